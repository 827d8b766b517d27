//! dflow's shared vocabulary: dtypes, shapes, tensors, device names, cluster specs, the graph IR,
//! the op registry, and the JSON and DSL graph formats.
#![warn(missing_docs, missing_debug_implementations)]
#![deny(unused_must_use)]

pub mod attr;
mod attr_list;
pub mod autodiff;
pub mod axis_split;
pub mod builder;
pub mod cluster;
pub mod def;
pub mod device;
pub mod device_type;
pub mod dtype;
pub mod embedding_partition;
pub mod error;
pub mod format;
pub mod graph;
pub mod kernel;
pub mod layers;
mod name_index;
pub mod op_error;
pub mod ops;
pub mod rendezvous_key;
pub mod shape;
pub mod sharding;
pub mod tensor;
/// The TensorFlow GraphDef importer (it lives with the other formats, in [`format`]).
pub use format::tf_import;
pub mod tf_random;
pub mod train;

pub use attr::{AttrType, AttrValue};
pub use attr_list::Attrs;
pub use cluster::{ClusterSpec, TfConfig};
pub use def::{GraphDef, InputRef, NodeDef};
pub use device::DeviceName;
pub use device_type::DeviceType;
pub use dtype::DType;
pub use error::{GraphError, GraphErrors};
pub use format::{
    load_file, parse_dsl, parse_json, to_dsl, to_json, Format, FormatErrors, ParsedGraph,
};
pub use graph::{Edge, Graph, Node};
pub use op_error::OpError;
pub use ops::{registry, OpDef, TensorType};
pub use rendezvous_key::{BadRendezvousKey, RendezvousKey};
pub use shape::Shape;
pub use tensor::{Element, Tensor, TensorError};
