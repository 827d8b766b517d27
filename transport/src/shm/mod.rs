//! The shared-memory data plane, for tasks on one host: tensors cross without a copy.
//!
//! Each receive slot of a sender → receiver pair is a segment under `/dev/shm` that both map
//! ([`segment`]). The sender creates it when it first needs the slot, tells the receiver its name
//! over the side channel, and the receiver maps it and unlinks the name at once, so a crash of
//! either task leaves no file behind. The producer of a sent value (a kernel, through
//! [`Rendezvous::send_buffer`](crate::Rendezvous::send_buffer) and the executor's output allocation) writes straight into its
//! view of the slot; `send` then only publishes it, and the receiver's Recv output is a
//! read-only [`Buffer`] over its own view of the same pages. A value produced elsewhere is copied
//! into the slot once by `send` (counted in [`ShmStats::copied_sends`]).
//!
//! Credits: a slot is `FREE`, `WRITING` (the sender owns it) or `FULL` (the receiver owns it
//! until the last view of the received tensor is dropped). The sender writes a slot only when it
//! is `FREE` and its own previous view of it is gone; it waits for that with a bounded spin, then
//! a futex in the slot's page, and gives up after the plane's frame timeout with
//! [`RendezvousError::SlotBusy`] naming the key and peer, or at once with
//! [`RendezvousError::PeerGone`] when the peer dies. Notifications ride a per-pair ring in shared
//! memory ([`slot::Ring`]) that one thread per sending peer consumes (spin, then futex); a slot's
//! first delivery travels as a side-channel message right after its segment's name, which keeps
//! the two ordered.
//!
//! A peer's death or close arrives on the side channel, not through its ring, so it may overtake
//! notifications the peer pushed just before: their values are complete (a slot is `FULL` before
//! its notification is pushed) and must not be lost. So before this plane marks a peer gone, it
//! stops the ring's consumer, waits for its thread to exit (the ring keeps one consumer), and
//! delivers what is left in the ring itself; only then does it fail the Recvs still waiting on
//! that peer. A Recv registered after that still gets a value delivered before. Replacing a
//! peer's ring and [`DataPlane::close`](crate::DataPlane::close) drain the old rings the same way.
//!
//! The side channel is a [`TcpPlane`]: control-plane messages, peer liveness (heartbeats,
//! closed connections), authentication with a cluster secret, and this plane's own small messages
//! ([`message`]).
//!
//! Trust: a peer that maps a segment can write it at any time; like an authenticated TCP peer
//! that sends wrong numbers, a misbehaving task of the same job can corrupt values, but the
//! receiver never reads outside its mappings, checks every slot id and length it is given, and
//! refuses segment names that are not this plane's.

pub mod message;
pub mod segment;
pub mod slot;

use crate::auth::Secret;
use crate::config::TcpConfig;
use crate::plane::{lock, BoxFuture, Link, PeerEvent, Plane};
use crate::rendezvous::{RendezvousError, RendezvousKey};
use crate::tcp::TcpPlane;
use dflow_graph::tensor::Buffer;
use dflow_graph::{DType, Tensor};
use message::ShmMessage;
use segment::{checked_path, new_name, shm_dir};
use slot::{Ring, SlotMem, WaitError, FREE, FULL, WRITING};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Counters of the values this plane sent and received.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShmStats {
    /// Sends whose value was written in place by its producer: nothing copied.
    pub zero_copy_sends: u64,
    /// Sends whose value was copied into the slot once.
    pub copied_sends: u64,
    /// Bytes those copies moved.
    pub copied_bytes: u64,
    /// Values received (each a view of a slot).
    pub received: u64,
}

#[derive(Default)]
struct Counters {
    zero_copy_sends: AtomicU64,
    copied_sends: AtomicU64,
    copied_bytes: AtomicU64,
    received: AtomicU64,
}

/// The sending peer and slot id of a received key.
type RecvRoute = (Arc<str>, u32);

/// A receive slot of this task.
struct RecvSlot {
    peer: Arc<str>,
    key: Arc<RendezvousKey>,
    dtype: DType,
    dims: Arc<[usize]>,
    len: usize,
    /// The sender's segment, once attached.
    mem: Option<Arc<SlotMem>>,
    /// True while a received view of the slot exists.
    held: Arc<AtomicBool>,
}

