//! The step time of a real dflow job, predicted from the job plan it runs.
//!
//! The analytical model ([`super::evaluate`]) prices FLOPs and bytes, which is what matters for
//! a large model on GPUs. A small model on this machine spends most of a step in dflow's own
//! distributed step path: the chief's batching, feeds and fetch and the step's dispatch to
//! every task (per step), the executor's dispatch of every node of a task's partition (per op),
//! and each collective message's handshake and the wake-ups of the threads waiting on it (per
//! message). Those costs are the profile's [`JobCosts`], measured by `dflow bench calibrate` on
//! small 2-worker jobs; the counts come from the job plan `dflow run` makes for the layout
//! ([`super::accounting::job_plan`]): its partitions' nodes, its collective ops and their bytes
//! ([`super::accounting::traffic`]).
//!
//! A step is `job.step + tasks · job.task + cpu + communication`, where a task's cpu time is its
//! share of the layout's compute (the analytical FLOPs, with the pipeline's bubble, at the job's
//! FLOP/s) plus `ops · job.op`, and a task's communication is `messages · job.collective +
//! values · job.value + bytes / β` (its collective calls' messages: each a step with a peer, so a
//! 4-rank ring all-gather pays three where a 2-rank one pays one) over a link inside the host (`job.collective` includes the link's
//! latency α; α alone when it is 0; `job.value` is the collective's cost when 0): per value
//! sent to another task and per value received from one (a pipeline's stages wait on each
//! other: the sender's call and the receiver's wake-up are both on the step's path). The tasks
//! share the host's cores: the step's cpu and communication are the busiest task's, or all
//! tasks' over the cores when that is more (`max(busiest, Σ tasks / cores)`: 4 tasks on 2 cores
//! take twice as long as 2). A call's handshake and wake-ups are work on the cores too: 4 tasks
//! that synchronize inside the step each wait for a core as well as for their peer. When the
//! tasks outnumber the cores, each wait on the step's path (a value sent or received, a
//! collective message between two computations: a tensor-parallel all-reduce, an MoE
//! all-to-all, [`super::accounting::between_products`]) costs the cores `job.beyond_cores`
//! more: the peer it waits for may be without a core, and the waiting thread's bounded spin
//! yields its core once per switch. A gradient's all-reduce at the step's end and a ZeRO-3
//! gather (issued ahead of its use) are not on the path. And the products run slower beyond the cores
//! (`job.beyond_cores_per_flop` more a FLOP): a product split over a task's pool threads
//! waits for whichever of them has no core.
//!
//! The step is linear in the costs once the busiest task and the branches of the maxima are
//! chosen ([`job_terms`]); [`fit_job_costs`] fits the costs to measured calibration jobs by
//! non-negative least squares ([`super::fit`]).

use super::accounting::{shares_input, traffic, with_rows, AccountingError};
use super::evaluate::Evaluation;
use super::flops::forward_flops;
use super::profile::{ClusterProfile, JobCosts, Link, LinkClass};
use crate::strategy::JobPlan;
use dflow_graph::{AttrValue, DeviceName, Graph};
use petgraph::graph::NodeIndex;
use std::collections::BTreeMap;

/// What one task does in a training step, from the job plan.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskWork {
    /// The task.
    pub task: String,
    /// Nodes of its training partitions (each dispatched once a step).
    pub ops: usize,
    /// FLOPs of its matrix products (`MatMul`, `BatchMatMul`: forward, backward and the
    /// micro-batches all appear as nodes of the partitions).
    pub product_flops: u64,
    /// Its matrix-product nodes (each pays `job.product` beyond its FLOPs: a small product's
    /// floor, the GEMM's setup and packing).
    pub products: usize,
    /// Nodes its executor hands to the compute pool alone ([`spawns`]: each pays `job.spawn`,
    /// the hand-off and the wake-up of another pool thread).
    pub spawns: usize,
    /// Bytes read and written by its other computing ops (not views, not sends, receives or
    /// collectives, not constant-time ops).
    pub bytes: u64,
    /// Output elements of its ops that evaluate a transcendental function per element
    /// ([`TRANSCENDENTAL`]: priced per element, not by their bytes).
    pub transcendentals: u64,
    /// Collective calls it makes.
    pub collective_calls: usize,
    /// Messages it sends in them (each a step with a peer: 1 for a 2-rank all-gather, 3 for a
    /// 4-rank ring's; [`super::collective::rank_messages`]).
    pub collective_messages: usize,
    /// Of those, the messages of calls between two computations (a tensor-parallel
    /// all-reduce, an MoE all-to-all: [`super::accounting::between_products`]), on the step's
    /// path as a pipeline's values are.
    pub path_messages: usize,
    /// Bytes it sends in collectives.
    pub collective_bytes: u64,
    /// Values carrying data it sends to other tasks' Recvs (the zero-byte values of control
    /// edges are not counted: they leave together at the step's end).
    pub values: usize,
    /// Values carrying data other tasks send to its Recvs (each wakes a waiting thread of this
    /// task).
    pub received: usize,
    /// Their bytes.
    pub data_plane_bytes: u64,
}

/// Ops priced by their FLOPs (the rest that compute are priced by their bytes).
const PRODUCTS: &[&str] = &["MatMul", "BatchMatMul"];

/// Ops whose kernels evaluate `tanh`, `exp` or `log` once per output element.
pub const TRANSCENDENTAL: &[&str] = &["Gelu", "GeluGrad", "Tanh", "Sigmoid", "Exp", "Log"];

/// Ops that read only the part of their input they copy out (a slice, the gathered rows), not
/// the whole input: the data-parallel strategy's `FlatSlice` of each gradient out of a fused
/// bucket would otherwise count the whole bucket once per gradient (the bundled GPT dp=2: 172
/// MB of a task's 279 MB a step, 13 ms at 12.8 GB/s, where the slices copy 3.3 MB).
const READS_WHAT_IT_WRITES: &[&str] = &["FlatSlice", "Slice", "Gather"];

