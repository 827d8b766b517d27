//! Ops that only autodiff emits: ReduceToShapeOf, BroadcastLike, ReshapeLike.
//!
//! They take a second input whose **run-time** shape drives the result, so gradients stay correct
//! when a dimension (the batch) is unknown until the step runs. Their CPU kernels live here too.

use super::math::require_numeric;
use super::*;
use crate::kernel::{FnKernel, Kernel, KernelContext, KernelInit};

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(reduce_to_shape_of());
    r.add(broadcast_like());
    r.add(reshape_like());
}

// ---------------------------------------------------------------------------------------------
// Shared kernel helpers
// ---------------------------------------------------------------------------------------------

/// Float element types the gradient and optimizer kernels support.
pub(crate) trait Real:
    crate::Element
    + Copy
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
{
    /// From f64 (rounding for f32).
    fn from_f64(x: f64) -> Self;
    /// To f64.
    fn to_f64(self) -> f64;
    /// Square root.
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
}

/// Calls `$f::<T>(args)` for the float dtype `$dtype` (f32 or f64), else returns an error.
macro_rules! dispatch_real {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            crate::DType::F32 => $f::<f32>($($arg),*).map_err(crate::OpError::from),
            crate::DType::F64 => $f::<f64>($($arg),*).map_err(crate::OpError::from),
            d => Err(crate::OpError::Invalid(format!(
                "this kernel supports f32 and f64, got {d}"
            ))),
        }
    };
}
pub(crate) use dispatch_real;

/// Strides into a tensor of shape `small` (right-aligned, size-1 dims broadcast) for each
/// dimension of `big`: 0 along broadcast dimensions.
pub(crate) fn broadcast_strides(big: &[usize], small: &[usize]) -> Result<Vec<usize>, String> {
    let bad = || format!("shape {small:?} does not broadcast to {big:?}");
    if small.len() > big.len() {
        return Err(bad());
    }
    let pad = big.len() - small.len();
    let mut strides = vec![0; big.len()];
    let mut s = 1usize;
    for i in (0..small.len()).rev() {
        let (d, bd) = (small[i], big[pad + i]);
        if d == bd && d != 1 {
            strides[pad + i] = s;
        } else if d != 1 {
            return Err(bad());
        }
        s = s.saturating_mul(d);
    }
    Ok(strides)
}

/// Calls `f(i, j)` for every flat index `i` of shape `big`, with `j` the flat index it maps to
/// under `strides` (from [`broadcast_strides`]).
pub(crate) fn for_each_mapped(big: &[usize], strides: &[usize], mut f: impl FnMut(usize, usize)) {
    let n: usize = big.iter().product();
    let mut idx = vec![0usize; big.len()];
    let mut j = 0usize;
    for i in 0..n {
        f(i, j);
        for d in (0..big.len()).rev() {
            idx[d] += 1;
            j += strides[d];
            if idx[d] < big[d] {
                break;
            }
            j -= strides[d] * idx[d];
            idx[d] = 0;
        }
    }
}

fn input2<'a>(ctx: &'a KernelContext<'_>) -> Result<(&'a Tensor, &'a Tensor), String> {
    Ok((ctx.input(0)?, ctx.input(1)?))
}

// ---------------------------------------------------------------------------------------------
// ReduceToShapeOf
// ---------------------------------------------------------------------------------------------

fn reduce_to_shape_of() -> OpDef {
    OpDef::new(
        "ReduceToShapeOf",
        "output = grad summed over the dimensions along which `like` was broadcast, reshaped to \
         like's run-time shape (TensorFlow's BroadcastGradientArgs + Sum + Reshape). In: grad \
         (float), like (any). Out: output, grad's dtype and like's shape.",
        |ctx| {
            let (g, like) = (ctx.input(0)?, ctx.input(1)?);
            require_float("ReduceToShapeOf: grad", g)?;
            Ok(vec![TensorType::new(g.dtype, like.shape.clone())])
        },
    )
    .inputs([arg("grad"), arg("like")])
    .outputs([arg("output")])
    .cpu_kernel(|_| Ok(Box::new(FnKernel(reduce_to_shape_of_kernel))))
}

fn reduce_to_shape_of_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (g, like) = input2(ctx)?;
    let out = if g.dims() == like.dims() {
        g.clone()
    } else {
        dispatch_real!(g.dtype(), reduce_to(g, like.dims()))?
    };
    ctx.set_output(0, out)
}

