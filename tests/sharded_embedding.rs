//! Sharded embedding tables under the ps strategy: a bag-of-ids model whose table is split over
//! two ps tasks (`mod` and `div`) looks up and trains exactly like the unsharded table in one
//! task, for each combiner (sum, mean, sqrtn), with one worker and with two sync replicas; lazy
//! Adam on two shards equals lazy Adam on one. Each step a worker sends each shard only its
//! distinct row ids and their gradients: C·8 + C·d·4 bytes (C = the row buffers' capacity, at
//! most the ids per step), counted from the trace's Send events, not the table's rows·d·4.

use dflow::executor::{Session, SessionOptions};
use dflow::graph::builder::GraphBuilder;
use dflow::graph::embedding_partition::{EmbeddingPartition, PartitionStrategy};
use dflow::graph::train::{expand_training, OptimizerKind, OptimizerSpec, TrainSpec};
use dflow::graph::{AttrValue, ClusterSpec, DType, Graph, GraphDef, Tensor};
use dflow::partitioner::strategy::sharded_embedding::{
    part_name, shard_embeddings, sparse_updates,
};
use dflow::partitioner::strategy::{ps_training, PsMode, ReplicaGraph};
use std::collections::BTreeMap;

const VOCAB: usize = 200;
const D: usize = 4;
/// Ids per step (4 examples of 3 ids) and the examples they belong to.
const IDS: [[i64; 12]; 3] = [
    [3, 17, 3, 30, 8, 8, 36, 0, 17, 21, 22, 5],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [36, 36, 36, 35, 0, 1, 18, 19, 18, 2, 9, 30],
];
const SEG: [i64; 12] = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3];
const TARGETS: [f32; 4] = [0.5, -1.0, 2.0, 0.25];

/// ids [K] → Gather(table) [K, d] → SparseSegment<combiner> → [S, d] → MatMul(w) → MSE.
fn model(combiner: &str, ids_per_step: usize, optimizer: OptimizerKind) -> (GraphDef, TrainSpec) {
    let mut b = GraphBuilder::new();
    let table = b.variable("emb", DType::F32, &[VOCAB, D], "normal");
    let w = b.variable("w", DType::F32, &[D, 1], "normal");
    let ids = b.placeholder("ids", DType::I64, &[ids_per_step as i64]);
    let seg = b.placeholder("seg", DType::I64, &[ids_per_step as i64]);
    let y = b.placeholder("y", DType::F32, &[-1, 1]);
    let positions: Vec<i64> = (0..ids_per_step as i64).collect();
    let positions = b.constant(
        "positions",
        Tensor::from_slice(&[ids_per_step], &positions).unwrap(),
    );
    let rows = b.op("Gather", "lookup").input(&table).input(&ids).finish();
    let op = match combiner {
        "sum" => "SparseSegmentSum",
        "mean" => "SparseSegmentMean",
        _ => "SparseSegmentSqrtN",
    };
    let bag = b
        .op(op, "bag")
        .input(&rows)
        .input(&positions)
        .input(&seg)
        .finish();
    let p = b.matmul("pred", &bag, &w);
    let d = b.binary("Sub", "diff", &p, &y);
    let sq = b.unary("Square", "sq", &d);
    b.op("Mean", "loss").input(&sq).finish();
    let mut def = b.to_def();
    for n in &mut def.nodes {
        if n.name == "emb" {
            n.attrs
                .insert("partition_strategy".into(), AttrValue::String("mod".into()));
        }
    }
    let spec = TrainSpec::new(
        "loss",
        OptimizerSpec {
            kind: optimizer,
            lr: 0.05,
        },
    );
    (def, spec)
}

fn session(def: &GraphDef, ps: usize, workers: usize) -> Session {
    let graph = Graph::from_def(def).expect("the graph is valid");
    let cluster = ClusterSpec::local(&[("ps", ps as u32), ("worker", workers as u32)]).unwrap();
    let opts = SessionOptions {
        trace: true,
        ..SessionOptions::default()
    };
    Session::new(graph, cluster, opts).expect("session starts")
}

