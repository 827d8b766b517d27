//! The evaluation copy of a forward graph on its pipeline stages ([`stage_copy`]): every batch
//! op copied to its stage's device, and what crosses stages sent there, padded where its first
//! dimension follows the batch (see the docs of `pipeline::eval`).

use super::copy::{constant, copy_name, copy_of, node, placeholder};
use super::SCOPE;
use crate::strategy::pipeline::schedule::PipelineShape;
use crate::strategy::pipeline::stages::StageMap;
use crate::strategy::pipeline::PipelineError;
use crate::strategy::StrategyError;
use dflow_graph::{AttrValue, DType, Graph, GraphDef, InputRef, NodeDef, Shape, Tensor};
use petgraph::graph::NodeIndex;
use std::collections::{HashMap, HashSet};

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
