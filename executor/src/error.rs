//! Executor errors: each names the node and device, or the rendezvous key and producing device.

use dflow_transport::RendezvousError;

/// Why a step (or setting one up) failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    /// Placement, partitioning or graph validation failed.
    #[error("{0}")]
    Setup(String),
    /// No kernel is registered for the op on this device type.
    #[error("node `{node}` ({op}) on {device}: no kernel for device type {device_type}")]
    NoKernel {
        /// Node name.
        node: String,
        /// Op type.
        op: String,
        /// Device name.
        device: String,
        /// Device type.
        device_type: dflow_graph::DeviceType,
    },
    /// A kernel could not be instantiated from its attributes.
    #[error("node `{node}` ({op}) on {device}: cannot build kernel: {error}")]
    KernelInit {
        /// Node name.
        node: String,
        /// Op type.
        op: String,
        /// Device name.
        device: String,
        /// What is wrong (boxed: it keeps `ExecError` small).
        error: Box<dflow_graph::OpError>,
    },
    /// A kernel failed at run time.
    #[error("node `{node}` ({op}) on {device}: {error}")]
    Kernel {
        /// Node name.
        node: String,
        /// Op type.
        op: String,
        /// Device name.
        device: String,
        /// What the kernel reported (boxed: it keeps `ExecError` small).
        error: Box<dflow_graph::OpError>,
    },
    /// A node's outputs would take the step's tensors past the task's memory limit.
    #[error(
        "node `{node}` ({op}) on {device}: the step's tensors would take {live} bytes on this task, past --memory-limit {limit}"
    )]
    MemoryLimit {
        /// Node name.
        node: String,
        /// Op type.
        op: String,
        /// Device name.
        device: String,
        /// The step's tensor bytes with this node's outputs.
        live: usize,
        /// The limit.
        limit: usize,
    },
    /// A Send or Recv failed.
    #[error("node `{node}` on {device}: {source}")]
    Transfer {
        /// Node name.
        node: String,
        /// Device name.
        device: String,
        /// The rendezvous error (aborted, timed out, peer gone, ...).
        source: Box<RendezvousError>,
    },
    /// A step did not finish in time; names what was still awaited.
    #[error(
        "step {step} timed out after {waited_ms} ms; still waiting for {}",
        describe_waits(waiting)
    )]
    Timeout {
        /// Step id.
        step: u64,
        /// Milliseconds waited.
        waited_ms: u64,
        /// (tensor, producing device, receiving device) still awaited.
        waiting: Vec<(String, String, String)>,
    },
    /// A feed does not match the graph.
    #[error("feed `{name}`: {message}")]
    Feed {
        /// Feed name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A fetch does not match the graph.
    #[error("fetch `{name}`: {message}")]
    Fetch {
        /// Fetch name.
        name: String,
        /// What is wrong.
        message: String,
    },
}

fn describe_waits(w: &[(String, String, String)]) -> String {
    if w.is_empty() {
        return "devices to finish (no Recv pending: a kernel is still running)".into();
    }
    let shown: Vec<String> = w
        .iter()
        .take(5)
        .map(|(t, from, to)| format!("tensor `{t}` from {from} on {to}"))
        .collect();
    let more = if w.len() > 5 {
        format!(" and {} more", w.len() - 5)
    } else {
        String::new()
    };
    format!("{}{more}", shown.join(", "))
}
