//! Partitioning: a placed graph becomes one subgraph per device, joined by Send/Recv pairs.
//!
//! All naming decisions live in `naming`: generated nodes are `send/{tensor}/to/{device}` and
//! `recv/{tensor}/from/{device}`, where `{tensor}` is the source tensor with `:` replaced by `_`
//! (`x:0` → `x_0`, a control edge from `x` → `x_ctrl`) and `{device}` is the short device name
//! (`worker_0`, `ps_1_gpu_0`, `client`).
//!
//! How, in phases (one module each): `devices` interns every node's device; `request` resolves
//! feeds, fetches and targets and decides which nodes to keep; `pairs` walks the kept nodes once
//! in node order and decides every pair and each partition's node order, keeping only small
//! handles (`Item`s); `naming` names the pairs; `build` makes each partition's nodes straight
//! into its graph, partitions in parallel; last the pairs are sorted and the buffer plan
//! (`crate::plan`) sized.
//!
//! Choices worth knowing:
//! - One pair per (source tensor, destination device), shared by all consumers there. Reference
//!   edges never cross devices: placement colocates a ref consumer with its variable, and a
//!   crossing ref edge is [`PartitionError::RefEdgeCrossesDevices`] (TensorFlow instead lets
//!   ref edges bypass dedup; dflow has no use for remote references).
//! - A cross-device control edge becomes a zero-byte pair: on the source device an empty `Const`
//!   (f32, shape `[0]`) runs after the source and is sent; on the destination, the consumer gets
//!   a control edge from the `Recv`. One pair per (source node, destination device).
//! - A feed `x:0` becomes a client-terminated `Recv` on `x`'s device that stands in for `x:0`
//!   everywhere; a fetch becomes a client-terminated `Send` on the device of the fetched tensor.
//! - With fetches or targets, only what they need is kept (walking data and control inputs
//!   back, stopping at fed tensors). With neither, every node is kept except fed nodes that have
//!   no other use (a fed `Placeholder` disappears).
//! - Pairs are sorted by (send device, recv device, tensor name), devices in [`DeviceName`]
//!   order (task 2 before task 10), which is the key's order up to numeric task ids.

mod build;
mod devices;
mod naming;
mod pairs;
mod request;
#[cfg(test)]
mod tests;

use crate::error::PartitionError;
use crate::place::PlacedGraph;
use crate::plan::{build_buffer_plan, BufferPlan};
use build::{build_graphs, NodeMaker};
use devices::{intern_devices, Devices};
use dflow_graph::{DType, DeviceName, Edge, Graph, RendezvousKey, Shape, TensorType};
use naming::{name_pairs, PairNames};
use pairs::{walk_pairs, Walk};
use petgraph::graph::NodeIndex;
use request::{kept_nodes, resolve_request, Request};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// A hash map with a fast hasher, for keys the partitioner makes itself (never user text).
type FastMap<K, V> = hashbrown::HashMap<K, V, hashbrown::DefaultHashBuilder>;

/// What to compute: feeds, fetches and targets. All empty means the whole graph.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartitionOptions {
    /// Tensors the client supplies: `"x"` or `"x:0"`.
    pub feeds: Vec<String>,
    /// Tensors the client reads back: `"y"` or `"y:1"`.
    pub fetches: Vec<String>,
    /// Nodes to run for their effect (node names).
    pub targets: Vec<String>,
}

/// The result of partitioning.
#[derive(Clone, Debug)]
pub struct Partitions {
    /// One subgraph per device, sorted by task then by device.
    pub partitions: BTreeMap<DeviceName, Partition>,
    /// Every Send/Recv pair, client-terminated ones included, sorted by key.
    pub pairs: Vec<TransferPair>,
    /// The client's feeds, in the order requested.
    pub feeds: Vec<ClientEndpoint>,
    /// The client's fetches, in the order requested.
    pub fetches: Vec<ClientEndpoint>,
    /// Buffers every pair needs, known before the first step.
    pub buffer_plan: BufferPlan,
}

/// The subgraph of one device.
#[derive(Clone, Debug)]
pub struct Partition {
    /// The device (full name).
    pub device: DeviceName,
    /// The validated subgraph, with its Send/Recv nodes.
    pub graph: Graph,
}

