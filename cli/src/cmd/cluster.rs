//! `dflow run --job J --index I` (or `TF_CONFIG`): one task of a distributed job.
//!
//! Every task listens at its cluster address and connects to every other task. Worker 0 is the
//! chief: it loads the graph and the data, trains (parameter-server, `--sync` or `--async`),
//! evaluates, saves checkpoints and shuts every task down. The other tasks serve it; a ps needs
//! nothing but the cluster.

use super::progress::Progress;
use super::run::Args;
use anyhow::{bail, Context};
use dflow_executor::cluster::{run_chief, ChiefConfig, Node, NodeOptions, ServerOptions};
use dflow_executor::data::{read_csv, ReadOptions};
use dflow_graph::ClusterSpec;
use dflow_partitioner::PlacementOptions;
use dflow_transport::auth::{Secret, SECRET_ENV};
use dflow_transport::quic::{pki, QuicIdentity, CERT_DIR_ENV};
use dflow_transport::TransportKind;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The cluster secret from `--secret-file` or `DFLOW_SECRET`, if either is given.
fn secret(args: &Args) -> anyhow::Result<Option<Secret>> {
    if let Some(path) = &args.secret_file {
        return Ok(Some(Secret::from_file(path)?));
    }
    if std::env::var_os(SECRET_ENV).is_some() {
        return Ok(Some(Secret::from_env()?));
    }
    Ok(None)
}

/// This task's certificate for `--transport quic`: `--ca/--cert/--key`, each defaulting to
/// its file in `--cert-dir` (or `DFLOW_CERT_DIR`).
fn quic_identity(args: &Args, task: &str) -> anyhow::Result<QuicIdentity> {
    let dir = args
        .cert_dir
        .clone()
        .or_else(|| std::env::var_os(CERT_DIR_ENV).map(PathBuf::from));
    let (dir_cert, dir_key) = match &dir {
        Some(d) => {
            let (c, k) = pki::task_files(d, task)?;
            (Some(c), Some(k))
        }
        None => (None, None),
    };
    let pick = |flag: &Option<PathBuf>, from_dir: Option<PathBuf>| flag.clone().or(from_dir);
    let ca = pick(&args.ca, dir.as_ref().map(|d| d.join(pki::CA_CERT)));
    let (Some(ca), Some(cert), Some(key)) =
        (ca, pick(&args.cert, dir_cert), pick(&args.key, dir_key))
    else {
        bail!(
            "--transport quic needs this task's certificate: --cert-dir DIR (or {CERT_DIR_ENV}), made with `dflow cert init --dir DIR` and `dflow cert issue --dir DIR --cluster CLUSTER`; or all of --ca, --cert and --key"
        );
    };
    Ok(QuicIdentity::from_files(task, &ca, &cert, &key)?)
}

/// Where this task writes its trace: `--trace t.json` becomes `t.worker-0.json`, so the files
/// of all tasks sit side by side (each task is its own process id in the trace).
fn trace_path(path: &Path, job: &str, index: u32) -> std::path::PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "trace".into());
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_else(|| "json".into());
    path.with_file_name(format!("{stem}.{job}-{index}.{ext}"))
}

/// Runs this process as task `index` of `job` in `cluster`.
pub fn run_task(args: &Args, cluster: ClusterSpec, job: &str, index: u32) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the network runtime")?;
    let task = dflow_executor::cluster::task_name(job, index);
    let (transport, why) = args.transport.resolve(&cluster);
    if let Some(why) = why {
        eprintln!("{task}: --transport auto chose {why}");
    }
    let quic_identity = if transport == TransportKind::Quic {
        Some(quic_identity(args, &task).with_context(|| format!("task {task}"))?)
    } else {
        if args.cert_dir.is_some() || args.ca.is_some() || args.cert.is_some() {
            eprintln!("{task}: certificates are only used by --transport quic; this task runs {transport}");
        }
        None
    };
    let opts = NodeOptions {
        cluster: cluster.clone(),
        job: job.to_string(),
        index,
        secret: secret(args)?,
        timeout: Duration::from_secs(args.timeout.max(1)),
        startup_timeout: Duration::from_secs(args.startup_timeout),
        server: ServerOptions {
            num_threads: 0,
            step_timeout: Duration::from_secs(args.timeout.max(1)),
            trace: args.trace.is_some(),
            data_path: args.data.clone(),
            // Filled in from the cluster address and the secret when the task joins.
            ..ServerOptions::default()
        },
        transport,
        quic_identity,
    };
    let is_chief = job == "worker" && index == 0;
    // The chief checks its inputs before joining, so a bad flag fails fast.
    let chief_cfg = if is_chief {
        Some(chief_config(args)?)
    } else {
        None
    };
    runtime.block_on(async move {
        let node = Node::start(&opts)
            .await
            .with_context(|| format!("task {task}"))?;
        let server = node.server.clone();
        let result = match chief_cfg {
            None => {
                eprintln!("{task}: joined the job; serving the chief");
                node.serve().await.with_context(|| format!("task {task}"))
            }
            Some(cfg) => chief(args, node, &cluster, cfg).await,
        };
        if let (Some(path), Some(tracer)) = (&args.trace, server.tracer()) {
            let path = trace_path(path, job, index);
            let json = serde_json::to_string(&tracer.to_chrome_json())?;
            std::fs::write(&path, json)
                .with_context(|| format!("writing trace {}", path.display()))?;
            eprintln!(
                "trace: {} events written to {}",
                tracer.len(),
                path.display()
            );
        }
        if result.is_ok() {
            eprintln!("{task}: done");
        }
        result
    })
}

