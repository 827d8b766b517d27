//! The op registry: every op's signature, attributes and dtype/shape rule.
//!
//! One module per op family; adding an op touches exactly one module (its declaration, shape
//! rule, and — as later layers land — its CPU kernel and gradient live side by side). Each family
//! module exposes `pub(crate) fn register(r: &mut OpRegistry)`.

use crate::{AttrType, AttrValue, DType, DeviceType, OpError, Shape, Tensor};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::OnceLock;

pub mod array;
pub mod batch_matmul;
pub mod broadcast;
pub mod collective;
pub mod collective_tp;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod grad;
pub mod init;
pub mod math;
pub mod moe;
pub mod nn;
pub mod reduce;
pub mod shape;
pub mod sharded_lookup;
pub mod sparse_embedding;
pub mod sparse_train;
pub mod state;
pub mod testing;
pub mod tf_compat;
pub mod tf_dynamic;
pub mod tf_embedding;
pub mod tf_math;
pub mod train;
pub mod transfer;
pub mod transformer;

/// One input or output of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArgDef {
    /// Argument name (for messages and docs).
    pub name: &'static str,
    /// A reference input: the op reads or mutates the producer's state (a variable) in place.
    /// Reference edges force colocation and never become Send/Recv pairs.
    pub is_ref: bool,
    /// Repeated: the op takes any number (≥ 1) of inputs here. Only the last input may be repeated.
    /// On an output: the shape rule decides how many outputs the node has (≥ 1 here, e.g. from
    /// an attribute such as `Split`'s `num_split`); only the last output may be repeated, and
    /// consumers' output indices are checked against the inferred count.
    pub variadic: bool,
}

/// A plain argument.
pub const fn arg(name: &'static str) -> ArgDef {
    ArgDef {
        name,
        is_ref: false,
        variadic: false,
    }
}

/// A reference argument (see [`ArgDef::is_ref`]).
pub const fn ref_arg(name: &'static str) -> ArgDef {
    ArgDef {
        name,
        is_ref: true,
        variadic: false,
    }
}

/// A repeated argument (see [`ArgDef::variadic`]).
pub const fn variadic(name: &'static str) -> ArgDef {
    ArgDef {
        name,
        is_ref: false,
        variadic: true,
    }
}

/// The default of an attribute, in a form that fits in a `static`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AttrDefault {
    /// The attribute is required.
    Required,
    /// Default integer.
    Int(i64),
    /// Default float.
    Float(f64),
    /// Default bool.
    Bool(bool),
    /// Default string.
    Str(&'static str),
    /// Default dtype.
    DType(DType),
    /// Default list of ints.
    Ints(&'static [i64]),
    /// Default empty string list.
    EmptyStrings,
    /// Default shape: unknown rank.
    UnknownShape,
    /// Optional without a default: an absent attribute means "not given" (the op's shape rule
    /// and kernel look it up with `attrs.get`).
    Unset,
}

impl AttrDefault {
    /// The default as a value, or `None` when required or [`AttrDefault::Unset`].
    pub fn value(self) -> Option<AttrValue> {
        Some(match self {
            AttrDefault::Required | AttrDefault::Unset => return None,
            AttrDefault::Int(i) => AttrValue::Int(i),
            AttrDefault::Float(x) => AttrValue::Float(x),
            AttrDefault::Bool(b) => AttrValue::Bool(b),
            AttrDefault::Str(s) => AttrValue::String(s.into()),
            AttrDefault::DType(d) => AttrValue::DType(d),
            AttrDefault::Ints(v) => AttrValue::IntList(v.to_vec()),
            AttrDefault::EmptyStrings => AttrValue::StringList(vec![]),
            AttrDefault::UnknownShape => AttrValue::Shape(Shape::unknown()),
        })
    }
}

/// One attribute an op accepts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttrDef {
    /// Attribute name.
    pub name: &'static str,
    /// Its type.
    pub ty: AttrType,
    /// Its default.
    pub default: AttrDefault,
}

