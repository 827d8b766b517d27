//! The pipelined engine under the ring and chain algorithms: one ordered list of messages to
//! send and one to receive, driven together on one thread without lock-step. A send may wait
//! for one receive (the chunk it forwards), nothing else waits: every chunk leaves as soon as
//! the chunk it depends on has been received (and reduced), while the next chunks keep
//! arriving in the socket buffers. Compared with one [`Ctx::exchange`] per chunk, no rank waits
//! for the slowest rank of the ring at every chunk, and a chunk received from the left is
//! forwarded to the right without waiting for this rank's own next receive.
//!
//! A received chunk to be reduced lands in a chunk-sized scratch buffer (cache-resident) and
//! is combined into its destination at once; a chunk to be kept is read straight into place.

use super::super::error::Result;
use super::super::scalar::{ReduceOp, Scalar};
use super::Ctx;
use std::ops::Range;
use std::time::Instant;

/// Where a sent chunk's elements come from.
#[derive(Debug, Clone)]
pub(crate) enum Src {
    /// The output buffer (what earlier receives wrote, or the caller's data in place).
    Out(Range<usize>),
    /// The read-only input buffer.
    In(Range<usize>),
}

/// What happens to a received chunk.
#[derive(Debug, Clone)]
pub(crate) enum Sink {
    /// Copied into the output buffer.
    Copy(Range<usize>),
    /// Combined with `op` into `out[dst]`: `out[dst] op= chunk` when `own` is `None`, else
    /// `out[dst] = in[own] op chunk`. With `avg`, the result is then divided by the rank count
    /// (the last reduction of an `Avg`).
    Reduce {
        dst: Range<usize>,
        own: Option<Range<usize>>,
        avg: bool,
    },
}

impl Sink {
    fn len(&self) -> usize {
        match self {
            Sink::Copy(r) | Sink::Reduce { dst: r, .. } => r.len(),
        }
    }
}

/// A message to send: to group rank `peer` with `tag`, after receive number `after` (an index
/// into the receive list) is complete.
#[derive(Debug, Clone)]
pub(crate) struct SendMsg {
    pub peer: usize,
    pub tag: u64,
    pub src: Src,
    pub after: Option<usize>,
}

/// A message to receive from group rank `peer` with `tag`.
#[derive(Debug, Clone)]
pub(crate) struct RecvMsg {
    pub peer: usize,
    pub tag: u64,
    pub sink: Sink,
}

/// The two ordered message lists of one rank's part of a call, generated on demand. Messages
/// to one peer are sent in list order and each peer lists its receives from this rank in the
/// same order; a send's `after` must point to an earlier receive.
pub(crate) trait Schedule {
    fn sends(&self) -> usize;
    fn send(&self, i: usize) -> SendMsg;
    fn recvs(&self) -> usize;
    fn recv(&self, i: usize) -> RecvMsg;
}

/// The buffers a schedule works on.
pub(crate) struct Bufs<'a, T> {
    /// Destination of receives, source of [`Src::Out`] sends.
    pub out: &'a mut [T],
    /// Source of [`Src::In`] sends and of the own operand of out-of-place reductions.
    pub inp: &'a [T],
    /// Scratch for chunks to be reduced: at least as long as the longest such chunk.
    pub tmp: &'a mut [T],
}

/// Runs `s` to completion (or failure) on this rank.
pub(crate) fn run<T: Scalar>(
    ctx: &mut Ctx<'_>,
    s: &impl Schedule,
    b: Bufs<'_, T>,
    op: ReduceOp,
) -> Result<()> {
    let Bufs { out, inp, tmp } = b;
    let ranks = ctx.size();
    let size = std::mem::size_of::<T>();
    let (ns, nr) = (s.sends(), s.recvs());
    // Current send and receive, with the bytes done of each.
    let (mut si, mut sent) = (0usize, 0usize);
    let (mut ri, mut got) = (0usize, 0usize);
    let mut cur_send = (ns > 0).then(|| s.send(0));
    let mut cur_recv = (nr > 0).then(|| s.recv(0));
    let mut last_progress = Instant::now();
    loop {
        let mut progressed = false;
        // Receives first: what arrives may release sends. One chunk per pass, so that what
        // it released leaves before more is read; a pass that moved bytes is followed by
        // another without sleeping, so a link may be left before it would block.
        if let Some(m) = &cur_recv {
            let len = m.sink.len();
            if ctx.ch.recv_header(&ctx.call, m.peer, m.tag, len * size)? {
                let before = got;
                let buf: &mut [u8] = match &m.sink {
                    Sink::Copy(r) => bytemuck::cast_slice_mut(&mut out[r.clone()]),
                    Sink::Reduce { .. } => bytemuck::cast_slice_mut(&mut tmp[..len]),
                };
                let complete = ctx.ch.recv_payload(&ctx.call, m.peer, buf, &mut got)?;
                progressed |= got != before;
                if complete {
                    if let Sink::Reduce { dst, own, avg } = &m.sink {
                        let d = &mut out[dst.clone()];
                        if let Some(own) = own {
                            d.copy_from_slice(&inp[own.clone()]);
                        }
                        T::reduce_into(d, &tmp[..len], op);
                        if *avg {
                            T::finish_avg(d, ranks);
                        }
                    }
                    progressed = true;
                    ri += 1;
                    got = 0;
                    cur_recv = (ri < nr).then(|| s.recv(ri));
                }
            }
        }
        // Then every send whose data is ready, in order.
        while let Some(m) = &cur_send {
            if m.after.is_some_and(|a| a >= ri) {
                break;
            }
            let data: &[u8] = match &m.src {
                Src::Out(r) => bytemuck::cast_slice(&out[r.clone()]),
                Src::In(r) => bytemuck::cast_slice(&inp[r.clone()]),
            };
            let before = sent;
            let complete = ctx
                .ch
                .send_frame(&ctx.call, m.peer, m.tag, data, &mut sent)?;
            progressed |= sent != before;
            if !complete {
                break;
            }
            si += 1;
            sent = 0;
            cur_send = (si < ns).then(|| s.send(si));
        }
        if cur_send.is_none() && cur_recv.is_none() {
            return ctx.ch.finish(&ctx.call);
        }
        if progressed {
            last_progress = Instant::now();
            ctx.ch.check_deadline(&ctx.call)?;
            continue;
        }
        let busy = cur_recv.as_ref().map(|m| m.peer);
        ctx.ch
            .idle(&mut ctx.call, |g| Some(g) == busy, last_progress)?;
    }
}
