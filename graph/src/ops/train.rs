//! Optimizer ops: ApplyGradientDescent, ApplyMomentum, ApplyAdam, ApplyAdamW, IncrementStep,
//! and GlobalNormScale (with SquaredNorm, its partial sums) for clipping by global norm, with their
//! CPU kernels.
//!
//! ApplyAdam and ApplyAdamW take an optional learning-rate schedule as attributes
//! (`warmup_steps`, `decay_steps`, `min_lr`; see [`crate::train::lr_at`]), evaluated at the step
//! count `t` they read, so a schedule costs no extra op or transfer.
//!
//! The update ops take their variable (and its optimizer slots) as reference inputs, so they are
//! placed with the variable — on ps in the parameter-server pattern — and only the gradient
//! crosses devices. They have no outputs; a training step depends on them through control edges.
//!
//! **Difference from TensorFlow:** ApplyAdam reads the step count `t` (the number of steps
//! already taken, a scalar) as a plain data input instead of taking `beta1_power` and
//! `beta2_power`; it computes `β^(t+1)` itself. One `IncrementStep` on the shared counter runs
//! after every ApplyAdam of the step. A data input (not a reference) lets variables on
//! different ps tasks share one counter.

use super::grad::{dispatch_real, Real};
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit, VariableCell};

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(apply_gradient_descent());
    r.add(apply_momentum());
    r.add(apply_adam());
    r.add(apply_adam_w());
    r.add(increment_step());
    r.add(global_norm_scale());
    r.add(squared_norm());
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// Shape rule of an update: every `(name, type)` has `var`'s float dtype and a compatible shape.
fn update_infer(op: &str, var: &TensorType, others: &[(&str, &TensorType)]) -> Result<(), String> {
    require_float(&format!("{op}: var"), var)?;
    for (name, t) in others {
        if t.dtype != var.dtype {
            return Err(format!(
                "{op}: var is {var} but {name} is {t}; both must have the same dtype"
            ));
        }
        if !t.shape.is_compatible_with(&var.shape) {
            return Err(format!(
                "{op}: var has shape {} but {name} has shape {}; they must match",
                var.shape, t.shape
            ));
        }
    }
    Ok(())
}

fn float_attr(init: &KernelInit<'_>, name: &str) -> Result<f64, String> {
    match init.attr(name)? {
        AttrValue::Float(x) => Ok(*x),
        v => Err(format!("attribute `{name}` is {}, not float", v.ty())),
    }
}

fn bool_attr(init: &KernelInit<'_>, name: &str) -> Result<bool, String> {
    match init.attr(name)? {
        AttrValue::Bool(b) => Ok(*b),
        v => Err(format!("attribute `{name}` is {}, not bool", v.ty())),
    }
}

/// Runs `f` on the elements of the variable in `cell` under its lock, after checking it is
/// initialized and has the gradient's shape `dims`.
fn with_slice<T: Real, R>(
    cell: &VariableCell,
    what: &str,
    dims: &[usize],
    f: impl FnOnce(&mut [T]) -> Result<R, String>,
) -> Result<R, String> {
    with_shaped_slice(cell, what, dims, "the gradient", f)
}

/// Runs `f` on the elements of the variable in `cell` under its lock, after checking it is
/// initialized and has shape `dims`, the shape of `expected` (named in the error).
pub(super) fn with_shaped_slice<T: Real, R>(
    cell: &VariableCell,
    what: &str,
    dims: &[usize],
    expected: &str,
    f: impl FnOnce(&mut [T]) -> Result<R, String>,
) -> Result<R, String> {
    cell.update(|slot| {
        let t = slot
            .as_mut()
            .ok_or_else(|| format!("{what} is not initialized"))?;
        if t.dims() != dims {
            return Err(format!(
                "{what} has shape {:?} but {expected} has shape {dims:?}",
                t.dims()
            ));
        }
        let s = t.as_mut_slice::<T>().map_err(|e| format!("{what}: {e}"))?;
        f(s)
    })
}

