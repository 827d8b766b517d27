//! RDMA transport: receive slots registered with the NIC, filled by the sender's RDMA WRITE
//! WITH IMMEDIATE, with credits so a slot is never written under its reader.
//!
//! - [`verbs`]: the [`Verbs`](verbs::Verbs) trait, the few verbs the protocol needs.
//! - [`sim`]: an in-memory fabric implementing it (tests; machines without RDMA).
//! - `ibv` (feature `rdma`): the real verbs, through `ibverbs-sys` (rdma-core).
//! - [`imm`], [`message`]: the immediate's bit layout and the control messages.
//! - [`slots`], [`routes`], [`protocol`]: the receive side, the send side, and the driver.
//! - [`plane`]: [`RdmaPlane`](plane::RdmaPlane), a [`DataPlane`](crate::DataPlane) that runs the
//!   protocol over a device, with a TCP plane for connections and control messages.
//!
//! See docs/distributed.md ("RDMA") for the protocol and how to run it on RoCE/InfiniBand.

#[cfg(feature = "rdma")]
pub mod ibv;
pub mod imm;
pub mod message;
pub mod plane;
pub mod protocol;
pub mod routes;
pub mod sim;
pub mod slots;
pub mod verbs;

pub use verbs::{Verbs, VerbsError};

/// An RDMA protocol failure, naming the peer (and the key, where there is one).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RdmaError {
    /// A peer broke the protocol (unknown slot, no credit, wrong parity, out-of-order step,
    /// length mismatch) or a Send does not fit its slot.
    #[error("peer `{peer}`: {msg}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong (names the slot and key).
        msg: String,
    },
    /// A verbs call for a peer failed.
    #[error("peer `{peer}`: {source}")]
    Peer {
        /// The peer.
        peer: String,
        /// The cause.
        source: VerbsError,
    },
    /// A slot (or its sender's staging buffer) could not be registered.
    #[error("cannot register slot {slot_id} for key {key}: {msg}")]
    Register {
        /// The slot id.
        slot_id: u32,
        /// The key.
        key: String,
        /// Why (a [`VerbsError::Register`] names the memlock fix).
        msg: String,
    },
    /// The device could not be used.
    #[error(transparent)]
    Device(#[from] VerbsError),
}
