//! The training mode of `dflow run --data TEXT` for a graph whose `train.data` reads character
//! windows (the GPT): a character vocabulary, a seeded window per example, `--steps` optimizer
//! steps with a progress bar in tokens/s, the validation loss every `--eval-every` steps and at
//! the end, checkpoints carrying the vocabulary, and `--init-from`.

use super::run::Args;
use super::train::Targets;
use anyhow::{bail, Context};
use dflow_executor::data::text::{
    read_text, CharCorpus, CharVocab, CharWindowSteps, CharWindows, VAL_SEED_SALT,
};
use dflow_executor::trainer::{
    evaluate_windows, load_variables, run_steps, SessionSteps, StepReport, StepRunner, TrainConfig,
};
use dflow_executor::{checkpoint, Session};
use dflow_graph::train::DataSpec;
use dflow_graph::Graph;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::Path;
use std::time::Instant;

/// The checkpoint metadata key holding the vocabulary (its characters in id order).
pub use dflow_executor::data::text::VOCAB_KEY;

/// Names a checkpoint may store a tied tensor under: nanoGPT's head shares the token
/// embedding, and a safetensors file keeps a shared tensor once, under either name.
pub const TIED_ALIASES: [(&str, &str); 1] = [("transformer.wte.weight", "lm_head.weight")];

/// A text run as the flags and the graph's `train.data` say, the same for `--local` and a
/// distributed job's chief: the encoded corpus (with the checkpoint's vocabulary when
/// resuming), the steps and the checkpoint metadata (the vocabulary).
pub struct TextRun {
    /// The encoded text and its split.
    pub corpus: CharCorpus,
    /// Tokens per window.
    pub block_size: usize,
    /// The held-out fraction.
    pub val_fraction: f64,
    /// The placeholder fed with the windows' inputs.
    pub inputs: String,
    /// The placeholder fed with the windows' targets.
    pub targets: String,
    /// Optimizer steps of the whole run.
    pub steps: u64,
    /// Written into every checkpoint.
    pub metadata: BTreeMap<String, String>,
}

/// Reads and encodes the text at `data` for `graph` (its embedding must have a row per
/// character) as `spec` and `args` say.
pub fn prepare(
    args: &Args,
    data: &Path,
    spec: &DataSpec,
    graph: &Graph,
) -> anyhow::Result<TextRun> {
    let DataSpec::CharWindows {
        block_size,
        inputs,
        targets,
        val_fraction,
    } = spec;
    let text = read_text(data).with_context(|| format!("reading {}", data.display()))?;
    let vocab = match saved_vocab(args)? {
        Some(v) => v,
        None => CharVocab::from_text(&text),
    };
    if let Some(rows) = embedding_rows(graph, inputs) {
        if vocab.len() > rows {
            bail!(
                "{}: the text has {} distinct characters but the graph's embedding looked up \
                 with `{inputs}` has {rows} rows; build the graph with vocab_size {} \
                 (GptConfig::vocab_size, then `cargo run -p dflow-examples --example build_gpt`)",
                data.display(),
                vocab.len(),
                vocab.len()
            );
        }
    }
    let corpus = CharCorpus::with_vocab(&text, vocab, *val_fraction)
        .with_context(|| format!("encoding {}", data.display()))?;
    let mut metadata = BTreeMap::new();
    metadata.insert(VOCAB_KEY.to_string(), corpus.vocab().as_string());
    Ok(TextRun {
        corpus,
        block_size: *block_size,
        val_fraction: *val_fraction,
        inputs: inputs.clone(),
        targets: targets.clone(),
        steps: args.steps.unwrap_or(2000),
        metadata,
    })
}

/// Trains `session` on the text at `data` as `spec` and `args` say.
pub fn train_text(
    args: &Args,
    data: &Path,
    spec: &DataSpec,
    training: &Targets,
    session: &Session,
) -> anyhow::Result<()> {
    let run = prepare(args, data, spec, &session.placed().graph)?;
    let (corpus, block_size, steps) = (&run.corpus, run.block_size, run.steps);
    let batch = args.batch_size;
    let train = CharWindows::new(corpus.train(), block_size, batch, args.seed)
        .with_context(|| format!("the training split of {}", data.display()))?;
    let val = if corpus.val().len() > block_size {
        Some(CharWindows::new(
            corpus.val(),
            block_size,
            batch,
            args.seed ^ VAL_SEED_SALT,
        )?)
    } else {
        None
    };
    let cfg = TrainConfig {
        features: run.inputs.clone(),
        labels: run.targets.clone(),
        loss: training.loss.clone(),
        train_op: training.train_op.clone(),
        epochs: 1,
        batch_size: batch,
        shuffle_seed: args.seed,
        checkpoint_dir: args.checkpoint_dir.clone(),
        save_every: args.save_every,
        keep_checkpoints: 3,
        checkpoint_metadata: run.metadata.clone(),
        eval_every: args.eval_every,
        drop_remainder: training.full_batches,
    };
    let eval_cfg = training.eval_config(&cfg);
    init_from(args, &training.trainable, session)?;
    eprintln!(
        "training on {} characters ({} held out, vocabulary {}): {steps} steps of {batch} windows of {block_size}",
        corpus.train().len(),
        corpus.val().len(),
        corpus.vocab().len()
    );
    let mut progress = TextProgress::new(steps, (batch * block_size) as u64, args.quiet);
    let mut source = CharWindowSteps::new(train, steps, &run.inputs, &run.targets);
    let mut runner = SessionSteps::new(session, &cfg, &mut source).with_eval(|s| match &val {
        Some(_) if args.eval_batches == 0 => Ok(Vec::new()),
        Some(w) => Ok(vec![(
            cfg.loss.clone(),
            evaluate_windows(s, &eval_cfg, w, args.eval_batches)?,
        )]),
        None => Ok(Vec::new()),
    });
    let summary = run_steps(&mut runner, &cfg, |r| progress.step(r))?;
    progress.finish();
    if let Some(step) = summary.resumed_from {
        eprintln!("resumed from the checkpoint at step {step}");
    }
    if let Some(path) = &summary.checkpoint {
        eprintln!("checkpoint: {}", path.display());
    }
    let secs = summary.elapsed.as_secs_f64().max(1e-9);
    eprintln!(
        "trained {} steps in {secs:.3} s ({:.0} tokens/s)",
        summary.losses.len(),
        summary.examples as f64 * block_size as f64 / secs
    );
    if let Some(path) = &args.losses_out {
        super::train::write_losses(path, summary.resumed_from.unwrap_or(0), &summary.losses)?;
    }
    let final_eval = runner
        .evaluate()
        .context("computing the final validation loss")?;
    print_validation(&final_eval, args.eval_batches);
    Ok(())
}

