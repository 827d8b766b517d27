//! `dflow run`: run a graph. `--local` starts every task of the cluster inside this process;
//! `--job J --index I` (or the launcher's environment, [`dflow::identity`]) runs one task of a distributed job (see
//! [`super::cluster`]).

use super::host_cpus::CpuBinding;
use super::train::Targets;
use anyhow::{bail, Context};
use dflow::identity::{self, Place, ProcessEnv, Source};
use dflow_executor::npy;
use dflow_executor::{Session, SessionOptions};
use dflow_graph::{ClusterSpec, Tensor};
use std::path::PathBuf;
use std::time::Duration;

/// Arguments of `dflow run`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The graph file (JSON or DSL). Needed by `--local` runs and the chief (worker 0); other
    /// tasks of a distributed job get their partitions from the chief.
    pub graph: Option<PathBuf>,
    /// Run every task of the cluster in this process (the in-process backend).
    #[arg(long, conflicts_with_all = ["job", "index"])]
    pub local: bool,
    /// Distributed: this process's job in the cluster (`ps` or `worker`; worker 0 is the chief).
    /// Without --job and --local, the task comes from the environment: TF_CONFIG, then
    /// torchrun/PyTorchJob (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), Slurm, MPI (see
    /// docs/launchers.md).
    #[arg(long, requires = "cluster")]
    pub job: Option<String>,
    /// Distributed: this process's index in its job.
    #[arg(long, default_value_t = 0)]
    pub index: u32,
    /// The cluster spec (JSON). With --local, defaults to one ps and one worker.
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// Distributed: a file holding the cluster secret (at least 16 bytes); every connection
    /// must prove it knows it. Without it, the DFLOW_SECRET environment variable is used if set.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// Distributed: the transport between tasks: `tcp`, `shm` (same host), `quic` (mutual TLS;
    /// needs --cert-dir), `rdma` (feature build), or `auto` (`shm` when every task of the
    /// cluster is on this host, else `tcp`).
    #[arg(long, default_value = "tcp", value_parser = |s: &str| s.parse::<super::transport_choice::TransportChoice>())]
    pub transport: super::transport_choice::TransportChoice,
    /// Distributed, `--transport quic`: the directory `dflow cert` wrote (ca.crt and this task's
    /// JOB-INDEX.crt/.key). Default: the DFLOW_CERT_DIR environment variable.
    #[arg(long, value_name = "DIR")]
    pub cert_dir: Option<PathBuf>,
    /// Distributed, `--transport quic`: the cluster CA certificate (instead of DIR/ca.crt).
    #[arg(long, value_name = "FILE")]
    pub ca: Option<PathBuf>,
    /// Distributed, `--transport quic`: this task's certificate (instead of DIR/JOB-INDEX.crt).
    #[arg(long, value_name = "FILE")]
    pub cert: Option<PathBuf>,
    /// Distributed, `--transport quic`: this task's private key (instead of DIR/JOB-INDEX.key).
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Distributed: seconds to wait for every other task to start.
    #[arg(long, default_value_t = 60)]
    pub startup_timeout: u64,
    /// Distributed training: how the workers train together. Default: `ps` when the job has a
    /// ps task, else `allreduce`.
    #[arg(long, value_parser = super::common::strategy_parser())]
    pub strategy: Option<dflow_partitioner::StrategyKind>,
    /// Distributed, identity from rank variables (RANK/WORLD_SIZE, Slurm, MPI): the last N
    /// ranks are parameter servers; the others are workers in rank order (rank 0 is the chief).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub num_ps: u32,
    /// Distributed all-reduce training: the fusion threshold, in MiB, of a gradient bucket.
    #[arg(long, default_value_t = 25.0)]
    pub fusion_threshold_mb: f64,
    /// `--strategy pipeline`: the stages, micro-batches and schedule (also with --local).
    #[command(flatten)]
    pub pipeline: super::strategy_flags::PipelineFlags,
    /// The workers as a device mesh, `dp=D,tp=T,pp=P`, in Megatron-core rank order (tp fastest,
    /// then dp, then pp); the product must equal the number of workers. tp > 1 runs --strategy
    /// tensor --tp T on each of D replicas (TP groups of T consecutive workers), the gradients
    /// summed over the DP groups; with pp > 1 too, that layout runs inside P balanced pipeline
    /// stages (stage s, shard t, replica d on worker s·D·T + d·T + t; --micro-batches,
    /// --schedule apply). tp = 1, pp > 1 runs the pipeline strategy with P stages and D
    /// replicas; tp = pp = 1 runs all-reduce (or ZeRO with --zero-stage). --zero-stage 1|2|3
    /// beside tp > 1 (pp = 1), or over a pipeline's replicas (tp = 1, pp > 1), shards the Adam
    /// slots (3: and the weights) over the DP groups instead. ep = E (dividing D, with
    /// tp = pp = 1) runs --strategy expert with each MoE layer's experts spread over runs of E
    /// consecutive workers (expert-parallel groups) and each expert's gradient summed over the D/E
    /// workers holding it (docs/experts.md); with --zero-stage 1|2|3 the dense parameters' Adam
    /// slots (3: and the weights) are sharded over the D workers and each expert shard's over
    /// its D/E holders. ep = E beside tp > 1 (pp = 1) runs --strategy tensor with each MoE
    /// layer replicated over tp and its experts spread over E replicas; with --zero-stage 1|2|3
    /// each rank's dense slots (3: and weights) are sharded over its DP group and each expert
    /// shard's over the D/E replicas of its tp coordinate holding it.
    #[arg(long, value_name = "dp=D,tp=T,pp=P[,ep=E]", value_parser = |s: &str| s.parse::<dflow_partitioner::mesh::Mesh>())]
    pub mesh: Option<dflow_partitioner::mesh::Mesh>,
    /// Distributed training with --strategy zero: 1 shards the Adam/AdamW slots over the
    /// workers, 2 also the summed gradients (reduce-scatter instead of all-reduce), 3 also the
    /// parameters (all-gathered just before each use). Default 1. With --mesh dp=D,tp=T (or
    /// --strategy tensor over D·T workers), or --mesh dp=D,pp=P: any stage over each rank's
    /// data-parallel group (1 or 2 with --mesh dp=D,tp=T,pp=P). With --mesh dp=D,ep=E (or
    /// --strategy expert): any stage, the dense slots (3: and weights) over the D workers and
    /// each expert shard's over its D/E holders. With --mesh dp=D,tp=T,ep=E: any stage, the
    /// dense slots (3: and weights) over each rank's DP group, each expert shard's over its D/E
    /// holders.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
    pub zero_stage: Option<u8>,
    /// Distributed: the most bytes this task's variables and step tensors may take. A plan
    /// whose variables plus largest step tensor on this task do not fit is refused before
    /// step 1, naming the biggest consumers; a step passing it at run time fails naming the
    /// node.
    #[arg(long, value_name = "BYTES")]
    pub memory_limit: Option<u64>,
    /// With --strategy tensor: the tensor-parallel size (Megatron layout over T consecutive
    /// workers; default: every worker). W workers run W/T data-parallel replicas (as --mesh
    /// dp=W/T,tp=T).
    #[arg(long, value_name = "T")]
    pub tp: Option<usize>,
    /// Parameter-server training: how embedding tables (Variables with a `partition_strategy`)
    /// are sharded over the ps tasks, `mod` or `div`, overriding the graph's.
    #[arg(long, value_name = "mod|div", value_parser = |s: &str| s.parse::<dflow_graph::embedding_partition::PartitionStrategy>())]
    pub partition_strategy: Option<dflow_graph::embedding_partition::PartitionStrategy>,
    /// Distributed training: aggregate all workers' gradients on the ps and apply them once per
    /// step (the default).
    #[arg(long, conflicts_with = "async")]
    pub sync: bool,
    /// Distributed training: apply each worker's gradients as they arrive; reports staleness.
    #[arg(long = "async")]
    pub r#async: bool,
    /// Asynchronous training: bounded staleness (stale-synchronous parallel). A worker may be
    /// at most S completed steps ahead of the slowest; 0 trains synchronously.
    #[arg(long, value_name = "S", requires = "async")]
    pub staleness: Option<u64>,
    /// Training: write `step loss` lines of every step to FILE.
    #[arg(long, value_name = "FILE")]
    pub losses_out: Option<PathBuf>,
    /// Feed a tensor from a .npy file: `name=FILE.npy` (repeatable).
    #[arg(long = "feed", value_name = "NAME=FILE")]
    pub feeds: Vec<String>,
    /// Fetch a tensor by name (`node` or `node:1`) and print it (repeatable).
    #[arg(long = "fetch", value_name = "NAME")]
    pub fetches: Vec<String>,
    /// Run a node for its effect (repeatable).
    #[arg(long = "target", value_name = "NODE")]
    pub targets: Vec<String>,
    /// Number of steps to run (default 1). Training on a text (a graph whose `train.data` reads
    /// character windows) counts optimizer steps, default 2000 (the bundled GPT's lr schedule
    /// decays over 2000).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Training on a text: compute the validation loss every N steps (0: only at the end).
    #[arg(long, default_value_t = 250)]
    pub eval_every: u64,
    /// Training on a text: batches of the validation split each validation loss averages
    /// (0: no validation loss, not even at the end, and a distributed job does not register
    /// its evaluation graph). A pipeline (with tp, ep or ZeRO) evaluates on its stages, tensor
    /// parallelism on tp group 0's shards (beside ZeRO-3 each rank gathering its flat shards
    /// per use, the other replicas joining), ZeRO-3 gathers each weight just before its use;
    /// the 4-axis mesh on replica 0's stages, each joining its own shards; experts without a
    /// pipeline run on their ranks, tokens sent there and back (`dp,ep` beside worker 0's dense
    /// copy, its ZeRO-3 weights gathered per use; `dp,tp,ep` beside tp group 0's shards).
    /// Placements written by hand, and any layout without a static batch (`--batch-size`),
    /// join the weights on worker 0.
    #[arg(long, default_value_t = 20)]
    pub eval_batches: u64,
    /// Training: load these variables (a safetensors file, names as the graph's variables)
    /// before step 1. Ignored when resuming from --checkpoint-dir.
    #[arg(long, value_name = "FILE.safetensors")]
    pub init_from: Option<PathBuf>,
    /// Write a Chrome trace (open in Perfetto or chrome://tracing).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Write each fetched tensor of the last step to DIR/NAME.npy.
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
    /// Seconds a step may take before it is aborted; distributed, also how long a silent task
    /// is trusted before it is declared dead.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// Distributed: compute threads of each task this process runs (default: one per CPU the
    /// task is bound to; unbound, the CPUs this process may use shared among the cluster's
    /// tasks on its host), at least 2: a collective holds its thread until its peers join, and
    /// with 1 a task can wait forever on a value only its busy thread would send. `1` runs the
    /// nodes in the order `dflow plan`'s memory accounting assumes (its tests pin jobs to one
    /// CPU with one thread).
    #[arg(long, value_name = "N")]
    pub compute_threads: Option<usize>,
    /// Distributed: `auto` binds each of the tasks sharing a host (same address host in the
    /// cluster; with registration, the launcher's local rank and `LOCAL_WORLD_SIZE` or
    /// `OMPI_COMM_WORLD_LOCAL_SIZE`) to its share of the CPUs this process may use, round
    /// robin when the tasks outnumber them, as `mpirun` binds ranks; a task alone on its host
    /// stays unbound. `none` never binds. `--local` runs every task in one process, unbound.
    #[arg(long, value_enum, default_value_t = CpuBinding::Auto)]
    pub cpu_binding: CpuBinding,
    /// Training: the data set (CSV, gzip detected; label in the last column). Requires a graph
    /// with a `train` section.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Training: epochs over the training split.
    #[arg(long, default_value_t = 30)]
    pub epochs: u64,
    /// Training: examples per step.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Training: fraction of the data held out for evaluation.
    #[arg(long, default_value_t = 0.2)]
    pub test_fraction: f64,
    /// Training: seed of the train/test split and of the per-epoch shuffle.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Training: the placeholder fed with features.
    #[arg(long, default_value = "pixels")]
    pub features: String,
    /// Training: the placeholder fed with labels.
    #[arg(long, default_value = "labels")]
    pub labels: String,
    /// Training: write checkpoints here, and resume from the newest one on start.
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Training: save a checkpoint every N steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    pub save_every: u64,
    /// Distributed all-reduce or sync ps training: an elastic job. When a worker other than
    /// the chief dies and at least K workers remain, the chief re-plans the job on the
    /// survivors, restores the newest checkpoint of --checkpoint-dir (needed) and goes on with
    /// the same global batch; fewer than K survivors end the job. A worker of the cluster
    /// started again while the job runs joins it before the next step (see docs/launchers.md).
    #[arg(long, value_name = "K")]
    pub min_workers: Option<usize>,
    /// Plain log lines instead of a progress bar (also when stderr is not a terminal).
    #[arg(long)]
    pub quiet: bool,
}

