//! Tensor parallelism from placements written by hand (`_sharding`, docs/tensor-parallel.md
//! "Placements by hand"): the digits MLP with Megatron's MLP layout declared on its weights
//! (`examples/digits/digits-tp.dflow`: `w1` column-parallel, `b1` with it, `w2` row-parallel)
//! under `--strategy tensor --tp 2` trains with the losses and the parameters of the one-process
//! run of `examples/digits/digits.dflow`, in one process (`--local`) and with 2 real processes;
//! each rank sends exactly the all-reduce of the row-parallel layer's partial sums; its
//! checkpoint resumes in one process; a replicated layer in front gets `f` (its gradient
//! all-reduced) and clipping spans the shards, with the same losses again; placements
//! that do not compose, or do not parse, are refused naming the node; `dflow partition` shows
//! every tensor's placement and the inserted collective with its bytes. Three variants reach
//! every other conversion of the placement table (an all-gather, a local slice and a
//! reduce-scatter, an all-to-all), each training like one process, locally and with 2
//! processes, and sending exactly the ring formulas' bytes.

mod support;

use dflow::executor::checkpoint;
use std::collections::BTreeMap;
use std::path::Path;
use support::*;

const PLAIN: &str = "examples/digits/digits.dflow";
const BY_HAND: &str = "examples/digits/digits-tp.dflow";
const TWO_WORKERS: &str = "examples/digits/cluster-allreduce.json";

/// The newest checkpoint's tensors in `dir`.
fn newest(dir: &Path) -> BTreeMap<String, dflow::graph::Tensor> {
    let path = checkpoint::latest(dir).unwrap().expect("a checkpoint");
    checkpoint::load(&path).unwrap().tensors
}

/// `dflow run --local GRAPH` for one epoch with `extra` flags: its losses, its stderr, and its
/// checkpoint's tensors.
/// A run's losses, stderr and checkpoint.
type Run = (
    Vec<(u64, f64)>,
    String,
    BTreeMap<String, dflow::graph::Tensor>,
);

fn local(graph: &str, extra: &[&str], dir: &Path) -> Run {
    local_epochs(graph, 1, extra, dir)
}

/// [`local`] for `epochs` epochs.
fn local_epochs(graph: &str, epochs: u32, extra: &[&str], dir: &Path) -> Run {
    let losses = dir.join("losses.txt");
    let ckpt = dir.join("ckpt");
    let (l, c) = (
        losses.to_string_lossy().into_owned(),
        ckpt.to_string_lossy().into_owned(),
    );
    let args_owned = digits_args(epochs);
    let mut args: Vec<&str> = vec!["run", "--local", graph];
    args.extend(args_owned.iter().map(String::as_str));
    args.extend(extra);
    args.extend(["--losses-out", &l, "--checkpoint-dir", &c]);
    let out = dflow(&args);
    stdout(&out);
    (
        read_losses(&losses),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        newest(&ckpt),
    )
}

/// Asserts the checkpoints hold the same whole tensors (f32) within `tol`.
fn assert_same_parameters(
    a: &BTreeMap<String, dflow::graph::Tensor>,
    b: &BTreeMap<String, dflow::graph::Tensor>,
    tol: f32,
) {
    for name in ["w1", "b1", "w2", "b2"] {
        let (x, y) = (&a[name], &b[name]);
        assert_eq!(x.dims(), y.dims(), "{name}");
        let (x, y) = (x.as_slice::<f32>().unwrap(), y.as_slice::<f32>().unwrap());
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert!((p - q).abs() <= tol, "{name}[{i}]: {p} vs {q}");
        }
    }
}

/// Per step, each rank all-reduces the row-parallel layer's partial logits `[rows, 10]` f32
/// once (ring over 2 ranks: 2(T−1)/T = 1× the tensor) and nothing else: one epoch of the 1,438
/// training rows in batches of 32 is 44 full batches and one of 30.
const COLLECTIVE_BYTES_PER_EPOCH: u64 = 44 * 32 * 10 * 4 + 30 * 10 * 4;

