//! The 32-bit immediate of every RDMA WRITE WITH IMMEDIATE.
//!
//! ```text
//!  31 30 | 29     | 28 ........................ 0
//!  kind  | parity | slot id (0 ..= MAX_SLOT_ID)
//! ```
//!
//! - `kind` `00`: the sender wrote the slot's tensor (payload, then its step word); `01`: the
//!   receiver grants the sender a credit for the slot; `10` and `11` are reserved and refused.
//! - `parity`: the low bit of the step id the write (or the consumed write, for a credit) belongs
//!   to; checked against the step word, so a stale or reordered write is caught.
//! - `slot id`: the receive slot, as registered (29 bits).
//!
//! ```
//! use dflow_transport::rdma::imm::{Imm, ImmKind};
//! let imm = Imm { kind: ImmKind::Data, slot_id: 7, parity: 1 };
//! assert_eq!(imm.encode(), 0x2000_0007);
//! assert_eq!(Imm::decode(0x2000_0007), Ok(imm));
//! ```

/// The largest slot id an immediate can carry.
pub const MAX_SLOT_ID: u32 = (1 << 29) - 1;

const KIND_SHIFT: u32 = 30;
const PARITY_BIT: u32 = 1 << 29;

/// What an immediate announces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ImmKind {
    /// A tensor landed in the slot.
    Data,
    /// The slot is free again: the sender may write it once more.
    Credit,
}

/// A decoded immediate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Imm {
    /// Data or credit.
    pub kind: ImmKind,
    /// The receive slot.
    pub slot_id: u32,
    /// Low bit of the step id (0 or 1).
    pub parity: u8,
}

/// An immediate that does not follow the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("immediate {0:#010x} has the reserved kind {}", .0 >> KIND_SHIFT)]
pub struct BadImm(pub u32);

impl Imm {
    /// The immediate for `kind` on `slot_id` in `step`. `slot_id` must be at most
    /// [`MAX_SLOT_ID`] (checked when the slot is registered).
    pub fn new(kind: ImmKind, slot_id: u32, step: u64) -> Imm {
        Imm {
            kind,
            slot_id,
            parity: (step & 1) as u8,
        }
    }

    /// Packs it into 32 bits.
    pub fn encode(self) -> u32 {
        debug_assert!(self.slot_id <= MAX_SLOT_ID);
        let kind = match self.kind {
            ImmKind::Data => 0,
            ImmKind::Credit => 1,
        };
        (kind << KIND_SHIFT)
            | if self.parity & 1 == 1 { PARITY_BIT } else { 0 }
            | (self.slot_id & MAX_SLOT_ID)
    }

    /// Unpacks 32 bits (from a peer: a reserved kind is an error).
    pub fn decode(raw: u32) -> Result<Imm, BadImm> {
        let kind = match raw >> KIND_SHIFT {
            0 => ImmKind::Data,
            1 => ImmKind::Credit,
            _ => return Err(BadImm(raw)),
        };
        Ok(Imm {
            kind,
            slot_id: raw & MAX_SLOT_ID,
            parity: u8::from(raw & PARITY_BIT != 0),
        })
    }

    /// True when `step` has this immediate's parity.
    pub fn matches_step(self, step: u64) -> bool {
        (step & 1) as u8 == self.parity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trips(slot_id in 0..=MAX_SLOT_ID, step in any::<u64>(), credit in any::<bool>()) {
            let kind = if credit { ImmKind::Credit } else { ImmKind::Data };
            let imm = Imm::new(kind, slot_id, step);
            let back = Imm::decode(imm.encode()).unwrap();
            prop_assert_eq!(back, imm);
            prop_assert!(back.matches_step(step));
            prop_assert!(!back.matches_step(step.wrapping_add(1)));
        }

        #[test]
        fn decode_never_panics_and_reencodes(raw in any::<u32>()) {
            match Imm::decode(raw) {
                Ok(imm) => prop_assert_eq!(imm.encode(), raw),
                Err(BadImm(r)) => prop_assert!(r >> 30 >= 2),
            }
        }
    }

    #[test]
    fn layout_is_fixed() {
        assert_eq!(Imm::new(ImmKind::Data, 0, 0).encode(), 0);
        assert_eq!(
            Imm::new(ImmKind::Data, MAX_SLOT_ID, 0).encode(),
            0x1fff_ffff
        );
        assert_eq!(Imm::new(ImmKind::Data, 5, 3).encode(), 0x2000_0005);
        assert_eq!(Imm::new(ImmKind::Credit, 5, 2).encode(), 0x4000_0005);
        assert_eq!(Imm::decode(0x8000_0001), Err(BadImm(0x8000_0001)));
        assert_eq!(Imm::decode(0xc000_0000), Err(BadImm(0xc000_0000)));
    }
}
