//! [`Plane`]: the one data plane that every backend is, over that backend's [`Link`].
//!
//! What every backend does the same way is written here, once:
//! - **route or local**: a key with no route to a peer meets its Recv in a [`LocalRendezvous`];
//!   a key with a route goes to its peer's slot, unless that peer is known to be gone;
//! - **remote wait**: a Recv of a key that a peer sends waits in the same local rendezvous and
//!   fails when that peer dies ([`RemoteWaits`]), unless its value arrived before;
//! - **abort fan-out**: an aborted step fails here and is told to every connected peer;
//! - **finish**: a finished step is forgotten;
//! - **peer death**: recorded once, reported to the subscriber ([`PeerEvent::Gone`]), and every
//!   step with a Recv waiting on one of the dead peer's keys fails with
//!   [`RendezvousError::PeerGone`].
//!
//! What differs per backend is its [`Link`]: how a value reaches a peer's slot (a frame on a
//! TCP or QUIC stream, a write into shared memory, an RDMA write), how receive slots and routes
//! are registered, how connections open and close, and how an abort is told to peers.

use super::{BoxFuture, DataPlane, PeerEvent, PeerEvents};
use crate::local::LocalRendezvous;
use crate::plane::lock;
use crate::remote_waits::RemoteWaits;
use crate::rendezvous::{RecvCallback, Rendezvous, RendezvousError, RendezvousKey};
use dflow_graph::{DType, Tensor};
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// What one backend does its own way; [`Plane`] does the rest. The associated functions take
/// the whole plane, so a link reaches the shared state (the local rendezvous, which peers are
/// gone) through it.
pub trait Link: fmt::Debug + Send + Sync + Sized + 'static {
    /// What a send needs, besides the peer, to reach `key`'s slot there (a slot id, a
    /// shared-memory slot, ...).
    type Route;

    /// Where values of `key` go: the receiving peer and the route to its slot; `None` when the
    /// key is not routed to a peer (its Recv is in this task).
    fn route(&self, key: &RendezvousKey) -> Option<(Arc<str>, Self::Route)>;

    /// The peer that sends `key`, when `key` has a receive slot here.
    fn sender_of(&self, key: &RendezvousKey) -> Option<Arc<str>>;

    /// Sends `value` of `key` in `step` to `peer` (not known to be gone) along `route`.
    fn send_to(
        plane: &Plane<Self>,
        key: &Arc<RendezvousKey>,
        step: u64,
        peer: &Arc<str>,
        route: Self::Route,
        value: Tensor,
    ) -> Result<(), RendezvousError>;

    /// Tells every connected peer that `step` is aborted because of `reason` (best effort:
    /// a peer that cannot be told is failing anyway).
    fn tell_abort(plane: &Plane<Self>, step: u64, reason: &str);

    /// Runs after `step` finished here (the default does nothing).
    fn step_finished(plane: &Plane<Self>, step: u64) {
        let _ = (plane, step);
    }

    /// Stops using `peer` before the plane marks it gone: drops its outgoing connection, and
    /// delivers every value it sent that is already here (a Recv registered after the peer is
    /// marked gone must still find them). Runs once per death.
    fn forget_peer(plane: &Plane<Self>, peer: &Arc<str>, cause: &str);

    /// See [`Rendezvous::send_buffer`] (the default: none).
    fn send_buffer(
        plane: &Plane<Self>,
        key: &Arc<RendezvousKey>,
        step: u64,
        dtype: DType,
        dims: &[usize],
    ) -> Option<Tensor> {
        let _ = (plane, key, step, dtype, dims);
        None
    }

    /// The address peers connect to.
    fn local_addr(&self) -> SocketAddr;

    /// See [`DataPlane::register_recv`].
    fn register_recv(
        plane: &Plane<Self>,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), String>;

    /// See [`DataPlane::register_send`].
    fn register_send(plane: &Plane<Self>, key: Arc<RendezvousKey>, peer: &str, slot_id: u32);

    /// See [`DataPlane::connect`]. On success the plane no longer counts `peer` as gone.
    fn connect(
        plane: Arc<Plane<Self>>,
        peer: String,
        addr: SocketAddr,
    ) -> BoxFuture<'static, Result<(), String>>;

    /// See [`DataPlane::send_message`].
    fn send_message(plane: &Plane<Self>, peer: &str, body: Vec<u8>) -> Result<(), RendezvousError>;

    /// See [`DataPlane::close`].
    fn close(plane: &Plane<Self>, within: Duration) -> BoxFuture<'_, ()>;
}

/// A data plane: the state and logic shared by every backend, and the backend's [`Link`].
pub struct Plane<L> {
    /// This task's name.
    pub(crate) name: Arc<str>,
    /// Where local keys, and values that arrived from peers, meet their Recv.
    pub(crate) local: LocalRendezvous,
    /// Steps with a Recv waiting on a remote key (to fail them when its peer dies).
    remote_waits: RemoteWaits,
    /// Peers known to be dead, with the cause.
    gone: Mutex<HashMap<Arc<str>, String>>,
    /// Where messages and peer failures go.
    events: PeerEvents,
    /// What this backend does its own way.
    pub(crate) link: L,
}

impl<L: Link> fmt::Debug for Plane<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Plane({}, {:?})", self.name, self.link)
    }
}

impl<L: Link> Plane<L> {
    /// A plane for task `name` over `link`.
    pub(crate) fn with_link(name: &str, link: L) -> Self {
        Plane {
            name: name.into(),
            local: LocalRendezvous::new(),
            remote_waits: RemoteWaits::default(),
            gone: Mutex::default(),
            events: PeerEvents::default(),
            link,
        }
    }

