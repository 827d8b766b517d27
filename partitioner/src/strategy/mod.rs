//! Strategies: how a model is spread over a cluster, each one a graph rewrite followed by
//! placement and partitioning into a [`JobPlan`].
//!
//! ```text
//!  forward Graph + TrainSpec ──Strategy::plan──▶ rewrite (replicas, collectives, training step)
//!                                                  │  one ReplicaGraph per signature
//!                                                  ▼
//!                                      JobPlan::build: place → partition → global BufferPlan
//! ```
//!
//! A strategy is one module here (`ps.rs`, `allreduce.rs`, `zero.rs`, `expert.rs`) holding a type that implements
//! [`Strategy`] and a [`Registration`] (name, one-line help, constructor from
//! [`StrategyOptions`]); [`REGISTRY`] lists them, and `--strategy` parses into a
//! [`StrategyKind`] by name, so `dflow run --help` and `dflow partition --help` list every
//! registered strategy. Adding one (pipeline, tensor, experts) is a new module plus one
//! line in [`REGISTRY`]; docs/architecture.md walks through it.
//!
//! ```
//! use dflow_graph::train::{OptimizerKind, OptimizerSpec, TrainSpec};
//! use dflow_graph::{builder::GraphBuilder, ClusterSpec, DType};
//! use dflow_partitioner::strategy::{JobInput, StrategyKind, StrategyOptions};
//! use dflow_partitioner::PlacementOptions;
//!
//! let mut b = GraphBuilder::new();
//! let w = b.variable("w", DType::F32, &[3, 1], "zeros");
//! let x = b.placeholder("x", DType::F32, &[4, 3]);
//! let y = b.placeholder("y", DType::F32, &[4, 1]);
//! let p = b.matmul("p", &x, &w);
//! let d = b.binary("Sub", "d", &p, &y);
//! let sq = b.binary("Mul", "sq", &d, &d);
//! b.op("Mean", "loss").input(&sq).finish();
//! let graph = b.build().unwrap();
//! let train = TrainSpec::new("loss", OptimizerSpec { kind: OptimizerKind::Sgd, lr: 0.1 });
//! let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
//!
//! let kind: StrategyKind = "ps".parse().unwrap();
//! let strategy = kind.build(&StrategyOptions::default()).unwrap();
//! let input = JobInput::new(&graph, &train, &cluster, "x", "y");
//! let plan = strategy.plan(&input).unwrap();
//! // One synchronous training signature over both workers, and one evaluation signature.
//! assert_eq!(plan.signatures.len(), 2);
//! // The ps receives each worker's gradient of `w`: one global slot per Send/Recv pair.
//! let ps = "/job:ps/replica:0/task:0";
//! assert_eq!(plan.recv_slots(ps).len(), 2);
//! assert!(plan.recv_slots(ps).iter().all(|s| s.slot.bytes == 12));
//! ```

pub mod allreduce;
pub mod expert;
pub mod pipeline;
pub mod ps;
pub mod sharded_embedding;
pub mod tensor;
#[cfg(test)]
pub(crate) mod test_support;
pub mod zero;

pub use crate::job::{JobPlan, JobPlanError};
pub use allreduce::AllReduce;
pub use expert::Expert;
pub use ps::{ps_training, ParameterServer, PsMode};
pub use zero::{zero_training, Zero};

use crate::error::{PartitionError, PlacementError};
use crate::place::PlacementOptions;
use dflow_graph::train::{ExpandError, TrainSpec, TrainingGraph};
use dflow_graph::{ClusterSpec, DType, Graph, GraphErrors, Shape};
use std::fmt;
use std::str::FromStr;

/// Plans a training job: rewrites the forward graph for the cluster, then places and partitions
/// it into the [`JobPlan`] the runtime runs. Takes the in-memory graph; no stage in between
/// serializes it.
pub trait Strategy: fmt::Debug + Send + Sync {
    /// The name it is registered under (`ps`, `allreduce`).
    fn name(&self) -> &'static str;

    /// The strategy and its options in a few words, for logs and `dflow partition`
    /// (`sync parameter-server training`).
    fn describe(&self) -> String;

    /// The plan of `input`'s job.
    fn plan(&self, input: &JobInput<'_>) -> Result<JobPlan, StrategyError>;

    /// Whether every training batch must be full: the plan's batch dimension is static (a
    /// pipeline sizes its activation buffers by it), so the driver drops each epoch's last
    /// partial batch.
    fn full_batches(&self) -> bool {
        false
    }
}

/// What a strategy plans: the model, what it trains, the cluster, and what is fed.
#[derive(Debug, Clone, Copy)]
pub struct JobInput<'a> {
    /// The forward graph, with its variables (its own `train` section is ignored).
    pub graph: &'a Graph,
    /// What to train.
    pub train: &'a TrainSpec,
    /// The cluster.
    pub cluster: &'a ClusterSpec,
    /// The placeholder fed with features.
    pub features: &'a str,
    /// The placeholder fed with labels.
    pub labels: &'a str,
    /// Placement options (strategies may override the policy).
    pub placement: &'a PlacementOptions,
}

