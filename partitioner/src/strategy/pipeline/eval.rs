//! The pipeline's evaluation: one forward pass of the held-out batch through the stages of the
//! replica, each op on its own stage's worker reading that stage's weights, so that no stage's
//! weights are joined on one task (the point of a pipeline for a model too big for one device).
//!
//! The evaluation signature holds:
//! - `eval/<features>` and `eval/<labels>`: the held-out batch's placeholders (batch dimension as
//!   written), on the first stage's worker (the chief, which feeds them);
//! - `eval/<op>`: one copy of every batch op, on the worker of the op's stage, reading the
//!   weights of that stage in place;
//! - `eval/pipeline/cross/<tensor>/...`: every tensor that one stage's copy makes and another
//!   stage's reads (an activation, or the labels for the last stage) crosses once per reading
//!   stage. Tensors between tasks need static shapes (their receive buffers are allocated once),
//!   and a held-out batch may be partial (the last batch of a CSV test set), so a tensor whose
//!   first dimension follows the batch is sent padded to its size at the global batch `B`
//!   (`padded = Gather(x, [0, 1, …, R−1] mod n)`, `n` its rows, `R` its rows at `B`), with
//!   `n`, and the reading stage takes its first `n` rows back (`Gather(padded, Range(0, n))`):
//!   each stage computes on exactly the held-out rows, so the loss is the one-process loss of
//!   the batch. A tensor of a static shape (a scalar, or the batch at a placeholder's fixed
//!   size) crosses as it is;
//! - `eval/pipeline/fetch/...`: the loss and metrics of the last stage, sent to the chief, which
//!   the executor fetches them from.
//!
//! A weight read by two stages (a tied embedding, read by the first stage's lookup and the
//! last stage's head) crosses once per evaluation batch, as it does once per training step;
//! no other weight leaves its stage (under ZeRO-3 each stage's replicas' flat shards are joined
//! on the stage's worker, `super::zero`). When a crossing tensor has an unknown dimension
//! besides its first, or a fetched loss or metric has no static shape (so no static size can
//! hold it), the whole evaluation runs on the first stage's worker instead, reading every
//! stage's weights ([`joined`], the older evaluation).
//!
//! With tensor parallelism inside the stages ([`add_sharded_stage_eval`], the 3D mesh) every
//! tensor-parallel rank of replica 0 runs its own [`stage_copy`] on its shards, with its stage's
//! collectives, fed whole batches of a static size; under ZeRO-3 each rank's flat shards are
//! joined first on its own stage's worker (`tensor::mesh3d`). `expert::eval` runs the
//! `dp × ep × pp` evaluation through it as one rank, each stage's experts joined on its worker.
//!
//! Its parts: this file chooses between the evaluation on the stages ([`evaluation`]) and the
//! joined one ([`joined`]); `copy` builds nodes and copies one forward op; `on_stages` copies a
//! graph onto its stages and sends what crosses them ([`stage_copy`]); `sharded` runs that for
//! every tensor-parallel rank ([`add_sharded_stage_eval`]); `tests` checks the plans.

mod copy;
mod on_stages;
mod sharded;
#[cfg(test)]
mod tests;

pub(crate) use on_stages::{stage_copy, StageCopy};
pub(crate) use sharded::{add_sharded_stage_eval, RankStages};

use super::schedule::PipelineShape;
use super::stages::StageMap;
use crate::strategy::{EvalNames, StrategyError};
use copy::{copy_of, node, placeholder};
use dflow_graph::train::TrainSpec;
use dflow_graph::{Graph, InputRef, NodeDef};
use std::collections::HashSet;

/// The name scope of what the staged evaluation adds besides the copies of the forward ops.
const SCOPE: &str = "eval/pipeline";

/// What the evaluation of one pipeline replica needs.
pub(super) struct EvalInput<'a> {
    /// The forward graph.
    pub graph: &'a Graph,
    /// The stage of every op of `graph`.
    pub stages: &'a StageMap,
    /// Stages, micro-batches, chunks.
    pub shape: PipelineShape,
    /// The device of each pipeline stage; `devices[0]` is the chief for replica 0.
    pub devices: &'a [String],
    /// The features placeholder.
    pub features: &'a str,
    /// The labels placeholder.
    pub labels: &'a str,
    /// The batch ops of `graph`, placeholders aside.
    pub batch: &'a HashSet<&'a str>,
    /// The loss and metrics to evaluate.
    pub spec: &'a TrainSpec,
    /// Rows of a whole held-out batch (the global batch size): the padded size of what crosses.
    pub rows: usize,
}

