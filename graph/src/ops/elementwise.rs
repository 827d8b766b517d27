//! Shared pieces of the CPU kernels: output allocation, typed views, dtype dispatch.
//!
//! Kernels are generic over the element type and dispatched once per call on the runtime dtype
//! (one `match`, then a monomorphised loop: no per-element dynamic dispatch). `bf16` and `f16`
//! are computed by converting to `f32`, computing, and converting back.
//!
//! Outputs are made with [`Tensor::filled`] (or written into memory the runtime provides, see
//! [`OutputAlloc`]): one allocation of the output buffer, no copy (building a `Vec` and calling
//! [`Tensor::from_slice`] allocates twice and copies; see `benches/matmul.rs`, group `alloc`).

use crate::kernel::{FnKernel, Kernel, KernelContext, KernelInit, OutputAlloc};
use crate::OpError;
use crate::{DType, Element, Shape, Tensor};

/// A typed view of `t`, with the tensor error as a message.
#[inline]
pub fn slice<T: Element>(t: &Tensor) -> Result<&[T], String> {
    t.as_slice::<T>().map_err(|e| e.to_string())
}

/// Where a kernel's output is allocated (see [`OutputAlloc`]): [`FRESH`] allocates zero-filled
/// memory; a kernel passes `&ctx.output_alloc(0)` to write straight into memory the runtime
/// provides (a transport slot).
pub type Alloc<'a> = &'a OutputAlloc<'a>;

/// Fresh memory (the default [`Alloc`]).
pub const FRESH: OutputAlloc<'static> = OutputAlloc::FRESH;

/// Elements per task when a kernel splits its work over the current rayon pool (the compute
/// pool inside the executor): below this a kernel runs as one task.
pub const PAR_CHUNK: usize = 1 << 14;

/// Rows of `c` elements per parallel task (at least one).
pub fn rows_per_task(c: usize) -> usize {
    (PAR_CHUNK / c.max(1)).max(1)
}

/// A fresh zero-filled tensor.
#[inline]
pub fn fresh(dtype: DType, dims: &[usize]) -> Result<Tensor, String> {
    Tensor::zeros(dtype, dims).map_err(|e| e.to_string())
}

/// A new tensor of shape `dims` and dtype `T::DTYPE`, filled by `fill` (which receives the
/// zero-initialised elements).
pub fn new_tensor<T: Element>(
    dims: &[usize],
    fill: impl FnOnce(&mut [T]),
) -> Result<Tensor, String> {
    new_tensor_in(&FRESH, dims, fill)
}

/// Like [`new_tensor`], in memory from `alloc`: `fill` must write every element (they may hold
/// old values).
#[inline]
pub fn new_tensor_in<T: Element>(
    alloc: Alloc<'_>,
    dims: &[usize],
    fill: impl FnOnce(&mut [T]),
) -> Result<Tensor, String> {
    alloc.filled(dims, fill)
}

/// `f` applied to every element of `x` (dtype `T`), giving a tensor of dtype `O`, same shape.
pub fn map_unary<T: Element, O: Element>(x: &Tensor, f: impl Fn(T) -> O) -> Result<Tensor, String> {
    map_unary_in(&FRESH, x, f)
}

/// Like [`map_unary`], the output in memory from `alloc`.
pub fn map_unary_in<T: Element, O: Element>(
    alloc: Alloc<'_>,
    x: &Tensor,
    f: impl Fn(T) -> O,
) -> Result<Tensor, String> {
    let xs = slice::<T>(x)?;
    new_tensor_in(alloc, x.dims(), |out: &mut [O]| {
        for (o, &v) in out.iter_mut().zip(xs) {
            *o = f(v);
        }
    })
}

/// A `bf16` or `f16` tensor widened to `f32` (exact). Other dtypes are an error.
pub fn to_f32(x: &Tensor) -> Result<Tensor, String> {
    match x.dtype() {
        DType::BF16 => map_unary(x, |v: half::bf16| v.to_f32()),
        DType::F16 => map_unary(x, |v: half::f16| v.to_f32()),
        DType::F32 => Ok(x.clone()),
        d => Err(format!("cannot widen {d} to f32")),
    }
}

