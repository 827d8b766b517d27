//! Memory as dflow's executor accounts it, predicted from the job plan a layout runs as.
//!
//! The analytical model ([`super::evaluate`]) counts model states and stashed activations the
//! way the ZeRO and Megatron papers do; a task of a real dflow job holds something more exact:
//! its variables (weights and optimizer slots, sharded as the strategy shards them), and step
//! tensors — every value a step produces, from its producer until its last reader finishes
//! (executor `memory.rs`: once per value, not when it shares an input's buffer — a reshape, an
//! identity — nor a variable's value; a value nobody reads stays until the step ends).
//!
//! [`job_plan`] builds the plan `dflow run` would run for a layout (the same strategies: all-reduce,
//! ZeRO, pipeline, tensor), and [`account`] runs each task's training partition through a
//! model of the executor's scheduler (its runners, stacks, held-back decrements and pool;
//! every node one tick), counting what the executor's meter counts. With one compute thread the
//! order is the executor's own and the count is exact (a task pinned to one CPU reports these
//! bytes); with more threads the ready nodes run in orders that vary from run to run, and a
//! measured peak varies around the one-thread count (docs/planner.md gives the spread).

use super::collective::{rank_bytes, rank_messages, Call};
use super::executor_order::run_order;
use super::layout::Layout;
use crate::strategy::{JobInput, JobPlan, StrategyKind, StrategyOptions};
use dflow_graph::train::TrainSpec;
use dflow_graph::{AttrValue, ClusterSpec, DeviceName, Graph, Shape};
use petgraph::graph::NodeIndex;
use std::collections::BTreeMap;

/// What one task holds, as the executor counts it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskMemory {
    /// The task (`/job:worker/replica:0/task:1`).
    pub task: String,
    /// Variables the task holds.
    pub variables: usize,
    /// Their bytes.
    pub variable_bytes: usize,
    /// The most bytes of step tensors held at once in one training step, in the order
    /// [`account`] runs it.
    pub peak_step_bytes: usize,
}

impl TaskMemory {
    /// Variables plus the step tensors' peak.
    pub fn total(&self) -> usize {
        self.variable_bytes + self.peak_step_bytes
    }
}

/// Why the accounting could not be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AccountingError {
    /// The layout has no strategy dflow runs.
    #[error("layout {layout}: {reason}")]
    NotRunnable {
        /// The layout.
        layout: String,
        /// Why.
        reason: String,
    },
    /// The strategy refused the model or the layout.
    #[error("layout {layout}: {message}")]
    Strategy {
        /// The layout.
        layout: String,
        /// The strategy.
        strategy: &'static str,
        /// Its error (naming the strategy).
        message: String,
    },
    /// A task's graph does not validate with the batch fixed.
    #[error("task {task}: its graph does not validate with a batch of {rows} rows:\n{message}")]
    Invalid {
        /// The task.
        task: String,
        /// The rows.
        rows: usize,
        /// The validation errors.
        message: String,
    },
    /// A tensor's size is not static with the batch fixed.
    #[error("task {task}: op `{node}` has no static shape with the batch fixed; the accounting needs every size")]
    NotStatic {
        /// The task.
        task: String,
        /// The op.
        node: String,
    },
}

