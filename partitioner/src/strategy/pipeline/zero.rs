//! ZeRO over a pipeline's data-parallel replicas (`--mesh dp=D,pp=P --zero-stage 1|2|3`): on
//! every stage, in place of the all-reduce of the stage's gradients over its replicas
//! (`gradients::all_reduce_gradients`), `--strategy zero`'s step
//! (`zero::shard_step_with`) over the stage's data-parallel group (`pipeline/stage<s>`, the
//! workers holding stage `s` in the `D` replicas): the gradients are summed rank-major in
//! buckets (all-reduced at stage 1, reduce-scattered at stage 2), replica `d` keeps only the
//! `1/D` shard `d` of the stage's Adam slots (`{slot}/shard_{d}_of_{D}`), updates its window of
//! each weight and all-gathers the updated shards. Clipping by the whole model's global norm:
//! each stage's `Σ‖g‖²` of its shards is summed over the stage's group, the stages' sums meet
//! in one `GlobalNormScale` on the loss's stage, and the scale goes back to every stage.
//!
//! At stage 3 replica `d` also holds only the flat shard `d` of each of the stage's
//! parameters (`{w}/shard_{d}_of_{D}`, [`zero::params`]), updated in place, never gathered
//! back: every micro-batch's forward copy reads an all-gather of the shards over the stage's
//! group made just before it (`zero/{w}/all_gather_stage{s}_mb{k}_forward`), and its backward
//! ops another (`..._backward`), each dropped after its last reader; each device's collectives
//! are then chained in one order that respects the schedule, the same on every replica. The
//! evaluation (each op on its stage's worker, `super::eval`) reads every replica's shards of the
//! stage joined on that worker, with no collective.
//!
//! Beside expert parallelism (`--mesh dp=D,ep=E,pp=P --zero-stage 1|2|3`,
//! `crate::strategy::expert::pipeline`) each stage's expert shards take their own step over the
//! stage's replicas holding them; their `Σ‖g‖²` joins the stages' sums. At stage 3 their flat
//! shards (of rows `r mod E` of the one-process variable on replica `r`) are gathered over
//! those replicas per micro-batch and pass, as the dense ones over the stage's; the caller
//! adds the evaluation copy.

use super::rewrite::{RewriteInput, SCOPE};
use super::{Pipeline, PipelineError, PipelineGraphs};
use crate::strategy::allreduce::{fresh, node};
use crate::strategy::expert::zero::{as_row_split, expert_shard_step};
use crate::strategy::zero::{self, params, Clip, OuterShards, Param, ShardGroup};
use crate::strategy::{JobInput, JobPlan, Strategy, StrategyError};
use dflow_graph::train::TrainingGraph;
use dflow_graph::{AttrValue, DType, Graph, GraphDef, InputRef, NodeDef};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};

/// ZeRO's options over a pipeline's replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaZero {
    /// 1: shard the Adam slots; 2: also reduce-scatter the gradients; 3: also shard the
    /// parameters, gathered before each micro-batch's forward and backward use.
    pub stage: u8,
    /// Fusion threshold: the most bytes of (padded) gradients in one bucket.
    pub bucket_bytes: usize,
}

/// `--strategy pipeline` with ZeRO over each stage's data-parallel replicas (see the module
/// docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineZero {
    /// The pipeline.
    pub pipeline: Pipeline,
    /// ZeRO over its replicas.
    pub zero: ReplicaZero,
}

