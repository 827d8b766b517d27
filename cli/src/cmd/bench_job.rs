//! `dflow bench calibrate`'s measurement of a real job's step path (the planner's
//! [`JobCosts`]): the per-step, per-op and per-collective-call costs of dflow's distributed step,
//! which dominate a small model's step time on this machine, and the rates a task of a job gets
//! on each kind of op (products, memory-bound ops, transcendental ops).
//!
//! It runs six synthetic models (`MatMul`s from 8 features, a chain of elementwise ops, SGD)
//! as real 2-worker all-reduce jobs (`dflow run --local`, every task in one child process, TCP
//! on 127.0.0.1), each `--runs` times, and takes each one's median step (the job's own `trained
//! N steps in T s` line): the base model; a chain of [`CHAIN`] `Relu` on 16 rows × 8 (more ops); [`LAYERS`] layers with every gradient its own all-reduce (more
//! collective calls); 3 layers of [`WIDE`] channels on 256 rows a task (product FLOPs); [`BYTES_CHAIN`]
//! `Relu` on 256 × [`BYTES_WIDTH`] (bytes of memory-bound ops); [`TRANSCENDENTAL_CHAIN`] `Gelu`
//! on 256 × [`BYTES_WIDTH`] (transcendental elements). The runs go round the variants (one run
//! of each, `--runs` times), so that a change of the machine's load falls on all of them. The planner's own counts of each job's plan (its
//! nodes, calls, bytes, product FLOPs, other ops' bytes and transcendental elements, planner
//! `runtime::work`) turn the six medians into six equations of the model of planner
//! `runtime::job_step`, solved for the six costs. None of these models
//! is one the planner is later compared against (docs/planner.md).

use anyhow::{bail, Context};
use dflow_partitioner::planner::{self, runtime, ClusterProfile, JobCosts};
use dflow_partitioner::strategy::{JobInput, StrategyKind, StrategyOptions};
use std::path::Path;
use std::process::Command;

/// Features of the synthetic models (rows × 8 elements: small, batched ops as in the small
/// models the planner is checked on).
const WIDTH: usize = 8;
/// `Relu` ops of the chain variant (16 rows × 8 a task: more nodes, few bytes).
pub const CHAIN: usize = 800;
/// Layers of the many-calls variant.
pub const LAYERS: usize = 24;
/// The global batch of the calibration jobs.
const BATCH: usize = 32;
/// Rows of the synthetic data set (16 steps an epoch; `--job-epochs` 100, 1,600 steps a job:
/// the job prints its time to 10 ms, so a step to ~6 µs).
const ROWS: usize = 512;

/// Hidden width of the FLOP-heavy variant's layers.
pub const WIDE: usize = 256;
/// The FLOP-heavy variant's global batch (the whole data set: 256 rows a task, products the
/// size of a small transformer's).
const WIDE_BATCH: usize = ROWS;

/// One synthetic job.
#[derive(Debug, Clone, Copy)]
struct Variant {
    /// The global batch.
    batch: usize,
    /// Width of the hidden layers (the first maps the 8 features to it).
    hidden: usize,
    layers: usize,
    chain: usize,
    /// The op of the chain (`Relu`: memory-bound; `Gelu`: one `tanh` an element).
    chain_op: &'static str,
    /// Every gradient its own all-reduce (a fusion threshold below one gradient's bytes).
    unfused: bool,
}

