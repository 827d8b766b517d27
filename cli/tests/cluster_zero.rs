//! ZeRO (`--strategy zero --zero-stage 1|2|3`) with real `dflow` processes, workers only: the
//! losses, the parameters and the Adam state (saved whole) equal a one-process run on the digits
//! MLP and on a small GPT, each rank's variable stores hold the parameters (stage 3: its 1/N of
//! them) plus its 1/N of the optimizer state, and a checkpoint saved at 2 ranks resumes in one
//! process and at 3 or 4 ranks with the uninterrupted run's losses.

mod support;

use dflow::executor::checkpoint;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use support::*;

const LIMIT: Duration = Duration::from_secs(240);
const GRAPH: &str = "examples/digits/digits-adamw.json";
const EPOCHS: u32 = 3;

/// The digits-adamw parameters: name and element count (Ψ = 2,410).
const PARAMS: [(&str, usize); 4] = [("w1", 64 * 32), ("b1", 32), ("w2", 32 * 10), ("b2", 10)];

/// The newest checkpoint's tensors in `dir`.
fn newest(dir: &Path) -> BTreeMap<String, dflow::graph::Tensor> {
    let path = checkpoint::latest(dir).unwrap().expect("a checkpoint");
    checkpoint::load(&path).unwrap().tensors
}

/// `dflow run --local` of the digits-adamw graph for `epochs` epochs, checkpointing to (and
/// resuming from) `ckpt`: its losses.
fn local_run(epochs: u32, ckpt: &Path, losses: &Path) -> Vec<(u64, f64)> {
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(["run", "--local", GRAPH])
        .args(digits_args(epochs))
        .arg("--losses-out")
        .arg(losses)
        .arg("--checkpoint-dir")
        .arg(ckpt)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    read_losses(losses)
}

/// What a task says, at the end of the job, its executor measured.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// Bytes of its variable stores (parameters and optimizer state).
    variables: usize,
    /// The most bytes of step tensors it held at once.
    peak: usize,
    /// Payload bytes it sent in collectives, as the transport counted them.
    sent: usize,
}

/// What task `index` says it holds at the end of the job (see [`Held`]).
fn held_bytes(stderr: &str, index: usize) -> Held {
    let task = format!("/job:worker/replica:0/task:{index}");
    let end = end_of_task(stderr)
        .into_iter()
        .find(|e| e.task == task)
        .unwrap_or_else(|| panic!("no `{task}: holds …` line in:\n{stderr}"));
    Held {
        variables: end.variable_bytes as usize,
        peak: end.peak as usize,
        sent: end.collective as usize,
    }
}

/// Runs digits-adamw for `epochs` epochs on `workers` workers under `strategy` (and
/// `--zero-stage stage`), checkpointing to (and resuming from) `ckpt`; returns the chief's
/// losses and worker 1's variable bytes and peak step-tensor bytes at the end.
fn distributed(
    workers: usize,
    strategy: &str,
    stage: u8,
    epochs: u32,
    ckpt: &Path,
) -> (Vec<(u64, f64)>, Held) {
    distributed_run(GRAPH, &digits_args(epochs), workers, strategy, stage, ckpt)
}

