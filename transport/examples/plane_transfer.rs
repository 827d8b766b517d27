//! Two-process transfer benchmark of any data plane bound through `plane::bind` (until
//! `dflow bench transfer` lands): GB/s of values sent from a heap tensor into the peer's slot,
//! each acknowledged before the next.
//!
//! ```sh
//! cargo run --release -p dflow-transport --example plane_transfer -- --transport tcp,quic --sizes 4MiB,64MiB
//! ```
//!
//! The lead process spawns its peer (this same binary with `--peer`). For QUIC it makes a
//! throw-away cluster CA and certificates for both tasks in a temporary directory and points
//! `DFLOW_CERT_DIR` at it, exactly what a caller of `plane::bind` without an explicit identity
//! does. The sender rotates four tensors; `--reuse` rewrites one tensor every iteration.

use dflow_graph::{DType, Tensor};
use dflow_transport::plane::{bind, DataPlane, TransportKind};
use dflow_transport::quic::{pki, CERT_DIR_ENV};
use dflow_transport::tcp::TcpConfig;
use dflow_transport::RendezvousKey;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// As in the `dflow` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Opts {
    kinds: Vec<TransportKind>,
    sizes: Vec<usize>,
    iters: u32,
    /// Rewrite one tensor every iteration (instead of rotating four).
    reuse: bool,
    peer: Option<String>,
}

fn parse_size(s: &str) -> Res<usize> {
    let (n, mul) = if let Some(n) = s.strip_suffix("MiB") {
        (n, 1 << 20)
    } else if let Some(n) = s.strip_suffix("KiB") {
        (n, 1 << 10)
    } else {
        (s, 1)
    };
    let bytes = n.trim().parse::<usize>()? * mul;
    if bytes < 8 || bytes % 4 != 0 {
        return Err(format!("size {s}: at least 8 bytes, a multiple of 4").into());
    }
    Ok(bytes)
}

fn opts() -> Res<Opts> {
    let mut o = Opts {
        kinds: vec![TransportKind::Tcp, TransportKind::Quic],
        sizes: vec![4 << 20, 64 << 20],
        iters: 0,
        reuse: false,
        peer: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--transport" => {
                o.kinds = val()?
                    .split(',')
                    .map(|s| s.parse::<TransportKind>())
                    .collect::<Result<_, _>>()?
            }
            "--sizes" => o.sizes = val()?.split(',').map(parse_size).collect::<Res<_>>()?,
            "--iters" => o.iters = val()?.parse()?,
            "--reuse" => o.reuse = true,
            "--peer" => o.peer = Some(val()?),
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    Ok(o)
}

/// Iterations for a size: about 2 GiB moved, between 10 and 10 000.
fn iters_for(o: &Opts, size: usize) -> u32 {
    if o.iters > 0 {
        o.iters
    } else {
        ((2usize << 30) / size).clamp(10, 10_000) as u32
    }
}

fn key(name: &str) -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new("/job:a/task:0", "/job:b/task:0", name))
}

fn recv(p: &dyn DataPlane, k: &Arc<RendezvousKey>, step: u64) -> Res<Tensor> {
    let (tx, rx) = mpsc::channel();
    p.recv_async(k, step, Box::new(move |r| drop(tx.send(r))));
    Ok(rx.recv_timeout(Duration::from_secs(60))??)
}

fn config() -> TcpConfig {
    TcpConfig {
        frame_timeout: Duration::from_secs(60),
        ..TcpConfig::default()
    }
}

