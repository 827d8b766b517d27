//! [`Communicator`]: a group of ranks and the eight collectives over it.

use super::algo::{self, Algorithm, Ctx, Scratch};
use super::channel::{CallState, Channel};
use super::error::{CollectiveError, Result};
use super::fingerprint::{CollectiveOp, Fingerprint};
use super::handle::{Handle, Worker};
use super::inproc::InProcPairs;
use super::pairs::Pairs;
use super::partition::block_range;
use super::scalar::{ReduceOp, Scalar};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Settings of a communicator; a copy with other values can be had per call with
/// [`Communicator::with_options`].
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// A call fails when it has not finished after this long (default 60 s).
    pub timeout: Duration,
    /// After this long inside one call, the ranks that have not joined it are logged with
    /// `tracing::warn` (default 10 s).
    pub stall_warning: Duration,
    /// Algorithm family (default [`Algorithm::Auto`]).
    pub algorithm: Algorithm,
    /// `Auto` uses trees up to this many bytes per rank and rings/chains above (default 64 KiB).
    pub small_bytes: usize,
    /// Message size of the pipelined algorithms (default 1 MiB).
    pub chunk_bytes: usize,
    /// On calls up to `small_bytes`, a rank that waits polls its links (yielding the core
    /// between polls) for up to this long after the last progress before it sleeps: lower
    /// latency for small collectives at the price of CPU (default 200 µs; zero sleeps at once).
    pub spin: Duration,
}

impl Default for CommOptions {
    fn default() -> CommOptions {
        CommOptions {
            timeout: Duration::from_secs(60),
            stall_warning: Duration::from_secs(10),
            algorithm: Algorithm::Auto,
            small_bytes: 64 << 10,
            chunk_bytes: 1 << 20,
            spin: Duration::from_micros(200),
        }
    }
}

#[derive(Debug)]
struct Shared {
    channel: Channel,
    scratch: Scratch,
}

#[derive(Debug)]
struct Group {
    id: u32,
    members: Arc<[usize]>,
    rank: usize,
    seq: AtomicU64,
    worker: Worker,
}

/// A group of ranks that run collectives together. Cheap to clone (clones share the group and
/// its sequence numbers); every rank of the group must issue the same collectives in the same
/// order. Buffers are typed slices of a [`Scalar`] (`f32`, `f64`, `i32`, `i64`, `bf16`).
///
/// Ranks in arguments and errors are this group's ranks, `0..size()`.
#[derive(Debug, Clone)]
pub struct Communicator {
    shared: Arc<Mutex<Shared>>,
    group: Arc<Group>,
    opts: CommOptions,
    in_worker: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// FNV-1a over the parent group id and the member list: equal on every member, different for
/// different member lists.
fn group_id(parent: u32, members: &[usize]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for x in std::iter::once(parent as u64).chain(members.iter().map(|&m| m as u64)) {
        for b in x.to_le_bytes() {
            h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
        }
    }
    h
}

impl Communicator {
    /// The communicator of all ranks of `pairs`.
    pub fn new(pairs: Box<dyn Pairs>, opts: CommOptions) -> Communicator {
        let rank = pairs.rank();
        let members: Arc<[usize]> = (0..pairs.size()).collect();
        let channel = Channel::new(pairs, opts.timeout);
        Communicator {
            shared: Arc::new(Mutex::new(Shared {
                channel,
                scratch: Scratch::default(),
            })),
            group: Arc::new(Group {
                id: group_id(0, &members),
                members,
                rank,
                seq: AtomicU64::new(0),
                worker: Worker::new(),
            }),
            opts,
            in_worker: false,
        }
    }

    /// `size` communicators connected in this process (one per rank; hand each to a thread).
    pub fn in_process(size: usize, opts: CommOptions) -> Vec<Communicator> {
        InProcPairs::group(size)
            .into_iter()
            .map(|p| Communicator::new(Box::new(p), opts.clone()))
            .collect()
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.group.rank
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        self.group.members.len()
    }

    /// What this rank has sent over the group's channel so far (shared by the groups split
    /// from it): payload bytes and messages, headers not counted.
    pub fn sent(&self) -> crate::Traffic {
        lock(&self.shared).channel.sent()
    }

