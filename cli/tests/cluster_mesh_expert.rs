//! `--mesh dp=D,ep=E`: expert parallelism carved out of the data-parallel ranks (Megatron-core).
//! On 4 workers, `dp=4,ep=2` holds each MoE layer's 4 experts twice, 2 per worker, in the
//! expert-parallel groups {0,1} and {2,3} (tokens move by all-to-all inside a group), and sums
//! each expert shard's gradient over the expert-data-parallel groups {0,2} and {1,3}; the dense
//! parameters are data-parallel over all 4.
//!
//! A two-block GPT with 4-expert MoE MLPs at capacity factor E = 4 drops no token, neither in
//! one process nor on a worker, so the job equals one process (capacity is per worker; see
//! docs/experts.md). Every task runs in this process (`--local --cluster`), which keeps the
//! 4-worker runs cheap; `--strategy expert` is covered by real processes in cluster_expert.rs.

mod support;

use dflow::graph::layers::{gpt, GptConfig, MoeConfig};
use std::path::{Path, PathBuf};
use support::*;

const FOUR: &str = "examples/gpt/cluster-4workers.json";
const TWO: &str = "examples/gpt/cluster-2workers.json";

/// A two-block GPT (16 characters of context, 16 channels) with 4-expert MoE MLPs, top-`top_k`
/// routing at capacity factor 4 (nothing dropped), clipped at global norm `grad_clip`.
fn tiny_moe_gpt(dir: &Path, top_k: usize, grad_clip: Option<f64>) -> PathBuf {
    let cfg = GptConfig {
        block_size: 16,
        n_layer: 2,
        n_head: 2,
        n_embd: 16,
        learning_rate: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 2,
        decay_steps: 20,
        grad_clip,
        moe: Some(MoeConfig {
            num_experts: 4,
            top_k,
            capacity_factor: 4.0,
            ..MoeConfig::default()
        }),
        ..GptConfig::default()
    };
    let model = gpt(&cfg).unwrap();
    let path = dir.join(format!("tiny-moe-top{top_k}-clip{grad_clip:?}.json"));
    std::fs::write(&path, dflow::graph::format::to_json(&model.def)).unwrap();
    path
}

/// `dflow run --local GRAPH` for `steps` steps of a global batch of 8 with `extra` flags (a
/// cluster and a mesh or strategy, or none: one process), checkpointing to (and resuming from)
/// `ckpt`: its losses.
fn run(graph: &Path, extra: &[&str], steps: u32, ckpt: &Path) -> Vec<(u64, f64)> {
    run_out(graph, extra, steps, ckpt).0
}

/// [`run`]: its losses and the final validation loss line ([`support::run_text_local`]).
fn run_out(graph: &Path, extra: &[&str], steps: u32, ckpt: &Path) -> (Vec<(u64, f64)>, String) {
    run_text_local(graph, extra, steps, ckpt)
}

/// The losses of `dp=4,ep=2` equal one process's within 1e-5 over 5 steps, for top-1 and for
/// top-2 clipped at global norm 0.1 (clipped every step); and `dp=2,ep=2` is `--strategy
/// expert` on 2 workers, loss for loss. Without the expert-data-parallel sum of the expert
/// gradients, step 2 differs by 5e-5 relative and this fails. (AdamW is nearly blind to a
/// gradient scaled alike at every step, so these losses do not check which group the clipping
/// norm is gathered over; `expert.rs`'s
/// `ep2_over_four_workers_shards_in_groups_and_sums_expert_gradients_over_the_others` does.)
#[test]
fn dp4_ep2_trains_like_one_process_and_dp2_ep2_is_the_expert_strategy() {
    let dir = scratch("mesh-expert");
    for (top_k, clip) in [(1, None), (2, Some(0.1))] {
        let graph = tiny_moe_gpt(&dir, top_k, clip);
        let tag = format!("top{top_k}-{clip:?}");
        let (local, one_validation) = run_out(&graph, &[], 5, &dir.join(format!("one-{tag}")));
        assert_eq!(local.len(), 5);
        assert!(!one_validation.is_empty(), "no validation loss printed");
        let (mesh, validation) = run_out(
            &graph,
            &["--cluster", FOUR, "--mesh", "dp=4,ep=2"],
            5,
            &dir.join(format!("dp4ep2-{tag}")),
        );
        let worst = assert_same_losses(&mesh, &local, 1e-5);
        eprintln!("dp=4,ep=2 top-{top_k} clip {clip:?}: worst relative difference {worst:e}");
        // Evaluated with the experts on their ranks (activations sent to them): one process's.
        assert_eq!(validation, one_validation, "dp=4,ep=2 {tag}");
        if clip.is_none() {
            let (two, validation) = run_out(
                &graph,
                &["--cluster", TWO, "--mesh", "dp=2,ep=2"],
                5,
                &dir.join(format!("dp2ep2-{tag}")),
            );
            assert_eq!(validation, one_validation, "dp=2,ep=2 {tag}");
            let expert = run(
                &graph,
                &["--cluster", TWO, "--strategy", "expert"],
                5,
                &dir.join(format!("expert-{tag}")),
            );
            assert_eq!(two, expert, "dp=2,ep=2 vs --strategy expert");
            assert_same_losses(&two, &local, 1e-5);
        }
    }
}

