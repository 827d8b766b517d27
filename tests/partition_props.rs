//! Property tests over random placed graphs: partitioning preserves the dataflow exactly.

use dflow_graph::builder::GraphBuilder;
use dflow_graph::{DType, DeviceName, DeviceType, Graph};
use dflow_partitioner::{partition, render_json, PartitionOptions, Partitions, PlacedGraph};
use proptest::prelude::*;
use std::collections::{BTreeSet, HashMap};

/// A random DAG: node i takes 1–2 data inputs and 0–1 control inputs from earlier nodes.
#[derive(Debug, Clone)]
struct Spec {
    nodes: Vec<(Vec<usize>, Option<usize>, usize)>, // (data inputs, control input, device)
}

fn spec() -> impl Strategy<Value = Spec> {
    (2usize..24).prop_flat_map(|n| {
        let node = |i: usize| {
            if i == 0 {
                (Just(vec![]), Just(None), 0usize..4).boxed()
            } else {
                (
                    proptest::collection::vec(0..i, 0..=2),
                    proptest::option::of(0..i),
                    0usize..4,
                )
                    .boxed()
            }
        };
        (0..n)
            .map(node)
            .collect::<Vec<_>>()
            .prop_map(|nodes| Spec { nodes })
    })
}

fn devices() -> Vec<DeviceName> {
    vec![
        DeviceName::full("ps", 0, DeviceType::CPU, 0),
        DeviceName::full("worker", 0, DeviceType::CPU, 0),
        DeviceName::full("worker", 1, DeviceType::CPU, 0),
        DeviceName::full("worker", 2, DeviceType::CPU, 0),
    ]
}

fn build(s: &Spec) -> PlacedGraph {
    let mut b = GraphBuilder::new();
    let mut handles = Vec::new();
    for (i, (ins, ctrl, _)) in s.nodes.iter().enumerate() {
        let name = format!("n{i}");
        let mut op = match ins.len() {
            0 => b
                .op("Placeholder", &name)
                .attr("dtype", DType::F32)
                .attr("shape", dflow_graph::Shape::known(&[2])),
            1 => b.op("Relu", &name).input(&handles[ins[0]]),
            _ => b
                .op("Add", &name)
                .input(&handles[ins[0]])
                .input(&handles[ins[1]]),
        };
        if let Some(c) = ctrl {
            op = op.control_dep(&handles[*c]);
        }
        handles.push(op.finish());
    }
    let graph = b.build().unwrap();
    let devs = devices();
    let devices = s.nodes.iter().map(|(_, _, d)| devs[*d].clone()).collect();
    PlacedGraph { graph, devices }
}

