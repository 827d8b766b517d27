//! The lockstep schedule's driver loop, elastic under `--min-workers K` (all-reduce and sync
//! parameter-server plans): the membership of the job changes at step boundaries, and every
//! change is a restart from a committed state.
//!
//! - **A worker dies** (not the chief): if at least K workers remain, the chief re-plans the
//!   job on the survivors (the same strategy over the smaller cluster: the global batch is
//!   split over fewer workers), has every survivor drop its graphs, variables and collective
//!   groups, registers the new plan, restores the last committed state and runs the step
//!   driver again from there. Fewer than K: the job ends naming the dead worker.
//! - **A worker joins**: a worker of the ClusterSpec that is not in the job (a replacement for
//!   a dead one, started at the same address) connects to every task and tells the chief it is
//!   [`Ready`](crate::cluster::protocol::Message::Ready). Before the next step the chief saves
//!   a checkpoint of the step just finished (a commit), has every task connect to the
//!   newcomer, re-plans on the larger membership and restores that checkpoint: the newcomer
//!   receives the state through the restore path (each holder of a variable gets it).
//!
//! The committed state is the newest checkpoint of `--checkpoint-dir`: the chief writes one
//! only after a step finished on every task, so it never holds a partial update (a step a
//! worker died in may have updated some variables on the ps, or some buckets under
//! all-reduce, and not others: those updates are thrown away with the whole step). Before the
//! first checkpoint it is the state before the first step: the tasks dropped their variables
//! with their graphs, so the new graphs initialize them as the first ones did (and
//! `--init-from` is loaded again). Steps after the commit run again on the new membership.

use super::{
    driver_config, initialize, job_error, register_all, save, setup, ChiefConfig, Finished, Ids,
    Job, Lockstep, SlotIds, Source,
};
use crate::checkpoint;
use crate::cluster::node::{task_name, JobError, Rpc};
use crate::cluster::protocol::{DataSpec, Reply, Request};
use crate::trainer::{run_steps, StepReport};
use dflow_graph::ClusterSpec;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Instant;

/// Why the membership changes.
enum Change {
    /// A task failed (the job goes on if it was a worker other than the chief).
    Failure(JobError),
    /// These workers are ready to join, before step `step` (the steps before it are done).
    Join { step: u64, tasks: Vec<String> },
}

