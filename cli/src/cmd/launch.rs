//! `dflow launch`: one command starts every task of a job on this machine, as a launcher on a
//! cluster would, and gives each its identity through the same environment variables:
//!
//! - `--ps P --workers W`: `TF_CONFIG` per task (the Kubeflow TFJob operator's variable), on
//!   free 127.0.0.1 ports; parameter-server training (all-reduce when P is 0).
//! - `--nproc N`: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//!   `MASTER_PORT` (torchrun's variables, as `torchrun --standalone`); the ranks register with
//!   rank 0 and train with all-reduce.
//!
//! Every output line of a task is prefixed with its name (`[worker 0] ...`). SIGINT and
//! SIGTERM are forwarded to every task. When a task fails, the others are stopped (SIGTERM,
//! then SIGKILL after `--grace`) and `dflow launch` exits with the failed task's code, naming it.

use super::transport_choice::TransportChoice;
use anyhow::{bail, Context};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Arguments of `dflow launch`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  dflow launch --ps 1 --workers 2 -- run examples/digits/digits.json --data examples/data/digits.csv.gz\n  dflow launch --nproc 2 -- run examples/digits/digits.json --data examples/data/digits.csv.gz"
)]
pub struct Args {
    /// Parameter-server tasks (with --workers); each task gets a TF_CONFIG.
    #[arg(long, requires = "workers", conflicts_with = "nproc")]
    pub ps: Option<u32>,
    /// Worker tasks; worker 0 is the chief. Without --ps (or with --ps 0), all-reduce.
    #[arg(long, conflicts_with = "nproc")]
    pub workers: Option<u32>,
    /// All-reduce over N processes that get torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    /// MASTER_ADDR, MASTER_PORT) and register with rank 0.
    #[arg(long, value_name = "N")]
    pub nproc: Option<u32>,
    /// The transport between the tasks (added to every task's command): tcp, shm, quic, or
    /// auto (shm: every task is on this host).
    #[arg(long, value_parser = |s: &str| s.parse::<TransportChoice>())]
    pub transport: Option<TransportChoice>,
    /// --nproc: the port rank 0 accepts registrations on (default: a free port).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Seconds the other tasks get to exit after a failure or a signal before they are killed.
    #[arg(long, default_value_t = 10)]
    pub grace: u64,
    /// An elastic job (all-reduce or sync ps): passes `--min-workers K` to every task, and a worker other
    /// than the chief that fails does not stop the others (the chief goes on without it while
    /// at least K workers remain; the run command needs --checkpoint-dir).
    #[arg(long, value_name = "K")]
    pub min_workers: Option<u32>,
    /// The command every task runs: `run GRAPH [run flags]` (the chief, worker 0, uses GRAPH;
    /// the others join the job).
    #[arg(last = true, required = true, value_name = "run GRAPH [FLAGS]")]
    pub command: Vec<String>,
}

/// One process of the local job: its name, extra arguments and identity variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskSpec {
    /// `worker 0`, `ps 1`, `rank 2` (the prefix of its output lines).
    pub name: String,
    /// The dflow arguments (`run GRAPH ...`).
    pub args: Vec<String>,
    /// The identity variables it gets.
    pub env: Vec<(String, String)>,
}

/// Every launcher's identity variable, removed from the tasks' environment so that only the
/// ones `dflow launch` sets are seen (it may itself run inside a Slurm allocation).
const IDENTITY_VARS: &[&str] = &[
    "TF_CONFIG",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_NPROC_PER_NODE",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
];

/// `n` distinct ports on 127.0.0.1 that were free a moment ago.
fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()
        .context("finding free ports on 127.0.0.1")?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// The tasks of the job `args` describes, with `ports` for the cluster (PS form: one per task;
