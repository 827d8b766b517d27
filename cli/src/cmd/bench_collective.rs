//! `dflow bench-collective`: collective throughput and latency over N ranks, with the
//! nccl-tests bandwidth formulas. Over TCP and shared memory each rank is a child process (this
//! binary with the hidden `--worker-rank`); in-process, each rank is a thread.
//!
//! Methodology (the same as `../shared/bench/gloo_collectives.py`): per size, `--warmup`
//! untimed calls, then `--iters` times: barrier, time one call. An iteration's time is the
//! slowest rank's; the table shows the median over iterations. algbw = S / time, busbw = algbw
//! times the op's factor (all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all, scatter
//! and gather (n-1)/n; broadcast and reduce 1), S as nccl-tests defines it: the buffer for
//! all-reduce, broadcast and reduce, the total output of all-gather and gather, the total
//! input of reduce-scatter, scatter and all-to-all.

use anyhow::{bail, Context};
use dflow_transport::collective::{
    block_range, Algorithm, CollectiveError, CommOptions, Communicator, Pairs, ReduceOp,
    ShmOptions, ShmRendezvous, TcpGroupListener, TcpOptions,
};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Arguments of `dflow bench-collective`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Collectives, comma separated: all_reduce, all_gather, broadcast, reduce, reduce_scatter,
    /// all_to_all, scatter, gather.
    #[arg(long, default_value = "all_reduce", value_delimiter = ',')]
    pub op: Vec<String>,
    /// Number of ranks.
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Sizes in bytes, comma separated (suffixes B, KiB, MiB, GiB).
    #[arg(long, default_value = "4B,4MiB,64MiB", value_delimiter = ',')]
    pub size: Vec<String>,
    /// `tcp` (one process per rank, 127.0.0.1), `shm` (one process per rank, shared memory) or
    /// `inproc` (threads of this process).
    #[arg(long, default_value = "tcp")]
    pub transport: String,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 20)]
    pub iters: usize,
    /// Untimed iterations per size.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// auto, ring or tree.
    #[arg(long, default_value = "auto")]
    pub algorithm: String,
    /// Message size of the pipelined algorithms (default: the library's).
    #[arg(long)]
    pub chunk: Option<String>,
    /// Busy-poll window of small calls in microseconds (default: the library's).
    #[arg(long)]
    pub spin_us: Option<u64>,
    /// Pin each rank's process to one CPU (rank r on the r-th CPU this process may use, modulo
    /// their count): `auto` pins when the ranks fit on the CPUs and leaves them free otherwise,
    /// which is what `mpirun` does by default (bind to core for up to as many ranks as cores,
    /// no binding when oversubscribed), so the default compares like with like; `core` always
    /// pins (`--bind` alone means `core`), `none` never does. Not used by `inproc`.
    #[arg(long, value_enum, default_value_t = Bind::Auto, num_args = 0..=1, default_missing_value = "core")]
    pub bind: Bind,
    /// Per-call timeout in seconds.
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    /// Internal: run as this rank (set by the parent process).
    #[arg(long, hide = true)]
    pub worker_rank: Option<usize>,
    /// Internal: the CPU this rank pins itself to (set by the parent process).
    #[arg(long, hide = true)]
    pub pin_cpu: Option<usize>,
}

/// Whether the ranks' processes are pinned to CPUs (`--bind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Bind {
    /// Pin when the ranks fit on the CPUs (as `mpirun` does by default).
    Auto,
    /// Always pin, rank r on CPU r modulo the CPU count.
    Core,
    /// Never pin.
    None,
}

impl Bind {
    fn name(self) -> &'static str {
        match self {
            Bind::Auto => "auto",
            Bind::Core => "core",
            Bind::None => "none",
        }
    }
}

/// The CPU of each rank under `bind`, or `None` when the ranks run unpinned.
fn rank_cpus(bind: Bind, ranks: usize, cpus: &[usize]) -> Option<Vec<usize>> {
    let pin = match bind {
        Bind::Core => true,
        Bind::Auto => ranks <= cpus.len(),
        Bind::None => false,
    };
    (pin && !cpus.is_empty()).then(|| (0..ranks).map(|r| cpus[r % cpus.len()]).collect())
}

