//! The shared-memory backend, for ranks that are processes of one host: every rank creates one
//! segment under `/dev/shm` holding a byte ring per peer (what that peer sends it), maps every
//! other rank's segment to write into its ring there, and sleeps on a futex doorbell in its own
//! segment. A transfer is one copy into the ring by the sender and one copy out by the receiver,
//! no system call while both run; the framing, aborts and timeouts above are the same as over
//! TCP ([`super::Channel`]).
//!
//! Segments reuse the data plane's machinery ([`crate::shm::segment`]): names carry the
//! creator's pid, a rank unlinks its own name once every peer has attached (so after set-up a
//! crash leaves nothing under `/dev/shm`), and names left by processes that died during set-up
//! are swept by the next rendezvous on the host. Waits sleep on the futex at once (small calls
//! poll above, in the channel; polling here measured slower for large ones) in short naps;
//! each nap checks that the peers' processes are alive, so a killed rank is seen as
//! a closed link within [`NAP`]. A dropped rank marks its rings closed.
//!
//! Trust: as with the data plane's segments, a process of the same job can write the rings at
//! any time; ring positions read from shared memory are checked, so a corrupt peer yields a
//! link error, never an access outside the mapping.

use super::error::{CollectiveError, Result};
use super::pairs::{connect_on_threads, LinkError, Pairs};
use crate::shm::segment::{checked_path, new_name, sweep_dead, Mapping};
use crate::shm::slot::{futex_wait, futex_wake_all};
use std::io::{self, IoSlice};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const MAGIC: u64 = u64::from_le_bytes(*b"DFLWCOLL");
const VERSION: u32 = 1;
/// Segment header: identity, then the doorbell and its sleeper count on their own lines.
const MAGIC_AT: usize = 0;
const VERSION_AT: usize = 8;
const SIZE_AT: usize = 12;
const RANK_AT: usize = 16;
const PID_AT: usize = 20;
const CAP_AT: usize = 24;
const DOORBELL_AT: usize = 64;
const SLEEPERS_AT: usize = 128;
const HEADER: usize = 4096;
/// Ring header: the writer's line (head, attached, closed), then the reader's (tail, closed).
const HEAD_AT: usize = 0;
const ATTACHED_AT: usize = 64;
const WCLOSED_AT: usize = 68;
const TAIL_AT: usize = 128;
const RCLOSED_AT: usize = 192;
const RING_HEADER: usize = 256;

/// Longest futex sleep: peers' liveness and the caller's deadline are checked this often.
pub const NAP: Duration = Duration::from_millis(10);

/// Settings of the shared-memory backend.
#[derive(Debug, Clone)]
pub struct ShmOptions {
    /// Bytes of each ring (one per ordered pair of ranks; a multiple of 4096, default 4 MiB).
    /// Every rank's segment holds `size - 1` of them.
    pub ring_bytes: usize,
    /// Set-up fails after this long (default 30 s).
    pub connect_timeout: Duration,
}

impl Default for ShmOptions {
    fn default() -> ShmOptions {
        ShmOptions {
            ring_bytes: 4 << 20,
            connect_timeout: Duration::from_secs(30),
        }
    }
}

fn segment_len(size: usize, cap: usize) -> usize {
    HEADER + size.saturating_sub(1) * (RING_HEADER + cap)
}

/// Index of `peer`'s ring in `owner`'s segment.
fn slot(owner: usize, peer: usize) -> usize {
    if peer < owner {
        peer
    } else {
        peer - 1
    }
}

/// A mapped segment of rank `rank`.
#[derive(Debug)]
struct Segment {
    map: Mapping,
    rank: usize,
    cap: usize,
}

impl Segment {
    fn ring_at(&self, peer: usize) -> usize {
        HEADER + slot(self.rank, peer) * (RING_HEADER + self.cap)
    }

    fn u32_at(&self, at: usize) -> &AtomicU32 {
        self.map.atomic_u32(at)
    }

    fn u64_at(&self, at: usize) -> &AtomicU64 {
        self.map.atomic_u64(at)
    }

