//! The held-out evaluation of `--mesh dp=D,tp=T,ep=E` with every weight at its training
//! place: tensor-parallel group 0 (workers `0..T`) runs its ranks' forward graphs on their
//! shards as `--mesh dp=D,tp=T` does ([`super::eval`]; under ZeRO-3 each rank gathering its
//! flat shards per use over `data_t<t>`, the other replicas joining), and each MoE layer —
//! replicated over tp in training — runs once, on rank 0, with its experts where their weights
//! are: worker 0 cuts the layer's dispatch buffer `[E', C, d]` (`E'` experts, `C` the
//! one-process capacity over the whole held-out batch) into `E` blocks (`Split`), sends block
//! `j` to the rank of tp coordinate 0 in replica `j` (worker `T·j`, holding expert shard `j`),
//! which runs the layer's expert ops on its shard and sends the result back; worker 0
//! concatenates the blocks for `MoeCombine`. The other tp ranks read rank 0's MoE output and
//! load-balancing loss (activations and a scalar) in place of their own copy of the layer. So
//! the loss is one process's, no expert weight leaves the replica holding it, and no weight is
//! joined whole on worker 0. Under ZeRO-3 with `D > E` an expert shard (flat-sharded over the
//! replicas holding it) is joined on worker `T·j` from those replicas' flat shards (their
//! receive slots there hold the expert shard whole, its ZeRO-0 share).

use super::eval::{self, EvalFeeds};
use super::{rank_forward, Gpt, RankAt, ShardedWeight};
use crate::mesh::Mesh;
use crate::strategy::allreduce::{node, worker_device};
use crate::strategy::expert::{self, MoeLayer};
use crate::strategy::zero::params;
use crate::strategy::{ReplicaGraph, StrategyError};
use dflow_graph::train::TrainSpec;
use dflow_graph::{AttrValue, GraphDef, InputRef, NodeDef, Shape};
use std::collections::{BTreeMap, HashMap, HashSet};

/// What the evaluation of one `dp × tp × ep` job is built from.
pub(super) struct ExpertEval<'a> {
    /// The one-process forward graph.
    pub forward: &'a GraphDef,
    /// Its GPT (MoE MLPs replicated over tp).
    pub gpt: &'a Gpt,
    /// The tensor-parallel layout.
    pub shards: &'a [ShardedWeight],
    /// The MoE layers.
    pub layers: &'a [MoeLayer],
    /// The mesh (`pp = 1`).
    pub mesh: &'a Mesh,
    /// ZeRO-3: every weight a flat shard over its data-parallel (or expert-data-parallel) group.
    pub zero3: bool,
    /// Data parallelism's fusion threshold (for the ranks' layout; the evaluation fuses none).
    pub bucket_bytes: usize,
}

/// Every node `from` depends on (data or control), `from` included.
fn ancestors(by_name: &HashMap<&str, &NodeDef>, from: &str) -> HashSet<String> {
    let mut seen = HashSet::new();
    let mut stack = vec![from.to_string()];
    while let Some(n) = stack.pop() {
        if !seen.insert(n.clone()) {
            continue;
        }
        if let Some(def) = by_name.get(n.as_str()) {
            stack.extend(def.inputs.iter().filter_map(|i| match InputRef::parse(i) {
                Ok(InputRef::Data { node, .. } | InputRef::Control(node)) => Some(node),
                Err(_) => None,
            }));
        }
    }
    seen
}

/// The data producer of `input` (`None` for a control input).
fn producer(input: &str) -> Option<String> {
    match InputRef::parse(input) {
        Ok(InputRef::Data { node, .. }) => Some(node),
        _ => None,
    }
}

/// The nodes of `def` that make its MoE layers' outputs (the combine and the load-balancing
/// loss, and what only they need), not what feeds the layers: what ranks `t > 0` read from
/// rank 0.
fn moe_nodes(def: &GraphDef, layers: &[MoeLayer]) -> HashSet<String> {
    let by_name: HashMap<&str, &NodeDef> = def.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let mut out = HashSet::new();
    for l in layers {
        let Some(input) = by_name
            .get(l.dispatch.as_str())
            .and_then(|d| d.inputs.first())
            .and_then(|i| producer(i))
        else {
            continue;
        };
        let before = ancestors(&by_name, &input);
        let mut made = ancestors(&by_name, &l.combine);
        let aux: Vec<String> = def
            .nodes
            .iter()
            .filter(|n| n.op == "MoeAuxLoss")
            .filter(|n| {
                n.inputs
                    .iter()
                    .filter_map(|i| producer(i))
                    .any(|p| made.contains(&p) && !before.contains(&p))
            })
            .map(|n| n.name.clone())
            .collect();
        for a in aux {
            made.extend(ancestors(&by_name, &a));
        }
        out.extend(made.into_iter().filter(|n| !before.contains(n)));
    }
    out
}

