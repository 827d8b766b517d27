//! Helpers shared by subcommands: loading and validating graph files with positioned errors.

use anyhow::anyhow;
use dflow_graph::{Graph, GraphErrors, ParsedGraph};
use std::collections::HashMap;
use std::path::Path;

/// Loads a graph file (JSON or DSL, detected) and validates it. Validation errors that name a
/// node are prefixed with that node's `file:line:col`.
pub fn load_graph(path: &Path) -> anyhow::Result<Graph> {
    let parsed = dflow_graph::load_file(path).map_err(|e| anyhow!("{e}"))?;
    Graph::from_def(&parsed.def).map_err(|e| anyhow!("{}", positioned(path, &parsed, &e)))
}

/// Renders validation errors with the file position of the node each one names.
pub fn positioned(path: &Path, parsed: &ParsedGraph, errors: &GraphErrors) -> String {
    let positions: HashMap<&str, (usize, usize)> = parsed
        .def
        .nodes
        .iter()
        .zip(&parsed.node_positions)
        .map(|(n, p)| (n.name.as_str(), *p))
        .collect();
    let n = errors.errors().len();
    let mut out = format!(
        "{}: {n} error{} in the graph\n",
        path.display(),
        if n == 1 { "" } else { "s" }
    );
    for e in errors.errors() {
        match e.node().and_then(|name| positions.get(name)) {
            Some((line, col)) => out.push_str(&format!("{}:{line}:{col}: {e}\n", path.display())),
            None => out.push_str(&format!("{}: {e}\n", path.display())),
        }
    }
    out.pop();
    out
}
