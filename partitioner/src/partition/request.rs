//! What to compute: the feeds, fetches and targets resolved to tensors and nodes, and the nodes
//! they keep.

use crate::error::PartitionError;
use dflow_graph::{Edge, Graph};
use petgraph::graph::NodeIndex;
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::collections::HashMap;

use super::{PartitionOptions, TensorRef};

/// The options resolved against the graph.
#[derive(Debug)]
pub(super) struct Request {
    /// Distinct fed tensors, in first-request order.
    pub(super) feeds: Vec<TensorRef>,
    /// For each requested feed, its index in `feeds`.
    pub(super) feed_index: Vec<u32>,
    /// Fetched tensors, in request order (repeats included).
    pub(super) fetches: Vec<TensorRef>,
    /// Target nodes.
    pub(super) targets: Vec<NodeIndex>,
    feed_of: HashMap<(u32, u32), u32>,
    /// Per node, whether any of its outputs is fed (empty when nothing is fed).
    has_feed: Vec<bool>,
}

impl Request {
    /// The feed of output `out` of node `node`, if it is fed.
    #[inline]
    pub(super) fn fed(&self, node: usize, out: usize) -> Option<u32> {
        if self.has_feed.is_empty() || !self.has_feed[node] {
            return None;
        }
        self.feed_of.get(&(node as u32, out as u32)).copied()
    }
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

/// Resolves the feeds, fetches and targets of `opts` in `g`.
pub(super) fn resolve_request(
    g: &Graph,
    opts: &PartitionOptions,
) -> Result<Request, PartitionError> {
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
    let mut has_feed = vec![false; if feeds.is_empty() { 0 } else { g.num_nodes() }];
    for t in &feeds {
        has_feed[t.node.index()] = true;
    }
    let fetches = opts
        .fetches
        .iter()
        .map(|s| parse_tensor(g, "fetch", s))
        .collect::<Result<_, _>>()?;
    let targets = opts
        .targets
        .iter()
        .map(|s| {
            g.find(s)
                .ok_or_else(|| PartitionError::UnknownTarget { node: s.clone() })
        })
        .collect::<Result<_, _>>()?;
    Ok(Request {
        feeds,
        feed_index,
        fetches,
        targets,
        feed_of,
        has_feed,
    })
}

/// Which nodes to keep, by node index. With fetches or targets, what they need (walking data
/// and control inputs back, stopping at fed tensors); with neither, every node but the fed
/// nodes that have no other use.
pub(super) fn kept_nodes(g: &Graph, req: &Request) -> Vec<bool> {
    let pg = g.petgraph();
    let n = g.num_nodes();
    if req.fetches.is_empty() && req.targets.is_empty() {
        let mut keep = vec![true; n];
        for t in &req.feeds {
            let idx = t.node;
            let only_fed = !g.node(idx).op_def().stateful
                && pg
                    .edges_directed(idx, Direction::Outgoing)
                    .all(|e| match *e.weight() {
                        Edge::Data { src_output, .. } => req.fed(idx.index(), src_output).is_some(),
                        Edge::Control => false,
                    });
            if only_fed {
                keep[idx.index()] = false;
            }
        }
        return keep;
    }
    let mut keep = vec![false; n];
    let mut stack: Vec<NodeIndex> = Vec::new();
    for t in &req.fetches {
        if req.fed(t.node.index(), t.out).is_none() {
            stack.push(t.node);
        }
    }
    stack.extend(req.targets.iter().copied());
    while let Some(v) = stack.pop() {
        if std::mem::replace(&mut keep[v.index()], true) {
            continue;
        }
        for e in pg.edges_directed(v, Direction::Incoming) {
            let u = e.source();
            let cut = match *e.weight() {
                Edge::Data { src_output, .. } => req.fed(u.index(), src_output).is_some(),
                Edge::Control => false,
            };
            if !cut && !keep[u.index()] {
                stack.push(u);
            }
        }
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::{builder::GraphBuilder, DType};

    /// `x -> y -> z`, `y2` reads `x` too, and `t` runs after `z` (control edge).
    fn chain() -> Graph {
        let mut b = GraphBuilder::new();
        let x = b.placeholder("x", DType::F32, &[2]);
        let y = b.unary("Neg", "y", &x);
        let z = b.unary("Neg", "z", &y);
        b.unary("Neg", "y2", &x);
        b.op("NoOp", "t").control_dep(&z).finish();
        b.build().unwrap()
    }

    fn opts(feeds: &[&str], fetches: &[&str], targets: &[&str]) -> PartitionOptions {
        let v = |s: &[&str]| s.iter().map(|s| s.to_string()).collect();
        PartitionOptions {
            feeds: v(feeds),
            fetches: v(fetches),
            targets: v(targets),
        }
    }

    fn kept(g: &Graph, o: &PartitionOptions) -> Vec<String> {
        let req = resolve_request(g, o).unwrap();
        let keep = kept_nodes(g, &req);
        g.node_indices()
            .filter(|v| keep[v.index()])
            .map(|v| g.node(v).name.clone())
            .collect()
    }

    #[test]
    fn feeds_are_deduplicated_and_looked_up_by_output() {
        let g = chain();
        let req = resolve_request(&g, &opts(&["y", "x:0", "y:0"], &["z", "z"], &["t"])).unwrap();
        assert_eq!(req.feeds.len(), 2);
        assert_eq!(req.feed_index, [0, 1, 0]);
        let y = g.find("y").unwrap().index();
        assert_eq!(req.fed(y, 0), Some(0));
        assert_eq!(req.fed(g.find("z").unwrap().index(), 0), None);
        assert_eq!(req.fetches.len(), 2);
        assert_eq!(req.targets, [g.find("t").unwrap()]);
    }

    #[test]
    fn bad_names_are_errors_naming_them() {
        let g = chain();
        let e = resolve_request(&g, &opts(&["nope"], &[], &[])).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        let e = resolve_request(&g, &opts(&[], &["y:1"], &[])).unwrap_err();
        assert!(e.to_string().contains("1 outputs"), "{e}");
        let e = resolve_request(&g, &opts(&[], &["y:x"], &[])).unwrap_err();
        assert!(e.to_string().contains("not a number"), "{e}");
        let e = resolve_request(&g, &opts(&[], &[], &["u"])).unwrap_err();
        assert_eq!(e, PartitionError::UnknownTarget { node: "u".into() });
    }

    #[test]
    fn fetches_and_targets_keep_what_they_need_and_feeds_cut() {
        let g = chain();
        assert_eq!(kept(&g, &opts(&[], &["z"], &[])), ["x", "y", "z"]);
        assert_eq!(kept(&g, &opts(&["y"], &["z"], &[])), ["z"]);
        assert_eq!(kept(&g, &opts(&[], &[], &["t"])), ["x", "y", "z", "t"]);
        assert_eq!(kept(&g, &opts(&["y"], &["y"], &[])), Vec::<String>::new());
    }

    #[test]
    fn without_fetches_everything_but_fed_nodes_with_no_other_use_is_kept() {
        let g = chain();
        assert_eq!(kept(&g, &opts(&[], &[], &[])), ["x", "y", "z", "y2", "t"]);
        // `y` is fed and has no other use: dropped. `x` still feeds `y2`: kept.
        assert_eq!(kept(&g, &opts(&["y"], &[], &[])), ["x", "z", "y2", "t"]);
    }
}
