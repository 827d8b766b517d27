//! Partitioning: a placed graph becomes one subgraph per device, joined by Send/Recv pairs.
//!
//! All naming decisions live in `naming`: generated nodes are `send/{tensor}/to/{device}` and
//! `recv/{tensor}/from/{device}`, where `{tensor}` is the source tensor with `:` replaced by `_`
//! (`x:0` → `x_0`, a control edge from `x` → `x_ctrl`) and `{device}` is the short device name
//! (`worker_0`, `ps_1_gpu_0`, `client`).
//!
//! How: one walk over the graph in node order decides every pair and each partition's node
//! order, keeping only small handles (`Item`s); then the pairs are named, and each partition's
//! nodes are made straight into its graph (`build`), partitions in parallel.
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
mod naming;
#[cfg(test)]
mod tests;

use crate::error::PartitionError;
use crate::place::PlacedGraph;
use crate::plan::{build_buffer_plan, BufferPlan};
use build::{build_graphs, NodeMaker};
use dflow_graph::ops::transfer::CLIENT_DEVICE;
use dflow_graph::{DType, DeviceName, Edge, Graph, Shape, TensorType};
use naming::{concat, name_pairs, short_device, tensor_name, PairNames};
use petgraph::graph::NodeIndex;
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
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
    pub key: Arc<str>,
    /// The source tensor `node:out`, or `^node` for a control pair.
    pub tensor_name: Arc<str>,
    /// Full name of the sending device ([`CLIENT_DEVICE`] for a feed).
    pub send_device: Arc<str>,
    /// Full name of the receiving device ([`CLIENT_DEVICE`] for a fetch).
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
    pub key: String,
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

