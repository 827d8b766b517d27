//! The 4-axis mesh (`--mesh dp=D,tp=T,pp=P,ep=E`): expert parallelism beside tensor parallelism
//! ([`super::experts`]) inside pipeline stages ([`super::mesh3d`]). Megatron-core's rank order:
//! shard `t` of replica `d` on stage `s` is worker `s·(D·T) + d·T + t` ([`Mesh::rank`]).
//!
//! Rank `(t, d)`'s forward graph is the one `--mesh dp=D,tp=T,ep=E` trains: the tensor rewrite's
//! Megatron graph (`rank_forward`, attention, embedding and loss split over tp), its MoE layers
//! replicated over tp and rewritten by the expert rewrite (`expert::worker_forward`: shard
//! `d mod E` of every expert variable, all-to-alls around the experts, router all-gathers).
//! The pipeline rewrite ([`crate::strategy::pipeline::rewrite`]) cuts it into `P` stages and
//! copies it per micro-batch, as [`super::mesh3d`] does a tensor-parallel rank's graph:
//!
//! - the rank graphs' cuts agree (checked op by op under the one-process names), and every MoE
//!   layer (dispatch, experts, expert weights, combine) lies on one stage (checked);
//! - every micro-batch copy of a collective goes to its stage's group under an instance key of
//!   its own (the forward key plus a stride per micro-batch): Megatron's `f`/`g` and the
//!   vocabulary-parallel loss to [`tp_stage_group`]`(s, d)`, the all-to-alls to
//!   [`ep_stage_group`]`(s, d / E, t)`, the router all-gathers to [`dp_stage_group`]`(s, t)`;
//! - gradients: each expert shard's is summed over the replicas of its stage and tp coordinate
//!   that hold it ([`expert_data_stage_group`], none when `E = D`) and is never reduced over tp
//!   (the T tp ranks of a replica compute the same one); every other parameter's (tp shards
//!   and replicated) over [`dp_stage_group`]`(s, t)`, the loss over the last stage's; each
//!   replica's loss weighted by `1/(m·D)`;
//! - clipping by the whole model's norm: per stage, the tp shards' `Σ‖g‖²` all-reduced over the
//!   stage's tp group, the expert shards' over its expert-parallel group, plus the replicated
//!   parameters' (counted once); the stages' sums meet on the loss's stage;
//! - the dropped token assignments summed on the loss's stage over its dp group;
//! - every worker's collectives chained in one topological order, the same on the members of
//!   every group (their graphs differ only in names and devices);
//! - replica 0's stages evaluate the one-process forward graph (`add_staged_eval`), each
//!   stage's tp shards and expert shards joined on its worker of tp rank 0, so no weight
//!   crosses stages (worker 0 joins them all where the stages cannot carry it, `add_eval`).
//!
//! Micro-batches: as beside `dp × ep × pp`, more than one only where the MoE layers do not
//! couple a batch's tokens (α = 0, capacity factor ≥ E; the pipeline's check).
//!
//! **ZeRO** (`--zero-stage 1|2|3`): the pipeline's per-stage ZeRO
//! (`pipeline::zero::shard_stages`) in place of the sums and the clipping above, told by
//! `rewrite::ExpertStages` (with `beside_tp`) which parameters are tp shards and which expert
//! shards: each (stage, shard)'s dense Adam slots sharded over its dp group (the tp shards'
//! `Σ‖g‖²` then summed over the stage's tp group), each expert shard's over its
//! expert-data-parallel group (`expert::zero::expert_shard_step`; whole when `D = E`, its
//! `Σ‖g‖²` summed over the expert-parallel group), one global clipping norm. At stage 3 the
//! weights too, gathered over those groups before each micro-batch's forward and backward use
//! (the expert shards' flat shards drawn from their rows of the one-process variable), every
//! worker's collectives then chained and numbered in one order; the evaluation joins every
//! flat shard on its stage's worker of replica 0.

use super::experts::{add_eval, add_staged_eval, EvalAt, Staged};
use super::mesh3d::{dp_stage_group, tp_stage_group};
use super::{options, rank_forward, RankAt, ShardedWeight, GROUP};
use crate::job::{task_name, CollectiveGroup, Schedule};
use crate::mesh::{Axis, Mesh};
use crate::strategy::expert::pipeline::{
    add_dropped_count, max_instance, node_device, reduce_shard_gradients, set_scalar,
};
use crate::strategy::expert::{self, ExpertLayout, ForwardGroups};
use crate::strategy::pipeline::gradients::{
    all_reduce_gradients, chain_collectives_per_device, scale_by_global_norm,
};
use crate::strategy::pipeline::rewrite::{
    rewrite, ExpertStages, ExpertsBesideTp, RewriteInput, TensorStages, STAGE_MARK,
};
use crate::strategy::pipeline::schedule::PipelineShape;
use crate::strategy::pipeline::zero::ReplicaZero;
use crate::strategy::pipeline::{worker_device, Pipeline, PipelineError, Prepared};
use crate::strategy::{EvalNames, JobInput, JobPlan, ReplicaGraph, Strategy, StrategyError};
use dflow_graph::train::{TrainSpec, TrainingGraph};
use dflow_graph::{AttrValue, DType, Graph, InputRef, NodeDef};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The expert-parallel group `g` of stage `s`'s tp coordinate `t` (the all-to-alls, the expert
/// shards' clipping norm): the replicas `g·E … g·E + E − 1` of that stage and shard.
pub fn ep_stage_group(s: usize, g: usize, t: usize) -> String {
    format!("experts_ep{g}_s{s}_t{t}")
}

/// The expert-data-parallel group of stage `s`'s tp coordinate `t` whose replicas hold expert
/// shard `k` (the sum of the shard's gradient; only when `D > E`).
pub fn expert_data_stage_group(s: usize, k: usize, t: usize) -> String {
    format!("experts_dp{k}_s{s}_t{t}")
}