/// The model: `layers` products to `hidden` channels, a chain of `chain` `chain_op`, a `[hidden, 2]` output, the
/// softmax cross-entropy's mean; SGD.
fn graph_json(v: Variant) -> String {
    let mut nodes = vec![
        serde_json::json!({"name": "pixels", "op": "Placeholder", "attrs": {"dtype": "f32", "shape": [-1, WIDTH]}}),
        serde_json::json!({"name": "labels", "op": "Placeholder", "attrs": {"dtype": "i64", "shape": [-1]}}),
    ];
    let mut h = "pixels".to_string();
    let variable = |name: &str, dims: [usize; 2], seed: usize| serde_json::json!({"name": name, "op": "Variable", "attrs": {"dtype": "f32", "shape": dims, "initializer": "glorot_uniform", "seed": seed}});
    for l in 0..v.layers {
        let w = format!("w{l}");
        let rows = if l == 0 { WIDTH } else { v.hidden };
        nodes.push(variable(&w, [rows, v.hidden], l + 1));
        let out = format!("layer{l}");
        nodes.push(serde_json::json!({"name": out, "op": "MatMul", "inputs": [h, w]}));
        h = out;
    }
    for c in 0..v.chain {
        let out = format!("chain{c}");
        nodes.push(serde_json::json!({"name": out, "op": v.chain_op, "inputs": [h]}));
        h = out;
    }
    nodes.push(variable("w_out", [v.hidden, 2], 99));
    nodes.push(serde_json::json!({"name": "logits", "op": "MatMul", "inputs": [h, "w_out"]}));
    nodes.push(serde_json::json!({"name": "xent", "op": "SparseSoftmaxCrossEntropyWithLogits", "inputs": ["logits", "labels"]}));
    nodes.push(serde_json::json!({"name": "loss", "op": "Mean", "inputs": ["xent"]}));
    serde_json::json!({
        "format": "dflow-graph",
        "version": 1,
        "nodes": nodes,
        "train": {"loss": "loss", "optimizer": {"type": "sgd", "lr": 0.01}}
    })
    .to_string()
}

/// `ROWS` rows of 8 features and a 0/1 label (deterministic).
fn data_csv() -> String {
    let mut s = String::new();
    for r in 0..ROWS {
        let row: Vec<String> = (0..WIDTH)
            .map(|c| ((r * 7 + c * 3) % 17).to_string())
            .collect();
        s.push_str(&format!("{},{}\n", row.join(","), r % 2));
    }
    s
}

/// Width of the memory-bound variant (256 rows a task × 512: 512 KiB a tensor).
pub const BYTES_WIDTH: usize = 512;
/// `Relu` ops of its chain.
pub const BYTES_CHAIN: usize = 20;
/// `Gelu` ops of the transcendental variant (256 rows a task × [`BYTES_WIDTH`]).
pub const TRANSCENDENTAL_CHAIN: usize = 4;

/// The fusion threshold (MiB) that makes every gradient of the models its own all-reduce.
const UNFUSED_MB: f64 = 1e-4;

/// The planner's view of one variant: its job plan's work per task.
fn predicted_work(def_text: &str, v: Variant) -> anyhow::Result<Vec<runtime::TaskWork>> {
    let parsed = dflow_graph::format::parse_json(def_text, None)?;
    let def = parsed.def;
    let graph = dflow_graph::Graph::from_def(&def)?;
    let train = def
        .train
        .as_ref()
        .context("the synthetic model has a train section")?;
    let cluster = dflow_graph::ClusterSpec::local(&[("worker", 2)])?;
    let mut options = StrategyOptions {
        batch_size: Some(v.batch),
        ..StrategyOptions::default()
    };
    if v.unfused {
        options.bucket_bytes = (UNFUSED_MB * (1u64 << 20) as f64) as usize;
    }
    let kind: StrategyKind = "allreduce".parse().map_err(anyhow::Error::msg)?;
    let strategy = kind.build(&options)?;
    let plan = strategy.plan(&JobInput::new(&graph, train, &cluster, "pixels", "labels"))?;
    Ok(runtime::work(&plan, v.batch / 2)?)
}

