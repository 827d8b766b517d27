//! CPU kernel benchmarks.
//!
//! - `matmul/f32/1024/threads=T`: the 1024×1024×1024 f32 MatMul kernel run inside a rayon pool of
//!   T threads (as the executor's compute pool runs it; the product is `gemm`, split over the
//!   pool). Throughput is in elements/s where one element is one flop, so `Gelem/s` reads as
//!   GFLOP/s. Peer: `OPENBLAS_NUM_THREADS=T python3 /work/shared/bench/numpy_matmul.py 1024 10`.
//! - `matmul/matrixmultiply_sgemm/1024`: the alternative measured against it, `matrixmultiply`
//!   with its `threading` feature (its own threads, `MATMUL_NUM_THREADS`, default 1).
//! - `matmul/gpt_*`: the GPT shapes [12·64, 128]·[128, 384] (c_attn) and [12·64, 128]·[128, 512]
//!   (c_fc) on 1 and 2 threads, and the attention BatchMatMul [12, 4, 64, 32]·[12, 4, 32, 64].
//! - `gemm_cutoff/n=N/{caller,pool}`: an N×N×N f32 product on the calling thread vs split over a
//!   2-thread pool, to place `ops::gemm::PARALLEL_MIN_FLOPS`.
//! - `scalar_add`: one scalar f32 `Add` kernel call (the executor's per-node floor).
//! - `alloc`: the two ways to build a small output tensor (`zeros` + `as_mut_slice` vs a `Vec`
//!   and `from_slice`).
//!
//! Run: `cargo bench -p dflow-graph --bench matmul` (a group: `-- matmul/f32`).

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use dflow_graph::kernel::{KernelContext, VariableCell};
use dflow_graph::ops::gemm::{self, MatView, Threads};
use dflow_graph::ops::testing::{attrs_with_defaults, build_kernel};
use dflow_graph::{AttrValue, DType, Tensor, TensorType};
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

fn rand_tensor(dims: &[usize], seed: u32) -> Tensor {
    Tensor::from_slice(dims, &random(dims.iter().product(), seed)).unwrap()
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// Benchmarks op `op`'s kernel on `inputs`, run inside `pool` when given.
#[allow(clippy::too_many_arguments)]
fn kernel_bench(
    c: &mut Criterion,
    group: &str,
    name: &str,
    op: &str,
    attrs: &[(&str, AttrValue)],
    inputs: Vec<Tensor>,
    flops: u64,
    pool: Option<&rayon::ThreadPool>,
) {
    let types: Vec<TensorType> = inputs
        .iter()
        .map(|t| TensorType::new(t.dtype(), t.shape()))
        .collect();
    let attrs = attrs_with_defaults(op, attrs).unwrap();
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
        let mut run = || {
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
        };
        match pool {
            Some(p) => p.install(|| b.iter(&mut run)),
            None => b.iter(run),
        }
    });
    g.finish();
}

fn matmul(c: &mut Criterion) {
    let n = 1024;
    let (a, b) = (rand_tensor(&[n, n], 1), rand_tensor(&[n, n], 2));
    for threads in [1, 2] {
        let p = pool(threads);
        kernel_bench(
            c,
            "matmul",
            &format!("f32/1024/threads={threads}"),
            "MatMul",
            &[],
            vec![a.clone(), b.clone()],
            2 * (n as u64).pow(3),
            Some(&p),
        );
    }
    // The alternative: matrixmultiply with its own threads (MATMUL_NUM_THREADS).
    let (av, bv) = (random(n * n, 1), random(n * n, 2));
    let mut out = vec![0.0f32; n * n];
    let mut g = c.benchmark_group("matmul");
    g.throughput(Throughput::Elements(2 * (n as u64).pow(3)));
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    g.bench_function("matrixmultiply_sgemm/1024", |bench| {
        bench.iter(|| {
            let s = n as isize;
            // SAFETY: `av`, `bv` and `out` each hold n·n f32s, read and written as n×n
            // row-major matrices (row stride n, column stride 1); `out` is a distinct buffer.
            unsafe {
                matrixmultiply::sgemm(
                    n,
                    n,
                    n,
                    1.0,
                    av.as_ptr(),
                    s,
                    1,
                    bv.as_ptr(),
                    s,
                    1,
                    0.0,
                    out.as_mut_ptr(),
                    s,
                    1,
                );
            }
            black_box(&out);
        })
    });
    g.finish();
}

fn gpt_shapes(c: &mut Criterion) {
    let x = rand_tensor(&[12 * 64, 128], 3);
    for (label, cols) in [("c_attn", 384usize), ("c_fc", 512)] {
        let w = rand_tensor(&[128, cols], 4);
        for threads in [1, 2] {
            let p = pool(threads);
            kernel_bench(
                c,
                "matmul",
                &format!("gpt_{label}_768x128x{cols}/threads={threads}"),
                "MatMul",
                &[],
                vec![x.clone(), w.clone()],
                2 * 768 * 128 * cols as u64,
                Some(&p),
            );
        }
    }
    let (q, k) = (
        rand_tensor(&[12, 4, 64, 32], 5),
        rand_tensor(&[12, 4, 32, 64], 6),
    );
    for threads in [1, 2] {
        let p = pool(threads);
        kernel_bench(
            c,
            "matmul",
            &format!("gpt_attention_bmm_12x4x64x32x64/threads={threads}"),
            "BatchMatMul",
            &[],
            vec![q.clone(), k.clone()],
            2 * 48 * 64 * 32 * 64,
            Some(&p),
        );
    }
}

fn gemm_cutoff(c: &mut Criterion) {
    let p = pool(2);
    let mut g = c.benchmark_group("gemm_cutoff");
    g.sample_size(30).measurement_time(Duration::from_secs(2));
    for n in [32usize, 48, 64, 96, 128] {
        let (a, b) = (random(n * n, 7), random(n * n, 8));
        let mut out = vec![0.0f32; n * n];
        g.throughput(Throughput::Elements(2 * (n as u64).pow(3)));
        for (label, threads) in [("caller", Threads::Caller), ("pool", Threads::PoolAlways)] {
            g.bench_function(format!("n={n}/{label}"), |bench| {
                p.install(|| {
                    bench.iter(|| {
                        gemm::matmul(
                            MatView::row_major(&a, 0, (n, n), false),
                            MatView::row_major(&b, 0, (n, n), false),
                            &mut out,
                            threads,
                        )
                        .unwrap();
                        black_box(&out);
                    })
                })
            });
        }
    }
    g.finish();
}

fn scalar_add(c: &mut Criterion) {
    let inputs = vec![Tensor::scalar(1.0f32), Tensor::scalar(2.0f32)];
    kernel_bench(c, "scalar_add", "f32", "Add", &[], inputs, 0, None);
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

criterion_group!(benches, matmul, gpt_shapes, gemm_cutoff, scalar_add, alloc);
criterion_main!(benches);
