//! Pipeline parallelism as a graph rewrite: the model's layers cut into stages on different
//! workers, each global batch cut into micro-batches that flow through the stages, the order of
//! every stage's forward and backward passes fixed by a schedule (GPipe, 1F1B, interleaved
//! 1F1B) in the plan itself.
//!
//! - [`stages`]: which stage each op runs on (from its placement, or balanced cuts).
//! - [`rewrite`]: the training graph (micro-batch copies, one loss, one optimizer step,
//!   evaluation copy, the schedule as control edges).
//! - [`schedule`]: the schedules' orders and their unit-cost simulation.
//! - [`zero`]: ZeRO over the pipeline's data-parallel replicas.
//!
//! Every activation and activation gradient between stages is a Send/Recv pair of a static
//! shape (`B/m` rows), so it is in the job's buffer plan before step 1; everything that can go
//! wrong with the numbers (a batch that does not split, a stage with nothing to run, a cut
//! sending a tensor backwards, interleaving with a partial group) is refused while planning.
//!
//! The training step equals a one-process step on the same global batch: the loss is the mean
//! of the micro-batches' mean losses (equal sizes), and each weight's gradient is the sum of
//! the micro-batches' gradients of that loss, applied once per step.

mod arrivals;
mod barriers;
pub(crate) mod eval;
pub mod gradients;
pub mod measure;
pub mod render;
pub mod rewrite;
pub mod schedule;
pub mod stages;
pub mod zero;

use super::{JobInput, JobPlan, Registration, ReplicaGraph, Strategy, StrategyError};
use crate::job::{task_name, CollectiveGroup, Schedule};
use crate::mesh::Mesh;
use crate::place::{PlacementOptions, Policy};
use dflow_graph::{DeviceName, Graph};
use schedule::{PipelineShape, ScheduleKind, Unit};
use stages::StageMap;

/// `--strategy pipeline`: stages on workers, micro-batches, a schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pipeline {
    /// Balanced stages (`--stages`); `None` takes the stages from the ops' worker placement.
    pub stages: Option<usize>,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// The schedule.
    pub schedule: ScheduleKind,
    /// Model chunks per worker (interleaved only).
    pub chunks: usize,
    /// The global batch size (activation buffers are sized from it).
    pub batch_size: Option<usize>,
}

/// The graphs of a pipeline job (see [`Pipeline::training_graphs`]).
#[derive(Clone, Debug)]
pub struct PipelineGraphs {
    /// One training graph per pipeline replica.
    pub replicas: Vec<ReplicaGraph>,
    /// Stages, micro-batches, chunks.
    pub shape: PipelineShape,
    /// With several replicas: each stage's group of replicas, whose gradients it all-reduces.
    pub groups: Vec<CollectiveGroup>,
}

/// A forward graph checked and cut for a pipeline ([`Pipeline::prepare`]).
#[derive(Clone, Debug)]
pub(crate) struct Prepared {
    /// The stage of every op.
    pub stages: StageMap,
    /// Stages, micro-batches, chunks.
    pub shape: PipelineShape,
    /// Each stage's order of forward and backward units.
    pub orders: Vec<Vec<Unit>>,
    /// The global batch.
    pub batch: usize,
}

/// Ops whose result for one example depends on the other examples of the batch (an expert's
/// capacity is a share of the batch's tokens; the load-balancing loss averages over them):
/// cut into micro-batches, they would not compute what the whole batch computes.
const BATCH_COUPLED: &[&str] = &["MoeRoute", "MoeAuxLoss"];

