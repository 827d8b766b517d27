//! The ops TensorFlow 1.x's `embedding_lookup` and `embedding_lookup_sparse` emit over a
//! partitioned variable (`params` a list of parts or a `PartitionedVariable`), imported by
//! [`crate::tf_import`]: `DynamicPartition`, `Less`, `Select`, `Size`, `Range` (with run-time
//! operands) and `StridedSlice` (constant begin/end/strides), with their shape rules, CPU
//! kernels and gradients; the gradient of `DynamicStitch` (TensorFlow's
//! `ParallelDynamicStitch`, which reassembles the looked-up rows in id order); and what
//! TensorFlow's own training graphs for the lookups add: `SparseSegmentSumGrad`/`MeanGrad`/
//! `SqrtNGrad`, `UnsortedSegmentSum` (its Adagrad sums a part's rows per unique index) and
//! `ScatterAdd` (TensorFlow's `ResourceScatterAdd`, its SGD update of the touched rows).
//!
//! `embedding_lookup(params=[p_0 .. p_{n-1}], ids, partition_strategy)` computes, per id, the
//! shard `s` and the row `r` inside it (`mod`: `s = id % n`, `r = id // n`; `div`: the first
//! `V % n` shards hold one row more, `Less`/`Select`/`Maximum` pick the formula), then
//!
//! ```text
//! rows_s    = DynamicPartition(r, s, n)[s]            # the ids each shard owns, [?]
//! pos_s     = DynamicPartition(Range(0, Size(ids)), s, n)[s]
//! gathered  = Gather(p_s, rows_s)                     # TensorFlow's ResourceGather
//! out       = DynamicStitch(pos_0 .. pos_{n-1}, gathered_0 .. gathered_{n-1})
//! ```
//!
//! How many ids go to each shard depends on the ids, so the partitions' first dimension is
//! unknown (`?`) to dflow's shape inference and known once the step runs, like `Unique`'s
//! output. The gradient w.r.t. a part is Gather's sparse pair fed by DynamicStitch's gradient
//! (`Gather(dy, pos_s)`), so only the rows a batch touched carry gradient.

use super::elementwise::{attr_dtype, attr_int, attr_ints, slice, stateless};
use super::grad::{dispatch_real, Real};
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit};

/// The ops this module registers.
pub const OPS: [&str; 11] = [
    "DynamicPartition",
    "Less",
    "Select",
    "Size",
    "Range",
    "StridedSlice",
    "ScatterAdd",
    "SparseSegmentSumGrad",
    "SparseSegmentMeanGrad",
    "SparseSegmentSqrtNGrad",
    "UnsortedSegmentSum",
];

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(dynamic_partition());
    r.add(less());
    r.add(select());
    r.add(size());
    r.add(range());
    r.add(strided_slice());
    r.add(scatter_add());
    r.add(unsorted_segment_sum());
    for c in [SegmentGrad::Sum, SegmentGrad::Mean, SegmentGrad::SqrtN] {
        r.add(segment_grad_op(c));
    }
}

/// The values of an int32/int64 tensor, any rank.
fn ints(t: &Tensor, what: &str) -> Result<Vec<i64>, String> {
    super::tf_compat::int_values(t, what)
}

fn is_index(d: DType) -> bool {
    matches!(d, DType::I32 | DType::I64)
}

// ---------------------------------------------------------------------------------------------
// DynamicPartition
// ---------------------------------------------------------------------------------------------

fn dynamic_partition() -> OpDef {
    OpDef::new(
        "DynamicPartition",
        "outputs[p] = the slices data[i..] with partitions[i..] = p, in order (TensorFlow's \
         DynamicPartition). In: data (any dtype, shape partitions' shape + trailing dims), \
         partitions (int32 or int64, each in [0, num_partitions)). Out: num_partitions tensors, \
         each [?] + data's trailing dims (how many rows each gets is known at run time only). \
         Attrs: num_partitions (int >= 1).",
        dynamic_partition_infer,
    )
    .inputs([arg("data"), arg("partitions")])
    .outputs([variadic("outputs")])
    .attrs([attr("num_partitions", AttrType::Int)])
    .cpu_kernel(|init: &KernelInit<'_>| {
        let n = num_partitions(attr_int(init, "num_partitions")?)?;
        Ok(Box::new(DynamicPartitionKernel { n }))
    })
}

/// The largest `num_partitions` accepted (a file's attribute is checked before the kernel
/// allocates one output per partition).
const MAX_PARTITIONS: i64 = 1 << 16;

fn num_partitions(n: i64) -> Result<usize, String> {
    if (1..=MAX_PARTITIONS).contains(&n) {
        Ok(n as usize)
    } else {
        Err(format!(
            "DynamicPartition: num_partitions must be in [1, {MAX_PARTITIONS}], got {n}"
        ))
    }
}

fn dynamic_partition_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let (data, parts) = (ctx.input(0)?, ctx.input(1)?);
    let n = num_partitions(ctx.int("num_partitions")?)?;
    if !is_index(parts.dtype) {
        return Err(
            format!("DynamicPartition: partitions must be int32 or int64, got {parts}").into(),
        );
    }
    let shape = match (parts.shape.dims(), data.shape.dims()) {
        (Some(p), Some(d)) => {
            let fits = d.len() >= p.len()
                && p.iter()
                    .zip(d)
                    .all(|(a, b)| a.is_none() || b.is_none() || a == b);
            if !fits {
                return Err(format!(
                    "DynamicPartition: data {} must start with the shape of partitions {}",
                    data.shape, parts.shape
                )
                .into());
            }
            let mut dims = vec![None];
            dims.extend_from_slice(&d[p.len()..]);
            Shape::partial(dims)
        }
        _ => Shape::unknown(),
    };
    Ok(vec![TensorType::new(data.dtype, shape); n])
}

#[derive(Debug)]
struct DynamicPartitionKernel {
    n: usize,
}

