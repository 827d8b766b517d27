//! Sparse optimizer updates: only the rows a batch touched change. `SparseApplyGradientDescent`,
//! `SparseApplyAdagrad` and `SparseApplyLazyAdam` take the gradient in sparse form — `indices
//! [N]` and `values [N, d..]`, Gather's `GatherGrad` outputs (see [`super::embedding`]) — and
//! update rows `indices` of a `[V, d..]` variable (and of its slots) in place.
//!
//! Duplicate indices are summed first, so SGD and Adagrad give exactly the dense update with
//! the `SparseRowsToDense` gradient (an untouched row has a zero gradient: neither it nor its
//! accumulator changes). Lazy Adam (TensorFlow Addons' `LazyAdam`) is Adam on the touched rows
//! only: an untouched row's moments do not decay, which is where it differs from dense Adam.
//! Like `ApplyAdam` it reads the step count `t` (steps already taken) as a data input.
//!
//! With `skip_padding` set, index -1 marks a padding row that is skipped (its values are
//! ignored): the sharded embedding lookup's static buffers (see [`super::sharded_lookup`]).
//!
//! The ops take their variable and slots as reference inputs (placed with the variable, on ps
//! in the parameter-server pattern) and have no outputs.

use super::elementwise::{attr_bool, attr_float, slice};
use super::grad::{dispatch_real, Real};
use super::sparse_embedding::unique_with_inverse;
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit, VariableCell};

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(sparse_sgd());
    r.add(sparse_adagrad());
    r.add(sparse_lazy_adam());
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// Shape rule: `vars` share a float dtype and shape `[V, d..]`, indices is i32/i64 `[N]`,
/// values `[N, d..]` of the variable's dtype.
fn sparse_update_infer(
    op: &str,
    vars: &[(&str, &TensorType)],
    indices: &TensorType,
    values: &TensorType,
) -> Result<(), String> {
    let (_, var) = vars[0];
    require_float(&format!("{op}: var"), var)?;
    for (name, t) in &vars[1..] {
        if t.dtype != var.dtype || !t.shape.is_compatible_with(&var.shape) {
            return Err(format!(
                "{op}: {name} is {t} but var is {var}; they must match"
            ));
        }
    }
    if !matches!(indices.dtype, DType::I32 | DType::I64)
        || indices.shape.rank().is_some_and(|r| r != 1)
    {
        return Err(format!(
            "{op}: indices must be i32 or i64 [N], got {indices}"
        ));
    }
    if values.dtype != var.dtype {
        return Err(format!(
            "{op}: values is {values} but var is {var}; they must have the same dtype"
        ));
    }
    if let (Some(v), Some(w)) = (values.shape.dims(), var.shape.dims()) {
        let fits = !w.is_empty()
            && v.len() == w.len()
            && v[1..]
                .iter()
                .zip(&w[1..])
                .all(|(a, b)| a.is_none() || b.is_none() || a == b)
            && (v[0].is_none() || indices.shape.dim(0).is_none() || v[0] == indices.shape.dim(0));
        if !fits {
            return Err(format!(
                "{op}: values {} must be [N, d..] with N = the length of indices {} and d.. the \
                 trailing dimensions of var {}",
                values.shape, indices.shape, var.shape
            ));
        }
    }
    Ok(())
}

/// The gradient with duplicate indices summed: the distinct rows (first-occurrence order) and
/// their summed values, `row` elements each. Errors name the node and the bad index.
fn summed_rows<T: Real>(
    op: &str,
    node: &str,
    indices: &Tensor,
    values: &Tensor,
    var_dims: &[usize],
    skip_padding: bool,
) -> Result<(Vec<usize>, Vec<T>, usize), String> {
    let ids: Vec<i64> = match indices.dtype() {
        DType::I32 => slice::<i32>(indices)?.iter().map(|&v| v.into()).collect(),
        DType::I64 => slice::<i64>(indices)?.to_vec(),
        d => {
            return Err(format!(
                "{op} `{node}`: indices must be i32 or i64, got {d}"
            ))
        }
    };
    let Some((&v, trailing)) = var_dims.split_first() else {
        return Err(format!("{op} `{node}`: var must have rank >= 1"));
    };
    let fits = indices.rank() == 1
        && values.rank() == var_dims.len()
        && values.dims()[0] == ids.len()
        && values.dims()[1..] == *trailing;
    if !fits {
        return Err(format!(
            "{op} `{node}`: values {} must be [N, d..] with N = the length of indices {} and \
             d.. the trailing dimensions of var {:?}",
            values.shape(),
            indices.shape(),
            var_dims
        ));
    }
    for (pos, &i) in ids.iter().enumerate() {
        if skip_padding && i == super::sharded_lookup::PADDING {
            continue;
        }
        if i < 0 || i as usize >= v {
            return Err(format!(
                "{op} `{node}`: index {i} at position {pos} is out of range [0, {v}) (the rows \
                 of var)"
            ));
        }
    }
    let row: usize = trailing.iter().product();
    let (uniq, inverse) = unique_with_inverse(&ids);
    // The padding row, if any, is summed like the others and dropped below.
    let src = slice::<T>(values)?;
    let mut sums = vec![T::from_f64(0.0); uniq.len() * row];
    if row > 0 {
        for (k, &u) in inverse.iter().enumerate() {
            for (s, &g) in sums[u * row..(u + 1) * row]
                .iter_mut()
                .zip(&src[k * row..(k + 1) * row])
            {
                *s += g;
            }
        }
    }
    if let Some(p) = uniq.iter().position(|&i| i < 0) {
        // Only the padding index gets here (others were refused above).
        sums.drain(p * row..(p + 1) * row);
        let mut uniq = uniq;
        uniq.remove(p);
        return Ok((uniq.iter().map(|&i| i as usize).collect(), sums, row));
    }
    Ok((uniq.iter().map(|&i| i as usize).collect(), sums, row))
}

