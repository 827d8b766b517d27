//! A task killed mid-training: every other task exits non-zero within the timeout naming the
//! dead task, and restarting the job resumes from the last checkpoint.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};
use support::*;

/// Per-step timeout given to every task; the failure must be seen well within it plus margin.
const TIMEOUT_S: &str = "5";
const EXIT_LIMIT: Duration = Duration::from_secs(20);

fn newest_checkpoint_step(dir: &Path) -> Option<u64> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix("ckpt-")?
                .strip_suffix(".safetensors")?
                .parse()
                .ok()
        })
        .max()
}

/// Starts ps, worker 1 and the chief training "forever" with checkpoints every 20 steps (with
/// `extra` flags on the workers), and waits for the first checkpoint.
fn start_long_job(cluster: &Cluster, ckpt: &Path, extra: &[&str]) -> (Task, Task, Task) {
    let mut args = vec![
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1000",
        "--quiet",
        "--timeout",
        TIMEOUT_S,
    ];
    args.extend(extra);
    let ps = Task::start(cluster, "ps", 0, &["--timeout", TIMEOUT_S]);
    let worker1 = Task::start(cluster, "worker", 1, &args);
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(&args);
    chief_args.extend(["--checkpoint-dir", &ckpt_s, "--save-every", "20"]);
    let chief = Task::start(cluster, "worker", 0, &chief_args);
    chief.wait_until(Duration::from_secs(120), "a checkpoint", || {
        newest_checkpoint_step(ckpt).is_some()
    });
    (ps, worker1, chief)
}

#[test]
fn killing_the_ps_ends_every_task_naming_it_and_a_restart_resumes_from_the_checkpoint() {
    let _serial = serial();
    let cluster = Cluster::new(1, 2);
    let ckpt = cluster.path("ckpt");
    let (ps, worker1, chief) = start_long_job(&cluster, &ckpt, &[]);
    ps.kill();
    let dead = "/job:ps/replica:0/task:0";
    let started = Instant::now();
    let chief = chief.wait(EXIT_LIMIT);
    let worker1 = worker1.wait(EXIT_LIMIT);
    eprintln!("both exited {:?} after the kill", started.elapsed());
    chief.assert_failure_naming(dead);
    worker1.assert_failure_naming(dead);

    // Restart the whole job: it resumes at the newest checkpoint and trains to the end.
    let step = newest_checkpoint_step(&ckpt).unwrap();
    let steps_per_epoch = 45; // 1438 training examples in batches of 32
    let epochs = (step / steps_per_epoch + 2).to_string();
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let common = [
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        &epochs,
        "--quiet",
    ];
    let ps = Task::start(&cluster, "ps", 0, &[]);
    let worker1 = Task::start(&cluster, "worker", 1, &common);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common);
    chief_args.extend(["--checkpoint-dir", &ckpt_s]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args);
    let chief = chief.wait(Duration::from_secs(120));
    chief.assert_success();
    assert!(
        chief
            .stderr
            .contains(&format!("resumed from the checkpoint at step {step}")),
        "{}",
        chief.stderr
    );
    let final_step = newest_checkpoint_step(&ckpt).unwrap();
    assert_eq!(final_step, steps_per_epoch * (step / steps_per_epoch + 2));
    worker1.wait(EXIT_LIMIT).assert_success();
    ps.wait(EXIT_LIMIT).assert_success();
}

#[test]
fn killing_a_non_chief_worker_ends_every_task_naming_it() {
    let _serial = serial();
    let cluster = Cluster::new(1, 2);
    let ckpt = cluster.path("ckpt");
    let (ps, worker1, chief) = start_long_job(&cluster, &ckpt, &[]);
    worker1.kill();
    let dead = "/job:worker/replica:0/task:1";
    let chief = chief.wait(EXIT_LIMIT);
    let ps = ps.wait(EXIT_LIMIT);
    chief.assert_failure_naming(dead);
    ps.assert_failure_naming(dead);
}

#[test]
fn killing_a_worker_of_an_async_job_ends_every_task_naming_it() {
    // The async schedule's worker lanes: the dead worker's lane fails, the others are stopped,
    // and the driver ends the job naming the worker, rather than waiting for its steps.
    let _serial = serial();
    let cluster = Cluster::new(1, 2);
    let ckpt = cluster.path("ckpt");
    let (ps, worker1, chief) = start_long_job(&cluster, &ckpt, &["--async"]);
    worker1.kill();
    let dead = "/job:worker/replica:0/task:1";
    let chief = chief.wait(EXIT_LIMIT);
    let ps = ps.wait(EXIT_LIMIT);
    chief.assert_failure_naming(dead);
    ps.assert_failure_naming(dead);
}
