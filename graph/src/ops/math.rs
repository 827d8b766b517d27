//! Arithmetic: Add, Sub, Mul, Div, Neg, MatMul, Cast, Equal, AddN, Square, Sqrt, Exp, Log.
//!
//! Binary elementwise ops broadcast like NumPy and TensorFlow (see [`broadcast_shapes`]).
//! Each op lives in its own delimited block below (declaration + shape rule); kernels and
//! gradients for an op go into the same block.

use super::*;

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(add());
    r.add(sub());
    r.add(mul());
    r.add(div());
    r.add(neg());
    r.add(mat_mul());
    r.add(cast());
    r.add(equal());
    r.add(add_n());
    r.add(square());
    r.add(sqrt());
    r.add(exp());
    r.add(log());
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// The shape of `a op b` under NumPy/TensorFlow broadcasting, over partially known shapes.
///
/// Shapes are aligned on the right; a missing or size-1 dimension stretches to the other. An
/// unknown dimension stays unknown unless the other side is known and not 1 (then the unknown
/// must be 1 or equal to it at run time, so the result is the known size). An unknown rank on
/// either side gives an unknown rank. Two known dimensions that differ and are both ≠ 1 are an
/// error naming both shapes.
pub fn broadcast_shapes(a: &Shape, b: &Shape) -> Result<Shape, String> {
    let (Some(da), Some(db)) = (a.dims(), b.dims()) else {
        return Ok(Shape::unknown());
    };
    let rank = da.len().max(db.len());
    // Dimension `i` (counted from the left of the result) of a shape of rank `r`.
    let at = |d: &[Option<usize>], i: usize| -> Option<usize> {
        let pad = rank - d.len();
        if i < pad {
            Some(1)
        } else {
            d[i - pad]
        }
    };
    let mut out = Vec::with_capacity(rank);
    for i in 0..rank {
        out.push(match (at(da, i), at(db, i)) {
            (Some(1), y) => y,
            (x, Some(1)) => x,
            (Some(x), Some(y)) if x == y => Some(x),
            (Some(x), Some(y)) => {
                return Err(format!(
                    "shapes {a} and {b} are not broadcastable (dimension {i} of the result: {x} vs {y})"
                ))
            }
            (Some(x), None) | (None, Some(x)) => Some(x),
            (None, None) => None,
        });
    }
    Ok(Shape::partial(out))
}

/// Requires a numeric (non-bool) dtype.
pub(crate) fn require_numeric(op: &str, what: &str, t: &TensorType) -> Result<(), String> {
    if t.dtype.is_numeric() {
        Ok(())
    } else {
        Err(format!("{op}: {what} must be numeric, got {t}"))
    }
}

/// Requires two inputs of one op to share a dtype, naming both in the error.
pub(crate) fn require_same(
    op: &str,
    (na, a): (&str, &TensorType),
    (nb, b): (&str, &TensorType),
) -> Result<DType, String> {
    if a.dtype == b.dtype {
        Ok(a.dtype)
    } else {
        Err(format!(
            "{op}: {na} is {a} but {nb} is {b}; both must have the same dtype"
        ))
    }
}

/// Shape rule of a binary elementwise op: same numeric dtype, broadcast shapes. `out` overrides
/// the output dtype (comparisons produce bool).
fn binary(
    op: &str,
    ctx: &InferCtx<'_>,
    numeric: bool,
    out: Option<DType>,
) -> Result<Vec<TensorType>, String> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let dtype = require_same(op, ("x", x), ("y", y))?;
    if numeric {
        require_numeric(op, "x", x)?;
    }
    let shape = broadcast_shapes(&x.shape, &y.shape).map_err(|e| format!("{op}: {e}"))?;
    Ok(vec![TensorType::new(out.unwrap_or(dtype), shape)])
}