/// The strategy `dflow run` runs `layout` with, and its options: expert parallelism when
/// `ep > 1` (over expert-parallel groups of `ep` workers, inside the stages when `pp > 1`; beside
/// `tp > 1` the tensor strategy with the experts over `ep` replicas, inside the stages too),
/// tensor parallelism when
/// `tp > 1` (beside a dp axis, inside the stages when `pp > 1`), a pipeline when `pp > 1`
/// alone, ZeRO at the layout's stage, else all-reduce.
pub fn strategy_for(
    layout: &Layout,
    batch: usize,
) -> Result<(StrategyKind, StrategyOptions), AccountingError> {
    let mesh = layout.mesh;
    let refuse = |reason: &str| AccountingError::NotRunnable {
        layout: layout.short(),
        reason: reason.to_string(),
    };
    let mut options = StrategyOptions {
        batch_size: Some(batch),
        ..StrategyOptions::default()
    };
    let name = if mesh.ep > 1 && mesh.tp > 1 {
        // ep beside tp (`--mesh dp=D,tp=T,ep=E`): the tensor strategy, the MoE layers
        // replicated over tp and their experts over ep; inside pipeline stages when pp > 1
        // (the 4-axis mesh `--mesh dp=D,tp=T,pp=P,ep=E`).
        if mesh.pp > 1 {
            options.stages = Some(mesh.pp);
            options.micro_batches = layout.micro_batches;
            options.schedule = layout.schedule;
            options.chunks = layout.chunks;
        }
        if layout.zero > 0 {
            // The strategy says which ZeRO stages run beside ep × tp.
            options.zero_stage = layout.zero;
            options.tensor_zero = true;
        }
        options.tp = Some(mesh.tp);
        options.ep = Some(mesh.ep);
        "tensor"
    } else if mesh.ep > 1 {
        if layout.zero > 3 {
            return Err(refuse(
                "expert parallelism runs over dp × ep (inside pipeline stages too) at ZeRO stages 0 to 3",
            ));
        }
        if mesh.pp > 1 {
            // Expert parallelism inside the pipeline's stages.
            options.stages = Some(mesh.pp);
            options.micro_batches = layout.micro_batches;
            options.schedule = layout.schedule;
            options.chunks = layout.chunks;
        }
        if layout.zero > 0 {
            // The dense states (ZeRO-3: and weights) over dp (each stage's replicas), each
            // expert shard's over its (stage's) expert-data-parallel group.
            options.zero_stage = layout.zero;
            options.tensor_zero = true;
        }
        options.ep = Some(mesh.ep);
        "expert"
    } else if mesh.tp > 1 {
        if layout.zero > 0 {
            // ZeRO over the dp axis beside tp (inside pipeline stages too): stages 1 to 3.
            if layout.zero > 3 || mesh.dp < 2 {
                return Err(refuse(
                    "ZeRO beside tensor parallelism runs at stages 1 to 3 over dp ≥ 2",
                ));
            }
            options.zero_stage = layout.zero;
            options.tensor_zero = true;
        }
        options.tp = Some(mesh.tp);
        if mesh.pp > 1 {
            // Tensor parallelism inside the pipeline's stages.
            options.stages = Some(mesh.pp);
            options.micro_batches = layout.micro_batches;
            options.schedule = layout.schedule;
            options.chunks = layout.chunks;
        }
        "tensor"
    } else if mesh.pp > 1 {
        if layout.zero > 0 {
            // ZeRO over each stage's replicas: stages 1 to 3, over dp ≥ 2.
            if layout.zero > 3 || mesh.dp < 2 {
                return Err(refuse(
                    "ZeRO over a pipeline's replicas runs at stages 1 to 3 over dp ≥ 2",
                ));
            }
            options.zero_stage = layout.zero;
            options.tensor_zero = true;
        }
        options.stages = Some(mesh.pp);
        options.micro_batches = layout.micro_batches;
        options.schedule = layout.schedule;
        options.chunks = layout.chunks;
        "pipeline"
    } else if layout.zero > 0 {
        options.zero_stage = layout.zero;
        "zero"
    } else {
        "allreduce"
    };
    let kind = name.parse().map_err(|e| refuse(&format!("{e}")))?;
    Ok((kind, options))
}

/// The job plan `dflow run` makes for `layout` of `graph` (trained by `train`, fed through
/// `features` and `labels`) on one worker per device.
pub fn job_plan(
    graph: &Graph,
    train: &TrainSpec,
    features: &str,
    labels: &str,
    layout: &Layout,
    batch: usize,
) -> Result<JobPlan, AccountingError> {
    let (kind, options) = strategy_for(layout, batch)?;
    let strategy_error = |message: String| AccountingError::Strategy {
        layout: layout.short(),
        strategy: kind.name(),
        message,
    };
    let workers = u32::try_from(layout.mesh.size()).map_err(|_| AccountingError::NotRunnable {
        layout: layout.short(),
        reason: "too many devices".into(),
    })?;
    let cluster =
        ClusterSpec::local(&[("worker", workers)]).map_err(|e| strategy_error(e.to_string()))?;
    let strategy = kind
        .build(&options)
        .map_err(|e| strategy_error(e.to_string()))?;
    let input = JobInput::new(graph, train, &cluster, features, labels);
    strategy
        .plan(&input)
        .map_err(|e| strategy_error(e.to_string()))
}