#[test]
fn megatrons_mlp_by_hand_trains_like_one_process_locally_and_with_two_processes() {
    let _guard = serial();
    let dir = scratch("tensor-by-hand");
    let one = dir.join("one");
    let (want, _, want_params) = local(PLAIN, &[], &one);
    assert!(want.len() >= 3, "{want:?}");
    // --local: both ranks in one process.
    let tp = dir.join("local-tp2");
    let (got, stderr, params) = local(
        BY_HAND,
        &[
            "--cluster",
            TWO_WORKERS,
            "--strategy",
            "tensor",
            "--tp",
            "2",
        ],
        &tp,
    );
    let worst = assert_same_losses(&got, &want, 1e-6);
    println!("--local tp=2: worst relative loss difference {worst:e}");
    // The checkpoint holds whole tensors under the one-process names.
    assert_same_parameters(&params, &want_params, 1e-6);
    let ends = end_of_task(&stderr);
    assert_eq!(ends.len(), 2, "{stderr}");
    for e in &ends {
        assert_eq!(e.collective, COLLECTIVE_BYTES_PER_EPOCH, "{}", e.task);
    }
    // Two real processes.
    let mut flags = digits_args(1);
    flags.extend(["--strategy", "tensor", "--tp", "2"].map(String::from));
    let ckpt = dir.join("procs-ckpt");
    let (got, chief) = worker_job(Path::new(BY_HAND), 2, &flags, &ckpt);
    let worst = assert_same_losses(&got, &want, 1e-6);
    println!("2 processes tp=2: worst relative loss difference {worst:e}");
    assert_same_parameters(&newest(&ckpt), &want_params, 1e-6);
    let chief_end = end_of_task(&chief.stderr);
    assert_eq!(chief_end.len(), 1, "{}", chief.stderr);
    assert_eq!(chief_end[0].collective, COLLECTIVE_BYTES_PER_EPOCH);
    // The tp=2 checkpoint holds whole tensors: one process without placements resumes from it
    // for a second epoch and continues an uninterrupted two-epoch run.
    let (two_epochs, _, _) = local_epochs(PLAIN, 2, &[], &dir.join("two-epochs"));
    let losses = dir.join("resumed.txt");
    let (l, c) = (
        losses.to_string_lossy().into_owned(),
        ckpt.to_string_lossy().into_owned(),
    );
    let args_owned = digits_args(2);
    let mut args: Vec<&str> = vec!["run", "--local", PLAIN];
    args.extend(args_owned.iter().map(String::as_str));
    args.extend(["--losses-out", &l, "--checkpoint-dir", &c]);
    stdout(&dflow(&args));
    let resumed = read_losses(&losses);
    let first = got.len() as u64;
    assert!(
        resumed.first().is_some_and(|(s, _)| *s == first + 1),
        "{resumed:?}"
    );
    let tail: Vec<(u64, f64)> = two_epochs.into_iter().filter(|(s, _)| *s > first).collect();
    let worst = assert_same_losses(&resumed, &tail, 1e-5);
    println!(
        "resumed in one process from the tp=2 checkpoint: worst relative difference {worst:e}"
    );
}

#[test]
fn placements_that_do_not_fit_are_refused_naming_the_node() {
    let dir = scratch("tensor-by-hand-bad");
    // 32 columns of w1 do not divide by 3.
    let three = dir.join("cluster-3.json");
    std::fs::write(
        &three,
        r#"{"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}"#,
    )
    .unwrap();
    let args_owned = digits_args(1);
    let mut args: Vec<&str> = vec!["run", "--local", BY_HAND];
    args.extend(args_owned.iter().map(String::as_str));
    let three_s = three.to_string_lossy().into_owned();
    args.extend(["--cluster", &three_s, "--strategy", "tensor", "--tp", "3"]);
    let out = dflow(&args);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("node `w1`: Shard(1): dimension 1 of shape [64, 32] is 32, which does not divide by --tp 3"),
        "{err}"
    );
    // An unknown placement: the file is refused at its position, naming the node.
    let text = std::fs::read_to_string(repo().join(BY_HAND))
        .unwrap()
        .replace("\"Shard(0)\")", "\"Split(0)\")");
    let bad = dir.join("bad.dflow");
    std::fs::write(&bad, text).unwrap();
    let bad_s = bad.to_string_lossy().into_owned();
    let out = dflow(&["check", &bad_s]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("node \"b1\"")
            && err.contains("unknown placement \"Split(0)\"")
            && err.contains("Shard(d) or Replicate"),
        "{err}"
    );
}

#[test]
fn partition_shows_each_tensors_placement_and_the_inserted_collectives_with_bytes() {
    let out = stdout(&dflow(&[
        "partition",
        BY_HAND,
        "--cluster",
        TWO_WORKERS,
        "--strategy",
        "tensor",
        "--tp",
        "2",
        "--features",
        "pixels",
        "--labels",
        "labels",
        "--batch-size",
        "32",
    ]));
    let at = out
        .find("tensor parallelism by hand")
        .unwrap_or_else(|| panic!("no tensor section in:\n{out}"));
    insta::assert_snapshot!(&out[at..]);
}

/// The digits MLP with a replicated layer `w0` in front of the column-parallel `w1`, clipped by
/// the global norm: with and without the placements of `digits-tp.dflow`.
fn deeper(dir: &Path) -> (String, String) {
    let text = std::fs::read_to_string(repo().join(BY_HAND))
        .unwrap()
        .replace(
            "layer1/matmul = MatMul(x, w1)",
            "w0 = Variable(dtype: f32, initializer: glorot_uniform, seed: 3, shape: [64, 64])\n\
             x0 = MatMul(x, w0)\n\
             layer1/matmul = MatMul(x0, w1)",
        )
        .replace(
            "metrics: [accuracy] }",
            "metrics: [accuracy], clip_global_norm: 0.5 }",
        );
    assert!(text.contains("x0 = MatMul") && text.contains("clip_global_norm"));
    let plain: String = text
        .replace(", _sharding: \"Shard(1)\"", "")
        .replace(", _sharding: \"Shard(0)\"", "");
    assert!(!plain.contains("_sharding"));
    let (a, b) = (dir.join("deeper-tp.dflow"), dir.join("deeper.dflow"));
    std::fs::write(&a, text).unwrap();
    std::fs::write(&b, plain).unwrap();
    (
        a.to_string_lossy().into_owned(),
        b.to_string_lossy().into_owned(),
    )
}