/// Loads `--init-from` into the session's trainable variables, unless `--checkpoint-dir`
/// holds a checkpoint to resume from.
pub fn init_from(args: &Args, trainable: &[String], session: &Session) -> anyhow::Result<()> {
    let Some(file) = &args.init_from else {
        return Ok(());
    };
    if let Some(dir) = &args.checkpoint_dir {
        if checkpoint::latest(dir)?.is_some() {
            return Ok(());
        }
    }
    let n = load_variables(session, file, trainable, &TIED_ALIASES)?;
    eprintln!("initialized {n} variables from {}", file.display());
    Ok(())
}

/// Prints the final validation loss (the first evaluated value), or why there is none
/// (`eval_batches` is `--eval-batches`: 0 turns the evaluation off).
pub fn print_validation(eval: &[(String, f64)], eval_batches: u64) {
    match eval.first() {
        Some((_, v)) => println!("validation loss: {v:.4}"),
        None if eval_batches == 0 => println!("no validation loss (--eval-batches 0)"),
        None => println!("no validation split (the held-out text is shorter than one window)"),
    }
}

/// The vocabulary of the newest checkpoint in `--checkpoint-dir`, when resuming.
fn saved_vocab(args: &Args) -> anyhow::Result<Option<CharVocab>> {
    let Some(dir) = &args.checkpoint_dir else {
        return Ok(None);
    };
    let Some(path) = checkpoint::latest(dir)? else {
        return Ok(None);
    };
    let ckpt = checkpoint::load(&path)?;
    match ckpt.metadata.get(VOCAB_KEY) {
        Some(v) => Ok(Some(CharVocab::from_saved(v).map_err(|e| {
            anyhow::anyhow!("{}: metadata {VOCAB_KEY}: {e}", path.display())
        })?)),
        None => Ok(None),
    }
}

/// Rows of the embedding table that `Gather` looks up with placeholder `inputs`, if the graph
/// has one.
pub fn embedding_rows(g: &Graph, inputs: &str) -> Option<usize> {
    let ids = g.find(inputs)?;
    g.node_indices().find_map(|i| {
        let n = g.node(i);
        if n.op != "Gather" {
            return None;
        }
        let inputs = g.inputs(i);
        let (table, _) = *inputs.first()?;
        let (index_src, _) = *inputs.get(1)?;
        (index_src == ids)
            .then(|| g.node(table).outputs.first()?.shape.dim(0))
            .flatten()
    })
}

/// Progress of step-based training: a bar with loss, tokens/s and ETA on a terminal, a line
/// every 10% otherwise.
pub struct TextProgress {
    bar: Option<ProgressBar>,
    tokens_per_step: u64,
    start: Instant,
    steps: u64,
    first_step: Option<u64>,
}

impl TextProgress {
    /// Progress over `steps` steps of `tokens_per_step` tokens; `quiet` forces plain lines.
    pub fn new(steps: u64, tokens_per_step: u64, quiet: bool) -> Self {
        let fancy = !quiet && std::io::stderr().is_terminal();
        let bar = fancy.then(|| {
            let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  ETA {eta}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        });
        TextProgress {
            bar,
            tokens_per_step,
            start: Instant::now(),
            steps,
            first_step: None,
        }
    }

    /// Reports a finished step, and the validation loss evaluated after it, if any.
    pub fn step(&mut self, r: &StepReport) {
        if let Some((_, v)) = r.eval.first() {
            self.line(format!(
                "step {}: train loss {:.4}, val loss {v:.4}",
                r.step, r.loss
            ));
        }
        let first = *self.first_step.get_or_insert(r.step - 1);
        let done = r.step - first;
        let rate =
            (done * self.tokens_per_step) as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
        match &self.bar {
            Some(bar) => {
                bar.set_position(r.step);
                bar.set_message(format!("loss {:.4}  {rate:.0} tokens/s", r.loss));
            }
            None => {
                let every = (self.steps / 10).max(1);
                if r.step % every == 0 || r.step == r.total_steps {
                    eprintln!(
                        "step {}/{}  loss {:.4}  {rate:.0} tokens/s",
                        r.step, r.total_steps, r.loss
                    );
                }
            }
        }
    }

    /// Prints a line above the bar.
    pub fn line(&self, line: String) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    /// Clears the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
