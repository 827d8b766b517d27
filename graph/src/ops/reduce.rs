//! Reductions: Sum, Mean, Max, ArgMax.
//!
//! **Difference from TensorFlow:** the reduction axes are the attribute `axes` (list(int)), not
//! a second input tensor, and ArgMax's axis is the attribute `axis`, not its `dimension` input.
//! Static axes keep every output shape known at graph-construction time, which the partitioner's
//! buffer plan relies on. An empty `axes` (the default) reduces over **all** axes; TensorFlow
//! reduces over none when given an empty axes tensor. Negative axes count from the end;
//! out-of-range or repeated axes are errors. Each op lives in its own delimited block below.

use super::elementwise::{
    attr_bool, attr_dtype, attr_ints, from_f32, new_tensor, slice, to_f32, unsupported, Real,
};
use super::math::require_numeric;
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit};
use crate::Element;

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(sum());
    r.add(mean());
    r.add(max());
    r.add(arg_max());
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// Resolves a possibly negative `axis` of a tensor of `shape` (rank `rank`) to an index.
pub(crate) fn normalize_axis(
    op: &str,
    axis: i64,
    rank: usize,
    shape: &Shape,
) -> Result<usize, String> {
    let r = i64::try_from(rank).map_err(|_| format!("{op}: rank {rank} too large"))?;
    let resolved = if axis < 0 { axis + r } else { axis };
    if (0..r).contains(&resolved) {
        usize::try_from(resolved).map_err(|_| format!("{op}: axis {axis} out of range"))
    } else {
        Err(format!(
            "{op}: axis {axis} is out of range for input of shape {shape} (rank {rank}; valid \
             axes are -{rank}..{rank})"
        ))
    }
}

/// Declaration shared by Sum, Mean and Max.
fn reduction(name: &'static str, summary: &'static str, infer: ShapeFn) -> OpDef {
    OpDef::new(name, summary, infer)
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([
            attr_or("axes", AttrType::IntList, AttrDefault::Ints(&[])),
            attr_or("keep_dims", AttrType::Bool, AttrDefault::Bool(false)),
        ])
}

/// Shape rule shared by Sum, Mean and Max.
fn reduce_infer(op: &str, ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let x = ctx.input(0)?;
    require_numeric(op, "input", x)?;
    let axes = ctx.ints("axes")?;
    let keep_dims = ctx.bool("keep_dims")?;
    let Some(dims) = x.shape.dims() else {
        // Rank unknown: only literal repeats can be caught; the output rank is known only when
        // every axis is reduced away.
        for (i, a) in axes.iter().enumerate() {
            if axes[..i].contains(a) {
                return Err(format!("{op}: axis {a} is listed twice in axes {axes:?}").into());
            }
        }
        let shape = if axes.is_empty() && !keep_dims {
            Shape::scalar()
        } else {
            Shape::unknown()
        };
        return Ok(vec![TensorType::new(x.dtype, shape)]);
    };
    let rank = dims.len();
    let mut reduced = vec![axes.is_empty(); rank];
    for &a in axes {
        let i = normalize_axis(op, a, rank, &x.shape)?;
        if reduced[i] {
            return Err(format!(
                "{op}: axes {axes:?} name dimension {i} of input shape {} more than once",
                x.shape
            )
            .into());
        }
        reduced[i] = true;
    }
    let out: Vec<Option<usize>> = dims
        .iter()
        .zip(&reduced)
        .filter_map(|(&d, &r)| match (r, keep_dims) {
            (false, _) => Some(d),
            (true, true) => Some(Some(1)),
            (true, false) => None,
        })
        .collect();
    Ok(vec![TensorType::new(x.dtype, Shape::partial(out))])
}

// ---------------------------------------------------------------------------------------------
// Shared kernel code of Sum, Mean and Max
// ---------------------------------------------------------------------------------------------

/// Which reduction a [`ReduceKernel`] computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reduction {
    Sum,
    Mean,
    Max,
}

