//! Variable updates TensorFlow graphs use directly: `AssignAdd`, `AssignSub` and `Assign`
//! (TensorFlow's `AssignAddVariableOp`/`AssignAdd`, `AssignSubVariableOp`/`AssignSub` and
//! `AssignVariableOp`/`Assign` on resource and reference variables; see
//! [`crate::tf_import`]), with their CPU kernels.
//!
//! Like the optimizer applies, they take the variable as a reference input, so they are placed
//! with it, and have no outputs: a step depends on them through control edges.

use super::elementwise::stateless;
use super::grad::{dispatch_real, Real};
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit, VariableCell};

/// The ops this module registers.
pub const OPS: [&str; 11] = [
    "ApplyAdamWithPowers",
    "AssignAdd",
    "AssignSub",
    "Assign",
    "Shape",
    "Fill",
    "Tile",
    "GatherV2",
    "Prod",
    "ExpandDims",
    "FloorMod",
];

pub(crate) fn register(r: &mut OpRegistry) {
    for mode in [Mode::Add, Mode::Sub, Mode::Set] {
        r.add(update_op(mode));
    }
    register_shape_ops(r);
    r.add(adam_with_powers_op());
}

// ---------------------------------------------------------------------------------------------
// ApplyAdamWithPowers: TensorFlow's ApplyAdam / ResourceApplyAdam
// ---------------------------------------------------------------------------------------------

fn adam_with_powers_op() -> OpDef {
    OpDef::new(
        "ApplyAdamWithPowers",
        "Adam as TensorFlow's ApplyAdam computes it from beta1^t and beta2^t: lr_t = lr * \
         sqrt(1 - beta2_power) / (1 - beta1_power); m += (grad - m) * (1 - beta1); v += (grad² \
         - v) * (1 - beta2); var -= lr_t * m / (sqrt(v) + epsilon). In: var, m, v (references to \
         float Variables of one type), beta1_power, beta2_power (scalars of var's type), grad \
         (var's type). No outputs. Attrs: lr, beta1, beta2, epsilon (float, required).",
        |ctx| {
            let var = ctx.input(0)?;
            require_float("ApplyAdamWithPowers: var", var)?;
            for (i, name) in [(1, "m"), (2, "v"), (5, "grad")] {
                let t = ctx.input(i)?;
                if t.dtype != var.dtype || !t.shape.is_compatible_with(&var.shape) {
                    return Err(format!(
                        "ApplyAdamWithPowers: var is {var} but {name} is {t}; they must match"
                    )
                    .into());
                }
            }
            for (i, name) in [(3, "beta1_power"), (4, "beta2_power")] {
                let t = ctx.input(i)?;
                if t.dtype != var.dtype || t.shape.rank().is_some_and(|r| r != 0) {
                    return Err(format!(
                        "ApplyAdamWithPowers: {name} must be a scalar of var's type, got {t}"
                    )
                    .into());
                }
            }
            Ok(vec![])
        },
    )
    .inputs([
        ref_arg("var"),
        ref_arg("m"),
        ref_arg("v"),
        arg("beta1_power"),
        arg("beta2_power"),
        arg("grad"),
    ])
    .attrs([
        attr("lr", AttrType::Float),
        attr("beta1", AttrType::Float),
        attr("beta2", AttrType::Float),
        attr("epsilon", AttrType::Float),
    ])
    .stateful()
    .cpu_kernel(AdamPowersKernel::build)
}

#[derive(Debug)]
struct AdamPowersKernel {
    lr: f64,
    beta1: f64,
    beta2: f64,
    epsilon: f64,
}

fn float_attr(init: &KernelInit<'_>, name: &str) -> Result<f64, String> {
    match init.attr(name)? {
        AttrValue::Float(x) => Ok(*x),
        v => Err(format!("attribute `{name}` is {}, not float", v.ty())),
    }
}

impl AdamPowersKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        Ok(Box::new(AdamPowersKernel {
            lr: float_attr(init, "lr")?,
            beta1: float_attr(init, "beta1")?,
            beta2: float_attr(init, "beta2")?,
            epsilon: float_attr(init, "epsilon")?,
        }))
    }
}

/// Runs `f` on the elements of the initialized variable in `cell`, which must have shape `dims`.
fn with_elements<T: Real, R>(
    cell: &VariableCell,
    what: &str,
    dims: &[usize],
    f: impl FnOnce(&mut [T]) -> Result<R, String>,
) -> Result<R, String> {
    cell.update(|slot| {
        let t = slot
            .as_mut()
            .ok_or_else(|| format!("{what} is not initialized"))?;
        if t.dims() != dims {
            return Err(format!(
                "{what} has shape {:?} but the gradient has shape {dims:?}",
                t.dims()
            ));
        }
        f(t.as_mut_slice::<T>().map_err(|e| format!("{what}: {e}"))?)
    })
}

