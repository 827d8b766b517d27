//! dflow's partitioning of an imported TensorFlow graph against TensorFlow's own.
//!
//! The fixtures under `tests/fixtures/tf/` were made by `make_tf_fixtures.py` with TensorFlow
//! 2.21.0: a parameter-server MLP exported as protobuf JSON, and the `_Send`/`_Recv` pairs
//! TensorFlow's partitioner produced for it on a local cluster (`*.tf_pairs.json`).
//!
//! Name mapping, TensorFlow → dflow (all in `Transfer::from_tf_pair` and `Transfer::new`):
//! - TensorFlow names a cross-device tensor `edge_<edge id>_<producer>` (`edge_7_w1/read`),
//!   which loses the output index and depends on edge numbering. The fixture also records the
//!   `_Send` node's data input as `src_tensor` (`w1/read:0`), which is what dflow's pairs carry
//!   (`node:output`); the comparison uses it. Without `src_tensor`, the `edge_N_` prefix is
//!   stripped and output 0 assumed.
//! - Variables are read through the Identity `<var>/read` that TensorFlow colocates with the
//!   variable on its ps task, and the importer keeps it, so the sent tensor is `w1/read:0` in
//!   both systems (not `w1:0`).
//! - Devices are compared after parsing with [`DeviceName`] and filling what TensorFlow always
//!   writes out (`replica:0`, `device:CPU:0`), so `/job:ps/task:0` and
//!   `/job:ps/replica:0/task:0/device:CPU:0` are equal.
//! - Client-terminated pairs (TensorFlow's feed and fetch plumbing) are left out: only the
//!   device-to-device transfers are compared.
//!
//! The comparison against dflow's partitioner is `mod with_partitioner`.

use dflow_graph::tf_import::import_graphdef_json;
use dflow_graph::{DeviceName, DeviceType, Graph};
use serde_json::Value;
use std::collections::BTreeSet;

const PS_MLP: &str = include_str!("fixtures/tf/ps_mlp.graphdef.json");
const PS_MLP_PAIRS: &str = include_str!("fixtures/tf/ps_mlp.tf_pairs.json");
const PS_MLP_2PS: &str = include_str!("fixtures/tf/ps_mlp_2ps.graphdef.json");
const PS_MLP_2PS_PAIRS: &str = include_str!("fixtures/tf/ps_mlp_2ps.tf_pairs.json");

/// One device-to-device transfer, normalised so TensorFlow's and dflow's can be compared.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Transfer {
    /// `node:output`.
    tensor: String,
    send_device: String,
    recv_device: String,
}

impl Transfer {
    /// A transfer from names as dflow writes them (`w1/read:0`; `w1/read` means output 0).
    fn new(tensor: &str, send_device: &str, recv_device: &str) -> Result<Transfer, String> {
        let tensor = if tensor
            .rsplit_once(':')
            .is_some_and(|(_, i)| i.parse::<usize>().is_ok())
        {
            tensor.to_string()
        } else {
            format!("{tensor}:0")
        };
        Ok(Transfer {
            tensor,
            send_device: normalize_device(send_device)?,
            recv_device: normalize_device(recv_device)?,
        })
    }

    /// A transfer from one entry of a `*.tf_pairs.json` fixture; `None` for client-terminated
    /// pairs.
    fn from_tf_pair(p: &Value) -> Result<Option<Transfer>, String> {
        let field = |k: &str| {
            p.get(k)
                .and_then(Value::as_str)
                .ok_or_else(|| format!("pair {p} has no string `{k}`"))
        };
        if p.get("client_terminated").and_then(Value::as_bool) == Some(true) {
            return Ok(None);
        }
        let tensor = match p.get("src_tensor").and_then(Value::as_str) {
            Some(t) => t.to_string(),
            None => strip_edge_prefix(field("tensor_name")?).to_string(),
        };
        Transfer::new(&tensor, field("send_device")?, field("recv_device")?).map(Some)
    }
}