#[test]
fn a_replicated_layer_before_the_column_layer_gets_f_and_clipping_spans_the_shards() {
    let _guard = serial();
    let dir = scratch("tensor-by-hand-deeper");
    let (by_hand, plain) = deeper(&dir);
    // The plan: f on the replicated layer's output (its gradient all-reduced backward).
    let out = stdout(&dflow(&[
        "partition",
        &by_hand,
        "--cluster",
        TWO_WORKERS,
        "--strategy",
        "tensor",
        "--tp",
        "2",
        "--features",
        "pixels",
        "--labels",
        "labels",
        "--batch-size",
        "32",
    ]));
    assert!(
        out.contains("CollectiveTpCopy on x0 → layer1/matmul[0]: f: Replicate entering a sharded op; all-reduce of its gradient backward; forward 0 B, backward 8192 B"),
        "{out}"
    );
    let (want, _, want_params) = local(&plain, &[], &dir.join("one"));
    let (got, _, params) = local(
        &by_hand,
        &[
            "--cluster",
            TWO_WORKERS,
            "--strategy",
            "tensor",
            "--tp",
            "2",
        ],
        &dir.join("tp2"),
    );
    let worst = assert_same_losses(&got, &want, 1e-6);
    println!("deeper --local tp=2: worst relative loss difference {worst:e}");
    assert_same_parameters(&params, &want_params, 1e-6);
    let (w0, v0) = (&params["w0"], &want_params["w0"]);
    for (p, q) in w0
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .zip(v0.as_slice::<f32>().unwrap())
    {
        assert!((p - q).abs() <= 1e-6, "w0: {p} vs {q}");
    }
}

/// `digits-tp.dflow` with `edits` (from, to) applied, and the same graph with no placements;
/// the training rows per epoch: 44 batches of 32 and one of 30.
fn variant(dir: &Path, name: &str, edits: &[(&str, &str)]) -> (String, String) {
    let mut text = std::fs::read_to_string(repo().join(BY_HAND)).unwrap();
    for (from, to) in edits {
        assert!(text.contains(from), "{from}");
        text = text.replace(from, to);
    }
    let mut plain = text.clone();
    for p in ["Shard(0)", "Shard(1)", "Replicate"] {
        plain = plain.replace(&format!(", _sharding: \"{p}\""), "");
    }
    assert!(!plain.contains("_sharding"));
    let (a, b) = (
        dir.join(format!("{name}-tp.dflow")),
        dir.join(format!("{name}.dflow")),
    );
    std::fs::write(&a, text).unwrap();
    std::fs::write(&b, plain).unwrap();
    (
        a.to_string_lossy().into_owned(),
        b.to_string_lossy().into_owned(),
    )
}

/// Training rows of one digits epoch (44 batches of 32, one of 30) and its steps.
const ROWS: u64 = 44 * 32 + 30;
const STEPS: u64 = 45;

/// `dflow partition` of `graph` at tp=2, batch 32.
fn partition(graph: &str) -> String {
    stdout(&dflow(&[
        "partition",
        graph,
        "--cluster",
        TWO_WORKERS,
        "--strategy",
        "tensor",
        "--tp",
        "2",
        "--features",
        "pixels",
        "--labels",
        "labels",
        "--batch-size",
        "32",
    ]))
}