/// Ops that move no bytes a kernel touches: they hand buffers over, block on a peer or register
/// a callback (their cost is the call's or the dispatch's).
fn moves_nothing(op: &str) -> bool {
    matches!(
        op,
        "NoOp" | "Const" | "Variable" | "Placeholder" | "Send" | "Recv" | "Shape"
    ) || op.starts_with("Collective")
}

/// The compute of one partition `graph` of `task` with `rows` rows where a feed's batch is
/// unknown.
fn partition_compute(task: &str, graph: &Graph, rows: usize) -> Result<TaskWork, AccountingError> {
    let fixed = with_rows(graph, rows).map_err(|message| AccountingError::Invalid {
        task: task.to_string(),
        rows,
        message,
    })?;
    let g = &fixed;
    let bytes_of = |idx: NodeIndex, k: usize| -> Option<usize> {
        let t = g.node(idx).outputs.get(k)?;
        Some(t.shape.num_elements()? * t.dtype.size_of())
    };
    let mut w = TaskWork {
        task: task.to_string(),
        ops: g.num_nodes(),
        spawns: spawns(graph),
        ..TaskWork::default()
    };
    let mut flops = 0.0;
    for idx in g.node_indices() {
        let op = g.node(idx).op;
        if PRODUCTS.contains(&op) {
            flops += forward_flops(g, idx);
            w.products += 1;
            continue;
        }
        if moves_nothing(op) {
            continue;
        }
        if TRANSCENDENTAL.contains(&op) {
            let elements = g
                .node(idx)
                .outputs
                .first()
                .and_then(|t| t.shape.num_elements());
            w.transcendentals += elements.unwrap_or(0) as u64;
            continue;
        }
        let inputs: Vec<Option<usize>> =
            g.inputs(idx).iter().map(|&(s, k)| bytes_of(s, k)).collect();
        let output = bytes_of(idx, 0);
        if let Some(out) = output {
            if shares_input(g, idx, out, inputs.first().copied().flatten()) {
                continue;
            }
        }
        let outputs: usize = (0..g.node(idx).outputs.len())
            .filter_map(|k| bytes_of(idx, k))
            .sum();
        let read = if READS_WHAT_IT_WRITES.contains(&op) {
            outputs
        } else {
            inputs.iter().flatten().sum::<usize>()
        };
        w.bytes += (read + outputs) as u64;
    }
    w.product_flops = flops as u64;
    Ok(w)
}

/// Whether the executor batches node `idx` of `g` with other cheap nodes
/// ([`dflow_graph::kernel::is_cheap`], the rule its plan applies).
fn executor_cheap(g: &Graph, idx: NodeIndex) -> bool {
    let node = g.node(idx);
    let inputs: Vec<&dflow_graph::ops::TensorType> = g
        .inputs(idx)
        .into_iter()
        .filter_map(|(s, k)| g.node(s).outputs.get(k))
        .collect();
    dflow_graph::kernel::is_cheap(node.op, &inputs, &node.outputs)
}

/// The nodes of a partition its executor hands to the compute pool alone in a step: when a
/// node completes, every expensive consumer it readies beyond the first (which its thread runs
/// next) is spawned on its own. A consumer is readied by its last predecessor to complete,
/// taken as its last in topological order (data or control edges): a chain spawns nothing (a
/// forward op's gradient reader waits for the backward pass), a fan-out of `k` ready nodes
/// spawns `k − 1`. `g` as the executor plans it: a feed's batch dimension unknown, so a node of
/// the batch is expensive whatever its size.
pub fn spawns(g: &Graph) -> usize {
    let order = g.topo_order();
    let mut position = vec![0usize; g.num_nodes()];
    for (k, &i) in order.iter().enumerate() {
        position[i.index()] = k;
    }
    let mut readied = vec![0usize; g.num_nodes()];
    for &i in &order {
        if executor_cheap(g, i) {
            continue;
        }
        let last = g
            .petgraph()
            .neighbors_directed(i, petgraph::Direction::Incoming)
            .max_by_key(|p| position[p.index()]);
        if let Some(p) = last {
            readied[p.index()] += 1;
        }
    }
    readied.iter().map(|k| k.saturating_sub(1)).sum()
}

/// Whether the Send `idx` of `g` carries data: not the zero-byte value of a control edge (a
/// stage's "updates done" for the other stage's readers), which leave together at the step's
/// end and are not priced one by one.
fn carries_data(g: &Graph, idx: NodeIndex) -> bool {
    g.inputs(idx)
        .first()
        .and_then(|&(s, k)| g.node(s).outputs.get(k))
        .map_or(true, |t| t.shape.num_elements() != Some(0))
}

