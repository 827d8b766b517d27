//! What lives in the shared segments: a receive slot (a header with its credit state, then the
//! tensor's bytes) and a pair's doorbell ring (slot ids and steps the sender published).
//!
//! A slot's `state` word is its credit: `FREE` (the sender may write), `WRITING` (the sender
//! owns it), `FULL` (published, the receiver owns it until its last view is dropped, which sets
//! `FREE` again). Waits spin briefly, then sleep on a futex in the shared page in short rounds,
//! and always end at a deadline or when the caller's check fails (peer gone, closing).

use super::segment::Mapping;
use rustix::thread::futex;
use std::io;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The sender may write the slot.
pub const FREE: u32 = 0;
/// The sender is writing the slot.
pub const WRITING: u32 = 1;
/// The slot holds a published value the receiver has not released.
pub const FULL: u32 = 2;

const SLOT_MAGIC: u64 = u64::from_le_bytes(*b"DFLWSLOT");
const RING_MAGIC: u64 = u64::from_le_bytes(*b"DFLWRING");
const MAGIC_AT: usize = 0;
const LEN_AT: usize = 8;
const STATE_AT: usize = 16;
const WAITERS_AT: usize = 20;
const STEP_AT: usize = 24;
/// A slot's bytes start one page into its segment.
const DATA_AT: usize = 4096;

/// How long a waiter polls before it sleeps on the futex. It polls with `sched_yield`, not a
/// busy spin: the thread it waits for (the peer's producer or consumer) may need this very core,
/// and on a busy 2-core host a busy spin made every round trip pay one full spin (≈ 120 µs
/// instead of ≈ 15 µs in `dflow bench transfer --transport shm`).
pub const SPIN: Duration = Duration::from_micros(50);
/// Longest single futex sleep: every wait re-checks its deadline and its caller's check at least
/// this often.
const NAP: Duration = Duration::from_millis(10);

fn timespec(d: Duration) -> futex::Timespec {
    futex::Timespec {
        tv_sec: d.as_secs() as i64,
        tv_nsec: d.subsec_nanos() as _,
    }
}

/// Sleeps while `word` holds `expected`, at most `d` (wakes, timeouts and signals all return).
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, d: Duration) {
    // Shared (not PRIVATE): the word lives in memory mapped by two processes.
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&timespec(d)));
}

/// Wakes every sleeper on `word` (a shared futex).
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}

/// Why a wait ended without its condition.
#[derive(Debug)]
pub enum WaitError {
    /// The deadline passed.
    Timeout,
    /// The caller's check failed (its message).
    Cancelled(String),
}

/// One receive slot's segment, mapped.
#[derive(Debug)]
pub struct SlotMem {
    map: Mapping,
    len: usize,
}

impl SlotMem {
    fn total(len: usize) -> usize {
        DATA_AT + len.max(64)
    }

    /// Creates the segment for a `len`-byte slot, `FREE`.
    pub fn create(path: &Path, len: usize) -> io::Result<SlotMem> {
        let map = Mapping::create(path, Self::total(len))?;
        map.atomic_u64(LEN_AT).store(len as u64, Ordering::Relaxed);
        map.atomic_u64(MAGIC_AT)
            .store(SLOT_MAGIC, Ordering::Release);
        Ok(SlotMem { map, len })
    }

    /// Maps a peer's segment for a `len`-byte slot, checking its header.
    pub fn open(path: &Path, len: usize) -> Result<SlotMem, String> {
        let map = Mapping::open(path, Self::total(len)).map_err(|e| e.to_string())?;
        let (magic, got) = (
            map.atomic_u64(MAGIC_AT).load(Ordering::Acquire),
            map.atomic_u64(LEN_AT).load(Ordering::Relaxed),
        );
        if magic != SLOT_MAGIC || got != len as u64 {
            return Err(format!(
                "not a slot segment of {len} bytes (magic {magic:#x}, length {got})"
            ));
        }
        Ok(SlotMem { map, len })
    }

    /// The tensor's bytes (64-byte aligned).
    pub fn data(&self) -> NonNull<u8> {
        // SAFETY: DATA_AT < total length, so the pointer stays inside the mapping.
        unsafe { NonNull::new_unchecked(self.map.base().as_ptr().add(DATA_AT)) }
    }

    /// The slot's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty slot (a tensor with no elements).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole mapping (for address checks).
    pub fn mapping(&self) -> &Mapping {
        &self.map
    }

    /// The credit word.
    pub fn state(&self) -> &AtomicU32 {
        self.map.atomic_u32(STATE_AT)
    }

    /// The step of the last published value.
    pub fn step(&self) -> &AtomicU64 {
        self.map.atomic_u64(STEP_AT)
    }

    /// Publishes the value written for `step` (the sender holds `WRITING`).
    pub fn publish(&self, step: u64) {
        self.step().store(step, Ordering::Relaxed);
        self.state().store(FULL, Ordering::SeqCst);
    }