/// `--mesh dp=D,tp=T,pp=P,ep=E` (see the module docs): the strategy `tensor` builds it when
/// given an expert-parallel size and pipeline stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorExpertPipeline {
    /// The tensor-parallel size.
    pub tp: usize,
    /// The expert-parallel size (divides the data-parallel size `workers / (tp·pp)`).
    pub ep: usize,
    /// The pipeline: its stages (`Some(P)`), micro-batches and schedule.
    pub pipeline: Pipeline,
    /// ZeRO's fusion threshold: the most bytes of (padded) gradients in one bucket.
    pub bucket_bytes: usize,
    /// ZeRO's stage (1 to 3): each (stage, shard)'s dense Adam slots (3: and weights) sharded
    /// over its dp group, each expert shard's over its expert-data-parallel group (whole when
    /// `D = E`); `None`: no ZeRO.
    pub zero_stage: Option<u8>,
}

impl TensorExpertPipeline {
    /// The mesh of `workers` (refusing one that does not fit), checked against the global batch.
    fn mesh(&self, workers: usize) -> Result<Mesh, StrategyError> {
        let (tp, pp) = (self.tp, self.pipeline.stages.unwrap_or(1));
        if tp == 0 || pp == 0 || workers % (tp * pp) != 0 {
            return Err(options(format!(
                "tp={tp} × pp={pp} does not divide the cluster's {workers} workers: the workers \
                 are dp × tp × pp ranks; use tp and pp whose product divides {workers}"
            )));
        }
        let mesh = Mesh::new(workers / (tp * pp), tp, pp)
            .and_then(|m| m.with_ep(self.ep))
            .map_err(|e| options(e.to_string()))?;
        if let Some(batch) = self.pipeline.batch_size {
            mesh.check_divides(Axis::Dp, batch, "the global batch (--batch-size)")
                .map_err(|e| options(e.to_string()))?;
        }
        Ok(mesh)
    }
}

impl Strategy for TensorExpertPipeline {
    fn name(&self) -> &'static str {
        super::REGISTRATION.name
    }

    fn describe(&self) -> String {
        let zero = match self.zero_stage {
            Some(s) => format!(
                ", ZeRO stage {s} over each (stage, shard)'s data-parallel group and the expert-data-parallel groups"
            ),
            None => String::new(),
        };
        format!(
            "Megatron tensor-parallel training, tp={}, MoE layers replicated over tp with their experts spread over ep={} replicas (all-to-all){zero}, inside the stages of {}",
            self.tp,
            self.ep,
            Strategy::describe(&self.pipeline)
        )
    }

    fn full_batches(&self) -> bool {
        // A pipeline's activations have a static batch, and every replica's part of a batch
        // the same expert capacity.
        true
    }

    fn plan(&self, input: &JobInput<'_>) -> Result<JobPlan, StrategyError> {
        let mesh = self.mesh(input.workers())?;
        let zero = self.zero_stage.map(|stage| ReplicaZero {
            stage,
            bucket_bytes: self.bucket_bytes,
        });
        let graphs = expert_tensor_pipeline_training(
            input.graph,
            input.train,
            &mesh,
            &self.pipeline,
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
        super::experts::mark_shards(
            &mut plan,
            input,
            &graphs.shards,
            &mesh,
            self.zero_stage.is_some(),
        )?;
        Ok(plan)
    }
}

/// The graphs of a `dp × tp × pp × ep` job.
#[derive(Clone, Debug)]
pub struct ExpertTensorPipelineGraphs {
    /// One training graph per (replica `d`, shard `t`), `d`-major: graph `d·T + t` runs the
    /// `P` stages of shard `t` of replica `d`.
    pub graphs: Vec<ReplicaGraph>,
    /// The tensor-parallel sharded weights (the expert variables are sharded over ep instead).
    pub shards: Vec<ShardedWeight>,
    /// Stages, micro-batches, chunks.
    pub shape: PipelineShape,
    /// Per stage: its tp groups, dp groups, expert-parallel groups and (when `D > E`)
    /// expert-data-parallel groups ([`groups`]).
    pub groups: Vec<CollectiveGroup>,
}

/// Every collective group of the 4-axis `mesh`, per stage `s`: the tp groups
/// [`tp_stage_group`]`(s, d)`, the dp groups [`dp_stage_group`]`(s, t)`, the expert-parallel
/// groups [`ep_stage_group`]`(s, g, t)` and, when `D > E`, the expert-data-parallel groups
/// [`expert_data_stage_group`]`(s, k, t)`.
pub fn groups(mesh: &Mesh) -> Vec<CollectiveGroup> {
    let task = |t: usize, d: usize, s: usize| task_name("worker", mesh.rank(t, d, s) as u32);
    let (dp, tp, ep) = (mesh.dp, mesh.tp, mesh.ep.max(1));
    let mut out = Vec::new();
    for s in 0..mesh.pp {
        for d in 0..dp {
            out.push(CollectiveGroup {
                key: tp_stage_group(s, d),
                members: (0..tp).map(|t| task(t, d, s)).collect(),
            });
        }
        for t in 0..tp {
            out.push(CollectiveGroup {
                key: dp_stage_group(s, t),
                members: (0..dp).map(|d| task(t, d, s)).collect(),
            });
        }
        for t in 0..tp {
            for g in 0..dp / ep {
                out.push(CollectiveGroup {
                    key: ep_stage_group(s, g, t),
                    members: (0..ep).map(|i| task(t, g * ep + i, s)).collect(),
                });
            }
        }
        if ep < dp {
            for t in 0..tp {
                for k in 0..ep {
                    out.push(CollectiveGroup {
                        key: expert_data_stage_group(s, k, t),
                        members: (0..dp / ep).map(|j| task(t, k + j * ep, s)).collect(),
                    });
                }
            }
        }
    }
    out
}

/// One rank's forward graph and its cut.
struct RankCut {
    typed: Graph,
    prepared: Prepared,
    /// The rank's tp shards (their names on the rank).
    tp_shards: HashSet<String>,
    /// The rank's expert shards.
    expert_shards: HashSet<String>,
    /// The collectives' largest instance key plus one.
    stride: i64,
}

