//! An embedding lookup over a table sharded on several tasks (the ps strategy's sharded
//! embeddings), with every buffer that crosses a task of a static size.
//!
//! A table of `vocab` rows split over `N` shards ([`crate::embedding_partition`]) is read for
//! ids `[i..]` (K ids) as
//!
//! ```text
//! rows_s, slots_s = EmbeddingShardRows(ids)          # worker: rows_s [C_s] i64, slots_s [K] i64
//! vals_s          = EmbeddingShardGather(part_s, rows_s)   # shard s: [C_s, d..]
//! out             = EmbeddingShardStitch(ids, slots_0, vals_0, ..., slots_N-1, vals_N-1)
//!                                                    # worker: [i.., d..] = Gather(table, ids)
//! ```
//!
//! `rows_s` holds the distinct local rows of shard `s` that the ids touch (first-occurrence
//! order), padded with -1 to the static capacity `C_s` (at most min(K, rows on shard s)): each
//! row is fetched once however often it occurs. `slots_s[k]` is the position of id `k`'s row in
//! `rows_s` when id `k` lives on shard `s`, else -1. Padded rows read as zeros.
//!
//! Gradients: the stitch's gradient w.r.t. `vals_s` is `EmbeddingShardStitchGrad` (`[C_s,
//! d..]`: duplicates summed on the worker, zero in padded rows), which travels to shard `s`;
//! the gather's gradient w.r.t. the shard is `EmbeddingShardScatter(rows_s, dvals_s, part_s)`,
//! dense on the shard. The ps strategy replaces the dense update that reads it by a sparse one
//! on `(rows_s, dvals_s)` (the sparse optimizers' `skip_padding` drops the -1 rows).

use super::elementwise::{attr_int, attr_str, dispatch_any, slice};
use super::grad::{dispatch_real, Real};
use super::*;
use crate::embedding_partition::{EmbeddingPartition, PartitionStrategy};
use crate::kernel::{Kernel, KernelContext, KernelInit};
use crate::Element;
use std::collections::HashMap;

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(shard_rows());
    r.add(shard_gather());
    r.add(shard_scatter());
    r.add(shard_stitch());
    r.add(shard_stitch_grad());
}

/// The padding row of `rows` and slot of `slots`.
pub const PADDING: i64 = -1;

/// An i32/i64 tensor of any shape as i64 values.
fn ids_of(op: &str, node: &str, t: &Tensor) -> Result<Vec<i64>, String> {
    match t.dtype() {
        DType::I32 => Ok(slice::<i32>(t)?.iter().map(|&v| v.into()).collect()),
        DType::I64 => Ok(slice::<i64>(t)?.to_vec()),
        d => Err(format!("{op} `{node}`: ids must be i32 or i64, got {d}")),
    }
}

