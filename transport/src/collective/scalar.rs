//! The element types collectives move and reduce, and the reduce operations.

use dflow_graph::DType;
use half::bf16;
use std::fmt;

/// How a reducing collective combines the ranks' values, element by element.
///
/// Integers use wrapping arithmetic (an overflowing sum or product wraps rather than panics);
/// `Avg` on integers is the wrapped sum divided by the rank count, truncated toward zero. `Min`
/// and `Max` on floats follow `f32::min`/`f32::max`: a NaN loses against a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean over the ranks (the sum divided by the rank count).
    Avg,
}

impl ReduceOp {
    /// Every reduce op, in a stable order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// The lower-case name (`sum`, `avg`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Prod => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Avg => 5,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Option<ReduceOp>> {
        Some(match code {
            0 => None,
            1 => Some(ReduceOp::Sum),
            2 => Some(ReduceOp::Prod),
            3 => Some(ReduceOp::Min),
            4 => Some(ReduceOp::Max),
            5 => Some(ReduceOp::Avg),
            _ => return None,
        })
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An element type that collectives can move and reduce: `f32`, `f64`, `i32`, `i64` and
/// [`half::bf16`]. Buffers are plain typed slices; a [`dflow_graph::Tensor`] hands its data over
/// with `as_slice_mut::<T>()`.
pub trait Scalar: bytemuck::Pod + Send + Sync + fmt::Debug + 'static {
    /// The matching graph dtype (carried in every collective's fingerprint).
    const DTYPE: DType;

    /// `acc[i] = acc[i] (op) other[i]`; `Avg` accumulates like `Sum`. Lengths are equal.
    fn reduce_into(acc: &mut [Self], other: &[Self], op: ReduceOp);

    /// Turns an accumulated `Avg` (a sum over `ranks` ranks) into the mean.
    fn finish_avg(buf: &mut [Self], ranks: usize);
}

macro_rules! float_scalar {
    ($t:ty, $dtype:expr) => {
        impl Scalar for $t {
            const DTYPE: DType = $dtype;

            fn reduce_into(acc: &mut [Self], other: &[Self], op: ReduceOp) {
                let pairs = acc.iter_mut().zip(other);
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(a, b)| *a += *b),
                    ReduceOp::Prod => pairs.for_each(|(a, b)| *a *= *b),
                    ReduceOp::Min => pairs.for_each(|(a, b)| *a = a.min(*b)),
                    ReduceOp::Max => pairs.for_each(|(a, b)| *a = a.max(*b)),
                }
            }

            fn finish_avg(buf: &mut [Self], ranks: usize) {
                let n = ranks as $t;
                buf.iter_mut().for_each(|a| *a /= n);
            }
        }
    };
}

macro_rules! int_scalar {
    ($t:ty, $dtype:expr) => {
        impl Scalar for $t {
            const DTYPE: DType = $dtype;

            fn reduce_into(acc: &mut [Self], other: &[Self], op: ReduceOp) {
                let pairs = acc.iter_mut().zip(other);
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => {
                        pairs.for_each(|(a, b)| *a = a.wrapping_add(*b))
                    }
                    ReduceOp::Prod => pairs.for_each(|(a, b)| *a = a.wrapping_mul(*b)),
                    ReduceOp::Min => pairs.for_each(|(a, b)| *a = (*a).min(*b)),
                    ReduceOp::Max => pairs.for_each(|(a, b)| *a = (*a).max(*b)),
                }
            }

            fn finish_avg(buf: &mut [Self], ranks: usize) {
                let n = ranks as $t;
                buf.iter_mut().for_each(|a| *a = a.wrapping_div(n));
            }
        }
    };
}

float_scalar!(f32, DType::F32);
float_scalar!(f64, DType::F64);
int_scalar!(i32, DType::I32);
int_scalar!(i64, DType::I64);

impl Scalar for bf16 {
    const DTYPE: DType = DType::BF16;

    /// Computed in f32 and rounded back to bf16 once per step.
    fn reduce_into(acc: &mut [Self], other: &[Self], op: ReduceOp) {
        let f = |x: f32, y: f32| match op {
            ReduceOp::Sum | ReduceOp::Avg => x + y,
            ReduceOp::Prod => x * y,
            ReduceOp::Min => x.min(y),
            ReduceOp::Max => x.max(y),
        };
        for (a, b) in acc.iter_mut().zip(other) {
            *a = bf16::from_f32(f(a.to_f32(), b.to_f32()));
        }
    }

    fn finish_avg(buf: &mut [Self], ranks: usize) {
        let n = ranks as f32;
        buf.iter_mut()
            .for_each(|a| *a = bf16::from_f32(a.to_f32() / n));
    }
}

/// Wire code of a dtype (0 is raw bytes, for point-to-point messages).
pub(crate) fn dtype_code(d: Option<DType>) -> u8 {
    match d {
        None => 0,
        Some(d) => 1 + DType::ALL.iter().position(|x| *x == d).unwrap_or(0) as u8,
    }
}

/// The dtype of a wire code; `None` for an unknown code.
pub(crate) fn dtype_from_code(code: u8) -> Option<Option<DType>> {
    match code {
        0 => Some(None),
        c => DType::ALL.get(usize::from(c) - 1).map(|d| Some(*d)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_reductions_wrap_and_truncate() {
        let mut a = [i32::MAX, 7, -7];
        i32::reduce_into(&mut a, &[1, 0, 0], ReduceOp::Sum);
        assert_eq!(a, [i32::MIN, 7, -7]);
        i32::finish_avg(&mut a[1..], 2);
        assert_eq!(a[1..], [3, -3]);
    }

    #[test]
    fn dtype_codes_round_trip() {
        for d in DType::ALL {
            assert_eq!(dtype_from_code(dtype_code(Some(d))), Some(Some(d)));
        }
        assert_eq!(dtype_from_code(0), Some(None));
        assert_eq!(dtype_from_code(200), None);
    }
}
