//! `dflow launch`: the README's parameter-server and all-reduce jobs in one command, output
//! prefixed per task, a killed task named in the exit, and SIGTERM forwarded to every task.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::*;

const LIMIT: Duration = Duration::from_secs(240);

/// A running `dflow launch` whose stderr is collected as it arrives.
struct Launch {
    child: Child,
    stderr: Arc<Mutex<String>>,
    stdout: Arc<Mutex<String>>,
}

impl Drop for Launch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn collect(from: impl std::io::Read + Send + 'static) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let sink = text.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            let mut s = sink.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    });
    text
}

impl Launch {
    fn start(args: &[&str]) -> Launch {
        Launch::start_with_env(args, &[])
    }

    fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Launch {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflow"));
        cmd.arg("launch").args(args).current_dir(repo());
        for var in LAUNCHER_VARS {
            cmd.env_remove(var);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = collect(child.stdout.take().unwrap());
        let stderr = collect(child.stderr.take().unwrap());
        Launch {
            child,
            stderr,
            stdout,
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Waits until stderr holds `what`, at most `limit`.
    fn wait_for(&self, what: &str, limit: Duration) {
        let start = Instant::now();
        while !self.stderr().contains(what) {
            assert!(
                start.elapsed() < limit,
                "`{what}` did not appear within {limit:?}:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pid `dflow launch` reported for `task`.
    fn pid_of(&self, task: &str) -> u32 {
        let prefix = format!("dflow launch: started {task} (pid ");
        self.stderr()
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.trim_end_matches(')').parse().ok())
            .unwrap_or_else(|| panic!("no pid for {task}:\n{}", self.stderr()))
    }

    /// Waits for the exit (at most `limit`); returns (code, stdout, stderr).
    fn wait(mut self, limit: Duration) -> (Option<i32>, String, String) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the collectors drain the pipes.
                std::thread::sleep(Duration::from_millis(200));
                let out = self.stdout.lock().unwrap().clone();
                return (status.code(), out, self.stderr());
            }
            assert!(
                start.elapsed() < limit,
                "dflow launch did not exit within {limit:?}:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn accuracy(stdout: &str) -> f64 {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("[worker 0] held-out accuracy: "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `[worker 0] held-out accuracy` line in:\n{stdout}"))
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.contains(") Z "))
            .unwrap_or(true)
}

#[test]
fn launch_runs_the_readme_parameter_server_job() {
    let _serial = serial();
    let run = Launch::start(&[
        "--ps",
        "1",
        "--workers",
        "2",
        "--",
        "run",
        "examples/digits/digits.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--quiet",
    ]);
    let (code, stdout, stderr) = run.wait(LIMIT);
    assert_eq!(code, Some(0), "{stderr}");
    let acc = accuracy(&stdout);
    assert!(acc >= 0.93, "held-out accuracy {acc}");
    for task in ["ps 0", "worker 0", "worker 1"] {
        assert!(
            stderr.contains(&format!("[{task}] dflow: identity from TF_CONFIG")),
            "{stderr}"
        );
        assert!(stderr.contains(&format!("[{task}] /job:")), "{stderr}");
    }
    assert!(stderr.contains("[worker 0] chief: every task joined; sync parameter-server training with 2 worker(s) and 1 ps task(s)"), "{stderr}");
}

#[test]
fn launch_runs_the_readme_all_reduce_job_with_a_cluster_secret() {
    let _serial = serial();
    // The tasks inherit DFLOW_SECRET: registration and the data plane are authenticated.
    let secret = [("DFLOW_SECRET", "launch-test-secret-0123456789")];
    let args = [
        "--nproc",
        "2",
        "--transport",
        "auto",
        "--",
        "run",
        "examples/digits/digits.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--quiet",
    ];
    let run = Launch::start_with_env(&args, &secret);
    let (code, stdout, stderr) = run.wait(LIMIT);
    assert_eq!(code, Some(0), "{stderr}");
    let acc = accuracy(&stdout);
    assert!(acc >= 0.93, "held-out accuracy {acc}");
    assert!(
        stderr.contains("[worker 1] rank 1: registered with rank 0"),
        "{stderr}"
    );
    assert!(
        stderr.contains("[worker 0] chief: every task joined; all-reduce"),
        "{stderr}"
    );
}

#[test]
fn killing_one_task_stops_the_job_and_names_it() {
    let _serial = serial();
    let run = Launch::start(&[
        "--nproc",
        "3",
        "--grace",
        "5",
        "--",
        "run",
        "examples/digits/digits.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "100000",
        "--quiet",
    ]);
    run.wait_for("[worker 0] chief: every task joined", LIMIT);
    let (victim, others) = (
        run.pid_of("worker 2"),
        [run.pid_of("worker 0"), run.pid_of("worker 1")],
    );
    Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    let started = Instant::now();
    let (code, _, stderr) = run.wait(Duration::from_secs(60));
    assert_eq!(code, Some(128 + 9), "the killed task's code:\n{stderr}");
    assert!(
        stderr.contains("dflow launch: worker 2 failed (killed by signal 9)"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
    for pid in others {
        assert!(!alive(pid), "task pid {pid} outlived dflow launch");
    }
}

#[test]
fn sigterm_is_forwarded_to_every_task() {
    let _serial = serial();
    let run = Launch::start(&[
        "--ps",
        "1",
        "--workers",
        "1",
        "--",
        "run",
        "examples/digits/digits.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "100000",
        "--quiet",
    ]);
    run.wait_for("[worker 0] chief: every task joined", LIMIT);
    let pids = [run.pid_of("ps 0"), run.pid_of("worker 0")];
    let launcher = run.child.id();
    Command::new("kill")
        .args(["-TERM", &launcher.to_string()])
        .status()
        .unwrap();
    let (code, _, stderr) = run.wait(Duration::from_secs(60));
    assert_eq!(code, Some(128 + 15), "{stderr}");
    assert!(
        stderr.contains("got SIGTERM; forwarding it to every task"),
        "{stderr}"
    );
    for pid in pids {
        assert!(!alive(pid), "task pid {pid} outlived dflow launch");
    }
}

/// Sends `signal` (`STOP`, `CONT`, `KILL`) to process `pid`.
fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal} {pid}");
}

#[test]
fn an_elastic_launch_goes_on_when_a_worker_is_killed_and_exits_zero() {
    elastic_launch(&["--nproc", "3"]);
}

#[test]
fn an_elastic_ps_launch_goes_on_when_a_worker_is_killed_and_exits_zero() {
    elastic_launch(&["--ps", "1", "--workers", "3"]);
}

/// `dflow launch SHAPE --min-workers 2` of a 3-worker digits job; worker 2 is killed mid-job.
fn elastic_launch(shape: &[&str]) {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let ckpt_s = ckpt.to_string_lossy().into_owned();
    let mut args = shape.to_vec();
    args.extend(["--min-workers", "2", "--"]);
    let run = Launch::start(
        &[
            &args[..],
            &[
                "run",
                "examples/digits/digits.json",
                "--data",
                "examples/data/digits.csv.gz",
                "--epochs",
                "1",
                "--quiet",
                "--timeout",
                "5",
                "--checkpoint-dir",
                &ckpt_s,
                "--save-every",
                "5",
            ],
        ]
        .concat(),
    );
    // Freeze the chief at its first checkpoint, kill worker 2, let the chief go on: the kill
    // lands mid-job whatever the machine's speed.
    let start = Instant::now();
    while std::fs::read_dir(&ckpt).map_or(true, |mut d| d.next().is_none()) {
        assert!(start.elapsed() < LIMIT, "no checkpoint:\n{}", run.stderr());
        std::thread::sleep(Duration::from_millis(1));
    }
    let chief = run.pid_of("worker 0");
    signal(chief, "STOP");
    signal(run.pid_of("worker 2"), "KILL");
    signal(chief, "CONT");
    let (code, stdout, stderr) = run.wait(LIMIT);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains(
            "dflow launch: worker 2 failed (killed by signal 9); the elastic job goes on"
        ) && stderr.contains("elastic restart 1: worker /job:worker/replica:0/task:2 is gone"),
        "{stderr}"
    );
    // The chief trained every step of the epoch (45) and evaluated the model.
    assert!(ckpt.join("ckpt-00000045.safetensors").exists(), "{stderr}");
    accuracy(&stdout);
}
