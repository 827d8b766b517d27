//! Parameter-server training strategies as graph rewrites, applied before placement.
//!
//! [`ps_training`] turns a forward graph and its [`TrainSpec`] into the graph(s) that train it
//! with data parallelism over `workers` worker tasks, the variables living on `ps`:
//!
//! - [`PsMode::Sync`]: one graph holding a copy of the model per worker (`replica_{i}/…`, on
//!   `/job:worker/task:{i}`) that shares the variables. Each replica's loss and metrics are
//!   weighted by a fed scalar (`replica_{i}/batch_weight`, the replica's share `n_i / n` of the
//!   global batch) and summed under their original names, so `loss` stays the mean over the
//!   global batch. The backward pass sums the replicas' gradients on each variable's device and
//!   the ps applies them once per step: `SyncReplicasOptimizer` without the queues, and the same
//!   step as one process training on the whole global batch.
//! - [`PsMode::Async`]: one graph per worker, the forward graph retargeted to that worker's task
//!   with its own training step. The graphs share the variables by name; each worker updates
//!   them on its own schedule (between-graph replication, Hogwild-style).
//!
//! ```
//! use dflow_graph::train::{OptimizerKind, OptimizerSpec, TrainSpec};
//! use dflow_graph::{builder::GraphBuilder, DType};
//! use dflow_partitioner::strategy::{ps_training, PsMode};
//!
//! let mut b = GraphBuilder::new();
//! let w = b.with_device("/job:ps/task:0", |b| b.variable("w", DType::F32, &[3], "zeros"));
//! let x = b.placeholder("x", DType::F32, &[-1, 3]);
//! let y = b.placeholder("y", DType::F32, &[-1, 3]);
//! let p = b.binary("Mul", "p", &x, &w);
//! let d = b.binary("Sub", "d", &p, &y);
//! let sq = b.binary("Mul", "sq", &d, &d);
//! b.op("Mean", "loss").input(&sq).finish();
//! let spec = TrainSpec {
//!     lr_schedule: None,
//!     data: None,
//!     loss: "loss".into(),
//!     optimizer: OptimizerSpec { kind: OptimizerKind::Sgd, lr: 0.1 },
//!     clip_global_norm: None,
//!     metrics: vec![],
//! };
//!
//! let graphs = ps_training(&b.to_def(), &spec, 2, PsMode::Sync, "x", "y").unwrap();
//! let sync = &graphs[0];
//! assert_eq!(sync.training.loss, "loss"); // the weighted sum over the replicas
//! assert_eq!(sync.replicas[1].features, "replica_1/x");
//! assert_eq!(sync.replicas[1].weight.as_deref(), Some("replica_1/batch_weight"));
//! let node = |name: &str| sync.training.def.nodes.iter().find(|n| n.name == name).unwrap();
//! assert_eq!(node("replica_1/p").device, "/job:worker/task:1");
//! assert_eq!(node("replica_1/p").inputs, ["replica_1/x", "w"]); // one shared `w`
//! assert_eq!(node("train/w/update").device, "/job:ps/task:0");
//! ```

use super::sharded_embedding::{row_sharded, shard_embeddings, sparse_updates};
use super::{
    EvalNames, JobInput, JobPlan, Registration, ReplicaFeeds, ReplicaGraph, Strategy, StrategyError,
};
use crate::job::Schedule;
use dflow_graph::embedding_partition::PartitionStrategy;
use dflow_graph::train::{expand_training_graph, TrainSpec};
use dflow_graph::{AttrValue, DType, DeviceName, Edge, Graph, GraphDef, InputRef, NodeDef, Shape};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::collections::{BTreeMap, HashMap, HashSet};

/// How the workers' updates reach the parameter servers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PsMode {
    /// One combined step per global batch: gradients of all replicas are summed on the ps and
    /// applied once (in-graph replication).
    Sync,
    /// Each worker runs its own graph and applies its own gradients whenever it finishes a step
    /// (between-graph replication).
    Async,
}

/// Parameter-server data parallelism: variables on the `ps` tasks, one replica of the model
/// per worker; [`PsMode`] says whether the updates are aggregated (sync) or not (async).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParameterServer {
    /// Sync or async updates.
    pub mode: PsMode,
    /// Overrides the partition strategy of sharded embedding tables (see
    /// [`super::sharded_embedding`]).
    pub partition_strategy: Option<PartitionStrategy>,
    /// The global batch size, bounding the ids a worker looks up per step (sizes the sharded
    /// tables' row buffers when the ids' batch dimension is unknown).
    pub batch_size: Option<usize>,
}

/// `--strategy ps`.
pub(super) static REGISTRATION: Registration = Registration {
    name: "ps",
    about: "variables on the parameter servers; sync (default) or --async updates",
    build: |opts| {
        Ok(Box::new(ParameterServer {
            mode: if opts.asynchronous {
                PsMode::Async
            } else {
                PsMode::Sync
            },
            partition_strategy: opts.partition_strategy,
            batch_size: opts.batch_size,
        }))
    },
};

