//! The evaluation of `--mesh dp=D,ep=E,pp=P` on replica 0's stages: one forward pass of the
//! held-out batch through the one-process forward graph cut as replica 0's training graph is
//! cut, each op on its stage's worker of replica 0 (`pipeline::eval::add_sharded_stage_eval`
//! with one rank), reading that stage's weights there.
//!
//! Each MoE layer runs whole on its stage's worker of replica 0: its expert variables are
//! joined there from the `E` shards of the stage's first expert-parallel group (shard `j` on
//! replica `j`'s worker of the same stage; under ZeRO-3 each from its flat shards over its
//! holders, and every dense parameter from the stage's `D` replicas' flat shards), so expert
//! weights move within their stage only, never between stages. Between stages only the
//! evaluation's activations cross (and the labels to the last stage, the loss to the chief).
//!
//! Why joining and not the all-to-all over the stage's expert group: it is exact by
//! construction (the one-process MoE layer on the whole experts, its capacity counted over the
//! whole held-out batch as one process counts it), and needs no evaluation collectives; it
//! costs `(E−1)/E` of each stage's expert weights sent within the stage per evaluation batch,
//! and replica 0's stage worker holds its stage's whole experts while it evaluates.
//!
//! The placeholders take whole batches of the global batch size (static shapes, as the 3D
//! mesh's; a text's held-out batches are whole).

use super::{eval_weights, EvalCopy, MoeLayer};
use crate::strategy::pipeline::eval::{add_sharded_stage_eval, RankStages};
use crate::strategy::pipeline::schedule::PipelineShape;
use crate::strategy::pipeline::stages::{batch_ops, StageMap};
use crate::strategy::pipeline::PipelineError;
use crate::strategy::{ReplicaGraph, StrategyError};
use dflow_graph::train::TrainSpec;
use dflow_graph::{Graph, GraphDef};
use std::collections::{HashMap, HashSet};

/// What [`add_staged_eval`] needs besides replica 0's graph.
pub(crate) struct StagedEval<'a> {
    /// The one-process forward graph and its definition.
    pub graph: &'a Graph,
    /// `graph`'s definition.
    pub forward: &'a GraphDef,
    /// Its MoE layers.
    pub layers: &'a [MoeLayer],
    /// The virtual stage of replica 0's ops, under their one-process names.
    pub cut: &'a HashMap<String, usize>,
    /// Stages, micro-batches, chunks.
    pub shape: PipelineShape,
    /// Replica 0's worker of each pipeline stage.
    pub devices: Vec<String>,
    /// Where the shards live ([`EvalCopy::shard_device`]) and ZeRO-3.
    pub copy: EvalCopy<'a>,
    /// The loss and metrics.
    pub spec: &'a TrainSpec,
    /// The features placeholder.
    pub features: &'a str,
    /// The labels placeholder.
    pub labels: &'a str,
    /// Rows of a whole held-out batch (the global batch size).
    pub rows: usize,
}

/// The stage of every op of the one-process graph: replica 0's where the op is in its graph;
/// else (an op of an MoE layer's one-process form) the latest stage among its inputs', or for
/// an op without inputs the earliest among its readers'.
fn stage_map(s: &StagedEval<'_>) -> Result<StageMap, StrategyError> {
    Ok(one_process_stages(
        s.graph, s.cut, s.shape, s.features, s.labels,
    ))
}

/// The stage of every op of the one-process graph `g` from `cut` (the virtual stage of a
/// replica's ops under their one-process names): `cut`'s where the op is in it; else the
/// latest stage among its inputs', or for an op without inputs the earliest among its
/// readers' (stage 0 where none is known).
pub(crate) fn one_process_stages(
    g: &Graph,
    cut: &HashMap<String, usize>,
    shape: PipelineShape,
    features: &str,
    labels: &str,
) -> StageMap {
    let mut stage: Vec<Option<usize>> = g
        .node_indices()
        .map(|i| cut.get(&g.node(i).name).copied())
        .collect();
    let order = g.topo_order();
    for &i in &order {
        if stage[i.index()].is_none() {
            stage[i.index()] = g
                .inputs(i)
                .into_iter()
                .filter_map(|(p, _)| stage[p.index()])
                .max();
        }
    }
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); g.num_nodes()];
    for &i in &order {
        for (p, _) in g.inputs(i) {
            readers[p.index()].push(i.index());
        }
    }
    for &i in order.iter().rev() {
        if stage[i.index()].is_none() {
            stage[i.index()] = readers[i.index()].iter().filter_map(|&r| stage[r]).min();
        }
    }
    let feeds: Vec<_> = [features, labels]
        .iter()
        .filter_map(|f| g.find(f))
        .collect();
    StageMap {
        stage: stage.into_iter().map(|x| x.unwrap_or(0)).collect(),
        batch_op: batch_ops(g, &feeds),
        virtual_stages: shape.virtual_stages(),
    }
}

