//! Pipelined chains for large rooted collectives: the buffer is cut into chunks that flow
//! rank to rank, so every link carries the whole buffer once and the pipeline fills in one
//! chunk time per hop.

use super::super::channel::{RecvOp, SendOp};
use super::super::error::Result;
use super::super::partition::{chunk_of, chunks, split_disjoint};
use super::super::scalar::{ReduceOp, Scalar};
use super::{tag, Ctx, Scratch};

/// Broadcast along root, root+1, ..., root+n-1: each rank receives chunk c while it forwards
/// chunk c-1.
pub(crate) fn broadcast<T: Scalar>(ctx: &mut Ctx<'_>, buf: &mut [T], root: usize) -> Result<()> {
    let (n, r) = (ctx.size(), ctx.rank());
    if n == 1 {
        return Ok(());
    }
    let vr = (r + n - root) % n;
    let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
    let ch = ctx.chunk_elems::<T>();
    let all = 0..buf.len();
    let k = chunks(buf.len(), ch);
    let has_next = vr + 1 < n;
    for i in 0..=k {
        let recv_c = (vr > 0 && i < k).then_some(i);
        let send_c = if vr == 0 {
            (i < k).then_some(i)
        } else {
            (has_next && i >= 1).then(|| i - 1)
        };
        match (send_c, recv_c) {
            (Some(s), Some(c)) => {
                let (data, into) =
                    split_disjoint(buf, chunk_of(&all, ch, s), chunk_of(&all, ch, c));
                ctx.exchange(
                    &[SendOp {
                        peer: next,
                        tag: tag(6, 0, s),
                        data: bytemuck::cast_slice(data),
                    }],
                    &mut [RecvOp {
                        peer: prev,
                        tag: tag(6, 0, c),
                        buf: bytemuck::cast_slice_mut(into),
                    }],
                )?;
            }
            (Some(s), None) => ctx.send(next, tag(6, 0, s), &buf[chunk_of(&all, ch, s)])?,
            (None, Some(c)) => ctx.recv(prev, tag(6, 0, c), &mut buf[chunk_of(&all, ch, c)])?,
            (None, None) => {}
        }
    }
    Ok(())
}

/// Reduce along root+n-1, ..., root+1, root: each rank receives the partial chunk c from its
/// successor, adds its own, and passes it on while the next chunk arrives. Non-root buffers are
/// left unchanged.
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
    let (from, to) = ((r + 1) % n, (r + n - 1) % n);
    let ch = ctx.chunk_elems::<T>();
    let all = 0..buf.len();
    let k = chunks(buf.len(), ch);
    let is_tail = vr == n - 1;
    let middle = vr > 0 && !is_tail;
    let (acc, tmp) = scratch.take2::<T>(if middle { buf.len() } else { 0 }, ch.min(buf.len()));
    for i in 0..=k {
        let recv_c = (!is_tail && i < k).then_some(i);
        let send_c = if is_tail {
            (i < k).then_some(i)
        } else {
            (vr > 0 && i >= 1).then(|| i - 1)
        };
        let src: &[T] = if middle { acc } else { buf };
        let sends = send_c.map(|s| SendOp {
            peer: to,
            tag: tag(7, 0, s),
            data: bytemuck::cast_slice(&src[chunk_of(&all, ch, s)]),
        });
        let rc = recv_c.map(|c| chunk_of(&all, ch, c));
        let t = &mut tmp[..rc.as_ref().map_or(0, |c| c.len())];
        let mut recvs = rc.as_ref().map(|_| RecvOp {
            peer: from,
            tag: tag(7, 0, i),
            buf: bytemuck::cast_slice_mut(t),
        });
        ctx.exchange(sends.as_slice(), recvs.as_mut_slice())?;
        if let Some(c) = rc {
            let t = &tmp[..c.len()];
            if middle {
                acc[c.clone()].copy_from_slice(&buf[c.clone()]);
                T::reduce_into(&mut acc[c], t, op);
            } else {
                T::reduce_into(&mut buf[c], t, op);
            }
        }
    }
    if vr == 0 && op == ReduceOp::Avg {
        T::finish_avg(buf, n);
    }
    Ok(())
}
