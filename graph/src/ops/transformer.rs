//! Transformer building blocks: LayerNorm (fused, with LayerNormGrad), Gelu (with GeluGrad) and
//! Dropout.
//!
//! - `LayerNorm` normalizes over the last axis with the biased variance, like
//!   `torch.nn.LayerNorm`; statistics are accumulated in f64 for every float type. Its outputs 1
//!   and 2 (`mean`, `rstd` = 1/√(var + ε)) exist for the backward pass, which is one fused
//!   `LayerNormGrad`.
//! - `Gelu` is GPT-2's tanh approximation by default (`approximate = "tanh"`), or the exact
//!   erf form (`"none"`), like `torch.nn.functional.gelu`.
//! - `Dropout` keeps element `i` when a hash of `(seed, step, i)` drawn uniformly from [0, 1)
//!   is ≥ `rate`, scaling kept elements by 1/(1 − rate); `rate = 0` returns the input itself (no
//!   copy). The mask depends only on the seed, the step id and the element index, so the
//!   gradient is the same op applied to the incoming gradient (same attrs, same step: the same
//!   mask), and a run is reproducible. Two Dropout nodes with the same seed and shape share their
//!   mask: give each its own seed.
//!
//! LayerNorm, LayerNormGrad, Gelu and GeluGrad split their rows (elements) over the current rayon
//! pool, the executor's compute pool, in tasks of about [`PAR_CHUNK`] elements; LayerNormGrad
//! sums its per-task dgamma/dbeta partials in task order, so results do not depend on the thread
//! count.

use super::elementwise::{
    attr_float, attr_int, attr_str, from_f32, rows_per_task, same_shape, slice, to_f32, PAR_CHUNK,
};
use super::grad::{dispatch_real, Real};
use super::math::require_same;
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit};
use rayon::prelude::*;

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(layer_norm());
    r.add(layer_norm_grad());
    r.add(gelu());
    r.add(gelu_grad());
    r.add(dropout());
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// Runs `f::<f32>` / `f::<f64>` on the inputs; bf16/f16 inputs are widened to f32 and every
/// output narrowed back.
fn on_floats(
    op: &str,
    inputs: &[&Tensor],
    f32_fn: impl Fn(&[&Tensor]) -> Result<Vec<Tensor>, String>,
    f64_fn: impl Fn(&[&Tensor]) -> Result<Vec<Tensor>, String>,
) -> Result<Vec<Tensor>, String> {
    let dtype = inputs.first().map(|t| t.dtype()).ok_or("no inputs")?;
    match dtype {
        DType::F32 => f32_fn(inputs),
        DType::F64 => f64_fn(inputs),
        DType::BF16 | DType::F16 => {
            let wide = inputs
                .iter()
                .map(|t| to_f32(t))
                .collect::<Result<Vec<_>, _>>()?;
            let refs: Vec<&Tensor> = wide.iter().collect();
            f32_fn(&refs)?.iter().map(|t| from_f32(t, dtype)).collect()
        }
        d => Err(format!(
            "{op}: dtype {d} is not supported (float types only)"
        )),
    }
}

fn new<T: Real>(dims: &[usize]) -> Result<Tensor, String> {
    Tensor::zeros(T::DTYPE, dims).map_err(|e| e.to_string())
}

fn mut_slice<T: Real>(t: &mut Tensor) -> Result<&mut [T], String> {
    t.as_mut_slice::<T>().map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------------------------

fn layer_norm() -> OpDef {
    OpDef::new(
        "LayerNorm",
        "y = (x - mean) / sqrt(var + epsilon) * gamma + beta over the last axis (biased variance, \
         as torch.nn.LayerNorm). In: x [..., C], gamma [C], beta [C] (same float dtype). Out: y \
         [..., C], mean [...], rstd [...] (1 / sqrt(var + epsilon); for the gradient). Attrs: \
         epsilon (float, default 1e-5).",
        layer_norm_infer,
    )
    .inputs([arg("x"), arg("gamma"), arg("beta")])
    .outputs([arg("y"), arg("mean"), arg("rstd")])
    .attrs([attr_or(
        "epsilon",
        AttrType::Float,
        AttrDefault::Float(1e-5),
    )])
    .cpu_kernel(|init: &KernelInit<'_>| {
        let epsilon = attr_float(init, "epsilon")?;
        check_epsilon(epsilon)?;
        Ok(Box::new(LayerNormKernel { epsilon }))
    })
}

