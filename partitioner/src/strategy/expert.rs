//! Expert parallelism (GShard, Switch Transformer) as a graph rewrite: data parallelism in which
//! each worker holds `E / N` of every mixture-of-experts layer's `E` experts, and tokens travel
//! to the worker of their expert and back by all-to-all.
//!
//! Worker `i` of `N` gets the all-reduce strategy's graph (its part of the global batch, the
//! loss weighted by its share, the non-expert gradients summed in buckets; see
//! [`super::allreduce`]) with each MoE layer rewritten:
//!
//! ```text
//!  x ─▶ MoeRoute ─▶ MoeDispatch [E, C, d] ─▶ AllToAll ─▶ [N, E/N, C, d] ─▶ transpose ─▶ [E/N, N·C, d]
//!                                                                               │ local experts
//!  y ◀─ MoeCombine ◀─ [E, C, d] ◀─ AllToAll ◀─ [N, E/N, C, d] ◀─ transpose ◀─ [E/N, N·C, d]
//! ```
//!
//! Block `j` of the dispatch buffer (experts `[j·E/N, (j+1)·E/N)`) goes to worker `j`, which runs
//! its experts on the `N·C` slots the workers sent it and returns each block to its sender. The
//! autodiff of the all-to-all is an all-to-all, so the backward pass mirrors the forward one:
//! two all-to-alls forward and two backward per MoE layer.
//!
//! - **Experts**: every variable feeding a layer's experts (between `MoeDispatch` and
//!   `MoeCombine`; its first dimension is `E`) becomes `<name>/shard_<i>` of `E/N` rows on worker
//!   `i`, initialized as those rows of the whole variable (`Variable`'s `shard_of`). Their
//!   gradients are not all-reduced: each expert lives on one worker, and its gradient already
//!   sums every worker's tokens (they came back through the all-to-all's gradient). The router
//!   and every other variable are replicated and all-reduced.
//! - **Capacity**: `MoeDispatch` sizes its buffer by the worker's own tokens,
//!   `C = ceil(tokens/E · capacity_factor)`. Every worker gets the same number of tokens per
//!   step (the global batch splits into equal parts; [`Expert`] refuses a batch size that does
//!   not divide by the worker count), so `C` is the same on every rank and the all-to-all's
//!   blocks agree: unequal routing can never make ranks disagree on sizes. Capacity is per worker, so
//!   when tokens are dropped the job drops other tokens than one process on the global batch
//!   would (one process fills `E · C_global` slots in batch order); with a capacity factor at
//!   which nothing drops (e.g. `E`), a job equals one process.
//! - **Load-balancing loss**: `MoeAuxLoss` reads all-gathered router probabilities and choices
//!   (an all-gather's gradient is a sum reduce-scatter), so every worker computes the global
//!   batch's auxiliary loss, like one process (the mean of per-worker losses would not be).
//! - **Order**: all collectives of a worker (forward all-to-alls and all-gathers, their
//!   gradients, the buckets, the loss) are chained by control edges in one topological order,
//!   the same on every worker.
//! - **Evaluation** (whole batches, no collective; `ep_eval`): with the batch size known, a
//!   copy of the forward graph named `eval/...` on worker 0 whose MoE layers send their
//!   dispatch buffer's blocks to the experts' ranks of expert group 0 and take the results
//!   back, so no expert weight leaves its worker; without it (`add_eval_copy`) the experts
//!   read the concatenation of all workers' shards, sent to worker 0 when it evaluates.
//!
//! - **Dropped tokens**: each worker sums its layers' `MoeRoute` `dropped` counts and an
//!   all-reduce (sum, after the loss's) gives the job's; the job fetches it every step
//!   ([`DROPPED_METRIC`] in [`ReplicaGraph::step_metrics`]) and the chief prints it.
//! - **Clipping** by global norm: the norm of the summed replicated gradients and of every
//!   worker's expert gradients (each worker's expert norm is all-gathered), the same on every
//!   worker, as one process's.
//!
//! - **Expert-parallel groups** (`--mesh dp=D,ep=E`, [`ExpertLayout`]): as in Megatron-core, the
//!   experts may be spread over runs of `ep` consecutive workers (an expert-parallel group;
//!   `ep` divides the worker count) instead of all of them. Everything above then happens
//!   inside each group — worker `i` holds shard `i mod ep` (`<name>/shard_<i mod ep>`, so
//!   the workers holding the same experts hold variables of the same name), and its
//!   all-to-alls run over its group — while the dense parameters stay data-parallel over every
//!   worker. The `N / ep` workers that hold the same shard (an expert-data-parallel group)
//!   sum its gradients by all-reduce before the update, so each expert's gradient counts every
//!   worker's tokens. `ep` = the worker count is the layout above.
//!
//! - **ZeRO** (`--zero-stage 1|2|3` beside `--mesh dp=D,ep=E`, [`Expert::zero`]): the dense
//!   parameters' Adam slots (stage 3: and the parameters, gathered just before each use)
//!   sharded over all the workers, each expert shard's over its expert-data-parallel group, by
//!   `--strategy zero`'s step and stage-3 rewrite (see [`zero`]); under ZeRO-3 the evaluation
//!   reads every dense parameter joined on worker 0 from its flat shards, and each expert
//!   shard joined on its rank.
//!
//! - **Pipeline stages** (`--mesh dp=D,ep=E,pp=P`, [`Expert::pipeline`]): each replica's
//!   graph cut into stages by the pipeline rewrite, the experts shared inside each stage's
//!   replicas (see [`pipeline`]); with `--zero-stage 1|2|3`, ZeRO over each stage's groups.
//!
//! Not supported: asynchronous training. Beside tensor
//! parallelism (`--mesh dp=D,tp=T,ep=E`) the tensor strategy runs the experts
//! ([`super::tensor::experts`], through `worker_forward`).

mod ep_eval;
pub(crate) mod eval;
pub mod pipeline;
pub mod zero;

use super::allreduce::{
    check_job, fresh, node, reduce_gradients, weighted_training, worker_device,
};
use super::{JobInput, JobPlan, Registration, ReplicaGraph, Strategy, StrategyError};
use crate::job::{CollectiveGroup, Schedule, VariablePlan};
use crate::mesh::{Axis, Mesh};
use crate::place::{PlacementOptions, Policy};
use crate::shards::ShardedVariable;
use dflow_graph::train::TrainSpec;
use dflow_graph::{AttrValue, Graph, GraphDef, InputRef, NodeDef, Shape};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The collective group of the workers (the all-reduce strategy's).
pub const GROUP: &str = super::allreduce::GROUP;

/// Instance keys of the forward collectives start here (the buckets count from 1).
const FIRST_INSTANCE: i64 = 1 << 20;

/// The instance key of the dropped-token count's all-reduce (after the buckets and the loss,
/// before the forward collectives' keys).
pub(crate) const DROPPED_INSTANCE: i64 = FIRST_INSTANCE - 1;

/// The name under which the chief reports the step's dropped token assignments
/// ([`ReplicaGraph::step_metrics`]).
pub const DROPPED_METRIC: &str = "moe/dropped";

/// Expert parallelism over all-to-all (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expert {
    /// All-reduce fusion threshold for the replicated gradients.
    pub bucket_bytes: usize,
    /// The global batch size, when known: it must divide by the worker count.
    pub batch_size: Option<usize>,
    /// The expert-parallel size (`--mesh ep=E`): the experts are spread over runs of `ep`
    /// consecutive workers ([`ExpertLayout`]); `None`: over all the workers.
    pub ep: Option<usize>,
    /// ZeRO's stage (1, 2 or 3) in place of the gradient all-reduces: the dense parameters' Adam
    /// slots (3: and weights) sharded over the workers, each expert shard's over its
    /// expert-data-parallel group ([`zero`]); `None`: no ZeRO.
    pub zero: Option<u8>,
    /// Pipeline stages (`--mesh dp=D,ep=E,pp=P`): the model cut into `P` stages, the experts
    /// shared inside each stage's replicas ([`pipeline`]; ZeRO stages 1 and 2 beside it);
    /// `None`: no pipeline.
    pub pipeline: Option<super::pipeline::Pipeline>,
}

/// How a job's workers share the experts: runs of `ep` consecutive workers (expert-parallel
/// groups) each hold one copy of every layer's experts, `E / ep` per worker; the workers at the
/// same position of every run (expert-data-parallel groups) hold the same experts. The groups
/// are [`Mesh::groups`]`(Axis::Ep)` and [`Mesh::expert_data_groups`] of the mesh `dp=workers,ep`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayout {
    /// The mesh: `dp` = the workers, `ep` = the expert-parallel size.
    pub mesh: Mesh,
}

impl ExpertLayout {
    /// `workers` sharing the experts in groups of `ep` (which must divide `workers`).
    pub fn new(workers: usize, ep: usize) -> Result<ExpertLayout, StrategyError> {
        let mesh = Mesh::new(workers, 1, 1)
            .and_then(|m| m.with_ep(ep))
            .map_err(|e| options(e.to_string()))?;
        Ok(ExpertLayout { mesh })
    }

    /// Every worker in one expert-parallel group (`--strategy expert`).
    pub fn all(workers: usize) -> Result<ExpertLayout, StrategyError> {
        ExpertLayout::new(workers, workers)
    }

    /// The workers.
    pub fn workers(&self) -> usize {
        self.mesh.dp
    }

    /// The expert-parallel size: the workers that share one copy of the experts.
    pub fn ep(&self) -> usize {
        self.mesh.ep
    }

    /// The expert shard that `worker` holds (its position in its expert-parallel group).
    pub fn shard(&self, worker: usize) -> usize {
        self.mesh.expert_rank(worker)
    }

