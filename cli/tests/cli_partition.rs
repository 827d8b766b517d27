//! `dflow partition`, driven through the real binary: the three output formats, `-o DIR`, a
//! TensorFlow GraphDef, and bad clusters / devices (a clear error, never a panic).

use std::process::{Command, Output};

mod support;
use support::{dflow, scratch, stdout};

/// Runs a command that must fail; returns its stderr after checking it is an error, not a panic.
fn failure(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "expected exit 1, stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(o.stdout.is_empty());
    err
}

const MLP: &str = "examples/mlp/mlp.json";
const MLP_CLUSTER: &str = "examples/mlp/cluster.json";
const PS: &str = "/job:ps/replica:0/task:0/device:CPU:0";
const WORKER: &str = "/job:worker/replica:0/task:0/device:CPU:0";

fn partition(extra: &[&str]) -> Output {
    let mut args = vec!["partition", MLP, "--cluster", MLP_CLUSTER];
    args.extend_from_slice(extra);
    dflow(&args)
}

#[test]
fn text_shows_devices_pairs_keys_and_bytes() {
    let out = stdout(&partition(&[]));
    assert!(out.contains(&format!("device {PS} (8 nodes, receives 0 bytes/step)")));
    assert!(out.contains(&format!(
        "device {WORKER} (18 nodes, receives 9640 bytes/step)"
    )));
    assert!(out.contains(&format!(
        "send/w1_0/to/worker_0 = Send(w1)  key={PS};{WORKER};w1:0  bytes=8192"
    )));
    assert!(out.contains(&format!(
        "recv/w1_0/from/ps_0 = Recv() f32[64, 32]  key={PS};{WORKER};w1:0  bytes=8192"
    )));
    assert!(out.contains("layer1/matmul = MatMul(x, recv/w1_0/from/ps_0)"));
    assert!(out.contains("pairs: 4 (4 data, 0 control, 0 client-terminated)"));
    // The default format is text, and the DSL file gives the same output.
    assert_eq!(out, stdout(&partition(&["--format", "text"])));
    let dsl = stdout(&dflow(&[
        "partition",
        "examples/mlp/mlp.dflow",
        "--cluster",
        MLP_CLUSTER,
    ]));
    assert_eq!(out, dsl);
}

