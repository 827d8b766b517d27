//! Splitting, sharding and batching: coverage, disjointness, determinism, batch shapes.

use dflow_executor::data::{epoch_seed, part_range, Dataset};
use dflow_graph::DType;
use std::collections::BTreeSet;

/// `n` examples with 3 features; feature 0 and the label encode the row (label = row % 10).
fn dataset(n: usize) -> Dataset {
    let mut features = Vec::with_capacity(n * 3);
    for i in 0..n {
        features.extend([i as f32, -(i as f32), 0.5]);
    }
    let labels = (0..n).map(|i| (i % 10) as i64).collect();
    Dataset::new(features, labels, 3, Some(10)).unwrap()
}

fn ids(ds: &Dataset) -> Vec<usize> {
    ds.row_ids().to_vec()
}

#[test]
fn split_is_disjoint_complete_and_deterministic() {
    let ds = dataset(1000);
    let (train, test) = ds.split(0.2, 42).unwrap();
    assert_eq!((train.len(), test.len()), (800, 200));
    let a: BTreeSet<_> = ids(&train).into_iter().collect();
    let b: BTreeSet<_> = ids(&test).into_iter().collect();
    assert!(a.is_disjoint(&b));
    assert_eq!(a.union(&b).count(), 1000);
    // Rows keep their data: feature 0 is the original row number.
    for i in 0..test.len() {
        let row = test.row_ids()[i];
        assert_eq!(test.features(i).unwrap()[0], row as f32);
        assert_eq!(test.label(i), Some((row % 10) as i64));
    }
    let (train2, test2) = ds.split(0.2, 42).unwrap();
    assert_eq!(ids(&train), ids(&train2));
    assert_eq!(ids(&test), ids(&test2));
    let (_, test3) = ds.split(0.2, 43).unwrap();
    assert_ne!(ids(&test), ids(&test3));
    // Not simply the first or last rows.
    assert_ne!(ids(&test), (0..200).collect::<Vec<_>>());
    assert_ne!(ids(&test), (800..1000).collect::<Vec<_>>());
}

#[test]
fn split_edges_and_bad_fractions() {
    let ds = dataset(10);
    let (train, test) = ds.split(0.0, 1).unwrap();
    assert_eq!((train.len(), test.len()), (10, 0));
    let (train, test) = ds.split(1.0, 1).unwrap();
    assert_eq!((train.len(), test.len()), (0, 10));
    let (train, test) = ds.split(0.25, 1).unwrap();
    assert_eq!((train.len(), test.len()), (7, 3)); // round(2.5) = 3
    for f in [-0.1, 1.5, f64::NAN] {
        let e = ds.split(f, 1).unwrap_err().to_string();
        assert!(e.contains("test fraction"), "{e}");
    }
}

#[test]
fn shards_partition_every_example_exactly_once() {
    let ds = dataset(103);
    for count in [1, 2, 3, 4, 7, 103, 200] {
        let shards: Vec<Dataset> = (0..count).map(|i| ds.shard(i, count).unwrap()).collect();
        let mut all: Vec<usize> = shards.iter().flat_map(ids).collect();
        let sizes: Vec<usize> = shards.iter().map(Dataset::len).collect();
        all.sort_unstable();
        assert_eq!(all, (0..103).collect::<Vec<_>>(), "count {count}");
        let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        assert!(max - min <= 1, "count {count}: sizes {sizes:?}");
        assert_eq!(ids(&ds.shard(0, count).unwrap()), ids(&shards[0]));
    }
    assert!(ds.shard(3, 3).is_err());
    assert!(ds.shard(0, 0).is_err());
}

#[test]
fn shards_of_a_split_stay_inside_it() {
    let ds = dataset(100);
    let (train, test) = ds.split(0.3, 9).unwrap();
    let test_ids: BTreeSet<_> = ids(&test).into_iter().collect();
    let mut seen = Vec::new();
    for i in 0..4 {
        let s = train.shard(i, 4).unwrap();
        assert!(ids(&s).iter().all(|r| !test_ids.contains(r)));
        seen.extend(ids(&s));
    }
    seen.sort_unstable();
    assert_eq!(seen, ids(&train));
}

