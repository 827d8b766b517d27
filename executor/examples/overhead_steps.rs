//! Runs the executor-overhead graphs of `benches/overhead.rs` for a fixed number of steps, for
//! profilers (`perf record`, `valgrind --tool=callgrind`) that want a plain loop, not criterion.
//!
//! `cargo run --release -p dflow-executor --example overhead_steps -- chain|fanout|chainfed|both|all [STEPS]
//! [N] [THREADS]` prints the median µs per node over the steps (THREADS 0: one per core).

use dflow_executor::{Session, SessionOptions};
use dflow_graph::builder::GraphBuilder;
use dflow_graph::{ClusterSpec, DType, Graph, Tensor};
use std::time::Instant;

/// The same allocator as the `dflow` binary and the bench.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn chain(n: usize) -> Graph {
    let mut b = GraphBuilder::new();
    let one = b.constant("one", Tensor::scalar(1.0f32));
    let mut prev = b.constant("start", Tensor::scalar(0.0f32));
    for i in 0..n {
        prev = b.binary("Add", &format!("add{i}"), &prev, &one);
    }
    b.unary("Identity", "out", &prev);
    b.build().expect("valid chain")
}

/// The chain with its addend fed at each step (a Recv, not a constant): every add waits for two
/// predecessors.
fn chain_fed(n: usize) -> Graph {
    let mut b = GraphBuilder::new();
    let one = b.placeholder("one", DType::F32, &[]);
    let mut prev = b.constant("start", Tensor::scalar(0.0f32));
    for i in 0..n {
        prev = b.binary("Add", &format!("add{i}"), &prev, &one);
    }
    b.unary("Identity", "out", &prev);
    b.build().expect("valid chain")
}

fn independent(n: usize) -> Graph {
    let mut b = GraphBuilder::new();
    let one = b.constant("one", Tensor::scalar(1.0f32));
    let mut deps = Vec::with_capacity(n);
    for i in 0..n {
        deps.push(b.binary("Add", &format!("add{i}"), &one, &one));
    }
    let mut done = b.op("NoOp", "done");
    for d in &deps {
        done = done.control_dep(d);
    }
    done.finish();
    b.build().expect("valid fan-out")
}

fn run(
    name: &str,
    graph: Graph,
    (feeds, fetches, targets): (&[(&str, Tensor)], &[&str], &[&str]),
    steps: usize,
    n: usize,
    threads: usize,
) {
    let cluster = ClusterSpec::local(&[("worker", 1)]).expect("cluster");
    let opts = SessionOptions {
        num_threads: threads,
        ..SessionOptions::default()
    };
    let s = Session::new(graph, cluster, opts).expect("session");
    s.run(feeds, fetches, targets).expect("warm-up");
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t0 = Instant::now();
        let out = s.run(feeds, fetches, targets).expect("step");
        times.push(t0.elapsed().as_secs_f64());
        if let Some(t) = out.first() {
            assert_eq!(t.as_slice::<f32>().expect("f32"), &[n as f32]);
        }
    }
    times.sort_by(f64::total_cmp);
    let med = times[times.len() / 2];
    println!(
        "{name}: median {:.3} ms/step, {:.4} µs/node",
        med * 1e3,
        med * 1e6 / n as f64
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let which = args.get(1).map(String::as_str).unwrap_or("both");
    let steps = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(100);
    let n = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let threads = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(0);
    if which == "chain" || which == "both" || which == "all" {
        run("chain", chain(n), (&[], &["out"], &[]), steps, n, threads);
    }
    if which == "fanout" || which == "both" || which == "all" {
        run(
            "fanout",
            independent(n),
            (&[], &[], &["done"]),
            steps,
            n,
            threads,
        );
    }
    if which == "chainfed" || which == "all" {
        let feeds = [("one", Tensor::scalar(1.0f32))];
        run(
            "chainfed",
            chain_fed(n),
            (&feeds, &["out"], &[]),
            steps,
            n,
            threads,
        );
    }
}
