//! `--strategy pipeline` through the command line: `--local` runs equal the one-process run
//! (`--losses-out` files), checkpoints written by a pipeline resume without one and the other
//! way round, `dflow partition` shows the plan and the timeline, and `--local` refuses
//! strategies that need several processes.

mod support;

use std::path::Path;
use support::*;

const CORPUS: &str = "examples/data/shakespeare.txt.gz";

fn gpt_run(graph: &Path, steps: &str, extra: &[&str]) -> std::process::Output {
    let graph = graph.to_string_lossy().into_owned();
    let mut args = vec![
        "run",
        "--local",
        &graph,
        "--data",
        CORPUS,
        "--batch-size",
        "8",
        "--steps",
        steps,
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--quiet",
    ];
    args.extend_from_slice(extra);
    dflow(&args)
}

const PIPELINE: [&str; 8] = [
    "--cluster",
    "examples/gpt/cluster-2workers.json",
    "--strategy",
    "pipeline",
    "--stages",
    "2",
    "--micro-batches",
    "4",
];

#[test]
fn a_local_pipeline_trains_the_digits_like_one_process() {
    let dir = scratch("pipeline-digits");
    let (one, two) = (dir.join("one.txt"), dir.join("two.txt"));
    let common = [
        "run",
        "--local",
        "examples/digits/digits.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1",
        "--quiet",
        "--losses-out",
    ];
    let mut plain = common.to_vec();
    plain.push(one.to_str().unwrap());
    stdout(&dflow(&plain));
    let mut piped = common.to_vec();
    piped.push(two.to_str().unwrap());
    piped.extend([
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--micro-batches",
        "8",
        "--schedule",
        "gpipe",
    ]);
    let out = dflow(&piped);
    let text = stdout(&out);
    assert!(text.contains("held-out accuracy"), "{text}");
    let (a, b) = (read_losses(&one), read_losses(&two));
    // The pipeline drops the epoch's last partial batch (44 full batches of 32).
    assert_eq!(a.len(), 45);
    assert_eq!(b.len(), 44);
    assert_same_losses(&b, &a[..44], 1e-6);
}

#[test]
fn gpt_checkpoints_move_between_a_pipeline_and_one_process() {
    let dir = scratch("pipeline-gpt");
    let graph = small_gpt(&dir, 2);
    // The reference: 6 steps in one process.
    let straight = dir.join("straight.txt");
    stdout(&gpt_run(
        &graph,
        "6",
        &["--losses-out", straight.to_str().unwrap()],
    ));
    let straight = read_losses(&straight);

    // 3 steps on a 2-stage pipeline, checkpointed; then 3 more in one process from it.
    let ckpt = dir.join("ckpt");
    let first = dir.join("first.txt");
    let mut args: Vec<&str> = PIPELINE.to_vec();
    args.extend([
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--losses-out",
        first.to_str().unwrap(),
    ]);
    stdout(&gpt_run(&graph, "3", &args));
    let rest = dir.join("rest.txt");
    stdout(&gpt_run(
        &graph,
        "6",
        &[
            "--checkpoint-dir",
            ckpt.to_str().unwrap(),
            "--losses-out",
            rest.to_str().unwrap(),
        ],
    ));
    let mut resumed = read_losses(&first);
    resumed.extend(read_losses(&rest));
    assert_eq!(
        resumed.iter().map(|l| l.0).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5, 6]
    );
    assert_same_losses(&resumed, &straight, 1e-5);

    // And back: 6 steps on the pipeline from the one-process checkpoint at step 6 → 8 steps.
    let more = dir.join("more.txt");
    let mut args: Vec<&str> = PIPELINE.to_vec();
    args.extend([
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
        "--losses-out",
        more.to_str().unwrap(),
    ]);
    stdout(&gpt_run(&graph, "8", &args));
    let reference = dir.join("reference.txt");
    stdout(&gpt_run(
        &graph,
        "8",
        &["--losses-out", reference.to_str().unwrap()],
    ));
    let more = read_losses(&more);
    assert_eq!(more.iter().map(|l| l.0).collect::<Vec<_>>(), [7, 8]);
    assert_same_losses(&more, &read_losses(&reference)[6..], 1e-5);
}

