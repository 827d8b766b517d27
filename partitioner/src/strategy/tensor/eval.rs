//! Evaluation over the tensor-parallel ranks: the held-out loss computed by the sharded model
//! itself, so that no task ever holds the whole model (the point of tensor parallelism).
//!
//! The evaluation signature is one step over the ranks of tensor-parallel group 0 (workers
//! `0..T`): each rank runs a copy of its own Megatron forward graph ([`RankForward`]),
//! `eval/...` on rank 0 and `eval/tp{t}/...` on rank `t`, reading the rank's shards of the
//! weights in place, with the forward collectives of the training step (in the same group, at
//! instance keys of their own). Worker 0 is fed the held-out batch through placeholders of a
//! static batch, `eval/{features}` and `eval/{labels}`, and sends it to the other ranks (a
//! Send/Recv pair each, sized once); the replicated weights (layer norms, position embedding,
//! row-parallel biases) are equal on every rank, so the other ranks read worker 0's. Rank 0's
//! loss waits (a control edge) for every other rank's, so the step runs each rank's
//! collectives, and every rank computes the same loss: the one-process model's.
//!
//! Without a static batch (no `--batch-size`, or a placeholder whose batch dimension is fixed
//! at another size), or under ZeRO-3 (whose weights are flat shards gathered per use), the
//! strategy keeps the evaluation that joins the weights on worker 0 (`eval_copy`).

use super::{find, RankForward, ReplicaGraph, StrategyError};
use crate::strategy::allreduce::{fresh, worker_device};
use dflow_graph::train::TrainSpec;
use dflow_graph::{AttrValue, Graph, InputRef, NodeDef};
use std::collections::{HashMap, HashSet};

/// The first collective instance key free in every graph of `graphs` (one more than the
/// largest key any of them uses): evaluation's collectives number from here, so no key of the
/// training step is reused.
pub(super) fn first_free_instance(graphs: &[ReplicaGraph]) -> i64 {
    graphs
        .iter()
        .flat_map(|g| &g.training.def.nodes)
        .filter(|n| n.op.starts_with("Collective"))
        .filter_map(|n| match n.attrs.get("instance_key") {
            Some(AttrValue::Int(k)) => Some(*k),
            _ => None,
        })
        .max()
        .map_or(1, |k| k + 1)
}

/// What the evaluation of one sharded step reads: the batch's placeholders and its size.
pub(super) struct EvalFeeds<'a> {
    /// The features placeholder of the forward graph.
    pub features: &'a str,
    /// The labels placeholder.
    pub labels: &'a str,
    /// Rows of every held-out batch (the global batch size).
    pub rows: usize,
}

