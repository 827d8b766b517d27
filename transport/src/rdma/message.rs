//! The RDMA plane's own control messages, carried on the control channel next to the runtime's:
//! a peer's queue-pair endpoint, and the advertisement of a receive slot (where its memory is and
//! the key that writes it).
//!
//! Layout (little-endian): `"RD"`, version `u8`, kind `u8`, then the fields of the kind. Every
//! message is bounded ([`MAX_MESSAGE`]) and decoded exactly (no trailing bytes, UTF-8 key, slot id
//! within [`MAX_SLOT_ID`]).
//!
//! ```text
//! kind 1 Endpoint: qp_num u32, lid u16, gid [16], psn u32
//! kind 2 SlotAd:   slot_id u32, len u64, addr u64, rkey u32, step_addr u64, step_rkey u32,
//!                  key_len u16, key [key_len]   (key = `send;recv;tensor`)
//! kind 3 Ready:    (nothing)
//! kind 4 Abort:    step u64, reason_len u16, reason [reason_len] (UTF-8, at most MAX_REASON)
//! ```

use super::imm::MAX_SLOT_ID;
use super::verbs::{QpEndpoint, RemoteSegment};
use crate::rendezvous::RendezvousKey;

/// Version of this layout; a peer speaking another one is refused.
pub const VERSION: u8 = 1;

/// Longest rendezvous key a SlotAd carries.
pub const MAX_KEY_LEN: usize = 4096;

/// Longest abort reason (longer ones are cut when encoding).
pub const MAX_REASON: usize = 1024;

/// Longest message (a SlotAd with the longest key).
pub const MAX_MESSAGE: usize = 4 + 36 + 2 + MAX_KEY_LEN;

const MAGIC: [u8; 2] = *b"RD";

/// One receive slot, as its receiver tells its sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotAd {
    /// The slot id (the sender's route names it).
    pub slot_id: u32,
    /// The key sent into it (the sender checks it against its route).
    pub key: RendezvousKey,
    /// The payload's exact length in bytes.
    pub len: u64,
    /// Where the payload goes (unused when `len` is 0).
    pub data: RemoteSegment,
    /// Where the 8-byte step word goes (written with the immediate, after the payload).
    pub step_word: RemoteSegment,
}

/// A control message of the RDMA plane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RdmaMessage {
    /// The sender's queue pair for this peer.
    Endpoint(QpEndpoint),
    /// A receive slot the peer writes; it comes with one credit.
    SlotAd(SlotAd),
    /// The sender's queue pair is connected to ours and has receives posted: write to it.
    Ready,
    /// The sender aborted a step.
    Abort {
        /// The step.
        step: u64,
        /// Why.
        reason: String,
    },
}

/// A message that does not decode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad RDMA control message: {0}")]
pub struct BadMessage(pub String);