/// `edge_12_w2/read` → `w2/read`; other names unchanged.
fn strip_edge_prefix(name: &str) -> &str {
    name.strip_prefix("edge_")
        .and_then(|rest| rest.split_once('_'))
        .filter(|(id, _)| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
        .map_or(name, |(_, producer)| producer)
}

/// A device name with TensorFlow's implicit parts filled in: `replica:0`, `device:CPU:0`.
fn normalize_device(d: &str) -> Result<String, String> {
    let mut dev = DeviceName::parse(d).map_err(|e| format!("device {d:?}: {e}"))?;
    dev.replica.get_or_insert(0);
    dev.device_type = Some(dev.device_type.take().unwrap_or(DeviceType::CPU));
    dev.device_id.get_or_insert(0);
    Ok(dev.to_string())
}

/// The device-to-device transfers in a `*.tf_pairs.json` fixture.
fn tf_transfers(fixture: &str) -> Result<BTreeSet<Transfer>, String> {
    let v: Value = serde_json::from_str(fixture).map_err(|e| e.to_string())?;
    let pairs = v
        .get("pairs")
        .and_then(Value::as_array)
        .ok_or("fixture has no `pairs` list")?;
    let mut out = BTreeSet::new();
    for p in pairs {
        if let Some(t) = Transfer::from_tf_pair(p)? {
            out.insert(t);
        }
    }
    Ok(out)
}

/// `Ok` when both sets are equal; otherwise a message listing what each side has alone.
fn compare_transfers(tf: &BTreeSet<Transfer>, dflow: &BTreeSet<Transfer>) -> Result<(), String> {
    if tf == dflow {
        return Ok(());
    }
    let show = |set: Vec<&Transfer>| {
        set.iter()
            .map(|t| format!("\n  {} {} -> {}", t.tensor, t.send_device, t.recv_device))
            .collect::<String>()
    };
    Err(format!(
        "dflow's transfers differ from TensorFlow's\nonly in TensorFlow:{}\nonly in dflow:{}",
        show(tf.difference(dflow).collect()),
        show(dflow.difference(tf).collect())
    ))
}

#[test]
fn normalises_tf_names() {
    assert_eq!(strip_edge_prefix("edge_7_w1/read"), "w1/read");
    assert_eq!(strip_edge_prefix("edge_x_w1"), "edge_x_w1");
    assert_eq!(strip_edge_prefix("x:0"), "x:0");
    assert_eq!(
        normalize_device("/job:ps/task:1").unwrap(),
        "/job:ps/replica:0/task:1/device:CPU:0"
    );
    assert_eq!(
        normalize_device("/job:ps/replica:0/task:1/device:cpu:0").unwrap(),
        "/job:ps/replica:0/task:1/device:CPU:0"
    );
    assert!(normalize_device("/job:").is_err());
    assert_eq!(
        Transfer::new("w1/read", "/job:ps/task:0", "/job:worker/task:0").unwrap(),
        Transfer::new(
            "w1/read:0",
            "/job:ps/replica:0/task:0/device:CPU:0",
            "/job:worker/replica:0/task:0"
        )
        .unwrap()
    );
}

#[test]
fn reads_tf_pairs_fixture() {
    let tf = tf_transfers(PS_MLP_PAIRS).unwrap();
    let want: BTreeSet<_> = ["w1/read", "b1/read", "w2/read", "b2/read"]
        .iter()
        .map(|t| Transfer::new(t, "/job:ps/task:0", "/job:worker/task:0").unwrap())
        .collect();
    assert_eq!(tf, want);
    // Without `src_tensor`, the edge_N_ prefix is stripped.
    let p: Value = serde_json::from_str(
        r#"{"tensor_name": "edge_12_w2/read", "send_device": "/job:ps/replica:0/task:0/device:CPU:0",
            "recv_device": "/job:worker/replica:0/task:0/device:CPU:0", "client_terminated": false}"#,
    )
    .unwrap();
    assert_eq!(
        Transfer::from_tf_pair(&p).unwrap().unwrap().tensor,
        "w2/read:0"
    );
}

