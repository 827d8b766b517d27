//! The few RDMA verbs the protocol needs, behind a trait: the real ones (`ibverbs`, feature
//! `rdma`) and an in-memory fabric ([`crate::rdma::sim`]) implement it, so the protocol logic is
//! tested on machines without RDMA hardware.
//!
//! The model is one device context per plane: a protection domain, one completion queue shared by
//! every queue pair, and reliable-connected (RC) queue pairs, one per peer. Only two operations
//! move data: RDMA WRITE (optionally WITH IMMEDIATE) from a registered local segment into a
//! remote registered segment, and a posted receive that an incoming immediate consumes.

use std::fmt;
use std::time::Duration;

/// Identifies a queue pair of one [`Verbs`] device (its `qp_num` on real hardware).
pub type QpId = u32;

/// A registered memory region: where it is and the keys that grant access to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRegion {
    /// Start address in this process.
    pub addr: u64,
    /// Length in bytes.
    pub len: usize,
    /// The key a local work request names it by.
    pub lkey: u32,
    /// The key a remote peer writes it with.
    pub rkey: u32,
}

/// Where an RDMA WRITE reads from: part of a local registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalSegment {
    /// Start address (inside the region of `lkey`).
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// The region's local key.
    pub lkey: u32,
}

/// Where an RDMA WRITE lands: part of a remote registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteSegment {
    /// Start address in the peer's process.
    pub addr: u64,
    /// The region's remote key.
    pub rkey: u32,
}

/// What a peer needs to connect its queue pair to ours (exchanged out of band, over the control
/// plane).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpEndpoint {
    /// Queue pair number.
    pub qp_num: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID (RoCE and routed InfiniBand; all zeros when unused).
    pub gid: [u8; 16],
    /// First packet sequence number.
    pub psn: u32,
}

/// What finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionKind {
    /// A signaled RDMA WRITE posted here completed (its local memory may be reused).
    Write,
    /// A peer's RDMA WRITE WITH IMMEDIATE landed in our memory and consumed a posted receive.
    RecvImm {
        /// The 32-bit immediate.
        imm: u32,
        /// Bytes the write carried.
        byte_len: u32,
    },
}

/// A work completion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The queue pair it belongs to.
    pub qp: QpId,
    /// The work request's id, as posted.
    pub wr_id: u64,
    /// What finished, or the failure status (e.g. "retry exceeded": the peer is unreachable).
    pub result: Result<CompletionKind, String>,
}

/// A verbs failure, saying what the operator can do about it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// No RDMA device, or not the one asked for.
    #[error("no RDMA device{}: {detail} (check `ibv_devices`; install rdma-core and load the driver, e.g. mlx5_ib, or rdma_rxe for Soft-RoCE)", name.as_deref().map(|n| format!(" named `{n}`")).unwrap_or_default())]
    NoDevice {
        /// The device asked for, if any.
        name: Option<String>,
        /// What the library said.
        detail: String,
    },
    /// Memory could not be registered; usually the locked-memory limit.
    #[error("cannot register {len} bytes of memory for RDMA: {detail} (raise the locked-memory limit: `ulimit -l unlimited`, or `* - memlock unlimited` in /etc/security/limits.conf, or LimitMEMLOCK=infinity for a systemd unit / --ulimit memlock=-1 for a container)")]
    Register {
        /// Bytes asked for.
        len: usize,
        /// What the library said.
        detail: String,
    },
    /// A queue pair could not be created or connected.
    #[error("queue pair: {0}")]
    QueuePair(String),
    /// Posting a work request failed (queue full, bad key, broken queue pair).
    #[error("post: {0}")]
    Post(String),
    /// Polling the completion queue failed.
    #[error("poll: {0}")]
    Poll(String),
}

/// The verbs of one opened device (context, protection domain, completion queue).
///
/// Methods take `&self`: an implementation serializes what the library needs serialized.
pub trait Verbs: Send + Sync + fmt::Debug + 'static {
    /// The device's name (`mlx5_0`, `rxe0`, `sim:...`).
    fn device_name(&self) -> &str;

    /// Registers `len` bytes at `addr` for local access and remote writes.
    ///
    /// # Safety
    ///
    /// `addr..addr+len` must stay allocated, and not move, until [`Verbs::deregister`] is called
    /// with the returned region. While a peer holds its `rkey`, remote writes may change those
    /// bytes at any time: the caller must not hold Rust references into the range while a write
    /// may land (the credit protocol guarantees this for receive slots).
    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MemoryRegion, VerbsError>;

    /// Deregisters a region (its keys stop working).
    fn deregister(&self, mr: &MemoryRegion);

    /// Creates a reliable-connected queue pair; returns it and the endpoint to send the peer.
    fn create_qp(&self) -> Result<(QpId, QpEndpoint), VerbsError>;

    /// Connects `qp` to the peer's endpoint (INIT → RTR → RTS).
    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<(), VerbsError>;

    /// Destroys a queue pair; its outstanding work requests are flushed.
    fn destroy_qp(&self, qp: QpId);

    /// Posts an RDMA WRITE of `local` (none: zero bytes) to `remote`. With `imm`, it is a WRITE
    /// WITH IMMEDIATE: signaled here, and it consumes a posted receive at the peer, which sees
    /// the immediate in its completion. Without, it is unsignaled and ordered before the next
    /// write on the same queue pair.
    fn post_write(
        &self,
        qp: QpId,
        wr_id: u64,
        local: Option<LocalSegment>,
        remote: RemoteSegment,
        imm: Option<u32>,
    ) -> Result<(), VerbsError>;

    /// Posts a zero-length receive for one incoming immediate.
    fn post_recv(&self, qp: QpId, wr_id: u64) -> Result<(), VerbsError>;

    /// Moves up to `max` completions into `out`, waiting at most `timeout` for the first one.
    /// Returns how many were added (0 after the timeout: the caller checks for shutdown).
    fn poll(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, VerbsError>;
}
