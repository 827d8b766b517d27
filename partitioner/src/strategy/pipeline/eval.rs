//! The pipeline's evaluation: one forward pass of the held-out batch through the stages of the
//! replica, each op on its own stage's worker reading that stage's weights, so that no stage's
//! weights are joined on one task (the point of a pipeline for a model too big for one device).
//!
//! The evaluation signature holds:
//! - `eval/<features>` and `eval/<labels>`: the held-out batch's placeholders (batch dimension as
//!   written), on the first stage's worker (the chief, which feeds them);
//! - `eval/<op>`: one copy of every batch op, on the worker of the op's stage, reading the
//!   weights of that stage in place;
//! - `eval/pipeline/cross/<tensor>/...`: every tensor that one stage's copy makes and another
//!   stage's reads (an activation, or the labels for the last stage) crosses once per reading
//!   stage. Tensors between tasks need static shapes (their receive buffers are allocated once),
//!   and a held-out batch may be partial (the last batch of a CSV test set), so a tensor whose
//!   first dimension follows the batch is sent padded to its size at the global batch `B`
//!   (`padded = Gather(x, [0, 1, …, R−1] mod n)`, `n` its rows, `R` its rows at `B`), with
//!   `n`, and the reading stage takes its first `n` rows back (`Gather(padded, Range(0, n))`):
//!   each stage computes on exactly the held-out rows, so the loss is the one-process loss of
//!   the batch. A tensor of a static shape (a scalar, or the batch at a placeholder's fixed
//!   size) crosses as it is;
//! - `eval/pipeline/fetch/...`: the loss and metrics of the last stage, sent to the chief, which
//!   the executor fetches them from.
//!
//! A weight read by two stages (a tied embedding, read by the first stage's lookup and the
//! last stage's head) crosses once per evaluation batch, as it does once per training step;
//! no other weight leaves its stage (under ZeRO-3 each stage's replicas' flat shards are joined
//! on the stage's worker, `super::zero`). When a crossing tensor has an unknown dimension
//! besides its first, or a fetched loss or metric has no static shape (so no static size can
//! hold it), the whole evaluation runs on the first stage's worker instead, reading every
//! stage's weights ([`joined`], the older evaluation).
//!
//! With tensor parallelism inside the stages ([`add_sharded_stage_eval`], the 3D mesh) every
//! tensor-parallel rank of replica 0 runs its own [`stage_copy`] on its shards, with its stage's
//! collectives, fed whole batches of a static size; under ZeRO-3 each rank's flat shards are
//! joined first on its own stage's worker (`tensor::mesh3d`). `expert::eval` runs the
//! `dp × ep × pp` evaluation through it as one rank, each stage's experts joined on its worker.

use super::schedule::PipelineShape;
use super::stages::StageMap;
use super::PipelineError;
use crate::strategy::{EvalNames, StrategyError};
use dflow_graph::train::TrainSpec;
use dflow_graph::{AttrValue, DType, Graph, GraphDef, InputRef, NodeDef, Shape, Tensor};
use petgraph::graph::NodeIndex;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

/// The name scope of what the staged evaluation adds besides the copies of the forward ops.
const SCOPE: &str = "eval/pipeline";

/// What the evaluation of one pipeline replica needs.
pub(super) struct EvalInput<'a> {
    /// The forward graph.
    pub graph: &'a Graph,
    /// The stage of every op of `graph`.
    pub stages: &'a StageMap,
    /// Stages, micro-batches, chunks.
    pub shape: PipelineShape,
    /// The device of each pipeline stage; `devices[0]` is the chief for replica 0.
    pub devices: &'a [String],
    /// The features placeholder.
    pub features: &'a str,
    /// The labels placeholder.
    pub labels: &'a str,
    /// The batch ops of `graph`, placeholders aside.
    pub batch: &'a HashSet<&'a str>,
    /// The loss and metrics to evaluate.
    pub spec: &'a TrainSpec,
    /// Rows of a whole held-out batch (the global batch size): the padded size of what crosses.
    pub rows: usize,
}

/// The evaluation nodes to add to the replica's graph and the names the executor feeds and
/// fetches: on the stages when every crossing tensor has a static size at the global batch,
/// else joined on the first stage's worker (see the module docs).
pub(super) fn evaluation(
    input: &EvalInput<'_>,
) -> Result<(Vec<NodeDef>, EvalNames), StrategyError> {
    match staged(input)? {
        Some(done) => Ok(done),
        None => joined(input),
    }
}

/// `eval/<name>`.
pub(super) fn eval_name(name: &str) -> String {
    format!("eval/{name}")
}

/// `loss` or `loss:1` of the evaluation copy.
pub(super) fn eval_tensor(name: &str) -> String {
    match InputRef::parse(name) {
        Ok(InputRef::Data { node, index }) => InputRef::Data {
            node: eval_name(&node),
            index,
        }
        .to_string(),
        _ => eval_name(name),
    }
}

fn node(name: String, op: &str, inputs: Vec<String>, device: &str) -> NodeDef {
    NodeDef {
        name,
        op: op.into(),
        inputs,
        device: device.to_string(),
        colocate_with: vec![],
        attrs: BTreeMap::new(),
    }
}

fn constant(name: String, value: Tensor, device: &str) -> NodeDef {
    let mut c = node(name, "Const", vec![], device);
    c.attrs
        .insert("value".into(), AttrValue::Tensor(Arc::new(value)));
    c
}

/// The evaluation placeholder of feed `n`, on `device`.
fn placeholder(n: &NodeDef, device: &str) -> NodeDef {
    let mut p = n.clone();
    p.name = eval_name(&n.name);
    p.device = device.to_string();
    p.colocate_with.clear();
    p
}

/// Where a copy reads output `index` of batch op (or placeholder) `node`: `Some(tensor)`, or
/// `None` for its own evaluation copy.
type MapInput<'a> = dyn FnMut(&str, usize) -> Result<Option<String>, StrategyError> + 'a;

