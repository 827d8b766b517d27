//! `dflow trace merge`: one Chrome trace from the per-task traces of a distributed run.

use anyhow::{bail, Context};
use std::collections::BTreeSet;
use std::path::PathBuf;

/// Arguments of `dflow trace`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: TraceCommand,
}

/// What to do with traces.
#[derive(Debug, clap::Subcommand)]
pub enum TraceCommand {
    /// Merge the trace files of several tasks (`run --trace t.json` writes `t.ps-0.json`,
    /// `t.worker-0.json`, ...) into one, aligned on wall-clock time.
    Merge {
        /// The trace files.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// The merged trace.
        #[arg(short, long)]
        output: PathBuf,
    },
}

/// Runs `dflow trace`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let TraceCommand::Merge { inputs, output } = args.command;
    let mut events: Vec<serde_json::Value> = Vec::new();
    let mut seen_meta = BTreeSet::new();
    for path in &inputs {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
        let Some(list) = value.get("traceEvents").and_then(|v| v.as_array()) else {
            bail!(
                "{}: no `traceEvents` array: not a Chrome trace",
                path.display()
            );
        };
        for e in list {
            if e.get("ph").and_then(|p| p.as_str()) == Some("M") {
                // Process names repeat when two files trace the same device: keep one.
                if !seen_meta.insert(e.to_string()) {
                    continue;
                }
            }
            events.push(e.clone());
        }
    }
    let n = events.len();
    let merged = serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"});
    std::fs::write(&output, serde_json::to_string(&merged)?)
        .with_context(|| format!("writing {}", output.display()))?;
    eprintln!(
        "merged {} files, {n} events, into {}",
        inputs.len(),
        output.display()
    );
    Ok(())
}
