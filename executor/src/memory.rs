//! Accounting of the tensors a task's steps hold: the bytes of the values produced in a step
//! and not yet released (the scheduler drops a value when its last reader finishes, see
//! [`crate::plan`]), their peak, and an optional limit that fails a step when it is passed.
//!
//! [`fits`] is the check before the first step: a task's variables plus its largest step
//! tensor, against the limit.
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
    /// The bytes of the task's variables, counted against the limit with the step tensors.
    resident: AtomicUsize,
    limit: Option<usize>,
}

/// A step would hold more than the meter's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverLimit {
    /// Bytes live with the new value (variables included).
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
        let total = live.saturating_add(self.resident.load(Ordering::Relaxed));
        match self.limit {
            Some(limit) if total > limit => Err(OverLimit { live: total, limit }),
            _ => Ok(()),
        }
    }

    /// Releases `bytes` counted before.
    pub(crate) fn sub(&self, bytes: usize) {
        if bytes > 0 {
            self.live.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Sets the bytes of the task's variables, counted against the limit with the step values.
    pub fn set_resident(&self, bytes: usize) {
        self.resident.store(bytes, Ordering::Relaxed);
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
        // The variables count against the limit too.
        m.set_resident(90);
        assert_eq!(
            m.add(20),
            Err(OverLimit {
                live: 110,
                limit: 100
            })
        );
    }
}

/// What a task needs at least: its variables (name, bytes) and its largest step tensor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Every variable the task holds and its bytes.
    pub variables: Vec<(String, usize)>,
    /// The biggest tensor one of its steps produces (node, bytes), from the static shapes.
    pub largest_tensor: Option<(String, usize)>,
}

impl Footprint {
    /// The bytes of the variables.
    pub fn variable_bytes(&self) -> usize {
        self.variables.iter().map(|(_, b)| b).sum()
    }

    /// Variables plus the largest step tensor.
    pub fn total(&self) -> usize {
        self.variable_bytes() + self.largest_tensor.as_ref().map_or(0, |(_, b)| *b)
    }
}

/// Checks `need` (task `task`'s footprint) against `limit`: the error names the biggest
/// consumers and what to do.
pub fn fits(task: &str, need: &Footprint, limit: usize) -> Result<(), String> {
    if need.total() <= limit {
        return Ok(());
    }
    let mut biggest = need.variables.clone();
    biggest.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let shown: Vec<String> = biggest
        .iter()
        .take(5)
        .map(|(n, b)| format!("`{n}` {b} B"))
        .collect();
    let largest = match &need.largest_tensor {
        Some((n, b)) => format!("; its largest step tensor is `{n}`, {b} B"),
        None => String::new(),
    };
    Err(format!(
        "task {task} cannot fit in --memory-limit {limit} bytes: it needs at least {} bytes, \
         {} in {} variables (biggest: {}){largest}. Shard the training state over more \
         workers (--strategy zero --zero-stage 3 shards parameters, gradients and Adam state; \
         --zero-stage 1 or 2 only part of it), or raise --memory-limit",
        need.total(),
        need.variable_bytes(),
        need.variables.len(),
        shown.join(", ")
    ))
}

#[cfg(test)]
mod fit_tests {
    use super::*;

    #[test]
    fn a_footprint_over_the_limit_names_the_biggest_variables_and_the_largest_tensor() {
        let need = Footprint {
            variables: vec![
                ("b".into(), 40),
                ("w".into(), 4000),
                ("w/adam_m".into(), 4000),
            ],
            largest_tensor: Some(("zero/w/forward".into(), 4000)),
        };
        assert_eq!(need.total(), 12_040);
        assert!(fits("/job:worker/replica:0/task:1", &need, 12_040).is_ok());
        let e = fits("/job:worker/replica:0/task:1", &need, 12_039).unwrap_err();
        assert!(
            e.contains("task /job:worker/replica:0/task:1 cannot fit in --memory-limit 12039"),
            "{e}"
        );
        assert!(
            e.contains("biggest: `w` 4000 B, `w/adam_m` 4000 B, `b` 40 B"),
            "{e}"
        );
        assert!(
            e.contains("largest step tensor is `zero/w/forward`, 4000 B"),
            "{e}"
        );
        assert!(e.contains("--strategy zero --zero-stage 3"), "{e}");
    }
}
