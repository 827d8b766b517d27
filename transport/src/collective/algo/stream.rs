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

/// Bytes of a received chunk staged at a time before they are reduced: small enough to stay
/// in the core's cache between the copy in and the reduction.
pub(crate) const WINDOW: usize = 128 << 10;

/// Elements of the scratch a schedule with chunks of `chunk` elements needs.
pub(crate) fn tmp_elems<T>(chunk: usize) -> usize {
    (WINDOW / std::mem::size_of::<T>()).min(chunk).max(1)
}

/// A chunk being received and reduced window by window.
struct Window {
    dst: Range<usize>,
    own: Option<Range<usize>>,
    avg: bool,
    ranks: usize,
    op: ReduceOp,
}

impl Window {
    /// Reads what arrived of the chunk into `tmp` and reduces every whole element into
    /// `out[dst]`; `got` counts the chunk's bytes read. True once the chunk is done. A partial
    /// element waits at the front of `tmp` (the first `got % size` bytes).
    fn recv<T: Scalar>(
        &self,
        ctx: &mut Ctx<'_>,
        peer: usize,
        out: &mut [T],
        inp: &[T],
        tmp: &mut [T],
        got: &mut usize,
    ) -> Result<bool> {
        let size = std::mem::size_of::<T>();
        let total = self.dst.len() * size;
        let cap = std::mem::size_of_val(tmp);
        while *got < total {
            let (done, part) = (*got / size, *got % size);
            let want = (total - done * size).min(cap);
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut *tmp);
            let n = ctx.ch.recv_some(&ctx.call, peer, &mut bytes[part..want])?;
            if n == 0 {
                return Ok(false);
            }
            *got += n;
            let whole = (part + n) / size;
            let d = &mut out[self.dst.start + done..self.dst.start + done + whole];
            if let Some(own) = &self.own {
                d.copy_from_slice(&inp[own.start + done..own.start + done + whole]);
            }
            T::reduce_into(d, &tmp[..whole], self.op);
            if self.avg {
                T::finish_avg(d, self.ranks);
            }
            let rest = (part + n) % size;
            if rest > 0 {
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut *tmp);
                bytes.copy_within(whole * size..whole * size + rest, 0);
            }
        }
        // An empty chunk: its (empty) frame must still be consumed.
        ctx.ch.recv_payload(&ctx.call, peer, &mut [], &mut 0)
    }
}

/// The buffers a schedule works on.
pub(crate) struct Bufs<'a, T> {
    /// Destination of receives, source of [`Src::Out`] sends.
    pub out: &'a mut [T],
    /// Source of [`Src::In`] sends and of the own operand of out-of-place reductions.
    pub inp: &'a [T],
    /// Scratch for chunks to be reduced: at least one element when any is (see [`WINDOW`]).
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
                let complete = match &m.sink {
                    Sink::Copy(r) => {
                        let buf = bytemuck::cast_slice_mut(&mut out[r.clone()]);
                        ctx.ch.recv_payload(&ctx.call, m.peer, buf, &mut got)?
                    }
                    Sink::Reduce { dst, own, avg } => {
                        let w = Window {
                            dst: dst.clone(),
                            own: own.clone(),
                            avg: *avg,
                            ranks,
                            op,
                        };
                        w.recv(ctx, m.peer, out, inp, tmp, &mut got)?
                    }
                };
                progressed |= got != before;
                if complete {
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
