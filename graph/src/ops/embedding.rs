//! Embedding lookup: Gather, and its sparse gradient GatherGrad + SparseRowsToDense.
//!
//! # The sparse gradient (TensorFlow's `IndexedSlices`)
//!
//! The gradient of `Gather(params, indices)` w.r.t. `params` is built as two adjacent nodes:
//!
//! 1. `gradients/<gather>/sparse` = `GatherGrad(indices, dy)`: output 0 `indices` (i64 `[N]`, the
//!    flattened indices, N = number of index elements) and output 1 `values` ([N, d1..], `dy`'s
//!    rows; a reshape of `dy`, no copy). Together they are the gradient in sparse form: row
//!    `indices[n]` of d params gets `values[n]` added.
//! 2. `gradients/<gather>/dparams` = `SparseRowsToDense(sparse:0, sparse:1, params)`: the dense
//!    [V, d1..] gradient with the rows scatter-added (duplicates summed); `params` is read only
//!    for its run-time shape.
//!
//! Autodiff (and so every optimizer) sees the dense output. A sparse-embedding rewrite finds the
//! `GatherGrad` → `SparseRowsToDense` pair (the second's inputs 0 and 1 are the first's outputs
//! 0 and 1) and uses `(indices, values)` directly, so only touched rows travel.

use super::elementwise::{attr_int, dispatch_any, from_f32, slice, to_f32};
use super::grad::{dispatch_real, Real};
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit};
use crate::Element;

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(gather());
    r.add(gather_grad());
    r.add(sparse_rows_to_dense());
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// Requires an i32 or i64 tensor type.
fn require_index(op: &str, what: &str, t: &TensorType) -> Result<(), String> {
    if matches!(t.dtype, DType::I32 | DType::I64) {
        Ok(())
    } else {
        Err(format!("{op}: {what} must be i32 or i64, got {t}"))
    }
}

/// The indices as `usize`, each checked against `[0, v)`; the error names the node, the index,
/// its position and `v`.
fn checked_indices(op: &str, node: &str, t: &Tensor, v: usize) -> Result<Vec<usize>, String> {
    let check = |pos: usize, i: i64| {
        usize::try_from(i).ok().filter(|&u| u < v).ok_or_else(|| {
            format!(
                "{op} `{node}`: index {i} at position {pos} is out of range [0, {v}) (the first \
                 dimension of params)"
            )
        })
    };
    match t.dtype() {
        DType::I32 => slice::<i32>(t)?
            .iter()
            .enumerate()
            .map(|(p, &i)| check(p, i.into()))
            .collect(),
        DType::I64 => slice::<i64>(t)?
            .iter()
            .enumerate()
            .map(|(p, &i)| check(p, i))
            .collect(),
        d => Err(format!("{op}: indices must be i32 or i64, got {d}")),
    }
}

// ---------------------------------------------------------------------------------------------
// Gather
// ---------------------------------------------------------------------------------------------

fn gather() -> OpDef {
    OpDef::new(
        "Gather",
        "output[i.., :] = params[indices[i..], :] (embedding lookup along axis 0). In: params \
         [V, d..] (any dtype), indices (i32 or i64, any shape [i..], each in [0, V)). Out: output \
         [i.., d..], params' dtype. Attrs: axis (int, default 0; only 0 is supported).",
        gather_infer,
    )
    .inputs([arg("params"), arg("indices")])
    .outputs([arg("output")])
    .attrs([attr_or("axis", AttrType::Int, AttrDefault::Int(0))])
    .cpu_kernel(|init: &KernelInit<'_>| {
        check_axis(attr_int(init, "axis")?)?;
        Ok(Box::new(GatherKernel))
    })
}

fn check_axis(axis: i64) -> Result<(), String> {
    if axis == 0 {
        Ok(())
    } else {
        Err(format!("Gather: only axis 0 is supported, got axis {axis}"))
    }
}

fn gather_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let (params, indices) = (ctx.input(0)?, ctx.input(1)?);
    check_axis(ctx.int("axis")?)?;
    require_index("Gather", "indices", indices)?;
    if params.shape.rank() == Some(0) {
        return Err(format!(
            "Gather: params must have rank >= 1, got shape {}",
            params.shape
        )
        .into());
    }
    let shape = match (indices.shape.dims(), params.shape.dims()) {
        (Some(i), Some(p)) => Shape::partial(i.iter().chain(&p[1..]).copied().collect()),
        _ => Shape::unknown(),
    };
    Ok(vec![TensorType::new(params.dtype, shape)])
}

