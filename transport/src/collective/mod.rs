//! Collectives: broadcast, scatter, gather, reduce, all-reduce, all-gather, reduce-scatter and
//! all-to-all over a group of ranks, with no knowledge of graphs.
//!
//! The layers, bottom up:
//! - [`Pairs`]: a non-blocking byte stream between every pair of ranks. Backends:
//!   [`InProcPairs`] (threads of one process), [`TcpPairs`] (one TCP connection per pair) and
//!   [`ShmPairs`] (processes of one host: a byte ring per pair in shared memory).
//! - [`Channel`]: frames with a fixed 48-byte header (fingerprint, tag, length) received
//!   straight into the caller's buffer; `send`/`recv_into` and [`Channel::exchange`], which
//!   drives many sends and receives at once. It checks fingerprints, spreads aborts, announces
//!   and reports stalls, and enforces each call's deadline.
//! - [`Communicator`]: the collectives on typed slices ([`Scalar`]: f32, f64, i32, i64, bf16),
//!   algorithm choice by size ([`Algorithm`]), subgroups, asynchronous [`Handle`]s.
//!
//! ```
//! use dflow_transport::collective::{CommOptions, Communicator, ReduceOp};
//!
//! let comms = Communicator::in_process(3, CommOptions::default());
//! let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
//!     let joins: Vec<_> = comms
//!         .into_iter()
//!         .map(|c| {
//!             s.spawn(move || {
//!                 let mut x = vec![c.rank() as f32; 4];
//!                 c.all_reduce(&mut x, ReduceOp::Sum).map(|()| x)
//!             })
//!         })
//!         .collect();
//!     joins.into_iter().map(|j| j.join().unwrap().unwrap()).collect()
//! });
//! assert!(sums.iter().all(|x| x == &[3.0; 4]));
//! ```

mod algo;
mod channel;
mod communicator;
mod error;
mod fingerprint;
mod handle;
mod inproc;
mod pairs;
mod partition;
mod scalar;
#[cfg(target_os = "linux")]
mod shm;
mod tcp;

pub use algo::Algorithm;
pub use channel::{CallState, Channel, RecvOp, SendOp};
pub use communicator::{CommOptions, Communicator};
pub use error::{CollectiveError, Result};
pub use fingerprint::{CollectiveOp, Fingerprint, FrameKind, Header, HEADER_LEN, MAX_ABORT_LEN};
pub use handle::Handle;
pub use inproc::InProcPairs;
pub use pairs::{LinkError, Pairs};
pub use partition::block_range;
pub use scalar::{ReduceOp, Scalar};
#[cfg(target_os = "linux")]
pub use shm::{shm_group, ShmOptions, ShmPairs, ShmRendezvous};
pub use tcp::{loopback_group, TcpGroupListener, TcpOptions, TcpPairs};
