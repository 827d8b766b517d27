//! Two `RdmaPlane`s in one process, over the in-memory fabric (data) and loopback TCP (control):
//! credits when a sender runs ahead, the runtime's messages, and a broken link. What every
//! backend does (values, aborts, peer death, late Recvs, close) is in conformance.rs.

use dflow_graph::{DType, Tensor};
use dflow_transport::rdma::plane::RdmaPlane;
use dflow_transport::rdma::sim::SimFabric;
use dflow_transport::TcpConfig;
use dflow_transport::{DataPlane, PeerEvent, Rendezvous, RendezvousError, RendezvousKey};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

async fn planes(fabric: &SimFabric) -> (Arc<RdmaPlane>, Arc<RdmaPlane>) {
    fabric.add_device("a");
    fabric.add_device("b");
    let addr = "127.0.0.1:0".parse().unwrap();
    let cfg = TcpConfig::default();
    let a = RdmaPlane::bind("a", addr, cfg, None, Arc::new(fabric.open("a").unwrap()))
        .await
        .unwrap();
    let b = RdmaPlane::bind("b", addr, cfg, None, Arc::new(fabric.open("b").unwrap()))
        .await
        .unwrap();
    a.clone().connect("b".into(), b.local_addr()).await.unwrap();
    b.clone().connect("a".into(), a.local_addr()).await.unwrap();
    (a, b)
}

async fn recv(
    plane: &Arc<RdmaPlane>,
    key: &Arc<RendezvousKey>,
    step: u64,
) -> Result<Tensor, RendezvousError> {
    let (tx, rx) = oneshot::channel();
    plane.recv_async(
        key,
        step,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    tokio::time::timeout(Duration::from_secs(10), rx)
        .await
        .expect("recv timed out")
        .expect("callback dropped")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_ahead_of_its_reader_waits_for_credits() {
    let fabric = SimFabric::new();
    let (a, b) = planes(&fabric).await;
    let x = Arc::new(RendezvousKey::new("/job:a/cpu:0", "/job:b/cpu:0", "x:0"));
    b.register_recv(4, "a", x.clone(), DType::F32, &[2])
        .unwrap();
    a.register_send(x.clone(), "b", 4);
    // Five steps sent before any Recv: one lands, the rest wait for credits, in order.
    for step in 10..15u64 {
        a.send(
            &x,
            step,
            Tensor::from_slice(&[2], &[step as f32; 2]).unwrap(),
        )
        .unwrap();
    }
    for step in 10..15u64 {
        let t = recv(&b, &x, step).await.unwrap();
        assert_eq!(t.as_slice::<f32>().unwrap(), &[step as f32; 2]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_messages_pass_and_a_broken_link_is_reported() {
    let fabric = SimFabric::new();
    let (a, b) = planes(&fabric).await;
    let mut events = b.subscribe();
    a.send_message("b", b"hello".to_vec()).unwrap();
    match tokio::time::timeout(Duration::from_secs(10), events.recv()).await {
        Ok(Some(PeerEvent::Message { peer, body })) => {
            assert_eq!(&*peer, "a");
            assert_eq!(body, b"hello");
        }
        other => panic!("{other:?}"),
    }

    let x = Arc::new(RendezvousKey::new("/job:a/cpu:0", "/job:b/cpu:0", "x:0"));
    b.register_recv(2, "a", x.clone(), DType::F32, &[1])
        .unwrap();
    a.register_send(x.clone(), "b", 2);
    a.send(&x, 1, Tensor::from_slice(&[1], &[1.0f32]).unwrap())
        .unwrap();
    let held = recv(&b, &x, 1).await.unwrap();
    fabric.break_link("a", "b");
    // b's Recv of step 2 fails naming a, and b's subscriber hears that a is gone.
    let err = recv(&b, &x, 2).await.unwrap_err();
    assert!(
        matches!(&err, RendezvousError::PeerGone { peer, .. } if peer == "a"),
        "{err}"
    );
    match tokio::time::timeout(Duration::from_secs(10), events.recv()).await {
        Ok(Some(PeerEvent::Gone { peer, cause })) => {
            assert_eq!(&*peer, "a");
            assert!(cause.contains("link down"), "{cause}");
        }
        other => panic!("{other:?}"),
    }
    drop(held);
}