impl Kernel for DynamicPartitionKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (data, parts) = (ctx.input(0)?, ctx.input(1)?);
        let node = ctx.node;
        let p = ints(parts, &format!("DynamicPartition `{node}`: partitions"))?;
        let lead = parts.rank();
        if data.rank() < lead || data.dims()[..lead] != *parts.dims() {
            return Err(format!(
                "DynamicPartition `{node}`: data of shape {:?} does not start with the shape of \
                 partitions {:?}",
                data.dims(),
                parts.dims()
            )
            .into());
        }
        let trailing = &data.dims()[lead..];
        let row = trailing.iter().product::<usize>() * data.dtype().size_of();
        let mut counts = vec![0usize; self.n];
        for (i, &k) in p.iter().enumerate() {
            let k = usize::try_from(k)
                .ok()
                .filter(|&k| k < self.n)
                .ok_or_else(|| {
                    format!(
                        "DynamicPartition `{node}`: partitions[{i}] = {k} is not in [0, {})",
                        self.n
                    )
                })?;
            counts[k] += 1;
        }
        // Every output together holds exactly data's bytes: nothing beyond the input is
        // allocated.
        let mut bufs: Vec<Vec<u8>> = counts
            .iter()
            .map(|&c| Vec::with_capacity(c * row))
            .collect();
        let bytes = data.as_bytes();
        for (i, &k) in p.iter().enumerate() {
            bufs[k as usize].extend_from_slice(&bytes[i * row..(i + 1) * row]);
        }
        for (k, (buf, &c)) in bufs.into_iter().zip(&counts).enumerate() {
            let mut dims = vec![c];
            dims.extend_from_slice(trailing);
            let t = Tensor::from_bytes(data.dtype(), &dims, &buf).map_err(|e| e.to_string())?;
            ctx.set_output(k, t)?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Less
// ---------------------------------------------------------------------------------------------

fn less() -> OpDef {
    OpDef::new(
        "Less",
        "z = (x < y) elementwise, with NumPy broadcasting (TensorFlow's Less; NaN compares \
         false). In: x, y (same numeric dtype). Out: z (bool).",
        |ctx| {
            let (x, y) = (ctx.input(0)?, ctx.input(1)?);
            super::math::require_same("Less", ("x", x), ("y", y))?;
            super::math::require_numeric("Less", "x", x)?;
            let shape = super::math::broadcast_shapes(&x.shape, &y.shape)
                .map_err(|e| format!("Less: {e}"))?;
            Ok(vec![TensorType::new(DType::Bool, shape)])
        },
    )
    .inputs([arg("x"), arg("y")])
    .outputs([arg("z")])
    .cpu_kernel(|_| stateless(less_kernel))
}

fn less_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    use super::broadcast::binary_map;
    use super::elementwise::to_f32;
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    if x.dtype() != y.dtype() {
        return Err(format!(
            "Less `{}`: x is {} but y is {}",
            ctx.node,
            x.dtype(),
            y.dtype()
        )
        .into());
    }
    fn lt<T: crate::Element + PartialOrd>(x: &Tensor, y: &Tensor) -> Result<Tensor, String> {
        binary_map(x, y, |a: T, b: T| u8::from(a < b))
    }
    let z = match x.dtype() {
        DType::F32 => lt::<f32>(x, y),
        DType::F64 => lt::<f64>(x, y),
        DType::I32 => lt::<i32>(x, y),
        DType::I64 => lt::<i64>(x, y),
        DType::BF16 | DType::F16 => lt::<f32>(&to_f32(x)?, &to_f32(y)?),
        d => Err(format!("Less `{}`: {d} is not numeric", ctx.node)),
    }?;
    ctx.set_output(0, z)
}

// ---------------------------------------------------------------------------------------------
// Select
// ---------------------------------------------------------------------------------------------

fn select() -> OpDef {
    OpDef::new(
        "Select",
        "out = where(condition, t, e) (TensorFlow 1.x's Select): condition has t's shape, or is \
         a scalar, or a vector over t's first dimension (choosing whole rows). In: condition \
         (bool), t, e (one dtype and shape). Out: out, t's type.",
        select_infer,
    )
    .inputs([arg("condition"), arg("t"), arg("e")])
    .outputs([arg("output")])
    .cpu_kernel(|_| stateless(select_kernel))
}

fn select_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let (c, t, e) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
    if c.dtype != DType::Bool {
        return Err(format!("Select: condition must be bool, got {c}").into());
    }
    if t.dtype != e.dtype {
        return Err(format!("Select: t is {t} but e is {e}; they must match").into());
    }
    let shape = t.shape.merge(&e.shape).ok_or_else(|| {
        format!(
            "Select: t {} and e {} must have one shape",
            t.shape, e.shape
        )
    })?;
    let fits = match (c.shape.dims(), shape.dims()) {
        (Some([]), _) => true,
        (Some(cd), Some(sd)) if cd.len() == sd.len() => cd
            .iter()
            .zip(sd)
            .all(|(a, b)| a.is_none() || b.is_none() || a == b),
        (Some([n]), Some(sd)) => !sd.is_empty() && (n.is_none() || sd[0].is_none() || *n == sd[0]),
        _ => true,
    };
    if !fits {
        return Err(format!(
            "Select: condition {} must have t's shape {}, be a scalar, or a vector over t's \
             first dimension",
            c.shape, shape
        )
        .into());
    }
    Ok(vec![TensorType::new(t.dtype, shape)])
}

fn select_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (c, t, e) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
    let node = ctx.node;
    if c.dtype() != DType::Bool || t.dtype() != e.dtype() || t.dims() != e.dims() {
        return Err(format!(
            "Select `{node}`: condition {}{} must be bool and t {}{} and e {}{} one type",
            c.dtype(),
            c.shape(),
            t.dtype(),
            t.shape(),
            e.dtype(),
            e.shape()
        )
        .into());
    }
    let cond = slice::<u8>(c)?;
    let n = t.num_elements();
    // Bytes per condition element: one element, a row, or the whole tensor.
    let unit = if c.dims() == t.dims() {
        1
    } else if c.rank() == 0 {
        n.max(1)
    } else if c.rank() == 1 && t.rank() >= 1 && c.dims()[0] == t.dims()[0] {
        t.dims()[1..].iter().product::<usize>().max(1)
    } else {
        return Err(format!(
            "Select `{node}`: condition of shape {:?} must have t's shape {:?}, be a scalar, or \
             a vector over t's first dimension",
            c.dims(),
            t.dims()
        )
        .into());
    };
    let size = t.dtype().size_of();
    let (tb, eb) = (t.as_bytes(), e.as_bytes());
    let mut out = Vec::with_capacity(n * size);
    for i in 0..n {
        let pick = cond.get(i / unit).copied().unwrap_or(0) != 0;
        let src = if pick { tb } else { eb };
        out.extend_from_slice(&src[i * size..(i + 1) * size]);
    }
    let z = Tensor::from_bytes(t.dtype(), t.dims(), &out).map_err(|e| e.to_string())?;
    ctx.set_output(0, z)
}

// ---------------------------------------------------------------------------------------------
// Size
// ---------------------------------------------------------------------------------------------

fn size() -> OpDef {
    OpDef::new(
        "Size",
        "n = the number of elements of input (TensorFlow's Size). In: input (any). Out: n, a \
         scalar of out_type. Attrs: out_type (dtype int32 or int64, default int32).",
        |ctx| {
            let d = ctx.dtype("out_type")?;
            if !is_index(d) {
                return Err(format!("Size: out_type must be int32 or int64, got {d}").into());
            }
            Ok(vec![TensorType::new(d, Shape::scalar())])
        },
    )
    .inputs([arg("input")])
    .outputs([arg("n")])
    .attrs([attr_or(
        "out_type",
        AttrType::DType,
        AttrDefault::DType(DType::I32),
    )])
    .cpu_kernel(|init: &KernelInit<'_>| Ok(Box::new(SizeKernel(attr_dtype(init, "out_type")?))))
}

#[derive(Debug)]
struct SizeKernel(DType);

impl Kernel for SizeKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let n = ctx.input(0)?.num_elements();
        let t = match self.0 {
            DType::I32 => Tensor::scalar(i32::try_from(n).map_err(|_| {
                format!(
                    "Size `{}`: {n} elements do not fit int32: use out_type int64",
                    ctx.node
                )
            })?),
            _ => Tensor::scalar(n as i64),
        };
        ctx.set_output(0, t)
    }
}

// ---------------------------------------------------------------------------------------------
// Range
// ---------------------------------------------------------------------------------------------