/// The step (seconds) of one run of variant `v` as a 2-worker job of `epochs` epochs.
fn measured_step(dir: &Path, v: Variant, graph: &Path, epochs: usize) -> anyhow::Result<f64> {
    let exe = std::env::current_exe().context("finding the dflow binary")?;
    let data = dir.join("data.csv");
    {
        let ports: Vec<u16> = (0..2)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
            .collect::<Result<Vec<_>, _>>()
            .context("finding free ports on 127.0.0.1")?
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect::<Result<_, _>>()?;
        let cluster = dir.join("cluster.json");
        std::fs::write(
            &cluster,
            format!(
                "{{\"worker\": [\"127.0.0.1:{}\", \"127.0.0.1:{}\"]}}",
                ports[0], ports[1]
            ),
        )?;
        let mut cmd = Command::new(&exe);
        cmd.args(["run", "--local"])
            .arg(graph)
            .arg("--cluster")
            .arg(&cluster)
            .args(["--strategy", "allreduce", "--data"])
            .arg(&data)
            .args(["--batch-size", &v.batch.to_string()])
            .args(["--epochs", &epochs.to_string()])
            .args(["--test-fraction", "0", "--quiet"]);
        if v.unfused {
            cmd.args(["--fusion-threshold-mb", &UNFUSED_MB.to_string()]);
        }
        let out = cmd.output().context("running a calibration job")?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            bail!("the calibration job {v:?} failed:\n{stderr}");
        }
        stderr
            .lines()
            .find_map(|l| {
                let rest = l.strip_prefix("trained ")?;
                let mut w = rest.split_whitespace();
                let n: f64 = w.next()?.parse().ok()?;
                let secs: f64 = w.nth(2)?.parse().ok()?;
                (n > 0.0).then_some(secs / n)
            })
            .with_context(|| format!("no `trained N steps in T s` line from {v:?}:\n{stderr}"))
    }
}

/// One calibration job's counts (the busiest task's, planner `runtime::work`) and its measured
/// step less its bytes over β.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Row {
    ops: f64,
    calls: f64,
    flops: f64,
    bytes: f64,
    transcendentals: f64,
    seconds: f64,
}

/// Unknowns of the solve: step, op, collective, seconds per FLOP, per byte, per transcendental
/// element.
const UNKNOWNS: usize = 6;

/// The costs that explain six measured steps: `t_i = step + ops_i·op + calls_i·collective + flops_i / flop_rate + bytes_i / byte_rate + tanh_i / element_rate`,
/// solved exactly (Gaussian
/// elimination with partial pivoting); each cost at least 0, the rates positive (0 when the
/// solve gives none).
fn solve(rows: [Row; UNKNOWNS]) -> Option<JobCosts> {
    let mut m: Vec<[f64; UNKNOWNS + 1]> = rows
        .iter()
        .map(|r| {
            [
                1.0,
                r.ops,
                r.calls,
                r.flops,
                r.bytes,
                r.transcendentals,
                r.seconds,
            ]
        })
        .collect();
    for c in 0..UNKNOWNS {
        let pivot = (c..UNKNOWNS).max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))?;
        m.swap(c, pivot);
        let p = m[c][c];
        // Relative to the column's scale: FLOPs and bytes are ~1e6–1e9, the other columns ~1–1e3.
        let scale = m.iter().map(|r| r[c].abs()).fold(0.0, f64::max);
        if scale == 0.0 || p.abs() < 1e-9 * scale {
            return None;
        }
        let pivot_row = m[c];
        for (r, row) in m.iter_mut().enumerate() {
            if r != c {
                let f = row[c] / p;
                for (x, y) in row.iter_mut().zip(pivot_row).skip(c) {
                    *x -= f * y;
                }
            }
        }
    }
    let x: Vec<f64> = (0..UNKNOWNS).map(|c| m[c][UNKNOWNS] / m[c][c]).collect();
    let rate = |s: f64| if s > 0.0 { 1.0 / s } else { 0.0 };
    Some(JobCosts {
        step: x[0].max(0.0),
        op: x[1].max(0.0),
        collective: x[2].max(0.0),
        flops_per_second: rate(x[3]),
        bytes_per_second: rate(x[4]),
        transcendentals_per_second: rate(x[5]),
    })
}

