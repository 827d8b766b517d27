//! Layout ops: Transpose, Split, Concat, Slice, and SliceGrad (the gradient of Slice).
//!
//! They only move elements, so their kernels handle every dtype. Gradients (block at the end):
//! Transpose ↦ Transpose by the inverse permutation; Split ↦ Concat of the output gradients (a
//! missing one is `ZerosLike` of that output); Concat ↦ one `Slice` of the incoming gradient per
//! input (`begin` = the input's offset along `axis`, `size` = its static length there, `-1`
//! elsewhere; the last input's slice runs to the end, so only the other inputs need a static
//! length along `axis`); Slice ↦ `SliceGrad` (the gradient written into zeros of the input's
//! shape at `begin`).

use super::elementwise::{attr_int, attr_ints, dispatch_any, slice};
use super::math::require_same;
use super::reduce::normalize_axis;
use super::*;
use crate::kernel::{Kernel, KernelContext};
use crate::Element;

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(transpose());
    r.add(split());
    r.add(concat());
    r.add(slice_op());
    r.add(slice_grad());
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// Row-major element strides of `dims`.
fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1].saturating_mul(dims[i + 1]);
    }
    s
}

/// Writes `dst` (row-major over `out_dims`) from `src`, where output element `(i0, .., ir)`
/// reads `src[offset + Σ ik · src_strides[k]]`. The innermost dimension is copied as one slice
/// when its stride is 1. Errors (never panics) when a read would leave `src`.
fn gather_strided<T: Copy>(
    src: &[T],
    offset: usize,
    src_strides: &[usize],
    out_dims: &[usize],
    dst: &mut [T],
) -> Result<(), String> {
    let n: usize = out_dims.iter().product();
    if n == 0 {
        return Ok(());
    }
    // The last element read, to check bounds once.
    let last = out_dims
        .iter()
        .zip(src_strides)
        .try_fold(offset, |acc, (&d, &s)| {
            acc.checked_add((d - 1).checked_mul(s)?)
        });
    if last.map_or(true, |l| l >= src.len()) || dst.len() != n {
        return Err(format!(
            "internal layout error: reading {out_dims:?} at strides {src_strides:?} from {} \
             elements into {}",
            src.len(),
            dst.len()
        ));
    }
    let r = out_dims.len();
    if r == 0 {
        dst[0] = src[offset];
        return Ok(());
    }
    let (inner, istride) = (out_dims[r - 1], src_strides[r - 1]);
    let mut idx = vec![0usize; r - 1];
    let mut base = offset;
    for row in dst.chunks_mut(inner) {
        if istride == 1 {
            row.copy_from_slice(&src[base..base + inner]);
        } else {
            for (k, o) in row.iter_mut().enumerate() {
                *o = src[base + k * istride];
            }
        }
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            base += src_strides[d];
            if idx[d] < out_dims[d] {
                break;
            }
            base -= src_strides[d] * out_dims[d];
            idx[d] = 0;
        }
    }
    Ok(())
}

