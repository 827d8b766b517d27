//! The run-time shape chain TensorFlow's gradients use when shapes are not static:
//! `BroadcastGradientArgs` (which axes each operand of a broadcasting op was stretched along),
//! `DynamicSum` (TensorFlow's `Sum` whose `reduction_indices` is a tensor) and `DynamicReshape`
//! (TensorFlow's `Reshape` whose `shape` is a tensor), with their CPU kernels and gradients.
//!
//! A TF 1.x graph exported with an unknown batch dimension computes the gradient of a
//! broadcasting `Add`/`Sub`/`Mul`/`Div` as `Reshape(Sum(grad, BroadcastGradientArgs(Shape(x),
//! Shape(y))[i]), Shape(x))`: the axes and the shape exist only once the fed batch is known.
//! dflow runs the chain as TensorFlow does, as ops on int32/int64 tensors, rather than
//! specializing the graph per batch size: the partitioner places and splits the graph once, the
//! same partitions serve every batch size, and the values equal TensorFlow's because the ops
//! are TensorFlow's. Their shape rules know ranks at most (a value-dependent shape is unknown
//! until the step runs, which dflow's partially known shapes express).

use super::array::resolve_shape;
use super::elementwise::stateless;
use super::grad::{broadcast_strides, for_each_mapped};
use super::reduce::sum_over;
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit};

/// The ops this module registers.
pub const OPS: [&str; 6] = [
    "BroadcastGradientArgs",
    "DynamicSum",
    "DynamicSumGrad",
    "DynamicReshape",
    "BroadcastTo",
    "DynamicStitch",
];

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(broadcast_gradient_args());
    r.add(dynamic_sum());
    r.add(dynamic_sum_grad());
    r.add(dynamic_reshape());
    r.add(broadcast_to_op());
    r.add(dynamic_stitch());
}

