//! The chief's view of a job's data: how many steps, which batch each step names, what the
//! feeding tasks are told about the data, and the held-out batches the chief evaluates on.

use super::{setup, ChiefConfig, ChiefData, EvalBatch};
use crate::cluster::node::JobError;
use crate::cluster::protocol::{DataKind, DataSpec};
use crate::data::text::{token_digest, CharCorpus, CharWindows, VAL_SEED_SALT};
use crate::data::Dataset;

/// The chief's view of the run's data: the steps, what each step's batch is, and the
/// held-out batches.
#[derive(Debug)]
pub(super) enum Source {
    Csv {
        train: Dataset,
        test: Dataset,
        steps_per_epoch: u64,
        epochs: u64,
        test_fraction: f64,
        rows: u64,
    },
    Text {
        corpus: CharCorpus,
        block_size: usize,
        val_fraction: f64,
        val: Option<CharWindows>,
        steps: u64,
        eval_batches: u64,
    },
}

impl Source {
    /// The data of `cfg`, split, with its sizes checked as every task will check them.
    pub(super) fn new(cfg: &ChiefConfig) -> Result<Source, JobError> {
        if cfg.batch_size == 0 {
            return Err(setup("batch size must be at least 1"));
        }
        match &cfg.data {
            ChiefData::Csv {
                data,
                test_fraction,
                epochs,
            } => {
                let (train, test) = data.split(*test_fraction, cfg.seed).map_err(setup)?;
                if train.is_empty() {
                    return Err(setup("the training split is empty"));
                }
                if cfg.strategy.full_batches() && train.len() < cfg.batch_size {
                    return Err(setup(format!(
                        "the training split has {} examples, fewer than one full batch of {} (the {} strategy trains on full batches only)",
                        train.len(),
                        cfg.batch_size,
                        cfg.strategy.name()
                    )));
                }
                Ok(Source::Csv {
                    // A strategy with a static batch dimension (pipeline) takes full batches
                    // only: the last partial batch of each epoch is dropped, as locally.
                    steps_per_epoch: train.num_batches(cfg.batch_size, cfg.strategy.full_batches())
                        as u64,
                    train,
                    test,
                    epochs: *epochs,
                    test_fraction: *test_fraction,
                    rows: data.len() as u64,
                })
            }
            ChiefData::Text {
                corpus,
                block_size,
                val_fraction,
                steps,
                eval_batches,
            } => {
                let at =
                    |e: crate::data::DataError| setup(format!("{}: {e}", cfg.data_path.display()));
                // Checks the sizes as every task will.
                CharWindows::new(corpus.train(), *block_size, cfg.batch_size, cfg.seed)
                    .map_err(at)?;
                let val = if corpus.val().len() > *block_size {
                    Some(
                        CharWindows::new(
                            corpus.val(),
                            *block_size,
                            cfg.batch_size,
                            cfg.seed ^ VAL_SEED_SALT,
                        )
                        .map_err(at)?,
                    )
                } else {
                    None
                };
                Ok(Source::Text {
                    corpus: corpus.clone(),
                    block_size: *block_size,
                    val_fraction: *val_fraction,
                    val,
                    steps: *steps,
                    eval_batches: *eval_batches,
                })
            }
        }
    }

    /// What the tasks that feed are told about the data.
    pub(super) fn data_spec(&self, cfg: &ChiefConfig) -> DataSpec {
        let kind = match self {
            Source::Csv {
                test_fraction,
                rows,
                ..
            } => DataKind::Csv {
                test_fraction: *test_fraction,
                rows: *rows,
            },
            Source::Text {
                corpus,
                block_size,
                val_fraction,
                ..
            } => DataKind::CharWindows {
                vocab: corpus.vocab().as_string(),
                block_size: *block_size as u64,
                val_fraction: *val_fraction,
                train_tokens: corpus.train().len() as u64,
                digest: token_digest(&corpus.train()),
            },
        };
        DataSpec {
            path: cfg.data_path.display().to_string(),
            seed: cfg.seed,
            kind,
        }
    }

    /// Steps of the whole run.
    pub(super) fn total_steps(&self) -> u64 {
        match self {
            Source::Csv {
                steps_per_epoch,
                epochs,
                ..
            } => steps_per_epoch * epochs,
            Source::Text { steps, .. } => *steps,
        }
    }

    /// Steps per epoch (a text's run is one epoch).
    pub(super) fn steps_per_epoch(&self) -> u64 {
        match self {
            Source::Csv {
                steps_per_epoch, ..
            } => *steps_per_epoch,
            Source::Text { steps, .. } => *steps,
        }
    }

    /// `(epoch, index)` of step `s`'s batch, as a [`BatchRef`] names it.
    pub(super) fn batch_of(&self, s: u64) -> (u64, u64) {
        match self {
            Source::Csv {
                steps_per_epoch, ..
            } => {
                let spe = (*steps_per_epoch).max(1);
                (s / spe, s % spe)
            }
            Source::Text { .. } => (0, s),
        }
    }

    /// Examples in step `s`'s global batch.
    pub(super) fn rows(&self, s: u64, batch_size: usize) -> usize {
        match self {
            Source::Csv { train, .. } => {
                let start = self.batch_of(s).1 as usize * batch_size;
                train.len().saturating_sub(start).min(batch_size)
            }
            Source::Text { .. } => batch_size,
        }
    }

    /// Training and held-out examples (characters, for a text).
    pub(super) fn sizes(&self) -> (usize, usize) {
        match self {
            Source::Csv { train, test, .. } => (train.len(), test.len()),
            Source::Text { corpus, .. } => (corpus.train().len(), corpus.val().len()),
        }
    }

    /// The held-out batches: the test rows in batches weighted by their size, or the first
    /// `eval_batches` batches of validation windows weighted equally (as a local run
    /// evaluates; none when `eval_batches` is 0, `--eval-batches 0`).
    pub(super) fn eval_batches(&self, batch_size: usize) -> Result<Vec<EvalBatch>, JobError> {
        match self {
            Source::Csv { test, .. } => {
                if test.is_empty() {
                    return Ok(Vec::new());
                }
                test.batches(batch_size.max(1), None, 0, false)
                    .map_err(setup)?
                    .map(|b| {
                        let (x, y) = b.map_err(setup)?;
                        let n = y.num_elements() as f64;
                        Ok((x, y, n))
                    })
                    .collect()
            }
            Source::Text {
                val, eval_batches, ..
            } => match val {
                None => Ok(Vec::new()),
                Some(w) => (0..*eval_batches)
                    .map(|k| {
                        let (x, y) = w.batch(k).map_err(setup)?;
                        Ok((x, y, 1.0))
                    })
                    .collect(),
            },
        }
    }
}