    /// The options calls use.
    pub fn options(&self) -> &CommOptions {
        &self.opts
    }

    /// The same communicator with other options for the calls made through it (per-call
    /// timeouts: `comm.with_options(o).all_reduce(..)`).
    pub fn with_options(&self, opts: CommOptions) -> Communicator {
        Communicator {
            opts,
            ..self.clone()
        }
    }

    /// The same communicator with another timeout.
    pub fn with_timeout(&self, timeout: Duration) -> Communicator {
        let mut o = self.opts.clone();
        o.timeout = timeout;
        self.with_options(o)
    }

    /// A communicator over `ranks` (ranks of this group; their order gives the new ranks). Every
    /// listed rank calls it with the same list; no message is exchanged. It shares this
    /// group's connections, so collectives on both must be issued in the same order everywhere.
    pub fn subgroup(&self, ranks: &[usize]) -> Result<Communicator> {
        let bad = |problem: String| CollectiveError::InvalidArgument {
            call: "subgroup".into(),
            rank: self.rank(),
            problem,
        };
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            if r >= self.size() || std::mem::replace(&mut seen[r], true) {
                return Err(bad(format!(
                    "ranks {ranks:?}: {r} is out of range or repeated"
                )));
            }
        }
        let rank = ranks
            .iter()
            .position(|&r| r == self.rank())
            .ok_or_else(|| bad(format!("rank {} is not in {ranks:?}", self.rank())))?;
        let members: Arc<[usize]> = ranks.iter().map(|&r| self.group.members[r]).collect();
        Ok(Communicator {
            shared: self.shared.clone(),
            group: Arc::new(Group {
                id: group_id(self.group.id, &members),
                members,
                rank,
                seq: AtomicU64::new(0),
                worker: Worker::new(),
            }),
            opts: self.opts.clone(),
            in_worker: false,
        })
    }

    /// Splits the group by `color`: ranks with equal colors form one new group, ordered by
    /// `key` then by rank. A collective (an all-gather of the colors) on this group.
    pub fn split(&self, color: u32, key: i64) -> Result<Communicator> {
        let mine = [i64::from(color), key];
        let mut all = vec![0i64; 2 * self.size()];
        self.all_gather(&mine, &mut all)?;
        let mut ranks: Vec<usize> = (0..self.size())
            .filter(|&r| all[2 * r] == i64::from(color))
            .collect();
        ranks.sort_by_key(|&r| (all[2 * r + 1], r));
        self.subgroup(&ranks)
    }

    fn fingerprint<T: Scalar>(
        &self,
        op: CollectiveOp,
        reduce: Option<ReduceOp>,
        root: usize,
        count: usize,
    ) -> Fingerprint {
        Fingerprint {
            group: self.group.id,
            seq: 0,
            op,
            dtype: Some(T::DTYPE),
            reduce,
            root: root as u32,
            count: count as u64,
        }
    }

