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
//! every rank computes the same (replicated) loss, so each inserted op has the gradient that
//! convention needs: a rank holds its slice's gradient for a `Shard` tensor and the whole
//! gradient for a `Replicate` or `Partial` one (`graph/src/ops/collective.rs`,
//! `graph/src/ops/collective_tp.rs`):
//!
//! | conversion | op | forward | backward |
//! |------------|----|---------|----------|
//! | `Partial → Replicate` | `CollectiveTpReduce` (`g`) | all-reduce | nothing |
//! | `Shard(d) → Replicate` | `CollectiveTpAllGather` | all-gather along `d` | the rank's slice |
//! | `Partial → Shard(d)` | `CollectiveTpReduceScatter` | reduce-scatter along `d` | all-gather |
//! | `Shard(i) → Shard(j)` | `CollectiveTpAllToAll` | all-to-all | the reverse all-to-all |
//! | `Replicate → Shard(d)` | `CollectiveTpSlice` | the rank's slice | all-gather |
//! | (`f`) a replicated tensor that depends on a variable entering an op whose output is not replicated | `CollectiveTpCopy` | nothing | all-reduce |
//!
//! A consumer asks for another placement where its rule refuses its inputs' (an element-wise op
//! of `Shard(0)` and `Shard(1)` inputs: the inputs are redistributed to the first shard's
//! dimension, [`rules::elementwise_targets`]; failing that the partial sums, then every input,
//! are made whole), where it has no rule (every input whole), where an op declares a placement
//! other than its inputs give (its consumers read it converted to the declared one), and where
//! a fetched tensor (the loss, a metric) is not whole.
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
    /// `Shard(dim) → Replicate`: an all-gather forward, the rank's slice backward.
    Gather {
        /// The sharded dimension.
        dim: usize,
    },
    /// `Partial → Shard(dim)`: a reduce-scatter forward, an all-gather backward.
    ReduceScatter {
        /// The dimension the result is sharded along.
        dim: usize,
    },
    /// `Shard(from) → Shard(to)`: an all-to-all forward, the reverse one backward.
    AllToAll {
        /// Sharded along this dimension before.
        from: usize,
        /// And along this one after.
        to: usize,
    },
    /// `Replicate → Shard(dim)`: the rank's slice forward (no traffic), an all-gather backward.
    Slice {
        /// The dimension sliced.
        dim: usize,
    },
}

impl Inserted {
    /// The op that changes a placement by `t` (`None`: nothing to change).
    pub fn of(t: Transition) -> Option<Inserted> {
        Some(match t {
            Transition::Nothing => return None,
            Transition::AllReduce => Inserted::Reduce,
            Transition::AllGather { dim } => Inserted::Gather { dim },
            Transition::ReduceScatter { dim } => Inserted::ReduceScatter { dim },
            Transition::AllToAll { from, to } => Inserted::AllToAll { from, to },
            Transition::LocalSlice { dim } => Inserted::Slice { dim },
        })
    }

    /// The op inserted.
    pub fn op(self) -> &'static str {
        match self {
            Inserted::Copy => "CollectiveTpCopy",
            Inserted::Reduce => "CollectiveTpReduce",
            Inserted::Gather { .. } => "CollectiveTpAllGather",
            Inserted::ReduceScatter { .. } => "CollectiveTpReduceScatter",
            Inserted::AllToAll { .. } => "CollectiveTpAllToAll",
            Inserted::Slice { .. } => "CollectiveTpSlice",
        }
    }

    /// What it does forward and what its gradient does backward, as transitions (for their
    /// bytes).
    pub fn transitions(self) -> (Transition, Transition) {
        match self {
            Inserted::Copy => (Transition::Nothing, Transition::AllReduce),
            Inserted::Reduce => (Transition::AllReduce, Transition::Nothing),
            Inserted::Gather { dim } => (
                Transition::AllGather { dim },
                Transition::LocalSlice { dim },
            ),
            Inserted::ReduceScatter { dim } => (
                Transition::ReduceScatter { dim },
                Transition::AllGather { dim },
            ),
            Inserted::AllToAll { from, to } => (
                Transition::AllToAll { from, to },
                Transition::AllToAll { from: to, to: from },
            ),
            Inserted::Slice { dim } => (
                Transition::LocalSlice { dim },
                Transition::AllGather { dim },
            ),
        }
    }
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
    /// A gradient flows back through it (the tensor depends on a variable), so its backward
    /// collective runs.
    pub backward: bool,
}

