//! The training mode of `dflow run --data ...`: split, train with a progress bar through the
//! step driver (`trainer::run_steps`, as a distributed job's chief does), evaluate.

use super::progress::Progress;
use super::run::Args;
use anyhow::Context;
use dflow_executor::data::{read_csv, ReadOptions};
use dflow_executor::trainer::{
    evaluate, run_steps, EpochBatches, SessionSteps, StepRunner, TrainConfig,
};
use dflow_executor::Session;
use dflow_graph::train::TrainingGraph;
use std::path::Path;

/// What a training run fetches and runs in its session: the training step's loss and update,
/// and what evaluation feeds and fetches.
#[derive(Debug, Clone)]
pub struct Targets {
    /// The loss fetched every training step.
    pub loss: String,
    /// The node run every training step.
    pub train_op: String,
    /// The placeholders evaluation feeds: (features, labels); `None`: the training ones.
    pub eval_feeds: Option<(String, String)>,
    /// The loss evaluation fetches.
    pub eval_loss: String,
    /// The metrics evaluation fetches: (the user's name, the tensor).
    pub eval_metrics: Vec<(String, String)>,
    /// The trainable variables.
    pub trainable: Vec<String>,
    /// Feed full training batches only (the graph's batch dimension is static).
    pub full_batches: bool,
}

impl Targets {
    /// The targets of a graph trained as written.
    pub fn of(training: &TrainingGraph) -> Targets {
        Targets {
            loss: training.loss.clone(),
            train_op: training.train_op.clone(),
            eval_feeds: None,
            eval_loss: training.loss.clone(),
            eval_metrics: training
                .metrics
                .iter()
                .map(|m| (m.clone(), m.clone()))
                .collect(),
            trainable: training.gradients.iter().map(|(v, _)| v.clone()).collect(),
            full_batches: false,
        }
    }

    /// `cfg` for evaluation: the evaluation placeholders and loss, every batch.
    pub fn eval_config(&self, cfg: &TrainConfig) -> TrainConfig {
        let (features, labels) = self
            .eval_feeds
            .clone()
            .unwrap_or_else(|| (cfg.features.clone(), cfg.labels.clone()));
        TrainConfig {
            features,
            labels,
            loss: self.eval_loss.clone(),
            drop_remainder: false,
            ..cfg.clone()
        }
    }
}

/// Training on a table runs whole epochs: `--steps` (a text run's length) is refused rather
/// than ignored.
pub fn refuse_steps_on_a_table(args: &Args, data: &Path) -> anyhow::Result<()> {
    if let Some(steps) = args.steps {
        anyhow::bail!(
            "--steps {steps}: {} is a table, which trains for whole epochs; give --epochs N \
             instead (--steps counts steps of a text run, or runs of a graph without --data)",
            data.display()
        );
    }
    Ok(())
}

/// Trains `session` on the CSV at `data` as `args` says, then prints held-out metrics.
pub fn train(
    args: &Args,
    data: &Path,
    training: &Targets,
    session: &Session,
) -> anyhow::Result<()> {
    refuse_steps_on_a_table(args, data)?;
    let all = read_csv(data, &ReadOptions::default())
        .with_context(|| format!("reading {}", data.display()))?;
    let (train_set, test_set) = all.split(args.test_fraction, args.seed)?;
    let cfg = TrainConfig {
        features: args.features.clone(),
        labels: args.labels.clone(),
        loss: training.loss.clone(),
        train_op: training.train_op.clone(),
        epochs: args.epochs,
        batch_size: args.batch_size,
        shuffle_seed: args.seed,
        checkpoint_dir: args.checkpoint_dir.clone(),
        save_every: args.save_every,
        keep_checkpoints: 3,
        checkpoint_metadata: Default::default(),
        eval_every: 0,
        drop_remainder: training.full_batches,
    };
    let steps_per_epoch = train_set.num_batches(args.batch_size, training.full_batches) as u64;
    eprintln!(
        "training on {} examples ({} held out), {} epochs of {} steps, batch {}",
        train_set.len(),
        test_set.len(),
        args.epochs,
        steps_per_epoch,
        args.batch_size
    );
    super::train_text::init_from(args, &training.trainable, session)?;
    let mut progress = Progress::new(args.epochs, steps_per_epoch, args.quiet);
    // The loss, then every metric, each the example-weighted mean over the held-out rows.
    let names: Vec<(&String, &String)> =
        std::iter::once((&training.eval_loss, &training.eval_loss))
            .chain(
                training
                    .eval_metrics
                    .iter()
                    .map(|(name, tensor)| (name, tensor)),
            )
            .collect();
    let eval_cfg = training.eval_config(&cfg);
    let mut source = EpochBatches::new(&train_set, &cfg)?;
    let mut runner = SessionSteps::new(session, &cfg, &mut source).with_eval(|s| {
        if test_set.is_empty() {
            return Ok(Vec::new());
        }
        names
            .iter()
            .map(|&(name, tensor)| Ok((name.clone(), evaluate(s, &eval_cfg, &test_set, tensor)?)))
            .collect()
    });
    let summary = run_steps(&mut runner, &cfg, |r| progress.step(r))?;
    progress.finish();
    if let Some(step) = summary.resumed_from {
        eprintln!("resumed from the checkpoint at step {step}");
    }
    if let Some(path) = &summary.checkpoint {
        eprintln!("checkpoint: {}", path.display());
    }
    eprintln!(
        "trained {} steps in {:.3} s ({:.0} examples/s)",
        summary.losses.len(),
        summary.elapsed.as_secs_f64(),
        summary.examples as f64 / summary.elapsed.as_secs_f64().max(1e-9)
    );
    if let Some(path) = &args.losses_out {
        write_losses(path, summary.resumed_from.unwrap_or(0), &summary.losses)?;
    }
    let held_out = runner.evaluate()?;
    let Some(((_, loss), metrics)) = held_out.split_first() else {
        println!(
            "no held-out examples (--test-fraction {}): nothing to evaluate",
            args.test_fraction
        );
        return Ok(());
    };
    println!("held-out loss: {loss:.4}");
    for (metric, value) in metrics {
        println!("held-out {metric}: {value:.4}");
    }
    Ok(())
}

/// Writes `step loss` lines, the steps numbered from `first + 1` (a resumed run continues the
/// numbers of the run it resumed).
pub fn write_losses(path: &Path, first: u64, losses: &[f64]) -> anyhow::Result<()> {
    let text: String = losses
        .iter()
        .enumerate()
        .map(|(i, l)| format!("{} {l:.9}\n", first + i as u64 + 1))
        .collect();
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
