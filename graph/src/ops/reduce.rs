//! Reductions: Sum, Mean, Max, ArgMax.
//!
//! **Difference from TensorFlow:** the reduction axes are the attribute `axes` (list(int)), not
//! a second input tensor, and ArgMax's axis is the attribute `axis`, not its `dimension` input.
//! Static axes keep every output shape known at graph-construction time, which the partitioner's
//! buffer plan relies on. An empty `axes` (the default) reduces over **all** axes; TensorFlow
//! reduces over none when given an empty axes tensor. Negative axes count from the end;
//! out-of-range or repeated axes are errors. Each op lives in its own delimited block below.

use super::math::require_numeric;
use super::*;

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
fn reduce_infer(op: &str, ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, String> {
    let x = ctx.input(0)?;
    require_numeric(op, "input", x)?;
    let axes = ctx.ints("axes")?;
    let keep_dims = ctx.bool("keep_dims")?;
    let Some(dims) = x.shape.dims() else {
        // Rank unknown: only literal repeats can be caught; the output rank is known only when
        // every axis is reduced away.
        for (i, a) in axes.iter().enumerate() {
            if axes[..i].contains(a) {
                return Err(format!("{op}: axis {a} is listed twice in axes {axes:?}"));
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
            ));
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
}

fn arg_max_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, String> {
    let x = ctx.input(0)?;
    require_numeric("ArgMax", "input", x)?;
    let axis = ctx.int("axis")?;
    let out_type = ctx.dtype("output_type")?;
    if !out_type.is_int() {
        return Err(format!(
            "ArgMax: output_type must be i32 or i64, got {out_type}"
        ));
    }
    let Some(dims) = x.shape.dims() else {
        return Ok(vec![TensorType::new(out_type, Shape::unknown())]);
    };
    if dims.is_empty() {
        return Err(format!(
            "ArgMax: input must have rank >= 1, got shape {}",
            x.shape
        ));
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
        assert!(e.contains("axis 2") && e.contains("[4, 5]"), "{e}");
        let e = infer("ArgMax", &[tt(F32, &[])], &[("axis", 0i64.into())]).unwrap_err();
        assert!(e.contains("rank >= 1"), "{e}");
        let e = infer(
            "ArgMax",
            &[tt(F32, &[4])],
            &[("axis", 0i64.into()), ("output_type", F32.into())],
        )
        .unwrap_err();
        assert!(e.contains("output_type") && e.contains("f32"), "{e}");
        let e = infer("ArgMax", &[tt(F32, &[4])], &[]).unwrap_err();
        assert!(e.contains("axis"), "{e}");
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
