//! Registration: how the tasks of a job learn the cluster when their launcher names only rank
//! 0's address (torchrun and PyTorchJob's `MASTER_ADDR:MASTER_PORT`, Slurm, MPI).
//!
//! Rank 0 listens at the master address ([`gather`]); every other rank binds its data plane
//! first (port 0), then connects to rank 0 ([`connect`]) and reports its task and listen
//! address ([`register`]). When all `world_size - 1` others have registered, rank 0 builds the
//! [`ClusterSpec`] and sends it to every rank; then the tasks connect to each other as usual.
//!
//! ```text
//! rank r -> 0: "dflowreg" version auth?          0 -> r: "dflowreg" version auth?
//! (with a cluster secret: the HMAC handshake of dflow_transport::auth, rank r connecting)
//! rank r -> 0: Registration {rank, world_size, job, index, address}   (JSON, length-prefixed)
//! 0 -> rank r: Answer::Cluster(cluster) | Answer::Refused(why)        (once every rank is in)
//! ```
//!
//! Every wait is bounded by the startup timeout and names whom it waits for; every message is
//! length-checked before memory is taken; a rank that registers twice (restarted by its
//! launcher) replaces its earlier registration; one that does not fit (another world size,
//! another role) is refused with the reason and rank 0 keeps waiting.

use super::node::JobError;
use dflow_graph::ClusterSpec;
use dflow_transport::auth::{Acceptor, Connector, Secret};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// Version of the registration exchange.
pub const REGISTRATION_VERSION: u8 = 1;
const MAGIC: &[u8; 8] = b"dflowreg";
/// Longest registration or handshake message accepted by rank 0.
pub const MAX_REQUEST_BYTES: usize = 4096;
/// Longest answer (the cluster spec) a rank accepts.
pub const MAX_ANSWER_BYTES: usize = 16 << 20;
/// How long rank 0 gives one connection to introduce itself.
const INTRODUCTION_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections being introduced at once, at most (unauthenticated peers cannot pile up).
const MAX_INTRODUCING: usize = 256;

/// What a rank tells rank 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// The rank.
    pub rank: u32,
    /// The world size this rank was started with (must agree with rank 0's).
    pub world_size: u32,
    /// Its job (`worker`, `ps`).
    pub job: String,
    /// Its index in the job.
    pub index: u32,
    /// Where its data plane listens, `host:port`.
    pub address: String,
}

#[derive(Debug, Serialize, Deserialize)]
enum Answer {
    Cluster(ClusterSpec),
    Refused(String),
}

fn setup(msg: String) -> JobError {
    JobError::Setup(msg)
}

async fn write_frame(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(&(bytes.len() as u32).to_le_bytes()).await?;
    s.write_all(bytes).await?;
    s.flush().await
}

async fn read_frame(s: &mut TcpStream, limit: usize) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a message of {len} bytes (at most {limit})"),
        ));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf).await?;
    Ok(buf)
}

fn preamble(auth: bool) -> [u8; 10] {
    let mut p = [0u8; 10];
    p[..8].copy_from_slice(MAGIC);
    p[8] = REGISTRATION_VERSION;
    p[9] = u8::from(auth);
    p
}

/// Checks the other side's preamble; the error says what differs.
fn check_preamble(p: &[u8; 10], auth: bool, peer: &str) -> Result<(), String> {
    if &p[..8] != MAGIC {
        return Err(format!(
            "{peer} does not speak dflow's registration (is the port right?)"
        ));
    }
    if p[8] != REGISTRATION_VERSION {
        return Err(format!(
            "{peer} speaks registration version {} and this dflow {REGISTRATION_VERSION}: run the same dflow everywhere",
            p[8]
        ));
    }
    if (p[9] != 0) != auth {
        return Err(format!(
            "{peer} {} a cluster secret and this task {}: give every task the same --secret-file or DFLOW_SECRET",
            if p[9] != 0 { "uses" } else { "does not use" },
            if auth { "does" } else { "does not" }
        ));
    }
    Ok(())
}

