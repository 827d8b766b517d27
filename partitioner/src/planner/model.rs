//! What the planner reads from a model graph: every op's forward FLOPs and output bytes as a
//! function of the batch rows, its role under tensor parallelism, and the variables.
//!
//! Shapes come from dflow's own inference: the graph is validated twice, with the fed
//! placeholders' batch dimension set to 1 and to 2 rows. Every quantity of these models is
//! linear in the rows (`fixed + per_row · rows`), so the two points give it exactly at any batch.
//!
//! Tensor parallelism is Megatron-LM's, found from the graph: a `MatMul`/`BatchMatMul` whose
//! right operand is a variable is *column-parallel* when its input is replicated (its output is
//! split over the `tp` ranks) and *row-parallel* when its input is split (its output is a partial
//! sum, all-reduced in the forward pass); a column-parallel product all-reduces its input's
//! gradient in the backward pass. A `Gather` from a variable is a vocabulary-parallel embedding
//! (its output all-reduced), ops reading a split tensor are split too, and a cross-entropy over a
//! split tensor all-reduces its per-row output three times (dflow's vocabulary-parallel
//! cross-entropy: the max, `Σ exp` and the target's logit). Everything else is replicated.

use super::flops::forward_flops;
use crate::strategy::pipeline::stages::batch_ops;
use dflow_graph::train::{OptimizerKind, TrainingGraph};
use dflow_graph::{AttrValue, Graph, GraphDef, InputRef, Shape};
use petgraph::graph::NodeIndex;
use std::collections::{HashMap, HashSet};

/// A quantity linear in the batch rows: `fixed + per_row · rows`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PerRows {
    /// The part that does not depend on the batch.
    pub fixed: f64,
    /// The part per row of the batch.
    pub per_row: f64,
}

impl PerRows {
    /// The value at `rows` rows.
    pub fn at(self, rows: f64) -> f64 {
        self.fixed + self.per_row * rows
    }

    /// From its values at 1 and 2 rows.
    fn from_points(at1: f64, at2: f64) -> PerRows {
        PerRows {
            fixed: 2.0 * at1 - at2,
            per_row: at2 - at1,
        }
    }

    /// `self + other`.
    pub fn plus(self, other: PerRows) -> PerRows {
        PerRows {
            fixed: self.fixed + other.fixed,
            per_row: self.per_row + other.per_row,
        }
    }
}

/// An op's part in Megatron-style tensor parallelism (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpRole {
    /// Every tensor-parallel rank runs it whole.
    Replicated,
    /// Runs on a split input: each rank does `1/tp` of it.
    Split,
    /// A product with a weight on a replicated input: the weight's output features split.
    ColumnParallel,
    /// A product with a weight on a split input: a partial sum, all-reduced.
    RowParallel,
    /// A lookup into a weight split by rows (vocabulary), all-reduced.
    VocabParallel,
    /// A cross-entropy over split logits: each rank's per-row values, all-reduced.
    SplitReduction,
}

impl TpRole {
    /// Whether the op's work and output are divided over the tensor-parallel ranks.
    pub fn divided(self) -> bool {
        !matches!(self, TpRole::Replicated)
    }
}

/// The all-reduces of dflow's vocabulary-parallel cross-entropy in the forward pass, each of
/// its per-row output's size (`strategy/tensor.rs`: the logits' max, `Σ exp` and the target's
/// logit); their gradients need none (the max is behind `StopGradient`, a sum's gradient is the
/// identity).
pub const SPLIT_REDUCTION_CALLS: usize = 3;

/// One forward op.
#[derive(Clone, Debug, PartialEq)]
pub struct OpProfile {
    /// The node in [`ModelProfile::graph`].
    pub node: NodeIndex,
    /// Whether it depends on the fed batch.
    pub batch: bool,
    /// Forward FLOPs.
    pub flops: PerRows,
    /// Bytes of its outputs.
    pub out_bytes: PerRows,
    /// Whether its output is split over the tensor-parallel ranks.
    pub split_output: bool,
    /// Its role under tensor parallelism.
    pub role: TpRole,
    /// Bytes of each all-reduce over the tensor-parallel group in the forward pass (there are
    /// [`Self::tp_forward_calls`]).
    pub tp_forward: PerRows,
    /// Bytes all-reduced over the tensor-parallel group in the backward pass.
    pub tp_backward: PerRows,
    /// Whether its first output is a float that depends on a variable (a gradient flows back
    /// through it).
    pub needs_gradient: bool,
    /// Whether its output is split over the tensor-parallel ranks along the vocabulary (a
    /// vocabulary-split weight, the head's logits and the split ops on them), which
    /// `--strategy tensor` pads to a multiple of tp: its bytes and FLOPs grow by
    /// [`ModelProfile::vocabulary_padding`].
    pub vocab_split: bool,
}