fn reduce_to<T: Real>(g: &Tensor, dims: &[usize]) -> Result<Tensor, String> {
    let strides = broadcast_strides(g.dims(), dims)
        .map_err(|e| format!("cannot reduce gradient of shape {:?}: {e}", g.dims()))?;
    let src = g.as_slice::<T>().map_err(|e| e.to_string())?;
    let mut out = Tensor::zeros(T::DTYPE, dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    for_each_mapped(g.dims(), &strides, |i, j| dst[j] += src[i]);
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// BroadcastLike
// ---------------------------------------------------------------------------------------------

fn broadcast_like() -> OpDef {
    OpDef::new(
        "BroadcastLike",
        "The gradient of Sum/Mean: output = dy (the reduction's output gradient) copied along the \
         reduced `axes` of x's run-time shape, divided by the number of reduced elements when \
         `mean`. In: dy (float), x (numeric). Out: output, dy's dtype and x's shape. Attrs: axes \
         (list(int), [] = all), keep_dims (bool; how dy was reduced), mean (bool).",
        |ctx| {
            let (dy, x) = (ctx.input(0)?, ctx.input(1)?);
            require_float("BroadcastLike: dy", dy)?;
            require_numeric("BroadcastLike", "x", x)?;
            Ok(vec![TensorType::new(dy.dtype, x.shape.clone())])
        },
    )
    .inputs([arg("dy"), arg("x")])
    .outputs([arg("output")])
    .attrs([
        attr_or("axes", AttrType::IntList, AttrDefault::Ints(&[])),
        attr_or("keep_dims", AttrType::Bool, AttrDefault::Bool(false)),
        attr_or("mean", AttrType::Bool, AttrDefault::Bool(false)),
    ])
    .cpu_kernel(BroadcastLikeKernel::build)
}

#[derive(Debug)]
struct BroadcastLikeKernel {
    axes: Vec<i64>,
    mean: bool,
}

impl BroadcastLikeKernel {
    fn build(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
        let axes = match init.attr("axes")? {
            AttrValue::IntList(v) => v.clone(),
            v => return Err(format!("attribute `axes` is {}, not list(int)", v.ty()).into()),
        };
        let mean = matches!(init.attr("mean")?, AttrValue::Bool(true));
        Ok(Box::new(BroadcastLikeKernel { axes, mean }))
    }
}

impl Kernel for BroadcastLikeKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (dy, x) = input2(ctx)?;
        let dims = x.dims();
        let rank = dims.len();
        let mut reduced = vec![self.axes.is_empty(); rank];
        for &a in &self.axes {
            let i = super::reduce::normalize_axis("BroadcastLike", a, rank, &x.shape())?;
            reduced[i] = true;
        }
        // dy laid out with the reduced dims kept as 1 (the same element order either way).
        let kept: Vec<usize> = dims
            .iter()
            .zip(&reduced)
            .map(|(&d, &r)| if r { 1 } else { d })
            .collect();
        if dy.num_elements() != kept.iter().product::<usize>() {
            return Err(format!(
                "dy has shape {:?} but reducing x of shape {dims:?} over axes {:?} gives {kept:?}",
                dy.dims(),
                self.axes
            )
            .into());
        }
        let count: usize = dims
            .iter()
            .zip(&reduced)
            .filter(|(_, &r)| r)
            .map(|(&d, _)| d)
            .product();
        let scale = if self.mean && count > 0 {
            1.0 / count as f64
        } else {
            1.0
        };
        let out = dispatch_real!(dy.dtype(), broadcast_to(dy, &kept, dims, scale))?;
        ctx.set_output(0, out)
    }
}

