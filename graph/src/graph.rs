//! The validated graph IR, on petgraph.
//!
//! [`Graph::from_def`] checks a [`GraphDef`] and builds a directed graph whose nodes carry their
//! op, attributes and inferred output types, and whose edges are data edges (with producer
//! output and consumer input slots) or control edges. Every later stage — placement,
//! partitioning, execution — works on this IR.
//!
//! ```
//! use dflow_graph::{Graph, GraphDef, NodeDef, DType, Shape, AttrValue};
//!
//! let mut def = GraphDef { version: 1, nodes: vec![], train: None };
//! let mut x = NodeDef { name: "x".into(), op: "Placeholder".into(), ..Default::default() };
//! x.attrs.insert("dtype".into(), AttrValue::DType(DType::F32));
//! x.attrs.insert("shape".into(), AttrValue::Shape(Shape::known(&[2, 3])));
//! def.nodes.push(x);
//! def.nodes.push(NodeDef { name: "y".into(), op: "Identity".into(), inputs: vec!["x".into()], ..Default::default() });
//!
//! let g = Graph::from_def(&def).unwrap();
//! let y = g.find("y").unwrap();
//! assert_eq!(g.node(y).outputs[0].shape, Shape::known(&[2, 3]));
//! assert_eq!(g.to_def(), def);
//! ```

use crate::def::{check_node_name, FORMAT_VERSION};
use crate::error::{GraphError, GraphErrors};
use crate::name_index::NameIndex;
use crate::ops::{registry, InferCtx, OpDef, TensorType};
use crate::{AttrValue, Attrs, GraphDef, InputRef, NodeDef};
use petgraph::graph::{DiGraph, EdgeIndex, NodeIndex};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// A node of the validated graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Unique name.
    pub name: String,
    /// Op type: the registered op's name (empty only for an op that failed validation).
    pub op: &'static str,
    /// Requested device as written (possibly partial, possibly empty). Shared: nodes on one
    /// device usually hold the same string.
    pub device: Arc<str>,
    /// Nodes this node must be colocated with.
    pub colocate_with: Vec<String>,
    /// Attributes as written in the source (defaults not filled in).
    pub attrs: Attrs,
    /// Inferred type of each output (shared: copies of a node, e.g. in partitions, share it).
    pub outputs: Arc<[TensorType]>,
}

impl Node {
    /// The op's declaration (every node of a validated graph has a registered op).
    pub fn op_def(&self) -> &'static OpDef {
        // Validation guarantees the op exists; a missing op would be a bug in this crate.
        registry().get(self.op).unwrap_or_else(|| {
            panic!(
                "validated node `{}` has unregistered op `{}`",
                self.name, self.op
            )
        })
    }

    /// An attribute, or its declared default.
    pub fn attr(&self, name: &str) -> Option<AttrValue> {
        self.attrs
            .get(name)
            .cloned()
            .or_else(|| self.op_def().attr(name).and_then(|a| a.default.value()))
    }

    /// All attributes with declared defaults filled in.
    pub fn resolved_attrs(&self) -> BTreeMap<String, AttrValue> {
        resolve_attrs(self.op_def(), &self.attrs)
    }
}

fn resolve_attrs(op: &OpDef, attrs: &Attrs) -> BTreeMap<String, AttrValue> {
    let mut out = attrs.to_map();
    for a in &op.attrs {
        if !out.contains_key(a.name) {
            if let Some(v) = a.default.value() {
                out.insert(a.name.to_string(), v);
            }
        }
    }
    out
}

/// An edge of the graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Edge {
    /// Output `src_output` of the source feeds input `dst_input` of the destination.
    Data {
        /// Producer output slot.
        src_output: usize,
        /// Consumer input slot.
        dst_input: usize,
    },
    /// The destination runs only after the source.
    Control,
}

/// A validated dataflow graph.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    g: DiGraph<Node, Edge>,
    by_name: NameIndex,
}

/// Limit on reported errors per graph, so a hostile file cannot make the report unbounded.
const MAX_ERRORS: usize = 100;

