//! A distributed job's chief trains exactly like `dflow run --local`: the same graph, seed and
//! global batch give the same `--losses-out` sequence, for the digits MLP (CSV) and for a tiny
//! GPT on text (character windows), under sync parameter servers and under all-reduce. Real
//! `dflow` processes on 127.0.0.1.
//!
//! `--losses-out` writes 9 decimals; every loss here is above 0.1, where neighbouring f32 values
//! are at least 7e-9 apart (more than the file's 1e-9), so equal files mean bit-identical f32
//! losses.
//!
//! Bitwise equality holds when the job has one worker: its part of every step's batch is the
//! whole batch and its weight is exactly 1, so it computes what the one process computes. With
//! two workers each computes the loss and gradients of half the batch and the halves are summed
//! (`Σ n_i/n · mean_i` instead of one mean over the batch): the same value in exact arithmetic,
//! but float sums in another order, so the losses agree to rounding (checked within 1e-6,
//! relative, over a few steps), not bit for bit.

mod support;

use dflow::graph::layers::{gpt, GptConfig};
use std::path::{Path, PathBuf};
use std::time::Duration;
use support::*;

const LIMIT: Duration = Duration::from_secs(120);
const CORPUS: &str = "examples/data/shakespeare.txt.gz";

/// Logs every step of the step driver (`trainer::run_steps`).
const DRIVER_LOG: &str = "warn,dflow_executor::trainer=debug";
const DRIVER_STEP: &str = "step driver: step done";

/// The steps the step driver logged in `stderr`.
fn driver_steps(stderr: &str) -> usize {
    stderr.lines().filter(|l| l.contains(DRIVER_STEP)).count()
}

/// A one-block GPT (16 characters of context, 16 channels), clipping its gradient by global
/// norm when `grad_clip` says so.
fn tiny_gpt(dir: &Path, grad_clip: Option<f64>) -> PathBuf {
    let cfg = GptConfig {
        block_size: 16,
        n_layer: 1,
        n_head: 2,
        n_embd: 16,
        learning_rate: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 2,
        decay_steps: 20,
        grad_clip,
        ..GptConfig::default()
    };
    let model = gpt(&cfg).unwrap();
    let path = dir.join(match grad_clip {
        None => "tiny-gpt.json".to_string(),
        Some(c) => format!("tiny-gpt-clip-{c}.json"),
    });
    std::fs::write(&path, dflow::graph::format::to_json(&model.def)).unwrap();
    path
}

/// What one model's training takes: the graph and the flags every run of it gets.
struct Run {
    graph: String,
    flags: Vec<String>,
}

impl Run {
    fn digits() -> Run {
        Run {
            graph: "examples/digits/digits.json".into(),
            flags: [
                "--data",
                "examples/data/digits.csv.gz",
                "--epochs",
                "1",
                "--quiet",
            ]
            .map(String::from)
            .to_vec(),
        }
    }

    fn gpt(dir: &Path) -> Run {
        Run::gpt_clipped(dir, None)
    }

    fn gpt_clipped(dir: &Path, grad_clip: Option<f64>) -> Run {
        Run {
            graph: tiny_gpt(dir, grad_clip).to_string_lossy().into_owned(),
            flags: [
                "--data",
                CORPUS,
                "--batch-size",
                "8",
                "--steps",
                "8",
                "--eval-every",
                "4",
                "--eval-batches",
                "2",
                "--quiet",
            ]
            .map(String::from)
            .to_vec(),
        }
    }

    /// The same run with `--steps steps`.
    fn with_steps(&self, steps: &str) -> Run {
        let mut flags = self.flags.clone();
        let at = flags.iter().position(|f| f == "--steps").unwrap() + 1;
        flags[at] = steps.into();
        Run {
            graph: self.graph.clone(),
            flags,
        }
    }

    /// `dflow run --local`; returns its losses and stdout.
    fn local(&self, dir: &Path) -> (Vec<(u64, f64)>, String) {
        let (losses, out, _) = self.local_with_stderr(dir);
        (losses, out)
    }

