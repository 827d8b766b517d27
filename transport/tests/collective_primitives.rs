//! Every collective at 1..=5 ranks, in-process, over TCP on 127.0.0.1 and over shared memory,
//! for sizes 0, 1, odd and large, every dtype and reduce op, against a reference computed here
//! from the same inputs. One test body ([`run_rank`]) is instantiated per backend and rank count.

use dflow_transport::collective::{
    block_range, loopback_group, shm_group, Algorithm, CommOptions, Communicator, InProcPairs,
    LinkError, Pairs, ReduceOp, Scalar, ShmOptions, TcpOptions,
};
use half::bf16;
use std::io::IoSlice;
use std::time::Duration;

/// Elements per rank of the "large" case; with 16 KiB chunks it spans many pipelined chunks.
const LARGE: usize = 30_011;
const SIZES: [usize; 4] = [0, 1, 7, LARGE];

/// Test-side view of an element type: inputs, an independent reference, a tolerance.
trait Elem: Scalar + PartialEq {
    fn make(rank: usize, i: usize, salt: usize) -> Self;
    fn to_f64(self) -> f64;
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self;
    fn avg(sum: Self, n: usize) -> Self;
    fn tol() -> f64;
}

fn val(rank: usize, i: usize, salt: usize) -> f64 {
    // Small multiples of 0.5 in [-4, 4], never 0: float sums are exact in any order.
    let x = (rank * 7 + i * 13 + salt * 5) % 16;
    (x as f64 - 7.5) / 2.0 + if x < 8 { -0.25 } else { 0.25 }
}

macro_rules! float_elem {
    ($t:ty, $tol:expr) => {
        impl Elem for $t {
            fn make(rank: usize, i: usize, salt: usize) -> Self {
                val(rank, i, salt) as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Prod => a * b,
                    ReduceOp::Min => {
                        if b < a {
                            b
                        } else {
                            a
                        }
                    }
                    ReduceOp::Max => {
                        if b > a {
                            b
                        } else {
                            a
                        }
                    }
                }
            }
            fn avg(sum: Self, n: usize) -> Self {
                sum / n as $t
            }
            fn tol() -> f64 {
                $tol
            }
        }
    };
}
float_elem!(f32, 1e-5);
float_elem!(f64, 1e-12);

macro_rules! int_elem {
    ($t:ty) => {
        impl Elem for $t {
            fn make(rank: usize, i: usize, salt: usize) -> Self {
                // Large values so sums and products wrap.
                ((rank as i64 + 3) * 1_000_003 * (i as i64 % 97 + 1) * (salt as i64 + 1) - 500_000)
                    as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn avg(sum: Self, n: usize) -> Self {
                sum.wrapping_div(n as $t)
            }
            fn tol() -> f64 {
                0.0
            }
        }
    };
}
int_elem!(i32);
int_elem!(i64);

impl Elem for bf16 {
    fn make(rank: usize, i: usize, salt: usize) -> Self {
        bf16::from_f64(val(rank, i, salt))
    }
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
        bf16::from_f64(f64::combine(a.to_f64(), b.to_f64(), op))
    }
    fn avg(sum: Self, n: usize) -> Self {
        bf16::from_f64(sum.to_f64() / n as f64)
    }
    fn tol() -> f64 {
        // Products of five values lose bits in bf16, rounded at each step.
        3e-2
    }
}

fn input<T: Elem>(rank: usize, len: usize, salt: usize) -> Vec<T> {
    (0..len).map(|i| T::make(rank, i, salt)).collect()
}

fn reference<T: Elem>(n: usize, len: usize, salt: usize, op: ReduceOp) -> Vec<T> {
    let mut acc = input::<T>(0, len, salt);
    for r in 1..n {
        for (a, b) in acc.iter_mut().zip(input::<T>(r, len, salt)) {
            *a = T::combine(*a, b, op);
        }
    }
    if op == ReduceOp::Avg {
        acc.iter_mut().for_each(|a| *a = T::avg(*a, n));
    }
    acc
}

fn assert_close<T: Elem>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if T::tol() == 0.0 {
            assert!(g == w, "{what}: element {i}: got {g:?}, want {w:?}");
        } else {
            let (g, w) = (g.to_f64(), w.to_f64());
            assert!(
                (g - w).abs() <= T::tol() * w.abs().max(1.0),
                "{what}: element {i}: got {g}, want {w}"
            );
        }
    }
}