fn broadcast_to<T: Real>(
    dy: &Tensor,
    kept: &[usize],
    dims: &[usize],
    scale: f64,
) -> Result<Tensor, String> {
    let strides = broadcast_strides(dims, kept)?;
    let src = dy.as_slice::<T>().map_err(|e| e.to_string())?;
    let s = T::from_f64(scale);
    let mut out = Tensor::zeros(T::DTYPE, dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    for_each_mapped(dims, &strides, |i, j| dst[i] = src[j] * s);
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// ReshapeLike
// ---------------------------------------------------------------------------------------------

fn reshape_like() -> OpDef {
    OpDef::new(
        "ReshapeLike",
        "output = tensor's elements laid out in like's run-time shape (the gradient of Reshape). \
         In: tensor (any), like (any; same element count). Out: output, tensor's dtype and \
         like's shape.",
        |ctx| {
            let (t, like) = (ctx.input(0)?, ctx.input(1)?);
            Ok(vec![TensorType::new(t.dtype, like.shape.clone())])
        },
    )
    .inputs([arg("tensor"), arg("like")])
    .outputs([arg("output")])
    .cpu_kernel(|_| {
        Ok(Box::new(FnKernel(|ctx| {
            let (t, like) = input2(ctx)?;
            let out = t.reshaped(like.dims()).map_err(|e| {
                format!(
                    "cannot reshape tensor of shape {:?} like {:?}: {e}",
                    t.dims(),
                    like.dims()
                )
            })?;
            ctx.set_output(0, out)
        })))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::VariableCell;
    use std::sync::Arc;

    fn run(op: &str, attrs: &[(&str, AttrValue)], inputs: &[Tensor]) -> Result<Tensor, String> {
        let def = registry().get(op).unwrap();
        let mut map: BTreeMap<String, AttrValue> = def
            .attrs
            .iter()
            .filter_map(|a| Some((a.name.to_string(), a.default.value()?)))
            .collect();
        for (k, v) in attrs {
            map.insert(k.to_string(), v.clone());
        }
        let types: Vec<TensorType> = inputs
            .iter()
            .map(|t| TensorType::new(t.dtype(), t.shape()))
            .collect();
        let outs = (def.infer)(&InferCtx {
            node: "n",
            inputs: &types,
            attrs: &map,
        })?;
        let k = (def.kernel_for(&crate::DeviceType::CPU).unwrap())(&KernelInit {
            node: "n",
            attrs: &map,
            input_types: &types,
            output_types: &outs,
        })?;
        let mut outputs = vec![None];
        let vars: Vec<Arc<VariableCell>> = vec![];
        let inputs: Vec<&Tensor> = inputs.iter().collect();
        k.compute(&mut KernelContext {
            node: "n",
            inputs: &inputs,
            variables: &vars,
            step: 0,
            outputs: &mut outputs,
            collectives: None,
            output_memory: None,
        })?;
        Ok(outputs.pop().flatten().unwrap())
    }

    fn t(dims: &[usize], v: &[f64]) -> Tensor {
        Tensor::from_slice(dims, v).unwrap()
    }

    #[test]
    fn reduce_to_shape_of_sums_broadcast_dims() {
        let g = t(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
        let r = run("ReduceToShapeOf", &[], &[g.clone(), t(&[1, 3], &[0.; 3])]).unwrap();
        assert_eq!(r.dims(), &[1, 3]);
        assert_eq!(r.to_f64_vec(), vec![5., 7., 9.]);
        let r = run("ReduceToShapeOf", &[], &[g.clone(), t(&[2, 1], &[0.; 2])]).unwrap();
        assert_eq!(r.to_f64_vec(), vec![6., 15.]);
        let r = run("ReduceToShapeOf", &[], &[g.clone(), t(&[3], &[0.; 3])]).unwrap();
        assert_eq!(r.to_f64_vec(), vec![5., 7., 9.]);
        let r = run("ReduceToShapeOf", &[], &[g.clone(), Tensor::scalar(0.0f64)]).unwrap();
        assert_eq!((r.dims(), r.to_f64_vec()), (&[][..], vec![21.]));
        let same = run("ReduceToShapeOf", &[], &[g.clone(), t(&[2, 3], &[0.; 6])]).unwrap();
        assert_eq!(same.data_ptr(), g.data_ptr(), "same shape passes through");
        let err = run("ReduceToShapeOf", &[], &[g, t(&[4], &[0.; 4])]).unwrap_err();
        assert!(err.contains("[4]") && err.contains("[2, 3]"), "{err}");
    }

    #[test]
    fn broadcast_like_copies_and_scales() {
        let x = t(&[2, 3], &[0.; 6]);
        let dy = t(&[3], &[1., 2., 3.]);
        let axes = AttrValue::IntList(vec![0]);
        let r = run(
            "BroadcastLike",
            &[("axes", axes.clone())],
            &[dy.clone(), x.clone()],
        )
        .unwrap();
        assert_eq!(r.to_f64_vec(), vec![1., 2., 3., 1., 2., 3.]);
        let r = run(
            "BroadcastLike",
            &[("axes", axes), ("mean", AttrValue::Bool(true))],
            &[dy, x.clone()],
        )
        .unwrap();
        assert_eq!(r.to_f64_vec(), vec![0.5, 1., 1.5, 0.5, 1., 1.5]);
        let all = run(
            "BroadcastLike",
            &[("mean", AttrValue::Bool(true))],
            &[Tensor::scalar(6.0f64), x.clone()],
        )
        .unwrap();
        assert_eq!(all.to_f64_vec(), vec![1.; 6]);
        let rows = run(
            "BroadcastLike",
            &[
                ("axes", AttrValue::IntList(vec![-1])),
                ("keep_dims", AttrValue::Bool(true)),
            ],
            &[t(&[2, 1], &[1., 2.]), x.clone()],
        )
        .unwrap();
        assert_eq!(rows.to_f64_vec(), vec![1., 1., 1., 2., 2., 2.]);
        let err = run("BroadcastLike", &[], &[t(&[2], &[1., 2.]), x]).unwrap_err();
        assert!(err.contains("dy has shape [2]"), "{err}");
    }

    #[test]
    fn reshape_like_shares_the_buffer() {
        let x = t(&[6], &[1., 2., 3., 4., 5., 6.]);
        let r = run("ReshapeLike", &[], &[x.clone(), t(&[3, 2], &[0.; 6])]).unwrap();
        assert_eq!((r.dims(), r.data_ptr()), (&[3, 2][..], x.data_ptr()));
        assert!(run("ReshapeLike", &[], &[x, t(&[4], &[0.; 4])]).is_err());
    }
}
