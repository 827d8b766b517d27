//! Elastic jobs (`--min-workers K`), all-reduce and sync ps: a worker killed mid-job after a
//! checkpoint, and the job goes on on the survivors from that checkpoint with the same global
//! batch, so it trains like one process; a replacement worker started later joins before the
//! next step and the job goes on over three workers again, still like one process; with fewer
//! than K survivors every task fails naming the dead one. Real `dflow` processes on 127.0.0.1.
//!
//! To kill the worker mid-job whatever the machine's speed, the test freezes the chief
//! (SIGSTOP) as soon as the first checkpoint appears, kills the worker, and lets the chief go
//! on (SIGCONT): the step after the freeze is the one that fails. The replacement is started
//! while the chief is frozen again, right after its restart, so that it joins mid-job too.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use support::*;

const TIMEOUT_S: &str = "5";
const LIMIT: Duration = Duration::from_secs(120);
const EXIT_LIMIT: Duration = Duration::from_secs(30);

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

/// Sends `signal` (`STOP`, `CONT`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid}");
}

/// Waits (polling every millisecond, at most `limit`) for the first checkpoint in `dir`, then
/// freezes `chief`; returns the newest checkpoint's step once frozen.
fn freeze_after_first_checkpoint(chief: &Task, dir: &Path, limit: Duration) -> u64 {
    let start = Instant::now();
    while newest_checkpoint_step(dir).is_none() {
        assert!(
            start.elapsed() < limit,
            "no checkpoint within {limit:?}:\n{}",
            chief.stderr()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    signal(chief.pid(), "STOP");
    // A checkpoint being written when the chief froze may still be renamed into place.
    std::thread::sleep(Duration::from_millis(50));
    newest_checkpoint_step(dir).unwrap()
}

#[test]
fn a_worker_killed_mid_job_leaves_two_survivors_that_finish_like_one_process() {
    killed_mid_job("allreduce", 0);
}

#[test]
fn ps_a_worker_killed_mid_job_leaves_two_survivors_that_finish_like_one_process() {
    killed_mid_job("ps", 1);
}

/// Three workers (and `ps` ps tasks) train one digits epoch under `strategy` with
/// `--min-workers 2`; worker 2 is killed after the first checkpoint. The job runs on 3
/// workers up to the commit and on 2 after it, each step on the same global batch: its losses
/// and final parameters equal one process's within 1e-6.
fn killed_mid_job(strategy: &str, ps: usize) {
    let _serial = serial();
    let cluster = Cluster::new(ps, 3);
    let ckpt = cluster.path("ckpt");
    let losses = cluster.path("losses.txt");
    let (ckpt_s, losses_s) = (
        ckpt.to_string_lossy().into_owned(),
        losses.to_string_lossy().into_owned(),
    );
    let mut common: Vec<String> = digits_args(1);
    common.extend(["--strategy", strategy, "--timeout", TIMEOUT_S].map(String::from));
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let ps_tasks: Vec<Task> = (0..ps)
        .map(|i| Task::start(&cluster, "ps", i, &common))
        .collect();
    let worker1 = Task::start(&cluster, "worker", 1, &common);
    let worker2 = Task::start(&cluster, "worker", 2, &common);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common.iter().copied());
    chief_args.extend([
        "--min-workers",
        "2",
        "--checkpoint-dir",
        &ckpt_s,
        "--save-every",
        "5",
        "--losses-out",
        &losses_s,
    ]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args);
    let committed = freeze_after_first_checkpoint(&chief, &ckpt, LIMIT);
    assert!(
        committed < 45,
        "the job should still be running when frozen (checkpoint at step {committed})"
    );
    worker2.kill();
    signal(chief.pid(), "CONT");

    let chief = chief.wait(LIMIT);
    chief.assert_success();
    let dead = "/job:worker/replica:0/task:2";
    assert!(
        chief.stderr.contains(&format!(
            "elastic restart 1: worker {dead} is gone"
        )) && chief.stderr.contains(
            "going on with 2 workers [/job:worker/replica:0/task:0, /job:worker/replica:0/task:1]"
        ),
        "the chief should log the restart and the new membership:\n{}",
        chief.stderr
    );
    worker1.wait(EXIT_LIMIT).assert_success();
    for t in ps_tasks {
        t.wait(EXIT_LIMIT).assert_success();
    }
    assert_eq!(
        newest_checkpoint_step(&ckpt),
        Some(45),
        "the job ran to its end"
    );

    // The restart resumes from the newest checkpoint: the one seen when the chief froze, or
    // one the chief was writing then.
    let resumed: u64 = chief
        .stderr
        .lines()
        .find_map(|l| l.split("from the checkpoint at step ").nth(1))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no restart checkpoint in:\n{}", chief.stderr));
    assert!(
        resumed >= committed && resumed < 45 && resumed % 5 == 0,
        "resumed from step {resumed}, frozen at {committed}"
    );

    // 3 workers up to the commit, 2 after it, each step on the same global batch: the same
    // training as one process, to rounding: the losses and the final parameters.
    let job = read_losses(&losses);
    let local_dir = cluster.path("local");
    let local = local_run(&local_dir, 1);
    assert_eq!(
        job.len(),
        45,
        "one loss per step, the re-run steps counted once"
    );
    let worst = assert_same_losses(&job, &local, 1e-6);
    let worst_param = assert_same_parameters(&ckpt, &local_dir.join("ckpt"), 45, 1e-6);
    eprintln!(
        "{strategy}: committed at step {committed}; worst relative difference: losses {worst:e}, parameters {worst_param:e}"
    );
}

/// `dflow run --local` of `epochs` digits epochs with its final checkpoint in `dir/ckpt`;
/// returns its losses.
fn local_run(dir: &Path, epochs: u32) -> Vec<(u64, f64)> {
    std::fs::create_dir_all(dir).unwrap();
    let losses = dir.join("losses.txt");
    let mut args: Vec<String> = vec![
        "run".into(),
        "--local".into(),
        "examples/digits/digits.json".into(),
    ];
    args.extend(digits_args(epochs));
    args.extend([
        "--checkpoint-dir".to_string(),
        dir.join("ckpt").to_string_lossy().into_owned(),
        "--losses-out".to_string(),
        losses.to_string_lossy().into_owned(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = dflow(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    read_losses(&losses)
}

/// Asserts the checkpoints of `step` in `a` and `b` hold the same tensors, equal within `tol`
/// (relative to the largest magnitude of each tensor); returns the worst difference.
fn assert_same_parameters(a: &Path, b: &Path, step: u64, tol: f64) -> f64 {
    use dflow::executor::checkpoint::{checkpoint_path, load};
    let a = load(&checkpoint_path(a, step)).unwrap().tensors;
    let b = load(&checkpoint_path(b, step)).unwrap().tensors;
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same variables"
    );
    let mut worst = 0.0f64;
    for (name, ta) in &a {
        let (va, vb) = (ta.to_f64_vec(), b[name].to_f64_vec());
        assert_eq!(va.len(), vb.len(), "{name}");
        let scale = vb.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
        for (x, y) in va.iter().zip(&vb) {
            let err = (x - y).abs() / scale;
            worst = worst.max(err);
            assert!(err <= tol, "{name}: elastic job {x}, one process {y}");
        }
    }
    worst
}

#[test]
fn a_worker_killed_before_the_first_checkpoint_restarts_from_the_initial_state() {
    let _serial = serial();
    let cluster = Cluster::new(0, 3);
    let ckpt = cluster.path("ckpt");
    let losses = cluster.path("losses.txt");
    let (ckpt_s, losses_s) = (
        ckpt.to_string_lossy().into_owned(),
        losses.to_string_lossy().into_owned(),
    );
    let mut common: Vec<String> = digits_args(1);
    common.extend(["--strategy", "allreduce", "--timeout", TIMEOUT_S].map(String::from));
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let worker1 = Task::start(&cluster, "worker", 1, &common);
    let worker2 = Task::start(&cluster, "worker", 2, &common);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common.iter().copied());
    // No checkpoint before the end (--save-every 0).
    chief_args.extend([
        "--min-workers",
        "2",
        "--checkpoint-dir",
        &ckpt_s,
        "--losses-out",
        &losses_s,
    ]);
    let env = [("DFLOW_LOG", "warn,dflow_executor::trainer=debug")];
    let chief = Task::start_with_env(&cluster, "worker", 0, &chief_args, &env);
    // Freeze the chief after its first step.
    let start = Instant::now();
    while !chief.stderr().contains("step driver: step done") {
        assert!(start.elapsed() < LIMIT, "no step:\n{}", chief.stderr());
        std::thread::sleep(Duration::from_millis(1));
    }
    signal(chief.pid(), "STOP");
    assert_eq!(newest_checkpoint_step(&ckpt), None, "no checkpoint yet");
    worker2.kill();
    signal(chief.pid(), "CONT");
    let chief = chief.wait(LIMIT);
    chief.assert_success();
    assert!(
        chief
            .stderr
            .contains("elastic restart 1: worker /job:worker/replica:0/task:2 is gone")
            && chief
                .stderr
                .contains("from the state before the first step"),
        "{}",
        chief.stderr
    );
    worker1.wait(EXIT_LIMIT).assert_success();
    let job = read_losses(&losses);
    let local_dir = cluster.path("local");
    let local = local_run(&local_dir, 1);
    assert_same_losses(&job, &local, 1e-6);
    assert_same_parameters(&ckpt, &local_dir.join("ckpt"), 45, 1e-6);
}

#[test]
fn fewer_survivors_than_min_workers_end_every_task_naming_the_dead_worker() {
    let _serial = serial();
    let cluster = Cluster::new(0, 3);
    let ckpt = cluster.path("ckpt");
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let mut common: Vec<String> = digits_args(1000);
    common.extend(["--strategy", "allreduce", "--timeout", TIMEOUT_S].map(String::from));
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let worker1 = Task::start(&cluster, "worker", 1, &common);
    let worker2 = Task::start(&cluster, "worker", 2, &common);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common.iter().copied());
    chief_args.extend([
        "--min-workers",
        "3",
        "--checkpoint-dir",
        &ckpt_s,
        "--save-every",
        "20",
    ]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args);
    chief.wait_until(LIMIT, "a checkpoint", || {
        newest_checkpoint_step(&ckpt).is_some()
    });
    worker2.kill();
    let dead = "/job:worker/replica:0/task:2";
    let started = Instant::now();
    let chief = chief.wait(EXIT_LIMIT);
    let worker1 = worker1.wait(EXIT_LIMIT);
    eprintln!("both exited {:?} after the kill", started.elapsed());
    chief.assert_failure_naming(dead);
    chief.assert_failure_naming("2 workers remain, fewer than --min-workers 3");
    worker1.assert_failure_naming(dead);
}

#[test]
fn min_workers_is_refused_with_async_ps_or_without_a_checkpoint_dir() {
    let _serial = serial();
    let cluster = Cluster::new(1, 1);
    let ckpt = cluster.path("ckpt");
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let mut args = vec!["examples/digits/digits.json"];
    let data = digits_args(1);
    args.extend(data.iter().map(String::as_str));
    let mut ps = args.clone();
    ps.extend([
        "--strategy",
        "ps",
        "--async",
        "--min-workers",
        "1",
        "--checkpoint-dir",
        &ckpt_s,
    ]);
    let ended = Task::start(&cluster, "worker", 0, &ps).wait(EXIT_LIMIT);
    ended.assert_failure_naming(
        "--min-workers 1 needs --strategy allreduce or a sync --strategy ps",
    );
    ended.assert_failure_naming("this job uses ps --async");
    let mut no_dir = args.clone();
    no_dir.extend(["--strategy", "allreduce", "--min-workers", "1"]);
    let ended = Task::start(&cluster, "worker", 0, &no_dir).wait(EXIT_LIMIT);
    ended.assert_failure_naming("--min-workers 1 needs --checkpoint-dir");
}

/// Waits (polling every millisecond, at most `limit`) until `chief`'s stderr holds `text`
/// followed by `steps` steps done (the step driver's debug lines), then freezes it.
fn freeze_after_steps_since(chief: &Task, text: &str, steps: usize, limit: Duration) {
    let start = Instant::now();
    loop {
        let stderr = chief.stderr();
        let done = stderr
            .split_once(text)
            .is_some_and(|(_, after)| after.matches("step driver: step done").count() >= steps);
        if done {
            break;
        }
        assert!(
            start.elapsed() < limit,
            "`{text}` and {steps} steps not logged within {limit:?}:\n{stderr}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    signal(chief.pid(), "STOP");
}

/// The step of the checkpoint the restart logged by `line_start` went on from.
fn restart_step(stderr: &str, line_start: &str) -> u64 {
    stderr
        .lines()
        .filter(|l| l.starts_with(line_start))
        .find_map(|l| l.split("from the checkpoint at step ").nth(1))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `{line_start}` from a checkpoint in:\n{stderr}"))
}

/// Three workers (and `ps` ps tasks) train two digits epochs (90 steps) under `strategy`
/// with `--min-workers 2`; worker 2 is killed after the first checkpoint, and a replacement
/// (`dflow run --job worker --index 2`, the same task of the ClusterSpec) is started once
/// the job went on without it. The job runs on 3 workers up to the commit, on 2 after it,
/// and on 3 again from the step the replacement joined before: each step on the same global
/// batch, so its losses (those of the steps the joining worker took part in included) and
/// final parameters equal one process's within 1e-6.
fn killed_then_replaced(strategy: &str, ps: usize) {
    let _serial = serial();
    let cluster = Cluster::new(ps, 3);
    let ckpt = cluster.path("ckpt");
    let losses = cluster.path("losses.txt");
    let (ckpt_s, losses_s) = (
        ckpt.to_string_lossy().into_owned(),
        losses.to_string_lossy().into_owned(),
    );
    // A longer timeout than the other tests: the chief is frozen while the replacement starts.
    let mut common: Vec<String> = digits_args(2);
    common.extend(["--strategy", strategy, "--timeout", "10"].map(String::from));
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let ps_tasks: Vec<Task> = (0..ps)
        .map(|i| Task::start(&cluster, "ps", i, &common))
        .collect();
    let worker1 = Task::start(&cluster, "worker", 1, &common);
    let worker2 = Task::start(&cluster, "worker", 2, &common);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common.iter().copied());
    chief_args.extend([
        "--min-workers",
        "2",
        "--checkpoint-dir",
        &ckpt_s,
        "--save-every",
        "5",
        "--losses-out",
        &losses_s,
    ]);
    let env = [("DFLOW_LOG", "warn,dflow_executor::trainer=debug")];
    let chief = Task::start_with_env(&cluster, "worker", 0, &chief_args, &env);
    let committed = freeze_after_first_checkpoint(&chief, &ckpt, LIMIT);
    assert!(committed < 70, "frozen at step {committed}: too late");
    worker2.kill();
    signal(chief.pid(), "CONT");

    // Once the job made 3 steps without it, worker 2 is started again, the chief frozen
    // meanwhile.
    freeze_after_steps_since(&chief, "elastic restart 1:", 3, LIMIT);
    let replacement = Task::start(&cluster, "worker", 2, &common);
    let frozen = Instant::now();
    replacement.wait_for_stderr(LIMIT, |s| s.contains("joined the job; serving the chief"));
    signal(chief.pid(), "CONT");
    eprintln!(
        "the chief was frozen {:?} while the replacement started",
        frozen.elapsed()
    );

    let chief = chief.wait(LIMIT);
    chief.assert_success();
    let w2 = "/job:worker/replica:0/task:2";
    let all = "[/job:worker/replica:0/task:0, /job:worker/replica:0/task:1";
    assert!(
        chief
            .stderr
            .contains(&format!("elastic restart 1: worker {w2} is gone"))
            && chief
                .stderr
                .contains(&format!("going on with 2 workers {all}"))
            && chief.stderr.contains(&format!(
                "elastic restart 2: {w2} joined; going on with 3 workers"
            ))
            && chief.stderr.contains(&format!("{all}, {w2}")),
        "the chief should log both restarts and the memberships:\n{}",
        chief.stderr
    );
    worker1.wait(EXIT_LIMIT).assert_success();
    let replacement = replacement.wait(EXIT_LIMIT);
    replacement.assert_success();
    for t in ps_tasks {
        t.wait(EXIT_LIMIT).assert_success();
    }
    let resumed = restart_step(&chief.stderr, "elastic restart 1:");
    let joined = restart_step(&chief.stderr, "elastic restart 2:");
    assert!(
        resumed >= committed && resumed % 5 == 0 && joined >= resumed + 3 && joined < 90,
        "resumed from step {resumed} (frozen at {committed}), joined at step {joined}"
    );
    assert_eq!(
        newest_checkpoint_step(&ckpt),
        Some(90),
        "the job ran to its end"
    );

    let job = read_losses(&losses);
    assert_eq!(
        job.len(),
        90,
        "one loss per step, the re-run steps counted once"
    );
    let local_dir = cluster.path("local");
    let local = local_run(&local_dir, 2);
    let worst = assert_same_losses(&job, &local, 1e-6);
    // The steps the joining worker took part in.
    let after: Vec<(u64, f64)> = job.iter().copied().filter(|&(s, _)| s > joined).collect();
    assert!(!after.is_empty(), "steps ran after the join");
    let local_after: Vec<(u64, f64)> = local.iter().copied().filter(|&(s, _)| s > joined).collect();
    assert_same_losses(&after, &local_after, 1e-6);
    let worst_param = assert_same_parameters(&ckpt, &local_dir.join("ckpt"), 90, 1e-6);
    eprintln!(
        "{strategy}: committed at step {committed}, resumed from {resumed}, joined before step {joined}; worst relative difference: losses {worst:e}, parameters {worst_param:e}"
    );
}

#[test]
fn ps_a_worker_killed_then_replaced_trains_like_one_process() {
    killed_then_replaced("ps", 1);
}

#[test]
fn allreduce_a_worker_killed_then_replaced_trains_like_one_process() {
    killed_then_replaced("allreduce", 0);
}

#[test]
fn ps_fewer_survivors_than_min_workers_end_every_task_naming_the_dead_worker() {
    let _serial = serial();
    let cluster = Cluster::new(1, 3);
    let ckpt = cluster.path("ckpt");
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let mut common: Vec<String> = digits_args(1000);
    common.extend(["--strategy", "ps", "--timeout", TIMEOUT_S].map(String::from));
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let ps = Task::start(&cluster, "ps", 0, &common);
    let worker1 = Task::start(&cluster, "worker", 1, &common);
    let worker2 = Task::start(&cluster, "worker", 2, &common);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common.iter().copied());
    chief_args.extend([
        "--min-workers",
        "3",
        "--checkpoint-dir",
        &ckpt_s,
        "--save-every",
        "20",
    ]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args);
    chief.wait_until(LIMIT, "a checkpoint", || {
        newest_checkpoint_step(&ckpt).is_some()
    });
    worker2.kill();
    let dead = "/job:worker/replica:0/task:2";
    let started = Instant::now();
    let chief = chief.wait(EXIT_LIMIT);
    let worker1 = worker1.wait(EXIT_LIMIT);
    let ps = ps.wait(EXIT_LIMIT);
    eprintln!("every task exited {:?} after the kill", started.elapsed());
    chief.assert_failure_naming(dead);
    chief.assert_failure_naming("2 workers remain, fewer than --min-workers 3");
    worker1.assert_failure_naming(dead);
    ps.assert_failure_naming(dead);
}