/// A required attribute.
pub const fn attr(name: &'static str, ty: AttrType) -> AttrDef {
    AttrDef {
        name,
        ty,
        default: AttrDefault::Required,
    }
}

/// An optional attribute with a default.
pub const fn attr_or(name: &'static str, ty: AttrType, default: AttrDefault) -> AttrDef {
    AttrDef { name, ty, default }
}

/// The static type of one tensor flowing along an edge.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Shape, possibly partial.
    pub shape: Shape,
}

impl TensorType {
    /// Builds a tensor type.
    pub fn new(dtype: DType, shape: Shape) -> Self {
        TensorType { dtype, shape }
    }

    /// Bytes of one value of this type, when its shape is static.
    pub fn byte_size(&self) -> Option<usize> {
        self.shape.num_elements()?.checked_mul(self.dtype.size_of())
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

/// What a shape rule sees: the node's input types and its attributes (defaults filled in).
#[derive(Debug)]
pub struct InferCtx<'a> {
    /// The node's name.
    pub node: &'a str,
    /// Types of the data inputs, in order.
    pub inputs: &'a [TensorType],
    /// Attributes, with declared defaults filled in.
    pub attrs: &'a BTreeMap<String, AttrValue>,
}

impl InferCtx<'_> {
    /// Input `i`'s type.
    pub fn input(&self, i: usize) -> Result<&TensorType, OpError> {
        self.inputs.get(i).ok_or(OpError::MissingInput { index: i })
    }

    fn attr(&self, name: &str) -> Result<&AttrValue, OpError> {
        self.attrs.get(name).ok_or_else(|| OpError::MissingAttr {
            name: name.to_string(),
        })
    }

    /// An int attribute.
    pub fn int(&self, name: &str) -> Result<i64, OpError> {
        match self.attr(name)? {
            AttrValue::Int(v) => Ok(*v),
            v => Err(OpError::AttrType {
                name: name.to_string(),
                found: v.ty(),
                expected: "int",
            }),
        }
    }

    /// A float attribute.
    pub fn float(&self, name: &str) -> Result<f64, OpError> {
        match self.attr(name)? {
            AttrValue::Float(v) => Ok(*v),
            v => Err(OpError::AttrType {
                name: name.to_string(),
                found: v.ty(),
                expected: "float",
            }),
        }
    }

    /// A bool attribute.
    pub fn bool(&self, name: &str) -> Result<bool, OpError> {
        match self.attr(name)? {
            AttrValue::Bool(v) => Ok(*v),
            v => Err(OpError::AttrType {
                name: name.to_string(),
                found: v.ty(),
                expected: "bool",
            }),
        }
    }

    /// A dtype attribute.
    pub fn dtype(&self, name: &str) -> Result<DType, OpError> {
        match self.attr(name)? {
            AttrValue::DType(v) => Ok(*v),
            v => Err(OpError::AttrType {
                name: name.to_string(),
                found: v.ty(),
                expected: "dtype",
            }),
        }
    }

    /// A shape attribute.
    pub fn shape(&self, name: &str) -> Result<&Shape, OpError> {
        match self.attr(name)? {
            AttrValue::Shape(v) => Ok(v),
            v => Err(OpError::AttrType {
                name: name.to_string(),
                found: v.ty(),
                expected: "shape",
            }),
        }
    }

    /// A tensor attribute.
    pub fn tensor(&self, name: &str) -> Result<&Tensor, OpError> {
        match self.attr(name)? {
            AttrValue::Tensor(v) => Ok(v),
            v => Err(OpError::AttrType {
                name: name.to_string(),
                found: v.ty(),
                expected: "tensor",
            }),
        }
    }

    /// A string attribute.
    pub fn string(&self, name: &str) -> Result<&str, OpError> {
        match self.attr(name)? {
            AttrValue::String(v) => Ok(v),
            v => Err(OpError::AttrType {
                name: name.to_string(),
                found: v.ty(),
                expected: "string",
            }),
        }
    }

