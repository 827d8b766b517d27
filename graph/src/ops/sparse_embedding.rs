//! Sparse embedding lookups, TensorFlow's `embedding_lookup_sparse` pieces: `Unique` (dedup the
//! ids so each row is fetched once), and the segment combiners `SparseSegmentSum`,
//! `SparseSegmentMean` and `SparseSegmentSqrtN` with their gradient `SparseSegmentCombineGrad`.
//!
//! A bag-of-ids lookup over `params [V, d]` with ids `[K]` and segment (example) ids `[K]` is
//!
//! ```text
//! unique, idx = Unique(ids)                          # [U], [K]: unique[idx[k]] = ids[k]
//! rows        = Gather(params, unique)               # [U, d]: each row once
//! out         = SparseSegmentSum(rows, idx, seg)     # [S, d]: out[s] = Σ_{seg[k]=s} rows[idx[k]]
//! ```
//!
//! `Mean` divides each segment by its size n, `SqrtN` by √n (empty segments are 0).
//!
//! The gradient of a combiner w.r.t. `data` is sparse: `SparseSegmentCombineGrad` gives the
//! values `[K, d..]` (row k = w_k · dout[seg[k]], w_k = 1, 1/n or 1/√n), then
//! `SparseRowsToDense(indices, values, data)` scatter-adds them, the same sparse pair as
//! Gather's gradient (see [`super::embedding`]), so only touched rows carry gradient.

use super::elementwise::{attr_dtype, attr_str, from_f32, slice, to_f32};
use super::grad::{dispatch_real, Real};
use super::*;
use crate::kernel::{Kernel, KernelContext, KernelInit};
use std::collections::HashMap;

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(unique());
    for c in [Combiner::Sum, Combiner::Mean, Combiner::SqrtN] {
        r.add(segment_combine(c));
    }
    r.add(segment_combine_grad());
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// How a segment's rows are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Combiner {
    /// Σ rows.
    Sum,
    /// Σ rows / n.
    Mean,
    /// Σ rows / √n.
    SqrtN,
}

impl Combiner {
    /// The combiner named `sum`, `mean` or `sqrtn` (TensorFlow's `combiner` strings).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "sum" => Ok(Combiner::Sum),
            "mean" => Ok(Combiner::Mean),
            "sqrtn" => Ok(Combiner::SqrtN),
            _ => Err(format!(
                "unknown combiner `{s}`: use `sum`, `mean` or `sqrtn`"
            )),
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            Combiner::Sum => "sum",
            Combiner::Mean => "mean",
            Combiner::SqrtN => "sqrtn",
        }
    }

    fn op(self) -> &'static str {
        match self {
            Combiner::Sum => "SparseSegmentSum",
            Combiner::Mean => "SparseSegmentMean",
            Combiner::SqrtN => "SparseSegmentSqrtN",
        }
    }

    /// The weight of each row of a segment of `n` rows.
    fn weight(self, n: usize) -> f64 {
        match self {
            Combiner::Sum => 1.0,
            Combiner::Mean => 1.0 / n as f64,
            Combiner::SqrtN => 1.0 / (n as f64).sqrt(),
        }
    }
}

fn require_index(op: &str, what: &str, t: &TensorType) -> Result<(), String> {
    if !matches!(t.dtype, DType::I32 | DType::I64) {
        return Err(format!("{op}: {what} must be i32 or i64, got {t}"));
    }
    if t.shape.rank().is_some_and(|r| r != 1) {
        return Err(format!(
            "{op}: {what} must have rank 1, got shape {}",
            t.shape
        ));
    }
    Ok(())
}

/// An i32/i64 tensor as i64 values.
fn index_values(op: &str, node: &str, what: &str, t: &Tensor) -> Result<Vec<i64>, String> {
    if t.rank() != 1 {
        return Err(format!(
            "{op} `{node}`: {what} must have rank 1, got shape {}",
            t.shape()
        ));
    }
    match t.dtype() {
        DType::I32 => Ok(slice::<i32>(t)?.iter().map(|&v| v.into()).collect()),
        DType::I64 => Ok(slice::<i64>(t)?.to_vec()),
        d => Err(format!("{op} `{node}`: {what} must be i32 or i64, got {d}")),
    }
}

