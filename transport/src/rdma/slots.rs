//! The receive side: every Recv slot is registered memory the peer writes, plus an 8-byte step
//! word, and a small state machine that decides when the peer may write it again.
//!
//! A slot is `Granted` (the peer holds its one credit and may write it once) or `Held` (a
//! tensor landed and was handed to the Recv, which may still hold it). It goes back to `Granted`
//! only when [`RecvSlots::reclaim`] finds that no reader holds the tensor any more, and only then
//! is the credit returned: the peer never writes a slot under a reader.

use super::imm::{Imm, ImmKind, MAX_SLOT_ID};
use super::message::SlotAd;
use super::verbs::{MemoryRegion, RemoteSegment, Verbs, VerbsError};
use super::RdmaError;
use crate::rendezvous::RendezvousKey;
use dflow_graph::tensor::Buffer;
use dflow_graph::{DType, Tensor};
use std::cell::UnsafeCell;
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::Arc;

/// Where a slot's bytes live. Host memory today; device memory (GPU buffers registered with
/// the NIC) is a later variant.
#[derive(Debug)]
pub enum SlotMemory {
    /// A host buffer; the received tensor aliases it.
    Host(Arc<Buffer>),
}

/// The 8 bytes a peer writes the step id into, right after the payload.
struct StepWord(Box<UnsafeCell<[u8; 8]>>);

// SAFETY: the cell is only read through `StepWord::read`, under the slot table's lock; the
// remote writer (the NIC, or the simulated fabric) is not a Rust thread holding references.
unsafe impl Sync for StepWord {}

impl StepWord {
    fn new() -> Self {
        StepWord(Box::new(UnsafeCell::new([0; 8])))
    }

    fn ptr(&self) -> *mut u8 {
        self.0.get().cast()
    }

    fn read(&self) -> u64 {
        // SAFETY: the pointer is valid (the box lives as long as `self`) and aligned for
        // `[u8; 8]`; the peer's write completed before the completion being handled (RC
        // ordering), and no reference into the cell exists. Volatile: the write came from outside
        // the program.
        u64::from_le_bytes(unsafe { std::ptr::read_volatile(self.0.get()) })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// The peer holds the credit: one write may land.
    Granted,
    /// The tensor of `step` was delivered; a reader may hold it.
    Held { step: u64 },
}

struct RecvSlot {
    peer: Arc<str>,
    key: Arc<RendezvousKey>,
    dtype: DType,
    dims: Arc<[usize]>,
    memory: SlotMemory,
    step_word: StepWord,
    data_mr: Option<MemoryRegion>,
    step_mr: MemoryRegion,
    state: State,
    last_step: Option<u64>,
}

/// A tensor that landed in a slot, for the Recv of `key` in `step`.
#[derive(Debug)]
pub struct Delivery {
    /// The key.
    pub key: Arc<RendezvousKey>,
    /// The step id (from the step word, checked against the immediate).
    pub step: u64,
    /// The tensor; its bytes are the slot's memory.
    pub tensor: Tensor,
}

/// A credit to send back: slot `imm.slot_id` of `peer` is free again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The sending peer.
    pub peer: Arc<str>,
    /// The credit immediate.
    pub imm: Imm,
}

/// The receive slots of one plane.
#[derive(Default)]
pub struct RecvSlots {
    slots: HashMap<u32, RecvSlot>,
    by_key: HashMap<Arc<RendezvousKey>, u32>,
    held: BTreeSet<u32>,
}

impl fmt::Debug for RecvSlots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RecvSlots({} slots, {} held)",
            self.slots.len(),
            self.held.len()
        )
    }
}

