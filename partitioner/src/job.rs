//! The job plan: everything a distributed job runs, decided before the first step.
//!
//! A [`JobPlan`] is what a [`Strategy`](crate::strategy::Strategy) returns and what the runtime
//! executes: per run signature (a training step, the evaluation step) the placed and
//! partitioned subgraphs with their feeds and fetches; the collective groups; and one
//! [`BufferPlan`] for the whole job that gives every Send/Recv pair crossing between two tasks
//! one global slot id and its byte size. The runtime registers exactly these slots (same ids,
//! same sizes) and nothing else; [`JobPlan::recv_slots`] and [`JobPlan::send_routes`] are each
//! task's share. `dflow partition --strategy S` prints this plan ([`render_job_text`]).
//!
//! Pairs between two devices of one task move through the task's in-process rendezvous and
//! need no slot; pairs with the client are the task's own feeds and fetches.

use crate::partition::{partition, PartitionOptions, Partitions, TransferPair};
use crate::place::{place, PlacementOptions};
use crate::plan::{build_buffer_plan, BufferPlan, SlotPlan};
use crate::strategy::{JobInput, ReplicaGraph, StrategyError};
use dflow_graph::{DType, DeviceName, RendezvousKey, Shape};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// `/job:{job}/replica:0/task:{index}`: the name a task goes by in plans and on the wire.
pub fn task_name(job: &str, index: u32) -> String {
    format!("/job:{job}/replica:0/task:{index}")
}

/// The task of a full device name (`/job:ps/replica:0/task:0` for `.../device:CPU:0`).
fn task_of(device: &str) -> Result<String, JobPlanError> {
    DeviceName::parse(device)
        .ok()
        .and_then(|d| d.task_name())
        .ok_or_else(|| JobPlanError::NoTask {
            device: device.to_string(),
        })
}

/// How the training signatures of a job are stepped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Schedule {
    /// Every step runs every training signature once, all workers in lockstep; the global
    /// batch is split into [`JobPlan::batch_parts`] parts.
    Lockstep,
    /// Each training signature is stepped by its own worker loop, on whole batches (async).
    Independent,
}

/// What the runtime feeds into a feed key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FeedRole {
    /// The features of the task's part of the batch.
    Features,
    /// The labels of the task's part of the batch.
    Labels,
    /// The part's share of the batch, `n_part / n_batch`, as an f32 scalar.
    BatchWeight,
}

/// One feed of a signature.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeedPlan {
    /// The fed tensor (`replica_1/pixels:0`).
    pub tensor: String,
    /// Its client-terminated rendezvous key.
    pub key: RendezvousKey,
    /// The task that feeds it.
    pub task: String,
    /// What it is fed with.
    pub role: FeedRole,
    /// Which part of a lockstep batch (0 under [`Schedule::Independent`]).
    pub part: u32,
}

/// What a signature is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SignatureKind {
    /// A training step: feeds a batch, fetches the loss, runs the update ops.
    Train,
    /// An evaluation step on held-out data: fetches the loss and metrics, updates nothing.
    Eval,
}

/// One run signature: the partitions that run together as one step, and their feeds and
/// fetches.
#[derive(Clone, Debug)]
pub struct Signature {
    /// The id the runtime registers it under (train signature `i` is `2i + 1`, evaluation 2).
    pub handle: u32,
    /// Training or evaluation.
    pub kind: SignatureKind,
    /// The placed and partitioned subgraphs (their own buffer plan numbers slots per
    /// signature; [`JobPlan::buffer_plan`] is the job's).
    pub partitions: Partitions,
    /// What is fed, by whom.
    pub feeds: Vec<FeedPlan>,
    /// The fetched tensors, in order: the loss, then the metrics (evaluation).
    pub fetches: Vec<String>,
    /// The task that receives the fetches.
    pub fetch_task: Option<String>,
}

impl Signature {
    /// The tasks with a partition of this signature, in order.
    pub fn tasks(&self) -> Result<BTreeSet<String>, JobPlanError> {
        self.partitions
            .partitions
            .keys()
            .map(|d| task_of(&d.to_string()))
            .collect()
    }
}

