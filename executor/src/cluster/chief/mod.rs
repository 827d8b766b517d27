//! The chief (worker 0) of a distributed training job: its strategy plans the job (a
//! [`JobPlan`]: partitions, feeds, collective groups, the global buffer plan), it registers
//! every task's partitions and exactly the plan's slots once, restores the newest checkpoint,
//! drives the steps (lockstep or each worker on its own, as the plan's [`Schedule`] says),
//! saves checkpoints, evaluates, and ends the job.
//!
//! Both schedules run through the step driver of `dflow run --local`
//! ([`run_steps`](crate::trainer::run_steps)): the chief is a
//! [`StepRunner`](crate::trainer::StepRunner) whose step `k` is, in lockstep, a RunStep on
//! every task (`Lockstep` here, `elastic.rs` for membership changes), and on the independent
//! schedule the `k`-th step any worker lane finishes (`independent.rs`). `source.rs` is the
//! chief's view of the data (CSV table or text windows: steps, batches, held-out batches).

mod elastic;
mod independent;
mod source;
mod staleness;

use super::node::{JobError, Rpc};
use super::protocol::{
    BatchRef, DataSpec, FeedBinding, FeedSource, NamedTensor, PartitionDef, RecvSlot,
    RegisterGraph, Reply, Request, RunStep, SendRoute, WireTensor,
};
use crate::checkpoint;
use crate::data::text::CharCorpus;
use crate::data::Dataset;
use crate::trainer::{initial_values, StepReport, StepRunner, TrainConfig, TrainError};
use dflow_graph::train::TrainSpec;
use dflow_graph::{format::to_json, ClusterSpec, DType, Graph, RendezvousKey, Tensor};
use dflow_partitioner::job::{CollectiveGroup, FeedRole};
use dflow_partitioner::{JobInput, JobPlan, PlacementOptions, Schedule, SignatureKind, Strategy};
use independent::independent;
use source::Source;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What the chief trains and how.
#[derive(Debug, Clone)]
pub struct ChiefConfig {
    /// The forward graph (with its Variables), validated, before the training expansion.
    pub forward: Graph,
    /// The graph's `train` section.
    pub spec: TrainSpec,
    /// How the workers train together: it plans the job (see [`JobPlan`]).
    pub strategy: Arc<dyn Strategy>,
    /// Placement options (strategies may override the policy).
    pub placement: PlacementOptions,
    /// The data file (sent to tasks started without `--data`).
    pub data_path: PathBuf,
    /// The data, as the chief read it, and how the run goes through it.
    pub data: ChiefData,
    /// Seed of the split and the shuffle (CSV) or of the windows (text).
    pub seed: u64,
    /// Placeholder fed with features (a text's inputs).
    pub features: String,
    /// Placeholder fed with labels (a text's targets).
    pub labels: String,
    /// Global batch size (split over the workers in sync mode).
    pub batch_size: usize,
    /// Checkpoint directory (resume from its newest checkpoint).
    pub checkpoint_dir: Option<PathBuf>,
    /// Save every N steps (0: only at the end).
    pub save_every: u64,
    /// Checkpoints kept.
    pub keep_checkpoints: usize,
    /// Extra metadata written into every checkpoint (a text's vocabulary).
    pub checkpoint_metadata: BTreeMap<String, String>,
    /// Evaluate every N steps (0: only at the end), reported in [`StepReport::eval`].
    pub eval_every: u64,
    /// Variables to load before the first step (`--init-from`), unless the job resumes from a
    /// checkpoint.
    pub init_from: Option<InitFrom>,
    /// Elastic job (`--min-workers K`, lockstep plans with [`ChiefConfig::checkpoint_dir`]):
    /// when a worker other than the chief dies and at least K workers remain, re-plan the job
    /// on the survivors, restore the newest checkpoint (the variables as they were before the
    /// first step when there is none yet) and go on; fewer than K survivors end the job. A
    /// worker of the cluster that is not in the job and says it is ready (a replacement) is
    /// taken in before the next step, from a checkpoint of the step before it.
    pub min_workers: Option<usize>,
    /// Bounded staleness (`--staleness S`, independent plans only): a worker may be at most
    /// `S` completed steps ahead of the slowest (see [`staleness`]); `None`: unbounded.
    pub staleness: Option<u64>,
}

