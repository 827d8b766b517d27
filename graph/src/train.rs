//! The training spec and its expansion into a training step: backward pass, optional clipping
//! by global norm, optimizer slots and update ops.
//!
//! [`expand_training`] runs before placement and partitioning, so `dflow partition` shows the
//! real step: gradient ops colocated with their forward ops (on the worker), and each update op
//! and optimizer slot colocated with its variable (on ps in the parameter-server pattern), so
//! only gradients cross from worker to ps.
//!
//! ```
//! use dflow_graph::train::{expand_training, OptimizerKind, OptimizerSpec, TrainSpec};
//! use dflow_graph::{builder::GraphBuilder, DType};
//!
//! let mut b = GraphBuilder::new();
//! let w = b.with_device("/job:ps/task:0", |b| b.variable("w", DType::F32, &[3], "zeros"));
//! let x = b.placeholder("x", DType::F32, &[3]);
//! let y = b.binary("Mul", "y", &x, &w);
//! let _loss = b.op("Sum", "loss").input(&y).finish();
//! let spec = TrainSpec {
//!     lr_schedule: None,
//!     data: None,
//!     loss: "loss".into(),
//!     optimizer: OptimizerSpec { kind: OptimizerKind::Sgd, lr: 0.1 },
//!     clip_global_norm: None,
//!     metrics: vec![],
//! };
//! let t = expand_training(&b.to_def(), &spec).unwrap();
//! let update = t.def.nodes.iter().find(|n| n.name == "train/w/update").unwrap();
//! assert_eq!(update.device, "/job:ps/task:0");
//! assert_eq!(t.gradients[0].0, "w");
//! ```

use crate::autodiff::{free_scope, gradients_of, AutodiffError};
use crate::builder::Output;
use crate::{AttrValue, DType, Graph, GraphDef, GraphErrors, InputRef, NodeDef, Shape};
use std::collections::{BTreeMap, HashSet};

/// What to train and how: the optional `train` section of a graph file.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSpec {
    /// The tensor to minimize (`"loss"` or `"node:k"`); a non-scalar loss is summed.
    pub loss: String,
    /// The optimizer.
    pub optimizer: OptimizerSpec,
    /// Clip the gradients by their global norm (`tf.clip_by_global_norm`) when set.
    pub clip_global_norm: Option<f64>,
    /// Tensors to report each step besides the loss (e.g. `accuracy`).
    pub metrics: Vec<String>,
    /// A learning-rate schedule (linear warm-up, cosine decay); `None`: the optimizer's lr
    /// every step.
    pub lr_schedule: Option<LrSchedule>,
    /// How `dflow run --data FILE` reads its file for this graph; `None`: a CSV of features
    /// with the label in the last column.
    pub data: Option<DataSpec>,
}

impl TrainSpec {
    /// A spec with no clipping, metrics, schedule or data section.
    pub fn new(loss: impl Into<String>, optimizer: OptimizerSpec) -> Self {
        TrainSpec {
            loss: loss.into(),
            optimizer,
            clip_global_norm: None,
            metrics: vec![],
            lr_schedule: None,
            data: None,
        }
    }
}

/// nanoGPT's learning-rate schedule: linear warm-up over `warmup_steps`, then cosine decay to
/// `min_lr` at `decay_steps`, then `min_lr`. With `decay_steps` 0 the lr stays at its base
/// value after the warm-up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Steps of linear warm-up.
    pub warmup_steps: u64,
    /// The step at which the cosine decay reaches `min_lr` (0: no decay).
    pub decay_steps: u64,
    /// The floor of the decay.
    pub min_lr: f64,
}

impl LrSchedule {
    /// The learning rate of step `it` (the number of steps already taken), as nanoGPT's
    /// `get_lr(it)`: `lr·(it+1)/(warmup+1)` during the warm-up, then
    /// `min_lr + ½(1 + cos(π·r))·(lr − min_lr)` with `r = (it − warmup)/(decay − warmup)`, and
    /// `min_lr` after `decay_steps`.
    pub fn lr_at(&self, lr: f64, it: u64) -> f64 {
        lr_at(lr, it, self.warmup_steps, self.decay_steps, self.min_lr)
    }

    /// The schedule's attributes on an update op (see [`lr_at`]).
    pub fn attrs(&self) -> Vec<(&'static str, AttrValue)> {
        vec![
            ("warmup_steps", AttrValue::Int(self.warmup_steps as i64)),
            ("decay_steps", AttrValue::Int(self.decay_steps as i64)),
            ("min_lr", AttrValue::Float(self.min_lr)),
        ]
    }
}