fn require_i64_vector(op: &str, what: &str, t: &TensorType) -> Result<(), String> {
    if t.dtype != DType::I64 || t.shape.rank().is_some_and(|r| r != 1) {
        return Err(format!("{op}: {what} must be i64 [N], got {t}"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// EmbeddingShardRows
// ---------------------------------------------------------------------------------------------

fn shard_rows() -> OpDef {
    OpDef::new(
        "EmbeddingShardRows",
        "The rows one shard of a partitioned table serves for ids (see the module docs). In: \
         ids (i32 or i64, any shape, K elements, each in [0, vocab)). Out: rows (i64 \
         [capacity]: the shard's distinct local rows, first-occurrence order, -1 padded), slots \
         (i64 [K]: id k's position in rows, -1 when it lives on another shard). Attrs: vocab, \
         num_shards, shard, capacity (ints), strategy (`mod` or `div`).",
        |ctx| {
            let ids = ctx.input(0)?;
            if !matches!(ids.dtype, DType::I32 | DType::I64) {
                return Err(
                    format!("EmbeddingShardRows: ids must be i32 or i64, got {ids}").into(),
                );
            }
            let p = ShardSpec::from_attrs(
                ctx.int("vocab")?,
                ctx.int("num_shards")?,
                ctx.int("shard")?,
                ctx.int("capacity")?,
                ctx.string("strategy")?,
            )?;
            Ok(vec![
                TensorType::new(DType::I64, Shape::known(&[p.capacity])),
                TensorType::new(DType::I64, Shape::partial(vec![ids.shape.num_elements()])),
            ])
        },
    )
    .inputs([arg("ids")])
    .outputs([arg("rows"), arg("slots")])
    .attrs([
        attr("vocab", AttrType::Int),
        attr("num_shards", AttrType::Int),
        attr("shard", AttrType::Int),
        attr("capacity", AttrType::Int),
        attr("strategy", AttrType::String),
    ])
    .cpu_kernel(|init: &KernelInit<'_>| {
        Ok(Box::new(ShardRowsKernel(ShardSpec::from_attrs(
            attr_int(init, "vocab")?,
            attr_int(init, "num_shards")?,
            attr_int(init, "shard")?,
            attr_int(init, "capacity")?,
            &attr_str(init, "strategy")?,
        )?)))
    })
}

/// One shard of a partitioned table and its buffer capacity.
#[derive(Debug)]
struct ShardSpec {
    partition: EmbeddingPartition,
    shard: usize,
    capacity: usize,
}

impl ShardSpec {
    fn from_attrs(
        vocab: i64,
        shards: i64,
        shard: i64,
        capacity: i64,
        strategy: &str,
    ) -> Result<Self, String> {
        const OP: &str = "EmbeddingShardRows";
        let strategy: PartitionStrategy = strategy.parse()?;
        let vocab =
            u64::try_from(vocab).map_err(|_| format!("{OP}: vocab must be ≥ 0, got {vocab}"))?;
        let shards_n = usize::try_from(shards)
            .map_err(|_| format!("{OP}: num_shards must be ≥ 1, got {shards}"))?;
        let partition =
            EmbeddingPartition::new(vocab, shards_n, strategy).map_err(|e| format!("{OP}: {e}"))?;
        let shard = usize::try_from(shard)
            .ok()
            .filter(|&s| s < shards_n)
            .ok_or_else(|| format!("{OP}: shard {shard} is not in [0, {shards_n})"))?;
        let capacity = usize::try_from(capacity)
            .map_err(|_| format!("{OP}: capacity must be ≥ 0, got {capacity}"))?;
        Ok(ShardSpec {
            partition,
            shard,
            capacity,
        })
    }
}

#[derive(Debug)]
struct ShardRowsKernel(ShardSpec);

impl Kernel for ShardRowsKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "EmbeddingShardRows";
        let s = &self.0;
        let ids = ids_of(OP, ctx.node, ctx.input(0)?)?;
        let mut rows = vec![PADDING; s.capacity];
        let mut slots = vec![PADDING; ids.len()];
        let mut position: HashMap<u64, usize> = HashMap::new();
        for (k, &id) in ids.iter().enumerate() {
            let (shard, row) = u64::try_from(id)
                .map_err(|_| format!("id {id} is negative"))
                .and_then(|id| s.partition.shard_of(id))
                .map_err(|e| format!("{OP} `{}`: id at position {k}: {e}", ctx.node))?;
            if shard != s.shard {
                continue;
            }
            let next = position.len();
            let p = *position.entry(row).or_insert(next);
            if p >= s.capacity {
                return Err(format!(
                    "{OP} `{}`: the ids touch more than {} distinct rows of shard {}; the \
                     buffers are sized for at most {} (one per id of the batch)",
                    ctx.node, s.capacity, s.shard, s.capacity
                )
                .into());
            }
            rows[p] = row as i64;
            slots[k] = p as i64;
        }
        let err = |e: crate::TensorError| e.to_string();
        ctx.set_output(0, Tensor::from_slice(&[rows.len()], &rows).map_err(err)?)?;
        ctx.set_output(1, Tensor::from_slice(&[slots.len()], &slots).map_err(err)?)
    }
}

// ---------------------------------------------------------------------------------------------
// EmbeddingShardGather
// ---------------------------------------------------------------------------------------------

fn shard_gather() -> OpDef {
    OpDef::new(
        "EmbeddingShardGather",
        "output[c] = params[rows[c]], zeros where rows[c] = -1 (padding). In: params [R, d..] \
         (a table shard), rows (i64 [C], each -1 or in [0, R)). Out: output [C, d..], params' \
         dtype.",
        |ctx| {
            let (params, rows) = (ctx.input(0)?, ctx.input(1)?);
            require_i64_vector("EmbeddingShardGather", "rows", rows)?;
            let shape = match params.shape.dims() {
                Some([]) => {
                    return Err(format!(
                        "EmbeddingShardGather: params must have rank >= 1, got {params}"
                    )
                    .into())
                }
                Some(p) => Shape::partial(
                    std::iter::once(rows.shape.dim(0))
                        .chain(p[1..].iter().copied())
                        .collect(),
                ),
                None => Shape::unknown(),
            };
            Ok(vec![TensorType::new(params.dtype, shape)])
        },
    )
    .inputs([arg("params"), arg("rows")])
    .outputs([arg("output")])
    .cpu_kernel(|_| Ok(Box::new(ShardGatherKernel)))
}

/// The rows as `Option<usize>` (None: padding), each checked against `[0, r)`.
fn checked_rows(
    op: &str,
    node: &str,
    rows: &Tensor,
    r: usize,
) -> Result<Vec<Option<usize>>, String> {
    if rows.rank() != 1 {
        return Err(format!(
            "{op} `{node}`: rows must have rank 1, got shape {}",
            rows.shape()
        ));
    }
    slice::<i64>(rows)?
        .iter()
        .enumerate()
        .map(|(pos, &i)| match i {
            PADDING => Ok(None),
            _ => usize::try_from(i)
                .ok()
                .filter(|&u| u < r)
                .map(Some)
                .ok_or_else(|| {
                    format!(
                    "{op} `{node}`: row {i} at position {pos} is neither -1 (padding) nor in [0, \
                     {r}) (the rows of the shard)"
                )
                }),
        })
        .collect()
}

fn row_len(t: &Tensor) -> usize {
    t.dims().get(1..).map_or(1, |d| d.iter().product())
}

fn gather_padded<T: Element>(
    params: &Tensor,
    rows: &[Option<usize>],
    out_dims: &[usize],
) -> Result<Tensor, String> {
    let src = slice::<T>(params)?;
    let row = row_len(params);
    let mut out = Tensor::zeros(T::DTYPE, out_dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    if row > 0 {
        for (chunk, r) in dst.chunks_mut(row).zip(rows) {
            if let Some(r) = r {
                chunk.copy_from_slice(&src[r * row..(r + 1) * row]);
            }
        }
    }
    Ok(out)
}

#[derive(Debug)]
struct ShardGatherKernel;

impl Kernel for ShardGatherKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "EmbeddingShardGather";
        let (params, rows) = (ctx.input(0)?, ctx.input(1)?);
        let Some(&r) = params.dims().first() else {
            return Err(format!(
                "{OP} `{}`: params must have rank >= 1, got shape {}",
                ctx.node,
                params.shape()
            )
            .into());
        };
        let rows = checked_rows(OP, ctx.node, rows, r)?;
        let out_dims: Vec<usize> = std::iter::once(rows.len())
            .chain(params.dims()[1..].iter().copied())
            .collect();
        let out = dispatch_any!(params.dtype(), gather_padded(params, &rows, &out_dims))?;
        ctx.set_output(0, out)
    }
}

