//! `--mesh dp=D,ep=E,pp=P`: a MoE GPT cut into P pipeline stages, each stage's D replicas
//! sharing its MoE layers' experts in expert-parallel groups of E (all-to-all per micro-batch),
//! the dense gradients summed over the stage's replicas (partitioner/src/strategy/expert/pipeline.rs).
//!
//! The two-block GPT with 4-expert MoE MLPs at capacity factor 4 drops no token, so the job
//! equals one process. With the load-balancing loss on (α = 0.01) the job runs one
//! micro-batch (the loss couples a batch's tokens); with α = 0 it runs several. Every task runs
//! in this process (`--local --cluster`) but one test, which starts 4 real processes.

mod support;

use dflow::graph::layers::{gpt, GptConfig, MoeConfig};
use std::path::{Path, PathBuf};
use support::*;

const FOUR: &str = "examples/gpt/cluster-4workers.json";
const EIGHT: &str = "examples/gpt/cluster-8workers.json";

/// A two-block GPT (16 characters of context, 16 channels) with 4-expert MoE MLPs, top-`top_k`
/// routing at capacity factor 4 (nothing dropped), load-balancing coefficient `aux`, clipped
/// at global norm `grad_clip`.
fn tiny_moe_gpt(dir: &Path, top_k: usize, aux: f64, grad_clip: Option<f64>) -> PathBuf {
    moe_gpt_of(dir, 2, top_k, aux, grad_clip)
}

/// [`tiny_moe_gpt`] with `layers` blocks.
fn moe_gpt_of(
    dir: &Path,
    layers: usize,
    top_k: usize,
    aux: f64,
    grad_clip: Option<f64>,
) -> PathBuf {
    let cfg = GptConfig {
        block_size: 16,
        n_layer: layers,
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
            aux_loss_coef: aux,
        }),
        ..GptConfig::default()
    };
    let model = gpt(&cfg).unwrap();
    let path = dir.join(format!(
        "tiny-moe-{layers}-top{top_k}-aux{aux}-clip{grad_clip:?}.json"
    ));
    std::fs::write(&path, dflow::graph::format::to_json(&model.def)).unwrap();
    path
}

/// `dflow run --local GRAPH` for `steps` steps of a global batch of 8 with `extra` flags (a
/// cluster and a mesh, or none: one process), checkpointing to (and resuming from) `ckpt`: its
/// losses.
fn run(graph: &Path, extra: &[&str], steps: u32, ckpt: &Path) -> Vec<(u64, f64)> {
    run_out(graph, extra, steps, ckpt).0
}

/// [`run`]: its losses and the final validation loss line ([`support::run_text_local`]).
fn run_out(graph: &Path, extra: &[&str], steps: u32, ckpt: &Path) -> (Vec<(u64, f64)>, String) {
    run_text_local(graph, extra, steps, ckpt)
}

/// `dp=2,ep=2,pp=2` (4 tasks: stage 0 on workers 0 and 1, stage 1 on 2 and 3; each stage's
/// experts split over its two replicas), top-2 routing with the load-balancing loss, clipped
/// at global norm 0.1: 5 steps' losses and the final parameters and Adam moments equal one
/// process's within 1e-5, and the validation loss (evaluated on replica 0's stages, each MoE
/// layer's experts joined on its stage's worker) as printed; the checkpoint holds the experts whole under their one-process
/// names, and one written after 3 steps resumes in one process with the uninterrupted job's
/// steps 4-5.
#[test]
fn dp2_ep2_pp2_trains_like_one_process_and_resumes_in_one() {
    let dir = scratch("mesh-expert-pipeline");
    let graph = tiny_moe_gpt(&dir, 2, 0.01, Some(0.1));
    let one = dir.join("one");
    let (local, one_validation) = run_out(&graph, &[], 5, &one);
    assert_eq!(local.len(), 5);
    assert!(!one_validation.is_empty(), "no validation loss printed");
    let mesh = ["--cluster", FOUR, "--mesh", "dp=2,ep=2,pp=2"];
    let full = dir.join("full");
    let (job, validation) = run_out(&graph, &mesh, 5, &full);
    let worst = assert_same_losses(&job, &local, 1e-5);
    eprintln!("dp=2,ep=2,pp=2: worst relative loss difference {worst:e}");
    assert_eq!(validation, one_validation);
    let saved = checkpoint_f32(&full);
    assert!(
        !saved.keys().any(|n| n.contains("/shard_")),
        "shards saved by their per-worker names: {:?}",
        saved.keys().collect::<Vec<_>>()
    );
    let worst = assert_same_tensors_f32("checkpoint", &saved, &checkpoint_f32(&one), 1e-5);
    eprintln!("dp=2,ep=2,pp=2: worst parameter/slot difference {worst:e}");

    let part = dir.join("part");
    assert_eq!(run(&graph, &mesh, 3, &part).len(), 3);
    let resumed = run(&graph, &[], 5, &part);
    let worst = assert_same_losses(&resumed, &job[3..], 1e-5);
    eprintln!("dp=2,ep=2,pp=2 checkpoint in one process: steps 4-5 worst {worst:e}");
}

