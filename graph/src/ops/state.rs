//! Sources, sinks and state: Const, Placeholder, Variable, Identity, NoOp, and ReadVariable /
//! Assign (read and overwrite a variable through a reference input, after whatever their control
//! inputs order them behind: the sharded-optimizer rewrite reads a variable after its update).

use super::elementwise::stateless;
use super::init::{initial_value_with_stddev, tf_random_value, Initializer};
use super::*;
use crate::axis_split::AxisSplit;
use crate::kernel::{Kernel, KernelContext, KernelInit};

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(
        OpDef::new(
            "Const",
            "A constant tensor given by its `value` attribute.",
            |ctx| {
                let t = ctx.tensor("value")?;
                Ok(vec![TensorType::new(t.dtype(), t.shape())])
            },
        )
        .outputs([arg("output")])
        .attrs([attr("value", AttrType::Tensor)])
        .cpu_kernel(const_factory),
    );
    r.add(
        OpDef::new(
            "Placeholder",
            "A value fed by the client at each step.",
            |ctx| {
                Ok(vec![TensorType::new(
                    ctx.dtype("dtype")?,
                    ctx.shape("shape")?.clone(),
                )])
            },
        )
        .outputs([arg("output")])
        .attrs([
            attr("dtype", AttrType::DType),
            attr_or("shape", AttrType::Shape, AttrDefault::UnknownShape),
        ])
        .cpu_kernel(|_| stateless(placeholder_kernel)),
    );
    r.add(
        OpDef::new(
            "Variable",
            "Trainable state that persists across steps; its output is the current value. With \
             `shard_of` set, the variable is rows [shard_offset, shard_offset + shape[0]) of a \
             variable of shape `shard_of` named `shard_name` and its initial value is that \
             slice of the bigger variable's (the expert strategy keeps each worker's experts \
             this way). With `initial_value` (a tensor of the variable's dtype and shape, or of \
             `shard_of` for a shard) the variable starts from exactly those values and \
             `initializer` is not used (TensorFlow imports carry their initializers' values \
             this way). With `shard_flat` also set, the variable is the vector of elements \
             [shard_offset, shard_offset + shape[0]) of the flattened bigger variable padded \
             with zeros past its end (ZeRO-3 keeps each rank's parameter shard this way). With \
             `shard_parts` > 0, the variable is instead shard `shard_index` of \
             `shard_of` cut along `shard_axis` into `shard_parts` parts, the axis taken as \
             `shard_blocks` blocks cut separately and padded with zeros to `shard_padded` (0: no \
             padding) — see `axis_split` (tensor parallelism keeps its weights this way); with \
             `shard_flat` also set, the variable is then the vector of elements \
             [shard_offset, shard_offset + shape[0]) of that shard flattened and padded with \
             zeros (ZeRO-3 beside tensor parallelism). With \
             `shard_stride` k > 1 a row shard holds rows shard_offset, shard_offset + k, ... (a \
             `mod`-partitioned embedding shard). `partition_strategy` (`mod` or `div`) marks an \
             embedding table that the ps strategy shards over the ps tasks.",
            |ctx| {
                let shape = ctx.shape("shape")?;
                let Some(dims) = shape.as_static() else {
                    return Err(format!("variable shape {shape} must be fully known").into());
                };
                let shard = shard_init(&dims, ctx.attrs)?;
                let dtype = ctx.dtype("dtype")?;
                let whole = shard.as_ref().map_or(dims.as_slice(), ShardInit::whole);
                check_initial_value(ctx.attrs.get("initial_value"), dtype, whole)?;
                match ctx.attrs.get("partition_strategy") {
                    None => {}
                    Some(AttrValue::String(s)) if s.is_empty() => {}
                    Some(AttrValue::String(s)) => {
                        s.parse::<crate::embedding_partition::PartitionStrategy>()?;
                        if dims.len() < 2 {
                            return Err(format!(
                                "a partitioned embedding table must have rank >= 2 ([rows, d..]), got shape {shape}"
                            ).into());
                        }
                    }
                    Some(v) => {
                        return Err(format!(
                            "attribute `partition_strategy` is {}, not string",
                            v.ty()
                        ).into())
                    }
                }
                Ok(vec![TensorType::new(dtype, shape.clone())])
            },
        )
        .outputs([arg("ref")])
        .attrs([
            attr("dtype", AttrType::DType),
            attr("shape", AttrType::Shape),
            attr_or("initializer", AttrType::String, AttrDefault::Str("zeros")),
            attr_or("init_value", AttrType::Float, AttrDefault::Float(0.0)),
            attr_or("seed", AttrType::Int, AttrDefault::Int(0)),
            attr_or(
                "stddev",
                AttrType::Float,
                AttrDefault::Float(super::init::DEFAULT_STDDEV),
            ),
            attr_or("shard_of", AttrType::Shape, AttrDefault::UnknownShape),
            attr_or("shard_offset", AttrType::Int, AttrDefault::Int(0)),
            attr_or("shard_name", AttrType::String, AttrDefault::Str("")),
            attr_or("shard_axis", AttrType::Int, AttrDefault::Int(0)),
            attr_or("shard_blocks", AttrType::Int, AttrDefault::Int(1)),
            attr_or("shard_parts", AttrType::Int, AttrDefault::Int(0)),
            attr_or("shard_index", AttrType::Int, AttrDefault::Int(0)),
            attr_or("shard_padded", AttrType::Int, AttrDefault::Int(0)),
            attr_or("initial_value", AttrType::Tensor, AttrDefault::Unset),
            attr_or("seed2", AttrType::Int, AttrDefault::Int(0)),
            attr_or("init_scale", AttrType::Float, AttrDefault::Float(1.0)),
            attr_or("shard_flat", AttrType::Bool, AttrDefault::Bool(false)),
            attr_or("shard_stride", AttrType::Int, AttrDefault::Int(1)),
            attr_or("partition_strategy", AttrType::String, AttrDefault::Str("")),
        ])
        .variable()
        .cpu_kernel(variable_factory),
    );
    r.add(
        OpDef::new(
            "ReadVariable",
            "The variable's value when this node runs (a `Variable` node's output is its value \
             when that node ran, at the start of the step). In: var (reference to a Variable). \
             Out: value.",
            same_as_input,
        )
        .inputs([ref_arg("var")])
        .outputs([arg("value")])
        .stateful()
        .cpu_kernel(|_| stateless(read_variable_kernel)),
    );
    r.add(
        OpDef::new(
            "Assign",
            "var = value. In: var (reference to a Variable), value (var's dtype and shape). No \
             outputs.",
            |ctx| {
                let (var, value) = (ctx.input(0)?, ctx.input(1)?);
                if var.dtype != value.dtype || !var.shape.is_compatible_with(&value.shape) {
                    return Err(format!(
                        "Assign: var is {var} but value is {value}; they must have the same dtype and shape"
                    ).into());
                }
                Ok(vec![])
            },
        )
        .inputs([ref_arg("var"), arg("value")])
        .stateful()
        .cpu_kernel(|_| stateless(assign_kernel)),
    );
    r.add(
        OpDef::new("Identity", "Passes its input through.", same_as_input)
            .inputs([arg("input")])
            .outputs([arg("output")])
            .cpu_kernel(|_| stateless(identity_kernel)),
    );
    r.add(
        OpDef::new(
            "StopGradient",
            "Passes its input through; no gradient flows back through it (TensorFlow's \
             StopGradient: the vocabulary-parallel cross-entropy's shift by the global maximum).",
            same_as_input,
        )
        .inputs([arg("input")])
        .outputs([arg("output")])
        .cpu_kernel(|_| stateless(identity_kernel)),
    );
    r.add(
        OpDef::new(
            "NoOp",
            "Does nothing; a target for control dependencies.",
            |_| Ok(vec![]),
        )
        .stateful()
        .cpu_kernel(|_| stateless(|_| Ok(()))),
    );
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

