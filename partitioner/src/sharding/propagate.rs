//! Placements written by hand (`_sharding` on the graph, [`dflow_graph::sharding`]) propagated
//! through a forward graph over `T` tensor-parallel ranks: each variable declared `Shard(d)`
//! becomes the rank's slice, every op's output placement follows from its inputs' by the
//! op's rule ([`super::rules`]), and where a rule refuses, an op has no rule, an op declares
//! another output placement, or a fetched tensor (the loss, a metric) is not whole, the
//! collective of the transition table ([`super::transition`]) is inserted. The result,
//! [`PlacementPlan`], is the same for every rank; `strategy::tensor::hand` writes it into each
//! rank's graph.
//!
//! The training graph of each rank is built by autodiff from the rewritten forward graph, and
//! every rank computes the same (replicated) loss, so the inserted ops are Megatron's `f` and
//! `g`, whose gradients are right for a replicated loss (`graph/src/ops/collective.rs`):
//!
//! - `Partial → Replicate`: `g`, `CollectiveTpReduce` (all-reduce forward, identity backward).
//! - `Shard(d) → Replicate`: every rank puts its shard in zeros at its place along `d` and `g`
//!   sums them — an all-gather sent as an all-reduce (`2(T−1)/T·B` instead of `(T−1)/T·B`)
//!   because `CollectiveAllGather`'s gradient is data parallelism's (a sum reduce-scatter,
//!   which a replicated loss would count `T` times); here the gradient is the rank's slice.
//! - A replicated tensor that depends on a variable and enters an op whose output is not
//!   replicated (a column-parallel `MatMul`, a bias or scale of a sharded or partial tensor):
//!   `f`, `CollectiveTpCopy` (identity forward), so its gradient, to which each rank
//!   contributes a part, is all-reduced backward.
//!
//! Only the rules whose op, run as is on each rank's pieces, gives the placement are used:
//! the embedding's vocabulary-sharded lookup and the vocabulary-parallel cross-entropy need the
//! GPT rewrite's own graphs (`strategy::tensor`), so here they make their inputs whole first.

use super::{rules, transition, Placement, Transition};
use dflow_graph::sharding::{sharding_value, SHARDING_ATTR};
use dflow_graph::{AttrValue, Graph, InputRef};
use petgraph::graph::NodeIndex;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

/// A variable cut over the ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardedVariable {
    /// The variable.
    pub name: String,
    /// Its whole dimensions.
    pub dims: Vec<usize>,
    /// The dimension cut (`Shard(axis)`).
    pub axis: usize,
}

/// What an inserted op does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Inserted {
    /// Megatron's `f` before an op whose output is not replicated: identity forward, the
    /// all-reduce of the gradient backward.
    Copy,
    /// `Partial → Replicate`: Megatron's `g`, an all-reduce forward.
    Reduce,
    /// `Shard(dim) → Replicate`: the rank's shard in zeros along `dim`, summed by `g`.
    Gather {
        /// The sharded dimension.
        dim: usize,
    },
}

/// One collective the rewrite inserts, on a tensor, for some consumers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Insert {
    /// The tensor it reads (`node` or `node:k`).
    pub tensor: String,
    /// What it does.
    pub kind: Inserted,
    /// The (consumer node, data input slot) pairs that read it instead of `tensor`.
    pub consumers: Vec<(String, usize)>,
    /// The tensor is fetched (the loss or a metric) and must be whole: the inserted op takes
    /// the tensor's name.
    pub fetched: bool,
    /// The tensor's whole size in bytes, when its shape is static.
    pub bytes: Option<usize>,
}

impl Insert {
    /// The op inserted.
    pub fn op(&self) -> &'static str {
        match self.kind {
            Inserted::Copy => "CollectiveTpCopy",
            Inserted::Reduce | Inserted::Gather { .. } => "CollectiveTpReduce",
        }
    }

    /// Bytes each of `tp` ranks sends per step, forward and backward (ring all-reduce,
    /// `2(T−1)/T` of the tensor); `None` where the shape is not static.
    pub fn bytes_sent(&self, tp: usize) -> (Option<usize>, Option<usize>) {
        let ring = self.bytes.map(|b| Transition::AllReduce.bytes_sent(b, tp));
        match self.kind {
            Inserted::Copy => (Some(0), ring),
            Inserted::Reduce | Inserted::Gather { .. } => (ring, Some(0)),
        }
    }
}

