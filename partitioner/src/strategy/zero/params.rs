//! ZeRO stage 3: the parameters themselves are sharded. Each trained variable `p` becomes the
//! rank's flat shard `p/shard_{r}_of_{N}` (`S = ⌈L/N⌉` elements, zero-padded, initialised as
//! its elements of the whole variable's seeded value), and every use of `p` reads a gathered
//! copy instead:
//!
//! - the forward pass's consumers read `zero/{p}/forward`, an all-gather of the shards cut back
//!   to `p`'s shape; the backward pass's consumers read a second gather, `zero/{p}/backward`;
//! - each gather waits (control edges) for the other inputs of its consumers that do not depend
//!   on it, so it runs just before its first use, not at the start of the step, and the
//!   executor drops the gathered tensor once its last consumer finished;
//! - all collectives of the step are then chained in one topological order of the graph (the
//!   same on every rank) and numbered in that order.
//!
//! Evaluation runs on worker 0 a copy of the forward graph, `eval/...`, whose parameters are
//! all-gathered just before their use as in training (every other rank joins the gathers with
//! its shard), so no task holds the whole model ([`add_eval_copy`]).

use super::{fresh, node, Param, StrategyError};
use crate::strategy::allreduce::worker_device;
use crate::strategy::zero::ShardGroup;
use crate::strategy::ReplicaGraph;
use dflow_graph::{AttrValue, Graph, GraphDef, InputRef, NodeDef, Shape};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The shard variable of parameter `var` on rank `rank` of `ranks`.
pub(crate) fn shard_name(var: &str, rank: usize, ranks: usize) -> String {
    format!("{var}/shard_{rank}_of_{ranks}")
}

/// `v` (the Variable node of `p`) made rank `rank`'s flat shard of it, renamed.
fn shard_variable(v: &mut NodeDef, p: &Param, rank: usize, ranks: usize) {
    v.name = shard_name(&p.var, rank, ranks);
    flat_shard(v, &p.var, &p.dims, rank, ranks);
}

/// Makes the Variable node `v` of parameter `var` (of dimensions `dims`) rank `rank`'s flat
/// shard of it over `ranks` ranks (`⌈len/N⌉` elements from element `rank·⌈len/N⌉`, zero-padded),
/// keeping its one-process initial value; its name is left to the caller. A variable that is
/// itself an axis-split shard (`shard_parts` > 0, a tensor-parallel shard) becomes the flat
/// shard of that shard, still drawn under the whole variable's name.
pub(crate) fn flat_shard(v: &mut NodeDef, var: &str, dims: &[usize], rank: usize, ranks: usize) {
    let size = dims.iter().product::<usize>().div_ceil(ranks).max(1);
    let split = matches!(v.attrs.get("shard_parts"), Some(AttrValue::Int(p)) if *p > 0);
    v.attrs
        .insert("shape".into(), AttrValue::Shape(Shape::known(&[size])));
    if !split {
        v.attrs
            .insert("shard_of".into(), AttrValue::Shape(Shape::known(dims)));
        v.attrs
            .insert("shard_name".into(), AttrValue::String(var.into()));
    }
    v.attrs
        .insert("shard_offset".into(), AttrValue::Int((rank * size) as i64));
    v.attrs.insert("shard_flat".into(), AttrValue::Bool(true));
}

/// The producer of a data input (`None` for a control input).
fn data_producer(input: &str) -> Option<String> {
    match InputRef::parse(input).ok()? {
        InputRef::Data { node, .. } => Some(node),
        InputRef::Control(_) => None,
    }
}

fn any_producer(input: &str) -> Option<String> {
    match InputRef::parse(input).ok()? {
        InputRef::Data { node, .. } | InputRef::Control(node) => Some(node),
    }
}