/// Trainable variables a job loads from a safetensors file before its first step, as
/// [`load_variables`](crate::trainer::load_variables) loads them into a local session.
#[derive(Debug, Clone)]
pub struct InitFrom {
    /// The safetensors file.
    pub path: PathBuf,
    /// The variables to load (the trainable ones; optimizer slots keep their initial values).
    pub variables: Vec<String>,
    /// `(variable, other name)` pairs the file may store a tied tensor under.
    pub aliases: Vec<(String, String)>,
}

/// The data a distributed job trains on, as the chief holds it.
#[derive(Debug, Clone)]
pub enum ChiefData {
    /// A CSV table: `epochs` epochs over its training split; the held-out rows are evaluated
    /// at the end.
    Csv {
        /// The whole table.
        data: Dataset,
        /// Held-out fraction.
        test_fraction: f64,
        /// Epochs over the training split.
        epochs: u64,
    },
    /// A text in random character windows (`train.data` `char_windows`), as `dflow run
    /// --local` trains on it: `steps` steps of `batch_size` windows drawn from the seed, the
    /// validation loss the mean over `eval_batches` batches of validation windows.
    Text {
        /// The encoded text and its split.
        corpus: CharCorpus,
        /// Tokens per window.
        block_size: usize,
        /// The held-out fraction the corpus was split with.
        val_fraction: f64,
        /// Training steps of the whole run.
        steps: u64,
        /// Batches each validation loss averages.
        eval_batches: u64,
    },
}

impl ChiefData {
    /// Whether the job evaluates at all: a text job with `eval_batches` 0 does not.
    pub fn evaluates(&self) -> bool {
        !matches!(
            self,
            ChiefData::Text {
                eval_batches: 0,
                ..
            }
        )
    }
}

/// What a finished job did.
#[derive(Debug, Clone)]
pub struct ChiefReport {
    /// Examples in the training split (characters, for a text).
    pub train_examples: usize,
    /// Examples held out (characters, for a text).
    pub test_examples: usize,
    /// Steps per epoch (a text's run is one epoch).
    pub steps_per_epoch: u64,
    /// The checkpoint step the job resumed from.
    pub resumed_from: Option<u64>,
    /// The last global step.
    pub final_step: u64,
    /// `(global step, loss)` of every step this run made, in completion order.
    pub losses: Vec<(u64, f64)>,
    /// Wall time of the steps.
    pub elapsed: Duration,
    /// Examples trained on (windows, for a text).
    pub examples: u64,
    /// Held-out loss and metrics, `(name, value)` (a text's validation loss); empty when
    /// nothing is held out.
    pub held_out: Vec<(String, f64)>,
    /// Async only: mean and maximum staleness (updates by other workers between a step's read
    /// of the variables and its update).
    pub staleness: Option<(f64, u64)>,
    /// The last checkpoint written.
    pub checkpoint: Option<PathBuf>,
    /// Variables loaded from [`ChiefConfig::init_from`], if it was used.
    pub initialized: Option<usize>,
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

fn setup(e: impl std::fmt::Display) -> JobError {
    JobError::Setup(e.to_string())
}

fn feed_source(role: FeedRole) -> FeedSource {
    match role {
        FeedRole::Features => FeedSource::Features,
        FeedRole::Labels => FeedSource::Labels,
        FeedRole::BatchWeight => FeedSource::BatchWeight,
    }
}

/// What the chief asks each task to register for `plan`: per task, one [`RegisterGraph`] per
/// signature it has a partition of, in handle order. Receive slots and send routes are the
/// plan's ([`JobPlan::recv_slots`], [`JobPlan::send_routes`]): a signature lists the slots of
/// the cross-task pairs it uses, with the plan's global ids and byte sizes.
pub fn task_registrations(
    plan: &JobPlan,
    data: &DataSpec,
) -> Result<BTreeMap<String, Vec<RegisterGraph>>, JobError> {
    Ok(registrations(plan, data, &mut SlotIds::default(), true)?.0)
}

/// The receive-slot ids the chief gives the tasks across an elastic job's plans. The tasks keep
/// their receive slots and send routes registered across a Reset (the data plane cannot drop
/// them), so a key keeps the id its first plan gave it, and a key new in a later plan (a
/// replica on another worker) gets an id no plan used. The first plan's ids are its own.
#[derive(Debug, Default)]
pub(crate) struct SlotIds {
    ids: BTreeMap<RendezvousKey, u32>,
    next: u32,
}

impl SlotIds {
    /// Gives every slot of `plan` its id (see the type's docs).
    fn learn(&mut self, plan: &JobPlan) -> Result<(), JobError> {
        let first = self.ids.is_empty();
        let mut slots: Vec<&dflow_partitioner::SlotPlan> = plan.buffer_plan.slots.iter().collect();
        slots.sort_by_key(|s| s.slot);
        for s in slots {
            if self.ids.contains_key(&s.key) {
                continue;
            }
            let id = if first {
                u32::try_from(s.slot).map_err(setup)?
            } else {
                self.next
            };
            self.next = id
                .checked_add(1)
                .ok_or_else(|| setup("the job's plans used up the 32-bit receive-slot ids"))?;
            self.ids.insert(s.key.clone(), id);
        }
        Ok(())
    }

