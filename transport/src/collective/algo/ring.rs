//! Ring reduce-scatter and all-gather, chunked so that a large segment flows as a pipeline of
//! messages (the socket buffers keep both directions busy while a chunk is being reduced).
//! All-reduce is the two in a row: every rank sends and receives 2(n-1)/n of the buffer, the
//! bandwidth optimum.

use super::super::error::Result;
use super::super::partition::{block_range, chunk_of, chunks, split_disjoint};
use super::super::scalar::{ReduceOp, Scalar};
use super::{tag, Ctx, Scratch};

/// Reduces `buf` across the ring in place; afterwards block `rank` (by
/// [`block_range`]) holds the reduction of every rank's block. Other blocks hold partials.
pub(crate) fn reduce_scatter_in_place<T: Scalar>(
    ctx: &mut Ctx<'_>,
    tmp: &mut [T],
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (n, r, len) = (ctx.size(), ctx.rank(), buf.len());
    if n == 1 {
        return Ok(());
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let ch = ctx.chunk_elems::<T>();
    let k = chunks(block_range(len, n, 0).len(), ch);
    for step in 0..n - 1 {
        let sseg = block_range(len, n, (r + 2 * n - step - 1) % n);
        let rseg = block_range(len, n, (r + 2 * n - step - 2) % n);
        for c in 0..k {
            let (sc, rc) = (chunk_of(&sseg, ch, c), chunk_of(&rseg, ch, c));
            let t = &mut tmp[..rc.len()];
            ctx.send_recv(right, &buf[sc], left, t, tag(1, step, c))?;
            T::reduce_into(&mut buf[rc], t, op);
        }
    }
    Ok(())
}

/// Ring all-gather in place: block `rank` of `buf` is this rank's; afterwards every block is.
pub(crate) fn all_gather_in_place<T: Scalar>(ctx: &mut Ctx<'_>, buf: &mut [T]) -> Result<()> {
    let (n, r, len) = (ctx.size(), ctx.rank(), buf.len());
    if n == 1 {
        return Ok(());
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    let ch = ctx.chunk_elems::<T>();
    let k = chunks(block_range(len, n, 0).len(), ch);
    for step in 0..n - 1 {
        let sseg = block_range(len, n, (r + n - step) % n);
        let rseg = block_range(len, n, (r + 2 * n - step - 1) % n);
        for c in 0..k {
            let (sc, rc) = (chunk_of(&sseg, ch, c), chunk_of(&rseg, ch, c));
            let (s, t) = split_disjoint(buf, sc, rc);
            ctx.send_recv(right, s, left, t, tag(2, step, c))?;
        }
    }
    Ok(())
}

/// Ring all-reduce: reduce-scatter, then all-gather of the reduced blocks.
pub(crate) fn all_reduce<T: Scalar>(
    ctx: &mut Ctx<'_>,
    scratch: &mut Scratch,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let n = ctx.size();
    let tmp_len = ctx
        .chunk_elems::<T>()
        .min(block_range(buf.len(), n, 0).len());
    let tmp = scratch.take::<T>(tmp_len);
    reduce_scatter_in_place(ctx, tmp, buf, op)?;
    if op == ReduceOp::Avg {
        let own = block_range(buf.len(), n, ctx.rank());
        T::finish_avg(&mut buf[own], n);
    }
    all_gather_in_place(ctx, buf)
}
