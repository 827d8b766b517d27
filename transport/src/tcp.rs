//! A minimal TCP data plane: tensors between tasks, read straight into receive slots registered
//! once.
//!
//! Each process owns one [`TcpRendezvous`]. It listens on one address; every peer that sends to
//! it opens one persistent connection, introduces itself with a Hello frame (its task name), and
//! then sends [`wire`](crate::wire) frames. A receive slot (slot id → key, dtype, shape, and a
//! preallocated [`Buffer`]) is registered once with [`TcpRendezvous::register_recv`]; a Data frame
//! is checked against its slot (known id, right peer, exact length) before a byte of payload is
//! read, and the payload is then read directly into the slot's buffer.
//!
//! The received tensor aliases the slot buffer (no copy). The next frame for that slot is read
//! in place only if the reader has released the previous tensor; otherwise the slot gets a fresh
//! buffer (counted by [`SlotTable::reallocations`]), so a tensor a reader still holds is never
//! torn. TODO(credits): the credit protocol ([`FrameKind::Credit`]: the receiver sends a Credit
//! for a slot once its reader dropped the tensor, and the sender does not write that slot again
//! before it has one) will keep the slot allocation-free even when a reader is slow, and bound how
//! far a sender runs ahead; Credit frames are accepted and ignored for now.
//!
//! A peer that closes its connection, stalls mid-frame, or sends a bad frame (truncated, unknown
//! slot, longer than its slot, garbage) is dropped with a logged error naming it, and every step
//! with a Recv waiting on one of its keys is aborted with [`RendezvousError::PeerGone`].

use crate::auth::{Acceptor, AuthError, Connector, Secret, SECRET_ENV};
use crate::local::LocalRendezvous;
pub use crate::plane::PeerEvent;
use crate::plane::PeerEvents;
use crate::remote_waits::RemoteWaits;
use crate::rendezvous::{RecvCallback, Rendezvous, RendezvousError, RendezvousKey};
use crate::wire::{
    decode_header_slice, encode_header, heartbeat_header, next_or_heartbeat, Body, FrameKind,
    Header, Outgoing, WireError, HEADER_LEN, MAX_CONTROL_PAYLOAD,
};
use dflow_graph::tensor::Buffer;
use dflow_graph::{DType, Tensor};
use std::collections::HashMap;
use std::fmt;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

/// Longest task name a Hello frame may carry.
pub const MAX_PEER_NAME: usize = 256;

/// Timeouts of the data plane.
#[derive(Clone, Copy, Debug)]
pub struct TcpConfig {
    /// How long a connection may stay silent between frames before it is dropped.
    pub idle_timeout: Duration,
    /// How long the rest of a frame (payload, Hello) and each write may take.
    pub frame_timeout: Duration,
    /// How long `connect` tries.
    pub connect_timeout: Duration,
    /// Send a Heartbeat frame on an outgoing connection after it was idle this long, so the
    /// peer's `idle_timeout` only fires when this task is really gone or stuck (`None`: never).
    pub heartbeat_interval: Option<Duration>,
    /// Longest control-plane [`FrameKind::Message`] accepted, checked before allocating; the
    /// body's memory then grows only as its bytes arrive.
    pub max_message: u64,
    /// Most incoming connections one peer name may hold open at once; a further one is refused
    /// (a task opens one connection to each peer, and one more while it reconnects).
    pub max_connections_per_peer: usize,
    /// Most incoming connections that may be in their handshake (before a Hello, or before the
    /// secret's proof) at once; a further one is closed at once.
    pub max_handshaking: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            idle_timeout: Duration::from_secs(300),
            frame_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            heartbeat_interval: None,
            max_message: 256 << 20,
            max_connections_per_peer: 4,
            max_handshaking: 64,
        }
    }
}

/// A data-plane failure, naming the peer.
#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    /// A malformed header.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A well-formed frame that breaks the protocol (unknown slot, wrong length, ...).
    #[error("peer `{peer}`: {msg}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        msg: String,
    },
    /// An I/O error or timeout.
    #[error("peer `{peer}`: {what}: {source}")]
    Io {
        /// The peer.
        peer: String,
        /// What was being done.
        what: String,
        /// The cause.
        source: io::Error,
    },
    /// A slot could not be registered.
    #[error("cannot register slot {slot_id} for key {key}: {msg}")]
    Register {
        /// The slot id.
        slot_id: u32,
        /// The key.
        key: String,
        /// Why.
        msg: String,
    },
}

struct Slot {
    peer: Arc<str>,
    key: Arc<RendezvousKey>,
    dtype: DType,
    dims: Arc<[usize]>,
    len: usize,
    /// `None` while a frame is being read into it.
    buf: Option<Arc<Buffer>>,
}

/// What a checked-out slot needs to become a tensor.
pub(crate) struct Checkout {
    pub(crate) key: Arc<RendezvousKey>,
    pub(crate) dtype: DType,
    pub(crate) dims: Arc<[usize]>,
    pub(crate) buf: Arc<Buffer>,
}

