//! The pipeline rewrite: micro-batch copies of the batch ops on their stages, one loss, one
//! training step, and the schedule as control edges.
//!
//! For `m` micro-batches the training graph holds:
//! - the features and labels placeholders with a static batch dimension (the global batch `B`),
//!   on the stage that reads them, each cut by `pipeline/split/<name>` (`Split`, axis 0) into
//!   `m` micro-batches of `B/m` rows;
//! - `pipeline/mb<k>/<op>`: a copy of every batch op for micro-batch `k`, on its stage, reading
//!   the shared weights; `pipeline/mb<k>/loss_share = loss_k · 1/m`;
//! - `pipeline/loss = AddN(loss_share_0 … loss_share_{m−1})`, the mean loss of the global batch
//!   (what the step reports), whose gradient seed is a constant 1 so that no backward pass waits
//!   for the last micro-batch's forward;
//! - the training step of that loss (autodiff colocates every backward op with its forward op,
//!   so micro-batch `k`'s backward runs on the stage of its forward; a weight's gradient is the
//!   sum of the `m` micro-batch gradients, applied once per step);
//! - `eval/<op>`: one copy of the batch ops for evaluation, fed by its own placeholders
//!   `eval/<features>` and `eval/<labels>` (batch dimension as written, so a partial last batch
//!   evaluates) on the chief, each copy on its op's stage, activations sent stage to stage
//!   (`super::eval`);
//! - `pipeline/schedule/stage<s>/<i>`: per stage, a `NoOp` after the `i`-th unit of the stage's
//!   order (see [`super::schedule`]) that the first ops of the next unit wait for, so the step's
//!   trace shows the schedule.

use super::arrivals::Arrivals;
use super::barriers::add_schedule;
use super::eval::{eval_name, eval_tensor};
use super::gradients::{
    all_reduce_gradients, chain_collectives_per_device, clip_by_stage_norms, stage_norms,
};
use super::schedule::{PipelineShape, Unit};
use super::stages::StageMap;
use super::zero::{order_collectives_per_device, shard_stages, Passes};
use super::PipelineError;
use crate::strategy::{EvalNames, ReplicaFeeds, ReplicaGraph, StrategyError};
use dflow_graph::train::{expand_training_graph, TrainSpec};
use dflow_graph::{AttrValue, DType, Graph, GraphDef, InputRef, NodeDef, Shape, Tensor};
use petgraph::graph::NodeIndex;
use std::collections::{BTreeMap, HashMap, HashSet};

/// Tensor parallelism inside the stages: the graph being cut is one tensor-parallel rank's
/// (its collectives in one group), and every micro-batch copy of a collective goes to the
/// tensor-parallel group of its stage under an instance key of its own.
#[derive(Clone, Debug)]
pub(crate) struct TensorStages {
    /// The tensor-parallel collective group of each pipeline device (stage).
    pub groups: Vec<String>,
    /// Added to a collective's instance key once per micro-batch: more than any instance key
    /// of the rank's forward graph.
    pub instance_stride: i64,
    /// The rank's sharded variables: clipping sums their gradients' squares over the
    /// tensor-parallel group (the replicated ones are whole on every rank).
    pub shards: HashSet<String>,
    /// Expert parallelism in place of tensor parallelism: `shards` are the replica's expert
    /// shards and `groups` each stage's expert-parallel group; ZeRO shards their states over
    /// their expert-data-parallel groups, not over the stage's replicas.
    pub experts: Option<ExpertStages>,
}

/// Where ZeRO over a pipeline's replicas ([`super::zero::shard_stages`]) puts the states of the
/// expert shards of one replica of a `dp × ep × pp` job.
#[derive(Clone, Debug)]
pub(crate) struct ExpertStages {
    /// Each stage's expert-data-parallel group of the replica's shard (the stage's replicas
    /// holding the same experts), or `None` when no other replica holds them (`E = D`).
    pub data_groups: Option<Vec<String>>,
    /// The replica's rank in those groups.
    pub rank: usize,
    /// The groups' size (`D / E`).
    pub ranks: usize,
    /// The expert-parallel size: the clipping norm of the shards is summed over the stage's
    /// expert-parallel group of this many replicas.
    pub ep: usize,
    /// Beside tensor parallelism too (`--mesh dp=D,tp=T,pp=P,ep=E`): the expert shards and
    /// expert-parallel groups, while [`TensorStages::shards`] and [`TensorStages::groups`] are
    /// the rank's tp shards and its stages' tp groups; `None`: they are the expert ones.
    pub beside_tp: Option<ExpertsBesideTp>,
}