    /// The collective group of `worker`'s all-to-alls: the workers' [`GROUP`] when one
    /// expert-parallel group holds them all, else `experts_ep<g>`.
    pub fn ep_group(&self, worker: usize) -> String {
        if self.ep() == self.workers() {
            GROUP.to_string()
        } else {
            format!("experts_ep{}", worker / self.ep())
        }
    }

    /// The collective group that sums `worker`'s expert gradients (`experts_dp<shard>`), or
    /// `None` when no other worker holds its experts.
    pub fn expert_data_group(&self, worker: usize) -> Option<String> {
        (self.ep() < self.workers()).then(|| format!("experts_dp{}", self.shard(worker)))
    }

    /// The collective groups besides [`GROUP`], over the worker tasks `tasks` (rank `r` is
    /// `tasks[r]`; a rank past the end is left out): the expert-parallel and
    /// expert-data-parallel groups, when `ep` is less than the workers.
    pub fn groups(&self, tasks: &[String]) -> Vec<CollectiveGroup> {
        if self.ep() == self.workers() {
            return Vec::new();
        }
        let members = |ranks: &[usize]| {
            ranks
                .iter()
                .filter_map(|&r| tasks.get(r).cloned())
                .collect()
        };
        let ep = self
            .mesh
            .groups(Axis::Ep)
            .into_iter()
            .map(|ranks| CollectiveGroup {
                key: self.ep_group(ranks[0]),
                members: members(&ranks),
            });
        let data = self
            .mesh
            .expert_data_groups()
            .into_iter()
            .filter_map(|ranks| {
                Some(CollectiveGroup {
                    key: self.expert_data_group(ranks[0])?,
                    members: members(&ranks),
                })
            });
        ep.chain(data).collect()
    }
}

/// `--strategy expert`.
pub(super) static REGISTRATION: Registration = Registration {
    name: "expert",
    about: "all-reduce data parallelism with each MoE layer's experts spread over the workers; tokens moved by all-to-all",
    build: |opts| {
        if opts.asynchronous {
            return Err(StrategyError::Options {
                strategy: "expert",
                message: "expert parallelism is synchronous (every step's all-to-alls need every worker); drop --async".into(),
            });
        }
        let zero = match (opts.tensor_zero, opts.zero_stage) {
            (false, _) => None,
            (true, s @ 1..=3) => Some(s),
            (true, s) => {
                return Err(StrategyError::Options {
                    strategy: "expert",
                    message: format!("--zero-stage must be 1, 2 or 3, got {s}"),
                })
            }
        };
        let pipeline = opts.stages.map(|stages| super::pipeline::Pipeline {
            stages: Some(stages),
            micro_batches: opts.micro_batches,
            schedule: opts.schedule,
            chunks: opts.chunks,
            batch_size: opts.batch_size,
        });
        Ok(Box::new(Expert {
            bucket_bytes: opts.bucket_bytes,
            batch_size: opts.batch_size,
            ep: opts.ep,
            zero,
            pipeline,
        }))
    },
};

impl Strategy for Expert {
    fn name(&self) -> &'static str {
        REGISTRATION.name
    }

    fn describe(&self) -> String {
        let over = match self.ep {
            Some(ep) => format!("groups of {ep} workers, expert gradients summed over the groups"),
            None => "the workers".to_string(),
        };
        let zero = match self.zero {
            Some(stage) => format!(
                ", ZeRO stage {stage} (dense states over the workers, each expert shard's over its expert-data-parallel group)"
            ),
            None => String::new(),
        };
        if let Some(p) = &self.pipeline {
            let groups = match self.ep {
                Some(ep) => format!("groups of {ep} of its replicas"),
                None => "its replicas".to_string(),
            };
            let zero = match self.zero {
                Some(stage) => format!(
                    ", ZeRO stage {stage} (each stage's dense states over its replicas, each expert shard's over the stage's replicas holding it)"
                ),
                None => String::new(),
            };
            return format!(
                "expert-parallel training inside {} pipeline stages (each stage's experts spread over {groups}, all-to-all), {} micro-batches, {} schedule{zero}",
                p.stages.unwrap_or(1),
                p.micro_batches,
                p.schedule
            );
        }
        format!(
            "expert-parallel training (experts spread over {over}, all-to-all){zero}, buckets of {:.1} MiB",
            self.bucket_bytes as f64 / (1u64 << 20) as f64
        )
    }

    fn plan(&self, input: &JobInput<'_>) -> Result<JobPlan, StrategyError> {
        let workers = input.workers();
        if let Some(p) = &self.pipeline {
            return self.plan_stages(input, p);
        }
        if let Some(b) = self.batch_size {
            if workers > 0 && b % workers != 0 {
                return Err(options(format!(
                    "the batch size {b} does not divide by the {workers} workers; every worker must get as many tokens as the others (equal expert capacity), so pick a multiple of {workers}"
                )));
            }
        }
        let layout = ExpertLayout::new(workers, self.ep.unwrap_or(workers))?;
        let graphs = expert_training_evaluating(
            input.graph,
            input.train,
            layout,
            (input.features, input.labels),
            self.bucket_bytes,
            self.zero,
            self.batch_size,
        )?;
        let placement = input.explicit_placement();
        let tasks: Vec<String> = input.worker_task_names();
        let mut groups = vec![CollectiveGroup {
            key: GROUP.to_string(),
            members: tasks.clone(),
        }];
        groups.extend(layout.groups(&tasks));
        let mut plan = JobPlan::build(
            self.describe(),
            input,
            graphs,
            &placement,
            Schedule::Lockstep,
            groups,
        )?;
        let layers = moe_layers(input.graph, &input.graph.to_def())?;
        if self.zero.is_some() {
            zero_shards(&mut plan, input.graph, &layers, layout);
        } else {
            plan.sharded = expert_shards(&layers, &plan.variables, layout.ep());
        }
        Ok(plan)
    }

    fn full_batches(&self) -> bool {
        // Every worker's part of every batch must be the same size.
        true
    }
}

impl Expert {
    /// The job plan of `--mesh dp=D,ep=E,pp=P` ([`pipeline`]).
    fn plan_stages(
        &self,
        input: &JobInput<'_>,
        p: &super::pipeline::Pipeline,
    ) -> Result<JobPlan, StrategyError> {
        let workers = input.workers();
        let pp = p.stages.unwrap_or(1);
        if pp == 0 || workers % pp != 0 {
            return Err(super::pipeline::PipelineError::Workers {
                stages: pp,
                workers,
            }
            .into());
        }
        let dp = workers / pp;
        let mesh = Mesh::new(dp, 1, pp)
            .and_then(|m| m.with_ep(self.ep.unwrap_or(dp)))
            .map_err(|e| options(e.to_string()))?;
        let staged = pipeline::expert_pipeline_training(
            input.graph,
            input.train,
            &mesh,
            p,
            self.zero.map(|stage| super::pipeline::zero::ReplicaZero {
                stage,
                bucket_bytes: self.bucket_bytes,
            }),
            input.features,
            input.labels,
        )?;
        let device = super::pipeline::worker_device(0);
        let placement = PlacementOptions {
            policy: Policy::Explicit,
            default_device: dflow_graph::DeviceName::parse(&device).map_err(|e| {
                StrategyError::InvalidDevice {
                    node: String::new(),
                    device: device.clone(),
                    message: e.to_string(),
                }
            })?,
            ..input.placement.clone()
        };
        let mut plan = JobPlan::build(
            self.describe(),
            input,
            staged.graphs,
            &placement,
            Schedule::Lockstep,
            staged.groups,
        )?;
        if self.zero.is_some() {
            let layout = ExpertLayout::new(dp, mesh.ep)?;
            zero_shards(&mut plan, input.graph, &staged.layers, layout);
        } else {
            plan.sharded = expert_shards(&staged.layers, &plan.variables, mesh.ep);
        }
        Ok(plan)
    }
}

fn options(message: String) -> StrategyError {
    StrategyError::Options {
        strategy: "expert",
        message,
    }
}

/// One MoE layer of the forward graph, as the rewrite sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeLayer {
    /// The `MoeDispatch` node.
    pub dispatch: String,
    /// The `MoeCombine` node.
    pub combine: String,
    /// Experts (E).
    pub experts: usize,
    /// The width of a token (the dispatch buffer's last dimension).
    pub width: usize,
    /// The nodes between dispatch and combine (the experts and their weights' preparation).
    pub expert_nodes: Vec<String>,
    /// The experts' variables, each `[E, ...]`.
    pub variables: Vec<String>,
}

fn producer(input: &str) -> Option<(String, usize)> {
    match InputRef::parse(input).ok()? {
        InputRef::Data { node, index } => Some((node, index)),
        InputRef::Control(node) => Some((node, usize::MAX)),
    }
}

/// Every node `from` depends on, by data or control, `from` included.
fn ancestors(by_name: &HashMap<&str, &NodeDef>, from: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    let mut stack = vec![from.to_string()];
    while let Some(n) = stack.pop() {
        if !seen.insert(n.clone()) {
            continue;
        }
        if let Some(def) = by_name.get(n.as_str()) {
            stack.extend(def.inputs.iter().filter_map(|i| producer(i).map(|p| p.0)));
        }
    }
    seen
}

fn not_moe(node: &str, message: String) -> StrategyError {
    options(format!("MoE layer of `{node}`: {message}"))
}

