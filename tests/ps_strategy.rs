//! Parameter-server strategies on the digits example: a synchronous step over two workers, each
//! fed its part of the global batch, computes the same loss and updates as one process training
//! on the whole batch; asynchronous graphs run each worker's replica on its own task.

use dflow::executor::data::Dataset;
use dflow::executor::{Session, SessionOptions};
use dflow::graph::train::{expand_training, TrainSpec, TrainingGraph};
use dflow::graph::{ClusterSpec, DeviceName, DeviceType, Graph, GraphDef, Tensor};
use dflow::partitioner::strategy::{ps_training, PsMode, ReplicaGraph};
use dflow_tests::digits_setup::{data, repo, SEED};
use std::collections::BTreeMap;

/// The digits forward graph and its train section.
fn forward() -> (GraphDef, TrainSpec) {
    let loaded = dflow::load::load_graph(&repo().join("examples/digits/digits.json"))
        .expect("digits.json loads");
    let spec = loaded.parsed.def.train.clone().expect("digits.json trains");
    (loaded.parsed.def, spec)
}

fn session(def: &GraphDef) -> Session {
    let graph = Graph::from_def(def).expect("the graph is valid");
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
    Session::new(graph, cluster, SessionOptions::default()).expect("session starts")
}

fn scalar(t: &Tensor) -> f64 {
    f64::from(t.as_slice::<f32>().unwrap()[0])
}

fn assert_close(what: &str, a: f64, b: f64, rel: f64) {
    assert!(
        (a - b).abs() <= rel * a.abs().max(b.abs()).max(1e-3),
        "{what}: {a} vs {b}"
    );
}

/// Single-process training on the whole global batch.
struct Plain {
    session: Session,
    training: TrainingGraph,
}

impl Plain {
    fn new() -> Plain {
        let (def, spec) = forward();
        let training = expand_training(&def, &spec).unwrap();
        Plain {
            session: session(&training.def),
            training,
        }
    }

    /// One step on `batch`: (loss, accuracy) before the update.
    fn step(&self, (x, y): (Tensor, Tensor)) -> (f64, f64) {
        let out = self
            .session
            .run(
                &[("pixels", x), ("labels", y)],
                &[&self.training.loss, &self.training.metrics[0]],
                &[&self.training.train_op],
            )
            .unwrap();
        (scalar(&out[0]), scalar(&out[1]))
    }
}

/// Synchronous training over two in-graph replicas.
struct Sync {
    session: Session,
    graph: ReplicaGraph,
}

impl Sync {
    fn new() -> Sync {
        let (def, spec) = forward();
        let mut graphs = ps_training(&def, &spec, 2, PsMode::Sync, "pixels", "labels").unwrap();
        assert_eq!(graphs.len(), 1);
        let graph = graphs.remove(0);
        Sync {
            session: session(&graph.training.def),
            graph,
        }
    }

    /// One step on batch `index` of `epoch`, each replica fed its part and weight n_i / n.
    fn step(&self, data: &Dataset, batch: usize, epoch: u64, index: usize) -> (f64, f64) {
        let n = (data.len() - index * batch).min(batch);
        let parts = self.graph.replicas.len();
        let mut feeds: Vec<(&str, Tensor)> = Vec::new();
        for r in &self.graph.replicas {
            let (x, y) = data
                .batch_part(batch, SEED, epoch, index, r.worker, parts)
                .unwrap();
            let weight = x.dims()[0] as f32 / n as f32;
            feeds.push((&r.features, x));
            feeds.push((&r.labels, y));
            feeds.push((r.weight.as_deref().unwrap(), Tensor::scalar(weight)));
        }
        let t = &self.graph.training;
        let out = self
            .session
            .run(&feeds, &[&t.loss, &t.metrics[0]], &[&t.train_op])
            .unwrap();
        (scalar(&out[0]), scalar(&out[1]))
    }
}

fn variables(s: &Session) -> BTreeMap<String, Vec<f32>> {
    s.variables()
        .into_iter()
        .map(|(_, name, t)| (name, t.as_slice::<f32>().unwrap().to_vec()))
        .collect()
}

/// Trains both ways over the given (epoch, batch index) schedule and compares every step's loss
/// and accuracy, then the variables.
fn sync_matches_plain(batch: usize, schedule: &[(u64, usize)]) {
    let (train, _) = data();
    let plain = Plain::new();
    let sync = Sync::new();
    for (step, &(epoch, index)) in schedule.iter().enumerate() {
        let whole = train
            .batches(batch, Some(SEED), epoch, false)
            .unwrap()
            .nth(index)
            .unwrap()
            .unwrap();
        let (plain_loss, plain_acc) = plain.step(whole);
        let (sync_loss, sync_acc) = sync.step(&train, batch, epoch, index);
        let at = format!("step {step} (epoch {epoch}, batch {index} of size {batch})");
        assert_close(&format!("loss at {at}"), sync_loss, plain_loss, 1e-5);
        assert_close(&format!("accuracy at {at}"), sync_acc, plain_acc, 1e-5);
    }
    let (a, b) = (variables(&plain.session), variables(&sync.session));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        ["b1", "b2", "w1", "w2"],
        "plain variables"
    );
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, x) in &a {
        for (i, (p, q)) in x.iter().zip(&b[name]).enumerate() {
            assert_close(&format!("{name}[{i}]"), f64::from(*q), f64::from(*p), 1e-4);
        }
    }
}

