//! Neural-network ops: BiasAdd, Relu, Sigmoid, Tanh, Softmax (optionally causal),
//! SparseSoftmaxCrossEntropyWithLogits, and the gradient helpers autodiff emits: ReluGrad,
//! SigmoidGrad, TanhGrad, BiasAddGrad, SoftmaxGrad.
//!
//! Only the NHWC layout exists (the channel/bias dimension is the last one), so TensorFlow's
//! `data_format` attribute is not declared. Each op lives in its own delimited block below.

use super::elementwise::{
    attr_bool, float_unary, from_f32, new_tensor, num_binary, rows_per_task, same_shape, slice,
    stateless, to_f32, unsupported, Real,
};
use super::math::{require_numeric, require_same, unary_float};
use super::*;
use crate::kernel::KernelContext;
use crate::Element;
use rayon::prelude::*;

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(bias_add());
    r.add(relu());
    r.add(sigmoid());
    r.add(tanh());
    r.add(softmax());
    r.add(softmax_grad());
    r.add(sparse_softmax_cross_entropy_with_logits());
    r.add(relu_grad());
    r.add(sigmoid_grad());
    r.add(tanh_grad());
    r.add(bias_add_grad());
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// Requires rank ≥ `min` when the rank is known.
fn require_min_rank(op: &str, what: &str, t: &TensorType, min: usize) -> Result<(), String> {
    match t.shape.rank() {
        Some(r) if r < min => Err(format!(
            "{op}: {what} must have rank >= {min}, got shape {}",
            t.shape
        )),
        _ => Ok(()),
    }
}

/// Requires exactly rank `n` when the rank is known.
fn require_rank(op: &str, what: &str, t: &TensorType, n: usize) -> Result<(), String> {
    match t.shape.rank() {
        Some(r) if r != n => Err(format!(
            "{op}: {what} must have rank {n}, got shape {}",
            t.shape
        )),
        _ => Ok(()),
    }
}

/// Shape rule of an elementwise gradient `(a, b) -> out`: same float dtype, same shape (merged).
fn grad_pair(
    op: &str,
    names: (&str, &str),
    ctx: &InferCtx<'_>,
) -> Result<Vec<TensorType>, OpError> {
    let (a, b) = (ctx.input(0)?, ctx.input(1)?);
    let dtype = require_same(op, (names.0, a), (names.1, b))?;
    require_float(&format!("{op}: {}", names.0), a)?;
    let shape = a.shape.merge(&b.shape).ok_or_else(|| {
        format!(
            "{op}: {} has shape {} but {} has shape {}; they must match",
            names.0, a.shape, names.1, b.shape
        )
    })?;
    Ok(vec![TensorType::new(dtype, shape)])
}

// ---------------------------------------------------------------------------------------------
// BiasAdd
// ---------------------------------------------------------------------------------------------

fn bias_add() -> OpDef {
    OpDef::new(
        "BiasAdd",
        "output = value + bias, bias added along the last dimension. In: value (rank >= 2, \
         numeric), bias (rank 1, same dtype, length = last dim of value). Out: output, shape of value.",
        bias_add_infer,
    )
    .inputs([arg("value"), arg("bias")])
    .outputs([arg("output")])
    .cpu_kernel(|_| stateless(bias_add_kernel))
}

fn bias_add_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (value, bias) = (ctx.input(0)?, ctx.input(1)?);
    if value.rank() < 2 || bias.rank() != 1 || value.dims().last() != bias.dims().first() {
        return Err(format!(
            "BiasAdd: bias {} must be rank 1 and match the last dimension of value {} (rank >= 2)",
            bias.shape(),
            value.shape()
        )
        .into());
    }
    let out0 = ctx.output_alloc(0);
    let out = num_binary!(in &out0; "BiasAdd", value, bias, float: |a, b| a + b, int: |a, b| a.wrapping_add(b))?;
    ctx.set_output(0, out)
}