impl Graph {
    /// Validates `def` and builds the graph. Every problem found is reported, up to a cap.
    pub fn from_def(def: &GraphDef) -> Result<Graph, GraphErrors> {
        let mut errs = Vec::new();
        if def.version != FORMAT_VERSION {
            errs.push(GraphError::UnsupportedVersion {
                found: def.version,
                supported: FORMAT_VERSION,
            });
        }

        // 1. Names.
        let mut by_name = NameIndex::with_capacity(def.nodes.len());
        let mut g: DiGraph<Node, Edge> = DiGraph::with_capacity(def.nodes.len(), def.nodes.len());
        // The node of each entry of `def` (none for a duplicate), and the entry of each node.
        let mut node_of_def: Vec<Option<NodeIndex>> = Vec::with_capacity(def.nodes.len());
        let mut def_of_node: Vec<usize> = Vec::with_capacity(def.nodes.len());
        // Nodes name a handful of devices: one shared string each.
        let mut devices: HashMap<&str, Arc<str>> = HashMap::new();
        for (i, n) in def.nodes.iter().enumerate() {
            if let Err(message) = check_node_name(&n.name) {
                errs.push(GraphError::InvalidName { index: i, message });
            }
            let next = g.node_count() as u32;
            if let Err(first) = by_name.insert(&n.name, next, |k| name_at(&g, k)) {
                errs.push(GraphError::DuplicateName {
                    name: n.name.clone(),
                    first: def_of_node[first as usize],
                    second: i,
                });
                node_of_def.push(None);
                continue;
            }
            node_of_def.push(Some(NodeIndex::new(next as usize)));
            def_of_node.push(i);
            // An unknown op is reported below (by the def's name for it).
            let op = registry().get(&n.op);
            g.add_node(Node {
                name: n.name.clone(),
                op: op.map_or("", |op| op.name),
                device: devices
                    .entry(n.device.as_str())
                    .or_insert_with(|| Arc::from(n.device.as_str()))
                    .clone(),
                colocate_with: n.colocate_with.clone(),
                // Attribute names the op declares are kept as its `&'static str`s.
                attrs: Attrs::from_map_with(&n.attrs, |k| op?.attr(k).map(|a| a.name)),
                outputs: Arc::from([]),
            });
        }

        // 2. Ops and attributes.
        let mut op_ok = vec![false; g.node_count()];
        // Most nodes share a handful of devices; parse each distinct one once.
        let mut good_devices: std::collections::HashSet<&str> = std::collections::HashSet::new();
        for idx in g.node_indices() {
            let n = &g[idx];
            match registry().get(n.op) {
                None => {
                    let op = &def.nodes[def_of_node[idx.index()]].op;
                    errs.push(GraphError::UnknownOp {
                        node: n.name.clone(),
                        op: op.clone(),
                        suggestion: registry().suggest(op),
                    })
                }
                Some(op) => {
                    let before = errs.len();
                    check_attrs(n, op, &mut errs);
                    if !good_devices.contains(&*n.device) && check_device(n, &mut errs) {
                        good_devices.insert(&n.device);
                    }
                    op_ok[idx.index()] = errs.len() == before;
                }
            }
        }

        // 3. Inputs and edges.
        let mut pending_edges = Vec::new();
        let find = |name: &str| {
            by_name
                .get(name, |k| name_at(&g, k))
                .map(|k| NodeIndex::new(k as usize))
        };
        for (i, n) in def.nodes.iter().enumerate() {
            let Some(dst) = node_of_def[i] else {
                continue; // a duplicate; already reported
            };
            let mut seen_control = false;
            let mut data_inputs = 0;
            for input in &n.inputs {
                let (src_name, index) = match crate::def::parse_input(input) {
                    Ok(r) => r,
                    Err(message) => {
                        errs.push(GraphError::InvalidInput {
                            node: n.name.clone(),
                            message,
                        });
                        continue;
                    }
                };
                let Some(src) = find(src_name) else {
                    if index.is_some() {
                        data_inputs += 1; // still counts towards arity
                    }
                    op_ok[dst.index()] = false;
                    errs.push(GraphError::DanglingInput {
                        node: n.name.clone(),
                        input: input.clone(),
                        missing: src_name.to_string(),
                        suggestion: nearest_name(src_name, &g),
                    });
                    continue;
                };
                match index {
                    None => {
                        seen_control = true;
                        pending_edges.push((src, dst, Edge::Control));
                    }
                    Some(index) => {
                        if seen_control {
                            errs.push(GraphError::InvalidInput {
                                node: n.name.clone(),
                                message: format!("data input `{input}` comes after a control input; list control inputs (`^x`) last"),
                            });
                        }
                        pending_edges.push((
                            src,
                            dst,
                            Edge::Data {
                                src_output: index,
                                dst_input: data_inputs,
                            },
                        ));
                        data_inputs += 1;
                    }
                }
            }
            for target in &n.colocate_with {
                if find(target).is_none() {
                    errs.push(GraphError::UnknownColocation {
                        node: n.name.clone(),
                        target: target.clone(),
                    });
                }
            }
            if let Some(op) = registry().get(&n.op) {
                let want = op.inputs.len();
                let ok = if op.is_variadic() {
                    data_inputs >= want
                } else {
                    data_inputs == want
                };
                if !ok {
                    errs.push(GraphError::Arity {
                        node: n.name.clone(),
                        op: n.op.clone(),
                        expected: if op.is_variadic() {
                            format!("at least {want}")
                        } else {
                            want.to_string()
                        },
                        found: data_inputs,
                    });
                    op_ok[dst.index()] = false;
                }
            }
        }
        for (src, dst, e) in pending_edges {
            if let Edge::Data { src_output, .. } = e {
                // An op with a repeated last output is checked after inference (step 5).
                if let Some(op) = registry()
                    .get(g[src].op)
                    .filter(|o| !o.has_variadic_output())
                {
                    if src_output >= op.outputs.len() {
                        errs.push(GraphError::NoSuchOutput {
                            node: g[dst].name.clone(),
                            input: format!("{}:{src_output}", g[src].name),
                            index: src_output,
                            producer: g[src].name.clone(),
                            outputs: op.outputs.len(),
                        });
                        op_ok[dst.index()] = false;
                        continue;
                    }
                }
            }
            g.add_edge(src, dst, e);
        }

        let mut graph = Graph { g, by_name };

        // 4. Cycles.
        let order = match petgraph::algo::toposort(&graph.g, None) {
            Ok(order) => order,
            Err(cycle) => {
                errs.push(GraphError::Cycle {
                    path: graph.cycle_through(cycle.node_id()),
                });
                truncate(&mut errs);
                return Err(GraphErrors(errs));
            }
        };

        // 5. Reference inputs and type inference, in topological order.
        let mut typed = vec![false; graph.g.node_count()];
        // Nodes without attrs of one op all resolve to the op's defaults: build that map once.
        let mut defaults: HashMap<&str, BTreeMap<String, AttrValue>> = HashMap::new();
        // Most nodes have one of a few output type lists: keep one shared copy of each.
        let mut type_lists: std::collections::HashSet<Arc<[TensorType]>> =
            std::collections::HashSet::new();
        for idx in order {
            if !op_ok[idx.index()] {
                continue;
            }
            let inputs = graph.inputs(idx);
            if inputs.iter().any(|(src, _)| !typed[src.index()]) {
                continue; // an upstream node failed; don't cascade
            }
            let node = &graph.g[idx];
            let op = node.op_def();
            let mut input_types = Vec::with_capacity(inputs.len());
            let mut ref_ok = true;
            for (i, (src, out)) in inputs.iter().enumerate() {
                let producer = &graph.g[*src];
                if let Some(arg) = op.inputs.get(i).filter(|a| a.is_ref) {
                    if !producer.op_def().is_variable {
                        errs.push(GraphError::RefInput {
                            node: node.name.clone(),
                            op: node.op.to_string(),
                            index: i,
                            arg: arg.name,
                            producer: producer.name.clone(),
                            producer_op: producer.op.to_string(),
                        });
                        ref_ok = false;
                    }
                }
                match producer.outputs.get(*out) {
                    Some(t) => input_types.push(t.clone()),
                    None => {
                        // Only reachable for a producer with a repeated output (see step 3).
                        errs.push(GraphError::NoSuchOutput {
                            node: node.name.clone(),
                            input: format!("{}:{out}", producer.name),
                            index: *out,
                            producer: producer.name.clone(),
                            outputs: producer.outputs.len(),
                        });
                        ref_ok = false;
                    }
                }
            }
            if !ref_ok {
                continue;
            }
            let own;
            let attrs = if node.attrs.is_empty() {
                defaults
                    .entry(op.name)
                    .or_insert_with(|| resolve_attrs(op, &node.attrs))
            } else {
                own = resolve_attrs(op, &node.attrs);
                &own
            };
            let ctx = InferCtx {
                node: &node.name,
                inputs: &input_types,
                attrs,
            };
            match (op.infer)(&ctx) {
                Ok(outs) if op.output_count_ok(outs.len()) => {
                    graph.g[idx].outputs = match type_lists.get(&outs[..]) {
                        Some(shared) => shared.clone(),
                        None => {
                            let shared: Arc<[TensorType]> = outs.into();
                            type_lists.insert(shared.clone());
                            shared
                        }
                    };
                    typed[idx.index()] = true;
                }
                Ok(outs) => errs.push(GraphError::Shape {
                    node: node.name.clone(),
                    op: node.op.to_string(),
                    message: format!(
                        "shape rule returned {} outputs, op declares {}{}",
                        outs.len(),
                        if op.has_variadic_output() {
                            "at least "
                        } else {
                            ""
                        },
                        op.outputs.len()
                    ),
                }),
                Err(message) => errs.push(GraphError::Shape {
                    node: node.name.clone(),
                    op: node.op.to_string(),
                    message: message.to_string(),
                }),
            }
        }

        if errs.is_empty() {
            Ok(graph)
        } else {
            truncate(&mut errs);
            Err(GraphErrors(errs))
        }
    }

