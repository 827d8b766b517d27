//! `dflow bench transfer`: point-to-point Send/Recv between two `dflow` processes over a data
//! plane (`tcp`, `shm`, or any other [`TransportKind`] this build has), the way a training step
//! uses it: one receive slot per key registered once, one tensor per step.
//!
//! The lead process spawns its peer (this binary with the hidden `--peer-of ADDR`). For each
//! size the lead sends `--iters` tensors to the peer; the peer checks a marker at both ends of
//! each (the bytes really arrived), drops it (the slot is free again) and acknowledges with a
//! 4-byte tensor. One iteration is therefore one step: S bytes there, 4 bytes back.
//!
//! - `GB/s` = S × iterations / total time (1 GB = 10^9 bytes), after `--warmup` iterations.
//! - `rtt` = the median (and p90) of the per-iteration times: at small sizes, the round trip.
//! - `memcpy GB/s` = `copy_from_slice` of S bytes in this process, same run: the cost of one copy.
//!
//! The producer writes its tensor where the transport wants it: into the slot memory offered by
//! [`dflow_transport::Rendezvous::send_buffer`] when there is some (shared memory: nothing is copied), otherwise
//! into its own buffer, reused every step (TCP writes it to the socket from there). `--copy`
//! forces the second way everywhere; the producer then cycles through a few buffers of its own,
//! as a kernel gets a fresh output each step, so a transport that still holds the previous
//! tensor (QUIC keeps it until its packets are acknowledged) does not force a copy-on-write.
//! Copies the producer did make anyway are counted in the `cow` column.
//!
//! Over QUIC the lead makes a throwaway cluster CA and certificates for both processes in a
//! temporary directory (removed at the end).

use anyhow::{bail, Context};
use dflow_graph::{DType, Tensor};
use dflow_transport::TcpConfig;
use dflow_transport::{DataPlane, RendezvousKey, TransportKind};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::bench_collective::{human, parse_size};

/// Arguments of `dflow bench transfer`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// The data plane between the two processes.
    #[arg(long, default_value = "tcp", value_parser = |s: &str| s.parse::<TransportKind>())]
    pub transport: TransportKind,
    /// Tensor sizes in bytes, comma separated (suffixes B, KiB, MiB, GiB; a positive multiple
    /// of 4).
    #[arg(long, default_value = "4KiB,4MiB,64MiB", value_delimiter = ',')]
    pub size: Vec<String>,
    /// Timed iterations per size (0: about 1 GiB moved, between 20 and 20,000).
    #[arg(long, default_value_t = 0)]
    pub iters: u32,
    /// Untimed iterations per size before the timed ones.
    #[arg(long, default_value_t = 3)]
    pub warmup: u32,
    /// Send tensors from the producer's own buffer even where the transport offers slot memory.
    #[arg(long)]
    pub copy: bool,
    /// Seconds to wait for any one tensor before giving up.
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// Internal: run as the receiving peer of the lead listening at this address.
    #[arg(long, hide = true)]
    pub peer_of: Option<SocketAddr>,
    /// Internal: the certificates of a QUIC run (made by the lead).
    #[arg(long, hide = true)]
    pub cert_dir: Option<PathBuf>,
}

/// Slot id of the 4-byte acknowledgement (the data slots are numbered by size index).
const ACK_SLOT: u32 = 1 << 20;

const LEAD: &str = "bench:0";
const PEER: &str = "bench:1";

fn data_key(i: usize) -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new(LEAD, PEER, &format!("data{i}:0")))
}

fn ack_key() -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new(PEER, LEAD, "ack:0"))
}

/// What both processes agree on: sizes (bytes) and iterations per size.
struct Plan {
    sizes: Vec<usize>,
    iters: Vec<u32>,
    warmup: u32,
    timeout: Duration,
}

fn plan(args: &Args) -> anyhow::Result<Plan> {
    let mut sizes = Vec::new();
    for s in &args.size {
        let bytes = parse_size(s)?;
        if bytes < 4 || bytes % 4 != 0 {
            bail!("size {s}: a transfer is a whole number of f32 elements (a positive multiple of 4 bytes)");
        }
        sizes.push(bytes);
    }
    if sizes.is_empty() {
        bail!("no sizes given (--size)");
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        bail!("--timeout must be a positive number of seconds");
    }
    let iters = sizes
        .iter()
        .map(|&s| match args.iters {
            0 => ((1usize << 30) / s).clamp(20, 20_000) as u32,
            n => n,
        })
        .collect();
    Ok(Plan {
        sizes,
        iters,
        warmup: args.warmup,
        timeout: Duration::from_secs_f64(args.timeout),
    })
}