/// The work of every task of `plan` in one training step (every training signature once), with
/// `rows` rows where a feed's batch dimension is unknown.
pub fn work(plan: &JobPlan, rows: usize) -> Result<Vec<TaskWork>, AccountingError> {
    let mut compute: BTreeMap<String, TaskWork> = BTreeMap::new();
    for signature in plan.train_signatures() {
        for (device, part) in &signature.partitions.partitions {
            let task = device.task_name().unwrap_or_else(|| device.to_string());
            for idx in part.graph.node_indices() {
                let node = part.graph.node(idx);
                if node.op != "Send"
                    || matches!(node.attr("client_terminated"), Some(AttrValue::Bool(true)))
                {
                    continue;
                }
                let to = match node.attr("recv_device") {
                    Some(AttrValue::String(d)) => {
                        DeviceName::parse(&d[..]).ok().and_then(|d| d.task_name())
                    }
                    _ => None,
                };
                if let Some(to) = to.filter(|t| *t != task) {
                    if carries_data(&part.graph, idx) {
                        compute.entry(to).or_default().received += 1;
                        compute.entry(task.clone()).or_default().values += 1;
                    }
                }
            }
            let p = partition_compute(&task, &part.graph, rows)?;
            let e = compute.entry(task).or_default();
            e.ops += p.ops;
            e.product_flops += p.product_flops;
            e.products += p.products;
            e.spawns += p.spawns;
            e.bytes += p.bytes;
            e.transcendentals += p.transcendentals;
        }
    }
    Ok(traffic(plan, rows)?
        .into_iter()
        .map(|t| {
            let c = compute.remove(&t.task).unwrap_or_default();
            TaskWork {
                task: t.task,
                collective_calls: t.collective_calls,
                collective_messages: t.collective_messages,
                path_messages: t.path_messages,
                collective_bytes: t.collective,
                data_plane_bytes: t.data_plane,
                ..c
            }
        })
        .collect())
}

/// A predicted step of a real job, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct JobStep {
    /// The profile's per-step cost and its per-task cost times the tasks.
    pub step: f64,
    /// The busiest task's compute: its products' FLOPs over the job's FLOP/s and its other
    /// ops' bytes over the job's bytes/s (the layout's analytical compute where the profile has
    /// no bytes/s), with the pipeline's bubble.
    pub compute: f64,
    /// The busiest task's ops times the per-op costs.
    pub ops: f64,
    /// CPU time of the step: compute and ops of the busiest task, or (when the tasks are more
    /// than the cores) all tasks' compute, ops and communication over the host's cores less
    /// [`JobStep::communication`].
    pub cpu: f64,
    /// The busiest task's collective messages and its sent and received values.
    pub communication: f64,
}

impl JobStep {
    /// The predicted step time.
    pub fn total(&self) -> f64 {
        self.step + self.cpu + self.communication
    }
}

/// A task's compute (seconds) from its own nodes under `job`'s rates: products at
/// `job.flops_per_second` (else `flops_per_second`), the other ops' bytes at
/// `job.bytes_per_second`, the [`TRANSCENDENTAL`] ops' elements at
/// `job.transcendentals_per_second`; `None` when the profile has no bytes/s (not calibrated per op kind).
pub fn task_compute(t: &TaskWork, job: &JobCosts, flops_per_second: f64) -> Option<f64> {
    if job.bytes_per_second <= 0.0 {
        return None;
    }
    let rate = if job.flops_per_second > 0.0 {
        job.flops_per_second
    } else {
        flops_per_second
    };
    let transcendentals = if job.transcendentals_per_second > 0.0 {
        t.transcendentals as f64 / job.transcendentals_per_second
    } else {
        // Priced by their bytes: an input and an output element each.
        t.transcendentals as f64 * 8.0 / job.bytes_per_second
    };
    Some(t.product_flops as f64 / rate + t.bytes as f64 / job.bytes_per_second + transcendentals)
}

/// The fixed cost (seconds) of a task's nodes: `job.op` each for its dispatch,
/// `job.product` more for each matrix product (the floor of a small GEMM) and `job.spawn` more
/// for each node handed to the pool alone.
pub fn task_dispatch(t: &TaskWork, job: &JobCosts) -> f64 {
    t.ops as f64 * job.op + t.products as f64 * job.product + t.spawns as f64 * job.spawn
}

/// The step of a job whose tasks do `work`, on `profile`'s hosts (`cores` per host: the tasks
/// of one host share them). A task computes for `compute` seconds (the analytical figure) when
/// the profile has no per-op-kind rates, else for its own nodes' [`task_compute`]; a pipeline
/// of bubble fraction `bubble` keeps each task busy `1 − bubble` of the step.
pub fn job_step(
    work: &[TaskWork],
    compute: f64,
    bubble: f64,
    profile: &ClusterProfile,
    cores: usize,
) -> JobStep {
    let job = profile.job;
    let link = profile.link(LinkClass::IntraHost);
    let compute_of =
        |t: &TaskWork| task_compute(t, &job, profile.flops_per_second).map_or(compute, |c| c);
    let cpu_of = |t: &TaskWork| compute_of(t) + task_dispatch(t, &job);
    // A pipeline's task waits the bubble out: its work is spread over `1/(1 − bubble)` of it.
    let stretch = if job.bytes_per_second > 0.0 && bubble > 0.0 && bubble < 1.0 {
        1.0 / (1.0 - bubble)
    } else {
        1.0
    };
    // A calibrated call cost includes the link's latency; uncalibrated, the latency alone.
    let call = if job.collective > 0.0 {
        job.collective
    } else {
        link.latency
    };
    let value = if job.value > 0.0 { job.value } else { call };
    let communication_of = |t: &TaskWork| {
        let bytes = (t.collective_bytes + t.data_plane_bytes) as f64;
        t.collective_messages as f64 * call
            + (t.values + t.received) as f64 * value
            + bytes / link.bandwidth
            + bytes * job.transfer_per_byte
    };
    let busiest = work.iter().map(cpu_of).fold(0.0, f64::max) * stretch;
    let communication = work.iter().map(communication_of).fold(0.0, f64::max);
    // Tasks beyond the cores share them: their computing and their calls' handshakes and
    // wake-ups alike, and each wait's spin and switches.
    let beyond = beyond_cores(work.len(), cores);
    let shared = work
        .iter()
        .map(|t| {
            cpu_of(t)
                + communication_of(t)
                + beyond
                    * (waits(t) as f64 * job.beyond_cores
                        + t.product_flops as f64 * job.beyond_cores_per_flop)
        })
        .sum::<f64>()
        / cores.max(1) as f64;
    let ops = work
        .iter()
        .map(|t| task_dispatch(t, &job))
        .fold(0.0, f64::max);
    let computes = work.iter().map(compute_of).fold(0.0, f64::max) * stretch;
    JobStep {
        step: job.step + work.len() as f64 * job.task,
        compute: computes,
        ops,
        cpu: busiest.max(shared - communication),
        communication,
    }
}

