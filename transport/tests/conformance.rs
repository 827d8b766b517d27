//! One conformance suite for every rendezvous backend: each scenario is one test body, run over
//! the in-process rendezvous (`local`), TCP, shared memory, QUIC and the RDMA plane over the
//! simulated fabric (`rdma_sim`), as `conformance!(scenario: backends...)` generates a test per
//! backend (`values::tcp`, `abort::quic`, ...), in the manner of candle's `test_device!`.
//!
//! Every pair is a `sender` task and a `receiver` task on 127.0.0.1 (ephemeral ports, waits
//! bounded). The sender sends keys `x0:0`, `x1:0`, `x2:0` (1, 1000 and 2^20 f32: 4 B, 4 KB and
//! 4 MiB) into the receiver's slots 1–3; the receiver sends `y:0` ([4] f32) into the sender's
//! slot 9. The sender runs on a tokio runtime of its own: shutting that runtime down drops all
//! its tasks and sockets at once, without a flush or an orderly close, which is how a killed
//! task looks to its peers. Over `local` both ends are one in-process rendezvous, so the
//! scenarios about peers (death, a sender that left, close) do not apply to it.
//!
//! Backend-specific behaviour stays in the backends' own files: handshakes, TLS and
//! authentication, bad frames, slot reuse and zero-copy counters, ring and credit details.

use dflow_graph::{DType, Tensor};
use dflow_transport::plane::{bind_with_identity, DataPlane, PeerEvent, TransportKind};
use dflow_transport::quic::{pki, QuicIdentity};
use dflow_transport::rdma::plane::RdmaPlane;
use dflow_transport::rdma::sim::SimFabric;
use dflow_transport::{LocalRendezvous, Rendezvous, RendezvousError, RendezvousKey, TcpConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

mod support;
use support::{recv, wait_within};

/// Bound of every wait for a value, an error or an event.
const WAIT: Duration = Duration::from_secs(15);
/// Elements of the sender's keys `x0:0`, `x1:0`, `x2:0`.
const SIZES: [usize; 3] = [1, 1000, 1 << 20];
/// Elements of the receiver's key `y:0`.
const BACK: usize = 4;

/// Where the pair's two tasks meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Local,
    Tcp,
    Shm,
    Quic,
    RdmaSim,
}

impl Backend {
    fn from_name(name: &str) -> Backend {
        match name {
            "local" => Backend::Local,
            "tcp" => Backend::Tcp,
            "shm" => Backend::Shm,
            "quic" => Backend::Quic,
            "rdma_sim" => Backend::RdmaSim,
            other => panic!("no backend `{other}` in this suite"),
        }
    }
}

/// Generates, for `scenario`, one test per listed backend (`scenario::backend`), each running
/// the one body `scenario(Backend)`.
macro_rules! conformance {
    ($scenario:ident: $($backend:ident),+ $(,)?) => {
        mod $scenario {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $backend() {
                    let backend = super::Backend::from_name(stringify!($backend));
                    if backend == super::Backend::Shm && !cfg!(target_os = "linux") {
                        eprintln!("the shm transport needs Linux: not run");
                        return;
                    }
                    super::$scenario(backend).await
                }
            )+
        }
    };
}

conformance!(values: local, tcp, shm, quic, rdma_sim);
conformance!(unrouted_keys_meet_locally: local, tcp, shm, quic, rdma_sim);
conformance!(abort: local, tcp, shm, quic, rdma_sim);
conformance!(late_recv_after_the_value_arrived: local, tcp, shm, quic, rdma_sim);
conformance!(peer_death: tcp, shm, quic, rdma_sim);
conformance!(late_recv_after_the_sender_left: tcp, shm, quic, rdma_sim);
conformance!(close: tcp, shm, quic, rdma_sim);
conformance!(traffic_counts_values_sent_to_peers: tcp, shm, quic, rdma_sim);

fn x(i: usize) -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new(
        "/job:sender/replica:0/task:0/device:CPU:0",
        "/job:receiver/replica:0/task:0/device:CPU:0",
        &format!("x{i}:0"),
    ))
}

fn y() -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new(
        "/job:receiver/replica:0/task:0/device:CPU:0",
        "/job:sender/replica:0/task:0/device:CPU:0",
        "y:0",
    ))
}

