//! A steady-state step allocates nothing on the TCP data plane: the payload lands in the slot
//! registered once, and no queue, map or frame buffer allocates per step.
//!
//! The Recv callback is boxed by its caller (the executor, once per Recv per step); the test
//! makes those boxes before the measured region, so the region holds only the data plane.

use dflow_graph::{DType, Tensor};
use dflow_transport::tcp::TcpPlane;
use dflow_transport::TcpConfig;
use dflow_transport::{RecvCallback, Rendezvous, RendezvousKey};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use std::alloc::System;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const N: usize = 1 << 18; // 1 MiB of f32

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_state_steps_allocate_nothing_on_the_data_plane() {
    let ps = TcpPlane::bind("ps:0", "127.0.0.1:0".parse().unwrap(), TcpConfig::default())
        .await
        .unwrap();
    let worker = TcpPlane::bind(
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

    // Everything the test itself needs per step (the Recv callbacks, which the executor boxes
    // per Recv) is made before the measured region; inside it, only the data plane runs:
    // `send` queues the frame, the writer writes header + payload from the producer's memory,
    // the reader checks the header and reads the payload into the slot, and the tensor (a view
    // of the slot) meets its Recv.
    let delivered = Arc::new(AtomicU64::new(0));
    let callbacks = |first: u64, n: u64| -> Vec<RecvCallback> {
        (first..first + n)
            .map(|s| {
                let delivered = delivered.clone();
                let expect = sent.as_bytes()[4];
                Box::new(move |v: Result<Tensor, _>| {
                    if let Ok(t) = v {
                        if t.as_bytes()[4] == expect {
                            delivered.store(s, Ordering::SeqCst);
                        }
                    }
                }) as RecvCallback
            })
            .collect()
    };
    let run = |first: u64, cbs: Vec<RecvCallback>| {
        let (ps, worker, k, sent, delivered) = (
            ps.clone(),
            worker.clone(),
            k.clone(),
            sent.clone(),
            delivered.clone(),
        );
        async move {
            for (s, cb) in (first..).zip(cbs) {
                ps.recv_async(&k, s, cb);
                worker.send(&k, s, sent.clone()).unwrap();
                let deadline = std::time::Instant::now() + Duration::from_secs(5);
                while delivered.load(Ordering::SeqCst) != s {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "step {s} not delivered"
                    );
                    tokio::task::yield_now().await;
                }
                ps.finish_step(s);
            }
        }
    };
    let warmup = 50;
    run(1, callbacks(1, warmup)).await;
    let steps = 200;
    let cbs = callbacks(warmup + 1, steps);
    let region = Region::new(GLOBAL);
    run(warmup + 1, cbs).await;
    let change = region.change();
    let allocs = (change.allocations + change.reallocations) as u64;
    let bytes = change.bytes_allocated as u64;
    println!(
        "{allocs} allocations, {bytes} bytes in {steps} steady-state steps of a {} byte tensor",
        N * 4
    );
    assert_eq!(ps.slots().reallocations(), 0);
    assert_eq!(
        allocs, 0,
        "the data plane allocated {allocs} times ({bytes} bytes) in {steps} steps"
    );
}
