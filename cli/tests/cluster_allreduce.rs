//! All-reduce data parallelism with real `dflow` processes: workers only, no ps.

mod support;

use std::time::Duration;
use support::*;

const LIMIT: Duration = Duration::from_secs(240);

/// Trains digits on `workers` workers with `--strategy allreduce` and checks it against the
/// one-process run with the same global batch: same losses (1e-5), same accuracy.
fn allreduce_equals_one_process(workers: usize, epochs: u32, fusion_mb: &str) {
    allreduce_over(workers, epochs, fusion_mb, "tcp");
}

/// As [`allreduce_equals_one_process`], every task on `--transport transport`; returns the
/// tasks' stderr (with the executor's info logs) and pids.
fn allreduce_over(
    workers: usize,
    epochs: u32,
    fusion_mb: &str,
    transport: &str,
) -> (String, Vec<u32>) {
    let _serial = serial();
    let cluster = Cluster::new(0, workers);
    let losses = cluster.path("losses.txt");
    let losses_s = losses.to_string_lossy().into_owned();
    let mut common: Vec<String> = digits_args(epochs);
    common.extend(["--strategy".into(), "allreduce".into()]);
    common.extend(["--transport".into(), transport.into()]);
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let env = [(
        "DFLOW_LOG",
        "warn,dflow_executor::cluster::collectives=info",
    )];
    let mut tasks = Vec::new();
    for i in 1..workers {
        tasks.push(Task::start_with_env(&cluster, "worker", i, &common, &env));
    }
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common.iter().copied());
    chief_args.extend([
        "--losses-out",
        &losses_s,
        "--fusion-threshold-mb",
        fusion_mb,
    ]);
    let chief = Task::start_with_env(&cluster, "worker", 0, &chief_args, &env);
    let mut pids = vec![chief.pid()];
    pids.extend(tasks.iter().map(|t| t.pid()));
    let chief = chief.wait(LIMIT);
    chief.assert_success();
    let mut logs = chief.stderr.clone();
    for t in tasks {
        let t = t.wait(Duration::from_secs(30));
        t.assert_success();
        logs.push_str(&t.stderr);
    }
    assert!(
        chief.stderr.contains("all-reduce data-parallel training"),
        "{}",
        chief.stderr
    );
    let (local, local_accuracy) = local_digits_run(epochs, cluster.dir.path());
    let worst = assert_same_losses(&read_losses(&losses), &local, 1e-5);
    eprintln!("{workers} workers: worst relative loss difference {worst:e}");
    let accuracy = chief.held_out("accuracy");
    assert!(
        (accuracy - local_accuracy).abs() <= 0.003,
        "accuracy {accuracy} vs one process {local_accuracy}"
    );
    if epochs >= 30 {
        assert!(accuracy >= 0.93, "held-out accuracy {accuracy}");
    }
    (logs, pids)
}

#[test]
fn two_workers_train_like_one_process_with_the_same_global_batch() {
    allreduce_equals_one_process(2, 30, "25");
}

#[test]
fn four_workers_with_one_bucket_per_gradient_train_like_one_process() {
    // A tiny fusion threshold: four buckets a step, chained in the same order on every rank.
    allreduce_equals_one_process(4, 5, "0.0001");
}

#[test]
fn workers_over_shared_memory_join_their_group_over_it_and_leave_nothing() {
    let (logs, pids) = allreduce_over(3, 3, "25", "shm");
    let joined = logs
        .lines()
        .filter(|l| l.contains("joined collective group") && l.contains("over shared memory"))
        .count();
    assert_eq!(
        joined, 3,
        "every rank's group runs over shared memory: {logs}"
    );
    let residue: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    pids.iter()
                        .any(|p| n.starts_with(&format!("dflow-shm-{p}-")))
                })
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(residue, Vec::<String>::new());
}

#[test]
fn a_killed_worker_ends_the_all_reduce_job_naming_it() {
    let _serial = serial();
    let cluster = Cluster::new(0, 3);
    let mut common: Vec<String> = digits_args(1000);
    common.extend(
        ["--strategy", "allreduce", "--timeout", "5"]
            .iter()
            .map(|s| s.to_string()),
    );
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let w1 = Task::start(&cluster, "worker", 1, &common);
    let w2 = Task::start(&cluster, "worker", 2, &common);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common.iter().copied());
    let chief = Task::start(&cluster, "worker", 0, &chief_args);
    chief.wait_for_stderr(Duration::from_secs(60), |s| s.contains("epoch 1/1000"));
    w2.kill();
    let dead = "/job:worker/replica:0/task:2";
    let limit = Duration::from_secs(20);
    chief.wait(limit).assert_failure_naming(dead);
    w1.wait(limit).assert_failure_naming(dead);
}