#[test]
fn batch_shapes_with_and_without_remainder() {
    let ds = dataset(10);
    let keep: Vec<_> = ds
        .batches(4, None, 0, false)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(keep.len(), 3);
    assert_eq!(ds.num_batches(4, false), 3);
    let dims: Vec<_> = keep
        .iter()
        .map(|(x, y)| (x.dims().to_vec(), y.dims().to_vec()))
        .collect();
    assert_eq!(
        dims,
        vec![
            (vec![4, 3], vec![4]),
            (vec![4, 3], vec![4]),
            (vec![2, 3], vec![2])
        ]
    );
    let (x, y) = &keep[2];
    assert_eq!(x.dtype(), DType::F32);
    assert_eq!(y.dtype(), DType::I64);
    // Unshuffled: rows 8 and 9 in order.
    assert_eq!(
        x.as_slice::<f32>().unwrap(),
        &[8.0, -8.0, 0.5, 9.0, -9.0, 0.5]
    );
    assert_eq!(y.as_slice::<i64>().unwrap(), &[8, 9]);

    let it = ds.batches(4, Some(3), 0, true).unwrap();
    assert_eq!(it.len(), 2);
    assert_eq!(ds.num_batches(4, true), 2);
    for b in it {
        let (x, y) = b.unwrap();
        assert_eq!((x.dims(), y.dims()), (&[4usize, 3][..], &[4usize][..]));
    }
    // Batch larger than the data set.
    let all: Vec<_> = ds.batches(64, Some(1), 0, false).unwrap().collect();
    assert_eq!(all.len(), 1);
    assert_eq!(ds.batches(64, Some(1), 0, true).unwrap().count(), 0);
    assert!(ds.batches(0, None, 0, false).is_err());
}

/// The rows an epoch visits, in order (feature 0 is the row number).
fn epoch_rows(ds: &Dataset, seed: Option<u64>, epoch: u64, drop: bool) -> Vec<usize> {
    let mut rows = Vec::new();
    for b in ds.batches(7, seed, epoch, drop).unwrap() {
        let (x, y) = b.unwrap();
        let xs = x.as_slice::<f32>().unwrap();
        for (r, label) in xs.chunks(3).zip(y.as_slice::<i64>().unwrap()) {
            let row = r[0] as usize;
            assert_eq!(r[1], -(row as f32), "features of one row stay together");
            assert_eq!(*label, (row % 10) as i64, "labels follow their rows");
            rows.push(row);
        }
    }
    rows
}

#[test]
fn shuffling_is_deterministic_per_seed_and_epoch() {
    let ds = dataset(50);
    let e0 = epoch_rows(&ds, Some(5), 0, false);
    assert_eq!(e0, epoch_rows(&ds, Some(5), 0, false));
    let mut sorted = e0.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (0..50).collect::<Vec<_>>(),
        "an epoch visits every row once"
    );
    assert_ne!(e0, (0..50).collect::<Vec<_>>());
    assert_ne!(e0, epoch_rows(&ds, Some(5), 1, false), "epochs differ");
    assert_ne!(e0, epoch_rows(&ds, Some(6), 0, false), "seeds differ");
    assert_eq!(epoch_rows(&ds, None, 3, false), (0..50).collect::<Vec<_>>());
    // Dropping the remainder drops the tail of the same permutation.
    assert_eq!(epoch_rows(&ds, Some(5), 0, true), e0[..49].to_vec());
    assert_eq!(epoch_seed(5, 0), 5);
    assert_ne!(epoch_seed(5, 1), epoch_seed(5, 2));
}

#[test]
fn shuffled_shard_batches_stay_in_the_shard() {
    let ds = dataset(60);
    let shard = ds.shard(1, 3).unwrap();
    let rows = epoch_rows(&shard, Some(11), 2, false);
    let mut sorted = rows.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, ids(&shard));
}

/// The rows of a batch (feature 0 is the row number), checking features and labels agree.
fn batch_rows(x: &dflow_graph::Tensor, y: &dflow_graph::Tensor) -> Vec<usize> {
    let xs = x.as_slice::<f32>().unwrap();
    let ys = y.as_slice::<i64>().unwrap();
    assert_eq!(xs.len(), ys.len() * 3);
    xs.chunks(3)
        .zip(ys)
        .map(|(r, &label)| {
            let row = r[0] as usize;
            assert_eq!(label, (row % 10) as i64, "labels follow their rows");
            row
        })
        .collect()
}

