//! [`SlotTable`]: the receive slots of a plane whose payloads are read from a byte stream (TCP,
//! QUIC): each registered once, its buffer allocated when its first frame arrives and kept for
//! the next, checked out for one frame at a time.
//!
//! The buffer is not allocated at registration: a task registers the slots of every graph of
//! its job, and some are never received into (worker 0's slots for the evaluation graph's
//! joined parameters under ZeRO-3 and tensor parallelism, a whole copy of the model, when the
//! job does not evaluate); a zeroed buffer is resident memory from the start.

use crate::plane::lock;
use crate::rendezvous::RendezvousKey;
use crate::tcp::TcpError;
use dflow_graph::tensor::{Buffer, MAX_TENSOR_BYTES};
use dflow_graph::DType;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

struct Slot {
    peer: Arc<str>,
    key: Arc<RendezvousKey>,
    dtype: DType,
    dims: Arc<[usize]>,
    len: usize,
    buf: SlotBuffer,
}

/// Where a slot's buffer is.
enum SlotBuffer {
    /// No frame has arrived yet: allocated by the first checkout.
    Unallocated,
    /// Kept for the next frame.
    Idle(Arc<Buffer>),
    /// A frame is being read into it.
    Writing,
}

/// What a checked-out slot needs to become a tensor.
pub(crate) struct Checkout {
    pub(crate) key: Arc<RendezvousKey>,
    pub(crate) dtype: DType,
    pub(crate) dims: Arc<[usize]>,
    pub(crate) buf: Arc<Buffer>,
}

/// The receive slots of one process, each registered once; its buffer is allocated by its first
/// frame and reused by the next.
#[derive(Default)]
pub struct SlotTable {
    slots: Mutex<HashMap<u32, Slot>>,
    by_key: Mutex<HashMap<Arc<RendezvousKey>, Arc<str>>>,
    max_len: AtomicU64,
    reallocs: AtomicU64,
}

impl fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SlotTable({} slots)", lock(&self.slots).len())
    }
}

