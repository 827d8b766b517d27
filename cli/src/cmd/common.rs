//! Helpers shared by subcommands: loading and validating graph files with positioned errors.

use dflow::load::LoadedGraph;
use dflow_graph::Graph;
use std::path::Path;

/// Loads a graph file (JSON or DSL, detected) and validates it. Every error carries the
/// `file:line:col` of what it is about (see [`dflow::load::load_graph`]).
// `partition` and `run` use this as they land.
#[allow(dead_code)]
pub fn load_graph(path: &Path) -> anyhow::Result<Graph> {
    Ok(load(path)?.graph)
}

/// Like [`load_graph`], also returning the graph as written and the file's format.
pub fn load(path: &Path) -> anyhow::Result<LoadedGraph> {
    Ok(dflow::load::load_graph(path)?)
}