static DEFAULT_PLACEMENT: std::sync::LazyLock<PlacementOptions> =
    std::sync::LazyLock::new(PlacementOptions::default);

impl<'a> JobInput<'a> {
    /// An input with the default placement options.
    pub fn new(
        graph: &'a Graph,
        train: &'a TrainSpec,
        cluster: &'a ClusterSpec,
        features: &'a str,
        labels: &'a str,
    ) -> JobInput<'a> {
        JobInput {
            graph,
            train,
            cluster,
            features,
            labels,
            placement: &DEFAULT_PLACEMENT,
        }
    }

    /// The number of worker tasks.
    pub fn workers(&self) -> usize {
        self.cluster.num_tasks("worker")
    }

    /// The worker tasks' names (`/job:worker/replica:0/task:i`), in task order.
    pub fn worker_task_names(&self) -> Vec<String> {
        self.cluster
            .tasks("worker")
            .map(|(i, _)| crate::job::task_name("worker", i))
            .collect()
    }

    /// The caller's placement options with every node kept where the strategy put it (the
    /// strategies that build one graph per worker place every node themselves).
    pub fn explicit_placement(&self) -> crate::place::PlacementOptions {
        crate::place::PlacementOptions {
            policy: crate::place::Policy::Explicit,
            ..self.placement.clone()
        }
    }
}

/// Options a strategy may read when it is built; each strategy uses the ones that concern it
/// and refuses ones that contradict it. A new strategy with its own knobs adds fields here.
#[derive(Debug, Clone, PartialEq)]
pub struct StrategyOptions {
    /// Apply each worker's update on its own schedule instead of in lockstep.
    pub asynchronous: bool,
    /// All-reduce fusion threshold: the most bytes of gradients in one bucket.
    pub bucket_bytes: usize,
    /// Pipeline: balanced stages (`None`: stages from the ops' worker placement).
    pub stages: Option<usize>,
    /// Pipeline: micro-batches per step.
    pub micro_batches: usize,
    /// Pipeline: the schedule.
    pub schedule: pipeline::schedule::ScheduleKind,
    /// Pipeline, interleaved schedule: model chunks per worker.
    pub chunks: usize,
    /// The global batch size, for strategies that size buffers by it (pipeline).
    pub batch_size: Option<usize>,
    /// The ZeRO stage (`--zero-stage`, read by `--strategy zero`): 1 shards the optimizer slots,
    /// 2 also the summed gradients, 3 also the parameters.
    pub zero_stage: u8,
    /// `--zero-stage` given beside tensor parallelism (`--mesh dp=D,tp=T`) or a pipeline
    /// (`--mesh dp=D,pp=P`): `--strategy tensor` or `pipeline` runs ZeRO at `zero_stage` over
    /// its data-parallel axis.
    pub tensor_zero: bool,
    /// The tensor-parallel size (`--tp`, read by `--strategy tensor`; `None`: every worker).
    pub tp: Option<usize>,
    /// `--partition-strategy`: how the ps strategy shards embedding tables over the ps tasks,
    /// overriding each table's own `partition_strategy` (`None`: the graph's).
    pub partition_strategy: Option<dflow_graph::embedding_partition::PartitionStrategy>,
    /// The expert-parallel size (`--mesh ep=E`, read by `--strategy expert`): the experts are
    /// spread over runs of `ep` workers (`None`: over every worker).
    pub ep: Option<usize>,
}

impl Default for StrategyOptions {
    fn default() -> Self {
        StrategyOptions {
            asynchronous: false,
            bucket_bytes: allreduce::DEFAULT_BUCKET_BYTES,
            stages: None,
            micro_batches: 1,
            schedule: pipeline::schedule::ScheduleKind::OneFOneB,
            chunks: 1,
            batch_size: None,
            zero_stage: 1,
            tensor_zero: false,
            tp: None,
            partition_strategy: None,
            ep: None,
        }
    }
}

/// A strategy in the registry: its name, its help line, and how to build it.
#[derive(Debug)]
pub struct Registration {
    /// The name `--strategy` takes.
    pub name: &'static str,
    /// One line for `--help`.
    pub about: &'static str,
    /// Builds the strategy from the options.
    pub build: fn(&StrategyOptions) -> Result<Box<dyn Strategy>, StrategyError>,
}

