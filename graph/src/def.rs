//! The serializable description of a graph: what the JSON and DSL formats read and write.
//!
//! A [`GraphDef`] is a list of [`NodeDef`]s in TensorFlow's style: each node names its op, its
//! inputs as strings (`"x"`, `"x:1"`, `"^x"` for a control dependency), its requested device and
//! its attributes. [`crate::Graph::from_def`] validates it and builds the IR.

use crate::AttrValue;
use std::collections::BTreeMap;
use std::fmt;

/// The current version of the graph file format.
pub const FORMAT_VERSION: u32 = 1;

/// A whole graph as written in a file.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct GraphDef {
    /// File format version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// The nodes, in file order.
    pub nodes: Vec<NodeDef>,
    /// The training step to add before partitioning (see [`crate::train::expand_training`]).
    pub train: Option<crate::train::TrainSpec>,
}

/// One node as written in a file.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct NodeDef {
    /// Unique name within the graph.
    pub name: String,
    /// Op type (a name in the op registry).
    pub op: String,
    /// Data inputs then control inputs, TF-style (`"x"`, `"x:1"`, `"^x"`).
    pub inputs: Vec<String>,
    /// Requested device, possibly partial (`"/job:ps"`); empty when unconstrained.
    pub device: String,
    /// Names of nodes this node must be placed with (TF's `_class: ["loc:@name"]`).
    pub colocate_with: Vec<String>,
    /// Attributes, typed by the op's declaration.
    pub attrs: BTreeMap<String, AttrValue>,
}

/// A parsed input reference.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum InputRef {
    /// Output `index` of node `node`.
    Data {
        /// Producer node name.
        node: String,
        /// Producer output index.
        index: usize,
    },
    /// A control dependency on `node`.
    Control(String),
}

impl InputRef {
    /// Parses `"x"`, `"x:1"` or `"^x"`.
    pub fn parse(s: &str) -> Result<InputRef, String> {
        Ok(match parse_input(s)? {
            (node, None) => InputRef::Control(node.to_string()),
            (node, Some(index)) => InputRef::Data {
                node: node.to_string(),
                index,
            },
        })
    }

    /// The producer node's name.
    pub fn node(&self) -> &str {
        match self {
            InputRef::Data { node, .. } | InputRef::Control(node) => node,
        }
    }
}

/// Parses an input string without allocating: the producer's name and, for a data input, the
/// output index (`None` for a control input `^x`).
pub(crate) fn parse_input(s: &str) -> Result<(&str, Option<usize>), String> {
    if let Some(rest) = s.strip_prefix('^') {
        check_node_name(rest).map_err(|e| format!("invalid control input {s:?}: {e}"))?;
        return Ok((rest, None));
    }
    let (node, index) = match s.rsplit_once(':') {
        Some((n, i)) => {
            let index = i
                .parse::<usize>()
                .map_err(|_| format!("invalid input {s:?}: output index {i:?} is not a number"))?;
            (n, index)
        }
        None => (s, 0),
    };
    check_node_name(node).map_err(|e| format!("invalid input {s:?}: {e}"))?;
    Ok((node, Some(index)))
}

impl fmt::Display for InputRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InputRef::Data { node, index: 0 } => f.write_str(node),
            InputRef::Data { node, index } => write!(f, "{node}:{index}"),
            InputRef::Control(node) => write!(f, "^{node}"),
        }
    }
}

/// Checks a node name: non-empty, at most 256 bytes, letters, digits and `_ . / -`, not starting
/// with `/` or `-` (TensorFlow's rule, slightly relaxed).
pub fn check_node_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("node name is empty".into());
    }
    if name.len() > 256 {
        return Err(format!(
            "node name is {} bytes long (limit 256)",
            name.len()
        ));
    }
    let first = name.chars().next().unwrap_or('_');
    if !(first.is_ascii_alphanumeric() || first == '_' || first == '.') {
        return Err(format!(
            "node name {name:?} must start with a letter, digit, '_' or '.'"
        ));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-')))
    {
        return Err(format!("node name {name:?} contains {bad:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_refs_parse_and_print() {
        for s in ["x", "x:1", "^x", "scope/y:12"] {
            assert_eq!(InputRef::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(InputRef::parse("x:0").unwrap().to_string(), "x");
        for bad in ["", "^", "x:", "x:a", ":1", "x y", "^^x", "x:-1"] {
            assert!(InputRef::parse(bad).is_err(), "{bad}");
        }
    }
}
