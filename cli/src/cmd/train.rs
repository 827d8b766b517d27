//! The training mode of `dflow run --data ...`: split, train with a progress bar, evaluate.

use super::run::Args;
use anyhow::Context;
use dflow_executor::data::{read_csv, ReadOptions};
use dflow_executor::trainer::{evaluate, fit, StepReport, TrainConfig};
use dflow_executor::Session;
use dflow_graph::train::TrainingGraph;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::Path;
use std::time::Instant;

/// Trains `session` on the CSV at `data` as `args` says, then prints held-out metrics.
pub fn train(
    args: &Args,
    data: &Path,
    training: &TrainingGraph,
    session: &Session,
) -> anyhow::Result<()> {
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
    };
    let steps_per_epoch = train_set.num_batches(args.batch_size, false) as u64;
    let total = steps_per_epoch * args.epochs;
    eprintln!(
        "training on {} examples ({} held out), {} epochs of {} steps, batch {}",
        train_set.len(),
        test_set.len(),
        args.epochs,
        steps_per_epoch,
        args.batch_size
    );
    let fancy = !args.quiet && std::io::stderr().is_terminal();
    let bar = if fancy {
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  ETA {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Some(bar)
    } else {
        None
    };
    let start = Instant::now();
    let mut examples = 0u64;
    let mut epoch_loss = (0.0f64, 0u64);
    let on_step = |r: &StepReport| {
        examples += r.examples as u64;
        epoch_loss.0 += r.loss;
        epoch_loss.1 += 1;
        let rate = examples as f64 / start.elapsed().as_secs_f64().max(1e-9);
        if let Some(bar) = &bar {
            bar.set_position(r.step);
            bar.set_message(format!(
                "epoch {}  loss {:.4}  {:.0} examples/s",
                r.epoch + 1,
                r.loss,
                rate
            ));
        }
        if r.step % steps_per_epoch == 0 || r.step == r.total_steps {
            let line = format!(
                "epoch {}/{}  step {}/{}  mean loss {:.4}  {:.0} examples/s",
                r.epoch + 1,
                args.epochs,
                r.step,
                r.total_steps,
                epoch_loss.0 / epoch_loss.1.max(1) as f64,
                rate
            );
            match &bar {
                Some(bar) => bar.println(line),
                None => eprintln!("{line}"),
            }
            epoch_loss = (0.0, 0);
        }
    };
    let summary = fit(session, &cfg, &train_set, on_step)?;
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    if let Some(step) = summary.resumed_from {
        eprintln!("resumed from the checkpoint at step {step}");
    }
    if let Some(path) = &summary.checkpoint {
        eprintln!("checkpoint: {}", path.display());
    }
    eprintln!(
        "trained {} steps in {:.2} s ({:.0} examples/s)",
        summary.losses.len(),
        summary.elapsed.as_secs_f64(),
        summary.examples as f64 / summary.elapsed.as_secs_f64().max(1e-9)
    );
    if test_set.is_empty() {
        println!(
            "no held-out examples (--test-fraction {}): nothing to evaluate",
            args.test_fraction
        );
        return Ok(());
    }
    let loss = evaluate(session, &cfg, &test_set, &training.loss)?;
    println!("held-out loss: {loss:.4}");
    for metric in &training.metrics {
        let value = evaluate(session, &cfg, &test_set, metric)?;
        println!("held-out {metric}: {value:.4}");
    }
    Ok(())
}
