//! `dflow bench calibrate`'s measurement of a real job's step path (the planner's
//! [`JobCosts`]): the per-step, per-task, per-op and per-collective-call costs of dflow's
//! distributed step, which dominate a small model's step time on this machine, and the rates a
//! task of a job gets on each kind of op (products, memory-bound ops, transcendental ops).
//!
//! It runs [`JOBS`] synthetic models (`MatMul`s from 8 features, a chain of elementwise ops,
//! SGD or Adam) as real jobs on 127.0.0.1, one `dflow run --job worker` process a task as a
//! cluster runs them, each `--runs` times, and takes each one's median step
//! (the median interval between its steps, `step time: median X µs`). The jobs vary one kind of work at a time
//! against a small base: more ops (a chain of [`CHAIN`] `Relu`), more collective calls
//! ([`LAYERS`] layers, every gradient its own all-reduce), many small products (the same
//! layers in one fused all-reduce: a product's floor beside its FLOPs), product FLOPs (3 layers of [`WIDE`]
//! channels on 256 rows a task), memory-bound bytes ([`BYTES_CHAIN`] `Relu` on 256 ×
//! [`BYTES_WIDTH`]), transcendental elements ([`TRANSCENDENTAL_CHAIN`] `Gelu`), the bytes of a large gradient all-reduce
//! (2 layers of [`WIDE`] channels on 2 rows a task: 272 KiB a step); and they vary
//! the shape of the job: 4 tasks on the host's cores (the base, the chain and the products
//! again), calls between computations (ZeRO-3 on a [`DEEP`]-layer MLP: an all-gather before
//! every layer's product, forward and backward; on 2 tasks and on 4 sharing the 2 cores) and a
//! pipeline (2 stages of a [`DEEP`]-layer MLP, 4 and 8 micro-batches: the values between
//! stages); 8 tasks on the 2 cores (the
//! base on 8 tasks; 4 replicas of the 2-stage pipeline); and the op kinds of a
//! transformer (one small [`TRANSFORMER`] block, data parallel on 2 tasks: layer norms,
//! attention's batched products, softmax, reshapes, AdamW and clipping, and their fan-outs,
//! each of which the executor hands to its pool; and tensor parallel (tp=2) in 2 replicas on
//! 4 tasks: all-reduces between computations, on the step's path, on shared cores). The runs go
//! round the jobs (one run of each, `--runs` times), so that a change of the machine's load
//! falls on all of them. The planner's own counts of each job plan (planner `runtime::work`)
//! turn each median into one equation of the model of planner `runtime::job_step`; planner
//! `runtime::fit_job_costs` fits the costs to all of them by non-negative least squares on
//! relative errors. None of these models is one the planner is later compared against
//! (docs/planner.md): the comparison is not circular.

use anyhow::{bail, Context};
use dflow_partitioner::planner::{self, accounting, runtime, ClusterProfile, JobCosts, Layout};
use std::path::Path;
use std::process::{Command, Stdio};

/// Features of the synthetic models (rows × 8 elements: small, batched ops as in the small
/// models the planner is checked on).
const WIDTH: usize = 8;
/// `Relu` ops of the chain job (16 rows × 8 a task: more nodes, few bytes).
pub const CHAIN: usize = 800;
/// Layers of the many-calls job.
pub const LAYERS: usize = 24;
/// Layers of the ZeRO-3 and pipeline jobs (of [`DEEP_WIDTH`] channels).
pub const DEEP: usize = 6;
/// Channels of the ZeRO-3 and pipeline jobs' layers.
const DEEP_WIDTH: usize = 64;
/// The global batch of the small calibration jobs.
const BATCH: usize = 32;
/// Rows of the synthetic data set (16 steps an epoch at batch 32; `--job-epochs` 100, 1,600
/// steps a job: the job prints its time to 10 ms, so a step to ~6 µs).
const ROWS: usize = 512;
/// Hidden width of the FLOP-heavy job's layers.
pub const WIDE: usize = 256;
/// The FLOP-heavy job's global batch (the whole data set: 256 rows a task on 2 tasks,
/// products the size of a small transformer's).
const WIDE_BATCH: usize = ROWS;
/// The gradient-bytes job's global batch: 2 rows a task, so that its 2 layers of [`WIDE`]
/// channels (272 KiB of gradients, one fused all-reduce) cost little but their bytes.
const GRADIENT_BATCH: usize = 4;
/// Width of the memory-bound job (256 rows a task × 512: 512 KiB a tensor).
pub const BYTES_WIDTH: usize = 512;
/// `Relu` ops of its chain.
pub const BYTES_CHAIN: usize = 20;
/// `Gelu` ops of the transcendental job (256 rows a task × [`BYTES_WIDTH`]).
pub const TRANSCENDENTAL_CHAIN: usize = 4;
/// The fusion threshold (MiB) that makes every gradient of the models its own all-reduce.
const UNFUSED_MB: f64 = 1e-4;