/// The receive slots of one process, each registered once with its preallocated buffer.
#[derive(Default)]
pub struct SlotTable {
    slots: Mutex<HashMap<u32, Slot>>,
    by_key: Mutex<HashMap<Arc<RendezvousKey>, Arc<str>>>,
    max_len: AtomicU64,
    reallocs: AtomicU64,
}

impl fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SlotTable({} slots)", lock(&self.slots).len())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // No callback runs under these locks; a poisoned lock means a bug elsewhere: keep going.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SlotTable {
    /// Registers slot `slot_id`: `peer` sends `key`, a `dtype` tensor of shape `dims`. The
    /// receive buffer is allocated here, once.
    pub fn register(
        &self,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), TcpError> {
        let err = |msg: String| TcpError::Register {
            slot_id,
            key: key.to_string(),
            msg,
        };
        let zeros = Tensor::zeros(dtype, dims).map_err(|e| err(e.to_string()))?;
        let buf = zeros.buffer().clone();
        drop(zeros);
        let mut slots = lock(&self.slots);
        if let Some(s) = slots.get(&slot_id) {
            return Err(err(format!("slot id already used by key {}", s.key)));
        }
        let mut by_key = lock(&self.by_key);
        if by_key.contains_key(&key) {
            return Err(err("key already has a slot".into()));
        }
        by_key.insert(key.clone(), peer.into());
        let len = buf.len();
        self.max_len.fetch_max(len as u64, Ordering::Relaxed);
        slots.insert(
            slot_id,
            Slot {
                peer: peer.into(),
                key,
                dtype,
                dims: dims.into(),
                len,
                buf: Some(buf),
            },
        );
        Ok(())
    }

    /// Number of registered slots.
    pub fn len(&self) -> usize {
        lock(&self.slots).len()
    }

    /// True when no slot is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The largest registered slot in bytes (the bound for any Data frame).
    pub fn max_payload(&self) -> u64 {
        self.max_len.load(Ordering::Relaxed)
    }

    /// The byte length of slot `slot_id`, if registered.
    pub fn slot_len(&self, slot_id: u32) -> Option<u64> {
        lock(&self.slots).get(&slot_id).map(|s| s.len as u64)
    }

    /// How often a slot got a fresh buffer because its reader still held the previous tensor.
    pub fn reallocations(&self) -> u64 {
        self.reallocs.load(Ordering::Relaxed)
    }

    /// The peer that sends `key`, if it has a slot.
    pub fn peer_of(&self, key: &RendezvousKey) -> Option<Arc<str>> {
        lock(&self.by_key).get(key).cloned()
    }

    /// Takes slot `slot_id`'s buffer (uniquely owned) for a frame of `len` bytes from `peer`.
    pub(crate) fn checkout(&self, slot_id: u32, peer: &str, len: u64) -> Result<Checkout, String> {
        let mut slots = lock(&self.slots);
        let s = slots
            .get_mut(&slot_id)
            .ok_or_else(|| format!("Data frame for unknown slot {slot_id}"))?;
        if *s.peer != *peer {
            return Err(format!(
                "Data frame for slot {slot_id} (key {}), which belongs to peer `{}`",
                s.key, s.peer
            ));
        }
        if len != s.len as u64 {
            return Err(format!(
                "Data frame for slot {slot_id} (key {}) has {len} bytes; the slot holds {}",
                s.key, s.len
            ));
        }
        let mut buf = s.buf.take().ok_or_else(|| {
            format!(
                "slot {slot_id} (key {}) is already being written by another connection",
                s.key
            )
        })?;
        if Arc::get_mut(&mut buf).is_none() {
            // The reader still holds the last tensor: never write under it.
            self.reallocs.fetch_add(1, Ordering::Relaxed);
            buf = Arc::new(Buffer::zeroed(s.len));
        }
        Ok(Checkout {
            key: s.key.clone(),
            dtype: s.dtype,
            dims: s.dims.clone(),
            buf,
        })
    }

    pub(crate) fn checkin(&self, slot_id: u32, buf: Arc<Buffer>) {
        if let Some(s) = lock(&self.slots).get_mut(&slot_id) {
            s.buf = Some(buf);
        }
    }
}

/// Writes `head` then `body` with vectored writes, from the caller's memory.
async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, head: &[u8], body: &[u8]) -> io::Result<()> {
    let total = head.len() + body.len();
    let mut done = 0;
    while done < total {
        let n = if done < head.len() {
            let bufs = [IoSlice::new(&head[done..]), IoSlice::new(body)];
            w.write_vectored(&bufs).await?
        } else {
            w.write(&body[done - head.len()..]).await?
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        done += n;
    }
    Ok(())
}

/// Writes one handshake frame.
async fn send_control<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: FrameKind,
    body: &[u8],
) -> io::Result<()> {
    let head = encode_header(&Header {
        kind,
        flags: 0,
        slot_id: 0,
        step: 0,
        payload_len: body.len() as u64,
    });
    write_frame(w, &head, body).await?;
    w.flush().await
}