/// The MoE layers of `graph` (whose definition is `def`), in graph order: each `MoeCombine`
/// whose experts' output comes from one `MoeDispatch`.
pub fn moe_layers(graph: &Graph, def: &GraphDef) -> Result<Vec<MoeLayer>, StrategyError> {
    let by_name: HashMap<&str, &NodeDef> = def.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let mut layers = Vec::new();
    for combine in def.nodes.iter().filter(|n| n.op == "MoeCombine") {
        let experts_out = combine
            .inputs
            .first()
            .and_then(|i| producer(i))
            .ok_or_else(|| {
                not_moe(
                    &combine.name,
                    "MoeCombine has no expert output input".into(),
                )
            })?;
        let above = ancestors(&by_name, &experts_out.0);
        // The layer's own dispatch: the last one above its experts (earlier layers' dispatches
        // are above it).
        let mut dispatches: Vec<(&str, HashSet<String>)> = above
            .iter()
            .filter(|n| {
                by_name
                    .get(n.as_str())
                    .is_some_and(|d| d.op == "MoeDispatch")
            })
            .map(|n| (n.as_str(), ancestors(&by_name, n)))
            .collect();
        dispatches.sort_by_key(|(_, a)| std::cmp::Reverse(a.len()));
        let Some((dispatch, before)) = dispatches.first() else {
            return Err(not_moe(
                &combine.name,
                format!(
                    "its expert output `{}` does not come from a MoeDispatch",
                    experts_out.0
                ),
            ));
        };
        if let Some((other, _)) = dispatches.iter().find(|(d, _)| !before.contains(*d)) {
            return Err(not_moe(
                &combine.name,
                format!(
                    "its expert output depends on MoeDispatch nodes `{dispatch}` and `{other}`, neither before the other; the expert strategy needs one dispatch per layer"
                ),
            ));
        }
        let dispatch = *dispatch;
        let idx = graph
            .find(dispatch)
            .ok_or_else(|| not_moe(dispatch, "not in the validated graph".into()))?;
        let ty = graph
            .output_type(idx, 0)
            .ok_or_else(|| not_moe(dispatch, "MoeDispatch has no output type".into()))?;
        let dims = ty.shape.dims().unwrap_or(&[]);
        let (Some(Some(experts)), Some(Some(width))) = (dims.first(), dims.get(2)) else {
            return Err(not_moe(
                dispatch,
                format!(
                    "the dispatch buffer's shape {} must have a known number of experts and token width",
                    ty.shape
                ),
            ));
        };
        let mut expert_nodes = Vec::new();
        let mut variables = Vec::new();
        for n in &def.nodes {
            if !above.contains(&n.name) || before.contains(&n.name) {
                continue;
            }
            if n.op == "Variable" {
                let first = match n.attrs.get("shape") {
                    Some(AttrValue::Shape(s)) => {
                        s.dims().and_then(|d| d.first().copied().flatten())
                    }
                    _ => None,
                };
                if first != Some(*experts) {
                    return Err(not_moe(
                        dispatch,
                        format!(
                            "variable `{}` feeds the experts but its first dimension is not the {experts} experts",
                            n.name
                        ),
                    ));
                }
                variables.push(n.name.clone());
            } else if n.op == "Placeholder" {
                return Err(not_moe(
                    dispatch,
                    format!(
                        "placeholder `{}` feeds the experts; only variables may",
                        n.name
                    ),
                ));
            } else {
                expert_nodes.push(n.name.clone());
            }
        }
        layers.push(MoeLayer {
            dispatch: dispatch.to_string(),
            combine: combine.name.clone(),
            experts: *experts,
            width: *width,
            expert_nodes,
            variables,
        });
    }
    Ok(layers)
}

/// The experts' shards as whole logical tensors for checkpoints ([`crate::shards`]): each
/// expert variable `v` (`[E, ...]`) and each of its optimizer slots `v/<slot>` of the same shape
/// are the concatenation of the `v/shard_<i>[/<slot>]` (`[E/N, ...]`, whole rows) of the `N = ep`
/// workers of an expert-parallel group (every group holds the same values), so a
/// checkpoint holds them under the names and shapes one process uses and resumes at any worker
/// count, with or without the strategy. A slot whose first dimension is not `E/N` (none of the
/// bundled optimizers has one) is left out and stays per worker.
pub fn expert_shards(
    layers: &[MoeLayer],
    variables: &[VariablePlan],
    workers: usize,
) -> Vec<ShardedVariable> {
    let mut sharded = Vec::new();
    for layer in layers {
        let per_worker = layer.experts / workers.max(1);
        for var in &layer.variables {
            let first = shard_name(var, 0);
            for v in variables {
                let Some(suffix) = v.name.strip_prefix(&first) else {
                    continue;
                };
                if !(suffix.is_empty() || suffix.starts_with('/'))
                    || v.dims.first() != Some(&per_worker)
                {
                    continue;
                }
                let mut dims = v.dims.clone();
                dims[0] = layer.experts;
                sharded.push(ShardedVariable {
                    logical: format!("{var}{suffix}"),
                    dtype: v.dtype,
                    dims,
                    shards: (0..workers)
                        .map(|i| format!("{}{suffix}", shard_name(var, i)))
                        .collect(),
                    shard_dims: Some(v.dims.clone()),
                });
            }
        }
    }
    sharded
}

/// The logical tensors of a plan under ZeRO beside experts, for checkpoints: the dense
/// parameters' slots and each expert shard's (`{v}/shard_{k}/adam_m`) as ZeRO's flat shards
/// (`plan.sharded`, gathered first), then each expert variable and slot whole from its `ep`
/// row shards (`plan.axis_sharded`, axis 0), so a checkpoint holds the one-process names and
/// shapes.
fn zero_shards(plan: &mut JobPlan, graph: &Graph, layers: &[MoeLayer], layout: ExpertLayout) {
    let (workers, ep) = (layout.workers(), layout.ep());
    let (dense, shards) = zero_dims(graph, layers, ep);
    plan.sharded = super::zero::slot_shards(&plan.variables, &dense, workers);
    if workers > ep {
        plan.sharded.extend(super::zero::slot_shards(
            &plan.variables,
            &shards,
            workers / ep,
        ));
    }
    plan.axis_sharded = expert_row_shards(&plan.variables, &plan.sharded, layers, &shards, ep);
}

/// Dtype and dimensions by name.
pub(crate) type Dims = BTreeMap<String, (dflow_graph::DType, Vec<usize>)>;

/// The one-process graph's trained variables, split for ZeRO's checkpoint entries: the dense
/// ones (by name) and each expert variable's `ep` row shards (`{v}/shard_{k}`, `[E/ep, ...]`).
pub(crate) fn zero_dims(graph: &Graph, layers: &[MoeLayer], ep: usize) -> (Dims, Dims) {
    let mut dense = Dims::new();
    let mut shards = Dims::new();
    let experts: HashMap<&str, &MoeLayer> = layers
        .iter()
        .flat_map(|l| l.variables.iter().map(move |v| (v.as_str(), l)))
        .collect();
    for i in graph.node_indices() {
        let n = graph.node(i);
        let Some(ty) = graph.output_type(i, 0).filter(|_| n.op == "Variable") else {
            continue;
        };
        let Some(dims) = ty.shape.as_static() else {
            continue;
        };
        match experts.get(n.name.as_str()) {
            Some(l) => {
                let mut rows = dims.clone();
                rows[0] = l.experts / ep;
                for k in 0..ep {
                    shards.insert(shard_name(&n.name, k), (ty.dtype, rows.clone()));
                }
            }
            None => {
                dense.insert(n.name.clone(), (ty.dtype, dims));
            }
        }
    }
    (dense, shards)
}

/// Each expert variable and its slots whole from its `ep` row shards (axis 0): a slot is a
/// variable of the plan (`variables`) of the shard's shape, or one of ZeRO's logical tensors
/// (`zero`, gathered first). `shards`: [`zero_dims`]'s row shards.
pub(crate) fn expert_row_shards(
    variables: &[VariablePlan],
    zero: &[ShardedVariable],
    layers: &[MoeLayer],
    shards: &Dims,
    ep: usize,
) -> Vec<crate::shards::AxisShardedVariable> {
    let mut axis = Vec::new();
    for l in layers {
        for var in &l.variables {
            let first = shard_name(var, 0);
            let Some((dtype, rows)) = shards.get(&first) else {
                continue;
            };
            let mut whole = rows.clone();
            whole[0] = l.experts;
            // The variable, and each slot: a variable of the shard's shape, or ZeRO's logical.
            let mut suffixes: BTreeMap<String, dflow_graph::DType> =
                BTreeMap::from([(String::new(), *dtype)]);
            let prefix = format!("{first}/");
            for v in variables {
                if let Some(slot) = v.name.strip_prefix(&prefix) {
                    if &v.dims == rows {
                        suffixes.insert(format!("/{slot}"), v.dtype);
                    }
                }
            }
            for z in zero {
                if let Some(slot) = z.logical.strip_prefix(&prefix) {
                    suffixes.insert(format!("/{slot}"), z.dtype);
                }
            }
            for (suffix, dtype) in suffixes {
                axis.push(crate::shards::AxisShardedVariable {
                    logical: format!("{var}{suffix}"),
                    dtype,
                    dims: whole.clone(),
                    shards: (0..ep)
                        .map(|k| format!("{}{suffix}", shard_name(var, k)))
                        .collect(),
                    axis: 0,
                    blocks: 1,
                    padded: l.experts,
                });
            }
        }
    }
    axis
}

/// The name of shard `shard` of expert variable `var` (held by the workers at position
/// `shard` of their expert-parallel groups; [`ExpertLayout::shard`]).
pub fn shard_name(var: &str, shard: usize) -> String {
    format!("{var}/shard_{shard}")
}

/// The expert-parallel training graphs, one per worker of `layout` (see the module docs).
pub fn expert_training(
    graph: &Graph,
    spec: &TrainSpec,
    layout: ExpertLayout,
    features: &str,
    labels: &str,
    bucket_bytes: usize,
) -> Result<Vec<ReplicaGraph>, StrategyError> {
    expert_training_with(graph, spec, layout, features, labels, bucket_bytes, None)
}