/// One synthetic job.
#[derive(Debug, Clone, Copy)]
struct Variant {
    /// A name for reports.
    name: &'static str,
    /// The layout it runs as (`dp=N`, `dp=2,zero=3`, `pp=2,m=4`).
    layout: &'static str,
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
    /// A small transformer ([`TRANSFORMER`]) in place of the MLP (`hidden`, `layers`, `chain`
    /// unused): the op kinds a GPT dispatches (layer norms, attention's batched products,
    /// softmax, reshapes, the embedding's gather), not a `Relu` chain's.
    transformer: bool,
}

impl Variant {
    /// The parsed layout.
    fn layout(&self) -> anyhow::Result<Layout> {
        self.layout
            .parse()
            .map_err(|e| anyhow::anyhow!("calibration layout {}: {e}", self.layout))
    }

    /// The optimizer: Adam where ZeRO needs its slots, else SGD.
    fn optimizer(&self) -> serde_json::Value {
        if self.layout.contains("zero") {
            serde_json::json!({"type": "adam", "lr": 0.001})
        } else {
            serde_json::json!({"type": "sgd", "lr": 0.01})
        }
    }
}

/// The base job: one product over the 8 features, 2 tasks, SGD.
const BASE: Variant = Variant {
    name: "base",
    layout: "dp=2",
    batch: BATCH,
    hidden: WIDTH,
    layers: 1,
    chain: 0,
    chain_op: "Relu",
    unfused: false,
    transformer: false,
};

/// The transformer job's model: one block of 16 channels, 2 heads, a context of 16 characters
/// (none of the planner's comparison models: those are 2 × 32 over 8 characters and the
/// bundled 4 × 128 over 64).
const TRANSFORMER: dflow_graph::layers::GptConfig = dflow_graph::layers::GptConfig {
    vocab_size: 32,
    block_size: 16,
    n_layer: 1,
    n_head: 2,
    n_embd: 16,
    dropout: 0.0,
    bias: true,
    tie_weights: true,
    seed: 7,
    learning_rate: 1e-3,
    min_lr: 1e-4,
    warmup_steps: 0,
    decay_steps: 0,
    weight_decay: 0.1,
    beta1: 0.9,
    beta2: 0.99,
    grad_clip: Some(1.0),
    moe: None,
};

/// Sequences a step of the transformer job (2 a task).
const TRANSFORMER_BATCH: usize = 4;