/// A new tensor of `out_dims` read from `x` as in [`gather_strided`].
fn strided_copy<T: Element>(
    x: &Tensor,
    offset: usize,
    src_strides: &[usize],
    out_dims: &[usize],
) -> Result<Tensor, String> {
    let src = slice::<T>(x)?;
    let mut out = Tensor::zeros(T::DTYPE, out_dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    gather_strided(src, offset, src_strides, out_dims, dst)?;
    Ok(out)
}

/// An int attribute as an axis of a rank-`rank` shape (negative counts from the end).
fn axis_of(op: &str, axis: i64, t: &TensorType) -> Result<Option<usize>, String> {
    match t.shape.rank() {
        None => Ok(None),
        Some(rank) => normalize_axis(op, axis, rank, &t.shape).map(Some),
    }
}

// ---------------------------------------------------------------------------------------------
// Transpose
// ---------------------------------------------------------------------------------------------

fn transpose() -> OpDef {
    OpDef::new(
        "Transpose",
        "y = x with its dimensions permuted: y.shape[i] = x.shape[perm[i]]. In: x (any dtype). \
         Out: y, same dtype. Attrs: perm (list(int), required; a permutation of 0..rank).",
        transpose_infer,
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .attrs([attr("perm", AttrType::IntList)])
    .cpu_kernel(|init| {
        Ok(Box::new(TransposeKernel {
            perm: attr_ints(init, "perm")?,
        }))
    })
}

/// `perm` as indices, checked to be a permutation of `0..rank`.
fn check_perm(perm: &[i64], rank: usize, shape: &Shape) -> Result<Vec<usize>, String> {
    let bad = || {
        format!("Transpose: perm {perm:?} is not a permutation of 0..{rank} (input shape {shape})")
    };
    if perm.len() != rank {
        return Err(bad());
    }
    let mut seen = vec![false; rank];
    let mut out = Vec::with_capacity(rank);
    for &p in perm {
        let i = usize::try_from(p)
            .ok()
            .filter(|&i| i < rank)
            .ok_or_else(bad)?;
        if std::mem::replace(&mut seen[i], true) {
            return Err(bad());
        }
        out.push(i);
    }
    Ok(out)
}

fn transpose_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let x = ctx.input(0)?;
    let perm = ctx.ints("perm")?;
    let Some(dims) = x.shape.dims() else {
        // Rank unknown: the output has perm's rank (checked at run time).
        return Ok(vec![TensorType::new(
            x.dtype,
            Shape::partial(vec![None; perm.len()]),
        )]);
    };
    let p = check_perm(perm, dims.len(), &x.shape)?;
    Ok(vec![TensorType::new(
        x.dtype,
        Shape::partial(p.iter().map(|&i| dims[i]).collect()),
    )])
}

#[derive(Debug)]
struct TransposeKernel {
    perm: Vec<i64>,
}

impl Kernel for TransposeKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let p = check_perm(&self.perm, x.rank(), &x.shape())?;
        if p.iter().enumerate().all(|(i, &j)| i == j) {
            return ctx.set_output(0, x.clone());
        }
        let s = strides(x.dims());
        let out_dims: Vec<usize> = p.iter().map(|&i| x.dims()[i]).collect();
        let src_strides: Vec<usize> = p.iter().map(|&i| s[i]).collect();
        let y = dispatch_any!(x.dtype(), strided_copy(x, 0, &src_strides, &out_dims))?;
        ctx.set_output(0, y)
    }
}

// ---------------------------------------------------------------------------------------------
// Split
// ---------------------------------------------------------------------------------------------

fn split() -> OpDef {
    OpDef::new(
        "Split",
        "outputs = value cut into num_split equal parts along axis. In: value (any dtype). Out: \
         num_split tensors (output k is part k), same dtype. Attrs: axis (int, required; \
         negative counts from the end), num_split (int >= 1, required; must divide the axis).",
        split_infer,
    )
    .inputs([arg("value")])
    .outputs([variadic("output")])
    .attrs([
        attr("axis", AttrType::Int),
        attr("num_split", AttrType::Int),
    ])
    .cpu_kernel(|init| {
        Ok(Box::new(SplitKernel {
            axis: attr_int(init, "axis")?,
            num_split: attr_int(init, "num_split")?,
        }))
    })
}

fn num_split(n: i64) -> Result<usize, String> {
    usize::try_from(n)
        .ok()
        .filter(|&n| n >= 1)
        .ok_or_else(|| format!("Split: num_split must be >= 1, got {n}"))
}

fn split_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let x = ctx.input(0)?;
    let n = num_split(ctx.int("num_split")?)?;
    let Some(axis) = axis_of("Split", ctx.int("axis")?, x)? else {
        return Ok(vec![x.clone(); n]);
    };
    let mut dims = x.shape.dims().map(<[_]>::to_vec).unwrap_or_default();
    if let Some(d) = dims[axis] {
        if d % n != 0 {
            return Err(format!(
                "Split: dimension {axis} of value {} has size {d}, which num_split {n} does not \
                 divide",
                x.shape
            )
            .into());
        }
        dims[axis] = Some(d / n);
    }
    Ok(vec![TensorType::new(x.dtype, Shape::partial(dims)); n])
}

#[derive(Debug)]
struct SplitKernel {
    axis: i64,
    num_split: i64,
}

