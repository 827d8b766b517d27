//! The shared-memory plane between two tasks (two planes in one process, each with its own
//! mappings): values written in place cross without a copy, other values are copied once and
//! counted, credits keep a held slot from being overwritten, and a dead peer fails waits.
#![cfg(target_os = "linux")]

use dflow_graph::tensor::buffer_copies;
use dflow_graph::{DType, Tensor};
use dflow_transport::shm::{segment, ShmPlane};
use dflow_transport::TcpConfig;
use dflow_transport::{DataPlane, PeerEvent, Rendezvous, RendezvousError, RendezvousKey};
use std::sync::{mpsc, Arc};
use std::time::Duration;

fn key(name: &str) -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new(
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:0/device:CPU:0",
        name,
    ))
}

/// A ps and a worker plane (`ps<tag>:0`, `worker<tag>:0`), connected both ways; the worker
/// sends `k` into slot 1 of the ps.
async fn pair(tag: &str, k: &Arc<RendezvousKey>, dims: &[usize]) -> (Arc<ShmPlane>, Arc<ShmPlane>) {
    let (ps_name, worker_name) = (format!("ps{tag}:0"), format!("worker{tag}:0"));
    let config = TcpConfig {
        frame_timeout: Duration::from_millis(400),
        ..TcpConfig::default()
    };
    let local = "127.0.0.1:0".parse().unwrap();
    let ps = ShmPlane::bind(&ps_name, local, config, None).await.unwrap();
    let worker = ShmPlane::bind(&worker_name, local, config, None)
        .await
        .unwrap();
    ps.clone()
        .connect(worker_name.clone(), worker.local_addr())
        .await
        .unwrap();
    worker
        .clone()
        .connect(ps_name.clone(), ps.local_addr())
        .await
        .unwrap();
    ps.register_recv(1, &worker_name, k.clone(), DType::F32, dims)
        .unwrap();
    worker.register_send(k.clone(), &ps_name, 1);
    (ps, worker)
}

