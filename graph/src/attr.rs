//! Node attributes: typed values whose types each op declares.

use crate::{DType, Shape, Tensor};
use serde::{Serialize, Serializer};
use serde_json::Value;
use std::fmt;
use std::sync::Arc;

/// The type of an attribute, as an op declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttrType {
    /// A signed integer.
    Int,
    /// A floating-point number.
    Float,
    /// A boolean.
    Bool,
    /// A string.
    String,
    /// A dtype name.
    DType,
    /// A shape (`-1` for unknown dims).
    Shape,
    /// A constant tensor value.
    Tensor,
    /// A list of integers (e.g. reduction axes).
    IntList,
    /// A list of strings.
    StringList,
}

impl fmt::Display for AttrType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttrType::Int => "int",
            AttrType::Float => "float",
            AttrType::Bool => "bool",
            AttrType::String => "string",
            AttrType::DType => "dtype",
            AttrType::Shape => "shape",
            AttrType::Tensor => "tensor",
            AttrType::IntList => "list(int)",
            AttrType::StringList => "list(string)",
        })
    }
}

/// A typed attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A string. Shared: copies of a node (e.g. the Send/Recv nodes of many pairs naming one
    /// device) hold one string, and cloning never copies it.
    String(Arc<str>),
    /// A dtype.
    DType(DType),
    /// A shape.
    Shape(Shape),
    /// A tensor constant. Behind a pointer, so that the other variants (every attribute of
    /// every node) do not pay for the tensor's size; shared, as the tensor's data already is.
    Tensor(Arc<Tensor>),
    /// A list of integers.
    IntList(Vec<i64>),
    /// A list of strings.
    StringList(Vec<String>),
}

impl AttrValue {
    /// The value's type.
    pub fn ty(&self) -> AttrType {
        match self {
            AttrValue::Int(_) => AttrType::Int,
            AttrValue::Float(_) => AttrType::Float,
            AttrValue::Bool(_) => AttrType::Bool,
            AttrValue::String(_) => AttrType::String,
            AttrValue::DType(_) => AttrType::DType,
            AttrValue::Shape(_) => AttrType::Shape,
            AttrValue::Tensor(_) => AttrType::Tensor,
            AttrValue::IntList(_) => AttrType::IntList,
            AttrValue::StringList(_) => AttrType::StringList,
        }
    }

    /// Interprets an untyped JSON value as an attribute of type `ty`.
    ///
    /// Files carry attributes untyped (`"transpose_a": true`); the op's declaration supplies the
    /// type. The error says what was expected and what was found.
    pub fn from_json(v: &Value, ty: AttrType) -> Result<AttrValue, String> {
        let found = || match v {
            Value::Null => "null".to_string(),
            Value::Bool(b) => format!("bool {b}"),
            Value::Number(n) => format!("number {n}"),
            Value::String(s) => format!("string {s:?}"),
            Value::Array(_) => "a list".to_string(),
            Value::Object(_) => "an object".to_string(),
        };
        let err = || format!("expected {ty}, found {}", found());
        Ok(match ty {
            AttrType::Int => AttrValue::Int(v.as_i64().ok_or_else(err)?),
            AttrType::Float => AttrValue::Float(v.as_f64().ok_or_else(err)?),
            AttrType::Bool => AttrValue::Bool(v.as_bool().ok_or_else(err)?),
            AttrType::String => AttrValue::String(v.as_str().ok_or_else(err)?.into()),
            AttrType::DType => {
                let s = v.as_str().ok_or_else(err)?;
                AttrValue::DType(
                    s.parse()
                        .map_err(|e: crate::dtype::UnknownDType| e.to_string())?,
                )
            }
            AttrType::Shape => AttrValue::Shape(
                serde_json::from_value::<Shape>(v.clone())
                    .map_err(|e| format!("{}: {e}", err()))?,
            ),
            AttrType::Tensor => AttrValue::Tensor(Arc::new(
                serde_json::from_value::<Tensor>(v.clone())
                    .map_err(|e| format!("invalid tensor: {e}"))?,
            )),
            AttrType::IntList => AttrValue::IntList(
                v.as_array()
                    .ok_or_else(err)?
                    .iter()
                    .map(|x| {
                        x.as_i64()
                            .ok_or_else(|| format!("expected {ty}, found element {x}"))
                    })
                    .collect::<Result<_, _>>()?,
            ),
            AttrType::StringList => AttrValue::StringList(
                v.as_array()
                    .ok_or_else(err)?
                    .iter()
                    .map(|x| {
                        x.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| format!("expected {ty}, found element {x}"))
                    })
                    .collect::<Result<_, _>>()?,
            ),
        })
    }

    /// The value as untyped JSON (the inverse of [`AttrValue::from_json`]).
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

impl Serialize for AttrValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            AttrValue::Int(i) => s.serialize_i64(*i),
            AttrValue::Float(x) => s.serialize_f64(*x),
            AttrValue::Bool(b) => s.serialize_bool(*b),
            AttrValue::String(x) => s.serialize_str(x),
            AttrValue::DType(d) => d.serialize(s),
            AttrValue::Shape(x) => x.serialize(s),
            AttrValue::Tensor(t) => (**t).serialize(s),
            AttrValue::IntList(v) => v.serialize(s),
            AttrValue::StringList(v) => v.serialize(s),
        }
    }
}

impl From<i64> for AttrValue {
    fn from(v: i64) -> Self {
        AttrValue::Int(v)
    }
}
impl From<f64> for AttrValue {
    fn from(v: f64) -> Self {
        AttrValue::Float(v)
    }
}
impl From<bool> for AttrValue {
    fn from(v: bool) -> Self {
        AttrValue::Bool(v)
    }
}
impl From<&str> for AttrValue {
    fn from(v: &str) -> Self {
        AttrValue::String(v.into())
    }
}
impl From<DType> for AttrValue {
    fn from(v: DType) -> Self {
        AttrValue::DType(v)
    }
}
impl From<Shape> for AttrValue {
    fn from(v: Shape) -> Self {
        AttrValue::Shape(v)
    }
}
impl From<Tensor> for AttrValue {
    fn from(v: Tensor) -> Self {
        AttrValue::Tensor(Arc::new(v))
    }
}
impl From<Vec<i64>> for AttrValue {
    fn from(v: Vec<i64>) -> Self {
        AttrValue::IntList(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_round_trip_through_declared_type() {
        let cases = [
            (json!(3), AttrType::Int),
            (json!(0.5), AttrType::Float),
            (json!(true), AttrType::Bool),
            (json!("x"), AttrType::String),
            (json!("f32"), AttrType::DType),
            (json!([-1, 4]), AttrType::Shape),
            (json!([0, 1]), AttrType::IntList),
            (json!(["loc:@a"]), AttrType::StringList),
            (
                json!({"dtype": "i32", "shape": [2], "values": [1, 2]}),
                AttrType::Tensor,
            ),
        ];
        for (v, ty) in cases {
            let a = AttrValue::from_json(&v, ty).unwrap();
            assert_eq!(a.ty(), ty);
            assert_eq!(a.to_json(), v);
        }
    }

    #[test]
    fn wrong_types_say_what_was_found() {
        let e = AttrValue::from_json(&json!("yes"), AttrType::Bool).unwrap_err();
        assert_eq!(e, "expected bool, found string \"yes\"");
        assert!(AttrValue::from_json(&json!("q8"), AttrType::DType).is_err());
        assert!(AttrValue::from_json(&json!([1, "a"]), AttrType::IntList).is_err());
    }
}