fn bias_add_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let (value, bias) = (ctx.input(0)?, ctx.input(1)?);
    let dtype = require_same("BiasAdd", ("value", value), ("bias", bias))?;
    require_numeric("BiasAdd", "value", value)?;
    require_min_rank("BiasAdd", "value", value, 2)?;
    require_rank("BiasAdd", "bias", bias, 1)?;
    let Some(dims) = value.shape.dims() else {
        return Ok(vec![value.clone()]);
    };
    let mut dims = dims.to_vec();
    if let Some(last) = dims.last_mut() {
        match (*last, bias.shape.dim(0)) {
            (Some(c), Some(b)) if c != b => {
                return Err(format!(
                    "BiasAdd: bias {} does not match the last dimension of value {}",
                    bias.shape, value.shape
                )
                .into())
            }
            (None, b) => *last = b,
            _ => {}
        }
    }
    Ok(vec![TensorType::new(dtype, Shape::partial(dims))])
}

// ---------------------------------------------------------------------------------------------
// Relu
// ---------------------------------------------------------------------------------------------

fn relu() -> OpDef {
    OpDef::new(
        "Relu",
        "activations = max(features, 0) elementwise. In: features (float). Out: activations, same type.",
        |ctx| unary_float("Relu", ctx),
    )
    .inputs([arg("features")])
    .outputs([arg("activations")])
    .cpu_kernel(|_| stateless(relu_kernel))
}

fn relu_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let y = float_unary!("Relu", ctx.input(0)?, |v| if v < 0.0 { 0.0 } else { v })?;
    ctx.set_output(0, y)
}

// ---------------------------------------------------------------------------------------------
// Sigmoid
// ---------------------------------------------------------------------------------------------

fn sigmoid() -> OpDef {
    OpDef::new(
        "Sigmoid",
        "y = 1 / (1 + e^-x) elementwise. In: x (float). Out: y, same type.",
        |ctx| unary_float("Sigmoid", ctx),
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .cpu_kernel(|_| stateless(sigmoid_kernel))
}

fn sigmoid_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let y = float_unary!("Sigmoid", ctx.input(0)?, |v| 1.0 / (1.0 + (-v).exp()))?;
    ctx.set_output(0, y)
}

// ---------------------------------------------------------------------------------------------
// Tanh
// ---------------------------------------------------------------------------------------------

fn tanh() -> OpDef {
    OpDef::new(
        "Tanh",
        "y = tanh(x) elementwise. In: x (float). Out: y, same type.",
        |ctx| unary_float("Tanh", ctx),
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .cpu_kernel(|_| stateless(tanh_kernel))
}

fn tanh_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let y = float_unary!("Tanh", ctx.input(0)?, |v| v.tanh())?;
    ctx.set_output(0, y)
}

// ---------------------------------------------------------------------------------------------
// Softmax
// ---------------------------------------------------------------------------------------------

fn softmax() -> OpDef {
    OpDef::new(
        "Softmax",
        "softmax = exp(logits) / sum(exp(logits)) over the last dimension. In: logits (rank >= 1, \
         float; rank >= 2 when causal). Out: softmax, same type. Attrs: causal (bool, default \
         false): over the last two dims [.., T, S], element (i, j) with j > i + (S - T) is \
         excluded (probability exactly 0; a row with nothing left is all 0).",
        |ctx| {
            let logits = ctx.input(0)?;
            require_float("Softmax: logits", logits)?;
            let causal = ctx.bool("causal")?;
            require_min_rank("Softmax", "logits", logits, if causal { 2 } else { 1 })?;
            Ok(vec![logits.clone()])
        },
    )
    .inputs([arg("logits")])
    .outputs([arg("softmax")])
    .attrs([attr_or("causal", AttrType::Bool, AttrDefault::Bool(false))])
    .cpu_kernel(|init| {
        Ok(Box::new(SoftmaxKernel {
            causal: attr_bool(init, "causal")?,
        }))
    })
}

