//! Tensor parallelism (`--strategy tensor --tp T`) with real `dflow` processes, workers only:
//! a small GPT trained with AdamW and global-norm clipping at TP=2 and TP=4 has the losses and
//! the parameters (saved whole, assembled from the shards) of a one-process run; a vocabulary
//! that does not divide by T (padded and masked) gives the same losses too; and a checkpoint
//! saved at TP=2 resumes at TP=1 (one process) and TP=4 with the same next-step loss.

mod support;

use dflow::executor::checkpoint;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use support::*;

const CORPUS: &str = "examples/data/shakespeare.txt.gz";
/// The test GPT's channels.
const EMBD: usize = 32;

/// A GPT of 2 blocks, 4 heads, 32 channels, context 8, over `vocab` tokens (≥ the corpus's 76),
/// clipping at 0.5 so that clipping is active, written to `dir/gpt-v<vocab>.json`.
fn gpt_file(dir: &Path, vocab: usize) -> PathBuf {
    use dflow::graph::layers::{gpt, GptConfig};
    let cfg = GptConfig {
        vocab_size: vocab,
        block_size: 8,
        n_layer: 2,
        n_head: 4,
        n_embd: EMBD,
        learning_rate: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 2,
        decay_steps: 20,
        grad_clip: Some(0.5),
        ..GptConfig::default()
    };
    let path = dir.join(format!("gpt-v{vocab}.json"));
    std::fs::write(
        &path,
        dflow::graph::format::to_json(&gpt(&cfg).unwrap().def),
    )
    .unwrap();
    path
}

