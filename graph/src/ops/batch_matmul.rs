//! BatchMatMul: matrix products over the last two dimensions with NumPy-broadcast batch
//! dimensions (`[B, H, T, D] · [B, H, D, T]`, `[B, T, C] · [C, N]`).
//!
//! The kernel runs on [`super::gemm`]: a right operand without batch dimensions (a linear layer)
//! is one product of the flattened left operand; otherwise each batch element is one product,
//! split over the current rayon pool either inside the product (large matrices) or across batch
//! elements (many small ones, e.g. attention heads).

use super::broadcast::broadcast_dims;
use super::elementwise::{attr_bool, from_f32, slice, to_f32, unsupported};
use super::gemm::{matmul, GemmScalar, MatView, Threads, PARALLEL_MIN_FLOPS};
use super::math::{broadcast_shapes, require_same};
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit};
use crate::Element;
use rayon::prelude::*;

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(batch_mat_mul());
}

fn batch_mat_mul() -> OpDef {
    OpDef::new(
        "BatchMatMul",
        "output[..., :, :] = op(x[..., :, :]) · op(y[..., :, :]), op = transpose of the last two \
         dimensions when the flag is set; the batch dimensions (all but the last two) broadcast \
         like NumPy. In: x [..., M, K], y [..., K, N] (rank >= 2, same float dtype). Out: output \
         [broadcast batch..., M, N]. Attrs: adj_x, adj_y (bool, default false).",
        batch_mat_mul_infer,
    )
    .inputs([arg("x"), arg("y")])
    .outputs([arg("output")])
    .attrs([
        attr_or("adj_x", AttrType::Bool, AttrDefault::Bool(false)),
        attr_or("adj_y", AttrType::Bool, AttrDefault::Bool(false)),
    ])
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(BatchMatMulKernel {
            adj_x: attr_bool(init, "adj_x")?,
            adj_y: attr_bool(init, "adj_y")?,
        }))
    })
}

fn batch_mat_mul_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    const OP: &str = "BatchMatMul";
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let (ax, ay) = (ctx.bool("adj_x")?, ctx.bool("adj_y")?);
    let dtype = require_same(OP, ("x", x), ("y", y))?;
    require_float(&format!("{OP}: x"), x)?;
    let (Some(dx), Some(dy)) = (x.shape.dims(), y.shape.dims()) else {
        return Ok(vec![TensorType::new(dtype, Shape::unknown())]);
    };
    for (name, d, t) in [("x", dx, x), ("y", dy, y)] {
        if d.len() < 2 {
            return Err(format!("{OP}: {name} must have rank >= 2, got shape {}", t.shape).into());
        }
    }
    let (rx, ry) = (dx.len(), dy.len());
    let (m, kx) = if ax {
        (dx[rx - 1], dx[rx - 2])
    } else {
        (dx[rx - 2], dx[rx - 1])
    };
    let (ky, n) = if ay {
        (dy[ry - 1], dy[ry - 2])
    } else {
        (dy[ry - 2], dy[ry - 1])
    };
    if let (Some(a), Some(b)) = (kx, ky) {
        if a != b {
            return Err(format!(
                "{OP}: inner dimensions differ: x is {} (adj_x={ax}), y is {} (adj_y={ay})",
                x.shape, y.shape
            )
            .into());
        }
    }
    let batch = broadcast_shapes(
        &Shape::partial(dx[..rx - 2].to_vec()),
        &Shape::partial(dy[..ry - 2].to_vec()),
    )
    .map_err(|e| {
        format!(
            "{OP}: batch dimensions of x {} and y {}: {e}",
            x.shape, y.shape
        )
    })?;
    let mut out = batch.dims().map(<[_]>::to_vec).unwrap_or_default();
    out.extend([m, n]);
    Ok(vec![TensorType::new(dtype, Shape::partial(out))])
}

#[derive(Debug)]
struct BatchMatMulKernel {
    adj_x: bool,
    adj_y: bool,
}

/// Offsets (in matrices) into an operand of batch dims `small` for each batch element of the
/// broadcast batch `big`, in row-major order.
fn batch_offsets(big: &[usize], small: &[usize]) -> Vec<usize> {
    let pad = big.len() - small.len();
    let mut strides = vec![0usize; big.len()];
    let mut s = 1usize;
    for i in (0..small.len()).rev() {
        if small[i] != 1 {
            strides[pad + i] = s;
        }
        s *= small[i];
    }
    let n: usize = big.iter().product();
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; big.len()];
    let mut off = 0usize;
    for _ in 0..n {
        out.push(off);
        for d in (0..big.len()).rev() {
            idx[d] += 1;
            off += strides[d];
            if idx[d] < big[d] {
                break;
            }
            off -= strides[d] * big[d];
            idx[d] = 0;
        }
    }
    out
}

