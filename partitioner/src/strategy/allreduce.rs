//! All-reduce data parallelism as a graph rewrite: every worker holds the whole model and the
//! gradients are summed across workers by collective all-reduces, fused into buckets.
//!
//! [`allreduce_training`] returns one graph per worker. Graph `i` is the forward graph with every
//! node (variables included) on `/job:worker/task:{i}`, its loss weighted by a fed scalar
//! `batch_weight` (the worker's share `n_i / n` of the global batch), and the training step of
//! that weighted loss whose gradients, before they reach the update ops, go through
//! `CollectiveAllReduce(sum)` over group [`GROUP`]: each worker applies `Σ_i n_i/n · ∇L_i`, the
//! gradient of the mean loss over the global batch, so the workers stay identical and train
//! like one process on the global batch.
//!
//! Fusion: the gradients are packed (`PackFlat`) into buckets of at most `bucket_bytes` (like
//! Horovod's fusion threshold and DDP's buckets; default [`DEFAULT_BUCKET_BYTES`]), one
//! all-reduce per bucket, then sliced back (`FlatSlice`). Buckets are filled in reverse variable
//! order — the backward pass produces the last layers' gradients first — so the first bucket can
//! be reduced while the backward pass is still running. The all-reduces are chained by control
//! edges so every worker issues them in the same order; last comes the all-reduce of the
//! weighted loss, giving every worker the global batch's mean loss (the fetched `loss`).
//!
//! Gradient clipping by global norm, when the spec asks for it, clips the summed gradient: one
//! `GlobalNormScale` over the all-reduced gradients (whole on every worker) scales them before
//! the updates, so clipping equals the one-process run's (clipping each worker's gradient before
//! the sum would not).

use super::{JobInput, JobPlan, Registration, ReplicaGraph, Strategy, StrategyError};
use crate::job::{CollectiveGroup, Schedule};
use dflow_graph::train::{expand_training_graph, TrainSpec};
use dflow_graph::{AttrValue, DType, DeviceName, Graph, GraphDef, InputRef, NodeDef, Shape};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The collective group of the workers.
pub const GROUP: &str = "workers";

/// Default fusion threshold: 25 MiB per bucket, as PyTorch DDP.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// The placeholder each worker feeds with its share of the global batch.
pub const BATCH_WEIGHT: &str = "batch_weight";

pub(super) fn worker_device(
    node: &str,
    device: &str,
    task: usize,
) -> Result<String, StrategyError> {
    let mut d = DeviceName::parse(device).map_err(|e| StrategyError::InvalidDevice {
        node: node.to_string(),
        device: device.to_string(),
        message: e.to_string(),
    })?;
    d.job = Some("worker".into());
    d.replica = None;
    d.task = Some(task as u32);
    Ok(d.to_string())
}

/// A gradient tensor and its static dimensions, in a bucket.
type GradientSlot = (String, Vec<usize>);

pub(super) fn fresh(taken: &mut HashSet<String>, base: &str) -> String {
    let mut name = base.to_string();
    let mut k = 1;
    while taken.contains(&name) {
        name = format!("{base}_{k}");
        k += 1;
    }
    taken.insert(name.clone());
    name
}

pub(super) fn node(name: &str, op: &str, inputs: Vec<String>, device: &str) -> NodeDef {
    NodeDef {
        name: name.to_string(),
        op: op.to_string(),
        inputs,
        device: device.to_string(),
        ..NodeDef::default()
    }
}

/// All-reduce data parallelism: every worker holds the model, gradients are summed by
/// collective all-reduces in buckets of at most `bucket_bytes`; no ps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllReduce {
    /// Fusion threshold.
    pub bucket_bytes: usize,
}

/// `--strategy allreduce`.
pub(super) static REGISTRATION: Registration = Registration {
    name: "allreduce",
    about: "every worker holds the model; gradients all-reduced in fused buckets; no ps",
    build: |opts| {
        if opts.asynchronous {
            return Err(StrategyError::Options {
                strategy: "allreduce",
                message: "all-reduce is synchronous; --async is a parameter-server mode (use --strategy ps)".into(),
            });
        }
        Ok(Box::new(AllReduce {
            bucket_bytes: opts.bucket_bytes,
        }))
    },
};

