//! Tensor parallelism from placements written by hand: `--strategy tensor --tp T` on a graph
//! whose nodes declare `_sharding` (any graph, the GPT included; a graph with none gets the
//! GPT's Megatron rewrite). [`crate::sharding::propagate`] derives every tensor's placement
//! and the collectives to insert; this module writes them into each rank's forward graph:
//!
//! - a variable declared `Shard(d)` becomes rank `r`'s `{name}/tp_{r}_of_{T}`, initialised as
//!   its slice of the one-process value (`shard_parts`), listed in [`JobPlan::sharded`]
//!   (through [`super::sharded_variables`]) so checkpoints hold whole tensors;
//! - `f` (`CollectiveTpCopy`), `g` (`CollectiveTpReduce`) and the other placement changes
//!   (`CollectiveTpAllGather`, `CollectiveTpReduceScatter`, `CollectiveTpAllToAll`,
//!   `CollectiveTpSlice`, each with the gradient of a replicated loss) before the consumers
//!   that need them; a fetched
//!   tensor (the loss, a metric) that is not whole is renamed `{name}/tp_local` and `g` takes
//!   its name, so the job fetches the same names;
//! - then the training step by autodiff, clipping across the shards and the collectives
//!   chained, as the GPT rewrite does; evaluation runs on worker 0 on the assembled weights.
//!
//! On a `dp × tp` mesh (`--mesh dp=D,tp=T`, ranks in Megatron-core order: tp fastest) the
//! hand-placed group is replicated `D` times, as the GPT's rewrite is: in words of placements,
//! every parameter is `Replicate` over `dp` and the batch `Shard(0)` over `dp`. Replica `d`
//! (TP group `tensor_d{d}`) feeds part `d` of each batch, its loss weighted by the part's
//! share, every gradient summed over the rank's DP group `data_t{t}` ([`super::data`]), then
//! clipped by the global norm (shards' `Σ‖g‖²` summed over dp, then over tp; the replicated
//! parameters' counted once). A pipeline axis is refused.
//!
//! [`JobPlan::sharded`]: crate::job::JobPlan

use super::super::allreduce::{check_job, fresh, worker_device};
use super::{
    data, data_parallel_step, eval_copy, onto_rank, options, prune, shard_name, shard_variable,
    Nodes, RankAt, ShardedWeight, TensorGraphs, GROUP,
};
use crate::mesh::Mesh;
use crate::sharding::propagate::{propagate, Inserted, PlacementPlan};
use crate::strategy::{ReplicaGraph, StrategyError};
use dflow_graph::axis_split::AxisSplit;
use dflow_graph::train::{expand_training_graph, TrainSpec};
use dflow_graph::{AttrValue, Graph, GraphDef, InputRef, NodeDef};
use std::collections::{HashMap, HashSet};

pub use crate::sharding::propagate::declares_placements;

/// ZeRO's stage over the data-parallel axis of `mesh` for `graph` ([`zero_layout`]'s).
pub fn zero_stage(
    graph: &Graph,
    mesh: &Mesh,
    flag: Option<u8>,
) -> Result<Option<u8>, StrategyError> {
    zero_layout(graph, mesh, flag).map(|(stage, _)| stage)
}

/// ZeRO over the data-parallel axis of `mesh` for `graph`, from `--zero-stage` (`flag`) and
/// the variables' placements on the `dp` axis (`_sharding: "dp:…"`): its stage, and the
/// variables whose training state stays whole. A variable declared `dp:Shard(0)` has its
/// training state sharded over its data-parallel group (ZeRO; stage 1 with no flag); one
/// declared `dp:Replicate` stays whole on every replica (its gradient all-reduced), even under
/// the flag; an undeclared one follows the flag. No variable sharded, or no flag over one
/// replica (where `dp:Shard(0)` is whole anyway): no ZeRO. A graph without placements by hand
/// gets `flag` for every variable.
pub fn zero_layout(
    graph: &Graph,
    mesh: &Mesh,
    flag: Option<u8>,
) -> Result<(Option<u8>, HashSet<String>), StrategyError> {
    use dflow_graph::sharding::{sharding_value, Placement, SHARDING_ATTR};
    if !declares_placements(graph) {
        return Ok((flag, HashSet::new()));
    }
    let (mut sharded, mut whole) = (0usize, HashSet::new());
    for i in graph.node_indices() {
        let v = graph.node(i);
        if v.op != "Variable" {
            continue;
        }
        let dp = match v.attrs.get(SHARDING_ATTR) {
            Some(a) => {
                sharding_value(&v.name, a)
                    .map_err(|e| options(format!("placements by hand: {e}")))?
                    .dp
            }
            None => None,
        };
        let zero = match dp {
            Some(Placement::Shard(0)) => true,
            Some(Placement::Replicate) => false,
            Some(other) => {
                return Err(options(format!(
                    "placements by hand: variable `{}` is dp:{other}; a variable's training \
                     state over the data-parallel axis is Replicate or Shard(0) (ZeRO)",
                    v.name
                )))
            }
            None => flag.is_some(),
        };
        if zero {
            sharded += 1;
        } else {
            whole.insert(v.name.clone());
        }
    }
    if sharded == 0 || (flag.is_none() && mesh.dp < 2) {
        return Ok((None, HashSet::new()));
    }
    Ok((Some(flag.unwrap_or(1)), whole))
}

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

