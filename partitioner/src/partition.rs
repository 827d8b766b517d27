//! Partitioning: a placed graph becomes one subgraph per device, joined by Send/Recv pairs.
//!
//! All naming decisions live in this module (`Namer`): generated nodes are
//! `send/{tensor}/to/{device}` and `recv/{tensor}/from/{device}`, where `{tensor}` is the source
//! tensor with `:` replaced by `_` (`x:0` → `x_0`, a control edge from `x` → `x_ctrl`) and
//! `{device}` is the short device name (`worker_0`, `ps_1_gpu_0`, `client`).
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

use crate::error::PartitionError;
use crate::place::PlacedGraph;
use crate::plan::{build_buffer_plan, BufferPlan};
use dflow_graph::ops::transfer::CLIENT_DEVICE;
use dflow_graph::{AttrValue, DType, DeviceName, Edge, Graph, Node, Shape, Tensor, TensorType};
use petgraph::graph::NodeIndex;
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};

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
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferPair {
    /// The rendezvous key `send_device;recv_device;tensor_name`.
    pub key: String,
    /// The source tensor `node:out`, or `^node` for a control pair.
    pub tensor_name: String,
    /// Full name of the sending device ([`CLIENT_DEVICE`] for a feed).
    pub send_device: String,
    /// Full name of the receiving device ([`CLIENT_DEVICE`] for a fetch).
    pub recv_device: String,
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

/// Generated node names: readable, deterministic, valid, and never equal to a graph node.
struct Namer<'a> {
    graph: &'a Graph,
    short: Vec<String>,
    used: HashSet<String>,
}

impl Namer<'_> {
    fn tensor_part(&self, src: Source, feeds: &[TensorRef]) -> String {
        match src {
            Source::Data(n, o) => {
                format!("{}_{o}", self.graph.node(NodeIndex::new(n as usize)).name)
            }
            Source::Feed(f) => {
                let t = feeds[f as usize];
                format!("{}_{}", self.graph.node(t.node).name, t.out)
            }
            Source::Control(n) => {
                format!("{}_ctrl", self.graph.node(NodeIndex::new(n as usize)).name)
            }
        }
    }

    /// `{prefix}/{tensor}/{dir}/{device}`, falling back to a numbered name when too long or
    /// taken by a graph node.
    fn name(&mut self, prefix: &str, tensor: &str, dir: &str, device: &str, pair: usize) -> String {
        let mut name = format!("{prefix}/{tensor}/{dir}/{device}");
        if name.len() > 200 {
            name = format!("{prefix}/pair_{pair}/{dir}/{device}");
        }
        if self.graph.find(&name).is_none() && !self.used.contains(&name) {
            return name;
        }
        // Rare: a user node already has this name. Suffix until free, and remember the result.
        let mut k = 1;
        loop {
            let candidate = format!("{name}_{k}");
            if self.graph.find(&candidate).is_none() && !self.used.contains(&candidate) {
                self.used.insert(candidate.clone());
                return candidate;
            }
            k += 1;
        }
    }
}

/// Short, name-safe form of a device: `worker_0`, or `worker_0_gpu_1` off CPU:0.
fn short_device(d: &DeviceName) -> String {
    let job = d.job.as_deref().unwrap_or("any");
    let task = d.task.unwrap_or(0);
    let mut s = format!("{job}_{task}");
    let ty = d.device_type.as_deref().unwrap_or("CPU");
    let id = d.device_id.unwrap_or(0);
    if d.replica.is_some_and(|r| r != 0) {
        s = format!("{job}_r{}_{task}", d.replica.unwrap_or(0));
    }
    if !(ty == "CPU" && id == 0) {
        s.push_str(&format!("_{}_{id}", ty.to_ascii_lowercase()));
    }
    s
}

/// A pair under construction.
struct PairBuild {
    src: Source,
    send_dev: u32,
    recv_dev: u32,
    send_node: String,
    recv_node: String,
    /// The Recv's position in its partition (`u32::MAX` for a fetch: the client receives).
    recv_local: u32,
    tensor_name: String,
    dtype: DType,
    shape: Shape,
}

/// Where an edge of a partition under construction starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EdgeSrc {
    /// A node of the placed graph, by index there; resolved once every node has its position.
    Orig(u32),
    /// A node of this partition, by position.
    Local(u32),
}

