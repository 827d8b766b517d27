//! Phase 2, pairs: one walk over the kept nodes in node order decides every Send/Recv pair and
//! each partition's node order, keeping only small handles ([`Item`]s, [`PartEdge`]s); the
//! nodes themselves are made later, straight into each partition's graph.

use crate::error::PartitionError;
use dflow_graph::{Edge, Graph};
use petgraph::graph::NodeIndex;
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::collections::HashMap;

use super::devices::Devices;
use super::naming::tensor_name;
use super::request::Request;
use super::{EdgeSrc, FastMap, Item, PairBuild, PairKind, PartBuild, PartEdge, Source};

/// The pairs and the partitions under construction.
pub(super) struct Walk {
    /// Per device id, its partition's items and edges.
    pub(super) parts: Vec<PartBuild>,
    /// Each kept node's position in its partition, by node index (`u32::MAX`: not kept).
    pub(super) local_of: Vec<u32>,
    /// Every pair: feeds first, then remote pairs in discovery order, then fetches.
    pub(super) pairs: Vec<PairBuild>,
    /// For each requested fetch, its pair.
    pub(super) fetch_pairs: Vec<u32>,
}

/// Creates the pair carrying `src` from device `sd` to device `d` and returns the position of
/// its Recv on `d`.
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

/// Walks the kept nodes of `g` (see the module docs).
pub(super) fn walk_pairs(
    g: &Graph,
    devices: &Devices,
    req: &Request,
    keep: &[bool],
) -> Result<Walk, PartitionError> {
    let pg = g.petgraph();
    let n = g.num_nodes();
    let dev = &devices.of_node;
    let feeds = &req.feeds;
    let mut kept_on = vec![0usize; devices.all.len()];
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
            send_dev: devices.client,
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
            let src = match req.fed(u.index(), out) {
                Some(f) => {
                    if is_ref {
                        return Err(PartitionError::FeedIntoRef {
                            tensor: tensor_name(g, feeds, Source::Feed(f)),
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
                    producer_device: devices.names[sd as usize].clone(),
                    consumer_device: devices.names[d as usize].clone(),
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
    let mut fetch_pairs = Vec::with_capacity(req.fetches.len());
    for t in &req.fetches {
        let src = match req.fed(t.node.index(), t.out) {
            Some(f) => Source::Feed(f),
            None => Source::Data(t.node.index() as u32, t.out as u32),
        };
        if let Some(&p) = fetch_pair.get(&src) {
            fetch_pairs.push(p);
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
            recv_dev: devices.client,
            recv_local: u32::MAX,
        });
        fetch_pair.insert(src, p as u32);
        fetch_pairs.push(p as u32);
    }
    Ok(Walk {
        parts,
        local_of,
        pairs,
        fetch_pairs,
    })
}

#[cfg(test)]
mod tests {
    use super::super::devices::intern_devices;
    use super::super::request::{kept_nodes, resolve_request};
    use super::super::PartitionOptions;
    use super::*;
    use dflow_graph::{builder::GraphBuilder, DType, DeviceName, DeviceType};

    /// `x` on worker 0; `y` and `z` read it on worker 1; `t` on worker 1 runs after `x`.
    fn walk(opts: &PartitionOptions) -> (Graph, Devices, Walk) {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[2]);
        b.unary("Neg", "y", &x);
        b.unary("Neg", "z", &x);
        b.op("NoOp", "t").control_dep(&x).finish();
        let g = b.build().unwrap();
        let (w0, w1) = (
            DeviceName::full("worker", 0, DeviceType::CPU, 0),
            DeviceName::full("worker", 1, DeviceType::CPU, 0),
        );
        let devices = intern_devices(&g, &[w0, w1.clone(), w1.clone(), w1]).unwrap();
        let req = resolve_request(&g, opts).unwrap();
        let keep = kept_nodes(&g, &req);
        let walk = walk_pairs(&g, &devices, &req, &keep).unwrap();
        (g, devices, walk)
    }

    #[test]
    fn one_pair_per_tensor_and_device_and_one_per_control_source() {
        let (g, devices, w) = walk(&PartitionOptions::default());
        let (d0, d1) = (devices.of_node[0], devices.of_node[1]);
        // `x:0` once to worker 1 (shared by y and z), and `^x` once.
        assert_eq!(w.pairs.len(), 2);
        assert!(w
            .pairs
            .iter()
            .all(|p| p.kind == PairKind::Remote && (p.send_dev, p.recv_dev) == (d0, d1)));
        assert_eq!(w.pairs[0].src, Source::Data(0, 0));
        assert_eq!(w.pairs[1].src, Source::Control(0));
        // Worker 0: x, its Send, the control pair's empty constant and its Send.
        assert_eq!(
            w.parts[d0 as usize].items,
            [
                Item::Orig(0),
                Item::Send(0),
                Item::ControlValue(1),
                Item::Send(1)
            ]
        );
        // Worker 1: the Recv before its first consumer, then y, z, the control Recv, t.
        assert_eq!(
            w.parts[d1 as usize].items,
            [
                Item::Recv(0),
                Item::Orig(1),
                Item::Orig(2),
                Item::Recv(1),
                Item::Orig(3)
            ]
        );
        assert_eq!(w.local_of, [0, 1, 2, 4]);
        assert!(w.fetch_pairs.is_empty());
        assert_eq!(g.num_nodes(), 4);
    }

    #[test]
    fn feeds_lead_their_partition_and_fetches_come_last() {
        let opts = PartitionOptions {
            feeds: vec!["x".into()],
            fetches: vec!["y".into(), "y:0".into()],
            targets: vec![],
        };
        let (_, devices, w) = walk(&opts);
        let d1 = devices.of_node[1];
        let kinds: Vec<PairKind> = w.pairs.iter().map(|p| p.kind).collect();
        // The feed, the fed `x` moving to worker 1, and one fetch for both requests.
        assert_eq!(kinds, [PairKind::Feed, PairKind::Remote, PairKind::Fetch]);
        assert_eq!(w.pairs[0].send_dev, devices.client);
        assert_eq!(w.pairs[2].recv_dev, devices.client);
        assert_eq!(w.pairs[2].send_dev, d1);
        assert_eq!(w.fetch_pairs, [2, 2]);
        assert_eq!(w.parts[devices.of_node[0] as usize].items[0], Item::Recv(0));
    }
}
