//! The small GPT the mesh tests train (2 blocks, 4 heads, 32 channels, context 8, clipping
//! active) and the runs they compare: one process (`--local`, or every task of a cluster in
//! this process) and a job of worker processes. Used by `cluster_mesh.rs`,
//! `cluster_mesh_zero.rs` and `cluster_pipeline_zero.rs`.

use super::{dflow, read_losses, stdout, worker_job};
use std::path::{Path, PathBuf};

/// The bundled corpus.
pub const CORPUS: &str = "examples/data/shakespeare.txt.gz";

/// A GPT of 2 blocks, 4 heads, 32 channels, context 8, over the corpus's 76 characters,
/// clipping at 0.5 so that clipping is active.
pub fn config() -> dflow::graph::layers::GptConfig {
    dflow::graph::layers::GptConfig {
        block_size: 8,
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        learning_rate: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 2,
        decay_steps: 20,
        grad_clip: Some(0.5),
        ..dflow::graph::layers::GptConfig::default()
    }
}

/// [`config`]'s GPT written to `dir/gpt.json`.
pub fn gpt_file(dir: &Path) -> PathBuf {
    let path = dir.join("gpt.json");
    std::fs::write(
        &path,
        dflow::graph::format::to_json(&dflow::graph::layers::gpt(&config()).unwrap().def),
    )
    .unwrap();
    path
}

/// The flags every run shares: 4 rows per batch (2 per data-parallel replica).
pub fn common(steps: u32) -> Vec<String> {
    common_rows(steps, 4)
}

/// [`common`] with `rows` rows per batch.
pub fn common_rows(steps: u32, rows: usize) -> Vec<String> {
    [
        "--data",
        CORPUS,
        "--batch-size",
        &rows.to_string(),
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

/// Turns [`common_rows`]' evaluation off (`--eval-batches 0`) in `args`.
pub fn no_evaluation(args: &mut [String]) {
    if let Some(i) = args.iter().position(|a| a == "--eval-batches") {
        if let Some(v) = args.get_mut(i + 1) {
            *v = "0".into();
        }
    }
}

/// One process (`--local`, plus `extra`): its losses; checkpoints to (and resumes from) `ckpt`.
pub fn local_run(graph: &Path, steps: u32, ckpt: &Path, extra: &[&str]) -> Vec<(u64, f64)> {
    local_run_validated(graph, steps, ckpt, extra).0
}

/// [`local_run`]: its losses and its final `validation loss: …` line (empty if none).
#[allow(dead_code)]
pub fn local_run_validated(
    graph: &Path,
    steps: u32,
    ckpt: &Path,
    extra: &[&str],
) -> (Vec<(u64, f64)>, String) {
    let losses = ckpt.with_extension("losses.txt");
    let mut args: Vec<String> = vec!["run".into(), "--local".into()];
    args.push(graph.to_string_lossy().into_owned());
    args.extend(common(steps));
    args.extend([
        "--losses-out".into(),
        losses.to_string_lossy().into_owned(),
        "--checkpoint-dir".into(),
        ckpt.to_string_lossy().into_owned(),
    ]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = stdout(&dflow(&args));
    let validation = out
        .lines()
        .find(|l| l.starts_with("validation loss: "))
        .unwrap_or_default()
        .to_string();
    (read_losses(&losses), validation)
}

/// `workers` worker processes running with `layout` (e.g. `--mesh dp=2,tp=2`): the chief's
/// losses; checkpoints to (and resumes from) `ckpt`.
pub fn job(
    graph: &Path,
    workers: usize,
    layout: &[&str],
    steps: u32,
    ckpt: &Path,
) -> Vec<(u64, f64)> {
    let mut flags = common(steps);
    flags.extend(layout.iter().map(|s| s.to_string()));
    worker_job(graph, workers, &flags, ckpt).0
}

/// A cluster spec of `n` workers on unused local ports (for `--local`, which binds none).
pub fn workers_file(dir: &Path, n: usize) -> PathBuf {
    let addrs: Vec<String> = (0..n)
        .map(|i| format!("\"127.0.0.1:{}\"", 2300 + i))
        .collect();
    let path = dir.join(format!("cluster-{n}workers.json"));
    std::fs::write(&path, format!("{{\"worker\": [{}]}}", addrs.join(", "))).unwrap();
    path
}