/// Ops whose kernel always returns its first input's buffer, reshaped or not.
const VIEWS: &[&str] = &[
    "Identity",
    "Reshape",
    "ReshapeLike",
    "ExpandDims",
    "Squeeze",
    "StopGradient",
    "CollectiveTpCopy",
];

/// Whether `idx`'s first output is its first input's buffer (the executor compares the data
/// pointers and does not count it again): the views, a slice of everything (`Slice`,
/// `FlatSlice` at offset 0), a `ReduceToShapeOf` to its own shape, a `Concat` or `AddN` of one
/// input, an identity `Transpose`, a `Dropout` of rate 0.
pub(super) fn shares_input(
    g: &Graph,
    idx: NodeIndex,
    bytes: usize,
    input_bytes: Option<usize>,
) -> bool {
    let node = g.node(idx);
    let Some(input_bytes) = input_bytes else {
        return false;
    };
    let whole = bytes == input_bytes;
    let data_inputs = g.inputs(idx).len();
    match node.op {
        op if VIEWS.contains(&op) => true,
        "Slice" | "ReduceToShapeOf" => whole,
        "AddN" => data_inputs == 1,
        "Concat" => data_inputs == 1,
        "FlatSlice" => whole && matches!(node.attr("offset"), Some(AttrValue::Int(0)) | None),
        "Transpose" => match node.attr("perm") {
            Some(AttrValue::IntList(p)) => p.iter().enumerate().all(|(i, &j)| j == i as i64),
            _ => false,
        },
        "Dropout" => match node.attr("rate") {
            Some(AttrValue::Float(r)) => r == 0.0,
            None => true,
            _ => false,
        },
        _ => false,
    }
}

/// `g` validated again with the unknown first dimension of every placeholder and received
/// tensor set to `rows` (the batch a task is fed), so that every size is known.
pub(super) fn with_rows(g: &Graph, rows: usize) -> Result<Graph, String> {
    let mut def = g.to_def();
    for n in def
        .nodes
        .iter_mut()
        .filter(|n| matches!(n.op.as_str(), "Placeholder" | "Recv"))
    {
        if let Some(AttrValue::Shape(s)) = n.attrs.get("shape") {
            if let Some(dims) = s.dims() {
                if let Some(None) = dims.first() {
                    let mut fixed = dims.to_vec();
                    fixed[0] = Some(rows);
                    n.attrs
                        .insert("shape".into(), AttrValue::Shape(Shape::partial(fixed)));
                }
            }
        }
    }
    Graph::from_def(&def).map_err(|e| e.to_string())
}

/// The executor's accounting of each task of `plan`'s training step, with `rows` rows where a
/// feed's batch dimension is unknown (a replica's rows: the global batch over `dp`).
pub fn account(
    plan: &JobPlan,
    rows: usize,
    threads: usize,
) -> Result<Vec<TaskMemory>, AccountingError> {
    let mut tasks: BTreeMap<String, TaskMemory> = BTreeMap::new();
    // A task drives the training signatures it is part of; the largest counts.
    for signature in plan.train_signatures() {
        let mut here: BTreeMap<String, TaskMemory> = BTreeMap::new();
        for (device, part) in &signature.partitions.partitions {
            let task = device.task_name().unwrap_or_else(|| device.to_string());
            let m = partition_memory(&task, &part.graph, rows, threads)?;
            let entry = here.entry(task.clone()).or_insert(TaskMemory {
                task,
                variables: 0,
                variable_bytes: 0,
                peak_step_bytes: 0,
            });
            entry.variables += m.variables;
            entry.variable_bytes += m.variable_bytes;
            entry.peak_step_bytes += m.peak_step_bytes;
        }
        for (task, m) in here {
            match tasks.get(&task) {
                Some(old) if old.total() >= m.total() => {}
                _ => {
                    tasks.insert(task, m);
                }
            }
        }
    }
    Ok(tasks.into_values().collect())
}