/// Trains `by_hand` at tp=2 (`--local`, then 2 processes) and `plain` in one process for an
/// epoch: the losses and the parameters `params` agree within 1e-6, and each rank sends `bytes`
/// in collectives.
fn trains_like_one_process(dir: &Path, by_hand: &str, plain: &str, params: &[&str], bytes: u64) {
    let (want, _, want_params) = local(plain, &[], &dir.join("one"));
    let (got, stderr, got_params) = local(
        by_hand,
        &[
            "--cluster",
            TWO_WORKERS,
            "--strategy",
            "tensor",
            "--tp",
            "2",
        ],
        &dir.join("tp2"),
    );
    assert_eq!(got.len() as u64, STEPS);
    let worst = assert_same_losses(&got, &want, 1e-6);
    println!("{by_hand} --local tp=2: worst relative loss difference {worst:e}");
    for name in params {
        let (x, y) = (&got_params[*name], &want_params[*name]);
        assert_eq!(x.dims(), y.dims(), "{name}");
        let (x, y) = (x.as_slice::<f32>().unwrap(), y.as_slice::<f32>().unwrap());
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert!((p - q).abs() <= 1e-6, "{name}[{i}]: {p} vs {q}");
        }
    }
    let ends = end_of_task(&stderr);
    assert_eq!(ends.len(), 2, "{stderr}");
    for e in &ends {
        assert_eq!(e.collective, bytes, "{}", e.task);
    }
    // Two real processes: the same losses, parameters and bytes.
    let mut flags = digits_args(1);
    flags.extend(["--strategy", "tensor", "--tp", "2"].map(String::from));
    let ckpt = dir.join("procs-ckpt");
    let (got, chief) = worker_job(Path::new(by_hand), 2, &flags, &ckpt);
    let worst = assert_same_losses(&got, &want, 1e-6);
    println!("{by_hand} 2 processes tp=2: worst relative loss difference {worst:e}");
    let got_params = newest(&ckpt);
    for name in params {
        let (x, y) = (&got_params[*name], &want_params[*name]);
        for (i, (p, q)) in x
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .zip(y.as_slice::<f32>().unwrap())
            .enumerate()
        {
            assert!((p - q).abs() <= 1e-6, "{name}[{i}]: {p} vs {q}");
        }
    }
    let chief_end = end_of_task(&chief.stderr);
    assert_eq!(chief_end.len(), 1, "{}", chief.stderr);
    assert_eq!(chief_end[0].collective, bytes);
}

/// Shard(1) → Replicate: with `w2` replicated, the column-parallel layer's output is
/// all-gathered for the second layer (no rule takes `Shard(1) · Replicate`); its gradient is
/// the rank's slice, so the only traffic is the all-gather, (T−1)/T of `[rows, 32]` f32.
#[test]
fn shard_to_replicate_is_an_all_gather_whose_gradient_is_the_slice() {
    let _guard = serial();
    let dir = scratch("tensor-by-hand-gather");
    let (by_hand, plain) = variant(
        &dir,
        "gather",
        &[(
            "shape: [32, 10], _sharding: \"Shard(0)\")",
            "shape: [32, 10])",
        )],
    );
    let plan = partition(&by_hand);
    assert!(
        plan.contains(
            "CollectiveTpAllGather on layer1/relu → layer2/matmul[0]: Shard(1) → Replicate: \
             all-gather along 1; the rank's slice of its gradient backward; forward 2048 B, \
             backward 0 B"
        ),
        "{plan}"
    );
    // Ring all-gather over 2 ranks: each sends its half of [rows, 32] f32.
    let bytes = ROWS * 32 * 4 / 2;
    trains_like_one_process(&dir, &by_hand, &plain, &["w1", "b1", "w2", "b2"], bytes);
}

/// Replicate → Shard(1) and Partial → Shard(1): a replicated layer `x0 = x · w0` declared
/// `Shard(1)` is sliced (no traffic; its gradient all-gathered, as `w0` trains), `w1` is
/// row-parallel so `x0 · w1` is a partial sum, which the bias `b1` (`Shard(0)`) takes
/// reduce-scattered along 1 (its gradient all-gathered); the second layer is Megatron's row
/// layer, whose partial logits `g` all-reduces.
#[test]
fn replicate_to_shard_is_a_local_slice_and_partial_to_shard_a_reduce_scatter() {
    let _guard = serial();
    let dir = scratch("tensor-by-hand-reduce-scatter");
    let (by_hand, plain) = variant(
        &dir,
        "reduce-scatter",
        &[
            (
                "layer1/matmul = MatMul(x, w1)",
                "w0 = Variable(dtype: f32, initializer: glorot_uniform, seed: 3, shape: [64, 64])\n\
                 x0 = MatMul(x, w0, _sharding: \"Shard(1)\")\n\
                 layer1/matmul = MatMul(x0, w1)",
            ),
            (
                "shape: [64, 32], _sharding: \"Shard(1)\")",
                "shape: [64, 32], _sharding: \"Shard(0)\")",
            ),
        ],
    );
    let plan = partition(&by_hand);
    for line in [
        "CollectiveTpSlice on x0 → layer1/matmul[0]: Replicate → Shard(1): the rank's slice (no \
         traffic); all-gather of its gradient backward; forward 0 B, backward 4096 B",
        "CollectiveTpReduceScatter on layer1/matmul → layer1/bias[0]: Partial(sum) → Shard(1): \
         reduce-scatter along 1; all-gather of its gradient backward; forward 2048 B, backward \
         2048 B",
        "CollectiveTpReduce on layer2/matmul → logits[0]: Partial(sum) → Replicate: all-reduce \
         (g); forward 1280 B, backward 0 B",
    ] {
        assert!(plan.contains(line), "{line}\nin\n{plan}");
    }
    // Per row: the slice's gradient all-gathered ([rows, 64] f32, half sent), the
    // reduce-scatter and its gradient's all-gather ([rows, 32], half each) and g on the
    // logits ([rows, 10], 2(T−1)/T = 1×).
    let bytes = ROWS * (64 * 4 / 2 + 32 * 4 / 2 + 32 * 4 / 2 + 10 * 4);
    trains_like_one_process(
        &dir,
        &by_hand,
        &plain,
        &["w0", "w1", "b1", "w2", "b2"],
        bytes,
    );
}

