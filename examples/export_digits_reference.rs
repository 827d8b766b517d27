//! Writes the inputs of the digits numerics reference (`tests/fixtures/digits_reference/`): the
//! initial values of the digits MLP's variables and the first 100 training batches, exactly as
//! `dflow run --local examples/digits/digits.json --data examples/data/digits.csv.gz` would use
//! them (split 0.2 with seed 0, shuffle seed 0, batch 32). `make_reference.py` trains from this
//! file with numpy; `tests/digits_reference.rs` checks dflow's losses against its output.
//!
//! Run from the repository root:
//! `cargo run -p dflow-examples --example export_digits_reference [OUT.json]`

use dflow::executor::data::{read_csv, ReadOptions};
use dflow::executor::{Session, SessionOptions};
use dflow::graph::train::{expand_training, OptimizerKind, TrainSpec};
use dflow::graph::{ClusterSpec, Graph, Tensor};
use std::error::Error;
use std::fmt::Write as _;
use std::path::Path;

/// Batches written (one per reference step).
const STEPS: usize = 100;
const BATCH: usize = 32;
const SEED: u64 = 0;
const TEST_FRACTION: f64 = 0.2;
const VARIABLES: [&str; 4] = ["w1", "b1", "w2", "b2"];

fn main() -> Result<(), Box<dyn Error>> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tests/fixtures/digits_reference/init.json".into());
    let loaded = dflow::load::load_graph(Path::new("examples/digits/digits.json"))?;
    let spec = loaded
        .parsed
        .def
        .train
        .clone()
        .ok_or("examples/digits/digits.json has no `train` section")?;
    let training = expand_training(&loaded.parsed.def, &spec)?;
    let graph = Graph::from_def(&training.def)?;
    let cluster = ClusterSpec::from_file(Path::new("examples/digits/cluster.json"))?;
    let session = Session::new(graph, cluster, SessionOptions::default())?;

    let all = read_csv("examples/data/digits.csv.gz", &ReadOptions::default())?;
    let (train, _) = all.split(TEST_FRACTION, SEED)?;
    // The trainer's batch order: epoch after epoch, each shuffled with its own seed.
    let mut batches: Vec<(Tensor, Tensor)> = Vec::with_capacity(STEPS);
    let mut epoch = 0;
    while batches.len() < STEPS {
        let before = batches.len();
        for batch in train.batches(BATCH, Some(SEED), epoch, false)? {
            if batches.len() == STEPS {
                break;
            }
            batches.push(batch?);
        }
        if batches.len() == before {
            return Err("the training split is empty".into());
        }
        epoch += 1;
    }

    // One forward step with no update initialises every variable from its initializer.
    let (x0, y0) = batches[0].clone();
    let first = session.run(&[("pixels", x0), ("labels", y0)], &[&training.loss], &[])?;
    let initial_loss = first.first().map(|t| t.to_f64_vec()).unwrap_or_default();
    let vars = session.variables();

    let mut json = String::new();
    writeln!(json, "{{")?;
    writeln!(
        json,
        "  \"about\": \"digits MLP reference inputs: initial variables and the first {STEPS} training batches, epochs in order (split {TEST_FRACTION} seed {SEED}, shuffle seed {SEED}, batch {BATCH}); written by examples/export_digits_reference.rs\","
    )?;
    writeln!(json, "  \"lr\": {},", spec_lr(&spec)?)?;
    writeln!(
        json,
        "  \"initial_forward_loss\": {},",
        initial_loss.first().copied().unwrap_or(f64::NAN) as f32
    )?;
    writeln!(json, "  \"variables\": {{")?;
    for (i, name) in VARIABLES.iter().enumerate() {
        let (_, _, t) = vars
            .iter()
            .find(|(_, n, _)| n == name)
            .ok_or_else(|| format!("variable {name} was not initialised"))?;
        let values: Vec<String> = t.as_slice::<f32>()?.iter().map(|v| v.to_string()).collect();
        let sep = if i + 1 < VARIABLES.len() { "," } else { "" };
        writeln!(
            json,
            "    \"{name}\": {{\"shape\": {:?}, \"values\": [{}]}}{sep}",
            t.dims(),
            values.join(", ")
        )?;
    }
    writeln!(json, "  }},")?;
    writeln!(json, "  \"batches\": [")?;
    for (i, (x, y)) in batches.iter().enumerate() {
        let rows: Vec<String> = x
            .as_slice::<f32>()?
            .chunks(x.dims()[1])
            .map(|row| {
                let vals: Vec<String> = row.iter().map(|v| pixel(*v)).collect::<Result<_, _>>()?;
                Ok(format!("[{}]", vals.join(",")))
            })
            .collect::<Result<_, Box<dyn Error>>>()?;
        let labels: Vec<String> = y.as_slice::<i64>()?.iter().map(i64::to_string).collect();
        let sep = if i + 1 < batches.len() { "," } else { "" };
        writeln!(
            json,
            "    {{\"pixels\": [{}], \"labels\": [{}]}}{sep}",
            rows.join(","),
            labels.join(",")
        )?;
    }
    writeln!(json, "  ]")?;
    writeln!(json, "}}")?;
    std::fs::write(&out, json).map_err(|e| format!("writing {out}: {e}"))?;
    eprintln!(
        "wrote {out}: {} variables, {STEPS} batches",
        VARIABLES.len()
    );
    Ok(())
}

/// The digits pixels are integers 0..=16; writing them as integers keeps the fixture small.
fn pixel(v: f32) -> Result<String, Box<dyn Error>> {
    if v.fract() == 0.0 && (0.0..=255.0).contains(&v) {
        Ok(format!("{}", v as i64))
    } else {
        Err(format!("pixel value {v} is not a small integer").into())
    }
}

/// The learning rate of plain SGD, the only optimizer the numpy reference implements.
fn spec_lr(spec: &TrainSpec) -> Result<f64, Box<dyn Error>> {
    match spec.optimizer.kind {
        OptimizerKind::Sgd => Ok(spec.optimizer.lr),
        ref other => {
            Err(format!("the reference implements SGD only, the graph uses {other:?}").into())
        }
    }
}
