//! Names of the nodes and tensors partitioning generates.
//!
//! Generated nodes are `send/{tensor}/to/{device}` and `recv/{tensor}/from/{device}`, where
//! `{tensor}` is the source tensor with `:` replaced by `_` (`x:0` → `x_0`, a control edge from
//! `x` → `x_ctrl`) and `{device}` is the short device name (`worker_0`, `ps_1_gpu_0`, `client`).
//! A name longer than 200 bytes becomes `{prefix}/pair_{n}/{dir}/{device}`; a name a graph node
//! already has gets the first free `_{k}` suffix.

use super::{PairBuild, PairKind, Source, TensorRef};
use dflow_graph::{DeviceName, DeviceType, Graph};
use petgraph::graph::NodeIndex;
use std::collections::HashSet;
use std::sync::Arc;

/// Generated node names: readable, deterministic, valid, and never equal to a graph node.
struct Namer<'a> {
    graph: &'a Graph,
    /// The graph's node names that start like generated names (`send/`, `recv/`), found on
    /// first use: one pass over the names beats a lookup in a large graph's name table per
    /// generated name, and the set is almost always empty.
    taken: Option<HashSet<&'a str>>,
    /// Suffixed names handed out after a clash (almost always empty).
    used: HashSet<String>,
}

/// How generated names start; see [`Namer::is_free`].
const GENERATED_PREFIXES: [&str; 2] = ["send/", "recv/"];

impl<'a> Namer<'a> {
    fn new(graph: &'a Graph) -> Namer<'a> {
        Namer {
            graph,
            taken: None,
            used: HashSet::new(),
        }
    }

    /// Whether `name` is neither a graph node's nor already handed out.
    fn is_free(&mut self, name: &str) -> bool {
        if !self.used.is_empty() && self.used.contains(name) {
            return false;
        }
        if !GENERATED_PREFIXES.iter().any(|p| name.starts_with(p)) {
            return self.graph.find(name).is_none();
        }
        !self.taken().contains(name)
    }

    fn taken(&mut self) -> &HashSet<&'a str> {
        use rayon::prelude::*;
        let graph = self.graph;
        self.taken.get_or_insert_with(|| {
            let taken: Vec<&str> = (0..graph.num_nodes())
                .into_par_iter()
                .map(|v| graph.node(NodeIndex::new(v)).name.as_str())
                .filter(|n| GENERATED_PREFIXES.iter().any(|p| n.starts_with(p)))
                .collect();
            taken.into_iter().collect()
        })
    }

    /// Whether some generated name could equal a graph node's (then names are handed out one
    /// by one, in pair order; otherwise every name is its plain form).
    fn clash_possible(&mut self) -> bool {
        !self.taken().is_empty()
    }

    /// `{prefix}/{tensor}/{dir}/{device}`, falling back to a numbered name when too long or
    /// taken by a graph node.
    fn name(&mut self, prefix: &str, tensor: &str, dir: &str, device: &str, pair: usize) -> String {
        let name = plain_name(prefix, tensor, dir, device, pair);
        if self.is_free(&name) {
            return name;
        }
        // Rare: a user node already has this name. Suffix until free, and remember the result.
        let mut k = 1;
        loop {
            let candidate = format!("{name}_{k}");
            if self.is_free(&candidate) {
                self.used.insert(candidate.clone());
                return candidate;
            }
            k += 1;
        }
    }
}

/// `{prefix}/{tensor}/{dir}/{device}`, or `{prefix}/pair_{pair}/{dir}/{device}` when that would
/// be longer than 200 bytes: a generated name before any clash is resolved.
fn plain_name(prefix: &str, tensor: &str, dir: &str, device: &str, pair: usize) -> String {
    let name = concat(&[prefix, "/", tensor, "/", dir, "/", device]);
    if name.len() > 200 {
        return format!("{prefix}/pair_{pair}/{dir}/{device}");
    }
    name
}

/// The source node and output of `src` (output 0 for a control edge).
fn source_output<'g>(g: &'g Graph, feeds: &[TensorRef], src: Source) -> (&'g str, usize) {
    match src {
        Source::Data(n, o) => (&g.node(NodeIndex::new(n as usize)).name, o as usize),
        Source::Feed(f) => {
            let t = feeds[f as usize];
            (&g.node(t.node).name, t.out)
        }
        Source::Control(n) => (&g.node(NodeIndex::new(n as usize)).name, 0),
    }
}

/// Appends the tensor part of a generated name to `buf`: the source tensor with `:` replaced
/// by `_`, or `{node}_ctrl` for a control edge.
fn push_tensor_part(buf: &mut String, g: &Graph, feeds: &[TensorRef], src: Source) {
    let (node, out) = source_output(g, feeds, src);
    buf.push_str(node);
    match src {
        Source::Control(_) => buf.push_str("_ctrl"),
        _ => push_indexed(buf, "_", out),
    }
}