// ---------------------------------------------------------------------------------------------
// EmbeddingShardScatter
// ---------------------------------------------------------------------------------------------

fn shard_scatter() -> OpDef {
    OpDef::new(
        "EmbeddingShardScatter",
        "EmbeddingShardGather's gradient w.r.t. params, dense: zeros of like's shape with \
         row rows[c] += values[c] (padding rows skipped, duplicates summed). In: rows (i64 \
         [C]), values (float [C, d..]), like ([R, d..]; only its shape is read). Out: [R, d..], \
         values' dtype.",
        |ctx| {
            let (rows, values, like) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
            require_i64_vector("EmbeddingShardScatter", "rows", rows)?;
            require_float("EmbeddingShardScatter: values", values)?;
            Ok(vec![TensorType::new(values.dtype, like.shape.clone())])
        },
    )
    .inputs([arg("rows"), arg("values"), arg("like")])
    .outputs([arg("dense")])
    .cpu_kernel(|_| Ok(Box::new(ShardScatterKernel)))
}

fn scatter_padded<T: Real>(
    rows: &[Option<usize>],
    values: &Tensor,
    dims: &[usize],
) -> Result<Tensor, String> {
    let src = slice::<T>(values)?;
    let row: usize = dims[1..].iter().product();
    let mut out = Tensor::zeros(T::DTYPE, dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    if row > 0 {
        for (chunk, r) in src.chunks(row).zip(rows) {
            if let Some(r) = r {
                for (o, &v) in dst[r * row..(r + 1) * row].iter_mut().zip(chunk) {
                    *o += v;
                }
            }
        }
    }
    Ok(out)
}

#[derive(Debug)]
struct ShardScatterKernel;

impl Kernel for ShardScatterKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "EmbeddingShardScatter";
        let (rows, values, like) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        let dims = like.dims();
        let fits = !dims.is_empty()
            && values.rank() == dims.len()
            && values.dims()[0] == rows.num_elements()
            && values.dims()[1..] == dims[1..];
        if !fits {
            return Err(format!(
                "{OP} `{}`: values {} must be [C, d..] with C = the length of rows {} and d.. \
                 the trailing dimensions of like {}",
                ctx.node,
                values.shape(),
                rows.shape(),
                like.shape()
            )
            .into());
        }
        let rows = checked_rows(OP, ctx.node, rows, dims[0])?;
        let out = dispatch_real!(values.dtype(), scatter_padded(&rows, values, dims))?;
        ctx.set_output(0, out)
    }
}

