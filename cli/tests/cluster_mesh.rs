//! Meshes with tensor parallelism (`--mesh dp=2,tp=2`) with real `dflow` processes, workers
//! only: a small GPT trained with AdamW and global-norm clipping by 4 processes (two
//! tensor-parallel replicas, Megatron-core rank order) has the losses of a one-process run, in
//! processes and in one process (`--local`); a checkpoint saved under dp2×tp2 resumes at tp=2
//! and in one process with the same next-step loss; each rank's collective bytes are tp=2's on
//! half the batch plus a ring all-reduce of its own gradients, exactly; a mesh that does not fit
//! the workers or the model is refused naming what does not fit. Tensor parallelism inside
//! pipeline stages (`--mesh tp=2,pp=2`, 4 processes and `--local`; 1F1B, GPipe and
//! interleaved) and the 3D mesh
//! (`dp=2,tp=2,pp=2`, 8 tasks in one process) have the one-process losses too, and a
//! checkpoint saved under tp2×pp2 resumes in one process.

mod support;

use support::clipped_gpt::*;
use support::*;

/// The parameters one rank holds at tensor-parallel size `tp`: its shard of every weight that
/// Megatron's layout splits, plus every replicated parameter whole (from the layout, not from
/// a run).
fn rank_parameters(tp: usize) -> u64 {
    use dflow::partitioner::strategy::tensor::layout;
    let def = dflow::graph::layers::gpt(&config()).unwrap().def;
    let graph = dflow::graph::Graph::from_def(&def).unwrap();
    let elements = |name: &str| -> u64 {
        let i = graph.find(name).unwrap();
        let dims = graph.output_type(i, 0).unwrap().shape.as_static().unwrap();
        dims.iter().product::<usize>() as u64
    };
    let all: u64 = def
        .nodes
        .iter()
        .filter(|n| n.op == "Variable")
        .map(|n| elements(&n.name))
        .sum();
    let cut = layout(&graph, tp).unwrap();
    let whole: u64 = cut.iter().map(|s| elements(&s.name)).sum();
    let shard: u64 = cut
        .iter()
        .map(|s| s.split.shard_dims(&s.dims).iter().product::<usize>() as u64)
        .sum();
    all - whole + shard
}

#[test]
fn dp2_tp2_trains_the_gpt_like_one_process() {
    let _serial = serial();
    let dir = scratch("mesh-dp2-tp2");
    let graph = gpt_file(&dir);
    let one = local_run(&graph, 5, &dir.join("ckpt-one"), &[]);
    assert_eq!(one.len(), 5);
    // 4 processes: TP groups {0,1}{2,3}, DP groups {0,2}{1,3}; each replica takes 2 rows.
    let mesh = job(
        &graph,
        4,
        &["--mesh", "dp=2,tp=2"],
        5,
        &dir.join("ckpt-mesh"),
    );
    let worst = assert_same_losses(&mesh, &one, 1e-5);
    eprintln!("dp=2,tp=2 (4 processes): worst relative loss difference {worst:e}");
    // The same mesh, every task in this process.
    let cluster = workers_file(&dir, 4);
    let local = local_run(
        &graph,
        5,
        &dir.join("ckpt-local-mesh"),
        &[
            "--cluster",
            cluster.to_str().unwrap(),
            "--mesh",
            "dp=2,tp=2",
        ],
    );
    let worst = assert_same_losses(&local, &one, 1e-5);
    eprintln!("dp=2,tp=2 (--local): worst relative loss difference {worst:e}");
}