/// A rank's experts beside tensor parallelism inside pipeline stages ([`ExpertStages`]).
#[derive(Clone, Debug)]
pub(crate) struct ExpertsBesideTp {
    /// The rank's expert shards.
    pub shards: HashSet<String>,
    /// Each stage's expert-parallel group of the rank.
    pub groups: Vec<String>,
}

impl TensorStages {
    /// The expert shards, when the rank holds some ([`ExpertStages`]).
    pub(crate) fn expert_shards(&self) -> Option<&HashSet<String>> {
        let e = self.experts.as_ref()?;
        Some(e.beside_tp.as_ref().map_or(&self.shards, |b| &b.shards))
    }

    /// The expert-parallel group of stage `s`, when the rank holds expert shards.
    pub(crate) fn expert_group(&self, s: usize) -> Option<&String> {
        let e = self.experts.as_ref()?;
        e.beside_tp
            .as_ref()
            .map_or(&self.groups, |b| &b.groups)
            .get(s)
    }

    /// Whether [`TensorStages::shards`] are tensor-parallel shards (summed over the stage's
    /// tp group), not expert shards.
    pub(crate) fn tp_shards(&self) -> bool {
        self.experts
            .as_ref()
            .map_or(true, |e| e.beside_tp.is_some())
    }
}

/// What the rewrite needs besides the graph and its stages.
#[derive(Debug)]
pub(crate) struct RewriteInput<'a> {
    pub graph: &'a Graph,
    pub stages: &'a StageMap,
    pub shape: PipelineShape,
    pub orders: &'a [Vec<Unit>],
    pub spec: &'a TrainSpec,
    pub features: &'a str,
    pub labels: &'a str,
    pub batch_size: usize,
    /// The device of each pipeline stage (`devices[s]` runs stage `s`).
    pub devices: &'a [String],
    /// Replicas of the pipeline training together (data parallelism); the loss of each is
    /// weighted by `1/replicas`.
    pub replicas: usize,
    /// Which replica this is (its part of each global batch).
    pub replica: usize,
    /// The collective group of each stage's data-parallel replicas (with `replicas > 1`).
    pub dp_groups: &'a [String],
    /// The devices of every replica's stages (`replica_devices[r][s]`; `devices` is this
    /// replica's): the evaluation copy of a ZeRO-3 pipeline joins every replica's shards.
    pub replica_devices: &'a [Vec<String>],
    /// Tensor parallelism inside the stages. Without evaluation copy: the caller adds one.
    pub tensor: Option<&'a TensorStages>,
    /// ZeRO over each stage's replicas (with `replicas > 1`), in place of their all-reduce.
    pub zero: Option<super::zero::ReplicaZero>,
}

/// In a collective's group key of a graph cut with [`TensorStages`], the stage (pipeline
/// device) the micro-batch copy runs on: `pipeline/stage{stage}` is the group of the stage's
/// data-parallel replicas ([`super::gradients::stage_group`]) on every stage.
pub(crate) const STAGE_MARK: &str = "{stage}";

/// The name scope of everything the rewrite adds.
pub(super) const SCOPE: &str = "pipeline";

fn mb_name(k: usize, name: &str) -> String {
    format!("{SCOPE}/mb{k}/{name}")
}

fn split_name(name: &str) -> String {
    format!("{SCOPE}/split/{name}")
}

/// Maps an input reference of micro-batch `k`'s copy of a batch op: placeholders to their
/// split, batch ops to their copies, the rest kept.
fn map_input(
    input: &str,
    copy: &dyn Fn(&str) -> String,
    batch: &HashSet<&str>,
    feeds: &[&str],
    k: usize,
) -> Result<String, String> {
    let r = InputRef::parse(input)?;
    Ok(match r {
        InputRef::Data { node, index } if feeds.contains(&node.as_str()) => {
            if index != 0 {
                return Err(format!("input `{input}`: a placeholder has one output"));
            }
            format!("{}:{k}", split_name(&node))
        }
        InputRef::Data { node, index } if batch.contains(node.as_str()) => InputRef::Data {
            node: copy(&node),
            index,
        }
        .to_string(),
        InputRef::Control(node) if batch.contains(node.as_str()) => format!("^{}", copy(&node)),
        _ => input.to_string(),
    })
}

