//! `dflow bench calibrate`: measures this machine and writes the planner's cluster profile
//! (`dflow plan --profile FILE`), so the cost model's constants are this machine's, not a
//! preset's.
//!
//! What it measures:
//! - **FLOP/s of one device**: dflow's `MatMul` kernel (the `gemm` crate) on the calling thread
//!   (one device = one worker process on one core) over the products a small transformer runs
//!   (token-major activations times weight matrices, forward and both gradient layouts) and a
//!   512³ square; per shape the median of `--iters` calls, and the profile takes the median
//!   rate over the shapes.
//! - **The two link classes** from dflow's own all-reduce between child processes: over shared
//!   memory (`intra_host`) and over TCP on 127.0.0.1 (`inter_host`, standing for the link
//!   between hosts). The planner costs a message as `α + bytes/β` (planner/collective.rs), and
//!   all-reduce as dflow runs it: recursive doubling (`⌈log₂ n⌉` rounds) for small sizes, a ring
//!   (`2(n−1)` steps of `S/n` bytes) for large ones. So α is the small all-reduce's time over its
//!   rounds, and β the large one's ring bytes per rank over its time less the ring's `2(n−1)·α`.
//! - **Memory per device**: `MemTotal` of `/proc/meminfo` over the devices per host (or
//!   `--memory-per-device`).
//!
//! The figures depend on the load at the time: the profile's `source` records the date, the
//! load average and the medians it was fitted to.

use super::bench_collective::all_reduce_medians;
use anyhow::{bail, Context};
use dflow_graph::ops::gemm::{matmul, MatView, Threads};
use dflow_partitioner::planner::{ClusterProfile, JobCosts, Link, Precision};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `dflow bench calibrate`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Write the profile (JSON) here; without it, the profile is printed.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The profile's name.
    #[arg(long, default_value = "calibrated")]
    pub name: String,
    /// Devices per host (default: the CPUs this process may use; one worker per core).
    #[arg(long)]
    pub devices_per_host: Option<usize>,
    /// Memory per device in bytes (default: MemTotal over the devices per host).
    #[arg(long)]
    pub memory_per_device: Option<u64>,
    /// Ranks of the all-reduce measurements.
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// The large all-reduce's size in bytes (the bandwidth point).
    #[arg(long, default_value_t = 16 << 20)]
    pub large_bytes: usize,
    /// Timed calls per measurement (matrix products and all-reduces).
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Runs of each synthetic calibration job (2 and 4 tasks, ZeRO-3, a pipeline; the median
    /// counts); 0 skips them (the profile's `job` costs stay 0).
    #[arg(long, default_value_t = 3)]
    pub job_runs: usize,
    /// Epochs of each calibration job over its 512 rows (16 steps an epoch at batch 32).
    #[arg(long, default_value_t = 100)]
    pub job_epochs: usize,
}

/// The products measured: `[m, k] · [k, n]` with the right operand transposed or not, as a
/// transformer's linear layers run them (forward x·Wᵀ, input gradient dy·W, weight gradient
/// dyᵀ·x) at 768 tokens and 128/384 channels, and a 512³ square.
const SHAPES: [(usize, usize, usize, Layout); 4] = [
    (768, 128, 384, Layout::RightTransposed),
    (768, 384, 128, Layout::Plain),
    (384, 768, 128, Layout::LeftTransposed),
    (512, 512, 512, Layout::Plain),
];

/// Which operand is read through a transposed view.
#[derive(Debug, Clone, Copy)]
enum Layout {
    Plain,
    LeftTransposed,
    RightTransposed,
}