/// One variable.
#[derive(Clone, Debug, PartialEq)]
pub struct VariableProfile {
    /// The node in [`ModelProfile::graph`].
    pub node: NodeIndex,
    /// Elements.
    pub elements: f64,
    /// Bytes as the graph stores it.
    pub bytes: f64,
    /// Whether tensor parallelism splits it.
    pub split: bool,
    /// Whether it holds a MoE layer's experts (`[E, ...]`): an `ep` layout splits it over the
    /// expert-parallel group.
    pub expert: bool,
    /// Whether the backward pass reads it (an op of dflow's gradient expansion takes it as an
    /// input: a product's weight for its input's gradient, a layer norm's scale; not a bias,
    /// nor the first layer's weight whose input needs no gradient). ZeRO-3 gathers a weight
    /// for the backward pass only then.
    pub backward_read: bool,
    /// The forward ops whose gradients read it (in [`ModelProfile::graph`]; a gradient op
    /// `gradients/<op>/...` counts for `<op>`): on which stage the backward pass reads it, and
    /// through which op (a lookup's gradient reads the table; under tensor parallelism the
    /// vocabulary-parallel lookup is a one-hot product, whose gradient does not).
    pub backward_readers: Vec<NodeIndex>,
}

/// One MoE layer (`MoeDispatch` … `MoeCombine`; see [`crate::strategy::expert`]).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeProfile {
    /// The `MoeDispatch` node.
    pub dispatch: String,
    /// Experts (E).
    pub experts: usize,
    /// The width of a token (d).
    pub width: usize,
    /// The dispatch's capacity factor.
    pub capacity_factor: f64,
    /// Tokens per row of the batch (the dispatch's `N` at one row).
    pub tokens_per_row: usize,
    /// Bytes of one element of the dispatch buffer.
    pub element_bytes: usize,
}

impl MoeProfile {
    /// Bytes of the dispatch buffer `[E, C, d]` of a replica fed `rows` rows:
    /// `C = capacity(N, E, capacity_factor)` of its `N = rows · tokens_per_row` tokens.
    pub fn buffer_bytes(&self, rows: usize) -> f64 {
        let c = dflow_graph::ops::moe::capacity(
            rows * self.tokens_per_row,
            self.experts,
            self.capacity_factor,
        );
        (self.experts * c * self.width * self.element_bytes) as f64
    }
}

/// A load-balancing loss (`MoeAuxLoss`) of an MoE layer. Beside `ep > 1` the expert
/// strategies (`strategy::expert::worker_forward`) all-gather both its inputs (the router's
/// probabilities and the chosen experts) over the data-parallel group of the loss's stage, so
/// that every rank computes the global batch's loss, even at α = 0; the gradient of a float
/// input's all-gather is a reduce-scatter.
#[derive(Clone, Debug, PartialEq)]
pub struct AuxLossProfile {
    /// The `MoeAuxLoss` node.
    pub node: NodeIndex,
    /// Its gathered inputs, in order.
    pub gathered: Vec<GatheredInput>,
}

/// One input of a load-balancing loss the expert strategies all-gather.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatheredInput {
    /// Its bytes on one replica (rank) for a micro-batch of `rows` rows.
    pub bytes: PerRows,
    /// Bytes of one element.
    pub element_bytes: usize,
    /// Whether its gradient comes back (a float: the all-gather's gradient is a reduce-scatter).
    pub gradient: bool,
}

/// A dimension tensor parallelism splits (it must divide by `tp`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitDim {
    /// What it is, for the error (`weight transformer.h.0.mlp.c_fc.weight dim 0`).
    pub what: String,
    /// Its size.
    pub size: usize,
    /// The weight it belongs to (none for the heads of a reshape).
    pub variable: Option<NodeIndex>,
    /// Whether `--strategy tensor` pads it to a multiple of tp (the vocabulary: see
    /// [`ModelProfile::vocabulary`]) instead of refusing a tp that does not divide it.
    pub padded: bool,
}