impl Strategy for AllReduce {
    fn name(&self) -> &'static str {
        REGISTRATION.name
    }

    fn describe(&self) -> String {
        format!(
            "all-reduce data-parallel training, buckets of {:.1} MiB",
            self.bucket_bytes as f64 / (1u64 << 20) as f64
        )
    }

    fn plan(&self, input: &JobInput<'_>) -> Result<JobPlan, StrategyError> {
        let forward = input.graph.to_def();
        // Graph `i` goes to the `i`-th worker task of the cluster: its indices need not be
        // dense (an elastic job re-plans on the survivors, e.g. tasks 0 and 2).
        let tasks: Vec<u32> = input.cluster.tasks("worker").map(|(i, _)| i).collect();
        let graphs = allreduce_graphs_on(
            input.graph,
            &forward,
            input.train,
            &tasks,
            input.features,
            input.labels,
            self.bucket_bytes,
        )?;
        // Every node of a worker's graph stays on that worker: no device setter.
        let placement = input.explicit_placement();
        let group = CollectiveGroup {
            key: GROUP.to_string(),
            members: input.worker_task_names(),
        };
        JobPlan::build(
            self.describe(),
            input,
            graphs,
            &placement,
            Schedule::Lockstep,
            vec![group],
        )
    }
}

/// The all-reduce training graphs, one per worker (see the module docs). `features` and
/// `labels` name the placeholders each worker feeds with its part of every global batch.
pub fn allreduce_training(
    forward: &GraphDef,
    spec: &TrainSpec,
    workers: usize,
    features: &str,
    labels: &str,
    bucket_bytes: usize,
) -> Result<Vec<ReplicaGraph>, StrategyError> {
    let graph = Graph::from_def(forward).map_err(StrategyError::InvalidGraph)?;
    allreduce_graphs(
        &graph,
        forward,
        spec,
        workers,
        features,
        labels,
        bucket_bytes,
    )
}

/// [`allreduce_training`] of an already validated `graph`, whose definition is `forward`.
pub(crate) fn allreduce_graphs(
    graph: &Graph,
    forward: &GraphDef,
    spec: &TrainSpec,
    workers: usize,
    features: &str,
    labels: &str,
    bucket_bytes: usize,
) -> Result<Vec<ReplicaGraph>, StrategyError> {
    let tasks: Vec<u32> = (0..workers)
        .map(|i| u32::try_from(i).map_err(|_| StrategyError::WorkerCount(workers)))
        .collect::<Result<_, _>>()?;
    allreduce_graphs_on(graph, forward, spec, &tasks, features, labels, bucket_bytes)
}

/// [`allreduce_graphs`] on the worker tasks `tasks` (ascending, not necessarily dense): graph
/// `i` is placed on `/job:worker/task:{tasks[i]}` and feeds part `i` of every global batch.
pub(crate) fn allreduce_graphs_on(
    graph: &Graph,
    forward: &GraphDef,
    spec: &TrainSpec,
    tasks: &[u32],
    features: &str,
    labels: &str,
    bucket_bytes: usize,
) -> Result<Vec<ReplicaGraph>, StrategyError> {
    let loss_dtype = check_job(graph, spec, tasks.len(), features, labels)?;
    tasks
        .iter()
        .enumerate()
        .map(|(part, &task)| {
            let on = Replica {
                part,
                task: task as usize,
            };
            worker_graph(
                forward,
                spec,
                on,
                features,
                labels,
                bucket_bytes,
                loss_dtype,
            )
        })
        .collect()
}

/// Which part of the batch a replica feeds and which worker task holds it.
#[derive(Debug, Clone, Copy)]
struct Replica {
    part: usize,
    task: usize,
}