/// Points replica 0's graph `g0`'s evaluation at the one-process forward pass on its stages
/// (see the module docs). Returns `false`, changing nothing, when the stages cannot carry it
/// (a crossing tensor of no static size): the caller joins it on worker 0 instead.
pub(crate) fn add_staged_eval(
    g0: &mut ReplicaGraph,
    s: &StagedEval<'_>,
    instance_base: i64,
) -> Result<bool, StrategyError> {
    let stages = stage_map(s)?;
    // Every variable's stage (one-process name): its readers'.
    let g = s.graph;
    let mut var_stage: HashMap<String, usize> = HashMap::new();
    for i in g.node_indices() {
        let n = g.node(i);
        if n.op_def().is_variable {
            var_stage.insert(n.name.clone(), stages.stage[i.index()]);
        }
    }
    let mut taken: HashSet<String> = g0
        .training
        .def
        .nodes
        .iter()
        .map(|n| n.name.clone())
        .collect();
    let devices = s.devices.clone();
    let shape = s.shape;
    let join_device = |v: &str| -> Result<String, StrategyError> {
        let st = var_stage
            .get(v)
            .ok_or_else(|| PipelineError::Internal(format!("no stage for `{v}`")))?;
        devices
            .get(shape.device_of(*st))
            .cloned()
            .ok_or_else(|| PipelineError::Internal(format!("no device for `{v}`")).into())
    };
    let weights = eval_weights(
        s.graph,
        s.forward,
        s.layers,
        &s.copy,
        &mut taken,
        &join_device,
    )?;
    let no_devices = HashMap::new();
    let rank = RankStages {
        graph: s.graph,
        stages: &stages,
        devices: s.devices.clone(),
        groups: Vec::new(),
        own: HashSet::new(),
        variable_device: &no_devices,
        weights: weights.map,
        weight_nodes: weights.nodes,
        copy_shared: true,
    };
    add_sharded_stage_eval(
        g0,
        &[rank],
        s.shape,
        s.spec,
        s.features,
        s.labels,
        s.rows,
        instance_base,
    )
}

#[cfg(test)]
mod tests {
    use crate::job::task_name;
    use crate::strategy::expert::Expert;
    use crate::strategy::pipeline::schedule::ScheduleKind;
    use crate::strategy::pipeline::Pipeline;
    use crate::strategy::test_support::{moe_of, tiny_moe_gpt};
    use crate::strategy::{JobInput, Strategy};
    use dflow_graph::{ClusterSpec, DeviceName, Graph};
    use std::collections::BTreeSet;

    /// A two-block GPT with 4-expert MoE MLPs, its head untied (a tied embedding would cross
    /// once per evaluation batch, as once per training step).
    fn moe_gpt() -> (Graph, dflow_graph::train::TrainSpec) {
        tiny_moe_gpt(|c| {
            c.tie_weights = false;
            moe_of(c).aux_loss_coef = 0.0;
        })
    }

    #[test]
    fn dp2_ep2_pp2_evaluates_on_replica_0s_stages_and_moves_expert_weights_within_a_stage_only() {
        // Worker s·2 + d is stage s of replica d: replica 0's stages are workers 0 and 2; the
        // other expert shard of a stage-s layer (and under ZeRO-3 every flat shard of replica
        // 1) is on worker s·2 + 1.
        let (graph, spec) = moe_gpt();
        let cluster = ClusterSpec::local(&[("worker", 4)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        for zero in [None, Some(1), Some(3)] {
            let plan = Expert {
                bucket_bytes: 1 << 20,
                batch_size: Some(8),
                ep: Some(2),
                zero,
                pipeline: Some(Pipeline {
                    stages: Some(2),
                    micro_batches: 1,
                    schedule: ScheduleKind::GPipe,
                    chunks: 1,
                    batch_size: Some(8),
                }),
            }
            .plan(&input)
            .unwrap();
            let eval = plan.eval_signature().unwrap();
            let w = |i: u32| task_name("worker", i);
            assert!(eval.feeds.iter().all(|f| f.task == w(0)), "{zero:?}");
            assert_eq!(eval.fetch_task.as_deref(), Some(&*w(0)));
            // The evaluation's ops run on workers 0 and 2 only (1 and 3 send shards).
            let defs: Vec<(u32, dflow_graph::GraphDef)> = eval
                .partitions
                .partitions
                .iter()
                .map(|(d, p)| (d.task.unwrap(), p.graph.to_def()))
                .collect();
            let evaluating: BTreeSet<u32> = defs
                .iter()
                .filter(|(_, def)| {
                    def.nodes.iter().any(|n| {
                        n.name.starts_with("eval/")
                            && !matches!(n.op.as_str(), "Variable" | "Identity" | "_Send" | "_Recv")
                    })
                })
                .map(|(t, _)| *t)
                .collect();
            assert_eq!(evaluating, BTreeSet::from([0, 2]), "{zero:?}");
            let kind = |op: &str| -> BTreeSet<String> {
                defs.iter()
                    .flat_map(|(_, d)| d.nodes.iter())
                    .filter(|n| n.op == op)
                    .map(|n| n.name.clone())
                    .collect()
            };
            let (variables, consts) = (kind("Variable"), kind("Const"));
            let task = |d: &str| DeviceName::parse(d).unwrap().task.unwrap();
            let mut within = Vec::new();
            let mut between = Vec::new();
            for p in eval
                .partitions
                .pairs
                .iter()
                .filter(|p| !p.client_terminated && !p.is_control)
            {
                let node = p.tensor_name.split(':').next().unwrap().to_string();
                let (from, to) = (task(&p.send_device), task(&p.recv_device));
                if from / 2 == to / 2 {
                    within.push(node);
                } else {
                    between.push(node);
                }
            }
            // Between stages: the evaluation's activations, labels and loss (and constants of
            // the training graph), never a weight, a shard or a join of them.
            for node in &between {
                assert!(!variables.contains(node), "{zero:?}: {node} crosses stages");
                assert!(
                    (node.starts_with("eval/") || consts.contains(node))
                        && !node.ends_with("/sent")
                        && !node.contains("/shard_"),
                    "{zero:?}: {node} crosses stages"
                );
            }
            assert!(
                between.iter().any(|n| n.contains("residual")),
                "{zero:?}: {between:?}"
            );
            // Within a stage: replica 1's expert shard (under ZeRO-3 its flat shards) to
            // replica 0's worker of the stage.
            assert!(
                within.iter().any(|n| n.contains("experts")),
                "{zero:?}: {within:?}"
            );
        }
    }
}