impl PipelineZero {
    /// The training graphs of every replica, ZeRO's step in place of the replicas' sum.
    pub fn training_graphs(&self, input: &JobInput<'_>) -> Result<PipelineGraphs, StrategyError> {
        if !(1..=3).contains(&self.zero.stage) {
            return Err(StrategyError::Options {
                strategy: "pipeline",
                message: format!("--zero-stage must be 1, 2 or 3, got {}", self.zero.stage),
            });
        }
        zero::check_optimizer(input.train, "pipeline")?;
        let graphs = self.pipeline.replica_graphs(input, Some(self.zero))?;
        if graphs.replicas.len() < 2 {
            return Err(StrategyError::Options {
                strategy: "pipeline",
                message: format!(
                    "--zero-stage {} shards each stage's Adam slots over the pipeline's data-parallel replicas, and {} workers for {} stages make one replica: use --mesh dp=D,pp=P with D ≥ 2",
                    self.zero.stage,
                    input.workers(),
                    graphs.shape.stages
                ),
            });
        }
        Ok(graphs)
    }
}

impl Strategy for PipelineZero {
    fn name(&self) -> &'static str {
        self.pipeline.name()
    }

    fn describe(&self) -> String {
        format!(
            "{}, ZeRO stage {} over each stage's data-parallel replicas",
            self.pipeline.describe(),
            self.zero.stage
        )
    }

    fn plan(&self, input: &JobInput<'_>) -> Result<JobPlan, StrategyError> {
        let graphs = self.training_graphs(input)?;
        let replicas = graphs.replicas.len();
        let (mut plan, _) = self.pipeline.plan_graphs(input, graphs, self.describe())?;
        // Each slot `{w}/adam_m` is the concatenation of its replicas' shards.
        let params: BTreeMap<String, (DType, Vec<usize>)> = input
            .graph
            .node_indices()
            .filter(|&i| input.graph.node(i).op == "Variable")
            .filter_map(|i| {
                let ty = input.graph.output_type(i, 0)?;
                Some((
                    input.graph.node(i).name.clone(),
                    (ty.dtype, ty.shape.as_static()?),
                ))
            })
            .collect();
        plan.sharded = zero::slot_shards(&plan.variables, &params, replicas);
        Ok(plan)
    }

    fn full_batches(&self) -> bool {
        true
    }
}

/// The passes of a pipeline's training graph, to tell which micro-batch's forward or backward
/// pass reads a parameter (ZeRO-3 gathers it once for each).
pub(super) struct Passes<'a> {
    /// The nodes of the forward graph: micro-batch copies, shared ops, the evaluation copy.
    pub forward: &'a HashSet<String>,
    /// The (virtual stage, micro-batch) of every forward copy; a backward op is its forward
    /// op's (the first it is colocated with).
    pub unit_of: &'a HashMap<String, (usize, usize)>,
}

impl Passes<'_> {
    /// The gather a reader `n` of a parameter reads: `stage{v}_mb{k}_forward` (or `_backward`)
    /// for micro-batch `k`'s copies on virtual stage `v`, `forward` or `backward` for the
    /// ops shared by the micro-batches.
    fn use_of(&self, n: &NodeDef) -> String {
        let unit = match self.unit_of.get(&n.name) {
            Some(u) => Some((u, "forward")),
            None => n
                .colocate_with
                .first()
                .filter(|_| n.name.starts_with("gradients/"))
                .and_then(|f| self.unit_of.get(f))
                .map(|u| (u, "backward")),
        };
        match unit {
            Some(((v, k), pass)) => format!("stage{v}_mb{k}_{pass}"),
            None if self.forward.contains(&n.name) => "forward".into(),
            None => "backward".into(),
        }
    }
}

