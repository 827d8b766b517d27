//! The deployment files in examples/deploy/ run commands that work: every `dflow run` they hold
//! names a graph and a data file of the repository, and (for the digits job) its flags train
//! for an epoch in one process. A renamed flag or a moved file fails here, not on a cluster.

mod support;

use std::path::Path;
use support::*;

/// The `dflow run` arguments (after `run`) of every command in `text`.
fn run_commands(text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        if let Some(array) = line.strip_prefix("command: [") {
            // Kubernetes: command: ["dflow", "run", ...]
            let args: Vec<String> = serde_json::from_str(&format!("[{array}")).unwrap();
            if args.first().map(String::as_str) == Some("dflow") {
                assert_eq!(args[1], "run", "{line}");
                out.push(args[2..].to_vec());
            }
        } else if let Some((_, rest)) = line.split_once("dflow run ") {
            // Shell: `srun ... dflow run ...`, `exec dflow run ...`.
            out.push(
                rest.split_whitespace()
                    .map(|t| t.trim_matches('"').to_string())
                    .collect(),
            );
        }
    }
    out
}

#[test]
fn every_deployment_file_runs_a_working_command() {
    let _serial = serial();
    let dir = scratch("deploy-files");
    let deploy = repo().join("examples/deploy");
    let mut files = Vec::new();
    for sub in ["kubernetes", "slurm"] {
        for entry in std::fs::read_dir(deploy.join(sub)).unwrap() {
            files.push(entry.unwrap().path());
        }
    }
    files.sort();
    assert!(files.len() >= 8, "{files:?}");
    let mut tried = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let commands = run_commands(&text);
        assert!(
            !commands.is_empty(),
            "{}: no `dflow run` command",
            file.display()
        );
        for args in commands {
            let graph = &args[0];
            let data = args
                .iter()
                .position(|a| a == "--data")
                .map(|i| &args[i + 1])
                .unwrap_or_else(|| panic!("{}: no --data in {args:?}", file.display()));
            if graph.contains("gpt") && !repo().join(graph).exists() {
                eprintln!(
                    "{}: {graph} is not in this checkout yet; its command is not run",
                    file.display()
                );
                continue;
            }
            assert!(
                repo().join(data).exists(),
                "{}: {data} does not exist",
                file.display()
            );
            let check = dflow(&["check", graph]);
            assert!(
                check.status.success(),
                "{}: dflow check {graph}: {}",
                file.display(),
                String::from_utf8_lossy(&check.stderr)
            );
            if !graph.contains("digits") {
                continue;
            }
            // The same flags, one epoch, every task in this process.
            let mut local: Vec<String> = vec!["run".into(), "--local".into()];
            for a in &args {
                local.push(if a.contains('$') {
                    dir.join("ckpt").to_string_lossy().into_owned()
                } else {
                    a.clone()
                });
            }
            local.extend(["--epochs".into(), "1".into()]);
            let local: Vec<&str> = local.iter().map(String::as_str).collect();
            let o = dflow(&local);
            assert!(
                o.status.success(),
                "{}: {local:?}: {}",
                file.display(),
                String::from_utf8_lossy(&o.stderr)
            );
            tried += 1;
        }
    }
    assert!(tried >= 4, "digits commands run: {tried}");
    let _ = Path::new(&dir);
}