/// Everything the planner needs from a model.
#[derive(Debug, Clone)]
pub struct ModelProfile {
    /// The forward graph, validated with a batch of 1 row.
    pub graph: Graph,
    /// The features and labels placeholders.
    pub feeds: Vec<NodeIndex>,
    /// Per node (by index): its profile (variables and constants have zero cost).
    pub ops: Vec<OpProfile>,
    /// The variables.
    pub variables: Vec<VariableProfile>,
    /// Per node: its index in `variables`, if it is one.
    pub variable_of: Vec<Option<usize>>,
    /// Dimensions a tensor-parallel size must divide (but those marked `padded`).
    pub split_dims: Vec<SplitDim>,
    /// The vocabulary `--strategy tensor` pads with zero rows to a multiple of tp (the rows of
    /// the vocabulary-parallel lookup's table, `transformer.wte.weight`, and of an untied
    /// head), where it pads: a GPT it lays out by its layer names (`_sharding` placements
    /// written by hand are cut as written, and a tp that does not divide them is refused).
    pub vocabulary: Option<usize>,
    /// The MoE layers, in graph order (none: the model has no experts, and no layout has an
    /// `ep` axis).
    pub moe: Vec<MoeProfile>,
    /// The load-balancing losses of the MoE layers, in graph order (their inputs all-gathered
    /// beside `ep > 1`).
    pub aux_losses: Vec<AuxLossProfile>,
    /// The first op that couples the examples of a batch as configured (an MoE router that can
    /// drop tokens, a load-balancing loss with α > 0): a pipeline cut into several
    /// micro-batches would train another model, so `dflow run` refuses them (the pipeline
    /// strategy's check, which this mirrors).
    pub batch_coupled: Option<String>,
    /// Why `dflow run --strategy tensor` cannot split this graph, if it cannot (neither a GPT
    /// it knows by its layer names nor `_sharding` placements written by hand): the planner
    /// then ranks no tp layout, as it ranks only what dflow runs.
    pub tensor_refusal: Option<String>,
    /// Optimizer moments per parameter (Adam 2, momentum 1, SGD 0).
    pub optimizer_slots: f64,
    /// Bytes of the fed placeholders (features and labels).
    pub feed_bytes: PerRows,
    /// Whether the training spec clips by global norm (a pipeline sends one norm per stage).
    pub clips: bool,
    /// Whether the optimizer keeps a step count (Adam: a pipeline sends it to later stages).
    pub step_count: bool,
    /// Ops of the training graph (forward, backward and optimizer) per forward op: what a
    /// device runs per step for each forward op it holds (the runtime's per-op cost).
    pub training_ops_per_op: f64,
}

/// Why a model cannot be profiled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// A feed is not a node of the graph.
    #[error(
        "{role} placeholder `{name}` is not a node of the graph (give it with --features/--labels)"
    )]
    NoFeed {
        /// `features` or `labels`.
        role: &'static str,
        /// The name.
        name: String,
    },
    /// The graph has no training section.
    #[error("the graph has no `train` section: the planner needs its loss and optimizer")]
    NoTrain,
    /// The graph does not validate with a fixed batch.
    #[error("the graph does not validate with a batch of {rows} rows:\n{message}")]
    Invalid {
        /// The rows tried.
        rows: usize,
        /// The validation errors.
        message: String,
    },
    /// An op's output shape is not known with a fixed batch.
    #[error("op `{node}`: its output shape is not static with a fixed batch ({shape}); the planner needs every shape")]
    NotStatic {
        /// The op.
        node: String,
        /// Its inferred shape.
        shape: Shape,
    },
}

/// `def` with every placeholder's unknown batch dimension set to `rows`.
fn with_batch(def: &GraphDef, rows: usize) -> GraphDef {
    let mut def = def.clone();
    for n in def.nodes.iter_mut().filter(|n| n.op == "Placeholder") {
        if let Some(AttrValue::Shape(s)) = n.attrs.get("shape") {
            if let Some(dims) = s.dims() {
                if let Some(None) = dims.first() {
                    let mut fixed = dims.to_vec();
                    fixed[0] = Some(rows);
                    n.attrs
                        .insert("shape".into(), AttrValue::Shape(Shape::partial(fixed)));
                }
            }
        }
    }
    def
}