/// Runs `f` on the elements of var an update writes: all of them (checked against the
/// gradient's shape `dims`) when `offset` is `None`, else the flattened window
/// `[offset, min(offset + len, var's length))` for a vector shard of `len` elements.
fn with_var_window<T: Real, R>(
    cell: &VariableCell,
    offset: Option<usize>,
    dims: &[usize],
    f: impl FnOnce(&mut [T]) -> Result<R, String>,
) -> Result<R, String> {
    let Some(offset) = offset else {
        return with_slice(cell, "var", dims, f);
    };
    let len = dims.iter().product::<usize>();
    cell.update(|slot| {
        let t = slot
            .as_mut()
            .ok_or_else(|| "var is not initialized".to_string())?;
        let s = t.as_mut_slice::<T>().map_err(|e| format!("var: {e}"))?;
        let total = s.len();
        let end = offset.saturating_add(len).min(total);
        let window = s
            .get_mut(offset..end)
            .ok_or_else(|| format!("shard_offset {offset} is past var's {total} elements"))?;
        f(window)
    })
}

fn grad_slice<T: Real>(g: &Tensor) -> Result<&[T], String> {
    g.as_slice::<T>().map_err(|e| format!("grad: {e}"))
}

// ---------------------------------------------------------------------------------------------
// ApplyGradientDescent
// ---------------------------------------------------------------------------------------------

fn apply_gradient_descent() -> OpDef {
    OpDef::new(
        "ApplyGradientDescent",
        "var -= lr * grad. In: var (reference to a float Variable), grad (same type). No \
         outputs. Attrs: lr (float, required).",
        |ctx| {
            update_infer(
                "ApplyGradientDescent",
                ctx.input(0)?,
                &[("grad", ctx.input(1)?)],
            )?;
            Ok(vec![])
        },
    )
    .inputs([ref_arg("var"), arg("grad")])
    .attrs([attr("lr", AttrType::Float)])
    .stateful()
    .cpu_kernel(SgdKernel::build)
}

#[derive(Debug)]
struct SgdKernel {
    lr: f64,
}

impl SgdKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        Ok(Box::new(SgdKernel {
            lr: float_attr(init, "lr")?,
        }))
    }
}

fn sgd<T: Real>(var: &VariableCell, g: &Tensor, lr: f64) -> Result<(), String> {
    let (gs, lr) = (grad_slice::<T>(g)?, T::from_f64(lr));
    with_slice::<T, _>(var, "var", g.dims(), |w| {
        for (w, &g) in w.iter_mut().zip(gs) {
            *w = *w - lr * g;
        }
        Ok(())
    })
}

impl Kernel for SgdKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let g = ctx.input(1)?;
        dispatch_real!(g.dtype(), sgd(ctx.variable_at(0)?, g, self.lr))
    }
}

// ---------------------------------------------------------------------------------------------
// ApplyMomentum
// ---------------------------------------------------------------------------------------------

fn apply_momentum() -> OpDef {
    OpDef::new(
        "ApplyMomentum",
        "accum = accum * momentum + grad; var -= lr * accum, or with use_nesterov var -= lr * grad \
         + lr * momentum * accum (TensorFlow's ApplyMomentum). In: var, accum (references to \
         float Variables of one type), grad (same type). No outputs. Attrs: lr, momentum \
         (float, required), use_nesterov (bool, default false).",
        |ctx| {
            let var = ctx.input(0)?;
            update_infer(
                "ApplyMomentum",
                var,
                &[("accum", ctx.input(1)?), ("grad", ctx.input(2)?)],
            )?;
            Ok(vec![])
        },
    )
    .inputs([ref_arg("var"), ref_arg("accum"), arg("grad")])
    .attrs([
        attr("lr", AttrType::Float),
        attr("momentum", AttrType::Float),
        attr_or("use_nesterov", AttrType::Bool, AttrDefault::Bool(false)),
    ])
    .stateful()
    .cpu_kernel(MomentumKernel::build)
}

#[derive(Debug)]
struct MomentumKernel {
    lr: f64,
    momentum: f64,
    nesterov: bool,
}

impl MomentumKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        Ok(Box::new(MomentumKernel {
            lr: float_attr(init, "lr")?,
            momentum: float_attr(init, "momentum")?,
            nesterov: bool_attr(init, "use_nesterov")?,
        }))
    }
}