/// The calibration jobs (see the module): none is a model of the planner's comparison table.
const JOBS: [Variant; 19] = [
    BASE,
    Variant {
        name: "chain",
        chain: CHAIN,
        ..BASE
    },
    Variant {
        name: "calls",
        layers: LAYERS,
        unfused: true,
        ..BASE
    },
    Variant {
        name: "small products",
        layers: LAYERS,
        ..BASE
    },
    Variant {
        name: "products",
        batch: WIDE_BATCH,
        hidden: WIDE,
        layers: 3,
        ..BASE
    },
    Variant {
        name: "bytes",
        batch: WIDE_BATCH,
        hidden: BYTES_WIDTH,
        chain: BYTES_CHAIN,
        ..BASE
    },
    Variant {
        name: "gelu",
        batch: WIDE_BATCH,
        hidden: BYTES_WIDTH,
        chain: TRANSCENDENTAL_CHAIN,
        chain_op: "Gelu",
        ..BASE
    },
    Variant {
        name: "gradient bytes",
        batch: GRADIENT_BATCH,
        hidden: WIDE,
        layers: 2,
        ..BASE
    },
    Variant {
        name: "base 4 tasks",
        layout: "dp=4",
        ..BASE
    },
    Variant {
        name: "chain 4 tasks",
        layout: "dp=4",
        chain: CHAIN / 2,
        ..BASE
    },
    Variant {
        name: "products 4 tasks",
        layout: "dp=4",
        batch: WIDE_BATCH,
        hidden: WIDE,
        layers: 3,
        ..BASE
    },
    Variant {
        name: "zero-3 (calls between products)",
        layout: "dp=2,zero=3",
        hidden: DEEP_WIDTH,
        layers: DEEP,
        ..BASE
    },
    Variant {
        name: "zero-3 4 tasks (calls between products on shared cores)",
        layout: "dp=4,zero=3",
        hidden: DEEP_WIDTH,
        layers: DEEP,
        ..BASE
    },
    Variant {
        name: "pipeline",
        layout: "pp=2,m=4",
        hidden: DEEP_WIDTH,
        layers: DEEP,
        ..BASE
    },
    Variant {
        name: "pipeline, 8 micro-batches",
        layout: "pp=2,m=8",
        hidden: DEEP_WIDTH,
        layers: DEEP,
        ..BASE
    },
    Variant {
        name: "base 8 tasks",
        layout: "dp=8",
        ..BASE
    },
    Variant {
        name: "pipeline 8 tasks (4 replicas of 2 stages)",
        layout: "dp=4,pp=2,m=2",
        hidden: DEEP_WIDTH,
        layers: DEEP,
        ..BASE
    },
    Variant {
        name: "transformer",
        batch: TRANSFORMER_BATCH,
        transformer: true,
        ..BASE
    },
    Variant {
        name: "transformer, tp=2 in 2 replicas (calls between computations on shared cores)",
        layout: "dp=2,tp=2",
        batch: TRANSFORMER_BATCH,
        transformer: true,
        ..BASE
    },
];

/// The model: `layers` products to `hidden` channels, a chain of `chain` `chain_op`, a
/// `[hidden, 2]` output, the softmax cross-entropy's mean (or the [`TRANSFORMER`]).
fn graph_json(v: Variant) -> anyhow::Result<String> {
    if v.transformer {
        let gpt = dflow_graph::layers::gpt(&TRANSFORMER)
            .map_err(|e| anyhow::anyhow!("the calibration transformer: {e}"))?;
        return Ok(dflow_graph::format::to_json(&gpt.def));
    }
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
    Ok(serde_json::json!({
        "format": "dflow-graph",
        "version": 1,
        "nodes": nodes,
        "train": {"loss": "loss", "optimizer": v.optimizer()}
    })
    .to_string())
}

/// The transformer job's corpus: 64 KiB of a deterministic sequence over 26 letters, a space
/// and 5 punctuation marks (fewer characters than [`TRANSFORMER`]'s vocabulary).
fn text_corpus() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz .,;!?";
    let mut state: u32 = 12345;
    (0..65536)
        .map(|_| {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
            ALPHABET[(state >> 16) as usize % ALPHABET.len()] as char
        })
        .collect()
}

/// The feeds of `v`'s model: its inputs and its labels.
fn feeds(v: Variant) -> (&'static str, &'static str) {
    if v.transformer {
        ("idx", "targets")
    } else {
        ("pixels", "labels")
    }
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

/// The planner's view of one job: its job plan's work per task and its pipeline bubble.
fn predicted_work(def_text: &str, v: Variant) -> anyhow::Result<(Vec<runtime::TaskWork>, f64)> {
    let parsed = dflow_graph::format::parse_json(def_text, None)?;
    let def = parsed.def;
    let graph = dflow_graph::Graph::from_def(&def)?;
    let train = def
        .train
        .as_ref()
        .context("the synthetic model has a train section")?;
    let layout = v.layout()?;
    let mesh = layout.mesh;
    let (kind, mut options) = accounting::strategy_for(&layout, v.batch)?;
    if v.unfused {
        options.bucket_bytes = (UNFUSED_MB * (1u64 << 20) as f64) as usize;
    }
    let workers = u32::try_from(mesh.size()).context("calibration mesh too large")?;
    let cluster = dflow_graph::ClusterSpec::local(&[("worker", workers)])?;
    let strategy = kind.build(&options)?;
    let (inputs, labels) = feeds(v);
    let input = dflow_partitioner::strategy::JobInput::new(&graph, train, &cluster, inputs, labels);
    let plan = strategy.plan(&input)?;
    // Each task is fed its replica's rows (a pipeline's micro-batches are nodes of its plan).
    let rows = v.batch / mesh.dp.max(1);
    let bubble = if mesh.pp > 1 {
        let (p, m) = (mesh.pp as f64, layout.micro_batches as f64);
        (p - 1.0) / (m + p - 1.0)
    } else {
        0.0
    };
    Ok((runtime::work(&plan, rows)?, bubble))
}

/// A cluster file of `n` workers on free ports of 127.0.0.1.
fn cluster_file(dir: &Path, n: usize) -> anyhow::Result<std::path::PathBuf> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()
        .context("finding free ports on 127.0.0.1")?;
    let addresses = listeners
        .iter()
        .map(|l| l.local_addr().map(|a| format!("127.0.0.1:{}", a.port())))
        .collect::<Result<Vec<_>, _>>()?;
    let cluster = dir.join("cluster.json");
    std::fs::write(
        &cluster,
        serde_json::json!({ "worker": addresses }).to_string(),
    )?;
    Ok(cluster)
}

