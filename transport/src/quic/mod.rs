//! The QUIC data plane (quinn, rustls with the ring provider): the TCP plane's frames over
//! QUIC streams, with TLS 1.3 and mutual authentication against a cluster CA.
//!
//! Each task has one UDP endpoint at its cluster address that both accepts and connects. Per
//! direction of a task pair there is one connection and one bidirectional stream: the
//! connecting side writes a Hello (or, with a cluster secret, the [`crate::auth`] handshake)
//! and then [`crate::wire`] frames exactly as over TCP — Data (payload read straight into the
//! registered slot), Message, Abort, Heartbeat; the accepting side only answers with its own
//! Hello once it accepted the peer. Messages to one peer keep their order, after the Data
//! frames queued before them.
//!
//! Security ([`tls`]): both sides present a certificate signed by the cluster CA whose DNS name
//! is the task's ([`names`]); the connecting side checks that the acceptor is the task it
//! dialled, the acceptor requires a client certificate and checks that it names the task the
//! Hello claims. A peer with no certificate, another CA's, or someone else's is refused at the
//! handshake, logged and counted ([`QuicStats`]); the job goes on. [`pki`] makes the CA and
//! the per-task certificates (`dflow cert init|issue`); [`identity`] loads them.
//!
//! Copies: the sender hands quinn the tensor's own memory (a [`bytes::Bytes`] owning the
//! tensor, kept until acknowledged), quinn encrypts it into packets; the receiver decrypts and
//! copies once into the slot. quinn allocates per packet, so unlike the TCP plane this path is
//! not allocation-free.
//!
//! Failures: a bad frame (truncated, oversized, unknown slot, garbage) drops the peer with an
//! error naming it, exactly like TCP. A killed peer sends nothing over UDP, so it is noticed
//! by the idle timeout (heartbeats keep live connections busy), not at once as over TCP.

pub mod config;
pub mod frames;
pub mod identity;
mod link;
pub mod names;
pub mod pki;
mod plane;
mod reader;
pub mod socket;
pub mod tls;
mod writer;

pub use frames::QuicError;
pub use identity::{QuicIdentity, CERT_DIR_ENV};
pub use plane::{QuicLink, QuicPlane, QuicStats};
