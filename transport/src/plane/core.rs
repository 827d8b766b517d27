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

use super::{BoxFuture, DataPlane, PeerEvent, PeerEvents, Traffic};
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
    /// marked gone must still find them). Not called for a peer already marked gone; two
    /// reports of one death racing each other may both call it, so it must be idempotent.
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
    /// Tensor payload bytes and values handed to the link for peers (not local keys).
    sent: super::TrafficCounter,
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
            sent: super::TrafficCounter::default(),
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
        let bytes = value.byte_len();
        L::send_to(self, key, step, &peer, route, value)?;
        self.sent.add(bytes);
        Ok(())
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

    fn traffic(&self) -> Traffic {
        self.sent.get()
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A link that routes `x:0` to `peer` and receives `y:0` from it, and records what the
    /// plane asks of it.
    #[derive(Debug, Default)]
    struct FakeLink {
        sent: AtomicUsize,
        aborts: Mutex<Vec<(u64, String)>>,
        forgotten: AtomicUsize,
    }

    fn x() -> Arc<RendezvousKey> {
        Arc::new(RendezvousKey::new("/job:a/cpu:0", "/job:b/cpu:0", "x:0"))
    }

    fn y() -> Arc<RendezvousKey> {
        Arc::new(RendezvousKey::new("/job:b/cpu:0", "/job:a/cpu:0", "y:0"))
    }

    impl Link for FakeLink {
        type Route = ();

        fn route(&self, key: &RendezvousKey) -> Option<(Arc<str>, ())> {
            (key.tensor_name() == "x:0").then(|| ("peer".into(), ()))
        }

        fn sender_of(&self, key: &RendezvousKey) -> Option<Arc<str>> {
            (key.tensor_name() == "y:0").then(|| "peer".into())
        }

        fn send_to(
            plane: &Plane<Self>,
            _: &Arc<RendezvousKey>,
            _: u64,
            _: &Arc<str>,
            _: (),
            _: Tensor,
        ) -> Result<(), RendezvousError> {
            plane.link.sent.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }

        fn tell_abort(plane: &Plane<Self>, step: u64, reason: &str) {
            lock(&plane.link.aborts).push((step, reason.to_string()));
        }

        fn forget_peer(plane: &Plane<Self>, _: &Arc<str>, _: &str) {
            plane.link.forgotten.fetch_add(1, Ordering::SeqCst);
        }

        fn local_addr(&self) -> SocketAddr {
            SocketAddr::from(([127, 0, 0, 1], 0))
        }

        fn register_recv(
            _: &Plane<Self>,
            _: u32,
            _: &str,
            _: Arc<RendezvousKey>,
            _: DType,
            _: &[usize],
        ) -> Result<(), String> {
            Ok(())
        }

        fn register_send(_: &Plane<Self>, _: Arc<RendezvousKey>, _: &str, _: u32) {}

        fn connect(
            _: Arc<Plane<Self>>,
            _: String,
            _: SocketAddr,
        ) -> BoxFuture<'static, Result<(), String>> {
            Box::pin(async { Ok(()) })
        }

        fn send_message(_: &Plane<Self>, _: &str, _: Vec<u8>) -> Result<(), RendezvousError> {
            Ok(())
        }

        fn close(_: &Plane<Self>, _: Duration) -> BoxFuture<'_, ()> {
            Box::pin(async {})
        }
    }

    fn outcome() -> (
        RecvCallback,
        std::sync::mpsc::Receiver<Result<Tensor, RendezvousError>>,
    ) {
        let (tx, rx) = std::sync::mpsc::channel();
        (
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
            rx,
        )
    }

    #[test]
    fn routed_keys_go_to_the_link_and_others_meet_locally() {
        let plane = Plane::with_link("me", FakeLink::default());
        plane.send(&x(), 1, Tensor::scalar(1.0f32)).unwrap();
        assert_eq!(plane.link.sent.load(Ordering::SeqCst), 1);
        let here = Arc::new(RendezvousKey::new("/job:a/cpu:0", "/job:a/cpu:1", "l:0"));
        let (done, rx) = outcome();
        plane.recv_async(&here, 1, done);
        plane.send(&here, 1, Tensor::scalar(2.0f32)).unwrap();
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap().unwrap();
        assert_eq!(got.as_slice::<f32>().unwrap(), &[2.0]);
        assert_eq!(plane.link.sent.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_death_is_reported_once_fails_its_waits_and_stops_sends() {
        let plane = Plane::with_link("me", FakeLink::default());
        let mut events = plane.subscribe();
        let (done, rx) = outcome();
        plane.recv_async(&y(), 3, done);
        plane.peer_gone(&"peer".into(), "reset");
        plane.peer_gone(&"peer".into(), "write failed");
        let err = rx
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(&err, RendezvousError::PeerGone { peer, cause } if peer == "peer" && cause == "reset"),
            "{err}"
        );
        assert!(matches!(events.try_recv(), Ok(PeerEvent::Gone { cause, .. }) if cause == "reset"));
        assert!(events.try_recv().is_err(), "one death, one report");
        assert_eq!(plane.link.forgotten.load(Ordering::SeqCst), 1);
        // Sends to it fail here, without reaching the link.
        let e = plane.send(&x(), 4, Tensor::scalar(1.0f32)).unwrap_err();
        assert!(matches!(e, RendezvousError::PeerGone { .. }), "{e}");
        assert_eq!(plane.link.sent.load(Ordering::SeqCst), 0);
        // Connected again: alive.
        plane.revive("peer");
        plane.send(&x(), 5, Tensor::scalar(1.0f32)).unwrap();
        assert_eq!(plane.link.sent.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_abort_is_told_to_the_link_and_fails_the_step_here() {
        let plane = Plane::with_link("me", FakeLink::default());
        let (done, rx) = outcome();
        plane.recv_async(&y(), 7, done);
        plane.abort_step(
            7,
            RendezvousError::Aborted {
                step: 7,
                cause: "node `m` failed".into(),
            },
        );
        assert!(rx.recv_timeout(Duration::from_secs(5)).unwrap().is_err());
        let aborts = lock(&plane.link.aborts).clone();
        assert_eq!(aborts.len(), 1);
        assert_eq!(aborts[0].0, 7);
        assert!(aborts[0].1.contains("node `m` failed"), "{aborts:?}");
    }
}
