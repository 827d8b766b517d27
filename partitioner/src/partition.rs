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
use dflow_graph::{AttrValue, DType, DeviceName, Edge, Graph, GraphDef, NodeDef, Shape, Tensor};
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
    tensor_name: String,
    dtype: DType,
    shape: Shape,
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
    let mut defs: Vec<Vec<NodeDef>> = (0..all.len()).map(|_| Vec::new()).collect();
    let mut pairs: Vec<PairBuild> = Vec::new();
    let mut pair_of: HashMap<(Source, u32), u32> = HashMap::new();
    let mut data_in: Vec<(usize, NodeIndex, usize)> = Vec::new();
    let mut ctrl_in: Vec<(usize, NodeIndex)> = Vec::new();
    let empty = Tensor::zeros(DType::F32, &[0]).ok();

    // The device and local input string of a source, and its type.
    let source_info = |src: Source| -> (u32, DType, Shape) {
        match src {
            Source::Data(u, o) => {
                let t = &g.node(NodeIndex::new(u as usize)).outputs[o as usize];
                (dev[u as usize], t.dtype, t.shape.clone())
            }
            Source::Feed(f) => {
                let t = feeds[f as usize];
                let ty = &g.node(t.node).outputs[t.out];
                (dev[t.node.index()], ty.dtype, ty.shape.clone())
            }
            Source::Control(u) => (dev[u as usize], DType::F32, Shape::known(&[0])),
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
    let local_name = |src: Source| -> String {
        match src {
            Source::Data(u, 0) => g.node(NodeIndex::new(u as usize)).name.clone(),
            Source::Data(u, o) => format!("{}:{o}", g.node(NodeIndex::new(u as usize)).name),
            Source::Feed(f) => feed_recv_names[f as usize].clone(),
            Source::Control(u) => format!("^{}", g.node(NodeIndex::new(u as usize)).name),
        }
    };
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
    for (f, t) in feeds.iter().enumerate() {
        let d = dev[t.node.index()];
        let ty = &g.node(t.node).outputs[t.out];
        let tn = tensor_name(Source::Feed(f as u32));
        defs[d as usize].push(recv_def(
            &feed_recv_names[f],
            &tn,
            &dev_str[client_id as usize],
            &dev_str[d as usize],
            true,
            ty.dtype,
            &ty.shape,
        ));
        pairs.push(PairBuild {
            src: Source::Feed(f as u32),
            send_dev: client_id,
            recv_dev: d,
            send_node: String::new(),
            recv_node: feed_recv_names[f].clone(),
            tensor_name: tn,
            dtype: ty.dtype,
            shape: ty.shape.clone(),
        });
    }

    // Returns the name of the local stand-in for `src` on device `d`, creating the pair if new.
    #[allow(clippy::too_many_arguments)]
    fn remote(
        src: Source,
        d: u32,
        pairs: &mut Vec<PairBuild>,
        pair_of: &mut HashMap<(Source, u32), u32>,
        defs: &mut [Vec<NodeDef>],
        namer: &mut Namer<'_>,
        feeds: &[TensorRef],
        dev_str: &[String],
        info: (u32, DType, Shape),
        local: String,
        tensor_name: String,
        empty: &Option<Tensor>,
    ) -> String {
        if let Some(&p) = pair_of.get(&(src, d)) {
            return pairs[p as usize].recv_node.clone();
        }
        let (sd, dtype, shape) = info;
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
        let send_input = if let Source::Control(_) = src {
            // A control pair sends an empty constant that runs after the source.
            let value = format!("{send}/value");
            let mut c = NodeDef {
                name: value.clone(),
                op: "Const".into(),
                inputs: vec![local],
                device: sdev.clone(),
                ..NodeDef::default()
            };
            if let Some(t) = empty {
                c.attrs.insert("value".into(), AttrValue::Tensor(t.clone()));
            }
            defs[sd as usize].push(c);
            value
        } else {
            local
        };
        defs[sd as usize].push(send_def(&send, send_input, &tensor_name, sdev, rdev, false));
        defs[d as usize].push(recv_def(
            &recv,
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
            recv_node: recv.clone(),
            tensor_name,
            dtype,
            shape,
        });
        recv
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
        let mut inputs = Vec::with_capacity(data_in.len() + ctrl_in.len());
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
            let info = source_info(src);
            if info.0 == d {
                inputs.push(local_name(src));
                continue;
            }
            if is_ref {
                return Err(PartitionError::RefEdgeCrossesDevices {
                    producer: g.node(u).name.clone(),
                    consumer: node.name.clone(),
                    producer_device: dev_str[info.0 as usize].clone(),
                    consumer_device: dev_str[d as usize].clone(),
                });
            }
            let local = local_name(src);
            let tn = tensor_name(src);
            inputs.push(remote(
                src,
                d,
                &mut pairs,
                &mut pair_of,
                &mut defs,
                &mut namer,
                &feeds,
                &dev_str,
                info,
                local,
                tn,
                &empty,
            ));
        }
        for &(_, u) in &ctrl_in {
            let src = Source::Control(u.index() as u32);
            if dev[u.index()] == d {
                inputs.push(local_name(src));
                continue;
            }
            let info = source_info(src);
            let local = local_name(src);
            let tn = tensor_name(src);
            let recv = remote(
                src,
                d,
                &mut pairs,
                &mut pair_of,
                &mut defs,
                &mut namer,
                &feeds,
                &dev_str,
                info,
                local,
                tn,
                &empty,
            );
            inputs.push(format!("^{recv}"));
        }
        // Control inputs must come last and may repeat after dedup; keep the first of each.
        dedup_controls(&mut inputs);
        let colocate_with = node
            .colocate_with
            .iter()
            .filter(|c| {
                g.find(c)
                    .is_some_and(|k| keep[k.index()] && dev[k.index()] == d)
            })
            .cloned()
            .collect();
        defs[d as usize].push(NodeDef {
            name: node.name.clone(),
            op: node.op.clone(),
            inputs,
            device: dev_str[d as usize].clone(),
            colocate_with,
            attrs: node.attrs.clone(),
        });
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
        let (sd, dtype, shape) = source_info(src);
        let p = pairs.len();
        let tensor = namer.tensor_part(src, &feeds);
        let send = namer.name("send", &tensor, "to", "client", p);
        let tn = tensor_name(src);
        defs[sd as usize].push(send_def(
            &send,
            local_name(src),
            &tn,
            &dev_str[sd as usize],
            &dev_str[client_id as usize],
            true,
        ));
        pairs.push(PairBuild {
            src,
            send_dev: sd,
            recv_dev: client_id,
            send_node: send,
            recv_node: String::new(),
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
    let built = build_graphs(defs, &all)?;
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

/// Validates the non-empty per-device node lists into graphs, in device order. Validation is
/// most of partitioning's cost, so partitions are validated in parallel.
fn build_graphs(
    defs: Vec<Vec<NodeDef>>,
    all: &[DeviceName],
) -> Result<Vec<(usize, Graph)>, PartitionError> {
    use rayon::prelude::*;
    let results: Vec<Option<Result<Graph, PartitionError>>> = defs
        .into_par_iter()
        .enumerate()
        .map(|(d, nodes)| {
            if nodes.is_empty() {
                return None;
            }
            let def = GraphDef {
                version: dflow_graph::def::FORMAT_VERSION,
                nodes,
                train: None,
            };
            Some(
                Graph::from_def(&def).map_err(|e| PartitionError::InvalidPartition {
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

fn dedup_controls(inputs: &mut Vec<String>) {
    let first_ctrl = inputs.iter().position(|s| s.starts_with('^'));
    if let Some(start) = first_ctrl {
        if inputs.len() - start > 1 {
            let mut seen = HashSet::new();
            let ctrls: Vec<String> = inputs
                .drain(start..)
                .filter(|c| seen.insert(c.clone()))
                .collect();
            inputs.extend(ctrls);
        }
    }
}

fn send_def(
    name: &str,
    input: String,
    tensor_name: &str,
    send_device: &str,
    recv_device: &str,
    client_terminated: bool,
) -> NodeDef {
    let mut attrs = BTreeMap::new();
    attrs.insert("tensor_name".into(), AttrValue::String(tensor_name.into()));
    attrs.insert("send_device".into(), AttrValue::String(send_device.into()));
    attrs.insert("recv_device".into(), AttrValue::String(recv_device.into()));
    if client_terminated {
        attrs.insert("client_terminated".into(), AttrValue::Bool(true));
    }
    NodeDef {
        name: name.into(),
        op: "Send".into(),
        inputs: vec![input],
        device: send_device.into(),
        colocate_with: vec![],
        attrs,
    }
}

fn recv_def(
    name: &str,
    tensor_name: &str,
    send_device: &str,
    recv_device: &str,
    client_terminated: bool,
    dtype: DType,
    shape: &Shape,
) -> NodeDef {
    let mut attrs = BTreeMap::new();
    attrs.insert("tensor_name".into(), AttrValue::String(tensor_name.into()));
    attrs.insert("send_device".into(), AttrValue::String(send_device.into()));
    attrs.insert("recv_device".into(), AttrValue::String(recv_device.into()));
    if client_terminated {
        attrs.insert("client_terminated".into(), AttrValue::Bool(true));
    }
    attrs.insert("dtype".into(), AttrValue::DType(dtype));
    attrs.insert("shape".into(), AttrValue::Shape(shape.clone()));
    NodeDef {
        name: name.into(),
        op: "Recv".into(),
        inputs: vec![],
        device: recv_device.into(),
        colocate_with: vec![],
        attrs,
    }
}