#[allow(clippy::too_many_arguments)]
fn worker_graph(
    forward: &GraphDef,
    spec: &TrainSpec,
    on: Replica,
    features: &str,
    labels: &str,
    bucket_bytes: usize,
    loss_dtype: DType,
) -> Result<ReplicaGraph, StrategyError> {
    let weighted = weighted_training(
        forward,
        &TrainSpec {
            clip_global_norm: None,
            ..spec.clone()
        },
        on.task,
        loss_dtype,
    )?;
    reduce_gradients(
        weighted,
        spec,
        on.part,
        features,
        labels,
        bucket_bytes,
        &HashSet::new(),
        (GROUP, 1),
    )
}

/// The all-reduce part of a worker's graph: the gradients of every variable not in `local`
/// summed in buckets (see the module docs), clipping when `spec` asks for it, the update ops
/// reading the sums, and the global loss. When clipping, the norm also counts the `local`
/// gradients (an all-gather of each one's norm over `locals_group`, a group key and its size,
/// in which every local gradient is held by exactly one worker), and they are scaled too. Collectives already in the graph (a strategy's
/// forward collectives and their gradients) are first chained by control edges in the graph's
/// topological order, and the buckets come after them, so that every worker issues all its
/// collectives in one order.
#[allow(clippy::too_many_arguments)]
pub(super) fn reduce_gradients(
    w: WeightedTraining,
    spec: &TrainSpec,
    worker: usize,
    features: &str,
    labels: &str,
    bucket_bytes: usize,
    local: &HashSet<String>,
    locals_group: (&str, usize),
) -> Result<ReplicaGraph, StrategyError> {
    let (locals_key, group_size) = locals_group;
    let WeightedTraining {
        mut training,
        typed,
        device,
        weight,
        weighted,
        base,
    } = w;
    let mut taken: HashSet<String> = training.def.nodes.iter().map(|n| n.name.clone()).collect();

    // The collectives already there, chained in topological order.
    let mut previous: Option<String> = None;
    let chain: Vec<String> = typed
        .topo_order()
        .into_iter()
        .map(|i| typed.node(i))
        .filter(|n| n.op.starts_with("Collective"))
        .map(|n| n.name.clone())
        .collect();
    for name in chain {
        if let Some(p) = &previous {
            if let Some(n) = training.def.nodes.iter_mut().find(|n| n.name == name) {
                n.inputs.push(format!("^{p}"));
            }
        }
        previous = Some(name);
    }

    // Buckets of gradients, last variables first, split by dtype and by the threshold.
    let mut buckets: Vec<(DType, Vec<GradientSlot>)> = Vec::new();
    let mut bucket_size = 0usize;
    for (var, grad) in training.gradients.iter().rev() {
        if local.contains(var) {
            continue;
        }
        let r = InputRef::parse(grad).map_err(|message| StrategyError::UnknownTensor {
            role: "gradient",
            name: grad.clone(),
            message,
        })?;
        let InputRef::Data {
            node: producer,
            index,
        } = r
        else {
            continue;
        };
        let ty = typed
            .find(&producer)
            .and_then(|i| typed.output_type(i, index))
            .ok_or_else(|| StrategyError::UnknownTensor {
                role: "gradient",
                name: grad.clone(),
                message: format!("the gradient of `{var}` is not in the graph"),
            })?;
        let dims = ty
            .shape
            .as_static()
            .ok_or_else(|| StrategyError::NotScalar {
                role: "gradient",
                name: grad.clone(),
                shape: ty.shape.clone(),
            })?;
        let bytes = dims.iter().product::<usize>() * ty.dtype.size_of();
        let fits = buckets
            .last()
            .is_some_and(|(d, _)| *d == ty.dtype && bucket_size + bytes <= bucket_bytes.max(1));
        if !fits {
            buckets.push((ty.dtype, Vec::new()));
            bucket_size = 0;
        }
        bucket_size += bytes;
        if let Some((_, grads)) = buckets.last_mut() {
            grads.push((grad.clone(), dims));
        }
    }

    let mut reduced: HashMap<String, String> = HashMap::new();
    let mut instance = 1i64;
    let mut added = Vec::new();
    for (k, (_, grads)) in buckets.iter().enumerate() {
        let pack = fresh(&mut taken, &format!("allreduce/bucket_{k}/pack"));
        let mut inputs: Vec<String> = grads.iter().map(|(g, _)| g.clone()).collect();
        if let Some(p) = &previous {
            inputs.push(format!("^{p}"));
        }
        added.push(node(&pack, "PackFlat", inputs, &device));
        let ar = fresh(&mut taken, &format!("allreduce/bucket_{k}"));
        let mut n = node(&ar, "CollectiveAllReduce", vec![pack], &device);
        n.attrs = BTreeMap::from([
            ("group_key".to_string(), AttrValue::String(GROUP.into())),
            ("instance_key".to_string(), AttrValue::Int(instance)),
            ("reduce".to_string(), AttrValue::String("sum".into())),
        ]);
        instance += 1;
        added.push(n);
        let mut offset = 0i64;
        for (j, (g, dims)) in grads.iter().enumerate() {
            let slice = fresh(&mut taken, &format!("allreduce/bucket_{k}/grad_{j}"));
            let mut s = node(&slice, "FlatSlice", vec![ar.clone()], &device);
            s.attrs = BTreeMap::from([
                ("offset".to_string(), AttrValue::Int(offset)),
                ("shape".to_string(), AttrValue::Shape(Shape::known(dims))),
            ]);
            offset += dims.iter().product::<usize>() as i64;
            added.push(s);
            reduced.insert(g.clone(), slice);
        }
        previous = Some(ar);
    }
    // Clipping by the global norm of the summed gradients.
    if let Some(clip) = spec.clip_global_norm {
        let mut summed: Vec<String> = training
            .gradients
            .iter()
            .filter_map(|(_, g)| reduced.get(g).cloned())
            .collect();
        // Local gradients (each on one worker): every worker's sqrt(Σ local²), all-gathered;
        // their squares sum to the local gradients' squared norm over all workers.
        let locals: Vec<String> = training
            .gradients
            .iter()
            .filter(|(v, _)| local.contains(v))
            .map(|(_, g)| g.clone())
            .collect();
        if !locals.is_empty() {
            let pack = fresh(&mut taken, "allreduce/clip/local/pack");
            added.push(node(&pack, "PackFlat", locals.clone(), &device));
            let sq = fresh(&mut taken, "allreduce/clip/local/square");
            added.push(node(&sq, "Square", vec![pack], &device));
            let sum = fresh(&mut taken, "allreduce/clip/local/sum");
            let mut n = node(&sum, "Sum", vec![sq], &device);
            n.attrs = BTreeMap::from([("keep_dims".to_string(), AttrValue::Bool(true))]);
            added.push(n);
            let norm = fresh(&mut taken, "allreduce/clip/local/norm");
            added.push(node(&norm, "Sqrt", vec![sum], &device));
            let gather = fresh(&mut taken, "allreduce/clip/local/all_gather");
            let mut inputs = vec![norm];
            if let Some(p) = &previous {
                inputs.push(format!("^{p}"));
            }
            let mut n = node(&gather, "CollectiveAllGather", inputs, &device);
            n.attrs = BTreeMap::from([
                (
                    "group_key".to_string(),
                    AttrValue::String(locals_key.into()),
                ),
                ("instance_key".to_string(), AttrValue::Int(instance)),
                ("group_size".to_string(), AttrValue::Int(group_size as i64)),
            ]);
            instance += 1;
            added.push(n);
            previous = Some(gather.clone());
            summed.push(gather);
            for g in locals {
                reduced.insert(g.clone(), g);
            }
        }
        let scale = fresh(&mut taken, "allreduce/clip/global_norm_scale");
        let mut n = node(&scale, "GlobalNormScale", summed, &device);
        n.attrs = BTreeMap::from([("clip_norm".to_string(), AttrValue::Float(clip))]);
        added.push(n);
        for (k, (_, g)) in training.gradients.iter().enumerate() {
            if let Some(r) = reduced.get_mut(g) {
                let clipped = fresh(&mut taken, &format!("allreduce/clip/grad_{k}"));
                added.push(node(
                    &clipped,
                    "Mul",
                    vec![r.clone(), scale.clone()],
                    &device,
                ));
                *r = clipped;
            }
        }
    }
    // The update ops read the summed gradients.
    for n in &mut training.def.nodes {
        if n.op.starts_with("Apply") {
            for input in &mut n.inputs {
                if let Some(r) = reduced.get(input) {
                    *input = r.clone();
                }
            }
        }
    }
    // The global batch's mean loss, after the gradients (one order of collectives everywhere).
    let global = fresh(&mut taken, &format!("{base}/global"));
    let mut inputs = vec![weighted.clone()];
    if let Some(p) = &previous {
        inputs.push(format!("^{p}"));
    }
    let mut n = node(&global, "CollectiveAllReduce", inputs, &device);
    n.attrs = BTreeMap::from([
        ("group_key".to_string(), AttrValue::String(GROUP.into())),
        ("instance_key".to_string(), AttrValue::Int(instance)),
        ("reduce".to_string(), AttrValue::String("sum".into())),
    ]);
    added.push(n);
    training.def.nodes.extend(added);
    training.loss = global;
    ReplicaGraph::of_replica(training, worker, (features, labels), Some(weight), spec)
}