fn check_epsilon(e: f64) -> Result<(), String> {
    if e.is_finite() && e >= 0.0 {
        Ok(())
    } else {
        Err(format!(
            "LayerNorm: epsilon must be finite and >= 0, got {e}"
        ))
    }
}

/// Checks x [..., C] against the [C] parameters; returns the row shape [...].
fn layer_norm_shapes(
    op: &str,
    x: &TensorType,
    params: &[(&str, &TensorType)],
) -> Result<Shape, String> {
    require_float(&format!("{op}: x"), x)?;
    let c = match x.shape.dims() {
        Some([]) => {
            return Err(format!(
                "{op}: x must have rank >= 1, got shape {}",
                x.shape
            ));
        }
        Some(d) => d[d.len() - 1],
        None => None,
    };
    for (name, p) in params {
        require_same(op, ("x", x), (name, p))?;
        let ok = match p.shape.dims() {
            Some([d]) => d.is_none() || c.is_none() || *d == c,
            Some(_) => false,
            None => true,
        };
        if !ok {
            return Err(format!(
                "{op}: {name} must be [C] with C = {} (the last dimension of x {}), got shape {}",
                c.map_or("?".to_string(), |c| c.to_string()),
                x.shape,
                p.shape
            ));
        }
    }
    Ok(match x.shape.dims() {
        Some(d) => Shape::partial(d[..d.len() - 1].to_vec()),
        None => Shape::unknown(),
    })
}

fn layer_norm_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let (x, gamma, beta) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
    check_epsilon(ctx.float("epsilon")?)?;
    let rows = layer_norm_shapes("LayerNorm", x, &[("gamma", gamma), ("beta", beta)])?;
    Ok(vec![
        x.clone(),
        TensorType::new(x.dtype, rows.clone()),
        TensorType::new(x.dtype, rows),
    ])
}

/// The run-time check shared by the two kernels: x has rank ≥ 1 and every parameter is [C] of
/// x's dtype, C = x's last dimension (returned).
fn check_rows(op: &str, x: &Tensor, params: &[(&str, &Tensor)]) -> Result<usize, String> {
    let Some(&c) = x.dims().last() else {
        return Err(format!(
            "{op}: x must have rank >= 1, got shape {}",
            x.shape()
        ));
    };
    for (name, p) in params {
        if p.dims() != [c] || p.dtype() != x.dtype() {
            return Err(format!(
                "{op}: {name} {}{} must be [{c}] of x's dtype (x is {}{})",
                p.dtype(),
                p.shape(),
                x.dtype(),
                x.shape()
            ));
        }
    }
    Ok(c)
}

#[derive(Debug)]
struct LayerNormKernel {
    epsilon: f64,
}

fn layer_norm_typed<T: Real>(ins: &[&Tensor], epsilon: f64) -> Result<Vec<Tensor>, String> {
    let (x, gamma, beta) = (ins[0], ins[1], ins[2]);
    let c = x.dims().last().copied().unwrap_or(0);
    let row_dims = &x.dims()[..x.rank().saturating_sub(1)];
    let (xs, gs, bs) = (slice::<T>(x)?, slice::<T>(gamma)?, slice::<T>(beta)?);
    let (mut y, mut mean, mut rstd) = (
        new::<T>(x.dims())?,
        new::<T>(row_dims)?,
        new::<T>(row_dims)?,
    );
    if c > 0 {
        let (ys, ms, rs) = (
            mut_slice::<T>(&mut y)?,
            mut_slice::<T>(&mut mean)?,
            mut_slice::<T>(&mut rstd)?,
        );
        let per = rows_per_task(c);
        ys.par_chunks_mut(per * c)
            .zip(xs.par_chunks(per * c))
            .zip(ms.par_chunks_mut(per))
            .zip(rs.par_chunks_mut(per))
            .for_each(|(((ys, xs), ms), rs)| {
                for (((row, out), m), r) in xs.chunks(c).zip(ys.chunks_mut(c)).zip(ms).zip(rs) {
                    let mu = row.iter().map(|v| v.to_f64()).sum::<f64>() / c as f64;
                    let var = row
                        .iter()
                        .map(|v| {
                            let d = v.to_f64() - mu;
                            d * d
                        })
                        .sum::<f64>()
                        / c as f64;
                    let inv = 1.0 / (var + epsilon).sqrt();
                    let (mu_t, inv_t) = (T::from_f64(mu), T::from_f64(inv));
                    for (((o, &v), &g), &b) in out.iter_mut().zip(row).zip(gs).zip(bs) {
                        *o = (v - mu_t) * inv_t * g + b;
                    }
                    *m = mu_t;
                    *r = inv_t;
                }
            });
    }
    Ok(vec![y, mean, rstd])
}

