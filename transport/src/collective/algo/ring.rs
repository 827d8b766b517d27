//! Ring reduce-scatter and all-gather, chunked and pipelined: all-reduce is the two in a row,
//! every rank sending and receiving 2(n-1)/n of the buffer (the bandwidth optimum). The chunks
//! flow through [`stream`](super::stream): a chunk received from the left is reduced and
//! forwarded to the right at once, while later chunks keep arriving.

use super::super::error::Result;
use super::super::partition::{block_range, chunk_of, chunks};
use super::super::scalar::{ReduceOp, Scalar};
use super::stream::{self, Bufs, RecvMsg, Schedule, SendMsg, Sink, Src};
use super::{tag, Ctx, Scratch};
use std::ops::Range;

/// One rank's messages of a ring: `rs_steps` reduce-scatter steps, then `ag_steps`
/// all-gather steps, each step `k` chunks of `ch` elements of one block.
struct Ring {
    n: usize,
    r: usize,
    len: usize,
    ch: usize,
    k: usize,
    rs_steps: usize,
    ag_steps: usize,
    /// Reduce-scatter reads this rank's data from the input buffer (out of place).
    from_input: bool,
    /// The reduce op is `Avg`: the last reduction of each element divides.
    avg: bool,
}

impl Ring {
    fn new<T>(ctx: &Ctx<'_>, len: usize, rs: bool, ag: bool) -> Ring {
        let (n, r) = (ctx.size(), ctx.rank());
        let ch = ctx.chunk_elems::<T>();
        Ring {
            n,
            r,
            len,
            ch,
            k: chunks(block_range(len, n, 0).len(), ch),
            rs_steps: if rs { n - 1 } else { 0 },
            ag_steps: if ag { n - 1 } else { 0 },
            from_input: false,
            avg: false,
        }
    }

    /// Chunk `c` of block `b` (taken modulo n).
    fn chunk(&self, b: usize, c: usize) -> Range<usize> {
        chunk_of(&block_range(self.len, self.n, b % self.n), self.ch, c)
    }

    fn left(&self) -> usize {
        (self.r + self.n - 1) % self.n
    }

    fn right(&self) -> usize {
        (self.r + 1) % self.n
    }
}

impl Schedule for Ring {
    fn sends(&self) -> usize {
        (self.rs_steps + self.ag_steps) * self.k
    }

    fn send(&self, i: usize) -> SendMsg {
        let (step, c) = (i / self.k, i % self.k);
        let (n, r, k) = (self.n, self.r, self.k);
        if step < self.rs_steps {
            let range = self.chunk(r + 2 * n - step - 1, c);
            SendMsg {
                peer: self.right(),
                tag: tag(1, step, c),
                src: if step == 0 && self.from_input {
                    Src::In(range)
                } else {
                    Src::Out(range)
                },
                after: (step > 0).then(|| (step - 1) * k + c),
            }
        } else {
            let s = step - self.rs_steps;
            SendMsg {
                peer: self.right(),
                tag: tag(2, s, c),
                src: Src::Out(self.chunk(r + n - s, c)),
                // The first all-gather step forwards the block the reduce-scatter finished.
                after: (step > 0).then(|| (step - 1) * k + c),
            }
        }
    }

    fn recvs(&self) -> usize {
        self.sends()
    }

    fn recv(&self, i: usize) -> RecvMsg {
        let (step, c) = (i / self.k, i % self.k);
        let (n, r) = (self.n, self.r);
        if step < self.rs_steps {
            let dst = self.chunk(r + 2 * n - step - 2, c);
            RecvMsg {
                peer: self.left(),
                tag: tag(1, step, c),
                sink: Sink::Reduce {
                    own: self.from_input.then(|| dst.clone()),
                    dst,
                    avg: self.avg && step + 1 == self.rs_steps,
                },
            }
        } else {
            let s = step - self.rs_steps;
            RecvMsg {
                peer: self.left(),
                tag: tag(2, s, c),
                sink: Sink::Copy(self.chunk(r + 2 * n - s - 1, c)),
            }
        }
    }
}

/// Reduce-scatter: block `rank` (by [`block_range`]) of the reduction of every rank's `send`
/// lands in `recv` (divided by the rank count for `Avg`). `send` is only read; the partial
/// sums travel through a scratch buffer as long as `send`.
pub(crate) fn reduce_scatter<T: Scalar>(
    ctx: &mut Ctx<'_>,
    scratch: &mut Scratch,
    send: &[T],
    recv: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (ctx.size(), ctx.rank());
    let own = block_range(send.len(), n, r);
    if n == 1 {
        recv.copy_from_slice(send);
        return Ok(());
    }
    let mut ring = Ring::new::<T>(ctx, send.len(), true, false);
    ring.from_input = true;
    ring.avg = op == ReduceOp::Avg;
    let (work, tmp) = scratch.take2::<T>(send.len(), stream::tmp_elems::<T>(ring.ch));
    let bufs = Bufs {
        out: &mut *work,
        inp: send,
        tmp,
    };
    stream::run(ctx, &ring, bufs, op)?;
    recv.copy_from_slice(&work[own]);
    Ok(())
}

/// Ring all-gather in place: block `rank` of `buf` is this rank's; afterwards every block is.
pub(crate) fn all_gather_in_place<T: Scalar>(ctx: &mut Ctx<'_>, buf: &mut [T]) -> Result<()> {
    if ctx.size() == 1 {
        return Ok(());
    }
    let ring = Ring::new::<T>(ctx, buf.len(), false, true);
    let bufs = Bufs {
        out: buf,
        inp: &[],
        tmp: &mut [],
    };
    stream::run(ctx, &ring, bufs, ReduceOp::Sum)
}

/// Ring all-reduce in place: reduce-scatter, then all-gather of the reduced blocks, as one
/// pipeline.
pub(crate) fn all_reduce<T: Scalar>(
    ctx: &mut Ctx<'_>,
    scratch: &mut Scratch,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let n = ctx.size();
    if n == 1 {
        return Ok(());
    }
    let mut ring = Ring::new::<T>(ctx, buf.len(), true, true);
    ring.avg = op == ReduceOp::Avg;
    let bufs = Bufs {
        out: buf,
        inp: &[],
        tmp: scratch.take::<T>(stream::tmp_elems::<T>(ring.ch)),
    };
    stream::run(ctx, &ring, bufs, op)
}