/// Reconnects the partitions: for every original node, its data inputs (as `node:out`) and its
/// control inputs (as node names), with Send/Recv resolved through their pair's tensor name.
fn merged(p: &Partitions) -> HashMap<String, (Vec<String>, BTreeSet<String>)> {
    let recv_tensor: HashMap<(String, String), String> = p
        .pairs
        .iter()
        .filter(|t| !t.recv_node.is_empty())
        .map(|t| {
            (
                (t.recv_device.to_string(), t.recv_node.clone()),
                t.tensor_name.to_string(),
            )
        })
        .collect();
    let mut out = HashMap::new();
    for (device, part) in &p.partitions {
        let d = device.to_string();
        let g: &Graph = &part.graph;
        for idx in g.node_indices() {
            let n = g.node(idx);
            assert_eq!(
                &*n.device, d,
                "node {} lives in its partition's device",
                n.name
            );
            if matches!(n.op, "Send" | "Recv") || n.name.ends_with("/value") {
                continue;
            }
            let data = g
                .inputs(idx)
                .into_iter()
                .map(|(u, o)| {
                    let un = &g.node(u).name;
                    match recv_tensor.get(&(d.clone(), un.clone())) {
                        Some(t) => t.clone(),
                        None => format!("{un}:{o}"),
                    }
                })
                .collect();
            let ctrl = g
                .control_inputs(idx)
                .into_iter()
                .map(|u| {
                    let un = &g.node(u).name;
                    match recv_tensor.get(&(d.clone(), un.clone())) {
                        Some(t) => t.trim_start_matches('^').to_string(),
                        None => un.clone(),
                    }
                })
                .collect();
            out.insert(n.name.clone(), (data, ctrl));
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn partitioning_preserves_dataflow(s in spec()) {
        let placed = build(&s);
        let p = partition(&placed, &PartitionOptions::default()).unwrap();
        let g = &placed.graph;

        // Merging the partitions back gives the original dataflow, node for node.
        let m = merged(&p);
        prop_assert_eq!(m.len(), g.num_nodes());
        for idx in g.node_indices() {
            let n = g.node(idx);
            let data: Vec<String> = g
                .inputs(idx)
                .into_iter()
                .map(|(u, o)| format!("{}:{o}", g.node(u).name))
                .collect();
            let ctrl: BTreeSet<String> =
                g.control_inputs(idx).into_iter().map(|u| g.node(u).name.clone()).collect();
            prop_assert_eq!(&m[&n.name], &(data, ctrl), "node {}", n.name);
        }

        // Each cross-device edge maps to exactly one pair; pairs are deduplicated.
        let mut expected = BTreeSet::new();
        for idx in g.node_indices() {
            let dv = &placed.devices[idx.index()];
            for (u, o) in g.inputs(idx) {
                if &placed.devices[u.index()] != dv {
                    expected.insert((format!("{}:{o}", g.node(u).name), dv.to_string()));
                }
            }
            for u in g.control_inputs(idx) {
                if &placed.devices[u.index()] != dv {
                    expected.insert((format!("^{}", g.node(u).name), dv.to_string()));
                }
            }
        }
        let got: Vec<(String, String)> =
            p.pairs.iter().map(|t| (t.tensor_name.to_string(), t.recv_device.to_string())).collect();
        let got_set: BTreeSet<_> = got.iter().cloned().collect();
        prop_assert_eq!(got.len(), got_set.len(), "one pair per (tensor, destination)");
        prop_assert_eq!(got_set, expected);
        let keys: BTreeSet<&str> = p.pairs.iter().map(|t| t.key.as_str()).collect();
        prop_assert_eq!(keys.len(), p.pairs.len());
        let mut sorted = p.pairs.clone();
        sorted.sort_by(|a, b| a.key.cmp(&b.key));
        prop_assert_eq!(&sorted, &p.pairs, "small task ids: key order");

        // Deterministic.
        let again = partition(&placed, &PartitionOptions::default()).unwrap();
        prop_assert_eq!(render_json(&p), render_json(&again));
    }

    #[test]
    fn pruning_keeps_exactly_the_ancestors(s in spec(), pick in any::<prop::sample::Index>()) {
        let placed = build(&s);
        let g = &placed.graph;
        let target = g.node_indices().nth(pick.index(g.num_nodes())).unwrap();
        let name = g.node(target).name.clone();
        let opts = PartitionOptions { targets: vec![name], ..Default::default() };
        let p = partition(&placed, &opts).unwrap();
        // Ancestors over data + control edges.
        let mut keep = vec![false; g.num_nodes()];
        let mut stack = vec![target];
        while let Some(v) = stack.pop() {
            if std::mem::replace(&mut keep[v.index()], true) { continue; }
            for (u, _) in g.inputs(v) { stack.push(u); }
            stack.extend(g.control_inputs(v));
        }
        let m = merged(&p);
        let want: BTreeSet<String> = g.node_indices().filter(|i| keep[i.index()]).map(|i| g.node(i).name.clone()).collect();
        let got: BTreeSet<String> = m.keys().cloned().collect();
        prop_assert_eq!(got, want);
    }
}
