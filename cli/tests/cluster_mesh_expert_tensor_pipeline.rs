//! The 4-axis mesh `--mesh dp=D,tp=T,pp=P,ep=E`: a MoE GPT's ranks as `--mesh dp=D,tp=T,ep=E`
//! builds them (attention, embedding and loss split over tp, the MoE MLPs replicated over tp
//! with their experts spread over ep replicas) cut into P pipeline stages, each stage's
//! collectives in groups of their own
//! (partitioner/src/strategy/tensor/experts_pipeline.rs).
//!
//! The two-block GPT with 4-expert MoE MLPs at capacity factor 4 drops no token, so the job
//! equals one process. With the load-balancing loss on (α = 0.01) the job runs one
//! micro-batch (the loss couples a batch's tokens); with α = 0 it runs several. Every task runs
//! in this process (`--local --cluster`) but one test, which starts 8 real processes.

mod support;

use dflow::graph::layers::{gpt, GptConfig, MoeConfig};
use std::path::{Path, PathBuf};
use support::*;

const EIGHT: &str = "examples/gpt/cluster-8workers.json";
const MESH: &str = "dp=2,tp=2,pp=2,ep=2";

/// A two-block GPT (16 characters of context, 16 channels, 2 heads) with 4-expert MoE MLPs,
/// top-`top_k` routing at capacity factor 4 (nothing dropped), load-balancing coefficient
/// `aux`, clipped at global norm `grad_clip`.
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

/// `dp=2,tp=2,pp=2,ep=2` (8 tasks: stage 0 on workers 0-3, stage 1 on 4-7; in each stage the
/// tp pairs {0,1} {2,3} and each tp coordinate's replicas sharing the experts), top-2 routing
/// with the load-balancing loss, clipped at global norm 0.1: 4 steps' losses, the validation
/// loss (worker 0's copy joining the tp and expert shards of both stages), and the final
/// parameters and Adam moments equal one process's within 1e-5; the checkpoint holds every
/// tensor whole under its one-process name, one written after 2 steps resumes in one process
/// with the uninterrupted job's steps 3-4, and one process's after 2 steps resumes on the mesh
/// with one process's steps 3-4.
#[test]
fn dp2_tp2_pp2_ep2_trains_like_one_process_and_resumes_in_one() {
    let dir = scratch("mesh-expert-tensor-pipeline");
    let graph = tiny_moe_gpt(&dir, 2, 0.01, Some(0.1));
    let one = dir.join("one");
    let (local, one_validation) = run_text_local(&graph, &[], 4, &one);
    assert_eq!(local.len(), 4);
    assert!(!one_validation.is_empty(), "no validation loss printed");
    let mesh = ["--cluster", EIGHT, "--mesh", MESH];
    let full = dir.join("full");
    let (job, validation) = run_text_local(&graph, &mesh, 4, &full);
    let worst = assert_same_losses(&job, &local, 1e-5);
    eprintln!("{MESH}: worst relative loss difference {worst:e}");
    assert_eq!(validation, one_validation);
    let saved = checkpoint_f32(&full);
    assert!(
        !saved
            .keys()
            .any(|n| n.contains("/shard_") || n.contains("/tp_")),
        "shards saved by their per-worker names: {:?}",
        saved.keys().collect::<Vec<_>>()
    );
    let worst = assert_same_tensors_f32("checkpoint", &saved, &checkpoint_f32(&one), 1e-5);
    eprintln!("{MESH}: worst parameter/slot difference {worst:e}");

    let part = dir.join("part");
    assert_eq!(run_text_local(&graph, &mesh, 2, &part).0.len(), 2);
    let resumed = run_text_local(&graph, &[], 4, &part).0;
    let worst = assert_same_losses(&resumed, &job[2..], 1e-5);
    eprintln!("{MESH} checkpoint in one process: steps 3-4 worst {worst:e}");

    // And back: one process's checkpoint after 2 steps resumes on the mesh.
    let back = dir.join("back");
    assert_eq!(run_text_local(&graph, &[], 2, &back).0.len(), 2);
    let resumed = run_text_local(&graph, &mesh, 4, &back).0;
    let worst = assert_same_losses(&resumed, &local[2..], 1e-5);
    eprintln!("one-process checkpoint on {MESH}: steps 3-4 worst {worst:e}");
}