#[derive(Debug)]
struct SoftmaxKernel {
    causal: bool,
}

/// Softmax over the last axis, stable: each row is shifted by its maximum before `exp`. With
/// `causal`, row r of a [.., T, S] input sees only its first `(r mod T) + 1 + S − T` entries
/// (clamped to [0, S]); the rest are 0.
fn softmax_rows<T: Real>(x: &Tensor, causal: bool) -> Result<Tensor, String> {
    let dims = x.dims();
    let c = dims.last().copied().unwrap_or(0);
    let t = if causal { dims[dims.len() - 2] } else { 0 };
    let xs = slice::<T>(x)?;
    let per = rows_per_task(c);
    new_tensor(x.dims(), |out: &mut [T]| {
        if c == 0 {
            return;
        }
        out.par_chunks_mut(per * c)
            .zip(xs.par_chunks(per * c))
            .enumerate()
            .for_each(|(task, (out, xs))| {
                for (k, (o, r)) in out.chunks_mut(c).zip(xs.chunks(c)).enumerate() {
                    let row = task * per + k;
                    let visible = if causal {
                        // j <= i + (S - T)  <=>  j < i + 1 + S - T.
                        ((row % t) + 1 + c).saturating_sub(t).min(c)
                    } else {
                        c
                    };
                    let (o, r) = (&mut o[..visible], &r[..visible]);
                    let m = r
                        .iter()
                        .fold(T::NEG_INFINITY, |m, &v| if v > m { v } else { m });
                    let mut s = T::ZERO;
                    for (o, &v) in o.iter_mut().zip(r) {
                        *o = (v - m).exp();
                        s = s + *o;
                    }
                    for o in o.iter_mut() {
                        *o = *o / s;
                    }
                }
            });
    })
}

impl crate::kernel::Kernel for SoftmaxKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let min_rank = if self.causal { 2 } else { 1 };
        if x.rank() < min_rank {
            return Err(format!(
                "Softmax: logits must have rank >= {min_rank}, got shape {}",
                x.shape()
            )
            .into());
        }
        let causal = self.causal;
        let y = match x.dtype() {
            DType::F32 => softmax_rows::<f32>(x, causal),
            DType::F64 => softmax_rows::<f64>(x, causal),
            d @ (DType::BF16 | DType::F16) => {
                from_f32(&softmax_rows::<f32>(&to_f32(x)?, causal)?, d)
            }
            d => Err(unsupported("Softmax", d)),
        }?;
        ctx.set_output(0, y)
    }
}

// ---------------------------------------------------------------------------------------------
// SoftmaxGrad
// ---------------------------------------------------------------------------------------------

fn softmax_grad() -> OpDef {
    OpDef::new(
        "SoftmaxGrad",
        "dx = y * (dy - sum(dy * y, last axis)), the gradient of Softmax given its output y \
         (masked entries of a causal softmax have y = 0 and get 0). In: dy, y (same float dtype \
         and shape). Out: dx.",
        |ctx| grad_pair("SoftmaxGrad", ("dy", "y"), ctx),
    )
    .inputs([arg("dy"), arg("y")])
    .outputs([arg("dx")])
    .cpu_kernel(|_| stateless(softmax_grad_kernel))
}

