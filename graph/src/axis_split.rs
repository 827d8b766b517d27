//! A tensor cut into equal shards along one axis, the layout tensor parallelism keeps its
//! weights in: [`AxisSplit::shard`] cuts a whole tensor (a `Variable` shard's initial value, a
//! checkpoint restored into shards) and [`AxisSplit::assemble`] joins the shards back (a
//! checkpoint saved whole).
//!
//! The axis is `blocks` equal blocks (a fused q/k/v weight has 3) and every block is cut into
//! `parts` equal pieces; shard `r` holds piece `r` of every block, in block order. With one
//! block the axis may be padded with zeros at its end to `padded` (a vocabulary padded to a
//! multiple of the tensor-parallel size); assembling drops the padding again.
//!
//! ```
//! use dflow_graph::axis_split::AxisSplit;
//! use dflow_graph::Tensor;
//!
//! // [q0 q1 k0 k1 v0 v1] rows, two shards: shard 0 = [q0 k0 v0], shard 1 = [q1 k1 v1].
//! let whole = Tensor::from_slice(&[6, 1], &[0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
//! let split = AxisSplit { axis: 0, blocks: 3, parts: 2, padded: 6 };
//! let s1 = split.shard(&whole, 1).unwrap();
//! assert_eq!(s1.as_slice::<f32>().unwrap(), &[1.0, 3.0, 5.0]);
//! let back = split.assemble(&[split.shard(&whole, 0).unwrap(), s1], &[6, 1]).unwrap();
//! assert_eq!(back, whole);
//! ```

use crate::Tensor;

/// How a tensor is cut along one axis (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AxisSplit {
    /// The axis cut.
    pub axis: usize,
    /// Equal blocks along the axis, each cut separately (1: the axis is one block).
    pub blocks: usize,
    /// Shards.
    pub parts: usize,
    /// The axis's length with padding (≥ the whole's; equal to it when `blocks > 1`).
    pub padded: usize,
}

impl AxisSplit {
    /// Checks the split against the whole tensor's dimensions.
    pub fn check(&self, whole: &[usize]) -> Result<(), String> {
        let Some(&len) = whole.get(self.axis) else {
            return Err(format!(
                "axis {} is outside a tensor of shape {whole:?}",
                self.axis
            ));
        };
        if self.blocks == 0 || self.parts == 0 {
            return Err("a split needs at least one block and one part".into());
        }
        if self.padded < len || (self.blocks > 1 && self.padded != len) {
            return Err(format!(
                "axis {} of {whole:?} cannot be padded to {} ({} blocks: padding needs one block)",
                self.axis, self.padded, self.blocks
            ));
        }
        if self.padded % (self.blocks * self.parts) != 0 {
            return Err(format!(
                "axis {} of {whole:?} ({} with padding) does not split into {} blocks of {} equal parts",
                self.axis, self.padded, self.blocks, self.parts
            ));
        }
        Ok(())
    }

    /// A shard's dimensions for a whole tensor of `whole` dimensions.
    pub fn shard_dims(&self, whole: &[usize]) -> Vec<usize> {
        let mut dims = whole.to_vec();
        if let Some(d) = dims.get_mut(self.axis) {
            *d = self.padded / self.parts.max(1);
        }
        dims
    }

    /// Piece length per block.
    fn piece(&self) -> usize {
        self.padded / (self.blocks * self.parts).max(1)
    }

    /// Shard `r` of `whole` (padding rows are zeros).
    pub fn shard(&self, whole: &Tensor, r: usize) -> Result<Tensor, String> {
        let dims = whole.dims().to_vec();
        self.check(&dims)?;
        if r >= self.parts {
            return Err(format!("shard {r} of {} does not exist", self.parts));
        }
        let size = whole.dtype().size_of();
        let len = dims[self.axis];
        let outer: usize = dims[..self.axis].iter().product();
        let inner: usize = dims[self.axis + 1..].iter().product::<usize>() * size;
        let block = self.padded / self.blocks;
        let piece = self.piece();
        let src = whole.as_bytes();
        let out_dims = self.shard_dims(&dims);
        let mut bytes = Vec::with_capacity(out_dims.iter().product::<usize>() * size);
        for o in 0..outer {
            for b in 0..self.blocks {
                for j in 0..piece {
                    let row = b * block + r * piece + j;
                    if row < len {
                        let at = (o * len + row) * inner;
                        bytes.extend_from_slice(&src[at..at + inner]);
                    } else {
                        bytes.resize(bytes.len() + inner, 0);
                    }
                }
            }
        }
        Tensor::from_bytes(whole.dtype(), &out_dims, &bytes).map_err(|e| e.to_string())
    }