fn split_parts<T: Element>(x: &Tensor, axis: usize, n: usize) -> Result<Vec<Tensor>, String> {
    let dims = x.dims();
    let part = dims[axis] / n;
    let outer: usize = dims[..axis].iter().product();
    let inner: usize = dims[axis + 1..].iter().product();
    let mut out_dims = dims.to_vec();
    out_dims[axis] = part;
    let src = slice::<T>(x)?;
    let (run, row) = (part * inner, dims[axis] * inner);
    (0..n)
        .map(|k| {
            let mut t = Tensor::zeros(T::DTYPE, &out_dims).map_err(|e| e.to_string())?;
            let dst = t.as_mut_slice::<T>().map_err(|e| e.to_string())?;
            if run > 0 {
                for (o, chunk) in dst.chunks_mut(run).enumerate().take(outer) {
                    let start = o * row + k * run;
                    chunk.copy_from_slice(&src[start..start + run]);
                }
            }
            Ok(t)
        })
        .collect()
}

impl Kernel for SplitKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let n = num_split(self.num_split)?;
        let axis = normalize_axis("Split", self.axis, x.rank(), &x.shape())?;
        if x.dims()[axis] % n != 0 {
            return Err(format!(
                "Split: dimension {axis} of value {} has size {}, which num_split {n} does not \
                 divide",
                x.shape(),
                x.dims()[axis]
            )
            .into());
        }
        let parts = dispatch_any!(x.dtype(), split_parts(x, axis, n))?;
        for (k, t) in parts.into_iter().enumerate() {
            ctx.set_output(k, t)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Concat
// ---------------------------------------------------------------------------------------------

fn concat() -> OpDef {
    OpDef::new(
        "Concat",
        "output = the values joined along axis, in input order. In: values (one or more, same \
         dtype and rank, equal dims except along axis). Out: output. Attrs: axis (int, \
         required; negative counts from the end).",
        concat_infer,
    )
    .inputs([variadic("values")])
    .outputs([arg("output")])
    .attrs([attr("axis", AttrType::Int)])
    .cpu_kernel(|init| {
        Ok(Box::new(ConcatKernel {
            axis: attr_int(init, "axis")?,
        }))
    })
}

fn concat_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let first = ctx
        .inputs
        .first()
        .ok_or("Concat: needs at least one input")?;
    let axis_attr = ctx.int("axis")?;
    let mut rank: Option<usize> = None;
    for (i, t) in ctx.inputs.iter().enumerate() {
        require_same("Concat", ("values[0]", first), (&format!("values[{i}]"), t))?;
        let Some(dims) = t.shape.dims() else {
            continue;
        };
        match rank {
            Some(r) if r != dims.len() => {
                return Err(format!(
                    "Concat: values[{i}] has shape {} but an earlier value has rank {r}; all must \
                     have the same rank",
                    t.shape
                )
                .into())
            }
            _ => rank = Some(dims.len()),
        }
    }
    let Some(rank) = rank else {
        return Ok(vec![TensorType::new(first.dtype, Shape::unknown())]);
    };
    let axis = normalize_axis("Concat", axis_attr, rank, &first.shape)?;
    let mut along: Option<usize> = Some(0);
    let mut other: Vec<Option<usize>> = vec![None; rank];
    for (i, t) in ctx.inputs.iter().enumerate() {
        let Some(dims) = t.shape.dims() else {
            along = None;
            continue;
        };
        along = along.and_then(|a| Some(a + dims[axis]?));
        for (k, (o, &d)) in other.iter_mut().zip(dims).enumerate() {
            if k == axis {
                continue;
            }
            match (*o, d) {
                (Some(a), Some(b)) if a != b => {
                    return Err(format!(
                        "Concat: values[{i}] has shape {} but an earlier value has size {a} in \
                         dimension {k}; all dimensions but axis {axis} must match",
                        t.shape
                    )
                    .into())
                }
                (None, d) => *o = d,
                _ => {}
            }
        }
    }
    other[axis] = along;
    Ok(vec![TensorType::new(first.dtype, Shape::partial(other))])
}