fn softmax_grad_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (dy, y) = (ctx.input(0)?, ctx.input(1)?);
    same_shape("SoftmaxGrad", ("dy", dy), ("y", y))?;
    if dy.dtype() != y.dtype() || y.rank() == 0 {
        return Err(format!(
            "SoftmaxGrad: dy {}{} and y {}{} must share a float dtype and have rank >= 1",
            dy.dtype(),
            dy.shape(),
            y.dtype(),
            y.shape()
        )
        .into());
    }
    fn rows<T: Real>(dy: &Tensor, y: &Tensor) -> Result<Tensor, String> {
        let c = y.dims().last().copied().unwrap_or(0);
        let (ds, ys) = (slice::<T>(dy)?, slice::<T>(y)?);
        let n = rows_per_task(c) * c.max(1);
        new_tensor(y.dims(), |out: &mut [T]| {
            if c == 0 {
                return;
            }
            out.par_chunks_mut(n)
                .zip(ds.par_chunks(n))
                .zip(ys.par_chunks(n))
                .for_each(|((out, ds), ys)| {
                    for ((o, d), yr) in out.chunks_mut(c).zip(ds.chunks(c)).zip(ys.chunks(c)) {
                        let s = d.iter().zip(yr).fold(T::ZERO, |s, (&a, &b)| s + a * b);
                        for ((o, &a), &b) in o.iter_mut().zip(d).zip(yr) {
                            *o = b * (a - s);
                        }
                    }
                });
        })
    }
    let dx = match y.dtype() {
        DType::F32 => rows::<f32>(dy, y),
        DType::F64 => rows::<f64>(dy, y),
        d @ (DType::BF16 | DType::F16) => from_f32(&rows::<f32>(&to_f32(dy)?, &to_f32(y)?)?, d),
        d => Err(unsupported("SoftmaxGrad", d)),
    }?;
    ctx.set_output(0, dx)
}

// ---------------------------------------------------------------------------------------------
// SparseSoftmaxCrossEntropyWithLogits
// ---------------------------------------------------------------------------------------------

fn sparse_softmax_cross_entropy_with_logits() -> OpDef {
    OpDef::new(
        "SparseSoftmaxCrossEntropyWithLogits",
        "Per-example softmax cross-entropy against integer class labels. In: features \
         [batch, classes] (float), labels [batch] (i32 or i64, each in [0, classes)). \
         Out: loss [batch], backprop [batch, classes] (d loss / d features), both of features' dtype.",
        sparse_xent_infer,
    )
    .inputs([arg("features"), arg("labels")])
    .outputs([arg("loss"), arg("backprop")])
    .cpu_kernel(|_| stateless(sparse_xent_kernel))
}

/// TensorFlow semantics: `loss[i] = logsumexp(features[i]) - features[i, labels[i]]` and
/// `backprop[i] = softmax(features[i]) - onehot(labels[i])`, computed stably (shifted by the row
/// maximum). A label outside `[0, classes)` is an error naming the label and its row.
fn sparse_xent_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    const OP: &str = "SparseSoftmaxCrossEntropyWithLogits";
    let (features, labels) = (ctx.input(0)?, ctx.input(1)?);
    if features.rank() != 2 || labels.rank() != 1 || features.dims()[0] != labels.dims()[0] {
        return Err(format!(
            "{OP}: features must be [batch, classes] and labels [batch], got features {} and labels {}",
            features.shape(),
            labels.shape()
        ).into());
    }
    let classes = features.dims()[1];
    let labels: Vec<i64> = match labels.dtype() {
        DType::I32 => slice::<i32>(labels)?.iter().map(|&l| l.into()).collect(),
        DType::I64 => slice::<i64>(labels)?.to_vec(),
        d => return Err(format!("{OP}: labels must be i32 or i64, got {d}").into()),
    };
    let mut rows = Vec::with_capacity(labels.len());
    for (row, &l) in labels.iter().enumerate() {
        match usize::try_from(l) {
            Ok(k) if k < classes => rows.push(k),
            _ => {
                return Err(
                    format!("{OP}: label {l} at row {row} is out of range [0, {classes})").into(),
                )
            }
        }
    }
    fn xent<T: Real>(f: &Tensor, labels: &[usize], c: usize) -> Result<(Tensor, Tensor), String> {
        let fs = slice::<T>(f)?;
        let mut losses = vec![T::ZERO; labels.len()];
        let backprop = new_tensor(f.dims(), |bp: &mut [T]| {
            if c == 0 {
                return;
            }
            for (((b, r), &k), loss) in bp
                .chunks_mut(c)
                .zip(fs.chunks(c))
                .zip(labels)
                .zip(&mut losses)
            {
                let m = r
                    .iter()
                    .fold(T::NEG_INFINITY, |m, &v| if v > m { v } else { m });
                let mut s = T::ZERO;
                for (b, &v) in b.iter_mut().zip(r) {
                    *b = (v - m).exp();
                    s = s + *b;
                }
                for b in b.iter_mut() {
                    *b = *b / s;
                }
                b[k] = b[k] - T::ONE;
                *loss = s.ln() - (r[k] - m);
            }
        })?;
        let loss = Tensor::from_slice(&[labels.len()], &losses).map_err(|e| e.to_string())?;
        Ok((loss, backprop))
    }
    let (loss, backprop) = match features.dtype() {
        DType::F32 => xent::<f32>(features, &rows, classes),
        DType::F64 => xent::<f64>(features, &rows, classes),
        d @ (DType::BF16 | DType::F16) => {
            let (l, b) = xent::<f32>(&to_f32(features)?, &rows, classes)?;
            Ok((from_f32(&l, d)?, from_f32(&b, d)?))
        }
        d => Err(unsupported(OP, d)),
    }?;
    ctx.set_output(0, loss)?;
    ctx.set_output(1, backprop)
}