impl RecvSlots {
    /// Registers slot `slot_id` for `key` from `peer` (a `dtype` tensor of shape `dims`): its
    /// buffer is allocated and registered with `verbs` once, with its step word. Returns the
    /// advertisement for the peer, which carries the slot's first credit.
    pub fn register(
        &mut self,
        verbs: &dyn Verbs,
        slot_id: u32,
        peer: &str,
        key: Arc<RendezvousKey>,
        dtype: DType,
        dims: &[usize],
    ) -> Result<SlotAd, RdmaError> {
        let err = |msg: String| RdmaError::Register {
            slot_id,
            key: key.to_string(),
            msg,
        };
        if slot_id > MAX_SLOT_ID {
            return Err(err(format!(
                "slot id exceeds {MAX_SLOT_ID}, the most the immediate carries"
            )));
        }
        if let Some(s) = self.slots.get(&slot_id) {
            return Err(err(format!("slot id already used by key {}", s.key)));
        }
        if self.by_key.contains_key(&key) {
            return Err(err("key already has a slot".into()));
        }
        let zeros = Tensor::zeros(dtype, dims).map_err(|e| err(e.to_string()))?;
        let mut buf = zeros.buffer().clone();
        drop(zeros);
        let len = buf.len();
        let reg_err = |e: VerbsError| err(e.to_string());
        let data_mr = match Arc::get_mut(&mut buf) {
            Some(b) if len > 0 => {
                let ptr = b.as_bytes_mut().as_mut_ptr();
                // SAFETY: the buffer is owned by the slot (in `memory`) and deregistered in
                // `deregister_all` before the slot is dropped; it never moves (heap or inline in
                // the Arc's allocation). Writes land only while the slot is Granted, when
                // `reclaim` saw this Arc unshared.
                Some(unsafe { verbs.register(ptr, len) }.map_err(reg_err)?)
            }
            Some(_) => None,
            None => return Err(err("fresh slot buffer is shared".into())),
        };
        let step_word = StepWord::new();
        // SAFETY: the step word is boxed in the slot and deregistered before it is dropped; it is
        // only read through `StepWord::read`.
        let step_mr = match unsafe { verbs.register(step_word.ptr(), 8) } {
            Ok(mr) => mr,
            Err(e) => {
                if let Some(mr) = &data_mr {
                    verbs.deregister(mr);
                }
                return Err(reg_err(e));
            }
        };
        let ad = SlotAd {
            slot_id,
            key: (*key).clone(),
            len: len as u64,
            data: data_mr
                .map(|mr| RemoteSegment {
                    addr: mr.addr,
                    rkey: mr.rkey,
                })
                .unwrap_or(RemoteSegment { addr: 0, rkey: 0 }),
            step_word: RemoteSegment {
                addr: step_mr.addr,
                rkey: step_mr.rkey,
            },
        };
        self.by_key.insert(key.clone(), slot_id);
        self.slots.insert(
            slot_id,
            RecvSlot {
                peer: peer.into(),
                key,
                dtype,
                dims: dims.into(),
                memory: SlotMemory::Host(buf),
                step_word,
                data_mr,
                step_mr,
                state: State::Granted,
                last_step: None,
            },
        );
        Ok(ad)
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when no slot is registered.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The peer that sends `key`, if it has a slot.
    pub fn peer_of(&self, key: &RendezvousKey) -> Option<Arc<str>> {
        let id = self.by_key.get(key)?;
        self.slots.get(id).map(|s| s.peer.clone())
    }

    /// Slots that `peer` writes.
    pub fn count_from(&self, peer: &str) -> usize {
        self.slots.values().filter(|s| &*s.peer == peer).count()
    }

    /// True when slot `slot_id` is delivered and not yet credited back.
    pub fn is_held(&self, slot_id: u32) -> bool {
        self.held.contains(&slot_id)
    }

    /// Handles an incoming data immediate from `peer` carrying `byte_len` bytes: checks it
    /// against the slot (known, that peer's, credited, parity and step order) and hands out the
    /// tensor, which aliases the slot.
    pub fn on_data(&mut self, peer: &str, imm: Imm, byte_len: u32) -> Result<Delivery, RdmaError> {
        debug_assert_eq!(imm.kind, ImmKind::Data);
        let perr = |msg: String| RdmaError::Protocol {
            peer: peer.to_string(),
            msg,
        };
        let slot = self
            .slots
            .get_mut(&imm.slot_id)
            .ok_or_else(|| perr(format!("wrote unknown slot {}", imm.slot_id)))?;
        let what = format!("slot {} (key {})", imm.slot_id, slot.key);
        if *slot.peer != *peer {
            return Err(perr(format!(
                "wrote {what}, which belongs to peer `{}`",
                slot.peer
            )));
        }
        if let State::Held { step } = slot.state {
            return Err(perr(format!(
                "wrote {what} without a credit (the reader of step {step} may still hold it)"
            )));
        }
        if byte_len != 8 {
            return Err(perr(format!(
                "the immediate write to {what} carried {byte_len} bytes; the step word is 8"
            )));
        }
        let step = slot.step_word.read();
        if !imm.matches_step(step) {
            return Err(perr(format!(
                "{what}: immediate has step parity {} but the step word says step {step} (a stale or reordered write)",
                imm.parity
            )));
        }
        if let Some(last) = slot.last_step {
            if step <= last {
                return Err(perr(format!(
                    "{what}: step {step} arrived after step {last} (out of order)"
                )));
            }
        }
        let SlotMemory::Host(buf) = &slot.memory;
        let tensor = Tensor::from_shared(slot.dtype, &slot.dims, buf.clone())
            .map_err(|e| perr(format!("{what}: {e}")))?;
        slot.state = State::Held { step };
        slot.last_step = Some(step);
        self.held.insert(imm.slot_id);
        Ok(Delivery {
            key: slot.key.clone(),
            step,
            tensor,
        })
    }

    /// Finds held slots whose tensor no reader holds any more, marks them granted and returns
    /// the credits to send.
    pub fn reclaim(&mut self) -> Vec<Grant> {
        let mut grants = Vec::new();
        let slots = &mut self.slots;
        self.held.retain(|id| {
            let Some(slot) = slots.get_mut(id) else {
                return false;
            };
            let SlotMemory::Host(buf) = &mut slot.memory;
            let State::Held { step } = slot.state else {
                return false;
            };
            if Arc::get_mut(buf).is_none() {
                return true; // a reader still holds the tensor
            }
            slot.state = State::Granted;
            grants.push(Grant {
                peer: slot.peer.clone(),
                imm: Imm::new(ImmKind::Credit, *id, step),
            });
            false
        });
        grants
    }

    /// Deregisters every slot's memory (before the buffers are freed).
    pub fn deregister_all(&mut self, verbs: &dyn Verbs) {
        for (_, s) in self.slots.drain() {
            if let Some(mr) = &s.data_mr {
                verbs.deregister(mr);
            }
            verbs.deregister(&s.step_mr);
        }
        self.by_key.clear();
        self.held.clear();
    }
}
