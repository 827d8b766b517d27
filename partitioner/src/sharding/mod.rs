//! Placements of tensors over a device-mesh axis (GSPMD, PyTorch DTensor): each tensor is
//! [`Placement::Shard`] along one dimension, [`Placement::Replicate`]d, or
//! [`Placement::Partial`] (every rank holds a term of an element-wise sum). Changing placement
//! is one collective ([`transition`], the table below); each op has a sharding rule
//! ([`rules`]) giving its output's placement from its inputs'. The tensor-parallel strategy
//! ([`crate::strategy::tensor`]) is Megatron's layout written as placements of the GPT's
//! weights; docs/tensor-parallel.md walks through it.
//!
//! | from → to          | collective                     | bytes each rank sends (ring, N ranks, B bytes whole) |
//! |--------------------|--------------------------------|------------------------------------------------------|
//! | Shard(d) → Replicate | all-gather along d           | (N−1)/N · B                                           |
//! | Partial → Replicate  | all-reduce (sum)             | 2(N−1)/N · B                                          |
//! | Partial → Shard(d)   | reduce-scatter along d       | (N−1)/N · B                                           |
//! | Shard(i) → Shard(j)  | all-to-all                   | (N−1)/N · B/N                                         |
//! | Replicate → Shard(d) | local slice (no traffic)     | 0                                                     |
//! | same → same          | nothing                      | 0                                                     |
//!
//! (All-to-all: each rank sends (N−1)/N of its shard of B/N bytes.) The ops, forward and
//! backward, are listed in [`propagate`].
//!
//! Replicate → Partial (keep the value on rank 0, zeros elsewhere) and Shard → Partial are
//! never needed by the rules here and are refused.

pub mod propagate;
pub mod rules;

use std::fmt;

pub use dflow_graph::sharding::Placement;

/// The collective that changes a tensor's placement (see the module's table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// Already there.
    Nothing,
    /// Gather the shards along a dimension.
    AllGather {
        /// The sharded dimension.
        dim: usize,
    },
    /// Sum the partial terms on every rank.
    AllReduce,
    /// Sum the partial terms, each rank keeping its slice along a dimension.
    ReduceScatter {
        /// The dimension the result is sharded along.
        dim: usize,
    },
    /// Re-shard from one dimension to another.
    AllToAll {
        /// Sharded along this dimension before.
        from: usize,
        /// And along this one after.
        to: usize,
    },
    /// Keep the rank's slice of a replicated tensor: no communication.
    LocalSlice {
        /// The dimension sliced.
        dim: usize,
    },
}

impl Transition {
    /// The tensor-parallel op that runs it (`graph/src/ops/collective_tp.rs`; `None`: already
    /// there). Their gradients are those of a replicated loss
    /// ([`propagate::Inserted::transitions`]).
    pub fn op(self) -> Option<&'static str> {
        match self {
            Transition::Nothing => None,
            Transition::LocalSlice { .. } => Some("CollectiveTpSlice"),
            Transition::AllGather { .. } => Some("CollectiveTpAllGather"),
            Transition::AllReduce => Some("CollectiveTpReduce"),
            Transition::ReduceScatter { .. } => Some("CollectiveTpReduceScatter"),
            Transition::AllToAll { .. } => Some("CollectiveTpAllToAll"),
        }
    }

    /// Bytes each of `ranks` ranks sends for a tensor of `bytes` bytes whole (ring algorithms).
    pub fn bytes_sent(self, bytes: usize, ranks: usize) -> usize {
        let n = ranks.max(1);
        match self {
            Transition::Nothing | Transition::LocalSlice { .. } => 0,
            Transition::AllGather { .. } | Transition::ReduceScatter { .. } => (n - 1) * bytes / n,
            Transition::AllReduce => 2 * (n - 1) * bytes / n,
            Transition::AllToAll { .. } => (n - 1) * bytes / (n * n),
        }
    }
}

impl fmt::Display for Transition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transition::Nothing => f.write_str("nothing"),
            Transition::AllGather { dim } => write!(f, "all-gather along {dim}"),
            Transition::AllReduce => f.write_str("all-reduce (sum)"),
            Transition::ReduceScatter { dim } => write!(f, "reduce-scatter along {dim}"),
            Transition::AllToAll { from, to } => write!(f, "all-to-all {from} → {to}"),
            Transition::LocalSlice { dim } => write!(f, "local slice along {dim}"),
        }
    }
}

/// The collective that turns a tensor placed `from` into one placed `to`.
pub fn transition(from: Placement, to: Placement) -> Result<Transition, String> {
    use Placement::*;
    Ok(match (from, to) {
        (a, b) if a == b => Transition::Nothing,
        (Shard(dim), Replicate) => Transition::AllGather { dim },
        (Partial, Replicate) => Transition::AllReduce,
        (Partial, Shard(dim)) => Transition::ReduceScatter { dim },
        (Shard(from), Shard(to)) => Transition::AllToAll { from, to },
        (Replicate, Shard(dim)) => Transition::LocalSlice { dim },
        (a, b) => {
            return Err(format!(
                "no collective turns a {a} tensor into a {b} one (a partial sum is made, not converted to)"
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Placement::*;

    #[test]
    fn the_table_of_transitions() {
        assert_eq!(
            transition(Shard(1), Replicate),
            Ok(Transition::AllGather { dim: 1 })
        );
        assert_eq!(transition(Partial, Replicate), Ok(Transition::AllReduce));
        assert_eq!(
            transition(Partial, Shard(0)),
            Ok(Transition::ReduceScatter { dim: 0 })
        );
        assert_eq!(
            transition(Shard(0), Shard(2)),
            Ok(Transition::AllToAll { from: 0, to: 2 })
        );
        assert_eq!(
            transition(Replicate, Shard(0)),
            Ok(Transition::LocalSlice { dim: 0 })
        );
        assert_eq!(transition(Shard(1), Shard(1)), Ok(Transition::Nothing));
        assert!(transition(Replicate, Partial).is_err());
        assert!(transition(Shard(0), Partial).is_err());
        // Ring bytes: an all-reduce of 1000 bytes over 4 ranks sends 1500 from each.
        assert_eq!(Transition::AllReduce.bytes_sent(1000, 4), 1500);
        assert_eq!(Transition::AllGather { dim: 0 }.bytes_sent(1000, 4), 750);
        assert_eq!(Transition::AllReduce.op(), Some("CollectiveTpReduce"));
        assert_eq!(
            Transition::LocalSlice { dim: 0 }.op(),
            Some("CollectiveTpSlice")
        );
        assert_eq!(Transition::Nothing.op(), None);
    }
}
