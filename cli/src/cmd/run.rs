//! `dflow run`.

/// Arguments of `dflow run`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `dflow run`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`dflow run` is not implemented yet")
}
