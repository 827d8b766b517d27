//! The evaluation of a pipeline with tensor parallelism inside its stages (the 3D mesh, and the
//! `dp × ep × pp` job as one rank): every tensor-parallel rank of replica 0 evaluates its own
//! stages on its shards ([`add_sharded_stage_eval`]).

use super::copy::node;
use super::{eval_name, stage_copy, StageCopy, SCOPE};
use crate::strategy::pipeline::schedule::PipelineShape;
use crate::strategy::pipeline::stages::StageMap;
use crate::strategy::pipeline::PipelineError;
use crate::strategy::{EvalNames, StrategyError};
use dflow_graph::train::TrainSpec;
use dflow_graph::{AttrValue, Graph, InputRef, NodeDef};
use std::collections::{HashMap, HashSet};

/// One tensor-parallel rank of replica 0 of a `dp × tp × pp` job, for
/// [`add_sharded_stage_eval`].
pub(crate) struct RankStages<'a> {
    /// The rank's forward graph (its shards in place of the sharded weights).
    pub graph: &'a Graph,
    /// Its cut into stages.
    pub stages: &'a StageMap,
    /// The device of each of the rank's pipeline stages.
    pub devices: Vec<String>,
    /// The tensor-parallel collective group of each of those devices.
    pub groups: Vec<String>,
    /// The rank's own variables (its shards), added to the evaluation where they live.
    pub own: HashSet<String>,
    /// Where the rank's training graph put each variable.
    pub variable_device: &'a HashMap<String, String>,
    /// The tensor each of the rank's variables is read from instead, where it is not read as
    /// it is: under ZeRO-3 (flat shards over the stage's data-parallel group) its flat shards
    /// joined on the rank's stage worker of replica 0 (or rank 0's join of a replicated
    /// weight); beside expert parallelism an expert variable's shards joined on its stage's
    /// worker (`expert::eval`). Empty otherwise.
    pub weights: HashMap<String, String>,
    /// The nodes that make `weights` (the other replicas' flat shards and their joins).
    pub weight_nodes: Vec<NodeDef>,
    /// Whether to copy the ops that do not read the batch too (constants, ops on weights),
    /// [`StageCopy::copy_shared`]: for a rank `t > 0`, and wherever the training graph's ops
    /// of those names do not compute what the evaluation reads (under ZeRO-3, or a graph
    /// other than the training graph's).
    pub copy_shared: bool,
}