/// The values of an int32/int64 tensor of rank ≤ 1.
fn int_vector(t: &Tensor, what: &str) -> Result<Vec<i64>, String> {
    if t.rank() > 1 {
        return Err(format!(
            "{what} must be a scalar or a vector, got shape {:?}",
            t.dims()
        ));
    }
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

/// Requires an int32/int64 scalar or vector type.
fn require_int_vector(op: &str, what: &str, t: &TensorType) -> Result<(), String> {
    if !matches!(t.dtype, DType::I32 | DType::I64) {
        return Err(format!("{op}: {what} must be int32 or int64, found {t}"));
    }
    if t.shape.rank().is_some_and(|r| r > 1) {
        return Err(format!(
            "{op}: {what} must be a scalar or a vector, found {t}"
        ));
    }
    Ok(())
}

/// An int vector of `dtype` (int32 or int64) holding `values`.
fn int_tensor(dtype: DType, values: &[i64]) -> Result<Tensor, String> {
    let t = if dtype == DType::I32 {
        let v = values
            .iter()
            .map(|&x| i32::try_from(x).map_err(|_| format!("{x} exceeds int32")))
            .collect::<Result<Vec<i32>, _>>()?;
        Tensor::from_slice(&[v.len()], &v)
    } else {
        Tensor::from_slice(&[values.len()], values)
    };
    t.map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------------------------
// BroadcastGradientArgs
// ---------------------------------------------------------------------------------------------

fn broadcast_gradient_args() -> OpDef {
    OpDef::new(
        "BroadcastGradientArgs",
        "r0, r1 = the axes along which shapes s0 and s1 are stretched when broadcast together \
         (TensorFlow's BroadcastGradientArgs): the gradient of a broadcasting op is summed over \
         r0 for its first operand and over r1 for its second. Shapes are right-aligned and \
         padded with 1s; an axis where both are 1 is in both lists; equal shapes give two empty \
         lists. In: s0, s1 (int32 or int64 vectors, one dtype). Out: r0, r1 (the same dtype, \
         ascending).",
        |ctx| {
            let (a, b) = (ctx.input(0)?, ctx.input(1)?);
            for (what, t) in [("s0", a), ("s1", b)] {
                require_int_vector("BroadcastGradientArgs", what, t)?;
            }
            if a.dtype != b.dtype {
                return Err(format!(
                    "BroadcastGradientArgs: s0 is {a} but s1 is {b}; both must have one dtype"
                )
                .into());
            }
            let out = TensorType::new(a.dtype, Shape::partial(vec![None]));
            Ok(vec![out.clone(), out])
        },
    )
    .inputs([arg("s0"), arg("s1")])
    .outputs([arg("r0"), arg("r1")])
    .cpu_kernel(|_| stateless(broadcast_gradient_args_kernel))
}

/// TensorFlow's `BCast` reduction indices (`fewer_dims_optimization` off, as
/// `BroadcastGradientArgs` runs it) for shapes `s0` and `s1`.
pub fn gradient_reduction_axes(s0: &[i64], s1: &[i64]) -> Result<(Vec<i64>, Vec<i64>), String> {
    if let Some(d) = s0.iter().chain(s1).find(|&&d| d < 0) {
        return Err(format!(
            "dimension {d} is negative (shapes {s0:?} and {s1:?})"
        ));
    }
    if s0 == s1 {
        return Ok((vec![], vec![]));
    }
    let rank = s0.len().max(s1.len());
    let at = |s: &[i64], i: usize| {
        let pad = rank - s.len();
        if i < pad {
            1
        } else {
            s[i - pad]
        }
    };
    let (mut r0, mut r1) = (vec![], vec![]);
    for i in 0..rank {
        let (a, b) = (at(s0, i), at(s1, i));
        let axis = i as i64;
        match (a, b) {
            (1, 1) => {
                r0.push(axis);
                r1.push(axis);
            }
            (1, _) => r0.push(axis),
            (_, 1) => r1.push(axis),
            (a, b) if a == b => {}
            (a, b) => {
                return Err(format!(
                    "incompatible shapes {s0:?} and {s1:?} (dimension {i} of the broadcast: {a} \
                     vs {b})"
                ))
            }
        }
    }
    Ok((r0, r1))
}

fn broadcast_gradient_args_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (a, b) = (ctx.input(0)?, ctx.input(1)?);
    let s0 = int_vector(a, "BroadcastGradientArgs: s0")?;
    let s1 = int_vector(b, "BroadcastGradientArgs: s1")?;
    let (r0, r1) =
        gradient_reduction_axes(&s0, &s1).map_err(|e| format!("BroadcastGradientArgs: {e}"))?;
    let dtype = a.dtype();
    ctx.set_output(0, int_tensor(dtype, &r0)?)?;
    ctx.set_output(1, int_tensor(dtype, &r1)?)
}

// ---------------------------------------------------------------------------------------------
// DynamicSum
// ---------------------------------------------------------------------------------------------

fn dynamic_sum() -> OpDef {
    OpDef::new(
        "DynamicSum",
        "y = the sum of x over the axes held in the tensor `axes` (TensorFlow's Sum with a \
         computed reduction_indices; negative axes count from the end, each axis at most once; \
         an empty `axes` reduces nothing, as in TensorFlow). In: x (numeric), axes (int32 or \
         int64, scalar or vector). Out: y, x's dtype. Attrs: keep_dims (bool, default false).",
        |ctx| {
            let (x, axes) = (ctx.input(0)?, ctx.input(1)?);
            super::math::require_numeric("DynamicSum", "x", x)?;
            require_int_vector("DynamicSum", "axes", axes)?;
            // Which axes go is known only at run time: with keep_dims the rank stays.
            let shape = if ctx.bool("keep_dims")? {
                x.shape
                    .rank()
                    .map_or_else(Shape::unknown, |r| Shape::partial(vec![None; r]))
            } else {
                Shape::unknown()
            };
            Ok(vec![TensorType::new(x.dtype, shape)])
        },
    )
    .inputs([arg("x"), arg("axes")])
    .outputs([arg("y")])
    .attrs([attr_or(
        "keep_dims",
        AttrType::Bool,
        AttrDefault::Bool(false),
    )])
    .cpu_kernel(DynamicSumKernel::build)
}

#[derive(Debug)]
struct DynamicSumKernel {
    keep_dims: bool,
}

impl DynamicSumKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        match init.attr("keep_dims")? {
            AttrValue::Bool(b) => Ok(Box::new(DynamicSumKernel { keep_dims: *b })),
            v => Err(format!("attribute `keep_dims` is {}, not bool", v.ty()).into()),
        }
    }
}

