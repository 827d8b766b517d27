//! Tensor parallelism inside pipeline stages (`--mesh tp=T,pp=P`) and the 3D mesh
//! (`--mesh dp=D,tp=T,pp=P`): each tensor-parallel rank's Megatron graph (`rank_forward`)
//! cut into stages by the pipeline rewrite ([`crate::strategy::pipeline`]), in Megatron-core's
//! rank order: stage `s`, shard `t`, replica `d` on worker `s·(D·T) + d·T + t`.
//!
//! - The stages are cut on each rank's graph by the pipeline's balanced cuts; the ranks hold
//!   shards of equal sizes, so the cuts agree (checked op by op: a disagreement is an error).
//! - Every micro-batch copy of a collective goes to the tensor-parallel group of its stage and
//!   replica ([`tp_stage_group`]) under an instance key of its own; each worker chains its
//!   collectives in one topological order, the same on every rank of a group.
//! - With `D > 1`, each stage's gradients are summed over the ranks with the same stage and
//!   shard ([`dp_stage_group`]), exactly as a plain pipeline sums them over its replicas; with
//!   ZeRO (`--zero-stage 1|2|3`), that group runs ZeRO's step instead
//!   ([`crate::strategy::pipeline::zero`]): each (stage, shard) keeps its replica's `1/D`
//!   shard of its weights' Adam slots (stage 2: and of their summed gradients; stage 3: and of
//!   the weights themselves, all-gathered over the group on the stage's worker before every
//!   micro-batch's forward and backward use, each worker's collectives, both groups', then
//!   chained and numbered in one order), and clipping's `Σ‖g‖²` of the tensor-parallel shards
//!   is summed over the stage's tensor-parallel group too, the replicated weights' counted
//!   once.
//! - Clipping uses the whole model's norm: per stage, the shards' `Σ‖g‖²` all-reduced over the
//!   stage's tensor-parallel group plus the replicated parameters'; the stages' sums meet on
//!   the loss's stage.
//! - Evaluation runs on replica 0's stages, each tensor-parallel rank's forward copy on its own
//!   shards with its stage's collectives (`crate::strategy::pipeline::eval`); under ZeRO-3
//!   (flat shards) each rank's weights joined first from their flat shards over the stage's
//!   data-parallel group on the rank's stage worker ([`zero3_weights`]): no weight crosses
//!   stages. The older evaluation on worker 0 (`eval_copy`) remains for a crossing tensor of
//!   no static size.