/// [`LrSchedule::lr_at`] on plain numbers (what the update kernels call with their attributes).
pub fn lr_at(lr: f64, it: u64, warmup_steps: u64, decay_steps: u64, min_lr: f64) -> f64 {
    if it < warmup_steps {
        return lr * (it + 1) as f64 / (warmup_steps + 1) as f64;
    }
    if decay_steps == 0 {
        return lr;
    }
    if it > decay_steps {
        return min_lr;
    }
    let span = decay_steps.saturating_sub(warmup_steps).max(1) as f64;
    let ratio = (it - warmup_steps) as f64 / span;
    let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
    min_lr + coeff * (lr - min_lr)
}

/// How a data file feeds the graph's placeholders.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSpec {
    /// A character-level text: random windows of `block_size + 1` characters; the first
    /// `block_size` feed `inputs`, the last `block_size` (shifted by one) feed `targets`, both
    /// `i64 [batch, block_size]`. The last `val_fraction` of the text is held out.
    CharWindows {
        /// Characters per example (the model's context length).
        block_size: usize,
        /// The placeholder fed with the input characters.
        inputs: String,
        /// The placeholder fed with the next characters.
        targets: String,
        /// Fraction of the text (its end) held out for validation.
        val_fraction: f64,
    },
}

/// An optimizer and its learning rate.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerSpec {
    /// Which optimizer, with its own hyperparameters.
    pub kind: OptimizerKind,
    /// Learning rate.
    pub lr: f64,
}

/// The optimizers dflow has update ops for.
#[derive(Clone, Debug, PartialEq)]
pub enum OptimizerKind {
    /// Plain gradient descent (`ApplyGradientDescent`).
    Sgd,
    /// Momentum (`ApplyMomentum`), one `momentum` slot per variable.
    Momentum {
        /// Momentum factor (default 0.9).
        momentum: f64,
        /// Nesterov momentum (default false).
        nesterov: bool,
    },
    /// Adam (`ApplyAdam`), `adam_m` and `adam_v` slots per variable and a shared step counter.
    Adam {
        /// Default 0.9.
        beta1: f64,
        /// Default 0.999.
        beta2: f64,
        /// Default 1e-7.
        epsilon: f64,
    },
    /// AdamW (`ApplyAdamW`, PyTorch's `torch.optim.AdamW`): Adam with bias-corrected moments
    /// and weight decay decoupled from the gradient, applied to variables of rank >= 2 only
    /// (matrices and embeddings; not biases or norm gains, as GPT-2 and nanoGPT do).
    AdamW {
        /// Default 0.9.
        beta1: f64,
        /// Default 0.999.
        beta2: f64,
        /// Default 1e-8.
        epsilon: f64,
        /// Default 0.01.
        weight_decay: f64,
    },
}

impl OptimizerKind {
    /// The name used in files: `sgd`, `momentum`, `adam`.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Momentum { .. } => "momentum",
            OptimizerKind::Adam { .. } => "adam",
            OptimizerKind::AdamW { .. } => "adamw",
        }
    }

    /// Momentum with its defaults.
    pub fn momentum() -> Self {
        OptimizerKind::Momentum {
            momentum: 0.9,
            nesterov: false,
        }
    }

    /// Adam with its defaults.
    pub fn adam() -> Self {
        OptimizerKind::Adam {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-7,
        }
    }

    /// AdamW with PyTorch's defaults.
    pub fn adamw() -> Self {
        OptimizerKind::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.01,
        }
    }

    /// Whether the update op reads the shared step counter (`adam/t`).
    pub fn counts_steps(&self) -> bool {
        matches!(
            self,
            OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. }
        )
    }

    /// The hyperparameters as (name, value) pairs, for writers and messages.
    pub fn params(&self) -> Vec<(&'static str, AttrValue)> {
        match *self {
            OptimizerKind::Sgd => vec![],
            OptimizerKind::Momentum { momentum, nesterov } => vec![
                ("momentum", AttrValue::Float(momentum)),
                ("nesterov", AttrValue::Bool(nesterov)),
            ],
            OptimizerKind::Adam {
                beta1,
                beta2,
                epsilon,
            } => vec![
                ("beta1", AttrValue::Float(beta1)),
                ("beta2", AttrValue::Float(beta2)),
                ("epsilon", AttrValue::Float(epsilon)),
            ],
            OptimizerKind::AdamW {
                beta1,
                beta2,
                epsilon,
                weight_decay,
            } => vec![
                ("beta1", AttrValue::Float(beta1)),
                ("beta2", AttrValue::Float(beta2)),
                ("epsilon", AttrValue::Float(epsilon)),
                ("weight_decay", AttrValue::Float(weight_decay)),
            ],
        }
    }
}