/// Reads one handshake frame of `kind` (bounded by the control-frame limit before allocating).
async fn recv_control<R: AsyncRead + Unpin>(r: &mut R, kind: FrameKind) -> io::Result<Vec<u8>> {
    let mut head = [0u8; HEADER_LEN];
    r.read_exact(&mut head).await?;
    let h = crate::wire::decode_header(&head, 0)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    if h.kind == FrameKind::Abort && kind != FrameKind::Abort {
        // The peer refuses the handshake and says why (see `refuse`).
        let mut reason = vec![0u8; h.payload_len as usize];
        r.read_exact(&mut reason).await?;
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("refused: {}", String::from_utf8_lossy(&reason)),
        ));
    }
    if h.kind != kind {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected a {kind:?} frame, got {:?}", h.kind),
        ));
    }
    let mut body = vec![0u8; h.payload_len as usize];
    r.read_exact(&mut body).await?;
    Ok(body)
}

/// Refuses a connection in its handshake: sends the peer an Abort frame with `reason` (which its
/// side reports) before the connection is dropped. Best effort, bounded by a short timeout.
async fn refuse(stream: &mut TcpStream, reason: &str) {
    let mut body = reason.as_bytes().to_vec();
    body.truncate(MAX_CONTROL_PAYLOAD as usize);
    let head = encode_header(&Header {
        kind: FrameKind::Abort,
        flags: 0,
        slot_id: 0,
        step: u64::MAX,
        payload_len: body.len() as u64,
    });
    let _ = tokio::time::timeout(
        Duration::from_millis(500),
        write_frame(stream, &head, &body),
    )
    .await;
}

/// Reads an Abort frame the peer of an outgoing connection sent to refuse it (see `refuse`),
/// without blocking: its reason, or `None` when what is there is not one.
fn refusal(stream: &TcpStream) -> Option<String> {
    let mut buf = [0u8; HEADER_LEN + MAX_CONTROL_PAYLOAD as usize];
    let mut got = 0;
    while got < buf.len() {
        match stream.try_read(&mut buf[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    let got = &buf[..got];
    let h = decode_header_slice(got, 0).ok()?;
    // A refusal cut short (not all arrived yet) is not reported; later writes fail as before.
    let body = got.get(HEADER_LEN..HEADER_LEN + h.payload_len as usize)?;
    (h.kind == FrameKind::Abort).then(|| String::from_utf8_lossy(body).into_owned())
}

/// Reads until `buf` is full or EOF; returns the bytes read.
async fn read_full<R: AsyncRead + Unpin>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        let n = r.read(&mut buf[got..]).await?;
        if n == 0 {
            break;
        }
        got += n;
    }
    Ok(got)
}

/// Where an outgoing key goes: the peer and its slot id.
type Route = (Arc<str>, u32);

#[derive(Default)]
struct Peers {
    /// Writer queues of outgoing connections.
    writers: HashMap<Arc<str>, mpsc::UnboundedSender<Outgoing>>,
    /// Peers known dead, with the cause.
    gone: HashMap<Arc<str>, String>,
    /// Open incoming connections per announced peer name.
    incoming: HashMap<Arc<str>, usize>,
    /// Incoming connections still in their handshake.
    handshaking: usize,
    /// Per remote IP: when a refused handshake was last logged as an error, and how many were
    /// refused quietly since (a peer that retries every 0.5 s is reported every 30 s).
    refusals: HashMap<std::net::IpAddr, (std::time::Instant, u32)>,
}

/// How often the same address's refused handshakes are logged as errors.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(30);

/// One slot of a connection counter in [`Peers`], released on drop.
struct Admitted<'a> {
    rv: &'a TcpRendezvous,
    peer: Option<Arc<str>>,
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        let mut peers = lock(&self.rv.peers);
        match self.peer.take() {
            Some(p) => {
                if let Some(n) = peers.incoming.get_mut(&p) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        peers.incoming.remove(&p);
                    }
                }
            }
            None => peers.handshaking = peers.handshaking.saturating_sub(1),
        }
    }
}

/// The rendezvous over TCP: local keys meet in a [`LocalRendezvous`]; keys with a registered
/// route go to their peer's slot; frames from peers land in registered slots and meet their Recv
/// in the same local rendezvous.
pub struct TcpRendezvous {
    name: Arc<str>,
    addr: SocketAddr,
    config: TcpConfig,
    local: LocalRendezvous,
    slots: SlotTable,
    routes: Mutex<HashMap<Arc<RendezvousKey>, Route>>,
    peers: Mutex<Peers>,
    /// Steps with a Recv waiting on a remote key (to abort them when its peer dies).
    remote_waits: RemoteWaits,
    shutdown: watch::Sender<bool>,
    /// With a cluster secret, every connection runs the [`crate::auth`] handshake first and a
    /// peer that cannot prove it knows the secret is dropped.
    secret: Option<Secret>,
    /// Where messages and peer failures go (see [`TcpRendezvous::subscribe`]).
    events: PeerEvents,
    /// The writer tasks of outgoing connections, awaited by [`TcpRendezvous::close`].
    writer_tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// Set by [`TcpRendezvous::close`]: peers closing their connections now is expected.
    closing: std::sync::atomic::AtomicBool,
}

