//! What every collective message says about the call it belongs to, and the frame header that
//! carries it. Ranks compare fingerprints on every frame, so two ranks in different collectives
//! (another op, dtype, count or root, or one rank a call behind) fail instead of mixing data.

use super::scalar::{dtype_code, dtype_from_code, ReduceOp};
use dflow_graph::DType;
use std::fmt;

/// The kind of call a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveOp {
    /// A point-to-point message (`Channel::send`).
    PointToPoint,
    /// Broadcast from a root.
    Broadcast,
    /// Scatter from a root.
    Scatter,
    /// Gather to a root.
    Gather,
    /// Reduce to a root.
    Reduce,
    /// All-reduce.
    AllReduce,
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-to-all.
    AllToAll,
    /// Barrier.
    Barrier,
}

impl CollectiveOp {
    const ALL: [CollectiveOp; 10] = [
        CollectiveOp::PointToPoint,
        CollectiveOp::Broadcast,
        CollectiveOp::Scatter,
        CollectiveOp::Gather,
        CollectiveOp::Reduce,
        CollectiveOp::AllReduce,
        CollectiveOp::AllGather,
        CollectiveOp::ReduceScatter,
        CollectiveOp::AllToAll,
        CollectiveOp::Barrier,
    ];

    /// The snake-case name (`all_reduce`, ...), as the CLI spells it.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::PointToPoint => "send",
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::Scatter => "scatter",
            CollectiveOp::Gather => "gather",
            CollectiveOp::Reduce => "reduce",
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::AllToAll => "all_to_all",
            CollectiveOp::Barrier => "barrier",
        }
    }

    fn code(self) -> u8 {
        CollectiveOp::ALL
            .iter()
            .position(|o| *o == self)
            .unwrap_or(0) as u8
    }

    fn from_code(c: u8) -> Option<CollectiveOp> {
        CollectiveOp::ALL.get(usize::from(c)).copied()
    }
}

/// Identifies one collective call: ranks in the same call have equal fingerprints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    /// The communicator's group id (a hash of its members).
    pub group: u32,
    /// The call's sequence number within the group, from 0.
    pub seq: u64,
    /// The collective.
    pub op: CollectiveOp,
    /// Element type (`None` for raw bytes).
    pub dtype: Option<DType>,
    /// Reduce op, for reducing collectives.
    pub reduce: Option<ReduceOp>,
    /// Root rank (0 for collectives without one).
    pub root: u32,
    /// Element count as the call defines it (per-rank count for scatter, gather, all-gather).
    pub count: u64,
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} #{} [", self.op.name(), self.seq)?;
        match self.dtype {
            Some(d) => write!(f, "{} x {}", d.name(), self.count)?,
            None => write!(f, "{} bytes", self.count)?,
        }
        if let Some(r) = self.reduce {
            write!(f, ", {r}")?;
        }
        if matches!(
            self.op,
            CollectiveOp::Broadcast
                | CollectiveOp::Scatter
                | CollectiveOp::Gather
                | CollectiveOp::Reduce
        ) {
            write!(f, ", root {}", self.root)?;
        }
        write!(f, ", group {:08x}]", self.group)
    }
}

impl Fingerprint {
    /// The call's short name for messages: `all_reduce #17`.
    pub fn call(&self) -> String {
        format!("{} #{}", self.op.name(), self.seq)
    }
}

/// Bytes of a frame header.
pub const HEADER_LEN: usize = 48;
const MAGIC: [u8; 4] = *b"DFC1";
/// Longest abort message accepted.
pub const MAX_ABORT_LEN: usize = 4096;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// Payload bytes for a posted receive.
    Data,
    /// The sender failed the call; the payload is its reason (UTF-8, at most [`MAX_ABORT_LEN`]).
    Abort,
    /// The sender is waiting inside the fingerprint's call (stall inspection); no payload.
    Joined,
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the frame carries.
    pub kind: FrameKind,
    /// The call it belongs to.
    pub fp: Fingerprint,
    /// Message tag within the call (or the user's tag for point-to-point messages).
    pub tag: u64,
    /// Payload bytes following the header.
    pub len: u64,
}

impl Header {
    /// The header's wire bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = match self.kind {
            FrameKind::Data => 1,
            FrameKind::Abort => 2,
            FrameKind::Joined => 3,
        };
        b[5] = self.fp.op.code();
        b[6] = dtype_code(self.fp.dtype);
        b[7] = self.fp.reduce.map_or(0, ReduceOp::code);
        b[8..12].copy_from_slice(&self.fp.group.to_le_bytes());
        b[12..16].copy_from_slice(&self.fp.root.to_le_bytes());
        b[16..24].copy_from_slice(&self.fp.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.fp.count.to_le_bytes());
        b[32..40].copy_from_slice(&self.tag.to_le_bytes());
        b[40..48].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and checks a header: magic, known codes, and the payload bound of control frames.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, String> {
        if b[0..4] != MAGIC {
            return Err(format!(
                "bad frame magic {:02x?} (not a dflow collective stream, or out of sync)",
                &b[0..4]
            ));
        }
        let kind = match b[4] {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            3 => FrameKind::Joined,
            k => return Err(format!("unknown frame kind {k}")),
        };
        let op =
            CollectiveOp::from_code(b[5]).ok_or_else(|| format!("unknown op code {}", b[5]))?;
        let dtype = dtype_from_code(b[6]).ok_or_else(|| format!("unknown dtype code {}", b[6]))?;
        let reduce =
            ReduceOp::from_code(b[7]).ok_or_else(|| format!("unknown reduce code {}", b[7]))?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        let h = Header {
            kind,
            fp: Fingerprint {
                group: u32_at(8),
                root: u32_at(12),
                seq: u64_at(16),
                count: u64_at(24),
                op,
                dtype,
                reduce,
            },
            tag: u64_at(32),
            len: u64_at(40),
        };
        match kind {
            FrameKind::Abort if h.len > MAX_ABORT_LEN as u64 => Err(format!(
                "abort frame of {} bytes (at most {MAX_ABORT_LEN})",
                h.len
            )),
            FrameKind::Joined if h.len != 0 => {
                Err(format!("joined frame with a {}-byte payload", h.len))
            }
            _ => Ok(h),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip_and_rejects() {
        let h = Header {
            kind: FrameKind::Data,
            fp: Fingerprint {
                group: 7,
                seq: 9,
                op: CollectiveOp::AllReduce,
                dtype: Some(DType::BF16),
                reduce: Some(ReduceOp::Avg),
                root: 0,
                count: 1 << 40,
            },
            tag: 3,
            len: 12,
        };
        let b = h.encode();
        assert_eq!(Header::decode(&b), Ok(h));
        let mut bad = b;
        bad[0] = b'X';
        assert!(Header::decode(&bad).unwrap_err().contains("magic"));
        let mut bad = b;
        bad[5] = 99;
        assert!(Header::decode(&bad).unwrap_err().contains("op code"));
        let mut abort = h;
        abort.kind = FrameKind::Abort;
        abort.len = 1 << 20;
        assert!(Header::decode(&abort.encode())
            .unwrap_err()
            .contains("abort frame"));
        assert!(h
            .fp
            .to_string()
            .contains("all_reduce #9 [bf16 x 1099511627776, avg"));
    }
}
