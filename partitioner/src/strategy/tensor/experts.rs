//! Expert parallelism beside tensor parallelism (`--mesh dp=D,tp=T,ep=E`, pp = 1), as
//! Megatron-core runs it at expert-tensor-parallel size 1: attention, the embedding and the
//! loss are Megatron-split over each replica's tp group exactly as `--mesh dp=D,tp=T` does
//! (`rank_forward`), and each MoE MLP is **replicated over tp** (no `f`/`g` around
//! it: every tp rank routes all of its replica's tokens on the full hidden width), its experts
//! spread over the expert-parallel group of the dp ranks with the same tp coordinate by the
//! expert rewrite's per-worker step (`expert::worker_forward`).
//!
//! Rank `w = t + T·d` (tp coordinate `t`, replica `d`) holds shard `d mod E` of every expert
//! variable (`<name>/shard_<d mod E>`, the same name on the T tp ranks of its replica: they
//! are replicas). Its collectives run in four kinds of groups (docs/experts.md):
//!
//! - `tensor_d<d>`: Megatron's `f`/`g`, the vocabulary-parallel loss, clipping's sum of the
//!   tp shards' `Σ‖g‖²`;
//! - `data_t<t>`: the dense gradients' buckets (tp shards and replicated parameters, the
//!   routers included), the loss, the load-balancing loss's router all-gathers, the dropped
//!   count;
//! - `experts_ep<g>_t<t>` ([`ep_group`]): the two all-to-alls each way per MoE layer, and
//!   clipping's sum of the expert shards' `Σ‖g‖²`;
//! - `experts_dp<s>_t<t>` ([`expert_data_group`], when `D > E`): each expert shard's gradient
//!   summed over the replicas holding it.
//!
//! An expert shard's gradient is the same on the T tp ranks (same tokens, and the MoE output
//! is consumed replicated, so the same upstream gradient): it is never reduced over tp and is
//! kept out of the dense buckets. The evaluation runs on tp group 0's shards with each MoE
//! layer on rank 0 and its experts on their replicas' ranks (`tensor/experts_eval.rs`; without
//! a batch size worker 0 evaluates a copy reading the tp and expert shards joined).
//!
//! **ZeRO-1/2** ([`TensorExpert::zero_stage`], `zero_step`): the dense parameters' Adam slots
//! sharded over `data_t<t>` by the step dp × tp ZeRO runs (`data::zero_step_with`), each expert
//! shard's over `experts_dp<s>_t<t>` by the step dp × ep ZeRO runs
//! (`expert::zero::expert_shard_step`; whole when `D = E`), one clipping scale from both
//! `Σ‖g‖²`. **ZeRO-3** (`shard_parameters`) also shards the weights over those groups (the
//! expert shards marked as row shards first), gathered just before each pass, the gathers
//! numbered in one order per group; the evaluation gathers them per use (and joins an expert
//! shard on its own rank), worker 0's older copy joins them all from their flat shards. Inside pipeline stages (`--mesh dp=D,tp=T,pp=P,ep=E`) the same rank graphs are cut
//! into stages by [`super::experts_pipeline`].

use super::{
    data, dp_group, eval_copy, finish_rank, global_norm_attrs, options, rank_forward,
    scale_gradients, sharded_variables, squared_norm_across_shards, tp_group, zero_slot_shards,
    Gpt, Nodes, RankAt, RankForward, ShardedWeight, TensorGraphs,
};
use crate::job::{CollectiveGroup, Schedule};
use crate::mesh::{Axis, Mesh};
use crate::strategy::allreduce::{check_job, fresh, node, worker_device};
use crate::strategy::expert::{
    self, expert_shards, moe_layers, ExpertLayout, ForwardGroups, MoeLayer, DROPPED_INSTANCE,
    DROPPED_METRIC,
};
use crate::strategy::zero::{self, params, Clip, Param, ShardGroup};
use crate::strategy::{JobInput, JobPlan, ReplicaGraph, Strategy, StrategyError};
use dflow_graph::train::{expand_training_graph, TrainSpec, TrainingGraph};
use dflow_graph::{AttrValue, DType, Graph, GraphDef, NodeDef};
use std::collections::{HashMap, HashSet};

/// Megatron tensor parallelism with each MoE layer's experts spread over `ep` replicas
/// (`--mesh dp=D,tp=T,ep=E`; see the module docs); the strategy `tensor` builds it when given
/// an expert-parallel size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorExpert {
    /// The tensor-parallel size.
    pub tp: usize,
    /// The expert-parallel size (divides the data-parallel size `workers / tp`).
    pub ep: usize,
    /// Data parallelism's fusion threshold: the most bytes of gradients in one all-reduce.
    pub bucket_bytes: usize,
    /// The global batch, when known: the data-parallel size must divide it.
    pub batch_size: Option<usize>,
    /// ZeRO's stage (1 to 3; `--mesh dp=D,tp=T,ep=E --zero-stage S`): each rank's dense Adam
    /// slots (3: and weights) sharded over its `data_t<t>` group, each expert shard's over its
    /// `experts_dp<s>_t<t>` group (whole when `D = E`); `None`: no ZeRO.
    pub zero_stage: Option<u8>,
}

/// The collective group of rank `rank`'s all-to-alls: `experts_ep<g>_t<t>`, its
/// expert-parallel group (the dp ranks of tp coordinate `t` in run `g` of `ep`).
pub fn ep_group(mesh: &Mesh, rank: usize) -> String {
    let (t, d, _) = mesh.coords(rank);
    format!("experts_ep{}_t{t}", d / mesh.ep.max(1))
}

/// The collective group that sums rank `rank`'s expert gradients, `experts_dp<s>_t<t>`
/// (`s` its expert shard), or `None` when no other replica holds its experts (`dp = ep`).
pub fn expert_data_group(mesh: &Mesh, rank: usize) -> Option<String> {
    let (t, _, _) = mesh.coords(rank);
    (mesh.dp > mesh.ep).then(|| format!("experts_dp{}_t{t}", mesh.expert_rank(rank)))
}

/// Every collective group of `mesh` (pp = 1) over the worker tasks `tasks` (rank `r` is
/// `tasks[r]`): tensor, data, expert-parallel and (when `dp > ep`) expert-data-parallel.
pub fn groups(mesh: &Mesh, tasks: &[String]) -> Vec<CollectiveGroup> {
    let members = |ranks: &[usize]| -> Vec<String> {
        ranks
            .iter()
            .filter_map(|&r| tasks.get(r).cloned())
            .collect()
    };
    let mut out = Vec::new();
    for (d, ranks) in mesh.groups(Axis::Tp).into_iter().enumerate() {
        out.push(CollectiveGroup {
            key: tp_group(mesh, d),
            members: members(&ranks),
        });
    }
    for (t, ranks) in mesh.groups(Axis::Dp).into_iter().enumerate() {
        out.push(CollectiveGroup {
            key: dp_group(t),
            members: members(&ranks),
        });
    }
    for ranks in mesh.groups(Axis::Ep) {
        out.push(CollectiveGroup {
            key: ep_group(mesh, ranks[0]),
            members: members(&ranks),
        });
    }
    for ranks in mesh.expert_data_groups() {
        if let Some(key) = expert_data_group(mesh, ranks[0]) {
            out.push(CollectiveGroup {
                key,
                members: members(&ranks),
            });
        }
    }
    out
}

