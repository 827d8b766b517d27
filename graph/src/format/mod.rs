//! The two graph file formats: JSON ([`json`]) and the dflow DSL ([`dsl`]).
//!
//! Both read and write a [`GraphDef`] with exactly the same expressive power, so a file converts
//! between them without loss. Attributes are untyped in files; each op's declaration in
//! [`crate::registry()`] supplies their types. Parsers check what they can see locally (op names,
//! attribute names and types, required attributes, node names, input syntax, duplicate node
//! names) and report every problem they find (up to [`MAX_ERRORS`]) with `file:line:col` and a
//! caret snippet. Graph-level checks (unknown inputs, cycles, shapes) happen later, in
//! validation, which can point back into the file through [`ParsedGraph::node_positions`].
//!
//! ```
//! use dflow_graph::format::{parse_dsl, to_json, parse_json};
//! let src = "dflow 1\nx = Placeholder(dtype: f32, shape: [-1, 4])\ny = Identity(x)\n";
//! let parsed = parse_dsl(src, Some("mlp.dflow")).unwrap();
//! assert_eq!(parsed.node_positions[1], (3, 1));
//! let back = parse_json(&to_json(&parsed.def), None).unwrap();
//! assert_eq!(back.def, parsed.def);
//! ```

use crate::def::{check_node_name, FORMAT_VERSION};
use crate::ops::AttrDefault;
use crate::{registry, AttrType, AttrValue, GraphDef, NodeDef};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;

pub mod dsl;
pub mod json;
pub mod tf_import;

pub use dsl::{parse_dsl, to_dsl};
pub use json::{parse_json, to_json};

/// At most this many errors are reported from one file.
pub const MAX_ERRORS: usize = 50;

/// Files larger than this are refused by [`load_file`].
pub const MAX_FILE_BYTES: u64 = 1 << 30;

/// The format versions this build reads.
pub const SUPPORTED_VERSIONS: &[u32] = &[FORMAT_VERSION];

/// One problem in a graph file, with its position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FormatError {
    /// The file name, for messages (`None` for in-memory text).
    pub path: Option<String>,
    /// 1-based line (0 when the error is about the whole file, e.g. an I/O error).
    pub line: usize,
    /// 1-based column, in characters.
    pub column: usize,
    /// What is wrong.
    pub message: String,
    /// The source line plus a caret line under the column (empty when there is no position).
    pub snippet: String,
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = self.path.as_deref().unwrap_or("<input>");
        if self.line == 0 {
            write!(f, "{path}: {}", self.message)?;
        } else {
            write!(f, "{path}:{}:{}: {}", self.line, self.column, self.message)?;
        }
        if !self.snippet.is_empty() {
            write!(f, "\n{}", self.snippet)?;
        }
        Ok(())
    }
}

impl std::error::Error for FormatError {}

/// Every problem found in one graph file (at least one, at most [`MAX_ERRORS`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct FormatErrors(pub Vec<FormatError>);

impl fmt::Display for FormatErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl FormatErrors {
    /// A single error without a position (I/O and the like).
    fn whole_file(path: Option<&str>, message: String) -> Self {
        FormatErrors(vec![FormatError {
            path: path.map(str::to_string),
            line: 0,
            column: 0,
            message,
            snippet: String::new(),
        }])
    }
}

/// A parsed graph plus where each node was defined, for later error messages.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedGraph {
    /// The graph.
    pub def: GraphDef,
    /// `(line, column)` of each node's definition (1-based), in the order of `def.nodes`.
    pub node_positions: Vec<(usize, usize)>,
}

/// A graph file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// JSON (`.json`).
    Json,
    /// The dflow DSL (`.dflow`).
    Dsl,
}

impl Format {
    /// Picks the format from the file extension (`.json`, `.dflow`), else from the content: JSON
    /// when the first non-space character (after an optional BOM) is `{`, the DSL otherwise.
    pub fn detect(path: Option<&Path>, text: &str) -> Format {
        match path
            .and_then(|p| p.extension())
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("json") => Format::Json,
            Some("dflow") => Format::Dsl,
            _ => {
                let t = text.strip_prefix('\u{feff}').unwrap_or(text);
                if t.trim_start().starts_with('{') {
                    Format::Json
                } else {
                    Format::Dsl
                }
            }
        }
    }
}

