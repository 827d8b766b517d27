//! `dflow partition`.

use anyhow::Context as _;
use dflow_graph::{ClusterSpec, DeviceName};
use dflow_partitioner::{
    partition, place, render_dot, render_job_text, render_json, render_text, JobInput,
    PartitionOptions, Partitions, PlacementOptions, Policy, PsStrategy,
};
use std::path::PathBuf;

/// Output format of `dflow partition`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One block per device, then a summary.
    Text,
    /// Everything, loadable by the executor.
    Json,
    /// Graphviz, one cluster per device.
    Dot,
}

/// How variables are spread over ps tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PsStrategyArg {
    /// ps tasks in turn.
    RoundRobin,
    /// The ps task with the fewest bytes so far.
    Greedy,
}

/// Arguments of `dflow partition`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("planned").args(["strategy", "mesh"]).multiple(true)))]
pub struct Args {
    /// The graph file: dflow JSON, the dflow DSL, or a TensorFlow GraphDef in protobuf JSON.
    pub graph: PathBuf,
    /// The cluster spec (TF cluster JSON).
    #[arg(long)]
    pub cluster: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Write one file per device plus `summary.*` into this directory instead of stdout.
    #[arg(short = 'o', long = "out-dir")]
    pub out_dir: Option<PathBuf>,
    /// Tensors to fetch (`y` or `y:0`); with targets, prunes to what they need.
    #[arg(long = "fetch")]
    pub fetches: Vec<String>,
    /// Nodes to run.
    #[arg(long = "target")]
    pub targets: Vec<String>,
    /// Tensors the client feeds.
    #[arg(long = "feed")]
    pub feeds: Vec<String>,
    /// How variables are spread over ps tasks.
    #[arg(long, value_enum, default_value_t = PsStrategyArg::RoundRobin)]
    pub ps_strategy: PsStrategyArg,
    /// Device of nodes that request none.
    #[arg(long, default_value = "/job:worker/task:0")]
    pub default_device: String,
    /// Fall back to an existing device type when a requested one does not exist.
    #[arg(long)]
    pub soft_placement: bool,
    /// Plan the distributed training job of the graph's `train` section with this strategy and
    /// print its job plan (the plan `dflow run` executes): signatures, feeds, collective groups
    /// and every task's slots.
    #[arg(long, value_parser = super::common::strategy_parser())]
    pub strategy: Option<dflow_partitioner::StrategyKind>,
    /// Plan the training job on the workers as a device mesh, `dp=D,tp=T,pp=P` (as `dflow run
    /// --mesh`, `ep=E` included): it picks the strategy, and prints the tensor-parallel layout and
    /// the pipeline where the mesh has them, and every collective group (the expert-parallel and
    /// expert-data-parallel ones for ep).
    #[arg(long, value_name = "dp=D,tp=T,pp=P[,ep=E]", value_parser = |s: &str| s.parse::<dflow_partitioner::mesh::Mesh>())]
    pub mesh: Option<dflow_partitioner::mesh::Mesh>,
    /// With --strategy: the placeholder fed with features.
    #[arg(long, default_value = "pixels", requires = "planned")]
    pub features: String,
    /// With --strategy: the placeholder fed with labels.
    #[arg(long, default_value = "labels", requires = "planned")]
    pub labels: String,
    /// With --strategy ps: asynchronous updates.
    #[arg(long = "async", requires = "planned")]
    pub r#async: bool,
    /// With --strategy allreduce: the fusion threshold, in MiB, of a gradient bucket.
    #[arg(long, default_value_t = 25.0, requires = "planned")]
    pub fusion_threshold_mb: f64,
    /// With --strategy: the global batch size (a pipeline sizes its activations by it).
    #[arg(long, requires = "planned")]
    pub batch_size: Option<usize>,
    /// With --strategy pipeline: the stages, micro-batches and schedule.
    #[command(flatten)]
    pub pipeline: super::strategy_flags::PipelineFlags,
    /// With --strategy pipeline: also draw the schedule's timeline into FILE (SVG).
    #[arg(long, value_name = "FILE.svg", requires = "planned")]
    pub timeline: Option<PathBuf>,
    /// With --strategy zero: 1 shards the Adam/AdamW slots over the workers, 2 also the summed
    /// gradients (reduce-scatter instead of all-reduce), 3 also the parameters (all-gathered
    /// before each use). Default 1. With --mesh dp=D,tp=T: any stage over each rank's
    /// data-parallel group.
    #[arg(long, requires = "planned", value_parser = clap::value_parser!(u8).range(1..=3))]
    pub zero_stage: Option<u8>,
    /// With --strategy tensor: the tensor-parallel size (Megatron layout over T workers; default:
    /// every worker).
    #[arg(long, value_name = "T", requires = "planned")]
    pub tp: Option<usize>,
    /// Parameter-server training: how embedding tables (Variables with a `partition_strategy`)
    /// are sharded over the ps tasks, `mod` or `div`, overriding the graph's.
    #[arg(long, value_name = "mod|div", value_parser = |s: &str| s.parse::<dflow_graph::embedding_partition::PartitionStrategy>())]
    pub partition_strategy: Option<dflow_graph::embedding_partition::PartitionStrategy>,
}

