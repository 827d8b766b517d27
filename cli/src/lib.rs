//! dflow: one crate that re-exports the whole public API.
pub use dflow_executor as executor;
pub use dflow_graph as graph;
pub use dflow_partitioner as partitioner;
pub use dflow_transport as transport;
pub mod identity;
pub mod load;
