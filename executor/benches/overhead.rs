//! Executor overhead: µs per node for a 10,000-node chain of scalar adds and for 10,000
//! independent scalar adds, one device, plan compiled once and reused each step. The plan binds
//! constants at compile time, so the chain's adds wait for one predecessor each; the third case,
//! the same chain with its addend fed each step, makes every add wait for two.
//!
//! `cargo bench -p dflow-executor --bench overhead`; compare with
//! `../shared/bench/tf_exec_overhead.py` run in the same session.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dflow_executor::{Session, SessionOptions};
use dflow_graph::builder::GraphBuilder;
use dflow_graph::{ClusterSpec, DType, Graph, Tensor};

const N: usize = 10_000;

/// The same allocator as the `dflow` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn chain() -> Graph {
    let mut b = GraphBuilder::new();
    let one = b.constant("one", Tensor::scalar(1.0f32));
    let mut prev = b.constant("start", Tensor::scalar(0.0f32));
    for i in 0..N {
        prev = b.binary("Add", &format!("add{i}"), &prev, &one);
    }
    b.unary("Identity", "out", &prev);
    b.build().expect("valid chain")
}

fn chain_fed() -> Graph {
    let mut b = GraphBuilder::new();
    let one = b.placeholder("one", DType::F32, &[]);
    let mut prev = b.constant("start", Tensor::scalar(0.0f32));
    for i in 0..N {
        prev = b.binary("Add", &format!("add{i}"), &prev, &one);
    }
    b.unary("Identity", "out", &prev);
    b.build().expect("valid chain")
}

fn independent() -> Graph {
    let mut b = GraphBuilder::new();
    let one = b.constant("one", Tensor::scalar(1.0f32));
    let mut deps = Vec::with_capacity(N);
    for i in 0..N {
        deps.push(b.binary("Add", &format!("add{i}"), &one, &one));
    }
    let mut done = b.op("NoOp", "done");
    for d in &deps {
        done = done.control_dep(d);
    }
    done.finish();
    b.build().expect("valid fan-out")
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("executor_overhead");
    group.sample_size(20);
    group.throughput(Throughput::Elements(N as u64));
    let cluster = ClusterSpec::local(&[("worker", 1)]).expect("cluster");
    let chain_session =
        Session::new(chain(), cluster.clone(), SessionOptions::default()).expect("session");
    chain_session.run(&[], &["out"], &[]).expect("warm-up");
    group.bench_function(BenchmarkId::new("chain_scalar_add", N), |b| {
        b.iter(|| chain_session.run(&[], &["out"], &[]).expect("step"))
    });
    let wide =
        Session::new(independent(), cluster.clone(), SessionOptions::default()).expect("session");
    wide.run(&[], &[], &["done"]).expect("warm-up");
    group.bench_function(BenchmarkId::new("independent_scalar_add", N), |b| {
        b.iter(|| wide.run(&[], &[], &["done"]).expect("step"))
    });
    let fed = Session::new(chain_fed(), cluster, SessionOptions::default()).expect("session");
    let feeds = [("one", Tensor::scalar(1.0f32))];
    fed.run(&feeds, &["out"], &[]).expect("warm-up");
    group.bench_function(BenchmarkId::new("chain_fed_scalar_add", N), |b| {
        b.iter(|| fed.run(&feeds, &["out"], &[]).expect("step"))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
