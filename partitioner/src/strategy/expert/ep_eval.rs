//! The held-out evaluation beside `--mesh dp=D,ep=G` (and `--strategy expert`) with every
//! expert weight staying on its expert-parallel rank: the one-process forward graph on worker 0
//! (the whole held-out batch, through placeholders of a static batch), except that each MoE
//! layer's experts run where their weights are. Worker 0 cuts the layer's dispatch buffer
//! `[E, C, d]` (`C`: the one-process capacity over the whole batch) into `G` blocks of `E/G`
//! experts (`Split`), sends block `j` to rank `j` of expert-parallel group 0 (worker `j`),
//! which runs the layer's expert ops on its own shard `{v}/shard_{j}` and sends its
//! `[E/G, C, d]` back; worker 0 concatenates the blocks for `MoeCombine`. Each expert computes
//! exactly what it computes in one process (the same tokens, the same capacity), so the loss
//! is the one-process loss; no collective runs and only activations cross between workers.
//!
//! The dense weights are whole on every worker (ZeRO 0–2) and read in place on worker 0. Under
//! ZeRO-3 they are flat shards over all `D` workers: worker 0 all-gathers each just before its
//! first reader, as training's forward does, and drops it after its last, every other worker
//! joining the gathers in worker 0's order with its shard ([`PeerJoins`]). An expert shard
//! that is itself flat-sharded over its expert-data-parallel group (`D > G`) is joined on its
//! rank `j` from its holders' flat shards (sent just before its readers run; its receive
//! slots there hold the expert shard whole, its ZeRO-2 share), never on worker 0.

use super::{shard_name, shard_variable, zero, EvalCopy, FlatJoin, MoeLayer, GROUP};
use crate::strategy::allreduce::{fresh, node, worker_device};
use crate::strategy::tensor::eval::{static_batch, CrossTaskNeeds, EvalFeeds};
use crate::strategy::zero::params;
use crate::strategy::{ReplicaGraph, StrategyError};
use dflow_graph::train::TrainSpec;
use dflow_graph::{AttrValue, Graph, GraphDef, InputRef, NodeDef, Shape};
use std::collections::{BTreeMap, HashMap, HashSet};

/// `input` with its producer renamed by the first of `maps` that names it.
fn remap(input: &str, maps: &[&HashMap<String, String>]) -> String {
    let rename = |node: &str| maps.iter().find_map(|m| m.get(node));
    match InputRef::parse(input) {
        Ok(InputRef::Data { node, index }) => match rename(&node) {
            Some(to) if index == 0 => to.clone(),
            Some(to) => format!("{to}:{index}"),
            None => input.to_string(),
        },
        Ok(InputRef::Control(node)) => match rename(&node) {
            Some(to) => format!("^{to}"),
            None => input.to_string(),
        },
        Err(_) => input.to_string(),
    }
}

