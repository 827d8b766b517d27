//! The scheduler's shortcuts keep results exact: batched fan-outs and coalesced fan-ins, edges
//! deduplicated per producer, constants bound at compile time, per-step arrays reused.

use dflow_executor::{ExecError, Session, SessionOptions};
use dflow_graph::builder::GraphBuilder;
use dflow_graph::{ClusterSpec, DType, Tensor};
use std::time::{Duration, Instant};

fn one_worker() -> ClusterSpec {
    ClusterSpec::local(&[("worker", 1)]).unwrap()
}

fn vec_f64(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec()
}

/// 1,000 branches (more than a runner keeps, so they are shared out in chunks) all feed one
/// AddN (its pending count is decremented in coalesced batches): every branch's value arrives,
/// step after step, with nothing left over from the previous step.
#[test]
fn a_wide_fan_out_and_fan_in_sum_every_branch_every_step() {
    const BRANCHES: usize = 1000;
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F64, &[2]);
    let branches: Vec<_> = (0..BRANCHES)
        .map(|i| {
            let c = b.constant(
                &format!("c{i}"),
                Tensor::from_slice(&[2], &[i as f64, 1.0]).unwrap(),
            );
            b.binary("Add", &format!("add{i}"), &x, &c)
        })
        .collect();
    b.op("AddN", "sum").inputs(&branches).finish();
    let s = Session::new(b.build().unwrap(), one_worker(), SessionOptions::default()).unwrap();
    let sum_i = (BRANCHES * (BRANCHES - 1) / 2) as f64;
    for step in 0..5 {
        let x = Tensor::from_slice(&[2], &[step as f64, -1.0]).unwrap();
        let out = s.run(&[("x", x)], &["sum"], &[]).unwrap();
        let n = BRANCHES as f64;
        assert_eq!(
            vec_f64(&out[0]),
            [n * step as f64 + sum_i, 0.0],
            "step {step}"
        );
    }
}

/// `Add(y, y)`: one producer feeding both inputs is one edge to wait for, and both inputs see
/// its value.
#[test]
fn a_node_reading_one_producer_twice_sees_it_twice() {
    let mut b = GraphBuilder::new();
    let mut y = b.placeholder("x", DType::F64, &[]);
    for i in 0..30 {
        y = b.binary("Add", &format!("double{i}"), &y, &y);
    }
    b.unary("Identity", "out", &y);
    let s = Session::new(b.build().unwrap(), one_worker(), SessionOptions::default()).unwrap();
    for x in [1.0, 3.0] {
        let out = s.run(&[("x", Tensor::scalar(x))], &["out"], &[]).unwrap();
        assert_eq!(vec_f64(&out[0]), [x * (1u64 << 30) as f64]);
    }
}

/// Constants are evaluated once and bound each step: fetched directly, consumed locally, and
/// sent to another device.
#[test]
fn bound_constants_reach_local_and_remote_consumers_and_fetches() {
    let mut b = GraphBuilder::new();
    let c = b.with_device("/job:ps/task:0", |b| {
        b.constant("c", Tensor::from_slice(&[2], &[1.5f32, -2.0]).unwrap())
    });
    b.with_device("/job:ps/task:0", |b| b.unary("Neg", "neg_on_ps", &c));
    b.with_device("/job:worker/task:0", |b| {
        b.binary("Mul", "sq_on_worker", &c, &c)
    });
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap();
    let s = Session::new(b.build().unwrap(), cluster, SessionOptions::default()).unwrap();
    for _ in 0..3 {
        let out = s
            .run(&[], &["c", "neg_on_ps", "sq_on_worker"], &[])
            .unwrap();
        assert_eq!(vec_f64(&out[0]), [1.5, -2.0]);
        assert_eq!(vec_f64(&out[1]), [-1.5, 2.0]);
        assert_eq!(vec_f64(&out[2]), [2.25, 4.0]);
    }
}

/// Large MatMuls in parallel branches (expensive nodes, each handed to the pool on its own)
/// give the same results as one at a time.
#[test]
fn parallel_expensive_branches_are_exact() {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[64, 64]);
    let prods: Vec<_> = (0..6)
        .map(|i| {
            let w = b.constant(
                &format!("w{i}"),
                Tensor::from_slice(&[64, 64], &vec![(i + 1) as f32; 64 * 64]).unwrap(),
            );
            b.matmul(&format!("p{i}"), &x, &w)
        })
        .collect();
    b.op("AddN", "sum").inputs(&prods).finish();
    let s = Session::new(b.build().unwrap(), one_worker(), SessionOptions::default()).unwrap();
    let x = Tensor::from_slice(&[64, 64], &vec![0.5f32; 64 * 64]).unwrap();
    let out = s.run(&[("x", x)], &["sum"], &[]).unwrap();
    // Each product is 0.5 · 64 · (i + 1); their sum over i = 0..6 is 32 · 21.
    assert!(vec_f64(&out[0]).iter().all(|&v| v == 32.0 * 21.0));
}

/// One failing branch among many batched ones aborts the step with its own error, promptly;
/// the next step runs clean.
#[test]
fn a_failure_inside_a_batched_fan_out_aborts_the_step_and_the_session_recovers() {
    const BRANCHES: usize = 600;
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[-1]);
    let branches: Vec<_> = (0..BRANCHES)
        .map(|i| {
            let c = if i == 417 {
                b.constant("c_bad", Tensor::from_slice(&[2], &[1.0f32, 1.0]).unwrap())
            } else {
                b.constant(&format!("c{i}"), Tensor::scalar(1.0f32))
            };
            b.binary("Add", &format!("add{i}"), &x, &c)
        })
        .collect();
    b.op("AddN", "sum").inputs(&branches).finish();
    let opts = SessionOptions {
        step_timeout: Duration::from_secs(10),
        ..SessionOptions::default()
    };
    let s = Session::new(b.build().unwrap(), one_worker(), opts).unwrap();
    let started = Instant::now();
    let bad = Tensor::from_slice(&[3], &[0.0f32; 3]).unwrap();
    let err = s.run(&[("x", bad)], &["sum"], &[]).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5), "prompt abort");
    match &err {
        ExecError::Kernel { node, .. } => assert_eq!(node, "add417"),
        other => panic!("expected add417's error, got {other}"),
    }
    let good = Tensor::from_slice(&[2], &[1.0f32, 2.0]).unwrap();
    let out = s.run(&[("x", good)], &["sum"], &[]).unwrap();
    let n = BRANCHES as f64;
    assert_eq!(vec_f64(&out[0]), [2.0 * n, 3.0 * n]);
}