/// `dflow partition --strategy S`: the job plan of the graph's training job.
fn plan(args: &Args, kind: dflow_partitioner::StrategyKind) -> anyhow::Result<()> {
    if args.format != Format::Text || args.out_dir.is_some() {
        anyhow::bail!("--strategy prints the job plan as text: drop --format and -o");
    }
    let loaded = super::common::load(&args.graph)?;
    let Some(train) = loaded.parsed.def.train.clone() else {
        anyhow::bail!(
            "{}: --strategy plans a training job, but the graph has no `train` section (see docs/graph-format.md)",
            args.graph.display()
        );
    };
    let cluster = ClusterSpec::from_file(&args.cluster)?;
    let strategy = super::strategy_flags::build_strategy(
        kind,
        super::strategy_flags::StrategyFlags {
            asynchronous: args.r#async,
            fusion_threshold_mb: args.fusion_threshold_mb,
            zero_stage: args.zero_stage,
            pipeline: &args.pipeline,
            batch_size: args.batch_size,
            tp: args.tp,
            partition_strategy: args.partition_strategy,
            ep: args.mesh.map(|m| m.ep).filter(|&e| e > 1),
        },
    )?;
    let placement = PlacementOptions {
        default_device: DeviceName::parse(&args.default_device).context("--default-device")?,
        allow_soft_placement: args.soft_placement,
        ..PlacementOptions::default()
    };
    let input = JobInput {
        graph: &loaded.graph,
        train: &train,
        cluster: &cluster,
        features: &args.features,
        labels: &args.labels,
        placement: &placement,
    };
    if kind.name() == "pipeline" {
        use dflow_partitioner::strategy::pipeline::{render, Pipeline};
        let pipeline = Pipeline {
            stages: args.pipeline.stages,
            micro_batches: args.pipeline.micro_batches,
            schedule: args.pipeline.schedule,
            chunks: args.pipeline.chunks(),
            batch_size: args.batch_size,
        };
        let (mut plan, shape) = pipeline
            .plan_with_shape(&input)
            .context("planning the job failed")?;
        if args.zero_stage.is_some() {
            // ZeRO over the replicas: the same pipeline, another step.
            plan = strategy.plan(&input).context("planning the job failed")?;
        }
        print!("{}", render_job_text(&plan));
        print!(
            "{}",
            render::render_pipeline(&plan, shape, pipeline.schedule)
        );
        if let Some(path) = &args.timeline {
            let svg = render::timeline_svg(pipeline.schedule, shape).map_err(anyhow::Error::msg)?;
            std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("timeline: {}", path.display());
        }
        return Ok(());
    }
    if args.timeline.is_some() {
        anyhow::bail!("--timeline draws a pipeline's schedule: it needs --strategy pipeline");
    }
    let plan = strategy.plan(&input).context("planning the job failed")?;
    print!("{}", render_job_text(&plan));
    if let (Some(stages), "tensor") = (args.pipeline.stages.filter(|&p| p > 1), kind.name()) {
        // Tensor parallelism inside pipeline stages: the pipeline of shard 0 of replica 0.
        use dflow_partitioner::strategy::pipeline::{render, schedule::PipelineShape};
        let shape = PipelineShape {
            stages,
            micro_batches: args.pipeline.micro_batches,
            chunks: args.pipeline.chunks(),
        };
        print!(
            "{}",
            render::render_pipeline(&plan, shape, args.pipeline.schedule)
        );
        println!(
            "\nthe tensor-parallel layout below is shown for the whole model; in the mesh, the ranks \
             of stage s in replica d run the collectives of their stage's layers, once per \
             micro-batch, in group tensor_s<s>_d<d>"
        );
    }
    let ep_beside_tp = args.mesh.is_some_and(|m| m.ep > 1);
    if kind.name() == "tensor" && ep_beside_tp {
        // The tensor-parallel layout alone refuses the MoE layers, which ep × tp replicates
        // over tp: the job plan above is the whole story (docs/experts.md, "ep beside tp").
        println!(
            "\nthe MoE layers are replicated over tp and their experts spread over ep: the groups \
             and each rank's shards are listed above"
        );
    }
    if kind.name() == "tensor" && !ep_beside_tp {
        let workers = cluster.num_tasks("worker");
        let tp = args.tp.unwrap_or(workers);
        // Several tensor-parallel groups (the GPT's layout or placements by hand): the tp
        // section shows one replica, fed its part of the batch, then the data-parallel axis.
        // Inside pipeline stages a replica is tp × pp workers.
        let pp = args.pipeline.stages.unwrap_or(1).max(1);
        let dp =
            (tp > 0 && workers % (tp * pp) == 0 && workers > tp * pp).then(|| workers / (tp * pp));
        print!(
            "{}",
            dflow_partitioner::strategy::tensor::render_tensor_plan(
                &loaded.graph,
                &train,
                tp,
                &args.features,
                &args.labels,
                args.batch_size.map(|b| b / dp.unwrap_or(1)),
            )?
        );
        if let (Some(dp), true) = (dp, pp > 1) {
            // The 3D mesh: each (stage, shard) sums its gradients (or runs ZeRO's step) over
            // its own data-parallel group, listed with the job plan's groups above.
            let zero = match args.zero_stage {
                Some(s) => format!(", ZeRO stage {s}'s step"),
                None => String::new(),
            };
            println!(
                "\ndata parallelism inside the pipeline stages: dp={dp} × tp={tp} × pp={pp}; \
                 the ranks of stage s and shard t in the {dp} replicas sum their gradients{zero} \
                 over group pipeline/stage<s>_t<t> (listed above)"
            );
        } else if let Some(dp) = dp {
            let mesh = dflow_partitioner::mesh::Mesh::new(dp, tp, 1)?;
            print!(
                "{}",
                dflow_partitioner::strategy::tensor::render_data_parallel(
                    &loaded.graph,
                    &train,
                    &mesh,
                    (args.fusion_threshold_mb * (1u64 << 20) as f64) as usize,
                    args.zero_stage,
                    &args.features,
                    &args.labels,
                )?
            );
        }
    }
    Ok(())
}