fn adam_powers<T: Real>(
    k: &AdamPowersKernel,
    cells: [&VariableCell; 3],
    powers: (f64, f64),
    g: &Tensor,
) -> Result<(), String> {
    let gs = g.as_slice::<T>().map_err(|e| format!("grad: {e}"))?;
    let lr_t = k.lr * (1.0 - powers.1).sqrt() / (1.0 - powers.0);
    let (lr_t, eps) = (T::from_f64(lr_t), T::from_f64(k.epsilon));
    let (one_b1, one_b2) = (T::from_f64(1.0 - k.beta1), T::from_f64(1.0 - k.beta2));
    let [var, m, v] = cells;
    with_elements::<T, _>(m, "m", g.dims(), |ms| {
        with_elements::<T, _>(v, "v", g.dims(), |vs| {
            with_elements::<T, _>(var, "var", g.dims(), |ws| {
                for (((w, m), v), &g) in ws.iter_mut().zip(ms.iter_mut()).zip(vs.iter_mut()).zip(gs)
                {
                    *m += (g - *m) * one_b1;
                    *v += (g * g - *v) * one_b2;
                    *w = *w - lr_t * *m / (v.sqrt() + eps);
                }
                Ok(())
            })
        })
    })
}

impl Kernel for AdamPowersKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let scalar = |i: usize, what: &str| -> Result<f64, String> {
            let t = ctx.input(i)?;
            match t.to_f64_vec()[..] {
                [x] => Ok(x),
                _ => Err(format!("{what} must be a scalar, got shape {:?}", t.dims())),
            }
        };
        let powers = (scalar(3, "beta1_power")?, scalar(4, "beta2_power")?);
        let g = ctx.input(5)?;
        let cells = [
            ctx.variable_at(0)?,
            ctx.variable_at(1)?,
            ctx.variable_at(2)?,
        ];
        dispatch_real!(g.dtype(), adam_powers(self, cells, powers, g))
    }
}

/// What an update does with the value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// `var += value`.
    Add,
    /// `var -= value`.
    Sub,
    /// `var = value`.
    Set,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Add => "AssignAdd",
            Mode::Sub => "AssignSub",
            Mode::Set => "Assign",
        }
    }
}

fn update_op(mode: Mode) -> OpDef {
    let summary = match mode {
        Mode::Add => {
            "var += value. In: var (reference to a float Variable), value (same type and \
                      shape). No outputs (TensorFlow's AssignAddVariableOp)."
        }
        Mode::Sub => {
            "var -= value. In: var (reference to a float Variable), value (same type and \
                      shape). No outputs (TensorFlow's AssignSubVariableOp)."
        }
        Mode::Set => {
            "var = value. In: var (reference to a Variable), value (same type and \
                      shape). No outputs (TensorFlow's AssignVariableOp)."
        }
    };
    // Shape rules and kernel factories are plain fns: one per mode.
    let (infer, build): (ShapeFn, crate::kernel::KernelFactory) = match mode {
        Mode::Add => (|ctx| infer(Mode::Add, ctx), |_| build(Mode::Add)),
        Mode::Sub => (|ctx| infer(Mode::Sub, ctx), |_| build(Mode::Sub)),
        Mode::Set => (|ctx| infer(Mode::Set, ctx), |_| build(Mode::Set)),
    };
    OpDef::new(mode.name(), summary, infer)
        .inputs([ref_arg("var"), arg("value")])
        .stateful()
        .cpu_kernel(build)
}

fn infer(mode: Mode, ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let (var, value) = (ctx.input(0)?, ctx.input(1)?);
    if mode != Mode::Set {
        require_float(&format!("{}: var", mode.name()), var)?;
    }
    if value.dtype != var.dtype || !value.shape.is_compatible_with(&var.shape) {
        return Err(format!(
            "{}: var is {var} but value is {value}; they must have the same dtype and shape",
            mode.name()
        )
        .into());
    }
    Ok(vec![])
}

fn build(mode: Mode) -> Result<Box<dyn Kernel>, OpError> {
    Ok(Box::new(UpdateKernel { mode }))
}

#[derive(Debug)]
struct UpdateKernel {
    mode: Mode,
}

fn add_into<T: Real>(cell: &VariableCell, value: &Tensor, sign: f64) -> Result<(), String> {
    let v = value.as_slice::<T>().map_err(|e| format!("value: {e}"))?;
    let sign = T::from_f64(sign);
    cell.update(|slot| {
        let t = slot.as_mut().ok_or("var is not initialized")?;
        if t.dims() != value.dims() {
            return Err(format!(
                "var has shape {:?} but value has shape {:?}",
                t.dims(),
                value.dims()
            ));
        }
        let w = t.as_mut_slice::<T>().map_err(|e| format!("var: {e}"))?;
        for (w, &v) in w.iter_mut().zip(v) {
            *w += sign * v;
        }
        Ok(())
    })
}

