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
//! ZeRO-3 they are flat shards over all `D` workers and are joined on worker 0 one at a time
//! as before (each holder's shard sent just before the weight's readers run), and an expert
//! shard that is itself flat-sharded over its expert-data-parallel group (`D > G`) is joined
//! the same way on its rank `j`, never on worker 0.

use super::{shard_name, shard_variable, zero, EvalCopy, FlatJoin, MoeLayer};
use crate::strategy::allreduce::{fresh, node, worker_device};
use crate::strategy::tensor::eval::{static_batch, EvalFeeds};
use crate::strategy::{ReplicaGraph, StrategyError};
use dflow_graph::train::TrainSpec;
use dflow_graph::{AttrValue, Graph, GraphDef, InputRef, NodeDef};
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
    // The dense weights: in place, or under ZeRO-3 joined on worker 0 from their flat shards.
    if copy.stage3 {
        for n in forward.nodes.iter().filter(|n| n.op == "Variable") {
            if experts.contains_key(n.name.as_str()) {
                continue;
            }
            let dims = dims_of(&n.name)?;
            let holders: Vec<usize> = (0..workers).collect();
            let join = FlatJoin {
                var: n,
                name: &n.name,
                dims: &dims,
                holders: &holders,
                device: &|w| (copy.shard_device)(&n.name, w),
            };
            let mut sent = Vec::new();
            let value = join.add(&mut taken, &mut added, &mut sent, &worker0)?;
            sends.push((value.clone(), sent));
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
    g0.graph = Graph::from_def(&g0.training.def).map_err(StrategyError::InvalidGraph)?;
    g0.eval.features.clone_from(&placeholders[0]);
    g0.eval.labels.clone_from(&placeholders[1]);
    g0.eval.loss = remap(&spec.loss, &[&map]);
    g0.eval.metrics = spec.metrics.iter().map(|m| remap(m, &[&map])).collect();
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::super::{expert_training_evaluating, moe_layers, ExpertLayout};
    use crate::strategy::ReplicaGraph;
    use dflow_graph::layers::{gpt, GptConfig, MoeConfig};
    use dflow_graph::{Graph, InputRef, NodeDef};
    use std::collections::{BTreeSet, HashMap, HashSet};

    /// A two-block GPT with 4-expert MoE MLPs, top-2, nothing dropped.
    fn moe_gpt() -> (Graph, dflow_graph::train::TrainSpec) {
        let cfg = GptConfig {
            vocab_size: 11,
            block_size: 4,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            moe: Some(MoeConfig {
                num_experts: 4,
                top_k: 2,
                capacity_factor: 4.0,
                ..MoeConfig::default()
            }),
            ..GptConfig::default()
        };
        let model = gpt(&cfg).unwrap();
        let spec = model.def.train.clone().unwrap();
        (Graph::from_def(&model.def).unwrap(), spec)
    }

    fn task_of(device: &str) -> usize {
        dflow_graph::DeviceName::parse(device)
            .ok()
            .and_then(|d| d.task)
            .map_or(usize::MAX, |t| t as usize)
    }

    /// Every tensor computed from weights alone (a variable, or an op all of whose data inputs
    /// are) that an evaluation node (`eval/...`) of `g` reads from another task: `(tensor,
    /// its task, the reader's task)`.
    fn weights_crossing_tasks(g: &ReplicaGraph) -> Vec<(String, usize, usize)> {
        let typed = &g.graph;
        let mut weighty: HashSet<String> = HashSet::new();
        for i in typed.topo_order() {
            let n = typed.node(i);
            let inputs = typed.inputs(i);
            if n.op_def().is_variable
                || (!inputs.is_empty()
                    && inputs
                        .iter()
                        .all(|(p, _)| weighty.contains(&typed.node(*p).name)))
            {
                weighty.insert(n.name.clone());
            }
        }
        let by_name: HashMap<&str, &NodeDef> = g
            .training
            .def
            .nodes
            .iter()
            .map(|n| (n.name.as_str(), n))
            .collect();
        let mut out = Vec::new();
        for n in g
            .training
            .def
            .nodes
            .iter()
            .filter(|n| n.name.starts_with("eval/"))
        {
            for i in &n.inputs {
                let Ok(InputRef::Data { node: p, .. }) = InputRef::parse(i) else {
                    continue;
                };
                let (from, to) = (task_of(&by_name[p.as_str()].device), task_of(&n.device));
                if weighty.contains(&p) && from != to {
                    out.push((p, from, to));
                }
            }
        }
        out
    }

    /// `dp=4,ep=2` with a known batch, ZeRO 0, 1 and 3: the evaluation runs worker 0's
    /// one-process forward graph with each MoE layer's expert ops on its ranks of expert group
    /// 0 (workers 0 and 1, each on its own shard), so no expert weight (nor a piece of one)
    /// reaches worker 0 from another worker, and without ZeRO-3 no weight crosses at all; under
    /// ZeRO-3 only flat shards cross, each to where its weight is used: a dense one to worker
    /// 0, an expert shard `j`'s to worker `j` (from its expert-data-parallel peer). The old
    /// evaluation (no static batch) joins expert shard 1 on worker 0: this fails on it.
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
        assert!(weights_crossing_tasks(&old[0])
            .iter()
            .any(|(p, from, to)| p.contains("experts") && *from == 1 && *to == 0));
        for zero in [None, Some(1), Some(3)] {
            let graphs = planned(zero, Some(8));
            let g0 = &graphs[0];
            let crossing = weights_crossing_tasks(g0);
            if zero != Some(3) {
                assert!(crossing.is_empty(), "{zero:?}: {crossing:?}");
            }
            for (p, from, to) in &crossing {
                assert!(p.contains("/shard_") && p.ends_with("/sent"), "{p}");
                if let Some(j) = (0..2).find(|j| p.contains(&format!("/shard_{j}/shard_"))) {
                    // An expert shard's flat piece, to the rank that holds the shard.
                    assert_eq!((*to, from % 2), (j, j), "{zero:?}: {p}");
                } else {
                    assert!(!p.contains("experts") && *to == 0, "{zero:?}: {p}");
                }
            }
            // Compute on workers 0 and 1 only; worker 1 runs each layer's experts on its shard.
            let eval: Vec<&NodeDef> = g0
                .training
                .def
                .nodes
                .iter()
                .filter(|n| n.name.starts_with("eval/"))
                .collect();
            let computing: BTreeSet<usize> = eval
                .iter()
                .filter(|n| !matches!(n.op.as_str(), "Identity" | "Variable"))
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
            // No collective: the experts' tokens go by Send/Recv.
            assert!(eval.iter().all(|n| !n.op.starts_with("Collective")));
        }
    }
}