/// Binds rank 0's registration listener.
pub async fn listen(addr: SocketAddr) -> Result<TcpListener, JobError> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| setup(format!("rank 0 cannot accept registrations on {addr}: {e}")))
}

/// Rank 0: [`collect`]s the registrations, then answers every rank with the cluster that
/// includes `own`. Returns the cluster.
pub async fn gather(
    listener: TcpListener,
    own: Registration,
    expected: &(dyn Fn(u32) -> (String, u32) + Sync),
    secret: Option<Secret>,
    within: Duration,
) -> Result<ClusterSpec, JobError> {
    collect(listener, own.world_size, expected, secret, within)
        .await?
        .answer(own)
        .await
}

/// The other ranks' registrations, their connections held open for the answer.
#[derive(Debug)]
pub struct Gathered {
    joined: BTreeMap<u32, (Registration, TcpStream)>,
}

/// Rank 0: waits (at most `within`) until ranks `1..world_size` have registered, checking
/// each against `expected(rank)` (the job and index that rank must have). Rank 0 then binds
/// its own data plane (see [`Gathered::advertised_host`]) and calls [`Gathered::answer`].
pub async fn collect(
    listener: TcpListener,
    world: u32,
    expected: &(dyn Fn(u32) -> (String, u32) + Sync),
    secret: Option<Secret>,
    within: Duration,
) -> Result<Gathered, JobError> {
    let start = Instant::now();
    let at = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let (tx, mut rx) = mpsc::channel::<Result<(Registration, TcpStream), String>>(64);
    let introducing = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_INTRODUCING));
    let mut joined: BTreeMap<u32, (Registration, TcpStream)> = BTreeMap::new();
    let mut last_log = Instant::now();
    let mut last_error = String::from("none");
    while (joined.len() as u64) + 1 < u64::from(world) {
        let left = within.saturating_sub(start.elapsed());
        let missing = || -> String {
            let ranks: Vec<String> = (1..world)
                .filter(|r| !joined.contains_key(r))
                .take(20)
                .map(|r| r.to_string())
                .collect();
            format!("ranks {}", ranks.join(", "))
        };
        if left.is_zero() {
            return Err(JobError::Waiting {
                secs: within.as_secs(),
                what: format!("{} (of {world}) to register at {at}", missing()),
                last_error,
            });
        }
        if last_log.elapsed() >= Duration::from_secs(5) {
            eprintln!(
                "rank 0: {} of {world} ranks registered at {at}; waiting for {}",
                joined.len() + 1,
                missing()
            );
            last_log = Instant::now();
        }
        let tick = left.min(Duration::from_secs(1));
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(permit) = introducing.clone().try_acquire_owned() else {
                        tracing::warn!("registration: dropping {peer}: {MAX_INTRODUCING} connections are introducing themselves");
                        continue;
                    };
                    let tx = tx.clone();
                    let secret = secret.clone();
                    tokio::spawn(async move {
                        let r = tokio::time::timeout(INTRODUCTION_TIMEOUT, introduce(stream, peer, secret))
                            .await
                            .unwrap_or_else(|_| Err(format!("{peer} did not introduce itself within {} s", INTRODUCTION_TIMEOUT.as_secs())));
                        drop(permit);
                        let _ = tx.send(r).await;
                    });
                }
                Err(e) => last_error = format!("accepting a connection: {e}"),
            },
            got = rx.recv() => match got {
                Some(Ok((reg, mut stream))) => {
                    if let Err(problem) = check(&reg, world, expected) {
                        // Refuse it and keep waiting: a stale process of an earlier job must
                        // not end this one; a misconfigured rank learns why at once.
                        let _ = send_answer(&mut stream, &Answer::Refused(problem.clone())).await;
                        eprintln!("rank 0: refused a registration: {problem}");
                        last_error = problem;
                        continue;
                    }
                    eprintln!("rank 0: rank {} registered as /job:{}/task:{} at {}", reg.rank, reg.job, reg.index, reg.address);
                    if let Some((old, _)) = joined.insert(reg.rank, (reg, stream)) {
                        eprintln!("rank 0: rank {} registered again (restarted?); its registration from {} is replaced", old.rank, old.address);
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!("registration: {e}");
                    last_error = e;
                }
                None => {}
            },
            _ = tokio::time::sleep(tick) => {}
        }
    }
    Ok(Gathered { joined })
}