/// [`expert_training`], with ZeRO at stage `zero` (1, 2 or 3) in place of the gradient
/// all-reduces ([`zero`]).
pub fn expert_training_with(
    graph: &Graph,
    spec: &TrainSpec,
    layout: ExpertLayout,
    features: &str,
    labels: &str,
    bucket_bytes: usize,
    zero: Option<u8>,
) -> Result<Vec<ReplicaGraph>, StrategyError> {
    expert_training_evaluating(
        graph,
        spec,
        layout,
        (features, labels),
        bucket_bytes,
        zero,
        None,
    )
}

/// [`expert_training_with`], whose evaluation, given the held-out batches' rows (`eval_rows`,
/// the global batch size), runs the experts on their ranks of expert-parallel group 0 and the
/// rest on worker 0, moving activations only ([`ep_eval`]); without it worker 0 evaluates a
/// copy that joins every expert's shards ([`add_eval_copy`]).
pub fn expert_training_evaluating(
    graph: &Graph,
    spec: &TrainSpec,
    layout: ExpertLayout,
    (features, labels): (&str, &str),
    bucket_bytes: usize,
    zero: Option<u8>,
    eval_rows: Option<usize>,
) -> Result<Vec<ReplicaGraph>, StrategyError> {
    let (workers, ep) = (layout.workers(), layout.ep());
    let loss_dtype = check_job(graph, spec, workers, features, labels)?;
    if zero.is_some() {
        super::zero::check_optimizer(spec, "expert")?;
    }
    let forward = graph.to_def();
    let layers = moe_layers(graph, &forward)?;
    check_layers(&layers, ep)?;
    let mut graphs = Vec::with_capacity(workers);
    for i in 0..workers {
        let groups = ForwardGroups {
            experts: layout.ep_group(i),
            all: GROUP.to_string(),
        };
        let (def, local) = worker_forward(&forward, &layers, i, layout, &groups)?;
        let names: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
        // Clipping, if any, comes after the sums (reduce_gradients).
        let unclipped = TrainSpec {
            clip_global_norm: None,
            ..spec.clone()
        };
        let mut weighted = weighted_training(&def, &unclipped, i, loss_dtype)?;
        let mut g = if let Some(stage) = zero {
            let z = zero::ExpertZero {
                layout,
                stage,
                bucket_bytes,
                feeds: (features, labels),
                forward: &names,
            };
            zero::zero_step(weighted, spec, i, &local, z)?
        } else {
            if let Some(group) = layout.expert_data_group(i) {
                reduce_expert_gradients(&mut weighted, &local, &group)?;
            }
            // Each expert shard's (summed) gradient once per expert-parallel group: the
            // clipping norm gathers the shards' norms over that group.
            reduce_gradients(
                weighted,
                spec,
                i,
                features,
                labels,
                bucket_bytes,
                &local,
                (&layout.ep_group(i), ep),
            )?
        };
        add_dropped_count(&mut g, &forward, i)?;
        graphs.push(g);
    }
    let device = |_: &str, j: usize| worker_device("", "", j);
    let copy = EvalCopy {
        layout,
        stage3: zero.is_some_and(|s| s >= 3),
        shard_device: &device,
        own_placeholders: false,
    };
    let staged = match eval_rows {
        Some(rows) => {
            let feeds = crate::strategy::tensor::eval::EvalFeeds {
                features,
                labels,
                rows,
            };
            ep_eval::add_ep_eval(&mut graphs, graph, &forward, &layers, spec, &copy, &feeds)?
        }
        None => false,
    };
    if !staged {
        if let Some(g) = graphs.first_mut() {
            add_eval_copy(g, graph, &forward, &layers, spec, copy)?;
        }
    }
    Ok(graphs)
}

/// Refuses a graph without MoE layer, or with a layer whose experts do not split over `ep`.
fn check_layers(layers: &[MoeLayer], ep: usize) -> Result<(), StrategyError> {
    if layers.is_empty() {
        return Err(options(
            "the graph has no MoE layer (MoeDispatch … MoeCombine); use --strategy allreduce"
                .into(),
        ));
    }
    for l in layers {
        if l.experts % ep != 0 {
            return Err(options(format!(
                "MoE layer `{}` has {} experts, which do not split evenly over the {ep} workers of an expert-parallel group (ep={ep}); use an expert-parallel size (the worker count, or --mesh ep) that divides {}",
                l.dispatch, l.experts, l.experts
            )));
        }
    }
    Ok(())
}

fn int_list(v: &[i64]) -> AttrValue {
    AttrValue::IntList(v.to_vec())
}

/// The collective groups of a worker's forward graph ([`worker_forward`]).
#[derive(Clone, Debug)]
pub(crate) struct ForwardGroups {
    /// The all-to-alls' group: the worker's expert-parallel group.
    pub experts: String,
    /// The router all-gathers' group: every worker that trains on a part of the batch.
    pub all: String,
}

/// Worker `worker`'s forward graph: expert variables sharded, all-to-alls (over its
/// expert-parallel group, `groups.experts`) around the experts, the auxiliary losses on inputs
/// gathered from every worker (`groups.all`). Returns it and the shards' names. Every
/// collective's instance key is [`FIRST_INSTANCE`] or above, one per collective.
pub(crate) fn worker_forward(
    forward: &GraphDef,
    layers: &[MoeLayer],
    worker: usize,
    layout: ExpertLayout,
    groups: &ForwardGroups,
) -> Result<(GraphDef, HashSet<String>), StrategyError> {
    let mut def = forward.clone();
    let mut taken: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
    let device = worker_device("", "", worker)?;
    let n = layout.ep() as i64;
    let ep_group = groups.experts.clone();
    let index = layout.shard(worker);
    let mut instance = FIRST_INSTANCE;
    // One instance counter for both groups: every key is unique in either.
    let mut collective = |name: &str, op: &str, input: String, group: &str, size: usize| {
        let mut c = node(name, op, vec![input], &device);
        c.attrs = BTreeMap::from([
            ("group_key".to_string(), AttrValue::String(group.into())),
            ("instance_key".to_string(), AttrValue::Int(instance)),
            ("group_size".to_string(), AttrValue::Int(size as i64)),
        ]);
        instance += 1;
        c
    };
    let mut local = HashSet::new();
    let mut renames: HashMap<String, String> = HashMap::new();
    let mut added = Vec::new();
    for l in layers {
        let per = (l.experts / layout.ep()) as i64;
        let width = l.width as i64;
        // Expert variables: this worker's rows.
        for var in &l.variables {
            let shard = shard_name(var, index);
            if taken.contains(&shard) {
                return Err(StrategyError::NameTaken {
                    node: var.clone(),
                    name: shard,
                });
            }
            taken.insert(shard.clone());
            if let Some(v) = def.nodes.iter_mut().find(|d| &d.name == var) {
                shard_variable(v, index, per)?;
            }
            renames.insert(var.clone(), shard.clone());
            local.insert(shard);
        }
        // Reshapes of the experts' weights name E: they now see E/N.
        for v in def
            .nodes
            .iter_mut()
            .filter(|d| d.op == "Reshape" && l.expert_nodes.contains(&d.name))
        {
            if let Some(AttrValue::IntList(dims)) = v.attrs.get_mut("shape") {
                if dims.first() == Some(&(l.experts as i64)) {
                    dims[0] = per;
                }
            }
        }
        // Tokens to their experts' workers.
        let base = &l.dispatch;
        let a2a = fresh(&mut taken, &format!("{base}/to_experts"));
        added.push(collective(
            &a2a,
            "CollectiveAllToAll",
            base.clone(),
            &ep_group,
            layout.ep(),
        ));
        let split = fresh(&mut taken, &format!("{base}/to_experts/by_rank"));
        let mut r = node(&split, "Reshape", vec![a2a.clone()], &device);
        r.attrs = BTreeMap::from([("shape".into(), int_list(&[n, per, -1, width]))]);
        added.push(r);
        let swap = fresh(&mut taken, &format!("{base}/to_experts/by_expert"));
        let mut t = node(&swap, "Transpose", vec![split], &device);
        t.attrs = BTreeMap::from([("perm".into(), int_list(&[1, 0, 2, 3]))]);
        added.push(t);
        let tokens = fresh(&mut taken, &format!("{base}/to_experts/local"));
        let mut r = node(&tokens, "Reshape", vec![swap], &device);
        r.attrs = BTreeMap::from([("shape".into(), int_list(&[per, -1, width]))]);
        added.push(r);
        for d in def
            .nodes
            .iter_mut()
            .filter(|d| l.expert_nodes.contains(&d.name))
        {
            for input in &mut d.inputs {
                if producer(input) == Some((base.clone(), 0)) {
                    *input = tokens.clone();
                }
            }
        }
        // Results back to the tokens' workers.
        let Some(comb) = def.nodes.iter_mut().find(|d| d.name == l.combine) else {
            continue;
        };
        let Some(out) = comb.inputs.first().cloned() else {
            continue;
        };
        let cb = l.combine.clone();
        let split = fresh(&mut taken, &format!("{cb}/from_experts/by_expert"));
        let mut r = node(&split, "Reshape", vec![out], &device);
        r.attrs = BTreeMap::from([("shape".into(), int_list(&[per, n, -1, width]))]);
        added.push(r);
        let swap = fresh(&mut taken, &format!("{cb}/from_experts/by_rank"));
        let mut t = node(&swap, "Transpose", vec![split], &device);
        t.attrs = BTreeMap::from([("perm".into(), int_list(&[1, 0, 2, 3]))]);
        added.push(t);
        let joined = fresh(&mut taken, &format!("{cb}/from_experts/joined"));
        let mut r = node(&joined, "Reshape", vec![swap], &device);
        r.attrs = BTreeMap::from([("shape".into(), int_list(&[n * per, -1, width]))]);
        added.push(r);
        let back = fresh(&mut taken, &format!("{cb}/from_experts"));
        added.push(collective(
            &back,
            "CollectiveAllToAll",
            joined,
            &ep_group,
            layout.ep(),
        ));
        comb.inputs[0] = back;
    }
    // The load-balancing losses see every worker's tokens (all workers, not only the group).
    let aux: Vec<String> = def
        .nodes
        .iter()
        .filter(|d| d.op == "MoeAuxLoss")
        .map(|d| d.name.clone())
        .collect();
    for name in aux {
        let Some(inputs) = def
            .nodes
            .iter()
            .find(|d| d.name == name)
            .map(|d| d.inputs.clone())
        else {
            continue;
        };
        let mut gathered = Vec::new();
        for (k, input) in inputs.iter().enumerate().take(2) {
            let g = fresh(&mut taken, &format!("{name}/all_gather_{k}"));
            added.push(collective(
                &g,
                "CollectiveAllGather",
                input.clone(),
                &groups.all,
                layout.workers(),
            ));
            gathered.push(g);
        }
        if let Some(d) = def.nodes.iter_mut().find(|d| d.name == name) {
            for (k, g) in gathered.into_iter().enumerate() {
                d.inputs[k] = g;
            }
        }
    }
    // References to the renamed variables.
    for d in &mut def.nodes {
        if let Some(new) = renames.get(&d.name) {
            d.name = new.clone();
        }
        for input in &mut d.inputs {
            if let Some((p, index)) = producer(input) {
                if let Some(new) = renames.get(&p) {
                    *input = if index == usize::MAX {
                        format!("^{new}")
                    } else if index == 0 {
                        new.clone()
                    } else {
                        format!("{new}:{index}")
                    };
                }
            }
        }
    }
    def.nodes.extend(added);
    Ok((def, local))
}

