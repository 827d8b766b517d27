//! The byte level under the collectives: one ordered, reliable byte stream between every pair
//! of ranks, driven without blocking. A backend implements [`Pairs`]; framing, fingerprints,
//! timeouts and aborts live above it in [`super::Channel`], so the in-process, TCP and a later
//! shared-memory backend share all of that.

use super::error::{CollectiveError, Result};
use std::io::{self, IoSlice};
use std::time::Instant;

/// Why a link to a peer failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The peer closed its end (it exited or dropped its communicator).
    #[error("connection closed by the peer")]
    Closed,
    /// The transport failed.
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Non-blocking byte streams from this rank to every other rank.
///
/// `try_write` and `try_read` never block: they move what they can now (possibly nothing) and
/// return the byte count. `wait` blocks until some link may have become readable or writable, or
/// `until`; it may return early. A backend keeps its own buffers; the caller's slices are only
/// borrowed for the call.
pub trait Pairs: Send {
    /// This rank, in `0..size`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// Writes a prefix of the concatenation of `bufs` to `peer`; `Ok(0)` when it would block.
    fn try_write(&mut self, peer: usize, bufs: &[IoSlice<'_>]) -> Result<usize, LinkError>;
    /// Reads into `buf` from `peer`; `Ok(0)` when nothing is available yet.
    fn try_read(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize, LinkError>;
    /// Blocks until some link may make progress, or until `until`.
    fn wait(&mut self, until: Instant) -> Result<(), LinkError>;
    /// Describes the link to `peer` for messages (an address, or "in-process").
    fn describe(&self, peer: usize) -> String;
}

/// Runs `connect(rank, item)` for every rank's item on a thread of its own (each blocks until
/// its peers connect too) and returns the results in rank order: how the in-process groups of
/// the TCP and shared-memory backends (tests, single-process benchmarks) connect. A thread
/// that panics is a setup error of its rank.
pub(crate) fn connect_on_threads<T: Send, P: Send>(
    items: Vec<T>,
    connect: impl Fn(usize, T) -> Result<P> + Sync,
) -> Result<Vec<P>> {
    std::thread::scope(|s| {
        let joins: Vec<_> = items
            .into_iter()
            .enumerate()
            .map(|(r, item)| {
                let connect = &connect;
                s.spawn(move || connect(r, item))
            })
            .collect();
        joins
            .into_iter()
            .enumerate()
            .map(|(r, j)| {
                j.join().unwrap_or_else(|_| {
                    Err(CollectiveError::Setup {
                        rank: r,
                        problem: "connect thread panicked".into(),
                    })
                })
            })
            .collect()
    })
}
