//! [`crate::wire`] frames over a QUIC stream: the header, then the payload. A tensor's payload
//! is handed to quinn as a [`Bytes`] that owns the tensor (no copy on the sending side); the
//! receiving side reads it straight into the slot's buffer.

use crate::wire::{decode_header, encode_header, Body, FrameKind, Header, WireError, HEADER_LEN};
use bytes::Bytes;
use dflow_graph::Tensor;
use quinn::{ConnectionError, ReadError, ReadExactError, RecvStream, SendStream, WriteError};
use std::time::Duration;

/// A QUIC data-plane failure, naming the peer.
#[derive(Debug, thiserror::Error)]
pub enum QuicError {
    /// A malformed header.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A well-formed frame that breaks the protocol, or a refused peer.
    #[error("peer `{peer}`: {msg}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        msg: String,
    },
    /// The connection or stream failed, or a wait timed out.
    #[error("peer `{peer}`: {what}: {cause}")]
    Link {
        /// The peer.
        peer: String,
        /// What was being done.
        what: String,
        /// The cause.
        cause: String,
    },
    /// This task's own configuration (certificates, socket).
    #[error("{0}")]
    Setup(String),
}

impl QuicError {
    pub(crate) fn link(peer: &str, what: &str, cause: impl ToString) -> QuicError {
        QuicError::Link {
            peer: peer.to_string(),
            what: what.to_string(),
            cause: cause.to_string(),
        }
    }

    pub(crate) fn protocol(peer: &str, msg: impl Into<String>) -> QuicError {
        QuicError::Protocol {
            peer: peer.to_string(),
            msg: msg.into(),
        }
    }
}

/// A tensor as the owner of the bytes quinn sends: it stays alive until they are acknowledged.
struct TensorBytes(Tensor);

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl Body {
    fn into_bytes(self) -> Bytes {
        match self {
            Body::Tensor(t) if t.byte_len() == 0 => Bytes::new(),
            Body::Tensor(t) => Bytes::from_owner(TensorBytes(t)),
            Body::Bytes(b) => Bytes::from(b),
        }
    }
}

/// Writes `head` and `body`.
pub(crate) async fn write_frame(
    send: &mut SendStream,
    head: [u8; HEADER_LEN],
    body: Body,
) -> Result<(), WriteError> {
    let mut chunks = [Bytes::copy_from_slice(&head), body.into_bytes()];
    send.write_all_chunks(&mut chunks).await
}

/// A header for a handshake or control frame without slot or step.
pub(crate) fn control_header(kind: FrameKind, len: usize) -> [u8; HEADER_LEN] {
    encode_header(&Header {
        kind,
        flags: 0,
        slot_id: 0,
        step: 0,
        payload_len: len as u64,
    })
}

/// Writes one handshake frame of `kind` within `timeout`.
pub(crate) async fn send_control(
    send: &mut SendStream,
    kind: FrameKind,
    body: &[u8],
    timeout: Duration,
    peer: &str,
) -> Result<(), QuicError> {
    let what = format!("sending {kind:?}");
    tokio::time::timeout(
        timeout,
        write_frame(
            send,
            control_header(kind, body.len()),
            Body::Bytes(body.to_vec()),
        ),
    )
    .await
    .map_err(|_| QuicError::link(peer, &what, format!("timed out after {timeout:?}")))?
    .map_err(|e| QuicError::link(peer, &what, describe_write(&e)))
}

/// Reads one handshake frame of `kind` within `timeout` (bounded by the control-frame limit
/// before anything is allocated).
pub(crate) async fn recv_control(
    recv: &mut RecvStream,
    kind: FrameKind,
    timeout: Duration,
    peer: &str,
) -> Result<Vec<u8>, QuicError> {
    let what = format!("waiting for {kind:?}");
    let read = async {
        let mut head = [0u8; HEADER_LEN];
        recv.read_exact(&mut head)
            .await
            .map_err(|e| QuicError::link(peer, &what, describe_read(&e)))?;
        let h = decode_header(&head, 0).map_err(|e| e.with_peer(peer))?;
        if h.kind != kind {
            return Err(QuicError::protocol(
                peer,
                format!("expected a {kind:?} frame, got {:?}", h.kind),
            ));
        }
        let mut body = vec![0u8; h.payload_len as usize];
        recv.read_exact(&mut body)
            .await
            .map_err(|e| QuicError::link(peer, &what, describe_read(&e)))?;
        Ok(body)
    };
    tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| QuicError::link(peer, &what, format!("timed out after {timeout:?}")))?
}

/// True when `e` is the peer's orderly end: its stream finished, or its connection closed
/// with code 0 (a task closing its plane).
pub(crate) fn is_clean_end(e: &ConnectionError) -> bool {
    matches!(e, ConnectionError::ApplicationClosed(c) if c.error_code == quinn::VarInt::from_u32(0))
}

/// True for a QUIC error code that carries a TLS alert (RFC 9001 §4.8).
fn is_tls_alert(code: u64) -> bool {
    (0x100..=0x1ff).contains(&code)
}

/// A connection error in words, with TLS refusals spelled out.
pub(crate) fn describe_conn(e: &ConnectionError) -> String {
    match e {
        ConnectionError::ConnectionClosed(c) if is_tls_alert(u64::from(c.error_code)) => format!(
            "the peer refused the TLS handshake ({c}): it does not accept this task's certificate (another cluster CA?)"
        ),
        ConnectionError::ConnectionClosed(c) => format!("aborted by the peer: {c}"),
        ConnectionError::TransportError(t) if is_tls_alert(u64::from(t.code)) => format!(
            "{t} (the peer's certificate is missing, expired, from another cluster CA, or for another task)"
        ),
        ConnectionError::TransportError(t) => t.to_string(),
        ConnectionError::TimedOut => "no answer (QUIC idle timeout)".into(),
        other => other.to_string(),
    }
}

pub(crate) fn describe_read(e: &ReadExactError) -> String {
    match e {
        ReadExactError::FinishedEarly(n) => {
            format!("the stream ended after {n} more bytes")
        }
        ReadExactError::ReadError(ReadError::ConnectionLost(c)) => describe_conn(c),
        ReadExactError::ReadError(r) => r.to_string(),
    }
}

pub(crate) fn describe_write(e: &WriteError) -> String {
    match e {
        WriteError::ConnectionLost(c) => describe_conn(c),
        other => other.to_string(),
    }
}
