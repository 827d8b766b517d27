//! Helpers shared by subcommands: thin wrappers over [`dflow::load`] that turn its errors into
//! `anyhow` errors for `main`.

use dflow::load::LoadedGraph;
pub use dflow::load::Program;
use std::path::Path;

/// Loads a graph file (JSON or DSL, detected) and validates it. Every error carries the
/// `file:line:col` of what it is about (see [`dflow::load::load_graph`]).
pub fn load(path: &Path) -> anyhow::Result<LoadedGraph> {
    Ok(dflow::load::load_graph(path)?)
}

/// Loads a graph file for `partition` and `run` (see [`dflow::load::load_program`]).
pub fn load_program(path: &Path) -> anyhow::Result<Program> {
    Ok(dflow::load::load_program(path)?)
}