#[derive(Debug)]
struct GatherKernel;

fn gather_rows<T: Element>(
    params: &Tensor,
    rows: &[usize],
    out_dims: &[usize],
) -> Result<Tensor, String> {
    let src = slice::<T>(params)?;
    let row: usize = params.dims()[1..].iter().product();
    let mut out = Tensor::zeros(T::DTYPE, out_dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    if row > 0 {
        for (chunk, &r) in dst.chunks_mut(row).zip(rows) {
            chunk.copy_from_slice(&src[r * row..(r + 1) * row]);
        }
    }
    Ok(out)
}

impl Kernel for GatherKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (params, indices) = (ctx.input(0)?, ctx.input(1)?);
        let Some(&v) = params.dims().first() else {
            return Err(format!(
                "Gather: params must have rank >= 1, got shape {}",
                params.shape()
            )
            .into());
        };
        let rows = checked_indices("Gather", ctx.node, indices, v)?;
        let out_dims: Vec<usize> = indices
            .dims()
            .iter()
            .chain(&params.dims()[1..])
            .copied()
            .collect();
        let y = dispatch_any!(params.dtype(), gather_rows(params, &rows, &out_dims))?;
        ctx.set_output(0, y)
    }
}

// ---------------------------------------------------------------------------------------------
// GatherGrad
// ---------------------------------------------------------------------------------------------

fn gather_grad() -> OpDef {
    OpDef::new(
        "GatherGrad",
        "The gradient of Gather in sparse form (see the module docs). In: indices (i32 or i64, \
         [i..]), dy (float, [i.., d..]). Out: indices (i64 [N], flattened, N = number of index \
         elements), values ([N, d..], dy's rows; no copy).",
        gather_grad_infer,
    )
    .inputs([arg("indices"), arg("dy")])
    .outputs([arg("indices"), arg("values")])
    .cpu_kernel(|_| Ok(Box::new(GatherGradKernel)))
}

fn gather_grad_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let (indices, dy) = (ctx.input(0)?, ctx.input(1)?);
    require_index("GatherGrad", "indices", indices)?;
    require_float("GatherGrad: dy", dy)?;
    let n = indices.shape.num_elements();
    let values = match (indices.shape.dims(), dy.shape.dims()) {
        (Some(i), Some(d)) => {
            let fits = d.len() >= i.len()
                && i.iter()
                    .zip(d)
                    .all(|(a, b)| a.is_none() || b.is_none() || a == b);
            if !fits {
                return Err(format!(
                    "GatherGrad: dy {} does not start with the shape of indices {}",
                    dy.shape, indices.shape
                )
                .into());
            }
            Shape::partial(
                std::iter::once(n)
                    .chain(d[i.len()..].iter().copied())
                    .collect(),
            )
        }
        _ => Shape::unknown(),
    };
    Ok(vec![
        TensorType::new(DType::I64, Shape::partial(vec![n])),
        TensorType::new(dy.dtype, values),
    ])
}

#[derive(Debug)]
struct GatherGradKernel;

impl Kernel for GatherGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (indices, dy) = (ctx.input(0)?, ctx.input(1)?);
        let r = indices.rank();
        if dy.rank() < r || dy.dims()[..r] != *indices.dims() {
            return Err(format!(
                "GatherGrad: dy {} does not start with the shape of indices {}",
                dy.shape(),
                indices.shape()
            )
            .into());
        }
        let n = indices.num_elements();
        let flat = match indices.dtype() {
            DType::I64 => indices.reshaped(&[n]).map_err(|e| e.to_string())?,
            DType::I32 => {
                let v: Vec<i64> = slice::<i32>(indices)?.iter().map(|&i| i.into()).collect();
                Tensor::from_slice(&[n], &v).map_err(|e| e.to_string())?
            }
            d => return Err(format!("GatherGrad: indices must be i32 or i64, got {d}").into()),
        };
        let value_dims: Vec<usize> = std::iter::once(n)
            .chain(dy.dims()[r..].iter().copied())
            .collect();
        let values = dy.reshaped(&value_dims).map_err(|e| e.to_string())?;
        ctx.set_output(0, flat)?;
        ctx.set_output(1, values)
    }
}

// ---------------------------------------------------------------------------------------------
// SparseRowsToDense
// ---------------------------------------------------------------------------------------------