// ---------------------------------------------------------------------------------------------
// Unique
// ---------------------------------------------------------------------------------------------

fn unique() -> OpDef {
    OpDef::new(
        "Unique",
        "The distinct values of x in order of first occurrence, and for every element its \
         position among them: y[idx[i]] = x[i] (TensorFlow's Unique). In: x (i32 or i64, rank \
         1). Out: y [U] (x's dtype), idx [N] (out_idx). Attrs: out_idx (dtype i32 or i64, \
         default i32).",
        |ctx| {
            let x = ctx.input(0)?;
            require_index("Unique", "x", x)?;
            let out_idx = ctx.dtype("out_idx")?;
            check_out_idx(out_idx)?;
            Ok(vec![
                TensorType::new(x.dtype, Shape::partial(vec![None])),
                TensorType::new(out_idx, x.shape.clone()),
            ])
        },
    )
    .inputs([arg("x")])
    .outputs([arg("y"), arg("idx")])
    .attrs([attr_or(
        "out_idx",
        AttrType::DType,
        AttrDefault::DType(DType::I32),
    )])
    .cpu_kernel(|init: &KernelInit<'_>| {
        let out_idx = attr_dtype(init, "out_idx")?;
        check_out_idx(out_idx)?;
        Ok(Box::new(UniqueKernel { out_idx }))
    })
}

fn check_out_idx(d: DType) -> Result<(), String> {
    match d {
        DType::I32 | DType::I64 => Ok(()),
        d => Err(format!("Unique: out_idx must be i32 or i64, got {d}")),
    }
}

#[derive(Debug)]
struct UniqueKernel {
    out_idx: DType,
}

/// The distinct values of `x` (first occurrence order) and each element's position among them.
pub fn unique_with_inverse(x: &[i64]) -> (Vec<i64>, Vec<usize>) {
    let mut pos: HashMap<i64, usize> = HashMap::with_capacity(x.len());
    let mut y = vec![];
    let idx = x
        .iter()
        .map(|&v| {
            *pos.entry(v).or_insert_with(|| {
                y.push(v);
                y.len() - 1
            })
        })
        .collect();
    (y, idx)
}

impl Kernel for UniqueKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let values = index_values("Unique", ctx.node, "x", x)?;
        let (y, idx) = unique_with_inverse(&values);
        let err = |e: crate::TensorError| e.to_string();
        let y = match x.dtype() {
            DType::I32 => {
                let v: Vec<i32> = y.iter().map(|&v| v as i32).collect();
                Tensor::from_slice(&[v.len()], &v)
            }
            _ => Tensor::from_slice(&[y.len()], &y),
        }
        .map_err(err)?;
        let n = idx.len();
        let idx = if self.out_idx == DType::I32 {
            let v = idx
                .iter()
                .map(|&i| i32::try_from(i))
                .collect::<Result<Vec<i32>, _>>()
                .map_err(|_| {
                    format!(
                        "Unique `{}`: {n} elements do not fit out_idx i32: use out_idx i64",
                        ctx.node
                    )
                })?;
            Tensor::from_slice(&[n], &v)
        } else {
            let v: Vec<i64> = idx.iter().map(|&i| i as i64).collect();
            Tensor::from_slice(&[n], &v)
        }
        .map_err(err)?;
        ctx.set_output(0, y)?;
        ctx.set_output(1, idx)
    }
}

// ---------------------------------------------------------------------------------------------
// SparseSegmentSum / Mean / SqrtN
// ---------------------------------------------------------------------------------------------