/// Pins the calling process (all of its threads created afterwards) to `cpu`.
fn pin_to_cpu(cpu: usize) -> anyhow::Result<()> {
    super::host_cpus::bind_to(&[cpu])
}

/// The collectives this command measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// all_reduce (sum).
    AllReduce,
    /// all_gather.
    AllGather,
    /// broadcast from 0.
    Broadcast,
    /// reduce (sum) to 0.
    Reduce,
    /// reduce_scatter (sum).
    ReduceScatter,
    /// all_to_all.
    AllToAll,
    /// scatter from 0.
    Scatter,
    /// gather to 0.
    Gather,
}

impl Op {
    const ALL: [(Op, &'static str); 8] = [
        (Op::AllReduce, "all_reduce"),
        (Op::AllGather, "all_gather"),
        (Op::Broadcast, "broadcast"),
        (Op::Reduce, "reduce"),
        (Op::ReduceScatter, "reduce_scatter"),
        (Op::AllToAll, "all_to_all"),
        (Op::Scatter, "scatter"),
        (Op::Gather, "gather"),
    ];

    fn parse(s: &str) -> anyhow::Result<Op> {
        Op::ALL
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(o, _)| *o)
            .with_context(|| {
                let names: Vec<_> = Op::ALL.iter().map(|(_, n)| *n).collect();
                format!("unknown collective {s:?} (one of {})", names.join(", "))
            })
    }

    fn name(self) -> &'static str {
        Op::ALL
            .iter()
            .find(|(o, _)| *o == self)
            .map_or("?", |(_, n)| n)
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::Broadcast | Op::Reduce => 1.0,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll | Op::Scatter | Op::Gather => {
                (n - 1.0) / n
            }
        }
    }
}

/// Parses `4B`, `4KiB`, `4MiB`, `1GiB` or a plain byte count.
pub fn parse_size(s: &str) -> anyhow::Result<usize> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num.parse().with_context(|| format!("bad size {s:?}"))?;
    let mult = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        u => bail!("bad size unit {u:?} in {s:?} (B, KiB, MiB, GiB)"),
    };
    n.checked_mul(mult)
        .with_context(|| format!("size {s:?} does not fit in {} bytes", usize::MAX))
}

/// `4 MiB`, `4 KiB`, `4 B`: a byte count in the largest unit that divides it.
pub(crate) fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// One measured row.
#[derive(Debug, Clone)]
struct Row {
    op: Op,
    bytes: usize,
    count: usize,
    median: f64,
    min: f64,
    max: f64,
}

/// Element count (f32) of one rank's main buffer for `bytes`, rounded so blocks are equal.
fn count_for(op: Op, bytes: usize, n: usize) -> usize {
    let elems = (bytes / 4).max(1);
    match op {
        Op::AllReduce | Op::Broadcast | Op::Reduce => elems,
        // Total over ranks, a multiple of n.
        _ => (elems / n).max(1) * n,
    }
}

/// Runs one op at one size on this rank; returns the per-iteration times (max over ranks).
fn measure(
    c: &Communicator,
    op: Op,
    bytes: usize,
    iters: usize,
    warmup: usize,
) -> Result<Vec<f64>, CollectiveError> {
    let n = c.size();
    let total = count_for(op, bytes, n);
    let per = total / n;
    let mut big = vec![1.0f32; total];
    let mut small = vec![1.0f32; per.max(block_range(total, n, c.rank()).len())];
    let mut once = || -> Result<(), CollectiveError> {
        match op {
            Op::AllReduce => c.all_reduce(&mut big, ReduceOp::Sum),
            Op::Broadcast => c.broadcast(&mut big, 0),
            Op::Reduce => c.reduce(&mut big, ReduceOp::Sum, 0),
            Op::AllGather => c.all_gather(&small[..per], &mut big),
            Op::ReduceScatter => c.reduce_scatter(&big, &mut small[..per], ReduceOp::Sum),
            Op::AllToAll => {
                let send = std::mem::take(&mut big);
                let mut recv = vec![0.0f32; 0];
                std::mem::swap(&mut recv, &mut small);
                recv.resize(total, 0.0);
                let r = c.all_to_all(&send, &mut recv);
                big = send;
                small = recv;
                r
            }
            Op::Scatter => c.scatter(&big, &mut small[..per], 0),
            Op::Gather => c.gather(&small[..per], &mut big, 0),
        }
    };
    for _ in 0..warmup {
        once()?;
    }
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        c.barrier()?;
        let t = Instant::now();
        once()?;
        times.push(t.elapsed().as_secs_f64());
    }
    c.all_reduce(&mut times, ReduceOp::Max)?;
    Ok(times)
}