/// Shape rule of a unary elementwise op on floats: the input type unchanged.
pub(crate) fn unary_float(op: &str, ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, String> {
    let x = ctx.input(0)?;
    require_float(&format!("{op}: input"), x)?;
    Ok(vec![x.clone()])
}

// ---------------------------------------------------------------------------------------------
// Add
// ---------------------------------------------------------------------------------------------

fn add() -> OpDef {
    OpDef::new(
        "Add",
        "z = x + y elementwise, with NumPy broadcasting. In: x, y (same numeric dtype). Out: z.",
        |ctx| binary("Add", ctx, true, None),
    )
    .inputs([arg("x"), arg("y")])
    .outputs([arg("z")])
}

// ---------------------------------------------------------------------------------------------
// Sub
// ---------------------------------------------------------------------------------------------

fn sub() -> OpDef {
    OpDef::new(
        "Sub",
        "z = x - y elementwise, with NumPy broadcasting. In: x, y (same numeric dtype). Out: z.",
        |ctx| binary("Sub", ctx, true, None),
    )
    .inputs([arg("x"), arg("y")])
    .outputs([arg("z")])
}

// ---------------------------------------------------------------------------------------------
// Mul
// ---------------------------------------------------------------------------------------------

fn mul() -> OpDef {
    OpDef::new(
        "Mul",
        "z = x * y elementwise, with NumPy broadcasting. In: x, y (same numeric dtype). Out: z.",
        |ctx| binary("Mul", ctx, true, None),
    )
    .inputs([arg("x"), arg("y")])
    .outputs([arg("z")])
}

// ---------------------------------------------------------------------------------------------
// Div
// ---------------------------------------------------------------------------------------------

fn div() -> OpDef {
    OpDef::new(
        "Div",
        "z = x / y elementwise (integers truncate), with NumPy broadcasting. \
         In: x, y (same numeric dtype). Out: z.",
        |ctx| binary("Div", ctx, true, None),
    )
    .inputs([arg("x"), arg("y")])
    .outputs([arg("z")])
}

// ---------------------------------------------------------------------------------------------
// Neg
// ---------------------------------------------------------------------------------------------

fn neg() -> OpDef {
    OpDef::new(
        "Neg",
        "y = -x elementwise. In: x (numeric). Out: y, same type.",
        |ctx| {
            let x = ctx.input(0)?;
            require_numeric("Neg", "x", x)?;
            Ok(vec![x.clone()])
        },
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
}

// ---------------------------------------------------------------------------------------------
// MatMul
// ---------------------------------------------------------------------------------------------

fn mat_mul() -> OpDef {
    OpDef::new(
        "MatMul",
        "product = op(a) · op(b), op = transpose when the flag is set. In: a, b (rank 2, same \
         float or int dtype). Out: product [rows of op(a), cols of op(b)]. \
         Attrs: transpose_a, transpose_b (bool, default false).",
        mat_mul_infer,
    )
    .inputs([arg("a"), arg("b")])
    .outputs([arg("product")])
    .attrs([
        attr_or("transpose_a", AttrType::Bool, AttrDefault::Bool(false)),
        attr_or("transpose_b", AttrType::Bool, AttrDefault::Bool(false)),
    ])
}

fn mat_mul_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, String> {
    let (a, b) = (ctx.input(0)?, ctx.input(1)?);
    let (ta, tb) = (ctx.bool("transpose_a")?, ctx.bool("transpose_b")?);
    let dtype = require_same("MatMul", ("a", a), ("b", b))?;
    if !(dtype.is_float() || dtype.is_int()) {
        return Err(format!("MatMul: a must be a float or int type, got {a}"));
    }
    // (rows, cols) after the optional transpose; unknown rank gives unknown dims.
    let matrix = |name: &str, t: &TensorType, transpose: bool| match t.shape.rank() {
        None => Ok((None, None)),
        Some(2) => {
            let (r, c) = (t.shape.dim(0), t.shape.dim(1));
            Ok(if transpose { (c, r) } else { (r, c) })
        }
        Some(n) => Err(format!(
            "MatMul: {name} must be rank 2, got rank {n} shape {}",
            t.shape
        )),
    };
    let (m, ka) = matrix("a", a, ta)?;
    let (kb, n) = matrix("b", b, tb)?;
    if let (Some(x), Some(y)) = (ka, kb) {
        if x != y {
            return Err(format!(
                "MatMul inner dimensions differ: a is {} (transpose_a={ta}), b is {} (transpose_b={tb})",
                a.shape, b.shape
            ));
        }
    }
    Ok(vec![TensorType::new(dtype, Shape::partial(vec![m, n]))])
}

// ---------------------------------------------------------------------------------------------
// Cast
// ---------------------------------------------------------------------------------------------

fn cast() -> OpDef {
    OpDef::new(
        "Cast",
        "y = x converted to dtype DstT (any dtype to any; float→int truncates toward zero, \
         nonzero→true). In: x. Out: y, same shape. Attrs: DstT (dtype, required).",
        |ctx| {
            let x = ctx.input(0)?;
            Ok(vec![TensorType::new(ctx.dtype("DstT")?, x.shape.clone())])
        },
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .attrs([attr("DstT", AttrType::DType)])
}

// ---------------------------------------------------------------------------------------------
// Equal
// ---------------------------------------------------------------------------------------------

fn equal() -> OpDef {
    OpDef::new(
        "Equal",
        "z = (x == y) elementwise, with NumPy broadcasting. In: x, y (same dtype, any). \
         Out: z (bool).",
        |ctx| binary("Equal", ctx, false, Some(DType::Bool)),
    )
    .inputs([arg("x"), arg("y")])
    .outputs([arg("z")])
}

// ---------------------------------------------------------------------------------------------
// AddN
// ---------------------------------------------------------------------------------------------

fn add_n() -> OpDef {
    OpDef::new(
        "AddN",
        "sum = inputs[0] + inputs[1] + … (no broadcasting). In: inputs (variadic, ≥ 1, same \
         numeric dtype, compatible shapes). Out: sum, the most specific common shape.",
        add_n_infer,
    )
    .inputs([variadic("inputs")])
    .outputs([arg("sum")])
}

fn add_n_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, String> {
    let first = ctx
        .inputs
        .first()
        .ok_or_else(|| "AddN: needs at least one input".to_string())?;
    require_numeric("AddN", "inputs[0]", first)?;
    let mut shape = first.shape.clone();
    for (i, t) in ctx.inputs.iter().enumerate().skip(1) {
        if t.dtype != first.dtype {
            return Err(format!(
                "AddN: inputs[0] is {first} but inputs[{i}] is {t}; all inputs must have the same dtype"
            ));
        }
        shape = shape.merge(&t.shape).ok_or_else(|| {
            format!(
                "AddN: inputs[{i}] has shape {} incompatible with {shape} (from the earlier inputs)",
                t.shape
            )
        })?;
    }
    Ok(vec![TensorType::new(first.dtype, shape)])
}

// ---------------------------------------------------------------------------------------------
// Square
// ---------------------------------------------------------------------------------------------

fn square() -> OpDef {
    OpDef::new(
        "Square",
        "y = x * x elementwise. In: x (float). Out: y, same type.",
        |ctx| unary_float("Square", ctx),
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
}

// ---------------------------------------------------------------------------------------------
// Sqrt
// ---------------------------------------------------------------------------------------------

fn sqrt() -> OpDef {
    OpDef::new(
        "Sqrt",
        "y = √x elementwise. In: x (float). Out: y, same type.",
        |ctx| unary_float("Sqrt", ctx),
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
}

// ---------------------------------------------------------------------------------------------
// Exp
// ---------------------------------------------------------------------------------------------

fn exp() -> OpDef {
    OpDef::new(
        "Exp",
        "y = eˣ elementwise. In: x (float). Out: y, same type.",
        |ctx| unary_float("Exp", ctx),
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
}

// ---------------------------------------------------------------------------------------------
// Log
// ---------------------------------------------------------------------------------------------

fn log() -> OpDef {
    OpDef::new(
        "Log",
        "y = ln x elementwise. In: x (float). Out: y, same type.",
        |ctx| unary_float("Log", ctx),
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
}

// ---------------------------------------------------------------------------------------------
// Test support shared by the op-family tests
// ---------------------------------------------------------------------------------------------

/// Runs op `name`'s shape rule through the registry, with declared attr defaults filled in the
/// way graph validation does.
#[cfg(test)]
pub(crate) fn infer(
    name: &str,
    inputs: &[TensorType],
    attrs: &[(&str, AttrValue)],
) -> Result<Vec<TensorType>, String> {
    let op = registry()
        .get(name)
        .unwrap_or_else(|| panic!("op {name} is not registered"));
    let mut map: BTreeMap<String, AttrValue> = op
        .attrs
        .iter()
        .filter_map(|a| Some((a.name.to_string(), a.default.value()?)))
        .collect();
    for (k, v) in attrs {
        assert!(op.attr(k).is_some(), "{name} has no attr {k}");
        map.insert(k.to_string(), v.clone());
    }
    (op.infer)(&InferCtx {
        node: "n",
        inputs,
        attrs: &map,
    })
}

/// Shorthand for a tensor type in tests: `-1` is an unknown dim.
#[cfg(test)]
pub(crate) fn tt(dtype: DType, dims: &[i64]) -> TensorType {
    TensorType::new(dtype, Shape::from_signed(dims).expect("valid test shape"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use DType::*;

    fn one(name: &str, inputs: &[TensorType]) -> Result<TensorType, String> {
        let mut out = infer(name, inputs, &[])?;
        assert_eq!(out.len(), 1);
        Ok(out.remove(0))
    }

    #[test]
    fn binary_ops_broadcast() {
        for op in ["Add", "Sub", "Mul", "Div"] {
            assert_eq!(
                one(op, &[tt(F32, &[2, 3]), tt(F32, &[2, 3])]),
                Ok(tt(F32, &[2, 3]))
            );
            assert_eq!(
                one(op, &[tt(F32, &[3, 1]), tt(F32, &[1, 4])]),
                Ok(tt(F32, &[3, 4]))
            );
            assert_eq!(
                one(op, &[tt(I32, &[]), tt(I32, &[2, 3])]),
                Ok(tt(I32, &[2, 3]))
            );
            assert_eq!(
                one(op, &[tt(F64, &[2, 3]), tt(F64, &[3])]),
                Ok(tt(F64, &[2, 3]))
            );
        }
    }

    #[test]
    fn broadcast_with_unknown_dims() {
        // unknown vs 1 -> unknown; unknown vs known ≠ 1 -> known; unknown vs unknown -> unknown.
        assert_eq!(
            one("Add", &[tt(F32, &[-1, 1, -1]), tt(F32, &[1, 5, -1])]),
            Ok(tt(F32, &[-1, 5, -1]))
        );
        assert_eq!(
            one("Add", &[tt(F32, &[-1, 10]), tt(F32, &[10])]),
            Ok(tt(F32, &[-1, 10]))
        );
        assert_eq!(
            one("Mul", &[tt(F32, &[4, -1]), tt(F32, &[-1, 1])]),
            Ok(tt(F32, &[4, -1]))
        );
        let unknown_rank = TensorType::new(F32, Shape::unknown());
        assert_eq!(
            one("Add", &[unknown_rank.clone(), tt(F32, &[2])]),
            Ok(unknown_rank)
        );
    }

    #[test]
    fn broadcast_mismatch_names_both_shapes() {
        let e = one("Add", &[tt(F32, &[3, 2]), tt(F32, &[4])]).unwrap_err();
        assert!(
            e.contains("Add") && e.contains("[3, 2]") && e.contains("[4]"),
            "{e}"
        );
        let e = one("Sub", &[tt(F32, &[-1, 3]), tt(F32, &[2, 4])]).unwrap_err();
        assert!(e.contains("[?, 3]") && e.contains("[2, 4]"), "{e}");
    }

    #[test]
    fn binary_dtype_errors() {
        let e = one("Mul", &[tt(F32, &[2]), tt(I32, &[2])]).unwrap_err();
        assert!(e.contains("f32[2]") && e.contains("i32[2]"), "{e}");
        let e = one("Add", &[tt(Bool, &[2]), tt(Bool, &[2])]).unwrap_err();
        assert!(e.contains("numeric") && e.contains("bool"), "{e}");
    }

    #[test]
    fn equal_outputs_bool_and_accepts_bool() {
        assert_eq!(
            one("Equal", &[tt(I64, &[-1]), tt(I64, &[])]),
            Ok(tt(Bool, &[-1]))
        );
        assert_eq!(
            one("Equal", &[tt(Bool, &[3, 1]), tt(Bool, &[1, 4])]),
            Ok(tt(Bool, &[3, 4]))
        );
        assert!(one("Equal", &[tt(I64, &[2]), tt(I32, &[2])]).is_err());
        assert!(one("Equal", &[tt(I64, &[2]), tt(I64, &[3])]).is_err());
    }

    #[test]
    fn neg_and_unary_float() {
        assert_eq!(one("Neg", &[tt(I32, &[-1, 2])]), Ok(tt(I32, &[-1, 2])));
        assert!(one("Neg", &[tt(Bool, &[2])]).is_err());
        for op in ["Square", "Sqrt", "Exp", "Log"] {
            assert_eq!(one(op, &[tt(F32, &[-1, 3])]), Ok(tt(F32, &[-1, 3])));
            let e = one(op, &[tt(I32, &[2])]).unwrap_err();
            assert!(
                e.contains(op) && e.contains("float") && e.contains("i32"),
                "{e}"
            );
        }
    }

    #[test]
    fn mat_mul_shapes() {
        let mm = |a, b, ta: bool, tb: bool| {
            infer(
                "MatMul",
                &[a, b],
                &[("transpose_a", ta.into()), ("transpose_b", tb.into())],
            )
        };
        assert_eq!(
            infer("MatMul", &[tt(F32, &[32, 64]), tt(F32, &[64, 10])], &[]),
            Ok(vec![tt(F32, &[32, 10])])
        );
        assert_eq!(
            mm(tt(F32, &[-1, 784]), tt(F32, &[784, 128]), false, false),
            Ok(vec![tt(F32, &[-1, 128])])
        );
        assert_eq!(
            mm(tt(F32, &[64, 32]), tt(F32, &[10, 64]), true, true),
            Ok(vec![tt(F32, &[32, 10])])
        );
        assert_eq!(
            mm(tt(I64, &[3, -1]), tt(I64, &[5, 7]), false, false),
            Ok(vec![tt(I64, &[3, 7])])
        );
        assert_eq!(
            mm(
                TensorType::new(F32, Shape::unknown()),
                tt(F32, &[5, 7]),
                false,
                false
            ),
            Ok(vec![tt(F32, &[-1, 7])])
        );
    }

    #[test]
    fn mat_mul_errors() {
        assert_eq!(
            infer("MatMul", &[tt(F32, &[32, 64]), tt(F32, &[32, 10])], &[]),
            Err(
                "MatMul inner dimensions differ: a is [32, 64] (transpose_a=false), \
                 b is [32, 10] (transpose_b=false)"
                    .to_string()
            )
        );
        let e = infer("MatMul", &[tt(F32, &[2, 3, 4]), tt(F32, &[4, 5])], &[]).unwrap_err();
        assert!(e.contains("rank 2") && e.contains("[2, 3, 4]"), "{e}");
        let e = infer("MatMul", &[tt(F32, &[2, 3]), tt(F64, &[3, 5])], &[]).unwrap_err();
        assert!(e.contains("f32[2, 3]") && e.contains("f64[3, 5]"), "{e}");
        let e = infer("MatMul", &[tt(Bool, &[2, 3]), tt(Bool, &[3, 5])], &[]).unwrap_err();
        assert!(e.contains("bool"), "{e}");
    }

    #[test]
    fn cast_changes_dtype_only() {
        assert_eq!(
            infer("Cast", &[tt(I64, &[-1, 3])], &[("DstT", F32.into())]),
            Ok(vec![tt(F32, &[-1, 3])])
        );
        assert_eq!(
            infer("Cast", &[tt(F32, &[2])], &[("DstT", Bool.into())]),
            Ok(vec![tt(Bool, &[2])])
        );
        let e = infer("Cast", &[tt(F32, &[2])], &[]).unwrap_err();
        assert!(e.contains("DstT"), "{e}");
    }

    #[test]
    fn add_n_merges_shapes() {
        assert_eq!(
            one(
                "AddN",
                &[tt(F32, &[-1, 3]), tt(F32, &[4, -1]), tt(F32, &[4, 3])]
            ),
            Ok(tt(F32, &[4, 3]))
        );
        assert_eq!(one("AddN", &[tt(F64, &[5])]), Ok(tt(F64, &[5])));
        let e = one("AddN", &[tt(F32, &[2]), tt(F32, &[3])]).unwrap_err();
        assert!(
            e.contains("inputs[1]") && e.contains("[3]") && e.contains("[2]"),
            "{e}"
        );
        let e = one("AddN", &[tt(F32, &[2]), tt(F64, &[2])]).unwrap_err();
        assert!(e.contains("f32[2]") && e.contains("f64[2]"), "{e}");
        assert!(one("AddN", &[]).unwrap_err().contains("at least one"));
        assert!(one("AddN", &[tt(Bool, &[2])]).is_err());
        assert!(registry().get("AddN").is_some_and(OpDef::is_variadic));
    }

    #[test]
    fn mlp_ops_are_registered_and_documented() {
        for name in [
            "Add",
            "Sub",
            "Mul",
            "Div",
            "Neg",
            "MatMul",
            "Cast",
            "Equal",
            "AddN",
            "Square",
            "Sqrt",
            "Exp",
            "Log",
            "BiasAdd",
            "Relu",
            "Sigmoid",
            "Tanh",
            "Softmax",
            "SparseSoftmaxCrossEntropyWithLogits",
            "ReluGrad",
            "SigmoidGrad",
            "TanhGrad",
            "BiasAddGrad",
            "Sum",
            "Mean",
            "Max",
            "ArgMax",
            "Reshape",
            "ZerosLike",
            "OnesLike",
        ] {
            let op = registry()
                .get(name)
                .unwrap_or_else(|| panic!("{name} missing"));
            assert!(
                op.summary.contains("In:") && op.summary.contains("Out"),
                "{name}"
            );
            assert!(!op.stateful && !op.outputs.is_empty(), "{name}");
        }
        assert_eq!(registry().suggest("Matmul"), Some("MatMul"));
    }

    #[test]
    fn broadcast_shapes_is_symmetric() {
        let shapes = [
            Shape::known(&[3, 1]),
            Shape::known(&[1, 4]),
            Shape::scalar(),
            Shape::partial(vec![None, Some(4)]),
            Shape::partial(vec![Some(1), None]),
            Shape::unknown(),
        ];
        for a in &shapes {
            for b in &shapes {
                assert_eq!(broadcast_shapes(a, b), broadcast_shapes(b, a), "{a} {b}");
            }
        }
    }
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]); a module so the block can follow the
/// tests.
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{no_gradient, only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("Add", add_grad);
        r.set_gradient("Sub", sub_grad);
        r.set_gradient("Mul", mul_grad);
        r.set_gradient("Div", div_grad);
        r.set_gradient("Neg", |b, _, dys| {
            Ok(vec![Some(b.unary("Neg", "dx", only_dy(dys)?))])
        });
        r.set_gradient("MatMul", mat_mul_grad);
        r.set_gradient("Cast", cast_grad);
        r.set_gradient("Equal", no_gradient);
        r.set_gradient("AddN", |_, f, dys| {
            let dy = only_dy(dys)?;
            Ok(vec![Some(dy.clone()); f.inputs.len()])
        });
        r.set_gradient("Square", |b, f, dys| {
            let x = f.input(0)?;
            let two_x = b.binary("Add", "two_x", x, x);
            Ok(vec![Some(b.binary("Mul", "dx", only_dy(dys)?, &two_x))])
        });
        r.set_gradient("Sqrt", |b, f, dys| {
            let y = f.output(0);
            let two_y = b.binary("Add", "two_y", &y, &y);
            Ok(vec![Some(b.binary("Div", "dx", only_dy(dys)?, &two_y))])
        });
        r.set_gradient("Exp", |b, f, dys| {
            Ok(vec![Some(b.binary(
                "Mul",
                "dx",
                only_dy(dys)?,
                &f.output(0),
            ))])
        });
        r.set_gradient("Log", |b, f, dys| {
            Ok(vec![Some(b.binary(
                "Div",
                "dx",
                only_dy(dys)?,
                f.input(0)?,
            ))])
        });
    }

    /// Reduces `gx` and `gy` (both of the output's static shape) to the shapes of x and y.
    fn reduce_both(b: &mut GradBuilder, f: &ForwardNode, gx: Output, gy: Output) -> GradResult {
        let shape = f.output_type(0)?.shape.clone();
        Ok(vec![
            Some(b.reduce_to_input(f, 0, gx, &shape, "dx")?),
            Some(b.reduce_to_input(f, 1, gy, &shape, "dy")?),
        ])
    }

    fn add_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        reduce_both(b, f, dy.clone(), dy.clone())
    }

    fn sub_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let neg = b.unary("Neg", "neg_dz", dy);
        reduce_both(b, f, dy.clone(), neg)
    }

    fn mul_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let (x, y) = (f.input(0)?, f.input(1)?);
        let gx = b.binary("Mul", "dz_y", dy, y);
        let gy = b.binary("Mul", "dz_x", dy, x);
        reduce_both(b, f, gx, gy)
    }

    fn div_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        // z = x / y: dz/dx = 1 / y, dz/dy = -x / y² = -z / y.
        let dy = only_dy(dys)?;
        let y = f.input(1)?;
        let gx = b.binary("Div", "dz_over_y", dy, y);
        let neg_z = b.unary("Neg", "neg_z", &f.output(0));
        let dzdy = b.binary("Div", "neg_z_over_y", &neg_z, y);
        let gy = b.binary("Mul", "dz_dzdy", dy, &dzdy);
        reduce_both(b, f, gx, gy)
    }

    fn mat_mul_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let (a, w) = (f.input(0)?, f.input(1)?);
        let (ta, tb) = (f.bool_attr("transpose_a")?, f.bool_attr("transpose_b")?);
        let mut mm = |suffix: &str, x: &Output, y: &Output, tx: bool, ty: bool| {
            b.op(
                "MatMul",
                suffix,
                &[x, y],
                &[
                    ("transpose_a", AttrValue::Bool(tx)),
                    ("transpose_b", AttrValue::Bool(ty)),
                ],
            )
        };
        // TensorFlow's _MatMulGrad, one case per transpose combination.
        let (da, db) = match (ta, tb) {
            (false, false) => (mm("da", dy, w, false, true), mm("db", a, dy, true, false)),
            (false, true) => (mm("da", dy, w, false, false), mm("db", dy, a, true, false)),
            (true, false) => (mm("da", w, dy, false, true), mm("db", a, dy, false, false)),
            (true, true) => (mm("da", w, dy, true, true), mm("db", dy, a, true, true)),
        };
        Ok(vec![Some(da), Some(db)])
    }

    fn cast_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let src = f.input_type(0)?.dtype;
        if !src.is_float() {
            return Ok(vec![None]);
        }
        let dy = only_dy(dys)?;
        Ok(vec![Some(b.op(
            "Cast",
            "dx",
            &[dy],
            &[("DstT", AttrValue::DType(src))],
        ))])
    }
}