fn recv(plane: &ShmPlane, k: &Arc<RendezvousKey>, step: u64) -> Result<Tensor, RendezvousError> {
    let (tx, rx) = mpsc::channel();
    plane.recv_async(
        k,
        step,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the Recv completes")
}

fn inside(range: std::ops::Range<usize>, t: &Tensor) -> bool {
    let p = t.data_ptr() as usize;
    range.contains(&p) && range.contains(&(p + t.byte_len() - 1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_written_in_the_slot_cross_without_a_copy() {
    let k = key("h:0");
    let (ps, worker) = pair("a", &k, &[16, 16]).await;
    let copies = buffer_copies();
    for step in 1..=3u64 {
        // The producer asks for its output's memory and gets the sender's view of the slot.
        let mut out = worker.send_buffer(&k, step, DType::F32, &[16, 16]).unwrap();
        let sender_view = worker.send_mapping(&k).unwrap();
        assert!(inside(sender_view.clone(), &out));
        for (i, v) in out.as_mut_slice::<f32>().unwrap().iter_mut().enumerate() {
            *v = i as f32 * step as f32;
        }
        assert!(inside(sender_view, &out), "the kernel wrote in place");
        worker.send(&k, step, out.clone()).unwrap();
        drop(out); // the producer's step ends

        let got = recv(&ps, &k, step).unwrap();
        let receiver_view = ps.recv_mapping(&k).unwrap();
        assert!(
            inside(receiver_view, &got),
            "the Recv output aliases the receiver's mapping"
        );
        assert_eq!(got.as_slice::<f32>().unwrap()[255], 255.0 * step as f32);
        drop(got); // releases the credit
        ps.finish_step(step);
    }
    assert_eq!(buffer_copies(), copies);
    let (w, p) = (worker.stats(), ps.stats());
    assert_eq!(
        (w.zero_copy_sends, w.copied_sends, w.copied_bytes),
        (3, 0, 0)
    );
    assert_eq!(p.received, 3);
    let left: Vec<String> = segment::segments_of(std::process::id())
        .into_iter()
        .filter(|n| n.contains("workera"))
        .collect();
    assert!(
        left.is_empty(),
        "the receiver unlinks every segment once mapped: {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_values_are_copied_once_and_counted() {
    let k = key("x:0");
    let (ps, worker) = pair("b", &k, &[8]).await;
    for step in 1..=2u64 {
        let v: Vec<f32> = (0..8).map(|i| (i * 10) as f32 + step as f32).collect();
        worker
            .send(&k, step, Tensor::from_slice(&[8], &v).unwrap())
            .unwrap();
        let got = recv(&ps, &k, step).unwrap();
        assert!(inside(ps.recv_mapping(&k).unwrap(), &got));
        assert_eq!(got.as_slice::<f32>().unwrap(), &v[..]);
    }
    let w = worker.stats();
    assert_eq!(
        (w.zero_copy_sends, w.copied_sends, w.copied_bytes),
        (0, 2, 64)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_slot_is_never_overwritten_and_a_dead_peer_fails_the_wait() {
    let k = key("w:0");
    let (ps, worker) = pair("c", &k, &[4]).await;
    worker
        .send(
            &k,
            1,
            Tensor::from_slice(&[4], &[1f32, 2., 3., 4.]).unwrap(),
        )
        .unwrap();
    let held = recv(&ps, &k, 1).unwrap();
    // The reader still holds step 1's value: step 2 waits for the credit, then gives up naming
    // the key and the peer; the held value is intact.
    let busy = worker
        .send(&k, 2, Tensor::from_slice(&[4], &[9f32; 4]).unwrap())
        .unwrap_err();
    match &busy {
        RendezvousError::SlotBusy { key, peer, .. } => {
            assert_eq!(key.tensor_name(), "w:0");
            assert_eq!(peer, "psc:0");
        }
        e => panic!("expected SlotBusy, got {e}"),
    }
    assert!(worker.send_buffer(&k, 2, DType::F32, &[4]).is_none());
    assert_eq!(held.as_slice::<f32>().unwrap(), &[1., 2., 3., 4.]);
    // Once released, the slot takes the next value.
    drop(held);
    worker
        .send(&k, 3, Tensor::from_slice(&[4], &[5f32; 4]).unwrap())
        .unwrap();
    assert_eq!(
        recv(&ps, &k, 3).unwrap().as_slice::<f32>().unwrap(),
        &[5.0; 4]
    );

    // The receiver goes away while holding a value: the sender's wait for that credit ends
    // with PeerGone naming it.
    let k2 = key("y:0");
    ps.register_recv(2, "workerc:0", k2.clone(), DType::F32, &[4])
        .unwrap();
    worker.register_send(k2.clone(), "psc:0", 2);
    worker
        .send(&k2, 4, Tensor::from_slice(&[4], &[0f32; 4]).unwrap())
        .unwrap();
    let pending = recv(&ps, &k2, 4).unwrap(); // held: the slot stays FULL
    ps.close(Duration::from_secs(1)).await;
    drop(ps);
    let t0 = std::time::Instant::now();
    let err = loop {
        match worker.send(&k2, 5, Tensor::from_slice(&[4], &[0f32; 4]).unwrap()) {
            Err(e @ RendezvousError::PeerGone { .. }) => break e,
            Err(_) if t0.elapsed() < Duration::from_secs(5) => continue,
            r => panic!("expected PeerGone, got {r:?}"),
        }
    };
    assert!(err.to_string().contains("psc:0"), "{err}");
    drop(pending);
}

/// Values the sender delivered through the ring right before it closed are all received, even
/// though the receiver learns of the close (side channel) independently of the ring's
/// notifications, and registers its Recvs only after that. Several keys make several
/// notifications wait in the ring at the close; rounds make the close overtake them often.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_sent_right_before_the_sender_closes_are_received() {
    const KEYS: u32 = 16;
    const ROUNDS: u32 = 20;
    let value = |i: u32, step: u64| -> Vec<f32> { vec![(i * 100) as f32 + step as f32; 4] };
    for round in 0..ROUNDS {
        let tag = format!("d{round}");
        let keys: Vec<_> = (1..=KEYS).map(|i| key(&format!("c{i}:0"))).collect();
        let (ps, worker) = pair(&tag, &keys[0], &[4]).await;
        let (ps_name, worker_name) = (format!("ps{tag}:0"), format!("worker{tag}:0"));
        for (i, k) in (1..).zip(&keys).skip(1) {
            ps.register_recv(i, &worker_name, k.clone(), DType::F32, &[4])
                .unwrap();
            worker.register_send(k.clone(), &ps_name, i);
        }
        let mut events = ps.subscribe();
        // Step 1 announces each slot (side channel), step 2 goes through the ring: both are
        // received and released before step 3.
        for step in 1..=2u64 {
            for (i, k) in (1..).zip(&keys) {
                let v = value(i, step);
                worker
                    .send(k, step, Tensor::from_slice(&[4], &v).unwrap())
                    .unwrap();
                assert_eq!(
                    recv(&ps, k, step).unwrap().as_slice::<f32>().unwrap(),
                    &v[..]
                );
            }
            ps.finish_step(step);
        }
        // Step 3: one ring notification per key, then the sender closes at once.
        for (i, k) in (1..).zip(&keys) {
            worker
                .send(k, 3, Tensor::from_slice(&[4], &value(i, 3)).unwrap())
                .unwrap();
        }
        worker.close(Duration::from_secs(1)).await;
        drop(worker);
        let gone = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(e) = events.recv().await {
                if let PeerEvent::Gone { peer, .. } = e {
                    if *peer == *worker_name {
                        return true;
                    }
                }
            }
            false
        })
        .await;
        assert_eq!(gone, Ok(true), "round {round}: the receiver sees the close");
        for (i, k) in (1..).zip(&keys) {
            match recv(&ps, k, 3) {
                Ok(t) => assert_eq!(t.as_slice::<f32>().unwrap(), &value(i, 3)[..]),
                Err(e) => panic!("round {round}: the value of {k} sent before the close: {e}"),
            }
        }
        assert_eq!(ps.stats().received, 3 * KEYS as u64);
        ps.close(Duration::from_secs(1)).await;
    }
}