/// The kernel of Sum, Mean and Max: attrs are read once, axes resolved per call (the runtime
/// rank may be known only then).
///
/// Empty reductions: Sum gives 0, Mean gives NaN for floats and 0 for integers, Max gives the
/// lowest value (−∞, `MIN`) like TensorFlow. Max propagates NaN like NumPy. Integer sums wrap.
#[derive(Debug)]
struct ReduceKernel {
    op: &'static str,
    kind: Reduction,
    axes: Vec<i64>,
    keep_dims: bool,
}

fn reduce_factory(
    op: &'static str,
    kind: Reduction,
    init: &KernelInit<'_>,
) -> Result<Box<dyn Kernel>, OpError> {
    Ok(Box::new(ReduceKernel {
        op,
        kind,
        axes: attr_ints(init, "axes")?,
        keep_dims: attr_bool(init, "keep_dims")?,
    }))
}

/// A reduction resolved against a runtime shape: the input's dims collapsed into alternating
/// runs `(length, reduced)` (size-1 dims dropped, adjacent runs of one kind merged), so the
/// common cases (all axes, trailing axes, leading axes) become one or two flat loops.
#[derive(Debug)]
struct ReducePlan {
    runs: Vec<(usize, bool)>,
    out_dims: Vec<usize>,
    count: usize,
}

fn reduce_plan(
    op: &str,
    dims: &[usize],
    axes: &[i64],
    keep_dims: bool,
) -> Result<ReducePlan, String> {
    let rank = dims.len();
    let shape = Shape::known(dims);
    let mut reduced = vec![axes.is_empty(); rank];
    for &a in axes {
        let i = normalize_axis(op, a, rank, &shape)?;
        if reduced[i] {
            return Err(format!(
                "{op}: axes {axes:?} name dimension {i} of input shape {shape} more than once"
            ));
        }
        reduced[i] = true;
    }
    let mut runs: Vec<(usize, bool)> = Vec::new();
    let (mut out_dims, mut count) = (Vec::with_capacity(rank), 1usize);
    for (&d, &r) in dims.iter().zip(&reduced) {
        if r {
            count *= d;
            if keep_dims {
                out_dims.push(1);
            }
        } else {
            out_dims.push(d);
        }
        if d == 1 {
            continue;
        }
        match runs.last_mut() {
            Some((len, kind)) if *kind == r => *len *= d,
            _ => runs.push((d, r)),
        }
    }
    if runs.is_empty() {
        runs.push((1, true));
    }
    Ok(ReducePlan {
        runs,
        out_dims,
        count,
    })
}

/// Folds `xs` into `out` (pre-filled with the identity) along the plan's reduced runs.
pub(crate) fn reduce_into<T: Copy>(
    xs: &[T],
    runs: &[(usize, bool)],
    out: &mut [T],
    f: impl Fn(T, T) -> T,
) {
    let r = runs.len();
    let Some(&(inner, inner_reduced)) = runs.last() else {
        return;
    };
    if xs.is_empty() || inner == 0 {
        return;
    }
    let mut ostride = vec![0usize; r];
    let mut s = 1;
    for i in (0..r).rev() {
        if !runs[i].1 {
            ostride[i] = s;
            s *= runs[i].0;
        }
    }
    let mut idx = vec![0usize; r - 1];
    let mut ob = 0usize;
    for chunk in xs.chunks(inner) {
        if inner_reduced {
            out[ob] = chunk.iter().fold(out[ob], |a, &v| f(a, v));
        } else {
            for (o, &v) in out[ob..ob + inner].iter_mut().zip(chunk) {
                *o = f(*o, v);
            }
        }
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            ob += ostride[d];
            if idx[d] < runs[d].0 {
                break;
            }
            ob -= ostride[d] * runs[d].0;
            idx[d] = 0;
        }
    }
}

