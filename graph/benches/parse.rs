//! Parse time of a 100k-node graph in each format, parse + validation time of a realistic
//! 100k-node model, and a chain written on one line (as `json.dump` writes it) at 10k, 40k and
//! 200k nodes, whose time must grow linearly (`cargo bench -p dflow-graph --bench parse`).

use criterion::{criterion_group, criterion_main, Criterion};
use dflow_graph::format::{parse_dsl, parse_json, to_dsl, to_json};
use dflow_graph::{DType, Graph, GraphDef, NodeDef, Shape, Tensor};

/// The allocator the `dflow` binary uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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

/// A stack of dense residual layers, the shape of a real model: each tower starts with a
/// Placeholder `[-1, 64]`; each layer is `w`, `b` (Variables on a ps task), MatMul, BiasAdd, Relu,
/// a residual Add and an Identity (with a control edge to the previous layer's Identity every 4th
/// layer). Towers of 100 layers, spread over 4 worker tasks. Exactly `NODES` nodes.
fn model_graph() -> GraphDef {
    const WIDTH: usize = 64;
    const LAYERS_PER_TOWER: usize = 100;
    let mut nodes: Vec<NodeDef> = Vec::with_capacity(NODES);
    let node = |name: String, op: &str, inputs: Vec<String>, device: String| NodeDef {
        name,
        op: op.into(),
        inputs,
        device,
        ..NodeDef::default()
    };
    let variable = |name: String, shape: &[usize], seed: i64, device: String| {
        let mut n = node(name, "Variable", vec![], device);
        n.attrs.insert("dtype".into(), DType::F32.into());
        n.attrs.insert("shape".into(), Shape::known(shape).into());
        n.attrs
            .insert("initializer".into(), "glorot_uniform".into());
        n.attrs.insert("seed".into(), seed.into());
        n
    };
    let (mut tower, mut layer) = (0usize, 0usize);
    let mut prev = String::new();
    let mut prev_id: Option<String> = None;
    while nodes.len() < NODES {
        let worker = format!("/job:worker/task:{}", tower % 4);
        let ps = format!("/job:ps/task:{}", tower % 2);
        if layer == 0 {
            let mut x = node(
                format!("tower{tower}/x"),
                "Placeholder",
                vec![],
                worker.clone(),
            );
            x.attrs.insert("dtype".into(), DType::F32.into());
            x.attrs.insert(
                "shape".into(),
                Shape::partial(vec![None, Some(WIDTH)]).into(),
            );
            prev = x.name.clone();
            prev_id = None;
            nodes.push(x);
        }
        let p = format!("tower{tower}/layer{layer}");
        let seed = i64::try_from(nodes.len()).unwrap_or(0);
        let block = [
            variable(format!("{p}/w"), &[WIDTH, WIDTH], seed, ps.clone()),
            variable(format!("{p}/b"), &[WIDTH], seed + 1, ps),
            node(
                format!("{p}/matmul"),
                "MatMul",
                vec![prev.clone(), format!("{p}/w")],
                worker.clone(),
            ),
            node(
                format!("{p}/bias"),
                "BiasAdd",
                vec![format!("{p}/matmul"), format!("{p}/b")],
                worker.clone(),
            ),
            node(
                format!("{p}/relu"),
                "Relu",
                vec![format!("{p}/bias")],
                worker.clone(),
            ),
            node(
                format!("{p}/residual"),
                "Add",
                vec![format!("{p}/relu"), prev.clone()],
                worker.clone(),
            ),
            node(
                format!("{p}/out"),
                "Identity",
                std::iter::once(format!("{p}/residual"))
                    .chain(
                        prev_id
                            .iter()
                            .filter(|_| layer % 4 == 3)
                            .map(|i| format!("^{i}")),
                    )
                    .collect(),
                worker,
            ),
        ];
        for n in block {
            if nodes.len() < NODES {
                nodes.push(n);
            }
        }
        prev = format!("{p}/out");
        prev_id = Some(prev.clone());
        layer += 1;
        if layer == LAYERS_PER_TOWER {
            (tower, layer) = (tower + 1, 0);
        }
    }
    // Each node only reads nodes pushed before it, so cutting mid-layer leaves a valid graph.
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

    let model = model_graph();
    let json = to_json(&model);
    let dsl = to_dsl(&model);
    let validated =
        |parsed: Option<GraphDef>| parsed.map(|d| Graph::from_def(&d).map(|g| g.num_nodes()));
    let n = model.nodes.len();
    assert_eq!(n, NODES);
    assert_eq!(
        validated(parse_json(&json, None).ok().map(|p| p.def)).map(|r| r.ok()),
        Some(Some(n))
    );
    assert_eq!(
        validated(parse_dsl(&dsl, None).ok().map(|p| p.def)).map(|r| r.ok()),
        Some(Some(n))
    );
    let mut group = c.benchmark_group("parse_validate_100k_model");
    group.sample_size(10);
    group.bench_function("json", |b| {
        b.iter(|| parse_json(&json, None).map(|p| Graph::from_def(&p.def)))
    });
    group.bench_function("dsl", |b| {
        b.iter(|| parse_dsl(&dsl, None).map(|p| Graph::from_def(&p.def)))
    });
    group.bench_function("validate_only", |b| b.iter(|| Graph::from_def(&model)));
    group.finish();
}

/// `x -> n0 -> n1 -> ...`: a Placeholder and `n` Relus, as JSON on one line.
fn one_line_chain(n: usize) -> String {
    let mut nodes = vec![NodeDef {
        name: "x".into(),
        op: "Placeholder".into(),
        ..NodeDef::default()
    }];
    nodes[0].attrs.insert("dtype".into(), DType::F32.into());
    for i in 0..n {
        nodes.push(NodeDef {
            name: format!("n{i}"),
            op: "Relu".into(),
            inputs: vec![if i == 0 {
                "x".into()
            } else {
                format!("n{}", i - 1)
            }],
            ..NodeDef::default()
        });
    }
    let g = GraphDef {
        version: 1,
        nodes,
        train: None,
    };
    // Newlines only separate tokens in `to_json`'s output (strings escape theirs).
    to_json(&g).replace('\n', "")
}

fn bench_one_line(c: &mut Criterion) {
    let mut group = c.benchmark_group("one_line_chain");
    group.sample_size(10);
    for n in [10_000, 40_000, 200_000] {
        let text = one_line_chain(n);
        assert_eq!(text.lines().count(), 1);
        group.bench_function(format!("parse_validate_{n}"), |b| {
            b.iter(|| parse_json(&text, None).map(|p| Graph::from_def(&p.def)))
        });
    }
    group.finish();
}

criterion_group!(benches, bench, bench_one_line);
criterion_main!(benches);
