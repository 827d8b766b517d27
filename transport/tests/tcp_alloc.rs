//! The steady-state receive path allocates no tensor-sized buffer: payloads land in the slot.
//!
//! Not yet the issue-6 "0 allocations" proof: the `Rendezvous` API itself boxes each Recv
//! callback, the test's oneshot channel allocates, and the local rendezvous map may grow. This
//! test bounds the bytes allocated per step far below the tensor size, bounds the count (2 per
//! step measured: both are the test's boxed callback and oneshot) and prints the figures.

use dflow_graph::{DType, Tensor};
use dflow_transport::tcp::{TcpConfig, TcpRendezvous};
use dflow_transport::{Rendezvous, RendezvousKey};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;
use std::sync::Arc;
use std::time::Duration;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const N: usize = 1 << 18; // 1 MiB of f32

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_state_steps_allocate_no_tensor_buffers() {
    let ps = TcpRendezvous::bind("ps:0", "127.0.0.1:0".parse().unwrap(), TcpConfig::default())
        .await
        .unwrap();
    let worker = TcpRendezvous::bind(
        "worker:0",
        "127.0.0.1:0".parse().unwrap(),
        TcpConfig::default(),
    )
    .await
    .unwrap();
    let k = Arc::new(RendezvousKey::new("w", "p", "x:0"));
    ps.register_recv(1, "worker:0", k.clone(), DType::F32, &[N])
        .unwrap();
    worker.register_send(k.clone(), "ps:0", 1);
    worker.connect("ps:0", ps.local_addr()).await.unwrap();
    // The producer's tensor, reused every step (its buffer is shared, never copied).
    let sent = Tensor::from_slice(&[N], &vec![1.5f32; N]).unwrap();

    let mut step = 0u64;
    let mut run = |steps: u64| {
        let (ps, worker, k, sent) = (ps.clone(), worker.clone(), k.clone(), sent.clone());
        let first = step + 1;
        step += steps;
        async move {
            for s in first..first + steps {
                let (tx, rx) = tokio::sync::oneshot::channel();
                ps.recv_async(
                    &k,
                    s,
                    Box::new(move |v| {
                        let _ = tx.send(v.map(|t| t.as_bytes()[4]));
                    }),
                );
                worker.send(&k, s, sent.clone()).unwrap();
                let got = tokio::time::timeout(Duration::from_secs(5), rx)
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap();
                assert_eq!(got, sent.as_bytes()[4]);
                ps.finish_step(s);
            }
        }
    };
    run(20).await; // warm up
    let region = Region::new(GLOBAL);
    let steps = 200;
    run(steps).await;
    let change = region.change();
    let allocs = (change.allocations + change.reallocations) as u64;
    let bytes = change.bytes_allocated as u64;
    println!(
        "{:.1} allocations, {:.0} bytes per step for a {} byte tensor",
        allocs as f64 / steps as f64,
        bytes as f64 / steps as f64,
        N * 4
    );
    assert_eq!(ps.slots().reallocations(), 0);
    // Measured: 2.0 per step, the test's own boxed callback and oneshot channel.
    assert!(allocs <= 3 * steps, "{allocs} allocations in {steps} steps");
    assert!(
        bytes / steps < 4096,
        "{} bytes allocated per step",
        bytes / steps
    );
}