/// Const's kernel: hands out its value; clones share the attribute's buffer (no copy per step).
#[derive(Debug)]
struct ConstKernel(Tensor);

fn const_factory(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
    match init.attr("value")? {
        AttrValue::Tensor(t) => Ok(Box::new(ConstKernel((**t).clone()))),
        v => Err(format!("attribute `value` is {}, not tensor", v.ty()).into()),
    }
}

impl Kernel for ConstKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        ctx.set_output(0, self.0.clone())
    }
}

/// Feeds replace placeholders before execution, so running one means it was not fed.
fn placeholder_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    Err(format!("placeholder `{}` must be fed", ctx.node).into())
}

fn read_variable_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let value = ctx
        .variable_at(0)?
        .read()
        .ok_or_else(|| "var is not initialized".to_string())?;
    ctx.set_output(0, value)
}

fn assign_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let value = ctx.input(1)?.clone();
    let cell = ctx.variable_at(0)?;
    match cell.read() {
        Some(old) if old.dtype() == value.dtype() && old.dims() == value.dims() => {}
        Some(old) => {
            return Err(format!(
                "var is {} {:?} but value is {} {:?}",
                old.dtype(),
                old.dims(),
                value.dtype(),
                value.dims()
            )
            .into())
        }
        None => return Err("var is not initialized".to_string().into()),
    }
    cell.write(value);
    Ok(())
}

fn identity_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let x = ctx.input(0)?.clone();
    ctx.set_output(0, x)
}

/// How a sharded variable's initial value is cut from the whole variable's.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ShardOf {
    /// Rows `first, first + stride, ...` (`dims[0]` of them) of a variable of these
    /// dimensions.
    Rows(ShardRows),
    /// Flat elements `[first, first + dims[0])` of a variable of these dimensions, zero past
    /// its end.
    Flat(Vec<usize>, usize),
}