impl fmt::Debug for TcpRendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TcpRendezvous({} on {}, {:?})",
            self.name, self.addr, self.slots
        )
    }
}

impl TcpRendezvous {
    /// Listens on `addr` (port 0 picks one) as task `name`, without authentication. Must run
    /// inside a tokio runtime.
    pub async fn bind(name: &str, addr: SocketAddr, config: TcpConfig) -> io::Result<Arc<Self>> {
        Self::bind_with_secret(name, addr, config, None).await
    }

    /// Like [`TcpRendezvous::bind`]; with `secret`, every connection in either direction must
    /// pass the HMAC challenge-response of [`crate::auth`] before any data frame.
    pub async fn bind_with_secret(
        name: &str,
        addr: SocketAddr,
        config: TcpConfig,
        secret: Option<Secret>,
    ) -> io::Result<Arc<Self>> {
        let listener = TcpListener::bind(addr).await?;
        let (shutdown, _) = watch::channel(false);
        let rv = Arc::new(TcpRendezvous {
            name: name.into(),
            addr: listener.local_addr()?,
            config,
            local: LocalRendezvous::new(),
            slots: SlotTable::default(),
            routes: Mutex::default(),
            peers: Mutex::default(),
            remote_waits: RemoteWaits::default(),
            shutdown,
            secret,
            events: PeerEvents::default(),
            writer_tasks: Mutex::default(),
            closing: Default::default(),
        });
        tokio::spawn(accept_loop(Arc::downgrade(&rv), listener));
        Ok(rv)
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// This task's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The receive slots.
    pub fn slots(&self) -> &SlotTable {
        &self.slots
    }

    /// Registers a receive slot: `peer` will send `key` (a `dtype` tensor of shape `dims`) as
    /// slot `slot_id`.
    pub fn register_recv(
        &self,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), TcpError> {
        self.slots.register(slot_id, peer, key, dtype, dims)
    }

    /// Routes `key` to slot `slot_id` of `peer` (connected with [`TcpRendezvous::connect`]).
    pub fn register_send(&self, key: Arc<RendezvousKey>, peer: &str, slot_id: u32) {
        lock(&self.routes).insert(key, (peer.into(), slot_id));
    }

    /// Opens the connection to `peer` at `addr` and introduces this task.
    pub async fn connect(self: &Arc<Self>, peer: &str, addr: SocketAddr) -> Result<(), TcpError> {
        let io_err = |what: &str, source| TcpError::Io {
            peer: peer.to_string(),
            what: what.to_string(),
            source,
        };
        let stream = tokio::time::timeout(self.config.connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| io_err("connect", io::ErrorKind::TimedOut.into()))?
            .map_err(|e| io_err("connect", e))?;
        let mut stream = stream;
        stream.set_nodelay(true).map_err(|e| io_err("connect", e))?;
        // This side writes the payloads of this connection, so its congestion control counts.
        #[cfg(target_os = "linux")]
        crate::sockopt::tune_congestion(&stream, None);
        let (tx, rx) = mpsc::unbounded_channel();
        match &self.secret {
            Some(secret) => {
                let t = self.config.frame_timeout;
                let handshake = async {
                    let (conn, hello) = Connector::hello(secret, &self.name);
                    send_control(&mut stream, FrameKind::Hello, &hello).await?;
                    let challenge = recv_control(&mut stream, FrameKind::Challenge).await?;
                    let (_, proof) = conn
                        .answer(&challenge, &format!("{peer} ({addr})"))
                        .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e))?;
                    send_control(&mut stream, FrameKind::Proof, &proof).await
                };
                tokio::time::timeout(t, handshake)
                    .await
                    .map_err(|_| io_err("authenticating", io::ErrorKind::TimedOut.into()))?
                    .map_err(|e| io_err("authenticating", e))?;
            }
            None => {
                let hello = Header {
                    kind: FrameKind::Hello,
                    flags: 0,
                    slot_id: 0,
                    step: 0,
                    payload_len: self.name.len() as u64,
                };
                let _ = tx.send(Outgoing {
                    head: encode_header(&hello),
                    body: Body::Bytes(self.name.as_bytes().to_vec()),
                });
            }
        }
        let peer: Arc<str> = peer.into();
        {
            let mut peers = lock(&self.peers);
            peers.gone.remove(&peer);
            peers.writers.insert(peer.clone(), tx);
        }
        let task = tokio::spawn(writer(Arc::downgrade(self), peer, stream, rx));
        let mut tasks = lock(&self.writer_tasks);
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
        Ok(())
    }

    /// Ends every outgoing connection after the frames already queued on it are written (or
    /// `within` passed), then stops accepting and reading. For a clean exit: a message queued
    /// just before is delivered.
    pub async fn close(&self, within: Duration) {
        self.closing.store(true, Ordering::SeqCst);
        lock(&self.peers).writers.clear();
        let tasks: Vec<_> = lock(&self.writer_tasks).drain(..).collect();
        let _ = tokio::time::timeout(within, async {
            for t in tasks {
                let _ = t.await;
            }
        })
        .await;
        let _ = self.shutdown.send(true);
    }

    /// Delivers control-plane messages and peer failures to the returned receiver from now on
    /// (a later call replaces an earlier subscriber). Without a subscriber, messages are dropped
    /// with a log line.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<PeerEvent> {
        self.events.subscribe()
    }

    fn emit(&self, event: PeerEvent) {
        self.events.emit(&self.name, event);
    }

    /// True when an outgoing connection to `peer` is open.
    pub fn is_connected(&self, peer: &str) -> bool {
        lock(&self.peers).writers.contains_key(peer)
    }

    /// Queues a control-plane message for `peer` (connected with [`TcpRendezvous::connect`]).
    /// Messages to one peer arrive in the order they were queued, after every Data frame queued
    /// before them.
    pub fn send_message(&self, peer: &str, body: Vec<u8>) -> Result<(), RendezvousError> {
        let gone = |cause: String| RendezvousError::PeerGone {
            peer: peer.to_string(),
            cause,
        };
        let peers = lock(&self.peers);
        if let Some(cause) = peers.gone.get(peer) {
            return Err(gone(cause.clone()));
        }
        let tx = peers
            .writers
            .get(peer)
            .ok_or_else(|| gone("not connected".into()))?;
        let head = encode_header(&Header {
            kind: FrameKind::Message,
            flags: 0,
            slot_id: 0,
            step: 0,
            payload_len: body.len() as u64,
        });
        tx.send(Outgoing {
            head,
            body: Body::Bytes(body),
        })
        .map_err(|_| gone("connection closed".into()))
    }

    /// Stops accepting and reading; connections close.
    pub fn shutdown(&self) {
        let _ = self.shutdown.send(true);
        lock(&self.peers).writers.clear();
    }

    /// Marks `peer` dead and aborts every step with a Recv waiting on one of its keys.
    fn peer_gone(&self, peer: &Arc<str>, cause: &str) {
        {
            let mut peers = lock(&self.peers);
            peers.writers.remove(peer);
            peers.gone.insert(peer.clone(), cause.to_string());
        }
        let err = RendezvousError::PeerGone {
            peer: peer.to_string(),
            cause: cause.to_string(),
        };
        self.emit(PeerEvent::Gone {
            peer: peer.clone(),
            cause: cause.to_string(),
        });
        self.remote_waits.abort_waiting_on(&self.local, &err, |k| {
            self.slots.peer_of(k).as_deref() == Some(&**peer)
        });
    }

    fn gone_cause(&self, peer: &str) -> Option<String> {
        lock(&self.peers).gone.get(peer).cloned()
    }
}

