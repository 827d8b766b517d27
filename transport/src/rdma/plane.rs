//! [`RdmaPlane`]: a [`DataPlane`] whose cross-task tensors travel by RDMA WRITE WITH IMMEDIATE
//! into registered receive slots ([`Protocol`]), while connections, authentication, the runtime's
//! control messages and the protocol's own messages (queue-pair endpoints, slot advertisements,
//! aborts) go over a control plane (TCP).
//!
//! Every message on the control plane starts with a tag byte: `0` the runtime's message, `1` an
//! [`RdmaMessage`]. A progress thread polls the completion queue, hands landed tensors to their
//! Recv, returns credits for released slots and posts queued writes.

use super::message::{RdmaMessage, SlotAd};
use super::protocol::{Event, Protocol};
use super::verbs::Verbs;
use crate::plane::{lock, BoxFuture, DataPlane, Link, PeerEvent, Plane};
use crate::rendezvous::{Rendezvous, RendezvousError, RendezvousKey};
use dflow_graph::{DType, Tensor};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::mpsc;

const TAG_RUNTIME: u8 = 0;
const TAG_RDMA: u8 = 1;

/// How long the progress thread waits on the completion queue before looking for released
/// slots and shutdown.
const POLL_TIMEOUT: Duration = Duration::from_millis(2);

#[derive(Default)]
struct Links {
    /// Peers this task's control connection reaches.
    connected: HashSet<Arc<str>>,
    /// Peers whose queue pair we connected before we could tell them (Ready).
    pending_ready: HashSet<Arc<str>>,
    /// Slot advertisements for peers not connected yet.
    unsent_ads: HashMap<Arc<str>, Vec<SlotAd>>,
}

/// The RDMA data plane of one task: a [`Plane`] over an [`RdmaLink`].
pub type RdmaPlane = Plane<RdmaLink>;

/// What the RDMA plane does its own way (see [`Link`]): the [`Protocol`] over the verbs, and
/// the control plane that carries connections and messages.
pub struct RdmaLink {
    control: Arc<dyn DataPlane>,
    proto: Protocol,
    links: Mutex<Links>,
    stop: Arc<AtomicBool>,
    /// Held while completions are polled and handled, so a peer is marked gone only between
    /// two such rounds (see `forget_peer`).
    progress: Mutex<()>,
    /// The progress thread (which may mark a peer gone from inside a round).
    progress_thread: std::sync::OnceLock<std::thread::ThreadId>,
}

impl fmt::Debug for RdmaLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RdmaLink({:?})", self.proto)
    }
}

impl Drop for RdmaLink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn tagged(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 1);
    out.push(tag);
    out.extend_from_slice(body);
    out
}

impl RdmaPlane {
    /// A plane over `verbs`, with `control` (a bound TCP plane, say) carrying connections and
    /// control messages. Takes over `control`'s subscription. Must run inside a tokio runtime.
    pub fn new(control: Arc<dyn DataPlane>, verbs: Arc<dyn Verbs>) -> Arc<Self> {
        let rx = control.subscribe();
        let stop = Arc::new(AtomicBool::new(false));
        let name: Arc<str> = control.task().into();
        let link = RdmaLink {
            control,
            proto: Protocol::new(verbs),
            links: Mutex::default(),
            stop: stop.clone(),
            progress: Mutex::default(),
            progress_thread: std::sync::OnceLock::new(),
        };
        let plane = Arc::new(Plane::with_link(&name, link));
        tokio::spawn(control_loop(Arc::downgrade(&plane), rx));
        let weak = Arc::downgrade(&plane);
        let spawned = std::thread::Builder::new()
            .name(format!("rdma-progress-{}", plane.name))
            .spawn(move || progress_loop(weak, stop));
        if let Err(e) = spawned {
            tracing::error!("rdma: cannot start the progress thread: {e}");
        }
        plane
    }

    /// Binds the TCP control plane on `addr` and runs the RDMA plane over `verbs`.
    pub async fn bind(
        task: &str,
        addr: SocketAddr,
        config: crate::config::TcpConfig,
        secret: Option<crate::auth::Secret>,
        verbs: Arc<dyn Verbs>,
    ) -> std::io::Result<Arc<Self>> {
        let control: Arc<dyn DataPlane> =
            crate::tcp::TcpPlane::bind_with_secret(task, addr, config, secret).await?;
        Ok(Self::new(control, verbs))
    }

    /// The protocol state (for tests and diagnostics).
    pub fn protocol(&self) -> &Protocol {
        &self.link.proto
    }