    /// The whole tensor of `whole` dimensions from its shards in rank order (padding dropped).
    pub fn assemble(&self, shards: &[Tensor], whole: &[usize]) -> Result<Tensor, String> {
        self.check(whole)?;
        if shards.len() != self.parts {
            return Err(format!(
                "{} shards given, the split has {}",
                shards.len(),
                self.parts
            ));
        }
        let want = self.shard_dims(whole);
        let dtype = shards[0].dtype();
        for (r, s) in shards.iter().enumerate() {
            if s.dims() != want.as_slice() || s.dtype() != dtype {
                return Err(format!(
                    "shard {r} is {} {:?}, expected {dtype} {want:?}",
                    s.dtype(),
                    s.dims()
                ));
            }
        }
        let size = dtype.size_of();
        let len = whole[self.axis];
        let outer: usize = whole[..self.axis].iter().product();
        let inner: usize = whole[self.axis + 1..].iter().product::<usize>() * size;
        let block = self.padded / self.blocks;
        let piece = self.piece();
        let rows = want[self.axis];
        let mut bytes = Vec::with_capacity(whole.iter().product::<usize>() * size);
        for o in 0..outer {
            for row in 0..len {
                let (b, within) = (row / block, row % block);
                let (r, j) = (within / piece, within % piece);
                let at = (o * rows + b * piece + j) * inner;
                bytes.extend_from_slice(&shards[r].as_bytes()[at..at + inner]);
            }
        }
        Tensor::from_bytes(dtype, whole, &bytes).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn shards_assemble_back_to_the_whole(
            dims in proptest::collection::vec(1usize..5, 1..4),
            axis_pick in 0usize..3,
            blocks in 1usize..4,
            parts in 1usize..5,
            pad in 0usize..4,
        ) {
            let axis = axis_pick % dims.len();
            let mut whole_dims = dims.clone();
            let padded = dims[axis] * blocks * parts;
            whole_dims[axis] = padded;
            if blocks == 1 {
                // An axis that is not a multiple of the parts: padded with zeros.
                whole_dims[axis] = (padded - pad.min(padded - 1)).max(1);
            }
            let n: usize = whole_dims.iter().product();
            let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let whole = Tensor::from_slice(&whole_dims, &values).unwrap();
            let split = AxisSplit { axis, blocks, parts, padded };
            let shards: Vec<Tensor> = (0..parts).map(|r| split.shard(&whole, r).unwrap()).collect();
            let back = split.assemble(&shards, &whole_dims).unwrap();
            prop_assert_eq!(back, whole);
        }
    }

    #[test]
    fn padding_is_zero_and_bad_splits_are_refused() {
        let whole = Tensor::from_slice(&[3, 2], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let split = AxisSplit {
            axis: 0,
            blocks: 1,
            parts: 2,
            padded: 4,
        };
        let s1 = split.shard(&whole, 1).unwrap();
        assert_eq!(s1.as_slice::<f32>().unwrap(), &[5.0, 6.0, 0.0, 0.0]);
        // Columns: axis 1.
        let cols = AxisSplit {
            axis: 1,
            blocks: 1,
            parts: 2,
            padded: 2,
        };
        assert_eq!(
            cols.shard(&whole, 0).unwrap().as_slice::<f32>().unwrap(),
            &[1.0, 3.0, 5.0]
        );
        let odd = AxisSplit {
            axis: 0,
            blocks: 1,
            parts: 2,
            padded: 3,
        };
        assert!(odd.shard(&whole, 0).unwrap_err().contains("equal parts"));
        assert!(split
            .shard(&whole, 2)
            .unwrap_err()
            .contains("does not exist"));
        assert!(split
            .assemble(std::slice::from_ref(&s1), &[3, 2])
            .unwrap_err()
            .contains("1 shards given"));
    }
}
