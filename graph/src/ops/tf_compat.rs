//! Variable updates TensorFlow graphs use directly: `AssignAdd`, `AssignSub` and `Assign`
//! (TensorFlow's `AssignAddVariableOp`/`AssignAdd`, `AssignSubVariableOp`/`AssignSub` and
//! `AssignVariableOp`/`Assign` on resource and reference variables; see
//! [`crate::tf_import`]), with their CPU kernels.
//!
//! Like the optimizer applies, they take the variable as a reference input, so they are placed
//! with it, and have no outputs: a step depends on them through control edges.

use super::grad::{dispatch_real, Real};
use super::*;
use crate::kernel::{Kernel, KernelContext, VariableCell};

pub(crate) fn register(r: &mut OpRegistry) {
    for mode in [Mode::Add, Mode::Sub, Mode::Set] {
        r.add(update_op(mode));
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
        .kernel("CPU", build)
}

fn infer(mode: Mode, ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, String> {
    let (var, value) = (ctx.input(0)?, ctx.input(1)?);
    if mode != Mode::Set {
        require_float(&format!("{}: var", mode.name()), var)?;
    }
    if value.dtype != var.dtype || !value.shape.is_compatible_with(&var.shape) {
        return Err(format!(
            "{}: var is {var} but value is {value}; they must have the same dtype and shape",
            mode.name()
        ));
    }
    Ok(vec![])
}

fn build(mode: Mode) -> Result<Box<dyn Kernel>, String> {
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
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), String> {
        let value = ctx.input(1)?;
        let cell = ctx.variable_at(0)?;
        match self.mode {
            Mode::Add => dispatch_real!(value.dtype(), add_into(cell, value, 1.0)),
            Mode::Sub => dispatch_real!(value.dtype(), add_into(cell, value, -1.0)),
            Mode::Set => cell.update(|slot| {
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
            }),
        }
    }
}
