//! Snapshot tests of placement and partitioning: text and JSON renderings of targeted graphs,
//! and the error messages of bad placements.

use dflow_graph::builder::GraphBuilder;
use dflow_graph::{ClusterSpec, DType, DeviceName, DeviceType, Graph, Tensor};
use dflow_partitioner::{
    load_json, partition, place, render_dot, render_json, render_text, PartitionOptions,
    Partitions, PlacementOptions, Policy, PsStrategy,
};

fn cluster(jobs: &[(&str, u32)]) -> ClusterSpec {
    ClusterSpec::local(jobs).unwrap()
}

fn explicit() -> PlacementOptions {
    PlacementOptions {
        policy: Policy::Explicit,
        ..PlacementOptions::default()
    }
}

fn run(
    g: &Graph,
    c: &ClusterSpec,
    popts: &PlacementOptions,
    opts: &PartitionOptions,
) -> Partitions {
    let placed = place(g, c, popts).unwrap();
    let a = partition(&placed, opts).unwrap();
    // Determinism and JSON round trip, checked on every snapshot case.
    let b = partition(&placed, opts).unwrap();
    let json = render_json(&a);
    assert_eq!(json, render_json(&b));
    assert_eq!(render_text(&a), render_text(&b));
    let back = load_json(&json).unwrap();
    assert_eq!(render_json(&back), json);
    assert!(render_dot(&a).starts_with("digraph partitions {"));
    a
}

fn snap(name: &str, p: &Partitions) {
    insta::assert_snapshot!(format!("{name}_text"), render_text(p));
    insta::assert_snapshot!(format!("{name}_json"), render_json(p));
}

fn w(t: u32) -> String {
    format!("/job:worker/task:{t}")
}

#[test]
fn chain_across_two_devices() {
    let mut b = GraphBuilder::new();
    let x = b.with_device(&w(0), |b| b.placeholder("x", DType::F32, &[2, 3]));
    let a = b.with_device(&w(0), |b| b.unary("Relu", "a", &x));
    let t = b.with_device(&w(1), |b| b.unary("Tanh", "t", &a));
    b.with_device(&w(1), |b| b.unary("Identity", "out", &t));
    let g = b.build().unwrap();
    let p = run(
        &g,
        &cluster(&[("worker", 2)]),
        &explicit(),
        &PartitionOptions::default(),
    );
    assert_eq!(p.pairs.len(), 1);
    snap("chain_across_two_devices", &p);
}

#[test]
fn one_tensor_two_consumers_one_pair() {
    let mut b = GraphBuilder::new();
    let x = b.with_device(&w(0), |b| b.placeholder("x", DType::F32, &[4]));
    let r = b.with_device(&w(1), |b| b.unary("Relu", "r", &x));
    let s = b.with_device(&w(1), |b| b.unary("Sigmoid", "s", &x));
    b.with_device(&w(1), |b| b.binary("Add", "sum", &r, &s));
    let g = b.build().unwrap();
    let p = run(
        &g,
        &cluster(&[("worker", 2)]),
        &explicit(),
        &PartitionOptions::default(),
    );
    assert_eq!(p.pairs.len(), 1, "both consumers share one pair");
    snap("one_tensor_two_consumers", &p);
}

#[test]
fn diamond_over_three_devices() {
    let mut b = GraphBuilder::new();
    let x = b.with_device(&w(0), |b| b.placeholder("x", DType::F64, &[8, 8]));
    let l = b.with_device(&w(1), |b| b.unary("Relu", "left", &x));
    let r = b.with_device(&w(2), |b| b.unary("Tanh", "right", &x));
    b.with_device(&w(0), |b| b.binary("Add", "join", &l, &r));
    let g = b.build().unwrap();
    let p = run(
        &g,
        &cluster(&[("worker", 3)]),
        &explicit(),
        &PartitionOptions::default(),
    );
    assert_eq!(p.pairs.len(), 4);
    assert_eq!(
        p.buffer_plan
            .bytes_received_per_step
            .values()
            .sum::<usize>(),
        4 * 512
    );
    snap("diamond_over_three_devices", &p);
}