/// Shard(1) → Shard(0): the column-parallel layer's output declared `Shard(0)` (rows) reaches
/// the second layer through an all-to-all (its gradient through the reverse one); `w2` and `b2`
/// are replicated and enter row-sharded ops, so they get `f` (their gradients all-reduced);
/// the cross-entropy has no rule for row-sharded logits with whole labels, so the logits are
/// all-gathered along 0.
#[test]
fn shard_to_another_shard_is_an_all_to_all_and_its_gradient_the_reverse() {
    let _guard = serial();
    let dir = scratch("tensor-by-hand-all-to-all");
    let (by_hand, plain) = variant(
        &dir,
        "all-to-all",
        &[
            (
                "layer1/relu = Relu(layer1/bias)",
                "layer1/relu = Relu(layer1/bias, _sharding: \"Shard(0)\")",
            ),
            (
                "shape: [32, 10], _sharding: \"Shard(0)\")",
                "shape: [32, 10])",
            ),
        ],
    );
    let plan = partition(&by_hand);
    for line in [
        "CollectiveTpAllToAll on layer1/relu → layer2/matmul[0]: Shard(1) → Shard(0): \
         all-to-all; the reverse all-to-all of its gradient backward; forward 1024 B, backward \
         1024 B",
        "CollectiveTpAllGather on logits → predictions[0], xent[0]: Shard(0) → Replicate: \
         all-gather along 0; the rank's slice of its gradient backward; forward 640 B, backward \
         0 B",
        "CollectiveTpCopy on w2 → layer2/matmul[1]: f",
        "CollectiveTpCopy on b2 → logits[1]: f",
    ] {
        assert!(plan.contains(line), "{line}\nin\n{plan}");
    }
    // Per row: the all-to-all of [rows, 32] f32 and its reverse, (T−1)/T of the rank's half
    // each way, and the logits' all-gather (half of [rows, 10]); per step, f's all-reduces of
    // the w2 and b2 gradients (2(T−1)/T = 1× of 1,280 and 40 bytes).
    let bytes = ROWS * (32 * 4 / 4 * 2 + 10 * 4 / 2) + STEPS * (32 * 10 * 4 + 10 * 4);
    trains_like_one_process(&dir, &by_hand, &plain, &["w1", "b1", "w2", "b2"], bytes);
}

/// A cluster file of 4 workers for `--local` runs (nothing listens: one process runs them).
fn four_workers(dir: &Path) -> String {
    let path = dir.join("cluster-4.json");
    std::fs::write(
        &path,
        r#"{"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"]}"#,
    )
    .unwrap();
    path.to_string_lossy().into_owned()
}