fn validate(def: &GraphDef, rows: usize) -> Result<Graph, ModelError> {
    Graph::from_def(&with_batch(def, rows)).map_err(|e| ModelError::Invalid {
        rows,
        message: e.to_string(),
    })
}

fn output_bytes(g: &Graph, idx: NodeIndex) -> Result<f64, ModelError> {
    let n = g.node(idx);
    let mut total = 0.0;
    for t in n.outputs.iter() {
        let bytes = t.byte_size().ok_or_else(|| ModelError::NotStatic {
            node: n.name.clone(),
            shape: t.shape.clone(),
        })?;
        total += bytes as f64;
    }
    Ok(total)
}

/// The nodes a live op of the gradient expansion (a node named `gradients/...` that the
/// training step runs: an ancestor of its `train_op`) reads as data. The expansion also makes
/// gradients nobody reads (the first layer's input gradient), which no strategy runs.
fn backward_reads(training: &TrainingGraph) -> HashMap<&str, Vec<&str>> {
    let def = &training.def;
    let index: HashMap<&str, usize> = def
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.as_str(), i))
        .collect();
    let name_of = |input: &str| -> String {
        InputRef::parse(input).map_or_else(|_| input.to_string(), |r| r.node().to_string())
    };
    let mut live = vec![false; def.nodes.len()];
    let mut todo: Vec<usize> = index
        .get(training.train_op.as_str())
        .copied()
        .into_iter()
        .collect();
    while let Some(i) = todo.pop() {
        if std::mem::replace(&mut live[i], true) {
            continue;
        }
        for input in &def.nodes[i].inputs {
            if let Some(&j) = index.get(name_of(input).as_str()) {
                if !live[j] {
                    todo.push(j);
                }
            }
        }
    }
    let mut reads: HashMap<&str, Vec<&str>> = HashMap::new();
    for (_, n) in def
        .nodes
        .iter()
        .enumerate()
        .filter(|&(i, n)| live[i] && n.name.starts_with("gradients/"))
    {
        for i in n.inputs.iter().filter(|i| !i.starts_with('^')) {
            if let Some(&j) = index.get(name_of(i).as_str()) {
                reads
                    .entry(def.nodes[j].name.as_str())
                    .or_default()
                    .push(n.name.as_str());
            }
        }
    }
    reads
}

/// The forward op of `g` a gradient op named `gradients/<op>/...` belongs to: the longest
/// `/`-prefix of the rest that names a node.
fn forward_op_of(g: &Graph, gradient: &str) -> Option<NodeIndex> {
    let mut rest = gradient.strip_prefix("gradients/")?;
    loop {
        if let Some(i) = g.find(rest) {
            return Some(i);
        }
        rest = &rest[..rest.rfind('/')?];
    }
}

impl OpProfile {
    /// The all-reduces of [`Self::tp_forward`] bytes each the op makes in the forward pass:
    /// [`SPLIT_REDUCTION_CALLS`] for a split cross-entropy, one for any other op with some.
    pub fn tp_forward_calls(&self) -> usize {
        if self.tp_forward == PerRows::default() {
            0
        } else if self.role == TpRole::SplitReduction {
            SPLIT_REDUCTION_CALLS
        } else {
            1
        }
    }
}