impl Strategy for TensorExpert {
    fn name(&self) -> &'static str {
        super::REGISTRATION.name
    }

    fn describe(&self) -> String {
        let zero = match self.zero_stage {
            Some(s) => format!(
                ", ZeRO stage {s} over the data-parallel axis and the expert-data-parallel groups"
            ),
            None => String::new(),
        };
        format!(
            "Megatron tensor-parallel training, tp={}, MoE layers replicated over tp with their experts spread over ep={} replicas (all-to-all){zero}",
            self.tp, self.ep
        )
    }

    fn full_batches(&self) -> bool {
        // Every replica's part of every batch must be the same size (equal expert capacity).
        true
    }

    fn plan(&self, input: &JobInput<'_>) -> Result<JobPlan, StrategyError> {
        let workers = input.workers();
        let tp = self.tp;
        let mesh = super::dp_tp_mesh(workers, tp, self.ep, self.batch_size)?;
        let graphs = mesh_expert_training_evaluating(
            input.graph,
            input.train,
            &mesh,
            self.bucket_bytes,
            self.zero_stage,
            (input.features, input.labels),
            self.batch_size,
        )?;
        let placement = input.explicit_placement();
        let tasks: Vec<String> = input.worker_task_names();
        let mut plan = JobPlan::build(
            self.describe(),
            input,
            graphs.graphs,
            &placement,
            Schedule::Lockstep,
            groups(&mesh, &tasks),
        )?;
        plan.batch_parts = mesh.dp as u32;
        mark_shards(
            &mut plan,
            input,
            &graphs.shards,
            &mesh,
            self.zero_stage.is_some(),
        )?;
        Ok(plan)
    }
}

/// The training graphs of the MoE GPT `graph` on a `dp × tp` `mesh` with `ep` (pp = 1), one
/// per rank in Megatron-core order (see the module docs); worker 0's evaluates a copy of the
/// forward graph reading every shard joined.
pub fn mesh_expert_training(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    bucket_bytes: usize,
    zero_stage: Option<u8>,
    features: &str,
    labels: &str,
) -> Result<TensorGraphs, StrategyError> {
    mesh_expert_training_evaluating(
        graph,
        spec,
        mesh,
        bucket_bytes,
        zero_stage,
        (features, labels),
        None,
    )
}

/// [`mesh_expert_training`], whose evaluation, given the held-out batches' rows (`eval_rows`,
/// the global batch size), runs on tensor-parallel group 0's shards with each MoE layer's
/// experts on their replicas' ranks (no weight joined on worker 0;
/// `tensor::experts_eval`); without it worker 0's copy joins every shard.
pub fn mesh_expert_training_evaluating(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    bucket_bytes: usize,
    zero_stage: Option<u8>,
    (features, labels): (&str, &str),
    eval_rows: Option<usize>,
) -> Result<TensorGraphs, StrategyError> {
    if mesh.pp != 1 || mesh.ep < 2 || mesh.dp < 2 {
        return Err(options(format!(
            "mesh {mesh}: expert parallelism beside tensor parallelism runs with pp = 1 and \
             ep ≥ 2 dividing dp"
        )));
    }
    if super::hand::declares_placements(graph) {
        return Err(options(
            "expert parallelism beside tensor parallelism runs on the GPT's layout, not on \
             placements by hand"
                .into(),
        ));
    }
    if let Some(stage) = zero_stage {
        if !matches!(stage, 1..=3) {
            return Err(options(format!(
                "mesh {mesh} with --zero-stage {stage}: ZeRO beside expert parallelism and \
                 tensor parallelism runs at stages 1 to 3; use --zero-stage 1, 2 or 3"
            )));
        }
        crate::strategy::zero::check_optimizer(spec, "tensor")?;
    }
    let def = graph.to_def();
    let (gpt, layers) = moe_gpt(graph, &def, spec, mesh, features, labels)?;
    let shards = gpt.layout(graph, mesh.tp)?;
    let mut graphs = Vec::with_capacity(mesh.size());
    for rank in 0..mesh.size() {
        let at = RankAt::on_mesh(mesh, rank, bucket_bytes, zero_stage);
        let parts = RankParts {
            forward: &def,
            gpt: &gpt,
            shards: &shards,
            layers: &layers,
            spec,
            mesh,
            feeds: (features, labels),
        };
        graphs.push(rank_graph(&parts, &at)?);
    }
    let zero3 = zero_stage.is_some_and(|s| s >= 3);
    let mut sharded = false;
    if let Some(rows) = eval_rows {
        let e = super::experts_eval::ExpertEval {
            forward: &def,
            gpt: &gpt,
            shards: &shards,
            layers: &layers,
            mesh,
            zero3,
            bucket_bytes,
        };
        let feeds = super::eval::EvalFeeds {
            features,
            labels,
            rows,
        };
        sharded = super::experts_eval::add_expert_eval(&mut graphs, &e, spec, &feeds)?;
    }
    if let (false, Some(g0)) = (sharded, graphs.first_mut()) {
        add_eval(
            g0,
            &def,
            &shards,
            &layers,
            spec,
            mesh,
            zero3,
            &EvalAt::one_stage(),
        )?;
    }
    Ok(TensorGraphs { graphs, shards })
}

/// Marks the variables of `plan` that ep beside tp splits (on `mesh`, with or without a
/// pipeline axis), for checkpoints to join: without ZeRO the expert shards (over ep) and the
/// tp shards (`shards`, along their axes); with ZeRO, ZeRO's flat shards first (the dense
/// slots over each dp group of a tp shard, each expert shard's over its holders), then the tp
/// shards and the expert row shards along their axes.
pub(super) fn mark_shards(
    plan: &mut JobPlan,
    input: &JobInput<'_>,
    shards: &[ShardedWeight],
    mesh: &Mesh,
    zero: bool,
) -> Result<(), StrategyError> {
    let layers = moe_layers(input.graph, &input.graph.to_def())?;
    if zero {
        let (_, rows) = expert::zero_dims(input.graph, &layers, mesh.ep);
        let mut sharded = zero_slot_shards(input, shards, &plan.variables, mesh);
        if mesh.dp > mesh.ep {
            sharded.extend(crate::strategy::zero::slot_shards(
                &plan.variables,
                &rows,
                mesh.dp / mesh.ep,
            ));
        }
        let mut axis = sharded_variables(shards, &plan.variables, &sharded, mesh.tp);
        axis.extend(expert::expert_row_shards(
            &plan.variables,
            &sharded,
            &layers,
            &rows,
            mesh.ep,
        ));
        plan.sharded = sharded;
        plan.axis_sharded = axis;
    } else {
        plan.sharded = expert_shards(&layers, &plan.variables, mesh.ep);
        plan.axis_sharded = sharded_variables(shards, &plan.variables, &[], mesh.tp);
    }
    Ok(())
}