/// Runs `graph` with `flags` on `workers` workers under `strategy` (and `--zero-stage
/// stage`), checkpointing to (and resuming from) `ckpt`; returns the chief's losses and worker
/// 1's variable bytes and peak step-tensor bytes at the end.
fn distributed_run(
    graph: &str,
    flags: &[String],
    workers: usize,
    strategy: &str,
    stage: u8,
    ckpt: &Path,
) -> (Vec<(u64, f64)>, Held) {
    let cluster = Cluster::new(0, workers);
    let losses = cluster.path("losses.txt");
    let (losses_s, ckpt_s) = (
        losses.to_string_lossy().into_owned(),
        ckpt.to_string_lossy().into_owned(),
    );
    let stage_s = stage.to_string();
    let mut common: Vec<String> = flags.to_vec();
    common.extend(["--strategy".into(), strategy.into()]);
    if strategy == "zero" {
        common.extend(["--zero-stage".into(), stage_s]);
    }
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let tasks: Vec<Task> = (1..workers)
        .map(|i| Task::start(&cluster, "worker", i, &common))
        .collect();
    let mut chief_args = vec![graph];
    chief_args.extend(common.iter().copied());
    chief_args.extend(["--losses-out", &losses_s, "--checkpoint-dir", &ckpt_s]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(LIMIT);
    chief.assert_success();
    let mut bytes = None;
    for t in tasks {
        let t = t.wait(Duration::from_secs(30));
        t.assert_success();
        if bytes.is_none() {
            bytes = Some(held_bytes(&t.stderr, 1));
        }
    }
    let bytes = bytes.unwrap_or_else(|| panic!("no worker 1"));
    (read_losses(&losses), bytes)
}

/// Asserts `got` equals `want` within `tol` relative to `max(|want|, floor)`.
fn assert_close(name: &str, got: &[f64], want: &[f64], tol: f64, floor: f64) {
    assert_eq!(got.len(), want.len(), "{name}: element count");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(floor),
            "{name}[{i}]: {a} vs one process {b}"
        );
    }
}

/// The checkpoints of a ZeRO job and of one process hold the same tensors under the same names
/// and shapes, equal within 1e-5 (parameters) and 1e-4 of their largest magnitude (the Adam
/// moments, saved whole, gathered from the shards).
fn assert_same_state(zero_ckpt: &Path, local_ckpt: &Path) {
    let (ckpt, local) = (newest(zero_ckpt), newest(local_ckpt));
    // The same tensors under the same names and shapes as the one-process checkpoint.
    assert_eq!(
        ckpt.iter()
            .map(|(k, t)| (k.clone(), t.dims().to_vec()))
            .collect::<Vec<_>>(),
        local
            .iter()
            .map(|(k, t)| (k.clone(), t.dims().to_vec()))
            .collect::<Vec<_>>()
    );
    for (name, t) in &local {
        let want = t.to_f64_vec();
        if name.ends_with("/adam_m") || name.ends_with("/adam_v") {
            // The moments of the summed gradient: equal to 1e-4 of their largest magnitude.
            let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            assert_close(name, &ckpt[name].to_f64_vec(), &want, 1e-4, scale);
        } else {
            assert_close(name, &ckpt[name].to_f64_vec(), &want, 1e-5, 1.0);
        }
    }
}

/// ZeRO stage `stage` on `workers` workers against one process: losses and parameters equal
/// within 1e-5, the Adam slots equal too, and worker 1 holding the parameters (4Ψ; stage 3:
/// 4·ΣS, its shards, S = ⌈len/N⌉ per parameter) + 8·ΣS (its m and v shards) + 8 (the step
/// count), measured on its variable stores.
fn zero_equals_one_process(workers: usize, stage: u8) {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (zero_ckpt, local_ckpt) = (dir.path().join("zero"), dir.path().join("local"));
    let (losses, held) = distributed(workers, "zero", stage, EPOCHS, &zero_ckpt);
    let bytes = held.variables;
    let local_losses = local_run(EPOCHS, &local_ckpt, &dir.path().join("local.txt"));
    let worst = assert_same_losses(&losses, &local_losses, 1e-5);
    eprintln!("ZeRO-{stage} on {workers} workers: worst relative loss difference {worst:e}");
    assert_same_state(&zero_ckpt, &local_ckpt);
    let psi: usize = PARAMS.iter().map(|(_, n)| n).sum();
    assert_eq!(psi, 2410);
    let shards: usize = PARAMS.iter().map(|(_, n)| n.div_ceil(workers)).sum();
    let params = if stage == 3 { 4 * shards } else { 4 * psi };
    assert_eq!(bytes, params + 8 * shards + 8, "worker 1's variable bytes");
}

/// The `held-out …` lines of a run's stdout.
fn held_out(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter(|l| l.starts_with("held-out"))
        .collect()
}

