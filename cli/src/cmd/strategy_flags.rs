//! The flags that configure strategies, shared by `dflow run` and `dflow partition`, and how
//! they build a [`Strategy`](dflow_partitioner::Strategy).

use dflow_graph::embedding_partition::PartitionStrategy;
use dflow_partitioner::strategy::pipeline::schedule::ScheduleKind;
use dflow_partitioner::{StrategyKind, StrategyOptions};

/// Pipeline flags (`--strategy pipeline`).
#[derive(Debug, Clone, clap::Args)]
pub struct PipelineFlags {
    /// Pipeline: cut the model into N stages balanced by parameter count, at points where one
    /// tensor crosses (stage s on worker s). Without it, each op's /job:worker/task:S placement
    /// is its stage.
    #[arg(long, value_name = "N")]
    pub stages: Option<usize>,
    /// Pipeline: micro-batches each global batch is cut into.
    #[arg(long, default_value_t = 1, value_name = "M")]
    pub micro_batches: usize,
    /// Pipeline: the order of each stage's forward and backward passes: `gpipe`, `1f1b` or
    /// `interleaved`.
    #[arg(long, default_value = "1f1b", value_parser = |s: &str| s.parse::<ScheduleKind>())]
    pub schedule: ScheduleKind,
    /// Pipeline, `--schedule interleaved`: model chunks per worker (default 2).
    #[arg(long, value_name = "V")]
    pub chunks: Option<usize>,
}

impl PipelineFlags {
    /// The chunks per worker: `--chunks`, or 2 for the interleaved schedule and 1 otherwise.
    pub fn chunks(&self) -> usize {
        match (self.chunks, self.schedule) {
            (Some(v), _) => v,
            (None, ScheduleKind::Interleaved) => 2,
            (None, _) => 1,
        }
    }
}

/// The flags that configure strategies, as `dflow run` and `dflow partition` parse them.
#[derive(Debug, Clone, Copy)]
pub struct StrategyFlags<'a> {
    /// `--async` (ps).
    pub asynchronous: bool,
    /// `--fusion-threshold-mb` (all-reduce, ZeRO).
    pub fusion_threshold_mb: f64,
    /// `--zero-stage`.
    pub zero_stage: Option<u8>,
    /// The pipeline flags.
    pub pipeline: &'a PipelineFlags,
    /// The global batch size.
    pub batch_size: Option<usize>,
    /// `--tp` (tensor).
    pub tp: Option<usize>,
    /// `--partition-strategy` (ps).
    pub partition_strategy: Option<PartitionStrategy>,
    /// `--mesh ep=E` when E > 1 (expert).
    pub ep: Option<usize>,
}

