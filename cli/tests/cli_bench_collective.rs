//! `dflow bench-collective` with 2 ranks as real processes over TCP: the table has a row per
//! (op, size) with numeric columns. No timing assertions.

use std::process::Command;

#[test]
fn two_processes_print_a_row_per_op_and_size() {
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args([
            "bench-collective",
            "--op",
            "all_reduce,all_gather,broadcast,reduce_scatter,all_to_all",
            "--ranks",
            "2",
            "--size",
            "4B,4KiB",
            "--transport",
            "tcp",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--timeout",
            "30",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with("op "))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 10, "{stdout}");
    for op in [
        "all_reduce",
        "all_gather",
        "broadcast",
        "reduce_scatter",
        "all_to_all",
    ] {
        let mine: Vec<_> = rows.iter().filter(|r| r[0] == op).collect();
        assert_eq!(mine.len(), 2, "{op}: {stdout}");
        for r in mine {
            // op, ranks, size (two words), count, time, min, algbw, busbw
            assert_eq!(r.len(), 9, "{r:?}");
            assert_eq!(r[1], "2");
            for v in &r[4..] {
                let x: f64 = v.parse().unwrap_or_else(|_| panic!("{v:?} in {r:?}"));
                assert!(x >= 0.0 && x.is_finite(), "{r:?}");
            }
        }
    }
    assert!(stdout.contains("busbw_GB/s"), "{stdout}");
    // Two ranks fit when this process may use two CPUs: pinned like mpirun unless told
    // otherwise (`available_parallelism` is at most the affinity mask's size; with a CPU quota
    // below 2 it says less than the mask and either line is right).
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pinned = stdout.contains("\n# ranks pinned to CPUs [");
    let unpinned = stdout.contains("\n# ranks not pinned (--bind auto)");
    assert!(
        if cpus >= 2 {
            pinned
        } else {
            pinned || unpinned
        },
        "{stdout}"
    );
}

#[test]
fn binding_can_be_turned_off() {
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args([
            "bench",
            "collective",
            "--ranks",
            "2",
            "--size",
            "4B",
            "--iters",
            "2",
            "--warmup",
            "0",
            "--bind",
            "none",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("\n# ranks not pinned (--bind none)"),
        "{stdout}"
    );
    assert!(stdout.contains("all_reduce"), "{stdout}");
}

#[test]
fn in_process_ranks_and_bad_arguments() {
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args([
            "bench-collective",
            "--op",
            "all_reduce",
            "--ranks",
            "3",
            "--size",
            "4B",
            "--transport",
            "inproc",
            "--iters",
            "2",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("all_reduce"));
    let out = Command::new(env!("CARGO_BIN_EXE_dflow"))
        .args(["bench-collective", "--op", "all_sum"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown collective \"all_sum\""));
}