/// Points `graphs[0]`'s evaluation at the forward graph `forward` (validated as `graph`) run
/// on worker 0 with each MoE layer's experts on their ranks of expert-parallel group 0 (see
/// the module docs); `copy.layout` and `copy.stage3` say where the shards are, `feeds` names
/// the features and labels placeholders and the held-out batch's rows. Returns `false`,
/// changing nothing, when the batch cannot be made static (a placeholder's batch dimension
/// fixed at another size).
pub(crate) fn add_ep_eval(
    graphs: &mut [ReplicaGraph],
    graph: &Graph,
    forward: &GraphDef,
    layers: &[MoeLayer],
    spec: &TrainSpec,
    copy: &EvalCopy<'_>,
    feeds: &EvalFeeds<'_>,
) -> Result<bool, StrategyError> {
    let rows = feeds.rows;
    // Evaluation's collectives number from past every training key.
    let base = graphs
        .iter()
        .map(|g| super::pipeline::max_instance(&g.training.def))
        .max()
        .unwrap_or(0)
        + 1;
    let Some((g0, peers)) = graphs.split_first_mut() else {
        return Ok(false);
    };
    let (workers, ep) = (copy.layout.workers(), copy.layout.ep());
    let worker0 = worker_device("", "", 0)?;
    let mut taken: HashSet<String> = g0
        .training
        .def
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .collect();
    let mut map: HashMap<String, String> = HashMap::new();
    let mut added: Vec<NodeDef> = Vec::new();
    // The held-out batch on worker 0, of a static batch (the blocks crossing have static sizes).
    let mut placeholders = Vec::new();
    for name in [feeds.features, feeds.labels] {
        let Some(p) = forward.nodes.iter().find(|n| n.name == name) else {
            return Ok(false);
        };
        let Some(mut p) = static_batch(p, rows) else {
            return Ok(false);
        };
        p.name = fresh(&mut taken, &format!("eval/{name}"));
        p.device.clone_from(&worker0);
        p.colocate_with.clear();
        map.insert(name.to_string(), p.name.clone());
        placeholders.push(p.name.clone());
        added.push(p);
    }
    let experts: HashMap<&str, &MoeLayer> = layers
        .iter()
        .flat_map(|l| l.variables.iter().map(move |v| (v.as_str(), l)))
        .collect();
    let expert_nodes: HashSet<&str> = layers
        .iter()
        .flat_map(|l| l.expert_nodes.iter().map(String::as_str))
        .collect();
    // Each remote shard's send under ZeRO-3, with the value it joins into.
    let mut sends: Vec<(String, Vec<String>)> = Vec::new();
    let dims_of = |name: &str| {
        graph
            .find(name)
            .and_then(|i| graph.output_type(i, 0))
            .and_then(|t| t.shape.as_static())
            .ok_or_else(|| super::not_moe(name, "the variable's shape is not static".into()))
    };
    // The dense weights: in place, or under ZeRO-3 all-gathered per use on worker 0 (every
    // other worker joining the gathers: `peer_joins`).
    let mut dense: Vec<(String, String)> = Vec::new();
    if copy.stage3 {
        for n in forward.nodes.iter().filter(|n| n.op == "Variable") {
            if experts.contains_key(n.name.as_str()) {
                continue;
            }
            let dims = dims_of(&n.name)?;
            let gather = fresh(&mut taken, &format!("eval/zero/{}/all_gather", n.name));
            let shard = params::shard_name(&n.name, 0, workers);
            added.push(gather_node(&gather, shard, &worker0, workers));
            let value = fresh(&mut taken, &format!("eval/{}", n.name));
            let mut s = node(&value, "FlatSlice", vec![gather.clone()], &worker0);
            s.attrs = BTreeMap::from([
                ("offset".to_string(), AttrValue::Int(0)),
                ("shape".to_string(), AttrValue::Shape(Shape::known(&dims))),
            ]);
            added.push(s);
            // Just in time: the gather waits for its readers' other inputs.
            sends.push((value.clone(), vec![gather.clone()]));
            dense.push((gather, n.name.clone()));
            map.insert(n.name.clone(), value);
        }
    }
    // Every other node on worker 0 under `eval/...` (the experts' nodes get one copy per rank).
    for n in &forward.nodes {
        if matches!(n.op.as_str(), "Variable" | "Placeholder") || expert_nodes.contains(&*n.name) {
            continue;
        }
        let name = fresh(&mut taken, &format!("eval/{}", n.name));
        map.insert(n.name.clone(), name);
    }
    // Per layer: the dispatch buffer's blocks, each rank's experts, the blocks joined back.
    for l in layers {
        let per = l.experts / ep;
        let Some(dispatch) = map.get(&l.dispatch).cloned() else {
            continue;
        };
        let blocks = fresh(&mut taken, &format!("{dispatch}/blocks"));
        let mut split = node(&blocks, "Split", vec![dispatch], &worker0);
        split.attrs = BTreeMap::from([
            ("axis".to_string(), AttrValue::Int(0)),
            ("num_split".to_string(), AttrValue::Int(ep as i64)),
        ]);
        added.push(split);
        let out = forward
            .nodes
            .iter()
            .find(|n| n.name == l.combine)
            .and_then(|c| c.inputs.first())
            .and_then(|i| match InputRef::parse(i) {
                Ok(InputRef::Data { node, .. }) => Some(node),
                _ => None,
            })
            .ok_or_else(|| super::not_moe(&l.combine, "MoeCombine has no expert input".into()))?;
        let mut outs = Vec::with_capacity(ep);
        for j in 0..ep {
            let device = worker_device("", "", j)?;
            let mut local: HashMap<String, String> = HashMap::new();
            local.insert(
                l.dispatch.clone(),
                if j == 0 {
                    blocks.clone()
                } else {
                    format!("{blocks}:{j}")
                },
            );
            // The rank's expert shards, where they are (joined on the rank under ZeRO-3 when
            // its expert-data-parallel group shares them).
            for var in &l.variables {
                let whole = forward
                    .nodes
                    .iter()
                    .find(|n| n.name == *var)
                    .ok_or_else(|| super::not_moe(var, "not in the forward graph".into()))?;
                let name = shard_name(var, j);
                let mut v = whole.clone();
                shard_variable(&mut v, j, per as i64)?;
                v.name.clone_from(&name);
                v.device = (copy.shard_device)(var, j)?;
                v.colocate_with.clear();
                if copy.stage3 && workers > ep {
                    zero::as_row_split(&mut v, ep, j);
                    let mut rows = dims_of(var)?;
                    rows[0] = per;
                    let holders: Vec<usize> = (j..workers).step_by(ep).collect();
                    let join = FlatJoin {
                        var: &v,
                        name: &name,
                        dims: &rows,
                        holders: &holders,
                        device: &|w| (copy.shard_device)(var, w),
                    };
                    let mut sent = Vec::new();
                    let value = join.add(&mut taken, &mut added, &mut sent, &v.device)?;
                    sends.push((value.clone(), sent));
                    local.insert(var.clone(), value);
                    continue;
                }
                if j > 0 {
                    // Declared as the rank's training graph declares it.
                    let held = peers
                        .get(j - 1)
                        .and_then(|p| p.training.def.nodes.iter().find(|n| n.name == name))
                        .cloned()
                        .unwrap_or(v);
                    taken.insert(name.clone());
                    added.push(held);
                }
                local.insert(var.clone(), name);
            }
            for x in &l.expert_nodes {
                let to = fresh(&mut taken, &format!("eval/ep{j}/{x}"));
                local.insert(x.clone(), to);
            }
            for x in forward
                .nodes
                .iter()
                .filter(|n| l.expert_nodes.contains(&n.name))
            {
                let mut c = x.clone();
                c.name = local[&x.name].clone();
                c.inputs = x.inputs.iter().map(|i| remap(i, &[&local, &map])).collect();
                c.device.clone_from(&device);
                c.colocate_with.clear();
                // Reshapes naming E see the rank's E/G.
                if c.op == "Reshape" {
                    if let Some(AttrValue::IntList(dims)) = c.attrs.get_mut("shape") {
                        if dims.first() == Some(&(l.experts as i64)) {
                            dims[0] = per as i64;
                        }
                    }
                }
                added.push(c);
            }
            outs.push(remap(&out, &[&local]));
        }
        let joined = fresh(&mut taken, &format!("eval/{}/experts", l.combine));
        let mut c = node(&joined, "Concat", outs, &worker0);
        c.attrs = BTreeMap::from([("axis".to_string(), AttrValue::Int(0))]);
        added.push(c);
        map.insert(out, joined);
    }
    for n in &forward.nodes {
        if matches!(n.op.as_str(), "Variable" | "Placeholder") || expert_nodes.contains(&*n.name) {
            continue;
        }
        let mut c = n.clone();
        c.name = map[&n.name].clone();
        c.inputs = n.inputs.iter().map(|i| remap(i, &[&map])).collect();
        c.device.clone_from(&worker0);
        c.colocate_with.clear();
        added.push(c);
    }
    // Each remote shard leaves its holder just before the readers of its value run.
    let mut eval = GraphDef {
        nodes: added,
        ..GraphDef::default()
    };
    let reads = |value: &str, n: &NodeDef| {
        n.inputs
            .iter()
            .any(|i| matches!(InputRef::parse(i), Ok(InputRef::Data { node, .. }) if node == value))
    };
    let mut readers: Vec<(String, Vec<String>)> = Vec::new();
    for (value, sent) in &sends {
        let who: Vec<String> = eval
            .nodes
            .iter()
            .filter(|n| reads(value, n))
            .map(|n| n.name.clone())
            .collect();
        readers.extend(sent.iter().map(|s| (s.clone(), who.clone())));
    }
    crate::strategy::zero::params::just_in_time(&mut eval, &readers);
    g0.training.def.nodes.extend(eval.nodes);
    let loss = remap(&spec.loss, &[&map]);
    if !dense.is_empty() {
        let joins = PeerJoins {
            dense: &dense,
            workers,
            base,
        };
        joins.add(g0, peers, &loss, &mut taken)?;
        crate::strategy::tensor::eval::sends_before_collectives(&mut g0.training.def.nodes, &[]);
    }
    g0.graph = Graph::from_def(&g0.training.def).map_err(StrategyError::InvalidGraph)?;
    g0.eval.features.clone_from(&placeholders[0]);
    g0.eval.labels.clone_from(&placeholders[1]);
    g0.eval.loss = loss;
    g0.eval.metrics = spec.metrics.iter().map(|m| remap(m, &[&map])).collect();
    Ok(true)
}

