//! Embedding tables sharded over the parameter servers, looked up and updated row by row (the
//! ps strategy's half of TensorFlow's partitioned variables and `embedding_lookup`).
//!
//! A `Variable` `[vocab, d..]` with the attribute `partition_strategy` (`mod` or `div`;
//! `--partition-strategy` overrides it) is a sharded table. [`shard_embeddings`] rewrites the
//! forward graph before the ps strategy replicates it:
//!
//! - the table becomes `<table>/part_<s>` on `/job:ps/task:<s>` for each of the N ps tasks,
//!   the rows [`EmbeddingPartition`] gives shard `s`, each starting as exactly those rows of the
//!   whole table (`shard_of`, `shard_offset`, `shard_stride`);
//! - every `Gather(table, ids)` becomes the sharded lookup of
//!   [`dflow_graph::ops::sharded_lookup`]: on the worker, `EmbeddingShardRows` finds each
//!   shard's distinct rows (deduplicated) in a static buffer of `C_s` = min(ids per step, rows
//!   of shard s) i64 slots, padded with -1; shard `s` gathers those rows (`[C_s, d..]`) and the
//!   worker stitches them into the `Gather` result, under the `Gather`'s name. Only the row ids
//!   and the rows travel, never the table; the combiner after the lookup (`SparseSegmentSum`,
//!   `Mean`, `SqrtN`, or any op) is untouched.
//!
//! After the training step is added, [`sparse_updates`] replaces each shard's dense update by a
//! sparse one on the rows the step touched: `SparseApplyGradientDescent` for `sgd`,
//! `SparseApplyLazyAdam` for `adam` (lazy: untouched rows' moments do not decay), fed the
//! worker's `[C_s, d..]` row gradients (summed over duplicate ids on the worker) and the row ids
//! the shard already received for the lookup. So a worker pushes `C_s·d·4` gradient bytes and
//! `C_s·8` id bytes per shard and step, not the shard's `rows·d·4`. With several sync replicas
//! the replicas' (ids, rows) are concatenated and duplicates summed by the update. Other
//! optimizers, learning-rate schedules, clipping, or a table also read other than by `Gather`
//! keep the dense update of each shard (still on the ps: only the row gradients travel).

use super::{ReplicaGraph, StrategyError};
use crate::shards::{RowShard, RowShardedVariable};
use dflow_graph::embedding_partition::{EmbeddingPartition, PartitionStrategy};
use dflow_graph::train::TrainingGraph;
use dflow_graph::{AttrValue, DType, Graph, GraphDef, InputRef, NodeDef, Shape};
use std::collections::{BTreeMap, HashMap, HashSet};

/// A table the rewrite sharded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardedTable {
    /// The table's name in the forward graph (and in checkpoints of unsharded runs).
    pub name: String,
    /// Rows of the whole table.
    pub vocab: u64,
    /// How ids map to shards.
    pub strategy: PartitionStrategy,
    /// The shard variables, shard 0 first.
    pub parts: Vec<String>,
    /// The whole table's element type.
    pub dtype: DType,
    /// The whole table's dimensions, `[vocab, d..]`.
    pub dims: Vec<usize>,
}

/// The forward graph with its tables sharded.
#[derive(Clone, Debug)]
pub struct ShardedForward {
    /// The rewritten forward graph.
    pub def: GraphDef,
    /// The sharded tables (empty: the graph has none, `def` is the input).
    pub tables: Vec<ShardedTable>,
}

/// Shard `s`'s variable of `table`.
pub fn part_name(table: &str, shard: usize) -> String {
    format!("{table}/part_{shard}")
}

fn bad(node: &str, message: String) -> StrategyError {
    StrategyError::Options {
        strategy: "ps",
        message: format!("sharded embedding table `{node}`: {message}"),
    }
}

