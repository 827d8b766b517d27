//! Partitioning's own tests: partitions equal their validated form, structure checks, names.

use super::naming::{concat, push_indexed};
use super::*;
use crate::synthetic;
use dflow_graph::DeviceType;

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
fn generated_names_step_around_graph_nodes() {
    use dflow_graph::builder::GraphBuilder;
    let mut b = GraphBuilder::new();
    let a = b.placeholder("a", DType::F32, &[2]);
    let _c = b.op("Identity", "c").input(&a).finish();
    // Nodes named like the pair's Send and Recv (and like the first suffixed Send name).
    for name in [
        "send/a_0/to/worker_1",
        "send/a_0/to/worker_1_1",
        "recv/a_0/from/worker_0",
    ] {
        b.placeholder(name, DType::F32, &[1]);
    }
    let graph = b.build().unwrap();
    let (w0, w1) = (
        DeviceName::full("worker", 0, DeviceType::CPU, 0),
        DeviceName::full("worker", 1, DeviceType::CPU, 0),
    );
    let devices = graph
        .node_indices()
        .map(|v| {
            if graph.node(v).name == "c" {
                w1.clone()
            } else {
                w0.clone()
            }
        })
        .collect();
    let placed = PlacedGraph { graph, devices };
    let p = partition(&placed, &PartitionOptions::default()).unwrap();
    assert_eq!(p.pairs.len(), 1);
    assert_eq!(p.pairs[0].send_node, "send/a_0/to/worker_1_2");
    assert_eq!(p.pairs[0].recv_node, "recv/a_0/from/worker_0_1");
    assert_same_as_validated(&p);
}

#[test]
fn indexed_names() {
    let indexed = |name: &str, sep: &str, index: usize| {
        let mut s = name.to_string();
        push_indexed(&mut s, sep, index);
        s
    };
    assert_eq!(indexed("x", ":", 0), "x:0");
    assert_eq!(indexed("a/b", "_", 12345), "a/b_12345");
    assert_eq!(indexed("y", ":", usize::MAX), format!("y:{}", usize::MAX));
    assert_eq!(concat(&["a", "", "bc"]), "abc");
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
    unknown.op = "NoSuchOp";
    assert!(Graph::from_parts(vec![unknown], vec![]).is_err());
}