/// `--mesh dp=2,tp=2` on the deeper hand-placed MLP (a replicated layer in front, clipping by
/// the global norm at 0.5, which is active: the unclipped run's losses differ): two replicas of
/// the hand-placed TP group, each fed half of every batch, train with the losses and the
/// parameters of the one-process run, in one process and with 4 real processes; `dflow
/// partition` shows the dp groups beside the placements; the dp2×tp2 checkpoint holds whole
/// tensors, and one process resumes from it, continuing an uninterrupted two-epoch run.
#[test]
fn dp2_tp2_over_hand_placements_trains_like_one_process_and_resumes_in_one() {
    let _guard = serial();
    let dir = scratch("tensor-by-hand-dp2-tp2");
    let (by_hand, plain) = deeper(&dir);
    let four = four_workers(&dir);
    let mesh = ["--cluster", four.as_str(), "--mesh", "dp=2,tp=2"];
    // The plan: the placements on tp and the dp axis's groups.
    let mut args = vec!["partition", by_hand.as_str()];
    args.extend(mesh);
    args.extend([
        "--features",
        "pixels",
        "--labels",
        "labels",
        "--batch-size",
        "32",
    ]);
    let plan = stdout(&dflow(&args));
    for line in [
        "tensor parallelism by hand: tp=2",
        // One replica's section: half of the batch of 32 (and g's bytes halved).
        "layer1/matmul f32[16, 32]: Shard(1)",
        "CollectiveTpReduce on layer2/matmul → logits[0]: Partial(sum) → Replicate: all-reduce \
         (g); forward 640 B, backward 0 B",
        "data parallelism over the hand-placed groups: dp=2 × tp=2",
        "every parameter (shard or replicated) Replicate; the batch (pixels, labels) Shard(0)",
        "tp group tensor_d1: ranks 2, 3 (replica 1)",
        "dp group data_t0: ranks 0, 2 (shard 0): every gradient summed",
        "dp group data_t1: ranks 1, 3 (shard 1): every gradient summed",
        // w0 [64, 64], its half of w1 [64, 16], b1 [16], w2 [16, 10], b2 [10], f32.
        "gradients each rank sums over its dp group per step: 21224 B (rank 0), sending 21224 B",
    ] {
        assert!(plan.contains(line), "{line}\nin\n{plan}");
    }
    let (want, _, want_params) = local(&plain, &[], &dir.join("one"));
    // Clipping is active: without it the losses differ.
    let unclipped = dir.join("unclipped.dflow");
    std::fs::write(
        &unclipped,
        std::fs::read_to_string(&plain)
            .unwrap()
            .replace(", clip_global_norm: 0.5", ""),
    )
    .unwrap();
    let (free, _, _) = local(&unclipped.to_string_lossy(), &[], &dir.join("free"));
    assert!(
        want.iter()
            .zip(&free)
            .any(|((_, a), (_, b))| (a - b).abs() > 1e-3 * a.abs()),
        "clipping at 0.5 changes nothing: {want:?}"
    );
    // --local: the 4 ranks in one process.
    let (got, stderr, params) = local(&by_hand, &mesh, &dir.join("local"));
    assert_eq!(got.len() as u64, STEPS);
    let worst = assert_same_losses(&got, &want, 1e-6);
    println!("--local dp=2,tp=2: worst relative loss difference {worst:e}");
    assert_same_parameters(&params, &want_params, 1e-6);
    let (w0, v0) = (&params["w0"], &want_params["w0"]);
    for (p, q) in w0
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .zip(v0.as_slice::<f32>().unwrap())
    {
        assert!((p - q).abs() <= 1e-6, "w0: {p} vs {q}");
    }
    assert_eq!(end_of_task(&stderr).len(), 4, "{stderr}");
    // Four real processes.
    let mut flags = digits_args(1);
    flags.extend(["--mesh", "dp=2,tp=2"].map(String::from));
    let ckpt = dir.join("procs-ckpt");
    let (got, _) = worker_job(Path::new(&by_hand), 4, &flags, &ckpt);
    let worst = assert_same_losses(&got, &want, 1e-6);
    println!("4 processes dp=2,tp=2: worst relative loss difference {worst:e}");
    assert_same_parameters(&newest(&ckpt), &want_params, 1e-6);
    // One process without placements resumes from the dp2×tp2 checkpoint for a second epoch
    // and continues an uninterrupted two-epoch run.
    let (two_epochs, _, _) = local_epochs(&plain, 2, &[], &dir.join("two-epochs"));
    let losses = dir.join("resumed.txt");
    let (l, c) = (
        losses.to_string_lossy().into_owned(),
        ckpt.to_string_lossy().into_owned(),
    );
    let args_owned = digits_args(2);
    let mut args: Vec<&str> = vec!["run", "--local", &plain];
    args.extend(args_owned.iter().map(String::as_str));
    args.extend(["--losses-out", &l, "--checkpoint-dir", &c]);
    stdout(&dflow(&args));
    let resumed = read_losses(&losses);
    let first = got.len() as u64;
    assert!(
        resumed.first().is_some_and(|(s, _)| *s == first + 1),
        "{resumed:?}"
    );
    let tail: Vec<(u64, f64)> = two_epochs.into_iter().filter(|(s, _)| *s > first).collect();
    let worst = assert_same_losses(&resumed, &tail, 1e-5);
    println!(
        "resumed in one process from the dp2×tp2 checkpoint: worst relative difference {worst:e}"
    );
}

/// `examples/digits/digits-tp-zero.dflow`: the digits MLP with AdamW, Megatron's MLP layout on
/// `tp` and every variable's training state `Shard(0)` on `dp` (ZeRO).
const ZERO_BY_HAND: &str = "examples/digits/digits-tp-zero.dflow";

/// `text` without its `_sharding` attributes (the one-process twin of a hand-placed graph).
fn without_placements(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(", _sharding: \"") {
        out.push_str(&rest[..at]);
        let after = &rest[at + ", _sharding: \"".len()..];
        let end = after.find('"').expect("a closed _sharding string");
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    assert!(!out.contains("_sharding"));
    out
}

/// Writes `text` to `dir/name` and returns the path.
fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_string_lossy().into_owned()
}

/// Asserts every tensor of the one-process checkpoint `want` (parameters, AdamW slots, the
/// step) is in `got`, whole, within `tol`.
fn assert_same_state(
    got: &BTreeMap<String, dflow::graph::Tensor>,
    want: &BTreeMap<String, dflow::graph::Tensor>,
    tol: f32,
) {
    for (name, w) in want {
        let g = got
            .get(name)
            .unwrap_or_else(|| panic!("`{name}` missing from {:?}", got.keys()));
        assert_eq!(g.dims(), w.dims(), "{name}");
        if let (Ok(x), Ok(y)) = (g.as_slice::<f32>(), w.as_slice::<f32>()) {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                assert!((p - q).abs() <= tol, "{name}[{i}]: {p} vs {q}");
            }
        }
    }
}