/// The MoE GPT `graph` (as `def`) as ep beside tp splits it on `mesh`: the job checked (its
/// feeds, an f32 loss for the vocabulary-parallel loss), its GPT (the MoE MLPs replicated over
/// tp) and its MoE layers, each with experts that divide evenly over `mesh.ep`. Shared by
/// `dp × tp × ep` and the 4-axis mesh.
pub(super) fn moe_gpt(
    graph: &Graph,
    def: &GraphDef,
    spec: &TrainSpec,
    mesh: &Mesh,
    features: &str,
    labels: &str,
) -> Result<(Gpt, Vec<MoeLayer>), StrategyError> {
    let loss_dtype = check_job(graph, spec, mesh.size(), features, labels)?;
    if loss_dtype != DType::F32 {
        return Err(options(format!(
            "the loss is {loss_dtype}; the vocabulary-parallel loss is built in f32"
        )));
    }
    let gpt = Gpt::of_with_moe(graph, def, true)?;
    let layers = moe_layers(graph, def)?;
    if layers.is_empty() {
        return Err(options(
            "--mesh with ep spreads MoE experts, and the graph has no MoE layer (MoeDispatch … \
             MoeCombine); drop ep from the mesh"
                .into(),
        ));
    }
    for l in &layers {
        if l.experts % mesh.ep != 0 {
            return Err(options(format!(
                "MoE layer `{}` has {} experts, which do not split evenly over ep={}; use an \
                 ep that divides {}",
                l.dispatch, l.experts, mesh.ep, l.experts
            )));
        }
    }
    Ok((gpt, layers))
}

/// What every rank's graph is built from.
struct RankParts<'a> {
    forward: &'a GraphDef,
    gpt: &'a Gpt,
    shards: &'a [ShardedWeight],
    layers: &'a [MoeLayer],
    spec: &'a TrainSpec,
    mesh: &'a Mesh,
    feeds: (&'a str, &'a str),
}

/// Rank `at`'s training graph: the tensor rewrite's forward graph, its MoE layers rewritten by
/// the expert rewrite over the rank's groups, the loss weighted by the replica's share; the
/// dense gradients bucketed over `data_t<t>`, the expert shards' summed over their
/// expert-data-parallel group (if any); clipping by one global norm of the three kinds of
/// gradients; the dropped count over `data_t<t>`.
fn rank_graph(p: &RankParts<'_>, at: &RankAt) -> Result<ReplicaGraph, StrategyError> {
    let (features, labels) = p.feeds;
    let device = worker_device("", "", at.task)?;
    let RankForward {
        def: tensor_def,
        renames,
        instance,
    } = rank_forward(p.forward, p.gpt, p.shards, p.spec, at, features, labels)?;
    let ep_key = ep_group(p.mesh, at.task);
    let forward_groups = ForwardGroups {
        experts: ep_key.clone(),
        all: dp_group(at.t),
    };
    let layout = ExpertLayout { mesh: *p.mesh };
    let (mut def, local) =
        expert::worker_forward(&tensor_def, p.layers, at.task, layout, &forward_groups)?;
    let replica = at
        .data
        .as_ref()
        .ok_or_else(|| options("expert parallelism beside tp needs dp ≥ 2".into()))?;
    let weighting = data::weight_loss(&mut def, &p.spec.loss, &device);
    let forward_names: HashSet<String> = def.nodes.iter().map(|x| x.name.clone()).collect();
    let (mut training, typed) = expand_training_graph(
        &def,
        &TrainSpec {
            clip_global_norm: None,
            loss: weighting.weighted.clone(),
            ..p.spec.clone()
        },
    )?;
    let mut n = Nodes {
        taken: training.def.nodes.iter().map(|x| x.name.clone()).collect(),
        added: Vec::new(),
        device: device.clone(),
        instance,
        group: at.group.clone(),
    };
    let all = std::mem::take(&mut training.gradients);
    let (expert_grads, dense): (Vec<_>, Vec<_>) =
        all.iter().cloned().partition(|(v, _)| local.contains(v));
    let grads = Gradients {
        dense,
        experts: expert_grads,
    };
    let mut zero3 = None;
    let (dense, expert_grads) = match replica.zero_stage {
        Some(stage) => {
            let step = ZeroStep {
                stage,
                replica,
                weighted: &weighting.weighted,
                renames: &renames,
            };
            let (grads, params) = zero_step(&mut training, &typed, &mut n, p, at, &step, grads)?;
            zero3 = (stage >= 3).then_some(params);
            grads
        }
        None => all_reduce_step(
            &mut training,
            &typed,
            &mut n,
            p,
            at,
            replica,
            &weighting.weighted,
            &renames,
            grads,
        )?,
    };
    let mut now: HashMap<String, String> = dense.into_iter().chain(expert_grads).collect();
    training.gradients = all
        .into_iter()
        .filter_map(|(v, _)| now.remove(&v).map(|g| (v, g)))
        .collect();
    training.def.nodes.extend(std::mem::take(&mut n.added));
    if let Some(params) = zero3 {
        shard_parameters(
            &mut training,
            &forward_names,
            &local,
            p.mesh,
            at,
            params,
            n.instance,
        )?;
    }
    let dropped = add_dropped_count(&mut training.def, &training.loss, p.forward, at, &device);
    let mut g = finish_rank(
        training,
        at,
        Some(weighting.weight),
        p.spec,
        features,
        labels,
    )?;
    if let Some(d) = dropped {
        g.step_metrics.push((DROPPED_METRIC.to_string(), d));
    }
    Ok(g)
}

/// A rank's gradients (variable, gradient): the dense ones (tp shards and replicated) and its
/// expert shards'.
struct Gradients {
    dense: Vec<(String, String)>,
    experts: Vec<(String, String)>,
}

/// Without ZeRO: the dense gradients bucketed over `data_t<t>` (the loss made the global
/// batch's), each expert shard's summed over its expert-data-parallel group (if any), clipping
/// by one global norm of the three kinds. Returns the gradients the updates read (dense,
/// experts).
#[allow(clippy::too_many_arguments)]
fn all_reduce_step(
    training: &mut TrainingGraph,
    typed: &Graph,
    n: &mut Nodes,
    p: &RankParts<'_>,
    at: &RankAt,
    replica: &data::Replica,
    weighted: &str,
    renames: &HashMap<String, String>,
    grads: Gradients,
) -> Result<Grads, StrategyError> {
    let Gradients {
        dense,
        experts: mut expert_grads,
    } = grads;
    training.gradients = dense;
    data::reduce_gradients(training, typed, n, replica, weighted)?;
    let dense = std::mem::take(&mut training.gradients);
    // Each expert shard's gradient summed over the replicas holding it.
    if let Some(group) = expert_data_group(p.mesh, at.task) {
        let mut summed: HashMap<String, String> = HashMap::new();
        for (k, (_, g)) in expert_grads.iter_mut().enumerate() {
            let s = n.collective_in(
                &group,
                &format!("experts/grad_{k}/all_reduce"),
                "CollectiveAllReduce",
                g.clone(),
                "sum",
            );
            summed.insert(g.clone(), s.clone());
            *g = s;
        }
        point_updates(&mut training.def.nodes, &summed);
    }
    if let Some(clip) = p.spec.clip_global_norm {
        // Σ‖g‖²: the replicated (equal everywhere) + the tp shards' over tensor_d<d> + the
        // expert shards' over experts_ep<g>_t<t> (each shard once: not over tp).
        let mut total = squared_norm_across_shards(&dense, n, renames);
        if !expert_grads.is_empty() {
            let local_sq = n.add(
                "ep/clip/experts_squared_norm",
                "SquaredNorm",
                expert_grads.iter().map(|(_, g)| g.clone()).collect(),
                vec![],
            );
            let sum = n.collective_in(
                &ep_group(p.mesh, at.task),
                "ep/clip/experts_squared_norm_sum",
                "CollectiveAllReduce",
                local_sq,
                "sum",
            );
            total = Some(match total {
                Some(t) => n.add("ep/clip/squared_norm", "Add", vec![t, sum], vec![]),
                None => sum,
            });
        }
        if let Some(total) = total {
            let scale = n.add(
                "ep/clip/global_norm_scale",
                "GlobalNormScale",
                vec![total],
                global_norm_attrs(clip),
            );
            let grads: Vec<(String, String)> = dense.iter().chain(&expert_grads).cloned().collect();
            scale_gradients(training, n, &grads, &scale);
        }
    }
    Ok((dense, expert_grads))
}