fn config(plan: &Plan) -> TcpConfig {
    TcpConfig {
        frame_timeout: plan.timeout,
        connect_timeout: plan.timeout,
        ..TcpConfig::default()
    }
}

/// A temporary directory holding a throwaway CA and both tasks' certificates; removed on drop.
struct Certs(PathBuf);

impl Certs {
    fn make() -> anyhow::Result<Certs> {
        let dir = std::env::temp_dir().join(format!("dflow-bench-certs-{}", std::process::id()));
        let certs = Certs(dir);
        let pki = |e: dflow_transport::quic::pki::PkiError| anyhow::anyhow!("{e}");
        dflow_transport::quic::pki::init_ca(&certs.0, 1, true).map_err(pki)?;
        for task in [LEAD, PEER] {
            dflow_transport::quic::pki::issue_to_dir(&certs.0, task, 1).map_err(pki)?;
        }
        Ok(certs)
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Binds `task`'s plane on 127.0.0.1 (with its certificate from `certs` for QUIC).
fn bind(
    rt: &tokio::runtime::Runtime,
    kind: TransportKind,
    task: &str,
    plan: &Plan,
    certs: Option<&Path>,
) -> anyhow::Result<Arc<dyn DataPlane>> {
    let identity = match (kind, certs) {
        (TransportKind::Quic, Some(dir)) => Some(
            dflow_transport::quic::QuicIdentity::from_dir(task, dir)
                .map_err(|e| anyhow::anyhow!("{e}"))?,
        ),
        _ => None,
    };
    Ok(rt.block_on(dflow_transport::plane::bind_with_identity(
        kind,
        task,
        "127.0.0.1:0".parse()?,
        config(plan),
        None,
        identity,
    ))?)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the I/O runtime")
}

/// How long a receiver polls (yielding the core) before it sleeps.
const POLL: Duration = Duration::from_micros(50);

/// Waits for `key`'s tensor in `step`, at most `timeout`.
fn recv(
    plane: &dyn DataPlane,
    key: &Arc<RendezvousKey>,
    step: u64,
    timeout: Duration,
    from: &str,
) -> anyhow::Result<Tensor> {
    let (tx, rx) = mpsc::channel();
    plane.recv_async(key, step, Box::new(move |r| drop(tx.send(r))));
    // Poll briefly before sleeping, as the transports' own waits do: a sleeping receiver
    // would add a wake-up to every round trip.
    let poll_until = Instant::now() + POLL;
    while Instant::now() < poll_until {
        match rx.try_recv() {
            Ok(r) => {
                return r.with_context(|| format!("receiving {key} (step {step}) from {from}"))
            }
            Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
            Err(mpsc::TryRecvError::Disconnected) => break,
        }
    }
    match rx.recv_timeout(timeout) {
        Ok(r) => r.with_context(|| format!("receiving {key} (step {step}) from {from}")),
        Err(_) => bail!(
            "waited {:.0} s for {key} (step {step}) from {from}",
            timeout.as_secs_f64()
        ),
    }
}

/// Buffers the producer cycles through when it writes into its own memory.
const OWN_BUFFERS: usize = 3;

/// The producer's output for `step`: slot memory where the transport offers it, else one of
/// its `own` buffers (taken in turn), with `step` written at both ends.
fn produce(
    plane: &dyn DataPlane,
    key: &Arc<RendezvousKey>,
    step: u64,
    own: &mut [Tensor],
    copy: bool,
) -> anyhow::Result<Tensor> {
    let n = own.len();
    let mine = &mut own[step as usize % n];
    match (copy, plane.send_buffer(key, step, DType::F32, mine.dims())) {
        (false, Some(mut slot)) => {
            mark(&mut slot, step)?;
            Ok(slot)
        }
        _ => {
            // Written while unique (the transport dropped the clone it sent earlier), then
            // shared with the transport: no copy unless it still held the buffer.
            mark(mine, step)?;
            Ok(mine.clone())
        }
    }
}

/// Writes `step` at both ends of `t` (the rest is whatever the producer computed).
fn mark(t: &mut Tensor, step: u64) -> anyhow::Result<()> {
    let v = t.as_mut_slice::<f32>()?;
    let last = v.len() - 1;
    v[0] = step as f32;
    v[last] = step as f32;
    Ok(())
}

/// The receiving side: checks and acknowledges every tensor.
fn run_peer(args: &Args, lead: SocketAddr) -> anyhow::Result<()> {
    let plan = plan(args)?;
    let rt = runtime()?;
    let plane = bind(&rt, args.transport, PEER, &plan, args.cert_dir.as_deref())?;
    for (i, &size) in plan.sizes.iter().enumerate() {
        plane
            .register_recv(i as u32, LEAD, data_key(i), DType::F32, &[size / 4])
            .map_err(anyhow::Error::msg)?;
    }
    let ack = ack_key();
    plane.register_send(ack.clone(), LEAD, ACK_SLOT);
    rt.block_on(plane.clone().connect(LEAD.into(), lead))
        .map_err(anyhow::Error::msg)?;
    println!("ADDR {}", plane.local_addr());
    let mut ack_value = [Tensor::zeros(DType::F32, &[1])?];
    let mut step = 0u64;
    for (i, &n) in plan.iters.iter().enumerate() {
        let key = data_key(i);
        for _ in 0..plan.warmup + n {
            step += 1;
            let t = recv(&*plane, &key, step, plan.timeout, LEAD)?;
            let v = t.as_slice::<f32>()?;
            let (first, last) = (v[0], v[v.len() - 1]);
            if first != step as f32 || last != step as f32 {
                bail!("step {step}: {key} carries markers {first}, {last}, not {step}");
            }
            drop(t);
            let a = produce(&*plane, &ack, step, &mut ack_value, args.copy)?;
            plane.send(&ack, step, a)?;
            plane.finish_step(step);
        }
    }
    // Stay connected until the lead has taken the last acknowledgement (it closes our stdin):
    // closing first could fail the lead's last Recv with "peer gone".
    let mut rest = String::new();
    let _ = std::io::stdin().read_line(&mut rest);
    rt.block_on(plane.close(Duration::from_secs(2)));
    Ok(())
}

/// Kills and reaps the peer however the lead leaves.
struct PeerProcess(Child);

impl Drop for PeerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn peer_args(args: &Args, lead: SocketAddr, certs: Option<&Path>) -> Vec<String> {
    let mut v = vec![
        "bench".to_string(),
        "transfer".into(),
        "--transport".into(),
        args.transport.to_string(),
        "--size".into(),
        args.size.join(","),
        "--iters".into(),
        args.iters.to_string(),
        "--warmup".into(),
        args.warmup.to_string(),
        "--timeout".into(),
        args.timeout.to_string(),
        "--peer-of".into(),
        lead.to_string(),
    ];
    if args.copy {
        v.push("--copy".into());
    }
    if let Some(dir) = certs {
        v.extend(["--cert-dir".into(), dir.display().to_string()]);
    }
    v
}

/// One measured size.
struct Row {
    bytes: usize,
    iters: u32,
    gbps: f64,
    median_us: f64,
    p90_us: f64,
    memcpy_gbps: f64,
    /// Copy-on-write copies the producer made (its buffer was still shared).
    cow: u64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted
        .get(((sorted.len().saturating_sub(1)) as f64 * p).round() as usize)
        .copied()
        .unwrap_or(f64::NAN)
}

/// GB/s of `copy_from_slice` of `bytes`, `iters` times (at least ~50 ms of copying).
fn memcpy_gbps(bytes: usize, iters: u32) -> f64 {
    let (src, mut dst) = (vec![1u8; bytes], vec![0u8; bytes]);
    dst.copy_from_slice(&src); // fault the pages in
    let t0 = Instant::now();
    let mut n = 0u64;
    while n < iters as u64 || t0.elapsed() < Duration::from_millis(50) {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        n += 1;
    }
    bytes as f64 * n as f64 / t0.elapsed().as_secs_f64() / 1e9
}

/// The sending side: spawns the peer, measures, returns the rows.
fn run_lead(args: &Args) -> anyhow::Result<Vec<Row>> {
    let plan = plan(args)?;
    let rt = runtime()?;
    let certs = match args.transport {
        TransportKind::Quic => Some(Certs::make().context("making throwaway certificates")?),
        _ => None,
    };
    let cert_dir = certs.as_ref().map(|c| c.0.as_path());
    let plane = bind(&rt, args.transport, LEAD, &plan, cert_dir)?;
    for i in 0..plan.sizes.len() {
        plane.register_send(data_key(i), PEER, i as u32);
    }
    let ack = ack_key();
    plane
        .register_recv(ACK_SLOT, PEER, ack.clone(), DType::F32, &[1])
        .map_err(anyhow::Error::msg)?;

    let exe = std::env::current_exe().context("finding this executable")?;
    let mut peer = PeerProcess(
        Command::new(exe)
            .args(peer_args(args, plane.local_addr(), cert_dir))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the peer process")?,
    );
    let mut line = String::new();
    BufReader::new(peer.0.stdout.take().context("the peer's stdout")?)
        .read_line(&mut line)
        .context("reading the peer's address")?;
    let addr: SocketAddr = line
        .trim()
        .strip_prefix("ADDR ")
        .and_then(|a| a.parse().ok())
        .with_context(|| format!("the peer did not report its address (it said {line:?})"))?;
    rt.block_on(plane.clone().connect(PEER.into(), addr))
        .map_err(anyhow::Error::msg)?;

    let mut rows = Vec::new();
    let mut step = 0u64;
    for (i, (&size, &n)) in plan.sizes.iter().zip(&plan.iters).enumerate() {
        let key = data_key(i);
        // Real values in every page (an untouched zeroed buffer would be read from the
        // kernel's one shared zero page, which is always in cache).
        let mut own = (0..OWN_BUFFERS)
            .map(|b| Tensor::from_slice(&[size / 4], &vec![b as f32 + 0.5; size / 4]))
            .collect::<Result<Vec<_>, _>>()?;
        let copies_before = dflow_graph::tensor::buffer_copies();
        let mut times = Vec::with_capacity(n as usize);
        let mut t_start = Instant::now();
        for it in 0..plan.warmup + n {
            if it == plan.warmup {
                t_start = Instant::now();
            }
            step += 1;
            let t0 = Instant::now();
            let t = produce(&*plane, &key, step, &mut own, args.copy)?;
            plane.send(&key, step, t)?;
            let a = recv(&*plane, &ack, step, plan.timeout, PEER)?;
            drop(a);
            plane.finish_step(step);
            if it >= plan.warmup {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        let total = t_start.elapsed().as_secs_f64();
        let cow = dflow_graph::tensor::buffer_copies() - copies_before;
        times.sort_by(f64::total_cmp);
        rows.push(Row {
            bytes: size,
            iters: n,
            gbps: size as f64 * n as f64 / total / 1e9,
            median_us: percentile(&times, 0.5) * 1e6,
            p90_us: percentile(&times, 0.9) * 1e6,
            memcpy_gbps: memcpy_gbps(size, n),
            cow,
        });
    }
    drop(peer.0.stdin.take()); // the peer may leave now
    let status = peer.0.wait().context("waiting for the peer")?;
    rt.block_on(plane.close(Duration::from_secs(2)));
    if !status.success() {
        bail!("the peer process failed ({status}); its error is above");
    }
    Ok(rows)
}

fn print_table(args: &Args, rows: &[Row]) {
    let how = if args.copy {
        "sent from the producer's buffer"
    } else {
        "written where the transport wants it"
    };
    println!(
        "# dflow transfer: 2 processes, {}, f32 tensors {how}; one iteration = S there, 4 B back",
        args.transport
    );
    println!(
        "{:>10} {:>7} {:>10} {:>12} {:>12} {:>14} {:>6}",
        "size", "iters", "GB/s", "rtt_med_us", "rtt_p90_us", "memcpy_GB/s", "cow"
    );
    for r in rows {
        println!(
            "{:>10} {:>7} {:>10.3} {:>12.1} {:>12.1} {:>14.3} {:>6}",
            human(r.bytes).replace(' ', ""),
            r.iters,
            r.gbps,
            r.median_us,
            r.p90_us,
            r.memcpy_gbps,
            r.cow
        );
    }
}

/// Runs `dflow bench transfer`.
pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(lead) = args.peer_of {
        return run_peer(&args, lead);
    }
    let rows = run_lead(&args)?;
    print_table(&args, &rows);
    Ok(())
}
