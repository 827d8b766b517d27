//! Deterministic renderings of [`Partitions`]: text for people, JSON for the executor (and
//! [`load_json`] to read it back), Graphviz DOT for pictures.

use crate::error::PartitionsJsonError;
use crate::partition::{ClientEndpoint, Partition, Partitions, TransferPair};
use crate::plan::BufferPlan;
use dflow_graph::ops::transfer::CLIENT_DEVICE;
use dflow_graph::{AttrValue, DeviceName, Graph, Node};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

/// The `"format"` tag of [`render_json`] output.
pub const PARTITIONS_FORMAT: &str = "dflow-partitions";

fn attr_str<'a>(n: &'a Node, k: &str) -> &'a str {
    match n.attrs.get(k) {
        Some(AttrValue::String(s)) => s,
        _ => "",
    }
}

/// The rendezvous key a Send or Recv node carries in its attrs.
fn node_key(n: &Node) -> String {
    format!(
        "{};{};{}",
        attr_str(n, "send_device"),
        attr_str(n, "recv_device"),
        attr_str(n, "tensor_name")
    )
}

fn bytes_text(b: Option<usize>) -> String {
    b.map_or_else(|| "dynamic".to_string(), |b| b.to_string())
}

/// Nodes in the partition's order with their inputs as written (`name = Op(inputs)`).
fn node_line(g: &Graph, idx: petgraph::graph::NodeIndex) -> String {
    let n = g.node(idx);
    let mut inputs: Vec<String> = g
        .inputs(idx)
        .into_iter()
        .map(|(u, o)| {
            let name = &g.node(u).name;
            if o == 0 {
                name.clone()
            } else {
                format!("{name}:{o}")
            }
        })
        .collect();
    inputs.extend(
        g.control_inputs(idx)
            .into_iter()
            .map(|u| format!("^{}", g.node(u).name)),
    );
    format!("{} = {}({})", n.name, n.op, inputs.join(", "))
}

/// One block per device (its nodes, each Send/Recv with key and bytes), then a summary.
pub fn render_text(p: &Partitions) -> String {
    let by_key: HashMap<&str, &TransferPair> =
        p.pairs.iter().map(|t| (t.key.as_str(), t)).collect();
    let mut out = String::new();
    for (device, part) in &p.partitions {
        let g = &part.graph;
        let recv = p
            .buffer_plan
            .bytes_received_per_step
            .get(device)
            .copied()
            .unwrap_or(0);
        let _ = writeln!(
            out,
            "device {device} ({} nodes, receives {recv} bytes/step)",
            g.num_nodes()
        );
        for idx in g.node_indices() {
            let n = g.node(idx);
            let _ = write!(out, "  {}", node_line(g, idx));
            if n.op == "Send" || n.op == "Recv" {
                let key = node_key(n);
                let bytes = by_key.get(key.as_str()).and_then(|t| t.bytes);
                let ty = n
                    .outputs
                    .first()
                    .map(|t| format!(" {t}"))
                    .unwrap_or_default();
                let _ = write!(out, "{ty}  key={key}  bytes={}", bytes_text(bytes));
            }
            out.push('\n');
        }
        out.push('\n');
    }
    let control = p.pairs.iter().filter(|t| t.is_control).count();
    let client = p.pairs.iter().filter(|t| t.client_terminated).count();
    let _ = writeln!(out, "summary");
    let _ = writeln!(out, "  devices: {}", p.partitions.len());
    let _ = writeln!(
        out,
        "  pairs: {} ({} data, {control} control, {client} client-terminated)",
        p.pairs.len(),
        p.pairs.len() - control - client
    );
    let _ = writeln!(out, "  bytes received per step:");
    for (d, b) in &p.buffer_plan.bytes_received_per_step {
        let _ = writeln!(out, "    {d}: {b}");
    }
    if !p.buffer_plan.dynamic.is_empty() {
        let _ = writeln!(out, "  dynamic pairs (per-step buffers):");
        for (k, why) in &p.buffer_plan.dynamic {
            let _ = writeln!(out, "    {k}: {why}");
        }
    }
    for (what, eps) in [("feeds", &p.feeds), ("fetches", &p.fetches)] {
        if !eps.is_empty() {
            let _ = writeln!(out, "  {what}:");
            for e in eps {
                let _ = writeln!(out, "    {} on {}  key={}", e.tensor, e.device, e.key);
            }
        }
    }
    out
}

/// The text block of one device alone (for `dflow partition -o DIR`).
pub fn render_device_text(p: &Partitions, device: &DeviceName) -> Option<String> {
    let part = p.partitions.get(device)?;
    let single = Partitions {
        partitions: BTreeMap::from([(device.clone(), part.clone())]),
        pairs: p
            .pairs
            .iter()
            .filter(|t| {
                let d = device.to_string();
                *t.send_device == *d || *t.recv_device == *d
            })
            .cloned()
            .collect(),
        feeds: vec![],
        fetches: vec![],
        buffer_plan: BufferPlan {
            bytes_received_per_step: p
                .buffer_plan
                .bytes_received_per_step
                .iter()
                .filter(|(d, _)| *d == device)
                .map(|(d, b)| (d.clone(), *b))
                .collect(),
            ..BufferPlan::default()
        },
    };
    let text = render_text(&single);
    Some(text.split("\nsummary\n").next().unwrap_or("").to_string() + "\n")
}