/// A collective group: the tasks of a collective op's `group_key`, in rank order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveGroup {
    /// The group key the collective ops name.
    pub key: String,
    /// Member tasks; rank `r` is `members[r]`.
    pub members: Vec<String>,
}

/// A variable of the job and the tasks holding a copy of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VariablePlan {
    /// The variable's name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Static dimensions.
    pub dims: Vec<usize>,
    /// Every task holding a copy (one under ps, every worker under all-reduce).
    pub holders: Vec<String>,
}

/// A receive slot of one task: a [`SlotPlan`] and the task that sends into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskSlot<'a> {
    /// The slot (global id, key, dtype, shape, bytes).
    pub slot: &'a SlotPlan,
    /// The sending task (for a receive slot) or the receiving task (for a send route).
    pub peer: &'a str,
}

/// Why partitions do not make a runnable job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobPlanError {
    /// A device names no task.
    #[error("device `{device}` names no task (a job plan needs /job:J/replica:R/task:T devices)")]
    NoTask {
        /// The device.
        device: String,
    },
    /// A tensor crossing between tasks has a shape that is not fully known.
    #[error("pair {key}: tensor `{tensor}` crosses between tasks with shape {shape}, which is not fully known; tensors between tasks need static shapes (their receive buffers are allocated once): give the placeholders static shapes")]
    DynamicCrossTask {
        /// The pair's rendezvous key.
        key: String,
        /// The tensor.
        tensor: String,
        /// Its partial shape.
        shape: Shape,
    },
    /// One key carries different types in two signatures.
    #[error(
        "pair {key}: {first} in one signature, {second} in another; one key needs one slot type"
    )]
    SlotConflict {
        /// The key.
        key: String,
        /// The type in the first signature.
        first: String,
        /// The type in the other.
        second: String,
    },
    /// More slots than a slot id holds.
    #[error("the job needs {0} receive slots; slot ids are 32-bit")]
    TooManySlots(usize),
    /// The fetches of one signature live on two tasks.
    #[error(
        "the fetches of one step live on two tasks ({first} and {second}); fetch them from one"
    )]
    FetchesOnTwoTasks {
        /// One task.
        first: String,
        /// The other.
        second: String,
    },
    /// A strategy produced no training graph.
    #[error("the strategy built no training graph")]
    Empty,
}

/// Everything a distributed job runs (see the module docs).
#[derive(Clone, Debug)]
pub struct JobPlan {
    /// The strategy and its options, in words (`sync parameter-server training`).
    pub strategy: String,
    /// How the training signatures are stepped.
    pub schedule: Schedule,
    /// Parts each batch is split into: the number of replicas in lockstep, 1 when every worker
    /// takes whole batches.
    pub batch_parts: u32,
    /// Training signatures first (in worker order), then the evaluation signature.
    pub signatures: Vec<Signature>,
    /// Collective groups the tasks join before the first step.
    pub groups: Vec<CollectiveGroup>,
    /// One slot per Send/Recv pair crossing between tasks, global ids in key order: the
    /// source of truth for what every task registers.
    pub buffer_plan: BufferPlan,
    /// The job's variables and who holds them, by name.
    pub variables: Vec<VariablePlan>,
    /// The loss and metric names the user asked for (reported under these names).
    pub report_names: Vec<String>,
    /// The names of the training signatures' fetches after the loss
    /// ([`crate::strategy::ReplicaGraph::step_metrics`]), reported by the chief every step.
    pub step_metrics: Vec<String>,
    /// Logical tensors stored as shards over several variables (ZeRO's optimizer slots): a
    /// checkpoint stores them whole ([`crate::shards::gather`] on save,
    /// [`crate::shards::split`] on restore), so it resumes under any layout.
    pub sharded: Vec<crate::shards::ShardedVariable>,
    /// Logical tensors stored as shards along one axis (tensor parallelism's weights and
    /// slots), gathered and split like [`JobPlan::sharded`] ([`crate::shards::gather_axis`],
    /// [`crate::shards::split_axis`]).
    pub axis_sharded: Vec<crate::shards::AxisShardedVariable>,
    /// Logical tensors stored as row shards (embedding tables sharded over the ps tasks and
    /// their slots): a checkpoint stores them whole ([`crate::shards::gather_rows`] on save,
    /// [`crate::shards::split_rows`] on restore), so it resumes at any number of ps tasks.
    pub row_sharded: Vec<crate::shards::RowShardedVariable>,
}

