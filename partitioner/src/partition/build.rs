//! Making each partition's graph from its items: the full nodes (Send/Recv nodes with their
//! rendezvous attributes) go straight into the graph, partitions in parallel.

use super::naming::{concat, PairNames};
use super::{source_type, EdgeSrc, Item, PairBuild, PairKind, PartBuild, Source, TensorRef};
use crate::error::PartitionError;
use dflow_graph::{AttrValue, Attrs, DType, DeviceName, Graph, Node, Shape, Tensor, TensorType};
use petgraph::graph::NodeIndex;
use std::sync::Arc;

/// Makes the full nodes of the partitions from their items; shared by the parallel builders.
pub(super) struct NodeMaker<'a> {
    pub(super) g: &'a Graph,
    pub(super) keep: &'a [bool],
    pub(super) dev: &'a [u32],
    pub(super) dev_str: &'a [String],
    pub(super) feeds: &'a [TensorRef],
    pub(super) pairs: &'a [PairBuild],
    pub(super) names: &'a [PairNames],
}

/// Values the nodes of one partition share. One set per partition, so that threads building
/// different partitions never count references on the same allocation.
struct PartShared {
    /// The partition's device: every node's `device`.
    device: Arc<str>,
    /// This partition's copy of every device's full name (by device id), for the
    /// `send_device`/`recv_device` attrs of its Send/Recv nodes.
    devices: Vec<Arc<str>>,
    /// The value a control pair sends: an empty f32 tensor.
    empty: Option<Arc<Tensor>>,
    /// Its type.
    control_type: Arc<[TensorType]>,
    /// Output type lists of the input graph (shared by many of its nodes) and this
    /// partition's copy of each: a node takes the local copy, so the threads do not all count
    /// references on the input graph's few lists.
    type_lists: Vec<(TypeList, TypeList)>,
}

/// A node's output types.
type TypeList = Arc<[TensorType]>;

/// How many distinct output type lists a partition keeps local copies of.
const LOCAL_TYPE_LISTS: usize = 16;

impl PartShared {
    /// The shared values of the partition of device `d`, given every device's full name.
    fn new(dev_str: &[String], d: usize) -> PartShared {
        let devices: Vec<Arc<str>> = dev_str.iter().map(|s| Arc::from(s.as_str())).collect();
        PartShared {
            device: devices[d].clone(),
            devices,
            empty: Tensor::zeros(DType::F32, &[0]).ok().map(Arc::new),
            control_type: Arc::from([TensorType::new(DType::F32, Shape::known(&[0]))]),
            type_lists: Vec::new(),
        }
    }

    /// A list equal to `outputs`, from this partition's copies where it has one.
    fn outputs(&mut self, outputs: &Arc<[TensorType]>) -> Arc<[TensorType]> {
        if let Some((_, local)) = self
            .type_lists
            .iter()
            .find(|(shared, _)| Arc::ptr_eq(shared, outputs))
        {
            return local.clone();
        }
        if self.type_lists.len() == LOCAL_TYPE_LISTS {
            return outputs.clone();
        }
        let local: Arc<[TensorType]> = Arc::from(&outputs[..]);
        self.type_lists.push((outputs.clone(), local.clone()));
        local
    }
}

impl NodeMaker<'_> {
    /// The node `item` of the partition of device `d`.
    fn node(&self, d: usize, item: Item, local: &mut PartShared) -> Node {
        let pair = |p: u32| (&self.pairs[p as usize], &self.names[p as usize]);
        match item {
            Item::Orig(v) => {
                let node = self.g.node(NodeIndex::new(v as usize));
                let colocate_with = node
                    .colocate_with
                    .iter()
                    .filter(|c| {
                        self.g.find(c).is_some_and(|k| {
                            self.keep[k.index()] && self.dev[k.index()] as usize == d
                        })
                    })
                    .cloned()
                    .collect();
                Node {
                    name: node.name.clone(),
                    op: node.op,
                    device: local.device.clone(),
                    colocate_with,
                    attrs: node.attrs.clone(),
                    outputs: local.outputs(&node.outputs),
                }
            }
            Item::Send(p) => {
                let (p, names) = pair(p);
                send_node(
                    names.send_node.clone(),
                    local.device.clone(),
                    names.tensor_name.clone(),
                    local.devices[p.recv_dev as usize].clone(),
                    p.kind == PairKind::Fetch,
                )
            }
            Item::Recv(p) => {
                let (p, names) = pair(p);
                let outputs = match p.src {
                    // A single-output source's type list is the Recv's: share it.
                    Source::Data(u, 0) => {
                        let outputs = &self.g.node(NodeIndex::new(u as usize)).outputs;
                        if outputs.len() == 1 {
                            local.outputs(outputs)
                        } else {
                            Arc::from([outputs[0].clone()])
                        }
                    }
                    Source::Control(_) => local.control_type.clone(),
                    src => Arc::from([source_type(self.g, self.feeds, src)]),
                };
                recv_node(
                    names.recv_node.clone(),
                    local.device.clone(),
                    names.tensor_name.clone(),
                    local.devices[p.send_dev as usize].clone(),
                    p.kind == PairKind::Feed,
                    outputs,
                )
            }
            Item::ControlValue(p) => {
                let (_, names) = pair(p);
                let mut attrs = Attrs::with_capacity(1);
                if let Some(t) = &local.empty {
                    attrs.insert("value", AttrValue::Tensor(t.clone()));
                }
                Node {
                    name: concat(&[&names.send_node, "/value"]),
                    op: "Const",
                    device: local.device.clone(),
                    colocate_with: vec![],
                    attrs,
                    outputs: local.control_type.clone(),
                }
            }
        }
    }
}