#[test]
fn sync_ps_training_equals_single_process_training() {
    // 20 steps of the CLI's schedule: batch 32, seed 0, epoch 0 (parts of 16 + 16).
    let schedule: Vec<(u64, usize)> = (0..20).map(|i| (0, i)).collect();
    sync_matches_plain(32, &schedule);
}

#[test]
fn sync_matches_with_odd_and_short_batches_across_an_epoch_end() {
    // 1438 examples in batches of 31: parts of 16 + 15, and the last batch of 12 (6 + 6).
    let (train, _) = data();
    assert_eq!(train.len(), 1438);
    assert_eq!(train.num_batches(31, false), 47);
    let schedule: Vec<(u64, usize)> = (40..47)
        .map(|i| (0, i))
        .chain((0..4).map(|i| (1, i)))
        .collect();
    sync_matches_plain(31, &schedule);
}

#[test]
fn sync_replicas_run_on_their_workers_and_share_variables_on_ps() {
    let sync = Sync::new();
    let placed = sync.session.placed();
    let on = |name: &str| {
        placed
            .device_of(name)
            .unwrap_or_else(|| panic!("no node {name}"))
    };
    for i in 0..2u32 {
        let worker = DeviceName::full("worker", i, DeviceType::CPU, 0);
        for n in [
            "pixels",
            "layer1/matmul",
            "logits",
            "loss",
            "accuracy",
            "batch_weight",
        ] {
            assert_eq!(on(&format!("replica_{i}/{n}")), &worker, "replica_{i}/{n}");
        }
    }
    let ps = DeviceName::full("ps", 0, DeviceType::CPU, 0);
    for (var, grad) in &sync.graph.training.gradients {
        assert_eq!(on(var), &ps);
        assert_eq!(
            on(grad.split(':').next().unwrap()),
            &ps,
            "summed gradient of {var}"
        );
        assert_eq!(on(&format!("train/{var}/update")), &ps);
    }
    assert_eq!(
        on("loss"),
        &DeviceName::full("worker", 0, DeviceType::CPU, 0)
    );

    // Evaluation feeds replica 0 whole batches, unweighted.
    let (_, test) = data();
    let (x, y) = test.to_tensors().unwrap();
    let eval = &sync.graph.eval;
    let out = sync
        .session
        .run(
            &[(&eval.features, x.clone()), (&eval.labels, y.clone())],
            &[&eval.loss, &eval.metrics[0]],
            &[],
        )
        .unwrap();
    let plain = Plain::new();
    let want = plain
        .session
        .run(&[("pixels", x), ("labels", y)], &["loss", "accuracy"], &[])
        .unwrap();
    assert_close("eval loss", scalar(&out[0]), scalar(&want[0]), 1e-6);
    assert_close("eval accuracy", scalar(&out[1]), scalar(&want[1]), 1e-6);
}

#[test]
fn async_graphs_put_each_replica_on_its_worker() {
    let (def, spec) = forward();
    let graphs = ps_training(&def, &spec, 2, PsMode::Async, "pixels", "labels").unwrap();
    assert_eq!(graphs.len(), 2);
    let (train, _) = data();
    let batch = train
        .batches(32, Some(SEED), 0, false)
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    let mut losses = vec![];
    for (i, g) in graphs.iter().enumerate() {
        assert_eq!(g.replicas.len(), 1);
        assert_eq!(g.replicas[0].worker, i);
        assert_eq!(g.replicas[0].weight, None);
        let s = session(&g.training.def);
        let placed = s.placed();
        let worker = DeviceName::full("worker", i as u32, DeviceType::CPU, 0);
        for n in [
            "pixels",
            "labels",
            "layer1/matmul",
            "logits",
            "loss",
            "accuracy",
        ] {
            assert_eq!(placed.device_of(n), Some(&worker), "graph {i}: {n}");
        }
        assert_eq!(placed.device_of(&g.training.train_op), Some(&worker));
        let vars: Vec<&str> = g
            .training
            .gradients
            .iter()
            .map(|(v, _)| v.as_str())
            .collect();
        assert_eq!(
            vars,
            ["w1", "b1", "w2", "b2"],
            "graph {i} trains the shared variables"
        );
        for v in vars {
            assert_eq!(
                placed.device_of(v),
                Some(&DeviceName::full("ps", 0, DeviceType::CPU, 0))
            );
        }
        // Each graph trains on its own: two steps on one batch lower its loss.
        let feeds = || {
            vec![
                (g.replicas[0].features.as_str(), batch.0.clone()),
                (g.replicas[0].labels.as_str(), batch.1.clone()),
            ]
        };
        let t = &g.training;
        let first = s.run(&feeds(), &[&t.loss], &[&t.train_op]).unwrap();
        let second = s.run(&feeds(), &[&t.loss], &[&t.train_op]).unwrap();
        assert!(scalar(&second[0]) < scalar(&first[0]));
        losses.push(scalar(&first[0]));
    }
    // Same variables, same initializers: both workers start from the same model.
    assert_eq!(losses[0], losses[1]);
}