impl Kernel for UpdateKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let value = ctx.input(1)?;
        let cell = ctx.variable_at(0)?;
        match self.mode {
            Mode::Add => Ok(dispatch_real!(value.dtype(), add_into(cell, value, 1.0))?),
            Mode::Sub => Ok(dispatch_real!(value.dtype(), add_into(cell, value, -1.0))?),
            Mode::Set => Ok(cell.update(|slot| {
                if let Some(t) = slot.as_ref() {
                    if t.dims() != value.dims() || t.dtype() != value.dtype() {
                        return Err(format!(
                            "var is {}{:?} but value is {}{:?}",
                            t.dtype(),
                            t.dims(),
                            value.dtype(),
                            value.dims()
                        ));
                    }
                }
                *slot = Some(value.clone());
                Ok(())
            })?),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Runtime shape ops TensorFlow's gradients emit: Shape, Fill, Tile, GatherV2, Prod, ExpandDims,
// FloorMod. Their output shapes depend on tensor values, so the shape rules know ranks only.
// ---------------------------------------------------------------------------------------------

/// The largest tensor a runtime shape op builds from dims it read from another tensor (bytes):
/// a bad value fails the step instead of taking the machine's memory.
pub const MAX_RUNTIME_SHAPE_BYTES: usize = 1 << 32;

pub(crate) fn register_shape_ops(r: &mut OpRegistry) {
    r.add(shape_op());
    r.add(fill_op());
    r.add(tile_op());
    r.add(gather_op());
    r.add(prod_op());
    r.add(expand_dims_op());
    r.add(floor_mod_op());
}

/// The values of an int32/int64 tensor.
pub(crate) fn int_values(t: &Tensor, what: &str) -> Result<Vec<i64>, String> {
    match t.dtype() {
        DType::I32 => Ok(t
            .as_slice::<i32>()
            .map_err(|e| e.to_string())?
            .iter()
            .map(|&v| i64::from(v))
            .collect()),
        DType::I64 => Ok(t.as_slice::<i64>().map_err(|e| e.to_string())?.to_vec()),
        d => Err(format!("{what} must be int32 or int64, found {d}")),
    }
}

/// Dims read from a tensor: each ≥ 0, the tensor within [`MAX_RUNTIME_SHAPE_BYTES`].
pub(crate) fn checked_dims(values: &[i64], dtype: DType, what: &str) -> Result<Vec<usize>, String> {
    let dims = values
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("{what}: dimension {d} is negative")))
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = dims
        .iter()
        .try_fold(dtype.size_of(), |a, &d| a.checked_mul(d))
        .filter(|&b| b <= MAX_RUNTIME_SHAPE_BYTES);
    if bytes.is_none() {
        return Err(format!(
            "{what}: a {dtype} tensor of shape {dims:?} is larger than {MAX_RUNTIME_SHAPE_BYTES} bytes"
        ));
    }
    Ok(dims)
}

fn from_bytes(dtype: DType, dims: &[usize], bytes: &[u8]) -> Result<Tensor, String> {
    Tensor::from_bytes(dtype, dims, bytes).map_err(|e| e.to_string())
}

/// A rank-`n` shape of unknown dims, or unknown when `n` is.
fn rank_only(n: Option<usize>) -> Shape {
    n.map_or_else(Shape::unknown, |n| Shape::partial(vec![None; n]))
}

fn shape_op() -> OpDef {
    OpDef::new(
        "Shape",
        "y = the dims of x, at run time (TensorFlow's Shape). In: x (any dtype). Out: y \
         (out_type, int32 or int64, default int32; shape [rank of x]).",
        |ctx| {
            let x = ctx.input(0)?;
            let out = ctx.dtype("out_type")?;
            if !matches!(out, DType::I32 | DType::I64) {
                return Err(format!("Shape: out_type must be int32 or int64, found {out}").into());
            }
            Ok(vec![TensorType::new(
                out,
                Shape::partial(vec![x.shape.rank()]),
            )])
        },
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .attrs([attr_or(
        "out_type",
        AttrType::DType,
        AttrDefault::DType(DType::I32),
    )])
    .cpu_kernel(ShapeKernel::build)
}

#[derive(Debug)]
struct ShapeKernel {
    out: DType,
}

impl ShapeKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        let out = init.output_types.first().map_or(DType::I32, |t| t.dtype);
        Ok(Box::new(ShapeKernel { out }))
    }
}

impl Kernel for ShapeKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let out = if self.out == DType::I64 {
            let v: Vec<i64> = x.dims().iter().map(|&d| d as i64).collect();
            Tensor::from_slice(&[v.len()], &v)
        } else {
            let v = x
                .dims()
                .iter()
                .map(|&d| i32::try_from(d).map_err(|_| format!("dimension {d} exceeds int32")))
                .collect::<Result<Vec<i32>, _>>()?;
            Tensor::from_slice(&[v.len()], &v)
        };
        ctx.set_output(0, out.map_err(|e| e.to_string())?)
    }
}

/// An int attribute from a kernel's attributes.
fn int_attr(init: &KernelInit<'_>, name: &str) -> Result<i64, String> {
    match init.attr(name)? {
        AttrValue::Int(v) => Ok(*v),
        v => Err(format!("attribute `{name}` is {}, not int", v.ty())),
    }
}

