//! Two-process benchmark of the shared-memory transport (until `dflow bench transfer` has a
//! `--transport shm`): effective GB/s of values written in place into the slot and of values
//! copied into it once, a plain memcpy of the same size in the same run, and the small-tensor
//! round trip.
//!
//! ```sh
//! cargo run --release -p dflow-transport --example shm_transfer -- --sizes 4KiB,4MiB,64MiB
//! ```
//!
//! The lead process spawns its peer (this same binary with `--peer`). For each size the lead
//! sends `iters` values to the peer, which checks a marker at both ends of each, drops it (the
//! credit goes back) and acknowledges with a 4-byte tensor; GB/s = bytes sent / time to the
//! last acknowledgement. "in place" = the producer writes into `send_buffer`'s slot memory (what
//! a MatMul feeding a Send does); "copied" = `send` of a heap tensor (one memcpy into the slot).

use dflow_graph::{DType, Tensor};
use dflow_transport::shm::ShmPlane;
use dflow_transport::tcp::TcpConfig;
use dflow_transport::{DataPlane, Rendezvous, RendezvousKey};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct Opts {
    sizes: Vec<usize>,
    iters: u32,
    rtt: u32,
    peer: Option<String>,
}

fn parse_size(s: &str) -> Res<usize> {
    let (n, mul) = if let Some(n) = s.strip_suffix("GiB") {
        (n, 1 << 30)
    } else if let Some(n) = s.strip_suffix("MiB") {
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
        sizes: vec![4 << 10, 4 << 20, 64 << 20],
        iters: 0,
        rtt: 20_000,
        peer: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--sizes" => o.sizes = val()?.split(',').map(parse_size).collect::<Res<_>>()?,
            "--iters" => o.iters = val()?.parse()?,
            "--rtt" => o.rtt = val()?.parse()?,
            "--peer" => o.peer = Some(val()?),
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    Ok(o)
}

/// Iterations for a size: about 1 GiB moved, between 20 and 20 000.
fn iters_for(o: &Opts, size: usize) -> u32 {
    if o.iters > 0 {
        o.iters
    } else {
        ((1usize << 30) / size).clamp(20, 20_000) as u32
    }
}

fn key(name: &str) -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new("/job:a/task:0", "/job:b/task:0", name))
}