    /// `dflow run --local`, logging the step driver's steps; returns its losses, stdout and
    /// stderr.
    fn local_with_stderr(&self, dir: &Path) -> (Vec<(u64, f64)>, String, String) {
        let losses = dir.join("local-losses.txt");
        let mut args = vec!["run", "--local", self.graph.as_str()];
        args.extend(self.flags.iter().map(String::as_str));
        let losses_s = losses.to_string_lossy().into_owned();
        args.extend(["--losses-out", &losses_s]);
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_dflow"))
            .args(&args)
            .current_dir(repo())
            .env("DFLOW_LOG", DRIVER_LOG)
            .output()
            .unwrap();
        let out = stdout(&output);
        let err = String::from_utf8_lossy(&output.stderr).into_owned();
        (read_losses(&losses), out, err)
    }

    /// The job on `cluster` with `strategy`, the chief given `chief_extra`; returns the
    /// chief's losses and its end.
    fn job(
        &self,
        cluster: &Cluster,
        strategy: &str,
        chief_extra: &[&str],
    ) -> (Vec<(u64, f64)>, Ended) {
        let losses = cluster.path("job-losses.txt");
        let losses_s = losses.to_string_lossy().into_owned();
        let mut common: Vec<&str> = self.flags.iter().map(String::as_str).collect();
        common.extend(["--strategy", strategy]);
        let mut others = Vec::new();
        for i in 0..cluster.ps.len() {
            others.push(Task::start(cluster, "ps", i, &[]));
        }
        for i in 1..cluster.workers.len() {
            others.push(Task::start(cluster, "worker", i, &common));
        }
        let mut chief_args = vec![self.graph.as_str()];
        chief_args.extend(common.iter().copied());
        chief_args.extend(["--losses-out", &losses_s]);
        chief_args.extend(chief_extra);
        let env = [("DFLOW_LOG", DRIVER_LOG)];
        let chief = Task::start_with_env(cluster, "worker", 0, &chief_args, &env).wait(LIMIT);
        chief.assert_success();
        for t in others {
            t.wait(Duration::from_secs(30)).assert_success();
        }
        (read_losses(&losses), chief)
    }
}

/// Asserts the losses are the same steps with bit-identical values.
fn assert_bitwise(job: &[(u64, f64)], local: &[(u64, f64)]) {
    assert_eq!(job.len(), local.len(), "same number of steps");
    for ((s1, a), (s2, b)) in job.iter().zip(local) {
        assert_eq!(s1, s2);
        assert_eq!(a.to_bits(), b.to_bits(), "step {s1}: job {a}, local {b}");
    }
}

/// The value of the `PREFIX VALUE` line of `text`.
fn line_value(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{text}"))
}

#[test]
fn digits_on_one_worker_lose_exactly_what_one_process_loses_under_ps_and_allreduce() {
    let _serial = serial();
    let run = Run::digits();
    for (strategy, ps) in [("ps", 1), ("allreduce", 0)] {
        let cluster = Cluster::new(ps, 1);
        let (job, chief) = run.job(&cluster, strategy, &[]);
        let (local, out) = run.local(cluster.dir.path());
        assert_eq!(job.len(), 45, "one epoch of 1437 examples in batches of 32");
        assert_bitwise(&job, &local);
        assert_eq!(
            chief.held_out("accuracy"),
            line_value(&out, "held-out accuracy: "),
            "{strategy}"
        );
    }
}

#[test]
fn digits_on_two_workers_match_one_process_to_rounding_under_ps_and_allreduce() {
    let _serial = serial();
    let run = Run::digits();
    for (strategy, ps) in [("ps", 1), ("allreduce", 0)] {
        let cluster = Cluster::new(ps, 2);
        let (job, _) = run.job(&cluster, strategy, &[]);
        let (local, _) = run.local(cluster.dir.path());
        let worst = assert_same_losses(&job, &local, 1e-6);
        eprintln!("{strategy}: worst relative difference {worst:e}");
    }
}

/// The `step N: train loss ..., val loss ...` line of `stderr`.
fn eval_line(stderr: &str, step: u64) -> String {
    let prefix = format!("step {step}: train loss");
    stderr
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{stderr}"))
        .to_string()
}

