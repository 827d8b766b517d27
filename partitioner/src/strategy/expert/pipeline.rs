//! Expert parallelism inside pipeline stages (`--mesh dp=D,ep=E,pp=P`): the MoE model cut into
//! `P` stages, and on every stage its `D` replicas split into expert-parallel groups of `E`
//! consecutive replicas that share each MoE layer's experts, as `--mesh dp=D,ep=E` does for a
//! whole model ([`super`]). Megatron-core's rank order: stage `s` of replica `d` is worker
//! `s·D + d`.
//!
//! The two rewrites compose: replica `d`'s expert forward graph ([`super::worker_forward`]:
//! shard `d mod E` of every expert variable, the all-to-alls around the experts, the router
//! all-gathers) is cut into stages and copied per micro-batch by the pipeline rewrite
//! ([`crate::strategy::pipeline::rewrite`]) exactly as a tensor-parallel rank's graph is inside
//! pipeline stages:
//!
//! - every micro-batch copy of an all-to-all goes to the expert-parallel group of its stage
//!   ([`ep_stage_group`]) and every router all-gather to the stage's data-parallel group
//!   ([`stage_group`]), each under an instance key of its own (the forward key plus a stride
//!   per micro-batch); autodiff keys their gradients after them;
//! - every MoE layer (its dispatch, experts, expert weights and combine) lies on one stage,
//!   checked: no expert weight shard is read from another stage;
//! - gradients: each expert shard's is summed over the replicas of its stage that hold the
//!   same shard ([`expert_data_stage_group`]; none when `E = D`), every other variable's over
//!   the stage's `D` replicas (the pipeline's one all-reduce per stage), and the loss over the
//!   last stage's replicas, each replica's loss weighted by `1/(m·D)`;
//! - clipping by the whole model's norm: per stage, the expert shards' `Σ‖g‖²` all-reduced
//!   over the stage's expert-parallel group (each shard once) plus the dense ones', the stages'
//!   sums meeting on the loss's stage;
//! - every device's collectives are chained in one topological order, the same on the ranks
//!   of each group (their graphs differ only in names and devices);
//! - evaluation runs on replica 0's stages ([`super::eval`]): the one-process forward graph
//!   cut as replica 0's is, each MoE layer's experts joined on its stage's worker of replica 0
//!   from the shards of the stage's first expert-parallel group (weights move within a stage,
//!   never between stages); on worker 0 ([`EvalCopy`]) only if a crossing tensor has no static
//!   size.
//!
//! - the step's dropped token assignments (every micro-batch's, every stage's) are summed on
//!   the loss's stage and over its replicas, and reported as under `--strategy expert`.
//!
//! Micro-batches: an MoE layer couples the tokens of a batch (capacity, load-balancing loss),
//! so more than one micro-batch runs only where that coupling is void (capacity factor ≥ E, α
//! = 0; see [`crate::strategy::pipeline`]).
//!
//! - **ZeRO** (`--zero-stage 1|2|3`, [`ReplicaZero`]): the pipeline's per-stage ZeRO
//!   (`pipeline::zero::shard_stages`) in place of the sums and the clipping above, told by
//!   `rewrite::ExpertStages` which parameters are expert shards: each stage's dense Adam
//!   slots sharded over the stage's `D` replicas, each expert shard's over the stage's
//!   replicas holding it (`super::zero::expert_shard_step`; none when `E = D`, their slots
//!   stay whole), one global clipping norm from every stage's dense and expert `Σ‖g‖²`.
//!   At stage 3 the weights too: each stage's dense weights flat-sharded over the stage's
//!   replicas, each expert shard's over its holders (drawn from its rows of the one-process
//!   variable, `super::zero::as_row_split`), gathered over those groups before each
//!   micro-batch's forward and backward use; the evaluation joins each stage's flat shards on
//!   that stage's worker of replica 0.