/// Deterministic values in [-0.5, 0.5) (xorshift): the products' speed does not depend on them.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s as f32 / u32::MAX as f32) - 0.5
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Median FLOP/s (2·m·n·k per product) of one shape on the calling thread.
fn product_rate(m: usize, k: usize, n: usize, layout: Layout, iters: usize) -> anyhow::Result<f64> {
    let (a, b) = (values(m * k, 1), values(k * n, 2));
    let mut out = vec![0.0f32; m * n];
    let (left, right) = match layout {
        Layout::Plain => (
            MatView::row_major(&a, 0, (m, k), false),
            MatView::row_major(&b, 0, (k, n), false),
        ),
        Layout::LeftTransposed => (
            MatView::row_major(&a, 0, (k, m), true),
            MatView::row_major(&b, 0, (k, n), false),
        ),
        Layout::RightTransposed => (
            MatView::row_major(&a, 0, (m, k), false),
            MatView::row_major(&b, 0, (n, k), true),
        ),
    };
    // One untimed call warms the caches and the kernel dispatch.
    matmul(left, right, &mut out, Threads::Caller).map_err(anyhow::Error::msg)?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        matmul(left, right, &mut out, Threads::Caller).map_err(anyhow::Error::msg)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (m * n * k) as f64 / median(times))
}

/// Rounds of dflow's small all-reduce (recursive doubling over the largest power of two, plus
/// a fold in and out when `n` is not one).
fn small_rounds(n: usize) -> f64 {
    let pow = usize::BITS - 1 - n.max(1).leading_zeros();
    let folds = if n.is_power_of_two() { 0 } else { 2 };
    f64::from(pow) + f64::from(folds)
}

/// The α-β link that explains a small and a large all-reduce's medians over `n` ranks.
fn fit_link(n: usize, small_seconds: f64, large_bytes: usize, large_seconds: f64) -> Link {
    let latency = small_seconds / small_rounds(n).max(1.0);
    let steps = 2.0 * (n as f64 - 1.0);
    let ring_bytes = steps * large_bytes as f64 / n as f64;
    // At least half the measured time is transfer: a latency estimate inflated by load must not
    // leave a negative or absurdly small transfer time.
    let transfer = (large_seconds - steps * latency).max(0.5 * large_seconds);
    Link {
        bandwidth: ring_bytes / transfer,
        latency,
    }
}

/// Bytes of memory of this machine (`MemTotal` in /proc/meminfo).
fn mem_total() -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let kib = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("/proc/meminfo has no MemTotal line; give --memory-per-device")?;
    Ok(kib.saturating_mul(1024))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}

/// Measures the link of one transport: (small median, large median) seconds.
fn measure_link(transport: &str, args: &Args) -> anyhow::Result<(f64, f64)> {
    let sizes = [4, args.large_bytes];
    let rows = all_reduce_medians(transport, args.ranks, &sizes, args.iters, 3)
        .with_context(|| format!("measuring all-reduce over {transport}"))?;
    match rows[..] {
        [(_, small), (_, large)] if small > 0.0 && large > 0.0 => Ok((small, large)),
        _ => bail!("the {transport} all-reduce measurement returned {rows:?}"),
    }
}