fn reduce_typed<T: Element>(
    x: &Tensor,
    p: &ReducePlan,
    identity: T,
    f: impl Fn(T, T) -> T,
) -> Result<Tensor, String> {
    let xs = slice::<T>(x)?;
    new_tensor(&p.out_dims, |out: &mut [T]| {
        out.fill(identity);
        reduce_into(xs, &p.runs, out, f);
    })
}

fn reduce_float<T: Real>(kind: Reduction, x: &Tensor, p: &ReducePlan) -> Result<Tensor, String> {
    match kind {
        Reduction::Sum => reduce_typed(x, p, T::ZERO, |a, b| a + b),
        Reduction::Mean => {
            let mut s = reduce_typed(x, p, T::ZERO, |a, b| a + b)?;
            let n = T::from_usize(p.count);
            for v in s.as_mut_slice::<T>().map_err(|e| e.to_string())? {
                *v = *v / n;
            }
            Ok(s)
        }
        Reduction::Max => reduce_typed(x, p, T::NEG_INFINITY, |a, b| {
            if b > a || b.is_nan() {
                b
            } else {
                a
            }
        }),
    }
}

macro_rules! reduce_int {
    ($t:ty, $kind:expr, $x:expr, $p:expr) => {
        match $kind {
            Reduction::Sum => reduce_typed::<$t>($x, $p, 0, <$t>::wrapping_add),
            Reduction::Mean => {
                let mut s = reduce_typed::<$t>($x, $p, 0, <$t>::wrapping_add)?;
                if let Ok(n) = <$t>::try_from($p.count) {
                    if n != 0 {
                        for v in s.as_mut_slice::<$t>().map_err(|e| e.to_string())? {
                            *v = v.wrapping_div(n);
                        }
                    }
                }
                Ok(s)
            }
            Reduction::Max => reduce_typed::<$t>($x, $p, <$t>::MIN, |a, b| a.max(b)),
        }
    };
}

/// `x` reduced over `axes` (empty: every axis) by `kind`; `op` names the op in errors.
fn reduce_tensor(
    op: &str,
    kind: Reduction,
    x: &Tensor,
    axes: &[i64],
    keep_dims: bool,
) -> Result<Tensor, String> {
    let p = reduce_plan(op, x.dims(), axes, keep_dims)?;
    match x.dtype() {
        DType::F32 => reduce_float::<f32>(kind, x, &p),
        DType::F64 => reduce_float::<f64>(kind, x, &p),
        DType::I32 => reduce_int!(i32, kind, x, &p),
        DType::I64 => reduce_int!(i64, kind, x, &p),
        d @ (DType::BF16 | DType::F16) => from_f32(&reduce_float::<f32>(kind, &to_f32(x)?, &p)?, d),
        d => Err(unsupported(op, d)),
    }
}

/// The sum of `x` over `axes` (each named once; empty: every axis), for ops that read their
/// axes at run time ([`super::tf_dynamic`]).
pub(crate) fn sum_over(
    op: &str,
    x: &Tensor,
    axes: &[i64],
    keep_dims: bool,
) -> Result<Tensor, String> {
    reduce_tensor(op, Reduction::Sum, x, axes, keep_dims)
}

impl Kernel for ReduceKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let y = reduce_tensor(self.op, self.kind, x, &self.axes, self.keep_dims)?;
        ctx.set_output(0, y)
    }
}

// ---------------------------------------------------------------------------------------------
// Sum
// ---------------------------------------------------------------------------------------------

fn sum() -> OpDef {
    reduction(
        "Sum",
        "output = sum of input over `axes`. In: input (numeric). Out: output, same dtype. \
         Attrs: axes (list(int), default [] = all axes; negative from the end), \
         keep_dims (bool, default false: reduced dims are removed, true: kept as 1).",
        |ctx| reduce_infer("Sum", ctx),
    )
    .cpu_kernel(|init| reduce_factory("Sum", Reduction::Sum, init))
}

// ---------------------------------------------------------------------------------------------
// Mean
// ---------------------------------------------------------------------------------------------