/// The shard a variable of shape `dims` is (`None`: not a shard): rows (see [`shard_rows`]) or,
/// with `shard_flat`, a vector of flat elements starting at `shard_offset`, no further than the
/// whole variable's end (the rest is padding).
fn shard_of(
    dims: &[usize],
    shard_of: Option<&AttrValue>,
    offset: Option<&AttrValue>,
    flat: Option<&AttrValue>,
    stride: Option<&AttrValue>,
) -> Result<Option<ShardOf>, String> {
    let flat = match flat {
        None => false,
        Some(AttrValue::Bool(b)) => *b,
        Some(v) => return Err(format!("attribute `shard_flat` is {}, not bool", v.ty())),
    };
    if !flat {
        return Ok(shard_rows(dims, shard_of, offset, stride)?.map(ShardOf::Rows));
    }
    let whole = match shard_of {
        Some(AttrValue::Shape(s)) => s
            .as_static()
            .ok_or_else(|| format!("attribute `shard_of` {s} must be fully known"))?,
        Some(v) => return Err(format!("attribute `shard_of` is {}, not shape", v.ty())),
        None => return Err("`shard_flat` needs the whole variable's `shard_of` shape".into()),
    };
    let offset = match offset {
        None => 0,
        Some(AttrValue::Int(v)) => {
            usize::try_from(*v).map_err(|_| format!("shard_offset must be ≥ 0, got {v}"))?
        }
        Some(v) => return Err(format!("attribute `shard_offset` is {}, not int", v.ty())),
    };
    let total: usize = whole.iter().product();
    if dims.len() != 1 || offset > total {
        return Err(format!(
            "a flat shard must be a vector starting within the whole variable: shape {dims:?} at \
             element {offset} of shard_of {whole:?} ({total} elements)"
        ));
    }
    Ok(Some(ShardOf::Flat(whole, offset)))
}

/// Which rows of a bigger variable a shard holds: rows `first, first + stride, ...`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ShardRows {
    /// The whole variable's dimensions.
    whole: Vec<usize>,
    /// The first row.
    first: usize,
    /// The distance between consecutive rows (1: a contiguous block).
    stride: usize,
}

/// The rows of the bigger variable a shard of shape `dims` holds (`None`: not a shard):
/// `shard_of` must match `dims` past dimension 0 and hold rows `shard_offset + r·shard_stride`
/// for `r < dims[0]`.
fn shard_rows(
    dims: &[usize],
    shard_of: Option<&AttrValue>,
    offset: Option<&AttrValue>,
    stride: Option<&AttrValue>,
) -> Result<Option<ShardRows>, String> {
    let whole = match shard_of {
        None => return Ok(None),
        Some(AttrValue::Shape(s)) if s.rank().is_none() => return Ok(None),
        Some(AttrValue::Shape(s)) => s
            .as_static()
            .ok_or_else(|| format!("attribute `shard_of` {s} must be fully known"))?,
        Some(v) => return Err(format!("attribute `shard_of` is {}, not shape", v.ty())),
    };
    let offset = match offset {
        None => 0,
        Some(AttrValue::Int(v)) => {
            usize::try_from(*v).map_err(|_| format!("shard_offset must be ≥ 0, got {v}"))?
        }
        Some(v) => return Err(format!("attribute `shard_offset` is {}, not int", v.ty())),
    };
    let stride = match stride {
        None => 1,
        Some(AttrValue::Int(v)) => usize::try_from(*v)
            .ok()
            .filter(|&s| s >= 1)
            .ok_or_else(|| format!("shard_stride must be ≥ 1, got {v}"))?,
        Some(v) => return Err(format!("attribute `shard_stride` is {}, not int", v.ty())),
    };
    // The last row, offset + (rows - 1)·stride, must lie inside the whole variable.
    let last = dims.first().and_then(|&rows| {
        rows.checked_sub(1)
            .map_or(Some(offset), |r| r.checked_mul(stride)?.checked_add(offset))
    });
    let fits = !dims.is_empty()
        && whole.len() == dims.len()
        && whole[1..] == dims[1..]
        && last.is_some_and(|l| dims[0] == 0 || l < whole[0])
        && offset <= whole[0];
    if !fits {
        return Err(format!(
            "a shard of shape {dims:?} at row {offset} (stride {stride}) does not fit in shard_of \
             {whole:?} (same dimensions past the first, rows within it)"
        ));
    }
    Ok(Some(ShardRows {
        whole,
        first: offset,
        stride,
    }))
}

/// How a shard variable starts: rows of the whole (`shard_of` alone) or an [`AxisSplit`]
/// shard (`shard_parts` > 0).
#[derive(Debug)]
enum ShardInit {
    Rows {
        whole: Vec<usize>,
        first: usize,
        stride: usize,
    },
    Flat {
        whole: Vec<usize>,
        first: usize,
    },
    Split {
        whole: Vec<usize>,
        split: AxisSplit,
        index: usize,
        /// With `shard_flat`: the variable is the flat elements of the split shard from this
        /// one on (zero-padded past its end).
        flat: Option<usize>,
    },
}

