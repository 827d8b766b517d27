//! The chief (worker 0) of a parameter-server job: it builds the replicated training graph(s),
//! places and partitions them, registers every task's partitions once, restores the newest
//! checkpoint, drives the steps (sync: all workers in lockstep; async: each worker on its own),
//! saves checkpoints, evaluates, and ends the job.

use super::node::{JobError, Rpc};
use super::protocol::{
    BatchRef, DataSpec, FeedBinding, FeedSource, NamedTensor, PartitionDef, RecvSlot,
    RegisterGraph, Reply, Request, RunStep, SendRoute, WireTensor,
};
use crate::checkpoint;
use crate::data::Dataset;
use crate::trainer::StepReport;
use dflow_graph::train::TrainSpec;
use dflow_graph::{format::to_json, DType, DeviceName, Graph, GraphDef, Tensor};
use dflow_partitioner::allreduce::{allreduce_training, GROUP};
use dflow_partitioner::strategy::{ps_training, PsGraph, PsMode};
use dflow_partitioner::Policy;
use dflow_partitioner::{partition, place, PartitionOptions, Partitions, PlacementOptions};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// What the chief trains and how.
#[derive(Debug, Clone)]
pub struct ChiefConfig {
    /// The forward graph (with its Variables), before the training expansion.
    pub forward: GraphDef,
    /// The graph's `train` section.
    pub spec: TrainSpec,
    /// How the workers train together.
    pub strategy: Strategy,
    /// Placement policy (variables on the ps tasks).
    pub placement: PlacementOptions,
    /// The data file (sent to tasks started without `--data`).
    pub data_path: PathBuf,
    /// The whole data set, as the chief read it.
    pub data: Dataset,
    /// Held-out fraction.
    pub test_fraction: f64,
    /// Seed of the split and the shuffle.
    pub seed: u64,
    /// Placeholder fed with features.
    pub features: String,
    /// Placeholder fed with labels.
    pub labels: String,
    /// Epochs over the training split.
    pub epochs: u64,
    /// Global batch size (split over the workers in sync mode).
    pub batch_size: usize,
    /// Checkpoint directory (resume from its newest checkpoint).
    pub checkpoint_dir: Option<PathBuf>,
    /// Save every N steps (0: only at the end).
    pub save_every: u64,
    /// Checkpoints kept.
    pub keep_checkpoints: usize,
}

/// How the workers of a job train together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Variables on the ps tasks; sync (aggregated, applied once per step) or async.
    Ps(PsMode),
    /// Every worker holds the model; gradients are all-reduced in fused buckets of at most
    /// `bucket_bytes`; no ps.
    AllReduce {
        /// Fusion threshold.
        bucket_bytes: usize,
    },
}

impl Strategy {
    /// True when every step runs all workers in lockstep.
    fn lockstep(self) -> bool {
        !matches!(self, Strategy::Ps(PsMode::Async))
    }
}

/// What a finished job did.
#[derive(Debug, Clone)]
pub struct ChiefReport {
    /// Examples in the training split.
    pub train_examples: usize,
    /// Examples held out.
    pub test_examples: usize,
    /// Steps per epoch.
    pub steps_per_epoch: u64,
    /// The checkpoint step the job resumed from.
    pub resumed_from: Option<u64>,
    /// The last global step.
    pub final_step: u64,
    /// `(global step, loss)` of every step this run made, in completion order.
    pub losses: Vec<(u64, f64)>,
    /// Wall time of the steps.
    pub elapsed: Duration,
    /// Examples trained on.
    pub examples: u64,
    /// Held-out loss and metrics, `(name, value)`.
    pub held_out: Vec<(String, f64)>,
    /// Async only: mean and maximum staleness (updates by other workers between a step's read
    /// of the variables and its update).
    pub staleness: Option<(f64, u64)>,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
}

/// One step's worth of registered graphs: what to ask each task to run.
#[derive(Debug)]
struct Registered {
    /// Tasks with a partition: the graph handle to run there, and whether (and as which part
    /// of the batch) it feeds data.
    tasks: Vec<(String, u32, Option<u32>)>,
    /// The task whose reply carries the fetched values.
    fetch_task: Option<String>,
}