fn sparse_rows_to_dense() -> OpDef {
    OpDef::new(
        "SparseRowsToDense",
        "dense = zeros of like's run-time shape with row indices[n] += values[n] for every n \
         (duplicates summed). In: indices (i64 [N], each in [0, V)), values (float [N, d..]), \
         like ([V, d..], any dtype; only its shape is read). Out: dense [V, d..], values' dtype.",
        sparse_rows_infer,
    )
    .inputs([arg("indices"), arg("values"), arg("like")])
    .outputs([arg("dense")])
    .cpu_kernel(|_| Ok(Box::new(SparseRowsToDenseKernel)))
}

fn sparse_rows_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    const OP: &str = "SparseRowsToDense";
    let (indices, values, like) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
    require_index(OP, "indices", indices)?;
    require_float(&format!("{OP}: values"), values)?;
    if indices.shape.rank().is_some_and(|r| r != 1) {
        return Err(format!(
            "{OP}: indices must have rank 1, got shape {}",
            indices.shape
        )
        .into());
    }
    if let (Some(v), Some(l)) = (values.shape.dims(), like.shape.dims()) {
        let fits = !v.is_empty()
            && v.len() == l.len()
            && v[1..]
                .iter()
                .zip(&l[1..])
                .all(|(a, b)| a.is_none() || b.is_none() || a == b)
            && (v[0].is_none() || indices.shape.dim(0).is_none() || v[0] == indices.shape.dim(0));
        if !fits {
            return Err(format!(
                "{OP}: values {} must be [N, d..] with N = the length of indices {} and d.. the \
                 trailing dimensions of like {}",
                values.shape, indices.shape, like.shape
            )
            .into());
        }
    }
    Ok(vec![TensorType::new(values.dtype, like.shape.clone())])
}

#[derive(Debug)]
struct SparseRowsToDenseKernel;

fn scatter_add<T: Real>(rows: &[usize], values: &Tensor, dims: &[usize]) -> Result<Tensor, String> {
    let src = values.as_slice::<T>().map_err(|e| e.to_string())?;
    let row: usize = dims[1..].iter().product();
    let mut out = Tensor::zeros(T::DTYPE, dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    if row > 0 {
        for (chunk, &r) in src.chunks(row).zip(rows) {
            for (o, &v) in dst[r * row..(r + 1) * row].iter_mut().zip(chunk) {
                *o += v;
            }
        }
    }
    Ok(out)
}

impl Kernel for SparseRowsToDenseKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "SparseRowsToDense";
        let (indices, values, like) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        let dims = like.dims();
        let fits = indices.rank() == 1
            && !dims.is_empty()
            && values.rank() == dims.len()
            && values.dims()[0] == indices.dims()[0]
            && values.dims()[1..] == dims[1..];
        if !fits {
            return Err(format!(
                "{OP}: values {} must be [N, d..] with N = the length of indices {} and d.. the \
                 trailing dimensions of like {}",
                values.shape(),
                indices.shape(),
                like.shape()
            )
            .into());
        }
        let rows = checked_indices(OP, ctx.node, indices, dims[0])?;
        let dense = match values.dtype() {
            d @ (DType::BF16 | DType::F16) => {
                from_f32(&scatter_add::<f32>(&rows, &to_f32(values)?, dims)?, d)
                    .map_err(OpError::from)
            }
            d => dispatch_real!(d, scatter_add(&rows, values, dims)),
        }?;
        ctx.set_output(0, dense)
    }
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`] and the module docs).
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        // GatherGrad and SparseRowsToDense get none: second derivatives are not supported.
        r.set_gradient("Gather", gather_grad);
    }

    /// The sparse pair: `sparse` = GatherGrad(indices, dy), then `dparams` =
    /// SparseRowsToDense(sparse:0, sparse:1, params). No gradient w.r.t. indices.
    fn gather_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let (params, indices) = (f.input(0)?, f.input(1)?);
        let sparse = b.add("GatherGrad", "sparse", &[indices, dy], &[]);
        let (rows, values) = (
            Output {
                node: sparse.clone(),
                index: 0,
            },
            Output {
                node: sparse,
                index: 1,
            },
        );
        let dense = b.op(
            "SparseRowsToDense",
            "dparams",
            &[&rows, &values, params],
            &[],
        );
        Ok(vec![Some(dense), None])
    }
}
