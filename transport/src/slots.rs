//! [`SlotTable`]: the receive slots of a plane whose payloads are read from a byte stream (TCP,
//! QUIC): each registered once with its preallocated buffer, checked out for one frame at a time.

use crate::plane::lock;
use crate::rendezvous::RendezvousKey;
use crate::tcp::TcpError;
use dflow_graph::tensor::Buffer;
use dflow_graph::{DType, Tensor};
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
    /// `None` while a frame is being read into it.
    buf: Option<Arc<Buffer>>,
}

/// What a checked-out slot needs to become a tensor.
pub(crate) struct Checkout {
    pub(crate) key: Arc<RendezvousKey>,
    pub(crate) dtype: DType,
    pub(crate) dims: Arc<[usize]>,
    pub(crate) buf: Arc<Buffer>,
}

/// The receive slots of one process, each registered once with its preallocated buffer.
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
    /// receive buffer is allocated here, once.
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
        let zeros = Tensor::zeros(dtype, dims).map_err(|e| err(e.to_string()))?;
        let buf = zeros.buffer().clone();
        drop(zeros);
        let mut slots = lock(&self.slots);
        if let Some(s) = slots.get(&slot_id) {
            return Err(err(format!("slot id already used by key {}", s.key)));
        }
        let mut by_key = lock(&self.by_key);
        if by_key.contains_key(&key) {
            return Err(err("key already has a slot".into()));
        }
        by_key.insert(key.clone(), peer.into());
        let len = buf.len();
        self.max_len.fetch_max(len as u64, Ordering::Relaxed);
        slots.insert(
            slot_id,
            Slot {
                peer: peer.into(),
                key,
                dtype,
                dims: dims.into(),
                len,
                buf: Some(buf),
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
        let mut buf = s.buf.take().ok_or_else(|| {
            format!(
                "slot {slot_id} (key {}) is already being written by another connection",
                s.key
            )
        })?;
        if Arc::get_mut(&mut buf).is_none() {
            // The reader still holds the last tensor: never write under it.
            self.reallocs.fetch_add(1, Ordering::Relaxed);
            buf = Arc::new(Buffer::zeroed(s.len));
        }
        Ok(Checkout {
            key: s.key.clone(),
            dtype: s.dtype,
            dims: s.dims.clone(),
            buf,
        })
    }

    pub(crate) fn checkin(&self, slot_id: u32, buf: Arc<Buffer>) {
        if let Some(s) = lock(&self.slots).get_mut(&slot_id) {
            s.buf = Some(buf);
        }
    }
}