#[test]
fn control_dependency_across_devices() {
    let mut b = GraphBuilder::new();
    let x = b.with_device(&w(0), |b| b.placeholder("x", DType::F32, &[2]));
    let init = b.with_device(&w(0), |b| b.unary("Identity", "init", &x));
    let y = b.with_device(&w(1), |b| b.op("NoOp", "after").control_dep(&init).finish());
    b.with_device(&w(1), |b| {
        b.op("NoOp", "after2")
            .control_dep(&init)
            .control_dep(&y)
            .finish()
    });
    let g = b.build().unwrap();
    let p = run(
        &g,
        &cluster(&[("worker", 2)]),
        &explicit(),
        &PartitionOptions::default(),
    );
    assert_eq!(
        p.pairs.len(),
        1,
        "control pair deduplicated per destination device"
    );
    assert!(p.pairs[0].is_control);
    assert_eq!(p.pairs[0].bytes, Some(0));
    assert_eq!(&*p.pairs[0].tensor_name, "^init");
    snap("control_dependency_across_devices", &p);
}

fn mlp(b: &mut GraphBuilder) {
    let x = b.placeholder("x", DType::F32, &[-1, 4]);
    let w1 = b.variable("w1", DType::F32, &[4, 8], "glorot_uniform");
    let b1 = b.variable("b1", DType::F32, &[8], "zeros");
    let w2 = b.variable("w2", DType::F32, &[8, 2], "glorot_uniform");
    let h = b.matmul("h", &x, &w1);
    let hb = b.binary("BiasAdd", "hb", &h, &b1);
    let r = b.unary("Relu", "relu", &hb);
    let s = b.constant("scale", Tensor::scalar(0.5f32));
    let logits = b.matmul("logits", &r, &w2);
    b.binary("Mul", "scaled", &logits, &s);
}

#[test]
fn classic_ps_pattern_round_robin() {
    let mut b = GraphBuilder::new();
    mlp(&mut b);
    let g = b.build().unwrap();
    let c = cluster(&[("ps", 2), ("worker", 1)]);
    let p = run(
        &g,
        &c,
        &PlacementOptions::default(),
        &PartitionOptions::default(),
    );
    let ps0 = DeviceName::full("ps", 0, DeviceType::CPU, 0);
    let ps1 = DeviceName::full("ps", 1, DeviceType::CPU, 0);
    let names = |d: &DeviceName| -> Vec<String> {
        let gr = &p.partitions[d].graph;
        gr.node_indices().map(|i| gr.node(i).name.clone()).collect()
    };
    assert!(names(&ps0).contains(&"w1".to_string()) && names(&ps0).contains(&"w2".to_string()));
    assert!(names(&ps1).contains(&"b1".to_string()));
    snap("classic_ps_pattern_round_robin", &p);
}

#[test]
fn classic_ps_pattern_greedy_bytes() {
    let mut b = GraphBuilder::new();
    mlp(&mut b);
    let g = b.build().unwrap();
    let c = cluster(&[("ps", 2), ("worker", 1)]);
    let popts = PlacementOptions {
        policy: Policy::DeviceSetter {
            ps_strategy: PsStrategy::GreedyBytes,
        },
        ..PlacementOptions::default()
    };
    let placed = place(&g, &c, &popts).unwrap();
    // w1 (128 B) → ps0, b1 (32 B) → ps1, w2 (64 B) → ps1 (32 < 128).
    assert_eq!(placed.device_of("w1").unwrap().task, Some(0));
    assert_eq!(placed.device_of("b1").unwrap().task, Some(1));
    assert_eq!(placed.device_of("w2").unwrap().task, Some(1));
    let p = run(&g, &c, &popts, &PartitionOptions::default());
    insta::assert_snapshot!("classic_ps_pattern_greedy_bytes_text", render_text(&p));
}

