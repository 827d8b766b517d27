//! Array manipulation: Reshape, ZerosLike, OnesLike.
//!
//! **Difference from TensorFlow:** Reshape's target shape is the attribute `shape` (list(int),
//! at most one `-1`), not a second input tensor. A static target keeps output shapes known at
//! graph-construction time, which the partitioner's buffer plan relies on; the `-1` still lets a
//! graph keep an unknown batch dimension. Each op lives in its own delimited block below.

use super::elementwise::{attr_ints, ones, stateless};
use super::*;
use crate::kernel::{Kernel, KernelContext};

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(reshape());
    r.add(zeros_like());
    r.add(ones_like());
}

// ---------------------------------------------------------------------------------------------
// Reshape
// ---------------------------------------------------------------------------------------------

fn reshape() -> OpDef {
    OpDef::new(
        "Reshape",
        "output = tensor with its elements (row-major order unchanged) laid out as `shape`. \
         In: tensor (any dtype). Out: output, same dtype. Attrs: shape (list(int), required; at \
         most one -1, inferred from the element count).",
        reshape_infer,
    )
    .inputs([arg("tensor")])
    .outputs([arg("output")])
    .attrs([attr("shape", AttrType::IntList)])
    .cpu_kernel(|init| {
        Ok(Box::new(ReshapeKernel {
            shape: attr_ints(init, "shape")?,
        }))
    })
}

/// Reshape's kernel: resolves the `-1` from the runtime element count and shares the input's
/// buffer (no copy).
#[derive(Debug)]
struct ReshapeKernel {
    shape: Vec<i64>,
}

/// The target dims for `n` elements, or an error naming the input shape and the target.
pub(crate) fn resolve_shape(input: &Shape, n: usize, target: &[i64]) -> Result<Vec<usize>, String> {
    let mut dims = Vec::with_capacity(target.len());
    let (mut given, mut wildcard) = (1usize, None);
    for (i, &d) in target.iter().enumerate() {
        match d {
            -1 if wildcard.is_none() => {
                wildcard = Some(i);
                dims.push(1);
            }
            -1 => return Err(format!("Reshape: shape {target:?} has more than one -1")),
            d => {
                let d = usize::try_from(d)
                    .map_err(|_| format!("Reshape: invalid dimension {d} in shape {target:?}"))?;
                given = given
                    .checked_mul(d)
                    .ok_or_else(|| format!("Reshape: shape {target:?} has too many elements"))?;
                dims.push(d);
            }
        }
    }
    match wildcard {
        None if given == n => Ok(dims),
        None => Err(format!(
            "Reshape: cannot reshape input of shape {input} ({n} elements) into {target:?} \
             ({given} elements)"
        )),
        Some(_) if given == 0 => Err(format!(
            "Reshape: cannot infer the -1 in {target:?} for input of shape {input}: another \
             dimension is 0"
        )),
        Some(k) if n % given == 0 => {
            dims[k] = n / given;
            Ok(dims)
        }
        Some(_) => Err(format!(
            "Reshape: cannot reshape input of shape {input} ({n} elements) into {target:?}: {n} \
             is not a multiple of {given}"
        )),
    }
}

impl Kernel for ReshapeKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let x = ctx.input(0)?;
        let dims = resolve_shape(&x.shape(), x.num_elements(), &self.shape)?;
        let y = x.reshaped(&dims).map_err(|e| e.to_string())?;
        ctx.set_output(0, y)
    }
}

fn reshape_infer(ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let x = ctx.input(0)?;
    let target = ctx.ints("shape")?;
    let pretty = || format!("{target:?}");
    if target.iter().filter(|&&d| d == -1).count() > 1 {
        return Err(format!("Reshape: shape {} has more than one -1", pretty()).into());
    }
    let mut out = Shape::from_signed(target)
        .map_err(|e| format!("Reshape: shape {}: {e}", pretty()))?
        .dims()
        .map(<[Option<usize>]>::to_vec)
        .unwrap_or_default();
    // Product of the given (non -1) target dims.
    let given = out
        .iter()
        .flatten()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("Reshape: shape {} has too many elements", pretty()))?;
    let wildcard = out.iter().position(Option::is_none);
    match (x.shape.num_elements(), wildcard) {
        (Some(n), None) if n != given => {
            return Err(format!(
            "Reshape: cannot reshape input of shape {} ({n} elements) into {} ({given} elements)",
            x.shape,
            pretty()
        )
            .into())
        }
        (Some(n), Some(k)) => {
            if given == 0 {
                return Err(format!(
                    "Reshape: cannot infer the -1 in {} for input of shape {}: another dimension is 0",
                    pretty(),
                    x.shape
                ).into());
            }
            if n % given != 0 {
                return Err(format!(
                    "Reshape: cannot reshape input of shape {} ({n} elements) into {}: {n} is not \
                     a multiple of {given}, the product of the other dimensions",
                    x.shape,
                    pretty()
                )
                .into());
            }
            out[k] = Some(n / given);
        }
        (None, None) => {
            // Partially known input: its element count is a multiple of its known dims' product.
            let known = x.shape.dims().map(|d| {
                d.iter()
                    .flatten()
                    .try_fold(1usize, |a, &d| a.checked_mul(d))
            });
            if let Some(Some(p)) = known {
                let fits = if p == 0 { given == 0 } else { given % p == 0 };
                if !fits {
                    return Err(format!(
                        "Reshape: cannot reshape input of shape {} into {} ({given} elements is \
                         not a multiple of {p})",
                        x.shape,
                        pretty()
                    )
                    .into());
                }
            }
        }
        _ => {}
    }
    Ok(vec![TensorType::new(x.dtype, Shape::partial(out))])
}