/// ZeRO as the dp placement of the training state over hand placements: the digits MLP with
/// Megatron's MLP layout on tp and AdamW, clipped by the global norm, on `--mesh dp=2,tp=2`
/// with `--zero-stage 1` and `3` (and with `dp:Shard(0)` declared on every variable and no
/// flag: stage 1) trains with the losses, parameters and AdamW slots of the one-process run,
/// and with 4 real processes at stage 3; the stage-3 checkpoint holds whole tensors and one process resumes from it, continuing an
/// uninterrupted two-epoch run; `dflow partition` shows each variable's placement per axis and
/// the ZeRO collectives with their bytes.
#[test]
fn zero_over_hand_placements_on_dp2_tp2_trains_like_one_process_and_resumes_in_one() {
    let _guard = serial();
    let dir = scratch("tensor-by-hand-zero");
    let declared = std::fs::read_to_string(repo().join(ZERO_BY_HAND)).unwrap();
    let plain = write(&dir, "plain.dflow", &without_placements(&declared));
    // The same placements on tp in the single form, nothing on dp: ZeRO by the flag.
    let tp_only = write(
        &dir,
        "tp-only.dflow",
        &declared
            .replace("\"dp:Shard(0),tp:Shard(1)\"", "\"Shard(1)\"")
            .replace("\"dp:Shard(0),tp:Shard(0)\"", "\"Shard(0)\"")
            .replace(", _sharding: \"dp:Shard(0)\"", ""),
    );
    let four = "examples/gpt/cluster-4workers.json";
    let mesh = ["--cluster", four, "--mesh", "dp=2,tp=2"];
    let (want, _, want_state) = local(&plain, &[], &dir.join("one"));
    assert!(
        want_state.contains_key("w1/adam_m"),
        "{:?}",
        want_state.keys()
    );
    for (graph, stage) in [
        (tp_only.as_str(), Some("1")),
        (tp_only.as_str(), Some("3")),
        (ZERO_BY_HAND, None),
    ] {
        let mut flags = mesh.to_vec();
        if let Some(s) = stage {
            flags.extend(["--zero-stage", s]);
        }
        let name = format!("zero-{}", stage.unwrap_or("declared"));
        let (got, stderr, state) = local(graph, &flags, &dir.join(&name));
        let worst = assert_same_losses(&got, &want, 1e-6);
        println!("--local dp=2,tp=2 {name}: worst relative loss difference {worst:e}");
        assert_same_parameters(&state, &want_state, 1e-6);
        assert_same_state(&state, &want_state, 1e-6);
        assert_eq!(end_of_task(&stderr).len(), 4, "{stderr}");
    }
    // Four real processes, the dp placements and --zero-stage 3.
    let mut flags = digits_args(1);
    flags.extend(["--mesh", "dp=2,tp=2", "--zero-stage", "3"].map(String::from));
    let ckpt = dir.join("procs-ckpt");
    let (got, _) = worker_job(Path::new(ZERO_BY_HAND), 4, &flags, &ckpt);
    let worst = assert_same_losses(&got, &want, 1e-6);
    println!("4 processes dp=2,tp=2 ZeRO-3: worst relative loss difference {worst:e}");
    assert_same_parameters(&newest(&ckpt), &want_state, 1e-6);
    // One process without placements resumes from the stage-3 checkpoint for a second epoch
    // and continues an uninterrupted two-epoch run.
    let (two_epochs, _, _) = local_epochs(&plain, 2, &[], &dir.join("two-epochs"));
    let losses = dir.join("resumed.txt");
    let (l, c) = (
        losses.to_string_lossy().into_owned(),
        dir.join("zero-3/ckpt").to_string_lossy().into_owned(),
    );
    let args_owned = digits_args(2);
    let mut args: Vec<&str> = vec!["run", "--local", &plain];
    args.extend(args_owned.iter().map(String::as_str));
    args.extend(["--losses-out", &l, "--checkpoint-dir", &c]);
    stdout(&dflow(&args));
    let resumed = read_losses(&losses);
    let first = want.len() as u64;
    assert!(
        resumed.first().is_some_and(|(s, _)| *s == first + 1),
        "{resumed:?}"
    );
    let tail: Vec<(u64, f64)> = two_epochs.into_iter().filter(|(s, _)| *s > first).collect();
    let worst = assert_same_losses(&resumed, &tail, 1e-5);
    println!("resumed in one process from the ZeRO-3 dp2×tp2 checkpoint: worst {worst:e}");
    // The plan: placements per axis, and ZeRO's collectives over the dp group with their bytes.
    let mut args = vec!["partition", ZERO_BY_HAND];
    args.extend(mesh);
    args.extend(["--features", "pixels", "--labels", "labels"]);
    args.extend(["--batch-size", "32"]);
    let plan = stdout(&dflow(&args));
    // Rank 0's weights: its halves of w1 [64, 16], b1 [16], w2 [16, 10] and b2 [10], 1,210
    // floats (all even: no padding), 4,840 B.
    for line in [
        "ZeRO stage 1: its Adam slots flattened and cut in 2 parts over its dp group",
        "  w1 f32[64, 32]: dp:Shard(0),tp:Shard(1)",
        "  b2 f32[10]: dp:Shard(0),tp:Replicate",
        "dp group data_t1: ranks 1, 3 (shard 1): ZeRO stage 1",
        "ZeRO collectives rank 0 runs over its dp group data_t0 per step",
        // Stage 1: the gradients all-reduced (2(D−1)/D = 1×), the updated halves gathered.
        "  zero/bucket_0/all_reduce (all-reduce of 4840 B): 4840 B",
        "  zero/bucket_0/all_gather (all-gather of 2420 B): 2420 B",
        // Clipping's two sums and the loss's: 3 × 4 B.
        "bytes rank 0 sends over its dp group per step: 7272 B",
    ] {
        assert!(plan.contains(line), "{line}\nin\n{plan}");
    }
}