impl TrainSpec {
    /// Checks the hyperparameters' ranges; the message names the offending field.
    pub fn check(&self) -> Result<(), String> {
        let lr = self.optimizer.lr;
        if !(lr.is_finite() && lr > 0.0) {
            return Err(format!(
                "optimizer lr must be positive and finite, got {lr}"
            ));
        }
        if let Some(c) = self.clip_global_norm {
            if !(c.is_finite() && c > 0.0) {
                return Err(format!(
                    "clip_global_norm must be positive and finite, got {c}"
                ));
            }
        }
        match self.optimizer.kind {
            OptimizerKind::Sgd => {}
            OptimizerKind::Momentum { momentum, .. } => {
                if !(momentum.is_finite() && momentum >= 0.0) {
                    return Err(format!("momentum must be >= 0 and finite, got {momentum}"));
                }
            }
            OptimizerKind::Adam {
                beta1,
                beta2,
                epsilon,
            } => check_adam("adam", beta1, beta2, epsilon)?,
            OptimizerKind::AdamW {
                beta1,
                beta2,
                epsilon,
                weight_decay,
            } => {
                check_adam("adamw", beta1, beta2, epsilon)?;
                if !(weight_decay.is_finite() && weight_decay >= 0.0) {
                    return Err(format!(
                        "adamw weight_decay must be >= 0 and finite, got {weight_decay}"
                    ));
                }
            }
        }
        if let Some(s) = &self.lr_schedule {
            if !self.optimizer.kind.counts_steps() {
                return Err(format!(
                    "lr_schedule needs an optimizer that counts steps (adam or adamw), not {}",
                    self.optimizer.kind.name()
                ));
            }
            if !(s.min_lr.is_finite() && s.min_lr >= 0.0 && s.min_lr <= lr) {
                return Err(format!(
                    "lr_schedule min_lr must be in [0, lr = {lr}], got {}",
                    s.min_lr
                ));
            }
            if s.decay_steps != 0 && s.decay_steps <= s.warmup_steps {
                return Err(format!(
                    "lr_schedule decay_steps ({}) must be 0 (no decay) or larger than warmup_steps ({})",
                    s.decay_steps, s.warmup_steps
                ));
            }
        }
        if let Some(DataSpec::CharWindows {
            block_size,
            val_fraction,
            ..
        }) = &self.data
        {
            if *block_size == 0 {
                return Err("data block_size must be at least 1".into());
            }
            if !(0.0..1.0).contains(val_fraction) {
                return Err(format!(
                    "data val_fraction must be in [0, 1), got {val_fraction}"
                ));
            }
        }
        Ok(())
    }
}

/// Checks the moments' decay rates (in [0, 1)) and epsilon (> 0) of an Adam-family optimizer.
fn check_adam(name: &str, beta1: f64, beta2: f64, epsilon: f64) -> Result<(), String> {
    for (what, b) in [("beta1", beta1), ("beta2", beta2)] {
        if !(0.0..1.0).contains(&b) {
            return Err(format!("{name} {what} must be in [0, 1), got {b}"));
        }
    }
    if !(epsilon.is_finite() && epsilon > 0.0) {
        return Err(format!("{name} epsilon must be positive, got {epsilon}"));
    }
    Ok(())
}

/// A graph with its training step added.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainingGraph {
    /// The expanded graph (its `train` section cleared: it is already expanded).
    pub def: GraphDef,
    /// A `NoOp` with control dependencies on every update: run it to take one step.
    pub train_op: String,
    /// The loss tensor.
    pub loss: String,
    /// The metric tensors.
    pub metrics: Vec<String>,
    /// (variable, its gradient tensor) for every trainable variable, in file order.
    pub gradients: Vec<(String, String)>,
    /// How the spec says `--data` is read (see [`TrainSpec::data`]).
    pub data: Option<DataSpec>,
}