fn int_attr(
    attrs: &std::collections::BTreeMap<String, AttrValue>,
    name: &str,
    default: i64,
) -> Result<i64, String> {
    match attrs.get(name) {
        None => Ok(default),
        Some(AttrValue::Int(v)) => Ok(*v),
        Some(v) => Err(format!("attribute `{name}` is {}, not int", v.ty())),
    }
}

/// The shard a variable of shape `dims` is (`None`: not a shard), checked against its attributes.
fn shard_init(
    dims: &[usize],
    attrs: &std::collections::BTreeMap<String, AttrValue>,
) -> Result<Option<ShardInit>, String> {
    let parts = int_attr(attrs, "shard_parts", 0)?;
    if parts <= 0 {
        let shard = shard_of(
            dims,
            attrs.get("shard_of"),
            attrs.get("shard_offset"),
            attrs.get("shard_flat"),
            attrs.get("shard_stride"),
        )?;
        return Ok(shard.map(|s| match s {
            ShardOf::Rows(ShardRows {
                whole,
                first,
                stride,
            }) => ShardInit::Rows {
                whole,
                first,
                stride,
            },
            ShardOf::Flat(whole, first) => ShardInit::Flat { whole, first },
        }));
    }
    let whole = match attrs.get("shard_of") {
        Some(AttrValue::Shape(s)) => s
            .as_static()
            .ok_or_else(|| format!("attribute `shard_of` {s} must be fully known"))?,
        _ => return Err("`shard_parts` needs `shard_of`, the whole variable's shape".into()),
    };
    let nonneg = |name: &str, default: i64| -> Result<usize, String> {
        let v = int_attr(attrs, name, default)?;
        usize::try_from(v).map_err(|_| format!("{name} must be ≥ 0, got {v}"))
    };
    let axis = nonneg("shard_axis", 0)?;
    let padded = nonneg("shard_padded", 0)?;
    let split = AxisSplit {
        axis,
        blocks: nonneg("shard_blocks", 1)?,
        parts: parts as usize,
        padded: if padded == 0 {
            whole.get(axis).copied().unwrap_or(0)
        } else {
            padded
        },
    };
    split.check(&whole)?;
    let index = nonneg("shard_index", 0)?;
    if index >= split.parts {
        return Err(format!("shard_index {index} ≥ shard_parts {}", split.parts));
    }
    let flat = match attrs.get("shard_flat") {
        None | Some(AttrValue::Bool(false)) => false,
        Some(AttrValue::Bool(true)) => true,
        Some(v) => return Err(format!("attribute `shard_flat` is {}, not bool", v.ty())),
    };
    if flat {
        // A flat shard of the split shard (ZeRO-3's shard of a tensor-parallel shard).
        let of = split.shard_dims(&whole);
        let total: usize = of.iter().product();
        let first = nonneg("shard_offset", 0)?;
        if dims.len() != 1 || first > total {
            return Err(format!(
                "a flat shard must be a vector starting within the split shard: shape {dims:?} \
                 at element {first} of shard {index} of {whole:?} cut along axis {axis} into {} \
                 parts, {of:?} ({total} elements)",
                split.parts
            ));
        }
        return Ok(Some(ShardInit::Split {
            whole,
            split,
            index,
            flat: Some(first),
        }));
    }
    if split.shard_dims(&whole) != dims {
        return Err(format!(
            "a shard of {whole:?} cut along axis {axis} into {} parts is {:?}, not {dims:?}",
            split.parts,
            split.shard_dims(&whole)
        ));
    }
    Ok(Some(ShardInit::Split {
        whole,
        split,
        index,
        flat: None,
    }))
}

impl ShardInit {
    /// The whole variable's dimensions.
    fn whole(&self) -> &[usize] {
        match self {
            ShardInit::Rows { whole, .. }
            | ShardInit::Flat { whole, .. }
            | ShardInit::Split { whole, .. } => whole,
        }
    }
}

/// Checks a Variable's `initial_value` attribute, when given, against its dtype and (whole)
/// dims, and returns it.
fn check_initial_value<'a>(
    value: Option<&'a AttrValue>,
    dtype: DType,
    dims: &[usize],
) -> Result<Option<&'a Tensor>, String> {
    match value {
        None => Ok(None),
        Some(AttrValue::Tensor(t)) if t.dtype() == dtype && t.dims() == dims => Ok(Some(t)),
        Some(AttrValue::Tensor(t)) => Err(format!(
            "initial_value is {}{:?} but the variable is {dtype}{dims:?}",
            t.dtype(),
            t.dims()
        )),
        Some(v) => Err(format!(
            "attribute `initial_value` is {}, not tensor",
            v.ty()
        )),
    }
}

