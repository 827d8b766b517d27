//! Snapshot tests of the partitions of every graph in `examples/`, loaded the way `dflow partition`
//! loads them (training expanded), plus the parameter-server assertions on the digits training graph.
//!
//! Each example exists as JSON and as DSL; both files must give byte-identical partitions, so each
//! example is snapshotted once (text and JSON renderings).

use dflow::load::{load_program, Program};
use dflow_graph::train::{expand_training, OptimizerKind};
use dflow_graph::{ClusterSpec, DeviceName, Graph};
use dflow_partitioner::{
    load_json, partition, place, render_json, render_text, PartitionOptions, Partitions,
    PlacementOptions, Policy, PsStrategy,
};
use std::path::PathBuf;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// The placement `dflow partition` uses by default.
fn cli_placement() -> PlacementOptions {
    PlacementOptions {
        policy: Policy::DeviceSetter {
            ps_strategy: PsStrategy::RoundRobin,
        },
        default_device: DeviceName::parse("/job:worker/task:0").unwrap(),
        allow_soft_placement: false,
    }
}

fn cluster(example: &str) -> ClusterSpec {
    ClusterSpec::from_file(&examples().join(example).join("cluster.json")).unwrap()
}

fn partition_graph(graph: &Graph, cluster: &ClusterSpec) -> Partitions {
    let placed = place(graph, cluster, &cli_placement()).unwrap();
    partition(&placed, &PartitionOptions::default()).unwrap()
}

fn load(example: &str, file: &str) -> Program {
    let path = examples().join(example).join(file);
    load_program(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Partitions `examples/<example>/<stem>.{json,dflow}`, checks both give the same partitions and
/// that the JSON rendering round-trips, and snapshots them once.
fn check_example(example: &str, stem: &str) -> Partitions {
    let c = cluster(example);
    let from_json = partition_graph(&load(example, &format!("{stem}.json")).graph, &c);
    let from_dsl = partition_graph(&load(example, &format!("{stem}.dflow")).graph, &c);
    let (text, json) = (render_text(&from_json), render_json(&from_json));
    assert_eq!(
        text,
        render_text(&from_dsl),
        "{example}: JSON and DSL differ"
    );
    assert_eq!(
        json,
        render_json(&from_dsl),
        "{example}: JSON and DSL differ"
    );
    assert_eq!(render_json(&load_json(&json).unwrap()), json);
    insta::assert_snapshot!(format!("{example}_text"), text);
    insta::assert_snapshot!(format!("{example}_json"), json);
    from_json
}

#[test]
fn mlp() {
    let p = check_example("mlp", "mlp");
    assert_eq!(p.partitions.len(), 2);
    // Four variables read by the worker: one pair each, nothing goes back (no training).
    assert_eq!(p.pairs.len(), 4);
    assert!(p.pairs.iter().all(|x| x.send_device.contains("/job:ps/")));
}

#[test]
fn three_devices() {
    let p = check_example("three_devices", "towers");
    assert_eq!(p.partitions.len(), 3);
}

#[test]
fn digits_training() {
    let p = check_example("digits", "digits");
    assert!(p
        .partitions
        .values()
        .any(|part| part.graph.find("train/w1/update").is_some()));
}

/// The device a node of the partitioned graph ended up on.
fn device_of<'a>(p: &'a Partitions, node: &str) -> Option<&'a DeviceName> {
    p.partitions
        .iter()
        .find(|(_, part)| part.graph.find(node).is_some())
        .map(|(d, _)| d)
}

fn on_ps(d: &str) -> bool {
    d.starts_with("/job:ps/")
}

