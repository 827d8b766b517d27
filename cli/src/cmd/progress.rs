//! Training progress on the terminal: a bar when stderr is a terminal, plain lines otherwise,
//! and a summary line per epoch. Shared by local and distributed training.

use dflow_executor::trainer::StepReport;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::Instant;

/// Reports steps as they finish.
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
    epochs: u64,
    steps_per_epoch: u64,
    start: Instant,
    examples: u64,
    epoch_loss: (f64, u64),
}

impl Progress {
    /// Progress over `epochs` epochs of `steps_per_epoch` steps; `quiet` forces plain lines.
    pub fn new(epochs: u64, steps_per_epoch: u64, quiet: bool) -> Progress {
        let total = epochs * steps_per_epoch;
        let fancy = !quiet && std::io::stderr().is_terminal();
        let bar = fancy.then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  ETA {eta}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        });
        Progress {
            bar,
            epochs,
            steps_per_epoch: steps_per_epoch.max(1),
            start: Instant::now(),
            examples: 0,
            epoch_loss: (0.0, 0),
        }
    }

    /// Records one finished step.
    pub fn step(&mut self, r: &StepReport) {
        self.examples += r.examples as u64;
        self.epoch_loss.0 += r.loss;
        self.epoch_loss.1 += 1;
        let rate = self.examples as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
        if let Some(bar) = &self.bar {
            bar.set_position(r.step);
            bar.set_message(format!(
                "epoch {}  loss {:.4}  {:.0} examples/s",
                r.epoch + 1,
                r.loss,
                rate
            ));
        }
        if r.step % self.steps_per_epoch == 0 || r.step == r.total_steps {
            let line = format!(
                "epoch {}/{}  step {}/{}  mean loss {:.4}  {:.0} examples/s",
                r.epoch + 1,
                self.epochs,
                r.step,
                r.total_steps,
                self.epoch_loss.0 / self.epoch_loss.1.max(1) as f64,
                rate
            );
            match &self.bar {
                Some(bar) => bar.println(line),
                None => eprintln!("{line}"),
            }
            self.epoch_loss = (0.0, 0);
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