/// A slot this task sends into.
struct SendSlot {
    mem: Arc<SlotMem>,
    /// True once its first value went out (by message; later ones go through the ring).
    delivered: AtomicBool,
    /// This task's live view of the slot, if a producer still holds one.
    view: Mutex<Weak<()>>,
}

/// Where a key goes: the receiving peer, its slot id, and the shared-memory slot once created.
pub struct SendRoute {
    peer: Arc<str>,
    slot_id: u32,
    slot: Mutex<Option<Arc<SendSlot>>>,
}

impl fmt::Debug for SendRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SendRoute(to `{}`, slot {})", self.peer, self.slot_id)
    }
}

/// The ring towards one receiving peer, with its producer lock.
struct SendPair {
    ring: Mutex<Ring>,
}

/// The thread that consumes one sending peer's ring.
struct Consumer {
    ring: Arc<Ring>,
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
    /// Disconnected when the thread exits (it holds the only sender): a bounded wait for that.
    exited: std::sync::mpsc::Receiver<()>,
}

/// Longest sleep of a ring consumer between checks of its `stop` flag (a wake ends it sooner).
const CONSUMER_NAP: Duration = Duration::from_millis(50);

/// How long retiring a ring's consumer waits for its thread to exit. Told to stop and woken, it
/// exits at once, or after the delivery it is in the middle of, whose Recv callback only hands
/// the value on (the executor's callbacks queue work); the bound only keeps a callback that
/// blocks from stalling the caller (the side channel's event pump, or `close`) for long.
const CONSUMER_EXIT_WAIT: Duration = Duration::from_secs(2);

/// The receiver's view of a slot: releases the slot to the sender when the last clone of the
/// received tensor is dropped.
struct RecvView {
    mem: Arc<SlotMem>,
    held: Arc<AtomicBool>,
}

impl Drop for RecvView {
    fn drop(&mut self) {
        self.held.store(false, Ordering::SeqCst);
        self.mem.release();
    }
}

/// The sender's view of a slot, handed to the producer: keeps the mapping alive, and tells the
/// plane (through `_token`) when the producer let go of it.
struct SendView {
    _mem: Arc<SlotMem>,
    _token: Arc<()>,
}

/// A data plane over shared memory, with a TCP side channel (see the module docs): a [`Plane`]
/// over a [`ShmLink`].
pub type ShmPlane = Plane<ShmLink>;

/// What the shared-memory plane does its own way (see [`Link`]): slots in shared segments,
/// notification rings and their consumers, and the TCP side channel.
pub struct ShmLink {
    tcp: Arc<TcpPlane>,
    /// How long a sender waits for a slot's credit or room in a ring.
    slot_timeout: Duration,
    recv: Mutex<HashMap<u32, RecvSlot>>,
    /// Each receive slot's key → its sending peer and slot id.
    recv_keys: Mutex<HashMap<Arc<RendezvousKey>, RecvRoute>>,
    routes: Mutex<HashMap<Arc<RendezvousKey>, Arc<SendRoute>>>,
    pairs: Mutex<HashMap<Arc<str>, Arc<SendPair>>>,
    consumers: Mutex<HashMap<Arc<str>, Consumer>>,
    /// Peers this task connected to (aborts go to them).
    peers: Mutex<HashSet<Arc<str>>>,
    /// Segments this task created, unlinked at close (the receiver unlinks them first normally).
    created: Mutex<Vec<PathBuf>>,
    counters: Counters,
}

impl fmt::Debug for ShmLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ShmLink(on {}, {} receive slots, {} routes)",
            self.tcp.local_addr(),
            lock(&self.recv).len(),
            lock(&self.routes).len()
        )
    }
}