/// Shards every table of `forward` (a `Variable` with `partition_strategy` set) over `ps_tasks`
/// tasks, `strategy` overriding each table's own; `batch_size` bounds an unknown batch
/// dimension of the ids (a worker never gets more than the global batch). See the module docs.
pub fn shard_embeddings(
    forward: &GraphDef,
    ps_tasks: usize,
    strategy: Option<PartitionStrategy>,
    batch_size: Option<usize>,
) -> Result<ShardedForward, StrategyError> {
    let marked: Vec<&NodeDef> = forward
        .nodes
        .iter()
        .filter(|n| n.op == "Variable")
        .filter(|n| matches!(n.attrs.get("partition_strategy"), Some(AttrValue::String(s)) if !s.is_empty()))
        .collect();
    if marked.is_empty() {
        return Ok(ShardedForward {
            def: forward.clone(),
            tables: vec![],
        });
    }
    if ps_tasks == 0 {
        return Err(bad(
            &marked[0].name,
            "the cluster has no ps task to hold its shards".into(),
        ));
    }
    let graph = Graph::from_def(forward).map_err(StrategyError::InvalidGraph)?;
    let mut taken: HashSet<String> = forward.nodes.iter().map(|n| n.name.clone()).collect();
    let mut tables = Vec::new();
    // Table name -> its partition, for the lookups.
    let mut partitions: BTreeMap<String, (EmbeddingPartition, Vec<String>)> = BTreeMap::new();
    let mut replaced: HashMap<String, Vec<NodeDef>> = HashMap::new();
    for v in &marked {
        let own = match v.attrs.get("partition_strategy") {
            Some(AttrValue::String(s)) => s
                .parse::<PartitionStrategy>()
                .map_err(|e| bad(&v.name, e))?,
            _ => unreachable_strategy(&v.name)?,
        };
        let strategy = strategy.unwrap_or(own);
        let dims = match v.attrs.get("shape") {
            Some(AttrValue::Shape(s)) => s.as_static(),
            _ => None,
        }
        .filter(|d| d.len() >= 2)
        .ok_or_else(|| bad(&v.name, "it needs a static shape [rows, d..]".into()))?;
        let vocab = dims[0] as u64;
        let partition =
            EmbeddingPartition::new(vocab, ps_tasks, strategy).map_err(|e| bad(&v.name, e))?;
        let mut parts = Vec::with_capacity(ps_tasks);
        let mut nodes = Vec::with_capacity(ps_tasks);
        for s in 0..ps_tasks {
            let rows = partition.rows(s).map_err(|e| bad(&v.name, e))?;
            let name = part_name(&v.name, s);
            if !taken.insert(name.clone()) {
                return Err(StrategyError::NameTaken {
                    node: v.name.clone(),
                    name,
                });
            }
            let mut part = (*v).clone();
            part.name = name.clone();
            part.device = format!("/job:ps/task:{s}");
            part.colocate_with.clear();
            part.attrs.remove("partition_strategy");
            let mut shard_dims = dims.clone();
            shard_dims[0] = rows.count as usize;
            part.attrs
                .insert("shape".into(), AttrValue::Shape(Shape::known(&shard_dims)));
            part.attrs
                .insert("shard_of".into(), AttrValue::Shape(Shape::known(&dims)));
            part.attrs
                .insert("shard_offset".into(), AttrValue::Int(rows.start as i64));
            part.attrs.insert(
                "shard_stride".into(),
                AttrValue::Int(rows.step.max(1) as i64),
            );
            part.attrs.insert(
                "shard_name".into(),
                AttrValue::String(v.name.as_str().into()),
            );
            parts.push(name);
            nodes.push(part);
        }
        replaced.insert(v.name.clone(), nodes);
        partitions.insert(v.name.clone(), (partition, parts.clone()));
        let dtype = match v.attrs.get("dtype") {
            Some(AttrValue::DType(d)) => *d,
            _ => return Err(bad(&v.name, "it has no dtype".into())),
        };
        tables.push(ShardedTable {
            name: v.name.clone(),
            vocab,
            strategy,
            parts,
            dtype,
            dims: dims.clone(),
        });
    }

    let mut out = GraphDef {
        nodes: Vec::with_capacity(forward.nodes.len() + 4 * ps_tasks),
        ..forward.clone()
    };
    for n in &forward.nodes {
        if let Some(parts) = replaced.remove(&n.name) {
            out.nodes.extend(parts);
            continue;
        }
        if let Some(c) = n
            .colocate_with
            .iter()
            .find(|c| partitions.contains_key(c.as_str()))
        {
            return Err(bad(
                c,
                format!(
                    "node `{}` is colocated with it; a sharded table has no single device",
                    n.name
                ),
            ));
        }
        // The tables this node reads (data or control).
        let reads: Vec<String> = n
            .inputs
            .iter()
            .filter_map(|i| InputRef::parse(i).ok())
            .map(|r| r.node().to_string())
            .filter(|src| partitions.contains_key(src))
            .collect();
        let table_read = reads.first().map(String::as_str);
        let Some(table) = table_read else {
            out.nodes.push(n.clone());
            continue;
        };
        let is_lookup = n.op == "Gather"
            && reads.len() == 1
            && n.inputs.first().and_then(|i| InputRef::parse(i).ok())
                == Some(InputRef::Data {
                    node: table.to_string(),
                    index: 0,
                });
        if !is_lookup {
            return Err(bad(
                table,
                format!(
                    "node `{}` ({}) reads it; a sharded table can only be read by Gather(table, ids)",
                    n.name, n.op
                ),
            ));
        }
        let (partition, parts) = &partitions[table];
        let ids = n
            .inputs
            .get(1)
            .ok_or_else(|| bad(table, format!("Gather `{}` has no ids input", n.name)))?;
        let max_ids = max_ids(&graph, forward, ids, batch_size)
            .map_err(|m| bad(table, format!("Gather `{}`: {m}", n.name)))?;
        let mut stitch_inputs = vec![ids.clone()];
        for (s, part) in parts.iter().enumerate() {
            let rows = partition.rows(s).map_err(|e| bad(table, e))?;
            let capacity = max_ids.min(rows.count as usize);
            let rows_name = fresh(&mut taken, &format!("{}/shard_{s}/rows", n.name));
            let gather_name = fresh(&mut taken, &format!("{}/shard_{s}/gather", n.name));
            out.nodes.push(NodeDef {
                name: rows_name.clone(),
                op: "EmbeddingShardRows".into(),
                inputs: vec![ids.clone()],
                device: n.device.clone(),
                colocate_with: vec![],
                attrs: BTreeMap::from([
                    ("vocab".into(), AttrValue::Int(partition.vocab() as i64)),
                    ("num_shards".into(), AttrValue::Int(ps_tasks as i64)),
                    ("shard".into(), AttrValue::Int(s as i64)),
                    ("capacity".into(), AttrValue::Int(capacity as i64)),
                    (
                        "strategy".into(),
                        AttrValue::String(partition.strategy().to_string().as_str().into()),
                    ),
                ]),
            });
            out.nodes.push(NodeDef {
                name: gather_name.clone(),
                op: "EmbeddingShardGather".into(),
                inputs: vec![part.clone(), format!("{rows_name}:0")],
                device: format!("/job:ps/task:{s}"),
                colocate_with: vec![],
                attrs: BTreeMap::new(),
            });
            stitch_inputs.push(format!("{rows_name}:1"));
            stitch_inputs.push(gather_name);
        }
        stitch_inputs.extend(n.inputs.iter().skip(2).cloned());
        out.nodes.push(NodeDef {
            name: n.name.clone(),
            op: "EmbeddingShardStitch".into(),
            inputs: stitch_inputs,
            device: n.device.clone(),
            colocate_with: n.colocate_with.clone(),
            attrs: BTreeMap::new(),
        });
    }
    Graph::from_def(&out).map_err(StrategyError::InvalidGraph)?;
    Ok(ShardedForward { def: out, tables })
}