/// The name of `name`'s evaluation copy under `prefix` (`eval`, `eval/tp1`): the placeholders'
/// are `eval/<name>` whatever the prefix (one batch, fed once).
fn copy_name(prefix: &str, feeds: &[&str], name: &str) -> String {
    if feeds.contains(&name) {
        eval_name(name)
    } else {
        format!("{prefix}/{name}")
    }
}

/// The copy `<prefix>/<op>` of batch op `n`, its data inputs mapped by `map` (`None`: the
/// input's own copy).
fn copy_of(
    n: &NodeDef,
    device: &str,
    prefix: &str,
    batch: &HashSet<&str>,
    feeds: &[&str],
    map: &mut MapInput<'_>,
) -> Result<NodeDef, StrategyError> {
    let mut e = n.clone();
    e.name = copy_name(prefix, feeds, &n.name);
    e.device = device.to_string();
    let mut inputs = Vec::with_capacity(n.inputs.len());
    for i in &n.inputs {
        let r = InputRef::parse(i).map_err(|message| PipelineError::Input {
            node: n.name.clone(),
            message,
        })?;
        inputs.push(match r {
            InputRef::Data { node, index }
                if feeds.contains(&node.as_str()) || batch.contains(node.as_str()) =>
            {
                match map(&node, index)? {
                    Some(to) => to,
                    None => InputRef::Data {
                        node: copy_name(prefix, feeds, &node),
                        index,
                    }
                    .to_string(),
                }
            }
            InputRef::Control(node) if batch.contains(node.as_str()) => {
                format!("^{}", copy_name(prefix, feeds, &node))
            }
            _ => i.clone(),
        });
    }
    e.inputs = inputs;
    e.colocate_with = n
        .colocate_with
        .iter()
        .filter(|w| batch.contains(w.as_str()))
        .map(|w| copy_name(prefix, feeds, w))
        .collect();
    Ok(e)
}

/// The evaluation on the first stage's worker, reading every stage's weights (the older
/// evaluation; see the module docs).
pub(super) fn joined(input: &EvalInput<'_>) -> Result<(Vec<NodeDef>, EvalNames), StrategyError> {
    let chief = input.devices[0].as_str();
    let feeds = [input.features, input.labels];
    let mut nodes = Vec::new();
    for n in input.graph.to_def().nodes {
        if feeds.contains(&n.name.as_str()) {
            nodes.push(placeholder(&n, chief));
        } else if input.batch.contains(n.name.as_str()) {
            nodes.push(copy_of(
                &n,
                chief,
                "eval",
                input.batch,
                &feeds,
                &mut |_, _| Ok(None),
            )?);
        }
    }
    let names = EvalNames {
        features: eval_name(input.features),
        labels: eval_name(input.labels),
        loss: eval_tensor(&input.spec.loss),
        metrics: input.spec.metrics.iter().map(|m| eval_tensor(m)).collect(),
    };
    Ok((nodes, names))
}

/// `def` with the features' and labels' batch dimension set to `rows` where it is unknown.
fn at_rows(def: &GraphDef, feeds: &[&str], rows: usize) -> GraphDef {
    let mut def = def.clone();
    for n in def
        .nodes
        .iter_mut()
        .filter(|n| feeds.contains(&n.name.as_str()))
    {
        if let Some(AttrValue::Shape(s)) = n.attrs.get_mut("shape") {
            if let Some(dims) = s.dims() {
                let mut dims = dims.to_vec();
                if let Some(first @ None) = dims.first_mut() {
                    *first = Some(rows);
                }
                *s = Shape::partial(dims);
            }
        }
    }
    def
}

/// How a tensor crosses from one stage to another.
enum Crossing {
    /// Its shape is static: as it is.
    AsIs,
    /// Its first dimension follows the batch: padded to this static shape.
    Padded(Vec<usize>),
}

/// One forward graph cut into stages (a plain pipeline's, or one tensor-parallel rank's) whose
/// evaluation copy [`stage_copy`] makes.
pub(crate) struct StageCopy<'a> {
    /// The forward graph.
    pub graph: &'a Graph,
    /// The stage of every op of `graph`.
    pub stages: &'a StageMap,
    /// Stages, micro-batches, chunks.
    pub shape: PipelineShape,
    /// The device of each of this copy's pipeline stages.
    pub devices: &'a [String],
    /// The chief's device, where the placeholders are fed.
    pub chief: &'a str,
    /// The copies' name prefix: `eval`, or `eval/tp{t}` for tensor-parallel rank `t > 0`.
    pub prefix: &'a str,
    /// The features placeholder.
    pub features: &'a str,
    /// The labels placeholder.
    pub labels: &'a str,
    /// Whether to add the placeholders `eval/<features>` and `eval/<labels>` (once per job).
    pub placeholders: bool,
    /// Whether the placeholders take exactly `rows` rows (a text's held-out batches are whole):
    /// then every tensor has a static shape and crosses as it is, and every collective's size
    /// is known to the planner. Otherwise they take the batch as written and what follows the
    /// batch crosses padded.
    pub static_batch: bool,
    /// Whether to copy the ops that do not read the batch too (constants, ops on weights):
    /// for a tensor-parallel rank `t > 0`, whose graph shares their names with rank 0's but
    /// not always their inputs (its shards).
    pub copy_shared: bool,
    /// Rows of a whole held-out batch (the global batch size).
    pub rows: usize,
}

/// What [`stage_copy`] made.
pub(crate) struct Copied {
    /// The nodes to add: the copies, the crossings, the placeholders if asked.
    pub nodes: Vec<NodeDef>,
    /// The copy of each batch op, by its forward name.
    pub names: HashMap<String, String>,
    /// The pipeline device (index into [`StageCopy::devices`]) of each copy, by the copy's name.
    pub device: HashMap<String, usize>,
}