impl Rendezvous for TcpRendezvous {
    fn send(
        &self,
        key: &Arc<RendezvousKey>,
        step: u64,
        value: Tensor,
    ) -> Result<(), RendezvousError> {
        let route = lock(&self.routes).get(key).cloned();
        let Some((peer, slot_id)) = route else {
            return self.local.send(key, step, value);
        };
        let gone = |cause: String| RendezvousError::PeerGone {
            peer: peer.to_string(),
            cause,
        };
        let peers = lock(&self.peers);
        if let Some(cause) = peers.gone.get(&peer) {
            return Err(gone(cause.clone()));
        }
        let tx = peers
            .writers
            .get(&peer)
            .ok_or_else(|| gone("not connected".into()))?;
        let head = encode_header(&Header::data(slot_id, step, value.byte_len() as u64));
        tx.send(Outgoing {
            head,
            body: Body::Tensor(value),
        })
        .map_err(|_| gone("connection closed".into()))
    }

    fn recv_async(&self, key: &Arc<RendezvousKey>, step: u64, done: RecvCallback) {
        let Some(peer) = self.slots.peer_of(key) else {
            return self.local.recv_async(key, step, done);
        };
        self.remote_waits.recv(
            &self.local,
            &peer,
            || self.gone_cause(&peer),
            key,
            step,
            done,
        );
    }

    fn abort_step(&self, step: u64, cause: RendezvousError) {
        let reason = cause.to_string();
        let mut reason = reason.into_bytes();
        reason.truncate(MAX_CONTROL_PAYLOAD as usize);
        let head = encode_header(&Header {
            kind: FrameKind::Abort,
            flags: 0,
            slot_id: 0,
            step,
            payload_len: reason.len() as u64,
        });
        for tx in lock(&self.peers).writers.values() {
            let _ = tx.send(Outgoing {
                head,
                body: Body::Bytes(reason.clone()),
            });
        }
        self.local.abort_step(step, cause);
    }