fn tensor_name(name: &str) -> String {
    if name.contains(':') {
        name.to_string()
    } else {
        format!("{name}:0")
    }
}

/// The feeds of `g`'s replicas, by tensor: role and batch part.
fn feed_roles(g: &ReplicaGraph, lockstep: bool) -> Vec<(String, FeedRole, u32)> {
    let mut out = Vec::new();
    for r in &g.replicas {
        // Independent workers take whole batches; lockstep replicas each feed their part.
        let part = if lockstep { r.worker as u32 } else { 0 };
        out.push((tensor_name(&r.features), FeedRole::Features, part));
        out.push((tensor_name(&r.labels), FeedRole::Labels, part));
        if let Some(w) = &r.weight {
            out.push((tensor_name(w), FeedRole::BatchWeight, part));
        }
    }
    out
}

/// Makes a signature of `parts`: binds each feed endpoint to its role and finds the fetch task.
fn signature(
    handle: u32,
    kind: SignatureKind,
    parts: Partitions,
    roles: &[(String, FeedRole, u32)],
    fetches: Vec<String>,
) -> Result<Signature, StrategyError> {
    let mut feeds = Vec::with_capacity(parts.feeds.len());
    for ep in &parts.feeds {
        let (_, role, part) = roles
            .iter()
            .find(|(t, _, _)| *t == ep.tensor)
            .ok_or_else(|| StrategyError::UnknownTensor {
                role: "feed",
                name: ep.tensor.clone(),
                message: "no data source feeds it".into(),
            })?;
        feeds.push(FeedPlan {
            tensor: ep.tensor.clone(),
            key: ep.key.clone(),
            task: task_of(&ep.device.to_string())?,
            role: *role,
            part: *part,
        });
    }
    let mut fetch_task: Option<String> = None;
    for ep in &parts.fetches {
        let task = task_of(&ep.device.to_string())?;
        match &fetch_task {
            Some(t) if *t != task => {
                return Err(JobPlanError::FetchesOnTwoTasks {
                    first: t.clone(),
                    second: task,
                }
                .into())
            }
            _ => fetch_task = Some(task),
        }
    }
    Ok(Signature {
        handle,
        kind,
        partitions: parts,
        feeds,
        fetches,
        fetch_task,
    })
}

/// The pairs of `signatures` that cross between two tasks, one per key, sorted by key; each
/// must have a static shape, and a key shared by two signatures must carry one type.
fn cross_task_pairs(signatures: &[Signature]) -> Result<Vec<TransferPair>, JobPlanError> {
    let mut by_key: BTreeMap<&RendezvousKey, &TransferPair> = BTreeMap::new();
    for s in signatures {
        for p in s.partitions.pairs.iter().filter(|p| !p.client_terminated) {
            if task_of(&p.send_device)? == task_of(&p.recv_device)? {
                continue;
            }
            if p.bytes.is_none() {
                return Err(JobPlanError::DynamicCrossTask {
                    key: p.key.to_string(),
                    tensor: p.tensor_name.to_string(),
                    shape: p.shape.clone(),
                });
            }
            match by_key.get(&p.key) {
                Some(q) if (q.dtype, &q.shape) != (p.dtype, &p.shape) => {
                    return Err(JobPlanError::SlotConflict {
                        key: p.key.to_string(),
                        first: format!("{}{}", q.dtype, q.shape),
                        second: format!("{}{}", p.dtype, p.shape),
                    })
                }
                Some(_) => {}
                None => {
                    by_key.insert(&p.key, p);
                }
            }
        }
    }
    Ok(by_key.into_values().cloned().collect())
}