/// `axis` of a rank-`rank` tensor, negative counting from the end.
fn resolve_axis(axis: i64, rank: usize, what: &str) -> Result<usize, String> {
    let r = i64::try_from(rank).map_err(|_| "rank too large".to_string())?;
    let a = if axis < 0 { axis + r } else { axis };
    usize::try_from(a)
        .ok()
        .filter(|&a| a < rank)
        .ok_or_else(|| format!("{what}: axis {axis} is out of range for rank {rank}"))
}

fn fill_op() -> OpDef {
    OpDef::new(
        "Fill",
        "y = value repeated to `shape` (TensorFlow's Fill with constant dims). In: value (a \
         scalar, any dtype). Out: y. Attrs: shape (list(int), required).",
        |ctx| {
            let v = ctx.input(0)?;
            if v.shape.rank().is_some_and(|r| r != 0) {
                return Err(format!("Fill: value must be a scalar, found {v}").into());
            }
            let dims = ctx
                .ints("shape")?
                .iter()
                .map(|&d| {
                    usize::try_from(d).map_err(|_| format!("Fill: dimension {d} is negative"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(vec![TensorType::new(v.dtype, Shape::known(&dims))])
        },
    )
    .inputs([arg("value")])
    .outputs([arg("y")])
    .attrs([attr("shape", AttrType::IntList)])
    .cpu_kernel(FillKernel::build)
}

#[derive(Debug)]
struct FillKernel {
    shape: Vec<i64>,
}

impl FillKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        match init.attr("shape")? {
            AttrValue::IntList(v) => Ok(Box::new(FillKernel { shape: v.clone() })),
            v => Err(format!("attribute `shape` is {}, not list(int)", v.ty()).into()),
        }
    }
}

impl Kernel for FillKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let v = ctx.input(0)?;
        let dims = checked_dims(&self.shape, v.dtype(), "Fill")?;
        let n: usize = dims.iter().product();
        let bytes = v.as_bytes().repeat(n);
        ctx.set_output(0, from_bytes(v.dtype(), &dims, &bytes)?)
    }
}

fn tile_op() -> OpDef {
    OpDef::new(
        "Tile",
        "y = x repeated multiples[i] times along dimension i (TensorFlow's Tile). In: x (any \
         dtype), multiples (int32 or int64, shape [rank of x]). Out: y, x's dtype and rank.",
        |ctx| {
            let (x, m) = (ctx.input(0)?, ctx.input(1)?);
            if !matches!(m.dtype, DType::I32 | DType::I64) {
                return Err(format!("Tile: multiples must be int32 or int64, found {m}").into());
            }
            Ok(vec![TensorType::new(x.dtype, rank_only(x.shape.rank()))])
        },
    )
    .inputs([arg("x"), arg("multiples")])
    .outputs([arg("y")])
    .cpu_kernel(|_| stateless(tile_kernel))
}

fn tile_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let x = ctx.input(0)?;
    let m = int_values(ctx.input(1)?, "Tile: multiples")?;
    if m.len() != x.rank() {
        return Err(format!(
            "Tile: multiples has {} entries but x has rank {}",
            m.len(),
            x.rank()
        )
        .into());
    }
    let out_dims_i: Vec<i64> = x
        .dims()
        .iter()
        .zip(&m)
        .map(|(&d, &k)| (d as i64).saturating_mul(k))
        .collect();
    let out_dims = checked_dims(&out_dims_i, x.dtype(), "Tile")?;
    let size = x.dtype().size_of();
    let src = x.as_bytes();
    let n: usize = out_dims.iter().product();
    let mut out = vec![0u8; n * size];
    // Row-major walk over the output: each output index maps to index mod input dim.
    let rank = out_dims.len();
    let mut idx = vec![0usize; rank];
    let in_strides = strides(x.dims());
    for o in 0..n {
        let i: usize = (0..rank)
            .map(|d| (idx[d] % x.dims()[d].max(1)) * in_strides[d])
            .sum();
        out[o * size..(o + 1) * size].copy_from_slice(&src[i * size..(i + 1) * size]);
        for d in (0..rank).rev() {
            idx[d] += 1;
            if idx[d] < out_dims[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    ctx.set_output(0, from_bytes(x.dtype(), &out_dims, &out)?)
}

/// Row-major strides (in elements) of `dims`.
fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for d in (0..dims.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * dims[d + 1];
    }
    s
}

fn gather_op() -> OpDef {
    OpDef::new(
        "GatherV2",
        "y = params gathered at indices along `axis` (TensorFlow's GatherV2, batch_dims 0). In: \
         params (any dtype), indices (int32 or int64). Out: y, shape params[:axis] + \
         indices.shape + params[axis+1:]. Attrs: axis (int, default 0).",
        |ctx| {
            let (p, i) = (ctx.input(0)?, ctx.input(1)?);
            if !matches!(i.dtype, DType::I32 | DType::I64) {
                return Err(format!("GatherV2: indices must be int32 or int64, found {i}").into());
            }
            let shape = match (p.shape.dims(), i.shape.dims()) {
                (Some(pd), Some(id)) => {
                    let axis = resolve_axis(ctx.int("axis")?, pd.len(), "GatherV2")?;
                    let mut dims = pd[..axis].to_vec();
                    dims.extend_from_slice(id);
                    dims.extend_from_slice(&pd[axis + 1..]);
                    Shape::partial(dims)
                }
                _ => Shape::unknown(),
            };
            Ok(vec![TensorType::new(p.dtype, shape)])
        },
    )
    .inputs([arg("params"), arg("indices")])
    .outputs([arg("y")])
    .attrs([attr_or("axis", AttrType::Int, AttrDefault::Int(0))])
    .cpu_kernel(GatherKernel::build)
}

#[derive(Debug)]
struct GatherKernel {
    axis: i64,
}

impl GatherKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        Ok(Box::new(GatherKernel {
            axis: int_attr(init, "axis")?,
        }))
    }
}

