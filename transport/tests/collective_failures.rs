//! Failures: mismatched collectives fail fast on every rank with both fingerprints; a skipped
//! collective stalls, is reported, and times out naming the missing rank; a dropped or killed
//! rank makes the others fail within the timeout naming it; hostile bytes are rejected. Each
//! scenario runs in process, over TCP and over shared memory.

use dflow_transport::collective::{
    loopback_group, Channel, CollectiveError, Communicator, InProcPairs, Pairs, ReduceOp,
    TcpGroupListener, TcpOptions, HEADER_LEN,
};
use std::io::IoSlice;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod support;
use support::{comms, on_ranks, opts, Backend};

fn mismatched_shapes(backend: Backend) {
    // Long timeout: failing fast means well under it.
    let results = on_ranks(comms(backend, 3, opts(20_000)), |c| {
        let mut x = vec![1.0f32; if c.rank() == 2 { 5 } else { 4 }];
        c.all_reduce(&mut x, ReduceOp::Sum)
    });
    for (rank, (r, took)) in results.iter().enumerate() {
        let e = r
            .as_ref()
            .expect_err("a mismatched all_reduce must fail")
            .to_string();
        assert!(
            *took < Duration::from_secs(5),
            "rank {rank} took {took:?}: {e}"
        );
        assert!(
            e.contains("all_reduce #0 [f32 x 4, sum") && e.contains("all_reduce #0 [f32 x 5, sum"),
            "rank {rank} must name both fingerprints: {e}"
        );
    }
}

#[test]
fn mismatched_shapes_fail_on_every_rank_in_process() {
    mismatched_shapes(Backend::InProcess);
}

#[test]
fn mismatched_shapes_fail_on_every_rank_over_tcp() {
    mismatched_shapes(Backend::Tcp);
}

#[cfg(target_os = "linux")]
#[test]
fn mismatched_shapes_fail_on_every_rank_over_shm() {
    mismatched_shapes(Backend::Shm);
}

fn skipped_collective(backend: Backend) {
    let results = on_ranks(comms(backend, 4, opts(20_000)), |c| {
        if c.rank() != 1 {
            let mut x = vec![1i64; 100];
            c.all_reduce(&mut x, ReduceOp::Max)?;
        }
        let mut y = vec![2i64; 3];
        c.broadcast(&mut y, 0)
    });
    for (rank, (r, took)) in results.iter().enumerate() {
        let e = r
            .as_ref()
            .expect_err("a skipped collective must fail")
            .to_string();
        assert!(
            *took < Duration::from_secs(5),
            "rank {rank} took {took:?}: {e}"
        );
        assert!(
            e.contains("all_reduce #0 [i64 x 100, max") && e.contains("broadcast #0 [i64 x 3"),
            "rank {rank} must name both fingerprints: {e}"
        );
    }
}

#[test]
fn skipped_collective_fails_on_every_rank_in_process() {
    skipped_collective(Backend::InProcess);
}

#[test]
fn skipped_collective_fails_on_every_rank_over_tcp() {
    skipped_collective(Backend::Tcp);
}