/// Builds the non-empty partitions into graphs, in device order. Every node and type comes from
/// the validated input graph, so only structural checks run ([`Graph::from_parts`]); partitions
/// are built in parallel.
pub(super) fn build_graphs(
    parts: Vec<PartBuild>,
    local_of: &[u32],
    all: &[DeviceName],
    maker: &NodeMaker<'_>,
) -> Result<Vec<(usize, Graph)>, PartitionError> {
    use rayon::prelude::*;
    let results: Vec<Option<Result<Graph, PartitionError>>> = parts
        .into_par_iter()
        .enumerate()
        .map(|(d, part)| {
            if part.items.is_empty() {
                return None;
            }
            let mut local = PartShared::new(maker.dev_str, d);
            let nodes = part
                .items
                .iter()
                .map(|&item| maker.node(d, item, &mut local));
            let edges = part.edges.iter().map(|e| {
                let src = match e.from {
                    // A kept node on another device would be a bug; from_parts reports it.
                    EdgeSrc::Orig(u) => local_of.get(u as usize).copied().unwrap_or(u32::MAX),
                    EdgeSrc::Local(i) => i,
                };
                (src, e.to, e.edge())
            });
            Some(
                Graph::from_parts(nodes, edges).map_err(|e| PartitionError::InvalidPartition {
                    device: all[d].to_string(),
                    message: e.to_string(),
                }),
            )
        })
        .collect();
    // The first error in device order, so the message is deterministic.
    let mut out = Vec::new();
    for (d, r) in results.into_iter().enumerate() {
        if let Some(r) = r {
            out.push((d, r?));
        }
    }
    Ok(out)
}

/// The rendezvous attrs of a Send, or of a Recv when it is given the type it receives. Set in
/// name order, so each lands at the end of the list. The strings are shared, not copied.
fn transfer_attrs(
    tensor_name: Arc<str>,
    send_device: Arc<str>,
    recv_device: Arc<str>,
    client_terminated: bool,
    received: Option<&TensorType>,
) -> Attrs {
    let n = 3 + usize::from(client_terminated) + if received.is_some() { 2 } else { 0 };
    let mut attrs = Attrs::with_capacity(n);
    if client_terminated {
        attrs.insert("client_terminated", AttrValue::Bool(true));
    }
    if let Some(ty) = received {
        attrs.insert("dtype", AttrValue::DType(ty.dtype));
    }
    attrs.insert("recv_device", AttrValue::String(recv_device));
    attrs.insert("send_device", AttrValue::String(send_device));
    if let Some(ty) = received {
        attrs.insert("shape", AttrValue::Shape(ty.shape.clone()));
    }
    attrs.insert("tensor_name", AttrValue::String(tensor_name));
    attrs
}

/// A Send node on `device` (the sending device, shared).
fn send_node(
    name: String,
    device: Arc<str>,
    tensor_name: Arc<str>,
    recv_device: Arc<str>,
    client_terminated: bool,
) -> Node {
    let attrs = transfer_attrs(
        tensor_name,
        device.clone(),
        recv_device,
        client_terminated,
        None,
    );
    Node {
        name,
        op: "Send",
        device,
        colocate_with: vec![],
        attrs,
        outputs: Arc::from([]),
    }
}

/// A Recv node on `device` (the receiving device, shared); its one output has the type it
/// receives (what Recv's shape rule would infer), `outputs`.
fn recv_node(
    name: String,
    device: Arc<str>,
    tensor_name: Arc<str>,
    send_device: Arc<str>,
    client_terminated: bool,
    outputs: Arc<[TensorType]>,
) -> Node {
    let attrs = transfer_attrs(
        tensor_name,
        send_device,
        device.clone(),
        client_terminated,
        outputs.first(),
    );
    Node {
        name,
        op: "Recv",
        device,
        colocate_with: vec![],
        attrs,
        outputs,
    }
}
