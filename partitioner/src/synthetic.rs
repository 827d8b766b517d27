//! Generated placed graphs for benchmarks and stress tests.

use crate::place::PlacedGraph;
use dflow_graph::{AttrValue, DType, DeviceName, DeviceType, Graph, GraphDef, NodeDef, Shape};

/// A layered graph of about `nodes` nodes over 64 devices (2 ps tasks, 62 worker tasks).
///
/// Layers are 1024 wide. Layer 0 holds variables (on ps, alternating) and placeholders;
/// every later node is `Add(prev[j], prev[j+1])` on worker `j * 62 / 1024`, so about one data
/// edge in sixteen crosses devices, and every 8th node also has a control dependency on a node
/// of another worker. Tensors are `f32[16]`.
pub fn layered(nodes: usize) -> PlacedGraph {
    const WIDTH: usize = 1024;
    const WORKERS: usize = 62;
    let layers = nodes.div_ceil(WIDTH).max(2);
    let mut defs = Vec::with_capacity(layers * WIDTH);
    let mut devices = Vec::with_capacity(layers * WIDTH);
    let ps: Vec<DeviceName> = (0..2)
        .map(|t| DeviceName::full("ps", t, DeviceType::CPU, 0))
        .collect();
    let workers: Vec<DeviceName> = (0..WORKERS as u32)
        .map(|t| DeviceName::full("worker", t, DeviceType::CPU, 0))
        .collect();
    let name = |l: usize, j: usize| format!("l{l}/n{j}");
    for j in 0..WIDTH {
        let mut attrs = std::collections::BTreeMap::new();
        attrs.insert("dtype".into(), AttrValue::DType(DType::F32));
        attrs.insert("shape".into(), AttrValue::Shape(Shape::known(&[16])));
        let variable = j < 32;
        defs.push(NodeDef {
            name: name(0, j),
            op: if variable { "Variable" } else { "Placeholder" }.into(),
            attrs,
            ..NodeDef::default()
        });
        devices.push(if variable {
            ps[j % 2].clone()
        } else {
            workers[j * WORKERS / WIDTH].clone()
        });
    }
    for l in 1..layers {
        for j in 0..WIDTH {
            let mut inputs = vec![name(l - 1, j), name(l - 1, (j + 1) % WIDTH)];
            if j % 8 == 0 {
                inputs.push(format!("^{}", name(l - 1, (j * 31 + 7) % WIDTH)));
            }
            defs.push(NodeDef {
                name: name(l, j),
                op: "Add".into(),
                inputs,
                ..NodeDef::default()
            });
            devices.push(workers[j * WORKERS / WIDTH].clone());
        }
    }
    let def = GraphDef {
        version: dflow_graph::def::FORMAT_VERSION,
        nodes: defs,
        train: None,
    };
    // The generator's own output is valid by construction.
    let graph = Graph::from_def(&def).unwrap_or_default();
    PlacedGraph { graph, devices }
}