#[cfg(target_os = "linux")]
#[test]
fn skipped_collective_fails_on_every_rank_over_shm() {
    skipped_collective(Backend::Shm);
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn absent_rank_is_reported_as_stalled_then_times_out() {
    let logs = Captured::default();
    let results = on_ranks(comms(Backend::InProcess, 3, opts(1_200)), |c| {
        let logs = logs.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || logs.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(sub, || {
            if c.rank() == 2 {
                // Joins late: after the others gave up.
                std::thread::sleep(Duration::from_millis(1_600));
                return Ok(());
            }
            let mut x = vec![1.0f64; 10];
            c.all_reduce(&mut x, ReduceOp::Sum)
        })
    });
    for (rank, (r, took)) in results.iter().enumerate().take(2) {
        match r {
            Err(CollectiveError::Timeout { call, missing, .. }) => {
                assert_eq!(call, "all_reduce #0");
                assert_eq!(missing, &vec![2], "rank {rank}");
            }
            // The first rank to time out aborts the call for the other.
            Err(CollectiveError::Aborted { reason, .. }) => {
                assert!(
                    reason.contains("timed out") && reason.contains("[2]"),
                    "{reason}"
                )
            }
            other => panic!("rank {rank}: expected a timeout, got {other:?}"),
        }
        assert!(
            *took < Duration::from_millis(1_500),
            "rank {rank} took {took:?}"
        );
    }
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(text.contains("collective stalled"), "{text}");
    assert!(text.contains("missing=[2]"), "{text}");
}

fn dropped_rank(backend: Backend) {
    let results = on_ranks(comms(backend, 3, opts(10_000)), |c| {
        let mut x = vec![1i32; 1000];
        c.all_reduce(&mut x, ReduceOp::Sum)?;
        if c.rank() == 2 {
            drop(c);
            return Ok(());
        }
        c.all_reduce(&mut x, ReduceOp::Sum)
    });
    for (rank, (r, took)) in results.iter().enumerate().take(2) {
        let e = r
            .as_ref()
            .expect_err("a lost rank must fail the call")
            .to_string();
        assert!(e.contains("rank 2 is gone"), "rank {rank}: {e}");
        assert!(*took < Duration::from_secs(5), "rank {rank} took {took:?}");
    }
}

#[test]
fn dropped_rank_fails_the_others_in_process() {
    dropped_rank(Backend::InProcess);
}

#[test]
fn dropped_rank_fails_the_others_over_tcp() {
    dropped_rank(Backend::Tcp);
}

#[cfg(target_os = "linux")]
#[test]
fn dropped_rank_fails_the_others_over_shm() {
    dropped_rank(Backend::Shm);
}

/// Entry point of the child processes of `killed_process_fails_the_others` (a no-op when the
/// test binary runs normally).
#[test]
fn child_rank_main() {
    let (Ok(rank), Ok(addrs)) = (
        std::env::var("COLL_CHILD_RANK"),
        std::env::var("COLL_ADDRS"),
    ) else {
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let addrs: Vec<SocketAddr> = addrs.split(',').map(|a| a.parse().unwrap()).collect();
    let l = TcpGroupListener::bind(addrs[rank]).unwrap();
    let p = l.connect(rank, &addrs, &TcpOptions::default()).unwrap();
    let c = Communicator::new(Box::new(p), opts(30_000));
    let mut x = vec![1.0f32; 4096];
    c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    println!("first all_reduce done");
    if rank == 2 {
        std::thread::sleep(Duration::from_secs(60));
    }
    let e = c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
    println!("second all_reduce failed: {e}");
}

#[test]
fn killed_process_fails_the_others() {
    let addrs: Vec<SocketAddr> = (0..3)
        .map(|_| {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
        })
        .collect();
    let list = addrs
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (1..3)
        .map(|r| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "child_rank_main",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("COLL_CHILD_RANK", r.to_string())
                .env("COLL_ADDRS", &list)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut guard = scopeguard(&mut children);
    let l = TcpGroupListener::bind(addrs[0]).unwrap();
    let p = l.connect(0, &addrs, &TcpOptions::default()).unwrap();
    let c = Communicator::new(Box::new(p), opts(30_000));
    let mut x = vec![1.0f32; 4096];
    c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x[0], 3.0);
    std::thread::sleep(Duration::from_millis(200));
    guard[1].kill().unwrap();
    let t = Instant::now();
    let e = c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err().to_string();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    assert!(e.contains("rank 2 is gone"), "{e}");
    let out = guard.wait_with_output_ref();
    assert!(
        out.contains("second all_reduce failed") && out.contains("rank 2 is gone"),
        "rank 1 said: {out}"
    );
}

/// Kills and reaps the children however the test ends.
struct Children<'a>(&'a mut Vec<std::process::Child>);

impl Children<'_> {
    fn wait_with_output_ref(&mut self) -> String {
        use std::io::Read;
        let mut s = String::new();
        if let Some(out) = self.0[0].stdout.as_mut() {
            let _ = out.read_to_string(&mut s);
        }
        let _ = self.0[0].wait();
        s
    }
}

impl std::ops::Index<usize> for Children<'_> {
    type Output = std::process::Child;
    fn index(&self, i: usize) -> &Self::Output {
        &self.0[i]
    }
}

impl std::ops::IndexMut<usize> for Children<'_> {
    fn index_mut(&mut self, i: usize) -> &mut Self::Output {
        &mut self.0[i]
    }
}

impl Drop for Children<'_> {
    fn drop(&mut self) {
        for c in self.0.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn scopeguard(c: &mut Vec<std::process::Child>) -> Children<'_> {
    Children(c)
}

/// Two raw endpoints: rank 0 behind a channel, rank 1 writing bytes by hand.
fn raw_pair() -> (Channel, InProcPairs) {
    let mut g = InProcPairs::group(2);
    let raw = g.pop().unwrap();
    let ch = Channel::new(Box::new(g.pop().unwrap()), Duration::from_secs(2));
    (ch, raw)
}