/// The `skip_padding` attribute, shared by the three ops.
fn skip_padding_attr() -> AttrDef {
    attr_or("skip_padding", AttrType::Bool, AttrDefault::Bool(false))
}

/// Runs `f` on the elements of the variable in `cell` under its lock, after checking it is
/// initialized with shape `dims` (the update's variable's).
fn with_rows<T: Real, R>(
    cell: &VariableCell,
    what: &str,
    dims: &[usize],
    f: impl FnOnce(&mut [T]) -> Result<R, String>,
) -> Result<R, String> {
    super::train::with_shaped_slice(cell, what, dims, "var", f)
}

/// The shape of the variable in `cell`.
fn var_dims(cell: &VariableCell) -> Result<Vec<usize>, String> {
    cell.update(|slot| {
        slot.as_ref()
            .map(|t| t.dims().to_vec())
            .ok_or_else(|| "var is not initialized".to_string())
    })
}

/// Errors when two reference inputs are the same variable (its lock would be taken twice).
fn distinct(op: &str, node: &str, cells: &[&VariableCell]) -> Result<(), String> {
    for (i, a) in cells.iter().enumerate() {
        if cells[..i].iter().any(|b| std::ptr::eq(*a, *b)) {
            return Err(format!(
                "{op} `{node}`: reference input {i} is the same variable as an earlier one; the \
                 variable and each optimizer slot must be separate variables"
            ));
        }
    }
    Ok(())
}

fn check_lr(op: &str, lr: f64) -> Result<f64, String> {
    if lr.is_finite() {
        Ok(lr)
    } else {
        Err(format!("{op}: lr must be finite, got {lr}"))
    }
}

// ---------------------------------------------------------------------------------------------
// SparseApplyGradientDescent
// ---------------------------------------------------------------------------------------------

fn sparse_sgd() -> OpDef {
    OpDef::new(
        "SparseApplyGradientDescent",
        "var[indices[n]] -= lr * values[n] for every n (duplicates summed): SGD on the touched \
         rows. In: var (reference to a float Variable [V, d..]), indices (i32 or i64 [N]), \
         values ([N, d..], var's dtype). No outputs. Attrs: lr (float, required), skip_padding \
         (bool, default false: index -1 is skipped).",
        |ctx| {
            sparse_update_infer(
                "SparseApplyGradientDescent",
                &[("var", ctx.input(0)?)],
                ctx.input(1)?,
                ctx.input(2)?,
            )?;
            Ok(vec![])
        },
    )
    .inputs([ref_arg("var"), arg("indices"), arg("values")])
    .attrs([attr("lr", AttrType::Float), skip_padding_attr()])
    .stateful()
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(SparseSgdKernel {
            lr: check_lr("SparseApplyGradientDescent", attr_float(init, "lr")?)?,
            skip_padding: attr_bool(init, "skip_padding")?,
        }))
    })
}

#[derive(Debug)]
struct SparseSgdKernel {
    lr: f64,
    skip_padding: bool,
}

fn sparse_sgd_typed<T: Real>(
    node: &str,
    var: &VariableCell,
    indices: &Tensor,
    values: &Tensor,
    lr: f64,
    skip_padding: bool,
) -> Result<(), String> {
    let dims = var_dims(var)?;
    let (rows, g, row) = summed_rows::<T>(
        "SparseApplyGradientDescent",
        node,
        indices,
        values,
        &dims,
        skip_padding,
    )?;
    let lr = T::from_f64(lr);
    with_rows::<T, _>(var, "var", &dims, |w| {
        for (k, &r) in rows.iter().enumerate() {
            for (w, &g) in w[r * row..(r + 1) * row]
                .iter_mut()
                .zip(&g[k * row..(k + 1) * row])
            {
                *w = *w - lr * g;
            }
        }
        Ok(())
    })
}