impl fmt::Display for Inserted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Inserted::Copy => f.write_str(
                "f: Replicate entering a sharded op; all-reduce of its gradient backward",
            ),
            Inserted::Reduce => f.write_str("Partial(sum) → Replicate: all-reduce (g)"),
            Inserted::Gather { dim } => write!(
                f,
                "Shard({dim}) → Replicate: all-gather along {dim} (zero-padded shards summed by g)"
            ),
        }
    }
}

/// The placements of a forward graph over `tp` ranks and the collectives to insert.
#[derive(Clone, Debug, PartialEq)]
pub struct PlacementPlan {
    /// The tensor-parallel size.
    pub tp: usize,
    /// Every node's placement (of each of its outputs), by name, after the rules.
    pub placements: BTreeMap<String, Placement>,
    /// The variables cut over the ranks, in graph order.
    pub sharded: Vec<ShardedVariable>,
    /// The collectives to insert, in topological order of the tensors they read.
    pub inserts: Vec<Insert>,
}

/// True when some node of `graph` declares a placement (`_sharding`).
pub fn declares_placements(graph: &Graph) -> bool {
    graph
        .node_indices()
        .any(|i| graph.node(i).attrs.get(SHARDING_ATTR).is_some())
}

/// The rank of `graph`'s output `(i, k)`, when known.
fn rank_of(graph: &Graph, i: NodeIndex, k: usize) -> Option<usize> {
    graph.output_type(i, k).and_then(|t| t.shape.rank())
}

fn tensor_name(graph: &Graph, i: NodeIndex, k: usize) -> String {
    let name = &graph.node(i).name;
    if k == 0 {
        name.clone()
    } else {
        format!("{name}:{k}")
    }
}

/// The op's sharding rule on its inputs' placements (`None`: the op has none here).
fn rule(
    graph: &Graph,
    i: NodeIndex,
    ins: &[Placement],
    ranks: &[Option<usize>],
) -> Option<Result<Placement, String>> {
    use Placement::*;
    let n = graph.node(i);
    let attr_bool = |k: &str| matches!(n.attrs.get(k), Some(AttrValue::Bool(true)));
    let out_rank = rank_of(graph, i, 0)?;
    let known: Option<Vec<usize>> = ranks.iter().copied().collect();
    let ranks = known?;
    let result = match (n.op, ins) {
        ("MatMul", [a, b]) if ranks == [2, 2] => {
            rules::matmul(*a, *b, attr_bool("transpose_a"), attr_bool("transpose_b"))
        }
        ("BatchMatMul", [a, b]) if ranks.iter().all(|&r| r == out_rank) => {
            rules::batch_matmul(*a, *b, out_rank)
        }
        (
            "Add" | "Sub" | "Mul" | "Div" | "AddN" | "BiasAdd" | "Maximum" | "Minimum" | "Relu"
            | "Gelu" | "Tanh" | "Sigmoid" | "Exp" | "Log" | "Neg" | "Square" | "Sqrt" | "Abs"
            | "Identity",
            _,
        ) if ranks.iter().all(|&r| r <= out_rank) => {
            let inputs: Vec<(Placement, usize)> =
                ins.iter().copied().zip(ranks.iter().copied()).collect();
            rules::elementwise(n.op, &inputs, out_rank)
        }
        ("Sum" | "Mean" | "Max" | "Min", [a]) => {
            let axes: Vec<usize> = match n.attrs.get("axes") {
                Some(AttrValue::IntList(v)) => v
                    .iter()
                    .map(|&x| if x < 0 { x + ranks[0] as i64 } else { x })
                    .filter_map(|x| usize::try_from(x).ok())
                    .collect(),
                _ => Vec::new(),
            };
            rules::reduce(n.op, *a, ranks[0], &axes, attr_bool("keep_dims"))
        }
        ("Softmax", [a]) => rules::last_axis("Softmax", *a, ranks[0]),
        ("LayerNorm", [a, rest @ ..]) => {
            if rest.iter().all(|p| *p == Replicate) {
                rules::last_axis("LayerNorm", *a, ranks[0])
            } else {
                Err("LayerNorm: the scale and offset must be replicated".into())
            }
        }
        // Only the lookups the plain kernel does on each rank's pieces.
        ("Gather", [t, ids]) => match rules::gather(*t, *ids, ranks[1]) {
            Ok(Partial) => Err(
                "Gather: a vocabulary-sharded table needs the masked lookup of the GPT \
                 rewrite"
                    .into(),
            ),
            r => r,
        },
        ("SparseSoftmaxCrossEntropyWithLogits", [l, t]) => {
            match (*l, rules::cross_entropy(*l, *t)) {
                (Shard(1), _) => Err(
                    "cross-entropy of vocabulary-sharded logits needs the GPT rewrite's \
                     vocabulary-parallel loss"
                        .into(),
                ),
                (_, r) => r,
            }
        }
        _ => return None,
    };
    Some(result)
}