impl JobPlan {
    /// Places and partitions a strategy's training graphs into the job's plan: one training
    /// signature per graph (`placement` places them), an evaluation signature of the first,
    /// and the job's buffer plan. Strategies call this after their rewrite.
    pub fn build(
        strategy: String,
        input: &JobInput<'_>,
        graphs: Vec<ReplicaGraph>,
        placement: &PlacementOptions,
        schedule: Schedule,
        groups: Vec<CollectiveGroup>,
    ) -> Result<JobPlan, StrategyError> {
        let lockstep = schedule == Schedule::Lockstep;
        let mut signatures = Vec::with_capacity(graphs.len() + 1);
        let mut eval = None;
        let mut variables: BTreeMap<String, VariablePlan> = BTreeMap::new();
        for (i, g) in graphs.iter().enumerate() {
            let placed = place(&g.graph, input.cluster, placement)?;
            for idx in placed.graph.node_indices() {
                let n = placed.graph.node(idx);
                let Some(out) = n.outputs.first().filter(|_| n.op_def().is_variable) else {
                    continue;
                };
                let Some(dims) = out.shape.as_static() else {
                    continue;
                };
                let task = task_of(&placed.devices[idx.index()].to_string())?;
                let v = variables
                    .entry(n.name.clone())
                    .or_insert_with(|| VariablePlan {
                        name: n.name.clone(),
                        dtype: out.dtype,
                        dims,
                        holders: Vec::new(),
                    });
                if !v.holders.contains(&task) {
                    v.holders.push(task);
                }
            }
            let roles = feed_roles(g, lockstep);
            let mut fetches = vec![tensor_name(&g.training.loss)];
            fetches.extend(g.step_metrics.iter().map(|(_, t)| tensor_name(t)));
            let opts = PartitionOptions {
                feeds: roles.iter().map(|(t, _, _)| t.clone()).collect(),
                fetches,
                targets: vec![g.training.train_op.clone()],
            };
            let parts = partition(&placed, &opts).map_err(|source| StrategyError::Partition {
                what: "training",
                source,
            })?;
            let handle =
                u32::try_from(2 * i + 1).map_err(|_| StrategyError::WorkerCount(graphs.len()))?;
            signatures.push(signature(
                handle,
                SignatureKind::Train,
                parts,
                &roles,
                opts.fetches,
            )?);
            if i == 0 {
                let roles = vec![
                    (tensor_name(&g.eval.features), FeedRole::Features, 0),
                    (tensor_name(&g.eval.labels), FeedRole::Labels, 0),
                ];
                let mut fetches = vec![tensor_name(&g.eval.loss)];
                fetches.extend(g.eval.metrics.iter().map(|m| tensor_name(m)));
                let opts = PartitionOptions {
                    feeds: roles.iter().map(|(t, _, _)| t.clone()).collect(),
                    fetches,
                    targets: vec![],
                };
                let parts =
                    partition(&placed, &opts).map_err(|source| StrategyError::Partition {
                        what: "evaluation",
                        source,
                    })?;
                eval = Some(signature(
                    2,
                    SignatureKind::Eval,
                    parts,
                    &roles,
                    opts.fetches,
                )?);
            }
        }
        signatures.push(eval.ok_or(JobPlanError::Empty)?);
        let pairs = cross_task_pairs(&signatures)?;
        if u32::try_from(pairs.len()).is_err() {
            return Err(JobPlanError::TooManySlots(pairs.len()).into());
        }
        let devices: BTreeSet<&DeviceName> = signatures
            .iter()
            .flat_map(|s| s.partitions.partitions.keys())
            .collect();
        let buffer_plan = build_buffer_plan(&pairs, devices.into_iter(), |_| None);
        let mut report_names = vec![input.train.loss.clone()];
        report_names.extend(input.train.metrics.iter().cloned());
        let step_metrics = graphs
            .first()
            .map(|g| g.step_metrics.iter().map(|(n, _)| n.clone()).collect())
            .unwrap_or_default();
        Ok(JobPlan {
            strategy,
            schedule,
            batch_parts: if lockstep {
                graphs.iter().map(|g| g.replicas.len() as u32).sum()
            } else {
                1
            },
            signatures,
            groups,
            buffer_plan,
            variables: variables.into_values().collect(),
            report_names,
            step_metrics,
            sharded: Vec::new(),
            axis_sharded: Vec::new(),
            row_sharded: Vec::new(),
        })
    }

    /// The training signatures, in worker order.
    pub fn train_signatures(&self) -> impl Iterator<Item = &Signature> {
        self.signatures
            .iter()
            .filter(|s| s.kind == SignatureKind::Train)
    }

