//! The data-plane frame format.
//!
//! Every frame is a fixed [`HEADER_LEN`]-byte little-endian header followed by `payload_len` raw
//! bytes:
//!
//! | field         | type  | notes                                   |
//! |---------------|-------|-----------------------------------------|
//! | `magic`       | `u32` | the bytes `DFLW`                        |
//! | `version`     | `u16` | [`VERSION`]                             |
//! | `kind`        | `u8`  | [`FrameKind`]                           |
//! | `flags`       | `u8`  | reserved, 0                             |
//! | `slot_id`     | `u32` | the receive slot (Data, Credit)         |
//! | `step`        | `u64` | the step id                             |
//! | `payload_len` | `u64` | bytes that follow                       |
//!
//! [`decode_header`] validates everything, the length included, before the caller allocates or
//! reads anything further.

use crate::plane::lock;
use crate::rendezvous::RendezvousError;
use dflow_graph::Tensor;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::UnboundedSender;

/// The magic number: the bytes `DFLW` read as a little-endian `u32`.
pub const MAGIC: u32 = u32::from_le_bytes(*b"DFLW");
/// The protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Versions this build accepts.
pub const SUPPORTED_VERSIONS: &[u16] = &[VERSION];
/// Size of the fixed header in bytes.
pub const HEADER_LEN: usize = 28;
/// Longest payload of a control frame (Abort reason, Hello name), whatever the caller's bound.
pub const MAX_CONTROL_PAYLOAD: u64 = 4096;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// A tensor's bytes for `slot_id` in `step`.
    Data = 1,
    /// The sender aborts `step`; the payload is the UTF-8 reason.
    Abort = 2,
    /// The receiver released `slot_id` and it may be rewritten (no payload).
    Credit = 3,
    /// First frame of a connection; the payload is the sender's UTF-8 task name, or with a
    /// cluster secret the [`crate::auth`] Hello.
    Hello = 4,
    /// The acceptor's answer to an authenticated Hello ([`crate::auth`] Challenge).
    Challenge = 5,
    /// The connector's proof that it knows the secret ([`crate::auth`] Proof).
    Proof = 6,
    /// A control-plane message (the payload is an encoded [`crate::control`] message), bounded by
    /// the receiver's configured message limit rather than a slot.
    Message = 7,
    /// Keeps an idle connection alive and proves the peer is still there (no payload).
    Heartbeat = 8,
}

impl FrameKind {
    /// The kind for a wire byte, if known.
    pub fn from_u8(b: u8) -> Option<FrameKind> {
        Some(match b {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            3 => FrameKind::Credit,
            4 => FrameKind::Hello,
            5 => FrameKind::Challenge,
            6 => FrameKind::Proof,
            7 => FrameKind::Message,
            8 => FrameKind::Heartbeat,
            _ => return None,
        })
    }

    /// True for kinds whose payload is bounded by [`MAX_CONTROL_PAYLOAD`].
    pub fn is_control(self) -> bool {
        !matches!(self, FrameKind::Data | FrameKind::Message)
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Header {
    /// What the frame carries.
    pub kind: FrameKind,
    /// Reserved flag bits (0 in version 1).
    pub flags: u8,
    /// The receive slot.
    pub slot_id: u32,
    /// The step id.
    pub step: u64,
    /// Bytes following the header.
    pub payload_len: u64,
}

impl Header {
    /// A Data header.
    pub fn data(slot_id: u32, step: u64, payload_len: u64) -> Header {
        Header {
            kind: FrameKind::Data,
            flags: 0,
            slot_id,
            step,
            payload_len,
        }
    }
}

/// The peer a wire error came from, for messages (empty when unknown).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerTag(pub Option<String>);

impl fmt::Display for PeerTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Some(p) => write!(f, " from peer `{p}`"),
            None => Ok(()),
        }
    }
}

