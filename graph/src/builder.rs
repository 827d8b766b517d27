//! The Rust builder API: typed node handles, device scopes, control dependencies.
//!
//! ```
//! use dflow_graph::{builder::GraphBuilder, DType};
//!
//! let mut b = GraphBuilder::new();
//! let w = b.with_device("/job:ps/task:0", |b| b.variable("w", DType::F32, &[4, 2], "glorot_uniform"));
//! let x = b.placeholder("x", DType::F32, &[-1, 4]);
//! let y = b.op("Identity", "y").input(&x).device("/job:worker/task:0").finish();
//! let _done = b.op("NoOp", "done").control_dep(&y).control_dep(&w).finish();
//! let g = b.build().unwrap();
//! assert_eq!(&*g.node(g.find("w").unwrap()).device, "/job:ps/task:0");
//! ```

use crate::def::FORMAT_VERSION;
use crate::{AttrValue, DType, Graph, GraphDef, GraphErrors, NodeDef, Shape, Tensor};

/// One output of a node: what a consumer's input refers to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Output {
    /// Producer node name.
    pub node: String,
    /// Producer output index.
    pub index: usize,
}

/// A node added to a [`GraphBuilder`]. Converts to its output 0 where an input is expected.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NodeHandle {
    name: String,
}

impl NodeHandle {
    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Output `index` of this node.
    pub fn out(&self, index: usize) -> Output {
        Output {
            node: self.name.clone(),
            index,
        }
    }
}

impl From<&NodeHandle> for Output {
    fn from(h: &NodeHandle) -> Output {
        h.out(0)
    }
}

impl From<&Output> for Output {
    fn from(o: &Output) -> Output {
        o.clone()
    }
}

/// Builds a [`Graph`] node by node; [`GraphBuilder::build`] validates it.
#[derive(Debug, Default)]
pub struct GraphBuilder {
    nodes: Vec<NodeDef>,
    device_scope: Vec<String>,
}

/// Adds one node; finish with [`OpBuilder::finish`].
#[derive(Debug)]
pub struct OpBuilder<'a> {
    b: &'a mut GraphBuilder,
    node: NodeDef,
    controls: Vec<String>,
}

impl OpBuilder<'_> {
    /// Appends a data input.
    pub fn input(mut self, x: impl Into<Output>) -> Self {
        let o = x.into();
        self.node.inputs.push(
            crate::InputRef::Data {
                node: o.node,
                index: o.index,
            }
            .to_string(),
        );
        self
    }

    /// Appends several data inputs.
    pub fn inputs<O: Into<Output>>(mut self, xs: impl IntoIterator<Item = O>) -> Self {
        for x in xs {
            self = self.input(x);
        }
        self
    }

    /// Sets an attribute.
    pub fn attr(mut self, name: &str, value: impl Into<AttrValue>) -> Self {
        self.node.attrs.insert(name.to_string(), value.into());
        self
    }

    /// Declares the node's placement over the tensor-parallel ranks (the `_sharding`
    /// attribute; see [`crate::sharding`]): a variable's layout, or an op's forced output
    /// layout.
    pub fn sharding(self, p: crate::sharding::Placement) -> Self {
        self.attr(
            crate::sharding::SHARDING_ATTR,
            crate::sharding::sharding_attr(p),
        )
    }

    /// Declares the node's placement on each mesh axis (the `_sharding` attribute written
    /// axis-named, e.g. `dp:Shard(0),tp:Shard(1)`; see [`crate::sharding`]).
    pub fn placements(self, p: crate::sharding::AxisPlacements) -> Self {
        self.attr(
            crate::sharding::SHARDING_ATTR,
            crate::sharding::placements_attr(p),
        )
    }

    /// Requests a device (overrides the enclosing [`GraphBuilder::with_device`] scope).
    pub fn device(mut self, device: &str) -> Self {
        self.node.device = device.to_string();
        self
    }

    /// Runs this node only after `dep`.
    pub fn control_dep(mut self, dep: &NodeHandle) -> Self {
        self.controls.push(format!("^{}", dep.name));
        self
    }

    /// Places this node with `other`.
    pub fn colocate_with(mut self, other: &NodeHandle) -> Self {
        self.node.colocate_with.push(other.name.clone());
        self
    }

    /// Adds the node and returns its handle.
    pub fn finish(mut self) -> NodeHandle {
        self.node.inputs.append(&mut self.controls);
        let name = self.node.name.clone();
        self.b.nodes.push(self.node);
        NodeHandle { name }
    }
}