fn header(tag: u64, len: u64) -> [u8; HEADER_LEN] {
    // A valid point-to-point header from rank 1, built by sending through a second channel.
    let (mut ch, mut raw) = {
        let mut g = InProcPairs::group(2);
        let b = g.pop().unwrap();
        (
            Channel::new(Box::new(g.pop().unwrap()), Duration::from_secs(2)),
            b,
        )
    };
    let _ = len;
    ch.send(1, tag, &[7u8; 4]).unwrap();
    let mut h = [0u8; HEADER_LEN];
    assert_eq!(raw.try_read(0, &mut h).unwrap(), HEADER_LEN);
    h[40..48].copy_from_slice(&len.to_le_bytes());
    h
}

#[test]
fn point_to_point_round_trip() {
    let mut g = InProcPairs::group(2);
    let mut b = Channel::new(Box::new(g.pop().unwrap()), Duration::from_secs(2));
    let mut a = Channel::new(Box::new(g.pop().unwrap()), Duration::from_secs(2));
    std::thread::scope(|s| {
        s.spawn(move || a.send(1, 5, b"hello").unwrap());
        let mut buf = [0u8; 5];
        b.recv_into(0, 5, &mut buf).unwrap();
        assert_eq!(&buf, b"hello");
    });
}

#[test]
fn garbage_bytes_are_rejected_naming_the_peer() {
    let (mut ch, mut raw) = raw_pair();
    raw.try_write(0, &[IoSlice::new(&[0xAB; HEADER_LEN])])
        .unwrap();
    let e = ch.recv_into(1, 0, &mut [0u8; 4]).unwrap_err().to_string();
    assert!(
        e.contains("bad frame from rank 1") && e.contains("magic"),
        "{e}"
    );
}

#[test]
fn oversized_length_is_rejected_before_reading() {
    let (mut ch, mut raw) = raw_pair();
    let h = header(3, 1 << 40);
    raw.try_write(0, &[IoSlice::new(&h)]).unwrap();
    let e = ch.recv_into(1, 3, &mut [0u8; 4]).unwrap_err().to_string();
    assert!(e.contains("rank 1"), "{e}");
    assert!(e.contains("1099511627776"), "{e}");
}

#[test]
fn truncated_frame_fails_naming_the_peer() {
    let (mut ch, mut raw) = raw_pair();
    let h = header(3, 4);
    raw.try_write(0, &[IoSlice::new(&h), IoSlice::new(&[1, 2])])
        .unwrap();
    drop(raw);
    let e = ch.recv_into(1, 3, &mut [0u8; 4]).unwrap_err().to_string();
    assert!(e.contains("rank 1 is gone"), "{e}");
}

#[test]
fn tcp_with_a_secret_connects_and_a_wrong_secret_is_refused() {
    use dflow_transport::auth::Secret;
    let good = TcpOptions {
        secret: Some(Secret::new(b"0123456789abcdef-good", "test").unwrap()),
        ..TcpOptions::default()
    };
    let pairs = loopback_group(3, &good).unwrap();
    let results = on_ranks(
        pairs
            .into_iter()
            .map(|p| Communicator::new(Box::new(p), opts(10_000)))
            .collect(),
        |c| {
            let mut x = vec![c.rank() as i32; 3];
            c.all_reduce(&mut x, ReduceOp::Sum).map(|()| x)
        },
    );
    for (r, _) in results {
        assert_eq!(r.unwrap(), vec![3, 3, 3]);
    }

    let l0 = TcpGroupListener::bind("127.0.0.1:0").unwrap();
    let l1 = TcpGroupListener::bind("127.0.0.1:0").unwrap();
    let addrs = [l0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let bad = TcpOptions {
        secret: Some(Secret::new(b"0123456789abcdef-evil", "test").unwrap()),
        connect_timeout: Duration::from_secs(2),
        ..TcpOptions::default()
    };
    let good = TcpOptions {
        connect_timeout: Duration::from_secs(2),
        ..good
    };
    let (r0, r1) = std::thread::scope(|s| {
        let a = s.spawn(|| l0.connect(0, &addrs, &good).map(|_| ()));
        let b = s.spawn(|| l1.connect(1, &addrs, &bad).map(|_| ()));
        (a.join().unwrap(), b.join().unwrap())
    });
    let e1 = r1.unwrap_err().to_string();
    assert!(e1.contains("its cluster secret differs"), "{e1}");
    assert!(r0.is_err(), "the acceptor must not accept the impostor");
    let _: &dyn Pairs = &InProcPairs::group(1).pop().unwrap();
}
