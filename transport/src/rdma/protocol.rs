//! The RDMA protocol over [`Verbs`]: one reliable-connected queue pair per peer, receive slots
//! written with RDMA WRITE WITH IMMEDIATE, credits returned the same way.
//!
//! The driver is synchronous and explicit: the plane (or a test) feeds it the peer's control
//! messages and calls [`Protocol::progress`], which polls the completion queue once, delivers
//! landed tensors, returns credits for released slots and posts the writes that have a credit.
//!
//! One tensor is two work requests on the peer's queue pair: an unsignaled RDMA WRITE of the
//! payload into the slot, then an RDMA WRITE WITH IMMEDIATE of the 8-byte step id into the slot's
//! step word. RC queue pairs place writes in order, so when the immediate's completion arrives
//! the payload is there. The immediate ([`Imm`]) names the slot and the step's parity; the
//! receiver checks it against the step word, the slot's peer, its credit, and step order.

use super::imm::{Imm, ImmKind};
use super::message::SlotAd;
use super::routes::{Refused, SendRoutes, Write};
use super::slots::{Delivery, RecvSlots};
use super::verbs::{Completion, CompletionKind, QpEndpoint, QpId, RemoteSegment, Verbs};
use super::RdmaError;
use crate::rendezvous::RendezvousKey;
use dflow_graph::{DType, Tensor};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Receives kept posted per peer beyond two per slot and route.
const RECV_SLACK: usize = 16;
/// Completions taken per poll.
const POLL_BATCH: usize = 64;

/// What a work request was, in the top 32 bits of its id (the slot id is the low 32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u64)]
enum WrTag {
    Payload = 1,
    StepWord = 2,
    Credit = 3,
    Recv = 4,
}

fn wr_id(tag: WrTag, slot_id: u32) -> u64 {
    ((tag as u64) << 32) | u64::from(slot_id)
}

fn wr_tag(wr_id: u64) -> Option<WrTag> {
    match wr_id >> 32 {
        1 => Some(WrTag::Payload),
        2 => Some(WrTag::StepWord),
        3 => Some(WrTag::Credit),
        4 => Some(WrTag::Recv),
        _ => None,
    }
}

/// What [`Protocol::progress`] found.
#[derive(Debug)]
pub enum Event {
    /// A tensor landed: hand it to the Recv of its key and step.
    Delivered(Delivery),
    /// A queued Send could not be written: abort the step.
    StepFailed {
        /// The step.
        step: u64,
        /// Why, naming the peer and key.
        error: RdmaError,
    },
    /// A peer broke the protocol or its queue pair failed; it is dropped.
    PeerFailed {
        /// The peer.
        peer: Arc<str>,
        /// What happened.
        cause: String,
        /// Steps that had Sends queued to it.
        steps: Vec<u64>,
    },
}

struct Peer {
    qp: QpId,
    endpoint: QpEndpoint,
    /// Our queue pair is connected to theirs and has receives posted.
    connected: bool,
    /// The peer said its queue pair is connected (see [`Protocol::on_ready`]).
    ready: bool,
    posted: usize,
    failed: Option<String>,
}

#[derive(Default)]
struct State {
    recv: RecvSlots,
    send: SendRoutes,
    peers: HashMap<Arc<str>, Peer>,
    by_qp: HashMap<QpId, Arc<str>>,
    /// Advertisements that arrived before their route was registered.
    early_ads: HashMap<(Arc<str>, u32), SlotAd>,
}

/// The protocol state of one plane over one device.
pub struct Protocol {
    verbs: Arc<dyn Verbs>,
    state: Mutex<State>,
}

impl fmt::Debug for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        write!(
            f,
            "Protocol({}, {:?}, {:?}, {} peers)",
            self.verbs.device_name(),
            st.recv,
            st.send,
            st.peers.len()
        )
    }
}

impl Drop for Protocol {
    fn drop(&mut self) {
        let verbs = self.verbs.clone();
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        for p in st.peers.values() {
            verbs.destroy_qp(p.qp);
        }
        st.recv.deregister_all(&*verbs);
        st.send.deregister_all(&*verbs);
    }
}

impl Protocol {
    /// A protocol over an opened device.
    pub fn new(verbs: Arc<dyn Verbs>) -> Self {
        Protocol {
            verbs,
            state: Mutex::default(),
        }
    }

