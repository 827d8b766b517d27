//! Data parallelism over tensor-parallel groups (`--mesh dp=D,tp=T`): each rank's loss is
//! weighted by its replica's share of the global batch, and every gradient — the rank's shards
//! and the replicated parameters alike — is summed over the rank's data-parallel group (the
//! ranks holding the same shard index in the other replicas), fused into buckets, before
//! clipping and the update. The sum of the weighted gradients is the gradient of the global
//! batch's mean loss, exactly as `--strategy allreduce` averages
//! ([`crate::strategy::allreduce`]), so every replica stays equal to the one-process model.
//! With ZeRO over the data-parallel axis ([`zero_step`]) the sum is `--strategy zero`'s step
//! over the group instead.

use super::{bad, Nodes, StrategyError};
use crate::strategy::allreduce::{fresh, node, BATCH_WEIGHT};
use crate::strategy::zero;
use dflow_graph::train::TrainingGraph;
use dflow_graph::{AttrValue, DType, Graph, GraphDef, InputRef, Shape};
use std::collections::{HashMap, HashSet};

/// A rank's replica: the part of every batch it feeds and its data-parallel group.
#[derive(Clone, Debug)]
pub(super) struct Replica {
    /// The batch part (the data-parallel coordinate).
    pub part: usize,
    /// The data-parallel collective group.
    pub group: String,
    /// The most bytes of gradients in one all-reduce.
    pub bucket_bytes: usize,
    /// The data-parallel size (the group's ranks).
    pub ranks: usize,
    /// ZeRO's stage over the group (`--zero-stage` beside tensor parallelism), in place of the
    /// all-reduce of the gradients: [`zero_step`].
    pub zero_stage: Option<u8>,
    /// Under ZeRO, the variables (as the one-process graph names them) whose training state
    /// stays whole on every replica (`dp:Replicate` by hand): their gradients are all-reduced
    /// as without ZeRO ([`sum_gradients`]).
    pub zero_whole: HashSet<String>,
}

/// Gradients summed by one all-reduce: their dtype, bytes, and each gradient with its dims.
struct Bucket {
    dtype: DType,
    bytes: usize,
    grads: Vec<(String, Vec<usize>)>,
}

/// The weight placeholder and the weighted loss [`weight_loss`] added.
pub(super) struct Weighting {
    /// The scalar f32 placeholder fed with the replica's share `n_d / n` of the batch.
    pub weight: String,
    /// `loss · weight`.
    pub weighted: String,
}

/// Adds to `def` the batch-weight placeholder and `loss · weight` on `device`.
pub(super) fn weight_loss(def: &mut GraphDef, loss: &str, device: &str) -> Weighting {
    let mut taken: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
    let weight = fresh(&mut taken, BATCH_WEIGHT);
    let mut w = node(&weight, "Placeholder", vec![], device);
    w.attrs.insert("dtype".into(), AttrValue::DType(DType::F32));
    w.attrs
        .insert("shape".into(), AttrValue::Shape(Shape::scalar()));
    def.nodes.push(w);
    let base = loss.split(':').next().unwrap_or(loss);
    let weighted = fresh(&mut taken, &format!("{base}/weighted"));
    def.nodes.push(node(
        &weighted,
        "Mul",
        vec![loss.to_string(), weight.clone()],
        device,
    ));
    Weighting { weight, weighted }
}

/// Sums every gradient of `training` over `replica.group` in buckets (last variables first, at
/// most `bucket_bytes` and one dtype each: `PackFlat`, one all-reduce, `FlatSlice` back), points
/// the updates and `training.gradients` at the sums, and makes `training.loss` the all-reduced
/// `weighted` loss (the global batch's mean). `typed` is the validated `training.def`. The
/// caller chains the collectives.
pub(super) fn reduce_gradients(
    training: &mut TrainingGraph,
    typed: &Graph,
    n: &mut Nodes,
    replica: &Replica,
    weighted: &str,
) -> Result<(), StrategyError> {
    sum_gradients(training, typed, n, replica)?;
    global_loss(training, n, replica, weighted);
    Ok(())
}

