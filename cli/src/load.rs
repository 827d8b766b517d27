//! Loading a graph file end to end: read, parse (JSON or DSL, detected), validate, and report
//! every problem with the file position of what it is about.
//!
//! Parse errors already carry `file:line:col` and a caret snippet. Validation errors name a node;
//! [`load_graph`] maps that node back to where it was defined in the file, so every message a
//! user sees points at a line.
//!
//! ```no_run
//! let loaded = dflow::load::load_graph(std::path::Path::new("examples/mlp/mlp.json"))?;
//! println!("{} nodes", loaded.graph.num_nodes());
//! # Ok::<(), dflow::load::LoadError>(())
//! ```

use dflow_graph::format::{FormatError, MAX_ERRORS};
use dflow_graph::tf_import::TfImportError;
use dflow_graph::train::{expand_training, ExpandError, TrainingGraph};
use dflow_graph::{Format, FormatErrors, Graph, GraphError, GraphErrors, ParsedGraph};
use std::collections::HashMap;
use std::fmt;
use std::path::Path;

/// A graph file that parsed and validated.
#[derive(Debug)]
pub struct LoadedGraph {
    /// The validated graph.
    pub graph: Graph,
    /// The graph exactly as written in the file, with node positions.
    pub parsed: ParsedGraph,
    /// The file's format (`Json` for an imported TensorFlow GraphDef).
    pub format: Format,
    /// The file was a TensorFlow GraphDef (protobuf JSON), imported; `parsed` holds the imported
    /// graph, without file positions.
    pub tf_graphdef: bool,
}

/// Why a graph file could not be loaded.
#[derive(Debug, Clone, PartialEq)]
pub enum LoadError {
    /// The file could not be read or parsed (each error has its position and snippet).
    Format(FormatErrors),
    /// The file parsed but the graph is invalid.
    Invalid {
        /// The file, as shown in messages.
        path: String,
        /// The validation errors.
        errors: GraphErrors,
        /// One rendered entry per error: `file:line:col: message` plus the node's source line
        /// and a caret, or `file: message` when the error names no node.
        rendered: Vec<String>,
    },
}

impl LoadError {
    /// Number of individual problems reported.
    pub fn count(&self) -> usize {
        match self {
            LoadError::Format(e) => e.0.len(),
            LoadError::Invalid { rendered, .. } => rendered.len(),
        }
    }
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (path, entries): (&str, Vec<String>) = match self {
            LoadError::Format(errors) => (
                errors
                    .0
                    .first()
                    .and_then(|e| e.path.as_deref())
                    .unwrap_or("<input>"),
                errors.0.iter().map(render_format_error).collect(),
            ),
            LoadError::Invalid { path, rendered, .. } => (path, rendered.clone()),
        };
        // One error needs no header: its own line names the file.
        if entries.len() > 1 {
            let more = match self {
                LoadError::Format(_) if entries.len() >= MAX_ERRORS => {
                    format!(" (stopped after {MAX_ERRORS})")
                }
                _ => String::new(),
            };
            writeln!(f, "{path}: {} errors{more}", entries.len())?;
        }
        write!(f, "{}", entries.join("\n"))
    }
}

/// `file:line:col: message` plus the source line and caret, the line cut to a window around the
/// column when it is long (a 10k-character line would drown the message).
fn render_format_error(e: &FormatError) -> String {
    let path = e.path.as_deref().unwrap_or("<input>");
    if e.line == 0 {
        return format!("{path}: {}", e.message);
    }
    let mut s = format!("{path}:{}:{}: {}", e.line, e.column, e.message);
    if let Some(src) = e.snippet.lines().next() {
        s.push_str(&snippet(src, e.column));
    }
    s
}

impl std::error::Error for LoadError {}

/// Reads, parses and validates a graph file. The format comes from the extension (`.json`,
/// `.dflow`), else from the content.
pub fn load_graph(path: &Path) -> Result<LoadedGraph, LoadError> {
    if let Some(loaded) = load_tf_graphdef(path)? {
        return Ok(loaded);
    }
    let parsed = dflow_graph::load_file(path).map_err(LoadError::Format)?;
    // The file was readable and valid UTF-8 a moment ago; re-reading it only serves format
    // detection and snippets, so a failure here just loses those.
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let format = Format::detect(Some(path), &text);
    let checked = Graph::from_def(&parsed.def).and_then(|graph| {
        let too_big = check_sizes(&graph);
        if too_big.is_empty() {
            Ok(graph)
        } else {
            Err(GraphErrors(too_big))
        }
    });
    match checked {
        Ok(graph) => Ok(LoadedGraph {
            graph,
            parsed,
            format,
            tf_graphdef: false,
        }),
        Err(errors) => {
            let shown = path.display().to_string();
            let rendered = render_validation_errors(&shown, &text, &parsed, &errors);
            Err(LoadError::Invalid {
                path: shown,
                errors,
                rendered,
            })
        }
    }
}