/// Why a header was rejected. Messages name the peer when one is attached with
/// [`WireError::with_peer`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The first four bytes are not `DFLW`.
    #[error("bad frame magic {found:#010x}{peer} (expected {MAGIC:#010x}, \"DFLW\"): not a dflow data-plane stream")]
    BadMagic {
        /// What was read.
        found: u32,
        /// The peer.
        peer: PeerTag,
    },
    /// An unsupported protocol version.
    #[error("unsupported wire version {found}{peer}; this build supports {SUPPORTED_VERSIONS:?}")]
    BadVersion {
        /// What was read.
        found: u16,
        /// The peer.
        peer: PeerTag,
    },
    /// An unknown frame kind.
    #[error("unknown frame kind {found}{peer} (known: 1 Data, 2 Abort, 3 Credit, 4 Hello, 5 Challenge, 6 Proof, 7 Message, 8 Heartbeat)")]
    BadKind {
        /// What was read.
        found: u8,
        /// The peer.
        peer: PeerTag,
    },
    /// The payload is longer than allowed.
    #[error("{kind:?} frame for slot {slot_id}, step {step}{peer} announces {len} payload bytes; at most {max} allowed")]
    TooLong {
        /// Frame kind.
        kind: FrameKind,
        /// Slot id.
        slot_id: u32,
        /// Step id.
        step: u64,
        /// Announced length.
        len: u64,
        /// The bound.
        max: u64,
        /// The peer.
        peer: PeerTag,
    },
    /// Fewer than [`HEADER_LEN`] bytes were available.
    #[error("truncated frame header{peer}: {got} of {HEADER_LEN} bytes")]
    Truncated {
        /// Bytes available.
        got: usize,
        /// The peer.
        peer: PeerTag,
    },
}

impl WireError {
    /// The same error, naming `peer`.
    pub fn with_peer(mut self, name: &str) -> WireError {
        let p = match &mut self {
            WireError::BadMagic { peer, .. }
            | WireError::BadVersion { peer, .. }
            | WireError::BadKind { peer, .. }
            | WireError::TooLong { peer, .. }
            | WireError::Truncated { peer, .. } => peer,
        };
        p.0 = Some(name.to_string());
        self
    }
}

/// Writes `h` into a header buffer.
pub fn encode_header(h: &Header) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&VERSION.to_le_bytes());
    b[6] = h.kind as u8;
    b[7] = h.flags;
    b[8..12].copy_from_slice(&h.slot_id.to_le_bytes());
    b[12..20].copy_from_slice(&h.step.to_le_bytes());
    b[20..28].copy_from_slice(&h.payload_len.to_le_bytes());
    b
}

fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[..N]);
    a
}

/// Decodes and validates a header. A Data frame's payload must be at most `max_payload` bytes
/// (the slot's registered size), a Message's at most `max_payload` (the receiver's message
/// limit); a handshake or Abort frame's at most [`MAX_CONTROL_PAYLOAD`]; Credit and Heartbeat
/// frames carry nothing.
pub fn decode_header(b: &[u8; HEADER_LEN], max_payload: u64) -> Result<Header, WireError> {
    let peer = PeerTag::default();
    let magic = u32::from_le_bytes(arr(&b[0..4]));
    if magic != MAGIC {
        return Err(WireError::BadMagic { found: magic, peer });
    }
    let version = u16::from_le_bytes(arr(&b[4..6]));
    if !SUPPORTED_VERSIONS.contains(&version) {
        return Err(WireError::BadVersion {
            found: version,
            peer,
        });
    }
    let kind = FrameKind::from_u8(b[6]).ok_or(WireError::BadKind { found: b[6], peer })?;
    let h = Header {
        kind,
        flags: b[7],
        slot_id: u32::from_le_bytes(arr(&b[8..12])),
        step: u64::from_le_bytes(arr(&b[12..20])),
        payload_len: u64::from_le_bytes(arr(&b[20..28])),
    };
    let max = match kind {
        FrameKind::Data | FrameKind::Message => max_payload,
        FrameKind::Credit | FrameKind::Heartbeat => 0,
        FrameKind::Abort | FrameKind::Hello | FrameKind::Challenge | FrameKind::Proof => {
            MAX_CONTROL_PAYLOAD
        }
    };
    if h.payload_len > max {
        return Err(WireError::TooLong {
            kind,
            slot_id: h.slot_id,
            step: h.step,
            len: h.payload_len,
            max,
            peer: PeerTag::default(),
        });
    }
    Ok(h)
}