#[derive(Debug)]
struct ConcatKernel {
    axis: i64,
}

fn concat_parts<T: Element>(
    xs: &[&Tensor],
    axis: usize,
    out_dims: &[usize],
) -> Result<Tensor, String> {
    let outer: usize = out_dims[..axis].iter().product();
    let inner: usize = out_dims[axis + 1..].iter().product();
    let row = out_dims[axis] * inner;
    let mut out = Tensor::zeros(T::DTYPE, out_dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    let mut at = 0usize;
    for x in xs {
        let src = slice::<T>(x)?;
        let run = x.dims()[axis] * inner;
        if run > 0 {
            for (o, chunk) in src.chunks(run).enumerate().take(outer) {
                let start = o * row + at;
                dst[start..start + run].copy_from_slice(chunk);
            }
        }
        at += run;
    }
    Ok(out)
}

impl Kernel for ConcatKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let xs = ctx.inputs;
        let first = ctx.input(0)?;
        let axis = normalize_axis("Concat", self.axis, first.rank(), &first.shape())?;
        let mut out_dims = first.dims().to_vec();
        out_dims[axis] = 0;
        for (i, x) in xs.iter().enumerate() {
            let fits = x.dtype() == first.dtype()
                && x.rank() == first.rank()
                && x.dims()
                    .iter()
                    .zip(first.dims())
                    .enumerate()
                    .all(|(k, (a, b))| k == axis || a == b);
            if !fits {
                return Err(format!(
                    "Concat: values[{i}] is {}{} but values[0] is {}{}; all must share dtype, rank \
                     and every dimension but axis {axis}",
                    x.dtype(),
                    x.shape(),
                    first.dtype(),
                    first.shape()
                )
                .into());
            }
            out_dims[axis] += x.dims()[axis];
        }
        if xs.len() == 1 {
            return ctx.set_output(0, first.clone());
        }
        let y = dispatch_any!(first.dtype(), concat_parts(xs, axis, &out_dims))?;
        ctx.set_output(0, y)
    }
}

// ---------------------------------------------------------------------------------------------
// Slice
// ---------------------------------------------------------------------------------------------

fn slice_op() -> OpDef {
    OpDef::new(
        "Slice",
        "output = input[begin[i] : begin[i] + size[i]] in every dimension i (size -1: to the \
         end). In: input (any dtype). Out: output, same dtype. Attrs: begin, size (list(int), \
         required, one entry per dimension).",
        slice_infer,
    )
    .inputs([arg("input")])
    .outputs([arg("output")])
    .attrs([
        attr("begin", AttrType::IntList),
        attr("size", AttrType::IntList),
    ])
    .cpu_kernel(|init| {
        Ok(Box::new(SliceKernel {
            begin: attr_ints(init, "begin")?,
            size: attr_ints(init, "size")?,
        }))
    })
}

/// The (begin, size) of each dimension for an input of `dims` (`None` = unknown), checked.
fn slice_bounds(
    begin: &[i64],
    size: &[i64],
    dims: &[Option<usize>],
    shape: &Shape,
) -> Result<Vec<(usize, Option<usize>)>, String> {
    if begin.len() != dims.len() || size.len() != dims.len() {
        return Err(format!(
            "Slice: begin {begin:?} and size {size:?} need one entry per dimension of input {shape}"
        ));
    }
    let mut out = Vec::with_capacity(dims.len());
    for (i, ((&b, &s), &d)) in begin.iter().zip(size).zip(dims).enumerate() {
        let bad = || format!("Slice: dimension {i}: begin {b}, size {s} do not fit input {shape}");
        let b = usize::try_from(b).map_err(|_| bad())?;
        let s = match s {
            -1 => None,
            s => Some(usize::try_from(s).map_err(|_| bad())?),
        };
        if let Some(d) = d {
            if b > d || s.is_some_and(|s| b + s > d) {
                return Err(bad());
            }
            out.push((b, Some(s.unwrap_or(d - b))));
        } else {
            out.push((b, s));
        }
    }
    Ok(out)
}

