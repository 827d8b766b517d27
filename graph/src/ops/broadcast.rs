//! NumPy broadcasting for the binary elementwise kernels (`Add`, `Sub`, `Mul`, `Div`, `Equal`).
//!
//! # Rules
//!
//! Two shapes are aligned on the right; the shorter one is padded on the left with 1s. In each
//! position the sizes must be equal or one of them must be 1; the result takes the larger size
//! and a size-1 input is repeated along it. A 0-sized dimension broadcasts like any other size
//! (`[0, 3]` with `[3]` gives `[0, 3]`; `[0]` with `[1]` gives `[0]`; `[0]` with `[2]` is an
//! error). The static counterpart over partially known shapes is
//! [`crate::ops::math::broadcast_shapes`].
//!
//! # Paths
//!
//! [`binary_map`] picks the cheapest loop that fits, each allocating only the output tensor:
//! - same shape: a straight zip;
//! - one side holds a single element and the other has the result's shape: a map;
//! - one side's shape (leading 1s dropped) is a suffix of the other's, e.g. a bias row
//!   `[n]` against `[batch, n]`: the short side is re-read once per row;
//! - anything else: a strided walk with stride 0 along broadcast dimensions, vectorisable
//!   along the innermost dimension.
//!
//! ```
//! use dflow_graph::ops::broadcast::{binary_map, broadcast_dims};
//! use dflow_graph::Tensor;
//! assert_eq!(broadcast_dims(&[3, 1], &[4]).unwrap(), vec![3, 4]);
//! let col = Tensor::from_slice(&[2, 1], &[10.0f32, 20.0]).unwrap();
//! let row = Tensor::from_slice(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
//! let z = binary_map(&col, &row, |a: f32, b: f32| a + b).unwrap();
//! assert_eq!(z.dims(), &[2, 3]);
//! assert_eq!(z.as_slice::<f32>().unwrap(), &[11.0, 12.0, 13.0, 21.0, 22.0, 23.0]);
//! ```

use super::elementwise::{new_tensor_in, slice, Alloc, FRESH};
use crate::{Element, Shape, Tensor};

/// The dimensions of the broadcast of runtime shapes `a` and `b`, or an error naming both.
pub fn broadcast_dims(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    let rank = a.len().max(b.len());
    let at = |d: &[usize], i: usize| {
        let pad = rank - d.len();
        if i < pad {
            1
        } else {
            d[i - pad]
        }
    };
    (0..rank)
        .map(|i| match (at(a, i), at(b, i)) {
            (x, y) if x == y => Ok(x),
            (1, y) => Ok(y),
            (x, 1) => Ok(x),
            (x, y) => Err(format!(
                "shapes {} and {} are not broadcastable (dimension {i} of the result: {x} vs {y})",
                Shape::known(a),
                Shape::known(b)
            )),
        })
        .collect()
}

/// `dims` without its leading 1s.
fn strip_ones(dims: &[usize]) -> &[usize] {
    let k = dims.iter().take_while(|&&d| d == 1).count();
    &dims[k..]
}

/// Element strides of an input of shape `dims` read in the coordinates of the broadcast shape
/// `out` (0 along dimensions the input repeats).
fn broadcast_strides(dims: &[usize], out: &[usize]) -> Vec<usize> {
    let pad = out.len() - dims.len();
    let mut strides = vec![0; out.len()];
    let mut s = 1;
    for i in (0..dims.len()).rev() {
        if dims[i] != 1 {
            strides[pad + i] = s;
        }
        s *= dims[i];
    }
    strides
}

/// `f` applied elementwise to `x` and `y` under NumPy broadcasting (see the module docs). Both
/// inputs must have dtype `T`; the output has dtype `O` and the broadcast shape.
pub fn binary_map<T: Element, O: Element>(
    x: &Tensor,
    y: &Tensor,
    f: impl Fn(T, T) -> O,
) -> Result<Tensor, String> {
    binary_map_in(&FRESH, x, y, f)
}

/// Like [`binary_map`], the output in memory from `alloc` (every element is written).
///
/// The same-shape path is inlined into the kernel (the common case, and for small tensors the
/// call and the moves of its result were a visible part of a node's cost); broadcasting is not.
#[inline]
pub fn binary_map_in<T: Element, O: Element>(
    alloc: Alloc<'_>,
    x: &Tensor,
    y: &Tensor,
    f: impl Fn(T, T) -> O,
) -> Result<Tensor, String> {
    let (xs, ys) = (slice::<T>(x)?, slice::<T>(y)?);
    // Scalars first: comparing two empty slices still calls `memcmp`.
    if (x.rank() == 0 && y.rank() == 0) || x.dims() == y.dims() {
        return new_tensor_in(alloc, x.dims(), |out: &mut [O]| {
            for ((o, &a), &b) in out.iter_mut().zip(xs).zip(ys) {
                *o = f(a, b);
            }
        });
    }
    broadcast_map_in(alloc, x, y, (xs, ys), f)
}

