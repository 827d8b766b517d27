//! Placements written on the graph: the `_sharding` attribute a node may carry on any op, and
//! the [`Placement`] and [`AxisPlacements`] types it names. A value places the node over the
//! axes of the device mesh (`--mesh dp=D,tp=T`), one placement per axis, axis-named and
//! comma-separated (`"dp:Shard(0),tp:Shard(1)"`); a single placement with no axis
//! (`"Shard(1)"`) is the tensor-parallel axis's, as it always was.
//!
//! - On the `tp` axis: a variable's layout over the tensor-parallel ranks, or an op's forced
//!   output layout. The partitioner's sharding layer (`dflow_partitioner::sharding`)
//!   propagates them through ops and inserts the collectives that change them.
//! - On the `dp` axis, on variables only: where the variable's training state lives over its
//!   data-parallel group. `Replicate` keeps it whole on every replica (gradients all-reduced);
//!   `Shard(0)` is ZeRO: its optimizer slots (and with `--zero-stage 2|3` its gradients and
//!   parameters) flattened and cut in `D` parts. The batch is always `Shard(0)` over `dp`.
//!
//! docs/tensor-parallel.md ("Placements by hand") shows the syntax.
//!
//! ```
//! use dflow_graph::sharding::{parse_sharding, AxisPlacements, Placement};
//! assert_eq!(parse_sharding("Shard(1)"), Ok(AxisPlacements::tp(Placement::Shard(1))));
//! let both = parse_sharding("dp:Shard(0),tp:Replicate").unwrap();
//! assert_eq!((both.dp, both.tp), (Some(Placement::Shard(0)), Some(Placement::Replicate)));
//! assert_eq!(both.to_string(), "dp:Shard(0),tp:Replicate");
//! assert!(parse_sharding("Partial(sum)").unwrap_err().contains("Shard(d) or Replicate"));
//! assert!(parse_sharding("ep:Shard(0)").unwrap_err().contains("the axes are dp, tp"));
//! ```

use crate::ops::{AttrDef, AttrDefault};
use crate::{AttrType, AttrValue, NodeDef};
use std::fmt;

/// The attribute naming a node's placements (a string, see [`parse_sharding`]); every op
/// accepts it. The leading underscore marks it as the partitioner's, not the op's
/// (TensorFlow's `_class`).
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

/// What one placement may be, for error messages.
pub const ACCEPTED: &str = "Shard(d) or Replicate (d: a dimension of the tensor, from 0)";

/// The mesh axes a `_sharding` value may name, in the order they are written.
pub const AXES: [&str; 2] = ["dp", "tp"];

/// What a `_sharding` value with axes may be, for error messages.
pub const ACCEPTED_AXES: &str = "axis:placement entries separated by commas, each axis (dp, tp) \
     at most once, e.g. \"dp:Shard(0),tp:Shard(1)\"; or one placement alone for the tp axis";

/// A node's placement on each mesh axis it names (`None`: not declared on that axis).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AxisPlacements {
    /// The data-parallel axis (variables only: `Replicate`, or `Shard(0)` for ZeRO).
    pub dp: Option<Placement>,
    /// The tensor-parallel axis.
    pub tp: Option<Placement>,
}

impl AxisPlacements {
    /// `p` on the tensor-parallel axis only (what a single placement with no axis means).
    pub fn tp(p: Placement) -> AxisPlacements {
        AxisPlacements {
            dp: None,
            tp: Some(p),
        }
    }

    /// `p` on the data-parallel axis only.
    pub fn dp(p: Placement) -> AxisPlacements {
        AxisPlacements {
            dp: Some(p),
            tp: None,
        }
    }

    /// The placement on `axis` (one of [`AXES`]), if declared.
    pub fn get(&self, axis: &str) -> Option<Placement> {
        match axis {
            "dp" => self.dp,
            "tp" => self.tp,
            _ => None,
        }
    }

    fn slot(&mut self, axis: &str) -> Option<&mut Option<Placement>> {
        match axis {
            "dp" => Some(&mut self.dp),
            "tp" => Some(&mut self.tp),
            _ => None,
        }
    }
}

/// Written axis-named, in the order of [`AXES`] (`dp:Replicate,tp:Shard(1)`); what
/// [`parse_sharding`] reads back.
impl fmt::Display for AxisPlacements {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for axis in AXES {
            if let Some(p) = self.get(axis) {
                if !first {
                    f.write_str(",")?;
                }
                first = false;
                write!(f, "{axis}:{p}")?;
            }
        }
        Ok(())
    }
}

