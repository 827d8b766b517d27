//! TensorFlow 1.x training graphs exported by `fixtures/tf/make_tf_training_graphs.py` (with
//! TensorFlow's own values for one step): imported, one step's fetched loss and the variables
//! after it equal TensorFlow's within 1e-5, and dflow's Send/Recv pairs equal TensorFlow's by
//! (source tensor, send device, recv device).

use dflow_executor::{Session, SessionOptions};
use dflow_graph::tf_import::import_graphdef_json;
use dflow_graph::{ClusterSpec, DeviceName, DeviceType, Graph, Tensor};
use dflow_partitioner::{partition, place, PartitionOptions, PlacementOptions};
use serde_json::Value;
use std::collections::BTreeSet;

fn fixture(variant: &str) -> (String, Value) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tf");
    let graph = std::fs::read_to_string(dir.join(format!("train_{variant}.graphdef.json")))
        .unwrap_or_else(|e| panic!("{variant}: {e}"));
    let step = std::fs::read_to_string(dir.join(format!("train_{variant}.tf_step.json")))
        .unwrap_or_else(|e| panic!("{variant}: {e}"));
    (graph, serde_json::from_str(&step).unwrap())
}

fn session(graph: Graph) -> Session {
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
    Session::new(graph, cluster, SessionOptions::default()).unwrap()
}

fn variable(session: &Session, name: &str) -> Vec<f64> {
    session
        .variables()
        .into_iter()
        .find(|(_, n, _)| n == name)
        .unwrap_or_else(|| panic!("no variable {name}"))
        .2
        .to_f64_vec()
}

fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5)
}

/// `counter.assign_add(1.0)` on a resource variable: imported, `init` runnable, one step gives
/// TensorFlow's value.
#[test]
fn assign_add_counter_steps_like_tensorflow() {
    let (text, tf) = fixture("counter");
    let def = import_graphdef_json(&text).unwrap();
    let s = session(Graph::from_def(&def).unwrap());
    s.run(&[], &[], &["init"]).unwrap();
    let before = tf["variables_before"]["counter"].as_f64().unwrap();
    let loss = s.run(&[], &["loss"], &[]).unwrap();
    assert!(close(&loss[0].to_f64_vec(), &[before]), "{loss:?}");
    let train = tf["train"].as_str().unwrap();
    s.run(&[], &[], &[train]).unwrap();
    let after = tf["variables_after"]["counter"].as_f64().unwrap();
    assert!(close(&variable(&s, "counter"), &[after]));
}

/// A fed tensor from the fixture: `y*` are int64 labels, the rest f32 vectors or matrices.
fn feed(name: &str, v: &Value) -> Tensor {
    let rows = v.as_array().unwrap();
    if name.starts_with('y') {
        let labels: Vec<i64> = rows.iter().map(|l| l.as_i64().unwrap()).collect();
        return Tensor::from_slice(&[labels.len()], &labels).unwrap();
    }
    if rows.iter().all(Value::is_number) {
        let v: Vec<f32> = rows.iter().map(|x| x.as_f64().unwrap() as f32).collect();
        return Tensor::from_slice(&[v.len()], &v).unwrap();
    }
    let cols = rows[0].as_array().unwrap().len();
    let flat: Vec<f32> = rows
        .iter()
        .flat_map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
        })
        .collect();
    Tensor::from_slice(&[rows.len(), cols], &flat).unwrap()
}

fn flat(v: &Value) -> Vec<f64> {
    match v {
        Value::Array(a) => a.iter().flat_map(flat).collect(),
        other => vec![other.as_f64().unwrap()],
    }
}