/// ZeRO over the 4-axis mesh (`--zero-stage 1`, `2` and `3`): each (stage, shard)'s dense
/// Adam slots (and at stage 3 its weights, gathered per micro-batch and pass) sharded over its
/// dp group, the expert shards' whole (E = D: no other replica holds them), one global
/// clipping norm (0.1, with the load-balancing loss): 3 steps' losses, the validation loss
/// (at stage 3 worker 0's copy joining every flat shard), and the final parameters and Adam
/// moments equal one process's within 1e-5 under their one-process names; a checkpoint
/// written after 2 steps resumes in one process with the job's step 3.
#[test]
fn zero_1_2_and_3_over_the_4_axis_mesh_train_like_one_process_and_resume_in_one() {
    let dir = scratch("mesh-expert-tensor-pipeline-zero");
    let graph = tiny_moe_gpt(&dir, 2, 0.01, Some(0.1));
    let one = dir.join("one");
    let (local, one_validation) = run_text_local(&graph, &[], 3, &one);
    let want = checkpoint_f32(&one);
    for stage in ["1", "2", "3"] {
        let args = ["--cluster", EIGHT, "--mesh", MESH, "--zero-stage", stage];
        let full = dir.join(format!("zero{stage}"));
        let (job, validation) = run_text_local(&graph, &args, 3, &full);
        let worst = assert_same_losses(&job, &local, 1e-5);
        eprintln!("{MESH} --zero-stage {stage}: worst relative loss difference {worst:e}");
        assert_eq!(validation, one_validation, "--zero-stage {stage}");
        let saved = checkpoint_f32(&full);
        assert!(
            !saved
                .keys()
                .any(|n| n.contains("/shard_") || n.contains("/tp_")),
            "shards saved by their per-worker names: {:?}",
            saved.keys().collect::<Vec<_>>()
        );
        let worst = assert_same_tensors_f32("checkpoint", &saved, &want, 1e-5);
        eprintln!("{MESH} --zero-stage {stage}: worst parameter/slot difference {worst:e}");
        let part = dir.join(format!("zero{stage}-part"));
        assert_eq!(run_text_local(&graph, &args, 2, &part).0.len(), 2);
        let resumed = run_text_local(&graph, &[], 3, &part).0;
        let worst = assert_same_losses(&resumed, &job[2..], 1e-5);
        eprintln!("{MESH} --zero-stage {stage} checkpoint in one process: worst {worst:e}");
    }
}

/// `dp=4,tp=2,pp=2,ep=2` (16 tasks): each expert shard is held by 2 replicas of its stage and
/// tp coordinate, its gradient summed over them (`experts_dp<k>_s<s>_t<t>`); without ZeRO and
/// with ZeRO-2 (each expert shard's slots halved over those replicas) and ZeRO-3 (its rows'
/// flat shards too, gathered per micro-batch and pass, joined for worker 0's evaluation), with
/// 2 micro-batches (α = 0), 2 steps and the validation loss equal one process's within 1e-5.
#[test]
fn dp4_tp2_pp2_ep2_sums_each_expert_shard_over_its_holders() {
    let dir = scratch("mesh-expert-tensor-pipeline-dp4");
    let cluster = dir.join("cluster-16workers.json");
    let workers: Vec<String> = (0..16)
        .map(|i| format!("\"127.0.0.1:{}\"", 2300 + i))
        .collect();
    std::fs::write(
        &cluster,
        format!("{{\"worker\": [{}]}}", workers.join(", ")),
    )
    .unwrap();
    let cluster = cluster.to_str().unwrap();
    let graph = tiny_moe_gpt(&dir, 1, 0.0, Some(0.1));
    let (local, one_validation) = run_text_local(&graph, &[], 2, &dir.join("one"));
    for zero in [None, Some("2"), Some("3")] {
        let mut args = vec![
            "--cluster",
            cluster,
            "--mesh",
            "dp=4,tp=2,pp=2,ep=2",
            "--micro-batches",
            "2",
        ];
        if let Some(stage) = zero {
            args.extend(["--zero-stage", stage]);
        }
        let (job, validation) =
            run_text_local(&graph, &args, 2, &dir.join(format!("job-{zero:?}")));
        let worst = assert_same_losses(&job, &local, 1e-5);
        assert_eq!(validation, one_validation, "ZeRO {zero:?}");
        eprintln!("dp=4,tp=2,pp=2,ep=2 ZeRO {zero:?}: worst relative loss difference {worst:e}");
    }
}