/// One Send/Recv pair: a tensor crossing from one device to another.
///
/// The strings are shared (and serialized as plain strings): the key with the buffer plan's
/// slot, the tensor name with the pair's Send and Recv nodes, each device name with every pair
/// that names the device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferPair {
    /// The rendezvous key `send_device;recv_device;tensor_name`.
    pub key: RendezvousKey,
    /// The source tensor `node:out`, or `^node` for a control pair.
    pub tensor_name: Arc<str>,
    /// Full name of the sending device ([`CLIENT_DEVICE`](dflow_graph::ops::transfer::CLIENT_DEVICE) for a feed).
    pub send_device: Arc<str>,
    /// Full name of the receiving device ([`CLIENT_DEVICE`](dflow_graph::ops::transfer::CLIENT_DEVICE) for a fetch).
    pub recv_device: Arc<str>,
    /// The Send node (empty for a feed: the client sends).
    pub send_node: String,
    /// The Recv node (empty for a fetch: the client receives).
    pub recv_node: String,
    /// Element type.
    pub dtype: DType,
    /// Shape, possibly partial.
    pub shape: Shape,
    /// Bytes per step, when the shape is static.
    pub bytes: Option<usize>,
    /// A zero-byte pair carrying a control edge.
    pub is_control: bool,
    /// One end is the client (a feed or a fetch).
    pub client_terminated: bool,
}

/// Where a feed enters or a fetch leaves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientEndpoint {
    /// The tensor, canonical `node:out`.
    pub tensor: String,
    /// The device the tensor lives on.
    pub device: DeviceName,
    /// The rendezvous key of its client-terminated pair.
    pub key: RendezvousKey,
}

/// A pair's source: a node output, a feed, or a node's completion (control).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Source {
    Data(u32, u32),
    Feed(u32),
    Control(u32),
}

/// A tensor referred to by a feed or fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct TensorRef {
    node: NodeIndex,
    out: usize,
}

/// What a pair connects: two devices, or the client and a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PairKind {
    /// A tensor or control edge crossing between two devices.
    Remote,
    /// A feed: the client sends, a Recv receives.
    Feed,
    /// A fetch: a Send sends, the client receives.
    Fetch,
}

/// A pair under construction. Its type comes from its source (`source_type`), its names from
/// `name_pairs`.
#[derive(Clone, Copy)]
struct PairBuild {
    src: Source,
    kind: PairKind,
    send_dev: u32,
    recv_dev: u32,
    /// The Recv's position in its partition (`u32::MAX` for a fetch: the client receives).
    recv_local: u32,
}

/// Where an edge of a partition under construction starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EdgeSrc {
    /// A node of the placed graph, by index there; resolved once every node has its position.
    Orig(u32),
    /// A node of this partition, by position.
    Local(u32),
}

/// A node of a partition under construction. Only this small handle is kept while the pairs are
/// worked out; the full [`Node`] is made once, straight into the partition's graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Item {
    /// A node of the placed graph, by index there.
    Orig(u32),
    /// The Send of a pair, by index in the pair list.
    Send(u32),
    /// The Recv of a pair.
    Recv(u32),
    /// The empty constant that a control pair sends.
    ControlValue(u32),
}

/// `src_output` of a [`PartEdge`] that is a control edge.
const CONTROL: u32 = u32::MAX;

/// An edge of a partition under construction, into the node at position `to`.
#[derive(Clone, Copy, Debug)]
struct PartEdge {
    from: EdgeSrc,
    to: u32,
    /// The producer's output slot, or [`CONTROL`].
    src_output: u32,
    dst_input: u32,
}

impl PartEdge {
    fn data(from: EdgeSrc, to: u32, src_output: usize, dst_input: usize) -> PartEdge {
        PartEdge {
            from,
            to,
            src_output: src_output as u32,
            dst_input: dst_input as u32,
        }
    }

    fn control(from: EdgeSrc, to: u32) -> PartEdge {
        PartEdge {
            from,
            to,
            src_output: CONTROL,
            dst_input: 0,
        }
    }

    fn edge(&self) -> Edge {
        if self.src_output == CONTROL {
            Edge::Control
        } else {
            Edge::Data {
                src_output: self.src_output as usize,
                dst_input: self.dst_input as usize,
            }
        }
    }
}

