//! Distributed jobs: one process per task of a ClusterSpec.
//!
//! - [`protocol`]: the control-plane messages (RegisterGraph, RunStep, variables, abort,
//!   shutdown), carried by the data plane's authenticated connections.
//! - [`server`]: a task's graphs, variables and steps.
//! - [`node`]: joining the job (listen, connect to every task with a startup deadline), serving
//!   the chief, and the chief's request client with its failure handling.
//! - [`chief`]: worker 0's driver for parameter-server training, sync or async.

pub mod chief;
pub mod node;
pub mod protocol;
pub mod server;

pub use chief::{run_chief, ChiefConfig, ChiefReport, Strategy};
pub use node::{task_name, JobError, Node, NodeOptions, Rpc};
pub use server::{ServerOptions, TaskServer};