/// (dense, experts) gradients, as the updates read them.
type Grads = (Vec<(String, String)>, Vec<(String, String)>);

/// The parameters [`zero_step`] left in ZeRO's shard layout, with the groups they are sharded
/// over: the dense ones over `data_t<t>`, the expert shards over `experts_dp<s>_t<t>` (none
/// when `D = E`: each expert shard stays whole on its holders).
struct ShardedParams {
    dense: (Vec<Param>, ShardGroup),
    experts: Option<(Vec<Param>, ShardGroup)>,
}

/// ZeRO-3 beside ep × tp: each of the rank's dense weights (tp shards and replicated) becomes
/// its flat shard over `data_t<t>` and each of its expert shards (`local`, marked as row
/// shards first) its flat shard over `experts_dp<s>_t<t>` (when `D > E`), every use reading
/// a gather just before its pass (`forward`: the forward graph's nodes) over the same group
/// ([`params::shard_parameters_by`]). The gathers are numbered from `instance` in the graph's
/// order, which every member of a group shares, so each group runs them in one order.
fn shard_parameters(
    training: &mut TrainingGraph,
    forward: &HashSet<String>,
    local: &HashSet<String>,
    mesh: &Mesh,
    at: &RankAt,
    params: ShardedParams,
    instance: i64,
) -> Result<(), StrategyError> {
    let roots = [training.train_op.clone(), training.loss.clone()];
    let roots: Vec<&str> = roots
        .iter()
        .map(|r| r.split(':').next().unwrap_or(r))
        .collect();
    let pass = |x: &NodeDef| {
        if forward.contains(&x.name) {
            "forward".to_string()
        } else {
            "backward".to_string()
        }
    };
    let def = &mut training.def;
    let (dense, dense_group) = &params.dense;
    params::shard_parameters_by(def, dense, dense_group, forward, &roots, &pass)?;
    let mut keys = vec![dense_group.key.clone()];
    if let Some((experts, group)) = &params.experts {
        let shard = mesh.expert_rank(at.task);
        for v in def.nodes.iter_mut().filter(|x| local.contains(&x.name)) {
            expert::zero::as_row_split(v, mesh.ep, shard);
        }
        params::shard_parameters_by(def, experts, group, forward, &roots, &pass)?;
        keys.push(group.key.clone());
    }
    let gathers = def.nodes.iter_mut().filter(|x| {
        x.op == "CollectiveAllGather"
            && matches!(x.attrs.get("group_key"), Some(AttrValue::String(k)) if keys.iter().any(|g| **k == **g))
            && matches!(x.attrs.get("instance_key"), Some(AttrValue::Int(0)))
    });
    for (x, key) in gathers.zip(instance..) {
        x.attrs.insert("instance_key".into(), AttrValue::Int(key));
    }
    Ok(())
}

/// What [`zero_step`] shards with.
struct ZeroStep<'a> {
    /// ZeRO's stage (1 to 3; stage 3's weights are sharded after the step).
    stage: u8,
    /// The rank's replica: its `data_t<t>` group.
    replica: &'a data::Replica,
    /// The replica's weighted loss.
    weighted: &'a str,
    /// Each tp-sharded variable's name on this rank.
    renames: &'a HashMap<String, String>,
}

/// ZeRO at `z.stage` in place of [`all_reduce_step`]'s all-reduces, composed of the steps
/// dp × tp ZeRO and dp × ep ZeRO run: the dense gradients get [`data::zero_step_with`] over
/// `data_t<t>` (each rank keeps its `1/D` shard of its tp shards' and replicated parameters'
/// Adam slots; `Σ‖g‖²` summed over `data_t<t>`, the tp shards' then over `tensor_d<d>`), the
/// loss is made the global batch's, and the expert shards get
/// [`expert::zero::expert_shard_step`] over `experts_dp<s>_t<t>` (the rank's position in it
/// `d / E` of `D / E`; whole slots when `D = E`; `Σ‖g‖²` summed over `experts_ep<g>_t<t>`).
/// With clipping, one `GlobalNormScale` of the two sums scales every shard's update. Returns
/// the gradients as the step left them (dense, experts).
fn zero_step(
    training: &mut TrainingGraph,
    typed: &Graph,
    n: &mut Nodes,
    p: &RankParts<'_>,
    at: &RankAt,
    z: &ZeroStep<'_>,
    grads: Gradients,
) -> Result<(Grads, ShardedParams), StrategyError> {
    let clip = p.spec.clip_global_norm;
    let scale = clip.map(|_| fresh(&mut n.taken, "ep/zero/clip/global_norm_scale"));
    let how = scale.as_deref().map_or(Clip::None, Clip::Scale);
    // The dense parameters over data_t<t>, then the global batch's loss.
    training.gradients = grads.dense;
    let tp_sharded: HashSet<String> = z.renames.values().cloned().collect();
    let (dense_params, dense_squared) = data::zero_step_with(
        training,
        typed,
        n,
        z.replica,
        z.stage,
        &at.group,
        &tp_sharded,
        how,
    )?;
    data::global_loss(training, n, z.replica, z.weighted);
    let dense = std::mem::take(&mut training.gradients);
    // The expert shards over the replicas holding them (of the same tp coordinate).
    let mesh = p.mesh;
    let (_, d, _) = mesh.coords(at.task);
    let holders = expert_data_group(mesh, at.task).map(|key| ShardGroup {
        rank: d / mesh.ep,
        ranks: mesh.dp / mesh.ep,
        stage: z.stage,
        key,
        bucket_bytes: z.replica.bucket_bytes,
    });
    let ep_key = ep_group(mesh, at.task);
    let mut nodes = zero::Nodes::new(std::mem::take(&mut n.taken), &n.device, n.instance);
    let (expert_params, experts_squared) = expert::zero::expert_shard_step(
        training,
        typed,
        &mut nodes,
        &n.device,
        grads.experts,
        holders.as_ref(),
        (&ep_key, mesh.ep),
        scale.as_deref(),
    )?;
    n.taken = nodes.taken;
    n.instance = nodes.instance;
    n.added.extend(nodes.added);
    let experts = std::mem::take(&mut training.gradients);
    if let (Some(clip), Some(scale)) = (clip, &scale) {
        let terms: Vec<String> = dense_squared.into_iter().chain(experts_squared).collect();
        let total = n.add("ep/zero/clip/squared_norm", "AddN", terms, vec![]);
        let mut s = node(scale, "GlobalNormScale", vec![total], &n.device);
        s.attrs = global_norm_attrs(clip)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        n.added.push(s);
    }
    let sharded = ShardedParams {
        dense: (dense_params, data::shard_group(z.replica, z.stage)),
        experts: holders.map(|g| (expert_params, g)),
    };
    Ok(((dense, experts), sharded))
}

/// Points every update reading a gradient of `summed` at its sum.
fn point_updates(nodes: &mut [NodeDef], summed: &HashMap<String, String>) {
    for u in nodes.iter_mut().filter(|u| u.op.starts_with("Apply")) {
        for i in &mut u.inputs {
            if let Some(s) = summed.get(i.as_str()) {
                *i = s.clone();
            }
        }
    }
}