    /// Hands the slot back to the sender (the receiver dropped its last view) and wakes it.
    pub fn release(&self) {
        self.state().store(FREE, Ordering::SeqCst);
        if self.map.atomic_u32(WAITERS_AT).load(Ordering::SeqCst) != 0 {
            futex_wake_all(self.state());
        }
    }

    /// Waits until `ready(state)` holds, spinning for [`SPIN`] and then sleeping in short
    /// rounds; `check` runs every round and cancels the wait with its error. Returns the state
    /// that satisfied `ready`.
    pub fn wait(
        &self,
        ready: impl Fn(u32) -> bool,
        deadline: Instant,
        mut check: impl FnMut() -> Result<(), String>,
    ) -> Result<u32, WaitError> {
        let state = self.state();
        let spin_until = Instant::now() + SPIN;
        loop {
            let s = state.load(Ordering::SeqCst);
            if ready(s) {
                return Ok(s);
            }
            let now = Instant::now();
            if now < spin_until {
                std::thread::yield_now();
                continue;
            }
            check().map_err(WaitError::Cancelled)?;
            if now >= deadline {
                return Err(WaitError::Timeout);
            }
            let waiters = self.map.atomic_u32(WAITERS_AT);
            waiters.fetch_add(1, Ordering::SeqCst);
            if state.load(Ordering::SeqCst) == s {
                futex_wait(state, s, NAP.min(deadline - now));
            }
            waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Entries in a pair's ring: enough for every slot of a pair to have one published value
/// outstanding (credits bound that); a full ring makes the sender wait.
pub const RING_CAP: u64 = 4096;
const HEAD_AT: usize = 64;
const TAIL_AT: usize = 128;
const SEQ_AT: usize = 192;
const SLEEPING_AT: usize = 196;
const ENTRIES_AT: usize = 256;
const ENTRY: usize = 16;

/// The doorbell of one sender → receiver pair: a single-producer single-consumer ring of
/// `(slot id, step)` entries with a futex the consumer sleeps on.
#[derive(Debug)]
pub struct Ring {
    map: Mapping,
}

impl Ring {
    const TOTAL: usize = ENTRIES_AT + ENTRY * RING_CAP as usize;

    /// Creates the ring segment (the sender's side).
    pub fn create(path: &Path) -> io::Result<Ring> {
        let map = Mapping::create(path, Self::TOTAL)?;
        map.atomic_u64(MAGIC_AT)
            .store(RING_MAGIC, Ordering::Release);
        Ok(Ring { map })
    }

    /// Maps a peer's ring segment (the receiver's side), checking its header.
    pub fn open(path: &Path) -> Result<Ring, String> {
        let map = Mapping::open(path, Self::TOTAL).map_err(|e| e.to_string())?;
        if map.atomic_u64(MAGIC_AT).load(Ordering::Acquire) != RING_MAGIC {
            return Err("not a ring segment".into());
        }
        Ok(Ring { map })
    }

    fn head(&self) -> &AtomicU64 {
        self.map.atomic_u64(HEAD_AT)
    }

    fn tail(&self) -> &AtomicU64 {
        self.map.atomic_u64(TAIL_AT)
    }

    fn seq(&self) -> &AtomicU32 {
        self.map.atomic_u32(SEQ_AT)
    }

    fn entry(&self, i: u64) -> (&AtomicU32, &AtomicU64) {
        let at = ENTRIES_AT + ENTRY * (i % RING_CAP) as usize;
        (self.map.atomic_u32(at), self.map.atomic_u64(at + 8))
    }

    /// Appends `(slot, step)` and rings the doorbell. One producer at a time (the caller holds
    /// the pair's lock); waits for room until `deadline`, calling `check` as [`SlotMem::wait`].
    pub fn push(
        &self,
        slot: u32,
        step: u64,
        deadline: Instant,
        mut check: impl FnMut() -> Result<(), String>,
    ) -> Result<(), WaitError> {
        let head = self.head().load(Ordering::Relaxed);
        while head.wrapping_sub(self.tail().load(Ordering::Acquire)) >= RING_CAP {
            check().map_err(WaitError::Cancelled)?;
            if Instant::now() >= deadline {
                return Err(WaitError::Timeout);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        let (s, t) = self.entry(head);
        s.store(slot, Ordering::Relaxed);
        t.store(step, Ordering::Relaxed);
        self.head().store(head.wrapping_add(1), Ordering::SeqCst);
        self.seq().fetch_add(1, Ordering::SeqCst);
        if self.map.atomic_u32(SLEEPING_AT).load(Ordering::SeqCst) != 0 {
            futex_wake_all(self.seq());
        }
        Ok(())
    }

    /// Takes the next entry, if any (the consumer's side). An impossible head (more entries
    /// than the ring holds) is an error: the peer corrupted the ring.
    pub fn pop(&self) -> Result<Option<(u32, u64)>, String> {
        let tail = self.tail().load(Ordering::Relaxed);
        let head = self.head().load(Ordering::Acquire);
        if head == tail {
            return Ok(None);
        }
        if head.wrapping_sub(tail) > RING_CAP {
            return Err(format!(
                "ring head {head} is ahead of tail {tail} by more than {RING_CAP}"
            ));
        }
        let (s, t) = self.entry(tail);
        let entry = (s.load(Ordering::Relaxed), t.load(Ordering::Relaxed));
        self.tail().store(tail.wrapping_add(1), Ordering::Release);
        Ok(Some(entry))
    }

    /// Waits for an entry: spins for `spin`, then sleeps on the doorbell at most `nap`. Returns
    /// early once `stop` is set: a consumer told to stop (set `stop`, then [`Ring::wake`]) never
    /// sleeps out its nap, even when the wake comes just before it goes to sleep.
    pub fn wait(&self, spin: Duration, nap: Duration, stop: &AtomicBool) {
        let until = Instant::now() + spin;
        let tail = self.tail().load(Ordering::Relaxed);
        while Instant::now() < until {
            if self.head().load(Ordering::Acquire) != tail || stop.load(Ordering::SeqCst) {
                return;
            }
            std::thread::yield_now();
        }
        let sleeping = self.map.atomic_u32(SLEEPING_AT);
        sleeping.store(1, Ordering::SeqCst);
        let seq = self.seq().load(Ordering::SeqCst);
        // `stop` is read after `seq`: a wake after this read changes `seq` and the futex returns
        // at once; a wake before it comes after its `stop` store, which this load then sees.
        if self.head().load(Ordering::SeqCst) == tail && !stop.load(Ordering::SeqCst) {
            futex_wait(self.seq(), seq, nap);
        }
        sleeping.store(0, Ordering::SeqCst);
    }

    /// Wakes a consumer sleeping in [`Ring::wait`] (to make it notice it should stop: set its
    /// `stop` flag first).
    pub fn wake(&self) {
        self.seq().fetch_add(1, Ordering::SeqCst);
        futex_wake_all(self.seq());
    }
}

#[cfg(test)]
mod tests {
    use super::super::segment::{new_name, shm_dir};
    use super::*;

    #[test]
    fn credits_and_ring_across_two_mappings() {
        let sp = shm_dir().join(new_name("test-slot"));
        let sender = SlotMem::create(&sp, 100).unwrap();
        let receiver = SlotMem::open(&sp, 100).unwrap();
        assert!(SlotMem::open(&sp, 99).is_err());
        std::fs::remove_file(&sp).unwrap();
        assert_eq!(sender.data().as_ptr() as usize % 64, 0);

        // The sender waits for the receiver's release; a check can cancel the wait.
        sender.state().store(WRITING, Ordering::SeqCst);
        sender.publish(7);
        assert_eq!(receiver.state().load(Ordering::SeqCst), FULL);
        assert_eq!(receiver.step().load(Ordering::SeqCst), 7);
        let far = Instant::now() + Duration::from_secs(10);
        let err = sender.wait(|s| s == FREE, far, || Err("peer gone".into()));
        assert!(matches!(err, Err(WaitError::Cancelled(m)) if m == "peer gone"));
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(matches!(
            sender.wait(|s| s == FREE, soon, || Ok(())),
            Err(WaitError::Timeout)
        ));
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                receiver.release();
            });
            assert_eq!(sender.wait(|s| s == FREE, far, || Ok(())).unwrap(), FREE);
        });

        let rp = shm_dir().join(new_name("test-ring"));
        let producer = Ring::create(&rp).unwrap();
        let consumer = Ring::open(&rp).unwrap();
        std::fs::remove_file(&rp).unwrap();
        assert_eq!(consumer.pop().unwrap(), None);
        let no_stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                producer.push(3, 11, far, || Ok(())).unwrap();
            });
            let got = loop {
                match consumer.pop().unwrap() {
                    Some(e) => break e,
                    None => consumer.wait(SPIN, Duration::from_millis(500), &no_stop),
                }
            };
            assert_eq!(got, (3, 11));
        });
        // A stopped consumer does not sleep out its nap: neither when told before it sleeps
        // nor while it sleeps.
        let stop = AtomicBool::new(true);
        let t0 = Instant::now();
        consumer.wait(SPIN, Duration::from_secs(5), &stop);
        assert!(t0.elapsed() < Duration::from_secs(2));
        stop.store(false, Ordering::SeqCst);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                stop.store(true, Ordering::SeqCst);
                consumer.wake();
            });
            let t0 = Instant::now();
            while !stop.load(Ordering::SeqCst) {
                consumer.wait(SPIN, Duration::from_secs(5), &stop);
                assert!(t0.elapsed() < Duration::from_secs(2));
            }
        });
        // A full ring makes the producer wait (and time out here).
        for i in 0..RING_CAP {
            producer.push(1, i, far, || Ok(())).unwrap();
        }
        assert!(matches!(
            producer.push(1, 0, soon, || Ok(())),
            Err(WaitError::Timeout)
        ));
        assert_eq!(consumer.pop().unwrap(), Some((1, 0)));
    }
}
