//! Training the digits example through the library, as `dflow run --data` does: accuracy after
//! 30 epochs, exact resume from checkpoints, and a clear error for a damaged checkpoint.

use dflow::executor::checkpoint::checkpoint_path;
use dflow::executor::trainer::{evaluate, fit, restore_latest, FitSummary, TrainConfig};
use dflow::executor::Session;
use dflow_tests::digits_setup::{config, data, session};
use std::path::PathBuf;

/// A fresh, empty scratch directory under the target dir.
fn scratch(name: &str) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn train(session: &Session, cfg: &TrainConfig) -> FitSummary {
    let (train_set, _) = data();
    fit(session, cfg, &train_set, |_| {}).unwrap()
}

fn bits(losses: &[f64]) -> Vec<u32> {
    losses.iter().map(|&l| (l as f32).to_bits()).collect()
}

#[test]
fn thirty_epochs_reach_95_percent_held_out_accuracy() {
    let (session, training) = session();
    let cfg = config(&training, 30);
    let summary = train(&session, &cfg);
    assert_eq!(summary.final_step, 30 * 45);
    let first = summary.losses[..45].iter().sum::<f64>() / 45.0;
    let last = summary.losses[summary.losses.len() - 45..]
        .iter()
        .sum::<f64>()
        / 45.0;
    assert!(last < first / 5.0, "mean loss went from {first} to {last}");

    let (_, test_set) = data();
    let accuracy = evaluate(&session, &cfg, &test_set, &training.metrics[0]).unwrap();
    let loss = evaluate(&session, &cfg, &test_set, &training.loss).unwrap();
    println!("held-out accuracy {accuracy:.4}, loss {loss:.4}");
    assert!(accuracy >= 0.95, "held-out accuracy {accuracy}");
}

#[test]
fn a_restored_run_continues_with_bit_equal_losses() {
    // The uninterrupted run: two epochs (90 steps) with no checkpoints.
    let (straight, training) = session();
    let full = train(&straight, &config(&training, 2));
    assert_eq!(full.losses.len(), 90);

    // The interrupted run: one epoch, a checkpoint every 10 steps (10, 20, 30, 40, and 45 at
    // the end; the last 3 kept). Dropping the final one makes the resume start mid-epoch.
    let dir = scratch("digits_resume");
    let (first, training) = session();
    let cfg = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        save_every: 10,
        ..config(&training, 1)
    };
    let part = train(&first, &cfg);
    assert_eq!(part.final_step, 45);
    assert_eq!(part.checkpoint, Some(checkpoint_path(&dir, 45)));
    assert_eq!(bits(&part.losses), bits(&full.losses[..45]));
    for step in [30, 40, 45] {
        assert!(checkpoint_path(&dir, step).is_file(), "checkpoint {step}");
    }
    assert!(
        !checkpoint_path(&dir, 20).exists(),
        "only 3 checkpoints kept"
    );
    std::fs::remove_file(checkpoint_path(&dir, 45)).unwrap();
    drop(first);

    // A new session picks up at step 40 and replays the rest of the schedule exactly.
    let (resumed, training) = session();
    let rest = train(
        &resumed,
        &TrainConfig {
            checkpoint_dir: Some(dir.clone()),
            save_every: 10,
            ..config(&training, 2)
        },
    );
    assert_eq!(rest.resumed_from, Some(40));
    assert_eq!(rest.final_step, 90);
    assert_eq!(bits(&rest.losses), bits(&full.losses[40..]));

    let mut a = straight.variables();
    let mut b = resumed.variables();
    a.sort_by(|x, y| x.1.cmp(&y.1));
    b.sort_by(|x, y| x.1.cmp(&y.1));
    assert_eq!(a.len(), b.len());
    for ((_, name, x), (_, _, y)) in a.iter().zip(&b) {
        assert_eq!(x.as_bytes(), y.as_bytes(), "variable {name} after 90 steps");
    }
}

#[test]
fn a_truncated_checkpoint_fails_to_restore_naming_the_file() {
    let dir = scratch("digits_truncated");
    let (first, training) = session();
    let cfg = TrainConfig {
        checkpoint_dir: Some(dir.clone()),
        ..config(&training, 1)
    };
    let summary = train(&first, &cfg);
    let file = summary.checkpoint.expect("a checkpoint at the end");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();

    let (second, _) = session();
    let err = restore_latest(&second, &dir).unwrap_err().to_string();
    assert!(err.contains(&file.display().to_string()), "{err}");
    assert!(err.contains("truncated"), "{err}");

    // `fit` refuses to start rather than silently training from scratch.
    let (train_set, _) = data();
    let err = fit(&second, &cfg, &train_set, |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains(&file.display().to_string()), "{err}");
}