/// Replaces every trained variable of `def` (rank `group.rank` of `group.ranks`) by its shard
/// and its uses by gathered copies over `group.key` (see the module docs). `forward` names the
/// nodes of the forward pass; `update` ops read the shard itself. Backward nodes that `roots`
/// (the train op, the loss) do not need (the gradient of a fed input) are dropped first: their
/// gathers would run for nothing. The gathers' `instance_key` is 0: the caller numbers them.
pub(crate) fn shard_parameters(
    def: &mut GraphDef,
    params: &[Param],
    group: &ShardGroup,
    forward: &HashSet<String>,
    roots: &[&str],
) -> Result<(), StrategyError> {
    let pass = |n: &NodeDef| {
        if forward.contains(&n.name) {
            "forward".to_string()
        } else {
            "backward".to_string()
        }
    };
    shard_parameters_by(def, params, group, forward, roots, &pass)
}

/// [`shard_parameters`] with one gather per use `use_of` names: every reader `n` of a
/// parameter reads the gather `zero/{p}/{use_of(n)}` (`forward` and `backward` above; a
/// pipeline gathers once per micro-batch and pass). Each gather runs on its parameter's
/// device.
pub(crate) fn shard_parameters_by(
    def: &mut GraphDef,
    params: &[Param],
    group: &ShardGroup,
    forward: &HashSet<String>,
    roots: &[&str],
    use_of: &dyn Fn(&NodeDef) -> String,
) -> Result<(), StrategyError> {
    let (rank, ranks) = (group.rank, group.ranks);
    drop_dead_backward(def, forward, roots);
    let mut taken: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
    let mut added: Vec<NodeDef> = Vec::new();
    // (gather node, its consumers)
    let mut gathers: Vec<(String, Vec<String>)> = Vec::new();
    for p in params {
        let shard = shard_name(&p.var, rank, ranks);
        if taken.contains(&shard) {
            return Err(StrategyError::NameTaken {
                node: p.var.clone(),
                name: shard,
            });
        }
        taken.insert(shard.clone());
        let Some(v) = def.nodes.iter_mut().find(|n| n.name == p.var) else {
            return Err(StrategyError::UnknownTensor {
                role: "variable",
                name: p.var.clone(),
                message: "not in the training graph".into(),
            });
        };
        shard_variable(v, p, rank, ranks);
        let device = v.device.clone();
        // Who reads p, by use (forward, backward, ...), in the graph's order.
        let mut readers: Vec<(String, Vec<usize>)> = Vec::new();
        for (i, n) in def.nodes.iter_mut().enumerate() {
            for c in &mut n.colocate_with {
                if *c == p.var {
                    c.clone_from(&shard);
                }
            }
            let mut reads = false;
            for input in &mut n.inputs {
                match InputRef::parse(input) {
                    Ok(InputRef::Control(c)) if c == p.var => *input = format!("^{shard}"),
                    Ok(InputRef::Data { node, index }) if node == p.var => {
                        if n.name == p.update || index != 0 {
                            *input = shard.clone();
                        } else {
                            reads = true;
                        }
                    }
                    _ => {}
                }
            }
            if reads {
                let pass = use_of(n);
                match readers.iter_mut().find(|(u, _)| *u == pass) {
                    Some((_, who)) => who.push(i),
                    None => readers.push((pass, vec![i])),
                }
            }
        }
        for (pass, who) in readers {
            let gather = fresh(&mut taken, &format!("zero/{}/all_gather_{pass}", p.var));
            let mut g = node(&gather, "CollectiveAllGather", vec![shard.clone()], &device);
            g.attrs = BTreeMap::from([
                (
                    "group_key".to_string(),
                    AttrValue::String(group.key.as_str().into()),
                ),
                ("instance_key".to_string(), AttrValue::Int(0)),
                ("group_size".to_string(), AttrValue::Int(ranks as i64)),
            ]);
            added.push(g);
            let value = fresh(&mut taken, &format!("zero/{}/{pass}", p.var));
            let mut s = node(&value, "FlatSlice", vec![gather.clone()], &device);
            s.attrs = BTreeMap::from([
                ("offset".to_string(), AttrValue::Int(0)),
                ("shape".to_string(), AttrValue::Shape(Shape::known(&p.dims))),
            ]);
            added.push(s);
            let mut consumers = Vec::with_capacity(who.len());
            for i in who {
                let n = &mut def.nodes[i];
                for input in &mut n.inputs {
                    if matches!(InputRef::parse(input), Ok(InputRef::Data { node, index: 0 }) if node == p.var)
                    {
                        *input = value.clone();
                    }
                }
                consumers.push(n.name.clone());
            }
            gathers.push((gather, consumers));
        }
    }
    def.nodes.extend(added);
    just_in_time(def, &gathers);
    Ok(())
}