fn mean() -> OpDef {
    reduction(
        "Mean",
        "output = mean of input over `axes` (integers truncate). In: input (numeric). Out: output, \
         same dtype. Attrs: axes (list(int), default [] = all axes; negative from the end), \
         keep_dims (bool, default false).",
        |ctx| reduce_infer("Mean", ctx),
    )
    .cpu_kernel(|init| reduce_factory("Mean", Reduction::Mean, init))
}

// ---------------------------------------------------------------------------------------------
// Max
// ---------------------------------------------------------------------------------------------

fn max() -> OpDef {
    reduction(
        "Max",
        "output = maximum of input over `axes`. In: input (numeric). Out: output, same dtype. \
         Attrs: axes (list(int), default [] = all axes; negative from the end), \
         keep_dims (bool, default false).",
        |ctx| reduce_infer("Max", ctx),
    )
    .cpu_kernel(|init| reduce_factory("Max", Reduction::Max, init))
}

// ---------------------------------------------------------------------------------------------
// ArgMax
// ---------------------------------------------------------------------------------------------

fn arg_max() -> OpDef {
    OpDef::new(
        "ArgMax",
        "output = index of the largest value along `axis` (first on ties). In: input (rank >= 1, \
         numeric). Out: output, input's shape without `axis`. Attrs: axis (int, required; \
         negative from the end), output_type (i32 or i64, default i64).",
        arg_max_infer,
    )
    .inputs([arg("input")])
    .outputs([arg("output")])
    .attrs([
        attr("axis", AttrType::Int),
        attr_or(
            "output_type",
            AttrType::DType,
            AttrDefault::DType(DType::I64),
        ),
    ])
    .cpu_kernel(|init| {
        Ok(Box::new(ArgMaxKernel {
            axis: match init.attr("axis")? {
                AttrValue::Int(a) => *a,
                v => return Err(format!("attribute `axis` is {}, not int", v.ty()).into()),
            },
            output_type: attr_dtype(init, "output_type")?,
        }))
    })
}

/// ArgMax's kernel: ties give the first index; NaN counts as the largest value (first NaN wins),
/// like NumPy. An empty `axis` with a non-empty output is an error.
#[derive(Debug)]
struct ArgMaxKernel {
    axis: i64,
    output_type: DType,
}

fn arg_max_typed<T: Element>(
    xs: &[T],
    (outer, n, inner): (usize, usize, usize),
    better: impl Fn(T, T) -> bool,
) -> Vec<i64> {
    let mut idx = vec![0i64; outer * inner];
    if n == 0 || inner == 0 {
        return idx;
    }
    for (block, ib) in xs.chunks(n * inner).zip(idx.chunks_mut(inner)) {
        let mut best: Vec<T> = block[..inner].to_vec();
        for (k, row) in block.chunks(inner).enumerate().skip(1) {
            for ((b, i), &v) in best.iter_mut().zip(ib.iter_mut()).zip(row) {
                if better(v, *b) {
                    *b = v;
                    *i = k as i64;
                }
            }
        }
    }
    idx
}

