//! Tensor parallelism's placement changes along any dimension, with the gradients a
//! *replicated* loss needs (every rank of the group computes the same loss, as Megatron-LM's
//! `f` and `g` in [`super::collective`] assume). With the placements of PyTorch DTensor —
//! `Shard(d)` (rank `r` holds the `r`-th of `group_size` equal slices along `d`), `Replicate`,
//! `Partial` (the value is the sum of the ranks' tensors) — each op turns one placement into
//! another, and each rank's gradient of a tensor is: its slice's gradient (`Shard`), the whole
//! gradient (`Replicate`, and `Partial`: the gradient of a term of a sum is the sum's):
//!
//! | op | forward | backward (the gradient) |
//! |----|---------|-------------------------|
//! | `CollectiveTpAllGather` | `Shard(axis)` → `Replicate`: all-gather along `axis` | `CollectiveTpSlice`: the rank's slice, no traffic |
//! | `CollectiveTpSlice` | `Replicate` → `Shard(axis)`: the rank's slice, no traffic | `CollectiveTpAllGather` |
//! | `CollectiveTpReduceScatter` | `Partial` → `Shard(axis)`: sum, each rank keeping its slice | `CollectiveTpAllGather` |
//! | `CollectiveTpAllToAll` | `Shard(concat_axis)` → `Shard(split_axis)` | the reverse all-to-all |
//!
//! (`CollectiveAllGather` keeps data parallelism's gradient, a sum reduce-scatter, which a
//! replicated loss would count `group_size` times.) The runtime's collectives work along
//! dimension 0; these kernels lay the slices out contiguously and back around them. A
//! gradient's collective runs in the same group under instance key
//! [`GRADIENT_INSTANCE_OFFSET`] + the forward one.

use super::collective::{Collective, GRADIENT_INSTANCE_OFFSET};
use super::*;
use crate::axis_split::AxisSplit;
use crate::kernel::{Collectives, Kernel, KernelContext, KernelInit, ReduceKind};

/// The four ops, as their kernels tell them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllGather { axis: usize },
    Slice { axis: usize },
    ReduceScatter { axis: usize },
    AllToAll { split: usize, concat: usize },
}

/// Equal slices along `axis` of a tensor of `len` there.
fn split(axis: usize, parts: usize, len: usize) -> AxisSplit {
    AxisSplit {
        axis,
        blocks: 1,
        parts,
        padded: len,
    }
}

/// Slice `r`…: the `parts` slices of `t` along `axis`, one after the other, as one vector
/// (what the runtime's collectives split along dimension 0).
fn slices_in_order(t: &Tensor, axis: usize, parts: usize) -> Result<Tensor, String> {
    if axis == 0 {
        // Already in that order: a view, no copy.
        return t.reshaped(&[t.num_elements()]).map_err(|e| e.to_string());
    }
    let s = split(axis, parts, t.dims()[axis]);
    let mut bytes = Vec::with_capacity(t.as_bytes().len());
    for r in 0..parts {
        bytes.extend_from_slice(s.shard(t, r)?.as_bytes());
    }
    Tensor::from_bytes(t.dtype(), &[t.num_elements()], &bytes).map_err(|e| e.to_string())
}