impl Strategy for ParameterServer {
    fn name(&self) -> &'static str {
        REGISTRATION.name
    }

    fn describe(&self) -> String {
        match self.mode {
            PsMode::Sync => "sync parameter-server training".into(),
            PsMode::Async => "async parameter-server training".into(),
        }
    }

    fn plan(&self, input: &JobInput<'_>) -> Result<JobPlan, StrategyError> {
        // Replica `i` goes to the `i`-th worker task of the cluster: its indices need not be
        // dense (an elastic job re-plans on the survivors, e.g. tasks 0 and 2).
        let tasks: Vec<u32> = input.cluster.tasks("worker").map(|(i, _)| i).collect();
        let sharded = shard_embeddings(
            &input.graph.to_def(),
            input.cluster.num_tasks("ps"),
            self.partition_strategy,
            self.batch_size,
        )?;
        let rewritten;
        let graph = if sharded.tables.is_empty() {
            input.graph
        } else {
            rewritten = Graph::from_def(&sharded.def).map_err(StrategyError::InvalidGraph)?;
            &rewritten
        };
        let mut graphs = ps_graphs(
            graph,
            &sharded.def,
            input.train,
            &tasks,
            self.mode,
            input.features,
            input.labels,
        )?;
        for g in &mut graphs {
            sparse_updates(g, &sharded.tables)?;
        }
        let row_sharded = graphs
            .first()
            .map(|g| row_sharded(&sharded.tables, &g.training.def))
            .unwrap_or_default();
        let schedule = match self.mode {
            PsMode::Sync => Schedule::Lockstep,
            PsMode::Async => Schedule::Independent,
        };
        let mut plan = JobPlan::build(
            self.describe(),
            input,
            graphs,
            input.placement,
            schedule,
            Vec::new(),
        )?;
        plan.row_sharded = row_sharded;
        Ok(plan)
    }
}

/// Builds the training graph(s) of a parameter-server strategy over `workers` worker tasks.
///
/// `features` and `labels` name the forward graph's placeholders that take a batch. Nodes that
/// request job `worker` or no job are retargeted to the worker's task (a device type and id they
/// request are kept); nodes on other jobs and nodes colocated with a variable (explicitly or by a
/// reference input) keep their request. Variables are never copied.
///
/// [`PsMode::Sync`] returns one [`ReplicaGraph`] with a replica per worker (see the module docs);
/// [`PsMode::Async`] returns one per worker, graph `i` retargeted to task `i` with its names
/// unchanged. `forward.train` is ignored: `spec` says what to train.
pub fn ps_training(
    forward: &GraphDef,
    spec: &TrainSpec,
    workers: usize,
    mode: PsMode,
    features: &str,
    labels: &str,
) -> Result<Vec<ReplicaGraph>, StrategyError> {
    let graph = Graph::from_def(forward).map_err(StrategyError::InvalidGraph)?;
    let tasks: Vec<u32> = (0..workers)
        .map(|i| u32::try_from(i).map_err(|_| StrategyError::WorkerCount(workers)))
        .collect::<Result<_, _>>()?;
    ps_graphs(&graph, forward, spec, &tasks, mode, features, labels)
}

/// [`ps_training`] of an already validated `graph`, whose definition is `forward`, on the
/// worker tasks `tasks` (ascending, not necessarily dense): replica (or graph) `i` is placed on
/// `/job:worker/task:{tasks[i]}` and feeds part `i` of every global batch.
pub(crate) fn ps_graphs(
    graph: &Graph,
    forward: &GraphDef,
    spec: &TrainSpec,
    tasks: &[u32],
    mode: PsMode,
    features: &str,
    labels: &str,
) -> Result<Vec<ReplicaGraph>, StrategyError> {
    let workers = tasks.len();
    if workers == 0 {
        return Err(StrategyError::WorkerCount(workers));
    }
    check_placeholder(graph, "features", features)?;
    check_placeholder(graph, "labels", labels)?;
    let facts = NodeFacts::of(graph);
    match mode {
        PsMode::Sync => {
            let summed = replicate(forward, graph, &facts, spec, tasks)?;
            let (training, graph) = expand_training_graph(&summed.def, &summed.spec)?;
            Ok(vec![ReplicaGraph {
                training,
                graph,
                replicas: (0..workers)
                    .map(|i| ReplicaFeeds {
                        worker: i,
                        features: replica_name(&facts, i, features),
                        labels: replica_name(&facts, i, labels),
                        weight: Some(summed.weights[i].clone()),
                    })
                    .collect(),
                eval: EvalNames {
                    features: replica_name(&facts, 0, features),
                    labels: replica_name(&facts, 0, labels),
                    loss: replica_tensor(&facts, 0, &spec.loss),
                    metrics: spec
                        .metrics
                        .iter()
                        .map(|m| replica_tensor(&facts, 0, m))
                        .collect(),
                },
                step_metrics: Vec::new(),
            }])
        }
        PsMode::Async => (0..workers)
            .map(|i| {
                let mut def = forward.clone();
                def.train = None;
                for node in &mut def.nodes {
                    if !facts.pinned.contains(&node.name) {
                        node.device = worker_device(&node.name, &node.device, tasks[i])?;
                    }
                }
                let (training, graph) = expand_training_graph(&def, spec)?;
                Ok(ReplicaGraph {
                    training,
                    graph,
                    replicas: vec![ReplicaFeeds {
                        worker: i,
                        features: features.to_string(),
                        labels: labels.to_string(),
                        weight: None,
                    }],
                    eval: EvalNames {
                        features: features.to_string(),
                        labels: labels.to_string(),
                        loss: spec.loss.clone(),
                        metrics: spec.metrics.clone(),
                    },
                    step_metrics: Vec::new(),
                })
            })
            .collect(),
    }
}

