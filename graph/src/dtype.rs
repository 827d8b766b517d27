//! Element types of tensors.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The element type of a tensor.
///
/// Serialized as its lower-case short name (`"f32"`, `"bf16"`, ...). TensorFlow's names
/// (`"float32"`, `"DT_FLOAT"`, `"int64"`, ...) are accepted on input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Boolean, one byte per element (0 or 1).
    Bool,
    /// bfloat16 (via the `half` crate).
    BF16,
    /// IEEE half precision (via the `half` crate).
    F16,
}

impl DType {
    /// Every dtype, in a stable order.
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::Bool,
        DType::BF16,
        DType::F16,
    ];

    /// Bytes per element.
    pub fn size_of(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::Bool => 1,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// The canonical short name (`f32`, `i64`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// True for the floating-point types.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    /// True for the signed integer types.
    pub fn is_int(self) -> bool {
        matches!(self, DType::I32 | DType::I64)
    }

    /// True for types arithmetic ops accept (everything but bool).
    pub fn is_numeric(self) -> bool {
        self != DType::Bool
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error for an unrecognised dtype name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype `{0}` (expected one of f32, f64, i32, i64, bool, bf16, f16)")]
pub struct UnknownDType(pub String);

impl FromStr for DType {
    type Err = UnknownDType;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        let name = lower.strip_prefix("dt_").unwrap_or(&lower);
        Ok(match name {
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "i32" | "int32" => DType::I32,
            "i64" | "int64" => DType::I64,
            "bool" => DType::Bool,
            "bf16" | "bfloat16" => DType::BF16,
            "f16" | "float16" | "half" => DType::F16,
            _ => return Err(UnknownDType(s.to_string())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_tf_aliases_parse() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert_eq!("DT_FLOAT".parse::<DType>().unwrap(), DType::F32);
        assert_eq!("int64".parse::<DType>().unwrap(), DType::I64);
        assert!("complex64".parse::<DType>().is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(DType::BF16.size_of(), 2);
        assert_eq!(DType::Bool.size_of(), 1);
        assert_eq!(DType::F64.size_of(), 8);
    }
}