/// Points `g0`'s evaluation (the graph of rank 0 of replica 0) at one forward pass of the
/// held-out batch through the stages of every tensor-parallel rank of replica 0: rank `t`'s
/// copy (`eval/...` for rank 0, `eval/tp{t}/...`) [`stage_copy`]'s, each op on the rank's
/// stage device reading the rank's shards there, its collectives in the stage's
/// tensor-parallel group at instance keys from `instance_base` (beyond every training key),
/// chained per device in the rank's forward order (the same on every rank). Worker 0 is fed
/// the batch through placeholders of the global batch size (static, as
/// `tensor::eval`'s: every collective's size is known) and sends it to the other ranks' first
/// stages (and the labels to every rank's last stage); the replicated weights (layer norms, biases, a few KB) of ranks `t > 0` are read
/// from rank 0's copies on the same stage; a variable in a rank's `weights` is read from the
/// tensor named there (its joined shards, made by `weight_nodes`). Rank 0's loss goes to
/// worker 0, after every other
/// rank's (control edges), so the step runs every rank's collectives. Returns `false`,
/// changing nothing, when a crossing tensor has no static size at the global batch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_sharded_stage_eval(
    g0: &mut crate::strategy::ReplicaGraph,
    ranks: &[RankStages<'_>],
    shape: PipelineShape,
    spec: &TrainSpec,
    features: &str,
    labels: &str,
    rows: usize,
    instance_base: i64,
) -> Result<bool, StrategyError> {
    let Some(chief) = ranks.first().and_then(|r| r.devices.first()).cloned() else {
        return Ok(false);
    };
    let mut added: Vec<NodeDef> = Vec::new();
    let mut losses: Vec<String> = Vec::new();
    let mut rank0: HashMap<String, String> = HashMap::new();
    let fetched: Vec<&str> = std::iter::once(spec.loss.as_str())
        .chain(spec.metrics.iter().map(String::as_str))
        .collect();
    for (t, rank) in ranks.iter().enumerate() {
        let prefix = if t == 0 {
            "eval".to_string()
        } else {
            format!("eval/tp{t}")
        };
        let Some(mut copied) = stage_copy(&StageCopy {
            graph: rank.graph,
            stages: rank.stages,
            shape,
            devices: &rank.devices,
            chief: &chief,
            prefix: &prefix,
            features,
            labels,
            placeholders: t == 0,
            copy_shared: rank.copy_shared,
            static_batch: true,
            rows,
        })?
        else {
            return Ok(false);
        };
        // Under ZeRO-3, the copies read the joined flat shards in place of the variables.
        if !rank.weights.is_empty() {
            for n in &mut copied.nodes {
                for i in &mut n.inputs {
                    if let Ok(InputRef::Data { node, index: 0 }) = InputRef::parse(i) {
                        if let Some(w) = rank.weights.get(&node) {
                            *i = w.clone();
                        }
                    }
                }
            }
        }
        // The rank's collectives: into its stage's group, at keys of the evaluation's own.
        for n in copied
            .nodes
            .iter_mut()
            .filter(|n| n.op.starts_with("Collective"))
        {
            let d = *copied
                .device
                .get(&n.name)
                .ok_or_else(|| PipelineError::Internal(n.name.clone()))?;
            let group = rank
                .groups
                .get(d)
                .ok_or_else(|| PipelineError::Internal(n.name.clone()))?;
            n.attrs
                .insert("group_key".into(), AttrValue::String(group.as_str().into()));
            match n.attrs.get_mut("instance_key") {
                Some(AttrValue::Int(k)) => *k += instance_base,
                _ => {
                    return Err(
                        PipelineError::Internal(format!("{} has no instance_key", n.name)).into(),
                    )
                }
            }
        }
        // ... chained per device in the rank's forward order.
        let mut last: HashMap<usize, String> = HashMap::new();
        let mut waits: Vec<(String, String)> = Vec::new();
        for i in rank.graph.topo_order() {
            let n = rank.graph.node(i);
            if !n.op.starts_with("Collective") || n.op == "CollectiveTpCopy" {
                continue;
            }
            let Some(copy) = copied.names.get(&n.name) else {
                continue;
            };
            let d = copied.device[copy];
            if let Some(before) = last.insert(d, copy.clone()) {
                waits.push((copy.clone(), before));
            }
        }
        for (after, before) in waits {
            if let Some(n) = copied.nodes.iter_mut().find(|n| n.name == after) {
                n.inputs.push(format!("^{before}"));
            }
        }
        // Rank 0's loss and metrics are fetched; every other rank's loss is waited for.
        for f in &fetched {
            let Ok(InputRef::Data { node: n, index }) = InputRef::parse(f) else {
                return Ok(false);
            };
            let Some(copy) = copied.names.get(&n) else {
                return Ok(false);
            };
            if t == 0 {
                rank0.insert(f.to_string(), format!("{copy}:{index}"));
            } else if *f == spec.loss {
                losses.push(format!("^{copy}"));
            }
        }
        // Rank t's own shards, where its training graph holds them.
        if t > 0 {
            let def = rank.graph.to_def();
            for i in rank.graph.node_indices() {
                let n = rank.graph.node(i);
                if n.op != "Variable"
                    || !rank.own.contains(&n.name)
                    || rank.weights.contains_key(&n.name)
                {
                    continue;
                }
                let device = rank.variable_device.get(&n.name).ok_or_else(|| {
                    PipelineError::Internal(format!("no device for `{}`", n.name))
                })?;
                let mut v = def
                    .nodes
                    .iter()
                    .find(|x| x.name == n.name)
                    .cloned()
                    .ok_or_else(|| PipelineError::Internal(n.name.clone()))?;
                v.device = device.clone();
                v.colocate_with.clear();
                added.push(v);
            }
        }
        added.extend(rank.weight_nodes.iter().cloned());
        added.extend(copied.nodes);
    }
    let mut fetch = |what: &str, name: &str, waits: Vec<String>| -> Result<String, StrategyError> {
        let tensor = rank0
            .get(name)
            .cloned()
            .ok_or_else(|| PipelineError::Internal(name.to_string()))?;
        let to = format!("{SCOPE}/fetch/{what}");
        let mut inputs = vec![tensor];
        inputs.extend(waits);
        added.push(node(to.clone(), "Identity", inputs, &chief));
        Ok(to)
    };
    let loss = fetch("loss", &spec.loss, losses)?;
    let mut metrics = Vec::with_capacity(spec.metrics.len());
    for (k, m) in spec.metrics.iter().enumerate() {
        metrics.push(fetch(&format!("metric{k}"), m, Vec::new())?);
    }
    let taken: HashSet<&str> = g0
        .training
        .def
        .nodes
        .iter()
        .map(|n| n.name.as_str())
        .collect();
    if let Some(clash) = added.iter().find(|n| taken.contains(n.name.as_str())) {
        return Err(StrategyError::NameTaken {
            node: clash.name.clone(),
            name: clash.name.clone(),
        });
    }
    // No task blocks in a collective before sending what its peers need for theirs.
    crate::strategy::tensor::eval::sends_before_collectives(&mut added, &g0.training.def.nodes);
    g0.training.def.nodes.extend(added);
    g0.graph = Graph::from_def(&g0.training.def).map_err(StrategyError::InvalidGraph)?;
    g0.eval = EvalNames {
        features: eval_name(features),
        labels: eval_name(labels),
        loss,
        metrics,
    };
    Ok(true)
}