/// What the rewrite needs to know about the forward graph's nodes.
struct NodeFacts {
    /// Variables: shared by every replica, never copied.
    variables: HashSet<String>,
    /// Nodes that must stay where their variable is (colocated with one, or in its reference
    /// group), so their device is not retargeted.
    pinned: HashSet<String>,
}

impl NodeFacts {
    fn of(graph: &Graph) -> NodeFacts {
        let n = graph.num_nodes();
        let mut parent: Vec<usize> = (0..n).collect();
        fn root(parent: &mut [usize], mut x: usize) -> usize {
            while parent[x] != x {
                parent[x] = parent[parent[x]];
                x = parent[x];
            }
            x
        }
        let mut union = |a: usize, b: usize| {
            let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
            parent[ra.max(rb)] = ra.min(rb);
        };
        // The same groups as placement forms: explicit colocation and reference inputs.
        for idx in graph.node_indices() {
            let node = graph.node(idx);
            for other in node.colocate_with.iter().filter_map(|c| graph.find(c)) {
                union(idx.index(), other.index());
            }
            let op = node.op_def();
            for e in graph.petgraph().edges_directed(idx, Direction::Incoming) {
                if let Edge::Data { dst_input, .. } = *e.weight() {
                    if op.inputs.get(dst_input).is_some_and(|a| a.is_ref) {
                        union(idx.index(), e.source().index());
                    }
                }
            }
        }
        let is_var = |i: usize| {
            graph
                .node(petgraph::graph::NodeIndex::new(i))
                .op_def()
                .is_variable
        };
        let with_variable: HashSet<usize> = (0..n)
            .filter(|&i| is_var(i))
            .map(|i| root(&mut parent, i))
            .collect();
        let mut facts = NodeFacts {
            variables: HashSet::new(),
            pinned: HashSet::new(),
        };
        for idx in graph.node_indices() {
            let name = graph.node(idx).name.clone();
            if is_var(idx.index()) {
                facts.variables.insert(name.clone());
            }
            if with_variable.contains(&root(&mut parent, idx.index())) {
                facts.pinned.insert(name);
            }
        }
        facts
    }
}

/// Replica `i`'s name for node `name`: variables keep theirs.
fn replica_name(facts: &NodeFacts, i: usize, name: &str) -> String {
    if facts.variables.contains(name) {
        name.to_string()
    } else {
        format!("replica_{i}/{name}")
    }
}

/// Replica `i`'s name for an input or tensor reference (`x`, `x:1`, `^x`).
fn replica_tensor(facts: &NodeFacts, i: usize, reference: &str) -> String {
    match InputRef::parse(reference) {
        Ok(InputRef::Data { node, index }) => InputRef::Data {
            node: replica_name(facts, i, &node),
            index,
        }
        .to_string(),
        Ok(InputRef::Control(node)) => InputRef::Control(replica_name(facts, i, &node)).to_string(),
        // Only names of a validated graph get here; leave anything else to validation.
        Err(_) => reference.to_string(),
    }
}

/// `device` retargeted to worker task `task` when it names job `worker` or no job.
fn worker_device(node: &str, device: &str, task: u32) -> Result<String, StrategyError> {
    let mut d = DeviceName::parse(device).map_err(|e| StrategyError::InvalidDevice {
        node: node.to_string(),
        device: device.to_string(),
        message: e.to_string(),
    })?;
    match d.job.as_deref() {
        None | Some("worker") => {
            d.job = Some("worker".into());
            d.task = Some(task);
            Ok(d.to_string())
        }
        Some(_) => Ok(device.to_string()),
    }
}

fn check_placeholder(graph: &Graph, role: &'static str, name: &str) -> Result<(), StrategyError> {
    let err = |message: String| StrategyError::NotAPlaceholder {
        role,
        name: name.to_string(),
        message,
    };
    let idx = graph
        .find(name)
        .ok_or_else(|| err(format!("no node named `{name}` in the graph")))?;
    match graph.node(idx).op {
        "Placeholder" => Ok(()),
        op => Err(err(format!("the node is a {op}, not a Placeholder"))),
    }
}