/// Rewrites rank 0's forward graph `def` so each MoE layer's experts run on the ranks of tp
/// coordinate 0 holding them (see the module docs): the dispatch buffer split into `E`
/// blocks, the layer's expert ops copied once per block onto worker `T·j` reading expert
/// shard `j` (joined there from its flat shards under ZeRO-3 with `D > E`), the blocks
/// concatenated for the combine. Returns the shard variables the graph of worker 0 lacks (to
/// add to it): each declared as its holder's training graph (`graphs`) declares it.
fn experts_on_their_ranks(
    def: &mut GraphDef,
    e: &ExpertEval<'_>,
    graphs: &[ReplicaGraph],
) -> Result<Vec<NodeDef>, StrategyError> {
    let (mesh, ep) = (e.mesh, e.mesh.ep);
    let worker0 = worker_device("", "", 0)?;
    let in_g0: HashSet<&str> = graphs
        .first()
        .map(|g| {
            g.training
                .def
                .nodes
                .iter()
                .map(|n| n.name.as_str())
                .collect()
        })
        .unwrap_or_default();
    let declared = |task: usize, name: &str| -> Result<NodeDef, StrategyError> {
        graphs
            .get(task)
            .and_then(|g| {
                g.training
                    .def
                    .nodes
                    .iter()
                    .find(|n| n.op == "Variable" && n.name == name)
            })
            .cloned()
            .ok_or_else(|| super::bad(format!("worker {task} holds no variable `{name}`")))
    };
    let mut missing = Vec::new();
    let mut added: Vec<NodeDef> = Vec::new();
    let mut dropped: HashSet<String> = HashSet::new();
    for l in e.layers {
        let per = l.experts / ep;
        let holders = mesh.dp / ep;
        let blocks = format!("{}/eval_blocks", l.dispatch);
        let mut split = node(&blocks, "Split", vec![l.dispatch.clone()], &worker0);
        split.attrs = BTreeMap::from([
            ("axis".to_string(), AttrValue::Int(0)),
            ("num_split".to_string(), AttrValue::Int(ep as i64)),
        ]);
        added.push(split);
        let out = def
            .nodes
            .iter()
            .find(|n| n.name == l.combine)
            .and_then(|c| c.inputs.first())
            .and_then(|i| producer(i))
            .ok_or_else(|| super::bad(format!("`{}` has no expert input", l.combine)))?;
        let mut outs = Vec::with_capacity(ep);
        for j in 0..ep {
            let task = mesh.rank(0, j, 0);
            let device = worker_device("", "", task)?;
            let mut local: HashMap<String, String> = HashMap::new();
            local.insert(
                l.dispatch.clone(),
                if j == 0 {
                    blocks.clone()
                } else {
                    format!("{blocks}:{j}")
                },
            );
            for var in &l.variables {
                let name = expert::shard_name(var, j);
                if e.zero3 && holders > 1 {
                    // Joined on the rank from the flat shards of the replicas holding it.
                    let mut pieces = Vec::with_capacity(holders);
                    for k in 0..holders {
                        let piece = params::shard_name(&name, k, holders);
                        let at = mesh.rank(0, j + ep * k, 0);
                        let v = declared(at, &piece)?;
                        if !in_g0.contains(piece.as_str()) {
                            missing.push(v.clone());
                        }
                        if at == task {
                            pieces.push(piece);
                        } else {
                            // Sent by an op of its holder, which joins the evaluation's gathers
                            // only once it has run (`eval::CrossTaskNeeds`).
                            let sent = format!("{piece}/eval_sent");
                            added.push(node(&sent, "Identity", vec![piece], &v.device));
                            pieces.push(sent);
                        }
                        added.push(v);
                    }
                    let rows = def
                        .nodes
                        .iter()
                        .find(|n| n.name == *var)
                        .and_then(|v| match v.attrs.get("shape") {
                            Some(AttrValue::Shape(s)) => s.as_static(),
                            _ => None,
                        })
                        .map(|mut d| {
                            d[0] = per;
                            d
                        })
                        .ok_or_else(|| super::bad(format!("`{var}` has no static shape")))?;
                    let flat = format!("{name}/eval_flat");
                    added.push(node(&flat, "PackFlat", pieces, &device));
                    let whole = format!("{name}/eval_joined");
                    let mut s = node(&whole, "FlatSlice", vec![flat], &device);
                    s.attrs = BTreeMap::from([
                        ("offset".to_string(), AttrValue::Int(0)),
                        ("shape".to_string(), AttrValue::Shape(Shape::known(&rows))),
                    ]);
                    added.push(s);
                    local.insert(var.clone(), whole);
                    continue;
                }
                let v = declared(task, &name)?;
                if !in_g0.contains(name.as_str()) {
                    missing.push(v.clone());
                }
                added.push(v);
                local.insert(var.clone(), name);
            }
            for x in &l.expert_nodes {
                local.insert(x.clone(), format!("{x}/ep{j}"));
            }
            let rename = |input: &str| match InputRef::parse(input) {
                Ok(InputRef::Data { node, index }) => match local.get(&node) {
                    Some(to) if index == 0 => to.clone(),
                    Some(to) => format!("{to}:{index}"),
                    None => input.to_string(),
                },
                Ok(InputRef::Control(node)) => match local.get(&node) {
                    Some(to) => format!("^{to}"),
                    None => input.to_string(),
                },
                Err(_) => input.to_string(),
            };
            for x in def
                .nodes
                .iter()
                .filter(|n| l.expert_nodes.contains(&n.name))
            {
                let mut c = x.clone();
                c.name = local[&x.name].clone();
                c.inputs = x.inputs.iter().map(|i| rename(i)).collect();
                c.device.clone_from(&device);
                c.colocate_with.clear();
                if c.op == "Reshape" {
                    if let Some(AttrValue::IntList(dims)) = c.attrs.get_mut("shape") {
                        if dims.first() == Some(&(l.experts as i64)) {
                            dims[0] = per as i64;
                        }
                    }
                }
                added.push(c);
            }
            outs.push(rename(&out));
        }
        let joined = format!("{}/eval_experts", l.combine);
        let mut c = node(&joined, "Concat", outs, &worker0);
        c.attrs = BTreeMap::from([("axis".to_string(), AttrValue::Int(0))]);
        added.push(c);
        if let Some(comb) = def.nodes.iter_mut().find(|n| n.name == l.combine) {
            comb.inputs[0] = joined;
        }
        dropped.extend(l.expert_nodes.iter().cloned());
        dropped.extend(l.variables.iter().cloned());
    }
    def.nodes.retain(|n| !dropped.contains(&n.name));
    def.nodes.extend(added);
    Ok(missing)
}