/// --nproc: one, rank 0's registration port).
pub fn plan(args: &Args, ports: &[u16]) -> anyhow::Result<Vec<TaskSpec>> {
    if args.command.first().map(String::as_str) != Some("run") {
        bail!(
            "dflow launch starts `dflow run`: write `dflow launch ... -- run GRAPH [run flags]`, got `{}`",
            args.command.join(" ")
        );
    }
    for flag in ["--job", "--index", "--cluster", "--local"] {
        if args
            .command
            .iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
        {
            bail!("dflow launch gives every task its identity; drop {flag} from the run command");
        }
    }
    let mut command = args.command.clone();
    if let Some(t) = args.transport {
        if command
            .iter()
            .any(|a| a == "--transport" || a.starts_with("--transport="))
        {
            bail!("--transport is given twice: to dflow launch and in the run command");
        }
        // Every task runs on this host, so `auto` is shared memory.
        let t = match t {
            TransportChoice::Auto => "shm".to_string(),
            TransportChoice::Kind(kind) => kind.to_string(),
        };
        command.extend(["--transport".to_string(), t]);
    }
    if let Some(k) = args.min_workers {
        if command
            .iter()
            .any(|a| a == "--min-workers" || a.starts_with("--min-workers="))
        {
            bail!("--min-workers is given twice: to dflow launch and in the run command");
        }
        command.extend(["--min-workers".to_string(), k.to_string()]);
    }
    let mut tasks = Vec::new();
    match (args.nproc, args.workers) {
        (Some(n), _) => {
            if n == 0 {
                bail!("--nproc must be at least 1");
            }
            let port = ports.first().context("no port for rank 0")?;
            for rank in 0..n {
                let env = [
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", n.to_string()),
                    ("LOCAL_RANK", rank.to_string()),
                    ("LOCAL_WORLD_SIZE", n.to_string()),
                    ("MASTER_ADDR", "127.0.0.1".to_string()),
                    ("MASTER_PORT", port.to_string()),
                ];
                tasks.push(TaskSpec {
                    name: format!("worker {rank}"),
                    args: command.clone(),
                    env: env.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                });
            }
        }
        (None, Some(workers)) => {
            let ps = args.ps.unwrap_or(0);
            if workers == 0 {
                bail!("--workers must be at least 1 (worker 0 is the chief)");
            }
            let total = (ps + workers) as usize;
            if ports.len() < total {
                bail!("{total} tasks need {total} ports, got {}", ports.len());
            }
            let addr = |p: &u16| format!("127.0.0.1:{p}");
            let mut cluster = serde_json::Map::new();
            if ps > 0 {
                cluster.insert("ps".into(), ports[..ps as usize].iter().map(addr).collect());
            }
            cluster.insert(
                "worker".into(),
                ports[ps as usize..total].iter().map(addr).collect(),
            );
            let roles = (0..ps)
                .map(|i| ("ps", i))
                .chain((0..workers).map(|i| ("worker", i)));
            for (job, index) in roles {
                let tf_config = serde_json::json!({
                    "cluster": cluster,
                    "task": {"type": job, "index": index},
                });
                tasks.push(TaskSpec {
                    name: format!("{job} {index}"),
                    args: command.clone(),
                    env: vec![("TF_CONFIG".to_string(), tf_config.to_string())],
                });
            }
        }
        (None, None) => bail!(
            "say how many tasks: --ps P --workers W (parameter server) or --nproc N (all-reduce)"
        ),
    }
    Ok(tasks)
}

/// The chief's task name (under `--workers` and under `--nproc` alike).
const CHIEF: &str = "worker 0";

/// A task that failed, for the exit code.
#[derive(Debug)]
struct Failure {
    task: String,
    code: u8,
    how: String,
}

/// The exit code of a status: its code, or 128 + the signal that killed it.
fn exit_code(status: &ExitStatus) -> (u8, String) {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        return (
            u8::try_from(code).unwrap_or(1).max(1),
            format!("exit code {code}"),
        );
    }
    let sig = status.signal().unwrap_or(0);
    (
        128u8.saturating_add(u8::try_from(sig).unwrap_or(0)),
        format!("killed by signal {sig}"),
    )
}

/// Copies `from` line by line to stdout or stderr, each line prefixed with `[name] `.
fn pump(
    from: impl Read + Send + 'static,
    name: String,
    to_stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            let mut out: Box<dyn Write> = if to_stderr {
                Box::new(std::io::stderr().lock())
            } else {
                Box::new(std::io::stdout().lock())
            };
            let _ = out.write_all(format!("[{name}] ").as_bytes());
            let _ = out.write_all(&line);
            let _ = out.flush();
        }
    })
}

fn signal(child: &Child, sig: rustix::process::Signal) {
    let pid = i32::try_from(child.id())
        .ok()
        .and_then(rustix::process::Pid::from_raw);
    if let Some(pid) = pid {
        let _ = rustix::process::kill_process(pid, sig);
    }
}

struct Running {
    name: String,
    child: Child,
    done: bool,
}

