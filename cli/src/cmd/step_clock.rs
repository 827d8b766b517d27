//! The wall time between consecutive completed training steps, as the chief sees them, and its
//! median: a steady step, which `trained N steps in T s` (the mean, with the first step's
//! warm-up and every stall of a shared machine in it) is not. `dflow bench calibrate` fits and
//! `tests/planner/steptime_table.sh` compares the planner's prediction with this median.

use std::time::{Duration, Instant};

/// Intervals a [`StepClock`] keeps: the most recent, so that a run of millions of steps holds
/// 1 MiB of them, not 16 bytes a step.
pub const KEPT_INTERVALS: usize = 1 << 16;

/// Completion instants of a run's steps (the last [`KEPT_INTERVALS`] intervals between them).
#[derive(Debug, Default)]
pub struct StepClock {
    last: Option<Instant>,
    intervals: Vec<Duration>,
    /// Where the next interval goes once `intervals` is full (the oldest one).
    next: usize,
}

/// The distribution of a run's step intervals.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    /// Intervals the median is of (steps less one, at most [`KEPT_INTERVALS`]: the latest).
    pub count: usize,
    /// Their median.
    pub median: Duration,
    /// Their 10th and 90th percentiles.
    pub p10: Duration,
    /// See [`StepTimes::p10`].
    pub p90: Duration,
}

impl StepClock {
    /// A step completed now.
    pub fn tick(&mut self) {
        self.tick_at(Instant::now());
    }

    /// A step completed at `now`.
    pub fn tick_at(&mut self, now: Instant) {
        if let Some(last) = self.last {
            let d = now.saturating_duration_since(last);
            if self.intervals.len() < KEPT_INTERVALS {
                self.intervals.push(d);
            } else {
                self.intervals[self.next] = d;
                self.next = (self.next + 1) % KEPT_INTERVALS;
            }
        }
        self.last = Some(now);
    }

    /// The intervals' median and percentiles; `None` before two steps.
    pub fn times(&self) -> Option<StepTimes> {
        let mut v = self.intervals.clone();
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        let at = |q: usize| v[(v.len() - 1) * q / 100];
        Some(StepTimes {
            count: v.len(),
            median: at(50),
            p10: at(10),
            p90: at(90),
        })
    }
}

impl std::fmt::Display for StepTimes {
    /// `step time: median 412.3 µs (p10 380.1, p90 1,494.0) over 999 steps`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        write!(
            f,
            "step time: median {:.1} µs (p10 {:.1}, p90 {:.1}) over {} steps",
            us(self.median),
            us(self.p10),
            us(self.p90),
            self.count
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_of_the_intervals_between_steps_and_ignores_a_stall() {
        let mut c = StepClock::default();
        assert_eq!(c.times(), None);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // A 30 ms first step (warm-up) is not an interval; one 50 ms stall among 1 ms steps.
        c.tick_at(t0 + ms(30));
        assert_eq!(c.times(), None, "one step has no interval");
        let mut t = t0 + ms(30);
        for i in 0..9 {
            t += if i == 4 { ms(50) } else { ms(1) };
            c.tick_at(t);
        }
        let s = c.times().unwrap();
        assert_eq!(s.count, 9);
        assert_eq!(s.median, ms(1));
        assert_eq!(s.p10, ms(1));
        assert_eq!(s.p90, ms(1), "the 90th percentile of 9 is the 8th");
        assert_eq!(
            s.to_string(),
            "step time: median 1000.0 µs (p10 1000.0, p90 1000.0) over 9 steps"
        );
    }

    #[test]
    fn a_long_run_keeps_only_the_latest_intervals() {
        let mut c = StepClock::default();
        let mut t = Instant::now();
        c.tick_at(t);
        // More 3 ms intervals than are kept, then as many 1 ms ones: only the latter remain.
        for i in 0..2 * KEPT_INTERVALS {
            t += Duration::from_millis(if i < KEPT_INTERVALS + 10 { 3 } else { 1 });
            c.tick_at(t);
        }
        let s = c.times().unwrap();
        assert_eq!(s.count, KEPT_INTERVALS);
        assert_eq!(s.median, Duration::from_millis(1));
        assert_eq!(s.p90, Duration::from_millis(1));
        assert_eq!(
            c.intervals.len(),
            KEPT_INTERVALS,
            "no interval beyond the kept ones"
        );
    }
}