/// Without the load-balancing loss (α = 0) and at capacity factor E, a MoE layer treats every
/// token alone, so a step may be cut into micro-batches: `dp=2,tp=2,pp=2,ep=2` with 2
/// micro-batches (1F1B) and with 4 (GPipe), each micro-batch's all-to-alls, Megatron
/// collectives and router gathers under keys of their own, equal one process within 1e-5
/// over 3 steps; so does a four-block model under the interleaved schedule (2 chunks per
/// device, 2 micro-batches). With α > 0, more than one micro-batch is refused naming the
/// load-balancing loss.
#[test]
fn micro_batches_of_an_uncoupled_moe_train_like_one_process() {
    let dir = scratch("mesh-expert-tensor-pipeline-micro");
    let graph = tiny_moe_gpt(&dir, 1, 0.0, Some(0.1));
    let local = run_text_local(&graph, &[], 3, &dir.join("one")).0;
    for extra in [
        ["--micro-batches", "2", "--schedule", "1f1b"],
        ["--micro-batches", "4", "--schedule", "gpipe"],
    ] {
        let mut args = vec!["--cluster", EIGHT, "--mesh", MESH];
        args.extend(extra);
        let tag = format!("m{}-{}", extra[1], extra[3]);
        let job = run_text_local(&graph, &args, 3, &dir.join(tag)).0;
        let worst = assert_same_losses(&job, &local, 1e-5);
        eprintln!("{MESH} {extra:?}: worst relative loss difference {worst:e}");
    }
    let four = moe_gpt_of(&dir, 4, 1, 0.0, Some(0.1));
    let local = run_text_local(&four, &[], 3, &dir.join("one-4")).0;
    let args = [
        "--cluster",
        EIGHT,
        "--mesh",
        MESH,
        "--micro-batches",
        "2",
        "--schedule",
        "interleaved",
    ];
    let job = run_text_local(&four, &args, 3, &dir.join("interleaved")).0;
    let worst = assert_same_losses(&job, &local, 1e-5);
    eprintln!("{MESH} interleaved, 4 blocks: worst relative loss difference {worst:e}");
    let coupled = tiny_moe_gpt(&dir, 1, 0.01, None);
    let out = partition(&coupled, &["--mesh", MESH, "--micro-batches", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "2 micro-batches with α > 0 accepted");
    assert!(
        err.contains("(MoeAuxLoss) couples the examples of a batch"),
        "{err}"
    );
}

/// `dflow partition GRAPH --cluster EIGHT --batch-size 8 ...` for the features `idx` and the
/// labels `targets`.
fn partition(graph: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "partition",
        graph.to_str().unwrap(),
        "--cluster",
        EIGHT,
        "--features",
        "idx",
        "--labels",
        "targets",
        "--batch-size",
        "8",
    ];
    args.extend(extra);
    dflow(&args)
}

