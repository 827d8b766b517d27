//! Why a collective failed. Every message names the call (`all_reduce #17`) and the ranks
//! involved; ranks are the communicator's own (group) ranks.

use super::fingerprint::Fingerprint;
use std::time::Duration;

/// A failed collective or point-to-point call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    /// Two ranks entered different collectives (op, dtype, count, root or sequence number).
    #[error("{call}: collective mismatch with rank {peer}: this rank (rank {rank}) called {ours}, rank {peer} called {theirs}")]
    Mismatch {
        /// The call on this rank.
        call: String,
        /// This rank.
        rank: usize,
        /// The other rank.
        peer: usize,
        /// This rank's fingerprint.
        ours: Fingerprint,
        /// The other rank's fingerprint.
        theirs: Fingerprint,
    },
    /// Another rank failed the call and told this one.
    #[error("{call}: aborted by rank {from}: {reason}")]
    Aborted {
        /// The call on this rank.
        call: String,
        /// The rank that sent the abort.
        from: usize,
        /// Its reason.
        reason: String,
    },
    /// The call did not finish within its timeout.
    #[error("{call}: timed out after {after:?} at rank {rank}; ranks not heard from in this call: {missing:?}; ranks whose connection closed: {gone:?}")]
    Timeout {
        /// The call.
        call: String,
        /// This rank.
        rank: usize,
        /// The timeout.
        after: Duration,
        /// Ranks that sent nothing for this call (neither data nor a stall notice).
        missing: Vec<usize>,
        /// Ranks whose connection closed while this rank waited.
        gone: Vec<usize>,
    },
    /// A peer's connection closed or failed: the rank died or dropped its communicator.
    #[error("{call}: rank {peer} is gone ({reason})")]
    PeerLost {
        /// The call.
        call: String,
        /// The lost rank.
        peer: usize,
        /// What the transport saw.
        reason: String,
    },
    /// A peer sent bytes that are not a valid frame for this call.
    #[error("{call}: bad frame from rank {peer}: {problem}")]
    Protocol {
        /// The call.
        call: String,
        /// The sending rank.
        peer: usize,
        /// What is wrong.
        problem: String,
    },
    /// The caller's arguments are inconsistent (buffer lengths, root, ranks).
    #[error("{call}: invalid arguments at rank {rank}: {problem}")]
    InvalidArgument {
        /// The call.
        call: String,
        /// This rank.
        rank: usize,
        /// What is wrong.
        problem: String,
    },
    /// An earlier call failed; the communicator's streams are in an unknown state.
    #[error("communicator unusable after an earlier failure: {0}")]
    Poisoned(Box<CollectiveError>),
    /// Connecting the ranks failed.
    #[error("setting up rank {rank}: {problem}")]
    Setup {
        /// This rank.
        rank: usize,
        /// What failed.
        problem: String,
    },
}

/// The collectives' result type.
pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;
