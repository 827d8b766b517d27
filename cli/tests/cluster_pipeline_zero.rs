//! ZeRO over a pipeline's data-parallel replicas (`--mesh dp=2,pp=2 --zero-stage 1|2|3`), workers
//! only, 4 tasks in one process (`--local`): a small GPT trained with AdamW and active
//! global-norm clipping has the losses and the final weights and Adam slots of a one-process
//! run over 5 steps, at stage 3 in 4 processes too; a checkpoint saved under dp2×pp2 with
//! ZeRO-1 or ZeRO-3 (whole tensors joined from the replicas' shards) resumes in one process
//! with the uninterrupted run's next-step loss; at stage 3 each rank's variable bytes are its
//! stage's weights and slots sharded in two, exactly; `dflow partition` shows each stage's
//! replicas holding their shards of that stage's slots only. Beside tensor parallelism inside
//! the stages (`--mesh dp=2,tp=2,pp=2 --zero-stage 1|2|3`, 8 tasks in one process, each
//! (stage, shard) sharding its Adam slots over its data-parallel group, at stage 3 its weights
//! too, gathered per micro-batch), the losses and final weights and slots are the one-process
//! run's too, and a checkpoint resumes in one process.

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

/// The tensors of the newest checkpoint in `dir`.
fn last_checkpoint(dir: &Path) -> std::collections::BTreeMap<String, dflow::graph::Tensor> {
    let newest = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .max()
        .unwrap_or_else(|| panic!("no checkpoint in {}", dir.display()));
    dflow::executor::checkpoint::load(&newest).unwrap().tensors
}

/// Asserts that the checkpoints in `a` and `b` hold the same tensors, every f32 element within
/// `tol` (relative to the larger of 1 and its size); returns the worst difference.
fn assert_same_checkpoints(a: &Path, b: &Path, tol: f32) -> f32 {
    let (a, b) = (last_checkpoint(a), last_checkpoint(b));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "the same tensors"
    );
    let mut worst = 0.0f32;
    for (name, x) in &a {
        let y = &b[name];
        assert_eq!(x.shape(), y.shape(), "{name}");
        let (Ok(x), Ok(y)) = (x.as_slice::<f32>(), y.as_slice::<f32>()) else {
            continue;
        };
        for (i, (u, v)) in x.iter().zip(y).enumerate() {
            let err = (u - v).abs() / u.abs().max(1.0);
            assert!(err <= tol, "{name}[{i}]: {u} against {v}");
            worst = worst.max(err);
        }
    }
    worst
}

#[test]
fn dp2_pp2_with_zero_trains_the_gpt_like_one_process() {
    let _serial = serial();
    let dir = scratch("pipeline-zero-losses");
    let graph = gpt_file(&dir);
    let one_ckpt = dir.join("ckpt-one");
    let one = local_run(&graph, 5, &one_ckpt, &[]);
    assert_eq!(one.len(), 5);
    let cluster = workers_file(&dir, 4);
    for stage in ["1", "2", "3"] {
        let flags = mesh_flags(&cluster, stage);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let ckpt = dir.join(format!("ckpt-zero{stage}"));
        let mesh = local_run(&graph, 5, &ckpt, &flags);
        // Each replica takes 2 rows, 1 per micro-batch; clipping (active at 0.5) uses the norm
        // of the replicas' summed gradients, from the shards of both stages.
        let worst = assert_same_losses(&mesh, &one, 1e-5);
        // The weights and Adam slots after step 5, joined from the shards, are the
        // one-process ones.
        let params = assert_same_checkpoints(&ckpt, &one_ckpt, 1e-5);
        eprintln!(
            "dp=2,pp=2 ZeRO-{stage} (--local, 4 tasks): worst relative loss difference {worst:e}, \
             parameter difference {params:e}"
        );
    }
}