    /// The id of `key`'s slot ([`SlotIds::learn`] saw its plan).
    fn id(&self, key: &RendezvousKey) -> Result<u32, JobError> {
        self.ids
            .get(key)
            .copied()
            .ok_or_else(|| setup(format!("pair {key}: the chief gave its slot no id")))
    }
}

type Registrations = (
    BTreeMap<String, Vec<RegisterGraph>>,
    Vec<Registered>,
    Registered,
);

/// Every task's registrations of `plan`'s signatures, and the chief's view of them. Without
/// `register_eval` (a job that never evaluates, `--eval-batches 0`) no task registers the
/// evaluation signature: under ZeRO-3 and tensor parallelism worker 0's evaluation graph joins
/// every worker's shards, and its receive slots alone (allocated at registration) would hold a
/// whole copy of the parameters.
fn registrations(
    plan: &JobPlan,
    data: &DataSpec,
    ids: &mut SlotIds,
    register_eval: bool,
) -> Result<Registrations, JobError> {
    ids.learn(plan)?;
    let mut all: BTreeMap<String, Vec<RegisterGraph>> = BTreeMap::new();
    let mut train = Vec::new();
    let mut eval = None;
    for s in &plan.signatures {
        let mut regs: BTreeMap<String, RegisterGraph> = BTreeMap::new();
        let blank = || RegisterGraph {
            handle: s.handle,
            partitions: vec![],
            recv_slots: vec![],
            send_routes: vec![],
            feeds: vec![],
            fetches: vec![],
            data: None,
            updates_variables: s.kind == SignatureKind::Train,
        };
        for (device, p) in &s.partitions.partitions {
            let task = device
                .task_name()
                .ok_or_else(|| setup(format!("device {device} names no task")))?;
            regs.entry(task)
                .or_insert_with(blank)
                .partitions
                .push(PartitionDef {
                    device: device.to_string(),
                    graph_json: to_json(&p.graph.to_def()),
                });
        }
        let keys: BTreeSet<&RendezvousKey> = s.partitions.pairs.iter().map(|p| &p.key).collect();
        for (task, reg) in regs.iter_mut() {
            for ts in plan.recv_slots(task) {
                if !keys.contains(&ts.slot.key) {
                    continue;
                }
                let slot = ids.id(&ts.slot.key)?;
                let dims = ts.slot.shape.as_static().ok_or_else(|| {
                    setup(format!(
                        "pair {}: the plan's slot has no static shape",
                        ts.slot.key
                    ))
                })?;
                reg.recv_slots.push(RecvSlot {
                    slot,
                    peer: ts.peer.to_string(),
                    key: ts.slot.key.clone(),
                    dtype: ts.slot.dtype.name().to_string(),
                    dims: dims.iter().map(|&d| d as u64).collect(),
                    bytes: ts.slot.bytes as u64,
                });
            }
            for ts in plan.send_routes(task) {
                if keys.contains(&ts.slot.key) {
                    reg.send_routes.push(SendRoute {
                        key: ts.slot.key.clone(),
                        peer: ts.peer.to_string(),
                        slot: ids.id(&ts.slot.key)?,
                    });
                }
            }
        }
        let mut feeding: BTreeMap<String, u32> = BTreeMap::new();
        for f in &s.feeds {
            feeding.insert(f.task.clone(), f.part);
            let r = regs.entry(f.task.clone()).or_insert_with(blank);
            r.feeds.push(FeedBinding {
                key: f.key.clone(),
                source: feed_source(f.role),
            });
            r.data = Some(data.clone());
        }
        for ep in &s.partitions.fetches {
            let task = ep
                .device
                .task_name()
                .ok_or_else(|| setup(format!("fetch {} has no task", ep.tensor)))?;
            regs.entry(task)
                .or_insert_with(blank)
                .fetches
                .push(ep.key.clone());
        }
        let registered = Registered {
            tasks: regs
                .keys()
                .map(|t| (t.clone(), s.handle, feeding.get(t).copied()))
                .collect(),
            fetch_task: s.fetch_task.clone(),
        };
        if s.kind == SignatureKind::Train || register_eval {
            for (task, r) in regs {
                all.entry(task).or_default().push(r);
            }
        }
        match s.kind {
            SignatureKind::Train => train.push(registered),
            SignatureKind::Eval => eval = Some(registered),
        }
    }
    let eval = eval.ok_or_else(|| setup("the plan has no evaluation signature"))?;
    Ok((all, train, eval))
}

fn scalar(t: &WireTensor) -> f64 {
    t.to_tensor()
        .ok()
        .and_then(|t| t.to_f64_vec().first().copied())
        .unwrap_or(f64::NAN)
}

/// The chief's job: the plan, every signature registered, the variables and where they live.
#[derive(Debug)]
struct Job {
    plan: JobPlan,
    train: Vec<Registered>,
    eval: Registered,
    /// Variable → every task holding a copy (one under ps, every worker under all-reduce).
    variable_tasks: BTreeMap<String, Vec<String>>,
    /// The expected (name, dtype, dims) of the variables, for checkpoints.
    variable_specs: Vec<(String, DType, Vec<usize>)>,
}

struct Ids(AtomicU64);

impl Ids {
    fn next(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed)
    }
}