/// One training step of an imported MLP: the fetched loss and every variable afterwards equal
/// TensorFlow's within 1e-5.
fn one_step_like_tensorflow(variant: &str) {
    let (text, tf) = fixture(variant);
    let def = import_graphdef_json(&text).unwrap_or_else(|e| panic!("{variant}: {e}"));
    let s = session(Graph::from_def(&def).unwrap());
    // The initial values come from the graph's initializers: TensorFlow's exactly (constants,
    // and its seeded random draws).
    s.run(&[], &[], &["init"]).unwrap();
    for (name, want) in tf["variables_before"].as_object().unwrap() {
        let got = s.run(&[], &[name.as_str()], &[]).unwrap()[0].to_f64_vec();
        assert!(
            close(&got, &flat(want)),
            "{variant}: {name} before the step: {got:?}\nTensorFlow: {:?}",
            flat(want)
        );
    }
    let feeds: Vec<(String, Tensor)> = tf["feeds"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), feed(k, v)))
        .collect();
    let feed_refs: Vec<(&str, Tensor)> =
        feeds.iter().map(|(k, t)| (k.as_str(), t.clone())).collect();
    let loss = tf["loss"].as_str().unwrap();
    let train = tf["train"].as_str().unwrap();
    let out = s.run(&feed_refs, &[loss], &[train]).unwrap();
    let want = tf["step_loss"].as_f64().unwrap();
    assert!(
        close(&out[0].to_f64_vec(), &[want]),
        "{variant}: loss {:?}, TensorFlow {want}",
        out[0].to_f64_vec()
    );
    for (name, want) in tf["variables_after"].as_object().unwrap() {
        let got = variable(&s, name);
        assert!(
            close(&got, &flat(want)),
            "{variant}: {name} after one step: {got:?}\nTensorFlow: {:?}",
            flat(want)
        );
    }
}

/// Gradients through a broadcasting Add and Sub, exported with a fixed batch size: TensorFlow's
/// constant reduction axes and shapes import, and the step equals TensorFlow's.
#[test]
fn broadcasting_ops_with_a_fixed_batch_step_like_tensorflow() {
    one_step_like_tensorflow("broadcast_fixed");
}

/// The same graph exported with the batch size unknown: TensorFlow's gradients compute the
/// reduction axes and shapes at run time (Shape -> BroadcastGradientArgs -> Sum -> Reshape);
/// imported as run-time ops, the step equals TensorFlow's.
#[test]
fn broadcasting_ops_with_an_unknown_batch_step_like_tensorflow() {
    let (text, tf) = fixture("broadcast_dynamic");
    assert!(
        tf["ops"]
            .as_array()
            .unwrap()
            .iter()
            .any(|o| o == "BroadcastGradientArgs"),
        "the fixture no longer has BroadcastGradientArgs"
    );
    let def = import_graphdef_json(&text).unwrap();
    let op = |n: &str| def.nodes.iter().find(|d| d.name == n).unwrap().op.clone();
    assert_eq!(op("gradients/sub_grad/Sum"), "DynamicSum");
    // Reshape to a Shape(y) is ReshapeLike(·, y): the gradient of a static operand is static.
    assert_eq!(op("gradients/sub_grad/Reshape"), "ReshapeLike");
    one_step_like_tensorflow("broadcast_dynamic");
}

/// MLPs with an unknown batch size (`x @ w + b`, per-example loss weights, a mean over
/// max(batch, 1)): BroadcastGradientArgs and Maximum at run time, weights initialized by
/// seeded `random_normal` and biases by constant lists, on resource and reference variables
/// with GradientDescent, Momentum and Adam; and with penalties reduced over some axes
/// (`dyn_reductions`: TensorFlow 2's BroadcastTo, DynamicStitch and Range) and with a sum whose
/// gradient is TF 1.x's (`dyn_tf1_sum_grad`: DynamicStitch, FloorDiv, Maximum, Tile). Initial
/// values, loss and variables after the step equal TensorFlow's.
#[test]
fn dynamic_batch_mlps_step_like_tensorflow() {
    for variant in [
        "dyn_resource_sgd",
        "dyn_ref_momentum",
        "dyn_resource_adam",
        "dyn_reductions",
        "dyn_tf1_sum_grad",
    ] {
        let (_, tf) = fixture(variant);
        let ops = tf["ops"].as_array().unwrap();
        for needed in ["BroadcastGradientArgs", "Maximum", "RandomStandardNormal"] {
            assert!(ops.iter().any(|o| o == needed), "{variant}: no {needed}");
        }
        one_step_like_tensorflow(variant);
    }
    for (variant, needed) in [
        ("dyn_reductions", ["BroadcastTo", "DynamicStitch", "Range"]),
        ("dyn_tf1_sum_grad", ["FloorDiv", "DynamicStitch", "Tile"]),
    ] {
        let (_, tf) = fixture(variant);
        let ops = tf["ops"].as_array().unwrap();
        for op in needed {
            assert!(ops.iter().any(|o| o == op), "{variant}: no {op}");
        }
    }
}

