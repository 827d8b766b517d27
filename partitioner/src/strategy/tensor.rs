//! Tensor parallelism (Megatron-LM) for the GPT of `graph/src/layers/gpt.rs`, as a graph
//! rewrite over the workers: every worker takes every batch whole and holds `1/T` of every
//! block's matrices, and the ranks' partial results meet in two all-reduces per block forward
//! and two backward. docs/tensor-parallel.md explains it with the placements of
//! [`crate::sharding`]; [`layout`] lists each weight's placement.
//!
//! Rank `r` of `T` (worker `r`):
//!
//! - **Attention**: `c_attn` is column-parallel — its `[3C, C]` weight (and bias) is cut along
//!   the output axis as 3 blocks (q, k, v), each into `T` pieces, so the rank holds the q, k and
//!   v of heads `[r·H/T, (r+1)·H/T)` — and attention runs on those `H/T` heads; `c_proj` is
//!   row-parallel (its `[C, C]` weight cut along the input axis), giving a partial sum that
//!   `g` (a sum all-reduce) makes whole before the (replicated) bias.
//! - **MLP**: `c_fc` column-parallel (`[4C/T, C]` per rank), GELU on the shard, `c_proj`
//!   row-parallel, then `g`.
//! - Each column-parallel layer's input goes through `f` (identity forward, all-reduce of its
//!   gradient backward): Megatron's `f` and `g` are the ops `CollectiveTpCopy` and
//!   `CollectiveTpReduce`, whose gradients are exactly those.
//! - **Vocabulary-parallel embedding**: `wte` `[V, C]` is padded with zero rows to `Vp`, a
//!   multiple of `T`, and cut along the vocabulary; the rank looks up the ids in its range (a
//!   one-hot product, zero rows for the others) and `g` sums the ranks' rows. The tied head
//!   `x·wteᵀ` then gives the rank's `Vp/T` logits only.
//! - **Vocabulary-parallel cross-entropy** (no rank holds the whole logits): the padded columns
//!   get −1e30 (exp gives exactly 0), `max` all-reduced (behind `StopGradient`: the loss does not
//!   depend on the shift), `Σ exp` and the target's logit each summed by `g`, so every rank
//!   computes the whole batch's loss, `log Σ exp − logit[target]`, equal to the unpadded model's.
//! - **Clipping** by global norm: `Σ‖g‖²` of the replicated parameters' gradients (whole and
//!   equal on every rank) plus the all-reduced `Σ‖g‖²` of the rank's shards' gradients.
//! - The variables keep the one-process initial values: rank `r`'s `{name}/tp_{r}_of_{T}` is
//!   its [`AxisSplit`] shard of `{name}` drawn under `{name}`'s stream (`Variable`'s
//!   `shard_parts`); the replicated ones (layer norms, `wpe`, row-parallel biases) keep their
//!   names. [`JobPlan::sharded`] lists the shards, so a checkpoint stores whole tensors and
//!   resumes at any `T` (or in one process).
//! - All collectives of a rank are chained by control edges in one topological order.
//! - Evaluation ([`eval`]): with the batch size known (`--batch-size`), the ranks of
//!   tensor-parallel group 0 run their own forward graphs on their shards, fed the held-out
//!   batch by worker 0, so no task holds the whole model (under ZeRO-3 each rank gathers its
//!   flat shards per use, the other replicas joining); otherwise worker 0 evaluates a copy of
//!   the forward graph, `eval/...`, whose weights are joined from every rank's shards.
//!
//! - **Data parallelism over tensor-parallel groups** (`--mesh dp=D,tp=T`, or `--tp T` over
//!   `D·T` workers): ranks in Megatron-core order ([`crate::mesh`]: tp fastest, so the TP
//!   groups are runs of `T` consecutive workers and the DP groups stride by `T`). Replica `d`
//!   (TP group `d`) takes part `d` of every global batch; its loss is weighted by the part's
//!   share of the batch and every gradient (shards and replicated parameters alike) is summed
//!   over the rank's DP group in fused buckets, exactly as `--strategy allreduce` averages
//!   ([`data`]), before clipping and the update. With `--zero-stage 1|2` the DP group runs
//!   ZeRO instead (`data::zero_step`: the rank keeps its `1/D` shard of its weights' Adam
//!   slots, clipping's norm summed over the DP group and then the TP group; at stage 3 also
//!   its `1/D` flat shard of each weight, all-gathered over the DP group before each use).
//!
//! - **Inside pipeline stages** (`--mesh dp=D,tp=T,pp=P`, `P > 1`): each rank's forward
//!   graph cut into stages by the pipeline rewrite ([`mesh3d`]).
//!
//! - **Beside expert parallelism** (`--mesh dp=D,tp=T,ep=E`): each MoE MLP replicated over
//!   tp, its experts spread over ep replicas ([`experts`]); with `--zero-stage 1|2`, the
//!   dense slots sharded over `data_t<t>` and each expert shard's over its holders.
//!
//! - **The 4-axis mesh** (`--mesh dp=D,tp=T,pp=P,ep=E`): the ep × tp ranks' graphs cut into
//!   pipeline stages ([`experts_pipeline`]; ZeRO 1 to 3 over each (stage, shard)'s groups).
//!
//! Not supported: dropout (a random mask per shard does not equal the one-process mask),
//! MoE blocks without an expert-parallel axis.

mod data;
pub(crate) mod eval;
pub mod experts;
mod experts_eval;
pub mod experts_pipeline;
pub mod hand;
pub mod mesh3d;

use super::allreduce::{check_job, fresh, node, worker_device};
use super::pipeline::zero::ReplicaZero;
use super::pipeline::Pipeline;
use super::{JobInput, JobPlan, Registration, ReplicaGraph, Strategy, StrategyError};
use crate::job::{CollectiveGroup, Schedule};
use crate::mesh::{Axis, Mesh};
use crate::sharding::Placement;
use crate::shards::AxisShardedVariable;
use dflow_graph::axis_split::AxisSplit;
use dflow_graph::train::{expand_training_graph, TrainSpec, TrainingGraph};
use dflow_graph::{AttrValue, DType, Graph, GraphDef, InputRef, NodeDef, Shape, Tensor};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

/// The collective group of the tensor-parallel ranks (one tensor-parallel group, `dp = 1`).
pub const GROUP: &str = "tensor";

/// The collective group of tensor-parallel group `d` (replica `d`) of `mesh`: [`GROUP`] when
/// there is one, `tensor_d{d}` otherwise.
pub fn tp_group(mesh: &Mesh, d: usize) -> String {
    if mesh.dp == 1 {
        GROUP.to_string()
    } else {
        format!("{GROUP}_d{d}")
    }
}

/// The data-parallel collective group of the ranks holding shard `t` (one per TP index).
pub fn dp_group(t: usize) -> String {
    format!("data_t{t}")
}

/// What the padded vocabulary columns' logits get before the softmax: `exp` of it is 0.
const MASKED_LOGIT: f32 = -1e30;

/// Megatron tensor parallelism over `tp` workers (see the module docs); no ps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallel {
    /// The tensor-parallel size (`None`: the worker count). The workers must be a multiple of
    /// it; the multiple is the data-parallel size.
    pub tp: Option<usize>,
    /// Data parallelism's fusion threshold: the most bytes of gradients in one all-reduce.
    pub bucket_bytes: usize,
    /// The global batch, when known: with several replicas, the data-parallel size must divide
    /// it.
    pub batch_size: Option<usize>,
    /// Tensor parallelism inside pipeline stages (`--mesh tp=T,pp=P`, P > 1): the pipeline's
    /// stages (`Some(P)`), micro-batches and schedule ([`mesh3d`]).
    pub pipeline: Option<Pipeline>,
    /// ZeRO's stage over the data-parallel axis (`--mesh dp=D,tp=T --zero-stage S`): each
    /// rank's weights get ZeRO over its data-parallel group in place of the all-reduce of
    /// their gradients (`data::zero_step`; stage 3 also shards the weights). Stages 1 to 3,
    /// `D > 1`; inside pipeline stages, over each (stage, shard)'s data-parallel group
    /// ([`mesh3d`]).
    pub zero_stage: Option<u8>,
}

/// `--strategy tensor`.
pub(super) static REGISTRATION: Registration = Registration {
    name: "tensor",
    about: "Megatron tensor parallelism for the GPT over --tp workers: column/row-parallel \
            attention and MLP, vocabulary-parallel embedding and loss; no ps",
    build: |opts| {
        if opts.asynchronous {
            return Err(options(
                "tensor parallelism is synchronous (every layer needs every rank); drop --async"
                    .into(),
            ));
        }
        if opts.tp == Some(0) {
            return Err(options("--tp must be at least 1".into()));
        }
        if let Some(ep) = opts.ep {
            // --mesh dp=D,tp=T,ep=E: the MoE layers' experts over ep (experts.rs).
            let tp = opts.tp.ok_or_else(|| {
                options(format!(
                    "ep={ep} beside tensor parallelism needs --tp (or --mesh tp=T)"
                ))
            })?;
            let zero_stage = opts.tensor_zero.then_some(opts.zero_stage);
            if let Some(p) = opts.stages.filter(|&p| p > 1) {
                // --mesh dp=D,tp=T,pp=P,ep=E (experts_pipeline.rs).
                return Ok(Box::new(experts_pipeline::TensorExpertPipeline {
                    tp,
                    ep,
                    pipeline: Pipeline {
                        stages: Some(p),
                        micro_batches: opts.micro_batches,
                        schedule: opts.schedule,
                        chunks: opts.chunks,
                        batch_size: opts.batch_size,
                    },
                    bucket_bytes: opts.bucket_bytes,
                    zero_stage,
                }));
            }
            if let Some(stage) = zero_stage.filter(|s| !matches!(s, 1..=3)) {
                return Err(options(format!(
                    "--zero-stage {stage} beside ep={ep} and tp={tp} does not run (ZeRO-1 to \
                     ZeRO-3 do); use --zero-stage 1, 2 or 3"
                )));
            }
            return Ok(Box::new(experts::TensorExpert {
                tp,
                ep,
                bucket_bytes: opts.bucket_bytes,
                batch_size: opts.batch_size,
                zero_stage,
            }));
        }
        Ok(Box::new(TensorParallel {
            tp: opts.tp,
            bucket_bytes: opts.bucket_bytes,
            batch_size: opts.batch_size,
            pipeline: opts.stages.filter(|&p| p > 1).map(|p| Pipeline {
                stages: Some(p),
                micro_batches: opts.micro_batches,
                schedule: opts.schedule,
                chunks: opts.chunks,
                batch_size: opts.batch_size,
            }),
            zero_stage: opts.tensor_zero.then_some(opts.zero_stage),
        }))
    },
};

fn options(message: String) -> StrategyError {
    StrategyError::Options {
        strategy: "tensor",
        message,
    }
}

impl Strategy for TensorParallel {
    fn name(&self) -> &'static str {
        REGISTRATION.name
    }

    fn describe(&self) -> String {
        let tp = match self.tp {
            Some(t) => format!("Megatron tensor-parallel training, tp={t}"),
            None => "Megatron tensor-parallel training over every worker".into(),
        };
        let tp = match self.zero_stage {
            Some(s) => format!("{tp}, ZeRO stage {s} over the data-parallel axis"),
            None => tp,
        };
        match &self.pipeline {
            Some(p) => format!("{tp}, inside the stages of {}", Strategy::describe(p)),
            None => tp,
        }
    }

    fn full_batches(&self) -> bool {
        // A pipeline's activations have a static batch.
        self.pipeline.is_some()
    }

    fn plan(&self, input: &JobInput<'_>) -> Result<JobPlan, StrategyError> {
        if let Some(pipeline) = &self.pipeline {
            return self.plan_mesh3d(input, pipeline);
        }
        let workers = input.workers();
        let tp = self.tp.unwrap_or(workers);
        let mesh = dp_tp_mesh(workers, tp, 1, self.batch_size)?;
        let tp_graphs = mesh_training_evaluating(
            input.graph,
            input.train,
            &mesh,
            self.bucket_bytes,
            self.zero_stage,
            input.features,
            input.labels,
            self.batch_size,
        )?;
        let placement = input.explicit_placement();
        let tasks: Vec<String> = input.worker_task_names();
        let mut groups = Vec::new();
        for (d, ranks) in mesh.groups(Axis::Tp).into_iter().enumerate() {
            groups.push(CollectiveGroup {
                key: tp_group(&mesh, d),
                members: ranks.iter().map(|&r| tasks[r].clone()).collect(),
            });
        }
        if mesh.dp > 1 {
            for (t, ranks) in mesh.groups(Axis::Dp).into_iter().enumerate() {
                groups.push(CollectiveGroup {
                    key: dp_group(t),
                    members: ranks.iter().map(|&r| tasks[r].clone()).collect(),
                });
            }
        }
        let mut plan = JobPlan::build(
            self.describe(),
            input,
            tp_graphs.graphs,
            &placement,
            Schedule::Lockstep,
            groups,
        )?;
        // Every rank of replica d takes part d of every batch (whole when dp = 1).
        plan.batch_parts = mesh.dp as u32;
        let zero_stage = hand::zero_stage(input.graph, &mesh, self.zero_stage)?;
        if let (Some(s), None) = (zero_stage, self.zero_stage) {
            // ZeRO chosen by the variables' dp placements, not by the flag.
            plan.strategy = format!(
                "{}, ZeRO stage {s} over the data-parallel axis (the dp placements)",
                plan.strategy
            );
        }
        if zero_stage.is_some() {
            plan.sharded = zero_slot_shards(input, &tp_graphs.shards, &plan.variables, &mesh);
        }
        plan.axis_sharded =
            sharded_variables(&tp_graphs.shards, &plan.variables, &plan.sharded, tp);
        Ok(plan)
    }
}

/// The `dp × tp` mesh of `workers` (with `ep` carved out of dp), checked against the global
/// batch `batch_size` when given: tp must divide the workers and dp the batch.
pub(crate) fn dp_tp_mesh(
    workers: usize,
    tp: usize,
    ep: usize,
    batch_size: Option<usize>,
) -> Result<Mesh, StrategyError> {
    if tp == 0 || workers % tp != 0 {
        return Err(options(format!(
            "--tp {tp} does not divide the cluster's {workers} workers: the workers are \
             dp × tp ranks (data parallelism over tensor-parallel groups of tp consecutive \
             workers); use a tp that divides {workers}, or dp × tp workers"
        )));
    }
    let mesh = Mesh::new(workers / tp, tp, 1)
        .and_then(|m| m.with_ep(ep))
        .map_err(|e| options(e.to_string()))?;
    if let Some(batch) = batch_size {
        mesh.check_divides(Axis::Dp, batch, "the global batch (--batch-size)")
            .map_err(|e| options(e.to_string()))?;
    }
    Ok(mesh)
}

impl TensorParallel {
    /// The plan of tensor parallelism inside pipeline stages, over `D = workers / (T·P)`
    /// replicas ([`mesh3d`]).
    fn plan_mesh3d(
        &self,
        input: &JobInput<'_>,
        pipeline: &Pipeline,
    ) -> Result<JobPlan, StrategyError> {
        let workers = input.workers();
        let pp = pipeline.stages.unwrap_or(1);
        let tp = self.tp.unwrap_or(workers / pp.max(1));
        if tp == 0 || pp == 0 || workers % (tp * pp) != 0 {
            return Err(options(format!(
                "tp={tp} × pp={pp} does not divide the cluster's {workers} workers: the workers \
                 are dp × tp × pp ranks; use tp and pp whose product divides {workers}"
            )));
        }
        let mesh = Mesh::new(workers / (tp * pp), tp, pp).map_err(|e| options(e.to_string()))?;
        if let Some(stage) = self.zero_stage {
            check_zero(&mesh, stage)?;
            super::zero::check_optimizer(input.train, "tensor")?;
        }
        if let Some(batch) = self.batch_size {
            mesh.check_divides(Axis::Dp, batch, "the global batch (--batch-size)")
                .map_err(|e| options(e.to_string()))?;
        }
        let zero = self.zero_stage.map(|stage| ReplicaZero {
            stage,
            bucket_bytes: self.bucket_bytes,
        });
        let graphs = mesh3d::mesh3d_training(
            input.graph,
            input.train,
            &mesh,
            pipeline,
            zero,
            input.features,
            input.labels,
        )?;
        let placement = crate::strategy::pipeline::placement_on_worker_0(input)?;
        let mut plan = JobPlan::build(
            self.describe(),
            input,
            graphs.graphs,
            &placement,
            Schedule::Lockstep,
            graphs.groups,
        )?;
        // The ranks of replica d take part d of every batch.
        plan.batch_parts = mesh.dp as u32;
        if self.zero_stage.is_some() {
            plan.sharded = zero_slot_shards(input, &graphs.shards, &plan.variables, &mesh);
        }
        plan.axis_sharded = sharded_variables(&graphs.shards, &plan.variables, &plan.sharded, tp);
        Ok(plan)
    }
}