/// Parses one placement: `Shard(d)` or `Replicate`. A partial sum is made by ops (a
/// row-parallel `MatMul`), never declared, so `Partial` is refused like any other word.
pub fn parse_placement(s: &str) -> Result<Placement, String> {
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

/// Parses a `_sharding` value: one placement ([`parse_placement`]), meaning the tensor-parallel
/// axis, or axis-named placements separated by commas (`dp:Replicate,tp:Shard(1)`), each axis
/// of [`AXES`] at most once. Errors name the axis and say what is accepted.
pub fn parse_sharding(s: &str) -> Result<AxisPlacements, String> {
    if !s.contains(':') {
        if s.contains(',') {
            return Err(format!(
                "{s:?}: several placements need their axes; write {ACCEPTED_AXES}"
            ));
        }
        return parse_placement(s).map(AxisPlacements::tp);
    }
    let mut out = AxisPlacements::default();
    for entry in s.split(',') {
        let Some((axis, placement)) = entry.split_once(':') else {
            return Err(format!(
                "{s:?}: entry {:?} names no axis; write {ACCEPTED_AXES}",
                entry.trim()
            ));
        };
        let axis = axis.trim();
        let Some(slot) = out.slot(axis) else {
            return Err(format!(
                "{s:?}: unknown mesh axis {axis:?}; the axes are {}; write {ACCEPTED_AXES}",
                AXES.join(", ")
            ));
        };
        if slot.is_some() {
            return Err(format!(
                "{s:?}: axis {axis:?} is given twice; write {ACCEPTED_AXES}"
            ));
        }
        *slot = Some(parse_placement(placement).map_err(|e| format!("axis {axis:?}: {e}"))?);
    }
    Ok(out)
}

/// Checks what a node of op `op` may declare beyond the syntax: on the data-parallel axis, only
/// a `Variable`, and only `Replicate` or `Shard(0)` (ZeRO's flat shards of its training state).
pub fn check_op_placements(op: &str, p: &AxisPlacements) -> Result<(), String> {
    match (p.dp, op == "Variable") {
        (None, _) | (Some(Placement::Replicate | Placement::Shard(0)), true) => Ok(()),
        (Some(d), true) => Err(format!(
            "dp:{d}: a variable's training state over the data-parallel axis is Replicate \
             (whole on every replica) or Shard(0) (ZeRO: flattened and cut over the replicas)"
        )),
        (Some(d), false) => Err(format!(
            "dp:{d} on a {op}: only variables take a data-parallel placement (their training \
             state); activations follow the batch, which is always Shard(0) over dp"
        )),
    }
}

/// The placements `node` declares by [`SHARDING_ATTR`], if any; an error names the node and
/// says what is accepted.
pub fn node_sharding(node: &NodeDef) -> Result<Option<AxisPlacements>, String> {
    node.attrs
        .get(SHARDING_ATTR)
        .map(|v| sharding_value(&node.name, v))
        .transpose()
}

/// The placements the [`SHARDING_ATTR`] value `value` of node `node` declares; an error names
/// the node and says what is accepted.
pub fn sharding_value(node: &str, value: &AttrValue) -> Result<AxisPlacements, String> {
    match value {
        AttrValue::String(s) => parse_sharding(s).map_err(|e| format!("node `{node}`: {e}")),
        v => Err(format!(
            "node `{node}`: attribute `{SHARDING_ATTR}` is {}, not a string; write {ACCEPTED}",
            v.ty()
        )),
    }
}

/// The attribute value declaring `p` on the tensor-parallel axis (the single form, what
/// [`parse_sharding`] reads back).
pub fn sharding_attr(p: Placement) -> AttrValue {
    AttrValue::String(p.to_string().into())
}

/// The attribute value declaring `p` axis by axis (what [`parse_sharding`] reads back).
pub fn placements_attr(p: AxisPlacements) -> AttrValue {
    AttrValue::String(p.to_string().into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn placements_parse_and_print_back() {
        for p in [
            Placement::Shard(0),
            Placement::Shard(3),
            Placement::Replicate,
        ] {
            assert_eq!(parse_placement(&p.to_string()), Ok(p));
            assert_eq!(parse_sharding(&p.to_string()), Ok(AxisPlacements::tp(p)));
        }
        assert_eq!(parse_placement(" Shard( 2 ) "), Ok(Placement::Shard(2)));
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

    #[test]
    fn axis_named_placements_parse_in_any_order_with_spaces() {
        let want = AxisPlacements {
            dp: Some(Placement::Shard(0)),
            tp: Some(Placement::Shard(1)),
        };
        assert_eq!(parse_sharding("dp:Shard(0),tp:Shard(1)"), Ok(want));
        assert_eq!(parse_sharding(" tp : Shard(1) , dp:Shard( 0 )"), Ok(want));
        assert_eq!(
            parse_sharding("dp:Replicate"),
            Ok(AxisPlacements::dp(Placement::Replicate))
        );
        assert_eq!(
            parse_sharding("tp:Shard(2)"),
            parse_sharding("Shard(2)"),
            "the single form is the tp axis"
        );
        assert_eq!(want.get("dp"), Some(Placement::Shard(0)));
        assert_eq!(want.get("pp"), None);
    }

    #[test]
    fn bad_axis_named_placements_name_the_axis_and_what_is_accepted() {
        let cases = [
            (
                "ep:Shard(0)",
                "unknown mesh axis \"ep\"; the axes are dp, tp",
            ),
            ("dp:Shard(0),dp:Replicate", "axis \"dp\" is given twice"),
            ("tp:Partial(sum)", "axis \"tp\": placement"),
            ("dp:Split(0)", "axis \"dp\": unknown placement \"Split(0)\""),
            ("Shard(1),dp:Replicate", "entry \"Shard(1)\" names no axis"),
            ("Shard(1),Replicate", "several placements need their axes"),
            ("dp:Replicate,", "entry \"\" names no axis"),
            (":Shard(0)", "unknown mesh axis \"\""),
        ];
        for (bad, want) in cases {
            let e = parse_sharding(bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
            assert!(
                e.contains("Shard(d) or Replicate") || e.contains("axis:placement"),
                "{bad}: {e}"
            );
        }
        let partial = parse_sharding("tp:Partial(sum)").unwrap_err();
        assert!(partial.contains("not declared"), "{partial}");
        // A value that is not a string names the node.
        let e = sharding_value("w", &AttrValue::Int(1)).unwrap_err();
        assert!(
            e.starts_with("node `w`: attribute `_sharding` is int"),
            "{e}"
        );
    }

    #[test]
    fn only_variables_take_a_dp_placement_and_only_replicate_or_shard_0() {
        let ok = |op: &str, s: &str| check_op_placements(op, &parse_sharding(s).unwrap());
        assert_eq!(ok("Variable", "dp:Shard(0),tp:Shard(1)"), Ok(()));
        assert_eq!(ok("Variable", "dp:Replicate"), Ok(()));
        assert_eq!(ok("MatMul", "tp:Shard(1)"), Ok(()));
        let e = ok("Variable", "dp:Shard(1)").unwrap_err();
        assert!(e.contains("dp:Shard(1)") && e.contains("Replicate"), "{e}");
        let e = ok("MatMul", "dp:Shard(0)").unwrap_err();
        assert!(
            e.contains("on a MatMul") && e.contains("only variables"),
            "{e}"
        );
    }

    fn placement() -> impl Strategy<Value = Option<Placement>> {
        prop_oneof![
            Just(None),
            Just(Some(Placement::Replicate)),
            (0usize..6).prop_map(|d| Some(Placement::Shard(d))),
        ]
    }

    proptest! {
        #[test]
        fn axis_placements_print_and_parse_back(dp in placement(), tp in placement()) {
            let p = AxisPlacements { dp, tp };
            prop_assume!(p != AxisPlacements::default());
            let text = p.to_string();
            prop_assert_eq!(parse_sharding(&text), Ok(p));
            prop_assert_eq!(sharding_value("n", &placements_attr(p)), Ok(p));
            if dp.is_none() {
                let single = tp.map(|t| t.to_string()).unwrap_or_default();
                prop_assert_eq!(parse_sharding(&single), Ok(p));
            }
        }

        #[test]
        fn arbitrary_text_never_panics(s in "\\PC{0,40}") {
            if let Ok(p) = parse_sharding(&s) {
                prop_assert_eq!(parse_sharding(&p.to_string()), Ok(p));
            }
        }
    }
}