/// The evaluation copy of `c.graph` on its stages (see the module docs): every batch op's copy
/// on its stage's device, reading the weights there, and every tensor one device makes and
/// another reads sent across (padded where its first dimension follows the batch). `None`
/// when a crossing tensor has no static size at the global batch.
pub(crate) fn stage_copy(c: &StageCopy<'_>) -> Result<Option<Copied>, StrategyError> {
    let g = c.graph;
    let feeds = [c.features, c.labels];
    // The ops copied: the batch ops, and with `copy_shared` every other op but the
    // variables.
    let batch: HashSet<&str> = g
        .node_indices()
        .filter(|i| {
            let n = g.node(*i);
            c.stages.batch_op[i.index()]
                || (c.copy_shared && !n.op_def().is_variable && n.op != "Placeholder")
        })
        .map(|i| g.node(i).name.as_str())
        .filter(|n| !feeds.contains(n))
        .collect();
    let scope = match c.prefix.strip_prefix("eval/") {
        Some(rank) => format!("{SCOPE}/{rank}"),
        None => SCOPE.to_string(),
    };
    let forward = g.to_def();
    let Ok(at_b) = Graph::from_def(&at_rows(&forward, &feeds, c.rows)) else {
        return Ok(None);
    };
    // The pipeline device of a node (`None`: the chief, for the placeholders).
    let device_index = |name: &str| -> Result<Option<usize>, StrategyError> {
        if feeds.contains(&name) {
            return Ok(None);
        }
        let i = g
            .find(name)
            .ok_or_else(|| PipelineError::Internal(name.to_string()))?;
        Ok(Some(c.shape.device_of(c.stages.stage[i.index()])))
    };
    let device_name = |d: Option<usize>| d.map_or(c.chief, |d| c.devices[d].as_str());
    let crossing = |name: &str, index: usize| -> Option<Crossing> {
        let ty = |g: &Graph| -> Option<Shape> {
            let i: NodeIndex = g.find(name)?;
            Some(g.output_type(i, index)?.shape.clone())
        };
        let (shape, padded) = (ty(if c.static_batch { &at_b } else { g })?, ty(&at_b)?);
        if shape.as_static().is_some() {
            return Some(Crossing::AsIs);
        }
        let dims = shape.dims()?;
        let padded = padded.as_static()?;
        (dims.len() == padded.len() && !dims.is_empty() && dims[1..].iter().all(Option::is_some))
            .then_some(Crossing::Padded(padded))
    };
    let mut copied = Copied {
        nodes: Vec::new(),
        names: HashMap::new(),
        device: HashMap::new(),
    };
    // Sender-side nodes made per tensor, receiver-side ones per (tensor, reading device).
    let mut sent: HashMap<String, (String, String)> = HashMap::new();
    let mut arrived: HashMap<(String, usize), String> = HashMap::new();
    let mut unsendable = false;
    for n in &forward.nodes {
        if feeds.contains(&n.name.as_str()) {
            if c.placeholders {
                let mut p = placeholder(n, c.chief);
                if c.static_batch {
                    match at_b.find(&n.name).and_then(|i| at_b.output_type(i, 0)) {
                        Some(t) if t.shape.as_static().is_some() => {
                            p.attrs
                                .insert("shape".into(), AttrValue::Shape(t.shape.clone()));
                        }
                        _ => return Ok(None),
                    }
                }
                copied.nodes.push(p);
            }
            continue;
        }
        if !batch.contains(n.name.as_str()) {
            continue;
        }
        let here = device_index(&n.name)?.ok_or_else(|| PipelineError::Internal(n.name.clone()))?;
        let mut extra: Vec<NodeDef> = Vec::new();
        let mut route = |from: &str, index: usize| -> Result<Option<String>, StrategyError> {
            let there = device_index(from)?;
            if device_name(there) == c.devices[here] {
                return Ok(None);
            }
            let tensor = InputRef::Data {
                node: copy_name(c.prefix, &feeds, from),
                index,
            }
            .to_string();
            let padded = match crossing(from, index) {
                Some(Crossing::AsIs) => return Ok(None),
                Some(Crossing::Padded(dims)) => dims,
                None => {
                    unsendable = true;
                    return Ok(None);
                }
            };
            if let Some(name) = arrived.get(&(tensor.clone(), here)) {
                return Ok(Some(name.clone()));
            }
            let base = format!("{scope}/cross/{}", tensor.replace(':', "_"));
            let (rows, padded_name) = match sent.get(&tensor) {
                Some(s) => s.clone(),
                None => {
                    let dev = device_name(there);
                    let shape = format!("{base}/shape");
                    let mut s = node(shape.clone(), "Shape", vec![tensor.clone()], dev);
                    s.attrs
                        .insert("out_type".into(), AttrValue::DType(DType::I32));
                    extra.push(s);
                    let first = format!("{base}/first");
                    extra.push(constant(first.clone(), Tensor::scalar(0i32), dev));
                    let rows = format!("{base}/rows");
                    extra.push(node(rows.clone(), "Gather", vec![shape, first], dev));
                    let r = padded[0];
                    let slots: Vec<i32> = (0..r)
                        .map(|k| {
                            i32::try_from(k).map_err(|_| PipelineError::Internal(base.clone()))
                        })
                        .collect::<Result<_, _>>()?;
                    let slots_name = format!("{base}/slots");
                    extra.push(constant(
                        slots_name.clone(),
                        Tensor::from_slice(&[r], &slots)
                            .map_err(|e| PipelineError::Internal(format!("{base}: {e}")))?,
                        dev,
                    ));
                    let index = format!("{base}/index");
                    extra.push(node(
                        index.clone(),
                        "FloorMod",
                        vec![slots_name, rows.clone()],
                        dev,
                    ));
                    let padded_name = format!("{base}/padded");
                    extra.push(node(
                        padded_name.clone(),
                        "Gather",
                        vec![tensor.clone(), index],
                        dev,
                    ));
                    sent.insert(tensor.clone(), (rows.clone(), padded_name.clone()));
                    (rows, padded_name)
                }
            };
            let dev = c.devices[here].as_str();
            let at = format!("{base}/at_stage{here}");
            let (zero, one, keep) = (
                format!("{at}/zero"),
                format!("{at}/one"),
                format!("{at}/keep"),
            );
            extra.push(constant(zero.clone(), Tensor::scalar(0i32), dev));
            extra.push(constant(one.clone(), Tensor::scalar(1i32), dev));
            extra.push(node(keep.clone(), "Range", vec![zero, rows, one], dev));
            extra.push(node(at.clone(), "Gather", vec![padded_name, keep], dev));
            arrived.insert((tensor, here), at.clone());
            Ok(Some(at))
        };
        let copy = copy_of(n, &c.devices[here], c.prefix, &batch, &feeds, &mut route)?;
        copied.names.insert(n.name.clone(), copy.name.clone());
        copied.device.insert(copy.name.clone(), here);
        copied.nodes.push(copy);
        copied.nodes.extend(extra);
    }
    Ok((!unsendable).then_some(copied))
}