/// A ZeRO-3 gather of `shard` over every worker ([`GROUP`]), numbered later.
fn gather_node(name: &str, shard: String, device: &str, workers: usize) -> NodeDef {
    let mut g = node(name, "CollectiveAllGather", vec![shard], device);
    g.attrs = BTreeMap::from([
        ("group_key".to_string(), AttrValue::String(GROUP.into())),
        ("instance_key".to_string(), AttrValue::Int(0)),
        ("group_size".to_string(), AttrValue::Int(workers as i64)),
    ]);
    g
}

/// Under ZeRO-3, the other workers' part in worker 0's per-use gathers of the dense weights.
struct PeerJoins<'a> {
    /// Worker 0's gathers in the evaluation, each with the weight it gathers.
    dense: &'a [(String, String)],
    /// The workers (every gather's group).
    workers: usize,
    /// The first instance key past the training step's.
    base: i64,
}

impl PeerJoins<'_> {
    /// Chains worker 0's gathers (already in `g0`) in its topological order, numbered from
    /// `base`, and adds every other worker's joins in that order: its flat shard (declared as
    /// its training graph, `peers[w - 1]`, declares it), the gather, a `Size` that frees the
    /// gathered value, which the next join waits for (one gathered weight at a time). A worker
    /// joins a gather only after sending what worker 0 needs before that gather (an expert
    /// block, a flat piece of an expert shard: [`CrossTaskNeeds`]), so it never waits in a
    /// gather while worker 0 waits for it. `loss` (worker 0's) waits for every worker's last
    /// join.
    fn add(
        &self,
        g0: &mut ReplicaGraph,
        peers: &[ReplicaGraph],
        loss: &str,
        taken: &mut HashSet<String>,
    ) -> Result<(), StrategyError> {
        let typed = Graph::from_def(&g0.training.def).map_err(StrategyError::InvalidGraph)?;
        let var_of: HashMap<&str, &str> = self
            .dense
            .iter()
            .map(|(g, v)| (g.as_str(), v.as_str()))
            .collect();
        let order: Vec<(String, String)> = typed
            .topo_order()
            .into_iter()
            .map(|i| typed.node(i).name.as_str())
            .filter_map(|n| var_of.get(n).map(|v| (n.to_string(), v.to_string())))
            .collect();
        let position: HashMap<String, usize> = g0
            .training
            .def
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.clone(), i))
            .collect();
        for (k, (gather, _)) in order.iter().enumerate() {
            let n = &mut g0.training.def.nodes[position[gather]];
            n.attrs
                .insert("instance_key".into(), AttrValue::Int(self.base + k as i64));
            if k > 0 {
                n.inputs.push(format!("^{}", order[k - 1].0));
            }
        }
        // What each worker must send before it joins each of worker 0's gathers.
        let needs = CrossTaskNeeds::new(&g0.training.def.nodes);
        let mut added = Vec::new();
        let mut waits = Vec::new();
        for w in 1..self.workers {
            let device = worker_device("", "", w)?;
            let peer = peers
                .get(w - 1)
                .ok_or_else(|| super::options(format!("no training graph for worker {w}")))?;
            let mut last: Option<String> = None;
            for (k, (_, var)) in order.iter().enumerate() {
                let shard = params::shard_name(var, w, self.workers);
                let v = peer
                    .training
                    .def
                    .nodes
                    .iter()
                    .find(|n| n.op == "Variable" && n.name == shard)
                    .ok_or_else(|| {
                        super::options(format!("worker {w} holds no flat shard `{shard}`"))
                    })?;
                taken.insert(shard.clone());
                added.push(v.clone());
                let name = fresh(taken, &format!("eval/zero/{var}/all_gather_r{w}"));
                let mut g = gather_node(&name, shard, &device, self.workers);
                g.attrs
                    .insert("instance_key".into(), AttrValue::Int(self.base + k as i64));
                if let Some(before) = &last {
                    g.inputs.push(format!("^{before}"));
                }
                let gather = &order[k].0;
                g.inputs
                    .extend(needs.of(gather, w).into_iter().map(|n| format!("^{n}")));
                let done = fresh(taken, &format!("eval/zero/{var}/dropped_r{w}"));
                added.push(g);
                added.push(node(&done, "Size", vec![name], &device));
                last = Some(done);
            }
            waits.extend(last.map(|d| format!("^{d}")));
        }
        let loss_node = match InputRef::parse(loss) {
            Ok(InputRef::Data { node, .. }) => node,
            _ => loss.to_string(),
        };
        if let Some(&i) = position.get(&loss_node) {
            g0.training.def.nodes[i].inputs.extend(waits);
        }
        g0.training.def.nodes.extend(added);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{expert_training_evaluating, moe_layers, ExpertLayout};
    use crate::strategy::test_support::{task_of, tiny_moe_gpt, weights_crossing_between_tasks};
    use dflow_graph::{AttrValue, Graph, NodeDef};
    use std::collections::{BTreeMap, BTreeSet, HashMap};

    /// A two-block GPT with 4-expert MoE MLPs, top-2, nothing dropped.
    fn moe_gpt() -> (Graph, dflow_graph::train::TrainSpec) {
        tiny_moe_gpt(|_| {})
    }

    /// `dp=4,ep=2` with a known batch, ZeRO 0, 1 and 3: the evaluation runs worker 0's
    /// one-process forward graph with each MoE layer's expert ops on its ranks of expert group
    /// 0 (workers 0 and 1, each on its own shard), so no weight (nor a piece of one) reaches
    /// worker 0 from another worker, and without ZeRO-3 no weight crosses at all; under ZeRO-3
    /// the dense weights are all-gathered per use on worker 0 (every worker joining, at the
    /// same keys) and only an expert shard `j`'s flat piece crosses, to worker `j` (from its
    /// expert-data-parallel peer). The old evaluation (no static batch) joins expert shard 1
    /// on worker 0: this fails on it.
    #[test]
    fn dp4_ep2_evaluates_each_experts_on_its_rank_and_joins_no_expert_weight_on_worker_0() {
        let (graph, spec) = moe_gpt();
        let layout = ExpertLayout::new(4, 2).unwrap();
        let layers = moe_layers(&graph, &graph.to_def()).unwrap();
        let planned = |zero, rows| {
            expert_training_evaluating(
                &graph,
                &spec,
                layout,
                ("idx", "targets"),
                1 << 20,
                zero,
                rows,
            )
            .unwrap()
        };
        let old = planned(None, None);
        assert!(weights_crossing_between_tasks(&old[0])
            .iter()
            .any(|(p, from, to)| p.contains("experts") && *from == 1 && *to == 0));
        for zero in [None, Some(1), Some(3)] {
            let graphs = planned(zero, Some(8));
            let g0 = &graphs[0];
            let crossing = weights_crossing_between_tasks(g0);
            if zero != Some(3) {
                assert!(crossing.is_empty(), "{zero:?}: {crossing:?}");
            }
            // Under ZeRO-3 only an expert shard's flat piece crosses, to the rank holding
            // that shard (the dense weights are gathered per use, not joined).
            for (p, from, to) in &crossing {
                assert!(p.contains("/shard_") && p.ends_with("/sent"), "{p}");
                let j = (0..2)
                    .find(|j| p.contains(&format!("/shard_{j}/shard_")))
                    .unwrap_or_else(|| panic!("{zero:?}: `{p}` crosses"));
                assert_eq!((*to, from % 2), (j, j), "{zero:?}: {p}");
            }
            // Compute on workers 0 and 1 only (the others only join gathers); worker 1 runs each
            // layer's experts on its shard.
            let eval: Vec<&NodeDef> = g0
                .training
                .def
                .nodes
                .iter()
                .filter(|n| n.name.starts_with("eval/"))
                .collect();
            let computing: BTreeSet<usize> = eval
                .iter()
                .filter(|n| {
                    !matches!(
                        n.op.as_str(),
                        "Identity" | "Variable" | "CollectiveAllGather" | "Size"
                    )
                })
                .map(|n| task_of(&n.device))
                .collect();
            assert_eq!(computing, BTreeSet::from([0, 1]), "{zero:?}");
            let by_name: HashMap<&str, &&NodeDef> =
                eval.iter().map(|n| (n.name.as_str(), n)).collect();
            for l in &layers {
                let matmuls = l.expert_nodes.iter().filter(|x| x.ends_with("/matmul"));
                for (x, j) in matmuls.flat_map(|x| [(x, 0), (x, 1)]) {
                    let copy = by_name[format!("eval/ep{j}/{x}").as_str()];
                    assert_eq!(task_of(&copy.device), j, "{zero:?}: {x}");
                }
            }
            // The experts' tokens go by Send/Recv; the only collectives are ZeRO-3's gathers of
            // the dense weights, joined by every worker at the same keys.
            let mut keys: BTreeMap<usize, Vec<AttrValue>> = BTreeMap::new();
            for n in eval.iter().filter(|n| n.op.starts_with("Collective")) {
                assert_eq!((n.op.as_str(), zero), ("CollectiveAllGather", Some(3)));
                assert!(!n.name.contains("experts"), "{}", n.name);
                keys.entry(task_of(&n.device))
                    .or_default()
                    .push(n.attrs["instance_key"].clone());
            }
            if zero == Some(3) {
                // Worker 1 joins the gathers after layer 0's MoE only once worker 0 has its
                // expert block (a control pair back from worker 0's concatenation), so it
                // never blocks in a gather before its block's `Send` has run.
                let join = eval
                    .iter()
                    .find(|n| n.name == "eval/zero/transformer.ln_f.bias/all_gather_r1")
                    .unwrap();
                assert!(
                    join.inputs
                        .iter()
                        .any(|i| i.starts_with('^')
                            && i.contains("transformer.h.0.mlp/combine/experts")),
                    "{:?}",
                    join.inputs
                );
                assert_eq!(keys.len(), 4);
                let mut sorted: Vec<Vec<AttrValue>> = keys.into_values().collect();
                for k in &mut sorted {
                    k.sort_by_key(|v| match v {
                        AttrValue::Int(i) => *i,
                        _ => 0,
                    });
                }
                assert!(sorted.windows(2).all(|w| w[0] == w[1]));
            }
        }
    }
}