/// Runs the steps of a lockstep `job` through the step driver; with `cfg.min_workers` set, goes
/// on after a worker's death and takes joining workers in, as the module docs say. `cluster`
/// is every task the job may have. Returns the job as it ended (the last membership's plan)
/// and what the steps did; `losses` hold one entry per step of the run, the last run of a step
/// that was run again after a restart.
#[allow(clippy::too_many_arguments)]
pub(super) async fn lockstep(
    rpc: &Rpc,
    cluster: &ClusterSpec,
    cfg: &ChiefConfig,
    mut job: Job,
    source: &Source,
    ids: &Ids,
    data: &DataSpec,
    mut slot_ids: SlotIds,
    runtime: tokio::runtime::Handle,
    mut on_step: impl FnMut(&StepReport),
) -> Result<(Job, Finished), JobError> {
    let driver = driver_config(cfg);
    let all = cluster;
    let mut cluster = cluster.clone();
    let resumed_from = match &cfg.checkpoint_dir {
        Some(dir) => newest_step(dir)?,
        None => None,
    };
    // (step, loss, examples) of every step reported, across restarts.
    let mut steps: Vec<(u64, f64, usize)> = Vec::new();
    let mut restarts = 0u32;
    let started = Instant::now();
    loop {
        let mut runner = Lockstep {
            rpc,
            job: &job,
            source,
            ids,
            batch_size: cfg.batch_size,
            runtime: runtime.clone(),
            joins: cfg.min_workers.map(|_| all),
            joined: None,
        };
        let result = tokio::task::block_in_place(|| {
            run_steps(&mut runner, &driver, |r: &StepReport| {
                steps.push((r.step, r.loss, r.examples));
                on_step(r)
            })
        });
        let joined = runner.joined.take();
        let error = match result {
            Ok(summary) => {
                let done = Finished {
                    resumed_from,
                    final_step: summary.final_step,
                    losses: steps.iter().map(|&(s, l, _)| (s, l)).collect(),
                    elapsed: started.elapsed(),
                    examples: steps.iter().map(|&(_, _, n)| n as u64).sum(),
                    checkpoint: summary.checkpoint,
                };
                return Ok((job, done));
            }
            Err(e) => job_error(e),
        };
        let (Some(min), Some(dir)) = (cfg.min_workers, &cfg.checkpoint_dir) else {
            return Err(error);
        };
        let mut change = match joined {
            Some((step, tasks)) => Change::Join { step, tasks },
            None => Change::Failure(error),
        };
        // Until a re-plan succeeds: another worker may die (or join) meanwhile.
        job = loop {
            let (message, committed) = match change {
                Change::Join { step, tasks } => {
                    let (joined, committed) =
                        match admit(rpc, cfg, &job, all, &cluster, dir, step, &tasks).await {
                            Ok(admitted) => admitted,
                            Err(e) => {
                                change = Change::Failure(e);
                                continue;
                            }
                        };
                    if joined.is_empty() {
                        // Nobody could be taken in: the same job goes on from the commit (the
                        // state it holds).
                        break job;
                    }
                    let mut names: BTreeSet<String> = cluster.task_names().into_iter().collect();
                    names.extend(joined.iter().cloned());
                    cluster = subset(all, &names)?;
                    restarts += 1;
                    let from = match committed {
                        Some(step) => format!("the checkpoint at step {step}"),
                        None => "the state before the first step".to_string(),
                    };
                    let message = format!(
                        "elastic restart {restarts}: {} joined; going on with {} workers [{}] from {from}",
                        joined.join(", "),
                        cluster.num_tasks("worker"),
                        workers(&cluster).join(", ")
                    );
                    (message, committed)
                }
                Change::Failure(error) => {
                    // Any other failure (the chief's own, a ps, a bad plan) ends the job.
                    let Some(dead) = dead_worker(rpc, &cluster, &error) else {
                        return Err(error);
                    };
                    let survivors = without(&cluster, &dead)?;
                    let left = survivors.num_tasks("worker");
                    if left < min {
                        return Err(setup(format!(
                            "worker {dead} is gone and {left} workers remain, fewer than --min-workers {min} ({error})"
                        )));
                    }
                    restarts += 1;
                    rpc.drop_tasks(std::slice::from_ref(&dead));
                    cluster = survivors;
                    let committed = newest_step(dir)?;
                    let from = match committed {
                        Some(step) => format!("the checkpoint at step {step}"),
                        None => "the state before the first step".to_string(),
                    };
                    let message = format!(
                        "elastic restart {restarts}: worker {dead} is gone ({error}); going on with {left} workers [{}] from {from}",
                        workers(&cluster).join(", ")
                    );
                    (message, committed)
                }
            };
            tracing::warn!("{message}");
            eprintln!("{message}");
            // The steps after the commit run again on the new membership.
            let keep = committed.unwrap_or(0);
            steps.retain(|&(s, _, _)| s <= keep);
            match replan(rpc, cfg, &cluster, data, &mut slot_ids, committed.is_none()).await {
                Ok(job) => break job,
                Err(e) => change = Change::Failure(e),
            }
        };
        // The driver restores the newest checkpoint when it starts again.
    }
}