#[test]
fn a_checkpoint_saved_under_dp2_tp2_resumes_at_tp2_and_in_one_process() {
    let _serial = serial();
    let dir = scratch("mesh-dp2-tp2-reshard");
    let graph = gpt_file(&dir);
    let straight = local_run(&graph, 4, &dir.join("ckpt-straight"), &[]);
    // 3 steps under dp2×tp2, checkpointed.
    let saved = dir.join("ckpt-mesh");
    let first = job(&graph, 4, &["--mesh", "dp=2,tp=2"], 3, &saved);
    assert_eq!(first.len(), 3);
    let copy = |name: &str| {
        let to = dir.join(name);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&saved).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
        to
    };
    // Resumed in one process and at tp=2 over 2 processes: steps 4 and 5.
    let at1 = local_run(&graph, 5, &copy("ckpt-one"), &[]);
    let at_tp2 = job(
        &graph,
        2,
        &["--strategy", "tensor", "--tp", "2"],
        5,
        &copy("ckpt-tp2"),
    );
    assert_eq!(at1.iter().map(|l| l.0).collect::<Vec<_>>(), [4, 5]);
    assert_eq!(at_tp2.iter().map(|l| l.0).collect::<Vec<_>>(), [4, 5]);
    // The next step's loss is the same whichever layout resumed (the step count, the AdamW
    // slots and the data order continue), and is the uninterrupted run's step 4.
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    assert!(
        rel(at_tp2[0].1, at1[0].1) <= 1e-6,
        "next-step loss {} in one process, {} at tp=2",
        at1[0].1,
        at_tp2[0].1
    );
    assert!(
        rel(at1[0].1, straight[3].1) <= 1e-5,
        "resumed step 4 loss {}, uninterrupted {}",
        at1[0].1,
        straight[3].1
    );
}

