//! Tensor shapes, possibly partially known.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A tensor shape as known at graph-construction time.
///
/// `dims == None` means the rank itself is unknown; a `None` dimension is unknown size
/// (written `-1` in files, like TensorFlow, and `?` when printed).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape {
    dims: Option<Vec<Option<usize>>>,
}

impl Shape {
    /// A fully known shape.
    pub fn known(dims: &[usize]) -> Self {
        Shape {
            dims: Some(dims.iter().map(|&d| Some(d)).collect()),
        }
    }

    /// A shape of known rank with some unknown dimensions.
    pub fn partial(dims: Vec<Option<usize>>) -> Self {
        Shape { dims: Some(dims) }
    }

    /// A shape whose rank is unknown.
    pub fn unknown() -> Self {
        Shape { dims: None }
    }

    /// A scalar (rank 0).
    pub fn scalar() -> Self {
        Shape { dims: Some(vec![]) }
    }

    /// The rank if known.
    pub fn rank(&self) -> Option<usize> {
        self.dims.as_ref().map(Vec::len)
    }

    /// The dimensions if the rank is known.
    pub fn dims(&self) -> Option<&[Option<usize>]> {
        self.dims.as_deref()
    }

    /// The dimension at `i` (unknown if the rank is unknown or the dim is).
    pub fn dim(&self, i: usize) -> Option<usize> {
        self.dims.as_ref().and_then(|d| d.get(i).copied().flatten())
    }

    /// All dimensions, when every one is known.
    pub fn as_static(&self) -> Option<Vec<usize>> {
        self.dims.as_ref()?.iter().copied().collect()
    }

    /// True when the rank and every dimension are known.
    pub fn is_static(&self) -> bool {
        self.as_static().is_some()
    }

    /// Number of elements, when static. `None` on overflow as well.
    pub fn num_elements(&self) -> Option<usize> {
        self.as_static()?
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// True if a tensor of shape `other` could have this shape (unknowns match anything).
    pub fn is_compatible_with(&self, other: &Shape) -> bool {
        match (&self.dims, &other.dims) {
            (Some(a), Some(b)) => {
                a.len() == b.len()
                    && a.iter().zip(b).all(|(x, y)| match (x, y) {
                        (Some(x), Some(y)) => x == y,
                        _ => true,
                    })
            }
            _ => true,
        }
    }

    /// The most specific shape compatible with both, if they are compatible.
    pub fn merge(&self, other: &Shape) -> Option<Shape> {
        match (&self.dims, &other.dims) {
            (None, _) => Some(other.clone()),
            (_, None) => Some(self.clone()),
            (Some(a), Some(b)) => {
                if a.len() != b.len() {
                    return None;
                }
                let mut out = Vec::with_capacity(a.len());
                for (x, y) in a.iter().zip(b) {
                    out.push(match (x, y) {
                        (Some(x), Some(y)) if x != y => return None,
                        (Some(x), _) => Some(*x),
                        (None, y) => *y,
                    });
                }
                Some(Shape::partial(out))
            }
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.dims {
            None => f.write_str("[*]"),
            Some(d) => {
                f.write_str("[")?;
                for (i, x) in d.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    match x {
                        Some(x) => write!(f, "{x}")?,
                        None => f.write_str("?")?,
                    }
                }
                f.write_str("]")
            }
        }
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape::known(d)
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Self {
        Shape::known(&d)
    }
}

/// Serialized like TensorFlow: a list of ints with `-1` for unknown dims, or `null` for unknown rank.
impl Serialize for Shape {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match &self.dims {
            None => s.serialize_none(),
            Some(d) => {
                let v: Vec<i64> = d.iter().map(|x| x.map_or(-1, |x| x as i64)).collect();
                v.serialize(s)
            }
        }
    }
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v: Option<Vec<i64>> = Option::deserialize(d)?;
        match v {
            None => Ok(Shape::unknown()),
            Some(v) => Shape::from_signed(&v).map_err(serde::de::Error::custom),
        }
    }
}

impl Shape {
    /// Builds a shape from TF-style signed dims (`-1` = unknown). Other negatives are an error.
    pub fn from_signed(v: &[i64]) -> Result<Shape, String> {
        let mut dims = Vec::with_capacity(v.len());
        for &x in v {
            dims.push(match x {
                -1 => None,
                x if x < -1 => return Err(format!("invalid dimension {x} (use -1 for unknown)")),
                x => Some(usize::try_from(x).map_err(|_| format!("dimension {x} too large"))?),
            });
        }
        Ok(Shape::partial(dims))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_and_compat() {
        let a = Shape::partial(vec![None, Some(3)]);
        let b = Shape::known(&[2, 3]);
        assert!(a.is_compatible_with(&b));
        assert_eq!(a.merge(&b), Some(b.clone()));
        assert!(!b.is_compatible_with(&Shape::known(&[3, 2])));
        assert_eq!(b.merge(&Shape::known(&[2])), None);
        assert_eq!(Shape::unknown().merge(&b), Some(b));
    }

    #[test]
    fn serde_uses_minus_one() {
        let a = Shape::partial(vec![None, Some(3)]);
        let j = serde_json::to_string(&a).unwrap();
        assert_eq!(j, "[-1,3]");
        assert_eq!(serde_json::from_str::<Shape>(&j).unwrap(), a);
        assert!(serde_json::from_str::<Shape>("[-2]").is_err());
        assert_eq!(a.to_string(), "[?, 3]");
    }

    #[test]
    fn num_elements_overflow_is_none() {
        assert_eq!(Shape::known(&[usize::MAX, 2]).num_elements(), None);
        assert_eq!(Shape::known(&[0, 5]).num_elements(), Some(0));
        assert_eq!(Shape::scalar().num_elements(), Some(1));
    }
}
