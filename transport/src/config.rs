//! The timeouts and limits every data plane runs with ([`TcpConfig`]): TCP, QUIC, the shared-memory
//! plane's side channel and the RDMA plane's control connections all read the same fields.

use std::time::Duration;

/// Timeouts of the data plane.
#[derive(Clone, Copy, Debug)]
pub struct TcpConfig {
    /// How long a connection may stay silent between frames before it is dropped.
    pub idle_timeout: Duration,
    /// How long the rest of a frame (payload, Hello) and each write may take.
    pub frame_timeout: Duration,
    /// How long `connect` tries.
    pub connect_timeout: Duration,
    /// Send a Heartbeat frame on an outgoing connection after it was idle this long, so the
    /// peer's `idle_timeout` only fires when this task is really gone or stuck (`None`: never).
    pub heartbeat_interval: Option<Duration>,
    /// Longest control-plane [`FrameKind::Message`](crate::wire::FrameKind::Message) accepted, checked before allocating; the
    /// body's memory then grows only as its bytes arrive.
    pub max_message: u64,
    /// Most incoming connections one peer name may hold open at once; a further one is refused
    /// (a task opens one connection to each peer, and one more while it reconnects).
    pub max_connections_per_peer: usize,
    /// Most incoming connections that may be in their handshake (before a Hello, or before the
    /// secret's proof) at once; a further one is closed at once.
    pub max_handshaking: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            idle_timeout: Duration::from_secs(300),
            frame_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            heartbeat_interval: None,
            max_message: 256 << 20,
            max_connections_per_peer: 4,
            max_handshaking: 64,
        }
    }
}