/// Imports `path` when it is a TensorFlow GraphDef in protobuf JSON (`None` when it is not), so
/// `check` and `convert` read the same files as `partition` and `run`.
fn load_tf_graphdef(path: &Path) -> Result<Option<LoadedGraph>, LoadError> {
    let shown = path.display().to_string();
    let whole_file = |message: String| {
        LoadError::Format(FormatErrors(vec![FormatError {
            path: Some(shown.clone()),
            line: 0,
            column: 0,
            message,
            snippet: String::new(),
        }]))
    };
    // Unreadable or oversized files are reported by `load_file`, with its limits.
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(None);
    };
    if meta.len() > dflow_graph::format::MAX_FILE_BYTES {
        return Ok(None);
    }
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(None);
    };
    if !dflow_graph::tf_import::looks_like_tf_graphdef(&text) {
        return Ok(None);
    }
    let def = dflow_graph::tf_import::import_graphdef_json(&text)
        .map_err(|e| whole_file(format!("importing a TensorFlow GraphDef: {e}")))?;
    let graph = Graph::from_def(&def).map_err(|errors| LoadError::Invalid {
        path: shown.clone(),
        rendered: errors
            .errors()
            .iter()
            .map(|e| format!("{shown}: imported TensorFlow graph: {e}"))
            .collect(),
        errors,
    })?;
    let too_big = check_sizes(&graph);
    if !too_big.is_empty() {
        let errors = GraphErrors(too_big);
        return Err(LoadError::Invalid {
            path: shown.clone(),
            rendered: errors
                .errors()
                .iter()
                .map(|e| format!("{shown}: {e}"))
                .collect(),
            errors,
        });
    }
    Ok(Some(LoadedGraph {
        graph,
        parsed: ParsedGraph {
            def,
            node_positions: vec![],
        },
        format: Format::Json,
        tf_graphdef: true,
    }))
}

/// Renders validation errors with the position (and source line) of the node each one is about.
pub fn render_validation_errors(
    path: &str,
    text: &str,
    parsed: &ParsedGraph,
    errors: &GraphErrors,
) -> Vec<String> {
    let mut positions: HashMap<&str, (usize, usize)> = HashMap::new();
    for (n, p) in parsed.def.nodes.iter().zip(&parsed.node_positions) {
        positions.entry(n.name.as_str()).or_insert(*p);
    }
    let lines: Vec<&str> = text.lines().collect();
    errors
        .errors()
        .iter()
        .map(|e| {
            let pos = match e {
                GraphError::DuplicateName { second, .. } => parsed.node_positions.get(*second),
                GraphError::InvalidName { index, .. } => parsed.node_positions.get(*index),
                _ => e.node().and_then(|name| positions.get(name)),
            };
            match pos {
                Some(&(line, col)) => {
                    let mut s = format!("{path}:{line}:{col}: {e}");
                    if let Some(src) = line.checked_sub(1).and_then(|i| lines.get(i)) {
                        s.push_str(&snippet(src, col));
                    }
                    s
                }
                None => format!("{path}: {e}"),
            }
        })
        .collect()
}

/// The source line and a caret under `col` (1-based, in chars). Lines longer than a screen are
/// cut to a window around the column, marked with `…`; control characters show as `�`.
fn snippet(line: &str, col: usize) -> String {
    const WIDTH: usize = 120;
    let chars: Vec<char> = line.trim_end_matches('\r').chars().collect();
    let at = col.saturating_sub(1).min(chars.len());
    let start = if chars.len() <= WIDTH {
        0
    } else {
        at.saturating_sub(WIDTH / 2).min(chars.len() - WIDTH)
    };
    let end = (start + WIDTH).min(chars.len());
    let head = if start > 0 { "…" } else { "" };
    let tail = if end < chars.len() { "…" } else { "" };
    // Control characters and BOMs would garble a terminal or hide; show them as U+FFFD, one
    // char each so the caret stays aligned.
    let shown: String = chars[start..end]
        .iter()
        .map(|&c| {
            if (c.is_control() && c != '\t') || c == '\u{feff}' {
                '\u{fffd}'
            } else {
                c
            }
        })
        .collect();
    let caret: String = std::iter::repeat(' ')
        .take(head.chars().count())
        .chain(
            chars[start..at]
                .iter()
                .map(|&c| if c == '\t' { '\t' } else { ' ' }),
        )
        .collect();
    format!("\n{head}{shown}{tail}\n{caret}^")
}