/// Appends the tensor a pair carries to `buf`: `node:out`, or `^node` for a control edge.
fn push_tensor_name(buf: &mut String, g: &Graph, feeds: &[TensorRef], src: Source) {
    let (node, out) = source_output(g, feeds, src);
    if let Source::Control(_) = src {
        buf.push('^');
        buf.push_str(node);
    } else {
        buf.push_str(node);
        push_indexed(buf, ":", out);
    }
}

/// The tensor a pair carries: `node:out`, or `^node` for a control edge.
pub(super) fn tensor_name(g: &Graph, feeds: &[TensorRef], src: Source) -> String {
    let mut s = String::new();
    push_tensor_name(&mut s, g, feeds, src);
    s
}

/// The names of a pair: its tensor, and its Send and Recv nodes (empty on the client's side).
/// The tensor name is shared by the pair's Send and Recv nodes (their `tensor_name` attr).
#[derive(Default)]
pub(super) struct PairNames {
    pub(super) tensor_name: Arc<str>,
    pub(super) send_node: String,
    pub(super) recv_node: String,
}

/// Names every pair. Each name is its plain form unless a graph node's name starts like a
/// generated one; then names are handed out one by one in pair order (feeds, then pairs as
/// the walk over the graph made them, then fetches), suffixing any clash.
pub(super) fn name_pairs(
    g: &Graph,
    feeds: &[TensorRef],
    pairs: &[PairBuild],
    short: &[String],
) -> Vec<PairNames> {
    use rayon::prelude::*;
    // The names of `pair`, given how to name one node from (prefix, tensor, dir, device), made
    // in `scratch` (reused, so the parts cost no allocation of their own).
    let names = |pair: &PairBuild,
                 scratch: &mut String,
                 name: &mut dyn FnMut(&str, &str, &str, &str) -> String| {
        scratch.clear();
        push_tensor_part(scratch, g, feeds, pair.src);
        let tensor = scratch.as_str();
        let (send_node, recv_node) = match pair.kind {
            PairKind::Feed => (String::new(), name("recv", tensor, "from", "client")),
            PairKind::Fetch => (name("send", tensor, "to", "client"), String::new()),
            PairKind::Remote => {
                let send = name("send", tensor, "to", &short[pair.recv_dev as usize]);
                let recv = name("recv", tensor, "from", &short[pair.send_dev as usize]);
                (send, recv)
            }
        };
        scratch.clear();
        push_tensor_name(scratch, g, feeds, pair.src);
        PairNames {
            tensor_name: Arc::from(scratch.as_str()),
            send_node,
            recv_node,
        }
    };
    let mut namer = Namer::new(g);
    if namer.clash_possible() {
        let mut scratch = String::new();
        return pairs
            .iter()
            .enumerate()
            .map(|(p, pair)| {
                names(pair, &mut scratch, &mut |prefix, tensor, dir, device| {
                    namer.name(prefix, tensor, dir, device, p)
                })
            })
            .collect();
    }
    pairs
        .par_iter()
        .enumerate()
        .map_init(String::new, |scratch, (p, pair)| {
            names(pair, scratch, &mut |prefix, tensor, dir, device| {
                plain_name(prefix, tensor, dir, device, p)
            })
        })
        .collect()
}

/// The strings of `parts` joined, in a string of exactly their size (`format!` grows its buffer
/// as it goes, which shows when making a few hundred thousand names).
pub(super) fn concat(parts: &[&str]) -> String {
    let mut s = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        s.push_str(p);
    }
    s
}

/// Appends `{sep}{index}` to `buf`, e.g. the `:0` of the tensor name `x:0`.
pub(super) fn push_indexed(buf: &mut String, sep: &str, index: usize) {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    let mut rest = index;
    loop {
        start -= 1;
        digits[start] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    buf.push_str(sep);
    buf.push_str(std::str::from_utf8(&digits[start..]).unwrap_or_default());
}

/// Short, name-safe form of a device: `worker_0`, or `worker_0_gpu_1` off CPU:0.
pub(super) fn short_device(d: &DeviceName) -> String {
    let job = d.job.as_deref().unwrap_or("any");
    let task = d.task.unwrap_or(0);
    let mut s = format!("{job}_{task}");
    let ty = d.device_type.clone().unwrap_or(DeviceType::CPU);
    let id = d.device_id.unwrap_or(0);
    if d.replica.is_some_and(|r| r != 0) {
        s = format!("{job}_r{}_{task}", d.replica.unwrap_or(0));
    }
    if !(ty == DeviceType::CPU && id == 0) {
        s.push_str(&format!("_{}_{id}", ty.as_str().to_ascii_lowercase()));
    }
    s
}