/// Parses `text` in the given format. `path` is only used in messages.
pub fn parse(text: &str, format: Format, path: Option<&str>) -> Result<ParsedGraph, FormatErrors> {
    match format {
        Format::Json => parse_json(text, path),
        Format::Dsl => parse_dsl(text, path),
    }
}

/// Reads and parses a graph file, detecting its format with [`Format::detect`].
///
/// I/O errors, files over [`MAX_FILE_BYTES`] and invalid UTF-8 are reported as [`FormatErrors`].
pub fn load_file(path: &Path) -> Result<ParsedGraph, FormatErrors> {
    use std::io::Read;
    let shown = path.display().to_string();
    let name = Some(shown.as_str());
    let io_err = |e: std::io::Error| FormatErrors::whole_file(name, format!("cannot read: {e}"));
    let file = std::fs::File::open(path).map_err(io_err)?;
    let len = file.metadata().map_err(io_err)?.len();
    let too_big = |n: u64| {
        FormatErrors::whole_file(
            name,
            format!("file is {n} bytes; graph files are limited to {MAX_FILE_BYTES} bytes"),
        )
    };
    if len > MAX_FILE_BYTES {
        return Err(too_big(len));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    // Read one byte past the cap so a file that grows while we read is still refused.
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_big(bytes.len() as u64));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let prefix = std::str::from_utf8(&e.as_bytes()[..at]).unwrap_or("");
        let src = Source::new(prefix, name);
        let mut err = src.error(at, "file is not valid UTF-8".to_string());
        err.message = format!("file is not valid UTF-8 (invalid byte at offset {at})");
        FormatErrors(vec![err])
    })?;
    parse(&text, Format::detect(Some(path), &text), name)
}

/// Source text with a line index, for turning byte offsets into positions.
#[derive(Debug)]
pub(crate) struct Source<'a> {
    pub(crate) text: &'a str,
    path: Option<&'a str>,
    line_starts: Vec<usize>,
    /// The last position computed: (byte offset, 0-based line, 0-based column in chars). The
    /// parsers ask for positions in file order, so counting on from here keeps a long line
    /// (a whole graph written by `json.dump`) linear instead of recounting from its start.
    cursor: std::cell::Cell<(usize, usize, usize)>,
}

impl<'a> Source<'a> {
    pub(crate) fn new(text: &'a str, path: Option<&'a str>) -> Self {
        let mut line_starts = vec![0];
        line_starts.extend(
            text.bytes()
                .enumerate()
                .filter(|&(_, b)| b == b'\n')
                .map(|(i, _)| i + 1),
        );
        Source {
            text,
            path,
            line_starts,
            cursor: std::cell::Cell::new((0, 0, 0)),
        }
    }

    /// 1-based (line, column in chars) of a byte offset.
    pub(crate) fn position(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let line = self.line_starts.partition_point(|&s| s <= offset) - 1;
        let start = self.line_starts[line];
        let (at, at_line, at_col) = self.cursor.get();
        let (from, base) = if at_line == line && (start..=offset).contains(&at) {
            (at, at_col)
        } else {
            (start, 0)
        };
        let col = base
            + self
                .text
                .get(from..offset)
                .map_or(offset - from, |s| s.chars().count());
        self.cursor.set((offset, line, col));
        (line + 1, col + 1)
    }

    /// An error at a byte offset.
    pub(crate) fn error(&self, offset: usize, message: String) -> FormatError {
        let (line, column) = self.position(offset);
        let start = self.line_starts[line - 1];
        let end = self.text[start..]
            .find('\n')
            .map_or(self.text.len(), |i| start + i);
        let src_line = self.text[start..end].trim_end_matches('\r');
        let caret: String = src_line
            .chars()
            .take(column - 1)
            .map(|c| if c == '\t' { '\t' } else { ' ' })
            .chain(std::iter::once('^'))
            .collect();
        FormatError {
            path: self.path.map(str::to_string),
            line,
            column,
            message,
            snippet: format!("{src_line}\n{caret}"),
        }
    }
}