fn recv(p: &ShmPlane, k: &Arc<RendezvousKey>, step: u64) -> Res<Tensor> {
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

/// Sends a 4-byte `value` under `k`, written in place.
fn send_small(p: &ShmPlane, k: &Arc<RendezvousKey>, step: u64, value: f32) -> Res<()> {
    let mut t = match p.send_buffer(k, step, DType::F32, &[1]) {
        Some(t) => t,
        None => Tensor::zeros(DType::F32, &[1])?,
    };
    t.as_mut_slice::<f32>()?[0] = value;
    p.send(k, step, t)?;
    Ok(())
}

fn main() -> Res<()> {
    let o = opts()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    match &o.peer {
        Some(addr) => peer(&o, &rt, addr.parse()?),
        None => lead(&o, &rt),
    }
}

const MODES: [&str; 2] = ["in place", "copied"];

/// The receiving side: checks and acknowledges every value, echoes pings.
fn peer(o: &Opts, rt: &tokio::runtime::Runtime, lead: std::net::SocketAddr) -> Res<()> {
    let b = rt.block_on(ShmPlane::bind("b", "127.0.0.1:0".parse()?, config(), None))?;
    for (i, &size) in o.sizes.iter().enumerate() {
        b.register_recv(
            i as u32,
            "a",
            key(&format!("data{i}")),
            DType::F32,
            &[size / 4],
        )?;
    }
    b.register_recv(1000, "a", key("ping"), DType::F32, &[1])?;
    b.register_send(key("ack"), "a", 2000);
    b.register_send(key("pong"), "a", 2001);
    rt.block_on(b.clone().connect("a".into(), lead))?;
    println!("{}", b.local_addr());
    let mut step = 0u64;
    for (i, &size) in o.sizes.iter().enumerate() {
        let k = key(&format!("data{i}"));
        for _ in MODES {
            for _ in 0..iters_for(o, size) + 3 {
                step += 1;
                let t = recv(&b, &k, step)?;
                let v = t.as_slice::<f32>()?;
                let (first, last) = (v[0], v[v.len() - 1]);
                if first != step as f32 || last != step as f32 {
                    return Err(format!("step {step}: markers {first}, {last}").into());
                }
                drop(t);
                send_small(&b, &key("ack"), step, 1.0)?;
                b.finish_step(step);
            }
        }
    }
    for _ in 0..o.rtt + 100 {
        step += 1;
        let t = recv(&b, &key("ping"), step)?;
        let v = t.as_slice::<f32>()?[0];
        drop(t);
        send_small(&b, &key("pong"), step, v)?;
        b.finish_step(step);
    }
    rt.block_on(b.close(Duration::from_secs(1)));
    Ok(())
}

fn gbps(bytes: f64, d: Duration) -> f64 {
    bytes / d.as_secs_f64() / 1e9
}

/// The sending side: spawns the peer, measures, prints a table.
fn lead(o: &Opts, rt: &tokio::runtime::Runtime) -> Res<()> {
    let a = rt.block_on(ShmPlane::bind("a", "127.0.0.1:0".parse()?, config(), None))?;
    for (i, _) in o.sizes.iter().enumerate() {
        a.register_send(key(&format!("data{i}")), "b", i as u32);
    }
    a.register_send(key("ping"), "b", 1000);
    a.register_recv(2000, "b", key("ack"), DType::F32, &[1])?;
    a.register_recv(2001, "b", key("pong"), DType::F32, &[1])?;
    let sizes: Vec<String> = o.sizes.iter().map(|s| s.to_string()).collect();
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--peer",
            &a.local_addr().to_string(),
            "--sizes",
            &sizes.join(","),
        ])
        .args(["--iters", &o.iters.to_string(), "--rtt", &o.rtt.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().ok_or("no stdout")?).read_line(&mut line)?;
    rt.block_on(a.clone().connect("b".into(), line.trim().parse()?))?;

    println!(
        "| size | iterations | shm in place GB/s | shm copied GB/s | memcpy GB/s (same run) |"
    );
    println!("|---:|---:|---:|---:|---:|");
    let mut step = 0u64;
    for (i, &size) in o.sizes.iter().enumerate() {
        let k = key(&format!("data{i}"));
        let n = iters_for(o, size);
        let mut heap = Tensor::zeros(DType::F32, &[size / 4])?;
        let mut rates = Vec::new();
        for mode in MODES {
            let mut t0 = Instant::now();
            for it in 0..n + 3 {
                if it == 3 {
                    t0 = Instant::now(); // after warm-up (segments created, pages faulted)
                }
                step += 1;
                if mode == "in place" {
                    let mut t = a
                        .send_buffer(&k, step, DType::F32, &[size / 4])
                        .ok_or("no slot memory")?;
                    mark(&mut t, step)?;
                    a.send(&k, step, t)?;
                } else {
                    // Unique again once the previous send dropped its clone: no copy-on-write.
                    mark(&mut heap, step)?;
                    a.send(&k, step, heap.clone())?;
                }
                recv(&a, &key("ack"), step)?;
                a.finish_step(step);
            }
            rates.push(gbps(size as f64 * n as f64, t0.elapsed()));
        }
        let (src, mut dst) = (vec![1u8; size], vec![0u8; size]);
        let t0 = Instant::now();
        for _ in 0..n {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
        let memcpy = gbps(size as f64 * n as f64, t0.elapsed());
        println!(
            "| {} | {n} | {:.1} | {:.1} | {:.1} |",
            human(size),
            rates[0],
            rates[1],
            memcpy
        );
    }
    let mut rtts = Vec::with_capacity(o.rtt as usize);
    for it in 0..o.rtt + 100 {
        step += 1;
        let t0 = Instant::now();
        send_small(&a, &key("ping"), step, it as f32)?;
        let got = recv(&a, &key("pong"), step)?;
        let dt = t0.elapsed();
        if got.as_slice::<f32>()?[0] != it as f32 {
            return Err("pong carries the wrong value".into());
        }
        drop(got);
        a.finish_step(step);
        if it >= 100 {
            rtts.push(dt);
        }
    }
    rtts.sort();
    let pct = |p: f64| rtts[((rtts.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
    println!(
        "\nsmall-tensor round trip (4 B there and back, {} iterations): median {:.1} µs, p90 {:.1} µs, p99 {:.1} µs",
        rtts.len(),
        pct(0.5),
        pct(0.9),
        pct(0.99)
    );
    let s = a.stats();
    println!(
        "lead sent {} values in place, {} copied ({} bytes)",
        s.zero_copy_sends, s.copied_sends, s.copied_bytes
    );
    let status = child.wait()?;
    rt.block_on(a.close(Duration::from_secs(1)));
    if !status.success() {
        return Err(format!("peer failed: {status}").into());
    }
    Ok(())
}

/// The producer's output: markers at both ends (the rest is whatever it computed).
fn mark(t: &mut Tensor, step: u64) -> Res<()> {
    let v = t.as_mut_slice::<f32>()?;
    let last = v.len() - 1;
    v[0] = step as f32;
    v[last] = step as f32;
    Ok(())
}

fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}
