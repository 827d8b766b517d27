//! CPU kernel benchmarks.
//!
//! - `matmul/f32/1024`: 1024×1024 f32 MatMul kernel, single-threaded (matrixmultiply through
//!   ndarray; its threading feature is off). Throughput is reported in elements/s where one
//!   element is one flop, so `Gelem/s` reads as GFLOP/s. Peer figure:
//!   `OPENBLAS_NUM_THREADS=1 python3 /work/shared/bench/numpy_matmul.py 1024 10`.
//! - `scalar_add`: one scalar f32 `Add` kernel call (the executor's per-node floor).
//! - `alloc`: the two ways to build a small output tensor (`zeros` + `as_mut_slice` vs a `Vec`
//!   and `from_slice`).
//!
//! Run: `cargo bench -p dflow-graph --bench matmul`.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use dflow_graph::kernel::{KernelContext, VariableCell};
use dflow_graph::ops::testing::{attrs_with_defaults, build_kernel};
use dflow_graph::{DType, Tensor, TensorType};
use std::time::Duration;

/// The allocator the `dflow` binary uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn random(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32) - 0.5
        })
        .collect()
}

fn kernel_bench(
    c: &mut Criterion,
    group: &str,
    name: &str,
    op: &str,
    inputs: Vec<Tensor>,
    flops: u64,
) {
    let types: Vec<TensorType> = inputs
        .iter()
        .map(|t| TensorType::new(t.dtype(), t.shape()))
        .collect();
    let attrs = attrs_with_defaults(op, &[]).unwrap();
    let kernel = build_kernel(op, "bench", &attrs, &types).unwrap();
    let cell = [std::sync::Arc::new(VariableCell::default())];
    let mut g = c.benchmark_group(group);
    if flops > 0 {
        g.throughput(Throughput::Elements(flops));
        g.sample_size(20).measurement_time(Duration::from_secs(4));
    }
    g.bench_function(name, |b| {
        let mut outputs = vec![None];
        let inputs: Vec<&Tensor> = inputs.iter().collect();
        b.iter(|| {
            let mut ctx = KernelContext {
                node: "bench",
                inputs: &inputs,
                variables: &cell,
                step: 0,
                outputs: &mut outputs,
                collectives: None,
                output_memory: None,
            };
            kernel.compute(&mut ctx).unwrap();
            black_box(&outputs);
        })
    });
    g.finish();
}

fn matmul(c: &mut Criterion) {
    let n = 1024;
    let a = Tensor::from_slice(&[n, n], &random(n * n, 1)).unwrap();
    let b = Tensor::from_slice(&[n, n], &random(n * n, 2)).unwrap();
    kernel_bench(
        c,
        "matmul",
        "f32/1024",
        "MatMul",
        vec![a, b],
        2 * (n as u64).pow(3),
    );
}

fn scalar_add(c: &mut Criterion) {
    let inputs = vec![Tensor::scalar(1.0f32), Tensor::scalar(2.0f32)];
    kernel_bench(c, "scalar_add", "f32", "Add", inputs, 0);
}

fn alloc(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc");
    for n in [1usize, 1024] {
        g.bench_function(format!("zeros_then_fill/{n}"), |b| {
            b.iter(|| {
                let mut t = Tensor::zeros(DType::F32, &[n]).unwrap();
                t.as_mut_slice::<f32>().unwrap().fill(black_box(1.0));
                t
            })
        });
        g.bench_function(format!("vec_then_from_slice/{n}"), |b| {
            b.iter(|| {
                let v = vec![black_box(1.0f32); n];
                Tensor::from_slice(&[n], &v).unwrap()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, matmul, scalar_add, alloc);
criterion_main!(benches);