/// Assigns receive-slot ids and keeps them stable across signatures.
#[derive(Debug, Default)]
struct Slots {
    by_key: HashMap<String, u32>,
    next: HashMap<String, u32>,
}

impl Slots {
    fn id(&mut self, recv_task: &str, key: &str) -> u32 {
        if let Some(&id) = self.by_key.get(key) {
            return id;
        }
        let next = self.next.entry(recv_task.to_string()).or_insert(1);
        let id = *next;
        *next += 1;
        self.by_key.insert(key.to_string(), id);
        id
    }
}

fn task_of(device: &str) -> Result<String, JobError> {
    DeviceName::parse(device)
        .ok()
        .and_then(|d| d.task_name())
        .ok_or_else(|| JobError::Setup(format!("device `{device}` names no task")))
}

fn tensor_name(name: &str) -> String {
    if name.contains(':') {
        name.to_string()
    } else {
        format!("{name}:0")
    }
}

/// Turns one signature's partitions into a RegisterGraph per task.
#[allow(clippy::too_many_arguments)]
fn registrations(
    handle: u32,
    parts: &Partitions,
    slots: &mut Slots,
    feed_sources: &HashMap<String, (FeedSource, u32)>,
    data: &DataSpec,
    updates_variables: bool,
) -> Result<(BTreeMap<String, RegisterGraph>, Registered), JobError> {
    let mut regs: BTreeMap<String, RegisterGraph> = BTreeMap::new();
    let blank = || RegisterGraph {
        handle,
        partitions: vec![],
        recv_slots: vec![],
        send_routes: vec![],
        feeds: vec![],
        fetches: vec![],
        data: None,
        updates_variables,
    };
    for (device, p) in &parts.partitions {
        let task = device
            .task_name()
            .ok_or_else(|| JobError::Setup(format!("device {device} names no task")))?;
        regs.entry(task)
            .or_insert_with(blank)
            .partitions
            .push(PartitionDef {
                device: device.to_string(),
                graph_json: to_json(&p.graph.to_def()),
            });
    }
    for pair in parts.pairs.iter().filter(|p| !p.client_terminated) {
        let send_task = task_of(&pair.send_device)?;
        let recv_task = task_of(&pair.recv_device)?;
        if send_task == recv_task {
            continue;
        }
        let dims = pair.shape.as_static().ok_or_else(|| {
            JobError::Setup(format!(
                "tensor `{}` crosses from {} to {} with shape {}, which is not fully known; \
                 tensors between tasks need static shapes (their receive buffers are allocated \
                 once)",
                pair.tensor_name, pair.send_device, pair.recv_device, pair.shape
            ))
        })?;
        let slot = slots.id(&recv_task, &pair.key);
        regs.entry(recv_task.clone())
            .or_insert_with(blank)
            .recv_slots
            .push(RecvSlot {
                slot,
                peer: send_task.clone(),
                key: pair.key.to_string(),
                dtype: pair.dtype.name().to_string(),
                dims: dims.iter().map(|&d| d as u64).collect(),
            });
        regs.entry(send_task)
            .or_insert_with(blank)
            .send_routes
            .push(SendRoute {
                key: pair.key.to_string(),
                peer: recv_task,
                slot,
            });
    }
    let mut feeding: BTreeMap<String, u32> = BTreeMap::new();
    for ep in &parts.feeds {
        let task = ep
            .device
            .task_name()
            .ok_or_else(|| JobError::Setup(format!("feed {} has no task", ep.tensor)))?;
        let (source, part) = feed_sources
            .get(&tensor_name(&ep.tensor))
            .ok_or_else(|| JobError::Setup(format!("no data source for feed `{}`", ep.tensor)))?;
        feeding.insert(task.clone(), *part);
        let r = regs.entry(task).or_insert_with(blank);
        r.feeds.push(FeedBinding {
            key: ep.key.clone(),
            source: *source,
        });
        r.data = Some(data.clone());
    }
    let mut fetch_task = None;
    for ep in &parts.fetches {
        let task = ep
            .device
            .task_name()
            .ok_or_else(|| JobError::Setup(format!("fetch {} has no task", ep.tensor)))?;
        if fetch_task.as_ref().is_some_and(|t| *t != task) {
            return Err(JobError::Setup(format!(
                "the fetches of one step live on two tasks ({} and {task}); fetch them from one",
                fetch_task.unwrap_or_default()
            )));
        }
        regs.entry(task.clone())
            .or_insert_with(blank)
            .fetches
            .push(ep.key.clone());
        fetch_task = Some(task);
    }
    let tasks = regs
        .keys()
        .map(|t| (t.clone(), handle, feeding.get(t).copied()))
        .collect();
    Ok((regs, Registered { tasks, fetch_task }))
}

