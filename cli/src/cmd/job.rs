//! `dflow run --job J --index I` (or `TF_CONFIG`): one task of a distributed job.
//!
//! Every task listens at its cluster address and connects to every other task. Worker 0 is the
//! chief: it loads the graph and the data, trains (parameter-server, `--sync` or `--async`),
//! evaluates, saves checkpoints and shuts every task down. The other tasks serve it; a ps needs
//! nothing but the cluster.

use super::host_cpus::{self, HostShare};
use super::progress::Progress;
use super::run::Args;
use super::step_clock::StepClock;
use super::train_text::{TextProgress, TIED_ALIASES};
use super::transport_choice::TransportChoice;
use anyhow::{bail, Context};
use dflow::identity::Ranked;
use dflow_executor::cluster::registration::{self, Registration};
use dflow_executor::cluster::{
    bind_addr, run_chief, ChiefConfig, ChiefData, InitFrom, Node, NodeOptions, ServerOptions,
};
use dflow_executor::data::{read_csv, ReadOptions};
use dflow_graph::train::expand_training_graph;
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

/// How this task learns the cluster.
enum Membership {
    /// From flags or `TF_CONFIG`.
    Known(ClusterSpec),
    /// From rank 0, by registration.
    Register(Ranked),
}

/// Runs this process as task `index` of `job` in `cluster`.
pub fn run_task(args: &Args, cluster: ClusterSpec, job: &str, index: u32) -> anyhow::Result<()> {
    run_member(args, job, index, Membership::Known(cluster))
}

/// Runs this process as rank `ranked.rank`: the last `--num-ps` ranks are parameter servers,
/// the others workers in rank order (rank 0 is worker 0, the chief). The cluster comes from
/// registration with rank 0.
pub fn run_ranked(args: &Args, ranked: Ranked) -> anyhow::Result<()> {
    let (job, index) = role(ranked.rank, ranked.world_size, args.num_ps)?;
    run_member(args, &job, index, Membership::Register(ranked))
}

/// The job and index of `rank` when the last `num_ps` of `world_size` ranks are ps tasks.
pub fn role(rank: u32, world_size: u32, num_ps: u32) -> anyhow::Result<(String, u32)> {
    if num_ps >= world_size {
        bail!("--num-ps {num_ps} leaves no worker among {world_size} ranks; rank 0 must be a worker (the chief)");
    }
    let workers = world_size - num_ps;
    Ok(if rank < workers {
        ("worker".to_string(), rank)
    } else {
        ("ps".to_string(), rank - workers)
    })
}

fn run_member(args: &Args, job: &str, index: u32, membership: Membership) -> anyhow::Result<()> {
    // Bound before any thread starts: the network runtime's and the compute pool's threads
    // inherit the binding.
    let share = match &membership {
        Membership::Known(c) => HostShare::in_cluster(c, job, index),
        Membership::Register(r) => HostShare::from_launcher(r.local_rank),
    };
    let threads = host_cpus::bind_task(
        &dflow_executor::cluster::task_name(job, index),
        args.cpu_binding,
        share,
        args.compute_threads,
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the network runtime")?;
    let task = dflow_executor::cluster::task_name(job, index);
    let (transport, why) = match &membership {
        Membership::Known(cluster) => args.transport.resolve(cluster),
        // Each rank knows only rank 0's host, so `auto` cannot see where the others are.
        Membership::Register(_) => match args.transport {
            TransportChoice::Auto => (
                TransportKind::Tcp,
                Some("tcp (the other ranks' hosts are unknown before registration)".to_string()),
            ),
            other => other.resolve(&ClusterSpec::local(&[("worker", 1)])?),
        },
    };
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
    let placeholder = ClusterSpec::local(&[("worker", 1)])?;
    let opts = NodeOptions {
        cluster: match &membership {
            Membership::Known(c) => c.clone(),
            Membership::Register(_) => placeholder,
        },
        job: job.to_string(),
        index,
        secret: secret(args)?,
        timeout: Duration::from_secs(args.timeout.max(1)),
        startup_timeout: Duration::from_secs(args.startup_timeout),
        server: server_options(args, threads),
        transport,
        quic_identity,
    };
    let is_chief = job == "worker" && index == 0;
    let has_ps = match &membership {
        Membership::Known(c) => c.num_tasks("ps") > 0,
        Membership::Register(_) => args.num_ps > 0,
    };
    if let (Some(mesh), Membership::Known(c)) = (&args.mesh, &membership) {
        super::strategy_flags::check_mesh_workers(mesh, c.num_tasks("worker"))?;
    }
    // The chief checks its inputs before joining, so a bad flag fails fast.
    let chief_cfg = if is_chief {
        Some(chief_config(args, has_ps)?)
    } else {
        None
    };
    runtime.block_on(async move {
        let (node, cluster) = match membership {
            Membership::Known(cluster) => {
                let node = Node::start(&opts)
                    .await
                    .with_context(|| format!("task {task}"))?;
                (node, cluster)
            }
            Membership::Register(ranked) => register_and_join(&opts, &ranked, args.num_ps)
                .await
                .with_context(|| format!("task {task} (rank {})", ranked.rank))?,
        };
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
            eprintln!("{task}: holds {}; sent {}", server.held(), server.traffic());
            eprintln!("{task}: done");
        }
        result
    })
}