impl Kernel for DynamicSumKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let axes = int_vector(ctx.input(1)?, "DynamicSum: axes")?;
        // dflow's reductions read empty axes as "all"; TensorFlow's as "none".
        let y = if axes.is_empty() {
            x.clone()
        } else {
            sum_over("DynamicSum", x, &axes, self.keep_dims)?
        };
        ctx.set_output(0, y)
    }
}

fn dynamic_sum_grad() -> OpDef {
    OpDef::new(
        "DynamicSumGrad",
        "The gradient of DynamicSum: dx = dy copied along the reduced `axes` to x's run-time \
         shape. In: dy (DynamicSum's output gradient), x (its input), axes (its axes). Out: dx, \
         dy's dtype and x's shape. Attrs: keep_dims (bool, DynamicSum's).",
        |ctx| {
            let (dy, x) = (ctx.input(0)?, ctx.input(1)?);
            require_int_vector("DynamicSumGrad", "axes", ctx.input(2)?)?;
            Ok(vec![TensorType::new(dy.dtype, x.shape.clone())])
        },
    )
    .inputs([arg("dy"), arg("x"), arg("axes")])
    .outputs([arg("dx")])
    .attrs([attr_or(
        "keep_dims",
        AttrType::Bool,
        AttrDefault::Bool(false),
    )])
    .cpu_kernel(|_| stateless(dynamic_sum_grad_kernel))
}

/// `t` copied to `dims` along its size-1 (or missing leading) dimensions, for any dtype.
pub(crate) fn broadcast_to(t: &Tensor, dims: &[usize]) -> Result<Tensor, String> {
    let strides = broadcast_strides(dims, t.dims())?;
    let size = t.dtype().size_of();
    let src = t.as_bytes();
    let n: usize = dims.iter().product();
    let mut out = vec![0u8; n * size];
    for_each_mapped(dims, &strides, |i, j| {
        out[i * size..(i + 1) * size].copy_from_slice(&src[j * size..(j + 1) * size]);
    });
    Tensor::from_bytes(t.dtype(), dims, &out).map_err(|e| e.to_string())
}

fn dynamic_sum_grad_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (dy, x) = (ctx.input(0)?, ctx.input(1)?);
    let axes = int_vector(ctx.input(2)?, "DynamicSumGrad: axes")?;
    let rank = x.rank();
    let mut kept = x.dims().to_vec();
    for &a in &axes {
        let i = super::reduce::normalize_axis("DynamicSumGrad", a, rank, &x.shape())?;
        kept[i] = 1;
    }
    let dy = dy
        .reshaped(&kept)
        .map_err(|e| format!("DynamicSumGrad: dy of shape {:?}: {e}", dy.dims()))?;
    ctx.set_output(0, broadcast_to(&dy, x.dims())?)
}

// ---------------------------------------------------------------------------------------------
// DynamicReshape
// ---------------------------------------------------------------------------------------------

fn dynamic_reshape() -> OpDef {
    OpDef::new(
        "DynamicReshape",
        "output = tensor laid out as the dims held in the tensor `shape` (TensorFlow's Reshape \
         with a computed shape; at most one -1, inferred from the element count). In: tensor \
         (any dtype), shape (int32 or int64 vector). Out: output, tensor's dtype, rank the \
         length of `shape`.",
        |ctx| {
            let (x, shape) = (ctx.input(0)?, ctx.input(1)?);
            require_int_vector("DynamicReshape", "shape", shape)?;
            let rank = match shape.shape.dims() {
                Some([n]) => *n,
                Some([]) => Some(0),
                _ => None,
            };
            let out = rank.map_or_else(Shape::unknown, |r| Shape::partial(vec![None; r]));
            Ok(vec![TensorType::new(x.dtype, out)])
        },
    )
    .inputs([arg("tensor"), arg("shape")])
    .outputs([arg("output")])
    .cpu_kernel(|_| stateless(dynamic_reshape_kernel))
}

fn dynamic_reshape_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let x = ctx.input(0)?;
    let target = int_vector(ctx.input(1)?, "DynamicReshape: shape")?;
    let dims =
        resolve_shape(&x.shape(), x.num_elements(), &target).map_err(|e| format!("Dynamic{e}"))?;
    ctx.set_output(0, x.reshaped(&dims).map_err(|e| e.to_string())?)
}

// ---------------------------------------------------------------------------------------------
// BroadcastTo
// ---------------------------------------------------------------------------------------------