/// [`reduce_gradients`] but the loss: every gradient of `training.gradients` summed over
/// `replica.group` in buckets, the updates and `training.gradients` pointed at the sums.
pub(super) fn sum_gradients(
    training: &mut TrainingGraph,
    typed: &Graph,
    n: &mut Nodes,
    replica: &Replica,
) -> Result<(), StrategyError> {
    let mut buckets: Vec<Bucket> = Vec::new();
    for (var, grad) in training.gradients.iter().rev() {
        let ty = match InputRef::parse(grad) {
            Ok(InputRef::Data { node, index }) => {
                typed.find(&node).and_then(|i| typed.output_type(i, index))
            }
            _ => None,
        }
        .ok_or_else(|| {
            bad(format!(
                "the gradient `{grad}` of `{var}` is not in the graph"
            ))
        })?;
        let dims = ty.shape.as_static().ok_or_else(|| {
            bad(format!(
                "the gradient of `{var}` has shape {}; data parallelism sums static shapes",
                ty.shape
            ))
        })?;
        let bytes = dims.iter().product::<usize>() * ty.dtype.size_of();
        match buckets.last_mut() {
            Some(b) if b.dtype == ty.dtype && b.bytes + bytes <= replica.bucket_bytes.max(1) => {
                b.bytes += bytes;
                b.grads.push((grad.clone(), dims));
            }
            _ => buckets.push(Bucket {
                dtype: ty.dtype,
                bytes,
                grads: vec![(grad.clone(), dims)],
            }),
        }
    }
    let mut summed: HashMap<String, String> = HashMap::new();
    for (k, Bucket { grads, .. }) in buckets.iter().enumerate() {
        let pack = n.add(
            &format!("dp/bucket_{k}/pack"),
            "PackFlat",
            grads.iter().map(|(g, _)| g.clone()).collect(),
            vec![],
        );
        let sum = n.collective_in(
            &replica.group,
            &format!("dp/bucket_{k}"),
            "CollectiveAllReduce",
            pack,
            "sum",
        );
        let mut offset = 0i64;
        for (j, (g, dims)) in grads.iter().enumerate() {
            let slice = n.add(
                &format!("dp/bucket_{k}/grad_{j}"),
                "FlatSlice",
                vec![sum.clone()],
                vec![
                    ("offset", AttrValue::Int(offset)),
                    ("shape", AttrValue::Shape(Shape::known(dims))),
                ],
            );
            offset += dims.iter().product::<usize>() as i64;
            summed.insert(g.clone(), slice);
        }
    }
    for u in training
        .def
        .nodes
        .iter_mut()
        .filter(|u| u.op.starts_with("Apply"))
    {
        for i in &mut u.inputs {
            if let Some(s) = summed.get(i) {
                *i = s.clone();
            }
        }
    }
    for (_, g) in &mut training.gradients {
        if let Some(s) = summed.get(g) {
            *g = s.clone();
        }
    }
    Ok(())
}

/// Makes `training.loss` the all-reduced `weighted` loss over the replica's group (the global
/// batch's mean).
pub(super) fn global_loss(
    training: &mut TrainingGraph,
    n: &mut Nodes,
    replica: &Replica,
    weighted: &str,
) {
    training.loss = n.collective_in(
        &replica.group,
        &format!("{}/global", weighted.split(':').next().unwrap_or(weighted)),
        "CollectiveAllReduce",
        weighted.to_string(),
        "sum",
    );
}

/// ZeRO over the replica's data-parallel group at `stage`, in place of [`reduce_gradients`]
/// and the tensor-parallel clipping: the rank's weights (its tensor-parallel shards and the
/// replicated parameters) get [`zero::shard_step`] over the group — each rank keeps and updates
/// the `1/D` shard `replica.part` of their Adam slots, from gradients all-reduced (stage 1) or
/// reduce-scattered (stage 2), and all-gathers the updated shards — with the global norm's
/// `Σ‖g‖²` of the shards of `tp_sharded` weights summed over the tensor-parallel group
/// `tp_group` too (the replicated weights' counted once). Then `training.loss` is the global
/// batch's mean loss, as in [`reduce_gradients`]. Returns the parameters in the shard layout
/// (stage 3 shards them next: [`zero::params::shard_parameters`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn zero_step(
    training: &mut TrainingGraph,
    typed: &Graph,
    n: &mut Nodes,
    replica: &Replica,
    stage: u8,
    weighted: &str,
    tp_group: &str,
    tp_sharded: &HashSet<String>,
    clip: Option<f64>,
) -> Result<Vec<zero::Param>, StrategyError> {
    let clip = clip.map_or(zero::Clip::None, zero::Clip::Norm);
    let (params, _) = zero_step_with(
        training, typed, n, replica, stage, tp_group, tp_sharded, clip,
    )?;
    global_loss(training, n, replica, weighted);
    Ok(params)
}

/// [`zero_step`] but the loss, over the gradients of `training.gradients` only, clipped by
/// `clip` (under [`zero::Clip::Scale`] also returns the tensor holding their `Σ‖g‖²`, summed
/// over the group and the tensor-parallel group, for the caller's scale).
#[allow(clippy::too_many_arguments)]
pub(super) fn zero_step_with(
    training: &mut TrainingGraph,
    typed: &Graph,
    n: &mut Nodes,
    replica: &Replica,
    stage: u8,
    tp_group: &str,
    tp_sharded: &HashSet<String>,
    clip: zero::Clip<'_>,
) -> Result<(Vec<zero::Param>, Option<String>), StrategyError> {
    let mut z = zero::Nodes::new(std::mem::take(&mut n.taken), &n.device, n.instance);
    let ctx = shard_group(replica, stage);
    let outer = zero::OuterShards {
        key: tp_group,
        sharded: tp_sharded,
    };
    let out = zero::shard_step_with(training, typed, &mut z, &ctx, clip, Some(&outer))?;
    n.taken = z.taken;
    n.instance = z.instance;
    n.added.extend(z.added);
    Ok(out)
}

/// The rank's place in its data-parallel group, as ZeRO at `stage` shards over it.
pub(super) fn shard_group(replica: &Replica, stage: u8) -> zero::ShardGroup {
    zero::ShardGroup {
        rank: replica.part,
        ranks: replica.ranks,
        stage,
        key: replica.group.clone(),
        bucket_bytes: replica.bucket_bytes,
    }
}