impl SlotTable {
    /// Registers slot `slot_id`: `peer` sends `key`, a `dtype` tensor of shape `dims`. The
    /// receive buffer is allocated when the first frame arrives, once.
    pub fn register(
        &self,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<(), TcpError> {
        let err = |msg: String| TcpError::Register {
            slot_id,
            key: key.to_string(),
            msg,
        };
        let len = dims
            .iter()
            .try_fold(dtype.size_of(), |a, &d| a.checked_mul(d))
            .filter(|&l| l <= MAX_TENSOR_BYTES)
            .ok_or_else(|| err(format!("a {dtype} tensor of shape {dims:?} is too large")))?;
        let mut slots = lock(&self.slots);
        if let Some(s) = slots.get(&slot_id) {
            return Err(err(format!("slot id already used by key {}", s.key)));
        }
        let mut by_key = lock(&self.by_key);
        if by_key.contains_key(&key) {
            return Err(err("key already has a slot".into()));
        }
        by_key.insert(key.clone(), peer.into());
        self.max_len.fetch_max(len as u64, Ordering::Relaxed);
        slots.insert(
            slot_id,
            Slot {
                peer: peer.into(),
                key,
                dtype,
                dims: dims.into(),
                len,
                buf: SlotBuffer::Unallocated,
            },
        );
        Ok(())
    }

    /// Number of registered slots.
    pub fn len(&self) -> usize {
        lock(&self.slots).len()
    }

    /// True when no slot is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The largest registered slot in bytes (the bound for any Data frame).
    pub fn max_payload(&self) -> u64 {
        self.max_len.load(Ordering::Relaxed)
    }

    /// The byte length of slot `slot_id`, if registered.
    pub fn slot_len(&self, slot_id: u32) -> Option<u64> {
        lock(&self.slots).get(&slot_id).map(|s| s.len as u64)
    }

    /// How often a slot got a fresh buffer because its reader still held the previous tensor.
    pub fn reallocations(&self) -> u64 {
        self.reallocs.load(Ordering::Relaxed)
    }

    /// The peer that sends `key`, if it has a slot.
    pub fn peer_of(&self, key: &RendezvousKey) -> Option<Arc<str>> {
        lock(&self.by_key).get(key).cloned()
    }

    /// Takes slot `slot_id`'s buffer (uniquely owned) for a frame of `len` bytes from `peer`.
    pub(crate) fn checkout(&self, slot_id: u32, peer: &str, len: u64) -> Result<Checkout, String> {
        let mut slots = lock(&self.slots);
        let s = slots
            .get_mut(&slot_id)
            .ok_or_else(|| format!("Data frame for unknown slot {slot_id}"))?;
        if *s.peer != *peer {
            return Err(format!(
                "Data frame for slot {slot_id} (key {}), which belongs to peer `{}`",
                s.key, s.peer
            ));
        }
        if len != s.len as u64 {
            return Err(format!(
                "Data frame for slot {slot_id} (key {}) has {len} bytes; the slot holds {}",
                s.key, s.len
            ));
        }
        let buf = match std::mem::replace(&mut s.buf, SlotBuffer::Writing) {
            SlotBuffer::Writing => {
                return Err(format!(
                    "slot {slot_id} (key {}) is already being written by another connection",
                    s.key
                ))
            }
            SlotBuffer::Unallocated => Arc::new(Buffer::zeroed(s.len)),
            SlotBuffer::Idle(mut buf) => {
                if Arc::get_mut(&mut buf).is_none() {
                    // The reader still holds the last tensor: never write under it.
                    self.reallocs.fetch_add(1, Ordering::Relaxed);
                    buf = Arc::new(Buffer::zeroed(s.len));
                }
                buf
            }
        };
        Ok(Checkout {
            key: s.key.clone(),
            dtype: s.dtype,
            dims: s.dims.clone(),
            buf,
        })
    }

    pub(crate) fn checkin(&self, slot_id: u32, buf: Arc<Buffer>) {
        if let Some(s) = lock(&self.slots).get_mut(&slot_id) {
            s.buf = SlotBuffer::Idle(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> Arc<RendezvousKey> {
        Arc::new(RendezvousKey::new("/job:a/task:0", "/job:b/task:0", name))
    }

    /// Bytes of the buffers the table's slots hold now.
    fn held(t: &SlotTable) -> usize {
        lock(&t.slots)
            .values()
            .map(|s| match &s.buf {
                SlotBuffer::Idle(b) => b.len(),
                SlotBuffer::Unallocated | SlotBuffer::Writing => 0,
            })
            .sum()
    }

    #[test]
    fn a_slot_allocates_its_buffer_on_its_first_frame_and_reuses_it() {
        let t = SlotTable::default();
        // 1 GiB: registering allocates nothing.
        t.register(7, "/job:b/task:0", key("w"), DType::F32, &[1 << 28])
            .unwrap();
        t.register(8, "/job:b/task:0", key("x"), DType::F32, &[4, 16])
            .unwrap();
        assert_eq!(held(&t), 0);
        assert_eq!(t.max_payload(), 1 << 30);
        let c = t.checkout(8, "/job:b/task:0", 256).unwrap();
        assert_eq!(c.buf.len(), 256);
        // A second frame for a slot being written is refused.
        let e = t.checkout(8, "/job:b/task:0", 256).err().unwrap();
        assert!(e.contains("already being written"), "{e}");
        let first = Arc::as_ptr(&c.buf);
        t.checkin(8, c.buf);
        assert_eq!(held(&t), 256);
        // The next frame reads into the same buffer.
        let c = t.checkout(8, "/job:b/task:0", 256).unwrap();
        assert_eq!(Arc::as_ptr(&c.buf), first);
        assert_eq!(t.reallocations(), 0);
        let reader = c.buf.clone();
        t.checkin(8, c.buf);
        // ...unless its reader still holds it.
        let c = t.checkout(8, "/job:b/task:0", 256).unwrap();
        assert_ne!(Arc::as_ptr(&c.buf), Arc::as_ptr(&reader));
        assert_eq!(t.reallocations(), 1);
    }

    #[test]
    fn a_slot_too_large_for_a_tensor_is_refused_at_registration() {
        let t = SlotTable::default();
        let e = t
            .register(1, "/job:b/task:0", key("w"), DType::F32, &[1 << 40, 2])
            .unwrap_err()
            .to_string();
        assert!(e.contains("too large"), "{e}");
        assert!(t.is_empty());
        let e = t
            .register(2, "/job:b/task:0", key("v"), DType::F32, &[usize::MAX, 2])
            .unwrap_err()
            .to_string();
        assert!(e.contains("too large"), "{e}");
    }
}
