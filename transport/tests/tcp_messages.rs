//! Control-plane messages, heartbeats and peer-failure events on the TCP data plane
//! (127.0.0.1, ephemeral ports, bounded in time).

use dflow_transport::tcp::{PeerEvent, TcpPlane};
use dflow_transport::wire::{encode_header, FrameKind, Header};
use dflow_transport::TcpConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::mpsc::UnboundedReceiver;

const WAIT: Duration = Duration::from_secs(5);

fn any_addr() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn next(rx: &mut UnboundedReceiver<PeerEvent>) -> PeerEvent {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("an event arrives in time")
        .expect("the rendezvous is alive")
}

async fn endpoints(sender: TcpConfig, receiver: TcpConfig) -> (Arc<TcpPlane>, Arc<TcpPlane>) {
    let a = TcpPlane::bind("a", any_addr(), sender).await.unwrap();
    let b = TcpPlane::bind("b", any_addr(), receiver).await.unwrap();
    a.connect("b", b.local_addr()).await.unwrap();
    (a, b)
}

#[tokio::test]
async fn messages_arrive_in_order_naming_their_sender() {
    let (a, b) = endpoints(TcpConfig::default(), TcpConfig::default()).await;
    let mut events = b.subscribe();
    for i in 0..3u8 {
        a.send_message("b", vec![i; 1000 * (i as usize + 1)])
            .unwrap();
    }
    for i in 0..3u8 {
        match next(&mut events).await {
            PeerEvent::Message { peer, body } => {
                assert_eq!(&*peer, "a");
                assert_eq!(body, vec![i; 1000 * (i as usize + 1)]);
            }
            e => panic!("expected a message, got {e:?}"),
        }
    }
    // Unknown peers are an error, not a panic or a silent drop.
    let err = a.send_message("nobody", vec![1]).unwrap_err();
    assert!(err.to_string().contains("nobody"), "{err}");
}

#[tokio::test]
async fn a_message_over_the_limit_drops_the_connection_before_allocating() {
    let small = TcpConfig {
        max_message: 1024,
        ..TcpConfig::default()
    };
    let b = TcpPlane::bind("b", any_addr(), small).await.unwrap();
    let mut events = b.subscribe();
    let mut raw = TcpStream::connect(b.local_addr()).await.unwrap();
    let hello = Header {
        kind: FrameKind::Hello,
        flags: 0,
        slot_id: 0,
        step: 0,
        payload_len: 5,
    };
    raw.write_all(&encode_header(&hello)).await.unwrap();
    raw.write_all(b"rogue").await.unwrap();
    let huge = Header {
        kind: FrameKind::Message,
        flags: 0,
        slot_id: 0,
        step: 0,
        payload_len: 1 << 40,
    };
    raw.write_all(&encode_header(&huge)).await.unwrap();
    match next(&mut events).await {
        PeerEvent::Gone { peer, cause } => {
            assert_eq!(&*peer, "rogue");
            assert!(cause.contains("at most 1024"), "{cause}");
        }
        e => panic!("expected the rogue to be dropped, got {e:?}"),
    }
}

#[tokio::test]
async fn heartbeats_keep_an_idle_peer_alive_and_silence_reports_it_gone() {
    let receiver = TcpConfig {
        idle_timeout: Duration::from_millis(400),
        ..TcpConfig::default()
    };
    let beating = TcpConfig {
        heartbeat_interval: Some(Duration::from_millis(50)),
        ..TcpConfig::default()
    };
    let (a, b) = endpoints(beating, receiver).await;
    let mut events = b.subscribe();
    // Well past the idle timeout: heartbeats keep the connection up.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    a.send_message("b", b"still here".to_vec()).unwrap();
    match next(&mut events).await {
        PeerEvent::Message { body, .. } => assert_eq!(body, b"still here"),
        e => panic!("expected the message, got {e:?}"),
    }

    // Without heartbeats the same silence is reported as the peer being gone.
    let (_silent, c) = endpoints(TcpConfig::default(), receiver).await;
    let mut events = c.subscribe();
    match next(&mut events).await {
        PeerEvent::Gone { peer, cause } => {
            assert_eq!(&*peer, "a");
            assert!(cause.contains("idle"), "{cause}");
        }
        e => panic!("expected a Gone event, got {e:?}"),
    }
}