#[derive(Serialize, Deserialize)]
struct JsonPartition {
    device: DeviceName,
    graph: serde_json::Value,
}

#[derive(Serialize, Deserialize)]
struct JsonPartitions {
    format: String,
    version: u32,
    partitions: Vec<JsonPartition>,
    pairs: Vec<TransferPair>,
    feeds: Vec<ClientEndpoint>,
    fetches: Vec<ClientEndpoint>,
    buffer_plan: BufferPlan,
}

/// Everything in [`Partitions`] as pretty JSON; each partition's graph in the dflow graph file
/// layout. [`load_json`] reads it back.
pub fn render_json(p: &Partitions) -> String {
    let doc = JsonPartitions {
        format: PARTITIONS_FORMAT.into(),
        version: 1,
        partitions: p
            .partitions
            .values()
            .map(|part| JsonPartition {
                device: part.device.clone(),
                // The graph file format's own writer; its output is always valid JSON.
                graph: serde_json::from_str(&dflow_graph::to_json(&part.graph.to_def()))
                    .unwrap_or_default(),
            })
            .collect(),
        pairs: p.pairs.clone(),
        feeds: p.feeds.clone(),
        fetches: p.fetches.clone(),
        buffer_plan: p.buffer_plan.clone(),
    };
    // Serializing plain data with string keys cannot fail.
    serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n"
}

/// Reads [`render_json`] output back, validating every partition's graph.
pub fn load_json(text: &str) -> Result<Partitions, PartitionsJsonError> {
    let doc: JsonPartitions = serde_json::from_str(text)?;
    let mut partitions = BTreeMap::new();
    for jp in doc.partitions {
        let err = |message: String| PartitionsJsonError::Graph {
            device: jp.device.to_string(),
            message,
        };
        let def = dflow_graph::parse_json(&jp.graph.to_string(), None)
            .map_err(|e| err(e.to_string()))?
            .def;
        let graph = Graph::from_def(&def).map_err(|e| err(e.to_string()))?;
        partitions.insert(
            jp.device.clone(),
            Partition {
                device: jp.device,
                graph,
            },
        );
    }
    Ok(Partitions {
        partitions,
        pairs: doc.pairs,
        feeds: doc.feeds,
        fetches: doc.fetches,
        buffer_plan: doc.buffer_plan,
    })
}

fn dot_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Graphviz: one `subgraph cluster_N` per device, local edges solid (control edges dotted), and
/// each pair a dashed edge from its Send to its Recv labelled with its bytes.
pub fn render_dot(p: &Partitions) -> String {
    let mut out = String::from(
        "digraph partitions {\n  rankdir=LR;\n  compound=true;\n  node [shape=box, fontsize=10];\n",
    );
    let id = |device: &str, node: &str| format!("\"{}|{}\"", dot_escape(device), dot_escape(node));
    for (i, (device, part)) in p.partitions.iter().enumerate() {
        let d = device.to_string();
        let g = &part.graph;
        let _ = writeln!(out, "  subgraph cluster_{i} {{");
        let _ = writeln!(out, "    label=\"{}\";", dot_escape(&d));
        for idx in g.node_indices() {
            let n = g.node(idx);
            let style = match n.op {
                "Send" | "Recv" => ", style=filled, fillcolor=lightgrey",
                _ => "",
            };
            let _ = writeln!(
                out,
                "    {} [label=\"{}\\n{}\"{style}];",
                id(&d, &n.name),
                dot_escape(&n.name),
                n.op
            );
        }
        for idx in g.node_indices() {
            let n = &g.node(idx).name;
            for (u, _) in g.inputs(idx) {
                let _ = writeln!(out, "    {} -> {};", id(&d, &g.node(u).name), id(&d, n));
            }
            for u in g.control_inputs(idx) {
                let _ = writeln!(
                    out,
                    "    {} -> {} [style=dotted];",
                    id(&d, &g.node(u).name),
                    id(&d, n)
                );
            }
        }
        out.push_str("  }\n");
    }
    if p.pairs.iter().any(|t| t.client_terminated) {
        out.push_str("  \"client\" [shape=ellipse];\n");
    }
    for t in &p.pairs {
        let from = if &*t.send_device == CLIENT_DEVICE {
            "\"client\"".to_string()
        } else {
            id(&t.send_device, &t.send_node)
        };
        let to = if &*t.recv_device == CLIENT_DEVICE {
            "\"client\"".to_string()
        } else {
            id(&t.recv_device, &t.recv_node)
        };
        let label = match t.bytes {
            Some(b) => format!("{b} B"),
            None => "dynamic".into(),
        };
        let _ = writeln!(
            out,
            "  {from} -> {to} [style=dashed, label=\"{} ({label})\"];",
            dot_escape(&t.tensor_name)
        );
    }
    out.push_str("}\n");
    out
}