#[test]
fn dp2_pp2_with_zero3_in_four_processes_trains_like_one_process() {
    let _serial = serial();
    let dir = scratch("pipeline-zero3-procs");
    let graph = gpt_file(&dir);
    let one = local_run(&graph, 4, &dir.join("ckpt-one"), &[]);
    let mut flags = common(4);
    flags.extend(
        [
            "--mesh",
            "dp=2,pp=2",
            "--zero-stage",
            "3",
            "--micro-batches",
            "2",
        ]
        .map(String::from),
    );
    let (mesh, _) = worker_job(&graph, 4, &flags, &dir.join("ckpt-mesh"));
    assert_eq!(mesh.len(), 4);
    let worst = assert_same_losses(&mesh, &one, 1e-5);
    eprintln!("dp=2,pp=2 ZeRO-3 (4 processes): worst relative loss difference {worst:e}");
}

#[test]
fn a_checkpoint_saved_under_dp2_pp2_zero1_or_zero3_resumes_in_one_process() {
    let _serial = serial();
    let dir = scratch("pipeline-zero-reshard");
    let graph = gpt_file(&dir);
    let straight = local_run(&graph, 4, &dir.join("ckpt-straight"), &[]);
    let cluster = workers_file(&dir, 4);
    for stage in ["1", "3"] {
        // 3 steps under dp2×pp2 with ZeRO (in this process), checkpointed, then step 4 in one
        // process: the Adam slots (and at stage 3 the weights) are joined from the replicas'
        // shards.
        let ckpt = dir.join(format!("ckpt-mesh-zero{stage}"));
        let flags = mesh_flags(&cluster, stage);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let first = local_run(&graph, 3, &ckpt, &flags);
        assert_eq!(first.len(), 3);
        let resumed = local_run(&graph, 4, &ckpt, &[]);
        assert_eq!(resumed.iter().map(|l| l.0).collect::<Vec<_>>(), [4]);
        let rel = (resumed[0].1 - straight[3].1).abs() / straight[3].1.abs();
        assert!(
            rel <= 1e-5,
            "ZeRO-{stage}: resumed step 4 loss {}, uninterrupted {}",
            resumed[0].1,
            straight[3].1
        );
        eprintln!(
            "dp2×pp2 ZeRO-{stage} checkpoint resumed in one process: step-4 relative difference {rel:e}"
        );
    }
}

/// The parameters (elements, and elements padded to a multiple of 2: ZeRO's flat shards) each
/// worker of the plain dp2×pp2 pipeline holds, by task index, from the plan.
fn stage_parameters() -> Vec<(u64, u64)> {
    use dflow::partitioner::strategy::pipeline::{schedule::ScheduleKind, Pipeline};
    use dflow::partitioner::strategy::{JobInput, Strategy};
    let def = dflow::graph::layers::gpt(&config()).unwrap().def;
    let spec = def.train.clone().unwrap();
    let graph = dflow::graph::Graph::from_def(&def).unwrap();
    let cluster = dflow::graph::ClusterSpec::local(&[("worker", 4)]).unwrap();
    let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
    let pipeline = Pipeline {
        stages: Some(2),
        micro_batches: 2,
        schedule: ScheduleKind::OneFOneB,
        chunks: 1,
        batch_size: Some(4),
    };
    let plan = pipeline.plan(&input).unwrap();
    let mut held = vec![(0u64, 0u64); 4];
    for n in def.nodes.iter().filter(|n| n.op == "Variable") {
        let v = plan.variables.iter().find(|v| v.name == n.name).unwrap();
        let len = v.dims.iter().product::<usize>() as u64;
        for task in &v.holders {
            let t: usize = task.rsplit(':').next().unwrap().parse().unwrap();
            held[t].0 += len;
            held[t].1 += len.div_ceil(2) * 2;
        }
    }
    held
}