impl Kernel for GatherKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let p = ctx.input(0)?;
        let indices_t = ctx.input(1)?;
        let indices = int_values(indices_t, "GatherV2: indices")?;
        let axis = resolve_axis(self.axis, p.rank(), "GatherV2")?;
        let pd = p.dims();
        let outer: usize = pd[..axis].iter().product();
        let inner: usize = pd[axis + 1..].iter().product();
        let size = p.dtype().size_of();
        let chunk = inner * size;
        let src = p.as_bytes();
        let mut out = Vec::with_capacity(outer * indices.len() * chunk);
        for o in 0..outer {
            for &ix in &indices {
                let ix = usize::try_from(ix)
                    .ok()
                    .filter(|&i| i < pd[axis])
                    .ok_or_else(|| {
                        format!("GatherV2: index {ix} is out of range 0..{}", pd[axis])
                    })?;
                let start = (o * pd[axis] + ix) * chunk;
                out.extend_from_slice(&src[start..start + chunk]);
            }
        }
        let mut dims = pd[..axis].to_vec();
        dims.extend_from_slice(indices_t.dims());
        dims.extend_from_slice(&pd[axis + 1..]);
        ctx.set_output(0, from_bytes(p.dtype(), &dims, &out)?)
    }
}

fn prod_op() -> OpDef {
    OpDef::new(
        "Prod",
        "y = the product of x over `axes` (TensorFlow's Prod; empty axes: all). In: x (int32, \
         int64, f32, f64). Out: y, x's dtype. Attrs: axes (list(int), default all), keep_dims \
         (bool, default false).",
        |ctx| {
            let x = ctx.input(0)?;
            if !matches!(x.dtype, DType::I32 | DType::I64 | DType::F32 | DType::F64) {
                return Err(format!("Prod: x must be int32, int64, f32 or f64, found {x}").into());
            }
            let keep = ctx.bool("keep_dims")?;
            let shape = match x.shape.dims() {
                Some(dims) => {
                    let axes = reduced_axes(ctx.ints("axes")?, dims.len())?;
                    let kept: Vec<Option<usize>> = dims
                        .iter()
                        .enumerate()
                        .filter_map(|(i, &d)| match (axes.contains(&i), keep) {
                            (true, true) => Some(Some(1)),
                            (true, false) => None,
                            (false, _) => Some(d),
                        })
                        .collect();
                    Shape::partial(kept)
                }
                None => Shape::unknown(),
            };
            Ok(vec![TensorType::new(x.dtype, shape)])
        },
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .attrs([
        attr_or("axes", AttrType::IntList, AttrDefault::Ints(&[])),
        attr_or("keep_dims", AttrType::Bool, AttrDefault::Bool(false)),
    ])
    .cpu_kernel(ProdKernel::build)
}

/// The axes a reduction covers (empty: all), resolved and deduplicated.
fn reduced_axes(axes: &[i64], rank: usize) -> Result<Vec<usize>, String> {
    if axes.is_empty() {
        return Ok((0..rank).collect());
    }
    let mut out = axes
        .iter()
        .map(|&a| resolve_axis(a, rank, "Prod"))
        .collect::<Result<Vec<_>, _>>()?;
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[derive(Debug)]
struct ProdKernel {
    axes: Vec<i64>,
    keep: bool,
}

impl ProdKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        let axes = match init.attr("axes")? {
            AttrValue::IntList(v) => v.clone(),
            v => return Err(format!("attribute `axes` is {}, not list(int)", v.ty()).into()),
        };
        let keep = match init.attr("keep_dims")? {
            AttrValue::Bool(b) => *b,
            v => return Err(format!("attribute `keep_dims` is {}, not bool", v.ty()).into()),
        };
        Ok(Box::new(ProdKernel { axes, keep }))
    }
}