/// The plain pipeline's evaluation on its stages (see the module docs); `None` when a crossing
/// tensor has no static size at the global batch.
fn staged(input: &EvalInput<'_>) -> Result<Option<(Vec<NodeDef>, EvalNames)>, StrategyError> {
    let chief = input.devices[0].as_str();
    let Some(copied) = stage_copy(&StageCopy {
        graph: input.graph,
        stages: input.stages,
        shape: input.shape,
        devices: input.devices,
        chief,
        prefix: "eval",
        features: input.features,
        labels: input.labels,
        placeholders: true,
        copy_shared: false,
        static_batch: false,
        rows: input.rows,
    })?
    else {
        return Ok(None);
    };
    // The loss and metrics, on the last stage, go to the chief, where the executor fetches
    // them: they need static shapes (scalars, as a rule) to cross.
    let g = input.graph;
    let fetched_static = std::iter::once(&input.spec.loss)
        .chain(&input.spec.metrics)
        .all(|f| match InputRef::parse(f) {
            Ok(InputRef::Data { node, index }) => g
                .find(&node)
                .and_then(|i| g.output_type(i, index))
                .is_some_and(|t| t.shape.as_static().is_some()),
            _ => false,
        });
    if !fetched_static {
        return Ok(None);
    }
    let mut nodes = copied.nodes;
    let mut fetch = |what: &str, name: &str| -> String {
        let copy = eval_tensor(name);
        let Ok(InputRef::Data { node: n, .. }) = InputRef::parse(&copy) else {
            return copy;
        };
        match copied.device.get(&n) {
            Some(&d) if input.devices[d] != chief => {
                let to = format!("{SCOPE}/fetch/{what}");
                nodes.push(node(to.clone(), "Identity", vec![copy], chief));
                to
            }
            _ => copy,
        }
    };
    let loss = fetch("loss", &input.spec.loss);
    let metrics = (input.spec.metrics.iter().enumerate())
        .map(|(k, m)| fetch(&format!("metric{k}"), m))
        .collect();
    let names = EvalNames {
        features: eval_name(input.features),
        labels: eval_name(input.labels),
        loss,
        metrics,
    };
    Ok(Some((nodes, names)))
}

/// One tensor-parallel rank of replica 0 of a `dp × tp × pp` job, for
/// [`add_sharded_stage_eval`].
pub(crate) struct RankStages<'a> {
    /// The rank's forward graph (its shards in place of the sharded weights).
    pub graph: &'a Graph,
    /// Its cut into stages.
    pub stages: &'a StageMap,
    /// The device of each of the rank's pipeline stages.
    pub devices: Vec<String>,
    /// The tensor-parallel collective group of each of those devices.
    pub groups: Vec<String>,
    /// The rank's own variables (its shards), added to the evaluation where they live.
    pub own: HashSet<String>,
    /// Where the rank's training graph put each variable.
    pub variable_device: &'a HashMap<String, String>,
    /// The tensor each of the rank's variables is read from instead, where it is not read as
    /// it is: under ZeRO-3 (flat shards over the stage's data-parallel group) its flat shards
    /// joined on the rank's stage worker of replica 0 (or rank 0's join of a replicated
    /// weight); beside expert parallelism an expert variable's shards joined on its stage's
    /// worker (`expert::eval`). Empty otherwise.
    pub weights: HashMap<String, String>,
    /// The nodes that make `weights` (the other replicas' flat shards and their joins).
    pub weight_nodes: Vec<NodeDef>,
    /// Whether to copy the ops that do not read the batch too (constants, ops on weights),
    /// [`StageCopy::copy_shared`]: for a rank `t > 0`, and wherever the training graph's ops
    /// of those names do not compute what the evaluation reads (under ZeRO-3, or a graph
    /// other than the training graph's).
    pub copy_shared: bool,
}