/// The sync graph before its training step: replicas, weights and the summed loss and metrics.
struct Replicated {
    def: GraphDef,
    /// The spec naming the summed loss and metrics.
    spec: TrainSpec,
    /// Each replica's batch weight placeholder.
    weights: Vec<String>,
}

/// Adds nodes under names no other node has.
struct Names {
    taken: HashSet<String>,
}

impl Names {
    /// `base`, or `base_1`, `base_2`, ... if taken.
    fn fresh(&mut self, base: &str) -> String {
        let mut name = base.to_string();
        let mut k = 1;
        while self.taken.contains(&name) {
            name = format!("{base}_{k}");
            k += 1;
        }
        self.taken.insert(name.clone());
        name
    }
}

fn node(name: String, op: &str, inputs: Vec<String>, device: &str) -> NodeDef {
    NodeDef {
        name,
        op: op.to_string(),
        inputs,
        device: device.to_string(),
        ..NodeDef::default()
    }
}

fn replicate(
    forward: &GraphDef,
    graph: &Graph,
    facts: &NodeFacts,
    spec: &TrainSpec,
    tasks: &[u32],
) -> Result<Replicated, StrategyError> {
    let workers = tasks.len();
    let mut nodes = Vec::with_capacity(forward.nodes.len() * workers + 4 * workers);
    for (i, &task) in tasks.iter().enumerate() {
        for n in &forward.nodes {
            let shared = facts.variables.contains(&n.name);
            if shared && i > 0 {
                continue;
            }
            let name = replica_name(facts, i, &n.name);
            if !shared && facts.variables.contains(&name) {
                return Err(StrategyError::NameTaken {
                    node: n.name.clone(),
                    name,
                });
            }
            let device = if facts.pinned.contains(&n.name) {
                n.device.clone()
            } else {
                worker_device(&n.name, &n.device, task)?
            };
            nodes.push(NodeDef {
                name,
                op: n.op.clone(),
                inputs: n
                    .inputs
                    .iter()
                    .map(|s| replica_tensor(facts, i, s))
                    .collect(),
                device,
                colocate_with: n
                    .colocate_with
                    .iter()
                    .map(|c| replica_name(facts, i, c))
                    .collect(),
                attrs: n.attrs.clone(),
            });
        }
    }
    let mut names = Names {
        taken: nodes.iter().map(|n| n.name.clone()).collect(),
    };
    let weights: Vec<String> = tasks
        .iter()
        .enumerate()
        .map(|(i, &task)| {
            let name = names.fresh(&format!("replica_{i}/batch_weight"));
            let mut w = node(name.clone(), "Placeholder", vec![], &task_device(task));
            w.attrs = BTreeMap::from([
                ("dtype".to_string(), AttrValue::DType(DType::F32)),
                ("shape".to_string(), AttrValue::Shape(Shape::scalar())),
            ]);
            nodes.push(w);
            name
        })
        .collect();

    // Each distinct loss or metric tensor becomes one weighted sum over the replicas.
    let mut summed: HashMap<String, String> = HashMap::new();
    let mut sum = |role: &'static str, tensor: &str| -> Result<String, StrategyError> {
        // `x` and `x:0` are one tensor, summed once.
        let key = InputRef::parse(tensor).map_or_else(|_| tensor.to_string(), |r| r.to_string());
        if let Some(done) = summed.get(&key) {
            return Ok(done.clone());
        }
        let out = weighted_sum(
            graph,
            facts,
            &mut names,
            &mut nodes,
            (&weights, tasks),
            role,
            tensor,
        )?;
        summed.insert(key, out.clone());
        Ok(out)
    };
    let loss = sum("loss", &spec.loss)?;
    let metrics = spec
        .metrics
        .iter()
        .map(|m| sum("metric", m))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Replicated {
        def: GraphDef {
            version: forward.version,
            nodes,
            train: None,
        },
        spec: TrainSpec {
            loss,
            metrics,
            ..spec.clone()
        },
        weights,
    })
}

fn task_device(task: u32) -> String {
    format!("/job:worker/task:{task}")
}