/// The step's dropped token assignments of the whole job: the sum of every `MoeRoute`'s
/// `dropped` output (the replica's tokens), all-reduced over `data_t<t>` after the loss (every
/// replica's once). Returns its node, `None` without MoE route.
fn add_dropped_count(
    def: &mut GraphDef,
    loss: &str,
    forward: &GraphDef,
    at: &RankAt,
    device: &str,
) -> Option<String> {
    let routes: Vec<String> = forward
        .nodes
        .iter()
        .filter(|n| n.op == "MoeRoute")
        .map(|n| format!("{}:3", n.name))
        .collect();
    if routes.is_empty() {
        return None;
    }
    let mut taken: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
    let local = if routes.len() == 1 {
        routes[0].clone()
    } else {
        let sum = fresh(&mut taken, "moe/dropped/local");
        def.nodes.push(node(&sum, "AddN", routes, device));
        sum
    };
    let global = fresh(&mut taken, "moe/dropped/global");
    let mut c = node(
        &global,
        "CollectiveAllReduce",
        vec![local, format!("^{loss}")],
        device,
    );
    c.attrs = [
        (
            "group_key",
            AttrValue::String(dp_group(at.t).as_str().into()),
        ),
        ("instance_key", AttrValue::Int(DROPPED_INSTANCE)),
        ("reduce", AttrValue::String("sum".into())),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    def.nodes.push(c);
    Some(global)
}

/// The stage (pp coordinate) holding a one-process variable.
pub(super) type StageOf<'a> = dyn Fn(&str) -> Result<usize, StrategyError> + 'a;

/// Where worker 0's evaluation copy ([`add_eval`]) finds the shards it joins.
pub(super) struct EvalAt<'a> {
    /// Inside pipeline stages: the stage (pp coordinate) holding each one-process variable;
    /// `None`: one stage (pp = 1).
    pub stage: Option<&'a StageOf<'a>>,
    /// The copy reads placeholders of its own (`eval/<name>`, as the one-process graph writes
    /// them: a pipeline's training placeholders have a static batch), else the training ones.
    pub own_placeholders: bool,
}

impl EvalAt<'_> {
    /// One stage: the training placeholders, every rank's devices as `--mesh dp=D,tp=T,ep=E`
    /// places them.
    pub(super) fn one_stage() -> EvalAt<'static> {
        EvalAt {
            stage: None,
            own_placeholders: false,
        }
    }

    /// The stage of one-process variable `var` (0 with one stage).
    fn stage_of(&self, var: &str) -> Result<usize, StrategyError> {
        self.stage.map_or(Ok(0), |f| f(var))
    }

    /// The device of mesh rank `rank`.
    fn device(&self, rank: usize) -> Result<String, StrategyError> {
        match self.stage {
            None => worker_device("", "", rank),
            Some(_) => Ok(crate::strategy::pipeline::worker_device(rank)),
        }
    }
}

/// Worker 0's evaluation: a copy of the forward graph (`eval/...`, `eval_copy`) reading the
/// tp shards joined and each expert variable joined from the ep shards that the ranks of tp
/// coordinate 0 hold (shard `j` on rank `T·j`). Under ZeRO-3 (`zero3`) every weight is first
/// joined from its flat shards: a dense one's over `data_t<t>` (flat shard `d` on rank
/// `t + T·d`), expert shard `j`'s over its holders of tp coordinate 0 (flat shard `k` of `D/E`
/// on rank `T·(j + E·k)`; whole on rank `T·j` when `D = E`).
#[allow(clippy::too_many_arguments)]
pub(super) fn add_eval(
    g0: &mut ReplicaGraph,
    forward: &GraphDef,
    shards: &[ShardedWeight],
    layers: &[MoeLayer],
    spec: &TrainSpec,
    mesh: &Mesh,
    zero3: bool,
    at: &EvalAt<'_>,
) -> Result<(), StrategyError> {
    let device = worker_device("", "", 0)?;
    let mut taken: HashSet<String> = g0
        .training
        .def
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .collect();
    let mut fwd = forward.clone();
    let joined = join_experts(g0, &mut taken, forward, layers, mesh, zero3, at, &|_| {
        Ok(device.clone())
    })?;
    for (var, joined) in joined {
        // The copy reads the joined shards where it read the variable.
        if let Some(x) = fwd.nodes.iter_mut().find(|n| n.name == var) {
            *x = node(&var, "Identity", vec![joined], &device);
        }
    }
    let tp = mesh.tp;
    let on_rank = |v: &NodeDef, r: usize, d: usize| match at.stage {
        None => worker_device(&v.name, &v.device, r + tp * d),
        Some(_) => at.device(mesh.rank(r, d, at.stage_of(&v.name)?)),
    };
    let flat = zero3.then_some(mesh.dp);
    eval_copy(
        g0,
        &fwd,
        shards,
        spec,
        tp,
        &on_rank,
        at.own_placeholders,
        flat,
    )
}

/// What [`add_staged_eval`] needs of the 4-axis mesh's pipeline.
pub(super) struct Staged<'a> {
    /// The one-process graph (`forward`'s).
    pub graph: &'a Graph,
    /// The virtual stage of replica 0's ops, under their one-process names.
    pub cut: &'a HashMap<String, usize>,
    /// Stages, micro-batches, chunks.
    pub shape: crate::strategy::pipeline::schedule::PipelineShape,
    /// The features and labels placeholders.
    pub feeds: (&'a str, &'a str),
    /// Rows of a whole held-out batch (the global batch size).
    pub rows: usize,
}

/// The 4-axis mesh's evaluation on replica 0's stages: each stage's tp shards, expert shards
/// (and under ZeRO-3 flat shards) joined on that stage's worker of replica 0, tp rank 0
/// (`at` places the shards as [`add_eval`] says), and the one-process forward graph run
/// there as one rank (`pipeline::eval::add_sharded_stage_eval`), so no weight crosses
/// stages. Returns `false`, changing nothing, where the stages cannot carry it (a crossing
/// tensor of no static size): the caller joins on worker 0 instead ([`add_eval`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn add_staged_eval(
    g0: &mut ReplicaGraph,
    forward: &GraphDef,
    shards: &[ShardedWeight],
    layers: &[MoeLayer],
    spec: &TrainSpec,
    mesh: &Mesh,
    zero3: bool,
    at: &EvalAt<'_>,
    staged: &Staged<'_>,
) -> Result<bool, StrategyError> {
    use crate::strategy::expert::eval::one_process_stages;
    use crate::strategy::pipeline::eval::{add_sharded_stage_eval, RankStages};
    let backup = g0.clone();
    let join_device = |var: &str| at.device(mesh.rank(0, 0, at.stage_of(var)?));
    let mut taken: HashSet<String> = g0
        .training
        .def
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .collect();
    let experts = join_experts(
        g0,
        &mut taken,
        forward,
        layers,
        mesh,
        zero3,
        at,
        &join_device,
    )?;
    let on_rank =
        |v: &NodeDef, r: usize, d: usize| at.device(mesh.rank(r, d, at.stage_of(&v.name)?));
    let joined = super::joined_weights(
        taken,
        forward,
        shards,
        mesh.tp,
        &on_rank,
        zero3.then_some(mesh.dp),
        &join_device,
    )?;
    let mut weights = joined.map;
    weights.extend(experts);
    let (features, labels) = staged.feeds;
    let stages = one_process_stages(staged.graph, staged.cut, staged.shape, features, labels);
    let devices = (0..mesh.pp)
        .map(|s| at.device(mesh.rank(0, 0, s)))
        .collect::<Result<Vec<_>, _>>()?;
    let no_devices = HashMap::new();
    let rank = RankStages {
        graph: staged.graph,
        stages: &stages,
        devices,
        groups: Vec::new(),
        own: HashSet::new(),
        variable_device: &no_devices,
        weights,
        weight_nodes: joined.nodes,
        copy_shared: true,
    };
    let base = crate::strategy::expert::pipeline::max_instance(&g0.training.def) + 1;
    let done = add_sharded_stage_eval(
        g0,
        &[rank],
        staged.shape,
        spec,
        features,
        labels,
        staged.rows,
        base,
    )?;
    if !done {
        *g0 = backup;
    }
    Ok(done)
}