/// Placements per axis written in JSON (`dp:Replicate,tp:Shard(1)`, converted from the DSL by
/// `dflow convert`) train exactly like the single form on `--mesh dp=2,tp=2`; with Adam and
/// `--zero-stage 3`, the variables declared `dp:Replicate` stay whole while the others are
/// sharded, training like one process; a dp placement ZeRO has no layout for is refused naming
/// the variable.
#[test]
fn per_axis_placements_in_json_train_like_the_single_form_and_dp_replicate_stays_out_of_zero() {
    let _guard = serial();
    let dir = scratch("tensor-by-hand-per-axis");
    let (by_hand, _) = deeper(&dir);
    let single = std::fs::read_to_string(&by_hand).unwrap();
    let per_axis = single
        .replace("\"Shard(1)\"", "\"dp:Replicate,tp:Shard(1)\"")
        .replace("\"Shard(0)\"", "\"tp:Shard(0), dp:Replicate\"");
    assert_ne!(per_axis, single);
    let dsl = write(&dir, "per-axis.dflow", &per_axis);
    let json = dir.join("per-axis.json");
    let json = json.to_string_lossy().into_owned();
    stdout(&dflow(&["convert", &dsl, "--to", "json", "-o", &json]));
    let text = std::fs::read_to_string(&json).unwrap();
    assert!(
        text.contains("\"_sharding\": \"dp:Replicate,tp:Shard(1)\""),
        "{text}"
    );
    let four = four_workers(&dir);
    let mesh = ["--cluster", four.as_str(), "--mesh", "dp=2,tp=2"];
    let (want, _, want_params) = local(&by_hand, &mesh, &dir.join("single"));
    let (got, _, params) = local(&json, &mesh, &dir.join("json"));
    assert_eq!(got.len(), want.len());
    let worst = assert_same_losses(&got, &want, 1e-6);
    println!("per-axis JSON vs single form: worst relative loss difference {worst:e}");
    assert_same_parameters(&params, &want_params, 1e-6);
    // ZeRO for some variables only: under --zero-stage 3, `w0` and `b2` (no dp placement) are
    // sharded over their dp group, `w1`, `b1` and `w2` (dp:Replicate) stay whole; one clipping
    // norm over both; the same training as one process.
    let adamw = per_axis.replace("optimizer: sgd(lr: 0.1)", "optimizer: adam(lr: 0.01)");
    assert_ne!(adamw, per_axis);
    let mixed = write(&dir, "mixed.dflow", &adamw);
    let plain = write(&dir, "mixed-plain.dflow", &without_placements(&adamw));
    let (want, _, want_state) = local(&plain, &[], &dir.join("mixed-one"));
    let mut flags = mesh.to_vec();
    flags.extend(["--zero-stage", "3"]);
    let (got, _, state) = local(&mixed, &flags, &dir.join("mixed-zero3"));
    let worst = assert_same_losses(&got, &want, 1e-6);
    println!("dp:Replicate beside ZeRO-3: worst relative loss difference {worst:e}");
    assert_same_parameters(&state, &want_state, 1e-6);
    assert_same_state(&state, &want_state, 1e-6);
    let mut args = vec!["partition", mixed.as_str()];
    args.extend(mesh);
    args.extend([
        "--zero-stage",
        "3",
        "--features",
        "pixels",
        "--labels",
        "labels",
    ]);
    let plan = stdout(&dflow(&args));
    for line in [
        "each parameter below declared so's training state Shard(0), ZeRO stage 3",
        "  w1 f32[64, 32]: dp:Replicate,tp:Shard(1)",
        "  w0 f32[64, 64]: dp:Shard(0),tp:Replicate",
        "  b2 f32[10]: dp:Shard(0),tp:Replicate",
    ] {
        assert!(plan.contains(line), "{line}\nin\n{plan}");
    }
    // A dp placement ZeRO has no layout for: refused at load, naming the node.
    let bad = write(
        &dir,
        "bad.dflow",
        &adamw.replace("dp:Replicate,tp:Shard(1)", "dp:Shard(1),tp:Shard(1)"),
    );
    let out = dflow(&["check", &bad]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        e.contains("w1") && e.contains("dp:Shard(1): a variable's training state"),
        "{e}"
    );
}