impl Insert {
    /// The op inserted.
    pub fn op(&self) -> &'static str {
        self.kind.op()
    }

    /// Bytes each of `tp` ranks sends per step, forward and backward, by the ring formulas of
    /// [`Transition::bytes_sent`] on the whole tensor (a backward collective only where a
    /// gradient flows); `None` where the shape is not static.
    pub fn bytes_sent(&self, tp: usize) -> (Option<usize>, Option<usize>) {
        let (forward, backward) = self.kind.transitions();
        let backward = if self.backward {
            backward
        } else {
            Transition::Nothing
        };
        let sent = |t: Transition| match t {
            Transition::Nothing | Transition::LocalSlice { .. } => Some(0),
            t => self.bytes.map(|b| t.bytes_sent(b, tp)),
        };
        (sent(forward), sent(backward))
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
                "Shard({dim}) → Replicate: all-gather along {dim}; the rank's slice of its \
                 gradient backward"
            ),
            Inserted::ReduceScatter { dim } => write!(
                f,
                "Partial(sum) → Shard({dim}): reduce-scatter along {dim}; all-gather of its \
                 gradient backward"
            ),
            Inserted::AllToAll { from, to } => write!(
                f,
                "Shard({from}) → Shard({to}): all-to-all; the reverse all-to-all of its \
                 gradient backward"
            ),
            Inserted::Slice { dim } => write!(
                f,
                "Replicate → Shard({dim}): the rank's slice (no traffic); all-gather of its \
                 gradient backward"
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

/// The element-wise ops ([`rules::elementwise`]).
const ELEMENTWISE: &[&str] = &[
    "Add", "Sub", "Mul", "Div", "AddN", "BiasAdd", "Maximum", "Minimum", "Relu", "Gelu", "Tanh",
    "Sigmoid", "Exp", "Log", "Neg", "Square", "Sqrt", "Abs", "Identity",
];

/// Where node `i`'s rule refuses `ins`, the placements to redistribute its inputs to so that
/// it takes them (`None`: no proposal; the inputs are made whole instead).
fn targets(
    graph: &Graph,
    i: NodeIndex,
    ins: &[Placement],
    ranks: &[Option<usize>],
) -> Option<Vec<Placement>> {
    let n = graph.node(i);
    let out_rank = rank_of(graph, i, 0)?;
    let ranks: Vec<usize> = ranks.iter().copied().collect::<Option<_>>()?;
    if !ELEMENTWISE.contains(&n.op) || ranks.iter().any(|&r| r > out_rank) {
        return None;
    }
    let inputs: Vec<(Placement, usize)> = ins.iter().copied().zip(ranks).collect();
    rules::elementwise_targets(&inputs, out_rank)
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
        (op, _) if ELEMENTWISE.contains(&op) && ranks.iter().all(|&r| r <= out_rank) => {
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
    let mut insert = |tensor: (NodeIndex, usize),
                      kind: Inserted,
                      consumer: Option<(&str, usize)>,
                      backward: bool| {
        let name = tensor_name(graph, tensor.0, tensor.1);
        let at = *keyed.entry((name.clone(), kind)).or_insert_with(|| {
            inserts.push(Insert {
                tensor: name,
                kind,
                consumers: Vec::new(),
                fetched: false,
                bytes: bytes_of(tensor.0, tensor.1),
                backward: backward || kind == Inserted::Copy,
            });
            inserts.len() - 1
        });
        match consumer {
            Some((c, slot)) => inserts[at].consumers.push((c.to_string(), slot)),
            None => inserts[at].fetched = true,
        }
    };
    // The op that turns output (i, k), placed `p`, into `want` (`None`: nothing to do); a
    // shard must exist and divide by T where its length is known.
    let convert = |(i, k): (NodeIndex, usize),
                   p: Placement,
                   want: Placement|
     -> Result<Option<Inserted>, String> {
        let node = &graph.node(i).name;
        let t = transition(p, want).map_err(|e| err(node, e))?;
        if let Shard(d) = want {
            shardable(graph, (i, k), d, tp).map_err(|e| err(node, format!("{want}: {e}")))?;
        }
        Ok(Inserted::of(t))
    };
    // Ops whose output reaches its consumers converted to a declared placement (their own
    // placement, before the conversion, stays what the rule gave).
    let mut forced: HashMap<NodeIndex, Placement> = HashMap::new();
    // The sources declared sharded, in the graph's order (the first bad one is reported).
    for i in graph.node_indices() {
        let n = graph.node(i);
        if !graph.inputs(i).is_empty() {
            continue;
        }
        if let Some(v) = n.attrs.get(SHARDING_ATTR) {
            if let Some(Shard(d)) = sharding_value(&n.name, v)?.tp {
                sharded.push(sharded_variable(graph, i, d, tp)?);
            }
        }
    }
    for &i in &order {
        let n = graph.node(i);
        let declared = match n.attrs.get(SHARDING_ATTR) {
            Some(v) => sharding_value(&n.name, v)?.tp,
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
        // Inputs from ops with a declared placement are read converted to it.
        for (slot, &(p, k)) in inputs.iter().enumerate() {
            if let Some(&want) = forced.get(&p) {
                if let Some(kind) = convert((p, k), ins[slot], want)? {
                    insert((p, k), kind, Some((&n.name, slot)), trainable.contains(&p));
                }
                ins[slot] = want;
            }
        }
        // Redistributes the inputs to `to` (checked first: nothing is inserted unless every
        // conversion exists).
        let mut redistribute = |ins: &mut Vec<Placement>, to: &[Placement]| -> Result<(), String> {
            let mut kinds = Vec::with_capacity(to.len());
            for (slot, &(p, k)) in inputs.iter().enumerate() {
                kinds.push(convert((p, k), ins[slot], to[slot]).map_err(|e| {
                    err(
                        &n.name,
                        format!(
                            "input {slot} ({}) cannot be made {}: {e}",
                            ins[slot], to[slot]
                        ),
                    )
                })?);
            }
            for (slot, (&(p, k), kind)) in inputs.iter().zip(kinds).enumerate() {
                if let Some(kind) = kind {
                    insert((p, k), kind, Some((&n.name, slot)), trainable.contains(&p));
                }
                ins[slot] = to[slot];
            }
            Ok(())
        };
        let whole = |ins: &[Placement], only_partial: bool| -> Vec<Placement> {
            ins.iter()
                .map(|&q| {
                    if only_partial && q != Partial {
                        q
                    } else {
                        Replicate
                    }
                })
                .collect()
        };
        let out = match rule(graph, i, &ins, &ranks) {
            None => {
                let to = whole(&ins, false);
                redistribute(&mut ins, &to)?;
                Replicate
            }
            Some(Ok(p)) => p,
            Some(Err(first)) => {
                let given = list(&ins);
                // The rule's own redistribution (an element-wise op's inputs sharded alike),
                // where every conversion exists and the rule then takes the inputs.
                let proposal = targets(graph, i, &ins, &ranks).filter(|to| {
                    inputs
                        .iter()
                        .enumerate()
                        .all(|(slot, &(p, k))| convert((p, k), ins[slot], to[slot]).is_ok())
                        && matches!(rule(graph, i, to, &ranks), Some(Ok(_)))
                });
                let retry = if let Some(to) = proposal {
                    redistribute(&mut ins, &to)?;
                    rule(graph, i, &ins, &ranks)
                } else {
                    // The partial sums made whole, then every input.
                    let to = whole(&ins, true);
                    redistribute(&mut ins, &to)?;
                    match rule(graph, i, &ins, &ranks) {
                        Some(Ok(p)) => Some(Ok(p)),
                        _ => {
                            let to = whole(&ins, false);
                            redistribute(&mut ins, &to)?;
                            rule(graph, i, &ins, &ranks)
                        }
                    }
                };
                match retry {
                    Some(Ok(p)) => p,
                    _ => {
                        return Err(err(
                            &n.name,
                            format!("{} of inputs placed {given}: {first}", n.op),
                        ))
                    }
                }
            }
        };
        // A declared output placement other than the rule's: the consumers read the output
        // converted to it.
        match declared {
            Some(want) if want != out => {
                for k in 0..graph.node(i).outputs.len() {
                    convert((i, k), out, want).map_err(|e| {
                        format!(
                            "{e} (declared {want}, derived {out} from inputs placed {})",
                            list(&ins)
                        )
                    })?;
                }
                forced.insert(i, want);
            }
            _ => {}
        }
        // f before the replicated, trainable inputs of an op whose output is not replicated.
        if out != Replicate {
            for (slot, &(p, k)) in inputs.iter().enumerate() {
                if ins[slot] == Replicate && trainable.contains(&p) {
                    insert((p, k), Inserted::Copy, Some((&n.name, slot)), true);
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
        if let Some(kind) = convert((i, k), place[&i], Replicate)? {
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
            insert((i, k), kind, None, trainable.contains(&i));
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

/// Checks that output `(i, k)` of `graph` can be `Shard(d)` over `tp` ranks: dimension `d`
/// exists and, where its length is known, divides by `tp` (an unknown length, a batch, is
/// checked by the op when it runs).
fn shardable(graph: &Graph, (i, k): (NodeIndex, usize), d: usize, tp: usize) -> Result<(), String> {
    let Some(t) = graph.output_type(i, k) else {
        return Err("the tensor's type is unknown".into());
    };
    let Some(dims) = t.shape.dims() else {
        return Err(format!(
            "its shape {} has an unknown rank; a sharded tensor needs a known one",
            t.shape
        ));
    };
    match dims.get(d) {
        None => Err(format!(
            "a tensor of shape {} has no dimension {d}",
            t.shape
        )),
        Some(Some(len)) if len % tp != 0 => Err(format!(
            "dimension {d} of shape {} is {len}, which does not divide by --tp {tp}; pick a \
             --tp that divides it or shard another dimension",
            t.shape
        )),
        Some(_) => Ok(()),
    }
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
                    backward: true,
                },
                Insert {
                    tensor: "h2".into(),
                    kind: Inserted::Reduce,
                    consumers: vec![("y".into(), 0)],
                    fetched: false,
                    bytes: Some(4 * 3 * 4),
                    backward: true,
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
        // Shard(1) · Replicate, so its input is all-gathered.
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
        // An all-gather: (T−1)/T of the 96 bytes forward, the rank's slice backward.
        assert_eq!(gather.op(), "CollectiveTpAllGather");
        assert_eq!(gather.bytes_sent(2), (Some(48), Some(0)));
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
                backward: true,
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
        // An op declared a shard its output cannot take: 6 columns over 4 ranks, and a
        // dimension it does not have.
        for (tp, want, says) in [
            (4, Shard(1), "does not divide by --tp 4"),
            (2, Shard(2), "no dimension 2"),
        ] {
            let mut b = GraphBuilder::new();
            let x = b.placeholder("x", DType::F32, &[4, 8]);
            let w = b.variable("w", DType::F32, &[8, 6], "ones");
            b.set_sharding(&w, Shard(0));
            let h = b
                .op("MatMul", "h")
                .input(&x)
                .input(&w)
                .sharding(want)
                .finish();
            b.op("Sum", "loss").input(&h).finish();
            let e = propagate(&b.build().unwrap(), tp, &fetch()).unwrap_err();
            assert!(
                e.contains("node `h`")
                    && e.contains(says)
                    && e.contains(&format!("declared {want}")),
                "{e}"
            );
        }
    }

    /// The insert on `tensor` in `plan`.
    fn on<'a>(plan: &'a PlacementPlan, tensor: &str) -> &'a Insert {
        plan.inserts
            .iter()
            .find(|i| i.tensor == tensor)
            .unwrap_or_else(|| panic!("no insert on `{tensor}` in {:?}", plan.inserts))
    }

    /// `h = x · w` with `w [8, 6]` placed `w_at` and `h` declared `h_at`, then `Relu`, summed.
    fn declared(w_at: Placement, h_at: Placement) -> Graph {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 8]);
        let w = b.variable("w", DType::F32, &[8, 6], "ones");
        b.set_sharding(&w, w_at);
        let h = b
            .op("MatMul", "h")
            .input(&x)
            .input(&w)
            .sharding(h_at)
            .finish();
        let r = b.unary("Relu", "r", &h);
        b.op("Sum", "loss").input(&r).finish();
        b.build().unwrap()
    }

    #[test]
    fn an_op_declared_another_shard_is_resharded_by_an_all_to_all() {
        // h = x · w is Shard(1) (column-parallel); declared Shard(0), its consumer reads it
        // through an all-to-all from 1 to 0.
        let plan = propagate(&declared(Shard(1), Shard(0)), 2, &fetch()).unwrap();
        assert_eq!(plan.placements["h"], Shard(1));
        assert_eq!(plan.placements["r"], Shard(0));
        let a2a = on(&plan, "h");
        assert_eq!(
            (a2a.kind, a2a.op(), a2a.consumers.clone(), a2a.bytes),
            (
                Inserted::AllToAll { from: 1, to: 0 },
                "CollectiveTpAllToAll",
                vec![("r".to_string(), 0)],
                Some(4 * 6 * 4)
            )
        );
        // Each rank sends (T−1)/T of its [4, 3] shard, 48 bytes: 24 B, forward and back.
        assert_eq!(a2a.bytes_sent(2), (Some(24), Some(24)));
    }

    #[test]
    fn a_partial_sum_declared_sharded_is_reduce_scattered() {
        // a [4, 8] Shard(1) · w [8, 6] Shard(0) is a partial sum; declared Shard(0), the
        // consumer reads its rank's rows of the sum.
        let mut b = GraphBuilder::new();
        let a = b.variable("a", DType::F32, &[4, 8], "ones");
        let w = b.variable("w", DType::F32, &[8, 6], "ones");
        b.set_sharding(&a, Shard(1));
        b.set_sharding(&w, Shard(0));
        let h = b
            .op("MatMul", "h")
            .input(&a)
            .input(&w)
            .sharding(Shard(0))
            .finish();
        let r = b.unary("Relu", "r", &h);
        b.op("Sum", "loss").input(&r).finish();
        let plan = propagate(&b.build().unwrap(), 2, &fetch()).unwrap();
        assert_eq!(plan.placements["h"], Partial);
        assert_eq!(plan.placements["r"], Shard(0));
        let rs = on(&plan, "h");
        assert_eq!(
            (rs.kind, rs.op(), rs.bytes, rs.backward),
            (
                Inserted::ReduceScatter { dim: 0 },
                "CollectiveTpReduceScatter",
                Some(96),
                true
            )
        );
        // Ring reduce-scatter (T−1)/T · B forward, all-gather (T−1)/T · B backward.
        assert_eq!(rs.bytes_sent(2), (Some(48), Some(48)));
        // The Sum over the sharded rows is partial: the loss is all-reduced (g) by name.
        assert_eq!(plan.placements["loss"], Partial);
        let g = on(&plan, "loss");
        assert_eq!((g.kind, g.fetched), (Inserted::Reduce, true));
    }

    #[test]
    fn a_replicated_tensor_declared_sharded_is_sliced_locally() {
        // h = x · w replicated, declared Shard(1): each rank's slice, no traffic forward; w
        // is trainable, so the slice's gradient is all-gathered backward.
        let plan = propagate(&declared(Replicate, Shard(1)), 2, &fetch()).unwrap();
        assert_eq!(plan.placements["h"], Replicate);
        assert_eq!(plan.placements["r"], Shard(1));
        let slice = on(&plan, "h");
        assert_eq!(
            (slice.kind, slice.op(), slice.backward),
            (Inserted::Slice { dim: 1 }, "CollectiveTpSlice", true)
        );
        assert_eq!(slice.bytes_sent(2), (Some(0), Some(48)));
        // Data (no variable behind it) sliced: no gradient, no traffic at all.
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[4, 8]);
        let xs = b.op("Identity", "xs").input(&x).sharding(Shard(0)).finish();
        let v = b.variable("v", DType::F32, &[8, 2], "ones");
        let h = b.matmul("h", &xs, &v);
        b.op("Sum", "loss").input(&h).finish();
        let plan = propagate(&b.build().unwrap(), 2, &fetch()).unwrap();
        // Shard(0) · Replicate keeps the rows; v enters a sharded op, so it gets f.
        assert_eq!(plan.placements["h"], Shard(0));
        let slice = on(&plan, "xs");
        assert_eq!(
            (slice.kind, slice.backward, slice.bytes_sent(2)),
            (Inserted::Slice { dim: 0 }, false, (Some(0), Some(0)))
        );
        assert_eq!(on(&plan, "v").kind, Inserted::Copy);
    }

    #[test]
    fn an_element_wise_op_redistributes_its_inputs_to_the_first_shard() {
        // y = a + b + c + d: a Shard(0), b Shard(1) (all-to-all to 0), p = e · f a partial
        // sum (reduce-scattered along 0), c replicated (sliced), all [4, 6].
        let mut b = GraphBuilder::new();
        let va = b.variable("a", DType::F32, &[4, 6], "ones");
        let vb = b.variable("b", DType::F32, &[4, 6], "ones");
        let vc = b.variable("c", DType::F32, &[4, 6], "ones");
        let ve = b.variable("e", DType::F32, &[4, 8], "ones");
        let vf = b.variable("f", DType::F32, &[8, 6], "ones");
        b.set_sharding(&va, Shard(0));
        b.set_sharding(&vb, Shard(1));
        b.set_sharding(&ve, Shard(1));
        b.set_sharding(&vf, Shard(0));
        let p = b.matmul("p", &ve, &vf);
        let y1 = b.binary("Add", "y1", &va, &vb);
        let y2 = b.binary("Add", "y2", &y1, &p);
        let y3 = b.binary("Mul", "y3", &y2, &vc);
        b.op("Sum", "loss").input(&y3).finish();
        let plan = propagate(&b.build().unwrap(), 2, &fetch()).unwrap();
        for n in ["y1", "y2", "y3"] {
            assert_eq!(plan.placements[n], Shard(0), "{n}");
        }
        let kinds: Vec<(&str, Inserted, String)> = plan
            .inserts
            .iter()
            .map(|i| {
                let readers: Vec<String> = i
                    .consumers
                    .iter()
                    .map(|(c, k)| format!("{c}[{k}]"))
                    .collect();
                (i.tensor.as_str(), i.kind, readers.join(" "))
            })
            .collect();
        assert_eq!(
            kinds,
            [
                ("b", Inserted::AllToAll { from: 1, to: 0 }, "y1[1]".into()),
                ("p", Inserted::ReduceScatter { dim: 0 }, "y2[1]".into()),
                ("c", Inserted::Slice { dim: 0 }, "y3[1]".into()),
                ("loss", Inserted::Reduce, String::new()),
            ]
        );
    }

    #[test]
    fn an_input_that_cannot_be_sliced_falls_back_to_whole_inputs() {
        // a Shard(0) [4, 6] times a replicated c [1, 6] broadcast along the rows: slicing c's
        // single row over 2 ranks is impossible, so a is all-gathered and the product whole.
        let mut b = GraphBuilder::new();
        let va = b.variable("a", DType::F32, &[4, 6], "ones");
        let vc = b.variable("c", DType::F32, &[1, 6], "ones");
        b.set_sharding(&va, Shard(0));
        let y = b.binary("Mul", "y", &va, &vc);
        b.op("Sum", "loss").input(&y).finish();
        let plan = propagate(&b.build().unwrap(), 2, &fetch()).unwrap();
        assert_eq!(plan.placements["y"], Replicate);
        assert_eq!(
            plan.inserts
                .iter()
                .map(|i| (i.tensor.as_str(), i.kind))
                .collect::<Vec<_>>(),
            [("a", Inserted::Gather { dim: 0 })]
        );
    }

    #[test]
    fn every_insert_sends_the_ring_formulas() {
        // B = 1000 bytes whole, T = 4: all-gather and reduce-scatter (T−1)/T·B = 750, all-to-all
        // (T−1)/T of the rank's B/T = 187, all-reduce 2(T−1)/T·B = 1500.
        let insert = |kind, backward| Insert {
            tensor: "t".into(),
            kind,
            consumers: vec![],
            fetched: false,
            bytes: Some(1000),
            backward,
        };
        for (kind, want) in [
            (Inserted::Copy, (0, 1500)),
            (Inserted::Reduce, (1500, 0)),
            (Inserted::Gather { dim: 0 }, (750, 0)),
            (Inserted::ReduceScatter { dim: 1 }, (750, 750)),
            (Inserted::AllToAll { from: 0, to: 1 }, (187, 187)),
            (Inserted::Slice { dim: 0 }, (0, 750)),
        ] {
            assert_eq!(
                insert(kind, true).bytes_sent(4),
                (Some(want.0), Some(want.1)),
                "{kind:?}"
            );
            // No gradient through it: no backward collective (f is only inserted with one).
            if kind != Inserted::Copy {
                assert_eq!(insert(kind, false).bytes_sent(4), (Some(want.0), Some(0)));
            }
        }
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
                backward: true,
            }]
        );
    }
}