/// `dflow partition --mesh dp=2,tp=2,pp=2,ep=2` prints each stage's tp, dp and
/// expert-parallel groups (Megatron-core's rank order: tp fastest, then dp, then pp), each
/// block's expert shards on its own stage's replicas (held by both tp ranks of a replica), and
/// under ZeRO-3 each rank's flat shard of its stage's tp shards.
#[test]
fn partition_shows_each_stages_groups_and_shards() {
    let dir = scratch("mesh-expert-tensor-pipeline-partition");
    let graph = tiny_moe_gpt(&dir, 1, 0.01, None);
    let out = partition(&graph, &["--mesh", MESH]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    let w = |i: u32| format!("/job:worker/replica:0/task:{i}");
    for (group, members) in [
        ("tensor_s0_d0", [0, 1]),
        ("tensor_s0_d1", [2, 3]),
        ("tensor_s1_d1", [6, 7]),
        ("pipeline/stage0_t0", [0, 2]),
        ("pipeline/stage0_t1", [1, 3]),
        ("pipeline/stage1_t1", [5, 7]),
        ("experts_ep0_s0_t0", [0, 2]),
        ("experts_ep0_s1_t1", [5, 7]),
    ] {
        let line = format!(
            "collective group {group}: {}, {}",
            w(members[0]),
            w(members[1])
        );
        assert!(text.contains(&line), "no `{line}` in:\n{text}");
    }
    assert!(!text.contains("experts_dp"), "E = D: no expert-data group");
    for (block, shard, on) in [
        (0, 0, [0, 1]),
        (0, 1, [2, 3]),
        (1, 0, [4, 5]),
        (1, 1, [6, 7]),
    ] {
        let var = format!("transformer.h.{block}.mlp.experts.c_fc.weight/shard_{shard} ");
        let line = text
            .lines()
            .find(|l| l.contains(&var))
            .unwrap_or_else(|| panic!("no `{var}` in:\n{text}"));
        assert!(
            line.ends_with(&format!("on {}, {}", w(on[0]), w(on[1]))),
            "{line}"
        );
    }
    // ZeRO-3: rank s·4 + d·2 + t keeps flat shard d of its tp shard of every stage-s dense
    // weight; the expert shards stay whole on their replica's two tp ranks (E = D).
    let out = partition(&graph, &["--mesh", MESH, "--zero-stage", "3"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = stdout(&out);
    assert!(text.contains("ZeRO stage 3"), "{text}");
    for (var, on) in [
        (
            "transformer.h.1.attn.c_attn.weight/tp_1_of_2/shard_1_of_2 ",
            w(7),
        ),
        (
            "transformer.h.1.mlp.experts.c_fc.weight/shard_1 ",
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
        !text.contains("transformer.h.1.attn.c_attn.weight/tp_1_of_2 "),
        "a whole tp shard under ZeRO-3:\n{text}"
    );
}

/// 8 real `dflow` processes on 127.0.0.1 under `--mesh dp=2,tp=2,pp=2,ep=2` (each process
/// building its own worker's graph; Megatron's collectives, the all-to-alls, router gathers,
/// gradient sums and clipping norms over the transport): 3 steps equal one process within
/// 1e-5.
#[test]
fn eight_processes_under_the_4_axis_mesh_train_like_one_process() {
    use std::time::Duration;
    let _serial = serial();
    let dir = scratch("mesh-expert-tensor-pipeline-processes");
    let graph = tiny_moe_gpt(&dir, 2, 0.01, Some(0.1));
    let graph_s = graph.to_string_lossy().into_owned();
    let local = run_text_local(&graph, &[], 3, &dir.join("one")).0;
    let cluster = Cluster::new(0, 8);
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
        MESH,
    ];
    let others: Vec<Task> = (1..8)
        .map(|i| Task::start(&cluster, "worker", i, &common))
        .collect();
    let mut chief_args = vec![graph_s.as_str()];
    chief_args.extend(common.iter().copied());
    chief_args.extend(["--losses-out", &losses_s]);
    let chief = Task::start(&cluster, "worker", 0, &chief_args).wait(Duration::from_secs(240));
    chief.assert_success();
    for t in others {
        t.wait(Duration::from_secs(30)).assert_success();
    }
    let job = read_losses(&losses);
    assert_eq!(job.len(), 3);
    let worst = assert_same_losses(&job, &local, 1e-5);
    eprintln!("8 processes, {MESH}: worst relative difference {worst:e}");
}
