//! The matrix product behind `MatMul` and `BatchMatMul` (f32 and f64): the `gemm` crate
//! (runtime-dispatched SIMD micro-kernels), run on the **current rayon pool** so a kernel called
//! from the executor's compute pool uses that pool's threads and no other.
//!
//! Products below [`PARALLEL_MIN_FLOPS`] run on the calling thread (splitting them costs more
//! than it saves; the cutoff was measured with `benches/matmul.rs`, see BENCHMARKS.md "MatMul
//! (GEMM)"); larger ones are split across the pool (`gemm`'s `Parallelism::Rayon`, which itself
//! keeps small blocks on one thread).
//!
//! Operands are described by [`MatView`]: a slice, an element offset and row/column strides, so
//! a transpose is a stride swap and a batch element an offset, never a copy. Every view is
//! checked against its slice before the product runs.

use gemm::Parallelism;

/// Products with fewer multiply-adds (`m·n·k`) than this run on the calling thread.
pub const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// The cutoff in effect: [`PARALLEL_MIN_FLOPS`], or the environment variable
/// `DFLOW_GEMM_PARALLEL_MIN_FLOPS` when it holds a number (read once; for tuning).
pub fn parallel_min_flops() -> usize {
    static CUTOFF: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CUTOFF.get_or_init(|| {
        std::env::var("DFLOW_GEMM_PARALLEL_MIN_FLOPS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(PARALLEL_MIN_FLOPS)
    })
}

/// Element types the GEMM supports.
pub trait GemmScalar: Copy + Send + Sync + 'static {
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
}

impl GemmScalar for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

impl GemmScalar for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

/// A `rows × cols` matrix inside a slice: element `(i, j)` is `data[offset + i·rs + j·cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatView<'a, T> {
    /// The backing elements.
    pub data: &'a [T],
    /// Index of element (0, 0).
    pub offset: usize,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Row stride (elements).
    pub rs: usize,
    /// Column stride (elements).
    pub cs: usize,
}

impl<'a, T> MatView<'a, T> {
    /// A row-major `rows × cols` matrix starting at `offset`, transposed (a stride swap) when
    /// `transpose` is set, so the view is `cols × rows`.
    pub fn row_major(
        data: &'a [T],
        offset: usize,
        (rows, cols): (usize, usize),
        transpose: bool,
    ) -> Self {
        let v = MatView {
            data,
            offset,
            rows,
            cols,
            rs: cols,
            cs: 1,
        };
        if transpose {
            v.t()
        } else {
            v
        }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        MatView {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Whether every element of the view lies inside `data`.
    fn in_bounds(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return self.offset <= self.data.len();
        }
        let last = (self.rows - 1)
            .checked_mul(self.rs)
            .and_then(|r| (self.cols - 1).checked_mul(self.cs)?.checked_add(r))
            .and_then(|x| x.checked_add(self.offset));
        last.is_some_and(|l| l < self.data.len())
            && isize::try_from(self.rs).is_ok()
            && isize::try_from(self.cs).is_ok()
    }
}

/// Whether a product may use more than the calling thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Threads {
    /// Split large products over the current rayon pool.
    Pool,
    /// Always on the calling thread (e.g. inside a parallel loop over batch elements).
    Caller,
    /// Split over the current rayon pool whatever the size (benchmarks measure the
    /// [`PARALLEL_MIN_FLOPS`] cutoff with it).
    PoolAlways,
}