/// ZeRO's shards among the plan's `variables` of a tensor-parallel job on `mesh`: its slot
/// shards `{w}/adam_m/shard_{d}_of_{D}` (and at stage 3 its weight shards) make the slots
/// `{w}/adam_m` of every TP shard `w` (of the weights `shards` splits) and replicated weight;
/// the TP shards' make the logical slots ([`sharded_variables`]).
fn zero_slot_shards(
    input: &JobInput<'_>,
    shards: &[ShardedWeight],
    variables: &[crate::job::VariablePlan],
    mesh: &Mesh,
) -> Vec<crate::shards::ShardedVariable> {
    let mut dims: BTreeMap<String, (DType, Vec<usize>)> = BTreeMap::new();
    for v in input
        .graph
        .to_def()
        .nodes
        .iter()
        .filter(|v| v.op == "Variable")
    {
        if let Ok(d) = static_dims(input.graph, &v.name) {
            let dtype = input
                .graph
                .find(&v.name)
                .and_then(|i| input.graph.output_type(i, 0))
                .map_or(DType::F32, |t| t.dtype);
            dims.insert(v.name.clone(), (dtype, d));
        }
    }
    for s in shards {
        let dtype = dims.get(&s.name).map_or(DType::F32, |d| d.0);
        for r in 0..mesh.tp {
            dims.insert(
                shard_name(&s.name, r, mesh.tp),
                (dtype, s.split.shard_dims(&s.dims)),
            );
        }
    }
    super::zero::slot_shards(variables, &dims, mesh.dp)
}

/// ZeRO beside tensor parallelism runs at stages 1 to 3 over a data-parallel axis of at least
/// two replicas (inside pipeline stages too); anything else is an error saying what to do.
fn check_zero(mesh: &Mesh, stage: u8) -> Result<(), StrategyError> {
    if mesh.dp < 2 {
        return Err(options(format!(
            "mesh {mesh} with --zero-stage {stage}: ZeRO shards over the data-parallel axis, and \
             this mesh has one replica; use dp ≥ 2 or drop --zero-stage"
        )));
    }
    if !matches!(stage, 1..=3) {
        return Err(options(format!(
            "mesh {mesh} with --zero-stage {stage}: ZeRO's stages are 1, 2 and 3"
        )));
    }
    Ok(())
}

/// One weight's tensor-parallel layout: how it is cut, and its placement on the `tp` axis.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedWeight {
    /// The variable (as the one-process graph names it).
    pub name: String,
    /// Its whole dimensions.
    pub dims: Vec<usize>,
    /// How it is cut.
    pub split: AxisSplit,
}

impl ShardedWeight {
    /// Its placement on the tensor-parallel axis.
    pub fn placement(&self) -> Placement {
        Placement::Shard(self.split.axis)
    }
}

/// The tensor-parallel graphs and the weights they shard.
#[derive(Clone, Debug)]
pub struct TensorGraphs {
    /// One training graph per rank.
    pub graphs: Vec<ReplicaGraph>,
    /// The sharded weights (every other variable is replicated).
    pub shards: Vec<ShardedWeight>,
}

/// The name of rank `r`'s shard of `var` over `tp` ranks.
pub fn shard_name(var: &str, r: usize, tp: usize) -> String {
    format!("{var}/tp_{r}_of_{tp}")
}

/// The GPT's layers as the rewrite addresses them (names from `graph/src/layers/gpt.rs`).
#[derive(Clone, Debug)]
struct Gpt {
    vocab: usize,
    embd: usize,
    block_size: i64,
    blocks: Vec<String>,
    heads: usize,
    hidden: usize,
    /// The head's weight (`transformer.wte.weight` when tied).
    head: String,
    /// Per block: its MLP is a mixture-of-experts layer, left unsplit (replicated over tp;
    /// only [`experts`] accepts such blocks).
    moe: Vec<bool>,
}

fn missing(what: &str) -> StrategyError {
    options(format!(
        "tensor parallelism rewrites the GPT of graph/src/layers/gpt.rs by its layer names; the \
         graph has no {what}"
    ))
}

fn static_dims(graph: &Graph, name: &str) -> Result<Vec<usize>, StrategyError> {
    graph
        .find(name)
        .and_then(|i| graph.output_type(i, 0))
        .and_then(|t| t.shape.as_static())
        .ok_or_else(|| missing(&format!("tensor `{name}` of static shape")))
}

fn find<'a>(def: &'a GraphDef, name: &str) -> Result<&'a NodeDef, StrategyError> {
    def.nodes
        .iter()
        .find(|n| n.name == name)
        .ok_or_else(|| missing(&format!("node `{name}`")))
}

fn int_list(n: &NodeDef, attr: &str) -> Result<Vec<i64>, StrategyError> {
    match n.attrs.get(attr) {
        Some(AttrValue::IntList(v)) => Ok(v.clone()),
        _ => Err(missing(&format!("list attribute `{attr}` on `{}`", n.name))),
    }
}

/// Why `--strategy tensor` cannot split `graph` (its forward graph `def`), if it cannot: it
/// splits placements written by hand (`_sharding`), or a GPT by its layer names (with MoE
/// blocks beside an ep axis, `with_experts`).
pub fn tensor_refusal(graph: &Graph, def: &GraphDef, with_experts: bool) -> Option<String> {
    if hand::declares_placements(graph) {
        return None;
    }
    Gpt::of_with_moe(graph, def, with_experts)
        .err()
        .map(|e| e.to_string())
}

impl Gpt {
    fn of(graph: &Graph, def: &GraphDef) -> Result<Gpt, StrategyError> {
        Gpt::of_with_moe(graph, def, false)
    }

    /// [`Gpt::of`]; with `allow_moe`, blocks whose MLP is an MoE layer (no `mlp.c_fc`) are
    /// accepted and marked in `moe` instead of refused.
    fn of_with_moe(graph: &Graph, def: &GraphDef, allow_moe: bool) -> Result<Gpt, StrategyError> {
        if let Some(d) = def.nodes.iter().find(|n| n.op == "Dropout") {
            return Err(options(format!(
                "dropout node `{}`: tensor parallelism does not run dropout (each shard would \
                 draw its own mask); build the GPT with dropout 0",
                d.name
            )));
        }
        if let Some(m) = def
            .nodes
            .iter()
            .find(|n| n.op.starts_with("Moe"))
            .filter(|_| !allow_moe)
        {
            return Err(options(format!(
                "MoE node `{}`: tensor parallelism splits dense MLPs only; an MoE GPT runs \
                 beside tensor parallelism with its experts over ep (--mesh dp=D,tp=T,ep=E), or \
                 with --mesh dp=D,ep=E (tp=1) or --strategy expert",
                m.name
            )));
        }
        let wte = static_dims(graph, "transformer.wte.weight")?;
        let [vocab, embd] = wte[..] else {
            return Err(missing("[vocab, n_embd] transformer.wte.weight"));
        };
        let head_node = find(def, "lm_head")?;
        let head = head_node
            .inputs
            .get(1)
            .cloned()
            .ok_or_else(|| missing("head weight input of `lm_head`"))?;
        let mut blocks = Vec::new();
        while graph
            .find(&format!(
                "transformer.h.{}.attn.c_attn.weight",
                blocks.len()
            ))
            .is_some()
        {
            blocks.push(format!("transformer.h.{}", blocks.len()));
        }
        let Some(first) = blocks.first() else {
            return Err(missing("block `transformer.h.0`"));
        };
        let q = int_list(find(def, &format!("{first}.attn/q_4d"))?, "shape")?;
        let (Some(&block_size), Some(&heads)) = (q.get(1), q.get(2)) else {
            return Err(missing("[-1, T, heads, head_dim] reshape `q_4d`"));
        };
        let moe: Vec<bool> = blocks
            .iter()
            .map(|b| allow_moe && graph.find(&format!("{b}.mlp.c_fc.weight")).is_none())
            .collect();
        let hidden = match blocks.iter().zip(&moe).find(|(_, &m)| !m) {
            Some((dense, _)) => static_dims(graph, &format!("{dense}.mlp.c_fc.weight"))?
                .first()
                .copied()
                .unwrap_or(0),
            None => 0,
        };
        Ok(Gpt {
            vocab,
            embd,
            block_size,
            blocks,
            heads: heads.max(0) as usize,
            hidden,
            head,
            moe,
        })
    }

    /// Every sharded weight of the layout at `tp`, after checking the dimensions divide.
    fn layout(&self, graph: &Graph, tp: usize) -> Result<Vec<ShardedWeight>, StrategyError> {
        let indivisible = |what: String, n: usize| {
            options(format!(
                "{what} is {n}, which does not divide by --tp {tp}; pick a --tp that divides it"
            ))
        };
        for (b, &moe) in self.blocks.iter().zip(&self.moe) {
            if self.heads % tp != 0 {
                return Err(indivisible(
                    format!("the number of heads (n_head) of {b}.attn"),
                    self.heads,
                ));
            }
            if !moe && self.hidden % tp != 0 {
                return Err(indivisible(
                    format!("the MLP width (4·n_embd) of {b}.mlp"),
                    self.hidden,
                ));
            }
        }
        let padded = self.vocab.div_ceil(tp) * tp;
        let mut out = Vec::new();
        let mut add = |name: String, axis: usize, blocks: usize, pad: Option<usize>| {
            let dims = static_dims(graph, &name)?;
            let Some(&len) = dims.get(axis) else {
                return Err(options(format!(
                    "`{name}` has shape {dims:?}; Megatron's layout cuts its axis {axis}"
                )));
            };
            let split = AxisSplit {
                axis,
                blocks,
                parts: tp,
                padded: pad.unwrap_or(len),
            };
            split
                .check(&dims)
                .map_err(|e| options(format!("`{name}`: {e}")))?;
            out.push(ShardedWeight { name, dims, split });
            Ok::<(), StrategyError>(())
        };
        add("transformer.wte.weight".into(), 0, 1, Some(padded))?;
        if self.head != "transformer.wte.weight" {
            add(self.head.clone(), 0, 1, Some(padded))?;
        }
        for (b, &moe) in self.blocks.iter().zip(&self.moe) {
            add(format!("{b}.attn.c_attn.weight"), 0, 3, None)?;
            if graph.find(&format!("{b}.attn.c_attn.bias")).is_some() {
                add(format!("{b}.attn.c_attn.bias"), 0, 3, None)?;
            }
            add(format!("{b}.attn.c_proj.weight"), 1, 1, None)?;
            if moe {
                // The MoE MLP stays whole (replicated over tp).
                continue;
            }
            add(format!("{b}.mlp.c_fc.weight"), 0, 1, None)?;
            if graph.find(&format!("{b}.mlp.c_fc.bias")).is_some() {
                add(format!("{b}.mlp.c_fc.bias"), 0, 1, None)?;
            }
            add(format!("{b}.mlp.c_proj.weight"), 1, 1, None)?;
        }
        Ok(out)
    }
}

/// The placements of Megatron's layout for the GPT `graph` at `tp`: every sharded weight with
/// its placement on the tensor-parallel axis (every other variable is replicated).
pub fn layout(graph: &Graph, tp: usize) -> Result<Vec<ShardedWeight>, StrategyError> {
    let def = graph.to_def();
    Gpt::of(graph, &def)?.layout(graph, tp)
}

/// One activation of the GPT under Megatron's layout, its placement derived by the sharding
/// rules ([`crate::sharding::rules`]) from the weights' placements.
#[derive(Clone, Debug, PartialEq)]
pub struct Activation {
    /// The node (in a block, after `transformer.h.{i}.`).
    pub node: &'static str,
    /// Its output's placement on the tensor-parallel axis.
    pub placement: Placement,
    /// The collective that makes it whole for its (replicated) consumer, when one is needed.
    pub made_whole: Option<crate::sharding::Transition>,
}

/// The placements of the GPT's activations under Megatron's layout, derived by the sharding
/// rules: the residual stream `Replicate`, column-parallel outputs `Shard(1)`, attention's heads
/// `Shard(1)` of `[B, H, S, D]`, row-parallel outputs and the vocabulary-parallel lookup
/// `Partial` (made whole by an all-reduce: `g`), the vocabulary-parallel loss `Replicate`. The
/// rewrite inserts the collectives these say.
pub fn megatron_activations() -> Result<Vec<Activation>, String> {
    use crate::sharding::{rules, transition};
    use Placement::{Replicate, Shard};
    let whole = |p: Placement| -> Result<Option<crate::sharding::Transition>, String> {
        Ok(match transition(p, Replicate)? {
            crate::sharding::Transition::Nothing => None,
            t => Some(t),
        })
    };
    let mut out = Vec::new();
    let mut add = |node: &'static str, placement: Placement, consumer_needs_whole: bool| {
        let made_whole = if consumer_needs_whole {
            whole(placement)?
        } else {
            None
        };
        out.push(Activation {
            node,
            placement,
            made_whole,
        });
        Ok::<(), String>(())
    };
    // wte [V, C] Shard(0) looked up at replicated ids: partial rows.
    add(
        "transformer.wte/lookup",
        rules::gather(Shard(0), Replicate, 2)?,
        true,
    )?;
    // Attention: c_attn [3C, C] Shard(0), x·Wᵀ.
    let qkv = rules::matmul(Replicate, Shard(0), false, true)?;
    add("attn.c_attn/matmul", qkv, false)?;
    let qkv = rules::elementwise("BiasAdd", &[(qkv, 2), (Shard(0), 1)], 2)?;
    add("attn.c_attn/bias_add", qkv, false)?;
    // [B·S, 3C/T] → q, k, v [B, H/T, S, D]: the sharded channels are the rank's heads.
    let heads = Shard(1);
    let scores = rules::batch_matmul(heads, heads, 4)?;
    add("attn/scores", scores, false)?;
    let probs = rules::last_axis("Softmax", scores, 4)?;
    add("attn/probs", probs, false)?;
    let mix = rules::batch_matmul(probs, heads, 4)?;
    add("attn/mix", mix, false)?;
    // [B, H/T, S, D] → [B·S, C/T]: channels sharded; c_proj [C, C] Shard(1).
    add("attn/merge_2d", Shard(1), false)?;
    add(
        "attn.c_proj/matmul",
        rules::matmul(Shard(1), Shard(1), false, true)?,
        true,
    )?;
    // MLP: c_fc [4C, C] Shard(0), GELU, c_proj [C, 4C] Shard(1).
    let fc = rules::matmul(Replicate, Shard(0), false, true)?;
    let fc = rules::elementwise("BiasAdd", &[(fc, 2), (Shard(0), 1)], 2)?;
    add("mlp.c_fc/bias_add", fc, false)?;
    let gelu = rules::elementwise("Gelu", &[(fc, 2)], 2)?;
    add("mlp.gelu", gelu, false)?;
    add(
        "mlp.c_proj/matmul",
        rules::matmul(gelu, Shard(1), false, true)?,
        true,
    )?;
    // The tied head x·wteᵀ: the rank's logits; the vocabulary-parallel loss, whole.
    let logits = rules::matmul(Replicate, Shard(0), false, true)?;
    add("lm_head", logits, false)?;
    add("xent", rules::cross_entropy(logits, Replicate)?, false)?;
    Ok(out)
}

