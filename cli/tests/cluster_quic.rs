//! Training over the QUIC transport with real `dflow` processes (1 ps + 2 workers on
//! 127.0.0.1), with certificates made by `dflow cert`: the losses equal a TCP run's bit for bit;
//! a rogue task with another CA's certificate is refused by the tasks it dials and the job ends
//! correctly; a killed worker ends the job naming it.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use support::*;

const LIMIT: Duration = Duration::from_secs(240);

/// `dflow cert init` + `dflow cert issue` for `tasks` (or every task of `cluster`) in `dir`.
fn certs(dir: &Path, cluster: Option<&Path>, tasks: &[&str]) -> PathBuf {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "dflow {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let d = dir.to_string_lossy().into_owned();
    run(&["cert", "init", "--dir", &d]);
    let mut issue = vec!["cert", "issue", "--dir", &d];
    let c;
    if let Some(cluster) = cluster {
        c = cluster.to_string_lossy().into_owned();
        issue.extend(["--cluster", &c]);
    }
    for t in tasks {
        issue.extend(["--task", t]);
    }
    run(&issue);
    dir.to_path_buf()
}

/// Runs the sync digits job over `transport` (`extra` flags for every task); returns the
/// chief's losses file and its held-out accuracy, after every task exited successfully.
/// `before_chief` may start another process (a rogue task) between worker 1 and the chief.
fn train(
    cluster: &Cluster,
    transport: &str,
    extra: &[&str],
    epochs: u32,
    before_chief: impl FnOnce() -> Option<Task>,
) -> (String, f64, Vec<Ended>, Option<Ended>) {
    let losses = cluster.path(&format!("{transport}-losses.txt"));
    let losses_arg = losses.to_string_lossy().into_owned();
    let args = digits_args(epochs);
    let mut common: Vec<&str> = args.iter().map(String::as_str).collect();
    common.extend(["--sync", "--transport", transport]);
    common.extend(extra);
    let mut ps_args = vec!["--transport", transport];
    ps_args.extend(extra);
    let ps = Task::start(cluster, "ps", 0, &ps_args);
    let worker1 = Task::start(cluster, "worker", 1, &common);
    let other = before_chief();
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common.iter().copied());
    chief_args.extend(["--losses-out", &losses_arg]);
    let chief = Task::start(cluster, "worker", 0, &chief_args);
    let mut ended = Vec::new();
    for t in [chief, worker1, ps] {
        let e = t.wait(LIMIT);
        e.assert_success();
        ended.push(e);
    }
    let other = other.map(|t| t.wait(Duration::from_secs(60)));
    let accuracy = ended[0].held_out("accuracy");
    (
        std::fs::read_to_string(&losses).unwrap(),
        accuracy,
        ended,
        other,
    )
}