    /// Runs one call: waits for earlier asynchronous calls, takes the next sequence number,
    /// checks the arguments (a failed check aborts the call on every rank) and runs `body`.
    fn run<R>(
        &self,
        mut fp: Fingerprint,
        check: Option<String>,
        body: impl FnOnce(&mut Ctx<'_>, &mut Scratch) -> Result<R>,
    ) -> Result<R> {
        if !self.in_worker {
            self.group.worker.drain();
        }
        let mut shared = lock(&self.shared);
        let Shared { channel, scratch } = &mut *shared;
        fp.seq = self.group.seq.fetch_add(1, Ordering::Relaxed);
        let bytes = (fp.count as usize).saturating_mul(fp.dtype.map_or(1, |d| d.size_of()));
        let spin = if bytes <= self.opts.small_bytes {
            self.opts.spin
        } else {
            Duration::ZERO
        };
        let call = CallState::new(
            fp,
            self.group.members.clone(),
            self.group.rank,
            self.opts.timeout,
            self.opts.stall_warning,
        )
        .with_spin(spin);
        if let Some(e) = channel.poisoned() {
            return Err(CollectiveError::Poisoned(Box::new(e.clone())));
        }
        if let Some(problem) = check {
            let e = CollectiveError::InvalidArgument {
                call: fp.call(),
                rank: self.rank(),
                problem,
            };
            channel.fail(&call, &e);
            return Err(e);
        }
        let mut ctx = Ctx {
            ch: channel,
            call,
            chunk_bytes: self.opts.chunk_bytes.max(1),
        };
        let r = body(&mut ctx, scratch);
        if let Err(e) = &r {
            ctx.ch.fail(&ctx.call, e);
        }
        r
    }

    fn small<T>(&self, count: usize) -> bool {
        match self.opts.algorithm {
            Algorithm::Auto => count * std::mem::size_of::<T>() <= self.opts.small_bytes,
            Algorithm::Tree => true,
            Algorithm::Ring => false,
        }
    }

    fn check_root(&self, root: usize) -> Option<String> {
        (root >= self.size())
            .then(|| format!("root {root} is not a rank of a group of {}", self.size()))
    }

    /// Reduces `buf` element-wise over all ranks; every rank gets the result. Any length.
    pub fn all_reduce<T: Scalar>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let fp = self.fingerprint::<T>(CollectiveOp::AllReduce, Some(op), 0, buf.len());
        let small = self.small::<T>(buf.len());
        self.run(fp, None, |ctx, scratch| {
            if small {
                algo::tree::all_reduce(ctx, scratch, buf, op)
            } else {
                algo::ring::all_reduce(ctx, scratch, buf, op)
            }
        })
    }