/// A partition under construction: typed nodes, and edges `(source, destination, edge)`
/// grouped by destination in push order (the order [`Graph::from_def`] would add them).
#[derive(Default)]
struct PartBuild {
    nodes: Vec<Node>,
    edges: Vec<(EdgeSrc, u32, Edge)>,
}

impl PartBuild {
    /// Appends a node and returns its position.
    fn push(&mut self, node: Node) -> u32 {
        self.nodes.push(node);
        (self.nodes.len() - 1) as u32
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
    let mut index: HashMap<&DeviceName, u32> = HashMap::new();
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

    // Build the per-device node lists.
    let mut namer = Namer {
        graph: g,
        short,
        used: HashSet::new(),
    };
    let mut parts: Vec<PartBuild> = (0..all.len()).map(|_| PartBuild::default()).collect();
    let mut local_of: Vec<u32> = vec![u32::MAX; n];
    let mut pairs: Vec<PairBuild> = Vec::new();
    let mut pair_of: HashMap<(Source, u32), u32> = HashMap::new();
    let mut data_in: Vec<(usize, NodeIndex, usize)> = Vec::new();
    let mut ctrl_in: Vec<(usize, NodeIndex)> = Vec::new();
    let mut data_from: Vec<(EdgeSrc, usize)> = Vec::new();
    let mut ctrl_from: Vec<EdgeSrc> = Vec::new();
    let empty = Tensor::zeros(DType::F32, &[0]).ok();

    // The device of a source, and its type.
    let source_dev = |src: Source| -> u32 {
        match src {
            Source::Data(u, _) | Source::Control(u) => dev[u as usize],
            Source::Feed(f) => dev[feeds[f as usize].node.index()],
        }
    };
    let source_type = |src: Source| -> (DType, Shape) {
        match src {
            Source::Data(u, o) => {
                let t = &g.node(NodeIndex::new(u as usize)).outputs[o as usize];
                (t.dtype, t.shape.clone())
            }
            Source::Feed(f) => {
                let t = feeds[f as usize];
                let ty = &g.node(t.node).outputs[t.out];
                (ty.dtype, ty.shape.clone())
            }
            Source::Control(_) => (DType::F32, Shape::known(&[0])),
        }
    };
    let feed_recv_names: Vec<String> = feeds
        .iter()
        .enumerate()
        .map(|(f, _)| {
            let tensor = namer.tensor_part(Source::Feed(f as u32), &feeds);
            namer.name("recv", &tensor, "from", "client", f)
        })
        .collect();
    let tensor_name = |src: Source| -> String {
        match src {
            Source::Data(u, o) => format!("{}:{o}", g.node(NodeIndex::new(u as usize)).name),
            Source::Feed(f) => {
                let t = feeds[f as usize];
                format!("{}:{}", g.node(t.node).name, t.out)
            }
            Source::Control(u) => format!("^{}", g.node(NodeIndex::new(u as usize)).name),
        }
    };

    // Feed pairs first, so feed Recvs lead their partitions.
    let mut feed_recv_local: Vec<u32> = Vec::with_capacity(feeds.len());
    for (f, t) in feeds.iter().enumerate() {
        let d = dev[t.node.index()];
        let ty = &g.node(t.node).outputs[t.out];
        let tn = tensor_name(Source::Feed(f as u32));
        let local = parts[d as usize].push(recv_node(
            feed_recv_names[f].clone(),
            &tn,
            &dev_str[client_id as usize],
            &dev_str[d as usize],
            true,
            ty.dtype,
            &ty.shape,
        ));
        feed_recv_local.push(local);
        pairs.push(PairBuild {
            src: Source::Feed(f as u32),
            send_dev: client_id,
            recv_dev: d,
            send_node: String::new(),
            recv_node: feed_recv_names[f].clone(),
            recv_local: local,
            tensor_name: tn,
            dtype: ty.dtype,
            shape: ty.shape.clone(),
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

    // Creates the pair carrying `src` to device `d` and returns its index.
    #[allow(clippy::too_many_arguments)]
    fn remote(
        src: Source,
        d: u32,
        sd: u32,
        pairs: &mut Vec<PairBuild>,
        pair_of: &mut HashMap<(Source, u32), u32>,
        parts: &mut [PartBuild],
        namer: &mut Namer<'_>,
        feeds: &[TensorRef],
        dev_str: &[String],
        (dtype, shape): (DType, Shape),
        (local, out): (EdgeSrc, usize),
        tensor_name: String,
        empty: &Option<Tensor>,
    ) -> u32 {
        let p = pairs.len();
        let tensor = namer.tensor_part(src, feeds);
        let send = namer.name("send", &tensor, "to", &namer.short[d as usize].clone(), p);
        let recv = namer.name(
            "recv",
            &tensor,
            "from",
            &namer.short[sd as usize].clone(),
            p,
        );
        let (sdev, rdev) = (&dev_str[sd as usize], &dev_str[d as usize]);
        let sender = &mut parts[sd as usize];
        let send_input = if let Source::Control(_) = src {
            // A control pair sends an empty constant that runs after the source.
            let mut attrs = BTreeMap::new();
            if let Some(t) = empty {
                attrs.insert("value".into(), AttrValue::Tensor(t.clone()));
            }
            let c = sender.push(Node {
                name: format!("{send}/value"),
                op: "Const".into(),
                device: sdev.clone(),
                colocate_with: vec![],
                attrs,
                outputs: vec![TensorType::new(DType::F32, Shape::known(&[0]))],
            });
            sender.edges.push((local, c, Edge::Control));
            (EdgeSrc::Local(c), 0)
        } else {
            (local, out)
        };
        let s = sender.push(send_node(send.clone(), &tensor_name, sdev, rdev, false));
        sender.edges.push((
            send_input.0,
            s,
            Edge::Data {
                src_output: send_input.1,
                dst_input: 0,
            },
        ));
        let recv_local = parts[d as usize].push(recv_node(
            recv.clone(),
            &tensor_name,
            sdev,
            rdev,
            false,
            dtype,
            &shape,
        ));
        pair_of.insert((src, d), p as u32);
        pairs.push(PairBuild {
            src,
            send_dev: sd,
            recv_dev: d,
            send_node: send,
            recv_node: recv,
            recv_local,
            tensor_name,
            dtype,
            shape,
        });
        recv_local
    }

    for v in g.node_indices() {
        let vi = v.index();
        if !keep[vi] {
            continue;
        }
        let d = dev[vi];
        let node = g.node(v);
        let op = node.op_def();
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
                        &mut namer,
                        &feeds,
                        &dev_str,
                        source_type($src),
                        local_ref($src),
                        tensor_name($src),
                        &empty,
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
                            tensor: tensor_name(Source::Feed(f)),
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
        let colocate_with = node
            .colocate_with
            .iter()
            .filter(|c| {
                g.find(c)
                    .is_some_and(|k| keep[k.index()] && dev[k.index()] == d)
            })
            .cloned()
            .collect();
        let part = &mut parts[d as usize];
        let local = part.push(Node {
            name: node.name.clone(),
            op: node.op.clone(),
            device: dev_str[d as usize].clone(),
            colocate_with,
            attrs: node.attrs.clone(),
            outputs: node.outputs.clone(),
        });
        local_of[vi] = local;
        for (k, &(from, out)) in data_from.iter().enumerate() {
            part.edges.push((
                from,
                local,
                Edge::Data {
                    src_output: out,
                    dst_input: k,
                },
            ));
        }
        for &from in &ctrl_from {
            part.edges.push((from, local, Edge::Control));
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
        let (dtype, shape) = source_type(src);
        let p = pairs.len();
        let tensor = namer.tensor_part(src, &feeds);
        let send = namer.name("send", &tensor, "to", "client", p);
        let tn = tensor_name(src);
        let part = &mut parts[sd as usize];
        let s = part.push(send_node(
            send.clone(),
            &tn,
            &dev_str[sd as usize],
            &dev_str[client_id as usize],
            true,
        ));
        let (from, out) = local_ref(src);
        part.edges.push((
            from,
            s,
            Edge::Data {
                src_output: out,
                dst_input: 0,
            },
        ));
        pairs.push(PairBuild {
            src,
            send_dev: sd,
            recv_dev: client_id,
            send_node: send,
            recv_node: String::new(),
            recv_local: u32::MAX,
            tensor_name: tn,
            dtype,
            shape,
        });
        fetch_pair.insert(src, p as u32);
        fetch_pairs_in_order.push(p as u32);
    }

    // Keys, client endpoints, the sorted pair list.
    let key_of = |p: &PairBuild| {
        format!(
            "{};{};{}",
            dev_str[p.send_dev as usize], dev_str[p.recv_dev as usize], p.tensor_name
        )
    };
    let feed_eps: Vec<ClientEndpoint> = feed_index
        .iter()
        .map(|&f| {
            let p = &pairs[f as usize];
            ClientEndpoint {
                tensor: p.tensor_name.clone(),
                device: all[p.recv_dev as usize].clone(),
                key: key_of(p),
            }
        })
        .collect();
    let fetch_eps: Vec<ClientEndpoint> = fetch_pairs_in_order
        .iter()
        .map(|&i| {
            let p = &pairs[i as usize];
            ClientEndpoint {
                tensor: p.tensor_name.clone(),
                device: all[p.send_dev as usize].clone(),
                key: key_of(p),
            }
        })
        .collect();
    let mut order: Vec<u32> = (0..pairs.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| {
        let (pa, pb) = (&pairs[a as usize], &pairs[b as usize]);
        (pa.send_dev, pa.recv_dev, &pa.tensor_name).cmp(&(
            pb.send_dev,
            pb.recv_dev,
            &pb.tensor_name,
        ))
    });
    let mut sorted = Vec::with_capacity(pairs.len());
    let mut pairs_opt: Vec<Option<PairBuild>> = pairs.into_iter().map(Some).collect();
    for &i in &order {
        let Some(p) = pairs_opt[i as usize].take() else {
            continue;
        };
        let bytes = p
            .shape
            .num_elements()
            .and_then(|e| e.checked_mul(p.dtype.size_of()));
        sorted.push(TransferPair {
            key: key_of(&p),
            send_device: dev_str[p.send_dev as usize].clone(),
            recv_device: dev_str[p.recv_dev as usize].clone(),
            is_control: matches!(p.src, Source::Control(_)),
            client_terminated: p.send_dev == client_id || p.recv_dev == client_id,
            tensor_name: p.tensor_name,
            send_node: p.send_node,
            recv_node: p.recv_node,
            dtype: p.dtype,
            shape: p.shape,
            bytes,
        });
    }

    // Validate each partition.
    let mut partitions = BTreeMap::new();
    let built = build_graphs(parts, &local_of, &all)?;
    for (d, graph) in built {
        let device = all[d].clone();
        partitions.insert(device.clone(), Partition { device, graph });
    }
    let origins = if sorted.iter().any(|p| p.bytes.is_none()) {
        dynamic_origins(g)
    } else {
        Vec::new()
    };
    let buffer_plan = build_buffer_plan(&sorted, partitions.keys(), |p| {
        let name = p
            .tensor_name
            .rsplit_once(':')
            .map_or(p.tensor_name.as_str(), |(n, _)| n);
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

/// Builds the non-empty partitions into graphs, in device order. Every node and type comes from
/// the validated input graph, so only structural checks run ([`Graph::from_parts`]); partitions
/// are built in parallel.
fn build_graphs(
    parts: Vec<PartBuild>,
    local_of: &[u32],
    all: &[DeviceName],
) -> Result<Vec<(usize, Graph)>, PartitionError> {
    use rayon::prelude::*;
    let results: Vec<Option<Result<Graph, PartitionError>>> = parts
        .into_par_iter()
        .enumerate()
        .map(|(d, part)| {
            if part.nodes.is_empty() {
                return None;
            }
            let edges = part
                .edges
                .into_iter()
                .map(|(from, to, e)| {
                    let src = match from {
                        // A kept node on another device would be a bug; from_parts reports it.
                        EdgeSrc::Orig(u) => local_of.get(u as usize).copied().unwrap_or(u32::MAX),
                        EdgeSrc::Local(i) => i,
                    };
                    (src, to, e)
                })
                .collect();
            Some(Graph::from_parts(part.nodes, edges).map_err(|e| {
                PartitionError::InvalidPartition {
                    device: all[d].to_string(),
                    message: e.to_string(),
                }
            }))
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

/// The rendezvous attrs shared by Send and Recv.
fn transfer_attrs(
    tensor_name: &str,
    send_device: &str,
    recv_device: &str,
    client_terminated: bool,
) -> BTreeMap<String, AttrValue> {
    let mut attrs = BTreeMap::new();
    attrs.insert("tensor_name".into(), AttrValue::String(tensor_name.into()));
    attrs.insert("send_device".into(), AttrValue::String(send_device.into()));
    attrs.insert("recv_device".into(), AttrValue::String(recv_device.into()));
    if client_terminated {
        attrs.insert("client_terminated".into(), AttrValue::Bool(true));
    }
    attrs
}

fn send_node(
    name: String,
    tensor_name: &str,
    send_device: &str,
    recv_device: &str,
    client_terminated: bool,
) -> Node {
    Node {
        name,
        op: "Send".into(),
        device: send_device.into(),
        colocate_with: vec![],
        attrs: transfer_attrs(tensor_name, send_device, recv_device, client_terminated),
        outputs: vec![],
    }
}

/// A Recv node; its one output has the type it receives (what Recv's shape rule would infer).
fn recv_node(
    name: String,
    tensor_name: &str,
    send_device: &str,
    recv_device: &str,
    client_terminated: bool,
    dtype: DType,
    shape: &Shape,
) -> Node {
    let mut attrs = transfer_attrs(tensor_name, send_device, recv_device, client_terminated);
    attrs.insert("dtype".into(), AttrValue::DType(dtype));
    attrs.insert("shape".into(), AttrValue::Shape(shape.clone()));
    Node {
        name,
        op: "Recv".into(),
        device: recv_device.into(),
        colocate_with: vec![],
        attrs,
        outputs: vec![TensorType::new(dtype, shape.clone())],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic;

    /// Building partitions from parts must give exactly what validating them would.
    fn assert_same_as_validated(p: &Partitions) {
        for part in p.partitions.values() {
            let def = part.graph.to_def();
            let validated = Graph::from_def(&def).unwrap();
            assert_eq!(validated.to_def(), def, "{}", part.device);
            let (a, b) = (validated.petgraph(), part.graph.petgraph());
            assert_eq!(a.node_count(), b.node_count());
            assert_eq!(a.edge_count(), b.edge_count());
            for v in validated.node_indices() {
                assert_eq!(a[v], b[v], "{}", part.device);
                assert_eq!(validated.out_edges(v), part.graph.out_edges(v));
                assert_eq!(validated.control_inputs(v), part.graph.control_inputs(v));
                assert_eq!(validated.inputs(v), part.graph.inputs(v));
            }
        }
    }

    #[test]
    fn partitions_equal_their_validated_form() {
        let placed = synthetic::layered(5000);
        let all = partition(&placed, &PartitionOptions::default()).unwrap();
        assert!(all.pairs.iter().any(|p| p.is_control));
        assert_same_as_validated(&all);
        let g = &placed.graph;
        let name = |i: usize| g.node(NodeIndex::new(i)).name.clone();
        let opts = PartitionOptions {
            feeds: vec![format!("{}:0", name(40)), name(1030)],
            fetches: vec![name(4000), format!("{}:0", name(4001)), name(1030)],
            targets: vec![name(3000)],
        };
        let some = partition(&placed, &opts).unwrap();
        assert!(some.pairs.iter().any(|p| p.client_terminated));
        assert_same_as_validated(&some);
    }

    #[test]
    fn from_parts_rejects_bad_structure() {
        let placed = synthetic::layered(2048);
        let g = &placed.graph;
        let node = |i: usize| g.node(NodeIndex::new(i)).clone();
        let data = Edge::Data {
            src_output: 0,
            dst_input: 0,
        };
        let e = Graph::from_parts(vec![node(0), node(0)], vec![]).unwrap_err();
        assert!(e.to_string().contains("duplicate node name"), "{e}");
        let e = Graph::from_parts(vec![node(0)], vec![(0, 5, data)]).unwrap_err();
        assert!(e.to_string().contains("out of range"), "{e}");
        let bad_slot = Edge::Data {
            src_output: 3,
            dst_input: 0,
        };
        let e = Graph::from_parts(vec![node(0), node(1)], vec![(0, 1, bad_slot)]).unwrap_err();
        assert!(e.to_string().contains("output"), "{e}");
        let e = Graph::from_parts(
            vec![node(1024), node(1025), node(1026)],
            vec![(0, 1, data), (1, 2, data), (2, 1, Edge::Control)],
        )
        .unwrap_err();
        assert!(e.to_string().contains("cycle"), "{e}");
        let mut unknown = node(0);
        unknown.op = "NoSuchOp".into();
        assert!(Graph::from_parts(vec![unknown], vec![]).is_err());
    }
}
