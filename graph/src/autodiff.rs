//! Symbolic reverse-mode differentiation, like `tf.gradients`.
//!
//! [`gradients`] extends a [`GraphDef`] with the backward pass of `loss` with respect to some
//! tensors and returns the gradient tensors. Each op's gradient is a [`GradFn`] registered next
//! to the op (a `// ---- gradients ----` block at the end of its family module); it adds nodes
//! through a [`GradBuilder`], which names them `gradients/<forward node>/...`, gives them the
//! forward node's device and colocates them with it (TensorFlow's
//! `colocate_gradients_with_ops`), so the partitioner keeps each backward op on the device of its
//! forward op and only activations' gradients cross devices.
//!
//! ```
//! use dflow_graph::{autodiff::gradients, builder::GraphBuilder, DType};
//!
//! let mut b = GraphBuilder::new();
//! let x = b.placeholder("x", DType::F64, &[3]);
//! let y = b.unary("Square", "y", &x);
//! let _loss = b.op("Sum", "loss").input(&y).finish();
//! let (def, grads) = gradients(&b.to_def(), "loss", &["x"]).unwrap();
//! assert_eq!(grads.len(), 1);
//! assert!(def.nodes.iter().any(|n| n.name == grads[0].node));
//! ```

use crate::builder::Output;
use crate::ops::TensorType;
use crate::{AttrValue, DType, Graph, GraphDef, GraphErrors, InputRef, NodeDef, Shape};
use petgraph::graph::NodeIndex;
use std::collections::{BTreeMap, HashMap, HashSet};

/// An op's gradient: given the forward node and the gradient flowing into each of its outputs
/// (`None` where the loss does not depend on that output), adds the backward nodes and returns
/// the gradient of each data input (`None` for inputs that get none, e.g. integer labels).
/// The error message describes the problem; the caller adds the node and op.
pub type GradFn =
    fn(&mut GradBuilder, &ForwardNode, &[Option<Output>]) -> Result<Vec<Option<Output>>, String>;

/// The gradient of an op that is not differentiable (ArgMax, Equal, ...): no input gets one.
pub fn no_gradient(
    _: &mut GradBuilder,
    fwd: &ForwardNode,
    _: &[Option<Output>],
) -> Result<Vec<Option<Output>>, String> {
    Ok(vec![None; fwd.inputs.len()])
}

/// What most gradient functions return.
pub type GradResult = Result<Vec<Option<Output>>, String>;

/// The gradient of a single-output op's output: the one entry of `dys`.
pub fn only_dy(dys: &[Option<Output>]) -> Result<&Output, String> {
    dys.first()
        .and_then(Option::as_ref)
        .ok_or_else(|| "no gradient flows into output 0".to_string())
}

/// What a [`GradFn`] knows about the forward node.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardNode {
    /// Node name.
    pub name: String,
    /// Op type.
    pub op: String,
    /// Requested device (the backward nodes get the same).
    pub device: String,
    /// Attributes with declared defaults filled in.
    pub attrs: BTreeMap<String, AttrValue>,
    /// The data inputs, in slot order.
    pub inputs: Vec<Output>,
    /// Static types of the data inputs.
    pub input_types: Vec<TensorType>,
    /// Static types of the outputs.
    pub output_types: Vec<TensorType>,
}

impl ForwardNode {
    /// Output `index` of the forward node.
    pub fn output(&self, index: usize) -> Output {
        Output {
            node: self.name.clone(),
            index,
        }
    }

    /// Data input `i`.
    pub fn input(&self, i: usize) -> Result<&Output, String> {
        self.inputs
            .get(i)
            .ok_or_else(|| format!("missing input {i}"))
    }

    /// Static type of data input `i`.
    pub fn input_type(&self, i: usize) -> Result<&TensorType, String> {
        self.input_types
            .get(i)
            .ok_or_else(|| format!("missing input {i}"))
    }

    /// Static type of output `i`.
    pub fn output_type(&self, i: usize) -> Result<&TensorType, String> {
        self.output_types
            .get(i)
            .ok_or_else(|| format!("missing output {i}"))
    }

    /// An attribute (defaults are filled in).
    pub fn attr(&self, name: &str) -> Result<&AttrValue, String> {
        self.attrs
            .get(name)
            .ok_or_else(|| format!("missing attribute `{name}`"))
    }