#[test]
fn a_gpt_job_on_one_worker_trains_resumes_and_evaluates_exactly_like_one_process_and_generates() {
    let _serial = serial();
    let dir = scratch("cluster-gpt-one");
    let run = Run::gpt(&dir);
    let (local, out, err) = run.local_with_stderr(&dir);
    assert_eq!(local.len(), 8);
    // The job stops after 5 steps (a checkpoint), and a second job resumes it to step 8.
    let ckpt = dir.join("ckpt");
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let flags = ["--checkpoint-dir", ckpt_s.as_str()];
    let (mut job, first) = run
        .with_steps("5")
        .job(&Cluster::new(0, 1), "allreduce", &flags);
    let (rest, second) = run.job(&Cluster::new(0, 1), "allreduce", &flags);
    assert!(
        second
            .stderr
            .contains("resumed from the checkpoint at step 5"),
        "{}",
        second.stderr
    );
    job.extend(rest);
    assert_bitwise(&job, &local);
    // Both ran every step through the one step driver.
    assert_eq!(driver_steps(&err), 8, "{err}");
    assert_eq!(
        driver_steps(&first.stderr) + driver_steps(&second.stderr),
        8,
        "{}{}",
        first.stderr,
        second.stderr
    );
    // The periodic and the final validation loss are the local run's.
    assert_eq!(eval_line(&first.stderr, 4), eval_line(&err, 4));
    assert_eq!(
        line_value(&second.stdout, "validation loss: "),
        line_value(&out, "validation loss: ")
    );
    // The job's checkpoint carries the vocabulary: `dflow generate` samples from it.
    let sample = stdout(&dflow(&[
        "generate",
        &run.graph,
        "--checkpoint-dir",
        &ckpt_s,
        "--prompt",
        "ROMEO:",
        "--chars",
        "20",
        "--seed",
        "1",
    ]));
    assert!(sample.starts_with("ROMEO:"), "{sample}");
    assert_eq!(
        sample.trim_end_matches('\n').chars().count(),
        "ROMEO:".len() + 20
    );
}

#[test]
fn an_async_gpt_job_trains_on_text_evaluates_and_reports_staleness() {
    let _serial = serial();
    let dir = scratch("cluster-gpt-async");
    let mut run = Run::gpt(&dir);
    run.flags.push("--async".into());
    let (job, chief) = run.job(&Cluster::new(1, 2), "ps", &[]);
    let steps: Vec<u64> = job.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>());
    // The workers' overlapping steps ran through the one step driver too.
    assert_eq!(driver_steps(&chief.stderr), 8, "{}", chief.stderr);
    // Step 1 sees uniform predictions over the 76 characters.
    assert!(
        (job[0].1 - 76f64.ln()).abs() < 0.1,
        "first loss {}",
        job[0].1
    );
    assert!(chief.stdout.contains("staleness: mean"), "{}", chief.stdout);
    eval_line(&chief.stderr, 4);
    let val = line_value(&chief.stdout, "validation loss: ");
    assert!(val.is_finite() && val < job[0].1, "validation loss {val}");
}

#[test]
fn a_gpt_trains_on_text_like_one_process_under_ps_and_allreduce() {
    let _serial = serial();
    let dir = scratch("cluster-gpt-two");
    let run = Run::gpt(&dir);
    let (local, out) = run.local(&dir);
    let local_val = line_value(&out, "validation loss: ");
    // One worker and a ps: bit for bit (all-reduce on one worker: the resume test above).
    let (job, chief) = run.job(&Cluster::new(1, 1), "ps", &[]);
    assert_bitwise(&job, &local);
    assert_eq!(line_value(&chief.stdout, "validation loss: "), local_val);
    // Two workers: to rounding.
    for (strategy, ps) in [("ps", 1), ("allreduce", 0)] {
        let cluster = Cluster::new(ps, 2);
        let (job, chief) = run.job(&cluster, strategy, &[]);
        let worst = assert_same_losses(&job, &local, 1e-6);
        eprintln!("{strategy}: worst relative difference {worst:e}");
        let val = line_value(&chief.stdout, "validation loss: ");
        assert!(
            (val - local_val).abs() <= 1e-3,
            "{strategy}: validation {val} vs {local_val}"
        );
    }
}

