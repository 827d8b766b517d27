//! The planner's text: the ranked table, the reasons for the pick, one layout in detail.
//! Deterministic: the same model, cluster and options print the same bytes.

use super::evaluate::Evaluation;
use super::profile::ClusterProfile;
use super::PlanReport;
use std::fmt::Write;

/// Bytes in decimal units (`1.5 GB`).
pub fn bytes(x: f64) -> String {
    let units = [(1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")];
    for (scale, unit) in units {
        if x >= scale {
            return format!("{:.2} {unit}", x / scale);
        }
    }
    format!("{x:.0} B")
}

/// Seconds in a readable unit (`12.3 ms`).
pub fn seconds(x: f64) -> String {
    if x >= 1.0 {
        format!("{x:.3} s")
    } else if x >= 1e-3 {
        format!("{:.2} ms", x * 1e3)
    } else {
        format!("{:.1} µs", x * 1e6)
    }
}

/// The header: the model, the cluster and what the memory model counts.
pub fn header(report: &PlanReport, profile: &ClusterProfile) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "plan: {:.0} parameters, global batch {}, {} devices of {} ({} per host, {} each, {:.1} TFLOP/s sustained, {:?} precision)",
        report.parameters,
        report.batch_size,
        report.devices,
        profile.name,
        profile.devices_per_host,
        bytes(profile.memory_per_device as f64),
        profile.flops_per_second / 1e12,
        profile.precision,
    );
    let _ = writeln!(
        s,
        "links: inside a host {}/s, {}; between hosts {}/s, {} ({})",
        bytes(profile.intra_host.bandwidth),
        seconds(profile.intra_host.latency),
        bytes(profile.inter_host.bandwidth),
        seconds(profile.inter_host.latency),
        profile.source
    );
    s
}

/// The ranked table of the `limit` fastest layouts that fit, and what was pruned.
pub fn table(report: &PlanReport, limit: usize) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>4}  {:<22} {:>11} {:>13} {:>13} {:>11} {:>7}",
        "rank", "layout", "memory/dev", "intra/step", "inter/step", "step time", "bubble"
    );
    for (i, e) in report.ranked.iter().take(limit).enumerate() {
        let _ = writeln!(
            s,
            "{:>4}  {:<22} {:>11} {:>13} {:>13} {:>11} {:>6.1}%",
            i + 1,
            e.layout.short(),
            bytes(e.peak().total()),
            bytes(e.traffic.intra()),
            bytes(e.traffic.inter()),
            seconds(e.time.total()),
            e.bubble * 100.0
        );
    }
    if report.ranked.len() > limit {
        let _ = writeln!(s, "      … {} more that fit", report.ranked.len() - limit);
    }
    let _ = writeln!(
        s,
        "{} layouts fit, {} do not fit in memory, {} cannot run this model",
        report.ranked.len(),
        report.too_big.len(),
        report.refused.len()
    );
    if let Some(e) = report.too_big.first() {
        let _ = writeln!(
            s,
            "  smallest that does not fit: {} needs {} per device",
            e.layout.short(),
            bytes(e.peak().total())
        );
    }
    if let Some(r) = report.refused.first() {
        let _ = writeln!(s, "  e.g. refused: {r}");
    }
    s
}

/// Why the best layout was picked, against the runner-up and pure data parallelism.
pub fn explain(report: &PlanReport, profile: &ClusterProfile) -> String {
    let mut s = String::new();
    let Some(best) = report.best() else {
        let _ = writeln!(
            s,
            "no layout fits in {} per device: give more devices, more memory per device, or a smaller batch",
            bytes(profile.memory_per_device as f64)
        );
        return s;
    };
    let t = &best.time;
    let _ = writeln!(
        s,
        "pick: {} ({}): predicted step {} = input {} + compute {} + tensor-parallel {} + pipeline sends {} + bubble {} + data-parallel {} + runtime overhead {}; {} per device of {}",
        best.layout.short(),
        best.layout,
        seconds(t.total()),
        seconds(t.input),
        seconds(t.compute),
        seconds(t.tensor_parallel),
        seconds(t.pipeline),
        seconds(t.bubble),
        data_parallel(best),
        seconds(t.overhead),
        bytes(best.peak().total()),
        bytes(profile.memory_per_device as f64),
    );
    if let Some(next) = report.ranked.get(1) {
        let _ = writeln!(
            s,
            "  runner-up {} is {:.1}% slower ({})",
            next.layout.short(),
            (next.time.total() / t.total() - 1.0) * 100.0,
            seconds(next.time.total())
        );
    }
    let pure_dp = |e: &&Evaluation| {
        e.layout.mesh.tp == 1
            && e.layout.mesh.pp == 1
            && e.layout.mesh.ep == 1
            && e.layout.zero == 0
    };
    if best.layout.mesh.dp != report.devices || best.layout.zero != 0 || best.layout.mesh.ep > 1 {
        if let Some(dp) = report.too_big.iter().find(pure_dp) {
            let _ = writeln!(
                s,
                "  pure data parallelism does not fit: every device would hold the whole model, {} > {}",
                bytes(dp.peak().total()),
                bytes(profile.memory_per_device as f64)
            );
        } else if let Some(dp) = report.ranked.iter().find(pure_dp) {
            let _ = writeln!(
                s,
                "  pure data parallelism fits but is predicted slower: {} (data-parallel {})",
                seconds(dp.time.total()),
                seconds(dp.time.data_parallel)
            );
        }
    }
    s
}