impl Kernel for LayerNormKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (x, gamma, beta) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        check_rows("LayerNorm", x, &[("gamma", gamma), ("beta", beta)])?;
        let e = self.epsilon;
        let outs = on_floats(
            "LayerNorm",
            &[x, gamma, beta],
            |i| layer_norm_typed::<f32>(i, e),
            |i| layer_norm_typed::<f64>(i, e),
        )?;
        for (k, t) in outs.into_iter().enumerate() {
            ctx.set_output(k, t)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNormGrad
// ---------------------------------------------------------------------------------------------

fn layer_norm_grad() -> OpDef {
    OpDef::new(
        "LayerNormGrad",
        "The gradient of LayerNorm. With xhat = (x - mean) * rstd and g = dy * gamma: dx = rstd * \
         (g - mean_C(g) - xhat * mean_C(g * xhat)), dgamma = sum over rows of dy * xhat, dbeta = \
         sum over rows of dy. In: dy [..., C], x [..., C], gamma [C], mean [...], rstd [...] \
         (LayerNorm's outputs 1 and 2). Out: dx [..., C], dgamma [C], dbeta [C].",
        layer_norm_grad_infer,
    )
    .inputs([arg("dy"), arg("x"), arg("gamma"), arg("mean"), arg("rstd")])
    .outputs([arg("dx"), arg("dgamma"), arg("dbeta")])
    .cpu_kernel(|_| Ok(Box::new(LayerNormGradKernel)))
}

fn layer_norm_grad_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    const OP: &str = "LayerNormGrad";
    let (dy, x, gamma) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
    let (mean, rstd) = (ctx.input(3)?, ctx.input(4)?);
    let rows = layer_norm_shapes(OP, x, &[("gamma", gamma)])?;
    require_same(OP, ("x", x), ("dy", dy))?;
    if !dy.shape.is_compatible_with(&x.shape) {
        return Err(format!(
            "{OP}: dy has shape {} but x has shape {}; they must match",
            dy.shape, x.shape
        )
        .into());
    }
    for (name, t) in [("mean", mean), ("rstd", rstd)] {
        require_same(OP, ("x", x), (name, t))?;
        if !t.shape.is_compatible_with(&rows) {
            return Err(format!(
                "{OP}: {name} has shape {} but x {} has rows {rows}",
                t.shape, x.shape
            )
            .into());
        }
    }
    Ok(vec![x.clone(), gamma.clone(), gamma.clone()])
}

#[derive(Debug)]
struct LayerNormGradKernel;

fn layer_norm_grad_typed<T: Real>(ins: &[&Tensor]) -> Result<Vec<Tensor>, String> {
    let (dy, x, gamma, mean, rstd) = (ins[0], ins[1], ins[2], ins[3], ins[4]);
    let c = gamma.dims()[0];
    let (dys, xs, gs) = (slice::<T>(dy)?, slice::<T>(x)?, slice::<T>(gamma)?);
    let (ms, rs) = (slice::<T>(mean)?, slice::<T>(rstd)?);
    let mut dx = new::<T>(x.dims())?;
    let mut dgamma = vec![0.0f64; c];
    let mut dbeta = vec![0.0f64; c];
    if c > 0 {
        let dxs = mut_slice::<T>(&mut dx)?;
        let per = rows_per_task(c);
        // Per task: dx of its rows, and its partial sums of dgamma and dbeta (added in task
        // order below, so the result does not depend on the thread count).
        let partials: Vec<(Vec<f64>, Vec<f64>)> = dxs
            .par_chunks_mut(per * c)
            .zip(dys.par_chunks(per * c))
            .zip(xs.par_chunks(per * c))
            .zip(ms.par_chunks(per))
            .zip(rs.par_chunks(per))
            .map(|((((dxs, dys), xs), ms), rs)| {
                let (mut dg, mut db) = (vec![0.0f64; c], vec![0.0f64; c]);
                let (mut xhat, mut g) = (vec![0.0f64; c], vec![0.0f64; c]);
                for ((((dyr, xr), dxr), &m), &r) in dys
                    .chunks(c)
                    .zip(xs.chunks(c))
                    .zip(dxs.chunks_mut(c))
                    .zip(ms)
                    .zip(rs)
                {
                    let (m, r) = (m.to_f64(), r.to_f64());
                    let (mut sum_g, mut sum_gx) = (0.0, 0.0);
                    for j in 0..c {
                        let d = dyr[j].to_f64();
                        xhat[j] = (xr[j].to_f64() - m) * r;
                        g[j] = d * gs[j].to_f64();
                        sum_g += g[j];
                        sum_gx += g[j] * xhat[j];
                        dg[j] += d * xhat[j];
                        db[j] += d;
                    }
                    let (a, b) = (sum_g / c as f64, sum_gx / c as f64);
                    for j in 0..c {
                        dxr[j] = T::from_f64(r * (g[j] - a - xhat[j] * b));
                    }
                }
                (dg, db)
            })
            .collect();
        for (dg, db) in partials {
            for j in 0..c {
                dgamma[j] += dg[j];
                dbeta[j] += db[j];
            }
        }
    }
    let to_t = |v: Vec<f64>| -> Result<Tensor, String> {
        let v: Vec<T> = v.into_iter().map(T::from_f64).collect();
        Tensor::from_slice(&[c], &v).map_err(|e| e.to_string())
    };
    Ok(vec![dx, to_t(dgamma)?, to_t(dbeta)?])
}