/// The training graphs of the MoE GPT `graph` on the 4-axis `mesh` (`tp > 1`, `pp > 1`,
/// `ep > 1`), cut and scheduled as `pipeline` says, with ZeRO (stages 1 to 3) over each
/// (stage, shard)'s groups when `zero` says (see the module docs).
pub fn expert_tensor_pipeline_training(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    pipeline: &Pipeline,
    zero: Option<ReplicaZero>,
    features: &str,
    labels: &str,
) -> Result<ExpertTensorPipelineGraphs, StrategyError> {
    let (dp, tp, pp, ep) = (mesh.dp, mesh.tp, mesh.pp, mesh.ep);
    if tp < 2 || pp < 2 || ep < 2 {
        return Err(options(format!(
            "mesh {mesh}: the 4-axis mesh runs with tp ≥ 2, pp ≥ 2 and ep ≥ 2"
        )));
    }
    if let Some(z) = zero {
        if !(1..=3).contains(&z.stage) {
            return Err(options(format!(
                "mesh {mesh} with --zero-stage {}: ZeRO's stages are 1, 2 and 3",
                z.stage
            )));
        }
        crate::strategy::zero::check_optimizer(spec, "tensor")?;
    }
    if super::hand::declares_placements(graph) {
        return Err(options(format!(
            "mesh {mesh}: placements written by hand (`_sharding`) do not run over a pipeline \
             axis (pp={pp}); drop the pp axis"
        )));
    }
    if pipeline.stages != Some(pp) {
        return Err(options(format!(
            "mesh {mesh}: the pipeline must cut {pp} balanced stages"
        )));
    }
    let def = graph.to_def();
    let (gpt, layers) = super::experts::moe_gpt(graph, &def, spec, mesh, features, labels)?;
    let shards = gpt.layout(graph, tp)?;
    // The ranks of one stage as `--mesh dp=D,tp=T,ep=E` numbers them: rank t + T·d.
    let flat = Mesh::new(dp, tp, 1)
        .and_then(|m| m.with_ep(ep))
        .map_err(|e| options(e.to_string()))?;
    let layout = ExpertLayout { mesh: flat };
    // Every rank's forward graph, cut; the cuts agree under the one-process names.
    let mut cuts: Vec<RankCut> = Vec::with_capacity(dp * tp);
    let mut first_cut: HashMap<String, usize> = HashMap::new();
    for d in 0..dp {
        for t in 0..tp {
            let rank = flat.rank(t, d, 0);
            let at = RankAt {
                t,
                tp,
                task: rank,
                group: GROUP.to_string(),
                data: None,
            };
            let forward = rank_forward(&def, &gpt, &shards, spec, &at, features, labels)?;
            let groups = ForwardGroups {
                experts: ep_stage_group_marked(d / ep, t),
                all: dp_stage_group_marked(t),
            };
            let (moe_def, local) =
                expert::worker_forward(&forward.def, &layers, rank, layout, &groups)?;
            let typed = Graph::from_def(&moe_def).map_err(StrategyError::InvalidGraph)?;
            let prepared = pipeline.prepare(&typed, features, labels)?;
            let mut original: HashMap<String, String> = forward
                .renames
                .iter()
                .map(|(k, v)| (v.clone(), k.clone()))
                .collect();
            for v in layers.iter().flat_map(|l| l.variables.iter()) {
                original.insert(expert::shard_name(v, layout.shard(rank)), v.clone());
            }
            for i in typed.node_indices() {
                let name = &typed.node(i).name;
                let name = original.get(name).unwrap_or(name);
                let stage = prepared.stages.stage[i.index()];
                match first_cut.get(name) {
                    Some(&s) if s != stage => {
                        return Err(PipelineError::Internal(format!(
                            "rank (tp {t}, dp {d}) puts `{name}` on stage {stage}, rank 0 on \
                             stage {s}"
                        ))
                        .into())
                    }
                    Some(_) => {}
                    None if rank == 0 => {
                        first_cut.insert(name.clone(), stage);
                    }
                    None => {}
                }
            }
            cuts.push(RankCut {
                stride: max_instance(&moe_def) + 1,
                typed,
                prepared,
                tp_shards: forward.renames.values().cloned().collect(),
                expert_shards: local,
            });
        }
    }
    let Some(first) = cuts.first() else {
        return Err(options(format!("mesh {mesh}: no rank")));
    };
    let (shape, batch) = (first.prepared.shape, first.prepared.batch);
    let m = shape.micro_batches;
    if batch % (dp * m) != 0 {
        return Err(PipelineError::ReplicaBatch {
            batch,
            replicas: dp,
            micro_batches: m,
        }
        .into());
    }
    // Every MoE layer on one stage (pipeline device); each expert variable's stage.
    let mut expert_stage: HashMap<String, usize> = HashMap::new();
    for l in &layers {
        let names = [l.dispatch.clone(), l.combine.clone()]
            .into_iter()
            .chain(l.expert_nodes.iter().cloned())
            .chain(l.variables.iter().cloned());
        let mut on: BTreeMap<usize, String> = BTreeMap::new();
        for n in names {
            if let Some(&v) = first_cut.get(&n) {
                on.entry(shape.device_of(v)).or_insert(n);
            }
        }
        if on.len() > 1 {
            let list: Vec<String> = on
                .iter()
                .map(|(s, n)| format!("`{n}` on stage {s}"))
                .collect();
            return Err(options(format!(
                "MoE layer `{}` is cut between pipeline stages ({}): every expert weight must \
                 stay on one stage; use another pp",
                l.dispatch,
                list.join(", ")
            )));
        }
        if let Some((&s, _)) = on.first_key_value() {
            for v in &l.variables {
                expert_stage.insert(v.clone(), s);
            }
        }
    }
    let stride = cuts.iter().map(|c| c.stride).max().unwrap_or(1);
    let unclipped = TrainSpec {
        clip_global_norm: None,
        ..spec.clone()
    };
    let sums = Sums {
        clip: spec.clip_global_norm,
        // `moe_gpt` checked the loss is f32 (the vocabulary-parallel loss's).
        loss_dtype: DType::F32,
        loss_share: 1.0 / (m * dp) as f64,
        instance: stride * m as i64,
    };
    let mut graphs = Vec::with_capacity(dp * tp);
    for (i, cut) in cuts.iter().enumerate() {
        let (d, t) = (i / tp, i % tp);
        let devices: Vec<String> = (0..pp).map(|s| worker_device(mesh.rank(t, d, s))).collect();
        let dp_groups: Vec<String> = (0..pp).map(|s| dp_stage_group(s, t)).collect();
        let shard = layout.shard(flat.rank(t, d, 0));
        let ep_groups: Vec<String> = (0..pp).map(|s| ep_stage_group(s, d / ep, t)).collect();
        let tensor = TensorStages {
            groups: (0..pp).map(|s| tp_stage_group(s, d)).collect(),
            instance_stride: stride,
            shards: cut.tp_shards.clone(),
            // ZeRO's step tells the expert shards apart by these.
            experts: zero.map(|_| ExpertStages {
                data_groups: (ep < dp).then(|| {
                    (0..pp)
                        .map(|s| expert_data_stage_group(s, shard, t))
                        .collect()
                }),
                rank: d / ep,
                ranks: dp / ep,
                ep,
                beside_tp: Some(ExpertsBesideTp {
                    shards: cut.expert_shards.clone(),
                    groups: ep_groups.clone(),
                }),
            }),
        };
        let mut g = rewrite(&RewriteInput {
            graph: &cut.typed,
            stages: &cut.prepared.stages,
            shape,
            orders: &cut.prepared.orders,
            // ZeRO clips by the global norm itself; without it, clipping is added below.
            spec: if zero.is_some() { spec } else { &unclipped },
            features,
            labels,
            batch_size: batch / dp,
            devices: &devices,
            // Without ZeRO, the replicas' sums are added below (the expert shards' apart);
            // with it, ZeRO's steps over the stage's groups take their place.
            replicas: if zero.is_some() { dp } else { 1 },
            replica: d,
            dp_groups: &dp_groups,
            replica_devices: &[],
            tensor: Some(&tensor),
            zero,
        })?;
        if zero.is_none() {
            let stages = RankStages {
                devices: &devices,
                dp_groups: &dp_groups,
                ep_groups: &ep_groups,
                expert_data: (ep < dp).then(|| {
                    (0..pp)
                        .map(|s| expert_data_stage_group(s, shard, t))
                        .collect()
                }),
            };
            sum_and_clip(&mut g, cut, &tensor, &stages, &sums)?;
        }
        add_dropped_count(&mut g, &devices, &|s| dp_stage_group(s, t))?;
        chain_collectives_per_device(&mut g.training.def)?;
        g.graph = Graph::from_def(&g.training.def).map_err(StrategyError::InvalidGraph)?;
        g.eval = EvalNames {
            features: features.to_string(),
            labels: labels.to_string(),
            loss: spec.loss.clone(),
            metrics: spec.metrics.clone(),
        };
        graphs.push(g);
    }
    // Replica 0's stages evaluate the one-process graph, each joining its stage's shards
    // (worker 0 joins them all where the stages cannot carry it).
    let stage_of = |var: &str| -> Result<usize, StrategyError> {
        match expert_stage.get(var) {
            Some(&s) => Ok(s),
            None => first_cut
                .get(var)
                .map(|&v| shape.device_of(v))
                .ok_or_else(|| PipelineError::Internal(format!("no stage for `{var}`")).into()),
        }
    };
    if let Some(g0) = graphs.first_mut() {
        let at = EvalAt {
            stage: Some(&stage_of),
            own_placeholders: true,
        };
        let zero3 = zero.is_some_and(|z| z.stage >= 3);
        let staged = Staged {
            graph,
            cut: &first_cut,
            shape,
            feeds: (features, labels),
            rows: batch,
        };
        if !add_staged_eval(g0, &def, &shards, &layers, spec, mesh, zero3, &at, &staged)? {
            add_eval(g0, &def, &shards, &layers, spec, mesh, zero3, &at)?;
        }
    }
    Ok(ExpertTensorPipelineGraphs {
        graphs,
        shards,
        shape,
        groups: groups(mesh),
    })
}