fn slice_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let x = ctx.input(0)?;
    let (begin, size) = (ctx.ints("begin")?, ctx.ints("size")?);
    let dims = match x.shape.dims() {
        Some(d) => d.to_vec(),
        None => vec![None; begin.len()],
    };
    let bounds = slice_bounds(begin, size, &dims, &x.shape)?;
    Ok(vec![TensorType::new(
        x.dtype,
        Shape::partial(bounds.iter().map(|&(_, s)| s).collect()),
    )])
}

#[derive(Debug)]
struct SliceKernel {
    begin: Vec<i64>,
    size: Vec<i64>,
}

impl Kernel for SliceKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let dims: Vec<Option<usize>> = x.dims().iter().map(|&d| Some(d)).collect();
        let bounds = slice_bounds(&self.begin, &self.size, &dims, &x.shape())?;
        let out_dims: Vec<usize> = bounds.iter().map(|&(_, s)| s.unwrap_or(0)).collect();
        if out_dims == x.dims() {
            return ctx.set_output(0, x.clone());
        }
        let s = strides(x.dims());
        let offset = bounds.iter().zip(&s).map(|(&(b, _), &st)| b * st).sum();
        let y = dispatch_any!(x.dtype(), strided_copy(x, offset, &s, &out_dims))?;
        ctx.set_output(0, y)
    }
}

// ---------------------------------------------------------------------------------------------
// SliceGrad
// ---------------------------------------------------------------------------------------------

fn slice_grad() -> OpDef {
    OpDef::new(
        "SliceGrad",
        "The gradient of Slice: output = zeros of like's run-time shape with dy written at \
         begin. In: dy (float), like (the Slice's input; only its shape is read). Out: output, \
         dy's dtype and like's shape. Attrs: begin (list(int), required; the Slice's begin).",
        |ctx| {
            let (dy, like) = (ctx.input(0)?, ctx.input(1)?);
            require_float("SliceGrad: dy", dy)?;
            let begin = ctx.ints("begin")?;
            if let (Some(r), Some(l)) = (dy.shape.rank(), like.shape.rank()) {
                if r != l || begin.len() != r {
                    return Err(format!(
                        "SliceGrad: dy {} and like {} must have the rank of begin {begin:?}",
                        dy.shape, like.shape
                    )
                    .into());
                }
            }
            Ok(vec![TensorType::new(dy.dtype, like.shape.clone())])
        },
    )
    .inputs([arg("dy"), arg("like")])
    .outputs([arg("output")])
    .attrs([attr("begin", AttrType::IntList)])
    .cpu_kernel(|init| {
        Ok(Box::new(SliceGradKernel {
            begin: attr_ints(init, "begin")?,
        }))
    })
}

#[derive(Debug)]
struct SliceGradKernel {
    begin: Vec<i64>,
}

/// Zeros of `dims` with `dy` written as the block starting at `begin` (checked by the caller).
fn scatter_block<T: Element>(
    dy: &Tensor,
    dims: &[usize],
    begin: &[usize],
) -> Result<Tensor, String> {
    let src = slice::<T>(dy)?;
    let st = strides(dims);
    let offset: usize = begin.iter().zip(&st).map(|(b, s)| b * s).sum();
    let mut out = Tensor::zeros(T::DTYPE, dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    let dd = dy.dims();
    if src.is_empty() {
        return Ok(out);
    }
    let r = dd.len();
    if r == 0 {
        dst[offset] = src[0];
        return Ok(out);
    }
    let inner = dd[r - 1];
    let mut idx = vec![0usize; r - 1];
    let mut base = offset;
    for row in src.chunks(inner) {
        dst[base..base + inner].copy_from_slice(row);
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            base += st[d];
            if idx[d] < dd[d] {
                break;
            }
            base -= st[d] * dd[d];
            idx[d] = 0;
        }
    }
    Ok(out)
}