    /// An int-list attribute.
    pub fn ints(&self, name: &str) -> Result<&[i64], OpError> {
        match self.attr(name)? {
            AttrValue::IntList(v) => Ok(v),
            v => Err(OpError::AttrType {
                name: name.to_string(),
                found: v.ty(),
                expected: "list(int)",
            }),
        }
    }
}

/// A dtype and shape rule: input types and attrs in, output types out. The error message should
/// name the offending shapes; the caller adds the node name.
pub type ShapeFn = fn(&InferCtx<'_>) -> Result<Vec<TensorType>, OpError>;

/// An op's declaration.
#[derive(Clone, Debug)]
pub struct OpDef {
    /// Op type name, as written in files (`MatMul`).
    pub name: &'static str,
    /// One line for docs and `dflow check`.
    pub summary: &'static str,
    /// Inputs, in order.
    pub inputs: Vec<ArgDef>,
    /// Outputs, in order.
    pub outputs: Vec<ArgDef>,
    /// Attributes.
    pub attrs: Vec<AttrDef>,
    /// The dtype and shape rule.
    pub infer: ShapeFn,
    /// True for ops with side effects or state (never pruned as dead, never deduplicated).
    pub stateful: bool,
    /// True for ops that hold trainable state (`Variable`): placed on ps by the device setter.
    pub is_variable: bool,
    /// Kernels by device type (every op has a CPU one; GPU ones come with the CUDA backend).
    pub kernels: Vec<(DeviceType, crate::kernel::KernelFactory)>,
    /// The symbolic gradient (see [`crate::autodiff`]); `None` when the op has none.
    pub gradient: Option<crate::autodiff::GradFn>,
}

impl OpDef {
    /// A stateless op with no inputs, outputs or attrs yet; add them with the builder methods.
    pub fn new(name: &'static str, summary: &'static str, infer: ShapeFn) -> Self {
        OpDef {
            name,
            summary,
            inputs: vec![],
            outputs: vec![],
            attrs: vec![],
            infer,
            stateful: false,
            is_variable: false,
            kernels: vec![],
            gradient: None,
        }
    }

    /// Sets the symbolic gradient.
    pub fn gradient(mut self, f: crate::autodiff::GradFn) -> Self {
        self.gradient = Some(f);
        self
    }

    /// Registers the kernel for `device_type`.
    pub fn kernel(
        mut self,
        device_type: DeviceType,
        factory: crate::kernel::KernelFactory,
    ) -> Self {
        self.kernels.push((device_type, factory));
        self
    }

    /// Registers the CPU kernel (`kernel(DeviceType::CPU, factory)`).
    pub fn cpu_kernel(self, factory: crate::kernel::KernelFactory) -> Self {
        self.kernel(DeviceType::CPU, factory)
    }

    /// The kernel factory for `device_type`, if the op has one.
    pub fn kernel_for(&self, device_type: &DeviceType) -> Option<crate::kernel::KernelFactory> {
        self.kernels
            .iter()
            .find(|(d, _)| d == device_type)
            .map(|(_, f)| *f)
    }

    /// Sets the inputs.
    pub fn inputs<const N: usize>(mut self, inputs: [ArgDef; N]) -> Self {
        self.inputs = inputs.to_vec();
        self
    }

    /// Sets the outputs.
    pub fn outputs<const N: usize>(mut self, outputs: [ArgDef; N]) -> Self {
        self.outputs = outputs.to_vec();
        self
    }

    /// Sets the attributes.
    pub fn attrs<const N: usize>(mut self, attrs: [AttrDef; N]) -> Self {
        self.attrs = attrs.to_vec();
        self
    }

    /// Marks the op stateful.
    pub fn stateful(mut self) -> Self {
        self.stateful = true;
        self
    }

    /// Marks the op as a variable (implies stateful).
    pub fn variable(mut self) -> Self {
        self.is_variable = true;
        self.stateful = true;
        self
    }

    /// The declaration of attribute `name`.
    /// Every op also accepts [`crate::sharding::SHARDING_ATTR`] (a placement written on the
    /// graph), which it does not list in `attrs`.
    pub fn attr(&self, name: &str) -> Option<&AttrDef> {
        self.attrs.iter().find(|a| a.name == name).or_else(|| {
            (name == crate::sharding::SHARDING_ATTR).then_some(&crate::sharding::SHARDING_ATTR_DEF)
        })
    }

    /// True when the last input is repeated.
    pub fn is_variadic(&self) -> bool {
        self.inputs.last().is_some_and(|a| a.variadic)
    }

    /// True when the last output is repeated (the shape rule decides the output count).
    pub fn has_variadic_output(&self) -> bool {
        self.outputs.last().is_some_and(|a| a.variadic)
    }

    /// Whether a shape rule's `n` outputs fit the declaration: exactly the declared count, or,
    /// with a repeated last output, at least that many.
    pub fn output_count_ok(&self, n: usize) -> bool {
        if self.has_variadic_output() {
            n >= self.outputs.len()
        } else {
            n == self.outputs.len()
        }
    }
}

/// All known ops, by name.
#[derive(Debug, Default)]
pub struct OpRegistry {
    ops: BTreeMap<&'static str, OpDef>,
    /// Names given to [`OpRegistry::set_gradient`] that name no registered op.
    unknown_gradients: Vec<String>,
}

/// The ops without a gradient, each with the reason. Every op has a gradient or is listed here;
/// [`registry`] checks it when it is built, so a new differentiable op without a gradient (or a
/// gradient registered under a misspelt name) fails the first test that touches an op, not a
/// user's training run. Differentiating through a listed op fails naming the node.
pub const NO_GRADIENT: &[(&str, &str)] = &[
    ("ApplyAdam", "an optimizer update"),
    ("ApplyAdamW", "an optimizer update"),
    ("ApplyAdamWithPowers", "an optimizer update"),
    ("ApplyGradientDescent", "an optimizer update"),
    ("ApplyMomentum", "an optimizer update"),
    ("SparseApplyAdagrad", "an optimizer update"),
    ("SparseApplyGradientDescent", "an optimizer update"),
    ("SparseApplyLazyAdam", "an optimizer update"),
    ("IncrementStep", "an optimizer update"),
    ("Assign", "a state update"),
    ("AssignAdd", "a state update"),
    ("AssignSub", "a state update"),
    ("NoOp", "no outputs"),
    (
        "Send",
        "a transfer the partitioner adds after differentiation",
    ),
    (
        "Recv",
        "a transfer the partitioner adds after differentiation",
    ),
    ("Shape", "an integer result"),
    ("Fill", "a constant of a given shape"),
    ("FloorMod", "an integer operation"),
    (
        "GlobalNormScale",
        "used on gradients, after differentiation",
    ),
    ("SquaredNorm", "used on gradients, after differentiation"),
    ("PackFlat", "used on gradients, after differentiation"),
    ("FlatSlice", "used on gradients, after differentiation"),
    ("ReduceToShapeOf", "a gradient op"),
    ("BiasAddGrad", "a gradient op"),
    ("ReluGrad", "a gradient op"),
    ("SigmoidGrad", "a gradient op"),
    ("TanhGrad", "a gradient op"),
    ("GeluGrad", "a gradient op"),
    ("LayerNormGrad", "a gradient op"),
    ("SoftmaxGrad", "a gradient op"),
    ("SliceGrad", "a gradient op"),
    ("GatherGrad", "a gradient op"),
    ("SparseRowsToDense", "a gradient op"),
    ("SparseSegmentCombineGrad", "a gradient op"),
    ("EmbeddingShardScatter", "a gradient op"),
    ("EmbeddingShardStitchGrad", "a gradient op"),
    ("MoeRouteGrad", "a gradient op"),
    ("MoeDispatchGrad", "a gradient op"),
    ("MoeCombineGrad", "a gradient op"),
    ("MoeAuxLossGrad", "a gradient op"),
    ("ReshapeLike", "a gradient op"),
    ("DynamicSumGrad", "a gradient op"),
    ("StridedSlice", "not yet"),
    ("ScatterAdd", "a state update"),
    ("SparseSegmentSumGrad", "a gradient op"),
    ("SparseSegmentMeanGrad", "a gradient op"),
    ("SparseSegmentSqrtNGrad", "a gradient op"),
    (
        "UnsortedSegmentSum",
        "not yet (TensorFlow's optimizers use it on gradients)",
    ),
    ("MaximumGrad", "a gradient op"),
    (
        "FloorDiv",
        "piecewise constant: TensorFlow's gradient is None for both inputs",
    ),
    ("BroadcastLike", "a gradient op"),
    (
        "CollectiveAllReduce",
        "used on gradients, after differentiation",
    ),
    (
        "CollectiveReduceScatter",
        "used on gradients, after differentiation",
    ),
    (
        "CollectiveBroadcast",
        "used on parameters, after differentiation",
    ),
    ("ExpandDims", "not yet"),
    ("Tile", "not yet"),
    ("Max", "not yet"),
    ("Prod", "not yet"),
    ("GatherV2", "not yet (Gather has one)"),
];

impl OpRegistry {
    /// Adds an op. Registering the same name twice is a programming error caught by a test.
    pub fn add(&mut self, op: OpDef) {
        self.ops.insert(op.name, op);
    }

    /// Sets the gradient of the already registered op `name`. An unknown name is remembered
    /// and reported by [`OpRegistry::check_gradients`].
    pub fn set_gradient(&mut self, name: &str, f: crate::autodiff::GradFn) {
        match self.ops.get_mut(name) {
            Some(op) => op.gradient = Some(f),
            None => self.unknown_gradients.push(name.to_string()),
        }
    }

    /// Every problem with the gradients: a gradient set for an unknown op, an op with neither a
    /// gradient nor a [`NO_GRADIENT`] entry, an op listed there that has a gradient, a listed
    /// name that is no op.
    pub fn check_gradients(&self, no_gradient: &[(&str, &str)]) -> Vec<String> {
        let mut problems: Vec<String> = self
            .unknown_gradients
            .iter()
            .map(|n| format!("a gradient is registered for `{n}`, which is no op"))
            .collect();
        for op in self.ops.values() {
            let listed = no_gradient.iter().any(|(n, _)| *n == op.name);
            match (op.gradient.is_some(), listed) {
                (false, false) => problems.push(format!(
                    "op `{}` has no gradient and is not in NO_GRADIENT (graph/src/ops/mod.rs): give it one, or list it with the reason",
                    op.name
                )),
                (true, true) => problems.push(format!(
                    "op `{}` has a gradient but is listed in NO_GRADIENT: remove the entry",
                    op.name
                )),
                _ => {}
            }
        }
        for (name, _) in no_gradient {
            if !self.ops.contains_key(name) {
                problems.push(format!("NO_GRADIENT lists `{name}`, which is no op"));
            }
        }
        problems
    }

    /// Looks up an op.
    pub fn get(&self, name: &str) -> Option<&OpDef> {
        self.ops.get(name)
    }

    /// Every op, sorted by name.
    pub fn ops(&self) -> impl Iterator<Item = &OpDef> {
        self.ops.values()
    }

    /// The registered op whose name is closest to `name`, if any is reasonably close.
    pub fn suggest(&self, name: &str) -> Option<&'static str> {
        let lower = name.to_ascii_lowercase();
        self.ops
            .keys()
            .map(|k| (strsim::jaro_winkler(&lower, &k.to_ascii_lowercase()), *k))
            .filter(|(score, _)| *score > 0.8)
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, k)| k)
    }
}

