//! Tensor parallelism from placements written by hand: `--strategy tensor --tp T` on a graph
//! whose nodes declare `_sharding` (any graph, the GPT included; a graph with none gets the
//! GPT's Megatron rewrite). [`crate::sharding::propagate`] derives every tensor's placement
//! and the collectives to insert; this module writes them into each rank's forward graph:
//!
//! - a variable declared `Shard(d)` becomes rank `r`'s `{name}/tp_{r}_of_{T}`, initialised as
//!   its slice of the one-process value (`shard_parts`), listed in [`JobPlan::sharded`]
//!   (through [`super::sharded_variables`]) so checkpoints hold whole tensors;
//! - `f` (`CollectiveTpCopy`), `g` (`CollectiveTpReduce`) and the all-gather (the rank's
//!   shard placed in zeros, `Concat`, then `g`) before the consumers that need them; a fetched
//!   tensor (the loss, a metric) that is not whole is renamed `{name}/tp_local` and `g` takes
//!   its name, so the job fetches the same names;
//! - then the training step by autodiff, clipping across the shards and the collectives
//!   chained, as the GPT rewrite does; evaluation runs on worker 0 on the assembled weights.
//!
//! One tensor-parallel group only: a data-parallel axis over hand-placed groups is refused.
//!
//! [`JobPlan::sharded`]: crate::job::JobPlan

use super::super::allreduce::{check_job, fresh, worker_device};
use super::{
    add_eval_copy, chain_collectives, clip_across_shards, options, prune, shard_name,
    shard_variable, Nodes, ShardedWeight, TensorGraphs, GROUP,
};
use crate::mesh::Mesh;
use crate::sharding::propagate::{propagate, Inserted, PlacementPlan};
use crate::strategy::{EvalNames, ReplicaFeeds, ReplicaGraph, StrategyError};
use dflow_graph::axis_split::AxisSplit;
use dflow_graph::train::{expand_training_graph, TrainSpec};
use dflow_graph::{AttrValue, Graph, GraphDef, InputRef, NodeDef};
use std::collections::HashMap;

pub use crate::sharding::propagate::declares_placements;

/// The tensors the job fetches: the loss and the metrics.
fn fetched(spec: &TrainSpec) -> Vec<String> {
    let mut f = vec![spec.loss.clone()];
    f.extend(spec.metrics.iter().cloned());
    f
}

/// The placements of `graph` over `tp` ranks (errors name the node).
pub fn plan(graph: &Graph, spec: &TrainSpec, tp: usize) -> Result<PlacementPlan, StrategyError> {
    propagate(graph, tp, &fetched(spec)).map_err(|e| options(format!("placements by hand: {e}")))
}

/// The sharded weights of `plan`, cut in `tp` equal parts.
fn weights(plan: &PlacementPlan) -> Vec<ShardedWeight> {
    plan.sharded
        .iter()
        .map(|s| ShardedWeight {
            name: s.name.clone(),
            dims: s.dims.clone(),
            split: AxisSplit {
                axis: s.axis,
                blocks: 1,
                parts: plan.tp,
                padded: s.dims[s.axis],
            },
        })
        .collect()
}

/// The training graphs of `graph` with hand placements on `mesh` (tensor axis only), one per
/// rank on worker task `r`.
pub(super) fn mesh_training(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    features: &str,
    labels: &str,
) -> Result<TensorGraphs, StrategyError> {
    if mesh.pp != 1 || mesh.dp != 1 {
        return Err(options(format!(
            "mesh {mesh}: a graph with placements written by hand (`_sharding`) runs on one \
             tensor-parallel group: use --tp equal to the worker count, with no dp or pp axis"
        )));
    }
    let tp = mesh.tp;
    check_job(graph, spec, tp, features, labels)?;
    let plan = plan(graph, spec, tp)?;
    let shards = weights(&plan);
    let forward = graph.to_def();
    let mut graphs = Vec::with_capacity(tp);
    for r in 0..tp {
        let mut g = rank_graph(&forward, &plan, &shards, spec, r, features, labels)?;
        if r == 0 {
            add_eval_copy(&mut g, &forward, &shards, spec, tp)?;
        }
        graphs.push(g);
    }
    Ok(TensorGraphs { graphs, shards })
}

/// Renames node `from` to `to` and every reference to it.
fn rename(nodes: &mut [NodeDef], from: &str, to: &str) {
    for d in nodes.iter_mut() {
        if d.name == from {
            d.name = to.to_string();
        }
        for i in &mut d.inputs {
            match InputRef::parse(i) {
                Ok(InputRef::Data { node, index }) if node == from => {
                    *i = if index == 0 {
                        to.to_string()
                    } else {
                        format!("{to}:{index}")
                    };
                }
                Ok(InputRef::Control(node)) if node == from => *i = format!("^{to}"),
                _ => {}
            }
        }
    }
}