/// ZeRO beside `ep` × `pp` (`--zero-stage 1`, `2` and `3`): on each stage the dense
/// parameters' Adam slots (and at stage 3 the weights, gathered per micro-batch) sharded over
/// the stage's replicas, each expert shard's over the stage's replicas holding it
/// (`dp=4,ep=2,pp=2`; with `E = D` they stay whole), one global clipping norm (0.1, with the
/// load-balancing loss): 4 steps' losses, the final validation loss, and the final parameters
/// and Adam moments equal one process's within 1e-5, the checkpoint holds every tensor under its one-process
/// name, and one written after 2 steps resumes in one process with the job's steps 3-4.
#[test]
fn zero_1_and_2_beside_ep_and_pp_train_like_one_process_and_resume_in_one() {
    let dir = scratch("mesh-expert-pipeline-zero");
    let graph = tiny_moe_gpt(&dir, 2, 0.01, Some(0.1));
    let one = dir.join("one");
    let (local, one_validation) = run_out(&graph, &[], 4, &one);
    assert!(!one_validation.is_empty(), "no validation loss printed");
    let want = checkpoint_f32(&one);
    for (cluster, mesh, stage) in [
        (FOUR, "dp=2,ep=2,pp=2", "1"),
        (FOUR, "dp=2,ep=2,pp=2", "2"),
        (EIGHT, "dp=4,ep=2,pp=2", "1"),
        (EIGHT, "dp=4,ep=2,pp=2", "2"),
        (FOUR, "dp=2,ep=2,pp=2", "3"),
        (EIGHT, "dp=4,ep=2,pp=2", "3"),
    ] {
        let args = ["--cluster", cluster, "--mesh", mesh, "--zero-stage", stage];
        let tag = format!("{mesh}-zero{stage}").replace([',', '='], "_");
        let full = dir.join(&tag);
        let (job, validation) = run_out(&graph, &args, 4, &full);
        let worst = assert_same_losses(&job, &local, 1e-5);
        eprintln!("{mesh} --zero-stage {stage}: worst relative loss difference {worst:e}");
        // The evaluation on replica 0's stages (each stage's expert shards, at stage 3 its dense
        // and expert flat shards, joined on its worker of replica 0): the one-process loss.
        assert_eq!(validation, one_validation, "{mesh} --zero-stage {stage}");
        let saved = checkpoint_f32(&full);
        assert!(
            !saved.keys().any(|n| n.contains("/shard_")),
            "shards saved by their per-worker names: {:?}",
            saved.keys().collect::<Vec<_>>()
        );
        let worst = assert_same_tensors_f32("checkpoint", &saved, &want, 1e-5);
        eprintln!("{mesh} --zero-stage {stage}: worst parameter/slot difference {worst:e}");
        if mesh == "dp=2,ep=2,pp=2" {
            let part = dir.join(format!("{tag}-part"));
            assert_eq!(run(&graph, &args, 2, &part).len(), 2);
            let resumed = run(&graph, &[], 4, &part);
            let worst = assert_same_losses(&resumed, &job[2..], 1e-5);
            eprintln!("{mesh} --zero-stage {stage} checkpoint in one process: worst {worst:e}");
        }
    }
}

