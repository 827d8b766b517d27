//! Arithmetic: Add, Sub, Mul, Div, Neg, MatMul, Cast, Equal, AddN, Square, Sqrt, Exp, Log.
//!
//! Binary elementwise ops broadcast like NumPy and TensorFlow (see [`broadcast_shapes`]).
//! Each op lives in its own delimited block below (declaration + shape rule); kernels and
//! gradients for an op go into the same block.

use super::broadcast::binary_map;
use super::elementwise::{
    attr_bool, attr_dtype, float_unary, from_f32, map_unary, num_binary, same_dtype, slice,
    stateless, to_f32, unsupported, Alloc, FRESH,
};
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit};
use crate::Element;

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
) -> Result<Vec<TensorType>, OpError> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let dtype = require_same(op, ("x", x), ("y", y))?;
    if numeric {
        require_numeric(op, "x", x)?;
    }
    let shape = broadcast_shapes(&x.shape, &y.shape).map_err(|e| format!("{op}: {e}"))?;
    Ok(vec![TensorType::new(out.unwrap_or(dtype), shape)])
}

/// Shape rule of a unary elementwise op on floats: the input type unchanged.
pub(crate) fn unary_float(op: &str, ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
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
    .cpu_kernel(|_| stateless(add_kernel))
}

fn add_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let out0 = ctx.output_alloc(0);
    let z = num_binary!(in &out0; "Add", x, y, float: |a, b| a + b, int: |a, b| a.wrapping_add(b))?;
    ctx.set_output(0, z)
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
    .cpu_kernel(|_| stateless(sub_kernel))
}

fn sub_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let out0 = ctx.output_alloc(0);
    let z = num_binary!(in &out0; "Sub", x, y, float: |a, b| a - b, int: |a, b| a.wrapping_sub(b))?;
    ctx.set_output(0, z)
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
    .cpu_kernel(|_| stateless(mul_kernel))
}

fn mul_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let out0 = ctx.output_alloc(0);
    let z = num_binary!(in &out0; "Mul", x, y, float: |a, b| a * b, int: |a, b| a.wrapping_mul(b))?;
    ctx.set_output(0, z)
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
    .cpu_kernel(|_| stateless(div_kernel))
}

/// Integer division truncates toward zero (like TensorFlow's `Div` and C); a zero divisor is an
/// error, and `MIN / -1` wraps to `MIN`.
fn div_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let zero_divisor = match y.dtype() {
        DType::I32 => slice::<i32>(y)?.contains(&0),
        DType::I64 => slice::<i64>(y)?.contains(&0),
        _ => false,
    };
    if zero_divisor {
        return Err(format!(
            "Div: integer division by zero (divisor y of shape {} contains 0)",
            y.shape()
        )
        .into());
    }
    let out0 = ctx.output_alloc(0);
    let z = num_binary!(in &out0; "Div", x, y, float: |a, b| a / b, int: |a, b| a.wrapping_div(b))?;
    ctx.set_output(0, z)
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
    .cpu_kernel(|_| stateless(neg_kernel))
}

fn neg_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let x = ctx.input(0)?;
    let y = match x.dtype() {
        DType::I32 => map_unary(x, i32::wrapping_neg),
        DType::I64 => map_unary(x, i64::wrapping_neg),
        _ => {
            let out0 = ctx.output_alloc(0);
            float_unary!(in &out0; "Neg", x, |v| -v)
        }
    }?;
    ctx.set_output(0, y)
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
    .cpu_kernel(mat_mul_factory)
}

/// MatMul's kernel: the transpose flags are read once. `f32`/`f64` run on [`super::gemm`]
/// (SIMD, split over the current rayon pool for large products; transposes are stride changes,
/// never copies); `i32`/`i64` use `ndarray`'s generic product with wrapping arithmetic;
/// `bf16`/`f16` compute in `f32`.
#[derive(Debug)]
struct MatMulKernel {
    transpose_a: bool,
    transpose_b: bool,
}

fn mat_mul_factory(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
    Ok(Box::new(MatMulKernel {
        transpose_a: attr_bool(init, "transpose_a")?,
        transpose_b: attr_bool(init, "transpose_b")?,
    }))
}

