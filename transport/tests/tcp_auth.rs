//! Authenticated TCP connections: with a cluster secret, only peers that know it get through;
//! a refused peer leaves the authenticated connections working.

use dflow_graph::{DType, Tensor};
use dflow_transport::auth::Secret;
use dflow_transport::tcp::TcpPlane;
use dflow_transport::TcpConfig;
use dflow_transport::{Rendezvous, RendezvousError, RendezvousKey};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

const WAIT: Duration = Duration::from_secs(5);

fn any_addr() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn key() -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new(
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:0/device:CPU:0",
        "grad:0",
    ))
}

fn secret(s: &str) -> Option<Secret> {
    Some(Secret::new(s.as_bytes(), "test").unwrap())
}

fn config() -> TcpConfig {
    TcpConfig {
        frame_timeout: Duration::from_secs(2),
        ..TcpConfig::default()
    }
}

async fn endpoint(name: &str, s: Option<Secret>) -> Arc<TcpPlane> {
    TcpPlane::bind_with_secret(name, any_addr(), config(), s)
        .await
        .unwrap()
}

async fn transfer(
    ps: &TcpPlane,
    worker: &TcpPlane,
    k: &Arc<RendezvousKey>,
    step: u64,
) -> Result<Tensor, RendezvousError> {
    let (tx, rx) = oneshot::channel();
    ps.recv_async(
        k,
        step,
        Box::new(move |v| {
            let _ = tx.send(v);
        }),
    );
    worker.send(
        k,
        step,
        Tensor::from_slice(&[2], &[step as f32, 2.0]).unwrap(),
    )?;
    tokio::time::timeout(WAIT, rx)
        .await
        .expect("in time")
        .expect("callback ran")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_the_secret_exchange_tensors() {
    let s = "a-cluster-secret-of-enough-length";
    let ps = endpoint("ps:0", secret(s)).await;
    let worker = endpoint("worker:0", secret(s)).await;
    let k = key();
    ps.register_recv(1, "worker:0", k.clone(), DType::F32, &[2])
        .unwrap();
    worker.register_send(k.clone(), "ps:0", 1);
    worker.connect("ps:0", ps.local_addr()).await.unwrap();
    for step in 1..=3 {
        let t = transfer(&ps, &worker, &k, step).await.unwrap();
        assert_eq!(t.as_slice::<f32>().unwrap(), &[step as f32, 2.0]);
        ps.finish_step(step);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_another_secret_cannot_connect() {
    let ps = endpoint("ps:0", secret("the-right-secret-0123456789")).await;
    let impostor = endpoint("worker:0", secret("a-wrong-secret-0123456789")).await;
    let e = impostor
        .connect("ps:0", ps.local_addr())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("authenticating") && e.contains("its cluster secret differs"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_a_handshake_are_dropped_and_the_good_peer_keeps_working() {
    let s = "a-cluster-secret-of-enough-length";
    let ps = endpoint("ps:0", secret(s)).await;
    let k = key();
    ps.register_recv(1, "worker:0", k.clone(), DType::F32, &[2])
        .unwrap();

    // A plain (unauthenticated) dflow endpoint: its name-only Hello is not an auth Hello.
    let plain = endpoint("worker:0", None).await;
    plain.register_send(k.clone(), "ps:0", 1);
    plain.connect("ps:0", ps.local_addr()).await.unwrap(); // the TCP connect itself succeeds
                                                           // ...but nothing it sends is accepted: the ps drops the connection during the handshake.
    let (tx, rx) = oneshot::channel();
    ps.recv_async(
        &k,
        1,
        Box::new(move |v| {
            let _ = tx.send(v);
        }),
    );
    let _ = plain.send(&k, 1, Tensor::from_slice(&[2], &[9.0f32, 9.0]).unwrap());
    assert!(
        tokio::time::timeout(Duration::from_millis(500), rx)
            .await
            .is_err(),
        "no tensor from an unauthenticated peer"
    );
    ps.abort_step(
        1,
        RendezvousError::Aborted {
            step: 1,
            cause: "test".into(),
        },
    );
    ps.finish_step(1);

    // A raw client sending garbage, then one that stalls: both dropped.
    let mut raw = TcpStream::connect(ps.local_addr()).await.unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\n\r\n garbage garbage garbage")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(WAIT, raw.read(&mut buf))
        .await
        .expect("the ps closes it");
    assert!(
        matches!(n, Ok(0) | Err(_)),
        "connection closed without a reply"
    );

    // The real worker still gets through.
    let worker = endpoint("worker:0", secret(s)).await;
    worker.register_send(k.clone(), "ps:0", 1);
    worker.connect("ps:0", ps.local_addr()).await.unwrap();
    let t = transfer(&ps, &worker, &k, 2).await.unwrap();
    assert_eq!(t.as_slice::<f32>().unwrap(), &[2.0, 2.0]);
}
