//! Small inputs that claim huge sizes are refused (or handled) within bounded memory: a
//! broadcast-encoded TensorFlow constant, a gzip bomb given as `--data`, and unauthenticated
//! peers that claim 256 MiB messages. Each test measures the peak of live heap bytes with
//! [`PeakAlloc`] (the tests take a lock so their measurements do not overlap).

use dflow_executor::data::{read_csv, DataError, ReadOptions, MAX_LINE_BYTES};
use dflow_tests::peak_alloc::PeakAlloc;
use dflow_transport::tcp::TcpPlane;
use dflow_transport::wire::{encode_header, FrameKind, Header};
use dflow_transport::TcpConfig;
use flate2::write::GzEncoder;
use flate2::Compression;
use std::io::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc::new();

/// One measurement at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const MIB: usize = 1 << 20;

/// Runs `f` and returns its result and the most heap bytes it added at once.
fn measured<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let _guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let base = ALLOC.live();
    ALLOC.reset_peak();
    let out = f();
    (out, ALLOC.peak_since(base))
}

/// The issue's 225-byte GraphDef, six times: constants that claim 268,435,455 floats each.
#[test]
fn broadcast_constants_are_refused_before_allocating() {
    let consts: Vec<String> = (0..6)
        .map(|i| {
            format!(
                r#"{{"name": "c{i}", "op": "Const", "attr": {{"dtype": {{"type": "DT_FLOAT"}},
                "value": {{"tensor": {{"dtype": "DT_FLOAT",
                "tensorShape": {{"dim": [{{"size": "268435455"}}]}}, "floatVal": [1.0]}}}}}}}}"#
            )
        })
        .collect();
    let text = format!(r#"{{"node": [{}]}}"#, consts.join(","));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bomb.graphdef.json");
    std::fs::write(&path, &text).unwrap();
    let (res, peak) = measured(|| dflow::load::load_program(&path));
    let err = res.unwrap_err().to_string();
    assert!(
        err.contains("`c0`")
            && err.contains("268435455 elements")
            && err.contains("MAX_EXPANDED_CONST_BYTES"),
        "{err}"
    );
    assert!(peak < 16 * MIB, "importing took {peak} bytes at its peak");
}

/// Gzip members concatenated: `members` copies of `chunk` compressed once (a bomb without the
/// cost of compressing it).
fn gzip_bomb(path: &std::path::Path, chunk: &[u8], members: usize) {
    let mut gz = GzEncoder::new(Vec::new(), Compression::best());
    gz.write_all(chunk).unwrap();
    let member = gz.finish().unwrap();
    let mut f = std::fs::File::create(path).unwrap();
    for _ in 0..members {
        f.write_all(&member).unwrap();
    }
}

#[test]
fn gzip_bomb_of_one_line_is_refused_at_the_line_limit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bomb.csv.gz");
    // 256 MiB of '0' without a newline (the issue's bomb: one 1.6 GB number).
    gzip_bomb(&path, &vec![b'0'; 4 * MIB], 64);
    assert!(std::fs::metadata(&path).unwrap().len() < MIB as u64);
    let (res, peak) = measured(|| read_csv(&path, &ReadOptions::default()));
    match res {
        Err(e @ DataError::TooLarge { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("bomb.csv.gz") && msg.contains("line 1"),
                "{msg}"
            );
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(
        peak < 3 * MAX_LINE_BYTES,
        "reading took {peak} bytes at its peak"
    );
}

#[test]
fn gzip_bomb_of_many_rows_is_refused_at_the_text_limit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rows.csv.gz");
    // 256 MiB of "0,0\n" rows: each 4-byte row would become 8 bytes of data set.
    gzip_bomb(&path, &b"0,0\n".repeat(MIB), 64);
    let options = ReadOptions::default().max_text_bytes(8 * MIB as u64);
    let (res, peak) = measured(|| read_csv(&path, &options));
    let msg = res.unwrap_err().to_string();
    assert!(
        msg.contains("rows.csv.gz")
            && msg.contains(&format!("limit of {} bytes", 8 * MIB))
            && msg.contains("DFLOW_MAX_DATA_BYTES"),
        "{msg}"
    );
    assert!(peak < 48 * MIB, "reading took {peak} bytes at its peak");
}

fn hello(name: &str) -> Vec<u8> {
    let mut f = encode_header(&Header {
        kind: FrameKind::Hello,
        flags: 0,
        slot_id: 0,
        step: 0,
        payload_len: name.len() as u64,
    })
    .to_vec();
    f.extend_from_slice(name.as_bytes());
    f
}

fn message_header(len: u64) -> [u8; dflow_transport::wire::HEADER_LEN] {
    encode_header(&Header {
        kind: FrameKind::Message,
        flags: 0,
        slot_id: 0,
        step: 0,
        payload_len: len,
    })
}

/// Waits until `f` holds or `within` passes; false on timeout.
async fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < within {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

/// The issue's ten connections announcing names outside the cluster and claiming 256 MiB
/// messages: memory follows the bytes that arrive, not the claims, and is freed on close.
#[test]
fn claimed_message_lengths_do_not_reserve_memory() {
    let (_, peak) = measured(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let ps = TcpPlane::bind("ps:0", "127.0.0.1:0".parse().unwrap(), TcpConfig::default())
                .await
                .unwrap();
            let before = ALLOC.live();
            let mut conns = Vec::new();
            for i in 0..10 {
                let mut s = TcpStream::connect(ps.local_addr()).await.unwrap();
                s.write_all(&hello(&format!("intruder:{i}"))).await.unwrap();
                s.write_all(&message_header(256 << 20)).await.unwrap();
                s.write_all(&[7u8; 64 << 10]).await.unwrap();
                conns.push(s);
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            let held = ALLOC.live().saturating_sub(before);
            assert!(held < 16 * MIB, "ten claimed messages hold {held} bytes");
            drop(conns);
            let freed = eventually(Duration::from_secs(5), || {
                ALLOC.live().saturating_sub(before) < 2 * MIB
            })
            .await;
            assert!(
                freed,
                "memory not released after close: {} bytes still held",
                ALLOC.live().saturating_sub(before)
            );
            ps.shutdown();
        });
    });
    assert!(peak < 32 * MIB, "the ps took {peak} bytes at its peak");
}

/// One peer name may hold only a few connections; the next is closed with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_per_peer_name_are_limited() {
    let config = TcpConfig::default();
    let ps = TcpPlane::bind("ps:0", "127.0.0.1:0".parse().unwrap(), config)
        .await
        .unwrap();
    let mut conns = Vec::new();
    for _ in 0..config.max_connections_per_peer {
        let mut s = TcpStream::connect(ps.local_addr()).await.unwrap();
        s.write_all(&hello("worker:0")).await.unwrap();
        conns.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut extra = TcpStream::connect(ps.local_addr()).await.unwrap();
    extra.write_all(&hello("worker:0")).await.unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(5), extra.read(&mut buf))
        .await
        .expect("the extra connection was neither closed nor answered within 5 s");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "the extra connection stayed open: {read:?}"
    );
    // The admitted ones are still served: closing one frees a place.
    drop(conns.pop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut again = TcpStream::connect(ps.local_addr()).await.unwrap();
    again.write_all(&hello("worker:0")).await.unwrap();
    let open = tokio::time::timeout(Duration::from_millis(500), again.read(&mut buf)).await;
    assert!(
        open.is_err(),
        "a connection within the limit was closed: {open:?}"
    );
    ps.shutdown();
}
