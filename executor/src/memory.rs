//! Accounting of the tensors a task's steps hold: the bytes of the values produced in a step
//! and not yet released (the scheduler drops a value when its last reader finishes, see
//! [`crate::plan`]), their peak, and an optional limit that fails a step when it is passed.
//!
//! A value is counted once, by the node that produced it, unless it shares its buffer with one
//! of the node's inputs (an `Identity`, a reshape) or is a variable's value (the variable store
//! is counted on its own, [`crate::variables::VariableStore::bytes`]).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Live and peak bytes of the step values of one task (see the module docs).
#[derive(Debug, Default)]
pub struct MemoryMeter {
    live: AtomicUsize,
    peak: AtomicUsize,
    limit: Option<usize>,
}

/// A step would hold more than the meter's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverLimit {
    /// Bytes live with the new value.
    pub live: usize,
    /// The limit.
    pub limit: usize,
}

impl MemoryMeter {
    /// A meter failing steps whose values pass `limit` bytes (none: no limit).
    pub fn new(limit: Option<usize>) -> MemoryMeter {
        MemoryMeter {
            limit,
            ..MemoryMeter::default()
        }
    }

    /// Counts `bytes` more; an error when that passes the limit (the bytes stay counted until
    /// released).
    pub(crate) fn add(&self, bytes: usize) -> Result<(), OverLimit> {
        if bytes == 0 {
            return Ok(());
        }
        let live = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(live, Ordering::Relaxed);
        match self.limit {
            Some(limit) if live > limit => Err(OverLimit { live, limit }),
            _ => Ok(()),
        }
    }

    /// Releases `bytes` counted before.
    pub(crate) fn sub(&self, bytes: usize) {
        if bytes > 0 {
            self.live.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Bytes of step values held now.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// The most bytes of step values held at once since the meter started.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// The limit, if any.
    pub fn limit(&self) -> Option<usize> {
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_stays_when_values_are_released_and_the_limit_is_reported() {
        let m = MemoryMeter::new(Some(100));
        m.add(60).unwrap();
        m.add(30).unwrap();
        m.sub(60);
        assert_eq!((m.live(), m.peak()), (30, 90));
        assert_eq!(
            m.add(80),
            Err(OverLimit {
                live: 110,
                limit: 100
            })
        );
        m.sub(110);
        assert_eq!((m.live(), m.peak()), (0, 110));
    }
}