fn common(steps: u32) -> Vec<String> {
    [
        "--data",
        CORPUS,
        "--batch-size",
        "4",
        "--steps",
        &steps.to_string(),
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--quiet",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// One process (`--local`): its losses; checkpoints to (and resumes from) `ckpt`.
fn one_process(graph: &Path, steps: u32, ckpt: &Path, losses: &Path) -> Vec<(u64, f64)> {
    one_process_out(graph, steps, ckpt, losses).0
}

/// [`one_process`] with its stdout.
fn one_process_out(
    graph: &Path,
    steps: u32,
    ckpt: &Path,
    losses: &Path,
) -> (Vec<(u64, f64)>, String) {
    let mut args: Vec<String> = vec!["run".into(), "--local".into()];
    args.push(graph.to_string_lossy().into_owned());
    args.extend(common(steps));
    args.extend([
        "--losses-out".into(),
        losses.to_string_lossy().into_owned(),
        "--checkpoint-dir".into(),
        ckpt.to_string_lossy().into_owned(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = stdout(&dflow(&args));
    (read_losses(losses), out)
}

/// The `validation loss: …` line of a run's stdout.
fn validation(out: &str) -> &str {
    out.lines()
        .find(|l| l.starts_with("validation loss"))
        .unwrap_or_else(|| panic!("no validation loss in:\n{out}"))
}

/// `tp` worker processes under `--strategy tensor --tp tp`: the chief's losses and stdout;
/// checkpoints to (and resumes from) `ckpt`.
fn tensor_job(graph: &Path, tp: usize, steps: u32, ckpt: &Path) -> (Vec<(u64, f64)>, String) {
    let mut flags = common(steps);
    flags.extend(["--strategy".into(), "tensor".into()]);
    flags.extend(["--tp".into(), tp.to_string()]);
    let (losses, chief) = worker_job(graph, tp, &flags, ckpt);
    (losses, chief.stdout)
}

/// The newest checkpoint's tensors in `dir`.
fn newest(dir: &Path) -> BTreeMap<String, dflow::graph::Tensor> {
    let path = checkpoint::latest(dir).unwrap().expect("a checkpoint");
    checkpoint::load(&path).unwrap().tensors
}

/// The key bias's entries of a fused q/k/v bias (or its AdamW slots) of `embd` channels: their
/// gradient is exactly zero (softmax does not change when every score of a query moves by the
/// same `q·b_k`), so both runs hold only rounding noise, which AdamW's `m/(√v+ε)` scales up.
fn key_bias(name: &str, embd: usize) -> Option<std::ops::Range<usize>> {
    let base = name.split('/').next()?;
    (base.starts_with("transformer.h.") && base.ends_with(".attn.c_attn.bias"))
        .then_some(embd..2 * embd)
}

/// Every tensor of `got` equals `want`'s within `tol` relative to the tensor's largest
/// magnitude, the same names and shapes; the key biases (see [`key_bias`]) are noise of at
/// most 1e-5 in both. Returns the worst relative error.
fn assert_same_tensors(
    what: &str,
    got: &BTreeMap<String, dflow::graph::Tensor>,
    want: &BTreeMap<String, dflow::graph::Tensor>,
    tol: f64,
) -> f64 {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: the checkpoint's tensors"
    );
    let mut worst = 0.0f64;
    for (name, w) in want {
        let g = &got[name];
        assert_eq!(g.dims(), w.dims(), "{what}: {name}");
        let (a, b) = (g.to_f64_vec(), w.to_f64_vec());
        let noise = key_bias(name, EMBD).unwrap_or(0..0);
        let scale = b
            .iter()
            .enumerate()
            .filter(|(i, _)| !noise.contains(i))
            .fold(f64::MIN_POSITIVE, |m, (_, y)| m.max(y.abs()));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            if noise.contains(&i) {
                assert!(
                    x.abs() <= 1e-5 && y.abs() <= 1e-5,
                    "{what}: key bias {name}[{i}] = {x}, one process {y}: not noise"
                );
                continue;
            }
            let err = (x - y).abs() / scale;
            worst = worst.max(err);
            assert!(
                err <= tol,
                "{what}: {name}[{i}] = {x}, one process {y} (tensor scale {scale})"
            );
        }
    }
    worst
}

#[test]
fn tp2_and_tp4_train_the_gpt_like_one_process() {
    let _serial = serial();
    let dir = scratch("tensor-parallel");
    let graph = gpt_file(&dir, 76);
    let ckpt1 = dir.join("ckpt-one");
    let (one, one_out) = one_process_out(&graph, 5, &ckpt1, &dir.join("one.txt"));
    assert_eq!(one.len(), 5);
    let want = newest(&ckpt1);
    for tp in [2usize, 4] {
        let ckpt = dir.join(format!("ckpt-tp{tp}"));
        let (losses, out) = tensor_job(&graph, tp, 5, &ckpt);
        let worst = assert_same_losses(&losses, &one, 1e-5);
        eprintln!("tp={tp}: worst relative loss difference {worst:e}");
        // Parameters and AdamW slots, gathered whole from the shards, under one-process names.
        let worst = assert_same_tensors(&format!("tp={tp}"), &newest(&ckpt), &want, 1e-5);
        eprintln!("tp={tp}: worst relative parameter/slot difference {worst:e}");
        // Evaluation on worker 0 (the one-process graph on weights assembled from the shards)
        // reports the one-process validation loss.
        assert_eq!(validation(&out), validation(&one_out));
    }
}

#[test]
fn a_vocabulary_not_divisible_by_tp_is_padded_and_masked() {
    let _serial = serial();
    let dir = scratch("tensor-parallel-pad");
    // 78 tokens over 4 ranks: padded to 80, the last rank's 2 padding logits masked.
    let graph = gpt_file(&dir, 78);
    let one = one_process(&graph, 3, &dir.join("ckpt-one"), &dir.join("one.txt"));
    let ckpt = dir.join("ckpt-tp4");
    let (losses, _) = tensor_job(&graph, 4, 3, &ckpt);
    assert_same_losses(&losses, &one, 1e-5);
    // The checkpoint holds the unpadded [78, 32] embedding.
    assert_eq!(newest(&ckpt)["transformer.wte.weight"].dims(), &[78, 32]);
}

#[test]
fn a_checkpoint_saved_at_tp2_resumes_at_tp1_and_tp4() {
    let _serial = serial();
    let dir = scratch("tensor-parallel-reshard");
    let graph = gpt_file(&dir, 76);
    // 3 steps at TP=2, checkpointed.
    let saved = dir.join("ckpt-tp2");
    let (first, _) = tensor_job(&graph, 2, 3, &saved);
    assert_eq!(first.len(), 3);
    // Resumed in one process (TP=1, no strategy) and at TP=4: steps 4 and 5 from it.
    let copy = |name: &str| {
        let to = dir.join(name);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&saved).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
        to
    };
    let at1 = one_process(&graph, 5, &copy("ckpt-tp1"), &dir.join("tp1.txt"));
    let (at4, _) = tensor_job(&graph, 4, 5, &copy("ckpt-tp4"));
    assert_eq!(at1.iter().map(|l| l.0).collect::<Vec<_>>(), [4, 5]);
    assert_eq!(at4.iter().map(|l| l.0).collect::<Vec<_>>(), [4, 5]);
    // The next step's loss is the same whichever layout resumed (the step count, the AdamW
    // slots and the data order continue).
    let next = (at1[0].1 - at4[0].1).abs() / at1[0].1.abs();
    assert!(
        next <= 1e-6,
        "next-step loss {} at TP=1, {} at TP=4",
        at1[0].1,
        at4[0].1
    );
    assert_same_losses(&at4, &at1, 1e-5);
    // And it continues the uninterrupted one-process run.
    let straight = one_process(
        &graph,
        5,
        &dir.join("ckpt-straight"),
        &dir.join("straight.txt"),
    );
    let mut resumed = first.clone();
    resumed.extend(at1);
    assert_same_losses(&resumed, &straight, 1e-5);
}

#[test]
fn partition_shows_each_placement_and_collective_with_its_bytes() {
    let out = dflow(&[
        "partition",
        "examples/gpt/gpt.json",
        "--cluster",
        "examples/gpt/cluster-2workers.json",
        "--strategy",
        "tensor",
        "--tp",
        "2",
        "--features",
        "idx",
        "--labels",
        "targets",
        "--batch-size",
        "8",
    ]);
    let text = stdout(&out);
    assert!(
        text.contains(
            "transformer.h.0.attn.c_proj.weight [128, 128]: Shard(1); [128, 64] per rank"
        ),
        "{text}"
    );
    assert!(text.contains("transformer.h.0.attn.c_attn.weight [384, 128]: Shard(0), 3 blocks"));
    // Activations, placed by the sharding rules.
    assert!(
        text.contains("attn.c_proj/matmul: Partial(sum) → Replicate by all-reduce (sum)"),
        "{text}"
    );
    assert!(text.contains("attn/probs: Shard(1)"), "{text}");
    // b·s·h = 8·64·128 floats: 262,144 bytes whole; a 2-rank ring all-reduce sends as many.
    // 4 blocks × 2 + the embedding forward, 4 × 2 + the head's input backward.
    assert!(
        text.contains("bytes each rank sends per step: forward 2359296 B, backward 2359296 B"),
        "{text}"
    );
    assert_eq!(
        text.matches("Partial → Replicate: all-reduce (g); f32[512, 128]")
            .count(),
        8
    );
    // A head count that does not divide is an error naming it.
    let out = dflow(&[
        "partition",
        "examples/gpt/gpt.json",
        "--cluster",
        "examples/gpt/cluster-4workers.json",
        "--strategy",
        "tensor",
        "--tp",
        "3",
        "--features",
        "idx",
        "--labels",
        "targets",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--tp 3 does not divide the cluster's 4 workers"),
        "{err}"
    );
    let dir = scratch("tensor-parallel-partition");
    let three = dir.join("cluster-3workers.json");
    std::fs::write(
        &three,
        r#"{"worker": ["127.0.0.1:2243", "127.0.0.1:2244", "127.0.0.1:2245"]}"#,
    )
    .unwrap();
    let out = dflow(&[
        "partition",
        "examples/gpt/gpt.json",
        "--cluster",
        three.to_str().unwrap(),
        "--strategy",
        "tensor",
        "--features",
        "idx",
        "--labels",
        "targets",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the number of heads (n_head) of transformer.h.0.attn is 4, which does not divide by --tp 3"),
        "{err}"
    );
}

/// Tensor parallelism's sharded evaluation finishes on one CPU (each task one compute thread):
/// rank 1 needs the held-out labels from worker 0 (1,024 tokens, a `Send` that is not a cheap
/// node) before its first tp collective, and worker 0 must not block in that collective with
/// the `Send` queued behind it on its thread (`tensor::eval::sends_before_collectives`; without
/// it this hung until the step timeout), nor under `tp=2,pp=2` on the stages. The validation
/// loss is one process's. Skipped without `taskset`.
#[test]
fn the_sharded_evaluation_finishes_on_one_cpu() {
    let pinned = std::process::Command::new("taskset")
        .args(["-c", "0", "true"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !pinned {
        eprintln!("no taskset: skipped");
        return;
    }
    let validation = |extra: &[&str]| {
        let out = std::process::Command::new("taskset")
            .args(["-c", "0"])
            .arg(env!("CARGO_BIN_EXE_dflow"))
            .args(["run", "--local", "examples/gpt/gpt.json"])
            .args(extra)
            .args([
                "--data",
                "examples/data/shakespeare.txt.gz",
                "--batch-size",
                "4",
                "--steps",
                "0",
                "--eval-batches",
                "1",
                "--timeout",
                "20",
                "--quiet",
            ])
            .current_dir(repo())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.starts_with("validation loss: "))
            .unwrap_or_default()
            .to_string()
    };
    let one = validation(&[]);
    assert!(!one.is_empty(), "no validation loss printed");
    for (cluster, mesh) in [
        ("examples/gpt/cluster-2workers.json", "dp=1,tp=2"),
        // On the stages (`pipeline::eval`): rank 1 of stage 0 waited for `wpe` the same way.
        ("examples/gpt/cluster-4workers.json", "dp=1,tp=2,pp=2"),
    ] {
        assert_eq!(
            validation(&["--cluster", cluster, "--mesh", mesh]),
            one,
            "{mesh}"
        );
    }
}
