//! Partitions generated layered graphs of 10k, 100k and 1M nodes over 64 devices
//! (see `dflow_partitioner::synthetic::layered`). Run: `cargo bench -p dflow-partitioner`.
//!
//! `partition` measures the call alone (the result is dropped outside the timed region, as a
//! caller keeps it); `partition_and_drop` also frees the result, for comparison.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dflow_partitioner::{partition, synthetic, PartitionOptions};

/// The allocator the `dflow` binary uses.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("partition");
    group.sample_size(10);
    for n in [10_000usize, 100_000, 1_000_000] {
        let placed = synthetic::layered(n);
        group.throughput(Throughput::Elements(placed.graph.num_nodes() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(n), &placed, |b, placed| {
            b.iter_with_large_drop(|| partition(placed, &PartitionOptions::default()))
        });
        group.bench_with_input(BenchmarkId::new("and_drop", n), &placed, |b, placed| {
            b.iter(|| partition(placed, &PartitionOptions::default()).map(|p| p.pairs.len()))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
