//! A minimal GraphDef ⇄ JSON bridge in the dflow graph file layout
//! (`{"format": "dflow-graph", "version": 1, "nodes": [...]}`).
//!
//! Kept isolated so it can be swapped for `dflow_graph::format::{to_json, parse_json}` once that
//! module lands on main; the layout is the same. Unlike that reader, this one reports errors
//! without file positions.

use dflow_graph::{registry, AttrValue, GraphDef, NodeDef};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The value of the top-level `"format"` field.
pub const FORMAT_TAG: &str = "dflow-graph";

/// `def` as a JSON value (fields in a fixed order, empty fields left out).
pub fn to_value(def: &GraphDef) -> Value {
    let nodes = def
        .nodes
        .iter()
        .map(|n| {
            let mut o = Map::new();
            o.insert("name".into(), Value::String(n.name.clone()));
            o.insert("op".into(), Value::String(n.op.clone()));
            if !n.inputs.is_empty() {
                o.insert("inputs".into(), strings(&n.inputs));
            }
            if !n.device.is_empty() {
                o.insert("device".into(), Value::String(n.device.clone()));
            }
            if !n.colocate_with.is_empty() {
                o.insert("colocate_with".into(), strings(&n.colocate_with));
            }
            if !n.attrs.is_empty() {
                let attrs = n
                    .attrs
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_json()))
                    .collect::<Map<_, _>>();
                o.insert("attrs".into(), Value::Object(attrs));
            }
            Value::Object(o)
        })
        .collect();
    let mut top = Map::new();
    top.insert("format".into(), Value::String(FORMAT_TAG.into()));
    top.insert("version".into(), Value::from(def.version));
    top.insert("nodes".into(), Value::Array(nodes));
    Value::Object(top)
}

fn strings(v: &[String]) -> Value {
    Value::Array(v.iter().cloned().map(Value::String).collect())
}

/// Reads a GraphDef from a JSON value; attribute types come from each op's declaration.
pub fn from_value(v: &Value) -> Result<GraphDef, String> {
    let top = v.as_object().ok_or("graph must be a JSON object")?;
    if let Some(f) = top.get("format") {
        if f.as_str() != Some(FORMAT_TAG) {
            return Err(format!("\"format\" must be {FORMAT_TAG:?}, found {f}"));
        }
    }
    let version = top
        .get("version")
        .and_then(Value::as_u64)
        .ok_or("missing or invalid \"version\"")?;
    let version = u32::try_from(version).map_err(|_| format!("version {version} too large"))?;
    let nodes = top
        .get("nodes")
        .and_then(Value::as_array)
        .ok_or("missing \"nodes\" array")?;
    let mut out = Vec::with_capacity(nodes.len());
    for (i, n) in nodes.iter().enumerate() {
        out.push(node_from_value(n).map_err(|e| format!("nodes[{i}]: {e}"))?);
    }
    Ok(GraphDef {
        version,
        nodes: out,
        train: None,
    })
}

fn node_from_value(v: &Value) -> Result<NodeDef, String> {
    let o = v.as_object().ok_or("node must be an object")?;
    let string = |k: &str| -> Result<Option<String>, String> {
        match o.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(format!("\"{k}\" must be a string, found {other}")),
        }
    };
    let list = |k: &str| -> Result<Vec<String>, String> {
        match o.get(k) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| format!("\"{k}\" must hold strings, found {x}"))
                })
                .collect(),
            Some(other) => Err(format!("\"{k}\" must be a list, found {other}")),
        }
    };
    let name = string("name")?.ok_or("missing \"name\"")?;
    let op = string("op")?.ok_or_else(|| format!("node `{name}`: missing \"op\""))?;
    let def = registry()
        .get(&op)
        .ok_or_else(|| format!("node `{name}`: unknown op `{op}`"))?;
    let mut attrs = BTreeMap::new();
    if let Some(a) = o.get("attrs") {
        let a = a
            .as_object()
            .ok_or_else(|| format!("node `{name}`: \"attrs\" must be an object"))?;
        for (k, val) in a {
            let ty = def
                .attr(k)
                .ok_or_else(|| format!("node `{name}`: op `{op}` has no attribute `{k}`"))?
                .ty;
            let value = AttrValue::from_json(val, ty)
                .map_err(|e| format!("node `{name}`: attribute `{k}`: {e}"))?;
            attrs.insert(k.clone(), value);
        }
    }
    Ok(NodeDef {
        inputs: list("inputs")?,
        device: string("device")?.unwrap_or_default(),
        colocate_with: list("colocate_with")?,
        name,
        op,
        attrs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::{builder::GraphBuilder, DType};

    #[test]
    fn round_trips() {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[-1, 4]);
        let w = b.with_device("/job:ps", |b| b.variable("w", DType::F32, &[4, 2], "zeros"));
        let y = b.matmul("y", &x, &w);
        b.op("NoOp", "done").control_dep(&y).finish();
        let def = b.to_def();
        let back = from_value(&to_value(&def)).unwrap();
        assert_eq!(back, def);
    }

    #[test]
    fn errors_name_the_node() {
        let v = serde_json::json!({"version": 1, "nodes": [{"name": "a", "op": "Nope"}]});
        assert_eq!(
            from_value(&v).unwrap_err(),
            "nodes[0]: node `a`: unknown op `Nope`"
        );
        let v = serde_json::json!({"version": 1, "nodes": [{"name": "a", "op": "Const", "attrs": {"value": 3}}]});
        assert!(from_value(&v).unwrap_err().contains("attribute `value`"));
    }
}