/// Removes the nodes outside the forward pass that `roots` do not depend on.
fn drop_dead_backward(def: &mut GraphDef, forward: &HashSet<String>, roots: &[&str]) {
    let inputs: HashMap<&str, &Vec<String>> = def
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), &n.inputs))
        .collect();
    let mut live: HashSet<String> = HashSet::new();
    let mut stack: Vec<String> = roots.iter().map(|r| r.to_string()).collect();
    while let Some(n) = stack.pop() {
        if !live.insert(n.clone()) {
            continue;
        }
        if let Some(ins) = inputs.get(n.as_str()) {
            stack.extend(ins.iter().filter_map(|i| any_producer(i)));
        }
    }
    def.nodes
        .retain(|n| live.contains(&n.name) || forward.contains(&n.name));
}

/// Makes each gather wait for the other inputs of its consumers that do not depend on it, so
/// that it runs just before its first use. Edges are added one gather at a time against the
/// graph with the edges already added, so no cycle can form. `gathers` may name any node (an
/// evaluation's send of a remote shard): `(node, the readers of what it feeds)`.
pub(crate) fn just_in_time(def: &mut GraphDef, gathers: &[(String, Vec<String>)]) {
    let index: HashMap<String, usize> = def
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.clone(), i))
        .collect();
    // successors[i]: the nodes reading node i (data or control).
    let mut successors: Vec<Vec<usize>> = vec![Vec::new(); def.nodes.len()];
    for (i, n) in def.nodes.iter().enumerate() {
        for input in &n.inputs {
            if let Some(&p) = any_producer(input).and_then(|p| index.get(&p)) {
                successors[p].push(i);
            }
        }
    }
    for (gather, consumers) in gathers {
        let Some(&g) = index.get(gather) else {
            continue;
        };
        // Everything downstream of the gather.
        let mut reach = vec![false; def.nodes.len()];
        let mut stack = vec![g];
        while let Some(i) = stack.pop() {
            if std::mem::replace(&mut reach[i], true) {
                continue;
            }
            stack.extend(successors[i].iter().copied());
        }
        let mut deps: Vec<usize> = Vec::new();
        for c in consumers {
            let Some(&c) = index.get(c) else { continue };
            for input in &def.nodes[c].inputs {
                if let Some(&p) = data_producer(input).and_then(|p| index.get(&p)) {
                    // Sources are ready at the start of the step anyway.
                    let is_source = matches!(
                        def.nodes[p].op.as_str(),
                        "Const" | "Variable" | "Placeholder"
                    );
                    if !reach[p] && !is_source && !deps.contains(&p) {
                        deps.push(p);
                    }
                }
            }
        }
        for p in deps {
            let name = format!("^{}", def.nodes[p].name);
            def.nodes[g].inputs.push(name);
            successors[p].push(g);
        }
    }
}