/// `op(a) · op(b)` into `out` ([m, n]); `a` is [ar, ac] before its optional transpose.
#[allow(clippy::too_many_arguments)]
fn mat_mul_into<T: ndarray::LinalgScalar>(
    a: &[T],
    (ar, ac): (usize, usize),
    ta: bool,
    b: &[T],
    (br, bc): (usize, usize),
    tb: bool,
    out: &mut [T],
    (m, n): (usize, usize),
) -> Result<(), String> {
    use ndarray::{ArrayView2, ArrayViewMut2};
    let err = |e: ndarray::ShapeError| format!("MatMul: {e}");
    let av = ArrayView2::from_shape((ar, ac), a).map_err(err)?;
    let bv = ArrayView2::from_shape((br, bc), b).map_err(err)?;
    let av = if ta { av.reversed_axes() } else { av };
    let bv = if tb { bv.reversed_axes() } else { bv };
    let mut c = ArrayViewMut2::from_shape((m, n), out).map_err(err)?;
    ndarray::linalg::general_mat_mul(T::one(), &av, &bv, T::zero(), &mut c);
    Ok(())
}

fn mat_mul_typed<T: Element + super::gemm::GemmScalar>(
    alloc: Alloc<'_>,
    a: &Tensor,
    b: &Tensor,
    flags: (bool, bool),
    mn: (usize, usize),
) -> Result<Tensor, String> {
    use super::gemm::{matmul, MatView, Threads};
    let (ad, bd) = ((a.dims()[0], a.dims()[1]), (b.dims()[0], b.dims()[1]));
    // The product overwrites `out`, so memory with old values is fine.
    let mut out = alloc.tensor(T::DTYPE, &[mn.0, mn.1])?;
    let o = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    let av = MatView::row_major(slice::<T>(a)?, 0, ad, flags.0);
    let bv = MatView::row_major(slice::<T>(b)?, 0, bd, flags.1);
    matmul(av, bv, o, Threads::Pool).map_err(|e| format!("MatMul: {e}"))?;
    Ok(out)
}

/// Integer product with wrapping arithmetic (overflow never panics).
fn mat_mul_wrapping<T: Element + bytemuck::Pod>(
    a: &Tensor,
    b: &Tensor,
    flags: (bool, bool),
    mn: (usize, usize),
) -> Result<Tensor, String>
where
    std::num::Wrapping<T>: ndarray::LinalgScalar + bytemuck::Pod,
{
    use std::num::Wrapping;
    let (ad, bd) = ((a.dims()[0], a.dims()[1]), (b.dims()[0], b.dims()[1]));
    let wa: &[Wrapping<T>] = bytemuck::cast_slice(slice::<T>(a)?);
    let wb: &[Wrapping<T>] = bytemuck::cast_slice(slice::<T>(b)?);
    let mut out = Tensor::zeros(T::DTYPE, &[mn.0, mn.1]).map_err(|e| e.to_string())?;
    let o: &mut [Wrapping<T>] =
        bytemuck::cast_slice_mut(out.as_mut_slice::<T>().map_err(|e| e.to_string())?);
    mat_mul_into(wa, ad, flags.0, wb, bd, flags.1, o, mn)?;
    Ok(out)
}

impl Kernel for MatMulKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (a, b) = (ctx.input(0)?, ctx.input(1)?);
        let (ta, tb) = (self.transpose_a, self.transpose_b);
        let dtype = same_dtype("MatMul", a, b)?;
        for (name, t) in [("a", a), ("b", b)] {
            if t.rank() != 2 {
                return Err(
                    format!("MatMul: {name} must be rank 2, got shape {}", t.shape()).into(),
                );
            }
        }
        let pick = |t: &Tensor, tr: bool| {
            let d = t.dims();
            if tr {
                (d[1], d[0])
            } else {
                (d[0], d[1])
            }
        };
        let ((m, ka), (kb, n)) = (pick(a, ta), pick(b, tb));
        if ka != kb {
            return Err(format!(
                "MatMul inner dimensions differ: a is {} (transpose_a={ta}), b is {} (transpose_b={tb})",
                a.shape(),
                b.shape()
            ).into());
        }
        let flags = (ta, tb);
        let out0 = ctx.output_alloc(0);
        let out = match dtype {
            DType::F32 => mat_mul_typed::<f32>(&out0, a, b, flags, (m, n)),
            DType::F64 => mat_mul_typed::<f64>(&out0, a, b, flags, (m, n)),
            DType::I32 => mat_mul_wrapping::<i32>(a, b, flags, (m, n)),
            DType::I64 => mat_mul_wrapping::<i64>(a, b, flags, (m, n)),
            DType::BF16 | DType::F16 => {
                let (a32, b32) = (to_f32(a)?, to_f32(b)?);
                from_f32(
                    &mat_mul_typed::<f32>(&FRESH, &a32, &b32, flags, (m, n))?,
                    dtype,
                )
            }
            d => Err(unsupported("MatMul", d)),
        }?;
        ctx.set_output(0, out)
    }
}