/// The collective op the forward activation `node` needs before its replicated consumer:
/// `CollectiveTpReduce` (Megatron's `g`) for a partial sum; anything else is not Megatron's
/// layout.
fn forward_op(acts: &[Activation], node: &str) -> Result<&'static str, StrategyError> {
    let a = acts
        .iter()
        .find(|a| a.node == node)
        .ok_or_else(|| options(format!("no placement derived for `{node}`")))?;
    match a.made_whole {
        Some(crate::sharding::Transition::AllReduce) => Ok("CollectiveTpReduce"),
        other => Err(options(format!(
            "`{node}` is {} and needs {other:?} before its consumer; the rewrite inserts only \
             all-reduces of partial sums",
            a.placement
        ))),
    }
}

/// The tensor-parallel training graphs of the GPT `graph`, one per rank (see the module docs).
pub fn tensor_training(
    graph: &Graph,
    spec: &TrainSpec,
    tp: usize,
    features: &str,
    labels: &str,
) -> Result<TensorGraphs, StrategyError> {
    let mesh = Mesh::new(1, tp.max(1), 1).map_err(|e| options(e.to_string()))?;
    mesh_training(
        graph,
        spec,
        &mesh,
        super::allreduce::DEFAULT_BUCKET_BYTES,
        None,
        features,
        labels,
    )
}

/// The training graphs of the GPT `graph` on a `dp × tp` mesh, one per rank in Megatron-core
/// order (rank `t + tp·d` on worker task `t + tp·d`): replica `d` is the tensor-parallel layout
/// over its `tp` ranks, fed part `d` of every batch, its gradients summed over the rank's
/// data-parallel group in buckets of at most `bucket_bytes` (see the module docs). A pipeline
/// axis is [`mesh3d::mesh3d_training`]'s.
pub fn mesh_training(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    bucket_bytes: usize,
    zero_stage: Option<u8>,
    features: &str,
    labels: &str,
) -> Result<TensorGraphs, StrategyError> {
    mesh_training_evaluating(
        graph,
        spec,
        mesh,
        bucket_bytes,
        zero_stage,
        features,
        labels,
        None,
    )
}