/// What every rank's sums without ZeRO ([`sum_and_clip`]) share.
struct Sums {
    /// The clipping norm, if any.
    clip: Option<f64>,
    /// The loss's dtype.
    loss_dtype: DType,
    /// Each replica's micro-batch loss weight, `1/(m·D)`.
    loss_share: f64,
    /// The clipping sums' instance key (above every micro-batch's forward key).
    instance: i64,
}

/// One rank's groups on every stage (pipeline device).
struct RankStages<'a> {
    /// The rank's device on each stage.
    devices: &'a [String],
    /// Its dp group on each stage.
    dp_groups: &'a [String],
    /// Its expert-parallel group on each stage.
    ep_groups: &'a [String],
    /// Its expert-data-parallel group on each stage (when `D > E`).
    expert_data: Option<Vec<String>>,
}

/// Without ZeRO, on rank graph `g` (cut as `cut`, its tp groups in `tensor`): the loss
/// weighted by `1/(m·D)`; each expert shard's gradient summed over the stage's
/// expert-data-parallel group (if any); every other gradient over the stage's dp group, the
/// loss over the last stage's; clipping by the whole model's norm ([`clip_by_three_norms`]).
fn sum_and_clip(
    g: &mut ReplicaGraph,
    cut: &RankCut,
    tensor: &TensorStages,
    at: &RankStages<'_>,
    sums: &Sums,
) -> Result<(), StrategyError> {
    set_scalar(
        &mut g.training.def,
        "pipeline/loss_share",
        sums.loss_share,
        sums.loss_dtype,
    )?;
    let local = &cut.expert_shards;
    if let Some(groups) = &at.expert_data {
        reduce_shard_gradients(&mut g.training, local, at.devices, |s| {
            groups.get(s).cloned().unwrap_or_default()
        })?;
    }
    // The dense gradients over the stage's replicas, the loss over the last stage's.
    let mut dense: Vec<(String, String)> = g
        .training
        .gradients
        .iter()
        .filter(|(v, _)| !local.contains(v))
        .cloned()
        .collect();
    g.training.loss = all_reduce_gradients(
        &mut g.training.def,
        &mut dense,
        &g.graph,
        at.devices,
        at.dp_groups,
        &g.training.loss,
    )?;
    let summed: HashMap<String, String> = dense.into_iter().collect();
    for (v, grad) in &mut g.training.gradients {
        if let Some(s) = summed.get(v) {
            *grad = s.clone();
        }
    }
    if let Some(clip) = sums.clip {
        let loss_device = node_device(&g.training.def, &g.training.loss)?;
        let norms = StageNorms {
            devices: at.devices,
            tp_shards: &cut.tp_shards,
            expert_shards: local,
            tp_groups: &tensor.groups,
            ep_groups: at.ep_groups,
            instance: sums.instance,
        };
        clip_by_three_norms(&mut g.training, &norms, &loss_device, clip)?;
    }
    Ok(())
}

