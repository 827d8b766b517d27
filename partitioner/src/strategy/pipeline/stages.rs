//! Which stage each op of the forward graph runs on.
//!
//! The ops that depend on the fed batch (the *batch ops*: everything downstream of the features
//! and labels placeholders) are cut into `V` virtual stages, in one of two ways:
//!
//! - **By placement** (no `--stages`): the TensorFlow way, each batch op's `/job:worker/task:s`
//!   is its stage; `V` is the highest task index plus one.
//! - **Balanced** (`--stages N`): the batch ops, in topological order, are cut at the points
//!   where the fewest batch tensors cross (one, between two transformer blocks or two MLP
//!   layers; scalars, such as an MoE block's load-balancing loss, are not counted), choosing the cuts whose cumulative *parameter count* (the elements of the
//!   variables each op is the first to read) is closest to `k·total/V`. The cost is the
//!   parameter count, not FLOPs: it is what a stage must hold, and for a stack of equal layers
//!   it balances compute too.
//!
//! Everything else (variables, constants, ops on weights only) goes to the earliest stage that
//! reads it, so a weight crosses stages only when two stages share it (a tied embedding).

use super::PipelineError;
use dflow_graph::{DeviceName, Graph};
use petgraph::graph::NodeIndex;
use std::collections::BTreeSet;

/// The stage of every node of the forward graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageMap {
    /// Virtual stage per node index.
    pub stage: Vec<usize>,
    /// Whether the node depends on the fed batch.
    pub batch_op: Vec<bool>,
    /// The number of virtual stages.
    pub virtual_stages: usize,
}

/// Which nodes depend on the batch: reachable from `feeds` through data edges (the feeds
/// included).
pub fn batch_ops(g: &Graph, feeds: &[NodeIndex]) -> Vec<bool> {
    let mut consumers: Vec<Vec<NodeIndex>> = vec![Vec::new(); g.num_nodes()];
    for idx in g.node_indices() {
        for (src, _) in g.inputs(idx) {
            consumers[src.index()].push(idx);
        }
    }
    let mut seen = vec![false; g.num_nodes()];
    let mut stack: Vec<NodeIndex> = feeds.to_vec();
    while let Some(i) = stack.pop() {
        if !std::mem::replace(&mut seen[i.index()], true) {
            stack.extend(consumers[i.index()].iter().copied());
        }
    }
    seen
}

/// Elements of the variables each node is the first (in `order`) to read directly.
fn parameter_costs(g: &Graph, order: &[NodeIndex]) -> Vec<u64> {
    let mut cost = vec![0u64; g.num_nodes()];
    let mut counted = vec![false; g.num_nodes()];
    for &i in order {
        for (src, _) in g.inputs(i) {
            let n = g.node(src);
            if n.op_def().is_variable && !std::mem::replace(&mut counted[src.index()], true) {
                let elems = n
                    .outputs
                    .first()
                    .and_then(|t| t.shape.as_static())
                    .map_or(0, |d| d.iter().product::<usize>() as u64);
                cost[i.index()] += elems;
            }
        }
    }
    cost
}

