//! Partitions one generated graph and prints the timings: `cargo run --release -p
//! dflow-partitioner --example partition_big -- 1000000 [REPEATS]`. With `REPEATS` > 1 the graph
//! is partitioned that many times (each result freed before the next), which suits profilers:
//! generation is paid once.
//!
//! On Linux it also prints the resident memory after generating (`rss`) and the peak so far
//! (`peak`, from `/proc/self/status`); the whole run's peak is what `/usr/bin/time -v` reports.

use dflow_partitioner::{partition, synthetic, PartitionOptions};
use std::time::Instant;

/// The allocator the `dflow` binary and the criterion benchmark use.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let repeats: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let t = Instant::now();
    let placed = synthetic::layered(n);
    let gen = t.elapsed();
    println!("generated: {}", memory());
    for _ in 0..repeats.max(1) {
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
            "nodes {} generate {:?} partition {:?} devices {} pairs {} ({})",
            placed.graph.num_nodes(),
            gen,
            part,
            p.partitions.len(),
            p.pairs.len(),
            memory()
        );
    }
}

/// Current and peak resident memory, from `/proc/self/status` (empty where there is none).
fn memory() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map_or("?".to_string(), |v| v.trim().to_string())
    };
    format!("rss {}, peak {}", field("VmRSS:"), field("VmHWM:"))
}