// ---------------------------------------------------------------------------------------------
// EmbeddingShardStitch
// ---------------------------------------------------------------------------------------------

fn shard_stitch() -> OpDef {
    OpDef::new(
        "EmbeddingShardStitch",
        "Gather(table, ids) from the shards' rows: output[k] = vals_s[slots_s[k]] for the shard \
         s whose slots_s[k] >= 0. In: ids (i32 or i64 [i..], K elements; only its shape is \
         read), then per shard slots_s (i64 [K]) and vals_s ([C_s, d..], one float dtype). Out: \
         output [i.., d..].",
        |ctx| {
            const OP: &str = "EmbeddingShardStitch";
            let ids = ctx.input(0)?;
            let n = ctx.inputs.len();
            if n < 3 || (n - 1) % 2 != 0 {
                return Err(format!(
                    "{OP}: takes ids and then (slots, vals) per shard, got {} inputs",
                    n
                )
                .into());
            }
            let first = ctx.input(2)?;
            for s in 0..(n - 1) / 2 {
                require_i64_vector(OP, &format!("slots_{s}"), ctx.input(1 + 2 * s)?)?;
                let v = ctx.input(2 + 2 * s)?;
                let same = v.dtype == first.dtype
                    && match (v.shape.dims(), first.shape.dims()) {
                        (Some(a), Some(b)) => {
                            !a.is_empty()
                                && a.len() == b.len()
                                && a[1..]
                                    .iter()
                                    .zip(&b[1..])
                                    .all(|(x, y)| x.is_none() || y.is_none() || x == y)
                        }
                        _ => true,
                    };
                if !same {
                    return Err(format!(
                        "{OP}: vals_{s} is {v} but vals_0 is {first}; each must be [C_s, d..] of \
                         one dtype"
                    )
                    .into());
                }
            }
            let shape = match (ids.shape.dims(), first.shape.dims()) {
                (Some(i), Some(v)) => Shape::partial(i.iter().chain(&v[1..]).copied().collect()),
                _ => Shape::unknown(),
            };
            Ok(vec![TensorType::new(first.dtype, shape)])
        },
    )
    .inputs([arg("ids"), variadic("parts")])
    .outputs([arg("output")])
    .cpu_kernel(|_| Ok(Box::new(ShardStitchKernel)))
}