/// One BatchMatMul call, checked: the operands, the adj flags, the output dims, each batch
/// element's operand offsets (in matrices), the stored (rows, cols) of one matrix of x and of y,
/// and the product's (m, k, n).
struct Plan<'a> {
    x: &'a Tensor,
    y: &'a Tensor,
    adj: (bool, bool),
    out_dims: Vec<usize>,
    x_off: Vec<usize>,
    y_off: Vec<usize>,
    x_mat: (usize, usize),
    y_mat: (usize, usize),
    mkn: (usize, usize, usize),
}

fn run_plan<T: Element + GemmScalar>(p: &Plan<'_>) -> Result<Tensor, String> {
    let (xs, ys) = (slice::<T>(p.x)?, slice::<T>(p.y)?);
    let (m, k, n) = p.mkn;
    let mut out = Tensor::zeros(T::DTYPE, &p.out_dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    if m * n == 0 {
        return Ok(out);
    }
    let (xsz, ysz) = (p.x_mat.0 * p.x_mat.1, p.y_mat.0 * p.y_mat.1);
    // A right operand without batch dims and an untransposed left one: one product of the
    // flattened left operand ([batch·M, K] · [K, N]).
    if p.y.rank() == 2 && !p.adj.0 {
        let rows = dst.len() / n;
        let xv = MatView::row_major(xs, 0, (rows, k), false);
        let yv = MatView::row_major(ys, 0, p.y_mat, p.adj.1);
        return matmul(xv, yv, dst, Threads::Pool).map(|()| out);
    }
    let item = |b: usize, chunk: &mut [T], threads: Threads| {
        let xv = MatView::row_major(xs, p.x_off[b] * xsz, p.x_mat, p.adj.0);
        let yv = MatView::row_major(ys, p.y_off[b] * ysz, p.y_mat, p.adj.1);
        matmul(xv, yv, chunk, threads)
    };
    let per_item = m.saturating_mul(n).saturating_mul(k);
    let total = per_item.saturating_mul(p.x_off.len());
    if p.x_off.len() > 1 && per_item < PARALLEL_MIN_FLOPS && total >= PARALLEL_MIN_FLOPS {
        dst.par_chunks_mut(m * n)
            .enumerate()
            .try_for_each(|(b, chunk)| item(b, chunk, Threads::Caller))?;
    } else {
        for (b, chunk) in dst.chunks_mut(m * n).enumerate() {
            item(b, chunk, Threads::Pool)?;
        }
    }
    Ok(out)
}

impl Kernel for BatchMatMulKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "BatchMatMul";
        let (x, y) = (ctx.input(0)?, ctx.input(1)?);
        let (ax, ay) = (self.adj_x, self.adj_y);
        if x.dtype() != y.dtype() || x.rank() < 2 || y.rank() < 2 {
            return Err(format!(
                "{OP}: x {}{} and y {}{} must have rank >= 2 and the same dtype",
                x.dtype(),
                x.shape(),
                y.dtype(),
                y.shape()
            )
            .into());
        }
        let (dx, dy) = (x.dims(), y.dims());
        let (rx, ry) = (dx.len(), dy.len());
        let x_mat = (dx[rx - 2], dx[rx - 1]);
        let y_mat = (dy[ry - 2], dy[ry - 1]);
        let (m, kx) = if ax { (x_mat.1, x_mat.0) } else { x_mat };
        let (ky, n) = if ay { (y_mat.1, y_mat.0) } else { y_mat };
        if kx != ky {
            return Err(format!(
                "{OP}: inner dimensions differ: x is {} (adj_x={ax}), y is {} (adj_y={ay})",
                x.shape(),
                y.shape()
            )
            .into());
        }
        let batch = broadcast_dims(&dx[..rx - 2], &dy[..ry - 2])
            .map_err(|e| format!("{OP}: batch dimensions: {e}"))?;
        let mut out_dims = batch.clone();
        out_dims.extend([m, n]);
        let plan = Plan {
            x,
            y,
            adj: (ax, ay),
            x_off: batch_offsets(&batch, &dx[..rx - 2]),
            y_off: batch_offsets(&batch, &dy[..ry - 2]),
            out_dims,
            x_mat,
            y_mat,
            mkn: (m, kx, n),
        };
        let out = match x.dtype() {
            DType::F32 => run_plan::<f32>(&plan),
            DType::F64 => run_plan::<f64>(&plan),
            d @ (DType::BF16 | DType::F16) => {
                let (x32, y32) = (to_f32(x)?, to_f32(y)?);
                let wide = Plan {
                    x: &x32,
                    y: &y32,
                    ..plan
                };
                from_f32(&run_plan::<f32>(&wide)?, d)
            }
            d => Err(unsupported(OP, d)),
        }?;
        ctx.set_output(0, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_offsets_broadcast() {
        assert_eq!(batch_offsets(&[2, 3], &[2, 3]), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(batch_offsets(&[2, 3], &[3]), vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(batch_offsets(&[2, 3], &[2, 1]), vec![0, 0, 0, 1, 1, 1]);
        assert_eq!(batch_offsets(&[2, 3], &[]), vec![0; 6]);
        assert_eq!(batch_offsets(&[], &[]), vec![0]);
    }
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]).
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("BatchMatMul", batch_mat_mul_grad);
    }

    fn bmm(
        b: &mut GradBuilder,
        suffix: &str,
        x: &Output,
        y: &Output,
        ax: bool,
        ay: bool,
    ) -> Output {
        b.op(
            "BatchMatMul",
            suffix,
            &[x, y],
            &[
                ("adj_x", AttrValue::Bool(ax)),
                ("adj_y", AttrValue::Bool(ay)),
            ],
        )
    }

    /// The static shape of a gradient for input `i`: the output's batch dims and the input's
    /// matrix dims (unknown when a rank is).
    fn grad_shape(f: &ForwardNode, i: usize) -> Result<Shape, String> {
        let (out, input) = (&f.output_type(0)?.shape, &f.input_type(i)?.shape);
        Ok(match (out.dims(), input.dims()) {
            (Some(o), Some(d)) if o.len() >= 2 && d.len() >= 2 => Shape::partial(
                o[..o.len() - 2]
                    .iter()
                    .chain(&d[d.len() - 2..])
                    .copied()
                    .collect(),
            ),
            _ => Shape::unknown(),
        })
    }

    /// TensorFlow's `_BatchMatMulV2Grad`: one product per input with the matching adj flags,
    /// summed over the batch dimensions that input was broadcast along. A 2-D `y` under a left
    /// operand with batch dims (a linear layer) gets its gradient as one 2-D product of the
    /// flattened operands instead of a batch of products and a reduction.
    fn batch_mat_mul_grad(
        b: &mut GradBuilder,
        f: &ForwardNode,
        dys: &[Option<Output>],
    ) -> GradResult {
        let dz = only_dy(dys)?;
        let (x, y) = (f.input(0)?, f.input(1)?);
        let (ax, ay) = (f.bool_attr("adj_x")?, f.bool_attr("adj_y")?);
        let dx = match (ax, ay) {
            (false, false) => bmm(b, "dx", dz, y, false, true),
            (false, true) => bmm(b, "dx", dz, y, false, false),
            (true, false) => bmm(b, "dx", y, dz, false, true),
            (true, true) => bmm(b, "dx", y, dz, true, true),
        };
        let dx_shape = grad_shape(f, 0)?;
        let dx = b.reduce_to_input(f, 0, dx, &dx_shape, "dx_reduced")?;

        let (xt, yt) = (f.input_type(0)?, f.input_type(1)?);
        let y_static = yt.shape.as_static().filter(|d| d.len() == 2);
        let x_batched = xt.shape.rank().is_some_and(|r| r > 2);
        let dy = match y_static {
            Some(yd) if x_batched && !ax => {
                // x [.., M, K] flattened to [R, K]; dz [.., M, N] to [R, N].
                let (k, n) = if ay { (yd[1], yd[0]) } else { (yd[0], yd[1]) };
                let flat = |b: &mut GradBuilder, s: &str, t: &Output, cols: usize| {
                    b.op(
                        "Reshape",
                        s,
                        &[t],
                        &[("shape", AttrValue::IntList(vec![-1, cols as i64]))],
                    )
                };
                let x2 = flat(b, "x_flat", x, k);
                let dz2 = flat(b, "dz_flat", dz, n);
                if ay {
                    bmm(b, "dy", &dz2, &x2, true, false)
                } else {
                    bmm(b, "dy", &x2, &dz2, true, false)
                }
            }
            _ => {
                let dy = match (ax, ay) {
                    (false, false) => bmm(b, "dy", x, dz, true, false),
                    (false, true) => bmm(b, "dy", dz, x, true, false),
                    (true, false) => bmm(b, "dy", x, dz, false, false),
                    (true, true) => bmm(b, "dy", dz, x, true, true),
                };
                let dy_shape = grad_shape(f, 1)?;
                b.reduce_to_input(f, 1, dy, &dy_shape, "dy_reduced")?
            }
        };
        Ok(vec![Some(dx), Some(dy)])
    }
}
