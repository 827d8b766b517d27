//! `dflow partition`.

/// Arguments of `dflow partition`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `dflow partition`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`dflow partition` is not implemented yet")
}