fn row(op: Op, bytes: usize, n: usize, mut times: Vec<f64>) -> Row {
    times.sort_by(f64::total_cmp);
    Row {
        op,
        bytes: count_for(op, bytes, n) * 4,
        count: count_for(op, bytes, n),
        median: times.get(times.len() / 2).copied().unwrap_or(f64::NAN),
        min: times.first().copied().unwrap_or(f64::NAN),
        max: times.last().copied().unwrap_or(f64::NAN),
    }
}

fn comm_options(args: &Args) -> anyhow::Result<CommOptions> {
    let algorithm = match args.algorithm.as_str() {
        "auto" => Algorithm::Auto,
        "ring" => Algorithm::Ring,
        "tree" => Algorithm::Tree,
        a => bail!("unknown algorithm {a:?} (auto, ring, tree)"),
    };
    let mut o = CommOptions {
        timeout: Duration::from_secs_f64(args.timeout),
        algorithm,
        ..CommOptions::default()
    };
    if let Some(c) = &args.chunk {
        o.chunk_bytes = parse_size(c)?;
    }
    if let Some(us) = args.spin_us {
        o.spin = Duration::from_micros(us);
    }
    Ok(o)
}

struct Plan {
    ops: Vec<Op>,
    sizes: Vec<usize>,
}

fn plan(args: &Args) -> anyhow::Result<Plan> {
    let ops = args
        .op
        .iter()
        .map(|o| Op::parse(o))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let sizes = args
        .size
        .iter()
        .map(|s| parse_size(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if args.ranks == 0 {
        bail!("--ranks must be at least 1");
    }
    Ok(Plan { ops, sizes })
}

/// Runs every (op, size) of the plan on one rank; rank 0 returns the rows.
fn run_rank(c: &Communicator, plan: &Plan, args: &Args) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &op in &plan.ops {
        for &bytes in &plan.sizes {
            let times = measure(c, op, bytes, args.iters.max(1), args.warmup)
                .with_context(|| format!("rank {}: {} at {}", c.rank(), op.name(), human(bytes)))?;
            rows.push(row(op, bytes, c.size(), times));
        }
    }
    Ok(rows)
}

fn print_table(rows: &[Row], n: usize, transport: &str, placement: &str) {
    println!("# dflow collectives: {n} ranks, {transport}, f32, sum; time = median over iterations of the slowest rank");
    println!("# {placement}");
    println!(
        "{:<15} {:>5} {:>10} {:>11} {:>12} {:>12} {:>12} {:>12}",
        "op", "ranks", "size", "count", "time_us", "min_us", "algbw_GB/s", "busbw_GB/s"
    );
    for r in rows {
        let algbw = r.bytes as f64 / r.median / 1e9;
        println!(
            "{:<15} {:>5} {:>10} {:>11} {:>12.1} {:>12.1} {:>12.3} {:>12.3}",
            r.op.name(),
            n,
            human(r.bytes),
            r.count,
            r.median * 1e6,
            r.min * 1e6,
            algbw,
            algbw * r.op.bus_factor(n)
        );
    }
}

/// Kills and reaps the worker processes however the parent leaves.
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn worker_args(args: &Args, rank: usize, cpu: Option<usize>) -> Vec<String> {
    let mut v = vec![
        "bench-collective".into(),
        "--op".into(),
        args.op.join(","),
        "--ranks".into(),
        args.ranks.to_string(),
        "--size".into(),
        args.size.join(","),
        "--transport".into(),
        args.transport.clone(),
        "--iters".into(),
        args.iters.to_string(),
        "--warmup".into(),
        args.warmup.to_string(),
        "--algorithm".into(),
        args.algorithm.clone(),
        "--timeout".into(),
        args.timeout.to_string(),
        "--worker-rank".into(),
        rank.to_string(),
    ];
    if let Some(c) = &args.chunk {
        v.extend(["--chunk".to_string(), c.clone()]);
    }
    if let Some(us) = args.spin_us {
        v.extend(["--spin-us".to_string(), us.to_string()]);
    }
    if let Some(cpu) = cpu {
        v.extend(["--pin-cpu".to_string(), cpu.to_string()]);
    }
    v
}

/// A worker: binds (TCP) or creates its segment (shm), prints its address, reads everyone's,
/// connects, runs, and (rank 0) prints the rows as `ROW` lines for the parent.
fn run_worker(args: &Args, rank: usize) -> anyhow::Result<()> {
    if let Some(cpu) = args.pin_cpu {
        // A container may forbid changing affinity: measure unpinned rather than not at all,
        // and say so next to the table.
        if let Err(e) = pin_to_cpu(cpu) {
            eprintln!("# rank {rank}: {e:#}; running unpinned");
        }
    }
    let plan = plan(args)?;
    let read_list = || -> anyhow::Result<Vec<String>> {
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line)?;
        Ok(line.split_whitespace().map(str::to_string).collect())
    };
    let pairs: Box<dyn Pairs> = match args.transport.as_str() {
        "shm" => {
            let opts = ShmOptions::default();
            let rv = ShmRendezvous::create(rank, args.ranks, &opts)?;
            println!("ADDR {}", rv.name());
            std::io::stdout().flush()?;
            Box::new(rv.connect(&read_list()?, &opts)?)
        }
        _ => {
            let l = TcpGroupListener::bind("127.0.0.1:0")?;
            println!("ADDR {}", l.local_addr()?);
            std::io::stdout().flush()?;
            let addrs: Vec<SocketAddr> = read_list()?
                .iter()
                .map(|a| {
                    a.parse()
                        .with_context(|| format!("bad address {a:?} from the parent"))
                })
                .collect::<anyhow::Result<_>>()?;
            Box::new(l.connect(rank, &addrs, &TcpOptions::default())?)
        }
    };
    // The parent holds our stdin open until we exit: end with it (no stray ranks burning CPU
    // after the parent was killed).
    std::thread::spawn(|| {
        let mut b = [0u8; 64];
        loop {
            match std::io::stdin().read(&mut b) {
                Ok(0) | Err(_) => std::process::exit(3),
                Ok(_) => {}
            }
        }
    });
    let c = Communicator::new(pairs, comm_options(args)?);
    let rows = run_rank(&c, &plan, args)?;
    if rank == 0 {
        for r in rows {
            println!(
                "ROW {} {} {} {} {} {}",
                r.op.name(),
                r.bytes,
                r.count,
                r.median,
                r.min,
                r.max
            );
        }
    }
    Ok(())
}

