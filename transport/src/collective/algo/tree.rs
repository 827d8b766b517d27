//! Latency-optimal algorithms for small messages: recursive doubling for all-reduce (log2 n
//! rounds; ranks beyond the largest power of two fold into a partner first) and binomial trees
//! for broadcast and reduce.

use super::super::channel::SendOp;
use super::super::error::Result;
use super::super::scalar::{ReduceOp, Scalar};
use super::{tag, Ctx, Scratch};
use smallvec::SmallVec;

/// Recursive-doubling all-reduce. Partners combine the same two operands (a op b and b op a),
/// so every rank ends with bit-identical results.
pub(crate) fn all_reduce<T: Scalar>(
    ctx: &mut Ctx<'_>,
    scratch: &mut Scratch,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (ctx.size(), ctx.rank());
    if n == 1 {
        return Ok(());
    }
    let p2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let extra = n - p2;
    let tmp = scratch.take::<T>(buf.len());
    if r >= p2 {
        ctx.send(r - p2, tag(3, 0, 0), buf)?;
        ctx.recv(r - p2, tag(3, 1, 0), buf)?;
    } else {
        if r < extra {
            ctx.recv(r + p2, tag(3, 0, 0), tmp)?;
            T::reduce_into(buf, tmp, op);
        }
        let mut mask = 1;
        let mut round = 2;
        while mask < p2 {
            let partner = r ^ mask;
            ctx.send_recv(partner, buf, partner, tmp, tag(3, round, 0))?;
            T::reduce_into(buf, tmp, op);
            mask <<= 1;
            round += 1;
        }
        if r < extra {
            ctx.send(r + p2, tag(3, 1, 0), buf)?;
        }
    }
    if op == ReduceOp::Avg {
        T::finish_avg(buf, n);
    }
    Ok(())
}

/// Binomial-tree broadcast from `root`.
pub(crate) fn broadcast<T: Scalar>(ctx: &mut Ctx<'_>, buf: &mut [T], root: usize) -> Result<()> {
    let (n, r) = (ctx.size(), ctx.rank());
    let vr = (r + n - root) % n;
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            ctx.recv((vr - mask + root) % n, tag(4, 0, 0), buf)?;
            break;
        }
        mask <<= 1;
    }
    let mut sends: SmallVec<[SendOp<'_>; 8]> = SmallVec::new();
    mask >>= 1;
    while mask > 0 {
        if vr + mask < n {
            sends.push(SendOp {
                peer: (vr + mask + root) % n,
                tag: tag(4, 0, 0),
                data: bytemuck::cast_slice(buf),
            });
        }
        mask >>= 1;
    }
    if !sends.is_empty() {
        ctx.exchange(&sends, &mut [])?;
    }
    Ok(())
}

/// Binomial-tree reduce to `root`; other ranks' buffers are left unchanged.
pub(crate) fn reduce<T: Scalar>(
    ctx: &mut Ctx<'_>,
    scratch: &mut Scratch,
    buf: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (n, r) = (ctx.size(), ctx.rank());
    let vr = (r + n - root) % n;
    let (acc, tmp) = scratch.take2::<T>(if vr == 0 { 0 } else { buf.len() }, buf.len());
    let acc: &mut [T] = if vr == 0 {
        buf
    } else {
        acc.copy_from_slice(buf);
        acc
    };
    let mut mask = 1;
    while mask < n {
        if vr & mask == 0 {
            let src = vr | mask;
            if src < n {
                ctx.recv((src + root) % n, tag(5, 0, 0), tmp)?;
                T::reduce_into(acc, tmp, op);
            }
        } else {
            ctx.send((vr - mask + root) % n, tag(5, 0, 0), acc)?;
            break;
        }
        mask <<= 1;
    }
    if vr == 0 && op == ReduceOp::Avg {
        T::finish_avg(acc, n);
    }
    Ok(())
}