/// Why [`expand_training`] failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExpandError {
    /// The spec's values are out of range.
    #[error("train spec: {0}")]
    InvalidSpec(String),
    /// The loss or a metric does not name a tensor.
    #[error("train spec: {role} `{name}` is not a tensor of the graph: {message}")]
    UnknownTensor {
        /// `loss` or `metric`.
        role: &'static str,
        /// The name as given.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// No float variable feeds the loss.
    #[error("train spec: loss `{0}` does not depend on any float Variable; nothing to train")]
    NothingToTrain(String),
    /// A name the expansion needs is already used by a node of the graph.
    #[error("train spec: cannot add node `{0}`: the name is already used in the graph")]
    NameTaken(String),
    /// Building the backward pass failed.
    #[error(transparent)]
    Autodiff(#[from] AutodiffError),
    /// The expanded graph does not validate (a bug in dflow).
    #[error("the expanded training graph is invalid:\n{0}")]
    InvalidResult(GraphErrors),
}

fn find_tensor(g: &Graph, role: &'static str, name: &str) -> Result<(), ExpandError> {
    let unknown = |message: String| ExpandError::UnknownTensor {
        role,
        name: name.to_string(),
        message,
    };
    match InputRef::parse(name).map_err(unknown)? {
        InputRef::Data { node, index } => {
            let idx = g
                .find(&node)
                .ok_or_else(|| unknown(format!("no node named `{node}`")))?;
            if g.output_type(idx, index).is_none() {
                return Err(unknown(format!(
                    "node `{node}` has {} outputs",
                    g.node(idx).outputs.len()
                )));
            }
            Ok(())
        }
        InputRef::Control(_) => Err(unknown("a control input is not a tensor".into())),
    }
}

/// Adds nodes, refusing names already taken.
struct Adder {
    taken: HashSet<String>,
    nodes: Vec<NodeDef>,
}

impl Adder {
    #[allow(clippy::too_many_arguments)]
    fn add(
        &mut self,
        name: String,
        op: &str,
        inputs: Vec<String>,
        device: &str,
        colocate_with: Option<&str>,
        attrs: Vec<(&str, AttrValue)>,
    ) -> Result<String, ExpandError> {
        if !self.taken.insert(name.clone()) {
            return Err(ExpandError::NameTaken(name));
        }
        self.nodes.push(NodeDef {
            name: name.clone(),
            op: op.to_string(),
            inputs,
            device: device.to_string(),
            colocate_with: colocate_with.map(str::to_string).into_iter().collect(),
            attrs: attrs
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect::<BTreeMap<_, _>>(),
        });
        Ok(name)
    }
}

/// One trainable variable: name, device, dtype, shape.
struct Trainable {
    name: String,
    device: String,
    dtype: DType,
    shape: Shape,
}

fn tensor_name(o: &Output) -> String {
    InputRef::Data {
        node: o.node.clone(),
        index: o.index,
    }
    .to_string()
}

/// Adds the training step described by `spec` to `def`: gradients of the loss for every float
/// `Variable` the loss depends on, optional clipping by global norm, optimizer slots (zeros,
/// colocated with their variable) and one update op per variable (`train/<var>/update`,
/// colocated with it), and a `NoOp` named `train` (made unique) that runs them all.
pub fn expand_training(def: &GraphDef, spec: &TrainSpec) -> Result<TrainingGraph, ExpandError> {
    spec.check().map_err(ExpandError::InvalidSpec)?;
    let g = Graph::from_def(def).map_err(AutodiffError::InvalidGraph)?;
    expand(&g, def, spec).map(|(t, _)| t)
}

/// [`expand_training`], also returning the validated training graph, so a caller that goes on
/// to place it need not parse and validate it again.
pub fn expand_training_graph(
    def: &GraphDef,
    spec: &TrainSpec,
) -> Result<(TrainingGraph, Graph), ExpandError> {
    spec.check().map_err(ExpandError::InvalidSpec)?;
    let g = Graph::from_def(def).map_err(AutodiffError::InvalidGraph)?;
    expand(&g, def, spec)
}

/// The expansion of `g` (whose definition is `def`): the training graph and its validated form.
fn expand(
    g: &Graph,
    def: &GraphDef,
    spec: &TrainSpec,
) -> Result<(TrainingGraph, Graph), ExpandError> {
    find_tensor(g, "loss", &spec.loss)?;
    for m in &spec.metrics {
        find_tensor(g, "metric", m)?;
    }
    let loss_node = match InputRef::parse(&spec.loss) {
        Ok(r) => r.node().to_string(),
        Err(message) => {
            return Err(ExpandError::UnknownTensor {
                role: "loss",
                name: spec.loss.clone(),
                message,
            })
        }
    };
    let loss_idx = g
        .find(&loss_node)
        .ok_or_else(|| ExpandError::UnknownTensor {
            role: "loss",
            name: spec.loss.clone(),
            message: format!("no node named `{loss_node}`"),
        })?;

    // Trainable: float Variables the loss reads through data (not reference) edges.
    let mut seen = vec![false; g.num_nodes()];
    let mut stack = vec![loss_idx];
    while let Some(i) = stack.pop() {
        if !std::mem::replace(&mut seen[i.index()], true) {
            stack.extend(
                crate::autodiff::data_inputs(g, i)
                    .into_iter()
                    .map(|(_, s, _)| s),
            );
        }
    }
    let vars: Vec<Trainable> = g
        .node_indices()
        .filter(|&i| seen[i.index()])
        .map(|i| g.node(i))
        .filter(|n| n.op_def().is_variable && n.outputs[0].dtype.is_float())
        .map(|n| Trainable {
            name: n.name.clone(),
            device: n.device.to_string(),
            dtype: n.outputs[0].dtype,
            shape: n.outputs[0].shape.clone(),
        })
        .collect();
    if vars.is_empty() {
        return Err(ExpandError::NothingToTrain(spec.loss.clone()));
    }
    let loss_device = g.node(loss_idx).device.clone();

    let names: Vec<&str> = vars.iter().map(|v| v.name.as_str()).collect();
    let (mut out, grads) = gradients_of(g, def, &spec.loss, &names)?;
    let mut grads: Vec<String> = grads.iter().map(tensor_name).collect();
    let mut a = Adder {
        taken: out.nodes.iter().map(|n| n.name.clone()).collect(),
        nodes: vec![],
    };
    let scope = free_scope(&a.taken, "train");

    if let Some(clip) = spec.clip_global_norm {
        let scale = a.add(
            format!("{scope}/clip/global_norm_scale"),
            "GlobalNormScale",
            grads.clone(),
            &loss_device,
            Some(&loss_node),
            vec![("clip_norm", AttrValue::Float(clip))],
        )?;
        for (v, grad) in vars.iter().zip(grads.iter_mut()) {
            // Scale where the gradient was computed, so one scaled tensor crosses to the variable.
            let producer = grad.split(':').next().unwrap_or(grad).to_string();
            let device = out
                .nodes
                .iter()
                .find(|n| n.name == producer)
                .map(|n| n.device.clone())
                .unwrap_or_default();
            *grad = a.add(
                format!("{scope}/clip/{}", v.name),
                "Mul",
                vec![grad.clone(), scale.clone()],
                &device,
                Some(&producer),
                vec![],
            )?;
        }
    }

    let lr = AttrValue::Float(spec.optimizer.lr);
    let zeros_like_var = |v: &Trainable| {
        vec![
            ("dtype", AttrValue::DType(v.dtype)),
            ("shape", AttrValue::Shape(v.shape.clone())),
            ("initializer", AttrValue::String("zeros".into())),
        ]
    };
    let mut updates = Vec::with_capacity(vars.len());
    let step_counter = match spec.optimizer.kind {
        OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. } => {
            let first = &vars[0];
            Some(a.add(
                "adam/t".to_string(),
                "Variable",
                vec![],
                &first.device,
                Some(&first.name),
                vec![
                    ("dtype", AttrValue::DType(DType::I64)),
                    ("shape", AttrValue::Shape(Shape::scalar())),
                    ("initializer", AttrValue::String("zeros".into())),
                ],
            )?)
        }
        _ => None,
    };
    for (v, grad) in vars.iter().zip(&grads) {
        let slot = |a: &mut Adder, suffix: &str| {
            a.add(
                format!("{}/{suffix}", v.name),
                "Variable",
                vec![],
                &v.device,
                Some(&v.name),
                zeros_like_var(v),
            )
        };
        let name = format!("{scope}/{}/update", v.name);
        let (op, inputs, attrs) = match spec.optimizer.kind {
            OptimizerKind::Sgd => (
                "ApplyGradientDescent",
                vec![v.name.clone(), grad.clone()],
                vec![("lr", lr.clone())],
            ),
            OptimizerKind::Momentum { momentum, nesterov } => {
                let accum = slot(&mut a, "momentum")?;
                (
                    "ApplyMomentum",
                    vec![v.name.clone(), accum, grad.clone()],
                    vec![
                        ("lr", lr.clone()),
                        ("momentum", AttrValue::Float(momentum)),
                        ("use_nesterov", AttrValue::Bool(nesterov)),
                    ],
                )
            }
            OptimizerKind::Adam {
                beta1,
                beta2,
                epsilon,
            } => {
                let m = slot(&mut a, "adam_m")?;
                let s = slot(&mut a, "adam_v")?;
                let t = step_counter.clone().unwrap_or_default();
                (
                    "ApplyAdam",
                    vec![v.name.clone(), m, s, t, grad.clone()],
                    vec![
                        ("lr", lr.clone()),
                        ("beta1", AttrValue::Float(beta1)),
                        ("beta2", AttrValue::Float(beta2)),
                        ("epsilon", AttrValue::Float(epsilon)),
                    ],
                )
            }
            OptimizerKind::AdamW {
                beta1,
                beta2,
                epsilon,
                weight_decay,
            } => {
                let m = slot(&mut a, "adam_m")?;
                let s = slot(&mut a, "adam_v")?;
                let t = step_counter.clone().unwrap_or_default();
                // Decay matrices and embeddings only (rank >= 2), as GPT-2 and nanoGPT do.
                let decay = if v.shape.rank().is_some_and(|r| r >= 2) {
                    weight_decay
                } else {
                    0.0
                };
                (
                    "ApplyAdamW",
                    vec![v.name.clone(), m, s, t, grad.clone()],
                    vec![
                        ("lr", lr.clone()),
                        ("beta1", AttrValue::Float(beta1)),
                        ("beta2", AttrValue::Float(beta2)),
                        ("epsilon", AttrValue::Float(epsilon)),
                        ("weight_decay", AttrValue::Float(decay)),
                    ],
                )
            }
        };
        let mut attrs = attrs;
        if let Some(schedule) = &spec.lr_schedule {
            attrs.extend(schedule.attrs());
        }
        updates.push(a.add(name, op, inputs, &v.device, Some(&v.name), attrs)?);
    }
    if let Some(t) = &step_counter {
        // Counts the step once all updates have read the old count.
        let mut inputs = vec![t.clone()];
        inputs.extend(updates.iter().map(|u| format!("^{u}")));
        let device = vars[0].device.clone();
        let inc = a.add(
            format!("{scope}/adam/t/increment"),
            "IncrementStep",
            inputs,
            &device,
            Some(t),
            vec![],
        )?;
        updates.push(inc);
    }
    let train_op = a.add(
        scope.clone(),
        "NoOp",
        updates.iter().map(|u| format!("^{u}")).collect(),
        &loss_device,
        None,
        vec![],
    )?;

    out.nodes.extend(a.nodes);
    out.train = None;
    let graph = Graph::from_def(&out).map_err(ExpandError::InvalidResult)?;
    let training = TrainingGraph {
        def: out,
        train_op,
        loss: spec.loss.clone(),
        metrics: spec.metrics.clone(),
        gradients: vars.into_iter().map(|v| v.name).zip(grads).collect(),
        data: spec.data.clone(),
    };
    Ok((training, graph))
}