/// Whether `n` couples the examples of its batch as configured: a [`BATCH_COUPLED`] op, unless
/// a `MoeRoute` whose capacity factor is at least its experts (every expert has a slot for
/// every token, so none is dropped whatever the batch) or a `MoeAuxLoss` with α = 0 (it adds
/// nothing to the loss or the gradients).
pub(crate) fn couples_batch(n: &dflow_graph::Node) -> bool {
    let float = |name: &str| match n.attrs.get(name) {
        Some(dflow_graph::AttrValue::Float(v)) => Some(*v),
        _ => None,
    };
    match n.op {
        "MoeRoute" => {
            // Output 4 (`load`) is `[E]`.
            let experts = n
                .outputs
                .get(4)
                .and_then(|t| t.shape.dims()?.first().copied().flatten())
                .map_or(f64::INFINITY, |e| e as f64);
            // The attribute's default is 1.
            float("capacity_factor").unwrap_or(1.0) < experts
        }
        // The attribute's default is α = 0.01.
        "MoeAuxLoss" => !matches!(float("alpha"), Some(a) if a == 0.0),
        op => BATCH_COUPLED.contains(&op),
    }
}

/// Why a pipeline cannot be planned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PipelineError {
    /// No batch size to size the activations with.
    #[error("a pipeline sizes its activation buffers from the global batch: give the batch size (--batch-size)")]
    NoBatchSize,
    /// The batch does not split evenly.
    #[error("batch {batch} does not split into {micro_batches} micro-batches (use a batch size that is a multiple of {micro_batches}, or another --micro-batches)")]
    Indivisible {
        /// Global batch.
        batch: usize,
        /// Micro-batches asked for.
        micro_batches: usize,
    },
    /// The schedule cannot run the shape.
    #[error(transparent)]
    Schedule(#[from] schedule::ScheduleError),
    /// The workers do not make whole pipeline replicas.
    #[error("a pipeline of {stages} stages needs a multiple of {stages} workers (one per stage, times the data-parallel replicas); the cluster has {workers}")]
    Workers {
        /// Stages.
        stages: usize,
        /// Workers in the cluster.
        workers: usize,
    },
    /// The batch does not split over replicas and micro-batches.
    #[error("batch {batch} does not split into {replicas} pipeline replicas × {micro_batches} micro-batches (use a multiple of {})", replicas * micro_batches)]
    ReplicaBatch {
        /// Global batch.
        batch: usize,
        /// Data-parallel replicas.
        replicas: usize,
        /// Micro-batches.
        micro_batches: usize,
    },
    /// Fewer ops than stages.
    #[error("cannot cut {ops} batch ops into {stages} stages: a stage would have no layers (use fewer --stages)")]
    TooFewOps {
        /// Virtual stages.
        stages: usize,
        /// Ops that depend on the batch.
        ops: usize,
    },
    /// Not enough clean cut points.
    #[error("cannot cut the model into {stages} stages: it has only {cuts} points where {crossing} tensor(s) cross between layers (use fewer --stages)")]
    TooFewCuts {
        /// Virtual stages.
        stages: usize,
        /// Cut points found.
        cuts: usize,
        /// Tensors crossing at each cut.
        crossing: usize,
    },
    /// A stage with no op, by placement.
    #[error("stage {stage} of {stages} has no layers: no op that reads the batch is placed on /job:worker/task:{stage} (place some there, or use --stages N for balanced stages)")]
    EmptyStage {
        /// The empty stage.
        stage: usize,
        /// Stages (highest task + 1).
        stages: usize,
    },
    /// An op reading the batch with no worker placement.
    #[error("op `{node}` reads the batch but is placed on \"{device}\", not a worker task: place it on /job:worker/task:S (its stage S), or use --stages N")]
    Unplaced {
        /// The op.
        node: String,
        /// Its device.
        device: String,
    },
    /// A cut sends a tensor backwards.
    #[error("op `{to}` on stage {to_stage} reads `{from}` from the later stage {from_stage}: a pipeline sends activations forward only (move `{to}` to stage {from_stage} or later)")]
    Backwards {
        /// The producer.
        from: String,
        /// Its stage.
        from_stage: usize,
        /// The consumer.
        to: String,
        /// Its (earlier) stage.
        to_stage: usize,
    },
    /// A placeholder's shape has no rank.
    #[error("placeholder `{placeholder}` has no known rank; a pipeline needs its shape to cut it into micro-batches")]
    UnknownRank {
        /// The placeholder.
        placeholder: String,
    },
    /// A placeholder's batch dimension is fixed to another size.
    #[error(
        "placeholder `{placeholder}` has batch dimension {dim}, but the batch size is {batch}"
    )]
    BatchDimension {
        /// The placeholder.
        placeholder: String,
        /// Its fixed batch dimension.
        dim: usize,
        /// The batch size asked for.
        batch: usize,
    },
    /// The loss does not depend on the batch.
    #[error("the loss `{0}` does not depend on the fed batch, so there is nothing to pipeline")]
    LossWithoutBatch(String),
    /// An op couples the examples of a batch, so micro-batches would change the model.
    #[error("op `{node}` ({op}) couples the examples of a batch (an expert's capacity and the load-balancing loss are shares of the batch), so {micro_batches} micro-batches would not train like the whole batch: use --micro-batches 1")]
    BatchCoupled {
        /// The op.
        node: String,
        /// Its type.
        op: String,
        /// The micro-batches asked for.
        micro_batches: usize,
    },
    /// Another placeholder than features and labels.
    #[error("placeholder `{0}` is neither the features nor the labels placeholder; a pipeline feeds only those (set --features/--labels)")]
    OtherPlaceholder(String),
    /// An input reference that does not parse.
    #[error("op `{node}`: {message}")]
    Input {
        /// The op.
        node: String,
        /// What is wrong.
        message: String,
    },
    /// A bug in the rewrite, named.
    #[error("pipeline rewrite: internal error at `{0}`; please report it")]
    Internal(String),
}