/// Plans the job with the configured strategy (see [`JobPlan`]).
pub fn plan_job(cfg: &ChiefConfig, cluster: &ClusterSpec) -> Result<JobPlan, JobError> {
    let input = JobInput {
        graph: &cfg.forward,
        train: &cfg.spec,
        cluster,
        features: &cfg.features,
        labels: &cfg.labels,
        placement: &cfg.placement,
    };
    cfg.strategy.plan(&input).map_err(setup)
}

async fn register_all(
    rpc: &Rpc,
    cfg: &ChiefConfig,
    cluster: &ClusterSpec,
    data: &DataSpec,
    ids: &mut SlotIds,
) -> Result<Job, JobError> {
    let plan = plan_job(cfg, cluster)?;
    let (all, mut train, eval) = registrations(&plan, data, ids, cfg.data.evaluates())?;
    if eval.fetch_task.as_deref() != Some(rpc.task.as_str()) {
        return Err(setup(format!(
            "evaluation fetches live on {:?}, not on the chief",
            eval.fetch_task
        )));
    }
    // A lockstep step runs every training signature together (all-reduce: one per worker).
    if plan.schedule == Schedule::Lockstep && train.len() > 1 {
        // Every signature fetches the global loss (all-reduced); take the first's task (the
        // chief under all-reduce, replica 0's last stage under a data-parallel pipeline).
        let fetch_task = train[0].fetch_task.clone();
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
        r.map_err(|e| setup(format!("registration task failed: {e}")))??;
    }
    for g in &plan.groups {
        join_group(rpc, g).await?;
    }
    let variable_tasks = plan
        .variables
        .iter()
        .map(|v| (v.name.clone(), v.holders.clone()))
        .collect();
    let variable_specs = plan
        .variables
        .iter()
        .map(|v| (v.name.clone(), v.dtype, v.dims.clone()))
        .collect();
    Ok(Job {
        plan,
        train,
        eval,
        variable_tasks,
        variable_specs,
    })
}