use super::{
    check_job, eval_copy, options, rank_forward, shard_name, Gpt, RankAt, RankForward,
    ShardedWeight, GROUP,
};
use crate::job::{task_name, CollectiveGroup};
use crate::mesh::Mesh;
use crate::strategy::pipeline::eval::{add_sharded_stage_eval, RankStages};
use crate::strategy::pipeline::gradients::stage_group;
use crate::strategy::pipeline::rewrite::{rewrite, RewriteInput, TensorStages};
use crate::strategy::pipeline::schedule::PipelineShape;
use crate::strategy::pipeline::zero::ReplicaZero;
use crate::strategy::pipeline::{worker_device, Pipeline, PipelineError, Prepared};
use crate::strategy::zero::params::shard_name as zero_shard_name;
use crate::strategy::{EvalNames, ReplicaGraph, StrategyError};
use dflow_graph::train::TrainSpec;
use dflow_graph::{DType, Graph, NodeDef};
use std::collections::{HashMap, HashSet};

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
/// `pipeline` says, with ZeRO over each (stage, shard)'s data-parallel group when `zero` is
/// given (see the module docs).
pub fn mesh3d_training(
    graph: &Graph,
    spec: &TrainSpec,
    mesh: &Mesh,
    pipeline: &Pipeline,
    zero: Option<ReplicaZero>,
    features: &str,
    labels: &str,
) -> Result<MeshGraphs, StrategyError> {
    let (tp, dp, pp) = (mesh.tp, mesh.dp, mesh.pp);
    if super::hand::declares_placements(graph) {
        return Err(options(format!(
            "mesh {mesh}: placements written by hand (`_sharding`) do not run over a pipeline \
             axis (pp={pp}); drop the pp axis (--mesh dp=D,tp=T with D·T workers)"
        )));
    }
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
    let mut first_cut: HashMap<String, usize> = HashMap::new();
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
        // The ranks' graphs differ in their shards' names (and the last rank's padding mask):
        // compare the stages of the ops they share, under their one-process names.
        let original: HashMap<&String, &String> =
            forward.renames.iter().map(|(k, v)| (v, k)).collect();
        for i in typed.node_indices() {
            let name = &typed.node(i).name;
            let name = original.get(name).map_or(name, |o| *o);
            let stage = prepared.stages.stage[i.index()];
            match first_cut.get(name) {
                Some(&s) if s != stage => {
                    let message = format!(
                        "tensor-parallel rank {t} puts `{name}` on stage {stage}, \
                         rank 0 on stage {s}"
                    );
                    return Err(PipelineError::Internal(message).into());
                }
                Some(_) => {}
                None if t == 0 => {
                    first_cut.insert(name.clone(), stage);
                }
                None => {}
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
                experts: None,
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
                replica_devices: &[],
                tensor: Some(&tensor),
                zero,
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
    // Evaluation on worker 0, from every shard where its stage holds it (under ZeRO-3, every
    // replica's flat shard of it).
    let zero3 = zero.filter(|z| z.stage >= 3).map(|_| dp);
    let variable_devices: Vec<HashMap<String, String>> = graphs
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
    let sharded: HashSet<&str> = shards.iter().map(|s| s.name.as_str()).collect();
    let shard_device = |v: &NodeDef, r: usize, d: usize| -> Result<String, StrategyError> {
        let mut name = if sharded.contains(v.name.as_str()) {
            shard_name(&v.name, r, tp)
        } else {
            v.name.clone()
        };
        if zero3.is_some() {
            name = zero_shard_name(&name, d, dp);
        }
        variable_devices
            .get(d * tp + r)
            .and_then(|m| m.get(&name))
            .cloned()
            .ok_or_else(|| {
                StrategyError::from(PipelineError::Internal(format!("no variable `{name}`")))
            })
    };
    // The evaluation runs on replica 0's stages, each rank on its own shards
    // ([`crate::strategy::pipeline::eval`]); under ZeRO-3 each rank's weights are first joined
    // from their flat shards over the stage's data-parallel group on the rank's stage worker
    // of replica 0 ([`zero3_weights`]).
    let instance_base = super::eval::first_free_instance(&graphs);
    let joins: Vec<RankWeights> = match zero3 {
        Some(dp) => zero3_weights(&ranks, &graphs, tp, dp)?,
        None => (0..tp).map(|_| (HashMap::new(), Vec::new())).collect(),
    };
    let staged = match graphs.first_mut() {
        Some(g) => {
            let ranks: Vec<RankStages<'_>> = (ranks.iter().zip(joins))
                .enumerate()
                .map(
                    |(t, ((forward, typed, prepared), (weights, weight_nodes)))| RankStages {
                        graph: typed,
                        stages: &prepared.stages,
                        devices: (0..pp).map(|s| worker_device(mesh.rank(t, 0, s))).collect(),
                        groups: (0..pp).map(|s| tp_stage_group(s, 0)).collect(),
                        own: forward.renames.values().cloned().collect(),
                        variable_device: &variable_devices[t],
                        weights,
                        weight_nodes,
                        // Under ZeRO-3 rank 0's ops on weights read the joined shards too.
                        copy_shared: t > 0 || zero3.is_some(),
                    },
                )
                .collect();
            add_sharded_stage_eval(
                g,
                &ranks,
                shape,
                spec,
                features,
                labels,
                batch,
                instance_base,
            )?
        }
        None => false,
    };
    if let Some(g) = graphs.first_mut().filter(|_| !staged) {
        eval_copy(g, &def, &shards, spec, tp, &shard_device, true, zero3)?;
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

/// One rank's evaluation weights: the tensor each variable is read from, and the nodes that
/// make them.
type RankWeights = (HashMap<String, String>, Vec<NodeDef>);

/// Under ZeRO-3 over `dp` replicas, per tensor-parallel rank `t` of replica 0: the tensor each
/// variable of the rank's forward graph is read from in the evaluation, and the nodes that
/// make it. Each of the rank's own weights (its shards, and for rank 0 the replicated ones) is
/// joined from its `dp` flat shards (`{w}/shard_{d}_of_{dp}`, the variables of graph
/// `d·tp + t`, on the worker of the weight's stage in replica `d`) on replica 0's worker of
/// its stage (`PackFlat`, then `FlatSlice` to the weight's shape): the shards cross within the
/// stage's data-parallel group only, never between stages. A rank `t > 0` reads the replicated
/// weights from rank 0's joins (its stage's worker, as without ZeRO-3). A variable without
/// flat shards is read as it is.
fn zero3_weights(
    ranks: &[(RankForward, Graph, Prepared)],
    graphs: &[ReplicaGraph],
    tp: usize,
    dp: usize,
) -> Result<Vec<RankWeights>, StrategyError> {
    let variables: Vec<HashMap<&str, &NodeDef>> = graphs
        .iter()
        .map(|g| {
            (g.training.def.nodes.iter())
                .filter(|n| n.op == "Variable")
                .map(|n| (n.name.as_str(), n))
                .collect()
        })
        .collect();
    let mut out: Vec<RankWeights> = Vec::with_capacity(tp);
    for (t, (forward, typed, _)) in ranks.iter().enumerate() {
        let own: HashSet<&String> = forward.renames.values().collect();
        let mut weights = HashMap::new();
        let mut nodes = Vec::new();
        for i in typed.node_indices() {
            let v = typed.node(i);
            if !v.op_def().is_variable {
                continue;
            }
            if t > 0 && !own.contains(&v.name) {
                if let Some(w) = out.first().and_then(|(w, _)| w.get(&v.name)) {
                    weights.insert(v.name.clone(), w.clone());
                }
                continue;
            }
            let mut pieces = Vec::with_capacity(dp);
            for d in 0..dp {
                let piece = zero_shard_name(&v.name, d, dp);
                match variables
                    .get(d * tp + t)
                    .and_then(|g| g.get(piece.as_str()))
                {
                    Some(p) => {
                        if t > 0 || d > 0 {
                            let mut p = (*p).clone();
                            p.colocate_with.clear();
                            nodes.push(p);
                        }
                        pieces.push(p);
                    }
                    None => break,
                }
            }
            if pieces.len() != dp {
                continue; // not flat-sharded: read as it is
            }
            let dims = typed
                .output_type(i, 0)
                .and_then(|o| o.shape.as_static())
                .ok_or_else(|| {
                    PipelineError::Internal(format!("`{}` has no static shape", v.name))
                })?;
            let device = pieces[0].device.clone();
            let flat = format!("eval/zero3/{}/flat", v.name);
            let whole = format!("eval/zero3/{}/whole", v.name);
            let op = |name: &str, op: &str, inputs: Vec<String>| NodeDef {
                name: name.to_string(),
                op: op.into(),
                inputs,
                device: device.clone(),
                colocate_with: vec![],
                attrs: Default::default(),
            };
            nodes.push(op(
                &flat,
                "PackFlat",
                pieces.iter().map(|p| p.name.clone()).collect(),
            ));
            let mut slice = op(&whole, "FlatSlice", vec![flat]);
            slice
                .attrs
                .insert("offset".into(), dflow_graph::AttrValue::Int(0));
            slice.attrs.insert(
                "shape".into(),
                dflow_graph::AttrValue::Shape(dflow_graph::Shape::known(&dims)),
            );
            nodes.push(slice);
            weights.insert(v.name.clone(), whole);
        }
        out.push((weights, nodes));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::pipeline::schedule::ScheduleKind;
    use crate::strategy::tensor::TensorParallel;
    use crate::strategy::{JobInput, Strategy};
    use dflow_graph::layers::{gpt, GptConfig};
    use dflow_graph::{AttrValue, Shape};
    use std::collections::HashSet;

    /// A small GPT whose placeholders take any batch of 4 tokens.
    fn model() -> (Graph, TrainSpec) {
        let cfg = GptConfig {
            vocab_size: 11,
            block_size: 4,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            grad_clip: Some(0.5),
            ..GptConfig::default()
        };
        let mut m = gpt(&cfg).unwrap();
        let spec = m.def.train.clone().unwrap();
        for n in &mut m.def.nodes {
            if n.op == "Placeholder" {
                n.attrs.insert(
                    "shape".into(),
                    AttrValue::Shape(Shape::partial(vec![None, Some(4)])),
                );
            }
        }
        (Graph::from_def(&m.def).unwrap(), spec)
    }

    fn pipeline(stages: usize, micro_batches: usize, batch: usize) -> Pipeline {
        Pipeline {
            stages: Some(stages),
            micro_batches,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
            batch_size: Some(batch),
        }
    }

    fn strategy(tp: usize, p: Pipeline) -> TensorParallel {
        TensorParallel {
            tp: Some(tp),
            bucket_bytes: 1 << 20,
            batch_size: p.batch_size,
            pipeline: Some(p),
            zero_stage: None,
        }
    }

    fn attr(n: &NodeDef, key: &str) -> String {
        match n.attrs.get(key) {
            Some(AttrValue::String(s)) => s.to_string(),
            Some(AttrValue::Int(i)) => i.to_string(),
            _ => String::new(),
        }
    }

    /// The collectives (not `CollectiveTpCopy`) that worker `task` calls in `g`'s training
    /// step (not the evaluation's, `eval/...`, which graph 0 holds), in the graph's
    /// topological order.
    fn order(g: &ReplicaGraph, task: u32) -> Vec<String> {
        g.graph
            .topo_order()
            .into_iter()
            .map(|i| g.graph.node(i))
            .filter(|n| n.op.starts_with("Collective") && n.op != "CollectiveTpCopy")
            .filter(|n| !n.name.starts_with("eval/"))
            .filter(|n| {
                dflow_graph::DeviceName::parse(n.device.as_ref())
                    .is_ok_and(|d| d.task == Some(task))
            })
            .map(|n| n.name.clone())
            .collect()
    }

    #[test]
    fn dp2_tp2_pp2_groups_are_megatron_cores_and_each_stage_talks_in_its_own() {
        let (graph, spec) = model();
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 8)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let plan = strategy(2, pipeline(2, 2, 8)).plan(&input).unwrap();
        let w = |i: u32| task_name("worker", i);
        let groups: Vec<(String, Vec<String>)> = plan
            .groups
            .iter()
            .map(|g| (g.key.clone(), g.members.clone()))
            .collect();
        // Issue 20's lists for t = d = p = 2: TP {0,1}{2,3}{4,5}{6,7}, DP {0,2}{1,3}{4,6}{5,7}.
        assert_eq!(
            groups,
            [
                ("tensor_s0_d0".to_string(), vec![w(0), w(1)]),
                ("tensor_s0_d1".to_string(), vec![w(2), w(3)]),
                ("tensor_s1_d0".to_string(), vec![w(4), w(5)]),
                ("tensor_s1_d1".to_string(), vec![w(6), w(7)]),
                ("pipeline/stage0_t0".to_string(), vec![w(0), w(2)]),
                ("pipeline/stage0_t1".to_string(), vec![w(1), w(3)]),
                ("pipeline/stage1_t0".to_string(), vec![w(4), w(6)]),
                ("pipeline/stage1_t1".to_string(), vec![w(5), w(7)]),
            ]
        );
        assert_eq!(plan.batch_parts, 2);
        // Checkpoints hold whole tensors: every shard listed with its two pieces.
        assert!(plan
            .axis_sharded
            .iter()
            .any(|v| v.logical == "transformer.h.1.mlp.c_fc.weight" && v.shards.len() == 2));

        let mesh = Mesh::new(2, 2, 2).unwrap();
        let mg = mesh3d_training(
            &graph,
            &spec,
            &mesh,
            &pipeline(2, 2, 8),
            None,
            "idx",
            "targets",
        )
        .unwrap();
        assert_eq!(mg.graphs.len(), 4);
        // Graph 3 is shard 1 of replica 1: stage 0 on worker 3, stage 1 on worker 7.
        let g = &mg.graphs[3];
        let nodes = &g.training.def.nodes;
        let task_of = |n: &NodeDef| -> u32 {
            let d = dflow_graph::DeviceName::parse(&n.device).unwrap();
            d.task.unwrap()
        };
        let mut keys: HashSet<(u32, String, String)> = HashSet::new();
        let mut per_task: std::collections::BTreeMap<u32, usize> = Default::default();
        for n in nodes.iter().filter(|n| n.op.starts_with("Collective")) {
            let task = task_of(n);
            let group = attr(n, "group_key");
            let want: &[&str] = match task {
                3 => &["tensor_s0_d1", "pipeline/stage0_t1"],
                7 => &["tensor_s1_d1", "pipeline/stage1_t1"],
                t => panic!("collective {} on worker {t}", n.name),
            };
            assert!(want.contains(&group.as_str()), "{} in {group}", n.name);
            // One instance key per collective of a group, micro-batch copies included.
            assert!(
                keys.insert((task, group.clone(), attr(n, "instance_key"))),
                "{} repeats an instance key of {group}",
                n.name
            );
            if n.op != "CollectiveTpCopy" {
                *per_task.entry(task).or_default() += 1;
            }
        }
        // Every stage's collectives but its first wait for another (one chain per worker).
        let collectives: HashSet<&str> = nodes
            .iter()
            .filter(|n| n.op.starts_with("Collective") && n.op != "CollectiveTpCopy")
            .map(|n| n.name.as_str())
            .collect();
        for (task, count) in per_task {
            let chained = nodes
                .iter()
                .filter(|n| collectives.contains(n.name.as_str()) && task_of(n) == task)
                .filter(|n| {
                    n.inputs
                        .iter()
                        .any(|i| i.strip_prefix('^').is_some_and(|c| collectives.contains(c)))
                })
                .count();
            assert_eq!(chained, count - 1, "worker {task}");
        }
        // The tensor-parallel ranks of a stage call the same collectives in the same order,
        // though the last rank's graph has the vocabulary's padding mask (11 tokens, 2 ranks).
        assert!(mg.graphs[1]
            .training
            .def
            .nodes
            .iter()
            .any(|n| n.name == "xent/tp_padding_mask"));
        for (a, b) in [(0, 1), (4, 5)] {
            let (x, y) = (order(&mg.graphs[0], a), order(&mg.graphs[1], b));
            assert!(x.len() > 10, "{x:?}");
            assert_eq!(x, y, "workers {a} and {b}");
        }
        // The rank's shards, and micro-batch copies of Megatron's g for both micro-batches.
        assert!(nodes
            .iter()
            .any(|n| n.name == shard_name("transformer.h.1.mlp.c_fc.weight", 1, 2)));
        for k in 0..2 {
            assert!(nodes
                .iter()
                .any(|n| n.op == "CollectiveTpReduce"
                    && n.name.starts_with(&format!("pipeline/mb{k}/"))));
        }
        // Evaluation runs on replica 0's ranks (workers 0, 1 on stage 0, 4, 5 on stage 1),
        // their collectives in their stage's tensor-parallel group
        // (`pipeline::eval::tests` checks the plan).
        let eval = &mg.graphs[0];
        assert_eq!(eval.eval.features, "eval/idx");
        for n in eval
            .training
            .def
            .nodes
            .iter()
            .filter(|n| n.name.starts_with("eval/"))
        {
            assert!([0, 1, 4, 5].contains(&task_of(n)), "{}", n.name);
            if n.op.starts_with("Collective") {
                let s = task_of(n) as usize / 4;
                assert_eq!(attr(n, "group_key"), tp_stage_group(s, 0), "{}", n.name);
            }
        }
    }

    #[test]
    fn dp2_tp2_pp2_zero_shards_each_stage_and_shards_slots_over_its_dp_group() {
        let (graph, spec) = model();
        let mesh = Mesh::new(2, 2, 2).unwrap();
        for stage in [1u8, 2] {
            let zero = ReplicaZero {
                stage,
                bucket_bytes: 1 << 20,
            };
            let mg = mesh3d_training(
                &graph,
                &spec,
                &mesh,
                &pipeline(2, 2, 8),
                Some(zero),
                "idx",
                "targets",
            )
            .unwrap();
            // Graph d·2 + t: replica d, shard t; stage s on worker s·4 + d·2 + t.
            for (i, g) in mg.graphs.iter().enumerate() {
                let (d, t) = (i / 2, i % 2);
                let nodes = &g.training.def.nodes;
                let task_of = |n: &NodeDef| -> usize {
                    let dev = dflow_graph::DeviceName::parse(&n.device).unwrap();
                    dev.task.unwrap() as usize
                };
                // Every update reads its replica's shard of the slots, on the stage's worker.
                let updates: Vec<&NodeDef> =
                    nodes.iter().filter(|n| n.op == "ApplyAdamW").collect();
                assert!(!updates.is_empty());
                for u in &updates {
                    assert!(
                        u.inputs[1].ends_with(&format!("/adam_m/shard_{d}_of_2")),
                        "{:?}",
                        u.inputs
                    );
                    assert!(u.attrs.contains_key("shard_offset"), "{}", u.name);
                }
                // ZeRO's gradient buckets talk in each (stage, shard)'s dp group; clipping's
                // norm of the tp shards also crosses the stage's tp group.
                let summing = if stage == 1 {
                    "CollectiveAllReduce"
                } else {
                    "CollectiveReduceScatter"
                };
                for s in 0..2 {
                    let worker = s * 4 + d * 2 + t;
                    let on = |prefix: &str, op: &str| -> Vec<&NodeDef> {
                        nodes
                            .iter()
                            .filter(|n| n.op == op && task_of(n) == worker)
                            .filter(|n| n.name.starts_with(prefix))
                            .collect()
                    };
                    let buckets = on("zero/bucket_", summing);
                    assert!(!buckets.is_empty(), "stage {s}");
                    assert!(buckets
                        .iter()
                        .all(|n| attr(n, "group_key") == dp_stage_group(s, t)));
                    let outer = on(
                        "zero/clip/sharded_squared_norm_outer",
                        "CollectiveAllReduce",
                    );
                    assert_eq!(outer.len(), 1, "stage {s}");
                    assert_eq!(attr(outer[0], "group_key"), tp_stage_group(s, d));
                    // No plain all-reduce of whole gradients is left.
                    assert!(on("pipeline/allreduce", "CollectiveAllReduce").is_empty());
                    assert!(on("pipeline/clip", "CollectiveAllReduce").is_empty());
                }
                // One instance key per collective of a group on each worker.
                let mut keys: HashSet<(usize, String, String)> = HashSet::new();
                for n in nodes.iter().filter(|n| n.op.starts_with("Collective")) {
                    assert!(
                        keys.insert((task_of(n), attr(n, "group_key"), attr(n, "instance_key"))),
                        "{} repeats an instance key",
                        n.name
                    );
                }
                // One clipping scale per graph, on the loss's stage.
                let scales: Vec<&NodeDef> =
                    nodes.iter().filter(|n| n.op == "GlobalNormScale").collect();
                assert_eq!(scales.len(), 1);
                assert_eq!(task_of(scales[0]), 4 + d * 2 + t);
            }
            // The tp ranks of a stage, and the replicas of a (stage, shard), call the same
            // collectives in the same order.
            for (a, b, ga, gb) in [(0, 1, 0, 1), (0, 2, 0, 2), (5, 7, 1, 3)] {
                assert_eq!(
                    order(&mg.graphs[ga], a),
                    order(&mg.graphs[gb], b),
                    "workers {a} and {b}"
                );
            }
        }
    }

    #[test]
    fn dp2_tp2_pp2_zero3_gathers_each_stage_shards_weights_per_micro_batch_on_its_worker() {
        let (graph, spec) = model();
        let mesh = Mesh::new(2, 2, 2).unwrap();
        let zero = ReplicaZero {
            stage: 3,
            bucket_bytes: 1 << 20,
        };
        let mg = mesh3d_training(
            &graph,
            &spec,
            &mesh,
            &pipeline(2, 2, 8),
            Some(zero),
            "idx",
            "targets",
        )
        .unwrap();
        let sharded: HashSet<&str> = mg.shards.iter().map(|s| s.name.as_str()).collect();
        let int = |n: &NodeDef, a: &str| match n.attrs.get(a) {
            Some(AttrValue::Int(v)) => *v,
            other => panic!("{} {a}: {other:?}", n.name),
        };
        let task_of = |n: &NodeDef| -> usize {
            let dev = dflow_graph::DeviceName::parse(&n.device).unwrap();
            dev.task.unwrap() as usize
        };
        // The same collective on every rank: its name without the rank's tp and dp shard.
        let strip = |name: &str| -> String {
            let mut s = name.to_string();
            for r in 0..2 {
                s = s.replace(&format!("/tp_{r}_of_2"), "/tp");
                s = s.replace(&format!("/shard_{r}_of_2"), "/shard");
            }
            s
        };
        // Per worker, its collectives (stripped) with their instance keys and groups, in order.
        let mut chains: HashMap<usize, Vec<(String, i64, String)>> = HashMap::new();
        for (i, g) in mg.graphs.iter().enumerate() {
            let (d, t) = (i / 2, i % 2);
            let nodes = &g.training.def.nodes;
            let find = |name: &str| nodes.iter().find(|n| n.name == name);
            let mut stages_used: HashSet<usize> = HashSet::new();
            for v in graph
                .node_indices()
                .filter(|&i| graph.node(i).op == "Variable")
            {
                let var = &graph.node(v).name;
                let mine = if sharded.contains(var.as_str()) {
                    shard_name(var, t, 2)
                } else {
                    var.clone()
                };
                // The rank's weight (its tp shard, or the replicated weight) is never whole:
                // the graph holds its replica's flat half, on one stage's worker.
                assert!(find(&mine).is_none(), "{mine} still whole on graph {i}");
                let shard = find(&zero_shard_name(&mine, d, 2)).unwrap();
                let s = (0..2)
                    .find(|&s| task_of(shard) == s * 4 + d * 2 + t)
                    .unwrap();
                stages_used.insert(s);
                // No other replica's shard is trained here, and the shard's only training
                // readers are on its stage's worker: gathers over its (stage, shard)'s dp group
                // and its update.
                assert!(find(&zero_shard_name(&mine, 1 - d, 2))
                    .is_none_or(|o| i == 0 && task_of(o) == (s * 4 + (1 - d) * 2 + t)));
                let readers: Vec<&NodeDef> = nodes
                    .iter()
                    .filter(|n| !n.name.starts_with("eval/"))
                    .filter(|n| n.inputs.contains(&shard.name))
                    .collect();
                assert!(readers.len() > 2, "{mine}: {readers:?}");
                let mut passes: HashSet<String> = HashSet::new();
                for r in readers {
                    assert_eq!(r.device, shard.device, "{} reads {}", r.name, shard.name);
                    match r.op.as_str() {
                        "ApplyAdamW" => {}
                        "CollectiveAllGather" => {
                            assert_eq!(attr(r, "group_key"), dp_stage_group(s, t));
                            let pass = r
                                .name
                                .strip_prefix(&format!("zero/{mine}/all_gather_"))
                                .unwrap();
                            assert!(passes.insert(pass.to_string()), "{} twice", r.name);
                            // The gathered copy is read by one micro-batch's pass only, so it
                            // is dropped after that pass.
                            let Some((_, k)) = pass.split_once("_mb") else {
                                // But the tied embedding's shard, gathered once per step for
                                // the head's stage, where it arrives (as in a plain pipeline).
                                let value = format!("zero/{mine}/{pass}");
                                let uses: Vec<&str> = nodes
                                    .iter()
                                    .filter(|n| n.inputs.contains(&value))
                                    .map(|n| n.name.as_str())
                                    .collect();
                                assert_eq!(
                                    (var.as_str(), pass, &uses[..]),
                                    (
                                        "transformer.wte.weight",
                                        "forward",
                                        &[format!("pipeline/shared/{mine}/at_stage1").as_str()][..]
                                    ),
                                    "{} outside a micro-batch",
                                    r.name
                                );
                                continue;
                            };
                            let k = &k[..1];
                            let value = format!("zero/{mine}/{pass}");
                            let uses: Vec<&NodeDef> =
                                nodes.iter().filter(|n| n.inputs.contains(&value)).collect();
                            assert!(!uses.is_empty(), "{value}");
                            for u in uses {
                                assert!(
                                    u.name.contains(&format!("pipeline/mb{k}/")),
                                    "{} reads {value}",
                                    u.name
                                );
                            }
                        }
                        op => panic!("{} ({op}) reads {}", r.name, shard.name),
                    }
                }
                // A forward gather for each micro-batch.
                for k in 0..2 {
                    assert!(
                        passes
                            .iter()
                            .any(|p| p.ends_with(&format!("_mb{k}_forward"))),
                        "{mine}: {passes:?}"
                    );
                }
            }
            assert_eq!(stages_used.len(), 2);
            // A matrix's backward reads a gather per micro-batch too.
            let w = shard_name("transformer.h.1.mlp.c_proj.weight", t, 2);
            for k in 0..2 {
                assert!(
                    nodes.iter().any(|n| n.op == "CollectiveAllGather"
                        && n.name.starts_with(&format!("zero/{w}/all_gather_stage"))
                        && n.name.ends_with(&format!("_mb{k}_backward"))),
                    "{w} backward {k}"
                );
            }
            // Nothing is assigned back.
            assert!(!nodes.iter().any(|n| n.op == "Assign"));
            // Every worker's collectives (tp's and dp's) form one chain numbered 1, 2, ...
            for s in 0..2 {
                let worker = s * 4 + d * 2 + t;
                let mut chain: Vec<&NodeDef> = nodes
                    .iter()
                    .filter(|n| n.op.starts_with("Collective") && n.op != "CollectiveTpCopy")
                    .filter(|n| task_of(n) == worker && !n.name.starts_with("eval/"))
                    .collect();
                chain.sort_by_key(|n| int(n, "instance_key"));
                for (k, w) in chain.windows(2).enumerate() {
                    assert_eq!(int(w[0], "instance_key"), k as i64 + 1);
                    assert!(
                        w[1].inputs.contains(&format!("^{}", w[0].name)),
                        "{} does not wait for {}",
                        w[1].name,
                        w[0].name
                    );
                }
                let groups: HashSet<String> = chain.iter().map(|n| attr(n, "group_key")).collect();
                assert_eq!(
                    groups,
                    HashSet::from([tp_stage_group(s, d), dp_stage_group(s, t)]),
                    "worker {worker}"
                );
                chains.insert(
                    worker,
                    chain
                        .iter()
                        .map(|n| (strip(&n.name), int(n, "instance_key"), attr(n, "group_key")))
                        .collect(),
                );
            }
            // One clipping scale per graph, on the loss's stage.
            let scales: Vec<&NodeDef> =
                nodes.iter().filter(|n| n.op == "GlobalNormScale").collect();
            assert_eq!(scales.len(), 1);
            assert_eq!(task_of(scales[0]), 4 + d * 2 + t);
        }
        // The tp ranks of a (stage, replica) and the replicas of a (stage, shard) call the same
        // collectives under the same instance keys.
        let same = |a: &Vec<(String, i64, String)>, b: &Vec<(String, i64, String)>| {
            a.iter().zip(b).all(|(x, y)| x.0 == y.0 && x.1 == y.1) && a.len() == b.len()
        };
        for (a, b) in [
            (0, 1),
            (2, 3),
            (0, 2),
            (1, 3),
            (4, 5),
            (4, 6),
            (5, 7),
            (6, 7),
        ] {
            assert!(same(&chains[&a], &chains[&b]), "workers {a} and {b}");
        }
        // Evaluation runs on replica 0's stages (workers 0, 1, 4, 5), each rank's weights joined
        // from their flat shards on the rank's stage worker of replica 0.
        let eval = &mg.graphs[0].training.def.nodes;
        let evaluated: HashSet<usize> = eval
            .iter()
            .filter(|n| n.name.starts_with("eval/"))
            .map(task_of)
            .collect();
        assert_eq!(evaluated, HashSet::from([0, 1, 4, 5]));
        let w = "transformer.h.1.mlp.c_fc.weight";
        let flat = eval
            .iter()
            .find(|n| n.name == format!("eval/zero3/{}/flat", shard_name(w, 1, 2)))
            .unwrap();
        assert_eq!(task_of(flat), 5);
        assert_eq!(
            flat.inputs,
            [
                zero_shard_name(&shard_name(w, 1, 2), 0, 2),
                zero_shard_name(&shard_name(w, 1, 2), 1, 2)
            ]
        );
        // Replica 1's shard of tp shard 1 of a stage-1 weight lives on worker 7, in the same
        // (stage, shard)'s data-parallel group.
        let piece = eval
            .iter()
            .find(|n| n.op == "Variable" && n.name == flat.inputs[1])
            .unwrap();
        assert_eq!(task_of(piece), 7);
    }

    #[test]
    fn dp2_tp2_pp2_zero3_plan_joins_the_flat_shards_then_the_tp_shards_for_checkpoints() {
        let (graph, spec) = model();
        let cluster = dflow_graph::ClusterSpec::local(&[("worker", 8)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let s = TensorParallel {
            zero_stage: Some(3),
            ..strategy(2, pipeline(2, 2, 8))
        };
        let plan = s.plan(&input).unwrap();
        for logical in [
            shard_name("transformer.h.1.mlp.c_fc.weight", 1, 2),
            format!(
                "{}/adam_v",
                shard_name("transformer.h.0.attn.c_attn.weight", 0, 2)
            ),
            "transformer.ln_f.weight".to_string(),
        ] {
            let joined = plan.sharded.iter().find(|v| v.logical == logical).unwrap();
            assert_eq!(
                joined.shards,
                [
                    zero_shard_name(&logical, 0, 2),
                    zero_shard_name(&logical, 1, 2)
                ]
            );
        }
        assert!(plan
            .axis_sharded
            .iter()
            .any(|v| v.logical == "transformer.h.1.mlp.c_fc.weight" && v.shards.len() == 2));
    }

    #[test]
    fn meshes_that_do_not_fit_are_refused_naming_them() {
        let (graph, spec) = model();
        let six = dflow_graph::ClusterSpec::local(&[("worker", 6)]).unwrap();
        let input = JobInput::new(&graph, &spec, &six, "idx", "targets");
        let e = strategy(2, pipeline(2, 2, 8)).plan(&input).unwrap_err();
        assert!(
            e.to_string()
                .contains("tp=2 × pp=2 does not divide the cluster's 6 workers"),
            "{e}"
        );
        let eight = dflow_graph::ClusterSpec::local(&[("worker", 8)]).unwrap();
        let input = JobInput::new(&graph, &spec, &eight, "idx", "targets");
        // 8 rows do not split into 2 replicas × 8 micro-batches.
        let e = strategy(2, pipeline(2, 8, 8)).plan(&input).unwrap_err();
        assert!(
            e.to_string()
                .contains("batch 8 does not split into 2 pipeline replicas × 8 micro-batches"),
            "{e}"
        );
        // tp=4 does not divide the 2 heads.
        let e = strategy(4, pipeline(2, 1, 8)).plan(&input).unwrap_err();
        assert!(e.to_string().contains("does not divide by --tp 4"), "{e}");
        // ZeRO runs beside tp inside the stages at stages 1 to 3, over dp ≥ 2.
        let zero = |stage: u8| TensorParallel {
            zero_stage: Some(stage),
            ..strategy(2, pipeline(2, 2, 8))
        };
        assert!(zero(2).plan(&input).is_ok());
        assert!(zero(3).plan(&input).is_ok());
        let e = zero(4).plan(&input).unwrap_err().to_string();
        assert!(e.contains("ZeRO's stages are 1, 2 and 3"), "{e}");
        let four = dflow_graph::ClusterSpec::local(&[("worker", 4)]).unwrap();
        let input = JobInput::new(&graph, &spec, &four, "idx", "targets");
        let e = zero(1).plan(&input).unwrap_err().to_string();
        assert!(e.contains("this mesh has one replica"), "{e}");
    }
}