    /// Copies the root's `buf` into every rank's `buf`.
    pub fn broadcast<T: Scalar>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let fp = self.fingerprint::<T>(CollectiveOp::Broadcast, None, root, buf.len());
        let small = self.small::<T>(buf.len());
        self.run(fp, self.check_root(root), |ctx, _| {
            if small {
                algo::tree::broadcast(ctx, buf, root)
            } else {
                algo::chain::broadcast(ctx, buf, root)
            }
        })
    }

    /// Reduces `buf` over all ranks into the root's `buf`; other ranks' buffers are unchanged.
    pub fn reduce<T: Scalar>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let fp = self.fingerprint::<T>(CollectiveOp::Reduce, Some(op), root, buf.len());
        let small = self.small::<T>(buf.len());
        self.run(fp, self.check_root(root), |ctx, scratch| {
            if small {
                algo::tree::reduce(ctx, scratch, buf, op, root)
            } else {
                algo::chain::reduce(ctx, scratch, buf, op, root)
            }
        })
    }

    /// The root's `send` (`size() * recv.len()` elements) is cut in equal blocks; rank i gets
    /// block i in `recv`. Other ranks' `send` is ignored (pass `&[]`).
    pub fn scatter<T: Scalar>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let fp = self.fingerprint::<T>(CollectiveOp::Scatter, None, root, recv.len());
        let check = self.check_root(root).or_else(|| {
            (self.rank() == root && send.len() != self.size() * recv.len()).then(|| {
                format!(
                    "the root's send buffer has {} elements, expected {} ranks x {}",
                    send.len(),
                    self.size(),
                    recv.len()
                )
            })
        });
        self.run(fp, check, |ctx, _| {
            algo::direct::scatter(ctx, send, recv, root)
        })
    }

    /// Every rank's `send` lands as block i (rank i's) of the root's `recv`
    /// (`size() * send.len()` elements). Other ranks' `recv` is ignored (pass `&mut []`).
    pub fn gather<T: Scalar>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        let fp = self.fingerprint::<T>(CollectiveOp::Gather, None, root, send.len());
        let check = self.check_root(root).or_else(|| {
            (self.rank() == root && recv.len() != self.size() * send.len()).then(|| {
                format!(
                    "the root's receive buffer has {} elements, expected {} ranks x {}",
                    recv.len(),
                    self.size(),
                    send.len()
                )
            })
        });
        self.run(fp, check, |ctx, _| {
            algo::direct::gather(ctx, send, recv, root)
        })
    }

    /// Every rank's `send` lands as block i (rank i's) of every rank's `recv`
    /// (`size() * send.len()` elements).
    pub fn all_gather<T: Scalar>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let fp = self.fingerprint::<T>(CollectiveOp::AllGather, None, 0, send.len());
        let check = (recv.len() != self.size() * send.len()).then(|| {
            format!(
                "receive buffer has {} elements, expected {} ranks x {}",
                recv.len(),
                self.size(),
                send.len()
            )
        });
        let (r, n) = (self.rank(), self.size());
        self.run(fp, check, |ctx, _| {
            let own = block_range(recv.len(), n, r);
            recv[own].copy_from_slice(send);
            algo::ring::all_gather_in_place(ctx, recv)
        })
    }

    /// Reduces `send` over all ranks and leaves block `rank()` of the result in `recv`. Blocks
    /// follow [`block_range`]: when `send.len()` is not a multiple of `size()`, the first
    /// `send.len() % size()` ranks get one element more.
    pub fn reduce_scatter<T: Scalar>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let fp = self.fingerprint::<T>(CollectiveOp::ReduceScatter, Some(op), 0, send.len());
        let (r, n) = (self.rank(), self.size());
        let own = block_range(send.len(), n, r);
        let check = (recv.len() != own.len()).then(|| {
            format!(
                "receive buffer has {} elements; block {r} of {} elements over {n} ranks has {}",
                recv.len(),
                send.len(),
                own.len()
            )
        });
        self.run(fp, check, |ctx, scratch| {
            algo::ring::reduce_scatter(ctx, scratch, send, recv, op)
        })
    }

    /// Block j of `send` goes to rank j; block i of `recv` comes from rank i. Both buffers have
    /// `size()` equal blocks.
    pub fn all_to_all<T: Scalar>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let fp = self.fingerprint::<T>(CollectiveOp::AllToAll, None, 0, send.len());
        let n = self.size();
        let check = (send.len() != recv.len() || send.len() % n != 0).then(|| {
            format!("send ({}) and receive ({}) buffers must have the same length, a multiple of {n} ranks", send.len(), recv.len())
        });
        self.run(fp, check, |ctx, _| {
            algo::direct::all_to_all(ctx, send, recv)
        })
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        let fp = self.fingerprint::<i32>(CollectiveOp::Barrier, None, 0, 0);
        self.run(fp, None, |ctx, scratch| {
            algo::tree::all_reduce::<i32>(ctx, scratch, &mut [], ReduceOp::Sum)
        })
    }

    /// Runs `job` on this group's worker thread after every call submitted before it; the
    /// handle yields its result. Calls made inside `job` on the communicator it receives run
    /// in order with other submitted jobs; synchronous calls on this communicator wait for all
    /// submitted jobs first.
    pub fn submit<R: Send + 'static>(
        &self,
        job: impl FnOnce(&Communicator) -> Result<R> + Send + 'static,
    ) -> Handle<R> {
        let worker_comm = Communicator {
            in_worker: true,
            ..self.clone()
        };
        self.group.worker.submit(move || job(&worker_comm))
    }

    /// Asynchronous [`Communicator::all_reduce`]: the buffer comes back through the handle.
    pub fn all_reduce_async<T: Scalar>(&self, mut buf: Vec<T>, op: ReduceOp) -> Handle<Vec<T>> {
        self.submit(move |c| c.all_reduce(&mut buf, op).map(|()| buf))
    }

    /// Asynchronous [`Communicator::broadcast`].
    pub fn broadcast_async<T: Scalar>(&self, mut buf: Vec<T>, root: usize) -> Handle<Vec<T>> {
        self.submit(move |c| c.broadcast(&mut buf, root).map(|()| buf))
    }

    /// Asynchronous [`Communicator::all_gather`]: returns the gathered buffer.
    pub fn all_gather_async<T: Scalar>(&self, send: Vec<T>) -> Handle<Vec<T>> {
        self.submit(move |c| {
            let mut recv = vec![T::zeroed(); send.len() * c.size()];
            c.all_gather(&send, &mut recv).map(|()| recv)
        })
    }

    /// Asynchronous [`Communicator::reduce_scatter`]: returns this rank's block.
    pub fn reduce_scatter_async<T: Scalar>(&self, send: Vec<T>, op: ReduceOp) -> Handle<Vec<T>> {
        self.submit(move |c| {
            let mut recv = vec![T::zeroed(); block_range(send.len(), c.size(), c.rank()).len()];
            c.reduce_scatter(&send, &mut recv, op).map(|()| recv)
        })
    }
}