impl Kernel for SparseSgdKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (indices, values) = (ctx.input(1)?, ctx.input(2)?);
        let var = ctx.variable_at(0)?;
        Ok(dispatch_real!(
            values.dtype(),
            sparse_sgd_typed(ctx.node, var, indices, values, self.lr, self.skip_padding)
        )?)
    }
}

// ---------------------------------------------------------------------------------------------
// SparseApplyAdagrad
// ---------------------------------------------------------------------------------------------

fn sparse_adagrad() -> OpDef {
    OpDef::new(
        "SparseApplyAdagrad",
        "Adagrad on the touched rows (duplicates summed into g): accum[r] += g²; var[r] -= lr * \
         g / (sqrt(accum[r]) + epsilon). In: var, accum (references to float Variables [V, \
         d..] of one type; accum starts at Keras' 0.1 or any value >= 0), indices (i32 or i64 \
         [N]), values ([N, d..]). No outputs. Attrs: lr (float, required), epsilon (float, \
         default 1e-7), skip_padding (bool, default false: index -1 is skipped).",
        |ctx| {
            sparse_update_infer(
                "SparseApplyAdagrad",
                &[("var", ctx.input(0)?), ("accum", ctx.input(1)?)],
                ctx.input(2)?,
                ctx.input(3)?,
            )?;
            Ok(vec![])
        },
    )
    .inputs([
        ref_arg("var"),
        ref_arg("accum"),
        arg("indices"),
        arg("values"),
    ])
    .attrs([
        attr("lr", AttrType::Float),
        attr_or("epsilon", AttrType::Float, AttrDefault::Float(1e-7)),
        skip_padding_attr(),
    ])
    .stateful()
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(SparseAdagradKernel {
            lr: check_lr("SparseApplyAdagrad", attr_float(init, "lr")?)?,
            epsilon: attr_float(init, "epsilon")?,
            skip_padding: attr_bool(init, "skip_padding")?,
        }))
    })
}

#[derive(Debug)]
struct SparseAdagradKernel {
    lr: f64,
    epsilon: f64,
    skip_padding: bool,
}

fn sparse_adagrad_typed<T: Real>(
    k: &SparseAdagradKernel,
    node: &str,
    cells: [&VariableCell; 2],
    indices: &Tensor,
    values: &Tensor,
) -> Result<(), String> {
    let [var, accum] = cells;
    let dims = var_dims(var)?;
    let (rows, g, row) = summed_rows::<T>(
        "SparseApplyAdagrad",
        node,
        indices,
        values,
        &dims,
        k.skip_padding,
    )?;
    let (lr, eps) = (T::from_f64(k.lr), T::from_f64(k.epsilon));
    with_rows::<T, _>(accum, "accum", &dims, |a| {
        with_rows::<T, _>(var, "var", &dims, |w| {
            for (j, &r) in rows.iter().enumerate() {
                let span = r * row..(r + 1) * row;
                for ((w, a), &g) in w[span.clone()]
                    .iter_mut()
                    .zip(&mut a[span])
                    .zip(&g[j * row..(j + 1) * row])
                {
                    *a += g * g;
                    *w = *w - lr * g / (a.sqrt() + eps);
                }
            }
            Ok(())
        })
    })
}

impl Kernel for SparseAdagradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (indices, values) = (ctx.input(2)?, ctx.input(3)?);
        let cells = [ctx.variable_at(0)?, ctx.variable_at(1)?];
        distinct("SparseApplyAdagrad", ctx.node, &cells)?;
        Ok(dispatch_real!(
            values.dtype(),
            sparse_adagrad_typed(self, ctx.node, cells, indices, values)
        )?)
    }
}

// ---------------------------------------------------------------------------------------------
// SparseApplyLazyAdam
// ---------------------------------------------------------------------------------------------