/// Points `graphs[0]`'s evaluation at tensor-parallel group 0's forward graphs with each MoE
/// layer on rank 0 and its experts on their ranks (see the module docs). Returns `false`,
/// changing nothing, when the batch cannot be made static.
pub(super) fn add_expert_eval(
    graphs: &mut [ReplicaGraph],
    e: &ExpertEval<'_>,
    spec: &TrainSpec,
    feeds: &EvalFeeds<'_>,
) -> Result<bool, StrategyError> {
    let mesh = e.mesh;
    let mut ranks = (0..mesh.tp)
        .map(|t| {
            let at = RankAt::on_mesh(mesh, t, e.bucket_bytes, None);
            let at = RankAt { data: None, ..at };
            rank_forward(
                e.forward,
                e.gpt,
                e.shards,
                spec,
                &at,
                feeds.features,
                feeds.labels,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let Some(first) = ranks.first_mut() else {
        return Ok(false);
    };
    let shared = moe_nodes(&first.def, e.layers);
    let missing = experts_on_their_ranks(&mut first.def, e, graphs)?;
    let zero = e.zero3.then_some(eval::Zero3 {
        dp: mesh.dp,
        tp: mesh.tp,
    });
    let mut gathers = Vec::new();
    if let Some(zero) = &zero {
        for (t, rank) in ranks.iter_mut().enumerate() {
            let training = &graphs[t].training.def;
            gathers.push(eval::flat_gathers(rank, t, zero, training)?);
        }
    }
    let base = eval::first_free_instance(graphs);
    let backup = graphs.first().cloned();
    if let Some(g0) = graphs.first_mut() {
        g0.training.def.nodes.extend(missing);
    }
    let zero = zero.as_ref().map(|z| (z, gathers.as_slice()));
    let done = eval::add_sharded_eval(graphs, &ranks, spec, feeds, base, zero, &shared)?;
    if !done {
        if let (Some(g0), Some(backup)) = (graphs.first_mut(), backup) {
            *g0 = backup;
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::super::experts::mesh_expert_training_evaluating;
    use crate::mesh::Mesh;
    use crate::strategy::test_support::{task_of, tiny_moe_gpt, weights_crossing_tasks};
    use dflow_graph::NodeDef;
    use std::collections::{BTreeSet, HashMap};

    /// `dp=2,tp=2,ep=2` (ZeRO 0, 1 and 3) and `dp=4,tp=2,ep=2` ZeRO-3 with a known batch:
    /// the evaluation runs on tp group 0 (workers 0 and 1) with each MoE layer's experts on the
    /// tp-0 ranks of the replicas holding them (workers 0 and 2), so no weight (nor a piece of
    /// one) reaches worker 0 from another worker but expert shard 0's flat half and no tp
    /// shard leaves its worker: what crosses is the replicated weights from worker 0 to rank 1
    /// (as `dp,tp` evaluates) and, under ZeRO-3 with `D > E`, an expert shard's flat halves to
    /// the rank holding that shard. Worker 0's old copy (no batch size) joins every shard
    /// there: this fails on it.
    #[test]
    fn evaluates_on_tp_group_0_with_experts_on_their_ranks_and_joins_nothing_on_worker_0() {
        let (graph, spec) = tiny_moe_gpt(|_| {});
        let planned = |dp, zero, rows| {
            let mesh = Mesh::new(dp, 2, 1).unwrap().with_ep(2).unwrap();
            mesh_expert_training_evaluating(
                &graph,
                &spec,
                &mesh,
                1 << 20,
                zero,
                ("idx", "targets"),
                rows,
            )
            .unwrap()
            .graphs
        };
        let into_worker_0 = |g: &crate::strategy::ReplicaGraph| {
            let device: HashMap<&str, &str> = g
                .training
                .def
                .nodes
                .iter()
                .map(|n| (n.name.as_str(), n.device.as_str()))
                .collect();
            weights_crossing_tasks(g)
                .into_iter()
                .filter(|(_, reader)| task_of(device[reader.as_str()]) == 0)
                .count()
        };
        assert!(into_worker_0(&planned(2, None, None)[0]) > 0);
        for (dp, zero) in [(2, None), (2, Some(1)), (2, Some(3)), (4, Some(3))] {
            let graphs = planned(dp, zero, Some(8));
            let g0 = &graphs[0];
            let by_name: HashMap<&str, &NodeDef> = g0
                .training
                .def
                .nodes
                .iter()
                .map(|n| (n.name.as_str(), n))
                .collect();
            for (p, reader) in weights_crossing_tasks(g0) {
                let (from, to) = (
                    task_of(&by_name[p.as_str()].device),
                    task_of(&by_name[reader.as_str()].device),
                );
                assert!(
                    !p.contains("/tp_"),
                    "{dp} {zero:?}: `{p}` leaves worker {from}"
                );
                if let Some(j) = (0..2).find(|j| p.contains(&format!("/shard_{j}/shard_"))) {
                    // A flat half of expert shard j, to its rank of tp coordinate 0 (worker 0
                    // holds shard 0: its other half comes from replica 2).
                    assert_eq!((dp, zero, to), (4, Some(3), 2 * j), "`{p}`");
                } else {
                    assert_ne!(to, 0, "{dp} {zero:?}: `{p}` reaches worker 0");
                    assert!(
                        from == 0 && to == 1 && !p.contains("experts"),
                        "{dp} {zero:?}: `{p}` from {from} to {to}"
                    );
                }
            }
            let eval: Vec<&NodeDef> = g0
                .training
                .def
                .nodes
                .iter()
                .filter(|n| n.name.starts_with("eval/"))
                .collect();
            // Every expert matmul on worker 0 or 2 (replicas 0 and 1 of tp coordinate 0).
            let experts: BTreeSet<usize> = eval
                .iter()
                .filter(|n| n.op == "BatchMatMul" && n.name.contains(".experts."))
                .map(|n| task_of(&n.device))
                .collect();
            assert_eq!(experts, BTreeSet::from([0, 2]), "{dp} {zero:?}");
            // Rank 1 runs no MoE layer of its own.
            assert!(!eval
                .iter()
                .any(|n| task_of(&n.device) == 1 && n.op.starts_with("Moe")));
            assert!(eval
                .iter()
                .all(|n| n.op != "Concat" || n.name.contains("/eval_experts")));
        }
    }
}