/// Each expert variable of `forward` joined from its ep shards (tp coordinate 0's, as
/// [`add_eval`] says) on `join_device(variable)`, the shards and joins added to `g0`: the
/// pairs (variable, its joined value).
#[allow(clippy::too_many_arguments)]
fn join_experts(
    g0: &mut ReplicaGraph,
    taken: &mut HashSet<String>,
    forward: &GraphDef,
    layers: &[MoeLayer],
    mesh: &Mesh,
    zero3: bool,
    at: &EvalAt<'_>,
    join_device: &dyn Fn(&str) -> Result<String, StrategyError>,
) -> Result<Vec<(String, String)>, StrategyError> {
    let mut out = Vec::new();
    for l in layers {
        let per = (l.experts / mesh.ep) as i64;
        for var in &l.variables {
            let Some(v) = forward.nodes.iter().find(|n| &n.name == var) else {
                continue;
            };
            let device = join_device(var)?;
            let mut pieces = Vec::with_capacity(mesh.ep);
            let holders = mesh.dp / mesh.ep;
            for j in 0..mesh.ep {
                let name = expert::shard_name(var, j);
                if zero3 && holders > 1 {
                    pieces.push(joined_expert_shard(
                        g0,
                        taken,
                        (v, &name),
                        (j, per),
                        (mesh, at),
                        &device,
                    )?);
                    continue;
                }
                if j > 0 {
                    let mut copy = v.clone();
                    expert::shard_variable(&mut copy, j, per)?;
                    copy.name = name.clone();
                    copy.device = at.device(mesh.rank(0, j, at.stage_of(var)?))?;
                    copy.colocate_with.clear();
                    g0.training.def.nodes.push(copy);
                    taken.insert(name.clone());
                }
                pieces.push(name);
            }
            let joined = fresh(taken, &format!("eval/{var}/experts_joined"));
            let mut c = node(&joined, "Concat", pieces, &device);
            c.attrs.insert("axis".into(), AttrValue::Int(0));
            g0.training.def.nodes.push(c);
            out.push((var.clone(), joined));
        }
    }
    Ok(out)
}

