//! TensorFlow 1.x training graphs exported by `fixtures/tf/make_tf_training_graphs.py` (with
//! TensorFlow's own values for one step): what imports runs one step to TensorFlow's numbers;
//! what does not yet import fails with one error that lists exactly the missing ops.

use dflow_executor::{Session, SessionOptions};
use dflow_graph::tf_import::import_graphdef_json;
use dflow_graph::{ClusterSpec, Graph};
use serde_json::Value;

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

/// The MLP training graphs: every optimizer apply, gradient op and variable op imports; the
/// dynamic-shape ops `tf.gradients` emits for the mean and the cross-entropy are what remains,
/// reported together in one error with the nodes that use them.
#[test]
fn mlp_training_graphs_report_only_the_dynamic_shape_ops() {
    const MISSING: [&str; 7] = [
        "Shape",
        "Fill",
        "Tile",
        "FloorMod",
        "GatherV2",
        "Prod",
        "ExpandDims",
    ];
    for variant in [
        "mlp_resource_sgd",
        "mlp_ref_sgd",
        "mlp_resource_momentum",
        "sync_2workers",
    ] {
        let (text, tf) = fixture(variant);
        let e = import_graphdef_json(&text).unwrap_err().to_string();
        let listed: Vec<&str> = e
            .trim_start_matches("unsupported TensorFlow ops: ")
            .split("), ")
            .map(|entry| entry.split(" (").next().unwrap_or(""))
            .collect();
        assert_eq!(listed, MISSING, "{variant}: {e}");
        // The graph uses the training ops the importer now handles.
        let ops: Vec<&str> = tf["ops"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            ops.iter().any(|o| o.contains("Apply")) && ops.contains(&"ReluGrad"),
            "{variant}: {ops:?}"
        );
    }
}