#[test]
fn zero_3_evaluates_on_gathered_shards_like_one_process() {
    // Worker 0 evaluates with each weight all-gathered just before its use (the other workers
    // join the gathers): the held-out loss and accuracy are the one-process run's.
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(["run", "--local", GRAPH])
        .args(digits_args(1))
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let local = String::from_utf8_lossy(&out.stdout).into_owned();
    let cluster = Cluster::new(0, 2);
    let mut common: Vec<String> = digits_args(1);
    common.extend(["--strategy", "zero", "--zero-stage", "3"].map(String::from));
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let other = Task::start(&cluster, "worker", 1, &common);
    let mut chief_args = vec![GRAPH];
    chief_args.extend(common.iter().copied());
    let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(LIMIT);
    chief.assert_success();
    other.wait(Duration::from_secs(30)).assert_success();
    let want = held_out(&local);
    assert_eq!(want.len(), 2, "{local}");
    assert_eq!(held_out(&chief.stdout), want, "{}", chief.stdout);
    drop(dir);
}

#[test]
fn zero_stage_1_on_two_workers_trains_like_one_process() {
    zero_equals_one_process(2, 1);
}

#[test]
fn zero_stage_2_on_two_workers_trains_like_one_process() {
    zero_equals_one_process(2, 2);
}

#[test]
fn zero_stage_2_on_three_workers_with_padded_shards_trains_like_one_process() {
    zero_equals_one_process(3, 2);
}

#[test]
fn zero_stage_3_on_two_workers_trains_like_one_process() {
    zero_equals_one_process(2, 3);
}

#[test]
fn zero_stage_3_on_four_workers_with_padded_shards_trains_like_one_process() {
    zero_equals_one_process(4, 3);
}

/// The flags of the GPT runs: 6 steps of 8 windows of the bundled Shakespeare.
fn gpt_flags() -> Vec<String> {
    [
        "--data",
        "examples/data/shakespeare.txt.gz",
        "--batch-size",
        "8",
        "--steps",
        "6",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--quiet",
    ]
    .map(String::from)
    .to_vec()
}

#[test]
fn zero_stages_1_2_3_train_a_small_gpt_like_one_process_on_two_and_four_workers() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let graph = small_gpt(dir.path(), 2);
    let graph_s = graph.to_string_lossy().into_owned();
    let local_ckpt = dir.path().join("local");
    let losses = dir.path().join("local.txt");
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(["run", "--local", &graph_s])
        .args(gpt_flags())
        .arg("--losses-out")
        .arg(&losses)
        .arg("--checkpoint-dir")
        .arg(&local_ckpt)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let local = read_losses(&losses);
    assert_eq!(local.len(), 6);
    for (workers, stage) in [(2, 3), (4, 3), (2, 1), (4, 2)] {
        let ckpt = dir.path().join(format!("zero-{workers}-{stage}"));
        let (job, _) = distributed_run(&graph_s, &gpt_flags(), workers, "zero", stage, &ckpt);
        let worst = assert_same_losses(&job, &local, 1e-5);
        eprintln!("GPT, ZeRO-{stage} on {workers} workers: worst relative difference {worst:e}");
        assert_same_state(&ckpt, &local_ckpt);
    }
}

#[test]
fn all_reduce_clips_the_summed_gradient_and_holds_the_whole_optimizer_state() {
    // The baseline ZeRO is measured against: 4Ψ parameters + 8Ψ Adam state + the step count;
    // with clipping by global norm (digits-adamw clips at 1.0) it equals one process too.
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (losses, held) = distributed(2, "allreduce", 1, EPOCHS, &dir.path().join("ar"));
    let bytes = held.variables;
    assert_eq!(bytes, 12 * 2410 + 8);
    let local = local_run(
        EPOCHS,
        &dir.path().join("local"),
        &dir.path().join("local.txt"),
    );
    assert_same_losses(&losses, &local, 1e-5);
}

/// Copies the checkpoint directory `from` to a new directory `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Asserts a resumed run continues the uninterrupted one: the same steps (the step count
/// continues), the first resumed loss within 1e-6, the rest within 1e-5.
fn assert_resumes(name: &str, resumed: &[(u64, f64)], rest: &[(u64, f64)]) {
    let first = assert_same_losses(&resumed[..1], &rest[..1], 1e-6);
    assert_same_losses(resumed, rest, 1e-5);
    eprintln!("{name}: first resumed step {} within {first:e}", rest[0].0);
}

