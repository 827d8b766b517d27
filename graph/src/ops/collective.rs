//! Collective ops: all-reduce, all-gather, reduce-scatter, broadcast and all-to-all over a group
//! of ranks, plus the flat packing ops the all-reduce strategy fuses gradients with.
//!
//! A collective op names its group (`group_key`) and its instance (`instance_key`): every rank
//! of the group runs a node with the same instance key, and the runtime matches the ranks'
//! calls by it (checking dtype, shape and op: a mismatch fails on every rank). The kernels call
//! the [`Collectives`](crate::kernel::Collectives) the runtime passes in
//! [`KernelContext::collectives`]; outside a runtime that joined the group they fail with a
//! message saying so. The ops are placed like any other op. The all-reduce strategy inserts
//! its collectives after the backward pass; the expert strategy puts all-to-alls and
//! all-gathers in the forward pass, so those two have gradients (see [`gradients`]): the
//! gradient of an all-to-all is the all-to-all of the output's gradient (the exchange is a
//! permutation of the ranks' blocks, and its own inverse), and the gradient of an all-gather is
//! the sum reduce-scatter of the output's gradient. A gradient's collective runs in the same
//! group with instance key [`GRADIENT_INSTANCE_OFFSET`] + the forward one.
//!
//! Tensor parallelism (Megatron-LM) needs two more, whose gradients are not the ones a
//! data-parallel sum of per-rank losses would give, because every rank computes the *same*
//! (replicated) loss: `CollectiveTpCopy` is Megatron's `f` (identity forward, all-reduce of the
//! gradient backward: each rank's shard of a column-parallel layer contributes part of the
//! input's gradient) and `CollectiveTpReduce` is its `g` (sum all-reduce forward, identity
//! backward: the replicated consumers each hand back the whole gradient of the sum, which is
//! every rank's partial term's gradient as is). The other placement changes of tensor
//! parallelism (all-gather, slice, reduce-scatter and all-to-all along any dimension) are in
//! [`super::collective_tp`].

use super::*;
use crate::kernel::{CollectiveCall, Kernel, KernelContext, KernelInit, ReduceKind};

/// Added to a forward collective's `instance_key` to key its gradient's collective.
pub const GRADIENT_INSTANCE_OFFSET: i64 = 1 << 40;

fn collective_attrs() -> [AttrDef; 2] {
    [
        attr("group_key", AttrType::String),
        attr("instance_key", AttrType::Int),
    ]
}

/// The shape of one of `size` equal parts of `t` along dimension 0.
fn split_dim0(op: &str, t: &TensorType, size: i64) -> Result<Shape, String> {
    if size < 1 {
        return Err(format!("{op}: group_size must be at least 1, got {size}"));
    }
    let Some(dims) = t.shape.dims() else {
        return Ok(Shape::unknown());
    };
    let Some(first) = dims.first() else {
        return Err(format!("{op}: the input must have rank ≥ 1, got a scalar"));
    };
    let mut out = dims.to_vec();
    if let Some(d0) = first {
        if d0 % size as usize != 0 {
            return Err(format!(
                "{op}: dimension 0 ({d0}) does not split into group_size {size} equal parts"
            ));
        }
        out[0] = Some(d0 / size as usize);
    }
    Ok(Shape::partial(out))
}

/// What every collective kernel knows from its node.
#[derive(Debug)]
pub(super) struct Collective {
    op: &'static str,
    group: String,
    instance: i64,
    reduce: ReduceKind,
    root: usize,
}

impl Collective {
    pub(super) fn new(op: &'static str, init: &KernelInit<'_>) -> Result<Collective, String> {
        let string = |name: &str| match init.attr(name)? {
            AttrValue::String(s) => Ok(s.to_string()),
            v => Err(format!("attribute `{name}` is {}, not string", v.ty())),
        };
        let int = |name: &str| match init.attr(name) {
            Ok(AttrValue::Int(v)) => Ok(Some(*v)),
            Ok(v) => Err(format!("attribute `{name}` is {}, not int", v.ty())),
            Err(_) => Ok(None),
        };
        let reduce = match init.attrs.get("reduce") {
            Some(AttrValue::String(s)) => ReduceKind::parse(s)?,
            _ => ReduceKind::Sum,
        };
        let root = int("root")?.unwrap_or(0);
        Ok(Collective {
            op,
            group: string("group_key")?,
            instance: int("instance_key")?.unwrap_or(0),
            reduce,
            root: usize::try_from(root).map_err(|_| format!("root must be ≥ 0, got {root}"))?,
        })
    }

