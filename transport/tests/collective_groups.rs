//! Subgroups, split, asynchronous handles and per-call options.

use dflow_transport::collective::{CommOptions, Communicator, ReduceOp};
use std::time::Duration;

fn on_ranks<R: Send>(n: usize, f: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let joins: Vec<_> = Communicator::in_process(n, CommOptions::default())
            .into_iter()
            .map(|c| s.spawn(move || f(c)))
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

#[test]
fn split_by_parity_reduces_within_each_half() {
    let out = on_ranks(5, |c| {
        let half = c.split((c.rank() % 2) as u32, -(c.rank() as i64)).unwrap();
        let mut x = vec![c.rank() as i64; 3];
        half.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        // The parent still works afterwards, in the same order on every rank.
        let mut y = [1i32];
        c.all_reduce(&mut y, ReduceOp::Sum).unwrap();
        (half.rank(), half.size(), x[0], y[0])
    });
    // Evens 0,2,4 (keys reverse the order), odds 1,3.
    assert_eq!(out[0], (2, 3, 6, 5));
    assert_eq!(out[4], (0, 3, 6, 5));
    assert_eq!(out[1], (1, 2, 4, 5));
    assert_eq!(out[3], (0, 2, 4, 5));
}

#[test]
fn subgroup_of_listed_ranks() {
    let out = on_ranks(4, |c| {
        if c.rank() == 0 {
            assert!(c.subgroup(&[1, 2]).is_err());
            return None;
        }
        let g = c.subgroup(&[3, 1, 2]).unwrap();
        let mut x = vec![0f32; 2];
        if g.rank() == 0 {
            x = vec![9.0, 8.0];
        }
        g.broadcast(&mut x, 0).unwrap();
        Some((g.rank(), x))
    });
    assert_eq!(out[3], Some((0, vec![9.0, 8.0])));
    assert_eq!(out[1], Some((1, vec![9.0, 8.0])));
}

#[test]
fn async_handles_complete_in_order() {
    let out = on_ranks(3, |c| {
        let a = c.all_reduce_async(vec![c.rank() as f64; 1000], ReduceOp::Sum);
        let b = c.all_gather_async(vec![c.rank() as i32; 2]);
        let d = c.reduce_scatter_async(vec![1i64; 7], ReduceOp::Sum);
        // A synchronous call waits for the submitted ones first.
        let mut z = [c.rank() as i32];
        c.all_reduce(&mut z, ReduceOp::Max).unwrap();
        assert!(a.is_done() && b.is_done() && d.is_done());
        (
            a.wait().unwrap()[999],
            b.wait().unwrap(),
            d.wait().unwrap(),
            z[0],
        )
    });
    for (r, (a, b, d, z)) in out.into_iter().enumerate() {
        assert_eq!(a, 3.0);
        assert_eq!(b, vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(d, vec![3; if r == 0 { 3 } else { 2 }]);
        assert_eq!(z, 2);
    }
}

#[test]
fn per_call_timeout_applies_to_that_call_only() {
    let out = on_ranks(2, |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(400));
        }
        let mut x = [1u8 as i32];
        let quick = c
            .with_timeout(Duration::from_millis(100))
            .all_reduce(&mut x, ReduceOp::Sum);
        quick.map_err(|e| e.to_string())
    });
    let e = out[0].as_ref().unwrap_err();
    assert!(
        e.contains("all_reduce #0") && e.contains("timed out after 100ms"),
        "{e}"
    );
}