/// A partition under construction: its nodes in order, and edges grouped by destination in push
/// order (the order [`Graph::from_def`] would add them).
#[derive(Default)]
struct PartBuild {
    items: Vec<Item>,
    edges: Vec<PartEdge>,
}

impl PartBuild {
    /// Appends a node and returns its position.
    fn push(&mut self, item: Item) -> u32 {
        self.items.push(item);
        (self.items.len() - 1) as u32
    }
}

/// Splits `placed` into one subgraph per device (see the module docs for the rules), phase by
/// phase: devices → request (feeds, fetches, targets, kept nodes) → pairs → names → build →
/// the sorted pair list and the buffer plan.
pub fn partition(
    placed: &PlacedGraph,
    opts: &PartitionOptions,
) -> Result<Partitions, PartitionError> {
    let g = &placed.graph;
    let devices = intern_devices(g, &placed.devices)?;
    let req = resolve_request(g, opts)?;
    let keep = kept_nodes(g, &req);
    let Walk {
        parts,
        local_of,
        pairs,
        fetch_pairs,
    } = walk_pairs(g, &devices, &req, &keep)?;
    let names = name_pairs(g, &req.feeds, &pairs, &devices.short);
    let (feeds, fetches) = client_endpoints(&devices, &req, &pairs, &fetch_pairs, &names);
    let partitions = build_partitions(g, &devices, &req, &keep, parts, &local_of, &pairs, &names)?;
    let pairs = transfer_pairs(g, &devices, &req.feeds, pairs, names);
    let buffer_plan = plan_buffers(g, &pairs, &partitions);
    Ok(Partitions {
        partitions,
        pairs,
        feeds,
        fetches,
        buffer_plan,
    })
}

/// The client's feed and fetch endpoints, in the order requested.
fn client_endpoints(
    devices: &Devices,
    req: &Request,
    pairs: &[PairBuild],
    fetch_pairs: &[u32],
    names: &[PairNames],
) -> (Vec<ClientEndpoint>, Vec<ClientEndpoint>) {
    let endpoint = |i: u32, device: fn(&PairBuild) -> u32| {
        let (p, tensor) = (&pairs[i as usize], &names[i as usize].tensor_name);
        ClientEndpoint {
            tensor: tensor.to_string(),
            device: devices.all[device(p) as usize].clone(),
            key: RendezvousKey::new(
                &devices.names[p.send_dev as usize],
                &devices.names[p.recv_dev as usize],
                tensor,
            ),
        }
    };
    let feeds = req
        .feed_index
        .iter()
        .map(|&f| endpoint(f, |p| p.recv_dev))
        .collect();
    let fetches = fetch_pairs
        .iter()
        .map(|&p| endpoint(p, |p| p.send_dev))
        .collect();
    (feeds, fetches)
}

/// Makes every partition's nodes and validates its structure, in parallel.
#[allow(clippy::too_many_arguments)]
fn build_partitions(
    g: &Graph,
    devices: &Devices,
    req: &Request,
    keep: &[bool],
    parts: Vec<PartBuild>,
    local_of: &[u32],
    pairs: &[PairBuild],
    names: &[PairNames],
) -> Result<BTreeMap<DeviceName, Partition>, PartitionError> {
    let ctx = NodeMaker {
        g,
        keep,
        dev: &devices.of_node,
        dev_str: &devices.names,
        feeds: &req.feeds,
        pairs,
        names,
    };
    let built = build_graphs(parts, local_of, &devices.all, &ctx)?;
    Ok(built
        .into_iter()
        .map(|(d, graph)| {
            let device = devices.all[d].clone();
            (device.clone(), Partition { device, graph })
        })
        .collect())
}