/// 1 when `tasks` outnumber the host's `cores` (each wait then costs the cores
/// `job.beyond_cores` more), else 0.
fn beyond_cores(tasks: usize, cores: usize) -> f64 {
    if tasks > cores.max(1) {
        1.0
    } else {
        0.0
    }
}

/// The waits of a task on the step's path: the values it sends and receives and its
/// collective messages between two computations. Beyond the cores each may find its peer
/// without a core: the woken thread waits for one.
fn waits(t: &TaskWork) -> usize {
    t.values + t.received + t.path_messages.min(t.collective_messages)
}

/// The unknowns `dflow bench calibrate` fits, in the order of [`JobTerms::counts`]: the
/// [`JobCosts`] as seconds per unit of work (a rate as its inverse).
pub const JOB_UNKNOWNS: [&str; JOB_COSTS] = [
    "step",
    "task",
    "op",
    "collective",
    "value",
    "product",
    "beyond the cores, per wait",
    "spawn",
    "seconds per product FLOP beyond the cores",
    "seconds per product FLOP",
    "seconds per byte",
    "seconds per transcendental element",
    "seconds per byte sent beyond the link's 1/β",
];

/// How many costs [`JOB_UNKNOWNS`] names.
pub const JOB_COSTS: usize = 13;

impl JobCosts {
    /// The costs as the unknowns of [`JOB_UNKNOWNS`] (a rate of 0, not modelled, as 0 s).
    pub fn unknowns(&self) -> [f64; JOB_COSTS] {
        let inverse = |r: f64| if r > 0.0 { 1.0 / r } else { 0.0 };
        [
            self.step,
            self.task,
            self.op,
            self.collective,
            self.value,
            self.product,
            self.beyond_cores,
            self.spawn,
            self.beyond_cores_per_flop,
            inverse(self.flops_per_second),
            inverse(self.bytes_per_second),
            inverse(self.transcendentals_per_second),
            self.transfer_per_byte,
        ]
    }

    /// The costs from the unknowns of [`JOB_UNKNOWNS`] (0 s per unit: a rate of 0, which the
    /// model reads as not modelled).
    pub fn from_unknowns(x: &[f64; JOB_COSTS]) -> JobCosts {
        let rate = |s: f64| if s > 0.0 { 1.0 / s } else { 0.0 };
        JobCosts {
            step: x[0],
            task: x[1],
            op: x[2],
            collective: x[3],
            value: x[4],
            product: x[5],
            beyond_cores: x[6],
            spawn: x[7],
            beyond_cores_per_flop: x[8],
            flops_per_second: rate(x[9]),
            bytes_per_second: rate(x[10]),
            transcendentals_per_second: rate(x[11]),
            transfer_per_byte: x[12],
        }
    }
}

/// A job's step as a linear function of the [`JOB_UNKNOWNS`]: `fixed + counts · unknowns`
/// equals [`job_step`]'s total for a calibrated profile (its `value` cost given) whose costs
/// chose the same busiest task, the same branch of `max(busiest, Σ / cores)` and the same
/// busiest communicator.
#[derive(Clone, Debug, PartialEq)]
pub struct JobTerms {
    /// The work multiplying each unknown: 1 step, the tasks, the busiest task's nodes,
    /// collective messages and sent and received values (or all tasks' over the cores, with the bubble's stretch
    /// on the nodes), its products' FLOPs, its other ops' bytes, its transcendental elements.
    pub counts: [f64; JOB_COSTS],
    /// Seconds not depending on the unknowns: the busiest communicator's bytes over β (or all
    /// tasks' over the cores).
    pub fixed: f64,
}

/// The [`JobTerms`] of a job doing `work` with pipeline bubble `bubble` on a host of `cores`
/// cores over `link`, linearised at the costs `job` (which decide the busiest task and the
/// branches of the maxima, as [`job_step`] does).
pub fn job_terms(
    work: &[TaskWork],
    bubble: f64,
    cores: usize,
    link: Link,
    job: &JobCosts,
) -> JobTerms {
    let x = job.unknowns();
    let cpu_counts = |t: &TaskWork| {
        [
            0.0,
            0.0,
            t.ops as f64,
            0.0,
            0.0,
            t.products as f64,
            0.0,
            t.spawns as f64,
            0.0,
            t.product_flops as f64,
            t.bytes as f64,
            t.transcendentals as f64,
            0.0,
        ]
    };
    // A task's communication: its calls, its values, and its bytes over β (fixed).
    let communication = |t: &TaskWork| {
        let mut c = [0.0; JOB_COSTS];
        c[3] = t.collective_messages as f64;
        c[4] = (t.values + t.received) as f64;
        c[12] = (t.collective_bytes + t.data_plane_bytes) as f64;
        (
            c,
            (t.collective_bytes + t.data_plane_bytes) as f64 / link.bandwidth,
        )
    };
    let value = |c: &[f64; JOB_COSTS], fixed: f64| {
        fixed + c.iter().zip(&x).map(|(a, b)| a * b).sum::<f64>()
    };
    let stretch = if bubble > 0.0 && bubble < 1.0 {
        1.0 / (1.0 - bubble)
    } else {
        1.0
    };
    let busiest_cpu = work
        .iter()
        .map(cpu_counts)
        .max_by(|a, b| value(a, 0.0).total_cmp(&value(b, 0.0)))
        .unwrap_or_default()
        .map(|c| c * stretch);
    let (busiest_comm, comm_fixed) = work
        .iter()
        .map(communication)
        .max_by(|a, b| value(&a.0, a.1).total_cmp(&value(&b.0, b.1)))
        .unwrap_or_default();
    let mut busiest = busiest_cpu;
    for (b, c) in busiest.iter_mut().zip(busiest_comm) {
        *b += c;
    }
    let mut shared = [0.0; JOB_COSTS];
    let mut shared_fixed = 0.0;
    let beyond = beyond_cores(work.len(), cores);
    for t in work {
        let (comm, fixed) = communication(t);
        for ((s, c), m) in shared.iter_mut().zip(cpu_counts(t)).zip(comm) {
            *s += (c + m) / cores.max(1) as f64;
        }
        shared[6] += beyond * waits(t) as f64 / cores.max(1) as f64;
        shared[8] += beyond * t.product_flops as f64 / cores.max(1) as f64;
        shared_fixed += fixed / cores.max(1) as f64;
    }
    let (mut counts, fixed) = if value(&busiest, comm_fixed) >= value(&shared, shared_fixed) {
        (busiest, comm_fixed)
    } else {
        (shared, shared_fixed)
    };
    counts[0] = 1.0;
    counts[1] = work.len() as f64;
    JobTerms { counts, fixed }
}