fn range() -> OpDef {
    OpDef::new(
        "Range",
        "output = start, start + delta, ... up to (excluding) limit (TensorFlow's Range with \
         run-time operands; a Range of constants is computed when a graph is imported). In: \
         start, limit, delta (int32 or int64 scalars, one dtype; delta != 0). Out: output [?], \
         their dtype.",
        |ctx| {
            let s = ctx.input(0)?;
            for (i, what) in ["start", "limit", "delta"].iter().enumerate() {
                let t = ctx.input(i)?;
                if t.dtype != s.dtype || !is_index(t.dtype) {
                    return Err(format!(
                        "Range: start, limit and delta must be int32 or int64 of one dtype, \
                         {what} is {t}"
                    )
                    .into());
                }
                if t.shape.rank().is_some_and(|r| r != 0) {
                    return Err(format!("Range: {what} must be a scalar, got {t}").into());
                }
            }
            Ok(vec![TensorType::new(s.dtype, Shape::partial(vec![None]))])
        },
    )
    .inputs([arg("start"), arg("limit"), arg("delta")])
    .outputs([arg("output")])
    .cpu_kernel(|_| stateless(range_kernel))
}

fn range_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let node = ctx.node;
    let mut v = [0i64; 3];
    for (i, what) in ["start", "limit", "delta"].iter().enumerate() {
        let t = ctx.input(i)?;
        match ints(t, &format!("Range `{node}`: {what}"))?[..] {
            [x] if t.rank() == 0 => v[i] = x,
            _ => return Err(format!("Range `{node}`: {what} must be a scalar").into()),
        }
    }
    let [start, limit, delta] = v;
    if delta == 0 {
        return Err(format!("Range `{node}`: delta must not be 0").into());
    }
    if (delta > 0 && start > limit) || (delta < 0 && start < limit) {
        return Err(format!(
            "Range `{node}`: start {start} cannot reach limit {limit} by delta {delta}"
        )
        .into());
    }
    // ceil((limit - start) / delta), in i128 so no operand overflows.
    let (span, d) = (i128::from(limit) - i128::from(start), i128::from(delta));
    let count = (span + d - d.signum()) / d;
    let dtype = ctx.input(0)?.dtype();
    let count = i64::try_from(count).map_err(|_| format!("Range `{node}`: too many elements"))?;
    // Checked against dflow's bound for tensors sized from run-time values before allocating.
    let n = super::tf_compat::checked_dims(&[count], dtype, &format!("Range `{node}`"))?[0];
    let values = (0..n as i64).map(|i| start + i * delta);
    let t = if dtype == DType::I32 {
        let v = values
            .map(|x| i32::try_from(x).map_err(|_| format!("Range `{node}`: {x} exceeds int32")))
            .collect::<Result<Vec<i32>, _>>()?;
        Tensor::from_slice(&[n], &v)
    } else {
        Tensor::from_slice(&[n], &values.collect::<Vec<i64>>())
    };
    ctx.set_output(0, t.map_err(|e| e.to_string())?)
}

// ---------------------------------------------------------------------------------------------
// StridedSlice
// ---------------------------------------------------------------------------------------------

fn strided_slice() -> OpDef {
    OpDef::new(
        "StridedSlice",
        "output = input[begin:end:strides] per dimension, Python-style (TensorFlow's \
         StridedSlice with constant begin, end and strides): bit i of begin_mask / end_mask \
         ignores begin[i] / end[i] (the full range in stride's direction), bit i of \
         shrink_axis_mask takes the single index begin[i] and drops the dimension; dimensions \
         past the spec are kept whole. In: input (any dtype). Out: output, input's dtype. \
         Attrs: begin, end, strides (list(int), one length, strides nonzero), begin_mask, \
         end_mask, shrink_axis_mask (int, default 0).",
        strided_slice_infer,
    )
    .inputs([arg("input")])
    .outputs([arg("output")])
    .attrs([
        attr("begin", AttrType::IntList),
        attr("end", AttrType::IntList),
        attr("strides", AttrType::IntList),
        attr_or("begin_mask", AttrType::Int, AttrDefault::Int(0)),
        attr_or("end_mask", AttrType::Int, AttrDefault::Int(0)),
        attr_or("shrink_axis_mask", AttrType::Int, AttrDefault::Int(0)),
    ])
    .cpu_kernel(|init: &KernelInit<'_>| {
        let spec = SliceSpec {
            begin: attr_ints(init, "begin")?,
            end: attr_ints(init, "end")?,
            strides: attr_ints(init, "strides")?,
            begin_mask: attr_int(init, "begin_mask")?,
            end_mask: attr_int(init, "end_mask")?,
            shrink: attr_int(init, "shrink_axis_mask")?,
        };
        spec.check()?;
        Ok(Box::new(StridedSliceKernel(spec)))
    })
}

/// A StridedSlice's constant spec.
#[derive(Debug, Clone)]
struct SliceSpec {
    begin: Vec<i64>,
    end: Vec<i64>,
    strides: Vec<i64>,
    begin_mask: i64,
    end_mask: i64,
    shrink: i64,
}

/// One dimension of a slice: the first index, the step and how many indices; `keep` false
/// for a shrunk dimension.
#[derive(Debug, Clone, Copy, PartialEq)]
struct DimSlice {
    start: i64,
    step: i64,
    count: usize,
    keep: bool,
}

impl SliceSpec {
    fn from_ctx(ctx: &InferCtx<'_>) -> Result<Self, String> {
        let s = SliceSpec {
            begin: ctx.ints("begin")?.to_vec(),
            end: ctx.ints("end")?.to_vec(),
            strides: ctx.ints("strides")?.to_vec(),
            begin_mask: ctx.int("begin_mask")?,
            end_mask: ctx.int("end_mask")?,
            shrink: ctx.int("shrink_axis_mask")?,
        };
        s.check()?;
        Ok(s)
    }

    fn check(&self) -> Result<(), String> {
        let n = self.begin.len();
        if self.end.len() != n || self.strides.len() != n {
            return Err(format!(
                "StridedSlice: begin, end and strides must have one length, got {}, {} and {}",
                n,
                self.end.len(),
                self.strides.len()
            ));
        }
        if n > 32 {
            return Err(format!("StridedSlice: {n} dimensions (at most 32)"));
        }
        if self.strides.contains(&0) {
            return Err("StridedSlice: strides must be nonzero".into());
        }
        Ok(())
    }

    fn bit(mask: i64, i: usize) -> bool {
        (mask >> i) & 1 == 1
    }

    /// Dimension `i` (of size `dim`) sliced, with TensorFlow's clamping.
    fn dim(&self, i: usize, dim: usize) -> Result<DimSlice, String> {
        let d = dim as i64;
        if i >= self.begin.len() {
            return Ok(DimSlice {
                start: 0,
                step: 1,
                count: dim,
                keep: true,
            });
        }
        let step = self.strides[i];
        if Self::bit(self.shrink, i) {
            let b = self.begin[i];
            let idx = if b < 0 { b + d } else { b };
            if !(0..d).contains(&idx) {
                return Err(format!(
                    "StridedSlice: index {b} of dimension {i} is out of range for size {dim}"
                ));
            }
            return Ok(DimSlice {
                start: idx,
                step: 1,
                count: 1,
                keep: false,
            });
        }
        // Python's slice clamping: [0, d] for a positive step, [-1, d - 1] for a negative one.
        let (lo, hi) = if step > 0 { (0, d) } else { (-1, d - 1) };
        let clamp = |v: i64| {
            let v = if v < 0 { v + d } else { v };
            v.clamp(lo, hi)
        };
        let start = if Self::bit(self.begin_mask, i) {
            if step > 0 {
                lo
            } else {
                hi
            }
        } else {
            clamp(self.begin[i])
        };
        let stop = if Self::bit(self.end_mask, i) {
            if step > 0 {
                hi
            } else {
                lo
            }
        } else {
            clamp(self.end[i])
        };
        let span = if step > 0 { stop - start } else { start - stop };
        let count = if span <= 0 {
            0
        } else {
            ((span + step.abs() - 1) / step.abs()) as usize
        };
        Ok(DimSlice {
            start,
            step,
            count,
            keep: true,
        })
    }
}

