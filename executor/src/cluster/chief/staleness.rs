//! Bounded staleness for the independent schedule (async ps, `--staleness S`): the
//! stale-synchronous-parallel rule. A worker may start a step only while it has completed fewer
//! than `S` steps more than the slowest worker still training, so no worker is ever more than
//! `S` steps ahead of it (the gradients a worker applies were computed at most `S` of its own
//! steps after the slowest worker's). A worker whose loop ended (no steps left) no longer
//! counts as the slowest.

use crate::cluster::node::JobError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;

/// The longest a worker waits for the slowest to finish a step before the job fails naming it.
pub(super) const WAIT_LIMIT: Duration = Duration::from_secs(600);

/// Steps completed per worker, and the bound.
#[derive(Debug)]
pub(super) struct Clocks {
    bound: u64,
    /// Steps each worker completed; `None` once its loop ended.
    done: Mutex<Vec<Option<u64>>>,
    changed: Notify,
    max_lead: AtomicU64,
}

impl Clocks {
    /// `workers` workers at step 0, at most `bound` (≥ 1) steps apart.
    pub(super) fn new(workers: usize, bound: u64) -> Clocks {
        Clocks {
            bound,
            done: Mutex::new(vec![Some(0); workers]),
            changed: Notify::new(),
            max_lead: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Option<u64>>> {
        self.done.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// (worker `w`'s completed steps, the slowest training worker and its steps).
    fn position(done: &[Option<u64>], w: usize) -> (u64, usize, u64) {
        let mine = done.get(w).copied().flatten().unwrap_or(0);
        let (slowest, min) = done
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.map(|d| (i, d)))
            .min_by_key(|&(i, d)| (d, i))
            .unwrap_or((w, mine));
        (mine, slowest, min)
    }

    /// Waits until worker `w` may start a step (it would then be at most `bound` steps ahead of
    /// the slowest), at most `limit`.
    pub(super) async fn wait_turn(&self, w: usize, limit: Duration) -> Result<(), JobError> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (mine, slowest, min) = Self::position(&self.lock(), w);
            if mine + 1 - min <= self.bound {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(JobError::Setup(format!(
                    "--staleness {}: worker {w} waited {} s for worker {slowest}, the slowest \
                     (at step {min}, worker {w} at step {mine}), to finish a step; is worker \
                     {slowest} stuck?",
                    self.bound,
                    limit.as_secs()
                )));
            }
        }
    }

    /// Worker `w` completed a step; returns its lead over the slowest worker.
    pub(super) fn step_done(&self, w: usize) -> u64 {
        let lead = {
            let mut done = self.lock();
            if let Some(Some(d)) = done.get_mut(w) {
                *d += 1;
            }
            let (mine, slowest, min) = Self::position(&done, w);
            tracing::debug!(
                worker = w,
                steps = mine,
                slowest,
                slowest_steps = min,
                "ssp: step done"
            );
            mine - min
        };
        self.max_lead.fetch_max(lead, Ordering::Relaxed);
        self.changed.notify_waiters();
        lead
    }

    /// Worker `w`'s loop ended: it no longer holds the others back.
    pub(super) fn finished(&self, w: usize) {
        if let Some(d) = self.lock().get_mut(w) {
            *d = None;
        }
        self.changed.notify_waiters();
    }

    /// The largest lead any worker had over the slowest.
    pub(super) fn max_lead(&self) -> u64 {
        self.max_lead.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_fast_worker_waits_for_the_slowest_within_the_bound() {
        let c = Arc::new(Clocks::new(2, 2));
        // Worker 0 may run 2 steps ahead, then must wait.
        for _ in 0..2 {
            c.wait_turn(0, Duration::from_millis(50)).await.unwrap();
            c.step_done(0);
        }
        let e = c
            .wait_turn(0, Duration::from_millis(50))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("worker 1, the slowest") && e.contains("--staleness 2"),
            "{e}"
        );
        // Worker 1 finishing a step lets worker 0 go on.
        let waiter = {
            let c = c.clone();
            tokio::spawn(async move { c.wait_turn(0, Duration::from_secs(5)).await })
        };
        c.step_done(1);
        waiter.await.unwrap().unwrap();
        assert_eq!(c.max_lead(), 2);
        // A worker whose loop ended does not hold the others back.
        c.finished(1);
        for _ in 0..5 {
            c.wait_turn(0, Duration::from_millis(50)).await.unwrap();
            c.step_done(0);
        }
    }
}