impl Kernel for LayerNormGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "LayerNormGrad";
        let ins: Vec<&Tensor> = (0..5).map(|i| ctx.input(i)).collect::<Result<_, _>>()?;
        let (dy, x, gamma, mean, rstd) = (ins[0], ins[1], ins[2], ins[3], ins[4]);
        let c = check_rows(OP, x, &[("gamma", gamma)])?;
        same_shape(OP, ("dy", dy), ("x", x))?;
        let rows = x.num_elements() / c.max(1);
        for (name, t) in [("mean", mean), ("rstd", rstd)] {
            if t.dtype() != x.dtype() || (c > 0 && t.num_elements() != rows) {
                return Err(format!(
                    "{OP}: {name} {}{} does not fit x {}{} (one value per row)",
                    t.dtype(),
                    t.shape(),
                    x.dtype(),
                    x.shape()
                )
                .into());
            }
        }
        if dy.dtype() != x.dtype() {
            return Err(format!("{OP}: dy is {} but x is {}", dy.dtype(), x.dtype()).into());
        }
        let outs = on_floats(
            OP,
            &ins,
            layer_norm_grad_typed::<f32>,
            layer_norm_grad_typed::<f64>,
        )?;
        for (k, t) in outs.into_iter().enumerate() {
            ctx.set_output(k, t)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Gelu
// ---------------------------------------------------------------------------------------------

/// √(2/π).
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// 1/√2.
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// 1/√(2π).
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// Which GELU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GeluKind {
    Tanh,
    Erf,
}

fn gelu_kind(op: &str, s: &str) -> Result<GeluKind, String> {
    match s {
        "tanh" => Ok(GeluKind::Tanh),
        "none" => Ok(GeluKind::Erf),
        s => Err(format!(
            "{op}: approximate must be \"tanh\" or \"none\", got {s:?}"
        )),
    }
}

fn gelu_attr() -> AttrDef {
    attr_or("approximate", AttrType::String, AttrDefault::Str("tanh"))
}

fn gelu() -> OpDef {
    OpDef::new(
        "Gelu",
        "y = GELU(x) elementwise: 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) (GPT-2) when \
         approximate = \"tanh\", 0.5x(1 + erf(x/sqrt 2)) when \"none\". In: x (float). Out: y, \
         same type. Attrs: approximate (string, default \"tanh\").",
        |ctx| {
            gelu_kind("Gelu", ctx.string("approximate")?)?;
            let x = ctx.input(0)?;
            require_float("Gelu: x", x)?;
            Ok(vec![x.clone()])
        },
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .attrs([gelu_attr()])
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(GeluKernel {
            kind: gelu_kind("Gelu", &attr_str(init, "approximate")?)?,
        }))
    })
}

/// Float types the GELU kernels compute in directly (no widening: the kernels are hot in a GPT).
trait GeluFloat: Real + Send + Sync {
    fn exp(self) -> Self;
    fn erf(self) -> Self;
}

impl GeluFloat for f32 {
    fn exp(self) -> Self {
        f32::exp(self)
    }
    fn erf(self) -> Self {
        libm::erff(self)
    }
}

impl GeluFloat for f64 {
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn erf(self) -> Self {
        libm::erf(self)
    }
}

