//! The `dflow` command-line tool.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod cmd;

/// mimalloc: a step allocates and frees one buffer per kernel output; glibc's malloc spends
/// more time consolidating those than the kernels spend computing on small tensors.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option (`mi_option_purge_delay` in the bundled v2 `mimalloc.h`).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps the memory a step frees for the next step. By default mimalloc gives freed pages back
/// to the OS 10 ms after they empty; a training step frees and allocates the same buffers every
/// few milliseconds, so each step faulted its large buffers in again and the kernel zeroed every
/// page (`clear_page_erms` was 12% of the GPT's CPU profile, system time 2 of 9 CPU seconds over
/// 60 steps; BENCHMARKS.md "Character-level GPT"). With purging off, resident memory stays at the
/// peak a step reaches, which a long-running job reaches anyway.
///
/// Except under `dflow run --memory-limit`: there the process's resident memory is what must
/// stay under the limit, and kept pages (freed buffers of every size a step used, which the
/// next step does not reuse exactly) held the 100M-parameter GPT's ZeRO-3 workers at ~9 bytes
/// per parameter resident against the executor's 4.6 (tests/big_model, BENCHMARKS.md); freed
/// pages then go back at once (`purge_delay` 0), costing page faults. `MIMALLOC_PURGE_DELAY`
/// in the environment still decides when it is set.
fn purge_delay(command: &Command) -> std::os::raw::c_long {
    match command {
        Command::Run(a) if a.memory_limit.is_some() => 0,
        _ => -1,
    }
}

/// Sets mimalloc's `purge_delay` to `delay` ms (-1: never), unless `MIMALLOC_PURGE_DELAY` is
/// set (see [`purge_delay`]).
fn set_purge_delay(delay: std::os::raw::c_long) {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: `mi_option_set` stores an integer in mimalloc's option table (a relaxed atomic
    // store); any value is valid for `purge_delay` (-1 = never purge, 0 = at once). The index
    // is that of `mi_option_purge_delay` in the mimalloc v2 header `libmimalloc-sys` builds,
    // which `tests::the_purge_delay_option_is_the_one_set` checks by its documented default.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, delay) }
}

/// dflow: partition dataflow graphs across devices and run them.
#[derive(Debug, Parser)]
#[command(name = "dflow", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Validate a graph file and print a summary (nodes, ops, devices, parameters).
    Check(cmd::check::Args),
    /// Convert a graph between the JSON and DSL formats.
    Convert(cmd::convert::Args),
    /// Place and partition a graph over a cluster; print per-device subgraphs and Send/Recv pairs.
    Partition(cmd::partition::Args),
    /// Predict memory, bytes and step time of every dp × tp × pp layout over N devices; pick one.
    Plan(cmd::plan::Args),
    /// Run a graph (`--local`: every task of the cluster in this process).
    Run(Box<cmd::run::Args>),
    /// Sample text from a character-level language model's checkpoint (`run --data TEXT`).
    Generate(cmd::generate::Args),
    /// Benchmarks: point-to-point transfers and collectives between real processes.
    #[command(subcommand)]
    Bench(Bench),
    /// Same as `bench collective` (the name child ranks are started with).
    #[command(hide = true)]
    BenchCollective(cmd::bench_collective::Args),
    /// Work with Chrome traces written by `run --trace` (merge the per-task files of a job).
    Trace(cmd::trace::Args),
    /// Make a cluster CA and per-task certificates for `run --transport quic`.
    Cert(cmd::cert::Args),
    /// Start every task of a job on this machine (`--ps P --workers W` or `--nproc N`), each
    /// with its identity in the environment, as a cluster launcher would.
    Launch(cmd::launch::Args),
}

/// `dflow bench ...`.
#[derive(Debug, Subcommand)]
enum Bench {
    /// Send/Recv between two processes over a data plane: GB/s and round trip per size.
    Transfer(cmd::bench_transfer::Args),
    /// Collectives (all-reduce, all-gather, ...) over N ranks: time, algbw, busbw.
    Collective(cmd::bench_collective::Args),
    /// Measure this machine (MatMul FLOP/s, shm and TCP links) into a `dflow plan --profile`.
    Calibrate(cmd::bench_calibrate::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    set_purge_delay(purge_delay(&cli.command));
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DFLOW_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log file or pipe gets plain text (and `NO_COLOR` is
        // honoured).
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none(),
        )
        .init();
    let result = match cli.command {
        Command::Check(a) => cmd::check::run(a),
        Command::Convert(a) => cmd::convert::run(a),
        Command::Partition(a) => cmd::partition::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Run(a) => cmd::run::run(*a),
        Command::Generate(a) => cmd::generate::run(a),
        Command::Trace(a) => cmd::trace::run(a),
        Command::Bench(Bench::Transfer(a)) => cmd::bench_transfer::run(a),
        Command::Bench(Bench::Calibrate(a)) => cmd::bench_calibrate::run(a),
        Command::Bench(Bench::Collective(a)) | Command::BenchCollective(a) => {
            cmd::bench_collective::run(a)
        }
        Command::Cert(a) => cmd::cert::run(a),
        // Exits with the failed task's code, not 1.
        Command::Launch(a) => return cmd::launch::main(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", render_error(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each cause once: many library errors already quote
/// their source in their own message, so a cause whose text is already shown is skipped.
fn render_error(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_purge_delay_option_is_the_one_set() {
        // SAFETY: `mi_option_get` reads an integer from mimalloc's option table.
        let get = || unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            // The documented default of `purge_delay` (10 ms); the options around it default
            // to other values (eager_commit_delay 1, use_numa_nodes 0).
            assert_eq!(get(), 10);
        }
        set_purge_delay(-1);
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            assert_eq!(get(), -1);
        }
    }

    #[test]
    fn freed_pages_are_kept_except_under_a_memory_limit() {
        let delay = |args: &[&str]| purge_delay(&Cli::try_parse_from(args).unwrap().command);
        assert_eq!(delay(&["dflow", "run", "g.json", "--memory-limit", "5"]), 0);
        assert_eq!(delay(&["dflow", "run", "g.json"]), -1);
        assert_eq!(delay(&["dflow", "check", "g.json"]), -1);
    }
}
