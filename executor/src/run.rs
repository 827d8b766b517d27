//! Running one step of several device plans against a rendezvous, with a deadline: shared by the
//! in-process [`Session`](crate::Session) and a cluster task's server.

use crate::error::ExecError;
use crate::memory::MemoryMeter;
use crate::plan::ExecutionPlan;
use crate::step::start_step;
use crate::trace::Tracer;
use dflow_graph::kernel::Collectives;
use dflow_graph::Tensor;
use dflow_transport::{Rendezvous, RendezvousError, RendezvousKey};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The pool kernels run on: `num_threads` threads, or one per CPU this process may use when 0
/// (at least 2 then: a collective kernel holds its thread until its peers join, and a peer
/// may wait for a value only another thread of this pool can send).
pub(crate) fn compute_pool(num_threads: usize) -> Result<rayon::ThreadPool, ExecError> {
    let threads = if num_threads == 0 {
        std::thread::available_parallelism().map_or(2, |n| n.get().max(2))
    } else {
        num_threads
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("dflow-compute-{i}"))
        .build()
        .map_err(|e| ExecError::Setup(format!("cannot start compute pool: {e}")))
}

/// What a step runs on and how long it may take.
#[derive(Clone, Debug)]
pub(crate) struct StepEnv {
    /// Where Send and Recv meet.
    pub rendezvous: Arc<dyn Rendezvous>,
    /// The compute pool.
    pub pool: Arc<rayon::ThreadPool>,
    /// The trace recorder, when tracing.
    pub tracer: Option<Arc<Tracer>>,
    /// Longest the step may take before it is aborted.
    pub timeout: Duration,
    /// The collective groups this process joined, for collective kernels.
    pub collectives: Option<Arc<dyn Collectives>>,
    /// The accounting of step values, when on.
    pub meter: Option<Arc<MemoryMeter>>,
}

enum Event {
    DeviceDone(Result<(), ExecError>),
    Fetched(usize, Result<Tensor, RendezvousError>),
}

/// Runs `step` of every plan in `plans`: sends `feeds` first, then waits for every plan to
/// finish and every fetch key to arrive, or for the deadline, when the step is aborted and the
/// error names every tensor still awaited and the device that should have sent it.
///
/// Does not call `finish_step`: the caller does, once it no longer needs the step's state.
pub(crate) fn run_plans(
    env: &StepEnv,
    step: u64,
    plans: &[Arc<ExecutionPlan>],
    feeds: &[(Arc<RendezvousKey>, Tensor)],
    fetches: &[Arc<RendezvousKey>],
) -> Result<Vec<Tensor>, ExecError> {
    for (key, value) in feeds {
        env.rendezvous
            .send(key, step, value.clone())
            .map_err(|e| ExecError::Feed {
                name: key.tensor_name().to_string(),
                message: e.to_string(),
            })?;
    }
    let (tx, rx) = mpsc::channel::<Event>();
    for plan in plans {
        let tx = tx.clone();
        start_step(
            plan.clone(),
            step,
            env,
            Box::new(move |r| {
                let _ = tx.send(Event::DeviceDone(r));
            }),
        );
    }
    for (i, key) in fetches.iter().enumerate() {
        let tx = tx.clone();
        env.rendezvous.recv_async(
            key,
            step,
            Box::new(move |r| {
                let _ = tx.send(Event::Fetched(i, r));
            }),
        );
    }
    drop(tx);
    collect(env, step, plans.len(), fetches, &rx)
}

fn collect(
    env: &StepEnv,
    step: u64,
    num_plans: usize,
    fetches: &[Arc<RendezvousKey>],
    rx: &mpsc::Receiver<Event>,
) -> Result<Vec<Tensor>, ExecError> {
    let start = Instant::now();
    let mut deadline = start + env.timeout;
    let mut devices_left = num_plans;
    let mut fetched: Vec<Option<Tensor>> = vec![None; fetches.len()];
    let mut fetches_left = fetches.len();
    let mut errors: Vec<ExecError> = Vec::new();
    let mut timeout_error: Option<ExecError> = None;
    while devices_left > 0 || fetches_left > 0 {
        let wait = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            Ok(Event::DeviceDone(r)) => {
                devices_left -= 1;
                if let Err(e) = r {
                    errors.push(e);
                }
            }
            Ok(Event::Fetched(i, r)) => {
                fetches_left -= 1;
                match r {
                    Ok(t) => fetched[i] = Some(t),
                    Err(e) => errors.push(ExecError::Transfer {
                        node: format!("fetch {}", fetches[i].tensor_name()),
                        device: "client".into(),
                        source: Box::new(e),
                    }),
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) if timeout_error.is_none() => {
                let waiting = env
                    .rendezvous
                    .pending_recvs(step)
                    .into_iter()
                    .map(|k| {
                        (
                            k.tensor_name().to_string(),
                            k.send_device().to_string(),
                            k.recv_device().to_string(),
                        )
                    })
                    .collect();
                let e = ExecError::Timeout {
                    step,
                    waited_ms: start.elapsed().as_millis() as u64,
                    waiting,
                };
                env.rendezvous.abort_step(
                    step,
                    RendezvousError::Aborted {
                        step,
                        cause: e.to_string(),
                    },
                );
                timeout_error = Some(e);
                // Give the aborted step a bounded grace period to unwind.
                deadline = Instant::now() + Duration::from_secs(5);
            }
            Err(_) => break, // grace period over, or every sender gone
        }
    }
    if let Some(e) = timeout_error {
        return Err(e);
    }
    if !errors.is_empty() {
        // The root cause is the error that is not a consequence of the abort.
        let root = errors
            .iter()
            .position(|e| !crate::step::is_abort_echo(e))
            .unwrap_or(0);
        return Err(errors.swap_remove(root));
    }
    fetched
        .into_iter()
        .zip(fetches)
        .map(|(t, k)| {
            t.ok_or_else(|| ExecError::Fetch {
                name: k.tensor_name().to_string(),
                message: "no value arrived".into(),
            })
        })
        .collect()
}