/// Under ZeRO-3 with `D > E`: expert shard `j` (`name`, `per` experts' rows) of the expert
/// variable `v` joined from the flat shards `{name}/shard_{k}_of_{D/E}` that its
/// holders of tp coordinate 0 keep (flat shard `k` on replica `j + E·k`'s rank of the
/// variable's stage, `at`; replica 0's own is in `g0`) on `device`. Returns the joined value.
fn joined_expert_shard(
    g0: &mut ReplicaGraph,
    taken: &mut HashSet<String>,
    (v, name): (&NodeDef, &str),
    (j, per): (usize, i64),
    (mesh, at): (&Mesh, &EvalAt<'_>),
    device: &str,
) -> Result<String, StrategyError> {
    let holders = mesh.dp / mesh.ep;
    let mut rows = match v.attrs.get("shape") {
        Some(AttrValue::Shape(s)) => s.as_static(),
        _ => None,
    }
    .ok_or_else(|| options(format!("expert variable `{}` has no static shape", v.name)))?;
    if let Some(r) = rows.first_mut() {
        *r = per as usize;
    }
    let mut shard = v.clone();
    expert::shard_variable(&mut shard, j, per)?;
    expert::zero::as_row_split(&mut shard, mesh.ep, j);
    let mut pieces = Vec::with_capacity(holders);
    for k in 0..holders {
        let piece = params::shard_name(name, k, holders);
        let replica = j + mesh.ep * k;
        let rank = mesh.rank(0, replica, at.stage_of(&v.name)?);
        // Replica 0's shard is in `g0` already (on its stage's worker).
        if replica != 0 {
            let mut copy = shard.clone();
            params::flat_shard(&mut copy, name, &rows, k, holders);
            copy.name = piece.clone();
            copy.device = at.device(rank)?;
            copy.colocate_with.clear();
            g0.training.def.nodes.push(copy);
            taken.insert(piece.clone());
        }
        pieces.push(piece);
    }
    let joined = fresh(taken, &format!("eval/{name}/flat"));
    g0.training
        .def
        .nodes
        .push(node(&joined, "PackFlat", pieces, device));
    let value = fresh(taken, &format!("eval/{name}/whole"));
    let mut s = node(&value, "FlatSlice", vec![joined], device);
    s.attrs.insert("offset".into(), AttrValue::Int(0));
    s.attrs.insert(
        "shape".into(),
        AttrValue::Shape(dflow_graph::Shape::known(&rows)),
    );
    g0.training.def.nodes.push(s);
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::test_support::tiny_moe_gpt;
    use dflow_graph::Shape;
    use std::collections::BTreeMap;

    /// A two-block GPT with 4-expert MoE MLPs (top-2, load-balancing loss), clipped at 1.0,
    /// fed `batch` rows per replica.
    fn moe_gpt(batch: usize) -> (Graph, TrainSpec) {
        let (graph, spec) = tiny_moe_gpt(|c| c.grad_clip = Some(1.0));
        let mut def = graph.to_def();
        for n in &mut def.nodes {
            if n.op == "Placeholder" {
                n.attrs
                    .insert("shape".into(), AttrValue::Shape(Shape::known(&[batch, 4])));
            }
        }
        (Graph::from_def(&def).unwrap(), spec)
    }

    /// One collective as its group's members must agree on it.
    type Call = (i64, String, String);

    /// Every rank's collectives in its graph's (chained) order, by group key.
    fn calls(g: &ReplicaGraph) -> BTreeMap<String, Vec<Call>> {
        let typed = &g.graph;
        let mut out: BTreeMap<String, Vec<Call>> = BTreeMap::new();
        for i in typed.topo_order() {
            let n = typed.node(i);
            if !n.op.starts_with("Collective") {
                continue;
            }
            let (Some(AttrValue::String(group)), Some(AttrValue::Int(key))) =
                (n.attrs.get("group_key"), n.attrs.get("instance_key"))
            else {
                panic!("collective `{}` without group or instance key", n.name);
            };
            let shape = typed
                .output_type(i, 0)
                .map(|t| format!("{} {}", t.dtype, t.shape))
                .unwrap_or_default();
            out.entry(group.to_string())
                .or_default()
                .push((*key, n.op.to_string(), shape));
        }
        out
    }

    /// dp=2,tp=2,ep=2 and dp=4,tp=2,ep=2: every rank's collectives fall in the groups of the
    /// plan (docs/experts.md's table), each group's members run the same sequence of
    /// (instance key, op, dtype and shape) in the same order, keys unique inside a group; the
    /// expert shards sit outside the dense buckets (their gradients are never packed).
    #[test]
    fn every_group_member_runs_the_same_collectives_in_the_same_order() {
        let (graph, spec) = moe_gpt(2);
        for (text, want_keys) in [
            (
                "dp=2,tp=2,ep=2",
                vec![
                    "data_t0",
                    "data_t1",
                    "experts_ep0_t0",
                    "experts_ep0_t1",
                    "tensor_d0",
                    "tensor_d1",
                ],
            ),
            (
                "dp=4,tp=2,ep=2",
                vec![
                    "data_t0",
                    "data_t1",
                    "experts_dp0_t0",
                    "experts_dp0_t1",
                    "experts_dp1_t0",
                    "experts_dp1_t1",
                    "experts_ep0_t0",
                    "experts_ep0_t1",
                    "experts_ep1_t0",
                    "experts_ep1_t1",
                    "tensor_d0",
                    "tensor_d1",
                    "tensor_d2",
                    "tensor_d3",
                ],
            ),
        ] {
            let mesh: Mesh = text.parse().unwrap();
            let tg = mesh_expert_training(&graph, &spec, &mesh, 1 << 20, None, "idx", "targets")
                .unwrap();
            assert_eq!(tg.graphs.len(), mesh.size());
            let tasks: Vec<String> = (0..mesh.size()).map(|r| r.to_string()).collect();
            let plan_groups = groups(&mesh, &tasks);
            let mut keys: Vec<&str> = plan_groups.iter().map(|g| g.key.as_str()).collect();
            keys.sort();
            assert_eq!(keys, want_keys, "{text}");
            let per_rank: Vec<BTreeMap<String, Vec<Call>>> = tg.graphs.iter().map(calls).collect();
            for g in &plan_groups {
                let members: Vec<usize> = g.members.iter().map(|m| m.parse().unwrap()).collect();
                let first = &per_rank[members[0]][&g.key];
                assert!(!first.is_empty(), "{text}: no collective in `{}`", g.key);
                let unique: HashSet<i64> = first.iter().map(|c| c.0).collect();
                assert_eq!(unique.len(), first.len(), "{text} `{}`: keys reused", g.key);
                for &m in &members[1..] {
                    assert_eq!(
                        &per_rank[m][&g.key], first,
                        "{text}: rank {m} vs rank {} in `{}`",
                        members[0], g.key
                    );
                }
            }
            for (r, calls) in per_rank.iter().enumerate() {
                for key in calls.keys() {
                    let g = plan_groups.iter().find(|g| &g.key == key);
                    assert!(
                        g.is_some_and(|g| g.members.contains(&r.to_string())),
                        "{text}: rank {r} runs a collective in `{key}` and is no member"
                    );
                }
                // Two all-to-alls forward and two backward per MoE layer, over its ep group.
                let a2a = calls[&ep_group(&mesh, r)]
                    .iter()
                    .filter(|c| c.1 == "CollectiveAllToAll")
                    .count();
                assert_eq!(a2a, 8, "{text}: rank {r}");
            }
            // Rank 0 holds expert shard 0; its expert gradients are in no bucket.
            let g0 = &tg.graphs[0].training.def;
            let shard = "transformer.h.0.mlp.experts.c_fc.weight/shard_0";
            assert!(g0.nodes.iter().any(|n| n.name == shard), "{text}");
            let grad = tg.graphs[0]
                .training
                .gradients
                .iter()
                .find(|(v, _)| v == shard)
                .map(|(_, g)| g.clone())
                .unwrap();
            for n in g0.nodes.iter().filter(|n| n.op == "PackFlat") {
                assert!(!n.inputs.iter().any(|i| i.starts_with(&grad)), "{text}");
            }
        }
    }

    /// Every group's members run the same collectives in the same order, no rank runs one in a
    /// group it is not a member of; returns each rank's calls.
    fn same_order_per_group(
        text: &str,
        mesh: &Mesh,
        tg: &TensorGraphs,
    ) -> Vec<BTreeMap<String, Vec<Call>>> {
        let tasks: Vec<String> = (0..mesh.size()).map(|r| r.to_string()).collect();
        let plan_groups = groups(mesh, &tasks);
        let per_rank: Vec<BTreeMap<String, Vec<Call>>> = tg.graphs.iter().map(calls).collect();
        for g in &plan_groups {
            let members: Vec<usize> = g.members.iter().map(|m| m.parse().unwrap()).collect();
            let first = &per_rank[members[0]][&g.key];
            let unique: HashSet<i64> = first.iter().map(|c| c.0).collect();
            assert_eq!(unique.len(), first.len(), "{text} `{}`: keys reused", g.key);
            for &m in &members[1..] {
                assert_eq!(
                    &per_rank[m][&g.key], first,
                    "{text}: rank {m} in `{}`",
                    g.key
                );
            }
        }
        for (r, calls) in per_rank.iter().enumerate() {
            for key in calls.keys() {
                let g = plan_groups.iter().find(|g| &g.key == key);
                assert!(
                    g.is_some_and(|g| g.members.contains(&r.to_string())),
                    "{text}: rank {r} runs a collective in `{key}` and is no member"
                );
            }
        }
        per_rank
    }

    /// ZeRO-1 and ZeRO-2 beside ep × tp: rank `t + T·d` keeps shard `d` of `D` of its tp
    /// shards' and replicated parameters' Adam slots (over `data_t<t>`) and, when `D > E`,
    /// shard `d / E` of `D / E` of its expert shard's (over `experts_dp<s>_t<t>`), whole when
    /// `D = E`; stage 2 reduce-scatters over both; one `GlobalNormScale` whose `Σ‖g‖²` sums
    /// the dense part over `data_t<t>` then `tensor_d<d>` and the experts' over
    /// `experts_ep<g>_t<t>`; every group's members run the same collectives in one order.
    #[test]
    fn zero_beside_ep_and_tp_shards_dense_slots_over_data_t_and_expert_slots_over_their_holders() {
        let (graph, spec) = moe_gpt(2);
        let expert = "transformer.h.0.mlp.experts.c_fc.weight";
        for text in ["dp=2,tp=2,ep=2", "dp=4,tp=2,ep=2"] {
            let mesh: Mesh = text.parse().unwrap();
            for stage in [1u8, 2] {
                let tg = mesh_expert_training(
                    &graph,
                    &spec,
                    &mesh,
                    1 << 20,
                    Some(stage),
                    "idx",
                    "targets",
                )
                .unwrap();
                let what = format!("{text} ZeRO-{stage}");
                let per_rank = same_order_per_group(&what, &mesh, &tg);
                let (dp, ep) = (mesh.dp, mesh.ep);
                for (r, g) in tg.graphs.iter().enumerate() {
                    let (t, d, _) = mesh.coords(r);
                    let nodes = &g.training.def.nodes;
                    let vars: HashSet<&str> = nodes
                        .iter()
                        .filter(|n| n.op == "Variable")
                        .map(|n| n.name.as_str())
                        .collect();
                    let dense = format!(
                        "{}/adam_m",
                        super::super::shard_name("transformer.wte.weight", t, 2)
                    );
                    assert!(
                        vars.contains(format!("{dense}/shard_{d}_of_{dp}").as_str()),
                        "{what} rank {r}: {vars:?}"
                    );
                    assert!(!vars.contains(dense.as_str()), "{what} rank {r}");
                    let replicated = "transformer.ln_f.weight/adam_v";
                    assert!(vars.contains(format!("{replicated}/shard_{d}_of_{dp}").as_str()));
                    let mine = format!("{expert}/shard_{}/adam_m", d % ep);
                    if dp > ep {
                        let piece = format!("{mine}/shard_{}_of_{}", d / ep, dp / ep);
                        assert!(vars.contains(piece.as_str()), "{what} rank {r}: {vars:?}");
                        assert!(!vars.contains(mine.as_str()), "{what} rank {r}");
                    } else {
                        assert!(vars.contains(mine.as_str()), "{what} rank {r}: {vars:?}");
                    }
                    let ops = &per_rank[r];
                    let has = |key: &str, op: &str| {
                        ops.get(key).is_some_and(|c| c.iter().any(|c| c.1 == op))
                    };
                    let scatter = if stage >= 2 {
                        "CollectiveReduceScatter"
                    } else {
                        "CollectiveAllReduce"
                    };
                    assert!(has(&dp_group(t), scatter), "{what} rank {r}: {ops:?}");
                    assert!(has(&dp_group(t), "CollectiveAllGather"), "{what} rank {r}");
                    if let Some(holders) = expert_data_group(&mesh, r) {
                        assert!(has(&holders, scatter), "{what} rank {r}: {ops:?}");
                        assert!(has(&holders, "CollectiveAllGather"), "{what} rank {r}");
                    }
                    // No bucket all-reduce of the plain dp step.
                    assert!(!nodes.iter().any(|n| n.name.starts_with("dp/bucket_")));
                    // One scale: the dense Σ‖g‖² over data_t<t> (the tp shards' then over
                    // tensor_d<d>), the experts' over experts_ep<g>_t<t>.
                    let scales: Vec<&NodeDef> =
                        nodes.iter().filter(|n| n.op == "GlobalNormScale").collect();
                    assert_eq!(scales.len(), 1, "{what} rank {r}");
                    let key = |name: &str| {
                        let n = nodes
                            .iter()
                            .find(|n| n.name == name)
                            .unwrap_or_else(|| panic!("{what} rank {r}: no `{name}`"));
                        match n.attrs.get("group_key") {
                            Some(AttrValue::String(k)) => k.to_string(),
                            other => panic!("`{name}`: {other:?}"),
                        }
                    };
                    assert_eq!(key("zero/clip/sharded_squared_norm"), dp_group(t));
                    assert_eq!(
                        key("zero/clip/sharded_squared_norm_outer"),
                        tp_group(&mesh, d)
                    );
                    assert_eq!(key("zero/clip/replicated_squared_norm"), dp_group(t));
                    assert_eq!(
                        key("experts/zero/clip/expert_squared_norm"),
                        ep_group(&mesh, r)
                    );
                }
            }
        }
        // Stage 4 is refused, naming the stages that run.
        let mesh: Mesh = "dp=2,tp=2,ep=2".parse().unwrap();
        let e = mesh_expert_training(&graph, &spec, &mesh, 1 << 20, Some(4), "idx", "targets")
            .expect_err("ZeRO-4 refused")
            .to_string();
        assert!(e.contains("runs at stages 1 to 3"), "{e}");
    }

    /// ZeRO-3 beside ep × tp: no rank keeps a whole weight — each dense weight (tp shard or
    /// replicated) is its flat shard `d` of `D` over `data_t<t>`, each expert shard its flat
    /// shard `d / E` of `D / E` over `experts_dp<s>_t<t>` (whole on its holders when `D = E`)
    /// — and every use reads a gather over that group; each group's members run the gathers
    /// (and every other collective) with the same keys in the same order; worker 0's
    /// evaluation copy joins the flat shards and reads no training gather.
    #[test]
    fn zero3_beside_ep_and_tp_leaves_no_whole_weight_and_gathers_in_one_order_per_group() {
        let (graph, spec) = moe_gpt(2);
        let expert = "transformer.h.0.mlp.experts.c_fc.weight";
        for text in ["dp=2,tp=2,ep=2", "dp=4,tp=2,ep=2"] {
            let mesh: Mesh = text.parse().unwrap();
            let tg = mesh_expert_training(&graph, &spec, &mesh, 1 << 20, Some(3), "idx", "targets")
                .unwrap();
            let what = format!("{text} ZeRO-3");
            let per_rank = same_order_per_group(&what, &mesh, &tg);
            let (dp, ep) = (mesh.dp, mesh.ep);
            for (r, g) in tg.graphs.iter().enumerate() {
                let (t, d, _) = mesh.coords(r);
                let nodes = &g.training.def.nodes;
                let vars: HashSet<&str> = nodes
                    .iter()
                    .filter(|n| n.op == "Variable" && !n.name.contains("/adam_"))
                    .map(|n| n.name.as_str())
                    .collect();
                let tp_shard = super::super::shard_name("transformer.wte.weight", t, 2);
                let mine = format!("{expert}/shard_{}", d % ep);
                for whole in ["transformer.ln_f.weight", tp_shard.as_str()] {
                    let flat = format!("{whole}/shard_{d}_of_{dp}");
                    assert!(vars.contains(flat.as_str()), "{what} rank {r}: {vars:?}");
                    assert!(!vars.contains(whole), "{what} rank {r}: whole `{whole}`");
                }
                if dp > ep {
                    let flat = format!("{mine}/shard_{}_of_{}", d / ep, dp / ep);
                    assert!(vars.contains(flat.as_str()), "{what} rank {r}: {vars:?}");
                    assert!(!vars.contains(mine.as_str()), "{what} rank {r}");
                } else {
                    assert!(vars.contains(mine.as_str()), "{what} rank {r}: {vars:?}");
                }
                // No rank keeps any weight whole (worker 0's evaluation copy's pieces are
                // other ranks' flat shards): neither the one-process variable nor its tp shard.
                for w in graph.to_def().nodes.iter().filter(|n| n.op == "Variable") {
                    let tp_name = super::super::shard_name(&w.name, t, 2);
                    for name in [w.name.as_str(), tp_name.as_str()] {
                        assert!(!vars.contains(name), "{what} rank {r}: whole `{name}`");
                    }
                    if dp > ep {
                        let own = expert::shard_name(&w.name, d % ep);
                        assert!(!vars.contains(own.as_str()), "{what} rank {r}: `{own}`");
                    }
                }
                let gathers = |key: &str| {
                    per_rank[r].get(key).map_or(0, |c| {
                        c.iter().filter(|c| c.1 == "CollectiveAllGather").count()
                    })
                };
                // A forward and a backward gather of (nearly) every weight, beside ZeRO's
                // gathers of the updated shards.
                assert!(gathers(&dp_group(t)) > 20, "{what} rank {r}");
                let ln_f = "zero/transformer.ln_f.weight/forward";
                assert!(
                    nodes.iter().any(|n| n.inputs.iter().any(|i| i == ln_f)),
                    "{what} rank {r}: ln_f read from no gather"
                );
                if let Some(holders) = expert_data_group(&mesh, r) {
                    let gathered = nodes.iter().any(|n| {
                        n.op == "CollectiveAllGather"
                            && n.name
                                .starts_with(&format!("zero/{mine}/all_gather_forward"))
                    });
                    assert!(
                        gathered,
                        "{what} rank {r}: `{mine}` not gathered over {holders}"
                    );
                }
            }
            // Worker 0's evaluation copy reads the joined flat shards, no training gather.
            let g0 = &tg.graphs[0].training.def;
            for n in g0.nodes.iter().filter(|n| n.name.starts_with("eval/")) {
                assert!(
                    !n.inputs.iter().any(|i| i.starts_with("zero/")),
                    "{what}: `{}` reads a training gather",
                    n.name
                );
            }
        }
    }
}