/// `--strategy pipeline`.
pub(crate) static REGISTRATION: Registration = Registration {
    name: "pipeline",
    about: "layers cut into stages on the workers, micro-batches, gpipe/1f1b/interleaved schedule",
    build: |opts| {
        if opts.asynchronous {
            return Err(StrategyError::Options {
                strategy: "pipeline",
                message: "a pipeline is synchronous; --async is a parameter-server mode".into(),
            });
        }
        let pipeline = Pipeline {
            stages: opts.stages,
            micro_batches: opts.micro_batches,
            schedule: opts.schedule,
            chunks: opts.chunks,
            batch_size: opts.batch_size,
        };
        if opts.tensor_zero {
            return Ok(Box::new(zero::PipelineZero {
                pipeline,
                zero: zero::ReplicaZero {
                    stage: opts.zero_stage,
                    bucket_bytes: opts.bucket_bytes,
                },
            }));
        }
        Ok(Box::new(pipeline))
    },
};

/// Placement of a job whose every node names its worker (the pipeline's rewrites place each
/// node): explicit, with worker 0 for any node left without a device.
pub(crate) fn placement_on_worker_0(
    input: &JobInput<'_>,
) -> Result<PlacementOptions, StrategyError> {
    let device = worker_device(0);
    Ok(PlacementOptions {
        policy: Policy::Explicit,
        default_device: DeviceName::parse(&device).map_err(|e| StrategyError::InvalidDevice {
            node: String::new(),
            device: device.clone(),
            message: e.to_string(),
        })?,
        ..input.placement.clone()
    })
}

pub(crate) fn worker_device(task: usize) -> String {
    format!("/job:worker/replica:0/task:{task}/device:cpu:0")
}

impl Pipeline {
    /// The pipeline's training graph and its shape, before placement and partitioning (the
    /// graph an in-process run executes as is).
    pub fn training_graph(
        &self,
        input: &JobInput<'_>,
    ) -> Result<(ReplicaGraph, PipelineShape), StrategyError> {
        let mut graphs = self.training_graphs(input)?;
        if graphs.replicas.len() != 1 {
            return Err(StrategyError::Options {
                strategy: "pipeline",
                message: format!(
                    "{} pipeline replicas exchange gradients between processes: run them as a cluster job (`dflow launch`), or give one worker per stage",
                    graphs.replicas.len()
                ),
            });
        }
        let replica = graphs.replicas.remove(0);
        Ok((replica, graphs.shape))
    }

