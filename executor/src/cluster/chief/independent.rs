//! The independent schedule (async ps): one loop per worker on the chief, each taking the next
//! global batch when its worker is free.

use super::staleness::{Clocks, WAIT_LIMIT};
use super::{evaluate, restore, run_step, save, scalar, ChiefConfig, Finished, Ids, Job, Source};
use crate::cluster::node::{JobError, Rpc};
use crate::trainer::StepReport;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// The independent schedule (async ps): each worker takes the next global batch when it is
/// free, so no straggler waits for another; the chief reports steps in completion order and
/// saves checkpoints. This loop stays beside the step driver because its steps overlap: the
/// driver runs one step at a time and numbers losses by step, while here several workers'
/// steps are in flight and finish in any order.
pub(super) async fn independent(
    rpc: &Rpc,
    job: Job,
    cfg: &ChiefConfig,
    source: &Source,
    ids: Arc<Ids>,
    mut on_step: impl FnMut(&StepReport),
) -> Result<(Job, Finished, Option<(u64, u64, u64)>), JobError> {
    let resumed_from = match &cfg.checkpoint_dir {
        Some(dir) => restore(rpc, &job, dir).await?,
        None => None,
    };
    let total = source.total_steps();
    let start_step = resumed_from.unwrap_or(0).min(total);
    let mut losses = Vec::new();
    let mut examples = 0u64;
    let mut last_ckpt = None;
    let mut staleness: Option<(u64, u64, u64)> = None; // (sum, max, count)
    let started = Instant::now();
    let next = Arc::new(AtomicU64::new(start_step));
    let (tx, mut rx) = mpsc::unbounded_channel();
    let job = Arc::new(job);
    let clocks = cfg
        .staleness
        .map(|s| Arc::new(Clocks::new(job.train.len(), s.max(1))));
    let mut loops = tokio::task::JoinSet::new();
    for w in 0..job.train.len() {
        let (rpc, job, next, ids, tx, clocks) = (
            rpc.clone(),
            job.clone(),
            next.clone(),
            ids.clone(),
            tx.clone(),
            clocks.clone(),
        );
        let bs = cfg.batch_size as u64;
        let spe = source.steps_per_epoch().max(1);
        let text = matches!(source, Source::Text { .. });
        loops.spawn(async move {
            loop {
                if let Some(c) = &clocks {
                    c.wait_turn(w, WAIT_LIMIT).await?;
                }
                let s = next.fetch_add(1, Ordering::SeqCst);
                if s >= total {
                    if let Some(c) = &clocks {
                        c.finished(w);
                    }
                    return Ok::<(), JobError>(());
                }
                let (epoch, index) = if text { (0, s) } else { (s / spe, s % spe) };
                let step = ids.next();
                let (fetched, stale) =
                    run_step(&rpc, &job.train[w], step, Some((epoch, index, bs, 1))).await?;
                let loss = fetched.first().map(scalar).unwrap_or(f64::NAN);
                if let Some(c) = &clocks {
                    c.step_done(w);
                }
                let _ = tx.send((s, epoch, loss, stale));
            }
        });
    }
    drop(tx);
    let mut done = start_step;
    let mut failure = None;
    let mut record = |(s, epoch, loss, stale): (u64, u64, f64, u64),
                      eval: Vec<(String, f64)>,
                      done: &mut u64| {
        *done += 1;
        let n = source.rows(s, cfg.batch_size);
        examples += n as u64;
        losses.push((*done, loss));
        let st = staleness.get_or_insert((0, 0, 0));
        st.0 += stale;
        st.1 = st.1.max(stale);
        st.2 += 1;
        on_step(&StepReport {
            step: *done,
            total_steps: total,
            epoch,
            loss,
            examples: n,
            eval,
        });
    };
    loop {
        tokio::select! {
            Some(finished) = rx.recv() => {
                // Evaluated while the workers go on training: async evaluation sees the
                // variables as they are at that moment, like the step itself.
                let due = cfg.eval_every > 0 && (done + 1) % cfg.eval_every == 0 && done + 1 < total;
                let eval = if due {
                    evaluate(rpc, &job, source.eval_batches(cfg.batch_size)?, &ids).await?
                } else {
                    Vec::new()
                };
                record(finished, eval, &mut done);
                if let (Some(dir), true) = (&cfg.checkpoint_dir, cfg.save_every > 0 && done % cfg.save_every == 0) {
                    last_ckpt = Some(save(rpc, &job, dir, done, cfg.keep_checkpoints, &cfg.checkpoint_metadata).await?);
                }
            }
            joined = loops.join_next() => match joined {
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => { failure.get_or_insert(e); loops.abort_all(); }
                Some(Err(e)) if e.is_cancelled() => {}
                Some(Err(e)) => { failure.get_or_insert(JobError::Setup(format!("worker loop failed: {e}"))); }
                None => {
                    // Every loop ended; drain the last reports.
                    while let Ok(finished) = rx.try_recv() {
                        record(finished, Vec::new(), &mut done);
                    }
                    break;
                }
            },
        }
    }
    if let Some(e) = failure {
        return Err(rpc.failure().unwrap_or(e));
    }
    if let (Some(c), Some(bound)) = (&clocks, cfg.staleness) {
        tracing::info!(
            "staleness bound {bound}: a worker was at most {} step(s) ahead of the slowest",
            c.max_lead()
        );
    }
    let job = Arc::try_unwrap(job)
        .map_err(|_| JobError::Setup("worker loops still hold the job".into()))?;
    let saved_at_end = cfg.save_every > 0 && done % cfg.save_every == 0 && last_ckpt.is_some();
    if let (Some(dir), false) = (&cfg.checkpoint_dir, saved_at_end) {
        last_ckpt = Some(
            save(
                rpc,
                &job,
                dir,
                done,
                cfg.keep_checkpoints,
                &cfg.checkpoint_metadata,
            )
            .await?,
        );
    }
    let finished = Finished {
        resumed_from,
        final_step: done,
        losses,
        elapsed: started.elapsed(),
        examples,
        checkpoint: last_ckpt,
    };
    Ok((job, finished, staleness))
}