// ---------------------------------------------------------------------------------------------
// The spec in files (shared by the JSON and DSL readers and writers)
// ---------------------------------------------------------------------------------------------

/// One `key: value` of a file's train section, with the byte offset of its value.
pub(crate) type SpecField = (String, usize, serde_json::Value);

fn number(v: &serde_json::Value, what: &str) -> Result<f64, String> {
    v.as_f64()
        .ok_or_else(|| format!("{what} must be a number, found {v}"))
}

fn optimizer_from_json(v: &serde_json::Value) -> Result<OptimizerSpec, String> {
    let obj = v.as_object().ok_or_else(|| {
        format!("train.optimizer must be an object like {{\"type\": \"adam\", \"lr\": 0.01}}, found {v}")
    })?;
    let ty = obj
        .get("type")
        .and_then(serde_json::Value::as_str)
        .ok_or("train.optimizer needs a \"type\": \"sgd\", \"momentum\", \"adam\" or \"adamw\"")?;
    let mut kind = match ty {
        "sgd" => OptimizerKind::Sgd,
        "momentum" => OptimizerKind::momentum(),
        "adam" => OptimizerKind::adam(),
        "adamw" => OptimizerKind::adamw(),
        other => {
            return Err(format!(
            "unknown optimizer {other:?} (expected \"sgd\", \"momentum\", \"adam\" or \"adamw\")"
        ))
        }
    };
    let lr = obj
        .get("lr")
        .ok_or_else(|| format!("optimizer {ty} needs \"lr\""))?;
    let lr = number(lr, "train.optimizer.lr")?;
    for (k, v) in obj {
        let what = format!("train.optimizer.{k}");
        match (&mut kind, k.as_str()) {
            (_, "type" | "lr") => {}
            (OptimizerKind::Momentum { momentum, .. }, "momentum") => *momentum = number(v, &what)?,
            (OptimizerKind::Momentum { nesterov, .. }, "nesterov") => {
                *nesterov = v
                    .as_bool()
                    .ok_or_else(|| format!("{what} must be true or false, found {v}"))?
            }
            (OptimizerKind::Adam { beta1, .. }, "beta1") => *beta1 = number(v, &what)?,
            (OptimizerKind::Adam { beta2, .. }, "beta2") => *beta2 = number(v, &what)?,
            (OptimizerKind::Adam { epsilon, .. }, "epsilon") => *epsilon = number(v, &what)?,
            (OptimizerKind::AdamW { beta1, .. }, "beta1") => *beta1 = number(v, &what)?,
            (OptimizerKind::AdamW { beta2, .. }, "beta2") => *beta2 = number(v, &what)?,
            (OptimizerKind::AdamW { epsilon, .. }, "epsilon") => *epsilon = number(v, &what)?,
            (OptimizerKind::AdamW { weight_decay, .. }, "weight_decay") => {
                *weight_decay = number(v, &what)?
            }
            (kind, _) => {
                let known: Vec<&str> = kind.params().iter().map(|(n, _)| *n).collect();
                return Err(format!(
                    "optimizer {ty} has no parameter {k:?} (it takes lr{})",
                    known.iter().map(|n| format!(", {n}")).collect::<String>()
                ));
            }
        }
    }
    Ok(OptimizerSpec { kind, lr })
}

