//! Validation errors. Each names the node(s) involved so a caller can point at the file position.

use crate::AttrType;
use std::fmt;

/// One problem found while validating a graph.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    /// The file format version is not supported.
    #[error("unsupported graph format version {found} (this dflow reads version {supported})")]
    UnsupportedVersion {
        /// Version in the file.
        found: u32,
        /// Version supported.
        supported: u32,
    },
    /// A node name breaks the naming rule.
    #[error("node #{index}: {message}")]
    InvalidName {
        /// Index of the node in file order.
        index: usize,
        /// What is wrong.
        message: String,
    },
    /// Two nodes share a name.
    #[error("duplicate node name `{name}` (nodes #{first} and #{second})")]
    DuplicateName {
        /// The name.
        name: String,
        /// Index of the first definition.
        first: usize,
        /// Index of the repeated definition.
        second: usize,
    },
    /// The op is not in the registry.
    #[error("node `{node}`: unknown op `{op}`{}", suggestion.map(|s| format!(" (did you mean `{s}`?)")).unwrap_or_default())]
    UnknownOp {
        /// Node name.
        node: String,
        /// The unknown op.
        op: String,
        /// The nearest registered op, if any is close.
        suggestion: Option<&'static str>,
    },
    /// An attribute the op does not declare.
    #[error("node `{node}` ({op}): unknown attribute `{attr}` (valid: {})", if valid.is_empty() { "none".to_string() } else { valid.join(", ") })]
    UnknownAttr {
        /// Node name.
        node: String,
        /// Op name.
        op: String,
        /// The attribute.
        attr: String,
        /// Attributes the op declares.
        valid: Vec<&'static str>,
    },
    /// A required attribute is missing.
    #[error("node `{node}` ({op}): missing required attribute `{attr}` of type {ty}")]
    MissingAttr {
        /// Node name.
        node: String,
        /// Op name.
        op: String,
        /// The attribute.
        attr: &'static str,
        /// Its declared type.
        ty: AttrType,
    },
    /// An attribute has the wrong type.
    #[error("node `{node}`: attribute `{attr}` must be {expected}, found {found}")]
    AttrType {
        /// Node name.
        node: String,
        /// The attribute.
        attr: String,
        /// Declared type.
        expected: AttrType,
        /// Given type.
        found: AttrType,
    },
    /// An input string is malformed or misplaced.
    #[error("node `{node}`: {message}")]
    InvalidInput {
        /// Node name.
        node: String,
        /// What is wrong.
        message: String,
    },
    /// An input names a node that does not exist.
    #[error("node `{node}`: input `{input}` refers to `{missing}`, which does not exist{}", suggestion.as_ref().map(|s| format!(" (did you mean `{s}`?)")).unwrap_or_default())]
    DanglingInput {
        /// Node name.
        node: String,
        /// The input string.
        input: String,
        /// The missing node.
        missing: String,
        /// The nearest existing node name.
        suggestion: Option<String>,
    },
    /// An input names an output index the producer does not have.
    #[error("node `{node}`: input `{input}` asks for output {index} of `{producer}`, which has {outputs} output(s)")]
    NoSuchOutput {
        /// Node name.
        node: String,
        /// The input string.
        input: String,
        /// Requested index.
        index: usize,
        /// Producer node.
        producer: String,
        /// Outputs the producer has.
        outputs: usize,
    },
    /// Wrong number of data inputs.
    #[error("node `{node}` ({op}): expects {expected} data input(s), got {found}")]
    Arity {
        /// Node name.
        node: String,
        /// Op name.
        op: String,
        /// Expected count (e.g. "2" or "at least 1").
        expected: String,
        /// Given count.
        found: usize,
    },
    /// `colocate_with` names a node that does not exist.
    #[error("node `{node}`: colocate_with refers to `{target}`, which does not exist")]
    UnknownColocation {
        /// Node name.
        node: String,
        /// The missing node.
        target: String,
    },
    /// The requested device does not parse.
    #[error("node `{node}`: {message}")]
    InvalidDevice {
        /// Node name.
        node: String,
        /// What is wrong.
        message: String,
    },
    /// The graph has a cycle (data or control edges).
    #[error("cycle: {}", path.join(" -> "))]
    Cycle {
        /// The nodes of the cycle, first repeated at the end.
        path: Vec<String>,
    },
    /// A reference input is not fed by a variable.
    #[error("node `{node}` ({op}): input {index} (`{arg}`) must come from a Variable, but `{producer}` is a {producer_op}")]
    RefInput {
        /// Node name.
        node: String,
        /// Op name.
        op: String,
        /// Input index.
        index: usize,
        /// Declared argument name.
        arg: &'static str,
        /// Producer node.
        producer: String,
        /// Producer's op.
        producer_op: String,
    },
    /// The `_sharding` attribute does not name a placement.
    #[error("{message}")]
    Sharding {
        /// Node name.
        node: String,
        /// What is wrong (names the node and what is accepted).
        message: String,
    },
    /// The op's dtype/shape rule rejected its inputs.
    #[error("node `{node}` ({op}): {message}")]
    Shape {
        /// Node name.
        node: String,
        /// Op name.
        op: String,
        /// The shape rule's message (names the shapes or dtypes).
        message: String,
    },
}

impl GraphError {
    /// The node this error is about, when there is one (for mapping to a file position).
    pub fn node(&self) -> Option<&str> {
        use GraphError::*;
        match self {
            UnknownOp { node, .. }
            | UnknownAttr { node, .. }
            | MissingAttr { node, .. }
            | AttrType { node, .. }
            | InvalidInput { node, .. }
            | DanglingInput { node, .. }
            | NoSuchOutput { node, .. }
            | Arity { node, .. }
            | UnknownColocation { node, .. }
            | InvalidDevice { node, .. }
            | RefInput { node, .. }
            | Sharding { node, .. }
            | Shape { node, .. } => Some(node),
            DuplicateName { name, .. } => Some(name),
            Cycle { path } => path.first().map(String::as_str),
            UnsupportedVersion { .. } | InvalidName { .. } => None,
        }
    }
}

/// Every problem found in one graph (at least one).
#[derive(Debug, Clone, PartialEq)]
pub struct GraphErrors(pub Vec<GraphError>);

impl GraphErrors {
    /// The individual errors.
    pub fn errors(&self) -> &[GraphError] {
        &self.0
    }
}

impl fmt::Display for GraphErrors {
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

impl std::error::Error for GraphErrors {}

impl From<GraphError> for GraphErrors {
    fn from(e: GraphError) -> Self {
        GraphErrors(vec![e])
    }
}