/// [`ep_stage_group`] of every stage: the stage a pipeline device's copy runs on fills in
/// [`STAGE_MARK`].
fn ep_stage_group_marked(g: usize, t: usize) -> String {
    format!("experts_ep{g}_s{STAGE_MARK}_t{t}")
}

/// [`dp_stage_group`] of every stage, as [`ep_stage_group_marked`].
fn dp_stage_group_marked(t: usize) -> String {
    format!("pipeline/stage{STAGE_MARK}_t{t}")
}

/// Where one rank's clipping norm sums its three kinds of gradients.
struct StageNorms<'a> {
    /// Each pipeline device (stage).
    devices: &'a [String],
    /// The rank's tp shards: `Σ‖g‖²` summed over the stage's tp group.
    tp_shards: &'a HashSet<String>,
    /// The rank's expert shards: `Σ‖g‖²` summed over the stage's expert-parallel group.
    expert_shards: &'a HashSet<String>,
    /// The stages' tp groups.
    tp_groups: &'a [String],
    /// The stages' expert-parallel groups.
    ep_groups: &'a [String],
    /// The sums' instance key (above every micro-batch's forward key).
    instance: i64,
}

/// Clipping by the whole model's norm, as `pipeline::gradients::clip_by_stage_norms` does
/// for one kind of shard: per stage, the tp shards' `Σ‖g‖²` all-reduced over the stage's tp
/// group, the expert shards' over its expert-parallel group, and the replicated parameters'
/// (the same on every rank); the stages' sums meet in one `GlobalNormScale` on the loss's
/// device, whose scale multiplies every gradient on its stage. The updates and
/// `training.gradients` read the clipped gradients.
fn clip_by_three_norms(
    training: &mut TrainingGraph,
    n: &StageNorms<'_>,
    loss_device: &str,
    clip: f64,
) -> Result<(), StrategyError> {
    let def = &mut training.def;
    let device_of: HashMap<String, String> = def
        .nodes
        .iter()
        .map(|x| (x.name.clone(), x.device.clone()))
        .collect();
    let stage_of = |grad: &str| -> Result<usize, StrategyError> {
        let node = InputRef::parse(grad)
            .map(|r| r.node().to_string())
            .map_err(PipelineError::Internal)?;
        device_of
            .get(&node)
            .and_then(|d| n.devices.iter().position(|x| x == d))
            .ok_or_else(|| {
                PipelineError::Internal(format!("the device of gradient `{grad}`")).into()
            })
    };
    // Per stage: (tp shards', expert shards', replicated) gradients.
    type Kinds = (Vec<String>, Vec<String>, Vec<String>);
    let mut by_stage: BTreeMap<usize, Kinds> = BTreeMap::new();
    for (var, grad) in &training.gradients {
        let e = by_stage.entry(stage_of(grad)?).or_default();
        if n.tp_shards.contains(var) {
            e.0.push(grad.clone());
        } else if n.expert_shards.contains(var) {
            e.1.push(grad.clone());
        } else {
            e.2.push(grad.clone());
        }
    }
    let node = |name: String, op: &str, inputs: Vec<String>, device: &str| NodeDef {
        name,
        op: op.into(),
        inputs,
        device: device.to_string(),
        colocate_with: vec![],
        attrs: BTreeMap::new(),
    };
    let base = "pipeline/clip";
    let mut added = Vec::new();
    let mut totals = Vec::new();
    for (s, (tp_grads, expert_grads, replicated)) in &by_stage {
        let device = &n.devices[*s];
        let mut parts = Vec::new();
        for (kind, grads, groups) in [
            ("shards", tp_grads, n.tp_groups),
            ("experts", expert_grads, n.ep_groups),
        ] {
            if grads.is_empty() {
                continue;
            }
            let group = groups
                .get(*s)
                .ok_or_else(|| PipelineError::Internal(format!("no group for stage {s}")))?;
            let local = format!("{base}/stage{s}/{kind}_squared_norm");
            added.push(node(local.clone(), "SquaredNorm", grads.clone(), device));
            let sum = format!("{base}/stage{s}/{kind}_squared_norm_sum");
            let mut ar = node(sum.clone(), "CollectiveAllReduce", vec![local], device);
            ar.attrs = BTreeMap::from([
                (
                    "group_key".to_string(),
                    AttrValue::String(group.as_str().into()),
                ),
                ("instance_key".to_string(), AttrValue::Int(n.instance)),
                ("reduce".to_string(), AttrValue::String("sum".into())),
            ]);
            added.push(ar);
            parts.push(sum);
        }
        if !replicated.is_empty() {
            let rep = format!("{base}/stage{s}/replicated_squared_norm");
            added.push(node(rep.clone(), "SquaredNorm", replicated.clone(), device));
            parts.push(rep);
        }
        let total = format!("{base}/stage{s}/squared_norm");
        added.push(node(total.clone(), "AddN", parts, device));
        totals.push(total);
    }
    let total = format!("{base}/squared_norm");
    added.push(node(total.clone(), "AddN", totals, loss_device));
    scale_by_global_norm(training, added, base, total, clip, loss_device, |grad| {
        Ok(n.devices[stage_of(grad)?].clone())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::pipeline::schedule::ScheduleKind;
    use crate::strategy::test_support::{moe_of, tiny_moe_gpt};
    use std::collections::BTreeSet;

    /// A two-block GPT with 4-expert MoE MLPs (capacity factor 4: nothing dropped), no
    /// load-balancing loss (so it may run several micro-batches), clipped at 0.5.
    fn moe_gpt() -> (Graph, TrainSpec) {
        moe_gpt_tied(true)
    }

    /// [`moe_gpt`], its head tied to the embedding or not.
    fn moe_gpt_tied(tie_weights: bool) -> (Graph, TrainSpec) {
        tiny_moe_gpt(|c| {
            c.tie_weights = tie_weights;
            c.grad_clip = Some(0.5);
            moe_of(c).aux_loss_coef = 0.0;
        })
    }

    fn pipeline(micro_batches: usize) -> Pipeline {
        Pipeline {
            stages: Some(2),
            micro_batches,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
            batch_size: Some(8),
        }
    }

    fn attr(n: &NodeDef, key: &str) -> String {
        match n.attrs.get(key) {
            Some(AttrValue::String(s)) => s.to_string(),
            Some(AttrValue::Int(i)) => i.to_string(),
            _ => String::new(),
        }
    }

    fn task_of(device: &str) -> usize {
        dflow_graph::DeviceName::parse(device)
            .ok()
            .and_then(|d| d.task)
            .map_or(usize::MAX, |t| t as usize)
    }

    /// dp=2,tp=2,pp=2,ep=2 with 2 micro-batches.
    fn staged() -> ExpertTensorPipelineGraphs {
        staged_with(2, None)
    }

    /// dp=`dp`,tp=2,pp=2,ep=2 with 2 micro-batches, ZeRO at `zero`.
    fn staged_with(dp: usize, zero: Option<u8>) -> ExpertTensorPipelineGraphs {
        let (graph, spec) = moe_gpt();
        let mesh = Mesh::new(dp, 2, 2).unwrap().with_ep(2).unwrap();
        let zero = zero.map(|stage| ReplicaZero {
            stage,
            bucket_bytes: 1 << 20,
        });
        expert_tensor_pipeline_training(&graph, &spec, &mesh, &pipeline(2), zero, "idx", "targets")
            .unwrap()
    }

    /// The evaluation runs on replica 0's stages (tp rank 0: workers 0 and `D·T`), each
    /// stage's tp, expert (and ZeRO-3 flat) shards joined there: no weight, and nothing
    /// computed from weights only, crosses stages (the head untied; a tied embedding would
    /// cross once per evaluation batch), with and without ZeRO, over dp=2 and dp=4.
    #[test]
    fn evaluates_on_replica_0s_stages_and_moves_weights_within_a_stage_only() {
        let (graph, spec) = moe_gpt_tied(false);
        for (dp, zero) in [
            (2, None),
            (2, Some(1)),
            (2, Some(3)),
            (4, None),
            (4, Some(3)),
        ] {
            let mesh = Mesh::new(dp, 2, 2).unwrap().with_ep(2).unwrap();
            let zero = zero.map(|stage| ReplicaZero {
                stage,
                bucket_bytes: 1 << 20,
            });
            let out = expert_tensor_pipeline_training(
                &graph,
                &spec,
                &mesh,
                &pipeline(1),
                zero,
                "idx",
                "targets",
            )
            .unwrap();
            let def = &out.graphs[0].training.def;
            let per_stage = dp * 2;
            let by_name: HashMap<&str, &NodeDef> =
                def.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
            // Computed from weights only: a variable, or an op all of whose data inputs are.
            let g = &out.graphs[0].graph;
            let mut weighty: HashSet<String> = HashSet::new();
            for i in g.topo_order() {
                let n = g.node(i);
                let inputs = g.inputs(i);
                if n.op_def().is_variable
                    || (!inputs.is_empty()
                        && inputs
                            .iter()
                            .all(|(p, _)| weighty.contains(&g.node(*p).name)))
                {
                    weighty.insert(n.name.clone());
                }
            }
            let mut evaluating = BTreeSet::new();
            let mut crossing = 0;
            for n in def.nodes.iter().filter(|n| n.name.starts_with("eval/")) {
                let stage = task_of(&n.device) / per_stage;
                if !matches!(n.op.as_str(), "Variable" | "Identity") {
                    evaluating.insert(task_of(&n.device));
                }
                for i in &n.inputs {
                    let Ok(InputRef::Data { node: p, .. }) = InputRef::parse(i) else {
                        continue;
                    };
                    let from = by_name[p.as_str()];
                    if task_of(&from.device) / per_stage != stage {
                        crossing += 1;
                        assert!(
                            !weighty.contains(&p),
                            "dp={dp}, {zero:?}: `{p}` crosses stages to `{}`",
                            n.name
                        );
                    }
                }
            }
            assert_eq!(
                evaluating,
                BTreeSet::from([0, per_stage]),
                "dp={dp}, {zero:?}"
            );
            // The activations do cross.
            assert!(crossing > 0, "dp={dp}, {zero:?}");
        }
    }

    /// Where the stages cannot carry the evaluation (here the placeholders take windows of any
    /// length: the staged evaluation's placeholders, of the global batch, get no static shape,
    /// nor does any activation between the stages), `add_staged_eval` changes nothing and worker 0 evaluates a copy reading every stage's
    /// shards joined (`add_eval`): the loss is still fetched, on worker 0, with no op of the
    /// staged evaluation left behind. The same model with fixed windows evaluates on replica
    /// 0's stages (workers 0 and 4).
    #[test]
    fn a_crossing_tensor_of_no_static_size_joins_the_evaluation_on_worker_0() {
        let (graph, spec) = moe_gpt_tied(false);
        let mut any_window = graph.to_def();
        for n in any_window
            .nodes
            .iter_mut()
            .filter(|n| n.op == "Placeholder")
        {
            n.attrs.insert(
                "shape".into(),
                AttrValue::Shape(dflow_graph::Shape::partial(vec![None, None])),
            );
        }
        let any_window = Graph::from_def(&any_window).unwrap();
        let mesh = Mesh::new(2, 2, 2).unwrap().with_ep(2).unwrap();
        let train = |graph: &Graph| {
            let out = expert_tensor_pipeline_training(
                graph,
                &spec,
                &mesh,
                &pipeline(1),
                None,
                "idx",
                "targets",
            )
            .unwrap();
            out.graphs.into_iter().next().unwrap()
        };
        let evaluating = |g0: &ReplicaGraph| -> BTreeSet<usize> {
            (g0.training.def.nodes.iter())
                .filter(|n| n.name.starts_with("eval/") && n.op != "Variable")
                .map(|n| task_of(&n.device))
                .collect()
        };
        // Fixed windows: on the stages, the loss sent to worker 0.
        let on_stages = train(&graph);
        assert_eq!(evaluating(&on_stages), BTreeSet::from([0, 4]));
        assert_eq!(on_stages.eval.loss, "eval/pipeline/fetch/loss");
        // Windows of any length: joined on worker 0.
        let g0 = train(&any_window);
        let def = &g0.training.def;
        let device: HashMap<&str, &str> = (def.nodes.iter())
            .map(|n| (n.name.as_str(), n.device.as_str()))
            .collect();
        let eval: Vec<&NodeDef> = (def.nodes.iter())
            .filter(|n| n.name.starts_with("eval/"))
            .collect();
        assert!(!eval.is_empty());
        assert!(
            eval.iter().all(|n| task_of(&n.device) == 0),
            "{:?}",
            eval.iter()
                .filter(|n| task_of(&n.device) != 0)
                .map(|n| (&n.name, &n.device))
                .collect::<Vec<_>>()
        );
        assert!(
            eval.iter().all(|n| !n.name.starts_with("eval/pipeline/")),
            "a staged evaluation's op is left behind"
        );
        assert_eq!(g0.eval.features, "eval/idx");
        assert_eq!(g0.eval.labels, "eval/targets");
        assert_eq!(g0.eval.loss, format!("eval/{}", spec.loss));
        assert_eq!(
            device.get(g0.eval.loss.as_str()).map(|d| task_of(d)),
            Some(0)
        );
        // It reads stage 1's shards (workers 4 to 7) from where they live.
        let reads_stage_1 = eval.iter().any(|n| {
            n.inputs.iter().any(|i| match InputRef::parse(i) {
                Ok(InputRef::Data { node, .. }) => {
                    device.get(node.as_str()).is_some_and(|d| task_of(d) >= 4)
                }
                _ => false,
            })
        });
        assert!(reads_stage_1, "worker 0 reads none of stage 1's weights");
        // The graph with the joined evaluation is well formed.
        Graph::from_def(def).unwrap();
    }

    /// The groups of `dp=2,tp=2,pp=2,ep=2` are Megatron-core's (worker `s·4 + d·2 + t`): per
    /// stage, TP {0,1} {2,3} / {4,5} {6,7}, DP {0,2} {1,3} / {4,6} {5,7}, and the
    /// expert-parallel groups of each tp coordinate (E = D: the DP groups' members, no
    /// expert-data-parallel group); block 0 (its tp shards and expert shards) on stage 0,
    /// block 1 on stage 1; clipping sums each stage's tp shards over its tp group and its
    /// expert shards over its expert-parallel group, one scale on the loss's stage.
    #[test]
    fn dp2_tp2_pp2_ep2_groups_are_megatron_cores_per_stage() {
        let staged = staged();
        let w = |i: u32| task_name("worker", i);
        let groups: Vec<(String, Vec<String>)> = staged
            .groups
            .iter()
            .map(|g| (g.key.clone(), g.members.clone()))
            .collect();
        let mut want = Vec::new();
        for s in 0..2u32 {
            let b = 4 * s;
            want.extend([
                (format!("tensor_s{s}_d0"), vec![w(b), w(b + 1)]),
                (format!("tensor_s{s}_d1"), vec![w(b + 2), w(b + 3)]),
                (format!("pipeline/stage{s}_t0"), vec![w(b), w(b + 2)]),
                (format!("pipeline/stage{s}_t1"), vec![w(b + 1), w(b + 3)]),
                (format!("experts_ep0_s{s}_t0"), vec![w(b), w(b + 2)]),
                (format!("experts_ep0_s{s}_t1"), vec![w(b + 1), w(b + 3)]),
            ]);
        }
        assert_eq!(groups, want);
        assert_eq!(staged.graphs.len(), 4);
        // Graph d·2 + t: its variables on its stages' workers s·4 + d·2 + t.
        for (i, g) in staged.graphs.iter().enumerate() {
            let (d, t) = (i / 2, i % 2);
            let on = |name: &str| {
                let n = g.training.def.nodes.iter().find(|n| n.name == name);
                task_of(&n.unwrap_or_else(|| panic!("no {name} in graph {i}")).device)
            };
            for (block, s) in [(0, 0), (1, 1)] {
                let expert = format!("transformer.h.{block}.mlp.experts.c_fc.weight/shard_{d}");
                assert_eq!(on(&expert), s * 4 + d * 2 + t, "{expert}");
                let tp = format!("transformer.h.{block}.attn.c_attn.weight/tp_{t}_of_2");
                assert_eq!(on(&tp), s * 4 + d * 2 + t, "{tp}");
                // Clipping's sums: the tp shards' over the stage's tp group, the expert
                // shards' over its expert-parallel group (each shard once, not over tp).
                let group = |name: &str| {
                    let n = g.training.def.nodes.iter().find(|n| n.name == name);
                    attr(
                        n.unwrap_or_else(|| panic!("no {name} in graph {i}")),
                        "group_key",
                    )
                };
                let sum = |kind: &str| format!("pipeline/clip/stage{s}/{kind}_squared_norm_sum");
                assert_eq!(group(&sum("shards")), tp_stage_group(s, d));
                assert_eq!(group(&sum("experts")), ep_stage_group(s, 0, t));
            }
            // One clipping scale, on the loss's stage.
            let scales: Vec<&NodeDef> = g
                .training
                .def
                .nodes
                .iter()
                .filter(|n| n.op == "GlobalNormScale")
                .collect();
            assert_eq!(scales.len(), 1);
            assert_eq!(task_of(&scales[0].device), 4 + d * 2 + t);
        }
    }

    /// One collective as its group's members must agree on it: (op, instance key, size).
    type Call = (String, String, String);

    /// Every collective of every graph is in a group of its worker's stage that holds the
    /// worker, under a key no other collective of that group on that worker uses, and waits
    /// for the worker's one before (one chain per worker); the members of every group call its
    /// collectives in one order (the same ops and keys); every group of the plan is used, and
    /// each micro-batch's copies of a forward collective have keys of their own.
    #[test]
    fn dp2_tp2_pp2_ep2_each_group_has_its_own_keys_and_one_order() {
        let calls = one_order_per_group(&staged());
        // Both micro-batches' all-to-alls on stage 1's expert-parallel groups.
        let a2a = calls["experts_ep0_s1_t0"][&4]
            .iter()
            .filter(|c| c.0 == "CollectiveAllToAll")
            .count();
        // Block 1: two forward all-to-alls and their two gradients, per micro-batch.
        assert_eq!(a2a, 2 * 2 * 2);
    }

    /// The same under ZeRO-2 and ZeRO-3 (its gathers over the dp and expert-data-parallel
    /// groups, every worker's collectives renumbered in one order), and over
    /// `dp=4,tp=2,pp=2,ep=2` (16 workers: each expert shard's gradient, or its ZeRO step, over
    /// `experts_dp<k>_s<s>_t<t>` of 2 replicas), where ZeRO-3 gathers the expert shards over
    /// those groups.
    #[test]
    fn zero_and_dp4_keep_one_order_per_group() {
        for (dp, zero) in [
            (2, Some(2)),
            (2, Some(3)),
            (4, None),
            (4, Some(2)),
            (4, Some(3)),
        ] {
            let calls = one_order_per_group(&staged_with(dp, zero));
            if dp == 4 {
                let sums = &calls["experts_dp1_s1_t1"];
                assert_eq!(
                    sums.keys().copied().collect::<Vec<_>>(),
                    [8 + 2 + 1, 8 + 6 + 1]
                );
                let ops: HashSet<&str> = sums
                    .values()
                    .next()
                    .unwrap()
                    .iter()
                    .map(|c| c.0.as_str())
                    .collect();
                // Without ZeRO the sum; with it the reduce-scatter, the updated shard's
                // gather (at stage 3 the weights' per-pass gathers too) and clipping's sum of
                // the holders' `Σ‖g‖²`.
                let want: HashSet<&str> = match zero {
                    None => HashSet::from(["CollectiveAllReduce"]),
                    Some(_) => HashSet::from([
                        "CollectiveReduceScatter",
                        "CollectiveAllGather",
                        "CollectiveAllReduce",
                    ]),
                };
                assert_eq!(ops, want, "dp=4, ZeRO {zero:?}");
            }
        }
    }

    /// Every collective of every graph of `staged` (see
    /// [`dp2_tp2_pp2_ep2_each_group_has_its_own_keys_and_one_order`]); returns them per group
    /// and member worker.
    fn one_order_per_group(
        staged: &ExpertTensorPipelineGraphs,
    ) -> BTreeMap<String, BTreeMap<usize, Vec<Call>>> {
        let members: HashMap<&str, &Vec<String>> = staged
            .groups
            .iter()
            .map(|g| (g.key.as_str(), &g.members))
            .collect();
        let mut calls: BTreeMap<String, BTreeMap<usize, Vec<Call>>> = BTreeMap::new();
        for g in &staged.graphs {
            let nodes = &g.training.def.nodes;
            let by_name: HashMap<&str, &NodeDef> =
                nodes.iter().map(|n| (n.name.as_str(), n)).collect();
            let mut keys = HashSet::new();
            let mut last_on: HashMap<usize, String> = HashMap::new();
            for i in g.graph.topo_order() {
                let n = by_name[g.graph.node(i).name.as_str()];
                if !n.op.starts_with("Collective") || n.name.starts_with("eval/") {
                    continue;
                }
                let task = task_of(&n.device);
                let group = attr(n, "group_key");
                let Some(m) = members.get(group.as_str()) else {
                    panic!("{} in {group}, not a group of the plan", n.name);
                };
                assert!(
                    m.contains(&task_name("worker", task as u32)),
                    "{} on worker {task} in {group} ({m:?})",
                    n.name
                );
                // Megatron's `f` forward (the identity) calls no collective: ZeRO-3's
                // renumbering leaves its key.
                if n.op == "CollectiveTpCopy" {
                    continue;
                }
                let key = attr(n, "instance_key");
                assert!(
                    keys.insert((task, group.clone(), key.clone())),
                    "{} repeats key {key} of {group}",
                    n.name
                );
                if let Some(prev) = last_on.insert(task, n.name.clone()) {
                    assert!(
                        n.inputs.contains(&format!("^{prev}")),
                        "{} does not wait for {prev}",
                        n.name
                    );
                }
                calls
                    .entry(group)
                    .or_default()
                    .entry(task)
                    .or_default()
                    .push((n.op.clone(), key, attr(n, "group_size")));
            }
        }
        assert_eq!(
            calls.keys().collect::<HashSet<_>>(),
            members
                .keys()
                .map(|k| k.to_string())
                .collect::<HashSet<_>>()
                .iter()
                .collect(),
            "every group of the plan runs collectives"
        );
        for (group, by_task) in &calls {
            assert_eq!(by_task.len(), members[group.as_str()].len(), "{group}");
            let first = by_task.values().next().unwrap();
            for (task, seq) in by_task {
                assert_eq!(seq, first, "{group}: worker {task}'s order");
            }
        }
        calls
    }
}