    /// The evaluation signature.
    pub fn eval_signature(&self) -> Option<&Signature> {
        self.signatures
            .iter()
            .find(|s| s.kind == SignatureKind::Eval)
    }

    /// Every task of the job with a partition, in order.
    pub fn tasks(&self) -> Result<BTreeSet<String>, JobPlanError> {
        let mut all = BTreeSet::new();
        for s in &self.signatures {
            all.extend(s.tasks()?);
        }
        Ok(all)
    }

    /// The slots `task` receives into, in slot order, each with its sending task.
    pub fn recv_slots(&self, task: &str) -> Vec<TaskSlot<'_>> {
        self.task_slots(task, |s, r| (r, s))
    }

    /// The slots `task` sends into, in slot order, each with its receiving task.
    pub fn send_routes(&self, task: &str) -> Vec<TaskSlot<'_>> {
        self.task_slots(task, |s, r| (s, r))
    }

    /// Slots whose (this end, other end) — as `ends` picks them from (send, recv) — has `task`
    /// at this end.
    fn task_slots<'a>(
        &'a self,
        task: &str,
        ends: impl Fn(&'a str, &'a str) -> (&'a str, &'a str),
    ) -> Vec<TaskSlot<'a>> {
        self.buffer_plan
            .slots
            .iter()
            .filter_map(|slot| {
                let (here, peer) = ends(slot.key.send_device(), slot.key.recv_device());
                let here_task = task_prefix(here)?;
                (here_task == task).then(|| TaskSlot {
                    slot,
                    peer: task_prefix(peer).unwrap_or(peer),
                })
            })
            .collect()
    }
}

/// The `/job:J/replica:R/task:T` prefix of a full device name, borrowed.
fn task_prefix(device: &str) -> Option<&str> {
    let at = device.find("/device:").unwrap_or(device.len());
    let task = &device[..at];
    task.contains("/task:").then_some(task)
}