impl ShmPlane {
    /// Listens on `addr` for the side channel as task `name` (with `secret`, every side-channel
    /// connection is authenticated). Removes segments that dead processes left behind. Must run
    /// inside a tokio runtime.
    pub async fn bind(
        name: &str,
        addr: SocketAddr,
        config: TcpConfig,
        secret: Option<Secret>,
    ) -> io::Result<Arc<ShmPlane>> {
        let swept = segment::sweep_dead();
        if swept > 0 {
            tracing::info!("{name}: removed {swept} shared-memory segments left by dead processes");
        }
        let tcp = TcpPlane::bind_with_secret(name, addr, config, secret).await?;
        let events = tcp.subscribe();
        let link = ShmLink {
            tcp,
            slot_timeout: config.frame_timeout,
            recv: Mutex::default(),
            recv_keys: Mutex::default(),
            routes: Mutex::default(),
            pairs: Mutex::default(),
            consumers: Mutex::default(),
            peers: Mutex::default(),
            created: Mutex::default(),
            counters: Counters::default(),
        };
        let plane = Arc::new(Plane::with_link(name, link));
        tokio::spawn(pump(Arc::downgrade(&plane), events));
        Ok(plane)
    }

    /// What was sent and received so far.
    pub fn stats(&self) -> ShmStats {
        let c = &self.link.counters;
        ShmStats {
            zero_copy_sends: c.zero_copy_sends.load(Ordering::Relaxed),
            copied_sends: c.copied_sends.load(Ordering::Relaxed),
            copied_bytes: c.copied_bytes.load(Ordering::Relaxed),
            received: c.received.load(Ordering::Relaxed),
        }
    }

    /// The addresses of this task's mapping of the receive slot for `key`, once attached (for
    /// zero-copy checks: a received tensor's bytes lie in it).
    pub fn recv_mapping(&self, key: &RendezvousKey) -> Option<Range<usize>> {
        let (_, slot) = lock(&self.link.recv_keys).get(key).cloned()?;
        let recv = lock(&self.link.recv);
        let m = recv.get(&slot)?.mem.as_ref()?.mapping();
        let start = m.base().as_ptr() as usize;
        Some(start..start + m.len())
    }

    /// The addresses of this task's mapping of the slot it sends `key` into, once created.
    pub fn send_mapping(&self, key: &RendezvousKey) -> Option<Range<usize>> {
        let route = lock(&self.link.routes).get(key).cloned()?;
        let slot = lock(&route.slot).clone()?;
        let m = slot.mem.mapping();
        let start = m.base().as_ptr() as usize;
        Some(start..start + m.len())
    }

    fn send_shm(&self, peer: &str, m: &ShmMessage) -> Result<(), RendezvousError> {
        self.link.tcp.send_message(peer, m.encode())
    }

    /// The ring towards `peer`, created (and announced) on first use.
    fn pair(&self, peer: &Arc<str>) -> Result<Arc<SendPair>, String> {
        let mut pairs = lock(&self.link.pairs);
        if let Some(p) = pairs.get(peer) {
            return Ok(p.clone());
        }
        let name = new_name(&format!("{}-{peer}-ring", self.name));
        let path = shm_dir().join(&name);
        let ring = Ring::create(&path).map_err(|e| format!("creating {}: {e}", path.display()))?;
        lock(&self.link.created).push(path);
        self.send_shm(peer, &ShmMessage::AttachRing { name })
            .map_err(|e| e.to_string())?;
        let pair = Arc::new(SendPair {
            ring: Mutex::new(ring),
        });
        pairs.insert(peer.clone(), pair.clone());
        Ok(pair)
    }

    /// The slot `route` sends into, created (and announced) for `len` bytes on first use.
    fn send_slot(&self, route: &SendRoute, len: usize) -> Result<Arc<SendSlot>, String> {
        let mut guard = lock(&route.slot);
        if let Some(s) = &*guard {
            if s.mem.len() != len {
                return Err(format!(
                    "a {len}-byte value for slot {} whose values have {} bytes",
                    route.slot_id,
                    s.mem.len()
                ));
            }
            return Ok(s.clone());
        }
        self.pair(&route.peer)?;
        let name = new_name(&format!("{}-{}-s{}", self.name, route.peer, route.slot_id));
        let path = shm_dir().join(&name);
        let mem =
            SlotMem::create(&path, len).map_err(|e| format!("creating {}: {e}", path.display()))?;
        lock(&self.link.created).push(path);
        self.send_shm(
            &route.peer,
            &ShmMessage::AttachSlot {
                slot: route.slot_id,
                len: len as u64,
                name,
            },
        )
        .map_err(|e| e.to_string())?;
        let slot = Arc::new(SendSlot {
            mem: Arc::new(mem),
            delivered: AtomicBool::new(false),
            view: Mutex::new(Weak::new()),
        });
        *guard = Some(slot.clone());
        Ok(slot)
    }

