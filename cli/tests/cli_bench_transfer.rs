//! `dflow bench transfer` between two real processes: a row per size with numeric columns, for
//! every transport this build has on this host. No timing assertions.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(["bench", "transfer"])
        .args(args)
        .output()
        .unwrap()
}

fn two_processes_print_a_row_per_size(transport: &str, extra: &[&str]) {
    let mut args = vec![
        "--transport",
        transport,
        "--size",
        "8B,4KiB,1MiB",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--timeout",
        "30",
    ];
    args.extend_from_slice(extra);
    let out = bench(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim_start().starts_with("size"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    let sizes: Vec<&str> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(sizes, ["8B", "4KiB", "1MiB"], "{stdout}");
    for r in &rows {
        // size, iters, GB/s, rtt median, rtt p90, memcpy GB/s, copy-on-write copies
        assert_eq!(r.len(), 7, "{r:?}");
        assert_eq!(r[1], "5", "{r:?}");
        let rtt: f64 = r[3].parse().unwrap_or(0.0);
        assert!(rtt > 0.0, "a round trip takes time: {r:?}");
        for v in &r[2..] {
            let x: f64 = v.parse().unwrap_or_else(|_| panic!("{v:?} in {r:?}"));
            assert!(x >= 0.0 && x.is_finite(), "{r:?}");
        }
    }
    assert!(stdout.contains(transport), "{stdout}");
}

#[test]
fn tcp_prints_a_row_per_size() {
    two_processes_print_a_row_per_size("tcp", &[]);
}

#[test]
fn tcp_from_the_producers_buffer_prints_a_row_per_size() {
    two_processes_print_a_row_per_size("tcp", &["--copy"]);
}

#[cfg(target_os = "linux")]
#[test]
fn shm_prints_a_row_per_size() {
    two_processes_print_a_row_per_size("shm", &[]);
}

#[test]
fn quic_with_throwaway_certificates_prints_a_row_per_size() {
    two_processes_print_a_row_per_size("quic", &[]);
}

#[test]
fn bad_sizes_and_transports_are_clear_errors() {
    for (args, expect) in [
        (&["--size", "6B"][..], "multiple of 4"),
        (&["--size", "0B"][..], "multiple of 4"),
        (&["--size", "4XB"][..], "bad size unit"),
        (&["--transport", "carrier-pigeon"][..], "unknown transport"),
        (&["--timeout", "0"][..], "--timeout"),
    ] {
        let out = bench(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expect), "{args:?}: {stderr}");
    }
}
