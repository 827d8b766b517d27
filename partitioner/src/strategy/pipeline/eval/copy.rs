//! Node builders of the evaluation, and the copy of one forward op into it.

use super::eval_name;
use crate::strategy::pipeline::PipelineError;
use crate::strategy::StrategyError;
use dflow_graph::{AttrValue, InputRef, NodeDef, Tensor};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

pub(super) fn node(name: String, op: &str, inputs: Vec<String>, device: &str) -> NodeDef {
    NodeDef {
        name,
        op: op.into(),
        inputs,
        device: device.to_string(),
        colocate_with: vec![],
        attrs: BTreeMap::new(),
    }
}

pub(super) fn constant(name: String, value: Tensor, device: &str) -> NodeDef {
    let mut c = node(name, "Const", vec![], device);
    c.attrs
        .insert("value".into(), AttrValue::Tensor(Arc::new(value)));
    c
}

/// The evaluation placeholder of feed `n`, on `device`.
pub(super) fn placeholder(n: &NodeDef, device: &str) -> NodeDef {
    let mut p = n.clone();
    p.name = eval_name(&n.name);
    p.device = device.to_string();
    p.colocate_with.clear();
    p
}

/// Where a copy reads output `index` of batch op (or placeholder) `node`: `Some(tensor)`, or
/// `None` for its own evaluation copy.
pub(super) type MapInput<'a> = dyn FnMut(&str, usize) -> Result<Option<String>, StrategyError> + 'a;

/// The name of `name`'s evaluation copy under `prefix` (`eval`, `eval/tp1`): the placeholders'
/// are `eval/<name>` whatever the prefix (one batch, fed once).
pub(super) fn copy_name(prefix: &str, feeds: &[&str], name: &str) -> String {
    if feeds.contains(&name) {
        eval_name(name)
    } else {
        format!("{prefix}/{name}")
    }
}

/// The copy `<prefix>/<op>` of batch op `n`, its data inputs mapped by `map` (`None`: the
/// input's own copy).
pub(super) fn copy_of(
    n: &NodeDef,
    device: &str,
    prefix: &str,
    batch: &HashSet<&str>,
    feeds: &[&str],
    map: &mut MapInput<'_>,
) -> Result<NodeDef, StrategyError> {
    let mut e = n.clone();
    e.name = copy_name(prefix, feeds, &n.name);
    e.device = device.to_string();
    let mut inputs = Vec::with_capacity(n.inputs.len());
    for i in &n.inputs {
        let r = InputRef::parse(i).map_err(|message| PipelineError::Input {
            node: n.name.clone(),
            message,
        })?;
        inputs.push(match r {
            InputRef::Data { node, index }
                if feeds.contains(&node.as_str()) || batch.contains(node.as_str()) =>
            {
                match map(&node, index)? {
                    Some(to) => to,
                    None => InputRef::Data {
                        node: copy_name(prefix, feeds, &node),
                        index,
                    }
                    .to_string(),
                }
            }
            InputRef::Control(node) if batch.contains(node.as_str()) => {
                format!("^{}", copy_name(prefix, feeds, &node))
            }
            _ => i.clone(),
        });
    }
    e.inputs = inputs;
    e.colocate_with = n
        .colocate_with
        .iter()
        .filter(|w| batch.contains(w.as_str()))
        .map(|w| copy_name(prefix, feeds, w))
        .collect();
    Ok(e)
}