// ---------------------------------------------------------------------------------------------
// ZerosLike
// ---------------------------------------------------------------------------------------------

fn zeros_like() -> OpDef {
    OpDef::new(
        "ZerosLike",
        "y = zeros of x's dtype and shape (false for bool). In: x (any dtype). Out: y, same type.",
        same_as_input,
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .cpu_kernel(|_| stateless(zeros_like_kernel))
}

fn zeros_like_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let x = ctx.input(0)?;
    let y = Tensor::zeros(x.dtype(), x.dims()).map_err(|e| e.to_string())?;
    ctx.set_output(0, y)
}

// ---------------------------------------------------------------------------------------------
// OnesLike
// ---------------------------------------------------------------------------------------------

fn ones_like() -> OpDef {
    OpDef::new(
        "OnesLike",
        "y = ones of x's dtype and shape (true for bool). In: x (any dtype). Out: y, same type.",
        same_as_input,
    )
    .inputs([arg("x")])
    .outputs([arg("y")])
    .cpu_kernel(|_| stateless(ones_like_kernel))
}

fn ones_like_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let x = ctx.input(0)?;
    let y = ones(x.dtype(), x.dims())?;
    ctx.set_output(0, y)
}

#[cfg(test)]
mod tests {
    use super::super::math::{infer, tt};
    use super::*;
    use DType::*;

    fn reshape(x: TensorType, shape: &[i64]) -> Result<Vec<TensorType>, OpError> {
        infer(
            "Reshape",
            &[x],
            &[("shape", AttrValue::IntList(shape.to_vec()))],
        )
    }

    #[test]
    fn reshape_static() {
        assert_eq!(
            reshape(tt(F32, &[2, 3]), &[3, 2]),
            Ok(vec![tt(F32, &[3, 2])])
        );
        assert_eq!(reshape(tt(I64, &[2, 3]), &[6]), Ok(vec![tt(I64, &[6])]));
        assert_eq!(reshape(tt(F32, &[1]), &[]), Ok(vec![tt(F32, &[])]));
        assert_eq!(
            reshape(tt(F32, &[0, 4]), &[2, 0]),
            Ok(vec![tt(F32, &[2, 0])])
        );
    }

    #[test]
    fn reshape_infers_minus_one() {
        assert_eq!(
            reshape(tt(F32, &[32, 28, 28]), &[-1, 784]),
            Ok(vec![tt(F32, &[32, 784])])
        );
        assert_eq!(reshape(tt(F32, &[2, 3]), &[-1]), Ok(vec![tt(F32, &[6])]));
        // Unknown batch: the -1 stays unknown.
        assert_eq!(
            reshape(tt(F32, &[-1, 28, 28]), &[-1, 784]),
            Ok(vec![tt(F32, &[-1, 784])])
        );
        assert_eq!(
            reshape(TensorType::new(Bool, Shape::unknown()), &[4, -1]),
            Ok(vec![tt(Bool, &[4, -1])])
        );
    }

    #[test]
    fn reshape_errors() {
        let e = reshape(tt(F32, &[2, 3]), &[4]).unwrap_err();
        assert!(
            e.to_string().contains("[2, 3]")
                && e.to_string().contains("6 elements")
                && e.to_string().contains("[4]"),
            "{e}"
        );
        let e = reshape(tt(F32, &[2, 3]), &[-1, 4]).unwrap_err();
        assert!(
            e.to_string().contains("[2, 3]") && e.to_string().contains("[-1, 4]"),
            "{e}"
        );
        let e = reshape(tt(F32, &[2, 3]), &[-1, -1]).unwrap_err();
        assert!(e.to_string().contains("more than one -1"), "{e}");
        let e = reshape(tt(F32, &[2, 3]), &[-2, 3]).unwrap_err();
        assert!(e.to_string().contains("-2"), "{e}");
        let e = reshape(tt(F32, &[0, 3]), &[0, -1]).unwrap_err();
        assert!(
            e.to_string().contains("[0, 3]") && e.to_string().contains("cannot infer"),
            "{e}"
        );
        // Partially known input: [?, 3] holds a multiple of 3 elements.
        let e = reshape(tt(F32, &[-1, 3]), &[4]).unwrap_err();
        assert!(
            e.to_string().contains("[?, 3]") && e.to_string().contains("multiple of 3"),
            "{e}"
        );
        assert_eq!(reshape(tt(F32, &[-1, 3]), &[6]), Ok(vec![tt(F32, &[6])]));
        let e = infer("Reshape", &[tt(F32, &[2])], &[]).unwrap_err();
        assert!(e.to_string().contains("shape"), "{e}");
    }

    #[test]
    fn like_ops_keep_type() {
        for op in ["ZerosLike", "OnesLike"] {
            for x in [
                tt(F32, &[-1, 3]),
                tt(Bool, &[2]),
                TensorType::new(I64, Shape::unknown()),
            ] {
                assert_eq!(infer(op, std::slice::from_ref(&x), &[]), Ok(vec![x]));
            }
        }
    }
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]); a module so the block can follow the
/// tests.
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{no_gradient, only_dy};

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("Reshape", |b, f, dys| {
            Ok(vec![Some(b.binary(
                "ReshapeLike",
                "dx",
                only_dy(dys)?,
                f.input(0)?,
            ))])
        });
        r.set_gradient("ZerosLike", no_gradient);
        r.set_gradient("OnesLike", no_gradient);
    }
}