/// [`mesh_training`], whose evaluation, given the held-out batches' rows (`eval_rows`, the
/// global batch size), runs over the ranks of tensor-parallel group 0 on their shards (no task
/// holds the whole model; [`eval`], under ZeRO-3 gathering each rank's flat shards per use);
/// without it worker 0 evaluates a copy that joins every rank's shards.
#[allow(clippy::too_many_arguments)]
pub fn mesh_training_evaluating(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    bucket_bytes: usize,
    zero_stage: Option<u8>,
    features: &str,
    labels: &str,
    eval_rows: Option<usize>,
) -> Result<TensorGraphs, StrategyError> {
    if mesh.pp != 1 {
        return Err(options(format!(
            "mesh {mesh}: tensor parallelism does not run over a pipeline axis yet"
        )));
    }
    let (zero_stage, zero_whole) = hand::zero_layout(graph, mesh, zero_stage)?;
    if let Some(stage) = zero_stage {
        check_zero(mesh, stage)?;
        super::zero::check_optimizer(spec, "tensor")?;
    }
    if hand::declares_placements(graph) {
        return hand::mesh_training(
            graph,
            spec,
            mesh,
            bucket_bytes,
            zero_stage,
            &zero_whole,
            features,
            labels,
        );
    }
    let tp = mesh.tp;
    let loss_dtype = check_job(graph, spec, mesh.size(), features, labels)?;
    if loss_dtype != DType::F32 {
        return Err(options(format!(
            "the loss is {loss_dtype}; the vocabulary-parallel loss is built in f32"
        )));
    }
    let def = graph.to_def();
    let gpt = Gpt::of(graph, &def)?;
    let shards = gpt.layout(graph, tp)?;
    let mut graphs = Vec::with_capacity(mesh.size());
    for rank in 0..mesh.size() {
        let at = RankAt::on_mesh(mesh, rank, bucket_bytes, zero_stage);
        graphs.push(rank_graph(
            &def, &gpt, &shards, spec, &at, features, labels,
        )?);
    }
    let zero3 = zero_stage.filter(|&s| s >= 3).map(|_| mesh.dp);
    let mut sharded_eval = false;
    if let Some(rows) = eval_rows {
        // Tensor-parallel group 0's ranks, without data parallelism: their forward graphs.
        let mut ranks = (0..tp)
            .map(|t| {
                let at = RankAt::on_mesh(mesh, t, bucket_bytes, None);
                let at = RankAt { data: None, ..at };
                rank_forward(&def, &gpt, &shards, spec, &at, features, labels)
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Under ZeRO-3 each rank gathers its flat shards per use over its dp group, as
        // training's forward does, the other replicas joining with theirs.
        let zero = zero3.map(|dp| eval::Zero3 { dp, tp });
        let mut gathers = Vec::new();
        if let Some(zero) = &zero {
            for (t, rank) in ranks.iter_mut().enumerate() {
                let training = &graphs[t].training.def;
                gathers.push(eval::flat_gathers(rank, t, zero, training)?);
            }
        }
        let base = eval::first_free_instance(&graphs);
        let feeds = eval::EvalFeeds {
            features,
            labels,
            rows,
        };
        let zero = zero.as_ref().map(|z| (z, gathers.as_slice()));
        let shared = HashSet::new();
        sharded_eval =
            eval::add_sharded_eval(&mut graphs, &ranks, spec, &feeds, base, zero, &shared)?;
    }
    if !sharded_eval {
        if let Some(g0) = graphs.first_mut() {
            let on_rank =
                |v: &NodeDef, r: usize, d: usize| worker_device(&v.name, &v.device, r + tp * d);
            eval_copy(g0, &def, &shards, spec, tp, &on_rank, false, zero3)?;
        }
    }
    Ok(TensorGraphs { graphs, shards })
}

/// Where one rank's graph goes: its shard index, the worker task holding it, its
/// tensor-parallel group, and (with data parallelism) its replica.
struct RankAt {
    /// The shard index (tensor-parallel coordinate).
    t: usize,
    /// The tensor-parallel size.
    tp: usize,
    /// The worker task.
    task: usize,
    /// The tensor-parallel collective group.
    group: String,
    /// The replica's part of the batch and data-parallel group, when `dp > 1`.
    data: Option<data::Replica>,
}

impl RankAt {
    /// Rank `rank` of a dp × tp `mesh` (Megatron-core order): its shard, its tensor-parallel
    /// group and, when `dp > 1`, its replica's part of the batch and data-parallel group (with
    /// ZeRO at `zero_stage` over it, if any).
    fn on_mesh(mesh: &Mesh, rank: usize, bucket_bytes: usize, zero_stage: Option<u8>) -> RankAt {
        let (t, d, _) = mesh.coords(rank);
        RankAt {
            t,
            tp: mesh.tp,
            task: rank,
            group: tp_group(mesh, d),
            data: (mesh.dp > 1).then(|| data::Replica {
                part: d,
                group: dp_group(t),
                bucket_bytes,
                ranks: mesh.dp,
                zero_stage,
                zero_whole: HashSet::new(),
            }),
        }
    }
}

/// Adds nodes to one rank's graph.
struct Nodes {
    taken: HashSet<String>,
    added: Vec<NodeDef>,
    device: String,
    instance: i64,
    /// The tensor-parallel group its collectives run in.
    group: String,
}

impl Nodes {
    fn add(
        &mut self,
        base: &str,
        op: &str,
        inputs: Vec<String>,
        attrs: Vec<(&str, AttrValue)>,
    ) -> String {
        let name = fresh(&mut self.taken, base);
        let mut n = node(&name, op, inputs, &self.device);
        n.attrs = attrs.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        self.added.push(n);
        name
    }

    fn collective(&mut self, base: &str, op: &str, input: String, max: bool) -> String {
        let group = self.group.clone();
        self.collective_in(&group, base, op, input, if max { "max" } else { "sum" })
    }

    /// A collective `op` of `input` in `group`, reducing by `reduce`.
    fn collective_in(
        &mut self,
        group: &str,
        base: &str,
        op: &str,
        input: String,
        reduce: &str,
    ) -> String {
        let mut attrs = vec![
            ("group_key", AttrValue::String(group.into())),
            ("instance_key", AttrValue::Int(self.instance)),
        ];
        if reduce != "sum" {
            attrs.push(("reduce", AttrValue::String(reduce.into())));
        }
        self.instance += 1;
        self.add(base, op, vec![input], attrs)
    }

    fn constant(&mut self, base: &str, t: Tensor) -> String {
        self.add(
            base,
            "Const",
            vec![],
            vec![("value", AttrValue::Tensor(Arc::new(t)))],
        )
    }

    fn reshape(&mut self, base: &str, input: String, dims: &[i64]) -> String {
        self.add(
            base,
            "Reshape",
            vec![input],
            vec![("shape", AttrValue::IntList(dims.to_vec()))],
        )
    }

    fn reduce(&mut self, base: &str, op: &str, input: String) -> String {
        self.add(
            base,
            op,
            vec![input],
            vec![
                ("axes", AttrValue::IntList(vec![1])),
                ("keep_dims", AttrValue::Bool(true)),
            ],
        )
    }
}

fn bad(e: impl std::fmt::Display) -> StrategyError {
    options(e.to_string())
}

/// `[r·n, (r+1)·n)` as an i64 vector: the vocabulary ids of rank `r`'s shard.
fn id_range(r: usize, n: usize) -> Result<Tensor, StrategyError> {
    let ids: Vec<i64> = (r * n..(r + 1) * n).map(|i| i as i64).collect();
    Tensor::from_slice(&[n], &ids).map_err(bad)
}

/// Redirects every data input reading `from:0` to `to`.
fn redirect(nodes: &mut [NodeDef], from: &str, to: &str, except: &str) {
    for n in nodes.iter_mut().filter(|n| n.name != except) {
        for i in &mut n.inputs {
            if matches!(InputRef::parse(i), Ok(InputRef::Data { node, index: 0 }) if node == from) {
                *i = to.to_string();
            }
        }
    }
}

/// One rank's forward graph ([`rank_forward`]): the Megatron rewrite of the one-process GPT.
struct RankForward {
    /// The forward graph, pruned to what the loss and metrics need, every op on the rank's
    /// worker.
    def: GraphDef,
    /// Each sharded variable's one-process name → the rank's shard's name.
    renames: HashMap<String, String>,
    /// The next free collective instance key (more than every key of `def`).
    instance: i64,
}

/// Rank `at.t`'s forward graph: its shards in place of the sharded weights, Megatron's `f`
/// and `g` around the column- and row-parallel layers (collectives in group `at.group`), the
/// vocabulary-parallel embedding and cross-entropy (see the module docs).
fn rank_forward(
    forward: &GraphDef,
    gpt: &Gpt,
    shards: &[ShardedWeight],
    spec: &TrainSpec,
    at: &RankAt,
    features: &str,
    labels: &str,
) -> Result<RankForward, StrategyError> {
    let (r, tp) = (at.t, at.tp);
    let device = worker_device("", "", at.task)?;
    let mut def = forward.clone();
    def.train = None;
    let mut n = Nodes {
        taken: def.nodes.iter().map(|x| x.name.clone()).collect(),
        added: Vec::new(),
        device: device.clone(),
        instance: 1,
        group: at.group.clone(),
    };
    // The shards, renamed, drawn as their part of the whole variable.
    let mut renames: HashMap<String, String> = HashMap::new();
    for s in shards {
        let name = shard_name(&s.name, r, tp);
        if n.taken.contains(&name) {
            return Err(StrategyError::NameTaken {
                node: s.name.clone(),
                name,
            });
        }
        n.taken.insert(name.clone());
        let v = def
            .nodes
            .iter_mut()
            .find(|x| x.name == s.name)
            .ok_or_else(|| missing(&format!("variable `{}`", s.name)))?;
        shard_variable(v, s, r);
        renames.insert(s.name.clone(), name);
    }
    let acts = megatron_activations().map_err(options)?;
    let f = |n: &mut Nodes, base: &str, input: String| {
        n.collective(&format!("{base}/tp_copy"), "CollectiveTpCopy", input, false)
    };
    let c = gpt.embd as i64;
    let t = gpt.block_size;
    let heads = (gpt.heads / tp) as i64;
    let hd = c / gpt.heads.max(1) as i64;
    // Vocabulary-parallel embedding: a one-hot product with the rank's rows, summed by g.
    let vs = shards[0].split.shard_dims(&shards[0].dims)[0];
    let range = n.constant("tp/vocab_ids", id_range(r, vs)?);
    let lookup = find(&def, "transformer.wte/lookup")?.clone();
    let ids = lookup
        .inputs
        .get(1)
        .cloned()
        .ok_or_else(|| missing("ids input of `transformer.wte/lookup`"))?;
    let ids3 = n.reshape("transformer.wte/tp_ids", ids, &[-1, t, 1]);
    let hit = n.add(
        "transformer.wte/tp_hit",
        "Equal",
        vec![ids3, range.clone()],
        vec![],
    );
    let onehot = n.add(
        "transformer.wte/tp_onehot",
        "Cast",
        vec![hit],
        vec![("DstT", AttrValue::DType(DType::F32))],
    );
    let onehot2 = n.reshape("transformer.wte/tp_onehot_2d", onehot, &[-1, vs as i64]);
    let rows = n.add(
        "transformer.wte/tp_rows",
        "MatMul",
        vec![onehot2, "transformer.wte.weight".into()],
        vec![],
    );
    let rows3 = n.reshape("transformer.wte/tp_rows_3d", rows, &[-1, t, c]);
    let summed = n.collective(
        "transformer.wte/tp_reduce",
        forward_op(&acts, "transformer.wte/lookup")?,
        rows3,
        false,
    );
    redirect(&mut def.nodes, &lookup.name, &summed, "");
    def.nodes.retain(|x| x.name != lookup.name);

    for (b, &moe) in gpt.blocks.iter().zip(&gpt.moe) {
        let attn = format!("{b}.attn");
        // Column-parallel c_attn on f(x); attention on the rank's heads.
        let mm = format!("{attn}.c_attn/matmul");
        let x = find(&def, &mm)?.inputs[0].clone();
        let fx = f(&mut n, &format!("{attn}.c_attn"), x);
        if let Some(m) = def.nodes.iter_mut().find(|x| x.name == mm) {
            m.inputs[0] = fx;
        }
        for part in ["q_4d", "k_4d", "v_4d"] {
            if let Some(m) = def
                .nodes
                .iter_mut()
                .find(|x| x.name == format!("{attn}/{part}"))
            {
                m.attrs
                    .insert("shape".into(), AttrValue::IntList(vec![-1, t, heads, hd]));
            }
        }
        if let Some(m) = def
            .nodes
            .iter_mut()
            .find(|x| x.name == format!("{attn}/merge_2d"))
        {
            m.attrs
                .insert("shape".into(), AttrValue::IntList(vec![-1, heads * hd]));
        }
        // Row-parallel c_proj: partial sums made whole by g before the bias.
        let projs = [
            (format!("{attn}.c_proj"), "attn.c_proj/matmul"),
            (format!("{b}.mlp.c_proj"), "mlp.c_proj/matmul"),
        ];
        // An MoE MLP is replicated over tp: no f or g around it.
        for (proj, act) in projs.into_iter().take(if moe { 1 } else { 2 }) {
            let mm = format!("{proj}/matmul");
            find(&def, &mm)?;
            let g = n.collective(
                &format!("{proj}/tp_reduce"),
                forward_op(&acts, act)?,
                mm.clone(),
                false,
            );
            redirect(&mut def.nodes, &mm, &g, "");
        }
        if moe {
            continue;
        }
        // Column-parallel c_fc on f(x).
        let mm = format!("{b}.mlp.c_fc/matmul");
        let x = find(&def, &mm)?.inputs[0].clone();
        let fx = f(&mut n, &format!("{b}.mlp.c_fc"), x);
        if let Some(m) = def.nodes.iter_mut().find(|x| x.name == mm) {
            m.inputs[0] = fx;
        }
    }
    // The head on f(x): the rank's logits.
    let x = find(&def, "lm_head")?.inputs[0].clone();
    let fx = f(&mut n, "lm_head", x);
    if let Some(m) = def.nodes.iter_mut().find(|x| x.name == "lm_head") {
        m.inputs[0] = fx;
    }
    // Vocabulary-parallel cross-entropy in place of `xent`.
    let xent = find(&def, "xent")?.clone();
    if xent.op != "SparseSoftmaxCrossEntropyWithLogits" {
        return Err(missing("SparseSoftmaxCrossEntropyWithLogits `xent`"));
    }
    let targets = xent
        .inputs
        .get(1)
        .cloned()
        .ok_or_else(|| missing("labels input of `xent`"))?;
    let mut logits = xent.inputs[0].clone();
    let valid = gpt.vocab.saturating_sub(r * vs).min(vs);
    if valid < vs {
        let mask: Vec<f32> = (0..vs)
            .map(|j| if j < valid { 0.0 } else { MASKED_LOGIT })
            .collect();
        let mask = n.constant(
            "xent/tp_padding_mask",
            Tensor::from_slice(&[vs], &mask).map_err(bad)?,
        );
        logits = n.add("xent/tp_masked", "Add", vec![logits, mask], vec![]);
    }
    let local_max = n.reduce("xent/tp_local_max", "Max", logits.clone());
    let global_max = n.collective("xent/tp_max", "CollectiveAllReduce", local_max, true);
    let shift = n.add("xent/tp_shift", "StopGradient", vec![global_max], vec![]);
    let shifted = n.add("xent/tp_shifted", "Sub", vec![logits, shift], vec![]);
    let exp = n.add("xent/tp_exp", "Exp", vec![shifted.clone()], vec![]);
    let local_sum = n.reduce("xent/tp_local_sum_exp", "Sum", exp);
    let sum = n.collective("xent/tp_sum_exp", "CollectiveTpReduce", local_sum, false);
    let lse = n.add("xent/tp_log_sum_exp", "Log", vec![sum], vec![]);
    let t2 = n.reshape("xent/tp_targets", targets, &[-1, 1]);
    let is_target = n.add("xent/tp_is_target", "Equal", vec![t2, range], vec![]);
    let onehot = n.add(
        "xent/tp_target_onehot",
        "Cast",
        vec![is_target],
        vec![("DstT", AttrValue::DType(DType::F32))],
    );
    let picked = n.add("xent/tp_picked", "Mul", vec![shifted, onehot], vec![]);
    let local_target = n.reduce("xent/tp_local_target_logit", "Sum", picked);
    let target = n.collective(
        "xent/tp_target_logit",
        "CollectiveTpReduce",
        local_target,
        false,
    );
    let per_token = n.add("xent/tp_per_token", "Sub", vec![lse, target], vec![]);
    if let Some(x) = def.nodes.iter_mut().find(|x| x.name == "xent") {
        *x = node("xent", "Reshape", vec![per_token], &device);
        x.attrs.insert("shape".into(), AttrValue::IntList(vec![-1]));
    }
    def.nodes.extend(std::mem::take(&mut n.added));
    // Renamed shards; everything on the rank; only what the loss and metrics need.
    onto_rank(&mut def.nodes, &renames, at.task)?;
    let mut keep: Vec<String> = vec![spec.loss.clone()];
    keep.extend(spec.metrics.iter().cloned());
    keep.push(features.to_string());
    keep.push(labels.to_string());
    prune(&mut def, &keep);
    Ok(RankForward {
        def,
        renames,
        instance: n.instance,
    })
}

fn rank_graph(
    forward: &GraphDef,
    gpt: &Gpt,
    shards: &[ShardedWeight],
    spec: &TrainSpec,
    at: &RankAt,
    features: &str,
    labels: &str,
) -> Result<ReplicaGraph, StrategyError> {
    let device = worker_device("", "", at.task)?;
    let RankForward {
        mut def,
        renames,
        instance,
    } = rank_forward(forward, gpt, shards, spec, at, features, labels)?;

    // With data parallelism, the replica's loss weighted by its share of the batch.
    let weighting = at
        .data
        .as_ref()
        .map(|_| data::weight_loss(&mut def, &spec.loss, &device));
    // The training step, clipped across the shards.
    let (mut training, typed) = expand_training_graph(
        &def,
        &TrainSpec {
            clip_global_norm: None,
            loss: weighting
                .as_ref()
                .map_or_else(|| spec.loss.clone(), |w| w.weighted.clone()),
            ..spec.clone()
        },
    )?;
    let mut n = Nodes {
        taken: training.def.nodes.iter().map(|x| x.name.clone()).collect(),
        added: Vec::new(),
        device: device.clone(),
        instance,
        group: at.group.clone(),
    };
    data_parallel_step(
        &mut training,
        &typed,
        &mut n,
        at,
        weighting.as_ref(),
        &renames,
        spec.clip_global_norm,
        &def,
    )?;
    finish_rank(
        training,
        at,
        weighting.map(|w| w.weight),
        spec,
        features,
        labels,
    )
}

/// Rank `at`'s graph once its step is complete: its collectives chained in one order,
/// validated, fed its replica's part of every batch (weighted by `weight` when there are
/// several replicas; the whole batch, unweighted, when there is one), evaluated on `spec`'s
/// loss and metrics.
fn finish_rank(
    mut training: TrainingGraph,
    at: &RankAt,
    weight: Option<String>,
    spec: &TrainSpec,
    features: &str,
    labels: &str,
) -> Result<ReplicaGraph, StrategyError> {
    chain_collectives(&mut training)?;
    let worker = at.data.as_ref().map_or(0, |d| d.part);
    ReplicaGraph::of_replica(training, worker, (features, labels), weight, spec)
}

/// The end of rank `at`'s step after autodiff, shared by the GPT's layout and placements by
/// hand: with data parallelism, every gradient summed over the rank's data-parallel group
/// ([`data::reduce_gradients`]) or, with ZeRO at `at.data.zero_stage`, [`data::zero_step`]
/// over it (stage 3 then shards the parameters: [`shard_parameters`]); clipping by `clip`
/// across the tensor-parallel shards (`renames`: each sharded variable's name on this rank).
/// `weighting` is the replica's weighted loss, `forward` the rank's forward graph; the nodes
/// added are appended to `training`.
#[allow(clippy::too_many_arguments)]
fn data_parallel_step(
    training: &mut TrainingGraph,
    typed: &Graph,
    n: &mut Nodes,
    at: &RankAt,
    weighting: Option<&data::Weighting>,
    renames: &HashMap<String, String>,
    clip: Option<f64>,
    forward: &GraphDef,
) -> Result<(), StrategyError> {
    let zero_stage = at.data.as_ref().and_then(|d| d.zero_stage);
    // ZeRO-3: the parameters to shard over the dp group, and the group.
    let mut zero3 = None;
    match (&at.data, weighting, zero_stage) {
        (Some(replica), Some(w), Some(stage)) if !replica.zero_whole.is_empty() => {
            let params = mixed_zero_step(training, typed, n, at, replica, stage, renames, clip)?;
            data::global_loss(training, n, replica, &w.weighted);
            if stage >= 3 {
                zero3 = Some((params, data::shard_group(replica, stage)));
            }
        }
        (Some(replica), Some(w), Some(stage)) => {
            let sharded: HashSet<String> = renames.values().cloned().collect();
            let params = data::zero_step(
                training,
                typed,
                n,
                replica,
                stage,
                &w.weighted,
                &at.group,
                &sharded,
                clip,
            )?;
            if stage >= 3 {
                zero3 = Some((params, data::shard_group(replica, stage)));
            }
        }
        (data, weighting, _) => {
            if let (Some(replica), Some(w)) = (data, weighting) {
                data::reduce_gradients(training, typed, n, replica, &w.weighted)?;
            }
            if let Some(clip) = clip {
                clip_across_shards(training, n, renames, clip);
            }
        }
    }
    training.def.nodes.extend(std::mem::take(&mut n.added));
    if let Some((params, group)) = zero3 {
        shard_parameters(training, forward, &params, &group, n.instance)?;
    }
    Ok(())
}

/// Gives the renamed nodes (a variable's shard) their new names, points every input at them,
/// and puts every node on worker `task` (no colocation: the rank's graph is all on it).
pub(super) fn onto_rank(
    nodes: &mut [NodeDef],
    renames: &HashMap<String, String>,
    task: usize,
) -> Result<(), StrategyError> {
    for d in nodes {
        if let Some(new) = renames.get(&d.name) {
            d.name = new.clone();
        }
        for i in &mut d.inputs {
            let (name, prefix, suffix) = match InputRef::parse(i) {
                Ok(InputRef::Data { node, index }) => {
                    let suffix = if index == 0 {
                        String::new()
                    } else {
                        format!(":{index}")
                    };
                    (node, "", suffix)
                }
                Ok(InputRef::Control(node)) => (node, "^", String::new()),
                Err(_) => continue,
            };
            if let Some(new) = renames.get(&name) {
                *i = format!("{prefix}{new}{suffix}");
            }
        }
        d.device = worker_device(&d.name, &d.device, task)?;
        d.colocate_with.clear();
    }
    Ok(())
}

/// Makes `v` rank `r`'s shard of `s` (the caller renames it).
fn shard_variable(v: &mut NodeDef, s: &ShardedWeight, r: usize) {
    let ints = [
        ("shard_axis", s.split.axis),
        ("shard_blocks", s.split.blocks),
        ("shard_parts", s.split.parts),
        ("shard_index", r),
        ("shard_padded", s.split.padded),
    ];
    v.attrs.insert(
        "shape".into(),
        AttrValue::Shape(Shape::known(&s.split.shard_dims(&s.dims))),
    );
    v.attrs
        .insert("shard_of".into(), AttrValue::Shape(Shape::known(&s.dims)));
    v.attrs.insert(
        "shard_name".into(),
        AttrValue::String(s.name.as_str().into()),
    );
    for (k, x) in ints {
        v.attrs.insert(k.into(), AttrValue::Int(x as i64));
    }
}

/// Drops every node none of `keep` depends on (the one-process `logits` reshape reads the
/// whole vocabulary).
fn prune(def: &mut GraphDef, keep: &[String]) {
    let by_name: HashMap<&str, &NodeDef> = def.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let mut seen: HashSet<String> = HashSet::new();
    let mut stack: Vec<String> = keep
        .iter()
        .map(|k| k.split(':').next().unwrap_or(k).to_string())
        .collect();
    while let Some(name) = stack.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        if let Some(n) = by_name.get(name.as_str()) {
            for i in &n.inputs {
                match InputRef::parse(i) {
                    Ok(InputRef::Data { node, .. }) | Ok(InputRef::Control(node)) => {
                        stack.push(node)
                    }
                    Err(_) => {}
                }
            }
        }
    }
    def.nodes.retain(|n| seen.contains(&n.name));
}

/// Clipping by the global norm of the whole model's gradient: the replicated parameters'
/// `Σ‖g‖²` (equal on every rank) plus the all-reduced sum of the shards'.
fn clip_across_shards(
    training: &mut TrainingGraph,
    n: &mut Nodes,
    renames: &HashMap<String, String>,
    clip: f64,
) {
    let Some(total) = squared_norm_across_shards(&training.gradients, n, renames) else {
        return;
    };
    let scale = n.add(
        "tp/clip/global_norm_scale",
        "GlobalNormScale",
        vec![total],
        global_norm_attrs(clip),
    );
    let grads = training.gradients.clone();
    scale_gradients(training, n, &grads, &scale);
}

/// `GlobalNormScale`'s attributes clipping at `clip` from a squared norm.
fn global_norm_attrs(clip: f64) -> Vec<(&'static str, AttrValue)> {
    vec![
        ("clip_norm", AttrValue::Float(clip)),
        ("squared_norm", AttrValue::Bool(true)),
    ]
}

/// `Σ‖g‖²` of the whole model's gradients `grads` (variable, gradient): the replicated
/// parameters' (equal on every rank) plus the sum over the tensor-parallel group of the
/// shards' (`renames`: each sharded variable's name on this rank); `None` when `grads` is empty.
fn squared_norm_across_shards(
    grads: &[(String, String)],
    n: &mut Nodes,
    renames: &HashMap<String, String>,
) -> Option<String> {
    let sharded: HashSet<&String> = renames.values().collect();
    type Grads<'a> = Vec<&'a (String, String)>;
    let (shard_grads, replicated): (Grads<'_>, Grads<'_>) =
        grads.iter().partition(|(v, _)| sharded.contains(v));
    // With no shard (placements by hand that shard activations only), no sum over the group.
    let mut total = (!shard_grads.is_empty()).then(|| {
        let local = n.add(
            "tp/clip/shards_squared_norm",
            "SquaredNorm",
            shard_grads.iter().map(|(_, g)| g.clone()).collect(),
            vec![],
        );
        n.collective(
            "tp/clip/shards_squared_norm_sum",
            "CollectiveAllReduce",
            local,
            false,
        )
    });
    if !replicated.is_empty() {
        let rep = n.add(
            "tp/clip/replicated_squared_norm",
            "SquaredNorm",
            replicated.iter().map(|(_, g)| g.clone()).collect(),
            vec![],
        );
        total = Some(match total {
            Some(t) => n.add("tp/clip/squared_norm", "Add", vec![t, rep], vec![]),
            None => rep,
        });
    }
    total
}

/// Multiplies each gradient of `grads` (variable, gradient) by `scale` where the updates read
/// it.
fn scale_gradients(
    training: &mut TrainingGraph,
    n: &mut Nodes,
    grads: &[(String, String)],
    scale: &str,
) {
    let mut clipped: HashMap<String, String> = HashMap::new();
    for (k, (_, g)) in grads.iter().enumerate() {
        let c = n.add(
            &format!("tp/clip/grad_{k}"),
            "Mul",
            vec![g.clone(), scale.to_string()],
            vec![],
        );
        clipped.insert(g.clone(), c);
    }
    for u in training
        .def
        .nodes
        .iter_mut()
        .filter(|u| u.op.starts_with("Apply"))
    {
        for i in &mut u.inputs {
            if let Some(c) = clipped.get(i) {
                *i = c.clone();
            }
        }
    }
}

/// ZeRO over `replica`'s group at `stage` for some of the rank's variables only, the others
/// (`replica.zero_whole`, by their one-process names) summed over the group as without ZeRO
/// ([`data::sum_gradients`]); clipping by `clip` takes the global norm over both: ZeRO's
/// `Σ‖g‖²` (summed over dp, then tp) plus the whole ones' ([`squared_norm_across_shards`]),
/// one scale for every gradient. `training.gradients` keeps its order (the summed gradients
/// of the whole ones, the local ones of ZeRO's). Returns ZeRO's parameters in the shard layout.
#[allow(clippy::too_many_arguments)]
fn mixed_zero_step(
    training: &mut TrainingGraph,
    typed: &Graph,
    n: &mut Nodes,
    at: &RankAt,
    replica: &data::Replica,
    stage: u8,
    renames: &HashMap<String, String>,
    clip: Option<f64>,
) -> Result<Vec<super::zero::Param>, StrategyError> {
    let original: HashMap<&String, &String> = renames.iter().map(|(o, r)| (r, o)).collect();
    let all = std::mem::take(&mut training.gradients);
    let (whole, zeroed): (Vec<_>, Vec<_>) = all.iter().cloned().partition(|(v, _)| {
        replica
            .zero_whole
            .contains(original.get(v).copied().unwrap_or(v))
    });
    // The whole ones' gradients summed over the dp group.
    training.gradients = whole;
    data::sum_gradients(training, typed, n, replica)?;
    let whole = std::mem::take(&mut training.gradients);
    // ZeRO's, clipped by the scale below (its name taken now, its node added after).
    training.gradients = zeroed;
    let scale = clip.map(|_| fresh(&mut n.taken, "dp/clip/global_norm_scale"));
    let zero_clip = scale
        .as_deref()
        .map_or(super::zero::Clip::None, super::zero::Clip::Scale);
    let sharded: HashSet<String> = renames.values().cloned().collect();
    let (params, zero_squared) = data::zero_step_with(
        training, typed, n, replica, stage, &at.group, &sharded, zero_clip,
    )?;
    let zeroed = std::mem::take(&mut training.gradients);
    if let (Some(clip), Some(scale), Some(zero_squared)) = (clip, &scale, zero_squared) {
        let total = match squared_norm_across_shards(&whole, n, renames) {
            Some(t) => n.add("dp/clip/squared_norm", "Add", vec![t, zero_squared], vec![]),
            None => zero_squared,
        };
        let mut s = node(scale, "GlobalNormScale", vec![total], &n.device);
        s.attrs = global_norm_attrs(clip)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        n.added.push(s);
        scale_gradients(training, n, &whole, scale);
    }
    let mut now: HashMap<String, String> = whole.into_iter().chain(zeroed).collect();
    training.gradients = all
        .into_iter()
        .filter_map(|(v, _)| now.remove(&v).map(|g| (v, g)))
        .collect();
    Ok(params)
}

/// Chains every collective of the graph by control edges in one topological order (the same on
/// every rank: the ranks' graphs differ only in their shards' names and sizes).
fn chain_collectives(training: &mut TrainingGraph) -> Result<(), StrategyError> {
    let typed = Graph::from_def(&training.def).map_err(StrategyError::InvalidGraph)?;
    let chain: Vec<String> = typed
        .topo_order()
        .into_iter()
        .map(|i| typed.node(i))
        .filter(|n| n.op.starts_with("Collective") && n.op != "CollectiveTpCopy")
        .map(|n| n.name.clone())
        .collect();
    for w in chain.windows(2) {
        if let Some(n) = training.def.nodes.iter_mut().find(|n| n.name == w[1]) {
            n.inputs.push(format!("^{}", w[0]));
        }
    }
    Ok(())
}

/// ZeRO-3 over the data-parallel `group`: each of the rank's trained weights (its
/// tensor-parallel shards and the replicated parameters, `params` in ZeRO's shard layout)
/// becomes its flat shard over the group, `{w}/shard_{d}_of_{D}`, all-gathered over the group
/// just before its forward and its backward uses ([`zero::params::shard_parameters`]); the
/// gathers are numbered from `instance`, in the graph's order (the same on every rank of the
/// group). `forward` is the rank's forward graph.
fn shard_parameters(
    training: &mut TrainingGraph,
    forward: &GraphDef,
    params: &[super::zero::Param],
    group: &super::zero::ShardGroup,
    instance: i64,
) -> Result<(), StrategyError> {
    let passes: HashSet<String> = forward.nodes.iter().map(|x| x.name.clone()).collect();
    let roots = [training.train_op.clone(), training.loss.clone()];
    let roots: Vec<&str> = roots
        .iter()
        .map(|r| r.split(':').next().unwrap_or(r))
        .collect();
    super::zero::params::shard_parameters(&mut training.def, params, group, &passes, &roots)?;
    let gathers = training.def.nodes.iter_mut().filter(|x| {
        x.op == "CollectiveAllGather"
            && matches!(x.attrs.get("group_key"), Some(AttrValue::String(k)) if **k == *group.key)
            && matches!(x.attrs.get("instance_key"), Some(AttrValue::Int(0)))
    });
    for (x, key) in gathers.zip(instance..) {
        x.attrs.insert("instance_key".into(), AttrValue::Int(key));
    }
    Ok(())
}

/// Adds to rank 0's graph a copy of the forward graph, `eval/<name>`, on worker 0, whose
/// sharded weights are assembled from every rank's shards (rank `r`'s shard of variable `v` in
/// replica `d` on `shard_device(v, r, d)`), and points evaluation at it. With
/// `own_placeholders` the copy reads placeholders of its own, `eval/<name>`, as written in
/// `forward` (a pipeline's training placeholders have a static batch); otherwise the training
/// ones. With `zero3 = Some(D)` every weight is ZeRO-3's flat shards over the data-parallel
/// groups of `D` replicas (`{w}/shard_{d}_of_{D}` on `shard_device(v, t, d)` for
/// tensor-parallel shard `t`, or `shard_device(v, 0, d)` for a replicated weight): each weight
/// is first joined from its `D` flat shards, then the tensor-parallel shards into the whole
/// weight.
#[allow(clippy::too_many_arguments)]
pub(super) fn eval_copy(
    g: &mut ReplicaGraph,
    forward: &GraphDef,
    shards: &[ShardedWeight],
    spec: &TrainSpec,
    tp: usize,
    shard_device: &dyn Fn(&NodeDef, usize, usize) -> Result<String, StrategyError>,
    own_placeholders: bool,
    zero3: Option<usize>,
) -> Result<(), StrategyError> {
    let device = worker_device("", "", 0)?;
    let taken: HashSet<String> = g
        .training
        .def
        .nodes
        .iter()
        .map(|x| x.name.clone())
        .collect();
    let joined = joined_weights(taken, forward, shards, tp, shard_device, zero3, &|_| {
        Ok(device.clone())
    })?;
    let mut map = joined.map;
    let mut n = Nodes {
        taken: joined.taken,
        added: joined.nodes,
        device: device.clone(),
        instance: 0,
        group: GROUP.to_string(),
    };
    let copied = |op: &str| match op {
        "Variable" => false,
        "Placeholder" => own_placeholders,
        _ => true,
    };
    for x in &forward.nodes {
        if !copied(&x.op) {
            continue;
        }
        let name = fresh(&mut n.taken, &format!("eval/{}", x.name));
        map.insert(x.name.clone(), name);
    }
    let remap = |input: &str| -> String {
        match InputRef::parse(input) {
            Ok(InputRef::Data { node: p, index }) => match map.get(&p) {
                Some(new) if index == 0 => new.clone(),
                Some(new) => format!("{new}:{index}"),
                None => input.to_string(),
            },
            Ok(InputRef::Control(p)) => match map.get(&p) {
                Some(new) => format!("^{new}"),
                None => input.to_string(),
            },
            Err(_) => input.to_string(),
        }
    };
    for x in &forward.nodes {
        if !copied(&x.op) {
            continue;
        }
        let mut copy = x.clone();
        copy.name = remap(&x.name);
        copy.inputs = x.inputs.iter().map(|i| remap(i)).collect();
        copy.device = worker_device(&x.name, &x.device, 0)?;
        copy.colocate_with.clear();
        n.added.push(copy);
    }
    g.training.def.nodes.extend(n.added);
    g.graph = Graph::from_def(&g.training.def).map_err(StrategyError::InvalidGraph)?;
    g.eval.features = remap(&g.eval.features);
    g.eval.labels = remap(&g.eval.labels);
    g.eval.loss = remap(&spec.loss);
    g.eval.metrics = spec.metrics.iter().map(|m| remap(m)).collect();
    Ok(())
}

/// [`joined_weights`]' answer.
pub(super) struct JoinedWeights {
    /// The tensor each sharded (under ZeRO-3 each flat-sharded) variable of the forward graph
    /// is read from: its shards joined.
    pub map: HashMap<String, String>,
    /// The nodes that make them (the other ranks' shard variables, the joins).
    pub nodes: Vec<NodeDef>,
    /// `taken` and the names of `nodes`.
    pub taken: HashSet<String>,
}

/// The whole values of `forward`'s tensor-parallel sharded weights (and under ZeRO-3,
/// `zero3 = Some(D)`, of every weight flat-sharded over `D` replicas) joined from their shards
/// (as [`eval_copy`] places them, `shard_device`) on `join_device(variable)`, named apart from
/// `taken`; rank 0's shards (and replica 0's flat shards) are read where they are.
pub(super) fn joined_weights(
    taken: HashSet<String>,
    forward: &GraphDef,
    shards: &[ShardedWeight],
    tp: usize,
    shard_device: &dyn Fn(&NodeDef, usize, usize) -> Result<String, StrategyError>,
    zero3: Option<usize>,
    join_device: &dyn Fn(&str) -> Result<String, StrategyError>,
) -> Result<JoinedWeights, StrategyError> {
    let by_name: HashMap<&str, &ShardedWeight> =
        shards.iter().map(|s| (s.name.as_str(), s)).collect();
    let mut n = Nodes {
        taken,
        added: Vec::new(),
        device: String::new(),
        instance: 0,
        group: GROUP.to_string(),
    };
    let mut map: HashMap<String, String> = HashMap::new();
    // ZeRO-3: the value of variable `v` (named `name` on rank `t` of replica 0) joined from its
    // flat shards over the replicas, `None` where it is not sharded so.
    // `probe`: the variable's name on rank 0, whose shard 0 is there when it is sharded;
    // `whole`: the forward graph's variable, whose shards `shard_device` places.
    let joined_flat = |n: &mut Nodes,
                       (v, whole): (&NodeDef, &NodeDef),
                       (name, probe): (&str, &str),
                       dims: &[usize],
                       t: usize|
     -> Result<Option<String>, StrategyError> {
        let Some(dp) = zero3 else {
            return Ok(None);
        };
        if !n
            .taken
            .contains(&super::zero::params::shard_name(probe, 0, dp))
        {
            return Ok(None);
        }
        let mut pieces = Vec::with_capacity(dp);
        for d in 0..dp {
            let piece = super::zero::params::shard_name(name, d, dp);
            if t > 0 || d > 0 {
                let mut copy = v.clone();
                super::zero::params::flat_shard(&mut copy, name, dims, d, dp);
                copy.name = piece.clone();
                copy.device = shard_device(whole, t, d)?;
                copy.colocate_with.clear();
                n.added.push(copy);
            }
            pieces.push(piece);
        }
        let joined = n.add(&format!("eval/{name}/flat"), "PackFlat", pieces, vec![]);
        Ok(Some(n.add(
            &format!("eval/{name}/whole"),
            "FlatSlice",
            vec![joined],
            vec![
                ("offset", AttrValue::Int(0)),
                ("shape", AttrValue::Shape(Shape::known(dims))),
            ],
        )))
    };
    for v in forward.nodes.iter().filter(|v| v.op == "Variable") {
        n.device = join_device(&v.name)?;
        let Some(s) = by_name.get(v.name.as_str()) else {
            // A replicated weight: whole on every rank, or ZeRO-3's flat shards.
            let dims = match v.attrs.get("shape") {
                Some(AttrValue::Shape(d)) => d.as_static(),
                _ => None,
            };
            if let Some(dims) = dims {
                if let Some(whole) = joined_flat(&mut n, (v, v), (&v.name, &v.name), &dims, 0)? {
                    map.insert(v.name.clone(), whole);
                }
            }
            continue;
        };
        let dims = s.split.shard_dims(&s.dims);
        let mut parts = Vec::with_capacity(tp);
        for r in 0..tp {
            let mut name = shard_name(&v.name, r, tp);
            let probe = shard_name(&v.name, 0, tp);
            let mut copy = v.clone();
            shard_variable(&mut copy, s, r);
            if let Some(whole) = joined_flat(&mut n, (&copy, v), (&name, &probe), &dims, r)? {
                name = whole;
            } else if r > 0 {
                copy.name = name.clone();
                copy.device = shard_device(v, r, 0)?;
                copy.colocate_with.clear();
                n.added.push(copy);
            }
            // [.., blocks, piece, ..]: the pieces of every block side by side.
            let a = s.split.axis;
            let mut blocked: Vec<i64> = dims[..a].iter().map(|&d| d as i64).collect();
            blocked.push(s.split.blocks as i64);
            blocked.push((dims[a] / s.split.blocks) as i64);
            blocked.extend(dims[a + 1..].iter().map(|&d| d as i64));
            parts.push(n.reshape(&format!("eval/{}/blocked_{r}", v.name), name, &blocked));
        }
        let joined = n.add(
            &format!("eval/{}/joined", v.name),
            "Concat",
            parts,
            vec![("axis", AttrValue::Int(s.split.axis as i64 + 1))],
        );
        let mut padded: Vec<i64> = s.dims.iter().map(|&d| d as i64).collect();
        padded[s.split.axis] = s.split.padded as i64;
        let mut whole = n.reshape(&format!("eval/{}/padded", v.name), joined, &padded);
        if s.split.padded != s.dims[s.split.axis] {
            whole = n.add(
                &format!("eval/{}", v.name),
                "Slice",
                vec![whole],
                vec![
                    ("begin", AttrValue::IntList(vec![0; s.dims.len()])),
                    (
                        "size",
                        AttrValue::IntList(s.dims.iter().map(|&d| d as i64).collect()),
                    ),
                ],
            );
        }
        map.insert(v.name.clone(), whole);
    }
    Ok(JoinedWeights {
        map,
        nodes: n.added,
        taken: n.taken,
    })
}

/// The plan's sharded variables: every shard weight and each of its optimizer slots (named
/// `{shard}/{slot}` by the training expansion, a variable or, under ZeRO, one of `zero`'s
/// logical tensors), stored whole under the one-process names.
fn sharded_variables(
    shards: &[ShardedWeight],
    variables: &[crate::job::VariablePlan],
    zero: &[crate::shards::ShardedVariable],
    tp: usize,
) -> Vec<AxisShardedVariable> {
    let mut out = Vec::new();
    for s in shards {
        let first = shard_name(&s.name, 0, tp);
        let dtype = variables
            .iter()
            .find(|v| v.name == first)
            .map(|v| v.dtype)
            .or_else(|| zero.iter().find(|z| z.logical == first).map(|z| z.dtype))
            .unwrap_or(DType::F32);
        let entry = |logical: String, dtype: DType, shards: Vec<String>| AxisShardedVariable {
            logical,
            dtype,
            dims: s.dims.clone(),
            shards,
            axis: s.split.axis,
            blocks: s.split.blocks,
            padded: s.split.padded,
        };
        out.push(entry(
            s.name.clone(),
            dtype,
            (0..tp).map(|r| shard_name(&s.name, r, tp)).collect(),
        ));
        // Slots: `{shard}/adam_m` etc., of the shard's shape.
        let prefix = format!("{first}/");
        let mut slots: BTreeMap<&str, DType> = BTreeMap::new();
        for v in variables {
            if let Some(slot) = v.name.strip_prefix(&prefix) {
                if v.dims == s.split.shard_dims(&s.dims) {
                    slots.insert(slot, v.dtype);
                }
            }
        }
        for z in zero {
            if let Some(slot) = z.logical.strip_prefix(&prefix) {
                slots.insert(slot, z.dtype);
            }
        }
        for (slot, dtype) in slots {
            out.push(entry(
                format!("{}/{slot}", s.name),
                dtype,
                (0..tp)
                    .map(|r| format!("{}/{slot}", shard_name(&s.name, r, tp)))
                    .collect(),
            ));
        }
    }
    out
}

/// Bytes one rank sends per training step in the tensor-parallel collectives of its graph `g`
/// over `tp` ranks, from the plan's static shapes (ring all-reduce: `2(T−1)/T` of the tensor):
/// `(forward, backward)`, where forward counts the `g` all-reduces (`CollectiveTpReduce`) and
/// backward the all-reduces of `f`'s gradients. The loss's own all-reduces of `[rows]` vectors
/// and clipping's scalar are not counted. `None` where a shape is not static.
pub fn activation_bytes(g: &ReplicaGraph, tp: usize) -> Option<(usize, usize)> {
    let typed = &g.graph;
    let ring = |i| {
        typed
            .output_type(i, 0)
            .and_then(|t: &dflow_graph::TensorType| {
                let bytes = t.shape.num_elements()? * t.dtype.size_of();
                Some(crate::sharding::Transition::AllReduce.bytes_sent(bytes, tp))
            })
    };
    let (mut fwd, mut bwd) = (0usize, 0usize);
    for i in typed.node_indices() {
        let n = typed.node(i);
        let Some(AttrValue::Int(key)) = n.attrs.get("instance_key") else {
            continue;
        };
        let backward = *key >= dflow_graph::ops::collective::GRADIENT_INSTANCE_OFFSET;
        match n.op {
            "CollectiveTpReduce" if !n.name.starts_with("xent/") => fwd += ring(i)?,
            "CollectiveAllReduce" if backward => bwd += ring(i)?,
            _ => {}
        }
    }
    Some((fwd, bwd))
}

/// Bytes of the tensor `input` (`node:index`) names in `g`, 0 when it is not static (or a
/// control input).
fn input_bytes(g: &Graph, input: &str) -> usize {
    match InputRef::parse(input) {
        Ok(InputRef::Data { node, index }) => g
            .find(&node)
            .and_then(|x| g.output_type(x, index))
            .map_or(0, |t| {
                t.shape
                    .as_static()
                    .map_or(0, |d| d.iter().product::<usize>())
                    * t.dtype.size_of()
            }),
        _ => 0,
    }
}

/// Writes to `out` the tensor-parallel and data-parallel groups of `mesh` with their ranks,
/// each dp group followed by `dp_state` (what it does with the training state).
fn render_mesh_groups(out: &mut String, mesh: &Mesh, dp_state: &str) {
    use std::fmt::Write as _;
    let ranks = |g: &[usize]| {
        g.iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (d, g) in mesh.groups(Axis::Tp).iter().enumerate() {
        let _ = writeln!(
            out,
            "  tp group {}: ranks {} (replica {d})",
            tp_group(mesh, d),
            ranks(g)
        );
    }
    for (t, g) in mesh.groups(Axis::Dp).iter().enumerate() {
        let _ = writeln!(
            out,
            "  dp group {}: ranks {} (shard {t}): {dp_state}",
            dp_group(t),
            ranks(g)
        );
    }
}

/// Writes to `out` the collectives rank 0 of `first` (its training graph) runs over its
/// data-parallel group (`dp_group(0)`, `dp` ranks) in one step, in the graph's order, each with
/// the bytes it sends by the ring algorithms the transport runs; returns their sum.
fn render_dp_collectives(out: &mut String, first: &ReplicaGraph, dp: usize) -> usize {
    use std::fmt::Write as _;
    let key = dp_group(0);
    let mut total = 0usize;
    for c in first.training.def.nodes.iter().filter(|n| {
        n.op.starts_with("Collective")
            && matches!(n.attrs.get("group_key"), Some(AttrValue::String(k)) if **k == *key)
    }) {
        let Some(input) = c.inputs.first() else {
            continue;
        };
        let b = input_bytes(&first.graph, input);
        let (what, sent) = match c.op.as_str() {
            "CollectiveAllReduce" => ("all-reduce", 2 * (dp - 1) * b / dp),
            "CollectiveReduceScatter" => ("reduce-scatter", (dp - 1) * b / dp),
            "CollectiveAllGather" => ("all-gather", (dp - 1) * b),
            other => (other, 0),
        };
        total += sent;
        let _ = writeln!(out, "  {} ({what} of {b} B): {sent} B", c.name);
    }
    total
}

/// `dflow partition`'s data-parallel section for the GPT on a `dp × tp` mesh (the tp section
/// shows one replica): its groups, and the collectives rank 0 runs over its dp group in one step
/// (the bucketed gradient all-reduces, or ZeRO's at `zero_stage`) with their bytes, fed `rows`
/// rows a replica.
#[allow(clippy::too_many_arguments)]
pub fn render_data_parallel(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    bucket_bytes: usize,
    zero_stage: Option<u8>,
    features: &str,
    labels: &str,
) -> Result<String, StrategyError> {
    use std::fmt::Write as _;
    if hand::declares_placements(graph) {
        return hand::render_data_parallel(
            graph,
            spec,
            mesh,
            bucket_bytes,
            zero_stage,
            features,
            labels,
        );
    }
    let tg = mesh_training(
        graph,
        spec,
        mesh,
        bucket_bytes,
        zero_stage,
        features,
        labels,
    )?;
    let first = tg
        .graphs
        .first()
        .ok_or_else(|| options("the mesh has no rank".into()))?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\ndata parallelism over tensor-parallel groups: dp={} × tp={} (ranks tp fastest; the tp \
         section above is one replica's, on its part of the batch)",
        mesh.dp, mesh.tp
    );
    let state = match zero_stage {
        None => "every gradient summed (bucketed all-reduce)".to_string(),
        Some(s) => format!("ZeRO stage {s}: shard d of each weight's training state"),
    };
    render_mesh_groups(&mut out, mesh, &state);
    let _ = writeln!(
        out,
        "collectives rank 0 runs over its dp group {} per step (bytes it sends, ring):",
        dp_group(0)
    );
    let total = render_dp_collectives(&mut out, first, mesh.dp);
    let _ = writeln!(
        out,
        "bytes rank 0 sends over its dp group per step: {total} B (clipping's norm summed over \
         dp, then tp)"
    );
    Ok(out)
}

/// `dflow partition --strategy tensor`'s section: every weight's placement on the
/// tensor-parallel axis and every collective rank 0 runs per step with the placement change it
/// makes and the bytes each rank sends (ring all-reduce, `2(T−1)/T` of the tensor). The
/// features and labels get batch dimension `batch` (when given) so that every size is known.
pub fn render_tensor_plan(
    graph: &Graph,
    spec: &TrainSpec,
    tp: usize,
    features: &str,
    labels: &str,
    batch: Option<usize>,
) -> Result<String, StrategyError> {
    use std::fmt::Write as _;
    let mut def = graph.to_def();
    if let Some(b) = batch {
        for n in def
            .nodes
            .iter_mut()
            .filter(|n| n.op == "Placeholder" && (n.name == features || n.name == labels))
        {
            if let Some(AttrValue::Shape(sh)) = n.attrs.get("shape") {
                if let Some(dims) = sh.dims() {
                    let mut d: Vec<Option<usize>> = dims.to_vec();
                    if let Some(first) = d.first_mut() {
                        *first = Some(b);
                    }
                    n.attrs
                        .insert("shape".into(), AttrValue::Shape(Shape::partial(d)));
                }
            }
        }
    }
    let graph = Graph::from_def(&def).map_err(StrategyError::InvalidGraph)?;
    if hand::declares_placements(&graph) {
        return hand::render(&graph, spec, tp);
    }
    let tg = tensor_training(&graph, spec, tp, features, labels)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\ntensor parallelism: tp={tp} over group `{GROUP}` (Megatron layout; docs/tensor-parallel.md)"
    );
    let _ = writeln!(out, "placements on the tp axis:");
    let sharded: HashSet<&str> = tg.shards.iter().map(|s| s.name.as_str()).collect();
    for s in &tg.shards {
        let mut how = String::new();
        if s.split.blocks > 1 {
            let _ = write!(how, ", {} blocks (q, k, v) cut separately", s.split.blocks);
        }
        if s.split.padded != s.dims[s.split.axis] {
            let _ = write!(
                how,
                ", padded {} → {} (masked)",
                s.dims[s.split.axis], s.split.padded
            );
        }
        let _ = writeln!(
            out,
            "  {} {:?}: {}{how}; {:?} per rank",
            s.name,
            s.dims,
            s.placement(),
            s.split.shard_dims(&s.dims)
        );
    }
    let replicated: Vec<&str> = def
        .nodes
        .iter()
        .filter(|n| n.op == "Variable" && !sharded.contains(n.name.as_str()))
        .map(|n| n.name.as_str())
        .collect();
    let _ = writeln!(out, "  {}: {}", replicated.join(", "), Placement::Replicate);
    let _ = writeln!(
        out,
        "activations (placements from the sharding rules; `transformer.h.i.` omitted in blocks):"
    );
    for a in megatron_activations().map_err(options)? {
        let then = a
            .made_whole
            .map_or_else(String::new, |t| format!(" → Replicate by {t}"));
        let _ = writeln!(out, "  {}: {}{then}", a.node, a.placement);
    }
    let g = &tg.graphs[0];
    let typed = &g.graph;
    let _ = writeln!(
        out,
        "collectives of one step on each rank (bytes each rank sends, ring):"
    );
    let (mut fwd, mut bwd, mut other) = (Some(0usize), Some(0usize), Some(0usize));
    for i in typed.topo_order() {
        let n = typed.node(i);
        if !n.op.starts_with("Collective") || n.name.starts_with("eval/") {
            continue;
        }
        let Some(AttrValue::Int(key)) = n.attrs.get("instance_key") else {
            continue;
        };
        let backward = *key >= dflow_graph::ops::collective::GRADIENT_INSTANCE_OFFSET;
        let ty = typed.output_type(i, 0);
        let bytes = ty.and_then(|t| {
            let b = t.shape.num_elements()? * t.dtype.size_of();
            Some(crate::sharding::Transition::AllReduce.bytes_sent(b, tp))
        });
        let (pass, change, total) = match n.op {
            "CollectiveTpCopy" => (
                "forward ",
                "f: Replicate, identity (its gradient below)",
                None,
            ),
            "CollectiveTpReduce" if n.name.starts_with("xent/") => (
                "loss    ",
                "Partial → Replicate: all-reduce (g)",
                Some(&mut other),
            ),
            "CollectiveTpReduce" => (
                "forward ",
                "Partial → Replicate: all-reduce (g)",
                Some(&mut fwd),
            ),
            "CollectiveAllReduce" if backward => (
                "backward",
                "Partial → Replicate: all-reduce (f's gradient)",
                Some(&mut bwd),
            ),
            "CollectiveAllReduce" if n.name.starts_with("xent/") => (
                "loss    ",
                "Partial(max) → Replicate: all-reduce max",
                Some(&mut other),
            ),
            _ => (
                "update  ",
                "Partial → Replicate: all-reduce (clipping's Σ‖g‖²)",
                Some(&mut other),
            ),
        };
        let shown = match (total, bytes) {
            (None, _) => "0 B".to_string(),
            (Some(t), Some(b)) => {
                if let Some(x) = t.as_mut() {
                    *x += b;
                }
                format!("{b} B")
            }
            (Some(t), None) => {
                *t = None;
                "? B (give --batch-size)".to_string()
            }
        };
        let ty = ty.map_or_else(|| "?".to_string(), |t| t.to_string());
        let _ = writeln!(out, "  {pass} {} {}: {change}; {ty}, {shown}", n.op, n.name);
    }
    let show = |b: Option<usize>| b.map_or_else(|| "?".to_string(), |b| b.to_string());
    let _ = writeln!(
        out,
        "bytes each rank sends per step: forward {} B, backward {} B, loss and clipping {} B",
        show(fwd),
        show(bwd),
        show(other)
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::task_name;
    use crate::strategy::test_support::weights_crossing_tasks;
    use dflow_graph::layers::{gpt, GptConfig};

    fn model(vocab: usize, heads: usize, batch: i64) -> (Graph, TrainSpec) {
        let cfg = GptConfig {
            vocab_size: vocab,
            block_size: 4,
            n_layer: 2,
            n_head: heads,
            n_embd: 8,
            ..GptConfig::default()
        };
        let mut m = gpt(&cfg).unwrap();
        let spec = m.def.train.clone().unwrap();
        for n in &mut m.def.nodes {
            if n.op == "Placeholder" {
                n.attrs.insert(
                    "shape".into(),
                    AttrValue::Shape(Shape::known(&[batch as usize, 4])),
                );
            }
        }
        (Graph::from_def(&m.def).unwrap(), spec)
    }

    fn ops<'a>(g: &'a ReplicaGraph, op: &str) -> Vec<&'a NodeDef> {
        g.training.def.nodes.iter().filter(|n| n.op == op).collect()
    }

    #[test]
    fn megatron_layout_two_reduces_forward_and_two_backward_per_block() {
        let (graph, spec) = model(11, 4, 3);
        for tp in [2usize, 4] {
            let tg = tensor_training(&graph, &spec, tp, "idx", "targets").unwrap();
            assert_eq!(tg.graphs.len(), tp);
            let g = &tg.graphs[1];
            // Shards: c_attn [3C/T, C], c_proj [C, C/T], c_fc [4C/T, C], wte [Vp/T, C].
            let shape = |name: &str| {
                let i = g.graph.find(name).unwrap();
                g.graph
                    .output_type(i, 0)
                    .unwrap()
                    .shape
                    .as_static()
                    .unwrap()
            };
            let s = |v: &str| shard_name(v, 1, tp);
            assert_eq!(
                shape(&s("transformer.h.0.attn.c_attn.weight")),
                [24 / tp, 8]
            );
            assert_eq!(shape(&s("transformer.h.1.attn.c_proj.weight")), [8, 8 / tp]);
            assert_eq!(shape(&s("transformer.h.0.mlp.c_fc.weight")), [32 / tp, 8]);
            assert_eq!(shape(&s("transformer.h.0.mlp.c_proj.weight")), [8, 32 / tp]);
            assert_eq!(
                shape(&s("transformer.wte.weight")),
                [11usize.div_ceil(tp), 8]
            );
            // Replicated: norms, wpe, the row-parallel biases.
            assert_eq!(shape("transformer.h.0.attn.c_proj.bias"), [8]);
            assert_eq!(shape("transformer.wpe.weight"), [4, 8]);
            // g: 2 per block + the embedding's + the loss's two; f: 2 per block + the head's.
            let reduces = ops(g, "CollectiveTpReduce");
            assert_eq!(reduces.len(), 2 * 2 + 1 + 2);
            assert_eq!(ops(g, "CollectiveTpCopy").len(), 2 * 2 + 1);
            // Bytes: per block two all-reduces of b·s·h floats forward, two backward, plus the
            // embedding's (forward) and the head's input gradient (backward).
            let (fwd, bwd) = activation_bytes(g, tp).unwrap();
            let act = 3 * 4 * 8 * 4;
            let ring = 2 * (tp - 1) * act / tp;
            assert_eq!(fwd, (2 * 2 + 1) * ring);
            assert_eq!(bwd, (2 * 2 + 1) * ring);
            // Every collective but f waits for the one before it.
            let chained = g
                .training
                .def
                .nodes
                .iter()
                .filter(|n| n.op.starts_with("Collective") && n.op != "CollectiveTpCopy")
                .filter(|n| !n.inputs.iter().any(|i| i.starts_with('^')))
                .count();
            assert_eq!(chained, 1, "one collective heads the chain");
            // The shards are drawn as the whole variable's parts.
            let v = g
                .training
                .def
                .nodes
                .iter()
                .find(|n| n.name == s("transformer.h.0.attn.c_attn.weight"))
                .unwrap();
            assert_eq!(v.attrs["shard_blocks"], AttrValue::Int(3));
            assert_eq!(v.attrs["shard_index"], AttrValue::Int(1));
            assert_eq!(
                v.attrs["shard_name"],
                AttrValue::String("transformer.h.0.attn.c_attn.weight".into())
            );
        }
    }

    #[test]
    fn dp2_tp2_zero_holds_each_ranks_dp_shard_of_its_tp_shards_adam_slots() {
        let (graph, spec) = model(11, 2, 4);
        assert!(spec.clip_global_norm.is_some());
        let mesh = Mesh::new(2, 2, 1).unwrap();
        let int = |n: &NodeDef, a: &str| match n.attrs.get(a) {
            Some(AttrValue::Int(v)) => *v,
            other => panic!("{} {a}: {other:?}", n.name),
        };
        let key = |n: &NodeDef| match n.attrs.get("group_key") {
            Some(AttrValue::String(k)) => k.to_string(),
            other => panic!("{} group_key: {other:?}", n.name),
        };
        for stage in [1u8, 2] {
            let tg = mesh_training(&graph, &spec, &mesh, 1 << 20, Some(stage), "idx", "targets")
                .unwrap();
            let mut orders = Vec::new();
            for (rank, g) in tg.graphs.iter().enumerate() {
                let (t, d, _) = mesh.coords(rank);
                let nodes = &g.training.def.nodes;
                let elements = |var: &str| -> usize {
                    let i = g.graph.find(var).unwrap();
                    let dims = g
                        .graph
                        .output_type(i, 0)
                        .unwrap()
                        .shape
                        .as_static()
                        .unwrap();
                    dims.iter().product()
                };
                let updates = ops(g, "ApplyAdamW");
                assert_eq!(updates.len(), spec_variables(&graph));
                for u in &updates {
                    // The rank's dp-shard (index d of 2) of its variable's slots: a TP shard's
                    // (`.../tp_{t}_of_2`) or a replicated weight's, at offset d·S.
                    let var = &u.inputs[0];
                    let s = elements(var).div_ceil(2);
                    assert_eq!(int(u, "shard_offset"), (d * s) as i64, "{}", u.name);
                    for (k, slot) in [(1, "adam_m"), (2, "adam_v")] {
                        let name = format!("{var}/{slot}/shard_{d}_of_2");
                        assert_eq!(u.inputs[k], name);
                        let v = nodes.iter().find(|x| x.name == name).unwrap();
                        assert_eq!(
                            v.attrs.get("shape"),
                            Some(&AttrValue::Shape(Shape::known(&[s])))
                        );
                    }
                }
                let tp_shard = shard_name("transformer.h.0.attn.c_attn.weight", t, 2);
                assert!(updates.iter().any(|u| u.inputs[0] == tp_shard));
                assert!(!nodes.iter().any(|x| x.name.ends_with("/adam_m")));
                // Gradients: all-reduced (stage 1) or reduce-scattered (stage 2) over the
                // rank's dp group, the updated shards all-gathered over it.
                let (summing, other) = if stage == 1 {
                    ("CollectiveAllReduce", "CollectiveReduceScatter")
                } else {
                    ("CollectiveReduceScatter", "CollectiveAllReduce")
                };
                let buckets: Vec<&NodeDef> = ops(g, summing)
                    .into_iter()
                    .filter(|n| n.name.starts_with("zero/bucket_"))
                    .collect();
                assert!(!buckets.is_empty());
                assert!(buckets.iter().all(|n| key(n) == dp_group(t)));
                assert!(!ops(g, other)
                    .iter()
                    .any(|n| n.name.starts_with("zero/bucket_")));
                let gathers = ops(g, "CollectiveAllGather");
                assert_eq!(gathers.len(), buckets.len());
                assert!(gathers.iter().all(|n| key(n) == dp_group(t)));
                assert!(ops(g, "Assign").len() == updates.len());
                // Clipping: the TP shards' Σ‖g‖² over the dp group then the TP group, the
                // replicated weights' over the dp group only.
                let find = |name: &str| nodes.iter().find(|x| x.name == name).unwrap();
                assert_eq!(key(find("zero/clip/sharded_squared_norm")), dp_group(t));
                assert_eq!(
                    key(find("zero/clip/sharded_squared_norm_outer")),
                    tp_group(&mesh, d)
                );
                assert_eq!(key(find("zero/clip/replicated_squared_norm")), dp_group(t));
                assert!(!nodes
                    .iter()
                    .any(|x| x.name == "zero/clip/replicated_squared_norm_outer"));
                assert!(!nodes.iter().any(|x| x.name.starts_with("dp/bucket_")));
                // Every collective but f waits for the one before it, in one order.
                let mut chain: Vec<&NodeDef> = nodes
                    .iter()
                    .filter(|n| n.op.starts_with("Collective") && n.op != "CollectiveTpCopy")
                    .collect();
                chain.sort_by_key(|n| int(n, "instance_key"));
                let heads = chain
                    .iter()
                    .filter(|n| !n.inputs.iter().any(|i| i.starts_with('^')))
                    .count();
                assert_eq!(heads, 1, "one collective heads the chain");
                orders.push(
                    chain
                        .iter()
                        .map(|n| (n.op.clone(), int(n, "instance_key")))
                        .collect::<Vec<_>>(),
                );
            }
            assert!(orders.windows(2).all(|w| w[0] == w[1]));
        }
        // The plan stores the slots whole: ZeRO's dp shards make each TP shard's slot, the TP
        // shards' slots the logical one.
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 4)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let plan = TensorParallel {
            tp: Some(2),
            bucket_bytes: 1 << 20,
            batch_size: Some(4),
            pipeline: None,
            zero_stage: Some(2),
        }
        .plan(&input)
        .unwrap();
        assert!(plan.strategy.contains("ZeRO stage 2"), "{}", plan.strategy);
        let w = "transformer.h.0.attn.c_attn.weight";
        let flat = plan
            .sharded
            .iter()
            .find(|s| s.logical == format!("{}/adam_m", shard_name(w, 1, 2)))
            .unwrap();
        assert_eq!(flat.dims, [12, 8]);
        assert_eq!(
            flat.shards,
            [0, 1].map(|d| format!("{}/adam_m/shard_{d}_of_2", shard_name(w, 1, 2)))
        );
        assert!(plan
            .sharded
            .iter()
            .any(|s| s.logical == "transformer.wpe.weight/adam_v" && s.dims == [4, 8]));
        let axis = plan
            .axis_sharded
            .iter()
            .find(|s| s.logical == format!("{w}/adam_m"))
            .unwrap();
        assert_eq!(axis.dims, [24, 8]);
        assert_eq!(
            axis.shards,
            [0, 1].map(|t| format!("{}/adam_m", shard_name(w, t, 2)))
        );
    }

    /// `dp=2,tp=2 --zero-stage 3` with a known batch evaluates on tensor-parallel group 0's
    /// ranks (workers 0 and 1), each gathering its flat shards per use over its dp group as
    /// training's forward does, the other replica (workers 2 and 3) joining each gather with
    /// its shard: no tensor-parallel shard and no flat shard leaves its device, and no weight
    /// is joined whole on one device (worker 0's old copy did: this fails on it). Only the
    /// replicated weights (layer norms, `wpe`, row-parallel biases) go from worker 0's gathered
    /// copy to rank 1, as without ZeRO-3.
    #[test]
    fn dp2_tp2_zero3_evaluates_on_tp_group_0_gathering_flat_shards_per_use_and_joins_no_weight() {
        let (graph, spec) = model(11, 2, 4);
        let mesh = Mesh::new(2, 2, 1).unwrap();
        let task_of = |device: &str| {
            dflow_graph::DeviceName::parse(device)
                .ok()
                .and_then(|d| d.task)
                .map_or(usize::MAX, |t| t as usize)
        };
        let evaluated = |rows| {
            mesh_training_evaluating(
                &graph,
                &spec,
                &mesh,
                1 << 20,
                Some(3),
                "idx",
                "targets",
                rows,
            )
            .unwrap()
        };
        // The old evaluation (no static batch) joins shards from the other workers on worker 0.
        let old = evaluated(None);
        assert!(weights_crossing_tasks(&old.graphs[0])
            .iter()
            .any(|(p, _)| p.contains("/tp_1_of_2/shard_")));
        let tg = evaluated(Some(4));
        let g0 = &tg.graphs[0];
        for (p, reader) in weights_crossing_tasks(g0) {
            let from = g0.training.def.nodes.iter().find(|n| n.name == p).unwrap();
            assert!(
                from.op == "FlatSlice" && task_of(&from.device) == 0 && !p.contains("/tp_"),
                "`{p}` ({}) crosses to `{reader}`",
                from.op
            );
        }
        let eval: Vec<&NodeDef> = g0
            .training
            .def
            .nodes
            .iter()
            .filter(|n| n.name.starts_with("eval/"))
            .collect();
        // No join: no weight is packed or concatenated whole anywhere.
        assert!(eval.iter().all(|n| n.op != "PackFlat" && n.op != "Concat"));
        let attr = |n: &NodeDef, a: &str| n.attrs.get(a).cloned().unwrap();
        // Per worker: its gathers (group, key) in instance order.
        let mut gathers: BTreeMap<usize, Vec<(AttrValue, AttrValue)>> = BTreeMap::new();
        for n in &eval {
            let task = task_of(&n.device);
            if task >= 2 {
                // The other replica only joins the gathers.
                assert!(
                    matches!(n.op.as_str(), "CollectiveAllGather" | "Size"),
                    "{}",
                    n.name
                );
            }
            if n.op == "CollectiveAllGather" {
                assert_eq!(
                    attr(n, "group_key"),
                    AttrValue::String(dp_group(task % 2).as_str().into())
                );
                // It reads the worker's own flat shard.
                let shard = g0
                    .training
                    .def
                    .nodes
                    .iter()
                    .find(|v| v.name == n.inputs[0])
                    .unwrap();
                assert_eq!(shard.op, "Variable");
                assert_eq!(task_of(&shard.device), task);
                assert!(shard.name.ends_with(&format!("/shard_{}_of_2", task / 2)));
                gathers
                    .entry(task)
                    .or_default()
                    .push((attr(n, "group_key"), attr(n, "instance_key")));
            }
        }
        // Rank 0 gathers its tp shards and the replicated weights, rank 1 its tp shards; each
        // peer joins the same gathers at the same keys.
        assert!(gathers[&0].len() > gathers[&1].len() && !gathers[&1].is_empty());
        for t in 0..2 {
            let key = |x: &(AttrValue, AttrValue)| match x.1 {
                AttrValue::Int(k) => k,
                _ => 0,
            };
            let mut own = gathers[&t].clone();
            let mut peer = gathers[&(t + 2)].clone();
            own.sort_by_key(key);
            peer.sort_by_key(key);
            assert_eq!(own, peer, "rank {t}");
        }
        // The job plan: the evaluation runs on all four workers, and what crosses between
        // them is the batch, activations, replicated weights and control edges (a peer's
        // last gather done) only.
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 4)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let plan = TensorParallel {
            tp: Some(2),
            bucket_bytes: 1 << 20,
            batch_size: Some(4),
            pipeline: None,
            zero_stage: Some(3),
        }
        .plan(&input)
        .unwrap();
        let eval = plan.eval_signature().unwrap();
        assert_eq!(eval.tasks().unwrap().len(), 4);
        let moved: Vec<String> = eval
            .partitions
            .pairs
            .iter()
            .map(|p| p.tensor_name.to_string())
            .filter(|t| !t.starts_with('^') && (t.contains("/tp_") || t.contains("/shard_")))
            .collect();
        assert!(moved.is_empty(), "{moved:?}");
    }

    #[test]
    fn zero_beside_tp_refuses_stage_4_one_replica_a_pipeline_and_sgd_naming_them() {
        let (graph, mut spec) = model(11, 2, 4);
        let refused = |spec: &TrainSpec, mesh: Mesh, stage: u8| {
            mesh_training(&graph, spec, &mesh, 1, Some(stage), "idx", "targets")
                .unwrap_err()
                .to_string()
        };
        let e = refused(&spec, Mesh::new(2, 2, 1).unwrap(), 4);
        assert!(e.contains("stages are 1, 2 and 3"), "{e}");
        let e = refused(&spec, Mesh::new(1, 2, 1).unwrap(), 1);
        assert!(e.contains("this mesh has one replica"), "{e}");
        let e = refused(&spec, Mesh::new(2, 2, 2).unwrap(), 1);
        assert!(e.contains("pipeline axis"), "{e}");
        spec.optimizer.kind = dflow_graph::train::OptimizerKind::Sgd;
        let e = refused(&spec, Mesh::new(2, 2, 1).unwrap(), 1);
        assert!(e.contains("optimizer is sgd"), "{e}");
    }

    #[test]
    fn dp2_tp2_zero3_keeps_each_ranks_flat_shard_of_its_tp_shards_and_gathers_it_before_each_use() {
        let (graph, spec) = model(11, 2, 4);
        let mesh = Mesh::new(2, 2, 1).unwrap();
        let str_attr = |n: &NodeDef, a: &str| match n.attrs.get(a) {
            Some(AttrValue::String(k)) => k.to_string(),
            other => panic!("{} {a}: {other:?}", n.name),
        };
        let int = |n: &NodeDef, a: &str| match n.attrs.get(a) {
            Some(AttrValue::Int(v)) => *v,
            other => panic!("{} {a}: {other:?}", n.name),
        };
        let tg = mesh_training(&graph, &spec, &mesh, 1 << 20, Some(3), "idx", "targets").unwrap();
        let w = "transformer.h.0.attn.c_attn.weight";
        let mut orders = Vec::new();
        for (rank, g) in tg.graphs.iter().enumerate() {
            let (t, d, _) = mesh.coords(rank);
            let nodes = &g.training.def.nodes;
            let find = |name: &str| nodes.iter().find(|x| x.name == name);
            // The rank's flat shard d of its TP shard t of c_attn ([12, 8], 96 elements).
            let tp = shard_name(w, t, 2);
            let shard = find(&format!("{tp}/shard_{d}_of_2")).unwrap();
            assert_eq!(shard.op, "Variable");
            assert_eq!(
                shard.attrs.get("shape"),
                Some(&AttrValue::Shape(Shape::known(&[48])))
            );
            assert_eq!(int(shard, "shard_parts"), 2);
            assert_eq!(int(shard, "shard_index"), t as i64);
            assert_eq!(int(shard, "shard_offset"), 48 * d as i64);
            assert_eq!(shard.attrs.get("shard_flat"), Some(&AttrValue::Bool(true)));
            assert_eq!(str_attr(shard, "shard_name"), w);
            // Neither the TP shard nor a replicated weight is held whole.
            assert!(find(&tp).is_none());
            assert!(find("transformer.wpe.weight").is_none());
            assert!(find(&format!("transformer.wpe.weight/shard_{d}_of_2")).is_some());
            // Forward and backward gathers over the dp group, each read only through its slice.
            for pass in ["forward", "backward"] {
                let gather = find(&format!("zero/{tp}/all_gather_{pass}")).unwrap();
                assert_eq!(gather.op, "CollectiveAllGather");
                assert_eq!(str_attr(gather, "group_key"), dp_group(t));
                assert!(int(gather, "instance_key") > 0);
                assert_eq!(gather.inputs[0], format!("{tp}/shard_{d}_of_2"));
                let value = format!("zero/{tp}/{pass}");
                assert!(nodes.iter().any(|x| x.inputs.contains(&value)));
            }
            // The update writes the shard in place; no assign of gathered values.
            let update = ops(g, "ApplyAdamW")
                .into_iter()
                .find(|u| u.inputs[0] == format!("{tp}/shard_{d}_of_2"))
                .unwrap();
            assert!(!update.attrs.contains_key("shard_offset"));
            assert!(ops(g, "Assign").is_empty());
            // Every collective (but f) in one chain, numbered alike on every rank.
            let mut chain: Vec<&NodeDef> = nodes
                .iter()
                .filter(|n| {
                    n.op.starts_with("Collective")
                        && n.op != "CollectiveTpCopy"
                        && !n.name.starts_with("eval/")
                })
                .collect();
            chain.sort_by_key(|n| int(n, "instance_key"));
            let keys: HashSet<i64> = chain.iter().map(|n| int(n, "instance_key")).collect();
            assert_eq!(keys.len(), chain.len(), "instance keys are unique");
            orders.push(
                chain
                    .iter()
                    .map(|n| (n.op.clone(), int(n, "instance_key")))
                    .collect::<Vec<_>>(),
            );
        }
        assert!(orders.windows(2).all(|w| w[0] == w[1]));
        // Worker 0's evaluation joins every rank's flat shards, then the TP shards.
        let g0 = &tg.graphs[0];
        for (t, d) in [(0, 1), (1, 0), (1, 1)] {
            let name = format!("{}/shard_{d}_of_2", shard_name(w, t, 2));
            let v = g0
                .training
                .def
                .nodes
                .iter()
                .find(|x| x.name == name)
                .unwrap();
            assert_eq!(v.device, worker_device("", "", t + 2 * d).unwrap());
        }
        assert!(g0.graph.find(&format!("eval/{w}/joined")).is_some());
        // The plan stores whole tensors: flat shards → TP shards → the logical weight.
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 4)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let plan = TensorParallel {
            tp: Some(2),
            bucket_bytes: 1 << 20,
            batch_size: Some(4),
            pipeline: None,
            zero_stage: Some(3),
        }
        .plan(&input)
        .unwrap();
        let flat = plan
            .sharded
            .iter()
            .find(|s| s.logical == shard_name(w, 1, 2))
            .unwrap();
        assert_eq!(flat.dims, [12, 8]);
        assert!(plan
            .sharded
            .iter()
            .any(|s| s.logical == "transformer.wpe.weight" && s.dims == [4, 8]));
        let axis = plan.axis_sharded.iter().find(|s| s.logical == w).unwrap();
        assert_eq!(axis.dims, [24, 8]);
    }

    /// The trained variables of `graph`.
    fn spec_variables(graph: &Graph) -> usize {
        graph
            .to_def()
            .nodes
            .iter()
            .filter(|n| n.op == "Variable")
            .count()
    }

    #[test]
    fn dp2_tp2_runs_megatron_on_each_replica_and_sums_gradients_over_the_dp_groups() {
        let (graph, spec) = model(11, 2, 4);
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 4)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let plan = TensorParallel {
            tp: Some(2),
            bucket_bytes: 1 << 20,
            batch_size: Some(4),
            pipeline: None,
            zero_stage: None,
        }
        .plan(&input)
        .unwrap();
        // The data-parallel size must divide the global batch.
        let e = TensorParallel {
            tp: Some(2),
            bucket_bytes: 1 << 20,
            batch_size: Some(5),
            pipeline: None,
            zero_stage: None,
        }
        .plan(&input)
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("mesh axis dp=2 does not divide the global batch (--batch-size) (5)"),
            "{e}"
        );
        // Megatron-core order: TP groups {0,1}{2,3}, DP groups {0,2}{1,3}.
        let w = |i: u32| task_name("worker", i);
        let groups: Vec<(String, Vec<String>)> = plan
            .groups
            .iter()
            .map(|g| (g.key.clone(), g.members.clone()))
            .collect();
        assert_eq!(
            groups,
            [
                ("tensor_d0".to_string(), vec![w(0), w(1)]),
                ("tensor_d1".to_string(), vec![w(2), w(3)]),
                ("data_t0".to_string(), vec![w(0), w(2)]),
                ("data_t1".to_string(), vec![w(1), w(3)]),
            ]
        );
        // Two parts per batch: ranks 0, 1 feed part 0, ranks 2, 3 part 1, each weighted.
        assert_eq!(plan.batch_parts, 2);
        let mut feeds: Vec<(String, u32, crate::job::FeedRole)> = plan
            .train_signatures()
            .flat_map(|s| s.feeds.iter().map(|f| (f.task.clone(), f.part, f.role)))
            .collect();
        feeds.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        feeds.dedup();
        for (task, part, _) in &feeds {
            let rank: u32 = task.rsplit(':').next().unwrap().parse().unwrap();
            assert_eq!(*part, rank / 2, "{task}");
        }
        assert_eq!(
            feeds
                .iter()
                .filter(|f| f.2 == crate::job::FeedRole::BatchWeight)
                .count(),
            4
        );
        // Rank 2 holds shard 0 (as rank 0 does), its TP collectives in `tensor_d1`, its
        // gradient sums and global loss in `data_t0`.
        let mesh = Mesh::new(2, 2, 1).unwrap();
        let tg = mesh_training(&graph, &spec, &mesh, 1 << 20, None, "idx", "targets").unwrap();
        let g = &tg.graphs[2];
        let nodes = &g.training.def.nodes;
        assert!(nodes
            .iter()
            .any(|n| n.name == shard_name("transformer.h.0.mlp.c_fc.weight", 0, 2)));
        assert!(nodes
            .iter()
            .all(|n| n.device == "/job:worker/task:2" || n.name.starts_with("eval/")));
        let group_of = |n: &NodeDef| match n.attrs.get("group_key") {
            Some(AttrValue::String(s)) => s.to_string(),
            _ => String::new(),
        };
        for n in nodes.iter().filter(|n| n.op == "CollectiveTpReduce") {
            assert_eq!(group_of(n), "tensor_d1", "{}", n.name);
        }
        let sums: Vec<&NodeDef> = nodes.iter().filter(|n| group_of(n) == "data_t0").collect();
        // One bucket of every gradient, then the global loss.
        assert_eq!(
            sums.len(),
            2,
            "{:?}",
            sums.iter().map(|n| &n.name).collect::<Vec<_>>()
        );
        assert_eq!(g.training.loss, sums[1].name);
        // Every update reads a summed gradient (clipping: scaled after the sum).
        for u in nodes.iter().filter(|n| n.op.starts_with("Apply")) {
            let grad = u.inputs.last().unwrap();
            assert!(
                grad.starts_with("tp/clip/grad_") || grad.starts_with("dp/bucket_"),
                "{grad}"
            );
        }
        let clip = nodes
            .iter()
            .find(|n| n.name == "tp/clip/shards_squared_norm")
            .unwrap();
        assert!(
            clip.inputs
                .iter()
                .all(|i| i.starts_with("dp/bucket_0/grad_")),
            "{:?}",
            clip.inputs
        );
        // A small threshold: one bucket per gradient, in one order on every rank.
        let tg = mesh_training(&graph, &spec, &mesh, 1, None, "idx", "targets").unwrap();
        let order = |g: &ReplicaGraph| -> Vec<String> {
            g.training
                .def
                .nodes
                .iter()
                .filter(|n| n.op.starts_with("Collective"))
                .map(|n| n.name.replace("tp_1_of_2", "tp_0_of_2"))
                .collect()
        };
        let first = order(&tg.graphs[0]);
        assert!(first.iter().filter(|n| n.starts_with("dp/bucket_")).count() > 10);
        for g in &tg.graphs[1..] {
            assert_eq!(order(g), first);
        }
        // A pipeline axis is refused.
        let e = mesh_training(
            &graph,
            &spec,
            &Mesh::new(1, 2, 2).unwrap(),
            1,
            None,
            "idx",
            "targets",
        )
        .unwrap_err();
        assert!(e.to_string().contains("pipeline axis"), "{e}");
    }

    #[test]
    fn the_sharding_rules_derive_megatrons_activation_placements() {
        use crate::sharding::Transition;
        let acts = megatron_activations().unwrap();
        let at = |node: &str| acts.iter().find(|a| a.node == node).unwrap().clone();
        assert_eq!(at("attn.c_attn/bias_add").placement, Placement::Shard(1));
        assert_eq!(at("attn/probs").placement, Placement::Shard(1));
        for row in [
            "attn.c_proj/matmul",
            "mlp.c_proj/matmul",
            "transformer.wte/lookup",
        ] {
            assert_eq!(at(row).placement, Placement::Partial, "{row}");
            assert_eq!(at(row).made_whole, Some(Transition::AllReduce), "{row}");
        }
        assert_eq!(at("lm_head").placement, Placement::Shard(1));
        assert_eq!(at("xent").placement, Placement::Replicate);
        // Exactly three all-reduces forward per model: per block two, plus the embedding's.
        assert_eq!(acts.iter().filter(|a| a.made_whole.is_some()).count(), 3);
    }

    #[test]
    fn a_padded_vocabulary_is_masked_and_checkpoints_store_whole_tensors() {
        let (graph, spec) = model(11, 2, 2);
        let tg = tensor_training(&graph, &spec, 2, "idx", "targets").unwrap();
        // 11 → 12: rank 1 holds rows 6..12, the last one padding, masked.
        assert!(ops(&tg.graphs[1], "Add")
            .iter()
            .any(|n| n.name == "xent/tp_masked"));
        assert!(!ops(&tg.graphs[0], "Add")
            .iter()
            .any(|n| n.name == "xent/tp_masked"));
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 2)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let plan = TensorParallel {
            tp: Some(2),
            bucket_bytes: 1 << 20,
            batch_size: Some(4),
            pipeline: None,
            zero_stage: None,
        }
        .plan(&input)
        .unwrap();
        assert_eq!(plan.batch_parts, 1);
        let wte = plan
            .axis_sharded
            .iter()
            .find(|s| s.logical == "transformer.wte.weight/adam_m")
            .unwrap();
        assert_eq!(wte.dims, [11, 8]);
        assert_eq!(wte.padded, 12);
        assert_eq!(
            wte.shards,
            [
                "transformer.wte.weight/tp_0_of_2/adam_m",
                "transformer.wte.weight/tp_1_of_2/adam_m"
            ]
        );
        // Evaluation runs on both ranks' shards: rank 0's loss, rank 1's copy beside it.
        let eval = plan.eval_signature().unwrap();
        assert_eq!(eval.fetches, ["eval/loss:0"]);
    }

    #[test]
    fn evaluation_runs_on_every_ranks_shards_and_moves_no_weight_shard() {
        let (graph, spec) = model(11, 2, 2);
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 2)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let planned = |batch_size| {
            TensorParallel {
                tp: Some(2),
                bucket_bytes: 1 << 20,
                batch_size,
                pipeline: None,
                zero_stage: None,
            }
            .plan(&input)
            .unwrap()
        };
        // The model's placeholders hold 2 rows: a batch of 2.
        let plan = planned(Some(2));
        let eval = plan.eval_signature().unwrap();
        let tasks: Vec<String> = eval.tasks().unwrap().into_iter().collect();
        assert_eq!(tasks, [task_name("worker", 0), task_name("worker", 1)]);
        // Between the ranks: the batch (static, 4 rows), replicated weights, control edges
        // (zero bytes: rank 1's waits for the batch and weights before each collective, the
        // loss); never a shard of a sharded weight.
        let cross: Vec<_> = eval
            .partitions
            .pairs
            .iter()
            .filter(|p| !p.client_terminated && !p.is_control)
            .collect();
        assert!(
            cross.iter().all(|p| !p.tensor_name.contains("/tp_")),
            "{cross:?}"
        );
        let batch = cross
            .iter()
            .find(|p| p.tensor_name.starts_with("eval/idx"))
            .expect("the batch goes to rank 1");
        assert_eq!(batch.bytes, Some(2 * 4 * 8));
        // Rank 1 runs its own copy: its collectives meet rank 0's at the same keys.
        let keys = |task: usize| -> Vec<(String, i64)> {
            let dev = eval
                .partitions
                .partitions
                .iter()
                .find(|(d, _)| d.to_string().contains(&format!("task:{task}")))
                .unwrap()
                .1;
            let mut keys: Vec<(String, i64)> = dev
                .graph
                .to_def()
                .nodes
                .iter()
                .filter(|n| n.op.starts_with("Collective") && n.op != "CollectiveTpCopy")
                .map(
                    |n| match (n.attrs.get("group_key"), n.attrs.get("instance_key")) {
                        (Some(AttrValue::String(g)), Some(AttrValue::Int(k))) => {
                            (g.to_string(), *k)
                        }
                        _ => panic!("{} has no keys", n.name),
                    },
                )
                .collect();
            keys.sort();
            keys
        };
        assert!(!keys(0).is_empty());
        assert_eq!(keys(0), keys(1));
        // Every evaluation key is beyond the training step's.
        let train_max = (0..2)
            .flat_map(|i| plan.signatures[i].partitions.partitions.values())
            .flat_map(|p| p.graph.to_def().nodes)
            .filter_map(|n| match n.attrs.get("instance_key") {
                Some(AttrValue::Int(k)) => Some(*k),
                _ => None,
            })
            .max()
            .unwrap();
        assert!(keys(0).iter().all(|(_, k)| *k > train_max));
        // Without a batch size, or with one the placeholders do not hold, worker 0 joins the
        // shards (the only way without a static batch).
        for joined in [planned(None), planned(Some(4))] {
            let eval = joined.eval_signature().unwrap();
            assert!(eval
                .partitions
                .pairs
                .iter()
                .any(|p| p.tensor_name.contains("/tp_1_of_2")));
        }
    }

    #[test]
    fn one_rank_an_untied_head_and_no_biases_plan_too() {
        let (graph, spec) = model(11, 2, 2);
        let tg = tensor_training(&graph, &spec, 1, "idx", "targets").unwrap();
        assert_eq!(tg.graphs.len(), 1);
        for (tie, bias) in [(false, true), (true, false)] {
            let cfg = GptConfig {
                vocab_size: 11,
                block_size: 4,
                n_layer: 1,
                n_head: 2,
                n_embd: 8,
                tie_weights: tie,
                bias,
                ..GptConfig::default()
            };
            let m = gpt(&cfg).unwrap();
            let graph = Graph::from_def(&m.def).unwrap();
            let tg = tensor_training(&graph, &spec, 2, "idx", "targets").unwrap();
            let names: Vec<&str> = tg.shards.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(names.contains(&"lm_head.weight"), !tie, "{names:?}");
            assert_eq!(
                names.contains(&"transformer.h.0.attn.c_attn.bias"),
                bias,
                "{names:?}"
            );
        }
    }

    #[test]
    fn indivisible_dimensions_and_other_options_are_errors_naming_them() {
        let (graph, spec) = model(11, 2, 2);
        let e = tensor_training(&graph, &spec, 4, "idx", "targets").unwrap_err();
        assert!(
            e.to_string()
                .contains("number of heads (n_head) of transformer.h.0.attn is 2"),
            "{e}"
        );
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 2)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let e = TensorParallel {
            tp: Some(4),
            bucket_bytes: 1 << 20,
            batch_size: None,
            pipeline: None,
            zero_stage: None,
        }
        .plan(&input)
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("--tp 4 does not divide the cluster's 2 workers"),
            "{e}"
        );
        let build = |asynchronous: bool, tp: Option<usize>| {
            (REGISTRATION.build)(&super::super::StrategyOptions {
                asynchronous,
                tp,
                ..Default::default()
            })
        };
        assert!(build(true, None)
            .unwrap_err()
            .to_string()
            .contains("synchronous"));
        assert!(build(false, Some(0))
            .unwrap_err()
            .to_string()
            .contains("at least 1"));
        // Not a GPT.
        let mut b = dflow_graph::builder::GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[2, 2]);
        let y = b.placeholder("y", DType::F32, &[2, 2]);
        let d = b.binary("Sub", "d", &x, &y);
        b.op("Mean", "loss").input(&d).finish();
        let g = b.build().unwrap();
        let e = tensor_training(
            &g,
            &TrainSpec::new("loss", spec.optimizer.clone()),
            2,
            "x",
            "y",
        )
        .unwrap_err();
        assert!(e.to_string().contains("transformer.wte.weight"), "{e}");
    }

    /// A MoE GPT is refused on a dp×tp mesh, naming its first MoE node and the design note of
    /// expert parallelism beside tensor parallelism (not built).
    #[test]
    fn a_moe_gpt_is_refused_naming_the_moe_node_and_the_ep_beside_tp_note() {
        let cfg = GptConfig {
            vocab_size: 11,
            block_size: 4,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            moe: Some(dflow_graph::layers::MoeConfig {
                num_experts: 2,
                top_k: 1,
                capacity_factor: 2.0,
                ..Default::default()
            }),
            ..GptConfig::default()
        };
        let m = gpt(&cfg).unwrap();
        let spec = m.def.train.clone().unwrap();
        let graph = Graph::from_def(&m.def).unwrap();
        let mesh = Mesh::new(2, 2, 1).unwrap();
        let e = mesh_training(&graph, &spec, &mesh, 1 << 20, None, "idx", "targets")
            .unwrap_err()
            .to_string();
        assert!(e.contains("MoE node `transformer.h.0.mlp"), "{e}");
        assert!(
            e.contains("an MoE GPT runs beside tensor parallelism with its experts over ep (--mesh dp=D,tp=T,ep=E)"),
            "{e}"
        );
    }

    /// The groups of docs/experts.md's "ep beside tp" table: inside a dp×tp mesh the
    /// expert-parallel groups are dp ranks of one tp coordinate (the members of `data_t<t>`
    /// at ep = dp), and the expert-data-parallel groups stride over them.
    #[test]
    fn ep_groups_inside_a_dp_tp_mesh_are_those_of_the_ep_beside_tp_note() {
        let mesh: Mesh = "dp=2,tp=2,ep=2".parse().unwrap();
        assert_eq!(mesh.groups(Axis::Tp), [[0, 1], [2, 3]].map(Vec::from));
        assert_eq!(mesh.groups(Axis::Dp), [[0, 2], [1, 3]].map(Vec::from));
        assert_eq!(mesh.groups(Axis::Ep), [[0, 2], [1, 3]].map(Vec::from));
        assert_eq!(
            mesh.expert_data_groups(),
            [[0], [1], [2], [3]].map(Vec::from)
        );
        let mesh: Mesh = "dp=4,tp=2,ep=2".parse().unwrap();
        assert_eq!(
            mesh.groups(Axis::Ep),
            [[0, 2], [1, 3], [4, 6], [5, 7]].map(Vec::from)
        );
        assert_eq!(
            mesh.expert_data_groups(),
            [[0, 4], [1, 5], [2, 6], [3, 7]].map(Vec::from)
        );
        assert_eq!(
            (0..8).map(|w| mesh.expert_rank(w)).collect::<Vec<_>>(),
            [0, 0, 1, 1, 0, 0, 1, 1]
        );
    }
}