fn unreachable_strategy(node: &str) -> Result<PartitionStrategy, StrategyError> {
    Err(bad(node, "partition_strategy must be a string".into()))
}

/// `base`, or `base_1`, ... when taken.
fn fresh(taken: &mut HashSet<String>, base: &str) -> String {
    let mut name = base.to_string();
    let mut k = 1;
    while taken.contains(&name) {
        name = format!("{base}_{k}");
        k += 1;
    }
    taken.insert(name.clone());
    name
}

/// The most ids a step's `ids` tensor holds: its static element count, an unknown first
/// (batch) dimension bounded by `batch_size`; the ids of `Unique(x)` count as x's.
fn max_ids(
    graph: &Graph,
    forward: &GraphDef,
    ids: &str,
    batch_size: Option<usize>,
) -> Result<usize, String> {
    let r = InputRef::parse(ids)?;
    let InputRef::Data { node, index } = r else {
        return Err(format!("ids `{ids}` is a control input"));
    };
    let idx = graph
        .find(&node)
        .ok_or_else(|| format!("no node `{node}`"))?;
    let n = graph.node(idx);
    let shape = &n
        .outputs
        .get(index)
        .ok_or_else(|| format!("`{node}` has no output {index}"))?
        .shape;
    if let Some(k) = shape.num_elements() {
        return Ok(k);
    }
    if n.op == "Unique" && index == 0 {
        let src = forward
            .nodes
            .iter()
            .find(|d| d.name == node)
            .and_then(|d| d.inputs.first());
        if let Some(src) = src {
            return max_ids(graph, forward, src, batch_size);
        }
    }
    let dims = shape
        .dims()
        .ok_or_else(|| format!("ids `{ids}` have an unknown rank"))?;
    let rest: Option<usize> = dims.iter().skip(1).copied().product();
    match (dims.first(), rest, batch_size) {
        (Some(None), Some(rest), Some(b)) => Ok(rest.saturating_mul(b)),
        (Some(None), Some(_), None) => Err(format!(
            "ids `{ids}` have shape {shape}: give the batch size (--batch-size) or the placeholder a static batch dimension, so the row buffers can be sized"
        )),
        _ => Err(format!(
            "ids `{ids}` have shape {shape}; only the first (batch) dimension may be unknown"
        )),
    }
}