    /// A bool attribute.
    pub fn bool_attr(&self, name: &str) -> Result<bool, String> {
        match self.attr(name)? {
            AttrValue::Bool(b) => Ok(*b),
            v => Err(format!("attribute `{name}` is {}, not bool", v.ty())),
        }
    }

    /// An int-list attribute.
    pub fn ints_attr(&self, name: &str) -> Result<Vec<i64>, String> {
        match self.attr(name)? {
            AttrValue::IntList(v) => Ok(v.clone()),
            v => Err(format!("attribute `{name}` is {}, not list(int)", v.ty())),
        }
    }
}

/// Adds backward nodes on behalf of one forward node at a time.
#[derive(Debug)]
pub struct GradBuilder {
    scope: String,
    taken: HashSet<String>,
    nodes: Vec<NodeDef>,
    /// (name, device) of the forward node whose gradient is being built.
    current: (String, String),
}

impl GradBuilder {
    fn new(scope: String, taken: HashSet<String>) -> Self {
        GradBuilder {
            scope,
            taken,
            nodes: vec![],
            current: (String::new(), String::new()),
        }
    }

    fn fresh_name(&mut self, suffix: &str) -> String {
        let base = format!("{}/{}/{suffix}", self.scope, self.current.0);
        let mut name = base.clone();
        let mut k = 1;
        while self.taken.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        self.taken.insert(name.clone());
        name
    }

    /// Adds node `op` named `<scope>/<forward node>/<suffix>` (made unique), on the forward
    /// node's device and colocated with it; returns its name.
    pub fn add(
        &mut self,
        op: &str,
        suffix: &str,
        inputs: &[&Output],
        attrs: &[(&str, AttrValue)],
    ) -> String {
        let name = self.fresh_name(suffix);
        let (fwd, device) = &self.current;
        self.nodes.push(NodeDef {
            name: name.clone(),
            op: op.to_string(),
            inputs: inputs
                .iter()
                .map(|o| {
                    InputRef::Data {
                        node: o.node.clone(),
                        index: o.index,
                    }
                    .to_string()
                })
                .collect(),
            device: device.clone(),
            colocate_with: if fwd.is_empty() {
                vec![]
            } else {
                vec![fwd.clone()]
            },
            attrs: attrs
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        });
        name
    }

    /// Like [`GradBuilder::add`], returning output 0.
    pub fn op(
        &mut self,
        op: &str,
        suffix: &str,
        inputs: &[&Output],
        attrs: &[(&str, AttrValue)],
    ) -> Output {
        Output {
            node: self.add(op, suffix, inputs, attrs),
            index: 0,
        }
    }

    /// A one-input op without attributes.
    pub fn unary(&mut self, op: &str, suffix: &str, x: &Output) -> Output {
        self.op(op, suffix, &[x], &[])
    }

    /// A two-input op without attributes.
    pub fn binary(&mut self, op: &str, suffix: &str, x: &Output, y: &Output) -> Output {
        self.op(op, suffix, &[x, y], &[])
    }

    /// `grad` (of static shape `grad_shape`) summed over the dimensions along which the forward
    /// node broadcast its input `i`, so it takes that input's run-time shape. No node is added
    /// when both shapes are fully known and equal.
    pub fn reduce_to_input(
        &mut self,
        fwd: &ForwardNode,
        i: usize,
        grad: Output,
        grad_shape: &Shape,
        suffix: &str,
    ) -> Result<Output, String> {
        let like = fwd.input(i)?;
        let like_shape = &fwd.input_type(i)?.shape;
        if grad_shape.is_static() && grad_shape == like_shape {
            return Ok(grad);
        }
        Ok(self.binary("ReduceToShapeOf", suffix, &grad, like))
    }

    fn set_forward(&mut self, name: &str, device: &str) {
        self.current = (name.to_string(), device.to_string());
    }
}

