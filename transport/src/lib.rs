//! dflow's transport layer: the rendezvous where `Send` and `Recv` meet, and its backends.
//!
//! The transport knows nothing of graphs: it moves [`Tensor`]s between named endpoints,
//! identified by a [`RendezvousKey`] and a step id.
#![warn(missing_docs, missing_debug_implementations)]
#![deny(unused_must_use)]

pub mod auth;
pub mod collective;
pub mod config;
pub mod local;
pub mod plane;
pub mod quic;
pub mod rdma;
mod remote_waits;
pub mod rendezvous;
#[cfg(target_os = "linux")]
pub mod shm;
pub mod slots;
#[cfg(target_os = "linux")]
pub mod sockopt;
pub mod tcp;
pub mod wire;

pub use config::TcpConfig;
pub use dflow_graph::Tensor;
pub use local::LocalRendezvous;
pub use plane::{DataPlane, Link, PeerEvent, Plane, Traffic, TrafficCounter, TransportKind};
pub use rendezvous::{RecvCallback, Rendezvous, RendezvousError, RendezvousKey};