impl RdmaMessage {
    /// Encodes it.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        match self {
            RdmaMessage::Endpoint(e) => {
                out.push(1);
                out.extend_from_slice(&e.qp_num.to_le_bytes());
                out.extend_from_slice(&e.lid.to_le_bytes());
                out.extend_from_slice(&e.gid);
                out.extend_from_slice(&e.psn.to_le_bytes());
            }
            RdmaMessage::SlotAd(ad) => {
                out.push(2);
                out.extend_from_slice(&ad.slot_id.to_le_bytes());
                out.extend_from_slice(&ad.len.to_le_bytes());
                out.extend_from_slice(&ad.data.addr.to_le_bytes());
                out.extend_from_slice(&ad.data.rkey.to_le_bytes());
                out.extend_from_slice(&ad.step_word.addr.to_le_bytes());
                out.extend_from_slice(&ad.step_word.rkey.to_le_bytes());
                let key = ad.key.to_string();
                let key = key.as_bytes();
                let n = key.len().min(MAX_KEY_LEN);
                out.extend_from_slice(&(n as u16).to_le_bytes());
                out.extend_from_slice(&key[..n]);
            }
            RdmaMessage::Ready => out.push(3),
            RdmaMessage::Abort { step, reason } => {
                out.push(4);
                out.extend_from_slice(&step.to_le_bytes());
                let mut n = reason.len().min(MAX_REASON);
                while !reason.is_char_boundary(n) {
                    n -= 1;
                }
                out.extend_from_slice(&(n as u16).to_le_bytes());
                out.extend_from_slice(&reason.as_bytes()[..n]);
            }
        }
        out
    }

    /// Decodes bytes from a peer.
    pub fn decode(bytes: &[u8]) -> Result<RdmaMessage, BadMessage> {
        let bad = |m: &str| BadMessage(m.to_string());
        if bytes.len() > MAX_MESSAGE {
            return Err(BadMessage(format!(
                "{} bytes, more than the {MAX_MESSAGE} allowed",
                bytes.len()
            )));
        }
        let mut r = Reader(bytes);
        if r.take(2)? != MAGIC {
            return Err(bad("missing the RD magic"));
        }
        let version = r.u8()?;
        if version != VERSION {
            return Err(BadMessage(format!(
                "version {version}, this build speaks version {VERSION} (run the same dflow on every task)"
            )));
        }
        let msg = match r.u8()? {
            1 => {
                let qp_num = r.u32()?;
                let lid = r.u16()?;
                let mut gid = [0u8; 16];
                gid.copy_from_slice(r.take(16)?);
                let psn = r.u32()?;
                RdmaMessage::Endpoint(QpEndpoint {
                    qp_num,
                    lid,
                    gid,
                    psn,
                })
            }
            2 => {
                let slot_id = r.u32()?;
                if slot_id > MAX_SLOT_ID {
                    return Err(BadMessage(format!(
                        "slot id {slot_id} exceeds the immediate's {MAX_SLOT_ID}"
                    )));
                }
                let len = r.u64()?;
                let data = RemoteSegment {
                    addr: r.u64()?,
                    rkey: r.u32()?,
                };
                let step_word = RemoteSegment {
                    addr: r.u64()?,
                    rkey: r.u32()?,
                };
                let key_len = r.u16()? as usize;
                if key_len > MAX_KEY_LEN {
                    return Err(BadMessage(format!(
                        "key of {key_len} bytes, more than {MAX_KEY_LEN}"
                    )));
                }
                let key =
                    std::str::from_utf8(r.take(key_len)?).map_err(|_| bad("key is not UTF-8"))?;
                let key = RendezvousKey::parse(key).map_err(|e| BadMessage(e.to_string()))?;
                RdmaMessage::SlotAd(SlotAd {
                    slot_id,
                    key,
                    len,
                    data,
                    step_word,
                })
            }
            3 => RdmaMessage::Ready,
            4 => {
                let step = r.u64()?;
                let n = r.u16()? as usize;
                if n > MAX_REASON {
                    return Err(BadMessage(format!(
                        "abort reason of {n} bytes, more than {MAX_REASON}"
                    )));
                }
                let reason = String::from_utf8_lossy(r.take(n)?).into_owned();
                RdmaMessage::Abort { step, reason }
            }
            k => return Err(BadMessage(format!("unknown kind {k}"))),
        };
        if !r.0.is_empty() {
            return Err(BadMessage(format!("{} trailing bytes", r.0.len())));
        }
        Ok(msg)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BadMessage> {
        if self.0.len() < n {
            return Err(BadMessage("truncated".into()));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, BadMessage> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, BadMessage> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, BadMessage> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, BadMessage> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ad() -> RdmaMessage {
        RdmaMessage::SlotAd(SlotAd {
            slot_id: 3,
            key: RendezvousKey::new("/job:w/task:0/cpu:0", "/job:ps/task:0/cpu:0", "g:0"),
            len: 4096,
            data: RemoteSegment {
                addr: 0x7f00_0000_1000,
                rkey: 0x1234,
            },
            step_word: RemoteSegment {
                addr: 0x7f00_0000_9000,
                rkey: 0x5678,
            },
        })
    }

    #[test]
    fn round_trips() {
        let ep = RdmaMessage::Endpoint(QpEndpoint {
            qp_num: 0x11,
            lid: 2,
            gid: [7; 16],
            psn: 0x42,
        });
        let abort = RdmaMessage::Abort {
            step: 9,
            reason: "kernel failed".into(),
        };
        for m in [ep, ad(), RdmaMessage::Ready, abort] {
            assert_eq!(RdmaMessage::decode(&m.encode()), Ok(m));
        }
    }

    #[test]
    fn refuses_bad_input() {
        let good = ad().encode();
        let mut wrong_version = good.clone();
        wrong_version[2] = 9;
        assert!(RdmaMessage::decode(&wrong_version)
            .unwrap_err()
            .0
            .contains("version 9"));
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(RdmaMessage::decode(&trailing).is_err());
        assert!(RdmaMessage::decode(&good[..good.len() - 1]).is_err());
        assert!(RdmaMessage::decode(&[b'R', b'D', VERSION, 99]).is_err());
        assert!(RdmaMessage::decode(&vec![0u8; MAX_MESSAGE + 1]).is_err());
        let mut big_slot = good.clone();
        big_slot[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(RdmaMessage::decode(&big_slot)
            .unwrap_err()
            .0
            .contains("slot id"));
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = RdmaMessage::decode(&bytes);
            let mut with_magic = vec![b'R', b'D', VERSION];
            with_magic.extend_from_slice(&bytes);
            let _ = RdmaMessage::decode(&with_magic);
        }
    }
}