impl Gathered {
    /// The host rank 0 advertises: `configured` (its `MASTER_ADDR`), unless that is a loopback
    /// name (some launchers give rank 0 `MASTER_ADDR=localhost`) and the others reached rank 0
    /// at another address (the local end of their connections): then that address.
    pub fn advertised_host(&self, configured: &str) -> String {
        advertised_host(
            configured,
            self.joined
                .values()
                .filter_map(|(_, s)| s.local_addr().ok())
                .map(|a| a.ip()),
        )
    }

    /// Builds the cluster of `own` and every registered rank and sends it to each.
    pub async fn answer(mut self, own: Registration) -> Result<ClusterSpec, JobError> {
        let mut jobs: BTreeMap<String, BTreeMap<u32, String>> = BTreeMap::new();
        for reg in std::iter::once(&own).chain(self.joined.values().map(|(r, _)| r)) {
            jobs.entry(reg.job.clone())
                .or_default()
                .insert(reg.index, reg.address.clone());
        }
        let cluster = match ClusterSpec::new(jobs) {
            Ok(c) => c,
            Err(e) => {
                let why = format!("the registered tasks do not form a cluster: {e}");
                for (_, stream) in self.joined.values_mut() {
                    let _ = send_answer(stream, &Answer::Refused(why.clone())).await;
                }
                return Err(setup(why));
            }
        };
        let answer = Answer::Cluster(cluster.clone());
        for (rank, (_, stream)) in self.joined.iter_mut() {
            if let Err(e) = send_answer(stream, &answer).await {
                return Err(JobError::PeerGone {
                    task: format!("rank {rank}"),
                    cause: format!("sending it the cluster: {e}"),
                    waiting: String::new(),
                });
            }
        }
        Ok(cluster)
    }
}

/// See [`Gathered::advertised_host`]; `reached_at` are the local ends of the connections.
fn advertised_host(configured: &str, mut reached_at: impl Iterator<Item = IpAddr>) -> String {
    let host = configured.trim_start_matches('[').trim_end_matches(']');
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        return configured.to_string();
    }
    match reached_at.find(|ip| !ip.is_loopback() && !ip.is_unspecified()) {
        Some(ip) => {
            eprintln!("rank 0: advertising {ip} instead of {configured} (the other ranks reached rank 0 there)");
            ip.to_string()
        }
        None => configured.to_string(),
    }
}

fn check(
    reg: &Registration,
    world: u32,
    expected: &(dyn Fn(u32) -> (String, u32) + Sync),
) -> Result<(), String> {
    if reg.world_size != world {
        return Err(format!(
            "rank {} was started with world size {} and rank 0 with {world}: start every rank with the same WORLD_SIZE",
            reg.rank, reg.world_size
        ));
    }
    if reg.rank == 0 || reg.rank >= world {
        return Err(format!(
            "a task registered as rank {}, not a rank from 1 to {}",
            reg.rank,
            world - 1
        ));
    }
    let (job, index) = expected(reg.rank);
    if reg.job != job || reg.index != index {
        return Err(format!(
            "rank {} registered as /job:{}/task:{} but rank 0 expects /job:{job}/task:{index}: give every rank the same --num-ps",
            reg.rank, reg.job, reg.index
        ));
    }
    Ok(())
}