#[test]
fn a_gpt_clipped_by_global_norm_trains_like_one_process_under_ps_and_allreduce() {
    let _serial = serial();
    let dir = scratch("cluster-gpt-clip");
    // A small norm: every step's gradient is clipped (its losses differ from the unclipped
    // run's by about 1e-4 from step 2 on, far beyond the tolerance).
    let run = Run::gpt_clipped(&dir, Some(0.1));
    let (local, _) = run.local(&dir);
    let (one, _) = run.job(&Cluster::new(0, 1), "allreduce", &[]);
    assert_bitwise(&one, &local);
    for (strategy, ps) in [("ps", 1), ("allreduce", 0)] {
        let (job, _) = run.job(&Cluster::new(ps, 2), strategy, &[]);
        let worst = assert_same_losses(&job, &local, 1e-6);
        eprintln!("{strategy}, clipped: worst relative difference {worst:e}");
    }
}

#[test]
fn a_gpt_job_initialized_from_a_file_trains_exactly_like_one_process_initialized_from_it() {
    let _serial = serial();
    let dir = scratch("cluster-gpt-init");
    let run = Run::gpt(&dir);
    // The model after 3 local steps, as a file of its trainable variables only.
    let ckpt = dir.join("ckpt");
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let warm = run.with_steps("3");
    let mut args = vec!["run", "--local", warm.graph.as_str()];
    args.extend(warm.flags.iter().map(String::as_str));
    args.extend(["--checkpoint-dir", &ckpt_s]);
    stdout(&dflow(&args));
    let file = std::fs::read_dir(&ckpt)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let (tensors, _) = dflow::executor::checkpoint::load_tensors(&file).unwrap();
    let text = std::fs::read_to_string(&run.graph).unwrap();
    let parsed = dflow::graph::format::parse_json(&text, None).unwrap();
    let model: Vec<(String, dflow::graph::Tensor)> = parsed
        .def
        .nodes
        .iter()
        .filter(|n| n.op == "Variable")
        .map(|n| (n.name.clone(), tensors[&n.name].clone()))
        .collect();
    let init_dir = dir.join("init");
    let init =
        dflow::executor::checkpoint::save(&init_dir, 3, &model, &Default::default()).unwrap();
    let init_s = init.to_string_lossy().into_owned();

    let mut from_file = run.with_steps("4");
    from_file.flags.extend(["--init-from".to_string(), init_s]);
    let (local, _) = from_file.local(&dir);
    let (job, chief) = from_file.job(&Cluster::new(0, 1), "allreduce", &[]);
    assert_bitwise(&job, &local);
    assert!(
        chief
            .stderr
            .contains(&format!("initialized {} variables", model.len())),
        "{}",
        chief.stderr
    );
    // It starts where the 3 steps ended, not from the initializers (ln 76 = 4.33).
    assert!(job[0].1 < 76f64.ln() - 0.01, "first loss {}", job[0].1);
}

#[test]
fn a_worker_whose_text_differs_from_the_chiefs_refuses_it_naming_its_file() {
    let _serial = serial();
    let dir = scratch("cluster-gpt-other-text");
    let run = Run::gpt(&dir);
    // Every character is in the corpus's vocabulary: only the digest tells the texts apart.
    let other = dir.join("other.txt");
    std::fs::write(&other, "to be or not to be\n".repeat(200)).unwrap();
    let other_s = other.to_string_lossy().into_owned();
    let cluster = Cluster::new(0, 2);
    let mut flags: Vec<&str> = run.flags.iter().map(String::as_str).collect();
    flags.extend(["--strategy", "allreduce"]);
    let mut worker_flags = flags.clone();
    worker_flags[1] = &other_s; // --data OTHER
    let worker = Task::start(&cluster, "worker", 1, &worker_flags);
    let mut chief_args = vec![run.graph.as_str()];
    chief_args.extend(flags.iter().copied());
    let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(LIMIT);
    chief.assert_failure_naming(&other_s);
    chief.assert_failure_naming("every task must read the same text");
    assert!(!worker.wait(Duration::from_secs(30)).status.success());
}