fn scalar_const(name: String, value: f64, dtype: DType, device: String) -> NodeDef {
    let tensor = match dtype {
        DType::F64 => Tensor::scalar(value),
        _ => Tensor::scalar(value as f32),
    };
    NodeDef {
        name,
        op: "Const".into(),
        inputs: vec![],
        device,
        colocate_with: vec![],
        attrs: BTreeMap::from([(
            "value".to_string(),
            AttrValue::Tensor(std::sync::Arc::new(tensor)),
        )]),
    }
}

/// The pipeline's training graph (see the module docs).
pub(crate) fn rewrite(input: &RewriteInput<'_>) -> Result<ReplicaGraph, StrategyError> {
    let g = input.graph;
    let m = input.shape.micro_batches;
    let p = input.shape.stages;
    let forward = g.to_def();
    let st = input.stages;
    let device_of_node =
        |i: NodeIndex| input.devices[input.shape.device_of(st.stage[i.index()])].clone();
    let feeds = [input.features, input.labels];
    let batch: HashSet<&str> = g
        .node_indices()
        .filter(|i| st.batch_op[i.index()])
        .map(|i| g.node(i).name.as_str())
        .filter(|n| !feeds.contains(n))
        .collect();
    let (loss_node, loss_index) = match InputRef::parse(&input.spec.loss) {
        Ok(InputRef::Data { node, index }) => (node, index),
        _ => {
            return Err(StrategyError::UnknownTensor {
                role: "loss",
                name: input.spec.loss.clone(),
                message: "not a tensor name".into(),
            })
        }
    };
    if !batch.contains(loss_node.as_str()) {
        return Err(PipelineError::LossWithoutBatch(input.spec.loss.clone()).into());
    }
    let loss_idx = g
        .find(&loss_node)
        .ok_or_else(|| StrategyError::UnknownTensor {
            role: "loss",
            name: input.spec.loss.clone(),
            message: "no such node".into(),
        })?;
    let loss_dtype = g
        .output_type(loss_idx, loss_index)
        .map_or(DType::F32, |t| t.dtype);
    let loss_device = device_of_node(loss_idx);

    let mut nodes: Vec<NodeDef> = Vec::with_capacity(forward.nodes.len() * (m + 1) + 8);
    let vstage_of = |name: &str| g.find(name).map(|i| st.stage[i.index()]);
    let mut arrivals = Arrivals {
        shape: input.shape,
        devices: input.devices,
        feeds: &feeds,
        made: HashMap::new(),
        nodes: Vec::new(),
    };
    // Which (virtual stage, micro-batch) each forward copy belongs to.
    let mut unit_of: HashMap<String, (usize, usize)> = HashMap::new();
    for n in &forward.nodes {
        let idx = g
            .find(&n.name)
            .ok_or_else(|| PipelineError::Internal(n.name.clone()))?;
        let device = device_of_node(idx);
        if feeds.contains(&n.name.as_str()) {
            // The placeholder, with a static batch dimension, and its split.
            let mut ph = n.clone();
            ph.device = device.clone();
            let shape = match ph.attrs.get("shape") {
                Some(AttrValue::Shape(s)) => s.clone(),
                _ => Shape::unknown(),
            };
            let dims: Vec<Option<usize>> =
                shape
                    .dims()
                    .map(<[_]>::to_vec)
                    .ok_or_else(|| PipelineError::UnknownRank {
                        placeholder: n.name.clone(),
                    })?;
            let Some(first) = dims.first() else {
                return Err(PipelineError::UnknownRank {
                    placeholder: n.name.clone(),
                }
                .into());
            };
            if let Some(d) = *first {
                if d != input.batch_size {
                    return Err(PipelineError::BatchDimension {
                        placeholder: n.name.clone(),
                        dim: d,
                        batch: input.batch_size,
                    }
                    .into());
                }
            }
            let mut fixed = dims.clone();
            fixed[0] = Some(input.batch_size);
            ph.attrs
                .insert("shape".into(), AttrValue::Shape(Shape::partial(fixed)));
            nodes.push(ph);
            nodes.push(NodeDef {
                name: split_name(&n.name),
                op: "Split".into(),
                inputs: vec![n.name.clone()],
                device,
                colocate_with: vec![],
                attrs: BTreeMap::from([
                    ("axis".to_string(), AttrValue::Int(0)),
                    ("num_split".to_string(), AttrValue::Int(m as i64)),
                ]),
            });
            continue;
        }
        if !batch.contains(n.name.as_str()) {
            let mut shared = n.clone();
            shared.device = device;
            nodes.push(shared);
            continue;
        }
        let vstage = st.stage[idx.index()];
        let here = input.shape.device_of(vstage);
        for k in 0..m {
            let copy = |name: &str| mb_name(k, name);
            let mut c = n.clone();
            c.name = copy(&n.name);
            c.device = device.clone();
            let mut inputs = Vec::with_capacity(n.inputs.len());
            for i in &n.inputs {
                let mapped = map_input(i, &copy, &batch, &feeds, k).map_err(|message| {
                    PipelineError::Input {
                        node: n.name.clone(),
                        message,
                    }
                })?;
                inputs.push(arrivals.route(i, mapped, here, Some(k), &vstage_of)?);
            }
            c.inputs = inputs;
            c.colocate_with = n
                .colocate_with
                .iter()
                .map(|w| {
                    if batch.contains(w.as_str()) {
                        copy(w)
                    } else {
                        w.clone()
                    }
                })
                .collect();
            if let Some(tensor) = input.tensor.filter(|_| c.op.starts_with("Collective")) {
                retarget_collective(&mut c, tensor, here, k)?;
            }
            unit_of.insert(c.name.clone(), (vstage, k));
            nodes.push(c);
        }
    }
    // The evaluation (beside tensor parallelism, the caller adds its own).
    let eval = match input.tensor {
        Some(_) => None,
        None => {
            let (added, names) = super::eval::evaluation(&super::eval::EvalInput {
                graph: g,
                stages: st,
                shape: input.shape,
                devices: input.devices,
                features: input.features,
                labels: input.labels,
                batch: &batch,
                spec: input.spec,
                rows: input.batch_size * input.replicas.max(1),
            })?;
            nodes.extend(added);
            Some(names)
        }
    };
    for (node, unit) in arrivals.nodes {
        if let Some(u) = unit {
            unit_of.insert(node.name.clone(), u);
        }
        nodes.push(node);
    }
    // The loss: the mean over micro-batches of each micro-batch's mean.
    let share = format!("{SCOPE}/loss_share");
    nodes.push(scalar_const(
        share.clone(),
        1.0 / (m * input.replicas.max(1)) as f64,
        loss_dtype,
        loss_device.clone(),
    ));
    let loss_stage = st.stage[loss_idx.index()];
    let mut shares = Vec::with_capacity(m);
    for k in 0..m {
        let name = mb_name(k, "loss_share");
        nodes.push(NodeDef {
            name: name.clone(),
            op: "Mul".into(),
            inputs: vec![
                InputRef::Data {
                    node: mb_name(k, &loss_node),
                    index: loss_index,
                }
                .to_string(),
                share.clone(),
            ],
            device: loss_device.clone(),
            colocate_with: vec![],
            attrs: BTreeMap::new(),
        });
        unit_of.insert(name.clone(), (loss_stage, k));
        shares.push(name);
    }
    let loss = format!("{SCOPE}/loss");
    nodes.push(NodeDef {
        name: loss.clone(),
        op: "AddN".into(),
        inputs: shares,
        device: loss_device.clone(),
        colocate_with: vec![],
        attrs: BTreeMap::new(),
    });
    let forward_names: HashSet<String> = nodes.iter().map(|n| n.name.clone()).collect();
    let def = GraphDef {
        nodes,
        ..forward.clone()
    };
    let sums = input.tensor.is_some() || input.replicas > 1;
    let (mut training, typed) = expand_training_graph(
        &GraphDef { train: None, ..def },
        &TrainSpec {
            loss: loss.clone(),
            metrics: vec![],
            // With data or tensor parallelism, clipping is added after the replicas' sums.
            clip_global_norm: input.spec.clip_global_norm.filter(|_| !sums),
            ..input.spec.clone()
        },
    )?;
    constant_seed(&mut training.def, &loss, loss_dtype)?;
    let zero = input.zero.filter(|_| input.replicas > 1);
    if let Some(zero) = zero {
        let passes = Passes {
            forward: &forward_names,
            unit_of: &unit_of,
        };
        training.loss = shard_stages(&mut training, &typed, input, zero, &loss_device, &passes)?;
    } else if input.replicas > 1 {
        training.loss = all_reduce_gradients(
            &mut training.def,
            &mut training.gradients,
            &typed,
            input.devices,
            input.dp_groups,
            &training.loss,
        )?;
    }
    match input.spec.clip_global_norm {
        // ZeRO clipped the shards.
        Some(_) if zero.is_some() => {}
        Some(clip) if sums => clip_by_stage_norms(
            &mut training,
            input.tensor,
            input.devices,
            &loss_device,
            clip,
            input.tensor.map_or(0, |t| t.instance_stride * m as i64),
        )?,
        _ => stage_norms(&mut training.def),
    }
    add_schedule(&mut training.def, &unit_of, input, p)?;
    if zero.is_some_and(|z| z.stage >= 3) {
        // The gathers run inside the micro-batches' passes: chained with the step's other
        // collectives (beside tensor parallelism, the tensor-parallel group's too) in an
        // order that respects the schedule, and numbered in it.
        order_collectives_per_device(&mut training.def)?;
    } else if input.tensor.is_some() {
        chain_collectives_per_device(&mut training.def)?;
    }
    let graph = Graph::from_def(&training.def).map_err(StrategyError::InvalidGraph)?;
    training.metrics = vec![];
    let eval = eval.unwrap_or_else(|| EvalNames {
        features: eval_name(input.features),
        labels: eval_name(input.labels),
        loss: eval_tensor(&input.spec.loss),
        metrics: input.spec.metrics.iter().map(|m| eval_tensor(m)).collect(),
    });
    Ok(ReplicaGraph {
        training,
        graph,
        replicas: vec![ReplicaFeeds {
            worker: input.replica,
            features: input.features.to_string(),
            labels: input.labels.to_string(),
            weight: None,
        }],
        eval,
        step_metrics: Vec::new(),
    })
}