    /// This task's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.link.local_addr()
    }

    /// Delivers control-plane messages and peer failures to the returned receiver from now on
    /// (a later call replaces an earlier subscriber). Without a subscriber, messages are dropped
    /// with a log line.
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<PeerEvent> {
        self.events.subscribe()
    }

    /// Hands `event` to the subscriber (see [`Plane::subscribe`]).
    pub(crate) fn emit(&self, event: PeerEvent) {
        self.events.emit(&self.name, event);
    }

    /// Why `peer` is gone, or `None` while it is not known to be.
    pub(crate) fn gone_cause(&self, peer: &str) -> Option<String> {
        lock(&self.gone).get(peer).cloned()
    }

    /// Counts `peer` as alive again (it connected, or this task connected to it).
    pub(crate) fn revive(&self, peer: &str) {
        lock(&self.gone).remove(peer);
    }

    /// Marks `peer` dead (once: a second report of the same death does nothing): the link lets
    /// go of it ([`Link::forget_peer`]), the subscriber hears [`PeerEvent::Gone`], and every
    /// step with a Recv still waiting on one of its keys fails with
    /// [`RendezvousError::PeerGone`].
    pub(crate) fn peer_gone(&self, peer: &Arc<str>, cause: &str) {
        if self.gone_cause(peer).is_some() {
            return;
        }
        L::forget_peer(self, peer, cause);
        if lock(&self.gone)
            .insert(peer.clone(), cause.to_string())
            .is_some()
        {
            return;
        }
        self.emit(PeerEvent::Gone {
            peer: peer.clone(),
            cause: cause.to_string(),
        });
        let err = RendezvousError::PeerGone {
            peer: peer.to_string(),
            cause: cause.to_string(),
        };
        self.remote_waits.abort_waiting_on(&self.local, &err, |k| {
            self.link.sender_of(k).as_deref() == Some(&**peer)
        });
    }

    /// Hands `value`, which arrived from `peer`, to the Recv of `key` in `step` (a value that
    /// cannot be delivered, e.g. for an aborted step, is dropped with a log line).
    pub(crate) fn deliver(&self, peer: &str, key: &Arc<RendezvousKey>, step: u64, value: Tensor) {
        if let Err(e) = self.local.send(key, step, value) {
            tracing::warn!(peer = %peer, "{}: value of {key} from `{peer}` not delivered: {e}", self.name);
        }
    }

    /// Fails `step` here because `peer` aborted it for `reason`.
    pub(crate) fn aborted_by_peer(&self, peer: &str, step: u64, reason: &str) {
        self.local.abort_step(
            step,
            RendezvousError::Aborted {
                step,
                cause: format!("aborted by peer `{peer}`: {reason}"),
            },
        );
    }
}

impl<L: Link> Rendezvous for Plane<L> {
    fn send(
        &self,
        key: &Arc<RendezvousKey>,
        step: u64,
        value: Tensor,
    ) -> Result<(), RendezvousError> {
        let Some((peer, route)) = self.link.route(key) else {
            return self.local.send(key, step, value);
        };
        if let Some(cause) = self.gone_cause(&peer) {
            return Err(RendezvousError::PeerGone {
                peer: peer.to_string(),
                cause,
            });
        }
        L::send_to(self, key, step, &peer, route, value)
    }

    fn recv_async(&self, key: &Arc<RendezvousKey>, step: u64, done: RecvCallback) {
        let Some(peer) = self.link.sender_of(key) else {
            return self.local.recv_async(key, step, done);
        };
        // A peer is marked gone only after every value it sent was delivered (`peer_gone`).
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
        L::tell_abort(self, step, &cause.to_string());
        self.local.abort_step(step, cause);
    }

    fn finish_step(&self, step: u64) {
        self.remote_waits.finish(step);
        self.local.finish_step(step);
        L::step_finished(self, step);
    }

    fn pending_recvs(&self, step: u64) -> Vec<RendezvousKey> {
        self.local.pending_recvs(step)
    }

    fn send_buffer(
        &self,
        key: &Arc<RendezvousKey>,
        step: u64,
        dtype: DType,
        dims: &[usize],
    ) -> Option<Tensor> {
        L::send_buffer(self, key, step, dtype, dims)
    }
}

impl<L: Link> DataPlane for Plane<L> {
    fn task(&self) -> &str {
        &self.name
    }

    fn local_addr(&self) -> SocketAddr {
        self.link.local_addr()
    }

    fn register_recv(
        &self,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), String> {
        L::register_recv(self, slot_id, peer, key, dtype, dims)
    }

    fn has_recv_slot(&self, key: &RendezvousKey) -> bool {
        self.link.sender_of(key).is_some()
    }

    fn register_send(&self, key: Arc<RendezvousKey>, peer: &str, slot_id: u32) {
        L::register_send(self, key, peer, slot_id)
    }

    fn connect(
        self: Arc<Self>,
        peer: String,
        addr: SocketAddr,
    ) -> BoxFuture<'static, Result<(), String>> {
        L::connect(self, peer, addr)
    }

    fn send_message(&self, peer: &str, body: Vec<u8>) -> Result<(), RendezvousError> {
        L::send_message(self, peer, body)
    }

    fn subscribe(&self) -> mpsc::UnboundedReceiver<PeerEvent> {
        self.events.subscribe()
    }

    fn close(&self, within: Duration) -> BoxFuture<'_, ()> {
        L::close(self, within)
    }

    fn as_rendezvous(self: Arc<Self>) -> Arc<dyn Rendezvous> {
        self
    }
}