/// Validation accepts any static shape, but a value whose byte size does not fit in `usize`
/// could never be allocated; report it as the node's error rather than summarizing it as 0.
fn check_sizes(graph: &Graph) -> Vec<GraphError> {
    graph
        .node_indices()
        .map(|idx| graph.node(idx))
        .flat_map(|n| {
            n.outputs
                .iter()
                .enumerate()
                .filter(|(_, t)| t.shape.is_static() && t.byte_size().is_none())
                .map(|(i, t)| GraphError::Shape {
                    node: n.name.clone(),
                    op: n.op.into(),
                    message: format!("output {i} is {t}: more bytes than this machine can address"),
                })
        })
        .collect()
}

/// What `dflow check` prints about a valid graph. Everything except the file and format is a
/// function of the graph alone, so the JSON and DSL versions of one graph summarize alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// Number of nodes.
    pub nodes: usize,
    /// Data edges.
    pub data_edges: usize,
    /// Control edges.
    pub control_edges: usize,
    /// Op name → node count, sorted by op name.
    pub ops: Vec<(String, usize)>,
    /// Requested device → node count, sorted; `""` is unconstrained.
    pub devices: Vec<(String, usize)>,
    /// Number of variables.
    pub variables: usize,
    /// Total elements in all variables.
    pub parameters: usize,
    /// Total bytes of all variables.
    pub parameter_bytes: usize,
    /// Placeholder name → its type (`f32[?, 64]`), sorted by name.
    pub placeholders: Vec<(String, String)>,
}

impl Summary {
    /// Summarizes a validated graph.
    pub fn of(graph: &Graph) -> Summary {
        use std::collections::BTreeMap;
        let mut ops: BTreeMap<String, usize> = BTreeMap::new();
        let mut devices: BTreeMap<String, usize> = BTreeMap::new();
        let mut placeholders = Vec::new();
        for idx in graph.node_indices() {
            let n = graph.node(idx);
            *ops.entry(n.op.into()).or_default() += 1;
            *devices.entry(n.device.to_string()).or_default() += 1;
            if n.op == "Placeholder" {
                let ty = n
                    .outputs
                    .first()
                    .map_or_else(|| "?".to_string(), ToString::to_string);
                placeholders.push((n.name.clone(), ty));
            }
        }
        placeholders.sort();
        let (mut data_edges, mut control_edges) = (0, 0);
        for e in graph.petgraph().edge_weights() {
            match e {
                dflow_graph::Edge::Data { .. } => data_edges += 1,
                dflow_graph::Edge::Control => control_edges += 1,
            }
        }
        let (variables, parameters, parameter_bytes) = graph.parameter_stats();
        Summary {
            nodes: graph.num_nodes(),
            data_edges,
            control_edges,
            ops: ops.into_iter().collect(),
            devices: devices.into_iter().collect(),
            variables,
            parameters,
            parameter_bytes,
            placeholders,
        }
    }
}

/// The width to pad a column of names to: the longest, but at most 60 (a longer name just pushes
/// its row out; `format!`'s width must also stay below 65,536).
fn column_width(lens: impl Iterator<Item = usize>) -> usize {
    lens.max().unwrap_or(0).min(60)
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "nodes:        {}", thousands(self.nodes))?;
        writeln!(
            f,
            "edges:        {} ({} data, {} control)",
            thousands(self.data_edges + self.control_edges),
            thousands(self.data_edges),
            thousands(self.control_edges)
        )?;
        let width = column_width(self.ops.iter().map(|(o, _)| o.len()));
        writeln!(f, "ops:          {}", self.ops.len())?;
        for (op, n) in &self.ops {
            writeln!(f, "  {op:<width$}  {n}")?;
        }
        let shown = |d: &str| {
            if d.is_empty() {
                "(none)".to_string()
            } else {
                d.to_string()
            }
        };
        let width = column_width(self.devices.iter().map(|(d, _)| shown(d).len()));
        writeln!(f, "devices:      {}", self.devices.len())?;
        for (d, n) in &self.devices {
            writeln!(f, "  {:<width$}  {n}", shown(d))?;
        }
        writeln!(f, "variables:    {}", thousands(self.variables))?;
        writeln!(
            f,
            "size:         {} parameters ({})",
            thousands(self.parameters),
            human_bytes(self.parameter_bytes)
        )?;
        let width = column_width(self.placeholders.iter().map(|(p, _)| p.len()));
        write!(f, "placeholders: {}", self.placeholders.len())?;
        for (p, ty) in &self.placeholders {
            write!(f, "\n  {p:<width$}  {ty}")?;
        }
        Ok(())
    }
}