/// Adds to worker `worker`'s graph the step's dropped token assignments of the whole job: the
/// sum of every MoE layer's `MoeRoute` `dropped` output (this worker's tokens against the
/// per-worker capacity), all-reduced (sum, i64) over the workers after the loss, the last
/// collective of the step on every worker. The job fetches it after the loss
/// ([`ReplicaGraph::step_metrics`], [`DROPPED_METRIC`]).
fn add_dropped_count(
    g: &mut ReplicaGraph,
    forward: &GraphDef,
    worker: usize,
) -> Result<(), StrategyError> {
    let routes: Vec<String> = forward
        .nodes
        .iter()
        .filter(|n| n.op == "MoeRoute")
        .map(|n| format!("{}:3", n.name))
        .collect();
    if routes.is_empty() {
        return Ok(());
    }
    let device = worker_device("", "", worker)?;
    let def = &mut g.training.def;
    let mut taken: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
    let local = if routes.len() == 1 {
        routes[0].clone()
    } else {
        let sum = fresh(&mut taken, "moe/dropped/local");
        def.nodes.push(node(&sum, "AddN", routes, &device));
        sum
    };
    let global = fresh(&mut taken, "moe/dropped/global");
    let mut n = node(
        &global,
        "CollectiveAllReduce",
        vec![local, format!("^{}", g.training.loss)],
        &device,
    );
    n.attrs = BTreeMap::from([
        ("group_key".to_string(), AttrValue::String(GROUP.into())),
        ("instance_key".to_string(), AttrValue::Int(DROPPED_INSTANCE)),
        ("reduce".to_string(), AttrValue::String("sum".into())),
    ]);
    def.nodes.push(n);
    g.graph = Graph::from_def(def).map_err(StrategyError::InvalidGraph)?;
    g.step_metrics.push((DROPPED_METRIC.to_string(), global));
    Ok(())
}

/// Sums each expert shard's gradient over the workers that hold the same shard (`group`, an
/// expert-data-parallel group) by all-reduce, and points the updates at the sums: the shards
/// in `local` are the worker's expert variables.
fn reduce_expert_gradients(
    w: &mut super::allreduce::WeightedTraining,
    local: &HashSet<String>,
    group: &str,
) -> Result<(), StrategyError> {
    let device = w.device.clone();
    sum_shard_gradients(&mut w.training, local, |_, _| {
        Ok((device.clone(), group.to_string()))
    })?;
    w.typed = Graph::from_def(&w.training.def).map_err(StrategyError::InvalidGraph)?;
    Ok(())
}

/// Sums the gradient of each expert shard in `local` by an all-reduce (`experts/grad_{k}/all_reduce`,
/// instance key `k + 1`) on the device and over the group `place(def, gradient)` names, and
/// points the updates and `training.gradients` at the sums: the one sum of the expert shards
/// held by several workers (the expert-data-parallel groups, per stage inside a pipeline).
pub(crate) fn sum_shard_gradients(
    training: &mut dflow_graph::train::TrainingGraph,
    local: &HashSet<String>,
    place: impl Fn(&GraphDef, &str) -> Result<(String, String), StrategyError>,
) -> Result<(), StrategyError> {
    let def = &mut training.def;
    let mut taken: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
    let mut summed: HashMap<String, String> = HashMap::new();
    let mut added = Vec::new();
    for (k, (var, grad)) in training.gradients.iter_mut().enumerate() {
        if !local.contains(var.as_str()) {
            continue;
        }
        let (device, group) = place(def, grad)?;
        let name = fresh(&mut taken, &format!("experts/grad_{k}/all_reduce"));
        let mut n = node(&name, "CollectiveAllReduce", vec![grad.clone()], &device);
        n.attrs = BTreeMap::from([
            ("group_key".to_string(), AttrValue::String(group.into())),
            ("instance_key".to_string(), AttrValue::Int(k as i64 + 1)),
            ("reduce".to_string(), AttrValue::String("sum".into())),
        ]);
        added.push(n);
        summed.insert(grad.clone(), name.clone());
        *grad = name;
    }
    for n in def.nodes.iter_mut().filter(|n| n.op.starts_with("Apply")) {
        for input in &mut n.inputs {
            if let Some(s) = summed.get(input.as_str()) {
                *input = s.clone();
            }
        }
    }
    def.nodes.extend(added);
    Ok(())
}

/// Makes `v` (an `[E, ...]` variable) shard `shard` of it, `per` rows (the caller renames it).
pub(crate) fn shard_variable(v: &mut NodeDef, shard: usize, per: i64) -> Result<(), StrategyError> {
    let whole = match v.attrs.get("shape") {
        Some(AttrValue::Shape(s)) => s.clone(),
        _ => {
            return Err(not_moe(&v.name, "the expert variable has no shape".into()));
        }
    };
    let Some(mut dims) = whole.as_static() else {
        return Err(not_moe(
            &v.name,
            format!("the expert variable's shape {whole} is not static"),
        ));
    };
    dims[0] = per as usize;
    v.attrs
        .insert("shape".into(), AttrValue::Shape(Shape::known(&dims)));
    v.attrs.insert("shard_of".into(), AttrValue::Shape(whole));
    v.attrs
        .insert("shard_offset".into(), AttrValue::Int(shard as i64 * per));
    v.attrs.insert(
        "shard_name".into(),
        AttrValue::String(v.name.as_str().into()),
    );
    Ok(())
}

/// How [`add_eval_copy`] finds the shards it joins.
pub(crate) struct EvalCopy<'a> {
    /// The workers and their expert-parallel groups (`ep` shards of each expert variable).
    pub layout: ExpertLayout,
    /// ZeRO-3: the parameters are flat shards, joined before each use.
    pub stage3: bool,
    /// The device of variable `v` (its one-process name) on worker `j` (beside a pipeline,
    /// replica `j`'s stage holding it): expert shard `j` of an expert variable, and under
    /// ZeRO-3 rank `j`'s flat shards.
    pub shard_device: &'a dyn Fn(&str, usize) -> Result<String, StrategyError>,
    /// Read placeholders of the one-process shapes (`eval/<name>`).
    pub own_placeholders: bool,
}

/// The evaluation's reads of the forward graph's weights, [`eval_weights`]'s.
pub(crate) struct EvalWeights {
    /// The tensor each variable (one-process name) is read from, where it is not read as it
    /// is: an expert variable's shards joined, under ZeRO-3 every parameter's flat shards.
    pub map: HashMap<String, String>,
    /// The nodes that make them (the other workers' shard variables, the joins).
    pub nodes: Vec<NodeDef>,
    /// Under ZeRO-3: each joined value's sends of remote shards.
    pub sends: Vec<(String, Vec<String>)>,
}

