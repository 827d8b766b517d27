//! Importing TensorFlow GraphDefs written as protobuf JSON.
//!
//! [`import_graphdef_json`] reads what `google.protobuf.json_format.MessageToJson(graph_def)`
//! writes for a TF1-style graph and returns a dflow [`GraphDef`] that [`crate::Graph::from_def`]
//! accepts. Node names, inputs (`"x"`, `"x:1"`, `"^x"`) and requested devices are kept as
//! TensorFlow wrote them (dflow's [`crate::DeviceName`] parses TensorFlow's device grammar), and
//! `_class: ["loc:@w1"]` becomes [`NodeDef::colocate_with`].
//!
//! ```
//! use dflow_graph::tf_import::import_graphdef_json;
//! use dflow_graph::Graph;
//!
//! let text = r#"{"node": [
//!   {"name": "x", "op": "Placeholder", "device": "/job:worker/task:0",
//!    "attr": {"dtype": {"type": "DT_FLOAT"},
//!             "shape": {"shape": {"dim": [{"size": "-1"}, {"size": "3"}]}}}},
//!   {"name": "y", "op": "Relu", "input": ["x"], "attr": {"T": {"type": "DT_FLOAT"}}}
//! ]}"#;
//! let def = import_graphdef_json(text).unwrap();
//! let g = Graph::from_def(&def).unwrap();
//! assert_eq!(g.node(g.find("y").unwrap()).outputs[0].to_string(), "f32[?, 3]");
//! ```
//!
//! # What changes on the way in
//! - **Ops are renamed** to dflow's (`AddV2` → `Add`, `RealDiv` → `Div`, `VariableV2`,
//!   `Variable` and `VarHandleOp` → `Variable`, `ReadVariableOp` → `Identity`); TensorFlow's
//!   type attributes (`T`, `Tidx`, `SrcT`, ...) and private ones (`_output_shapes`, ...) are
//!   dropped, since dflow infers types.
//! - **Constant operands become attributes**: ArgMax's `dimension` → `axis`, the
//!   `reduction_indices` of Sum/Mean/Max → `axes`, Reshape's `shape` → `shape`. The operand must
//!   be a `Const`; the edge is removed, and so is the `Const` when nothing else reads it. A
//!   reduction over an empty axes constant (TensorFlow: reduce nothing) becomes an `Identity`,
//!   because an empty `axes` means "all axes" in dflow.
//! - **Variable initialization is dropped**: every `Assign`/`AssignVariableOp` into a
//!   variable of a value computed from constants alone (an assignment that reads a placeholder
//!   or a variable is a real update: it stays, as dflow's `Assign`),
//!   `IsVariableInitialized`/`VarIsInitializedOp`, every node whose name contains
//!   `/Initializer/`, and every node all of whose consumers are dropped (the random ops and
//!   constants feeding an initializer). The variable starts from exactly the values
//!   TensorFlow's initializer assigns:
//!   - a `Const` (or `Fill` of one) of a single repeated value becomes `zeros`, `ones` or
//!     `constant` with `init_value` (a broadcast-encoded constant is not expanded);
//!   - a `Const` of differing values (`tensorContent` or a value list) is carried over as the
//!     Variable's `initial_value` tensor;
//!   - a float32 `RandomStandardNormal`, `RandomUniform` or `TruncatedNormal` of the variable's
//!     shape, multiplied and offset by scalars computed from constants (`random_normal`,
//!     `truncated_normal`, `random_uniform`, Glorot and other variance-scaling initializers)
//!     becomes `tf_random_normal`, `tf_random_uniform` or `tf_truncated_normal` with the op's
//!     `seed`/`seed2`, `init_scale` and `init_value`: dflow draws TensorFlow's own values
//!     ([`crate::tf_random`]) when the session starts. Without seeds (TensorFlow then draws
//!     differently every run) the seeds come from the variable's name;
//!   - not float32, a Glorot-uniform draw becomes dflow's `glorot_uniform` (other values).
//!
//!   Anything else is an error naming the variable. A variable with no initializer in the
//!   graph starts at zeros. The `init` NoOp itself stays, without inputs, so `--target init`
//!   runs (dflow initializes variables when a session starts).
//! - **Training ops**: TensorFlow's optimizer applies (`ApplyGradientDescent`,
//!   `ResourceApplyGradientDescent`, `ApplyMomentum`, `ResourceApplyMomentum`, `ApplyAdam`,
//!   `ResourceApplyAdam`) become dflow's (`ApplyAdamWithPowers` for Adam, which reads
//!   `beta1^t`/`beta2^t` as TensorFlow's does), their constant hyper-parameter inputs (`lr`,
//!   `momentum`, `beta1`, `beta2`, `epsilon`) folded into attributes;
//!   `AssignAdd(VariableOp)`, `AssignSub(VariableOp)` and `Assign`/`AssignVariableOp` updates
//!   become `AssignAdd`, `AssignSub` and `Assign` ([`crate::ops::tf_compat`]); `ReluGrad`,
//!   `BiasAddGrad`, `SigmoidGrad` and `TanhGrad` keep their names and operand order. A
//!   `ReadVariableOp` without a device is colocated with its variable, as TensorFlow places it.
//! - **Partitioned variables** (`get_variable(..., partitioner=...)`: `emb/part_0`,
//!   `emb/part_1`, ...) import as their part variables, each with its own initializer, and the
//!   whole table TensorFlow reads through a `ConcatV2` of the parts becomes a `Concat` (its
//!   constant axis, the last input, folded into `axis`). The parts are not merged into one
//!   dflow variable: TensorFlow draws each part's initial values separately, and a checkpoint
//!   keeps TensorFlow's part names.
//! - **`embedding_lookup` over the parts** (`mod` and `div`) and **`embedding_lookup_sparse`**
//!   import op for op ([`crate::ops::tf_embedding`]): `DynamicPartition` (keeping
//!   `num_partitions`), `ResourceGather` → `Gather` (colocated with its part; `batch_dims` 0),
//!   `ParallelDynamicStitch` → `DynamicStitch`, `Less`, `Select`, `Size`, a `Range` of run-time
//!   scalars, `StridedSlice` (constant begin/end/strides folded into attributes, its begin, end
//!   and shrink masks kept; an ellipsis or new-axis mask is refused naming the node), `Unique`
//!   and `SparseSegmentSum`/`Mean`/`SqrtN`. A `ConcatV2` of constant int vectors along axis 0
//!   (the output shape a lookup builds) is computed at import, so the `Reshape` to it is static.
//!   TensorFlow's training graphs for them import too: `SparseSegmentSumGrad`/`MeanGrad`/
//!   `SqrtNGrad`, `UnsortedSegmentSum`, `ResourceScatterAdd` → `ScatterAdd` and
//!   `ResourceSparseApplyAdagrad` → `SparseApplyAdagrad` (inputs reordered to var, accum,
//!   indices, values; `lr` folded; epsilon 0, as TensorFlow's update has none).
//! - Ops dflow does not know are reported together, each with the nodes that use it, unless
//!   they belong to the dropped initializer subgraph. The run-time shape ops `tf.gradients`
//!   emits for a mean or a softmax cross-entropy (`Shape`, `Fill`, `Tile`, `Prod`, `FloorMod`,
//!   `GatherV2`, `ExpandDims`) are imported ([`crate::ops::tf_compat`]), and so is the chain
//!   it emits for a broadcasting `Add`/`Sub`/`Mul`/`Div` when shapes are not static
//!   ([`crate::ops::tf_dynamic`]): `BroadcastGradientArgs` keeps its name, a `Sum` whose axes
//!   are computed becomes `DynamicSum`, a `Reshape` to `Shape(y)` becomes `ReshapeLike(t, y)`
//!   (y's static shape, when it has one, stays known: tensors between tasks need one) and any
//!   other `Reshape` to a computed shape `DynamicReshape`. For a reduction over some axes of a
//!   tensor whose shape is not static, TensorFlow 2 emits `BroadcastTo` and `DynamicStitch`
//!   (kept) and a `Range` of constants (computed at import into a `Const`, so it folds like
//!   one). `Maximum` and `FloorDiv` (TF 1.x's `_safe_shape_div`) keep their names
//!   ([`crate::ops::tf_math`]). Other ops whose folded
//!   operand is computed at run time (`Mean`, `Max`, `Prod`, `Fill`, ...) are refused with the
//!   node named and what to do: fix the batch size (fully static placeholder shapes) before
//!   TensorFlow builds the gradients, and it emits constants instead.
//!
//! Protobuf JSON quirks handled: int64 values as JSON strings, `bytes` fields (string attrs,
//! `_class`) in base64, omitted default values (`{}` is a dimension of size 0, a missing `b` is
//! `false`), tensor values in `tensorContent` (base64, little-endian) or in typed lists
//! (`floatVal`, `intVal`, `int64Val`, ...) whose last value repeats to fill the shape, and the
//! original snake_case field names (`tensor_content`, `float_val`, ...) as well.

use crate::def::{InputRef, FORMAT_VERSION};
use crate::{AttrValue, DType, GraphDef, NodeDef, Shape, Tensor};
use base64::Engine as _;
use serde_json::{Map, Value};
use std::cell::Cell;
use std::collections::{BTreeSet, HashMap};
use std::fmt;

/// The largest constant tensor the importer materializes (bytes). Values written in full
/// (`tensorContent`, or a value list as long as the tensor) are bounded by the file's size anyway.
const MAX_TENSOR_BYTES: usize = 1 << 30;

/// How many bytes of repeated-value constants one import may expand, over all its constants.
///
/// TensorFlow may write a constant as a short value list whose last value repeats to fill the
/// shape (`{"tensorShape": [268435455], "floatVal": [1]}`): a few bytes of file that stand for a
/// gigabyte. dflow keeps constants expanded, so the importer charges each such expansion against
/// this budget *before* allocating and refuses the GraphDef beyond it, naming the constant.
/// Constants whose values are written in full are not charged.
pub const MAX_EXPANDED_CONST_BYTES: usize = 64 << 20;

/// Why a TensorFlow GraphDef could not be imported.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TfImportError {
    /// The text is not JSON.
    #[error("invalid JSON at line {line}, column {column}: {message}")]
    Json {
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The parser's message.
        message: String,
    },
    /// The JSON is not shaped like a GraphDef (no top-level `node` list).
    #[error("not a TensorFlow GraphDef: {0}")]
    NotGraphDef(String),
    /// One node is malformed or cannot be expressed in dflow.
    #[error("node #{index} `{node}` ({op}): {message}")]
    Node {
        /// Index of the node in the `node` list.
        index: usize,
        /// Node name (empty when the name itself is missing).
        node: String,
        /// TensorFlow op (empty when missing).
        op: String,
        /// What is wrong.
        message: String,
    },
    /// Ops dflow has no equivalent for, each with the nodes that use it.
    #[error("unsupported TensorFlow ops: {}", UnsupportedList(.0))]
    UnsupportedOps(Vec<UnsupportedOp>),
}

/// One TensorFlow op dflow cannot import, and where it is used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsupportedOp {
    /// TensorFlow op name.
    pub op: String,
    /// Nodes using it, in file order.
    pub nodes: Vec<String>,
}

struct UnsupportedList<'a>(&'a [UnsupportedOp]);

/// What to do about an operand TensorFlow computes at run time where dflow needs a constant
/// (dflow computes `Sum` axes and `Reshape` shapes at run time, other ops' as attributes).
const STATIC_SHAPES_HINT: &str = "dflow computes the axes of Sum and the shape of Reshape at \
     run time, but this operand must be constant. If tf.gradients computed it from a run-time \
     shape, give the graph's placeholders fully static shapes (a fixed batch size) before \
     building the gradients: TensorFlow then emits constants, which dflow imports";

impl fmt::Display for UnsupportedList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, u) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{} ({})", u.op, u.nodes.join(", "))?;
        }
        Ok(())
    }
}

/// True when `text` looks like a TensorFlow GraphDef in protobuf JSON: a JSON object with a
/// top-level `node` list whose first entry (if any) has an `op`. Cheap enough for format
/// detection in the CLI; it does not validate the nodes.
pub fn looks_like_tf_graphdef(text: &str) -> bool {
    let Ok(Value::Object(top)) = serde_json::from_str::<Value>(text) else {
        return false;
    };
    match top.get("node") {
        Some(Value::Array(nodes)) => nodes
            .first()
            .map_or(true, |n| n.get("op").is_some_and(Value::is_string)),
        _ => false,
    }
}