/// Why the placements do not compose.
fn err(node: &str, what: impl fmt::Display) -> String {
    format!("node `{node}`: {what}")
}

/// Propagates the placements declared on `graph` over `tp` ranks (see the module docs);
/// `fetched` are the tensors the job fetches (the loss and the metrics), which must be whole.
/// Errors name the node and the placements that do not compose.
pub fn propagate(graph: &Graph, tp: usize, fetched: &[String]) -> Result<PlacementPlan, String> {
    use Placement::*;
    if tp == 0 {
        return Err("the tensor-parallel size must be at least 1".into());
    }
    let order = graph.topo_order();
    let mut place: HashMap<NodeIndex, Placement> = HashMap::new();
    // Nodes whose value depends on a variable (their gradients matter).
    let mut trainable: HashSet<NodeIndex> = HashSet::new();
    let mut sharded = Vec::new();
    // (tensor, kind) → index in `inserts`.
    let mut keyed: HashMap<(String, Inserted), usize> = HashMap::new();
    let mut inserts: Vec<Insert> = Vec::new();
    let bytes_of = |i: NodeIndex, k: usize| {
        graph
            .output_type(i, k)
            .and_then(|t| Some(t.shape.num_elements()? * t.dtype.size_of()))
    };
    let mut insert =
        |tensor: (NodeIndex, usize), kind: Inserted, consumer: Option<(&str, usize)>| {
            let name = tensor_name(graph, tensor.0, tensor.1);
            let at = *keyed.entry((name.clone(), kind)).or_insert_with(|| {
                inserts.push(Insert {
                    tensor: name,
                    kind,
                    consumers: Vec::new(),
                    fetched: false,
                    bytes: bytes_of(tensor.0, tensor.1),
                });
                inserts.len() - 1
            });
            match consumer {
                Some((c, slot)) => inserts[at].consumers.push((c.to_string(), slot)),
                None => inserts[at].fetched = true,
            }
        };
    // The transition of `p` to Replicate as an inserted op.
    let to_whole = |node: &str, p: Placement| -> Result<Option<Inserted>, String> {
        match transition(p, Replicate).map_err(|e| err(node, e))? {
            Transition::Nothing => Ok(None),
            Transition::AllReduce => Ok(Some(Inserted::Reduce)),
            Transition::AllGather { dim } => Ok(Some(Inserted::Gather { dim })),
            t => Err(err(node, format!("{p} → Replicate would need {t}"))),
        }
    };
    // Ops whose declared Replicate output is made whole for every consumer (their own
    // placement, before the conversion).
    let mut forced: HashSet<NodeIndex> = HashSet::new();
    // The sources declared sharded, in the graph's order (the first bad one is reported).
    for i in graph.node_indices() {
        let n = graph.node(i);
        if !graph.inputs(i).is_empty() {
            continue;
        }
        if let Some(v) = n.attrs.get(SHARDING_ATTR) {
            if let Shard(d) = sharding_value(&n.name, v)? {
                sharded.push(sharded_variable(graph, i, d, tp)?);
            }
        }
    }
    for &i in &order {
        let n = graph.node(i);
        let declared = match n.attrs.get(SHARDING_ATTR) {
            Some(v) => Some(sharding_value(&n.name, v)?),
            None => None,
        };
        let inputs = graph.inputs(i);
        if n.op == "Variable" || inputs.iter().any(|(p, _)| trainable.contains(p)) {
            trainable.insert(i);
        }
        if n.op == "Dropout" {
            return Err(err(
                &n.name,
                "dropout under tensor parallelism would draw a mask per rank; build the model \
                 without dropout",
            ));
        }
        if inputs.is_empty() {
            // Checked in the graph's order above.
            place.insert(i, declared.unwrap_or(Replicate));
            continue;
        }
        let mut ins: Vec<Placement> = inputs.iter().map(|(p, _)| place[p]).collect();
        let ranks: Vec<Option<usize>> = inputs.iter().map(|&(p, k)| rank_of(graph, p, k)).collect();
        // Inputs from ops declared Replicate are read whole.
        for (slot, &(p, k)) in inputs.iter().enumerate() {
            if forced.contains(&p) {
                if let Some(kind) = to_whole(&graph.node(p).name, ins[slot])? {
                    insert((p, k), kind, Some((&n.name, slot)));
                }
                ins[slot] = Replicate;
            }
        }
        // The rule; where it refuses, the partial sums made whole, then every input.
        let mut whole_inputs =
            |ins: &mut Vec<Placement>, only_partial: bool| -> Result<(), String> {
                for (slot, &(p, k)) in inputs.iter().enumerate() {
                    let q = ins[slot];
                    if q == Replicate || (only_partial && q != Partial) {
                        continue;
                    }
                    let kind = to_whole(&graph.node(p).name, q).map_err(|e| {
                        err(
                            &n.name,
                            format!("input {slot} ({q}) cannot be made whole: {e}"),
                        )
                    })?;
                    if let Some(kind) = kind {
                        insert((p, k), kind, Some((&n.name, slot)));
                    }
                    ins[slot] = Replicate;
                }
                Ok(())
            };
        let out = match rule(graph, i, &ins, &ranks) {
            None => {
                whole_inputs(&mut ins, false)?;
                Replicate
            }
            Some(Ok(p)) => p,
            Some(Err(first)) => {
                let given = list(&ins);
                whole_inputs(&mut ins, true)?;
                let retry = match rule(graph, i, &ins, &ranks) {
                    Some(Ok(p)) => Ok(p),
                    _ => {
                        whole_inputs(&mut ins, false)?;
                        match rule(graph, i, &ins, &ranks) {
                            Some(Ok(p)) => Ok(p),
                            _ => Err(()),
                        }
                    }
                };
                retry.map_err(|()| {
                    err(
                        &n.name,
                        format!("{} of inputs placed {given}: {first}", n.op),
                    )
                })?
            }
        };
        // A declared output placement: an op's output is converted only to Replicate; a
        // declared shard must be what its inputs give.
        match declared {
            Some(want) if want == out => {}
            Some(Replicate) => {
                forced.insert(i);
            }
            Some(want) => {
                return Err(err(
                    &n.name,
                    format!(
                        "declared {want}, but its inputs ({}) give {out}; an op's output is \
                         converted only to Replicate (declare Replicate, or change the \
                         inputs' placements)",
                        list(&ins)
                    ),
                ))
            }
            None => {}
        }
        // f before the replicated, trainable inputs of an op whose output is not replicated.
        if out != Replicate {
            for (slot, &(p, k)) in inputs.iter().enumerate() {
                if ins[slot] == Replicate && trainable.contains(&p) {
                    insert((p, k), Inserted::Copy, Some((&n.name, slot)));
                }
            }
        }
        place.insert(i, out);
    }
    // The fetched tensors, whole.
    for f in fetched {
        let (node, k) = match InputRef::parse(f) {
            Ok(InputRef::Data { node, index }) => (node, index),
            _ => return Err(format!("fetched tensor `{f}` is not a data output")),
        };
        let i = graph
            .find(&node)
            .ok_or_else(|| format!("fetched tensor `{f}`: no node named `{node}`"))?;
        if let Some(kind) = to_whole(&node, place[&i])? {
            if k != 0 {
                return Err(err(
                    &node,
                    format!(
                        "the fetched output {k} is {}; only an output 0 is made whole for a \
                         fetch (make it whole in the graph: an Identity declared Replicate)",
                        place[&i]
                    ),
                ));
            }
            insert((i, k), kind, None);
        }
    }
    let placements = order
        .iter()
        .map(|i| (graph.node(*i).name.clone(), place[i]))
        .collect();
    Ok(PlacementPlan {
        tp,
        placements,
        sharded,
        inserts,
    })
}

