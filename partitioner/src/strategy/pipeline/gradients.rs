//! What a pipeline does with its gradients before the update: sum them over the pipeline's
//! data-parallel replicas, and clip them by a global norm computed from one norm per stage.
//! With tensor parallelism inside the stages, the clipping norm also sums the shards'
//! squares over each stage's tensor-parallel group, and every device's collectives are
//! chained in one order.

use super::rewrite::{TensorStages, SCOPE};
use super::PipelineError;
use crate::strategy::StrategyError;
use dflow_graph::train::TrainingGraph;
use dflow_graph::{AttrValue, Graph, GraphDef, InputRef, NodeDef, Shape};
use std::collections::{BTreeMap, HashMap};

/// The collective group of pipeline stage `s`'s replicas.
pub fn stage_group(s: usize) -> String {
    format!("{SCOPE}/stage{s}")
}

/// Data parallelism over pipeline replicas: on every stage, the gradients of the stage's
/// variables (each the sum of its micro-batches') are packed into one buffer and summed over
/// the stage's replicas by one `CollectiveAllReduce` in group `groups[stage]` ([`stage_group`]
/// for a plain pipeline); everything that read a gradient (clipping, the update) reads the
/// sum, and `gradients` names the sums. Each replica's loss is already weighted
/// by `1/replicas`, so the sum is the gradient of the global batch's mean loss. Last, the loss
/// is summed over the last stage's replicas: every replica reports the global batch's loss.
/// Returns the name of the global loss.
pub(crate) fn all_reduce_gradients(
    def: &mut GraphDef,
    gradients: &mut [(String, String)],
    typed: &Graph,
    devices: &[String],
    groups: &[String],
    loss: &str,
) -> Result<String, PipelineError> {
    let group = |stage: usize| {
        groups
            .get(stage)
            .cloned()
            .ok_or_else(|| PipelineError::Internal(format!("no group for stage {stage}")))
    };
    let device_of: HashMap<String, String> = def
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.device.clone()))
        .collect();
    let stage_of = |tensor: &str| -> Result<usize, PipelineError> {
        let node = InputRef::parse(tensor)
            .map(|r| r.node().to_string())
            .map_err(PipelineError::Internal)?;
        let device = device_of
            .get(&node)
            .ok_or_else(|| PipelineError::Internal(node.clone()))?;
        devices
            .iter()
            .position(|d| d == device)
            .ok_or_else(|| PipelineError::Internal(format!("{node} on {device}")))
    };
    // Per stage: (gradient tensor, static dims), in variable order.
    let mut by_stage: BTreeMap<usize, Vec<(String, Vec<usize>)>> = BTreeMap::new();
    for (var, grad) in gradients.iter() {
        let (node, index) = match InputRef::parse(grad) {
            Ok(InputRef::Data { node, index }) => (node, index),
            _ => return Err(PipelineError::Internal(grad.clone())),
        };
        let dims = typed
            .find(&node)
            .and_then(|i| typed.output_type(i, index))
            .and_then(|t| t.shape.as_static())
            .ok_or_else(|| {
                PipelineError::Internal(format!("the gradient of `{var}` has no static shape"))
            })?;
        by_stage
            .entry(stage_of(grad)?)
            .or_default()
            .push((grad.clone(), dims));
    }
    let node = |name: String, op: &str, inputs: Vec<String>, device: &str| NodeDef {
        name,
        op: op.into(),
        inputs,
        device: device.to_string(),
        colocate_with: vec![],
        attrs: BTreeMap::new(),
    };
    let mut added = Vec::new();
    let mut reduced: HashMap<InputRef, String> = HashMap::new();
    let mut last_on: HashMap<usize, String> = HashMap::new();
    for (stage, grads) in &by_stage {
        let device = &devices[*stage];
        let base = format!("{SCOPE}/allreduce/stage{stage}");
        let pack = format!("{base}/pack");
        added.push(node(
            pack.clone(),
            "PackFlat",
            grads.iter().map(|(g, _)| g.clone()).collect(),
            device,
        ));
        let mut ar = node(base.clone(), "CollectiveAllReduce", vec![pack], device);
        ar.attrs = BTreeMap::from([
            (
                "group_key".to_string(),
                AttrValue::String(group(*stage)?.into()),
            ),
            ("instance_key".to_string(), AttrValue::Int(1)),
            ("reduce".to_string(), AttrValue::String("sum".into())),
        ]);
        added.push(ar);
        let mut offset = 0i64;
        for (j, (g, dims)) in grads.iter().enumerate() {
            let slice = format!("{base}/grad_{j}");
            let mut s = node(slice.clone(), "FlatSlice", vec![base.clone()], device);
            s.attrs = BTreeMap::from([
                ("offset".to_string(), AttrValue::Int(offset)),
                ("shape".to_string(), AttrValue::Shape(Shape::known(dims))),
            ]);
            offset += dims.iter().product::<usize>() as i64;
            added.push(s);
            if let Ok(r) = InputRef::parse(g) {
                reduced.insert(r, slice);
            }
        }
        last_on.insert(*stage, base);
    }
    for n in &mut def.nodes {
        for input in &mut n.inputs {
            if let Some(r) = InputRef::parse(input).ok().and_then(|r| reduced.get(&r)) {
                *input = r.clone();
            }
        }
    }
    for (_, grad) in gradients.iter_mut() {
        if let Some(r) = InputRef::parse(grad).ok().and_then(|r| reduced.get(&r)) {
            *grad = r.clone();
        }
    }
    let loss_stage = stage_of(loss)?;
    let global = format!("{SCOPE}/loss/global");
    let mut inputs = vec![loss.to_string()];
    if let Some(prev) = last_on.get(&loss_stage) {
        inputs.push(format!("^{prev}"));
    }
    let mut g = node(
        global.clone(),
        "CollectiveAllReduce",
        inputs,
        &devices[loss_stage],
    );
    g.attrs = BTreeMap::from([
        (
            "group_key".to_string(),
            AttrValue::String(group(loss_stage)?.into()),
        ),
        ("instance_key".to_string(), AttrValue::Int(2)),
        ("reduce".to_string(), AttrValue::String("sum".into())),
    ]);
    added.push(g);
    def.nodes.extend(added);
    Ok(global)
}