/// Checks a data-parallel job's arguments: 1 to `u32::MAX` workers, `features` and `labels`
/// placeholders, a scalar f32/f64 loss. Returns the loss's dtype.
pub(super) fn check_job(
    graph: &Graph,
    spec: &TrainSpec,
    workers: usize,
    features: &str,
    labels: &str,
) -> Result<DType, StrategyError> {
    if workers == 0 || u32::try_from(workers).is_err() {
        return Err(StrategyError::WorkerCount(workers));
    }
    for (role, name) in [("features", features), ("labels", labels)] {
        match graph.find(name).map(|i| graph.node(i).op) {
            Some("Placeholder") => {}
            Some(op) => {
                return Err(StrategyError::NotAPlaceholder {
                    role,
                    name: name.to_string(),
                    message: format!("the node is a {op}, not a Placeholder"),
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
    let loss_type = {
        let r = InputRef::parse(&spec.loss).map_err(|message| StrategyError::UnknownTensor {
            role: "loss",
            name: spec.loss.clone(),
            message,
        })?;
        let (producer, index) = match r {
            InputRef::Data { node, index } => (node, index),
            InputRef::Control(_) => {
                return Err(StrategyError::UnknownTensor {
                    role: "loss",
                    name: spec.loss.clone(),
                    message: "a control input is not a tensor".into(),
                })
            }
        };
        graph
            .find(&producer)
            .and_then(|i| graph.output_type(i, index))
            .cloned()
            .ok_or_else(|| StrategyError::UnknownTensor {
                role: "loss",
                name: spec.loss.clone(),
                message: "no such tensor".into(),
            })?
    };
    if !matches!(loss_type.dtype, DType::F32 | DType::F64) {
        return Err(StrategyError::NotFloat {
            role: "loss",
            name: spec.loss.clone(),
            dtype: loss_type.dtype,
        });
    }
    if loss_type.shape.rank().is_some_and(|r| r != 0) {
        return Err(StrategyError::NotScalar {
            role: "loss",
            name: spec.loss.clone(),
            shape: loss_type.shape.clone(),
        });
    }
    Ok(loss_type.dtype)
}

/// One worker's training graph before any collective: the forward graph on
/// `/job:worker/task:{worker}`, its loss times a fed `batch_weight`, and the training step of
/// that weighted loss (see [`weighted_training`]).
pub(super) struct WeightedTraining {
    /// The expanded training graph.
    pub training: dflow_graph::train::TrainingGraph,
    /// Its validated form (for gradient types).
    pub typed: Graph,
    /// The worker's device.
    pub device: String,
    /// The batch-weight placeholder.
    pub weight: String,
    /// The weighted loss tensor.
    pub weighted: String,
    /// The loss node's name.
    pub base: String,
}

/// The forward graph of `worker` with every node on it, its loss weighted by the worker's share
/// of the batch, and the training step of `spec` (a ZeRO rewrite passes a spec without
/// clipping and replaces the update ops).
pub(super) fn weighted_training(
    forward: &GraphDef,
    spec: &TrainSpec,
    worker: usize,
    loss_dtype: DType,
) -> Result<WeightedTraining, StrategyError> {
    let device = worker_device("", "", worker)?;
    let mut def = forward.clone();
    def.train = None;
    for n in &mut def.nodes {
        n.device = worker_device(&n.name, &n.device, worker)?;
    }
    let mut taken: HashSet<String> = def.nodes.iter().map(|n| n.name.clone()).collect();
    let weight = fresh(&mut taken, BATCH_WEIGHT);
    let mut w = node(&weight, "Placeholder", vec![], &device);
    w.attrs = BTreeMap::from([
        ("dtype".to_string(), AttrValue::DType(DType::F32)),
        ("shape".to_string(), AttrValue::Shape(Shape::scalar())),
    ]);
    def.nodes.push(w);
    let mut weight_in = weight.clone();
    if loss_dtype != DType::F32 {
        let cast = fresh(&mut taken, &format!("{weight}/cast"));
        let mut c = node(&cast, "Cast", vec![weight.clone()], &device);
        c.attrs
            .insert("DstT".to_string(), AttrValue::DType(loss_dtype));
        def.nodes.push(c);
        weight_in = cast;
    }
    let base = spec
        .loss
        .split(':')
        .next()
        .unwrap_or(&spec.loss)
        .to_string();
    let weighted = fresh(&mut taken, &format!("{base}/weighted"));
    def.nodes.push(node(
        &weighted,
        "Mul",
        vec![spec.loss.clone(), weight_in],
        &device,
    ));
    let (training, typed) = expand_training_graph(
        &def,
        &TrainSpec {
            loss: weighted.clone(),
            ..spec.clone()
        },
    )?;
    Ok(WeightedTraining {
        training,
        typed,
        device,
        weight,
        weighted,
        base,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::train::{OptimizerKind, OptimizerSpec};

    fn digits() -> (GraphDef, TrainSpec) {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/digits/digits.json"
        ))
        .unwrap();
        let parsed = dflow_graph::format::parse_json(&text, None).unwrap();
        let spec = parsed.def.train.clone().unwrap();
        (parsed.def, spec)
    }

    #[test]
    fn a_cluster_with_a_gap_in_its_worker_indices_places_graph_i_on_the_ith_task() {
        // An elastic job's survivors: workers 0 and 2 (worker 1 died).
        let (def, spec) = digits();
        let graph = Graph::from_def(&def).unwrap();
        let jobs = BTreeMap::from([(
            "worker".to_string(),
            BTreeMap::from([
                (0, "127.0.0.1:2000".to_string()),
                (2, "127.0.0.1:2002".to_string()),
            ]),
        )]);
        let cluster = dflow_graph::ClusterSpec::new(jobs).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "pixels", "labels");
        let plan = AllReduce {
            bucket_bytes: 1 << 20,
        }
        .plan(&input)
        .unwrap();
        assert_eq!(plan.batch_parts, 2, "the batch is split in two parts");
        assert_eq!(
            plan.groups[0].members,
            [
                "/job:worker/replica:0/task:0",
                "/job:worker/replica:0/task:2"
            ]
        );
        // One training signature per worker.
        let mut parts: Vec<(String, u32)> = plan
            .signatures
            .iter()
            .filter(|s| s.kind == crate::SignatureKind::Train)
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
                assert_ne!(device.task, Some(1), "nothing on the dead worker");
            }
        }
    }

    #[test]
    fn every_worker_holds_the_model_and_sums_gradients_in_ordered_buckets() {
        let (def, spec) = digits();
        let graphs = allreduce_training(&def, &spec, 2, "pixels", "labels", 1 << 20).unwrap();
        assert_eq!(graphs.len(), 2);
        for (i, g) in graphs.iter().enumerate() {
            let want = format!("/job:worker/task:{i}");
            for n in &g.training.def.nodes {
                assert_eq!(n.device, want, "{} is on {}", n.name, n.device);
            }
            let ars: Vec<&NodeDef> = g
                .training
                .def
                .nodes
                .iter()
                .filter(|n| n.op == "CollectiveAllReduce")
                .collect();
            // One bucket of 1 MiB holds all four gradients; then the loss.
            assert_eq!(
                ars.len(),
                2,
                "{:?}",
                ars.iter().map(|n| &n.name).collect::<Vec<_>>()
            );
            assert_eq!(ars[1].inputs[1], format!("^{}", ars[0].name));
            for n in g
                .training
                .def
                .nodes
                .iter()
                .filter(|n| n.op.starts_with("Apply"))
            {
                let grad = n.inputs.last().unwrap();
                assert!(grad.starts_with("allreduce/bucket_0/grad_"), "{grad}");
            }
            assert_eq!(g.replicas[0].weight.as_deref(), Some(BATCH_WEIGHT));
            assert_eq!(g.training.loss, ars[1].name);
        }
    }

    #[test]
    fn a_small_threshold_makes_one_bucket_per_gradient_chained_in_order() {
        let (def, spec) = digits();
        let graphs = allreduce_training(&def, &spec, 3, "pixels", "labels", 1).unwrap();
        let nodes = &graphs[2].training.def.nodes;
        let packs: Vec<&NodeDef> = nodes.iter().filter(|n| n.op == "PackFlat").collect();
        assert_eq!(packs.len(), 4);
        for (k, pack) in packs.iter().enumerate().skip(1) {
            assert_eq!(
                pack.inputs.last().unwrap(),
                &format!("^allreduce/bucket_{}", k - 1)
            );
        }
        // Reverse variable order: the last layer's bias first.
        assert!(
            packs[0].inputs[0].contains("logits"),
            "{:?}",
            packs[0].inputs
        );
    }

    #[test]
    fn clipping_scales_the_summed_gradients_by_their_global_norm() {
        let (def, mut spec) = digits();
        spec.clip_global_norm = Some(1.0);
        let graphs = allreduce_training(&def, &spec, 2, "pixels", "labels", 1 << 20).unwrap();
        let nodes = &graphs[0].training.def.nodes;
        let scale = nodes.iter().find(|n| n.op == "GlobalNormScale").unwrap();
        // The norm of the all-reduced gradients, not of the worker's own.
        assert_eq!(scale.inputs.len(), 4);
        assert!(scale
            .inputs
            .iter()
            .all(|i| i.starts_with("allreduce/bucket_0/grad_")));
        for n in nodes.iter().filter(|n| n.op.starts_with("Apply")) {
            let grad = n.inputs.last().unwrap();
            assert!(grad.starts_with("allreduce/clip/grad_"), "{grad}");
        }
        assert_eq!(
            nodes.iter().filter(|n| n.op == "GlobalNormScale").count(),
            1
        );
    }

    #[test]
    fn bad_arguments_are_errors() {
        let (def, spec) = digits();
        assert!(matches!(
            allreduce_training(&def, &spec, 0, "pixels", "labels", 1),
            Err(StrategyError::WorkerCount(0))
        ));
        let err = allreduce_training(&def, &spec, 2, "nope", "labels", 1).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
        let bad = TrainSpec {
            lr_schedule: None,
            data: None,
            loss: "logits".into(),
            optimizer: OptimizerSpec {
                kind: OptimizerKind::Sgd,
                lr: 0.1,
            },
            clip_global_norm: None,
            metrics: vec![],
        };
        assert!(allreduce_training(&def, &bad, 2, "pixels", "labels", 1).is_err());
    }
}