/// Collects errors up to [`MAX_ERRORS`].
#[derive(Debug)]
pub(crate) struct Errors<'a> {
    pub(crate) src: &'a Source<'a>,
    list: Vec<FormatError>,
}

impl<'a> Errors<'a> {
    pub(crate) fn new(src: &'a Source<'a>) -> Self {
        Errors { src, list: vec![] }
    }

    pub(crate) fn push(&mut self, offset: usize, message: String) {
        if self.list.len() < MAX_ERRORS {
            self.list.push(self.src.error(offset, message));
        }
    }

    pub(crate) fn is_full(&self) -> bool {
        self.list.len() >= MAX_ERRORS
    }

    /// `Ok(ok)` when nothing was reported, else the errors in file order.
    pub(crate) fn into_result<T>(mut self, ok: T) -> Result<T, FormatErrors> {
        if self.list.is_empty() {
            Ok(ok)
        } else {
            self.list.sort_by_key(|e| (e.line, e.column));
            Err(FormatErrors(self.list))
        }
    }
}

/// A string with the byte offset where it was written.
#[derive(Clone, Debug)]
pub(crate) struct At<T> {
    pub(crate) v: T,
    pub(crate) pos: usize,
}

/// A node as written, before op lookup: untyped attrs, positions for every part.
#[derive(Debug, Default)]
pub(crate) struct RawNode {
    pub(crate) pos: usize,
    pub(crate) name: Option<At<String>>,
    pub(crate) op: Option<At<String>>,
    pub(crate) inputs: Vec<At<String>>,
    pub(crate) device: String,
    pub(crate) colocate_with: Vec<At<String>>,
    /// (name, value); the value's offset is where it starts.
    pub(crate) attrs: Vec<(At<String>, At<Value>)>,
}

/// Turns raw nodes into a [`ParsedGraph`], checking ops, attrs, names and inputs.
pub(crate) fn build_graph(raw: Vec<RawNode>, errs: &mut Errors<'_>) -> ParsedGraph {
    let mut nodes = Vec::with_capacity(raw.len());
    let mut positions = Vec::with_capacity(raw.len());
    let mut seen: HashMap<String, usize> = HashMap::with_capacity(raw.len());
    for r in raw {
        if errs.is_full() {
            break;
        }
        positions.push(errs.src.position(r.pos));
        if let Some(n) = build_node(r, &mut seen, errs) {
            nodes.push(n);
        }
    }
    ParsedGraph {
        def: GraphDef {
            version: FORMAT_VERSION,
            nodes,
            train: None,
        },
        node_positions: positions,
    }
}

fn build_node(
    r: RawNode,
    seen: &mut HashMap<String, usize>,
    errs: &mut Errors<'_>,
) -> Option<NodeDef> {
    let before = errs.list.len();
    let name = match r.name {
        Some(n) => {
            if let Err(e) = check_node_name(&n.v) {
                errs.push(n.pos, e);
            } else if let Some(&first) = seen.get(&n.v) {
                let (l, c) = errs.src.position(first);
                errs.push(
                    n.pos,
                    format!("duplicate node name {:?} (first defined at {l}:{c})", n.v),
                );
            } else {
                seen.insert(n.v.clone(), n.pos);
            }
            n.v
        }
        None => {
            errs.push(r.pos, "node has no name".into());
            String::new()
        }
    };
    let mut inputs = Vec::with_capacity(r.inputs.len());
    let mut first_control: Option<&str> = None;
    for i in &r.inputs {
        match crate::def::parse_input(&i.v) {
            Err(e) => errs.push(i.pos, e),
            Ok((_, None)) => first_control = first_control.or(Some(&i.v)),
            Ok((_, Some(_))) => {
                if let Some(c) = first_control {
                    errs.push(
                        i.pos,
                        format!(
                            "data input {:?} comes after control input {c:?}; \
                             control inputs (^name) must come last",
                            i.v
                        ),
                    );
                }
            }
        }
        inputs.push(i.v.clone());
    }
    let mut colocate_with = Vec::with_capacity(r.colocate_with.len());
    for c in r.colocate_with {
        if let Err(e) = check_node_name(&c.v) {
            errs.push(c.pos, format!("invalid colocate_with entry: {e}"));
        }
        colocate_with.push(c.v);
    }
    let attrs = match &r.op {
        None => {
            errs.push(r.pos, format!("node {name:?} has no op"));
            BTreeMap::new()
        }
        Some(op) => build_attrs(&name, op, r.attrs, errs),
    };
    (errs.list.len() == before).then(|| NodeDef {
        name,
        op: r.op.map(|o| o.v).unwrap_or_default(),
        inputs,
        device: r.device,
        colocate_with,
        attrs,
    })
}