/// The whole values of `forward`'s expert variables (and under ZeRO-3 of all its parameters)
/// joined from their shards on `join_device(variable)` (shard `j` of variable `v` on
/// `copy.shard_device(v, j)`, shard 0, and ZeRO-3 rank 0's flat shard, in the graph of the
/// evaluation already), named apart from `taken`.
pub(crate) fn eval_weights(
    graph: &Graph,
    forward: &GraphDef,
    layers: &[MoeLayer],
    copy: &EvalCopy<'_>,
    taken: &mut HashSet<String>,
    join_device: &dyn Fn(&str) -> Result<String, StrategyError>,
) -> Result<EvalWeights, StrategyError> {
    let (layout, stage3) = (copy.layout, copy.stage3);
    let (workers, ep) = (layout.workers(), layout.ep());
    let experts: HashMap<&str, &MoeLayer> = layers
        .iter()
        .flat_map(|l| l.variables.iter().map(move |v| (v.as_str(), l)))
        .collect();
    let mut map: HashMap<String, String> = HashMap::new();
    let mut added = Vec::new();
    // Under ZeRO-3: each whole value's sends of remote shards, to run just before its readers.
    let mut sends: Vec<(String, Vec<String>)> = Vec::new();
    for n in forward.nodes.iter().filter(|n| n.op == "Variable") {
        let device = join_device(&n.name)?;
        let dims = graph
            .find(&n.name)
            .and_then(|i| graph.output_type(i, 0))
            .and_then(|t| t.shape.as_static())
            .ok_or_else(|| not_moe(&n.name, "the variable's shape is not static".into()))?;
        if let Some(l) = experts.get(n.name.as_str()) {
            let per = (l.experts / ep) as i64;
            let mut shards = Vec::new();
            let mut sent = Vec::new();
            for j in 0..ep {
                let name = shard_name(&n.name, j);
                let mut v = n.clone();
                shard_variable(&mut v, j, per)?;
                v.name = name.clone();
                if stage3 && workers > ep {
                    // Its flat shards, over the workers j, j + ep, ...
                    zero::as_row_split(&mut v, ep, j);
                    let mut rows = dims.clone();
                    rows[0] = per as usize;
                    let holders: Vec<usize> = (j..workers).step_by(ep).collect();
                    let part = FlatJoin {
                        var: &v,
                        name: &name,
                        dims: &rows,
                        holders: &holders,
                        device: &|w| (copy.shard_device)(&n.name, w),
                    };
                    shards.push(part.add(taken, &mut added, &mut sent, &device)?);
                    continue;
                }
                if j > 0 {
                    v.device = (copy.shard_device)(&n.name, j)?;
                    added.push(v);
                }
                shards.push(name);
            }
            let joined = fresh(taken, &format!("eval/{}", n.name));
            let mut c = node(&joined, "Concat", shards, &device);
            c.attrs = BTreeMap::from([("axis".to_string(), AttrValue::Int(0))]);
            added.push(c);
            sends.push((joined.clone(), sent));
            map.insert(n.name.clone(), joined);
        } else if stage3 {
            let holders: Vec<usize> = (0..workers).collect();
            let whole = FlatJoin {
                var: n,
                name: &n.name,
                dims: &dims,
                holders: &holders,
                device: &|w| (copy.shard_device)(&n.name, w),
            };
            let mut sent = Vec::new();
            let value = whole.add(taken, &mut added, &mut sent, &device)?;
            sends.push((value.clone(), sent));
            map.insert(n.name.clone(), value);
        }
    }
    Ok(EvalWeights {
        map,
        nodes: added,
        sends,
    })
}

/// Adds to worker 0's graph a copy of the forward graph, `eval/<name>`, whose experts read the
/// shards of its expert-parallel group joined (shard `j` of variable `v` on
/// `copy.shard_device(v, j)`, shard 0 in `g`), and points evaluation at it. Under ZeRO-3
/// (`copy.stage3`) every parameter is read joined from its flat shards: a dense one's from all
/// the workers, each expert shard's from its expert-data-parallel group (`graph`: the forward
/// graph, for the parameters' dimensions). With `copy.own_placeholders`, the copy reads
/// placeholders `eval/<name>` of the one-process shapes (the training ones have a fixed
/// batch), else the training ones.
pub(crate) fn add_eval_copy(
    g: &mut ReplicaGraph,
    graph: &Graph,
    forward: &GraphDef,
    layers: &[MoeLayer],
    spec: &TrainSpec,
    copy: EvalCopy<'_>,
) -> Result<(), StrategyError> {
    let device = worker_device("", "", 0)?;
    let own_placeholders = copy.own_placeholders;
    let mut taken: HashSet<String> = g
        .training
        .def
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .collect();
    let joined = eval_weights(graph, forward, layers, &copy, &mut taken, &|_| {
        Ok(device.clone())
    })?;
    let (mut map, mut added, sends) = (joined.map, joined.nodes, joined.sends);
    for n in &forward.nodes {
        match n.op.as_str() {
            "Placeholder" if own_placeholders => {
                let name = fresh(&mut taken, &format!("eval/{}", n.name));
                let mut ph = n.clone();
                ph.name = name.clone();
                ph.device = device.clone();
                ph.colocate_with.clear();
                added.push(ph);
                map.insert(n.name.clone(), name);
            }
            "Placeholder" | "Variable" => {}
            _ => {
                let name = fresh(&mut taken, &format!("eval/{}", n.name));
                map.insert(n.name.clone(), name);
            }
        }
    }
    let remap = |input: &str| -> String {
        match producer(input) {
            Some((p, index)) => match map.get(&p) {
                Some(new) if index == usize::MAX => format!("^{new}"),
                Some(new) if index == 0 => new.clone(),
                Some(new) => format!("{new}:{index}"),
                None => input.to_string(),
            },
            None => input.to_string(),
        }
    };
    for n in &forward.nodes {
        if matches!(n.op.as_str(), "Placeholder" | "Variable") {
            continue;
        }
        let mut copy = n.clone();
        copy.name = remap(&n.name);
        copy.inputs = n.inputs.iter().map(|i| remap(i)).collect();
        copy.device = worker_device(&n.name, &n.device, 0)?;
        copy.colocate_with.clear();
        added.push(copy);
    }
    // Each remote shard leaves its holder just before the readers of its value run (it waits
    // for their other inputs), so worker 0 holds about one weight at a time, not the model.
    let mut eval = GraphDef {
        nodes: added,
        ..GraphDef::default()
    };
    let reads = |value: &str, n: &NodeDef| {
        n.inputs
            .iter()
            .any(|i| matches!(producer(i), Some((p, k)) if p == value && k != usize::MAX))
    };
    let mut readers: Vec<(String, Vec<String>)> = Vec::new();
    for (value, sent) in &sends {
        let who: Vec<String> = eval
            .nodes
            .iter()
            .filter(|n| reads(value, n))
            .map(|n| n.name.clone())
            .collect();
        readers.extend(sent.iter().map(|s| (s.clone(), who.clone())));
    }
    super::zero::params::just_in_time(&mut eval, &readers);
    g.training.def.nodes.extend(eval.nodes);
    g.graph = Graph::from_def(&g.training.def).map_err(StrategyError::InvalidGraph)?;
    g.eval.loss = remap(&spec.loss);
    g.eval.metrics = spec.metrics.iter().map(|m| remap(m)).collect();
    if own_placeholders {
        g.eval.features = remap(&g.eval.features);
        g.eval.labels = remap(&g.eval.labels);
    }
    Ok(())
}

/// A variable read whole on worker 0 from the flat ZeRO-3 shards `{name}/shard_{r}_of_{R}`
/// that the workers `holders` (rank `r` is `holders[r]`) keep of it.
struct FlatJoin<'a> {
    /// The variable as its holders declare it before ZeRO-3 shards it (whole, or an expert
    /// row shard in [`zero::as_row_split`]'s form).
    var: &'a NodeDef,
    /// The sharded variable's name.
    name: &'a str,
    /// Its dimensions.
    dims: &'a [usize],
    /// The workers holding its shards, in rank order.
    holders: &'a [usize],
    /// The device of worker `w`'s shard.
    device: &'a dyn Fn(usize) -> Result<String, StrategyError>,
}

impl FlatJoin<'_> {
    /// Adds to `added` the other holders' shard variables (worker 0's own is in its graph),
    /// each read by an `Identity` on its holder (pushed to `sent`: what crosses to worker 0),
    /// and their join cut back to the variable's dimensions, on `device`; returns the join.
    fn add(
        &self,
        taken: &mut HashSet<String>,
        added: &mut Vec<NodeDef>,
        sent: &mut Vec<String>,
        device: &str,
    ) -> Result<String, StrategyError> {
        let ranks = self.holders.len();
        let mut pieces = Vec::with_capacity(ranks);
        for (r, &w) in self.holders.iter().enumerate() {
            let piece = super::zero::params::shard_name(self.name, r, ranks);
            if w != 0 {
                let mut v = self.var.clone();
                super::zero::params::flat_shard(&mut v, self.name, self.dims, r, ranks);
                v.name = piece.clone();
                v.device = (self.device)(w)?;
                v.colocate_with.clear();
                let send = fresh(taken, &format!("eval/{piece}/sent"));
                added.push(node(&send, "Identity", vec![piece.clone()], &v.device));
                added.push(v);
                sent.push(send.clone());
                pieces.push(send);
            } else {
                pieces.push(piece);
            }
        }
        let joined = fresh(taken, &format!("eval/{}/joined", self.name));
        added.push(node(&joined, "PackFlat", pieces, device));
        let value = fresh(taken, &format!("eval/{}", self.name));
        let mut s = node(&value, "FlatSlice", vec![joined], device);
        s.attrs = BTreeMap::from([
            ("offset".to_string(), AttrValue::Int(0)),
            (
                "shape".to_string(),
                AttrValue::Shape(Shape::known(self.dims)),
            ),
        ]);
        added.push(s);
        Ok(value)
    }
}