use super::eval::{add_staged_eval, StagedEval};
use super::{
    add_eval_copy, moe_layers, options, worker_forward, EvalCopy, ExpertLayout, ForwardGroups,
    MoeLayer,
};
use crate::job::{task_name, CollectiveGroup};
use crate::mesh::Mesh;
use crate::strategy::allreduce::{check_job, fresh};
use crate::strategy::pipeline::gradients::{
    all_reduce_gradients, chain_collectives_per_device, clip_by_stage_norms, stage_group,
};
use crate::strategy::pipeline::rewrite::{
    rewrite, ExpertStages, RewriteInput, TensorStages, STAGE_MARK,
};
use crate::strategy::pipeline::schedule::PipelineShape;
use crate::strategy::pipeline::zero::ReplicaZero;
use crate::strategy::pipeline::{worker_device, Pipeline, PipelineError};
use crate::strategy::{ReplicaGraph, StrategyError};
use dflow_graph::train::{TrainSpec, TrainingGraph};
use dflow_graph::{AttrValue, DType, Graph, GraphDef, InputRef, NodeDef, Tensor};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The expert-parallel collective group `g` of pipeline stage `s` (the all-to-alls, the
/// experts' clipping norm).
pub fn ep_stage_group(s: usize, g: usize) -> String {
    format!("experts_ep{g}_s{s}")
}

/// The expert-data-parallel collective group of pipeline stage `s`'s replicas that hold expert
/// shard `k` (the sum of the shard's gradient).
pub fn expert_data_stage_group(s: usize, k: usize) -> String {
    format!("experts_dp{k}_s{s}")
}

/// The graphs of a `dp × ep × pp` job.
#[derive(Clone, Debug)]
pub struct ExpertPipelineGraphs {
    /// One training graph per replica `d`, running the `P` stages of replica `d`.
    pub graphs: Vec<ReplicaGraph>,
    /// The MoE layers of the one-process graph.
    pub layers: Vec<MoeLayer>,
    /// Stages, micro-batches, chunks.
    pub shape: PipelineShape,
    /// Each stage's data-parallel group, its expert-parallel groups, and its
    /// expert-data-parallel groups (when `E < D`).
    pub groups: Vec<CollectiveGroup>,
}

/// The training graphs of the MoE model `graph` on `mesh` (`tp = 1`, `pp > 1`, `ep > 1`), cut
/// and scheduled as `pipeline` says, with ZeRO (stages 1 to 3) over each stage's groups when
/// `zero` says (see the module docs).
pub fn expert_pipeline_training(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    pipeline: &Pipeline,
    zero: Option<ReplicaZero>,
    features: &str,
    labels: &str,
) -> Result<ExpertPipelineGraphs, StrategyError> {
    let (dp, ep, pp) = (mesh.dp, mesh.ep, mesh.pp);
    if mesh.tp != 1 {
        return Err(options(format!(
            "mesh {mesh}: expert parallelism beside tensor parallelism does not run yet; drop the tp axis"
        )));
    }
    if let Some(z) = zero {
        if !(1..=3).contains(&z.stage) {
            return Err(options(format!(
                "mesh {mesh}: --zero-stage must be 1, 2 or 3, got {}",
                z.stage
            )));
        }
        crate::strategy::zero::check_optimizer(spec, "expert")?;
    }
    if pipeline.stages != Some(pp) {
        return Err(options(format!(
            "mesh {mesh}: the pipeline must cut {pp} balanced stages"
        )));
    }
    let loss_dtype = check_job(graph, spec, mesh.size(), features, labels)?;
    let forward = graph.to_def();
    let layers = moe_layers(graph, &forward)?;
    super::check_layers(&layers, ep)?;
    let layout = ExpertLayout::new(dp, ep)?;
    let mut graphs = Vec::with_capacity(dp);
    // The stage of every op of replica 0, under the one-process names.
    let mut first_cut: HashMap<String, usize> = HashMap::new();
    // The pipeline device of each expert variable (by its one-process name).
    let mut expert_stage: HashMap<String, usize> = HashMap::new();
    let mut shape_of = None;
    let dp_groups: Vec<String> = (0..pp).map(stage_group).collect();
    for d in 0..dp {
        let groups = ForwardGroups {
            experts: layout.ep_group(d),
            all: format!("pipeline/stage{STAGE_MARK}"),
        };
        let (def, local) = worker_forward(&forward, &layers, d, layout, &groups)?;
        let stride = max_instance(&def) + 1;
        let typed = Graph::from_def(&def).map_err(StrategyError::InvalidGraph)?;
        let prepared = pipeline.prepare(&typed, features, labels)?;
        let shape = prepared.shape;
        let batch = prepared.batch;
        let m = shape.micro_batches;
        if batch % (dp * m) != 0 {
            return Err(PipelineError::ReplicaBatch {
                batch,
                replicas: dp,
                micro_batches: m,
            }
            .into());
        }
        // The one-process name of every shard.
        let original: HashMap<String, String> = layers
            .iter()
            .flat_map(|l| l.variables.iter())
            .map(|v| (super::shard_name(v, layout.shard(d)), v.clone()))
            .collect();
        let device_of = |name: &str| {
            typed
                .find(name)
                .map(|i| shape.device_of(prepared.stages.stage[i.index()]))
        };
        for i in typed.node_indices() {
            let name = &typed.node(i).name;
            let name = original.get(name).unwrap_or(name);
            let stage = prepared.stages.stage[i.index()];
            match first_cut.get(name) {
                Some(&s) if s != stage => {
                    return Err(PipelineError::Internal(format!(
                        "replica {d} puts `{name}` on stage {stage}, replica 0 on stage {s}"
                    ))
                    .into())
                }
                Some(_) => {}
                None if d == 0 => {
                    first_cut.insert(name.clone(), stage);
                }
                None => {}
            }
        }
        for l in &layers {
            let mut on: BTreeMap<usize, String> = BTreeMap::new();
            let shards = l
                .variables
                .iter()
                .map(|v| super::shard_name(v, layout.shard(d)));
            let names = [l.dispatch.clone(), l.combine.clone()]
                .into_iter()
                .chain(l.expert_nodes.iter().cloned())
                .chain(shards);
            for n in names {
                if let Some(s) = device_of(&n) {
                    on.entry(s).or_insert(n);
                }
            }
            if on.len() > 1 {
                let list: Vec<String> = on
                    .iter()
                    .map(|(s, n)| format!("`{n}` on stage {s}"))
                    .collect();
                return Err(options(format!(
                    "MoE layer `{}` is cut between pipeline stages ({}): every expert weight must stay on one stage; use another pp",
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
        let devices: Vec<String> = (0..pp).map(|s| worker_device(mesh.rank(0, d, s))).collect();
        let tensor = TensorStages {
            groups: (0..pp).map(|s| ep_stage_group(s, d / ep)).collect(),
            instance_stride: stride,
            shards: local.clone(),
            experts: Some(ExpertStages {
                data_groups: (ep < dp).then(|| {
                    (0..pp)
                        .map(|s| expert_data_stage_group(s, layout.shard(d)))
                        .collect()
                }),
                rank: d / ep,
                ranks: dp / ep,
                ep,
                beside_tp: None,
            }),
        };
        let unclipped = TrainSpec {
            clip_global_norm: None,
            ..spec.clone()
        };
        let mut g = rewrite(&RewriteInput {
            graph: &typed,
            stages: &prepared.stages,
            shape,
            orders: &prepared.orders,
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
        set_scalar(
            &mut g.training.def,
            "pipeline/loss_share",
            1.0 / (m * dp) as f64,
            loss_dtype,
        )?;
        // With ZeRO, its steps summed, clipped and updated every stage's parameters.
        if zero.is_none() {
            if ep < dp {
                let shard = layout.shard(d);
                reduce_shard_gradients(&mut g.training, &local, &devices, |s| {
                    expert_data_stage_group(s, shard)
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
                &devices,
                &dp_groups,
                &g.training.loss,
            )?;
            let summed: HashMap<String, String> = dense.into_iter().collect();
            for (v, grad) in &mut g.training.gradients {
                if let Some(s) = summed.get(v) {
                    *grad = s.clone();
                }
            }
            if let Some(clip) = spec.clip_global_norm {
                let loss_device = node_device(&g.training.def, &g.training.loss)?;
                clip_by_stage_norms(
                    &mut g.training,
                    Some(&tensor),
                    &devices,
                    &loss_device,
                    clip,
                    stride * m as i64,
                )?;
            }
        }
        add_dropped_count(&mut g, &devices, &stage_group)?;
        chain_collectives_per_device(&mut g.training.def)?;
        g.graph = Graph::from_def(&g.training.def).map_err(StrategyError::InvalidGraph)?;
        g.eval.features = features.to_string();
        g.eval.labels = labels.to_string();
        shape_of = Some((shape, batch));
        graphs.push(g);
    }
    let Some((shape, batch)) = shape_of else {
        return Err(options(format!("mesh {mesh}: no data-parallel replica")));
    };
    // Evaluation on replica 0's stages (`super::eval`), else on worker 0: shard j of a stage-s
    // expert lives on replica j's stage s, and so does replica j's flat ZeRO-3 shard of a
    // stage-s parameter.
    let shard_device = |var: &str, j: usize| -> Result<String, StrategyError> {
        let s = match expert_stage.get(var) {
            Some(&s) => s,
            None => first_cut
                .get(var)
                .map(|&v| shape.device_of(v))
                .ok_or_else(|| PipelineError::Internal(format!("no stage for `{var}`")))?,
        };
        Ok(worker_device(mesh.rank(0, j, s)))
    };
    let copy = || -> Result<EvalCopy<'_>, StrategyError> {
        Ok(EvalCopy {
            layout: ExpertLayout::new(dp, ep)?,
            stage3: zero.is_some_and(|z| z.stage >= 3),
            shard_device: &shard_device,
            own_placeholders: true,
        })
    };
    if let Some(g) = graphs.first_mut() {
        let staged = StagedEval {
            graph,
            forward: &forward,
            layers: &layers,
            cut: &first_cut,
            shape,
            devices: (0..pp).map(|s| worker_device(mesh.rank(0, 0, s))).collect(),
            copy: copy()?,
            spec,
            features,
            labels,
            rows: batch,
        };
        if !add_staged_eval(g, &staged, 0)? {
            add_eval_copy(g, graph, &forward, &layers, spec, copy()?)?;
        }
    }
    let task = |d: usize, s: usize| task_name("worker", mesh.rank(0, d, s) as u32);
    let mut groups = Vec::new();
    for s in 0..pp {
        groups.push(CollectiveGroup {
            key: stage_group(s),
            members: (0..dp).map(|d| task(d, s)).collect(),
        });
        for g in 0..dp / ep {
            groups.push(CollectiveGroup {
                key: ep_stage_group(s, g),
                members: (0..ep).map(|i| task(g * ep + i, s)).collect(),
            });
        }
        if ep < dp {
            for k in 0..ep {
                groups.push(CollectiveGroup {
                    key: expert_data_stage_group(s, k),
                    members: (0..dp / ep).map(|j| task(k + j * ep, s)).collect(),
                });
            }
        }
    }
    Ok(ExpertPipelineGraphs {
        graphs,
        layers,
        shape,
        groups,
    })
}

/// Adds the step's dropped token assignments of the whole job to replica graph `g` (stages on
/// `devices`): the `dropped` outputs of every micro-batch copy of every `MoeRoute`, summed on
/// the loss's stage and all-reduced (sum, i64) over that stage's replicas (`group(stage)`)
/// after the loss; fetched as [`super::DROPPED_METRIC`] like `--strategy expert`'s.
pub(crate) fn add_dropped_count(
    g: &mut ReplicaGraph,
    devices: &[String],
    group: &dyn Fn(usize) -> String,
) -> Result<(), StrategyError> {
    let def = &mut g.training.def;
    let routes: Vec<String> = def
        .nodes
        .iter()
        .filter(|n| n.op == "MoeRoute")
        .map(|n| format!("{}:3", n.name))
        .collect();
    if routes.is_empty() {
        return Ok(());
    }
    let device = node_device(def, &g.training.loss)?;
    let stage = devices
        .iter()
        .position(|d| *d == device)
        .ok_or_else(|| PipelineError::Internal(format!("the stage of `{}`", g.training.loss)))?;
    let mut taken: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
    let node = |name: &str, op: &str, inputs: Vec<String>| NodeDef {
        name: name.to_string(),
        op: op.into(),
        inputs,
        device: device.clone(),
        colocate_with: vec![],
        attrs: BTreeMap::new(),
    };
    let local = fresh(&mut taken, "moe/dropped/local");
    def.nodes.push(node(&local, "AddN", routes));
    let global = fresh(&mut taken, "moe/dropped/global");
    let mut n = node(
        &global,
        "CollectiveAllReduce",
        vec![local, format!("^{}", g.training.loss)],
    );
    n.attrs = BTreeMap::from([
        (
            "group_key".to_string(),
            AttrValue::String(group(stage).into()),
        ),
        (
            "instance_key".to_string(),
            AttrValue::Int(super::DROPPED_INSTANCE),
        ),
        ("reduce".to_string(), AttrValue::String("sum".into())),
    ]);
    def.nodes.push(n);
    g.step_metrics
        .push((super::DROPPED_METRIC.to_string(), global));
    Ok(())
}

/// The largest instance key of `def`'s collectives.
pub(crate) fn max_instance(def: &GraphDef) -> i64 {
    def.nodes
        .iter()
        .filter(|n| n.op.starts_with("Collective"))
        .filter_map(|n| match n.attrs.get("instance_key") {
            Some(AttrValue::Int(k)) => Some(*k),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

/// The device of the node of tensor `tensor`.
pub(crate) fn node_device(def: &GraphDef, tensor: &str) -> Result<String, StrategyError> {
    let node = InputRef::parse(tensor)
        .map(|r| r.node().to_string())
        .map_err(PipelineError::Internal)?;
    def.nodes
        .iter()
        .find(|n| n.name == node)
        .map(|n| n.device.clone())
        .ok_or_else(|| PipelineError::Internal(format!("no node `{node}`")).into())
}

/// Sets the scalar constant `name` to `value`.
pub(crate) fn set_scalar(
    def: &mut GraphDef,
    name: &str,
    value: f64,
    dtype: DType,
) -> Result<(), StrategyError> {
    let c = def
        .nodes
        .iter_mut()
        .find(|n| n.name == name && n.op == "Const")
        .ok_or_else(|| PipelineError::Internal(format!("no constant `{name}`")))?;
    let tensor = match dtype {
        DType::F64 => Tensor::scalar(value),
        _ => Tensor::scalar(value as f32),
    };
    c.attrs.insert(
        "value".to_string(),
        AttrValue::Tensor(std::sync::Arc::new(tensor)),
    );
    Ok(())
}

/// Sums each expert shard's gradient (the shards are `local`) over `group(s)` of its stage `s`
/// (the replicas that hold the same shard) by all-reduce where it is computed, and points the
/// updates and `training.gradients` at the sums ([`super::sum_shard_gradients`]).
pub(crate) fn reduce_shard_gradients(
    training: &mut TrainingGraph,
    local: &HashSet<String>,
    devices: &[String],
    group: impl Fn(usize) -> String,
) -> Result<(), StrategyError> {
    super::sum_shard_gradients(training, local, |def, grad| {
        let device = node_device(def, grad)?;
        let s = devices
            .iter()
            .position(|d| *d == device)
            .ok_or_else(|| PipelineError::Internal(format!("the stage of `{grad}`")))?;
        Ok((device, group(s)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::pipeline::schedule::ScheduleKind;
    use crate::strategy::test_support::{moe_of, tiny_moe_gpt};

    /// A two-block GPT with 4-expert MoE MLPs (capacity factor 4: nothing dropped) and no
    /// load-balancing loss, so it may run several micro-batches.
    fn moe_gpt(clip: Option<f64>) -> (Graph, TrainSpec) {
        tiny_moe_gpt(|c| {
            c.grad_clip = clip;
            moe_of(c).aux_loss_coef = 0.0;
        })
    }

    fn pipeline(micro_batches: usize, schedule: ScheduleKind) -> Pipeline {
        Pipeline {
            stages: Some(2),
            micro_batches,
            schedule,
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

    fn task_of(device: &str) -> u32 {
        dflow_graph::DeviceName::parse(device)
            .ok()
            .and_then(|d| d.task)
            .unwrap_or(u32::MAX)
    }

    type Call = (String, String, String);

    /// Every collective of `staged` (a `dp × ep × pp` job) is in a group of its worker's stage
    /// under a key of its own and waits for the worker's one before; the ranks of every group
    /// call its collectives in one order (the same ops, keys and sizes). Returns them, per
    /// group and member task.
    fn one_order_per_group(
        staged: &ExpertPipelineGraphs,
        dp: usize,
        ep: usize,
    ) -> BTreeMap<String, BTreeMap<u32, Vec<Call>>> {
        let mut calls: BTreeMap<String, BTreeMap<u32, Vec<Call>>> = BTreeMap::new();
        for (d, g) in staged.graphs.iter().enumerate() {
            let nodes = &g.training.def.nodes;
            let by_name: HashMap<&str, &NodeDef> =
                nodes.iter().map(|n| (n.name.as_str(), n)).collect();
            let mut keys = HashSet::new();
            let mut last_on: HashMap<u32, String> = HashMap::new();
            for i in g.graph.topo_order() {
                let n = by_name[g.graph.node(i).name.as_str()];
                if !n.op.starts_with("Collective") {
                    continue;
                }
                let task = task_of(&n.device);
                let s = task as usize / dp;
                assert_eq!(task as usize % dp, d, "{} on worker {task}", n.name);
                let group = attr(n, "group_key");
                let mine = [
                    stage_group(s),
                    ep_stage_group(s, d / ep),
                    expert_data_stage_group(s, d % ep),
                ];
                assert!(mine.contains(&group), "{} in {group} on stage {s}", n.name);
                assert!(
                    keys.insert((group.clone(), attr(n, "instance_key"))),
                    "{} repeats a key of {group}",
                    n.name
                );
                // Every collective of a worker waits for the one before.
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
                    .push((n.op.clone(), attr(n, "instance_key"), attr(n, "group_size")));
            }
        }
        for (group, by_task) in &calls {
            let members = &staged
                .groups
                .iter()
                .find(|g| &g.key == group)
                .unwrap()
                .members;
            assert_eq!(by_task.len(), members.len(), "{group}");
            let first = by_task.values().next().unwrap();
            assert!(!first.is_empty());
            for (task, seq) in by_task {
                assert_eq!(seq, first, "{group}: worker {task}'s order");
            }
        }
        calls
    }

    /// `dp=4,ep=2,pp=2` (worker `s·4 + d` runs stage `s` of replica `d`), 2 micro-batches:
    /// the groups are Megatron-core's; every collective of a worker is in a group of its stage
    /// under a key of its own; the ranks of every group call its collectives in one order (the
    /// same ops, keys and sizes), each worker's chained; each expert shard's gradient is summed
    /// over its stage's holders, the clipping norm of the shards over the stage's
    /// expert-parallel group.
    #[test]
    fn dp4_ep2_pp2_collectives_keys_and_order_match_on_every_groups_ranks() {
        let (graph, spec) = moe_gpt(Some(0.5));
        let mesh = Mesh::new(4, 1, 2).unwrap().with_ep(2).unwrap();
        let staged = expert_pipeline_training(
            &graph,
            &spec,
            &mesh,
            &pipeline(2, ScheduleKind::OneFOneB),
            None,
            "idx",
            "targets",
        )
        .unwrap();
        let w = |i: u32| task_name("worker", i);
        let groups: Vec<(String, Vec<String>)> = staged
            .groups
            .iter()
            .map(|g| (g.key.clone(), g.members.clone()))
            .collect();
        let want = |key: &str, m: &[u32]| (key.to_string(), m.iter().map(|&i| w(i)).collect());
        assert_eq!(
            groups,
            [
                want("pipeline/stage0", &[0, 1, 2, 3]),
                want("experts_ep0_s0", &[0, 1]),
                want("experts_ep1_s0", &[2, 3]),
                want("experts_dp0_s0", &[0, 2]),
                want("experts_dp1_s0", &[1, 3]),
                want("pipeline/stage1", &[4, 5, 6, 7]),
                want("experts_ep0_s1", &[4, 5]),
                want("experts_ep1_s1", &[6, 7]),
                want("experts_dp0_s1", &[4, 6]),
                want("experts_dp1_s1", &[5, 7]),
            ]
        );
        assert_eq!(staged.graphs.len(), 4);
        let calls = one_order_per_group(&staged, 4, 2);
        assert_eq!(calls.len(), 10, "{:?}", calls.keys().collect::<Vec<_>>());
        // 2 layers × 2 micro-batches × (2 forward + 2 backward) all-to-alls per expert group.
        let a2a = calls["experts_ep0_s0"]
            .values()
            .next()
            .unwrap()
            .iter()
            .filter(|c| c.0 == "CollectiveAllToAll")
            .count();
        let a2a_1 = calls["experts_ep0_s1"][&4]
            .iter()
            .filter(|c| c.0 == "CollectiveAllToAll")
            .count();
        assert_eq!(a2a + a2a_1, 2 * 2 * 4);

        // Expert gradients: summed over the stage's holders, and clipped by the norm
        // gathered over the stage's expert-parallel group.
        let g = &staged.graphs[1];
        let nodes = &g.training.def.nodes;
        let find = |name: &str| nodes.iter().find(|n| n.name == name).unwrap();
        for var in staged.layers.iter().flat_map(|l| &l.variables) {
            let shard = crate::strategy::expert::shard_name(var, 1);
            let (_, grad) = g
                .training
                .gradients
                .iter()
                .find(|(v, _)| *v == shard)
                .unwrap();
            let clipped = find(grad);
            assert_eq!(clipped.op, "Mul", "{shard}");
            let sum = find(&clipped.inputs[0]);
            assert_eq!(sum.op, "CollectiveAllReduce", "{shard}");
            let s = (task_of(&sum.device) / 4) as usize;
            assert_eq!(attr(sum, "group_key"), expert_data_stage_group(s, 1));
        }
        let norms: Vec<&NodeDef> = nodes
            .iter()
            .filter(|n| n.name.ends_with("shards_squared_norm_sum"))
            .collect();
        assert_eq!(norms.len(), 2);
        for n in norms {
            let s = (task_of(&n.device) / 4) as usize;
            assert_eq!(attr(n, "group_key"), ep_stage_group(s, 0));
        }
    }

    /// ZeRO-2 beside `dp=4,ep=2,pp=2`: replica `d` holds shard `d` of 4 of each dense
    /// parameter's Adam slots and shard `d / 2` of 2 of its expert shard's (`k = d mod 2`),
    /// each on the parameter's stage; the gradients are reduce-scattered over the stage's
    /// replicas and over the stage's holders of the shard; one clipping scale per replica; the
    /// ranks of every group call its collectives in one order under keys of their own. ZeRO-4
    /// is refused.
    #[test]
    fn dp4_ep2_pp2_zero2_shards_dense_slots_over_the_stage_and_expert_slots_over_their_holders() {
        let (graph, spec) = moe_gpt(Some(0.5));
        let mesh = Mesh::new(4, 1, 2).unwrap().with_ep(2).unwrap();
        let zero = |stage| {
            Some(ReplicaZero {
                stage,
                bucket_bytes: 1 << 20,
            })
        };
        let p = pipeline(2, ScheduleKind::OneFOneB);
        let staged =
            expert_pipeline_training(&graph, &spec, &mesh, &p, zero(2), "idx", "targets").unwrap();
        one_order_per_group(&staged, 4, 2);
        let dense = "transformer.wte.weight";
        let expert = "transformer.h.1.mlp.experts.c_fc.weight";
        for (d, g) in staged.graphs.iter().enumerate() {
            let nodes = &g.training.def.nodes;
            let find = |name: &str| nodes.iter().find(|n| n.name == name);
            let (k, j) = (d % 2, d / 2);
            for (slot, stage) in [
                (format!("{dense}/adam_m/shard_{d}_of_4"), 0),
                (format!("{expert}/shard_{k}/adam_v/shard_{j}_of_2"), 1),
            ] {
                let v = find(&slot).unwrap_or_else(|| panic!("replica {d}: no `{slot}`"));
                assert_eq!(task_of(&v.device) as usize, stage * 4 + d, "{slot}");
            }
            assert!(find(&format!("{dense}/adam_m")).is_none());
            assert!(find(&format!("{expert}/shard_{k}/adam_v")).is_none());
            let scattered: HashSet<String> = nodes
                .iter()
                .filter(|n| n.op == "CollectiveReduceScatter")
                .map(|n| attr(n, "group_key"))
                .collect();
            for s in 0..2 {
                assert!(scattered.contains(&stage_group(s)), "{scattered:?}");
                assert!(
                    scattered.contains(&expert_data_stage_group(s, k)),
                    "{scattered:?}"
                );
            }
            let scales = nodes.iter().filter(|n| n.op == "GlobalNormScale").count();
            assert_eq!(scales, 1);
            assert!(!nodes.iter().any(|n| n.name.starts_with("experts/grad_")));
        }
        let e = expert_pipeline_training(&graph, &spec, &mesh, &p, zero(4), "idx", "targets")
            .unwrap_err()
            .to_string();
        assert!(e.contains("--zero-stage must be 1, 2 or 3, got 4"), "{e}");
    }

    /// ZeRO-3 beside `dp=4,ep=2,pp=2` (2 micro-batches): replica `d` holds the flat shard `d`
    /// of 4 of each dense weight and the flat shard `d / 2` of 2 of its expert shard
    /// `k = d mod 2` (rows `k` of 2 of the one-process variable), each only on the worker of
    /// its stage; no whole weight is left; every micro-batch's forward pass reads a gather of
    /// its own over the stage's replicas (dense) or the stage's holders of the shard (experts),
    /// on that worker, and its backward pass another; the ranks of every group call its
    /// collectives in one order. The evaluation joins each stage's shards on that stage's
    /// worker of replica 0, with no collective.
    #[test]
    fn dp4_ep2_pp2_zero3_shards_each_stages_weights_on_its_workers_and_gathers_them_per_micro_batch(
    ) {
        let (graph, spec) = moe_gpt(Some(0.5));
        let mesh = Mesh::new(4, 1, 2).unwrap().with_ep(2).unwrap();
        let zero = ReplicaZero {
            stage: 3,
            bucket_bytes: 1 << 20,
        };
        let p = pipeline(2, ScheduleKind::OneFOneB);
        let staged =
            expert_pipeline_training(&graph, &spec, &mesh, &p, Some(zero), "idx", "targets")
                .unwrap();
        one_order_per_group(&staged, 4, 2);
        let experts: HashSet<&str> = staged
            .layers
            .iter()
            .flat_map(|l| l.variables.iter().map(String::as_str))
            .collect();
        // Every shard variable's device, from the replica that trains it.
        let mut home: HashMap<String, String> = HashMap::new();
        for (d, g) in staged.graphs.iter().enumerate() {
            let nodes = &g.training.def.nodes;
            let find = |name: &str| nodes.iter().find(|n| n.name == name);
            let (k, j) = (d % 2, d / 2);
            for i in graph
                .node_indices()
                .filter(|&i| graph.node(i).op == "Variable")
            {
                let var = graph.node(i).name.as_str();
                let len: usize = graph
                    .output_type(i, 0)
                    .unwrap()
                    .shape
                    .as_static()
                    .unwrap()
                    .iter()
                    .product();
                let (owned, whole, group, elements) = if experts.contains(var) {
                    let row = crate::strategy::expert::shard_name(var, k);
                    assert!(find(&row).is_none(), "replica {d}: {row} still whole");
                    (
                        format!("{row}/shard_{j}_of_2"),
                        row,
                        "experts_dp",
                        len / 2 / 2,
                    )
                } else {
                    (
                        format!("{var}/shard_{d}_of_4"),
                        var.to_string(),
                        "pipeline/stage",
                        len.div_ceil(4),
                    )
                };
                assert!(find(&whole).is_none(), "replica {d}: {whole} still whole");
                let v = find(&owned).unwrap_or_else(|| panic!("replica {d}: no `{owned}`"));
                assert_eq!(
                    v.attrs.get("shape"),
                    Some(&AttrValue::Shape(dflow_graph::Shape::known(&[elements]))),
                    "{owned}"
                );
                let task = task_of(&v.device) as usize;
                assert_eq!(task % 4, d, "{owned} on worker {task}");
                let s = task / 4;
                let key = if experts.contains(var) {
                    assert_eq!(
                        v.attrs.get("shard_parts"),
                        Some(&AttrValue::Int(2)),
                        "{owned}"
                    );
                    assert_eq!(
                        v.attrs.get("shard_index"),
                        Some(&AttrValue::Int(k as i64)),
                        "{owned}"
                    );
                    expert_data_stage_group(s, k)
                } else {
                    stage_group(s)
                };
                assert!(key.starts_with(group));
                home.insert(owned.clone(), v.device.clone());
                // Every gather of it runs on the shard's worker, over the shard's group; each
                // micro-batch's forward pass reads one of its own (an expert bias, reshaped
                // once for the micro-batches, is gathered once for their forward passes).
                let gathers: Vec<&NodeDef> = nodes
                    .iter()
                    .filter(|n| n.op == "CollectiveAllGather" && n.inputs.first() == Some(&owned))
                    .collect();
                for g in &gathers {
                    assert_eq!(g.device, v.device, "{}", g.name);
                    assert_eq!(attr(g, "group_key"), key, "{}", g.name);
                }
                let shared = var.contains(".experts.") && var.ends_with(".bias");
                for m in 0..2 {
                    let pass = if shared {
                        "forward".to_string()
                    } else {
                        format!("_mb{m}_forward")
                    };
                    assert!(
                        gathers.iter().any(|n| n.name.ends_with(&pass)),
                        "{owned}: micro-batch {m}: {:?}",
                        gathers.iter().map(|n| &n.name).collect::<Vec<_>>()
                    );
                }
            }
            // An expert matrix and a dense one are read again by each backward pass.
            for w in [
                format!(
                    "{}/shard_{k}/shard_{j}_of_2",
                    "transformer.h.1.mlp.experts.c_proj.weight"
                ),
                format!("transformer.h.1.attn.c_proj.weight/shard_{d}_of_4"),
            ] {
                for m in 0..2 {
                    assert!(
                        nodes.iter().any(|n| n.op == "CollectiveAllGather"
                            && n.inputs.first() == Some(&w)
                            && n.name.ends_with(&format!("_mb{m}_backward"))),
                        "{w}: backward {m}"
                    );
                }
            }
            assert!(!nodes.iter().any(|n| n.op == "Assign"));
        }
        // The evaluation reads each shard where its replica keeps it, joined on the stage's
        // worker of replica 0 (workers 0 and 4) with no collective, and every stage's expert
        // shards from their holders on that stage.
        let nodes = &staged.graphs[0].training.def.nodes;
        let weight_shards = nodes.iter().filter(|n| {
            n.op == "Variable" && n.name.contains("_of_") && !n.name.contains("/adam_")
        });
        for n in weight_shards {
            assert_eq!(home.get(&n.name), Some(&n.device), "{}", n.name);
        }
        let eval: Vec<&NodeDef> = nodes
            .iter()
            .filter(|n| n.name.starts_with("eval/"))
            .collect();
        assert!(eval.iter().all(|n| !n.op.starts_with("Collective")));
        let joined = |name: &str| {
            let n = eval
                .iter()
                .find(|n| n.name == format!("eval/{name}/joined"))
                .unwrap();
            assert_eq!(n.op, "PackFlat");
            n.inputs.clone()
        };
        assert_eq!(joined("transformer.wte.weight").len(), 4);
        let join_task = |name: &str| {
            let n = eval
                .iter()
                .find(|n| n.name == format!("eval/{name}/joined"))
                .unwrap();
            task_of(&n.device)
        };
        assert_eq!(join_task("transformer.wte.weight"), 0);
        assert_eq!(
            join_task(&crate::strategy::expert::shard_name(
                "transformer.h.1.mlp.experts.c_fc.weight",
                1
            )),
            4
        );
        let row = crate::strategy::expert::shard_name("transformer.h.1.mlp.experts.c_fc.weight", 1);
        let pieces = joined(&row);
        assert_eq!(pieces.len(), 2);
        for (r, piece) in pieces.iter().enumerate() {
            let send = eval.iter().find(|n| &n.name == piece).unwrap();
            // Rows 1 of stage 1's expert: replicas 1 and 3, on stage 1 (workers 5 and 7).
            assert_eq!(task_of(&send.device) as usize, 4 + 1 + 2 * r, "{piece}");
        }
    }

    /// No expert weight shard crosses stages: each MoE layer's shards live on one stage (block
    /// 0's on stage 0, block 1's on stage 1) and every op of the training step that reads one
    /// runs there (the evaluation too: `super::super::eval`'s tests). With `E = D`,
    /// no gradient of a shard is summed over other replicas.
    #[test]
    fn dp2_ep2_pp2_expert_shards_stay_on_their_stage() {
        let (graph, spec) = moe_gpt(None);
        let mesh = Mesh::new(2, 1, 2).unwrap().with_ep(2).unwrap();
        let staged = expert_pipeline_training(
            &graph,
            &spec,
            &mesh,
            &pipeline(2, ScheduleKind::GPipe),
            None,
            "idx",
            "targets",
        )
        .unwrap();
        assert_eq!(staged.groups.len(), 4);
        for (d, g) in staged.graphs.iter().enumerate() {
            let nodes = &g.training.def.nodes;
            let device: HashMap<&str, &str> = nodes
                .iter()
                .map(|n| (n.name.as_str(), n.device.as_str()))
                .collect();
            for (b, layer) in staged.layers.iter().enumerate() {
                for var in &layer.variables {
                    let shard = crate::strategy::expert::shard_name(var, d);
                    let on = device[shard.as_str()];
                    // Block b on stage b: worker b·2 + d.
                    assert_eq!(task_of(on), (b * 2 + d) as u32, "{shard}");
                    for n in nodes.iter().filter(|n| !n.name.starts_with("eval/")) {
                        let reads = n
                            .inputs
                            .iter()
                            .any(|i| InputRef::parse(i).is_ok_and(|r| r.node() == shard.as_str()));
                        if reads {
                            assert_eq!(n.device, on, "{} reads {shard}", n.name);
                        }
                    }
                    let (_, grad) = g
                        .training
                        .gradients
                        .iter()
                        .find(|(v, _)| *v == shard)
                        .unwrap();
                    let op = &nodes.iter().find(|n| &n.name == grad).unwrap().op;
                    assert!(
                        !op.starts_with("Collective") && op != "FlatSlice",
                        "{shard}: {op}"
                    );
                }
            }
            assert_eq!(
                g.step_metrics
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>(),
                [crate::strategy::expert::DROPPED_METRIC]
            );
        }
    }

    /// More than one micro-batch of a MoE layer runs only where it treats every token alone:
    /// a capacity factor below E (tokens may be dropped) or a load-balancing loss (α > 0) is
    /// refused naming the op; capacity factor E and α = 0 run.
    #[test]
    fn micro_batches_need_a_capacity_of_every_token_and_no_load_balancing_loss() {
        let mesh = Mesh::new(2, 1, 2).unwrap().with_ep(2).unwrap();
        let p = pipeline(2, ScheduleKind::OneFOneB);
        for (factor, alpha, refused) in [
            (
                1.25,
                0.0,
                Some("(MoeRoute) couples the examples of a batch"),
            ),
            (
                4.0,
                0.01,
                Some("(MoeAuxLoss) couples the examples of a batch"),
            ),
            (4.0, 0.0, None),
        ] {
            let (graph, spec) = tiny_moe_gpt(|c| {
                let moe = moe_of(c);
                moe.top_k = 1;
                moe.capacity_factor = factor;
                moe.aux_loss_coef = alpha;
            });
            let got = expert_pipeline_training(&graph, &spec, &mesh, &p, None, "idx", "targets");
            match (refused, got) {
                (Some(want), Err(e)) => assert!(e.to_string().contains(want), "{e}"),
                (None, Ok(_)) => {}
                (want, got) => panic!("factor {factor}, α {alpha}: {want:?} vs {:?}", got.err()),
            }
        }
    }

    /// The interleaved schedule: a four-block MoE GPT in 4 virtual stages over 2 pipeline
    /// devices (2 chunks each), `dp=2,ep=2`, 2 micro-batches: each device's MoE layers talk in
    /// its own groups, under keys of their own, in one order on both replicas.
    #[test]
    fn interleaved_chunks_keep_each_devices_groups_and_one_order() {
        let (graph, spec) = tiny_moe_gpt(|c| {
            c.n_layer = 4;
            c.grad_clip = Some(0.5);
            let moe = moe_of(c);
            moe.top_k = 1;
            moe.aux_loss_coef = 0.0;
        });
        let mesh = Mesh::new(2, 1, 2).unwrap().with_ep(2).unwrap();
        let p = Pipeline {
            chunks: 2,
            ..pipeline(2, ScheduleKind::Interleaved)
        };
        let staged =
            expert_pipeline_training(&graph, &spec, &mesh, &p, None, "idx", "targets").unwrap();
        let calls = one_order_per_group(&staged, 2, 2);
        // Each device's expert-parallel group runs the all-to-alls of its MoE layers.
        for s in 0..2 {
            let a2a = calls[&ep_stage_group(s, 0)]
                .values()
                .next()
                .unwrap()
                .iter()
                .filter(|c| c.0 == "CollectiveAllToAll")
                .count();
            assert!(a2a > 0 && a2a % (2 * 4) == 0, "device {s}: {a2a}");
        }
    }
}
