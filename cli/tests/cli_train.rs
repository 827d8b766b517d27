//! `dflow run --local ... --data ...` trains the digits example, through the real binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Trains the digits example for `epochs` epochs with checkpoints in `ckpt`.
fn train_digits(epochs: u32, ckpt: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args([
            "run",
            "--local",
            "examples/digits/digits.json",
            "--cluster",
            "examples/digits/cluster.json",
            "--data",
            "examples/data/digits.csv.gz",
            "--epochs",
            &epochs.to_string(),
            "--quiet",
            "--checkpoint-dir",
        ])
        .arg(ckpt)
        .current_dir(repo())
        .output()
        .unwrap()
}

fn text(o: &Output) -> (String, String) {
    let stdout = String::from_utf8(o.stdout.clone()).unwrap();
    let stderr = String::from_utf8(o.stderr.clone()).unwrap();
    assert!(o.status.success(), "dflow failed:\n{stderr}");
    (stdout, stderr)
}

fn checkpoints(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ckpt-") && n.ends_with(".safetensors"))
        .collect();
    names.sort();
    names
}

#[test]
fn trains_logs_plain_lines_checkpoints_and_resumes() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("cli_train_digits-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);

    let (stdout, stderr) = text(&train_digits(3, &dir));
    assert!(
        !stderr.contains('\x1b'),
        "escape codes in piped output:\n{stderr}"
    );
    assert!(
        !stderr.contains('\r'),
        "carriage returns in piped output:\n{stderr}"
    );
    for epoch in 1..=3 {
        let line = format!("epoch {epoch}/3  step {}/135  mean loss ", 45 * epoch);
        assert!(stderr.contains(&line), "no `{line}` in:\n{stderr}");
    }
    assert!(stderr.contains("trained 135 steps"), "{stderr}");
    assert!(stdout.contains("held-out loss: "), "{stdout}");
    let accuracy = stdout
        .lines()
        .find_map(|l| l.strip_prefix("held-out accuracy: "))
        .unwrap_or_else(|| panic!("no held-out accuracy line in:\n{stdout}"));
    let accuracy: f64 = accuracy.trim().parse().unwrap();
    assert!(
        (0.5..=1.0).contains(&accuracy),
        "accuracy {accuracy} after 3 epochs"
    );
    assert_eq!(checkpoints(&dir), ["ckpt-00000135.safetensors"]);
    assert!(stderr.contains("ckpt-00000135.safetensors"), "{stderr}");

    let (stdout, stderr) = text(&train_digits(4, &dir));
    assert!(
        stderr.contains("resumed from the checkpoint at step 135"),
        "{stderr}"
    );
    assert!(stderr.contains("epoch 4/4  step 180/180"), "{stderr}");
    assert!(stderr.contains("trained 45 steps"), "{stderr}");
    assert!(stdout.contains("held-out accuracy: "), "{stdout}");
    assert_eq!(
        checkpoints(&dir),
        ["ckpt-00000135.safetensors", "ckpt-00000180.safetensors"]
    );
}

fn dflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap()
}

#[test]
fn training_without_held_out_data_skips_evaluation() {
    let o = dflow(&[
        "run",
        "--local",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--epochs",
        "1",
        "--quiet",
        "--test-fraction",
        "0",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("no held-out examples"), "{out}");
}

#[test]
fn data_without_a_train_section_is_a_clear_error() {
    let o = dflow(&[
        "run",
        "--local",
        "examples/mlp/mlp.json",
        "--cluster",
        "examples/mlp/cluster.json",
        "--data",
        "examples/data/digits.csv.gz",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("has no `train` section"), "{err}");
}

#[test]
fn a_zero_batch_size_is_an_error_not_a_silent_no_op() {
    let o = dflow(&[
        "run",
        "--local",
        "examples/digits/digits.json",
        "--cluster",
        "examples/digits/cluster.json",
        "--data",
        "examples/data/digits.csv.gz",
        "--batch-size",
        "0",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("batch size must be at least 1"), "{err}");
}

#[test]
fn steps_on_a_table_are_refused_not_ignored() {
    // A table trains for whole epochs; `--steps` used to be ignored silently (30 epochs ran).
    for local in [true, false] {
        let mut args = vec!["run"];
        if local {
            args.push("--local");
        } else {
            // The chief of a job refuses it too, before contacting any task.
            args.extend(["--job", "worker", "--index", "0"]);
        }
        args.extend([
            "examples/digits/digits.json",
            "--cluster",
            "examples/digits/cluster.json",
            "--data",
            "examples/data/digits.csv.gz",
            "--steps",
            "4",
            "--quiet",
        ]);
        let o = dflow(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "local {local}: {err}");
        assert!(
            err.contains("--steps 4") && err.contains("--epochs"),
            "local {local}: {err}"
        );
    }
}