fn stitch<T: Element>(
    node: &str,
    parts: &[(&[i64], &Tensor)],
    out_dims: &[usize],
    row: usize,
) -> Result<Tensor, String> {
    let mut out = Tensor::zeros(T::DTYPE, out_dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    let k_total = parts.first().map_or(0, |(s, _)| s.len());
    let mut filled = vec![false; k_total];
    for (s, (slots, vals)) in parts.iter().enumerate() {
        let src = slice::<T>(vals)?;
        let c = vals.dims()[0];
        for (k, &p) in slots.iter().enumerate() {
            if p == PADDING {
                continue;
            }
            let p = usize::try_from(p).ok().filter(|&p| p < c).ok_or_else(|| {
                format!(
                    "EmbeddingShardStitch `{node}`: slots_{s}[{k}] = {p} is neither -1 nor in \
                     [0, {c})"
                )
            })?;
            if std::mem::replace(&mut filled[k], true) {
                return Err(format!(
                    "EmbeddingShardStitch `{node}`: id {k} is claimed by two shards"
                ));
            }
            dst[k * row..(k + 1) * row].copy_from_slice(&src[p * row..(p + 1) * row]);
        }
    }
    if let Some(k) = filled.iter().position(|f| !f) {
        return Err(format!(
            "EmbeddingShardStitch `{node}`: no shard serves id {k}"
        ));
    }
    Ok(out)
}

#[derive(Debug)]
struct ShardStitchKernel;

impl Kernel for ShardStitchKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        const OP: &str = "EmbeddingShardStitch";
        let ids = ctx.input(0)?;
        let k = ids.num_elements();
        let n = ctx.inputs.len().saturating_sub(1) / 2;
        let mut parts = Vec::with_capacity(n);
        for s in 0..n {
            let (slots, vals) = (ctx.input(1 + 2 * s)?, ctx.input(2 + 2 * s)?);
            if slots.dtype() != DType::I64 || slots.rank() != 1 || slots.num_elements() != k {
                return Err(format!(
                    "{OP} `{}`: slots_{s} must be i64 [{k}] (one per id), got {} {}",
                    ctx.node,
                    slots.dtype(),
                    slots.shape()
                )
                .into());
            }
            if vals.rank() == 0 {
                return Err(format!("{OP} `{}`: vals_{s} must have rank >= 1", ctx.node).into());
            }
            parts.push((slice::<i64>(slots)?, vals));
        }
        let Some(&(_, first)) = parts.first() else {
            return Err(format!("{OP} `{}`: no shards", ctx.node).into());
        };
        let trailing = &first.dims()[1..];
        if let Some(s) = parts
            .iter()
            .position(|(_, v)| v.dtype() != first.dtype() || v.dims()[1..] != *trailing)
        {
            return Err(format!(
                "{OP} `{}`: vals_{s} is {} {} but vals_0 is {} {}",
                ctx.node,
                parts[s].1.dtype(),
                parts[s].1.shape(),
                first.dtype(),
                first.shape()
            )
            .into());
        }
        let row: usize = trailing.iter().product();
        let out_dims: Vec<usize> = ids.dims().iter().chain(trailing).copied().collect();
        let out = dispatch_any!(first.dtype(), stitch(ctx.node, &parts, &out_dims, row))?;
        ctx.set_output(0, out)
    }
}

// ---------------------------------------------------------------------------------------------
// EmbeddingShardStitchGrad
// ---------------------------------------------------------------------------------------------

fn shard_stitch_grad() -> OpDef {
    OpDef::new(
        "EmbeddingShardStitchGrad",
        "EmbeddingShardStitch's gradient w.r.t. one shard's vals: out[c] = Σ dy[k] over the ids \
         k with slots[k] = c (zero for padding rows). In: slots (i64 [K]), dy (float [i.., \
         d..], K ids), like ([C, d..]; only its shape is read). Out: [C, d..], dy's dtype.",
        |ctx| {
            let (slots, dy, like) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
            require_i64_vector("EmbeddingShardStitchGrad", "slots", slots)?;
            require_float("EmbeddingShardStitchGrad: dy", dy)?;
            Ok(vec![TensorType::new(dy.dtype, like.shape.clone())])
        },
    )
    .inputs([arg("slots"), arg("dy"), arg("like")])
    .outputs([arg("dvals")])
    .cpu_kernel(|_| Ok(Box::new(ShardStitchGradKernel)))
}

fn stitch_grad<T: Real>(
    node: &str,
    slots: &[i64],
    dy: &Tensor,
    dims: &[usize],
) -> Result<Tensor, String> {
    let row: usize = dims[1..].iter().product();
    let src = slice::<T>(dy)?;
    if src.len() != slots.len() * row {
        return Err(format!(
            "EmbeddingShardStitchGrad `{node}`: dy {} does not hold {} rows of {row}",
            dy.shape(),
            slots.len()
        ));
    }
    let mut out = Tensor::zeros(T::DTYPE, dims).map_err(|e| e.to_string())?;
    let dst = out.as_mut_slice::<T>().map_err(|e| e.to_string())?;
    for (k, &p) in slots.iter().enumerate() {
        if p == PADDING {
            continue;
        }
        let p = usize::try_from(p)
            .ok()
            .filter(|&p| p < dims[0])
            .ok_or_else(|| {
                format!(
                "EmbeddingShardStitchGrad `{node}`: slots[{k}] = {p} is neither -1 nor in [0, {})",
                dims[0]
            )
            })?;
        for (o, &g) in dst[p * row..(p + 1) * row]
            .iter_mut()
            .zip(&src[k * row..(k + 1) * row])
        {
            *o += g;
        }
    }
    Ok(out)
}

