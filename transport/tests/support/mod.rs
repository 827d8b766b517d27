//! Groups of communicators for the collective tests, and running a closure on every rank.
#![allow(dead_code)] // each test binary uses a different part

use dflow_transport::collective::{loopback_group, CommOptions, Communicator, TcpOptions};
use std::time::{Duration, Instant};

/// Where a test group's ranks talk.
#[derive(Clone, Copy, Debug)]
pub enum Backend {
    /// Threads of this process, in-memory pairs.
    InProcess,
    /// Threads of this process over TCP on 127.0.0.1.
    Tcp,
    /// Threads of this process over shared-memory rings.
    #[cfg(target_os = "linux")]
    Shm,
}

/// Options with a per-call `timeout_ms` and a stall warning at a quarter of it.
pub fn opts(timeout_ms: u64) -> CommOptions {
    CommOptions {
        timeout: Duration::from_millis(timeout_ms),
        stall_warning: Duration::from_millis(timeout_ms / 4),
        ..CommOptions::default()
    }
}

/// `n` connected communicators over `backend`.
pub fn comms(backend: Backend, n: usize, o: CommOptions) -> Vec<Communicator> {
    let wrap = |p: Box<dyn dflow_transport::collective::Pairs>| Communicator::new(p, o.clone());
    match backend {
        Backend::InProcess => Communicator::in_process(n, o.clone()),
        Backend::Tcp => loopback_group(n, &TcpOptions::default())
            .unwrap()
            .into_iter()
            .map(|p| wrap(Box::new(p)))
            .collect(),
        #[cfg(target_os = "linux")]
        Backend::Shm => dflow_transport::collective::shm_group(
            n,
            &dflow_transport::collective::ShmOptions::default(),
        )
        .unwrap()
        .into_iter()
        .map(|p| wrap(Box::new(p)))
        .collect(),
    }
}

/// Runs `f` on every rank; returns each rank's result and how long it took.
pub fn on_ranks<R: Send>(
    comms: Vec<Communicator>,
    f: impl Fn(Communicator) -> R + Sync,
) -> Vec<(R, Duration)> {
    std::thread::scope(|s| {
        let f = &f;
        let joins: Vec<_> = comms
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let t = Instant::now();
                    let r = f(c);
                    (r, t.elapsed())
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    })
}

/// Registers a Recv of `key` for `step` on `r`; the returned receiver gets its outcome.
pub fn recv(
    r: &dyn dflow_transport::Rendezvous,
    key: &std::sync::Arc<dflow_transport::RendezvousKey>,
    step: u64,
) -> tokio::sync::oneshot::Receiver<Result<dflow_graph::Tensor, dflow_transport::RendezvousError>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    r.recv_async(
        key,
        step,
        Box::new(move |v| {
            let _ = tx.send(v);
        }),
    );
    rx
}

/// The outcome of a Recv from [`recv`], waiting at most `limit`.
pub async fn wait_within(
    rx: tokio::sync::oneshot::Receiver<
        Result<dflow_graph::Tensor, dflow_transport::RendezvousError>,
    >,
    limit: Duration,
) -> Result<dflow_graph::Tensor, dflow_transport::RendezvousError> {
    tokio::time::timeout(limit, rx)
        .await
        .expect("recv completes in time")
        .expect("callback ran")
}
