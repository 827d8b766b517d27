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
//! Under ZeRO-3 the ranks' weights are flat shards over their data-parallel groups: each rank
//! gathers its own per use, as training's forward does ([`flat_gathers`]), the other
//! replicas joining each gather with their shards ([`peer_gathers`]). Beside experts
//! (`dp,tp,ep`, `tensor::experts_eval`) the MoE layers run once, on rank 0, whose copy the
//! other ranks read (`shared`).
//!
//! Without a static batch (no `--batch-size`, or a placeholder whose batch dimension is fixed
//! at another size) the strategy keeps the evaluation that joins the weights on worker 0
//! (`eval_copy`).

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
pub(crate) struct EvalFeeds<'a> {
    /// The features placeholder of the forward graph.
    pub features: &'a str,
    /// The labels placeholder.
    pub labels: &'a str,
    /// Rows of every held-out batch (the global batch size).
    pub rows: usize,
}

/// Points `g0`'s evaluation (rank 0's graph) at a forward step over the tensor-parallel ranks
/// whose forward graphs are `ranks` (rank `t` on worker `t`), see the module docs. Under
/// ZeRO-3 (`zero3`: the layout and each rank's [`flat_gathers`]) the other replicas join the
/// ranks' gathers ([`peer_gathers`]). The nodes of ranks `t > 0` named in `shared` (an MoE
/// layer, replicated over tp) are not copied: those ranks read rank 0's copy. Returns
/// `false`, changing nothing, when the batch cannot be made static (a placeholder's batch
/// dimension is fixed at another size than `feeds.rows`).
pub(super) fn add_sharded_eval(
    graphs: &mut [ReplicaGraph],
    ranks: &[RankForward],
    spec: &TrainSpec,
    feeds: &EvalFeeds<'_>,
    instance_base: i64,
    zero3: Option<(&Zero3, &[Vec<FlatGather>])>,
    shared: &HashSet<String>,
) -> Result<bool, StrategyError> {
    let (Some(first), Some((g0, peers))) = (ranks.first(), graphs.split_first_mut()) else {
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
    // Each rank's evaluation name of every node of its forward graph.
    let mut copies: Vec<HashMap<String, String>> = Vec::with_capacity(ranks.len());
    // Under ZeRO-3, rank 0's gathered value of each replicated weight, which the other ranks
    // read (they hold the same weight, as flat shards of the same values).
    let replicated: HashMap<&str, &str> = zero3
        .and_then(|(_, gathers)| gathers.first())
        .map(|g| {
            g.iter()
                .filter(|f| f.replicated)
                .map(|f| (f.var.as_str(), f.value.as_str()))
                .collect()
        })
        .unwrap_or_default();
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
            if t > 0 && shared.contains(&x.name) {
                // Computed once, by rank 0: read its copy.
                if let Some(to) = copies.first().and_then(|c| c.get(&x.name)) {
                    map.insert(&x.name, to.clone());
                }
                continue;
            }
            let to = match x.op.as_str() {
                // Rank t's shards are its own; the replicated weights are read from worker 0.
                "Variable" => {
                    if t > 0 && shards.contains(x.name.as_str()) {
                        added.push(x.clone());
                        x.name.clone()
                    } else {
                        match (t, replicated.get(x.name.as_str())) {
                            (1.., Some(value)) => copies
                                .first()
                                .and_then(|c| c.get(*value))
                                .cloned()
                                .unwrap_or_else(|| x.name.clone()),
                            _ => x.name.clone(),
                        }
                    }
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
            .filter(|x| t == 0 || !shared.contains(&x.name))
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
        copies.push(map.into_iter().map(|(k, v)| (k.to_string(), v)).collect());
    }
    if let Some((zero, gathers)) = zero3 {
        added.extend(peer_gathers(
            peers, zero, gathers, &copies, &added, &mut taken, &mut waits,
        )?);
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
    sends_before_collectives(&mut added, &g0.training.def.nodes);
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

/// ZeRO-3 beside tensor parallelism: every rank's weights are flat shards over its
/// data-parallel group, which the evaluation gathers per use as training's forward does.
pub(super) struct Zero3 {
    /// The data-parallel size `D` (the ranks of each flat shard's group).
    pub dp: usize,
    /// The tensor-parallel size `T` (rank `t` of replica `d` is worker `t + T·d`).
    pub tp: usize,
}

/// One gather [`flat_gathers`] put in a rank's forward graph.
pub(super) struct FlatGather {
    /// The `CollectiveAllGather` node.
    gather: String,
    /// The variable it gathers, as the rank's forward graph named it before (its tp shard or a
    /// replicated weight): its flat shards are `{var}/shard_{d}_of_{D}`.
    var: String,
    /// The gathered value (the `FlatSlice` its readers read).
    value: String,
    /// A replicated weight (not a tensor-parallel shard).
    replicated: bool,
}

/// Makes rank `t`'s forward graph read its weights as ZeRO-3 training does: each weight the
/// rank's training graph (`training`) holds as flat shards over the data-parallel group
/// `dp_group(t)` becomes replica 0's shard, all-gathered over the group just before its first
/// reader (`zero::params::just_in_time`) and cut back by a `FlatSlice`, which the executor
/// drops after its last reader. On ranks `t > 0` the replicated weights are left as they are
/// ([`add_sharded_eval`] reads rank 0's gathered copy). The rank's tensor-parallel collectives
/// are chained first, so the gathers take their places between them alike on every rank; the
/// gathers are numbered from `rank.instance` in their topological order. Returns them in that
/// order.
pub(super) fn flat_gathers(
    rank: &mut RankForward,
    t: usize,
    zero: &Zero3,
    training: &dflow_graph::GraphDef,
) -> Result<Vec<FlatGather>, StrategyError> {
    use crate::strategy::zero::params::{just_in_time, shard_name};
    // The tensor-parallel collectives in one order, fixed before any gather joins the graph.
    let order = collective_order(&rank.def)?;
    for w in order.windows(2) {
        if let Some(n) = rank.def.nodes.iter_mut().find(|n| n.name == w[1]) {
            n.inputs.push(format!("^{}", w[0]));
        }
    }
    let sharded: HashSet<String> = rank.renames.values().cloned().collect();
    let held: HashMap<&str, &NodeDef> = training
        .nodes
        .iter()
        .filter(|n| n.op == "Variable")
        .map(|n| (n.name.as_str(), n))
        .collect();
    let mut taken: HashSet<String> = rank.def.nodes.iter().map(|n| n.name.clone()).collect();
    let group = super::dp_group(t);
    let device = worker_device("", "", t)?;
    let mut added: Vec<NodeDef> = Vec::new();
    let mut gathers: Vec<(String, Vec<String>)> = Vec::new();
    let mut vars: HashMap<String, (String, String, bool)> = HashMap::new();
    let variables: Vec<String> = rank
        .def
        .nodes
        .iter()
        .filter(|n| n.op == "Variable")
        .map(|n| n.name.clone())
        .collect();
    for var in variables {
        if t > 0 && !sharded.contains(&var) {
            continue;
        }
        let shard = shard_name(&var, 0, zero.dp);
        let Some(&held) = held.get(shard.as_str()) else {
            continue;
        };
        let Some(i) = rank.def.nodes.iter().position(|n| n.name == var) else {
            continue;
        };
        let dims = match rank.def.nodes[i].attrs.get("shape") {
            Some(AttrValue::Shape(s)) => s.as_static(),
            _ => None,
        }
        .ok_or_else(|| {
            super::bad(format!(
                "the evaluation gathers `{var}` per use and needs its static shape"
            ))
        })?;
        // The shard as the rank's training graph declares it.
        rank.def.nodes[i] = held.clone();
        let gather = fresh(&mut taken, &format!("zero/{var}/all_gather"));
        let mut g = crate::strategy::allreduce::node(
            &gather,
            "CollectiveAllGather",
            vec![shard.clone()],
            &device,
        );
        g.attrs = [
            ("group_key", AttrValue::String(group.as_str().into())),
            ("instance_key", AttrValue::Int(0)),
            ("group_size", AttrValue::Int(zero.dp as i64)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        added.push(g);
        let value = fresh(&mut taken, &format!("zero/{var}/value"));
        let mut s =
            crate::strategy::allreduce::node(&value, "FlatSlice", vec![gather.clone()], &device);
        s.attrs = [
            ("offset", AttrValue::Int(0)),
            ("shape", AttrValue::Shape(dflow_graph::Shape::known(&dims))),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        added.push(s);
        let mut readers = Vec::new();
        for n in rank.def.nodes.iter_mut() {
            let mut reads = false;
            for input in &mut n.inputs {
                match InputRef::parse(input) {
                    Ok(InputRef::Data { node, .. }) if node == var => {
                        input.clone_from(&value);
                        reads = true;
                    }
                    Ok(InputRef::Control(node)) if node == var => *input = format!("^{shard}"),
                    _ => {}
                }
            }
            if reads {
                readers.push(n.name.clone());
            }
        }
        for v in rank.renames.values_mut() {
            if *v == var {
                v.clone_from(&shard);
            }
        }
        vars.insert(
            gather.clone(),
            (var.clone(), value, !sharded.contains(&var)),
        );
        gathers.push((gather, readers));
    }
    rank.def.nodes.extend(added);
    just_in_time(&mut rank.def, &gathers);
    // Numbered in the order the rank runs them (the same on its data-parallel peers).
    let mut out = Vec::new();
    for name in collective_order(&rank.def)? {
        let Some((var, value, replicated)) = vars.remove(&name) else {
            continue;
        };
        if let Some(n) = rank.def.nodes.iter_mut().find(|n| n.name == name) {
            n.attrs
                .insert("instance_key".into(), AttrValue::Int(rank.instance));
            rank.instance += 1;
        }
        out.push(FlatGather {
            gather: name,
            var,
            value,
            replicated,
        });
    }
    Ok(out)
}

/// The other replicas' part in the evaluation's ZeRO-3 gathers: worker `t + T·d` (`d > 0`)
/// joins each gather of rank `t` (`gathers[t]`, evaluated as `copies[t]` names them, among
/// `added`) with its flat shard `{var}/shard_{d}_of_{D}`, in rank `t`'s order and at its
/// instance keys; each gathered value is read only by a `Size` that frees it, which the next
/// gather waits for, so a peer holds one gathered weight at a time. `waits` gets each peer's
/// last `Size` (rank 0's loss waits for it). Returns the nodes (the shard variables as the
/// peers' training graphs, `peers[w - 1]` of worker `w`, declare them).
fn peer_gathers(
    peers: &[ReplicaGraph],
    zero: &Zero3,
    gathers: &[Vec<FlatGather>],
    copies: &[HashMap<String, String>],
    added: &[NodeDef],
    taken: &mut HashSet<String>,
    waits: &mut Vec<String>,
) -> Result<Vec<NodeDef>, StrategyError> {
    use crate::strategy::allreduce::node;
    use crate::strategy::zero::params::shard_name;
    let key_of = |name: &str| {
        added
            .iter()
            .find(|n| n.name == name)
            .and_then(|n| n.attrs.get("instance_key").cloned())
    };
    let mut out = Vec::new();
    // What each peer must send before it joins each gather (an expert block, a shard piece).
    let needs = CrossTaskNeeds::new(added);
    for (t, list) in gathers.iter().enumerate() {
        let prefix = if t == 0 {
            "eval".to_string()
        } else {
            format!("eval/tp{t}")
        };
        for d in 1..zero.dp {
            let task = t + zero.tp * d;
            let device = worker_device("", "", task)?;
            let peer = task
                .checked_sub(1)
                .and_then(|i| peers.get(i))
                .ok_or_else(|| super::bad(format!("no training graph for worker {task}")))?;
            let mut last: Option<String> = None;
            for f in list {
                let shard = shard_name(&f.var, d, zero.dp);
                let var = peer
                    .training
                    .def
                    .nodes
                    .iter()
                    .find(|n| n.op == "Variable" && n.name == shard)
                    .ok_or_else(|| {
                        super::bad(format!("worker {task} holds no flat shard `{shard}`"))
                    })?;
                let key = copies
                    .get(t)
                    .and_then(|c| c.get(&f.gather))
                    .and_then(|c| key_of(c))
                    .ok_or_else(|| super::bad(format!("no evaluation copy of `{}`", f.gather)))?;
                taken.insert(shard.clone());
                out.push(var.clone());
                let name = fresh(taken, &format!("{prefix}/zero/{}/all_gather_d{d}", f.var));
                let mut g = node(&name, "CollectiveAllGather", vec![shard], &device);
                g.attrs = [
                    (
                        "group_key",
                        AttrValue::String(super::dp_group(t).as_str().into()),
                    ),
                    ("instance_key", key),
                    ("group_size", AttrValue::Int(zero.dp as i64)),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
                if let Some(before) = &last {
                    g.inputs.push(format!("^{before}"));
                }
                if let Some(copied) = copies.get(t).and_then(|c| c.get(&f.gather)) {
                    g.inputs
                        .extend(needs.of(copied, task).into_iter().map(|n| format!("^{n}")));
                }
                let done = fresh(taken, &format!("{prefix}/zero/{}/dropped_d{d}", f.var));
                out.push(g);
                out.push(node(&done, "Size", vec![name], &device));
                last = Some(done);
            }
            if let Some(done) = last {
                waits.push(format!("^{done}"));
            }
        }
    }
    Ok(out)
}

/// `placeholder` with its batch dimension set to `rows`; `None` when it is fixed at another
/// size or the shape is not known.
pub(crate) fn static_batch(placeholder: &NodeDef, rows: usize) -> Option<NodeDef> {
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

/// What a worker joining another worker's evaluation gathers must wait for before each join.
/// A worker blocks a compute thread in a collective until every member has joined it, and a
/// tensor it sends to another task leaves through a `Send` that may be queued behind that
/// collective; if the gatherer needs the tensor before it reaches the gather, both wait for
/// ever (with one compute thread). So the joining worker waits, before each join, for the
/// readers on other tasks of what it sends that the gather depends on: a zero-byte control
/// pair back, which arrives only once the tensor has.
pub(crate) struct CrossTaskNeeds {
    /// Each node's inputs (data and control) and task.
    nodes: HashMap<String, (Vec<String>, usize)>,
    /// Each node's readers (by data) on other tasks.
    remote_readers: HashMap<String, Vec<String>>,
}

impl CrossTaskNeeds {
    /// Over `nodes` (every node a gather may depend on, with its device).
    pub(crate) fn new<'a>(nodes: impl IntoIterator<Item = &'a NodeDef>) -> CrossTaskNeeds {
        let task = |device: &str| {
            dflow_graph::DeviceName::parse(device)
                .ok()
                .and_then(|d| d.task)
                .map_or(usize::MAX, |t| t as usize)
        };
        let mut all: HashMap<String, (Vec<String>, usize)> = HashMap::new();
        let mut data: Vec<(String, String)> = Vec::new();
        for n in nodes {
            let mut inputs = Vec::with_capacity(n.inputs.len());
            for i in &n.inputs {
                match InputRef::parse(i) {
                    Ok(InputRef::Data { node, .. }) => {
                        data.push((node.clone(), n.name.clone()));
                        inputs.push(node);
                    }
                    Ok(InputRef::Control(node)) => inputs.push(node),
                    Err(_) => {}
                }
            }
            all.insert(n.name.clone(), (inputs, task(&n.device)));
        }
        let mut remote_readers: HashMap<String, Vec<String>> = HashMap::new();
        for (from, reader) in data {
            let (Some((_, a)), Some((_, b))) = (all.get(&from), all.get(&reader)) else {
                continue;
            };
            if a != b {
                remote_readers.entry(from).or_default().push(reader);
            }
        }
        CrossTaskNeeds {
            nodes: all,
            remote_readers,
        }
    }

    /// The nodes on other tasks than `task` that `gather` depends on and that read a tensor
    /// of `task`'s.
    pub(crate) fn of(&self, gather: &str, task: usize) -> Vec<String> {
        let mut seen: HashSet<&str> = HashSet::new();
        let mut stack = vec![gather];
        while let Some(n) = stack.pop() {
            if !seen.insert(n) {
                continue;
            }
            if let Some((inputs, _)) = self.nodes.get(n) {
                stack.extend(inputs.iter().map(String::as_str));
            }
        }
        let mut out: Vec<String> = seen
            .iter()
            .filter(|n| self.nodes.get(**n).is_some_and(|(_, t)| *t == task))
            .filter_map(|n| self.remote_readers.get(*n))
            .flatten()
            .filter(|r| seen.contains(r.as_str()))
            .cloned()
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// Makes every collective of `nodes` (an evaluation across tasks, beside the graph's other
/// nodes `context`: the variables it reads) wait until the other
/// members have received what its task sends them that their own call of it depends on: the
/// member's call `B` of a collective whose call on task `A` is `G` (one group key and instance
/// key), and `G` waits (a zero-byte control pair back) for the readers on other tasks of `A`'s
/// tensors among `B`'s dependencies ([`CrossTaskNeeds`]). A task blocks a compute thread in a
/// collective until every member has joined it, and its `Send`s may be queued behind it on
/// that thread: without this, a rank waiting for the held-out batch, a replicated weight or
/// an MoE output from worker 0 before its call would hang with worker 0 blocked in its own
/// (with one compute thread per task).
pub(crate) fn sends_before_collectives(nodes: &mut [NodeDef], context: &[NodeDef]) {
    let task = |device: &str| {
        dflow_graph::DeviceName::parse(device)
            .ok()
            .and_then(|d| d.task)
            .map_or(usize::MAX, |t| t as usize)
    };
    // Each collective call: (group, instance) → [(node index, task)].
    let mut calls: HashMap<(String, i64), Vec<(usize, usize)>> = HashMap::new();
    for (i, n) in nodes.iter().enumerate() {
        if !n.op.starts_with("Collective") || n.op == "CollectiveTpCopy" {
            continue;
        }
        if let (Some(AttrValue::String(g)), Some(AttrValue::Int(k))) =
            (n.attrs.get("group_key"), n.attrs.get("instance_key"))
        {
            calls
                .entry((g.to_string(), *k))
                .or_default()
                .push((i, task(&n.device)));
        }
    }
    let needs = CrossTaskNeeds::new(nodes.iter().chain(context));
    let mut waits: Vec<(usize, Vec<String>)> = Vec::new();
    for members in calls.values() {
        for &(a, at) in members {
            let mut wait: Vec<String> = Vec::new();
            for &(b, bt) in members {
                if bt != at {
                    wait.extend(needs.of(&nodes[b].name, at));
                }
            }
            wait.sort();
            wait.dedup();
            if !wait.is_empty() {
                waits.push((a, wait));
            }
        }
    }
    for (a, wait) in waits {
        let n = &mut nodes[a];
        for w in wait {
            let control = format!("^{w}");
            if !n.inputs.contains(&control) {
                n.inputs.push(control);
            }
        }
    }
}