fn render(p: &Partitions, format: Format) -> String {
    match format {
        Format::Text => render_text(p),
        Format::Json => render_json(p),
        Format::Dot => render_dot(p),
    }
}

fn extension(format: Format) -> &'static str {
    match format {
        Format::Text => "txt",
        Format::Json => "json",
        Format::Dot => "dot",
    }
}

/// `worker_0` for `/job:worker/replica:0/task:0/device:CPU:0`; a file-name-safe device name.
fn file_stem(d: &DeviceName) -> String {
    d.to_string()
        .trim_start_matches('/')
        .replace(['/', ':'], "_")
}

/// Runs `dflow partition`.
pub fn run(mut args: Args) -> anyhow::Result<()> {
    if let Some(mesh) = args.mesh {
        let kind = super::strategy_flags::apply_mesh(
            &mesh,
            args.strategy,
            args.zero_stage,
            &mut args.tp,
            &mut args.pipeline,
        )?;
        let cluster = ClusterSpec::from_file(&args.cluster)?;
        super::strategy_flags::check_mesh_workers(&mesh, cluster.num_tasks("worker"))?;
        return plan(&args, kind);
    }
    if let Some(kind) = args.strategy {
        return plan(&args, kind);
    }
    let graph = super::common::load_program(&args.graph)?.graph;
    let cluster = ClusterSpec::from_file(&args.cluster)?;
    let default_device = DeviceName::parse(&args.default_device).context("--default-device")?;
    let popts = PlacementOptions {
        policy: Policy::DeviceSetter {
            ps_strategy: match args.ps_strategy {
                PsStrategyArg::RoundRobin => PsStrategy::RoundRobin,
                PsStrategyArg::Greedy => PsStrategy::GreedyBytes,
            },
        },
        default_device,
        allow_soft_placement: args.soft_placement,
    };
    let placed = place(&graph, &cluster, &popts).context("placement failed")?;
    let opts = PartitionOptions {
        feeds: args.feeds,
        fetches: args.fetches,
        targets: args.targets,
    };
    let parts = partition(&placed, &opts).context("partitioning failed")?;
    match &args.out_dir {
        None => print!("{}", render(&parts, args.format)),
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let ext = extension(args.format);
            let write = |name: String, text: String| -> anyhow::Result<()> {
                let path = dir.join(name);
                std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
            };
            for (device, part) in &parts.partitions {
                let text = match args.format {
                    Format::Text => dflow_partitioner::render::render_device_text(&parts, device)
                        .unwrap_or_default(),
                    Format::Json => dflow_graph::to_json(&part.graph.to_def()),
                    Format::Dot => {
                        let single = Partitions {
                            partitions: [(device.clone(), part.clone())].into(),
                            pairs: vec![],
                            feeds: vec![],
                            fetches: vec![],
                            buffer_plan: Default::default(),
                        };
                        render_dot(&single)
                    }
                };
                write(format!("{}.{ext}", file_stem(device)), text)?;
            }
            write(format!("summary.{ext}"), render(&parts, args.format))?;
            eprintln!(
                "wrote {} device files and summary.{ext} to {}",
                parts.partitions.len(),
                dir.display()
            );
        }
    }
    Ok(())
}
