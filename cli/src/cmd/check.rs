//! `dflow check`: validate a graph file and summarize it.

use super::common;
use dflow::load::Summary;
use dflow_graph::train::OptimizerKind;
use dflow_graph::{registry, Format};
use std::path::PathBuf;

/// Arguments of `dflow check`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The graph file: dflow JSON, the dflow DSL, or a TensorFlow GraphDef in protobuf JSON
    /// (detected from the extension and content).
    #[arg(required_unless_present = "ops")]
    file: Option<PathBuf>,
    /// List the registered ops instead of checking a file.
    #[arg(long)]
    ops: bool,
}

/// Runs `dflow check`.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.ops {
        print!("{}", op_list());
        return Ok(());
    }
    let Some(path) = args.file else {
        anyhow::bail!("no graph file given");
    };
    let loaded = common::load(&path)?;
    println!("file:         {}", path.display());
    if loaded.tf_graphdef {
        println!("format:       tensorflow graphdef (imported)");
    } else {
        println!("format:       {}", format_name(loaded.format));
    }
    println!("{}", Summary::of(&loaded.graph));
    if let Some(t) = &loaded.parsed.def.train {
        let optimizer = match &t.optimizer.kind {
            OptimizerKind::Sgd => "sgd".to_string(),
            OptimizerKind::Momentum { momentum, nesterov } => {
                format!("momentum (momentum {momentum}, nesterov {nesterov})")
            }
            OptimizerKind::Adam {
                beta1,
                beta2,
                epsilon,
            } => {
                format!("adam (beta1 {beta1}, beta2 {beta2}, epsilon {epsilon})")
            }
            OptimizerKind::AdamW {
                beta1,
                beta2,
                epsilon,
                weight_decay,
            } => format!(
                "adamw (beta1 {beta1}, beta2 {beta2}, epsilon {epsilon}, weight_decay {weight_decay})"
            ),
        };
        println!(
            "train:        loss {}, {optimizer}, lr {}",
            t.loss, t.optimizer.lr
        );
        if let Some(c) = t.clip_global_norm {
            println!("  clip_global_norm {c}");
        }
        if !t.metrics.is_empty() {
            println!("  metrics {}", t.metrics.join(", "));
        }
        if let Some(s) = &t.lr_schedule {
            println!(
                "  lr_schedule cosine: warmup {} steps, decay to {} at step {}",
                s.warmup_steps, s.min_lr, s.decay_steps
            );
        }
        if let Some(dflow_graph::train::DataSpec::CharWindows {
            block_size,
            inputs,
            targets,
            val_fraction,
        }) = &t.data
        {
            println!(
                "  data: character windows of {block_size} + 1 into {inputs}/{targets}, last {val_fraction} held out"
            );
        }
    }
    Ok(())
}

/// The name of a format as `--to` spells it.
pub fn format_name(f: Format) -> &'static str {
    match f {
        Format::Json => "json",
        Format::Dsl => "dsl",
    }
}

fn op_list() -> String {
    let mut ops: Vec<_> = registry().ops().collect();
    ops.sort_by_key(|o| o.name);
    let width = ops.iter().map(|o| o.name.len()).max().unwrap_or(0);
    ops.iter()
        .map(|o| format!("{:<width$}  {}\n", o.name, o.summary))
        .collect()
}