/// The training graphs of `graph` with hand placements on `mesh`, one per rank in
/// Megatron-core order (rank `t + tp·d` on worker task `t + tp·d`): replica `d` is the
/// hand-placed tensor-parallel group, fed part `d` of every batch, its gradients summed over
/// the rank's data-parallel group in buckets of at most `bucket_bytes` (see the module docs), or
/// with ZeRO at `zero_stage` over it but for the variables of `zero_whole` ([`zero_layout`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn mesh_training(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    bucket_bytes: usize,
    zero_stage: Option<u8>,
    zero_whole: &HashSet<String>,
    features: &str,
    labels: &str,
) -> Result<TensorGraphs, StrategyError> {
    if mesh.pp != 1 {
        return Err(options(format!(
            "mesh {mesh}: a graph with placements written by hand (`_sharding`) does not run \
             over a pipeline axis (pp={}); use --mesh dp=D,tp=T with D·T workers",
            mesh.pp
        )));
    }
    let tp = mesh.tp;
    check_job(graph, spec, mesh.size(), features, labels)?;
    let plan = plan(graph, spec, tp)?;
    let shards = weights(&plan);
    let forward = graph.to_def();
    let mut graphs = Vec::with_capacity(mesh.size());
    for rank in 0..mesh.size() {
        let mut at = RankAt::on_mesh(mesh, rank, bucket_bytes, zero_stage);
        if let Some(d) = at.data.as_mut() {
            d.zero_whole = zero_whole.clone();
        }
        let mut g = rank_graph(&forward, &plan, &shards, spec, &at, features, labels)?;
        if rank == 0 {
            let on_rank =
                |v: &NodeDef, r: usize, d: usize| worker_device(&v.name, &v.device, r + tp * d);
            let zero3 = zero_stage.filter(|&s| s >= 3).map(|_| mesh.dp);
            eval_copy(&mut g, &forward, &shards, spec, tp, &on_rank, false, zero3)?;
        }
        graphs.push(g);
    }
    Ok(TensorGraphs { graphs, shards })
}