#[test]
fn under_zero3_each_rank_holds_half_its_stages_weights_and_slots() {
    let dir = scratch("pipeline-zero3-bytes");
    let graph = gpt_file(&dir);
    let cluster = workers_file(&dir, 4);
    // Each task's end-of-task line, by task index.
    let ends = |extra: &[&str]| -> Vec<EndOfTask> {
        let mut args = vec![
            "run".to_string(),
            "--local".into(),
            graph.to_string_lossy().into_owned(),
            "--cluster".into(),
            cluster.to_string_lossy().into_owned(),
            "--mesh".into(),
            "dp=2,pp=2".into(),
            "--micro-batches".into(),
            "2".into(),
        ];
        args.extend(common(2));
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = dflow(&args);
        stdout(&out);
        let mut ends = end_of_task(&String::from_utf8_lossy(&out.stderr));
        ends.sort_by(|a, b| a.task.cmp(&b.task));
        assert_eq!(ends.len(), 4, "one end-of-task line per task");
        ends
    };
    let held = stage_parameters();
    // Both stages hold weights; worker s·2 + d holds stage s.
    assert!(held.iter().all(|&(psi, _)| psi > 0), "{held:?}");
    assert_eq!(held[0], held[1]);
    assert_eq!(held[2], held[3]);
    let plain = ends(&[]);
    let zero3 = ends(&["--zero-stage", "3"]);
    for (rank, ((z, p), (psi, padded))) in zero3.iter().zip(&plain).zip(&held).enumerate() {
        // The weight and both Adam slots of Ψ_s elements (12·Ψ_s bytes) become flat shards of
        // ⌈L/2⌉ elements each (12·Ψ'_s/2 bytes); the step counter and the like are as without
        // ZeRO.
        assert_eq!(
            z.variable_bytes,
            p.variable_bytes - 12 * psi + 12 * padded / 2,
            "ZeRO-3 rank {rank}: variables"
        );
    }
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

/// `(Ψ_w, Ψ'_w)` of every worker `w` of dp2×tp2×pp2: the elements of the weights it holds
/// (its stage's tensor-parallel shards and replicated weights), and the same with each padded
/// to a multiple of 2 (ZeRO's flat shards), from the plan without ZeRO, not a run.
fn mesh3d_parameters() -> Vec<(u64, u64)> {
    use dflow::partitioner::strategy::pipeline::{schedule::ScheduleKind, Pipeline};
    use dflow::partitioner::strategy::tensor::{shard_name, TensorParallel};
    use dflow::partitioner::strategy::{JobInput, Strategy};
    let def = dflow::graph::layers::gpt(&config()).unwrap().def;
    let spec = def.train.clone().unwrap();
    let graph = dflow::graph::Graph::from_def(&def).unwrap();
    let cluster = dflow::graph::ClusterSpec::local(&[("worker", 8)]).unwrap();
    let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
    let pipeline = Pipeline {
        stages: Some(2),
        micro_batches: 2,
        schedule: ScheduleKind::OneFOneB,
        chunks: 1,
        batch_size: Some(4),
    };
    let plan = TensorParallel {
        tp: Some(2),
        bucket_bytes: 1 << 20,
        batch_size: Some(4),
        pipeline: Some(pipeline),
        zero_stage: None,
    }
    .plan(&input)
    .unwrap();
    let mut held = vec![(0u64, 0u64); 8];
    for n in def.nodes.iter().filter(|n| n.op == "Variable") {
        let names = match plan.variables.iter().any(|v| v.name == n.name) {
            true => vec![n.name.clone()],
            false => (0..2).map(|t| shard_name(&n.name, t, 2)).collect(),
        };
        for name in names {
            let v = plan.variables.iter().find(|v| v.name == name).unwrap();
            let len = v.dims.iter().product::<usize>() as u64;
            for task in &v.holders {
                let t: usize = task.rsplit(':').next().unwrap().parse().unwrap();
                held[t].0 += len;
                held[t].1 += len.div_ceil(2) * 2;
            }
        }
    }
    held
}

#[test]
fn under_3d_zero3_each_rank_holds_half_its_stage_shards_weights() {
    let _serial = serial();
    let dir = scratch("mesh3d-zero3-bytes");
    let graph = gpt_file(&dir);
    let cluster = workers_file(&dir, 8);
    // Each task's end-of-task line, by task index.
    let ends = |stage: &str| -> Vec<EndOfTask> {
        let mut args = vec![
            "run".to_string(),
            "--local".into(),
            graph.to_string_lossy().into_owned(),
        ];
        args.extend(mesh3d_flags(&cluster, stage));
        args.extend(common(1));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = dflow(&args);
        stdout(&out);
        let mut ends = end_of_task(&String::from_utf8_lossy(&out.stderr));
        ends.sort_by(|a, b| a.task.cmp(&b.task));
        assert_eq!(ends.len(), 8, "one end-of-task line per task");
        ends
    };
    let held = mesh3d_parameters();
    // Every worker holds weights.
    assert!(held.iter().all(|&(psi, _)| psi > 0), "{held:?}");
    let zero1 = ends("1");
    let zero3 = ends("3");
    for (rank, ((z3, z1), (psi, padded))) in zero3.iter().zip(&zero1).zip(&held).enumerate() {
        // The Adam slots are halved under both; at stage 3 the weights' Ψ_w elements
        // (4·Ψ_w bytes) become flat shards of ⌈L/2⌉ elements each (4·Ψ'_w/2 bytes).
        assert_eq!(
            z3.variable_bytes,
            z1.variable_bytes - 4 * psi + 4 * padded / 2,
            "ZeRO-3 rank {rank}: variables"
        );
        eprintln!(
            "dp=2,tp=2,pp=2 worker {rank}: variable bytes ZeRO-1 {}, ZeRO-3 {}",
            z1.variable_bytes, z3.variable_bytes
        );
    }
}

#[test]
fn partition_shows_the_3d_meshs_zero3_shards_on_their_stages_workers_only() {
    let out = stdout(&dflow(&[
        "partition",
        "examples/gpt/gpt.json",
        "--cluster",
        "examples/gpt/cluster-8workers.json",
        "--mesh",
        "dp=2,tp=2,pp=2",
        "--zero-stage",
        "3",
        "--micro-batches",
        "2",
        "--batch-size",
        "12",
        "--features",
        "idx",
        "--labels",
        "targets",
    ]));
    assert!(
        out.contains("ZeRO stage 3 over the data-parallel axis, inside the stages of pipeline"),
        "{out}"
    );
    // Worker s·4 + d·2 + t holds replica d's flat half of shard t of stage s's weights and of
    // their Adam slots; the replicated final norm (stage 1) on both of its tp ranks.
    let on = |workers: &[u32]| -> String {
        let w: Vec<String> = workers
            .iter()
            .map(|i| format!("/job:worker/replica:0/task:{i}"))
            .collect();
        w.join(", ")
    };
    for (var, workers) in [
        (
            "transformer.h.0.mlp.c_fc.weight/tp_1_of_2/shard_0_of_2 f32[16384]",
            on(&[1]),
        ),
        (
            "transformer.h.0.mlp.c_fc.weight/tp_1_of_2/shard_1_of_2 f32[16384]",
            on(&[3]),
        ),
        (
            "transformer.wte.weight/tp_1_of_2/shard_1_of_2 f32[2432]",
            on(&[3]),
        ),
        (
            "transformer.h.0.mlp.c_fc.weight/tp_1_of_2/adam_v/shard_1_of_2 f32[16384]",
            on(&[3]),
        ),
        ("transformer.ln_f.weight/shard_0_of_2 f32[64]", on(&[4, 5])),
        ("transformer.ln_f.weight/shard_1_of_2 f32[64]", on(&[6, 7])),
    ] {
        let line = format!("  {var} on {workers}\n");
        assert!(out.contains(&line), "{line} in {out}");
    }
    // No rank holds a whole weight or tp shard.
    assert!(
        !out.contains("transformer.h.0.mlp.c_fc.weight/tp_1_of_2 f32"),
        "{out}"
    );
    assert!(!out.contains("transformer.ln_f.weight f32"), "{out}");
    // The data-parallel axis is each (stage, shard)'s group, 2 replicas.
    assert!(
        out.contains("data parallelism inside the pipeline stages: dp=2 × tp=2 × pp=2"),
        "{out}"
    );
    assert!(!out.contains("dp=4"), "{out}");
}

/// `--mesh dp=2,tp=2,pp=2 --zero-stage <stage> --micro-batches 2` on 8 tasks in this process.
fn mesh3d_flags(cluster: &Path, stage: &str) -> Vec<String> {
    [
        "--cluster",
        &cluster.to_string_lossy(),
        "--mesh",
        "dp=2,tp=2,pp=2",
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
fn dp2_tp2_pp2_with_zero_1_and_2_trains_the_gpt_like_one_process_and_resumes_in_one() {
    let _serial = serial();
    mesh3d_zero_trains_like_one_process_and_resumes_in_one("mesh3d-zero", &["1", "2"]);
}

#[test]
fn dp2_tp2_pp2_with_zero3_trains_the_gpt_like_one_process_and_resumes_in_one() {
    let _serial = serial();
    // Each (stage, tp shard)'s weights are flat-sharded over its dp group and gathered on the
    // stage's worker before each micro-batch's forward and backward use.
    mesh3d_zero_trains_like_one_process_and_resumes_in_one("mesh3d-zero3", &["3"]);
}

/// Under `--mesh dp=2,tp=2,pp=2 --zero-stage <stage>` (each of `stages`, 8 tasks in this
/// process, in scratch directory `name`), 3 steps have the one-process run's losses and
/// weights and Adam slots, and their checkpoint resumes in one process with the uninterrupted
/// run's step-4 loss.
fn mesh3d_zero_trains_like_one_process_and_resumes_in_one(name: &str, stages: &[&str]) {
    let dir = scratch(name);
    let graph = gpt_file(&dir);
    let one_ckpt = dir.join("ckpt-one");
    let one = local_run(&graph, 4, &one_ckpt, &[]);
    let cluster = workers_file(&dir, 8);
    let straight3 = dir.join("ckpt-one-3");
    local_run(&graph, 3, &straight3, &[]);
    for &stage in stages {
        let flags = mesh3d_flags(&cluster, stage);
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        // 3 steps under dp2×tp2×pp2 with ZeRO, checkpointed; its weights and Adam slots (whole
        // tensors, joined from every rank's dp-shard of its tp-shard) and losses are the
        // one-process run's after step 3; step 4 resumes in one process.
        let ckpt = dir.join(format!("ckpt-zero{stage}"));
        let mesh = local_run(&graph, 3, &ckpt, &flags);
        let worst = assert_same_losses(&mesh, &one[..3], 1e-5);
        let params = assert_same_checkpoints(&ckpt, &straight3, 1e-5);
        let resumed = local_run(&graph, 4, &ckpt, &[]);
        assert_eq!(resumed.iter().map(|l| l.0).collect::<Vec<_>>(), [4]);
        let rel = (resumed[0].1 - one[3].1).abs() / one[3].1.abs();
        assert!(
            rel <= 1e-5,
            "ZeRO-{stage}: resumed step 4 loss {}, uninterrupted {}",
            resumed[0].1,
            one[3].1
        );
        eprintln!(
            "dp=2,tp=2,pp=2 ZeRO-{stage} (--local, 8 tasks): worst relative loss difference \
             {worst:e}, parameter difference {params:e}, resumed step 4 {rel:e}"
        );
    }
}