/// Issue 5: with the variables on ps, the updates and slots live there too, the worker sends
/// gradients (never updated weights) and the ps sends the variables' values.
fn assert_ps_training(program: &Program, p: &Partitions, slots: &[&str]) {
    let training = program.training.as_ref().unwrap();
    let vars: Vec<&str> = training.gradients.iter().map(|(v, _)| v.as_str()).collect();
    assert_eq!(vars, ["w1", "b1", "w2", "b2"]);
    for v in &vars {
        let update = format!("train/{v}/update");
        let d = device_of(p, &update).unwrap_or_else(|| panic!("{update} missing"));
        assert!(on_ps(&d.to_string()), "{update} is on {d}");
        for s in slots {
            let slot = format!("{v}/{s}");
            let d = device_of(p, &slot).unwrap_or_else(|| panic!("slot {slot} missing"));
            assert!(on_ps(&d.to_string()), "slot {slot} is on {d}");
        }
    }
    let updates: Vec<String> = vars.iter().map(|v| format!("train/{v}/update")).collect();
    let mut grads_sent = Vec::new();
    let mut values_sent = Vec::new();
    for pair in p.pairs.iter().filter(|x| !x.client_terminated) {
        let (from_ps, to_ps) = (on_ps(&pair.send_device), on_ps(&pair.recv_device));
        let tensor = &*pair.tensor_name;
        if pair.is_control {
            // Only "the update ran" signals cross (and Adam's step count), towards the train op.
            assert!(from_ps && !to_ps, "{pair:?}");
            let node = tensor.trim_start_matches('^');
            assert!(
                updates.iter().any(|u| u == node) || node == "train/adam/t/increment",
                "{pair:?}"
            );
            continue;
        }
        match (from_ps, to_ps) {
            (false, true) => {
                assert!(tensor.starts_with("gradients/"), "worker sends {tensor}");
                assert!(
                    !updates.iter().any(|u| tensor.starts_with(u.as_str())),
                    "worker sends an updated weight: {tensor}"
                );
                grads_sent.push(tensor.to_string());
            }
            (true, false) => values_sent.push(tensor.to_string()),
            _ => panic!("unexpected pair {pair:?}"),
        }
    }
    let mut want_grads: Vec<String> = training
        .gradients
        .iter()
        .map(|(_, g)| {
            if g.contains(':') {
                g.clone()
            } else {
                format!("{g}:0")
            }
        })
        .collect();
    want_grads.sort();
    grads_sent.sort();
    assert_eq!(grads_sent, want_grads, "each gradient crosses once");
    let mut want_values: Vec<String> = vars.iter().map(|v| format!("{v}:0")).collect();
    want_values.sort();
    values_sent.sort();
    assert_eq!(
        values_sent, want_values,
        "each variable's value crosses once"
    );
    // Each update reads its gradient from the Recv of that gradient.
    for (v, g) in &training.gradients {
        let update = format!("train/{v}/update");
        let part = &p.partitions[device_of(p, &update).unwrap()];
        let idx = part.graph.find(&update).unwrap();
        let inputs: Vec<&str> = part
            .graph
            .inputs(idx)
            .into_iter()
            .map(|(i, _)| part.graph.node(i).name.as_str())
            .collect();
        let g = g.split(':').next().unwrap_or(g);
        let recv = format!("recv/{g}_0/from/worker_0");
        assert!(inputs.contains(&recv.as_str()), "{update} reads {inputs:?}");
    }
}

#[test]
fn digits_training_keeps_updates_on_ps_and_sends_gradients() {
    let program = load("digits", "digits.json");
    let p = partition_graph(&program.graph, &cluster("digits"));
    assert_ps_training(&program, &p, &[]);
}

#[test]
fn digits_training_with_slots_keeps_them_on_ps() {
    let sgd = load("digits", "digits.json");
    let base = sgd.training.as_ref().unwrap();
    let loaded = dflow::load::load_graph(&examples().join("digits/digits.json")).unwrap();
    let mut spec = loaded.parsed.def.train.clone().unwrap();
    for (kind, slots) in [
        (
            OptimizerKind::Momentum {
                momentum: 0.9,
                nesterov: false,
            },
            &["momentum"][..],
        ),
        (
            OptimizerKind::Adam {
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-7,
            },
            &["adam_m", "adam_v"][..],
        ),
    ] {
        spec.optimizer.kind = kind;
        let training = expand_training(&loaded.parsed.def, &spec).unwrap();
        assert_eq!(training.gradients, base.gradients);
        let graph = Graph::from_def(&training.def).unwrap();
        let program = Program {
            graph,
            training: Some(training),
        };
        let p = partition_graph(&program.graph, &cluster("digits"));
        assert_ps_training(&program, &p, slots);
        if slots.contains(&"adam_m") {
            let d = device_of(&p, "adam/t").unwrap();
            assert!(on_ps(&d.to_string()), "adam/t is on {d}");
        }
    }
}

#[test]
fn tf_graphdef_fixture_partitions() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/tf/ps_mlp.graphdef.json");
    let program = load_program(&path).unwrap();
    assert!(program.training.is_none());
    let c = ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap();
    let p = partition_graph(&program.graph, &c);
    assert_eq!(p.partitions.len(), 2);
    assert!(!p.pairs.is_empty());
}