/// Reads a TensorFlow GraphDef written as protobuf JSON and returns the equivalent dflow graph
/// definition. See the [module docs](self) for what is renamed, folded and dropped.
pub fn import_graphdef_json(text: &str) -> Result<GraphDef, TfImportError> {
    let top: Value = serde_json::from_str(text).map_err(|e| TfImportError::Json {
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    let Value::Object(top) = top else {
        return Err(TfImportError::NotGraphDef(
            "expected a JSON object with a `node` list".into(),
        ));
    };
    let nodes = match top.get("node") {
        Some(Value::Array(nodes)) => nodes,
        Some(_) => {
            return Err(TfImportError::NotGraphDef(
                "top-level `node` is not a list".into(),
            ))
        }
        None => {
            return Err(TfImportError::NotGraphDef(
                "no top-level `node` list (an empty GraphDef has nothing to import)".into(),
            ))
        }
    };
    let raw = nodes
        .iter()
        .enumerate()
        .map(|(i, v)| RawNode::parse(i, v))
        .collect::<Result<Vec<_>, _>>()?;
    Importer::new(&raw)?.run()
}

// ---------------------------------------------------------------------------------------------
// Raw nodes
// ---------------------------------------------------------------------------------------------

/// One node as TensorFlow wrote it, with its inputs parsed.
struct RawNode<'a> {
    index: usize,
    name: String,
    op: String,
    inputs: Vec<InputRef>,
    device: String,
    attrs: &'a Map<String, Value>,
}

static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();

impl<'a> RawNode<'a> {
    fn parse(index: usize, v: &'a Value) -> Result<RawNode<'a>, TfImportError> {
        let err = |node: &str, op: &str, message: String| TfImportError::Node {
            index,
            node: node.to_string(),
            op: op.to_string(),
            message,
        };
        let Value::Object(obj) = v else {
            return Err(err("", "", "expected a JSON object".into()));
        };
        let string = |key: &str| match obj.get(key) {
            None => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(format!("`{key}` must be a string, found {}", kind(other))),
        };
        let name = string("name").map_err(|m| err("", "", m))?;
        let op = string("op").map_err(|m| err(&name, "", m))?;
        if name.is_empty() {
            return Err(err("", &op, "missing `name`".into()));
        }
        if op.is_empty() {
            return Err(err(&name, "", "missing `op`".into()));
        }
        let device = string("device").map_err(|m| err(&name, &op, m))?;
        let inputs = match obj.get("input") {
            None => vec![],
            Some(Value::Array(list)) => list
                .iter()
                .map(|i| {
                    let s = i.as_str().ok_or_else(|| {
                        format!("`input` entries must be strings, found {}", kind(i))
                    })?;
                    InputRef::parse(s)
                })
                .collect::<Result<_, _>>()
                .map_err(|m| err(&name, &op, m))?,
            Some(other) => {
                return Err(err(
                    &name,
                    &op,
                    format!("`input` must be a list, found {}", kind(other)),
                ))
            }
        };
        let attrs = match obj.get("attr") {
            None => EMPTY.get_or_init(Map::new),
            Some(Value::Object(m)) => m,
            Some(other) => {
                return Err(err(
                    &name,
                    &op,
                    format!("`attr` must be an object, found {}", kind(other)),
                ))
            }
        };
        Ok(RawNode {
            index,
            name,
            op,
            inputs,
            device,
            attrs,
        })
    }

    fn err(&self, message: impl Into<String>) -> TfImportError {
        TfImportError::Node {
            index: self.index,
            node: self.name.clone(),
            op: self.op.clone(),
            message: message.into(),
        }
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a bool",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn is_variable_op(op: &str) -> bool {
    matches!(op, "VariableV2" | "Variable" | "VarHandleOp")
}

/// Ops with constant operands that dflow takes as attributes: (operand index, dflow attr).
fn folded_operands(op: &str) -> &'static [(usize, &'static str)] {
    match op {
        "ArgMax" => &[(1, "axis")],
        "Sum" | "Mean" | "Max" => &[(1, "axes")],
        "Reshape" => &[(1, "shape")],
        // TensorFlow's optimizer applies take their hyper-parameters as (constant) inputs.
        "ApplyGradientDescent" | "ResourceApplyGradientDescent" => &[(1, "lr")],
        "ApplyMomentum" | "ResourceApplyMomentum" => &[(2, "lr"), (4, "momentum")],
        "ApplyAdam" | "ResourceApplyAdam" => {
            &[(5, "lr"), (6, "beta1"), (7, "beta2"), (8, "epsilon")]
        }
        "Fill" => &[(0, "shape")],
        "GatherV2" => &[(2, "axis")],
        "Prod" => &[(1, "axes")],
        "ExpandDims" => &[(1, "axis")],
        "StridedSlice" => &[(1, "begin"), (2, "end"), (3, "strides")],
        "ResourceSparseApplyAdagrad" | "SparseApplyAdagrad" => &[(2, "lr")],
        _ => &[],
    }
}

/// The operand slots of `n` folded into attributes: [`folded_operands`], and for `ConcatV2` its
/// last data input (the axis, after the variadic values).
fn folded_slots(n: &RawNode<'_>) -> Vec<usize> {
    if n.op == "ConcatV2" {
        let data = n
            .inputs
            .iter()
            .filter(|r| matches!(r, InputRef::Data { .. }))
            .count();
        return data.checked_sub(1).into_iter().collect();
    }
    folded_operands(&n.op).iter().map(|&(s, _)| s).collect()
}

/// Ops whose folded operand may instead be computed at run time: (TensorFlow op, operand, the
/// dflow op that reads it as a tensor).
fn runtime_operand_op(op: &str) -> Option<(usize, &'static str)> {
    match op {
        "Sum" => Some((1, "DynamicSum")),
        "Reshape" => Some((1, "DynamicReshape")),
        _ => None,
    }
}

/// The dflow op for a TensorFlow op, when there is one.
fn dflow_op(op: &str) -> Option<&'static str> {
    Some(match op {
        "Const" => "Const",
        "Placeholder" => "Placeholder",
        "VariableV2" | "Variable" | "VarHandleOp" => "Variable",
        "Identity" | "ReadVariableOp" => "Identity",
        "NoOp" => "NoOp",
        "Add" | "AddV2" => "Add",
        "Sub" => "Sub",
        "Mul" => "Mul",
        "RealDiv" | "Div" => "Div",
        "Neg" => "Neg",
        "MatMul" => "MatMul",
        "BiasAdd" => "BiasAdd",
        "Relu" => "Relu",
        "Sigmoid" => "Sigmoid",
        "Tanh" => "Tanh",
        "Softmax" => "Softmax",
        "SparseSoftmaxCrossEntropyWithLogits" => "SparseSoftmaxCrossEntropyWithLogits",
        "Sum" => "Sum",
        "Mean" => "Mean",
        "Max" => "Max",
        "ArgMax" => "ArgMax",
        "Reshape" => "Reshape",
        "Cast" => "Cast",
        "Equal" => "Equal",
        "AddN" => "AddN",
        "Square" => "Square",
        "Sqrt" => "Sqrt",
        "Exp" => "Exp",
        "Log" => "Log",
        "ZerosLike" => "ZerosLike",
        "OnesLike" => "OnesLike",
        // Gradient ops with TensorFlow's operand order.
        "ReluGrad" => "ReluGrad",
        "BiasAddGrad" => "BiasAddGrad",
        "SigmoidGrad" => "SigmoidGrad",
        "TanhGrad" => "TanhGrad",
        // Optimizer applies (ref and resource variables alike; constant hyper-parameters folded).
        "ApplyGradientDescent" | "ResourceApplyGradientDescent" => "ApplyGradientDescent",
        "ApplyMomentum" | "ResourceApplyMomentum" => "ApplyMomentum",
        "ApplyAdam" | "ResourceApplyAdam" => "ApplyAdamWithPowers",
        // Variable updates (an `Assign` from constants alone is an initializer, dropped before).
        "AssignAddVariableOp" | "AssignAdd" => "AssignAdd",
        "AssignSubVariableOp" | "AssignSub" => "AssignSub",
        "AssignVariableOp" | "Assign" => "Assign",
        // The run-time shape ops `tf.gradients` emits ([`crate::ops::tf_compat`]).
        "Shape" => "Shape",
        "Fill" => "Fill",
        "Tile" => "Tile",
        "GatherV2" => "GatherV2",
        // Partitioned variables are read through a ConcatV2 of their parts (constant axis).
        "ConcatV2" => "Concat",
        "Prod" => "Prod",
        "ExpandDims" => "ExpandDims",
        "FloorMod" => "FloorMod",
        // Run-time reduction axes of broadcasting gradients ([`crate::ops::tf_dynamic`]).
        "BroadcastGradientArgs" => "BroadcastGradientArgs",
        "BroadcastTo" => "BroadcastTo",
        "DynamicStitch" => "DynamicStitch",
        "Maximum" => "Maximum",
        "FloorDiv" => "FloorDiv",
        // `embedding_lookup` over a partitioned variable and `embedding_lookup_sparse`
        // ([`crate::ops::tf_embedding`], [`crate::ops::sparse_embedding`]).
        "DynamicPartition" => "DynamicPartition",
        "ParallelDynamicStitch" => "DynamicStitch",
        "ResourceGather" => "Gather",
        "Less" => "Less",
        "Select" => "Select",
        "Size" => "Size",
        "Range" => "Range",
        "StridedSlice" => "StridedSlice",
        "Unique" => "Unique",
        "SparseSegmentSum" => "SparseSegmentSum",
        "SparseSegmentMean" => "SparseSegmentMean",
        "SparseSegmentSqrtN" => "SparseSegmentSqrtN",
        // What TensorFlow's gradients and GradientDescentOptimizer emit for them.
        "SparseSegmentSumGrad" => "SparseSegmentSumGrad",
        "SparseSegmentMeanGrad" => "SparseSegmentMeanGrad",
        "SparseSegmentSqrtNGrad" => "SparseSegmentSqrtNGrad",
        "ResourceScatterAdd" => "ScatterAdd",
        // ... and its AdagradOptimizer (rows summed per unique index, then the update).
        "UnsortedSegmentSum" => "UnsortedSegmentSum",
        "ResourceSparseApplyAdagrad" | "SparseApplyAdagrad" => "SparseApplyAdagrad",
        _ => return None,
    })
}

// ---------------------------------------------------------------------------------------------
// The import itself
// ---------------------------------------------------------------------------------------------

struct Importer<'r, 'a> {
    nodes: &'r [RawNode<'a>],
    by_name: HashMap<&'r str, usize>,
    /// For each node, the indices of the nodes that read it (data or control), with repeats.
    consumers: Vec<Vec<usize>>,
    dropped: Vec<bool>,
    /// (consumer, input slot) edges folded into an attribute.
    folded: BTreeSet<(usize, usize)>,
    /// Nodes whose foldable operand is computed at run time: they become the dflow op of
    /// [`runtime_operand_op`].
    runtime_operand: BTreeSet<usize>,
    /// Nodes computed from constants at import (a `Range` of constant scalars): they become
    /// `Const`s and can be folded like one.
    computed: HashMap<usize, Tensor>,
    /// Bytes of repeated-value constants this import may still expand.
    budget: Cell<usize>,
}