/// Makes every member of collective group `g` join it (rank = position in `g.members`).
async fn join_group(rpc: &Rpc, g: &CollectiveGroup) -> Result<(), JobError> {
    let group = &g.key;
    let mut addrs = Vec::with_capacity(g.members.len());
    for w in &g.members {
        let what = format!("PrepareGroup `{group}`");
        let req = Request::PrepareGroup {
            group: group.clone(),
        };
        match rpc.call(w, req, &what).await? {
            Reply::GroupAddress(a) => addrs.push(a),
            other => {
                return Err(setup(format!(
                    "unexpected reply to PrepareGroup from {w}: {other:?}"
                )))
            }
        }
    }
    let mut set = tokio::task::JoinSet::new();
    for (rank, w) in g.members.iter().enumerate() {
        let (rpc, w, addrs, group) = (rpc.clone(), w.clone(), addrs.clone(), group.clone());
        set.spawn(async move {
            let what = format!("JoinGroup `{group}` as rank {rank}");
            let req = Request::JoinGroup {
                group,
                rank: rank as u32,
                addrs,
            };
            rpc.call(&w, req, &what).await
        });
    }
    while let Some(r) = set.join_next().await {
        r.map_err(|e| setup(format!("join task failed: {e}")))??;
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

/// One copy of every variable (its first holder's), sharded ones gathered whole (so the
/// values restore under any layout); `what` names the purpose in errors.
async fn gather_variables(
    rpc: &Rpc,
    job: &Job,
    what: &str,
) -> Result<Vec<(String, Tensor)>, JobError> {
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
                // A task may hold variables whose first holder is another task (ZeRO: the
                // replicated parameters next to the task's own optimizer shards).
                for v in vars.into_iter().filter(|v| {
                    job.variable_tasks
                        .get(&v.name)
                        .and_then(|h| h.first())
                        .is_some_and(|first| first == task)
                }) {
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
    let tensors = dflow_partitioner::shards::gather_rows(&job.plan.row_sharded, tensors)
        .map_err(|e| JobError::Setup(format!("{what}: {e}")))?;
    dflow_partitioner::shards::gather(&job.plan.sharded, tensors)
        .and_then(|t| dflow_partitioner::shards::gather_axis(&job.plan.axis_sharded, t))
        .map_err(|e| JobError::Setup(format!("{what}: {e}")))
}

/// Saves one copy of every variable (its first holder's) into `dir` at `step`.
async fn save(
    rpc: &Rpc,
    job: &Job,
    dir: &Path,
    step: u64,
    keep: usize,
    metadata: &BTreeMap<String, String>,
) -> Result<PathBuf, JobError> {
    let tensors = gather_variables(rpc, job, &format!("checkpoint of step {step}")).await?;
    let path = checkpoint::save(dir, step, &tensors, metadata)
        .map_err(|e| JobError::Setup(e.to_string()))?;
    if keep > 0 {
        checkpoint::keep_last(dir, keep).map_err(|e| JobError::Setup(e.to_string()))?;
    }
    Ok(path)
}

/// Restores the newest checkpoint of `dir` on every task holding its variables.
async fn restore(rpc: &Rpc, job: &Job, dir: &Path) -> Result<Option<u64>, JobError> {
    let setup = |e: checkpoint::CheckpointError| JobError::Setup(e.to_string());
    let Some(path) = checkpoint::latest(dir).map_err(setup)? else {
        return Ok(None);
    };
    let ckpt = checkpoint::load(&path).map_err(setup)?;
    let step = ckpt.step;
    restore_values(rpc, job, ckpt, &path.display().to_string()).await?;
    Ok(Some(step))
}

/// Splits the whole variables of `ckpt` as `job` shards them and sends each to every task
/// holding it; `what` names where they came from in errors.
async fn restore_values(
    rpc: &Rpc,
    job: &Job,
    mut ckpt: checkpoint::Checkpoint,
    what: &str,
) -> Result<(), JobError> {
    // The inverse of `gather_variables`: axis shards first (a tensor-parallel shard's slot),
    // then flat shards (ZeRO's shards of that slot over the dp axis).
    dflow_partitioner::shards::split_axis(&job.plan.axis_sharded, &mut ckpt.tensors)
        .and_then(|()| dflow_partitioner::shards::split(&job.plan.sharded, &mut ckpt.tensors))
        .map_err(|e| JobError::Setup(format!("{what}: {e}")))?;
    dflow_partitioner::shards::split_rows(&job.plan.row_sharded, &mut ckpt.tensors)
        .map_err(|e| JobError::Setup(format!("{what}: {e}")))?;
    let values = checkpoint::restore_into(&job.variable_specs, &ckpt)
        .map_err(|e| JobError::Setup(format!("{what}: {e}")))?;
    scatter(
        rpc,
        job,
        values,
        &format!("SetVariables (restoring {what})"),
    )
    .await
}

/// Loads `cfg.init_from` into every task holding its variables, unless `cfg.checkpoint_dir`
/// holds a checkpoint (the job resumes from it instead); returns how many variables it loaded.
async fn initialize(rpc: &Rpc, job: &Job, cfg: &ChiefConfig) -> Result<Option<usize>, JobError> {
    let Some(init) = &cfg.init_from else {
        return Ok(None);
    };
    if let Some(dir) = &cfg.checkpoint_dir {
        if checkpoint::latest(dir).map_err(setup)?.is_some() {
            return Ok(None);
        }
    }
    let aliases: Vec<(&str, &str)> = init
        .aliases
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let values = initial_values(&job.variable_specs, &init.path, &init.variables, &aliases)
        .map_err(job_error)?;
    let n = values.len();
    scatter(rpc, job, values, "SetVariables (--init-from)").await?;
    Ok(Some(n))
}

/// Sends every `(variable, value)` to each task holding a copy of the variable.
async fn scatter(
    rpc: &Rpc,
    job: &Job,
    values: Vec<(String, Tensor)>,
    what: &str,
) -> Result<(), JobError> {
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
        rpc.call(&task, Request::SetVariables(values), what).await?;
    }
    Ok(())
}

/// One held-out batch: inputs, targets and its weight in the mean.
type EvalBatch = (Tensor, Tensor, f64);

/// The weighted means of the evaluation signature's fetches (loss, metrics) over `batches`,
/// under the user's names; empty when there are no batches.
async fn evaluate(
    rpc: &Rpc,
    job: &Job,
    batches: Vec<EvalBatch>,
    ids: &Ids,
) -> Result<Vec<(String, f64)>, JobError> {
    let mut sums = vec![0.0; job.plan.report_names.len()];
    let mut count = 0.0;
    for (x, y, weight) in batches {
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
            *sum += t.to_f64_vec().first().copied().unwrap_or(f64::NAN) * weight;
        }
        count += weight;
    }
    if count == 0.0 {
        return Ok(Vec::new());
    }
    // Report under the user's names (`loss`, `accuracy`), not the replica's.
    Ok(job
        .plan
        .report_names
        .iter()
        .cloned()
        .zip(sums)
        .map(|(name, s)| (name, s / count))
        .collect())
}

/// A lockstep job as a [`StepRunner`]: step `k` runs the training signature on every task at
/// once, each feeding its part of step `k`'s global batch; checkpoints gather and scatter the
/// variables; evaluation runs the evaluation signature on the held-out batches. Its async
/// calls run on `runtime` (the driver is synchronous: run it under `block_in_place`).
struct Lockstep<'a> {
    rpc: &'a Rpc,
    job: &'a Job,
    source: &'a Source,
    ids: &'a Ids,
    batch_size: usize,
    runtime: tokio::runtime::Handle,
    /// An elastic job: every task it may have (workers ready to join it are taken in before
    /// the next step).
    joins: Option<&'a ClusterSpec>,
    /// Set when the driver stopped before a step to take workers in: (the step, the workers).
    joined: Option<(u64, Vec<String>)>,
}