/// Runs `dflow bench calibrate`.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.ranks < 2 {
        bail!("--ranks must be at least 2 (a link needs two ends)");
    }
    if args.large_bytes < 4 * args.ranks {
        bail!("--large-bytes must be at least 4 bytes per rank");
    }
    let iters = args.iters.max(1);
    let devices_per_host = match args.devices_per_host {
        Some(d) => d,
        None => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    };
    let memory_per_device = match args.memory_per_device {
        Some(m) => m,
        None => mem_total()? / devices_per_host.max(1) as u64,
    };
    let load = load_average();

    let mut rates = Vec::new();
    for (m, k, n, layout) in SHAPES {
        let rate = product_rate(m, k, n, layout, iters)?;
        eprintln!(
            "# MatMul [{m},{k}]·[{k},{n}] ({layout:?}): {:.1} GFLOP/s",
            rate / 1e9
        );
        rates.push(rate);
    }
    let flops_per_second = median(rates);

    let (shm_small, shm_large) = measure_link("shm", &args)?;
    let (tcp_small, tcp_large) = measure_link("tcp", &args)?;
    let intra_host = fit_link(args.ranks, shm_small, args.large_bytes, shm_large);
    let inter_host = fit_link(args.ranks, tcp_small, args.large_bytes, tcp_large);
    for (what, small, large, link) in [
        ("shm (intra-host)", shm_small, shm_large, intra_host),
        ("tcp (inter-host)", tcp_small, tcp_large, inter_host),
    ] {
        eprintln!(
            "# all-reduce over {what}, {} ranks: 4 B {:.1} µs, {} B {:.2} ms → α {:.2} µs, β {:.2} GB/s",
            args.ranks,
            small * 1e6,
            args.large_bytes,
            large * 1e3,
            link.latency * 1e6,
            link.bandwidth / 1e9
        );
    }

    let (op_overhead, step_overhead) = executor_overheads(iters)?;
    eprintln!(
        "# executor, one thread: {:.2} µs per op, {:.1} µs per step (chains of {} and 1 Neg on {} elements)",
        op_overhead * 1e6,
        step_overhead * 1e6,
        CHAIN + 1,
        ELEMENTS
    );

    let date = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%dT%H:%M:%SZ")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let mut profile = ClusterProfile {
        name: args.name.clone(),
        devices_per_host,
        memory_per_device,
        flops_per_second,
        intra_host,
        inter_host,
        precision: Precision::F32,
        op_overhead,
        step_overhead,
        job: JobCosts::default(),
        source: format!(
            "dflow bench calibrate {date}, load average {load}: MatMul median of {} shapes on one \
             thread; all-reduce of 4 B and {} B over {} ranks (shm: {:.1} µs, {:.2} ms; tcp: \
             {:.1} µs, {:.2} ms); executor {:.2} µs per op, {:.1} µs per step",
            SHAPES.len(),
            args.large_bytes,
            args.ranks,
            shm_small * 1e6,
            shm_large * 1e3,
            tcp_small * 1e6,
            tcp_large * 1e3,
            op_overhead * 1e6,
            step_overhead * 1e6
        ),
    };
    if args.job_runs > 0 {
        let (job, raw) = super::bench_job::measure(&profile, args.job_runs, args.job_epochs)?;
        let summary = format!(
            "{:.1} µs per step, {:.1} µs per task, {:.3} µs per op, {:.1} µs per collective message, {:.1} µs per value sent or received, {:.2} µs per product, {:.1} µs per wait beyond the cores, {:.2} µs per node spawned alone, {:.1} ps per product FLOP beyond the cores, {:.3} ns per byte sent beyond the link's 1/β, {:.1} GFLOP/s in products, {:.2} GB/s in other ops, {:.1} M transcendental elements/s",
            job.step * 1e6,
            job.task * 1e6,
            job.op * 1e6,
            job.collective * 1e6,
            job.value * 1e6,
            job.product * 1e6,
            job.beyond_cores * 1e6,
            job.spawn * 1e6,
            job.beyond_cores_per_flop * 1e12,
            job.transfer_per_byte * 1e9,
            job.flops_per_second / 1e9,
            job.bytes_per_second / 1e9,
            job.transcendentals_per_second / 1e6
        );
        eprintln!("# calibration jobs, fitted: {summary}");
        profile.job = job;
        profile.source.push_str(&format!(
            "; synthetic calibration jobs (median of {} runs each: {raw}), non-negative least squares: {summary}",
            args.job_runs,
        ));
    }
    profile
        .check()
        .context("the measured profile is not usable (a measurement failed?)")?;
    let text = serde_json::to_string_pretty(&profile)? + "\n";
    match &args.out {
        Some(path) => {
            write_atomically(path, &text)?;
            eprintln!(
                "# wrote {} (use: dflow plan GRAPH --profile {0})",
                path.display()
            );
        }
        None => print!("{text}"),
    }
    Ok(())
}

/// Ops in the long chain of [`executor_overheads`].
const CHAIN: usize = 256;

/// Elements of the chain's tensor: past the executor's 1,024 elements of inputs and outputs
/// under which a node is cheap and batched with others, so every node is dispatched alone as
/// most of a model's ops are (its arithmetic, 600 negations, is a small part of its cost).
const ELEMENTS: usize = 600;

