//! `dflow check`.

/// Arguments of `dflow check`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `dflow check`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`dflow check` is not implemented yet")
}
