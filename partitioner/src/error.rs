//! The partitioner's errors: one enum per stage, each variant naming the node and what was asked.

use std::fmt;

/// Why a graph could not be placed on a cluster.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// A node's device string is not a device name.
    #[error("node `{node}`: invalid device \"{requested}\": {message}")]
    InvalidDevice {
        /// The node.
        node: String,
        /// The device string as written.
        requested: String,
        /// What is wrong with it.
        message: String,
    },
    /// The default device given in the options is not usable.
    #[error("invalid default device \"{device}\": {message}")]
    InvalidDefault {
        /// The default device (canonical form).
        device: String,
        /// What is wrong with it.
        message: String,
    },
    /// No device of the cluster satisfies a node's request.
    #[error("node `{node}`: no device in the cluster matches \"{requested}\" ({reason}); devices: {}", Devices(.available))]
    NoSuchDevice {
        /// The node.
        node: String,
        /// The spec that was asked for, after merging with the policy and the default.
        requested: String,
        /// Why nothing matches, e.g. `no job "gpu"` or `job "worker" has tasks 0..1`.
        reason: String,
        /// Every device the cluster has.
        available: Vec<String>,
    },
    /// Two members of one colocation group request incompatible devices.
    #[error("colocation conflict: node `{node}` requests \"{node_device}\" but is colocated with `{other}` which requests \"{other_device}\" ({message})")]
    ColocationConflict {
        /// One node of the group.
        node: String,
        /// Its request.
        node_device: String,
        /// The group member it conflicts with.
        other: String,
        /// That member's request.
        other_device: String,
        /// Which part conflicts.
        message: String,
    },
    /// A colocation group's members request different jobs.
    #[error("colocation group spans jobs: node `{node}` requests job \"{node_job}\" but is colocated with `{other}` on job \"{other_job}\"")]
    ColocationSpansJobs {
        /// One node of the group.
        node: String,
        /// Its job.
        node_job: String,
        /// The group member on another job.
        other: String,
        /// That member's job.
        other_job: String,
    },
    /// `colocate_with` names a node that does not exist.
    #[error("node `{node}`: colocate_with names unknown node `{target}`")]
    UnknownColocation {
        /// The node.
        node: String,
        /// The missing name.
        target: String,
    },
}

/// Why a placed graph could not be partitioned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartitionError {
    /// `devices` does not have one entry per node.
    #[error("placed graph has {nodes} nodes but {devices} device assignments")]
    DeviceCount {
        /// Nodes in the graph.
        nodes: usize,
        /// Entries in `devices`.
        devices: usize,
    },
    /// A node is assigned a partial device name.
    #[error("node `{node}` is placed on \"{device}\", which is not a full device name")]
    NotFullDevice {
        /// The node.
        node: String,
        /// Its device.
        device: String,
    },
    /// A feed or fetch names something that is not a tensor of the graph.
    #[error("{what} \"{tensor}\": {message}")]
    BadTensor {
        /// "feed" or "fetch".
        what: &'static str,
        /// The name as given.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// A target names no node of the graph.
    #[error("target \"{node}\" is not a node of the graph")]
    UnknownTarget {
        /// The name as given.
        node: String,
    },
    /// A reference edge connects two devices (colocation should have prevented it).
    #[error("reference edge `{producer}` -> `{consumer}` crosses devices ({producer_device} -> {consumer_device}); a reference input must be colocated with its variable")]
    RefEdgeCrossesDevices {
        /// The variable.
        producer: String,
        /// The op reading it by reference.
        consumer: String,
        /// The variable's device.
        producer_device: String,
        /// The consumer's device.
        consumer_device: String,
    },
    /// A fed tensor is consumed by reference.
    #[error(
        "feed \"{tensor}\" is read by reference by `{consumer}`; a reference input cannot be fed"
    )]
    FeedIntoRef {
        /// The fed tensor.
        tensor: String,
        /// The consumer.
        consumer: String,
    },
    /// A partition failed validation (a bug in the partitioner; the message says where).
    #[error("partition for {device} is invalid: {message}")]
    InvalidPartition {
        /// The device.
        device: String,
        /// The validation errors.
        message: String,
    },
}

/// Why a JSON rendering of partitions could not be loaded back.
#[derive(Debug, thiserror::Error)]
pub enum PartitionsJsonError {
    /// Not JSON of the expected shape.
    #[error("invalid partitions JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A graph inside is not a valid GraphDef.
    #[error("partition for {device}: {message}")]
    Graph {
        /// The partition's device.
        device: String,
        /// What is wrong.
        message: String,
    },
}

struct Devices<'a>(&'a [String]);

impl fmt::Display for Devices<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("(none)");
        }
        f.write_str(&self.0.join(", "))
    }
}