/// The process-wide registry of built-in ops.
pub fn registry() -> &'static OpRegistry {
    static REGISTRY: OnceLock<OpRegistry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        let mut r = OpRegistry::default();
        state::register(&mut r);
        transfer::register(&mut r);
        math::register(&mut r);
        nn::register(&mut r);
        reduce::register(&mut r);
        array::register(&mut r);
        grad::register(&mut r);
        train::register(&mut r);
        tf_compat::register(&mut r);
        tf_dynamic::register(&mut r);
        tf_math::register(&mut r);
        tf_embedding::register(&mut r);
        collective::register(&mut r);
        collective_tp::register(&mut r);
        shape::register(&mut r);
        embedding::register(&mut r);
        batch_matmul::register(&mut r);
        transformer::register(&mut r);
        moe::register(&mut r);
        sparse_embedding::register(&mut r);
        sparse_train::register(&mut r);
        sharded_lookup::register(&mut r);
        state::gradients::register_gradients(&mut r);
        math::gradients::register_gradients(&mut r);
        nn::gradients::register_gradients(&mut r);
        reduce::gradients::register_gradients(&mut r);
        array::gradients::register_gradients(&mut r);
        shape::gradients::register_gradients(&mut r);
        embedding::gradients::register_gradients(&mut r);
        batch_matmul::gradients::register_gradients(&mut r);
        transformer::gradients::register_gradients(&mut r);
        moe::gradients::register_gradients(&mut r);
        collective::gradients::register_gradients(&mut r);
        collective_tp::gradients::register_gradients(&mut r);
        sparse_embedding::gradients::register_gradients(&mut r);
        tf_dynamic::gradients::register_gradients(&mut r);
        tf_math::gradients::register_gradients(&mut r);
        tf_embedding::gradients::register_gradients(&mut r);
        sharded_lookup::gradients::register_gradients(&mut r);
        let problems = r.check_gradients(NO_GRADIENT);
        // The registry is built from this crate's code only: a problem here is a bug in it,
        // reported by the first test that touches an op.
        assert!(problems.is_empty(), "op registry: {}", problems.join("; "));
        r
    })
}

