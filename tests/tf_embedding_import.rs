//! TensorFlow 1.x embedding lookups over partitioned variables, exported by
//! `fixtures/tf/make_tf_embedding_lookup.py` with TensorFlow's own values (issue 19):
//! `embedding_lookup` with partition strategies `mod` and `div` and `embedding_lookup_sparse`
//! with each combiner import, compute TensorFlow's outputs within 1e-6, send ids to TensorFlow's
//! shards, and train (dflow differentiating the imported graph) to TensorFlow's SGD steps.

use dflow_executor::{Session, SessionOptions};
use dflow_graph::tf_import::import_graphdef_json;
use dflow_graph::train::{expand_training, OptimizerKind, OptimizerSpec, TrainSpec};
use dflow_graph::{ClusterSpec, Graph, GraphDef, Tensor};
use serde_json::Value;

fn fixture() -> (String, Value) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tf");
    let graph = std::fs::read_to_string(dir.join("embedding_lookup.graphdef.json")).unwrap();
    let values = std::fs::read_to_string(dir.join("embedding_lookup.tf_values.json")).unwrap();
    (graph, serde_json::from_str(&values).unwrap())
}

fn session(def: &GraphDef) -> Session {
    let cluster = ClusterSpec::local(&[("ps", 2), ("worker", 1)]).unwrap();
    Session::new(
        Graph::from_def(def).unwrap(),
        cluster,
        SessionOptions::default(),
    )
    .unwrap()
}

/// Every value of a (nested) JSON array, flattened.
fn flat(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        v => vec![v.as_f64().unwrap()],
    }
}

/// The int64 feeds the fixture recorded, each with its recorded shape.
fn feeds(tf: &Value) -> Vec<(String, Tensor)> {
    let mut out = vec![];
    for (name, v) in tf["feeds"].as_object().unwrap() {
        let values: Vec<i64> = flat(v).iter().map(|&x| x as i64).collect();
        let dims = match v.as_array().unwrap().first() {
            Some(Value::Array(row)) => vec![values.len() / row.len(), row.len()],
            _ => vec![values.len()],
        };
        out.push((name.clone(), Tensor::from_slice(&dims, &values).unwrap()));
    }
    out
}