/// Builds a spec from a train section's fields; `pos` is the section's offset (for missing
/// fields). Errors carry the offset of the value they are about.
pub(crate) fn spec_from_fields(
    fields: Vec<SpecField>,
    pos: usize,
) -> Result<TrainSpec, Vec<(usize, String)>> {
    let mut errs = vec![];
    let (mut loss, mut optimizer, mut clip, mut metrics) = (None, None, None, vec![]);
    let (mut lr_schedule, mut data) = (None, None);
    let mut seen = HashSet::new();
    for (k, at, v) in fields {
        if !seen.insert(k.clone()) {
            errs.push((at, format!("train.{k} is given twice")));
            continue;
        }
        let r: Result<(), String> = match k.as_str() {
            "loss" => match v.as_str().map(InputRef::parse) {
                Some(Ok(InputRef::Data { .. })) => {
                    loss = v.as_str().map(str::to_string);
                    Ok(())
                }
                _ => Err(format!("train.loss must be a tensor name, found {v}")),
            },
            "optimizer" => optimizer_from_json(&v).map(|o| optimizer = Some(o)),
            "clip_global_norm" => match v {
                serde_json::Value::Null => Ok(()),
                v => number(&v, "train.clip_global_norm").map(|c| clip = Some(c)),
            },
            "metrics" => match v.as_array() {
                Some(items) => {
                    items
                        .iter()
                        .try_for_each(|m| match m.as_str().map(InputRef::parse) {
                            Some(Ok(InputRef::Data { .. })) => {
                                metrics.push(m.as_str().unwrap_or_default().to_string());
                                Ok(())
                            }
                            _ => Err(format!(
                                "train.metrics entries must be tensor names, found {m}"
                            )),
                        })
                }
                None => Err(format!(
                    "train.metrics must be a list of tensor names, found {v}"
                )),
            },
            "lr_schedule" => schedule_from_json(&v).map(|x| lr_schedule = Some(x)),
            "data" => data_from_json(&v).map(|x| data = Some(x)),
            other => Err(format!(
                "unknown field train.{other} (train has {})",
                TRAIN_FIELDS.join(", ")
            )),
        };
        if let Err(m) = r {
            errs.push((at, m));
        }
    }
    if loss.is_none() && !seen.contains("loss") {
        errs.push((pos, "train is missing \"loss\"".into()));
    }
    if optimizer.is_none() && !seen.contains("optimizer") {
        errs.push((pos, "train is missing \"optimizer\"".into()));
    }
    let (Some(loss), Some(optimizer), true) = (loss, optimizer, errs.is_empty()) else {
        return Err(errs);
    };
    let spec = TrainSpec {
        loss,
        optimizer,
        clip_global_norm: clip,
        metrics,
        lr_schedule,
        data,
    };
    spec.check().map_err(|m| vec![(pos, m)])?;
    Ok(spec)
}

