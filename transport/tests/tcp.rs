//! What only the TCP data plane does, between two endpoints on 127.0.0.1 (ephemeral ports, bounded
//! in time): slot buffer reuse, bad and stalled frames. What every backend does is in
//! conformance.rs.

use dflow_graph::{DType, Tensor};
use dflow_transport::tcp::TcpPlane;
use dflow_transport::wire::{encode_header, FrameKind, Header};
use dflow_transport::TcpConfig;
use dflow_transport::{Rendezvous, RendezvousError, RendezvousKey};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

mod support;
use support::wait_within;

const WAIT: Duration = Duration::from_secs(5);

fn key(name: &str) -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new(
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:0/device:CPU:0",
        name,
    ))
}

fn any_addr() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn recv(
    r: &TcpPlane,
    k: &Arc<RendezvousKey>,
    step: u64,
) -> oneshot::Receiver<Result<Tensor, RendezvousError>> {
    support::recv(r, k, step)
}

async fn wait(
    rx: oneshot::Receiver<Result<Tensor, RendezvousError>>,
) -> Result<Tensor, RendezvousError> {
    wait_within(rx, WAIT).await
}

/// A worker that sends `x:0` ([n] f32, slot 1) to a ps.
async fn pair(n: usize) -> (Arc<TcpPlane>, Arc<TcpPlane>, Arc<RendezvousKey>) {
    let ps = TcpPlane::bind("ps:0", any_addr(), TcpConfig::default())
        .await
        .unwrap();
    let worker = TcpPlane::bind("worker:0", any_addr(), TcpConfig::default())
        .await
        .unwrap();
    let k = key("x:0");
    ps.register_recv(1, "worker:0", k.clone(), DType::F32, &[n])
        .unwrap();
    worker.register_send(k.clone(), "ps:0", 1);
    worker.connect("ps:0", ps.local_addr()).await.unwrap();
    (ps, worker, k)
}

fn values(n: usize, step: u64) -> Tensor {
    let v: Vec<f32> = (0..n)
        .map(|i| f32::from_bits((i as u32).wrapping_mul(2_654_435_761) ^ step as u32))
        .collect();
    Tensor::from_slice(&[n], &v).unwrap()
}