    /// Builds a graph from parts that were already validated, e.g. the subgraphs the partitioner
    /// cuts out of a validated graph: `nodes` carry their inferred `outputs`, and `edges` are
    /// `(source, destination, edge)` by position in `nodes`, in the order [`Graph::from_def`]
    /// would add them (by destination, then input order).
    ///
    /// Attributes are not re-checked and types are not re-inferred. Only cheap structural checks
    /// run: registered ops, unique names, edge endpoints and producer output slots in range, and
    /// no cycle. Nodes and edges may come from iterators (their size hints size the graph), so a
    /// caller can make each node straight into the graph.
    pub fn from_parts(
        nodes: impl IntoIterator<Item = Node>,
        edges: impl IntoIterator<Item = (u32, u32, Edge)>,
    ) -> Result<Graph, GraphErrors> {
        let (nodes, edges) = (nodes.into_iter(), edges.into_iter());
        let mut errs = Vec::new();
        let mut g: DiGraph<Node, Edge> =
            DiGraph::with_capacity(nodes.size_hint().0, edges.size_hint().0);
        let mut by_name = NameIndex::with_capacity(nodes.size_hint().0);
        // A partition uses a handful of ops: look each up in the registry once.
        let mut known_ops: Vec<&'static str> = Vec::new();
        for node in nodes {
            let i = g.node_count();
            if !known_ops.contains(&node.op) {
                match registry().get(node.op) {
                    None => errs.push(GraphError::UnknownOp {
                        node: node.name.clone(),
                        op: node.op.to_string(),
                        suggestion: registry().suggest(node.op),
                    }),
                    // Bounded, so a graph of many ops does not make this quadratic.
                    Some(op) if known_ops.len() < 32 => known_ops.push(op.name),
                    Some(_) => {}
                }
            }
            if let Err(first) = by_name.insert(&node.name, i as u32, |k| name_at(&g, k)) {
                errs.push(GraphError::DuplicateName {
                    name: node.name.clone(),
                    first: first as usize,
                    second: i,
                });
            }
            g.add_node(node);
        }
        if !errs.is_empty() {
            truncate(&mut errs);
            return Err(GraphErrors(errs));
        }
        let n = g.node_count();
        let mut indegree = vec![0u32; n];
        for (src, dst, e) in edges {
            let (s, d) = (src as usize, dst as usize);
            if s >= n || d >= n {
                errs.push(GraphError::InvalidInput {
                    node: g
                        .node_weight(NodeIndex::new(d))
                        .map_or_else(|| format!("#{d}"), |x| x.name.clone()),
                    message: format!("edge {s} -> {d} names a node out of range (0..{n})"),
                });
                continue;
            }
            if let Edge::Data { src_output, .. } = e {
                let outputs = g[NodeIndex::new(s)].outputs.len();
                if src_output >= outputs {
                    errs.push(GraphError::NoSuchOutput {
                        node: g[NodeIndex::new(d)].name.clone(),
                        input: format!("{}:{src_output}", g[NodeIndex::new(s)].name),
                        index: src_output,
                        producer: g[NodeIndex::new(s)].name.clone(),
                        outputs,
                    });
                    continue;
                }
            }
            indegree[d] += 1;
            g.add_edge(NodeIndex::new(s), NodeIndex::new(d), e);
        }
        if !errs.is_empty() {
            truncate(&mut errs);
            return Err(GraphErrors(errs));
        }
        let graph = Graph { g, by_name };
        // Kahn's algorithm: every node is reached exactly when there is no cycle.
        let mut ready: Vec<NodeIndex> = (0..n)
            .filter(|&i| indegree[i] == 0)
            .map(NodeIndex::new)
            .collect();
        let mut seen = 0;
        while let Some(v) = ready.pop() {
            seen += 1;
            for w in graph.g.neighbors_directed(v, Direction::Outgoing) {
                indegree[w.index()] -= 1;
                if indegree[w.index()] == 0 {
                    ready.push(w);
                }
            }
        }
        if seen < n {
            // Every node left over has a left-over predecessor; walking back must hit a cycle.
            let mut v = NodeIndex::new((0..n).find(|&i| indegree[i] > 0).unwrap_or(0));
            let mut on_path = vec![false; n];
            while !on_path[v.index()] {
                on_path[v.index()] = true;
                match graph
                    .g
                    .neighbors_directed(v, Direction::Incoming)
                    .find(|u| indegree[u.index()] > 0)
                {
                    Some(u) => v = u,
                    None => break,
                }
            }
            return Err(GraphErrors(vec![GraphError::Cycle {
                path: graph.cycle_through(v),
            }]));
        }
        Ok(graph)
    }