/// A tensor-parallel collective `op` of `input` over the group's `tp` ranks with the axis
/// attributes `axes` (`graph/src/ops/collective_tp.rs`).
fn tp_collective(
    n: &mut Nodes,
    base: &str,
    op: &str,
    input: String,
    tp: usize,
    axes: &[(&str, usize)],
) -> String {
    let name = n.collective(base, op, input, false);
    if let Some(d) = n.added.iter_mut().rev().find(|d| d.name == name) {
        d.attrs
            .insert("group_size".to_string(), AttrValue::Int(tp as i64));
        for (k, v) in axes {
            d.attrs.insert(k.to_string(), AttrValue::Int(*v as i64));
        }
    }
    name
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

/// Rank `at.t`'s training graph of replica `at.data` (see the module docs).
fn rank_graph(
    forward: &GraphDef,
    plan: &PlacementPlan,
    shards: &[ShardedWeight],
    spec: &TrainSpec,
    at: &RankAt,
    features: &str,
    labels: &str,
) -> Result<ReplicaGraph, StrategyError> {
    let (tp, r) = (plan.tp, at.t);
    let device = worker_device("", "", at.task)?;
    let mut def = forward.clone();
    def.train = None;
    let mut n = Nodes {
        taken: def.nodes.iter().map(|x| x.name.clone()).collect(),
        added: Vec::new(),
        device: device.clone(),
        instance: 1,
        group: at.group.clone(),
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
            rename(&mut n.added, &node, &local);
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
            Inserted::Gather { dim }
            | Inserted::ReduceScatter { dim }
            | Inserted::Slice { dim } => {
                let what = match ins.kind {
                    Inserted::Gather { .. } => "tp_gather",
                    Inserted::ReduceScatter { .. } => "tp_reduce_scatter",
                    _ => "tp_slice",
                };
                tp_collective(
                    &mut n,
                    &base(what),
                    ins.kind.op(),
                    source,
                    tp,
                    &[("axis", dim)],
                )
            }
            Inserted::AllToAll { from, to } => tp_collective(
                &mut n,
                &base("tp_all_to_all"),
                ins.kind.op(),
                source,
                tp,
                &[("split_axis", to), ("concat_axis", from)],
            ),
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
    onto_rank(&mut def.nodes, &renames, at.task)?;
    let mut keep = fetched(spec);
    keep.push(features.to_string());
    keep.push(labels.to_string());
    prune(&mut def, &keep);
    // With data parallelism, the replica's loss weighted by its share of the batch.
    let weighting = at
        .data
        .as_ref()
        .map(|_| data::weight_loss(&mut def, &spec.loss, &device));
    // Clipping across the shards (and, with data parallelism, after the gradients' sums)
    // below; with neither, the expansion's own clipping.
    let own_clip = renames.is_empty() && at.data.is_none();
    let (mut training, typed) = expand_training_graph(
        &def,
        &TrainSpec {
            clip_global_norm: spec.clip_global_norm.filter(|_| own_clip),
            loss: weighting
                .as_ref()
                .map_or_else(|| spec.loss.clone(), |w| w.weighted.clone()),
            ..spec.clone()
        },
    )?;
    let mut n = Nodes {
        taken: training.def.nodes.iter().map(|x| x.name.clone()).collect(),
        added: Vec::new(),
        device,
        instance: n.instance,
        group: at.group.clone(),
    };
    data_parallel_step(
        &mut training,
        &typed,
        &mut n,
        at,
        weighting.as_ref(),
        &renames,
        spec.clip_global_norm.filter(|_| !own_clip),
        &def,
    )?;
    super::finish_rank(
        training,
        at,
        weighting.map(|w| w.weight),
        spec,
        features,
        labels,
    )
}

/// `dflow partition --strategy tensor`'s section for a graph with hand placements: every
/// tensor's placement on the tensor-parallel axis and every inserted collective with the bytes
/// each rank sends per step, forward and backward, by the ring formulas
/// ([`crate::sharding::propagate::Insert::bytes_sent`]). `graph` has the batch dimension
/// filled in where known.
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

/// `dflow partition`'s section for a graph with hand placements on a `dp × tp` mesh with
/// `dp > 1`: every variable's placement on each axis (on `dp`, its training state: `Replicate`,
/// or `Shard(0)` under ZeRO, see [`zero_stage`]; `flag` is `--zero-stage`), the batch's, the
/// tensor- and data-parallel groups with their ranks, and what each rank sends over its DP
/// group per step: without ZeRO the gradient bytes it sums (ring all-reduce, `2(D−1)/D` of the
/// bytes; the global loss's scalar not counted), under ZeRO every collective of the group with
/// its bytes (ring: an all-reduce `2(D−1)/D` of its input, a reduce-scatter `(D−1)/D`, an
/// all-gather `(D−1)` times its input).
#[allow(clippy::too_many_arguments)]
pub fn render_data_parallel(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    bucket_bytes: usize,
    flag: Option<u8>,
    features: &str,
    labels: &str,
) -> Result<String, StrategyError> {
    use dflow_graph::sharding::{AxisPlacements, Placement};
    use std::fmt::Write as _;
    let (stage, whole) = zero_layout(graph, mesh, flag)?;
    let tg = super::mesh_training(graph, spec, mesh, bucket_bytes, flag, features, labels)?;
    let dp = mesh.dp;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\ndata parallelism over the hand-placed groups: dp={dp} × tp={} (ranks tp fastest; the \
         tp section above is one replica's, on its part of the batch)",
        mesh.tp
    );
    match stage {
        None => {
            let _ = writeln!(
                out,
                "placements on the dp axis: every parameter (shard or replicated) Replicate; \
                 the batch ({features}, {labels}) Shard(0): replica d feeds part d, its loss \
                 weighted by its share"
            );
        }
        Some(s) => {
            let what = match s {
                1 => "its Adam slots",
                2 => "its Adam slots and summed gradient",
                _ => "its Adam slots, summed gradient and the parameter itself (all-gathered before each use)",
            };
            let _ = writeln!(
                out,
                "placements on the dp axis: {}'s training state Shard(0), ZeRO stage {s}: \
                 {what} flattened and cut in {dp} parts over its dp group{}; the batch \
                 ({features}, {labels}) Shard(0): replica d feeds part d, its loss weighted by \
                 its share",
                if whole.is_empty() {
                    "every parameter"
                } else {
                    "each parameter below declared so"
                },
                if whole.is_empty() {
                    ""
                } else {
                    " (the others Replicate: their gradients all-reduced)"
                }
            );
        }
    }
    let _ = writeln!(out, "variables' placements per axis:");
    let tp_plan = plan(graph, spec, mesh.tp)?;
    for i in graph.node_indices() {
        let v = graph.node(i);
        if v.op != "Variable" {
            continue;
        }
        let ty = graph
            .output_type(i, 0)
            .map_or_else(|| "?".to_string(), |t| t.to_string());
        let p = AxisPlacements {
            dp: Some(if stage.is_some() && !whole.contains(&v.name) {
                Placement::Shard(0)
            } else {
                Placement::Replicate
            }),
            tp: Some(
                tp_plan
                    .placements
                    .get(&v.name)
                    .copied()
                    .unwrap_or(Placement::Replicate),
            ),
        };
        let _ = writeln!(out, "  {} {ty}: {p}", v.name);
    }
    let first = tg
        .graphs
        .first()
        .ok_or_else(|| options("the mesh has no rank".into()))?;
    let summed = match stage {
        None => "every gradient summed".to_string(),
        Some(s) => format!("ZeRO stage {s}, shard d of each weight's training state"),
    };
    super::render_mesh_groups(&mut out, mesh, &summed);
    if stage.is_none() {
        // Rank 0's gradient buckets: every input of its DP group's PackFlats.
        let grads: usize = first
            .training
            .def
            .nodes
            .iter()
            .filter(|n| n.op == "PackFlat" && n.name.starts_with("dp/bucket_"))
            .flat_map(|p| p.inputs.iter())
            .map(|i| super::input_bytes(&first.graph, i))
            .sum();
        let _ = writeln!(
            out,
            "gradients each rank sums over its dp group per step: {grads} B (rank 0), sending \
             {} B (ring all-reduce); clipping's norm summed over dp, then tp",
            2 * (dp - 1) * grads / dp
        );
        return Ok(out);
    }
    // ZeRO: rank 0's collectives over its DP group, in the graph's order.
    let _ = writeln!(
        out,
        "ZeRO collectives rank 0 runs over its dp group {} per step (bytes it sends, ring):",
        super::dp_group(0)
    );
    let total = super::render_dp_collectives(&mut out, first, dp);
    let _ = writeln!(
        out,
        "bytes rank 0 sends over its dp group per step: {total} B (clipping's norm summed over \
         dp, then tp)"
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharding::Placement::Shard;
    use dflow_graph::builder::GraphBuilder;
    use dflow_graph::train::{OptimizerKind, OptimizerSpec};
    use dflow_graph::DType;

    fn node<'a>(g: &'a ReplicaGraph, name: &str) -> &'a NodeDef {
        g.training
            .def
            .nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node `{name}`"))
    }

    /// `y = m + Σ_rows (v · w)`: a row-sharded `m` plus a partial bias made whole by `g`, which
    /// then enters a sharded op (so `f` follows `g`); the loss, a Sum over the sharded rows, is
    /// partial and made whole under its own name.
    #[test]
    fn g_then_f_on_one_input_and_a_partial_loss_made_whole_under_its_name() {
        let mut b = GraphBuilder::new();
        b.placeholder("x", DType::F32, &[4, 3]);
        b.placeholder("t", DType::F32, &[4]);
        let v = b.variable("v", DType::F32, &[2, 6], "ones");
        let w = b.variable("w", DType::F32, &[6, 3], "ones");
        let m = b.variable("m", DType::F32, &[4, 3], "ones");
        b.set_sharding(&v, Shard(1));
        b.set_sharding(&w, Shard(0));
        b.set_sharding(&m, Shard(0));
        let p0 = b.matmul("p0", &v, &w);
        let p = b
            .op("Sum", "p")
            .input(&p0)
            .attr("axes", AttrValue::IntList(vec![0]))
            .finish();
        let y = b.binary("Add", "y", &m, &p);
        b.op("Sum", "loss").input(&y).finish();
        let graph = b.build().unwrap();
        let spec = TrainSpec::new(
            "loss",
            OptimizerSpec {
                kind: OptimizerKind::Sgd,
                lr: 0.1,
            },
        );
        let mesh = Mesh::new(1, 2, 1).unwrap();
        let tg = mesh_training(
            &graph,
            &spec,
            &mesh,
            1 << 20,
            None,
            &HashSet::new(),
            "x",
            "t",
        )
        .unwrap();
        assert_eq!(tg.graphs.len(), 2);
        let names: Vec<&str> = tg.shards.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["v", "w", "m"]);
        for g in &tg.graphs {
            let y = node(g, "y");
            let f = node(g, &y.inputs[1]);
            assert_eq!(f.op, "CollectiveTpCopy");
            let gg = node(g, &f.inputs[0]);
            assert_eq!(
                (gg.op.as_str(), gg.inputs[0].as_str()),
                ("CollectiveTpReduce", "p")
            );
            let loss = node(g, "loss");
            assert_eq!(
                (loss.op.as_str(), loss.inputs[0].as_str()),
                ("CollectiveTpReduce", "loss/tp_local")
            );
            assert_eq!(node(g, "loss/tp_local").op, "Sum");
            // f's gradient: an all-reduce in the backward pass.
            assert!(g
                .training
                .def
                .nodes
                .iter()
                .any(|n| n.op == "CollectiveAllReduce"
                    && matches!(n.attrs.get("instance_key"), Some(AttrValue::Int(k))
                    if *k >= dflow_graph::ops::collective::GRADIENT_INSTANCE_OFFSET)));
        }
        // Rank 1 holds its shards under their own names.
        let shard = node(&tg.graphs[1], "m/tp_1_of_2");
        assert_eq!(shard.attrs.get("shard_index"), Some(&AttrValue::Int(1)));
    }

    /// `h = x · w` (column-parallel) declared `Shard(0)`: every rank reads it through a
    /// `CollectiveTpAllToAll` from 1 to 0, whose gradient is the reverse all-to-all keyed apart.
    #[test]
    fn a_declared_reshard_is_an_all_to_all_with_its_reverse_as_gradient() {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 2]);
        b.placeholder("t", DType::F32, &[4]);
        let w = b.variable("w", DType::F32, &[2, 6], "ones");
        b.set_sharding(&w, Shard(1));
        let h = b
            .op("MatMul", "h")
            .input(&x)
            .input(&w)
            .sharding(Shard(0))
            .finish();
        let r = b.unary("Relu", "r", &h);
        b.op("Sum", "loss").input(&r).finish();
        let graph = b.build().unwrap();
        let spec = TrainSpec::new(
            "loss",
            OptimizerSpec {
                kind: OptimizerKind::Sgd,
                lr: 0.1,
            },
        );
        let tg = mesh_training(
            &graph,
            &spec,
            &Mesh::new(1, 2, 1).unwrap(),
            1 << 20,
            None,
            &HashSet::new(),
            "x",
            "t",
        )
        .unwrap();
        for g in &tg.graphs {
            let a2a = node(g, &node(g, "r").inputs[0]);
            assert_eq!(
                (a2a.op.as_str(), a2a.inputs[0].as_str()),
                ("CollectiveTpAllToAll", "h")
            );
            let int = |n: &NodeDef, k: &str| match n.attrs.get(k) {
                Some(AttrValue::Int(v)) => *v,
                other => panic!("{k}: {other:?}"),
            };
            assert_eq!(
                [
                    int(a2a, "split_axis"),
                    int(a2a, "concat_axis"),
                    int(a2a, "group_size")
                ],
                [0, 1, 2]
            );
            let back = g
                .training
                .def
                .nodes
                .iter()
                .find(|n| n.op == "CollectiveTpAllToAll" && n.name != a2a.name)
                .expect("the gradient's all-to-all");
            assert_eq!([int(back, "split_axis"), int(back, "concat_axis")], [1, 0]);
            assert_eq!(
                int(back, "instance_key"),
                int(a2a, "instance_key") + dflow_graph::ops::collective::GRADIENT_INSTANCE_OFFSET
            );
        }
    }

    /// `loss = Σ (x · w + b)` with `w` column-parallel and `b` replicated (it enters the
    /// sharded bias, so it gets `f`), clipped by the global norm, on a dp=2 × tp=2 mesh.
    #[test]
    fn dp2_tp2_replicates_the_hand_placed_group_and_sums_gradients_over_the_dp_groups() {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[-1, 2]);
        b.placeholder("t", DType::F32, &[-1]);
        let w = b.variable("w", DType::F32, &[2, 4], "ones");
        let bias = b.variable("b", DType::F32, &[4], "zeros");
        b.set_sharding(&w, Shard(1));
        let h = b.matmul("h", &x, &w);
        let y = b.op("BiasAdd", "y").input(&h).input(&bias).finish();
        b.op("Sum", "loss").input(&y).finish();
        let graph = b.build().unwrap();
        let mut spec = TrainSpec::new(
            "loss",
            OptimizerSpec {
                kind: OptimizerKind::Sgd,
                lr: 0.1,
            },
        );
        spec.clip_global_norm = Some(1.0);
        let mesh = Mesh::new(2, 2, 1).unwrap();
        let tg = mesh_training(
            &graph,
            &spec,
            &mesh,
            1 << 20,
            None,
            &HashSet::new(),
            "x",
            "t",
        )
        .unwrap();
        assert_eq!(tg.graphs.len(), 4);
        let key = |n: &NodeDef| match n.attrs.get("group_key") {
            Some(AttrValue::String(s)) => s.to_string(),
            _ => String::new(),
        };
        for (rank, g) in tg.graphs.iter().enumerate() {
            let (t, d) = (rank % 2, rank / 2);
            let nodes = &g.training.def.nodes;
            // Rank t + 2d holds shard t of `w` on its own task, and feeds part d, weighted.
            assert!(nodes.iter().any(|n| n.name == shard_name("w", t, 2)));
            // Everything on the rank's task, but evaluation's copy on rank 0 (it reads rank
            // 1's shard where it lives).
            let task = format!("/job:worker/task:{rank}");
            for n in nodes {
                let eval = n.name.starts_with("eval/") || (rank == 0 && n.name == "w/tp_1_of_2");
                assert!(n.device == task || eval, "{}: {}", n.name, n.device);
            }
            assert_eq!(g.replicas[0].worker, d);
            let weight = g.replicas[0].weight.as_deref().expect("a batch weight");
            assert_eq!(node(g, weight).op, "Placeholder");
            // TP collectives in the replica's group, gradient sums in the shard's DP group
            // (keys apart), and nothing else.
            let (tp_key, dp_key) = (format!("tensor_d{d}"), format!("data_t{t}"));
            let collectives: Vec<&NodeDef> = nodes
                .iter()
                .filter(|n| n.op.starts_with("Collective") && !n.name.starts_with("eval/"))
                .collect();
            for c in &collectives {
                let k = key(c);
                assert!(k == tp_key || k == dp_key, "{}: {k}", c.name);
            }
            let sums: Vec<&&NodeDef> = collectives.iter().filter(|n| key(n) == dp_key).collect();
            // One bucket of both gradients (`w`'s shard and `b`), then the global loss.
            assert_eq!(sums.len(), 2, "{sums:?}");
            assert_eq!(g.training.loss, sums[1].name);
            // The clipping norm: the shards' squared norm of the summed gradients, all-reduced
            // over the TP group, plus the replicated `b`'s counted once.
            let shards = node(g, "tp/clip/shards_squared_norm");
            assert_eq!(shards.inputs.len(), 1);
            assert!(shards.inputs[0].starts_with("dp/bucket_0/grad_"));
            let rep = node(g, "tp/clip/replicated_squared_norm");
            assert!(rep
                .inputs
                .iter()
                .all(|i| i.starts_with("dp/bucket_0/grad_")));
            let sum = node(g, "tp/clip/shards_squared_norm_sum");
            assert_eq!(key(sum), tp_key);
            // Every update reads a clipped sum.
            for u in nodes.iter().filter(|n| n.op.starts_with("Apply")) {
                let grad = u.inputs.last().unwrap();
                assert!(grad.starts_with("tp/clip/grad_"), "{grad}");
                let c = node(g, grad);
                assert!(
                    c.inputs[0].starts_with("dp/bucket_0/grad_"),
                    "{:?}",
                    c.inputs
                );
            }
        }
        // The collectives are chained in one order, the same on every rank.
        let order = |g: &ReplicaGraph| -> Vec<(String, String)> {
            let mut chain: Vec<(String, String)> = g
                .training
                .def
                .nodes
                .iter()
                .filter(|n| n.op.starts_with("Collective") && n.op != "CollectiveTpCopy")
                .map(|n| {
                    let prev = n
                        .inputs
                        .iter()
                        .find(|i| i.starts_with('^'))
                        .cloned()
                        .unwrap_or_default();
                    let same = |s: &str| s.replace("tp_1_of_2", "tp_0_of_2");
                    (same(&n.name), same(&prev))
                })
                .collect();
            chain.sort();
            chain
        };
        let first = order(&tg.graphs[0]);
        assert!(first.len() >= 5, "{first:?}");
        for g in &tg.graphs[1..] {
            assert_eq!(order(g), first);
        }
        // The plan: TP groups {0,1} {2,3}, DP groups {0,2} {1,3}, two parts per batch.
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 4)]).unwrap();
        let input = crate::strategy::JobInput::new(&graph, &spec, &cluster, "x", "t");
        use crate::strategy::Strategy as _;
        let plan = crate::strategy::tensor::TensorParallel {
            tp: Some(2),
            bucket_bytes: 1 << 20,
            batch_size: Some(4),
            pipeline: None,
            zero_stage: None,
        }
        .plan(&input)
        .unwrap();
        let groups: Vec<(&str, Vec<&str>)> = plan
            .groups
            .iter()
            .map(|g| {
                (
                    g.key.as_str(),
                    g.members.iter().map(String::as_str).collect(),
                )
            })
            .collect();
        let w = |i: u32| crate::job::task_name("worker", i);
        let (w0, w1, w2, w3) = (w(0), w(1), w(2), w(3));
        assert_eq!(
            groups,
            [
                ("tensor_d0", vec![w0.as_str(), &w1]),
                ("tensor_d1", vec![w2.as_str(), &w3]),
                ("data_t0", vec![w0.as_str(), &w2]),
                ("data_t1", vec![w1.as_str(), &w3]),
            ]
        );
        assert_eq!(plan.batch_parts, 2);
    }

    #[test]
    fn a_pipeline_axis_over_hand_placements_is_refused_naming_it() {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 2]);
        b.placeholder("t", DType::F32, &[4]);
        let w = b.variable("w", DType::F32, &[2, 2], "ones");
        b.set_sharding(&w, Shard(1));
        let h = b.matmul("h", &x, &w);
        b.op("Sum", "loss").input(&h).finish();
        let graph = b.build().unwrap();
        let spec = TrainSpec::new(
            "loss",
            OptimizerSpec {
                kind: OptimizerKind::Sgd,
                lr: 0.1,
            },
        );
        let e = mesh_training(
            &graph,
            &spec,
            &Mesh::new(1, 2, 2).unwrap(),
            1,
            None,
            &HashSet::new(),
            "x",
            "t",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("does not run over a pipeline axis (pp=2)"),
            "{e}"
        );
    }

    /// ZeRO's layout from the flag and the dp placements: undeclared variables follow the
    /// flag, `dp:Replicate` stays whole under it, `dp:Shard(0)` alone is stage 1 over two
    /// replicas and nothing over one.
    #[test]
    fn zero_layout_follows_the_flag_and_the_dp_placements() {
        use dflow_graph::sharding::AxisPlacements;
        let graph = |w_dp: Option<&str>, b_dp: Option<&str>| {
            let mut b = GraphBuilder::new();
            let x = b.placeholder("x", DType::F32, &[4, 2]);
            let w = b.variable("w", DType::F32, &[2, 2], "ones");
            let bias = b.variable("b", DType::F32, &[2], "zeros");
            let place = |dp: Option<&str>, tp| {
                let mut p = AxisPlacements::tp(tp);
                p.dp = dp.map(|d| dflow_graph::sharding::parse_placement(d).unwrap());
                p
            };
            b.set_placements(&w, place(w_dp, Shard(1)));
            b.set_placements(&bias, place(b_dp, Placement::Replicate));
            let h = b.matmul("h", &x, &w);
            let y = b.op("BiasAdd", "y").input(&h).input(&bias).finish();
            b.op("Sum", "loss").input(&y).finish();
            b.build().unwrap()
        };
        use crate::sharding::Placement;
        let dp2 = Mesh::new(2, 2, 1).unwrap();
        let whole = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<HashSet<_>>();
        let g = graph(None, None);
        assert_eq!(zero_layout(&g, &dp2, None).unwrap(), (None, whole(&[])));
        assert_eq!(
            zero_layout(&g, &dp2, Some(2)).unwrap(),
            (Some(2), whole(&[]))
        );
        let g = graph(Some("Replicate"), None);
        assert_eq!(
            zero_layout(&g, &dp2, Some(3)).unwrap(),
            (Some(3), whole(&["w"]))
        );
        let g = graph(Some("Replicate"), Some("Replicate"));
        assert_eq!(zero_layout(&g, &dp2, Some(1)).unwrap(), (None, whole(&[])));
        let g = graph(Some("Shard(0)"), None);
        assert_eq!(
            zero_layout(&g, &dp2, None).unwrap(),
            (Some(1), whole(&["b"]))
        );
        assert_eq!(
            zero_layout(&g, &Mesh::new(1, 2, 1).unwrap(), None).unwrap(),
            (None, whole(&[]))
        );
    }

    /// `w` (tp `Shard(1)`) declared `dp:Replicate`, `b` undeclared, `--zero-stage 2` on
    /// dp=2 × tp=2 with Adam and clipping: `b`'s slots are ZeRO's halves, `w`'s shard keeps
    /// whole slots and its gradient is all-reduced over the dp group, and both are clipped by
    /// one scale from both squared norms.
    #[test]
    fn dp_replicate_beside_zero_keeps_whole_slots_and_shares_one_clipping_scale() {
        use dflow_graph::sharding::{AxisPlacements, Placement};
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[-1, 2]);
        b.placeholder("t", DType::F32, &[-1]);
        let w = b.variable("w", DType::F32, &[2, 4], "ones");
        let bias = b.variable("b", DType::F32, &[4], "zeros");
        let mut p = AxisPlacements::tp(Shard(1));
        p.dp = Some(Placement::Replicate);
        b.set_placements(&w, p);
        let h = b.matmul("h", &x, &w);
        let y = b.op("BiasAdd", "y").input(&h).input(&bias).finish();
        b.op("Sum", "loss").input(&y).finish();
        let graph = b.build().unwrap();
        let mut spec = TrainSpec::new(
            "loss",
            OptimizerSpec {
                kind: OptimizerKind::adam(),
                lr: 0.1,
            },
        );
        spec.clip_global_norm = Some(1.0);
        let mesh = Mesh::new(2, 2, 1).unwrap();
        let tg =
            super::super::mesh_training(&graph, &spec, &mesh, 1 << 20, Some(2), "x", "t").unwrap();
        for (rank, g) in tg.graphs.iter().enumerate() {
            let t = rank % 2;
            let has = |n: &str| g.training.def.nodes.iter().any(|x| x.name == n);
            let w = shard_name("w", t, 2);
            assert!(has("b/adam_m/shard_0_of_2") || has("b/adam_m/shard_1_of_2"));
            assert!(!has("b/adam_m"));
            assert!(has(&format!("{w}/adam_m")), "{w}'s whole slot");
            assert!(!has(&format!("{w}/adam_m/shard_0_of_2")));
            let scale = node(g, "dp/clip/global_norm_scale");
            assert_eq!(scale.op, "GlobalNormScale");
            assert_eq!(node(g, &scale.inputs[0]).op, "Add");
            let update = g
                .training
                .def
                .nodes
                .iter()
                .find(|u| u.op == "ApplyAdam" && u.inputs[0] == w)
                .expect("w's update");
            let clipped = node(g, update.inputs.last().unwrap());
            assert_eq!(clipped.inputs[1], "dp/clip/global_norm_scale");
            assert!(
                clipped.inputs[0].starts_with("dp/bucket_0/grad_"),
                "{clipped:?}"
            );
            // b's update reads its clipped ZeRO shard.
            let update = g
                .training
                .def
                .nodes
                .iter()
                .find(|u| u.op == "ApplyAdam" && u.inputs[0] == "b")
                .expect("b's update");
            let clipped = node(g, &update.inputs[4]);
            assert_eq!(clipped.inputs[1], "dp/clip/global_norm_scale");
        }
    }
}