/// Every strategy, in `--help` order. A new strategy adds its line here.
pub static REGISTRY: &[&Registration] = &[
    &ps::REGISTRATION,
    &allreduce::REGISTRATION,
    &pipeline::REGISTRATION,
    &zero::REGISTRATION,
    &expert::REGISTRATION,
    &tensor::REGISTRATION,
];

/// A registered strategy, chosen by name (`"ps".parse::<StrategyKind>()`).
#[derive(Debug, Clone, Copy)]
pub struct StrategyKind(&'static Registration);

impl StrategyKind {
    /// Every registered strategy.
    pub fn all() -> impl Iterator<Item = StrategyKind> {
        REGISTRY.iter().map(|r| StrategyKind(r))
    }

    /// Its registered name.
    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// Its help line.
    pub fn about(self) -> &'static str {
        self.0.about
    }

    /// Builds the strategy with `options`.
    pub fn build(self, options: &StrategyOptions) -> Result<Box<dyn Strategy>, StrategyError> {
        (self.0.build)(options)
    }
}

impl PartialEq for StrategyKind {
    fn eq(&self, other: &Self) -> bool {
        self.0.name == other.0.name
    }
}

impl Eq for StrategyKind {}

impl fmt::Display for StrategyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.name)
    }
}

/// `--strategy` named no registered strategy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown strategy `{name}`; the strategies are: {}", known.join(", "))]
pub struct UnknownStrategy {
    /// The name given.
    pub name: String,
    /// Every registered name.
    pub known: Vec<&'static str>,
}

impl FromStr for StrategyKind {
    type Err = UnknownStrategy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        StrategyKind::all()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownStrategy {
                name: s.to_string(),
                known: StrategyKind::all().map(StrategyKind::name).collect(),
            })
    }
}

/// Which placeholders worker `worker` feeds with its part of each batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaFeeds {
    /// The worker task index.
    pub worker: usize,
    /// The features placeholder of this worker's replica.
    pub features: String,
    /// The labels placeholder of this worker's replica.
    pub labels: String,
    /// Sync only: a scalar f32 placeholder fed with `n_i / n`, the worker's rows over the rows
    /// of the global batch, so that the summed loss is the global batch's mean.
    pub weight: Option<String>,
}

/// Names to feed and fetch for evaluation on worker 0: whole batches, no weight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvalNames {
    /// The features placeholder.
    pub features: String,
    /// The labels placeholder.
    pub labels: String,
    /// The (unweighted) loss tensor.
    pub loss: String,
    /// The (unweighted) metric tensors, in the spec's order.
    pub metrics: Vec<String>,
}

/// One training graph of a data-parallel rewrite (a replica set of workers) and how to drive it.
#[derive(Clone, Debug)]
pub struct ReplicaGraph {
    /// The graph with its training step; `loss` and `metrics` name the global-batch values.
    pub training: TrainingGraph,
    /// `training.def`, validated (placement takes it as is).
    pub graph: Graph,
    /// What each worker driving this graph feeds, one entry per replica in the graph.
    pub replicas: Vec<ReplicaFeeds>,
    /// What to feed and fetch to evaluate the model.
    pub eval: EvalNames,
    /// `(name, tensor)` pairs the job fetches after the loss at every training step and the
    /// chief reports per step (the expert strategy's dropped-token count); empty for most
    /// strategies. Every graph of a job names the same values, in the same order.
    pub step_metrics: Vec<(String, String)>,
}

impl ReplicaGraph {
    /// The graph of one worker's replica, `worker`, once its training step is complete:
    /// `training` validated, fed `features` and `labels` (and the batch share `weight`, when
    /// there are several replicas), evaluating `spec`'s loss and metrics on the same
    /// placeholders; no per-step metrics.
    pub fn of_replica(
        training: TrainingGraph,
        worker: usize,
        (features, labels): (&str, &str),
        weight: Option<String>,
        spec: &TrainSpec,
    ) -> Result<ReplicaGraph, StrategyError> {
        let graph = Graph::from_def(&training.def).map_err(StrategyError::InvalidGraph)?;
        Ok(ReplicaGraph {
            training,
            graph,
            replicas: vec![ReplicaFeeds {
                worker,
                features: features.to_string(),
                labels: labels.to_string(),
                weight,
            }],
            eval: EvalNames {
                features: features.to_string(),
                labels: labels.to_string(),
                loss: spec.loss.clone(),
                metrics: spec.metrics.clone(),
            },
            step_metrics: Vec::new(),
        })
    }
}