/// Replaces the gradient seed `OnesLike(loss)` by a constant 1 (the loss is a scalar), so the
/// backward pass of a micro-batch does not wait for the forward pass of every micro-batch.
fn constant_seed(def: &mut GraphDef, loss: &str, dtype: DType) -> Result<(), PipelineError> {
    let reads_loss = |n: &NodeDef| {
        n.inputs
            .first()
            .is_some_and(|i| i == loss || *i == format!("{loss}:0"))
    };
    let seed = def
        .nodes
        .iter_mut()
        .find(|n| n.op == "OnesLike" && reads_loss(n))
        .ok_or_else(|| PipelineError::Internal(format!("no gradient seed reads `{loss}`")))?;
    let c = scalar_const(seed.name.clone(), 1.0, dtype, seed.device.clone());
    seed.op = c.op;
    seed.inputs = c.inputs;
    seed.attrs = c.attrs;
    Ok(())
}

/// Micro-batch `k`'s copy `c` of a collective of a tensor-parallel rank's graph, on pipeline
/// device `device`: into that stage's tensor-parallel group (or, for a group key naming
/// [`STAGE_MARK`], that group of the stage), under an instance key of its own.
fn retarget_collective(
    c: &mut NodeDef,
    tensor: &TensorStages,
    device: usize,
    k: usize,
) -> Result<(), PipelineError> {
    let group = tensor.groups.get(device).ok_or_else(|| {
        PipelineError::Internal(format!("no tensor-parallel group for {}", c.name))
    })?;
    let key = match c.attrs.get("instance_key") {
        Some(AttrValue::Int(v)) => *v,
        _ => {
            return Err(PipelineError::Internal(format!(
                "{} has no instance_key",
                c.name
            )))
        }
    };
    // A group key naming [`STAGE_MARK`] is a group of this stage's own (expert parallelism's
    // router gathers over the stage's replicas): the mark becomes the device.
    let group = match c.attrs.get("group_key") {
        Some(AttrValue::String(own)) if own.contains(STAGE_MARK) => {
            own.replace(STAGE_MARK, &device.to_string())
        }
        _ => group.clone(),
    };
    c.attrs
        .insert("group_key".into(), AttrValue::String(group.as_str().into()));
    c.attrs.insert(
        "instance_key".into(),
        AttrValue::Int(key + tensor.instance_stride * k as i64),
    );
    Ok(())
}