#[test]
fn partition_shows_the_pipeline_and_draws_its_timeline() {
    let dir = scratch("pipeline-partition");
    let svg = dir.join("t.svg");
    let out = dflow(&[
        "partition",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--micro-batches",
        "4",
        "--batch-size",
        "32",
        "--timeline",
        svg.to_str().unwrap(),
    ]);
    let text = stdout(&out);
    assert!(
        text.contains("pipeline: 2 stages × 1 chunk(s), 4 micro-batches, 1f1b schedule"),
        "{text}"
    );
    assert!(
        text.contains("bytes between tasks per step: 8192"),
        "{text}"
    );
    assert!(text.contains("idle 3/15 ticks"), "{text}");
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert_eq!(picture.matches("<rect").count(), 16);
}

#[test]
fn bad_pipelines_are_refused() {
    let out = dflow(&[
        "run",
        "--local",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--micro-batches",
        "5",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("batch 32 does not split into 5 micro-batches"),
        "{err}"
    );
}

#[test]
fn a_mesh_runs_what_it_names_and_refuses_what_does_not_run() {
    let run = |mesh: &str, extra: &[&str]| {
        let mut args = vec![
            "run",
            "--local",
            "examples/digits/digits.json",
            "--cluster",
            "examples/digits/cluster-allreduce.json",
            "--data",
            "examples/data/digits.csv.gz",
            "--epochs",
            "1",
            "--quiet",
            "--mesh",
            mesh,
        ];
        args.extend_from_slice(extra);
        dflow(&args)
    };
    // pp=2 on the 2 workers: the pipeline, in one process.
    let text = stdout(&run("pp=2", &["--micro-batches", "2"]));
    assert!(text.contains("held-out accuracy"), "{text}");
    let err = |o: std::process::Output| {
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = err(run("dp=2,pp=2", &[]));
    assert!(
        e.contains("--mesh dp=2,tp=1,pp=2") && e.contains("4"),
        "{e}"
    );
    // tp=2 runs tensor parallelism, which rewrites the GPT only: the digits MLP is refused.
    let e = err(run("tp=2", &[]));
    assert!(
        e.contains("strategy `tensor`") && e.contains("transformer.wte.weight"),
        "{e}"
    );
    // Tensor parallelism inside pipeline stages runs (cluster_mesh.rs), on tp·pp workers.
    let e = err(run("tp=2,pp=2", &[]));
    assert!(
        e.contains("--mesh dp=1,tp=2,pp=2") && e.contains("has 4 ranks but the job has 2 tasks"),
        "{e}"
    );
    let e = err(run("tp=2", &["--tp", "4"]));
    assert!(e.contains("--mesh tp=2 but --tp 4"), "{e}");
    let e = err(run("pp=2", &["--strategy", "allreduce"]));
    assert!(
        e.contains("runs --strategy pipeline, not --strategy allreduce"),
        "{e}"
    );
    let e = err(run("pp=2", &["--stages", "3"]));
    assert!(e.contains("--mesh pp=2 but --stages 3"), "{e}");
}

#[test]
fn trace_pipeline_refuses_what_is_no_pipeline_trace_naming_the_file() {
    let dir = scratch("pipeline-trace-errors");
    let not_json = dir.join("not.json");
    std::fs::write(&not_json, "{ nope").unwrap();
    let no_events = dir.join("empty.json");
    std::fs::write(&no_events, r#"{"displayTimeUnit": "ms"}"#).unwrap();
    let no_pipeline = dir.join("plain.json");
    std::fs::write(
        &no_pipeline,
        r#"{"traceEvents": [{"name": "x", "ph": "X", "ts": 1.0, "dur": 2.0, "pid": 1, "args": {"step": 1}}]}"#,
    )
    .unwrap();
    for (file, says) in [
        (&not_json, "not JSON"),
        (&no_events, "no `traceEvents` array"),
        (&no_pipeline, "no pipeline training step"),
    ] {
        let out = dflow(&["trace", "pipeline", file.to_str().unwrap()]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(says) && err.contains(file.to_str().unwrap()),
            "{err}"
        );
    }
}
