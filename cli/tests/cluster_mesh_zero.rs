//! ZeRO over the data-parallel axis beside tensor parallelism (`--mesh dp=2,tp=2
//! --zero-stage 1|2`), with real `dflow` tasks: a small GPT trained with AdamW and global-norm
//! clipping active has the losses of a one-process run, every task in one process (`--local`)
//! at stages 1, 2 and 3 and in 4 processes at stages 2 and 3; a checkpoint saved under dp2×tp2 with ZeRO
//! (each rank holding only its dp-shard of its tensor-parallel shard's Adam slots) resumes in
//! one process with the uninterrupted run's next-step loss; each rank's variable bytes and
//! collective bytes are dp2×tp2's with its Adam slots halved and its gradient all-reduce
//! replaced by ZeRO's collectives, exactly. At stage 3 each rank holds only its dp-shard of its
//! tensor-parallel shards (and of the replicated weights): the losses are the one-process ones,
//! a checkpoint resumes in one process, and the variable bytes are the formula. The
//! combinations that do not run (ZeRO-3 beside tensor parallelism inside pipeline stages) are
//! refused naming what to do.

mod support;

use std::path::Path;
use support::clipped_gpt::*;
use support::*;

/// dp2×tp2 with ZeRO at `stage`, its 4 tasks in this process: its losses.
fn mesh_zero_local(
    dir: &Path,
    graph: &Path,
    stage: u8,
    steps: u32,
    ckpt: &Path,
) -> Vec<(u64, f64)> {
    mesh_zero_validated(dir, graph, stage, steps, ckpt).0
}

/// [`mesh_zero_local`]: its losses and its final validation loss line.
fn mesh_zero_validated(
    dir: &Path,
    graph: &Path,
    stage: u8,
    steps: u32,
    ckpt: &Path,
) -> (Vec<(u64, f64)>, String) {
    let cluster = workers_file(dir, 4);
    let stage = stage.to_string();
    local_run_validated(
        graph,
        steps,
        ckpt,
        &[
            "--cluster",
            cluster.to_str().unwrap(),
            "--mesh",
            "dp=2,tp=2",
            "--zero-stage",
            &stage,
        ],
    )
}

#[test]
fn dp2_tp2_with_zero_1_2_and_3_trains_the_gpt_like_one_process() {
    let _serial = serial();
    let dir = scratch("mesh-zero-dp2-tp2");
    let graph = gpt_file(&dir);
    let (one, one_validation) = local_run_validated(&graph, 5, &dir.join("ckpt-one"), &[]);
    assert_eq!(one.len(), 5);
    assert!(!one_validation.is_empty(), "no validation loss printed");
    for stage in [1u8, 2, 3] {
        let ckpt = dir.join(format!("ckpt-z{stage}"));
        let (mesh, validation) = mesh_zero_validated(&dir, &graph, stage, 5, &ckpt);
        assert_eq!(mesh.len(), 5);
        let worst = assert_same_losses(&mesh, &one, 1e-5);
        eprintln!("dp=2,tp=2 ZeRO-{stage} (--local): worst relative loss difference {worst:e}");
        // The validation loss, evaluated on tp group 0's ranks (at stage 3 each gathering its
        // flat shards per use, the other replica joining), is the one process's as printed.
        assert_eq!(validation, one_validation, "ZeRO-{stage}");
    }
}

#[test]
fn dp2_tp2_with_zero_2_and_3_in_four_processes_trains_like_one_process() {
    let _serial = serial();
    let dir = scratch("mesh-zero-dp2-tp2-procs");
    let graph = gpt_file(&dir);
    let one = local_run(&graph, 4, &dir.join("ckpt-one"), &[]);
    for stage in ["2", "3"] {
        let mut flags = common(4);
        flags.extend(["--mesh", "dp=2,tp=2", "--zero-stage", stage].map(String::from));
        let (mesh, _) = worker_job(&graph, 4, &flags, &dir.join(format!("ckpt-mesh-z{stage}")));
        assert_eq!(mesh.len(), 4);
        let worst = assert_same_losses(&mesh, &one, 1e-5);
        eprintln!("dp=2,tp=2 ZeRO-{stage} (4 processes): worst relative loss difference {worst:e}");
    }
}

#[test]
fn a_checkpoint_saved_under_dp2_tp2_zero_resumes_in_one_process() {
    let _serial = serial();
    let dir = scratch("mesh-zero-reshard");
    let graph = gpt_file(&dir);
    let straight = local_run(&graph, 4, &dir.join("ckpt-straight"), &[]);
    for stage in [1u8, 2, 3] {
        // 3 steps under dp2×tp2 with ZeRO, checkpointed, then steps 4 and 5 in one process.
        let ckpt = dir.join(format!("ckpt-z{stage}"));
        let first = mesh_zero_local(&dir, &graph, stage, 3, &ckpt);
        assert_eq!(first.len(), 3);
        let resumed = local_run(&graph, 5, &ckpt, &[]);
        assert_eq!(resumed.iter().map(|l| l.0).collect::<Vec<_>>(), [4, 5]);
        // The step count, the AdamW slots (whole logical tensors, assembled from every rank's
        // dp-shard of its tp-shard) and the data order continue.
        let rel = (resumed[0].1 - straight[3].1).abs() / straight[3].1.abs();
        assert!(
            rel <= 1e-5,
            "ZeRO-{stage}: resumed step 4 loss {}, uninterrupted {}",
            resumed[0].1,
            straight[3].1
        );
        // And the one-process checkpoint resumes under dp2×tp2 with ZeRO again.
        let again = mesh_zero_local(&dir, &graph, stage, 6, &ckpt);
        assert_eq!(again.iter().map(|l| l.0).collect::<Vec<_>>(), [6]);
    }
}

