//! `dflow convert`: rewrite a graph file in the other format.

use super::common;
use anyhow::Context;
use dflow_graph::{to_dsl, to_json};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Target format of `dflow convert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum To {
    /// JSON (`.json`).
    Json,
    /// The dflow DSL (`.dflow`).
    Dsl,
}

/// Arguments of `dflow convert`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The graph file to convert: dflow JSON, the dflow DSL, or a TensorFlow GraphDef in protobuf
    /// JSON (imported first; detected from the extension and content).
    file: PathBuf,
    /// The format to write.
    #[arg(long, value_enum)]
    to: To,
    /// Write here (atomically) instead of to stdout.
    #[arg(short, long)]
    output: Option<PathBuf>,
}

/// Runs `dflow convert`. The graph is validated first; an invalid graph is not converted.
pub fn run(args: Args) -> anyhow::Result<()> {
    let loaded = common::load(&args.file)?;
    let text = match args.to {
        To::Json => to_json(&loaded.parsed.def),
        To::Dsl => to_dsl(&loaded.parsed.def),
    };
    match &args.output {
        Some(out) => write_atomically(out, text.as_bytes()),
        None => {
            let mut stdout = std::io::stdout().lock();
            stdout
                .write_all(text.as_bytes())
                .and_then(|()| stdout.flush())
                .context("cannot write to stdout")
        }
    }
}

/// Writes `bytes` to a temporary file next to `path`, then renames it over `path`, so readers see
/// either the old file or the whole new one.
fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .with_context(|| format!("{}: not a file path", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        // Best effort: the temporary file may not exist if creating it failed.
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot write {}", path.display()));
    }
    Ok(())
}
