//! The shm plane's own messages on the side channel (TCP control messages): attaching segments,
//! a slot's first delivery, and step aborts. They start with [`MAGIC`], which no control-plane
//! message of the layer above starts with (those begin with a small protocol version), so the
//! plane can take them out of the message stream.

/// First bytes of every shm message.
pub const MAGIC: [u8; 4] = [0xff, b'S', b'H', b'M'];

/// One side-channel message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShmMessage {
    /// The sender's doorbell ring for this pair is segment `name`.
    AttachRing {
        /// Segment name (under `/dev/shm`).
        name: String,
    },
    /// Receive slot `slot` (of `len` bytes) lives in segment `name`.
    AttachSlot {
        /// The receiver's slot id.
        slot: u32,
        /// Slot length in bytes.
        len: u64,
        /// Segment name.
        name: String,
    },
    /// Slot `slot` holds the value of `step` (a slot's first delivery; later ones ride the ring).
    Deliver {
        /// The receiver's slot id.
        slot: u32,
        /// Step id.
        step: u64,
    },
    /// The sender aborted `step`.
    Abort {
        /// Step id.
        step: u64,
        /// Why.
        reason: String,
    },
}

impl ShmMessage {
    /// The wire form: [`MAGIC`], a kind byte, little-endian fields, names with a `u16` length.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        let name_field = |b: &mut Vec<u8>, s: &str| {
            let s = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
            b.extend_from_slice(&(s.len() as u16).to_le_bytes());
            b.extend_from_slice(s);
        };
        match self {
            ShmMessage::AttachRing { name } => {
                b.push(1);
                name_field(&mut b, name);
            }
            ShmMessage::AttachSlot { slot, len, name } => {
                b.push(2);
                b.extend_from_slice(&slot.to_le_bytes());
                b.extend_from_slice(&len.to_le_bytes());
                name_field(&mut b, name);
            }
            ShmMessage::Deliver { slot, step } => {
                b.push(3);
                b.extend_from_slice(&slot.to_le_bytes());
                b.extend_from_slice(&step.to_le_bytes());
            }
            ShmMessage::Abort { step, reason } => {
                b.push(4);
                b.extend_from_slice(&step.to_le_bytes());
                b.extend_from_slice(reason.as_bytes());
            }
        }
        b
    }

    /// `None` when `body` is not an shm message (no [`MAGIC`]); an error when it is one but
    /// malformed.
    pub fn decode(body: &[u8]) -> Option<Result<ShmMessage, String>> {
        let rest = body.strip_prefix(&MAGIC)?;
        Some(Reader(rest).message())
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err(format!(
                "truncated shm message ({} bytes left, {n} needed)",
                self.0.len()
            ));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, String> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    fn name(&mut self) -> Result<String, String> {
        let n = self.u16()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "segment name is not UTF-8".into())
    }

    fn message(mut self) -> Result<ShmMessage, String> {
        let kind = self.take(1)?[0];
        let m = match kind {
            1 => ShmMessage::AttachRing { name: self.name()? },
            2 => ShmMessage::AttachSlot {
                slot: self.u32()?,
                len: self.u64()?,
                name: self.name()?,
            },
            3 => ShmMessage::Deliver {
                slot: self.u32()?,
                step: self.u64()?,
            },
            4 => {
                let step = self.u64()?;
                let reason = String::from_utf8_lossy(self.0).into_owned();
                self.0 = &[];
                ShmMessage::Abort { step, reason }
            }
            k => return Err(format!("unknown shm message kind {k}")),
        };
        if !self.0.is_empty() {
            return Err(format!("{} stray bytes after an shm message", self.0.len()));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        for m in [
            ShmMessage::AttachRing {
                name: "dflow-shm-1-0-r".into(),
            },
            ShmMessage::AttachSlot {
                slot: 3,
                len: 1 << 20,
                name: "dflow-shm-1-1-s".into(),
            },
            ShmMessage::Deliver {
                slot: 9,
                step: u64::MAX,
            },
            ShmMessage::Abort {
                step: 4,
                reason: "kernel failed".into(),
            },
        ] {
            let b = m.encode();
            assert_eq!(ShmMessage::decode(&b), Some(Ok(m)));
            for cut in 4..b.len().saturating_sub(1) {
                if !matches!(
                    ShmMessage::decode(&b[..cut]),
                    Some(Err(_)) | Some(Ok(ShmMessage::Abort { .. }))
                ) {
                    panic!(
                        "truncated at {cut} decoded: {:?}",
                        ShmMessage::decode(&b[..cut])
                    );
                }
            }
        }
        assert_eq!(
            ShmMessage::decode(&[1, 0, 5]),
            None,
            "a control message passes through"
        );
        assert!(matches!(
            ShmMessage::decode(&[0xff, b'S', b'H', b'M', 77]),
            Some(Err(_))
        ));
    }
}