    fn send_rdma(&self, peer: &str, msg: &RdmaMessage) -> Result<(), RendezvousError> {
        self.link
            .control
            .send_message(peer, tagged(TAG_RDMA, &msg.encode()))
    }

    fn handle(&self, events: Vec<Event>) {
        for e in events {
            match e {
                // The sending device names the peer in a log line.
                Event::Delivered(d) => self.deliver(d.key.send_device(), &d.key, d.step, d.tensor),
                Event::StepFailed { step, error } => {
                    let cause = RendezvousError::Aborted {
                        step,
                        cause: error.to_string(),
                    };
                    self.abort_step(step, cause);
                }
                Event::PeerFailed { peer, cause, steps } => {
                    self.peer_gone(&peer, &cause);
                    for step in steps {
                        self.local.abort_step(
                            step,
                            RendezvousError::PeerGone {
                                peer: peer.to_string(),
                                cause: cause.clone(),
                            },
                        );
                    }
                }
            }
        }
    }

    fn on_rdma(&self, peer: &Arc<str>, msg: RdmaMessage) {
        let res = match msg {
            RdmaMessage::Endpoint(ep) => self.link.proto.connect(peer, &ep).map(|()| {
                let mut links = lock(&self.link.links);
                if links.connected.contains(peer) {
                    if let Err(e) = self.send_rdma(peer, &RdmaMessage::Ready) {
                        tracing::warn!("{}: cannot tell `{peer}` Ready: {e}", self.name);
                    }
                } else {
                    links.pending_ready.insert(peer.clone());
                }
            }),
            RdmaMessage::Ready => {
                let events = self.link.proto.on_ready(peer);
                self.handle(events);
                Ok(())
            }
            RdmaMessage::SlotAd(ad) => self.link.proto.on_slot_ad(peer, ad).map(|e| self.handle(e)),
            RdmaMessage::Abort { step, reason } => {
                self.link.proto.drop_step(step);
                self.aborted_by_peer(peer, step, &reason);
                Ok(())
            }
        };
        if let Err(e) = res {
            tracing::error!(peer = %peer, "{}: rdma: {e}", self.name);
            self.peer_gone(peer, &e.to_string());
        }
    }
}

async fn control_loop(plane: Weak<RdmaPlane>, mut rx: mpsc::UnboundedReceiver<PeerEvent>) {
    while let Some(event) = rx.recv().await {
        let Some(plane) = plane.upgrade() else { return };
        match event {
            PeerEvent::Message { peer, body } => match body.split_first() {
                Some((&TAG_RUNTIME, rest)) => plane.emit(PeerEvent::Message {
                    peer,
                    body: rest.to_vec(),
                }),
                Some((&TAG_RDMA, rest)) => match RdmaMessage::decode(rest) {
                    Ok(msg) => plane.on_rdma(&peer, msg),
                    Err(e) => {
                        tracing::error!(peer = %peer, "{}: from `{peer}`: {e}", plane.name);
                        plane.peer_gone(&peer, &e.to_string());
                    }
                },
                _ => tracing::warn!(
                    "{}: dropped an untagged message from `{peer}` (is it running another transport?)",
                    plane.name
                ),
            },
            PeerEvent::Gone { peer, cause } => plane.peer_gone(&peer, &cause),
        }
    }
}

fn progress_loop(plane: Weak<RdmaPlane>, stop: Arc<AtomicBool>) {
    if let Some(p) = plane.upgrade() {
        let _ = p.link.progress_thread.set(std::thread::current().id());
    }
    while !stop.load(Ordering::SeqCst) {
        let Some(plane) = plane.upgrade() else { return };
        let _round = lock(&plane.link.progress);
        let events = plane.link.proto.progress(POLL_TIMEOUT);
        plane.handle(events);
    }
}

/// How often a closing plane looks whether its last writes completed.
const CLOSE_POLL: Duration = Duration::from_millis(1);

impl Link for RdmaLink {
    type Route = ();

    fn route(&self, key: &RendezvousKey) -> Option<(Arc<str>, ())> {
        self.proto.send_peer(key).map(|peer| (peer, ()))
    }

    fn sender_of(&self, key: &RendezvousKey) -> Option<Arc<str>> {
        self.proto.recv_peer(key)
    }

