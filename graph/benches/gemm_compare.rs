//! Interleaved GEMM timings with the statistics `numpy_matmul.py` prints (median and minimum of
//! N runs), so a loaded machine can be compared run for run: the dflow `MatMul` kernel (the `gemm`
//! crate) on rayon pools of 1 and 2 threads, and `matrixmultiply` (threading feature; its thread
//! count comes from `MATMUL_NUM_THREADS`, read once per process), each call alternating with the
//! others.
//!
//! Run: `cargo bench -p dflow-graph --bench gemm_compare -- [N] [REPS]` (default 1024, 20), or
//! `-- M K N REPS` for an [M, K]·[K, N] product.
//! Peer: `OPENBLAS_NUM_THREADS=T python3 /work/shared/bench/numpy_matmul.py N REPS`.

use dflow_graph::kernel::KernelContext;
use dflow_graph::ops::testing::{attrs_with_defaults, build_kernel};
use dflow_graph::{Tensor, TensorType};
use std::time::Instant;

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

fn main() {
    // `cargo bench` passes `--bench`; the numbers are the positional arguments.
    let nums: Vec<usize> = std::env::args().filter_map(|a| a.parse().ok()).collect();
    let ((m, k, n), reps) = match nums[..] {
        [m, k, n, reps, ..] => ((m, k, n), reps),
        [n, reps] => ((n, n, n), reps),
        [n] => ((n, n, n), 20),
        _ => ((1024, 1024, 1024), 20),
    };
    let (av, bv) = (random(m * k, 1), random(k * n, 2));
    let a = Tensor::from_slice(&[m, k], &av).unwrap();
    let b = Tensor::from_slice(&[k, n], &bv).unwrap();
    let types = [
        TensorType::new(a.dtype(), a.shape()),
        TensorType::new(b.dtype(), b.shape()),
    ];
    let attrs = attrs_with_defaults("MatMul", &[]).unwrap();
    let kernel = build_kernel("MatMul", "bench", &attrs, &types).unwrap();
    let pools: Vec<rayon::ThreadPool> = [1, 2]
        .iter()
        .map(|&t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
        })
        .collect();
    let inputs = [&a, &b];
    let run_dflow = |pool: &rayon::ThreadPool| {
        pool.install(|| {
            let mut outputs = vec![None];
            let t = Instant::now();
            kernel
                .compute(&mut KernelContext {
                    node: "bench",
                    inputs: &inputs,
                    variables: &[],
                    step: 0,
                    outputs: &mut outputs,
                    collectives: None,
                    output_memory: None,
                })
                .unwrap();
            t.elapsed().as_secs_f64()
        })
    };
    let mut out = vec![0.0f32; m * n];
    let mut run_mm = || {
        let t = Instant::now();
        // SAFETY: `av` holds m·k f32s read as an m×k row-major matrix (strides k, 1), `bv` k·n
        // as k×n (n, 1), `out` m·n written as m×n (n, 1); `out` is a distinct buffer.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                av.as_ptr(),
                k as isize,
                1,
                bv.as_ptr(),
                n as isize,
                1,
                0.0,
                out.as_mut_ptr(),
                n as isize,
                1,
            );
        }
        t.elapsed().as_secs_f64()
    };
    // Warm-up.
    for _ in 0..2 {
        run_dflow(&pools[0]);
        run_dflow(&pools[1]);
        run_mm();
    }
    let mut times: [Vec<f64>; 3] = [vec![], vec![], vec![]];
    for _ in 0..reps {
        times[0].push(run_dflow(&pools[0]));
        times[1].push(run_dflow(&pools[1]));
        times[2].push(run_mm());
    }
    let mm_threads = std::env::var("MATMUL_NUM_THREADS").unwrap_or_else(|_| "1".into());
    let labels = [
        "dflow MatMul (gemm) threads=1".to_string(),
        "dflow MatMul (gemm) threads=2".to_string(),
        format!("matrixmultiply MATMUL_NUM_THREADS={mm_threads}"),
    ];
    for (label, t) in labels.iter().zip(&mut times) {
        t.sort_by(f64::total_cmp);
        let med = t[t.len() / 2];
        println!(
            "{label} [{m},{k}]x[{k},{n}] median_s={med:.5} min_s={:.5} max_s={:.5} GFLOP/s={:.1}",
            t[0],
            t[t.len() - 1],
            2.0 * (m * k * n) as f64 / med / 1e9
        );
    }
}