/// What one task sends in one training step, as the transport's counters count it (payload
/// bytes, headers not counted: the `sent N B in K values over the data plane, M B in J
/// collective messages` line a task prints when it ends).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskTraffic {
    /// The task.
    pub task: String,
    /// Bytes of the values it sends to other tasks' Recvs (Send/Recv pairs between tasks).
    pub data_plane: u64,
    /// Those values.
    pub values: usize,
    /// Bytes it sends in its collective groups, by the algorithm the transport runs.
    pub collective: u64,
    /// Collective calls it makes.
    pub collective_calls: usize,
    /// Messages it sends in them, by the algorithm the transport runs
    /// ([`super::collective::rank_messages`]: each a step with a peer).
    pub collective_messages: usize,
    /// Of those, the messages of calls between two computations ([`between_products`]: a
    /// tensor-parallel all-reduce, an MoE all-to-all), which the step waits on as a pipeline's
    /// stage waits on a value; not a gradient's all-reduce at the step's end, nor a ZeRO-3
    /// gather of a weight shard (its input is a variable: issued ahead of its use).
    pub path_messages: usize,
}

/// The matrix products: the computations a call on the step's path sits between.
const PRODUCTS: &[&str] = &["MatMul", "BatchMatMul"];

/// The nodes of `g` that read, through data edges, what a matrix product computed in the step
/// and whose result a later product reads: a collective among them waits for one
/// computation's result and holds up the next.
pub fn between_products(g: &Graph) -> Vec<bool> {
    let order = g.topo_order();
    let n = g.num_nodes();
    let is_product = |i: NodeIndex| PRODUCTS.contains(&g.node(i).op);
    let mut after = vec![false; n];
    for &i in &order {
        after[i.index()] = g
            .inputs(i)
            .iter()
            .any(|&(p, _)| after[p.index()] || is_product(p));
    }
    let mut before = vec![false; n];
    for &i in order.iter().rev() {
        before[i.index()] = g
            .out_edges(i)
            .iter()
            .filter(|(_, e)| matches!(e, dflow_graph::Edge::Data { .. }))
            .any(|&(c, _)| before[c.index()] || is_product(c));
    }
    after.iter().zip(&before).map(|(a, b)| *a && *b).collect()
}

/// The transport's call for a collective op of a job plan, if `op` communicates.
fn collective_call(g: &Graph, idx: NodeIndex) -> Option<Call> {
    let node = g.node(idx);
    match node.op {
        "CollectiveAllReduce" | "CollectiveTpReduce" => Some(Call::AllReduce),
        // The tensor-parallel placement changes (hand placements) send what their data-parallel
        // namesakes send on the same input; `CollectiveTpSlice` sends nothing.
        "CollectiveAllGather" | "CollectiveTpAllGather" => Some(Call::AllGather),
        "CollectiveReduceScatter" | "CollectiveTpReduceScatter" => Some(Call::ReduceScatter),
        "CollectiveAllToAll" | "CollectiveTpAllToAll" => Some(Call::AllToAll),
        "CollectiveBroadcast" => {
            let root = match node.attr("root") {
                Some(AttrValue::Int(r)) => usize::try_from(r).unwrap_or(0),
                _ => 0,
            };
            Some(Call::Broadcast { root })
        }
        // `CollectiveTpCopy` is the identity forward (its gradient is a `CollectiveTpReduce`).
        _ => None,
    }
}

/// What each task of `plan` sends in one training step (every training signature once, as a
/// lockstep step runs them), with `rows` rows where a feed's batch dimension is unknown (as
/// [`account`]): the Send/Recv pairs between tasks at their tensors' sizes, and each collective
/// op's bytes on this task's rank of its group by the algorithm dflow's transport runs
/// ([`rank_bytes`]). Exact by construction for a plan whose ops all run every step. Not
/// counted, as the task's counters do not count them per step: the feeds and fetches between
/// the chief's client and the tasks, and what a job sends once (the chief fetching sharded
/// variables at the end of the job).
pub fn traffic(plan: &JobPlan, rows: usize) -> Result<Vec<TaskTraffic>, AccountingError> {
    signatures_traffic(plan, plan.train_signatures(), rows)
}

/// What each task sends in one run of the evaluation signature (one evaluation batch of
/// `rows` rows), counted as [`traffic`] counts a training step: tensor parallelism's
/// evaluation, for one, copies the other ranks' weight shards to the chief.
pub fn eval_traffic(plan: &JobPlan, rows: usize) -> Result<Vec<TaskTraffic>, AccountingError> {
    signatures_traffic(plan, plan.eval_signature().into_iter(), rows)
}