fn i64s(v: &[i64]) -> Tensor {
    Tensor::from_slice(&[v.len()], v).unwrap()
}

fn targets(t: &[f32]) -> Tensor {
    Tensor::from_slice(&[t.len(), 1], t).unwrap()
}

/// The losses of 3 steps of the plain (unsharded, one task) graph and its final table.
fn plain(def: &GraphDef, spec: &TrainSpec) -> (Vec<f32>, Vec<f32>) {
    let t = expand_training(def, spec).unwrap();
    let s = session(&t.def, 1, 1);
    let mut losses = vec![];
    for ids in &IDS {
        let out = s
            .run(
                &[
                    ("ids", i64s(ids)),
                    ("seg", i64s(&SEG)),
                    ("y", targets(&TARGETS)),
                ],
                &[&t.loss],
                &[&t.train_op],
            )
            .unwrap();
        losses.push(out[0].as_slice::<f32>().unwrap()[0]);
    }
    (losses, variable(&s, "emb"))
}

fn variable(s: &Session, name: &str) -> Vec<f32> {
    s.variables()
        .into_iter()
        .find(|(_, n, _)| n == name)
        .unwrap_or_else(|| panic!("no variable {name}"))
        .2
        .as_slice::<f32>()
        .unwrap()
        .to_vec()
}

/// The sharded job: the forward graph's table over `ps` shards, one sync graph of `workers`
/// replicas each fed its share of every step (consecutive examples).
struct Sharded {
    session: Session,
    graph: ReplicaGraph,
    partition: EmbeddingPartition,
    ps: usize,
}

impl Sharded {
    fn new(
        combiner: &str,
        optimizer: OptimizerKind,
        strategy: PartitionStrategy,
        ps: usize,
        workers: usize,
    ) -> Sharded {
        let (def, spec) = model(combiner, 12 / workers, optimizer);
        let sharded = shard_embeddings(&def, ps, Some(strategy), None).unwrap();
        assert_eq!(sharded.tables.len(), 1);
        let mut graph = ps_training(&sharded.def, &spec, workers, PsMode::Sync, "ids", "y")
            .unwrap()
            .remove(0);
        let parts = sparse_updates(&mut graph, &sharded.tables).unwrap();
        assert_eq!(parts.len(), ps, "every shard's update is sparse");
        for n in &graph.training.def.nodes {
            assert!(
                !matches!(n.op.as_str(), "EmbeddingShardScatter" | "Gather"),
                "{} ({}) is left: no dense table gradient, no whole-table lookup",
                n.name,
                n.op
            );
        }
        Sharded {
            session: session(&graph.training.def, ps, workers),
            graph,
            partition: EmbeddingPartition::new(VOCAB as u64, ps, strategy).unwrap(),
            ps,
        }
    }

    fn step(&self, ids: &[i64]) -> f32 {
        let parts = self.graph.replicas.len();
        let per = ids.len() / parts;
        let examples = TARGETS.len() / parts;
        let mut feeds: Vec<(String, Tensor)> = vec![];
        for (i, r) in self.graph.replicas.iter().enumerate() {
            let seg: Vec<i64> = SEG[i * per..(i + 1) * per]
                .iter()
                .map(|s| s - (i * examples) as i64)
                .collect();
            feeds.push((r.features.clone(), i64s(&ids[i * per..(i + 1) * per])));
            feeds.push((
                r.labels.clone(),
                targets(&TARGETS[i * examples..(i + 1) * examples]),
            ));
            feeds.push((format!("replica_{i}/seg"), i64s(&seg)));
            feeds.push((
                r.weight.clone().unwrap(),
                Tensor::scalar(1.0f32 / parts as f32),
            ));
        }
        let feeds: Vec<(&str, Tensor)> =
            feeds.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
        let t = &self.graph.training;
        let out = self
            .session
            .run(&feeds, &[&t.loss], &[&t.train_op])
            .unwrap();
        out[0].as_slice::<f32>().unwrap()[0]
    }