impl<'r, 'a> Importer<'r, 'a> {
    fn new(nodes: &'r [RawNode<'a>]) -> Result<Self, TfImportError> {
        let mut by_name = HashMap::with_capacity(nodes.len());
        for n in nodes {
            if let Some(first) = by_name.insert(n.name.as_str(), n.index) {
                return Err(n.err(format!("duplicate node name (first defined at #{first})")));
            }
        }
        let mut consumers = vec![vec![]; nodes.len()];
        for n in nodes {
            for input in &n.inputs {
                let Some(&src) = by_name.get(input.node()) else {
                    return Err(n.err(format!("input `{input}` names no node")));
                };
                consumers[src].push(n.index);
            }
        }
        Ok(Importer {
            nodes,
            by_name,
            consumers,
            dropped: vec![false; nodes.len()],
            folded: BTreeSet::new(),
            runtime_operand: BTreeSet::new(),
            computed: HashMap::new(),
            budget: Cell::new(MAX_EXPANDED_CONST_BYTES),
        })
    }

    fn producer(&self, r: &InputRef) -> usize {
        // Every input was resolved in `new`.
        self.by_name.get(r.node()).copied().unwrap_or(usize::MAX)
    }

    fn run(mut self) -> Result<GraphDef, TfImportError> {
        self.drop_initializers();
        self.compute_constant_ranges();
        self.compute_constant_concats();
        self.check_supported()?;
        let initializers = self.initializer_kinds();
        self.fold_constant_operands()?;
        let mut out = Vec::new();
        for n in self.nodes {
            if !self.dropped[n.index] {
                out.push(self.convert(n, &initializers)?);
            }
        }
        Ok(GraphDef {
            version: FORMAT_VERSION,
            nodes: out,
            train: None,
        })
    }

    /// Marks the variable-initialization subgraph as dropped.
    fn drop_initializers(&mut self) {
        for n in self.nodes {
            // Only an assignment of a value computed from constants alone initializes; one
            // that reads data or state (`w.assign(w + 1)`) is a real update and stays (and is
            // then reported as unsupported).
            let assigns_variable = matches!(n.op.as_str(), "Assign" | "AssignVariableOp")
                && n.inputs.first().is_some_and(|r| {
                    matches!(r, InputRef::Data { .. })
                        && is_variable_op(&self.nodes[self.producer(r)].op)
                })
                && n.inputs
                    .get(1)
                    .is_some_and(|r| self.computed_from_constants(self.producer(r)));
            let is_init_check = matches!(
                n.op.as_str(),
                "IsVariableInitialized" | "VarIsInitializedOp"
            );
            if assigns_variable || is_init_check || n.name.contains("/Initializer/") {
                self.dropped[n.index] = true;
            }
        }
        // Grow the set: nodes read only by dropped nodes, and NoOps waiting only on dropped nodes.
        loop {
            let mut changed = false;
            for n in self.nodes {
                if self.dropped[n.index] || is_variable_op(&n.op) {
                    continue;
                }
                let readers = &self.consumers[n.index];
                let only_feeds_dropped =
                    !readers.is_empty() && readers.iter().all(|&c| self.dropped[c]);
                // A NoOp waiting only on initializers (`init`) stays, without those inputs: dflow
                // initializes variables when a session starts, and `--target init` still runs.
                if only_feeds_dropped {
                    self.dropped[n.index] = true;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
    }

    /// True when no data ancestor of node `i` (itself included) is a variable or placeholder.
    fn computed_from_constants(&self, i: usize) -> bool {
        let mut stack = vec![i];
        let mut seen = BTreeSet::new();
        while let Some(i) = stack.pop() {
            if !seen.insert(i) {
                continue;
            }
            let n = &self.nodes[i];
            if is_variable_op(&n.op) || n.op.starts_with("Placeholder") {
                return false;
            }
            stack.extend(
                n.inputs
                    .iter()
                    .filter(|r| matches!(r, InputRef::Data { .. }))
                    .map(|r| self.producer(r)),
            );
        }
        true
    }

    /// Evaluates every `Range` whose start, limit and delta are constant int scalars (the axes
    /// TensorFlow 2's reduction gradients build: `range(rank)`), so it is folded like a `Const`.
    fn compute_constant_ranges(&mut self) {
        for n in self.nodes {
            if n.op != "Range" || self.dropped[n.index] || n.inputs.len() < 3 {
                continue;
            }
            let scalar = |r: &InputRef| -> Option<(DType, i64)> {
                let src = &self.nodes[self.producer(r)];
                if !matches!(r, InputRef::Data { index: 0, .. }) || src.op != "Const" {
                    return None;
                }
                let t = tensor_attr(src.attrs.get("value")?, &side_budget()).ok()?;
                let v = match t.dtype() {
                    DType::I32 => i64::from(*t.as_slice::<i32>().ok()?.first()?),
                    DType::I64 => *t.as_slice::<i64>().ok()?.first()?,
                    _ => return None,
                };
                (t.num_elements() == 1).then_some((t.dtype(), v))
            };
            let vals: Option<Vec<(DType, i64)>> = n.inputs[..3].iter().map(scalar).collect();
            let Some([(dtype, start), (d1, limit), (d2, delta)]) =
                vals.as_deref().map(|v| [v[0], v[1], v[2]])
            else {
                continue;
            };
            if d1 != dtype || d2 != dtype {
                continue;
            }
            if let Some(t) = constant_range(dtype, start, limit, delta) {
                self.computed.insert(n.index, t);
                for slot in 0..3 {
                    self.folded.insert((n.index, slot));
                }
            }
        }
    }

    /// Evaluates every `ConcatV2` of constant int vectors along axis 0 (the output shape
    /// `embedding_lookup` builds from its ids' static shape and the rows' width), so the
    /// `Reshape` reading it gets a constant shape and a static output.
    fn compute_constant_concats(&mut self) {
        for n in self.nodes {
            if n.op != "ConcatV2" || self.dropped[n.index] {
                continue;
            }
            let data: Vec<&InputRef> = n
                .inputs
                .iter()
                .filter(|r| matches!(r, InputRef::Data { .. }))
                .collect();
            let Some((axis, values)) = data.split_last() else {
                continue;
            };
            let constant = |r: &InputRef| -> Option<Tensor> {
                let src = self.producer(r);
                if !matches!(r, InputRef::Data { index: 0, .. }) {
                    return None;
                }
                match self.computed.get(&src) {
                    Some(t) => Some(t.clone()),
                    None if self.nodes[src].op == "Const" => {
                        let value = self.nodes[src].attrs.get("value")?;
                        // Only small vectors are joined: the declared size is checked before
                        // a repeated-value constant is expanded.
                        let declared = field(value.get("tensor")?, "tensorShape", "tensor_shape")
                            .map_or(Some(Shape::scalar()), |s| shape_proto(s).ok())?
                            .num_elements()?;
                        if declared > MAX_CONSTANT_RANGE as usize {
                            return None;
                        }
                        tensor_attr(value, &side_budget()).ok()
                    }
                    None => None,
                }
            };
            let axis_ok = constant(axis).is_some_and(|t| {
                matches!(t.dtype(), DType::I32 | DType::I64)
                    && t.num_elements() == 1
                    && matches!(t.to_f64_vec()[..], [a] if a == 0.0 || a == -1.0)
            });
            let Some(parts) = values
                .iter()
                .map(|r| constant(r))
                .collect::<Option<Vec<_>>>()
            else {
                continue;
            };
            let Some(dtype) = parts.first().map(Tensor::dtype) else {
                continue;
            };
            let fits = axis_ok
                && matches!(dtype, DType::I32 | DType::I64)
                && parts.iter().all(|t| t.dtype() == dtype && t.rank() == 1)
                && parts.iter().map(Tensor::num_elements).sum::<usize>()
                    <= MAX_CONSTANT_RANGE as usize;
            if !fits {
                continue;
            }
            let joined = if dtype == DType::I32 {
                let v: Vec<i32> = parts
                    .iter()
                    .filter_map(|t| t.as_slice::<i32>().ok())
                    .flatten()
                    .copied()
                    .collect();
                Tensor::from_slice(&[v.len()], &v)
            } else {
                let v: Vec<i64> = parts
                    .iter()
                    .filter_map(|t| t.as_slice::<i64>().ok())
                    .flatten()
                    .copied()
                    .collect();
                Tensor::from_slice(&[v.len()], &v)
            };
            if let Ok(t) = joined {
                self.computed.insert(n.index, t);
                for (slot, r) in n.inputs.iter().enumerate() {
                    if matches!(r, InputRef::Data { .. }) {
                        self.folded.insert((n.index, slot));
                    }
                }
            }
        }
    }

    fn check_supported(&self) -> Result<(), TfImportError> {
        let mut unsupported: Vec<UnsupportedOp> = Vec::new();
        for n in self.nodes {
            if self.dropped[n.index]
                || dflow_op(&n.op).is_some()
                || self.computed.contains_key(&n.index)
            {
                continue;
            }
            match unsupported.iter_mut().find(|u| u.op == n.op) {
                Some(u) => u.nodes.push(n.name.clone()),
                None => unsupported.push(UnsupportedOp {
                    op: n.op.clone(),
                    nodes: vec![n.name.clone()],
                }),
            }
        }
        if unsupported.is_empty() {
            Ok(())
        } else {
            Err(TfImportError::UnsupportedOps(unsupported))
        }
    }

    /// What the dropped initializing `Assign` of each variable assigns.
    fn initializer_kinds(&self) -> HashMap<usize, InitValue> {
        let mut kinds = HashMap::new();
        for n in self.nodes {
            if !matches!(n.op.as_str(), "Assign" | "AssignVariableOp") || !self.dropped[n.index] {
                continue;
            }
            let (Some(var), Some(value)) = (n.inputs.first(), n.inputs.get(1)) else {
                continue;
            };
            let var = self.producer(var);
            let value = self.producer(value);
            let kind = self
                .classify_initializer(var, value)
                .unwrap_or(InitValue::Unknown);
            kinds.insert(var, kind);
        }
        kinds
    }

    fn classify_initializer(&self, var: usize, value: usize) -> Option<InitValue> {
        let v = &self.nodes[value];
        if let Some(kind) = self.constant_initial_value(v) {
            return Some(kind);
        }
        if let Some(kind) = self.tf_random_initial_value(&self.nodes[var], v) {
            return Some(kind);
        }
        // Not float32 (TensorFlow's draws are reproduced for float32 only): a Glorot-uniform
        // draw still becomes dflow's `glorot_uniform` (same distribution, other values).
        let mut stack = vec![value];
        let mut seen = BTreeSet::new();
        let mut ops = BTreeSet::new();
        let mut scalars = Vec::new();
        while let Some(i) = stack.pop() {
            if !seen.insert(i) || !self.dropped[i] {
                continue;
            }
            let n = &self.nodes[i];
            ops.insert(n.op.as_str());
            if n.op == "Const" {
                if let Some(Ok(t)) = n.attrs.get("value").map(|v| tensor_attr(v, &side_budget())) {
                    if t.num_elements() == 1 && t.dtype().is_float() {
                        scalars.extend(t.to_f64_vec());
                    }
                }
            }
            stack.extend(n.inputs.iter().map(|r| self.producer(r)));
        }
        let limit = glorot_limit(&self.nodes[var]);
        let is_glorot = ops.contains("RandomUniform")
            && limit.is_some_and(|l| {
                scalars
                    .iter()
                    .any(|s| (s.abs() - l).abs() <= 1e-6 * l.max(1e-12))
            });
        is_glorot.then_some(InitValue::Named("glorot_uniform"))
    }

    /// The value of `n` when it is a Const, or a Fill of a Const: one repeated value (`zeros`,
    /// `ones`, `constant`, found without expanding a broadcast-encoded constant) or the exact
    /// tensor ([`InitValue::Tensor`]; an expansion is charged to the import's budget).
    fn constant_initial_value(&self, n: &RawNode<'_>) -> Option<InitValue> {
        let (value_node, fill) = match n.op.as_str() {
            "Const" => (n, false),
            "Fill" => (&self.nodes[self.producer(n.inputs.get(1)?)], true),
            _ => return None,
        };
        if value_node.op != "Const" {
            return None;
        }
        let value = value_node.attrs.get("value")?;
        let uniform = match value.get("tensor").and_then(uniform_value) {
            Some(v) => Some(v),
            None => {
                let t = tensor_attr(value, &self.budget).ok()?;
                let values = t.to_f64_vec();
                let first = values.first().copied().unwrap_or(0.0);
                if values.iter().all(|&x| x.to_bits() == first.to_bits()) {
                    Some(first)
                } else if fill {
                    return None; // Fill's value must be a scalar
                } else {
                    return Some(InitValue::Tensor(std::sync::Arc::new(t)));
                }
            }
        };
        uniform.map(|v| {
            if v == 0.0 && v.is_sign_positive() {
                InitValue::Named("zeros")
            } else if v == 1.0 {
                InitValue::Named("ones")
            } else {
                InitValue::Constant(v)
            }
        })
    }

    /// A float32 variable initialized by `rnd × scale + offset`, `rnd` a TensorFlow random op
    /// (`RandomStandardNormal`, `RandomUniform`, `TruncatedNormal`) of the variable's shape and
    /// `scale`, `offset` scalar constants (TensorFlow's `random_normal`, `truncated_normal`,
    /// `random_uniform` and variance-scaling initializers build exactly this): TensorFlow's
    /// draw, reproduced. An op without seeds (TensorFlow draws a fresh seed each run) gets
    /// seeds from the variable's name, so dflow's values are reproducible.
    fn tf_random_initial_value(&self, var: &RawNode<'_>, value: &RawNode<'_>) -> Option<InitValue> {
        let split = |n: &RawNode<'_>| -> Option<(usize, f32)> {
            let (a, b) = (
                self.producer(n.inputs.first()?),
                self.producer(n.inputs.get(1)?),
            );
            match (self.scalar_f32(a, 0), self.scalar_f32(b, 0)) {
                (_, Some(s)) => Some((a, s)),
                (Some(s), None) => Some((b, s)),
                (None, None) => None,
            }
        };
        let mut node = value;
        let mut offset = 0.0f32;
        if matches!(node.op.as_str(), "Add" | "AddV2") {
            let (rest, s) = split(node)?;
            (node, offset) = (&self.nodes[rest], s);
        }
        let mut scale = 1.0f32;
        if node.op == "Mul" {
            let (rest, s) = split(node)?;
            (node, scale) = (&self.nodes[rest], s);
        }
        let init = match node.op.as_str() {
            "RandomStandardNormal" => "tf_random_normal",
            "RandomUniform" => "tf_random_uniform",
            "TruncatedNormal" => "tf_truncated_normal",
            _ => return None,
        };
        let f32_type = |v: Option<&Value>| v.and_then(|v| dtype_attr(v).ok()) == Some(DType::F32);
        if !f32_type(node.attrs.get("dtype")) || !f32_type(var.attrs.get("dtype")) {
            return None;
        }
        let var_dims = shape_attr(var.attrs.get("shape")?).ok()?.as_static()?;
        let dims = self.folded_ints(node, 0).ok()?;
        if dims.len() != var_dims.len() || dims.iter().zip(&var_dims).any(|(&a, &b)| a != b as i64)
        {
            return None;
        }
        let seed_attr = |name: &str| {
            node.attrs
                .get(name)
                .and_then(|v| v.get("i"))
                .map_or(Ok(0), int_value)
        };
        let (mut seed, seed2) = (seed_attr("seed").ok()?, seed_attr("seed2").ok()?);
        if seed == 0 && seed2 == 0 {
            seed = i64::from(fnv1a32(&var.name)) + 1;
        }
        Some(InitValue::TfRandom {
            init,
            seed,
            seed2,
            scale: f64::from(scale),
            offset: f64::from(offset),
        })
    }

    /// For a `Reshape` whose shape operand is output 0 of a `Shape` node: that node's input.
    fn shape_source(&self, n: &RawNode<'_>) -> Option<&InputRef> {
        if n.op != "Reshape" {
            return None;
        }
        let r @ InputRef::Data { index: 0, .. } = n.inputs.get(1)? else {
            return None;
        };
        let s = &self.nodes[self.producer(r)];
        if s.op != "Shape" || self.dropped[s.index] {
            return None;
        }
        s.inputs
            .first()
            .filter(|y| matches!(y, InputRef::Data { .. }))
    }

    /// The float32 value of a scalar computed from constants (`Const`; `Add`, `AddV2`, `Sub`,
    /// `Mul`, `RealDiv`, `Neg` of such), in float32 as TensorFlow computes it.
    fn scalar_f32(&self, i: usize, depth: usize) -> Option<f32> {
        let n = &self.nodes[i];
        if depth > 8 {
            return None;
        }
        let arg = |k: usize| self.scalar_f32(self.producer(n.inputs.get(k)?), depth + 1);
        // f32 arithmetic on f32 values: one rounding per op, like TensorFlow's kernels.
        Some(match n.op.as_str() {
            "Const" => {
                let t = n
                    .attrs
                    .get("value")
                    .map(|v| tensor_attr(v, &side_budget()))?
                    .ok()?;
                if t.dtype() != DType::F32 || t.num_elements() != 1 {
                    return None;
                }
                *t.as_slice::<f32>().ok()?.first()?
            }
            "Identity" => arg(0)?,
            "Neg" => -arg(0)?,
            "Add" | "AddV2" => arg(0)? + arg(1)?,
            "Sub" => arg(0)? - arg(1)?,
            "Mul" => arg(0)? * arg(1)?,
            "RealDiv" | "Div" => arg(0)? / arg(1)?,
            _ => return None,
        })
    }

    /// Turns constant operands into attributes (recorded in `self.folded`), dropping constants
    /// that nothing else reads.
    fn fold_constant_operands(&mut self) -> Result<(), TfImportError> {
        for n in self.nodes {
            if self.dropped[n.index] {
                continue;
            }
            for slot in folded_slots(n) {
                let Some(r @ InputRef::Data { .. }) = n.inputs.get(slot) else {
                    return Err(n.err(format!("expected a constant operand at input {slot}")));
                };
                let src = self.producer(r);
                let constant = self.nodes[src].op == "Const" || self.computed.contains_key(&src);
                if !constant && runtime_operand_op(&n.op).is_some_and(|(s, _)| s == slot) {
                    self.runtime_operand.insert(n.index);
                    continue;
                }
                if !constant {
                    return Err(n.err(format!(
                        "operand `{r}` (a `{}`) must be a Const: dflow takes it as a static \
                         attribute and does not compute it at run time. {STATIC_SHAPES_HINT}",
                        self.nodes[src].op
                    )));
                }
                self.folded.insert((n.index, slot));
            }
        }
        for n in self.nodes {
            let constant = n.op == "Const" || self.computed.contains_key(&n.index);
            if !constant || self.dropped[n.index] {
                continue;
            }
            let readers = &self.consumers[n.index];
            let still_read =
                readers.iter().any(|&c| {
                    !self.dropped[c]
                        && self.nodes[c].inputs.iter().enumerate().any(|(slot, r)| {
                            r.node() == n.name && !self.folded.contains(&(c, slot))
                        })
                });
            if !readers.is_empty() && !still_read {
                self.dropped[n.index] = true;
            }
        }
        Ok(())
    }

    fn folded_ints(&self, n: &RawNode<'_>, slot: usize) -> Result<Vec<i64>, TfImportError> {
        let src = n
            .inputs
            .get(slot)
            .map(|r| &self.nodes[self.producer(r)])
            .ok_or_else(|| n.err(format!("missing input {slot}")))?;
        let t = match self.computed.get(&src.index) {
            Some(t) => t.clone(),
            None => {
                let value = src
                    .attrs
                    .get("value")
                    .ok_or_else(|| n.err(format!("operand Const `{}` has no `value`", src.name)))?;
                tensor_attr(value, &side_budget())
                    .map_err(|m| n.err(format!("operand Const `{}`: {m}", src.name)))?
            }
        };
        let ints = match t.dtype() {
            DType::I32 => t
                .as_slice::<i32>()
                .map(|v| v.iter().map(|&x| i64::from(x)).collect()),
            DType::I64 => t.as_slice::<i64>().map(<[i64]>::to_vec),
            d => {
                return Err(n.err(format!(
                    "operand Const `{}` must be int32 or int64, found {d}",
                    src.name
                )))
            }
        };
        ints.map_err(|e| n.err(e.to_string()))
    }

    /// The scalar float value of the constant operand at `slot` (a folded hyper-parameter).
    fn folded_float(&self, n: &RawNode<'_>, slot: usize) -> Result<f64, TfImportError> {
        let src = n
            .inputs
            .get(slot)
            .map(|r| &self.nodes[self.producer(r)])
            .ok_or_else(|| n.err(format!("missing input {slot}")))?;
        let value = src
            .attrs
            .get("value")
            .ok_or_else(|| n.err(format!("operand Const `{}` has no `value`", src.name)))?;
        let t = tensor_attr(value, &side_budget())
            .map_err(|m| n.err(format!("operand Const `{}`: {m}", src.name)))?;
        match t.to_f64_vec()[..] {
            [v] => Ok(v),
            ref vals => Err(n.err(format!(
                "operand Const `{}` must be a scalar, found {} values",
                src.name,
                vals.len()
            ))),
        }
    }

    fn convert(
        &self,
        n: &RawNode<'_>,
        initializers: &HashMap<usize, InitValue>,
    ) -> Result<NodeDef, TfImportError> {
        let op = if self.computed.contains_key(&n.index) {
            "Const"
        } else {
            dflow_op(&n.op).ok_or_else(|| n.err("unsupported op"))?
        };
        let mut out = NodeDef {
            name: n.name.clone(),
            op: op.to_string(),
            device: n.device.clone(),
            ..NodeDef::default()
        };
        for (slot, r) in n.inputs.iter().enumerate() {
            let src = self.producer(r);
            if self.folded.contains(&(n.index, slot)) {
                continue;
            }
            if self.dropped[src] {
                match r {
                    InputRef::Control(_) => continue,
                    InputRef::Data { .. } => {
                        return Err(n.err(format!(
                            "reads `{r}`, which is part of the variable-initialization \
                             subgraph that the importer drops"
                        )))
                    }
                }
            }
            out.inputs.push(r.to_string());
        }
        if let Some(v) = n.attrs.get("_class") {
            for loc in string_list_attr(v).map_err(|m| n.err(format!("attr `_class`: {m}")))? {
                let Some(target) = loc.strip_prefix("loc:@") else {
                    continue;
                };
                let keep =
                    target != n.name && self.by_name.get(target).is_some_and(|&i| !self.dropped[i]);
                if keep && !out.colocate_with.iter().any(|c| c == target) {
                    out.colocate_with.push(target.to_string());
                }
            }
        }
        let a = &mut out.attrs;
        let get = |name: &str| n.attrs.get(name);
        let wrap = |name: &'static str| move |m: String| n.err(format!("attr `{name}`: {m}"));
        if let Some(t) = self.computed.get(&n.index) {
            // A Range or ConcatV2 of constants, computed at import.
            a.insert("value".into(), AttrValue::Tensor(t.clone().into()));
            return Ok(out);
        }
        match n.op.as_str() {
            "Const" => {
                let v = get("value").ok_or_else(|| n.err("missing attr `value`"))?;
                a.insert(
                    "value".into(),
                    AttrValue::Tensor(tensor_attr(v, &self.budget).map_err(wrap("value"))?.into()),
                );
            }
            "Placeholder" => {
                let d = get("dtype").ok_or_else(|| n.err("missing attr `dtype`"))?;
                a.insert(
                    "dtype".into(),
                    AttrValue::DType(dtype_attr(d).map_err(wrap("dtype"))?),
                );
                if let Some(s) = get("shape") {
                    a.insert(
                        "shape".into(),
                        AttrValue::Shape(shape_attr(s).map_err(wrap("shape"))?),
                    );
                }
            }
            "VariableV2" | "Variable" | "VarHandleOp" => {
                let d = get("dtype").ok_or_else(|| n.err("missing attr `dtype`"))?;
                let s = get("shape").ok_or_else(|| n.err("missing attr `shape`"))?;
                a.insert(
                    "dtype".into(),
                    AttrValue::DType(dtype_attr(d).map_err(wrap("dtype"))?),
                );
                a.insert(
                    "shape".into(),
                    AttrValue::Shape(shape_attr(s).map_err(wrap("shape"))?),
                );
                // No initializer in the graph at all (values restored elsewhere): zeros.
                let cannot = |why: &str| {
                    n.err(format!(
                        "variable `{}`: its initializer {why}, which dflow cannot carry over \
                         (dflow carries over constants, and float32 random_normal, \
                         truncated_normal and random_uniform draws scaled and offset by \
                         constants); re-export it with such an initializer, or leave it out of \
                         the graph",
                        n.name
                    ))
                };
                match initializers
                    .get(&n.index)
                    .cloned()
                    .unwrap_or(InitValue::Named("zeros"))
                {
                    InitValue::Named(kind) => {
                        a.insert("initializer".into(), AttrValue::String(kind.into()));
                    }
                    InitValue::Constant(v) => {
                        a.insert("initializer".into(), AttrValue::String("constant".into()));
                        a.insert("init_value".into(), AttrValue::Float(v));
                    }
                    InitValue::Tensor(t) => {
                        a.insert("initial_value".into(), AttrValue::Tensor(t));
                    }
                    InitValue::TfRandom {
                        init,
                        seed,
                        seed2,
                        scale,
                        offset,
                    } => {
                        a.insert("initializer".into(), AttrValue::String(init.into()));
                        a.insert("seed".into(), AttrValue::Int(seed));
                        a.insert("seed2".into(), AttrValue::Int(seed2));
                        a.insert("init_scale".into(), AttrValue::Float(scale));
                        a.insert("init_value".into(), AttrValue::Float(offset));
                    }
                    InitValue::Unknown => {
                        return Err(cannot("is computed by ops the importer does not recognise"))
                    }
                }
            }
            "MatMul" => {
                for name in ["transpose_a", "transpose_b"] {
                    if let Some(v) = get(name) {
                        a.insert(
                            name.into(),
                            AttrValue::Bool(bool_attr(v).map_err(wrap(name))?),
                        );
                    }
                }
            }
            "BiasAdd" => {
                if let Some(v) = get("data_format") {
                    let f = string_attr(v).map_err(wrap("data_format"))?;
                    if !(f.is_empty() || f == "NHWC") {
                        return Err(n.err(format!(
                            "data_format {f:?} is not supported (dflow adds the bias along the \
                             last dimension, TensorFlow's NHWC)"
                        )));
                    }
                }
            }
            "Cast" => {
                let d = get("DstT").ok_or_else(|| n.err("missing attr `DstT`"))?;
                a.insert(
                    "DstT".into(),
                    AttrValue::DType(dtype_attr(d).map_err(wrap("DstT"))?),
                );
            }
            "ArgMax" => {
                let axis = self.folded_ints(n, 1)?;
                let [axis] = axis[..] else {
                    return Err(n.err(format!("dimension must be one integer, found {axis:?}")));
                };
                a.insert("axis".into(), AttrValue::Int(axis));
                if let Some(v) = get("output_type") {
                    a.insert(
                        "output_type".into(),
                        AttrValue::DType(dtype_attr(v).map_err(wrap("output_type"))?),
                    );
                }
            }
            "Shape" => {
                if let Some(v) = get("out_type") {
                    a.insert(
                        "out_type".into(),
                        AttrValue::DType(dtype_attr(v).map_err(wrap("out_type"))?),
                    );
                }
            }
            "Fill" => {
                let shape = self.folded_ints(n, 0)?;
                a.insert("shape".into(), AttrValue::IntList(shape));
            }
            "ConcatV2" => {
                let Some(&slot) = folded_slots(n).first() else {
                    return Err(n.err("ConcatV2 needs its values and an axis input"));
                };
                let axis = self.folded_ints(n, slot)?;
                let [axis] = axis[..] else {
                    return Err(n.err(format!("axis must be one integer, found {axis:?}")));
                };
                a.insert("axis".into(), AttrValue::Int(axis));
            }
            "GatherV2" => {
                let axis = self.folded_ints(n, 2)?;
                let [axis] = axis[..] else {
                    return Err(n.err(format!("axis must be one integer, found {axis:?}")));
                };
                if let Some(b) = get("batch_dims").map(|v| v.get("i").map_or(Ok(0), int_value)) {
                    let b = b.map_err(wrap("batch_dims"))?;
                    if b != 0 {
                        return Err(n.err(format!("batch_dims {b} is not supported (only 0)")));
                    }
                }
                a.insert("axis".into(), AttrValue::Int(axis));
            }
            "DynamicPartition" => {
                let v =
                    get("num_partitions").ok_or_else(|| n.err("missing attr `num_partitions`"))?;
                let k = v
                    .get("i")
                    .map_or(Ok(0), int_value)
                    .map_err(wrap("num_partitions"))?;
                a.insert("num_partitions".into(), AttrValue::Int(k));
            }
            "ResourceGather" => {
                if let Some(b) = get("batch_dims").map(|v| v.get("i").map_or(Ok(0), int_value)) {
                    let b = b.map_err(wrap("batch_dims"))?;
                    if b != 0 {
                        return Err(n.err(format!("batch_dims {b} is not supported (only 0)")));
                    }
                }
            }
            "Unique" | "Size" => {
                let name = if n.op == "Unique" {
                    "out_idx"
                } else {
                    "out_type"
                };
                if let Some(v) = get(name) {
                    let d = dtype_attr(v).map_err(|m| n.err(format!("attr `{name}`: {m}")))?;
                    a.insert(name.into(), AttrValue::DType(d));
                }
            }
            "StridedSlice" => {
                for (slot, name) in [(1, "begin"), (2, "end"), (3, "strides")] {
                    a.insert(name.into(), AttrValue::IntList(self.folded_ints(n, slot)?));
                }
                for name in [
                    "begin_mask",
                    "end_mask",
                    "shrink_axis_mask",
                    "ellipsis_mask",
                    "new_axis_mask",
                ] {
                    let v = get(name)
                        .map(|v| v.get("i").map_or(Ok(0), int_value))
                        .transpose()
                        .map_err(|m| n.err(format!("attr `{name}`: {m}")))?
                        .unwrap_or(0);
                    if matches!(name, "ellipsis_mask" | "new_axis_mask") {
                        if v != 0 {
                            return Err(n.err(format!(
                                "{name} {v} is not supported (dflow's StridedSlice takes begin,                                  end and shrink masks; write the slice without `...` and                                  `tf.newaxis`)"
                            )));
                        }
                    } else {
                        a.insert(name.into(), AttrValue::Int(v));
                    }
                }
            }
            "ExpandDims" => {
                let axis = self.folded_ints(n, 1)?;
                let [axis] = axis[..] else {
                    return Err(n.err(format!("dim must be one integer, found {axis:?}")));
                };
                a.insert("axis".into(), AttrValue::Int(axis));
            }
            _ if self.runtime_operand.contains(&n.index) => {
                // Sum over axes / Reshape to a shape computed at run time.
                if let Some((_, dynamic)) = runtime_operand_op(&n.op) {
                    out.op = dynamic.to_string();
                }
                // `Reshape(t, Shape(y))` (how tf.gradients reshapes a gradient back to its
                // operand) reshapes to y's run-time shape: dflow's ReshapeLike(t, y), whose
                // type is y's, so a gradient of a static operand stays static (a tensor
                // between tasks needs a static shape).
                if let Some(y) = self.shape_source(n) {
                    out.op = "ReshapeLike".into();
                    out.inputs[1] = y.to_string();
                }
                if let Some(v) = get("keep_dims") {
                    a.insert(
                        "keep_dims".into(),
                        AttrValue::Bool(bool_attr(v).map_err(wrap("keep_dims"))?),
                    );
                }
            }
            "Sum" | "Mean" | "Max" | "Prod" => {
                let axes = self.folded_ints(n, 1)?;
                if axes.is_empty() {
                    out.op = "Identity".into();
                } else {
                    a.insert("axes".into(), AttrValue::IntList(axes));
                    if let Some(v) = get("keep_dims") {
                        a.insert(
                            "keep_dims".into(),
                            AttrValue::Bool(bool_attr(v).map_err(wrap("keep_dims"))?),
                        );
                    }
                }
            }
            "Reshape" => {
                let shape = self.folded_ints(n, 1)?;
                a.insert("shape".into(), AttrValue::IntList(shape));
            }
            "ApplyGradientDescent" | "ResourceApplyGradientDescent" => {
                a.insert("lr".into(), AttrValue::Float(self.folded_float(n, 1)?));
            }
            "ApplyAdam" | "ResourceApplyAdam" => {
                for (slot, name) in [(5, "lr"), (6, "beta1"), (7, "beta2"), (8, "epsilon")] {
                    a.insert(name.into(), AttrValue::Float(self.folded_float(n, slot)?));
                }
                if get("use_nesterov")
                    .map(bool_attr)
                    .transpose()
                    .map_err(wrap("use_nesterov"))?
                    == Some(true)
                {
                    return Err(n.err("use_nesterov is not supported for Adam"));
                }
            }
            "ResourceSparseApplyAdagrad" | "SparseApplyAdagrad" => {
                a.insert("lr".into(), AttrValue::Float(self.folded_float(n, 2)?));
                // TensorFlow's (V1) update has no epsilon: var -= lr * g / sqrt(accum).
                a.insert("epsilon".into(), AttrValue::Float(0.0));
                let update_slots = get("update_slots")
                    .map(|v| v.get("b").map_or(Ok(true), |_| bool_attr(v)))
                    .transpose()
                    .map_err(wrap("update_slots"))?;
                if update_slots == Some(false) {
                    return Err(n.err(
                        "update_slots false is not supported (the accumulator \
                         always grows by g²)",
                    ));
                }
                // TensorFlow: (var, accum, lr, grad, indices); dflow: (var, accum, indices,
                // values), lr folded.
                if out.inputs.len() < 4 {
                    return Err(n.err("expected var, accum, lr, grad and indices inputs"));
                }
                out.inputs.swap(2, 3);
            }
            "ApplyMomentum" | "ResourceApplyMomentum" => {
                a.insert("lr".into(), AttrValue::Float(self.folded_float(n, 2)?));
                a.insert(
                    "momentum".into(),
                    AttrValue::Float(self.folded_float(n, 4)?),
                );
                if let Some(v) = get("use_nesterov") {
                    a.insert(
                        "use_nesterov".into(),
                        AttrValue::Bool(bool_attr(v).map_err(wrap("use_nesterov"))?),
                    );
                }
            }
            _ => {}
        }
        // TensorFlow's placer puts every op that reads or updates a variable through its handle
        // or reference (ReadVariableOp, the applies, the assigns) with the variable, ignoring
        // a different requested device; so does dflow.
        let takes_variable = matches!(n.op.as_str(), "ReadVariableOp" | "ResourceGather")
            || matches!(
                out.op.as_str(),
                "ApplyGradientDescent"
                    | "ApplyMomentum"
                    | "ApplyAdamWithPowers"
                    | "AssignAdd"
                    | "AssignSub"
                    | "Assign"
                    | "ScatterAdd"
                    | "SparseApplyAdagrad"
            );
        if takes_variable {
            if let Some(var) = n
                .inputs
                .first()
                .map(|r| &self.nodes[self.producer(r)])
                .filter(|v| is_variable_op(&v.op))
            {
                if out.device != var.device {
                    out.device.clear();
                }
                if !out.colocate_with.contains(&var.name) {
                    out.colocate_with.push(var.name.clone());
                }
            }
        }
        Ok(out)
    }
}

/// What a variable's initializer assigns, as far as dflow can carry it over.
#[derive(Debug, Clone, PartialEq)]
enum InitValue {
    /// One of dflow's named initializers (`zeros`, `glorot_uniform`, ...).
    Named(&'static str),
    /// One value repeated (`constant` with `init_value`).
    Constant(f64),
    /// A constant tensor of differing values, carried over exactly (`initial_value`).
    Tensor(std::sync::Arc<Tensor>),
    /// TensorFlow's random draw × `scale` + `offset` (a `tf_*` initializer).
    TfRandom {
        init: &'static str,
        seed: i64,
        seed2: i64,
        scale: f64,
        offset: f64,
    },
    /// An initializer subgraph the importer does not recognise.
    Unknown,
}

/// The one value a TensorProto's typed list repeats to its whole shape (an empty list: 0),
/// found without expanding it; `None` when the values are written in `tensorContent`, differ,
/// or are of another kind.
fn uniform_value(t: &Value) -> Option<f64> {
    if field(t, "tensorContent", "tensor_content").is_some() {
        return None;
    }
    let lists = [
        ("floatVal", "float_val"),
        ("doubleVal", "double_val"),
        ("intVal", "int_val"),
        ("int64Val", "int64_val"),
    ];
    let mut values = Vec::new();
    for (camel, snake) in lists {
        match field(t, camel, snake) {
            None => {}
            Some(Value::Array(a)) => {
                for v in a {
                    values.push(float_value(v).ok()?);
                }
            }
            Some(_) => return None,
        }
    }
    if ["halfVal", "half_val", "boolVal", "bool_val"]
        .iter()
        .any(|k| t.get(*k).is_some())
    {
        return None;
    }
    let first = values.first().copied().unwrap_or(0.0);
    values
        .iter()
        .all(|v| v.to_bits() == first.to_bits())
        .then_some(first)
}

/// The most elements a `Range` computed at import may have.
const MAX_CONSTANT_RANGE: i64 = 1 << 16;

/// TensorFlow's `Range(start, limit, delta)` for ints: `start, start + delta, ...` up to
/// (excluding) `limit`; `None` for a zero delta, an empty-direction mismatch TensorFlow rejects,
/// or more than [`MAX_CONSTANT_RANGE`] elements (left to the unsupported-op report).
fn constant_range(dtype: DType, start: i64, limit: i64, delta: i64) -> Option<Tensor> {
    if delta == 0 || (delta > 0 && start > limit) || (delta < 0 && start < limit) {
        return None;
    }
    let span = limit.checked_sub(start)?;
    let n = (span.checked_add(delta.checked_sub(delta.signum())?)?).checked_div(delta)?;
    if !(0..=MAX_CONSTANT_RANGE).contains(&n) {
        return None;
    }
    let values: Vec<i64> = (0..n).map(|i| start + i * delta).collect();
    let len = values.len();
    match dtype {
        DType::I32 => {
            let v: Option<Vec<i32>> = values.iter().map(|&x| i32::try_from(x).ok()).collect();
            Tensor::from_slice(&[len], &v?).ok()
        }
        _ => Tensor::from_slice(&[len], &values).ok(),
    }
}

/// 32-bit FNV-1a of a name (seeds for unseeded TensorFlow random initializers).
fn fnv1a32(s: &str) -> u32 {
    s.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// TensorFlow's Glorot-uniform limit √(6 / (fan_in + fan_out)) for a variable's shape.
fn glorot_limit(var: &RawNode<'_>) -> Option<f64> {
    let shape = shape_attr(var.attrs.get("shape")?).ok()?;
    let dims: Vec<f64> = shape.as_static()?.into_iter().map(|d| d as f64).collect();
    let (fan_in, fan_out) = match dims.as_slice() {
        [] => (1.0, 1.0),
        [n] => (*n, *n),
        [a, b] => (*a, *b),
        [rest @ .., a, b] => {
            let field: f64 = rest.iter().product();
            (a * field, b * field)
        }
    };
    (fan_in + fan_out > 0.0).then(|| (6.0 / (fan_in + fan_out)).sqrt())
}

// ---------------------------------------------------------------------------------------------
// Protobuf-JSON attribute values
// ---------------------------------------------------------------------------------------------

/// A field by its protobuf-JSON (lowerCamelCase) name or its original snake_case name.
fn field<'v>(obj: &'v Value, camel: &str, snake: &str) -> Option<&'v Value> {
    obj.get(camel).or_else(|| obj.get(snake))
}

fn int_value(v: &Value) -> Result<i64, String> {
    match v {
        Value::Number(n) => n
            .as_i64()
            .ok_or_else(|| format!("expected an integer, found {n}")),
        Value::String(s) => s
            .parse()
            .map_err(|_| format!("expected an integer, found {s:?}")),
        other => Err(format!("expected an integer, found {}", kind(other))),
    }
}

fn float_value(v: &Value) -> Result<f64, String> {
    match v {
        Value::Number(n) => n
            .as_f64()
            .ok_or_else(|| format!("expected a number, found {n}")),
        Value::String(s) => match s.as_str() {
            "NaN" => Ok(f64::NAN),
            "Infinity" => Ok(f64::INFINITY),
            "-Infinity" => Ok(f64::NEG_INFINITY),
            _ => s
                .parse()
                .map_err(|_| format!("expected a number, found {s:?}")),
        },
        other => Err(format!("expected a number, found {}", kind(other))),
    }
}

fn bytes_value(v: &Value) -> Result<Vec<u8>, String> {
    let s = v
        .as_str()
        .ok_or_else(|| format!("expected base64 bytes, found {}", kind(v)))?;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| format!("invalid base64: {e}"))
}