/// How a task's server runs steps, from `dflow run`'s flags (the address and the secret are
/// filled in when the task joins), with `threads` compute threads.
fn server_options(args: &Args, threads: usize) -> ServerOptions {
    ServerOptions {
        num_threads: threads,
        step_timeout: Duration::from_secs(args.timeout.max(1)),
        trace: args.trace.is_some(),
        data_path: args.data.clone(),
        memory_limit: args
            .memory_limit
            .map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
        ..ServerOptions::default()
    }
}

/// `dflow run --local --strategy S` for a strategy whose tasks exchange tensors through
/// collectives (all-reduce, ZeRO, experts, ...): every task of `cluster` runs in this process as
/// a real task — its own data plane on 127.0.0.1 at a port the system picks (the cluster file's
/// addresses are not used), its own task server — and worker 0 drives them with the chief's
/// driver, the same code path as a job of separate processes.
pub fn run_in_process(args: &Args, cluster: &ClusterSpec) -> anyhow::Result<()> {
    if cluster.num_tasks("worker") == 0 {
        bail!("the cluster has no `worker` job: worker 0 is the chief");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the network runtime")?;
    let transport = match args.transport {
        TransportChoice::Auto => TransportKind::Tcp,
        TransportChoice::Kind(TransportKind::Quic) => bail!(
            "--local runs every task in this process over tcp or shm; --transport quic needs \
             certificates per task: start the tasks separately (dflow launch, docs/launchers.md)"
        ),
        TransportChoice::Kind(k) => k,
    };
    let chief_cfg = chief_config(args, cluster.num_tasks("ps") > 0)?;
    let tasks: Vec<(String, u32)> = cluster
        .jobs()
        .flat_map(|job| cluster.tasks(job).map(move |(i, _)| (job.to_string(), i)))
        .collect();
    let threads = host_cpus::compute_threads(
        args.compute_threads,
        None,
        host_cpus::allowed_cpus().map_or(1, |c| c.len()),
        HostShare {
            local_index: 0,
            local_tasks: tasks.len(),
        },
    );
    let options = |job: &str, index: u32| NodeOptions {
        cluster: cluster.clone(),
        job: job.to_string(),
        index,
        secret: None,
        timeout: Duration::from_secs(args.timeout.max(1)),
        startup_timeout: Duration::from_secs(args.startup_timeout),
        // Every task runs in this process: they share its CPUs, unbound.
        server: server_options(args, threads),
        transport,
        quic_identity: None,
    };
    runtime.block_on(async move {
        let mut listening = Vec::new();
        let mut addresses: std::collections::BTreeMap<
            String,
            std::collections::BTreeMap<u32, String>,
        > = Default::default();
        for (job, index) in &tasks {
            let l = Node::listen(&options(job, *index), "127.0.0.1:0".parse()?, "127.0.0.1")
                .await
                .with_context(|| {
                    format!("task {}", dflow_executor::cluster::task_name(job, *index))
                })?;
            addresses
                .entry(job.clone())
                .or_default()
                .insert(*index, l.local_addr().to_string());
            listening.push(l);
        }
        let actual = ClusterSpec::new(addresses)?;
        let mut joins = tokio::task::JoinSet::new();
        for (l, (job, index)) in listening.into_iter().zip(&tasks) {
            let (cluster, job, index) = (actual.clone(), job.clone(), *index);
            joins.spawn(async move { (job, index, l.join(&cluster).await) });
        }
        let mut chief_node = None;
        let mut servers = tokio::task::JoinSet::new();
        let mut tracers = Vec::new(); // every task's server: traces and traffic
        while let Some(joined) = joins.join_next().await {
            let (job, index, node) = joined.context("a task's join panicked")?;
            let task = dflow_executor::cluster::task_name(&job, index);
            let node = node.with_context(|| format!("task {task}"))?;
            tracers.push((job.clone(), index, node.server.clone()));
            if job == "worker" && index == 0 {
                chief_node = Some(node);
            } else {
                servers.spawn(
                    async move { node.serve().await.with_context(|| format!("task {task}")) },
                );
            }
        }
        let chief_node = chief_node.context("worker 0 did not join")?;
        let result = chief(args, chief_node, &actual, chief_cfg).await;
        // The chief shut every task down (or aborted them); collect their ends.
        while let Some(served) = servers.join_next().await {
            let served = served.context("a task panicked")?;
            if let (Ok(()), Err(e)) = (&result, served) {
                return Err(e);
            }
        }
        if result.is_ok() {
            for (job, index, server) in &tracers {
                let task = dflow_executor::cluster::task_name(job, *index);
                eprintln!("{task}: holds {}; sent {}", server.held(), server.traffic());
            }
        }
        if let Some(path) = &args.trace {
            for (job, index, server) in &tracers {
                if let Some(tracer) = server.tracer() {
                    let path = trace_path(path, job, *index);
                    let json = serde_json::to_string(&tracer.to_chrome_json())?;
                    std::fs::write(&path, json)
                        .with_context(|| format!("writing trace {}", path.display()))?;
                    eprintln!(
                        "trace: {} events written to {}",
                        tracer.len(),
                        path.display()
                    );
                }
            }
        }
        result
    })
}

/// `host:port`, with an IPv6 host in brackets.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Binds this task's data plane, learns the cluster from rank 0 (rank 0 gathers it) and
/// connects to every task.
async fn register_and_join(
    opts: &NodeOptions,
    ranked: &Ranked,
    num_ps: u32,
) -> anyhow::Result<(Node, ClusterSpec)> {
    let within = opts.startup_timeout;
    let me = |address: String| Registration {
        rank: ranked.rank,
        world_size: ranked.world_size,
        job: opts.job.clone(),
        index: opts.index,
        address,
    };
    let Some(master) = &ranked.master else {
        // One process: nobody to register with.
        let listening = Node::listen(opts, "127.0.0.1:0".parse()?, "127.0.0.1").await?;
        let address = listening.local_addr().to_string();
        let cluster =
            ClusterSpec::new([(opts.job.clone(), [(opts.index, address)].into())].into())?;
        return Ok((listening.join(&cluster).await?, cluster));
    };
    let master_address = master.address();
    if ranked.rank == 0 {
        let listener = registration::listen(bind_addr(&master_address)?).await?;
        eprintln!(
            "rank 0: accepting registrations of {} rank(s) at {master_address}",
            ranked.world_size - 1
        );
        let world = ranked.world_size;
        // Roles were checked by `role` for this rank; the same rule holds for every rank.
        let expected = move |rank: u32| {
            role(rank, world, num_ps).unwrap_or_else(|_| ("worker".to_string(), rank))
        };
        let gathered =
            registration::collect(listener, world, &expected, opts.secret.clone(), within).await?;
        // Bound after the others registered: a loopback MASTER_ADDR is replaced by the address
        // they reached rank 0 at, for the data plane and the collective listeners alike.
        let host = gathered.advertised_host(&master.host);
        let bind = std::net::SocketAddr::new(bind_addr(&host_port(&host, 0))?.ip(), 0);
        let listening = Node::listen(opts, bind, &host).await?;
        let own = me(host_port(&host, listening.local_addr().port()));
        let cluster = gathered.answer(own).await?;
        eprintln!(
            "rank 0: every rank registered; the cluster is {}",
            cluster.to_json_value()
        );
        return Ok((listening.join(&cluster).await?, cluster));
    }
    let (stream, ip) = registration::connect(&master_address, ranked.rank, within).await?;
    let listening = Node::listen(opts, std::net::SocketAddr::new(ip, 0), &ip.to_string()).await?;
    let address = std::net::SocketAddr::new(ip, listening.local_addr().port()).to_string();
    let cluster = registration::register(stream, &me(address), opts.secret.clone(), within).await?;
    eprintln!(
        "rank {}: registered with rank 0 at {master_address}",
        ranked.rank
    );
    Ok((listening.join(&cluster).await?, cluster))
}

/// The chief's configuration; without `--strategy`, parameter-server training when the job
/// has a ps and all-reduce otherwise.
fn chief_config(args: &Args, has_ps: bool) -> anyhow::Result<ChiefConfig> {
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
    let init_from = match &args.init_from {
        Some(file) => {
            let (training, _) = expand_training_graph(&loaded.graph.to_def(), &spec)
                .with_context(|| format!("{}: expanding the training step", path.display()))?;
            Some(InitFrom {
                path: file.clone(),
                variables: training.gradients.iter().map(|(v, _)| v.clone()).collect(),
                aliases: TIED_ALIASES
                    .iter()
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .collect(),
            })
        }
        None => None,
    };
    // `--eval-every` is a text run's (a table is evaluated at the end).
    let (data, features, labels, metadata, eval_every) = match &spec.data {
        Some(text_spec) => {
            let run = super::train_text::prepare(args, data_path, text_spec, &loaded.graph)?;
            let data = ChiefData::Text {
                corpus: run.corpus,
                block_size: run.block_size,
                val_fraction: run.val_fraction,
                steps: run.steps,
                eval_batches: args.eval_batches,
            };
            (data, run.inputs, run.targets, run.metadata, args.eval_every)
        }
        None => {
            super::train::refuse_steps_on_a_table(args, data_path)?;
            let data = read_csv(data_path, &ReadOptions::default())
                .with_context(|| format!("reading {}", data_path.display()))?;
            let data = ChiefData::Csv {
                data,
                test_fraction: args.test_fraction,
                epochs: args.epochs,
            };
            let (f, l) = (args.features.clone(), args.labels.clone());
            (data, f, l, Default::default(), 0)
        }
    };
    let kind = default_strategy(args.strategy, has_ps)?;
    check_elastic(args, kind)?;
    Ok(ChiefConfig {
        forward: loaded.graph,
        spec,
        strategy: super::strategy_flags::build_strategy(
            kind,
            super::strategy_flags::StrategyFlags {
                // --staleness 0: no worker ahead of another, the synchronous plan.
                asynchronous: args.r#async && args.staleness != Some(0),
                fusion_threshold_mb: args.fusion_threshold_mb,
                zero_stage: args.zero_stage,
                pipeline: &args.pipeline,
                batch_size: Some(args.batch_size),
                tp: args.tp,
                partition_strategy: args.partition_strategy,
                ep: args.mesh.map(|m| m.ep).filter(|&e| e > 1),
            },
        )?
        .into(),
        placement: PlacementOptions::default(),
        data_path: data_path.clone(),
        data,
        seed: args.seed,
        features,
        labels,
        batch_size: args.batch_size,
        checkpoint_dir: args.checkpoint_dir.clone(),
        save_every: args.save_every,
        keep_checkpoints: 3,
        checkpoint_metadata: metadata,
        eval_every,
        init_from,
        min_workers: args.min_workers,
        staleness: args.staleness.filter(|&s| s > 0),
    })
}

/// Checks `--min-workers`: at least 1, with all-reduce or sync ps (lockstep data parallelism)
/// and with a checkpoint directory (the state a restart restores).
fn check_elastic(args: &Args, kind: dflow_partitioner::StrategyKind) -> anyhow::Result<()> {
    let Some(k) = args.min_workers else {
        return Ok(());
    };
    if k == 0 {
        bail!("--min-workers 0: an elastic job needs at least 1 worker left to go on");
    }
    if !matches!(kind.name(), "allreduce" | "ps") || args.r#async {
        bail!(
            "--min-workers {k} needs --strategy allreduce or a sync --strategy ps (elastic jobs re-plan the lockstep data parallelism on the survivors); this job uses {}{}",
            kind.name(),
            if args.r#async { " --async" } else { "" }
        );
    }
    if args.checkpoint_dir.is_none() {
        bail!("--min-workers {k} needs --checkpoint-dir DIR: after a worker dies the job goes on from the newest checkpoint there (save often with --save-every N)");
    }
    Ok(())
}

