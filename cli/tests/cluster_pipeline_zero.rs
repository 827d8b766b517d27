//! ZeRO over a pipeline's data-parallel replicas (`--mesh dp=2,pp=2 --zero-stage 1|2`), workers
//! only, 4 tasks in one process (`--local`): a small GPT trained with AdamW and active
//! global-norm clipping has the losses of a one-process run over 5 steps, and a checkpoint
//! saved under dp2×pp2 with ZeRO-1 (whole slots joined from the replicas' shards) resumes in
//! one process with the uninterrupted run's next-step loss; `dflow partition` shows each stage's
//! replicas holding their shards of that stage's slots only.

mod support;

use std::path::Path;
use support::clipped_gpt::*;
use support::*;

/// `--mesh dp=2,pp=2 --zero-stage <stage> --micro-batches 2` on 4 tasks in this process.
fn mesh_flags(cluster: &Path, stage: &'static str) -> Vec<String> {
    [
        "--cluster",
        &cluster.to_string_lossy(),
        "--mesh",
        "dp=2,pp=2",
        "--zero-stage",
        stage,
        "--micro-batches",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[test]
fn dp2_pp2_with_zero_trains_the_gpt_like_one_process() {
    let _serial = serial();
    let dir = scratch("pipeline-zero-losses");
    let graph = gpt_file(&dir);
    let one = local_run(&graph, 5, &dir.join("ckpt-one"), &[]);
    assert_eq!(one.len(), 5);
    let cluster = workers_file(&dir, 4);
    for stage in ["1", "2"] {
        let flags = mesh_flags(&cluster, stage);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let mesh = local_run(&graph, 5, &dir.join(format!("ckpt-zero{stage}")), &flags);
        // Each replica takes 2 rows, 1 per micro-batch; clipping (active at 0.5) uses the norm
        // of the replicas' summed gradients, from the shards of both stages.
        let worst = assert_same_losses(&mesh, &one, 1e-5);
        eprintln!(
            "dp=2,pp=2 ZeRO-{stage} (--local, 4 tasks): worst relative loss difference {worst:e}"
        );
    }
}

#[test]
fn a_checkpoint_saved_under_dp2_pp2_zero1_resumes_in_one_process() {
    let _serial = serial();
    let dir = scratch("pipeline-zero-reshard");
    let graph = gpt_file(&dir);
    let straight = local_run(&graph, 4, &dir.join("ckpt-straight"), &[]);
    // 3 steps under dp2×pp2 with ZeRO-1 (in this process), checkpointed, then step 4 in one
    // process: the Adam slots are joined from the replicas' shards.
    let ckpt = dir.join("ckpt-mesh");
    let cluster = workers_file(&dir, 4);
    let flags = mesh_flags(&cluster, "1");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let first = local_run(&graph, 3, &ckpt, &flags);
    assert_eq!(first.len(), 3);
    let resumed = local_run(&graph, 4, &ckpt, &[]);
    assert_eq!(resumed.iter().map(|l| l.0).collect::<Vec<_>>(), [4]);
    let rel = (resumed[0].1 - straight[3].1).abs() / straight[3].1.abs();
    assert!(
        rel <= 1e-5,
        "resumed step 4 loss {}, uninterrupted {}",
        resumed[0].1,
        straight[3].1
    );
    eprintln!(
        "dp2×pp2 ZeRO-1 checkpoint resumed in one process: step-4 relative difference {rel:e}"
    );
}

#[test]
fn partition_shows_each_stages_replicas_holding_their_shards_of_that_stages_slots() {
    let out = stdout(&dflow(&[
        "partition",
        "examples/gpt/gpt.json",
        "--cluster",
        "examples/gpt/cluster-4workers.json",
        "--mesh",
        "dp=2,pp=2",
        "--zero-stage",
        "1",
        "--micro-batches",
        "2",
        "--batch-size",
        "4",
        "--features",
        "idx",
        "--labels",
        "targets",
    ]));
    assert!(
        out.contains("ZeRO stage 1 over each stage's data-parallel replicas"),
        "{out}"
    );
    // Stage 0 (the embedding) on workers 0 and 1, stage 1 (the final norm) on 2 and 3
    // (Megatron-core order: worker s·2 + d), each replica its own half.
    for (slot, worker) in [
        ("transformer.wte.weight/adam_m/shard_0_of_2 f32[4864]", 0),
        ("transformer.wte.weight/adam_m/shard_1_of_2 f32[4864]", 1),
        ("transformer.ln_f.weight/adam_m/shard_0_of_2 f32[64]", 2),
        ("transformer.ln_f.weight/adam_v/shard_1_of_2 f32[64]", 3),
    ] {
        let line = format!("{slot} on /job:worker/replica:0/task:{worker}\n");
        assert!(out.contains(&line), "{line} in {out}");
    }
    assert!(!out.contains("transformer.wte.weight/adam_m f32"), "{out}");
}
