//! The shared-memory backend's failures and set-up: a killed rank process fails the others
//! within the timeout naming it and leaves nothing under /dev/shm; a stalled rank is reported
//! like over TCP; foreign or mismatched segments are refused naming the rank. (Dropped ranks and
//! mismatched or skipped collectives over shared memory: `collective_failures.rs`.)
//! (The collectives themselves run over shared memory in `collective_primitives.rs`.)

use dflow_transport::collective::{
    CollectiveError, CommOptions, Communicator, ReduceOp, ShmOptions, ShmRendezvous,
};
use dflow_transport::shm::segment::{segments_of, shm_dir};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod support;
use support::{comms, on_ranks, opts, Backend};

fn group(n: usize, o: CommOptions) -> Vec<Communicator> {
    comms(Backend::Shm, n, o)
}

#[test]
fn names_are_unlinked_once_connected() {
    let o = ShmOptions::default();
    let rvs: Vec<_> = (0..3)
        .map(|r| ShmRendezvous::create(r, 3, &o).unwrap())
        .collect();
    let names: Vec<String> = rvs.iter().map(|r| r.name().to_string()).collect();
    assert!(names.iter().all(|n| shm_dir().join(n).exists()));
    let pairs: Vec<_> = std::thread::scope(|s| {
        let joins: Vec<_> = rvs
            .into_iter()
            .map(|rv| {
                let names = &names;
                let o = &o;
                s.spawn(move || rv.connect(names, o).unwrap())
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    assert!(
        names.iter().all(|n| !shm_dir().join(n).exists()),
        "every name is unlinked after set-up"
    );
    drop(pairs);
    // An abandoned rendezvous removes its name too.
    let rv = ShmRendezvous::create(0, 2, &o).unwrap();
    let path = shm_dir().join(rv.name());
    assert!(path.exists());
    drop(rv);
    assert!(!path.exists());
}

#[test]
fn foreign_or_mismatched_segments_are_refused() {
    let o = ShmOptions {
        connect_timeout: Duration::from_millis(300),
        ..ShmOptions::default()
    };
    // A name that is not a collective segment of this plane.
    let rv = ShmRendezvous::create(0, 2, &o).unwrap();
    let me = rv.name().to_string();
    let e = rv
        .connect(&[me.clone(), "../../etc/passwd".into()], &o)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 1") && e.contains("refusing"),
        "names the rank and the refusal: {e}"
    );
    // A segment of another group size.
    let other = ShmRendezvous::create(1, 3, &o).unwrap();
    let rv = ShmRendezvous::create(0, 2, &o).unwrap();
    let names = [rv.name().to_string(), other.name().to_string()];
    let e = rv.connect(&names, &o).unwrap_err().to_string();
    assert!(e.contains("rank 1"), "{e}");
    // A peer that never attaches: set-up times out naming it.
    let a = ShmRendezvous::create(0, 2, &o).unwrap();
    let b = ShmRendezvous::create(1, 2, &o).unwrap();
    let names = [a.name().to_string(), b.name().to_string()];
    let t = Instant::now();
    let e = a.connect(&names, &o).unwrap_err().to_string();
    assert!(e.contains("ranks [1]") && e.contains("attach"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
    drop(b);
}

#[test]
fn stalled_rank_times_out_naming_it() {
    let results = on_ranks(group(3, opts(800)), |c| {
        if c.rank() == 1 {
            // Joins after the others gave up.
            std::thread::sleep(Duration::from_millis(1_200));
            return Ok(());
        }
        let mut x = vec![1.0f32; 1 << 20];
        c.all_reduce(&mut x, ReduceOp::Sum)
    });
    for (rank, (r, took)) in results.iter().enumerate() {
        if rank == 1 {
            continue;
        }
        match r {
            Err(CollectiveError::Timeout { missing, .. }) => {
                assert!(missing.contains(&1), "rank {rank}: {missing:?}")
            }
            Err(CollectiveError::Aborted { reason, .. }) => {
                assert!(reason.contains("timed out"), "rank {rank}: {reason}")
            }
            other => panic!("rank {rank}: expected a timeout, got {other:?}"),
        }
        assert!(
            *took < Duration::from_millis(1_150),
            "rank {rank} took {took:?}"
        );
    }
}

/// Entry point of the child processes of `killed_process_fails_the_others` (a no-op when the
/// test binary runs normally): creates its segment, prints its name, reads everyone's.
#[test]
fn child_shm_rank_main() {
    let Ok(rank) = std::env::var("COLL_SHM_CHILD_RANK") else {
        return;
    };
    let rank: usize = rank.parse().unwrap();
    let o = ShmOptions::default();
    let rv = ShmRendezvous::create(rank, 3, &o).unwrap();
    println!("NAME {}", rv.name());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let names: Vec<String> = line.split_whitespace().map(str::to_string).collect();
    let c = Communicator::new(Box::new(rv.connect(&names, &o).unwrap()), opts(30_000));
    let mut x = vec![1.0f32; 1 << 18];
    c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    println!("first all_reduce done");
    if rank == 2 {
        std::thread::sleep(Duration::from_secs(60));
    }
    let e = c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
    println!("second all_reduce failed: {e}");
}

/// Kills and reaps the children however the test ends.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn killed_process_fails_the_others_and_leaves_nothing() {
    let exe = std::env::current_exe().unwrap();
    let mut children = Children(
        (1..3)
            .map(|r| {
                Command::new(&exe)
                    .args([
                        "--exact",
                        "child_shm_rank_main",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env("COLL_SHM_CHILD_RANK", r.to_string())
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect(),
    );
    let o = ShmOptions::default();
    let rv = ShmRendezvous::create(0, 3, &o).unwrap();
    let mut names = vec![rv.name().to_string()];
    let mut outs = Vec::new();
    for c in &mut children.0 {
        let mut out = BufReader::new(c.stdout.take().unwrap());
        // The test harness prints its own text first, maybe on the same line.
        let name = loop {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "child ended early");
            if let Some(i) = line.find("NAME ") {
                break line[i + "NAME ".len()..].trim().to_string();
            }
        };
        names.push(name);
        outs.push(out);
    }
    let list = names.join(" ") + "\n";
    for c in &mut children.0 {
        c.stdin.take().unwrap().write_all(list.as_bytes()).unwrap();
    }
    let c = Communicator::new(Box::new(rv.connect(&names, &o).unwrap()), opts(30_000));
    let mut x = vec![1.0f32; 1 << 18];
    c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x[0], 3.0);
    let pids: Vec<u32> = children.0.iter().map(|c| c.id()).collect();
    std::thread::sleep(Duration::from_millis(200));
    children.0[1].kill().unwrap();
    let t = Instant::now();
    let e = c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err().to_string();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    assert!(e.contains("rank 2 is gone"), "{e}");
    let mut said = String::new();
    use std::io::Read;
    outs[0].read_to_string(&mut said).unwrap();
    assert!(
        said.contains("second all_reduce failed") && said.contains("rank 2 is gone"),
        "rank 1 said: {said}"
    );
    drop(c);
    drop(children);
    for pid in pids {
        assert_eq!(segments_of(pid), Vec::<String>::new(), "residue of {pid}");
    }
    assert!(names.iter().all(|n| !shm_dir().join(n).exists()));
}

#[test]
fn reserved_names_connect_whoever_creates_first() {
    // Names published before the ranks know their rank and group size (as the runtime's
    // collective groups do); rank 1 creates its segment late and rank 0 waits for it.
    let o = ShmOptions {
        connect_timeout: Duration::from_secs(10),
        ..ShmOptions::default()
    };
    let names: Vec<String> = (0..2)
        .map(|_| ShmRendezvous::reserve_name("workers"))
        .collect();
    let comms: Vec<Communicator> = std::thread::scope(|s| {
        let joins: Vec<_> = (0..2)
            .map(|r| {
                let (names, o) = (&names, &o);
                s.spawn(move || {
                    if r == 1 {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    let rv = ShmRendezvous::create_named(&names[r], r, 2, o).unwrap();
                    Communicator::new(Box::new(rv.connect(names, o).unwrap()), opts(10_000))
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let results = on_ranks(comms, |c| {
        let mut x = vec![c.rank() as f32 + 1.0; 1000];
        c.all_reduce(&mut x, ReduceOp::Sum).map(|()| x[999])
    });
    for (r, _) in results {
        assert_eq!(r.unwrap(), 3.0);
    }
    assert!(names.iter().all(|n| !shm_dir().join(n).exists()));
    // A name nobody creates: set-up gives up at its timeout, naming the rank.
    let o = ShmOptions {
        connect_timeout: Duration::from_millis(200),
        ..ShmOptions::default()
    };
    let names = [
        ShmRendezvous::reserve_name("g"),
        ShmRendezvous::reserve_name("g"),
    ];
    let rv = ShmRendezvous::create_named(&names[0], 0, 2, &o).unwrap();
    let e = rv.connect(&names, &o).unwrap_err().to_string();
    assert!(e.contains("rank 1"), "{e}");
}