impl StepRunner for Lockstep<'_> {
    fn total_steps(&self) -> u64 {
        self.source.total_steps()
    }

    fn epoch(&self, step: u64) -> u64 {
        self.source.batch_of(step).0
    }

    fn train_step(&mut self, s: u64) -> Result<(f64, usize), TrainError> {
        if let Some(all) = self.joins {
            let tasks = elastic::joiners(self.rpc, all);
            if !tasks.is_empty() {
                let why = format!("{} joining before step {s}", tasks.join(", "));
                self.joined = Some((s, tasks));
                return Err(TrainError::Job(JobError::Setup(why)));
            }
        }
        let (epoch, index) = self.source.batch_of(s);
        let batch = Some((
            epoch,
            index,
            self.batch_size as u64,
            self.job.plan.batch_parts,
        ));
        let step = self.ids.next();
        let (fetched, _) =
            self.runtime
                .block_on(run_step(self.rpc, &self.job.train[0], step, batch))?;
        let loss = fetched.first().map(scalar).unwrap_or(f64::NAN);
        // The strategy's per-step values (the expert strategy's dropped tokens), one line.
        if !self.job.plan.step_metrics.is_empty() {
            let values: Vec<String> = self
                .job
                .plan
                .step_metrics
                .iter()
                .zip(fetched.iter().skip(1))
                .map(|(name, t)| format!("{name} {}", scalar(t)))
                .collect();
            eprintln!("{}: step {}: {}", self.rpc.task, s + 1, values.join(", "));
        }
        Ok((loss, self.source.rows(s, self.batch_size)))
    }

    fn restore_latest(&mut self, dir: &Path) -> Result<Option<u64>, TrainError> {
        Ok(self.runtime.block_on(restore(self.rpc, self.job, dir))?)
    }

    fn save(
        &mut self,
        dir: &Path,
        step: u64,
        keep: usize,
        metadata: &BTreeMap<String, String>,
    ) -> Result<PathBuf, TrainError> {
        Ok(self
            .runtime
            .block_on(save(self.rpc, self.job, dir, step, keep, metadata))?)
    }

    fn evaluate(&mut self) -> Result<Vec<(String, f64)>, TrainError> {
        let batches = self.source.eval_batches(self.batch_size)?;
        Ok(self
            .runtime
            .block_on(evaluate(self.rpc, self.job, batches, self.ids))?)
    }
}

