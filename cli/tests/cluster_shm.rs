//! Training over the shared-memory transport with real `dflow` processes (1 ps + 2 workers on
//! this host): the losses equal a TCP run's bit for bit, and a killed task leaves no segment
//! under /dev/shm.
#![cfg(target_os = "linux")]

mod support;

use std::path::Path;
use std::time::Duration;
use support::*;

const LIMIT: Duration = Duration::from_secs(240);

/// Segments under /dev/shm whose names carry one of `pids`.
fn shm_residue(pids: &[u32]) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            pids.iter()
                .any(|p| n.starts_with(&format!("dflow-shm-{p}-")))
        })
        .collect()
}

/// Runs the sync digits job over `transport`; returns the chief's losses file, the workers'
/// stderr (with the transport's info logs) and the tasks' pids once every task exited
/// successfully.
fn train(transport: &str, epochs: u32, dir: &Path) -> (String, String, Vec<u32>) {
    let cluster = Cluster::new(1, 2);
    let losses = dir.join(format!("{transport}-losses.txt"));
    let losses_arg = losses.to_string_lossy().into_owned();
    let args = digits_args(epochs);
    let mut common: Vec<&str> = args.iter().map(String::as_str).collect();
    common.extend(["--sync", "--transport", transport]);
    let env = [("DFLOW_LOG", "warn,dflow_transport::shm=info")];
    let ps = Task::start_with_env(&cluster, "ps", 0, &["--transport", transport], &env);
    let worker1 = Task::start_with_env(&cluster, "worker", 1, &common, &env);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common.iter().copied());
    chief_args.extend(["--losses-out", &losses_arg]);
    let chief = Task::start_with_env(&cluster, "worker", 0, &chief_args, &env);
    let pids = vec![chief.pid(), worker1.pid(), ps.pid()];
    let mut logs = String::new();
    for t in [chief, worker1, ps] {
        let ended = t.wait(LIMIT);
        ended.assert_success();
        if ended.name.starts_with("worker") {
            logs.push_str(&ended.stderr);
        }
    }
    (std::fs::read_to_string(&losses).unwrap(), logs, pids)
}

/// The counts of values the workers sent in place, from their shm transport's closing line.
fn sent_in_place(logs: &str) -> Vec<u64> {
    logs.lines()
        .filter_map(|l| l.split("shm transport: ").nth(1))
        .filter_map(|rest| rest.split(' ').next()?.parse().ok())
        .collect()
}

#[test]
fn shm_training_equals_tcp_and_leaves_no_segments() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (shm, logs, pids) = train("shm", 3, dir.path());
    let (tcp, _, _) = train("tcp", 3, dir.path());
    assert!(shm.lines().count() > 100, "{shm}");
    assert_eq!(shm, tcp, "the losses over shm equal the losses over TCP");
    // Both workers' gradients (MatMul, BiasAdd...) were written straight into their slots.
    let in_place = sent_in_place(&logs);
    assert!(
        in_place.len() == 2 && in_place.iter().all(|&n| n > 0),
        "{logs}"
    );
    assert_eq!(shm_residue(&pids), Vec::<String>::new());
}

#[test]
fn a_killed_task_leaves_no_shm_segments() {
    let _serial = serial();
    let cluster = Cluster::new(1, 2);
    let ckpt = cluster.path("ckpt");
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let args = [
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1000",
        "--quiet",
        "--timeout",
        "5",
        "--transport",
        "shm",
    ];
    let ps = Task::start(&cluster, "ps", 0, &["--timeout", "5", "--transport", "shm"]);
    let worker1 = Task::start(&cluster, "worker", 1, &args);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(args);
    chief_args.extend(["--checkpoint-dir", &ckpt_s, "--save-every", "20"]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args);
    let pids = [chief.pid(), worker1.pid(), ps.pid()];
    // Train until the first checkpoint (20 steps over shm), then kill a worker.
    chief.wait_until(Duration::from_secs(120), "a checkpoint", || {
        std::fs::read_dir(&ckpt).is_ok_and(|mut d| d.next().is_some())
    });
    worker1.kill();
    let dead = "/job:worker/replica:0/task:1";
    chief
        .wait(Duration::from_secs(20))
        .assert_failure_naming(dead);
    ps.wait(Duration::from_secs(20)).assert_failure_naming(dead);
    assert_eq!(shm_residue(&pids), Vec::<String>::new());
}