fn chief_config(args: &Args) -> anyhow::Result<ChiefConfig> {
    let Some(path) = &args.graph else {
        bail!("the chief (worker 0) needs the graph file: dflow run --job worker --index 0 --cluster CLUSTER GRAPH --data DATA");
    };
    let loaded = super::common::load(path)?;
    let Some(spec) = loaded.parsed.def.train.clone() else {
        bail!(
            "{}: distributed runs train the graph, but it has no `train` section (see docs/graph-format.md)",
            path.display()
        );
    };
    let Some(data_path) = &args.data else {
        bail!("the chief needs --data: the distributed job trains on it");
    };
    let data = read_csv(data_path, &ReadOptions::default())
        .with_context(|| format!("reading {}", data_path.display()))?;
    Ok(ChiefConfig {
        forward: loaded.graph,
        spec,
        strategy: super::common::build_strategy(
            args.strategy,
            args.r#async,
            args.fusion_threshold_mb,
        )?
        .into(),
        placement: PlacementOptions::default(),
        data_path: data_path.clone(),
        data,
        test_fraction: args.test_fraction,
        seed: args.seed,
        features: args.features.clone(),
        labels: args.labels.clone(),
        epochs: args.epochs,
        batch_size: args.batch_size,
        checkpoint_dir: args.checkpoint_dir.clone(),
        save_every: args.save_every,
        keep_checkpoints: 3,
    })
}

async fn chief(
    args: &Args,
    node: Node,
    cluster: &ClusterSpec,
    cfg: ChiefConfig,
) -> anyhow::Result<()> {
    let rpc = node.into_rpc();
    let workers = cluster.num_tasks("worker");
    eprintln!(
        "chief: every task joined; {} with {workers} worker(s) and {} ps task(s)",
        cfg.strategy.describe(),
        cluster.num_tasks("ps")
    );
    let mut progress: Option<Progress> = None;
    let epochs = args.epochs;
    let quiet = args.quiet;
    let result = run_chief(&rpc, cluster, &cfg, |r| {
        let p = progress
            .get_or_insert_with(|| Progress::new(epochs, r.total_steps / epochs.max(1), quiet));
        p.step(r);
    })
    .await;
    if let Some(p) = &progress {
        p.finish();
    }
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            rpc.shutdown(Some(format!("the chief failed: {e}"))).await;
            return Err(e).context("chief /job:worker/replica:0/task:0");
        }
    };
    rpc.shutdown(None).await;
    if let Some(step) = report.resumed_from {
        eprintln!("resumed from the checkpoint at step {step}");
    }
    if let Some(path) = &report.checkpoint {
        eprintln!("checkpoint: {}", path.display());
    }
    eprintln!(
        "trained {} steps in {:.2} s ({:.0} examples/s) on {} examples ({} held out)",
        report.losses.len(),
        report.elapsed.as_secs_f64(),
        report.examples as f64 / report.elapsed.as_secs_f64().max(1e-9),
        report.train_examples,
        report.test_examples
    );
    if let Some((mean, max)) = report.staleness {
        println!("staleness: mean {mean:.2} max {max} updates");
    }
    if report.held_out.is_empty() {
        println!("no held-out examples: nothing to evaluate");
    }
    for (name, value) in &report.held_out {
        println!("held-out {name}: {value:.4}");
    }
    if let Some(dir) = &args.losses_out {
        let text: String = report
            .losses
            .iter()
            .map(|(s, l)| format!("{s} {l:.9}\n"))
            .collect();
        std::fs::write(dir, text).with_context(|| format!("writing {}", dir.display()))?;
    }
    Ok(())
}
