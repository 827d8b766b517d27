//! Pipelined chains for large rooted collectives: the buffer is cut into chunks that flow
//! rank to rank through [`stream`](super::stream), so every link carries the whole buffer once
//! and a chunk is forwarded as soon as it arrived (and, for reduce, was combined).

use super::super::error::Result;
use super::super::partition::{chunk_of, chunks};
use super::super::scalar::{ReduceOp, Scalar};
use super::stream::{self, Bufs, RecvMsg, Schedule, SendMsg, Sink, Src};
use super::{tag, Ctx, Scratch};
use std::ops::Range;

/// One rank's part of a chain: `k` chunks of `ch` elements received from `from` (when
/// `recv`), each sent on to `to` (when `send`) after it arrived (`forward`) or from the
/// start.
struct Chain {
    len: usize,
    ch: usize,
    k: usize,
    from: usize,
    to: usize,
    send: bool,
    recv: bool,
    /// Sends wait for the matching receive (middle ranks).
    forward: bool,
    /// Sends read the input buffer (the first rank of a reduce chain).
    send_input: bool,
    phase: u64,
    /// How received chunks are kept.
    sink: SinkKind,
}

#[derive(Clone, Copy)]
enum SinkKind {
    Copy,
    /// `out op= chunk` (`avg`: then divide).
    ReduceInPlace {
        avg: bool,
    },
    /// `out = in op chunk`.
    ReduceFromInput,
}

impl Chain {
    fn chunk(&self, c: usize) -> Range<usize> {
        chunk_of(&(0..self.len), self.ch, c)
    }
}

impl Schedule for Chain {
    fn sends(&self) -> usize {
        if self.send {
            self.k
        } else {
            0
        }
    }

    fn send(&self, c: usize) -> SendMsg {
        let range = self.chunk(c);
        SendMsg {
            peer: self.to,
            tag: tag(self.phase, 0, c),
            src: if self.send_input {
                Src::In(range)
            } else {
                Src::Out(range)
            },
            after: self.forward.then_some(c),
        }
    }

    fn recvs(&self) -> usize {
        if self.recv {
            self.k
        } else {
            0
        }
    }

    fn recv(&self, c: usize) -> RecvMsg {
        let dst = self.chunk(c);
        RecvMsg {
            peer: self.from,
            tag: tag(self.phase, 0, c),
            sink: match self.sink {
                SinkKind::Copy => Sink::Copy(dst),
                SinkKind::ReduceInPlace { avg } => Sink::Reduce {
                    dst,
                    own: None,
                    avg,
                },
                SinkKind::ReduceFromInput => Sink::Reduce {
                    own: Some(dst.clone()),
                    dst,
                    avg: false,
                },
            },
        }
    }
}

/// Broadcast along root, root+1, ..., root+n-1: each rank forwards chunk c as soon as it
/// arrived, while the next chunks arrive.
pub(crate) fn broadcast<T: Scalar>(ctx: &mut Ctx<'_>, buf: &mut [T], root: usize) -> Result<()> {
    let (n, r) = (ctx.size(), ctx.rank());
    if n == 1 {
        return Ok(());
    }
    let vr = (r + n - root) % n;
    let ch = ctx.chunk_elems::<T>();
    let chain = Chain {
        len: buf.len(),
        ch,
        k: chunks(buf.len(), ch),
        from: (r + n - 1) % n,
        to: (r + 1) % n,
        send: vr + 1 < n,
        recv: vr > 0,
        forward: vr > 0,
        send_input: false,
        phase: 6,
        sink: SinkKind::Copy,
    };
    let bufs = Bufs {
        out: buf,
        inp: &[],
        tmp: &mut [],
    };
    stream::run(ctx, &chain, bufs, ReduceOp::Sum)
}

/// Reduce along root+n-1, ..., root+1, root: each rank receives the partial chunk c from its
/// successor, combines its own, and passes it on while the next chunks arrive. Non-root
/// buffers are left unchanged.
pub(crate) fn reduce<T: Scalar>(
    ctx: &mut Ctx<'_>,
    scratch: &mut Scratch,
    buf: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (n, r) = (ctx.size(), ctx.rank());
    if n == 1 {
        return Ok(());
    }
    let vr = (r + n - root) % n;
    let ch = ctx.chunk_elems::<T>();
    let is_tail = vr == n - 1;
    let middle = vr > 0 && !is_tail;
    let mut chain = Chain {
        len: buf.len(),
        ch,
        k: chunks(buf.len(), ch),
        from: (r + 1) % n,
        to: (r + n - 1) % n,
        send: vr > 0,
        recv: !is_tail,
        forward: middle,
        send_input: is_tail,
        phase: 7,
        sink: SinkKind::ReduceInPlace {
            avg: op == ReduceOp::Avg,
        },
    };
    let (acc, tmp) = scratch.take2::<T>(
        if middle { buf.len() } else { 0 },
        stream::tmp_elems::<T>(ch),
    );
    let bufs = if middle {
        chain.sink = SinkKind::ReduceFromInput;
        Bufs {
            out: acc,
            inp: buf,
            tmp,
        }
    } else if is_tail {
        Bufs {
            out: &mut [],
            inp: buf,
            tmp,
        }
    } else {
        Bufs {
            out: buf,
            inp: &[],
            tmp,
        }
    };
    stream::run(ctx, &chain, bufs, op)
}