// Values of every size, aborts, peer death, late Recvs and close: tests/conformance.rs, over
// every backend. Here: what only the TCP plane does.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_slot_buffer_is_reused_step_after_step() {
    let n = 1 << 20;
    let (ps, worker, k) = pair(n).await;
    let mut last_ptr = None;
    for step in 1..=5u64 {
        worker.send(&k, step, values(n, step)).unwrap();
        let got = wait(recv(&ps, &k, step)).await.unwrap();
        assert_eq!(got.as_bytes(), values(n, step).as_bytes(), "step {step}");
        // Released before the next step: the next frame lands in the same buffer.
        if let Some(p) = last_ptr {
            assert_eq!(got.data_ptr(), p, "step {step} reuses the slot buffer");
        }
        last_ptr = Some(got.data_ptr());
        ps.finish_step(step);
    }
    assert_eq!(ps.slots().reallocations(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_still_held_is_never_overwritten() {
    let (ps, worker, k) = pair(1024).await;
    worker.send(&k, 1, values(1024, 1)).unwrap();
    let first = wait(recv(&ps, &k, 1)).await.unwrap();
    worker.send(&k, 2, values(1024, 2)).unwrap();
    let second = wait(recv(&ps, &k, 2)).await.unwrap();
    assert_eq!(first.as_bytes(), values(1024, 1).as_bytes());
    assert_eq!(second.as_bytes(), values(1024, 2).as_bytes());
    assert_eq!(ps.slots().reallocations(), 1);
}

/// Reads until the server drops the connection; panics if it stays open.
async fn assert_dropped(mut s: TcpStream) {
    let mut buf = [0u8; 64];
    let r = tokio::time::timeout(WAIT, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(r.is_ok(), "the server did not drop the connection");
}

async fn rogue(addr: SocketAddr, name: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let hello = Header {
        kind: FrameKind::Hello,
        flags: 0,
        slot_id: 0,
        step: 0,
        payload_len: name.len() as u64,
    };
    s.write_all(&encode_header(&hello)).await.unwrap();
    s.write_all(name.as_bytes()).await.unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_are_rejected_and_the_good_connection_keeps_working() {
    let (ps, worker, k) = pair(256).await;
    let addr = ps.local_addr();
    let k2 = key("y:0");
    ps.register_recv(2, "rogue:trunc", k2.clone(), DType::F32, &[256])
        .unwrap();

    // Someone else's slot.
    let mut s = rogue(addr, "rogue:other").await;
    s.write_all(&encode_header(&Header::data(1, 1, 1024)))
        .await
        .unwrap();
    assert_dropped(s).await;

    // Garbage instead of a Hello.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&[0xAB; 100]).await.unwrap();
    assert_dropped(s).await;

    // An unknown slot.
    let mut s = rogue(addr, "rogue:slot").await;
    s.write_all(&encode_header(&Header::data(99, 1, 16)))
        .await
        .unwrap();
    assert_dropped(s).await;

    // Longer than any slot: rejected at the header, nothing is allocated or read.
    let mut s = rogue(addr, "rogue:long").await;
    s.write_all(&encode_header(&Header::data(1, 1, 1 << 40)))
        .await
        .unwrap();
    assert_dropped(s).await;

    // Longer than its slot (64 bytes), though within the largest slot (1 KiB).
    ps.register_recv(3, "rogue:len", key("z:0"), DType::F32, &[16])
        .unwrap();
    let mut s = rogue(addr, "rogue:len").await;
    s.write_all(&encode_header(&Header::data(3, 1, 1000)))
        .await
        .unwrap();
    assert_dropped(s).await;

    // A truncated frame: a pending Recv on that peer's key fails naming it.
    let pending = recv(&ps, &k2, 1);
    let mut s = rogue(addr, "rogue:trunc").await;
    s.write_all(&encode_header(&Header::data(2, 1, 1024)))
        .await
        .unwrap();
    s.write_all(&[7u8; 100]).await.unwrap();
    drop(s);
    match wait(pending).await {
        Err(RendezvousError::PeerGone { peer, cause }) => {
            assert_eq!(peer, "rogue:trunc");
            assert!(cause.contains("payload"), "{cause}");
        }
        other => panic!("expected PeerGone, got {other:?}"),
    }

    // A truncated header.
    let mut s = rogue(addr, "rogue:head").await;
    s.write_all(&encode_header(&Header::data(1, 1, 1024))[..10])
        .await
        .unwrap();
    drop(s);

    // The good connection still works.
    for step in 10..13 {
        worker.send(&k, step, values(256, step)).unwrap();
        let got = wait(recv(&ps, &k, step)).await.unwrap();
        assert_eq!(got.as_bytes(), values(256, step).as_bytes());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stalls_mid_frame_is_dropped_after_the_frame_timeout() {
    let config = TcpConfig {
        frame_timeout: Duration::from_millis(200),
        ..TcpConfig::default()
    };
    let ps = TcpPlane::bind("ps:0", any_addr(), config).await.unwrap();
    let k = key("x:0");
    ps.register_recv(1, "worker:slow", k.clone(), DType::F32, &[64])
        .unwrap();
    let pending = recv(&ps, &k, 1);
    let mut s = rogue(ps.local_addr(), "worker:slow").await;
    s.write_all(&encode_header(&Header::data(1, 1, 256)))
        .await
        .unwrap();
    s.write_all(&[1u8; 100]).await.unwrap();
    // The connection stays open, the rest never comes.
    match wait(pending).await {
        Err(RendezvousError::PeerGone { peer, cause }) => {
            assert_eq!(peer, "worker:slow");
            assert!(
                cause.contains("timed out") || cause.contains("TimedOut"),
                "{cause}"
            );
        }
        other => panic!("expected PeerGone, got {other:?}"),
    }
    assert_dropped(s).await;
}