fn utf8(bytes: Vec<u8>) -> Result<String, String> {
    String::from_utf8(bytes).map_err(|_| "string is not UTF-8".to_string())
}

fn bool_attr(v: &Value) -> Result<bool, String> {
    match v.get("b") {
        None => Ok(false), // proto3 JSON may omit a false value
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(format!("expected a bool `b`, found {}", kind(other))),
    }
}

fn string_attr(v: &Value) -> Result<String, String> {
    match v.get("s") {
        None => Ok(String::new()),
        Some(s) => utf8(bytes_value(s)?),
    }
}

fn string_list_attr(v: &Value) -> Result<Vec<String>, String> {
    match v.get("list").and_then(|l| l.get("s")) {
        None => Ok(vec![]),
        Some(Value::Array(items)) => items.iter().map(|s| utf8(bytes_value(s)?)).collect(),
        Some(other) => Err(format!("expected a list of strings, found {}", kind(other))),
    }
}

fn dtype_name(v: &Value) -> Result<DType, String> {
    let s = v
        .as_str()
        .ok_or_else(|| format!("expected a dtype name, found {}", kind(v)))?;
    s.parse().map_err(|_| {
        format!("dtype {s} is not supported (dflow has f32, f64, i32, i64, bool, bf16, f16)")
    })
}