fn broadcast_to_op() -> OpDef {
    OpDef::new(
        "BroadcastTo",
        "output = input broadcast (NumPy rules) to the dims held in the tensor `shape` \
         (TensorFlow's BroadcastTo, which TensorFlow 2's gradients of reductions emit). In: \
         input (any dtype), shape (int32 or int64 vector). Out: output, input's dtype, rank the \
         length of `shape`.",
        |ctx| {
            let (x, shape) = (ctx.input(0)?, ctx.input(1)?);
            require_int_vector("BroadcastTo", "shape", shape)?;
            let rank = match shape.shape.dims() {
                Some([n]) => *n,
                Some([]) => Some(0),
                _ => None,
            };
            let out = rank.map_or_else(Shape::unknown, |r| Shape::partial(vec![None; r]));
            Ok(vec![TensorType::new(x.dtype, out)])
        },
    )
    .inputs([arg("input"), arg("shape")])
    .outputs([arg("output")])
    .cpu_kernel(|_| stateless(broadcast_to_kernel))
}

fn broadcast_to_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let x = ctx.input(0)?;
    let target = int_vector(ctx.input(1)?, "BroadcastTo: shape")?;
    let dims = super::tf_compat::checked_dims(&target, x.dtype(), "BroadcastTo")?;
    let y = broadcast_to(x, &dims).map_err(|e| format!("BroadcastTo: {e}"))?;
    ctx.set_output(0, y)
}

// ---------------------------------------------------------------------------------------------
// DynamicStitch
// ---------------------------------------------------------------------------------------------

fn dynamic_stitch() -> OpDef {
    OpDef::new(
        "DynamicStitch",
        "merged[indices[m][i]] = data[m][i] (TensorFlow's DynamicStitch; later m win; merged has \
         max index + 1 rows, each of data's trailing shape). In: indices_and_data: N int32 \
         index tensors then N data tensors of one dtype (2N inputs, data[m]'s shape \
         indices[m]'s shape + a common trailing shape). Out: merged.",
        |ctx| {
            let n = ctx.inputs.len();
            if n < 2 || n % 2 != 0 {
                return Err(format!(
                    "DynamicStitch: needs N index tensors then N data tensors, got {n} inputs"
                )
                .into());
            }
            let (indices, data) = ctx.inputs.split_at(n / 2);
            for (i, t) in indices.iter().enumerate() {
                if !matches!(t.dtype, DType::I32 | DType::I64) {
                    return Err(
                        format!("DynamicStitch: indices[{i}] must be int32, found {t}").into(),
                    );
                }
            }
            if let Some(t) = data.iter().find(|t| t.dtype != data[0].dtype) {
                return Err(format!(
                    "DynamicStitch: data tensors must share one dtype, found {} and {t}",
                    data[0]
                )
                .into());
            }
            // merged: [?] + the trailing dims of data[0] past its indices' rank.
            let shape = match (indices[0].shape.rank(), data[0].shape.dims()) {
                (Some(r), Some(d)) if d.len() >= r => {
                    let mut dims = vec![None];
                    dims.extend_from_slice(&d[r..]);
                    Shape::partial(dims)
                }
                _ => Shape::unknown(),
            };
            Ok(vec![TensorType::new(data[0].dtype, shape)])
        },
    )
    .inputs([variadic("indices_and_data")])
    .outputs([arg("merged")])
    .cpu_kernel(|_| stateless(dynamic_stitch_kernel))
}