#[test]
fn mlp_resource_variables_sgd_step_like_tensorflow() {
    one_step_like_tensorflow("mlp_resource_sgd");
}

#[test]
fn mlp_ref_variables_sgd_step_like_tensorflow() {
    one_step_like_tensorflow("mlp_ref_sgd");
}

#[test]
fn mlp_momentum_steps_like_tensorflow() {
    one_step_like_tensorflow("mlp_resource_momentum");
}

#[test]
fn two_worker_sync_graph_steps_like_tensorflow() {
    one_step_like_tensorflow("sync_2workers");
}

/// Adam: TensorFlow's `ResourceApplyAdam` reads `beta1^t` and `beta2^t` from variables the
/// optimizer updates after the applies; imported as `ApplyAdamWithPowers`.
#[test]
fn mlp_adam_steps_like_tensorflow() {
    one_step_like_tensorflow("mlp_resource_adam");
}

/// A device with TensorFlow's implicit parts filled in (`replica:0`, `device:CPU:0`).
fn normalize_device(d: &str) -> String {
    let mut dev = DeviceName::parse(d).unwrap_or_else(|e| panic!("{d}: {e}"));
    dev.replica.get_or_insert(0);
    dev.device_type = Some(dev.device_type.take().unwrap_or(DeviceType::CPU));
    dev.device_id.get_or_insert(0);
    dev.to_string()
}

/// `node:i` (`node` means output 0).
fn tensor_name(t: &str) -> String {
    match t.rsplit_once(':') {
        Some((_, i)) if i.parse::<usize>().is_ok() => t.to_string(),
        _ => format!("{t}:0"),
    }
}

/// dflow's device-to-device transfers for one training step (feeds, loss fetched, train run)
/// against TensorFlow's, as (source tensor, send device, recv device). Left out of TensorFlow's:
/// its client plumbing (a feed forwarded from the master task, `_recv_<feed>`; a fetch sent to the
/// master task, worker 0) and the constants the importer folds into attributes (a learning rate).
fn pairs_match_tensorflow(variant: &str) {
    let (text, tf) = fixture(variant);
    let def = import_graphdef_json(&text).unwrap();
    let kept: BTreeSet<&str> = def.nodes.iter().map(|n| n.name.as_str()).collect();
    let graph = Graph::from_def(&def).unwrap();
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
    let placed = place(&graph, &cluster, &PlacementOptions::default()).unwrap();
    let loss = tf["loss"].as_str().unwrap().to_string();
    let feeds: Vec<String> = tf["feeds"]
        .as_object()
        .unwrap()
        .keys()
        .map(|k| format!("{k}:0"))
        .collect();
    let parts = partition(
        &placed,
        &PartitionOptions {
            feeds,
            fetches: vec![loss.clone()],
            targets: vec![tf["train"].as_str().unwrap().to_string()],
        },
    )
    .unwrap();
    let dflow: BTreeSet<(String, String, String)> = parts
        .pairs
        .iter()
        .filter(|p| !p.client_terminated)
        .map(|p| {
            (
                tensor_name(&p.tensor_name),
                normalize_device(&p.send_device),
                normalize_device(&p.recv_device),
            )
        })
        .collect();
    let master = normalize_device("/job:worker/task:0");
    let tf_pairs: BTreeSet<(String, String, String)> = tf["pairs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let f = |k: &str| p[k].as_str().unwrap().to_string();
            (
                tensor_name(&f("src_tensor")),
                normalize_device(&f("send_device")),
                normalize_device(&f("recv_device")),
            )
        })
        .filter(|(t, _, r)| {
            let node = t.rsplit_once(':').map_or(t.as_str(), |(n, _)| n);
            let client_plumbing = node.starts_with("_recv_") || (t == &loss && r == &master);
            !client_plumbing && kept.contains(node)
        })
        .collect();
    assert!(tf_pairs.len() >= 2, "{variant}: {tf_pairs:?}");
    // Every tensor between tasks has a static shape (a multi-process job allocates its receive
    // buffer once), the batch size unknown or not.
    for p in parts.pairs.iter().filter(|p| !p.client_terminated) {
        assert!(
            p.bytes.is_some(),
            "{variant}: {} crosses tasks with shape {}",
            p.tensor_name,
            p.shape
        );
    }
    assert_eq!(
        dflow, tf_pairs,
        "{variant}: dflow's pairs (left) differ from TensorFlow's (right)"
    );
}