    /// Takes `slot` for writing (state `WRITING`): waits until the receiver released it and this
    /// task's previous view of it is gone.
    fn acquire(
        &self,
        key: &RendezvousKey,
        route: &SendRoute,
        slot: &SendSlot,
    ) -> Result<(), RendezvousError> {
        let t0 = Instant::now();
        let deadline = t0 + self.link.slot_timeout;
        let busy = |cause: &'static str| RendezvousError::SlotBusy {
            key: key.clone(),
            peer: route.peer.to_string(),
            waited_ms: t0.elapsed().as_millis() as u64,
            cause,
        };
        // This task's own view first: it is released by the end of the producer's step.
        while lock(&slot.view).strong_count() > 0 {
            if Instant::now() >= deadline {
                return Err(busy("this task still holds the value it sent last"));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        let state = slot.mem.state();
        loop {
            let ready = slot.mem.wait(
                |s| s != FULL,
                deadline,
                || match self.gone_cause(&route.peer) {
                    Some(cause) => Err(cause),
                    None => Ok(()),
                },
            );
            match ready {
                Ok(WRITING) => return Ok(()),
                Ok(_) => {
                    if state
                        .compare_exchange(FREE, WRITING, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                    {
                        return Ok(());
                    }
                }
                Err(WaitError::Timeout) => {
                    return Err(busy("the receiver has not released the previous value"))
                }
                Err(WaitError::Cancelled(cause)) => {
                    return Err(RendezvousError::PeerGone {
                        peer: route.peer.to_string(),
                        cause,
                    })
                }
            }
        }
    }

    /// Tells the receiver that `slot` holds the value of `step`.
    fn notify(
        &self,
        key: &RendezvousKey,
        route: &SendRoute,
        slot: &SendSlot,
        step: u64,
    ) -> Result<(), RendezvousError> {
        slot.mem.publish(step);
        if !slot.delivered.swap(true, Ordering::SeqCst) {
            return self.send_shm(
                &route.peer,
                &ShmMessage::Deliver {
                    slot: route.slot_id,
                    step,
                },
            );
        }
        let pair = lock(&self.link.pairs)
            .get(&route.peer)
            .cloned()
            .ok_or_else(|| RendezvousError::PeerGone {
                peer: route.peer.to_string(),
                cause: "no ring towards it".into(),
            })?;
        let ring = lock(&pair.ring);
        let t0 = Instant::now();
        ring.push(
            route.slot_id,
            step,
            t0 + self.link.slot_timeout,
            || match self.gone_cause(&route.peer) {
                Some(cause) => Err(cause),
                None => Ok(()),
            },
        )
        .map_err(|e| match e {
            WaitError::Timeout => RendezvousError::SlotBusy {
                key: key.clone(),
                peer: route.peer.to_string(),
                waited_ms: t0.elapsed().as_millis() as u64,
                cause: "its notification ring stayed full",
            },
            WaitError::Cancelled(cause) => RendezvousError::PeerGone {
                peer: route.peer.to_string(),
                cause,
            },
        })
    }

    /// Hands the value in receive slot `slot_id` for `step` to its Recv, as a view of the slot.
    fn deliver_slot(&self, peer: &str, slot_id: u32, step: u64) -> Result<(), String> {
        let (key, dtype, dims, mem, held) = {
            let recv = lock(&self.link.recv);
            let s = recv
                .get(&slot_id)
                .ok_or_else(|| format!("a value for unknown slot {slot_id}"))?;
            if *s.peer != *peer {
                return Err(format!(
                    "a value for slot {slot_id} (key {}), which belongs to `{}`",
                    s.key, s.peer
                ));
            }
            let mem = s.mem.clone().ok_or_else(|| {
                format!(
                    "a value for slot {slot_id} (key {}) before its segment",
                    s.key
                )
            })?;
            (s.key.clone(), s.dtype, s.dims.clone(), mem, s.held.clone())
        };
        if mem.state().load(Ordering::SeqCst) != FULL {
            return Err(format!(
                "slot {slot_id} (key {key}) was announced for step {step} but holds no value"
            ));
        }
        if held.swap(true, Ordering::SeqCst) {
            return Err(format!(
                "slot {slot_id} (key {key}) was announced for step {step} while this task still holds its previous value"
            ));
        }
        let len = mem.len();
        let view = RecvView {
            mem: mem.clone(),
            held,
        };
        // SAFETY: the slot is FULL: the sender published it and writes it again only after the
        // view's owner (`RecvView`) is dropped and sets it FREE; the mapping stays alive inside
        // the owner. The view is read-only, so this task never writes the shared bytes.
        let buf = unsafe { Buffer::from_external(mem.data(), len, false, Box::new(view)) }
            .ok_or_else(|| format!("slot {slot_id} (key {key}) is misaligned"))?;
        let tensor = Tensor::from_shared(dtype, &dims, Arc::new(buf)).map_err(|e| e.to_string())?;
        self.link.counters.received.fetch_add(1, Ordering::Relaxed);
        self.deliver(peer, &key, step, tensor);
        Ok(())
    }

    /// Handles one of this plane's side-channel messages from `peer`.
    fn on_message(self: &Arc<Self>, peer: &Arc<str>, m: ShmMessage) -> Result<(), String> {
        match m {
            ShmMessage::AttachRing { name } => {
                let path = checked_path(&name)?;
                let ring = Ring::open(&path);
                let _ = std::fs::remove_file(&path);
                let ring = Arc::new(ring.map_err(|e| format!("ring segment {name}: {e}"))?);
                // The peer's notifications in its old ring, if any, precede everything in the new
                // one: deliver them before a consumer of the new ring starts.
                let old = lock(&self.link.consumers).remove(peer);
                if let Some(old) = old {
                    old.stop.store(true, Ordering::SeqCst);
                    old.ring.wake();
                    self.retire(peer, old);
                }
                let stop = Arc::new(AtomicBool::new(false));
                let (exited_tx, exited) = std::sync::mpsc::channel::<()>();
                let (plane, peer2, ring2, stop2) = (
                    Arc::downgrade(self),
                    peer.clone(),
                    ring.clone(),
                    stop.clone(),
                );
                let thread = std::thread::Builder::new()
                    .name(format!("dflow-shm-rx-{peer}"))
                    .spawn(move || {
                        let _exited = exited_tx;
                        consume(plane, peer2, ring2, stop2)
                    })
                    .map_err(|e| format!("starting the ring consumer: {e}"))?;
                let replaced = lock(&self.link.consumers).insert(
                    peer.clone(),
                    Consumer {
                        ring,
                        stop,
                        thread,
                        exited,
                    },
                );
                // Only this task's event pump attaches rings, so nothing came in between; if
                // something did, it is retired like the old one.
                if let Some(other) = replaced {
                    other.stop.store(true, Ordering::SeqCst);
                    other.ring.wake();
                    self.retire(peer, other);
                }
                Ok(())
            }
            ShmMessage::AttachSlot { slot, len, name } => {
                let path = checked_path(&name)?;
                let opened = {
                    let recv = lock(&self.link.recv);
                    match recv.get(&slot) {
                        Some(s) if *s.peer == **peer && s.len as u64 == len => {
                            SlotMem::open(&path, s.len)
                        }
                        Some(s) => Err(format!(
                            "segment for slot {slot} (key {}) of {len} bytes from `{peer}`; the slot holds {} bytes from `{}`",
                            s.key, s.len, s.peer
                        )),
                        None => Err(format!("segment for unknown slot {slot}")),
                    }
                };
                let _ = std::fs::remove_file(&path);
                let mem = Arc::new(opened?);
                if let Some(s) = lock(&self.link.recv).get_mut(&slot) {
                    s.mem = Some(mem);
                }
                Ok(())
            }
            ShmMessage::Deliver { slot, step } => self.deliver_slot(peer, slot, step),
            ShmMessage::Abort { step, reason } => {
                self.aborted_by_peer(peer, step, &reason);
                Ok(())
            }
        }
    }

    /// Stops `peer`'s ring consumer and delivers what the peer notified before it went (the
    /// link's part of marking it gone: [`Link::forget_peer`]).
    ///
    /// Runs in the event pump (a tokio task) and blocks it while the consumer thread exits and
    /// the ring drains: a wake-up and at most [`slot::RING_CAP`] deliveries, with the wait for
    /// the thread bounded by [`CONSUMER_EXIT_WAIT`]. Blocking here rather than handing the work
    /// to another task keeps the side channel's order: every value the peer sent is delivered
    /// before it is marked gone, before `Gone` is passed on, and before the pump's next event.
    fn stop_consumer(&self, peer: &Arc<str>) {
        let consumer = lock(&self.link.consumers).remove(peer);
        if let Some(c) = consumer {
            c.stop.store(true, Ordering::SeqCst);
            c.ring.wake();
            self.retire(peer, c);
        }
    }

    /// Waits (bounded) for the thread of `c`, already told to stop and woken, to exit, then
    /// delivers what is left in its ring on this thread: nothing the peer pushed before the
    /// consumer stopped is lost, and the ring never has two consumers.
    fn retire(&self, peer: &Arc<str>, c: Consumer) {
        if c.thread.thread().id() == std::thread::current().id() {
            // Called from a Recv callback on the consumer itself: it is the ring's only
            // consumer, and stops when that callback returns.
            self.drain(peer, &c.ring);
            return;
        }
        if let Err(RecvTimeoutError::Timeout) = c.exited.recv_timeout(CONSUMER_EXIT_WAIT) {
            tracing::error!(
                peer = %peer,
                "{}: the consumer of the ring of `{peer}` did not stop within {CONSUMER_EXIT_WAIT:?} (a Recv callback blocks?); values it did not deliver yet are dropped",
                self.name
            );
            return;
        }
        if c.thread.join().is_err() {
            tracing::error!(peer = %peer, "{}: the consumer of the ring of `{peer}` panicked", self.name);
        }
        self.drain(peer, &c.ring);
    }

    /// Delivers the entries left in `peer`'s ring (its consumer has exited). Takes at most the
    /// ring's capacity, so a peer that keeps pushing cannot keep this thread here.
    fn drain(&self, peer: &Arc<str>, ring: &Ring) {
        for _ in 0..slot::RING_CAP {
            match ring.pop() {
                Ok(Some((slot, step))) => {
                    if let Err(e) = self.deliver_slot(peer, slot, step) {
                        tracing::error!(peer = %peer, "{}: value from `{peer}` refused: {e}", self.name);
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    tracing::error!(peer = %peer, "{}: dropping the ring of `{peer}`: {e}", self.name);
                    return;
                }
            }
        }
    }

    /// Stops every ring consumer: tells them all first, then retires each (see `retire`).
    fn retire_consumers(&self) {
        let all: Vec<(Arc<str>, Consumer)> = lock(&self.link.consumers).drain().collect();
        for (_, c) in &all {
            c.stop.store(true, Ordering::SeqCst);
            c.ring.wake();
        }
        for (peer, c) in all {
            self.retire(&peer, c);
        }
    }
}

impl ShmLink {
    /// Tells every ring consumer to stop, without waiting: for `Drop`, which may run on a
    /// consumer thread (the last reference to the plane can be the one it upgraded), and after
    /// which nothing could receive a value anyway.
    fn stop_consumers(&self) {
        for (_, c) in lock(&self.consumers).drain() {
            c.stop.store(true, Ordering::SeqCst);
            c.ring.wake();
        }
    }

    fn unlink_created(&self) {
        for path in lock(&self.created).drain(..) {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.stop_consumers();
        self.unlink_created();
    }
}

/// Forwards the side channel's events, taking this plane's own messages out.
async fn pump(plane: Weak<ShmPlane>, mut events: mpsc::UnboundedReceiver<PeerEvent>) {
    while let Some(event) = events.recv().await {
        let Some(plane) = plane.upgrade() else { return };
        match event {
            PeerEvent::Message { peer, body } => match ShmMessage::decode(&body) {
                None => plane.emit(PeerEvent::Message { peer, body }),
                Some(decoded) => {
                    if let Err(e) = decoded.and_then(|m| plane.on_message(&peer, m)) {
                        tracing::error!(peer = %peer, "{}: shared-memory message from `{peer}` refused: {e}", plane.name);
                    }
                }
            },
            PeerEvent::Gone { peer, cause } => plane.peer_gone(&peer, &cause),
        }
    }
}

/// Consumes the ring of sending peer `peer` until stopped or the plane is gone. Checks `stop`
/// after every entry and every wait, and waits at most [`CONSUMER_NAP`] (a wake ends the wait at
/// once), so a stopped consumer exits promptly; whoever stopped it delivers what it left.
fn consume(plane: Weak<ShmPlane>, peer: Arc<str>, ring: Arc<Ring>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        match ring.pop() {
            Ok(Some((slot, step))) => {
                let Some(p) = plane.upgrade() else { return };
                if let Err(e) = p.deliver_slot(&peer, slot, step) {
                    tracing::error!(peer = %peer, "{}: value from `{peer}` refused: {e}", p.name);
                }
            }
            Ok(None) => ring.wait(slot::SPIN, CONSUMER_NAP, &stop),
            Err(e) => {
                if let Some(p) = plane.upgrade() {
                    tracing::error!(peer = %peer, "{}: dropping the ring of `{peer}`: {e}", p.name);
                }
                return;
            }
        }
    }
}

impl Link for ShmLink {
    type Route = Arc<SendRoute>;

    fn route(&self, key: &RendezvousKey) -> Option<(Arc<str>, Arc<SendRoute>)> {
        lock(&self.routes)
            .get(key)
            .map(|r| (r.peer.clone(), r.clone()))
    }

    fn sender_of(&self, key: &RendezvousKey) -> Option<Arc<str>> {
        lock(&self.recv_keys).get(key).map(|(p, _)| p.clone())
    }

    fn send_to(
        plane: &ShmPlane,
        key: &Arc<RendezvousKey>,
        step: u64,
        _peer: &Arc<str>,
        route: Arc<SendRoute>,
        value: Tensor,
    ) -> Result<(), RendezvousError> {
        let len = value.byte_len();
        let slot = plane
            .send_slot(&route, len)
            .map_err(|e| RendezvousError::Aborted {
                step,
                cause: format!("sending {key} to `{}`: {e}", route.peer),
            })?;
        let in_place = value.buffer().is_external() && value.data_ptr() == slot.mem.data().as_ptr();
        if in_place {
            // The producer wrote into the slot: it holds WRITING since `send_buffer`.
            drop(value);
            plane
                .link
                .counters
                .zero_copy_sends
                .fetch_add(1, Ordering::Relaxed);
        } else {
            plane.acquire(key, &route, &slot)?;
            // SAFETY: this task holds the slot (WRITING) and no view of it exists on either side
            // (the receiver released it, this task's last view is gone), so nothing else reads or
            // writes these `len` bytes, which lie inside the live mapping.
            unsafe {
                std::ptr::copy_nonoverlapping(value.data_ptr(), slot.mem.data().as_ptr(), len);
            }
            plane
                .link
                .counters
                .copied_sends
                .fetch_add(1, Ordering::Relaxed);
            plane
                .link
                .counters
                .copied_bytes
                .fetch_add(len as u64, Ordering::Relaxed);
        }
        plane.notify(key, &route, &slot, step)
    }

    fn tell_abort(plane: &ShmPlane, step: u64, reason: &str) {
        // At most 1 KiB, cut at a character boundary.
        let mut end = reason.len().min(1024);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        let reason = &reason[..end];
        let peers: Vec<Arc<str>> = lock(&plane.link.peers).iter().cloned().collect();
        for peer in peers {
            let _ = plane.send_shm(
                &peer,
                &ShmMessage::Abort {
                    step,
                    reason: reason.to_string(),
                },
            );
        }
    }

    fn forget_peer(plane: &ShmPlane, peer: &Arc<str>, _cause: &str) {
        plane.stop_consumer(peer);
    }

    fn send_buffer(
        plane: &ShmPlane,
        key: &Arc<RendezvousKey>,
        _step: u64,
        dtype: DType,
        dims: &[usize],
    ) -> Option<Tensor> {
        let route = lock(&plane.link.routes).get(key).cloned()?;
        if plane.gone_cause(&route.peer).is_some() {
            return None;
        }
        let len = dims
            .iter()
            .try_fold(dtype.size_of(), |acc, &d| acc.checked_mul(d))?;
        let slot = match plane.send_slot(&route, len) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("{}: no shared-memory slot for {key}: {e}", plane.name);
                return None;
            }
        };
        // On failure the producer allocates normally and `send` reports the busy slot.
        plane.acquire(key, &route, &slot).ok()?;
        let token = Arc::new(());
        *lock(&slot.view) = Arc::downgrade(&token);
        let view = SendView {
            _mem: slot.mem.clone(),
            _token: token,
        };
        // SAFETY: this task holds the slot (WRITING): the receiver neither reads nor writes it
        // until `send` publishes it, and no other view of it exists here (`acquire` waited for
        // the previous one to go). The mapping lives inside the owner.
        let buf = unsafe { Buffer::from_external(slot.mem.data(), len, true, Box::new(view)) }?;
        Tensor::from_shared(dtype, dims, Arc::new(buf)).ok()
    }

    fn local_addr(&self) -> SocketAddr {
        self.tcp.local_addr()
    }

    fn register_recv(
        plane: &ShmPlane,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), String> {
        let err = |msg: String| format!("cannot register slot {slot_id} for key {key}: {msg}");
        let len = dims
            .iter()
            .try_fold(dtype.size_of(), |a, &d| a.checked_mul(d))
            .filter(|&l| l <= dflow_graph::tensor::MAX_TENSOR_BYTES)
            .ok_or_else(|| err(format!("shape {dims:?} is too large")))?;
        let mut recv = lock(&plane.link.recv);
        if let Some(s) = recv.get(&slot_id) {
            return Err(err(format!("slot id already used by key {}", s.key)));
        }
        let mut keys = lock(&plane.link.recv_keys);
        if keys.contains_key(&key) {
            return Err(err("key already has a slot".into()));
        }
        keys.insert(key.clone(), (peer.into(), slot_id));
        recv.insert(
            slot_id,
            RecvSlot {
                peer: peer.into(),
                key,
                dtype,
                dims: dims.into(),
                len,
                mem: None,
                held: Arc::new(AtomicBool::new(false)),
            },
        );
        Ok(())
    }

    fn register_send(plane: &ShmPlane, key: Arc<RendezvousKey>, peer: &str, slot_id: u32) {
        lock(&plane.link.routes).insert(
            key,
            Arc::new(SendRoute {
                peer: peer.into(),
                slot_id,
                slot: Mutex::new(None),
            }),
        );
    }

    fn connect(
        plane: Arc<ShmPlane>,
        peer: String,
        addr: SocketAddr,
    ) -> BoxFuture<'static, Result<(), String>> {
        Box::pin(async move {
            TcpPlane::connect(&plane.link.tcp, &peer, addr)
                .await
                .map_err(|e| e.to_string())?;
            plane.revive(&peer);
            lock(&plane.link.peers).insert(peer.into());
            Ok(())
        })
    }

    fn send_message(plane: &ShmPlane, peer: &str, body: Vec<u8>) -> Result<(), RendezvousError> {
        plane.link.tcp.send_message(peer, body)
    }

    fn close(plane: &ShmPlane, within: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            plane.link.tcp.close(within).await;
            // Values peers notified before the close are delivered, not dropped with the rings.
            plane.retire_consumers();
            plane.link.unlink_created();
            let s = plane.stats();
            tracing::info!(
                "{}: shm transport: {} values sent in place, {} copied into their slot ({} bytes), {} received",
                plane.name,
                s.zero_copy_sends,
                s.copied_sends,
                s.copied_bytes,
                s.received
            );
        })
    }
}
