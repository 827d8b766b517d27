//! dflow's shared vocabulary: dtypes, shapes, tensors, device names, cluster specs, the graph IR,
//! the op registry, and the JSON and DSL graph formats.
#![warn(missing_docs, missing_debug_implementations)]
#![deny(unused_must_use)]

pub mod attr;
pub mod def;
pub mod dtype;
pub mod format;
pub mod ops;
pub mod shape;
pub mod tensor;

pub use attr::{AttrType, AttrValue};
pub use def::{GraphDef, InputRef, NodeDef};
pub use dtype::DType;
pub use format::{
    load_file, parse_dsl, parse_json, to_dsl, to_json, Format, FormatErrors, ParsedGraph,
};
pub use ops::{registry, OpDef, TensorType};
pub use shape::Shape;
pub use tensor::{Element, Tensor, TensorError};