    fn doorbell(&self) -> &AtomicU32 {
        self.u32_at(DOORBELL_AT)
    }

    /// Bumps the doorbell and wakes a sleeping owner.
    fn ring_bell(&self) {
        self.doorbell().fetch_add(1, Ordering::SeqCst);
        if self.u32_at(SLEEPERS_AT).load(Ordering::SeqCst) != 0 {
            futex_wake_all(self.doorbell());
        }
    }

    /// The ring `peer` writes into.
    fn ring(&self, peer: usize) -> Ring<'_> {
        let at = self.ring_at(peer);
        Ring {
            seg: self,
            at,
            data: at + RING_HEADER,
        }
    }
}

/// One ring inside a segment.
struct Ring<'a> {
    seg: &'a Segment,
    at: usize,
    data: usize,
}

impl Ring<'_> {
    fn head(&self) -> &AtomicU64 {
        self.seg.u64_at(self.at + HEAD_AT)
    }
    fn tail(&self) -> &AtomicU64 {
        self.seg.u64_at(self.at + TAIL_AT)
    }
    fn attached(&self) -> &AtomicU32 {
        self.seg.u32_at(self.at + ATTACHED_AT)
    }
    fn writer_closed(&self) -> &AtomicU32 {
        self.seg.u32_at(self.at + WCLOSED_AT)
    }
    fn reader_closed(&self) -> &AtomicU32 {
        self.seg.u32_at(self.at + RCLOSED_AT)
    }

    /// Bytes written and not yet read, checked against the capacity.
    fn used(&self, head: u64, tail: u64) -> std::result::Result<usize, LinkError> {
        let used = head.wrapping_sub(tail);
        if used > self.seg.cap as u64 {
            return Err(LinkError::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "shared-memory ring corrupted (head {head}, tail {tail}, capacity {})",
                    self.seg.cap
                ),
            )));
        }
        Ok(used as usize)
    }

    /// Copies `src` into the ring at stream position `pos` (wrapping).
    fn put(&self, pos: u64, src: &[u8]) {
        let cap = self.seg.cap;
        let off = (pos % cap as u64) as usize;
        let first = src.len().min(cap - off);
        let base = self.seg.map.base().as_ptr();
        // SAFETY: `data + off + first` and `data + (len - first)` stay within the ring's
        // `cap` bytes inside the mapping (off < cap, len <= cap - used); the ring protocol gives
        // the writer these bytes (between head and tail + cap) until it publishes the new head,
        // and `src` is a Rust slice that cannot overlap the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(self.data + off), first);
            std::ptr::copy_nonoverlapping(
                src.as_ptr().add(first),
                base.add(self.data),
                src.len() - first,
            );
        }
    }

    /// Copies from stream position `pos` (wrapping) into `dst`.
    fn get(&self, pos: u64, dst: &mut [u8]) {
        let cap = self.seg.cap;
        let off = (pos % cap as u64) as usize;
        let first = dst.len().min(cap - off);
        let base = self.seg.map.base().as_ptr();
        // SAFETY: as in `put`: in bounds (off < cap, len <= used <= cap), published by the
        // writer's release store of head (loaded with acquire before), and not rewritten until
        // this reader publishes the new tail. `dst` is a Rust slice outside the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(base.add(self.data + off), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(
                base.add(self.data),
                dst.as_mut_ptr().add(first),
                dst.len() - first,
            );
        }
    }
}

/// Whether process `pid` still runs (it is neither gone nor a zombie), and its start time, from
/// `/proc/<pid>/stat`. `None` when it cannot be read (another pid namespace): not checked.
fn process_state(pid: u32) -> Option<(bool, u64)> {
    let stat = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Some((false, 0)),
        Err(_) => return None,
    };
    // After the command name (in parentheses, may hold spaces): state, then 18 more fields
    // before the start time.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    let start: u64 = fields.nth(18)?.parse().ok()?;
    Some((!matches!(state, "Z" | "X" | "x"), start))
}

