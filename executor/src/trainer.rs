//! The training loop: feed batches, run the training step, report progress, save and restore
//! checkpoints so a restarted run continues exactly where it stopped.

use crate::checkpoint::{self, CheckpointError};
use crate::data::{DataError, Dataset};
use crate::error::ExecError;
use crate::session::Session;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// What to feed, what to run, and for how long.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Placeholder fed with the features batch.
    pub features: String,
    /// Placeholder fed with the labels batch.
    pub labels: String,
    /// Tensor fetched every step and reported as the loss.
    pub loss: String,
    /// Node run every step to apply the updates.
    pub train_op: String,
    /// Epochs to train (counting epochs already done before a restore).
    pub epochs: u64,
    /// Examples per step.
    pub batch_size: usize,
    /// Seed of the per-epoch shuffle.
    pub shuffle_seed: u64,
    /// Where checkpoints go; `None` disables them.
    pub checkpoint_dir: Option<PathBuf>,
    /// Save every N steps (0: only at the end).
    pub save_every: u64,
    /// Checkpoints kept on disk.
    pub keep_checkpoints: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            features: "x".into(),
            labels: "labels".into(),
            loss: "loss".into(),
            train_op: "train".into(),
            epochs: 1,
            batch_size: 32,
            shuffle_seed: 0,
            checkpoint_dir: None,
            save_every: 0,
            keep_checkpoints: 3,
        }
    }
}

/// Why training stopped early.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A step failed.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The data could not be batched.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A checkpoint could not be saved or restored.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The configuration does not fit the graph or the data.
    #[error("{0}")]
    Config(String),
}

/// One finished step, for progress reporting.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// Global step (1-based, continues across restores).
    pub step: u64,
    /// Steps the whole run will take.
    pub total_steps: u64,
    /// Epoch of this step (0-based).
    pub epoch: u64,
    /// The loss fetched this step.
    pub loss: f64,
    /// Examples in this step's batch.
    pub examples: usize,
}

/// What a finished `fit` did.
#[derive(Debug, Clone)]
pub struct FitSummary {
    /// The step the run restored from, if it did.
    pub resumed_from: Option<u64>,
    /// The last global step.
    pub final_step: u64,
    /// Loss of every step this call ran, in order.
    pub losses: Vec<f64>,
    /// Examples processed by this call.
    pub examples: u64,
    /// Wall time of this call's steps.
    pub elapsed: Duration,
    /// The last checkpoint written, if any.
    pub checkpoint: Option<PathBuf>,
}

fn scalar(t: &dflow_graph::Tensor) -> f64 {
    t.to_f64_vec().first().copied().unwrap_or(f64::NAN)
}

/// Restores the newest checkpoint in `dir` into the session's variables; returns its step.
pub fn restore_latest(session: &Session, dir: &std::path::Path) -> Result<Option<u64>, TrainError> {
    let Some(path) = checkpoint::latest(dir)? else {
        return Ok(None);
    };
    let ckpt = checkpoint::load(&path)?;
    let expected = session.variable_specs();
    for (name, value) in checkpoint::restore_into(&expected, &ckpt)? {
        session.assign_variable(&name, value)?;
    }
    Ok(Some(ckpt.step))
}

/// Saves every variable of the session at `step`.
pub fn save_checkpoint(
    session: &Session,
    dir: &std::path::Path,
    step: u64,
    keep: usize,
) -> Result<PathBuf, TrainError> {
    let tensors: Vec<(String, dflow_graph::Tensor)> = session
        .variables()
        .into_iter()
        .map(|(_, n, t)| (n, t))
        .collect();
    let path = checkpoint::save(dir, step, &tensors, &BTreeMap::new())?;
    if keep > 0 {
        checkpoint::keep_last(dir, keep)?;
    }
    Ok(path)
}

/// Trains on `data`, calling `on_step` after every step. With a checkpoint directory holding a
/// checkpoint, training resumes at its step: the same batches in the same order follow, so the
/// losses equal those of an uninterrupted run.
pub fn fit(
    session: &Session,
    cfg: &TrainConfig,
    data: &Dataset,
    mut on_step: impl FnMut(&StepReport),
) -> Result<FitSummary, TrainError> {
    if data.is_empty() {
        return Err(TrainError::Config("the training set is empty".into()));
    }
    if cfg.batch_size == 0 {
        return Err(TrainError::Config("batch size must be at least 1".into()));
    }
    let steps_per_epoch = data.num_batches(cfg.batch_size, false) as u64;
    let total_steps = steps_per_epoch * cfg.epochs;
    let resumed_from = match &cfg.checkpoint_dir {
        Some(dir) => restore_latest(session, dir)?,
        None => None,
    };
    let mut step = resumed_from.unwrap_or(0);
    let mut losses = Vec::new();
    let mut examples = 0u64;
    let mut last_ckpt = None;
    let start = Instant::now();
    let fetches = [cfg.loss.as_str()];
    let targets = [cfg.train_op.as_str()];
    while step < total_steps {
        let epoch = step / steps_per_epoch;
        let skip = (step % steps_per_epoch) as usize;
        for batch in data
            .batches(cfg.batch_size, Some(cfg.shuffle_seed), epoch, false)?
            .skip(skip)
        {
            let (x, y) = batch?;
            let n = y.num_elements();
            let out = session.run(
                &[(cfg.features.as_str(), x), (cfg.labels.as_str(), y)],
                &fetches,
                &targets,
            )?;
            step += 1;
            let loss = out.first().map(scalar).unwrap_or(f64::NAN);
            losses.push(loss);
            examples += n as u64;
            on_step(&StepReport {
                step,
                total_steps,
                epoch,
                loss,
                examples: n,
            });
            if let Some(dir) = &cfg.checkpoint_dir {
                if cfg.save_every > 0 && step % cfg.save_every == 0 {
                    last_ckpt = Some(save_checkpoint(session, dir, step, cfg.keep_checkpoints)?);
                }
            }
        }
    }
    if let Some(dir) = &cfg.checkpoint_dir {
        if last_ckpt.is_none() || cfg.save_every == 0 || step % cfg.save_every != 0 {
            last_ckpt = Some(save_checkpoint(session, dir, step, cfg.keep_checkpoints)?);
        }
    }
    Ok(FitSummary {
        resumed_from,
        final_step: step,
        losses,
        examples,
        elapsed: start.elapsed(),
        checkpoint: last_ckpt,
    })
}

/// The example-weighted mean of scalar metric `metric` over `data`, in batches.
pub fn evaluate(
    session: &Session,
    cfg: &TrainConfig,
    data: &Dataset,
    metric: &str,
) -> Result<f64, TrainError> {
    let mut sum = 0.0;
    let mut count = 0usize;
    for batch in data.batches(cfg.batch_size.max(1), None, 0, false)? {
        let (x, y) = batch?;
        let n = y.num_elements();
        let out = session.run(
            &[(cfg.features.as_str(), x), (cfg.labels.as_str(), y)],
            &[metric],
            &[],
        )?;
        sum += out.first().map(scalar).unwrap_or(f64::NAN) * n as f64;
        count += n;
    }
    if count == 0 {
        return Err(TrainError::Config("the evaluation set is empty".into()));
    }
    Ok(sum / count as f64)
}
