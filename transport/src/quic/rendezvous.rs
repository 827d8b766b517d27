//! [`Rendezvous`] and [`DataPlane`] for [`QuicPlane`]: local keys meet in a local rendezvous,
//! keys with a route go to their peer's slot, received frames meet their Recv locally.

use super::frames::Body;
use super::plane::{lock, Outgoing, QuicPlane};
use crate::plane::{BoxFuture, DataPlane, PeerEvent};
use crate::rendezvous::{RecvCallback, Rendezvous, RendezvousError, RendezvousKey};
use crate::wire::{encode_header, Header};
use dflow_graph::{DType, Tensor};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

impl Rendezvous for QuicPlane {
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
        let head = encode_header(&Header::data(slot_id, step, value.byte_len() as u64));
        self.queue(
            &peer,
            Outgoing {
                head,
                body: Body::Tensor(value),
            },
        )
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
        self.broadcast_abort(step, &cause.to_string());
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

impl DataPlane for QuicPlane {
    fn task(&self) -> &str {
        &self.name
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn register_recv(
        &self,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), String> {
        self.slots
            .register(slot_id, peer, key, dtype, dims)
            .map_err(|e| e.to_string())
    }

    fn has_recv_slot(&self, key: &RendezvousKey) -> bool {
        self.slots.peer_of(key).is_some()
    }

    fn register_send(&self, key: Arc<RendezvousKey>, peer: &str, slot_id: u32) {
        QuicPlane::register_send(self, key, peer, slot_id)
    }

    fn connect(
        self: Arc<Self>,
        peer: String,
        addr: SocketAddr,
    ) -> BoxFuture<'static, Result<(), String>> {
        Box::pin(async move {
            QuicPlane::connect(&self, &peer, addr)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn send_message(&self, peer: &str, body: Vec<u8>) -> Result<(), RendezvousError> {
        QuicPlane::send_message(self, peer, body)
    }

    fn subscribe(&self) -> mpsc::UnboundedReceiver<PeerEvent> {
        QuicPlane::subscribe(self)
    }

    fn close(&self, within: Duration) -> BoxFuture<'_, ()> {
        Box::pin(QuicPlane::close(self, within))
    }

    fn as_rendezvous(self: Arc<Self>) -> Arc<dyn Rendezvous> {
        self
    }
}