    pub(super) fn run(
        &self,
        ctx: &mut KernelContext<'_>,
        f: impl FnOnce(
            &dyn crate::kernel::Collectives,
            &CollectiveCall<'_>,
            &Tensor,
        ) -> Result<Tensor, String>,
    ) -> Result<(), String> {
        let Some(c) = ctx.collectives else {
            return Err(format!(
                "{}: no collective runtime here: run the graph in a distributed job whose tasks joined group `{}`",
                self.op, self.group
            ));
        };
        let call = CollectiveCall {
            group: &self.group,
            instance: self.instance,
            step: ctx.step,
            node: ctx.node,
        };
        let out = f(c, &call, ctx.input(0)?)?;
        Ok(ctx.set_output(0, out)?)
    }
}

macro_rules! collective_kernel {
    ($name:ident, $op:literal, |$c:ident, $call:ident, $x:ident, $k:ident| $body:expr) => {
        #[derive(Debug)]
        struct $name(Collective);

        impl Kernel for $name {
            fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
                let $k = &self.0;
                Ok($k.run(ctx, |$c, $call, $x| $body)?)
            }
        }

        impl $name {
            fn factory(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
                Ok(Box::new($name(Collective::new($op, init)?)))
            }
        }
    };
}

collective_kernel!(AllReduceKernel, "CollectiveAllReduce", |c, call, x, k| c
    .all_reduce(call, x, k.reduce));
collective_kernel!(AllGatherKernel, "CollectiveAllGather", |c, call, x, _k| c
    .all_gather(call, x));
collective_kernel!(
    ReduceScatterKernel,
    "CollectiveReduceScatter",
    |c, call, x, k| c.reduce_scatter(call, x, k.reduce)
);
collective_kernel!(BroadcastKernel, "CollectiveBroadcast", |c, call, x, k| c
    .broadcast(call, x, k.root));
collective_kernel!(AllToAllKernel, "CollectiveAllToAll", |c, call, x, _k| c
    .all_to_all(call, x));

collective_kernel!(TpReduceKernel, "CollectiveTpReduce", |c, call, x, _k| c
    .all_reduce(call, x, ReduceKind::Sum));

fn tp_copy(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let x = ctx.input(0)?.clone();
    ctx.set_output(0, x)
}

fn reduce_attr() -> AttrDef {
    attr_or("reduce", AttrType::String, AttrDefault::Str("sum"))
}

fn check_reduce(ctx: &InferCtx<'_>) -> Result<(), String> {
    match ctx.attrs.get("reduce") {
        Some(AttrValue::String(s)) => ReduceKind::parse(s).map(|_| ()),
        _ => Ok(()),
    }
}