/// An `f32` tensor rounded to `dtype` (`bf16`, `f16`, or `f32` itself).
pub fn from_f32(x: &Tensor, dtype: DType) -> Result<Tensor, String> {
    match dtype {
        DType::BF16 => map_unary(x, half::bf16::from_f32),
        DType::F16 => map_unary(x, half::f16::from_f32),
        DType::F32 => Ok(x.clone()),
        d => Err(format!("cannot narrow f32 to {d}")),
    }
}

/// A tensor of ones (`true` for bool) of `dtype` and shape `dims`.
pub fn ones(dtype: DType, dims: &[usize]) -> Result<Tensor, String> {
    match dtype {
        DType::F32 => new_tensor(dims, |o: &mut [f32]| o.fill(1.0)),
        DType::F64 => new_tensor(dims, |o: &mut [f64]| o.fill(1.0)),
        DType::I32 => new_tensor(dims, |o: &mut [i32]| o.fill(1)),
        DType::I64 => new_tensor(dims, |o: &mut [i64]| o.fill(1)),
        DType::Bool => new_tensor(dims, |o: &mut [u8]| o.fill(1)),
        DType::BF16 => new_tensor(dims, |o: &mut [half::bf16]| o.fill(half::bf16::ONE)),
        DType::F16 => new_tensor(dims, |o: &mut [half::f16]| o.fill(half::f16::ONE)),
    }
}

/// The error for a dtype a kernel does not handle.
pub fn unsupported(op: &str, dtype: DType) -> String {
    format!("dtype {dtype} not supported by kernel {op}")
}

/// Requires two runtime inputs of one op to share a dtype.
pub fn same_dtype(op: &str, x: &Tensor, y: &Tensor) -> Result<DType, String> {
    if x.dtype() == y.dtype() {
        Ok(x.dtype())
    } else {
        Err(format!(
            "{op}: inputs have dtypes {} and {}; they must match",
            x.dtype(),
            y.dtype()
        ))
    }
}

/// Requires two runtime inputs of one op to have the same shape, naming both.
pub fn same_shape(
    op: &str,
    (na, a): (&str, &Tensor),
    (nb, b): (&str, &Tensor),
) -> Result<(), String> {
    if a.dims() == b.dims() {
        Ok(())
    } else {
        Err(format!(
            "{op}: {na} has shape {} but {nb} has shape {}; they must match",
            a.shape(),
            b.shape()
        ))
    }
}

/// Pretty form of runtime dims for messages.
pub fn shape_of(dims: &[usize]) -> Shape {
    Shape::known(dims)
}