/// The inverse of [`slices_in_order`] for slices of `slice` dimensions: `flat` holds `parts`
/// such slices one after the other; they are joined along `axis`.
fn join_slices(
    flat: &Tensor,
    slice: &[usize],
    axis: usize,
    parts: usize,
) -> Result<Tensor, String> {
    if axis == 0 {
        // Slices along the first axis, one after the other, are the joined tensor: a view.
        let mut whole = slice.to_vec();
        whole[0] *= parts;
        return flat.reshaped(&whole).map_err(|e| e.to_string());
    }
    let size: usize = slice.iter().product::<usize>() * flat.dtype().size_of();
    let pieces = (0..parts)
        .map(|r| {
            let bytes = flat
                .as_bytes()
                .get(r * size..(r + 1) * size)
                .ok_or_else(|| format!("slice {r} of {slice:?} is outside the received data"))?;
            Tensor::from_bytes(flat.dtype(), slice, bytes).map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, String>>()?;
    let mut whole = slice.to_vec();
    whole[axis] *= parts;
    split(axis, parts, whole[axis]).assemble(&pieces, &whole)
}

/// Checks that `axis` exists in `dims` and, when `divides`, that its length divides by `n`.
fn check_axis(dims: &[usize], axis: usize, n: usize, divides: bool) -> Result<(), String> {
    let Some(&len) = dims.get(axis) else {
        return Err(format!("axis {axis} is outside a tensor of shape {dims:?}"));
    };
    if divides && len % n != 0 {
        return Err(format!(
            "dimension {axis} of shape {dims:?} is {len}, which does not split into {n} equal \
             parts (group_size)"
        ));
    }
    Ok(())
}

#[derive(Debug)]
struct TpKernel {
    base: Collective,
    kind: Kind,
    size: usize,
}

impl TpKernel {
    fn new(op: &'static str, init: &KernelInit<'_>) -> Result<TpKernel, OpError> {
        let int = |name: &str| -> Result<usize, OpError> {
            match init.attr(name)? {
                AttrValue::Int(v) => usize::try_from(*v)
                    .map_err(|_| format!("attribute `{name}` must be ≥ 0, got {v}").into()),
                v => Err(OpError::AttrType {
                    name: name.to_string(),
                    found: v.ty(),
                    expected: "int",
                }),
            }
        };
        let kind = match op {
            "CollectiveTpAllGather" => Kind::AllGather { axis: int("axis")? },
            "CollectiveTpSlice" => Kind::Slice { axis: int("axis")? },
            "CollectiveTpReduceScatter" => Kind::ReduceScatter { axis: int("axis")? },
            _ => Kind::AllToAll {
                split: int("split_axis")?,
                concat: int("concat_axis")?,
            },
        };
        let size = int("group_size")?;
        if size == 0 {
            return Err("group_size must be at least 1, got 0".to_string().into());
        }
        Ok(TpKernel {
            base: Collective::new(op, init)?,
            kind,
            size,
        })
    }

    fn apply(
        &self,
        c: &dyn Collectives,
        call: &crate::kernel::CollectiveCall<'_>,
        x: &Tensor,
    ) -> Result<Tensor, String> {
        let n = self.size;
        let (rank, size) = c.rank_and_size(call.group)?;
        if size != n {
            return Err(format!(
                "group `{}` has {size} ranks, the op was built for group_size {n}",
                call.group
            ));
        }
        let dims = x.dims();
        match self.kind {
            Kind::Slice { axis } => {
                check_axis(dims, axis, n, true)?;
                split(axis, n, dims[axis]).shard(x, rank)
            }
            Kind::AllGather { axis } => {
                check_axis(dims, axis, n, false)?;
                let flat = x.reshaped(&[x.num_elements()]).map_err(|e| e.to_string())?;
                let all = c.all_gather(call, &flat)?;
                join_slices(&all, dims, axis, n)
            }
            Kind::ReduceScatter { axis } => {
                check_axis(dims, axis, n, true)?;
                let mine =
                    c.reduce_scatter(call, &slices_in_order(x, axis, n)?, ReduceKind::Sum)?;
                let mut out = dims.to_vec();
                out[axis] /= n;
                mine.reshaped(&out).map_err(|e| e.to_string())
            }
            Kind::AllToAll {
                split: to,
                concat: from,
            } => {
                check_axis(dims, to, n, true)?;
                check_axis(dims, from, n, false)?;
                let got = c.all_to_all(call, &slices_in_order(x, to, n)?)?;
                let mut slice = dims.to_vec();
                slice[to] /= n;
                join_slices(&got, &slice, from, n)
            }
        }
    }
}

impl Kernel for TpKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        Ok(self.base.run(ctx, |c, call, x| self.apply(c, call, x))?)
    }
}

fn all_gather_kernel(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
    Ok(Box::new(TpKernel::new("CollectiveTpAllGather", init)?))
}
fn slice_kernel(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
    Ok(Box::new(TpKernel::new("CollectiveTpSlice", init)?))
}
fn reduce_scatter_kernel(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
    Ok(Box::new(TpKernel::new("CollectiveTpReduceScatter", init)?))
}
fn all_to_all_kernel(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
    Ok(Box::new(TpKernel::new("CollectiveTpAllToAll", init)?))
}

/// The shape rule: `times` multiplies dimension `grow` (if any), `shrink` is divided by the
/// group size (if any; a known length must divide).
fn reshaped(
    ctx: &InferCtx<'_>,
    grow: Option<&str>,
    shrink: Option<&str>,
) -> Result<Vec<TensorType>, OpError> {
    let t = ctx.input(0)?;
    let n = ctx.int("group_size")?;
    if n < 1 {
        return Err(format!("group_size must be at least 1, got {n}").into());
    }
    let n = n as usize;
    let axis = |name: &str| -> Result<usize, OpError> {
        let a = ctx.int(name)?;
        usize::try_from(a).map_err(|_| format!("attribute `{name}` must be ≥ 0, got {a}").into())
    };
    let grow = grow.map(axis).transpose()?;
    let shrink = shrink.map(axis).transpose()?;
    if grow.is_some() && grow == shrink {
        return Err("split_axis and concat_axis must differ".to_string().into());
    }
    let Some(dims) = t.shape.dims() else {
        return Ok(vec![TensorType::new(t.dtype, Shape::unknown())]);
    };
    let mut out = dims.to_vec();
    for a in grow.iter().chain(shrink.iter()) {
        if *a >= out.len() {
            return Err(format!("axis {a} is outside the input's shape {}", t.shape).into());
        }
    }
    if let Some(a) = grow {
        out[a] = out[a].map(|d| d * n);
    }
    if let Some(a) = shrink {
        if let Some(d) = out[a] {
            if d % n != 0 {
                return Err(format!(
                    "dimension {a} of {} is {d}, which does not split into group_size {n} equal \
                     parts",
                    t.shape
                )
                .into());
            }
            out[a] = Some(d / n);
        }
    }
    Ok(vec![TensorType::new(t.dtype, Shape::partial(out))])
}

