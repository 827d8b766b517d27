//! End-to-end runs of the local session: the same graph partitioned over 1, 2 and 3 devices,
//! zero-copy hand-over between partitions, aborts and timeouts.

use dflow_executor::{ExecError, Session, SessionOptions};
use dflow_graph::builder::GraphBuilder;
use dflow_graph::{ClusterSpec, DType, Graph, GraphDef, Tensor};
use std::time::{Duration, Instant};

fn examples() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn load(path: &str) -> GraphDef {
    dflow_graph::load_file(&examples().join(path)).unwrap().def
}

/// Moves every node to `device` (single-device placement of the same graph).
fn on_one_device(mut def: GraphDef, device: &str) -> Graph {
    for n in &mut def.nodes {
        n.device = device.to_string();
    }
    Graph::from_def(&def).unwrap()
}

fn digits_batch(n: usize) -> (Tensor, Tensor) {
    // Deterministic pseudo-pixels in 0..16 and labels in 0..10.
    let x: Vec<f32> = (0..n * 64)
        .map(|i| ((i * 7919) % 17) as f32 / 16.0)
        .collect();
    let y: Vec<i64> = (0..n).map(|i| (i * 3 % 10) as i64).collect();
    (
        Tensor::from_slice(&[n, 64], &x).unwrap(),
        Tensor::from_slice(&[n], &y).unwrap(),
    )
}

fn run_mlp(graph: Graph, cluster: ClusterSpec) -> Vec<Tensor> {
    let s = Session::new(graph, cluster, SessionOptions::default()).unwrap();
    let (x, y) = digits_batch(16);
    s.run(
        &[("x", x), ("labels", y)],
        &["logits", "loss", "accuracy", "probs"],
        &[],
    )
    .unwrap()
}

#[test]
fn mlp_forward_is_bit_identical_on_one_two_and_three_devices() {
    let def = load("mlp/mlp.json");
    let one = run_mlp(
        on_one_device(def.clone(), "/job:worker/task:0"),
        ClusterSpec::local(&[("worker", 1)]).unwrap(),
    );
    let two = run_mlp(
        Graph::from_def(&def).unwrap(),
        ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap(),
    );
    // Three devices: variables spread over two ps tasks, compute on the worker.
    let mut three_def = def.clone();
    for n in &mut three_def.nodes {
        if n.name == "w2" || n.name == "b2" {
            n.device = "/job:ps/task:1".into();
        }
    }
    let three = run_mlp(
        Graph::from_def(&three_def).unwrap(),
        ClusterSpec::local(&[("ps", 2), ("worker", 1)]).unwrap(),
    );
    assert_eq!(one[0].dims(), &[16, 10]);
    for (i, name) in ["logits", "loss", "accuracy", "probs"].iter().enumerate() {
        assert_eq!(one[i], two[i], "{name}: 1 vs 2 devices");
        assert_eq!(one[i], three[i], "{name}: 1 vs 3 devices");
    }
    let probs = one[3].as_slice::<f32>().unwrap();
    let row: f32 = probs[..10].iter().sum();
    assert!((row - 1.0).abs() < 1e-5, "softmax rows sum to 1, got {row}");
}