/// Shape-rule helper: the first input's type unchanged (elementwise unary ops).
pub fn same_as_input(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    Ok(vec![ctx.input(0)?.clone()])
}

/// Shape-rule helper: requires a floating-point dtype.
pub fn require_float(what: &str, t: &TensorType) -> Result<(), OpError> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(OpError::NotFloat {
            what: what.to_string(),
            got: t.dtype,
        })
    }
}

/// Shape-rule helper: requires two inputs to have the same dtype.
pub fn require_same_dtype(a: &TensorType, b: &TensorType) -> Result<DType, OpError> {
    if a.dtype == b.dtype {
        Ok(a.dtype)
    } else {
        Err(OpError::DTypeMismatch {
            a: a.dtype,
            b: b.dtype,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_is_well_formed() {
        for op in registry().ops() {
            for (i, a) in op.inputs.iter().enumerate() {
                assert!(
                    !a.variadic || i + 1 == op.inputs.len(),
                    "{}: only the last input may repeat",
                    op.name
                );
            }
            for (i, a) in op.outputs.iter().enumerate() {
                assert!(
                    !a.variadic || i + 1 == op.outputs.len(),
                    "{}: only the last output may repeat",
                    op.name
                );
            }
            let mut names: Vec<_> = op.attrs.iter().map(|a| a.name).collect();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), op.attrs.len(), "{}: duplicate attr", op.name);
            for a in &op.attrs {
                if let Some(v) = a.default.value() {
                    assert_eq!(
                        v.ty(),
                        a.ty,
                        "{}.{}: default has the wrong type",
                        op.name,
                        a.name
                    );
                }
            }
        }
    }

    #[test]
    fn suggests_near_names() {
        assert_eq!(registry().suggest("Identiy"), Some("Identity"));
        assert_eq!(registry().suggest("zzzzzzzz"), None);
    }
}