    fn finish_step(&self, step: u64) {
        self.remote_waits.finish(step);
        self.local.finish_step(step);
    }

    fn pending_recvs(&self, step: u64) -> Vec<RendezvousKey> {
        self.local.pending_recvs(step)
    }
}

async fn writer(
    rv: Weak<TcpRendezvous>,
    peer: Arc<str>,
    mut stream: TcpStream,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
) {
    let (timeout, heartbeat) = match rv.upgrade() {
        Some(rv) => (rv.config.frame_timeout, rv.config.heartbeat_interval),
        None => return,
    };
    let beat = || Outgoing {
        head: heartbeat_header(),
        body: Body::Bytes(Vec::new()),
    };
    // Peers never write on a connection this task opened, except to refuse it in the handshake
    // (an Abort with the reason, see `refuse`): watch for that until the first EOF.
    let mut watch_refusal = true;
    loop {
        let next = tokio::select! {
            out = next_or_heartbeat(&mut rx, heartbeat, beat) => out,
            ready = stream.readable(), if watch_refusal => {
                match (ready, refusal(&stream)) {
                    (Ok(()), Some(reason)) => {
                        tracing::error!(peer = %peer, "peer `{peer}` refused this task's connection: {reason}");
                        if let Some(rv) = rv.upgrade() {
                            rv.peer_gone(&peer, &format!("refused this task's connection: {reason}"));
                        }
                        return;
                    }
                    // EOF, or bytes that are no refusal: later writes tell what happened.
                    _ => watch_refusal = false,
                }
                continue;
            }
        };
        let Some(out) = next else { break };
        let body: &[u8] = match &out.body {
            Body::Tensor(t) => t.as_bytes(),
            Body::Bytes(b) => b,
        };
        let res = tokio::time::timeout(timeout, write_frame(&mut stream, &out.head, body)).await;
        let err = match res {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => e,
            Err(_) => io::ErrorKind::TimedOut.into(),
        };
        tracing::error!(peer = %peer, "dropping connection to peer `{peer}`: write failed: {err}");
        if let Some(rv) = rv.upgrade() {
            rv.peer_gone(&peer, &format!("write failed: {err}"));
        }
        return;
    }
    let _ = stream.shutdown().await;
}

async fn accept_loop(rv: Weak<TcpRendezvous>, listener: TcpListener) {
    let mut shutdown = match rv.upgrade() {
        Some(rv) => rv.shutdown.subscribe(),
        None => return,
    };
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.wait_for(|&stop| stop) => return,
        };
        let Some(rv) = rv.upgrade() else { return };
        match accepted {
            Ok((stream, addr)) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve(rv, stream, addr));
            }
            Err(e) => tracing::warn!("{}: accept failed: {e}", rv.name),
        }
    }
}

/// Reads one incoming connection until it closes or misbehaves.
async fn serve(rv: Arc<TcpRendezvous>, mut stream: TcpStream, addr: SocketAddr) {
    let mut shutdown = rv.shutdown.subscribe();
    let mut peer: Option<Arc<str>> = None;
    let res = tokio::select! {
        r = read_frames(&rv, &mut stream, addr, &mut peer) => r,
        _ = shutdown.wait_for(|&stop| stop) => return,
    };
    let label = match &peer {
        Some(p) => format!("{p} ({addr})"),
        None => addr.to_string(),
    };
    let cause = match res {
        Ok(()) if rv.closing.load(Ordering::SeqCst) => {
            tracing::debug!(
                "{}: peer `{label}` closed its connection as this task closes",
                rv.name
            );
            return;
        }
        Ok(()) => {
            // A clean close between frames: the layer above decides whether that is a failure
            // (a task dying mid-job) or expected (the job ending), and says so.
            tracing::debug!(peer = %label, "{}: peer `{label}` closed the connection", rv.name);
            "closed the connection".to_string()
        }
        Err(e) if peer.is_none() => {
            // Refused in the handshake: the same peer retrying must not flood the log.
            let quiet = {
                let mut peers = lock(&rv.peers);
                let now = std::time::Instant::now();
                match peers.refusals.get_mut(&addr.ip()) {
                    Some((last, n)) if now.duration_since(*last) < REFUSAL_LOG_EVERY => {
                        *n += 1;
                        None
                    }
                    Some((last, n)) => {
                        let since = *n;
                        (*last, *n) = (now, 0);
                        Some(since)
                    }
                    None => {
                        peers.refusals.insert(addr.ip(), (now, 0));
                        Some(0)
                    }
                }
            };
            match quiet {
                Some(0) => {
                    tracing::error!(peer = %label, "{}: dropping connection from peer `{label}`: {e}", rv.name)
                }
                Some(n) => {
                    tracing::error!(peer = %label, "{}: dropping connection from peer `{label}`: {e} ({n} more refused from {} in the last {}s)", rv.name, addr.ip(), REFUSAL_LOG_EVERY.as_secs())
                }
                None => {
                    tracing::debug!(peer = %label, "{}: dropping connection from peer `{label}`: {e}", rv.name)
                }
            }
            return;
        }
        Err(e) => {
            tracing::error!(peer = %label, "{}: dropping connection from peer `{label}`: {e}", rv.name);
            e.to_string()
        }
    };
    if let Some(p) = peer {
        rv.peer_gone(&p, &cause);
    }
}

