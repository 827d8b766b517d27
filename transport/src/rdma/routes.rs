//! The send side: every key sent to a peer has a route to one of its receive slots, a
//! registered staging buffer (payload, then the 8-byte step word) and at most one credit.
//!
//! A Send never blocks: its tensor is queued on the route. [`SendRoutes::ready`] hands out the
//! next write only when the route holds the credit and its previous write completed; the credit
//! is spent by the write and comes back (as an immediate) when the receiver's reader released
//! the slot. Without a credit the tensors wait in order.

use super::imm::{Imm, ImmKind};
use super::message::SlotAd;
use super::verbs::{LocalSegment, MemoryRegion, RemoteSegment, Verbs};
use super::RdmaError;
use crate::rendezvous::RendezvousKey;
use dflow_graph::Tensor;
use std::cell::UnsafeCell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

/// Registered memory a write is posted from: the payload, then the step word.
struct Staging {
    bytes: Box<[UnsafeCell<u8>]>,
    mr: MemoryRegion,
}

// SAFETY: the staging bytes are written only through `Staging::fill`, under the routes' lock,
// when no write from them is in flight; the NIC only reads them.
unsafe impl Sync for Staging {}

impl Staging {
    fn ptr(&self) -> *mut u8 {
        UnsafeCell::raw_get(self.bytes.as_ptr())
    }

    fn fill(&self, payload: &[u8], step: u64) {
        debug_assert_eq!(payload.len() + 8, self.bytes.len());
        let p = self.ptr();
        // SAFETY: `p` points to `payload.len() + 8` bytes owned by `self.bytes`; no write from
        // them is in flight (the caller checked), so nothing else reads them now; `payload` is a
        // different allocation (a tensor), so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(payload.as_ptr(), p, payload.len());
            std::ptr::copy_nonoverlapping(step.to_le_bytes().as_ptr(), p.add(payload.len()), 8);
        }
    }
}

struct Route {
    peer: Arc<str>,
    slot_id: u32,
    key: Arc<RendezvousKey>,
    /// The slot's advertisement and the staging buffer, once the ad arrived.
    remote: Option<(SlotAd, Staging)>,
    credit: bool,
    in_flight: bool,
    queue: VecDeque<(u64, Tensor)>,
    last_step: Option<u64>,
}

/// Two work requests that deliver one tensor: the payload (unsignaled), then the step word with
/// the data immediate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Write {
    /// The receiving peer.
    pub peer: Arc<str>,
    /// Its slot.
    pub slot_id: u32,
    /// The step.
    pub step: u64,
    /// Payload source (none for an empty tensor).
    pub payload: Option<(LocalSegment, RemoteSegment)>,
    /// Step word source and destination.
    pub step_word: (LocalSegment, RemoteSegment),
    /// The immediate.
    pub imm: Imm,
}

/// A tensor that cannot be written, with the step it belonged to.
#[derive(Debug)]
pub struct Refused {
    /// The step to abort.
    pub step: u64,
    /// Why, naming the peer and key.
    pub error: RdmaError,
}

/// The send routes of one plane.
#[derive(Default)]
pub struct SendRoutes {
    routes: HashMap<(Arc<str>, u32), Route>,
    by_key: HashMap<Arc<RendezvousKey>, (Arc<str>, u32)>,
}

impl fmt::Debug for SendRoutes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SendRoutes({} routes)", self.routes.len())
    }
}

impl SendRoutes {
    /// Routes `key` to slot `slot_id` of `peer`; writes wait for the slot's advertisement.
    /// Returns false when the route already existed.
    pub fn register(&mut self, key: Arc<RendezvousKey>, peer: &str, slot_id: u32) -> bool {
        let peer: Arc<str> = peer.into();
        self.by_key.insert(key.clone(), (peer.clone(), slot_id));
        let mut fresh = false;
        self.routes
            .entry((peer.clone(), slot_id))
            .or_insert_with(|| {
                fresh = true;
                Route {
                    peer,
                    slot_id,
                    key,
                    remote: None,
                    credit: false,
                    in_flight: false,
                    queue: VecDeque::new(),
                    last_step: None,
                }
            });
        fresh
    }

    /// True when slot `slot_id` of `peer` has a route.
    pub fn has_route(&self, peer: &str, slot_id: u32) -> bool {
        self.routes.contains_key(&(Arc::from(peer), slot_id))
    }