fn momentum<T: Real>(
    k: &MomentumKernel,
    var: &VariableCell,
    accum: &VariableCell,
    g: &Tensor,
) -> Result<(), String> {
    let gs = grad_slice::<T>(g)?;
    let (lr, mu) = (T::from_f64(k.lr), T::from_f64(k.momentum));
    with_slice::<T, _>(accum, "accum", g.dims(), |a| {
        with_slice::<T, _>(var, "var", g.dims(), |w| {
            for ((w, a), &g) in w.iter_mut().zip(a.iter_mut()).zip(gs) {
                *a = *a * mu + g;
                *w = if k.nesterov {
                    *w - (g * lr + *a * mu * lr)
                } else {
                    *w - lr * *a
                };
            }
            Ok(())
        })
    })
}

impl Kernel for MomentumKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let g = ctx.input(2)?;
        let (var, accum) = (ctx.variable_at(0)?, ctx.variable_at(1)?);
        dispatch_real!(g.dtype(), momentum(self, var, accum, g))
    }
}

// ---------------------------------------------------------------------------------------------
// ApplyAdam
// ---------------------------------------------------------------------------------------------

fn apply_adam() -> OpDef {
    OpDef::new(
        "ApplyAdam",
        "Adam (TensorFlow's ApplyAdam) at step n = t + 1: lr_n = lr * sqrt(1 - beta2^n) / \
         (1 - beta1^n); m += (grad - m) * (1 - beta1); v += (grad² - v) * (1 - beta2); \
         var -= lr_n * m / (sqrt(v) + epsilon). In: var, m, v (references to float Variables of \
         one type), t (scalar: steps taken so far, i32/i64/f32/f64), grad (var's type). No \
         outputs. Attrs: lr (float, required), beta1 (0.9), beta2 (0.999), epsilon (1e-7), \
         shard_offset (-1: the whole var; o >= 0: m, v, grad are a vector shard of var's \
         flattened elements from o, see ZeRO).",
        |ctx| adam_family_infer("ApplyAdam", ctx),
    )
    .inputs(ADAM_FAMILY_INPUTS)
    .attrs([
        attr("lr", AttrType::Float),
        attr_or("beta1", AttrType::Float, AttrDefault::Float(0.9)),
        attr_or("beta2", AttrType::Float, AttrDefault::Float(0.999)),
        attr_or("epsilon", AttrType::Float, AttrDefault::Float(1e-7)),
        SCHEDULE_ATTRS[0],
        SCHEDULE_ATTRS[1],
        SCHEDULE_ATTRS[2],
        SHARD_OFFSET_ATTR,
    ])
    .stateful()
    .cpu_kernel(AdamKernel::build)
}

/// The inputs of ApplyAdam and ApplyAdamW: the variable and its two slots (references), the
/// step count, the gradient.
const ADAM_FAMILY_INPUTS: [ArgDef; 5] = [
    ref_arg("var"),
    ref_arg("m"),
    ref_arg("v"),
    arg("t"),
    arg("grad"),
];

/// Shape rule of ApplyAdam and ApplyAdamW: var, m, v and grad agree (or, with `shard_offset`
/// set, m, v and grad are one vector shard of var's flattened elements); t is a numeric scalar.
fn adam_family_infer(op: &str, ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let var = ctx.input(0)?;
    let offset = ctx.int("shard_offset")?;
    if offset < 0 {
        update_infer(
            op,
            var,
            &[
                ("m", ctx.input(1)?),
                ("v", ctx.input(2)?),
                ("grad", ctx.input(4)?),
            ],
        )?;
    } else {
        require_float(&format!("{op}: var"), var)?;
        let grad = ctx.input(4)?;
        if grad.shape.rank().is_some_and(|r| r != 1) {
            return Err(format!(
                "{op}: with shard_offset, grad must be a vector (a shard of var's flattened \
                 elements), got {grad}"
            )
            .into());
        }
        let shard = TensorType::new(var.dtype, grad.shape.clone());
        update_infer(
            op,
            &shard,
            &[("m", ctx.input(1)?), ("v", ctx.input(2)?), ("grad", grad)],
        )?;
        if let Some(n) = var.shape.as_static().map(|d| d.iter().product::<usize>()) {
            if offset as u64 >= n.max(1) as u64 {
                return Err(
                    format!("{op}: shard_offset {offset} is past var's {n} elements").into(),
                );
            }
        }
    }
    let t = ctx.input(3)?;
    if !(t.dtype.is_float() || t.dtype.is_int()) || t.shape.rank().is_some_and(|r| r != 0) {
        return Err(format!("{op}: t must be a numeric scalar, got {t}").into());
    }
    Ok(vec![])
}