/// Stops every running task: `sig`, then SIGKILL for those still there after `grace`.
fn stop_all(tasks: &mut [Running], sig: rustix::process::Signal, grace: Duration) {
    for t in tasks.iter().filter(|t| !t.done) {
        signal(&t.child, sig);
    }
    let start = Instant::now();
    while start.elapsed() < grace {
        let mut all = true;
        for t in tasks.iter_mut().filter(|t| !t.done) {
            match t.child.try_wait() {
                Ok(Some(_)) | Err(_) => t.done = true,
                Ok(None) => all = false,
            }
        }
        if all {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for t in tasks.iter_mut().filter(|t| !t.done) {
        eprintln!(
            "dflow launch: {} did not stop within {} s; killing it",
            t.name,
            grace.as_secs()
        );
        let _ = t.child.kill();
        let _ = t.child.wait();
        t.done = true;
    }
}

/// Runs `dflow launch`; the exit code is 0, the first failed task's, or 128 + a signal.
pub fn main(args: Args) -> ExitCode {
    match launch(&args) {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(f)) => {
            eprintln!(
                "dflow launch: {} failed ({}); the other tasks were stopped",
                f.task, f.how
            );
            ExitCode::from(f.code)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn launch(args: &Args) -> anyhow::Result<Option<Failure>> {
    let ports = match (args.nproc, args.master_port) {
        (Some(_), Some(p)) => vec![p],
        (Some(_), None) => free_ports(1)?,
        (None, _) => free_ports((args.ps.unwrap_or(0) + args.workers.unwrap_or(0)) as usize)?,
    };
    let specs = plan(args, &ports)?;
    let exe = std::env::current_exe().context("finding the dflow executable")?;
    let got = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_usize(sig, got.clone(), sig as usize)
            .context("installing the signal handlers")?;
    }
    let grace = Duration::from_secs(args.grace);
    let mut tasks: Vec<Running> = Vec::new();
    let mut pumps = Vec::new();
    for spec in &specs {
        let mut cmd = Command::new(&exe);
        cmd.args(&spec.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for v in IDENTITY_VARS {
            cmd.env_remove(v);
        }
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut tasks, rustix::process::Signal::TERM, grace);
                bail!("cannot start {}: {e}", spec.name);
            }
        };
        eprintln!("dflow launch: started {} (pid {})", spec.name, child.id());
        if let Some(out) = child.stdout.take() {
            pumps.push(pump(out, spec.name.clone(), false));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(pump(err, spec.name.clone(), true));
        }
        tasks.push(Running {
            name: spec.name.clone(),
            child,
            done: false,
        });
    }
    let failure = loop {
        let sig = got.swap(0, Ordering::SeqCst);
        if sig != 0 {
            let (forward, name) = if sig == signal_hook::consts::SIGINT as usize {
                (rustix::process::Signal::INT, "SIGINT")
            } else {
                (rustix::process::Signal::TERM, "SIGTERM")
            };
            eprintln!("dflow launch: got {name}; forwarding it to every task");
            stop_all(&mut tasks, forward, grace);
            break Some(Failure {
                task: "dflow launch".into(),
                code: 128u8.saturating_add(u8::try_from(sig).unwrap_or(0)),
                how: format!("interrupted by {name}"),
            });
        }
        let mut failed: Vec<(usize, ExitStatus)> = Vec::new();
        for (i, t) in tasks.iter_mut().enumerate().filter(|(_, t)| !t.done) {
            match t.child.try_wait() {
                Ok(Some(status)) => {
                    t.done = true;
                    if !status.success() {
                        failed.push((i, status));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("dflow launch: cannot watch {}: {e}", t.name);
                    t.done = true;
                }
            }
        }
        // Several seen at once: one killed by a signal is the cause, the others noticed it.
        failed.sort_by_key(|(i, s)| (s.code().is_some(), *i));
        if let Some(k) = args.min_workers {
            // An elastic job: the chief decides whether it goes on without a lost worker.
            failed.retain(|(i, status)| {
                let name = &tasks[*i].name;
                let worker = name.starts_with("worker ") && name != CHIEF;
                if worker {
                    let (_, how) = exit_code(status);
                    eprintln!("dflow launch: {name} failed ({how}); the elastic job goes on without it if at least {k} workers remain (--min-workers {k})");
                }
                !worker
            });
        }
        if let Some((i, status)) = failed.first() {
            let (code, how) = exit_code(status);
            let task = tasks[*i].name.clone();
            eprintln!("dflow launch: {task} failed ({how}); stopping the other tasks");
            stop_all(&mut tasks, rustix::process::Signal::TERM, grace);
            break Some(Failure { task, code, how });
        }
        if tasks.iter().all(|t| t.done) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for p in pumps {
        let _ = p.join();
    }
    Ok(failure)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn args(line: &[&str]) -> Args {
        Cli::try_parse_from(std::iter::once("launch").chain(line.iter().copied()))
            .unwrap()
            .args
    }

    #[test]
    fn ps_jobs_get_one_tf_config_per_task() {
        let a = args(&[
            "--ps",
            "1",
            "--workers",
            "2",
            "--transport",
            "auto",
            "--",
            "run",
            "g.json",
        ]);
        let tasks = plan(&a, &[7000, 7001, 7002]).unwrap();
        let names: Vec<&str> = tasks.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["ps 0", "worker 0", "worker 1"]);
        let w1: serde_json::Value = serde_json::from_str(&tasks[2].env[0].1).unwrap();
        assert_eq!(
            w1,
            serde_json::json!({"cluster": {"ps": ["127.0.0.1:7000"], "worker": ["127.0.0.1:7001", "127.0.0.1:7002"]}, "task": {"type": "worker", "index": 1}})
        );
        assert_eq!(tasks[0].args, ["run", "g.json", "--transport", "shm"]);
        // What a task reads back is what was meant.
        let id = dflow::identity::tf_config::parse(&tasks[2].env[0].1).unwrap();
        assert!(
            matches!(id.place, dflow::identity::Place::Task { ref job, index: 1, .. } if job == "worker")
        );
    }

    #[test]
    fn nproc_jobs_get_torchrun_variables() {
        let a = args(&["--nproc", "3", "--", "run", "g.json", "--epochs", "2"]);
        let tasks = plan(&a, &[29500]).unwrap();
        assert_eq!(tasks.len(), 3);
        let env: std::collections::BTreeMap<_, _> = tasks[2].env.iter().cloned().collect();
        assert_eq!(env["RANK"], "2");
        assert_eq!(env["WORLD_SIZE"], "3");
        assert_eq!(env["LOCAL_RANK"], "2");
        assert_eq!(env["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(env["MASTER_PORT"], "29500");
        let lookup = |k: &str| env.get(k).cloned();
        let id = dflow::identity::from_env(&lookup).unwrap().unwrap();
        assert_eq!(id.source, dflow::identity::Source::Torchrun);
    }

    #[test]
    fn min_workers_reaches_every_task() {
        let tasks = plan(
            &args(&["--nproc", "3", "--min-workers", "2", "--", "run", "g.json"]),
            &[1],
        )
        .unwrap();
        for t in &tasks {
            assert_eq!(
                t.args,
                ["run", "g.json", "--min-workers", "2"],
                "{}",
                t.name
            );
        }
    }

    #[test]
    fn commands_that_cannot_work_are_refused() {
        let e = plan(&args(&["--nproc", "2", "--", "check", "g.json"]), &[1]).unwrap_err();
        assert!(e.to_string().contains("-- run GRAPH"), "{e}");
        let e = plan(&args(&["--nproc", "2", "--", "run", "--job", "ps"]), &[1]).unwrap_err();
        assert!(e.to_string().contains("drop --job"), "{e}");
        let e = plan(&args(&["--nproc", "0", "--", "run"]), &[1]).unwrap_err();
        assert!(e.to_string().contains("at least 1"), "{e}");
        let e = plan(&args(&["--", "run"]), &[]).unwrap_err();
        assert!(e.to_string().contains("--nproc N"), "{e}");
        let e = plan(
            &args(&[
                "--nproc",
                "1",
                "--transport",
                "tcp",
                "--",
                "run",
                "--transport",
                "shm",
            ]),
            &[1],
        )
        .unwrap_err();
        assert!(e.to_string().contains("given twice"), "{e}");
        let e = plan(
            &args(&[
                "--nproc",
                "2",
                "--min-workers",
                "1",
                "--",
                "run",
                "--min-workers",
                "2",
            ]),
            &[1],
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("--min-workers is given twice"),
            "{e}"
        );
        assert!(
            Cli::try_parse_from(["launch", "--nproc", "2", "--workers", "1", "--", "run"]).is_err()
        );
    }
}
