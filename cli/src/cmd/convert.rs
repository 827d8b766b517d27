//! `dflow convert`.

/// Arguments of `dflow convert`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `dflow convert`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`dflow convert` is not implemented yet")
}