/// Variable's kernel: outputs the cell's current value, initializing it on first use from the
/// `initial_value` attribute when given, else the `initializer` and `seed` attributes (see
/// [`super::init`]).
#[derive(Debug)]
struct VariableKernel {
    node: String,
    dtype: DType,
    dims: Vec<usize>,
    initializer: Initializer,
    seed: i64,
    init_value: f64,
    stddev: f64,
    /// What the variable is a shard of.
    shard: Option<ShardInit>,
    /// The exact starting value (the whole variable's, for a shard), when given.
    initial_value: Option<Tensor>,
    /// The `tf_*` initializers' second seed and scale.
    seed2: i64,
    init_scale: f64,
}

fn variable_factory(init: &KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError> {
    let dtype = match init.attr("dtype")? {
        AttrValue::DType(d) => *d,
        v => return Err(format!("attribute `dtype` is {}, not dtype", v.ty()).into()),
    };
    let dims = match init.attr("shape")? {
        AttrValue::Shape(s) => s
            .as_static()
            .ok_or_else(|| format!("variable shape {s} must be fully known"))?,
        v => return Err(format!("attribute `shape` is {}, not shape", v.ty()).into()),
    };
    let initializer = match init.attr("initializer")? {
        AttrValue::String(s) => s.parse::<Initializer>()?,
        v => return Err(format!("attribute `initializer` is {}, not string", v.ty()).into()),
    };
    let seed = match init.attr("seed")? {
        AttrValue::Int(s) => *s,
        v => return Err(format!("attribute `seed` is {}, not int", v.ty()).into()),
    };
    let init_value = match init.attr("init_value")? {
        AttrValue::Float(x) => *x,
        v => return Err(format!("attribute `init_value` is {}, not float", v.ty()).into()),
    };
    let stddev = match init.attr("stddev")? {
        AttrValue::Float(x) if x.is_finite() && *x >= 0.0 => *x,
        v => return Err(format!("attribute `stddev` must be a float >= 0, got {v:?}").into()),
    };
    let shard = shard_init(&dims, init.attrs)?;
    let whole = shard.as_ref().map_or(dims.as_slice(), ShardInit::whole);
    let initial_value =
        check_initial_value(init.attrs.get("initial_value"), dtype, whole)?.cloned();
    // A shard draws its values under the whole variable's name (the random stream's key).
    let node = match init.attrs.get("shard_name") {
        Some(AttrValue::String(s)) if shard.is_some() && !s.is_empty() => s.to_string(),
        _ => init.node.to_string(),
    };
    Ok(Box::new(VariableKernel {
        node,
        shard,
        dtype,
        dims,
        initializer,
        seed,
        init_value,
        stddev,
        initial_value,
        seed2: match init.attr("seed2")? {
            AttrValue::Int(s) => *s,
            v => return Err(format!("attribute `seed2` is {}, not int", v.ty()).into()),
        },
        init_scale: match init.attr("init_scale")? {
            AttrValue::Float(x) => *x,
            v => return Err(format!("attribute `init_scale` is {}, not float", v.ty()).into()),
        },
    }))
}

impl Kernel for VariableKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let value = ctx.variable()?.update(|v| -> Result<Tensor, String> {
            if let Some(t) = v {
                return Ok(t.clone());
            }
            let dims = match &self.shard {
                Some(
                    ShardInit::Rows { whole, .. }
                    | ShardInit::Flat { whole, .. }
                    | ShardInit::Split { whole, .. },
                ) => whole.as_slice(),
                None => self.dims.as_slice(),
            };
            let mut t = match &self.initial_value {
                Some(t) => t.clone(),
                None if self.initializer.is_tensorflow() => tf_random_value(
                    self.initializer,
                    self.dtype,
                    dims,
                    (self.seed, self.seed2),
                    self.init_scale,
                    self.init_value,
                )?,
                None => initial_value_with_stddev(
                    self.initializer,
                    self.dtype,
                    dims,
                    self.seed,
                    &self.node,
                    self.init_value,
                    self.stddev,
                )?,
            };
            // The whole variable's value is drawn once, at the first step, and sliced.
            match &self.shard {
                Some(ShardInit::Split {
                    split, index, flat, ..
                }) => {
                    t = split.shard(&t, *index)?;
                    if let Some(first) = flat {
                        t = flat_elements(&t, *first, self.dims[0])?;
                    }
                }
                Some(ShardInit::Rows { first, stride, .. }) => {
                    let row = t.num_elements() / dims[0].max(1) * t.dtype().size_of();
                    let mut bytes = Vec::with_capacity(self.dims[0] * row);
                    for r in 0..self.dims[0] {
                        let at = first + r * stride;
                        bytes.extend_from_slice(
                            t.as_bytes()
                                .get(at * row..(at + 1) * row)
                                .ok_or_else(|| format!("shard row {at} outside {dims:?}"))?,
                        );
                    }
                    t = Tensor::from_bytes(self.dtype, &self.dims, &bytes)
                        .map_err(|e| e.to_string())?;
                }
                Some(ShardInit::Flat { first, .. }) => {
                    t = flat_elements(&t, *first, self.dims[0])?;
                }
                None => {}
            }
            *v = Some(t.clone());
            Ok(t)
        })?;
        ctx.set_output(0, value)
    }
}