fn sparse_xent_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    const OP: &str = "SparseSoftmaxCrossEntropyWithLogits";
    let (features, labels) = (ctx.input(0)?, ctx.input(1)?);
    require_float(&format!("{OP}: features"), features)?;
    if !labels.dtype.is_int() {
        return Err(format!("{OP}: labels must be i32 or i64, got {labels}").into());
    }
    require_rank(OP, "features", features, 2)?;
    require_rank(OP, "labels", labels, 1)?;
    let (batch, classes) = (features.shape.dim(0), features.shape.dim(1));
    let batch = match (batch, labels.shape.dim(0)) {
        (Some(f), Some(l)) if f != l => {
            return Err(format!(
                "{OP}: features {} and labels {} disagree on the batch size",
                features.shape, labels.shape
            )
            .into())
        }
        (f, l) => f.or(l),
    };
    Ok(vec![
        TensorType::new(features.dtype, Shape::partial(vec![batch])),
        TensorType::new(features.dtype, Shape::partial(vec![batch, classes])),
    ])
}

// ---------------------------------------------------------------------------------------------
// ReluGrad
// ---------------------------------------------------------------------------------------------

fn relu_grad() -> OpDef {
    OpDef::new(
        "ReluGrad",
        "backprops = gradients where features > 0, else 0. In: gradients, features (same float \
         dtype and shape). Out: backprops.",
        |ctx| grad_pair("ReluGrad", ("gradients", "features"), ctx),
    )
    .inputs([arg("gradients"), arg("features")])
    .outputs([arg("backprops")])
    .cpu_kernel(|_| stateless(relu_grad_kernel))
}

fn relu_grad_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (g, f) = (ctx.input(0)?, ctx.input(1)?);
    same_shape("ReluGrad", ("gradients", g), ("features", f))?;
    let z = num_binary!("ReluGrad", g, f, float: |g, f| if f > 0.0 { g } else { 0.0 }, int: none)?;
    ctx.set_output(0, z)
}

// ---------------------------------------------------------------------------------------------
// SigmoidGrad
// ---------------------------------------------------------------------------------------------

fn sigmoid_grad() -> OpDef {
    OpDef::new(
        "SigmoidGrad",
        "z = dy * y * (1 - y), the gradient of Sigmoid given its output y. In: y, dy (same float \
         dtype and shape). Out: z.",
        |ctx| grad_pair("SigmoidGrad", ("y", "dy"), ctx),
    )
    .inputs([arg("y"), arg("dy")])
    .outputs([arg("z")])
    .cpu_kernel(|_| stateless(sigmoid_grad_kernel))
}

