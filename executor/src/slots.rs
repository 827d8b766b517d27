//! The value slots of one step: plain cells, each written by one node and read by its
//! consumers, with the hand-over ordered by the scheduler's pending counts.
//!
//! A `OnceLock` per slot cost two atomic read-modify-writes per value (its state goes through
//! "running" to "complete"), about a sixth of a scalar node's time. The scheduler already
//! orders every write before every read of a slot, so the cells need no synchronisation of
//! their own:
//!
//! 1. Slot `k` belongs to the one node that produces it. That node runs once per step; while it
//!    runs it alone touches its slots ([`ValueSlots::outputs_mut`]).
//! 2. A node reads slot `k` ([`ValueSlots::get`]) only if it consumes `k`, i.e. it is a
//!    successor of `k`'s producer, and it runs only after every predecessor has finished: the
//!    producer's `fetch_sub` (Release) on the consumer's pending count, or the hand-over to the
//!    consumer on the same thread or through the compute pool (which synchronises), happens
//!    after the write and before the read. A `Recv`'s callback writes its slot before it hands
//!    the node's completion to the pool.
//! 3. The cells are emptied only through `&mut` ([`ValueSlots::clear`]), once the step's state
//!    is no longer shared.
//!
//! Rule 1 and 2 are the scheduler's invariants (each node runs at most once per step, after its
//! predecessors); `step.rs` is the only caller of the two `unsafe` functions.

use dflow_graph::Tensor;
use std::cell::UnsafeCell;

/// The value slots of one step (see the module docs for the access protocol).
pub(crate) struct ValueSlots {
    cells: Box<[UnsafeCell<Option<Tensor>>]>,
}

// SAFETY: shared access follows the protocol of the module docs: a cell is written only by its
// producer before it publishes it (Release), and read only after that publication (Acquire) by
// consumers, so no cell is written while it is read or written elsewhere. `Tensor` is `Send +
// Sync`, so handing references to it between threads is sound.
unsafe impl Sync for ValueSlots {}

impl ValueSlots {
    /// `n` empty slots.
    pub(crate) fn new(n: usize) -> Self {
        ValueSlots {
            cells: (0..n).map(|_| UnsafeCell::new(None)).collect(),
        }
    }

    /// Number of slots.
    pub(crate) fn len(&self) -> usize {
        self.cells.len()
    }

    /// Writes slot `k` (before the step starts: `&mut` is exclusive). Panics when `k` is out of
    /// range.
    pub(crate) fn set(&mut self, k: usize, value: Tensor) {
        *self.cells[k].get_mut() = Some(value);
    }

    /// Empties every slot (dropping the values: their memory and transport slots are released).
    pub(crate) fn clear(&mut self) {
        for c in self.cells.iter_mut() {
            *c.get_mut() = None;
        }
    }

    /// The value in slot `k`, if one was written. Panics when `k` is out of range.
    ///
    /// # Safety
    ///
    /// The write of slot `k` in this step, if any, happens before this call (the caller runs
    /// after `k`'s producer finished, see the module docs), and no write to `k` happens while
    /// the returned reference lives.
    #[inline]
    pub(crate) unsafe fn get(&self, k: usize) -> Option<&Tensor> {
        // SAFETY: the caller guarantees that no write to this cell is concurrent with, or
        // follows, this read while the reference lives.
        unsafe { (*self.cells[k].get()).as_ref() }
    }

    /// Takes the value out of slot `k` (its last reader finished). Panics when `k` is out of
    /// range.
    ///
    /// # Safety
    ///
    /// Slot `k`'s producer and every node that reads `k` in this step have finished, and their
    /// accesses happen before this call (the caller holds the last of the read counts); nothing
    /// reads or writes `k` again in this step.
    #[inline]
    pub(crate) unsafe fn take(&self, k: usize) -> Option<Tensor> {
        // SAFETY: the caller guarantees exclusive access to this cell from now on.
        unsafe { (*self.cells[k].get()).take() }
    }

    /// Slots `base..base + n`, writable. Panics when the range is out of bounds.
    ///
    /// # Safety
    ///
    /// The caller is the node that produces these slots, running: nothing else reads or writes
    /// them until it has finished and notified its successors, and it calls this once per step.
    #[inline]
    // `&mut` from `&self` is the point of the cells: exclusivity is the caller's obligation.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn outputs_mut(&self, base: usize, n: usize) -> &mut [Option<Tensor>] {
        let cells = &self.cells[base..base + n];
        // SAFETY: `UnsafeCell<T>` has the layout of `T`, so the cells are `n` contiguous
        // `Option<Tensor>`s; the caller guarantees that no other reference to them exists while
        // the returned one lives.
        unsafe { std::slice::from_raw_parts_mut(UnsafeCell::raw_get(cells.as_ptr()), n) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[test]
    fn written_values_are_read_and_cleared() {
        let mut slots = ValueSlots::new(3);
        // SAFETY: one thread: the write (as producer of 1..3) precedes the reads.
        unsafe {
            let out = slots.outputs_mut(1, 2);
            out[0] = Some(Tensor::scalar(1.0f32));
            out[1] = Some(Tensor::scalar(2i32));
            assert!(slots.get(0).is_none());
            assert_eq!(slots.get(1), Some(&Tensor::scalar(1.0f32)));
            assert_eq!(slots.get(2), Some(&Tensor::scalar(2i32)));
        }
        slots.clear();
        // SAFETY: as above.
        unsafe {
            assert!((0..3).all(|k| slots.get(k).is_none()));
        }
        assert_eq!(slots.len(), 3);
    }

    /// The scheduler's protocol between threads: producers write their slot then decrement the
    /// consumer's pending count (Release); whoever brings it to zero (Acquire) reads every
    /// slot. Run many times so that a missing ordering would show as a wrong or missing value
    /// (and under Miri or a thread sanitizer as a race).
    #[test]
    fn the_pending_count_hands_values_between_threads() {
        for round in 0..200 {
            let slots = Arc::new(ValueSlots::new(4));
            let pending = Arc::new(AtomicU32::new(4));
            let handles: Vec<_> = (0..4)
                .map(|k| {
                    let (slots, pending) = (slots.clone(), pending.clone());
                    std::thread::spawn(move || {
                        // SAFETY: thread k is the only producer of slot k, once.
                        unsafe {
                            slots.outputs_mut(k, 1)[0] = Some(Tensor::scalar((round + k) as i64));
                        }
                        if pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                            // SAFETY: every producer decremented after writing; this is the
                            // last decrement, so every write happens before these reads.
                            let sum: i64 = (0..4)
                                .map(|j| unsafe { slots.get(j) }.expect("written"))
                                .map(|t| t.as_slice::<i64>().expect("i64")[0])
                                .sum();
                            Some(sum)
                        } else {
                            None
                        }
                    })
                })
                .collect();
            let sums: Vec<i64> = handles
                .into_iter()
                .filter_map(|h| h.join().expect("no panic"))
                .collect();
            assert_eq!(sums, [4 * round as i64 + 6]);
        }
    }
}