    /// Checks the forward graph `g` against the options and cuts it: the stage of every op, the
    /// pipeline's shape and each stage's order of units. Workers and replicas are not checked
    /// here (see [`Pipeline::training_graphs`]).
    pub(crate) fn prepare(
        &self,
        g: &Graph,
        features: &str,
        labels: &str,
    ) -> Result<Prepared, StrategyError> {
        let batch = self.batch_size.ok_or(PipelineError::NoBatchSize)?;
        let m = self.micro_batches;
        if m == 0 {
            return Err(PipelineError::Schedule(schedule::ScheduleError::Zero {
                what: "micro-batch",
            })
            .into());
        }
        if batch % m != 0 {
            return Err(PipelineError::Indivisible {
                batch,
                micro_batches: m,
            }
            .into());
        }
        let mut feeds = Vec::new();
        for (role, name) in [("features", features), ("labels", labels)] {
            match g.find(name) {
                Some(i) if g.node(i).op == "Placeholder" => feeds.push(i),
                Some(i) => {
                    return Err(StrategyError::NotAPlaceholder {
                        role,
                        name: name.to_string(),
                        message: format!("the node is a {}, not a Placeholder", g.node(i).op),
                    })
                }
                None => {
                    return Err(StrategyError::NotAPlaceholder {
                        role,
                        name: name.to_string(),
                        message: format!("no node named `{name}` in the graph"),
                    })
                }
            }
        }
        if let Some(other) = g
            .node_indices()
            .find(|i| g.node(*i).op == "Placeholder" && !feeds.contains(i))
        {
            return Err(PipelineError::OtherPlaceholder(g.node(other).name.clone()).into());
        }
        if let Some(coupled) = g
            .node_indices()
            .find(|i| m > 1 && couples_batch(g.node(*i)))
        {
            let n = g.node(coupled);
            return Err(PipelineError::BatchCoupled {
                node: n.name.clone(),
                op: n.op.to_string(),
                micro_batches: m,
            }
            .into());
        }
        let chunks = if self.schedule == ScheduleKind::Interleaved {
            self.chunks
        } else {
            1
        };
        if self.schedule != ScheduleKind::Interleaved && self.chunks != 1 {
            return Err(PipelineError::Schedule(
                schedule::ScheduleError::ChunksWithoutInterleaving {
                    chunks: self.chunks,
                    schedule: self.schedule,
                },
            )
            .into());
        }
        let stage_map = match self.stages {
            Some(n) => {
                if n == 0 || chunks == 0 {
                    return Err(PipelineError::Schedule(schedule::ScheduleError::Zero {
                        what: if n == 0 { "stage" } else { "chunk" },
                    })
                    .into());
                }
                stages::balanced(g, &feeds, n * chunks)?
            }
            None => {
                if chunks != 1 {
                    return Err(StrategyError::Options {
                        strategy: "pipeline",
                        message: "the interleaved schedule cuts the model itself: give --stages N"
                            .into(),
                    });
                }
                stages::from_placement(g, &feeds)?
            }
        };
        let shape = PipelineShape {
            stages: stage_map.virtual_stages / chunks,
            micro_batches: m,
            chunks,
        };
        let orders = schedule::orders(self.schedule, shape).map_err(PipelineError::from)?;
        Ok(Prepared {
            stages: stage_map,
            shape,
            orders,
            batch,
        })
    }

    /// The training graphs of every pipeline replica (`d = workers / stages` of them: data
    /// parallelism over pipelines, in Megatron-core's rank order: worker `w` runs stage `w / d`
    /// of replica `w mod d`), the shape, and the collective groups of the stages' replicas.
    pub fn training_graphs(&self, input: &JobInput<'_>) -> Result<PipelineGraphs, StrategyError> {
        self.replica_graphs(input, None)
    }