/// tanh through one `exp` (cheaper than the library tanh; saturates correctly: exp overflowing
/// to ∞ gives 1, underflowing to 0 gives −1).
fn fast_tanh<T: GeluFloat>(u: T) -> T {
    let one = T::from_f64(1.0);
    one - T::from_f64(2.0) / ((u + u).exp() + one)
}

/// GELU of `x`.
fn gelu_f<T: GeluFloat>(kind: GeluKind, x: T) -> T {
    let half = T::from_f64(0.5);
    let one = T::from_f64(1.0);
    match kind {
        GeluKind::Tanh => {
            let u = T::from_f64(SQRT_2_OVER_PI) * (x + T::from_f64(0.044715) * x * x * x);
            half * x * (one + fast_tanh(u))
        }
        GeluKind::Erf => half * x * (one + (x * T::from_f64(FRAC_1_SQRT_2)).erf()),
    }
}

/// d GELU / dx at `x`.
fn gelu_df<T: GeluFloat>(kind: GeluKind, x: T) -> T {
    let half = T::from_f64(0.5);
    let one = T::from_f64(1.0);
    match kind {
        GeluKind::Tanh => {
            let s = T::from_f64(SQRT_2_OVER_PI);
            let c = T::from_f64(0.044715);
            let t = fast_tanh(s * (x + c * x * x * x));
            half * (one + t) + half * x * (one - t * t) * s * (one + T::from_f64(3.0) * c * x * x)
        }
        GeluKind::Erf => {
            half * (one + (x * T::from_f64(FRAC_1_SQRT_2)).erf())
                + x * (T::from_f64(-0.5) * x * x).exp() * T::from_f64(FRAC_1_SQRT_2PI)
        }
    }
}

#[derive(Debug)]
struct GeluKernel {
    kind: GeluKind,
}

/// Elements per parallel chunk of the f32 GELU kernels: below two chunks they run inline.
const GELU_CHUNK: usize = 16 * 1024;

/// `(1 + tanh(u), 1 − tanh²(u))` from one `exp(−2|u|)`: both stay accurate in the tails, where
/// forming `tanh` first and then `1 + t` or `1 − t²` would cancel (GELU of a large negative
/// input and its derivative are tiny, not rounding noise).
#[inline(always)]
fn one_plus_tanh_and_sech2(u: f32) -> (f32, f32) {
    let e = (-2.0 * u.abs()).exp();
    let inv = 1.0 / (1.0 + e);
    let one_plus_t = if u >= 0.0 { 2.0 * inv } else { 2.0 * e * inv };
    (one_plus_t, 4.0 * e * inv * inv)
}

/// GELU (tanh form) of f32s, in parallel on the current pool for large tensors.
fn gelu_tanh_f32(xs: &[f32], out: &mut [f32]) {
    use rayon::prelude::*;
    let k = SQRT_2_OVER_PI as f32;
    let run = |(o, x): (&mut [f32], &[f32])| {
        for (o, &v) in o.iter_mut().zip(x) {
            let (one_plus_t, _) = one_plus_tanh_and_sech2(k * (v + 0.044715 * v * v * v));
            *o = 0.5 * v * one_plus_t;
        }
    };
    if xs.len() < 2 * GELU_CHUNK {
        run((out, xs));
    } else {
        out.par_chunks_mut(GELU_CHUNK)
            .zip(xs.par_chunks(GELU_CHUNK))
            .for_each(run);
    }
}

/// dy · GELU'(x) (tanh form) of f32s, in parallel on the current pool for large tensors.
fn gelu_tanh_grad_f32(dys: &[f32], xs: &[f32], out: &mut [f32]) {
    use rayon::prelude::*;
    let k = SQRT_2_OVER_PI as f32;
    let run = |((o, x), dy): ((&mut [f32], &[f32]), &[f32])| {
        for ((o, &v), &d) in o.iter_mut().zip(x).zip(dy) {
            let (one_plus_t, sech2) = one_plus_tanh_and_sech2(k * (v + 0.044715 * v * v * v));
            let df = 0.5 * one_plus_t + 0.5 * v * sech2 * k * (1.0 + 3.0 * 0.044715 * v * v);
            *o = d * df;
        }
    };
    if xs.len() < 2 * GELU_CHUNK {
        run(((out, xs), dys));
    } else {
        out.par_chunks_mut(GELU_CHUNK)
            .zip(xs.par_chunks(GELU_CHUNK))
            .zip(dys.par_chunks(GELU_CHUNK))
            .for_each(run);
    }
}