/// `shard_offset` of the Adam family: -1 (the default) updates the whole variable; `o >= 0`
/// makes m, v and grad one vector shard of `S` elements and updates only var's flattened
/// elements `[o, min(o + S, len))` (ZeRO: each rank updates its shard of every parameter; the
/// shard's padding past the end of var is ignored).
const SHARD_OFFSET_ATTR: AttrDef = attr_or("shard_offset", AttrType::Int, AttrDefault::Int(-1));

/// The learning-rate schedule attributes of the Adam family (defaults: no schedule).
const SCHEDULE_ATTRS: [AttrDef; 3] = [
    attr_or("warmup_steps", AttrType::Int, AttrDefault::Int(0)),
    attr_or("decay_steps", AttrType::Int, AttrDefault::Int(0)),
    attr_or("min_lr", AttrType::Float, AttrDefault::Float(0.0)),
];

/// A base learning rate and its schedule, read from an update op's attributes.
#[derive(Debug, Clone, Copy)]
struct ScheduledLr {
    lr: f64,
    warmup_steps: u64,
    decay_steps: u64,
    min_lr: f64,
}

impl ScheduledLr {
    fn from_attrs(init: &KernelInit<'_>) -> Result<Self, String> {
        let steps = |name: &str| match init.attr(name)? {
            AttrValue::Int(v) if *v >= 0 => Ok(*v as u64),
            v => Err(format!("attribute `{name}` must be an int >= 0, got {v:?}")),
        };
        Ok(ScheduledLr {
            lr: float_attr(init, "lr")?,
            warmup_steps: steps("warmup_steps")?,
            decay_steps: steps("decay_steps")?,
            min_lr: float_attr(init, "min_lr")?,
        })
    }

    /// The learning rate after `t` steps.
    fn at(&self, t: f64) -> f64 {
        let it = if t.is_finite() && t > 0.0 {
            t as u64
        } else {
            0
        };
        crate::train::lr_at(
            self.lr,
            it,
            self.warmup_steps,
            self.decay_steps,
            self.min_lr,
        )
    }
}

#[derive(Debug)]
struct AdamKernel {
    lr: ScheduledLr,
    beta1: f64,
    beta2: f64,
    epsilon: f64,
    /// `shard_offset` when it is set.
    shard_offset: Option<usize>,
}

impl AdamKernel {
    fn from_attrs(init: &KernelInit<'_>) -> Result<Self, String> {
        Ok(AdamKernel {
            lr: ScheduledLr::from_attrs(init)?,
            beta1: float_attr(init, "beta1")?,
            beta2: float_attr(init, "beta2")?,
            epsilon: float_attr(init, "epsilon")?,
            shard_offset: match init.attr("shard_offset")? {
                AttrValue::Int(o) => usize::try_from(*o).ok(),
                v => return Err(format!("attribute `shard_offset` is {}, not int", v.ty())),
            },
        })
    }

    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        Ok(Box::new(Self::from_attrs(init)?))
    }
}

/// The value of a numeric scalar tensor as f64.
fn scalar_value(t: &Tensor, what: &str) -> Result<f64, String> {
    match (t.num_elements(), t.to_f64_vec().first()) {
        (1, Some(&x)) => Ok(x),
        _ => Err(format!("{what} must be a scalar, got shape {:?}", t.dims())),
    }
}