/// Builds strategy `kind` from the flags that configure strategies; a flag given to a strategy
/// it does not apply to is an error naming both.
pub fn build_strategy(
    kind: StrategyKind,
    flags: StrategyFlags<'_>,
) -> anyhow::Result<Box<dyn dflow_partitioner::Strategy>> {
    let StrategyFlags {
        asynchronous,
        fusion_threshold_mb,
        zero_stage,
        pipeline,
        batch_size,
        tp,
        partition_strategy,
        ep,
    } = flags;
    // ep beside tp (--mesh dp=D,tp=T,ep=E) is the tensor strategy's.
    let ep_beside_tp = kind.name() == "tensor" && tp.is_some_and(|t| t > 1);
    if let Some(e) = ep.filter(|_| kind.name() != "expert" && !ep_beside_tp) {
        anyhow::bail!(
            "--mesh ep={e} spreads experts: it applies to --strategy expert (or tensor, with --mesh tp=T), not --strategy {}",
            kind.name()
        );
    }
    if let Some(t) = tp.filter(|_| kind.name() != "tensor") {
        anyhow::bail!(
            "--tp {t} applies to --strategy tensor, not --strategy {}",
            kind.name()
        );
    }
    if let Some(p) = partition_strategy.filter(|_| kind.name() != "ps") {
        anyhow::bail!(
            "--partition-strategy {p} shards embedding tables over ps tasks: it applies to --strategy ps, not --strategy {}",
            kind.name()
        );
    }
    // Beside tensor parallelism, a pipeline or experts, ZeRO runs over the data-parallel axis
    // (--mesh dp=D,tp=T, dp=D,pp=P or dp=D,ep=E).
    let over_dp = matches!(kind.name(), "tensor" | "pipeline" | "expert");
    if let Some(stage) = zero_stage.filter(|_| kind.name() != "zero" && !over_dp) {
        anyhow::bail!(
            "--zero-stage {stage} applies to --strategy zero (or tensor, pipeline or expert, over its dp axis), not --strategy {}",
            kind.name()
        );
    }
    // Micro-batches split a pipeline's batch: a strategy without stages would ignore them.
    let staged = kind.name() == "pipeline"
        || (matches!(kind.name(), "tensor" | "expert") && pipeline.stages.is_some());
    if pipeline.micro_batches > 1 && !staged {
        anyhow::bail!(
            "--micro-batches {} splits the batch of pipeline stages; --strategy {} has none \
             (use --strategy pipeline, or --mesh with a pp axis)",
            pipeline.micro_batches,
            kind.name()
        );
    }
    if fusion_threshold_mb.is_nan() || fusion_threshold_mb <= 0.0 {
        anyhow::bail!("--fusion-threshold-mb must be positive, got {fusion_threshold_mb}");
    }
    let options = StrategyOptions {
        asynchronous,
        bucket_bytes: (fusion_threshold_mb * (1u64 << 20) as f64) as usize,
        stages: pipeline.stages,
        micro_batches: pipeline.micro_batches,
        schedule: pipeline.schedule,
        chunks: pipeline.chunks(),
        batch_size,
        zero_stage: zero_stage.unwrap_or(1),
        tensor_zero: zero_stage.is_some() && over_dp,
        tp,
        partition_strategy,
        ep,
    };
    Ok(kind.build(&options)?)
}

