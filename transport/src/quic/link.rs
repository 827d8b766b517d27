//! [`Link`] for [`QuicLink`]: the QUIC plane's own part of the generic [`Plane`] (Data and
//! Abort frames queued for a peer's writer, slots in a [`crate::slots::SlotTable`]).

use super::plane::{QuicLink, QuicPlane};
use crate::plane::{lock, BoxFuture, Link};
use crate::rendezvous::{RendezvousError, RendezvousKey};
use crate::wire::Outgoing;
use dflow_graph::{DType, Tensor};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

impl Link for QuicLink {
    type Route = u32;

    fn route(&self, key: &RendezvousKey) -> Option<(Arc<str>, u32)> {
        lock(&self.routes).get(key).cloned()
    }

    fn sender_of(&self, key: &RendezvousKey) -> Option<Arc<str>> {
        self.slots.peer_of(key)
    }

    fn send_to(
        plane: &QuicPlane,
        _key: &Arc<RendezvousKey>,
        step: u64,
        peer: &Arc<str>,
        slot_id: u32,
        value: Tensor,
    ) -> Result<(), RendezvousError> {
        plane
            .link
            .writers
            .queue(peer, Outgoing::data(slot_id, step, value))
    }

    fn tell_abort(plane: &QuicPlane, step: u64, reason: &str) {
        plane.link.writers.broadcast(&Outgoing::abort(step, reason));
    }

    fn forget_peer(plane: &QuicPlane, peer: &Arc<str>, _cause: &str) {
        plane.link.writers.remove(peer);
    }

    fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    fn register_recv(
        plane: &QuicPlane,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), String> {
        plane
            .link
            .slots
            .register(slot_id, peer, key, dtype, dims)
            .map_err(|e| e.to_string())
    }

    fn register_send(plane: &QuicPlane, key: Arc<RendezvousKey>, peer: &str, slot_id: u32) {
        QuicPlane::register_send(plane, key, peer, slot_id)
    }

    fn connect(
        plane: Arc<QuicPlane>,
        peer: String,
        addr: SocketAddr,
    ) -> BoxFuture<'static, Result<(), String>> {
        Box::pin(async move {
            QuicPlane::connect(&plane, &peer, addr)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn send_message(plane: &QuicPlane, peer: &str, body: Vec<u8>) -> Result<(), RendezvousError> {
        QuicPlane::send_message(plane, peer, body)
    }

    fn close(plane: &QuicPlane, within: Duration) -> BoxFuture<'_, ()> {
        Box::pin(QuicPlane::close(plane, within))
    }
}