#[test]
fn quic_training_equals_tcp_and_a_rogue_task_is_refused() {
    let _serial = serial();
    let cluster = Cluster::new(1, 2);
    let good = certs(&cluster.path("certs"), Some(&cluster.file), &[]);
    let good_s = good.to_string_lossy().into_owned();

    // The rogue: worker 1 by name, with a certificate from another CA, at its own port,
    // dialling the real ps and chief.
    let rogue_certs = certs(&cluster.path("rogue-certs"), None, &["worker:1"]);
    let rogue_port = free_ports(1)[0];
    let rogue_cluster = cluster.path("rogue-cluster.json");
    std::fs::write(
        &rogue_cluster,
        format!(
            r#"{{"ps": ["127.0.0.1:{}"], "worker": ["127.0.0.1:{}", "127.0.0.1:{rogue_port}"]}}"#,
            cluster.ps[0], cluster.workers[0]
        ),
    )
    .unwrap();
    // The rogue dials the ps (up, waiting for the chief) and then the chief while the job
    // starts and runs; it gives up after 3 s.
    let rogue_file = Cluster {
        dir: tempfile::tempdir().unwrap(),
        file: rogue_cluster.clone(),
        ps: cluster.ps.clone(),
        workers: vec![cluster.workers[0], cluster.workers[1], rogue_port],
    };
    let rogue_dir = rogue_certs.to_string_lossy().into_owned();
    let (quic, quic_acc, ended, rogue) =
        train(&cluster, "quic", &["--cert-dir", &good_s], 3, || {
            let rogue_args = [
                "--transport",
                "quic",
                "--cert-dir",
                &rogue_dir,
                "--startup-timeout",
                "3",
            ];
            // The ps is up by now (it waits for the chief).
            std::thread::sleep(Duration::from_secs(1));
            let rogue = Task::start(&rogue_file, "worker", 1, &rogue_args);
            // Let it dial the ps before the chief comes up.
            std::thread::sleep(Duration::from_millis(500));
            Some(rogue)
        });
    let rogue = rogue.unwrap();
    rogue.assert_failure_naming("/job:ps/replica:0/task:0");
    assert!(
        rogue
            .stderr
            .contains("invalid peer certificate: UnknownIssuer"),
        "the rogue's error says why:\n{}\nps:\n{}",
        rogue.stderr,
        ended[2].stderr
    );
    // The tasks it dialled refused it and logged it.
    let refused = ended
        .iter()
        .filter(|e| e.stderr.contains("refused a connection from"))
        .count();
    assert!(refused >= 1, "{ended:#?}");

    let tcp_cluster = Cluster::new(1, 2);
    let (tcp, tcp_acc, _, _) = train(&tcp_cluster, "tcp", &[], 3, || None);
    assert!(quic.lines().count() > 100, "{quic}");
    assert_eq!(quic, tcp, "the losses over QUIC equal the losses over TCP");
    assert_eq!(quic_acc, tcp_acc);
}

#[test]
fn a_killed_worker_ends_a_quic_job_naming_it() {
    let _serial = serial();
    let cluster = Cluster::new(1, 2);
    let dir = certs(&cluster.path("certs"), Some(&cluster.file), &[]);
    let dir_s = dir.to_string_lossy().into_owned();
    let ckpt = cluster.path("ckpt");
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let args = [
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1000",
        "--quiet",
        "--timeout",
        "3",
        "--transport",
        "quic",
        "--cert-dir",
        &dir_s,
    ];
    let ps = Task::start(
        &cluster,
        "ps",
        0,
        &[
            "--timeout",
            "3",
            "--transport",
            "quic",
            "--cert-dir",
            &dir_s,
        ],
    );
    let worker1 = Task::start(&cluster, "worker", 1, &args);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(args);
    chief_args.extend(["--checkpoint-dir", &ckpt_s, "--save-every", "20"]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args);
    chief.wait_until(Duration::from_secs(120), "a checkpoint", || {
        std::fs::read_dir(&ckpt).is_ok_and(|mut d| d.next().is_some())
    });
    // SIGKILL: over UDP nothing tells the others; the idle timeout (3 s) does.
    worker1.kill();
    let dead = "/job:worker/replica:0/task:1";
    chief
        .wait(Duration::from_secs(30))
        .assert_failure_naming(dead);
    ps.wait(Duration::from_secs(30)).assert_failure_naming(dead);
}

#[test]
fn missing_or_foreign_certificates_fail_at_start_naming_the_file() {
    let cluster = Cluster::new(1, 1);
    // No certificates at all.
    Task::start(&cluster, "ps", 0, &["--transport", "quic"])
        .wait(Duration::from_secs(30))
        .assert_failure_naming("--cert-dir");
    // A directory with only worker 0's certificate: the ps names its missing file.
    let dir = certs(&cluster.path("certs"), None, &["worker:0"]);
    let d = dir.to_string_lossy().into_owned();
    Task::start(
        &cluster,
        "ps",
        0,
        &["--transport", "quic", "--cert-dir", &d],
    )
    .wait(Duration::from_secs(30))
    .assert_failure_naming("ps-0.crt");
    // Worker 0's certificate given to the ps: refused, naming the file and the task.
    let ps_args = [
        "--transport",
        "quic",
        "--cert-dir",
        &d,
        "--cert",
        &format!("{d}/worker-0.crt"),
        "--key",
        &format!("{d}/worker-0.key"),
    ];
    let ended = Task::start(&cluster, "ps", 0, &ps_args).wait(Duration::from_secs(30));
    ended.assert_failure_naming("worker-0.crt");
    ended.assert_failure_naming("ps-0.dflow");
}