/// One measured calibration job: what each task does in a step (its job plan's
/// [`work`]), its pipeline bubble and its measured step.
#[derive(Clone, Debug, PartialEq)]
pub struct CalibrationJob {
    /// A name for reports.
    pub name: String,
    /// Each task's work in a step.
    pub work: Vec<TaskWork>,
    /// The pipeline bubble fraction (0 without a pipeline).
    pub bubble: f64,
    /// The measured step in seconds.
    pub seconds: f64,
}

/// The [`JobCosts`] that best explain `jobs` (non-negative least squares on relative errors,
/// [`super::fit`]) on a host of `cores` cores over `link`. The model is linear in the costs
/// once the busiest task and the branches of its maxima are chosen: they are chosen at
/// `start`, then again at each fit's costs until they stop changing (at most 8 fits). Returns
/// the costs and the last fit (each job's relative error).
pub fn fit_job_costs(
    jobs: &[CalibrationJob],
    cores: usize,
    link: Link,
    start: &JobCosts,
) -> Result<(JobCosts, super::fit::Fit), super::fit::FitError> {
    let mut costs = *start;
    let mut last: Option<Vec<super::fit::Observation>> = None;
    let mut result = None;
    for _ in 0..8 {
        let obs: Vec<super::fit::Observation> = jobs
            .iter()
            .map(|j| {
                let t = job_terms(&j.work, j.bubble, cores, link, &costs);
                super::fit::Observation {
                    name: j.name.clone(),
                    counts: t.counts.to_vec(),
                    fixed: t.fixed,
                    seconds: j.seconds,
                }
            })
            .collect();
        if last.as_ref() == Some(&obs) {
            break;
        }
        let f = super::fit::fit(&obs, &JOB_UNKNOWNS)?;
        let mut x = [0.0; JOB_COSTS];
        x.copy_from_slice(&f.costs);
        costs = JobCosts::from_unknowns(&x);
        result = Some(f);
        last = Some(obs);
    }
    match result {
        Some(f) => Ok((costs, f)),
        None => Err(super::fit::FitError::TooFew {
            observations: 0,
            unknowns: JOB_UNKNOWNS.len(),
        }),
    }
}