    fn send_to(
        plane: &RdmaPlane,
        key: &Arc<RendezvousKey>,
        step: u64,
        _peer: &Arc<str>,
        _route: (),
        value: Tensor,
    ) -> Result<(), RendezvousError> {
        match plane.link.proto.send(key, step, value) {
            Ok(_) => Ok(()),
            Err(e) => Err(RendezvousError::Aborted {
                step,
                cause: e.to_string(),
            }),
        }
    }

    fn tell_abort(plane: &RdmaPlane, step: u64, reason: &str) {
        plane.link.proto.drop_step(step);
        let msg = RdmaMessage::Abort {
            step,
            reason: reason.to_string(),
        };
        let peers: Vec<Arc<str>> = lock(&plane.link.links).connected.iter().cloned().collect();
        for p in peers {
            let _ = plane.send_rdma(&p, &msg);
        }
    }

    fn step_finished(plane: &RdmaPlane, _step: u64) {
        // Readers of this step are done: return their slots' credits now.
        let events = plane.link.proto.pump();
        plane.handle(events);
    }

    /// Delivers what `peer` wrote before it went: the completions already in the queue are
    /// handled first (a peer that writes and then closes its control connection must not lose
    /// those values to the close, which travels on another path). From another thread this
    /// waits for the progress thread's round in flight, whose completions it may hold.
    fn forget_peer(plane: &RdmaPlane, peer: &Arc<str>, cause: &str) {
        let on_progress_thread =
            plane.link.progress_thread.get() == Some(&std::thread::current().id());
        if !on_progress_thread {
            let _round = lock(&plane.link.progress);
            let events = plane.link.proto.progress(Duration::ZERO);
            plane.handle(events);
        }
        plane.link.proto.fail_peer(peer, cause);
    }

    fn local_addr(&self) -> SocketAddr {
        self.control.local_addr()
    }

    fn register_recv(
        plane: &RdmaPlane,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), String> {
        let ad = plane
            .link
            .proto
            .register_recv(slot_id, peer, key, dtype, dims)
            .map_err(|e| e.to_string())?;
        let mut links = lock(&plane.link.links);
        if links.connected.contains(peer) {
            plane
                .send_rdma(peer, &RdmaMessage::SlotAd(ad))
                .map_err(|e| e.to_string())?;
        } else {
            links.unsent_ads.entry(peer.into()).or_default().push(ad);
        }
        Ok(())
    }

    fn register_send(plane: &RdmaPlane, key: Arc<RendezvousKey>, peer: &str, slot_id: u32) {
        if let Err(e) = plane.link.proto.register_send(key, peer, slot_id) {
            // Sends on this route then wait forever; fail the peer so they fail loudly instead.
            tracing::error!("{}: rdma: {e}", plane.name);
            plane.peer_gone(&Arc::from(peer), &e.to_string());
        }
    }

    fn connect(
        plane: Arc<RdmaPlane>,
        peer: String,
        addr: SocketAddr,
    ) -> BoxFuture<'static, Result<(), String>> {
        Box::pin(async move {
            plane
                .link
                .control
                .clone()
                .connect(peer.clone(), addr)
                .await?;
            let ep = plane
                .link
                .proto
                .local_endpoint(&peer)
                .map_err(|e| e.to_string())?;
            let peer: Arc<str> = peer.into();
            plane.revive(&peer);
            let mut links = lock(&plane.link.links);
            links.connected.insert(peer.clone());
            let mut msgs = vec![RdmaMessage::Endpoint(ep)];
            if links.pending_ready.remove(&peer) {
                msgs.push(RdmaMessage::Ready);
            }
            msgs.extend(
                links
                    .unsent_ads
                    .remove(&peer)
                    .unwrap_or_default()
                    .into_iter()
                    .map(RdmaMessage::SlotAd),
            );
            for m in &msgs {
                plane.send_rdma(&peer, m).map_err(|e| e.to_string())?;
            }
            Ok(())
        })
    }

    fn send_message(plane: &RdmaPlane, peer: &str, body: Vec<u8>) -> Result<(), RendezvousError> {
        plane
            .link
            .control
            .send_message(peer, tagged(TAG_RUNTIME, &body))
    }

    fn close(plane: &RdmaPlane, within: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            // What was sent goes out first (a peer's credit may still be on its way), within
            // the bound; the control connection then closes with what is left of it.
            let deadline = tokio::time::Instant::now() + within;
            while plane.link.proto.unsent() > 0 && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(CLOSE_POLL).await;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            plane.link.control.close(left).await;
            plane.link.stop.store(true, Ordering::SeqCst);
        })
    }
}