fn gelu_typed<T: GeluFloat>(ins: &[&Tensor], kind: GeluKind) -> Result<Vec<Tensor>, String> {
    if let (GeluKind::Tanh, DType::F32) = (kind, T::DTYPE) {
        let xs = slice::<f32>(ins[0])?;
        let y = Tensor::filled(ins[0].dims(), |o: &mut [f32]| gelu_tanh_f32(xs, o))
            .map_err(|e| e.to_string())?;
        return Ok(vec![y]);
    }
    let xs = slice::<T>(ins[0])?;
    let y = Tensor::filled(ins[0].dims(), |o: &mut [T]| {
        o.par_chunks_mut(PAR_CHUNK)
            .zip(xs.par_chunks(PAR_CHUNK))
            .for_each(|(o, x)| {
                for (o, &v) in o.iter_mut().zip(x) {
                    *o = gelu_f(kind, v);
                }
            });
    })
    .map_err(|e| e.to_string())?;
    Ok(vec![y])
}

impl Kernel for GeluKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let k = self.kind;
        let mut outs = on_floats(
            "Gelu",
            &[x],
            |i| gelu_typed::<f32>(i, k),
            |i| gelu_typed::<f64>(i, k),
        )?;
        ctx.set_output(0, outs.remove(0))
    }
}

// ---------------------------------------------------------------------------------------------
// GeluGrad
// ---------------------------------------------------------------------------------------------

fn gelu_grad() -> OpDef {
    OpDef::new(
        "GeluGrad",
        "dx = dy * GELU'(x), the gradient of Gelu. In: dy, x (same float dtype and shape). Out: \
         dx. Attrs: approximate (string, default \"tanh\"; as the forward Gelu).",
        |ctx| {
            gelu_kind("GeluGrad", ctx.string("approximate")?)?;
            let (dy, x) = (ctx.input(0)?, ctx.input(1)?);
            let dtype = require_same("GeluGrad", ("dy", dy), ("x", x))?;
            require_float("GeluGrad: x", x)?;
            let shape = dy.shape.merge(&x.shape).ok_or_else(|| {
                format!(
                    "GeluGrad: dy has shape {} but x has shape {}; they must match",
                    dy.shape, x.shape
                )
            })?;
            Ok(vec![TensorType::new(dtype, shape)])
        },
    )
    .inputs([arg("dy"), arg("x")])
    .outputs([arg("dx")])
    .attrs([gelu_attr()])
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(GeluGradKernel {
            kind: gelu_kind("GeluGrad", &attr_str(init, "approximate")?)?,
        }))
    })
}

#[derive(Debug)]
struct GeluGradKernel {
    kind: GeluKind,
}

fn gelu_grad_typed<T: GeluFloat>(ins: &[&Tensor], kind: GeluKind) -> Result<Vec<Tensor>, String> {
    if let (GeluKind::Tanh, DType::F32) = (kind, T::DTYPE) {
        let (dys, xs) = (slice::<f32>(ins[0])?, slice::<f32>(ins[1])?);
        if dys.len() != xs.len() {
            return Err(format!(
                "GeluGrad: dy has {} elements but x has {}",
                dys.len(),
                xs.len()
            ));
        }
        let dx = Tensor::filled(ins[1].dims(), |o: &mut [f32]| {
            gelu_tanh_grad_f32(dys, xs, o)
        })
        .map_err(|e| e.to_string())?;
        return Ok(vec![dx]);
    }
    let (dys, xs) = (slice::<T>(ins[0])?, slice::<T>(ins[1])?);
    let dx = Tensor::filled(ins[1].dims(), |o: &mut [T]| {
        o.par_chunks_mut(PAR_CHUNK)
            .zip(dys.par_chunks(PAR_CHUNK))
            .zip(xs.par_chunks(PAR_CHUNK))
            .for_each(|((o, d), x)| {
                for ((o, &d), &v) in o.iter_mut().zip(d).zip(x) {
                    *o = d * gelu_df(kind, v);
                }
            });
    })
    .map_err(|e| e.to_string())?;
    Ok(vec![dx])
}

impl Kernel for GeluGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (dy, x) = (ctx.input(0)?, ctx.input(1)?);
        same_shape("GeluGrad", ("dy", dy), ("x", x))?;
        if dy.dtype() != x.dtype() {
            return Err(format!("GeluGrad: dy is {} but x is {}", dy.dtype(), x.dtype()).into());
        }
        let k = self.kind;
        let mut outs = on_floats(
            "GeluGrad",
            &[dy, x],
            |i| gelu_grad_typed::<f32>(i, k),
            |i| gelu_grad_typed::<f64>(i, k),
        )?;
        ctx.set_output(0, outs.remove(0))
    }
}

