//! TensorFlow's element-wise `Maximum` and `FloorDiv`, which TF 1.x gradients of means and
//! reductions over run-time shapes emit (`_safe_shape_div`: `x // maximum(y, 1)`), with their
//! CPU kernels and gradients. Both broadcast like NumPy and TensorFlow.

use super::elementwise::{num_binary, slice, stateless};
use super::grad::{dispatch_real, Real};
use super::tf_dynamic::broadcast_to;
use super::*;
use crate::kernel::KernelContext;

/// The ops this module registers.
pub const OPS: [&str; 3] = ["Maximum", "FloorDiv", "MaximumGrad"];

pub(crate) fn register(r: &mut OpRegistry) {
    r.add(maximum());
    r.add(floor_div());
    r.add(maximum_grad());
}

/// Shape rule of a broadcasting binary op on one numeric dtype.
fn binary_numeric(op: &str, ctx: &InferCtx<'_>) -> Result<Vec<TensorType>, OpError> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let dtype = super::math::require_same(op, ("x", x), ("y", y))?;
    super::math::require_numeric(op, "x", x)?;
    let shape =
        super::math::broadcast_shapes(&x.shape, &y.shape).map_err(|e| format!("{op}: {e}"))?;
    Ok(vec![TensorType::new(dtype, shape)])
}

// ---------------------------------------------------------------------------------------------
// Maximum
// ---------------------------------------------------------------------------------------------

fn maximum() -> OpDef {
    OpDef::new(
        "Maximum",
        "z = max(x, y) elementwise, with NumPy broadcasting; a NaN on either side gives NaN \
         (TensorFlow's Maximum). In: x, y (same numeric dtype). Out: z.",
        |ctx| binary_numeric("Maximum", ctx),
    )
    .inputs([arg("x"), arg("y")])
    .outputs([arg("z")])
    .cpu_kernel(|_| stateless(maximum_kernel))
}

fn maximum_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let z = num_binary!("Maximum", x, y,
        float: |a, b| if a >= b || a.is_nan() { a } else { b },
        int: |a, b| a.max(b))?;
    ctx.set_output(0, z)
}

fn maximum_grad() -> OpDef {
    OpDef::new(
        "MaximumGrad",
        "The gradient of Maximum for one operand, before it is summed to that operand's shape: \
         dy where x >= y (for x) or where not (for y), else 0 (TensorFlow's _MaximumGrad; a \
         tie goes to x). In: dy (float, Maximum's output shape), x, y (Maximum's inputs). Out: \
         the gradient, dy's type. Attrs: for_y (bool, default false).",
        |ctx| {
            let dy = ctx.input(0)?;
            require_float("MaximumGrad: dy", dy)?;
            Ok(vec![dy.clone()])
        },
    )
    .inputs([arg("dy"), arg("x"), arg("y")])
    .outputs([arg("dz")])
    .attrs([attr_or("for_y", AttrType::Bool, AttrDefault::Bool(false))])
    .cpu_kernel(|init| {
        let for_y = match init.attr("for_y")? {
            AttrValue::Bool(b) => *b,
            v => return Err(format!("attribute `for_y` is {}, not bool", v.ty()).into()),
        };
        Ok(Box::new(MaximumGradKernel { for_y }))
    })
}

#[derive(Debug)]
struct MaximumGradKernel {
    for_y: bool,
}

fn masked<T: Real + PartialOrd>(
    dy: &Tensor,
    x: &Tensor,
    y: &Tensor,
    for_y: bool,
) -> Result<Tensor, String> {
    let (x, y) = (broadcast_to(x, dy.dims())?, broadcast_to(y, dy.dims())?);
    let (d, xs, ys) = (slice::<T>(dy)?, slice::<T>(&x)?, slice::<T>(&y)?);
    let v: Vec<T> = d
        .iter()
        .zip(xs.iter().zip(ys))
        .map(|(&g, (&a, &b))| {
            if (a >= b) != for_y {
                g
            } else {
                T::from_f64(0.0)
            }
        })
        .collect();
    Tensor::from_slice(dy.dims(), &v).map_err(|e| e.to_string())
}

impl crate::kernel::Kernel for MaximumGradKernel {
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        let (dy, x, y) = (ctx.input(0)?, ctx.input(1)?, ctx.input(2)?);
        if x.dtype() != dy.dtype() || y.dtype() != dy.dtype() {
            return Err(format!(
                "MaximumGrad: dy is {} but x and y are {} and {}",
                dy.dtype(),
                x.dtype(),
                y.dtype()
            )
            .into());
        }
        let g = dispatch_real!(dy.dtype(), masked(dy, x, y, self.for_y))
            .map_err(|e| format!("MaximumGrad: {e}"))?;
        ctx.set_output(0, g)
    }
}