/// Every collective for one dtype on one rank.
fn run_dtype<T: Elem>(c: &Communicator, salt0: usize) {
    let (n, r) = (c.size(), c.rank());
    let name = std::any::type_name::<T>();
    for (si, &len) in SIZES.iter().enumerate() {
        let algos = if len == LARGE {
            [Algorithm::Auto, Algorithm::Tree]
        } else {
            [Algorithm::Auto, Algorithm::Ring]
        };
        for (ai, &algo) in algos.iter().enumerate() {
            let mut o = c.options().clone();
            o.algorithm = algo;
            let c = c.with_options(o);
            let salt = salt0 + si * 10 + ai;
            let root = (salt + si) % n;
            let ctx = |what: &str| format!("{what} {name} n={n} rank={r} len={len} {algo:?}");
            for op in ReduceOp::ALL {
                let mut buf = input::<T>(r, len, salt);
                c.all_reduce(&mut buf, op)
                    .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_reduce")));
                assert_close(
                    &buf,
                    &reference::<T>(n, len, salt, op),
                    &ctx(&format!("all_reduce {op}")),
                );

                let mut buf = input::<T>(r, len, salt);
                c.reduce(&mut buf, op, root)
                    .unwrap_or_else(|e| panic!("{}: {e}", ctx("reduce")));
                let want = if r == root {
                    reference::<T>(n, len, salt, op)
                } else {
                    input::<T>(r, len, salt)
                };
                assert_close(&buf, &want, &ctx(&format!("reduce {op} root {root}")));

                let send = input::<T>(r, len, salt);
                let own = block_range(len, n, r);
                let mut recv = vec![T::zeroed(); own.len()];
                c.reduce_scatter(&send, &mut recv, op)
                    .unwrap_or_else(|e| panic!("{}: {e}", ctx("reduce_scatter")));
                assert_close(
                    &recv,
                    &reference::<T>(n, len, salt, op)[own],
                    &ctx(&format!("reduce_scatter {op}")),
                );
            }

            let mut buf = if r == root {
                input::<T>(r, len, salt)
            } else {
                vec![T::zeroed(); len]
            };
            c.broadcast(&mut buf, root)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("broadcast")));
            assert_close(&buf, &input::<T>(root, len, salt), &ctx("broadcast"));

            let all: Vec<Vec<T>> = (0..n).map(|q| input::<T>(q, len, salt)).collect();
            let mut recv = vec![T::zeroed(); n * len];
            c.all_gather(&all[r], &mut recv)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_gather")));
            assert_close(&recv, &all.concat(), &ctx("all_gather"));

            let mut recv = if r == root {
                vec![T::zeroed(); n * len]
            } else {
                Vec::new()
            };
            c.gather(&all[r], &mut recv, root)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("gather")));
            if r == root {
                assert_close(&recv, &all.concat(), &ctx("gather"));
            }

            let send = if r == root { all.concat() } else { Vec::new() };
            let mut recv = vec![T::zeroed(); len];
            c.scatter(&send, &mut recv, root)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("scatter")));
            assert_close(&recv, &all[r], &ctx("scatter"));

            // all_to_all: rank q's send is n blocks of `len`; block j goes to rank j.
            let sends: Vec<Vec<T>> = (0..n).map(|q| input::<T>(q, n * len, salt + 1)).collect();
            let mut recv = vec![T::zeroed(); n * len];
            c.all_to_all(&sends[r], &mut recv)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx("all_to_all")));
            let want: Vec<T> = (0..n)
                .flat_map(|q| sends[q][r * len..(r + 1) * len].to_vec())
                .collect();
            assert_close(&recv, &want, &ctx("all_to_all"));
        }
    }
    c.barrier().unwrap();
}

fn run_rank(c: Communicator) {
    run_dtype::<f32>(&c, 1);
    run_dtype::<f64>(&c, 2);
    run_dtype::<i32>(&c, 3);
    run_dtype::<i64>(&c, 4);
    run_dtype::<bf16>(&c, 5);
}

fn opts() -> CommOptions {
    CommOptions {
        timeout: Duration::from_secs(60),
        chunk_bytes: 16 << 10,
        ..CommOptions::default()
    }
}

fn run_all(comms: Vec<Communicator>) {
    std::thread::scope(|s| {
        let joins: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || run_rank(c)))
            .collect();
        for j in joins {
            if let Err(p) = j.join() {
                std::panic::resume_unwind(p);
            }
        }
    });
}

fn in_process(n: usize) {
    run_all(Communicator::in_process(n, opts()));
}

fn tcp(n: usize) {
    let pairs = loopback_group(n, &TcpOptions::default()).unwrap();
    run_all(
        pairs
            .into_iter()
            .map(|p| Communicator::new(Box::new(p), opts()))
            .collect(),
    );
}

fn shm(n: usize) {
    // Small rings, so that the large case wraps them and fills them many times.
    let shm_opts = ShmOptions {
        ring_bytes: 64 << 10,
        ..ShmOptions::default()
    };
    let pairs = shm_group(n, &shm_opts).unwrap();
    run_all(
        pairs
            .into_iter()
            .map(|p| Communicator::new(Box::new(p), opts()))
            .collect(),
    );
}