fn strided_slice_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let x = ctx.input(0)?;
    let spec = SliceSpec::from_ctx(ctx)?;
    let Some(dims) = x.shape.dims() else {
        return Ok(vec![TensorType::new(x.dtype, Shape::unknown())]);
    };
    if spec.begin.len() > dims.len() {
        return Err(format!(
            "StridedSlice: a spec of {} dimensions for input {}",
            spec.begin.len(),
            x.shape
        )
        .into());
    }
    let mut out = vec![];
    for (i, d) in dims.iter().enumerate() {
        let shrunk = i < spec.begin.len() && SliceSpec::bit(spec.shrink, i);
        match d {
            Some(d) => {
                let s = spec.dim(i, *d)?;
                if s.keep {
                    out.push(Some(s.count));
                }
            }
            None if !shrunk => out.push(None),
            None => {}
        }
    }
    Ok(vec![TensorType::new(x.dtype, Shape::partial(out))])
}

#[derive(Debug)]
struct StridedSliceKernel(SliceSpec);

impl Kernel for StridedSliceKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let node = ctx.node;
        if self.0.begin.len() > x.rank() {
            return Err(format!(
                "StridedSlice `{node}`: a spec of {} dimensions for input of shape {:?}",
                self.0.begin.len(),
                x.dims()
            )
            .into());
        }
        let slices = x
            .dims()
            .iter()
            .enumerate()
            .map(|(i, &d)| self.0.dim(i, d))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("StridedSlice `{node}`: {e}"))?;
        let out_dims: Vec<usize> = slices.iter().filter(|s| s.keep).map(|s| s.count).collect();
        let n: usize = slices.iter().map(|s| s.count).product();
        let size = x.dtype().size_of();
        // Row-major strides of the input, in elements.
        let mut strides = vec![1usize; x.rank()];
        for i in (0..x.rank().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * x.dims()[i + 1];
        }
        let src = x.as_bytes();
        let mut out = Vec::with_capacity(n * size);
        let mut idx = vec![0usize; slices.len()];
        for _ in 0..n {
            let off: usize = slices
                .iter()
                .zip(&idx)
                .zip(&strides)
                .map(|((s, &k), &st)| (s.start + s.step * k as i64) as usize * st)
                .sum();
            out.extend_from_slice(&src[off * size..(off + 1) * size]);
            for a in (0..idx.len()).rev() {
                idx[a] += 1;
                if idx[a] < slices[a].count {
                    break;
                }
                idx[a] = 0;
            }
        }
        let y = Tensor::from_bytes(x.dtype(), &out_dims, &out).map_err(|e| e.to_string())?;
        ctx.set_output(0, y)
    }
}

// ---------------------------------------------------------------------------------------------
// ScatterAdd (TensorFlow's ResourceScatterAdd)
// ---------------------------------------------------------------------------------------------

fn scatter_add() -> OpDef {
    OpDef::new(
        "ScatterAdd",
        "var[indices[i], ..] += updates[i, ..] for every i, repeated indices adding up \
         (TensorFlow's ResourceScatterAdd, which its GradientDescentOptimizer applies to a \
         sparse gradient: updates = -lr · values). In: var (reference to a float Variable [V, \
         d..]), indices (int32 or int64 [N], each in [0, V)), updates (var's dtype, [N, d..]). \
         No outputs.",
        |ctx| {
            let (var, indices, updates) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
            require_float("ScatterAdd: var", var)?;
            if !is_index(indices.dtype) || indices.shape.rank().is_some_and(|r| r != 1) {
                return Err(format!(
                    "ScatterAdd: indices must be an int32 or int64 vector, got {indices}"
                )
                .into());
            }
            if updates.dtype != var.dtype {
                return Err(
                    format!("ScatterAdd: updates {updates} must have var's dtype ({var})").into(),
                );
            }
            if let (Some(v), Some(u)) = (var.shape.dims(), updates.shape.dims()) {
                let fits = !v.is_empty()
                    && u.len() == v.len()
                    && v[1..]
                        .iter()
                        .zip(&u[1..])
                        .all(|(a, b)| a.is_none() || b.is_none() || a == b);
                if !fits {
                    return Err(format!(
                        "ScatterAdd: updates {} must be [N] + var's trailing dims {}",
                        updates.shape, var.shape
                    )
                    .into());
                }
            }
            Ok(vec![])
        },
    )
    .inputs([ref_arg("var"), arg("indices"), arg("updates")])
    .stateful()
    .cpu_kernel(|_| Ok(Box::new(ScatterAddKernel)))
}

#[derive(Debug)]
struct ScatterAddKernel;

fn scatter_into<T: Real>(
    node: &str,
    cell: &crate::kernel::VariableCell,
    rows: &[i64],
    updates: &Tensor,
) -> Result<(), String> {
    let u = slice::<T>(updates)?;
    cell.update(|slot| {
        let t = slot
            .as_mut()
            .ok_or_else(|| format!("ScatterAdd `{node}`: var is not initialized"))?;
        let v = t.dims().first().copied().unwrap_or(0);
        let fits = t.rank() >= 1
            && updates.rank() == t.rank()
            && updates.dims()[0] == rows.len()
            && updates.dims()[1..] == t.dims()[1..];
        if !fits {
            return Err(format!(
                "ScatterAdd `{node}`: updates of shape {:?} must be [{}] + the trailing dims of \
                 var {:?}",
                updates.dims(),
                rows.len(),
                t.dims()
            ));
        }
        if let Some((i, r)) = rows
            .iter()
            .enumerate()
            .find(|(_, &r)| usize::try_from(r).map_or(true, |r| r >= v))
        {
            return Err(format!(
                "ScatterAdd `{node}`: index {r} at position {i} is out of range [0, {v})"
            ));
        }
        let row: usize = t.dims()[1..].iter().product();
        let w = t.as_mut_slice::<T>().map_err(|e| e.to_string())?;
        if row > 0 {
            for (&r, chunk) in rows.iter().zip(u.chunks(row)) {
                let r = r as usize;
                for (w, &x) in w[r * row..(r + 1) * row].iter_mut().zip(chunk) {
                    *w += x;
                }
            }
        }
        Ok(())
    })
}

impl Kernel for ScatterAddKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let node = ctx.node;
        let rows = ints(ctx.input(1)?, &format!("ScatterAdd `{node}`: indices"))?;
        let updates = ctx.input(2)?;
        let cell = ctx.variable_at(0)?;
        dispatch_real!(updates.dtype(), scatter_into(node, cell, &rows, updates))
    }
}

// ---------------------------------------------------------------------------------------------
// SparseSegmentSumGrad / MeanGrad / SqrtNGrad (TensorFlow's, as its gradients emit them)
// ---------------------------------------------------------------------------------------------

/// Which of TensorFlow's segment-combiner gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SegmentGrad {
    Sum,
    Mean,
    SqrtN,
}

impl SegmentGrad {
    fn op(self) -> &'static str {
        match self {
            SegmentGrad::Sum => "SparseSegmentSumGrad",
            SegmentGrad::Mean => "SparseSegmentMeanGrad",
            SegmentGrad::SqrtN => "SparseSegmentSqrtNGrad",
        }
    }

    fn weight(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            SegmentGrad::Sum => 1.0,
            SegmentGrad::Mean => 1.0 / n,
            SegmentGrad::SqrtN => 1.0 / n.sqrt(),
        }
    }
}