fn segment_combine(c: Combiner) -> OpDef {
    let summary = match c {
        Combiner::Sum => {
            "out[s, ..] = sum over k with segment_ids[k] = s of data[indices[k], ..] \
             (TensorFlow's SparseSegmentSum). In: data [V, d..] (f32, f64, bf16, f16), indices \
             [K] (i32 or i64, each in [0, V)), segment_ids [K] (i32 or i64, non-decreasing, >= \
             0). Out: out [S, d..], S = the last segment id + 1 (0 when K = 0); empty segments \
             are 0."
        }
        Combiner::Mean => {
            "SparseSegmentSum divided by each segment's size (TensorFlow's SparseSegmentMean). \
             In: data [V, d..], indices [K], segment_ids [K] (non-decreasing). Out: out [S, \
             d..]."
        }
        Combiner::SqrtN => {
            "SparseSegmentSum divided by the square root of each segment's size (TensorFlow's \
             SparseSegmentSqrtN). In: data [V, d..], indices [K], segment_ids [K] \
             (non-decreasing). Out: out [S, d..]."
        }
    };
    let factory: crate::kernel::KernelFactory = match c {
        Combiner::Sum => |_| Ok(Box::new(SegmentKernel(Combiner::Sum))),
        Combiner::Mean => |_| Ok(Box::new(SegmentKernel(Combiner::Mean))),
        Combiner::SqrtN => |_| Ok(Box::new(SegmentKernel(Combiner::SqrtN))),
    };
    let infer: ShapeFn = match c {
        Combiner::Sum => |ctx| segment_infer(Combiner::Sum.op(), ctx),
        Combiner::Mean => |ctx| segment_infer(Combiner::Mean.op(), ctx),
        Combiner::SqrtN => |ctx| segment_infer(Combiner::SqrtN.op(), ctx),
    };
    OpDef::new(c.op(), summary, infer)
        .inputs([arg("data"), arg("indices"), arg("segment_ids")])
        .outputs([arg("output")])
        .cpu_kernel(factory)
}

fn segment_infer(op: &str, ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let (data, indices, seg) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
    require_float(&format!("{op}: data"), data)?;
    require_index(op, "indices", indices)?;
    require_index(op, "segment_ids", seg)?;
    if let (Some(a), Some(b)) = (indices.shape.dim(0), seg.shape.dim(0)) {
        if a != b {
            return Err(format!(
                "{op}: indices {} and segment_ids {} must have the same length",
                indices.shape, seg.shape
            )
            .into());
        }
    }
    let shape = match data.shape.dims() {
        Some([]) => {
            return Err(format!("{op}: data must have rank >= 1, got shape {}", data.shape).into())
        }
        Some(d) => Shape::partial(
            std::iter::once(None)
                .chain(d[1..].iter().copied())
                .collect(),
        ),
        None => Shape::unknown(),
    };
    Ok(vec![TensorType::new(data.dtype, shape)])
}

/// The checked run-time indices and segments: (rows into data, segment per k, segment sizes).
struct Segments {
    rows: Vec<usize>,
    seg: Vec<usize>,
    sizes: Vec<usize>,
}