    /// The peer `key` goes to, if it has a route.
    pub fn peer_of(&self, key: &RendezvousKey) -> Option<Arc<str>> {
        self.by_key.get(key).map(|(p, _)| p.clone())
    }

    /// Routes to `peer`.
    pub fn count_to(&self, peer: &str) -> usize {
        self.routes.keys().filter(|(p, _)| &**p == peer).count()
    }

    /// Tensors queued on `key`'s route (waiting for a credit or the slot's advertisement).
    pub fn queued(&self, key: &RendezvousKey) -> usize {
        self.by_key
            .get(key)
            .and_then(|k| self.routes.get(k))
            .map_or(0, |r| r.queue.len())
    }

    /// True when `key`'s route holds its credit.
    pub fn has_credit(&self, key: &RendezvousKey) -> bool {
        self.by_key
            .get(key)
            .and_then(|k| self.routes.get(k))
            .is_some_and(|r| r.credit)
    }

    /// Takes `peer`'s advertisement of a slot: checks it against the route, registers the
    /// staging buffer and takes the slot's first credit.
    pub fn on_slot_ad(
        &mut self,
        verbs: &dyn Verbs,
        peer: &str,
        ad: SlotAd,
    ) -> Result<(), RdmaError> {
        let perr = |msg: String| RdmaError::Protocol {
            peer: peer.to_string(),
            msg,
        };
        let route = self
            .routes
            .get_mut(&(Arc::from(peer), ad.slot_id))
            .ok_or_else(|| {
                perr(format!(
                    "advertised slot {} (key {}), which no Send here routes to",
                    ad.slot_id, ad.key
                ))
            })?;
        if *route.key != ad.key {
            return Err(perr(format!(
                "advertised slot {} for key {}, but this task sends key {} there",
                ad.slot_id, ad.key, route.key
            )));
        }
        if route.remote.is_some() {
            return Err(perr(format!(
                "advertised slot {} (key {}) twice",
                ad.slot_id, ad.key
            )));
        }
        let len = usize::try_from(ad.len)
            .ok()
            .filter(|l| *l <= u32::MAX as usize - 8)
            .ok_or_else(|| {
                perr(format!(
                    "slot {} is {} bytes, too large",
                    ad.slot_id, ad.len
                ))
            })?;
        let bytes: Box<[UnsafeCell<u8>]> = (0..len + 8).map(|_| UnsafeCell::new(0)).collect();
        let ptr = UnsafeCell::raw_get(bytes.as_ptr());
        // SAFETY: the staging bytes live in the route (boxed, never moved) and are deregistered
        // in `deregister_all` before they are dropped; only `Staging::fill` writes them.
        let mr = unsafe { verbs.register(ptr, len + 8) }.map_err(|e| RdmaError::Register {
            slot_id: ad.slot_id,
            key: ad.key.to_string(),
            msg: format!("staging buffer for peer `{peer}`: {e}"),
        })?;
        route.remote = Some((ad, Staging { bytes, mr }));
        route.credit = true;
        Ok(())
    }

    /// Queues `value` for `key` in `step`. `Ok(false)` when `key` has no route (it is local).
    /// A tensor whose length differs from the advertised slot is refused here, naming the peer
    /// and key.
    pub fn send(
        &mut self,
        key: &RendezvousKey,
        step: u64,
        value: Tensor,
    ) -> Result<bool, RdmaError> {
        let Some(id) = self.by_key.get(key) else {
            return Ok(false);
        };
        let Some(route) = self.routes.get_mut(id) else {
            return Ok(false);
        };
        if let Some((ad, _)) = &route.remote {
            check_len(route.peer.as_ref(), &route.key, ad, &value)?;
        }
        route.queue.push_back((step, value));
        Ok(true)
    }