fn scalar(t: &WireTensor) -> f64 {
    t.to_tensor()
        .ok()
        .and_then(|t| t.to_f64_vec().first().copied())
        .unwrap_or(f64::NAN)
}

/// The chief's plan: every signature registered, the variables and where they live.
#[derive(Debug)]
struct Job {
    graphs: Vec<PsGraph>,
    train: Vec<Registered>,
    eval: Registered,
    /// Variable → every task holding a copy (one under ps, every worker under all-reduce),
    /// and the expected (name, dtype, dims) for checkpoints.
    variable_tasks: BTreeMap<String, Vec<String>>,
    /// Batch parts per lockstep step (the number of replicas).
    parts: u32,
    variable_specs: Vec<(String, DType, Vec<usize>)>,
}

struct Ids(AtomicU64);

impl Ids {
    fn next(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }
}

async fn register_all(
    rpc: &Rpc,
    cfg: &ChiefConfig,
    cluster: &dflow_graph::ClusterSpec,
    train_rows: u64,
) -> Result<Job, JobError> {
    let workers = cluster.num_tasks("worker");
    let (graphs, placement) = match cfg.strategy {
        Strategy::Ps(mode) => (
            ps_training(
                &cfg.forward,
                &cfg.spec,
                workers,
                mode,
                &cfg.features,
                &cfg.labels,
            ),
            cfg.placement.clone(),
        ),
        Strategy::AllReduce { bucket_bytes } => (
            allreduce_training(
                &cfg.forward,
                &cfg.spec,
                workers,
                &cfg.features,
                &cfg.labels,
                bucket_bytes,
            ),
            // Every node of a worker's graph stays on that worker: no device setter.
            PlacementOptions {
                policy: Policy::Explicit,
                ..cfg.placement.clone()
            },
        ),
    };
    let graphs = graphs.map_err(|e| JobError::Setup(e.to_string()))?;
    let data = DataSpec {
        path: cfg.data_path.display().to_string(),
        test_fraction: cfg.test_fraction,
        seed: cfg.seed,
        rows: train_rows,
    };
    let mut slots = Slots::default();
    let mut all: BTreeMap<String, Vec<RegisterGraph>> = BTreeMap::new();
    let mut train = Vec::new();
    let mut eval = None;
    let mut variable_tasks = BTreeMap::new();
    let mut variable_specs = Vec::new();
    for (i, g) in graphs.iter().enumerate() {
        let graph = Graph::from_def(&g.training.def)
            .map_err(|e| JobError::Setup(format!("the replicated training graph: {e}")))?;
        let placed = place(&graph, cluster, &placement)
            .map_err(|e| JobError::Setup(format!("placing the training graph: {e}")))?;
        for idx in placed.graph.node_indices() {
            let n = placed.graph.node(idx);
            if n.op_def().is_variable {
                let task = placed.devices[idx.index()].task_name().unwrap_or_default();
                let holders: &mut Vec<String> = variable_tasks.entry(n.name.clone()).or_default();
                if !holders.contains(&task) {
                    holders.push(task);
                }
                if i == 0 {
                    if let Some(dims) = n.outputs[0].shape.as_static() {
                        variable_specs.push((n.name.clone(), n.outputs[0].dtype, dims));
                    }
                }
            }
        }
        variable_specs.sort();
        let mut sources = HashMap::new();
        let mut feeds = Vec::new();
        for r in &g.replicas {
            // Async workers each take whole batches; otherwise every replica feeds its part.
            let part = if cfg.strategy.lockstep() {
                r.worker as u32
            } else {
                0
            };
            sources.insert(tensor_name(&r.features), (FeedSource::Features, part));
            sources.insert(tensor_name(&r.labels), (FeedSource::Labels, part));
            feeds.push(r.features.clone());
            feeds.push(r.labels.clone());
            if let Some(w) = &r.weight {
                sources.insert(tensor_name(w), (FeedSource::BatchWeight, part));
                feeds.push(w.clone());
            }
        }
        let opts = PartitionOptions {
            feeds: feeds.iter().map(|f| tensor_name(f)).collect(),
            fetches: vec![tensor_name(&g.training.loss)],
            targets: vec![g.training.train_op.clone()],
        };
        let parts = partition(&placed, &opts)
            .map_err(|e| JobError::Setup(format!("partitioning the training graph: {e}")))?;
        let handle = (2 * i + 1) as u32;
        let (regs, registered) = registrations(handle, &parts, &mut slots, &sources, &data, true)?;
        for (task, r) in regs {
            all.entry(task).or_default().push(r);
        }
        train.push(registered);
        if i == 0 {
            let mut sources = HashMap::new();
            sources.insert(tensor_name(&g.eval.features), (FeedSource::Features, 0));
            sources.insert(tensor_name(&g.eval.labels), (FeedSource::Labels, 0));
            let mut fetches = vec![tensor_name(&g.eval.loss)];
            fetches.extend(g.eval.metrics.iter().map(|m| tensor_name(m)));
            let opts = PartitionOptions {
                feeds: vec![tensor_name(&g.eval.features), tensor_name(&g.eval.labels)],
                fetches,
                targets: vec![],
            };
            let parts = partition(&placed, &opts)
                .map_err(|e| JobError::Setup(format!("partitioning the evaluation graph: {e}")))?;
            let (regs, registered) =
                registrations(handle + 1, &parts, &mut slots, &sources, &data, false)?;
            if registered.fetch_task.as_deref() != Some(rpc.task.as_str()) {
                return Err(JobError::Setup(format!(
                    "evaluation fetches live on {:?}, not on the chief",
                    registered.fetch_task
                )));
            }
            for (task, r) in regs {
                all.entry(task).or_default().push(r);
            }
            eval = Some(registered);
        }
    }
    let eval = eval.ok_or_else(|| JobError::Setup("no training graph was built".into()))?;
    let parts = graphs.iter().map(|g| g.replicas.len() as u32).sum();
    // Under all-reduce the workers' graphs run together: one step runs each on its worker.
    if let Strategy::AllReduce { .. } = cfg.strategy {
        let fetch_task = Some(rpc.task.clone());
        let tasks = train.drain(..).flat_map(|r| r.tasks).collect();
        train.push(Registered { tasks, fetch_task });
    }
    // Register every task's graphs, all tasks at once.
    let mut set = tokio::task::JoinSet::new();
    for (task, regs) in all {
        let rpc = rpc.clone();
        set.spawn(async move {
            for r in regs {
                let what = format!("RegisterGraph {}", r.handle);
                rpc.call(&task, Request::RegisterGraph(r), &what).await?;
            }
            Ok::<(), JobError>(())
        });
    }
    while let Some(r) = set.join_next().await {
        r.map_err(|e| JobError::Setup(format!("registration task failed: {e}")))??;
    }
    if let Strategy::AllReduce { .. } = cfg.strategy {
        join_group(rpc, cluster).await?;
    }
    Ok(Job {
        graphs,
        train,
        eval,
        variable_tasks,
        parts,
        variable_specs,
    })
}