fn dynamic_stitch_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let n = ctx.inputs.len();
    if n < 2 || n % 2 != 0 {
        return Err(format!("DynamicStitch: got {n} inputs, not 2N").into());
    }
    let half = n / 2;
    let mut rows: Vec<(usize, &[u8])> = Vec::new();
    let mut row_dims: Option<Vec<usize>> = None;
    let data0 = ctx.input(half)?;
    let (dtype, size) = (data0.dtype(), data0.dtype().size_of());
    for m in 0..half {
        let (idx, data) = (ctx.input(m)?, ctx.input(half + m)?);
        if data.dtype() != dtype {
            return Err(
                format!("DynamicStitch: data[{m}] is {}, not {dtype}", data.dtype()).into(),
            );
        }
        let ix = super::tf_compat::int_values(idx, "DynamicStitch: indices")?;
        let lead = idx.rank();
        if data.rank() < lead || data.dims()[..lead] != *idx.dims() {
            return Err(format!(
                "DynamicStitch: data[{m}] of shape {:?} does not start with indices[{m}]'s shape {:?}",
                data.dims(),
                idx.dims()
            ).into());
        }
        let trailing = data.dims()[lead..].to_vec();
        match &row_dims {
            Some(d) if *d != trailing => {
                return Err(format!(
                    "DynamicStitch: data[{m}] rows have shape {trailing:?}, others {d:?}"
                )
                .into())
            }
            _ => row_dims = Some(trailing.clone()),
        }
        let row = trailing.iter().product::<usize>() * size;
        let bytes = data.as_bytes();
        for (i, &k) in ix.iter().enumerate() {
            let k =
                usize::try_from(k).map_err(|_| format!("DynamicStitch: index {k} is negative"))?;
            rows.push((k, &bytes[i * row..(i + 1) * row]));
        }
    }
    let trailing = row_dims.unwrap_or_default();
    let rows_out = rows.iter().map(|&(k, _)| k + 1).max().unwrap_or(0);
    let mut dims = vec![rows_out];
    dims.extend_from_slice(&trailing);
    let dims_i: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
    super::tf_compat::checked_dims(&dims_i, dtype, "DynamicStitch")?;
    let row = trailing.iter().product::<usize>() * size;
    let mut out = vec![0u8; rows_out * row];
    for (k, src) in rows {
        out[k * row..(k + 1) * row].copy_from_slice(src);
    }
    ctx.set_output(
        0,
        Tensor::from_bytes(dtype, &dims, &out).map_err(|e| e.to_string())?,
    )
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]).
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{no_gradient, only_dy};

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("BroadcastGradientArgs", no_gradient);
        r.set_gradient("DynamicSum", |b, f, dys| {
            let dx = b.op(
                "DynamicSumGrad",
                "dx",
                &[only_dy(dys)?, f.input(0)?, f.input(1)?],
                &[("keep_dims", AttrValue::Bool(f.bool_attr("keep_dims")?))],
            );
            Ok(vec![Some(dx), None])
        });
        r.set_gradient("DynamicReshape", |b, f, dys| {
            let dx = b.binary("ReshapeLike", "dx", only_dy(dys)?, f.input(0)?);
            Ok(vec![Some(dx), None])
        });
        r.set_gradient("BroadcastTo", |b, f, dys| {
            let dx = b.binary("ReduceToShapeOf", "dx", only_dy(dys)?, f.input(0)?);
            Ok(vec![Some(dx), None])
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::math::{infer, tt};
    use super::super::testing::run_kernel;
    use super::*;
    use DType::*;

    fn v32(v: &[i32]) -> Tensor {
        Tensor::from_slice(&[v.len()], v).unwrap()
    }

    fn ints(t: &Tensor) -> Vec<i64> {
        int_vector(t, "t").unwrap()
    }

    /// TensorFlow 2.21's `tf.raw_ops.BroadcastGradientArgs` on each pair (int32).
    #[test]
    fn broadcast_gradient_args_match_tensorflow() {
        type Case = (
            &'static [i32],
            &'static [i32],
            &'static [i64],
            &'static [i64],
        );
        let cases: [Case; 13] = [
            (&[2, 3], &[3], &[], &[0]),
            (&[2, 3], &[2, 1], &[], &[1]),
            (&[1, 1], &[1], &[0, 1], &[0, 1]),
            (&[], &[4], &[0], &[]),
            (&[4], &[], &[], &[0]),
            (&[], &[], &[], &[]),
            (&[1], &[1], &[], &[]),
            (&[2, 1, 3], &[4, 1], &[1], &[0, 2]),
            (&[5, 1], &[1, 1], &[1], &[0, 1]),
            (&[3, 1], &[1], &[1], &[0, 1]),
            (&[1, 2], &[2, 1], &[0], &[1]),
            (&[0, 3], &[3], &[], &[0]),
            (&[2, 0], &[1], &[], &[0, 1]),
        ];
        for (s0, s1, r0, r1) in cases {
            let out = run_kernel("BroadcastGradientArgs", &[], &[v32(s0), v32(s1)])
                .unwrap_or_else(|e| panic!("{s0:?} {s1:?}: {e}"));
            assert_eq!(
                (ints(&out[0]), ints(&out[1])),
                (r0.to_vec(), r1.to_vec()),
                "{s0:?} {s1:?}"
            );
            assert_eq!(out[0].dtype(), I32);
        }
        // int64 in, int64 out.
        let s = |v: &[i64]| Tensor::from_slice(&[v.len()], v).unwrap();
        let out = run_kernel("BroadcastGradientArgs", &[], &[s(&[4, 3]), s(&[3])]).unwrap();
        assert_eq!((out[1].dtype(), ints(&out[1])), (I64, vec![0]));
        // TensorFlow: "Incompatible shapes: [2,3] vs. [4]".
        let e = run_kernel("BroadcastGradientArgs", &[], &[v32(&[2, 3]), v32(&[4])]).unwrap_err();
        assert!(e.contains("incompatible shapes [2, 3] and [4]"), "{e}");
        let e = run_kernel("BroadcastGradientArgs", &[], &[v32(&[-2]), v32(&[4])]).unwrap_err();
        assert!(e.contains("negative"), "{e}");
        assert_eq!(
            infer(
                "BroadcastGradientArgs",
                &[tt(I32, &[2]), tt(I32, &[-1])],
                &[]
            ),
            Ok(vec![tt(I32, &[-1]), tt(I32, &[-1])])
        );
        assert!(infer(
            "BroadcastGradientArgs",
            &[tt(I32, &[2]), tt(I64, &[1])],
            &[]
        )
        .is_err());
        assert!(infer(
            "BroadcastGradientArgs",
            &[tt(F32, &[2]), tt(F32, &[1])],
            &[]
        )
        .is_err());
    }

    #[test]
    fn dynamic_sum_reduces_the_run_time_axes() {
        let x = Tensor::from_slice(&[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let sum = |axes: &[i32], keep: bool| {
            run_kernel(
                "DynamicSum",
                &[("keep_dims", AttrValue::Bool(keep))],
                &[x.clone(), v32(axes)],
            )
            .unwrap()
            .remove(0)
        };
        let y = sum(&[0], false);
        assert_eq!(
            (y.dims(), y.as_slice::<f32>().unwrap()),
            (&[3][..], &[5.0, 7.0, 9.0][..])
        );
        let y = sum(&[-1], true);
        assert_eq!(
            (y.dims(), y.as_slice::<f32>().unwrap()),
            (&[2, 1][..], &[6.0, 15.0][..])
        );
        let y = sum(&[0, 1], false);
        assert_eq!(
            (y.dims(), y.as_slice::<f32>().unwrap()),
            (&[][..], &[21.0][..])
        );
        // TensorFlow: empty reduction_indices reduce nothing.
        let y = sum(&[], false);
        assert_eq!(y, x);
        let e = run_kernel("DynamicSum", &[], &[x.clone(), v32(&[2])]).unwrap_err();
        assert!(e.contains("DynamicSum"), "{e}");
        assert_eq!(
            infer("DynamicSum", &[tt(F32, &[-1, 3]), tt(I32, &[-1])], &[]),
            Ok(vec![TensorType::new(F32, Shape::unknown())])
        );
        assert_eq!(
            infer(
                "DynamicSum",
                &[tt(F32, &[-1, 3]), tt(I32, &[-1])],
                &[("keep_dims", AttrValue::Bool(true))]
            ),
            Ok(vec![tt(F32, &[-1, -1])])
        );
    }

    #[test]
    fn dynamic_sum_grad_copies_along_the_reduced_axes() {
        let x = Tensor::zeros(F32, &[2, 3]).unwrap();
        let dy = Tensor::from_slice(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
        let dx = run_kernel("DynamicSumGrad", &[], &[dy, x.clone(), v32(&[0])])
            .unwrap()
            .remove(0);
        assert_eq!(dx.dims(), [2, 3]);
        assert_eq!(
            dx.as_slice::<f32>().unwrap(),
            [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
        );
        let dy = Tensor::from_slice(&[2], &[1.0f32, 2.0]).unwrap();
        let dx = run_kernel("DynamicSumGrad", &[], &[dy, x, v32(&[-1])])
            .unwrap()
            .remove(0);
        assert_eq!(
            dx.as_slice::<f32>().unwrap(),
            [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        );
    }

    #[test]
    fn dynamic_reshape_takes_its_shape_at_run_time() {
        let x = Tensor::from_slice(&[2, 3], &[1i64, 2, 3, 4, 5, 6]).unwrap();
        let y = run_kernel("DynamicReshape", &[], &[x.clone(), v32(&[3, -1])])
            .unwrap()
            .remove(0);
        assert_eq!(y.dims(), [3, 2]);
        assert_eq!(y.as_slice::<i64>().unwrap(), [1, 2, 3, 4, 5, 6]);
        let e = run_kernel("DynamicReshape", &[], &[x.clone(), v32(&[4, 2])]).unwrap_err();
        assert!(e.contains("DynamicReshape: cannot reshape"), "{e}");
        let e = run_kernel("DynamicReshape", &[], &[x, v32(&[-1, -1])]).unwrap_err();
        assert!(e.contains("more than one -1"), "{e}");
        assert_eq!(
            infer("DynamicReshape", &[tt(F32, &[-1, 3]), tt(I32, &[2])], &[]),
            Ok(vec![tt(F32, &[-1, -1])])
        );
    }

    /// TensorFlow's `reduced_shape` ([2, 3, 5, 7] reduced over axes [1, 2], keepdims): the
    /// DynamicStitch of range(4) and the axes, over the shape and ones (TensorFlow's own
    /// example: [2, 1, 1, 7]); and stitching rows, later tensors winning.
    #[test]
    fn dynamic_stitch_merges_like_tensorflow() {
        let out = run_kernel(
            "DynamicStitch",
            &[],
            &[
                v32(&[0, 1, 2, 3]),
                v32(&[1, 2]),
                v32(&[2, 3, 5, 7]),
                v32(&[1, 1]),
            ],
        )
        .unwrap()
        .remove(0);
        assert_eq!(ints(&out), [2, 1, 1, 7]);
        // Rows: data[0] is [2, 2] at indices [0, 2]; data[1] is [1, 2] at index [2] (wins).
        let d0 = Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let d1 = Tensor::from_slice(&[1, 2], &[9.0f32, 8.0]).unwrap();
        let out = run_kernel("DynamicStitch", &[], &[v32(&[0, 2]), v32(&[2]), d0, d1])
            .unwrap()
            .remove(0);
        assert_eq!(out.dims(), [3, 2]);
        assert_eq!(
            out.as_slice::<f32>().unwrap(),
            [1.0, 2.0, 0.0, 0.0, 9.0, 8.0]
        );
        let e = run_kernel("DynamicStitch", &[], &[v32(&[-1]), v32(&[5])]).unwrap_err();
        assert!(e.contains("negative"), "{e}");
        let e = run_kernel("DynamicStitch", &[], &[v32(&[0, 1]), v32(&[5])]).unwrap_err();
        assert!(e.contains("does not start with"), "{e}");
        assert!(infer("DynamicStitch", &[tt(I32, &[2])], &[]).is_err());
        assert_eq!(
            infer(
                "DynamicStitch",
                &[tt(I32, &[4]), tt(I32, &[-1]), tt(I32, &[4]), tt(I32, &[-1])],
                &[]
            ),
            Ok(vec![tt(I32, &[-1])])
        );
    }

    #[test]
    fn broadcast_to_takes_its_shape_at_run_time() {
        let x = Tensor::from_slice(&[2, 1], &[1.0f32, 2.0]).unwrap();
        let y = run_kernel("BroadcastTo", &[], &[x.clone(), v32(&[2, 3])])
            .unwrap()
            .remove(0);
        assert_eq!(y.dims(), [2, 3]);
        assert_eq!(y.as_slice::<f32>().unwrap(), [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
        let y = run_kernel("BroadcastTo", &[], &[x.clone(), v32(&[4, 2, 2])])
            .unwrap()
            .remove(0);
        assert_eq!(y.dims(), [4, 2, 2]);
        let e = run_kernel("BroadcastTo", &[], &[x.clone(), v32(&[3, 3])]).unwrap_err();
        assert!(e.contains("BroadcastTo"), "{e}");
        let e = run_kernel("BroadcastTo", &[], &[x, v32(&[1 << 30, 1 << 30])]).unwrap_err();
        assert!(e.contains("larger than"), "{e}");
        assert_eq!(
            infer("BroadcastTo", &[tt(F32, &[-1, 1]), tt(I32, &[2])], &[]),
            Ok(vec![tt(F32, &[-1, -1])])
        );
    }

    #[test]
    fn ops_lists_what_is_registered() {
        for op in OPS {
            assert!(registry().get(op).is_some(), "{op}");
        }
    }
}