/// Takes the workers `tasks` (ready, not in the job) into it before step `step`: commits the
/// state after the steps before it (a checkpoint in `dir`, unless the newest one is that
/// step's; before the first step with no checkpoint the commit is the initial state, which the
/// variables do not hold yet: they initialize on their first step), has the chief and every
/// other task of `cluster` connect to each newcomer. Returns the newcomers taken in and the
/// committed step (`None`: the initial state): a newcomer that cannot be reached, by the
/// chief or by a member, is left out with a warning (it is offered again once it says Ready
/// anew). An error is a member's failure (the caller goes on as after any failure).
#[allow(clippy::too_many_arguments)]
async fn admit(
    rpc: &Rpc,
    cfg: &ChiefConfig,
    job: &Job,
    all: &ClusterSpec,
    cluster: &ClusterSpec,
    dir: &Path,
    step: u64,
    tasks: &[String],
) -> Result<(Vec<String>, Option<u64>), JobError> {
    let newest = newest_step(dir)?;
    let committed = if newest.is_none() && step == 0 {
        None
    } else {
        Some(step)
    };
    if committed.is_some() && newest != Some(step) {
        save(
            rpc,
            job,
            dir,
            step,
            cfg.keep_checkpoints,
            &cfg.checkpoint_metadata,
        )
        .await?;
    }
    let addresses = addresses(all);
    let mut joined = Vec::new();
    for task in tasks {
        let Some(address) = addresses.get(task) else {
            continue;
        };
        let left_out = |why: String| {
            rpc.drop_tasks(std::slice::from_ref(task));
            rpc.forget_ready(task);
            tracing::warn!("{why}");
            eprintln!("elastic: {task} said it is ready, but it cannot join the job: {why}");
        };
        if let Err(e) = rpc.admit(task, address).await {
            left_out(e.to_string());
            continue;
        }
        let mut reached = true;
        for member in cluster.task_names() {
            if member == rpc.task {
                continue;
            }
            let req = Request::Connect {
                task: task.clone(),
                address: address.clone(),
            };
            match rpc.call(&member, req, &format!("Connect to {task}")).await {
                Ok(Reply::Connected) => {}
                Ok(other) => {
                    rpc.drop_tasks(std::slice::from_ref(task));
                    return Err(setup(format!(
                        "unexpected reply to Connect from {member}: {other:?}"
                    )));
                }
                // The member cannot reach the newcomer.
                Err(JobError::Remote { message, .. }) => {
                    left_out(format!("{member} cannot connect to it: {message}"));
                    reached = false;
                    break;
                }
                // The newcomer died (it is a member now), or a member did.
                Err(e) => {
                    let newcomer = matches!(&e, JobError::PeerGone { task: t, .. } if t == task);
                    rpc.drop_tasks(std::slice::from_ref(task));
                    if newcomer {
                        left_out(e.to_string());
                        reached = false;
                        break;
                    }
                    return Err(e);
                }
            }
        }
        if reached {
            joined.push(task.clone());
        }
    }
    Ok((joined, committed))
}

/// The workers of `all` (every task the job may have) that are ready to join a job whose
/// tasks are `members`, in name order.
pub(super) fn joiners(rpc: &Rpc, all: &ClusterSpec) -> Vec<String> {
    let workers: BTreeSet<String> = all
        .tasks("worker")
        .map(|(i, _)| task_name("worker", i))
        .collect();
    rpc.joining()
        .into_iter()
        .filter(|t| workers.contains(t))
        .collect()
}

/// The worker tasks of `cluster`, in index order.
fn workers(cluster: &ClusterSpec) -> Vec<String> {
    cluster
        .tasks("worker")
        .map(|(i, _)| task_name("worker", i))
        .collect()
}

/// Every task of `cluster` and its address.
fn addresses(cluster: &ClusterSpec) -> BTreeMap<String, String> {
    cluster
        .jobs()
        .flat_map(|job| {
            cluster
                .tasks(job)
                .map(move |(i, addr)| (task_name(job, i), addr.to_string()))
        })
        .collect()
}