    /// Back to the serializable form (inverse of [`Graph::from_def`], node order preserved).
    pub fn to_def(&self) -> GraphDef {
        let nodes = self
            .g
            .node_indices()
            .map(|idx| {
                let n = &self.g[idx];
                let mut inputs: Vec<String> = self
                    .inputs(idx)
                    .into_iter()
                    .map(|(src, out)| {
                        InputRef::Data {
                            node: self.g[src].name.clone(),
                            index: out,
                        }
                        .to_string()
                    })
                    .collect();
                inputs.extend(
                    self.control_inputs(idx)
                        .into_iter()
                        .map(|s| format!("^{}", self.g[s].name)),
                );
                NodeDef {
                    name: n.name.clone(),
                    op: n.op.to_string(),
                    inputs,
                    device: n.device.to_string(),
                    colocate_with: n.colocate_with.clone(),
                    attrs: n.attrs.to_map(),
                }
            })
            .collect();
        GraphDef {
            version: FORMAT_VERSION,
            nodes,
            train: None,
        }
    }

    /// Number of nodes.
    pub fn num_nodes(&self) -> usize {
        self.g.node_count()
    }

    /// Number of edges (data and control).
    pub fn num_edges(&self) -> usize {
        self.g.edge_count()
    }

    /// Node indices in file order.
    pub fn node_indices(&self) -> impl Iterator<Item = NodeIndex> + '_ {
        self.g.node_indices()
    }

    /// The node at `idx`.
    pub fn node(&self, idx: NodeIndex) -> &Node {
        &self.g[idx]
    }

    /// Looks a node up by name.
    pub fn find(&self, name: &str) -> Option<NodeIndex> {
        self.by_name
            .get(name, |k| name_at(&self.g, k))
            .map(|k| NodeIndex::new(k as usize))
    }

    /// The data inputs of `idx` in input-slot order: (producer, producer output).
    pub fn inputs(&self, idx: NodeIndex) -> Vec<(NodeIndex, usize)> {
        let mut v: Vec<(usize, NodeIndex, usize)> = self
            .g
            .edges_directed(idx, Direction::Incoming)
            .filter_map(|e| match *e.weight() {
                Edge::Data {
                    src_output,
                    dst_input,
                } => Some((dst_input, e.source(), src_output)),
                Edge::Control => None,
            })
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, s, o)| (s, o)).collect()
    }

    /// The control inputs of `idx`, in insertion order.
    pub fn control_inputs(&self, idx: NodeIndex) -> Vec<NodeIndex> {
        let mut v: Vec<(EdgeIndex, NodeIndex)> = self
            .g
            .edges_directed(idx, Direction::Incoming)
            .filter(|e| *e.weight() == Edge::Control)
            .map(|e| (e.id(), e.source()))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, s)| s).collect()
    }

    /// Every outgoing edge of `idx`: (consumer, edge).
    pub fn out_edges(&self, idx: NodeIndex) -> Vec<(NodeIndex, Edge)> {
        let mut v: Vec<(EdgeIndex, NodeIndex, Edge)> = self
            .g
            .edges_directed(idx, Direction::Outgoing)
            .map(|e| (e.id(), e.target(), *e.weight()))
            .collect();
        v.sort_unstable_by_key(|x| x.0);
        v.into_iter().map(|(_, t, e)| (t, e)).collect()
    }

    /// Node indices in a topological order (producers before consumers), deterministic.
    pub fn topo_order(&self) -> Vec<NodeIndex> {
        // Validation rejected cycles, so this cannot fail on a Graph built by from_def.
        petgraph::algo::toposort(&self.g, None).unwrap_or_default()
    }

    /// The type of output `out` of node `idx`.
    pub fn output_type(&self, idx: NodeIndex, out: usize) -> Option<&TensorType> {
        self.g[idx].outputs.get(out)
    }

    /// The data tensor `name` (`node:out`, or `node` for output 0): its producer, the output
    /// index and its type. The error says in words what is wrong with the name (a control
    /// input `^node`, no such node, too few outputs), for the caller to put in context.
    pub fn resolve_tensor(&self, name: &str) -> Result<(NodeIndex, usize, &TensorType), String> {
        let (node, index) = match InputRef::parse(name)? {
            InputRef::Data { node, index } => (node, index),
            InputRef::Control(_) => return Err("a control input is not a tensor".into()),
        };
        let idx = self
            .find(&node)
            .ok_or_else(|| format!("no node named `{node}`"))?;
        let ty = self
            .output_type(idx, index)
            .ok_or_else(|| format!("node `{node}` has {} outputs", self.g[idx].outputs.len()))?;
        Ok((idx, index, ty))
    }

    /// The underlying petgraph graph (read-only).
    pub fn petgraph(&self) -> &DiGraph<Node, Edge> {
        &self.g
    }

    /// Variables and their total size: (count, elements, bytes).
    pub fn parameter_stats(&self) -> (usize, usize, usize) {
        self.g
            .node_weights()
            .filter(|n| n.op_def().is_variable)
            .fold((0, 0, 0), |(c, e, b), n| {
                let t = &n.outputs[0];
                let elems = t.shape.num_elements().unwrap_or(0);
                (c + 1, e + elems, b + t.byte_size().unwrap_or(0))
            })
    }

    fn cycle_through(&self, start: NodeIndex) -> Vec<String> {
        // Iterative DFS from `start` until it returns to `start`; the stack is the cycle.
        let mut stack: Vec<(NodeIndex, Vec<NodeIndex>)> =
            vec![(start, self.g.neighbors(start).collect())];
        let mut visited = vec![false; self.g.node_count()];
        visited[start.index()] = true;
        while let Some((_, next)) = stack.last_mut() {
            match next.pop() {
                Some(n) if n == start => {
                    let mut path: Vec<String> =
                        stack.iter().map(|(x, _)| self.g[*x].name.clone()).collect();
                    path.push(self.g[start].name.clone());
                    return path;
                }
                Some(n) if !visited[n.index()] => {
                    visited[n.index()] = true;
                    let succ = self.g.neighbors(n).collect();
                    stack.push((n, succ));
                }
                Some(_) => {}
                None => {
                    stack.pop();
                }
            }
        }
        vec![self.g[start].name.clone(), self.g[start].name.clone()]
    }
}