/// The step of `plan` (the job plan of `e`'s layout, fed `rows` rows a replica) on `profile`,
/// its tasks sharing `profile.devices_per_host` cores per host.
pub fn predict(
    plan: &JobPlan,
    rows: usize,
    e: &Evaluation,
    profile: &ClusterProfile,
) -> Result<JobStep, AccountingError> {
    let work = work(plan, rows)?;
    // Without per-op-kind rates, the analytical compute (at the job's FLOP/s where the profile
    // has one), its bubble included.
    Ok(job_step(
        &work,
        e.time.compute + e.time.bubble,
        e.bubble,
        profile,
        profile.devices_per_host,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(ops: usize, calls: usize) -> TaskWork {
        TaskWork {
            task: format!("t{ops}"),
            ops,
            collective_calls: calls,
            collective_messages: calls,
            ..TaskWork::default()
        }
    }

    fn costs() -> ClusterProfile {
        let mut p = ClusterProfile::preset("this-machine").unwrap();
        p.intra_host.latency = 0.0;
        p.job = JobCosts {
            step: 100e-6,
            op: 1e-6,
            collective: 10e-6,
            ..JobCosts::default()
        };
        p
    }

    #[test]
    fn a_step_is_the_fixed_cost_the_busiest_task_and_its_calls() {
        let mut p = costs();
        let s = job_step(&[task(50, 2), task(40, 3)], 5e-6, 0.0, &p, 2);
        assert!((s.cpu - 55e-6).abs() < 1e-12, "{s:?}");
        assert!((s.communication - 30e-6).abs() < 1e-12, "{s:?}");
        assert!((s.total() - 185e-6).abs() < 1e-12, "{s:?}");
        // Uncalibrated, a call costs the link's latency.
        p.job.collective = 0.0;
        p.intra_host.latency = 2e-6;
        let s = job_step(&[task(50, 2), task(40, 3)], 5e-6, 0.0, &p, 2);
        assert!((s.communication - 6e-6).abs() < 1e-12, "{s:?}");
    }

    /// A calibrated profile: every cost and rate set.
    fn calibrated() -> ClusterProfile {
        let mut p = costs();
        p.job = JobCosts {
            step: 150e-6,
            task: 12e-6,
            op: 0.2e-6,
            collective: 15e-6,
            value: 25e-6,
            product: 0.8e-6,
            beyond_cores: 3e-6,
            spawn: 1.5e-6,
            beyond_cores_per_flop: 5e-12,
            transfer_per_byte: 0.3e-9,
            flops_per_second: 50e9,
            bytes_per_second: 12e9,
            transcendentals_per_second: 150e6,
        };
        p
    }

    /// `tasks` tasks doing the same work.
    fn job(
        tasks: usize,
        ops: usize,
        calls: usize,
        flops: u64,
        bytes: u64,
        tanh: u64,
    ) -> Vec<TaskWork> {
        (0..tasks)
            .map(|i| TaskWork {
                task: format!("t{i}"),
                ops,
                product_flops: flops,
                bytes,
                transcendentals: tanh,
                collective_calls: calls,
                collective_messages: calls,
                collective_bytes: 4096,
                ..TaskWork::default()
            })
            .collect()
    }

    /// Synthetic calibration jobs like `dflow bench calibrate`'s: 2 and 4 tasks, many ops,
    /// many calls, products, bytes, transcendentals, and a pipeline's sends.
    fn synthetic_jobs() -> Vec<(String, Vec<TaskWork>, f64)> {
        let mut pipeline = job(2, 120, 0, 1_000_000, 200_000, 0);
        pipeline[0].values = 8;
        pipeline[1].received = 8;
        pipeline[1].values = 8;
        pipeline[0].received = 8;
        let mut longer = job(2, 200, 0, 1_500_000, 300_000, 0);
        for t in &mut longer {
            t.values = 16;
            t.received = 16;
        }
        vec![
            ("base".into(), job(2, 40, 2, 10_000, 20_000, 0), 0.0),
            ("chain".into(), job(2, 1640, 2, 10_000, 300_000, 0), 0.0),
            ("calls".into(), job(2, 200, 26, 40_000, 60_000, 0), 0.0),
            ("wide".into(), job(2, 60, 2, 200_000_000, 3_000_000, 0), 0.0),
            (
                "bytes".into(),
                job(2, 100, 2, 2_000_000, 50_000_000, 0),
                0.0,
            ),
            (
                "gelu".into(),
                job(2, 60, 2, 2_000_000, 4_000_000, 1_000_000),
                0.0,
            ),
            ("base x4".into(), job(4, 40, 2, 10_000, 20_000, 0), 0.0),
            ("chain x4".into(), job(4, 1640, 2, 10_000, 300_000, 0), 0.0),
            ("pipeline".into(), pipeline, 0.2),
            ("pipeline m8".into(), longer, 1.0 / 9.0),
            ("deep".into(), job(2, 300, 12, 3_000_000, 500_000, 0), 0.0),
            (
                "deep x4".into(),
                job(4, 300, 12, 3_000_000, 500_000, 0),
                0.0,
            ),
            (
                "wide x4".into(),
                job(4, 60, 2, 100_000_000, 1_500_000, 0),
                0.0,
            ),
            (
                "wide calls".into(),
                job(2, 80, 6, 50_000_000, 1_000_000, 0),
                0.0,
            ),
            (
                "fan-outs".into(),
                job(2, 400, 4, 1_000_000, 2_000_000, 10_000),
                0.0,
            ),
            (
                "mixed".into(),
                job(2, 90, 3, 20_000_000, 8_000_000, 2_000_000),
                0.0,
            ),
            (
                "gradient bytes".into(),
                job(2, 50, 2, 800_000, 900_000, 0),
                0.0,
            ),
        ]
        .into_iter()
        .map(|(name, mut work, bubble): (String, Vec<TaskWork>, f64)| {
            // Matrix products, not a function of the other counts.
            let products = match name.as_str() {
                "calls" => 48,
                "wide" | "wide x4" => 6,
                "bytes" | "gelu" => 4,
                "pipeline" => 12,
                "pipeline m8" => 24,
                "deep" | "deep x4" => 36,
                _ => 2,
            };
            // Nodes spawned alone: fan-outs, not a function of the other counts.
            let spawns = match name.as_str() {
                "calls" => 30,
                "deep" | "deep x4" => 18,
                "wide calls" => 9,
                "pipeline m8" => 5,
                "fan-outs" => 120,
                _ => 1,
            };
            // Calls between two computations (tensor parallelism's).
            let path = match name.as_str() {
                "deep" | "deep x4" => 8,
                "fan-outs" => 2,
                _ => 0,
            };
            // Bytes sent: a gradient all-reduce's, not a function of the other counts.
            let sent = match name.as_str() {
                "gradient bytes" => 1_100_000,
                "wide" | "wide x4" => 800_000,
                "mixed" => 300_000,
                "deep" | "deep x4" => 60_000,
                "pipeline" | "pipeline m8" => 20_000,
                _ => 4_000,
            };
            for t in &mut work {
                t.products = products;
                t.spawns = spawns;
                t.path_messages = path;
                t.collective_bytes = sent;
            }
            (name, work, bubble)
        })
        .collect()
    }

    /// A fan-out of `k` expensive nodes spawns `k − 1`; a chain spawns none, nor a node whose
    /// other consumer waits for a later input; nodes the executor batches (static and small)
    /// spawn nothing.
    #[test]
    fn a_fan_out_of_expensive_nodes_spawns_all_but_one() {
        use dflow_graph::builder::GraphBuilder;
        use dflow_graph::DType;
        let graph = |batch: i64| {
            let mut b = GraphBuilder::new();
            let x = b.placeholder("x", DType::F32, &[batch, 8]);
            let y: Vec<_> = (0..3)
                .map(|i| b.op("Neg", &format!("y{i}")).input(&x).finish())
                .collect();
            // A chain behind the first: no spawn.
            let z = b.op("Neg", "z").input(&y[0]).finish();
            let w = b.op("Neg", "w").input(&z).finish();
            // Read by z's chain and, later, beside w: readied by w, not by y1.
            b.op("Add", "late").input(&y[1]).input(&w).finish();
            b.build().unwrap()
        };
        assert_eq!(spawns(&graph(-1)), 2);
        assert_eq!(spawns(&graph(4)), 0);
    }

    #[test]
    fn the_linear_terms_give_the_step() {
        let p = calibrated();
        let x = p.job.unknowns();
        for (name, work, bubble) in synthetic_jobs() {
            let s = job_step(&work, 0.0, bubble, &p, 2);
            let t = job_terms(&work, bubble, 2, p.intra_host, &p.job);
            let linear = t.fixed + t.counts.iter().zip(&x).map(|(a, b)| a * b).sum::<f64>();
            assert!(
                (linear / s.total() - 1.0).abs() < 1e-12,
                "{name}: {linear} {s:?}"
            );
        }
        assert_eq!(JobCosts::from_unknowns(&x), p.job);
    }

    #[test]
    fn the_fit_recovers_the_costs_that_made_the_steps() {
        let p = calibrated();
        let jobs: Vec<CalibrationJob> = synthetic_jobs()
            .into_iter()
            .map(|(name, work, bubble)| CalibrationJob {
                seconds: job_step(&work, 0.0, bubble, &p, 2).total(),
                name,
                work,
                bubble,
            })
            .collect();
        // Started far from the truth: the busiest task and branches are chosen again.
        let start = JobCosts {
            step: 1e-3,
            op: 1e-6,
            collective: 1e-6,
            flops_per_second: 1e9,
            bytes_per_second: 1e9,
            transcendentals_per_second: 1e9,
            ..JobCosts::default()
        };
        let (got, f) = fit_job_costs(&jobs, 2, p.intra_host, &start).unwrap();
        for (a, b) in got.unknowns().iter().zip(p.job.unknowns()) {
            assert!((a / b - 1.0).abs() < 1e-6, "{got:?} {:?}", p.job);
        }
        assert!(f.relative_errors.iter().all(|e| e.abs() < 1e-9), "{f:?}");
        // Without the 4-task jobs the per-task cost is the per-step cost times a constant, and
        // no wait is beyond the cores.
        let two: Vec<CalibrationJob> = jobs
            .into_iter()
            .filter(|j| !j.name.contains("x4"))
            .collect();
        let e = fit_job_costs(&two, 2, p.intra_host, &start).unwrap_err();
        assert!(
            matches!(&e, crate::planner::fit::FitError::Collinear { unknown }
                if unknown == "task" || unknown == JOB_UNKNOWNS[6]),
            "{e:?}"
        );
    }

    #[test]
    fn a_pipeline_pays_for_its_sends_and_receives() {
        let p = costs();
        let mut first = task(10, 0);
        first.values = 4;
        first.received = 4;
        let s = job_step(&[first.clone()], 0.0, 0.0, &p, 2);
        assert!((s.communication - 80e-6).abs() < 1e-12, "{s:?}");
        // With its own cost a value is priced apart from the calls.
        let mut p = p;
        p.job.value = 3e-6;
        first.collective_calls = 1;
        first.collective_messages = 1;
        let s = job_step(&[first], 0.0, 0.0, &p, 2);
        assert!((s.communication - 34e-6).abs() < 1e-12, "{s:?}");
    }

    #[test]
    fn tasks_beyond_the_cores_share_them() {
        let p = costs();
        let two = job_step(&[task(50, 0), task(50, 0)], 0.0, 0.0, &p, 2);
        assert!((two.cpu - 50e-6).abs() < 1e-12, "{two:?}");
        // Four tasks on two cores take twice as long as two; on four cores, as long.
        let four = [task(50, 0), task(50, 0), task(50, 0), task(50, 0)];
        let s = job_step(&four, 0.0, 0.0, &p, 2);
        assert!((s.cpu - 100e-6).abs() < 1e-12, "{s:?}");
        let s = job_step(&four, 0.0, 0.0, &p, 4);
        assert!((s.cpu - 50e-6).abs() < 1e-12, "{s:?}");
        // Uneven tasks: the busiest when it outweighs the share.
        let s = job_step(&[task(300, 0), task(10, 0), task(10, 0)], 0.0, 0.0, &p, 2);
        assert!((s.cpu - 300e-6).abs() < 1e-12, "{s:?}");
    }

    #[test]
    fn tasks_beyond_the_cores_share_them_for_their_calls_too() {
        let p = costs();
        // Two tasks on two cores: 50 µs of ops and 2 calls of 10 µs each.
        let two = job_step(&[task(50, 2), task(50, 2)], 0.0, 0.0, &p, 2);
        assert!(
            (two.cpu + two.communication - 70e-6).abs() < 1e-12,
            "{two:?}"
        );
        // Four on two cores: every task's ops and calls over the cores, twice two's.
        let four = [task(50, 2), task(50, 2), task(50, 2), task(50, 2)];
        let s = job_step(&four, 0.0, 0.0, &p, 2);
        assert!((s.cpu + s.communication - 140e-6).abs() < 1e-12, "{s:?}");
        assert!((s.communication - 20e-6).abs() < 1e-12, "{s:?}");
        // The linear terms agree on that branch.
        let mut c = calibrated();
        c.job.value = 25e-6;
        let s = job_step(&four, 0.0, 0.0, &c, 2);
        let t = job_terms(&four, 0.0, 2, c.intra_host, &c.job);
        let x = c.job.unknowns();
        let linear = t.fixed + t.counts.iter().zip(&x).map(|(a, b)| a * b).sum::<f64>();
        assert!((linear / s.total() - 1.0).abs() < 1e-12, "{linear} {s:?}");
        assert_eq!(t.counts[3], 4.0 * 2.0 / 2.0, "{t:?}");
    }

    #[test]
    fn products_are_priced_by_flops_and_the_rest_by_bytes() {
        let mut p = costs();
        let mut t = task(0, 0);
        t.product_flops = 2_000_000_000;
        t.bytes = 500_000_000;
        // Without a bytes/s the analytical compute stands.
        assert_eq!(task_compute(&t, &p.job, p.flops_per_second), None);
        let s = job_step(&[t.clone()], 7e-3, 0.0, &p, 2);
        assert!((s.compute - 7e-3).abs() < 1e-12, "{s:?}");
        p.job.flops_per_second = 20e9;
        p.job.bytes_per_second = 5e9;
        // 2 GFLOP at 20 GFLOP/s and 0.5 GB at 5 GB/s.
        let c = task_compute(&t, &p.job, p.flops_per_second).unwrap();
        assert!((c - 0.2).abs() < 1e-12, "{c}");
        let s = job_step(&[t.clone()], 7e-3, 0.0, &p, 2);
        assert!((s.compute - 0.2).abs() < 1e-12, "{s:?}");
        // No job FLOP/s: the profile's lone MatMul rate.
        p.job.flops_per_second = 0.0;
        let c = task_compute(&t, &p.job, 40e9).unwrap();
        assert!((c - 0.15).abs() < 1e-12, "{c}");
        // A pipeline's bubble stretches its tasks' work: a bubble of 1/5 makes 0.2 s 0.25 s.
        p.job.flops_per_second = 20e9;
        let s = job_step(&[t], 0.0, 0.2, &p, 2);
        assert!((s.compute - 0.25).abs() < 1e-12, "{s:?}");
        assert!((s.cpu - 0.25).abs() < 1e-12, "{s:?}");
    }

    #[test]
    fn the_gpt_work_counts_products_and_bytes() {
        use crate::planner::accounting::job_plan;
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/gpt/gpt.json"
        ))
        .unwrap();
        let def = dflow_graph::format::parse_json(&text, None).unwrap().def;
        let graph = Graph::from_def(&def).unwrap();
        let train = def.train.as_ref().unwrap();
        let dp = job_plan(
            &graph,
            train,
            "idx",
            "targets",
            &"dp=2".parse().unwrap(),
            12,
        );
        let tp = job_plan(
            &graph,
            train,
            "idx",
            "targets",
            &"tp=2".parse().unwrap(),
            12,
        );
        let (dp, tp) = (dp.unwrap(), tp.unwrap());
        let dp = work(&dp, 6).unwrap();
        let tp = work(&tp, 12).unwrap();
        assert_eq!((dp.len(), tp.len()), (2, 2));
        // dp=2: half the rows a task, the same products; tp=2: all the rows, half of each
        // split product. Either way each task does about half of the step's product FLOPs.
        let ratio = dp[0].product_flops as f64 / tp[0].product_flops as f64;
        assert!((0.8..1.25).contains(&ratio), "{ratio} {dp:?} {tp:?}");
        assert!(dp[0].bytes > 0 && dp[0].ops > 0);
        // Every matrix product of a dp task's partition, forward and backward: the product
        // nodes of its training graph.
        let dp_plan = job_plan(
            &graph,
            train,
            "idx",
            "targets",
            &"dp=2".parse().unwrap(),
            12,
        )
        .unwrap();
        let product_nodes: usize = dp_plan
            .train_signatures()
            .flat_map(|s| s.partitions.partitions.iter())
            .filter(|(d, _)| d.task_name().as_deref() == Some(dp[0].task.as_str()))
            .map(|(_, p)| {
                p.graph
                    .node_indices()
                    .filter(|&i| PRODUCTS.contains(&p.graph.node(i).op))
                    .count()
            })
            .sum();
        assert_eq!(dp[0].products, product_nodes, "{dp:?}");
        assert!(dp[0].products > 4 * 4, "{dp:?}");
        // Half the rows, the whole optimizer: a dp task's bytes are of the order of a tp
        // task's (each `FlatSlice` of the fused gradient bucket reads its own slice, not the
        // whole 3.2 MB bucket).
        let bytes = dp[0].bytes as f64 / tp[0].bytes as f64;
        assert!((0.5..1.5).contains(&bytes), "{bytes} {dp:?} {tp:?}");
        // Each task's GELUs and their gradients: 4 blocks of [6 × 64, 512] (dp) or
        // [12 × 64, 256] (tp) elements, each evaluated forward and again in its gradient.
        assert_eq!(dp[0].transcendentals, 2 * 4 * 6 * 64 * 512, "{dp:?}");
        // tp adds the vocabulary-parallel cross-entropy's `Exp` over its half of the 76 logits
        // of each of its 12 × 64 tokens and a `Log` of each token's sum.
        let extra = tp[0].transcendentals - dp[0].transcendentals;
        assert_eq!(extra, 12 * 64 * (76 / 2 + 1), "{tp:?}");
    }

    #[test]
    fn a_pipeline_stage_receives_what_the_other_sends() {
        use crate::planner::accounting::job_plan;
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/digits/digits.json"
        ))
        .unwrap();
        let def = dflow_graph::format::parse_json(&text, None).unwrap().def;
        let graph = Graph::from_def(&def).unwrap();
        let train = def.train.as_ref().unwrap();
        let layout = "pp=2,m=4".parse().unwrap();
        let plan = job_plan(&graph, train, "pixels", "labels", &layout, 32).unwrap();
        let w = work(&plan, 32).unwrap();
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].values > 0 && w[1].values > 0, "{w:?}");
        assert_eq!(w[0].received, w[1].values, "{w:?}");
        assert_eq!(w[1].received, w[0].values, "{w:?}");
    }
}
