//! The word-level language model (`examples/wordlm/wordlm.json`, a 20,480-row hashed embedding
//! table marked `partition_strategy: mod`) trained as a job whose table is sharded over two ps
//! tasks loses what one process training the unsharded table loses (sgd: the sparse update of
//! the touched rows equals the dense one), with `mod` and `div` shards, one and two workers.
//! Real `dflow` processes on 127.0.0.1; the data is a small CSV of the workload's format
//! (three hashed context ids, the next word's class) drawn from a fixed-seed generator.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;
use support::*;

const GRAPH: &str = "examples/wordlm/wordlm.json";
const LIMIT: Duration = Duration::from_secs(120);

/// 400 examples: ids in [0, 20480) (a small pool, so ids repeat within a batch), classes in
/// [0, 2000).
fn data(dir: &Path) -> PathBuf {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut csv = String::new();
    for _ in 0..400 {
        let ids: Vec<u64> = (0..3).map(|_| (next() % 300) * 67 % 20_480).collect();
        let class = (ids[0] + ids[2]) % 50;
        csv.push_str(&format!("{},{},{},{class}\n", ids[0], ids[1], ids[2]));
    }
    let path = dir.join("wordlm.csv");
    std::fs::write(&path, csv).unwrap();
    path
}

fn flags(data: &Path, epochs: u32) -> Vec<String> {
    [
        "--data",
        &data.to_string_lossy(),
        "--features",
        "context",
        "--batch-size",
        "32",
        "--epochs",
        &epochs.to_string(),
        "--quiet",
    ]
    .map(String::from)
    .to_vec()
}

fn local(dir: &Path, data: &Path, epochs: u32) -> Vec<(u64, f64)> {
    let losses = dir.join("local-losses.txt");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(["run", "--local", GRAPH])
        .args(flags(data, epochs))
        .arg("--losses-out")
        .arg(&losses)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    read_losses(&losses)
}

/// The job on `ps` ps tasks and `workers` workers; returns the chief's losses and stdout.
fn job(data: &Path, ps: usize, workers: usize, extra: &[&str]) -> (Vec<(u64, f64)>, String) {
    job_epochs(data, ps, workers, 1, extra)
}

fn job_epochs(
    data: &Path,
    ps: usize,
    workers: usize,
    epochs: u32,
    extra: &[&str],
) -> (Vec<(u64, f64)>, String) {
    let cluster = Cluster::new(ps, workers);
    let losses = cluster.path("job-losses.txt");
    let losses_s = losses.to_string_lossy().into_owned();
    let mut common = flags(data, epochs);
    common.extend(["--strategy", "ps"].map(String::from));
    common.extend(extra.iter().map(|s| s.to_string()));
    let common: Vec<&str> = common.iter().map(String::as_str).collect();
    let mut others = Vec::new();
    for i in 0..ps {
        others.push(Task::start(&cluster, "ps", i, &[]));
    }
    for i in 1..workers {
        others.push(Task::start(&cluster, "worker", i, &common));
    }
    let mut chief_args = vec![GRAPH];
    chief_args.extend(common.iter().copied());
    chief_args.extend(["--losses-out", &losses_s]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(LIMIT);
    chief.assert_success();
    for t in others {
        t.wait(Duration::from_secs(30)).assert_success();
    }
    (read_losses(&losses), chief.stdout.clone())
}

#[test]
fn two_ps_shards_train_like_one_process() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let want = local(dir.path(), &data, 1);
    assert_eq!(want.len(), 10, "320 training examples in batches of 32");
    assert!(
        want.last().unwrap().1 < want[0].1,
        "the loss goes down: {want:?}"
    );
    for (workers, strategy) in [(1, "mod"), (1, "div"), (2, "mod")] {
        let (got, _) = job(&data, 2, workers, &["--partition-strategy", strategy]);
        let worst = assert_same_losses(&got, &want, 1e-5);
        eprintln!("{workers} worker(s), {strategy}: worst relative loss difference {worst:e}");
    }
}

/// A checkpoint of the sharded table (saved whole, under the one-process names) resumes at
/// another number of ps tasks (2 → 1 and 1 → 2) with the losses of an uninterrupted run.
#[test]
fn a_sharded_checkpoint_resumes_at_another_ps_count() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let data = data(dir.path());
    let want = local(dir.path(), &data, 2);
    assert_eq!(want.len(), 20);
    for (first, then) in [(2, 1), (1, 2)] {
        let ckpt = dir.path().join(format!("ckpt-{first}-{then}"));
        let ckpt_s = ckpt.to_string_lossy().into_owned();
        let (before, _) = job_epochs(&data, first, 1, 1, &["--checkpoint-dir", &ckpt_s]);
        assert_same_losses(&before, &want[..10], 1e-5);
        let (after, _) = job_epochs(&data, then, 1, 2, &["--checkpoint-dir", &ckpt_s]);
        // Steps 11 to 20 only: the job resumed from step 10.
        let worst = assert_same_losses(&after, &want[10..], 1e-5);
        eprintln!("{first} ps -> {then} ps: worst relative loss difference {worst:e}");
    }
}