/// `n` f32s whose bits depend on every index and on `step` (NaNs and denormals included).
fn tensor(n: usize, step: u64) -> Tensor {
    let v: Vec<f32> = (0..n)
        .map(|i| f32::from_bits((i as u32).wrapping_mul(2_654_435_761) ^ step as u32))
        .collect();
    Tensor::from_slice(&[n], &v).unwrap()
}

fn config() -> TcpConfig {
    TcpConfig {
        // A dead QUIC peer is noticed by the idle timeout: keep it short, with heartbeats
        // keeping live connections busy.
        idle_timeout: Duration::from_secs(3),
        heartbeat_interval: Some(Duration::from_millis(200)),
        frame_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
        ..TcpConfig::default()
    }
}

/// A sender and a receiver joined over one backend (see the module docs).
struct Pair {
    sender: Arc<dyn Rendezvous>,
    receiver: Arc<dyn Rendezvous>,
    /// The two data planes (`None` over `local`).
    planes: Option<(Arc<dyn DataPlane>, Arc<dyn DataPlane>)>,
    /// What the sender and the receiver hear about their peers (`None` over `local`).
    sender_events: Option<UnboundedReceiver<PeerEvent>>,
    receiver_events: Option<UnboundedReceiver<PeerEvent>>,
    /// The sender's runtime: shutting it down is the sender's death.
    sender_rt: Option<tokio::runtime::Runtime>,
}

impl Drop for Pair {
    fn drop(&mut self) {
        if let Some(rt) = self.sender_rt.take() {
            rt.shutdown_background();
        }
    }
}

async fn bind(
    backend: Backend,
    name: &'static str,
    fabric: SimFabric,
    id: QuicIdentity,
) -> Arc<dyn DataPlane> {
    let addr = "127.0.0.1:0".parse().unwrap();
    let kind = match backend {
        Backend::Tcp => TransportKind::Tcp,
        Backend::Shm => TransportKind::Shm,
        Backend::Quic => TransportKind::Quic,
        Backend::RdmaSim => {
            fabric.add_device(name);
            let verbs = Arc::new(fabric.open(name).unwrap());
            let plane: Arc<dyn DataPlane> = RdmaPlane::bind(name, addr, config(), None, verbs)
                .await
                .unwrap();
            return plane;
        }
        Backend::Local => unreachable!("the local rendezvous has no plane"),
    };
    bind_with_identity(kind, name, addr, config(), None, Some(id))
        .await
        .unwrap()
}

impl Pair {
    async fn new(backend: Backend) -> Pair {
        if backend == Backend::Local {
            let local: Arc<dyn Rendezvous> = Arc::new(LocalRendezvous::new());
            return Pair {
                sender: local.clone(),
                receiver: local,
                planes: None,
                sender_events: None,
                receiver_events: None,
                sender_rt: None,
            };
        }
        let ids = pki::ephemeral_cluster(&["sender", "receiver"]).unwrap();
        let fabric = SimFabric::new();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let sender = rt
            .spawn(bind(backend, "sender", fabric.clone(), ids[0].clone()))
            .await
            .unwrap();
        let receiver = bind(backend, "receiver", fabric, ids[1].clone()).await;
        let sender_events = sender.subscribe();
        let receiver_events = receiver.subscribe();
        for (i, &n) in SIZES.iter().enumerate() {
            receiver
                .register_recv(1 + i as u32, "sender", x(i), DType::F32, &[n])
                .unwrap();
            sender.register_send(x(i), "receiver", 1 + i as u32);
        }
        sender
            .register_recv(9, "receiver", y(), DType::F32, &[BACK])
            .unwrap();
        receiver.register_send(y(), "sender", 9);
        rt.spawn(
            sender
                .clone()
                .connect("receiver".into(), receiver.local_addr()),
        )
        .await
        .unwrap()
        .unwrap();
        receiver
            .clone()
            .connect("sender".into(), sender.local_addr())
            .await
            .unwrap();
        Pair {
            sender: sender.clone().as_rendezvous(),
            receiver: receiver.clone().as_rendezvous(),
            planes: Some((sender, receiver)),
            sender_events: Some(sender_events),
            receiver_events: Some(receiver_events),
            sender_rt: Some(rt),
        }
    }

    fn planes(&self) -> (&Arc<dyn DataPlane>, &Arc<dyn DataPlane>) {
        let (s, r) = self.planes.as_ref().expect("a backend with peers");
        (s, r)
    }