impl Kernel for ProdKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let dims = x.dims();
        let axes = reduced_axes(&self.axes, dims.len())?;
        let out_full: Vec<usize> = dims
            .iter()
            .enumerate()
            .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
            .collect();
        let n_out: usize = out_full.iter().product();
        let mut acc = vec![1.0f64; n_out];
        let (in_s, out_s) = (strides(dims), strides(&out_full));
        for (flat, v) in x.to_f64_vec().into_iter().enumerate() {
            let o: usize = (0..dims.len())
                .map(|d| {
                    let i = (flat / in_s[d]) % dims[d].max(1);
                    if axes.contains(&d) {
                        0
                    } else {
                        i * out_s[d]
                    }
                })
                .sum();
            acc[o] *= v;
        }
        let out_dims: Vec<usize> = if self.keep {
            out_full
        } else {
            dims.iter()
                .enumerate()
                .filter(|(i, _)| !axes.contains(i))
                .map(|(_, &d)| d)
                .collect()
        };
        let t = match x.dtype() {
            DType::I32 => {
                let v: Vec<i32> = acc.iter().map(|&a| a as i32).collect();
                Tensor::from_slice(&out_dims, &v)
            }
            DType::I64 => {
                let v: Vec<i64> = acc.iter().map(|&a| a as i64).collect();
                Tensor::from_slice(&out_dims, &v)
            }
            DType::F32 => {
                let v: Vec<f32> = acc.iter().map(|&a| a as f32).collect();
                Tensor::from_slice(&out_dims, &v)
            }
            DType::F64 => Tensor::from_slice(&out_dims, &acc),
            d => return Err(format!("Prod: unsupported dtype {d}").into()),
        };
        ctx.set_output(0, t.map_err(|e| e.to_string())?)
    }
}

fn expand_dims_op() -> OpDef {
    OpDef::new(
        "ExpandDims",
        "y = x with a dimension of size 1 inserted at `axis` (TensorFlow's ExpandDims; negative \
         counts from the end of the output). In: x (any dtype). Out: y. Attrs: axis (int).",
        |ctx| {
            let x = ctx.input(0)?;
            let shape = match x.shape.dims() {
                Some(d) => {
                    let at = resolve_axis(ctx.int("axis")?, d.len() + 1, "ExpandDims")?;
                    let mut dims = d.to_vec();
                    dims.insert(at, Some(1));
                    Shape::partial(dims)
                }
                None => Shape::unknown(),
            };
            Ok(vec![TensorType::new(x.dtype, shape)])
        },
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .attrs([attr("axis", AttrType::Int)])
    .cpu_kernel(ExpandDimsKernel::build)
}

#[derive(Debug)]
struct ExpandDimsKernel {
    axis: i64,
}

impl ExpandDimsKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        Ok(Box::new(ExpandDimsKernel {
            axis: int_attr(init, "axis")?,
        }))
    }
}

impl Kernel for ExpandDimsKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let at = resolve_axis(self.axis, x.rank() + 1, "ExpandDims")?;
        let mut dims = x.dims().to_vec();
        dims.insert(at, 1);
        let y = x.reshaped(&dims).map_err(|e| e.to_string())?;
        ctx.set_output(0, y)
    }
}

fn floor_mod_op() -> OpDef {
    OpDef::new(
        "FloorMod",
        "z = x mod y with the sign of y (TensorFlow's FloorMod), element-wise; one side may be a \
         scalar. In: x, y (int32 or int64, one dtype). Out: z.",
        |ctx| {
            let (x, y) = (ctx.input(0)?, ctx.input(1)?);
            if x.dtype != y.dtype || !matches!(x.dtype, DType::I32 | DType::I64) {
                return Err(format!(
                    "FloorMod: x and y must be int32 or int64 of one dtype, found {x} and {y}"
                )
                .into());
            }
            let shape = if y.shape.rank() == Some(0) {
                x.shape.clone()
            } else {
                y.shape.clone()
            };
            Ok(vec![TensorType::new(x.dtype, shape)])
        },
    )
    .inputs([arg("x"), arg("y")])
    .outputs([arg("z")])
    .cpu_kernel(|_| stateless(floor_mod_kernel))
}

fn floor_mod_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let (xv, yv) = (int_values(x, "FloorMod: x")?, int_values(y, "FloorMod: y")?);
    let (n, dims) = if xv.len() >= yv.len() {
        (xv.len(), x.dims().to_vec())
    } else {
        (yv.len(), y.dims().to_vec())
    };
    let pick = |v: &[i64], i: usize| -> Result<i64, String> {
        match v.len() {
            1 => Ok(v[0]),
            l if l == n => Ok(v[i]),
            _ => Err(format!(
                "FloorMod: shapes {:?} and {:?} do not match",
                x.dims(),
                y.dims()
            )),
        }
    };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (a, b) = (pick(&xv, i)?, pick(&yv, i)?);
        if b == 0 {
            return Err("FloorMod: division by zero".into());
        }
        out.push(a.rem_euclid(b) + if b < 0 && a.rem_euclid(b) != 0 { b } else { 0 });
    }
    let t = if x.dtype() == DType::I32 {
        let v: Vec<i32> = out.iter().map(|&v| v as i32).collect();
        Tensor::from_slice(&dims, &v)
    } else {
        Tensor::from_slice(&dims, &out)
    };
    ctx.set_output(0, t.map_err(|e| e.to_string())?)
}

