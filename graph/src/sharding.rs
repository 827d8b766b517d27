//! Placements written on the graph: the `_sharding` attribute a node may carry on any op (a
//! variable's layout over the tensor-parallel ranks, or an op's forced output layout), and the
//! [`Placement`] type it names. The partitioner's sharding layer (`dflow_partitioner::sharding`)
//! propagates placements through ops and inserts the collectives that change them;
//! docs/tensor-parallel.md ("Placements by hand") shows the syntax.
//!
//! ```
//! use dflow_graph::sharding::{parse_sharding, Placement};
//! assert_eq!(parse_sharding("Shard(1)"), Ok(Placement::Shard(1)));
//! assert_eq!(parse_sharding("Replicate"), Ok(Placement::Replicate));
//! assert!(parse_sharding("Partial(sum)").unwrap_err().contains("Shard(d) or Replicate"));
//! ```

use crate::ops::{AttrDef, AttrDefault};
use crate::{AttrType, AttrValue, NodeDef};
use std::fmt;

/// The attribute naming a node's placement (a string, see [`parse_sharding`]); every op accepts
/// it. The leading underscore marks it as the partitioner's, not the op's (TensorFlow's `_class`).
pub const SHARDING_ATTR: &str = "_sharding";

/// The declaration of [`SHARDING_ATTR`] that every op shares.
pub(crate) static SHARDING_ATTR_DEF: AttrDef = AttrDef {
    name: SHARDING_ATTR,
    ty: AttrType::String,
    default: AttrDefault::Unset,
};

/// How a tensor lies over the ranks of one mesh axis (GSPMD, PyTorch DTensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Rank `r` holds the `r`-th of `N` equal slices along this dimension.
    Shard(usize),
    /// Every rank holds the whole tensor.
    Replicate,
    /// Every rank holds a tensor of the whole shape; the value is their element-wise sum.
    Partial,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "Shard({d})"),
            Placement::Replicate => f.write_str("Replicate"),
            Placement::Partial => f.write_str("Partial(sum)"),
        }
    }
}

/// What a `_sharding` value may be, for error messages.
pub const ACCEPTED: &str = "Shard(d) or Replicate (d: a dimension of the tensor, from 0)";

/// Parses a `_sharding` value: `Shard(d)` or `Replicate`. A partial sum is made by ops (a
/// row-parallel `MatMul`), never declared, so `Partial` is refused like any other word.
pub fn parse_sharding(s: &str) -> Result<Placement, String> {
    let t = s.trim();
    if t == "Replicate" {
        return Ok(Placement::Replicate);
    }
    if let Some(d) = t.strip_prefix("Shard(").and_then(|r| r.strip_suffix(')')) {
        return d.trim().parse::<usize>().map(Placement::Shard).map_err(|_| {
            format!("placement {s:?}: the dimension of Shard(d) must be an integer ≥ 0; write {ACCEPTED}")
        });
    }
    if t.starts_with("Partial") {
        return Err(format!(
            "placement {s:?}: a partial sum is made by ops (a row-parallel MatMul), not \
             declared; write {ACCEPTED}"
        ));
    }
    Err(format!("unknown placement {s:?}; write {ACCEPTED}"))
}

/// The placement `node` declares by [`SHARDING_ATTR`], if any; an error names the node and
/// says what is accepted.
pub fn node_sharding(node: &NodeDef) -> Result<Option<Placement>, String> {
    node.attrs
        .get(SHARDING_ATTR)
        .map(|v| sharding_value(&node.name, v))
        .transpose()
}

/// The placement the [`SHARDING_ATTR`] value `value` of node `node` declares; an error names
/// the node and says what is accepted.
pub fn sharding_value(node: &str, value: &AttrValue) -> Result<Placement, String> {
    match value {
        AttrValue::String(s) => parse_sharding(s).map_err(|e| format!("node `{node}`: {e}")),
        v => Err(format!(
            "node `{node}`: attribute `{SHARDING_ATTR}` is {}, not a string; write {ACCEPTED}",
            v.ty()
        )),
    }
}

/// The attribute value declaring `p` (what [`parse_sharding`] reads back).
pub fn sharding_attr(p: Placement) -> AttrValue {
    AttrValue::String(p.to_string().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_parse_and_print_back() {
        for p in [
            Placement::Shard(0),
            Placement::Shard(3),
            Placement::Replicate,
        ] {
            assert_eq!(parse_sharding(&p.to_string()), Ok(p));
        }
        assert_eq!(parse_sharding(" Shard( 2 ) "), Ok(Placement::Shard(2)));
        for bad in [
            "Shard(-1)",
            "Shard(x)",
            "shard(1)",
            "Partial",
            "Split(0)",
            "",
        ] {
            let e = parse_sharding(bad).unwrap_err();
            assert!(e.contains("Shard(d) or Replicate"), "{bad}: {e}");
        }
    }
}
