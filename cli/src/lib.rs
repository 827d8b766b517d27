//! dflow as a library: build a dataflow graph, let a strategy plan it over a cluster, pin the
//! plan with snapshot tests, and run it.
//!
//! This crate re-exports the four crates ([`graph`], [`partitioner`], [`executor`],
//! [`transport`]) and gathers the names a program needs in [`prelude`]. The path, in order:
//!
//! 1. **Build** a graph with [`GraphBuilder`](graph::builder::GraphBuilder) (or load a JSON /
//!    DSL file with [`load::load_graph`]). Ops name the device they want, e.g.
//!    `/job:ps/task:0` for variables.
//! 2. **Plan**: a [`Strategy`](partitioner::Strategy) (`ps`, `allreduce`, chosen by name through
//!    [`StrategyKind`](partitioner::StrategyKind)) rewrites the graph for the cluster and
//!    places and partitions it into a [`JobPlan`](partitioner::JobPlan): per run signature the
//!    per-device subgraphs joined by Send/Recv pairs, and one buffer slot per pair between
//!    tasks. Without a training strategy, [`place`](fn@partitioner::place) and
//!    [`partition`](fn@partitioner::partition) do the placing and partitioning of any graph.
//! 3. **Snapshot**: the renderings ([`render_text`](partitioner::render_text),
//!    [`render_job_text`](partitioner::render_job_text)) are deterministic, so a test can pin
//!    them with `insta::assert_snapshot!` and review every change to the partitioning (see the
//!    README's "Use dflow as a library").
//! 4. **Run**: a [`Session`](executor::Session) runs a graph over every device of a cluster in
//!    this process; `dflow run --job …` runs the job plan across processes.
//!
//! ```
//! use dflow::prelude::*;
//!
//! // 1. Build: a linear model, its variable on the parameter server.
//! let mut b = GraphBuilder::new();
//! let w = b.with_device("/job:ps/task:0", |b| b.variable("w", DType::F32, &[3, 1], "zeros"));
//! let x = b.placeholder("x", DType::F32, &[4, 3]);
//! let y = b.placeholder("y", DType::F32, &[4, 1]);
//! let p = b.matmul("p", &x, &w);
//! let d = b.binary("Sub", "d", &p, &y);
//! let sq = b.binary("Mul", "sq", &d, &d);
//! b.op("Mean", "loss").input(&sq).finish();
//! let graph = b.build().unwrap();
//! let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
//!
//! // 2. Plan: synchronous parameter-server training over both workers.
//! let train = TrainSpec::new("loss", OptimizerSpec { kind: OptimizerKind::Sgd, lr: 0.1 });
//! let strategy = "ps".parse::<StrategyKind>().unwrap().build(&StrategyOptions::default()).unwrap();
//! let plan = strategy.plan(&JobInput::new(&graph, &train, &cluster, "x", "y")).unwrap();
//!
//! // 3. Snapshot: the plan as text (a test would `insta::assert_snapshot!` it).
//! let text = render_job_text(&plan);
//! assert!(text.starts_with("job plan: sync parameter-server training"));
//! // The ps receives each worker's 12-byte gradient of `w` into its own slot.
//! assert_eq!(plan.recv_slots("/job:ps/replica:0/task:0").len(), 2);
//!
//! // 4. Run the forward graph in this process, every task of the cluster included.
//! let session = Session::new(graph, cluster, SessionOptions::default()).unwrap();
//! let ones = |rows| Tensor::from_slice(&[rows, 3], &vec![1.0f32; rows * 3]).unwrap();
//! let zeros = Tensor::from_slice(&[4, 1], &[0.0f32; 4]).unwrap();
//! let out = session.run(&[("x", ones(4)), ("y", zeros)], &["loss"], &[]).unwrap();
//! assert_eq!(out[0].as_slice::<f32>().unwrap(), &[0.0]); // w starts at zero
//! ```
#![warn(missing_docs)]

pub use dflow_executor as executor;
pub use dflow_graph as graph;
pub use dflow_partitioner as partitioner;
pub use dflow_transport as transport;
pub mod identity;
pub mod load;

/// The names most programs use: `use dflow::prelude::*;`.
pub mod prelude {
    pub use crate::load::{load_graph, load_program};
    pub use dflow_executor::{Session, SessionOptions};
    pub use dflow_graph::builder::GraphBuilder;
    pub use dflow_graph::train::{OptimizerKind, OptimizerSpec, TrainSpec};
    pub use dflow_graph::{ClusterSpec, DType, DeviceName, Graph, Shape, Tensor};
    pub use dflow_partitioner::{
        partition, place, render_dot, render_job_text, render_json, render_text, JobInput, JobPlan,
        PartitionOptions, Partitions, PlacementOptions, Strategy, StrategyKind, StrategyOptions,
    };
}