fn signatures_traffic<'a>(
    plan: &JobPlan,
    signatures: impl Iterator<Item = &'a crate::job::Signature>,
    rows: usize,
) -> Result<Vec<TaskTraffic>, AccountingError> {
    let mut tasks: BTreeMap<String, TaskTraffic> = BTreeMap::new();
    let members: BTreeMap<&str, &[String]> = plan
        .groups
        .iter()
        .map(|g| (g.key.as_str(), g.members.as_slice()))
        .collect();
    for signature in signatures {
        for (device, part) in &signature.partitions.partitions {
            let task = device.task_name().unwrap_or_else(|| device.to_string());
            let fixed =
                with_rows(&part.graph, rows).map_err(|message| AccountingError::Invalid {
                    task: task.clone(),
                    rows,
                    message,
                })?;
            let g = &fixed;
            let on_path = between_products(g);
            let entry = tasks.entry(task.clone()).or_insert(TaskTraffic {
                task: task.clone(),
                data_plane: 0,
                values: 0,
                collective: 0,
                collective_calls: 0,
                collective_messages: 0,
                path_messages: 0,
            });
            for idx in g.node_indices() {
                let node = g.node(idx);
                let input_bytes = || -> Result<(usize, usize), AccountingError> {
                    let (s, k) = g.inputs(idx).first().copied().ok_or_else(|| {
                        AccountingError::NotStatic {
                            task: task.clone(),
                            node: node.name.clone(),
                        }
                    })?;
                    let t = &g.node(s).outputs[k];
                    let elements =
                        t.shape
                            .num_elements()
                            .ok_or_else(|| AccountingError::NotStatic {
                                task: task.clone(),
                                node: node.name.clone(),
                            })?;
                    Ok((elements, t.dtype.size_of()))
                };
                if node.op == "Send" {
                    if matches!(node.attr("client_terminated"), Some(AttrValue::Bool(true))) {
                        continue;
                    }
                    let to = match node.attr("recv_device") {
                        Some(AttrValue::String(d)) => {
                            DeviceName::parse(&d[..]).ok().and_then(|d| d.task_name())
                        }
                        _ => None,
                    };
                    if to.as_deref().is_some_and(|t| t != task) {
                        let (elements, size) = input_bytes()?;
                        entry.data_plane += (elements * size) as u64;
                        entry.values += 1;
                    }
                } else if let Some(call) = collective_call(g, idx) {
                    let group = match node.attr("group_key") {
                        Some(AttrValue::String(k)) => k.to_string(),
                        _ => String::new(),
                    };
                    let ranks = members.get(group.as_str()).copied().unwrap_or(&[]);
                    let rank = ranks.iter().position(|m| *m == task).ok_or_else(|| {
                        AccountingError::NotRunnable {
                            layout: plan.strategy.clone(),
                            reason: format!(
                                "task {task} runs collective `{}` of group `{group}` but is not one of its members {ranks:?}",
                                node.name
                            ),
                        }
                    })?;
                    let (elements, size) = input_bytes()?;
                    entry.collective += rank_bytes(call, ranks.len(), rank, elements, size);
                    entry.collective_calls += 1;
                    let messages = rank_messages(call, ranks.len(), rank, elements, size);
                    entry.collective_messages += messages;
                    if on_path[idx.index()] {
                        entry.path_messages += messages;
                    }
                }
            }
        }
    }
    Ok(tasks.into_values().collect())
}

/// The accounting of one partition `graph` of `task`.
fn partition_memory(
    task: &str,
    graph: &Graph,
    rows: usize,
    threads: usize,
) -> Result<TaskMemory, AccountingError> {
    let fixed = with_rows(graph, rows).map_err(|message| AccountingError::Invalid {
        task: task.to_string(),
        rows,
        message,
    })?;
    let g = &fixed;
    let not_static = |idx: NodeIndex| AccountingError::NotStatic {
        task: task.to_string(),
        node: g.node(idx).name.clone(),
    };
    let size = |idx: NodeIndex, k: usize| -> Result<usize, AccountingError> {
        let t = &g.node(idx).outputs[k];
        let dims = t.shape.dims().ok_or_else(|| not_static(idx))?;
        let elements = dims
            .iter()
            .map(|d| d.ok_or_else(|| not_static(idx)))
            .product::<Result<usize, _>>()?;
        Ok(elements * t.dtype.size_of())
    };
    let mut variables = 0;
    let mut variable_bytes = 0;
    for idx in g.node_indices() {
        if g.node(idx).op_def().is_variable {
            variables += 1;
            variable_bytes += size(idx, 0)?;
        }
    }
    // The executor decides what is cheap from the plan's own types (an unknown batch: not
    // cheap), so the order comes from `graph`, the sizes from `fixed`.
    let aligned = graph.num_nodes() == g.num_nodes()
        && graph
            .node_indices()
            .all(|i| graph.node(i).name == g.node(i).name);
    let order = run_order(if aligned { graph } else { g }, threads);
    Ok(TaskMemory {
        task: task.to_string(),
        variables,
        variable_bytes,
        peak_step_bytes: step_peak(g, &order, &size)?,
    })
}