fn segment_grad_op(c: SegmentGrad) -> OpDef {
    let summary = match c {
        SegmentGrad::Sum => {
            "TensorFlow's SparseSegmentSumGrad: out[indices[k], ..] += grad[segment_ids[k], ..], \
             out [output_dim0, d..] zeros elsewhere. In: grad [S, d..] (float), indices [K], \
             segment_ids [K] (int32 or int64; each in [0, S)), output_dim0 (int32 or int64 \
             scalar; indices in [0, output_dim0)). Out: out, grad's dtype."
        }
        SegmentGrad::Mean => {
            "TensorFlow's SparseSegmentMeanGrad: SparseSegmentSumGrad with each row divided by \
             its segment's size. In: grad, indices, segment_ids, output_dim0. Out: out."
        }
        SegmentGrad::SqrtN => {
            "TensorFlow's SparseSegmentSqrtNGrad: SparseSegmentSumGrad with each row divided by \
             the square root of its segment's size. In: grad, indices, segment_ids, \
             output_dim0. Out: out."
        }
    };
    let factory: crate::kernel::KernelFactory = match c {
        SegmentGrad::Sum => |_| Ok(Box::new(SegmentGradKernel(SegmentGrad::Sum))),
        SegmentGrad::Mean => |_| Ok(Box::new(SegmentGradKernel(SegmentGrad::Mean))),
        SegmentGrad::SqrtN => |_| Ok(Box::new(SegmentGradKernel(SegmentGrad::SqrtN))),
    };
    OpDef::new(c.op(), summary, segment_grad_infer)
        .inputs([
            arg("grad"),
            arg("indices"),
            arg("segment_ids"),
            arg("output_dim0"),
        ])
        .outputs([arg("output")])
        .cpu_kernel(factory)
}

fn segment_grad_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let grad = ctx.input(0)?;
    require_float("SparseSegment*Grad: grad", grad)?;
    for (i, what) in [(1, "indices"), (2, "segment_ids"), (3, "output_dim0")] {
        let t = ctx.input(i)?;
        let rank_ok = if i == 3 {
            t.shape.rank().map_or(true, |r| r == 0)
        } else {
            t.shape.rank().map_or(true, |r| r == 1)
        };
        if !is_index(t.dtype) || !rank_ok {
            return Err(format!(
                "SparseSegment*Grad: {what} must be an int32 or int64 {}, got {t}",
                if i == 3 { "scalar" } else { "vector" }
            )
            .into());
        }
    }
    let shape = rows_unknown("SparseSegment*Grad: grad", grad)?;
    Ok(vec![TensorType::new(grad.dtype, shape)])
}

/// `t`'s shape with its first dimension (rows, counted at run time) unknown; `t` must have rank
/// at least 1 (`what` names it in the error).
fn rows_unknown(what: &str, t: &TensorType) -> Result<Shape, OpError> {
    match t.shape.dims() {
        Some([]) => Err(format!("{what} must have rank >= 1, got {}", t.shape).into()),
        Some(d) => Ok(Shape::partial(
            std::iter::once(None)
                .chain(d[1..].iter().copied())
                .collect(),
        )),
        None => Ok(Shape::unknown()),
    }
}

#[derive(Debug)]
struct SegmentGradKernel(SegmentGrad);

fn segment_grad_typed<T: Real>(
    grad: &Tensor,
    rows: &[usize],
    seg: &[usize],
    weights: &[f64],
    dims: &[usize],
) -> Result<Tensor, String> {
    let row: usize = dims[1..].iter().product();
    let src = slice::<T>(grad)?;
    let mut acc = vec![0f64; dims[0] * row];
    for (&r, &g) in rows.iter().zip(seg) {
        let w = weights[g];
        for (a, &v) in acc[r * row..(r + 1) * row]
            .iter_mut()
            .zip(&src[g * row..(g + 1) * row])
        {
            *a += w * v.to_f64();
        }
    }
    let v: Vec<T> = acc.into_iter().map(T::from_f64).collect();
    Tensor::from_slice(dims, &v).map_err(|e| e.to_string())
}

impl Kernel for SegmentGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let op = self.0.op();
        let node = ctx.node;
        let grad = ctx.input(0)?;
        let idx = ints(ctx.input(1)?, &format!("{op} `{node}`: indices"))?;
        let seg = ints(ctx.input(2)?, &format!("{op} `{node}`: segment_ids"))?;
        let dim0 = match ints(ctx.input(3)?, &format!("{op} `{node}`: output_dim0"))?[..] {
            [d] => d,
            _ => return Err(format!("{op} `{node}`: output_dim0 must be a scalar").into()),
        };
        let Some(&segments) = grad.dims().first() else {
            return Err(format!("{op} `{node}`: grad must have rank >= 1").into());
        };
        if idx.len() != seg.len() {
            return Err(format!(
                "{op} `{node}`: {} indices but {} segment_ids",
                idx.len(),
                seg.len()
            )
            .into());
        }
        let mut dims = vec![0usize];
        dims.extend_from_slice(&grad.dims()[1..]);
        let signed: Vec<i64> = std::iter::once(dim0)
            .chain(grad.dims()[1..].iter().map(|&d| d as i64))
            .collect();
        // output_dim0 comes from a tensor: checked before anything is allocated.
        dims[0] =
            super::tf_compat::checked_dims(&signed, grad.dtype(), &format!("{op} `{node}`"))?[0];
        let check = |what: &str, v: &[i64], bound: usize| {
            v.iter()
                .enumerate()
                .map(|(k, &i)| {
                    usize::try_from(i)
                        .ok()
                        .filter(|&u| u < bound)
                        .ok_or_else(|| {
                            format!("{op} `{node}`: {what}[{k}] = {i} is not in [0, {bound})")
                        })
                })
                .collect::<Result<Vec<usize>, String>>()
        };
        let rows = check("indices", &idx, dims[0])?;
        let seg = check("segment_ids", &seg, segments)?;
        let mut counts = vec![0usize; segments];
        for &g in &seg {
            counts[g] += 1;
        }
        let weights: Vec<f64> = counts.iter().map(|&n| self.0.weight(n)).collect();
        let out = dispatch_real!(
            grad.dtype(),
            segment_grad_typed(grad, &rows, &seg, &weights, &dims)
        )?;
        ctx.set_output(0, out)
    }
}

// ---------------------------------------------------------------------------------------------
// UnsortedSegmentSum
// ---------------------------------------------------------------------------------------------

fn unsorted_segment_sum() -> OpDef {
    OpDef::new(
        "UnsortedSegmentSum",
        "out[s, ..] = sum of data[i, ..] over i with segment_ids[i] = s, in any order \
         (TensorFlow's UnsortedSegmentSum with vector ids, which its optimizers use to sum the \
         rows of a sparse gradient per unique index; a negative id drops its row, as in \
         TensorFlow). In: data [N, d..] (float), segment_ids [N] (int32 or int64, each < \
         num_segments), num_segments (int32 or int64 scalar). Out: out [num_segments, d..].",
        |ctx| {
            let (data, seg, n) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
            require_float("UnsortedSegmentSum: data", data)?;
            if !is_index(seg.dtype) || seg.shape.rank().is_some_and(|r| r != 1) {
                return Err(format!(
                    "UnsortedSegmentSum: segment_ids must be an int32 or int64 vector, got {seg}"
                )
                .into());
            }
            if !is_index(n.dtype) || n.shape.rank().is_some_and(|r| r != 0) {
                return Err(format!(
                    "UnsortedSegmentSum: num_segments must be an int32 or int64 scalar, got {n}"
                )
                .into());
            }
            let shape = rows_unknown("UnsortedSegmentSum: data", data)?;
            Ok(vec![TensorType::new(data.dtype, shape)])
        },
    )
    .inputs([arg("data"), arg("segment_ids"), arg("num_segments")])
    .outputs([arg("output")])
    .cpu_kernel(|_| stateless(unsorted_segment_sum_kernel))
}