/// The data-parallel time of `e`, and its experts' all-to-alls where it has an `ep` axis.
fn data_parallel(e: &Evaluation) -> String {
    let mut s = seconds(e.time.data_parallel);
    if e.layout.mesh.ep > 1 {
        s.push_str(" + expert all-to-alls ");
        s.push_str(&seconds(e.time.expert_parallel));
    }
    s
}

/// One layout in detail: memory per stage, bytes per link class by source, the time model.
pub fn detail(e: &Evaluation, profile: &ClusterProfile) -> String {
    let mut s = String::new();
    let l = &e.layout;
    let _ = writeln!(s, "layout {} ({})", l.short(), l);
    let _ = writeln!(
        s,
        "  {} rows per micro-batch per replica; {} micro-batches; schedule {}; fits in {}: {}",
        e.rows,
        l.micro_batches,
        l.schedule,
        bytes(profile.memory_per_device as f64),
        if e.fits { "yes" } else { "NO" }
    );
    let _ = writeln!(
        s,
        "  memory per device (weights + gradients + optimizer + activations):"
    );
    for (stage, m) in e.memory.iter().enumerate() {
        let _ = writeln!(
            s,
            "    stage {stage}: {} = {} + {} + {} + {}",
            bytes(m.total()),
            bytes(m.weights),
            bytes(m.gradients),
            bytes(m.optimizer),
            bytes(m.activations)
        );
    }
    let _ = writeln!(
        s,
        "  bytes per step (whole cluster), inside hosts / between hosts:"
    );
    for (what, c) in [
        ("tensor-parallel all-reduces", e.traffic.tensor_parallel),
        ("pipeline sends", e.traffic.pipeline),
        ("data-parallel collectives", e.traffic.data_parallel),
        ("expert all-to-alls", e.traffic.expert_parallel),
    ] {
        if what == "expert all-to-alls" && e.layout.mesh.ep == 1 {
            continue;
        }
        let _ = writeln!(
            s,
            "    {what:<28} {:>12} / {:>12}",
            bytes(c.intra_bytes),
            bytes(c.inter_bytes)
        );
    }
    let _ = writeln!(
        s,
        "  pipeline: {} between stages per step; data parallelism: {} of gradients per rank of stage 0",
        bytes(e.pipeline_bytes),
        bytes(e.data_parallel_payload)
    );
    let t = &e.time;
    let _ = writeln!(
        s,
        "  step {} = input {} + compute {} + tensor-parallel {} + pipeline sends {} + bubble {} ({:.1}%, slowest stage {}, {} per micro-batch) + data-parallel {} + runtime overhead {}",
        seconds(t.total()),
        seconds(t.input),
        seconds(t.compute),
        seconds(t.tensor_parallel),
        seconds(t.pipeline),
        seconds(t.bubble),
        e.bubble * 100.0,
        e.slowest_stage,
        seconds(e.slot),
        data_parallel(e),
        seconds(t.overhead)
    );
    s
}

/// The executor's accounting of each task of a layout's job plan ([`super::accounting`]), as
/// `dflow plan --layout` prints it under the detail.
pub fn accounting(
    tasks: &[super::accounting::TaskMemory],
    strategy: &str,
    threads: usize,
) -> String {
    let mut s = format!(
        "  as dflow runs it (--strategy {strategy}; the executor's count with {threads} compute thread(s) per task):\n"
    );
    for t in tasks {
        s.push_str(&format!(
            "    {}: {} variables {} B + step tensors peak {} B = {} B ({})\n",
            t.task,
            t.variables,
            t.variable_bytes,
            t.peak_step_bytes,
            t.total(),
            bytes(t.total() as f64)
        ));
    }
    s
}

/// What each task of a layout's job plan sends per training step
/// ([`super::accounting::traffic`]), as `dflow plan --layout` prints it under the memory.
pub fn traffic(tasks: &[super::accounting::TaskTraffic]) -> String {
    let mut s = String::from(
        "  sent per step as dflow runs it (the transport's counters; feeds and fetches not counted):\n",
    );
    for t in tasks {
        s.push_str(&format!(
            "    {}: {} B in {} values over the data plane, {} B in {} collective calls ({} messages)\n",
            t.task, t.data_plane, t.values, t.collective, t.collective_calls, t.collective_messages
        ));
    }
    s
}

/// What each task of a layout's job plan computes per training step ([`super::runtime::work`]:
/// the counts the step-time line prices), as `dflow plan --layout` prints it under the bytes.
pub fn work(tasks: &[super::runtime::TaskWork]) -> String {
    let mut s = String::from(
        "  work per step as dflow runs it (what the step below prices):
",
    );
    for t in tasks {
        s.push_str(&format!(
            "    {}: {} nodes ({} spawned alone), {} products {:.2} MFLOP, {} of other ops, {} transcendental elements\n",
            t.task,
            t.ops,
            t.spawns,
            t.products,
            t.product_flops as f64 / 1e6,
            bytes(t.bytes as f64),
            t.transcendentals
        ));
    }
    s
}

/// A step of the layout's job as dflow runs it ([`super::runtime`]), one line.
pub fn job_step(step: &super::runtime::JobStep) -> String {
    format!(
        "  step as dflow runs it: {} = job step {} + cpu {} (compute {}, busiest task's ops {}) + collectives and sends {}\n",
        seconds(step.total()),
        seconds(step.step),
        seconds(step.cpu),
        seconds(step.compute),
        seconds(step.ops),
        seconds(step.communication)
    )
}