/// The median step of the run (after `trained N steps in T s`, the mean).
fn print_step_times(clock: &StepClock) {
    if let Some(t) = clock.times() {
        eprintln!("{t}");
    }
}

/// How the chief shows its progress: epochs of a table, or steps of a text in tokens/s.
enum ChiefProgress {
    Table(Option<Progress>),
    Text(TextProgress),
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
    let epochs = args.epochs;
    let quiet = args.quiet;
    let mut progress = match &cfg.data {
        ChiefData::Text {
            block_size, steps, ..
        } => ChiefProgress::Text(TextProgress::new(
            *steps,
            (cfg.batch_size * block_size) as u64,
            quiet,
        )),
        ChiefData::Csv { .. } => ChiefProgress::Table(None),
    };
    let mut clock = StepClock::default();
    let result = run_chief(&rpc, cluster, &cfg, |r| {
        clock.tick();
        match &mut progress {
            ChiefProgress::Text(p) => p.step(r),
            ChiefProgress::Table(p) => p
                .get_or_insert_with(|| Progress::new(epochs, r.total_steps / epochs.max(1), quiet))
                .step(r),
        }
    })
    .await;
    match &progress {
        ChiefProgress::Text(p) => p.finish(),
        ChiefProgress::Table(Some(p)) => p.finish(),
        ChiefProgress::Table(None) => {}
    }
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            rpc.shutdown(Some(format!("the chief failed: {e}"))).await;
            return Err(e).context("chief /job:worker/replica:0/task:0");
        }
    };
    rpc.shutdown(None).await;
    if let (Some(n), Some(file)) = (report.initialized, &args.init_from) {
        eprintln!("initialized {n} variables from {}", file.display());
    }
    if let Some(step) = report.resumed_from {
        eprintln!("resumed from the checkpoint at step {step}");
    }
    if let Some(path) = &report.checkpoint {
        eprintln!("checkpoint: {}", path.display());
    }
    let secs = report.elapsed.as_secs_f64().max(1e-9);
    if let Some((mean, max)) = report.staleness {
        println!("staleness: mean {mean:.2} max {max} updates");
    }
    match &cfg.data {
        ChiefData::Text { block_size, .. } => {
            eprintln!(
                "trained {} steps in {secs:.3} s ({:.0} tokens/s) on {} characters ({} held out)",
                report.losses.len(),
                report.examples as f64 * *block_size as f64 / secs,
                report.train_examples,
                report.test_examples
            );
            print_step_times(&clock);
            super::train_text::print_validation(&report.held_out, args.eval_batches);
        }
        ChiefData::Csv { .. } => {
            eprintln!(
                "trained {} steps in {secs:.3} s ({:.0} examples/s) on {} examples ({} held out)",
                report.losses.len(),
                report.examples as f64 / secs,
                report.train_examples,
                report.test_examples
            );
            print_step_times(&clock);
            if report.held_out.is_empty() {
                println!("no held-out examples: nothing to evaluate");
            }
            for (name, value) in &report.held_out {
                println!("held-out {name}: {value:.4}");
            }
        }
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

/// `--strategy`, or by default `ps` when the job has a ps task and `allreduce` when it has none.
fn default_strategy(
    given: Option<dflow_partitioner::StrategyKind>,
    has_ps: bool,
) -> anyhow::Result<dflow_partitioner::StrategyKind> {
    match given {
        Some(kind) => Ok(kind),
        None => {
            let name = if has_ps { "ps" } else { "allreduce" };
            name.parse()
                .map_err(|e| anyhow::anyhow!("the default strategy {name}: {e}"))
        }
    }
}