/// Unlinks a segment name when dropped (set-up failed or was abandoned).
#[derive(Debug)]
struct Unlink(PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A rank's segment, created and named but not yet connected. Dropping it removes the name.
#[derive(Debug)]
pub struct ShmRendezvous {
    seg: Segment,
    path: Unlink,
    name: String,
    size: usize,
}

impl ShmRendezvous {
    /// Creates rank `rank`'s segment for a group of `size` ranks; [`ShmRendezvous::name`] is
    /// what the other ranks need to connect. Removes segments dead processes left behind.
    pub fn create(rank: usize, size: usize, opts: &ShmOptions) -> Result<ShmRendezvous> {
        Self::create_named(&new_name(&format!("coll-r{rank}")), rank, size, opts)
    }

    /// A fresh segment name for a group called `group`, to be published before the rank and
    /// the group's size are known; [`ShmRendezvous::create_named`] creates it later. Peers
    /// that connect first wait for it (within their connect timeout).
    pub fn reserve_name(group: &str) -> String {
        new_name(&format!("coll-{group}"))
    }

    /// As [`ShmRendezvous::create`], under `name` (from [`ShmRendezvous::reserve_name`]).
    pub fn create_named(
        name: &str,
        rank: usize,
        size: usize,
        opts: &ShmOptions,
    ) -> Result<ShmRendezvous> {
        let setup = |problem: String| CollectiveError::Setup { rank, problem };
        if rank >= size {
            return Err(setup(format!("rank {rank} is not in a group of {size}")));
        }
        let cap = opts.ring_bytes;
        if cap == 0 || cap % 4096 != 0 {
            return Err(setup(format!(
                "ring size {cap} is not a positive multiple of 4096"
            )));
        }
        let swept = sweep_dead();
        if swept > 0 {
            tracing::info!("removed {swept} shared-memory segments left by dead processes");
        }
        let name = name.to_string();
        let path = checked_path(&name).map_err(setup)?;
        let map = Mapping::create(&path, segment_len(size, cap).max(HEADER))
            .map_err(|e| setup(format!("creating {}: {e}", path.display())))?;
        let seg = Segment { map, rank, cap };
        seg.u32_at(VERSION_AT).store(VERSION, Ordering::Relaxed);
        seg.u32_at(SIZE_AT).store(size as u32, Ordering::Relaxed);
        seg.u32_at(RANK_AT).store(rank as u32, Ordering::Relaxed);
        seg.u32_at(PID_AT)
            .store(std::process::id(), Ordering::Relaxed);
        seg.u64_at(CAP_AT).store(cap as u64, Ordering::Relaxed);
        seg.u64_at(MAGIC_AT).store(MAGIC, Ordering::Release);
        Ok(ShmRendezvous {
            seg,
            path: Unlink(path),
            name,
            size,
        })
    }

    /// The segment's name, to be published as this rank's entry of the name list.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Maps every other rank's segment (`names[r]` is rank r's name; this rank's own entry is
    /// ignored), waits until every peer mapped this one, then unlinks this rank's name. Blocks
    /// at most `opts.connect_timeout`.
    pub fn connect(self, names: &[String], opts: &ShmOptions) -> Result<ShmPairs> {
        let (rank, size, cap) = (self.seg.rank, self.size, self.seg.cap);
        let setup = |problem: String| CollectiveError::Setup { rank, problem };
        if names.len() != size {
            return Err(setup(format!(
                "{} segment names for a group of {size}",
                names.len()
            )));
        }
        let deadline = Instant::now() + opts.connect_timeout;
        let mut peers = Vec::with_capacity(size);
        for (peer, name) in names.iter().enumerate() {
            if peer == rank {
                peers.push(None);
                continue;
            }
            // A peer that has not created its segment yet is waited for.
            let seg = loop {
                match open_peer(peer, name, size, cap) {
                    Ok(seg) => break seg,
                    Err(Open::NotYet(_)) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(Open::NotYet(e) | Open::Bad(e)) => {
                        return Err(setup(format!(
                            "attaching rank {peer}'s segment {name:?}: {e}"
                        )))
                    }
                }
            };
            seg.ring(rank).attached().store(1, Ordering::SeqCst);
            seg.ring_bell();
            let pid = seg.u32_at(PID_AT).load(Ordering::Relaxed);
            let start = process_state(pid).and_then(|(alive, start)| alive.then_some(start));
            peers.push(Some(Peer {
                seg,
                pid,
                start,
                dead: false,
            }));
        }
        // Every peer attached to this rank's segment: its name can go.
        loop {
            let missing: Vec<usize> = (0..size)
                .filter(|&p| p != rank && self.seg.ring(p).attached().load(Ordering::SeqCst) == 0)
                .collect();
            if missing.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(setup(format!(
                    "timed out after {:?} waiting for ranks {missing:?} to attach to this rank's shared memory",
                    opts.connect_timeout
                )));
            }
            let bell = self.seg.doorbell().load(Ordering::SeqCst);
            futex_wait(self.seg.doorbell(), bell, Duration::from_millis(2));
        }
        drop(self.path);
        let seen = self.seg.doorbell().load(Ordering::SeqCst);
        Ok(ShmPairs {
            own: self.seg,
            peers,
            names: names.to_vec(),
            seen,
            next_check: Instant::now() + NAP,
        })
    }
}