fn dtype_attr(v: &Value) -> Result<DType, String> {
    dtype_name(v.get("type").ok_or("missing `type`")?)
}

fn shape_attr(v: &Value) -> Result<Shape, String> {
    shape_proto(v.get("shape").ok_or("missing `shape`")?)
}

/// A TensorShapeProto: `{"dim": [{"size": "64"}, {"size": "-1"}, {}]}`, `{"unknownRank": true}`
/// or `{}` (a scalar).
fn shape_proto(v: &Value) -> Result<Shape, String> {
    if !v.is_object() {
        return Err(format!("expected a shape object, found {}", kind(v)));
    }
    if field(v, "unknownRank", "unknown_rank").and_then(Value::as_bool) == Some(true) {
        return Ok(Shape::unknown());
    }
    let dims = match v.get("dim") {
        None => vec![],
        Some(Value::Array(dims)) => dims
            .iter()
            .map(|d| d.get("size").map_or(Ok(0), int_value))
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => return Err(format!("`dim` must be a list, found {}", kind(other))),
    };
    if let Some(bad) = dims.iter().find(|&&d| d < -1) {
        return Err(format!("dimension {bad} is negative"));
    }
    Shape::from_signed(&dims)
}

fn tensor_attr(v: &Value, budget: &Cell<usize>) -> Result<Tensor, String> {
    tensor_proto(v.get("tensor").ok_or("missing `tensor`")?, budget)
}

/// A fresh expansion budget for reading one constant on the side (initializer classification,
/// folded operands): each such read is dropped right after, so it gets the full budget.
fn side_budget() -> Cell<usize> {
    Cell::new(MAX_EXPANDED_CONST_BYTES)
}

/// A TensorProto: dtype, shape, and the values in `tensorContent` or a typed list. A list shorter
/// than the tensor is expanded only within `budget` (bytes, decremented).
fn tensor_proto(v: &Value, budget: &Cell<usize>) -> Result<Tensor, String> {
    let dtype = dtype_name(v.get("dtype").ok_or("tensor has no `dtype`")?)?;
    let shape = match field(v, "tensorShape", "tensor_shape") {
        None => Shape::scalar(),
        Some(s) => shape_proto(s)?,
    };
    let dims = shape
        .as_static()
        .ok_or_else(|| format!("constant tensor shape {shape} must be fully known"))?;
    let n = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .filter(|&n| {
            n.checked_mul(dtype.size_of())
                .is_some_and(|b| b <= MAX_TENSOR_BYTES)
        })
        .ok_or_else(|| format!("constant tensor of shape {shape} is too large"))?;
    if let Some(content) = field(v, "tensorContent", "tensor_content") {
        let bytes = bytes_value(content)?;
        if bytes.len() != n * dtype.size_of() {
            return Err(format!(
                "tensorContent has {} bytes, but {dtype}{shape} needs {}",
                bytes.len(),
                n * dtype.size_of()
            ));
        }
        return from_le_bytes(dtype, &dims, &bytes);
    }
    let list = |camel: &str, snake: &str| -> Result<&[Value], String> {
        match field(v, camel, snake) {
            None => Ok(&[]),
            Some(Value::Array(a)) => Ok(a),
            Some(other) => Err(format!("`{camel}` must be a list, found {}", kind(other))),
        }
    };
    let t = match dtype {
        DType::F32 => {
            let vals = parse_all(list("floatVal", "float_val")?, |x| {
                float_value(x).map(|f| f as f32)
            })?;
            Tensor::from_slice(&dims, &fill(vals, n, dtype, &shape, budget)?)
        }
        DType::F64 => {
            let vals = parse_all(list("doubleVal", "double_val")?, float_value)?;
            Tensor::from_slice(&dims, &fill(vals, n, dtype, &shape, budget)?)
        }
        DType::I32 => {
            let vals = parse_all(list("intVal", "int_val")?, |x| {
                i32::try_from(int_value(x)?).map_err(|_| "int32 value out of range".to_string())
            })?;
            Tensor::from_slice(&dims, &fill(vals, n, dtype, &shape, budget)?)
        }
        DType::I64 => {
            let vals = parse_all(list("int64Val", "int64_val")?, int_value)?;
            Tensor::from_slice(&dims, &fill(vals, n, dtype, &shape, budget)?)
        }
        DType::Bool => {
            let vals = parse_all(list("boolVal", "bool_val")?, |x| {
                x.as_bool()
                    .map(u8::from)
                    .ok_or_else(|| format!("expected a bool, found {}", kind(x)))
            })?;
            Tensor::from_slice(&dims, &fill(vals, n, dtype, &shape, budget)?)
        }
        DType::F16 | DType::BF16 => {
            let bits = parse_all(list("halfVal", "half_val")?, |x| {
                u16::try_from(int_value(x)?).map_err(|_| "halfVal entry out of range".to_string())
            })?;
            let bits = fill(bits, n, dtype, &shape, budget)?;
            if dtype == DType::F16 {
                let v: Vec<half::f16> = bits.into_iter().map(half::f16::from_bits).collect();
                Tensor::from_slice(&dims, &v)
            } else {
                let v: Vec<half::bf16> = bits.into_iter().map(half::bf16::from_bits).collect();
                Tensor::from_slice(&dims, &v)
            }
        }
    };
    t.map_err(|e| e.to_string())
}

fn parse_all<T>(vals: &[Value], f: impl Fn(&Value) -> Result<T, String>) -> Result<Vec<T>, String> {
    vals.iter().map(f).collect()
}

/// TensorFlow's rule for typed value lists: an empty list means all zeros, a shorter list is
/// padded with its last value (a single value broadcasts). Padding is charged against `budget`
/// before anything is allocated.
fn fill<T: Copy + Default>(
    mut vals: Vec<T>,
    n: usize,
    dtype: DType,
    shape: &Shape,
    budget: &Cell<usize>,
) -> Result<Vec<T>, String> {
    if vals.len() > n {
        return Err(format!(
            "{} values given for a tensor of {n} elements",
            vals.len()
        ));
    }
    if vals.len() < n {
        // `n * size_of` was checked against MAX_TENSOR_BYTES by the caller.
        let bytes = n.saturating_mul(dtype.size_of());
        if bytes > budget.get() {
            return Err(format!(
                "{dtype}{shape} is written as {} value(s) repeated to {n} elements ({}); \
                 expanding it would pass the importer's limit of {} for repeated-value \
                 constants in one GraphDef (dflow_graph::tf_import::MAX_EXPANDED_CONST_BYTES). \
                 Write the values in full (`tensorContent`) or build the tensor at run time \
                 (e.g. `tf.fill`)",
                vals.len(),
                human_bytes(bytes),
                human_bytes(MAX_EXPANDED_CONST_BYTES),
            ));
        }
        budget.set(budget.get() - bytes);
    }
    let last = vals.last().copied().unwrap_or_default();
    vals.resize(n, last);
    Ok(vals)
}