/// A ZeRO-`stage` checkpoint saved at 2 ranks after `EPOCHS - 1` epochs resumes in one process
/// (no strategy), at 3 ranks under ZeRO-1 and at 4 ranks under ZeRO-3, each continuing the
/// uninterrupted one-process run (the step count, the Adam state, the data order).
fn saved_at_two_ranks_resumes_anywhere(stage: u8) {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let uninterrupted = local_run(
        EPOCHS,
        &dir.path().join("full"),
        &dir.path().join("full.txt"),
    );
    let saved = dir.path().join("saved");
    distributed(2, "zero", stage, EPOCHS - 1, &saved);
    let (three_dir, four_dir) = (dir.path().join("three"), dir.path().join("four"));
    copy_dir(&saved, &three_dir);
    copy_dir(&saved, &four_dir);
    let rest = &uninterrupted[45 * (EPOCHS as usize - 1)..];
    // One process, no strategy.
    let local = local_run(EPOCHS, &saved, &dir.path().join("resumed-local.txt"));
    assert_resumes(&format!("ZeRO-{stage} at 2 → one process"), &local, rest);
    // Three ranks, ZeRO-1.
    let (three, _) = distributed(3, "zero", 1, EPOCHS, &three_dir);
    assert_resumes(&format!("ZeRO-{stage} at 2 → ZeRO-1 at 3"), &three, rest);
    // Four ranks, ZeRO-3 (padded shards).
    let (four, _) = distributed(4, "zero", 3, EPOCHS, &four_dir);
    assert_resumes(&format!("ZeRO-{stage} at 2 → ZeRO-3 at 4"), &four, rest);
}

#[test]
fn a_zero_1_checkpoint_saved_at_two_ranks_resumes_in_one_process_and_at_three_and_four_ranks() {
    saved_at_two_ranks_resumes_anywhere(1);
}

#[test]
fn a_zero_2_checkpoint_saved_at_two_ranks_resumes_in_one_process_and_at_three_and_four_ranks() {
    saved_at_two_ranks_resumes_anywhere(2);
}

#[test]
fn a_zero_3_checkpoint_saved_at_two_ranks_resumes_in_one_process_and_at_three_and_four_ranks() {
    saved_at_two_ranks_resumes_anywhere(3);
}