pub(crate) fn register(r: &mut OpRegistry) {
    let [g, i, n] = [
        attr("group_key", AttrType::String),
        attr("instance_key", AttrType::Int),
        attr("group_size", AttrType::Int),
    ];
    let axis = attr("axis", AttrType::Int);
    r.add(
        OpDef::new(
            "CollectiveTpAllGather",
            "Tensor parallelism's Shard(axis) → Replicate: every rank of `group_key` gets the \
             ranks' inputs joined along `axis` in rank order; the gradient is the rank's slice \
             of the output's gradient (CollectiveTpSlice; the loss is replicated). In: input. \
             Out: output, `axis` group_size times as long.",
            |ctx| reshaped(ctx, Some("axis"), None),
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([g, i, n, axis])
        .cpu_kernel(all_gather_kernel)
        .stateful(),
    );
    r.add(
        OpDef::new(
            "CollectiveTpSlice",
            "Tensor parallelism's Replicate → Shard(axis): rank r keeps the r-th of group_size \
             equal slices along `axis`, with no traffic; the gradient is the all-gather of the \
             output's gradient (CollectiveTpAllGather). In: input. Out: output, `axis` cut in \
             group_size.",
            |ctx| reshaped(ctx, None, Some("axis")),
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([g, i, n, axis])
        .cpu_kernel(slice_kernel)
        .stateful(),
    );
    r.add(
        OpDef::new(
            "CollectiveTpReduceScatter",
            "Tensor parallelism's Partial → Shard(axis): rank r gets the r-th slice along \
             `axis` of the sum of the ranks' inputs; the gradient is the all-gather of the \
             output's gradient (CollectiveTpAllGather). In: input. Out: output, `axis` cut in \
             group_size.",
            |ctx| reshaped(ctx, None, Some("axis")),
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([g, i, n, axis])
        .cpu_kernel(reduce_scatter_kernel)
        .stateful(),
    );
    r.add(
        OpDef::new(
            "CollectiveTpAllToAll",
            "Tensor parallelism's Shard(concat_axis) → Shard(split_axis): rank r's input cut in \
             group_size slices along `split_axis`, slice q sent to rank q, the received slices \
             joined along `concat_axis`; the gradient is the reverse all-to-all. In: input. \
             Out: output, `split_axis` cut in group_size, `concat_axis` group_size times as \
             long.",
            |ctx| reshaped(ctx, Some("concat_axis"), Some("split_axis")),
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([
            g,
            i,
            n,
            attr("split_axis", AttrType::Int),
            attr("concat_axis", AttrType::Int),
        ])
        .cpu_kernel(all_to_all_kernel)
        .stateful(),
    );
}

/// The ops' gradients (see the module's table).
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("CollectiveTpAllGather", |b, f, dys| {
            along(b, f, dys, "CollectiveTpSlice", "tp_slice")
        });
        r.set_gradient("CollectiveTpSlice", |b, f, dys| {
            along(b, f, dys, "CollectiveTpAllGather", "tp_all_gather")
        });
        r.set_gradient("CollectiveTpReduceScatter", |b, f, dys| {
            along(b, f, dys, "CollectiveTpAllGather", "tp_all_gather")
        });
        r.set_gradient("CollectiveTpAllToAll", all_to_all_grad);
    }

    /// The group, the gradient's instance key and the group size of forward node `f`.
    fn keys(f: &ForwardNode) -> Result<Vec<(&'static str, AttrValue)>, String> {
        let instance = match f.attr("instance_key")? {
            AttrValue::Int(v) => v.checked_add(GRADIENT_INSTANCE_OFFSET).ok_or_else(|| {
                format!("instance_key {v} is too large to key a gradient collective")
            })?,
            v => return Err(format!("attribute `instance_key` is {}, not int", v.ty())),
        };
        Ok(vec![
            ("group_key", f.attr("group_key")?.clone()),
            ("instance_key", AttrValue::Int(instance)),
            ("group_size", f.attr("group_size")?.clone()),
        ])
    }

    /// `op` along the forward node's `axis` on the output's gradient.
    fn along(
        b: &mut GradBuilder,
        f: &ForwardNode,
        dys: &[Option<Output>],
        op: &str,
        suffix: &str,
    ) -> GradResult {
        let dy = only_dy(dys)?;
        let mut attrs = keys(f)?;
        attrs.push(("axis", f.attr("axis")?.clone()));
        Ok(vec![Some(b.op(op, suffix, &[dy], &attrs))])
    }

    /// Slice q of rank r's input along `split_axis` became slice r of rank q's output along
    /// `concat_axis`; the gradient goes back the same way: the all-to-all with the axes swapped.
    fn all_to_all_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let mut attrs = keys(f)?;
        attrs.push(("split_axis", f.attr("concat_axis")?.clone()));
        attrs.push(("concat_axis", f.attr("split_axis")?.clone()));
        Ok(vec![Some(b.op(
            "CollectiveTpAllToAll",
            "tp_all_to_all",
            &[dy],
            &attrs,
        ))])
    }
}
