//! Issue 5: for fixed initial weights and batch order, the first 100 losses of the digits MLP
//! match a numpy reference within 1e-4 relative.
//!
//! The fixture lives in `tests/fixtures/digits_reference/`: `init.json` (initial variables and
//! the first 100 training batches, from `examples/export_digits_reference.rs`) and `losses.json`
//! (from `make_reference.py`, numpy float32 with TensorFlow's formulas). No Python at run time.

use dflow::graph::Tensor;
use dflow_tests::digits_setup::{repo, session};
use serde_json::Value;

const TOLERANCE: f64 = 1e-4;

fn read_json(name: &str) -> Value {
    let path = repo().join("tests/fixtures/digits_reference").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

fn dims(v: &Value) -> Vec<usize> {
    f64s(v).into_iter().map(|d| d as usize).collect()
}

/// `(pixels f32 [n, 64], labels i64 [n])` of one fixture batch.
fn batch(b: &Value) -> (Tensor, Tensor) {
    let rows = b["pixels"].as_array().expect("pixels rows");
    let width = rows[0].as_array().expect("a row").len();
    let pixels: Vec<f32> = rows.iter().flat_map(f64s).map(|p| p as f32).collect();
    let labels: Vec<i64> = f64s(&b["labels"]).into_iter().map(|l| l as i64).collect();
    (
        Tensor::from_slice(&[rows.len(), width], &pixels).unwrap(),
        Tensor::from_slice(&[labels.len()], &labels).unwrap(),
    )
}

#[test]
fn first_100_losses_match_the_numpy_reference() {
    let init = read_json("init.json");
    let expected = f64s(&read_json("losses.json")["losses"]);
    let batches = init["batches"].as_array().expect("batches");
    assert_eq!(expected.len(), 100);
    assert_eq!(batches.len(), expected.len());

    let (session, training) = session();
    let variables = init["variables"].as_object().expect("variables");
    assert_eq!(variables.len(), session.variable_specs().len());
    for (name, v) in variables {
        let values: Vec<f32> = f64s(&v["values"]).into_iter().map(|x| x as f32).collect();
        let t = Tensor::from_slice(&dims(&v["shape"]), &values).unwrap();
        session.assign_variable(name, t).unwrap();
    }

    let mut worst = (0.0f64, 0usize);
    for (step, (b, want)) in batches.iter().zip(&expected).enumerate() {
        let (x, y) = batch(b);
        let out = session
            .run(
                &[("pixels", x), ("labels", y)],
                &[&training.loss],
                &[&training.train_op],
            )
            .unwrap();
        let got = out[0].as_slice::<f32>().unwrap()[0] as f64;
        let rel = (got - want).abs() / want.abs();
        assert!(
            rel <= TOLERANCE,
            "step {}: dflow loss {got} vs numpy {want} (relative error {rel:.3e})",
            step + 1
        );
        if rel > worst.0 {
            worst = (rel, step + 1);
        }
    }
    println!(
        "max relative loss error vs numpy over {} steps: {:.3e} (step {})",
        expected.len(),
        worst.0,
        worst.1
    );
}