#[test]
fn batch_parts_concatenate_to_the_batch() {
    // 104 examples of a split view (batches of 32: 32, 32, 32 and 8); epochs shuffle differently.
    let (ds, _) = dataset(130).split(0.2, 3).unwrap();
    assert_eq!(ds.len(), 104);
    for (batch_size, parts) in [(32, 2), (31, 2), (32, 3), (10, 4), (7, 1), (104, 5)] {
        for epoch in [0, 1] {
            let batches: Vec<_> = ds
                .batches(batch_size, Some(9), epoch, false)
                .unwrap()
                .collect();
            for (index, batch) in batches.into_iter().enumerate() {
                let (x, y) = batch.unwrap();
                let whole = batch_rows(&x, &y);
                let mut joined = Vec::new();
                for part in 0..parts {
                    let range = part_range(whole.len(), part, parts).unwrap();
                    if range.is_empty() {
                        assert!(ds
                            .batch_part(batch_size, 9, epoch, index, part, parts)
                            .is_err());
                        continue;
                    }
                    let (px, py) = ds
                        .batch_part(batch_size, 9, epoch, index, part, parts)
                        .unwrap();
                    assert_eq!(px.dims(), &[range.len(), 3]);
                    assert_eq!(py.dims(), &[range.len()]);
                    joined.extend(batch_rows(&px, &py));
                }
                assert_eq!(
                    joined, whole,
                    "batch {batch_size}x{index} in {parts} parts, epoch {epoch}"
                );
            }
        }
    }
}

#[test]
fn parts_differ_by_at_most_one_row_and_the_first_are_longer() {
    for rows in 0..40 {
        for parts in 1..7 {
            let ranges: Vec<_> = (0..parts)
                .map(|p| part_range(rows, p, parts).unwrap())
                .collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[parts - 1].end, rows);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start, "contiguous");
                assert!(w[0].len() == w[1].len() || w[0].len() == w[1].len() + 1);
            }
            assert_eq!(part_range(rows, parts, parts), None);
        }
    }
    assert_eq!(part_range(31, 0, 2), Some(0..16));
    assert_eq!(part_range(31, 1, 2), Some(16..31));
    assert_eq!(part_range(5, 0, 0), None);
}

#[test]
fn batch_part_refuses_out_of_range_arguments() {
    let ds = dataset(10);
    let err = |batch_size, index, part, parts| {
        ds.batch_part(batch_size, 0, 0, index, part, parts)
            .unwrap_err()
            .to_string()
    };
    assert!(err(0, 0, 0, 1).contains("batch size"));
    let e = err(4, 3, 0, 2);
    assert!(e.contains("batch 3 is not in 0..3"), "{e}");
    let e = err(4, 0, 2, 2);
    assert!(e.contains("part 2 is not in 0..2"), "{e}");
    let e = err(4, 0, 0, 0);
    assert!(e.contains("not in 0..0"), "{e}");
    // The last batch holds 2 rows: a third part would be empty.
    let e = err(4, 2, 2, 3);
    assert!(e.contains("empty") && e.contains("only 2 examples"), "{e}");
    assert!(ds.batch_part(4, 0, 0, 2, 1, 3).is_ok());
}

#[test]
fn new_checks_lengths_and_labels() {
    let e = Dataset::new(vec![0.0; 5], vec![0, 1], 3, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("features (5 values, 3 per row)") && e.contains("2 labels"),
        "{e}"
    );
    let e = Dataset::new(vec![0.0; 2], vec![0, 3], 1, Some(3))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("row 1: label 3 is out of range for 3 classes"),
        "{e}"
    );
    let ds = Dataset::new(vec![], vec![], 4, None).unwrap();
    assert!(ds.is_empty());
    assert_eq!(ds.batches(2, Some(1), 0, false).unwrap().count(), 0);
    let (x, y) = ds.to_tensors().unwrap();
    assert_eq!((x.dims(), y.dims()), (&[0usize, 4][..], &[0usize][..]));
}