/// Points `g0`'s evaluation (the graph of rank 0 of replica 0) at one forward pass of the
/// held-out batch through the stages of every tensor-parallel rank of replica 0: rank `t`'s
/// copy (`eval/...` for rank 0, `eval/tp{t}/...`) [`stage_copy`]'s, each op on the rank's
/// stage device reading the rank's shards there, its collectives in the stage's
/// tensor-parallel group at instance keys from `instance_base` (beyond every training key),
/// chained per device in the rank's forward order (the same on every rank). Worker 0 is fed
/// the batch through placeholders of the global batch size (static, as
/// `tensor::eval`'s: every collective's size is known) and sends it to the other ranks' first
/// stages (and the labels to every rank's last stage); the replicated weights (layer norms, biases, a few KB) of ranks `t > 0` are read
/// from rank 0's copies on the same stage; a variable in a rank's `weights` is read from the
/// tensor named there (its joined shards, made by `weight_nodes`). Rank 0's loss goes to
/// worker 0, after every other
/// rank's (control edges), so the step runs every rank's collectives. Returns `false`,
/// changing nothing, when a crossing tensor has no static size at the global batch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_sharded_stage_eval(
    g0: &mut crate::strategy::ReplicaGraph,
    ranks: &[RankStages<'_>],
    shape: PipelineShape,
    spec: &TrainSpec,
    features: &str,
    labels: &str,
    rows: usize,
    instance_base: i64,
) -> Result<bool, StrategyError> {
    let Some(chief) = ranks.first().and_then(|r| r.devices.first()).cloned() else {
        return Ok(false);
    };
    let mut added: Vec<NodeDef> = Vec::new();
    let mut losses: Vec<String> = Vec::new();
    let mut rank0: HashMap<String, String> = HashMap::new();
    let fetched: Vec<&str> = std::iter::once(spec.loss.as_str())
        .chain(spec.metrics.iter().map(String::as_str))
        .collect();
    for (t, rank) in ranks.iter().enumerate() {
        let prefix = if t == 0 {
            "eval".to_string()
        } else {
            format!("eval/tp{t}")
        };
        let Some(mut copied) = stage_copy(&StageCopy {
            graph: rank.graph,
            stages: rank.stages,
            shape,
            devices: &rank.devices,
            chief: &chief,
            prefix: &prefix,
            features,
            labels,
            placeholders: t == 0,
            copy_shared: rank.copy_shared,
            static_batch: true,
            rows,
        })?
        else {
            return Ok(false);
        };
        // Under ZeRO-3, the copies read the joined flat shards in place of the variables.
        if !rank.weights.is_empty() {
            for n in &mut copied.nodes {
                for i in &mut n.inputs {
                    if let Ok(InputRef::Data { node, index: 0 }) = InputRef::parse(i) {
                        if let Some(w) = rank.weights.get(&node) {
                            *i = w.clone();
                        }
                    }
                }
            }
        }
        // The rank's collectives: into its stage's group, at keys of the evaluation's own.
        for n in copied
            .nodes
            .iter_mut()
            .filter(|n| n.op.starts_with("Collective"))
        {
            let d = *copied
                .device
                .get(&n.name)
                .ok_or_else(|| PipelineError::Internal(n.name.clone()))?;
            let group = rank
                .groups
                .get(d)
                .ok_or_else(|| PipelineError::Internal(n.name.clone()))?;
            n.attrs
                .insert("group_key".into(), AttrValue::String(group.as_str().into()));
            match n.attrs.get_mut("instance_key") {
                Some(AttrValue::Int(k)) => *k += instance_base,
                _ => {
                    return Err(
                        PipelineError::Internal(format!("{} has no instance_key", n.name)).into(),
                    )
                }
            }
        }
        // ... chained per device in the rank's forward order.
        let mut last: HashMap<usize, String> = HashMap::new();
        let mut waits: Vec<(String, String)> = Vec::new();
        for i in rank.graph.topo_order() {
            let n = rank.graph.node(i);
            if !n.op.starts_with("Collective") || n.op == "CollectiveTpCopy" {
                continue;
            }
            let Some(copy) = copied.names.get(&n.name) else {
                continue;
            };
            let d = copied.device[copy];
            if let Some(before) = last.insert(d, copy.clone()) {
                waits.push((copy.clone(), before));
            }
        }
        for (after, before) in waits {
            if let Some(n) = copied.nodes.iter_mut().find(|n| n.name == after) {
                n.inputs.push(format!("^{before}"));
            }
        }
        // Rank 0's loss and metrics are fetched; every other rank's loss is waited for.
        for f in &fetched {
            let Ok(InputRef::Data { node: n, index }) = InputRef::parse(f) else {
                return Ok(false);
            };
            let Some(copy) = copied.names.get(&n) else {
                return Ok(false);
            };
            if t == 0 {
                rank0.insert(f.to_string(), format!("{copy}:{index}"));
            } else if *f == spec.loss {
                losses.push(format!("^{copy}"));
            }
        }
        // Rank t's own shards, where its training graph holds them.
        if t > 0 {
            let def = rank.graph.to_def();
            for i in rank.graph.node_indices() {
                let n = rank.graph.node(i);
                if n.op != "Variable"
                    || !rank.own.contains(&n.name)
                    || rank.weights.contains_key(&n.name)
                {
                    continue;
                }
                let device = rank.variable_device.get(&n.name).ok_or_else(|| {
                    PipelineError::Internal(format!("no device for `{}`", n.name))
                })?;
                let mut v = def
                    .nodes
                    .iter()
                    .find(|x| x.name == n.name)
                    .cloned()
                    .ok_or_else(|| PipelineError::Internal(n.name.clone()))?;
                v.device = device.clone();
                v.colocate_with.clear();
                added.push(v);
            }
        }
        added.extend(rank.weight_nodes.iter().cloned());
        added.extend(copied.nodes);
    }
    let mut fetch = |what: &str, name: &str, waits: Vec<String>| -> Result<String, StrategyError> {
        let tensor = rank0
            .get(name)
            .cloned()
            .ok_or_else(|| PipelineError::Internal(name.to_string()))?;
        let to = format!("{SCOPE}/fetch/{what}");
        let mut inputs = vec![tensor];
        inputs.extend(waits);
        added.push(node(to.clone(), "Identity", inputs, &chief));
        Ok(to)
    };
    let loss = fetch("loss", &spec.loss, losses)?;
    let mut metrics = Vec::with_capacity(spec.metrics.len());
    for (k, m) in spec.metrics.iter().enumerate() {
        metrics.push(fetch(&format!("metric{k}"), m, Vec::new())?);
    }
    let taken: HashSet<&str> = g0
        .training
        .def
        .nodes
        .iter()
        .map(|n| n.name.as_str())
        .collect();
    if let Some(clash) = added.iter().find(|n| taken.contains(n.name.as_str())) {
        return Err(StrategyError::NameTaken {
            node: clash.name.clone(),
            name: clash.name.clone(),
        });
    }
    // No task blocks in a collective before sending what its peers need for theirs.
    crate::strategy::tensor::eval::sends_before_collectives(&mut added, &g0.training.def.nodes);
    g0.training.def.nodes.extend(added);
    g0.graph = Graph::from_def(&g0.training.def).map_err(StrategyError::InvalidGraph)?;
    g0.eval = EvalNames {
        features: eval_name(features),
        labels: eval_name(labels),
        loss,
        metrics,
    };
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::super::schedule::ScheduleKind;
    use super::super::Pipeline;
    use crate::job::{task_name, JobPlan};
    use crate::strategy::{JobInput, Strategy};
    use dflow_graph::layers::{gpt, GptConfig};
    use dflow_graph::{AttrValue, ClusterSpec, Graph, Shape};
    use std::collections::BTreeSet;

    /// A small GPT (4-token windows, 8 channels) whose placeholders take any batch.
    fn model(tie_weights: bool) -> (Graph, dflow_graph::train::TrainSpec) {
        let cfg = GptConfig {
            vocab_size: 11,
            block_size: 4,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            tie_weights,
            ..GptConfig::default()
        };
        let mut m = gpt(&cfg).unwrap();
        let spec = m.def.train.clone().unwrap();
        for n in &mut m.def.nodes {
            if n.op == "Placeholder" {
                n.attrs.insert(
                    "shape".into(),
                    AttrValue::Shape(Shape::partial(vec![None, Some(4)])),
                );
            }
        }
        (Graph::from_def(&m.def).unwrap(), spec)
    }

    /// The plan of `model(tie_weights)` on `workers` workers, 2 balanced stages, a global
    /// batch of 4 in 2 micro-batches.
    fn plan(tie_weights: bool, workers: u32) -> (Graph, JobPlan) {
        let (graph, spec) = model(tie_weights);
        let cluster = ClusterSpec::local(&[("worker", workers)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let plan = Pipeline {
            stages: Some(2),
            micro_batches: 2,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
            batch_size: Some(4),
        }
        .plan(&input)
        .unwrap();
        (graph, plan)
    }

    /// The evaluation signature's pairs between tasks: (tensor, bytes).
    fn crossing(plan: &JobPlan) -> Vec<(String, Option<usize>)> {
        plan.eval_signature()
            .unwrap()
            .partitions
            .pairs
            .iter()
            .filter(|p| !p.client_terminated && !p.is_control)
            .map(|p| (p.tensor_name.to_string(), p.bytes))
            .collect()
    }

    #[test]
    fn evaluation_runs_on_each_stage_and_sends_activations_only() {
        // dp2×pp2: replica 0's stages are workers 0 and 2.
        let (graph, plan) = plan(false, 4);
        let eval = plan.eval_signature().unwrap();
        let tasks: Vec<String> = eval.tasks().unwrap().into_iter().collect();
        assert_eq!(tasks, [task_name("worker", 0), task_name("worker", 2)]);
        // The chief feeds the batch and fetches the loss.
        assert!(eval.feeds.iter().all(|f| f.task == task_name("worker", 0)));
        assert_eq!(eval.fetch_task.as_deref(), Some(&*task_name("worker", 0)));
        assert_eq!(eval.fetches, ["eval/pipeline/fetch/loss:0"]);
        // Each stage evaluates with its own weights: every variable the evaluation reads is
        // in the partition of the task that holds it, and none crosses.
        let variables: BTreeSet<&str> = graph
            .node_indices()
            .map(|i| graph.node(i))
            .filter(|n| n.op_def().is_variable)
            .map(|n| n.name.as_str())
            .collect();
        let cross = crossing(&plan);
        let weights: Vec<_> = cross
            .iter()
            .filter(|(t, _)| variables.contains(t.split(':').next().unwrap()))
            .collect();
        assert!(weights.is_empty(), "weights cross: {weights:?}");
        // What crosses is the evaluation's own: stage 0's residual stream (4 rows × 4 tokens
        // × 8 channels, padded to the global batch) and its rows, the labels (4 × 4 ids) and
        // their rows to the last stage, and the loss back to the chief.
        assert!(
            cross
                .iter()
                .all(|(t, _)| t.starts_with("eval/pipeline/cross/") || t == "eval/loss:0"),
            "{cross:?}"
        );
        let padded: Vec<_> = cross
            .iter()
            .filter(|(t, _)| t.ends_with("/padded:0"))
            .collect();
        assert!(!padded.is_empty(), "{cross:?}");
        assert!(
            padded
                .iter()
                .any(|(t, b)| t.contains("eval/targets") && *b == Some(4 * 4 * 8)),
            "{padded:?}"
        );
        assert!(
            padded
                .iter()
                .any(|(t, b)| !t.contains("eval/targets") && *b == Some(4 * 4 * 8 * 4)),
            "{padded:?}"
        );
        assert_eq!(
            cross.iter().filter(|(t, _)| t.ends_with("/rows:0")).count(),
            padded.len()
        );
        assert!(cross.contains(&("eval/loss:0".to_string(), Some(4))));
        // Every weight read by an evaluation op is on that op's device.
        for part in eval.partitions.partitions.values() {
            let def = part.graph.to_def();
            let here: BTreeSet<&str> = def.nodes.iter().map(|n| n.name.as_str()).collect();
            for n in def.nodes.iter().filter(|n| n.name.starts_with("eval/")) {
                for i in &n.inputs {
                    let src = i.trim_start_matches('^').split(':').next().unwrap();
                    if variables.contains(src) {
                        assert!(here.contains(src), "{} reads {src} from elsewhere", n.name);
                    }
                }
            }
        }
    }

    #[test]
    fn a_tied_embedding_is_the_only_weight_the_evaluation_sends_as_training_does() {
        // The head on the last stage reads the first stage's `wte`: it crosses once per
        // evaluation batch, as once per training step; nothing else.
        let (graph, plan) = plan(true, 2);
        let variables: BTreeSet<&str> = graph
            .node_indices()
            .map(|i| graph.node(i))
            .filter(|n| n.op_def().is_variable)
            .map(|n| n.name.as_str())
            .collect();
        let weights: Vec<String> = crossing(&plan)
            .into_iter()
            .map(|(t, _)| t)
            .filter(|t| variables.contains(t.split(':').next().unwrap()))
            .collect();
        assert_eq!(weights.len(), 1, "{weights:?}");
        let train: BTreeSet<String> = plan
            .train_signatures()
            .flat_map(|s| s.partitions.pairs.iter())
            .map(|p| p.tensor_name.to_string())
            .collect();
        assert!(train.contains(&weights[0]), "{weights:?}");
    }

    #[test]
    fn one_stage_per_worker_evaluates_in_the_one_process_graph_too() {
        // The single-replica graph (what `--local` runs in one process) has the same
        // evaluation: placeholders of any batch on the chief, copies on their stages.
        let (graph, spec) = model(false);
        let cluster = ClusterSpec::local(&[("worker", 2)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let pipeline = Pipeline {
            stages: Some(2),
            micro_batches: 2,
            schedule: ScheduleKind::GPipe,
            chunks: 1,
            batch_size: Some(4),
        };
        let (g, _) = pipeline.training_graph(&input).unwrap();
        let nodes = &g.training.def.nodes;
        let find = |name: &str| nodes.iter().find(|n| n.name == name).unwrap();
        let worker = super::super::worker_device;
        assert_eq!(find("eval/idx").device, worker(0));
        assert_eq!(find("eval/targets").device, worker(0));
        assert_eq!(
            find("eval/idx").attrs.get("shape"),
            Some(&AttrValue::Shape(Shape::partial(vec![None, Some(4)])))
        );
        let devices: BTreeSet<&str> = nodes
            .iter()
            .filter(|n| n.name.starts_with("eval/"))
            .map(|n| n.device.as_str())
            .collect();
        assert_eq!(devices.len(), 2, "{devices:?}");
        assert_eq!(g.eval.loss, "eval/pipeline/fetch/loss");
        assert_eq!(find("eval/pipeline/fetch/loss").device, worker(0));
    }

    #[test]
    fn under_dp2_tp2_pp2_each_rank_of_replica_0_evaluates_its_stages_on_its_shards() {
        // Megatron-core's order at d = t = p = 2: replica 0 is workers 0, 1 (stage 0) and 4, 5
        // (stage 1).
        let (graph, spec) = model(false);
        let cluster = ClusterSpec::local(&[("worker", 8)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let tensor = |zero_stage| crate::strategy::tensor::TensorParallel {
            tp: Some(2),
            bucket_bytes: 1 << 20,
            batch_size: Some(8),
            pipeline: Some(Pipeline {
                stages: Some(2),
                micro_batches: 2,
                schedule: ScheduleKind::OneFOneB,
                chunks: 1,
                batch_size: Some(8),
            }),
            zero_stage,
        };
        for zero_stage in [None, Some(1)] {
            let plan = tensor(zero_stage).plan(&input).unwrap();
            let eval = plan.eval_signature().unwrap();
            let tasks: Vec<String> = eval.tasks().unwrap().into_iter().collect();
            let w = |i: u32| task_name("worker", i);
            assert_eq!(tasks, [w(0), w(1), w(4), w(5)], "{zero_stage:?}");
            assert!(eval.feeds.iter().all(|f| f.task == w(0)));
            assert_eq!(eval.fetch_task.as_deref(), Some(&*w(0)));
            // No tensor-parallel shard crosses; what crosses is the evaluation's own (the
            // batch, the residual stream, the loss) and a few replicated weights that rank 1
            // reads from rank 0's copies (layer norms, biases).
            let cross = crossing(&plan);
            assert!(cross.iter().all(|(t, _)| !t.contains("/tp_")), "{cross:?}");
            let variables: BTreeSet<&str> = graph
                .node_indices()
                .map(|i| graph.node(i))
                .filter(|n| n.op_def().is_variable)
                .map(|n| n.name.as_str())
                .collect();
            let weights: Vec<&str> = cross
                .iter()
                .map(|(t, _)| t.split(':').next().unwrap())
                .filter(|n| variables.contains(n))
                .collect();
            assert!(!weights.is_empty());
            assert!(
                weights.iter().all(|w| w.contains(".ln_")
                    || w.ends_with(".bias")
                    || *w == "transformer.wpe.weight"),
                "{weights:?}"
            );
            // The activations between stages: each rank's residual stream, 8 rows (the
            // placeholders take whole batches, so nothing is padded).
            assert!(
                cross.iter().all(|(t, _)| !t.ends_with("/padded:0")),
                "{cross:?}"
            );
            let activations: Vec<_> = cross
                .iter()
                .filter(|(t, _)| t.contains("mlp_residual"))
                .collect();
            assert_eq!(activations.len(), 2, "{cross:?}");
            assert!(activations.iter().all(|(_, b)| *b == Some(8 * 4 * 8 * 4)));
            // Every rank's collectives of the evaluation are in its stage's group, at keys
            // beyond the training step's, and the ranks of a stage call the same ones.
            let train_max = plan
                .train_signatures()
                .flat_map(|s| s.partitions.partitions.values())
                .flat_map(|p| p.graph.to_def().nodes)
                .filter_map(|n| match n.attrs.get("instance_key") {
                    Some(AttrValue::Int(k)) => Some(*k),
                    _ => None,
                })
                .max()
                .unwrap();
            let keys = |task: u32| -> Vec<(String, i64)> {
                let (_, part) = eval
                    .partitions
                    .partitions
                    .iter()
                    .find(|(d, _)| d.task == Some(task))
                    .unwrap();
                let mut keys: Vec<(String, i64)> = part
                    .graph
                    .to_def()
                    .nodes
                    .iter()
                    .filter(|n| n.op.starts_with("Collective"))
                    .map(
                        |n| match (n.attrs.get("group_key"), n.attrs.get("instance_key")) {
                            (Some(AttrValue::String(g)), Some(AttrValue::Int(k))) => {
                                (g.to_string(), *k)
                            }
                            _ => panic!("{} has no keys", n.name),
                        },
                    )
                    .collect();
                keys.sort();
                keys
            };
            for (a, b, group) in [(0, 1, "tensor_s0_d0"), (4, 5, "tensor_s1_d0")] {
                assert!(!keys(a).is_empty());
                assert_eq!(keys(a), keys(b));
                assert!(keys(a).iter().all(|(g, k)| g == group && *k > train_max));
            }
        }
    }

    #[test]
    fn under_dp2_tp2_pp2_zero3_each_stage_joins_its_flat_shards_and_sends_activations_only() {
        // Replica 0 is workers 0, 1 (stage 0) and 4, 5 (stage 1); replica 1's flat shards of a
        // stage's weights are on workers 2, 3 (stage 0) and 6, 7 (stage 1).
        let (graph, spec) = model(false);
        let cluster = ClusterSpec::local(&[("worker", 8)]).unwrap();
        let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
        let pipeline = Pipeline {
            stages: Some(2),
            micro_batches: 2,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
            batch_size: Some(8),
        };
        let plan = crate::strategy::tensor::TensorParallel {
            tp: Some(2),
            bucket_bytes: 1 << 20,
            batch_size: Some(8),
            pipeline: Some(pipeline),
            zero_stage: Some(3),
        }
        .plan(&input)
        .unwrap();
        let eval = plan.eval_signature().unwrap();
        let w = |i: u32| task_name("worker", i);
        let tasks: Vec<String> = eval.tasks().unwrap().into_iter().collect();
        assert_eq!(
            tasks,
            [0, 1, 2, 3, 4, 5, 6, 7].map(w),
            "every flat shard is read"
        );
        assert!(eval.feeds.iter().all(|f| f.task == w(0)));
        assert_eq!(eval.fetch_task.as_deref(), Some(&*w(0)));
        // The ops of the evaluation run on replica 0's stage workers only.
        let mut evaluating = BTreeSet::new();
        for (d, part) in &eval.partitions.partitions {
            if part
                .graph
                .to_def()
                .nodes
                .iter()
                .any(|n| n.name.starts_with("eval/") && n.op != "Variable")
            {
                evaluating.insert(d.task.unwrap());
            }
        }
        assert_eq!(evaluating, BTreeSet::from([0, 1, 4, 5]));
        let variables: BTreeSet<String> = eval
            .partitions
            .partitions
            .values()
            .flat_map(|p| p.graph.to_def().nodes)
            .filter(|n| n.op == "Variable")
            .map(|n| n.name)
            .collect();
        let consts: BTreeSet<String> = eval
            .partitions
            .partitions
            .values()
            .flat_map(|p| p.graph.to_def().nodes)
            .filter(|n| n.op == "Const")
            .map(|n| n.name)
            .collect();
        let task = |d: &str| dflow_graph::DeviceName::parse(d).unwrap().task.unwrap();
        let stage = |t: u32| t / 4;
        let pairs: Vec<_> = eval
            .partitions
            .pairs
            .iter()
            .filter(|p| !p.client_terminated && !p.is_control)
            .collect();
        let mut within = 0;
        let mut between = Vec::new();
        for p in &pairs {
            let node = p.tensor_name.split(':').next().unwrap();
            let (from, to) = (task(&p.send_device), task(&p.recv_device));
            if stage(from) == stage(to) {
                within += usize::from(variables.contains(node));
            } else {
                between.push(p.tensor_name.to_string());
                // Between stages: the evaluation's own tensors (and the training graph's
                // constants it reads, the vocabulary's ids), never a weight or its join.
                assert!(!variables.contains(node), "{node} crosses stages");
                assert!(!node.starts_with("eval/zero3/"), "{node} crosses stages");
                assert!(
                    node.starts_with("eval/") || consts.contains(node),
                    "{node} crosses stages"
                );
            }
        }
        // Replica 1's flat shards go to replica 0's worker of their stage.
        assert!(within > 0);
        // Each rank's residual stream goes to its next stage (8 rows, whole batches).
        assert!(
            between
                .iter()
                .filter(|t| t.contains("mlp_residual"))
                .count()
                == 2,
            "{between:?}"
        );
        assert!(
            between.iter().all(|t| !t.ends_with("/padded:0")),
            "{between:?}"
        );
    }

    #[test]
    fn a_fetched_tensor_of_no_static_shape_keeps_the_evaluation_joined_on_worker_0() {
        // The digits MLP on 2 stages: its loss and accuracy are scalars, so the evaluation
        // runs on both stages; with the logits (`[?, 10]`, on the last stage) as a metric,
        // which cannot be sent to the chief at a static size, it stays on worker 0.
        let text = include_str!("../../../../examples/digits/digits.json");
        let def = dflow_graph::format::parse_json(text, None).unwrap().def;
        let graph = Graph::from_def(&def).unwrap();
        let cluster = ClusterSpec::local(&[("worker", 2)]).unwrap();
        let pipeline = Pipeline {
            stages: Some(2),
            micro_batches: 2,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
            batch_size: Some(32),
        };
        let mut spec = def.train.clone().unwrap();
        let tasks = |spec: &dflow_graph::train::TrainSpec| -> Vec<String> {
            let input = JobInput::new(&graph, spec, &cluster, "pixels", "labels");
            let plan = pipeline.plan(&input).unwrap();
            let eval = plan.eval_signature().unwrap();
            eval.tasks().unwrap().into_iter().collect()
        };
        let w = |i: u32| task_name("worker", i);
        assert_eq!(tasks(&spec), [w(0), w(1)]);
        spec.metrics.push("logits".into());
        assert_eq!(
            tasks(&spec),
            [w(0), w(1)],
            "worker 1 still sends its weights"
        );
        let input = JobInput::new(&graph, &spec, &cluster, "pixels", "labels");
        let plan = pipeline.plan(&input).unwrap();
        let eval = plan.eval_signature().unwrap();
        assert_eq!(
            eval.fetches,
            ["eval/loss:0", "eval/accuracy:0", "eval/logits:0"]
        );
        // Joined: every evaluation op on worker 0, the weights of stage 1 sent to it.
        let (_, part) = eval
            .partitions
            .partitions
            .iter()
            .find(|(d, _)| d.task == Some(1))
            .unwrap();
        assert!(part
            .graph
            .to_def()
            .nodes
            .iter()
            .all(|n| !n.name.starts_with("eval/")));
        assert!(crossing(&plan).iter().any(|(t, _)| t == "w2:0"));
    }
}