// ---------------------------------------------------------------------------------------------
// FloorDiv
// ---------------------------------------------------------------------------------------------

fn floor_div() -> OpDef {
    OpDef::new(
        "FloorDiv",
        "z = floor(x / y) elementwise, with NumPy broadcasting (TensorFlow's FloorDiv): integers \
         round toward −∞ (−7 // 2 = −4; a zero divisor is an error; MIN // −1 wraps to MIN), \
         floats are floor(x / y). In: x, y (same numeric dtype). Out: z.",
        |ctx| binary_numeric("FloorDiv", ctx),
    )
    .inputs([arg("x"), arg("y")])
    .outputs([arg("z")])
    .cpu_kernel(|_| stateless(floor_div_kernel))
}

fn floor_div_kernel(ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
    let (x, y) = (ctx.input(0)?, ctx.input(1)?);
    let zero_divisor = match y.dtype() {
        DType::I32 => slice::<i32>(y)?.contains(&0),
        DType::I64 => slice::<i64>(y)?.contains(&0),
        _ => false,
    };
    if zero_divisor {
        return Err(format!(
            "FloorDiv: integer division by zero (divisor y of shape {} contains 0)",
            y.shape()
        )
        .into());
    }
    let z = num_binary!("FloorDiv", x, y,
    float: |a, b| (a / b).floor(),
    int: |a, b| {
        let q = a.wrapping_div(b);
        if a.wrapping_rem(b) != 0 && ((a < 0) != (b < 0)) {
            q - 1
        } else {
            q
        }
    })?;
    ctx.set_output(0, z)
}

// ---- gradients ----

/// Gradients of this family's ops (see [`crate::autodiff`]); FloorDiv has none (it is listed in
/// [`super::NO_GRADIENT`]: TensorFlow's is None for both inputs).
pub(crate) mod gradients {
    use super::*;
    use crate::autodiff::{only_dy, ForwardNode, GradBuilder, GradResult};
    use crate::builder::Output;

    pub(crate) fn register_gradients(r: &mut OpRegistry) {
        r.set_gradient("Maximum", maximum_grad);
    }

