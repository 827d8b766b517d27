//! A dropped peer is logged with an error that names it.

use dflow_transport::tcp::TcpPlane;
use dflow_transport::wire::{encode_header, FrameKind, Header};
use dflow_transport::TcpConfig;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_frame_is_logged_naming_the_peer() {
    let logs = Captured::default();
    let sink = logs.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || sink.clone())
            .finish(),
    )
    .unwrap();

    let ps = TcpPlane::bind("ps:0", "127.0.0.1:0".parse().unwrap(), TcpConfig::default())
        .await
        .unwrap();
    ps.register_recv(
        5,
        "worker:8",
        Arc::new(dflow_transport::RendezvousKey::new("a", "b", "x:0")),
        dflow_graph::DType::F32,
        &[16],
    )
    .unwrap();
    rogue(ps.local_addr(), b"worker:7", Header::data(42, 3, 8)).await;
    rogue(ps.local_addr(), b"worker:8", Header::data(5, 4, 1000)).await;

    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
        if text.contains("unknown slot 42") && text.contains("at most 64") {
            assert!(
                text.contains("ERROR") && text.contains("peer `worker:7 (127.0.0.1:"),
                "{text}"
            );
            assert!(
                text.contains("Data frame for slot 5, step 4 from peer `worker:8 (127.0.0.1:")
                    && text.contains("announces 1000 payload bytes; at most 64 allowed"),
                "{text}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no error logged: {text}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Introduces itself as `name`, sends `frame`'s header and waits until the server drops it.
async fn rogue(addr: std::net::SocketAddr, name: &[u8], frame: Header) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let hello = Header {
        kind: FrameKind::Hello,
        flags: 0,
        slot_id: 0,
        step: 0,
        payload_len: name.len() as u64,
    };
    s.write_all(&encode_header(&hello)).await.unwrap();
    s.write_all(name).await.unwrap();
    s.write_all(&encode_header(&frame)).await.unwrap();
    let mut buf = [0u8; 8];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("the server drops the connection");
    assert!(matches!(n, Ok(0) | Err(_)));
}
