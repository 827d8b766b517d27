//! Parse time of a 100k-node graph in each format (`cargo bench -p dflow-graph --bench parse`).

use criterion::{criterion_group, criterion_main, Criterion};
use dflow_graph::format::{parse_dsl, parse_json, to_dsl, to_json};
use dflow_graph::{DType, GraphDef, NodeDef, Shape, Tensor};

const NODES: usize = 100_000;

/// A chain/diamond mix: every 8th node is a source (Placeholder or Const), the others are
/// Identity nodes reading the previous node, some with a control edge to a node further back.
fn big_graph() -> GraphDef {
    let mut nodes = Vec::with_capacity(NODES);
    for i in 0..NODES {
        let mut n = NodeDef {
            name: format!("layer{}/n{i}", i / 1000),
            device: format!("/job:worker/task:{}", i % 4),
            ..NodeDef::default()
        };
        if i % 8 == 0 {
            if i % 16 == 0 {
                n.op = "Placeholder".into();
                n.attrs.insert("dtype".into(), DType::F32.into());
                n.attrs
                    .insert("shape".into(), Shape::partial(vec![None, Some(64)]).into());
            } else {
                n.op = "Const".into();
                let t = Tensor::from_slice(&[2, 2], &[1.0f32, 2.5, -3.0, 0.125]);
                n.attrs.insert(
                    "value".into(),
                    t.unwrap_or_else(|_| Tensor::scalar(0f32)).into(),
                );
            }
        } else {
            n.op = "Identity".into();
            n.inputs.push(nodes_name(&nodes, i - 1));
            if i % 8 == 3 {
                // Diamond: join back to the last source.
                n.inputs.push(format!("^{}", nodes_name(&nodes, i - 3)));
            }
        }
        nodes.push(n);
    }
    GraphDef {
        version: 1,
        nodes,
        train: None,
    }
}

fn nodes_name(nodes: &[NodeDef], i: usize) -> String {
    nodes[i].name.clone()
}

fn bench(c: &mut Criterion) {
    let g = big_graph();
    let json = to_json(&g);
    let dsl = to_dsl(&g);
    assert_eq!(
        parse_json(&json, None).map(|p| p.def.nodes.len()).ok(),
        Some(NODES)
    );
    assert_eq!(
        parse_dsl(&dsl, None).map(|p| p.def.nodes.len()).ok(),
        Some(NODES)
    );
    let mut group = c.benchmark_group("parse_100k");
    group.sample_size(10);
    group.bench_function("json", |b| b.iter(|| parse_json(&json, None)));
    group.bench_function("dsl", |b| b.iter(|| parse_dsl(&dsl, None)));
    group.bench_function("to_json", |b| b.iter(|| to_json(&g)));
    group.bench_function("to_dsl", |b| b.iter(|| to_dsl(&g)));
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