/// `2410` → `"2,410"`.
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `9640` → `"9.4 KiB"`; below 1 KiB exact bytes (`"12 B"`).
pub fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    // Display only; f64 precision loss on huge sizes is harmless.
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// A graph ready to place and run: a graph file loaded, its `train` section (if any) expanded into
/// the backward pass and optimizer updates, or a TensorFlow GraphDef imported.
#[derive(Debug)]
pub struct Program {
    /// The graph to place and run (forward, backward and updates when training).
    pub graph: Graph,
    /// What the training expansion added (train op, loss, metrics), if the file trains.
    pub training: Option<TrainingGraph>,
}

/// Why [`load_program`] failed. Each message starts with the file it is about.
#[derive(Debug)]
pub enum ProgramError {
    /// The dflow graph file could not be loaded (see [`load_graph`]).
    Load(LoadError),
    /// The file looks like a TensorFlow GraphDef but could not be imported.
    TfImport {
        /// The file, as shown in messages.
        path: String,
        /// What the importer said.
        error: TfImportError,
    },
    /// The imported TensorFlow graph does not validate.
    TfInvalid {
        /// The file, as shown in messages.
        path: String,
        /// The validation errors.
        errors: GraphErrors,
    },
    /// The graph's `train` section could not be expanded.
    Train {
        /// The file, as shown in messages.
        path: String,
        /// What the expansion said.
        error: ExpandError,
    },
    /// The expanded training graph does not validate (a bug in the expansion, if it happens).
    TrainInvalid {
        /// The file, as shown in messages.
        path: String,
        /// The validation errors.
        errors: GraphErrors,
    },
}

impl fmt::Display for ProgramError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProgramError::Load(e) => write!(f, "{e}"),
            ProgramError::TfImport { path, error } => {
                write!(f, "{path}: importing a TensorFlow GraphDef: {error}")
            }
            ProgramError::TfInvalid { path, errors } => {
                write!(f, "{path}: imported TensorFlow graph is invalid:\n{errors}")
            }
            ProgramError::Train { path, error } => {
                write!(f, "{path}: expanding the training spec: {error}")
            }
            ProgramError::TrainInvalid { path, errors } => {
                write!(
                    f,
                    "{path}: the expanded training graph is invalid:\n{errors}"
                )
            }
        }
    }
}

impl std::error::Error for ProgramError {}

impl From<LoadError> for ProgramError {
    fn from(e: LoadError) -> Self {
        ProgramError::Load(e)
    }
}

/// Loads a graph file for `partition` and `run`: a dflow graph (its `train` section expanded into
/// the backward pass and updates), or a TensorFlow GraphDef in protobuf JSON (imported).
///
/// ```no_run
/// let program = dflow::load::load_program(std::path::Path::new("examples/digits/digits.json"))?;
/// assert!(program.training.is_some());
/// # Ok::<(), dflow::load::ProgramError>(())
/// ```
pub fn load_program(path: &Path) -> Result<Program, ProgramError> {
    let shown = path.display().to_string();
    // An unreadable or oversized file is reported by `load_graph` below, with its path and the
    // limit; it is not read here.
    let within_limit =
        std::fs::metadata(path).is_ok_and(|m| m.len() <= dflow_graph::format::MAX_FILE_BYTES);
    let text = if within_limit {
        std::fs::read_to_string(path).unwrap_or_default()
    } else {
        String::new()
    };
    if dflow_graph::tf_import::looks_like_tf_graphdef(&text) {
        let def = dflow_graph::tf_import::import_graphdef_json(&text).map_err(|error| {
            ProgramError::TfImport {
                path: shown.clone(),
                error,
            }
        })?;
        let graph = Graph::from_def(&def).map_err(|errors| ProgramError::TfInvalid {
            path: shown,
            errors,
        })?;
        return Ok(Program {
            graph,
            training: None,
        });
    }
    let loaded = load_graph(path)?;
    let Some(spec) = &loaded.parsed.def.train else {
        return Ok(Program {
            graph: loaded.graph,
            training: None,
        });
    };
    let training =
        expand_training(&loaded.parsed.def, spec).map_err(|error| ProgramError::Train {
            path: shown.clone(),
            error,
        })?;
    let graph = Graph::from_def(&training.def).map_err(|errors| ProgramError::TrainInvalid {
        path: shown,
        errors,
    })?;
    Ok(Program {
        graph,
        training: Some(training),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_readable() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(2410), "2,410");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(9640), "9.4 KiB");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
    }

    #[test]
    fn snippet_points_at_the_column() {
        assert_eq!(snippet("  a = B(c)", 3), "\n  a = B(c)\n  ^");
        assert_eq!(snippet("x", 2), "\nx\n ^");
        assert_eq!(snippet("a\0b", 2), "\na\u{fffd}b\n ^");
        let long = "a".repeat(1000);
        let s = snippet(&long, 500);
        let lines: Vec<&str> = s.lines().collect();
        assert!(lines[1].starts_with('…') && lines[1].ends_with('…'));
        assert_eq!(lines[2].chars().count(), 62);
    }
}