fn parse_row(line: &str) -> anyhow::Result<Row> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() != 7 || f[0] != "ROW" {
        bail!("unexpected worker output {line:?}");
    }
    Ok(Row {
        op: Op::parse(f[1])?,
        bytes: f[2].parse()?,
        count: f[3].parse()?,
        median: f[4].parse()?,
        min: f[5].parse()?,
        max: f[6].parse()?,
    })
}

/// Runs every rank as a child process (TCP or shared memory).
fn run_procs(args: &Args) -> anyhow::Result<(Vec<Row>, String)> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let mut workers = Workers(Vec::new());
    let cpus = rank_cpus(args.bind, args.ranks, &super::host_cpus::allowed_cpus()?);
    let bind = args.bind.name();
    let placement = match &cpus {
        Some(c) => format!("ranks pinned to CPUs {c:?} (--bind {bind})"),
        None => format!("ranks not pinned (--bind {bind})"),
    };
    for r in 0..args.ranks {
        let cpu = cpus.as_ref().map(|c| c[r]);
        let child = Command::new(&exe)
            .args(worker_args(args, r, cpu))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting rank {r}"))?;
        workers.0.push(child);
    }
    let mut readers = Vec::new();
    let mut addrs = Vec::new();
    for (r, w) in workers.0.iter_mut().enumerate() {
        let out = w.stdout.take().context("worker stdout")?;
        let mut reader = BufReader::new(out);
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let addr = line
            .strip_prefix("ADDR ")
            .with_context(|| format!("rank {r} did not report its address (it said {line:?})"))?;
        addrs.push(addr.trim().to_string());
        readers.push(reader);
    }
    let list = addrs.join(" ") + "\n";
    // Kept open until the workers exit: a worker ends when its stdin closes (see run_worker).
    let mut stdins = Vec::new();
    for (r, w) in workers.0.iter_mut().enumerate() {
        let mut stdin = w.stdin.take().context("worker stdin")?;
        stdin
            .write_all(list.as_bytes())
            .with_context(|| format!("sending addresses to rank {r}"))?;
        stdins.push(stdin);
    }
    let mut rows = Vec::new();
    let mut first = readers.swap_remove(0);
    let mut line = String::new();
    while first.read_line(&mut line)? > 0 {
        rows.push(parse_row(&line)?);
        line.clear();
    }
    drop(readers);
    for (r, w) in workers.0.iter_mut().enumerate() {
        let status = w.wait()?;
        if !status.success() {
            bail!("rank {r} failed ({status}); its error is above");
        }
    }
    drop(stdins);
    Ok((rows, placement))
}