fn sparse_lazy_adam() -> OpDef {
    OpDef::new(
        "SparseApplyLazyAdam",
        "Lazy Adam (TensorFlow Addons' LazyAdam) at step n = t + 1 on the touched rows only \
         (duplicates summed into g): lr_n = lr * sqrt(1 - beta2^n) / (1 - beta1^n); m[r] += (g \
         - m[r]) * (1 - beta1); v[r] += (g² - v[r]) * (1 - beta2); var[r] -= lr_n * m[r] / \
         (sqrt(v[r]) + epsilon). In: var, m, v (references to float Variables [V, d..] of one \
         type), t (scalar: steps taken so far), indices (i32 or i64 [N]), values ([N, d..]). No \
         outputs. Attrs: lr (float, required), beta1 (0.9), beta2 (0.999), epsilon (1e-7), \
         skip_padding (false: index -1 is skipped).",
        |ctx| {
            const OP: &str = "SparseApplyLazyAdam";
            sparse_update_infer(
                OP,
                &[
                    ("var", ctx.input(0)?),
                    ("m", ctx.input(1)?),
                    ("v", ctx.input(2)?),
                ],
                ctx.input(4)?,
                ctx.input(5)?,
            )?;
            let t = ctx.input(3)?;
            if !(t.dtype.is_float() || t.dtype.is_int()) || t.shape.rank().is_some_and(|r| r != 0) {
                return Err(format!("{OP}: t must be a numeric scalar, got {t}").into());
            }
            Ok(vec![])
        },
    )
    .inputs([
        ref_arg("var"),
        ref_arg("m"),
        ref_arg("v"),
        arg("t"),
        arg("indices"),
        arg("values"),
    ])
    .attrs([
        attr("lr", AttrType::Float),
        attr_or("beta1", AttrType::Float, AttrDefault::Float(0.9)),
        attr_or("beta2", AttrType::Float, AttrDefault::Float(0.999)),
        attr_or("epsilon", AttrType::Float, AttrDefault::Float(1e-7)),
        skip_padding_attr(),
    ])
    .stateful()
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(LazyAdamKernel {
            skip_padding: attr_bool(init, "skip_padding")?,
            lr: check_lr("SparseApplyLazyAdam", attr_float(init, "lr")?)?,
            beta1: attr_float(init, "beta1")?,
            beta2: attr_float(init, "beta2")?,
            epsilon: attr_float(init, "epsilon")?,
        }))
    })
}

#[derive(Debug)]
struct LazyAdamKernel {
    skip_padding: bool,
    lr: f64,
    beta1: f64,
    beta2: f64,
    epsilon: f64,
}

fn lazy_adam_typed<T: Real>(
    k: &LazyAdamKernel,
    node: &str,
    cells: [&VariableCell; 3],
    step: f64,
    indices: &Tensor,
    values: &Tensor,
) -> Result<(), String> {
    let [var, m, v] = cells;
    let dims = var_dims(var)?;
    let (rows, g, row) = summed_rows::<T>(
        "SparseApplyLazyAdam",
        node,
        indices,
        values,
        &dims,
        k.skip_padding,
    )?;
    let n = step + 1.0;
    let lr_n = k.lr * (1.0 - k.beta2.powf(n)).sqrt() / (1.0 - k.beta1.powf(n));
    let (lr_n, eps) = (T::from_f64(lr_n), T::from_f64(k.epsilon));
    let (one_b1, one_b2) = (T::from_f64(1.0 - k.beta1), T::from_f64(1.0 - k.beta2));
    with_rows::<T, _>(m, "m", &dims, |ms| {
        with_rows::<T, _>(v, "v", &dims, |vs| {
            with_rows::<T, _>(var, "var", &dims, |ws| {
                for (j, &r) in rows.iter().enumerate() {
                    let span = r * row..(r + 1) * row;
                    for (((w, m), v), &g) in ws[span.clone()]
                        .iter_mut()
                        .zip(&mut ms[span.clone()])
                        .zip(&mut vs[span])
                        .zip(&g[j * row..(j + 1) * row])
                    {
                        *m += (g - *m) * one_b1;
                        *v += (g * g - *v) * one_b2;
                        *w = *w - lr_n * *m / (v.sqrt() + eps);
                    }
                }
                Ok(())
            })
        })
    })
}

impl Kernel for LazyAdamKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let t = ctx.input(3)?;
        let step = match (t.num_elements(), t.to_f64_vec().first()) {
            (1, Some(&x)) => x,
            _ => {
                return Err(format!(
                    "SparseApplyLazyAdam `{}`: t must be a scalar, got shape {}",
                    ctx.node,
                    t.shape()
                )
                .into())
            }
        };
        let (indices, values) = (ctx.input(4)?, ctx.input(5)?);
        let cells = [
            ctx.variable_at(0)?,
            ctx.variable_at(1)?,
            ctx.variable_at(2)?,
        ];
        distinct("SparseApplyLazyAdam", ctx.node, &cells)?;
        Ok(dispatch_real!(
            values.dtype(),
            lazy_adam_typed(self, ctx.node, cells, step, indices, values)
        )?)
    }
}