/// The evaluation nodes to add to the replica's graph and the names the executor feeds and
/// fetches: on the stages when every crossing tensor has a static size at the global batch,
/// else joined on the first stage's worker (see the module docs).
pub(super) fn evaluation(
    input: &EvalInput<'_>,
) -> Result<(Vec<NodeDef>, EvalNames), StrategyError> {
    match staged(input)? {
        Some(done) => Ok(done),
        None => joined(input),
    }
}

/// `eval/<name>`.
pub(super) fn eval_name(name: &str) -> String {
    format!("eval/{name}")
}

/// `loss` or `loss:1` of the evaluation copy.
pub(super) fn eval_tensor(name: &str) -> String {
    match InputRef::parse(name) {
        Ok(InputRef::Data { node, index }) => InputRef::Data {
            node: eval_name(&node),
            index,
        }
        .to_string(),
        _ => eval_name(name),
    }
}

/// The evaluation on the first stage's worker, reading every stage's weights (the older
/// evaluation; see the module docs).
pub(super) fn joined(input: &EvalInput<'_>) -> Result<(Vec<NodeDef>, EvalNames), StrategyError> {
    let chief = input.devices[0].as_str();
    let feeds = [input.features, input.labels];
    let mut nodes = Vec::new();
    for n in input.graph.to_def().nodes {
        if feeds.contains(&n.name.as_str()) {
            nodes.push(placeholder(&n, chief));
        } else if input.batch.contains(n.name.as_str()) {
            nodes.push(copy_of(
                &n,
                chief,
                "eval",
                input.batch,
                &feeds,
                &mut |_, _| Ok(None),
            )?);
        }
    }
    let names = EvalNames {
        features: eval_name(input.features),
        labels: eval_name(input.labels),
        loss: eval_tensor(&input.spec.loss),
        metrics: input.spec.metrics.iter().map(|m| eval_tensor(m)).collect(),
    };
    Ok((nodes, names))
}

/// The plain pipeline's evaluation on its stages (see the module docs); `None` when a crossing
/// tensor has no static size at the global batch.
fn staged(input: &EvalInput<'_>) -> Result<Option<(Vec<NodeDef>, EvalNames)>, StrategyError> {
    let chief = input.devices[0].as_str();
    let Some(copied) = stage_copy(&StageCopy {
        graph: input.graph,
        stages: input.stages,
        shape: input.shape,
        devices: input.devices,
        chief,
        prefix: "eval",
        features: input.features,
        labels: input.labels,
        placeholders: true,
        copy_shared: false,
        static_batch: false,
        rows: input.rows,
    })?
    else {
        return Ok(None);
    };
    // The loss and metrics, on the last stage, go to the chief, where the executor fetches
    // them: they need static shapes (scalars, as a rule) to cross.
    let g = input.graph;
    let fetched_static = std::iter::once(&input.spec.loss)
        .chain(&input.spec.metrics)
        .all(|f| match InputRef::parse(f) {
            Ok(InputRef::Data { node, index }) => g
                .find(&node)
                .and_then(|i| g.output_type(i, index))
                .is_some_and(|t| t.shape.as_static().is_some()),
            _ => false,
        });
    if !fetched_static {
        return Ok(None);
    }
    let mut nodes = copied.nodes;
    let mut fetch = |what: &str, name: &str| -> String {
        let copy = eval_tensor(name);
        let Ok(InputRef::Data { node: n, .. }) = InputRef::parse(&copy) else {
            return copy;
        };
        match copied.device.get(&n) {
            Some(&d) if input.devices[d] != chief => {
                let to = format!("{SCOPE}/fetch/{what}");
                nodes.push(node(to.clone(), "Identity", vec![copy], chief));
                to
            }
            _ => copy,
        }
    };
    let loss = fetch("loss", &input.spec.loss);
    let metrics = (input.spec.metrics.iter().enumerate())
        .map(|(k, m)| fetch(&format!("metric{k}"), m))
        .collect();
    let names = EvalNames {
        features: eval_name(input.features),
        labels: eval_name(input.labels),
        loss,
        metrics,
    };
    Ok(Some((nodes, names)))
}