/// Adds `Σ_i weight_i * replica_i/tensor` on worker 0 (replica `i` on worker task `tasks[i]`
/// of `(weights, tasks)`) and returns its name: the tensor's node
/// name for `x` or `x:0`, a fresh `x_k` for output `k > 0`. A variable's tensor is shared, so it
/// is returned as is.
#[allow(clippy::too_many_arguments)]
fn weighted_sum(
    graph: &Graph,
    facts: &NodeFacts,
    names: &mut Names,
    nodes: &mut Vec<NodeDef>,
    (weights, tasks): (&[String], &[u32]),
    role: &'static str,
    tensor: &str,
) -> Result<String, StrategyError> {
    let unknown = |message: String| StrategyError::UnknownTensor {
        role,
        name: tensor.to_string(),
        message,
    };
    let (idx, index, ty) = graph.resolve_tensor(tensor).map_err(unknown)?;
    let producer = graph.node(idx).name.clone();
    if facts.variables.contains(&producer) {
        return Ok(tensor.to_string());
    }
    if !matches!(ty.dtype, DType::F32 | DType::F64) {
        return Err(StrategyError::NotFloat {
            role,
            name: tensor.to_string(),
            dtype: ty.dtype,
        });
    }
    if ty.shape.rank().is_some_and(|r| r != 0) {
        return Err(StrategyError::NotScalar {
            role,
            name: tensor.to_string(),
            shape: ty.shape.clone(),
        });
    }
    let out = match index {
        0 => names.fresh(&producer),
        k => names.fresh(&format!("{producer}_{k}")),
    };
    let mut terms = Vec::with_capacity(weights.len());
    for (i, (weight, &task)) in weights.iter().zip(tasks).enumerate() {
        let device = task_device(task);
        let mut weight = weight.clone();
        if ty.dtype != DType::F32 {
            let cast = names.fresh(&format!("{out}/replica_{i}/weight"));
            let mut c = node(cast.clone(), "Cast", vec![weight], &device);
            c.attrs
                .insert("DstT".to_string(), AttrValue::DType(ty.dtype));
            nodes.push(c);
            weight = cast;
        }
        // Weighted where the replica computed it, so one scalar crosses to worker 0.
        let term = names.fresh(&format!("{out}/replica_{i}"));
        let value = replica_tensor(facts, i, tensor);
        nodes.push(node(term.clone(), "Mul", vec![value, weight], &device));
        terms.push(term);
    }
    nodes.push(node(out.clone(), "AddN", terms, &task_device(0)));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::builder::GraphBuilder;
    use dflow_graph::train::{OptimizerKind, OptimizerSpec};

    fn spec(loss: &str, metrics: &[&str]) -> TrainSpec {
        TrainSpec {
            lr_schedule: None,
            data: None,
            loss: loss.into(),
            optimizer: OptimizerSpec {
                kind: OptimizerKind::Sgd,
                lr: 0.1,
            },
            clip_global_norm: None,
            metrics: metrics.iter().map(|m| m.to_string()).collect(),
        }
    }

    /// A linear model: `loss = mean((x @ w + b - y)^2)`, metric `mse` (the same value by another path), variables on ps.
    fn model() -> GraphDef {
        let mut b = GraphBuilder::new();
        let (w, bias) = b.with_device("/job:ps/task:0", |b| {
            (
                b.variable("w", DType::F32, &[3, 1], "zeros"),
                b.variable("b", DType::F32, &[1], "zeros"),
            )
        });
        b.with_device("/job:worker/task:0", |b| {
            let x = b.placeholder("x", DType::F32, &[-1, 3]);
            let y = b.placeholder("y", DType::F32, &[-1, 1]);
            let p = b.matmul("p", &x, &w);
            let q = b.binary("Add", "q", &p, &bias);
            let d = b.binary("Sub", "d", &q, &y);
            let sq = b.binary("Mul", "sq", &d, &d);
            b.op("Mean", "loss").input(&sq).finish();
            let a = b.unary("Square", "sq2", &d);
            b.op("Mean", "mse").input(&a).finish();
        });
        b.to_def()
    }

    fn find<'a>(def: &'a GraphDef, name: &str) -> &'a NodeDef {
        def.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node `{name}`"))
    }

    fn sync(def: &GraphDef, workers: usize) -> ReplicaGraph {
        let mut g = ps_training(
            def,
            &spec("loss", &["mse"]),
            workers,
            PsMode::Sync,
            "x",
            "y",
        )
        .expect("sync strategy builds");
        assert_eq!(g.len(), 1);
        g.remove(0)
    }

    #[test]
    fn sync_copies_every_node_but_variables_per_replica() {
        let forward = model();
        let g = sync(&forward, 3);
        let def = &g.training.def;
        for n in forward.nodes.iter().filter(|n| n.op != "Variable") {
            for i in 0..3 {
                let copy = find(def, &format!("replica_{i}/{}", n.name));
                assert_eq!(copy.op, n.op);
                assert_eq!(
                    copy.device,
                    format!("/job:worker/task:{i}"),
                    "{}",
                    copy.name
                );
            }
            assert!(!def
                .nodes
                .iter()
                .any(|d| d.name == format!("replica_3/{}", n.name)));
        }
        for v in ["w", "b"] {
            assert_eq!(def.nodes.iter().filter(|n| n.name == v).count(), 1, "{v}");
            assert_eq!(find(def, v).device, "/job:ps/task:0");
            assert!(!def.nodes.iter().any(|n| n.name.ends_with(&format!("/{v}"))));
        }
        // Inputs point into the same replica, or at the shared variable.
        assert_eq!(find(def, "replica_2/p").inputs, ["replica_2/x", "w"]);
        assert_eq!(find(def, "replica_1/q").inputs, ["replica_1/p", "b"]);
        assert_eq!(
            find(def, "replica_1/sq").inputs,
            ["replica_1/d", "replica_1/d"]
        );
    }

    #[test]
    fn sync_names_feeds_weights_and_eval() {
        let g = sync(&model(), 2);
        let want: Vec<ReplicaFeeds> = (0..2)
            .map(|i| ReplicaFeeds {
                worker: i,
                features: format!("replica_{i}/x"),
                labels: format!("replica_{i}/y"),
                weight: Some(format!("replica_{i}/batch_weight")),
            })
            .collect();
        assert_eq!(g.replicas, want);
        assert_eq!(
            g.eval,
            EvalNames {
                features: "replica_0/x".into(),
                labels: "replica_0/y".into(),
                loss: "replica_0/loss".into(),
                metrics: vec!["replica_0/mse".into()],
            }
        );
        let def = &g.training.def;
        for i in 0..2 {
            let w = find(def, &format!("replica_{i}/batch_weight"));
            assert_eq!(w.op, "Placeholder");
            assert_eq!(w.device, format!("/job:worker/task:{i}"));
            assert_eq!(w.attrs["dtype"], AttrValue::DType(DType::F32));
            assert_eq!(w.attrs["shape"], AttrValue::Shape(Shape::scalar()));
        }
    }

    #[test]
    fn sync_loss_and_metrics_are_weighted_sums_under_their_names() {
        let g = sync(&model(), 2);
        let def = &g.training.def;
        assert_eq!(g.training.loss, "loss");
        assert_eq!(g.training.metrics, ["mse"]);
        for (name, replica) in [("loss", "loss"), ("mse", "mse")] {
            let sum = find(def, name);
            assert_eq!(sum.op, "AddN");
            assert_eq!(sum.device, "/job:worker/task:0");
            assert_eq!(
                sum.inputs,
                [format!("{name}/replica_0"), format!("{name}/replica_1")]
            );
            for i in 0..2 {
                let term = find(def, &format!("{name}/replica_{i}"));
                assert_eq!(term.op, "Mul");
                assert_eq!(term.device, format!("/job:worker/task:{i}"));
                assert_eq!(
                    term.inputs,
                    [
                        format!("replica_{i}/{replica}"),
                        format!("replica_{i}/batch_weight")
                    ]
                );
            }
        }
    }

    #[test]
    fn sync_gradients_are_summed_and_applied_once_on_ps() {
        let g = sync(&model(), 2);
        let def = &g.training.def;
        let updates: Vec<&NodeDef> = def
            .nodes
            .iter()
            .filter(|n| n.op == "ApplyGradientDescent")
            .collect();
        assert_eq!(updates.len(), 2, "one update per shared variable");
        for (var, grad) in &g.training.gradients {
            let producer = grad.split(':').next().unwrap();
            let sum = find(def, producer);
            assert_eq!(sum.op, "AddN", "gradient of {var} sums the replicas");
            assert_eq!(sum.inputs.len(), 2);
            assert_eq!(sum.device, "/job:ps/task:0");
        }
        // Every gradient op reading replica i's activations lives on worker i.
        let mut checked = 0;
        for n in &def.nodes {
            for i in 0..2 {
                if n.inputs
                    .iter()
                    .any(|s| s.starts_with(&format!("replica_{i}/")))
                    && n.name.starts_with("gradients")
                    && n.op != "AddN"
                {
                    assert_eq!(n.device, format!("/job:worker/task:{i}"), "{}", n.name);
                    checked += 1;
                }
            }
        }
        assert!(
            checked >= 4,
            "only {checked} gradient ops read replica activations"
        );
        Graph::from_def(def).expect("the sync graph validates");
    }

    #[test]
    fn a_tensor_named_twice_is_summed_once() {
        let g = ps_training(
            &model(),
            &spec("loss:0", &["loss", "mse"]),
            2,
            PsMode::Sync,
            "x",
            "y",
        )
        .unwrap()
        .remove(0);
        assert_eq!(g.training.loss, "loss");
        assert_eq!(g.training.metrics, ["loss", "mse"]);
        assert!(!g.training.def.nodes.iter().any(|n| n.name == "loss_1"));
        assert_eq!(g.eval.loss, "replica_0/loss");
    }

    #[test]
    fn one_worker_sync_is_a_weighted_copy() {
        let g = sync(&model(), 1);
        assert_eq!(g.replicas.len(), 1);
        assert_eq!(find(&g.training.def, "loss").inputs, ["loss/replica_0"]);
    }

    #[test]
    fn devices_keep_type_and_other_jobs() {
        let mut def = model();
        for n in &mut def.nodes {
            match n.name.as_str() {
                "p" => n.device = "/job:worker/task:0/device:GPU:1".into(),
                "q" => n.device = String::new(),
                "d" => n.device = "/device:CPU:0".into(),
                "sq2" => n.device = "/job:ps/task:0".into(),
                _ => {}
            }
        }
        let g = sync(&def, 2);
        let d = &g.training.def;
        assert_eq!(
            find(d, "replica_1/p").device,
            "/job:worker/task:1/device:GPU:1"
        );
        assert_eq!(find(d, "replica_1/q").device, "/job:worker/task:1");
        assert_eq!(
            find(d, "replica_1/d").device,
            "/job:worker/task:1/device:CPU:0"
        );
        assert_eq!(find(d, "replica_1/sq2").device, "/job:ps/task:0");
    }

    #[test]
    fn colocation_is_remapped_and_variable_groups_stay_put() {
        let mut def = model();
        def.nodes.push(NodeDef {
            name: "w_read".into(),
            op: "Identity".into(),
            inputs: vec!["w".into()],
            colocate_with: vec!["w".into()],
            ..NodeDef::default()
        });
        def.nodes.push(NodeDef {
            name: "d_copy".into(),
            op: "Identity".into(),
            inputs: vec!["d".into()],
            device: "/job:worker/task:0".into(),
            colocate_with: vec!["d".into()],
            ..NodeDef::default()
        });
        let g = sync(&def, 2);
        let d = &g.training.def;
        let read = find(d, "replica_1/w_read");
        assert_eq!(read.colocate_with, ["w"]);
        assert_eq!(
            read.device, "",
            "colocated with a variable: left to placement"
        );
        let copy = find(d, "replica_1/d_copy");
        assert_eq!(copy.colocate_with, ["replica_1/d"]);
        assert_eq!(copy.device, "/job:worker/task:1");
    }

    #[test]
    fn control_inputs_are_remapped() {
        let mut def = model();
        def.nodes.push(NodeDef {
            name: "after".into(),
            op: "NoOp".into(),
            inputs: vec!["^loss".into(), "^w".into()],
            ..NodeDef::default()
        });
        let g = sync(&def, 2);
        assert_eq!(
            find(&g.training.def, "replica_1/after").inputs,
            ["^replica_1/loss", "^w"]
        );
    }

    #[test]
    fn f64_losses_weight_through_a_cast() {
        let mut b = GraphBuilder::new();
        let w = b.variable("w", DType::F64, &[2], "ones");
        let x = b.placeholder("x", DType::F64, &[-1, 2]);
        let y = b.placeholder("y", DType::F64, &[-1]);
        let p = b.binary("Mul", "p", &x, &w);
        b.op("Mean", "loss").input(&p).finish();
        let _ = y;
        let g = ps_training(&b.to_def(), &spec("loss", &[]), 2, PsMode::Sync, "x", "y").unwrap();
        let def = &g[0].training.def;
        let cast = find(def, "loss/replica_1/weight");
        assert_eq!(cast.op, "Cast");
        assert_eq!(cast.attrs["DstT"], AttrValue::DType(DType::F64));
        assert_eq!(
            find(def, "loss/replica_1").inputs[1],
            "loss/replica_1/weight"
        );
    }

    #[test]
    fn async_retargets_each_graph_and_shares_variables() {
        let forward = model();
        let graphs = ps_training(
            &forward,
            &spec("loss", &["mse"]),
            3,
            PsMode::Async,
            "x",
            "y",
        )
        .unwrap();
        assert_eq!(graphs.len(), 3);
        for (i, g) in graphs.iter().enumerate() {
            let def = &g.training.def;
            assert_eq!(
                g.replicas,
                [ReplicaFeeds {
                    worker: i,
                    features: "x".into(),
                    labels: "y".into(),
                    weight: None,
                }]
            );
            assert_eq!(g.eval.loss, "loss");
            assert_eq!(g.eval.metrics, ["mse"]);
            assert_eq!(g.training.loss, "loss");
            for n in forward.nodes.iter() {
                let copy = find(def, &n.name);
                if n.op == "Variable" {
                    assert_eq!(copy.device, "/job:ps/task:0");
                } else {
                    assert_eq!(copy.device, format!("/job:worker/task:{i}"), "{}", n.name);
                }
            }
            assert_eq!(
                find(def, &g.training.train_op).device,
                format!("/job:worker/task:{i}")
            );
            let vars: Vec<&str> = g
                .training
                .gradients
                .iter()
                .map(|(v, _)| v.as_str())
                .collect();
            assert_eq!(vars, ["w", "b"]);
            assert_eq!(find(def, "train/w/update").device, "/job:ps/task:0");
        }
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let def = model();
        let err = |s: &TrainSpec, workers, features: &str, labels: &str| {
            ps_training(&def, s, workers, PsMode::Sync, features, labels)
                .unwrap_err()
                .to_string()
        };
        let plain = spec("loss", &["mse"]);
        let e = err(&plain, 0, "x", "y");
        assert!(e.contains("got 0"), "{e}");
        let e = err(&plain, 2, "pixels", "y");
        assert!(
            e.contains("features placeholder `pixels`") && e.contains("no node"),
            "{e}"
        );
        let e = err(&plain, 2, "x", "sq");
        assert!(
            e.contains("labels placeholder `sq`") && e.contains("Mul"),
            "{e}"
        );
        let e = err(&spec("nope", &[]), 2, "x", "y");
        assert!(e.contains("loss `nope`") && e.contains("no node"), "{e}");
        let e = err(&spec("loss", &["p:3"]), 2, "x", "y");
        assert!(e.contains("metric `p:3`"), "{e}");
        let e = err(&spec("sq", &[]), 2, "x", "y");
        assert!(e.contains("loss `sq`") && e.contains("scalar"), "{e}");
        let e = ps_training(&def, &plain, 0, PsMode::Async, "x", "y").unwrap_err();
        assert_eq!(e, StrategyError::WorkerCount(0));
    }

    #[test]
    fn non_float_metrics_are_refused() {
        let mut def = model();
        def.nodes.push(NodeDef {
            name: "count".into(),
            op: "Const".into(),
            attrs: BTreeMap::from([(
                "value".to_string(),
                AttrValue::Tensor(dflow_graph::Tensor::scalar(3i64).into()),
            )]),
            ..NodeDef::default()
        });
        let e = ps_training(&def, &spec("loss", &["count"]), 2, PsMode::Sync, "x", "y")
            .unwrap_err()
            .to_string();
        assert!(e.contains("metric `count` is i64"), "{e}");
    }

    #[test]
    fn a_variable_named_like_a_replica_copy_is_refused() {
        let mut def = model();
        def.nodes.push(NodeDef {
            name: "replica_1/p".into(),
            op: "Variable".into(),
            attrs: BTreeMap::from([
                ("dtype".to_string(), AttrValue::DType(DType::F32)),
                ("shape".to_string(), AttrValue::Shape(Shape::scalar())),
            ]),
            ..NodeDef::default()
        });
        let e = ps_training(&def, &spec("loss", &[]), 2, PsMode::Sync, "x", "y").unwrap_err();
        assert_eq!(
            e,
            StrategyError::NameTaken {
                node: "p".into(),
                name: "replica_1/p".into()
            }
        );
    }

    #[test]
    fn a_node_named_like_an_added_one_gets_a_fresh_name() {
        let mut def = model();
        def.nodes.push(NodeDef {
            name: "loss/replica_0".into(),
            op: "Variable".into(),
            attrs: BTreeMap::from([
                ("dtype".to_string(), AttrValue::DType(DType::F32)),
                ("shape".to_string(), AttrValue::Shape(Shape::scalar())),
            ]),
            ..NodeDef::default()
        });
        let g = sync(&def, 2);
        assert_eq!(
            find(&g.training.def, "loss").inputs,
            ["loss/replica_0_1", "loss/replica_1"]
        );
    }

    #[test]
    fn a_cluster_with_a_gap_in_its_worker_indices_places_replica_i_on_the_ith_task() {
        // An elastic job's survivors: workers 0 and 2 (worker 1 died).
        let def = model();
        let graph = Graph::from_def(&def).unwrap();
        let train = spec("loss", &["mse"]);
        let jobs = BTreeMap::from([
            (
                "ps".to_string(),
                BTreeMap::from([(0, "127.0.0.1:1999".to_string())]),
            ),
            (
                "worker".to_string(),
                BTreeMap::from([
                    (0, "127.0.0.1:2000".to_string()),
                    (2, "127.0.0.1:2002".to_string()),
                ]),
            ),
        ]);
        let cluster = dflow_graph::ClusterSpec::new(jobs).unwrap();
        let input = JobInput::new(&graph, &train, &cluster, "x", "y");
        let plan = ParameterServer {
            mode: PsMode::Sync,
            partition_strategy: None,
            batch_size: None,
        }
        .plan(&input)
        .unwrap();
        assert_eq!(plan.batch_parts, 2, "the batch is split in two parts");
        let mut parts: Vec<(String, u32)> = plan
            .train_signatures()
            .flat_map(|s| s.feeds.iter().map(|f| (f.task.clone(), f.part)))
            .collect();
        parts.sort();
        parts.dedup();
        assert_eq!(
            parts,
            [
                ("/job:worker/replica:0/task:0".to_string(), 0),
                ("/job:worker/replica:0/task:2".to_string(), 1)
            ]
        );
        for s in &plan.signatures {
            for device in s.partitions.partitions.keys() {
                assert!(
                    !(device.job.as_deref() == Some("worker") && device.task == Some(1)),
                    "nothing on the dead worker: {device}"
                );
            }
        }
        // The variables stay on the ps.
        assert!(plan
            .variables
            .iter()
            .all(|v| v.holders == ["/job:ps/replica:0/task:0"]));
    }
}
