//! `dflow run --local` driven through the real binary: fetches are printed, traces written, and a
//! hostile feed file is a clear, single-cause error.

mod support;
use support::{dflow, scratch};

const MLP: [&str; 5] = [
    "run",
    "--local",
    "examples/mlp/mlp.json",
    "--cluster",
    "examples/mlp/cluster.json",
];

#[test]
fn prints_the_fetched_tensor_and_writes_a_trace() {
    let dir = scratch("run_fetch");
    let trace = dir.join("trace.json");
    let mut args = MLP.to_vec();
    args.extend([
        "--fetch",
        "logits",
        "--feed",
        "x=examples/mlp/x.npy",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    let o = dflow(&args);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.starts_with("logits: f32[4, 10]\n[["), "{stdout}");
    assert_eq!(stdout.matches("],\n").count(), 3, "four rows: {stdout}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    assert!(
        events.iter().any(|e| e["cat"] == "Recv"),
        "the ps → worker transfers are traced"
    );
}

#[test]
fn a_hostile_feed_file_is_a_clear_error_naming_it_once() {
    let dir = scratch("run_hostile");
    let file = dir.join("huge.npy");
    // A header claiming 10^12 × 64 floats, followed by 16 bytes.
    let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000, 64), }";
    let header = format!(
        "{header}{}\n",
        " ".repeat(64 - (10 + header.len() + 1) % 64)
    );
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    bytes.extend([0u8; 16]);
    std::fs::write(&file, bytes).unwrap();
    let feed = format!("x={}", file.display());
    let mut args = MLP.to_vec();
    args.extend(["--fetch", "logits", "--feed", &feed]);
    let o = dflow(&args);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.starts_with("error: --feed x: ") && stderr.contains("huge.npy"),
        "{stderr}"
    );
    let cause = "failed to fill whole buffer";
    assert_eq!(
        stderr.matches(cause).count(),
        1,
        "each cause printed once: {stderr}"
    );
}

#[test]
fn a_missing_fetch_and_nothing_to_run_are_errors() {
    let mut args = MLP.to_vec();
    args.extend(["--fetch", "no_such_node", "--feed", "x=examples/mlp/x.npy"]);
    let o = dflow(&args);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && stderr.contains("no_such_node"),
        "{stderr}"
    );
    let o = dflow(&MLP);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && stderr.contains("nothing to run"),
        "{stderr}"
    );
}