fn mat_mul_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let (a, b) = (ctx.input(0)?, ctx.input(1)?);
    let (ta, tb) = (ctx.bool("transpose_a")?, ctx.bool("transpose_b")?);
    let dtype = require_same("MatMul", ("a", a), ("b", b))?;
    if !(dtype.is_float() || dtype.is_int()) {
        return Err(format!("MatMul: a must be a float or int type, got {a}").into());
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
            ).into());
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
    .cpu_kernel(|init| {
        Ok(Box::new(CastKernel {
            dst: attr_dtype(init, "DstT")?,
        }))
    })
}

/// Cast's kernel. Integers (and bools as 0/1) convert through `i64`, floats through `f64`, so
/// every conversion rounds once: float→int truncates toward zero and saturates (NaN → 0),
/// int→int wraps like C, anything→bool is `x != 0` (NaN → true). Same dtype shares the buffer.
#[derive(Debug)]
struct CastKernel {
    dst: DType,
}

fn cast_typed<D: Element>(
    x: &Tensor,
    from_int: impl Fn(i64) -> D,
    from_float: impl Fn(f64) -> D,
) -> Result<Tensor, String> {
    match x.dtype() {
        DType::I32 => map_unary(x, |v: i32| from_int(v.into())),
        DType::I64 => map_unary(x, from_int),
        DType::Bool => map_unary(x, |v: u8| from_int(v.into())),
        DType::F32 => map_unary(x, |v: f32| from_float(v.into())),
        DType::F64 => map_unary(x, from_float),
        DType::BF16 => map_unary(x, |v: half::bf16| from_float(v.to_f64())),
        DType::F16 => map_unary(x, |v: half::f16| from_float(v.to_f64())),
    }
}

impl Kernel for CastKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        if x.dtype() == self.dst {
            let y = x.clone();
            return ctx.set_output(0, y);
        }
        let y = match self.dst {
            DType::F32 => cast_typed(x, |i| i as f32, |f| f as f32),
            DType::F64 => cast_typed(x, |i| i as f64, |f| f),
            DType::I32 => cast_typed(x, |i| i as i32, |f| f as i32),
            DType::I64 => cast_typed(x, |i| i, |f| f as i64),
            DType::Bool => cast_typed(x, |i| u8::from(i != 0), |f| u8::from(f != 0.0)),
            DType::BF16 => cast_typed(x, |i| half::bf16::from_f64(i as f64), half::bf16::from_f64),
            DType::F16 => cast_typed(x, |i| half::f16::from_f64(i as f64), half::f16::from_f64),
        }?;
        ctx.set_output(0, y)
    }
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
    .cpu_kernel(|_| stateless(equal_kernel))
}

/// Equal compares values: `bf16`/`f16` compare after widening (so `-0 == 0` and NaN ≠ NaN).
fn equal_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    fn eq<T: Element + PartialEq>(x: &Tensor, y: &Tensor) -> Result<Tensor, String> {
        binary_map(x, y, |a: T, b: T| u8::from(a == b))
    }
    let z = match same_dtype("Equal", x, y)? {
        DType::F32 => eq::<f32>(x, y),
        DType::F64 => eq::<f64>(x, y),
        DType::I32 => eq::<i32>(x, y),
        DType::I64 => eq::<i64>(x, y),
        DType::Bool => eq::<u8>(x, y),
        DType::BF16 | DType::F16 => eq::<f32>(&to_f32(x)?, &to_f32(y)?),
    }?;
    ctx.set_output(0, z)
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
    .cpu_kernel(|_| stateless(add_n_kernel))
}