impl Kernel for SliceGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (dy, like) = (ctx.input(0)?, ctx.input(1)?);
        let dims = like.dims();
        let bad = || {
            format!(
                "SliceGrad: dy {} does not fit in like {} at begin {:?}",
                dy.shape(),
                like.shape(),
                self.begin
            )
        };
        if dy.rank() != dims.len() || self.begin.len() != dims.len() {
            return Err(bad().into());
        }
        let mut begin = Vec::with_capacity(dims.len());
        for ((&b, &d), &n) in self.begin.iter().zip(dims).zip(dy.dims()) {
            let b = usize::try_from(b).map_err(|_| bad())?;
            if b.checked_add(n).map_or(true, |e| e > d) {
                return Err(bad().into());
            }
            begin.push(b);
        }
        let out = dispatch_any!(dy.dtype(), scatter_block(dy, dims, &begin))?;
        ctx.set_output(0, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_strided_transposes_and_rejects_overruns() {
        // [2, 3] read transposed.
        let src = [0, 1, 2, 3, 4, 5];
        let mut dst = [0; 6];
        gather_strided(&src, 0, &[1, 3], &[3, 2], &mut dst).unwrap();
        assert_eq!(dst, [0, 3, 1, 4, 2, 5]);
        let e = gather_strided(&src, 1, &[1, 3], &[3, 2], &mut dst).unwrap_err();
        assert!(e.contains("layout"), "{e}");
    }

    #[test]
    fn row_major_strides() {
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(strides(&[]), Vec::<usize>::new());
    }
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]).
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("Transpose", transpose_grad);
        r.set_gradient("Split", split_grad);
        r.set_gradient("Concat", concat_grad);
        r.set_gradient("Slice", |b, f, dys| {
            Ok(vec![Some(b.op(
                "SliceGrad",
                "dx",
                &[only_dy(dys)?, f.input(0)?],
                &[("begin", AttrValue::IntList(f.ints_attr("begin")?))],
            ))])
        });
    }

    fn int_attr(f: &ForwardNode, name: &str) -> Result<i64, String> {
        match f.attr(name)? {
            AttrValue::Int(v) => Ok(*v),
            v => Err(format!("attribute `{name}` is {}, not int", v.ty())),
        }
    }

    fn transpose_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let perm = f.ints_attr("perm")?;
        let mut inverse = vec![0i64; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            let slot = usize::try_from(p)
                .ok()
                .and_then(|p| inverse.get_mut(p))
                .ok_or_else(|| format!("perm {perm:?} is not a permutation"))?;
            *slot = i as i64;
        }
        Ok(vec![Some(b.op(
            "Transpose",
            "dx",
            &[only_dy(dys)?],
            &[("perm", AttrValue::IntList(inverse))],
        ))])
    }

    fn split_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let mut parts = Vec::with_capacity(f.output_types.len());
        for k in 0..f.output_types.len() {
            parts.push(match dys.get(k).cloned().flatten() {
                Some(dy) => dy,
                None => b.unary("ZerosLike", &format!("zeros_{k}"), &f.output(k)),
            });
        }
        let refs: Vec<&Output> = parts.iter().collect();
        Ok(vec![Some(b.op(
            "Concat",
            "dx",
            &refs,
            &[("axis", AttrValue::Int(int_attr(f, "axis")?))],
        ))])
    }

    fn concat_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let n = f.inputs.len();
        if n == 1 {
            return Ok(vec![Some(dy.clone())]);
        }
        let out = f.output_type(0)?;
        let rank = out
            .shape
            .rank()
            .ok_or("the gradient of Concat needs the rank of its output")?;
        let axis = normalize_axis("Concat", int_attr(f, "axis")?, rank, &out.shape)?;
        let mut offset = 0usize;
        let mut grads = Vec::with_capacity(n);
        for i in 0..n {
            let mut begin = vec![0i64; rank];
            let mut size = vec![-1i64; rank];
            begin[axis] = offset as i64;
            if i + 1 < n {
                let len = f.input_type(i)?.shape.dim(axis).ok_or_else(|| {
                    format!(
                        "the gradient of Concat needs the static size along axis {axis} of \
                         values[{i}] (shape {})",
                        f.input_types[i].shape
                    )
                })?;
                size[axis] = len as i64;
                offset += len;
            }
            grads.push(Some(b.op(
                "Slice",
                &format!("d_values_{i}"),
                &[dy],
                &[
                    ("begin", AttrValue::IntList(begin)),
                    ("size", AttrValue::IntList(size)),
                ],
            )));
        }
        Ok(grads)
    }
}