/// ZeRO's step on every stage of one replica's training graph (see the module docs), in place
/// of the replicas' all-reduce and of the pipeline's clipping; `loss` (this replica's weighted
/// loss) is summed over the loss stage's group. At stage 3 every stage's parameters are also
/// sharded over the stage's group and gathered before each micro-batch's forward and backward
/// use (`passes` tells them apart); the caller then chains each device's collectives
/// ([`order_collectives_per_device`]) once the schedule is in the graph. Beside expert
/// parallelism (`input.tensor`'s `experts`) each stage's expert shards are left out of the
/// stage's step and given their own (`expert::zero::expert_shard_step`) over the stage's
/// replicas holding them, at stage 3 sharded and gathered over those replicas too. `typed` is the validated `training.def`. Returns the name of
/// the global batch's loss.
pub(super) fn shard_stages(
    training: &mut TrainingGraph,
    typed: &Graph,
    input: &RewriteInput<'_>,
    zero: ReplicaZero,
    loss_device: &str,
    passes: &Passes<'_>,
) -> Result<String, StrategyError> {
    let internal = |what: String| StrategyError::from(PipelineError::Internal(what));
    let device_index = |name: &str| {
        let d = training
            .def
            .nodes
            .iter()
            .find(|n| n.name == name)
            .map(|n| n.device.as_str());
        d.and_then(|d| input.devices.iter().position(|x| x == d))
    };
    // Each stage's parameters: those whose variable lives on its device (with its slots and
    // update).
    let mut by_device: BTreeMap<usize, Vec<(String, String)>> = BTreeMap::new();
    for (var, grad) in &training.gradients {
        let d =
            device_index(var).ok_or_else(|| internal(format!("the device of variable `{var}`")))?;
        by_device
            .entry(d)
            .or_default()
            .push((var.clone(), grad.clone()));
    }
    let loss_stage = input
        .devices
        .iter()
        .position(|d| d == loss_device)
        .ok_or_else(|| internal(format!("the loss device {loss_device}")))?;
    let all = std::mem::take(&mut training.gradients);
    let mut taken: HashSet<String> = training.def.nodes.iter().map(|n| n.name.clone()).collect();
    let scale = fresh(&mut taken, &format!("{SCOPE}/zero/clip/global_norm_scale"));
    let clip = input.spec.clip_global_norm;
    let mut squared = Vec::new();
    let mut added = Vec::new();
    let mut global = None;
    // ZeRO-3: each stage's parameters in the shard layout, their group, the stage's index,
    // and whether they are expert shards.
    let mut sharded: Vec<(Vec<Param>, ShardGroup, usize, bool)> = Vec::new();
    for (d, device) in input.devices.iter().enumerate() {
        let key = input
            .dp_groups
            .get(d)
            .ok_or_else(|| internal(format!("no data-parallel group for stage {d}")))?;
        // Beside tensor parallelism, after every instance key of the micro-batches' copies
        // (the tensor-parallel group's too).
        let first = input.tensor.map_or(1, |t| {
            t.instance_stride * input.shape.micro_batches as i64 + 1
        });
        let mut nodes = zero::Nodes::new(std::mem::take(&mut taken), device, first);
        if let Some(grads) = by_device.remove(&d) {
            // Beside expert parallelism: the expert shards apart, over their own groups.
            let experts = input.tensor.and_then(|t| Some((t, t.experts.as_ref()?)));
            let (grads, expert_grads): (Vec<_>, Vec<_>) =
                match input.tensor.and_then(|t| t.expert_shards()) {
                    Some(shards) => grads.into_iter().partition(|(v, _)| !shards.contains(v)),
                    None => (grads, Vec::new()),
                };
            training.gradients = grads;
            let ctx = ShardGroup {
                rank: input.replica,
                ranks: input.replicas,
                stage: zero.stage,
                key: key.clone(),
                bucket_bytes: zero.bucket_bytes,
            };
            let how = if clip.is_some() {
                Clip::Scale(&scale)
            } else {
                Clip::None
            };
            // Beside tensor parallelism: the shards' squares summed over the stage's
            // tensor-parallel group too.
            let outer = match input.tensor.filter(|t| t.tp_shards()) {
                Some(t) => Some(OuterShards {
                    key: t.groups.get(d).ok_or_else(|| {
                        internal(format!("no tensor-parallel group for stage {d}"))
                    })?,
                    sharded: &t.shards,
                }),
                None => None,
            };
            let (params, sq) =
                zero::shard_step_with(training, typed, &mut nodes, &ctx, how, outer.as_ref())?;
            squared.extend(sq);
            if let Some((t, e)) = experts.filter(|_| !expert_grads.is_empty()) {
                let data = match &e.data_groups {
                    Some(groups) => Some(ShardGroup {
                        rank: e.rank,
                        ranks: e.ranks,
                        stage: zero.stage,
                        key: groups
                            .get(d)
                            .ok_or_else(|| {
                                internal(format!("no expert-data-parallel group for stage {d}"))
                            })?
                            .clone(),
                        bucket_bytes: zero.bucket_bytes,
                    }),
                    None => None,
                };
                let ep_key = t
                    .expert_group(d)
                    .ok_or_else(|| internal(format!("no expert-parallel group for stage {d}")))?;
                let mut en =
                    zero::Nodes::new(std::mem::take(&mut nodes.taken), device, nodes.instance);
                let (expert_params, sq) = expert_shard_step(
                    training,
                    typed,
                    &mut en,
                    device,
                    expert_grads,
                    data.as_ref(),
                    (ep_key, e.ep),
                    clip.map(|_| scale.as_str()),
                )?;
                squared.extend(sq);
                nodes.taken = std::mem::take(&mut en.taken);
                nodes.added.append(&mut en.added);
                // ZeRO-3: the expert shards' flat shards over their holders (none when no
                // other replica holds them: they stay whole).
                if let Some(data) = data.filter(|_| zero.stage >= 3) {
                    sharded.push((expert_params, data, d, true));
                }
            }
            if zero.stage >= 3 {
                sharded.push((params, ctx, d, false));
            }
        }
        if d == loss_stage {
            // Last of the stage's collectives: every replica reports the global batch's loss.
            global = Some(nodes.collective(
                key,
                &format!("{SCOPE}/loss/global"),
                "CollectiveAllReduce",
                training.loss.clone(),
                input.replicas,
                true,
            ));
        }
        taken = std::mem::take(&mut nodes.taken);
        added.extend(nodes.added);
    }
    training.gradients = all;
    if let Some(clip) = clip {
        let total = fresh(&mut taken, &format!("{SCOPE}/zero/clip/squared_norm"));
        added.push(node(&total, "AddN", squared, loss_device));
        let mut gns = node(&scale, "GlobalNormScale", vec![total], loss_device);
        gns.attrs = BTreeMap::from([
            ("clip_norm".to_string(), AttrValue::Float(clip)),
            ("squared_norm".to_string(), AttrValue::Bool(true)),
        ]);
        added.push(gns);
    }
    training.def.nodes.extend(added);
    let global = global.ok_or_else(|| internal("no global loss".into()))?;
    if !sharded.is_empty() {
        // The evaluation copy (each op on its stage's device) reads every replica's shards
        // joined on the stage's device; the training passes read gathers.
        let mut keep = passes.forward.clone();
        let is_eval = |n: &NodeDef| n.name.starts_with("eval/");
        for (params, ctx, d, _) in sharded.iter().filter(|s| !s.3) {
            let eval_device = input
                .devices
                .get(*d)
                .ok_or_else(|| internal(format!("no device for pipeline device {d}")))?;
            let device_of = |q: usize| input.replica_devices.get(q)?.get(*d).cloned();
            keep.extend(params::join_for_eval(
                &mut training.def,
                params,
                ctx,
                &device_of,
                eval_device,
                &is_eval,
            )?);
        }
        let roots = [training.train_op.as_str(), global.as_str()];
        let passes = Passes {
            forward: &keep,
            unit_of: passes.unit_of,
        };
        // Each expert shard's flat shards are drawn from its rows of the one-process
        // variable, as beside `--mesh dp=D,ep=E` (`expert::zero`): replica `r` holds rows
        // `r mod E` of `E`.
        if let Some((t, e)) = input.tensor.and_then(|t| Some((t, t.experts.as_ref()?))) {
            let shards = t.expert_shards().unwrap_or(&t.shards);
            if sharded.iter().any(|s| s.3) {
                for v in training
                    .def
                    .nodes
                    .iter_mut()
                    .filter(|n| n.op == "Variable" && shards.contains(&n.name))
                {
                    as_row_split(v, e.ep, input.replica % e.ep);
                }
            }
        }
        for (params, ctx, _, _) in &sharded {
            params::shard_parameters_by(&mut training.def, params, ctx, &keep, &roots, &|n| {
                passes.use_of(n)
            })?;
        }
    }
    Ok(global)
}