/// AddN: all inputs must share dtype and runtime shape; one input passes through (shared buffer).
fn add_n_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let first = ctx.input(0)?;
    for (i, t) in ctx.inputs.iter().enumerate().skip(1) {
        if t.dtype() != first.dtype() || t.dims() != first.dims() {
            return Err(format!(
                "AddN: inputs[{i}] is {}{} but inputs[0] is {}{}; all inputs must match",
                t.dtype(),
                t.shape(),
                first.dtype(),
                first.shape()
            )
            .into());
        }
    }
    /// The sum of two or more inputs, written into memory from `alloc`.
    fn sum<T: Element>(
        alloc: Alloc<'_>,
        inputs: &[&Tensor],
        add: impl Fn(T, T) -> T,
    ) -> Result<Tensor, String> {
        let mut out = alloc.tensor(T::DTYPE, inputs[0].dims())?;
        let acc = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
        acc.copy_from_slice(slice::<T>(inputs[0])?);
        for t in &inputs[1..] {
            for (o, &v) in acc.iter_mut().zip(slice::<T>(t)?) {
                *o = add(*o, v);
            }
        }
        Ok(out)
    }
    let inputs = ctx.inputs;
    let out0 = ctx.output_alloc(0);
    let out = match first.dtype() {
        _ if inputs.len() == 1 => Ok(first.clone()),
        DType::F32 => sum::<f32>(&out0, inputs, |a, b| a + b),
        DType::F64 => sum::<f64>(&out0, inputs, |a, b| a + b),
        DType::I32 => sum::<i32>(&out0, inputs, i32::wrapping_add),
        DType::I64 => sum::<i64>(&out0, inputs, i64::wrapping_add),
        d @ (DType::BF16 | DType::F16) => {
            let wide = inputs
                .iter()
                .map(|t| to_f32(t))
                .collect::<Result<Vec<_>, _>>()?;
            let wide: Vec<&Tensor> = wide.iter().collect();
            from_f32(&sum::<f32>(&FRESH, &wide, |a, b| a + b)?, d)
        }
        d => Err(unsupported("AddN", d)),
    }?;
    ctx.set_output(0, out)
}

fn add_n_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
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
            ).into());
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
    .cpu_kernel(|_| stateless(square_kernel))
}

fn square_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let out0 = ctx.output_alloc(0);
    let y = float_unary!(in &out0; "Square", ctx.input(0)?, |v| v * v)?;
    ctx.set_output(0, y)
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
    .cpu_kernel(|_| stateless(sqrt_kernel))
}

fn sqrt_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let out0 = ctx.output_alloc(0);
    let y = float_unary!(in &out0; "Sqrt", ctx.input(0)?, |v| v.sqrt())?;
    ctx.set_output(0, y)
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
    .cpu_kernel(|_| stateless(exp_kernel))
}

fn exp_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let out0 = ctx.output_alloc(0);
    let y = float_unary!(in &out0; "Exp", ctx.input(0)?, |v| v.exp())?;
    ctx.set_output(0, y)
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
    .cpu_kernel(|_| stateless(log_kernel))
}

fn log_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let out0 = ctx.output_alloc(0);
    let y = float_unary!(in &out0; "Log", ctx.input(0)?, |v| v.ln())?;
    ctx.set_output(0, y)
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
) -> Result<Vec<TensorType>, OpError> {
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
            Err(OpError::Invalid(
                "MatMul inner dimensions differ: a is [32, 64] (transpose_a=false), \
                 b is [32, 10] (transpose_b=false)"
                    .to_string()
            ))
        );
        let e = infer("MatMul", &[tt(F32, &[2, 3, 4]), tt(F32, &[4, 5])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("rank 2") && e.to_string().contains("[2, 3, 4]"),
            "{e}"
        );
        let e = infer("MatMul", &[tt(F32, &[2, 3]), tt(F64, &[3, 5])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("f32[2, 3]") && e.to_string().contains("f64[3, 5]"),
            "{e}"
        );
        let e = infer("MatMul", &[tt(Bool, &[2, 3]), tt(Bool, &[3, 5])], &[]).unwrap_err();
        assert!(e.to_string().contains("bool"), "{e}");
    }

    #[test]
    fn shape_rules_report_what_is_wrong_as_typed_errors() {
        assert_eq!(
            infer("MatMul", &[tt(F32, &[2, 3])], &[]),
            Err(OpError::MissingInput { index: 1 })
        );
        let wrong_attr = infer(
            "MatMul",
            &[tt(F32, &[2, 3]), tt(F32, &[3, 5])],
            &[("transpose_a", AttrValue::Int(1))],
        );
        assert_eq!(
            wrong_attr,
            Err(OpError::AttrType {
                name: "transpose_a".into(),
                found: crate::AttrType::Int,
                expected: "bool",
            })
        );
        assert_eq!(
            infer(
                "BatchMatMul",
                &[tt(I32, &[2, 2, 2]), tt(I32, &[2, 2, 2])],
                &[]
            ),
            Err(OpError::NotFloat {
                what: "BatchMatMul: x".into(),
                got: I32
            })
        );
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
        assert!(e.to_string().contains("DstT"), "{e}");
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