/// Runs `dflow run`.
pub fn run(mut args: Args) -> anyhow::Result<()> {
    if let Some(mesh) = args.mesh {
        args.strategy = Some(super::strategy_flags::apply_mesh(
            &mesh,
            args.strategy,
            args.zero_stage,
            &mut args.tp,
            &mut args.pipeline,
        )?);
    }
    if !args.local {
        if let Some(job) = &args.job {
            let path = args.cluster.as_ref().context("--job needs --cluster")?;
            let cluster = ClusterSpec::from_file(path)?;
            let job = job.clone();
            eprintln!(
                "dflow: identity from {}: /job:{job}/task:{}",
                Source::Flags,
                args.index
            );
            return super::job::run_task(&args, cluster, &job, args.index);
        }
        let Some(identity) = identity::from_env(&ProcessEnv)? else {
            bail!("say where to run: --local (every task in this process), --job J --index I --cluster FILE (one task of a distributed job), or start under a launcher that sets TF_CONFIG, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun, PyTorchJob, `dflow launch`), Slurm's srun or mpirun (see docs/launchers.md)");
        };
        eprintln!("dflow: {}", identity.describe());
        return match identity.place {
            Place::Task {
                cluster,
                job,
                index,
            } => super::job::run_task(&args, cluster, &job, index),
            Place::Evaluator => Ok(()),
            Place::Ranked(ranked) => super::job::run_ranked(&args, ranked),
        };
    }
    let Some(graph_path) = &args.graph else {
        bail!("--local needs the graph file");
    };
    if let (Some(limit), None) = (args.memory_limit, args.strategy) {
        bail!(
            "--memory-limit {limit} applies to the tasks of a distributed job (--job/--index, a \
             launcher, `dflow launch`, or --local with a --strategy that runs them in this \
             process), not to a plain --local run"
        );
    }
    let cluster = match &args.cluster {
        Some(p) => ClusterSpec::from_file(p)?,
        None => ClusterSpec::local(&[("ps", 1), ("worker", 1)])?,
    };
    if let Some(mesh) = &args.mesh {
        super::strategy_flags::check_mesh_workers(mesh, cluster.num_tasks("worker"))?;
    }
    if let Some(kind) = args.strategy {
        return local_strategy(&args, kind, graph_path, cluster);
    }
    let program = super::common::load_program(graph_path)?;
    let mut feeds: Vec<(String, Tensor)> = Vec::new();
    for f in &args.feeds {
        let (name, file) = f
            .split_once('=')
            .with_context(|| format!("--feed {f:?}: expected NAME=FILE.npy"))?;
        let t = npy::read_tensor(file.as_ref()).with_context(|| format!("--feed {name}"))?;
        feeds.push((name.to_string(), t));
    }
    let opts = SessionOptions {
        step_timeout: Duration::from_secs(args.timeout),
        trace: args.trace.is_some(),
        ..SessionOptions::default()
    };
    if let Some(data) = &args.data {
        let training = program.training.context(
            "--data trains the graph, but the graph file has no `train` section (see docs/graph-format.md)",
        )?;
        let session = Session::new(program.graph, cluster, opts)?;
        let targets = Targets::of(&training);
        match &training.data {
            Some(spec) => super::train_text::train_text(&args, data, spec, &targets, &session)?,
            None => super::train::train(&args, data, &targets, &session)?,
        }
        return write_trace(&args, &session);
    }
    if args.fetches.is_empty() && args.targets.is_empty() {
        if let Some(t) = &program.training {
            bail!(
                "nothing to run: {} is a training graph; give --data FILE (CSV, optionally \
                 gzip) to train it, or --fetch NAME / --target NAME to run single nodes (its \
                 loss is `{}`)",
                graph_path.display(),
                t.loss
            );
        }
        bail!(
            "nothing to run: give at least one --fetch NAME[:OUTPUT] (a tensor to print) or \
             --target NAME (a node to run, e.g. an update or `init`)"
        );
    }
    let graph = program.graph;
    let session = Session::new(graph, cluster, opts)?;
    let feed_refs: Vec<(&str, Tensor)> =
        feeds.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
    let fetch_refs: Vec<&str> = args.fetches.iter().map(String::as_str).collect();
    let target_refs: Vec<&str> = args.targets.iter().map(String::as_str).collect();
    let mut last = Vec::new();
    for _ in 0..args.steps.unwrap_or(1).max(1) {
        last = session.run(&feed_refs, &fetch_refs, &target_refs)?;
    }
    for (name, t) in args.fetches.iter().zip(&last) {
        println!("{name}: {}", format_tensor(t));
    }
    if let Some(dir) = &args.out_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for (name, t) in args.fetches.iter().zip(&last) {
            let file = dir.join(format!("{}.npy", name.replace(['/', ':'], "_")));
            npy::write_tensor(&file, t)?;
        }
    }
    write_trace(&args, &session)
}