/// The tables of `tables` and their optimizer slots (`<part>/<slot>` variables of `training`)
/// as row-sharded logical tensors, so checkpoints hold them whole under the names a
/// one-process run gives them (`emb`, `emb/adam_m`).
pub fn row_sharded(tables: &[ShardedTable], training: &GraphDef) -> Vec<RowShardedVariable> {
    let mut out = Vec::new();
    for t in tables {
        let Ok(partition) = EmbeddingPartition::new(t.vocab, t.parts.len(), t.strategy) else {
            continue;
        };
        let Some(first) = t.parts.first() else {
            continue;
        };
        // "" for the table itself, then every slot of shard 0 (`emb/part_0/adam_m`).
        let mut suffixes = vec![String::new()];
        suffixes.extend(
            training
                .nodes
                .iter()
                .filter(|n| n.op == "Variable")
                .filter_map(|n| {
                    n.name
                        .strip_prefix(first.as_str())
                        .filter(|rest| rest.starts_with('/'))
                        .map(str::to_string)
                }),
        );
        for suffix in suffixes {
            let shards: Option<Vec<RowShard>> = t
                .parts
                .iter()
                .enumerate()
                .map(|(s, part)| {
                    let rows = partition.rows(s).ok()?;
                    Some(RowShard {
                        name: format!("{part}{suffix}"),
                        start: rows.start,
                        step: rows.step.max(1),
                        count: rows.count,
                    })
                })
                .collect();
            if let Some(shards) = shards {
                out.push(RowShardedVariable {
                    logical: format!("{}{suffix}", t.name),
                    dtype: t.dtype,
                    dims: t.dims.clone(),
                    shards,
                });
            }
        }
    }
    out
}

/// Replaces the dense update of each of `tables`' shards in `replica` by a sparse one (see the
/// module docs), where the update and gradient have the expected form; re-validates the graph.
/// Returns the shard variables whose update became sparse.
pub fn sparse_updates(
    replica: &mut ReplicaGraph,
    tables: &[ShardedTable],
) -> Result<Vec<String>, StrategyError> {
    let mut sparse = Vec::new();
    let training = &mut replica.training;
    let mut dense = HashSet::new();
    for part in tables.iter().flat_map(|t| &t.parts) {
        if let Some(values) = sparse_update(training, part, &mut dense) {
            if let Some(g) = training.gradients.iter_mut().find(|(v, _)| v == part) {
                g.1 = values;
            }
            sparse.push(part.clone());
        }
    }
    if !sparse.is_empty() {
        remove_unread(&mut training.def, &dense);
        replica.graph = Graph::from_def(&training.def).map_err(StrategyError::InvalidGraph)?;
    }
    Ok(sparse)
}

/// The node named `name` (a data reference's node) in `def`.
fn find<'a>(def: &'a GraphDef, reference: &str) -> Option<&'a NodeDef> {
    let node = match InputRef::parse(reference).ok()? {
        InputRef::Data { node, .. } => node,
        InputRef::Control(_) => return None,
    };
    def.nodes.iter().find(|n| n.name == node)
}

