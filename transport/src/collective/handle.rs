//! Asynchronous collectives: a per-group worker thread runs submitted calls in submission order
//! and hands each result to a [`Handle`].

use super::error::Result;
use std::fmt;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The result of a submitted collective, once it is done.
pub struct Handle<R> {
    slot: Arc<(Mutex<Option<Result<R>>>, Condvar)>,
}

impl<R> fmt::Debug for Handle<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handle")
            .field("done", &self.is_done())
            .finish()
    }
}

impl<R> Handle<R> {
    /// True once the call finished (successfully or not); `wait` will not block.
    pub fn is_done(&self) -> bool {
        lock(&self.slot.0).is_some()
    }

    /// Blocks until the call finished and returns its result. The call's own timeout bounds the
    /// wait.
    pub fn wait(self) -> Result<R> {
        let (m, cv) = &*self.slot;
        let mut g = lock(m);
        loop {
            if let Some(r) = g.take() {
                return r;
            }
            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Runs jobs in order on one thread; counts jobs submitted but not yet finished.
pub(crate) struct Worker {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    pending: Arc<(Mutex<usize>, Condvar)>,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("pending", &*lock(&self.pending.0))
            .finish()
    }
}

impl Worker {
    pub fn new() -> Worker {
        Worker {
            tx: Mutex::new(None),
            pending: Arc::new((Mutex::new(0), Condvar::new())),
        }
    }

    /// Queues `f`; its result goes to the returned handle.
    pub fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<R> + Send + 'static,
    ) -> Handle<R> {
        let slot = Arc::new((Mutex::new(None), Condvar::new()));
        let out = slot.clone();
        let pending = self.pending.clone();
        *lock(&pending.0) += 1;
        let job: Job = Box::new(move || {
            let r = f();
            *lock(&out.0) = Some(r);
            out.1.notify_all();
            *lock(&pending.0) -= 1;
            pending.1.notify_all();
        });
        let mut tx = lock(&self.tx);
        let sender = tx.get_or_insert_with(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name("dflow-collective".into())
                .spawn(move || rx.into_iter().for_each(|job| job()))
                .map(|_| tx)
                .unwrap_or_else(|_| mpsc::channel().0)
        });
        if let Err(mpsc::SendError(job)) = sender.send(job) {
            // No worker thread could be started: run the job here rather than lose it.
            job();
        }
        Handle { slot }
    }

    /// Blocks until every submitted job has finished.
    pub fn drain(&self) {
        let (m, cv) = &*self.pending;
        let mut g = lock(m);
        while *g > 0 {
            g = cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}