impl ModelProfile {
    /// Profiles the forward graph `def` fed through `features` and `labels`.
    pub fn new(def: &GraphDef, features: &str, labels: &str) -> Result<ModelProfile, ModelError> {
        let train = def.train.as_ref().ok_or(ModelError::NoTrain)?;
        let g1 = validate(def, 1)?;
        let g2 = validate(def, 2)?;
        let mut feeds = Vec::new();
        for (role, name) in [("features", features), ("labels", labels)] {
            feeds.push(g1.find(name).ok_or_else(|| ModelError::NoFeed {
                role,
                name: name.to_string(),
            })?);
        }
        let batch = batch_ops(&g1, &feeds);
        let n = g1.num_nodes();
        let mut ops: Vec<OpProfile> = Vec::with_capacity(n);
        let mut variables = Vec::new();
        let mut variable_of = vec![None; n];
        // Every output's bytes on its own (an op's input is one output of its producer).
        let mut slot_bytes: Vec<Vec<PerRows>> = Vec::with_capacity(n);
        for idx in g1.node_indices() {
            let node = g1.node(idx);
            let idx2 = if g2.node(idx).name == node.name {
                Some(idx)
            } else {
                g2.find(&node.name)
            };
            let (f1, b1) = (forward_flops(&g1, idx), output_bytes(&g1, idx)?);
            let (f2, b2) = match idx2 {
                Some(i2) => (forward_flops(&g2, i2), output_bytes(&g2, i2)?),
                None => (f1, b1),
            };
            let slots = |g: &Graph, i: NodeIndex| -> Vec<f64> {
                g.node(i)
                    .outputs
                    .iter()
                    .map(|t| t.byte_size().unwrap_or(0) as f64)
                    .collect()
            };
            let s1 = slots(&g1, idx);
            let s2 = idx2.map_or_else(|| s1.clone(), |i2| slots(&g2, i2));
            slot_bytes.push(
                s1.iter()
                    .zip(&s2)
                    .map(|(&a, &b)| PerRows::from_points(a, b))
                    .collect(),
            );
            if node.op_def().is_variable {
                variable_of[idx.index()] = Some(variables.len());
                variables.push(VariableProfile {
                    node: idx,
                    elements: node.outputs[0].shape.num_elements().unwrap_or(0) as f64,
                    bytes: b1,
                    split: false,
                    expert: false,
                    backward_read: false,
                    backward_readers: Vec::new(),
                });
            }
            ops.push(OpProfile {
                node: idx,
                batch: batch[idx.index()],
                flops: PerRows::from_points(f1, f2),
                out_bytes: PerRows::from_points(b1, b2),
                split_output: false,
                role: TpRole::Replicated,
                tp_forward: PerRows::default(),
                tp_backward: PerRows::default(),
                needs_gradient: false,
                vocab_split: false,
            });
        }
        let (optimizer_slots, step_count) = match train.optimizer.kind {
            OptimizerKind::Sgd => (0.0, false),
            OptimizerKind::Momentum { .. } => (1.0, false),
            OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. } => (2.0, true),
        };
        let feed_bytes = feeds
            .iter()
            .map(|f| ops[f.index()].out_bytes)
            .fold(PerRows::default(), PerRows::plus);
        // The training graph dflow builds (before any strategy's rewrite): its ops per forward op.
        let forward_ops = def.nodes.len().max(1) as f64;
        let expanded = dflow_graph::train::expand_training(&with_batch(def, 1), train).ok();
        let training_ops_per_op = expanded
            .as_ref()
            .map_or(3.0, |t| t.def.nodes.len() as f64 / forward_ops);
        if let Some(t) = &expanded {
            let read = backward_reads(t);
            for v in &mut variables {
                if let Some(by) = read.get(g1.node(v.node).name.as_str()) {
                    v.backward_read = true;
                    v.backward_readers = by.iter().filter_map(|n| forward_op_of(&g1, n)).collect();
                    v.backward_readers.sort_unstable();
                    v.backward_readers.dedup();
                }
            }
        }
        let (moe, moe_region) = moe_profiles(&g1, def, &mut variables);
        let batch_coupled = g1
            .node_indices()
            .map(|i| g1.node(i))
            .find(|n| crate::strategy::pipeline::couples_batch(n))
            .map(|n| n.name.clone());
        let tensor_refusal = crate::strategy::tensor::tensor_refusal(&g1, def, !moe.is_empty());
        let aux_losses = aux_loss_profiles(&g1, &slot_bytes);
        let mut model = ModelProfile {
            moe,
            aux_losses,
            batch_coupled,
            tensor_refusal,
            training_ops_per_op,
            feed_bytes,
            graph: g1,
            feeds,
            ops,
            variables,
            variable_of,
            split_dims: Vec::new(),
            vocabulary: None,
            optimizer_slots,
            clips: train.clip_global_norm.is_some(),
            step_count,
        };
        model.mark_gradients();
        model.assign_tp_roles(&moe_region, &slot_bytes);
        if model.tensor_refusal.is_none()
            && !crate::strategy::tensor::hand::declares_placements(&model.graph)
        {
            model.mark_vocabulary();
        }
        Ok(model)
    }

    fn is_variable(&self, idx: NodeIndex) -> bool {
        self.variable_of[idx.index()].is_some()
    }

    fn split_variable(&mut self, idx: NodeIndex, dim: Option<usize>) {
        if let Some(v) = self.variable_of[idx.index()] {
            if !self.variables[v].split {
                self.variables[v].split = true;
                let node = self.graph.node(idx);
                if let (Some(d), Some(dims)) = (dim, node.outputs[0].shape.as_static()) {
                    if let Some(&size) = dims.get(d) {
                        self.split_dims.push(SplitDim {
                            what: format!("weight {} dim {d}", node.name),
                            size,
                            variable: Some(idx),
                            padded: false,
                        });
                    }
                }
            }
        }
    }

    /// Marks the ops whose (float) output depends on a variable: the backward pass sends a
    /// gradient for them and for nothing else.
    fn mark_gradients(&mut self) {
        let g = &self.graph;
        for idx in g.topo_order() {
            let float = g
                .node(idx)
                .outputs
                .first()
                .is_some_and(|t| t.dtype.is_float());
            let depends = self.variable_of[idx.index()].is_some()
                || g.inputs(idx)
                    .iter()
                    .any(|(s, _)| self.ops[s.index()].needs_gradient);
            self.ops[idx.index()].needs_gradient = float && depends;
        }
    }

    /// Assigns every op its tensor-parallel role, in topological order (module docs). The ops
    /// of `moe_region` (the MoE layers' routers, dispatches, experts and combines) are
    /// replicated: the tensor strategy runs each MoE MLP whole on every tp rank
    /// (`strategy/tensor/experts.rs`), so their weights are not split and no all-reduce is
    /// around them. The all-reduces' sizes are those of the tensors dflow sums (`slot_bytes`:
    /// each node's outputs apart): a row-parallel product's or an embedding's output, a
    /// column-parallel product's input (the one output of its producer it reads, not a layer
    /// norm's mean and deviation beside it), a split cross-entropy's per-row loss (not its
    /// gradient output).
    fn assign_tp_roles(&mut self, moe_region: &HashSet<NodeIndex>, slot_bytes: &[Vec<PerRows>]) {
        let slot = |(s, k): (NodeIndex, usize)| -> PerRows {
            slot_bytes
                .get(s.index())
                .and_then(|o| o.get(k))
                .copied()
                .unwrap_or_default()
        };
        let g = self.graph.clone();
        for idx in g.topo_order() {
            let node = g.node(idx);
            let inputs = g.inputs(idx);
            if !self.ops[idx.index()].batch || inputs.is_empty() || moe_region.contains(&idx) {
                continue;
            }
            let split_in = |k: usize| -> bool {
                inputs
                    .get(k)
                    .is_some_and(|(s, _)| self.ops[s.index()].split_output)
            };
            let any_split = (0..inputs.len()).any(split_in);
            let weight_rhs = inputs.len() >= 2 && self.is_variable(inputs[1].0);
            let in_bytes0 = inputs.first().copied().map(slot).unwrap_or_default();
            let out = slot((idx, 0));
            let (role, split_output) = match node.op {
                "MatMul" | "BatchMatMul" if weight_rhs => {
                    let transpose = matches!(
                        node.attr("transpose_b").or_else(|| node.attr("adj_y")),
                        Some(AttrValue::Bool(true))
                    );
                    if split_in(0) {
                        // The weight's input features are split: dim 1 of [out, in] when
                        // transposed, dim 0 of [in, out] otherwise.
                        self.split_variable(inputs[1].0, Some(usize::from(transpose)));
                        self.ops[idx.index()].tp_forward = out;
                        (TpRole::RowParallel, false)
                    } else {
                        self.split_variable(inputs[1].0, Some(usize::from(!transpose)));
                        // No gradient to all-reduce for an input that needs none (the batch).
                        if self.ops[inputs[0].0.index()].needs_gradient {
                            self.ops[idx.index()].tp_backward = in_bytes0;
                        }
                        (TpRole::ColumnParallel, true)
                    }
                }
                "Gather" if self.is_variable(inputs[0].0) => {
                    self.split_variable(inputs[0].0, Some(0));
                    self.ops[idx.index()].tp_forward = out;
                    (TpRole::VocabParallel, false)
                }
                "SparseSoftmaxCrossEntropyWithLogits" | "SoftmaxCrossEntropyWithLogits"
                    if any_split =>
                {
                    self.ops[idx.index()].tp_forward = out;
                    (TpRole::SplitReduction, false)
                }
                _ if any_split => {
                    for (s, _) in &inputs {
                        self.split_variable(*s, None);
                    }
                    if node.op == "Reshape" {
                        // [B, T, H, D]: the heads are what a tensor-parallel rank holds.
                        if let Some(d) = node.outputs[0].shape.as_static() {
                            if d.len() == 4 {
                                self.split_dims.push(SplitDim {
                                    what: format!("the heads of {} (dim 2)", node.name),
                                    size: d[2],
                                    variable: None,
                                    padded: false,
                                });
                            }
                        }
                    }
                    (TpRole::Split, true)
                }
                _ => (TpRole::Replicated, false),
            };
            self.ops[idx.index()].role = role;
            self.ops[idx.index()].split_output = split_output;
        }
    }

    /// Parameter elements of the model.
    pub fn parameters(&self) -> f64 {
        self.variables.iter().map(|v| v.elements).sum()
    }

    /// Parameter elements of the MoE layers' experts.
    pub fn expert_parameters(&self) -> f64 {
        self.variables
            .iter()
            .filter(|v| v.expert)
            .map(|v| v.elements)
            .sum()
    }

    /// The expert-parallel sizes a layout may have: every `ep` dividing the number of experts of
    /// every MoE layer (`[1]` for a model without experts).
    pub fn ep_sizes(&self) -> Vec<usize> {
        let Some(first) = self.moe.first() else {
            return vec![1];
        };
        super::layout::divisors(first.experts)
            .into_iter()
            .filter(|&e| self.moe.iter().all(|l| l.experts % e == 0))
            .collect()
    }

    /// The first dimension tensor parallelism splits that `tp` does not divide, if any (the
    /// vocabulary, which `--strategy tensor` pads, is not one).
    pub fn tp_refusal(&self, tp: usize) -> Option<&SplitDim> {
        if tp <= 1 {
            return None;
        }
        self.split_dims
            .iter()
            .find(|d| !d.padded && d.size % tp != 0)
    }

    /// The vocabulary at `tp` as `--strategy tensor` pads it (`V.div_ceil(tp) · tp`), if the
    /// model has one it pads ([`Self::vocabulary`]).
    pub fn padded_vocabulary(&self, tp: usize) -> Option<usize> {
        self.vocabulary.map(|v| v.div_ceil(tp.max(1)) * tp.max(1))
    }

    /// The factor the vocabulary's padding at `tp` grows every vocabulary-split tensor by
    /// (`Vp / V`; 1 when tp divides the vocabulary, or the model has none padded).
    pub fn vocabulary_padding(&self, tp: usize) -> f64 {
        match (self.vocabulary, self.padded_vocabulary(tp)) {
            (Some(v), Some(p)) if v > 0 => p as f64 / v as f64,
            _ => 1.0,
        }
    }

    /// Marks what `--strategy tensor` splits along the vocabulary and pads to a multiple of
    /// tp (`strategy/tensor.rs`: `transformer.wte.weight` and the head's weight padded with
    /// zero rows, the rank's logits `Vp/T` wide): the vocabulary-parallel lookup's table, and
    /// back from the split cross-entropy the split ops on the logits, the column-parallel
    /// head and its weight (when its split dimension is the vocabulary). Sets
    /// [`Self::vocabulary`] and marks those weights' split dimensions `padded`.
    fn mark_vocabulary(&mut self) {
        let g = &self.graph;
        let Some(lookup) = self.ops.iter().find(|o| o.role == TpRole::VocabParallel) else {
            return;
        };
        let Some(&(table, _)) = g.inputs(lookup.node).first() else {
            return;
        };
        let Some(vocab) = g.node(table).outputs[0]
            .shape
            .as_static()
            .and_then(|d| d.first().copied())
        else {
            return;
        };
        let mut marked = vec![table];
        let mut todo: Vec<NodeIndex> = self
            .ops
            .iter()
            .filter(|o| o.role == TpRole::SplitReduction)
            .flat_map(|o| g.inputs(o.node))
            .map(|(s, _)| s)
            .filter(|s| self.ops[s.index()].split_output)
            .collect();
        let mut seen = HashSet::new();
        while let Some(i) = todo.pop() {
            if !seen.insert(i) {
                continue;
            }
            let inputs = g.inputs(i);
            match self.ops[i.index()].role {
                TpRole::ColumnParallel => {
                    let Some(&(w, _)) = inputs.get(1) else {
                        continue;
                    };
                    let rows = g.node(w).outputs[0]
                        .shape
                        .as_static()
                        .and_then(|d| d.first().copied());
                    if rows == Some(vocab) {
                        marked.extend([i, w]);
                    }
                }
                TpRole::Split => {
                    marked.push(i);
                    todo.extend(
                        inputs
                            .into_iter()
                            .map(|(s, _)| s)
                            .filter(|s| self.ops[s.index()].split_output),
                    );
                }
                _ => {}
            }
        }
        for &i in &marked {
            self.ops[i.index()].vocab_split = true;
        }
        for d in &mut self.split_dims {
            d.padded = d.variable.is_some_and(|v| self.ops[v.index()].vocab_split);
        }
        self.vocabulary = Some(vocab);
    }
}