    fn maximum_grad(b: &mut GradBuilder, f: &ForwardNode, dys: &[Option<Output>]) -> GradResult {
        let dy = only_dy(dys)?;
        let (x, y) = (f.input(0)?, f.input(1)?);
        let shape = f.output_type(0)?.shape.clone();
        let mut side = |for_y: bool, suffix: &str| {
            b.op(
                "MaximumGrad",
                suffix,
                &[dy, x, y],
                &[("for_y", AttrValue::Bool(for_y))],
            )
        };
        let (gx, gy) = (side(false, "dz_x"), side(true, "dz_y"));
        Ok(vec![
            Some(b.reduce_to_input(f, 0, gx, &shape, "dx")?),
            Some(b.reduce_to_input(f, 1, gy, &shape, "dy")?),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::super::math::{infer, tt};
    use super::super::testing::run_kernel;
    use super::*;
    use DType::*;

    fn run(op: &str, x: Tensor, y: Tensor) -> Result<Tensor, String> {
        run_kernel(op, &[], &[x, y]).map(|mut v| v.remove(0))
    }

    fn v<T: crate::Element>(xs: &[T]) -> Tensor {
        Tensor::from_slice(&[xs.len()], xs).unwrap()
    }

    /// Against a direct reference: Python's `//` and `max` (which TensorFlow's FloorDiv and
    /// Maximum agree with: TensorFlow 2.21 gives floordiv(7, 2) = 3, (-7, 2) = -4,
    /// (7, -2) = -4, (-7, -2) = 3, (-1, 3) = -1, and floordiv(int32 MIN, -1) = MIN).
    #[test]
    fn floor_div_rounds_toward_negative_infinity() {
        let xs: Vec<i64> = (-9..=9).collect();
        let ys: [i64; 6] = [-4, -3, -1, 1, 2, 5];
        for &b in &ys {
            let z = run("FloorDiv", v(&xs), Tensor::scalar(b)).unwrap();
            let want: Vec<i64> = xs
                .iter()
                .map(|&a| (a as f64 / b as f64).floor() as i64)
                .collect();
            assert_eq!(z.as_slice::<i64>().unwrap(), want, "divisor {b}");
        }
        let z = run(
            "FloorDiv",
            v(&[7i32, -7, 7, -7, -1]),
            v(&[2i32, 2, -2, -2, 3]),
        )
        .unwrap();
        assert_eq!(z.as_slice::<i32>().unwrap(), [3, -4, -4, 3, -1]);
        let z = run("FloorDiv", v(&[i32::MIN]), v(&[-1i32])).unwrap();
        assert_eq!(z.as_slice::<i32>().unwrap(), [i32::MIN]);
        let e = run("FloorDiv", v(&[1i32]), v(&[0i32])).unwrap_err();
        assert!(e.contains("division by zero"), "{e}");
        let z = run(
            "FloorDiv",
            v(&[7.0f32, -7.0, 1.0, -1.0]),
            v(&[2.0f32, 2.0, 0.0, 0.0]),
        )
        .unwrap();
        assert_eq!(
            z.as_slice::<f32>().unwrap(),
            [3.0, -4.0, f32::INFINITY, f32::NEG_INFINITY]
        );
        // Broadcasting: [2, 1] // [3].
        let x = Tensor::from_slice(&[2, 1], &[10i32, -10]).unwrap();
        let z = run("FloorDiv", x, v(&[3i32, 4, 5])).unwrap();
        assert_eq!(z.dims(), [2, 3]);
        assert_eq!(z.as_slice::<i32>().unwrap(), [3, 2, 2, -4, -3, -2]);
        assert_eq!(
            infer("FloorDiv", &[tt(I32, &[-1, 1]), tt(I32, &[3])], &[]),
            Ok(vec![tt(I32, &[-1, 3])])
        );
        assert!(infer("FloorDiv", &[tt(I32, &[2]), tt(I64, &[2])], &[]).is_err());
    }

    #[test]
    fn maximum_propagates_nan_and_broadcasts() {
        let z = run(
            "Maximum",
            v(&[1.0f32, 5.0, f32::NAN, 2.0]),
            v(&[3.0f32, 4.0, 1.0, f32::NAN]),
        )
        .unwrap();
        let z = z.as_slice::<f32>().unwrap();
        assert_eq!(z[..2], [3.0, 5.0]);
        assert!(z[2].is_nan() && z[3].is_nan());
        let z = run("Maximum", v(&[-3i32, 0, 7]), Tensor::scalar(1i32)).unwrap();
        assert_eq!(z.as_slice::<i32>().unwrap(), [1, 1, 7]);
        assert_eq!(
            infer("Maximum", &[tt(F32, &[-1, 4]), tt(F32, &[])], &[]),
            Ok(vec![tt(F32, &[-1, 4])])
        );
    }

    /// The gradient against finite differences of max, and TensorFlow's tie rule (x wins).
    #[test]
    fn maximum_grad_routes_dy_to_the_larger_operand() {
        let x = v(&[1.0f64, 5.0, 2.0]);
        let y = v(&[3.0f64, 4.0, 2.0]);
        let dy = v(&[10.0f64, 20.0, 30.0]);
        let grad = |for_y: bool| {
            run_kernel(
                "MaximumGrad",
                &[("for_y", AttrValue::Bool(for_y))],
                &[dy.clone(), x.clone(), y.clone()],
            )
            .unwrap()
            .remove(0)
            .to_f64_vec()
        };
        let (gx, gy) = (grad(false), grad(true));
        assert_eq!(gx, [0.0, 20.0, 30.0]);
        assert_eq!(gy, [10.0, 0.0, 0.0]);
        // Away from ties, d/dx sum(dy * max(x, y)) by central differences.
        let (xs, ys, ds) = ([1.0f64, 5.0], [3.0f64, 4.0], [10.0f64, 20.0]);
        let f = |xs: &[f64]| -> f64 {
            xs.iter()
                .zip(ys)
                .zip(ds)
                .map(|((&a, b), d)| d * a.max(b))
                .sum()
        };
        for i in 0..2 {
            let (mut hi, mut lo) = (xs, xs);
            hi[i] += 1e-6;
            lo[i] -= 1e-6;
            let num = (f(&hi) - f(&lo)) / 2e-6;
            assert!((num - gx[i]).abs() < 1e-4, "{num} vs {}", gx[i]);
        }
    }

    #[test]
    fn ops_lists_what_is_registered() {
        for op in OPS {
            assert!(registry().get(op).is_some(), "{op}");
        }
    }
}