fn sigmoid_grad_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (y, dy) = (ctx.input(0)?, ctx.input(1)?);
    same_shape("SigmoidGrad", ("y", y), ("dy", dy))?;
    let z = num_binary!("SigmoidGrad", y, dy, float: |y, dy| dy * y * (1.0 - y), int: none)?;
    ctx.set_output(0, z)
}

// ---------------------------------------------------------------------------------------------
// TanhGrad
// ---------------------------------------------------------------------------------------------

fn tanh_grad() -> OpDef {
    OpDef::new(
        "TanhGrad",
        "z = dy * (1 - y²), the gradient of Tanh given its output y. In: y, dy (same float dtype \
         and shape). Out: z.",
        |ctx| grad_pair("TanhGrad", ("y", "dy"), ctx),
    )
    .inputs([arg("y"), arg("dy")])
    .outputs([arg("z")])
    .cpu_kernel(|_| stateless(tanh_grad_kernel))
}

fn tanh_grad_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (y, dy) = (ctx.input(0)?, ctx.input(1)?);
    same_shape("TanhGrad", ("y", y), ("dy", dy))?;
    let z = num_binary!("TanhGrad", y, dy, float: |y, dy| dy * (1.0 - y * y), int: none)?;
    ctx.set_output(0, z)
}

// ---------------------------------------------------------------------------------------------
// BiasAddGrad
// ---------------------------------------------------------------------------------------------

fn bias_add_grad() -> OpDef {
    OpDef::new(
        "BiasAddGrad",
        "output = out_backprop summed over every dimension but the last (the gradient of BiasAdd \
         w.r.t. bias). In: out_backprop (rank >= 2, numeric). Out: output [last dim].",
        |ctx| {
            let g = ctx.input(0)?;
            require_numeric("BiasAddGrad", "out_backprop", g)?;
            require_min_rank("BiasAddGrad", "out_backprop", g, 2)?;
            let last = g.shape.dims().and_then(|d| d.last().copied().flatten());
            Ok(vec![TensorType::new(g.dtype, Shape::partial(vec![last]))])
        },
    )
    .inputs([arg("out_backprop")])
    .outputs([arg("output")])
    .cpu_kernel(|_| stateless(bias_add_grad_kernel))
}

fn bias_add_grad_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let g = ctx.input(0)?;
    let c = match g.dims() {
        [_, .., c] => *c,
        _ => {
            return Err(format!(
                "BiasAddGrad: out_backprop must have rank >= 2, got shape {}",
                g.shape()
            )
            .into())
        }
    };
    fn sum_rows<T: Element>(
        g: &Tensor,
        c: usize,
        add: impl Fn(T, T) -> T,
    ) -> Result<Tensor, String> {
        let gs = slice::<T>(g)?;
        new_tensor(&[c], |out: &mut [T]| {
            if c == 0 {
                return;
            }
            for row in gs.chunks(c) {
                for (o, &v) in out.iter_mut().zip(row) {
                    *o = add(*o, v);
                }
            }
        })
    }
    let out = match g.dtype() {
        DType::F32 => sum_rows::<f32>(g, c, |a, b| a + b),
        DType::F64 => sum_rows::<f64>(g, c, |a, b| a + b),
        DType::I32 => sum_rows::<i32>(g, c, i32::wrapping_add),
        DType::I64 => sum_rows::<i64>(g, c, i64::wrapping_add),
        d @ (DType::BF16 | DType::F16) => {
            from_f32(&sum_rows::<f32>(&to_f32(g)?, c, |a, b| a + b)?, d)
        }
        d => Err(unsupported("BiasAddGrad", d)),
    }?;
    ctx.set_output(0, out)
}

#[cfg(test)]
mod tests {
    use super::super::math::{infer, tt};
    use super::*;
    use DType::*;

