//! `dflow cert init|issue`: a cluster CA and per-task certificates for the QUIC transport, for
//! people without a PKI (see docs/distributed.md, "Data plane (QUIC)").

use anyhow::{bail, Context};
use dflow_graph::ClusterSpec;
use dflow_transport::quic::pki;
use std::path::PathBuf;

/// Arguments of `dflow cert`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Make the cluster CA: DIR/ca.crt (give it to every task) and DIR/ca.key (keep it where
    /// you issue certificates; mode 0600).
    Init {
        /// The certificate directory (created if missing).
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// Days the CA is valid.
        #[arg(long, default_value_t = 3650)]
        days: u32,
        /// Replace an existing CA (every certificate it issued stops being accepted).
        #[arg(long)]
        force: bool,
    },
    /// Issue task certificates signed by DIR's CA: DIR/<job>-<index>.crt and .key (mode 0600).
    Issue {
        /// The certificate directory holding ca.crt and ca.key.
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// A task, `JOB:INDEX` (e.g. `worker:0`) or `/job:worker/replica:0/task:0`
        /// (repeatable).
        #[arg(long = "task", value_name = "JOB:INDEX")]
        tasks: Vec<String>,
        /// Issue one certificate for every task of this cluster spec.
        #[arg(long, value_name = "FILE")]
        cluster: Option<PathBuf>,
        /// Days the certificates are valid.
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
}

/// Runs `dflow cert`.
pub fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Init { dir, days, force } => {
            for path in pki::init_ca(&dir, days, force)? {
                println!("wrote {}", path.display());
            }
            println!(
                "next: dflow cert issue --dir {} --cluster CLUSTER.json (or --task JOB:INDEX)",
                dir.display()
            );
        }
        Command::Issue {
            dir,
            mut tasks,
            cluster,
            days,
        } => {
            if let Some(path) = &cluster {
                let spec = ClusterSpec::from_file(path)?;
                for job in spec.jobs() {
                    tasks.extend(spec.tasks(job).map(|(i, _)| format!("{job}:{i}")));
                }
            }
            if tasks.is_empty() {
                bail!("say which tasks: --task JOB:INDEX (repeatable) or --cluster FILE");
            }
            for task in &tasks {
                let written = pki::issue_to_dir(&dir, task, days)
                    .with_context(|| format!("issuing the certificate of task {task}"))?;
                for path in written {
                    println!("wrote {}", path.display());
                }
            }
        }
    }
    Ok(())
}