impl Segments {
    fn check(
        op: &str,
        node: &str,
        indices: &Tensor,
        segment_ids: &Tensor,
        v: usize,
    ) -> Result<Self, String> {
        let idx = index_values(op, node, "indices", indices)?;
        let seg = index_values(op, node, "segment_ids", segment_ids)?;
        if idx.len() != seg.len() {
            return Err(format!(
                "{op} `{node}`: indices has {} elements but segment_ids has {}",
                idx.len(),
                seg.len()
            ));
        }
        let rows = idx
            .iter()
            .enumerate()
            .map(|(k, &i)| {
                usize::try_from(i).ok().filter(|&u| u < v).ok_or_else(|| {
                    format!("{op} `{node}`: index {i} at position {k} is out of range [0, {v})")
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut prev = 0i64;
        for (k, &s) in seg.iter().enumerate() {
            if s < prev {
                return Err(format!(
                    "{op} `{node}`: segment_ids must be non-negative and non-decreasing, got {s} \
                     at position {k}{}",
                    if k > 0 {
                        format!(" after {prev}")
                    } else {
                        String::new()
                    }
                ));
            }
            prev = s;
        }
        // The last id bounds the output rows; K entries at most K distinct non-empty segments,
        // but ids may skip: cap the output at what K elements of index memory could justify.
        let count = seg.last().map_or(0, |&s| s as usize + 1);
        if count > seg.len().saturating_mul(1024).max(1 << 20) {
            return Err(format!(
                "{op} `{node}`: the last segment id {} asks for {count} output rows from {} \
                 ids; segment ids must number examples densely",
                count - 1,
                seg.len()
            ));
        }
        let mut sizes = vec![0usize; count];
        let seg: Vec<usize> = seg.iter().map(|&s| s as usize).collect();
        for &s in &seg {
            sizes[s] += 1;
        }
        Ok(Segments { rows, seg, sizes })
    }
}

#[derive(Debug)]
struct SegmentKernel(Combiner);

fn segment_typed<T: Real>(data: &Tensor, s: &Segments, c: Combiner) -> Result<Tensor, String> {
    let row: usize = data.dims()[1..].iter().product();
    let src = slice::<T>(data)?;
    let dims: Vec<usize> = std::iter::once(s.sizes.len())
        .chain(data.dims()[1..].iter().copied())
        .collect();
    let mut acc = vec![0f64; s.sizes.len() * row];
    for (&r, &g) in s.rows.iter().zip(&s.seg) {
        for (a, &v) in acc[g * row..(g + 1) * row]
            .iter_mut()
            .zip(&src[r * row..(r + 1) * row])
        {
            *a += v.to_f64();
        }
    }
    if row > 0 {
        for (chunk, &n) in acc.chunks_mut(row).zip(&s.sizes) {
            if n > 0 {
                let w = c.weight(n);
                chunk.iter_mut().for_each(|a| *a *= w);
            }
        }
    }
    let v: Vec<T> = acc.into_iter().map(T::from_f64).collect();
    Tensor::from_slice(&dims, &v).map_err(|e| e.to_string())
}

impl Kernel for SegmentKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let op = self.0.op();
        let (data, indices, seg) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        let Some(&v) = data.dims().first() else {
            return Err(format!(
                "{op} `{}`: data must have rank >= 1, got shape {}",
                ctx.node,
                data.shape()
            )
            .into());
        };
        let s = Segments::check(op, ctx.node, indices, seg, v)?;
        let c = self.0;
        let out = match data.dtype() {
            d @ (DType::BF16 | DType::F16) => {
                from_f32(&segment_typed::<f32>(&to_f32(data)?, &s, c)?, d).map_err(OpError::from)
            }
            d => dispatch_real!(d, segment_typed(data, &s, c)),
        }?;
        ctx.set_output(0, out)
    }
}

// ---------------------------------------------------------------------------------------------
// SparseSegmentCombineGrad
// ---------------------------------------------------------------------------------------------

fn segment_combine_grad() -> OpDef {
    OpDef::new(
        "SparseSegmentCombineGrad",
        "The gradient of SparseSegmentSum/Mean/SqrtN in sparse form: values[k, ..] = w_k * \
         grad[segment_ids[k], ..], w_k = 1, 1/n or 1/sqrt(n) for a segment of n ids; with \
         SparseRowsToDense(indices, values, data) it is the dense gradient w.r.t. data. In: grad \
         [S, d..] (float), indices [K], segment_ids [K] (i32 or i64). Out: values [K, d..]. \
         Attrs: combiner (string: sum, mean or sqrtn).",
        |ctx| {
            const OP: &str = "SparseSegmentCombineGrad";
            Combiner::parse(ctx.string("combiner")?)?;
            let (grad, indices, seg) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
            require_float(&format!("{OP}: grad"), grad)?;
            require_index(OP, "indices", indices)?;
            require_index(OP, "segment_ids", seg)?;
            let k = indices.shape.dim(0).or(seg.shape.dim(0));
            let shape = match grad.shape.dims() {
                Some([]) => {
                    return Err(
                        format!("{OP}: grad must have rank >= 1, got shape {}", grad.shape).into(),
                    )
                }
                Some(d) => {
                    Shape::partial(std::iter::once(k).chain(d[1..].iter().copied()).collect())
                }
                None => Shape::unknown(),
            };
            Ok(vec![TensorType::new(grad.dtype, shape)])
        },
    )
    .inputs([arg("grad"), arg("indices"), arg("segment_ids")])
    .outputs([arg("values")])
    .attrs([attr("combiner", AttrType::String)])
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(SegmentGradKernel(Combiner::parse(&attr_str(
            init, "combiner",
        )?)?)))
    })
}