fn rank_graph(
    forward: &GraphDef,
    plan: &PlacementPlan,
    shards: &[ShardedWeight],
    spec: &TrainSpec,
    r: usize,
    features: &str,
    labels: &str,
) -> Result<ReplicaGraph, StrategyError> {
    let tp = plan.tp;
    let device = worker_device("", "", r)?;
    let mut def = forward.clone();
    def.train = None;
    let mut n = Nodes {
        taken: def.nodes.iter().map(|x| x.name.clone()).collect(),
        added: Vec::new(),
        device: device.clone(),
        instance: 1,
        group: GROUP.to_string(),
    };
    // The shards, drawn as their part of the whole variable (renamed below).
    let mut renames: HashMap<String, String> = HashMap::new();
    for s in shards {
        let name = shard_name(&s.name, r, tp);
        if !n.taken.insert(name.clone()) {
            return Err(StrategyError::NameTaken {
                node: s.name.clone(),
                name,
            });
        }
        if let Some(v) = def.nodes.iter_mut().find(|x| x.name == s.name) {
            shard_variable(v, s, r);
        }
        renames.insert(s.name.clone(), name);
    }
    // The collectives, in the plan's order (the same on every rank).
    let mut moved: HashMap<String, String> = HashMap::new();
    // The conversions first, then each `f` on what its consumer's input reads by then (a
    // converted input that feeds a sharded op gets `f` after its `g`).
    let (converts, copies): (Vec<_>, Vec<_>) =
        plan.inserts.iter().partition(|i| i.kind != Inserted::Copy);
    for ins in converts {
        let (node, index) = match InputRef::parse(&ins.tensor) {
            Ok(InputRef::Data { node, index }) => (node, index),
            _ => {
                return Err(options(format!(
                    "tensor `{}` is not a data output",
                    ins.tensor
                )))
            }
        };
        let node = moved.get(&node).cloned().unwrap_or(node);
        let mut source = if index == 0 {
            node.clone()
        } else {
            format!("{node}:{index}")
        };
        if ins.fetched {
            // The collective takes the fetched name; the local value moves aside.
            let local = fresh(&mut n.taken, &format!("{node}/tp_local"));
            rename(&mut def.nodes, &node, &local);
            n.taken.remove(&node);
            moved.insert(node.clone(), local.clone());
            source = local;
        }
        let base = |what: &str| {
            if ins.fetched {
                node.clone()
            } else {
                format!("{node}/{what}")
            }
        };
        let out = match ins.kind {
            Inserted::Copy => continue,
            Inserted::Reduce => {
                n.collective(&base("tp_reduce"), "CollectiveTpReduce", source, false)
            }
            Inserted::Gather { dim } => {
                let zeros = n.add(
                    &format!("{node}/tp_zeros"),
                    "ZerosLike",
                    vec![source.clone()],
                    vec![],
                );
                let parts = (0..tp)
                    .map(|q| {
                        if q == r {
                            source.clone()
                        } else {
                            zeros.clone()
                        }
                    })
                    .collect();
                let placed = n.add(
                    &format!("{node}/tp_placed"),
                    "Concat",
                    parts,
                    vec![("axis", AttrValue::Int(dim as i64))],
                );
                n.collective(&base("tp_gather"), "CollectiveTpReduce", placed, false)
            }
        };
        for (consumer, slot) in &ins.consumers {
            let consumer = moved.get(consumer).unwrap_or(consumer);
            let c = def
                .nodes
                .iter_mut()
                .find(|x| &x.name == consumer)
                .ok_or_else(|| options(format!("no node `{consumer}` to rewire")))?;
            if let Some(i) = c.inputs.get_mut(*slot) {
                *i = out.clone();
            }
        }
    }
    let mut copied: HashMap<String, String> = HashMap::new();
    for ins in copies {
        for (consumer, slot) in &ins.consumers {
            let consumer = moved.get(consumer).unwrap_or(consumer);
            let c = def
                .nodes
                .iter_mut()
                .find(|x| &x.name == consumer)
                .ok_or_else(|| options(format!("no node `{consumer}` to rewire")))?;
            let Some(input) = c.inputs.get_mut(*slot) else {
                continue;
            };
            let f = match copied.get(input.as_str()) {
                Some(f) => f.clone(),
                None => {
                    let base = match InputRef::parse(input) {
                        Ok(InputRef::Data { node, .. }) => format!("{node}/tp_copy"),
                        _ => "tp_copy".to_string(),
                    };
                    let f = n.collective(&base, "CollectiveTpCopy", input.clone(), false);
                    copied.insert(input.clone(), f.clone());
                    f
                }
            };
            *input = f;
        }
    }
    def.nodes.extend(std::mem::take(&mut n.added));
    // Renamed shards; everything on the rank.
    for d in &mut def.nodes {
        if let Some(new) = renames.get(&d.name) {
            d.name = new.clone();
        }
        for i in &mut d.inputs {
            let (name, prefix, suffix) = match InputRef::parse(i) {
                Ok(InputRef::Data { node, index }) => {
                    let suffix = if index == 0 {
                        String::new()
                    } else {
                        format!(":{index}")
                    };
                    (node, "", suffix)
                }
                Ok(InputRef::Control(node)) => (node, "^", String::new()),
                Err(_) => continue,
            };
            if let Some(new) = renames.get(&name) {
                *i = format!("{prefix}{new}{suffix}");
            }
        }
        d.device = worker_device(&d.name, &d.device, r)?;
        d.colocate_with.clear();
    }
    let mut keep = fetched(spec);
    keep.push(features.to_string());
    keep.push(labels.to_string());
    prune(&mut def, &keep);
    // Clipping across the shards below (with no shard, the expansion's own clipping).
    let (mut training, _) = expand_training_graph(
        &def,
        &TrainSpec {
            clip_global_norm: spec.clip_global_norm.filter(|_| renames.is_empty()),
            ..spec.clone()
        },
    )?;
    let mut n = Nodes {
        taken: training.def.nodes.iter().map(|x| x.name.clone()).collect(),
        added: Vec::new(),
        device,
        instance: n.instance,
        group: GROUP.to_string(),
    };
    if let Some(clip) = spec.clip_global_norm.filter(|_| !renames.is_empty()) {
        clip_across_shards(&mut training, &mut n, &renames, clip);
    }
    training.def.nodes.extend(std::mem::take(&mut n.added));
    chain_collectives(&mut training)?;
    let graph = Graph::from_def(&training.def).map_err(StrategyError::InvalidGraph)?;
    Ok(ReplicaGraph {
        training,
        graph,
        replicas: vec![ReplicaFeeds {
            worker: 0,
            features: features.to_string(),
            labels: labels.to_string(),
            weight: None,
        }],
        eval: EvalNames {
            features: features.to_string(),
            labels: labels.to_string(),
            loss: spec.loss.clone(),
            metrics: spec.metrics.clone(),
        },
        step_metrics: Vec::new(),
    })
}