#[test]
fn comparison_reports_both_sides() {
    let tf = tf_transfers(PS_MLP_2PS_PAIRS).unwrap();
    assert_eq!(tf.len(), 4);
    // A hand-made dflow pair list: same transfers, written the way dflow writes them.
    let mut dflow: BTreeSet<_> = [
        ("w1/read:0", 0),
        ("b1/read:0", 1),
        ("w2/read:0", 0),
        ("b2/read:0", 1),
    ]
    .iter()
    .map(|(t, ps)| {
        Transfer::new(
            t,
            &format!("/job:ps/replica:0/task:{ps}/device:CPU:0"),
            "/job:worker/replica:0/task:0/device:CPU:0",
        )
        .unwrap()
    })
    .collect();
    assert_eq!(compare_transfers(&tf, &dflow), Ok(()));

    // Variables round-robin differently: b1 read from ps:0 instead of ps:1.
    dflow.remove(&Transfer::new("b1/read", "/job:ps/task:1", "/job:worker/task:0").unwrap());
    dflow.insert(Transfer::new("b1/read", "/job:ps/task:0", "/job:worker/task:0").unwrap());
    dflow.insert(Transfer::new("w1:0", "/job:ps/task:0", "/job:worker/task:0").unwrap());
    let e = compare_transfers(&tf, &dflow).unwrap_err();
    assert_eq!(
        e,
        "dflow's transfers differ from TensorFlow's\n\
         only in TensorFlow:\n  b1/read:0 /job:ps/replica:0/task:1/device:CPU:0 -> \
         /job:worker/replica:0/task:0/device:CPU:0\n\
         only in dflow:\n  b1/read:0 /job:ps/replica:0/task:0/device:CPU:0 -> \
         /job:worker/replica:0/task:0/device:CPU:0\n  w1:0 /job:ps/replica:0/task:0/device:CPU:0 \
         -> /job:worker/replica:0/task:0/device:CPU:0"
    );
}

#[test]
fn fixtures_import_and_every_tf_transfer_is_a_graph_edge() {
    // Until the partitioner lands: every transfer TensorFlow made is a data edge of the
    // imported graph between nodes requesting those two devices.
    for (graph, pairs) in [(PS_MLP, PS_MLP_PAIRS), (PS_MLP_2PS, PS_MLP_2PS_PAIRS)] {
        let def = import_graphdef_json(graph).unwrap();
        let g = Graph::from_def(&def).unwrap();
        for t in tf_transfers(pairs).unwrap() {
            let (producer, _) = t.tensor.rsplit_once(':').unwrap();
            let src = &def.nodes[def.nodes.iter().position(|n| n.name == producer).unwrap()];
            assert_eq!(normalize_device(&src.device).unwrap(), t.send_device);
            let consumers: Vec<_> = def
                .nodes
                .iter()
                .filter(|n| n.inputs.iter().any(|i| i == producer || *i == t.tensor))
                .collect();
            assert!(
                consumers
                    .iter()
                    .any(|c| normalize_device(&c.device).unwrap() == t.recv_device),
                "{t:?}"
            );
            assert!(g.find(producer).is_some());
        }
    }
}

/// The real comparison: TensorFlow's GraphDef, imported, placed and partitioned by dflow,
/// gives the same (tensor, send device, receive device) transfers as TensorFlow's own
/// partitioner for the same placement.
mod with_partitioner {
    use super::*;
    use dflow_graph::ClusterSpec;
    use dflow_partitioner::{partition, place, PartitionOptions, PlacementOptions};

    fn dflow_transfers(graph: &str, num_ps: u32) -> BTreeSet<Transfer> {
        let def = import_graphdef_json(graph).unwrap();
        let graph = Graph::from_def(&def).unwrap();
        let cluster = ClusterSpec::local(&[("ps", num_ps), ("worker", 1)]).unwrap();
        let placed = place(&graph, &cluster, &PlacementOptions::default()).unwrap();
        let parts = partition(
            &placed,
            &PartitionOptions {
                feeds: vec!["x:0".into()],
                fetches: vec!["softmax:0".into(), "prediction:0".into()],
                targets: vec![],
            },
        )
        .unwrap();
        parts
            .pairs
            .iter()
            .filter(|p| !p.client_terminated)
            .map(|p| Transfer::new(&p.tensor_name, &p.send_device, &p.recv_device).unwrap())
            .collect()
    }

    #[test]
    fn ps_mlp_matches_tensorflow() {
        let dflow = dflow_transfers(PS_MLP, 1);
        compare_transfers(&tf_transfers(PS_MLP_PAIRS).unwrap(), &dflow).unwrap();
    }

    #[test]
    fn ps_mlp_two_ps_matches_tensorflow() {
        let dflow = dflow_transfers(PS_MLP_2PS, 2);
        compare_transfers(&tf_transfers(PS_MLP_2PS_PAIRS).unwrap(), &dflow).unwrap();
    }
}
