//! The GPT through the command line, on a CI-sized configuration of the same model (one block,
//! 32 channels, a context of 16) and the bundled corpus: training lowers the loss, a resumed run
//! continues exactly (same batches, same losses, step numbers continued), `generate` samples
//! from the checkpoint reproducibly, and `--init-from` names what does not fit.

mod support;

use dflow::graph::layers::{gpt, GptConfig};
use std::path::{Path, PathBuf};
use support::*;

const CORPUS: &str = "examples/data/shakespeare.txt.gz";

/// A one-block GPT over the corpus's 76 characters, written as JSON into `dir`.
fn tiny_gpt(dir: &Path) -> PathBuf {
    let cfg = GptConfig {
        block_size: 16,
        n_layer: 1,
        n_head: 2,
        n_embd: 32,
        learning_rate: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 5,
        decay_steps: 60,
        ..GptConfig::default()
    };
    let model = gpt(&cfg).unwrap();
    let path = dir.join("tiny-gpt.json");
    std::fs::write(&path, dflow::graph::format::to_json(&model.def)).unwrap();
    path
}

fn losses(path: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let (s, v) = l.split_once(' ').unwrap();
            (s.parse().unwrap(), v.parse().unwrap())
        })
        .collect()
}

fn train(graph: &Path, steps: &str, extra: &[&str]) -> std::process::Output {
    let graph = graph.to_string_lossy().into_owned();
    let mut args = vec![
        "run",
        "--local",
        &graph,
        "--cluster",
        "examples/gpt/cluster.json",
        "--data",
        CORPUS,
        "--batch-size",
        "8",
        "--steps",
        steps,
        "--eval-every",
        "0",
        "--eval-batches",
        "2",
        "--quiet",
    ];
    args.extend_from_slice(extra);
    dflow(&args)
}

#[test]
fn sixty_steps_lower_the_loss_and_report_validation() {
    let dir = scratch("gpt-train");
    let graph = tiny_gpt(&dir);
    let out_file = dir.join("losses.txt");
    let out = train(&graph, "60", &["--losses-out", &out_file.to_string_lossy()]);
    let text = stdout(&out);
    let l = losses(&out_file);
    assert_eq!(l.len(), 60);
    assert_eq!(l[0].0, 1);
    // Step 1 sees uniform predictions: ln(76) = 4.33 nats per character.
    assert!((l[0].1 - 76f64.ln()).abs() < 0.1, "first loss {}", l[0].1);
    let last5 = l[55..].iter().map(|(_, v)| v).sum::<f64>() / 5.0;
    assert!(
        last5 < l[0].1 - 1.0,
        "60 steps lowered the loss from {} only to {last5}",
        l[0].1
    );
    let val: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("validation loss: "))
        .unwrap_or_else(|| panic!("no validation loss in {text}"))
        .trim()
        .parse()
        .unwrap();
    assert!(val < l[0].1 - 0.8, "validation loss {val}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tokens/s"), "{err}");
}

#[test]
fn a_resumed_run_continues_the_uninterrupted_one_and_generate_samples_from_it() {
    let dir = scratch("gpt-resume");
    let graph = tiny_gpt(&dir);
    let straight = dir.join("straight.txt");
    stdout(&train(
        &graph,
        "12",
        &["--losses-out", &straight.to_string_lossy()],
    ));
    let ckpt = dir.join("ckpt");
    let (ckpt_s, part) = (ckpt.to_string_lossy().into_owned(), dir.join("part.txt"));
    stdout(&train(
        &graph,
        "6",
        &[
            "--checkpoint-dir",
            &ckpt_s,
            "--losses-out",
            &part.to_string_lossy(),
        ],
    ));
    let rest = dir.join("rest.txt");
    let out = train(
        &graph,
        "12",
        &[
            "--checkpoint-dir",
            &ckpt_s,
            "--losses-out",
            &rest.to_string_lossy(),
        ],
    );
    stdout(&out);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("resumed from the checkpoint at step 6"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut joined = losses(&part);
    joined.extend(losses(&rest));
    let want = losses(&straight);
    assert_eq!(joined.len(), 12);
    for ((s1, a), (s2, b)) in joined.iter().zip(&want) {
        assert_eq!(s1, s2);
        assert_eq!(a.to_bits(), b.to_bits(), "step {s1}: {a} vs {b}");
    }

    // Sampling: the prompt, then exactly N characters; the same seed gives the same text.
    let g = graph.to_string_lossy().into_owned();
    let sample = |seed: &str| {
        stdout(&dflow(&[
            "generate",
            &g,
            "--checkpoint-dir",
            &ckpt_s,
            "--prompt",
            "ROMEO:",
            "--chars",
            "40",
            "--seed",
            seed,
        ]))
    };
    let a = sample("1");
    assert!(a.starts_with("ROMEO:"), "{a}");
    assert_eq!(
        a.trim_end_matches('\n').chars().count(),
        "ROMEO:".len() + 40,
        "{a:?}"
    );
    assert_eq!(a, sample("1"));
    assert_ne!(a, sample("2"));
    let bad = dflow(&[
        "generate",
        &g,
        "--checkpoint-dir",
        &ckpt_s,
        "--prompt",
        "héllo",
        "--chars",
        "5",
    ]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("'é' at byte 1 is not in the model's vocabulary"),
        "{err}"
    );
}

#[test]
fn init_from_a_file_that_does_not_fit_names_every_problem() {
    let dir = scratch("gpt-init");
    let graph = tiny_gpt(&dir);
    // A checkpoint of another model: the real GPT's fixture from the PyTorch tests.
    let file = repo().join("tests/fixtures/gpt/init.safetensors");
    let out = train(&graph, "1", &["--init-from", &file.to_string_lossy()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot initialize the model from it"), "{err}");
    assert!(err.contains("transformer.wte.weight"), "{err}");
    assert!(err.contains("transformer.h.1.ln_1.weight"), "{err}");
}