/// Makes every worker join collective group [`GROUP`] (rank = worker index).
async fn join_group(rpc: &Rpc, cluster: &dflow_graph::ClusterSpec) -> Result<(), JobError> {
    let workers: Vec<String> = cluster
        .tasks("worker")
        .map(|(i, _)| super::node::task_name("worker", i))
        .collect();
    let mut addrs = Vec::with_capacity(workers.len());
    for w in &workers {
        let what = format!("PrepareGroup `{GROUP}`");
        let req = Request::PrepareGroup {
            group: GROUP.to_string(),
        };
        match rpc.call(w, req, &what).await? {
            Reply::GroupAddress(a) => addrs.push(a),
            other => {
                return Err(JobError::Setup(format!(
                    "unexpected reply to PrepareGroup from {w}: {other:?}"
                )))
            }
        }
    }
    let mut set = tokio::task::JoinSet::new();
    for (rank, w) in workers.iter().enumerate() {
        let (rpc, w, addrs) = (rpc.clone(), w.clone(), addrs.clone());
        set.spawn(async move {
            let req = Request::JoinGroup {
                group: GROUP.to_string(),
                rank: rank as u32,
                addrs,
            };
            rpc.call(&w, req, &format!("JoinGroup `{GROUP}` as rank {rank}"))
                .await
        });
    }
    while let Some(r) = set.join_next().await {
        r.map_err(|e| JobError::Setup(format!("join task failed: {e}")))??;
    }
    Ok(())
}