/// Chains every collective of `def` by control edges in one topological order of the graph
/// (the same on every rank: the ranks' graphs differ only in names and offsets) and numbers
/// them in that order.
pub(crate) fn order_collectives(def: &mut GraphDef) -> Result<(), StrategyError> {
    let graph = Graph::from_def(def).map_err(StrategyError::InvalidGraph)?;
    let chain: Vec<String> = graph
        .topo_order()
        .into_iter()
        .map(|i| graph.node(i))
        .filter(|n| n.op.starts_with("Collective"))
        .map(|n| n.name.clone())
        .collect();
    let position: HashMap<&str, usize> = chain
        .iter()
        .enumerate()
        .map(|(k, n)| (n.as_str(), k))
        .collect();
    for n in &mut def.nodes {
        let Some(&k) = position.get(n.name.as_str()) else {
            continue;
        };
        n.attrs
            .insert("instance_key".into(), AttrValue::Int(k as i64 + 1));
        if k > 0 {
            n.inputs.push(format!("^{}", chain[k - 1]));
        }
    }
    Ok(())
}

/// Adds to worker 0's graph a copy of the forward graph, `eval/<name>`, whose parameters are
/// all-gathered over `group` just before their use and dropped after (as in training), and
/// points evaluation at it: no task holds the whole model. Every other rank `r` joins each
/// gather with its shard (`eval/zero/{p}/all_gather_r{r}`, on worker `r`, read only by a `Size`
/// that frees it), chained in worker 0's order, one gathered weight at a time; worker 0's loss
/// waits for each rank's last, so the evaluation step runs them. The gathers' instance keys follow the training step's.
pub(super) fn add_eval_copy(
    g: &mut ReplicaGraph,
    forward: &GraphDef,
    params: &[Param],
    group: &ShardGroup,
) -> Result<(), StrategyError> {
    let ranks = group.ranks;
    let device = worker_device("", "", 0)?;
    let sharded: HashMap<&str, &Param> = params.iter().map(|p| (p.var.as_str(), p)).collect();
    let mut taken: HashSet<String> = g
        .training
        .def
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .collect();
    let first_instance = g
        .training
        .def
        .nodes
        .iter()
        .filter_map(|n| match n.attrs.get("instance_key") {
            Some(AttrValue::Int(k)) if n.op.starts_with("Collective") => Some(*k),
            _ => None,
        })
        .max()
        .map_or(1, |k| k + 1);
    let gather_node = |name: &str, shard: String, device: &str| {
        let mut n = node(name, "CollectiveAllGather", vec![shard], device);
        n.attrs = BTreeMap::from([
            (
                "group_key".to_string(),
                AttrValue::String(group.key.as_str().into()),
            ),
            ("instance_key".to_string(), AttrValue::Int(0)),
            ("group_size".to_string(), AttrValue::Int(ranks as i64)),
        ]);
        n
    };
    let mut map: HashMap<String, String> = HashMap::new();
    let mut added = Vec::new();
    // Worker 0's gathers, each with the parameter it gathers.
    let mut gathers: Vec<(String, &Param)> = Vec::new();
    for n in &forward.nodes {
        match n.op.as_str() {
            "Placeholder" => {}
            "Variable" => {
                let Some(p) = sharded.get(n.name.as_str()) else {
                    continue;
                };
                let gather = fresh(&mut taken, &format!("eval/zero/{}/all_gather", n.name));
                added.push(gather_node(&gather, shard_name(&p.var, 0, ranks), &device));
                let value = fresh(&mut taken, &format!("eval/{}", n.name));
                let mut s = node(&value, "FlatSlice", vec![gather.clone()], &device);
                s.attrs = BTreeMap::from([
                    ("offset".to_string(), AttrValue::Int(0)),
                    ("shape".to_string(), AttrValue::Shape(Shape::known(&p.dims))),
                ]);
                added.push(s);
                map.insert(n.name.clone(), value);
                gathers.push((gather, p));
            }
            _ => {
                let name = fresh(&mut taken, &format!("eval/{}", n.name));
                map.insert(n.name.clone(), name);
            }
        }
    }
    let remap = |input: &str| -> String {
        match InputRef::parse(input) {
            Ok(InputRef::Data { node, index }) => match map.get(&node) {
                Some(new) if index == 0 => new.clone(),
                Some(new) => format!("{new}:{index}"),
                None => input.to_string(),
            },
            Ok(InputRef::Control(node)) => match map.get(&node) {
                Some(new) => format!("^{new}"),
                None => input.to_string(),
            },
            Err(_) => input.to_string(),
        }
    };
    for n in &forward.nodes {
        if matches!(n.op.as_str(), "Placeholder" | "Variable") {
            continue;
        }
        let mut copy = n.clone();
        copy.name = remap(&n.name);
        copy.inputs = n.inputs.iter().map(|i| remap(i)).collect();
        copy.device = worker_device(&n.name, &n.device, 0)?;
        copy.colocate_with.clear();
        added.push(copy);
    }
    // Each gather just before its first use: it waits for its readers' other inputs.
    let mut eval = GraphDef {
        nodes: added,
        ..GraphDef::default()
    };
    let readers: Vec<(String, Vec<String>)> = gathers
        .iter()
        .map(|(gather, p)| {
            let value = &map[&p.var];
            let who = eval
                .nodes
                .iter()
                .filter(|n| {
                    n.inputs.iter().any(|i| {
                        matches!(InputRef::parse(i), Ok(InputRef::Data { node, .. }) if node == *value)
                    })
                })
                .map(|n| n.name.clone())
                .collect();
            (gather.clone(), who)
        })
        .collect();
    just_in_time(&mut eval, &readers);
    g.training.def.nodes.extend(eval.nodes);
    // Worker 0's gathers in its topological order; the other ranks gather in the same order.
    let typed = Graph::from_def(&g.training.def).map_err(StrategyError::InvalidGraph)?;
    let is_gather: HashMap<&str, &Param> = gathers.iter().map(|(n, p)| (n.as_str(), *p)).collect();
    let order: Vec<(String, &Param)> = typed
        .topo_order()
        .into_iter()
        .map(|i| typed.node(i).name.as_str())
        .filter_map(|n| is_gather.get(n).map(|p| (n.to_string(), *p)))
        .collect();
    // Per rank, its gathers in order, each with the node after which the next may start:
    // worker 0's next gather follows the previous gather (its readers free the value); another
    // rank's follows the `Size` that reads (and so frees) the previous gathered value, so that
    // rank holds one gathered weight at a time.
    let mut chains: Vec<Vec<(String, String)>> =
        vec![order.iter().map(|(n, _)| (n.clone(), n.clone())).collect()];
    for r in 1..ranks {
        let mut chain = Vec::with_capacity(order.len());
        for (_, p) in &order {
            let Some(v) = forward.nodes.iter().find(|n| n.name == p.var) else {
                continue;
            };
            let mut shard = v.clone();
            shard_variable(&mut shard, p, r, ranks);
            shard.device = worker_device(&v.name, &v.device, r)?;
            shard.colocate_with.clear();
            let name = fresh(&mut taken, &format!("eval/zero/{}/all_gather_r{r}", p.var));
            let done = fresh(&mut taken, &format!("eval/zero/{}/dropped_r{r}", p.var));
            let nodes = &mut g.training.def.nodes;
            nodes.push(gather_node(&name, shard.name.clone(), &shard.device));
            nodes.push(node(&done, "Size", vec![name.clone()], &shard.device));
            nodes.push(shard);
            chain.push((name, done));
        }
        chains.push(chain);
    }
    let position: HashMap<String, usize> = g
        .training
        .def
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.clone(), i))
        .collect();
    for chain in &chains {
        for (k, (name, _)) in chain.iter().enumerate() {
            let Some(&i) = position.get(name) else {
                continue;
            };
            let n = &mut g.training.def.nodes[i];
            n.attrs.insert(
                "instance_key".into(),
                AttrValue::Int(first_instance + k as i64),
            );
            if k > 0 {
                n.inputs.push(format!("^{}", chain[k - 1].1));
            }
        }
    }
    // Worker 0's loss waits for every other rank's last gathered value to be dropped.
    let loss = remap(&g.eval.loss);
    let loss_node = match InputRef::parse(&loss) {
        Ok(InputRef::Data { node, .. }) => node,
        _ => loss.clone(),
    };
    let waits: Vec<String> = chains
        .iter()
        .skip(1)
        .filter_map(|c| c.last().map(|(_, done)| format!("^{done}")))
        .collect();
    if let Some(&i) = position.get(&loss_node) {
        g.training.def.nodes[i].inputs.extend(waits);
    }
    g.graph = Graph::from_def(&g.training.def).map_err(StrategyError::InvalidGraph)?;
    g.eval.loss = loss;
    g.eval.metrics = g.eval.metrics.iter().map(|m| remap(m)).collect();
    Ok(())
}

