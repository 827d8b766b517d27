//! The name of one Send/Recv pair, shared by the partitioner (which makes pairs), the job plan
//! (which lists them) and the transports (which meet on them): `send_device;recv_device;tensor`.
//!
//! One shared string with the two separators' positions: cloning is a reference count, the
//! three parts are slices of it, and nothing between the partitioner and the transport turns a
//! key into text and parses it back. Text appears only at the edges (files, the wire,
//! snapshots), where [`RendezvousKey::parse`] checks it.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// Identifies one Send/Recv pair: `send_device;recv_device;tensor_name`.
///
/// The step id is not part of the key; it is passed alongside, so the same key is reused every
/// step (and the same preallocated buffer behind it). Keys order as their text does (the job
/// plan numbers slots in that order).
#[derive(Clone)]
pub struct RendezvousKey {
    text: Arc<str>,
    /// End of the send device in `text` (the first `;`).
    send_end: u32,
    /// End of the receive device in `text` (the second `;`).
    recv_end: u32,
}

/// Text that is not `send_device;recv_device;tensor_name` with three non-empty parts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad rendezvous key `{0}`: expected `send_device;recv_device;tensor_name`, three non-empty parts")]
pub struct BadRendezvousKey(pub String);

impl RendezvousKey {
    /// Builds a key from its parts (the device names must not contain `;`; a tensor name may).
    pub fn new(send_device: &str, recv_device: &str, tensor_name: &str) -> Self {
        let mut text =
            String::with_capacity(send_device.len() + recv_device.len() + tensor_name.len() + 2);
        for part in [send_device, ";", recv_device, ";", tensor_name] {
            text.push_str(part);
        }
        Self::from_parts(&text, send_device.len(), recv_device.len())
    }

    /// A key from `text`, `send_device;recv_device;tensor_name` whose first two parts are
    /// `send_len` and `recv_len` bytes long (the partitioner's scratch string: one copy). Text
    /// not separated there is split at its first two `;` instead (a part may then be empty).
    pub fn from_parts(text: &str, send_len: usize, recv_len: usize) -> Self {
        let bytes = text.as_bytes();
        let recv_end = send_len.saturating_add(1).saturating_add(recv_len);
        let fits = u32::try_from(text.len()).is_ok();
        if fits && bytes.get(send_len) == Some(&b';') && bytes.get(recv_end) == Some(&b';') {
            return RendezvousKey {
                text: Arc::from(text),
                send_end: send_len as u32,
                recv_end: recv_end as u32,
            };
        }
        let first = text.find(';').unwrap_or(text.len());
        let second = text
            .get(first + 1..)
            .and_then(|rest| rest.find(';'))
            .map_or(text.len(), |i| first + 1 + i);
        RendezvousKey {
            text: Arc::from(text),
            send_end: u32::try_from(first).unwrap_or(u32::MAX),
            recv_end: u32::try_from(second).unwrap_or(u32::MAX),
        }
    }

    /// Parses `send;recv;tensor` (the tensor name may itself contain `;`).
    pub fn parse(s: &str) -> Result<Self, BadRendezvousKey> {
        let bad = || BadRendezvousKey(s.to_string());
        if u32::try_from(s.len()).is_err() {
            return Err(bad());
        }
        let mut it = s.splitn(3, ';');
        match (it.next(), it.next(), it.next()) {
            (Some(a), Some(b), Some(c)) if !a.is_empty() && !b.is_empty() && !c.is_empty() => {
                Ok(Self::from_parts(s, a.len(), b.len()))
            }
            _ => Err(bad()),
        }
    }

    /// The sending device's full name.
    pub fn send_device(&self) -> &str {
        self.text.get(..self.send_end as usize).unwrap_or("")
    }

    /// The receiving device's full name.
    pub fn recv_device(&self) -> &str {
        self.text
            .get(self.send_end as usize + 1..self.recv_end as usize)
            .unwrap_or("")
    }

    /// The tensor, `node:output` (or `^node` for a control edge).
    pub fn tensor_name(&self) -> &str {
        self.text.get(self.recv_end as usize + 1..).unwrap_or("")
    }

    /// The whole key, `send_device;recv_device;tensor_name`.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl PartialEq for RendezvousKey {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for RendezvousKey {}

impl Hash for RendezvousKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.text.hash(state);
    }
}

impl PartialOrd for RendezvousKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for RendezvousKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.text.cmp(&other.text)
    }
}

impl fmt::Display for RendezvousKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for RendezvousKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.text, f)
    }
}

impl std::str::FromStr for RendezvousKey {
    type Err = BadRendezvousKey;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl Serialize for RendezvousKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for RendezvousKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEND: &str = "/job:worker/replica:0/task:0/device:CPU:0";
    const RECV: &str = "/job:ps/replica:0/task:0/device:CPU:0";

    #[test]
    fn the_parts_come_back_and_the_text_round_trips() {
        let k = RendezvousKey::new(SEND, RECV, "w:0");
        assert_eq!(
            (k.send_device(), k.recv_device(), k.tensor_name()),
            (SEND, RECV, "w:0")
        );
        assert_eq!(k.to_string(), format!("{SEND};{RECV};w:0"));
        assert_eq!(RendezvousKey::parse(k.as_str()).unwrap(), k);
        let json = serde_json::to_string(&k).unwrap();
        assert_eq!(serde_json::from_str::<RendezvousKey>(&json).unwrap(), k);
        // A tensor name may hold the separator.
        let odd = RendezvousKey::parse("a;b;c;d").unwrap();
        assert_eq!(odd.tensor_name(), "c;d");
    }

    #[test]
    fn bad_text_is_refused_naming_it() {
        for bad in ["", "a", "a;b", ";b;c", "a;;c", "a;b;"] {
            let err = RendezvousKey::parse(bad).unwrap_err();
            assert!(err.to_string().contains(&format!("`{bad}`")), "{err}");
        }
        assert!(serde_json::from_str::<RendezvousKey>("\"a;b\"").is_err());
    }

    #[test]
    fn parts_given_at_the_wrong_places_are_found_at_the_separators() {
        let k = RendezvousKey::from_parts("ab;c;d", 1, 7);
        assert_eq!(
            (k.send_device(), k.recv_device(), k.tensor_name()),
            ("ab", "c", "d")
        );
        let none = RendezvousKey::from_parts("abc", 9, 9);
        assert_eq!(
            (none.send_device(), none.recv_device(), none.tensor_name()),
            ("abc", "", "")
        );
    }

    #[test]
    fn keys_order_and_hash_as_their_text() {
        let a = RendezvousKey::new("x", "z", "t");
        let b = RendezvousKey::new("x1", "a", "t");
        assert_eq!(a.cmp(&b), a.as_str().cmp(b.as_str()));
        let mut h = std::collections::HashSet::new();
        h.insert(a.clone());
        assert!(h.contains(&RendezvousKey::parse("x;z;t").unwrap()));
        assert!(!h.contains(&b));
    }
}
