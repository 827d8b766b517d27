//! What an op's shape rule or kernel reports when it cannot run: one typed error for both, so
//! callers can tell a missing attribute from an input of the wrong dtype or a value out of
//! range. The executor and graph validation add the node, op and device.

use crate::{AttrType, DType};

/// Why an op's shape rule or kernel refused (the node is named by the caller).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpError {
    /// An input the op reads is not there.
    #[error("missing input {index}")]
    MissingInput {
        /// The input's position.
        index: usize,
    },
    /// An output the op sets does not exist.
    #[error("no output {index}")]
    MissingOutput {
        /// The output's position.
        index: usize,
    },
    /// A required attribute is not set.
    #[error("missing attribute `{name}`")]
    MissingAttr {
        /// The attribute.
        name: String,
    },
    /// An attribute holds another type than the op reads.
    #[error("attribute `{name}` is {found}, not {expected}")]
    AttrType {
        /// The attribute.
        name: String,
        /// Its type.
        found: AttrType,
        /// The type the op reads.
        expected: &'static str,
    },
    /// An input whose dtype must be floating point is not.
    #[error("{what} must be a float type, got {got}")]
    NotFloat {
        /// Which input (for the message).
        what: String,
        /// Its dtype.
        got: DType,
    },
    /// Two inputs whose dtypes must match differ.
    #[error("dtype mismatch: {a} vs {b}")]
    DTypeMismatch {
        /// The first input's dtype.
        a: DType,
        /// The second's.
        b: DType,
    },
    /// Anything else the op checks (shapes that do not fit, values out of range, memory that
    /// cannot be had), described.
    #[error("{0}")]
    Invalid(String),
}

impl From<String> for OpError {
    fn from(message: String) -> Self {
        OpError::Invalid(message)
    }
}

impl From<&str> for OpError {
    fn from(message: &str) -> Self {
        OpError::Invalid(message.to_string())
    }
}

impl From<OpError> for String {
    fn from(e: OpError) -> Self {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_is_wrong() {
        let e = OpError::AttrType {
            name: "axis".into(),
            found: AttrType::Float,
            expected: "int",
        };
        assert_eq!(e.to_string(), "attribute `axis` is float, not int");
        assert_eq!(
            OpError::from("shapes [2] and [3] differ".to_string()),
            OpError::Invalid("shapes [2] and [3] differ".into())
        );
        let back: String = OpError::MissingInput { index: 1 }.into();
        assert_eq!(back, "missing input 1");
    }
}