/// The step (seconds) of a job: the median interval between its steps (`step time: median X
/// µs`, [`super::step_clock`]: a steady step, as the planner predicts one), else the mean of
/// its `trained N steps in T s` line (a job of one step).
fn step_of(v: Variant, stderr: &str) -> anyhow::Result<f64> {
    let median = stderr.lines().find_map(|l| {
        let rest = l.strip_prefix("step time: median ")?;
        let us: f64 = rest.split_whitespace().next()?.parse().ok()?;
        (us > 0.0).then_some(us * 1e-6)
    });
    let mean = || {
        stderr.lines().find_map(|l| {
            let rest = l.strip_prefix("trained ")?;
            let mut w = rest.split_whitespace();
            let n: f64 = w.next()?.parse().ok()?;
            let secs: f64 = w.nth(2)?.parse().ok()?;
            (n > 0.0).then_some(secs / n)
        })
    };
    median.or_else(mean).with_context(|| {
        format!(
            "no `step time: median X µs` or `trained N steps in T s` line from the calibration job {}:\n{stderr}",
            v.name
        )
    })
}

/// How long a calibration job may take before it is taken to hang.
const JOB_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Waits for `child` at most [`JOB_TIMEOUT`]; kills it past that.
fn wait_bounded(
    mut child: std::process::Child,
    what: &str,
) -> anyhow::Result<std::process::Output> {
    let start = std::time::Instant::now();
    loop {
        if child.try_wait()?.is_some() {
            return Ok(child.wait_with_output()?);
        }
        if start.elapsed() > JOB_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the calibration job {what} took over {} s: killed (a hung worker? a busy machine?)",
                JOB_TIMEOUT.as_secs()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The step (seconds) of one run of job `v` of `epochs` epochs, one `dflow run --job worker`
/// process a task.
fn measured_step(dir: &Path, v: Variant, graph: &Path, epochs: usize) -> anyhow::Result<f64> {
    let exe = std::env::current_exe().context("finding the dflow binary")?;
    let data = dir.join(if v.transformer {
        "corpus.txt"
    } else {
        "data.csv"
    });
    let layout = v.layout()?;
    let mesh = layout.mesh;
    let cluster = cluster_file(dir, mesh.size())?;
    // One process a task, as a job runs on a cluster: the chief (task 0) runs the job, the
    // others serve it.
    let mut others = Vec::new();
    for index in 1..mesh.size() {
        let other = Command::new(&exe)
            .args(["run", "--job", "worker", "--index", &index.to_string()])
            .arg("--cluster")
            .arg(&cluster)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting task {index} of the calibration job {}", v.name))?;
        others.push(other);
    }
    let mut cmd = Command::new(&exe);
    cmd.args(["run", "--job", "worker", "--index", "0", "--cluster"])
        .arg(&cluster)
        .arg(graph);
    if mesh.pp > 1 {
        cmd.args(["--mesh", &format!("dp={},pp={}", mesh.dp, mesh.pp)])
            .args(["--micro-batches", &layout.micro_batches.to_string()]);
    } else if mesh.tp > 1 {
        cmd.args(["--mesh", &format!("dp={},tp={}", mesh.dp, mesh.tp)]);
    } else if layout.zero > 0 {
        cmd.args([
            "--strategy",
            "zero",
            "--zero-stage",
            &layout.zero.to_string(),
        ]);
    } else {
        cmd.args(["--strategy", "allreduce"]);
    }
    cmd.arg("--data")
        .arg(&data)
        .args(["--batch-size", &v.batch.to_string()])
        .args(["--quiet"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if v.transformer {
        // As many steps as an epoch of the MLP jobs' rows, evaluation only once at the end.
        let steps = epochs * (ROWS / BATCH);
        cmd.args(["--steps", &steps.to_string()]).args([
            "--eval-every",
            "0",
            "--eval-batches",
            "1",
        ]);
    } else {
        cmd.args(["--epochs", &epochs.to_string()])
            .args(["--test-fraction", "0"]);
    }
    if v.unfused {
        cmd.args(["--fusion-threshold-mb", &UNFUSED_MB.to_string()]);
    }
    let chief = cmd.spawn().context("running a calibration job")?;
    let out = wait_bounded(chief, v.name);
    let mut failed = Vec::new();
    for other in others {
        match wait_bounded(other, v.name) {
            Ok(o) if o.status.success() => {}
            Ok(o) => failed.push(String::from_utf8_lossy(&o.stderr).into_owned()),
            Err(e) => failed.push(e.to_string()),
        }
    }
    let out = out?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || !failed.is_empty() {
        bail!(
            "the calibration job {} ({}) failed:\n{stderr}{}",
            v.name,
            v.layout,
            failed.join("\n")
        );
    }
    step_of(v, &stderr)
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

/// Where the fit starts choosing each job's busiest task and branches (then at its own costs):
/// figures of the order this machine shows.
const START: JobCosts = JobCosts {
    step: 150e-6,
    task: 10e-6,
    op: 0.2e-6,
    collective: 15e-6,
    value: 25e-6,
    product: 1e-6,
    beyond_cores: 2e-6,
    spawn: 1e-6,
    beyond_cores_per_flop: 2e-12,
    transfer_per_byte: 0.2e-9,
    flops_per_second: 50e9,
    bytes_per_second: 12e9,
    transcendentals_per_second: 150e6,
};

/// Measures the job costs: the [`JOBS`]' medians of `runs` runs each, fitted to
/// [`JobCosts`] under `profile`'s intra-host link and devices per host. Prints what it
/// measured and each job's error under the fit.
pub fn measure(
    profile: &ClusterProfile,
    runs: usize,
    epochs: usize,
) -> anyhow::Result<(JobCosts, String)> {
    let dir = Scratch::new()?;
    std::fs::write(dir.path().join("data.csv"), data_csv())?;
    std::fs::write(dir.path().join("corpus.txt"), text_corpus())?;
    let mut jobs = Vec::new();
    for (i, v) in JOBS.into_iter().enumerate() {
        let text = graph_json(v)?;
        let graph = dir.path().join(format!("model{i}.json"));
        std::fs::write(&graph, &text)?;
        let (work, bubble) = predicted_work(&text, v)
            .with_context(|| format!("planning the calibration job {} ({})", v.name, v.layout))?;
        jobs.push((v, graph, work, bubble, Vec::new()));
    }
    // Round the jobs, so that a change of load falls on all of them.
    for _ in 0..runs.max(1) {
        for (v, graph, _, _, steps) in jobs.iter_mut() {
            steps.push(measured_step(dir.path(), *v, graph, epochs.max(1))?);
        }
    }
    let mut measured = Vec::new();
    for (v, _, work, bubble, mut steps) in jobs {
        steps.sort_by(f64::total_cmp);
        let t = steps[steps.len() / 2];
        measured.push((
            v,
            runtime::CalibrationJob {
                name: format!("{} ({})", v.name, v.layout),
                work,
                bubble,
                seconds: t,
            },
            steps,
        ));
    }
    let link = profile.link(planner::LinkClass::IntraHost);
    let calibration: Vec<runtime::CalibrationJob> =
        measured.iter().map(|(_, j, _)| j.clone()).collect();
    let (costs, fit) = runtime::fit_job_costs(&calibration, profile.devices_per_host, link, &START)
        .context("fitting the job costs to the calibration jobs")?;
    let mut raw = Vec::new();
    for ((v, job, steps), error) in measured.iter().zip(&fit.relative_errors) {
        let busiest = job
            .work
            .iter()
            .max_by_key(|w| (w.ops, w.collective_calls))
            .context("the calibration job has no tasks")?;
        eprintln!(
            "# job {}: {} tasks; busiest {} ops, {} calls ({} messages, {} on the path) + {} values sent/received, {} nodes spawned alone, {:.2} MFLOP in products, {:.2} MB other ops, {:.2} M transcendentals; step median {:.1} µs ({:.1}–{:.1}), fit {:+.0}%",
            job.name,
            job.work.len(),
            busiest.ops,
            busiest.collective_calls,
            busiest.collective_messages,
            busiest.path_messages,
            busiest.values + busiest.received,
            busiest.spawns,
            busiest.product_flops as f64 / 1e6,
            busiest.bytes as f64 / 1e6,
            busiest.transcendentals as f64 / 1e6,
            job.seconds * 1e6,
            steps.first().copied().unwrap_or(f64::NAN) * 1e6,
            steps.last().copied().unwrap_or(f64::NAN) * 1e6,
            error * 100.0
        );
        raw.push(format!(
            "{} {:.1} µs (fit {:+.0}%)",
            v.name,
            job.seconds * 1e6,
            error * 100.0
        ));
    }
    let worst = fit
        .relative_errors
        .iter()
        .fold(0.0f64, |a, e| a.max(e.abs()));
    eprintln!(
        "# the fit explains the {} calibration jobs within {:.0}% (worst)",
        calibration.len(),
        worst * 100.0
    );
    if costs.flops_per_second == 0.0
        || costs.bytes_per_second == 0.0
        || costs.transcendentals_per_second == 0.0
    {
        eprintln!(
            "# warning: a FLOP-, byte- or transcendental-heavy calibration job was not slower \
             than the others explain ({}): the profile leaves that rate at 0 (not modelled); a \
             busy machine? calibrate again",
            raw.join(", ")
        );
    }
    Ok((costs, raw.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jobs_step_is_its_median_line_else_its_mean_and_none_is_an_error() {
        let v = JOBS[0];
        let both = "trained 1000 steps in 0.500 s (1 tokens/s)\nstep time: median 412.5 µs (p10 400.0, p90 900.0) over 999 steps\n";
        assert!((step_of(v, both).unwrap() - 412.5e-6).abs() < 1e-12);
        let mean = "trained 1000 steps in 0.500 s (1 tokens/s)\n";
        assert!((step_of(v, mean).unwrap() - 500e-6).abs() < 1e-12);
        let e = step_of(v, "error: the chief failed\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains(v.name) && e.contains("step time"), "{e}");
    }

    #[test]
    fn the_calibration_jobs_plan_and_vary_their_work() {
        let small = |v: Variant| Variant {
            chain: v.chain.min(20),
            layers: v.layers.min(4),
            ..v
        };
        let work: Vec<(Variant, Vec<runtime::TaskWork>, f64)> = JOBS
            .into_iter()
            .map(|v| {
                let v = small(v);
                let (w, b) = predicted_work(&graph_json(v).unwrap(), v).unwrap();
                (v, w, b)
            })
            .collect();
        let by = |name: &str| {
            work.iter()
                .find(|(v, _, _)| v.name == name)
                .unwrap_or_else(|| panic!("{name}"))
        };
        let (_, base, _) = by("base");
        let (_, chain, _) = by("chain");
        let (_, calls, _) = by("calls");
        let (_, bytes, _) = by("bytes");
        let (_, gelu, _) = by("gelu");
        assert_eq!(base.len(), 2);
        assert!(chain[0].ops > base[0].ops + 20, "{chain:?} {base:?}");
        assert_eq!(chain[0].collective_calls, base[0].collective_calls);
        // Every gradient its own call, plus the loss.
        assert_eq!(calls[0].collective_calls, 4 + 1 + 1, "{calls:?}");
        // The same layers fused: as many products, far fewer calls.
        let (_, small, _) = by("small products");
        assert_eq!(small[0].products, calls[0].products, "{small:?}");
        assert!(small[0].products > 2 * base[0].products, "{small:?}");
        assert!(
            small[0].collective_calls < calls[0].collective_calls,
            "{small:?}"
        );
        // A Relu on 256 × 512 reads and writes 1 MiB: twenty of them, forward and backward, more.
        assert!(bytes[0].bytes > base[0].bytes + 4 * (1 << 20), "{bytes:?}");
        assert_eq!(bytes[0].transcendentals, 0, "{bytes:?}");
        // Four Gelu of 256 × 512 elements, and their gradients.
        assert_eq!(gelu[0].transcendentals, 2 * 4 * 256 * 512, "{gelu:?}");
        // The 256 × 8 · 8 × 512 product a task, forward and backward.
        assert!(bytes[0].product_flops >= 2 * 256 * 8 * 512, "{bytes:?}");
        assert_eq!(by("base 4 tasks").1.len(), 4);
        // ZeRO-3 gathers every layer's weight before its use: calls among the products.
        let (_, zero, _) = by("zero-3 (calls between products)");
        assert!(zero[0].collective_calls > 2 * 4, "{zero:?}");
        // The pipeline: 2 stages that send to each other, a bubble of 1/5.
        let (_, pipe, bubble) = by("pipeline");
        assert_eq!(pipe.len(), 2, "{pipe:?}");
        assert!(
            pipe[0].values > 0 && pipe[0].received == pipe[1].values,
            "{pipe:?}"
        );
        assert!((bubble - 0.2).abs() < 1e-12, "{bubble}");
        // Four more micro-batches: four more activations from the first stage, four more
        // gradients back to it.
        let (_, pipe8, _) = by("pipeline, 8 micro-batches");
        assert_eq!(pipe8[0].values, pipe[0].values + 4, "{pipe8:?} {pipe:?}");
        assert_eq!(
            pipe8[0].received,
            pipe[0].received + 4,
            "{pipe8:?} {pipe:?}"
        );
        // Eight tasks on the two cores: the base, and 4 replicas of a 2-stage pipeline whose
        // stages send to each other.
        assert_eq!(by("base 8 tasks").1.len(), 8);
        let (_, pipe8x, _) = by("pipeline 8 tasks (4 replicas of 2 stages)");
        assert_eq!(pipe8x.len(), 8, "{pipe8x:?}");
        assert!(
            pipe8x.iter().all(|t| t.values > 0 && t.received > 0),
            "{pipe8x:?}"
        );
        // The transformer: batched products (attention), Gelu's transcendental elements, and
        // more ops than the base.
        let (_, gpt_tp, _) =
            by("transformer, tp=2 in 2 replicas (calls between computations on shared cores)");
        assert_eq!(gpt_tp.len(), 4, "{gpt_tp:?}");
        assert!(gpt_tp.iter().all(|t| t.path_messages > 4), "{gpt_tp:?}");
        let (_, gpt, _) = by("transformer");
        assert_eq!(gpt.len(), 2, "{gpt:?}");
        assert!(gpt[0].ops > 4 * base[0].ops, "{gpt:?}");
        assert!(gpt[0].products > 8 && gpt[0].transcendentals > 0, "{gpt:?}");
        assert!(gpt[0].spawns > chain[0].spawns + 10, "{gpt:?} {chain:?}");
        assert_eq!(gpt[0].path_messages, 0, "{gpt:?}");
        // Four tasks on the two cores, each gathering before every layer.
        let (_, zero4, _) = by("zero-3 4 tasks (calls between products on shared cores)");
        assert_eq!(zero4.len(), 4);
        assert_eq!(
            zero4[0].collective_calls, zero[0].collective_calls,
            "{zero4:?}"
        );
        // The full-size jobs determine the thirteen costs (no cost the others explain).
        let full: Vec<runtime::CalibrationJob> = JOBS
            .into_iter()
            .map(|v| {
                let (w, b) = predicted_work(&graph_json(v).unwrap(), v).unwrap();
                runtime::CalibrationJob {
                    name: v.name.into(),
                    seconds: 1e-3,
                    work: w,
                    bubble: b,
                }
            })
            .collect();
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let link = profile.link(planner::LinkClass::IntraHost);
        let obs: Vec<planner::fit::Observation> = full
            .iter()
            .map(|j| {
                let t = runtime::job_terms(&j.work, j.bubble, 2, link, &START);
                planner::fit::Observation {
                    name: j.name.clone(),
                    counts: t.counts.to_vec(),
                    fixed: t.fixed,
                    seconds: j.seconds,
                }
            })
            .collect();
        planner::fit::check_design(&obs, &runtime::JOB_UNKNOWNS).unwrap();
    }
}
