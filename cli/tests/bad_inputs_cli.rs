//! The real binary on every file of the bad-input catalog (`tests/bad_inputs/`): a non-zero exit,
//! an error message on stderr, no panic, and quickly.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn catalog() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/bad_inputs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().is_some_and(|n| n != "README.md"))
        .collect();
    files.sort();
    files
}

/// Runs `dflow ARGS`, killing it if it takes longer than `limit`.
fn run_bounded(args: &[&str], limit: Duration) -> (Option<i32>, String, Duration) {
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut s).unwrap();
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            child.kill().unwrap();
            panic!("dflow {args:?} ran longer than {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    (status.code(), reader.join().unwrap(), start.elapsed())
}

#[test]
fn check_and_convert_fail_cleanly_on_every_bad_input() {
    let files = catalog();
    assert!(files.len() >= 30);
    for f in &files {
        let path = f.to_str().unwrap();
        for args in [
            vec!["check", path],
            vec!["convert", path, "--to", "json"],
            vec!["convert", path, "--to", "dsl"],
        ] {
            let (code, stderr, took) = run_bounded(&args, Duration::from_secs(20));
            assert_eq!(code, Some(1), "{args:?}: {stderr}");
            assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
            assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
            assert!(
                stderr.contains(path),
                "{args:?} does not name the file: {stderr}"
            );
            assert!(took < Duration::from_secs(5), "{args:?} took {took:?}");
        }
    }
}