/// The (rows, row gradients) pairs whose scatters sum to `grad`, the gradient of `part`, with
/// the names of the scatter and sum nodes; `None` when `grad` is anything else.
fn row_gradients(
    def: &GraphDef,
    grad: &str,
    part: &str,
    nodes: &mut Vec<String>,
) -> Option<Vec<(String, String)>> {
    let n = find(def, grad)?;
    nodes.push(n.name.clone());
    match n.op.as_str() {
        "EmbeddingShardScatter" if n.inputs.get(2).map(String::as_str) == Some(part) => {
            Some(vec![(n.inputs[0].clone(), n.inputs[1].clone())])
        }
        "AddN" => {
            let mut all = Vec::new();
            for i in n.inputs.iter().filter(|i| !i.starts_with('^')) {
                all.extend(row_gradients(def, i, part, nodes)?);
            }
            Some(all)
        }
        _ => None,
    }
}

/// Rewrites `part`'s update to its sparse form; returns the values tensor it reads and adds the
/// dense gradient nodes it no longer reads to `dense`.
fn sparse_update(
    training: &mut TrainingGraph,
    part: &str,
    dense: &mut HashSet<String>,
) -> Option<String> {
    let grad = training
        .gradients
        .iter()
        .find(|(v, _)| v == part)?
        .1
        .clone();
    let def = &training.def;
    let mut nodes = Vec::new();
    let pairs = row_gradients(def, &grad, part, &mut nodes)?;
    let at = def.nodes.iter().position(|n| {
        n.inputs.first().map(String::as_str) == Some(part)
            && n.inputs.contains(&grad)
            && matches!(n.op.as_str(), "ApplyGradientDescent" | "ApplyAdam")
    })?;
    let update = &def.nodes[at];
    // A schedule or other attributes the sparse ops lack keep the dense update.
    let known: &[&str] = match update.op.as_str() {
        "ApplyGradientDescent" => &["lr"],
        _ => &["lr", "beta1", "beta2", "epsilon"],
    };
    if update.attrs.keys().any(|k| !known.contains(&k.as_str())) {
        return None;
    }
    let device = update.device.clone();
    let update_name = update.name.clone();
    let mut added = Vec::new();
    let (indices, values) = if pairs.len() == 1 {
        pairs[0].clone()
    } else {
        let concat = |suffix: &str, inputs: Vec<String>| NodeDef {
            name: format!("{update_name}/{suffix}"),
            op: "Concat".into(),
            inputs,
            device: device.clone(),
            colocate_with: vec![part.to_string()],
            attrs: BTreeMap::from([("axis".into(), AttrValue::Int(0))]),
        };
        let names: HashSet<&str> = def.nodes.iter().map(|n| n.name.as_str()).collect();
        for suffix in ["indices", "values"] {
            if names.contains(format!("{update_name}/{suffix}").as_str()) {
                return None;
            }
        }
        added.push(concat(
            "indices",
            pairs.iter().map(|p| p.0.clone()).collect(),
        ));
        added.push(concat(
            "values",
            pairs.iter().map(|p| p.1.clone()).collect(),
        ));
        (
            format!("{update_name}/indices"),
            format!("{update_name}/values"),
        )
    };
    let update = &mut training.def.nodes[at];
    let control: Vec<String> = update
        .inputs
        .iter()
        .filter(|i| i.starts_with('^'))
        .cloned()
        .collect();
    let data: Vec<String> = update
        .inputs
        .iter()
        .filter(|i| !i.starts_with('^'))
        .cloned()
        .collect();
    match update.op.as_str() {
        "ApplyGradientDescent" => {
            update.op = "SparseApplyGradientDescent".into();
            update.inputs = vec![data[0].clone(), indices, values.clone()];
        }
        _ => {
            // ApplyAdam(var, m, v, t, grad).
            update.op = "SparseApplyLazyAdam".into();
            update.inputs = data[..4].to_vec();
            update.inputs.extend([indices, values.clone()]);
        }
    }
    update.inputs.extend(control);
    update
        .attrs
        .insert("skip_padding".into(), AttrValue::Bool(true));
    training.def.nodes.extend(added);
    dense.extend(nodes);
    Some(values)
}

