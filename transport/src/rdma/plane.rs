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
use crate::local::LocalRendezvous;
use crate::plane::{BoxFuture, DataPlane, PeerEvent, PeerEvents};
use crate::remote_waits::RemoteWaits;
use crate::rendezvous::{RecvCallback, Rendezvous, RendezvousError, RendezvousKey};
use dflow_graph::{DType, Tensor};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
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

/// The RDMA data plane of one task.
pub struct RdmaPlane {
    name: Arc<str>,
    control: Arc<dyn DataPlane>,
    proto: Protocol,
    local: LocalRendezvous,
    links: Mutex<Links>,
    events: PeerEvents,
    remote_waits: RemoteWaits,
    gone: Mutex<HashMap<Arc<str>, String>>,
    stop: Arc<AtomicBool>,
}

impl fmt::Debug for RdmaPlane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RdmaPlane({}, {:?})", self.name, self.proto)
    }
}

impl Drop for RdmaPlane {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // No callback runs under these locks; poisoning means a bug elsewhere: keep going.
    m.lock().unwrap_or_else(|p| p.into_inner())
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
        let plane = Arc::new(RdmaPlane {
            name: control.task().into(),
            control,
            proto: Protocol::new(verbs),
            local: LocalRendezvous::new(),
            links: Mutex::default(),
            events: PeerEvents::default(),
            remote_waits: RemoteWaits::default(),
            gone: Mutex::default(),
            stop: stop.clone(),
        });
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
        config: crate::tcp::TcpConfig,
        secret: Option<crate::auth::Secret>,
        verbs: Arc<dyn Verbs>,
    ) -> std::io::Result<Arc<Self>> {
        let control: Arc<dyn DataPlane> =
            crate::tcp::TcpRendezvous::bind_with_secret(task, addr, config, secret).await?;
        Ok(Self::new(control, verbs))
    }

    /// The protocol state (for tests and diagnostics).
    pub fn protocol(&self) -> &Protocol {
        &self.proto
    }

    fn send_rdma(&self, peer: &str, msg: &RdmaMessage) -> Result<(), RendezvousError> {
        self.control
            .send_message(peer, tagged(TAG_RDMA, &msg.encode()))
    }

    fn emit(&self, event: PeerEvent) {
        self.events.emit(&self.name, event);
    }

    fn handle(&self, events: Vec<Event>) {
        for e in events {
            match e {
                Event::Delivered(d) => {
                    if let Err(e) = self.local.send(&d.key, d.step, d.tensor) {
                        tracing::warn!("{}: tensor {} not delivered: {e}", self.name, d.key);
                    }
                }
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

    /// Marks `peer` dead and aborts every step with a Recv waiting on one of its keys.
    fn peer_gone(&self, peer: &Arc<str>, cause: &str) {
        if lock(&self.gone)
            .insert(peer.clone(), cause.to_string())
            .is_some()
        {
            return;
        }
        self.proto.fail_peer(peer, cause);
        self.emit(PeerEvent::Gone {
            peer: peer.clone(),
            cause: cause.to_string(),
        });
        let err = RendezvousError::PeerGone {
            peer: peer.to_string(),
            cause: cause.to_string(),
        };
        self.remote_waits.abort_waiting_on(&self.local, &err, |k| {
            self.proto.recv_peer(k).as_deref() == Some(&**peer)
        });
    }

    fn gone_cause(&self, peer: &str) -> Option<String> {
        lock(&self.gone).get(peer).cloned()
    }

    fn on_rdma(&self, peer: &Arc<str>, msg: RdmaMessage) {
        let res = match msg {
            RdmaMessage::Endpoint(ep) => self.proto.connect(peer, &ep).map(|()| {
                let mut links = lock(&self.links);
                if links.connected.contains(peer) {
                    if let Err(e) = self.send_rdma(peer, &RdmaMessage::Ready) {
                        tracing::warn!("{}: cannot tell `{peer}` Ready: {e}", self.name);
                    }
                } else {
                    links.pending_ready.insert(peer.clone());
                }
            }),
            RdmaMessage::Ready => {
                let events = self.proto.on_ready(peer);
                self.handle(events);
                Ok(())
            }
            RdmaMessage::SlotAd(ad) => self.proto.on_slot_ad(peer, ad).map(|e| self.handle(e)),
            RdmaMessage::Abort { step, reason } => {
                self.proto.drop_step(step);
                self.local.abort_step(
                    step,
                    RendezvousError::Aborted {
                        step,
                        cause: format!("aborted by peer `{peer}`: {reason}"),
                    },
                );
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
    while !stop.load(Ordering::SeqCst) {
        let Some(plane) = plane.upgrade() else { return };
        let events = plane.proto.progress(POLL_TIMEOUT);
        plane.handle(events);
    }
}

impl Rendezvous for RdmaPlane {
    fn send(
        &self,
        key: &Arc<RendezvousKey>,
        step: u64,
        value: Tensor,
    ) -> Result<(), RendezvousError> {
        let Some(peer) = self.proto.send_peer(key) else {
            return self.local.send(key, step, value);
        };
        if let Some(cause) = self.gone_cause(&peer) {
            return Err(RendezvousError::PeerGone {
                peer: peer.to_string(),
                cause,
            });
        }
        match self.proto.send(key, step, value) {
            Ok(_) => Ok(()),
            Err(e) => Err(RendezvousError::Aborted {
                step,
                cause: e.to_string(),
            }),
        }
    }

    fn recv_async(&self, key: &Arc<RendezvousKey>, step: u64, done: RecvCallback) {
        let Some(peer) = self.proto.recv_peer(key) else {
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
        self.proto.drop_step(step);
        let msg = RdmaMessage::Abort {
            step,
            reason: cause.to_string(),
        };
        let peers: Vec<Arc<str>> = lock(&self.links).connected.iter().cloned().collect();
        for p in peers {
            let _ = self.send_rdma(&p, &msg);
        }
        self.local.abort_step(step, cause);
    }

    fn finish_step(&self, step: u64) {
        self.remote_waits.finish(step);
        self.local.finish_step(step);
        // Readers of this step are done: return their slots' credits now.
        let events = self.proto.pump();
        self.handle(events);
    }

    fn pending_recvs(&self, step: u64) -> Vec<RendezvousKey> {
        self.local.pending_recvs(step)
    }
}

impl DataPlane for RdmaPlane {
    fn task(&self) -> &str {
        &self.name
    }

    fn local_addr(&self) -> SocketAddr {
        self.control.local_addr()
    }

    fn register_recv(
        &self,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), String> {
        let ad = self
            .proto
            .register_recv(slot_id, peer, key, dtype, dims)
            .map_err(|e| e.to_string())?;
        let mut links = lock(&self.links);
        if links.connected.contains(peer) {
            self.send_rdma(peer, &RdmaMessage::SlotAd(ad))
                .map_err(|e| e.to_string())?;
        } else {
            links.unsent_ads.entry(peer.into()).or_default().push(ad);
        }
        Ok(())
    }

    fn has_recv_slot(&self, key: &RendezvousKey) -> bool {
        self.proto.recv_peer(key).is_some()
    }

    fn register_send(&self, key: Arc<RendezvousKey>, peer: &str, slot_id: u32) {
        if let Err(e) = self.proto.register_send(key, peer, slot_id) {
            // Sends on this route then wait forever; fail the peer so they fail loudly instead.
            tracing::error!("{}: rdma: {e}", self.name);
            self.peer_gone(&Arc::from(peer), &e.to_string());
        }
    }

    fn connect(
        self: Arc<Self>,
        peer: String,
        addr: SocketAddr,
    ) -> BoxFuture<'static, Result<(), String>> {
        Box::pin(async move {
            self.control.clone().connect(peer.clone(), addr).await?;
            let ep = self
                .proto
                .local_endpoint(&peer)
                .map_err(|e| e.to_string())?;
            let peer: Arc<str> = peer.into();
            lock(&self.gone).remove(&peer);
            let mut links = lock(&self.links);
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
                self.send_rdma(&peer, m).map_err(|e| e.to_string())?;
            }
            Ok(())
        })
    }

    fn send_message(&self, peer: &str, body: Vec<u8>) -> Result<(), RendezvousError> {
        self.control.send_message(peer, tagged(TAG_RUNTIME, &body))
    }

    fn subscribe(&self) -> mpsc::UnboundedReceiver<PeerEvent> {
        self.events.subscribe()
    }

    fn close(&self, within: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.control.close(within).await;
            self.stop.store(true, Ordering::SeqCst);
        })
    }

    fn as_rendezvous(self: Arc<Self>) -> Arc<dyn Rendezvous> {
        self
    }
}