async fn send_answer(stream: &mut TcpStream, answer: &Answer) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(answer).map_err(std::io::Error::other)?;
    write_frame(stream, &bytes).await
}

/// Rank 0's side of one connection up to its registration.
async fn introduce(
    mut s: TcpStream,
    peer: SocketAddr,
    secret: Option<Secret>,
) -> Result<(Registration, TcpStream), String> {
    let who = peer.to_string();
    let io = |e: std::io::Error| format!("registration from {who}: {e}");
    let mut theirs = [0u8; 10];
    s.read_exact(&mut theirs).await.map_err(io)?;
    s.write_all(&preamble(secret.is_some())).await.map_err(io)?;
    check_preamble(&theirs, secret.is_some(), &who)?;
    if let Some(secret) = &secret {
        let hello = read_frame(&mut s, MAX_REQUEST_BYTES).await.map_err(io)?;
        let (acceptor, challenge) =
            Acceptor::challenge(secret, "rank 0", &hello, &who).map_err(|e| e.to_string())?;
        write_frame(&mut s, &challenge).await.map_err(io)?;
        let proof = read_frame(&mut s, MAX_REQUEST_BYTES).await.map_err(io)?;
        acceptor.verify(&proof, &who).map_err(|e| e.to_string())?;
        s.write_all(&[1]).await.map_err(io)?;
    }
    let body = read_frame(&mut s, MAX_REQUEST_BYTES).await.map_err(io)?;
    let reg: Registration = serde_json::from_slice(&body)
        .map_err(|e| format!("registration from {who} is not valid: {e}"))?;
    Ok((reg, s))
}

