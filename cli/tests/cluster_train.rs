//! Parameter-server training with real `dflow` processes: 1 ps + 2 workers on 127.0.0.1.

mod support;

use std::process::Command;
use std::time::Duration;
use support::*;

const LIMIT: Duration = Duration::from_secs(240);

fn start_job(cluster: &Cluster, mode: &str, epochs: u32, chief_extra: &[&str]) -> Vec<Task> {
    // The ps learns its task from TF_CONFIG, as under the Kubernetes TFJob operator.
    let ps = Task::start_tf_config(cluster, "ps", 0, &[]);
    let args = digits_args(epochs);
    let mut w1: Vec<&str> = args.iter().map(String::as_str).collect();
    w1.push(mode);
    let worker1 = Task::start(cluster, "worker", 1, &w1);
    let mut chief: Vec<&str> = vec!["examples/digits/digits.json"];
    chief.extend(w1.iter().copied());
    chief.extend(chief_extra);
    let chief = Task::start(cluster, "worker", 0, &chief);
    vec![chief, worker1, ps]
}

#[test]
fn sync_training_on_two_workers_equals_the_single_process_run_with_the_same_global_batch() {
    let _serial = serial();
    let cluster = Cluster::new(1, 2);
    let losses = cluster.path("losses.txt");
    let losses_arg = losses.to_string_lossy().into_owned();
    let tasks = start_job(&cluster, "--sync", 30, &["--losses-out", &losses_arg]);
    let ended: Vec<Ended> = tasks.into_iter().map(|t| t.wait(LIMIT)).collect();
    for e in &ended {
        e.assert_success();
    }
    let chief = &ended[0];
    let accuracy = chief.held_out("accuracy");
    assert!(accuracy >= 0.93, "held-out accuracy {accuracy}");

    // The same training in one process, same global batch.
    let local_losses = cluster.path("local.txt");
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args([
            "run",
            "--local",
            "examples/digits/digits.json",
            "--data",
            "examples/data/digits.csv.gz",
            "--epochs",
            "30",
            "--quiet",
            "--losses-out",
        ])
        .arg(&local_losses)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dist = read_losses(&losses);
    let local = read_losses(&local_losses);
    assert_eq!(dist.len(), local.len(), "same number of steps");
    assert!(dist.len() > 1000);
    let mut worst = 0.0f64;
    for ((s1, a), (s2, b)) in dist.iter().zip(&local) {
        assert_eq!(s1, s2);
        let err = (a - b).abs() / b.abs().max(1e-3);
        worst = worst.max(err);
        assert!(err <= 1e-5, "step {s1}: distributed loss {a}, local {b}");
    }
    eprintln!(
        "worst relative loss difference over {} steps: {worst:e}",
        dist.len()
    );
}

#[test]
fn async_training_on_two_workers_reaches_the_accuracy_and_reports_staleness() {
    let _serial = serial();
    let cluster = Cluster::new(1, 2);
    let tasks = start_job(&cluster, "--async", 30, &[]);
    let ended: Vec<Ended> = tasks.into_iter().map(|t| t.wait(LIMIT)).collect();
    for e in &ended {
        e.assert_success();
    }
    let chief = &ended[0];
    let accuracy = chief.held_out("accuracy");
    assert!(accuracy >= 0.93, "held-out accuracy {accuracy}");
    assert!(chief.stdout.contains("staleness: mean"), "{}", chief.stdout);
}

#[test]
fn workers_started_before_the_ps_wait_for_it_and_then_train() {
    let _serial = serial();
    let cluster = Cluster::new(1, 2);
    let args = digits_args(2);
    let w1: Vec<&str> = args.iter().map(String::as_str).collect();
    let worker1 = Task::start(&cluster, "worker", 1, &w1);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(w1.iter().copied());
    let chief = Task::start(&cluster, "worker", 0, &chief_args);
    // Both say whom they wait for before the ps exists.
    chief.wait_for_stderr(Duration::from_secs(30), |s| {
        s.contains("waiting for /job:ps/replica:0/task:0")
    });
    std::thread::sleep(Duration::from_millis(500));
    let ps = Task::start(&cluster, "ps", 0, &[]);
    for t in [chief, worker1, ps] {
        t.wait(LIMIT).assert_success();
    }
}

#[test]
fn a_task_whose_peers_never_come_fails_naming_them() {
    let _serial = serial();
    let cluster = Cluster::new(1, 2);
    let ps = Task::start(&cluster, "ps", 0, &["--startup-timeout", "2"]);
    let ended = ps.wait(Duration::from_secs(30));
    ended.assert_failure_naming("/job:worker/replica:0/task:0");
    ended.assert_failure_naming("/job:worker/replica:0/task:1");
}