/// The plan as text: the strategy, the signatures with their partitions and feeds, the
/// collective groups, and every task's slots.
pub fn render_job_text(plan: &JobPlan) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "job plan: {}", plan.strategy);
    let _ = writeln!(
        out,
        "schedule: {:?}, {} batch part(s) per step",
        plan.schedule, plan.batch_parts
    );
    for s in &plan.signatures {
        let _ = writeln!(out, "\nsignature {} ({:?})", s.handle, s.kind);
        for (device, p) in &s.partitions.partitions {
            let _ = writeln!(out, "  {device}: {} nodes", p.graph.num_nodes());
        }
        for f in &s.feeds {
            let _ = writeln!(
                out,
                "  feed {} <- {:?} part {} on {}",
                f.tensor, f.role, f.part, f.task
            );
        }
        if let Some(t) = &s.fetch_task {
            let _ = writeln!(out, "  fetch {} on {t}", s.fetches.join(", "));
        }
    }
    for g in &plan.groups {
        let _ = writeln!(
            out,
            "\ncollective group {}: {}",
            g.key,
            g.members.join(", ")
        );
    }
    let _ = writeln!(out, "\nvariables:");
    for v in &plan.variables {
        let _ = writeln!(
            out,
            "  {} {}{:?} on {}",
            v.name,
            v.dtype,
            v.dims,
            v.holders.join(", ")
        );
    }
    let total: usize = plan.buffer_plan.slots.iter().map(|s| s.bytes).sum();
    let _ = writeln!(
        out,
        "\nbuffer plan: {} slot(s) between tasks, {total} bytes per step",
        plan.buffer_plan.slots.len()
    );
    if let Ok(tasks) = plan.tasks() {
        for task in tasks {
            let slots = plan.recv_slots(&task);
            if slots.is_empty() {
                continue;
            }
            let _ = writeln!(out, "  {task} receives:");
            for s in slots {
                let _ = writeln!(
                    out,
                    "    slot {:>3}  {:>9} B  from {}  {}",
                    s.slot.slot, s.slot.bytes, s.peer, s.slot.key
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::{JobInput, StrategyKind, StrategyOptions};
    use dflow_graph::builder::GraphBuilder;
    use dflow_graph::train::{OptimizerKind, OptimizerSpec, TrainSpec};
    use dflow_graph::{ClusterSpec, DType, Graph};

    fn spec() -> TrainSpec {
        TrainSpec::new(
            "loss",
            OptimizerSpec {
                kind: OptimizerKind::Sgd,
                lr: 0.1,
            },
        )
    }

    /// `loss = mean((x @ w - y)^2)`, `x` with `batch` rows; with `ps_reads_activation`, a node
    /// pinned to the ps reads the worker's activation `p` and the loss depends on it.
    fn model(batch: i64, ps_reads_activation: bool) -> Graph {
        let mut b = GraphBuilder::new();
        let w = b.with_device("/job:ps/task:0", |b| {
            b.variable("w", DType::F32, &[3, 1], "zeros")
        });
        let x = b.placeholder("x", DType::F32, &[batch, 3]);
        let y = b.placeholder("y", DType::F32, &[batch, 1]);
        let mut p = b.matmul("p", &x, &w);
        if ps_reads_activation {
            p = b.with_device("/job:ps/task:0", |b| b.unary("Neg", "on_ps", &p));
        }
        let d = b.binary("Sub", "d", &p, &y);
        let sq = b.binary("Mul", "sq", &d, &d);
        b.op("Mean", "loss").input(&sq).finish();
        b.build().unwrap()
    }

    fn plan(graph: &Graph, workers: u32) -> Result<JobPlan, StrategyError> {
        let cluster = ClusterSpec::local(&[("ps", 1), ("worker", workers)]).unwrap();
        let strategy = "ps"
            .parse::<StrategyKind>()
            .unwrap()
            .build(&StrategyOptions::default())
            .unwrap();
        strategy.plan(&JobInput::new(graph, &spec(), &cluster, "x", "y"))
    }

    #[test]
    fn slots_are_global_in_key_order_and_split_by_task() {
        let plan = plan(&model(4, false), 2).unwrap();
        let slots = &plan.buffer_plan.slots;
        assert!(slots.windows(2).all(|w| w[0].key < w[1].key));
        assert!(slots.iter().enumerate().all(|(i, s)| s.slot == i));
        let tasks = plan.tasks().unwrap();
        assert_eq!(tasks.len(), 3);
        // Every slot is received by one task and sent by another.
        let received: usize = tasks.iter().map(|t| plan.recv_slots(t).len()).sum();
        let sent: usize = tasks.iter().map(|t| plan.send_routes(t).len()).sum();
        assert_eq!((received, sent), (slots.len(), slots.len()));
        for t in &tasks {
            for s in plan.recv_slots(t) {
                assert_ne!(s.peer, t.as_str());
                assert!(s.slot.key.as_str().contains(&format!(";{t}/device:")));
            }
        }
        // The eval signature shares the training signature's keys: no second slot for `w`.
        let w_to_worker0 = slots
            .iter()
            .filter(|s| {
                s.key.tensor_name() == "w:0"
                    && s.key.as_str().contains(";/job:worker/replica:0/task:0/")
            })
            .count();
        assert_eq!(w_to_worker0, 1);
    }

    #[test]
    fn a_dynamic_shape_between_tasks_is_refused_naming_the_pair() {
        // Variables and gradients are static even with a dynamic batch: the plan builds.
        assert!(plan(&model(-1, false), 2).is_ok());
        let e = plan(&model(-1, true), 1).unwrap_err();
        let StrategyError::Plan(JobPlanError::DynamicCrossTask { key, tensor, .. }) = &e else {
            panic!("{e}");
        };
        // The first in key order: the gradient flowing back from the ps to the worker.
        assert_eq!(tensor, "gradients/replica_0/on_ps/dx:0");
        assert!(e.to_string().contains(&format!("pair {key}")), "{e}");
    }

    #[test]
    fn task_prefixes() {
        assert_eq!(
            task_prefix("/job:ps/replica:0/task:3/device:CPU:0"),
            Some("/job:ps/replica:0/task:3")
        );
        assert_eq!(
            task_prefix("/job:ps/replica:0/task:3"),
            Some("/job:ps/replica:0/task:3")
        );
        assert_eq!(task_prefix("/job:ps"), None);
        assert_eq!(task_name("worker", 2), "/job:worker/replica:0/task:2");
    }
}