/// Chains the collectives of every device by control edges in one topological order of the
/// graph and numbers them from 1 in that order (every device of a ZeRO-3 pipeline talks in
/// one group, its stage's). The order is Kahn's, taking the first node of the graph's order
/// among those ready: it depends only on the ancestors of the collectives, so the ranks of a
/// group, whose graphs differ only in names, devices and their evaluation copy's joins, call
/// the same collectives in the same order.
pub(super) fn order_collectives_per_device(def: &mut GraphDef) -> Result<(), StrategyError> {
    let index: HashMap<&str, usize> = def
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.as_str(), i))
        .collect();
    let mut successors: Vec<Vec<usize>> = vec![Vec::new(); def.nodes.len()];
    let mut waiting = vec![0usize; def.nodes.len()];
    for (i, n) in def.nodes.iter().enumerate() {
        for input in &n.inputs {
            let r = InputRef::parse(input).map_err(|e| {
                StrategyError::from(PipelineError::Input {
                    node: n.name.clone(),
                    message: e,
                })
            })?;
            if let Some(&p) = index.get(r.node()) {
                successors[p].push(i);
                waiting[i] += 1;
            }
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> = (0..def.nodes.len())
        .filter(|&i| waiting[i] == 0)
        .map(Reverse)
        .collect();
    let mut chains: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut done = 0;
    while let Some(Reverse(i)) = ready.pop() {
        done += 1;
        let n = &def.nodes[i];
        if n.op.starts_with("Collective") && n.op != "CollectiveTpCopy" {
            chains.entry(n.device.as_str()).or_default().push(i);
        }
        for &s in &successors[i] {
            waiting[s] -= 1;
            if waiting[s] == 0 {
                ready.push(Reverse(s));
            }
        }
    }
    if done != def.nodes.len() {
        return Err(PipelineError::Internal("a cycle among the collectives' inputs".into()).into());
    }
    let chains: Vec<Vec<usize>> = chains.into_values().collect();
    for chain in chains {
        for (k, &i) in chain.iter().enumerate() {
            let previous = k
                .checked_sub(1)
                .map(|j| format!("^{}", def.nodes[chain[j]].name));
            let n = &mut def.nodes[i];
            n.attrs
                .insert("instance_key".into(), AttrValue::Int(k as i64 + 1));
            if let Some(p) = previous.filter(|p| !n.inputs.contains(p)) {
                n.inputs.push(p);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::pipeline::gradients::stage_group;
    use crate::strategy::pipeline::schedule::ScheduleKind;
    use dflow_graph::layers::{gpt, GptConfig};
    use dflow_graph::{ClusterSpec, NodeDef, Shape};

    /// A small GPT (AdamW, clipping) with windows of 4 tokens.
    fn model() -> (Graph, dflow_graph::train::TrainSpec) {
        let cfg = GptConfig {
            vocab_size: 11,
            block_size: 4,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            ..GptConfig::default()
        };
        let mut m = gpt(&cfg).unwrap();
        let spec = m.def.train.clone().unwrap();
        for n in &mut m.def.nodes {
            if n.op == "Placeholder" {
                n.attrs.insert(
                    "shape".into(),
                    AttrValue::Shape(Shape::partial(vec![None, Some(4)])),
                );
            }
        }
        (Graph::from_def(&m.def).unwrap(), spec)
    }

    fn strategy(stage: u8) -> PipelineZero {
        PipelineZero {
            pipeline: Pipeline {
                stages: Some(2),
                micro_batches: 2,
                schedule: ScheduleKind::OneFOneB,
                chunks: 1,
                batch_size: Some(4),
            },
            zero: ReplicaZero {
                stage,
                bucket_bytes: 1 << 20,
            },
        }
    }

    fn group_key(n: &NodeDef) -> String {
        match n.attrs.get("group_key") {
            Some(AttrValue::String(k)) => k.to_string(),
            other => panic!("{} group_key: {other:?}", n.name),
        }
    }

    #[test]
    fn dp2_pp2_zero_each_stages_ranks_hold_their_dp_shard_of_that_stages_slots_only() {
        let (graph, spec) = model();
        assert!(spec.clip_global_norm.is_some());
        let cluster = ClusterSpec::local(&[("worker", 4)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let elements = |var: &str| -> usize {
            let i = graph.find(var).unwrap();
            let dims = graph.output_type(i, 0).unwrap().shape.as_static().unwrap();
            dims.iter().product()
        };
        for stage in [1u8, 2] {
            let s = strategy(stage);
            let graphs = s.training_graphs(&input).unwrap();
            assert_eq!(graphs.replicas.len(), 2);
            // Megatron-core order: stage p of replica d is worker 2p + d.
            let worker = |p: usize, d: usize| super::super::worker_device(2 * p + d);
            let mut stage_vars: Vec<Vec<String>> = vec![Vec::new(); 2];
            for (d, g) in graphs.replicas.iter().enumerate() {
                let nodes = &g.training.def.nodes;
                let updates: Vec<&NodeDef> =
                    nodes.iter().filter(|n| n.op == "ApplyAdamW").collect();
                assert_eq!(updates.len(), g.training.gradients.len());
                for u in &updates {
                    let var = &u.inputs[0];
                    let device = &nodes.iter().find(|n| &n.name == var).unwrap().device;
                    let p = (0..2).find(|&p| *device == worker(p, d)).unwrap();
                    if d == 0 {
                        stage_vars[p].push(var.clone());
                    }
                    let shard = elements(var).div_ceil(2);
                    assert_eq!(
                        u.attrs.get("shard_offset"),
                        Some(&AttrValue::Int((d * shard) as i64)),
                        "{}",
                        u.name
                    );
                    for (k, slot) in [(1, "adam_m"), (2, "adam_v")] {
                        let name = format!("{var}/{slot}/shard_{d}_of_2");
                        assert_eq!(u.inputs[k], name);
                        let v = nodes.iter().find(|x| x.name == name).unwrap();
                        // The slot shard lives with its variable, on that stage's worker.
                        assert_eq!(&v.device, device);
                        assert_eq!(
                            v.attrs.get("shape"),
                            Some(&AttrValue::Shape(Shape::known(&[shard])))
                        );
                    }
                }
                // No whole slot, and no other replica's shard.
                assert!(!nodes.iter().any(|x| x.name.ends_with("/adam_m")));
                assert!(nodes
                    .iter()
                    .filter(|x| x.op == "Variable" && x.name.ends_with("_of_2"))
                    .all(|x| x.name.ends_with(&format!("shard_{d}_of_2"))));
                // The gradients are summed and the shards gathered over the stage's dp group
                // only; no replica all-reduce of whole gradients is left.
                let summing = if stage == 1 {
                    "CollectiveAllReduce"
                } else {
                    "CollectiveReduceScatter"
                };
                for p in 0..2 {
                    let on = |op: &str| -> Vec<&NodeDef> {
                        nodes
                            .iter()
                            .filter(|n| n.op == op && n.device == worker(p, d))
                            .filter(|n| n.name.starts_with("zero/bucket_"))
                            .collect()
                    };
                    let buckets = on(summing);
                    assert!(!buckets.is_empty(), "stage {p}");
                    assert!(buckets.iter().all(|n| group_key(n) == stage_group(p)));
                    let gathers = on("CollectiveAllGather");
                    assert_eq!(gathers.len(), buckets.len());
                    assert!(gathers.iter().all(|n| group_key(n) == stage_group(p)));
                }
                assert!(!nodes
                    .iter()
                    .any(|n| n.name.starts_with("pipeline/allreduce/")));
                // One clipping scale, from both stages' squared norms, on the loss's stage.
                let scales: Vec<&NodeDef> =
                    nodes.iter().filter(|n| n.op == "GlobalNormScale").collect();
                assert_eq!(scales.len(), 1);
                assert_eq!(scales[0].device, worker(1, d));
            }
            // Both stages hold parameters, and together every one.
            assert!(stage_vars.iter().all(|v| !v.is_empty()));
            let total: usize = stage_vars.iter().map(Vec::len).sum();
            assert_eq!(
                total,
                graph
                    .node_indices()
                    .filter(|&i| graph.node(i).op == "Variable")
                    .count()
            );
            // The plan joins the shards of every slot for checkpoints.
            let plan = s.plan(&input).unwrap();
            let var = &stage_vars[1][0];
            let joined = plan
                .sharded
                .iter()
                .find(|v| v.logical == format!("{var}/adam_m"))
                .unwrap();
            assert_eq!(
                joined.shards,
                [
                    format!("{var}/adam_m/shard_0_of_2"),
                    format!("{var}/adam_m/shard_1_of_2")
                ]
            );
        }
    }

    #[test]
    fn dp2_pp2_zero3_shards_each_stages_weights_and_gathers_them_per_micro_batch_and_pass() {
        let (graph, spec) = model();
        let cluster = ClusterSpec::local(&[("worker", 4)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let s = strategy(3);
        let graphs = s.training_graphs(&input).unwrap();
        let worker = |p: usize, d: usize| super::super::worker_device(2 * p + d);
        let int = |n: &NodeDef, a: &str| match n.attrs.get(a) {
            Some(AttrValue::Int(v)) => *v,
            other => panic!("{} {a}: {other:?}", n.name),
        };
        // Per replica, per stage: the collectives in their chain's order.
        let mut orders: Vec<Vec<Vec<String>>> = Vec::new();
        for (d, g) in graphs.replicas.iter().enumerate() {
            let nodes = &g.training.def.nodes;
            let find = |name: &str| nodes.iter().find(|n| n.name == name);
            for i in graph
                .node_indices()
                .filter(|&i| graph.node(i).op == "Variable")
            {
                let var = &graph.node(i).name;
                let dims = graph.output_type(i, 0).unwrap().shape.as_static().unwrap();
                let len: usize = dims.iter().product();
                // The whole weight is gone; the replica holds its flat half, on the stage's
                // worker, and the update reads that shard.
                assert!(find(var).is_none(), "{var} still whole");
                let shard = find(&format!("{var}/shard_{d}_of_2")).unwrap();
                let p = (0..2).find(|&p| shard.device == worker(p, d)).unwrap();
                assert_eq!(
                    shard.attrs.get("shape"),
                    Some(&AttrValue::Shape(Shape::known(&[len.div_ceil(2)])))
                );
                assert_eq!(int(shard, "shard_offset"), (d * len.div_ceil(2)) as i64);
                // Each micro-batch's forward pass reads a gather of its own, over the
                // stage's group, on the stage's worker.
                for k in 0..2 {
                    let gathers: Vec<&NodeDef> = nodes
                        .iter()
                        .filter(|n| {
                            n.op == "CollectiveAllGather"
                                && n.name.starts_with(&format!("zero/{var}/all_gather_stage"))
                                && n.name.ends_with(&format!("_mb{k}_forward"))
                        })
                        .collect();
                    assert!(!gathers.is_empty(), "{var} micro-batch {k}");
                    for g in gathers {
                        assert_eq!(g.inputs[0], shard.name);
                        assert_eq!(g.device, shard.device);
                        assert_eq!(group_key(g), stage_group(p));
                    }
                }
            }
            // A matrix is read again by the backward pass of each micro-batch.
            let w = "transformer.h.1.mlp.c_proj.weight";
            for k in 0..2 {
                assert!(
                    nodes.iter().any(|n| n.op == "CollectiveAllGather"
                        && n.name.starts_with(&format!("zero/{w}/all_gather_stage"))
                        && n.name.ends_with(&format!("_mb{k}_backward"))),
                    "{w} backward {k}"
                );
            }
            // Nothing is assigned back; evaluation reads the replicas' shards joined on the
            // stage's worker of this replica, with no collective.
            assert!(!nodes.iter().any(|n| n.op == "Assign"));
            let joined = find(&format!("eval/{w}/joined")).unwrap();
            assert_eq!(
                joined.inputs,
                [format!("{w}/shard_0_of_2"), format!("{w}/shard_1_of_2")]
            );
            assert_eq!(joined.device, worker(1, d), "{w} is on stage 1");
            let evaluation: Vec<&NodeDef> = nodes
                .iter()
                .filter(|n| n.name.starts_with("eval/"))
                .collect();
            assert!(evaluation.iter().all(|n| !n.op.starts_with("Collective")
                && (n.device == worker(0, d) || n.device == worker(1, d))));
            assert!(evaluation.iter().any(|n| n.device == worker(1, d)));
            // Every stage's collectives form one chain numbered 1, 2, ...
            let mut per_stage = Vec::new();
            for p in 0..2 {
                let mut chain: Vec<&NodeDef> = nodes
                    .iter()
                    .filter(|n| n.op.starts_with("Collective") && n.device == worker(p, d))
                    .collect();
                chain.sort_by_key(|n| int(n, "instance_key"));
                for (k, w) in chain.windows(2).enumerate() {
                    assert_eq!(int(w[0], "instance_key"), k as i64 + 1);
                    assert!(
                        w[1].inputs.contains(&format!("^{}", w[0].name)),
                        "{} does not wait for {}",
                        w[1].name,
                        w[0].name
                    );
                }
                per_stage.push(chain.iter().map(|n| n.name.clone()).collect());
            }
            orders.push(per_stage);
        }
        // The replicas of a stage call the same collectives in the same order.
        assert_eq!(orders[0], orders[1]);
        // The plan joins the shards of every weight and slot for checkpoints.
        let plan = s.plan(&input).unwrap();
        let w = "transformer.h.0.attn.c_attn.weight";
        for logical in [w.to_string(), format!("{w}/adam_v")] {
            let joined = plan.sharded.iter().find(|v| v.logical == logical).unwrap();
            assert_eq!(
                joined.shards,
                [
                    format!("{logical}/shard_0_of_2"),
                    format!("{logical}/shard_1_of_2")
                ]
            );
        }
    }

    #[test]
    fn zero_over_a_pipeline_refuses_stage_4_one_replica_and_sgd_naming_them() {
        let (graph, spec) = model();
        let four = ClusterSpec::local(&[("worker", 4)]).unwrap();
        let input = JobInput::new(&graph, &spec, &four, "idx", "targets");
        let e = strategy(4).plan(&input).unwrap_err().to_string();
        assert!(e.contains("--zero-stage must be 1, 2 or 3, got 4"), "{e}");
        let two = ClusterSpec::local(&[("worker", 2)]).unwrap();
        let input = JobInput::new(&graph, &spec, &two, "idx", "targets");
        let e = strategy(1).plan(&input).unwrap_err().to_string();
        assert!(e.contains("make one replica"), "{e}");
        let mut sgd = spec.clone();
        sgd.optimizer.kind = dflow_graph::train::OptimizerKind::Sgd;
        let input = JobInput::new(&graph, &sgd, &four, "idx", "targets");
        let e = strategy(1).plan(&input).unwrap_err().to_string();
        assert!(e.contains("shards the Adam/AdamW slots"), "{e}");
    }
}