#[cfg(test)]
mod tests {
    use super::super::math::{infer, tt};
    use super::super::testing::{run_kernel, run_kernel_with};
    use super::*;
    use std::sync::Arc;
    use DType::*;

    fn ints(t: &Tensor) -> Vec<i64> {
        int_values(t, "t").unwrap()
    }

    fn run1(op: &str, attrs: &[(&str, AttrValue)], inputs: &[Tensor]) -> Tensor {
        run_kernel(op, attrs, inputs)
            .unwrap_or_else(|e| panic!("{op}: {e}"))
            .remove(0)
    }

    #[test]
    fn ops_lists_what_is_registered() {
        for op in OPS {
            assert!(registry().get(op).is_some(), "{op}");
        }
    }

    #[test]
    fn shape_and_fill() {
        let x = Tensor::zeros(F32, &[2, 3]).unwrap();
        assert_eq!(ints(&run1("Shape", &[], std::slice::from_ref(&x))), [2, 3]);
        let s64 = run1("Shape", &[("out_type", AttrValue::DType(I64))], &[x]);
        assert_eq!(s64.dtype(), I64);
        assert_eq!(
            infer("Shape", &[tt(F32, &[-1, 3])], &[]),
            Ok(vec![tt(I32, &[2])])
        );
        let f = run1(
            "Fill",
            &[("shape", AttrValue::IntList(vec![2, 2]))],
            &[Tensor::scalar(1.5f32)],
        );
        assert_eq!(f.as_slice::<f32>().unwrap(), [1.5; 4]);
        let e = run_kernel(
            "Fill",
            &[("shape", AttrValue::IntList(vec![1 << 40, 1 << 40]))],
            &[Tensor::scalar(1.5f32)],
        )
        .unwrap_err();
        assert!(e.contains("larger than"), "{e}");
    }

    #[test]
    fn tile_repeats_along_each_dimension() {
        let x = Tensor::from_slice(&[2, 2], &[1i32, 2, 3, 4]).unwrap();
        let m = Tensor::from_slice(&[2], &[2i32, 3]).unwrap();
        let y = run1("Tile", &[], &[x, m]);
        assert_eq!(y.dims(), [4, 6]);
        assert_eq!(
            ints(&y),
            [1, 2, 1, 2, 1, 2, 3, 4, 3, 4, 3, 4, 1, 2, 1, 2, 1, 2, 3, 4, 3, 4, 3, 4]
        );
        let bad = Tensor::from_slice(&[1], &[2i32]).unwrap();
        let x = Tensor::zeros(F32, &[2, 2]).unwrap();
        assert!(run_kernel("Tile", &[], &[x.clone(), bad]).is_err());
        let huge = Tensor::from_slice(&[2], &[1i64 << 40, 1 << 40]).unwrap();
        assert!(run_kernel("Tile", &[], &[x, huge])
            .unwrap_err()
            .contains("larger than"));
    }