fn check_attrs(n: &Node, op: &OpDef, errs: &mut Vec<GraphError>) {
    for (name, value) in &n.attrs {
        match op.attr(name) {
            None => errs.push(GraphError::UnknownAttr {
                node: n.name.clone(),
                op: n.op.to_string(),
                attr: name.to_string(),
                valid: op.attrs.iter().map(|a| a.name).collect(),
            }),
            Some(d) if d.ty != value.ty() => errs.push(GraphError::AttrType {
                node: n.name.clone(),
                attr: name.to_string(),
                expected: d.ty,
                found: value.ty(),
            }),
            Some(_) => {}
        }
    }
    if let Some(v) = n.attrs.get(crate::sharding::SHARDING_ATTR) {
        let checked = crate::sharding::sharding_value(&n.name, v).and_then(|a| {
            crate::sharding::check_op_placements(n.op, &a)
                .map_err(|e| format!("node `{}`: {e}", n.name))
        });
        if let Err(message) = checked {
            errs.push(GraphError::Sharding {
                node: n.name.clone(),
                message,
            });
        }
    }
    for a in &op.attrs {
        if a.default == crate::ops::AttrDefault::Required && !n.attrs.contains_key(a.name) {
            errs.push(GraphError::MissingAttr {
                node: n.name.clone(),
                op: n.op.to_string(),
                attr: a.name,
                ty: a.ty,
            });
        }
    }
}