fn run(s: &Session, tf: &Value, fetches: &[&str], targets: &[&str]) -> Vec<Tensor> {
    let feeds = feeds(tf);
    let feeds: Vec<(&str, Tensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
    s.run(&feeds, fetches, targets).unwrap()
}

fn assert_close(name: &str, got: &[f64], want: &[f64], tol: f64) {
    assert!(
        got.len() == want.len() && got.iter().zip(want).all(|(a, b)| (a - b).abs() <= tol),
        "{name}: {got:?}\nTensorFlow: {want:?}"
    );
}

fn variable(s: &Session, name: &str) -> Vec<f64> {
    s.variables()
        .into_iter()
        .find(|(_, n, _)| n == name)
        .unwrap_or_else(|| panic!("no variable {name}"))
        .2
        .to_f64_vec()
}

const OUTPUTS: [&str; 9] = [
    "lookup_mod",
    "lookup_div",
    "lookup2_mod",
    "lookup2_div",
    "sparse_sum",
    "sparse_mean",
    "sparse_sqrtn",
    "sparse_sum_div",
    "loss",
];

/// Both partition strategies and every combiner, over 5 and 2 parts spread over 2 ps tasks,
/// with repeated ids: each output equals TensorFlow's within 1e-6, each part starts from
/// TensorFlow's draw, and the lookups' static shapes survive the import (the ids' count per
/// shard is `?`).
#[test]
fn embedding_lookups_over_partitions_compute_tensorflows_values() {
    let (text, tf) = fixture();
    let def = import_graphdef_json(&text).unwrap();
    let g = Graph::from_def(&def).unwrap();
    let ty = |n: &str| {
        let (node, index) = n
            .split_once(':')
            .map_or((n, 0), |(a, b)| (a, b.parse().unwrap()));
        g.node(g.find(node).unwrap()).outputs[index].to_string()
    };
    assert_eq!(ty("embedding_lookup/DynamicPartition:4"), "i64[?]");
    assert_eq!(ty("embedding_lookup/Gather"), "f32[?, 3]");
    assert_eq!(ty("lookup_mod"), "f32[8, 3]");
    assert_eq!(ty("lookup2_div"), "f32[10, 4]");
    let op = |n: &str| def.nodes.iter().find(|d| d.name == n).unwrap().op.clone();
    assert_eq!(op("embedding_lookup"), "DynamicStitch");
    assert_eq!(op("embedding_lookup_1/Gather_2"), "Gather");
    assert_eq!(op("embedding_lookup_sparse_2"), "SparseSegmentSqrtN");
    let s = session(&def);
    let out = run(&s, &tf, &OUTPUTS, &[]);
    for (part, want) in tf["partitions"].as_object().unwrap() {
        assert_close(part, &variable(&s, part), &flat(want), 1e-6);
    }
    for (t, name) in out.iter().zip(OUTPUTS) {
        assert_close(name, &t.to_f64_vec(), &flat(&tf["outputs"][name]), 1e-6);
    }
    // The parts sit on both ps tasks (dflow's device setter, round robin), each Gather with
    // its part: the lookups read rows on two tasks, in counts known only at run time.
    let devices: std::collections::BTreeSet<String> = s
        .variables()
        .iter()
        .map(|(d, _, _)| d.to_string())
        .collect();
    assert_eq!(
        devices.into_iter().collect::<Vec<_>>(),
        [
            "/job:ps/replica:0/task:0/device:CPU:0",
            "/job:ps/replica:0/task:1/device:CPU:0"
        ]
    );
    assert_eq!(out[2].dims(), [10, 4]);
    assert_eq!(out[6].dims(), [4, 4]);
}

/// Ids 0..12 over emb5's 5 shards: the positions each strategy's DynamicPartition sends to
/// each shard equal TensorFlow's, which are issue 19's lists.
#[test]
fn ids_go_to_tensorflows_shards() {
    let (text, tf) = fixture();
    let s = session(&import_graphdef_json(&text).unwrap());
    let issue_19 = [
        (
            "shard_mod",
            [&[0, 5, 10][..], &[1, 6, 11], &[2, 7, 12], &[3, 8], &[4, 9]],
        ),
        (
            "shard_div",
            [&[0, 1, 2][..], &[3, 4, 5], &[6, 7, 8], &[9, 10], &[11, 12]],
        ),
    ];
    for (name, lists) in issue_19 {
        let fetches: Vec<String> = (0..5)
            .map(|k| format!("{name}/DynamicPartition_1:{k}"))
            .collect();
        let fetches: Vec<&str> = fetches.iter().map(String::as_str).collect();
        let got: Vec<Vec<i64>> = run(&s, &tf, &fetches, &[])
            .iter()
            .map(|t| t.to_f64_vec().iter().map(|&x| x as i64).collect())
            .collect();
        let want: Vec<Vec<i64>> = tf["shard_maps"][name]["positions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| flat(p).iter().map(|&x| x as i64).collect())
            .collect();
        assert_eq!(got, want, "{name}");
        let lists: Vec<Vec<i64>> = lists.iter().map(|l| l.to_vec()).collect();
        assert_eq!(got, lists, "{name}");
    }
}

/// dflow differentiates the imported lookups (Gather's sparse gradient through DynamicStitch's,
/// the segment combiners' through theirs) and two SGD steps (lr 0.1) give TensorFlow's losses
/// and every part's values within 1e-6 (the losses within 1e-5: |loss| reaches 14, where one
/// float32 ulp is 1e-6, and it sums eight reductions in another order than TensorFlow).
#[test]
fn sgd_through_imported_lookups_steps_like_tensorflow() {
    let (text, tf) = fixture();
    let def = import_graphdef_json(&text).unwrap();
    let lr = tf["sgd_lr"].as_f64().unwrap();
    let spec = TrainSpec::new(
        "loss",
        OptimizerSpec {
            kind: OptimizerKind::Sgd,
            lr,
        },
    );
    let t = expand_training(&def, &spec).unwrap();
    let s = session(&t.def);
    for (i, step) in tf["sgd_steps"].as_array().unwrap().iter().enumerate() {
        let loss = run(&s, &tf, &[t.loss.as_str()], &[t.train_op.as_str()]);
        let want = step["loss"].as_f64().unwrap();
        assert_close(
            &format!("step {i} loss"),
            &loss[0].to_f64_vec(),
            &[want],
            1e-5,
        );
        for (part, want) in step["partitions"].as_object().unwrap() {
            let name = format!("step {i} {part}");
            assert_close(&name, &variable(&s, part), &flat(want), 1e-6);
        }
    }
}

/// TensorFlow's own training graph for the lookups (`<optimizer>.minimize(loss)`: TensorFlow's
/// gradients of DynamicStitch and ResourceGather as GatherV2 and IndexedSlices,
/// SparseSegmentSumGrad/MeanGrad/SqrtNGrad, then per part the optimizer's sparse update)
/// imports, and two runs of its `train` give TensorFlow's losses and parts within 1e-6.
fn tensorflows_training_graph_steps_like_tensorflow(optimizer: &str, update: (&str, &str)) {
    let (_, tf) = fixture();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tf");
    let file = format!("embedding_lookup_train_{optimizer}.graphdef.json");
    let text = std::fs::read_to_string(dir.join(file)).unwrap();
    let def = import_graphdef_json(&text).unwrap();
    let op = |n: &str| def.nodes.iter().find(|d| d.name == n).unwrap().op.clone();
    assert_eq!(op(update.0), update.1);
    assert_eq!(
        op("gradients/embedding_lookup_sparse_1_grad/SparseSegmentMeanGrad"),
        "SparseSegmentMeanGrad"
    );
    let s = session(&def);
    let steps = tf[format!("{optimizer}_steps")].as_array().unwrap();
    assert_eq!(steps.len(), 2);
    for (i, step) in steps.iter().enumerate() {
        let loss = run(&s, &tf, &["loss"], &["train"]);
        let want = step["loss"].as_f64().unwrap();
        let what = format!("{optimizer} step {i} loss");
        assert_close(&what, &loss[0].to_f64_vec(), &[want], 1e-6);
        for (part, want) in step["partitions"].as_object().unwrap() {
            let name = format!("{optimizer} step {i} {part}");
            assert_close(&name, &variable(&s, part), &flat(want), 1e-6);
        }
    }
}

/// GradientDescentOptimizer(0.1): ResourceScatterAdd(part, indices, -lr · values) per part.
#[test]
fn tensorflows_own_sgd_training_graph_steps_like_tensorflow() {
    tensorflows_training_graph_steps_like_tensorflow(
        "sgd",
        ("train/update_emb5/part_0/ResourceScatterAdd", "ScatterAdd"),
    );
}

/// AdagradOptimizer(0.1) (accumulators from 0.1): Unique and UnsortedSegmentSum sum each part's
/// rows per index, then ResourceSparseApplyAdagrad (dflow's SparseApplyAdagrad, epsilon 0).
#[test]
fn tensorflows_own_adagrad_training_graph_steps_like_tensorflow() {
    tensorflows_training_graph_steps_like_tensorflow(
        "adagrad",
        (
            "train/update_emb2/part_1/ResourceSparseApplyAdagrad",
            "SparseApplyAdagrad",
        ),
    );
}

/// An op dflow lacks (here TensorFlow's UnsortedSegmentMax) is still refused, naming the op and
/// the node.
#[test]
fn an_unsupported_op_is_refused_naming_op_and_node() {
    let (text, _) = fixture();
    let mut graph: Value = serde_json::from_str(&text).unwrap();
    graph["node"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "name": "extra/segment_max", "op": "UnsortedSegmentMax",
            "input": ["lookup_mod", "ids", "ids"]
        }));
    let e = import_graphdef_json(&graph.to_string())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unsupported TensorFlow ops: UnsortedSegmentMax (extra/segment_max)"),
        "{e}"
    );
}
