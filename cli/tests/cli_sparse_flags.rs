//! The flags of sharded embeddings and bounded staleness refuse what they do not apply to,
//! saying why; `dflow partition --strategy ps` shows the sharded table's job plan.

mod support;

use support::*;

#[test]
fn partition_strategy_applies_to_the_ps_strategy_only() {
    let out = dflow(&[
        "partition",
        "examples/wordlm/wordlm.json",
        "--strategy",
        "allreduce",
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--partition-strategy",
        "mod",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("applies to --strategy ps"), "{err}");
    let out = dflow(&[
        "partition",
        "examples/wordlm/wordlm.json",
        "--strategy",
        "ps",
        "--cluster",
        "examples/wordlm/cluster-2ps.json",
        "--partition-strategy",
        "zigzag",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("use `mod` or `div`"), "{err}");
}

#[test]
fn the_ps_plan_shows_the_table_split_over_both_ps_tasks() {
    let out = dflow(&[
        "partition",
        "examples/wordlm/wordlm.json",
        "--strategy",
        "ps",
        "--cluster",
        "examples/wordlm/cluster-2ps.json",
        "--batch-size",
        "64",
        "--features",
        "context",
        "--partition-strategy",
        "div",
    ]);
    let plan = stdout(&out);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        plan.contains("emb/part_0 f32[10240, 32] on /job:ps/replica:0/task:0"),
        "{plan}"
    );
    assert!(
        plan.contains("emb/part_1 f32[10240, 32] on /job:ps/replica:0/task:1"),
        "{plan}"
    );
    // Rows travel in 192-row buffers (64 examples × 3 ids), never the table.
    assert!(plan.contains("1536 B"), "{plan}");
    assert!(!plan.contains("2621440 B"), "{plan}");
}

#[test]
fn staleness_needs_async() {
    let out = dflow(&[
        "run",
        "--local",
        "examples/digits/digits.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--staleness",
        "2",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--async"), "{err}");
}