    #[test]
    fn gather_takes_slices_along_the_axis() {
        let p = Tensor::from_slice(&[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let i = Tensor::from_slice(&[2], &[2i32, 0]).unwrap();
        let y = run1(
            "GatherV2",
            &[("axis", AttrValue::Int(1))],
            &[p.clone(), i.clone()],
        );
        assert_eq!(y.dims(), [2, 2]);
        assert_eq!(y.as_slice::<f32>().unwrap(), [3.0, 1.0, 6.0, 4.0]);
        let y = run1("GatherV2", &[], &[p.clone(), Tensor::scalar(1i32)]);
        assert_eq!(
            (y.dims(), y.as_slice::<f32>().unwrap()),
            (&[3][..], &[4.0, 5.0, 6.0][..])
        );
        let out_of_range = Tensor::from_slice(&[1], &[7i32]).unwrap();
        assert!(run_kernel("GatherV2", &[], &[p, out_of_range])
            .unwrap_err()
            .contains("out of range"));
    }

    #[test]
    fn prod_reduces_like_tensorflow() {
        let x = Tensor::from_slice(&[2, 3], &[1i32, 2, 3, 4, 5, 6]).unwrap();
        let axes = |a: &[i64]| ("axes", AttrValue::IntList(a.to_vec()));
        assert_eq!(
            ints(&run1("Prod", &[axes(&[0])], std::slice::from_ref(&x))),
            [4, 10, 18]
        );
        assert_eq!(
            ints(&run1("Prod", &[axes(&[1])], std::slice::from_ref(&x))),
            [6, 120]
        );
        assert_eq!(ints(&run1("Prod", &[], std::slice::from_ref(&x))), [720]);
        let kept = run1(
            "Prod",
            &[axes(&[-1]), ("keep_dims", AttrValue::Bool(true))],
            &[x],
        );
        assert_eq!(kept.dims(), [2, 1]);
        assert_eq!(
            infer("Prod", &[tt(I32, &[-1, 3])], &[axes(&[0])]),
            Ok(vec![tt(I32, &[3])])
        );
    }

    #[test]
    fn expand_dims_and_floor_mod() {
        let x = Tensor::from_slice(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
        let y = run1("ExpandDims", &[("axis", AttrValue::Int(-1))], &[x]);
        assert_eq!(y.dims(), [3, 1]);
        assert_eq!(
            infer(
                "ExpandDims",
                &[tt(F32, &[-1])],
                &[("axis", AttrValue::Int(0))]
            ),
            Ok(vec![tt(F32, &[1, -1])])
        );
        let a = Tensor::from_slice(&[4], &[7i32, -7, 7, -7]).unwrap();
        let b = Tensor::from_slice(&[4], &[3i32, 3, -3, -3]).unwrap();
        // TensorFlow: floormod(7,3)=1, (-7,3)=2, (7,-3)=-2, (-7,-3)=-1.
        assert_eq!(
            ints(&run1("FloorMod", &[], &[a.clone(), b])),
            [1, 2, -2, -1]
        );
        assert_eq!(
            ints(&run1("FloorMod", &[], &[a, Tensor::scalar(3i32)])),
            [1, 2, 1, 2]
        );
        let e = run_kernel(
            "FloorMod",
            &[],
            &[Tensor::scalar(1i32), Tensor::scalar(0i32)],
        );
        assert!(e.unwrap_err().contains("division by zero"));
    }

    #[test]
    fn adam_with_powers_follows_tensorflow() {
        let cells: Vec<Arc<VariableCell>> = [1.0f64, 0.1, 0.01]
            .iter()
            .map(|&x| {
                let c = Arc::new(VariableCell::default());
                c.update(|s| *s = Some(Tensor::from_slice(&[1], &[x]).unwrap()));
                c
            })
            .collect();
        let (b1p, b2p, g) = (0.9f64, 0.999f64, 0.5f64);
        let attrs = [
            ("lr", AttrValue::Float(0.1)),
            ("beta1", AttrValue::Float(0.9)),
            ("beta2", AttrValue::Float(0.999)),
            ("epsilon", AttrValue::Float(1e-7)),
        ];
        let read = |c: &Arc<VariableCell>| c.update(|s| s.clone()).unwrap();
        let inputs = [
            read(&cells[0]),
            read(&cells[1]),
            read(&cells[2]),
            Tensor::scalar(b1p),
            Tensor::scalar(b2p),
            Tensor::from_slice(&[1], &[g]).unwrap(),
        ];
        let types: Vec<TensorType> = inputs
            .iter()
            .map(|t| TensorType::new(t.dtype(), t.shape()))
            .collect();
        run_kernel_with("ApplyAdamWithPowers", "n", &attrs, &types, &inputs, &cells).unwrap();
        // TensorFlow's ApplyAdam, by hand.
        let m = 0.1 + (g - 0.1) * 0.1;
        let v = 0.01 + (g * g - 0.01) * 0.001;
        let lr_t = 0.1 * (1.0 - b2p).sqrt() / (1.0 - b1p);
        let w = 1.0 - lr_t * m / (v.sqrt() + 1e-7);
        for (c, want) in cells.iter().zip([w, m, v]) {
            let got = read(c).as_slice::<f64>().unwrap()[0];
            assert!((got - want).abs() < 1e-12, "{got} vs {want}");
        }
    }

    #[test]
    fn assign_updates_change_the_variable() {
        let cell = Arc::new(VariableCell::default());
        cell.update(|s| *s = Some(Tensor::from_slice(&[2], &[1.0f32, 2.0]).unwrap()));
        let v = Tensor::from_slice(&[2], &[0.5f32, 0.5]).unwrap();
        let ty = [tt(F32, &[2]), tt(F32, &[2])];
        let current = || cell.update(|s| s.clone()).unwrap();
        for (op, want) in [
            ("AssignAdd", [1.5, 2.5]),
            ("AssignSub", [1.0, 2.0]),
            ("Assign", [0.5, 0.5]),
        ] {
            run_kernel_with(
                op,
                "n",
                &[],
                &ty,
                &[current(), v.clone()],
                std::slice::from_ref(&cell),
            )
            .unwrap_or_else(|e| panic!("{op}: {e}"));
            assert_eq!(current().as_slice::<f32>().unwrap(), want, "{op}");
        }
        let wrong = Tensor::from_slice(&[3], &[1.0f32, 1.0, 1.0]).unwrap();
        let e = run_kernel_with(
            "AssignAdd",
            "n",
            &[],
            &[tt(F32, &[2]), tt(F32, &[3])],
            &[current(), wrong],
            std::slice::from_ref(&cell),
        );
        assert!(e.is_err());
    }
}