/// `--mesh dp=D,tp=T,pp=P` as a strategy: `tp > 1` is tensor parallelism (`--tp T`) on each of
/// the `dp` replicas, inside `pp` balanced pipeline stages when `pp > 1`; `tp = 1, pp > 1` the
/// pipeline strategy with `pp` balanced stages and `dp` replicas (Megatron-core rank order);
/// `pp = tp = 1` data parallelism (all-reduce, or ZeRO with `--zero-stage`); `--zero-stage`
/// beside `tp > 1` or `pp > 1` (or both) is ZeRO over the dp axis (stages 1 to 3; with both,
/// over each (stage, tp shard)'s dp group); `ep > 1` (with `tp = 1`) expert parallelism over
/// expert-parallel groups of `ep` workers (with `--zero-stage 1|2|3` and `pp = 1`, ZeRO over the
/// dp axis and the expert-data-parallel groups: the dense parameters' states, and at stage 3
/// the parameters themselves, sharded over all the workers, each expert shard's over the
/// workers holding it), inside `pp` balanced pipeline stages when `pp > 1` (each stage's `dp`
/// replicas in groups of `ep`; with `--zero-stage 1|2|3`, ZeRO over each stage's replicas for
/// the dense states and over the stage's expert-data-parallel groups for each expert shard's,
/// one global clipping norm, and at stage 3 each stage's dense and expert weights sharded so,
/// gathered per micro-batch); `ep` beside `tp > 1` (pp = 1) the tensor strategy with the MoE
/// layers replicated over tp and their experts over `ep` replicas (with `--zero-stage 1|2|3`,
/// each rank's dense states sharded over its `data_t<t>` group and each expert shard's over its
/// `experts_dp<s>_t<t>` group, one global clipping norm, and at stage 3 the weights themselves
/// sharded so, gathered just before each pass), and inside `pp` balanced pipeline stages when
/// `pp > 1` (the 4-axis mesh: each (stage, replica)'s tp group, each (stage, shard)'s dp group
/// and expert-parallel groups; with `--zero-stage 1|2|3`, ZeRO over each (stage, shard)'s dp
/// group for the dense states and over its expert-data-parallel groups for each expert
/// shard's, one global clipping norm, and at stage 3 the weights sharded so, gathered per
/// micro-batch; docs/experts.md, "The 4-axis mesh"). Returns the
/// strategy to run and sets `tp` and the pipeline's stages; a contradicting `--strategy`,
/// `--tp` or `--stages` is an error naming both.
pub fn apply_mesh(
    mesh: &dflow_partitioner::mesh::Mesh,
    strategy: Option<StrategyKind>,
    zero_stage: Option<u8>,
    tp: &mut Option<usize>,
    pipeline: &mut PipelineFlags,
) -> anyhow::Result<StrategyKind> {
    if let Some(t) = tp.filter(|&t| t != mesh.tp) {
        anyhow::bail!("--mesh tp={} but --tp {t}: give one of them", mesh.tp);
    }
    let name = if mesh.ep > 1 && mesh.tp > 1 {
        // Tensor parallelism, the MoE layers replicated over tp and their experts over ep,
        // inside pp balanced pipeline stages when pp > 1 (the 4-axis mesh).
        *tp = Some(mesh.tp);
        if mesh.pp > 1 {
            set_stages(mesh, pipeline)?;
        }
        "tensor"
    } else if mesh.ep > 1 {
        // ZeRO (stages 1 to 3, inside pipeline stages too): the dense states over dp (each
        // stage's replicas), each expert shard's over its expert-data-parallel group.
        if mesh.pp > 1 {
            // Expert parallelism inside each of pp balanced pipeline stages.
            set_stages(mesh, pipeline)?;
        }
        "expert"
    } else if mesh.tp > 1 {
        // ZeRO over the dp axis runs beside tp (stages 1 to 3, inside pipeline stages too;
        // D ≥ 2 checked by the strategy).
        *tp = Some(mesh.tp);
        if mesh.pp > 1 {
            // Tensor parallelism inside pipeline stages: the tensor strategy over P stages.
            set_stages(mesh, pipeline)?;
        }
        "tensor"
    } else if mesh.pp > 1 {
        // ZeRO over each stage's replicas (stages 1 to 3, D ≥ 2, checked by the strategy).
        set_stages(mesh, pipeline)?;
        "pipeline"
    } else if zero_stage.is_some() {
        "zero"
    } else {
        "allreduce"
    };
    let kind: StrategyKind = name.parse()?;
    match strategy {
        Some(given) if given != kind => anyhow::bail!(
            "--mesh {} runs --strategy {kind}, not --strategy {given}",
            mesh_text(mesh)
        ),
        _ => Ok(kind),
    }
}

/// The pipeline's stages from `--mesh pp=P`; a contradicting `--stages` is an error.
fn set_stages(
    mesh: &dflow_partitioner::mesh::Mesh,
    pipeline: &mut PipelineFlags,
) -> anyhow::Result<()> {
    if let Some(n) = pipeline.stages.filter(|&n| n != mesh.pp) {
        anyhow::bail!("--mesh pp={} but --stages {n}: give one of them", mesh.pp);
    }
    pipeline.stages = Some(mesh.pp);
    Ok(())
}

/// `--mesh` as written back: `dp=2,tp=1,pp=2` (and `,ep=E` when E > 1).
pub fn mesh_text(mesh: &dflow_partitioner::mesh::Mesh) -> String {
    mesh.to_string()
}

/// Checks that `mesh` covers the cluster's `workers` exactly.
pub fn check_mesh_workers(
    mesh: &dflow_partitioner::mesh::Mesh,
    workers: usize,
) -> anyhow::Result<()> {
    mesh.check_tasks(workers)
        .map_err(|e| anyhow::anyhow!("--mesh {}: {e}", mesh_text(mesh)))
}