/// A job error from the driver's error (a task's failure stays what it was).
fn job_error(e: TrainError) -> JobError {
    match e {
        TrainError::Job(e) => e,
        other => JobError::Setup(other.to_string()),
    }
}

/// What the driver reads of the chief's configuration.
fn driver_config(cfg: &ChiefConfig) -> TrainConfig {
    TrainConfig {
        batch_size: cfg.batch_size,
        shuffle_seed: cfg.seed,
        checkpoint_dir: cfg.checkpoint_dir.clone(),
        save_every: cfg.save_every,
        keep_checkpoints: cfg.keep_checkpoints,
        checkpoint_metadata: cfg.checkpoint_metadata.clone(),
        eval_every: cfg.eval_every,
        ..TrainConfig::default()
    }
}

/// Trains as `cfg` says over the tasks reachable through `rpc`, calling `on_step` after every
/// step; evaluates on the held-out data and saves the final checkpoint. A lockstep plan runs
/// through the step driver [`run_steps`] (the loop `dflow run --local` runs), and so does an
/// independent one (async ps), whose workers are lanes that each take the next batch when
/// free (`independent.rs`). Does not shut the job down: the caller tells
/// the tasks how it ended. Needs a multi-threaded tokio runtime (the driver blocks in place).
pub async fn run_chief(
    rpc: &Rpc,
    cluster: &ClusterSpec,
    cfg: &ChiefConfig,
    on_step: impl FnMut(&StepReport),
) -> Result<ChiefReport, JobError> {
    let source = Source::new(cfg)?;
    let mut slot_ids = SlotIds::default();
    let job = register_all(rpc, cfg, cluster, &source.data_spec(cfg), &mut slot_ids).await?;
    check_batch_parts(job.plan.batch_parts, cfg.batch_size)?;
    let initialized = initialize(rpc, &job, cfg).await?;
    let ids = Arc::new(Ids(AtomicU64::new(1)));
    let runtime = tokio::runtime::Handle::current();
    if runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
        return Err(setup(
            "run_chief needs a multi-threaded tokio runtime (the step driver blocks in place)",
        ));
    }
    match job.plan.schedule {
        Schedule::Lockstep => {
            if let Some(s) = cfg.staleness {
                return Err(setup(format!(
                    "--staleness {s} bounds asynchronous training; this plan runs the workers in lockstep (add --async)"
                )));
            }
            let data = source.data_spec(cfg);
            let (job, done) = elastic::lockstep(
                rpc, cluster, cfg, job, &source, &ids, &data, slot_ids, runtime, on_step,
            )
            .await?;
            let held_out = evaluate(rpc, &job, source.eval_batches(cfg.batch_size)?, &ids).await?;
            Ok(report(&source, done, held_out, None, initialized))
        }
        Schedule::Independent => {
            if let Some(k) = cfg.min_workers {
                return Err(setup(format!(
                    "--min-workers {k}: elastic jobs need a lockstep strategy (allreduce, or ps without --async); this plan runs each worker on its own"
                )));
            }
            let (job, done, staleness) =
                independent(rpc, job, cfg, &source, ids.clone(), on_step).await?;
            let held_out = evaluate(rpc, &job, source.eval_batches(cfg.batch_size)?, &ids).await?;
            Ok(report(&source, done, held_out, staleness, initialized))
        }
    }
}

