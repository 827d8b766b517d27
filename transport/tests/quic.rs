//! The QUIC data plane between endpoints on 127.0.0.1 (ephemeral ports, bounded in time):
//! tensors by key and step, messages, mutual TLS against a cluster CA (another CA's certificate,
//! no certificate, someone else's certificate: all refused while the good pair keeps working),
//! bad frames dropping the peer, and the certificate files `dflow cert` writes.

use dflow_graph::{DType, Tensor};
use dflow_transport::plane::{bind_with_identity, DataPlane, PeerEvent, TransportKind};
use dflow_transport::quic::pki::{self, Authority};
use dflow_transport::quic::{tls, QuicIdentity, QuicPlane};
use dflow_transport::wire::{encode_header, FrameKind, Header};
use dflow_transport::TcpConfig;
use dflow_transport::{Rendezvous, RendezvousError, RendezvousKey};
use quinn::crypto::rustls::QuicClientConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

mod support;
use support::{recv, wait_within};

const WAIT: Duration = Duration::from_secs(10);

fn any_addr() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn config() -> TcpConfig {
    TcpConfig {
        frame_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(5),
        ..TcpConfig::default()
    }
}

fn key(name: &str) -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new(
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:0/device:CPU:0",
        name,
    ))
}

fn values(n: usize, step: u64) -> Tensor {
    let v: Vec<f32> = (0..n)
        .map(|i| f32::from_bits((i as u32).wrapping_mul(2_654_435_761) ^ step as u32))
        .collect();
    Tensor::from_slice(&[n], &v).unwrap()
}

async fn wait(
    rx: oneshot::Receiver<Result<Tensor, RendezvousError>>,
) -> Result<Tensor, RendezvousError> {
    wait_within(rx, WAIT).await
}

/// Identities for `ps:0`, `worker:0`, `worker:1` under one CA.
fn cluster() -> Vec<QuicIdentity> {
    pki::ephemeral_cluster(&["ps:0", "worker:0", "worker:1"]).unwrap()
}

async fn quic(name: &str, id: &QuicIdentity) -> Arc<QuicPlane> {
    QuicPlane::bind(name, any_addr(), config(), None, id.clone())
        .await
        .unwrap()
}

/// ps:0 receives `x:0` ([n] f32, slot 1) from worker:0; worker:0 receives `y:0` ([4], slot 2).
async fn pair(ids: &[QuicIdentity], n: usize) -> (Arc<QuicPlane>, Arc<QuicPlane>) {
    let ps = quic("ps:0", &ids[0]).await;
    let worker = quic("worker:0", &ids[1]).await;
    ps.register_recv(1, "worker:0", key("x:0"), DType::F32, &[n])
        .unwrap();
    worker.register_send(key("x:0"), "ps:0", 1);
    worker
        .register_recv(2, "ps:0", key("y:0"), DType::F32, &[4])
        .unwrap();
    ps.register_send(key("y:0"), "worker:0", 2);
    QuicPlane::connect(&worker, "ps:0", ps.local_addr())
        .await
        .unwrap();
    QuicPlane::connect(&ps, "worker:0", worker.local_addr())
        .await
        .unwrap();
    (ps, worker)
}