/// One test per rank count for a backend function.
macro_rules! per_rank_count {
    ($backend:ident) => {
        mod $backend {
            #[test]
            fn rank_1() {
                super::$backend(1);
            }
            #[test]
            fn ranks_2() {
                super::$backend(2);
            }
            #[test]
            fn ranks_3() {
                super::$backend(3);
            }
            #[test]
            fn ranks_4() {
                super::$backend(4);
            }
            #[test]
            fn ranks_5() {
                super::$backend(5);
            }
        }
    };
}

per_rank_count!(in_process);
per_rank_count!(tcp);
per_rank_count!(shm);

/// Links that move at most 5 bytes per call, so that elements arrive split across reads.
struct Dribble(InProcPairs);

impl Pairs for Dribble {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn try_write(&mut self, peer: usize, bufs: &[IoSlice<'_>]) -> Result<usize, LinkError> {
        let first = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &b[..]);
        self.0
            .try_write(peer, &[IoSlice::new(&first[..first.len().min(5)])])
    }
    fn try_read(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize, LinkError> {
        let n = buf.len().min(5);
        self.0.try_read(peer, &mut buf[..n])
    }
    fn wait(&mut self, until: std::time::Instant) -> Result<(), LinkError> {
        self.0.wait(until)
    }
    fn describe(&self, peer: usize) -> String {
        self.0.describe(peer)
    }
}

fn reductions<T: Elem>(c: &Communicator, lens: &[usize]) {
    let (n, r) = (c.size(), c.rank());
    for &len in lens {
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let what = format!("{} len {len} {op}", std::any::type_name::<T>());
            let mut buf = input::<T>(r, len, 9);
            c.all_reduce(&mut buf, op).unwrap();
            assert_close(&buf, &reference::<T>(n, len, 9, op), &what);
            let own = block_range(len, n, r);
            let mut recv = vec![T::zeroed(); own.len()];
            c.reduce_scatter(&input::<T>(r, len, 9), &mut recv, op)
                .unwrap();
            assert_close(&recv, &reference::<T>(n, len, 9, op)[own], &what);
            let mut buf = input::<T>(r, len, 9);
            c.reduce(&mut buf, op, 1).unwrap();
            if r == 1 {
                assert_close(&buf, &reference::<T>(n, len, 9, op), &what);
            }
        }
    }
}

#[test]
fn elements_split_across_reads_are_reduced_whole() {
    let o = CommOptions {
        algorithm: Algorithm::Ring,
        chunk_bytes: 40,
        ..opts()
    };
    let comms: Vec<Communicator> = InProcPairs::group(3)
        .into_iter()
        .map(|p| Communicator::new(Box::new(Dribble(p)), o.clone()))
        .collect();
    std::thread::scope(|s| {
        for c in comms {
            s.spawn(move || {
                reductions::<f64>(&c, &[1, 7, 301]);
                reductions::<bf16>(&c, &[1, 7, 301]);
                reductions::<i32>(&c, &[5, 301]);
            });
        }
    });
}

/// Each rank counts the payload it sent: a ring all-reduce sends `2(n−1)/n` of the buffer per
/// rank, an all-gather `(n−1)/n` of the output, recursive doubling the whole small buffer per
/// round (`log₂ n` rounds); frame headers are not counted.
#[test]
fn ranks_count_the_payload_they_send() {
    let n = 4;
    let big = 1 << 16; // f32s: 256 KiB, above the recursive-doubling cutoff (64 KiB)
    let comms = Communicator::in_process(n, CommOptions::default());
    let results: Vec<_> = std::thread::scope(|s| {
        let joins: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let mut ring = vec![1.0f32; big];
                    c.all_reduce(&mut ring, ReduceOp::Sum).unwrap();
                    let after_ring = c.sent();
                    let mut small = vec![1.0f32; 8];
                    c.all_reduce(&mut small, ReduceOp::Sum).unwrap();
                    let after_small = c.sent();
                    let mine = vec![1.0f32; 1024];
                    let mut all = vec![0.0f32; 1024 * n];
                    c.all_gather(&mine, &mut all).unwrap();
                    (after_ring, after_small, c.sent())
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    for (ring, small, gather) in results {
        assert_eq!(ring.bytes, (2 * (n - 1) * big * 4 / n) as u64);
        assert_eq!(
            small.bytes - ring.bytes,
            2 * 8 * 4,
            "log2(4) rounds of 32 B"
        );
        assert_eq!(gather.bytes - small.bytes, ((n - 1) * 1024 * 4) as u64);
    }
}