/// The executor's cost per op and per step on one compute thread: the median step of an
/// in-process session fetching the end of a chain of `CHAIN + 1` `Neg` ops on [`ELEMENTS`]
/// elements, and of a chain of 1; the difference over `CHAIN` is the cost of an op beyond its arithmetic, the
/// rest of the short chain's step the cost of a step.
fn executor_overheads(iters: usize) -> anyhow::Result<(f64, f64)> {
    use dflow_executor::session::{Session, SessionOptions};
    use dflow_graph::builder::GraphBuilder;
    use dflow_graph::{ClusterSpec, Tensor};
    let step = |ops: usize| -> anyhow::Result<f64> {
        let mut b = GraphBuilder::new();
        let mut x = b.constant("x", Tensor::from_slice(&[ELEMENTS], &[1.0f32; ELEMENTS])?);
        for i in 0..ops {
            x = b.op("Neg", &format!("neg{i}")).input(&x).finish();
        }
        let graph = b.build().map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let cluster = ClusterSpec::local(&[("worker", 1)])?;
        let options = SessionOptions {
            num_threads: 1,
            ..SessionOptions::default()
        };
        let session = Session::new(graph, cluster, options)?;
        let last = format!("neg{}", ops - 1);
        let mut times = Vec::with_capacity(iters);
        session.run(&[], &[&last], &[])?;
        for _ in 0..iters.max(5) {
            let t0 = Instant::now();
            session.run(&[], &[&last], &[])?;
            times.push(t0.elapsed().as_secs_f64());
        }
        Ok(median(times))
    };
    let short = step(1)?;
    let long = step(CHAIN + 1)?;
    let per_op = ((long - short) / CHAIN as f64).max(0.0);
    Ok((per_op, (short - per_op).max(0.0)))
}

/// Writes `text` to a temporary file beside `path`, then renames it over `path`.
fn write_atomically(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_follow_recursive_doubling() {
        assert_eq!(small_rounds(2), 1.0);
        assert_eq!(small_rounds(4), 2.0);
        // 3 ranks: one fold into a partner, one doubling round, one fold back.
        assert_eq!(small_rounds(3), 3.0);
        assert_eq!(small_rounds(8), 3.0);
    }

    #[test]
    fn the_fit_inverts_the_planner_cost_model() {
        use dflow_partitioner::planner::collective::{AxisLinks, Collective};
        // The planner's own cost of a small and a 16 MiB all-reduce over a known link, for 2, 3
        // and 4 ranks on one host: the fit must give that link back.
        let link = Link {
            bandwidth: 2e9,
            latency: 5e-6,
        };
        for n in [2usize, 3, 4] {
            let mut profile = ClusterProfile::preset("this-machine").unwrap();
            profile.devices_per_host = n;
            profile.intra_host = link;
            let links = AxisLinks::of_groups(&[(0..n).collect()], n, &profile);
            let s = 16usize << 20;
            let small = links.cost(Collective::AllReduce, 4.0).seconds;
            let large = links.cost(Collective::AllReduce, s as f64).seconds;
            let fit = fit_link(n, small, s, large);
            assert!(
                (fit.latency - link.latency).abs() / link.latency < 1e-3,
                "{n}: {fit:?}"
            );
            assert!(
                (fit.bandwidth - link.bandwidth).abs() / link.bandwidth < 1e-3,
                "{n}: {fit:?}"
            );
        }
    }

    #[test]
    fn a_latency_inflated_by_load_cannot_make_bandwidth_absurd() {
        // The small call took longer than the large one (a preempted measurement).
        let link = fit_link(2, 1e-2, 1 << 20, 1e-3);
        assert!(link.bandwidth.is_finite() && link.bandwidth > 0.0);
        assert!(link.bandwidth <= (1 << 20) as f64 / 0.5e-3 + 1.0);
    }

    #[test]
    fn products_are_measured_in_every_layout() {
        for (m, k, n, layout) in [
            (8, 4, 6, Layout::Plain),
            (8, 4, 6, Layout::LeftTransposed),
            (8, 4, 6, Layout::RightTransposed),
        ] {
            let r = product_rate(m, k, n, layout, 3).unwrap();
            assert!(r.is_finite() && r > 0.0, "{layout:?}: {r}");
        }
    }
}
