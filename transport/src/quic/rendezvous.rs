//! [`Rendezvous`] and [`DataPlane`](crate::plane::DataPlane) (through `slot_table_data_plane!`) for [`QuicPlane`]: local keys meet in a local rendezvous,
//! keys with a route go to their peer's slot, received frames meet their Recv locally.

use super::plane::{lock, QuicPlane};
use crate::rendezvous::{RecvCallback, Rendezvous, RendezvousError, RendezvousKey};
use crate::wire::{encode_header, Body, Header, Outgoing};
use dflow_graph::Tensor;
use std::sync::Arc;

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

crate::plane::slot_table_data_plane!(QuicPlane);
