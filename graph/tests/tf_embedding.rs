//! The gradients through TensorFlow's partitioned `embedding_lookup` as dflow imports it
//! (DynamicPartition, Gather per part, DynamicStitch), through `DynamicPartition` of float data
//! and through `Select`, against central
//! finite differences in f64. The forward values are checked against TensorFlow itself in the
//! workspace's tests/tf_embedding_import.rs.

use dflow_graph::Tensor;

mod common;
use common::Case;

/// `embedding_lookup([p0, p1], ids, partition_strategy="mod")` written op for op: ids 3, 0, 3,
/// 4 (a repeat) over 2 parts; every row of both parts gets d loss / d row.
#[test]
fn a_partitioned_lookup_differentiates_like_finite_differences() {
    let mut case = Case::new();
    let p0 = case.variable("p0", &[3, 2]); // ids 0, 2, 4
    let p1 = case.variable("p1", &[2, 2]); // ids 1, 3
    let b = &mut case.b;
    let ids: [i64; 4] = [3, 0, 3, 4];
    let shard: Vec<i32> = ids.iter().map(|&i| (i % 2) as i32).collect();
    let row: Vec<i64> = ids.iter().map(|&i| i / 2).collect();
    let shard = b.constant("shard", Tensor::from_slice(&[4], &shard).unwrap());
    let row = b.constant("row", Tensor::from_slice(&[4], &row).unwrap());
    let pos = b.constant("pos", Tensor::from_slice(&[4], &[0i32, 1, 2, 3]).unwrap());
    let rows = b
        .op("DynamicPartition", "rows")
        .input(&row)
        .input(&shard)
        .attr("num_partitions", 2i64)
        .finish();
    let at = b
        .op("DynamicPartition", "at")
        .input(&pos)
        .input(&shard)
        .attr("num_partitions", 2i64)
        .finish();
    let g0 = b.binary("Gather", "g0", &p0, rows.out(0));
    let g1 = b.binary("Gather", "g1", &p1, rows.out(1));
    let out = b
        .op("DynamicStitch", "lookup")
        .input(at.out(0))
        .input(at.out(1))
        .input(&g0)
        .input(&g1)
        .finish();
    case.check(&out, &[4, 2], &["p0", "p1"]);
}

/// DynamicPartition of float rows into 3 partitions, of which the loss reads 0 and 2 (joined by
/// a DynamicStitch): row i of the data gets its partition's gradient, rows sent to 1 get zeros.
#[test]
fn dynamic_partition_differentiates_like_finite_differences() {
    let mut case = Case::new();
    let data = case.variable("data", &[5, 2]);
    let b = &mut case.b;
    let parts = b.constant(
        "parts",
        Tensor::from_slice(&[5], &[2i32, 0, 1, 2, 0]).unwrap(),
    );
    let split = b
        .op("DynamicPartition", "split")
        .input(&data)
        .input(&parts)
        .attr("num_partitions", 3i64)
        .finish();
    // Outputs 0 and 2 (2 rows each) side by side: stitched to rows 0-1 and 2-3.
    let at0 = b.constant("at0", Tensor::from_slice(&[2], &[0i32, 1]).unwrap());
    let at2 = b.constant("at2", Tensor::from_slice(&[2], &[2i32, 3]).unwrap());
    let joined = b
        .op("DynamicStitch", "joined")
        .input(&at0)
        .input(&at2)
        .input(split.out(0))
        .input(split.out(2))
        .finish();
    case.check(&joined, &[4, 2], &["data"]);
}

/// `Select(x > 0, x · w, w)` picks per element: each side's gradient only where it was picked.
#[test]
fn select_differentiates_like_finite_differences() {
    let mut case = Case::new();
    let x = case.input("x", &[2, 3], &[2, 3], -1.0, 1.0);
    let w = case.variable("w", &[2, 3]);
    let b = &mut case.b;
    let zero = b.constant("zero", Tensor::scalar(0.0f64));
    let cond = b.binary("Less", "cond", &zero, &x);
    let xw = b.binary("Mul", "xw", &x, &w);
    let out = b
        .op("Select", "pick")
        .input(&cond)
        .input(&xw)
        .input(&w)
        .finish();
    case.check(&out, &[2, 3], &["x", "w"]);
}