pub(crate) fn register(r: &mut OpRegistry) {
    let [g, i] = collective_attrs();
    r.add(
        OpDef::new(
            "CollectiveAllReduce",
            "Every rank of `group_key` gets the element-wise `reduce` (sum, prod, min, max, avg) \
             of all ranks' input. In: input. Out: output, same type.",
            |ctx| {
                check_reduce(ctx)?;
                same_as_input(ctx)
            },
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([g, i, reduce_attr()])
        .cpu_kernel(AllReduceKernel::factory)
        .stateful(),
    );
    r.add(
        OpDef::new(
            "CollectiveAllGather",
            "Every rank gets the ranks' inputs concatenated along dimension 0 in rank order. In: \
             input [d0, ...]. Out: output [group_size·d0, ...].",
            |ctx| {
                let t = ctx.input(0)?;
                let n = ctx.int("group_size")?;
                if n < 1 {
                    return Err(format!("group_size must be at least 1, got {n}").into());
                }
                let shape = match t.shape.dims() {
                    None => Shape::unknown(),
                    Some([]) => return Err("the input must have rank ≥ 1, got a scalar".into()),
                    Some(dims) => {
                        let mut out = dims.to_vec();
                        out[0] = out[0].map(|d| d * n as usize);
                        Shape::partial(out)
                    }
                };
                Ok(vec![TensorType::new(t.dtype, shape)])
            },
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([g, i, attr("group_size", AttrType::Int)])
        .cpu_kernel(AllGatherKernel::factory)
        .stateful(),
    );
    r.add(
        OpDef::new(
            "CollectiveReduceScatter",
            "Rank r gets part r (dimension 0 split into group_size equal parts) of the \
             element-wise `reduce` of all ranks' input. In: input [group_size·k, ...]. Out: \
             output [k, ...].",
            |ctx| {
                check_reduce(ctx)?;
                let t = ctx.input(0)?;
                let shape = split_dim0("CollectiveReduceScatter", t, ctx.int("group_size")?)?;
                Ok(vec![TensorType::new(t.dtype, shape)])
            },
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([g, i, attr("group_size", AttrType::Int), reduce_attr()])
        .cpu_kernel(ReduceScatterKernel::factory)
        .stateful(),
    );
    r.add(
        OpDef::new(
            "CollectiveBroadcast",
            "Every rank gets rank `root`'s input (the other ranks' inputs only give the type). \
             In: input. Out: output, same type.",
            |ctx| {
                let root = ctx.int("root")?;
                if root < 0 {
                    return Err(format!("root must be ≥ 0, got {root}").into());
                }
                same_as_input(ctx)
            },
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([g, i, attr_or("root", AttrType::Int, AttrDefault::Int(0))])
        .cpu_kernel(BroadcastKernel::factory)
        .stateful(),
    );
    r.add(
        OpDef::new(
            "CollectiveAllToAll",
            "Part j (dimension 0 split into group_size equal parts) of rank i's input becomes \
             part i of rank j's output. In: input [group_size·k, ...]. Out: output, same type.",
            |ctx| {
                let t = ctx.input(0)?;
                split_dim0("CollectiveAllToAll", t, ctx.int("group_size")?)?;
                same_as_input(ctx)
            },
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([g, i, attr("group_size", AttrType::Int)])
        .cpu_kernel(AllToAllKernel::factory)
        .stateful(),
    );
    r.add(
        OpDef::new(
            "CollectiveTpCopy",
            "Tensor parallelism's `f`: the input as is; its gradient is the sum all-reduce of \
             the output's gradient over `group_key` (the input feeds a layer whose weights are \
             sharded over the group). In: input. Out: output, same type.",
            same_as_input,
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([g, i])
        .cpu_kernel(|_| super::elementwise::stateless(tp_copy)),
    );
    r.add(
        OpDef::new(
            "CollectiveTpReduce",
            "Tensor parallelism's `g`: the sum over the ranks of `group_key` of their inputs \
             (partial sums of a row-parallel layer); its gradient is the output's gradient as \
             is (every rank's consumers are replicated). In: input. Out: output, same type.",
            same_as_input,
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .attrs([g, i])
        .cpu_kernel(TpReduceKernel::factory)
        .stateful(),
    );
    r.add(
        OpDef::new(
            "PackFlat",
            "Concatenates its inputs, flattened, into one vector (fuses tensors for one \
             collective). In: inputs (variadic, same dtype, static shapes). Out: flat \
             [total elements].",
            |ctx| {
                let first = ctx.input(0)?;
                let mut total = 0usize;
                for (k, t) in ctx.inputs.iter().enumerate() {
                    if t.dtype != first.dtype {
                        return Err(format!(
                            "inputs[{k}] is {t} but inputs[0] is {first}; all inputs must share a dtype"
                        ).into());
                    }
                    total += t.shape.num_elements().ok_or_else(|| {
                        format!("inputs[{k}] has shape {}, which is not fully known", t.shape)
                    })?;
                }
                Ok(vec![TensorType::new(first.dtype, Shape::known(&[total]))])
            },
        )
        .inputs([variadic("inputs")])
        .outputs([arg("flat")])
        .cpu_kernel(|_| super::elementwise::stateless(pack_flat)),
    );
    r.add(
        OpDef::new(
            "FlatSlice",
            "The elements [offset, offset + product(shape)) of a vector, as a tensor of `shape` \
             (undoes PackFlat). In: flat [n]. Out: output of `shape`.",
            |ctx| {
                let t = ctx.input(0)?;
                let shape = ctx.shape("shape")?;
                let n = shape
                    .num_elements()
                    .ok_or_else(|| format!("attribute `shape` {shape} is not fully known"))?;
                let offset = ctx.int("offset")?;
                if offset < 0 {
                    return Err(format!("offset must be ≥ 0, got {offset}").into());
                }
                if let Some(len) = t.shape.num_elements() {
                    if offset as usize + n > len {
                        return Err(format!(
                            "elements [{offset}, {}) are outside the input's {len}",
                            offset as usize + n
                        )
                        .into());
                    }
                }
                Ok(vec![TensorType::new(t.dtype, shape.clone())])
            },
        )
        .inputs([arg("flat")])
        .outputs([arg("output")])
        .attrs([
            attr("offset", AttrType::Int),
            attr("shape", AttrType::Shape),
        ])
        .cpu_kernel(flat_slice_kernel),
    );
}

fn pack_flat(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let first = ctx.input(0)?;
    let dtype = first.dtype();
    let total: usize = ctx.inputs.iter().map(|t| t.num_elements()).sum();
    let mut bytes = Vec::with_capacity(total * dtype.size_of());
    for (k, t) in ctx.inputs.iter().enumerate() {
        if t.dtype() != dtype {
            return Err(format!("inputs[{k}] is {}, inputs[0] is {dtype}", t.dtype()).into());
        }
        bytes.extend_from_slice(t.as_bytes());
    }
    let out = Tensor::from_bytes(dtype, &[total], &bytes).map_err(|e| e.to_string())?;
    ctx.set_output(0, out)
}

#[derive(Debug)]
struct FlatSlice {
    offset: usize,
    dims: Vec<usize>,
}

fn flat_slice_kernel(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
    let offset = match init.attr("offset")? {
        AttrValue::Int(v) => usize::try_from(*v).map_err(|_| format!("offset {v} < 0"))?,
        v => return Err(format!("attribute `offset` is {}, not int", v.ty()).into()),
    };
    let dims = match init.attr("shape")? {
        AttrValue::Shape(s) => s
            .as_static()
            .ok_or_else(|| format!("attribute `shape` {s} is not fully known"))?,
        v => return Err(format!("attribute `shape` is {}, not shape", v.ty()).into()),
    };
    Ok(Box::new(FlatSlice { offset, dims }))
}

impl Kernel for FlatSlice {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let flat = ctx.input(0)?;
        let size = flat.dtype().size_of();
        let n: usize = self.dims.iter().product();
        if self.offset == 0 && n == flat.num_elements() {
            // The whole input: its buffer under the new shape (a gathered parameter with no
            // padding is not copied).
            let out = flat.reshaped(&self.dims).map_err(|e| e.to_string())?;
            return ctx.set_output(0, out);
        }
        let (start, end) = (self.offset * size, (self.offset + n) * size);
        let bytes = flat.as_bytes().get(start..end).ok_or_else(|| {
            format!(
                "elements [{}, {}) are outside the input's {}",
                self.offset,
                self.offset + n,
                flat.num_elements()
            )
        })?;
        let out = Tensor::from_bytes(flat.dtype(), &self.dims, bytes).map_err(|e| e.to_string())?;
        ctx.set_output(0, out)
    }
}

// ---- gradients ----

/// Gradients of the collectives that run in a forward pass: all-to-all and all-gather.
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("CollectiveAllToAll", all_to_all_grad);
        r.set_gradient("CollectiveAllGather", all_gather_grad);
        r.set_gradient("CollectiveTpCopy", tp_copy_grad);
        r.set_gradient("CollectiveTpReduce", |_, _, dys| {
            Ok(vec![Some(only_dy(dys)?.clone())])
        });
    }

    /// Megatron's `f` backward: the sum all-reduce of the output's gradient.
    fn tp_copy_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let instance = match f.attr("instance_key")? {
            AttrValue::Int(v) => v.checked_add(GRADIENT_INSTANCE_OFFSET).ok_or_else(|| {
                format!("instance_key {v} is too large to key a gradient collective")
            })?,
            v => return Err(format!("attribute `instance_key` is {}, not int", v.ty())),
        };
        let dx = b.op(
            "CollectiveAllReduce",
            "tp_all_reduce",
            &[dy],
            &[
                ("group_key", f.attr("group_key")?.clone()),
                ("instance_key", AttrValue::Int(instance)),
                ("reduce", AttrValue::String("sum".into())),
            ],
        );
        Ok(vec![Some(dx)])
    }

    /// The group, the gradient's instance key and the group size of a forward collective.
    fn keys(f: &ForwardNode) -> Result<[(&'static str, AttrValue); 3], String> {
        let instance = match f.attr("instance_key")? {
            AttrValue::Int(v) => v.checked_add(GRADIENT_INSTANCE_OFFSET).ok_or_else(|| {
                format!("instance_key {v} is too large to key a gradient collective")
            })?,
            v => return Err(format!("attribute `instance_key` is {}, not int", v.ty())),
        };
        Ok([
            ("group_key", f.attr("group_key")?.clone()),
            ("instance_key", AttrValue::Int(instance)),
            ("group_size", f.attr("group_size")?.clone()),
        ])
    }

    /// Block j of rank i's input became block i of rank j's output, so block i of rank j's
    /// output gradient goes back to block j of rank i's input gradient: the same exchange.
    fn all_to_all_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let keys = keys(f)?;
        let dx = b.op("CollectiveAllToAll", "all_to_all", &[dy], &keys);
        Ok(vec![Some(dx)])
    }

    /// Every rank's output holds every rank's input, so rank r's input gradient is the sum over
    /// ranks of block r of their output gradients: a sum reduce-scatter.
    fn all_gather_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let [g, i, n] = keys(f)?;
        let dx = b.op(
            "CollectiveReduceScatter",
            "reduce_scatter",
            &[dy],
            &[g, i, n, ("reduce", AttrValue::String("sum".into()))],
        );
        Ok(vec![Some(dx)])
    }
}

#[cfg(test)]
mod tests {
    use crate::ops::testing::run_kernel;
    use crate::{AttrValue, Shape, Tensor};

    #[test]
    fn pack_then_slice_round_trips() {
        let a = Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let b = Tensor::from_slice(&[3], &[5.0f32, 6.0, 7.0]).unwrap();
        let flat = run_kernel("PackFlat", &[], &[a.clone(), b.clone()])
            .unwrap()
            .remove(0);
        assert_eq!(flat.dims(), &[7]);
        let back = run_kernel(
            "FlatSlice",
            &[
                ("offset", AttrValue::Int(4)),
                ("shape", AttrValue::Shape(Shape::known(&[3]))),
            ],
            std::slice::from_ref(&flat),
        )
        .unwrap()
        .remove(0);
        assert_eq!(
            back.as_slice::<f32>().unwrap(),
            b.as_slice::<f32>().unwrap()
        );
        let err = run_kernel(
            "FlatSlice",
            &[
                ("offset", AttrValue::Int(5)),
                ("shape", AttrValue::Shape(Shape::known(&[3]))),
            ],
            &[flat],
        )
        .unwrap_err();
        assert!(err.contains("outside"), "{err}");
    }

    #[test]
    fn a_slice_of_the_whole_input_shares_its_buffer() {
        let flat = Tensor::from_slice(&[6], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let whole = run_kernel(
            "FlatSlice",
            &[
                ("offset", AttrValue::Int(0)),
                ("shape", AttrValue::Shape(Shape::known(&[2, 3]))),
            ],
            std::slice::from_ref(&flat),
        )
        .unwrap()
        .remove(0);
        assert_eq!(whole.dims(), &[2, 3]);
        assert_eq!(whole.data_ptr(), flat.data_ptr());
        assert_eq!(
            whole.as_slice::<f32>().unwrap(),
            flat.as_slice::<f32>().unwrap()
        );
    }

    #[test]
    fn collectives_without_a_runtime_fail_naming_the_group() {
        let x = Tensor::from_slice(&[2], &[1.0f32, 2.0]).unwrap();
        let err = run_kernel(
            "CollectiveAllReduce",
            &[
                ("group_key", AttrValue::String("workers".into())),
                ("instance_key", AttrValue::Int(1)),
            ],
            &[x],
        )
        .unwrap_err();
        assert!(err.contains("group `workers`"), "{err}");
    }

    #[test]
    fn all_to_all_and_all_gather_differentiate_into_collectives_keyed_apart() {
        use crate::autodiff::gradients;
        use crate::builder::GraphBuilder;
        use crate::DType;
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 3]);
        let a = b
            .op("CollectiveAllToAll", "a2a")
            .input(&x)
            .attr("group_key", "workers")
            .attr("instance_key", 7i64)
            .attr("group_size", 2i64)
            .finish();
        let g = b
            .op("CollectiveAllGather", "gather")
            .input(&a)
            .attr("group_key", "workers")
            .attr("instance_key", 8i64)
            .attr("group_size", 2i64)
            .finish();
        b.op("Sum", "loss").input(&g).finish();
        let (def, grads) = gradients(&b.to_def(), "loss", &["x"]).unwrap();
        let node = |op: &str| {
            def.nodes
                .iter()
                .find(|n| n.op == op && n.name.starts_with("gradients"))
                .unwrap()
        };
        let rs = node("CollectiveReduceScatter");
        assert_eq!(
            rs.attrs["instance_key"],
            AttrValue::Int(8 + super::GRADIENT_INSTANCE_OFFSET)
        );
        assert_eq!(rs.attrs["reduce"], AttrValue::String("sum".into()));
        assert_eq!(rs.attrs["group_size"], AttrValue::Int(2));
        let back = def.nodes.iter().find(|n| n.name == grads[0].node).unwrap();
        assert_eq!(back.op, "CollectiveAllToAll");
        assert_eq!(
            back.attrs["instance_key"],
            AttrValue::Int(7 + super::GRADIENT_INSTANCE_OFFSET)
        );
        assert_eq!(back.attrs["group_key"], AttrValue::String("workers".into()));
        assert_eq!(back.inputs, vec![rs.name.clone()]);
        // The backward pass validates: shapes of [4, 3] on the way back.
        let typed = crate::Graph::from_def(&def).unwrap();
        let t = typed
            .output_type(typed.find(&back.name).unwrap(), 0)
            .unwrap();
        assert_eq!(t.shape, Shape::known(&[4, 3]));
    }

    #[test]
    fn megatron_f_all_reduces_its_gradient_and_g_passes_it_through() {
        use crate::autodiff::gradients;
        use crate::builder::GraphBuilder;
        use crate::DType;
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[2, 3]);
        let f = b
            .op("CollectiveTpCopy", "f")
            .input(&x)
            .attr("group_key", "tp")
            .attr("instance_key", 3i64)
            .finish();
        let sq = b.binary("Mul", "sq", &f, &f);
        let g = b
            .op("CollectiveTpReduce", "g")
            .input(&sq)
            .attr("group_key", "tp")
            .attr("instance_key", 4i64)
            .finish();
        b.op("Sum", "loss").input(&g).finish();
        let (def, grads) = gradients(&b.to_def(), "loss", &["x"]).unwrap();
        // dx is the all-reduce (keyed apart) of 2·x·dy, and dy reached Mul unreduced.
        let back = def.nodes.iter().find(|n| n.name == grads[0].node).unwrap();
        assert_eq!(back.op, "CollectiveAllReduce");
        assert_eq!(back.attrs["group_key"], AttrValue::String("tp".into()));
        assert_eq!(
            back.attrs["instance_key"],
            AttrValue::Int(3 + super::GRADIENT_INSTANCE_OFFSET)
        );
        let all_reduces = def
            .nodes
            .iter()
            .filter(|n| n.op.starts_with("Collective") && n.name.starts_with("gradients"))
            .count();
        assert_eq!(all_reduces, 1, "g's gradient is no collective");
        crate::Graph::from_def(&def).unwrap();
        // f's forward is the identity.
        let t = Tensor::from_slice(&[2], &[1.0f32, -2.0]).unwrap();
        let out = run_kernel(
            "CollectiveTpCopy",
            &[
                ("group_key", AttrValue::String("tp".into())),
                ("instance_key", AttrValue::Int(1)),
            ],
            std::slice::from_ref(&t),
        )
        .unwrap();
        assert_eq!(out[0], t);
        // StopGradient: identity forward, nothing back.
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[2]);
        let s = b.op("StopGradient", "s").input(&x).finish();
        let y = b.binary("Mul", "y", &s, &x);
        b.op("Sum", "loss").input(&y).finish();
        let (def, grads) = gradients(&b.to_def(), "loss", &["x"]).unwrap();
        let dx = def.nodes.iter().find(|n| n.name == grads[0].node).unwrap();
        // Only Mul's second input gets a gradient: dy · s, no sum of two paths.
        assert_ne!(dx.op, "AddN");
        assert_ne!(dx.op, "Add");
    }
}