/// Drops the nodes in `candidates` that nothing reads any more (repeatedly: a sum read only by
/// a dropped node goes too).
fn remove_unread(def: &mut GraphDef, candidates: &HashSet<String>) {
    loop {
        let read: HashSet<String> = def
            .nodes
            .iter()
            .flat_map(|n| n.inputs.iter())
            .filter_map(|i| InputRef::parse(i).ok())
            .map(|r| r.node().to_string())
            .collect();
        let before = def.nodes.len();
        def.nodes
            .retain(|n| !candidates.contains(&n.name) || read.contains(&n.name));
        if def.nodes.len() == before {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::builder::GraphBuilder;
    use dflow_graph::DType;

    /// emb [10, 2] (marked `div`) looked up with ids [batch, 3].
    fn forward(extra_read: bool) -> GraphDef {
        let mut b = GraphBuilder::new();
        let emb = b.variable("emb", DType::F32, &[10, 2], "normal");
        let ids = b.placeholder("ids", DType::I64, &[-1, 3]);
        let rows = b.op("Gather", "lookup").input(&emb).input(&ids).finish();
        b.op("Mean", "loss").input(&rows).finish();
        if extra_read {
            b.unary("Identity", "peek", &emb);
        }
        let mut def = b.to_def();
        def.nodes[0]
            .attrs
            .insert("partition_strategy".into(), AttrValue::String("div".into()));
        def
    }

    fn node<'a>(def: &'a GraphDef, name: &str) -> &'a NodeDef {
        def.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    #[test]
    fn a_table_becomes_shards_and_its_gather_a_sharded_lookup() {
        let s =
            shard_embeddings(&forward(false), 3, Some(PartitionStrategy::Mod), Some(2)).unwrap();
        assert_eq!(
            s.tables,
            [ShardedTable {
                name: "emb".into(),
                vocab: 10,
                strategy: PartitionStrategy::Mod,
                parts: vec![
                    "emb/part_0".into(),
                    "emb/part_1".into(),
                    "emb/part_2".into()
                ],
                dtype: DType::F32,
                dims: vec![10, 2],
            }]
        );
        assert!(!s.def.nodes.iter().any(|n| n.name == "emb"));
        // mod over 3: shard 1 holds ids 1, 4, 7 (3 rows from row 1, stride 3).
        let p1 = node(&s.def, "emb/part_1");
        assert_eq!(p1.device, "/job:ps/task:1");
        assert_eq!(p1.attrs["shape"], AttrValue::Shape(Shape::known(&[3, 2])));
        assert_eq!(p1.attrs["shard_offset"], AttrValue::Int(1));
        assert_eq!(p1.attrs["shard_stride"], AttrValue::Int(3));
        assert!(!p1.attrs.contains_key("partition_strategy"));
        // Buffers: 2 examples × 3 ids = 6, capped by the shard's rows.
        let rows = node(&s.def, "lookup/shard_0/rows");
        assert_eq!(rows.op, "EmbeddingShardRows");
        assert_eq!(rows.attrs["capacity"], AttrValue::Int(4));
        assert_eq!(
            node(&s.def, "lookup/shard_2/gather").device,
            "/job:ps/task:2"
        );
        let stitch = node(&s.def, "lookup");
        assert_eq!(stitch.op, "EmbeddingShardStitch");
        assert_eq!(stitch.inputs.len(), 1 + 2 * 3);
        // The graph's own strategy when not overridden.
        let s = shard_embeddings(&forward(false), 2, None, Some(2)).unwrap();
        assert_eq!(s.tables[0].strategy, PartitionStrategy::Div);
        assert_eq!(
            node(&s.def, "emb/part_1").attrs["shard_offset"],
            AttrValue::Int(5)
        );
    }

    #[test]
    fn a_graph_without_tables_is_unchanged() {
        let mut def = forward(false);
        def.nodes[0].attrs.remove("partition_strategy");
        let s = shard_embeddings(&def, 2, Some(PartitionStrategy::Mod), None).unwrap();
        assert!(s.tables.is_empty());
        assert_eq!(s.def, def);
    }

    #[test]
    fn errors_name_the_table_and_say_what_to_do() {
        let e = shard_embeddings(&forward(true), 2, None, Some(2))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`emb`") && e.contains("`peek`") && e.contains("Gather"),
            "{e}"
        );
        let e = shard_embeddings(&forward(false), 2, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--batch-size"), "{e}");
        let e = shard_embeddings(&forward(false), 0, None, Some(2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no ps task"), "{e}");
    }
}