fn build_attrs(
    node: &str,
    op: &At<String>,
    raw: Vec<(At<String>, At<Value>)>,
    errs: &mut Errors<'_>,
) -> BTreeMap<String, AttrValue> {
    let mut out = BTreeMap::new();
    let Some(def) = registry().get(&op.v) else {
        let hint = registry()
            .suggest(&op.v)
            .map(|s| format!(" (did you mean {s:?}?)"))
            .unwrap_or_default();
        errs.push(op.pos, format!("unknown op {:?}{hint}", op.v));
        return out;
    };
    // A required attr that is present but invalid gets one error (its own), not two.
    let given: Vec<String> = raw.iter().map(|(k, _)| k.v.clone()).collect();
    for (k, v) in raw {
        let Some(a) = def.attr(&k.v) else {
            let valid = if def.attrs.is_empty() {
                format!("{} takes no attrs", def.name)
            } else {
                let names: Vec<_> = def.attrs.iter().map(|a| a.name).collect();
                format!("valid attrs of {}: {}", def.name, names.join(", "))
            };
            errs.push(
                k.pos,
                format!("unknown attr {:?} for op {} ({valid})", k.v, def.name),
            );
            continue;
        };
        if out.contains_key(&k.v) {
            errs.push(k.pos, format!("attr {:?} given twice", k.v));
            continue;
        }
        match attr_from_json(&v.v, a.ty) {
            Ok(AttrValue::String(p)) if k.v == crate::sharding::SHARDING_ATTR => {
                match crate::sharding::parse_sharding(&p)
                    .and_then(|a| crate::sharding::check_op_placements(def.name, &a))
                {
                    Ok(()) => {
                        out.insert(k.v, AttrValue::String(p));
                    }
                    Err(e) => errs.push(v.pos, format!("node {node:?}, attr {:?}: {e}", k.v)),
                }
            }
            Ok(val) => {
                out.insert(k.v, val);
            }
            Err(e) => errs.push(v.pos, format!("attr {:?} of {}: {e}", k.v, def.name)),
        }
    }
    for a in &def.attrs {
        if a.default == AttrDefault::Required && !given.iter().any(|g| g == a.name) {
            errs.push(
                op.pos,
                format!(
                    "{} is missing required attr {:?} ({})",
                    def.name, a.name, a.ty
                ),
            );
        }
    }
    out
}

/// Non-finite floats are written as the strings `"nan"`, `"inf"`, `"-inf"` (like tensor values).
fn non_finite_name(x: f64) -> Option<&'static str> {
    if x.is_nan() {
        Some("nan")
    } else if x == f64::INFINITY {
        Some("inf")
    } else if x == f64::NEG_INFINITY {
        Some("-inf")
    } else {
        None
    }
}

/// Interprets an untyped value as attr type `ty` ([`AttrValue::from_json`] plus non-finite floats).
pub(crate) fn attr_from_json(v: &Value, ty: AttrType) -> Result<AttrValue, String> {
    if ty == AttrType::Float {
        if let Some(s) = v.as_str() {
            match s {
                "nan" => return Ok(AttrValue::Float(f64::NAN)),
                "inf" => return Ok(AttrValue::Float(f64::INFINITY)),
                "-inf" => return Ok(AttrValue::Float(f64::NEG_INFINITY)),
                _ => {}
            }
        }
    }
    AttrValue::from_json(v, ty)
}

/// An attr as untyped JSON (the inverse of [`attr_from_json`]).
pub(crate) fn attr_to_json(a: &AttrValue) -> Value {
    match a {
        AttrValue::Float(x) => match non_finite_name(*x) {
            Some(n) => Value::String(n.into()),
            None => a.to_json(),
        },
        _ => a.to_json(),
    }
}

#[cfg(test)]
mod tests;