    /// The writes that may go now (a route to a ready peer with a credit, no write in flight,
    /// and a tensor queued), with their staging filled; each spends its route's credit. Tensors that cannot
    /// be written (length or step order) come back refused.
    pub fn ready(&mut self, peer_ready: impl Fn(&str) -> bool) -> (Vec<Write>, Vec<Refused>) {
        let mut writes = Vec::new();
        let mut refused = Vec::new();
        for route in self.routes.values_mut() {
            if !peer_ready(&route.peer) {
                continue;
            }
            while route.credit && !route.in_flight {
                let Some((ad, staging)) = &route.remote else {
                    break;
                };
                let Some((step, value)) = route.queue.pop_front() else {
                    break;
                };
                if let Err(error) = check_len(&route.peer, &route.key, ad, &value) {
                    refused.push(Refused { step, error });
                    continue;
                }
                if let Some(last) = route.last_step.filter(|l| step <= *l) {
                    refused.push(Refused {
                        step,
                        error: RdmaError::Protocol {
                            peer: route.peer.to_string(),
                            msg: format!(
                                "Send of key {} in step {step} after step {last}: steps of one slot must increase",
                                route.key
                            ),
                        },
                    });
                    continue;
                }
                staging.fill(value.as_bytes(), step);
                let len = value.byte_len();
                let base = staging.mr.addr;
                let payload = (len > 0).then_some((
                    LocalSegment {
                        addr: base,
                        len: len as u32,
                        lkey: staging.mr.lkey,
                    },
                    ad.data,
                ));
                writes.push(Write {
                    peer: route.peer.clone(),
                    slot_id: route.slot_id,
                    step,
                    payload,
                    step_word: (
                        LocalSegment {
                            addr: base + len as u64,
                            len: 8,
                            lkey: staging.mr.lkey,
                        },
                        ad.step_word,
                    ),
                    imm: Imm::new(ImmKind::Data, route.slot_id, step),
                });
                route.credit = false;
                route.in_flight = true;
                route.last_step = Some(step);
            }
        }
        (writes, refused)
    }

    /// The write of slot `slot_id` of `peer` completed: its staging may be reused.
    pub fn on_write_done(&mut self, peer: &str, slot_id: u32) {
        if let Some(r) = self.routes.get_mut(&(Arc::from(peer), slot_id)) {
            r.in_flight = false;
        }
    }

    /// Takes a credit from `peer`, checked against the route (known, not already credited,
    /// parity of the last write).
    pub fn on_credit(&mut self, peer: &str, imm: Imm) -> Result<(), RdmaError> {
        let perr = |msg: String| RdmaError::Protocol {
            peer: peer.to_string(),
            msg,
        };
        let route = self
            .routes
            .get_mut(&(Arc::from(peer), imm.slot_id))
            .ok_or_else(|| perr(format!("credit for unknown slot {}", imm.slot_id)))?;
        let what = format!("slot {} (key {})", imm.slot_id, route.key);
        if route.credit {
            return Err(perr(format!("second credit for {what}")));
        }
        match route.last_step {
            Some(step) if imm.matches_step(step) => {}
            last => {
                return Err(perr(format!(
                    "credit for {what} has parity {} but the last write was step {last:?}",
                    imm.parity
                )))
            }
        }
        route.credit = true;
        Ok(())
    }

    /// Drops every queued tensor of `step` (it was aborted).
    pub fn drop_step(&mut self, step: u64) {
        for r in self.routes.values_mut() {
            r.queue.retain(|(s, _)| *s != step);
        }
    }

    /// Tensors not yet written to a live peer: queued (waiting for a credit or the slot's
    /// advertisement) or in flight (the write not completed). A closing plane waits for 0.
    pub fn unsent(&self) -> usize {
        self.routes
            .values()
            .map(|r| r.queue.len() + usize::from(r.in_flight))
            .sum()
    }

    /// Drops the queues to `peer` and returns the steps they held (the peer is gone).
    pub fn fail_peer(&mut self, peer: &str) -> Vec<u64> {
        let mut steps = Vec::new();
        for r in self.routes.values_mut().filter(|r| &*r.peer == peer) {
            steps.extend(r.queue.drain(..).map(|(s, _)| s));
            r.in_flight = false;
        }
        steps
    }

    /// Deregisters every staging buffer.
    pub fn deregister_all(&mut self, verbs: &dyn Verbs) {
        for r in self.routes.values_mut() {
            if let Some((_, staging)) = r.remote.take() {
                verbs.deregister(&staging.mr);
            }
        }
    }
}

fn check_len(
    peer: &str,
    key: &RendezvousKey,
    ad: &SlotAd,
    value: &Tensor,
) -> Result<(), RdmaError> {
    if value.byte_len() as u64 != ad.len {
        return Err(RdmaError::Protocol {
            peer: peer.to_string(),
            msg: format!(
                "tensor for key {key} has {} bytes, but slot {} holds {}",
                value.byte_len(),
                ad.slot_id,
                ad.len
            ),
        });
    }
    Ok(())
}
