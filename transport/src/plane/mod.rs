//! What the distributed runtime needs from a transport: a [`Rendezvous`] whose cross-task keys
//! travel through receive slots registered once, plus control-plane messages and peer events
//! on the same authenticated connections ([`DataPlane`]). Every backend is the one generic
//! [`Plane`] over its own [`Link`] (TCP: [`crate::tcp::TcpPlane`]; QUIC, shared memory and
//! RDMA likewise), and the runtime picks one per job with [`TransportKind`].

mod core;

pub use self::core::{Link, Plane};

use crate::rendezvous::{Rendezvous, RendezvousError, RendezvousKey};
use dflow_graph::DType;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::mpsc;

/// A boxed future, for the trait's async methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a data plane reports to the layer above it (the control plane) about its peers.
#[derive(Debug)]
pub enum PeerEvent {
    /// A control-plane message from an authenticated connection.
    Message {
        /// The sending task, as its Hello named it.
        peer: Arc<str>,
        /// The encoded message.
        body: Vec<u8>,
    },
    /// A peer's connection broke or closed, it stayed silent past the idle timeout, or it sent
    /// a bad frame and was dropped.
    Gone {
        /// The task.
        peer: Arc<str>,
        /// What happened.
        cause: String,
    },
}

/// Locks `m`, going on after a poisoned lock: the planes run no callback under their locks, so
/// a poisoned one means a bug elsewhere and its data is still consistent.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A data plane's subscriber for [`PeerEvent`]s (see [`DataPlane::subscribe`]): the planes
/// share this instead of each keeping its own sender.
#[derive(Debug, Default)]
pub(crate) struct PeerEvents {
    tx: std::sync::Mutex<Option<mpsc::UnboundedSender<PeerEvent>>>,
}

impl PeerEvents {
    fn tx(&self) -> std::sync::MutexGuard<'_, Option<mpsc::UnboundedSender<PeerEvent>>> {
        // Only a store and a clone-free send run under this lock: a poisoned one is consistent.
        self.tx.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Delivers events to the returned receiver from now on (a later call replaces an earlier
    /// subscriber).
    pub(crate) fn subscribe(&self) -> mpsc::UnboundedReceiver<PeerEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        *self.tx() = Some(tx);
        rx
    }

    /// Hands `event` to the subscriber. Without one (or after it went away) a message is
    /// dropped with a log line naming `plane` (this task) and the sender; a peer failure is
    /// dropped silently (nobody waits on it).
    pub(crate) fn emit(&self, plane: &str, event: PeerEvent) {
        let sent = match self.tx().as_ref() {
            Some(tx) => tx.send(event).map_err(|e| e.0),
            None => Err(event),
        };
        if let Err(PeerEvent::Message { peer, body }) = sent {
            tracing::warn!(
                "{plane}: dropped a {}-byte message from `{peer}`: nobody listens for messages",
                body.len()
            );
        }
    }
}

/// What a task sent: tensor payload bytes (the values' own bytes; frame headers and control
/// messages not counted) and how many values or messages carried them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Payload bytes.
    pub bytes: u64,
    /// Values (Send/Recv) or collective messages.
    pub messages: u64,
}

impl std::ops::Add for Traffic {
    type Output = Traffic;
    fn add(self, o: Traffic) -> Traffic {
        Traffic {
            bytes: self.bytes + o.bytes,
            messages: self.messages + o.messages,
        }
    }
}

/// A [`Traffic`] counted from several threads.
#[derive(Debug, Default)]
pub struct TrafficCounter {
    bytes: std::sync::atomic::AtomicU64,
    messages: std::sync::atomic::AtomicU64,
}

impl TrafficCounter {
    /// Counts one value or message of `bytes` payload bytes.
    pub fn add(&self, bytes: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        self.bytes.fetch_add(bytes as u64, Relaxed);
        self.messages.fetch_add(1, Relaxed);
    }

    /// The counts so far.
    pub fn get(&self) -> Traffic {
        use std::sync::atomic::Ordering::Relaxed;
        Traffic {
            bytes: self.bytes.load(Relaxed),
            messages: self.messages.load(Relaxed),
        }
    }
}

/// A transport for one task of a distributed job.
pub trait DataPlane: Rendezvous {
    /// This task's name.
    fn task(&self) -> &str;

    /// The tensor values this task has sent to peers so far (payload bytes; values for its own
    /// keys stay local and are not counted).
    fn traffic(&self) -> Traffic {
        Traffic::default()
    }

    /// The address peers connect to.
    fn local_addr(&self) -> SocketAddr;

    /// Registers receive slot `slot_id`: `peer` sends `key`, a `dtype` tensor of shape `dims`;
    /// the slot's buffer is allocated here, once.
    fn register_recv(
        &self,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), String>;

    /// True when `key` already has a receive slot.
    fn has_recv_slot(&self, key: &RendezvousKey) -> bool;

    /// Routes `key` to slot `slot_id` of `peer`.
    fn register_send(&self, key: Arc<RendezvousKey>, peer: &str, slot_id: u32);