/// Runs one step of `reg` on every task of it; returns the fetch task's reply values and the
/// largest concurrent-update count any task reported.
async fn run_step(
    rpc: &Rpc,
    reg: &Registered,
    step: u64,
    batch: Option<(u64, u64, u64, u32)>,
) -> Result<(Vec<WireTensor>, u64), JobError> {
    let mut set = tokio::task::JoinSet::new();
    for (task, handle, part) in &reg.tasks {
        let rpc = rpc.clone();
        let task = task.clone();
        let run = RunStep {
            handle: *handle,
            step,
            batch: part.and_then(|part| {
                batch.map(|(epoch, index, batch_size, parts)| BatchRef {
                    epoch,
                    index,
                    batch_size,
                    part,
                    parts,
                })
            }),
        };
        set.spawn(async move {
            let what = format!("RunStep (step {step})");
            let reply = rpc.call(&task, Request::RunStep(run), &what).await;
            (task, reply)
        });
    }
    let mut fetched = Vec::new();
    let mut concurrent = 0;
    let mut first_error: Option<JobError> = None;
    while let Some(joined) = set.join_next().await {
        let (task, reply) =
            joined.map_err(|e| JobError::Setup(format!("step task failed: {e}")))?;
        match reply {
            Ok(Reply::StepDone(done)) => {
                concurrent = concurrent.max(done.concurrent_updates);
                if reg.fetch_task.as_deref() == Some(task.as_str()) {
                    fetched = done.fetched;
                }
            }
            Ok(other) => {
                first_error.get_or_insert(JobError::Setup(format!(
                    "unexpected reply to RunStep from {task}: {other:?}"
                )));
            }
            Err(e) => {
                if first_error.is_none() {
                    rpc.abort_step(step, &e.to_string());
                }
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        // A dead task explains every other failure of the step.
        Some(e) => Err(rpc.failure().unwrap_or(e)),
        None => Ok((fetched, concurrent)),
    }
}

async fn save(
    rpc: &Rpc,
    job: &Job,
    cfg: &ChiefConfig,
    step: u64,
) -> Result<Option<PathBuf>, JobError> {
    let Some(dir) = &cfg.checkpoint_dir else {
        return Ok(None);
    };
    // One copy of each variable: its first holder's.
    let tasks: BTreeSet<&String> = job
        .variable_tasks
        .values()
        .filter_map(|holders| holders.first())
        .collect();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for task in tasks {
        match rpc
            .call(task, Request::GetVariables, "GetVariables")
            .await?
        {
            Reply::Variables(vars) => {
                for v in vars {
                    let t = v.value.to_tensor().map_err(|e| {
                        JobError::Setup(format!("variable `{}` from {task}: {e}", v.name))
                    })?;
                    tensors.push((v.name, t));
                }
            }
            other => {
                return Err(JobError::Setup(format!(
                    "unexpected reply to GetVariables from {task}: {other:?}"
                )))
            }
        }
    }
    let path = checkpoint::save(dir, step, &tensors, &BTreeMap::new())
        .map_err(|e| JobError::Setup(e.to_string()))?;
    if cfg.keep_checkpoints > 0 {
        checkpoint::keep_last(dir, cfg.keep_checkpoints)
            .map_err(|e| JobError::Setup(e.to_string()))?;
    }
    Ok(Some(path))
}

async fn restore(rpc: &Rpc, job: &Job, cfg: &ChiefConfig) -> Result<Option<u64>, JobError> {
    let Some(dir) = &cfg.checkpoint_dir else {
        return Ok(None);
    };
    let setup = |e: checkpoint::CheckpointError| JobError::Setup(e.to_string());
    let Some(path) = checkpoint::latest(dir).map_err(setup)? else {
        return Ok(None);
    };
    let ckpt = checkpoint::load(&path).map_err(setup)?;
    let values = checkpoint::restore_into(&job.variable_specs, &ckpt).map_err(setup)?;
    let mut by_task: BTreeMap<String, Vec<NamedTensor>> = BTreeMap::new();
    for (name, value) in values {
        for task in job.variable_tasks.get(&name).into_iter().flatten() {
            by_task.entry(task.clone()).or_default().push(NamedTensor {
                name: name.clone(),
                value: WireTensor::from_tensor(&value),
            });
        }
    }
    for (task, values) in by_task {
        rpc.call(
            &task,
            Request::SetVariables(values),
            "SetVariables (restoring a checkpoint)",
        )
        .await?;
    }
    Ok(Some(ckpt.step))
}

async fn evaluate(
    rpc: &Rpc,
    job: &Job,
    cfg: &ChiefConfig,
    test: &Dataset,
    ids: &Ids,
) -> Result<Vec<(String, f64)>, JobError> {
    let g = &job.graphs[0];
    let mut names = vec![g.training.loss.clone()];
    names.extend(g.training.metrics.iter().cloned());
    let mut sums = vec![0.0; names.len()];
    let mut count = 0usize;
    let batches = test
        .batches(cfg.batch_size.max(1), None, 0, false)
        .map_err(|e| JobError::Setup(e.to_string()))?;
    for batch in batches {
        let (x, y) = batch.map_err(|e| JobError::Setup(e.to_string()))?;
        let n = y.num_elements();
        let step = ids.next();
        // Remote tasks (the ps) run their part; the chief feeds its own.
        let mut set = tokio::task::JoinSet::new();
        for (task, handle, _) in job.eval.tasks.iter().filter(|(t, _, _)| *t != rpc.task) {
            let rpc = rpc.clone();
            let task = task.clone();
            let run = RunStep {
                handle: *handle,
                step,
                batch: None,
            };
            set.spawn(async move {
                rpc.call(
                    &task,
                    Request::RunStep(run),
                    &format!("RunStep (evaluation step {step})"),
                )
                .await
            });
        }
        let server = rpc.server.clone();
        let handle = job
            .eval
            .tasks
            .iter()
            .find(|(t, _, _)| *t == rpc.task)
            .map(|(_, h, _)| *h)
            .ok_or_else(|| JobError::Setup("the chief has no evaluation graph".into()))?;
        let local = tokio::task::spawn_blocking(move || {
            server.run_with_sources(handle, step, |s| match s {
                FeedSource::Features => x.clone(),
                FeedSource::Labels => y.clone(),
                FeedSource::BatchWeight => Tensor::scalar(1.0f32),
            })
        })
        .await
        .map_err(|e| JobError::Setup(format!("evaluation step failed: {e}")))?;
        let mut remote_error = None;
        while let Some(r) = set.join_next().await {
            if let Ok(Err(e)) = r {
                remote_error.get_or_insert(e);
            }
        }
        if let Some(e) = remote_error {
            return Err(rpc.failure().unwrap_or(e));
        }
        let (fetched, _) = local.map_err(|e| rpc.failure().unwrap_or(JobError::Exec(e)))?;
        for (sum, t) in sums.iter_mut().zip(&fetched) {
            *sum += t.to_f64_vec().first().copied().unwrap_or(f64::NAN) * n as f64;
        }
        count += n;
    }
    // Report under the user's names (`loss`, `accuracy`), not the replica's.
    let mut user_names = vec![cfg.spec.loss.clone()];
    user_names.extend(cfg.spec.metrics.iter().cloned());
    Ok(user_names
        .into_iter()
        .zip(sums)
        .map(|(name, s)| (name, s / count.max(1) as f64))
        .collect())
}

/// Trains as `cfg` says over the tasks reachable through `rpc`, calling `on_step` after every
/// step; evaluates on the held-out split and saves the final checkpoint. Does not shut the job
/// down: the caller tells the tasks how it ended.
pub async fn run_chief(
    rpc: &Rpc,
    cluster: &dflow_graph::ClusterSpec,
    cfg: &ChiefConfig,
    mut on_step: impl FnMut(&StepReport),
) -> Result<ChiefReport, JobError> {
    if cfg.batch_size == 0 {
        return Err(JobError::Setup("batch size must be at least 1".into()));
    }
    let (train, test) = cfg
        .data
        .split(cfg.test_fraction, cfg.seed)
        .map_err(|e| JobError::Setup(e.to_string()))?;
    if train.is_empty() {
        return Err(JobError::Setup("the training split is empty".into()));
    }
    let job = register_all(rpc, cfg, cluster, cfg.data.len() as u64).await?;
    let resumed_from = restore(rpc, &job, cfg).await?;
    let spe = train.num_batches(cfg.batch_size, false) as u64;
    let total = spe * cfg.epochs;
    let start_step = resumed_from.unwrap_or(0).min(total);
    let ids = Arc::new(Ids(AtomicU64::new(1)));
    let mut losses = Vec::new();
    let mut examples = 0u64;
    let mut last_ckpt = None;
    let mut staleness: Option<(u64, u64, u64)> = None; // (sum, max, count)
    let started = Instant::now();
    let batch_rows = |index: u64| -> usize {
        let start = index as usize * cfg.batch_size;
        train.len().saturating_sub(start).min(cfg.batch_size)
    };
    match cfg.strategy {
        Strategy::Ps(PsMode::Sync) | Strategy::AllReduce { .. } => {
            let parts = job.parts;
            for s in start_step..total {
                let (epoch, index) = (s / spe, s % spe);
                let step = ids.next();
                let batch = Some((epoch, index, cfg.batch_size as u64, parts));
                let (fetched, _) = run_step(rpc, &job.train[0], step, batch).await?;
                let loss = fetched.first().map(scalar).unwrap_or(f64::NAN);
                let n = batch_rows(index);
                examples += n as u64;
                losses.push((s + 1, loss));
                on_step(&StepReport {
                    step: s + 1,
                    total_steps: total,
                    epoch,
                    loss,
                    examples: n,
                });
                if cfg.save_every > 0 && (s + 1) % cfg.save_every == 0 {
                    last_ckpt = save(rpc, &job, cfg, s + 1).await?;
                }
            }
        }
        Strategy::Ps(PsMode::Async) => {
            // Each worker takes the next global batch when it is free: per-worker data
            // sharding with no straggler waiting for another.
            let next = Arc::new(AtomicU64::new(start_step));
            let (tx, mut rx) = mpsc::unbounded_channel();
            let job = Arc::new(job);
            let mut loops = tokio::task::JoinSet::new();
            for w in 0..job.train.len() {
                let (rpc, job, next, ids, tx) = (
                    rpc.clone(),
                    job.clone(),
                    next.clone(),
                    ids.clone(),
                    tx.clone(),
                );
                let bs = cfg.batch_size as u64;
                loops.spawn(async move {
                    loop {
                        let s = next.fetch_add(1, Ordering::SeqCst);
                        if s >= total {
                            return Ok::<(), JobError>(());
                        }
                        let (epoch, index) = (s / spe, s % spe);
                        let step = ids.next();
                        let (fetched, stale) =
                            run_step(&rpc, &job.train[w], step, Some((epoch, index, bs, 1)))
                                .await?;
                        let loss = fetched.first().map(scalar).unwrap_or(f64::NAN);
                        let _ = tx.send((epoch, index, loss, stale));
                    }
                });
            }
            drop(tx);
            let mut done = start_step;
            let mut failure = None;
            loop {
                tokio::select! {
                    Some((epoch, index, loss, stale)) = rx.recv() => {
                        done += 1;
                        let n = batch_rows(index);
                        examples += n as u64;
                        losses.push((done, loss));
                        let st = staleness.get_or_insert((0, 0, 0));
                        st.0 += stale;
                        st.1 = st.1.max(stale);
                        st.2 += 1;
                        on_step(&StepReport { step: done, total_steps: total, epoch, loss, examples: n });
                        if cfg.save_every > 0 && done % cfg.save_every == 0 {
                            last_ckpt = save(rpc, &job, cfg, done).await?;
                        }
                    }
                    joined = loops.join_next() => match joined {
                        Some(Ok(Ok(()))) => {}
                        Some(Ok(Err(e))) => { failure.get_or_insert(e); loops.abort_all(); }
                        Some(Err(e)) if e.is_cancelled() => {}
                        Some(Err(e)) => { failure.get_or_insert(JobError::Setup(format!("worker loop failed: {e}"))); }
                        None => {
                            // Every loop ended; drain the last reports.
                            while let Ok((epoch, index, loss, stale)) = rx.try_recv() {
                                done += 1;
                                let n = batch_rows(index);
                                examples += n as u64;
                                losses.push((done, loss));
                                let st = staleness.get_or_insert((0, 0, 0));
                                st.0 += stale;
                                st.1 = st.1.max(stale);
                                st.2 += 1;
                                on_step(&StepReport { step: done, total_steps: total, epoch, loss, examples: n });
                            }
                            break;
                        }
                    },
                }
            }
            if let Some(e) = failure {
                return Err(rpc.failure().unwrap_or(e));
            }
            let job = Arc::try_unwrap(job)
                .map_err(|_| JobError::Setup("worker loops still hold the job".into()))?;
            return finish(
                rpc,
                job,
                cfg,
                &train,
                &test,
                &ids,
                FinishState {
                    resumed_from,
                    final_step: done,
                    losses,
                    elapsed: started.elapsed(),
                    examples,
                    staleness,
                    last_ckpt,
                    spe,
                },
            )
            .await;
        }
    }
    finish(
        rpc,
        job,
        cfg,
        &train,
        &test,
        &ids,
        FinishState {
            resumed_from,
            final_step: total.max(start_step),
            losses,
            elapsed: started.elapsed(),
            examples,
            staleness,
            last_ckpt,
            spe,
        },
    )
    .await
}

struct FinishState {
    resumed_from: Option<u64>,
    final_step: u64,
    losses: Vec<(u64, f64)>,
    elapsed: Duration,
    examples: u64,
    staleness: Option<(u64, u64, u64)>,
    last_ckpt: Option<PathBuf>,
    spe: u64,
}

async fn finish(
    rpc: &Rpc,
    job: Job,
    cfg: &ChiefConfig,
    train: &Dataset,
    test: &Dataset,
    ids: &Ids,
    st: FinishState,
) -> Result<ChiefReport, JobError> {
    let mut last_ckpt = st.last_ckpt;
    let saved_at_end =
        cfg.save_every > 0 && st.final_step % cfg.save_every == 0 && last_ckpt.is_some();
    if !saved_at_end {
        if let Some(p) = save(rpc, &job, cfg, st.final_step).await? {
            last_ckpt = Some(p);
        }
    }
    let held_out = if test.is_empty() {
        Vec::new()
    } else {
        evaluate(rpc, &job, cfg, test, ids).await?
    };
    Ok(ChiefReport {
        train_examples: train.len(),
        test_examples: test.len(),
        steps_per_epoch: st.spe,
        resumed_from: st.resumed_from,
        final_step: st.final_step,
        losses: st.losses,
        elapsed: st.elapsed,
        examples: st.examples,
        held_out,
        staleness: st
            .staleness
            .map(|(sum, max, n)| (sum as f64 / n.max(1) as f64, max)),
        checkpoint: last_ckpt,
    })
}