    /// Kills the sender: its runtime stops with every task and socket of its plane.
    fn kill_sender(&mut self) {
        if let Some(rt) = self.sender_rt.take() {
            rt.shutdown_background();
        }
    }

    /// Closes the sender's plane in good order (on its own runtime), flushing for at most
    /// `within`.
    async fn close_sender(&self, within: Duration) {
        let sender = self.planes().0.clone();
        let rt = self.sender_rt.as_ref().expect("the sender runs");
        let t0 = Instant::now();
        rt.spawn(async move { sender.close(within).await })
            .await
            .unwrap();
        assert!(
            t0.elapsed() < within + Duration::from_secs(5),
            "close took {:?} with a bound of {within:?}",
            t0.elapsed()
        );
    }
}

/// The next event that `events` reports about `peer` being gone, with its cause; other
/// events before it are returned too.
async fn next_gone(
    events: &mut UnboundedReceiver<PeerEvent>,
    peer: &str,
) -> (String, Vec<PeerEvent>) {
    let mut others = Vec::new();
    let found = tokio::time::timeout(WAIT, async {
        while let Some(e) = events.recv().await {
            match e {
                PeerEvent::Gone { peer: p, cause } if &*p == peer => return Some(cause),
                other => others.push(other),
            }
        }
        None
    })
    .await;
    match found {
        Ok(Some(cause)) => (cause, others),
        Ok(None) => panic!("the events ended before `{peer}` was reported gone"),
        Err(_) => panic!("`{peer}` was not reported gone within {WAIT:?}"),
    }
}

/// Fails unless `events` reports nothing about `peer` being gone for `quiet`.
async fn no_gone(events: &mut UnboundedReceiver<PeerEvent>, peer: &str, quiet: Duration) {
    let deadline = tokio::time::Instant::now() + quiet;
    while let Ok(Some(e)) = tokio::time::timeout_at(deadline, events.recv()).await {
        if let PeerEvent::Gone { peer: p, cause } = e {
            assert_ne!(&*p, peer, "`{peer}` reported gone (again): {cause}");
        }
    }
}

async fn expect_value(r: &dyn Rendezvous, key: &Arc<RendezvousKey>, step: u64, n: usize) {
    let got = wait_within(recv(r, key, step), WAIT)
        .await
        .unwrap_or_else(|e| panic!("{key} in step {step}: {e}"));
    assert_eq!(got.dims(), &[n], "{key} in step {step}");
    assert_eq!(
        got.as_bytes(),
        tensor(n, step).as_bytes(),
        "{key} in step {step}"
    );
}

fn assert_sender_gone(e: &RendezvousError) {
    assert!(
        matches!(e, RendezvousError::PeerGone { peer, .. } if peer == "sender"),
        "expected PeerGone naming `sender`, got {e}"
    );
}

/// Every size arrives bit-identical, step after step, in both directions, whether the Recv
/// or the Send comes first; nothing is left pending.
async fn values(backend: Backend) {
    let p = Pair::new(backend).await;
    for step in 1..=4u64 {
        for (i, &n) in SIZES.iter().enumerate() {
            if step % 2 == 0 {
                let rx = recv(&*p.receiver, &x(i), step);
                p.sender.send(&x(i), step, tensor(n, step)).unwrap();
                let got = wait_within(rx, WAIT).await.unwrap();
                assert_eq!(
                    got.as_bytes(),
                    tensor(n, step).as_bytes(),
                    "x{i} step {step}"
                );
            } else {
                p.sender.send(&x(i), step, tensor(n, step)).unwrap();
                expect_value(&*p.receiver, &x(i), step, n).await;
            }
        }
        p.receiver.send(&y(), step, tensor(BACK, step)).unwrap();
        expect_value(&*p.sender, &y(), step, BACK).await;
        assert!(p.receiver.pending_recvs(step).is_empty());
        assert!(p.sender.pending_recvs(step).is_empty());
        p.sender.finish_step(step);
        p.receiver.finish_step(step);
    }
}