/// Clipping by global norm without moving the gradients: the training step's
/// `GlobalNormScale` reads every gradient, so each would cross to the loss's stage. Instead,
/// each stage computes the norm of its own gradients (`Sqrt(Σ Sum(Square(g)))`) and the scale
/// reads one scalar per stage: `sqrt(Σ norm_s²)` is the same global norm. The scale (a scalar)
/// goes back to each stage, which scales its gradients where they were computed.
pub(super) fn stage_norms(def: &mut GraphDef) {
    let device_of: HashMap<String, String> = def
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.device.clone()))
        .collect();
    let mut added = Vec::new();
    for n in def.nodes.iter_mut().filter(|n| n.op == "GlobalNormScale") {
        let mut by_device: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for input in &n.inputs {
            let Ok(InputRef::Data { node, .. }) = InputRef::parse(input) else {
                continue;
            };
            let device = device_of.get(&node).cloned().unwrap_or_default();
            by_device.entry(device).or_default().push(input.clone());
        }
        if by_device.len() < 2 {
            continue;
        }
        let controls: Vec<String> = n
            .inputs
            .iter()
            .filter(|i| i.starts_with('^'))
            .cloned()
            .collect();
        let mut norms = Vec::new();
        for (s, (device, grads)) in by_device.into_iter().enumerate() {
            let base = format!("{}/stage{s}", n.name);
            let node = |name: String, op: &str, inputs: Vec<String>| NodeDef {
                name,
                op: op.into(),
                inputs,
                device: device.clone(),
                colocate_with: vec![],
                attrs: BTreeMap::new(),
            };
            let mut sums = Vec::new();
            for (i, g) in grads.into_iter().enumerate() {
                let sq = format!("{base}/square_{i}");
                let sum = format!("{base}/sum_{i}");
                added.push(node(sq.clone(), "Square", vec![g]));
                added.push(node(sum.clone(), "Sum", vec![sq]));
                sums.push(sum);
            }
            let total = format!("{base}/sum_of_squares");
            let norm = format!("{base}/norm");
            added.push(node(total.clone(), "AddN", sums));
            added.push(node(norm.clone(), "Sqrt", vec![total]));
            norms.push(norm);
        }
        n.inputs = norms;
        n.inputs.extend(controls);
    }
    def.nodes.extend(added);
}