/// Without the load-balancing loss (α = 0) and at capacity factor E, a MoE layer treats every
/// token alone, so a step may be cut into micro-batches: `dp=2,ep=2,pp=2` with 2 micro-batches
/// (1F1B) and 4 (GPipe), and `dp=4,ep=2,pp=2` (8 tasks: each expert shard's gradient summed over
/// the 2 replicas of its stage that hold it) with 2, equal one process within 1e-5 over 4 steps;
/// so does `dp=4,ep=2,pp=2 --zero-stage 2` (and `3`) with 2 (its final parameters and Adam
/// moments too), and a four-block model under the
/// interleaved schedule (2 chunks per device) over 3.
/// With α > 0, more than one micro-batch is refused naming the load-balancing loss.
#[test]
fn micro_batches_of_an_uncoupled_moe_train_like_one_process() {
    let dir = scratch("mesh-expert-pipeline-micro");
    let graph = tiny_moe_gpt(&dir, 1, 0.0, Some(0.1));
    let local = run(&graph, &[], 4, &dir.join("one"));
    for (cluster, mesh, extra) in [
        (
            FOUR,
            "dp=2,ep=2,pp=2",
            ["--micro-batches", "2", "--schedule", "1f1b"],
        ),
        (
            FOUR,
            "dp=2,ep=2,pp=2",
            ["--micro-batches", "4", "--schedule", "gpipe"],
        ),
        (
            EIGHT,
            "dp=4,ep=2,pp=2",
            ["--micro-batches", "2", "--schedule", "1f1b"],
        ),
    ] {
        let mut args = vec!["--cluster", cluster, "--mesh", mesh];
        args.extend(extra);
        let tag = format!("{mesh}-{}", extra[1]);
        let job = run(&graph, &args, 4, &dir.join(tag.replace([',', '='], "_")));
        let worst = assert_same_losses(&job, &local, 1e-5);
        eprintln!("{mesh} {extra:?}: worst relative loss difference {worst:e}");
    }
    // ZeRO-2 over each stage's groups, 2 micro-batches accumulated before the reduce-scatters;
    // ZeRO-3, each micro-batch's passes gathering the stage's dense and expert weight shards.
    for stage in ["2", "3"] {
        let args = [
            "--cluster",
            EIGHT,
            "--mesh",
            "dp=4,ep=2,pp=2",
            "--micro-batches",
            "2",
            "--zero-stage",
            stage,
        ];
        let ckpt = dir.join(format!("zero{stage}-m2"));
        let job = run(&graph, &args, 4, &ckpt);
        let worst = assert_same_losses(&job, &local, 1e-5);
        eprintln!(
            "dp=4,ep=2,pp=2 --zero-stage {stage}, 2 micro-batches: worst relative loss difference {worst:e}"
        );
        // The final parameters and Adam moments too (the checkpoint joins the shards).
        let worst = assert_same_tensors_f32(
            "checkpoint",
            &checkpoint_f32(&ckpt),
            &checkpoint_f32(&dir.join("one")),
            1e-5,
        );
        eprintln!(
            "dp=4,ep=2,pp=2 --zero-stage {stage}, 2 micro-batches: worst parameter/slot difference {worst:e}"
        );
    }
    // The interleaved schedule: 4 blocks in 4 virtual stages, 2 chunks per device.
    let four = moe_gpt_of(&dir, 4, 1, 0.0, Some(0.1));
    let local = run(&four, &[], 3, &dir.join("one-4"));
    let args = [
        "--cluster",
        FOUR,
        "--mesh",
        "dp=2,ep=2,pp=2",
        "--micro-batches",
        "2",
        "--schedule",
        "interleaved",
    ];
    let job = run(&four, &args, 3, &dir.join("interleaved"));
    let worst = assert_same_losses(&job, &local, 1e-5);
    eprintln!("dp=2,ep=2,pp=2 interleaved, 4 blocks: worst relative loss difference {worst:e}");
    let coupled = tiny_moe_gpt(&dir, 1, 0.01, None);
    let out = dflow(&[
        "partition",
        coupled.to_str().unwrap(),
        "--cluster",
        FOUR,
        "--features",
        "idx",
        "--labels",
        "targets",
        "--mesh",
        "dp=2,ep=2,pp=2",
        "--micro-batches",
        "2",
        "--batch-size",
        "8",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "2 micro-batches with α > 0 accepted");
    assert!(
        err.contains("(MoeAuxLoss) couples the examples of a batch"),
        "{err}"
    );
}

/// 4 real `dflow` processes on 127.0.0.1 under `--mesh dp=2,ep=2,pp=2` (each process building
/// its own worker's graph; the all-to-alls, router gathers, gradient sums and clipping norms
/// over the transport): 3 steps equal one process within 1e-5.
#[test]
fn four_processes_under_dp2_ep2_pp2_train_like_one_process() {
    use std::time::Duration;
    let _serial = serial();
    let dir = scratch("mesh-expert-pipeline-processes");
    let graph = tiny_moe_gpt(&dir, 2, 0.01, Some(0.1));
    let graph_s = graph.to_string_lossy().into_owned();
    let local = run(&graph, &[], 3, &dir.join("one"));
    let cluster = Cluster::new(0, 4);
    let losses = cluster.path("job-losses.txt");
    let losses_s = losses.to_string_lossy().into_owned();
    let common = vec![
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
        "dp=2,ep=2,pp=2",
    ];
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
    eprintln!("4 processes, dp=2,ep=2,pp=2: worst relative difference {worst:e}");
}

/// `dflow partition --mesh dp=2,ep=2,pp=2` prints each stage's data-parallel and
/// expert-parallel groups, and each block's expert shards on its own stage's replicas
/// (block 0 on workers 0 and 1, block 1 on workers 2 and 3), and under ZeRO-2 where the slot
/// shards live, and under ZeRO-3 the weights' shards; beside `ep` and `tp` (pp = 1) ZeRO-3
/// keeps each rank's flat shard of its tp shards.
#[test]
fn partition_shows_each_stages_expert_groups_and_shards() {
    let dir = scratch("mesh-expert-pipeline-partition");
    let graph = tiny_moe_gpt(&dir, 1, 0.01, None);
    let partition = |extra: &[&str]| {
        let mut args = vec![
            "partition",
            graph.to_str().unwrap(),
            "--cluster",
            FOUR,
            "--features",
            "idx",
            "--labels",
            "targets",
            "--batch-size",
            "8",
        ];
        args.extend(extra);
        dflow(&args)
    };
    let out = partition(&["--mesh", "dp=2,ep=2,pp=2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    let w = |i: u32| format!("/job:worker/replica:0/task:{i}");
    for (group, members) in [
        ("pipeline/stage0", [0, 1]),
        ("experts_ep0_s0", [0, 1]),
        ("pipeline/stage1", [2, 3]),
        ("experts_ep0_s1", [2, 3]),
    ] {
        let line = format!(
            "collective group {group}: {}, {}",
            w(members[0]),
            w(members[1])
        );
        assert!(text.contains(&line), "no `{line}` in:\n{text}");
    }
    for (block, shard, on) in [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)] {
        let line = format!(
            "transformer.h.{block}.mlp.experts.c_fc.weight/shard_{shard} f32[2, 64, 16] on {}\n",
            w(on)
        );
        assert!(text.contains(&line), "no `{line}` in:\n{text}");
    }
    // ZeRO-2: stage 1's dense slots halved over workers 2 and 3, its experts' whole (E = D).
    let out = partition(&["--mesh", "dp=2,ep=2,pp=2", "--zero-stage", "2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    for line in [
        format!(
            "transformer.h.1.attn.c_attn.weight/adam_m/shard_1_of_2 f32[384] on {}\n",
            w(3)
        ),
        format!(
            "transformer.h.1.mlp.experts.c_fc.weight/shard_1/adam_m f32[2, 64, 16] on {}\n",
            w(3)
        ),
    ] {
        assert!(text.contains(&line), "no `{line}` in:\n{text}");
    }
    // ZeRO-3: stage 1's dense weights halved over workers 2 and 3, its experts whole (E = D).
    let out = partition(&["--mesh", "dp=2,ep=2,pp=2", "--zero-stage", "3"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    for line in [
        format!(
            "transformer.h.1.attn.c_attn.weight/shard_1_of_2 f32[384] on {}\n",
            w(3)
        ),
        format!(
            "transformer.h.1.mlp.experts.c_fc.weight/shard_1 f32[2, 64, 16] on {}\n",
            w(3)
        ),
    ] {
        assert!(text.contains(&line), "no `{line}` in:\n{text}");
    }
    // ZeRO-3 beside ep and tp (pp = 1): rank t + 2·d keeps flat shard d of its tp shard of
    // every dense weight (over data_t<t>); the expert shards stay whole on their replica's
    // two tp ranks (E = D: no other replica holds them); no whole tp shard remains.
    let out = partition(&["--mesh", "dp=2,tp=2,ep=2", "--zero-stage", "3"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    assert!(text.contains("ZeRO stage 3"), "{text}");
    for (var, on) in [
        ("transformer.wte.weight/tp_1_of_2/shard_1_of_2 ", w(3)),
        (
            "transformer.h.1.mlp.experts.c_fc.weight/shard_1 ",
            format!("{}, {}", w(2), w(3)),
        ),
    ] {
        let line = text
            .lines()
            .find(|l| l.contains(var))
            .unwrap_or_else(|| panic!("no `{var}` in:\n{text}"));
        assert!(line.ends_with(&format!("on {on}")), "{line}");
    }
    assert!(
        !text.contains("transformer.wte.weight/tp_1_of_2 "),
        "a whole tp shard under ZeRO-3:\n{text}"
    );
}