#[derive(Debug)]
struct ShardStitchGradKernel;

impl Kernel for ShardStitchGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (slots, dy, like) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        if slots.dtype() != DType::I64 || slots.rank() != 1 || like.rank() == 0 {
            return Err(format!(
                "EmbeddingShardStitchGrad `{}`: slots must be i64 [K] and like [C, d..], got {} \
                 {} and {}",
                ctx.node,
                slots.dtype(),
                slots.shape(),
                like.shape()
            )
            .into());
        }
        let slots = slice::<i64>(slots)?;
        let out = dispatch_real!(dy.dtype(), stitch_grad(ctx.node, slots, dy, like.dims()))?;
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
        r.set_gradient("EmbeddingShardRows", no_gradient);
        r.set_gradient("EmbeddingShardGather", gather_grad);
        r.set_gradient("EmbeddingShardStitch", stitch_grad);
        // EmbeddingShardScatter and EmbeddingShardStitchGrad get none: second derivatives are
        // not supported.
    }

    /// Dense on the shard: EmbeddingShardScatter(rows, dy, params).
    fn gather_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let (params, rows) = (f.input(0)?, f.input(1)?);
        let dense = b.op("EmbeddingShardScatter", "dparams", &[rows, dy, params], &[]);
        Ok(vec![Some(dense), None])
    }

    /// Per shard: EmbeddingShardStitchGrad(slots_s, dy, vals_s); none for ids and slots.
    fn stitch_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let mut grads = vec![None; f.inputs.len()];
        for s in 0..(f.inputs.len() - 1) / 2 {
            let (slots, vals) = (f.input(1 + 2 * s)?, f.input(2 + 2 * s)?);
            grads[2 + 2 * s] = Some(b.op(
                "EmbeddingShardStitchGrad",
                &format!("dvals_{s}"),
                &[slots, dy, vals],
                &[],
            ));
        }
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testing::run_kernel;

    fn i64s(v: &[i64]) -> Tensor {
        Tensor::from_slice(&[v.len()], v).unwrap()
    }

    fn rows_of(ids: &[i64], shards: i64, shard: i64, strategy: &str) -> (Vec<i64>, Vec<i64>) {
        let out = run_kernel(
            "EmbeddingShardRows",
            &[
                ("vocab", AttrValue::Int(13)),
                ("num_shards", AttrValue::Int(shards)),
                ("shard", AttrValue::Int(shard)),
                ("capacity", AttrValue::Int(ids.len() as i64)),
                ("strategy", AttrValue::String(strategy.into())),
            ],
            &[i64s(ids)],
        )
        .unwrap();
        (
            out[0].as_slice::<i64>().unwrap().to_vec(),
            out[1].as_slice::<i64>().unwrap().to_vec(),
        )
    }

    #[test]
    fn rows_are_distinct_padded_and_slots_point_at_them() {
        // mod over 5 shards: shard 2 holds ids 2, 7, 12 at local rows 0, 1, 2.
        let ids = [7, 3, 12, 7, 2, 7];
        let (rows, slots) = rows_of(&ids, 5, 2, "mod");
        assert_eq!(rows, [1, 2, 0, -1, -1, -1]);
        assert_eq!(slots, [0, -1, 1, 0, 2, 0]);
        // div over 5 shards: shard 1 holds ids 3, 4, 5.
        let (rows, slots) = rows_of(&ids, 5, 1, "div");
        assert_eq!(rows, [0, -1, -1, -1, -1, -1]);
        assert_eq!(slots, [-1, 0, -1, -1, -1, -1]);
    }

    #[test]
    fn bad_ids_and_overflowing_capacity_are_errors() {
        let attrs = |cap: i64| {
            vec![
                ("vocab", AttrValue::Int(13)),
                ("num_shards", AttrValue::Int(2)),
                ("shard", AttrValue::Int(0)),
                ("capacity", AttrValue::Int(cap)),
                ("strategy", AttrValue::String("mod".into())),
            ]
        };
        let e = run_kernel("EmbeddingShardRows", &attrs(4), &[i64s(&[0, 13])]).unwrap_err();
        assert!(e.contains("position 1") && e.contains("13"), "{e}");
        let e = run_kernel("EmbeddingShardRows", &attrs(4), &[i64s(&[-2])]).unwrap_err();
        assert!(e.contains("negative"), "{e}");
        let e = run_kernel("EmbeddingShardRows", &attrs(1), &[i64s(&[0, 2])]).unwrap_err();
        assert!(e.contains("more than 1 distinct rows"), "{e}");
        let mut bad = attrs(1);
        bad[2] = ("shard", AttrValue::Int(2));
        let e = run_kernel("EmbeddingShardRows", &bad, &[i64s(&[0])]).unwrap_err();
        assert!(e.contains("shard 2"), "{e}");
    }

    /// The sharded path equals Gather on the whole table, and its gradients equal Gather's
    /// dense gradient, for both strategies.
    #[test]
    fn shards_stitched_equal_gather_and_gradients_match() {
        let vocab = 13usize;
        let d = 3usize;
        let table: Vec<f64> = (0..vocab * d).map(|i| i as f64 * 0.5 - 3.0).collect();
        let ids = [4i64, 11, 4, 0, 12, 5, 11, 4];
        let dy: Vec<f64> = (0..ids.len() * d).map(|i| (i as f64).sin()).collect();
        for strategy in ["mod", "div"] {
            let p = EmbeddingPartition::new(13, 3, strategy.parse().unwrap()).unwrap();
            let mut stitch_inputs = vec![i64s(&ids)];
            let mut dense_grad = vec![0.0f64; vocab * d];
            for s in 0..3 {
                let rows = p.rows(s).unwrap();
                let part: Vec<f64> = rows
                    .ids()
                    .flat_map(|id| table[id as usize * d..(id as usize + 1) * d].to_vec())
                    .collect();
                let part = Tensor::from_slice(&[rows.count as usize, d], &part).unwrap();
                let (r, slots) = rows_of(&ids, 3, s as i64, strategy);
                let vals = run_kernel("EmbeddingShardGather", &[], &[part.clone(), i64s(&r)])
                    .unwrap()
                    .remove(0);
                // The shard's gradient: stitch grad then scatter.
                let dvals = run_kernel(
                    "EmbeddingShardStitchGrad",
                    &[],
                    &[
                        i64s(&slots),
                        Tensor::from_slice(&[ids.len(), d], &dy).unwrap(),
                        vals.clone(),
                    ],
                )
                .unwrap()
                .remove(0);
                let dpart = run_kernel("EmbeddingShardScatter", &[], &[i64s(&r), dvals, part])
                    .unwrap()
                    .remove(0);
                for (local, id) in rows.ids().enumerate() {
                    let g = &dpart.as_slice::<f64>().unwrap()[local * d..(local + 1) * d];
                    dense_grad[id as usize * d..(id as usize + 1) * d].copy_from_slice(g);
                }
                stitch_inputs.push(i64s(&slots));
                stitch_inputs.push(vals);
            }
            let out = run_kernel("EmbeddingShardStitch", &[], &stitch_inputs)
                .unwrap()
                .remove(0);
            let table_t = Tensor::from_slice(&[vocab, d], &table).unwrap();
            let want = run_kernel("Gather", &[], &[table_t.clone(), i64s(&ids)])
                .unwrap()
                .remove(0);
            assert_eq!(out.dims(), want.dims());
            assert_eq!(
                out.as_slice::<f64>().unwrap(),
                want.as_slice::<f64>().unwrap()
            );
            // Gather's dense gradient: scatter-add of dy at ids.
            let mut want_grad = vec![0.0f64; vocab * d];
            for (k, &id) in ids.iter().enumerate() {
                for j in 0..d {
                    want_grad[id as usize * d + j] += dy[k * d + j];
                }
            }
            for (a, b) in dense_grad.iter().zip(&want_grad) {
                assert!((a - b).abs() < 1e-12, "{strategy}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn padding_reads_zero_and_bad_rows_are_refused() {
        let part = Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let out = run_kernel("EmbeddingShardGather", &[], &[part.clone(), i64s(&[1, -1])])
            .unwrap()
            .remove(0);
        assert_eq!(out.as_slice::<f32>().unwrap(), [3.0, 4.0, 0.0, 0.0]);
        let e = run_kernel("EmbeddingShardGather", &[], &[part, i64s(&[2])]).unwrap_err();
        assert!(e.contains("row 2 at position 0"), "{e}");
    }
}
