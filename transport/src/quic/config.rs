//! quinn's settings for a data plane: flow-control windows sized for tensors, idle timeout and
//! keep-alives from the plane's [`TcpConfig`], large datagrams on loopback.

use super::identity::QuicIdentity;
use super::tls;
use crate::config::TcpConfig;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{EndpointConfig, IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// Bytes a stream may have in flight unread by the receiver.
pub const STREAM_WINDOW: u32 = 32 << 20;
/// Bytes a connection may have in flight unread by the receiver.
pub const CONNECTION_WINDOW: u32 = 64 << 20;
/// Bytes a sender buffers unacknowledged.
pub const SEND_WINDOW: u64 = 4 << 20;
/// The largest UDP payload accepted (the QUIC maximum). Senders only use what their path
/// carries: loopback connections start at [`LOOPBACK_MTU`], others discover theirs from 1200.
pub const MAX_UDP_PAYLOAD: u16 = 65_527;
/// The datagram size on loopback (its MTU is 64 KiB): far fewer packets per tensor.
pub const LOOPBACK_MTU: u16 = 65_000;
/// The smallest datagram size assumed on loopback.
pub const LOOPBACK_MIN_MTU: u16 = 16_000;

/// The connection-level settings for a connection to or from `peer`.
pub fn transport(cfg: &TcpConfig, peer_is_loopback: bool) -> Result<TransportConfig, String> {
    let mut t = TransportConfig::default();
    // The frame reader enforces `idle_timeout` on the stream; quinn's own timer, a little
    // longer, ends a connection whose peer vanished without a word (a killed process sends no
    // CONNECTION_CLOSE over UDP).
    let idle = cfg.idle_timeout + Duration::from_secs(1);
    t.max_idle_timeout(Some(
        IdleTimeout::try_from(idle)
            .map_err(|_| format!("idle timeout {idle:?} is too long for QUIC"))?,
    ));
    t.keep_alive_interval(Some((cfg.idle_timeout / 4).max(Duration::from_millis(100))));
    t.max_concurrent_bidi_streams(VarInt::from_u32(4));
    t.max_concurrent_uni_streams(VarInt::from_u32(0));
    t.stream_receive_window(VarInt::from_u32(STREAM_WINDOW));
    t.receive_window(VarInt::from_u32(CONNECTION_WINDOW));
    t.send_window(SEND_WINDOW);
    if peer_is_loopback {
        // A peer not started yet drops the first Initial: retry after milliseconds, not the
        // default 333 ms round trip's timeout.
        t.initial_rtt(Duration::from_millis(10));
        t.initial_mtu(LOOPBACK_MTU);
        // Loopback surely carries this much: a burst of losses (a full socket buffer) must not
        // make black-hole detection fall back to 1200-byte datagrams. (Below 16 KiB: quinn pads
        // handshake packets, whose length field has 14 bits, to this size.)
        t.min_mtu(LOOPBACK_MIN_MTU);
        // Ask the receiver to acknowledge every packet at once: the send window frees sooner,
        // and a sent tensor is released (quinn holds it until acknowledged) before its
        // producer is likely to reuse it.
        let mut ack = quinn::AckFrequencyConfig::default();
        ack.ack_eliciting_threshold(VarInt::from_u32(0));
        ack.max_ack_delay(Some(Duration::from_millis(1)));
        t.ack_frequency_config(Some(ack));
        // A GSO batch must fit in one 64 KiB IP packet: with datagrams this large, quinn's
        // batches of several would be refused by the kernel (and silently lost).
        t.enable_segmentation_offload(false);
        // The default initial window (14 720 bytes) is smaller than one such datagram.
        let mut cubic = quinn::congestion::CubicConfig::default();
        cubic.initial_window(10 * u64::from(LOOPBACK_MTU));
        t.congestion_controller_factory(Arc::new(cubic));
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(MAX_UDP_PAYLOAD);
        // A burst of losses (a full socket buffer, not a smaller path) can make black-hole
        // detection fall back to 1200-byte datagrams: search again soon.
        mtu.black_hole_cooldown(Duration::from_millis(500));
        mtu.interval(Duration::from_secs(5));
        t.mtu_discovery_config(Some(mtu));
    }
    Ok(t)
}

/// The endpoint settings: datagrams up to [`MAX_UDP_PAYLOAD`] accepted.
pub fn endpoint() -> Result<EndpointConfig, String> {
    let mut e = EndpointConfig::default();
    e.max_udp_payload_size(MAX_UDP_PAYLOAD)
        .map_err(|e| format!("max UDP payload: {e}"))?;
    Ok(e)
}

/// The acceptor's quinn configuration for `id`.
pub fn server(
    id: &QuicIdentity,
    cfg: &TcpConfig,
    local: SocketAddr,
) -> Result<quinn::ServerConfig, String> {
    let crypto = QuicServerConfig::try_from(tls::server_config(id)?)
        .map_err(|e| format!("QUIC needs TLS_AES_128_GCM_SHA256: {e}"))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    server.transport_config(Arc::new(transport(cfg, local.ip().is_loopback())?));
    server.migration(false);
    Ok(server)
}

/// The connecting side's quinn configuration for a connection from `id` to `peer`.
pub fn client(
    crypto: &Arc<QuicClientConfig>,
    cfg: &TcpConfig,
    peer: SocketAddr,
) -> Result<quinn::ClientConfig, String> {
    let mut client = quinn::ClientConfig::new(crypto.clone());
    client.transport_config(Arc::new(transport(cfg, peer.ip().is_loopback())?));
    Ok(client)
}

/// The connecting side's TLS for `id`, built once per plane.
pub fn client_crypto(id: &QuicIdentity) -> Result<Arc<QuicClientConfig>, String> {
    let crypto = QuicClientConfig::try_from(tls::client_config(id)?)
        .map_err(|e| format!("QUIC needs TLS_AES_128_GCM_SHA256: {e}"))?;
    Ok(Arc::new(crypto))
}