/// The MoE layers of `g` (the forward graph `def` validated at one row), marking their experts'
/// variables in `variables`. A graph whose MoE ops the expert strategy cannot lay out (see
/// [`crate::strategy::expert::moe_layers`]) has none for the planner either: it gets no `ep`
/// layout.
///
/// Also the ops of the MoE layers (every op the layer's `MoeCombine` depends on that its tokens'
/// producer, the dispatch's first input, does not: router, routing, dispatch, experts,
/// combine), which tensor parallelism replicates.
fn moe_profiles(
    g: &Graph,
    def: &GraphDef,
    variables: &mut [VariableProfile],
) -> (Vec<MoeProfile>, HashSet<NodeIndex>) {
    let none = || (Vec::new(), HashSet::new());
    let Ok(layers) = crate::strategy::expert::moe_layers(g, def) else {
        return none();
    };
    let mut out = Vec::with_capacity(layers.len());
    let mut region = HashSet::new();
    for l in &layers {
        let Some(idx) = g.find(&l.dispatch) else {
            return none();
        };
        let Some(combine) = g.find(&l.combine) else {
            return none();
        };
        let before: HashSet<NodeIndex> = g
            .inputs(idx)
            .first()
            .map(|&(x, _)| ancestors(g, x))
            .unwrap_or_default();
        region.extend(
            ancestors(g, combine)
                .into_iter()
                .filter(|n| !before.contains(n)),
        );
        let tokens = g.inputs(idx).first().and_then(|&(s, k)| {
            g.node(s).outputs[k]
                .shape
                .dims()?
                .first()
                .copied()
                .flatten()
        });
        let element_bytes = g.node(idx).outputs[0].dtype.size_of();
        let capacity_factor = match g.node(idx).attr("capacity_factor") {
            Some(AttrValue::Float(f)) => f,
            _ => 1.0,
        };
        let Some(tokens_per_row) = tokens else {
            return none();
        };
        for v in variables.iter_mut() {
            if l.variables.contains(&g.node(v.node).name) {
                v.expert = true;
            }
        }
        out.push(MoeProfile {
            dispatch: l.dispatch.clone(),
            experts: l.experts,
            width: l.width,
            capacity_factor,
            tokens_per_row,
            element_bytes,
        });
    }
    (out, region)
}

/// The load-balancing losses of `g` (validated at one row), their first two inputs' bytes from
/// `slot_bytes` (every node's outputs, as [`PerRows`]).
fn aux_loss_profiles(g: &Graph, slot_bytes: &[Vec<PerRows>]) -> Vec<AuxLossProfile> {
    g.node_indices()
        .filter(|&i| g.node(i).op == "MoeAuxLoss")
        .map(|i| AuxLossProfile {
            node: i,
            gathered: g
                .inputs(i)
                .into_iter()
                .take(2)
                .map(|(s, k)| {
                    let t = &g.node(s).outputs[k];
                    GatheredInput {
                        bytes: slot_bytes[s.index()][k],
                        element_bytes: t.dtype.size_of(),
                        gradient: t.dtype.is_float(),
                    }
                })
                .collect(),
        })
        .collect()
}

/// Every node `from` depends on by data, `from` included.
fn ancestors(g: &Graph, from: NodeIndex) -> HashSet<NodeIndex> {
    let mut seen = HashSet::new();
    let mut stack = vec![from];
    while let Some(n) = stack.pop() {
        if seen.insert(n) {
            stack.extend(g.inputs(n).into_iter().map(|(s, _)| s));
        }
    }
    seen
}
