//! Helpers shared by subcommands: loading graph files (dflow JSON/DSL with positioned errors, or
//! a TensorFlow GraphDef in protobuf JSON) and expanding their training spec.

use anyhow::Context;
use dflow::load::LoadedGraph;
use dflow_graph::train::{expand_training, TrainingGraph};
use dflow_graph::Graph;
use std::path::Path;

/// Loads a graph file (JSON or DSL, detected) and validates it. Every error carries the
/// `file:line:col` of what it is about (see [`dflow::load::load_graph`]).
pub fn load(path: &Path) -> anyhow::Result<LoadedGraph> {
    Ok(dflow::load::load_graph(path)?)
}

/// A graph ready to place: training expanded when the file has a `train` section.
#[derive(Debug)]
pub struct Program {
    /// The graph to place and run (forward, backward and updates when training).
    pub graph: Graph,
    /// What the training expansion added (train op, loss, metrics), if the file trains.
    pub training: Option<TrainingGraph>,
}

/// Loads a graph file for `partition` and `run`: a dflow graph (its `train` section expanded into
/// the backward pass and updates), or a TensorFlow GraphDef in protobuf JSON (imported).
pub fn load_program(path: &Path) -> anyhow::Result<Program> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    if dflow_graph::tf_import::looks_like_tf_graphdef(&text) {
        let def = dflow_graph::tf_import::import_graphdef_json(&text)
            .with_context(|| format!("{}: importing a TensorFlow GraphDef", path.display()))?;
        let graph = Graph::from_def(&def).map_err(|e| {
            anyhow::anyhow!(
                "{}: imported TensorFlow graph is invalid:\n{e}",
                path.display()
            )
        })?;
        return Ok(Program {
            graph,
            training: None,
        });
    }
    let loaded = load(path)?;
    let Some(spec) = &loaded.parsed.def.train else {
        return Ok(Program {
            graph: loaded.graph,
            training: None,
        });
    };
    let training = expand_training(&loaded.parsed.def, spec)
        .with_context(|| format!("{}: expanding the training spec", path.display()))?;
    let graph = Graph::from_def(&training.def).map_err(|e| {
        anyhow::anyhow!(
            "{}: the expanded training graph is invalid:\n{e}",
            path.display()
        )
    })?;
    Ok(Program {
        graph,
        training: Some(training),
    })
}