/// Kernel factory for a stateless op computed by a plain function.
pub fn stateless(
    f: fn(&mut KernelContext<'_>) -> Result<(), OpError>,
) -> Result<Box<dyn Kernel>, OpError> {
    Ok(Box::new(FnKernel(f)))
}

/// A boolean attribute (defaults are filled in).
pub fn attr_bool(init: &KernelInit<'_>, name: &str) -> Result<bool, String> {
    match init.attr(name)? {
        crate::AttrValue::Bool(b) => Ok(*b),
        v => Err(format!("attribute `{name}` is {}, not bool", v.ty())),
    }
}

/// An int-list attribute.
pub fn attr_ints(init: &KernelInit<'_>, name: &str) -> Result<Vec<i64>, String> {
    match init.attr(name)? {
        crate::AttrValue::IntList(v) => Ok(v.clone()),
        v => Err(format!("attribute `{name}` is {}, not list(int)", v.ty())),
    }
}

/// An int attribute.
pub fn attr_int(init: &KernelInit<'_>, name: &str) -> Result<i64, String> {
    match init.attr(name)? {
        crate::AttrValue::Int(v) => Ok(*v),
        v => Err(format!("attribute `{name}` is {}, not int", v.ty())),
    }
}

/// A float attribute.
pub fn attr_float(init: &KernelInit<'_>, name: &str) -> Result<f64, String> {
    match init.attr(name)? {
        crate::AttrValue::Float(v) => Ok(*v),
        v => Err(format!("attribute `{name}` is {}, not float", v.ty())),
    }
}

/// A string attribute.
pub fn attr_str(init: &KernelInit<'_>, name: &str) -> Result<String, String> {
    match init.attr(name)? {
        crate::AttrValue::String(v) => Ok(v.to_string()),
        v => Err(format!("attribute `{name}` is {}, not string", v.ty())),
    }
}

/// Calls `$f::<T>(args)` with `T` the element type of `$dtype` (every dtype), for kernels that
/// only move elements (Transpose, Split, Concat, Gather).
macro_rules! dispatch_any {
    ($dtype:expr, $f:ident ( $($arg:expr),* )) => {
        match $dtype {
            $crate::DType::F32 => $f::<f32>($($arg),*),
            $crate::DType::F64 => $f::<f64>($($arg),*),
            $crate::DType::I32 => $f::<i32>($($arg),*),
            $crate::DType::I64 => $f::<i64>($($arg),*),
            $crate::DType::Bool => $f::<u8>($($arg),*),
            $crate::DType::BF16 => $f::<half::bf16>($($arg),*),
            $crate::DType::F16 => $f::<half::f16>($($arg),*),
        }
    };
}
pub(crate) use dispatch_any;

/// A dtype attribute.
pub fn attr_dtype(init: &KernelInit<'_>, name: &str) -> Result<DType, String> {
    match init.attr(name)? {
        crate::AttrValue::DType(v) => Ok(*v),
        v => Err(format!("attribute `{name}` is {}, not dtype", v.ty())),
    }
}

/// The float element types kernels compute in (`f32`, `f64`); `bf16`/`f16` widen to `f32`.
pub trait Real:
    Element
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// −∞.
    const NEG_INFINITY: Self;
    /// eˣ.
    fn exp(self) -> Self;
    /// ln x.
    fn ln(self) -> Self;
    /// True for NaN.
    fn is_nan(self) -> bool;
    /// The nearest value to `n`.
    fn from_usize(n: usize) -> Self;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn from_usize(n: usize) -> Self {
                n as $t
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// Applies a float expression elementwise: `float_unary!("Op", &x, |v| expr)`, where `expr` is
/// written once and compiled for `f32` and `f64`; `bf16`/`f16` go through `f32`.
/// `float_unary!(in alloc; "Op", &x, |v| expr)` writes `f32`/`f64` results in memory from
/// `alloc` (an [`Alloc`]).
macro_rules! float_unary {
    (in $alloc:expr; $op:expr, $x:expr, |$v:ident| $body:expr) => {{
        use $crate::ops::elementwise as ew;
        let alloc: ew::Alloc<'_> = $alloc;
        let x: &$crate::Tensor = $x;
        match x.dtype() {
            $crate::DType::F32 => ew::map_unary_in(alloc, x, |$v: f32| -> f32 { $body }),
            $crate::DType::F64 => ew::map_unary_in(alloc, x, |$v: f64| -> f64 { $body }),
            $crate::DType::BF16 | $crate::DType::F16 => {
                let y = ew::map_unary(&ew::to_f32(x)?, |$v: f32| -> f32 { $body })?;
                ew::from_f32(&y, x.dtype())
            }
            d => Err(ew::unsupported($op, d)),
        }
    }};
    ($op:expr, $x:expr, |$v:ident| $body:expr) => {
        $crate::ops::elementwise::float_unary!(in &$crate::ops::elementwise::FRESH; $op, $x, |$v| $body)
    };
}
pub(crate) use float_unary;

pub use crate::ops::broadcast::binary_map as binary_map_fresh;

/// Applies a binary expression with broadcasting:
/// `num_binary!("Op", &x, &y, float: |a, b| fexpr, int: |a, b| iexpr)`. The float expression is
/// compiled for `f32`/`f64` (and used for `bf16`/`f16` through `f32`), the int one for
/// `i32`/`i64`; `int: none` rejects integers.
macro_rules! num_binary {
    (in $alloc:expr; $op:expr, $x:expr, $y:expr, float: |$a:ident, $b:ident| $fb:expr, int: |$ia:ident, $ib:ident| $ibody:expr) => {{
        use $crate::ops::broadcast::binary_map_in;
        use $crate::ops::elementwise as ew;
        let alloc: ew::Alloc<'_> = $alloc;
        let (x, y): (&$crate::Tensor, &$crate::Tensor) = ($x, $y);
        match ew::same_dtype($op, x, y)? {
            $crate::DType::F32 => binary_map_in(alloc, x, y, |$a: f32, $b: f32| -> f32 { $fb }),
            $crate::DType::F64 => binary_map_in(alloc, x, y, |$a: f64, $b: f64| -> f64 { $fb }),
            $crate::DType::I32 => binary_map_in(alloc, x, y, |$ia: i32, $ib: i32| -> i32 { $ibody }),
            $crate::DType::I64 => binary_map_in(alloc, x, y, |$ia: i64, $ib: i64| -> i64 { $ibody }),
            d @ ($crate::DType::BF16 | $crate::DType::F16) => {
                let (x, y) = (ew::to_f32(x)?, ew::to_f32(y)?);
                let z = ew::binary_map_fresh(&x, &y, |$a: f32, $b: f32| -> f32 { $fb })?;
                ew::from_f32(&z, d)
            }
            d => Err(ew::unsupported($op, d)),
        }
    }};
    (in $alloc:expr; $op:expr, $x:expr, $y:expr, float: |$a:ident, $b:ident| $fb:expr, int: none) => {{
        use $crate::ops::broadcast::binary_map_in;
        use $crate::ops::elementwise as ew;
        let alloc: ew::Alloc<'_> = $alloc;
        let (x, y): (&$crate::Tensor, &$crate::Tensor) = ($x, $y);
        match ew::same_dtype($op, x, y)? {
            $crate::DType::F32 => binary_map_in(alloc, x, y, |$a: f32, $b: f32| -> f32 { $fb }),
            $crate::DType::F64 => binary_map_in(alloc, x, y, |$a: f64, $b: f64| -> f64 { $fb }),
            d @ ($crate::DType::BF16 | $crate::DType::F16) => {
                let (x, y) = (ew::to_f32(x)?, ew::to_f32(y)?);
                let z = ew::binary_map_fresh(&x, &y, |$a: f32, $b: f32| -> f32 { $fb })?;
                ew::from_f32(&z, d)
            }
            d => Err(ew::unsupported($op, d)),
        }
    }};
    ($op:expr, $x:expr, $y:expr, float: $($rest:tt)*) => {
        $crate::ops::elementwise::num_binary!(in &$crate::ops::elementwise::FRESH; $op, $x, $y, float: $($rest)*)
    };
}
pub(crate) use num_binary;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_types_round_trip_through_f32() {
        let x = Tensor::from_slice(
            &[2],
            &[half::bf16::from_f32(1.5), half::bf16::from_f32(-2.0)],
        )
        .unwrap();
        fn neg(x: &Tensor) -> Result<Tensor, String> {
            float_unary!("Neg", x, |v| -v)
        }
        fn exp(x: &Tensor) -> Result<Tensor, String> {
            float_unary!("Exp", x, |v| v.exp())
        }
        let y = neg(&x).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        assert_eq!(y.to_f64_vec(), vec![-1.5, 2.0]);
        let b = Tensor::from_slice(&[1], &[1u8]).unwrap();
        let e = exp(&b).unwrap_err();
        assert_eq!(e, "dtype bool not supported by kernel Exp");
    }
}
