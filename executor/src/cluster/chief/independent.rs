//! The independent schedule (async ps) as a [`StepRunner`] of the one step driver
//! ([`run_steps`]): each worker is a *lane* that takes the next global batch when it is free,
//! so no straggler waits for another; the driver's step `k` is the `k`-th step to finish, in
//! whichever lane. Reports, evaluation and checkpoints are the driver's, as for a lockstep job.

use super::staleness::{Clocks, WAIT_LIMIT};
use super::{
    driver_config, evaluate, job_error, restore, run_step, save, scalar, ChiefConfig, Finished,
    Ids, Job, Source,
};
use crate::cluster::node::{JobError, Rpc};
use crate::trainer::{run_steps, StepReport, StepRunner, TrainError};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// Trains `job` on the independent schedule through the step driver; returns the job, what
/// the steps did and the staleness seen, `(sum, max, count)` of the lanes' reported staleness.
pub(super) async fn independent(
    rpc: &Rpc,
    job: Job,
    cfg: &ChiefConfig,
    source: &Source,
    ids: Arc<Ids>,
    mut on_step: impl FnMut(&StepReport),
) -> Result<(Job, Finished, Option<(u64, u64, u64)>), JobError> {
    let started = Instant::now();
    let mut runner = Independent {
        rpc,
        job: Arc::new(job),
        source,
        ids,
        cfg,
        runtime: tokio::runtime::Handle::current(),
        lanes: None,
        staleness: None,
        clocks: None,
    };
    runner.clocks = cfg
        .staleness
        .map(|s| Arc::new(Clocks::new(runner.job.train.len(), s.max(1))));
    let mut steps: Vec<(u64, f64, usize)> = Vec::new();
    let driven = tokio::task::block_in_place(|| {
        run_steps(&mut runner, &driver_config(cfg), |r: &StepReport| {
            steps.push((r.step, r.loss, r.examples));
            on_step(r)
        })
    });
    // Every lane has ended or is ending (no step is left to take); wait for them, so the job
    // is ours again and no lane outlives the run.
    if driven.is_err() {
        // The driver stopped (a lane failed, or a checkpoint or an evaluation did): the lanes
        // finish the steps they are in and take no more.
        if let Some(lanes) = &runner.lanes {
            lanes.stop();
        }
    }
    let ended = runner.join_lanes().await;
    let summary = driven.map_err(job_error)?;
    ended?;
    if let (Some(c), Some(bound)) = (&runner.clocks, cfg.staleness) {
        tracing::info!(
            "staleness bound {bound}: a worker was at most {} step(s) ahead of the slowest",
            c.max_lead()
        );
    }
    let staleness = runner.staleness;
    let job = Arc::try_unwrap(runner.job)
        .map_err(|_| JobError::Setup("worker lanes still hold the job".into()))?;
    let finished = Finished {
        resumed_from: summary.resumed_from,
        final_step: summary.final_step,
        losses: steps.iter().map(|&(s, l, _)| (s, l)).collect(),
        elapsed: started.elapsed(),
        examples: steps.iter().map(|&(_, _, n)| n as u64).sum(),
        checkpoint: summary.checkpoint,
    };
    Ok((job, finished, staleness))
}

/// A step one lane finished: (its global batch index, its loss, its staleness).
type Done = (u64, f64, u64);

/// The running lanes: their completions and their tasks.
struct Lanes {
    done: mpsc::UnboundedReceiver<Done>,
    loops: JoinSet<Result<(), JobError>>,
    /// Set when a lane failed: the others finish the step they are in and take no other.
    stop: Arc<AtomicBool>,
    /// The staleness clocks, if bounded (released when the lanes stop, so none waits on a
    /// lane that failed).
    clocks: Option<Arc<Clocks>>,
    lanes: usize,
}

impl Lanes {
    /// No lane takes another batch; each ends after the step it is in (that step runs to its
    /// end, so no task is left answering a chief that stopped listening).
    fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(c) = &self.clocks {
            for w in 0..self.lanes {
                c.finished(w);
            }
        }
    }
}

/// An independent job as a [`StepRunner`]: the first step starts one lane per worker from
/// the step the driver resumes at; each later `train_step` waits for the next lane to finish
/// a step. Its async calls run on `runtime` (the driver blocks in place).
struct Independent<'a> {
    rpc: &'a Rpc,
    job: Arc<Job>,
    source: &'a Source,
    ids: Arc<Ids>,
    cfg: &'a ChiefConfig,
    runtime: tokio::runtime::Handle,
    lanes: Option<Lanes>,
    /// `(sum, max, count)` of the finished steps' staleness.
    staleness: Option<(u64, u64, u64)>,
    /// The stale-synchronous bound's clocks (`--staleness`).
    clocks: Option<Arc<Clocks>>,
}