#[test]
fn send_recv_pairs_match_tensorflow() {
    for variant in [
        "counter",
        "mlp_resource_sgd",
        "mlp_ref_sgd",
        "mlp_resource_momentum",
        "mlp_resource_adam",
        "sync_2workers",
        "broadcast_dynamic",
        "dyn_resource_sgd",
        "dyn_ref_momentum",
        "dyn_resource_adam",
    ] {
        pairs_match_tensorflow(variant);
    }
}

/// A fixture of `fixtures/tf/make_tf_partitioned.py`: the GraphDef and TensorFlow's values.
fn partitioned_fixture(name: &str) -> (String, Value) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tf");
    let graph = std::fs::read_to_string(dir.join(format!("{name}.graphdef.json")))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let values = std::fs::read_to_string(dir.join(format!("{name}.tf_values.json")))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    (graph, serde_json::from_str(&values).unwrap())
}

/// A table of rows from the fixture, flattened.
fn rows(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
        .collect()
}

/// A variable made with `fixed_size_partitioner(2)` (`emb/part_0` [7, 3], `emb/part_1` [6, 3],
/// each from its own seeded random-normal initializer) imports as its two part variables, each
/// starting from TensorFlow's values; the whole table read through the parts' ConcatV2 (axis a
/// folded constant) and a `tf.gather` of rows of it equal TensorFlow's outputs within 1e-6.
#[test]
fn a_partitioned_variable_read_through_concat_computes_tensorflows_values() {
    let (text, tf) = partitioned_fixture("partitioned_concat");
    let def = import_graphdef_json(&text).unwrap();
    let concat = def
        .nodes
        .iter()
        .find(|n| n.name == "emb/ConcatPartitions/concat")
        .unwrap();
    assert_eq!(concat.op, "Concat");
    assert_eq!(concat.attrs["axis"], dflow_graph::AttrValue::Int(0));
    assert_eq!(concat.inputs.len(), 2, "{:?}", concat.inputs);
    let s = session(Graph::from_def(&def).unwrap());
    let ids: Vec<i64> = tf["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    let ids = Tensor::from_slice(&[ids.len()], &ids).unwrap();
    let out = s.run(&[("ids", ids)], &["whole", "gathered"], &[]).unwrap();
    for (t, name) in out.iter().zip(["whole", "gathered"]) {
        let want = rows(&tf["outputs"][name]);
        let got = t.to_f64_vec();
        assert!(
            got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-6),
            "{name}: {got:?}\nTensorFlow: {want:?}"
        );
    }
    assert_eq!(out[0].dims(), [13, 3]);
    assert_eq!(out[1].dims(), [6, 3]);
    // Each part started from TensorFlow's own draw of its shape.
    for (part, want) in tf["partitions"].as_object().unwrap() {
        let got = variable(&s, part);
        assert!(
            close(&got, &rows(want)),
            "{part}: {got:?}\nTensorFlow: {want}"
        );
    }
}

/// `embedding_lookup` over the partitioned variable (partition strategies `mod` and `div`:
/// DynamicPartition, ResourceGather, ParallelDynamicStitch) imports and computes TensorFlow's
/// rows within 1e-6 (more lookups: `tf_embedding_import.rs`).
#[test]
fn an_embedding_lookup_over_partitions_computes_tensorflows_rows() {
    let (text, tf) = partitioned_fixture("partitioned_lookup");
    let def = import_graphdef_json(&text).unwrap();
    let s = session(Graph::from_def(&def).unwrap());
    let ids: Vec<i64> = tf["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    let ids = Tensor::from_slice(&[ids.len()], &ids).unwrap();
    let out = s
        .run(&[("ids", ids)], &["lookup_mod", "lookup_div"], &[])
        .unwrap();
    for (t, name) in out.iter().zip(["lookup_mod", "lookup_div"]) {
        let want = rows(&tf["outputs"][name]);
        let got = t.to_f64_vec();
        assert!(
            got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-6),
            "{name}: {got:?}\nTensorFlow: {want:?}"
        );
        assert_eq!(t.dims(), [6, 3]);
    }
}