fn adam<T: Real>(
    k: &AdamKernel,
    cells: [&VariableCell; 3],
    step: f64,
    g: &Tensor,
) -> Result<(), String> {
    let gs = grad_slice::<T>(g)?;
    let n = step + 1.0;
    let lr_t = k.lr.at(step) * (1.0 - k.beta2.powf(n)).sqrt() / (1.0 - k.beta1.powf(n));
    let (lr_t, eps) = (T::from_f64(lr_t), T::from_f64(k.epsilon));
    let (one_b1, one_b2) = (T::from_f64(1.0 - k.beta1), T::from_f64(1.0 - k.beta2));
    let [var, m, v] = cells;
    with_slice::<T, _>(m, "m", g.dims(), |ms| {
        with_slice::<T, _>(v, "v", g.dims(), |vs| {
            with_var_window::<T, _>(var, k.shard_offset, g.dims(), |ws| {
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

impl Kernel for AdamKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let step = scalar_value(ctx.input(3)?, "t")?;
        let g = ctx.input(4)?;
        let cells = [
            ctx.variable_at(0)?,
            ctx.variable_at(1)?,
            ctx.variable_at(2)?,
        ];
        dispatch_real!(g.dtype(), adam(self, cells, step, g))
    }
}

// ---------------------------------------------------------------------------------------------
// ApplyAdamW
// ---------------------------------------------------------------------------------------------

fn apply_adam_w() -> OpDef {
    OpDef::new(
        "ApplyAdamW",
        "AdamW (PyTorch's torch.optim.AdamW) at step n = t + 1 with lr = the scheduled lr of \
         step t: var *= 1 - lr * weight_decay; m = beta1 m + (1 - beta1) grad; v = beta2 v + \
         (1 - beta2) grad²; var -= lr * (m / (1 - beta1^n)) / (sqrt(v / (1 - beta2^n)) + \
         epsilon). In: var, m, v (references to float Variables of one type), t (scalar: steps \
         taken so far), grad (var's type). No outputs. Attrs: lr (float, required), beta1 \
         (0.9), beta2 (0.999), epsilon (1e-8), weight_decay (0.01), warmup_steps (0), \
         decay_steps (0), min_lr (0), shard_offset (-1, as in ApplyAdam).",
        |ctx| adam_family_infer("ApplyAdamW", ctx),
    )
    .inputs(ADAM_FAMILY_INPUTS)
    .attrs([
        attr("lr", AttrType::Float),
        attr_or("beta1", AttrType::Float, AttrDefault::Float(0.9)),
        attr_or("beta2", AttrType::Float, AttrDefault::Float(0.999)),
        attr_or("epsilon", AttrType::Float, AttrDefault::Float(1e-8)),
        attr_or("weight_decay", AttrType::Float, AttrDefault::Float(0.01)),
        SCHEDULE_ATTRS[0],
        SCHEDULE_ATTRS[1],
        SCHEDULE_ATTRS[2],
        SHARD_OFFSET_ATTR,
    ])
    .stateful()
    .cpu_kernel(AdamWKernel::build)
}

#[derive(Debug)]
struct AdamWKernel {
    adam: AdamKernel,
    weight_decay: f64,
}

impl AdamWKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        Ok(Box::new(AdamWKernel {
            adam: AdamKernel::from_attrs(init)?,
            weight_decay: float_attr(init, "weight_decay")?,
        }))
    }
}

fn adam_w<T: Real>(
    k: &AdamWKernel,
    cells: [&VariableCell; 3],
    step: f64,
    g: &Tensor,
) -> Result<(), String> {
    let gs = grad_slice::<T>(g)?;
    let a = &k.adam;
    let n = step + 1.0;
    let lr = a.lr.at(step);
    // The same arithmetic as torch.optim.AdamW (single-tensor path): decay, moments, then
    // var -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
    let decay = T::from_f64(1.0 - lr * k.weight_decay);
    let step_size = T::from_f64(lr / (1.0 - a.beta1.powf(n)));
    let bc2_sqrt = T::from_f64((1.0 - a.beta2.powf(n)).sqrt());
    let eps = T::from_f64(a.epsilon);
    let (b1, b2) = (T::from_f64(a.beta1), T::from_f64(a.beta2));
    let (one_b1, one_b2) = (T::from_f64(1.0 - a.beta1), T::from_f64(1.0 - a.beta2));
    let [var, m, v] = cells;
    with_slice::<T, _>(m, "m", g.dims(), |ms| {
        with_slice::<T, _>(v, "v", g.dims(), |vs| {
            with_var_window::<T, _>(var, a.shard_offset, g.dims(), |ws| {
                for (((w, m), v), &g) in ws.iter_mut().zip(ms.iter_mut()).zip(vs.iter_mut()).zip(gs)
                {
                    *w = *w * decay;
                    *m = b1 * *m + one_b1 * g;
                    *v = b2 * *v + one_b2 * g * g;
                    *w = *w - step_size * *m / (v.sqrt() / bc2_sqrt + eps);
                }
                Ok(())
            })
        })
    })
}

impl Kernel for AdamWKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let step = scalar_value(ctx.input(3)?, "t")?;
        let g = ctx.input(4)?;
        let cells = [
            ctx.variable_at(0)?,
            ctx.variable_at(1)?,
            ctx.variable_at(2)?,
        ];
        dispatch_real!(g.dtype(), adam_w(self, cells, step, g))
    }
}

// ---------------------------------------------------------------------------------------------
// IncrementStep
// ---------------------------------------------------------------------------------------------

fn increment_step() -> OpDef {
    OpDef::new(
        "IncrementStep",
        "counter += 1. In: counter (reference to a scalar Variable, i32/i64/f32/f64). No outputs.",
        |ctx| {
            let c = ctx.input(0)?;
            if !(c.dtype.is_int() || c.dtype == DType::F32 || c.dtype == DType::F64)
                || c.shape.rank().is_some_and(|r| r != 0)
            {
                return Err(format!(
                    "IncrementStep: counter must be an i32, i64, f32 or f64 scalar, got {c}"
                )
                .into());
            }
            Ok(vec![])
        },
    )
    .inputs([ref_arg("counter")])
    .stateful()
    .cpu_kernel(|_| {
        Ok(Box::new(crate::kernel::FnKernel(|ctx| {
            ctx.variable_at(0)?.update(|slot| {
                let t = slot
                    .as_mut()
                    .ok_or_else(|| "counter is not initialized".to_string())?;
                let e = |e: crate::TensorError| e.to_string();
                match t.dtype() {
                    DType::I64 => t
                        .as_mut_slice::<i64>()
                        .map_err(e)?
                        .iter_mut()
                        .for_each(|x| *x += 1),
                    DType::I32 => t
                        .as_mut_slice::<i32>()
                        .map_err(e)?
                        .iter_mut()
                        .for_each(|x| *x += 1),
                    DType::F32 => t
                        .as_mut_slice::<f32>()
                        .map_err(e)?
                        .iter_mut()
                        .for_each(|x| *x += 1.0),
                    DType::F64 => t
                        .as_mut_slice::<f64>()
                        .map_err(e)?
                        .iter_mut()
                        .for_each(|x| *x += 1.0),
                    d => return Err(format!("counter has unsupported dtype {d}")),
                }
                Ok::<(), String>(())
            })?;
            Ok(())
        })))
    })
}

// ---------------------------------------------------------------------------------------------
// GlobalNormScale
// ---------------------------------------------------------------------------------------------

fn global_norm_scale() -> OpDef {
    OpDef::new(
        "GlobalNormScale",
        "scale = clip_norm / max(global_norm, clip_norm), global_norm = sqrt(Σ‖g‖²) over all \
         inputs; multiplying each gradient by it is tf.clip_by_global_norm. In: grads \
         (variadic, one float dtype). Out: scale (scalar of that dtype). Attrs: clip_norm \
         (float, required, > 0), squared_norm (bool, default false: when true the one input is \
         Σ‖g‖² already summed, e.g. over the ranks' ZeRO shards by an all-reduce).",
        |ctx| {
            let first = ctx.input(0)?;
            require_float("GlobalNormScale: grads[0]", first)?;
            if let Some((i, t)) = ctx
                .inputs
                .iter()
                .enumerate()
                .find(|(_, t)| t.dtype != first.dtype)
            {
                return Err(format!(
                    "GlobalNormScale: grads[0] is {first} but grads[{i}] is {t}; all must have the same dtype"
                ).into());
            }
            if ctx.bool("squared_norm")?
                && (ctx.inputs.len() != 1 || first.shape.rank().is_some_and(|r| r != 0))
            {
                return Err(format!(
                    "GlobalNormScale: with squared_norm the one input is the scalar Σ‖g‖², got {} inputs, the first {first}",
                    ctx.inputs.len()
                ).into());
            }
            let clip = ctx.float("clip_norm")?;
            if !(clip > 0.0 && clip.is_finite()) {
                return Err(format!(
                    "GlobalNormScale: clip_norm must be positive and finite, got {clip}"
                ).into());
            }
            Ok(vec![TensorType::new(first.dtype, Shape::scalar())])
        },
    )
    .inputs([variadic("grads")])
    .outputs([arg("scale")])
    .attrs([
        attr("clip_norm", AttrType::Float),
        attr_or("squared_norm", AttrType::Bool, AttrDefault::Bool(false)),
    ])
    .cpu_kernel(GlobalNormKernel::build)
}

#[derive(Debug)]
struct GlobalNormKernel {
    clip: f64,
    squared_norm: bool,
}

impl GlobalNormKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        Ok(Box::new(GlobalNormKernel {
            clip: float_attr(init, "clip_norm")?,
            squared_norm: bool_attr(init, "squared_norm")?,
        }))
    }
}