/// Points the readers `is_eval` picks (an evaluation copy on `eval_device`, which runs no
/// collective) of every parameter in `params` (sharded over `group`) at the parameter joined
/// from every rank's shard: rank `q`'s shard variable, on `device_of(q)`, is added for every
/// rank but `group.rank` (whose shard is the parameter's own variable, renamed by
/// [`shard_parameters`] after this), and the shards are packed and cut back on
/// `eval_device`. Call it before [`shard_parameters`], while the variables are whole; returns
/// the names added.
pub(crate) fn join_for_eval(
    def: &mut GraphDef,
    params: &[Param],
    group: &ShardGroup,
    device_of: &dyn Fn(usize) -> Option<String>,
    eval_device: &str,
    is_eval: &dyn Fn(&NodeDef) -> bool,
) -> Result<Vec<String>, StrategyError> {
    let (rank, ranks) = (group.rank, group.ranks);
    let mut taken: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
    let mut added: Vec<NodeDef> = Vec::new();
    for p in params {
        let reads = |n: &NodeDef| {
            n.inputs.iter().any(|i| {
                matches!(InputRef::parse(i), Ok(InputRef::Data { node, index: 0 }) if node == p.var)
            })
        };
        if !def.nodes.iter().any(|n| is_eval(n) && reads(n)) {
            continue;
        }
        let Some(whole) = def.nodes.iter().find(|n| n.name == p.var).cloned() else {
            return Err(StrategyError::UnknownTensor {
                role: "variable",
                name: p.var.clone(),
                message: "not in the training graph".into(),
            });
        };
        let mut shards = Vec::with_capacity(ranks);
        for q in 0..ranks {
            let name = shard_name(&p.var, q, ranks);
            if q != rank {
                let mut v = whole.clone();
                shard_variable(&mut v, p, q, ranks);
                v.device = device_of(q).ok_or_else(|| StrategyError::UnknownTensor {
                    role: "variable",
                    name: name.clone(),
                    message: format!("no device for rank {q} of group `{}`", group.key),
                })?;
                v.colocate_with.clear();
                if !taken.insert(name.clone()) {
                    return Err(StrategyError::NameTaken {
                        node: p.var.clone(),
                        name,
                    });
                }
                added.push(v);
            }
            shards.push(name);
        }
        let joined = fresh(&mut taken, &format!("eval/{}/joined", p.var));
        added.push(node(&joined, "PackFlat", shards, eval_device));
        let value = fresh(&mut taken, &format!("eval/{}", p.var));
        let mut s = node(&value, "FlatSlice", vec![joined], eval_device);
        s.attrs = BTreeMap::from([
            ("offset".to_string(), AttrValue::Int(0)),
            ("shape".to_string(), AttrValue::Shape(Shape::known(&p.dims))),
        ]);
        added.push(s);
        for n in def.nodes.iter_mut().filter(|n| is_eval(n)) {
            for input in &mut n.inputs {
                if matches!(InputRef::parse(input), Ok(InputRef::Data { node, index: 0 }) if node == p.var)
                {
                    input.clone_from(&value);
                }
            }
        }
    }
    let names = added.iter().map(|n| n.name.clone()).collect();
    def.nodes.extend(added);
    Ok(names)
}