#[derive(Debug)]
struct SegmentGradKernel(Combiner);

fn segment_grad_typed<T: Real>(grad: &Tensor, s: &Segments, c: Combiner) -> Result<Tensor, String> {
    let row: usize = grad.dims()[1..].iter().product();
    let src = slice::<T>(grad)?;
    let dims: Vec<usize> = std::iter::once(s.seg.len())
        .chain(grad.dims()[1..].iter().copied())
        .collect();
    let mut out = Tensor::zeros(T::DTYPE, &dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    if row > 0 {
        for (chunk, &g) in dst.chunks_mut(row).zip(&s.seg) {
            let w = T::from_f64(c.weight(s.sizes[g]));
            for (o, &v) in chunk.iter_mut().zip(&src[g * row..(g + 1) * row]) {
                *o = w * v;
            }
        }
    }
    Ok(out)
}

impl Kernel for SegmentGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "SparseSegmentCombineGrad";
        let (grad, indices, seg) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        if grad.rank() == 0 {
            return Err(format!(
                "{OP} `{}`: grad must have rank >= 1, got shape {}",
                ctx.node,
                grad.shape()
            )
            .into());
        }
        // Indices are only checked for type and length here (SparseRowsToDense checks range).
        let s = Segments::check(OP, ctx.node, indices, seg, usize::MAX)?;
        if s.sizes.len() != grad.dims()[0] {
            return Err(format!(
                "{OP} `{}`: grad has {} segments but segment_ids end at segment {}",
                ctx.node,
                grad.dims()[0],
                s.sizes.len() as i64 - 1
            )
            .into());
        }
        let c = self.0;
        let out = match grad.dtype() {
            d @ (DType::BF16 | DType::F16) => {
                from_f32(&segment_grad_typed::<f32>(&to_f32(grad)?, &s, c)?, d)
                    .map_err(OpError::from)
            }
            d => dispatch_real!(d, segment_grad_typed(grad, &s, c)),
        }?;
        ctx.set_output(0, out)
    }
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`] and the module docs).
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{no_gradient, only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("Unique", no_gradient);
        r.set_gradient("SparseSegmentSum", |b, f, d| combine_grad(b, f, d, "sum"));
        r.set_gradient("SparseSegmentMean", |b, f, d| combine_grad(b, f, d, "mean"));
        r.set_gradient("SparseSegmentSqrtN", |b, f, d| {
            combine_grad(b, f, d, "sqrtn")
        });
        // SparseSegmentCombineGrad gets none: second derivatives are not supported.
    }

    /// The sparse pair: `values` = SparseSegmentCombineGrad(dy, indices, segment_ids), then
    /// `ddata` = SparseRowsToDense(indices, values, data).
    fn combine_grad(
        b: &mut GradBuilder,
        f: &ForwardNode,
        dys: &[Option<Output>],
        combiner: &str,
    ) -> GradResult {
        let dy = only_dy(dys)?;
        let (data, indices, seg) = (f.input(0)?, f.input(1)?, f.input(2)?);
        let values = b.op(
            "SparseSegmentCombineGrad",
            "values",
            &[dy, indices, seg],
            &[("combiner", combiner.into())],
        );
        let dense = b.op("SparseRowsToDense", "ddata", &[indices, &values, data], &[]);
        Ok(vec![Some(dense), None, None])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_keeps_first_occurrence_order() {
        let (y, idx) = unique_with_inverse(&[5, 3, 5, 9, 3, 3]);
        assert_eq!(y, vec![5, 3, 9]);
        assert_eq!(idx, vec![0, 1, 0, 2, 1, 1]);
        let (y, idx) = unique_with_inverse(&[]);
        assert!(y.is_empty() && idx.is_empty());
    }

    #[test]
    fn combiners_parse_and_weigh() {
        for c in [Combiner::Sum, Combiner::Mean, Combiner::SqrtN] {
            assert_eq!(Combiner::parse(c.name()), Ok(c));
        }
        assert!(Combiner::parse("max").unwrap_err().contains("sqrtn"));
        assert_eq!(Combiner::Mean.weight(4), 0.25);
        assert_eq!(Combiner::SqrtN.weight(4), 0.5);
    }
}
