//! The per-step arrays of a plan (pending counts and value slots), recycled from one step to
//! the next.
//!
//! A 10,000-node plan needs about 700 KB of them per step. Allocating them afresh each step
//! made the allocator hand fresh pages back and forth with the kernel (page faults and zeroing
//! were a sixth of a scalar chain's time); a step now takes a spare set from its plan and gives
//! it back, emptied, when it ends. At most [`MAX_SPARE`] sets wait, so concurrent steps cost
//! memory only while they run.

use crate::slots::ValueSlots;
use std::fmt;
use std::sync::atomic::AtomicU32;
use std::sync::Mutex;

/// Spare sets kept per plan (a step's state may still be draining while the next one starts).
const MAX_SPARE: usize = 4;

/// The arrays one step of a plan works on.
pub(crate) struct StepArrays {
    /// Per node, the count of predecessors not finished yet.
    pub(crate) pending: Box<[AtomicU32]>,
    /// Per output slot, its value once produced.
    pub(crate) values: ValueSlots,
    /// Per counted slot (see [`crate::plan::Release`]), the reads left.
    pub(crate) reads: Box<[AtomicU32]>,
}

/// Spare [`StepArrays`] of one plan.
#[derive(Default)]
pub(crate) struct Arena {
    spare: Mutex<Vec<StepArrays>>,
}

impl fmt::Debug for Arena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.spare.lock().map_or(0, |s| s.len());
        write!(f, "Arena({n} spare)")
    }
}

impl Arena {
    /// Arrays for a new step: pending counts set to `initial`, `num_slots` empty slots, read
    /// counts set to `reads`.
    pub(crate) fn take(&self, initial: &[u32], num_slots: usize, reads: &[u32]) -> StepArrays {
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match spare {
            Some(mut a)
                if a.pending.len() == initial.len()
                    && a.values.len() == num_slots
                    && a.reads.len() == reads.len() =>
            {
                for (p, &c) in a.pending.iter_mut().zip(initial) {
                    *p.get_mut() = c;
                }
                for (p, &c) in a.reads.iter_mut().zip(reads) {
                    *p.get_mut() = c;
                }
                a
            }
            _ => StepArrays {
                pending: initial.iter().map(|&c| AtomicU32::new(c)).collect(),
                values: ValueSlots::new(num_slots),
                reads: reads.iter().map(|&c| AtomicU32::new(c)).collect(),
            },
        }
    }

    /// Takes back the arrays of a finished step: drops its values (releasing their memory,
    /// transport slots included) and keeps the arrays for a later step.
    pub(crate) fn give_back(&self, mut a: StepArrays) {
        a.values.clear();
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < MAX_SPARE {
            spare.push(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::Tensor;
    use std::sync::atomic::Ordering;

    #[test]
    fn recycled_arrays_start_like_new_ones() {
        let arena = Arena::default();
        let a = arena.take(&[0, 2, 1], 2, &[]);
        a.pending[1].fetch_sub(2, Ordering::AcqRel);
        // SAFETY: one thread, the only user of slot 0.
        unsafe { a.values.outputs_mut(0, 1)[0] = Some(Tensor::scalar(1.0f32)) };
        let ptr = a.pending.as_ptr();
        arena.give_back(a);
        let b = arena.take(&[0, 2, 1], 2, &[]);
        assert_eq!(b.pending.as_ptr(), ptr, "the same arrays, reused");
        let counts: Vec<u32> = b
            .pending
            .iter()
            .map(|p| p.load(Ordering::Relaxed))
            .collect();
        assert_eq!(counts, [0, 2, 1]);
        // SAFETY: one thread, nothing writes.
        assert!((0..2).all(|k| unsafe { b.values.get(k) }.is_none()));
        // Arrays of another size are not reused.
        arena.give_back(b);
        let c = arena.take(&[0], 1, &[]);
        assert_eq!((c.pending.len(), c.values.len()), (1, 1));
    }
}