/// Why [`gradients`] failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AutodiffError {
    /// The input graph does not validate.
    #[error("the graph is invalid:\n{0}")]
    InvalidGraph(GraphErrors),
    /// A loss or wrt tensor name does not name a tensor of the graph.
    #[error("{role} `{name}`: {message}")]
    UnknownTensor {
        /// `loss` or `wrt`.
        role: &'static str,
        /// The name as given.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// Gradients exist only for floating-point tensors.
    #[error("{role} `{name}` is {dtype}; gradients need a float tensor")]
    NotFloat {
        /// `loss` or `wrt`.
        role: &'static str,
        /// The tensor.
        name: String,
        /// Its dtype.
        dtype: DType,
    },
    /// The loss does not depend (differentiably) on a wrt tensor.
    #[error("loss `{loss}` does not depend differentiably on `{wrt}`")]
    NotConnected {
        /// The wrt tensor.
        wrt: String,
        /// The loss tensor.
        loss: String,
    },
    /// An op between the wrt tensors and the loss has no gradient.
    #[error("node `{node}`: op `{op}` has no gradient, but it lies between the loss and a tensor being differentiated")]
    NoGradient {
        /// Node name.
        node: String,
        /// Its op.
        op: String,
    },
    /// An op's gradient function failed.
    #[error("node `{node}`: gradient of `{op}` failed: {message}")]
    GradientFailed {
        /// Node name.
        node: String,
        /// Its op.
        op: String,
        /// What went wrong.
        message: String,
    },
    /// The graph with the backward pass does not validate (a bug in a gradient function).
    #[error("the backward graph is invalid:\n{0}")]
    InvalidBackward(GraphErrors),
}

/// A tensor of a validated graph: (node, output).
type TensorId = (NodeIndex, usize);

fn resolve(g: &Graph, role: &'static str, name: &str) -> Result<TensorId, AutodiffError> {
    let unknown = |message: String| AutodiffError::UnknownTensor {
        role,
        name: name.to_string(),
        message,
    };
    let (idx, index, ty) = g.resolve_tensor(name).map_err(unknown)?;
    if !ty.dtype.is_float() {
        return Err(AutodiffError::NotFloat {
            role,
            name: name.to_string(),
            dtype: ty.dtype,
        });
    }
    Ok((idx, index))
}

/// The data inputs of `idx` that are differentiable edges (not reference inputs).
pub(crate) fn data_inputs(g: &Graph, idx: NodeIndex) -> Vec<(usize, NodeIndex, usize)> {
    let op = g.node(idx).op_def();
    g.inputs(idx)
        .into_iter()
        .enumerate()
        .filter(|(slot, _)| {
            !op.inputs
                .get(*slot)
                .or(op.inputs.last().filter(|a| a.variadic))
                .is_some_and(|a| a.is_ref)
        })
        .map(|(slot, (src, out))| (slot, src, out))
        .collect()
}

/// A name prefix no node of `g` uses: `gradients`, else `gradients_1`, ...
pub(crate) fn free_scope(taken: &HashSet<String>, base: &str) -> String {
    let used = |s: &str| {
        let prefix = format!("{s}/");
        taken.iter().any(|n| n == s || n.starts_with(&prefix))
    };
    let mut scope = base.to_string();
    let mut k = 1;
    while used(&scope) {
        scope = format!("{base}_{k}");
        k += 1;
    }
    scope
}

/// Adds the gradient of `loss` (a tensor name: `"node"` or `"node:k"`) with respect to each
/// `wrt` tensor to `def`, like `tf.gradients(loss, wrt)` (a non-scalar loss is summed).
///
/// Walks the nodes that lie on a data path from a wrt tensor to the loss in reverse topological
/// order, seeding with `OnesLike(loss)` and summing several incoming gradients with `AddN`.
/// Returns the extended graph (validated) and one gradient tensor per wrt tensor.
pub fn gradients(
    def: &GraphDef,
    loss: &str,
    wrt: &[&str],
) -> Result<(GraphDef, Vec<Output>), AutodiffError> {
    let g = Graph::from_def(def).map_err(AutodiffError::InvalidGraph)?;
    let (out, grads) = gradients_of(&g, def, loss, wrt)?;
    Graph::from_def(&out).map_err(AutodiffError::InvalidBackward)?;
    Ok((out, grads))
}

