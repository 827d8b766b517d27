//! The step time of a real dflow job, predicted from the job plan it runs.
//!
//! The analytical model ([`super::evaluate`]) prices FLOPs and bytes, which is what matters for
//! a large model on GPUs. A small model on this machine spends most of a step in dflow's own
//! distributed step path: the chief's batching, feeds and fetch and the step's dispatch to
//! every task (per step), the executor's dispatch of every node of a task's partition (per op),
//! and each collective call's handshake and the wake-ups of the threads waiting on it (per
//! call). Those costs are the profile's [`JobCosts`], measured by `dflow bench calibrate` on
//! small 2-worker jobs; the counts come from the job plan `dflow run` makes for the layout
//! ([`super::accounting::job_plan`]): its partitions' nodes, its collective ops and their bytes
//! ([`super::accounting::traffic`]).
//!
//! A step is `job.step + cpu + communication`, where a task's cpu time is its share of the
//! layout's compute (the analytical FLOPs, with the pipeline's bubble, at the job's FLOP/s)
//! plus `ops · job.op`, the
//! tasks sharing the host's cores (`max(busiest task, Σ tasks / cores)`: 4 tasks on 2 cores
//! take twice as long as 2), and a task's communication is `calls · job.collective + bytes / β`
//! over a link inside the host (`job.collective` includes the link's latency α; α alone when it
//! is 0), the same per value sent to another task.

use super::accounting::{traffic, AccountingError};
use super::evaluate::Evaluation;
use super::profile::{ClusterProfile, JobCosts, LinkClass};
use crate::strategy::JobPlan;
use std::collections::BTreeMap;

/// What one task does in a training step, from the job plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskWork {
    /// The task.
    pub task: String,
    /// Nodes of its training partitions (each dispatched once a step).
    pub ops: usize,
    /// Collective calls it makes.
    pub collective_calls: usize,
    /// Bytes it sends in collectives.
    pub collective_bytes: u64,
    /// Values it sends to other tasks' Recvs.
    pub values: usize,
    /// Their bytes.
    pub data_plane_bytes: u64,
}

/// The work of every task of `plan` in one training step (every training signature once), with
/// `rows` rows where a feed's batch dimension is unknown.
pub fn work(plan: &JobPlan, rows: usize) -> Result<Vec<TaskWork>, AccountingError> {
    let mut ops: BTreeMap<String, usize> = BTreeMap::new();
    for signature in plan.train_signatures() {
        for (device, part) in &signature.partitions.partitions {
            let task = device.task_name().unwrap_or_else(|| device.to_string());
            *ops.entry(task).or_default() += part.graph.num_nodes();
        }
    }
    Ok(traffic(plan, rows)?
        .into_iter()
        .map(|t| TaskWork {
            ops: ops.get(&t.task).copied().unwrap_or(0),
            task: t.task,
            collective_calls: t.collective_calls,
            collective_bytes: t.collective,
            values: t.values,
            data_plane_bytes: t.data_plane,
        })
        .collect())
}

/// A predicted step of a real job, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct JobStep {
    /// The profile's per-step cost.
    pub step: f64,
    /// The layout's compute on the slowest device (FLOPs over FLOP/s, with the bubble).
    pub compute: f64,
    /// The busiest task's ops times the per-op cost.
    pub ops: f64,
    /// CPU time of the step: compute and ops of the busiest task, or of all tasks over the
    /// host's cores when they are more than the cores.
    pub cpu: f64,
    /// The busiest task's collective calls and sends.
    pub communication: f64,
}

impl JobStep {
    /// The predicted step time.
    pub fn total(&self) -> f64 {
        self.step + self.cpu + self.communication
    }
}

/// The step of a job whose tasks do `work`, on `profile`'s hosts (`cores` per host: the tasks
/// of one host share them), each task computing for `compute` seconds.
pub fn job_step(
    work: &[TaskWork],
    compute: f64,
    profile: &ClusterProfile,
    cores: usize,
) -> JobStep {
    let JobCosts {
        step,
        op,
        collective,
        ..
    } = profile.job;
    let link = profile.link(LinkClass::IntraHost);
    let cpu_of = |t: &TaskWork| compute + t.ops as f64 * op;
    let busiest = work.iter().map(cpu_of).fold(0.0, f64::max);
    let shared = work.iter().map(cpu_of).sum::<f64>() / cores.max(1) as f64;
    let ops = work.iter().map(|t| t.ops as f64 * op).fold(0.0, f64::max);
    // A calibrated call cost includes the link's latency; uncalibrated, the latency alone.
    let call = if collective > 0.0 {
        collective
    } else {
        link.latency
    };
    let communication = work
        .iter()
        .map(|t| {
            t.collective_calls as f64 * call
                + t.values as f64 * call
                + (t.collective_bytes + t.data_plane_bytes) as f64 / link.bandwidth
        })
        .fold(0.0, f64::max);
    JobStep {
        step,
        compute,
        ops,
        cpu: busiest.max(shared),
        communication,
    }
}

/// The step of `plan` (the job plan of `e`'s layout, fed `rows` rows a replica) on `profile`,
/// its tasks sharing `profile.devices_per_host` cores per host.
pub fn predict(
    plan: &JobPlan,
    rows: usize,
    e: &Evaluation,
    profile: &ClusterProfile,
) -> Result<JobStep, AccountingError> {
    let work = work(plan, rows)?;
    // The analytical compute is at the job's FLOP/s where the profile has one.
    Ok(job_step(
        &work,
        e.time.compute + e.time.bubble,
        profile,
        profile.devices_per_host,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(ops: usize, calls: usize) -> TaskWork {
        TaskWork {
            task: format!("t{ops}"),
            ops,
            collective_calls: calls,
            collective_bytes: 0,
            values: 0,
            data_plane_bytes: 0,
        }
    }

    #[test]
    fn a_step_is_the_fixed_cost_the_busiest_task_and_its_calls() {
        let mut p = ClusterProfile::preset("this-machine").unwrap();
        p.intra_host.latency = 0.0;
        p.job = JobCosts {
            step: 100e-6,
            op: 1e-6,
            collective: 10e-6,
            flops_per_second: 0.0,
        };
        let s = job_step(&[task(50, 2), task(40, 3)], 5e-6, &p, 2);
        assert!((s.cpu - 55e-6).abs() < 1e-12, "{s:?}");
        assert!((s.communication - 30e-6).abs() < 1e-12, "{s:?}");
        assert!((s.total() - 185e-6).abs() < 1e-12, "{s:?}");
        // Four tasks on two cores share them.
        let four = job_step(
            &[task(50, 0), task(50, 0), task(50, 0), task(50, 0)],
            0.0,
            &p,
            2,
        );
        assert!((four.cpu - 100e-6).abs() < 1e-12, "{four:?}");
        // Uncalibrated, a call costs the link's latency.
        p.job.collective = 0.0;
        p.intra_host.latency = 2e-6;
        let s = job_step(&[task(50, 2), task(40, 3)], 5e-6, &p, 2);
        assert!((s.communication - 6e-6).abs() < 1e-12, "{s:?}");
    }
}