#[test]
fn dp2_tp2_sends_tp2s_bytes_plus_a_ring_all_reduce_of_each_ranks_gradients() {
    let dir = scratch("mesh-dp2-tp2-bytes");
    let graph = gpt_file(&dir);
    const STEPS: u64 = 3;
    // The collective bytes each task reports at its end, by task index.
    let sent = |workers: usize, rows: usize, layout: &[&str]| -> Vec<u64> {
        let cluster = workers_file(&dir, workers);
        let mut args = vec![
            "run".to_string(),
            "--local".into(),
            graph.to_string_lossy().into_owned(),
            "--cluster".into(),
            cluster.to_string_lossy().into_owned(),
        ];
        args.extend(common_rows(STEPS as u32, rows));
        // Training only: the evaluation runs over tensor-parallel group 0 on the whole batch.
        no_evaluation(&mut args);
        args.extend(layout.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = dflow(&args);
        stdout(&out);
        let mut ends = end_of_task(&String::from_utf8_lossy(&out.stderr));
        ends.sort_by(|a, b| a.task.cmp(&b.task));
        assert_eq!(ends.len(), workers, "one end-of-task line per task");
        ends.iter().map(|e| e.collective).collect()
    };
    // Each replica of dp2×tp2 on 4 rows runs tp=2 on 2 rows: the same tensor-parallel
    // all-reduces. On top, per step, a 2-rank ring all-reduce of the rank's gradients
    // (2(D−1)/D · 4Ψ_r = 4Ψ_r bytes sent) and of the 4-byte weighted loss.
    let tp2 = sent(2, 2, &["--strategy", "tensor", "--tp", "2"]);
    let mesh = sent(4, 4, &["--mesh", "dp=2,tp=2"]);
    let psi = rank_parameters(2);
    for (rank, &bytes) in mesh.iter().enumerate() {
        let want = tp2[rank % 2] + STEPS * (4 * psi + 4);
        assert_eq!(bytes, want, "rank {rank}: tp=2 sent {}", tp2[rank % 2]);
    }
}

#[test]
fn a_mesh_that_does_not_fit_the_workers_or_the_model_is_refused_naming_it() {
    let dir = scratch("mesh-refused");
    let graph = gpt_file(&dir);
    let run_with = |workers: usize, mesh: &str, rows: usize, extra: &[&str]| {
        let cluster = workers_file(&dir, workers);
        let mut args = vec![
            "run".to_string(),
            "--local".into(),
            graph.to_string_lossy().into_owned(),
            "--cluster".into(),
            cluster.to_string_lossy().into_owned(),
            "--mesh".into(),
            mesh.into(),
        ];
        args.extend(common_rows(1, rows));
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = dflow(&args);
        assert!(
            !out.status.success(),
            "--mesh {mesh} {extra:?} on {workers} workers ran"
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let run = |workers: usize, mesh: &str, rows: usize| run_with(workers, mesh, rows, &[]);
    // 4 ranks on 3 workers.
    let e = run(3, "dp=2,tp=2", 4);
    assert!(
        e.contains("--mesh dp=2,tp=2,pp=1") && e.contains("has 4 ranks but the job has 3 tasks"),
        "{e}"
    );
    // dp=2 does not divide a batch of 5 rows.
    let e = run(4, "dp=2,tp=2", 5);
    assert!(
        e.contains("mesh axis dp=2 does not divide the global batch (--batch-size) (5)"),
        "{e}"
    );
    // tp=3 does not divide the 4 heads.
    let e = run(6, "dp=2,tp=3", 4);
    assert!(
        e.contains("the number of heads (n_head) of transformer.h.0.attn is 4, which does not divide by --tp 3"),
        "{e}"
    );
    // The same inside pipeline stages.
    let e = run(6, "dp=1,tp=3,pp=2", 4);
    assert!(
        e.contains("the number of heads (n_head) of transformer.h.0.attn is 4, which does not divide by --tp 3"),
        "{e}"
    );
    // 4 rows do not split into 3 micro-batches, nor into 2 replicas × 4 micro-batches.
    let e = run_with(4, "dp=1,tp=2,pp=2", 4, &["--micro-batches", "3"]);
    assert!(
        e.contains("batch 4 does not split into 3 micro-batches"),
        "{e}"
    );
    let e = run_with(8, "dp=2,tp=2,pp=2", 4, &["--micro-batches", "4"]);
    assert!(
        e.contains("batch 4 does not split into 2 pipeline replicas × 4 micro-batches"),
        "{e}"
    );
}

#[test]
fn tp2_pp2_trains_the_gpt_like_one_process() {
    let _serial = serial();
    let dir = scratch("mesh-tp2-pp2");
    let graph = gpt_file(&dir);
    let one = local_run(&graph, 4, &dir.join("ckpt-one"), &[]);
    assert_eq!(one.len(), 4);
    // 4 processes: stage 0 on workers {0,1} (TP group), stage 1 on {2,3}; 2 micro-batches,
    // 1F1B.
    let mesh = job(
        &graph,
        4,
        &["--mesh", "dp=1,tp=2,pp=2", "--micro-batches", "2"],
        4,
        &dir.join("ckpt-mesh"),
    );
    let worst = assert_same_losses(&mesh, &one, 1e-5);
    eprintln!("dp=1,tp=2,pp=2 1f1b (4 processes): worst relative loss difference {worst:e}");
    // The same mesh in this process, under GPipe.
    let cluster = workers_file(&dir, 4);
    let local = local_run(
        &graph,
        4,
        &dir.join("ckpt-local-mesh"),
        &[
            "--cluster",
            cluster.to_str().unwrap(),
            "--mesh",
            "dp=1,tp=2,pp=2",
            "--micro-batches",
            "2",
            "--schedule",
            "gpipe",
        ],
    );
    let worst = assert_same_losses(&local, &one, 1e-5);
    eprintln!("dp=1,tp=2,pp=2 gpipe (--local): worst relative loss difference {worst:e}");
    // Interleaved 1F1B: 2 chunks per stage, so 4 virtual stages over the 2 TP groups.
    let local = local_run(
        &graph,
        4,
        &dir.join("ckpt-local-interleaved"),
        &[
            "--cluster",
            cluster.to_str().unwrap(),
            "--mesh",
            "dp=1,tp=2,pp=2",
            "--micro-batches",
            "2",
            "--schedule",
            "interleaved",
        ],
    );
    let worst = assert_same_losses(&local, &one, 1e-5);
    eprintln!("dp=1,tp=2,pp=2 interleaved (--local): worst relative loss difference {worst:e}");
}

#[test]
fn dp2_tp2_pp2_and_dp2_pp2_train_the_gpt_like_one_process() {
    let _serial = serial();
    let dir = scratch("mesh-dp2-tp2-pp2");
    let graph = gpt_file(&dir);
    let one = local_run(&graph, 3, &dir.join("ckpt-one"), &[]);
    // 8 tasks in this process: TP {0,1}{2,3}{4,5}{6,7}, DP {0,2}{1,3}{4,6}{5,7}, PP {0,4}…;
    // each replica takes 2 rows, 1 per micro-batch.
    let cluster = workers_file(&dir, 8);
    let local = local_run(
        &graph,
        3,
        &dir.join("ckpt-local-mesh"),
        &[
            "--cluster",
            cluster.to_str().unwrap(),
            "--mesh",
            "dp=2,tp=2,pp=2",
            "--micro-batches",
            "2",
        ],
    );
    let worst = assert_same_losses(&local, &one, 1e-5);
    eprintln!("dp=2,tp=2,pp=2 (--local, 8 tasks): worst relative loss difference {worst:e}");
    // Without tensor parallelism (dp2×pp2): clipping (active at 0.5) uses the norm of the
    // replicas' summed gradients, as one process does.
    let cluster = workers_file(&dir, 4);
    let local = local_run(
        &graph,
        3,
        &dir.join("ckpt-local-dp2-pp2"),
        &[
            "--cluster",
            cluster.to_str().unwrap(),
            "--mesh",
            "dp=2,pp=2",
            "--micro-batches",
            "2",
        ],
    );
    let worst = assert_same_losses(&local, &one, 1e-5);
    eprintln!("dp=2,pp=2 (--local, 4 tasks): worst relative loss difference {worst:e}");
}

#[test]
fn a_checkpoint_saved_under_tp2_pp2_resumes_in_one_process() {
    let _serial = serial();
    let dir = scratch("mesh-tp2-pp2-reshard");
    let graph = gpt_file(&dir);
    let straight = local_run(&graph, 4, &dir.join("ckpt-straight"), &[]);
    // 3 steps under tp2×pp2 (in this process), checkpointed, then step 4 in one process.
    let ckpt = dir.join("ckpt-mesh");
    let cluster = workers_file(&dir, 4);
    let first = local_run(
        &graph,
        3,
        &ckpt,
        &[
            "--cluster",
            cluster.to_str().unwrap(),
            "--mesh",
            "dp=1,tp=2,pp=2",
            "--micro-batches",
            "2",
        ],
    );
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
    eprintln!("tp2×pp2 checkpoint resumed in one process: step-4 relative difference {rel:e}");
}

#[test]
fn partition_prints_the_3d_plan_with_megatron_cores_groups() {
    let dir = scratch("mesh-partition-3d");
    let graph = gpt_file(&dir);
    let cluster = workers_file(&dir, 8);
    let out = dflow(&[
        "partition",
        graph.to_str().unwrap(),
        "--cluster",
        cluster.to_str().unwrap(),
        "--mesh",
        "dp=2,tp=2,pp=2",
        "--micro-batches",
        "2",
        "--batch-size",
        "4",
        "--features",
        "idx",
        "--labels",
        "targets",
    ]);
    let text = stdout(&out);
    let w = |i: u32| format!("/job:worker/replica:0/task:{i}");
    // Issue 20's groups: TP {0,1}{2,3}{4,5}{6,7} (per stage and replica), DP {0,2}{1,3}{4,6}{5,7}.
    for (key, a, b) in [
        ("tensor_s0_d0", 0, 1),
        ("tensor_s0_d1", 2, 3),
        ("tensor_s1_d0", 4, 5),
        ("tensor_s1_d1", 6, 7),
        ("pipeline/stage0_t0", 0, 2),
        ("pipeline/stage0_t1", 1, 3),
        ("pipeline/stage1_t0", 4, 6),
        ("pipeline/stage1_t1", 5, 7),
    ] {
        let line = format!("collective group {key}: {}, {}", w(a), w(b));
        assert!(text.contains(&line), "no `{line}` in\n{text}");
    }
    assert!(
        text.contains("schedule: Lockstep, 2 batch part(s) per step")
            && text.contains("pipeline: 2 stages × 1 chunk(s), 2 micro-batches, 1f1b schedule")
            && text.contains("tensor parallelism: tp=2"),
        "{text}"
    );
}