/// Why a peer's segment could not be attached.
enum Open {
    /// It does not exist or is not initialized yet (its creator may still be on its way).
    NotYet(String),
    /// It is not what was expected.
    Bad(String),
}

fn open_peer(
    peer: usize,
    name: &str,
    size: usize,
    cap: usize,
) -> std::result::Result<Segment, Open> {
    let path = checked_path(name).map_err(Open::Bad)?;
    let len = segment_len(size, cap).max(HEADER);
    match std::fs::metadata(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Open::NotYet(e.to_string())),
        // Created, not sized yet.
        Ok(m) if m.len() == 0 => return Err(Open::NotYet("the segment is empty".into())),
        _ => {}
    }
    let map = Mapping::open(&path, len).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => Open::NotYet(e.to_string()),
        _ => Open::Bad(e.to_string()),
    })?;
    let seg = Segment {
        map,
        rank: peer,
        cap,
    };
    let (magic, version) = (
        seg.u64_at(MAGIC_AT).load(Ordering::Acquire),
        seg.u32_at(VERSION_AT).load(Ordering::Relaxed),
    );
    let (s, r, c) = (
        seg.u32_at(SIZE_AT).load(Ordering::Relaxed) as usize,
        seg.u32_at(RANK_AT).load(Ordering::Relaxed) as usize,
        seg.u64_at(CAP_AT).load(Ordering::Relaxed),
    );
    if magic == 0 {
        return Err(Open::NotYet(
            "the segment's header is not written yet".into(),
        ));
    }
    if magic != MAGIC || version != VERSION || s != size || r != peer || c != cap as u64 {
        return Err(Open::Bad(format!(
            "not rank {peer}'s collective segment for {size} ranks with {cap}-byte rings (magic {magic:#x}, version {version}, rank {r} of {s}, rings of {c} bytes)"
        )));
    }
    Ok(seg)
}

#[derive(Debug)]
struct Peer {
    seg: Segment,
    pid: u32,
    /// The peer process's start time, when its liveness can be checked.
    start: Option<u64>,
    /// Its process was seen gone.
    dead: bool,
}

/// A rank's shared-memory links to every other rank of its group.
#[derive(Debug)]
pub struct ShmPairs {
    own: Segment,
    peers: Vec<Option<Peer>>,
    names: Vec<String>,
    /// The doorbell value when `wait` last returned.
    seen: u32,
    next_check: Instant,
}