/// Each plane counts the payload bytes and values it sent to its peer, and nothing for values
/// that stayed in the task.
async fn traffic_counts_values_sent_to_peers(backend: Backend) {
    let p = Pair::new(backend).await;
    let (sender, receiver) = p.planes();
    assert_eq!(sender.traffic(), dflow_transport::Traffic::default());
    let mut bytes = 0;
    for step in 1..=2u64 {
        for (i, &n) in SIZES.iter().enumerate() {
            p.sender.send(&x(i), step, tensor(n, step)).unwrap();
            expect_value(&*p.receiver, &x(i), step, n).await;
            bytes += 4 * n as u64;
        }
        p.receiver.send(&y(), step, tensor(BACK, step)).unwrap();
        expect_value(&*p.sender, &y(), step, BACK).await;
    }
    let here = Arc::new(RendezvousKey::new(
        "/job:receiver/replica:0/task:0/device:CPU:0",
        "/job:receiver/replica:0/task:0/device:CPU:1",
        "l:0",
    ));
    let rx = recv(&*p.receiver, &here, 1);
    p.receiver.send(&here, 1, tensor(64, 1)).unwrap();
    wait_within(rx, WAIT).await.unwrap();
    let sent = sender.traffic();
    assert_eq!(sent.bytes, bytes);
    assert_eq!(sent.messages, 2 * SIZES.len() as u64);
    let back = receiver.traffic();
    assert_eq!(
        back.bytes,
        2 * 4 * BACK as u64,
        "the local value is not counted"
    );
    assert_eq!(back.messages, 2);
}

/// A key with neither a route nor a receive slot meets its Recv in the same task, without a
/// copy.
async fn unrouted_keys_meet_locally(backend: Backend) {
    let p = Pair::new(backend).await;
    let here = Arc::new(RendezvousKey::new(
        "/job:receiver/replica:0/task:0/device:CPU:0",
        "/job:receiver/replica:0/task:0/device:CPU:1",
        "l:0",
    ));
    let t = tensor(32, 1);
    let ptr = t.data_ptr();
    let rx = recv(&*p.receiver, &here, 1);
    p.receiver.send(&here, 1, t).unwrap();
    assert_eq!(wait_within(rx, WAIT).await.unwrap().data_ptr(), ptr);
    assert!(p.receiver.pending_recvs(1).is_empty());
}

/// An abort fails the pending Recv of that step on the other side with its cause, in either
/// direction (a long cause is cut, not a panic), and leaves the other steps alone.
async fn abort(backend: Backend) {
    let p = Pair::new(backend).await;
    let pending = recv(&*p.receiver, &x(0), 4);
    p.sender.abort_step(
        4,
        RendezvousError::Aborted {
            step: 4,
            cause: "node `m` failed".into(),
        },
    );
    let e = wait_within(pending, WAIT).await.unwrap_err();
    assert!(
        matches!(&e, RendezvousError::Aborted { step: 4, cause } if cause.contains("node `m` failed")),
        "{e}"
    );
    // The other way round.
    let pending = recv(&*p.sender, &y(), 6);
    p.receiver.abort_step(
        6,
        RendezvousError::Aborted {
            step: 6,
            cause: "node `n` failed".into(),
        },
    );
    let e = wait_within(pending, WAIT).await.unwrap_err();
    assert!(
        matches!(&e, RendezvousError::Aborted { step: 6, cause } if cause.contains("node `n` failed")),
        "{e}"
    );
    // A long cause that is not ASCII is cut at a character boundary on the way, never a panic.
    let long = format!("x{}", "€".repeat(2000));
    let pending = recv(&*p.receiver, &x(0), 8);
    p.sender.abort_step(
        8,
        RendezvousError::Aborted {
            step: 8,
            cause: long.clone(),
        },
    );
    let e = wait_within(pending, WAIT).await.unwrap_err();
    assert!(
        matches!(&e, RendezvousError::Aborted { step: 8, cause } if cause.contains("x€€€")),
        "{e}"
    );
    // Step 5 was not aborted: its values still flow.
    p.sender.send(&x(0), 5, tensor(SIZES[0], 5)).unwrap();
    expect_value(&*p.receiver, &x(0), 5, SIZES[0]).await;
}

/// A Recv registered after its value arrived gets it. `x1:0` is sent after `x0:0` on the same
/// link; once `x1:0` is received, `x0:0` is here and its Recv comes late.
async fn late_recv_after_the_value_arrived(backend: Backend) {
    let p = Pair::new(backend).await;
    p.sender.send(&x(0), 1, tensor(SIZES[0], 1)).unwrap();
    p.sender.send(&x(1), 1, tensor(SIZES[1], 1)).unwrap();
    expect_value(&*p.receiver, &x(1), 1, SIZES[1]).await;
    assert!(p.receiver.pending_recvs(1).is_empty());
    expect_value(&*p.receiver, &x(0), 1, SIZES[0]).await;
}