/// [`gradients`] of the validated `g`, whose definition is `def`; the extended graph is not
/// validated here (the caller validates what it builds on top of it once).
pub(crate) fn gradients_of(
    g: &Graph,
    def: &GraphDef,
    loss: &str,
    wrt: &[&str],
) -> Result<(GraphDef, Vec<Output>), AutodiffError> {
    let loss_id = resolve(g, "loss", loss)?;
    let wrt_ids = wrt
        .iter()
        .map(|w| resolve(g, "wrt", w))
        .collect::<Result<Vec<_>, _>>()?;

    // Nodes on a differentiable path from some wrt tensor to the loss.
    let n = g.num_nodes();
    let mut consumers: Vec<Vec<NodeIndex>> = vec![vec![]; n];
    for idx in g.node_indices() {
        for (_, src, _) in data_inputs(g, idx) {
            consumers[src.index()].push(idx);
        }
    }
    let mut from_wrt = vec![false; n];
    let mut stack: Vec<NodeIndex> = wrt_ids.iter().map(|w| w.0).collect();
    while let Some(i) = stack.pop() {
        if !std::mem::replace(&mut from_wrt[i.index()], true) {
            stack.extend(consumers[i.index()].iter().copied());
        }
    }
    let mut to_loss = vec![false; n];
    let mut stack = vec![loss_id.0];
    while let Some(i) = stack.pop() {
        if !std::mem::replace(&mut to_loss[i.index()], true) {
            stack.extend(data_inputs(g, i).into_iter().map(|(_, s, _)| s));
        }
    }
    let on_path = |i: NodeIndex| from_wrt[i.index()] && to_loss[i.index()];

    let taken: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
    let scope = free_scope(&taken, "gradients");
    let mut b = GradBuilder::new(scope, taken);

    let mut incoming: HashMap<TensorId, Vec<Output>> = HashMap::new();
    let mut summed: HashMap<TensorId, Output> = HashMap::new();
    let loss_node = g.node(loss_id.0);
    b.set_forward(&loss_node.name, &loss_node.device);
    let seed = b.unary(
        "OnesLike",
        "seed",
        &Output {
            node: loss_node.name.clone(),
            index: loss_id.1,
        },
    );
    incoming.insert(loss_id, vec![seed]);

    for idx in g.topo_order().into_iter().rev() {
        if !on_path(idx) {
            continue;
        }
        let node = g.node(idx);
        b.set_forward(&node.name, &node.device);
        let mut dys = Vec::with_capacity(node.outputs.len());
        for k in 0..node.outputs.len() {
            let dy = match incoming.remove(&(idx, k)) {
                None => None,
                Some(mut v) if v.len() == 1 => v.pop(),
                Some(v) => {
                    let refs: Vec<&Output> = v.iter().collect();
                    Some(b.op("AddN", &format!("sum_{k}"), &refs, &[]))
                }
            };
            if let Some(dy) = &dy {
                summed.insert((idx, k), dy.clone());
            }
            dys.push(dy);
        }
        let inputs = data_inputs(g, idx);
        if dys.iter().all(Option::is_none) || !inputs.iter().any(|(_, s, _)| on_path(*s)) {
            continue;
        }
        let op = node.op_def();
        let f = op.gradient.ok_or_else(|| AutodiffError::NoGradient {
            node: node.name.clone(),
            op: node.op.to_string(),
        })?;
        let all_inputs = g.inputs(idx);
        let fwd = ForwardNode {
            name: node.name.clone(),
            op: node.op.to_string(),
            device: node.device.to_string(),
            attrs: node.resolved_attrs(),
            inputs: all_inputs
                .iter()
                .map(|(s, o)| Output {
                    node: g.node(*s).name.clone(),
                    index: *o,
                })
                .collect(),
            input_types: all_inputs
                .iter()
                .filter_map(|(s, o)| g.output_type(*s, *o).cloned())
                .collect(),
            output_types: node.outputs.to_vec(),
        };
        let failed = |message: String| AutodiffError::GradientFailed {
            node: node.name.clone(),
            op: node.op.to_string(),
            message,
        };
        let dxs = f(&mut b, &fwd, &dys).map_err(failed)?;
        if dxs.len() > all_inputs.len() {
            return Err(failed(format!(
                "returned {} input gradients for {} inputs",
                dxs.len(),
                all_inputs.len()
            )));
        }
        for (slot, src, out) in inputs {
            let Some(Some(dx)) = dxs.get(slot) else {
                continue;
            };
            let float = g.output_type(src, out).is_some_and(|t| t.dtype.is_float());
            if on_path(src) && float {
                incoming.entry((src, out)).or_default().push(dx.clone());
            }
        }
    }

    let mut grads = Vec::with_capacity(wrt_ids.len());
    for (id, name) in wrt_ids.iter().zip(wrt) {
        grads.push(
            summed
                .get(id)
                .cloned()
                .ok_or_else(|| AutodiffError::NotConnected {
                    wrt: name.to_string(),
                    loss: loss.to_string(),
                })?,
        );
    }
    let mut out = def.clone();
    out.nodes.extend(b.nodes);
    Ok((out, grads))
}