#[test]
fn json_is_the_full_partition_set() {
    let out = stdout(&partition(&["--format", "json"]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["format"], "dflow-partitions");
    let devices: Vec<&str> = v["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["device"].as_str().unwrap())
        .collect();
    assert_eq!(devices, [PS, WORKER]);
    let pairs = v["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 4);
    assert!(pairs
        .iter()
        .any(|p| p["key"] == format!("{PS};{WORKER};w1:0").as_str()));
    assert_eq!(v["buffer_plan"]["slots"].as_array().unwrap().len(), 4);
    // Loadable by the library, and renders back to the same text.
    let back = dflow::partitioner::load_json(&out).unwrap();
    assert_eq!(dflow::partitioner::render_json(&back), out);
}

#[test]
fn dot_has_one_cluster_per_device_and_pair_edges() {
    let out = stdout(&partition(&["--format", "dot"]));
    assert!(out.starts_with("digraph partitions {"), "{out}");
    assert!(out.trim_end().ends_with('}'));
    assert_eq!(out.matches("subgraph cluster_").count(), 2, "{out}");
    assert!(out.contains("w1:0"), "{out}");
}

#[test]
fn dot_is_accepted_by_graphviz_when_installed() {
    let have_dot = Command::new("dot").arg("-V").output().is_ok();
    if !have_dot {
        println!("note: graphviz `dot` is not installed; skipping the DOT syntax check");
        return;
    }
    for (graph, cluster) in [
        (MLP, MLP_CLUSTER),
        (
            "examples/digits/digits.json",
            "examples/digits/cluster.json",
        ),
        (
            "examples/three_devices/towers.json",
            "examples/three_devices/cluster.json",
        ),
    ] {
        let dot_src = stdout(&dflow(&[
            "partition",
            graph,
            "--cluster",
            cluster,
            "--format",
            "dot",
        ]));
        let dir = scratch(&format!("dot-{}", graph.replace('/', "_")));
        let file = dir.join("p.dot");
        std::fs::write(&file, &dot_src).unwrap();
        let o = Command::new("dot")
            .arg("-Tsvg")
            .arg(&file)
            .arg("-o")
            .arg(dir.join("p.svg"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{graph}: dot failed: {err}");
        assert!(err.trim().is_empty(), "{graph}: dot warned: {err}");
    }
}

#[test]
fn out_dir_writes_one_file_per_device_and_a_summary() {
    for (format, ext) in [("text", "txt"), ("json", "json"), ("dot", "dot")] {
        let dir = scratch(&format!("partition-out-{format}"));
        let o = partition(&["--format", format, "-o", dir.to_str().unwrap()]);
        assert!(stdout(&o).is_empty());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("wrote 2 device files"), "{err}");
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                format!("job_ps_replica_0_task_0_device_CPU_0.{ext}"),
                format!("job_worker_replica_0_task_0_device_CPU_0.{ext}"),
                format!("summary.{ext}"),
            ],
            "{format}"
        );
        let summary = std::fs::read_to_string(dir.join(format!("summary.{ext}"))).unwrap();
        assert_eq!(summary, stdout(&partition(&["--format", format])));
        let worker = std::fs::read_to_string(
            dir.join(format!("job_worker_replica_0_task_0_device_CPU_0.{ext}")),
        )
        .unwrap();
        assert!(worker.contains("recv/w1_0/from/ps_0"), "{format}: {worker}");
        assert!(
            !worker.contains("send/w1_0/to/worker_0"),
            "{format}: {worker}"
        );
        if format == "json" {
            let v: serde_json::Value = serde_json::from_str(&worker).unwrap();
            assert!(v["nodes"].as_array().is_some_and(|n| n.len() == 18), "{v}");
        }
    }
}

#[test]
fn tf_graphdef_imports_and_partitions() {
    let out = stdout(&dflow(&[
        "partition",
        "tests/fixtures/tf/ps_mlp.graphdef.json",
        "--cluster",
        MLP_CLUSTER,
    ]));
    assert!(out.contains(&format!("device {PS} ")), "{out}");
    assert!(out.contains(&format!("device {WORKER} ")), "{out}");
    assert!(out.contains("devices: 2"), "{out}");
    assert!(out.contains(" = Send("), "{out}");
    assert!(out.contains(" = Recv() "), "{out}");
}

#[test]
fn training_graph_partitions_with_updates_on_ps() {
    let out = stdout(&dflow(&[
        "partition",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster.json",
    ]));
    let ps_block = out.split("\n\n").next().unwrap();
    assert!(ps_block.starts_with(&format!("device {PS}")));
    assert!(ps_block.contains("train/w1/update = ApplyGradientDescent(w1, recv/gradients/"));
}

#[test]
fn bad_cluster_files_are_clear_errors() {
    let dir = scratch("partition-bad-cluster");
    let cases: &[(&str, &str, &str)] = &[
        ("truncated.json", "{\"ps\": [", "EOF while parsing"),
        (
            "string.json",
            "{\"worker\": \"x\"}",
            "expected the tasks of job \"worker\"",
        ),
        ("empty.json", "{}", "cluster spec has no jobs"),
        (
            "port.json",
            "{\"worker\": [\"localhost\"]}",
            "is not host:port",
        ),
    ];
    for (name, text, want) in cases {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let err = failure(&dflow(&[
            "partition",
            MLP,
            "--cluster",
            path.to_str().unwrap(),
        ]));
        assert!(err.contains(path.to_str().unwrap()), "{name}: {err}");
        assert!(err.contains(want), "{name}: {err}");
        // The cause is told once, not once per error in the chain.
        assert_eq!(err.matches(want).count(), 1, "{name}: {err}");
    }
    let missing = dir.join("missing.json");
    let err = failure(&dflow(&[
        "partition",
        MLP,
        "--cluster",
        missing.to_str().unwrap(),
    ]));
    assert!(err.contains("cannot read cluster spec"), "{err}");
}

#[test]
fn unknown_device_or_job_is_a_clear_error() {
    let dir = scratch("partition-unknown-device");
    let no_ps = dir.join("no_ps.json");
    std::fs::write(&no_ps, "{\"worker\": [\"localhost:2223\"]}").unwrap();
    let err = failure(&dflow(&[
        "partition",
        MLP,
        "--cluster",
        no_ps.to_str().unwrap(),
    ]));
    assert!(err.contains("placement failed"), "{err}");
    assert!(err.contains("node `w1`"), "{err}");
    assert!(err.contains("no job \"ps\""), "{err}");

    let err = failure(&partition(&["--default-device", "not a device"]));
    assert!(err.contains("--default-device"), "{err}");

    let err = failure(&partition(&["--fetch", "nosuch"]));
    assert!(err.contains("no node named `nosuch`"), "{err}");

    let err = failure(&dflow(&[
        "partition",
        "examples/mlp/nosuch.json",
        "--cluster",
        MLP_CLUSTER,
    ]));
    assert!(err.contains("nosuch.json"), "{err}");
}

#[test]
fn strategy_prints_the_job_plan_that_runs() {
    let out = stdout(&dflow(&[
        "partition",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster-2workers.json",
        "--strategy",
        "ps",
    ]));
    assert!(
        out.starts_with("job plan: sync parameter-server training\n"),
        "{out}"
    );
    assert!(
        out.contains("buffer plan: 22 slot(s) between tasks"),
        "{out}"
    );
    assert!(out.contains(&format!(
        "slot   6       8192 B  from /job:ps/replica:0/task:0  {PS};{WORKER};w1:0"
    )));
    let out = stdout(&dflow(&[
        "partition",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--strategy",
        "allreduce",
        "--fusion-threshold-mb",
        "0.001",
    ]));
    assert!(
        out.contains(
            "collective group workers: /job:worker/replica:0/task:0, /job:worker/replica:0/task:1"
        ),
        "{out}"
    );
    assert!(out.contains("buffer plan: 0 slot(s)"), "{out}");
}

#[test]
fn strategy_help_lists_every_strategy_and_unknown_ones_are_refused() {
    let help = stdout(&dflow(&["partition", "--help"]));
    assert!(
        help.contains("ps:")
            && help.contains("allreduce:")
            && help.contains("pipeline:")
            && help.contains("zero:")
            && help.contains("expert:"),
        "{help}"
    );
    let o = partition(&["--strategy", "zigzag"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "a usage error: {err}");
    assert!(
        err.contains("'zigzag'")
            && err.contains("[possible values: ps, allreduce, pipeline, zero, expert, tensor]"),
        "{err}"
    );
    let err = failure(&partition(&["--strategy", "ps"]));
    assert!(err.contains("no `train` section"), "{err}");
    let err = failure(&dflow(&[
        "partition",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--strategy",
        "allreduce",
        "--async",
    ]));
    assert!(err.contains("synchronous"), "{err}");
}

#[test]
fn zero_plans_show_each_workers_slot_and_parameter_shards_and_refuse_sgd() {
    let zero = |graph: &str, stage: &str| {
        dflow(&[
            "partition",
            graph,
            "--cluster",
            "examples/digits/cluster-allreduce.json",
            "--strategy",
            "zero",
            "--zero-stage",
            stage,
        ])
    };
    let out = stdout(&zero("examples/digits/digits-adamw.json", "2"));
    assert!(out.contains("ZeRO stage 2 data-parallel training"), "{out}");
    assert!(
        out.contains("w1/adam_m/shard_1_of_2 f32[1024] on /job:worker/replica:0/task:1\n"),
        "{out}"
    );
    assert!(
        out.contains(
            "w1 f32[64, 32] on /job:worker/replica:0/task:0, /job:worker/replica:0/task:1"
        ),
        "{out}"
    );
    // Stage 3: the parameters are sharded too; no worker holds a whole `w1`. Worker 0
    // evaluates with each weight all-gathered before its use, worker 1 joining the gathers:
    // the evaluation runs on both, and no shard is sent point to point (only the zero-byte
    // control pair of worker 1's last gather).
    let out = stdout(&zero("examples/digits/digits-adamw.json", "3"));
    assert!(out.contains("ZeRO stage 3 data-parallel training"), "{out}");
    assert!(
        out.contains("w1/shard_1_of_2 f32[1024] on /job:worker/replica:0/task:1\n"),
        "{out}"
    );
    assert!(!out.contains("w1 f32[64, 32]"), "{out}");
    let eval = &out[out.find("(Eval)").expect("an evaluation signature")..];
    assert!(
        eval.contains("/job:worker/replica:0/task:1/device:CPU:0: "),
        "{out}"
    );
    assert!(
        !out.contains("4096 B  from /job:worker/replica:0/task:1"),
        "{out}"
    );
    assert!(
        out.contains("0 B  from /job:worker/replica:0/task:1") && out.contains("^eval/zero/"),
        "{out}"
    );
    let o = zero("examples/digits/digits-adamw.json", "4");
    assert_eq!(o.status.code(), Some(2), "a usage error");
    let err = failure(&zero("examples/digits/digits.json", "1"));
    assert!(err.contains("optimizer is sgd"), "{err}");
    let err = failure(&dflow(&[
        "partition",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--strategy",
        "allreduce",
        "--zero-stage",
        "2",
    ]));
    assert!(
        err.contains("--zero-stage 2 applies to --strategy zero (or tensor, pipeline or expert, over its dp axis), not --strategy allreduce"),
        "{err}"
    );
    // Micro-batches without pipeline stages would be ignored: refused, naming the strategy.
    let err = failure(&dflow(&[
        "partition",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--strategy",
        "allreduce",
        "--micro-batches",
        "4",
    ]));
    assert!(
        err.contains("--micro-batches 4") && err.contains("--strategy allreduce has none"),
        "{err}"
    );
}

#[test]
fn the_gpt_on_dp2_tp2_shows_its_data_parallel_groups_and_collectives_with_bytes() {
    // The tp section shows one replica on its 6 of 12 rows; the dp section lists rank 0's
    // collectives over its dp group: bucketed all-reduces, or ZeRO-2's reduce-scatters and
    // all-gathers, which send the same bytes over 2 ranks (the ring's (N−1)/N·V each way).
    let partition = |zero: Option<&str>| {
        let mut args = vec![
            "partition",
            "examples/gpt/gpt.json",
            "--cluster",
            "examples/gpt/cluster-4workers.json",
            "--mesh",
            "dp=2,tp=2",
            "--features",
            "idx",
            "--labels",
            "targets",
            "--batch-size",
            "12",
        ];
        if let Some(s) = zero {
            args.extend(["--zero-stage", s]);
        }
        stdout(&dflow(&args))
    };
    // The listed bytes, and the total the section states.
    let dp_bytes = |out: &str, op: &str| -> (usize, usize, usize) {
        let section = &out[out
            .find("data parallelism over tensor-parallel groups: dp=2 × tp=2")
            .unwrap_or_else(|| panic!("no dp section:\n{out}"))..];
        let mut listed = 0;
        let mut of_op = 0;
        for l in section
            .lines()
            .filter(|l| l.starts_with("  ") && l.ends_with(" B"))
        {
            if let Some(b) = l.rsplit(": ").next().and_then(|b| b.strip_suffix(" B")) {
                if let Ok(b) = b.parse::<usize>() {
                    listed += b;
                    if l.contains(&format!("({op} of ")) {
                        of_op += 1;
                    }
                }
            }
        }
        let total = section
            .lines()
            .find_map(|l| l.strip_prefix("bytes rank 0 sends over its dp group per step: "))
            .and_then(|l| l.split(' ').next())
            .and_then(|b| b.parse().ok())
            .unwrap_or_else(|| panic!("no total:\n{section}"));
        (listed, total, of_op)
    };
    let plain = partition(None);
    assert!(
        plain.contains("f32[6, 64, 128]"),
        "one replica's rows:\n{plain}"
    );
    assert!(plain.contains("dp group data_t0: ranks 0, 2"), "{plain}");
    assert!(plain.contains("tp group tensor_d1: ranks 2, 3"), "{plain}");
    let (listed, total, reduces) = dp_bytes(&plain, "all-reduce");
    assert_eq!(listed, total);
    assert!(reduces > 0, "{plain}");
    let zero2 = partition(Some("2"));
    let (listed2, total2, scatters) = dp_bytes(&zero2, "reduce-scatter");
    assert_eq!(listed2, total2);
    assert!(scatters > 0, "{zero2}");
    assert!(zero2.contains("(all-gather of "), "{zero2}");
    // Gradients: all-reduce V ⇒ V sent; reduce-scatter + all-gather ⇒ V/2 + V/2 (plus a few
    // scalars on each side: the loss, clipping's norms).
    let diff = total.abs_diff(total2);
    assert!(diff <= 64, "plain {total} B, ZeRO-2 {total2} B");
    assert!(total > 100_000, "{total}");
}