// ---------------------------------------------------------------------------------------------
// Dropout
// ---------------------------------------------------------------------------------------------

fn dropout() -> OpDef {
    OpDef::new(
        "Dropout",
        "y = x * mask / (1 - rate), mask[i] = 1 with probability 1 - rate, drawn from (seed, step \
         id, i) only (reproducible; the gradient is Dropout of dy with the same attrs). rate 0: y \
         is x (no copy). In: x (float). Out: y, same type. Attrs: rate (float in [0, 1), default \
         0), seed (int, default 0).",
        |ctx| {
            check_rate(ctx.float("rate")?)?;
            ctx.int("seed")?;
            let x = ctx.input(0)?;
            require_float("Dropout: x", x)?;
            Ok(vec![x.clone()])
        },
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .attrs([
        attr_or("rate", AttrType::Float, AttrDefault::Float(0.0)),
        attr_or("seed", AttrType::Int, AttrDefault::Int(0)),
    ])
    .cpu_kernel(|init: &KernelInit<'_>| {
        let rate = attr_float(init, "rate")?;
        check_rate(rate)?;
        Ok(Box::new(DropoutKernel {
            rate,
            seed: attr_int(init, "seed")?,
        }))
    })
}

fn check_rate(rate: f64) -> Result<(), String> {
    if (0.0..1.0).contains(&rate) {
        Ok(())
    } else {
        Err(format!("Dropout: rate must be in [0, 1), got {rate}"))
    }
}

