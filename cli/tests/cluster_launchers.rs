//! Jobs whose tasks learn their identity only from the variables a launcher sets: torchrun's
//! (registration with rank 0), Slurm's srun (registration, with a ps), and a TFJob TF_CONFIG
//! with a `chief` task (the chief drives and trains). Each trains digits on 127.0.0.1.

mod support;

use std::time::Duration;
use support::*;

const LIMIT: Duration = Duration::from_secs(240);
const GRAPH: &str = "examples/digits/digits.json";

/// The digits training command every task of these jobs runs (the same on every rank, as a
/// launcher runs one command everywhere; only the chief uses the graph).
fn command(extra: &[&str]) -> Vec<String> {
    let mut args = vec!["run".to_string(), GRAPH.to_string()];
    args.extend(digits_args(30));
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

#[test]
fn torchrun_variables_alone_train_digits_with_all_reduce_like_one_process() {
    let _serial = serial();
    let dir = scratch("torchrun-vars");
    let port = free_ports(1)[0].to_string();
    let losses = dir.join("losses.txt");
    let losses_arg = losses.to_string_lossy().into_owned();
    let args = command(&["--losses-out", &losses_arg]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let tasks: Vec<Task> = (0..2)
        .map(|rank| {
            let rank = rank.to_string();
            Task::start_with_identity(
                &dir,
                &format!("rank-{rank}"),
                &args,
                &[
                    ("RANK", &rank),
                    ("LOCAL_RANK", &rank),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", &port),
                ],
            )
        })
        .collect();
    let ended: Vec<Ended> = tasks.into_iter().map(|t| t.wait(LIMIT)).collect();
    for e in &ended {
        e.assert_success();
        assert!(e.stderr.contains("identity from torchrun"), "{}", e.stderr);
    }
    assert!(
        ended[0]
            .stderr
            .contains("all-reduce data-parallel training")
            && ended[0]
                .stderr
                .contains("with 2 worker(s) and 0 ps task(s)"),
        "no ps: all-reduce\n{}",
        ended[0].stderr
    );
    let accuracy = ended[0].held_out("accuracy");
    assert!(accuracy >= 0.93, "held-out accuracy {accuracy}");
    let (local, _) = local_digits_run(30, &dir);
    let worst = assert_same_losses(&read_losses(&losses), &local, 1e-5);
    eprintln!("worst relative loss difference: {worst:e}");
}

#[test]
fn slurm_variables_alone_train_digits_with_a_parameter_server() {
    let _serial = serial();
    let dir = scratch("slurm-vars");
    let port = free_ports(1)[0].to_string();
    let args = command(&["--num-ps", "1"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // srun -n 3 on one node: ranks 0 and 1 are workers, the last rank (2) is the ps.
    let tasks: Vec<Task> = (0..3)
        .map(|rank| {
            let rank = rank.to_string();
            Task::start_with_identity(
                &dir,
                &format!("procid-{rank}"),
                &args,
                &[
                    ("SLURM_PROCID", &rank),
                    ("SLURM_LOCALID", &rank),
                    ("SLURM_NTASKS", "3"),
                    ("SLURM_STEP_NODELIST", "127.0.0.1"),
                    ("SLURM_STEP_TASKS_PER_NODE", "3"),
                    ("MASTER_PORT", &port),
                ],
            )
        })
        .collect();
    let ended: Vec<Ended> = tasks.into_iter().map(|t| t.wait(LIMIT)).collect();
    for e in &ended {
        e.assert_success();
        assert!(e.stderr.contains("identity from Slurm"), "{}", e.stderr);
    }
    assert!(
        ended[2]
            .stderr
            .contains("/job:ps/replica:0/task:0: joined the job"),
        "{}",
        ended[2].stderr
    );
    assert!(
        ended[0]
            .stderr
            .contains("sync parameter-server training with 2 worker(s) and 1 ps task(s)"),
        "{}",
        ended[0].stderr
    );
    let accuracy = ended[0].held_out("accuracy");
    assert!(accuracy >= 0.93, "held-out accuracy {accuracy}");
}

#[test]
fn a_tf_config_chief_task_is_the_chief() {
    let _serial = serial();
    let dir = scratch("tf-chief");
    let ports = free_ports(4);
    let cluster = format!(
        r#"{{"chief": ["127.0.0.1:{}"], "evaluator": ["127.0.0.1:{}"], "ps": ["127.0.0.1:{}"], "worker": ["127.0.0.1:{}"]}}"#,
        ports[0], ports[1], ports[2], ports[3]
    );
    // As the TFJob operator writes it, `"environment": "cloud"` included.
    let tf = |ty: &str| {
        format!(
            r#"{{"cluster": {cluster}, "task": {{"type": "{ty}", "index": 0}}, "environment": "cloud"}}"#
        )
    };
    let args = command(&[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let tasks: Vec<Task> = ["ps", "worker", "evaluator", "chief"]
        .iter()
        .map(|ty| Task::start_with_identity(&dir, ty, &args, &[("TF_CONFIG", &tf(ty))]))
        .collect();
    let ended: Vec<Ended> = tasks.into_iter().map(|t| t.wait(LIMIT)).collect();
    for e in &ended {
        e.assert_success();
    }
    let (worker, evaluator, chief) = (&ended[1], &ended[2], &ended[3]);
    assert!(
        chief
            .stderr
            .contains("task chief:0 runs as /job:worker/task:0 (the chief"),
        "{}",
        chief.stderr
    );
    assert!(
        chief
            .stderr
            .contains("sync parameter-server training with 2 worker(s)"),
        "the chief trains too:\n{}",
        chief.stderr
    );
    let accuracy = chief.held_out("accuracy");
    assert!(accuracy >= 0.93, "held-out accuracy {accuracy}");
    assert!(
        worker
            .stderr
            .contains("task worker:0 runs as /job:worker/task:1"),
        "{}",
        worker.stderr
    );
    assert!(
        !worker.stdout.contains("held-out"),
        "TF's worker 0 must not drive:\n{}",
        worker.stdout
    );
    assert!(
        evaluator.stderr.contains("an evaluator has nothing to do"),
        "{}",
        evaluator.stderr
    );
}

#[test]
fn a_rank_that_never_starts_is_named_within_the_startup_timeout() {
    let _serial = serial();
    let dir = scratch("missing-rank");
    let port = free_ports(1)[0].to_string();
    let args = command(&["--startup-timeout", "2"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // WORLD_SIZE 3, but rank 2 is never started.
    let tasks: Vec<Task> = (0..2)
        .map(|rank| {
            let rank = rank.to_string();
            Task::start_with_identity(
                &dir,
                &format!("rank-{rank}"),
                &args,
                &[
                    ("RANK", &rank),
                    ("WORLD_SIZE", "3"),
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", &port),
                ],
            )
        })
        .collect();
    let ended: Vec<Ended> = tasks
        .into_iter()
        .map(|t| t.wait(Duration::from_secs(30)))
        .collect();
    ended[0].assert_failure_naming("waiting for ranks 2 (of 3) to register");
    ended[1].assert_failure_naming("rank 0");
}