/// A checkpoint written under `dp=4,ep=2` holds the experts and their Adam moments whole
/// (`[E, ...]`, the one-process names, no `/shard_<i>`), and resumes in one process with no
/// strategy with the uninterrupted mesh job's next losses (within 1e-6 relative).
#[test]
fn a_dp4_ep2_checkpoint_resumes_in_one_process() {
    let dir = scratch("mesh-expert-checkpoint");
    let graph = tiny_moe_gpt(&dir, 1, None);
    let mesh = ["--cluster", FOUR, "--mesh", "dp=4,ep=2"];
    let uninterrupted = run(&graph, &mesh, 5, &dir.join("full"));
    assert_eq!(uninterrupted.len(), 5);
    let saved = dir.join("saved");
    assert_eq!(run(&graph, &mesh, 3, &saved).len(), 3);
    let path = dflow::executor::checkpoint::latest(&saved)
        .unwrap()
        .expect("a checkpoint");
    let tensors = dflow::executor::checkpoint::load(&path).unwrap().tensors;
    assert!(
        !tensors.keys().any(|n| n.contains("/shard_")),
        "shards saved by their per-worker names: {:?}",
        tensors.keys().collect::<Vec<_>>()
    );
    let experts: Vec<_> = tensors
        .iter()
        .filter(|(n, _)| n.contains(".mlp.experts."))
        .collect();
    // 2 layers × (c_fc, c_proj) × (weight, bias) × (value, adam_m, adam_v).
    assert_eq!(
        experts.len(),
        24,
        "{:?}",
        experts.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    for (n, t) in &experts {
        assert_eq!(t.dims().first(), Some(&4), "`{n}` is {:?}", t.dims());
    }
    let resumed = run(&graph, &[], 5, &saved);
    let worst = assert_same_losses(&resumed, &uninterrupted[3..], 1e-6);
    eprintln!("dp=4,ep=2 checkpoint in one process: steps 4-5 worst relative difference {worst:e}");
}

/// `dp=4,ep=2` with ZeRO-1, ZeRO-2 and ZeRO-3 (top-2 routing, clipped at global norm 0.1
/// every step): the dense parameters' Adam slots (ZeRO-3: and the parameters, gathered just in
/// time) sharded over the 4 workers, each expert shard's over its 2 holders. 5 steps' losses
/// equal one process's within 1e-5, and the checkpoint it ends with (gathered whole: the
/// one-process names and shapes) holds the same parameters and Adam moments within 1e-5; a
/// ZeRO-2 and a ZeRO-3 checkpoint written after 3 steps resume in one process with the
/// uninterrupted job's losses, and a one-process checkpoint resumes under ZeRO-3 with the
/// one-process losses. `dp=2,ep=2` ZeRO-1 and ZeRO-3 (the experts held once, their slots and
/// weights whole) equal one process too.
#[test]
fn dp4_ep2_zero_trains_like_one_process_and_resumes_in_one() {
    let dir = scratch("mesh-expert-zero");
    let graph = tiny_moe_gpt(&dir, 2, Some(0.1));
    let one = dir.join("one");
    let (local, one_validation) = run_out(&graph, &[], 5, &one);
    assert!(!one_validation.is_empty(), "no validation loss printed");
    let whole = checkpoint_f32(&one);
    for stage in ["1", "2", "3"] {
        let mesh = [
            "--cluster",
            FOUR,
            "--mesh",
            "dp=4,ep=2",
            "--zero-stage",
            stage,
        ];
        let ckpt = dir.join(format!("zero{stage}"));
        let (losses, validation) = run_out(&graph, &mesh, 5, &ckpt);
        let worst = assert_same_losses(&losses, &local, 1e-5);
        eprintln!("dp=4,ep=2 ZeRO-{stage}: worst relative loss difference {worst:e}");
        // Evaluated with the experts on their ranks: one process's validation loss.
        assert_eq!(validation, one_validation, "dp=4,ep=2 ZeRO-{stage}");
        let saved = checkpoint_f32(&ckpt);
        assert_eq!(
            saved.keys().collect::<Vec<_>>(),
            whole.keys().collect::<Vec<_>>(),
            "ZeRO-{stage}: the checkpoint's tensors"
        );
        let mut worst = 0.0f32;
        for (name, want) in &whole {
            let got = &saved[name];
            assert_eq!(got.len(), want.len(), "ZeRO-{stage} `{name}`");
            for (a, b) in got.iter().zip(want) {
                let gap = (a - b).abs() / b.abs().max(1.0);
                assert!(gap <= 1e-5, "ZeRO-{stage} `{name}`: {a} vs {b}");
                worst = worst.max(gap);
            }
        }
        eprintln!("dp=4,ep=2 ZeRO-{stage}: worst parameter/slot difference {worst:e}");
        if stage == "1" {
            // Where the slots live: a dense weight's in 4 shards, one per worker; an expert
            // shard's in 2, over the workers holding it ({1,3} for shard 1).
            let out = dflow(&[
                "partition",
                graph.to_str().unwrap(),
                "--cluster",
                FOUR,
                "--features",
                "idx",
                "--labels",
                "targets",
                "--mesh",
                "dp=4,ep=2",
                "--zero-stage",
                "1",
                "--batch-size",
                "8",
            ]);
            let text = stdout(&out);
            for (var, on) in [
                ("transformer.wte.weight/adam_m/shard_3_of_4 ", 3),
                (
                    "transformer.h.0.mlp.experts.c_fc.weight/shard_1/adam_m/shard_0_of_2 ",
                    1,
                ),
                (
                    "transformer.h.0.mlp.experts.c_fc.weight/shard_1/adam_m/shard_1_of_2 ",
                    3,
                ),
            ] {
                let line = text
                    .lines()
                    .find(|l| l.contains(var))
                    .unwrap_or_else(|| panic!("no `{var}` in:\n{text}"));
                assert!(
                    line.ends_with(&format!("on /job:worker/replica:0/task:{on}")),
                    "{line}"
                );
            }
            // dp=2,ep=2: no other worker holds a worker's experts; their slots stay whole and
            // ZeRO shards the dense ones over both.
            let (two, validation) = run_out(
                &graph,
                &["--cluster", TWO, "--mesh", "dp=2,ep=2", "--zero-stage", "1"],
                5,
                &dir.join("dp2ep2-zero1"),
            );
            assert_eq!(validation, one_validation, "dp=2,ep=2 ZeRO-1");
            let worst = assert_same_losses(&two, &local, 1e-5);
            eprintln!("dp=2,ep=2 ZeRO-1: worst relative loss difference {worst:e}");
        }
        if stage == "3" {
            // dp=2,ep=2: the dense weights sharded over both workers, the experts whole.
            let (two, validation) = run_out(
                &graph,
                &["--cluster", TWO, "--mesh", "dp=2,ep=2", "--zero-stage", "3"],
                5,
                &dir.join("dp2ep2-zero3"),
            );
            assert_eq!(validation, one_validation, "dp=2,ep=2 ZeRO-3");
            let worst = assert_same_losses(&two, &local, 1e-5);
            eprintln!("dp=2,ep=2 ZeRO-3: worst relative loss difference {worst:e}");
            // A one-process checkpoint resumes under dp=4,ep=2 ZeRO-3 (split into the
            // workers' flat shards of their row shards) with the one-process losses.
            let from_one = dir.join("one-saved");
            assert_eq!(run(&graph, &[], 3, &from_one).len(), 3);
            let resumed = run(&graph, &mesh, 5, &from_one);
            let worst = assert_same_losses(&resumed, &local[3..], 1e-5);
            eprintln!("one process's checkpoint under dp=4,ep=2 ZeRO-3: worst {worst:e}");
        }
        if stage != "1" {
            let saved = dir.join(format!("zero{stage}-saved"));
            assert_eq!(run(&graph, &mesh, 3, &saved).len(), 3);
            let resumed = run(&graph, &[], 5, &saved);
            let worst = assert_same_losses(&resumed, &losses[3..], 1e-6);
            eprintln!("dp=4,ep=2 ZeRO-{stage} checkpoint in one process: worst {worst:e}");
        }
    }
}

/// `dp=2,tp=2,ep=2` on 4 workers (tp groups {0,1} {2,3}; each MoE layer replicated over tp,
/// its experts over the replicas of one tp coordinate, {0,2} and {1,3}), top-2 routing with the
/// load-balancing loss, clipped at global norm 0.1 every step: 5 steps' losses equal one
/// process's within 1e-5, the final checkpoint (the one-process names and shapes: tp shards
/// and expert shards joined) holds the same parameters and Adam moments within 1e-5, the
/// validation loss (tp group 0's ranks on their shards, each MoE layer on rank 0 with its
/// experts on their replicas' ranks) is one process's, and a
/// checkpoint written after 3 steps resumes in one process with the uninterrupted job's losses;
/// `dp=4,tp=2,ep=2` on 8 workers equals one process too.
#[test]
fn dp2_tp2_ep2_trains_like_one_process_and_resumes_in_one() {
    let dir = scratch("mesh-expert-tp");
    let graph = tiny_moe_gpt(&dir, 2, Some(0.1));
    let one = dir.join("one");
    let (local, one_validation) = run_out(&graph, &[], 5, &one);
    assert_eq!(local.len(), 5);
    let mesh = ["--cluster", FOUR, "--mesh", "dp=2,tp=2,ep=2"];
    let full = dir.join("full");
    let (losses, validation) = run_out(&graph, &mesh, 5, &full);
    let worst = assert_same_losses(&losses, &local, 1e-5);
    eprintln!("dp=2,tp=2,ep=2: worst relative loss difference {worst:e}");
    // Evaluated on the shards, the experts where they are: the one-process model's loss.
    assert!(!one_validation.is_empty(), "no validation loss printed");
    assert_eq!(validation, one_validation);
    let (whole, saved) = (checkpoint_f32(&one), checkpoint_f32(&full));
    assert_eq!(
        saved.keys().collect::<Vec<_>>(),
        whole.keys().collect::<Vec<_>>(),
        "the checkpoint's tensors"
    );
    let mut worst = 0.0f32;
    for (name, want) in &whole {
        let got = &saved[name];
        assert_eq!(got.len(), want.len(), "`{name}`");
        for (a, b) in got.iter().zip(want) {
            let gap = (a - b).abs() / b.abs().max(1.0);
            assert!(gap <= 1e-5, "`{name}`: {a} vs {b}");
            worst = worst.max(gap);
        }
    }
    eprintln!("dp=2,tp=2,ep=2: worst parameter/slot difference {worst:e}");
    let resume = dir.join("saved");
    assert_eq!(run(&graph, &mesh, 3, &resume).len(), 3);
    let resumed = run(&graph, &[], 5, &resume);
    let worst = assert_same_losses(&resumed, &losses[3..], 1e-6);
    eprintln!("dp=2,tp=2,ep=2 checkpoint in one process: worst {worst:e}");
    // dp=4,tp=2,ep=2 on 8: each expert shard held by 2 replicas, its gradient summed over
    // them (experts_dp<s>_t<t>).
    let eight = [
        "--cluster",
        "examples/gpt/cluster-8workers.json",
        "--mesh",
        "dp=4,tp=2,ep=2",
    ];
    let losses = run(&graph, &eight, 5, &dir.join("dp4"));
    let worst = assert_same_losses(&losses, &local, 1e-5);
    eprintln!("dp=4,tp=2,ep=2: worst relative loss difference {worst:e}");
}

/// `dp=2,tp=2,ep=2 --zero-stage 1|2|3` on 4 workers (top-2 with the load-balancing loss,
/// clipped at global norm 0.1 every step): each rank's dense Adam slots (its tp shards' and
/// the replicated parameters') sharded over its `data_t<t>` group, the expert shards' whole
/// (dp = ep: no other replica holds them), one global clipping norm; ZeRO-3 also shards the
/// weights so (the expert shards stay whole), gathered just before each pass, and the
/// evaluation gathers them per use on tp group 0 (the experts on their ranks): its printed
/// validation loss is one process's at every stage. 4 steps' losses equal one
/// process's within 1e-5, the final checkpoint (ZeRO's flat shards, the tp shards and the expert
/// shards joined) holds the same parameters and Adam moments within 1e-5, and a checkpoint
/// written after 2 steps resumes in one process with the job's steps 3–4 (and a one-process
/// checkpoint under `dp=4,tp=2,ep=2` ZeRO-2 with one process's). `dp=4,tp=2,ep=2`
/// on 8 workers (each expert shard's slots, and at ZeRO-3 the shard itself, sharded over its 2
/// holders, `experts_dp<s>_t<t>`) at ZeRO-1, ZeRO-2 and ZeRO-3 equals one process too (losses,
/// parameters and moments; ZeRO-3's validation loss too), and `dflow
/// partition` shows where its slot shards live.
#[test]
fn dp2_tp2_ep2_zero_trains_like_one_process_and_resumes_in_one() {
    let dir = scratch("mesh-expert-tp-zero");
    let graph = tiny_moe_gpt(&dir, 2, Some(0.1));
    let one = dir.join("one");
    let (local, one_validation) = run_out(&graph, &[], 4, &one);
    assert!(!one_validation.is_empty(), "no validation loss printed");
    assert_eq!(local.len(), 4);
    let whole = checkpoint_f32(&one);
    for stage in ["1", "2", "3"] {
        let mesh = [
            "--cluster",
            FOUR,
            "--mesh",
            "dp=2,tp=2,ep=2",
            "--zero-stage",
            stage,
        ];
        let ckpt = dir.join(format!("zero{stage}"));
        let (losses, validation) = run_out(&graph, &mesh, 4, &ckpt);
        let worst = assert_same_losses(&losses, &local, 1e-5);
        eprintln!("dp=2,tp=2,ep=2 ZeRO-{stage}: worst relative loss difference {worst:e}");
        // Evaluated on tp group 0's shards, the experts on their replicas' ranks (under
        // ZeRO-3 each rank gathering its flat shards per use): one process's.
        assert_eq!(validation, one_validation, "dp=2,tp=2,ep=2 ZeRO-{stage}");
        let worst = assert_same_tensors_f32(
            &format!("ZeRO-{stage}"),
            &checkpoint_f32(&ckpt),
            &whole,
            1e-5,
        );
        eprintln!("dp=2,tp=2,ep=2 ZeRO-{stage}: worst parameter/slot difference {worst:e}");
        let saved = dir.join(format!("zero{stage}-saved"));
        assert_eq!(run(&graph, &mesh, 2, &saved).len(), 2);
        let resumed = run(&graph, &[], 4, &saved);
        let worst = assert_same_losses(&resumed, &losses[2..], 1e-6);
        eprintln!("dp=2,tp=2,ep=2 ZeRO-{stage} checkpoint in one process: worst {worst:e}");
    }
    // A one-process checkpoint resumes under dp=4,tp=2,ep=2 ZeRO-2 (split into tp shards,
    // expert row shards and ZeRO's flat slot shards) with the one-process losses.
    let from_one = dir.join("one-saved");
    assert_eq!(run(&graph, &[], 2, &from_one).len(), 2);
    let eight_zero2 = [
        "--cluster",
        "examples/gpt/cluster-8workers.json",
        "--mesh",
        "dp=4,tp=2,ep=2",
        "--zero-stage",
        "2",
    ];
    let resumed = run(&graph, &eight_zero2, 4, &from_one);
    let worst = assert_same_losses(&resumed, &local[2..], 1e-5);
    eprintln!("one process's checkpoint under dp=4,tp=2,ep=2 ZeRO-2: worst {worst:e}");
    for stage in ["1", "2", "3"] {
        let eight = [
            "--cluster",
            "examples/gpt/cluster-8workers.json",
            "--mesh",
            "dp=4,tp=2,ep=2",
            "--zero-stage",
            stage,
        ];
        let ckpt = dir.join(format!("dp4-zero{stage}"));
        let (losses, validation) = run_out(&graph, &eight, 4, &ckpt);
        let worst = assert_same_losses(&losses, &local, 1e-5);
        // Under ZeRO-3 each expert shard joined from its flat halves on its rank of tp
        // coordinate 0, never on worker 0.
        assert_eq!(validation, one_validation, "dp=4,tp=2,ep=2 ZeRO-{stage}");
        eprintln!("dp=4,tp=2,ep=2 ZeRO-{stage}: worst relative loss difference {worst:e}");
        let what = format!("dp=4,tp=2,ep=2 ZeRO-{stage}");
        let worst = assert_same_tensors_f32(&what, &checkpoint_f32(&ckpt), &whole, 1e-5);
        eprintln!("{what}: worst parameter/slot difference {worst:e}");
    }
    // Where the slots live: a tp shard's in 4 flat shards over its data_t<t> group; an expert
    // shard's in 2 over its holders of one tp coordinate (experts_dp<s>_t<t>), the same name on
    // both tp ranks of a replica.
    let out = dflow(&[
        "partition",
        graph.to_str().unwrap(),
        "--cluster",
        "examples/gpt/cluster-8workers.json",
        "--features",
        "idx",
        "--labels",
        "targets",
        "--mesh",
        "dp=4,tp=2,ep=2",
        "--zero-stage",
        "1",
        "--batch-size",
        "8",
    ]);
    let text = stdout(&out);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let w = |i: usize| format!("/job:worker/replica:0/task:{i}");
    for (var, on) in [
        (
            "transformer.wte.weight/tp_1_of_2/adam_m/shard_2_of_4 ",
            w(5),
        ),
        (
            "transformer.h.0.mlp.experts.c_fc.weight/shard_1/adam_v/shard_1_of_2 ",
            format!("{}, {}", w(6), w(7)),
        ),
    ] {
        let line = text
            .lines()
            .find(|l| l.contains(var))
            .unwrap_or_else(|| panic!("no `{var}` in:\n{text}"));
        assert!(line.ends_with(&format!("on {on}")), "{line}");
    }
    assert!(
        !text.contains("transformer.wte.weight/tp_1_of_2/adam_m "),
        "a whole dense slot:\n{text}"
    );
}

/// `dflow partition --mesh dp=4,ep=2` prints the expert-parallel groups {0,1} {2,3} and the
/// expert-data-parallel groups {0,2} {1,3} beside the group of all workers, and each worker's
/// shards; bad meshes are refused naming the axis.
#[test]
fn partition_shows_the_expert_groups_and_bad_meshes_are_refused() {
    let dir = scratch("mesh-expert-partition");
    let graph = tiny_moe_gpt(&dir, 1, None);
    let graph_s = graph.to_string_lossy().into_owned();
    let partition = |cluster: &str, extra: &[&str]| {
        let mut args = vec![
            "partition",
            graph_s.as_str(),
            "--cluster",
            cluster,
            "--features",
            "idx",
            "--labels",
            "targets",
        ];
        args.extend(extra);
        dflow(&args)
    };
    let out = partition(FOUR, &["--mesh", "dp=4,ep=2", "--batch-size", "8"]);
    let text = stdout(&out);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let w = |i: usize| format!("/job:worker/replica:0/task:{i}");
    for (key, members) in [
        ("workers", vec![0, 1, 2, 3]),
        ("experts_ep0", vec![0, 1]),
        ("experts_ep1", vec![2, 3]),
        ("experts_dp0", vec![0, 2]),
        ("experts_dp1", vec![1, 3]),
    ] {
        let line = format!(
            "collective group {key}: {}",
            members.iter().map(|&i| w(i)).collect::<Vec<_>>().join(", ")
        );
        assert!(text.contains(&line), "no `{line}` in:\n{text}");
    }
    assert!(
        text.contains("experts spread over groups of 2 workers"),
        "{text}"
    );
    // Shard 1 of a layer's expert weight lives on workers 1 and 3.
    let shard = text
        .lines()
        .find(|l| l.contains("transformer.h.0.mlp.experts.c_fc.weight/shard_1 "))
        .unwrap_or_else(|| panic!("no shard 1 line in:\n{text}"));
    assert!(
        shard.ends_with(&format!("on {}, {}", w(1), w(3))),
        "{shard}"
    );

    // ZeRO-3 beside the experts: each worker keeps its flat shard of every dense weight and of
    // its expert shard (shard 1's halves on workers 1 and 3), gathered over `workers` and
    // `experts_dp<k>` just before each use.
    let out = partition(
        FOUR,
        &[
            "--mesh",
            "dp=4,ep=2",
            "--zero-stage",
            "3",
            "--batch-size",
            "8",
        ],
    );
    let text = stdout(&out);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("ZeRO stage 3"), "{text}");
    for (var, on) in [
        ("transformer.wte.weight/shard_3_of_4 ", 3),
        (
            "transformer.h.0.mlp.experts.c_fc.weight/shard_1/shard_0_of_2 ",
            1,
        ),
        (
            "transformer.h.0.mlp.experts.c_fc.weight/shard_1/shard_1_of_2 ",
            3,
        ),
    ] {
        let line = text
            .lines()
            .find(|l| l.contains(var))
            .unwrap_or_else(|| panic!("no `{var}` in:\n{text}"));
        assert!(line.ends_with(&format!("on {}", w(on))), "{line}");
    }
    assert!(
        !text.contains("transformer.wte.weight "),
        "a whole dense weight under ZeRO-3:\n{text}"
    );

    for (cluster, extra, want) in [
        (
            FOUR,
            vec!["--mesh", "dp=4,ep=3"],
            "mesh axis ep=3 does not divide the data-parallel axis dp (4)",
        ),
        (
            "examples/gpt/cluster-8workers.json",
            vec!["--mesh", "dp=8,ep=8"],
            "has 4 experts, which do not split evenly over the 8 workers of an expert-parallel group (ep=8)",
        ),
        (
            FOUR,
            vec!["--mesh", "dp=2,tp=2", "--batch-size", "8"],
            "tensor parallelism splits dense MLPs only; an MoE GPT runs beside tensor parallelism with its experts over ep (--mesh dp=D,tp=T,ep=E), or with --mesh dp=D,ep=E (tp=1) or --strategy expert",
        ),
        (
            FOUR,
            vec!["--mesh", "dp=4,ep=2", "--strategy", "allreduce"],
            "runs --strategy expert, not --strategy allreduce",
        ),
    ] {
        let out = partition(cluster, &extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert!(err.contains(want), "{extra:?}: no `{want}` in:\n{err}");
    }
}

/// 4 real `dflow` processes on 127.0.0.1 under `--mesh dp=4,ep=2` (the groups' collectives
/// over the transport, each process building its own worker's graph), without ZeRO, with
/// ZeRO-2 (its steps over `workers` and `experts_dp<k>` and the clipping norm over
/// `experts_ep<g>`, in one order on every process) and with ZeRO-3 (also the parameters'
/// just-in-time gathers over those groups, and the evaluation reading other processes'
/// shards), and under `--mesh dp=2,tp=2,ep=2` (four kinds of groups, the evaluation joining
/// tp and expert shards from other processes): 3 steps equal one process within 1e-5.
#[test]
fn four_processes_under_dp4_ep2_train_like_one_process() {
    use std::time::Duration;
    let _serial = serial();
    let dir = scratch("mesh-expert-processes");
    let graph = tiny_moe_gpt(&dir, 2, Some(0.1));
    let graph_s = graph.to_string_lossy().into_owned();
    let (local, one_validation) = run_out(&graph, &[], 3, &dir.join("one"));
    assert!(!one_validation.is_empty(), "no validation loss printed");
    for (mesh, zero) in [
        ("dp=4,ep=2", None),
        ("dp=4,ep=2", Some("2")),
        ("dp=4,ep=2", Some("3")),
        ("dp=2,tp=2,ep=2", None),
    ] {
        let cluster = Cluster::new(0, 4);
        let losses = cluster.path("job-losses.txt");
        let losses_s = losses.to_string_lossy().into_owned();
        let mut common = vec![
            "--data",
            "examples/data/shakespeare.txt.gz",
            "--batch-size",
            "8",
            "--steps",
            "3",
            "--eval-batches",
            "1",
            "--quiet",
            "--mesh",
            mesh,
        ];
        if let Some(stage) = zero {
            common.extend(["--zero-stage", stage]);
        }
        let others: Vec<Task> = (1..4)
            .map(|i| Task::start(&cluster, "worker", i, &common))
            .collect();
        let mut chief_args = vec![graph_s.as_str()];
        chief_args.extend(common.iter().copied());
        chief_args.extend(["--losses-out", &losses_s]);
        let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(Duration::from_secs(180));
        chief.assert_success();
        for t in others {
            t.wait(Duration::from_secs(30)).assert_success();
        }
        let job = read_losses(&losses);
        assert_eq!(job.len(), 3);
        let worst = assert_same_losses(&job, &local, 1e-5);
        eprintln!("4 processes, {mesh}, ZeRO {zero:?}: worst relative difference {worst:e}");
        // The experts evaluated on their ranks across processes: one process's loss.
        let validation = chief
            .stdout
            .lines()
            .find(|l| l.starts_with("validation loss: "))
            .unwrap_or_default();
        assert_eq!(
            validation, one_validation,
            "4 processes, {mesh}, ZeRO {zero:?}"
        );
    }
}

/// The evaluations that run collectives beside sends between tasks (`dp,ep` and `dp,tp,ep` at
/// ZeRO-3: per-use gathers that the expert ranks join; `dp,tp,ep`: tp collectives beside the
/// batch (72 rows × 16 tokens: more than a cheap node's 1024 elements) and the MoE outputs sent
/// to rank 1) finish on one CPU, where each task has one compute thread and a task blocked in a
/// collective before a `Send` its peer waits for has run would wait for ever, and print one
/// process's validation loss. Skipped without `taskset`.
#[test]
fn zero3_evaluations_beside_experts_finish_on_one_cpu_with_one_process_s_loss() {
    let pinned = std::process::Command::new("taskset")
        .args(["-c", "0", "true"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !pinned {
        eprintln!("no taskset: skipped");
        return;
    }
    let dir = scratch("mesh-expert-one-cpu");
    let graph = tiny_moe_gpt(&dir, 2, Some(0.1));
    let validation = |extra: &[&str]| {
        let out = std::process::Command::new("taskset")
            .args(["-c", "0"])
            .arg(env!("CARGO_BIN_EXE_dflow"))
            .args(["run", "--local"])
            .arg(&graph)
            .args(extra)
            .args([
                "--data",
                "examples/data/shakespeare.txt.gz",
                "--batch-size",
                "72",
                "--steps",
                "1",
                "--eval-batches",
                "1",
                "--timeout",
                "20",
                "--quiet",
            ])
            .current_dir(repo())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{extra:?}: {stderr}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.starts_with("validation loss: "))
            .unwrap_or_default()
            .to_string()
    };
    let one = validation(&[]);
    assert!(!one.is_empty(), "no validation loss printed");
    for mesh in [
        &["--cluster", TWO, "--mesh", "dp=2,ep=2", "--zero-stage", "3"][..],
        &[
            "--cluster",
            FOUR,
            "--mesh",
            "dp=2,tp=2,ep=2",
            "--zero-stage",
            "3",
        ],
        &["--cluster", FOUR, "--mesh", "dp=2,tp=2,ep=2"],
    ] {
        assert_eq!(validation(mesh), one, "{mesh:?}");
    }
}
