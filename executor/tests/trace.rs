//! `--trace` output is a valid Chrome trace with Send and Recv events.

use dflow_executor::{Session, SessionOptions};
use dflow_graph::builder::GraphBuilder;
use dflow_graph::{ClusterSpec, DType, Tensor};

#[test]
fn trace_has_chrome_schema_and_transfer_events() {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[4]);
    let w = b.with_device("/job:ps/task:0", |b| {
        b.variable("w", DType::F32, &[4], "ones")
    });
    b.with_device("/job:worker/task:0", |b| b.binary("Add", "y", &x, &w));
    let s = Session::new(
        b.build().unwrap(),
        ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap(),
        SessionOptions {
            trace: true,
            ..SessionOptions::default()
        },
    )
    .unwrap();
    s.run(
        &[("x", Tensor::from_slice(&[4], &[1.0f32; 4]).unwrap())],
        &["y"],
        &[],
    )
    .unwrap();
    let json = s.tracer().unwrap().to_chrome_json();
    let events = json["traceEvents"].as_array().unwrap();
    let mut saw_send = false;
    let mut saw_recv = false;
    let mut tracks = std::collections::BTreeSet::new();
    for e in events {
        let ph = e["ph"].as_str().unwrap();
        assert!(
            e["pid"].is_u64() && e["tid"].is_u64() && e["name"].is_string(),
            "{e}"
        );
        match ph {
            "M" => {
                assert_eq!(e["name"], "process_name");
                tracks.insert(e["args"]["name"].as_str().unwrap().to_string());
            }
            "X" => {
                assert!(
                    e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0,
                    "{e}"
                );
                assert!(e["cat"].is_string());
                if e["cat"] == "Send" {
                    saw_send = true;
                    assert_eq!(e["args"]["bytes"], 16, "{e}");
                }
                if e["cat"] == "Recv" {
                    saw_recv = true;
                }
            }
            other => panic!("unexpected phase {other}"),
        }
    }
    assert!(saw_send && saw_recv, "Send and Recv events present");
    assert!(
        tracks.iter().any(|t| t.contains("/job:ps"))
            && tracks.iter().any(|t| t.contains("/job:worker")),
        "{tracks:?}"
    );
}
