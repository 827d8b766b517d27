//! Bounded staleness (`--async --staleness S`): with S = 2 and worker 1 slowed down
//! (`DFLOW_STEP_DELAY_MS`), the chief's step counters show no worker ever more than 2 steps
//! ahead of the slowest, and the fast worker does reach the bound; `--staleness 0` trains
//! synchronously (the losses of one process). Real `dflow` processes on 127.0.0.1.

mod support;

use std::time::Duration;
use support::*;

const LIMIT: Duration = Duration::from_secs(120);

/// (steps, slowest_steps) of every `ssp: step done` line of the chief's log.
fn counters(stderr: &str) -> Vec<(u64, u64)> {
    let field = |line: &str, name: &str| -> Option<u64> {
        let at = line.find(&format!(" {name}="))? + name.len() + 2;
        line[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    stderr
        .lines()
        .filter(|l| l.contains("ssp: step done"))
        .filter_map(|l| Some((field(l, "steps")?, field(l, "slowest_steps")?)))
        .collect()
}

/// Digits on one ps and two workers, worker 1 sleeping `delay_ms` before each step; returns
/// the chief's losses and stderr.
fn job(extra: &[&str], delay_ms: u64) -> (Vec<(u64, f64)>, String) {
    let cluster = Cluster::new(1, 2);
    let losses = cluster.path("losses.txt");
    let losses_s = losses.to_string_lossy().into_owned();
    let mut common = digits_args(1);
    common.extend(extra.iter().map(|s| s.to_string()));
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let ps = Task::start(&cluster, "ps", 0, &[]);
    let delay = delay_ms.to_string();
    let slow = Task::start_with_env(
        &cluster,
        "worker",
        1,
        &common,
        &[("DFLOW_STEP_DELAY_MS", delay.as_str())],
    );
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common.iter().copied());
    chief_args.extend(["--losses-out", &losses_s]);
    let chief = Task::start_with_env(
        &cluster,
        "worker",
        0,
        &chief_args,
        &[("DFLOW_LOG", "warn,dflow_executor::cluster::chief=debug")],
    )
    .wait(LIMIT);
    chief.assert_success();
    for t in [ps, slow] {
        t.wait(Duration::from_secs(30)).assert_success();
    }
    (read_losses(&losses), chief.stderr.clone())
}

#[test]
fn no_worker_runs_more_than_s_steps_ahead_of_a_slowed_one() {
    let _serial = serial();
    let (losses, stderr) = job(&["--async", "--staleness", "2"], 40);
    let c = counters(&stderr);
    assert_eq!(
        c.len(),
        losses.len(),
        "one counter line per step:\n{stderr}"
    );
    let max_lead = c
        .iter()
        .map(|(mine, slowest)| mine - slowest)
        .max()
        .unwrap();
    assert!(
        max_lead <= 2,
        "a worker ran {max_lead} steps ahead:\n{stderr}"
    );
    // The slowed worker held the fast one back: the bound was reached.
    assert_eq!(max_lead, 2, "{c:?}");
    assert!(
        stderr.contains("staleness bound 2: a worker was at most 2 step(s) ahead"),
        "{stderr}"
    );
}

#[test]
fn staleness_zero_trains_synchronously() {
    let _serial = serial();
    let (losses, stderr) = job(&["--async", "--staleness", "0"], 5);
    assert!(counters(&stderr).is_empty(), "no async loop:\n{stderr}");
    let dir = tempfile::tempdir().unwrap();
    let (local, _) = local_digits_run(1, dir.path());
    // Two sync replicas sum their halves' gradients: the one-process losses to rounding.
    assert_same_losses(&losses, &local, 1e-5);
}