/// Decodes a header from a slice that may be short (e.g. what arrived before a peer closed).
pub fn decode_header_slice(b: &[u8], max_payload: u64) -> Result<Header, WireError> {
    let a: &[u8; HEADER_LEN] =
        b.get(..HEADER_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(WireError::Truncated {
                got: b.len(),
                peer: PeerTag::default(),
            })?;
    decode_header(a, max_payload)
}

/// A frame's payload, as queued for a connection's writer (TCP and QUIC).
#[derive(Clone)]
pub(crate) enum Body {
    /// A tensor, sent from its own memory.
    Tensor(Tensor),
    /// Bytes (messages, abort reasons, handshake frames).
    Bytes(Vec<u8>),
}

/// A frame queued for a peer's writer: its encoded header and its payload.
#[derive(Clone)]
pub(crate) struct Outgoing {
    pub(crate) head: [u8; HEADER_LEN],
    pub(crate) body: Body,
}

impl Outgoing {
    /// The Abort frame telling a peer that `step` failed because of `reason` (cut to
    /// [`MAX_CONTROL_PAYLOAD`]).
    pub(crate) fn abort(step: u64, reason: &str) -> Outgoing {
        let mut reason = reason.as_bytes().to_vec();
        reason.truncate(MAX_CONTROL_PAYLOAD as usize);
        Outgoing {
            head: encode_header(&Header {
                kind: FrameKind::Abort,
                flags: 0,
                slot_id: 0,
                step,
                payload_len: reason.len() as u64,
            }),
            body: Body::Bytes(reason),
        }
    }

    /// The frame carrying control-plane message `body`.
    pub(crate) fn message(body: Vec<u8>) -> Outgoing {
        Outgoing {
            head: encode_header(&Header {
                kind: FrameKind::Message,
                flags: 0,
                slot_id: 0,
                step: 0,
                payload_len: body.len() as u64,
            }),
            body: Body::Bytes(body),
        }
    }

    /// The Data frame carrying `value` into slot `slot_id` for `step`, from the tensor's memory.
    pub(crate) fn data(slot_id: u32, step: u64, value: Tensor) -> Outgoing {
        Outgoing {
            head: encode_header(&Header::data(slot_id, step, value.byte_len() as u64)),
            body: Body::Tensor(value),
        }
    }
}

/// The writer queues of one plane's outgoing connections, one per peer (TCP and QUIC).
#[derive(Default)]
pub(crate) struct Writers {
    queues: Mutex<HashMap<Arc<str>, UnboundedSender<Outgoing>>>,
}

impl Writers {
    /// Queues `out` for `peer`'s writer.
    pub(crate) fn queue(&self, peer: &str, out: Outgoing) -> Result<(), RendezvousError> {
        let gone = |cause: &str| RendezvousError::PeerGone {
            peer: peer.to_string(),
            cause: cause.to_string(),
        };
        lock(&self.queues)
            .get(peer)
            .ok_or_else(|| gone("not connected"))?
            .send(out)
            .map_err(|_| gone("connection closed"))
    }

    /// Queues `out` for every connected peer (best effort).
    pub(crate) fn broadcast(&self, out: &Outgoing) {
        for tx in lock(&self.queues).values() {
            let _ = tx.send(out.clone());
        }
    }

    /// The queue of a new connection to `peer` (replacing an older one).
    pub(crate) fn insert(&self, peer: Arc<str>, tx: UnboundedSender<Outgoing>) {
        lock(&self.queues).insert(peer, tx);
    }

    /// Drops the queue to `peer`: its writer ends once the frames queued before are written.
    pub(crate) fn remove(&self, peer: &str) {
        lock(&self.queues).remove(peer);
    }

    /// Drops every queue.
    pub(crate) fn clear(&self) {
        lock(&self.queues).clear();
    }

    /// True while a connection to `peer` is open.
    pub(crate) fn contains(&self, peer: &str) -> bool {
        lock(&self.queues).contains_key(peer)
    }
}

/// Reads a payload of `len` bytes whose length a peer claimed (already checked against its
/// limit), growing the buffer only as bytes arrive: a peer that claims a large message and sends
/// little makes this task hold little, and what it held is freed when the connection drops.
pub(crate) async fn read_claimed<R>(r: &mut R, len: u64) -> std::io::Result<Vec<u8>>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt as _;
    const FIRST_CHUNK: u64 = 64 << 10;
    let mut body = Vec::with_capacity(usize::try_from(len.min(FIRST_CHUNK)).unwrap_or(0));
    let got = (&mut *r).take(len).read_to_end(&mut body).await?;
    if (got as u64) < len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("the peer closed the connection after {got} of {len} payload bytes"),
        ));
    }
    Ok(body)
}

/// The header of a heartbeat frame (no payload).
pub fn heartbeat_header() -> [u8; HEADER_LEN] {
    encode_header(&Header {
        kind: FrameKind::Heartbeat,
        flags: 0,
        slot_id: 0,
        step: 0,
        payload_len: 0,
    })
}