/// Independent partial sums of [`sum_squares`].
const SQUARE_LANES: usize = 8;

/// Σx² of `t`'s elements in f64, in [`SQUARE_LANES`] independent partial sums added at the end:
/// one running sum is one dependent addition per element, bound by the adder's latency (the
/// 2×32 GPT's clipping norm over its 28K gradient elements was 5% of a step's profile, ~30 µs,
/// where its bytes take ~3 µs).
fn sum_squares<T: Real>(t: &Tensor) -> Result<f64, String> {
    let xs = t.as_slice::<T>().map_err(|e| e.to_string())?;
    let square = |x: &T| {
        let v = x.to_f64();
        v * v
    };
    let mut lanes = [0.0f64; SQUARE_LANES];
    let mut chunks = xs.chunks_exact(SQUARE_LANES);
    for chunk in &mut chunks {
        for (lane, x) in lanes.iter_mut().zip(chunk) {
            *lane += square(x);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(square).sum();
    Ok(lanes.iter().sum::<f64>() + tail)
}

impl Kernel for GlobalNormKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let mut total = 0.0;
        if self.squared_norm {
            total = scalar_value(ctx.input(0)?, "the squared norm")?;
        } else {
            for g in ctx.inputs {
                total += dispatch_real!(g.dtype(), sum_squares(g))?;
            }
        }
        // NaN or infinite gradients give a NaN scale, as in TensorFlow, rather than hiding them.
        let scale = if total.is_finite() {
            self.clip / total.sqrt().max(self.clip)
        } else {
            f64::NAN
        };
        let out = match ctx.input(0)?.dtype() {
            DType::F64 => Tensor::scalar(scale),
            _ => Tensor::scalar(scale as f32),
        };
        ctx.set_output(0, out)
    }
}