fn run_inproc(args: &Args) -> anyhow::Result<Vec<Row>> {
    let plan = plan(args)?;
    let comms = Communicator::in_process(args.ranks, comm_options(args)?);
    std::thread::scope(|s| {
        let joins: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let plan = &plan;
                s.spawn(move || run_rank(&c, plan, args))
            })
            .collect();
        let mut first = None;
        for j in joins {
            let r = j.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??;
            first.get_or_insert(r);
        }
        first.context("no ranks")
    })
}

/// The median seconds of one all-reduce (sum, f32) of each of `sizes` bytes over `ranks` child
/// processes on `transport` (`tcp` or `shm`), ranks pinned as `--bind auto` pins them: what
/// `dflow bench calibrate` fits the planner's link constants to.
pub(crate) fn all_reduce_medians(
    transport: &str,
    ranks: usize,
    sizes: &[usize],
    iters: usize,
    warmup: usize,
) -> anyhow::Result<Vec<(usize, f64)>> {
    let args = Args {
        op: vec!["all_reduce".into()],
        ranks,
        size: sizes.iter().map(|s| s.to_string()).collect(),
        transport: transport.into(),
        iters,
        warmup,
        algorithm: "auto".into(),
        chunk: None,
        spin_us: None,
        bind: Bind::Auto,
        timeout: 60.0,
        worker_rank: None,
        pin_cpu: None,
    };
    plan(&args)?;
    let (rows, _) = run_procs(&args)?;
    Ok(rows.iter().map(|r| (r.bytes, r.median)).collect())
}

/// Runs `dflow bench-collective`.
pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(rank) = args.worker_rank {
        return run_worker(&args, rank);
    }
    plan(&args)?;
    let (rows, placement) = match args.transport.as_str() {
        "tcp" | "shm" => run_procs(&args)?,
        "inproc" => (
            run_inproc(&args)?,
            "ranks are threads of this process".into(),
        ),
        t => bail!("unknown transport {t:?} (tcp, shm, inproc)"),
    };
    print_table(&rows, args.ranks, &args.transport, &placement);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_bus_factors() {
        assert_eq!(parse_size("4B").unwrap(), 4);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("4XB").is_err());
        assert!(parse_size("18446744073709551615GiB").is_err());
        assert_eq!(Op::AllReduce.bus_factor(4), 1.5);
        assert_eq!(Op::AllGather.bus_factor(4), 0.75);
        assert_eq!(Op::Broadcast.bus_factor(4), 1.0);
        assert_eq!(Op::AllToAll.bus_factor(2), 0.5);
    }

    #[test]
    fn binding_follows_mpirun_by_default() {
        let cpus = [0, 1];
        assert_eq!(rank_cpus(Bind::Auto, 2, &cpus), Some(vec![0, 1]));
        assert_eq!(rank_cpus(Bind::Auto, 4, &cpus), None);
        assert_eq!(rank_cpus(Bind::Core, 4, &cpus), Some(vec![0, 1, 0, 1]));
        assert_eq!(rank_cpus(Bind::None, 2, &cpus), None);
        assert_eq!(rank_cpus(Bind::Core, 3, &[2, 5]), Some(vec![2, 5, 2]));
        assert!(!super::super::host_cpus::allowed_cpus().unwrap().is_empty());
    }

    #[test]
    fn an_impossible_cpu_is_an_error_not_a_panic() {
        let e = pin_to_cpu(usize::MAX).unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
    }
}