/// What each rank holds and sends, measured by its executor and its transport (f32, Ψ = 2,410,
/// N = 2, 45 steps):
/// - variable stores (plus 8 bytes of step count): all-reduce 12Ψ (parameters and Adam state
///   whole), ZeRO-1 and ZeRO-2 4Ψ + 8Ψ/N, ZeRO-3 12Ψ/N; the gradients are step tensors,
///   released when their last reader finishes, and ZeRO-3's step tensors (gathered layers
///   included) peak no higher than all-reduce's;
/// - collective payload bytes per step, the ring formulas with V = 4Ψ (plus, under ZeRO-3,
///   (N−1)/N·V per held-out batch: the evaluation gathers every weight once): all-reduce
///   2(N−1)/N·V, ZeRO-1 1.5× that (all-reduce, then all-gather of the parameters), ZeRO-2
///   2(N−1)/N·V (reduce-scatter + all-gather), ZeRO-3 (N−1)/N·V for the reduce-scatter and
///   the forward gathers plus (N−1)/N of the parameters the backward pass reads (here `w2`,
///   320 elements: the first layer's input needs no gradient and an addition's gradient does not
///   read its bias); plus 4 bytes per scalar all-reduce (the loss; ZeRO's clipping norm).
#[test]
fn each_stage_holds_and_sends_the_bytes_of_its_formula() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let (psi, n) = (2410, 2);
    let v = 4 * psi;
    let ring = 2 * (n - 1) * v / n;
    // 1,797 digits, round(20%) = 359 held out, in batches of 32.
    let held_out_batches = 359usize.div_ceil(32);
    let mut peaks = Vec::new();
    for (strategy, stage, variables, sent, per_eval) in [
        ("allreduce", 1, 12 * psi, ring + 4, 0),
        ("zero", 1, 4 * psi + 8 * psi / n, 3 * ring / 2 + 8, 0),
        ("zero", 2, 4 * psi + 8 * psi / n, ring + 8, 0),
        (
            "zero",
            3,
            12 * psi / n,
            ring + (n - 1) * 4 * 320 / n + 8,
            (n - 1) * v / n,
        ),
    ] {
        let ckpt = dir.path().join(format!("{strategy}-{stage}"));
        let (losses, held) = distributed(n, strategy, stage, 1, &ckpt);
        eprintln!("{strategy} {stage}: {held:?} over {} steps", losses.len());
        assert_eq!(held.variables, variables + 8, "{strategy} stage {stage}");
        assert_eq!(
            held.sent,
            sent * losses.len() + per_eval * held_out_batches,
            "{strategy} stage {stage}: {} steps, {held_out_batches} held-out batches",
            losses.len()
        );
        peaks.push(held.variables + held.peak);
    }
    // What a task holds at its peak (variables + step tensors): the step-tensor peak alone
    // depends on the order the threads ran ready nodes in (ZeRO-3's measured 19,284–19,756 B
    // against all-reduce's 19,284 B), the whole does not come near.
    assert!(
        peaks[3] < peaks[0],
        "ZeRO-3 holds {} B at its peak, all-reduce {} B",
        peaks[3],
        peaks[0]
    );
}