/// Clipping by the whole model's global norm after the replicas' sums (data parallelism), or
/// when every stage is a tensor-parallel rank (`tensor`): on each stage, `Σ‖g‖²` of its
/// shards' gradients all-reduced over the stage's tensor-parallel group (instance `instance`)
/// plus `Σ‖g‖²` of its other parameters' (whole on every rank); the stages' sums meet in one
/// `GlobalNormScale` on the loss's device, whose scale goes back to each stage and multiplies
/// its gradients there. The updates and `training.gradients` read the clipped gradients.
pub(crate) fn clip_by_stage_norms(
    training: &mut TrainingGraph,
    tensor: Option<&TensorStages>,
    devices: &[String],
    loss_device: &str,
    clip: f64,
    instance: i64,
) -> Result<(), PipelineError> {
    let def = &mut training.def;
    let device_of: HashMap<String, String> = def
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.device.clone()))
        .collect();
    let device_index = |grad: &str| -> Result<usize, PipelineError> {
        let node = InputRef::parse(grad)
            .map(|r| r.node().to_string())
            .map_err(PipelineError::Internal)?;
        device_of
            .get(&node)
            .and_then(|d| devices.iter().position(|x| x == d))
            .ok_or_else(|| PipelineError::Internal(format!("the device of gradient `{grad}`")))
    };
    // Per device: (shard gradients, replicated gradients).
    let mut by_device: BTreeMap<usize, (Vec<String>, Vec<String>)> = BTreeMap::new();
    for (var, grad) in &training.gradients {
        let entry = by_device.entry(device_index(grad)?).or_default();
        if tensor.is_some_and(|t| t.shards.contains(var)) {
            entry.0.push(grad.clone());
        } else {
            entry.1.push(grad.clone());
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
    let base = format!("{SCOPE}/clip");
    let mut added = Vec::new();
    let mut totals = Vec::new();
    for (s, (shards, replicated)) in &by_device {
        let device = &devices[*s];
        let mut parts = Vec::new();
        if !shards.is_empty() {
            let local = format!("{base}/stage{s}/shards_squared_norm");
            added.push(node(local.clone(), "SquaredNorm", shards.clone(), device));
            let sum = format!("{base}/stage{s}/shards_squared_norm_sum");
            let mut ar = node(sum.clone(), "CollectiveAllReduce", vec![local], device);
            let group = tensor
                .and_then(|t| t.groups.get(*s))
                .ok_or_else(|| PipelineError::Internal(format!("no group for stage {s}")))?;
            ar.attrs = BTreeMap::from([
                (
                    "group_key".to_string(),
                    AttrValue::String(group.as_str().into()),
                ),
                ("instance_key".to_string(), AttrValue::Int(instance)),
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
    scale_by_global_norm(training, added, &base, total, clip, loss_device, |grad| {
        Ok(devices[device_index(grad)?].clone())
    })
}

/// Clipping's last part on a pipeline's stages: the scale `GlobalNormScale` of the whole
/// model's squared norm `total` (a node of `added`, on `loss_device`), each gradient of
/// `training` multiplied by it on its own stage's device (`device_of`), every update rewired to
/// read the clipped gradient, and `added` (the norms' nodes) with these joined to the graph.
pub(crate) fn scale_by_global_norm<E>(
    training: &mut TrainingGraph,
    mut added: Vec<NodeDef>,
    base: &str,
    total: String,
    clip: f64,
    loss_device: &str,
    device_of: impl Fn(&str) -> Result<String, E>,
) -> Result<(), E> {
    let node = |name: String, op: &str, inputs: Vec<String>, device: &str| NodeDef {
        name,
        op: op.into(),
        inputs,
        device: device.to_string(),
        colocate_with: vec![],
        attrs: BTreeMap::new(),
    };
    let scale = format!("{base}/global_norm_scale");
    let mut gns = node(scale.clone(), "GlobalNormScale", vec![total], loss_device);
    gns.attrs = BTreeMap::from([
        ("clip_norm".to_string(), AttrValue::Float(clip)),
        ("squared_norm".to_string(), AttrValue::Bool(true)),
    ]);
    added.push(gns);
    let mut clipped: HashMap<String, String> = HashMap::new();
    for (j, (_, grad)) in training.gradients.iter_mut().enumerate() {
        let device = device_of(grad)?;
        let name = format!("{base}/grad_{j}");
        added.push(node(
            name.clone(),
            "Mul",
            vec![grad.clone(), scale.clone()],
            &device,
        ));
        clipped.insert(grad.clone(), name.clone());
        *grad = name;
    }
    let def = &mut training.def;
    for u in def.nodes.iter_mut().filter(|u| u.op.starts_with("Apply")) {
        for i in &mut u.inputs {
            if let Some(c) = clipped.get(i) {
                *i = c.clone();
            }
        }
    }
    def.nodes.extend(added);
    Ok(())
}

/// Chains the collectives of every device by control edges in one topological order of the
/// whole graph, so that the ranks of every group (a stage's tensor-parallel ranks, or its
/// data-parallel replicas, whose graphs differ only in names and devices) call them in the
/// same order. Megatron's `f` forward (`CollectiveTpCopy`, the identity) calls none.
pub(crate) fn chain_collectives_per_device(def: &mut GraphDef) -> Result<(), StrategyError> {
    let typed = Graph::from_def(def).map_err(StrategyError::InvalidGraph)?;
    let mut chains: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for i in typed.topo_order() {
        let n = typed.node(i);
        if n.op.starts_with("Collective") && n.op != "CollectiveTpCopy" {
            chains
                .entry(n.device.to_string())
                .or_default()
                .push(n.name.clone());
        }
    }
    let index: HashMap<String, usize> = def
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.clone(), i))
        .collect();
    for chain in chains.values() {
        for w in chain.windows(2) {
            if let Some(&i) = index.get(&w[1]) {
                def.nodes[i].inputs.push(format!("^{}", w[0]));
            }
        }
    }
    Ok(())
}
