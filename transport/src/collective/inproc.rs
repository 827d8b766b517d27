//! The in-process backend: ranks are threads of one process, each directed pair of ranks shares
//! a bounded byte ring, and each rank sleeps on its own condition variable until a peer wrote to
//! it or drained its ring. Used by tests and by one-process runs with several ranks.

use super::pairs::{LinkError, Pairs};
use std::io::IoSlice;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// Capacity of each directed ring.
const RING_BYTES: usize = 1 << 20;

#[derive(Debug)]
struct Ring {
    buf: Vec<u8>,
    head: usize,
    len: usize,
    /// Either end dropped.
    closed: bool,
}

impl Ring {
    fn write(&mut self, mut data: &[u8]) -> usize {
        let cap = self.buf.len();
        let mut n = 0;
        while !data.is_empty() && self.len < cap {
            let tail = (self.head + self.len) % cap;
            let room = (cap - self.len).min(cap - tail).min(data.len());
            self.buf[tail..tail + room].copy_from_slice(&data[..room]);
            self.len += room;
            data = &data[room..];
            n += room;
        }
        n
    }

    fn read(&mut self, out: &mut [u8]) -> usize {
        let cap = self.buf.len();
        let mut n = 0;
        while n < out.len() && self.len > 0 {
            let take = self.len.min(cap - self.head).min(out.len() - n);
            out[n..n + take].copy_from_slice(&self.buf[self.head..self.head + take]);
            self.head = (self.head + take) % cap;
            self.len -= take;
            n += take;
        }
        n
    }
}

#[derive(Debug, Default)]
struct Signal {
    events: Mutex<u64>,
    cv: Condvar,
}

impl Signal {
    fn notify(&self) {
        *lock(&self.events) += 1;
        self.cv.notify_all();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves the ring consistent (plain copies); go on.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One rank's end of an in-process group. Dropping it closes its links: peers see
/// [`LinkError::Closed`], as they would see a dead process over TCP.
#[derive(Debug)]
pub struct InProcPairs {
    rank: usize,
    /// `rings[from][to]`, shared by the whole group.
    rings: Arc<Vec<Vec<Mutex<Ring>>>>,
    signals: Arc<Vec<Signal>>,
    seen: u64,
}

impl InProcPairs {
    /// One endpoint per rank of a group of `size` ranks (hand one to each thread).
    pub fn group(size: usize) -> Vec<InProcPairs> {
        let rings: Vec<Vec<Mutex<Ring>>> = (0..size)
            .map(|from| {
                (0..size)
                    .map(|to| {
                        Mutex::new(Ring {
                            buf: if from == to {
                                Vec::new()
                            } else {
                                vec![0; RING_BYTES]
                            },
                            head: 0,
                            len: 0,
                            closed: false,
                        })
                    })
                    .collect()
            })
            .collect();
        let rings = Arc::new(rings);
        let signals = Arc::new((0..size).map(|_| Signal::default()).collect::<Vec<_>>());
        (0..size)
            .map(|rank| InProcPairs {
                rank,
                rings: rings.clone(),
                signals: signals.clone(),
                seen: 0,
            })
            .collect()
    }
}

impl Pairs for InProcPairs {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.signals.len()
    }

    fn try_write(&mut self, peer: usize, bufs: &[IoSlice<'_>]) -> Result<usize, LinkError> {
        let mut ring = lock(&self.rings[self.rank][peer]);
        if ring.closed {
            return Err(LinkError::Closed);
        }
        let mut n = 0;
        for b in bufs {
            let w = ring.write(b);
            n += w;
            if w < b.len() {
                break;
            }
        }
        drop(ring);
        if n > 0 {
            self.signals[peer].notify();
        }
        Ok(n)
    }

    fn try_read(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize, LinkError> {
        let mut ring = lock(&self.rings[peer][self.rank]);
        let n = ring.read(buf);
        if n == 0 && ring.closed && !buf.is_empty() {
            return Err(LinkError::Closed);
        }
        drop(ring);
        if n > 0 {
            self.signals[peer].notify();
        }
        Ok(n)
    }

    fn wait(&mut self, until: Instant) -> Result<(), LinkError> {
        let signal = &self.signals[self.rank];
        let mut events = lock(&signal.events);
        while *events == self.seen {
            let now = Instant::now();
            if now >= until {
                break;
            }
            events = signal
                .cv
                .wait_timeout(events, until - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        self.seen = *events;
        Ok(())
    }

    fn describe(&self, peer: usize) -> String {
        format!("in-process rank {peer}")
    }
}

impl Drop for InProcPairs {
    fn drop(&mut self) {
        for peer in 0..self.size() {
            if peer == self.rank {
                continue;
            }
            lock(&self.rings[self.rank][peer]).closed = true;
            lock(&self.rings[peer][self.rank]).closed = true;
            self.signals[peer].notify();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_wraps_and_bounds() {
        let mut r = Ring {
            buf: vec![0; 5],
            head: 0,
            len: 0,
            closed: false,
        };
        assert_eq!(r.write(b"abcdefg"), 5);
        let mut out = [0u8; 3];
        assert_eq!(r.read(&mut out), 3);
        assert_eq!(&out, b"abc");
        assert_eq!(r.write(b"xyz"), 3);
        let mut out = [0u8; 8];
        assert_eq!(r.read(&mut out), 5);
        assert_eq!(&out[..5], b"dexyz");
    }

    #[test]
    fn dropped_rank_reads_as_closed() {
        let mut g = InProcPairs::group(2);
        let b = g.pop();
        drop(b);
        let mut buf = [0u8; 4];
        assert!(matches!(g[0].try_read(1, &mut buf), Err(LinkError::Closed)));
        assert!(matches!(
            g[0].try_write(1, &[IoSlice::new(b"x")]),
            Err(LinkError::Closed)
        ));
    }
}
