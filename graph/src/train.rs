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
}

impl OptimizerKind {
    /// The name used in files: `sgd`, `momentum`, `adam`.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Momentum { .. } => "momentum",
            OptimizerKind::Adam { .. } => "adam",
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
            } => {
                for (name, b) in [("beta1", beta1), ("beta2", beta2)] {
                    if !(0.0..1.0).contains(&b) {
                        return Err(format!("adam {name} must be in [0, 1), got {b}"));
                    }
                }
                if !(epsilon.is_finite() && epsilon > 0.0) {
                    return Err(format!("adam epsilon must be positive, got {epsilon}"));
                }
            }
        }
        Ok(())
    }
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
        OptimizerKind::Adam { .. } => {
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
        };
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
        .ok_or("train.optimizer needs a \"type\": \"sgd\", \"momentum\" or \"adam\"")?;
    let mut kind = match ty {
        "sgd" => OptimizerKind::Sgd,
        "momentum" => OptimizerKind::momentum(),
        "adam" => OptimizerKind::adam(),
        other => {
            return Err(format!(
                "unknown optimizer {other:?} (expected \"sgd\", \"momentum\" or \"adam\")"
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
            other => Err(format!(
                "unknown field train.{other} (train has loss, optimizer, clip_global_norm, metrics)"
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
    };
    spec.check().map_err(|m| vec![(pos, m)])?;
    Ok(spec)
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