#[test]
fn two_workers_send_to_one_ps() {
    let mut b = GraphBuilder::new();
    let v = b.variable("v", DType::F32, &[16], "zeros");
    let g0 = b.with_device(&w(0), |b| b.binary("Mul", "grad0", &v, &v));
    let g1 = b.with_device(&w(1), |b| b.binary("Mul", "grad1", &v, &v));
    b.with_device("/job:ps/task:0", |b| {
        b.op("AddN", "sum").inputs([&g0, &g1]).finish()
    });
    let g = b.build().unwrap();
    let c = cluster(&[("ps", 1), ("worker", 2)]);
    let p = run(
        &g,
        &c,
        &PlacementOptions::default(),
        &PartitionOptions::default(),
    );
    let ps0 = DeviceName::full("ps", 0, DeviceType::CPU, 0);
    assert_eq!(p.buffer_plan.bytes_received_per_step[&ps0], 128);
    snap("two_workers_send_to_one_ps", &p);
}

#[test]
fn feed_and_fetch_on_non_chief_task() {
    let mut b = GraphBuilder::new();
    let x = b.with_device(&w(1), |b| b.placeholder("x", DType::F32, &[-1, 3]));
    let y = b.with_device(&w(1), |b| b.unary("Relu", "y", &x));
    let z = b.with_device(&w(0), |b| b.unary("Square", "z", &y));
    b.with_device(&w(1), |b| b.unary("Exp", "unused", &x));
    let _ = z;
    let g = b.build().unwrap();
    let opts = PartitionOptions {
        feeds: vec!["x".into()],
        fetches: vec!["y:0".into(), "z".into()],
        targets: vec![],
    };
    let p = run(&g, &cluster(&[("worker", 2)]), &explicit(), &opts);
    assert_eq!(
        p.feeds[0].device,
        DeviceName::full("worker", 1, DeviceType::CPU, 0)
    );
    assert_eq!(p.fetches.len(), 2);
    assert!(p
        .buffer_plan
        .dynamic
        .iter()
        .all(|(_, why)| why.contains("placeholder x")));
    snap("feed_and_fetch_on_non_chief_task", &p);
}