/// A rank other than 0: connects to rank 0 at `master` (`host:port`), retrying until
/// `within`. Returns the connection and this host's address on the route to rank 0 (the
/// address to advertise).
pub async fn connect(
    master: &str,
    rank: u32,
    within: Duration,
) -> Result<(TcpStream, IpAddr), JobError> {
    let start = Instant::now();
    let mut last_log = Instant::now();
    let mut pause = Duration::from_millis(50);
    loop {
        let attempt =
            tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(master)).await;
        let last_error = match attempt {
            Ok(Ok(stream)) => {
                let ip = stream
                    .local_addr()
                    .map_err(|e| {
                        setup(format!(
                            "rank {rank}: the connection to rank 0 at {master}: {e}"
                        ))
                    })?
                    .ip();
                return Ok((stream, ip));
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "connecting timed out after 5 s".to_string(),
        };
        if start.elapsed() >= within {
            return Err(JobError::Waiting {
                secs: within.as_secs(),
                what: format!("rank 0 to accept registrations at {master}"),
                last_error,
            });
        }
        if last_log.elapsed() >= Duration::from_secs(5) {
            eprintln!("rank {rank}: waiting for rank 0 at {master} ({last_error})");
            last_log = Instant::now();
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// A rank other than 0: registers `me` over `stream` (from [`connect`]) and waits at most
/// `within` for the cluster.
pub async fn register(
    mut stream: TcpStream,
    me: &Registration,
    secret: Option<Secret>,
    within: Duration,
) -> Result<ClusterSpec, JobError> {
    let master = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "rank 0".into());
    let gone = |cause: String| JobError::PeerGone {
        task: format!("rank 0 ({master})"),
        cause,
        waiting: "; was registering".into(),
    };
    let exchange = async {
        stream
            .write_all(&preamble(secret.is_some()))
            .await
            .map_err(|e| gone(e.to_string()))?;
        let mut theirs = [0u8; 10];
        stream.read_exact(&mut theirs).await.map_err(|e| {
            gone(format!(
                "{e} (it closed the connection: a different dflow, or not rank 0?)"
            ))
        })?;
        check_preamble(&theirs, secret.is_some(), &format!("rank 0 ({master})")).map_err(setup)?;
        if let Some(secret) = &secret {
            let (connector, hello) = Connector::hello(secret, &format!("rank {}", me.rank));
            write_frame(&mut stream, &hello)
                .await
                .map_err(|e| gone(e.to_string()))?;
            let challenge = read_frame(&mut stream, MAX_REQUEST_BYTES)
                .await
                .map_err(|e| gone(e.to_string()))?;
            let (_, proof) = connector
                .answer(&challenge, &master)
                .map_err(|e| setup(e.to_string()))?;
            write_frame(&mut stream, &proof)
                .await
                .map_err(|e| gone(e.to_string()))?;
            let mut ok = [0u8; 1];
            stream.read_exact(&mut ok).await.map_err(|e| {
                gone(format!(
                    "{e} (rank 0 refused this task's proof: is the cluster secret the same?)"
                ))
            })?;
        }
        let body = serde_json::to_vec(me).map_err(|e| setup(e.to_string()))?;
        write_frame(&mut stream, &body)
            .await
            .map_err(|e| gone(e.to_string()))?;
        let answer = read_frame(&mut stream, MAX_ANSWER_BYTES)
            .await
            .map_err(|e| gone(e.to_string()))?;
        match serde_json::from_slice::<Answer>(&answer) {
            Ok(Answer::Cluster(c)) => Ok(c),
            Ok(Answer::Refused(why)) => {
                Err(setup(format!("rank 0 refused rank {}: {why}", me.rank)))
            }
            Err(e) => Err(setup(format!("rank 0's answer is not valid: {e}"))),
        }
    };
    match tokio::time::timeout(within, exchange).await {
        Ok(r) => r,
        Err(_) => Err(JobError::Waiting {
            secs: within.as_secs(),
            what: format!(
                "rank 0 at {master} to send the cluster (the other ranks have not all registered)"
            ),
            last_error: "none".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(rank: u32, job: &str, index: u32, port: u16) -> Registration {
        Registration {
            rank,
            world_size: 3,
            job: job.into(),
            index,
            address: format!("127.0.0.1:{port}"),
        }
    }

    fn roles(rank: u32) -> (String, u32) {
        if rank < 2 {
            ("worker".into(), rank)
        } else {
            ("ps".into(), rank - 2)
        }
    }

    async fn start_master(
        secret: Option<Secret>,
        within: Duration,
    ) -> (
        String,
        tokio::task::JoinHandle<Result<ClusterSpec, JobError>>,
    ) {
        let listener = listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let handle = tokio::spawn(async move {
            gather(listener, reg(0, "worker", 0, 1000), &roles, secret, within).await
        });
        (addr, handle)
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn rank_0_given_localhost_advertises_where_the_others_reached_it() {
        let local: IpAddr = "127.0.0.1".parse().unwrap();
        let pod: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(
            advertised_host("localhost", [local].into_iter()),
            "localhost"
        );
        assert_eq!(
            advertised_host("localhost", [local, pod].into_iter()),
            "10.1.2.3"
        );
        assert_eq!(advertised_host("127.0.0.1", [pod].into_iter()), "10.1.2.3");
        assert_eq!(
            advertised_host("digits-master-0", [pod].into_iter()),
            "digits-master-0"
        );
    }

    #[test]
    fn every_rank_gets_the_same_cluster() {
        rt().block_on(async {
            let secret = Secret::new(b"0123456789abcdef0123", "test").unwrap();
            let (addr, master) = start_master(Some(secret.clone()), Duration::from_secs(10)).await;
            let mut ranks = Vec::new();
            for (rank, job, index, port) in [(2, "ps", 0, 1002), (1, "worker", 1, 1001)] {
                let (addr, secret) = (addr.clone(), secret.clone());
                ranks.push(tokio::spawn(async move {
                    let (s, ip) = connect(&addr, rank, Duration::from_secs(5)).await.unwrap();
                    assert_eq!(ip.to_string(), "127.0.0.1");
                    register(
                        s,
                        &reg(rank, job, index, port),
                        Some(secret),
                        Duration::from_secs(10),
                    )
                    .await
                }));
            }
            let cluster = master.await.unwrap().unwrap();
            assert_eq!(cluster.address("worker", 0), Some("127.0.0.1:1000"));
            assert_eq!(cluster.address("worker", 1), Some("127.0.0.1:1001"));
            assert_eq!(cluster.address("ps", 0), Some("127.0.0.1:1002"));
            for r in ranks {
                assert_eq!(r.await.unwrap().unwrap(), cluster);
            }
        });
    }

    #[test]
    fn a_missing_rank_is_named_when_the_wait_ends() {
        rt().block_on(async {
            let (addr, master) = start_master(None, Duration::from_millis(1500)).await;
            let (s, _) = connect(&addr, 1, Duration::from_secs(5)).await.unwrap();
            let r1 = tokio::spawn(async move {
                register(s, &reg(1, "worker", 1, 1001), None, Duration::from_secs(5)).await
            });
            let e = master.await.unwrap().unwrap_err().to_string();
            assert!(e.contains("waiting for ranks 2 (of 3) to register"), "{e}");
            // Rank 1 learns that rank 0 gave up instead of waiting for its own timeout.
            let e1 = r1.await.unwrap().unwrap_err().to_string();
            assert!(e1.contains("rank 0"), "{e1}");
        });
    }

    #[test]
    fn a_wrong_secret_and_a_wrong_role_are_refused_with_the_reason() {
        rt().block_on(async {
            let good = Secret::new(b"0123456789abcdef0123", "test").unwrap();
            let bad = Secret::new(b"XXXXXXXXXXXXXXXXXXXX", "test").unwrap();
            let (addr, master) = start_master(Some(good.clone()), Duration::from_secs(3)).await;
            let (s, _) = connect(&addr, 1, Duration::from_secs(5)).await.unwrap();
            let e = register(
                s,
                &reg(1, "worker", 1, 1001),
                Some(bad),
                Duration::from_secs(5),
            )
            .await
            .unwrap_err();
            assert!(e.to_string().contains("rank 0"), "{e}");
            let (s, _) = connect(&addr, 1, Duration::from_secs(5)).await.unwrap();
            let e = register(s, &reg(1, "worker", 1, 1001), None, Duration::from_secs(5))
                .await
                .unwrap_err();
            assert!(
                e.to_string()
                    .contains("uses a cluster secret and this task does not"),
                "{e}"
            );
            let (s, _) = connect(&addr, 2, Duration::from_secs(5)).await.unwrap();
            let e = register(
                s,
                &reg(2, "worker", 2, 1002),
                Some(good),
                Duration::from_secs(5),
            )
            .await
            .unwrap_err();
            assert!(
                e.to_string().contains("rank 0 expects /job:ps/task:0"),
                "{e}"
            );
            // Rank 0 kept waiting for a rank that fits, and names the refusal when it gives up.
            let e = master.await.unwrap().unwrap_err().to_string();
            assert!(e.contains("waiting for ranks 1, 2 (of 3)"), "{e}");
            assert!(e.contains("expects /job:ps/task:0"), "{e}");
        });
    }

    #[test]
    fn a_silent_rank_0_is_a_bounded_wait() {
        rt().block_on(async {
            let e = connect("127.0.0.1:1", 1, Duration::from_millis(300))
                .await
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("rank 0 to accept registrations at 127.0.0.1:1"),
                "{e}"
            );
            // A listener that never answers: register gives up within its bound.
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap().to_string();
            let (s, _) = connect(&addr, 1, Duration::from_secs(2)).await.unwrap();
            let started = Instant::now();
            let e = register(s, &reg(1, "worker", 1, 1), None, Duration::from_millis(500))
                .await
                .unwrap_err();
            assert!(started.elapsed() < Duration::from_secs(3));
            assert!(e.to_string().contains("to send the cluster"), "{e}");
            drop(l);
        });
    }
}
