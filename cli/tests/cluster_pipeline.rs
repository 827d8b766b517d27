//! Pipeline parallelism with real `dflow` processes: stages on separate processes over tcp and
//! shm, pipeline replicas with data parallelism, a GPT on text, and a stage killed mid-run.
//! Every run is compared with the same pipeline run in one process (`--local`), whose equality
//! with plain one-process training `tests/pipeline_numerics.rs` and `pipeline_cli.rs` check.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};
use support::*;

const LIMIT: Duration = Duration::from_secs(240);

/// Runs the chief (worker 0) and workers 1.. of `cluster` with `common` flags, the chief with
/// `graph` and `--losses-out`; returns the losses and the chief's stdout.
fn job(cluster: &Cluster, graph: &str, common: &[&str]) -> (Vec<(u64, f64)>, String) {
    let losses = cluster.path("losses.txt");
    let losses_s = losses.to_string_lossy().into_owned();
    let tasks: Vec<Task> = (1..cluster.workers.len())
        .map(|i| Task::start(cluster, "worker", i, common))
        .collect();
    let mut chief_args = vec![graph];
    chief_args.extend(common.iter().copied());
    chief_args.extend(["--losses-out", &losses_s]);
    let chief = Task::start(cluster, "worker", 0, &chief_args).wait(LIMIT);
    chief.assert_success();
    for t in tasks {
        t.wait(Duration::from_secs(30)).assert_success();
    }
    (read_losses(&losses), chief.stdout)
}

/// The same run in one process (`--local`, the cluster file naming the stages' workers).
fn local(cluster: &Path, graph: &str, common: &[&str], dir: &Path) -> (Vec<(u64, f64)>, String) {
    let losses = dir.join("local-losses.txt");
    let cluster = cluster.to_string_lossy().into_owned();
    let mut args = vec!["run", "--local", graph, "--cluster", &cluster];
    args.extend(common.iter().copied());
    args.extend(["--losses-out", losses.to_str().unwrap()]);
    let out = dflow(&args);
    (read_losses(&losses), stdout(&out))
}