/// The step of the newest checkpoint of `dir`, if any.
fn newest_step(dir: &Path) -> Result<Option<u64>, JobError> {
    Ok(checkpoint::list(dir)
        .map_err(setup)?
        .pop()
        .map(|(step, _)| step))
}

/// The worker whose death `error` reports, if the job can go on without it: a worker task of
/// `cluster` other than the chief.
fn dead_worker(rpc: &Rpc, cluster: &ClusterSpec, error: &JobError) -> Option<String> {
    let JobError::PeerGone { task, .. } = error else {
        return None;
    };
    let is_worker = cluster
        .tasks("worker")
        .any(|(i, _)| task_name("worker", i) == *task);
    (is_worker && *task != rpc.task).then(|| task.clone())
}

/// `cluster` without task `dead`.
fn without(cluster: &ClusterSpec, dead: &str) -> Result<ClusterSpec, JobError> {
    let keep: BTreeSet<String> = cluster
        .task_names()
        .into_iter()
        .filter(|t| t != dead)
        .collect();
    subset(cluster, &keep)
}

/// The tasks of `cluster` named in `keep`.
fn subset(cluster: &ClusterSpec, keep: &BTreeSet<String>) -> Result<ClusterSpec, JobError> {
    let mut jobs: BTreeMap<String, BTreeMap<u32, String>> = BTreeMap::new();
    for job in cluster.jobs() {
        for (i, addr) in cluster.tasks(job) {
            if keep.contains(&task_name(job, i)) {
                jobs.entry(job.to_string())
                    .or_default()
                    .insert(i, addr.to_string());
            }
        }
    }
    ClusterSpec::new(jobs).map_err(|e| setup(format!("the cluster of tasks {keep:?}: {e}")))
}

/// Has every task of `cluster` drop its graphs, variables and collective groups, then
/// registers the strategy's plan for `cluster` on them; `initial`: nothing is committed yet,
/// so the new graphs start from the initial state (`--init-from` is loaded again).
async fn replan(
    rpc: &Rpc,
    cfg: &ChiefConfig,
    cluster: &ClusterSpec,
    data: &DataSpec,
    slot_ids: &mut SlotIds,
    initial: bool,
) -> Result<Job, JobError> {
    for task in cluster.task_names() {
        match rpc.call(&task, Request::Reset, "Reset").await? {
            Reply::ResetDone => {}
            other => {
                return Err(setup(format!(
                    "unexpected reply to Reset from {task}: {other:?}"
                )))
            }
        }
    }
    let job = register_all(rpc, cfg, cluster, data, slot_ids).await?;
    if initial {
        initialize(rpc, &job, cfg).await?;
    }
    Ok(job)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(workers: &[u32]) -> ClusterSpec {
        let mut jobs: BTreeMap<String, BTreeMap<u32, String>> = BTreeMap::new();
        jobs.entry("ps".into())
            .or_default()
            .insert(0, "127.0.0.1:2000".into());
        for &w in workers {
            jobs.entry("worker".into())
                .or_default()
                .insert(w, format!("127.0.0.1:{}", 2001 + w));
        }
        ClusterSpec::new(jobs).unwrap()
    }

    #[test]
    fn a_membership_keeps_the_tasks_and_their_addresses() {
        let all = spec(&[0, 1, 2]);
        let survivors = without(&all, "/job:worker/replica:0/task:1").unwrap();
        assert_eq!(survivors.num_tasks("worker"), 2);
        assert_eq!(survivors.address("worker", 2), Some("127.0.0.1:2003"));
        assert_eq!(survivors.address("worker", 1), None);
        assert_eq!(survivors.num_tasks("ps"), 1);
        let mut names: BTreeSet<String> = survivors.task_names().into_iter().collect();
        names.insert("/job:worker/replica:0/task:1".into());
        assert_eq!(subset(&all, &names).unwrap(), all);
        assert_eq!(
            addresses(&all)["/job:worker/replica:0/task:1"],
            "127.0.0.1:2002"
        );
    }
}