    #[test]
    fn bias_add() {
        assert_eq!(
            infer("BiasAdd", &[tt(F32, &[32, 10]), tt(F32, &[10])], &[]),
            Ok(vec![tt(F32, &[32, 10])])
        );
        // The bias fills in an unknown channel dimension.
        assert_eq!(
            infer("BiasAdd", &[tt(F32, &[-1, 2, -1]), tt(F32, &[7])], &[]),
            Ok(vec![tt(F32, &[-1, 2, 7])])
        );
        assert_eq!(
            infer("BiasAdd", &[tt(F32, &[-1, 10]), tt(F32, &[-1])], &[]),
            Ok(vec![tt(F32, &[-1, 10])])
        );
        let unknown = TensorType::new(F32, Shape::unknown());
        assert_eq!(
            infer("BiasAdd", &[unknown.clone(), tt(F32, &[3])], &[]),
            Ok(vec![unknown])
        );
    }

    #[test]
    fn bias_add_errors() {
        let e = infer("BiasAdd", &[tt(F32, &[32, 10]), tt(F32, &[9])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("[9]") && e.to_string().contains("[32, 10]"),
            "{e}"
        );
        let e = infer("BiasAdd", &[tt(F32, &[10]), tt(F32, &[10])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("rank >= 2") && e.to_string().contains("[10]"),
            "{e}"
        );
        let e = infer("BiasAdd", &[tt(F32, &[2, 10]), tt(F32, &[1, 10])], &[]).unwrap_err();
        assert!(e.to_string().contains("bias must have rank 1"), "{e}");
        let e = infer("BiasAdd", &[tt(F32, &[2, 10]), tt(F64, &[10])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("f32[2, 10]") && e.to_string().contains("f64[10]"),
            "{e}"
        );
    }

    #[test]
    fn activations() {
        for op in ["Relu", "Sigmoid", "Tanh", "Softmax"] {
            assert_eq!(
                infer(op, &[tt(F32, &[-1, 10])], &[]),
                Ok(vec![tt(F32, &[-1, 10])])
            );
            let e = infer(op, &[tt(I32, &[2])], &[]).unwrap_err();
            assert!(
                e.to_string().contains(op) && e.to_string().contains("i32"),
                "{e}"
            );
        }
        let e = infer("Softmax", &[tt(F32, &[])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("rank >= 1") && e.to_string().contains("[]"),
            "{e}"
        );
    }

    #[test]
    fn sparse_xent() {
        const OP: &str = "SparseSoftmaxCrossEntropyWithLogits";
        assert_eq!(
            infer(OP, &[tt(F32, &[32, 10]), tt(I64, &[32])], &[]),
            Ok(vec![tt(F32, &[32]), tt(F32, &[32, 10])])
        );
        // The batch size can come from either input.
        assert_eq!(
            infer(OP, &[tt(F32, &[-1, 10]), tt(I32, &[8])], &[]),
            Ok(vec![tt(F32, &[8]), tt(F32, &[8, 10])])
        );
        assert_eq!(
            infer(
                OP,
                &[TensorType::new(F64, Shape::unknown()), tt(I32, &[-1])],
                &[]
            ),
            Ok(vec![tt(F64, &[-1]), tt(F64, &[-1, -1])])
        );
        let e = infer(OP, &[tt(F32, &[32, 10]), tt(I64, &[16])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("[32, 10]") && e.to_string().contains("[16]"),
            "{e}"
        );
        let e = infer(OP, &[tt(F32, &[32, 10]), tt(F32, &[32])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("labels") && e.to_string().contains("f32[32]"),
            "{e}"
        );
        let e = infer(OP, &[tt(I32, &[32, 10]), tt(I32, &[32])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("features") && e.to_string().contains("i32"),
            "{e}"
        );
        let e = infer(OP, &[tt(F32, &[32]), tt(I32, &[32])], &[]).unwrap_err();
        assert!(e.to_string().contains("features must have rank 2"), "{e}");
        let e = infer(OP, &[tt(F32, &[32, 10]), tt(I32, &[32, 1])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("labels must have rank 1") && e.to_string().contains("[32, 1]"),
            "{e}"
        );
    }

    #[test]
    fn elementwise_grads() {
        for (op, a, b) in [
            ("ReluGrad", "gradients", "features"),
            ("SigmoidGrad", "y", "dy"),
            ("TanhGrad", "y", "dy"),
        ] {
            assert_eq!(
                infer(op, &[tt(F32, &[-1, 10]), tt(F32, &[4, -1])], &[]),
                Ok(vec![tt(F32, &[4, 10])])
            );
            let e = infer(op, &[tt(F32, &[4, 10]), tt(F32, &[4, 9])], &[]).unwrap_err();
            assert!(
                e.to_string().contains(a)
                    && e.to_string().contains(b)
                    && e.to_string().contains("[4, 9]"),
                "{e}"
            );
            let e = infer(op, &[tt(F32, &[4]), tt(F64, &[4])], &[]).unwrap_err();
            assert!(
                e.to_string().contains("f32[4]") && e.to_string().contains("f64[4]"),
                "{e}"
            );
            assert!(infer(op, &[tt(I32, &[4]), tt(I32, &[4])], &[]).is_err());
        }
    }

    #[test]
    fn bias_add_grad() {
        assert_eq!(
            infer("BiasAddGrad", &[tt(F32, &[-1, 10])], &[]),
            Ok(vec![tt(F32, &[10])])
        );
        assert_eq!(
            infer(
                "BiasAddGrad",
                &[TensorType::new(F32, Shape::unknown())],
                &[]
            ),
            Ok(vec![tt(F32, &[-1])])
        );
        let e = infer("BiasAddGrad", &[tt(F32, &[10])], &[]).unwrap_err();
        assert!(
            e.to_string().contains("rank >= 2") && e.to_string().contains("[10]"),
            "{e}"
        );
    }
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]); a module so the block can follow the
/// tests.
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    /// Second derivatives are not supported: ReluGrad, SigmoidGrad, TanhGrad and BiasAddGrad get no
    /// gradient.
    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("BiasAdd", |b, _, dys| {
            let dy = only_dy(dys)?;
            Ok(vec![
                Some(dy.clone()),
                Some(b.unary("BiasAddGrad", "dbias", dy)),
            ])
        });
        r.set_gradient("Relu", |b, f, dys| {
            Ok(vec![Some(b.binary(
                "ReluGrad",
                "dx",
                only_dy(dys)?,
                f.input(0)?,
            ))])
        });
        r.set_gradient("Sigmoid", |b, f, dys| {
            Ok(vec![Some(b.binary(
                "SigmoidGrad",
                "dx",
                &f.output(0),
                only_dy(dys)?,
            ))])
        });
        r.set_gradient("Tanh", |b, f, dys| {
            Ok(vec![Some(b.binary(
                "TanhGrad",
                "dx",
                &f.output(0),
                only_dy(dys)?,
            ))])
        });
        r.set_gradient("Softmax", softmax_grad);
        r.set_gradient("SparseSoftmaxCrossEntropyWithLogits", sparse_xent_grad);
    }

    /// The fused SoftmaxGrad: y * (dy - Σ_last(dy * y)); also right for a causal softmax.
    fn softmax_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        Ok(vec![Some(b.binary("SoftmaxGrad", "dx", dy, &f.output(0)))])
    }

    fn sparse_xent_grad(
        b: &mut GradBuilder,
        f: &ForwardNode,
        dys: &[Option<Output>],
    ) -> GradResult {
        if dys.get(1).is_some_and(Option::is_some) {
            return Err("differentiating through output 1 (backprop) is not supported".into());
        }
        // d loss_i / d features_ij = backprop_ij, scaled by the incoming dy_i.
        let dy = only_dy(dys)?;
        let column = b.op(
            "Reshape",
            "dy_column",
            &[dy],
            &[("shape", AttrValue::IntList(vec![-1, 1]))],
        );
        Ok(vec![
            Some(b.binary("Mul", "dfeatures", &f.output(1), &column)),
            None,
        ])
    }
}
