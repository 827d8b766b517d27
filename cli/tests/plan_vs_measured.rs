//! `dflow plan`'s predicted bytes per step against what the tasks of a real job sent, from the
//! transport's counters (each task prints `sent N B in K values over the data plane, M B in J
//! collective messages` when it ends): equal exactly, for data parallelism (collective payload
//! per rank) and for a pipeline (Send/Recv payload between stages). The jobs run with no
//! held-out split, so every counted byte is training.

mod support;

use dflow::partitioner::planner::{self, ClusterProfile, Layout, ModelProfile, PlanOptions};
use std::process::Command;
use std::time::Duration;
use support::*;

/// `(task, data-plane bytes, collective bytes)` of every `sent` line in `stderr`.
fn traffic(stderr: &str) -> Vec<(String, u64, u64)> {
    end_of_task(stderr)
        .into_iter()
        .map(|e| (e.task, e.data_plane, e.collective))
        .collect()
}

/// The planner's evaluation of `layout` for the digits MLP on this machine's preset.
fn predicted(layout: &str, devices: usize) -> planner::Evaluation {
    let text = std::fs::read_to_string(repo().join("examples/digits/digits.json")).unwrap();
    let parsed = dflow::graph::format::parse_json(&text, None).unwrap();
    let model = ModelProfile::new(&parsed.def, "pixels", "labels").unwrap();
    let profile = ClusterProfile::preset("this-machine").unwrap();
    let options = PlanOptions {
        devices,
        batch_size: 32,
    };
    let layout: Layout = layout.parse().unwrap();
    planner::evaluate_layout(&model, &profile, &options, &layout).unwrap()
}

const TRAIN_ONLY: [&str; 7] = [
    "--data",
    "examples/data/digits.csv.gz",
    "--epochs",
    "1",
    "--test-fraction",
    "0",
    "--quiet",
];

#[test]
fn data_parallel_bytes_per_rank_equal_the_prediction() {
    let dir = scratch("plan_vs_measured_dp");
    let losses = dir.join("losses.txt");
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args([
            "run",
            "--local",
            "examples/digits/digits.json",
            "--cluster",
            "examples/digits/cluster-allreduce.json",
            "--strategy",
            "allreduce",
            "--losses-out",
        ])
        .arg(&losses)
        .args(TRAIN_ONLY)
        .current_dir(repo())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let steps = read_losses(&losses).len() as u64;
    assert!(steps > 10, "{stderr}");
    let e = predicted("dp=2", 2);
    let whole = e.traffic.data_parallel.intra_bytes + e.traffic.data_parallel.inter_bytes;
    let per_rank = whole / 2.0;
    assert_eq!(per_rank.fract(), 0.0, "{per_rank}");
    let sent = traffic(&stderr);
    assert_eq!(sent.len(), 2, "{stderr}");
    for (task, data, coll) in sent {
        assert_eq!(
            data, 0,
            "{task}: no Send/Recv between workers under all-reduce"
        );
        assert_eq!(
            coll,
            per_rank as u64 * steps,
            "{task}: {coll} B in {steps} steps, predicted {per_rank} B per step"
        );
    }
}

#[test]
fn pipeline_bytes_between_stages_equal_the_prediction() {
    let cluster = Cluster::new(0, 2);
    let losses = cluster.path("losses.txt");
    let mut chief_args = vec![
        "examples/digits/digits.json",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--micro-batches",
        "4",
        "--losses-out",
        losses.to_str().unwrap(),
    ];
    chief_args.extend(TRAIN_ONLY);
    let chief = Task::start(&cluster, "worker", 0, &chief_args);
    let other = Task::start(&cluster, "worker", 1, &[]);
    let limit = Duration::from_secs(120);
    let (chief, other) = (chief.wait(limit), other.wait(limit));
    assert!(chief.status.success(), "{}", chief.stderr);
    assert!(other.status.success(), "{}", other.stderr);
    let steps = read_losses(&losses).len() as u64;
    assert!(steps > 10);
    let e = predicted("pp=2,m=4", 2);
    assert_eq!(e.pipeline_bytes.fract(), 0.0);
    let mut total = 0;
    for stderr in [&chief.stderr, &other.stderr] {
        let sent = traffic(stderr);
        assert_eq!(sent.len(), 1, "{stderr}");
        let (task, data, coll) = &sent[0];
        assert_eq!(
            *coll, 0,
            "{task}: a pipeline of one replica has no collectives"
        );
        total += data;
    }
    assert_eq!(
        total,
        e.pipeline_bytes as u64 * steps,
        "{total} B in {steps} steps, predicted {} B per step",
        e.pipeline_bytes
    );
}