/// The fields a train section may have, in the order writers write them.
pub(crate) const TRAIN_FIELDS: [&str; 6] = [
    "loss",
    "optimizer",
    "clip_global_norm",
    "metrics",
    "lr_schedule",
    "data",
];

/// Reads `{"type": NAME, key: value, ...}` into its keys, refusing keys not in `known`.
fn typed_object<'a>(
    v: &'a serde_json::Value,
    what: &str,
    example: &str,
    types: &[&str],
) -> Result<(&'a str, &'a serde_json::Map<String, serde_json::Value>), String> {
    let obj = v
        .as_object()
        .ok_or_else(|| format!("train.{what} must be an object like {example}, found {v}"))?;
    let ty = obj
        .get("type")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| format!("train.{what} needs a \"type\": one of {types:?}"))?;
    if !types.contains(&ty) {
        return Err(format!(
            "unknown train.{what} type {ty:?} (expected one of {types:?})"
        ));
    }
    Ok((ty, obj))
}

fn whole_number(v: &serde_json::Value, what: &str) -> Result<u64, String> {
    v.as_u64()
        .ok_or_else(|| format!("{what} must be a whole number >= 0, found {v}"))
}

fn schedule_from_json(v: &serde_json::Value) -> Result<LrSchedule, String> {
    let example =
        r#"{"type": "cosine", "warmup_steps": 100, "decay_steps": 2000, "min_lr": 0.0001}"#;
    let (_, obj) = typed_object(v, "lr_schedule", example, &["cosine"])?;
    let mut s = LrSchedule {
        warmup_steps: 0,
        decay_steps: 0,
        min_lr: 0.0,
    };
    for (k, v) in obj {
        let what = format!("train.lr_schedule.{k}");
        match k.as_str() {
            "type" => {}
            "warmup_steps" => s.warmup_steps = whole_number(v, &what)?,
            "decay_steps" => s.decay_steps = whole_number(v, &what)?,
            "min_lr" => s.min_lr = number(v, &what)?,
            _ => {
                return Err(format!(
                "train.lr_schedule has no field {k:?} (it takes warmup_steps, decay_steps, min_lr)"
            ))
            }
        }
    }
    Ok(s)
}