#[test]
fn three_device_towers_match_single_device() {
    let def = load("three_devices/towers.json");
    let x = Tensor::from_slice(
        &[8, 16],
        &(0..128)
            .map(|i| (i as f32 - 64.0) / 50.0)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let cluster3 = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
    let s3 = Session::new(
        Graph::from_def(&def).unwrap(),
        cluster3,
        SessionOptions::default(),
    )
    .unwrap();
    let parts = s3.partitions(&["x"], &["out"], &["done"]).unwrap();
    assert_eq!(
        parts.partitions.len(),
        3,
        "ps, worker 0 and worker 1 each get a partition"
    );
    let three = s3.run(&[("x", x.clone())], &["out"], &["done"]).unwrap();
    let s1 = Session::new(
        on_one_device(def, "/job:worker/task:0"),
        ClusterSpec::local(&[("worker", 1)]).unwrap(),
        SessionOptions::default(),
    )
    .unwrap();
    let one = s1.run(&[("x", x)], &["out"], &["done"]).unwrap();
    assert_eq!(one, three);
    assert_eq!(one[0].dims(), &[8]);
}

#[test]
fn tensors_cross_partitions_without_copying_bytes() {
    let mut b = GraphBuilder::new();
    let w = b.with_device("/job:ps/task:0", |b| {
        b.variable("w", DType::F32, &[256, 256], "glorot_uniform")
    });
    b.with_device("/job:worker/task:0", |b| {
        b.unary("Identity", "w_on_worker", &w)
    });
    let s = Session::new(
        b.build().unwrap(),
        ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap(),
        SessionOptions::default(),
    )
    .unwrap();
    s.run(&[], &["w"], &[]).unwrap(); // initializes the variable
    let copies = dflow_graph::tensor::buffer_copies();
    let out = s.run(&[], &["w", "w_on_worker"], &[]).unwrap();
    assert_eq!(
        out[0].data_ptr(),
        out[1].data_ptr(),
        "the worker's tensor is the ps variable's buffer, handed over by the local rendezvous"
    );
    assert_eq!(
        dflow_graph::tensor::buffer_copies(),
        copies,
        "no copy-on-write copies"
    );
}

#[test]
fn kernel_failure_aborts_every_device_and_the_session_recovers() {
    // x [?, 3] @ w [3, 2] on the worker; a ps-side consumer waits on the product.
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[-1, -1]);
    let w = b.with_device("/job:ps/task:0", |b| {
        b.variable("w", DType::F32, &[3, 2], "ones")
    });
    let p = b.with_device("/job:worker/task:0", |b| b.matmul("product", &x, &w));
    b.with_device("/job:ps/task:0", |b| b.unary("Neg", "back_on_ps", &p));
    let s = Session::new(
        b.build().unwrap(),
        ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap(),
        SessionOptions {
            step_timeout: Duration::from_secs(10),
            ..SessionOptions::default()
        },
    )
    .unwrap();
    let bad = Tensor::from_slice(&[1, 4], &[1.0f32; 4]).unwrap();
    let started = Instant::now();
    let err = s.run(&[("x", bad)], &["back_on_ps"], &[]).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "abort is prompt, not a timeout"
    );
    match &err {
        ExecError::Kernel {
            node,
            device,
            error,
            ..
        } => {
            assert_eq!(node, "product");
            assert!(device.contains("/job:worker"), "{device}");
            // A shape the op checks itself: described, not one of the structured cases.
            let dflow_graph::OpError::Invalid(message) = &**error else {
                panic!("expected the MatMul's shape message, got {error:?}");
            };
            assert!(
                message.contains("[1, 4]") && message.contains("[3, 2]"),
                "{message}"
            );
        }
        other => panic!("expected the MatMul's error, got {other}"),
    }
    let good = Tensor::from_slice(&[1, 3], &[1.0f32, 2.0, 3.0]).unwrap();
    let out = s.run(&[("x", good)], &["back_on_ps"], &[]).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[-6.0, -6.0]);
}

#[test]
fn variables_persist_across_steps_and_can_be_assigned() {
    let mut b = GraphBuilder::new();
    let w = b.with_device("/job:ps/task:0", |b| {
        b.variable("w", DType::F32, &[2], "zeros")
    });
    b.with_device("/job:worker/task:0", |b| b.unary("Neg", "neg_w", &w));
    let s = Session::new(
        b.build().unwrap(),
        ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap(),
        SessionOptions::default(),
    )
    .unwrap();
    assert_eq!(
        s.run(&[], &["neg_w"], &[]).unwrap()[0]
            .as_slice::<f32>()
            .unwrap(),
        &[0.0, 0.0]
    );
    s.assign_variable("w", Tensor::from_slice(&[2], &[1.5f32, -2.0]).unwrap())
        .unwrap();
    assert_eq!(
        s.run(&[], &["neg_w"], &[]).unwrap()[0]
            .as_slice::<f32>()
            .unwrap(),
        &[-1.5, 2.0]
    );
    assert!(
        s.assign_variable("w", Tensor::scalar(1.0f32)).is_err(),
        "shape is checked"
    );
    assert!(
        s.assign_variable("neg_w", Tensor::scalar(1.0f32)).is_err(),
        "only variables"
    );
    let vars = s.variables();
    assert_eq!(vars.len(), 1);
    assert_eq!(vars[0].1, "w");
}

#[test]
fn bad_feeds_and_fetches_are_named() {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[2]);
    b.unary("Neg", "y", &x);
    let s = Session::new(
        b.build().unwrap(),
        ClusterSpec::local(&[("worker", 1)]).unwrap(),
        SessionOptions::default(),
    )
    .unwrap();
    let e = s
        .run(&[("x", Tensor::scalar(1i32))], &["y"], &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("feed `x`") && e.contains("dtype"), "{e}");
    let e = s
        .run(
            &[("x", Tensor::from_slice(&[3], &[1.0f32; 3]).unwrap())],
            &["y"],
            &[],
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("feed `x`") && e.contains("shape"), "{e}");
    let e = s.run(&[], &["nope"], &[]).unwrap_err().to_string();
    assert!(e.contains("nope"), "{e}");
}