impl GraphBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts a node of op `op` named `name`, on the current device scope.
    pub fn op(&mut self, op: &str, name: &str) -> OpBuilder<'_> {
        let device = self.device_scope.last().cloned().unwrap_or_default();
        OpBuilder {
            node: NodeDef {
                name: name.to_string(),
                op: op.to_string(),
                device,
                ..Default::default()
            },
            b: self,
            controls: vec![],
        }
    }

    /// Runs `f` with `device` as the default device of the nodes it adds.
    pub fn with_device<R>(&mut self, device: &str, f: impl FnOnce(&mut Self) -> R) -> R {
        self.device_scope.push(device.to_string());
        let r = f(self);
        self.device_scope.pop();
        r
    }

    /// A placeholder fed by the client; `-1` in `dims` is an unknown dimension.
    pub fn placeholder(&mut self, name: &str, dtype: DType, dims: &[i64]) -> NodeHandle {
        let shape = Shape::from_signed(dims).unwrap_or_else(|_| Shape::unknown());
        self.op("Placeholder", name)
            .attr("dtype", dtype)
            .attr("shape", shape)
            .finish()
    }

    /// A constant.
    pub fn constant(&mut self, name: &str, value: Tensor) -> NodeHandle {
        self.op("Const", name).attr("value", value).finish()
    }

    /// A variable with an initializer name (`zeros`, `glorot_uniform`, ...).
    pub fn variable(
        &mut self,
        name: &str,
        dtype: DType,
        dims: &[usize],
        initializer: &str,
    ) -> NodeHandle {
        self.op("Variable", name)
            .attr("dtype", dtype)
            .attr("shape", Shape::known(dims))
            .attr("initializer", initializer)
            .finish()
    }

    /// Declares the placement of the node `node` added earlier (see [`OpBuilder::sharding`]);
    /// false when no node has that name.
    pub fn set_sharding(&mut self, node: &NodeHandle, p: crate::sharding::Placement) -> bool {
        match self.nodes.iter_mut().find(|n| n.name == node.name) {
            Some(n) => {
                n.attrs.insert(
                    crate::sharding::SHARDING_ATTR.to_string(),
                    crate::sharding::sharding_attr(p),
                );
                true
            }
            None => false,
        }
    }

    /// Declares the placements on each mesh axis of the node `node` added earlier (see
    /// [`OpBuilder::placements`]); false when no node has that name.
    pub fn set_placements(
        &mut self,
        node: &NodeHandle,
        p: crate::sharding::AxisPlacements,
    ) -> bool {
        match self.nodes.iter_mut().find(|n| n.name == node.name) {
            Some(n) => {
                n.attrs.insert(
                    crate::sharding::SHARDING_ATTR.to_string(),
                    crate::sharding::placements_attr(p),
                );
                true
            }
            None => false,
        }
    }

    /// A one-input op with no attributes.
    pub fn unary(&mut self, op: &str, name: &str, x: impl Into<Output>) -> NodeHandle {
        self.op(op, name).input(x).finish()
    }

    /// A two-input op with no attributes.
    pub fn binary(
        &mut self,
        op: &str,
        name: &str,
        a: impl Into<Output>,
        b: impl Into<Output>,
    ) -> NodeHandle {
        self.op(op, name).input(a).input(b).finish()
    }

    /// `a @ b`.
    pub fn matmul(&mut self, name: &str, a: impl Into<Output>, b: impl Into<Output>) -> NodeHandle {
        self.binary("MatMul", name, a, b)
    }

    /// The nodes added so far, as a [`GraphDef`].
    pub fn to_def(&self) -> GraphDef {
        GraphDef {
            version: FORMAT_VERSION,
            nodes: self.nodes.clone(),
            train: None,
        }
    }

    /// Validates and returns the graph.
    pub fn build(self) -> Result<Graph, GraphErrors> {
        Graph::from_def(&GraphDef {
            version: FORMAT_VERSION,
            nodes: self.nodes,
            train: None,
        })
    }
}