/// Why a strategy could not plan the job.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StrategyError {
    /// The worker count is zero or does not fit a task index.
    #[error("a data-parallel strategy needs 1 to {} workers, got {0}", u32::MAX)]
    WorkerCount(usize),
    /// The forward graph does not validate.
    #[error("the forward graph is invalid:\n{0}")]
    InvalidGraph(GraphErrors),
    /// The features or labels name is not a placeholder of the graph.
    #[error("{role} placeholder `{name}`: {message}")]
    NotAPlaceholder {
        /// `features` or `labels`.
        role: &'static str,
        /// The name as given.
        name: String,
        /// What is wrong, e.g. `no node named ...`.
        message: String,
    },
    /// The loss or a metric does not name a tensor of the graph.
    #[error("{role} `{name}` is not a tensor of the graph: {message}")]
    UnknownTensor {
        /// `loss` or `metric`.
        role: &'static str,
        /// The name as given.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// The loss or a metric is not f32 or f64, so it cannot be weighted by a batch share.
    #[error("{role} `{name}` is {dtype}; a replicated {role} must be f32 or f64 to be weighted by the replica's share of the batch")]
    NotFloat {
        /// `loss` or `metric`.
        role: &'static str,
        /// The name as given.
        name: String,
        /// Its dtype.
        dtype: DType,
    },
    /// The loss or a metric is not a scalar, so the replicas' values cannot be averaged.
    #[error("{role} `{name}` has shape {shape}; a replicated {role} must be a scalar (e.g. a Mean over the batch)")]
    NotScalar {
        /// `loss` or `metric`.
        role: &'static str,
        /// The name as given.
        name: String,
        /// Its inferred shape.
        shape: Shape,
    },
    /// A node's device string does not parse.
    #[error("node `{node}`: invalid device \"{device}\": {message}")]
    InvalidDevice {
        /// The node.
        node: String,
        /// The device as written.
        device: String,
        /// What is wrong.
        message: String,
    },
    /// A replica's node would take the name of a shared variable.
    #[error("cannot replicate node `{node}` as `{name}`: a variable already has that name")]
    NameTaken {
        /// The original node.
        node: String,
        /// The replica's name for it.
        name: String,
    },
    /// Adding the training step failed.
    #[error(transparent)]
    Train(#[from] ExpandError),
    /// The strategy's options do not fit it (e.g. `async` for a synchronous strategy).
    #[error("strategy `{strategy}`: {message}")]
    Options {
        /// The strategy's name.
        strategy: &'static str,
        /// What is wrong and what to do.
        message: String,
    },
    /// The pipeline cannot be planned (see [`pipeline::PipelineError`]).
    #[error("pipeline: {0}")]
    Pipeline(#[from] pipeline::PipelineError),
    /// Placing a training graph on the cluster failed.
    #[error("placing the training graph: {0}")]
    Placement(#[from] PlacementError),
    /// Partitioning a placed training graph failed.
    #[error("partitioning the {what} graph: {source}")]
    Partition {
        /// `training` or `evaluation`.
        what: &'static str,
        /// Why.
        source: PartitionError,
    },
    /// The partitions do not make a runnable job (see [`JobPlanError`]).
    #[error(transparent)]
    Plan(#[from] JobPlanError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_registered_name_parses_back_to_itself() {
        let names: Vec<&str> = StrategyKind::all().map(StrategyKind::name).collect();
        assert_eq!(
            names,
            ["ps", "allreduce", "pipeline", "zero", "expert", "tensor"]
        );
        for k in StrategyKind::all() {
            assert_eq!(k.name().parse::<StrategyKind>().unwrap(), k);
            assert!(!k.about().is_empty());
            let built = k.build(&StrategyOptions::default()).unwrap();
            assert_eq!(built.name(), k.name());
        }
    }

    #[test]
    fn an_unknown_name_lists_the_known_ones() {
        let e = "zigzag".parse::<StrategyKind>().unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown strategy `zigzag`; the strategies are: ps, allreduce, pipeline, zero, expert, tensor"
        );
    }

    #[test]
    fn allreduce_refuses_async() {
        let opts = StrategyOptions {
            asynchronous: true,
            ..StrategyOptions::default()
        };
        let e = "allreduce"
            .parse::<StrategyKind>()
            .unwrap()
            .build(&opts)
            .unwrap_err();
        assert!(e.to_string().contains("synchronous"), "{e}");
        let ps = "ps".parse::<StrategyKind>().unwrap().build(&opts).unwrap();
        assert_eq!(ps.describe(), "async parameter-server training");
    }
}