/// The `len` flat elements of `t` from element `first` on, as a vector, zero-padded past `t`'s
/// end (a flat shard).
fn flat_elements(t: &Tensor, first: usize, len: usize) -> Result<Tensor, String> {
    let size = t.dtype().size_of();
    let all = t.as_bytes();
    let start = first.saturating_mul(size).min(all.len());
    let end = first
        .saturating_add(len)
        .saturating_mul(size)
        .min(all.len());
    let mut bytes = all[start..end].to_vec();
    bytes.resize(len * size, 0);
    Tensor::from_bytes(t.dtype(), &[len], &bytes).map_err(|e| e.to_string())
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]); a module so the block can follow the
/// tests.
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{no_gradient, only_dy};

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("Identity", |_, _, dys| {
            Ok(vec![Some(only_dy(dys)?.clone())])
        });
        // Sources: nothing flows further back (they have no inputs); StopGradient by definition.
        for op in ["Const", "Placeholder", "Variable", "StopGradient"] {
            r.set_gradient(op, no_gradient);
        }
        // State reads behind control edges are not differentiated through.
        r.set_gradient("ReadVariable", no_gradient);
    }

    #[test]
    fn an_axis_split_shard_starts_as_its_part_of_the_whole_variable() {
        use crate::ops::testing::run_kernel_with;
        let cell = || [std::sync::Arc::new(crate::kernel::VariableCell::default())];
        let base = |shape: &[usize]| {
            vec![
                ("dtype", AttrValue::DType(DType::F32)),
                ("shape", AttrValue::Shape(Shape::known(shape))),
                ("initializer", AttrValue::String("normal".into())),
                ("seed", AttrValue::Int(5)),
            ]
        };
        let whole = run_kernel_with("Variable", "w", &base(&[3, 4]), &[], &[], &cell())
            .unwrap()
            .remove(0);
        // Columns 2..4 of a [3, 4] variable: shard 1 of 2 along axis 1.
        let mut attrs = base(&[3, 2]);
        attrs.extend([
            ("shard_of", AttrValue::Shape(Shape::known(&[3, 4]))),
            ("shard_name", AttrValue::String("w".into())),
            ("shard_axis", AttrValue::Int(1)),
            ("shard_parts", AttrValue::Int(2)),
            ("shard_index", AttrValue::Int(1)),
        ]);
        let shard = run_kernel_with("Variable", "w/tp_1_of_2", &attrs, &[], &[], &cell())
            .unwrap()
            .remove(0);
        let w = whole.as_slice::<f32>().unwrap();
        assert_eq!(
            shard.as_slice::<f32>().unwrap(),
            &[w[2], w[3], w[6], w[7], w[10], w[11]]
        );
        // Rows padded to 4 over 2 parts: shard 1 holds row 2 and a zero row.
        let mut attrs = base(&[2, 4]);
        attrs.extend([
            ("shard_of", AttrValue::Shape(Shape::known(&[3, 4]))),
            ("shard_name", AttrValue::String("w".into())),
            ("shard_parts", AttrValue::Int(2)),
            ("shard_index", AttrValue::Int(1)),
            ("shard_padded", AttrValue::Int(4)),
        ]);
        let shard = run_kernel_with("Variable", "w/tp_1_of_2", &attrs, &[], &[], &cell())
            .unwrap()
            .remove(0);
        assert_eq!(&shard.as_slice::<f32>().unwrap()[..4], &w[8..]);
        assert_eq!(&shard.as_slice::<f32>().unwrap()[4..], &[0.0; 4]);
        // A shape that is not the split's shard is refused, naming both.
        attrs[1] = ("shape", AttrValue::Shape(Shape::known(&[1, 4])));
        let err =
            run_kernel_with("Variable", "w/tp_1_of_2", &attrs, &[], &[], &cell()).unwrap_err();
        assert!(err.contains("[2, 4]") && err.contains("[1, 4]"), "{err}");
    }

    #[test]
    fn flat_shards_of_axis_split_shards_reassemble_the_whole_variable() {
        use crate::ops::testing::run_kernel_with;
        let cell = || [std::sync::Arc::new(crate::kernel::VariableCell::default())];
        let base = |shape: &[usize]| {
            vec![
                ("dtype", AttrValue::DType(DType::F32)),
                ("shape", AttrValue::Shape(Shape::known(shape))),
                ("initializer", AttrValue::String("normal".into())),
                ("seed", AttrValue::Int(9)),
            ]
        };
        let whole = run_kernel_with("Variable", "w", &base(&[3, 4]), &[], &[], &cell())
            .unwrap()
            .remove(0);
        let w = whole.as_slice::<f32>().unwrap();
        // T = 2 column shards of [3, 2] (6 elements), each cut flat over D = 4 ranks: shards of
        // 2 elements, the last one all padding.
        let (tp, dp, size) = (2usize, 4usize, 2usize);
        let mut rebuilt = vec![f32::NAN; 12];
        for t in 0..tp {
            let mut joined = Vec::new();
            for d in 0..dp {
                let mut attrs = base(&[size]);
                attrs.extend([
                    ("shard_of", AttrValue::Shape(Shape::known(&[3, 4]))),
                    ("shard_name", AttrValue::String("w".into())),
                    ("shard_axis", AttrValue::Int(1)),
                    ("shard_parts", AttrValue::Int(tp as i64)),
                    ("shard_index", AttrValue::Int(t as i64)),
                    ("shard_flat", AttrValue::Bool(true)),
                    ("shard_offset", AttrValue::Int((d * size) as i64)),
                ]);
                let name = format!("w/tp_{t}_of_2/shard_{d}_of_4");
                let piece = run_kernel_with("Variable", &name, &attrs, &[], &[], &cell())
                    .unwrap()
                    .remove(0);
                assert_eq!(piece.dims(), &[size]);
                joined.extend_from_slice(piece.as_slice::<f32>().unwrap());
            }
            assert_eq!(&joined[6..], &[0.0, 0.0], "the padding is zeros");
            // The tensor-parallel shard [3, 2] holds columns 2t, 2t + 1.
            for i in 0..3 {
                for j in 0..2 {
                    rebuilt[i * 4 + t * 2 + j] = joined[i * 2 + j];
                }
            }
        }
        assert_eq!(
            rebuilt, w,
            "the D·T pieces are exactly the one-process value"
        );
        // A flat shard starting past the split shard's end is refused, naming it.
        let mut attrs = base(&[size]);
        attrs.extend([
            ("shard_of", AttrValue::Shape(Shape::known(&[3, 4]))),
            ("shard_axis", AttrValue::Int(1)),
            ("shard_parts", AttrValue::Int(2)),
            ("shard_flat", AttrValue::Bool(true)),
            ("shard_offset", AttrValue::Int(7)),
        ]);
        let err = run_kernel_with("Variable", "w/x", &attrs, &[], &[], &cell()).unwrap_err();
        assert!(err.contains("element 7") && err.contains("[3, 2]"), "{err}");
    }

    #[test]
    fn a_shard_starts_as_its_rows_of_the_whole_variable() {
        use crate::ops::testing::run_kernel_with;
        let attrs = |shape: &[usize]| {
            vec![
                ("dtype", AttrValue::DType(DType::F32)),
                ("shape", AttrValue::Shape(Shape::known(shape))),
                ("initializer", AttrValue::String("normal".into())),
                ("seed", AttrValue::Int(5)),
            ]
        };
        let cell = || [std::sync::Arc::new(crate::kernel::VariableCell::default())];
        let whole = run_kernel_with("Variable", "w", &attrs(&[4, 2, 3]), &[], &[], &cell())
            .unwrap()
            .remove(0);
        let mut shard_attrs = attrs(&[2, 2, 3]);
        shard_attrs.extend([
            ("shard_of", AttrValue::Shape(Shape::known(&[4, 2, 3]))),
            ("shard_offset", AttrValue::Int(2)),
            ("shard_name", AttrValue::String("w".into())),
        ]);
        let shard = run_kernel_with("Variable", "w/shard_1", &shard_attrs, &[], &[], &cell())
            .unwrap()
            .remove(0);
        assert_eq!(shard.dims(), &[2, 2, 3]);
        assert_eq!(
            shard.as_slice::<f32>().unwrap(),
            &whole.as_slice::<f32>().unwrap()[12..]
        );
        // Rows past the whole variable are refused, naming both shapes.
        shard_attrs[5] = ("shard_offset", AttrValue::Int(3));
        let err =
            run_kernel_with("Variable", "w/shard_1", &shard_attrs, &[], &[], &cell()).unwrap_err();
        assert!(
            err.contains("[2, 2, 3]") && err.contains("[4, 2, 3]"),
            "{err}"
        );
    }

    #[test]
    fn a_variable_starts_from_its_initial_value_exactly() {
        use crate::ops::math::infer;
        use crate::ops::testing::run_kernel_with;
        let value = Tensor::from_slice(&[2, 2], &[0.5f32, -1.25, 3.0, 7.5]).unwrap();
        let attrs = |v: &Tensor| {
            vec![
                ("dtype", AttrValue::DType(DType::F32)),
                ("shape", AttrValue::Shape(Shape::known(&[2, 2]))),
                ("initializer", AttrValue::String("normal".into())),
                (
                    "initial_value",
                    AttrValue::Tensor(std::sync::Arc::new(v.clone())),
                ),
            ]
        };
        let cell = [std::sync::Arc::new(crate::kernel::VariableCell::default())];
        let out = run_kernel_with("Variable", "w", &attrs(&value), &[], &[], &cell)
            .unwrap()
            .remove(0);
        assert_eq!(out.as_slice::<f32>().unwrap(), [0.5, -1.25, 3.0, 7.5]);
        // A value of another shape or dtype is refused by the shape rule and the kernel.
        for wrong in [
            Tensor::from_slice(&[4], &[0.5f32, -1.25, 3.0, 7.5]).unwrap(),
            Tensor::from_slice(&[2, 2], &[1.0f64, 2.0, 3.0, 4.0]).unwrap(),
        ] {
            let e = infer("Variable", &[], &attrs(&wrong)).unwrap_err();
            assert!(e.to_string().contains("initial_value is"), "{e}");
            let fresh = [std::sync::Arc::new(crate::kernel::VariableCell::default())];
            let e = run_kernel_with("Variable", "w", &attrs(&wrong), &[], &[], &fresh).unwrap_err();
            assert!(e.contains("initial_value is"), "{e}");
        }
    }

    #[test]
    fn a_flat_shard_is_its_elements_of_the_whole_variable_padded_with_zeros() {
        use crate::ops::testing::run_kernel_with;
        let attrs = |shape: &[usize]| {
            vec![
                ("dtype", AttrValue::DType(DType::F32)),
                ("shape", AttrValue::Shape(Shape::known(shape))),
                ("initializer", AttrValue::String("normal".into())),
                ("seed", AttrValue::Int(5)),
            ]
        };
        let cell = || [std::sync::Arc::new(crate::kernel::VariableCell::default())];
        let whole = run_kernel_with("Variable", "w", &attrs(&[2, 5]), &[], &[], &cell())
            .unwrap()
            .remove(0);
        let whole = whole.as_slice::<f32>().unwrap();
        // 10 elements over 3 ranks: shards of 4, the last one half padding.
        let mut joined = Vec::new();
        for r in 0..3 {
            let mut a = attrs(&[4]);
            a.extend([
                ("shard_of", AttrValue::Shape(Shape::known(&[2, 5]))),
                ("shard_offset", AttrValue::Int(4 * r)),
                ("shard_name", AttrValue::String("w".into())),
                ("shard_flat", AttrValue::Bool(true)),
            ]);
            let shard = run_kernel_with("Variable", "w/shard", &a, &[], &[], &cell())
                .unwrap()
                .remove(0);
            assert_eq!(shard.dims(), &[4]);
            joined.extend_from_slice(shard.as_slice::<f32>().unwrap());
        }
        assert_eq!(&joined[..10], whole);
        assert_eq!(&joined[10..], &[0.0, 0.0]);
        // A flat shard that is not a vector, or starts past the end, is refused.
        let mut a = attrs(&[2, 2]);
        a.extend([
            ("shard_of", AttrValue::Shape(Shape::known(&[2, 5]))),
            ("shard_flat", AttrValue::Bool(true)),
        ]);
        let err = run_kernel_with("Variable", "w/shard", &a, &[], &[], &cell()).unwrap_err();
        assert!(err.contains("a flat shard must be a vector"), "{err}");
        let mut a = attrs(&[4]);
        a.extend([
            ("shard_of", AttrValue::Shape(Shape::known(&[2, 5]))),
            ("shard_offset", AttrValue::Int(11)),
            ("shard_flat", AttrValue::Bool(true)),
        ]);
        let err = run_kernel_with("Variable", "w/shard", &a, &[], &[], &cell()).unwrap_err();
        assert!(err.contains("element 11"), "{err}");
    }

    #[test]
    fn a_strided_shard_starts_as_every_kth_row() {
        use crate::ops::testing::run_kernel_with;
        let attrs = |shape: &[usize]| {
            vec![
                ("dtype", AttrValue::DType(DType::F32)),
                ("shape", AttrValue::Shape(Shape::known(shape))),
                ("initializer", AttrValue::String("normal".into())),
                ("seed", AttrValue::Int(7)),
            ]
        };
        let cell = || [std::sync::Arc::new(crate::kernel::VariableCell::default())];
        let whole = run_kernel_with("Variable", "e", &attrs(&[5, 2]), &[], &[], &cell())
            .unwrap()
            .remove(0);
        let w = whole.as_slice::<f32>().unwrap();
        // `mod` over 2 shards: shard 1 holds rows 1 and 3.
        let mut shard_attrs = attrs(&[2, 2]);
        shard_attrs.extend([
            ("shard_of", AttrValue::Shape(Shape::known(&[5, 2]))),
            ("shard_offset", AttrValue::Int(1)),
            ("shard_stride", AttrValue::Int(2)),
            ("shard_name", AttrValue::String("e".into())),
        ]);
        let shard = run_kernel_with("Variable", "e/part_1", &shard_attrs, &[], &[], &cell())
            .unwrap()
            .remove(0);
        assert_eq!(shard.as_slice::<f32>().unwrap(), [w[2], w[3], w[6], w[7]]);
        // Three rows at stride 2 from row 1 would need row 5: refused.
        shard_attrs[1] = ("shape", AttrValue::Shape(Shape::known(&[3, 2])));
        let err =
            run_kernel_with("Variable", "e/part_1", &shard_attrs, &[], &[], &cell()).unwrap_err();
        assert!(err.contains("stride 2"), "{err}");
    }
}