// ---------------------------------------------------------------------------------------------
// SquaredNorm
// ---------------------------------------------------------------------------------------------

fn squared_norm() -> OpDef {
    OpDef::new(
        "SquaredNorm",
        "Σ‖g‖² over all inputs (summed in f64): one rank's part of a global norm whose parts an \
         all-reduce adds up before GlobalNormScale(squared_norm=true). In: grads (variadic, one \
         float dtype). Out: the sum (scalar of that dtype).",
        |ctx| {
            let first = ctx.input(0)?;
            require_float("SquaredNorm: grads[0]", first)?;
            if let Some((i, t)) = ctx
                .inputs
                .iter()
                .enumerate()
                .find(|(_, t)| t.dtype != first.dtype)
            {
                return Err(format!(
                    "SquaredNorm: grads[0] is {first} but grads[{i}] is {t}; all must have the same dtype"
                ).into());
            }
            Ok(vec![TensorType::new(first.dtype, Shape::scalar())])
        },
    )
    .inputs([variadic("grads")])
    .outputs([arg("sum")])
    .cpu_kernel(|_| {
        Ok(Box::new(crate::kernel::FnKernel(|ctx| {
            let mut total = 0.0;
            for g in ctx.inputs {
                total += dispatch_real!(g.dtype(), sum_squares(g))?;
            }
            let out = match ctx.input(0)?.dtype() {
                DType::F64 => Tensor::scalar(total),
                _ => Tensor::scalar(total as f32),
            };
            ctx.set_output(0, out)
        })))
    })
}

#[cfg(test)]
mod sum_squares_tests {
    use super::*;

    /// Every element is counted once, the ones past the last full group of lanes too, and the
    /// sum is the one running sum's (within rounding).
    #[test]
    fn the_lanes_sum_every_elements_square() {
        for n in [0usize, 1, 7, 8, 9, 17, 1000, 28_001] {
            let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
            let expected: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            let t = Tensor::from_slice(&[n], &v).unwrap();
            let got = sum_squares::<f32>(&t).unwrap();
            assert!(
                (got - expected).abs() <= 1e-12 * expected.max(1.0),
                "n={n}: {got} vs {expected}"
            );
        }
        let t = Tensor::from_slice(&[3], &[1.0f64, 2.0, 2.0]).unwrap();
        assert_eq!(sum_squares::<f64>(&t).unwrap(), 9.0);
    }
}
