//! Partitions one generated graph and prints the timings: `cargo run --release -p
//! dflow-partitioner --example partition_big -- 1000000` (peak memory: run under
//! `/usr/bin/time -v`).

use dflow_partitioner::{partition, synthetic, PartitionOptions};
use std::time::Instant;

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let t = Instant::now();
    let placed = synthetic::layered(n);
    let gen = t.elapsed();
    let t = Instant::now();
    let p = match partition(&placed, &PartitionOptions::default()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let part = t.elapsed();
    println!(
        "nodes {} generate {:?} partition {:?} devices {} pairs {}",
        placed.graph.num_nodes(),
        gen,
        part,
        p.partitions.len(),
        p.pairs.len()
    );
}