    /// [`Pipeline::training_graphs`], with ZeRO's step over each stage's replicas in place of
    /// their all-reduce when `zero` is given ([`zero`]).
    pub(crate) fn replica_graphs(
        &self,
        input: &JobInput<'_>,
        zero: Option<zero::ReplicaZero>,
    ) -> Result<PipelineGraphs, StrategyError> {
        let Prepared {
            stages: stage_map,
            shape,
            orders,
            batch,
        } = self.prepare(input.graph, input.features, input.labels)?;
        let m = self.micro_batches;
        let workers = input.workers();
        if workers == 0 || workers % shape.stages != 0 {
            return Err(PipelineError::Workers {
                stages: shape.stages,
                workers,
            }
            .into());
        }
        let data_parallel = workers / shape.stages;
        if batch % (data_parallel * m) != 0 {
            return Err(PipelineError::ReplicaBatch {
                batch,
                replicas: data_parallel,
                micro_batches: m,
            }
            .into());
        }
        // Megatron-core's rank order (tp fastest, then dp, then pp): stage s of replica r is
        // worker s·d + r, so stage 0 of replica 0 is the chief.
        let mesh =
            Mesh::new(data_parallel, 1, shape.stages).map_err(|e| StrategyError::Options {
                strategy: "pipeline",
                message: e.to_string(),
            })?;
        let replica_devices: Vec<Vec<String>> = (0..data_parallel)
            .map(|r| {
                (0..shape.stages)
                    .map(|s| worker_device(mesh.rank(0, r, s)))
                    .collect()
            })
            .collect();
        let mut replicas = Vec::with_capacity(data_parallel);
        for (r, devices) in replica_devices.iter().enumerate() {
            let dp_groups: Vec<String> = (0..shape.stages).map(gradients::stage_group).collect();
            replicas.push(rewrite::rewrite(&rewrite::RewriteInput {
                graph: input.graph,
                stages: &stage_map,
                shape,
                orders: &orders,
                spec: input.train,
                features: input.features,
                labels: input.labels,
                batch_size: batch / data_parallel,
                devices,
                replicas: data_parallel,
                replica: r,
                dp_groups: &dp_groups,
                replica_devices: &replica_devices,
                tensor: None,
                zero,
            })?);
        }
        let groups = if data_parallel > 1 {
            (0..shape.stages)
                .map(|s| CollectiveGroup {
                    key: gradients::stage_group(s),
                    members: (0..data_parallel)
                        .map(|r| task_name("worker", mesh.rank(0, r, s) as u32))
                        .collect(),
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok(PipelineGraphs {
            replicas,
            shape,
            groups,
        })
    }
}

impl Strategy for Pipeline {
    fn name(&self) -> &'static str {
        REGISTRATION.name
    }

    fn describe(&self) -> String {
        let stages = match self.stages {
            Some(n) => format!("{n} balanced stages"),
            None => "stages by placement".to_string(),
        };
        let chunks = if self.schedule == ScheduleKind::Interleaved {
            format!(", {} chunks per stage", self.chunks)
        } else {
            String::new()
        };
        format!(
            "pipeline training, {stages}, {} micro-batches, {} schedule{chunks}",
            self.micro_batches, self.schedule
        )
    }

    fn plan(&self, input: &JobInput<'_>) -> Result<JobPlan, StrategyError> {
        self.plan_with_shape(input).map(|(plan, _)| plan)
    }

    fn full_batches(&self) -> bool {
        true
    }
}

impl Pipeline {
    /// The job plan and the pipeline's shape (for [`render::render_pipeline`]).
    pub fn plan_with_shape(
        &self,
        input: &JobInput<'_>,
    ) -> Result<(JobPlan, PipelineShape), StrategyError> {
        let graphs = self.training_graphs(input)?;
        self.plan_graphs(input, graphs, self.describe())
    }

    /// The job plan of a pipeline's training graphs, described as `describe`.
    pub(crate) fn plan_graphs(
        &self,
        input: &JobInput<'_>,
        graphs: PipelineGraphs,
        describe: String,
    ) -> Result<(JobPlan, PipelineShape), StrategyError> {
        let PipelineGraphs {
            replicas,
            shape,
            groups,
        } = graphs;
        let placement = placement_on_worker_0(input)?;
        let plan = JobPlan::build(
            describe,
            input,
            replicas,
            &placement,
            Schedule::Lockstep,
            groups,
        )?;
        Ok((plan, shape))
    }
}