/// Cuts the batch ops into `virtual_stages` balanced stages (see the module docs).
pub fn balanced(
    g: &Graph,
    feeds: &[NodeIndex],
    virtual_stages: usize,
) -> Result<StageMap, PipelineError> {
    let batch = batch_ops(g, feeds);
    let feeds_set: BTreeSet<NodeIndex> = feeds.iter().copied().collect();
    // The cut runs through the ops downstream of the features; ops on the labels alone (a
    // reshape of the targets) follow their readers, like the weights.
    let from_features = batch_ops(g, &feeds[..1]);
    let order: Vec<NodeIndex> = g
        .topo_order()
        .into_iter()
        .filter(|i| from_features[i.index()] && !feeds_set.contains(i))
        .collect();
    if order.len() < virtual_stages {
        return Err(PipelineError::TooFewOps {
            stages: virtual_stages,
            ops: order.len(),
        });
    }
    let cost = parameter_costs(g, &order);
    let position: Vec<Option<usize>> = {
        let mut p = vec![None; g.num_nodes()];
        for (k, i) in order.iter().enumerate() {
            p[i.index()] = Some(k);
        }
        p
    };
    // live[k]: batch tensors produced before position k and read at k or later. Scalars
    // cross for free (an MoE block's load-balancing loss on its way to the total loss), so
    // they do not count: the residual stream between two MoE blocks is one tensor.
    let scalar = |src: NodeIndex, out: usize| {
        g.output_type(src, out)
            .and_then(|t| t.shape.dims().map(<[_]>::is_empty))
            .unwrap_or(false)
    };
    let mut last_use: std::collections::BTreeMap<(usize, usize), usize> = Default::default();
    for (k, &i) in order.iter().enumerate() {
        for (src, out) in g.inputs(i) {
            if scalar(src, out) {
                continue;
            }
            if let Some(ps) = position[src.index()] {
                let e = last_use.entry((ps, out)).or_insert(k);
                *e = (*e).max(k);
            }
        }
    }
    let mut diff = vec![0i64; order.len() + 2];
    for (&(ps, _), &lu) in &last_use {
        if lu > ps {
            diff[ps + 1] += 1;
            diff[lu + 1] -= 1;
        }
    }
    let mut live = vec![0usize; order.len()];
    let mut running = 0i64;
    for (k, l) in live.iter_mut().enumerate() {
        running += diff[k];
        *l = running.max(0) as usize;
    }
    // A point where no batch tensor crosses (only scalars: beside tensor parallelism, an MoE
    // GPT's `loss = xent_loss + aux` after its last batch tensor) is as good a cut as one
    // where one crosses, so it does not rule the others out.
    let fewest = live[1..].iter().copied().min().unwrap_or(1).max(1);
    let candidates: Vec<usize> = (1..order.len()).filter(|&k| live[k] <= fewest).collect();
    if candidates.len() < virtual_stages - 1 {
        return Err(PipelineError::TooFewCuts {
            stages: virtual_stages,
            cuts: candidates.len(),
            crossing: fewest,
        });
    }
    let mut prefix = vec![0u64; order.len() + 1];
    for (k, &i) in order.iter().enumerate() {
        prefix[k + 1] = prefix[k] + cost[i.index()];
    }
    let total = prefix[order.len()].max(1);
    // Choose cut c_k for k = 1..V-1, increasing, leaving enough candidates for the rest.
    let mut cuts = Vec::with_capacity(virtual_stages - 1);
    let mut from = 0usize;
    for k in 1..virtual_stages {
        let target = total as f64 * k as f64 / virtual_stages as f64;
        let remaining = virtual_stages - 1 - k;
        let last_allowed = candidates.len() - 1 - remaining;
        let mut best = from;
        for (c, &pos) in candidates
            .iter()
            .enumerate()
            .take(last_allowed + 1)
            .skip(from)
        {
            let d = (prefix[pos] as f64 - target).abs();
            let best_d = (prefix[candidates[best]] as f64 - target).abs();
            if d < best_d {
                best = c;
            }
        }
        cuts.push(candidates[best]);
        from = best + 1;
    }
    let mut stage = vec![0usize; g.num_nodes()];
    let mut fixed = vec![false; g.num_nodes()];
    for (k, &i) in order.iter().enumerate() {
        stage[i.index()] = cuts.iter().filter(|&&c| c <= k).count();
        fixed[i.index()] = true;
    }
    Ok(finish(g, batch, fixed, stage, virtual_stages))
}

/// Reads the stages from the worker task of every batch op's device (see the module docs).
pub fn from_placement(g: &Graph, feeds: &[NodeIndex]) -> Result<StageMap, PipelineError> {
    let batch = batch_ops(g, feeds);
    let feeds_set: BTreeSet<NodeIndex> = feeds.iter().copied().collect();
    let mut stage = vec![0usize; g.num_nodes()];
    let mut used = BTreeSet::new();
    for i in g.node_indices() {
        if !batch[i.index()] || feeds_set.contains(&i) {
            continue;
        }
        let n = g.node(i);
        let device = n.device.to_string();
        let parsed = DeviceName::parse(&device).ok();
        let task = parsed
            .as_ref()
            .filter(|d| d.job.as_deref() == Some("worker"))
            .and_then(|d| d.task);
        let Some(task) = task else {
            return Err(PipelineError::Unplaced {
                node: n.name.clone(),
                device,
            });
        };
        stage[i.index()] = task as usize;
        used.insert(task as usize);
    }
    let stages = used.iter().next_back().map_or(1, |s| s + 1);
    if let Some(missing) = (0..stages).find(|s| !used.contains(s)) {
        return Err(PipelineError::EmptyStage {
            stage: missing,
            stages,
        });
    }
    // No tensor may travel to an earlier stage.
    for i in g.node_indices() {
        if !batch[i.index()] || feeds_set.contains(&i) {
            continue;
        }
        for (src, _) in g.inputs(i) {
            if batch[src.index()]
                && !feeds_set.contains(&src)
                && stage[src.index()] > stage[i.index()]
            {
                return Err(PipelineError::Backwards {
                    from: g.node(src).name.clone(),
                    from_stage: stage[src.index()],
                    to: g.node(i).name.clone(),
                    to_stage: stage[i.index()],
                });
            }
        }
    }
    let fixed: Vec<bool> = g
        .node_indices()
        .map(|i| batch[i.index()] && !feeds_set.contains(&i))
        .collect();
    Ok(finish(g, batch, fixed, stage, stages))
}

/// Puts every node whose stage is not `fixed` (weights, feeds, ops on the labels alone) on the
/// earliest stage reading it.
fn finish(
    g: &Graph,
    batch: Vec<bool>,
    fixed: Vec<bool>,
    mut stage: Vec<usize>,
    virtual_stages: usize,
) -> StageMap {
    let mut consumers: Vec<Vec<NodeIndex>> = vec![Vec::new(); g.num_nodes()];
    for idx in g.node_indices() {
        for (src, _) in g.inputs(idx) {
            consumers[src.index()].push(idx);
        }
        for src in g.control_inputs(idx) {
            consumers[src.index()].push(idx);
        }
    }
    for i in g.topo_order().into_iter().rev() {
        if fixed[i.index()] {
            continue;
        }
        stage[i.index()] = consumers[i.index()]
            .iter()
            .map(|c| stage[c.index()])
            .min()
            .unwrap_or(0);
    }
    StageMap {
        stage,
        batch_op: batch,
        virtual_stages,
    }
}