#[test]
fn pruning_to_fetches_and_targets() {
    let mut b = GraphBuilder::new();
    let x = b.with_device(&w(0), |b| b.placeholder("x", DType::F32, &[2]));
    let a = b.with_device(&w(0), |b| b.unary("Relu", "a", &x));
    let dead = b.with_device(&w(1), |b| b.unary("Tanh", "dead", &x));
    let keep = b.with_device(&w(1), |b| b.unary("Sigmoid", "kept", &a));
    b.with_device(&w(1), |b| b.op("NoOp", "train").control_dep(&keep).finish());
    let _ = dead;
    let g = b.build().unwrap();
    let opts = PartitionOptions {
        feeds: vec![],
        fetches: vec!["a:0".into()],
        targets: vec!["train".into()],
    };
    let p = run(&g, &cluster(&[("worker", 2)]), &explicit(), &opts);
    let all: Vec<String> = p
        .partitions
        .values()
        .flat_map(|part| {
            let gr = &part.graph;
            gr.node_indices()
                .map(|i| gr.node(i).name.clone())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(!all.contains(&"dead".to_string()));
    snap("pruning_to_fetches_and_targets", &p);
}

#[test]
fn generator_follows_its_consumers_and_refs_colocate() {
    let mut b = GraphBuilder::new();
    let c = b.constant("c", Tensor::scalar(2.0f32));
    let x = b.with_device(&w(1), |b| b.placeholder("x", DType::F32, &[]));
    b.with_device(&w(1), |b| b.binary("Mul", "m", &x, &c));
    let v = b.variable("v", DType::F32, &[3], "zeros");
    b.op("Identity", "read")
        .input(&v)
        .colocate_with(&v)
        .finish();
    let g = b.build().unwrap();
    let placed = place(
        &g,
        &cluster(&[("ps", 1), ("worker", 2)]),
        &PlacementOptions::default(),
    )
    .unwrap();
    assert_eq!(placed.device_of("c").unwrap().task, Some(1));
    assert_eq!(placed.device_of("read").unwrap().job.as_deref(), Some("ps"));
}

fn place_err(g: &Graph, c: &ClusterSpec, popts: &PlacementOptions) -> String {
    place(g, c, popts).unwrap_err().to_string()
}

#[test]
fn bad_placements() {
    let c = cluster(&[("ps", 1), ("worker", 2)]);
    let one = |dev: &str| {
        let mut b = GraphBuilder::new();
        b.with_device(dev, |b| b.placeholder("x", DType::F32, &[1]));
        b.build().unwrap()
    };
    let opts = PlacementOptions::default();
    let mut report = String::new();
    report += &format!(
        "unknown job: {}\n",
        place_err(&one("/job:chief"), &c, &opts)
    );
    report += &format!(
        "unknown task: {}\n",
        place_err(&one("/job:worker/task:7"), &c, &opts)
    );
    report += &format!(
        "device not in cluster: {}\n",
        place_err(&one("/job:worker/device:GPU:0"), &c, &opts)
    );

    let mut b = GraphBuilder::new();
    let a = b.with_device(&w(0), |b| b.placeholder("a", DType::F32, &[1]));
    b.with_device(&w(1), |b| {
        b.op("Identity", "b").input(&a).colocate_with(&a).finish()
    });
    report += &format!(
        "conflicting colocation: {}\n",
        place_err(&b.build().unwrap(), &c, &opts)
    );

    let mut b = GraphBuilder::new();
    let a = b.with_device("/job:ps", |b| b.placeholder("a", DType::F32, &[1]));
    b.with_device("/job:worker", |b| {
        b.op("Identity", "b").input(&a).colocate_with(&a).finish()
    });
    report += &format!(
        "colocation spans jobs: {}\n",
        place_err(&b.build().unwrap(), &c, &opts)
    );

    let bad_default = PlacementOptions {
        default_device: "/job:trainer".parse().unwrap(),
        ..PlacementOptions::default()
    };
    report += &format!(
        "default not in cluster: {}\n",
        place_err(&one(""), &c, &bad_default)
    );
    insta::assert_snapshot!("bad_placements", report);

    // Soft placement falls back to the task's CPU.
    let soft = PlacementOptions {
        allow_soft_placement: true,
        ..PlacementOptions::default()
    };
    let placed = place(&one("/job:worker/task:1/device:GPU:0"), &c, &soft).unwrap();
    assert_eq!(
        placed.devices[0],
        DeviceName::full("worker", 1, DeviceType::CPU, 0)
    );
}

#[test]
fn bad_partition_requests() {
    let mut b = GraphBuilder::new();
    b.placeholder("x", DType::F32, &[1]);
    let g = b.build().unwrap();
    let placed = place(&g, &cluster(&[("worker", 1)]), &PlacementOptions::default()).unwrap();
    let err = |o: PartitionOptions| partition(&placed, &o).unwrap_err().to_string();
    let report = [
        err(PartitionOptions {
            fetches: vec!["nope".into()],
            ..Default::default()
        }),
        err(PartitionOptions {
            fetches: vec!["x:3".into()],
            ..Default::default()
        }),
        err(PartitionOptions {
            feeds: vec!["x:a".into()],
            ..Default::default()
        }),
        err(PartitionOptions {
            targets: vec!["ghost".into()],
            ..Default::default()
        }),
    ]
    .join("\n");
    insta::assert_snapshot!("bad_partition_requests", report);
}
