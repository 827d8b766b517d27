//! dflow's partitioner: strategies (graph rewrites for a cluster), placement, partitioning into
//! per-device subgraphs joined by Send/Recv pairs, the static buffer plan, the job plan that
//! ties them together, and deterministic renderings (text, JSON, Graphviz DOT).
//!
//! The stages, in order: [`strategy`] → [`place`](mod@place) → [`partition`](mod@partition) →
//! [`plan`] → [`job`].
//!
//! ```
//! use dflow_graph::{builder::GraphBuilder, ClusterSpec, DType};
//! use dflow_partitioner::{partition, place, render_text, PartitionOptions, PlacementOptions};
//!
//! let mut b = GraphBuilder::new();
//! let w = b.variable("w", DType::F32, &[4, 2], "zeros");
//! let x = b.placeholder("x", DType::F32, &[8, 4]);
//! let y = b.matmul("y", &x, &w);
//! let graph = b.build().unwrap();
//!
//! let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap();
//! let placed = place(&graph, &cluster, &PlacementOptions::default()).unwrap();
//! let parts = partition(&placed, &PartitionOptions::default()).unwrap();
//! assert_eq!(parts.partitions.len(), 2);
//! // `w` lives on ps and is read by `y` on the worker: one pair of 4*2*4 bytes.
//! assert_eq!(parts.pairs.len(), 1);
//! assert_eq!(&*parts.pairs[0].tensor_name, "w:0");
//! assert_eq!(parts.pairs[0].bytes, Some(32));
//! assert!(render_text(&parts).contains("send/w_0/to/worker_0"));
//! ```
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use)]

pub mod error;
pub mod job;
pub mod mesh;
pub mod partition;
pub mod place;
pub mod plan;
pub mod planner;
pub mod render;
pub mod sharding;
pub mod shards;
pub mod strategy;
pub mod synthetic;

pub use error::{PartitionError, PartitionsJsonError, PlacementError};
pub use job::{render_job_text, JobPlan, JobPlanError, Schedule, Signature, SignatureKind};
pub use partition::{
    partition, ClientEndpoint, Partition, PartitionOptions, Partitions, TransferPair,
};
pub use place::{place, PlacedGraph, PlacementOptions, Policy, PsStrategy};
pub use plan::{BufferPlan, SlotPlan};
pub use render::{load_json, render_dot, render_json, render_text};
pub use strategy::{
    ps_training, JobInput, PsMode, ReplicaGraph, Strategy, StrategyError, StrategyKind,
    StrategyOptions,
};