/// What a connection's writer sends next: the next queued frame, or `beat()` when nothing was
/// queued for `heartbeat` (with heartbeats on); `None` once the queue is closed.
pub(crate) async fn next_or_heartbeat<T>(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<T>,
    heartbeat: Option<std::time::Duration>,
    beat: impl FnOnce() -> T,
) -> Option<T> {
    match heartbeat {
        Some(every) => match tokio::time::timeout(every, rx.recv()).await {
            Ok(next) => next,
            Err(_) => Some(beat()),
        },
        None => rx.recv().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layout_is_little_endian_and_fixed() {
        let b = encode_header(&Header::data(0x0403_0201, 0x0807_0605_0403_0201, 5));
        assert_eq!(&b[0..4], b"DFLW");
        assert_eq!(&b[4..6], &[1, 0]);
        assert_eq!(b[6], 1);
        assert_eq!(&b[8..12], &[1, 2, 3, 4]);
        assert_eq!(&b[12..20], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[20..28], &[5, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn bad_magic_version_kind_are_named() {
        let good = encode_header(&Header::data(1, 2, 3));
        let mut b = good;
        b[0] = b'X';
        let e = decode_header(&b, 10).unwrap_err().with_peer("worker:1");
        assert!(matches!(e, WireError::BadMagic { .. }));
        assert!(e.to_string().contains("peer `worker:1`"), "{e}");

        let mut b = good;
        b[4] = 9;
        let e = decode_header(&b, 10).unwrap_err();
        assert_eq!(
            e.to_string(),
            "unsupported wire version 9; this build supports [1]"
        );

        let mut b = good;
        b[6] = 77;
        assert!(matches!(
            decode_header(&b, 10),
            Err(WireError::BadKind { found: 77, .. })
        ));
    }

    #[test]
    fn length_is_checked_against_the_bound() {
        let b = encode_header(&Header::data(4, 9, 1025));
        let e = decode_header(&b, 1024).unwrap_err().with_peer("ps:0");
        assert_eq!(
            e.to_string(),
            "Data frame for slot 4, step 9 from peer `ps:0` announces 1025 payload bytes; at most 1024 allowed"
        );
        assert!(decode_header(&b, 1025).is_ok());
        // Control frames have their own bound, whatever the caller allows.
        let mut h = Header::data(0, 0, MAX_CONTROL_PAYLOAD + 1);
        h.kind = FrameKind::Abort;
        assert!(decode_header(&encode_header(&h), u64::MAX).is_err());
        h.kind = FrameKind::Credit;
        h.payload_len = 1;
        assert!(decode_header(&encode_header(&h), u64::MAX).is_err());
    }

    #[test]
    fn truncated_headers_are_errors() {
        let b = encode_header(&Header::data(1, 2, 3));
        for n in 0..HEADER_LEN {
            assert_eq!(
                decode_header_slice(&b[..n], 10),
                Err(WireError::Truncated {
                    got: n,
                    peer: PeerTag::default()
                })
            );
        }
        assert!(decode_header_slice(&b, 10).is_ok());
    }

    fn any_kind() -> impl Strategy<Value = FrameKind> {
        prop_oneof![
            Just(FrameKind::Data),
            Just(FrameKind::Abort),
            Just(FrameKind::Credit),
            Just(FrameKind::Hello),
            Just(FrameKind::Challenge),
            Just(FrameKind::Proof),
        ]
    }

    proptest! {
        #[test]
        fn every_header_round_trips(kind in any_kind(), flags: u8, slot_id: u32, step: u64, len: u64) {
            let len = match kind {
                FrameKind::Data => len,
                FrameKind::Credit => 0,
                _ => len % (MAX_CONTROL_PAYLOAD + 1),
            };
            let h = Header { kind, flags, slot_id, step, payload_len: len };
            prop_assert_eq!(decode_header(&encode_header(&h), u64::MAX), Ok(h));
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64), max: u64) {
            if let Ok(h) = decode_header_slice(&b, max) {
                prop_assert!(b.len() >= HEADER_LEN);
                prop_assert!(h.payload_len <= max.max(MAX_CONTROL_PAYLOAD));
            }
        }

        #[test]
        fn over_long_lengths_are_errors(slot_id: u32, step: u64, max in 0u64..u64::MAX) {
            let b = encode_header(&Header::data(slot_id, step, max + 1));
            let is_too_long = matches!(decode_header(&b, max), Err(WireError::TooLong { .. }));
            prop_assert!(is_too_long);
        }
    }
}