/// A killed sender fails the receiver's pending Recv with `PeerGone` naming it, is reported
/// once, fails later Recvs of its keys at once, and sends to it fail with `PeerGone`.
async fn peer_death(backend: Backend) {
    let mut p = Pair::new(backend).await;
    let mut events = p.receiver_events.take().unwrap();
    p.sender.send(&x(0), 1, tensor(SIZES[0], 1)).unwrap();
    expect_value(&*p.receiver, &x(0), 1, SIZES[0]).await;
    let pending = recv(&*p.receiver, &x(0), 2);
    p.kill_sender();
    assert_sender_gone(&wait_within(pending, WAIT).await.unwrap_err());
    next_gone(&mut events, "sender").await;
    // Later Recvs on its keys fail at once.
    let t0 = Instant::now();
    assert_sender_gone(
        &wait_within(recv(&*p.receiver, &x(2), 3), WAIT)
            .await
            .unwrap_err(),
    );
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // Sends to it fail, naming it.
    let e = p.receiver.send(&y(), 3, tensor(BACK, 3)).unwrap_err();
    assert_sender_gone(&e);
    // One death, one report.
    no_gone(&mut events, "sender", Duration::from_millis(500)).await;
}

/// Values sent right before the sender closes are delivered, and a Recv registered after the
/// receiver learnt that the sender left still gets them; the next step's Recv fails at once,
/// naming the sender.
async fn late_recv_after_the_sender_left(backend: Backend) {
    let p = Pair::new(backend).await;
    let mut p = p;
    let mut events = p.receiver_events.take().unwrap();
    // Step 1 is received before step 2 is sent: over shared memory, step 1 announces each slot
    // on the side channel and step 2 goes through the ring.
    for step in 1..=2u64 {
        for (i, &n) in SIZES.iter().enumerate() {
            p.sender.send(&x(i), step, tensor(n, step)).unwrap();
        }
        if step == 1 {
            for (i, &n) in SIZES.iter().enumerate() {
                expect_value(&*p.receiver, &x(i), step, n).await;
            }
            p.receiver.finish_step(step);
        }
    }
    p.close_sender(Duration::from_secs(5)).await;
    next_gone(&mut events, "sender").await;
    for (i, &n) in SIZES.iter().enumerate() {
        expect_value(&*p.receiver, &x(i), 2, n).await;
    }
    assert_sender_gone(
        &wait_within(recv(&*p.receiver, &x(0), 3), WAIT)
            .await
            .unwrap_err(),
    );
}

/// A close flushes what was queued (a value and a message) within its bound; the receiver
/// hears the sender go once; the side that closes reports no failure of its peer; the
/// receiver's own close returns within its bound.
async fn close(backend: Backend) {
    let mut p = Pair::new(backend).await;
    let mut events = p.receiver_events.take().unwrap();
    let mut sender_events = p.sender_events.take().unwrap();
    let pending = recv(&*p.receiver, &x(2), 1);
    p.sender.send(&x(2), 1, tensor(SIZES[2], 1)).unwrap();
    p.planes()
        .0
        .send_message("receiver", b"bye".to_vec())
        .unwrap();
    p.close_sender(Duration::from_secs(5)).await;
    let got = wait_within(pending, WAIT).await.unwrap();
    assert_eq!(got.as_bytes(), tensor(SIZES[2], 1).as_bytes());
    let (_, before) = next_gone(&mut events, "sender").await;
    let message = match before.as_slice() {
        [PeerEvent::Message { peer, body }] => (peer.to_string(), body.clone()),
        other => panic!("expected the message before the close, got {other:?}"),
    };
    assert_eq!(message, ("sender".to_string(), b"bye".to_vec()));
    no_gone(&mut events, "sender", Duration::from_millis(300)).await;
    no_gone(&mut sender_events, "receiver", Duration::from_millis(300)).await;
    let t0 = Instant::now();
    let receiver = p.planes().1.clone();
    receiver.close(Duration::from_secs(2)).await;
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}