fn parse_tensor(g: &Graph, what: &'static str, s: &str) -> Result<TensorRef, PartitionError> {
    let bad = |message: String| PartitionError::BadTensor {
        what,
        tensor: s.to_string(),
        message,
    };
    let (name, out) = match s.rsplit_once(':') {
        Some((n, o)) => (
            n,
            o.parse::<usize>()
                .map_err(|_| bad(format!("output index {o:?} is not a number")))?,
        ),
        None => (s, 0),
    };
    let node = g
        .find(name)
        .ok_or_else(|| bad(format!("no node named `{name}`")))?;
    let outputs = g.node(node).outputs.len();
    if out >= outputs {
        return Err(bad(format!("node `{name}` has {outputs} outputs")));
    }
    Ok(TensorRef { node, out })
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

/// Splits `placed` into one subgraph per device (see the module docs for the rules).
pub fn partition(
    placed: &PlacedGraph,
    opts: &PartitionOptions,
) -> Result<Partitions, PartitionError> {
    let g = &placed.graph;
    let pg = g.petgraph();
    let n = g.num_nodes();
    if placed.devices.len() != n {
        return Err(PartitionError::DeviceCount {
            nodes: n,
            devices: placed.devices.len(),
        });
    }

    // Intern devices; ids follow DeviceName order, the client last-but-sorted among them.
    let client = DeviceName::parse(CLIENT_DEVICE).unwrap_or_default();
    let mut dev_raw = Vec::with_capacity(n);
    let mut index: FastMap<&DeviceName, u32> = FastMap::default();
    let mut uniq: Vec<&DeviceName> = Vec::new();
    let mut first_node: Vec<usize> = Vec::new();
    let mut last: Option<(&DeviceName, u32)> = None;
    for (i, d) in placed.devices.iter().enumerate() {
        let id = match last {
            Some((ld, lid)) if ld == d => lid,
            _ => *index.entry(d).or_insert_with(|| {
                uniq.push(d);
                first_node.push(i);
                (uniq.len() - 1) as u32
            }),
        };
        last = Some((d, id));
        dev_raw.push(id);
    }
    if let Some(k) = uniq.iter().position(|d| !d.is_fully_specified()) {
        return Err(PartitionError::NotFullDevice {
            node: g.node(NodeIndex::new(first_node[k])).name.clone(),
            device: uniq[k].to_string(),
        });
    }
    let mut all: Vec<DeviceName> = uniq.iter().map(|d| (*d).clone()).collect();
    if !all.contains(&client) {
        all.push(client.clone());
    }
    all.sort();
    let remap: Vec<u32> = uniq
        .iter()
        .map(|d| all.binary_search(d).unwrap_or(0) as u32)
        .collect();
    let dev: Vec<u32> = dev_raw.iter().map(|&i| remap[i as usize]).collect();
    drop(dev_raw);
    let client_id = all.binary_search(&client).unwrap_or(0) as u32;
    let dev_str: Vec<String> = all.iter().map(|d| d.to_string()).collect();
    let short: Vec<String> = all
        .iter()
        .map(|d| {
            if *d == client {
                "client".to_string()
            } else {
                short_device(d)
            }
        })
        .collect();

    // Feeds, fetches, targets.
    let mut feeds: Vec<TensorRef> = Vec::new();
    let mut feed_of: HashMap<(u32, u32), u32> = HashMap::new();
    let mut feed_index: Vec<u32> = Vec::with_capacity(opts.feeds.len());
    for s in &opts.feeds {
        let t = parse_tensor(g, "feed", s)?;
        let key = (t.node.index() as u32, t.out as u32);
        let f = *feed_of.entry(key).or_insert_with(|| {
            feeds.push(t);
            (feeds.len() - 1) as u32
        });
        feed_index.push(f);
    }
    let mut has_feed = vec![false; if feeds.is_empty() { 0 } else { n }];
    for t in &feeds {
        has_feed[t.node.index()] = true;
    }
    let fed = |node: usize, out: usize| -> Option<u32> {
        if has_feed.is_empty() || !has_feed[node] {
            return None;
        }
        feed_of.get(&(node as u32, out as u32)).copied()
    };
    let fetches: Vec<TensorRef> = opts
        .fetches
        .iter()
        .map(|s| parse_tensor(g, "fetch", s))
        .collect::<Result<_, _>>()?;
    let targets: Vec<NodeIndex> = opts
        .targets
        .iter()
        .map(|s| {
            g.find(s)
                .ok_or_else(|| PartitionError::UnknownTarget { node: s.clone() })
        })
        .collect::<Result<_, _>>()?;

    // Which nodes to keep.
    let keep = if fetches.is_empty() && targets.is_empty() {
        let mut keep = vec![true; n];
        for t in &feeds {
            let idx = t.node;
            let node = g.node(idx);
            let only_fed = !node.op_def().stateful
                && pg
                    .edges_directed(idx, Direction::Outgoing)
                    .all(|e| match *e.weight() {
                        Edge::Data { src_output, .. } => fed(idx.index(), src_output).is_some(),
                        Edge::Control => false,
                    });
            if only_fed {
                keep[idx.index()] = false;
            }
        }
        keep
    } else {
        let mut keep = vec![false; n];
        let mut stack: Vec<NodeIndex> = Vec::new();
        for t in &fetches {
            if fed(t.node.index(), t.out).is_none() {
                stack.push(t.node);
            }
        }
        stack.extend(targets.iter().copied());
        while let Some(v) = stack.pop() {
            if std::mem::replace(&mut keep[v.index()], true) {
                continue;
            }
            for e in pg.edges_directed(v, Direction::Incoming) {
                let u = e.source();
                let cut = match *e.weight() {
                    Edge::Data { src_output, .. } => fed(u.index(), src_output).is_some(),
                    Edge::Control => false,
                };
                if !cut && !keep[u.index()] {
                    stack.push(u);
                }
            }
        }
        keep
    };

    // Work out the pairs and each partition's node order. Partitions hold small `Item`s here;
    // the nodes themselves are made afterwards, straight into each partition's graph.
    let mut kept_on = vec![0usize; all.len()];
    for (i, &d) in dev.iter().enumerate() {
        if keep[i] {
            kept_on[d as usize] += 1;
        }
    }
    // Room for the kept nodes and their edges, and a quarter more for Send/Recv nodes.
    let edges_per_node = g.num_edges().div_ceil(n.max(1));
    let mut parts: Vec<PartBuild> = kept_on
        .iter()
        .map(|&k| PartBuild {
            items: Vec::with_capacity(k + k / 4),
            edges: Vec::with_capacity((k + k / 4) * edges_per_node),
        })
        .collect();
    let mut local_of: Vec<u32> = vec![u32::MAX; n];
    let mut pairs: Vec<PairBuild> = Vec::new();
    let mut pair_of: FastMap<(Source, u32), u32> = FastMap::default();
    let mut data_in: Vec<(usize, NodeIndex, usize)> = Vec::new();
    let mut ctrl_in: Vec<(usize, NodeIndex)> = Vec::new();
    let mut data_from: Vec<(EdgeSrc, usize)> = Vec::new();
    let mut ctrl_from: Vec<EdgeSrc> = Vec::new();

    // The device of a source.
    let source_dev = |src: Source| -> u32 {
        match src {
            Source::Data(u, _) | Source::Control(u) => dev[u as usize],
            Source::Feed(f) => dev[feeds[f as usize].node.index()],
        }
    };

    // Feed pairs first, so feed Recvs lead their partitions.
    let mut feed_recv_local: Vec<u32> = Vec::with_capacity(feeds.len());
    for (f, t) in feeds.iter().enumerate() {
        let d = dev[t.node.index()];
        let p = pairs.len() as u32;
        let local = parts[d as usize].push(Item::Recv(p));
        feed_recv_local.push(local);
        pairs.push(PairBuild {
            src: Source::Feed(f as u32),
            kind: PairKind::Feed,
            send_dev: client_id,
            recv_dev: d,
            recv_local: local,
        });
    }
    // Where `src` comes from on its own device: (node, output).
    let local_ref = |src: Source| -> (EdgeSrc, usize) {
        match src {
            Source::Data(u, o) => (EdgeSrc::Orig(u), o as usize),
            Source::Feed(f) => (EdgeSrc::Local(feed_recv_local[f as usize]), 0),
            Source::Control(u) => (EdgeSrc::Orig(u), 0),
        }
    };

    // Creates the pair carrying `src` from device `sd` to device `d` and returns the position of
    // its Recv on `d`.
    fn remote(
        src: Source,
        d: u32,
        sd: u32,
        pairs: &mut Vec<PairBuild>,
        pair_of: &mut FastMap<(Source, u32), u32>,
        parts: &mut [PartBuild],
        (local, out): (EdgeSrc, usize),
    ) -> u32 {
        let p = pairs.len();
        let sender = &mut parts[sd as usize];
        let send_input = if let Source::Control(_) = src {
            // A control pair sends an empty constant that runs after the source.
            let c = sender.push(Item::ControlValue(p as u32));
            sender.edges.push(PartEdge::control(local, c));
            (EdgeSrc::Local(c), 0)
        } else {
            (local, out)
        };
        let s = sender.push(Item::Send(p as u32));
        sender
            .edges
            .push(PartEdge::data(send_input.0, s, send_input.1, 0));
        let recv_local = parts[d as usize].push(Item::Recv(p as u32));
        pair_of.insert((src, d), p as u32);
        pairs.push(PairBuild {
            src,
            kind: PairKind::Remote,
            send_dev: sd,
            recv_dev: d,
            recv_local,
        });
        recv_local
    }

    // The op of the previous node, to skip the registry lookup along runs of one op.
    let mut op_cache: Option<&'static dflow_graph::OpDef> = None;
    for v in g.node_indices() {
        let vi = v.index();
        if !keep[vi] {
            continue;
        }
        let d = dev[vi];
        let node = g.node(v);
        let op = match op_cache {
            Some(op) if op.name == node.op => op,
            _ => *op_cache.insert(node.op_def()),
        };
        data_in.clear();
        ctrl_in.clear();
        data_from.clear();
        ctrl_from.clear();
        for e in pg.edges_directed(v, Direction::Incoming) {
            match *e.weight() {
                Edge::Data {
                    src_output,
                    dst_input,
                } => data_in.push((dst_input, e.source(), src_output)),
                Edge::Control => ctrl_in.push((e.id().index(), e.source())),
            }
        }
        data_in.sort_unstable();
        ctrl_in.sort_unstable();
        // The local Recv of `src` on this device: the existing pair's, or a new pair's (one pair
        // per (source, destination device), shared by every consumer here).
        macro_rules! recv_of {
            ($src:expr, $sd:expr) => {
                match pair_of.get(&($src, d)) {
                    Some(&p) => pairs[p as usize].recv_local,
                    None => remote(
                        $src,
                        d,
                        $sd,
                        &mut pairs,
                        &mut pair_of,
                        &mut parts,
                        local_ref($src),
                    ),
                }
            };
        }
        for &(slot, u, out) in &data_in {
            let is_ref = op.inputs.get(slot).is_some_and(|a| a.is_ref);
            let src = match fed(u.index(), out) {
                Some(f) => {
                    if is_ref {
                        return Err(PartitionError::FeedIntoRef {
                            tensor: tensor_name(g, &feeds, Source::Feed(f)),
                            consumer: node.name.clone(),
                        });
                    }
                    Source::Feed(f)
                }
                None => Source::Data(u.index() as u32, out as u32),
            };
            let sd = source_dev(src);
            if sd == d {
                data_from.push(local_ref(src));
                continue;
            }
            if is_ref {
                return Err(PartitionError::RefEdgeCrossesDevices {
                    producer: g.node(u).name.clone(),
                    consumer: node.name.clone(),
                    producer_device: dev_str[sd as usize].clone(),
                    consumer_device: dev_str[d as usize].clone(),
                });
            }
            let recv = recv_of!(src, sd);
            data_from.push((EdgeSrc::Local(recv), 0));
        }
        for &(_, u) in &ctrl_in {
            let src = Source::Control(u.index() as u32);
            let sd = dev[u.index()];
            let from = if sd == d {
                EdgeSrc::Orig(u.index() as u32)
            } else {
                EdgeSrc::Local(recv_of!(src, sd))
            };
            // Several control edges can collapse onto one Recv; keep the first of each.
            if !ctrl_from.contains(&from) {
                ctrl_from.push(from);
            }
        }
        let part = &mut parts[d as usize];
        let local = part.push(Item::Orig(vi as u32));
        local_of[vi] = local;
        for (k, &(from, out)) in data_from.iter().enumerate() {
            part.edges.push(PartEdge::data(from, local, out, k));
        }
        for &from in &ctrl_from {
            part.edges.push(PartEdge::control(from, local));
        }
    }

    // Fetches: one client-terminated Send per distinct fetched tensor.
    let mut fetch_pair: HashMap<Source, u32> = HashMap::new();
    let mut fetch_pairs_in_order = Vec::with_capacity(fetches.len());
    for t in &fetches {
        let src = match fed(t.node.index(), t.out) {
            Some(f) => Source::Feed(f),
            None => Source::Data(t.node.index() as u32, t.out as u32),
        };
        if let Some(&p) = fetch_pair.get(&src) {
            fetch_pairs_in_order.push(p);
            continue;
        }
        let sd = source_dev(src);
        let p = pairs.len();
        let part = &mut parts[sd as usize];
        let s = part.push(Item::Send(p as u32));
        let (from, out) = local_ref(src);
        part.edges.push(PartEdge::data(from, s, out, 0));
        pairs.push(PairBuild {
            src,
            kind: PairKind::Fetch,
            send_dev: sd,
            recv_dev: client_id,
            recv_local: u32::MAX,
        });
        fetch_pair.insert(src, p as u32);
        fetch_pairs_in_order.push(p as u32);
    }

    // Names, keys and client endpoints.
    let names = name_pairs(g, &feeds, &pairs, &short);
    let key_of = |p: &PairBuild, tensor_name: &str| {
        concat(&[
            &dev_str[p.send_dev as usize],
            ";",
            &dev_str[p.recv_dev as usize],
            ";",
            tensor_name,
        ])
    };
    let endpoint = |i: u32, device: fn(&PairBuild) -> u32| {
        let (p, tensor) = (&pairs[i as usize], &names[i as usize].tensor_name);
        ClientEndpoint {
            tensor: tensor.to_string(),
            device: all[device(p) as usize].clone(),
            key: key_of(p, tensor),
        }
    };
    let feed_eps: Vec<ClientEndpoint> = feed_index
        .iter()
        .map(|&f| endpoint(f, |p| p.recv_dev))
        .collect();
    let fetch_eps: Vec<ClientEndpoint> = fetch_pairs_in_order
        .iter()
        .map(|&p| endpoint(p, |p| p.send_dev))
        .collect();

    // Make every partition's nodes and validate its structure, in parallel.
    let ctx = NodeMaker {
        g,
        keep: &keep,
        dev: &dev,
        dev_str: &dev_str,
        feeds: &feeds,
        pairs: &pairs,
        names: &names,
    };
    let built = build_graphs(parts, &local_of, &all, &ctx)?;
    let mut partitions = BTreeMap::new();
    for (d, graph) in built {
        let device = all[d].clone();
        partitions.insert(device.clone(), Partition { device, graph });
    }

    // The pair list, sorted by (send device, receive device, tensor name). Device names are
    // shared; each key is made in the thread's scratch string, then copied once.
    let dev_arc: Vec<Arc<str>> = dev_str.iter().map(|s| Arc::from(s.as_str())).collect();
    let sorted = sorted_pairs(pairs, names, |p, names, scratch| {
        let ty = source_type(g, &feeds, p.src);
        scratch.clear();
        let (send, recv) = (&dev_str[p.send_dev as usize], &dev_str[p.recv_dev as usize]);
        for part in [send.as_str(), ";", recv, ";", &names.tensor_name] {
            scratch.push_str(part);
        }
        TransferPair {
            key: Arc::from(scratch.as_str()),
            send_device: dev_arc[p.send_dev as usize].clone(),
            recv_device: dev_arc[p.recv_dev as usize].clone(),
            is_control: matches!(p.src, Source::Control(_)),
            client_terminated: p.send_dev == client_id || p.recv_dev == client_id,
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
    });

    let origins = if sorted.iter().any(|p| p.bytes.is_none()) {
        dynamic_origins(g)
    } else {
        Vec::new()
    };
    let buffer_plan = build_buffer_plan(&sorted, partitions.keys(), |p| {
        let name = p
            .tensor_name
            .rsplit_once(':')
            .map_or(&*p.tensor_name, |(n, _)| n);
        let v = g.find(name)?;
        let o = origins.get(v.index()).copied().flatten()?;
        Some(g.node(NodeIndex::new(o as usize)).name.clone())
    });
    Ok(Partitions {
        partitions,
        pairs: sorted,
        feeds: feed_eps,
        fetches: fetch_eps,
        buffer_plan,
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
