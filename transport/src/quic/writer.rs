//! The writer of one outgoing connection: frames in the order they were queued, a Heartbeat
//! when idle, and an orderly end (stream finished, data acknowledged, connection closed).

use super::frames::{describe_write, write_frame};
use super::plane::QuicPlane;
use crate::wire::{heartbeat_header, next_or_heartbeat, Body, Outgoing};
use quinn::{Connection, RecvStream, SendStream, VarInt};
use std::sync::{Arc, Weak};
use tokio::sync::mpsc;

/// Application error code of a connection closed in good order.
pub(crate) const CLOSE_OK: u32 = 0;
/// Application error code of a connection dropped for a failure.
pub(crate) const CLOSE_ERROR: u32 = 1;

pub(crate) async fn writer(
    rv: Weak<QuicPlane>,
    peer: Arc<str>,
    conn: Connection,
    mut send: SendStream,
    // Kept open: the acceptor may still write on it (it never does after its Hello).
    _recv: RecvStream,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
) {
    let (timeout, heartbeat) = match rv.upgrade() {
        Some(rv) => (
            rv.link.config.frame_timeout,
            rv.link.config.heartbeat_interval,
        ),
        None => return,
    };
    let beat = || Outgoing {
        head: heartbeat_header(),
        body: Body::Bytes(Vec::new()),
    };
    while let Some(out) = next_or_heartbeat(&mut rx, heartbeat, beat).await {
        let res = tokio::time::timeout(timeout, write_frame(&mut send, out.head, out.body)).await;
        let err = match res {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => describe_write(&e),
            Err(_) => format!("timed out after {timeout:?}"),
        };
        tracing::error!(peer = %peer, "dropping connection to peer `{peer}`: write failed: {err}");
        conn.close(VarInt::from_u32(CLOSE_ERROR), b"write failed");
        if let Some(rv) = rv.upgrade() {
            rv.peer_gone(&peer, &format!("write failed: {err}"));
        }
        return;
    }
    // Orderly end: everything queued reaches the peer before the connection closes.
    let _ = send.finish();
    let _ = tokio::time::timeout(timeout, send.stopped()).await;
    let p = conn.stats().path;
    tracing::debug!(
        peer = %peer,
        "connection to `{peer}`: {} packets sent, {} lost, {} congestion events, MTU {}, cwnd {}, RTT {:?}",
        p.sent_packets,
        p.lost_packets,
        p.congestion_events,
        p.current_mtu,
        p.cwnd,
        p.rtt
    );
    conn.close(VarInt::from_u32(CLOSE_OK), b"done");
}