/// `1.0 GiB`, `64 MiB`, `12 B`: a byte count for messages.
fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if v.fract() == 0.0 {
        format!("{v} {}", UNITS[unit])
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn from_le_bytes(dtype: DType, dims: &[usize], bytes: &[u8]) -> Result<Tensor, String> {
    fn chunks<const N: usize, T>(bytes: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
        bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect()
    }
    let t = match dtype {
        DType::F32 => Tensor::from_slice(dims, &chunks(bytes, f32::from_le_bytes)),
        DType::F64 => Tensor::from_slice(dims, &chunks(bytes, f64::from_le_bytes)),
        DType::I32 => Tensor::from_slice(dims, &chunks(bytes, i32::from_le_bytes)),
        DType::I64 => Tensor::from_slice(dims, &chunks(bytes, i64::from_le_bytes)),
        DType::Bool => {
            if let Some(b) = bytes.iter().find(|&&b| b > 1) {
                return Err(format!("bool tensorContent holds byte {b}, not 0 or 1"));
            }
            Tensor::from_slice(dims, bytes)
        }
        DType::F16 => Tensor::from_slice(
            dims,
            &chunks(bytes, |b| half::f16::from_bits(u16::from_le_bytes(b))),
        ),
        DType::BF16 => Tensor::from_slice(
            dims,
            &chunks(bytes, |b| half::bf16::from_bits(u16::from_le_bytes(b))),
        ),
    };
    t.map_err(|e| e.to_string())
}

/// Initializer kinds the importer can record (besides an exact `initial_value`), for
/// documentation and tests.
pub const INITIALIZER_KINDS: [&str; 7] = [
    "zeros",
    "ones",
    "constant",
    "glorot_uniform",
    "tf_random_normal",
    "tf_random_uniform",
    "tf_truncated_normal",
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Graph;
    use serde_json::json;

    const PS_MLP: &str = include_str!("../../../tests/fixtures/tf/ps_mlp.graphdef.json");
    const PS_MLP_2PS: &str = include_str!("../../../tests/fixtures/tf/ps_mlp_2ps.graphdef.json");

    fn node<'d>(def: &'d GraphDef, name: &str) -> &'d NodeDef {
        def.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    fn import(v: Value) -> Result<GraphDef, TfImportError> {
        import_graphdef_json(&v.to_string())
    }

    fn f32_type() -> Value {
        json!({"type": "DT_FLOAT"})
    }

    fn placeholder(name: &str, dims: &[i64]) -> Value {
        let dims: Vec<Value> = dims
            .iter()
            .map(|d| json!({"size": d.to_string()}))
            .collect();
        json!({"name": name, "op": "Placeholder",
               "attr": {"dtype": f32_type(), "shape": {"shape": {"dim": dims}}}})
    }

    fn int_const(name: &str, vals: &[i32]) -> Value {
        json!({"name": name, "op": "Const", "attr": {
            "dtype": {"type": "DT_INT32"},
            "value": {"tensor": {"dtype": "DT_INT32",
                                 "tensorShape": {"dim": [{"size": vals.len().to_string()}]},
                                 "intVal": vals}}}})
    }

    fn const_tensor(tensor: Value) -> Result<Tensor, TfImportError> {
        let def = import(json!({"node": [
            {"name": "c", "op": "Const", "attr": {"value": {"tensor": tensor}}}
        ]}))?;
        match node(&def, "c").attrs.get("value") {
            Some(AttrValue::Tensor(t)) => Ok((**t).clone()),
            other => panic!("value is {other:?}"),
        }
    }

    #[test]
    fn fixture_imports_and_validates() {
        let def = import_graphdef_json(PS_MLP).unwrap();
        let g = Graph::from_def(&def).unwrap();
        let mut names: Vec<_> = def.nodes.iter().map(|n| n.name.as_str()).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "MatMul",
                "b1",
                "b1/read",
                "b2",
                "b2/read",
                "h",
                "h_pre",
                "init",
                "logits",
                "logits_mm",
                "prediction",
                "softmax",
                "w1",
                "w1/read",
                "w2",
                "w2/read",
                "x"
            ]
        );
        let out = |n: &str| g.node(g.find(n).unwrap()).outputs[0].to_string();
        assert_eq!(out("softmax"), "f32[?, 10]");
        assert_eq!(out("prediction"), "i64[?]");
        assert_eq!(out("w1/read"), "f32[64, 32]");

        let w1 = node(&def, "w1");
        assert_eq!(w1.op, "Variable");
        assert_eq!(w1.device, "/job:ps/task:0");
        assert_eq!(w1.attrs["shape"], AttrValue::Shape(Shape::known(&[64, 32])));
        let init = |n: &str| node(&def, n).attrs["initializer"].clone();
        // Seeded random initializers: TensorFlow's draws, reproduced (RandomUniform × (max -
        // min) + min; TruncatedNormal × stddev + mean).
        assert_eq!(init("w1"), AttrValue::from("tf_random_uniform"));
        assert_eq!(w1.attrs["seed"], AttrValue::Int(7));
        assert_eq!(w1.attrs["seed2"], AttrValue::Int(1));
        let limit = (6.0f64 / (64.0 + 32.0)).sqrt();
        match (&w1.attrs["init_scale"], &w1.attrs["init_value"]) {
            (AttrValue::Float(s), AttrValue::Float(o)) => {
                assert!(
                    (s - 2.0 * limit).abs() < 1e-6 && (o + limit).abs() < 1e-6,
                    "{s} {o}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(init("b1"), AttrValue::from("zeros"));
        assert_eq!(init("w2"), AttrValue::from("tf_truncated_normal"));
        // constant(0.1): one repeated value (once silently zeros).
        assert_eq!(init("b2"), AttrValue::from("constant"));
        match node(&def, "b2").attrs["init_value"] {
            AttrValue::Float(v) => assert!((v - 0.1).abs() < 1e-7, "{v}"),
            ref other => panic!("init_value is {other:?}"),
        }

        let read = node(&def, "w1/read");
        assert_eq!(
            (read.op.as_str(), read.device.as_str()),
            ("Identity", "/job:ps/task:0")
        );
        assert_eq!(read.colocate_with, ["w1"]);
        assert!(w1.colocate_with.is_empty(), "self-colocation is dropped");

        let pred = node(&def, "prediction");
        assert_eq!(pred.inputs, ["logits"]);
        assert_eq!(pred.attrs["axis"], AttrValue::Int(1));
        assert_eq!(pred.attrs["output_type"], AttrValue::DType(DType::I64));
        assert_eq!(node(&def, "logits").op, "Add");
        assert_eq!(
            node(&def, "MatMul").attrs["transpose_b"],
            AttrValue::Bool(false)
        );
        assert_eq!(
            node(&def, "x").attrs["shape"],
            AttrValue::Shape(Shape::partial(vec![None, Some(64)]))
        );
    }

    #[test]
    fn two_ps_fixture_keeps_round_robin_devices() {
        let def = import_graphdef_json(PS_MLP_2PS).unwrap();
        Graph::from_def(&def).unwrap();
        let dev = |n: &str| node(&def, n).device.clone();
        assert_eq!(dev("w1"), "/job:ps/task:0");
        assert_eq!(dev("b1"), "/job:ps/task:1");
        assert_eq!(dev("w2"), "/job:ps/task:0");
        assert_eq!(dev("b2/read"), "/job:ps/task:1");
        assert_eq!(dev("softmax"), "/job:worker/task:0");
    }

    #[test]
    fn detects_graphdefs() {
        assert!(looks_like_tf_graphdef(PS_MLP));
        assert!(looks_like_tf_graphdef(r#"{"node": []}"#));
        assert!(!looks_like_tf_graphdef(r#"{"version": 1, "nodes": []}"#));
        assert!(!looks_like_tf_graphdef(r#"{"node": [{"name": "x"}]}"#));
        assert!(!looks_like_tf_graphdef("x = Placeholder()"));
        assert!(!looks_like_tf_graphdef("[1, 2]"));
    }

    #[test]
    fn tensor_content_is_base64_little_endian() {
        let vals = [1.0f32, -2.5, 3.0, 4.0];
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = const_tensor(json!({
            "dtype": "DT_FLOAT",
            "tensorShape": {"dim": [{"size": "2"}, {"size": "2"}]},
            "tensorContent": base64::engine::general_purpose::STANDARD.encode(bytes)
        }))
        .unwrap();
        assert_eq!(t.dims(), [2, 2]);
        assert_eq!(t.as_slice::<f32>().unwrap(), vals);

        let bytes: Vec<u8> = [7i64, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = const_tensor(json!({
            "dtype": "DT_INT64", "tensor_shape": {"dim": [{"size": 2}]},
            "tensor_content": base64::engine::general_purpose::STANDARD.encode(bytes)
        }))
        .unwrap();
        assert_eq!(t.as_slice::<i64>().unwrap(), [7, -1]);
    }

    #[test]
    fn value_lists_broadcast_their_last_value() {
        let t = const_tensor(json!({"dtype": "DT_FLOAT",
            "tensorShape": {"dim": [{"size": "2"}, {"size": "3"}]}, "floatVal": [0.5]}))
        .unwrap();
        assert_eq!(t.as_slice::<f32>().unwrap(), [0.5; 6]);
        let t = const_tensor(json!({"dtype": "DT_INT32",
            "tensorShape": {"dim": [{"size": "4"}]}, "intVal": [1, 2]}))
        .unwrap();
        assert_eq!(t.as_slice::<i32>().unwrap(), [1, 2, 2, 2]);
        let t =
            const_tensor(json!({"dtype": "DT_INT64", "int64Val": ["-9007199254740993"]})).unwrap();
        assert_eq!(t.as_slice::<i64>().unwrap(), [-9_007_199_254_740_993]);
        let t = const_tensor(json!({"dtype": "DT_DOUBLE",
            "tensorShape": {"dim": [{"size": "3"}]}, "doubleVal": ["NaN", "-Infinity", 2]}))
        .unwrap();
        let v = t.as_slice::<f64>().unwrap();
        assert!(v[0].is_nan() && v[1] == f64::NEG_INFINITY && v[2] == 2.0);
        // No values at all: zeros. A dimension written as `{}` has size 0.
        let t = const_tensor(json!({"dtype": "DT_BOOL", "tensorShape": {"dim": [{"size": "3"}]}}))
            .unwrap();
        assert_eq!(t.as_slice::<u8>().unwrap(), [0, 0, 0]);
        let t = const_tensor(json!({"dtype": "DT_FLOAT", "tensorShape": {"dim": [{}]}})).unwrap();
        assert_eq!(t.dims(), [0]);
        let t = const_tensor(json!({"dtype": "DT_HALF", "halfVal": [15360]})).unwrap();
        assert_eq!(t.as_slice::<half::f16>().unwrap(), [half::f16::ONE]);
    }

    #[test]
    fn repeated_value_expansion_is_budgeted_over_the_whole_graphdef() {
        let big = |name: &str| {
            // 40 MiB of f32 from one value: the first fits the 64 MiB budget, the second not.
            json!({"name": name, "op": "Const", "attr": {"value": {"tensor": {
                "dtype": "DT_FLOAT", "tensorShape": {"dim": [{"size": "10485760"}]},
                "floatVal": [2.0]}}}})
        };
        let one = import(json!({"node": [big("a")]})).unwrap();
        assert_eq!(one.nodes.len(), 1);
        let e = import(json!({"node": [big("a"), big("b")]}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`b`") && e.contains("40 MiB") && e.contains("limit of 64 MiB"),
            "{e}"
        );
        // Values written in full are not charged.
        let full = json!({"name": "f", "op": "Const", "attr": {"value": {"tensor": {
            "dtype": "DT_FLOAT", "tensorShape": {"dim": [{"size": "2"}]}, "floatVal": [1.0, 2.0]}}}});
        assert!(import(json!({"node": [big("a"), full]})).is_ok());
        assert_eq!(human_bytes(1 << 30), "1 GiB");
        assert_eq!(human_bytes(1_073_741_820), "1024.0 MiB");
    }

    #[test]
    fn bad_tensors_are_clean_errors() {
        let cases = [
            (
                json!({"dtype": "DT_FLOAT", "tensorShape": {"dim": [{"size": "2"}]},
                    "tensorContent": "AAAA"}),
                "tensorContent has 3 bytes",
            ),
            (
                json!({"dtype": "DT_FLOAT", "tensorContent": "!!"}),
                "invalid base64",
            ),
            (
                json!({"dtype": "DT_STRING", "stringVal": ["YQ=="]}),
                "DT_STRING is not supported",
            ),
            (json!({"tensorShape": {}}), "no `dtype`"),
            (
                json!({"dtype": "DT_FLOAT", "tensorShape": {"dim": [{"size": "1000000"},
                    {"size": "1000000"}]}, "floatVal": [1]}),
                "too large",
            ),
            (
                json!({"dtype": "DT_FLOAT", "tensorShape": {"dim": [{"size": "-1"}]}}),
                "must be fully known",
            ),
            (
                json!({"dtype": "DT_INT32", "intVal": [1, 2]}),
                "2 values given for a tensor of 1",
            ),
            (
                json!({"dtype": "DT_INT32", "intVal": ["x"]}),
                "expected an integer",
            ),
            (
                json!({"dtype": "DT_INT32", "intVal": [3000000000u64]}),
                "out of range",
            ),
        ];
        for (tensor, want) in cases {
            let e = const_tensor(tensor.clone()).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("`c`"), "{tensor}: {e}");
        }
    }

    #[test]
    fn shapes_with_unknown_dims_and_rank() {
        let def = import(json!({"node": [
            placeholder("a", &[-1, 3]),
            {"name": "b", "op": "Placeholder", "attr": {"dtype": f32_type(),
                "shape": {"shape": {"unknownRank": true}}}},
            {"name": "c", "op": "Placeholder", "attr": {"dtype": f32_type(),
                "shape": {"shape": {}}}},
            {"name": "d", "op": "Placeholder", "attr": {"dtype": f32_type()}}
        ]}))
        .unwrap();
        let shape = |n: &str| node(&def, n).attrs.get("shape").cloned();
        assert_eq!(
            shape("a"),
            Some(AttrValue::Shape(Shape::partial(vec![None, Some(3)])))
        );
        assert_eq!(shape("b"), Some(AttrValue::Shape(Shape::unknown())));
        assert_eq!(shape("c"), Some(AttrValue::Shape(Shape::scalar())));
        assert_eq!(shape("d"), None, "dflow's default (unknown) applies");
        Graph::from_def(&def).unwrap();
        let e = import(json!({"node": [placeholder("a", &[-2])]})).unwrap_err();
        assert!(e.to_string().contains("dimension -2 is negative"), "{e}");
    }

    #[test]
    fn constant_operands_fold_into_attrs() {
        let def = import(json!({"node": [
            placeholder("x", &[-1, 4, 6]),
            int_const("axes", &[1, -1]),
            {"name": "s", "op": "Sum", "input": ["x", "axes"],
             "attr": {"keep_dims": {"b": true}, "Tidx": {"type": "DT_INT32"}}},
            {"name": "m", "op": "Mean", "input": ["x", "axes"], "attr": {}},
            {"name": "shape", "op": "Const", "attr": {"value": {"tensor": {"dtype": "DT_INT64",
                "tensorShape": {"dim": [{"size": "2"}]}, "int64Val": ["-1", "24"]}}}},
            {"name": "r", "op": "Reshape", "input": ["x", "shape"]},
            int_const("none", &[]),
            {"name": "keep", "op": "Max", "input": ["x", "none"]},
            int_const("shared", &[0]),
            {"name": "am", "op": "ArgMax", "input": ["r", "shared"],
             "attr": {"output_type": {"type": "DT_INT32"}}},
            {"name": "use_shared", "op": "Cast", "input": ["shared"],
             "attr": {"DstT": f32_type(), "SrcT": {"type": "DT_INT32"}}}
        ]}))
        .unwrap();
        let s = node(&def, "s");
        assert_eq!(s.inputs, ["x"]);
        assert_eq!(s.attrs["axes"], AttrValue::IntList(vec![1, -1]));
        assert_eq!(s.attrs["keep_dims"], AttrValue::Bool(true));
        assert_eq!(
            node(&def, "r").attrs["shape"],
            AttrValue::IntList(vec![-1, 24])
        );
        assert_eq!(node(&def, "keep").op, "Identity");
        assert_eq!(node(&def, "am").attrs["axis"], AttrValue::Int(0));
        assert!(def
            .nodes
            .iter()
            .all(|n| !["axes", "shape", "none"].contains(&n.name.as_str())));
        assert_eq!(node(&def, "shared").op, "Const", "still read by use_shared");
        let g = Graph::from_def(&def).unwrap();
        let out = |n: &str| g.node(g.find(n).unwrap()).outputs[0].to_string();
        assert_eq!(out("s"), "f32[?, 1, 1]");
        assert_eq!(out("r"), "f32[?, 24]");
        assert_eq!(out("am"), "i32[24]");
    }

    #[test]
    fn non_constant_operands_are_rejected() {
        let e = import(json!({"node": [
            placeholder("x", &[2, 3]),
            {"name": "axis", "op": "Placeholder", "attr": {"dtype": {"type": "DT_INT32"}}},
            {"name": "am", "op": "ArgMax", "input": ["x", "axis"]}
        ]}))
        .unwrap_err();
        assert!(
            matches!(&e, TfImportError::Node { node, .. } if node == "am")
                && e.to_string()
                    .contains("operand `axis` (a `Placeholder`) must be a Const"),
            "{e}"
        );
        let e = import(json!({"node": [placeholder("x", &[2]), {"name": "am", "op": "ArgMax", "input": ["x"]}]}))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("expected a constant operand at input 1"),
            "{e}"
        );
    }

    #[test]
    fn unsupported_ops_are_listed_together() {
        let e = import(json!({"node": [
            placeholder("x", &[2]),
            {"name": "a", "op": "Conv2D", "input": ["x", "x"]},
            {"name": "b", "op": "MaxPool", "input": ["x"]},
            {"name": "c", "op": "Conv2D", "input": ["x", "x"]}
        ]}))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "unsupported TensorFlow ops: Conv2D (a, c), MaxPool (b)"
        );
        let e = import(json!({"node": [
            placeholder("x", &[2]),
            {"name": "a", "op": "Conv2D", "input": ["x", "x"]}
        ]}))
        .unwrap_err();
        assert_eq!(e.to_string(), "unsupported TensorFlow ops: Conv2D (a)");
    }

    /// The gradient of a broadcasting `Add` as tf.gradients writes it when the batch size is
    /// not fixed: `Shape` of each operand, `BroadcastGradientArgs`, then `Sum` over the
    /// run-time axes and `Reshape` to the run-time shape. Imported as run-time ops, it gives the
    /// reduced gradient for any fed batch size.
    #[test]
    fn a_broadcast_gradient_with_run_time_shapes_runs_like_tensorflow() {
        use crate::ops::testing::run_kernel;
        let def = import(json!({"node": [
            placeholder("x", &[-1, 3]),
            placeholder("g", &[-1, 3]),
            {"name": "b", "op": "Const", "attr": {"value": {"tensor": {"dtype": "DT_FLOAT",
                "tensorShape": {"dim": [{"size": "3"}]}, "floatVal": [0.5]}}}},
            {"name": "grad/Shape", "op": "Shape", "input": ["x"]},
            {"name": "grad/Shape_1", "op": "Shape", "input": ["b"]},
            {"name": "grad/BroadcastGradientArgs", "op": "BroadcastGradientArgs",
             "input": ["grad/Shape", "grad/Shape_1"]},
            {"name": "grad/Sum_1", "op": "Sum", "input": ["g", "grad/BroadcastGradientArgs:1"],
             "attr": {"keep_dims": {"b": false}}},
            {"name": "grad/Reshape_1", "op": "Reshape", "input": ["grad/Sum_1", "grad/Shape_1"]}
        ]}))
        .unwrap();
        let ops: Vec<_> = def.nodes.iter().map(|n| n.op.as_str()).collect();
        assert_eq!(
            ops,
            [
                "Placeholder",
                "Placeholder",
                "Const",
                "Shape",
                "Shape",
                "BroadcastGradientArgs",
                "DynamicSum",
                "ReshapeLike"
            ]
        );
        assert_eq!(
            node(&def, "grad/Sum_1").inputs,
            ["g", "grad/BroadcastGradientArgs:1"]
        );
        let g = Graph::from_def(&def).unwrap();
        let out = |n: &str| g.node(g.find(n).unwrap()).outputs[0].to_string();
        // Reshape(t, Shape(b)) is ReshapeLike(t, b): b's static shape is kept.
        assert_eq!(node(&def, "grad/Reshape_1").inputs, ["grad/Sum_1", "b"]);
        assert_eq!(out("grad/Reshape_1"), "f32[3]");
        // The chain's kernels, on a batch of 2: the gradient of b sums over the batch.
        let shape = |dims: &[i32]| Tensor::from_slice(&[dims.len()], dims).unwrap();
        let r = run_kernel("BroadcastGradientArgs", &[], &[shape(&[2, 3]), shape(&[3])]).unwrap();
        let gv = Tensor::from_slice(&[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let s = run_kernel("DynamicSum", &[], &[gv, r[1].clone()])
            .unwrap()
            .remove(0);
        let db = run_kernel("DynamicReshape", &[], &[s, shape(&[3])])
            .unwrap()
            .remove(0);
        assert_eq!(db.as_slice::<f32>().unwrap(), [5.0, 7.0, 9.0]);
    }

    /// A `Range` of constant scalars (TensorFlow 2's `range(rank)` in reduction gradients) is
    /// computed at import: a `Const`, foldable into a `Prod`'s axes.
    #[test]
    fn constant_ranges_are_computed_at_import() {
        let scalar = |name: &str, v: i32| {
            json!({"name": name, "op": "Const", "attr": {"value": {"tensor": {"dtype": "DT_INT32",
                "tensorShape": {}, "intVal": [v]}}}})
        };
        let def = import(json!({"node": [
            placeholder("x", &[-1, 3]),
            scalar("start", 0), scalar("limit", 2), scalar("delta", 1),
            {"name": "range", "op": "Range", "input": ["start", "limit", "delta"]},
            {"name": "p", "op": "Prod", "input": ["x", "range"]},
            scalar("down", -2),
            {"name": "back", "op": "Range", "input": ["limit", "start", "down"]},
            {"name": "use_back", "op": "Identity", "input": ["back"]}
        ]}))
        .unwrap();
        assert_eq!(
            node(&def, "p").attrs["axes"],
            AttrValue::IntList(vec![0, 1])
        );
        let back = node(&def, "back");
        assert_eq!((back.op.as_str(), back.inputs.len()), ("Const", 0));
        match &back.attrs["value"] {
            AttrValue::Tensor(t) => assert_eq!(t.as_slice::<i32>().unwrap(), [2]),
            other => panic!("{other:?}"),
        }
        assert!(def
            .nodes
            .iter()
            .all(|n| n.name != "range" && n.name != "delta"));
        Graph::from_def(&def).unwrap();
        assert_eq!(
            constant_range(DType::I64, 5, 0, -2).unwrap().to_f64_vec(),
            [5.0, 3.0, 1.0]
        );
        assert!(constant_range(DType::I64, 0, 5, 0).is_none());
        assert!(constant_range(DType::I64, 0, 1 << 40, 1).is_none());
        // A Range of run-time values stays a Range (embedding_lookup_sparse counts its unique
        // ids at run time), of unknown length.
        let def = import(json!({"node": [
            {"name": "n", "op": "Placeholder", "attr": {"dtype": {"type": "DT_INT32"},
             "shape": {"shape": {}}}},
            scalar("start", 0), scalar("delta", 1),
            {"name": "r", "op": "Range", "input": ["start", "n", "delta"]}
        ]}))
        .unwrap();
        assert_eq!(node(&def, "r").op, "Range");
        assert_eq!(node(&def, "r").inputs, ["start", "n", "delta"]);
        let g = Graph::from_def(&def).unwrap();
        assert_eq!(
            g.node(g.find("r").unwrap()).outputs[0].to_string(),
            "i32[?]"
        );
    }

    /// The ops of `embedding_lookup` over parts: DynamicPartition keeps `num_partitions`,
    /// ResourceGather becomes Gather with its variable, ParallelDynamicStitch DynamicStitch,
    /// StridedSlice folds begin/end/strides and keeps its masks, and a ConcatV2 of constant int
    /// vectors is computed (so a Reshape to it is static). What dflow cannot express is refused
    /// naming the node.
    #[test]
    fn embedding_lookup_ops_import() {
        let i64_const = |name: &str, vals: &[i64]| {
            json!({"name": name, "op": "Const", "attr": {"value": {"tensor": {
                "dtype": "DT_INT64", "tensorShape": {"dim": [{"size": vals.len().to_string()}]},
                "int64Val": vals.iter().map(|v| v.to_string()).collect::<Vec<_>>()}}}})
        };
        let graph = |gather_attrs: Value, slice_attrs: Value| {
            json!({"node": [
                variable("p", "VarHandleOp", &[4, 3]),
                {"name": "ids", "op": "Placeholder", "attr": {"dtype": {"type": "DT_INT64"},
                    "shape": {"shape": {"dim": [{"size": "6"}]}}}},
                {"name": "sp", "op": "Placeholder", "attr": {"dtype": {"type": "DT_INT64"},
                    "shape": {"shape": {"dim": [{"size": "6"}, {"size": "2"}]}}}},
                {"name": "shard", "op": "Placeholder", "attr": {"dtype": {"type": "DT_INT32"},
                    "shape": {"shape": {"dim": [{"size": "6"}]}}}},
                {"name": "part", "op": "DynamicPartition", "input": ["ids", "shard"],
                 "attr": {"num_partitions": {"i": "2"}}},
                {"name": "g", "op": "ResourceGather", "input": ["p", "part:1"],
                 "attr": gather_attrs},
                {"name": "stitch", "op": "ParallelDynamicStitch", "input": ["shard", "g"]},
                int_const("b", &[0, 0]), int_const("e", &[0, 1]), int_const("s", &[1, 1]),
                {"name": "col", "op": "StridedSlice", "input": ["sp", "b", "e", "s"],
                 "attr": slice_attrs},
                i64_const("shape_a", &[2, 3]), i64_const("shape_b", &[3]),
                int_const("axis", &[0]),
                {"name": "shape", "op": "ConcatV2", "input": ["shape_a", "shape_b", "axis"]},
                {"name": "r", "op": "Reshape", "input": ["g", "shape"]}
            ]})
        };
        let masks = json!({"begin_mask": {"i": "1"}, "end_mask": {"i": "1"},
                           "shrink_axis_mask": {"i": "2"}, "ellipsis_mask": {}});
        let def = import(graph(json!({"batch_dims": {}}), masks.clone())).unwrap();
        assert_eq!(
            node(&def, "part").attrs["num_partitions"],
            AttrValue::Int(2)
        );
        let g = node(&def, "g");
        assert_eq!(
            (g.op.as_str(), g.colocate_with.as_slice()),
            ("Gather", &["p".to_string()][..])
        );
        assert_eq!(node(&def, "stitch").op, "DynamicStitch");
        let col = node(&def, "col");
        assert_eq!(col.inputs, ["sp"]);
        assert_eq!(col.attrs["end"], AttrValue::IntList(vec![0, 1]));
        assert_eq!(col.attrs["shrink_axis_mask"], AttrValue::Int(2));
        assert!(!col.attrs.contains_key("ellipsis_mask"));
        assert_eq!(
            node(&def, "r").attrs["shape"],
            AttrValue::IntList(vec![2, 3, 3])
        );
        assert!(def
            .nodes
            .iter()
            .all(|n| n.name != "shape" && n.name != "shape_a"));
        let graph_ = Graph::from_def(&def).unwrap();
        let out = |n: &str| graph_.node(graph_.find(n).unwrap()).outputs[0].to_string();
        assert_eq!(out("part"), "i64[?]");
        assert_eq!(out("g"), "f32[?, 3]");
        assert_eq!(out("col"), "i64[6]");
        let e = import(graph(json!({"batch_dims": {"i": "1"}}), masks))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`g`") && e.contains("batch_dims 1"), "{e}");
        let e = import(graph(json!({}), json!({"ellipsis_mask": {"i": "1"}})))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`col`") && e.contains("ellipsis_mask 1"), "{e}");
    }

    /// TensorFlow's ResourceSparseApplyAdagrad (var, accum, lr, grad, indices) becomes dflow's
    /// SparseApplyAdagrad (var, accum, indices, values) with lr folded and no epsilon, placed
    /// with its variable; `update_slots: false` is refused naming the node.
    #[test]
    fn sparse_adagrad_reorders_its_inputs() {
        let graph = |update_slots: bool| {
            json!({"node": [
                variable("w", "VarHandleOp", &[4, 2]),
                variable("w/Adagrad", "VarHandleOp", &[4, 2]),
                f32_const("lr", &[], &[0.1]),
                f32_const("g", &[2, 2], &[1.0, 2.0, 3.0, 4.0]),
                int_const("idx", &[3, 0]),
                {"name": "update", "op": "ResourceSparseApplyAdagrad",
                 "input": ["w", "w/Adagrad", "lr", "g", "idx"],
                 "attr": {"update_slots": {"b": update_slots}}}
            ]})
        };
        let def = import(graph(true)).unwrap();
        let u = node(&def, "update");
        assert_eq!(u.op, "SparseApplyAdagrad");
        assert_eq!(u.inputs, ["w", "w/Adagrad", "idx", "g"]);
        assert!(matches!(u.attrs["lr"], AttrValue::Float(x) if (x - 0.1).abs() < 1e-7));
        assert_eq!(u.attrs["epsilon"], AttrValue::Float(0.0));
        assert_eq!(u.colocate_with, ["w"]);
        Graph::from_def(&def).unwrap();
        let e = import(graph(false)).unwrap_err().to_string();
        assert!(
            e.contains("`update`") && e.contains("update_slots false"),
            "{e}"
        );
    }

    /// An operand dflow needs as a constant (a reduction other than Sum, a Fill's dims), computed
    /// at run time: the node and its operand are named, with what to do.
    #[test]
    fn a_run_time_operand_where_a_constant_is_needed_is_refused_with_what_to_do() {
        let e = import(json!({"node": [
            placeholder("x", &[-1, 3]),
            {"name": "grad/Shape", "op": "Shape", "input": ["x"]},
            {"name": "grad/Mean", "op": "Mean", "input": ["x", "grad/Shape"]}
        ]}))
        .unwrap_err();
        assert!(
            matches!(&e, TfImportError::Node { node, .. } if node == "grad/Mean"),
            "{e}"
        );
        let e = e.to_string();
        assert!(
            e.contains("operand `grad/Shape` (a `Shape`) must be a Const")
                && e.contains("fully static shapes (a fixed batch size)"),
            "{e}"
        );
    }

    #[test]
    fn initializer_subgraph_is_dropped_with_its_unsupported_ops() {
        let def = import(json!({"node": [
            {"name": "v/Initializer/random_normal/shape", "op": "Const", "attr": {"value":
                {"tensor": {"dtype": "DT_INT32", "tensorShape": {"dim": [{"size": "1"}]}, "intVal": [3]}}}},
            {"name": "v/Initializer/random_normal/RandomStandardNormal", "op": "RandomStandardNormal",
             "input": ["v/Initializer/random_normal/shape"], "attr": {"dtype": f32_type()}},
            {"name": "v", "op": "VarHandleOp", "device": "/job:ps/task:0",
             "attr": {"dtype": f32_type(), "shape": {"shape": {"dim": [{"size": "3"}]}}}},
            {"name": "v/Assign", "op": "AssignVariableOp",
             "input": ["v", "v/Initializer/random_normal/RandomStandardNormal"]},
            {"name": "v/IsInitialized", "op": "VarIsInitializedOp", "input": ["v"]},
            {"name": "ones", "op": "Const", "attr": {"value": {"tensor": {"dtype": "DT_FLOAT",
                "tensorShape": {"dim": [{"size": "3"}]}, "floatVal": [1]}}}},
            {"name": "u", "op": "VariableV2", "attr": {"dtype": f32_type(),
                "shape": {"shape": {"dim": [{"size": "3"}]}}, "_class": {"list": {"s": ["bG9jOkB2"]}}}},
            {"name": "u/Assign", "op": "Assign", "input": ["u", "ones"]},
            {"name": "init", "op": "NoOp", "input": ["^v/Assign", "^u/Assign"]},
            {"name": "v/read", "op": "ReadVariableOp", "input": ["v"], "attr": {"dtype": f32_type()}},
            {"name": "y", "op": "AddV2", "input": ["v/read", "u", "^init"]}
        ]}))
        .unwrap();
        let names: Vec<_> = def.nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["v", "u", "init", "v/read", "y"]);
        assert!(
            node(&def, "init").inputs.is_empty(),
            "init keeps no dropped inputs"
        );
        assert_eq!(node(&def, "v/read").colocate_with, ["v"]);
        assert_eq!(
            node(&def, "v").attrs["initializer"],
            AttrValue::from("tf_random_normal")
        );
        assert_eq!(
            node(&def, "u").attrs["initializer"],
            AttrValue::from("ones")
        );
        assert_eq!(node(&def, "u").colocate_with, ["v"]);
        assert_eq!(node(&def, "y").inputs, ["v/read", "u", "^init"]);
        assert_eq!(node(&def, "v/read").op, "Identity");
        Graph::from_def(&def).unwrap();
    }

    fn f32_const(name: &str, dims: &[i64], vals: &[f32]) -> Value {
        let dims: Vec<Value> = dims
            .iter()
            .map(|d| json!({"size": d.to_string()}))
            .collect();
        json!({"name": name, "op": "Const", "attr": {"value": {"tensor": {"dtype": "DT_FLOAT",
            "tensorShape": {"dim": dims}, "floatVal": vals}}}})
    }

    fn variable(name: &str, op: &str, dims: &[i64]) -> Value {
        let dims: Vec<Value> = dims
            .iter()
            .map(|d| json!({"size": d.to_string()}))
            .collect();
        json!({"name": name, "op": op, "device": "/job:ps/task:0",
               "attr": {"dtype": f32_type(), "shape": {"shape": {"dim": dims}}}})
    }

    #[test]
    fn optimizer_applies_fold_their_hyper_parameters() {
        let def = import(json!({"node": [
            variable("w", "VarHandleOp", &[2]),
            variable("v", "VariableV2", &[2]),
            variable("v/Momentum", "VariableV2", &[2]),
            f32_const("lr", &[], &[0.5]),
            f32_const("mom", &[], &[0.9]),
            f32_const("g", &[2], &[1.0, 2.0]),
            {"name": "w/read", "op": "ReadVariableOp", "input": ["w"], "attr": {"dtype": f32_type()}},
            {"name": "relu_grad", "op": "ReluGrad", "input": ["g", "w/read"]},
            {"name": "sgd", "op": "ResourceApplyGradientDescent", "input": ["w", "lr", "relu_grad"]},
            {"name": "momentum", "op": "ApplyMomentum", "input": ["v", "v/Momentum", "lr", "g", "mom"],
             "attr": {"use_nesterov": {"b": true}}},
            {"name": "train", "op": "NoOp", "input": ["^sgd", "^momentum"]}
        ]}))
        .unwrap();
        let sgd = node(&def, "sgd");
        assert_eq!(sgd.op, "ApplyGradientDescent");
        assert_eq!(sgd.inputs, ["w", "relu_grad"]);
        assert_eq!(sgd.attrs["lr"], AttrValue::Float(0.5));
        let m = node(&def, "momentum");
        assert_eq!(m.inputs, ["v", "v/Momentum", "g"]);
        assert_eq!(m.attrs["lr"], AttrValue::Float(0.5));
        assert!(matches!(m.attrs["momentum"], AttrValue::Float(x) if (x - 0.9).abs() < 1e-6));
        assert_eq!(m.attrs["use_nesterov"], AttrValue::Bool(true));
        // The hyper-parameter constants are gone; the gradient constant stays.
        assert!(def.nodes.iter().all(|n| n.name != "lr" && n.name != "mom"));
        // A read without a device goes with its variable.
        assert_eq!(node(&def, "w/read").colocate_with, ["w"]);
        Graph::from_def(&def).unwrap();
    }

    #[test]
    fn initial_values_are_carried_over_or_refused_naming_the_variable() {
        let with_init = |value: Value| {
            import(json!({"node": [
                variable("w", "VariableV2", &[3]),
                value,
                {"name": "w/Assign", "op": "Assign", "input": ["w", "w/Initializer/value"]},
                {"name": "init", "op": "NoOp", "input": ["^w/Assign"]}
            ]}))
        };
        let def = with_init(f32_const("w/Initializer/value", &[3], &[0.25])).unwrap();
        assert_eq!(
            node(&def, "w").attrs["initializer"],
            AttrValue::from("constant")
        );
        assert_eq!(node(&def, "w").attrs["init_value"], AttrValue::Float(0.25));
        assert!(node(&def, "init").inputs.is_empty());
        // Differing values are carried over exactly, and the variable starts from them.
        let def = with_init(f32_const("w/Initializer/value", &[3], &[0.25, -1.0, 2.0])).unwrap();
        let w = node(&def, "w");
        assert!(!w.attrs.contains_key("initializer"));
        match &w.attrs["initial_value"] {
            AttrValue::Tensor(t) => assert_eq!(t.as_slice::<f32>().unwrap(), [0.25, -1.0, 2.0]),
            other => panic!("{other:?}"),
        }
        Graph::from_def(&def).unwrap();
        // A broadcast-encoded zeros of a huge variable stays compact (not expanded).
        let big = import(json!({"node": [
            variable("e", "VariableV2", &[1 << 20, 1 << 10]),
            {"name": "e/Initializer/zeros", "op": "Const", "attr": {"value": {"tensor": {
                "dtype": "DT_FLOAT", "floatVal": [0],
                "tensorShape": {"dim": [{"size": "1048576"}, {"size": "1024"}]}}}}},
            {"name": "e/Assign", "op": "Assign", "input": ["e", "e/Initializer/zeros"]}
        ]}))
        .unwrap();
        assert_eq!(
            node(&big, "e").attrs["initializer"],
            AttrValue::from("zeros")
        );
        // A value computed by ops the importer does not evaluate is an error naming the
        // variable.
        let e = import(json!({"node": [
            variable("w", "VariableV2", &[3]),
            f32_const("a", &[3], &[1.0, 2.0, 3.0]),
            {"name": "w/Initializer/value", "op": "Exp", "input": ["a"]},
            {"name": "w/Assign", "op": "Assign", "input": ["w", "w/Initializer/value"]}
        ]}))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("variable `w`") && e.contains("does not recognise"),
            "{e}"
        );
    }

    /// TensorFlow's seeded random initializers are reproduced: a variable imported with one
    /// starts from TensorFlow's values (references: TensorFlow 2.21,
    /// `RandomStandardNormal(shape=[10], seed=87654321, seed2=7)`, then × 0.5 + 1).
    #[test]
    fn seeded_random_initializers_start_from_tensorflows_values() {
        use crate::ops::testing::run_kernel_with;
        let def = import(json!({"node": [
            variable("w", "VarHandleOp", &[2, 5]),
            {"name": "w/Initializer/random_normal/shape", "op": "Const", "attr": {"value":
                {"tensor": {"dtype": "DT_INT32", "tensorShape": {"dim": [{"size": "2"}]},
                            "intVal": [2, 5]}}}},
            {"name": "w/Initializer/random_normal/RandomStandardNormal",
             "op": "RandomStandardNormal", "input": ["w/Initializer/random_normal/shape"],
             "attr": {"dtype": f32_type(), "seed": {"i": "87654321"}, "seed2": {"i": "7"}}},
            f32_const("w/Initializer/random_normal/stddev", &[], &[0.5]),
            f32_const("w/Initializer/random_normal/mean", &[], &[1.0]),
            {"name": "w/Initializer/random_normal/mul", "op": "Mul", "input": [
                "w/Initializer/random_normal/RandomStandardNormal",
                "w/Initializer/random_normal/stddev"]},
            {"name": "w/Initializer/random_normal", "op": "AddV2", "input": [
                "w/Initializer/random_normal/mul", "w/Initializer/random_normal/mean"]},
            {"name": "w/Assign", "op": "AssignVariableOp",
             "input": ["w", "w/Initializer/random_normal"]}
        ]}))
        .unwrap();
        let w = node(&def, "w");
        let attrs: Vec<(&str, AttrValue)> = w
            .attrs
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        let cell = [std::sync::Arc::new(crate::kernel::VariableCell::default())];
        let t = run_kernel_with("Variable", "w", &attrs, &[], &[], &cell)
            .unwrap()
            .remove(0);
        let tf = [
            -0.046945683658123016f64,
            -1.2039023637771606,
            1.1668351888656616,
            1.1706204414367676,
            -0.3200702369213104,
            -0.19035114347934723,
            -1.4242879152297974,
            0.9578679203987122,
            -0.22877390682697296,
            -0.6875477433204651,
        ];
        let got = t.to_f64_vec();
        assert_eq!(t.dims(), [2, 5]);
        for (g, v) in got.iter().zip(tf) {
            assert!((g - (v * 0.5 + 1.0)).abs() < 1e-6, "{got:?}");
        }
    }

    #[test]
    fn state_updates_are_not_mistaken_for_initializers() {
        let e = import(json!({"node": [
            {"name": "w", "op": "VariableV2", "attr": {"dtype": f32_type(),
                "shape": {"shape": {"dim": [{"size": "2"}]}}}},
            {"name": "w/Initializer/zeros", "op": "Const", "attr": {"value": {"tensor":
                {"dtype": "DT_FLOAT", "tensorShape": {"dim": [{"size": "2"}]}}}}},
            {"name": "w/Assign", "op": "Assign", "input": ["w", "w/Initializer/zeros"]},
            {"name": "one", "op": "Const", "attr": {"value": {"tensor": {"dtype": "DT_FLOAT",
                "floatVal": [1]}}}},
            {"name": "w_plus_1", "op": "AddV2", "input": ["w", "one"]},
            {"name": "update", "op": "Assign", "input": ["w", "w_plus_1"]},
            {"name": "bump", "op": "AssignAddVariableOp", "input": ["w", "w_plus_1"]}
        ]}))
        .unwrap();
        let names: Vec<_> = e.nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["w", "one", "w_plus_1", "update", "bump"]);
        assert_eq!(node(&e, "update").op, "Assign");
        assert_eq!(node(&e, "update").inputs, ["w", "w_plus_1"]);
        assert_eq!(node(&e, "bump").op, "AssignAdd");
        Graph::from_def(&e).unwrap();
    }

    #[test]
    fn reading_a_dropped_node_is_an_error() {
        let e = import(json!({"node": [
            {"name": "v/Initializer/zeros", "op": "Const", "attr": {"value": {"tensor":
                {"dtype": "DT_FLOAT"}}}},
            {"name": "y", "op": "Identity", "input": ["v/Initializer/zeros"]}
        ]}))
        .unwrap_err();
        assert!(e.to_string().contains("variable-initialization"), "{e}");
    }

    #[test]
    fn garbage_and_missing_fields_are_clean_errors() {
        let cases: [(&str, &str); 13] = [
            ("not json", "invalid JSON at line 1"),
            ("{\"node\": [\n  {\"name\": }", "invalid JSON at line 2"),
            ("[1, 2]", "not a TensorFlow GraphDef"),
            ("{}", "no top-level `node` list"),
            (r#"{"node": 3}"#, "`node` is not a list"),
            (r#"{"node": [3]}"#, "node #0 `` (): expected a JSON object"),
            (r#"{"node": [{"op": "NoOp"}]}"#, "missing `name`"),
            (
                r#"{"node": [{"name": "a"}]}"#,
                "node #0 `a` (): missing `op`",
            ),
            (
                r#"{"node": [{"name": "a", "op": "NoOp", "input": "b"}]}"#,
                "`input` must be a list",
            ),
            (
                r#"{"node": [{"name": "a", "op": "NoOp", "input": ["^"]}]}"#,
                "invalid control input",
            ),
            (
                r#"{"node": [{"name": "a", "op": "NoOp", "input": ["^b"]}]}"#,
                "`^b` names no node",
            ),
            (
                r#"{"node": [{"name": "a", "op": "NoOp"}, {"name": "a", "op": "NoOp"}]}"#,
                "node #1 `a` (NoOp): duplicate node name (first defined at #0)",
            ),
            (
                r#"{"node": [{"name": "c", "op": "Const"}]}"#,
                "missing attr `value`",
            ),
        ];
        for (text, want) in cases {
            let e = import_graphdef_json(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        let bad_attrs = [
            (
                json!({"name": "p", "op": "Placeholder"}),
                "missing attr `dtype`",
            ),
            (
                json!({"name": "p", "op": "Placeholder", "attr": {"dtype": {"type": "DT_COMPLEX64"}}}),
                "attr `dtype`: dtype DT_COMPLEX64 is not supported",
            ),
            (
                json!({"name": "p", "op": "Placeholder", "attr": {"dtype": {"type": 1}}}),
                "expected a dtype name",
            ),
            (
                json!({"name": "p", "op": "Placeholder", "attr": {"dtype": f32_type(),
                "shape": {"shape": {"dim": [{"size": "many"}]}}}}),
                "expected an integer",
            ),
            (
                json!({"name": "v", "op": "VariableV2", "attr": {"dtype": f32_type()}}),
                "missing attr `shape`",
            ),
            (
                json!({"name": "m", "op": "MatMul", "attr": {"transpose_a": {"b": "yes"}}}),
                "attr `transpose_a`: expected a bool",
            ),
            (
                json!({"name": "b", "op": "BiasAdd", "attr": {"data_format": {"s": "TkNIVw=="}}}),
                "data_format \"NCHW\" is not supported",
            ),
            (
                json!({"name": "b", "op": "NoOp", "attr": {"_class": {"list": {"s": ["%%"]}}}}),
                "attr `_class`: invalid base64",
            ),
        ];
        for (n, want) in bad_attrs {
            let e = import(json!({"node": [n]})).unwrap_err().to_string();
            assert!(e.contains(want), "{n}: {e}");
        }
    }
}
