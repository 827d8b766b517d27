//! `dflow plan`: predict memory, bytes and step time of every layout of a model over N devices
//! and pick one (see docs/planner.md).

use super::common;
use anyhow::Context as _;
use dflow_graph::train::DataSpec;
use dflow_partitioner::planner::{
    self, accounting, render, runtime, timeline, ClusterProfile, Layout, ModelProfile, PlanOptions,
};
use std::path::PathBuf;

/// Arguments of `dflow plan`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model graph file (with its `train` section).
    graph: PathBuf,
    /// Devices to plan for.
    #[arg(long)]
    devices: usize,
    /// A cluster preset: this-machine (BENCHMARKS.md), a100-80g-8x, h100-80g-8x.
    #[arg(long, default_value = "this-machine", conflicts_with = "profile")]
    preset: String,
    /// A cluster profile file (JSON; see docs/planner.md) instead of a preset.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Memory per device in bytes (overrides the profile's).
    #[arg(long)]
    memory_per_device: Option<u64>,
    /// The global batch (rows per step).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Show one layout in detail (`dp=2,tp=2,pp=2[,zero=1][,m=8][,schedule=1f1b]`).
    #[arg(long)]
    layout: Option<String>,
    /// Write a simulated step of the picked (or `--layout`) layout as a Chrome trace.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Rows of the ranked table.
    #[arg(long, default_value_t = 15)]
    top: usize,
    /// The placeholder fed with features (default: the graph's data section, else `pixels`).
    #[arg(long)]
    features: Option<String>,
    /// The placeholder fed with labels (default: the graph's data section, else `labels`).
    #[arg(long)]
    labels: Option<String>,
    /// With --layout: the compute threads of each task in the executor's count of its memory.
    /// 1 (default): the order one thread runs, exact for a task pinned to one CPU; with more
    /// threads (`dflow run` uses one per CPU) the order, and the peak, vary from run to run.
    #[arg(long, value_name = "N", default_value_t = 1)]
    threads: usize,
}

/// The executor's count of memory per task, and the transport's of bytes sent per step, for
/// the job plan `dflow run` makes of `e`'s layout
/// (planner `accounting`), or why there is none.
fn executor_count(
    def: &dflow_graph::GraphDef,
    features: &str,
    labels: &str,
    e: &planner::Evaluation,
    profile: &ClusterProfile,
    threads: usize,
) -> anyhow::Result<String> {
    anyhow::ensure!(threads > 0, "--threads must be at least 1");
    let Some(train) = def.train.as_ref() else {
        return Ok(String::new());
    };
    let graph = dflow_graph::Graph::from_def(def)?;
    let batch = (e.rows * e.layout.micro_batches as f64 * e.layout.mesh.dp as f64).round() as usize;
    let counted = accounting::strategy_for(&e.layout, batch).and_then(|(kind, _)| {
        let plan = accounting::job_plan(&graph, train, features, labels, &e.layout, batch)?;
        // Each task is fed its replica's rows.
        let rows = batch / e.layout.mesh.dp;
        Ok((
            kind,
            accounting::account(&plan, rows, threads)?,
            accounting::traffic(&plan, rows)?,
            runtime::work(&plan, rows)?,
            runtime::predict(&plan, rows, e, profile)?,
        ))
    });
    Ok(match counted {
        Ok((kind, tasks, sent, work, step)) => {
            let mut text = render::accounting(&tasks, kind.name(), threads)
                + &render::traffic(&sent)
                + &render::work(&work)
                + &render::job_step(&step);
            if profile.job == planner::JobCosts::default() {
                text.push_str("    (profile `");
                text.push_str(&profile.name);
                text.push_str(
                    "` has no job costs: the step above omits dflow's per-step, per-op and per-call \
                     costs and prices compute analytically; for a step as measured on this machine \
                     run `dflow bench calibrate --out p.json` and pass `--profile p.json`)\n",
                );
            }
            text
        }
        Err(err) => format!("  as dflow runs it: not counted ({err})\n"),
    })
}

/// Runs `dflow plan`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let loaded = common::load(&args.graph)?;
    let def = &loaded.parsed.def;
    let (default_features, default_labels) = match def.train.as_ref().and_then(|t| t.data.as_ref())
    {
        Some(DataSpec::CharWindows {
            inputs, targets, ..
        }) => (inputs.clone(), targets.clone()),
        _ => ("pixels".to_string(), "labels".to_string()),
    };
    let features = args.features.unwrap_or(default_features);
    let labels = args.labels.unwrap_or(default_labels);
    let mut profile = match &args.profile {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading profile {}", path.display()))?;
            ClusterProfile::from_json(&text, &path.display().to_string())?
        }
        None => ClusterProfile::preset(&args.preset)?,
    };
    if let Some(m) = args.memory_per_device {
        anyhow::ensure!(m > 0, "--memory-per-device must be at least 1 byte");
        profile.memory_per_device = m;
    }
    let model = ModelProfile::new(def, &features, &labels)
        .with_context(|| format!("profiling {}", args.graph.display()))?;
    let options = PlanOptions {
        devices: args.devices,
        batch_size: args.batch_size,
    };
    let report = planner::plan(&model, &profile, &options)?;
    print!("{}", render::header(&report, &profile));
    println!();
    print!("{}", render::table(&report, args.top));
    println!();
    print!("{}", render::explain(&report, &profile));
    let shown = match &args.layout {
        Some(text) => {
            let layout: Layout = text.parse()?;
            Some(planner::evaluate_layout(
                &model, &profile, &options, &layout,
            )?)
        }
        None => report.best().cloned(),
    };
    if let Some(e) = &shown {
        println!();
        print!("{}", render::detail(e, &profile));
    }
    if let (Some(e), Some(_)) = (&shown, &args.layout) {
        print!(
            "{}",
            executor_count(def, &features, &labels, e, &profile, args.threads)?
        );
    }
    if let Some(path) = &args.timeline {
        let e = shown.ok_or_else(|| {
            anyhow::anyhow!("--timeline: no layout fits, so there is no step to simulate")
        })?;
        let trace = timeline::chrome_trace(&e).map_err(anyhow::Error::msg)?;
        std::fs::write(path, serde_json::to_string(&trace)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("timeline: {}", path.display());
    }
    Ok(())
}
