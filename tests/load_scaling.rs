//! Loading is linear in the input size: a chain written on one line (as Python's `json.dump`
//! writes it) at 200k nodes takes less than 40× the time of 10k nodes (linear is 20×; the
//! quadratic loader this guards against took ~200×). The benchmark with the figures is
//! `cargo bench -p dflow-graph --bench parse -- one_line_chain`.

use std::path::Path;
use std::time::{Duration, Instant};

/// `x -> n0 -> n1 -> ...` on one line: a Placeholder and `n` Relus.
fn write_chain(path: &Path, n: usize) {
    let mut s = String::from(
        r#"{"format": "dflow-graph", "version": 1, "nodes": [{"name": "x", "op": "Placeholder", "device": "/job:worker/task:0", "attrs": {"dtype": "f32", "shape": [-1, 4]}}"#,
    );
    let mut prev = "x".to_string();
    for i in 0..n {
        s.push_str(&format!(
            r#", {{"name": "n{i}", "op": "Relu", "inputs": ["{prev}"]}}"#
        ));
        prev = format!("n{i}");
    }
    s.push_str("]}");
    std::fs::write(path, s).unwrap();
}

/// The fastest of `runs` loads of `path` (the least disturbed by other work on the machine).
fn best_load(path: &Path, nodes: usize, runs: usize) -> Duration {
    (0..runs)
        .map(|_| {
            let start = Instant::now();
            let loaded = dflow::load::load_graph(path).unwrap();
            let took = start.elapsed();
            assert_eq!(loaded.graph.num_nodes(), nodes + 1);
            took
        })
        .min()
        .unwrap_or_default()
}

#[test]
fn one_line_chain_loads_in_linear_time() {
    let dir = tempfile::tempdir().unwrap();
    let (small, large) = (dir.path().join("10k.json"), dir.path().join("200k.json"));
    write_chain(&small, 10_000);
    write_chain(&large, 200_000);
    let t_small = best_load(&small, 10_000, 3);
    let t_large = best_load(&large, 200_000, 2);
    let ratio = t_large.as_secs_f64() / t_small.as_secs_f64().max(1e-9);
    assert!(
        ratio < 40.0,
        "200k nodes took {t_large:?}, 10k took {t_small:?}: {ratio:.1}× for 20× the nodes"
    );
}