async fn read_frames(
    rv: &TcpRendezvous,
    stream: &mut TcpStream,
    addr: SocketAddr,
    peer_out: &mut Option<Arc<str>>,
) -> Result<(), TcpError> {
    let cfg = rv.config;
    let addr_s = addr.to_string();
    let io_err = |peer: &str, what: &str, source: io::Error| TcpError::Io {
        peer: peer.to_string(),
        what: what.to_string(),
        source,
    };
    let timed = |peer: &str, what: &str| io_err(peer, what, io::ErrorKind::TimedOut.into());
    let mut head = [0u8; HEADER_LEN];

    // At most `max_handshaking` connections may be unauthenticated at once.
    let handshake_slot = {
        let mut peers = lock(&rv.peers);
        if peers.handshaking >= cfg.max_handshaking {
            return Err(TcpError::Protocol {
                peer: addr_s,
                msg: format!(
                    "{} connections are already in their handshake (the limit); refusing this one",
                    cfg.max_handshaking
                ),
            });
        }
        peers.handshaking += 1;
        Admitted { rv, peer: None }
    };

    // Hello: the peer's task name, authenticated when this task has a cluster secret.
    let name = match &rv.secret {
        Some(secret) => {
            // What to tell a peer that is refused (its own view of the problem).
            let mut tell_peer: Option<String> = None;
            let handshake = async {
                let hello = recv_control(stream, FrameKind::Hello).await?;
                let (acceptor, challenge) = Acceptor::challenge(secret, &rv.name, &hello, &addr_s)
                    .map_err(|e| {
                        if let AuthError::NoSecret { .. } = e {
                            tell_peer = Some(format!(
                                "task `{}` requires the job's cluster secret and this task sent \
                                 none: start this task with the same --secret-file (or \
                                 {SECRET_ENV}) as the others",
                                rv.name
                            ));
                        }
                        io::Error::new(io::ErrorKind::PermissionDenied, e)
                    })?;
                send_control(stream, FrameKind::Challenge, &challenge).await?;
                let proof = match recv_control(stream, FrameKind::Proof).await {
                    // The connector checks this task's proof first and hangs up when it fails.
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                        return Err(io::Error::new(
                            io::ErrorKind::PermissionDenied,
                            format!(
                                "the peer hung up instead of answering this task's challenge: it \
                                 found this task's proof wrong, so its cluster secret differs \
                                 from this task's; start every task with the same --secret-file \
                                 (or {SECRET_ENV})"
                            ),
                        ))
                    }
                    r => r?,
                };
                acceptor
                    .verify(&proof, &addr_s)
                    .map_err(|e| io::Error::new(io::ErrorKind::PermissionDenied, e))
            };
            let res = tokio::time::timeout(cfg.frame_timeout, handshake).await;
            if let Some(reason) = &tell_peer {
                refuse(stream, reason).await;
            }
            res.map_err(|_| timed(&addr_s, "authenticating"))?
                .map_err(|e| io_err(&addr_s, "authenticating", e))?
        }
        None => {
            let got = tokio::time::timeout(cfg.frame_timeout, read_full(stream, &mut head))
                .await
                .map_err(|_| timed(&addr_s, "waiting for Hello"))?
                .map_err(|e| io_err(&addr_s, "reading Hello", e))?;
            if got == 0 {
                return Ok(());
            }
            let h = decode_header_slice(&head[..got], 0).map_err(|e| e.with_peer(&addr_s))?;
            if h.kind != FrameKind::Hello || h.payload_len as usize > MAX_PEER_NAME {
                return Err(TcpError::Protocol {
                    peer: addr_s,
                    msg: format!(
                        "first frame must be a Hello with a name of at most {MAX_PEER_NAME} bytes, got {:?} with {} bytes",
                        h.kind, h.payload_len
                    ),
                });
            }
            let mut name = vec![0u8; h.payload_len as usize];
            tokio::time::timeout(cfg.frame_timeout, stream.read_exact(&mut name))
                .await
                .map_err(|_| timed(&addr_s, "reading Hello"))?
                .map_err(|e| io_err(&addr_s, "reading Hello", e))?;
            // An authenticating peer's Hello starts with the handshake version, not a name.
            if name.first() == Some(&crate::auth::AUTH_VERSION) {
                refuse(
                    stream,
                    &format!(
                        "task `{}` was started without a cluster secret, but this task \
                         authenticates with one: start every task with the same --secret-file \
                         (or {SECRET_ENV}), or none",
                        rv.name
                    ),
                )
                .await;
                return Err(TcpError::Protocol {
                    peer: addr_s,
                    msg: format!(
                        "the peer authenticates with a cluster secret, but this task was started \
                         without one: start it with the job's --secret-file (or {SECRET_ENV})"
                    ),
                });
            }
            String::from_utf8(name).map_err(|_| TcpError::Protocol {
                peer: addr_s.clone(),
                msg: "Hello name is not UTF-8".into(),
            })?
        }
    };
    let peer: Arc<str> = name.into();
    drop(handshake_slot);
    let _peer_slot = {
        let mut peers = lock(&rv.peers);
        let open = peers.incoming.entry(peer.clone()).or_default();
        if *open >= cfg.max_connections_per_peer {
            return Err(TcpError::Protocol {
                peer: format!("{peer} ({addr})"),
                msg: format!(
                    "peer `{peer}` already has {} connections open to this task (the limit); \
                     refusing another: is a second process running as `{peer}`?",
                    cfg.max_connections_per_peer
                ),
            });
        }
        *open += 1;
        Admitted {
            rv,
            peer: Some(peer.clone()),
        }
    };
    *peer_out = Some(peer.clone());
    lock(&rv.peers).gone.remove(&peer);
    let label = format!("{peer} ({addr})");

    loop {
        let got = tokio::time::timeout(cfg.idle_timeout, read_full(stream, &mut head))
            .await
            .map_err(|_| timed(&label, "idle"))?
            .map_err(|e| io_err(&label, "reading a frame header", e))?;
        if got == 0 {
            return Ok(());
        }
        // Bound a Data payload by its slot's registered size. An unknown slot id is rejected by
        // `checkout` right after, still before anything is allocated or read.
        let slot_id = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
        let bound = if head[6] == FrameKind::Message as u8 {
            cfg.max_message
        } else {
            rv.slots.slot_len(slot_id).unwrap_or(u64::MAX)
        };
        let h = decode_header_slice(&head[..got], bound).map_err(|e| e.with_peer(&label))?;
        match h.kind {
            FrameKind::Data => {
                let mut c = rv
                    .slots
                    .checkout(h.slot_id, &peer, h.payload_len)
                    .map_err(|msg| TcpError::Protocol {
                        peer: label.clone(),
                        msg: format!("{msg} (step {})", h.step),
                    })?;
                let read = match Arc::get_mut(&mut c.buf) {
                    Some(b) => {
                        tokio::time::timeout(cfg.frame_timeout, stream.read_exact(b.as_bytes_mut()))
                            .await
                    }
                    None => Ok(Err(io::Error::other("slot buffer is shared"))),
                };
                let tensor = Tensor::from_shared(c.dtype, &c.dims, c.buf.clone());
                rv.slots.checkin(h.slot_id, c.buf);
                let what = || {
                    format!(
                        "reading {} payload bytes of slot {} (key {}, step {})",
                        h.payload_len, h.slot_id, c.key, h.step
                    )
                };
                read.map_err(|_| timed(&label, &what()))?
                    .map_err(|e| io_err(&label, &what(), e))?;
                let tensor = tensor.map_err(|e| TcpError::Protocol {
                    peer: label.clone(),
                    msg: e.to_string(),
                })?;
                if let Err(e) = rv.local.send(&c.key, h.step, tensor) {
                    tracing::warn!(peer = %label, "{}: frame from peer `{label}` not delivered: {e}", rv.name);
                }
            }
            FrameKind::Abort => {
                let mut reason = vec![0u8; h.payload_len as usize];
                tokio::time::timeout(cfg.frame_timeout, stream.read_exact(&mut reason))
                    .await
                    .map_err(|_| timed(&label, "reading an Abort"))?
                    .map_err(|e| io_err(&label, "reading an Abort", e))?;
                let reason = String::from_utf8_lossy(&reason);
                rv.local.abort_step(
                    h.step,
                    RendezvousError::Aborted {
                        step: h.step,
                        cause: format!("aborted by peer `{peer}`: {reason}"),
                    },
                );
            }
            FrameKind::Message => {
                let body = tokio::time::timeout(
                    cfg.frame_timeout,
                    crate::wire::read_claimed(stream, h.payload_len),
                )
                .await
                .map_err(|_| timed(&label, "reading a message"))?
                .map_err(|e| io_err(&label, "reading a message", e))?;
                rv.emit(PeerEvent::Message {
                    peer: peer.clone(),
                    body,
                });
            }
            // Any frame proves the peer alive; the read timeout above does the rest.
            FrameKind::Heartbeat => {}
            // TODO(credits): a Credit releases a slot on the sender side.
            FrameKind::Credit => {}
            FrameKind::Hello | FrameKind::Challenge | FrameKind::Proof => {
                return Err(TcpError::Protocol {
                    peer: label,
                    msg: format!("{:?} frame after the handshake", h.kind),
                })
            }
        }
    }
}

crate::plane::slot_table_data_plane!(TcpRendezvous);