fn digits_pipeline(extra: &[&'static str]) -> Vec<&'static str> {
    let mut v = vec![
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1",
        "--quiet",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
    ];
    v.extend_from_slice(extra);
    v
}

fn held_out(stdout: &str) -> String {
    stdout
        .lines()
        .filter(|l| l.starts_with("held-out"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn two_stage_processes_over_tcp_and_shm_train_like_one_process() {
    let _serial = serial();
    for (transport, schedule) in [("tcp", "1f1b"), ("shm", "gpipe")] {
        let cluster = Cluster::new(0, 2);
        let extra: Vec<&'static str> = vec![
            "--micro-batches",
            "4",
            "--schedule",
            schedule,
            "--transport",
            transport,
        ];
        let common = digits_pipeline(&extra);
        let (dist, out) = job(&cluster, "examples/digits/digits.json", &common);
        let local_common: Vec<&str> = common
            .iter()
            .copied()
            .filter(|a| *a != "--transport" && *a != transport)
            .collect();
        let scratch_dir = scratch(&format!("pipeline-{transport}"));
        let (one, local_out) = local(
            &cluster.file,
            "examples/digits/digits.json",
            &local_common,
            &scratch_dir,
        );
        // The same plan on the same batches: the same floats.
        assert_eq!(
            dist, one,
            "{transport}: losses differ from the in-process pipeline"
        );
        assert_eq!(held_out(&out), held_out(&local_out));
        assert!(out.contains("held-out accuracy"), "{out}");
    }
}

#[test]
fn pipeline_replicas_with_data_parallelism_train_like_one_process() {
    let _serial = serial();
    // 4 workers as a mesh of 2 stages × 2 replicas, each replica on half of every batch of 32.
    let cluster = Cluster::new(0, 4);
    let common = [
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1",
        "--quiet",
        "--mesh",
        "dp=2,pp=2",
        "--micro-batches",
        "4",
    ];
    let (dist, out) = job(&cluster, "examples/digits/digits.json", &common);
    // The reference: the same pipeline without replicas, in one process.
    let two = Cluster::new(0, 2);
    let dir = scratch("pipeline-dp");
    let (one, _) = local(
        &two.file,
        "examples/digits/digits.json",
        &digits_pipeline(&["--micro-batches", "4"]),
        &dir,
    );
    assert_eq!(dist.len(), 44);
    assert_same_losses(&dist, &one, 1e-6);
    assert!(out.contains("held-out accuracy"), "{out}");
}

#[test]
fn a_gpt_on_two_stage_processes_trains_on_text_like_one_process() {
    let _serial = serial();
    let dir = scratch("pipeline-gpt-job");
    let graph = small_gpt(&dir, 2);
    let graph_s = graph.to_string_lossy().into_owned();
    let cluster = Cluster::new(0, 2);
    let common = [
        "--data",
        "examples/data/shakespeare.txt.gz",
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--quiet",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--micro-batches",
        "2",
    ];
    let (dist, out) = job(&cluster, &graph_s, &common);
    let (one, local_out) = local(&cluster.file, &graph_s, &common, &dir);
    assert_eq!(dist, one);
    let val = |s: &str| {
        s.lines()
            .find(|l| l.starts_with("validation loss"))
            .map(str::to_string)
    };
    assert!(val(&out).is_some(), "{out}");
    assert_eq!(val(&out), val(&local_out));
}

/// `dflow run --local` with `args`: its stdout (asserting success).
fn run_local(args: &[&str]) -> String {
    let mut all = vec!["run", "--local"];
    all.extend_from_slice(args);
    stdout(&dflow(&all))
}

#[test]
fn a_pipelines_validation_loss_runs_on_its_stages_and_is_one_process_s() {
    // The evaluation is a forward pass through the stages (each on its own weights; see
    // `partitioner::strategy::pipeline::eval`): the one-process validation loss after 3 steps,
    // as printed, under 2 stages (1F1B, and interleaved: activations go 0 → 1 → 0 → 1), under
    // dp2×pp2 (plain, ZeRO-1, and ZeRO-3, whose evaluation joins each stage's replicas' shards
    // on that stage's worker), and with tensor parallelism inside the stages (tp2×pp2,
    // dp2×tp2×pp2 with ZeRO-1: each rank of replica 0 evaluates on its own shards; with ZeRO-3
    // each rank first joins its flat shards over its stage's dp group on its stage's worker).
    let dir = scratch("pipeline-eval-gpt");
    let graph = small_gpt(&dir, 2);
    let (one_losses, one) = run_text_local(&graph, &[], 3, &dir.join("ckpt-one"));
    assert!(one.starts_with("validation loss: "), "{one}");
    let layouts: [&[&str]; 8] = [
        &[
            "--cluster",
            "examples/gpt/cluster-2workers.json",
            "--strategy",
            "pipeline",
            "--stages",
            "2",
            "--micro-batches",
            "2",
        ],
        &[
            "--cluster",
            "examples/gpt/cluster-2workers.json",
            "--strategy",
            "pipeline",
            "--stages",
            "2",
            "--schedule",
            "interleaved",
            "--chunks",
            "2",
            "--micro-batches",
            "2",
        ],
        &[
            "--cluster",
            "examples/gpt/cluster-4workers.json",
            "--mesh",
            "dp=2,pp=2",
            "--micro-batches",
            "2",
        ],
        &[
            "--cluster",
            "examples/gpt/cluster-4workers.json",
            "--mesh",
            "dp=2,pp=2",
            "--micro-batches",
            "2",
            "--zero-stage",
            "1",
        ],
        &[
            "--cluster",
            "examples/gpt/cluster-4workers.json",
            "--mesh",
            "dp=2,pp=2",
            "--micro-batches",
            "2",
            "--zero-stage",
            "3",
        ],
        &[
            "--cluster",
            "examples/gpt/cluster-4workers.json",
            "--mesh",
            "dp=1,tp=2,pp=2",
            "--micro-batches",
            "2",
        ],
        &[
            "--cluster",
            "examples/gpt/cluster-8workers.json",
            "--mesh",
            "dp=2,tp=2,pp=2",
            "--micro-batches",
            "2",
            "--zero-stage",
            "1",
        ],
        &[
            "--cluster",
            "examples/gpt/cluster-8workers.json",
            "--mesh",
            "dp=2,tp=2,pp=2",
            "--micro-batches",
            "2",
            "--zero-stage",
            "3",
        ],
    ];
    for (k, layout) in layouts.iter().enumerate() {
        let (losses, validation) =
            run_text_local(&graph, layout, 3, &dir.join(format!("ckpt-{k}")));
        assert_same_losses(&losses, &one_losses, 1e-5);
        assert_eq!(validation, one, "{layout:?}");
    }
    // `--eval-batches 0` still turns it off.
    let graph_s = graph.to_string_lossy().into_owned();
    let off = run_local(&[
        &graph_s,
        "--cluster",
        "examples/gpt/cluster-2workers.json",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--data",
        "examples/data/shakespeare.txt.gz",
        "--batch-size",
        "8",
        "--steps",
        "1",
        "--eval-batches",
        "0",
        "--quiet",
    ]);
    assert!(
        off.contains("no validation loss (--eval-batches 0)"),
        "{off}"
    );
}

#[test]
fn a_partial_held_out_batch_crosses_the_stages_padded_and_scores_like_one_process() {
    // 1797 digits, 357 held out: 11 batches of 32 and one of 5, which crosses the stages
    // padded to 32 rows with its row count; 1440 training examples make 45 full batches, so
    // the pipeline trains on what one process does.
    let common = [
        "examples/digits/digits.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "2",
        "--test-fraction",
        "0.19866",
    ];
    let one = run_local(&common);
    let mut piped = common.to_vec();
    piped.extend([
        "--cluster",
        "examples/digits/cluster-allreduce.json",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--micro-batches",
        "4",
    ]);
    let two = run_local(&piped);
    let held = |s: &str| {
        s.lines()
            .filter(|l| l.starts_with("held-out"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(held(&one).len(), 2, "{one}");
    assert_eq!(held(&two), held(&one));
}

#[test]
fn killing_a_stage_ends_the_other_naming_it() {
    let _serial = serial();
    let cluster = Cluster::new(0, 2);
    let ckpt = cluster.path("ckpt");
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let common = [
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1000",
        "--quiet",
        "--timeout",
        "10",
        "--strategy",
        "pipeline",
        "--stages",
        "2",
        "--micro-batches",
        "4",
    ];
    let stage1 = Task::start(&cluster, "worker", 1, &common);
    let mut chief_args = vec!["examples/digits/digits.json"];
    chief_args.extend(common);
    chief_args.extend(["--checkpoint-dir", &ckpt_s, "--save-every", "20"]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args);
    chief.wait_until(Duration::from_secs(120), "a checkpoint", || {
        std::fs::read_dir(&ckpt).is_ok_and(|mut d| d.next().is_some())
    });
    let killed = Instant::now();
    stage1.kill();
    let chief = chief.wait(Duration::from_secs(60));
    chief.assert_failure_naming("/job:worker/replica:0/task:1");
    assert!(
        killed.elapsed() < Duration::from_secs(40),
        "the chief took {:?} to notice",
        killed.elapsed()
    );
}