/// False (and an error pushed) when the node's device does not parse.
fn check_device(n: &Node, errs: &mut Vec<GraphError>) -> bool {
    match crate::DeviceName::parse(&n.device) {
        Ok(_) => true,
        Err(e) => {
            errs.push(GraphError::InvalidDevice {
                node: n.name.clone(),
                message: e.to_string(),
            });
            false
        }
    }
}

/// The name of node `k`, or `""` past the end.
fn name_at(g: &DiGraph<Node, Edge>, k: u32) -> &str {
    g.node_weight(NodeIndex::new(k as usize))
        .map_or("", |n| n.name.as_str())
}

fn nearest_name(name: &str, g: &DiGraph<Node, Edge>) -> Option<String> {
    // Bounded: suggestions only for graphs small enough that a linear scan is cheap.
    if g.node_count() > 10_000 {
        return None;
    }
    g.node_weights()
        .map(|n| (strsim::jaro_winkler(name, &n.name), &n.name))
        .filter(|(s, _)| *s > 0.85)
        .max_by(|a, b| a.0.total_cmp(&b.0).then_with(|| b.1.cmp(a.1)))
        .map(|(_, k)| k.clone())
}

fn truncate(errs: &mut Vec<GraphError>) {
    errs.truncate(MAX_ERRORS);
}