    /// Opens this task's connection to `peer` at `addr` (authenticating when the plane has a
    /// secret).
    fn connect(
        self: Arc<Self>,
        peer: String,
        addr: SocketAddr,
    ) -> BoxFuture<'static, Result<(), String>>;

    /// Queues a control-plane message for `peer`; messages to one peer keep their order.
    fn send_message(&self, peer: &str, body: Vec<u8>) -> Result<(), RendezvousError>;

    /// Delivers messages and peer failures to the returned receiver from now on.
    fn subscribe(&self) -> mpsc::UnboundedReceiver<PeerEvent>;

    /// Flushes what is queued (at most `within`), then closes every connection.
    fn close(&self, within: Duration) -> BoxFuture<'_, ()>;

    /// This plane as a plain rendezvous (for the step scheduler).
    fn as_rendezvous(self: Arc<Self>) -> Arc<dyn Rendezvous>;
}

/// The transports a job can run on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// TCP: persistent connections, payloads read straight into registered slots.
    #[default]
    Tcp,
    /// RDMA verbs (feature `rdma`): tensors written into registered receive slots; control
    /// messages over TCP. See [`crate::rdma`].
    #[cfg(feature = "rdma")]
    Rdma,
    /// Shared memory between tasks on one host (Linux): receive slots mapped by both tasks,
    /// values written in place by their producers; a TCP side channel for messages.
    Shm,
    /// QUIC (quinn): the TCP plane's frames over QUIC streams, TLS 1.3 with mutual
    /// authentication against a cluster CA. See [`crate::quic`].
    Quic,
}

impl TransportKind {
    /// Every kind this build has, by name.
    pub const ALL: &'static [(&'static str, TransportKind)] = &[
        ("tcp", TransportKind::Tcp),
        ("shm", TransportKind::Shm),
        ("quic", TransportKind::Quic),
        #[cfg(feature = "rdma")]
        ("rdma", TransportKind::Rdma),
    ];

    /// The kind's name.
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, k)| *k == self)
            .map(|(n, _)| *n)
            .unwrap_or("?")
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TransportKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, k)| *k)
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|(n, _)| *n).collect();
                format!(
                    "unknown transport `{s}` (this build has: {}; rdma needs a build with `--features rdma`)",
                    known.join(", ")
                )
            })
    }
}

/// Binds a data plane of `kind` for task `task` on `addr`, with `secret` required of every
/// connection when given. Must run inside a tokio runtime.
///
/// A QUIC plane needs the task's certificate: here it is loaded from the directory named by
/// `DFLOW_CERT_DIR` ([`crate::quic::CERT_DIR_ENV`]); [`bind_with_identity`] takes it directly.
pub async fn bind(
    kind: TransportKind,
    task: &str,
    addr: SocketAddr,
    config: crate::config::TcpConfig,
    secret: Option<crate::auth::Secret>,
) -> std::io::Result<Arc<dyn DataPlane>> {
    bind_with_identity(kind, task, addr, config, secret, None).await
}

/// Like [`bind`]; a QUIC plane uses `identity` (this task's certificate, key and cluster CA)
/// when given, else `DFLOW_CERT_DIR`. Other kinds ignore `identity`.
pub async fn bind_with_identity(
    kind: TransportKind,
    task: &str,
    addr: SocketAddr,
    config: crate::config::TcpConfig,
    secret: Option<crate::auth::Secret>,
    identity: Option<crate::quic::QuicIdentity>,
) -> std::io::Result<Arc<dyn DataPlane>> {
    match kind {
        TransportKind::Quic => {
            let identity = match identity {
                Some(id) => id,
                None => crate::quic::QuicIdentity::from_env(task).map_err(std::io::Error::other)?,
            };
            let plane: Arc<dyn DataPlane> =
                crate::quic::QuicPlane::bind(task, addr, config, secret, identity)
                    .await
                    .map_err(std::io::Error::other)?;
            Ok(plane)
        }
        TransportKind::Tcp => {
            let plane: Arc<dyn DataPlane> =
                crate::tcp::TcpPlane::bind_with_secret(task, addr, config, secret).await?;
            Ok(plane)
        }
        #[cfg(feature = "rdma")]
        TransportKind::Rdma => {
            // Device, port and GID index from DFLOW_RDMA_DEVICE/_PORT/_GID_INDEX.
            let ibv = crate::rdma::ibv::IbvConfig::from_env().map_err(std::io::Error::other)?;
            let verbs = crate::rdma::ibv::IbvVerbs::open(&ibv).map_err(std::io::Error::other)?;
            let plane: Arc<dyn DataPlane> =
                crate::rdma::plane::RdmaPlane::bind(task, addr, config, secret, Arc::new(verbs))
                    .await?;
            Ok(plane)
        }
        #[cfg(target_os = "linux")]
        TransportKind::Shm => {
            let plane: Arc<dyn DataPlane> =
                crate::shm::ShmPlane::bind(task, addr, config, secret).await?;
            Ok(plane)
        }
        #[cfg(not(target_os = "linux"))]
        TransportKind::Shm => Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "the shm transport needs Linux",
        )),
    }
}