impl Kernel for ArgMaxKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let dims = x.dims();
        if dims.is_empty() {
            return Err(
                format!("ArgMax: input must have rank >= 1, got shape {}", x.shape()).into(),
            );
        }
        let a = normalize_axis("ArgMax", self.axis, dims.len(), &x.shape())?;
        let (outer, n, inner): (usize, usize, usize) = (
            dims[..a].iter().product(),
            dims[a],
            dims[a + 1..].iter().product(),
        );
        let mut out_dims = dims.to_vec();
        out_dims.remove(a);
        if n == 0 && outer * inner > 0 {
            return Err(format!(
                "ArgMax: axis {} of input shape {} is empty; there is no largest value",
                self.axis,
                x.shape()
            )
            .into());
        }
        fn float_better<T: Real>(v: T, b: T) -> bool {
            v > b || (v.is_nan() && !b.is_nan())
        }
        let geom = (outer, n, inner);
        let idx = match x.dtype() {
            DType::F32 => arg_max_typed(slice::<f32>(x)?, geom, float_better::<f32>),
            DType::F64 => arg_max_typed(slice::<f64>(x)?, geom, float_better::<f64>),
            DType::I32 => arg_max_typed(slice::<i32>(x)?, geom, |v: i32, b| v > b),
            DType::I64 => arg_max_typed(slice::<i64>(x)?, geom, |v: i64, b| v > b),
            DType::BF16 | DType::F16 => {
                arg_max_typed(slice::<f32>(&to_f32(x)?)?, geom, float_better::<f32>)
            }
            d => return Err(unsupported("ArgMax", d).into()),
        };
        let y = match self.output_type {
            DType::I64 => Tensor::from_slice(&out_dims, &idx).map_err(|e| e.to_string())?,
            DType::I32 => {
                let narrow = idx
                    .iter()
                    .map(|&i| i32::try_from(i))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| format!("ArgMax: index does not fit in i32 (axis length {n})"))?;
                Tensor::from_slice(&out_dims, &narrow).map_err(|e| e.to_string())?
            }
            d => return Err(format!("ArgMax: output_type must be i32 or i64, got {d}").into()),
        };
        ctx.set_output(0, y)
    }
}

fn arg_max_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let x = ctx.input(0)?;
    require_numeric("ArgMax", "input", x)?;
    let axis = ctx.int("axis")?;
    let out_type = ctx.dtype("output_type")?;
    if !out_type.is_int() {
        return Err(format!("ArgMax: output_type must be i32 or i64, got {out_type}").into());
    }
    let Some(dims) = x.shape.dims() else {
        return Ok(vec![TensorType::new(out_type, Shape::unknown())]);
    };
    if dims.is_empty() {
        return Err(format!("ArgMax: input must have rank >= 1, got shape {}", x.shape).into());
    }
    let i = normalize_axis("ArgMax", axis, dims.len(), &x.shape)?;
    let mut out = dims.to_vec();
    out.remove(i);
    Ok(vec![TensorType::new(out_type, Shape::partial(out))])
}

#[cfg(test)]
mod tests {
    use super::super::math::{infer, tt};
    use super::*;
    use DType::*;

    fn red(op: &str, x: TensorType, axes: &[i64], keep: bool) -> Result<TensorType, String> {
        let mut out = infer(
            op,
            &[x],
            &[
                ("axes", AttrValue::IntList(axes.to_vec())),
                ("keep_dims", keep.into()),
            ],
        )?;
        assert_eq!(out.len(), 1);
        Ok(out.remove(0))
    }

    #[test]
    fn default_reduces_all_axes() {
        for op in ["Sum", "Mean", "Max"] {
            assert_eq!(
                infer(op, &[tt(F32, &[32, 10])], &[]),
                Ok(vec![tt(F32, &[])])
            );
            assert_eq!(red(op, tt(I32, &[-1, 10]), &[], true), Ok(tt(I32, &[1, 1])));
        }
    }

    #[test]
    fn explicit_and_negative_axes() {
        assert_eq!(
            red("Sum", tt(F32, &[2, 3, 4]), &[1], false),
            Ok(tt(F32, &[2, 4]))
        );
        assert_eq!(
            red("Sum", tt(F32, &[2, 3, 4]), &[-1], false),
            Ok(tt(F32, &[2, 3]))
        );
        assert_eq!(
            red("Mean", tt(F32, &[-1, 3, -1]), &[0, -1], true),
            Ok(tt(F32, &[1, 3, 1]))
        );
        assert_eq!(
            red("Max", tt(F64, &[-1, 10]), &[0], false),
            Ok(tt(F64, &[10]))
        );
        assert_eq!(red("Sum", tt(F32, &[]), &[], false), Ok(tt(F32, &[])));
    }