fn data_from_json(v: &serde_json::Value) -> Result<DataSpec, String> {
    let example =
        r#"{"type": "char_windows", "block_size": 64, "inputs": "idx", "targets": "targets"}"#;
    let (_, obj) = typed_object(v, "data", example, &["char_windows"])?;
    let (mut block_size, mut inputs, mut targets, mut val_fraction) = (None, None, None, 0.1);
    for (k, v) in obj {
        let what = format!("train.data.{k}");
        let name = |v: &serde_json::Value| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("{what} must be a placeholder name, found {v}"))
        };
        match k.as_str() {
            "type" => {}
            "block_size" => block_size = Some(whole_number(v, &what)? as usize),
            "inputs" => inputs = Some(name(v)?),
            "targets" => targets = Some(name(v)?),
            "val_fraction" => val_fraction = number(v, &what)?,
            _ => {
                return Err(format!(
                    "train.data has no field {k:?} (char_windows takes block_size, inputs, targets, val_fraction)"
                ))
            }
        }
    }
    match (block_size, inputs, targets) {
        (Some(block_size), Some(inputs), Some(targets)) => Ok(DataSpec::CharWindows {
            block_size,
            inputs,
            targets,
            val_fraction,
        }),
        _ => Err(format!(
            "train.data char_windows needs block_size, inputs and targets, like {example}"
        )),
    }
}

/// The schedule as a JSON object: `{"type": "cosine", "warmup_steps": ..., ...}`.
pub(crate) fn schedule_to_json(s: &LrSchedule) -> serde_json::Value {
    serde_json::json!({
        "type": "cosine",
        "warmup_steps": s.warmup_steps,
        "decay_steps": s.decay_steps,
        "min_lr": s.min_lr,
    })
}

/// The data section as a JSON object: `{"type": "char_windows", ...}`.
pub(crate) fn data_to_json(d: &DataSpec) -> serde_json::Value {
    match d {
        DataSpec::CharWindows {
            block_size,
            inputs,
            targets,
            val_fraction,
        } => serde_json::json!({
            "type": "char_windows",
            "block_size": block_size,
            "inputs": inputs,
            "targets": targets,
            "val_fraction": val_fraction,
        }),
    }
}

/// The optimizer as a JSON object: `{"type": "adam", "lr": 0.01, "beta1": 0.9, ...}`.
pub(crate) fn optimizer_to_json(o: &OptimizerSpec) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    m.insert("type".into(), o.kind.name().into());
    m.insert("lr".into(), o.lr.into());
    for (k, v) in o.kind.params() {
        m.insert(k.into(), crate::format::attr_to_json(&v));
    }
    serde_json::Value::Object(m)
}