/// `--local --strategy S`. A pipeline without replicas is one graph without collectives: it runs
/// in one [`Session`], every stage an in-process device. Every other strategy (and a pipeline
/// over a `--mesh`) runs its tasks in this process as a real cluster job under the chief's
/// driver ([`super::job::run_in_process`]).
fn local_strategy(
    args: &Args,
    kind: dflow_partitioner::StrategyKind,
    graph_path: &std::path::Path,
    cluster: ClusterSpec,
) -> anyhow::Result<()> {
    use dflow_partitioner::strategy::pipeline::Pipeline;
    if kind.name() != "pipeline"
        || args.mesh.as_ref().is_some_and(|m| m.dp > 1)
        || args.zero_stage.is_some()
    {
        // Collectives between tasks: every task runs in this process under the chief's driver
        // (ZeRO over a pipeline's replicas too; with one replica the strategy refuses it).
        return super::job::run_in_process(args, &cluster);
    }
    if let Some(limit) = args.memory_limit {
        bail!(
            "--memory-limit {limit} applies to tasks; --local --strategy pipeline runs one \
             session: drop --memory-limit, or start the stages as tasks (dflow launch)"
        );
    }
    let Some(data) = &args.data else {
        bail!("--strategy trains the graph: give --data FILE");
    };
    let loaded = super::common::load(graph_path)?;
    let Some(spec) = loaded.parsed.def.train.clone() else {
        bail!(
            "{}: --strategy trains the graph, but it has no `train` section (see docs/graph-format.md)",
            graph_path.display()
        );
    };
    let (features, labels) = match &spec.data {
        Some(dflow_graph::train::DataSpec::CharWindows {
            inputs, targets, ..
        }) => (inputs.clone(), targets.clone()),
        None => (args.features.clone(), args.labels.clone()),
    };
    let pipeline = Pipeline {
        stages: args.pipeline.stages,
        micro_batches: args.pipeline.micro_batches,
        schedule: args.pipeline.schedule,
        chunks: args.pipeline.chunks(),
        batch_size: Some(args.batch_size),
    };
    let input =
        dflow_partitioner::JobInput::new(&loaded.graph, &spec, &cluster, &features, &labels);
    let (replica, shape) = pipeline
        .training_graph(&input)
        .context("planning the pipeline failed")?;
    eprintln!(
        "{}: {} stages × {} chunk(s), {} micro-batches of {}",
        dflow_partitioner::Strategy::describe(&pipeline),
        shape.stages,
        shape.chunks,
        shape.micro_batches,
        args.batch_size / shape.micro_batches.max(1)
    );
    let targets = Targets {
        loss: replica.training.loss.clone(),
        train_op: replica.training.train_op.clone(),
        eval_feeds: Some((replica.eval.features.clone(), replica.eval.labels.clone())),
        eval_loss: replica.eval.loss.clone(),
        eval_metrics: spec
            .metrics
            .iter()
            .cloned()
            .zip(replica.eval.metrics.iter().cloned())
            .collect(),
        trainable: replica
            .training
            .gradients
            .iter()
            .map(|(v, _)| v.clone())
            .collect(),
        full_batches: true,
    };
    let opts = SessionOptions {
        step_timeout: Duration::from_secs(args.timeout),
        trace: args.trace.is_some(),
        placement: dflow_partitioner::PlacementOptions {
            policy: dflow_partitioner::Policy::Explicit,
            ..Default::default()
        },
        ..SessionOptions::default()
    };
    let session = Session::new(replica.graph, cluster, opts)?;
    match &spec.data {
        Some(text) => super::train_text::train_text(args, data, text, &targets, &session)?,
        None => super::train::train(args, data, &targets, &session)?,
    }
    write_trace(args, &session)
}