fn main() -> Res<()> {
    let o = opts()?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DFLOW_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut made_certs = None;
    if o.peer.is_none() && std::env::var_os(CERT_DIR_ENV).is_none() {
        // Before any thread starts: the child inherits the variable.
        let dir = std::env::temp_dir().join(format!("dflow-plane-transfer-{}", std::process::id()));
        pki::init_ca(&dir, 1, true)?;
        for task in ["a", "b"] {
            pki::issue_to_dir(&dir, task, 1)?;
        }
        std::env::set_var(CERT_DIR_ENV, &dir);
        made_certs = Some(dir);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = match &o.peer {
        Some(addr) => peer(&o, &rt, addr),
        None => lead(&o, &rt),
    };
    if let Some(dir) = made_certs {
        let _ = std::fs::remove_dir_all(dir);
    }
    result
}

/// The receiving side: checks and acknowledges every value.
fn peer(o: &Opts, rt: &tokio::runtime::Runtime, lead: &str) -> Res<()> {
    let kind = o.kinds[0];
    let addr = "127.0.0.1:0".parse()?;
    let b = rt.block_on(bind(kind, "b", addr, config(), None))?;
    for (i, &size) in o.sizes.iter().enumerate() {
        b.register_recv(
            i as u32,
            "a",
            key(&format!("data{i}")),
            DType::F32,
            &[size / 4],
        )?;
    }
    b.register_send(key("ack"), "a", 2000);
    rt.block_on(b.clone().connect("a".into(), lead.parse()?))?;
    println!("{}", b.local_addr());
    let mut step = 0u64;
    for (i, &size) in o.sizes.iter().enumerate() {
        let k = key(&format!("data{i}"));
        for _ in 0..iters_for(o, size) + 2 {
            step += 1;
            let t = recv(&*b, &k, step)?;
            let v = t.as_slice::<f32>()?;
            let (first, last) = (v[0], v[v.len() - 1]);
            if first != step as f32 || last != step as f32 {
                return Err(format!("step {step}: markers {first}, {last}").into());
            }
            drop(t);
            b.send(&key("ack"), step, Tensor::from_slice(&[1], &[1.0f32])?)?;
            b.finish_step(step);
        }
    }
    rt.block_on(b.close(Duration::from_secs(1)));
    Ok(())
}

fn lead(o: &Opts, rt: &tokio::runtime::Runtime) -> Res<()> {
    println!("| transport | size | iterations | GB/s |");
    println!("|---|---:|---:|---:|");
    for &kind in &o.kinds {
        let addr = "127.0.0.1:0".parse()?;
        let a = rt.block_on(bind(kind, "a", addr, config(), None))?;
        for (i, _) in o.sizes.iter().enumerate() {
            a.register_send(key(&format!("data{i}")), "b", i as u32);
        }
        a.register_recv(2000, "b", key("ack"), DType::F32, &[1])?;
        let sizes: Vec<String> = o.sizes.iter().map(|s| s.to_string()).collect();
        let mut child = Command::new(std::env::current_exe()?)
            .args(["--peer", &a.local_addr().to_string()])
            .args(["--transport", kind.name(), "--sizes", &sizes.join(",")])
            .args(["--iters", &o.iters.to_string()])
            .stdout(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().ok_or("no stdout")?).read_line(&mut line)?;
        rt.block_on(a.clone().connect("b".into(), line.trim().parse()?))?;
        let mut step = 0u64;
        for (i, &size) in o.sizes.iter().enumerate() {
            let k = key(&format!("data{i}"));
            let n = iters_for(o, size);
            // A few producer outputs in rotation, as a training step's kernels would allocate:
            // QUIC keeps a sent tensor until the peer acknowledged its packets, and writing
            // the same tensor again at once would copy it first.
            let mut pool = (0..4)
                .map(|_| Tensor::zeros(DType::F32, &[size / 4]))
                .collect::<Result<Vec<_>, _>>()?;
            let mut t0 = Instant::now();
            for it in 0..n + 2 {
                if it == 2 {
                    t0 = Instant::now();
                }
                step += 1;
                let heap = &mut pool[if o.reuse { 0 } else { it as usize % 4 }];
                {
                    let v = heap.as_mut_slice::<f32>()?;
                    let last = v.len() - 1;
                    v[0] = step as f32;
                    v[last] = step as f32;
                }
                a.send(&k, step, heap.clone())?;
                recv(&*a, &key("ack"), step)?;
                a.finish_step(step);
            }
            let gbps = size as f64 * n as f64 / t0.elapsed().as_secs_f64() / 1e9;
            println!("| {kind} | {} KiB | {n} | {gbps:.2} |", size >> 10);
        }
        let status = child.wait()?;
        rt.block_on(a.close(Duration::from_secs(1)));
        if !status.success() {
            return Err(format!("peer failed: {status}").into());
        }
    }
    Ok(())
}
