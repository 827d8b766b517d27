//! dflow's executor: compiles each partition into an execution plan once, runs steps with a
//! dataflow scheduler on a compute pool, and offers the [`Session`] API.
#![warn(missing_docs, missing_debug_implementations)]
#![deny(unused_must_use)]

mod arena;
pub mod checkpoint;
pub mod cluster;
pub mod data;
pub mod error;
pub mod memory;
pub mod npy;
pub mod plan;
mod run;
pub mod session;
mod slots;
mod step;
pub mod trace;
pub mod trainer;
pub mod variables;

pub use error::ExecError;
pub use memory::MemoryMeter;
pub use plan::ExecutionPlan;
pub use session::{Session, SessionOptions};
pub use trace::Tracer;
pub use variables::VariableStore;