impl ShmPairs {
    fn peer(&mut self, peer: usize) -> std::result::Result<&mut Peer, LinkError> {
        self.peers
            .get_mut(peer)
            .and_then(|p| p.as_mut())
            .ok_or_else(|| {
                LinkError::Io(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("no link to rank {peer}"),
                ))
            })
    }

    /// Marks peers whose process ended.
    fn check_peers(&mut self) -> bool {
        let mut died = false;
        for p in self.peers.iter_mut().flatten() {
            if p.dead {
                continue;
            }
            if let Some(start) = p.start {
                if let Some((alive, now)) = process_state(p.pid) {
                    if !alive || now != start {
                        p.dead = true;
                        died = true;
                    }
                }
            }
        }
        died
    }
}

impl Pairs for ShmPairs {
    fn rank(&self) -> usize {
        self.own.rank
    }

    fn size(&self) -> usize {
        self.peers.len()
    }

    fn try_write(
        &mut self,
        peer: usize,
        bufs: &[IoSlice<'_>],
    ) -> std::result::Result<usize, LinkError> {
        let me = self.own.rank;
        let p = self.peer(peer)?;
        let ring = p.seg.ring(me);
        if p.dead || ring.reader_closed().load(Ordering::Acquire) != 0 {
            return Err(LinkError::Closed);
        }
        let head = ring.head().load(Ordering::Relaxed);
        let tail = ring.tail().load(Ordering::Acquire);
        let mut free = p.seg.cap - ring.used(head, tail)?;
        let mut pos = head;
        for b in bufs {
            if free == 0 {
                break;
            }
            let n = b.len().min(free);
            ring.put(pos, &b[..n]);
            pos = pos.wrapping_add(n as u64);
            free -= n;
        }
        let n = pos.wrapping_sub(head) as usize;
        if n > 0 {
            ring.head().store(pos, Ordering::SeqCst);
            // The reader sleeps only after it found the ring empty: ring the bell when it had
            // read everything before these bytes (both sides store, then load, SeqCst: one of
            // them sees the other).
            if ring.tail().load(Ordering::SeqCst) == head {
                p.seg.ring_bell();
            }
        }
        Ok(n)
    }

    fn try_read(&mut self, peer: usize, buf: &mut [u8]) -> std::result::Result<usize, LinkError> {
        if buf.is_empty() {
            return Ok(0);
        }
        let dead = self.peer(peer)?.dead;
        let ring = self.own.ring(peer);
        let tail = ring.tail().load(Ordering::Relaxed);
        let head = ring.head().load(Ordering::Acquire);
        let used = ring.used(head, tail)?;
        if used == 0 {
            if dead || ring.writer_closed().load(Ordering::Acquire) != 0 {
                return Err(LinkError::Closed);
            }
            return Ok(0);
        }
        let n = used.min(buf.len());
        ring.get(tail, &mut buf[..n]);
        ring.tail()
            .store(tail.wrapping_add(n as u64), Ordering::SeqCst);
        // The writer sleeps for room only after it found the ring full: ring its bell when it
        // had filled the ring as this read found it.
        let full = ring.head().load(Ordering::SeqCst).wrapping_sub(tail) >= self.own.cap as u64;
        if full {
            self.peer(peer)?.seg.ring_bell();
        }
        Ok(n)
    }

    fn wait(&mut self, until: Instant) -> std::result::Result<(), LinkError> {
        loop {
            let now_bell = self.own.doorbell().load(Ordering::SeqCst);
            if now_bell != self.seen {
                self.seen = now_bell;
                return Ok(());
            }
            let now = Instant::now();
            if now >= self.next_check {
                self.next_check = now + NAP;
                if self.check_peers() {
                    return Ok(());
                }
            }
            if now >= until {
                return Ok(());
            }
            let (bell, sleepers) = (self.own.doorbell(), self.own.u32_at(SLEEPERS_AT));
            sleepers.fetch_add(1, Ordering::SeqCst);
            if bell.load(Ordering::SeqCst) == self.seen {
                let nap = NAP
                    .min(until - now)
                    .min(self.next_check.saturating_duration_since(now));
                futex_wait(bell, self.seen, nap.max(Duration::from_micros(1)));
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn describe(&self, peer: usize) -> String {
        self.names
            .get(peer)
            .map_or_else(|| format!("rank {peer}"), |n| format!("shared memory {n}"))
    }
}

impl Drop for ShmPairs {
    fn drop(&mut self) {
        let me = self.own.rank;
        for (peer, p) in self.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            p.seg.ring(me).writer_closed().store(1, Ordering::SeqCst);
            self.own
                .ring(peer)
                .reader_closed()
                .store(1, Ordering::SeqCst);
            p.seg.ring_bell();
        }
    }
}

/// Creates and connects `size` ranks in this process (tests and single-process benchmarks).
pub fn shm_group(size: usize, opts: &ShmOptions) -> Result<Vec<ShmPairs>> {
    let rvs = (0..size)
        .map(|r| ShmRendezvous::create(r, size, opts))
        .collect::<Result<Vec<_>>>()?;
    let names: Vec<String> = rvs.iter().map(|r| r.name().to_string()).collect();
    connect_on_threads(rvs, |_, rv| rv.connect(&names, opts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(ring_bytes: usize) -> (ShmPairs, ShmPairs) {
        let o = ShmOptions {
            ring_bytes,
            ..ShmOptions::default()
        };
        let mut g = shm_group(2, &o).unwrap();
        let b = g.pop().unwrap();
        let a = g.pop().unwrap();
        (a, b)
    }

    #[test]
    fn ring_wraps_fills_and_rejects_corrupt_positions() {
        let (mut a, mut b) = pair(4096);
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let mut got = Vec::new();
        let mut buf = [0u8; 3000];
        let mut sent = 0;
        // Writes stop at a full ring; reads of any size see the bytes in order across wraps.
        while got.len() < data.len() {
            let n = a
                .try_write(
                    1,
                    &[IoSlice::new(&data[sent..(sent + 1500).min(data.len())])],
                )
                .unwrap();
            sent += n;
            assert!(sent - got.len() <= 4096, "never more than the ring holds");
            let m = b
                .try_read(0, &mut buf[..(got.len() % 7) * 400 + 1])
                .unwrap();
            got.extend_from_slice(&buf[..m]);
        }
        assert_eq!(got, data);
        assert_eq!(b.try_read(0, &mut buf).unwrap(), 0);
        // A head beyond what the ring can hold is refused, not read.
        let tail = b.own.ring(0).tail().load(Ordering::SeqCst);
        b.own.ring(0).head().store(tail + 4097, Ordering::SeqCst);
        assert!(matches!(b.try_read(0, &mut buf), Err(LinkError::Io(_))));
        b.own.ring(0).head().store(tail, Ordering::SeqCst);
        // A dropped end reads as closed once drained; writes to it fail.
        a.try_write(1, &[IoSlice::new(b"last")]).unwrap();
        drop(a);
        assert_eq!(b.try_read(0, &mut buf).unwrap(), 4);
        assert!(matches!(b.try_read(0, &mut buf), Err(LinkError::Closed)));
        assert!(matches!(
            b.try_write(0, &[IoSlice::new(b"x")]),
            Err(LinkError::Closed)
        ));
    }

    #[test]
    fn wait_returns_on_data_and_at_the_deadline() {
        let (mut a, mut b) = pair(4096);
        // Nothing arrives: waits end at the deadline (an early return is allowed), not after.
        let t = Instant::now();
        let deadline = t + Duration::from_millis(30);
        while Instant::now() < deadline {
            b.wait(deadline).unwrap();
        }
        assert!(t.elapsed() < Duration::from_millis(500));
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                a.try_write(1, &[IoSlice::new(b"ping")]).unwrap();
            });
            let t = Instant::now();
            let mut buf = [0u8; 4];
            while b.try_read(0, &mut buf).unwrap() == 0 {
                b.wait(t + Duration::from_secs(10)).unwrap();
            }
            assert!(t.elapsed() < Duration::from_secs(5));
            assert_eq!(&buf, b"ping");
        });
    }

    #[test]
    fn process_liveness_from_proc() {
        let (alive, start) = process_state(std::process::id()).unwrap();
        assert!(alive && start > 0);
        assert_eq!(process_state(u32::MAX), Some((false, 0)));
    }
}