    /// The whole table, joined from the shards.
    fn table(&self) -> Vec<f32> {
        let mut whole = vec![f32::NAN; VOCAB * D];
        for s in 0..self.ps {
            let part = variable(&self.session, &part_name("emb", s));
            for (local, id) in self.partition.rows(s).unwrap().ids().enumerate() {
                let id = id as usize;
                whole[id * D..(id + 1) * D].copy_from_slice(&part[local * D..(local + 1) * D]);
            }
        }
        whole
    }

    /// Bytes of each step's Send events from worker tasks to ps tasks, and their count.
    fn pushed_per_step(&self) -> BTreeMap<u64, usize> {
        let mut per_step = BTreeMap::new();
        for e in self.session.tracer().unwrap().events() {
            if e.cat == "Send" && e.device.contains("/job:worker") && e.name.contains("/to/ps_") {
                *per_step.entry(e.step).or_insert(0) += e.bytes.unwrap_or(0);
            }
        }
        per_step
    }
}

fn assert_close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-6, "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn sharded_tables_train_like_the_unsharded_table_for_each_strategy_and_combiner() {
    for combiner in ["sum", "mean", "sqrtn"] {
        let (def, spec) = model(combiner, 12, OptimizerKind::Sgd);
        let (want_losses, want_table) = plain(&def, &spec);
        for strategy in [PartitionStrategy::Mod, PartitionStrategy::Div] {
            for workers in [1, 2] {
                let job = Sharded::new(combiner, OptimizerKind::Sgd, strategy, 2, workers);
                let losses: Vec<f32> = IDS.iter().map(|ids| job.step(ids)).collect();
                let what = format!("{combiner}, {strategy}, {workers} worker(s)");
                assert_close(&format!("losses ({what})"), &losses, &want_losses);
                assert_close(&format!("table ({what})"), &job.table(), &want_table);
            }
        }
    }
}

#[test]
fn lazy_adam_on_two_shards_equals_lazy_adam_on_one() {
    for strategy in [PartitionStrategy::Mod, PartitionStrategy::Div] {
        let one = Sharded::new("mean", OptimizerKind::adam(), strategy, 1, 1);
        let two = Sharded::new("mean", OptimizerKind::adam(), strategy, 2, 1);
        let (a, b): (Vec<f32>, Vec<f32>) =
            IDS.iter().map(|ids| (one.step(ids), two.step(ids))).unzip();
        assert_close(&format!("losses ({strategy})"), &b, &a);
        assert_close(&format!("table ({strategy})"), &two.table(), &one.table());
        // Lazy: a row no step touched (id 13) keeps its initial value.
        let (def, _) = model("mean", 12, OptimizerKind::adam());
        let init = session(&def, 1, 1);
        let start = init.run(&[], &["emb"], &[]).unwrap().remove(0);
        let start = start.as_slice::<f32>().unwrap();
        assert_eq!(&two.table()[13 * D..14 * D], &start[13 * D..14 * D]);
    }
}

#[test]
fn a_worker_pushes_only_the_rows_it_touched() {
    let job = Sharded::new("sum", OptimizerKind::Sgd, PartitionStrategy::Mod, 2, 1);
    for ids in &IDS {
        job.step(ids);
    }
    // Per shard the buffers hold C = min(12 ids, the shard's rows) = 12 rows: the ids go out
    // for the lookup (C·8 bytes) and the row gradients come back (C·d·4); `w`'s gradient (d·4
    // bytes) is the only other push.
    let capacity = 12usize;
    let want = 2 * (capacity * 8 + capacity * D * 4) + D * 4;
    let pushed = job.pushed_per_step();
    assert_eq!(pushed.len(), IDS.len(), "{pushed:?}");
    for (step, bytes) in &pushed {
        assert_eq!(*bytes, want, "step {step}");
    }
    // The dense update would push the whole table's gradient every step.
    assert!(want < VOCAB * D * 4, "{want} vs {}", VOCAB * D * 4);
}