/// Points `g0`'s evaluation (rank 0's graph) at a forward step over the tensor-parallel ranks
/// whose forward graphs are `ranks` (rank `t` on worker `t`), see the module docs. Returns
/// `false`, changing nothing, when the batch cannot be made static (a placeholder's batch
/// dimension is fixed at another size than `feeds.rows`).
pub(super) fn add_sharded_eval(
    g0: &mut ReplicaGraph,
    ranks: &[RankForward],
    spec: &TrainSpec,
    feeds: &EvalFeeds<'_>,
    instance_base: i64,
) -> Result<bool, StrategyError> {
    let Some(first) = ranks.first() else {
        return Ok(false);
    };
    let mut taken: HashSet<String> = g0
        .training
        .def
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .collect();
    let worker0 = worker_device("", "", 0)?;
    // The held-out batch's placeholders, on worker 0, of a static batch.
    let mut placeholders = HashMap::new();
    let mut added: Vec<NodeDef> = Vec::new();
    for name in [feeds.features, feeds.labels] {
        let Some(mut p) = static_batch(find(&first.def, name)?, feeds.rows) else {
            return Ok(false);
        };
        p.name = fresh(&mut taken, &format!("eval/{name}"));
        p.device = worker0.clone();
        p.colocate_with.clear();
        placeholders.insert(name.to_string(), p.name.clone());
        added.push(p);
    }
    let fetched: Vec<&str> = std::iter::once(spec.loss.as_str())
        .chain(spec.metrics.iter().map(String::as_str))
        .collect();
    let mut rank0_fetches: HashMap<String, String> = HashMap::new();
    let mut waits: Vec<String> = Vec::new();
    for (t, rank) in ranks.iter().enumerate() {
        let shards: HashSet<&str> = rank.renames.values().map(String::as_str).collect();
        let prefix = if t == 0 {
            "eval".to_string()
        } else {
            format!("eval/tp{t}")
        };
        // Each node's name in the evaluation copy.
        let mut map: HashMap<&str, String> = HashMap::new();
        for x in &rank.def.nodes {
            let to = match x.op.as_str() {
                // Rank t's shards are its own; the replicated weights are read from worker 0.
                "Variable" => {
                    if t > 0 && shards.contains(x.name.as_str()) {
                        added.push(x.clone());
                    }
                    x.name.clone()
                }
                "Placeholder" => match placeholders.get(&x.name) {
                    Some(p) => p.clone(),
                    None => return Ok(false),
                },
                _ => fresh(&mut taken, &format!("{prefix}/{}", x.name)),
            };
            map.insert(&x.name, to);
        }
        let remap = |input: &str| -> String {
            match InputRef::parse(input) {
                Ok(InputRef::Data { node, index }) => match map.get(node.as_str()) {
                    Some(to) if index == 0 => to.clone(),
                    Some(to) => format!("{to}:{index}"),
                    None => input.to_string(),
                },
                Ok(InputRef::Control(node)) => match map.get(node.as_str()) {
                    Some(to) => format!("^{to}"),
                    None => input.to_string(),
                },
                Err(_) => input.to_string(),
            }
        };
        let copies_from = added.len();
        for x in rank
            .def
            .nodes
            .iter()
            .filter(|x| x.op != "Variable" && x.op != "Placeholder")
        {
            let mut copy = x.clone();
            copy.name = remap(&x.name);
            copy.inputs = x.inputs.iter().map(|i| remap(i)).collect();
            copy.colocate_with.clear();
            if x.op.starts_with("Collective") {
                if let Some(AttrValue::Int(k)) = copy.attrs.get_mut("instance_key") {
                    *k += instance_base;
                }
            }
            added.push(copy);
        }
        // The rank's collectives in one order, the same on every rank (its forward graph's).
        let order = collective_order(&rank.def)?;
        for w in order.windows(2) {
            let (before, after) = (&map[w[0].as_str()], &map[w[1].as_str()]);
            if let Some(n) = added[copies_from..].iter_mut().find(|n| n.name == *after) {
                n.inputs.push(format!("^{before}"));
            }
        }
        for f in &fetched {
            let copied = remap(f);
            if t == 0 {
                rank0_fetches.insert(f.to_string(), copied);
            } else {
                let node = match InputRef::parse(&copied) {
                    Ok(InputRef::Data { node, .. }) => node,
                    _ => copied,
                };
                waits.push(format!("^{node}"));
            }
        }
    }
    // Rank 0's loss waits for every other rank's fetches: the step runs all of them.
    let loss = rank0_fetches
        .get(&spec.loss)
        .cloned()
        .unwrap_or_else(|| spec.loss.clone());
    let loss_node = match InputRef::parse(&loss) {
        Ok(InputRef::Data { node, .. }) => node,
        _ => loss.clone(),
    };
    if let Some(n) = added.iter_mut().find(|n| n.name == loss_node) {
        n.inputs.extend(waits);
    }
    g0.training.def.nodes.extend(added);
    g0.graph = Graph::from_def(&g0.training.def).map_err(StrategyError::InvalidGraph)?;
    g0.eval.features = placeholders[feeds.features].clone();
    g0.eval.labels = placeholders[feeds.labels].clone();
    g0.eval.loss = loss;
    g0.eval.metrics = spec
        .metrics
        .iter()
        .map(|m| rank0_fetches.get(m).cloned().unwrap_or_else(|| m.clone()))
        .collect();
    Ok(true)
}

/// `placeholder` with its batch dimension set to `rows`; `None` when it is fixed at another
/// size or the shape is not known.
fn static_batch(placeholder: &NodeDef, rows: usize) -> Option<NodeDef> {
    let mut p = placeholder.clone();
    match p.attrs.get_mut("shape") {
        Some(AttrValue::IntList(dims)) => {
            let first = dims.first_mut()?;
            if *first < 0 {
                *first = i64::try_from(rows).ok()?;
            } else if *first as usize != rows {
                return None;
            }
        }
        Some(AttrValue::Shape(s)) => {
            let mut dims = s.dims()?.to_vec();
            let first = dims.first_mut()?;
            match first {
                None => *first = Some(rows),
                Some(d) if *d == rows => {}
                Some(_) => return None,
            }
            *s = dflow_graph::Shape::partial(dims);
        }
        _ => return None,
    }
    Some(p)
}

/// The collectives of a rank's forward graph in its topological order, the order every rank
/// runs them in (`CollectiveTpCopy` is no collective forward).
fn collective_order(def: &dflow_graph::GraphDef) -> Result<Vec<String>, StrategyError> {
    let typed = Graph::from_def(def).map_err(StrategyError::InvalidGraph)?;
    Ok(typed
        .topo_order()
        .into_iter()
        .map(|i| typed.node(i))
        .filter(|n| n.op.starts_with("Collective") && n.op != "CollectiveTpCopy")
        .map(|n| n.name.clone())
        .collect())
}