/// `dflow partition --strategy tensor`'s section for a graph with hand placements: every
/// tensor's placement on the tensor-parallel axis and every inserted collective with the bytes
/// each rank sends per step (ring all-reduce, `2(T−1)/T` of the tensor). `graph` has the batch
/// dimension filled in where known.
pub fn render(graph: &Graph, spec: &TrainSpec, tp: usize) -> Result<String, StrategyError> {
    use std::fmt::Write as _;
    let plan = plan(graph, spec, tp)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\ntensor parallelism by hand: tp={tp} over group `{GROUP}` (placements declared by \
         _sharding; docs/tensor-parallel.md)"
    );
    let _ = writeln!(out, "sharded variables:");
    for s in weights(&plan) {
        let _ = writeln!(
            out,
            "  {} {:?}: Shard({}); {:?} per rank",
            s.name,
            s.dims,
            s.split.axis,
            s.split.shard_dims(&s.dims)
        );
    }
    let _ = writeln!(out, "placements on the tp axis (every node's outputs):");
    for i in graph.node_indices() {
        let name = &graph.node(i).name;
        if let Some(p) = plan.placements.get(name) {
            let ty = graph
                .output_type(i, 0)
                .map_or_else(|| "no output".to_string(), |t| t.to_string());
            let _ = writeln!(out, "  {name} {ty}: {p}");
        }
    }
    let _ = writeln!(
        out,
        "collectives inserted (bytes each rank sends per step, ring):"
    );
    let (mut fwd, mut bwd) = (Some(0usize), Some(0usize));
    let add = |t: &mut Option<usize>, b: Option<usize>| {
        *t = t.zip(b).map(|(x, y)| x + y);
    };
    for ins in &plan.inserts {
        let (f, b) = ins.bytes_sent(tp);
        add(&mut fwd, f);
        add(&mut bwd, b);
        let mut readers: Vec<String> = ins
            .consumers
            .iter()
            .map(|(c, slot)| format!("{c}[{slot}]"))
            .collect();
        if ins.fetched {
            readers.push("fetched".into());
        }
        let show = |b: Option<usize>| {
            b.map_or_else(|| "? (give --batch-size)".into(), |b| format!("{b} B"))
        };
        let _ = writeln!(
            out,
            "  {} on {} → {}: {}; forward {}, backward {}",
            ins.op(),
            ins.tensor,
            readers.join(", "),
            ins.kind,
            show(f),
            show(b)
        );
    }
    let show = |b: Option<usize>| b.map_or_else(|| "?".to_string(), |b| b.to_string());
    let _ = writeln!(
        out,
        "bytes each rank sends per step: forward {} B, backward {} B (clipping's scalar not counted)",
        show(fwd),
        show(bwd)
    );
    Ok(out)
}
