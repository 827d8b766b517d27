//! Tensor parallelism inside pipeline stages (`--mesh tp=T,pp=P`) and the 3D mesh
//! (`--mesh dp=D,tp=T,pp=P`): each tensor-parallel rank's Megatron graph ([`super::rank_forward`])
//! cut into stages by the pipeline rewrite ([`crate::strategy::pipeline`]), in Megatron-core's
//! rank order: stage `s`, shard `t`, replica `d` on worker `s·(D·T) + d·T + t`.
//!
//! - The stages are cut on each rank's graph by the pipeline's balanced cuts; the ranks hold
//!   shards of equal sizes, so the cuts agree (checked: a disagreement is an error).
//! - Every micro-batch copy of a collective goes to the tensor-parallel group of its stage and
//!   replica ([`tp_stage_group`]) under an instance key of its own; each worker chains its
//!   collectives in one topological order, the same on every rank of a group.
//! - With `D > 1`, each stage's gradients are summed over the ranks with the same stage and
//!   shard ([`dp_stage_group`]), exactly as a plain pipeline sums them over its replicas.
//! - Clipping uses the whole model's norm: per stage, the shards' `Σ‖g‖²` all-reduced over the
//!   stage's tensor-parallel group plus the replicated parameters'; the stages' sums meet on
//!   the loss's stage.
//! - Evaluation runs on worker 0 without collectives, on a one-process forward copy whose
//!   weights are assembled from every shard, wherever its stage put it.

use super::{
    add_eval_copy, check_job, options, rank_forward, shard_name, Gpt, RankAt, RankForward,
    ShardedWeight, GROUP,
};
use crate::job::{task_name, CollectiveGroup};
use crate::mesh::Mesh;
use crate::strategy::pipeline::gradients::stage_group;
use crate::strategy::pipeline::rewrite::{rewrite, RewriteInput, TensorStages};
use crate::strategy::pipeline::schedule::PipelineShape;
use crate::strategy::pipeline::{worker_device, Pipeline, PipelineError, Prepared};
use crate::strategy::{EvalNames, ReplicaGraph, StrategyError};
use dflow_graph::train::TrainSpec;
use dflow_graph::{DType, Graph, NodeDef};

/// The tensor-parallel collective group of pipeline stage `s` in replica `d`.
pub fn tp_stage_group(s: usize, d: usize) -> String {
    format!("{GROUP}_s{s}_d{d}")
}

/// The data-parallel collective group of pipeline stage `s`'s shard `t` (its replicas).
pub fn dp_stage_group(s: usize, t: usize) -> String {
    format!("{}_t{t}", stage_group(s))
}

/// The graphs of a `dp × tp × pp` job.
#[derive(Clone, Debug)]
pub struct MeshGraphs {
    /// One training graph per (replica `d`, shard `t`), `d`-major: graph `d·T + t` runs the
    /// `P` stages of shard `t` of replica `d`.
    pub graphs: Vec<ReplicaGraph>,
    /// The sharded weights (every other variable is replicated).
    pub shards: Vec<ShardedWeight>,
    /// Stages, micro-batches, chunks.
    pub shape: PipelineShape,
    /// The tensor-parallel groups of every (stage, replica), then the data-parallel groups of
    /// every (stage, shard) when `D > 1`.
    pub groups: Vec<CollectiveGroup>,
}