/// [`binary_map_in`] for inputs of different shapes.
fn broadcast_map_in<T: Element, O: Element>(
    alloc: Alloc<'_>,
    x: &Tensor,
    y: &Tensor,
    (xs, ys): (&[T], &[T]),
    f: impl Fn(T, T) -> O,
) -> Result<Tensor, String> {
    let dims = broadcast_dims(x.dims(), y.dims())?;
    let n: usize = dims.iter().product();
    if n == 0 {
        return new_tensor_in(alloc, &dims, |_: &mut [O]| {});
    }
    if dims == x.dims() {
        if let [b] = ys {
            return new_tensor_in(alloc, &dims, |out: &mut [O]| {
                for (o, &a) in out.iter_mut().zip(xs) {
                    *o = f(a, *b);
                }
            });
        }
        if x.dims().ends_with(strip_ones(y.dims())) {
            return new_tensor_in(alloc, &dims, |out: &mut [O]| {
                for (oc, xc) in out.chunks_mut(ys.len()).zip(xs.chunks(ys.len())) {
                    for ((o, &a), &b) in oc.iter_mut().zip(xc).zip(ys) {
                        *o = f(a, b);
                    }
                }
            });
        }
    }
    if dims == y.dims() {
        if let [a] = xs {
            return new_tensor_in(alloc, &dims, |out: &mut [O]| {
                for (o, &b) in out.iter_mut().zip(ys) {
                    *o = f(*a, b);
                }
            });
        }
        if y.dims().ends_with(strip_ones(x.dims())) {
            return new_tensor_in(alloc, &dims, |out: &mut [O]| {
                for (oc, yc) in out.chunks_mut(xs.len()).zip(ys.chunks(xs.len())) {
                    for ((o, &a), &b) in oc.iter_mut().zip(xs).zip(yc) {
                        *o = f(a, b);
                    }
                }
            });
        }
    }
    strided(alloc, xs, ys, x.dims(), y.dims(), &dims, f)
}

/// The general path: walks the output row by row, advancing each input by its broadcast strides.
fn strided<T: Element, O: Element>(
    alloc: Alloc<'_>,
    xs: &[T],
    ys: &[T],
    xd: &[usize],
    yd: &[usize],
    dims: &[usize],
    f: impl Fn(T, T) -> O,
) -> Result<Tensor, String> {
    let (sx, sy) = (broadcast_strides(xd, dims), broadcast_strides(yd, dims));
    let r = dims.len();
    // r ≥ 1 here: two rank-0 inputs have the same shape.
    let inner = dims[r - 1];
    let (ix, iy) = (sx[r - 1], sy[r - 1]);
    new_tensor_in(alloc, dims, |out: &mut [O]| {
        let mut idx = vec![0usize; r - 1];
        let (mut ox, mut oy) = (0usize, 0usize);
        for row in out.chunks_mut(inner) {
            for (k, o) in row.iter_mut().enumerate() {
                *o = f(xs[ox + k * ix], ys[oy + k * iy]);
            }
            for d in (0..r - 1).rev() {
                idx[d] += 1;
                ox += sx[d];
                oy += sy[d];
                if idx[d] < dims[d] {
                    break;
                }
                ox -= sx[d] * dims[d];
                oy -= sy[d] * dims[d];
                idx[d] = 0;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(dims: &[usize]) -> Tensor {
        let n: usize = dims.iter().product();
        let v: Vec<i64> = (0..n as i64).collect();
        Tensor::from_slice(dims, &v).unwrap()
    }

    /// Reference: index arithmetic on every output element.
    fn naive(x: &Tensor, y: &Tensor) -> Vec<i64> {
        let dims = broadcast_dims(x.dims(), y.dims()).unwrap();
        let n: usize = dims.iter().product();
        let (xs, ys) = (x.as_slice::<i64>().unwrap(), y.as_slice::<i64>().unwrap());
        let pick = |d: &[usize], s: &[i64], coord: &[usize]| {
            let pad = coord.len() - d.len();
            let mut off = 0;
            for (i, &di) in d.iter().enumerate() {
                off = off * di + if di == 1 { 0 } else { coord[pad + i] };
            }
            s[off]
        };
        (0..n)
            .map(|mut lin| {
                let mut coord = vec![0; dims.len()];
                for i in (0..dims.len()).rev() {
                    coord[i] = lin % dims[i];
                    lin /= dims[i];
                }
                pick(x.dims(), xs, &coord) * 1000 + pick(y.dims(), ys, &coord)
            })
            .collect()
    }

    #[test]
    fn every_path_matches_index_arithmetic() {
        let shapes: &[&[usize]] = &[
            &[],
            &[1],
            &[3],
            &[2, 3],
            &[2, 1],
            &[1, 3],
            &[4, 2, 3],
            &[4, 1, 3],
            &[1, 2, 1],
            &[0, 3],
            &[1, 1, 3],
        ];
        for a in shapes {
            for b in shapes {
                let (x, y) = (t(a), t(b));
                match broadcast_dims(a, b) {
                    Ok(dims) => {
                        let z = binary_map(&x, &y, |p: i64, q: i64| p * 1000 + q).unwrap();
                        assert_eq!(z.dims(), &dims[..], "{a:?} {b:?}");
                        assert_eq!(z.as_slice::<i64>().unwrap(), naive(&x, &y), "{a:?} {b:?}");
                    }
                    Err(e) => {
                        let e2 = binary_map(&x, &y, |p: i64, q: i64| p + q).unwrap_err();
                        assert_eq!(e, e2);
                        assert!(e.contains(&Shape::known(a).to_string()), "{e}");
                    }
                }
            }
        }
    }
}