/// What one worker sends to other workers in each all-to-all of its training graph `g` (over
/// the `workers` workers of its expert-parallel group), from the plan's static shapes: `(node, bytes)` in graph order, `None`
/// where the batch size is not static. The dispatch buffer is `[E, C, d]` and blocks `j ≠ i`
/// leave worker `i`, so each all-to-all sends `(N−1)·(E/N)·C·d·size` bytes off-rank: every
/// capacity slot of another worker's experts, filled or not (the buffers are static), i.e. the
/// tokens sent off-rank at full capacity × d_model × 4 for f32.
pub fn all_to_all_bytes(g: &ReplicaGraph, workers: usize) -> Vec<(String, Option<usize>)> {
    let typed = &g.graph;
    typed
        .topo_order()
        .into_iter()
        .map(|i| (i, typed.node(i)))
        .filter(|(_, n)| n.op == "CollectiveAllToAll")
        .map(|(i, n)| {
            let bytes = typed.output_type(i, 0).and_then(|t| {
                let elems = t.shape.num_elements()?;
                Some(elems * t.dtype.size_of() / workers.max(1) * workers.saturating_sub(1))
            });
            (n.name.clone(), bytes)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::task_name;
    use dflow_graph::layers::{gpt, GptConfig, MoeConfig};
    use dflow_graph::DType;

    fn moe_gpt(experts: usize, top_k: usize) -> (Graph, TrainSpec) {
        let cfg = GptConfig {
            vocab_size: 11,
            block_size: 4,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            moe: Some(MoeConfig {
                num_experts: experts,
                top_k,
                capacity_factor: experts as f64,
                ..MoeConfig::default()
            }),
            ..GptConfig::default()
        };
        let model = gpt(&cfg).unwrap();
        let spec = model.def.train.clone().unwrap();
        let graph = Graph::from_def(&model.def).unwrap();
        (
            graph,
            TrainSpec {
                clip_global_norm: None,
                ..spec
            },
        )
    }

    fn ops<'a>(g: &'a ReplicaGraph, op: &str) -> Vec<&'a NodeDef> {
        g.training.def.nodes.iter().filter(|n| n.op == op).collect()
    }

    #[test]
    fn each_worker_holds_its_experts_and_moves_tokens_by_two_all_to_alls_each_way() {
        let (graph, spec) = moe_gpt(4, 2);
        let layers = moe_layers(&graph, &graph.to_def()).unwrap();
        assert_eq!(layers.len(), 2);
        // c_fc and c_proj, weights and biases.
        assert_eq!(layers[0].variables.len(), 4, "{:?}", layers[0].variables);
        let graphs = expert_training(
            &graph,
            &spec,
            ExpertLayout::all(2).unwrap(),
            "idx",
            "targets",
            1 << 20,
        )
        .unwrap();
        for (i, g) in graphs.iter().enumerate() {
            for l in &layers {
                for var in &l.variables {
                    let shard = g
                        .training
                        .def
                        .nodes
                        .iter()
                        .find(|n| n.name == shard_name(var, i))
                        .unwrap_or_else(|| panic!("no shard {i} of {var}"));
                    let Some(AttrValue::Shape(s)) = shard.attrs.get("shape") else {
                        panic!("{var}: no shape");
                    };
                    assert_eq!(s.dims().unwrap()[0], Some(2), "{var}");
                    assert_eq!(shard.attrs["shard_offset"], AttrValue::Int(2 * i as i64));
                    assert_eq!(shard.device, format!("/job:worker/task:{i}"));
                    // Not all-reduced: no bucket packs its gradient.
                    let grad = &g
                        .training
                        .gradients
                        .iter()
                        .find(|(v, _)| *v == shard.name)
                        .unwrap()
                        .1;
                    assert!(
                        ops(g, "PackFlat").iter().all(|p| !p.inputs.contains(grad)),
                        "{var}'s gradient is all-reduced"
                    );
                    assert!(!g
                        .training
                        .def
                        .nodes
                        .iter()
                        .any(|n| &n.name == var && n.op == "Variable"));
                }
            }
            // 2 forward, 2 backward per layer; the aux losses gather probs and choices.
            assert_eq!(ops(g, "CollectiveAllToAll").len(), 8);
            assert_eq!(ops(g, "CollectiveAllGather").len(), 4);
            assert_eq!(
                ops(g, "CollectiveReduceScatter").len(),
                2,
                "probs' gradients only"
            );
            // The router is replicated and its gradient summed.
            let router = "transformer.h.0.mlp.router.weight";
            let grad = &g
                .training
                .gradients
                .iter()
                .find(|(v, _)| v == router)
                .unwrap()
                .1;
            assert!(ops(g, "PackFlat").iter().any(|p| p.inputs.contains(grad)));
            // Every collective after the one before it: one order on every worker.
            let by_name: HashMap<&str, &NodeDef> = g
                .training
                .def
                .nodes
                .iter()
                .map(|n| (n.name.as_str(), n))
                .collect();
            let typed = &g.graph;
            let chain: Vec<String> = typed
                .topo_order()
                .into_iter()
                .map(|i| typed.node(i))
                .filter(|n| n.op.starts_with("Collective") && !n.name.starts_with("eval/"))
                .map(|n| n.name.clone())
                .collect();
            // + a bucket, the loss and the dropped-token count.
            assert_eq!(chain.len(), 8 + 4 + 2 + 3, "{chain:?}");
            // The dropped count: the layers' MoeRoute `dropped` summed, all-reduced last, and
            // fetched every step.
            assert_eq!(chain.last().map(String::as_str), Some("moe/dropped/global"));
            assert_eq!(
                g.step_metrics,
                [(DROPPED_METRIC.to_string(), "moe/dropped/global".to_string())]
            );
            assert_eq!(
                by_name["moe/dropped/local"].inputs,
                ["transformer.h.0.mlp/route:3", "transformer.h.1.mlp/route:3"]
            );
            for pair in chain.windows(2) {
                assert!(
                    ancestors(&by_name, &pair[1]).contains(&pair[0]),
                    "{} is not after {}",
                    pair[1],
                    pair[0]
                );
            }
        }
        // The same collectives, in the same order, on both workers.
        let keys = |g: &ReplicaGraph| -> Vec<(String, AttrValue)> {
            let typed = &g.graph;
            typed
                .topo_order()
                .into_iter()
                .map(|i| typed.node(i))
                .filter(|n| n.op.starts_with("Collective"))
                .map(|n| (n.op.to_string(), n.attrs["instance_key"].clone()))
                .collect()
        };
        assert_eq!(keys(&graphs[0]), keys(&graphs[1]));
        // Worker 0 evaluates on a copy that joins every shard, with no collective.
        let eval = &graphs[0].eval.loss;
        assert!(eval.starts_with("eval/"), "{eval}");
        let joined = graphs[0]
            .training
            .def
            .nodes
            .iter()
            .find(|n| n.name == "eval/transformer.h.1.mlp.experts.c_fc.weight")
            .unwrap();
        assert_eq!(
            joined.inputs,
            [
                "transformer.h.1.mlp.experts.c_fc.weight/shard_0",
                "transformer.h.1.mlp.experts.c_fc.weight/shard_1"
            ]
        );
        let g0 = &graphs[0].training.def.nodes;
        assert!(g0
            .iter()
            .filter(|n| n.name.starts_with("eval/"))
            .all(|n| !n.op.starts_with("Collective")));
    }

    #[test]
    fn clipping_counts_every_workers_expert_gradients() {
        let (graph, mut spec) = moe_gpt(4, 1);
        spec.clip_global_norm = Some(1.0);
        let graphs = expert_training(
            &graph,
            &spec,
            ExpertLayout::all(2).unwrap(),
            "idx",
            "targets",
            1 << 20,
        )
        .unwrap();
        let g = &graphs[1];
        let scale = ops(g, "GlobalNormScale");
        assert_eq!(scale.len(), 1);
        let gather = "allreduce/clip/local/all_gather";
        assert!(
            scale[0].inputs.iter().any(|i| i == gather),
            "{:?}",
            scale[0].inputs
        );
        // Every update, the expert shards' included, reads a clipped gradient.
        let updates = ops(g, "ApplyAdamW");
        assert_eq!(updates.len(), g.training.gradients.len());
        for n in updates {
            assert!(
                n.inputs
                    .iter()
                    .any(|i| i.starts_with("allreduce/clip/grad_")),
                "{}: {:?}",
                n.name,
                n.inputs
            );
        }
    }

    #[test]
    fn experts_that_do_not_split_over_the_workers_are_refused_naming_both() {
        let (graph, spec) = moe_gpt(4, 1);
        let err = expert_training(
            &graph,
            &spec,
            ExpertLayout::all(3).unwrap(),
            "idx",
            "targets",
            1 << 20,
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("4 experts") && msg.contains("3 workers"),
            "{msg}"
        );
        // One worker holds every expert; four hold one each.
        assert!(expert_training(
            &graph,
            &spec,
            ExpertLayout::all(1).unwrap(),
            "idx",
            "targets",
            1 << 20
        )
        .is_ok());
        assert!(expert_training(
            &graph,
            &spec,
            ExpertLayout::all(4).unwrap(),
            "idx",
            "targets",
            1 << 20
        )
        .is_ok());
    }

    #[test]
    fn a_dense_model_and_uneven_batches_are_refused() {
        let (graph, _) = moe_gpt(4, 1);
        let dense = gpt(&GptConfig {
            vocab_size: 11,
            block_size: 4,
            n_layer: 1,
            n_head: 2,
            n_embd: 8,
            ..GptConfig::default()
        })
        .unwrap();
        let dense_graph = Graph::from_def(&dense.def).unwrap();
        let spec = TrainSpec {
            clip_global_norm: None,
            ..dense.def.train.clone().unwrap()
        };
        let err = expert_training(
            &dense_graph,
            &spec,
            ExpertLayout::all(2).unwrap(),
            "idx",
            "targets",
            1,
        )
        .unwrap_err();
        assert!(err.to_string().contains("no MoE layer"), "{err}");
        let built = REGISTRATION.build;
        let opts = super::super::StrategyOptions {
            batch_size: Some(7),
            ..Default::default()
        };
        let strategy = built(&opts).unwrap();
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 2)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let err = strategy.plan(&input).unwrap_err();
        assert!(err.to_string().contains("batch size 7"), "{err}");
    }

    #[test]
    fn ep2_over_four_workers_shards_in_groups_and_sums_expert_gradients_over_the_others() {
        let (graph, mut spec) = moe_gpt(4, 2);
        spec.clip_global_norm = Some(1.0);
        let layout = ExpertLayout::new(4, 2).unwrap();
        let tasks: Vec<String> = (0..4).map(|i| task_name("worker", i)).collect();
        let groups: Vec<(String, Vec<String>)> = layout
            .groups(&tasks)
            .into_iter()
            .map(|g| (g.key, g.members))
            .collect();
        let members = |r: &[usize]| r.iter().map(|&i| tasks[i].clone()).collect::<Vec<_>>();
        assert_eq!(
            groups,
            [
                ("experts_ep0".to_string(), members(&[0, 1])),
                ("experts_ep1".to_string(), members(&[2, 3])),
                ("experts_dp0".to_string(), members(&[0, 2])),
                ("experts_dp1".to_string(), members(&[1, 3])),
            ]
        );
        let graphs = expert_training(&graph, &spec, layout, "idx", "targets", 1 << 20).unwrap();
        let layers = moe_layers(&graph, &graph.to_def()).unwrap();
        let attr = |n: &NodeDef, k: &str| n.attrs.get(k).cloned();
        let text = |v: &str| Some(AttrValue::String(v.into()));
        for (i, g) in graphs.iter().enumerate() {
            let shard = i % 2;
            let ep_group = format!("experts_ep{}", i / 2);
            let dp_group = format!("experts_dp{shard}");
            let nodes = &g.training.def.nodes;
            for var in layers.iter().flat_map(|l| &l.variables) {
                let name = shard_name(var, shard);
                let v = nodes
                    .iter()
                    .find(|n| n.name == name && n.op == "Variable")
                    .unwrap_or_else(|| panic!("worker {i}: no {name}"));
                assert_eq!(
                    attr(v, "shard_offset"),
                    Some(AttrValue::Int(2 * shard as i64))
                );
                assert_eq!(v.device, format!("/job:worker/task:{i}"));
                // Its gradient is summed over the workers holding the same shard, and the
                // update reads the sum.
                let grad = &g
                    .training
                    .gradients
                    .iter()
                    .find(|(v, _)| *v == name)
                    .unwrap()
                    .1;
                let sum = nodes.iter().find(|n| &n.name == grad).unwrap();
                assert_eq!(sum.op, "CollectiveAllReduce", "{name}");
                assert_eq!(attr(sum, "group_key"), text(&dp_group));
                let update = nodes
                    .iter()
                    .find(|n| n.op == "ApplyAdamW" && n.inputs.first() == Some(&name))
                    .unwrap();
                assert!(
                    update
                        .inputs
                        .iter()
                        .any(|x| x.starts_with("allreduce/clip/grad_")),
                    "{:?}",
                    update.inputs
                );
                assert!(ops(g, "PackFlat")
                    .iter()
                    .filter(|p| p.name.starts_with("allreduce/bucket_"))
                    .all(|p| !p.inputs.contains(grad)));
            }
            // All-to-alls inside the expert-parallel group; the router's gathers, the buckets,
            // the loss and the dropped count over every worker; the clipping norm gathered over
            // the expert-parallel group (each shard counted once).
            for n in ops(g, "CollectiveAllToAll") {
                assert_eq!(attr(n, "group_key"), text(&ep_group), "{}", n.name);
                assert_eq!(attr(n, "group_size"), Some(AttrValue::Int(2)));
            }
            assert_eq!(ops(g, "CollectiveAllToAll").len(), 8);
            for n in ops(g, "CollectiveAllGather") {
                if n.name == "allreduce/clip/local/all_gather" {
                    assert_eq!(attr(n, "group_key"), text(&ep_group));
                    assert_eq!(attr(n, "group_size"), Some(AttrValue::Int(2)));
                } else {
                    assert_eq!(attr(n, "group_key"), text(GROUP), "{}", n.name);
                    assert_eq!(attr(n, "group_size"), Some(AttrValue::Int(4)));
                }
            }
            for n in ops(g, "CollectiveAllReduce") {
                if !n.name.starts_with("experts/") {
                    assert_eq!(attr(n, "group_key"), text(GROUP), "{}", n.name);
                }
            }
            // 2 layers × 4 expert variables summed over the expert-data group.
            assert_eq!(
                ops(g, "CollectiveAllReduce")
                    .iter()
                    .filter(|n| attr(n, "group_key") == text(&dp_group))
                    .count(),
                8
            );
        }
        // One order of collectives on every worker (group keys aside).
        let keys = |g: &ReplicaGraph| -> Vec<(String, AttrValue)> {
            let typed = &g.graph;
            typed
                .topo_order()
                .into_iter()
                .map(|i| typed.node(i))
                .filter(|n| n.op.starts_with("Collective"))
                .map(|n| (n.op.to_string(), n.attrs["instance_key"].clone()))
                .collect()
        };
        for g in &graphs[1..] {
            assert_eq!(keys(g), keys(&graphs[0]));
        }
        // Worker 0 evaluates with its group's two shards joined.
        let joined = graphs[0]
            .training
            .def
            .nodes
            .iter()
            .find(|n| n.name == "eval/transformer.h.0.mlp.experts.c_fc.weight")
            .unwrap();
        assert_eq!(
            joined.inputs,
            [
                "transformer.h.0.mlp.experts.c_fc.weight/shard_0",
                "transformer.h.0.mlp.experts.c_fc.weight/shard_1"
            ]
        );
        // The checkpoint's whole variables gather the two shards.
        let vars: Vec<VariablePlan> = ["fc/shard_0", "fc/shard_1"]
            .iter()
            .map(|n| VariablePlan {
                name: n.to_string(),
                dtype: DType::F32,
                dims: vec![2, 8],
                holders: vec![],
            })
            .collect();
        let layer = MoeLayer {
            variables: vec!["fc".into()],
            ..layers[0].clone()
        };
        let sharded = expert_shards(&[layer], &vars, layout.ep());
        assert_eq!(sharded[0].dims, [4, 8]);
        assert_eq!(sharded[0].shards, ["fc/shard_0", "fc/shard_1"]);
    }

    #[test]
    fn an_ep_that_does_not_divide_the_workers_or_the_experts_is_refused_naming_it() {
        let e = ExpertLayout::new(4, 3).unwrap_err().to_string();
        assert!(
            e.contains("mesh axis ep=3 does not divide the data-parallel axis dp (4)"),
            "{e}"
        );
        let (graph, spec) = moe_gpt(4, 1);
        let layout = ExpertLayout::new(8, 8).unwrap();
        let e = expert_training(&graph, &spec, layout, "idx", "targets", 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4 experts") && e.contains("ep=8"), "{e}");
        // ep = the workers: the all-worker layout, no extra groups.
        assert!(ExpertLayout::all(2).unwrap().groups(&[]).is_empty());
        assert_eq!(ExpertLayout::all(2).unwrap().ep_group(1), GROUP);
        assert_eq!(ExpertLayout::all(2).unwrap().expert_data_group(1), None);
    }

    #[test]
    fn expert_shards_cover_the_variables_and_their_same_shaped_slots() {
        let layer = MoeLayer {
            dispatch: "d".into(),
            combine: "c".into(),
            experts: 4,
            width: 8,
            expert_nodes: vec![],
            variables: vec!["fc".into()],
        };
        let var = |name: &str, dims: &[usize]| VariablePlan {
            name: name.into(),
            dtype: DType::F32,
            dims: dims.to_vec(),
            holders: vec![],
        };
        let variables = vec![
            var("fc/shard_0", &[2, 8, 3]),
            var("fc/shard_1", &[2, 8, 3]),
            var("fc/shard_0/adam_m", &[2, 8, 3]),
            var("fc/shard_1/adam_m", &[2, 8, 3]),
            // Not a slot of the shard, and a slot of another shape: left alone.
            var("fc/shard_0x", &[2, 8, 3]),
            var("fc/shard_0/count", &[]),
            var("router", &[4, 8]),
        ];
        let sharded = expert_shards(std::slice::from_ref(&layer), &variables, 2);
        assert_eq!(sharded.len(), 2);
        assert_eq!(sharded[0].logical, "fc");
        assert_eq!(sharded[0].dims, [4, 8, 3]);
        assert_eq!(sharded[0].shards, ["fc/shard_0", "fc/shard_1"]);
        assert_eq!(sharded[0].shard_dims.as_deref(), Some(&[2, 8, 3][..]));
        assert_eq!(sharded[1].logical, "fc/adam_m");
        assert_eq!(
            sharded[1].shards,
            ["fc/shard_0/adam_m", "fc/shard_1/adam_m"]
        );
    }

    #[test]
    fn all_to_all_bytes_are_the_capacity_slots_of_other_workers_experts() {
        // A static batch: 4 sequences of 4 tokens per worker.
        let (graph, spec) = moe_gpt(4, 1);
        let mut def = graph.to_def();
        for n in def.nodes.iter_mut().filter(|n| n.op == "Placeholder") {
            n.attrs
                .insert("shape".into(), AttrValue::Shape(Shape::known(&[4, 4])));
        }
        let spec = TrainSpec {
            clip_global_norm: None,
            ..spec
        };
        let graph = Graph::from_def(&def).unwrap();
        for workers in [2usize, 4] {
            let graphs = expert_training(
                &graph,
                &spec,
                ExpertLayout::all(workers).unwrap(),
                "idx",
                "targets",
                1 << 20,
            )
            .unwrap();
            let bytes = all_to_all_bytes(&graphs[0], workers);
            // 2 layers × (2 forward + 2 backward).
            assert_eq!(bytes.len(), 8, "{bytes:?}");
            // Capacity factor E = 4 over 16 tokens: min(ceil(16 / 4 · 4), 16) = 16 slots.
            let (e, c, d) = (4, 16, 8);
            let off_rank_slots = (workers - 1) * (e / workers) * c;
            for (name, b) in bytes {
                assert_eq!(b, Some(off_rank_slots * d * 4), "{name}");
            }
        }
    }
}