    #[test]
    fn unknown_rank() {
        let x = TensorType::new(F32, Shape::unknown());
        assert_eq!(red("Sum", x.clone(), &[], false), Ok(tt(F32, &[])));
        assert_eq!(
            red("Sum", x.clone(), &[], true),
            Ok(TensorType::new(F32, Shape::unknown()))
        );
        assert_eq!(
            red("Sum", x.clone(), &[0], false),
            Ok(TensorType::new(F32, Shape::unknown()))
        );
        assert!(red("Sum", x, &[1, 1], false).unwrap_err().contains("twice"));
    }

    #[test]
    fn axis_errors() {
        let e = red("Sum", tt(F32, &[2, 3]), &[2], false).unwrap_err();
        assert!(
            e.contains("Sum") && e.contains("axis 2") && e.contains("[2, 3]"),
            "{e}"
        );
        let e = red("Mean", tt(F32, &[2, 3]), &[-3], false).unwrap_err();
        assert!(e.contains("axis -3") && e.contains("[2, 3]"), "{e}");
        let e = red("Max", tt(F32, &[2, 3]), &[1, -1], false).unwrap_err();
        assert!(e.contains("more than once") && e.contains("[1, -1]"), "{e}");
        let e = red("Sum", tt(Bool, &[2]), &[], false).unwrap_err();
        assert!(e.contains("numeric"), "{e}");
    }

    #[test]
    fn arg_max() {
        assert_eq!(
            infer("ArgMax", &[tt(F32, &[-1, 10])], &[("axis", 1i64.into())]),
            Ok(vec![tt(I64, &[-1])])
        );
        assert_eq!(
            infer(
                "ArgMax",
                &[tt(F32, &[4, 5, 6])],
                &[("axis", (-3i64).into()), ("output_type", I32.into())]
            ),
            Ok(vec![tt(I32, &[5, 6])])
        );
        assert_eq!(
            infer(
                "ArgMax",
                &[TensorType::new(F32, Shape::unknown())],
                &[("axis", 0i64.into())]
            ),
            Ok(vec![TensorType::new(I64, Shape::unknown())])
        );
    }

    #[test]
    fn arg_max_errors() {
        let e = infer("ArgMax", &[tt(F32, &[4, 5])], &[("axis", 2i64.into())]).unwrap_err();
        assert!(
            e.to_string().contains("axis 2") && e.to_string().contains("[4, 5]"),
            "{e}"
        );
        let e = infer("ArgMax", &[tt(F32, &[])], &[("axis", 0i64.into())]).unwrap_err();
        assert!(e.to_string().contains("rank >= 1"), "{e}");
        let e = infer(
            "ArgMax",
            &[tt(F32, &[4])],
            &[("axis", 0i64.into()), ("output_type", F32.into())],
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("output_type") && e.to_string().contains("f32"),
            "{e}"
        );
        let e = infer("ArgMax", &[tt(F32, &[4])], &[]).unwrap_err();
        assert!(e.to_string().contains("axis"), "{e}");
    }
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]); a module so the block can follow the
/// tests.
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{no_gradient, only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("Sum", |b, f, dys| reduction_grad(b, f, dys, false));
        r.set_gradient("Mean", |b, f, dys| reduction_grad(b, f, dys, true));
        r.set_gradient("ArgMax", no_gradient);
    }

    /// dx = dy copied back along the reduced axes of x's run-time shape (÷ count for Mean).
    fn reduction_grad(
        b: &mut GradBuilder,
        f: &ForwardNode,
        dys: &[Option<Output>],
        mean: bool,
    ) -> GradResult {
        let dy = only_dy(dys)?;
        let dx = b.op(
            "BroadcastLike",
            "dx",
            &[dy, f.input(0)?],
            &[
                ("axes", AttrValue::IntList(f.ints_attr("axes")?)),
                ("keep_dims", AttrValue::Bool(f.bool_attr("keep_dims")?)),
                ("mean", AttrValue::Bool(mean)),
            ],
        );
        Ok(vec![Some(dx)])
    }
}