/// Checks `Shard(d)` of variable `i` over `tp` ranks.
fn sharded_variable(
    graph: &Graph,
    i: NodeIndex,
    d: usize,
    tp: usize,
) -> Result<ShardedVariable, String> {
    let n = graph.node(i);
    let p = Placement::Shard(d);
    if n.op != "Variable" {
        return Err(err(
            &n.name,
            format!(
                "{p} is declared on a {} (fed or built whole on every rank); only variables \
                 and ops may be declared sharded",
                n.op
            ),
        ));
    }
    let dims = graph
        .output_type(i, 0)
        .and_then(|t| t.shape.as_static())
        .ok_or_else(|| err(&n.name, "a sharded variable needs a static shape"))?;
    let Some(&len) = dims.get(d) else {
        return Err(err(
            &n.name,
            format!("{p} of a variable of shape {dims:?}, which has no dimension {d}"),
        ));
    };
    if len % tp != 0 {
        return Err(err(
            &n.name,
            format!(
                "{p}: dimension {d} of shape {dims:?} is {len}, which does not divide by --tp \
                 {tp}; pick a --tp that divides it or shard another dimension"
            ),
        ));
    }
    Ok(ShardedVariable {
        name: n.name.clone(),
        dims,
        axis: d,
    })
}

fn list(ps: &[Placement]) -> String {
    ps.iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::builder::GraphBuilder;
    use dflow_graph::DType;
    use Placement::*;

    /// x [4, 8] · w0 [8, 8] (replicated) → h0 · w1 [8, 6] (`w1`) → Relu → · w2 [6, 3] (`w2`)
    /// + b2 [3] → Sum: a replicated layer, then Megatron's MLP.
    fn mlp(w1: Option<Placement>, w2: Option<Placement>) -> Graph {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 8]);
        let w0 = b.variable("w0", DType::F32, &[8, 8], "ones");
        let v1 = b.variable("w1", DType::F32, &[8, 6], "ones");
        let v2 = b.variable("w2", DType::F32, &[6, 3], "ones");
        let b2 = b.variable("b2", DType::F32, &[3], "zeros");
        for (v, p) in [(&v1, w1), (&v2, w2)] {
            if let Some(p) = p {
                b.set_sharding(v, p);
            }
        }
        let h0 = b.matmul("h0", &x, &w0);
        let h1 = b.matmul("h1", &h0, &v1);
        let r = b.unary("Relu", "relu", &h1);
        let h2 = b.matmul("h2", &r, &v2);
        let y = b.op("BiasAdd", "y").input(&h2).input(&b2).finish();
        b.op("Sum", "loss").input(&y).finish();
        b.build().unwrap()
    }

    fn fetch() -> Vec<String> {
        vec!["loss".to_string()]
    }

    #[test]
    fn megatrons_mlp_by_hand_gets_f_before_the_column_layer_and_g_after_the_row_layer() {
        let g = mlp(Some(Shard(1)), Some(Shard(0)));
        let plan = propagate(&g, 2, &fetch()).unwrap();
        let at = |n: &str| plan.placements[n];
        assert_eq!(
            [
                at("h0"),
                at("h1"),
                at("relu"),
                at("h2"),
                at("y"),
                at("loss")
            ],
            [Replicate, Shard(1), Shard(1), Partial, Replicate, Replicate]
        );
        assert_eq!(
            plan.sharded,
            [
                ShardedVariable {
                    name: "w1".into(),
                    dims: vec![8, 6],
                    axis: 1
                },
                ShardedVariable {
                    name: "w2".into(),
                    dims: vec![6, 3],
                    axis: 0
                }
            ]
        );
        // f on h0 (trainable: it depends on w0) for the column-parallel h1; g on the partial
        // h2 for the replicated bias. The data x gets no f (no gradient flows to it).
        assert_eq!(
            plan.inserts,
            [
                Insert {
                    tensor: "h0".into(),
                    kind: Inserted::Copy,
                    consumers: vec![("h1".into(), 0)],
                    fetched: false,
                    bytes: Some(4 * 8 * 4),
                },
                Insert {
                    tensor: "h2".into(),
                    kind: Inserted::Reduce,
                    consumers: vec![("y".into(), 0)],
                    fetched: false,
                    bytes: Some(4 * 3 * 4),
                },
            ]
        );
        // Ring all-reduce bytes at T=2: 2(T−1)/T = 1× the tensor; f backward, g forward.
        assert_eq!(plan.inserts[0].bytes_sent(2), (Some(0), Some(128)));
        assert_eq!(plan.inserts[1].bytes_sent(2), (Some(48), Some(0)));
        assert_eq!(plan.inserts[1].bytes_sent(4), (Some(72), Some(0)));
    }

    #[test]
    fn a_shard_is_gathered_where_no_rule_takes_it() {
        // Only w1 sharded: the Relu stays sharded, the next MatMul has no rule for
        // Shard(1) · Replicate, so its input is gathered (zero-padded shards summed by g).
        let g = mlp(Some(Shard(1)), None);
        let plan = propagate(&g, 2, &fetch()).unwrap();
        assert_eq!(plan.placements["h2"], Replicate);
        let gather = plan
            .inserts
            .iter()
            .find(|i| i.kind == Inserted::Gather { dim: 1 })
            .unwrap();
        assert_eq!(gather.tensor, "relu");
        assert_eq!(gather.consumers, [("h2".to_string(), 0)]);
        assert_eq!(gather.bytes, Some(4 * 6 * 4));
        // w2 sharded by rows under a replicated input: Replicate · Shard(0) has no rule, so
        // the weight itself is gathered (a refusal falls back to whole inputs).
        let plan = propagate(&mlp(None, Some(Shard(0))), 2, &fetch()).unwrap();
        assert_eq!(plan.placements["h2"], Replicate);
        assert_eq!(
            plan.inserts,
            [Insert {
                tensor: "w2".into(),
                kind: Inserted::Gather { dim: 0 },
                consumers: vec![("h2".into(), 1)],
                fetched: false,
                bytes: Some(6 * 3 * 4),
            }]
        );
    }

    #[test]
    fn a_fetched_partial_sum_is_made_whole_under_its_own_name() {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 6]);
        // A Sum over the sharded columns of a column-parallel product is partial.
        let v = b.variable("v", DType::F32, &[6, 4], "ones");
        b.set_sharding(&v, Shard(1));
        let h = b.matmul("h", &x, &v);
        b.op("Sum", "loss").input(&h).finish();
        let g = b.build().unwrap();
        let plan = propagate(&g, 2, &fetch()).unwrap();
        assert_eq!(plan.placements["loss"], Partial);
        let last = plan.inserts.last().unwrap();
        assert_eq!(
            (last.tensor.as_str(), last.kind, last.fetched, last.bytes),
            ("loss", Inserted::Reduce, true, Some(4))
        );
    }

    #[test]
    fn placements_that_do_not_compose_are_refused_naming_the_node() {
        // 6 columns do not divide by 4.
        let e = propagate(&mlp(Some(Shard(1)), None), 4, &fetch()).unwrap_err();
        assert!(
            e.contains("node `w1`") && e.contains("does not divide by --tp 4"),
            "{e}"
        );
        // A dimension the variable does not have.
        let e = propagate(&mlp(Some(Shard(2)), None), 2, &fetch()).unwrap_err();
        assert!(
            e.contains("node `w1`") && e.contains("no dimension 2"),
            "{e}"
        );
        // A placeholder is fed whole.
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 8]);
        b.set_sharding(&x, Shard(0));
        b.op("Sum", "loss").input(&x).finish();
        let e = propagate(&b.build().unwrap(), 2, &fetch()).unwrap_err();
        assert!(
            e.contains("node `x`") && e.contains("only variables"),
            "{e}"
        );
        // An op declared Shard(0) whose inputs give Shard(1).
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 8]);
        let w = b.variable("w", DType::F32, &[8, 6], "ones");
        b.set_sharding(&w, Shard(1));
        let h = b
            .op("MatMul", "h")
            .input(&x)
            .input(&w)
            .sharding(Shard(0))
            .finish();
        b.op("Sum", "loss").input(&h).finish();
        let e = propagate(&b.build().unwrap(), 2, &fetch()).unwrap_err();
        assert!(
            e.contains("node `h`")
                && e.contains("declared Shard(0)")
                && e.contains("give Shard(1)"),
            "{e}"
        );
    }

    #[test]
    fn an_op_declared_replicate_is_made_whole_for_its_consumers() {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 8]);
        let w = b.variable("w", DType::F32, &[8, 6], "ones");
        b.set_sharding(&w, Shard(1));
        let h = b
            .op("MatMul", "h")
            .input(&x)
            .input(&w)
            .sharding(Replicate)
            .finish();
        let r = b.unary("Relu", "r", &h);
        b.op("Sum", "loss").input(&r).finish();
        let plan = propagate(&b.build().unwrap(), 2, &fetch()).unwrap();
        assert_eq!(plan.placements["h"], Shard(1));
        assert_eq!(plan.placements["r"], Replicate);
        assert_eq!(
            plan.inserts,
            [Insert {
                tensor: "h".into(),
                kind: Inserted::Gather { dim: 1 },
                consumers: vec![("r".into(), 0)],
                fetched: false,
                bytes: Some(4 * 6 * 4),
            }]
        );
    }
}
