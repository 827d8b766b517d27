//! The rendezvous interface: `Send` and `Recv` meet by key and step id.

use dflow_graph::{DType, Tensor};
use std::fmt;
use std::sync::Arc;

/// The pair's key: one type from the partitioner to the transports (see
/// [`dflow_graph::rendezvous_key`]).
pub use dflow_graph::RendezvousKey;

impl From<dflow_graph::BadRendezvousKey> for RendezvousError {
    fn from(e: dflow_graph::BadRendezvousKey) -> Self {
        RendezvousError::BadKey(e.0)
    }
}

/// Why a Send or Recv did not complete. Says whether the step was aborted, the peer is gone, or
/// the slot was misused, and names the key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    /// The step was aborted; `cause` says why (e.g. a kernel failure on another device).
    #[error("step {step} aborted: {cause}")]
    Aborted {
        /// Step id.
        step: u64,
        /// The original error.
        cause: String,
    },
    /// Nothing arrived within the timeout.
    #[error("timed out after {waited_ms} ms waiting for tensor `{}` from {} (key {key}, step {step})", key.tensor_name(), key.send_device())]
    Timeout {
        /// The key waited on.
        key: RendezvousKey,
        /// Step id.
        step: u64,
        /// Milliseconds waited.
        waited_ms: u64,
    },
    /// The same key was sent twice in one step.
    #[error("duplicate send of key {key} in step {step}")]
    DuplicateSend {
        /// The key.
        key: RendezvousKey,
        /// Step id.
        step: u64,
    },
    /// The same key was received twice in one step.
    #[error("duplicate recv of key {key} in step {step}")]
    DuplicateRecv {
        /// The key.
        key: RendezvousKey,
        /// Step id.
        step: u64,
    },
    /// A key string does not have the `send;recv;tensor` form.
    #[error("malformed rendezvous key {0:?} (expected `send_device;recv_device;tensor_name`)")]
    BadKey(String),
    /// A sender's slot at the peer still held an earlier value past the timeout (its reader, or
    /// this task, did not release it).
    #[error("slot for tensor `{}` (key {key}) at peer {peer} stayed busy for {waited_ms} ms: {cause}", key.tensor_name())]
    SlotBusy {
        /// The key.
        key: RendezvousKey,
        /// The receiving task.
        peer: String,
        /// Milliseconds waited.
        waited_ms: u64,
        /// Who holds it.
        cause: &'static str,
    },
    /// The peer task is unreachable or died.
    #[error("peer {peer} is gone: {cause}")]
    PeerGone {
        /// The peer task.
        peer: String,
        /// What happened.
        cause: String,
    },
}

/// Called exactly once with the received tensor or the reason there is none.
pub type RecvCallback = Box<dyn FnOnce(Result<Tensor, RendezvousError>) + Send>;

/// Where `Send` and `Recv` meet.
///
/// `send` never blocks. `recv_async` never blocks either: it registers a callback that runs
/// when the tensor arrives (on the sender's thread, or immediately if it is already there), so a
/// pending Recv holds no compute thread.
pub trait Rendezvous: Send + Sync + fmt::Debug {
    /// Delivers `value` for `key` in `step`.
    fn send(
        &self,
        key: &Arc<RendezvousKey>,
        step: u64,
        value: Tensor,
    ) -> Result<(), RendezvousError>;

    /// Asks for the value of `key` in `step`; `done` runs once with it or with an error.
    fn recv_async(&self, key: &Arc<RendezvousKey>, step: u64, done: RecvCallback);

    /// Aborts `step`: every pending and future Recv of that step fails with `cause`, and values
    /// already sent for it are dropped.
    fn abort_step(&self, step: u64, cause: RendezvousError);

    /// Forgets everything about `step` once it has completed (values not consumed are dropped).
    fn finish_step(&self, step: u64);

    /// Keys with a Recv still waiting in `step` (for timeout messages).
    fn pending_recvs(&self, step: u64) -> Vec<RendezvousKey>;

    /// Memory in which the producer of `key`'s value in `step` (a `dtype` tensor of shape
    /// `dims`) may write it, so that [`Rendezvous::send`] of that very tensor moves no bytes
    /// (a shared-memory slot). `None` (the default): the producer allocates as usual. The
    /// contents are unspecified; the producer writes every element.
    fn send_buffer(
        &self,
        key: &Arc<RendezvousKey>,
        step: u64,
        dtype: DType,
        dims: &[usize],
    ) -> Option<Tensor> {
        let _ = (key, step, dtype, dims);
        None
    }
}