/// `out = a · b` (`out` row-major `m × n`, contiguous, overwritten; old contents ignored).
pub fn matmul<T: GemmScalar>(
    a: MatView<'_, T>,
    b: MatView<'_, T>,
    out: &mut [T],
    threads: Threads,
) -> Result<(), String> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k || m.checked_mul(n) != Some(out.len()) || !a.in_bounds() || !b.in_bounds() {
        return Err(format!(
            "GEMM: operands do not fit: a is {}x{} (offset {}, {} elements), b is {}x{} (offset {}, \
             {} elements), out has {} elements",
            a.rows,
            a.cols,
            a.offset,
            a.data.len(),
            b.rows,
            b.cols,
            b.offset,
            b.data.len(),
            out.len()
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        out.fill(T::ZERO);
        return Ok(());
    }
    let flops = m.saturating_mul(n).saturating_mul(k);
    let split = match threads {
        Threads::Pool => flops >= parallel_min_flops(),
        Threads::PoolAlways => true,
        Threads::Caller => false,
    };
    let parallelism = if split && rayon::current_num_threads() > 1 {
        // 0: as many threads as the current pool has.
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    // The strides fit in isize (checked by `in_bounds`); `n` does since `out` has m·n elements.
    let (ars, acs, brs, bcs) = (a.rs as isize, a.cs as isize, b.rs as isize, b.cs as isize);
    // SAFETY: `in_bounds` checked that every element (i, j) of `a` (i < m, j < k) and of `b`
    // (i < k, j < n) lies inside its slice, and `out` holds exactly m·n elements written at
    // row stride n, column stride 1. `out` is a unique borrow, so it aliases neither input.
    // With `read_dst = false` the destination is only written. T is f32 or f64 (GemmScalar),
    // types `gemm` supports (it panics on others).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.data.as_ptr().add(a.offset),
            acs,
            ars,
            b.data.as_ptr().add(b.offset),
            bcs,
            brs,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &MatView<'_, f64>, b: &MatView<'_, f64>) -> Vec<f64> {
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                let mut s = 0.0;
                for p in 0..a.cols {
                    s += a.data[a.offset + i * a.rs + p * a.cs]
                        * b.data[b.offset + p * b.rs + j * b.cs];
                }
                out[i * b.cols + j] = s;
            }
        }
        out
    }

    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64) - 0.5
            })
            .collect()
    }

    #[test]
    fn strided_views_match_the_naive_product() {
        // Small and large (parallel) sizes, every transpose combination, offsets.
        for &(m, k, n) in &[(1, 1, 1), (3, 5, 2), (17, 9, 33), (70, 80, 90)] {
            for ta in [false, true] {
                for tb in [false, true] {
                    let av = values(m * k + 3, 1);
                    let bv = values(k * n + 5, 2);
                    let a_dims = if ta { (k, m) } else { (m, k) };
                    let b_dims = if tb { (n, k) } else { (k, n) };
                    let a = MatView::row_major(&av, 3, a_dims, ta);
                    let b = MatView::row_major(&bv, 5, b_dims, tb);
                    let want = naive(&a, &b);
                    for threads in [Threads::Pool, Threads::Caller, Threads::PoolAlways] {
                        let mut out = vec![f64::NAN; m * n];
                        matmul(a, b, &mut out, threads).unwrap();
                        for (g, w) in out.iter().zip(&want) {
                            assert!((g - w).abs() < 1e-12, "{m}x{k}x{n} {ta} {tb}: {g} vs {w}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn empty_inner_dimension_zeroes_the_output() {
        let (a, b) = (vec![0.0f32; 0], vec![0.0f32; 0]);
        let mut out = vec![7.0f32; 6];
        matmul(
            MatView::row_major(&a, 0, (2, 0), false),
            MatView::row_major(&b, 0, (0, 3), false),
            &mut out,
            Threads::Pool,
        )
        .unwrap();
        assert_eq!(out, vec![0.0; 6]);
    }

    #[test]
    fn out_of_bounds_views_are_errors_not_reads() {
        let a = vec![1.0f32; 6];
        let b = vec![1.0f32; 6];
        let mut out = vec![0.0f32; 4];
        // a claims 2x3 starting at offset 1: its last element would be index 6.
        let e = matmul(
            MatView::row_major(&a, 1, (2, 3), false),
            MatView::row_major(&b, 0, (3, 2), false),
            &mut out,
            Threads::Caller,
        )
        .unwrap_err();
        assert!(e.contains("do not fit"), "{e}");
        let e = matmul(
            MatView::row_major(&a, 0, (2, 3), false),
            MatView::row_major(&b, 0, (3, 2), false),
            &mut out[..3],
            Threads::Caller,
        )
        .unwrap_err();
        assert!(e.contains("out has 3"), "{e}");
    }
}
