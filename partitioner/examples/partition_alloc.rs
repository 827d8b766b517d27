//! Counts what partitioning one generated graph allocates: `cargo run --release -p
//! dflow-partitioner --example partition_alloc -- 1000000`. Prints the allocations made during
//! `partition()`, the bytes they asked for, how many bytes the result still holds, and the
//! size of a few types every node carries. Deterministic, unlike timings: use it to compare
//! changes to the partitioner's memory use.

use dflow_graph::{AttrValue, Attrs, Node};
use dflow_partitioner::{partition, synthetic, PartitionOptions, TransferPair};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    println!(
        "size_of: AttrValue {}, (name, AttrValue) entry {}, Attrs {}, Node {}, TransferPair {}",
        std::mem::size_of::<AttrValue>(),
        std::mem::size_of::<(std::borrow::Cow<'static, str>, AttrValue)>(),
        std::mem::size_of::<Attrs>(),
        std::mem::size_of::<Node>(),
        std::mem::size_of::<TransferPair>(),
    );
    let placed = synthetic::layered(n);
    let region = Region::new(GLOBAL);
    let p = match partition(&placed, &PartitionOptions::default()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let s = region.change();
    // Reallocations count the (signed) change in size.
    let held =
        s.bytes_allocated as i128 + s.bytes_reallocated as i128 - s.bytes_deallocated as i128;
    println!(
        "nodes {} pairs {}: allocations {} (reallocations {}), bytes asked {}, result holds {} bytes",
        placed.graph.num_nodes(),
        p.pairs.len(),
        s.allocations,
        s.reallocations,
        s.bytes_allocated,
        held
    );
    drop(p);
}
