//! Distributed jobs: one process per task of a ClusterSpec.
//!
//! - [`protocol`]: the control-plane messages (RegisterGraph, RunStep, variables, abort,
//!   shutdown), carried by the data plane's authenticated connections.
//! - [`server`]: a task's graphs, variables and steps.
//! - [`node`]: joining the job (listen, connect to every task with a startup deadline), serving
//!   the chief, and the chief's request client with its failure handling.
//! - [`registration`]: learning the cluster from rank 0 when a launcher names only its address.
//! - [`chief`]: worker 0's driver: plans the job with its strategy, registers the plan on
//!   every task, and steps it.
//! - [`collectives`]: the collective groups a task joined, offered to collective kernels.

pub mod chief;
pub mod collectives;
pub mod node;
pub mod protocol;
pub mod registration;
pub mod server;

pub use chief::{
    plan_job, run_chief, task_registrations, ChiefConfig, ChiefData, ChiefReport, InitFrom,
};
pub use node::{bind_addr, task_name, JobError, Listening, Node, NodeOptions, Rpc};
pub use server::{ServerOptions, TaskHeld, TaskServer, TaskTraffic};