/// One round: worker → ps `x:0`, ps → worker `y:0`; checks the bytes.
async fn round(ps: &QuicPlane, worker: &QuicPlane, n: usize, step: u64) {
    let x = key("x:0");
    let y = key("y:0");
    let rx = recv(ps, &x, step);
    worker.send(&x, step, values(n, step)).unwrap();
    let got = wait(rx).await.unwrap();
    assert_eq!(got.dims(), &[n]);
    assert_eq!(got.as_bytes(), values(n, step).as_bytes(), "step {step}");
    drop(got);
    ps.send(&y, step, values(4, step)).unwrap();
    let got = wait(recv(worker, &y, step)).await.unwrap();
    assert_eq!(got.as_bytes(), values(4, step).as_bytes(), "step {step}");
    ps.finish_step(step);
    worker.finish_step(step);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_arrive_bit_identical_through_plane_bind() {
    let ids = cluster();
    let n = 1 << 20;
    let ps = bind_with_identity(
        TransportKind::Quic,
        "ps:0",
        any_addr(),
        config(),
        None,
        Some(ids[0].clone()),
    )
    .await
    .unwrap();
    let worker = bind_with_identity(
        TransportKind::Quic,
        "worker:0",
        any_addr(),
        config(),
        None,
        Some(ids[1].clone()),
    )
    .await
    .unwrap();
    let mut events = ps.subscribe();
    let x = key("x:0");
    ps.register_recv(1, "worker:0", x.clone(), DType::F32, &[n])
        .unwrap();
    worker.register_send(x.clone(), "ps:0", 1);
    worker
        .clone()
        .connect("ps:0".into(), ps.local_addr())
        .await
        .unwrap();
    let mut last_ptr = None;
    for step in 1..=6u64 {
        // Alternate Recv-before-Send and Send-before-Recv.
        let got = if step % 2 == 0 {
            let rx = recv(&*ps, &x, step);
            worker.send(&x, step, values(n, step)).unwrap();
            wait(rx).await.unwrap()
        } else {
            worker.send(&x, step, values(n, step)).unwrap();
            wait(recv(&*ps, &x, step)).await.unwrap()
        };
        assert_eq!(got.as_bytes(), values(n, step).as_bytes(), "step {step}");
        // Released before the next step: the next frame lands in the same buffer.
        if let Some(p) = last_ptr {
            assert_eq!(got.data_ptr(), p, "step {step} reuses the slot buffer");
        }
        last_ptr = Some(got.data_ptr());
        ps.finish_step(step);
    }
    // Messages arrive in order, after the Data frames queued before them.
    for i in 0..3u8 {
        worker.send_message("ps:0", vec![i; 10]).unwrap();
    }
    for i in 0..3u8 {
        match tokio::time::timeout(WAIT, events.recv()).await.unwrap() {
            Some(PeerEvent::Message { peer, body }) => {
                assert_eq!(&*peer, "worker:0");
                assert_eq!(body, vec![i; 10]);
            }
            other => panic!("expected message {i}, got {other:?}"),
        }
    }
    // A clean close is not a failure while the plane closes.
    worker.close(Duration::from_secs(2)).await;
    ps.close(Duration::from_secs(2)).await;
}

/// A raw client: its own endpoint, `crypto`, dialling `ps:0` at `addr`. Returns the stream
/// pair after the QUIC handshake (the TLS verdict of the acceptor may come later).
async fn raw_client(
    crypto: rustls::ClientConfig,
    addr: SocketAddr,
) -> Result<(quinn::Endpoint, quinn::SendStream, quinn::RecvStream), String> {
    let crypto = QuicClientConfig::try_from(crypto).map_err(|e| e.to_string())?;
    let endpoint = quinn::Endpoint::client(any_addr()).map_err(|e| e.to_string())?;
    let client = quinn::ClientConfig::new(Arc::new(crypto));
    let conn = endpoint
        .connect_with(client, addr, "ps-0.dflow")
        .map_err(|e| e.to_string())?;
    let conn = tokio::time::timeout(WAIT, conn)
        .await
        .map_err(|_| "handshake timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let (send, recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    Ok((endpoint, send, recv))
}

fn frame(kind: FrameKind, slot_id: u32, step: u64, body: &[u8]) -> Vec<u8> {
    let mut f = encode_header(&Header {
        kind,
        flags: 0,
        slot_id,
        step,
        payload_len: body.len() as u64,
    })
    .to_vec();
    f.extend_from_slice(body);
    f
}

/// Sends a Hello as `name` and waits for the acceptor's answer: `Ok` when accepted.
async fn hello(
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    name: &str,
) -> Result<(), String> {
    send.write_all(&frame(FrameKind::Hello, 0, 0, name.as_bytes()))
        .await
        .map_err(|e| e.to_string())?;
    let mut head = [0u8; 28];
    tokio::time::timeout(WAIT, recv.read_exact(&mut head))
        .await
        .map_err(|_| "no answer".to_string())?
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_a_valid_certificate_are_refused_and_the_good_pair_keeps_working() {
    let ids = cluster();
    let (ps, worker) = pair(&ids, 256).await;
    let mut events = ps.subscribe();
    round(&ps, &worker, 256, 1).await;

    // 1. A task whose certificate comes from another CA (and which trusts only that CA).
    let other = pki::ephemeral_cluster(&["worker:1"]).unwrap();
    let rogue = quic("worker:1", &other[0]).await;
    let e = QuicPlane::connect(&rogue, "ps:0", ps.local_addr())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("ps:0"), "{e}");
    round(&ps, &worker, 256, 2).await;

    // 2. A client that trusts the cluster CA but presents another CA's certificate.
    let other_ca = Authority::generate(1).unwrap();
    let issued = other_ca.issue("worker:1", 1).unwrap();
    let (_, chain, key_der) = other_ca.identity_parts(&issued).unwrap();
    let crypto = tls::client_config_from_parts(ids[0].ca(), chain, key_der).unwrap();
    let refused = match raw_client(crypto, ps.local_addr()).await {
        Err(_) => true,
        Ok((_ep, mut send, mut recv)) => hello(&mut send, &mut recv, "worker:1").await.is_err(),
    };
    assert!(refused, "a certificate from another CA must be refused");
    round(&ps, &worker, 256, 3).await;

    // 3. A client with no certificate at all.
    let crypto = tls::anonymous_client_config(ids[0].ca()).unwrap();
    let refused = match raw_client(crypto, ps.local_addr()).await {
        Err(_) => true,
        Ok((_ep, mut send, mut recv)) => hello(&mut send, &mut recv, "worker:1").await.is_err(),
    };
    assert!(refused, "a client without a certificate must be refused");
    round(&ps, &worker, 256, 4).await;

    // 4. A valid certificate for worker:1 claiming to be worker:0.
    let crypto = tls::client_config(&ids[2]).unwrap();
    let (_ep, mut send, mut recv) = raw_client(crypto, ps.local_addr()).await.unwrap();
    let e = hello(&mut send, &mut recv, "worker:0").await.unwrap_err();
    assert!(!e.is_empty());
    round(&ps, &worker, 256, 5).await;

    let stats = ps.stats();
    assert!(stats.refused_tls >= 3, "{stats:?}");
    assert_eq!(stats.refused_identity, 1, "{stats:?}");
    // None of this reached the layer above: no Gone, no message.
    assert!(events.try_recv().is_err());
    // The rogue plane itself was never accepted by ps.
    assert!(!rogue.is_connected("ps:0"));
}

/// Connects a raw client with worker:1's valid certificate, sends its Hello and then `bytes`,
/// finishes the stream, and returns the Gone event ps reports for worker:1.
async fn bad_frame(
    ps: &QuicPlane,
    events: &mut mpsc::UnboundedReceiver<PeerEvent>,
    id: &QuicIdentity,
    bytes: &[u8],
) -> String {
    let crypto = tls::client_config(id).unwrap();
    let (_ep, mut send, mut recv) = raw_client(crypto, ps.local_addr()).await.unwrap();
    hello(&mut send, &mut recv, "worker:1").await.unwrap();
    send.write_all(bytes).await.unwrap();
    let _ = send.finish();
    tokio::time::timeout(WAIT, async {
        loop {
            match events.recv().await {
                Some(PeerEvent::Gone { peer, cause }) => {
                    assert_eq!(&*peer, "worker:1");
                    break cause;
                }
                Some(_) => continue,
                None => panic!("events ended"),
            }
        }
    })
    .await
    .expect("ps drops the peer in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_oversized_and_garbage_frames_drop_the_peer() {
    let ids = cluster();
    let (ps, worker) = pair(&ids, 64).await;
    // worker:1 may send slot 7: 64 bytes.
    ps.register_recv(7, "worker:1", key("z:0"), DType::F32, &[16])
        .unwrap();
    let mut events = ps.subscribe();

    let data = frame(FrameKind::Data, 7, 1, &[0u8; 64]);
    let cause = bad_frame(&ps, &mut events, &ids[2], &data[..10]).await;
    assert!(cause.contains("truncated frame header"), "{cause}");
    round(&ps, &worker, 64, 1).await;

    let cause = bad_frame(&ps, &mut events, &ids[2], &data[..50]).await;
    assert!(cause.contains("truncated frame"), "{cause}");
    round(&ps, &worker, 64, 2).await;

    let long = frame(FrameKind::Data, 7, 3, &[0u8; 65]);
    let cause = bad_frame(&ps, &mut events, &ids[2], &long).await;
    assert!(cause.contains("announces 65 payload bytes"), "{cause}");
    round(&ps, &worker, 64, 3).await;

    let unknown = frame(FrameKind::Data, 99, 4, &[0u8; 8]);
    let cause = bad_frame(&ps, &mut events, &ids[2], &unknown).await;
    assert!(cause.contains("unknown slot 99"), "{cause}");
    round(&ps, &worker, 64, 4).await;

    let cause = bad_frame(
        &ps,
        &mut events,
        &ids[2],
        b"GET /index.html HTTP/1.1\r\nHost: example\r\n\r\n",
    )
    .await;
    assert!(cause.contains("bad frame magic"), "{cause}");
    round(&ps, &worker, 64, 5).await;

    // A slot of worker:0 written by worker:1.
    let foreign = frame(FrameKind::Data, 1, 6, &[0u8; 256]);
    let cause = bad_frame(&ps, &mut events, &ids[2], &foreign).await;
    assert!(cause.contains("belongs to peer `worker:0`"), "{cause}");
    round(&ps, &worker, 64, 6).await;

    assert_eq!(ps.stats().dropped_bad_frames, 6);
}

#[test]
fn cert_files_are_written_with_private_keys_0600_and_load_back() {
    let dir = tempfile::tempdir().unwrap();
    let written = pki::init_ca(dir.path(), 30, false).unwrap();
    assert_eq!(written.len(), 2);
    // The CA is not replaced by accident.
    let e = pki::init_ca(dir.path(), 30, false).unwrap_err();
    assert!(e.to_string().contains("ca.crt"), "{e}");
    for task in ["/job:worker/replica:0/task:0", "ps:0"] {
        pki::issue_to_dir(dir.path(), task, 30).unwrap();
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        for f in ["ca.key", "worker-0.key", "ps-0.key"] {
            let mode = std::fs::metadata(dir.path().join(f))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{f}");
        }
    }
    // No temporary file is left behind.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    let id = QuicIdentity::from_dir("/job:worker/replica:0/task:0", dir.path()).unwrap();
    assert_eq!(id.dns_name(), "worker-0.dflow");
    // A task without a certificate: the error names the missing file.
    let e = QuicIdentity::from_dir("worker:5", dir.path()).unwrap_err();
    assert!(e.to_string().contains("worker-5.crt"), "{e}");
    // A certificate under another task's name: refused, naming the file.
    std::fs::copy(dir.path().join("ps-0.crt"), dir.path().join("worker-9.crt")).unwrap();
    std::fs::copy(dir.path().join("ps-0.key"), dir.path().join("worker-9.key")).unwrap();
    let e = QuicIdentity::from_dir("worker:9", dir.path()).unwrap_err();
    assert!(
        e.to_string().contains("worker-9.crt") && e.to_string().contains("worker-9.dflow"),
        "{e}"
    );
    // A garbage key file: named.
    std::fs::write(dir.path().join("worker-9.key"), "not a key").unwrap();
    let e = QuicIdentity::from_dir("worker:9", dir.path()).unwrap_err();
    assert!(e.to_string().contains("worker-9.key"), "{e}");
    // Issuing with a CA key that does not belong to ca.crt is refused.
    let other = tempfile::tempdir().unwrap();
    pki::init_ca(other.path(), 30, false).unwrap();
    std::fs::copy(other.path().join("ca.key"), dir.path().join("ca.key")).unwrap();
    let e = pki::issue_to_dir(dir.path(), "worker:1", 30).unwrap_err();
    assert!(e.to_string().contains("ca.key"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_binds_late_is_reached_quickly() {
    let ids = cluster();
    // Reserve a port, free it, and bind ps there 300 ms after worker:0 starts dialling.
    let port = std::net::UdpSocket::bind(any_addr())
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let worker = quic("worker:0", &ids[1]).await;
    let ps_id = ids[0].clone();
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        QuicPlane::bind("ps:0", addr, config(), None, ps_id)
            .await
            .unwrap()
    });
    let t0 = std::time::Instant::now();
    QuicPlane::connect(&worker, "ps:0", addr).await.unwrap();
    let took = t0.elapsed();
    let _ps = late.await.unwrap();
    assert!(took < Duration::from_secs(2), "took {took:?}");
}