/// The pair list, sorted by (send device, receive device, tensor name). Device names are
/// shared; each key is made in the thread's scratch string, then copied once.
fn transfer_pairs(
    g: &Graph,
    devices: &Devices,
    feeds: &[TensorRef],
    pairs: Vec<PairBuild>,
    names: Vec<PairNames>,
) -> Vec<TransferPair> {
    let dev_str = &devices.names;
    let dev_arc: Vec<Arc<str>> = dev_str.iter().map(|s| Arc::from(s.as_str())).collect();
    sorted_pairs(pairs, names, |p, names, scratch| {
        let ty = source_type(g, feeds, p.src);
        scratch.clear();
        let (send, recv) = (&dev_str[p.send_dev as usize], &dev_str[p.recv_dev as usize]);
        for part in [send.as_str(), ";", recv, ";", &names.tensor_name] {
            scratch.push_str(part);
        }
        TransferPair {
            key: RendezvousKey::from_parts(scratch, send.len(), recv.len()),
            send_device: dev_arc[p.send_dev as usize].clone(),
            recv_device: dev_arc[p.recv_dev as usize].clone(),
            is_control: matches!(p.src, Source::Control(_)),
            client_terminated: p.send_dev == devices.client || p.recv_dev == devices.client,
            bytes: ty
                .shape
                .num_elements()
                .and_then(|e| e.checked_mul(ty.dtype.size_of())),
            tensor_name: names.tensor_name,
            send_node: names.send_node,
            recv_node: names.recv_node,
            dtype: ty.dtype,
            shape: ty.shape,
        }
    })
}

/// The buffer plan of `pairs`; a dynamic pair's reason names the placeholder its shape comes
/// from.
fn plan_buffers(
    g: &Graph,
    pairs: &[TransferPair],
    partitions: &BTreeMap<DeviceName, Partition>,
) -> BufferPlan {
    let origins = if pairs.iter().any(|p| p.bytes.is_none()) {
        dynamic_origins(g)
    } else {
        Vec::new()
    };
    build_buffer_plan(pairs, partitions.keys(), |p| {
        let name = p
            .tensor_name
            .rsplit_once(':')
            .map_or(&*p.tensor_name, |(n, _)| n);
        let v = g.find(name)?;
        let o = origins.get(v.index()).copied().flatten()?;
        Some(g.node(NodeIndex::new(o as usize)).name.clone())
    })
}

/// Turns every pair into its [`TransferPair`] (in parallel) and sorts them by (send device,
/// receive device, tensor name); device ids follow [`DeviceName`] order. `make` is given a
/// scratch string of its thread.
fn sorted_pairs(
    pairs: Vec<PairBuild>,
    mut names: Vec<PairNames>,
    make: impl Fn(PairBuild, PairNames, &mut String) -> TransferPair + Sync,
) -> Vec<TransferPair> {
    use rayon::prelude::*;
    let mut order: Vec<(u32, u32, u32)> = pairs
        .iter()
        .enumerate()
        .map(|(i, p)| (p.send_dev, p.recv_dev, i as u32))
        .collect();
    // The tensor name decides within a device pair; the pair index breaks (impossible) ties, so
    // the order never depends on the sort algorithm.
    order.par_sort_unstable_by(|a, b| {
        (a.0, a.1)
            .cmp(&(b.0, b.1))
            .then_with(|| {
                names[a.2 as usize]
                    .tensor_name
                    .cmp(&names[b.2 as usize].tensor_name)
            })
            .then(a.2.cmp(&b.2))
    });
    // Put the (small) pairs and their names in order, then make the pairs in place.
    let in_order: Vec<(PairBuild, PairNames)> = order
        .iter()
        .map(|&(_, _, i)| (pairs[i as usize], std::mem::take(&mut names[i as usize])))
        .collect();
    in_order
        .into_par_iter()
        .map_init(String::new, |scratch, (p, n)| make(p, n, scratch))
        .collect()
}

/// The type a pair carries: its source tensor's, or an empty f32 for a control pair.
fn source_type(g: &Graph, feeds: &[TensorRef], src: Source) -> TensorType {
    match src {
        Source::Data(u, o) => g.node(NodeIndex::new(u as usize)).outputs[o as usize].clone(),
        Source::Feed(f) => {
            let t = feeds[f as usize];
            g.node(t.node).outputs[t.out].clone()
        }
        Source::Control(_) => TensorType::new(DType::F32, Shape::known(&[0])),
    }
}

/// For each node, the first partially-shaped placeholder among its data ancestors (following
/// first inputs first): where a non-static shape comes from. One pass in topological order.
fn dynamic_origins(g: &Graph) -> Vec<Option<u32>> {
    let mut origin = vec![None; g.num_nodes()];
    for v in g.topo_order() {
        let node = g.node(v);
        origin[v.index()] = if node.op == "Placeholder"
            && node.outputs.first().is_some_and(|t| !t.shape.is_static())
        {
            Some(v.index() as u32)
        } else {
            g.inputs(v).iter().find_map(|(u, _)| origin[u.index()])
        };
    }
    origin
}