/// `--memory-limit`: the same model and limit are refused up front under all-reduce (its
/// variables and largest step tensor do not fit; the error names the biggest consumers and
/// ZeRO-3) and train under ZeRO-3 like one process.
///
/// The limit is checked against the values a step holds as it runs, and which of two ready
/// branches runs first is up to the threads (and when a collective's peers arrive): the ZeRO-3
/// job runs on 4 workers with small batches, where its measured peak (26.5 kB here) is far
/// enough under the limit for every order. On 2 workers with batches of 32 the held-out
/// evaluation (which gathers the whole `w1`) peaks at 35.2–39.3 kB depending on the order.
#[test]
fn a_memory_limit_refuses_all_reduce_before_step_1_and_zero_3_fits() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let limit = "36000";
    let run = |strategy: &str, stage: Option<&str>, workers: usize| {
        let cluster = Cluster::new(0, workers);
        let losses = cluster.path("losses.txt");
        let losses_s = losses.to_string_lossy().into_owned();
        let mut common: Vec<&str> = vec![
            "--data",
            "examples/data/digits.csv.gz",
            "--epochs",
            "1",
            "--quiet",
            "--batch-size",
            "8",
            "--memory-limit",
            limit,
            "--strategy",
            strategy,
        ];
        if let Some(s) = stage {
            common.extend(["--zero-stage", s]);
        }
        let others: Vec<Task> = (1..workers)
            .map(|i| Task::start(&cluster, "worker", i, &common))
            .collect();
        let mut chief_args = vec![GRAPH];
        chief_args.extend(common.iter().copied());
        chief_args.extend(["--losses-out", &losses_s]);
        let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(LIMIT);
        let losses = losses.exists().then(|| read_losses(&losses));
        // The cluster's directory holds the tasks' logs: it lives as long as they are read.
        (chief, others, losses, cluster)
    };
    let (chief, others, losses, _cluster) = run("allreduce", None, 2);
    drop(others);
    chief.assert_failure_naming("cannot fit in --memory-limit 36000 bytes");
    for what in [
        "`w1` 8192 B",
        "`w1/adam_m` 8192 B",
        "--strategy zero --zero-stage 3",
    ] {
        chief.assert_failure_naming(what);
    }
    assert!(
        losses.as_ref().map_or(true, Vec::is_empty),
        "no step ran: {losses:?}"
    );
    let (chief, others, losses, _cluster) = run("zero", Some("3"), 4);
    chief.assert_success();
    for (i, other) in others.into_iter().enumerate() {
        let other = other.wait(Duration::from_secs(30));
        other.assert_success();
        let Held {
            variables: bytes,
            peak,
            ..
        } = held_bytes(&other.stderr, i + 1);
        assert!(bytes + peak <= 36000, "task {}: {bytes} + {peak}", i + 1);
    }
    let Held {
        variables: bytes,
        peak,
        ..
    } = held_bytes(&chief.stderr, 0);
    assert!(bytes + peak <= 36000, "the chief: {bytes} + {peak}");
    let local = {
        let (ckpt, path) = (dir.path().join("local"), dir.path().join("local.txt"));
        let out = dflow(&[
            "run",
            "--local",
            GRAPH,
            "--data",
            "examples/data/digits.csv.gz",
            "--epochs",
            "1",
            "--quiet",
            "--batch-size",
            "8",
            "--losses-out",
            &path.to_string_lossy(),
            "--checkpoint-dir",
            &ckpt.to_string_lossy(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        read_losses(&path)
    };
    assert_same_losses(&losses.unwrap_or_default(), &local, 1e-5);
    // One process does not account its tasks: the flag is refused there, not ignored.
    let out = dflow(&["run", "--local", GRAPH, "--memory-limit", limit]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--memory-limit 36000 applies to the tasks of a distributed job"),
        "{err}"
    );
}

/// Under ZeRO-3 the evaluation gathers each weight just before its use, as training does: no
/// shard is sent point to point (no whole copy of the model on worker 0). `--eval-batches 0`
/// turns it off (no validation loss, no evaluation gathers); `--eval-batches 1` reports one,
/// worker 1 sending its shard of every parameter once in the evaluation's all-gathers.
#[test]
fn zero_3_evaluation_gathers_each_weight_and_eval_batches_0_turns_it_off() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let graph = small_gpt(dir.path(), 1);
    let graph_s = graph.to_string_lossy().into_owned();
    let run = |eval_batches: &str| {
        let cluster = Cluster::new(0, 2);
        let common = [
            "--data",
            "examples/data/shakespeare.txt.gz",
            "--batch-size",
            "4",
            "--steps",
            "2",
            "--eval-every",
            "0",
            "--eval-batches",
            eval_batches,
            "--quiet",
            "--strategy",
            "zero",
            "--zero-stage",
            "3",
        ];
        let worker = Task::start(&cluster, "worker", 1, &common);
        let mut chief_args = vec![graph_s.as_str()];
        chief_args.extend(common);
        let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(LIMIT);
        chief.assert_success();
        let worker = worker.wait(Duration::from_secs(30));
        worker.assert_success();
        let end = end_of_task(&worker.stderr)
            .into_iter()
            .find(|e| e.task == "/job:worker/replica:0/task:1")
            .unwrap_or_else(|| panic!("no end-of-task line in:\n{}", worker.stderr));
        (chief.stdout, end.data_plane, end.collective)
    };
    let (stdout, sent_off, collective_off) = run("0");
    assert!(
        stdout.contains("no validation loss (--eval-batches 0)"),
        "{stdout}"
    );
    assert!(!stdout.contains("validation loss:"), "{stdout}");
    assert_eq!(sent_off, 0, "worker 1 sent its shards to worker 0");
    let (stdout, sent_on, collective_on) = run("1");
    assert!(stdout.contains("validation loss: "), "{stdout}");
    assert_eq!(
        sent_on, 0,
        "worker 1 sent its shards to worker 0 point to point"
    );
    let sent = collective_on - collective_off;
    // Its half of every parameter (rounded up per parameter), 4 bytes each.
    let cfg = dflow::graph::layers::GptConfig {
        block_size: 16,
        n_layer: 1,
        n_head: 2,
        n_embd: 32,
        ..Default::default()
    };
    let psi = cfg.num_params() as u64;
    assert!(
        sent >= 4 * psi / 2 && sent <= 4 * psi / 2 + 4 * 64,
        "worker 1 sent {sent} B more in collectives, not its half of 4Ψ = {}",
        4 * psi
    );
}