fn write_trace(args: &Args, session: &Session) -> anyhow::Result<()> {
    if let (Some(path), Some(tracer)) = (&args.trace, session.tracer()) {
        let json = serde_json::to_string(&tracer.to_chrome_json())?;
        std::fs::write(path, json).with_context(|| format!("writing trace {}", path.display()))?;
        eprintln!(
            "trace: {} events written to {}",
            tracer.len(),
            path.display()
        );
    }
    Ok(())
}

/// Prints a tensor like numpy: dtype, shape, then nested rows (long tensors are elided).
pub fn format_tensor(t: &Tensor) -> String {
    let vals = t.to_f64_vec();
    let fmt_val = |x: f64| -> String {
        if t.dtype().is_float() {
            format!("{x:.6}")
        } else {
            format!("{x}")
        }
    };
    fn nest(dims: &[usize], vals: &[String], depth: usize) -> String {
        match dims {
            [] => vals.first().cloned().unwrap_or_default(),
            [n] => format!("[{}]", elide(vals, *n).join(", ")),
            [n, rest @ ..] => {
                let inner: usize = rest.iter().product();
                let rows: Vec<String> = (0..*n)
                    .map(|i| {
                        nest(
                            rest,
                            vals.get(i * inner..(i + 1) * inner).unwrap_or(&[]),
                            depth + 1,
                        )
                    })
                    .collect();
                let rows = elide(&rows, *n);
                format!("[{}]", rows.join(&format!(",\n{}", " ".repeat(depth + 1))))
            }
        }
    }
    fn elide(v: &[String], n: usize) -> Vec<String> {
        if n > 12 {
            let mut out: Vec<String> = v.iter().take(5).cloned().collect();
            out.push("...".into());
            out.extend(v.iter().skip(n.saturating_sub(5)).cloned());
            out
        } else {
            v.to_vec()
        }
    }
    let strs: Vec<String> = vals.into_iter().map(fmt_val).collect();
    format!("{}{}\n{}", t.dtype(), t.shape(), nest(t.dims(), &strs, 0))
}