/// The peak of one step's values in `g`, its nodes run in `order`.
fn step_peak(
    g: &Graph,
    order: &[NodeIndex],
    size: &dyn Fn(NodeIndex, usize) -> Result<usize, AccountingError>,
) -> Result<usize, AccountingError> {
    // Reads left per (node, output).
    let mut reads: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    for idx in g.node_indices() {
        for (s, k) in g.inputs(idx) {
            *reads.entry((s.index(), k)).or_default() += 1;
        }
    }
    let mut counted: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    let (mut live, mut peak) = (0usize, 0usize);
    for &idx in order {
        let node = g.node(idx);
        let op = node.op_def();
        let inputs = g.inputs(idx);
        let bound_constant =
            node.op == "Const" && inputs.is_empty() && g.control_inputs(idx).is_empty();
        if !(op.is_variable || node.op == "ReadVariable" || bound_constant) {
            let first_input = match inputs.first() {
                Some(&(s, k)) => Some(size(s, k)?),
                None => None,
            };
            for k in 0..node.outputs.len() {
                let bytes = size(idx, k)?;
                if k == 0 && shares_input(g, idx, bytes, first_input) {
                    continue;
                }
                counted.insert((idx.index(), k), bytes);
                live += bytes;
            }
            peak = peak.max(live);
        }
        for (s, k) in inputs {
            let key = (s.index(), k);
            if let Some(r) = reads.get_mut(&key) {
                *r -= 1;
                if *r == 0 {
                    if let Some(b) = counted.remove(&key) {
                        live -= b;
                    }
                }
            }
        }
    }
    Ok(peak)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::layers::gpt::{gpt, GptConfig};

    fn digits(file: &str) -> (Graph, TrainSpec) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/digits")
            .join(file);
        let text = std::fs::read_to_string(path).unwrap();
        let parsed = dflow_graph::format::parse_json(&text, None).unwrap();
        let train = parsed.def.train.clone().unwrap();
        (Graph::from_def(&parsed.def).unwrap(), train)
    }

    fn accounted(file: &str, layout: &str, batch: usize) -> Vec<TaskMemory> {
        let (g, t) = digits(file);
        let layout: Layout = layout.parse().unwrap();
        let plan = job_plan(&g, &t, "pixels", "labels", &layout, batch).unwrap();
        account(&plan, batch / layout.mesh.dp, 2).unwrap()
    }

    /// The digits MLP: 64·32 + 32 + 32·10 + 10 parameters.
    const PARAMS: usize = 2410;

    #[test]
    fn data_parallel_holds_the_weights_and_peaks_at_the_fused_gradients() {
        let tasks = accounted("digits.json", "dp=2", 32);
        assert_eq!(tasks.len(), 2);
        for t in &tasks {
            // SGD: the weights only.
            assert_eq!((t.variables, t.variable_bytes), (4, 4 * PARAMS), "{t:?}");
            // Every gradient and the bucket packed from them, plus the 4-byte loss.
            assert_eq!(t.peak_step_bytes, 2 * 4 * PARAMS + 4, "{t:?}");
        }
    }

    #[test]
    fn zero_shards_what_its_stage_says() {
        let adam = 3 * 4 * PARAMS; // weights and two moments
        let whole = accounted("digits-adamw.json", "dp=2", 32);
        let z1 = accounted("digits-adamw.json", "dp=2,zero=1", 32);
        let z3 = accounted("digits-adamw.json", "dp=2,zero=3", 32);
        // Plus the step count and its power terms: 8 bytes of scalars.
        assert_eq!(whole[0].variable_bytes, adam + 8);
        assert_eq!(z1[0].variable_bytes, 4 * PARAMS + 4 * PARAMS + 8);
        assert_eq!(z3[0].variable_bytes, 2 * PARAMS + 4 * PARAMS + 8);
        assert!(z1[0].peak_step_bytes > whole[0].peak_step_bytes, "{z1:?}");
    }

    #[test]
    fn a_pipeline_stage_holds_its_own_weights() {
        let tasks = accounted("digits.json", "pp=2,m=4", 32);
        let bytes: Vec<usize> = tasks.iter().map(|t| t.variable_bytes).collect();
        assert_eq!(bytes, [4 * 64 * 32, 4 * (32 + 32 * 10 + 10)]);
        assert!(tasks.iter().all(|t| t.peak_step_bytes > 0));
    }

    #[test]
    fn tensor_parallelism_splits_the_gpt() {
        let cfg = GptConfig {
            vocab_size: 76,
            block_size: 8,
            n_layer: 2,
            n_head: 4,
            n_embd: 32,
            ..GptConfig::default()
        };
        let def = gpt(&cfg).unwrap().def;
        let g = Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        let one = job_plan(&g, &train, "idx", "targets", &"dp=1".parse().unwrap(), 4).unwrap();
        let two = job_plan(&g, &train, "idx", "targets", &"tp=2".parse().unwrap(), 4).unwrap();
        let one = account(&one, 4, 2).unwrap();
        let two = account(&two, 4, 2).unwrap();
        assert_eq!((one.len(), two.len()), (1, 2));
        assert!(
            two[0].variable_bytes < one[0].variable_bytes,
            "{two:?} {one:?}"
        );
        assert!(two[0].total() < one[0].total(), "{two:?} {one:?}");
    }

    /// Tensor parallelism's all-reduces sit between two products (the step waits on them);
    /// data parallelism's gradient all-reduces and ZeRO-3's gathers of weight shards do not.
    #[test]
    fn only_calls_between_two_products_are_on_the_steps_path() {
        let cfg = GptConfig {
            vocab_size: 76,
            block_size: 8,
            n_layer: 2,
            n_head: 4,
            n_embd: 32,
            ..GptConfig::default()
        };
        let def = gpt(&cfg).unwrap().def;
        let g = Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        let traffic_of = |layout: &str| {
            let plan = job_plan(&g, &train, "idx", "targets", &layout.parse().unwrap(), 4).unwrap();
            traffic(&plan, 4).unwrap()
        };
        for t in traffic_of("tp=2") {
            // The blocks' f/g all-reduces and the split cross-entropy's, forward and backward;
            // not clipping's norm or the loss's report.
            assert!(t.path_messages >= 4 * cfg.n_layer, "{t:?}");
            assert!(t.path_messages < t.collective_messages, "{t:?}");
        }
        for layout in ["dp=2", "dp=2,zero=3"] {
            for t in traffic_of(layout) {
                assert!(t.collective_messages > 0, "{layout}: {t:?}");
                assert_eq!(t.path_messages, 0, "{layout}: {t:?}");
            }
        }
    }

    #[test]
    fn a_view_is_not_counted_again() {
        use dflow_graph::builder::GraphBuilder;
        use dflow_graph::DType;
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 8]);
        let y = b.op("Neg", "y").input(&x).finish();
        let r = b
            .op("Reshape", "r")
            .input(&y)
            .attr("shape", vec![32i64])
            .finish();
        b.op("Neg", "z").input(&r).finish();
        let g = b.build().unwrap();
        let size = |i: NodeIndex, k: usize| -> Result<usize, AccountingError> {
            Ok(g.node(i).outputs[k].byte_size().unwrap_or(0))
        };
        let order = run_order(&g, 1);
        // x (fed) 128 B, y 128 B, r shares y's buffer, z 128 B: x is released after y.
        assert_eq!(step_peak(&g, &order, &size).unwrap(), 256);
    }

    #[test]
    fn a_layout_dflow_cannot_run_is_refused_by_name() {
        let (g, t) = digits("digits.json");
        let e = job_plan(
            &g,
            &t,
            "pixels",
            "labels",
            &"tp=2,zero=1".parse().unwrap(),
            32,
        )
        .unwrap_err();
        assert!(e.to_string().contains("dp1 tp2 pp1 z1"), "{e}");
    }
}
