//! Running the real `dflow` binary from tests: one-shot commands (`dflow`, `stdout`, `scratch`)
//! and the tasks of a job started as processes on 127.0.0.1, bounded in time.
#![allow(dead_code)] // each test binary uses a different part

pub mod clipped_gpt;

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One multi-process test at a time per test binary: each starts several processes, and the
/// CI machine has two cores.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `dflow ARGS` from the repository root and returns its output.
pub fn dflow(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap()
}

/// The stdout of a run that must have succeeded (its stderr in the panic otherwise).
pub fn stdout(o: &std::process::Output) -> String {
    assert!(
        o.status.success(),
        "dflow failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// A fresh scratch directory `NAME-PID` under the target dir. The first call of a test binary
/// also removes the scratch directories of test binaries that have exited (their `PID` is no
/// longer a process), so they do not pile up run after run.
pub fn scratch(name: &str) -> PathBuf {
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(sweep_exited_scratch);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Removes the `NAME-PID` scratch directories whose `PID` has exited (Linux: no
/// `/proc/PID`); a live process's (another test binary running now) are kept.
fn sweep_exited_scratch() {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(env!("CARGO_TARGET_TMPDIR")) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.rsplit_once('-'))
            .and_then(|(_, pid)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if entry.path().is_dir() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// `n` ports that were free a moment ago.
pub fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// A cluster spec file with `ps` ps tasks and `workers` workers on fresh local ports.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub file: PathBuf,
    pub ps: Vec<u16>,
    pub workers: Vec<u16>,
}

impl Cluster {
    pub fn new(ps: usize, workers: usize) -> Cluster {
        let ports = free_ports(ps + workers);
        let (p, w) = ports.split_at(ps);
        let addrs = |ports: &[u16]| -> Vec<String> {
            ports.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect()
        };
        let json = if ps == 0 {
            format!("{{\"worker\": [{}]}}", addrs(w).join(", "))
        } else {
            format!(
                "{{\"ps\": [{}], \"worker\": [{}]}}",
                addrs(p).join(", "),
                addrs(w).join(", ")
            )
        };
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cluster.json");
        std::fs::write(&file, json).unwrap();
        Cluster {
            dir,
            file,
            ps: p.to_vec(),
            workers: w.to_vec(),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// Every variable a launcher gives a task its identity with (and the cluster secret).
pub const LAUNCHER_VARS: &[&str] = &[
    "TF_CONFIG",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PET_NNODES",
    "PET_NODE_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "DFLOW_SECRET",
];

/// A running task; killed when dropped.
pub struct Task {
    pub name: String,
    child: Child,
    stderr_file: PathBuf,
    stdout_file: PathBuf,
}

impl Drop for Task {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The end of a task: exit status and its output.
#[derive(Debug)]
pub struct Ended {
    pub name: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

fn read(path: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = std::fs::File::open(path) {
        let _ = f.read_to_string(&mut s);
    }
    s
}

impl Task {
    /// Starts `dflow run --job JOB --index I --cluster FILE EXTRA...` from the repository root.
    pub fn start(cluster: &Cluster, job: &str, index: usize, extra: &[&str]) -> Task {
        Task::start_with_env(cluster, job, index, extra, &[])
    }

    pub fn start_with_env(
        cluster: &Cluster,
        job: &str,
        index: usize,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Task {
        let name = format!("{job}-{index}");
        let stdout_file = cluster.path(&format!("{name}.stdout"));
        let stderr_file = cluster.path(&format!("{name}.stderr"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflow"));
        cmd.args([
            "run",
            "--job",
            job,
            "--index",
            &index.to_string(),
            "--cluster",
        ])
        .arg(&cluster.file)
        .args(extra)
        .current_dir(repo())
        .env_remove("TF_CONFIG")
        .env_remove("DFLOW_SECRET")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout_file).unwrap())
        .stderr(std::fs::File::create(&stderr_file).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap();
        Task {
            name,
            child,
            stderr_file,
            stdout_file,
        }
    }

    /// Starts `dflow run EXTRA...` with the task given by `TF_CONFIG` instead of flags.
    pub fn start_tf_config(cluster: &Cluster, job: &str, index: usize, extra: &[&str]) -> Task {
        let spec = std::fs::read_to_string(&cluster.file).unwrap();
        let tf_config = format!(
            "{{\"cluster\": {spec}, \"task\": {{\"type\": \"{job}\", \"index\": {index}}}}}"
        );
        let name = format!("{job}-{index}");
        let stdout_file = cluster.path(&format!("{name}.stdout"));
        let stderr_file = cluster.path(&format!("{name}.stderr"));
        let child = Command::new(env!("CARGO_BIN_EXE_dflow"))
            .arg("run")
            .args(extra)
            .current_dir(repo())
            .env("TF_CONFIG", tf_config)
            .env_remove("DFLOW_SECRET")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout_file).unwrap())
            .stderr(std::fs::File::create(&stderr_file).unwrap())
            .spawn()
            .unwrap();
        Task {
            name,
            child,
            stderr_file,
            stdout_file,
        }
    }

    /// Starts `dflow ARGS` from the repository root with its identity given only by `env`
    /// (every launcher's identity variable is removed first); output goes to DIR/NAME.*.
    pub fn start_with_identity(
        dir: &Path,
        name: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Task {
        let stdout_file = dir.join(format!("{name}.stdout"));
        let stderr_file = dir.join(format!("{name}.stderr"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflow"));
        cmd.args(args).current_dir(repo()).stdin(Stdio::null());
        for var in LAUNCHER_VARS {
            cmd.env_remove(var);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .stdout(std::fs::File::create(&stdout_file).unwrap())
            .stderr(std::fs::File::create(&stderr_file).unwrap())
            .spawn()
            .unwrap();
        Task {
            name: name.to_string(),
            child,
            stderr_file,
            stdout_file,
        }
    }

    pub fn stderr(&self) -> String {
        read(&self.stderr_file)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stdout(&self) -> String {
        read(&self.stdout_file)
    }

    /// Waits at most `limit` for the task to exit; panics with its output otherwise.
    pub fn wait(mut self, limit: Duration) -> Ended {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Ended {
                    name: self.name.clone(),
                    status,
                    stdout: self.stdout(),
                    stderr: self.stderr(),
                };
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                panic!(
                    "{} did not exit within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                    self.name,
                    self.stdout(),
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the task now (SIGKILL: no chance to say goodbye).
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits until `pred` holds for the task's stderr, at most `limit`.
    pub fn wait_for_stderr(&self, limit: Duration, pred: impl Fn(&str) -> bool) {
        self.wait_until(limit, "the expected output", || pred(&self.stderr()));
    }

    /// Waits until `done()` holds, polling every 20 ms for at most `limit`; panics naming
    /// `what` with this task's stderr otherwise.
    pub fn wait_until(&self, limit: Duration, what: &str, done: impl Fn() -> bool) {
        let start = Instant::now();
        while start.elapsed() < limit {
            if done() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "{}: {what} did not appear within {limit:?}; stderr:\n{}",
            self.name,
            self.stderr()
        );
    }
}

impl Ended {
    pub fn assert_success(&self) {
        assert!(
            self.status.success(),
            "{} failed ({}):\nstdout:\n{}\nstderr:\n{}",
            self.name,
            self.status,
            self.stdout,
            self.stderr
        );
    }

    pub fn assert_failure_naming(&self, what: &str) {
        assert!(
            !self.status.success(),
            "{} should have failed:\n{}",
            self.name,
            self.stderr
        );
        assert!(
            self.stderr.contains(what),
            "{}'s error should name {what}:\n{}",
            self.name,
            self.stderr
        );
    }

    /// The `held-out NAME: VALUE` line's value.
    pub fn held_out(&self, name: &str) -> f64 {
        let prefix = format!("held-out {name}: ");
        self.stdout
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no `{prefix}` line in:\n{}", self.stdout))
    }
}

/// What one task says it held and sent at the end of a job (its line
/// `<task>: holds K variables, B bytes; step tensors peaked at P bytes; sent N B in V values over
/// the data plane, M B in J collective messages`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndOfTask {
    pub task: String,
    /// Bytes of its variable stores (parameters and optimizer state).
    pub variable_bytes: u64,
    /// The most bytes of step tensors it held at once.
    pub peak: u64,
    /// Payload bytes of values sent to other tasks' Recvs.
    pub data_plane: u64,
    /// Payload bytes sent in collectives, and in how many messages.
    pub collective: u64,
    pub collective_messages: u64,
}

/// Every end-of-task line in `stderr` (see [`EndOfTask`]).
pub fn end_of_task(stderr: &str) -> Vec<EndOfTask> {
    stderr
        .lines()
        .filter_map(|l| {
            let (task, rest) = l.split_once(": holds ")?;
            let words: Vec<&str> = rest
                .split(|c: char| c.is_whitespace() || c == ',' || c == ';')
                .filter(|w| !w.is_empty())
                .collect();
            // K variables B bytes step tensors peaked at P bytes sent N B in V values over the
            // data plane M B in J collective messages
            let n = |i: usize| words.get(i).and_then(|w| w.parse().ok());
            Some(EndOfTask {
                task: task.to_string(),
                variable_bytes: n(2)?,
                peak: n(8)?,
                data_plane: n(11)?,
                collective: n(20)?,
                collective_messages: n(23)?,
            })
        })
        .collect()
}

/// `workers` worker processes on 127.0.0.1 running `graph` with `flags` (every task gets them;
/// the chief also writes `--losses-out` and checkpoints to, and resumes from, `ckpt`). Asserts
/// every task ended well; returns the chief's losses and its end.
pub fn worker_job(
    graph: &Path,
    workers: usize,
    flags: &[String],
    ckpt: &Path,
) -> (Vec<(u64, f64)>, Ended) {
    let cluster = Cluster::new(0, workers);
    let losses = cluster.path("losses.txt");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let tasks: Vec<Task> = (1..workers)
        .map(|i| Task::start(&cluster, "worker", i, &flags))
        .collect();
    let (graph_s, losses_s, ckpt_s) = (
        graph.to_string_lossy().into_owned(),
        losses.to_string_lossy().into_owned(),
        ckpt.to_string_lossy().into_owned(),
    );
    let mut chief_args = vec![graph_s.as_str()];
    chief_args.extend(flags.iter().copied());
    chief_args.extend(["--losses-out", &losses_s, "--checkpoint-dir", &ckpt_s]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(Duration::from_secs(300));
    chief.assert_success();
    for t in tasks {
        t.wait(Duration::from_secs(30)).assert_success();
    }
    (read_losses(&losses), chief)
}

/// The training flags every digits task gets.
pub fn digits_args(epochs: u32) -> Vec<String> {
    vec![
        "--data".into(),
        "examples/data/digits.csv.gz".into(),
        "--epochs".into(),
        epochs.to_string(),
        "--quiet".into(),
    ]
}

/// Runs the digits training in one process (`--local`) and returns its `--losses-out` losses
/// and its held-out accuracy.
pub fn local_digits_run(epochs: u32, dir: &Path) -> (Vec<(u64, f64)>, f64) {
    let losses = dir.join("local-losses.txt");
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args([
            "run",
            "--local",
            "examples/digits/digits.json",
            "--data",
            "examples/data/digits.csv.gz",
            "--epochs",
            &epochs.to_string(),
            "--quiet",
            "--losses-out",
        ])
        .arg(&losses)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let accuracy = stdout
        .lines()
        .find_map(|l| l.strip_prefix("held-out accuracy: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in:\n{stdout}"));
    (read_losses(&losses), accuracy)
}

/// Asserts two loss curves are the same steps with losses equal within `tol` (relative).
pub fn assert_same_losses(dist: &[(u64, f64)], local: &[(u64, f64)], tol: f64) -> f64 {
    assert_eq!(dist.len(), local.len(), "same number of steps");
    let mut worst = 0.0f64;
    for ((s1, a), (s2, b)) in dist.iter().zip(local) {
        assert_eq!(s1, s2);
        let err = (a - b).abs() / b.abs().max(1e-3);
        worst = worst.max(err);
        assert!(err <= tol, "step {s1}: distributed loss {a}, local {b}");
    }
    worst
}

/// Parses a `--losses-out` file: `(step, loss)` per line.
pub fn read_losses(path: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let (s, v) = l.split_once(' ').unwrap();
            (s.parse().unwrap(), v.parse().unwrap())
        })
        .collect()
}

/// A GPT of `n_layer` blocks (context 16, 32 channels, 2 heads) over the bundled corpus's
/// characters, with a short lr schedule, written as JSON to `dir/gpt-<n_layer>.json`.
pub fn small_gpt(dir: &Path, n_layer: usize) -> PathBuf {
    use dflow::graph::layers::{gpt, GptConfig};
    let cfg = GptConfig {
        block_size: 16,
        n_layer,
        n_head: 2,
        n_embd: 32,
        learning_rate: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 2,
        decay_steps: 20,
        ..GptConfig::default()
    };
    let path = dir.join(format!("gpt-{n_layer}.json"));
    std::fs::write(
        &path,
        dflow::graph::format::to_json(&gpt(&cfg).unwrap().def),
    )
    .unwrap();
    path
}

/// `dflow run --local GRAPH` on the bundled Shakespeare for `steps` steps of a global batch of 8
/// with `extra` flags (a cluster and a mesh or strategy, or none: one process), one evaluation
/// batch, checkpointing to (and resuming from) `ckpt`: its losses and its final validation
/// line (`validation loss: …`; the MoE tests' job).
pub fn run_text_local(
    graph: &Path,
    extra: &[&str],
    steps: u32,
    ckpt: &Path,
) -> (Vec<(u64, f64)>, String) {
    let losses = ckpt.with_extension(format!("losses-{steps}.txt"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(["run", "--local"])
        .arg(graph)
        .args(extra)
        .args([
            "--data",
            "examples/data/shakespeare.txt.gz",
            "--batch-size",
            "8",
            "--eval-batches",
            "1",
            "--quiet",
            "--steps",
        ])
        .arg(steps.to_string())
        .arg("--checkpoint-dir")
        .arg(ckpt)
        .arg("--losses-out")
        .arg(&losses)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{extra:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let validation = stdout
        .lines()
        .find(|l| l.starts_with("validation loss: "))
        .unwrap_or_default()
        .to_string();
    (read_losses(&losses), validation)
}

/// The latest checkpoint in `dir`: its f32 tensors by name.
pub fn checkpoint_f32(dir: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let path = dflow::executor::checkpoint::latest(dir)
        .unwrap()
        .expect("a checkpoint");
    dflow::executor::checkpoint::load(&path)
        .unwrap()
        .tensors
        .into_iter()
        .filter_map(|(n, t)| Some((n, t.as_slice::<f32>().ok()?.to_vec())))
        .collect()
}

/// Every tensor of `got` equals `want`'s within `tol` (relative, or absolute below 1), the same
/// names and sizes; `what` names the comparison in a failure. Returns the worst difference.
pub fn assert_same_tensors_f32(
    what: &str,
    got: &std::collections::BTreeMap<String, Vec<f32>>,
    want: &std::collections::BTreeMap<String, Vec<f32>>,
    tol: f32,
) -> f32 {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: the checkpoints' tensors"
    );
    let mut worst = 0.0f32;
    for (name, w) in want {
        let g = &got[name];
        assert_eq!(g.len(), w.len(), "{what} `{name}`");
        for (a, b) in g.iter().zip(w) {
            let gap = (a - b).abs() / b.abs().max(1.0);
            assert!(gap <= tol, "{what} `{name}`: {a} vs {b}");
            worst = worst.max(gap);
        }
    }
    worst
}