/// Every part of a split batch needs an example: an empty part's mean loss is 0/0, and its
/// weight 0 does not make the sum finite.
fn check_batch_parts(parts: u32, batch_size: usize) -> Result<(), JobError> {
    if parts as usize > batch_size {
        return Err(setup(format!(
            "--batch-size {batch_size} is smaller than the {parts} parts the strategy splits every batch into (one per data-parallel replica); each part needs an example: give --batch-size {parts} or more"
        )));
    }
    Ok(())
}

/// What a run of steps did.
struct Finished {
    resumed_from: Option<u64>,
    final_step: u64,
    losses: Vec<(u64, f64)>,
    elapsed: Duration,
    examples: u64,
    checkpoint: Option<PathBuf>,
}

fn report(
    source: &Source,
    done: Finished,
    held_out: Vec<(String, f64)>,
    staleness: Option<(u64, u64, u64)>,
    initialized: Option<usize>,
) -> ChiefReport {
    let (train_examples, test_examples) = source.sizes();
    ChiefReport {
        train_examples,
        test_examples,
        steps_per_epoch: source.steps_per_epoch(),
        resumed_from: done.resumed_from,
        final_step: done.final_step,
        losses: done.losses,
        elapsed: done.elapsed,
        examples: done.examples,
        held_out,
        staleness: staleness.map(|(sum, max, n)| (sum as f64 / n.max(1) as f64, max)),
        checkpoint: done.checkpoint,
        initialized,
    }
}