/// SplitMix64's finalizer: a well-mixed 64-bit hash.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Whether Dropout keeps element `i` in step `step` (public to the crate for tests).
pub(crate) fn dropout_keeps(seed: i64, step: u64, i: usize, rate: f64) -> bool {
    let key = mix64(mix64(seed as u64) ^ step);
    let h = mix64(key ^ (i as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let u = (h >> 11) as f64 / (1u64 << 53) as f64;
    u >= rate
}

#[derive(Debug)]
struct DropoutKernel {
    rate: f64,
    seed: i64,
}

fn dropout_typed<T: Real>(x: &Tensor, rate: f64, seed: i64, step: u64) -> Result<Tensor, String> {
    let xs = slice::<T>(x)?;
    let scale = T::from_f64(1.0 / (1.0 - rate));
    Tensor::filled(x.dims(), |o: &mut [T]| {
        for (i, (o, &v)) in o.iter_mut().zip(xs).enumerate() {
            if dropout_keeps(seed, step, i, rate) {
                *o = v * scale;
            }
        }
    })
    .map_err(|e| e.to_string())
}

impl Kernel for DropoutKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        if self.rate == 0.0 {
            return ctx.set_output(0, x.clone());
        }
        let (rate, seed, step) = (self.rate, self.seed, ctx.step);
        let y = match x.dtype() {
            d @ (DType::BF16 | DType::F16) => {
                from_f32(&dropout_typed::<f32>(&to_f32(x)?, rate, seed, step)?, d)
                    .map_err(OpError::from)
            }
            d => dispatch_real!(d, dropout_typed(x, rate, seed, step)),
        }?;
        ctx.set_output(0, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_gelu_kernels_match_the_f64_formula_in_parallel_chunks_too() {
        for n in [5usize, 3 * GELU_CHUNK + 7] {
            // x in [-12, 12]: both tails, where GELU and its derivative are tiny.
            let xs: Vec<f32> = (0..n).map(|i| ((i % 997) as f32 - 498.0) / 41.5).collect();
            let dys: Vec<f32> = (0..n).map(|i| ((i % 13) as f32 - 6.0) / 3.0).collect();
            let (mut y, mut dx) = (vec![0.0f32; n], vec![0.0f32; n]);
            gelu_tanh_f32(&xs, &mut y);
            gelu_tanh_grad_f32(&dys, &xs, &mut dx);
            for i in 0..n {
                let x = f64::from(xs[i]);
                let (want_y, want_dx) = (
                    gelu_f(GeluKind::Tanh, x),
                    f64::from(dys[i]) * gelu_df(GeluKind::Tanh, x),
                );
                // GELU: relative to the value (accurate in the tails too). GELU' sums two O(1)
                // terms that cancel near x = -0.75, so its error is a few f32 ulp of 1, times dy.
                let y_err = (f64::from(y[i]) - want_y).abs();
                assert!(
                    y_err <= 1e-6 * want_y.abs() + 1e-9,
                    "gelu({x}) = {} vs {want_y}",
                    y[i]
                );
                let dx_err = (f64::from(dx[i]) - want_dx).abs();
                let dy = f64::from(dys[i]).abs();
                assert!(
                    dx_err <= 1e-6 * want_dx.abs() + 4e-7 * dy + 1e-12,
                    "gelu'({x}) = {} vs {want_dx}",
                    dx[i]
                );
            }
        }
    }

    #[test]
    fn dropout_mask_rate_and_reproducibility() {
        let n = 20_000;
        let kept = (0..n).filter(|&i| dropout_keeps(7, 3, i, 0.25)).count();
        let frac = kept as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.02, "kept fraction {frac}");
        let a: Vec<bool> = (0..64).map(|i| dropout_keeps(7, 3, i, 0.5)).collect();
        let b: Vec<bool> = (0..64).map(|i| dropout_keeps(7, 3, i, 0.5)).collect();
        let c: Vec<bool> = (0..64).map(|i| dropout_keeps(7, 4, i, 0.5)).collect();
        let d: Vec<bool> = (0..64).map(|i| dropout_keeps(8, 3, i, 0.5)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c, "another step draws another mask");
        assert_ne!(a, d, "another seed draws another mask");
    }

    #[test]
    fn gelu_derivatives_match_finite_differences() {
        for kind in [GeluKind::Tanh, GeluKind::Erf] {
            for &x in &[-3.0f64, -1.0, -0.1, 0.0, 0.3, 2.5] {
                let h = 1e-6;
                let fd = (gelu_f(kind, x + h) - gelu_f(kind, x - h)) / (2.0 * h);
                assert!((fd - gelu_df(kind, x)).abs() < 1e-8, "{kind:?} at {x}");
                // f32 agrees with f64 to f32 precision.
                let (y32, y64) = (gelu_f(kind, x as f32) as f64, gelu_f(kind, x));
                assert!(
                    (y32 - y64).abs() < 1e-6 * (1.0 + y64.abs()),
                    "{kind:?} f32 at {x}"
                );
                let (d32, d64) = (gelu_df(kind, x as f32) as f64, gelu_df(kind, x));
                assert!(
                    (d32 - d64).abs() < 1e-6 * (1.0 + d64.abs()),
                    "{kind:?} f32' at {x}"
                );
            }
        }
        // Known values: GELU(1) exact = 0.841344746..., tanh form = 0.841191990...
        assert!((gelu_f(GeluKind::Erf, 1.0f64) - 0.841_344_746_068_542_9).abs() < 1e-12);
        assert!((gelu_f(GeluKind::Tanh, 1.0f64) - 0.841_191_990_607_477_2).abs() < 1e-9);
        // Saturation: no NaN from the exp-based tanh at large |x|.
        for x in [-100.0f32, -30.0, 30.0, 100.0] {
            let y = gelu_f(GeluKind::Tanh, x);
            assert!(y.is_finite() && (y - x.max(0.0)).abs() < 1e-3, "{x}: {y}");
            assert!(gelu_df(GeluKind::Tanh, x).is_finite());
        }
    }
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]).
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("LayerNorm", layer_norm_grad);
        r.set_gradient("Gelu", |b, f, dys| {
            Ok(vec![Some(b.op(
                "GeluGrad",
                "dx",
                &[only_dy(dys)?, f.input(0)?],
                &[("approximate", f.attr("approximate")?.clone())],
            ))])
        });
        r.set_gradient("Dropout", |b, f, dys| {
            Ok(vec![Some(b.op(
                "Dropout",
                "dx",
                &[only_dy(dys)?],
                &[
                    ("rate", f.attr("rate")?.clone()),
                    ("seed", f.attr("seed")?.clone()),
                ],
            ))])
        });
        // LayerNormGrad and GeluGrad get no gradient: second derivatives are not supported.
    }

    fn layer_norm_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        if dys.iter().skip(1).any(Option::is_some) {
            return Err(
                "differentiating through LayerNorm's mean or rstd output is not supported".into(),
            );
        }
        let dy = only_dy(dys)?;
        let (x, gamma) = (f.input(0)?, f.input(1)?);
        let (mean, rstd) = (f.output(1), f.output(2));
        let node = b.add("LayerNormGrad", "grad", &[dy, x, gamma, &mean, &rstd], &[]);
        let out = |index| Output {
            node: node.clone(),
            index,
        };
        Ok(vec![Some(out(0)), Some(out(1)), Some(out(2))])
    }
}
