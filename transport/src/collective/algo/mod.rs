//! The algorithms, each over a [`Ctx`] (one call on one rank) and typed buffers:
//! ring reduce-scatter and all-gather for large messages, recursive doubling and binomial trees
//! for small ones, pipelined chains for large rooted collectives, and direct exchanges for
//! scatter, gather and all-to-all.

pub(crate) mod chain;
pub(crate) mod direct;
pub(crate) mod ring;
pub(crate) mod stream;
pub(crate) mod tree;

use super::channel::{CallState, Channel, RecvOp, SendOp};
use super::error::Result;
use super::scalar::Scalar;

/// Which algorithm family a collective uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// Trees (recursive doubling, binomial) up to `CommOptions::small_bytes`, ring and chains
    /// above.
    #[default]
    Auto,
    /// Ring (all-reduce) and pipelined chains (broadcast, reduce) at every size.
    Ring,
    /// Recursive doubling (all-reduce) and binomial trees (broadcast, reduce) at every size.
    Tree,
}

/// One call on one rank: the channel, the call's state and the chunk size.
pub(crate) struct Ctx<'a> {
    pub ch: &'a mut Channel,
    pub call: CallState,
    pub chunk_bytes: usize,
}

impl Ctx<'_> {
    pub fn rank(&self) -> usize {
        self.call.rank()
    }

    pub fn size(&self) -> usize {
        self.call.size()
    }

    /// Elements of `T` per pipelined chunk.
    pub fn chunk_elems<T>(&self) -> usize {
        (self.chunk_bytes / std::mem::size_of::<T>()).max(1)
    }

    pub fn exchange(&mut self, sends: &[SendOp<'_>], recvs: &mut [RecvOp<'_>]) -> Result<()> {
        self.ch.exchange(&mut self.call, sends, recvs)
    }

    pub fn send<T: Scalar>(&mut self, peer: usize, tag: u64, data: &[T]) -> Result<()> {
        let data = bytemuck::cast_slice(data);
        self.exchange(&[SendOp { peer, tag, data }], &mut [])
    }

    pub fn recv<T: Scalar>(&mut self, peer: usize, tag: u64, buf: &mut [T]) -> Result<()> {
        let buf = bytemuck::cast_slice_mut(buf);
        self.exchange(&[], &mut [RecvOp { peer, tag, buf }])
    }

    /// Sends `data` to `to` while receiving `buf` from `from`.
    pub fn send_recv<T: Scalar>(
        &mut self,
        to: usize,
        data: &[T],
        from: usize,
        buf: &mut [T],
        tag: u64,
    ) -> Result<()> {
        let data = bytemuck::cast_slice(data);
        let buf = bytemuck::cast_slice_mut(buf);
        self.exchange(
            &[SendOp {
                peer: to,
                tag,
                data,
            }],
            &mut [RecvOp {
                peer: from,
                tag,
                buf,
            }],
        )
    }
}

/// Scratch memory kept by a communicator across calls (8-byte aligned, so any [`Scalar`]
/// view of it is aligned).
#[derive(Debug, Default)]
pub(crate) struct Scratch(Vec<u64>);

impl Scratch {
    /// Two disjoint scratch buffers of `a` and `b` elements.
    pub fn take2<T: Scalar>(&mut self, a: usize, b: usize) -> (&mut [T], &mut [T]) {
        let size = std::mem::size_of::<T>();
        let words = |n: usize| (n * size).div_ceil(8);
        let need = words(a) + words(b);
        if self.0.len() < need {
            self.0.resize(need, 0);
        }
        let (x, y) = self.0.split_at_mut(words(a));
        let x: &mut [u8] = bytemuck::cast_slice_mut(x);
        let y: &mut [u8] = bytemuck::cast_slice_mut(y);
        (
            bytemuck::cast_slice_mut(&mut x[..a * size]),
            bytemuck::cast_slice_mut(&mut y[..b * size]),
        )
    }

    /// One scratch buffer of `n` elements.
    pub fn take<T: Scalar>(&mut self, n: usize) -> &mut [T] {
        self.take2::<T>(n, 0).0
    }
}

/// The tag of chunk `c` of step `step` in phase `phase` of a call.
pub(crate) fn tag(phase: u64, step: usize, c: usize) -> u64 {
    (phase << 56) | ((step as u64) << 32) | c as u64
}