    /// The device.
    pub fn verbs(&self) -> &Arc<dyn Verbs> {
        &self.verbs
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No callback runs under this lock; poisoning means a bug elsewhere: keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Our queue pair for `peer` (created on first use): the endpoint to send it.
    pub fn local_endpoint(&self, peer: &str) -> Result<QpEndpoint, RdmaError> {
        let mut st = self.lock();
        if let Some(p) = st.peers.get(peer) {
            return Ok(p.endpoint);
        }
        let (qp, endpoint) = self.verbs.create_qp().map_err(|e| RdmaError::Peer {
            peer: peer.to_string(),
            source: e,
        })?;
        let peer: Arc<str> = peer.into();
        st.by_qp.insert(qp, peer.clone());
        st.peers.insert(
            peer,
            Peer {
                qp,
                endpoint,
                connected: false,
                ready: false,
                posted: 0,
                failed: None,
            },
        );
        Ok(endpoint)
    }

    /// Connects our queue pair for `peer` to its endpoint and posts receives for its immediates.
    /// Then tell the peer (a Ready message): it writes only after that.
    pub fn connect(&self, peer: &str, remote: &QpEndpoint) -> Result<(), RdmaError> {
        self.local_endpoint(peer)?;
        let mut st = self.lock();
        let st = &mut *st;
        let p = st.peers.get_mut(peer).ok_or_else(|| RdmaError::Protocol {
            peer: peer.to_string(),
            msg: "no queue pair".into(),
        })?;
        if p.connected {
            return Err(RdmaError::Protocol {
                peer: peer.to_string(),
                msg: "sent its queue-pair endpoint twice".into(),
            });
        }
        self.verbs
            .connect_qp(p.qp, remote)
            .map_err(|e| RdmaError::Peer {
                peer: peer.to_string(),
                source: e,
            })?;
        p.connected = true;
        p.failed = None;
        top_up(&*self.verbs, &st.recv, &st.send, peer, p)
    }

    /// The peer's queue pair is connected to ours: writes to it may start.
    pub fn on_ready(&self, peer: &str) -> Vec<Event> {
        {
            let mut st = self.lock();
            match st.peers.get_mut(peer) {
                Some(p) => p.ready = true,
                None => {
                    return vec![Event::PeerFailed {
                        peer: peer.into(),
                        cause: "said Ready before exchanging queue-pair endpoints".into(),
                        steps: Vec::new(),
                    }]
                }
            }
        }
        self.pump()
    }

    /// True when writes to `peer` may go (both queue pairs connected).
    pub fn is_ready(&self, peer: &str) -> bool {
        self.lock()
            .peers
            .get(peer)
            .is_some_and(|p| p.connected && p.ready && p.failed.is_none())
    }

    /// Registers receive slot `slot_id` (see [`RecvSlots::register`]); returns the
    /// advertisement to send `peer`.
    pub fn register_recv(
        &self,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<SlotAd, RdmaError> {
        let mut st = self.lock();
        let st = &mut *st;
        let ad = st
            .recv
            .register(&*self.verbs, slot_id, peer, key, dtype, dims)?;
        if let Some(p) = st.peers.get_mut(peer).filter(|p| p.connected) {
            top_up(&*self.verbs, &st.recv, &st.send, peer, p)?;
        }
        Ok(ad)
    }

    /// True when `key` has a receive slot.
    pub fn recv_peer(&self, key: &RendezvousKey) -> Option<Arc<str>> {
        self.lock().recv.peer_of(key)
    }

    /// The peer `key` is sent to, if it has a route.
    pub fn send_peer(&self, key: &RendezvousKey) -> Option<Arc<str>> {
        self.lock().send.peer_of(key)
    }

    /// Routes `key` to slot `slot_id` of `peer` (an advertisement that came first is applied).
    pub fn register_send(
        &self,
        key: Arc<RendezvousKey>,
        peer: &str,
        slot_id: u32,
    ) -> Result<(), RdmaError> {
        let mut st = self.lock();
        let st = &mut *st;
        st.send.register(key, peer, slot_id);
        if let Some(ad) = st.early_ads.remove(&(Arc::from(peer), slot_id)) {
            st.send.on_slot_ad(&*self.verbs, peer, ad)?;
        }
        if let Some(p) = st.peers.get_mut(peer).filter(|p| p.connected) {
            top_up(&*self.verbs, &st.recv, &st.send, peer, p)?;
        }
        Ok(())
    }

    /// Takes `peer`'s advertisement of one of its slots (kept until the route exists).
    pub fn on_slot_ad(&self, peer: &str, ad: SlotAd) -> Result<Vec<Event>, RdmaError> {
        {
            let mut st = self.lock();
            if st.send.has_route(peer, ad.slot_id) {
                st.send.on_slot_ad(&*self.verbs, peer, ad)?;
            } else {
                let k = (Arc::from(peer), ad.slot_id);
                if st.early_ads.contains_key(&k) {
                    return Err(RdmaError::Protocol {
                        peer: peer.to_string(),
                        msg: format!("advertised slot {} twice", ad.slot_id),
                    });
                }
                st.early_ads.insert(k, ad);
                return Ok(Vec::new());
            }
        }
        Ok(self.pump())
    }

    /// Queues `value` for `key` in `step` and posts what may go. `Ok(false)` when `key` has no
    /// route (it is local).
    pub fn send(&self, key: &RendezvousKey, step: u64, value: Tensor) -> Result<bool, RdmaError> {
        let queued = {
            let mut st = self.lock();
            if let Some(peer) = st.send.peer_of(key) {
                if let Some(cause) = st.peers.get(&peer).and_then(|p| p.failed.clone()) {
                    return Err(RdmaError::Protocol {
                        peer: peer.to_string(),
                        msg: format!("is gone: {cause}"),
                    });
                }
            }
            st.send.send(key, step, value)?
        };
        if queued {
            // Failures here are reported by the next `progress` as well; nothing is lost.
            for e in self.pump() {
                tracing::debug!("rdma send: {e:?}");
            }
        }
        Ok(queued)
    }

    /// Tensors queued on `key`'s route.
    pub fn queued(&self, key: &RendezvousKey) -> usize {
        self.lock().send.queued(key)
    }

    /// True when `key`'s route holds its credit.
    pub fn has_credit(&self, key: &RendezvousKey) -> bool {
        self.lock().send.has_credit(key)
    }

    /// True when receive slot `slot_id` holds a delivered tensor not yet credited back.
    pub fn is_held(&self, slot_id: u32) -> bool {
        self.lock().recv.is_held(slot_id)
    }

    /// Drops the queued Sends of an aborted step.
    pub fn drop_step(&self, step: u64) {
        self.lock().send.drop_step(step);
    }

    /// Tensors sent here but not yet written to a live peer (see [`SendRoutes::unsent`]).
    pub fn unsent(&self) -> usize {
        self.lock().send.unsent()
    }

    /// Marks `peer` failed; returns the steps whose Sends to it were dropped.
    pub fn fail_peer(&self, peer: &str, cause: &str) -> Vec<u64> {
        let mut st = self.lock();
        if let Some(p) = st.peers.get_mut(peer) {
            p.failed = Some(cause.to_string());
        }
        st.send.fail_peer(peer)
    }

    /// Polls the completion queue once (waiting at most `timeout`), then returns credits for
    /// released slots and posts the writes that have one.
    pub fn progress(&self, timeout: Duration) -> Vec<Event> {
        let mut done = Vec::new();
        let mut events = Vec::new();
        if let Err(e) = self.verbs.poll(&mut done, POLL_BATCH, timeout) {
            // A failed poll means the device is unusable: every peer is affected.
            let peers: Vec<Arc<str>> = self.lock().peers.keys().cloned().collect();
            for peer in peers {
                let cause = format!("completion queue failed: {e}");
                let steps = self.fail_peer(&peer, &cause);
                events.push(Event::PeerFailed { peer, cause, steps });
            }
            return events;
        }
        for c in done {
            self.complete(c, &mut events);
        }
        events.extend(self.pump());
        events
    }

    fn complete(&self, c: Completion, events: &mut Vec<Event>) {
        let mut st = self.lock();
        let st = &mut *st;
        let Some(peer) = st.by_qp.get(&c.qp).cloned() else {
            tracing::warn!("completion for unknown queue pair {}", c.qp);
            return;
        };
        let slot_id = c.wr_id as u32;
        let outcome = match (wr_tag(c.wr_id), c.result) {
            (_, Err(status)) => Err(format!(
                "work request {:?} for slot {slot_id} failed: {status}",
                wr_tag(c.wr_id)
            )),
            (Some(WrTag::StepWord), Ok(CompletionKind::Write)) => {
                st.send.on_write_done(&peer, slot_id);
                Ok(())
            }
            (Some(WrTag::Payload | WrTag::Credit), Ok(CompletionKind::Write)) => Ok(()),
            (Some(WrTag::Recv), Ok(CompletionKind::RecvImm { imm, byte_len })) => {
                if let Some(p) = st.peers.get_mut(&peer) {
                    p.posted = p.posted.saturating_sub(1);
                }
                let handled = match Imm::decode(imm) {
                    Err(e) => Err(e.to_string()),
                    Ok(imm) if imm.kind == ImmKind::Credit => {
                        st.send.on_credit(&peer, imm).map_err(|e| e.to_string())
                    }
                    Ok(imm) => match st.recv.on_data(&peer, imm, byte_len) {
                        Ok(d) => {
                            events.push(Event::Delivered(d));
                            Ok(())
                        }
                        Err(e) => Err(e.to_string()),
                    },
                };
                handled.and_then(|()| match st.peers.get_mut(&peer) {
                    Some(p) => top_up(&*self.verbs, &st.recv, &st.send, &peer, p)
                        .map_err(|e| e.to_string()),
                    None => Ok(()),
                })
            }
            (tag, Ok(kind)) => Err(format!("unexpected completion {kind:?} for {tag:?}")),
        };
        if let Err(cause) = outcome {
            let already = st
                .peers
                .get(&peer)
                .and_then(|p| p.failed.as_ref())
                .is_some();
            if let Some(p) = st.peers.get_mut(&peer) {
                p.failed = Some(cause.clone());
            }
            let steps = st.send.fail_peer(&peer);
            // A broken queue pair flushes every outstanding request with an error: report once.
            if !already {
                tracing::error!(peer = %peer, "rdma: dropping peer `{peer}`: {cause}");
                events.push(Event::PeerFailed { peer, cause, steps });
            }
        }
    }

    /// Returns credits for slots whose readers released them and posts the writes that may go.
    pub fn pump(&self) -> Vec<Event> {
        let mut events = Vec::new();
        let mut st = self.lock();
        let st = &mut *st;
        for g in st.recv.reclaim() {
            let Some(p) = st.peers.get(&g.peer).filter(|p| p.failed.is_none()) else {
                continue;
            };
            let posted = self.verbs.post_write(
                p.qp,
                wr_id(WrTag::Credit, g.imm.slot_id),
                None,
                RemoteSegment { addr: 0, rkey: 0 },
                Some(g.imm.encode()),
            );
            if let Err(e) = posted {
                let cause = format!("returning the credit of slot {}: {e}", g.imm.slot_id);
                fail(st, &g.peer, cause, &mut events);
            }
        }
        let ready: Vec<Arc<str>> = st
            .peers
            .iter()
            .filter(|(_, p)| p.connected && p.ready && p.failed.is_none())
            .map(|(n, _)| n.clone())
            .collect();
        let (writes, refused) = st.send.ready(|peer| ready.iter().any(|r| **r == *peer));
        for Refused { step, error } in refused {
            events.push(Event::StepFailed { step, error });
        }
        for w in writes {
            let Some(p) = st.peers.get(&w.peer) else {
                continue;
            };
            if let Err(e) = post(&*self.verbs, p.qp, &w) {
                let cause = format!("writing slot {} (step {}): {e}", w.slot_id, w.step);
                fail(st, &w.peer, cause, &mut events);
            }
        }
        events
    }
}

fn fail(st: &mut State, peer: &Arc<str>, cause: String, events: &mut Vec<Event>) {
    if let Some(p) = st.peers.get_mut(peer) {
        if p.failed.is_some() {
            return;
        }
        p.failed = Some(cause.clone());
    }
    let steps = st.send.fail_peer(peer);
    events.push(Event::PeerFailed {
        peer: peer.clone(),
        cause,
        steps,
    });
}

fn post(verbs: &dyn Verbs, qp: QpId, w: &Write) -> Result<(), super::verbs::VerbsError> {
    if let Some((local, remote)) = w.payload {
        verbs.post_write(
            qp,
            wr_id(WrTag::Payload, w.slot_id),
            Some(local),
            remote,
            None,
        )?;
    }
    let (local, remote) = w.step_word;
    verbs.post_write(
        qp,
        wr_id(WrTag::StepWord, w.slot_id),
        Some(local),
        remote,
        Some(w.imm.encode()),
    )
}

/// Keeps enough receives posted on `peer`'s queue pair for every immediate that may arrive: one
/// data write per slot it writes and one credit per route to it, plus slack.
fn top_up(
    verbs: &dyn Verbs,
    recv: &RecvSlots,
    send: &SendRoutes,
    peer: &str,
    p: &mut Peer,
) -> Result<(), RdmaError> {
    let want = RECV_SLACK + 2 * (recv.count_from(peer) + send.count_to(peer));
    while p.posted < want {
        verbs
            .post_recv(p.qp, wr_id(WrTag::Recv, 0))
            .map_err(|e| RdmaError::Peer {
                peer: peer.to_string(),
                source: e,
            })?;
        p.posted += 1;
    }
    Ok(())
}