fn unsorted_segment_sum_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    const OP: &str = "UnsortedSegmentSum";
    let node = ctx.node;
    let data = ctx.input(0)?;
    let seg = ints(ctx.input(1)?, &format!("{OP} `{node}`: segment_ids"))?;
    let n = match ints(ctx.input(2)?, &format!("{OP} `{node}`: num_segments"))?[..] {
        [n] => n,
        _ => return Err(format!("{OP} `{node}`: num_segments must be a scalar").into()),
    };
    if data.rank() == 0 || data.dims()[0] != seg.len() {
        return Err(format!(
            "{OP} `{node}`: data of shape {:?} must have one row per segment id ({})",
            data.dims(),
            seg.len()
        )
        .into());
    }
    let signed: Vec<i64> = std::iter::once(n)
        .chain(data.dims()[1..].iter().map(|&d| d as i64))
        .collect();
    // num_segments comes from a tensor: checked before anything is allocated.
    let dims = super::tf_compat::checked_dims(&signed, data.dtype(), &format!("{OP} `{node}`"))?;
    let mut rows = Vec::with_capacity(seg.len());
    for (i, &s) in seg.iter().enumerate() {
        if s >= n {
            return Err(format!(
                "{OP} `{node}`: segment_ids[{i}] = {s} is not below num_segments {n}"
            )
            .into());
        }
        rows.push(usize::try_from(s).ok());
    }
    fn sum<T: Real>(
        data: &Tensor,
        rows: &[Option<usize>],
        dims: &[usize],
    ) -> Result<Tensor, String> {
        let row: usize = dims[1..].iter().product();
        let src = slice::<T>(data)?;
        let mut out = Tensor::zeros(T::DTYPE, dims).map_err(|e| e.to_string())?;
        let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
        if row > 0 {
            for (chunk, r) in src.chunks(row).zip(rows) {
                if let Some(r) = *r {
                    for (o, &v) in dst[r * row..(r + 1) * row].iter_mut().zip(chunk) {
                        *o += v;
                    }
                }
            }
        }
        Ok(out)
    }
    let out = dispatch_real!(data.dtype(), sum(data, &rows, &dims))?;
    ctx.set_output(0, out)
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]), and DynamicStitch's.
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{no_gradient, only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("Less", no_gradient);
        r.set_gradient("Size", no_gradient);
        r.set_gradient("Range", no_gradient);
        r.set_gradient("Select", select_grad);
        r.set_gradient("DynamicStitch", dynamic_stitch_grad);
        r.set_gradient("DynamicPartition", dynamic_partition_grad);
    }

    /// TensorFlow's `_DynamicPartitionGrads`: the positions of `data`'s rows, partitioned like
    /// them, stitch the outputs' gradients back in place (an output the loss does not reach
    /// contributes zeros); the partitions get none.
    fn dynamic_partition_grad(
        b: &mut GradBuilder,
        f: &ForwardNode,
        dys: &[Option<Output>],
    ) -> GradResult {
        let (data, parts) = (f.input(0)?, f.input(1)?);
        let n = match f.attr("num_partitions")? {
            AttrValue::Int(n) => *n,
            v => return Err(format!("num_partitions is {}, not int", v.ty())),
        };
        let scalar = |v: i32| AttrValue::Tensor(Tensor::scalar(v).into());
        let zero = b.op("Const", "zero", &[], &[("value", scalar(0))]);
        let one = b.op("Const", "one", &[], &[("value", scalar(1))]);
        let size = b.unary("Size", "size", parts);
        let range = b.op("Range", "positions", &[&zero, &size, &one], &[]);
        let positions = b.binary("ReshapeLike", "positions_shaped", &range, parts);
        let split = b.add(
            "DynamicPartition",
            "partitioned_positions",
            &[&positions, parts],
            &[("num_partitions", AttrValue::Int(n))],
        );
        let count = usize::try_from(n).map_err(|_| format!("num_partitions {n}"))?;
        let mut inputs: Vec<Output> = (0..count)
            .map(|k| Output {
                node: split.clone(),
                index: k,
            })
            .collect();
        for k in 0..count {
            let g = match dys.get(k).cloned().flatten() {
                Some(g) => g,
                None => b.unary("ZerosLike", &format!("zeros_{k}"), &f.output(k)),
            };
            inputs.push(g);
        }
        let refs: Vec<&Output> = inputs.iter().collect();
        let stitched = b.op("DynamicStitch", "stitched", &refs, &[]);
        let dx = b.binary("ReshapeLike", "ddata", &stitched, data);
        Ok(vec![Some(dx), None])
    }

    /// dt = Select(c, dy, 0), de = Select(c, 0, dy); none for the condition.
    fn select_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let c = f.input(0)?;
        let zeros = b.unary("ZerosLike", "zeros", dy);
        let dt = b.op("Select", "dt", &[c, dy, &zeros], &[]);
        let de = b.op("Select", "de", &[c, &zeros, dy], &[]);
        Ok(vec![None, Some(dt), Some(de)])
    }

    /// TensorFlow's `_DynamicStitchGrads`: data[m] gets `Gather(dy, indices[m])`, the indices
    /// none. (With repeated indices a row written by a later m still passes gradient to the
    /// earlier one, as in TensorFlow; embedding lookups stitch distinct positions.)
    fn dynamic_stitch_grad(
        b: &mut GradBuilder,
        f: &ForwardNode,
        dys: &[Option<Output>],
    ) -> GradResult {
        let dy = only_dy(dys)?;
        let n = f.inputs.len();
        if n % 2 != 0 {
            return Err(format!("DynamicStitch with {n} inputs (not 2N)"));
        }
        let mut grads = vec![None; n / 2];
        for m in 0..n / 2 {
            let g = b.op("Gather", &format!("data_{m}"), &[dy, f.input(m)?], &[]);
            grads.push(Some(g));
        }
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::super::math::{infer, tt};
    use super::super::testing::run_kernel;
    use super::*;
    use DType::*;

    fn v<T: crate::Element>(xs: &[T]) -> Tensor {
        Tensor::from_slice(&[xs.len()], xs).unwrap()
    }

    #[test]
    fn segment_ops_give_rows_unknown_and_refuse_a_scalar() {
        let out = infer(
            "UnsortedSegmentSum",
            &[tt(F32, &[5, 3]), tt(I32, &[5]), tt(I32, &[])],
            &[],
        )
        .unwrap();
        assert_eq!(out[0].shape, Shape::partial(vec![None, Some(3)]));
        let e = infer(
            "UnsortedSegmentSum",
            &[tt(F32, &[]), tt(I32, &[5]), tt(I32, &[])],
            &[],
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "UnsortedSegmentSum: data must have rank >= 1, got []"
        );
    }

    fn i64s(t: &Tensor) -> Vec<i64> {
        ints(t, "t").unwrap()
    }

    /// TensorFlow's `embedding_lookup` assignment of ids 0..12 over 5 shards (issue 19's
    /// lists): `mod` puts id on shard id % 5; `div` (13 = 5·2 + 3: the first 3 shards hold 3
    /// rows) on max(id // 3, (id - 3) // 2). DynamicPartition of the positions gives exactly
    /// TensorFlow's lists.
    #[test]
    fn dynamic_partition_gives_tensorflows_shard_lists() {
        let ids: Vec<i64> = (0..13).collect();
        let partition = |shards: Vec<i32>| {
            run_kernel(
                "DynamicPartition",
                &[("num_partitions", AttrValue::Int(5))],
                &[v(&ids), v(&shards)],
            )
            .unwrap()
            .iter()
            .map(i64s)
            .collect::<Vec<_>>()
        };
        let modulo = partition(ids.iter().map(|&i| (i % 5) as i32).collect());
        assert_eq!(
            modulo,
            [
                vec![0, 5, 10],
                vec![1, 6, 11],
                vec![2, 7, 12],
                vec![3, 8],
                vec![4, 9]
            ]
        );
        let div = partition(
            ids.iter()
                .map(|&i| (i / 3).max((i - 3) / 2) as i32)
                .collect(),
        );
        assert_eq!(
            div,
            [
                vec![0, 1, 2],
                vec![3, 4, 5],
                vec![6, 7, 8],
                vec![9, 10],
                vec![11, 12]
            ]
        );
    }

    #[test]
    fn dynamic_partition_moves_rows_and_refuses_bad_partitions() {
        let data = Tensor::from_slice(&[3, 2], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let out = run_kernel(
            "DynamicPartition",
            &[("num_partitions", AttrValue::Int(3))],
            &[data.clone(), v(&[1i32, 0, 1])],
        )
        .unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(out[0].dims(), [1, 2]);
        assert_eq!(out[1].as_slice::<f32>().unwrap(), [1.0, 2.0, 5.0, 6.0]);
        assert_eq!(out[2].dims(), [0, 2]);
        let e = run_kernel(
            "DynamicPartition",
            &[("num_partitions", AttrValue::Int(3))],
            &[data.clone(), v(&[1i32, 3, 1])],
        )
        .unwrap_err();
        assert!(e.contains("partitions[1] = 3 is not in [0, 3)"), "{e}");
        let e = run_kernel(
            "DynamicPartition",
            &[("num_partitions", AttrValue::Int(2))],
            &[data, v(&[1i32, 0])],
        )
        .unwrap_err();
        assert!(e.contains("start with the shape of partitions"), "{e}");
        let big = infer(
            "DynamicPartition",
            &[tt(F32, &[3, 2]), tt(I32, &[3])],
            &[("num_partitions", AttrValue::Int(1 << 40))],
        );
        assert!(big.unwrap_err().to_string().contains("num_partitions"));
        assert_eq!(
            infer(
                "DynamicPartition",
                &[tt(F32, &[-1, 4]), tt(I32, &[-1])],
                &[("num_partitions", AttrValue::Int(2))]
            ),
            Ok(vec![tt(F32, &[-1, 4]), tt(F32, &[-1, 4])])
        );
        assert!(infer(
            "DynamicPartition",
            &[tt(F32, &[3, 4]), tt(F32, &[3])],
            &[("num_partitions", AttrValue::Int(2))]
        )
        .is_err());
    }

    #[test]
    fn less_and_select_pick_like_tensorflow() {
        let z = run_kernel("Less", &[], &[v(&[1i64, 5, 3]), Tensor::scalar(3i64)])
            .unwrap()
            .remove(0);
        assert_eq!(z.as_slice::<u8>().unwrap(), [1, 0, 0]);
        assert_eq!(
            infer("Less", &[tt(F32, &[-1, 3]), tt(F32, &[3])], &[]),
            Ok(vec![tt(Bool, &[-1, 3])])
        );
        let c = Tensor::from_slice(&[3], &[1u8, 0, 1]).unwrap();
        let s = run_kernel("Select", &[], &[c, v(&[1i64, 2, 3]), v(&[7i64, 8, 9])])
            .unwrap()
            .remove(0);
        assert_eq!(s.as_slice::<i64>().unwrap(), [1, 8, 3]);
        // A vector condition picks whole rows.
        let c = Tensor::from_slice(&[2], &[0u8, 1]).unwrap();
        let t = Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let e = Tensor::from_slice(&[2, 2], &[5.0f32, 6.0, 7.0, 8.0]).unwrap();
        let s = run_kernel("Select", &[], &[c, t, e]).unwrap().remove(0);
        assert_eq!(s.as_slice::<f32>().unwrap(), [5.0, 6.0, 3.0, 4.0]);
        assert!(infer(
            "Select",
            &[tt(I32, &[2]), tt(F32, &[2]), tt(F32, &[2])],
            &[]
        )
        .is_err());
        assert!(infer(
            "Select",
            &[tt(Bool, &[3]), tt(F32, &[2]), tt(F32, &[2])],
            &[]
        )
        .is_err());
    }

    #[test]
    fn size_and_range_count_at_run_time() {
        let t = Tensor::zeros(F32, &[3, 4]).unwrap();
        let n = run_kernel("Size", &[], &[t]).unwrap().remove(0);
        assert_eq!(i64s(&n), [12]);
        assert_eq!(n.dtype(), I32);
        let r = |a: i64, b: i64, d: i64| {
            run_kernel(
                "Range",
                &[],
                &[Tensor::scalar(a), Tensor::scalar(b), Tensor::scalar(d)],
            )
        };
        assert_eq!(i64s(&r(0, 5, 2).unwrap()[0]), [0, 2, 4]);
        assert_eq!(i64s(&r(5, 0, -2).unwrap()[0]), [5, 3, 1]);
        assert!(i64s(&r(3, 3, 1).unwrap()[0]).is_empty());
        assert!(r(0, 5, 0).unwrap_err().contains("delta"));
        assert!(r(5, 0, 1).unwrap_err().contains("cannot reach"));
        // A limit from a bad value fails the step instead of allocating it.
        assert!(r(0, i64::MAX, 1).unwrap_err().contains("larger than"));
        assert_eq!(
            infer("Range", &[tt(I32, &[]), tt(I32, &[]), tt(I32, &[])], &[]),
            Ok(vec![tt(I32, &[-1])])
        );
        assert!(infer("Range", &[tt(I32, &[]), tt(I64, &[]), tt(I32, &[])], &[]).is_err());
    }

    fn sliced(x: &Tensor, spec: &[(&str, AttrValue)]) -> Result<Tensor, String> {
        run_kernel("StridedSlice", spec, std::slice::from_ref(x)).map(|mut v| v.remove(0))
    }

    /// Against NumPy's slicing (which TensorFlow's StridedSlice follows).
    #[test]
    fn strided_slice_follows_python_slicing() {
        let x = Tensor::from_slice(&[3, 4], &(0..12i64).collect::<Vec<_>>()).unwrap();
        let l = |v: &[i64]| AttrValue::IntList(v.to_vec());
        // x[:, 0] (what embedding_lookup_sparse takes of sp_ids.indices).
        let spec = [
            ("begin", l(&[0, 0])),
            ("end", l(&[0, 1])),
            ("strides", l(&[1, 1])),
            ("begin_mask", AttrValue::Int(1)),
            ("end_mask", AttrValue::Int(1)),
            ("shrink_axis_mask", AttrValue::Int(2)),
        ];
        let y = sliced(&x, &spec).unwrap();
        assert_eq!((y.dims(), i64s(&y)), (&[3][..], vec![0, 4, 8]));
        assert_eq!(
            infer("StridedSlice", &[tt(I64, &[-1, 2])], &spec),
            Ok(vec![tt(I64, &[-1])])
        );
        // x[1:, ::-2] = [[7, 5], [11, 9]]
        let spec = [
            ("begin", l(&[1, 0])),
            ("end", l(&[0, 0])),
            ("strides", l(&[1, -2])),
            ("end_mask", AttrValue::Int(3)),
            ("begin_mask", AttrValue::Int(2)),
        ];
        let y = sliced(&x, &spec).unwrap();
        assert_eq!((y.dims(), i64s(&y)), (&[2, 2][..], vec![7, 5, 11, 9]));
        assert_eq!(
            infer("StridedSlice", &[tt(I64, &[3, 4])], &spec),
            Ok(vec![tt(I64, &[2, 2])])
        );
        // x[-1] (shrink, negative index); x[0:2] (rows), out-of-range ends clamp.
        let spec = [
            ("begin", l(&[-1])),
            ("end", l(&[0])),
            ("strides", l(&[1])),
            ("shrink_axis_mask", AttrValue::Int(1)),
        ];
        assert_eq!(i64s(&sliced(&x, &spec).unwrap()), [8, 9, 10, 11]);
        let spec = [("begin", l(&[0])), ("end", l(&[99])), ("strides", l(&[2]))];
        let y = sliced(&x, &spec).unwrap();
        assert_eq!(y.dims(), [2, 4]);
        assert_eq!(i64s(&y)[4..], [8, 9, 10, 11]);
        let spec = [
            ("begin", l(&[5])),
            ("end", l(&[0])),
            ("strides", l(&[1])),
            ("shrink_axis_mask", AttrValue::Int(1)),
        ];
        assert!(sliced(&x, &spec).unwrap_err().contains("out of range"));
        let spec = [("begin", l(&[0])), ("end", l(&[1])), ("strides", l(&[0]))];
        assert!(sliced(&x, &spec).unwrap_err().contains("nonzero"));
    }

    /// TensorFlow's ResourceScatterAdd: repeated rows add up; a bad index names the node and
    /// leaves the variable as it was.
    #[test]
    fn scatter_add_adds_rows_in_place() {
        use super::super::testing::run_kernel_with;
        use crate::kernel::VariableCell;
        let var = Tensor::from_slice(&[3, 2], &[1.0f32, 1.0, 2.0, 2.0, 3.0, 3.0]).unwrap();
        let cell = std::sync::Arc::new(VariableCell::default());
        cell.write(var.clone());
        let updates = Tensor::from_slice(&[3, 2], &[0.5f32, 1.0, 10.0, 20.0, -1.0, -2.0]).unwrap();
        let scatter = |idx: Tensor| {
            let inputs = [var.clone(), idx, updates.clone()];
            let types: Vec<TensorType> = inputs
                .iter()
                .map(|t| TensorType::new(t.dtype(), t.shape()))
                .collect();
            run_kernel_with(
                "ScatterAdd",
                "scatter",
                &[],
                &types,
                &inputs,
                std::slice::from_ref(&cell),
            )
        };
        scatter(v(&[2i64, 0, 2])).unwrap();
        let got = cell.read().unwrap();
        assert_eq!(
            got.as_slice::<f32>().unwrap(),
            [11.0, 21.0, 2.0, 2.0, 2.5, 2.0]
        );
        let e = scatter(v(&[2i64, 3, 0])).unwrap_err();
        assert!(
            e.contains("`scatter`") && e.contains("index 3 at position 1"),
            "{e}"
        );
        assert_eq!(
            cell.read().unwrap(),
            got,
            "a refused update changes nothing"
        );
    }

    /// TensorFlow's SparseSegment*Grad against the definition: row indices[k] of the output
    /// gets w · grad[segment_ids[k]], w = 1, 1/n or 1/√n for a segment of n ids.
    #[test]
    fn sparse_segment_grads_scatter_weighted_rows() {
        let grad = Tensor::from_slice(&[2, 2], &[1.0f64, 2.0, 10.0, 20.0]).unwrap();
        // Ids 0, 2, 0 in segment 0; id 1 in segment 1.
        let idx = v(&[0i32, 2, 0, 1]);
        let seg = v(&[0i32, 0, 0, 1]);
        let run = |op: &str, dim0: i32| {
            run_kernel(
                op,
                &[],
                &[grad.clone(), idx.clone(), seg.clone(), Tensor::scalar(dim0)],
            )
        };
        let sum = run("SparseSegmentSumGrad", 4).unwrap().remove(0);
        assert_eq!(sum.dims(), [4, 2]);
        assert_eq!(
            sum.as_slice::<f64>().unwrap(),
            [2.0, 4.0, 10.0, 20.0, 1.0, 2.0, 0.0, 0.0]
        );
        let mean = run("SparseSegmentMeanGrad", 4)
            .unwrap()
            .remove(0)
            .to_f64_vec();
        let third = 1.0 / 3.0;
        let want = [
            2.0 * third,
            4.0 * third,
            10.0,
            20.0,
            third,
            2.0 * third,
            0.0,
            0.0,
        ];
        assert!(
            mean.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12),
            "{mean:?}"
        );
        let sqrtn = run("SparseSegmentSqrtNGrad", 3)
            .unwrap()
            .remove(0)
            .to_f64_vec();
        let r = 1.0 / 3f64.sqrt();
        assert!((sqrtn[0] - 2.0 * r).abs() < 1e-12 && (sqrtn[4] - r).abs() < 1e-12);
        let e = run("SparseSegmentSumGrad", 2).unwrap_err();
        assert!(e.contains("indices[1] = 2 is not in [0, 2)"), "{e}");
        let e = run("SparseSegmentSumGrad", -1).unwrap_err();
        assert!(e.contains("negative"), "{e}");
        let e = run("SparseSegmentSumGrad", i32::MAX).unwrap_err();
        assert!(e.contains("larger than"), "{e}");
        assert_eq!(
            infer(
                "SparseSegmentMeanGrad",
                &[
                    tt(F32, &[-1, 4]),
                    tt(I32, &[-1]),
                    tt(I64, &[-1]),
                    tt(I32, &[])
                ],
                &[]
            ),
            Ok(vec![tt(F32, &[-1, 4])])
        );
    }

    #[test]
    fn unsorted_segment_sum_adds_rows_per_id() {
        let data =
            Tensor::from_slice(&[4, 2], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).unwrap();
        let run = |seg: &[i64], n: i32| {
            run_kernel(
                "UnsortedSegmentSum",
                &[],
                &[data.clone(), v(seg), Tensor::scalar(n)],
            )
        };
        let out = run(&[2, 0, 2, -1], 3).unwrap().remove(0);
        assert_eq!(out.dims(), [3, 2]);
        assert_eq!(
            out.as_slice::<f32>().unwrap(),
            [3.0, 4.0, 0.0, 0.0, 6.0, 8.0]
        );
        let e = run(&[2, 0, 3, 1], 3).unwrap_err();
        assert!(
            e.contains("segment_ids[2] = 3 is not below num_segments 3"),
            "{e}"
        );
        assert!(run(&[0, 0, 0, 0], i32::MAX)
            .unwrap_err()
            .contains("larger than"));
        assert!(run(&[0, 0, 0], 1)
            .unwrap_err()
            .contains("one row per segment id"));
    }

    #[test]
    fn ops_lists_what_is_registered() {
        for op in OPS {
            assert!(registry().get(op).is_some(), "{op}");
        }
    }
}