/// A scratch directory under the system's temporary directory, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> anyhow::Result<Scratch> {
        let dir = std::env::temp_dir().join(format!("dflow-calibrate-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating the scratch directory {}", dir.display()))?;
        Ok(Scratch(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Measures the job costs: the four variants' medians of `runs` runs each, solved for
/// [`JobCosts`] under `profile`'s FLOP/s and links. Prints what it measured.
pub fn measure(
    profile: &ClusterProfile,
    runs: usize,
    epochs: usize,
) -> anyhow::Result<(JobCosts, String)> {
    let dir = Scratch::new()?;
    std::fs::write(dir.path().join("data.csv"), data_csv())?;
    let base = Variant {
        batch: BATCH,
        hidden: WIDTH,
        layers: 1,
        chain: 0,
        chain_op: "Relu",
        unfused: false,
    };
    let variants = [
        base,
        Variant {
            chain: CHAIN,
            ..base
        },
        Variant {
            layers: LAYERS,
            unfused: true,
            ..base
        },
        Variant {
            batch: WIDE_BATCH,
            hidden: WIDE,
            layers: 3,
            ..base
        },
        // Bytes: 256 rows × 512 a task (512 KiB tensors), memory-bound ops.
        Variant {
            batch: WIDE_BATCH,
            hidden: BYTES_WIDTH,
            chain: BYTES_CHAIN,
            ..base
        },
        // Transcendentals: `Gelu` (and its gradient) on 256 rows × 512 a task.
        Variant {
            batch: WIDE_BATCH,
            hidden: BYTES_WIDTH,
            chain: TRANSCENDENTAL_CHAIN,
            chain_op: "Gelu",
            ..base
        },
    ];
    let link = profile.link(planner::LinkClass::IntraHost);
    let mut rows = [Row::default(); UNKNOWNS];
    let mut raw = Vec::new();
    let mut jobs = Vec::new();
    for (i, v) in variants.into_iter().enumerate() {
        let text = graph_json(v);
        let graph = dir.path().join(format!("model{i}.json"));
        std::fs::write(&graph, &text)?;
        jobs.push((v, graph, predicted_work(&text, v)?, Vec::new()));
    }
    // Round the variants, so that a change of load falls on all of them.
    for _ in 0..runs.max(1) {
        for (v, graph, _, steps) in jobs.iter_mut() {
            steps.push(measured_step(dir.path(), *v, graph, epochs.max(1))?);
        }
    }
    for (i, (v, _, work, mut steps)) in jobs.into_iter().enumerate() {
        steps.sort_by(f64::total_cmp);
        let t = steps[steps.len() / 2];
        let busiest = work
            .iter()
            .max_by_key(|w| (w.ops, w.collective_calls))
            .context("the calibration job has no tasks")?;
        let rest = busiest.values as f64 * link.latency
            + (busiest.collective_bytes + busiest.data_plane_bytes) as f64 / link.bandwidth;
        eprintln!(
            "# job {v:?}: {} ops, {} collective calls, {:.2} MFLOP in products, {:.2} MB other ops, {:.2} M transcendentals per task; median step {:.1} µs",
            busiest.ops,
            busiest.collective_calls,
            busiest.product_flops as f64 / 1e6,
            busiest.bytes as f64 / 1e6,
            busiest.transcendentals as f64 / 1e6,
            t * 1e6
        );
        raw.push(format!(
            "{} ops/{} calls/{:.1} MFLOP/{:.1} MB/{:.2} M tanh {:.1} µs",
            busiest.ops,
            busiest.collective_calls,
            busiest.product_flops as f64 / 1e6,
            busiest.bytes as f64 / 1e6,
            busiest.transcendentals as f64 / 1e6,
            t * 1e6
        ));
        rows[i] = Row {
            ops: busiest.ops as f64,
            calls: busiest.collective_calls as f64,
            flops: busiest.product_flops as f64,
            bytes: busiest.bytes as f64,
            transcendentals: busiest.transcendentals as f64,
            seconds: t - rest,
        };
    }
    let costs = solve(rows).context("the calibration jobs' counts do not determine the costs")?;
    if costs.flops_per_second == 0.0 || costs.bytes_per_second == 0.0 {
        eprintln!(
            "# warning: a FLOP- or byte-heavy calibration job was not slower than the others \
             explain ({}): the profile leaves that rate at 0 (the lone MatMul's FLOP/s, the \
             analytical compute); a busy machine? calibrate again",
            raw.join(", ")
        );
    }
    Ok((costs, raw.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_solve_returns_the_costs_that_made_the_steps() {
        let truth = JobCosts {
            step: 300e-6,
            op: 0.5e-6,
            collective: 20e-6,
            flops_per_second: 20e9,
            bytes_per_second: 4e9,
            transcendentals_per_second: 0.05e9,
        };
        let t = |ops: f64, calls: f64, flops: f64, bytes: f64, tanh: f64| Row {
            ops,
            calls,
            flops,
            bytes,
            transcendentals: tanh,
            seconds: truth.step
                + ops * truth.op
                + calls * truth.collective
                + flops / truth.flops_per_second
                + bytes / truth.bytes_per_second
                + tanh / truth.transcendentals_per_second,
        };
        let got = solve([
            t(40.0, 2.0, 1e4, 1e4, 0.0),
            t(440.0, 2.0, 1e4, 2e4, 0.0),
            t(120.0, 14.0, 2e4, 3e4, 0.0),
            t(60.0, 2.0, 5e7, 1e6, 0.0),
            t(100.0, 2.0, 1e6, 3e7, 0.0),
            t(80.0, 2.0, 1e6, 1e6, 3e5),
        ])
        .unwrap();
        for (a, b) in [
            (got.step, truth.step),
            (got.op, truth.op),
            (got.collective, truth.collective),
        ] {
            assert!((a - b).abs() < 1e-10, "{got:?}");
        }
        assert!(
            (got.flops_per_second / truth.flops_per_second - 1.0).abs() < 1e-6,
            "{got:?}"
        );
        for (a, b) in [
            (got.bytes_per_second, truth.bytes_per_second),
            (
                got.transcendentals_per_second,
                truth.transcendentals_per_second,
            ),
        ] {
            assert!((a / b - 1.0).abs() < 1e-6, "{got:?}");
        }
        // Counts that cannot tell the costs apart.
        let same = t(40.0, 2.0, 1e4, 1e4, 0.0);
        assert!(solve([same; UNKNOWNS]).is_none());
    }

    #[test]
    fn the_synthetic_models_plan() {
        let base = Variant {
            batch: BATCH,
            hidden: WIDTH,
            layers: 1,
            chain: 0,
            chain_op: "Relu",
            unfused: false,
        };
        let chain = Variant { chain: 20, ..base };
        let many = Variant {
            layers: 4,
            unfused: true,
            ..base
        };
        let wide = Variant {
            batch: WIDE_BATCH,
            hidden: BYTES_WIDTH,
            chain: 2,
            ..base
        };
        let gelu = Variant {
            chain_op: "Gelu",
            ..wide
        };
        let w0 = predicted_work(&graph_json(base), base).unwrap();
        let w1 = predicted_work(&graph_json(chain), chain).unwrap();
        let w2 = predicted_work(&graph_json(many), many).unwrap();
        let w4 = predicted_work(&graph_json(wide), wide).unwrap();
        let w5 = predicted_work(&graph_json(gelu), gelu).unwrap();
        assert_eq!(w0.len(), 2);
        assert!(w1[0].ops > w0[0].ops + 20, "{w1:?} {w0:?}");
        assert_eq!(w1[0].collective_calls, w0[0].collective_calls);
        // Every gradient its own call, plus the loss.
        assert_eq!(w2[0].collective_calls, 4 + 1 + 1, "{w2:?}");
        // A Relu on 256 × 512 reads and writes 1 MiB: two of them, forward and backward, more.
        assert!(w4[0].bytes > w0[0].bytes + 4 * (1 << 20), "{w4:?}");
        assert_eq!(w4[0].transcendentals, 0, "{w4:?}");
        // Two Gelu of 256 × 512 elements, and their gradients.
        assert_eq!(w5[0].transcendentals, 2 * 2 * 256 * 512, "{w5:?}");
        // The 256 × 8 · 8 × 512 product a task, forward and backward.
        assert!(w4[0].product_flops >= 2 * 256 * 8 * 512, "{w4:?}");
    }
}
