//! Collectives where every rank talks to its peers directly, all messages in flight at once:
//! scatter and gather (root to each rank) and all-to-all (every pair).

use super::super::channel::{RecvOp, SendOp};
use super::super::error::Result;
use super::super::scalar::Scalar;
use super::{tag, Ctx};
use smallvec::SmallVec;

/// Root sends block i of `send` to rank i; every rank's block lands in `recv`.
pub(crate) fn scatter<T: Scalar>(
    ctx: &mut Ctx<'_>,
    send: &[T],
    recv: &mut [T],
    root: usize,
) -> Result<()> {
    let (n, r, k) = (ctx.size(), ctx.rank(), recv.len());
    if r != root {
        return ctx.recv(root, tag(8, 0, 0), recv);
    }
    let sends: SmallVec<[SendOp<'_>; 8]> = (0..n)
        .filter(|&i| i != r)
        .map(|i| SendOp {
            peer: i,
            tag: tag(8, 0, 0),
            data: bytemuck::cast_slice(&send[i * k..(i + 1) * k]),
        })
        .collect();
    ctx.exchange(&sends, &mut [])?;
    recv.copy_from_slice(&send[r * k..(r + 1) * k]);
    Ok(())
}

/// Every rank's `send` lands as block i of the root's `recv`.
pub(crate) fn gather<T: Scalar>(
    ctx: &mut Ctx<'_>,
    send: &[T],
    recv: &mut [T],
    root: usize,
) -> Result<()> {
    let (n, r, k) = (ctx.size(), ctx.rank(), send.len());
    if r != root {
        return ctx.send(root, tag(9, 0, 0), send);
    }
    recv[r * k..(r + 1) * k].copy_from_slice(send);
    let mut recvs: SmallVec<[RecvOp<'_>; 8]> = SmallVec::new();
    let mut rest = recv;
    for i in 0..n {
        let (b, tail) = rest.split_at_mut(k);
        rest = tail;
        if i != r {
            recvs.push(RecvOp {
                peer: i,
                tag: tag(9, 0, 0),
                buf: bytemuck::cast_slice_mut(b),
            });
        }
    }
    ctx.exchange(&[], &mut recvs)
}

/// Block j of `send` goes to rank j; block i of `recv` comes from rank i.
pub(crate) fn all_to_all<T: Scalar>(ctx: &mut Ctx<'_>, send: &[T], recv: &mut [T]) -> Result<()> {
    let (n, r) = (ctx.size(), ctx.rank());
    let k = send.len() / n;
    recv[r * k..(r + 1) * k].copy_from_slice(&send[r * k..(r + 1) * k]);
    let sends: SmallVec<[SendOp<'_>; 8]> = (0..n)
        .filter(|&i| i != r)
        .map(|i| SendOp {
            peer: i,
            tag: tag(10, 0, 0),
            data: bytemuck::cast_slice(&send[i * k..(i + 1) * k]),
        })
        .collect();
    let mut recvs: SmallVec<[RecvOp<'_>; 8]> = SmallVec::new();
    let mut rest = recv;
    for i in 0..n {
        let (b, tail) = rest.split_at_mut(k);
        rest = tail;
        if i != r {
            recvs.push(RecvOp {
                peer: i,
                tag: tag(10, 0, 0),
                buf: bytemuck::cast_slice_mut(b),
            });
        }
    }
    ctx.exchange(&sends, &mut recvs)
}