#[test]
fn zero_combinations_that_do_not_run_are_refused_naming_them() {
    let dir = scratch("mesh-zero-refused");
    let graph = gpt_file(&dir);
    let refused = |workers: usize, flags: &[&str]| {
        let cluster = workers_file(&dir, workers);
        let mut args = vec![
            "run".to_string(),
            "--local".into(),
            graph.to_string_lossy().into_owned(),
            "--cluster".into(),
            cluster.to_string_lossy().into_owned(),
        ];
        args.extend(common(1));
        args.extend(flags.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = dflow(&args);
        assert!(!out.status.success(), "{flags:?} on {workers} workers ran");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // Inside pipeline stages, ZeRO beside tensor parallelism runs at stages 1 to 3
    // (cli/tests/cluster_pipeline_zero.rs), over at least two replicas.
    let e = refused(4, &["--mesh", "dp=1,tp=2,pp=2", "--zero-stage", "3"]);
    assert!(e.contains("this mesh has one replica"), "{e}");
    let e = refused(2, &["--mesh", "dp=1,tp=2", "--zero-stage", "1"]);
    assert!(e.contains("this mesh has one replica"), "{e}");
    // ZeRO over pipeline replicas runs at stages 1 to 3 (cli/tests/cluster_pipeline_zero.rs),
    // with at least two replicas.
    let e = refused(2, &["--mesh", "dp=1,pp=2", "--zero-stage", "1"]);
    assert!(e.contains("make one replica"), "{e}");
}

/// `(Ψ_r, Ψ'_r)`: the parameters one rank of dp=`dp` × tp=`tp` holds (its shard of every
/// weight Megatron's layout splits, every replicated one whole), and the same with each
/// parameter padded to a multiple of `dp` (ZeRO's flat shards), from the layout, not a run.
fn rank_parameters(tp: usize, dp: usize) -> (u64, u64) {
    use dflow::partitioner::strategy::tensor::layout;
    let def = dflow::graph::layers::gpt(&config()).unwrap().def;
    let graph = dflow::graph::Graph::from_def(&def).unwrap();
    let cut = layout(&graph, tp).unwrap();
    let (mut held, mut padded) = (0u64, 0u64);
    for n in def.nodes.iter().filter(|n| n.op == "Variable") {
        let i = graph.find(&n.name).unwrap();
        let dims = graph.output_type(i, 0).unwrap().shape.as_static().unwrap();
        let len = match cut.iter().find(|s| s.name == n.name) {
            Some(s) => s.split.shard_dims(&s.dims).iter().product::<usize>(),
            None => dims.iter().product::<usize>(),
        };
        held += len as u64;
        padded += (len.div_ceil(dp) * dp) as u64;
    }
    (held, padded)
}

#[test]
fn each_rank_holds_half_its_adam_slots_and_sends_zeros_bytes() {
    let dir = scratch("mesh-zero-bytes");
    let graph = gpt_file(&dir);
    const STEPS: u64 = 3;
    // Each task's end-of-task line, by task index.
    let ends = |extra: &[&str]| -> Vec<EndOfTask> {
        let cluster = workers_file(&dir, 4);
        let mut args = vec![
            "run".to_string(),
            "--local".into(),
            graph.to_string_lossy().into_owned(),
            "--cluster".into(),
            cluster.to_string_lossy().into_owned(),
            "--mesh".into(),
            "dp=2,tp=2".into(),
        ];
        args.extend(common(STEPS as u32));
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = dflow(&args);
        stdout(&out);
        let mut ends = end_of_task(&String::from_utf8_lossy(&out.stderr));
        ends.sort_by(|a, b| a.task.cmp(&b.task));
        assert_eq!(ends.len(), 4, "one end-of-task line per task");
        ends
    };
    let (psi, padded) = rank_parameters(2, 2);
    let plain = ends(&[]);
    // ZeRO-3: the weights too are the rank's flat shards of S = ⌈L/2⌉ elements, so the
    // parameters and both slots take 12·Ψ'_r/2 bytes instead of 12·Ψ_r (the other variables,
    // the step counter and the like, as without ZeRO).
    let zero3 = ends(&["--zero-stage", "3"]);
    for (rank, (z, p)) in zero3.iter().zip(&plain).enumerate() {
        assert_eq!(
            z.variable_bytes,
            p.variable_bytes - 12 * psi + 12 * padded / 2,
            "ZeRO-3 rank {rank}: variables"
        );
    }
    for (stage, grads) in [("1", 6 * padded), ("2", 4 * padded)] {
        let zero = ends(&["--zero-stage", stage]);
        for (rank, (z, p)) in zero.iter().zip(&plain).enumerate() {
            // Variables: the weights whole, the two Adam slots of S = ⌈L/2⌉ per weight instead
            // of L.
            assert_eq!(
                z.variable_bytes,
                p.variable_bytes - 8 * psi + 8 * padded / 2,
                "ZeRO-{stage} rank {rank}: variables"
            );
            // Collectives per step: instead of the 2-rank ring all-reduce of the gradients
            // (4Ψ_r), ZeRO-1 all-reduces them (4Ψ'_r) and all-gathers the updated shards
            // (2Ψ'_r); ZeRO-2 reduce-scatters (2Ψ'_r) and all-gathers (2Ψ'_r); clipping adds two
            // 4-byte all-reduces over the dp group (the tp-sharded and the replicated weights'
            // squared norms) beside its one over the tp group.
            assert_eq!(
                z.collective,
                p.collective - STEPS * 4 * psi + STEPS * (grads + 8),
                "ZeRO-{stage} rank {rank}: collective bytes"
            );
        }
    }
}