impl Independent<'_> {
    /// One lane per worker, taking global batches from `first` on.
    fn start_lanes(&self, first: u64) -> Lanes {
        let next = Arc::new(AtomicU64::new(first));
        let total = self.source.total_steps();
        let (tx, done) = mpsc::unbounded_channel();
        let mut loops = JoinSet::new();
        let stop = Arc::new(AtomicBool::new(false));
        for w in 0..self.job.train.len() {
            let (rpc, job, next, ids, tx, clocks, stop) = (
                self.rpc.clone(),
                self.job.clone(),
                next.clone(),
                self.ids.clone(),
                tx.clone(),
                self.clocks.clone(),
                stop.clone(),
            );
            let bs = self.cfg.batch_size as u64;
            let spe = self.source.steps_per_epoch().max(1);
            let text = matches!(self.source, Source::Text { .. });
            loops.spawn_on(
                async move {
                    loop {
                        if let Some(c) = &clocks {
                            c.wait_turn(w, WAIT_LIMIT).await?;
                        }
                        if stop.load(Ordering::SeqCst) {
                            return Ok(());
                        }
                        let s = next.fetch_add(1, Ordering::SeqCst);
                        if s >= total {
                            if let Some(c) = &clocks {
                                c.finished(w);
                            }
                            return Ok(());
                        }
                        let (epoch, index) = if text { (0, s) } else { (s / spe, s % spe) };
                        let step = ids.next();
                        let (fetched, stale) =
                            run_step(&rpc, &job.train[w], step, Some((epoch, index, bs, 1)))
                                .await?;
                        let loss = fetched.first().map(scalar).unwrap_or(f64::NAN);
                        if let Some(c) = &clocks {
                            c.step_done(w);
                        }
                        // The driver stops listening only when it failed; the lane ends with
                        // its next batch then.
                        let _ = tx.send((s, loss, stale));
                    }
                },
                &self.runtime,
            );
        }
        Lanes {
            done,
            loops,
            stop,
            clocks: self.clocks.clone(),
            lanes: self.job.train.len(),
        }
    }

    /// The next step any lane finishes; a lane's failure (the first, or the peer failure
    /// behind it) ends the others and is returned.
    async fn next_done(
        lanes: &mut Lanes,
        rpc: &Rpc,
        step: u64,
        total: u64,
    ) -> Result<Done, JobError> {
        loop {
            tokio::select! {
                Some(done) = lanes.done.recv() => return Ok(done),
                joined = lanes.loops.join_next() => match joined {
                    Some(Ok(Ok(()))) => {}
                    Some(Ok(Err(e))) => {
                        lanes.stop();
                        return Err(rpc.failure().unwrap_or(e));
                    }
                    Some(Err(e)) if e.is_cancelled() => {}
                    Some(Err(e)) => {
                        lanes.stop();
                        return Err(JobError::Setup(format!("worker lane failed: {e}")));
                    }
                    None => {
                        // Every lane ended: a last report may still be queued.
                        return lanes.done.try_recv().map_err(|_| {
                            JobError::Setup(format!(
                                "every worker lane ended before step {} of {total}",
                                step + 1
                            ))
                        });
                    }
                },
            }
        }
    }

    /// Waits for every lane to end (they end once no step is left, or after their step in
    /// flight once stopped).
    async fn join_lanes(&mut self) -> Result<(), JobError> {
        let Some(mut lanes) = self.lanes.take() else {
            return Ok(());
        };
        let mut failure = None;
        while let Some(joined) = lanes.loops.join_next().await {
            match joined {
                Ok(Err(e)) => {
                    failure.get_or_insert(e);
                }
                Err(e) if !e.is_cancelled() => {
                    failure.get_or_insert(JobError::Setup(format!("worker lane failed: {e}")));
                }
                _ => {}
            }
        }
        failure.map_or(Ok(()), Err)
    }
}

impl StepRunner for Independent<'_> {
    fn total_steps(&self) -> u64 {
        self.source.total_steps()
    }

    fn epoch(&self, step: u64) -> u64 {
        self.source.batch_of(step).0
    }

    fn train_step(&mut self, step: u64) -> Result<(f64, usize), TrainError> {
        if self.lanes.is_none() {
            self.lanes = Some(self.start_lanes(step));
        }
        let (rpc, runtime) = (self.rpc, self.runtime.clone());
        let lanes = self
            .lanes
            .as_mut()
            .ok_or_else(|| TrainError::Job(JobError::Setup("worker lanes not started".into())))?;
        let total = self.source.total_steps();
        let (s, loss, stale) = runtime.block_on(Self::next_done(lanes, rpc, step, total))?;
        let st = self.staleness.get_or_insert((0, 0, 0));
        st.0 += stale;
        st.1 = st.1.max(stale);
        st.2 += 1;
        Ok((loss, self.source.rows(s, self.cfg.batch_size)))
    }

    fn restore_latest(&mut self, dir: &Path) -> Result<Option<u64>, TrainError> {
        Ok(self.runtime.block_on(restore(self.rpc, &self.job, dir))?)
    }

    fn save(
        &mut self,
        dir: &Path,
        step: u64,
        keep: usize,
        metadata: &BTreeMap<String, String>,
    ) -> Result<PathBuf, TrainError> {
        Ok(self
            .runtime
            .block_on(save(self.rpc, &self.job, dir, step, keep, metadata))?)
    }

    /// Evaluated while the lanes go on training: async evaluation sees the variables as they
    /// are at that moment, like the steps themselves.
    fn evaluate(&mut self) -> Result<Vec<(String, f64)>, TrainError> {
        let batches = self.source.eval_batches(self.cfg.batch_size)?;
        Ok(self
            .runtime
            .block_on(evaluate(self.rpc, &self.job, batches, &self.ids))?)
    }
}