/// The training graphs of the GPT `graph` on `mesh` (`pp > 1`), cut and scheduled as
/// `pipeline` says (see the module docs).
pub fn mesh3d_training(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    pipeline: &Pipeline,
    features: &str,
    labels: &str,
) -> Result<MeshGraphs, StrategyError> {
    let (tp, dp, pp) = (mesh.tp, mesh.dp, mesh.pp);
    let loss_dtype = check_job(graph, spec, mesh.size(), features, labels)?;
    if loss_dtype != DType::F32 {
        return Err(options(format!(
            "the loss is {loss_dtype}; the vocabulary-parallel loss is built in f32"
        )));
    }
    if pipeline.stages != Some(pp) {
        return Err(options(format!(
            "mesh {mesh}: the pipeline must cut {pp} balanced stages"
        )));
    }
    let def = graph.to_def();
    let gpt = Gpt::of(graph, &def)?;
    let shards = gpt.layout(graph, tp)?;
    // Each shard's forward graph, typed and cut.
    let mut ranks: Vec<(RankForward, Graph, Prepared)> = Vec::with_capacity(tp);
    for t in 0..tp {
        let at = RankAt {
            t,
            tp,
            task: t,
            group: GROUP.to_string(),
            data: None,
        };
        let forward = rank_forward(&def, &gpt, &shards, spec, &at, features, labels)?;
        let typed = Graph::from_def(&forward.def).map_err(StrategyError::InvalidGraph)?;
        let prepared = pipeline.prepare(&typed, features, labels)?;
        if let Some((_, _, first)) = ranks.first() {
            if first.stages.stage != prepared.stages.stage {
                return Err(PipelineError::Internal(format!(
                    "the stage cuts of tensor-parallel ranks 0 and {t} differ"
                ))
                .into());
            }
        }
        ranks.push((forward, typed, prepared));
    }
    let Some((_, _, first)) = ranks.first() else {
        return Err(options("--tp must be at least 1".into()));
    };
    let (shape, batch) = (first.shape, first.batch);
    let m = shape.micro_batches;
    if batch % (dp * m) != 0 {
        return Err(PipelineError::ReplicaBatch {
            batch,
            replicas: dp,
            micro_batches: m,
        }
        .into());
    }
    let stride = ranks.iter().map(|(f, _, _)| f.instance).max().unwrap_or(1);
    let mut graphs = Vec::with_capacity(dp * tp);
    for d in 0..dp {
        for (t, (forward, typed, prepared)) in ranks.iter().enumerate() {
            let devices: Vec<String> = (0..pp).map(|s| worker_device(mesh.rank(t, d, s))).collect();
            let dp_groups: Vec<String> = (0..pp).map(|s| dp_stage_group(s, t)).collect();
            let tensor = TensorStages {
                groups: (0..pp).map(|s| tp_stage_group(s, d)).collect(),
                instance_stride: stride,
                shards: forward.renames.values().cloned().collect(),
            };
            let mut g = rewrite(&RewriteInput {
                graph: typed,
                stages: &prepared.stages,
                shape,
                orders: &prepared.orders,
                spec,
                features,
                labels,
                batch_size: batch / dp,
                devices: &devices,
                replicas: dp,
                replica: d,
                dp_groups: &dp_groups,
                tensor: Some(&tensor),
            })?;
            g.eval = EvalNames {
                features: features.to_string(),
                labels: labels.to_string(),
                loss: spec.loss.clone(),
                metrics: spec.metrics.clone(),
            };
            graphs.push(g);
        }
    }
    // Evaluation on worker 0, from every shard of replica 0 where its stage holds it.
    let shard_devices: Vec<std::collections::HashMap<String, String>> = graphs[..tp]
        .iter()
        .map(|g| {
            g.training
                .def
                .nodes
                .iter()
                .filter(|n| n.op == "Variable")
                .map(|n| (n.name.clone(), n.device.clone()))
                .collect()
        })
        .collect();
    let shard_device = |v: &NodeDef, r: usize| -> Result<String, StrategyError> {
        let name = shard_name(&v.name, r, tp);
        shard_devices
            .get(r)
            .and_then(|m| m.get(&name))
            .cloned()
            .ok_or_else(|| StrategyError::from(PipelineError::Internal(format!("no variable `{name}`"))))
    };
    if let Some(g) = graphs.first_mut() {
        add_eval_copy(g, &def, &shards, spec, tp, &shard_device, true)?;
    }
    let task = |t: usize, d: usize, s: usize| task_name("worker", mesh.rank(t, d, s) as u32);
    let mut groups = Vec::new();
    for s in 0..pp {
        for d in 0..dp {
            groups.push(CollectiveGroup {
                key: tp_stage_group(s, d),
                members: (0..tp).map(|t| task(t, d, s)).collect(),
            });
        }
    }
    if dp > 1 {
        for s in 0..pp {
            for t in 0..tp {
                groups.push(CollectiveGroup {
                    key: dp_stage_group(s, t),
                    members: (0..dp).map(|d| task(t, d, s)).collect(),
                });
            }
        }
    }
    Ok(MeshGraphs {
        graphs,
        shards,
        shape,
        groups,
    })
}
