//! `dflow run --local --strategy S` for strategies whose tasks exchange tensors through
//! collectives: every task of the cluster runs inside the one process as a real task (its own
//! data plane on 127.0.0.1) and worker 0 drives them with the chief's step driver, the code path
//! of a multi-process job. Its losses equal the one-process run of the same graph, seed and
//! global batch (to rounding: two workers sum two half-batch means).

mod support;

use std::process::Command;
use support::*;

/// Logs every step of the step driver (`trainer::run_steps`).
const DRIVER_LOG: &str = "warn,dflow_executor::trainer=debug";
const DRIVER_STEP: &str = "step driver: step done";

/// Runs `dflow run --local GRAPH ARGS --losses-out FILE` with the driver's step log on; returns
/// the losses and stderr.
fn local(graph: &str, args: &[&str], losses: &std::path::Path) -> (Vec<(u64, f64)>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(["run", "--local", graph])
        .args(args)
        .arg("--losses-out")
        .arg(losses)
        .env("DFLOW_LOG", DRIVER_LOG)
        .current_dir(repo())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "dflow failed:\n{stderr}");
    (read_losses(losses), stderr)
}

fn driver_steps(stderr: &str) -> usize {
    stderr.lines().filter(|l| l.contains(DRIVER_STEP)).count()
}

#[test]
fn local_allreduce_runs_the_cluster_driver_and_equals_one_process() {
    let dir = scratch("local_allreduce");
    let data = [
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1",
        "--quiet",
    ];
    let (one, _) = local("examples/digits/digits.json", &data, &dir.join("one.txt"));
    let mut args = data.to_vec();
    args.extend([
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--strategy",
        "allreduce",
    ]);
    let (two, stderr) = local("examples/digits/digits.json", &args, &dir.join("two.txt"));
    assert!(stderr.contains("chief: every task joined"), "{stderr}");
    assert!(stderr.contains("with 2 worker(s)"), "{stderr}");
    assert_eq!(driver_steps(&stderr), two.len(), "{stderr}");
    assert_same_losses(&two, &one, 1e-6);
}

#[test]
fn local_zero_equals_one_process() {
    let dir = scratch("local_zero");
    let data = [
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1",
        "--quiet",
    ];
    let graph = "examples/digits/digits-adamw.json";
    let (one, _) = local(graph, &data, &dir.join("one.txt"));
    for stage in ["1", "2"] {
        let mut args = data.to_vec();
        args.extend([
            "--cluster",
            "examples/digits/cluster-allreduce.json",
            "--strategy",
            "zero",
            "--zero-stage",
            stage,
        ]);
        let (zero, stderr) = local(graph, &args, &dir.join(format!("zero{stage}.txt")));
        assert_eq!(driver_steps(&stderr), zero.len(), "{stderr}");
        assert_same_losses(&zero, &one, 1e-6);
    }
}

#[test]
fn local_quic_is_refused_with_the_way_out() {
    let out = dflow(&[
        "run",
        "--local",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--strategy",
        "allreduce",
        "--transport",
        "quic",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--transport quic needs"), "{stderr}");
    assert!(stderr.contains("dflow launch"), "{stderr}");
}

/// A global batch smaller than the replicas would leave a part empty (a 0/0 mean loss): refused
/// before step 1, naming the flag and the smallest batch that works.
#[test]
fn a_batch_smaller_than_the_replicas_is_refused() {
    let out = dflow(&[
        "run",
        "--local",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--strategy",
        "allreduce",
        "--batch-size",
        "1",
        "--epochs",
        "1",
        "--quiet",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--batch-size 1 is smaller than the 2 parts")
            && stderr.contains("give --batch-size 2 or more"),
        "{stderr}"
    );
    assert!(!stderr.contains("NaN"), "{stderr}");
}

#[test]
fn local_tensor_parallel_equals_one_process() {
    let dir = scratch("local_tensor");
    let graph = small_gpt(&dir, 2);
    let graph = graph.to_str().unwrap();
    let data = [
        "--data",
        "examples/data/shakespeare.txt.gz",
        "--batch-size",
        "4",
        "--steps",
        "4",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--quiet",
    ];
    let (one, _) = local(graph, &data, &dir.join("one.txt"));
    let mut args = data.to_vec();
    args.extend([
        "--cluster",
        "examples/gpt/cluster-2workers.json",
        "--strategy",
        "tensor",
        "--tp",
        "2",
    ]);
    let (tp, stderr) = local(graph, &args, &dir.join("tp.txt"));
    assert!(stderr.contains("chief: every task joined"), "{stderr}");
    assert_eq!(driver_steps(&stderr), tp.len(), "{stderr}");
    assert_same_losses(&tp, &one, 1e-5);
}

#[test]
fn a_local_memory_limit_refuses_all_reduce_and_fits_zero_3() {
    let base = [
        "run",
        "--local",
        "examples/digits/digits-adamw.json",
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1",
        "--quiet",
        "--memory-limit",
        "36000",
    ];
    let mut args = base.to_vec();
    args.extend(["--strategy", "allreduce"]);
    let out = dflow(&args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot fit in --memory-limit 36000 bytes"),
        "{err}"
    );
    let mut args = base.to_vec();
    args.extend(["--strategy", "zero", "--zero-stage", "3"]);
    let text = stdout(&dflow(&args));
    assert!(text.contains("held-out accuracy"), "{text}");
}
