//! Tests of the pipeline's evaluation: where it runs, what crosses between tasks.

use super::super::schedule::ScheduleKind;
use super::super::Pipeline;
use crate::job::{task_name, JobPlan};
use crate::strategy::{JobInput, Strategy};
use dflow_graph::layers::{gpt, GptConfig};
use dflow_graph::{AttrValue, ClusterSpec, Graph, Shape};
use std::collections::BTreeSet;

/// A small GPT (4-token windows, 8 channels) whose placeholders take any batch.
fn model(tie_weights: bool) -> (Graph, dflow_graph::train::TrainSpec) {
    let cfg = GptConfig {
        vocab_size: 11,
        block_size: 4,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        tie_weights,
        ..GptConfig::default()
    };
    let mut m = gpt(&cfg).unwrap();
    let spec = m.def.train.clone().unwrap();
    for n in &mut m.def.nodes {
        if n.op == "Placeholder" {
            n.attrs.insert(
                "shape".into(),
                AttrValue::Shape(Shape::partial(vec![None, Some(4)])),
            );
        }
    }
    (Graph::from_def(&m.def).unwrap(), spec)
}

/// The plan of `model(tie_weights)` on `workers` workers, 2 balanced stages, a global
/// batch of 4 in 2 micro-batches.
fn plan(tie_weights: bool, workers: u32) -> (Graph, JobPlan) {
    let (graph, spec) = model(tie_weights);
    let cluster = ClusterSpec::local(&[("worker", workers)]).unwrap();
    let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
    let plan = Pipeline {
        stages: Some(2),
        micro_batches: 2,
        schedule: ScheduleKind::OneFOneB,
        chunks: 1,
        batch_size: Some(4),
    }
    .plan(&input)
    .unwrap();
    (graph, plan)
}

/// The evaluation signature's pairs between tasks: (tensor, bytes).
fn crossing(plan: &JobPlan) -> Vec<(String, Option<usize>)> {
    plan.eval_signature()
        .unwrap()
        .partitions
        .pairs
        .iter()
        .filter(|p| !p.client_terminated && !p.is_control)
        .map(|p| (p.tensor_name.to_string(), p.bytes))
        .collect()
}

#[test]
fn evaluation_runs_on_each_stage_and_sends_activations_only() {
    // dp2×pp2: replica 0's stages are workers 0 and 2.
    let (graph, plan) = plan(false, 4);
    let eval = plan.eval_signature().unwrap();
    let tasks: Vec<String> = eval.tasks().unwrap().into_iter().collect();
    assert_eq!(tasks, [task_name("worker", 0), task_name("worker", 2)]);
    // The chief feeds the batch and fetches the loss.
    assert!(eval.feeds.iter().all(|f| f.task == task_name("worker", 0)));
    assert_eq!(eval.fetch_task.as_deref(), Some(&*task_name("worker", 0)));
    assert_eq!(eval.fetches, ["eval/pipeline/fetch/loss:0"]);
    // Each stage evaluates with its own weights: every variable the evaluation reads is
    // in the partition of the task that holds it, and none crosses.
    let variables: BTreeSet<&str> = graph
        .node_indices()
        .map(|i| graph.node(i))
        .filter(|n| n.op_def().is_variable)
        .map(|n| n.name.as_str())
        .collect();
    let cross = crossing(&plan);
    let weights: Vec<_> = cross
        .iter()
        .filter(|(t, _)| variables.contains(t.split(':').next().unwrap()))
        .collect();
    assert!(weights.is_empty(), "weights cross: {weights:?}");
    // What crosses is the evaluation's own: stage 0's residual stream (4 rows × 4 tokens
    // × 8 channels, padded to the global batch) and its rows, the labels (4 × 4 ids) and
    // their rows to the last stage, and the loss back to the chief.
    assert!(
        cross
            .iter()
            .all(|(t, _)| t.starts_with("eval/pipeline/cross/") || t == "eval/loss:0"),
        "{cross:?}"
    );
    let padded: Vec<_> = cross
        .iter()
        .filter(|(t, _)| t.ends_with("/padded:0"))
        .collect();
    assert!(!padded.is_empty(), "{cross:?}");
    assert!(
        padded
            .iter()
            .any(|(t, b)| t.contains("eval/targets") && *b == Some(4 * 4 * 8)),
        "{padded:?}"
    );
    assert!(
        padded
            .iter()
            .any(|(t, b)| !t.contains("eval/targets") && *b == Some(4 * 4 * 8 * 4)),
        "{padded:?}"
    );
    assert_eq!(
        cross.iter().filter(|(t, _)| t.ends_with("/rows:0")).count(),
        padded.len()
    );
    assert!(cross.contains(&("eval/loss:0".to_string(), Some(4))));
    // Every weight read by an evaluation op is on that op's device.
    for part in eval.partitions.partitions.values() {
        let def = part.graph.to_def();
        let here: BTreeSet<&str> = def.nodes.iter().map(|n| n.name.as_str()).collect();
        for n in def.nodes.iter().filter(|n| n.name.starts_with("eval/")) {
            for i in &n.inputs {
                let src = i.trim_start_matches('^').split(':').next().unwrap();
                if variables.contains(src) {
                    assert!(here.contains(src), "{} reads {src} from elsewhere", n.name);
                }
            }
        }
    }
}

#[test]
fn a_tied_embedding_is_the_only_weight_the_evaluation_sends_as_training_does() {
    // The head on the last stage reads the first stage's `wte`: it crosses once per
    // evaluation batch, as once per training step; nothing else.
    let (graph, plan) = plan(true, 2);
    let variables: BTreeSet<&str> = graph
        .node_indices()
        .map(|i| graph.node(i))
        .filter(|n| n.op_def().is_variable)
        .map(|n| n.name.as_str())
        .collect();
    let weights: Vec<String> = crossing(&plan)
        .into_iter()
        .map(|(t, _)| t)
        .filter(|t| variables.contains(t.split(':').next().unwrap()))
        .collect();
    assert_eq!(weights.len(), 1, "{weights:?}");
    let train: BTreeSet<String> = plan
        .train_signatures()
        .flat_map(|s| s.partitions.pairs.iter())
        .map(|p| p.tensor_name.to_string())
        .collect();
    assert!(train.contains(&weights[0]), "{weights:?}");
}

#[test]
fn one_stage_per_worker_evaluates_in_the_one_process_graph_too() {
    // The single-replica graph (what `--local` runs in one process) has the same
    // evaluation: placeholders of any batch on the chief, copies on their stages.
    let (graph, spec) = model(false);
    let cluster = ClusterSpec::local(&[("worker", 2)]).unwrap();
    let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
    let pipeline = Pipeline {
        stages: Some(2),
        micro_batches: 2,
        schedule: ScheduleKind::GPipe,
        chunks: 1,
        batch_size: Some(4),
    };
    let (g, _) = pipeline.training_graph(&input).unwrap();
    let nodes = &g.training.def.nodes;
    let find = |name: &str| nodes.iter().find(|n| n.name == name).unwrap();
    let worker = super::super::worker_device;
    assert_eq!(find("eval/idx").device, worker(0));
    assert_eq!(find("eval/targets").device, worker(0));
    assert_eq!(
        find("eval/idx").attrs.get("shape"),
        Some(&AttrValue::Shape(Shape::partial(vec![None, Some(4)])))
    );
    let devices: BTreeSet<&str> = nodes
        .iter()
        .filter(|n| n.name.starts_with("eval/"))
        .map(|n| n.device.as_str())
        .collect();
    assert_eq!(devices.len(), 2, "{devices:?}");
    assert_eq!(g.eval.loss, "eval/pipeline/fetch/loss");
    assert_eq!(find("eval/pipeline/fetch/loss").device, worker(0));
}

#[test]
fn under_dp2_tp2_pp2_each_rank_of_replica_0_evaluates_its_stages_on_its_shards() {
    // Megatron-core's order at d = t = p = 2: replica 0 is workers 0, 1 (stage 0) and 4, 5
    // (stage 1).
    let (graph, spec) = model(false);
    let cluster = ClusterSpec::local(&[("worker", 8)]).unwrap();
    let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
    let tensor = |zero_stage| crate::strategy::tensor::TensorParallel {
        tp: Some(2),
        bucket_bytes: 1 << 20,
        batch_size: Some(8),
        pipeline: Some(Pipeline {
            stages: Some(2),
            micro_batches: 2,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
            batch_size: Some(8),
        }),
        zero_stage,
    };
    for zero_stage in [None, Some(1)] {
        let plan = tensor(zero_stage).plan(&input).unwrap();
        let eval = plan.eval_signature().unwrap();
        let tasks: Vec<String> = eval.tasks().unwrap().into_iter().collect();
        let w = |i: u32| task_name("worker", i);
        assert_eq!(tasks, [w(0), w(1), w(4), w(5)], "{zero_stage:?}");
        assert!(eval.feeds.iter().all(|f| f.task == w(0)));
        assert_eq!(eval.fetch_task.as_deref(), Some(&*w(0)));
        // No tensor-parallel shard crosses; what crosses is the evaluation's own (the
        // batch, the residual stream, the loss) and a few replicated weights that rank 1
        // reads from rank 0's copies (layer norms, biases).
        let cross = crossing(&plan);
        assert!(cross.iter().all(|(t, _)| !t.contains("/tp_")), "{cross:?}");
        let variables: BTreeSet<&str> = graph
            .node_indices()
            .map(|i| graph.node(i))
            .filter(|n| n.op_def().is_variable)
            .map(|n| n.name.as_str())
            .collect();
        let weights: Vec<&str> = cross
            .iter()
            .map(|(t, _)| t.split(':').next().unwrap())
            .filter(|n| variables.contains(n))
            .collect();
        assert!(!weights.is_empty());
        assert!(
            weights.iter().all(|w| w.contains(".ln_")
                || w.ends_with(".bias")
                || *w == "transformer.wpe.weight"),
            "{weights:?}"
        );
        // The activations between stages: each rank's residual stream, 8 rows (the
        // placeholders take whole batches, so nothing is padded).
        assert!(
            cross.iter().all(|(t, _)| !t.ends_with("/padded:0")),
            "{cross:?}"
        );
        let activations: Vec<_> = cross
            .iter()
            .filter(|(t, _)| t.contains("mlp_residual"))
            .collect();
        assert_eq!(activations.len(), 2, "{cross:?}");
        assert!(activations.iter().all(|(_, b)| *b == Some(8 * 4 * 8 * 4)));
        // Every rank's collectives of the evaluation are in its stage's group, at keys
        // beyond the training step's, and the ranks of a stage call the same ones.
        let train_max = plan
            .train_signatures()
            .flat_map(|s| s.partitions.partitions.values())
            .flat_map(|p| p.graph.to_def().nodes)
            .filter_map(|n| match n.attrs.get("instance_key") {
                Some(AttrValue::Int(k)) => Some(*k),
                _ => None,
            })
            .max()
            .unwrap();
        let keys = |task: u32| -> Vec<(String, i64)> {
            let (_, part) = eval
                .partitions
                .partitions
                .iter()
                .find(|(d, _)| d.task == Some(task))
                .unwrap();
            let mut keys: Vec<(String, i64)> = part
                .graph
                .to_def()
                .nodes
                .iter()
                .filter(|n| n.op.starts_with("Collective"))
                .map(
                    |n| match (n.attrs.get("group_key"), n.attrs.get("instance_key")) {
                        (Some(AttrValue::String(g)), Some(AttrValue::Int(k))) => {
                            (g.to_string(), *k)
                        }
                        _ => panic!("{} has no keys", n.name),
                    },
                )
                .collect();
            keys.sort();
            keys
        };
        for (a, b, group) in [(0, 1, "tensor_s0_d0"), (4, 5, "tensor_s1_d0")] {
            assert!(!keys(a).is_empty());
            assert_eq!(keys(a), keys(b));
            assert!(keys(a).iter().all(|(g, k)| g == group && *k > train_max));
        }
    }
}

#[test]
fn under_dp2_tp2_pp2_zero3_each_stage_joins_its_flat_shards_and_sends_activations_only() {
    // Replica 0 is workers 0, 1 (stage 0) and 4, 5 (stage 1); replica 1's flat shards of a
    // stage's weights are on workers 2, 3 (stage 0) and 6, 7 (stage 1).
    let (graph, spec) = model(false);
    let cluster = ClusterSpec::local(&[("worker", 8)]).unwrap();
    let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
    let pipeline = Pipeline {
        stages: Some(2),
        micro_batches: 2,
        schedule: ScheduleKind::OneFOneB,
        chunks: 1,
        batch_size: Some(8),
    };
    let plan = crate::strategy::tensor::TensorParallel {
        tp: Some(2),
        bucket_bytes: 1 << 20,
        batch_size: Some(8),
        pipeline: Some(pipeline),
        zero_stage: Some(3),
    }
    .plan(&input)
    .unwrap();
    let eval = plan.eval_signature().unwrap();
    let w = |i: u32| task_name("worker", i);
    let tasks: Vec<String> = eval.tasks().unwrap().into_iter().collect();
    assert_eq!(
        tasks,
        [0, 1, 2, 3, 4, 5, 6, 7].map(w),
        "every flat shard is read"
    );
    assert!(eval.feeds.iter().all(|f| f.task == w(0)));
    assert_eq!(eval.fetch_task.as_deref(), Some(&*w(0)));
    // The ops of the evaluation run on replica 0's stage workers only.
    let mut evaluating = BTreeSet::new();
    for (d, part) in &eval.partitions.partitions {
        if part
            .graph
            .to_def()
            .nodes
            .iter()
            .any(|n| n.name.starts_with("eval/") && n.op != "Variable")
        {
            evaluating.insert(d.task.unwrap());
        }
    }
    assert_eq!(evaluating, BTreeSet::from([0, 1, 4, 5]));
    let variables: BTreeSet<String> = eval
        .partitions
        .partitions
        .values()
        .flat_map(|p| p.graph.to_def().nodes)
        .filter(|n| n.op == "Variable")
        .map(|n| n.name)
        .collect();
    let consts: BTreeSet<String> = eval
        .partitions
        .partitions
        .values()
        .flat_map(|p| p.graph.to_def().nodes)
        .filter(|n| n.op == "Const")
        .map(|n| n.name)
        .collect();
    let task = |d: &str| dflow_graph::DeviceName::parse(d).unwrap().task.unwrap();
    let stage = |t: u32| t / 4;
    let pairs: Vec<_> = eval
        .partitions
        .pairs
        .iter()
        .filter(|p| !p.client_terminated && !p.is_control)
        .collect();
    let mut within = 0;
    let mut between = Vec::new();
    for p in &pairs {
        let node = p.tensor_name.split(':').next().unwrap();
        let (from, to) = (task(&p.send_device), task(&p.recv_device));
        if stage(from) == stage(to) {
            within += usize::from(variables.contains(node));
        } else {
            between.push(p.tensor_name.to_string());
            // Between stages: the evaluation's own tensors (and the training graph's
            // constants it reads, the vocabulary's ids), never a weight or its join.
            assert!(!variables.contains(node), "{node} crosses stages");
            assert!(!node.starts_with("eval/zero3/"), "{node} crosses stages");
            assert!(
                node.starts_with("eval/") || consts.contains(node),
                "{node} crosses stages"
            );
        }
    }
    // Replica 1's flat shards go to replica 0's worker of their stage.
    assert!(within > 0);
    // Each rank's residual stream goes to its next stage (8 rows, whole batches).
    assert!(
        between
            .iter()
            .filter(|t| t.contains("mlp_residual"))
            .count()
            == 2,
        "{between:?}"
    );
    assert!(
        between.iter().all(|t| !t.ends_with("/padded:0")),
        "{between:?}"
    );
}

#[test]
fn a_crossing_tensor_of_no_static_size_keeps_the_evaluation_joined_on_worker_0() {
    // Placeholders of windows of any length: the residual stream between the stages is
    // `[?, ?, 8]`, no static size holds it, so worker 0 evaluates reading stage 1's weights.
    let (graph, spec) = model(false);
    let mut def = graph.to_def();
    for n in def.nodes.iter_mut().filter(|n| n.op == "Placeholder") {
        n.attrs.insert(
            "shape".into(),
            AttrValue::Shape(Shape::partial(vec![None, None])),
        );
    }
    let graph = Graph::from_def(&def).unwrap();
    let cluster = ClusterSpec::local(&[("worker", 2)]).unwrap();
    let input = JobInput::new(&graph, &spec, &cluster, "idx", "targets");
    let pipeline = Pipeline {
        stages: Some(2),
        micro_batches: 2,
        schedule: ScheduleKind::OneFOneB,
        chunks: 1,
        batch_size: Some(4),
    };
    let (g, _) = pipeline.training_graph(&input).unwrap();
    let worker = super::super::worker_device;
    let eval: Vec<_> = (g.training.def.nodes.iter())
        .filter(|n| n.name.starts_with("eval/"))
        .collect();
    assert!(!eval.is_empty());
    assert!(eval.iter().all(|n| n.device == worker(0)));
    assert!(eval.iter().all(|n| !n.name.starts_with("eval/pipeline/")));
    assert_eq!(g.eval.loss, format!("eval/{}", spec.loss));
    // Stage 1's weights are read where they live, on worker 1.
    let variables: BTreeSet<&str> = (g.training.def.nodes.iter())
        .filter(|n| n.op == "Variable" && n.device == worker(1))
        .map(|n| n.name.as_str())
        .collect();
    assert!(!variables.is_empty());
    assert!(eval.iter().any(|n| n
        .inputs
        .iter()
        .any(|i| variables.contains(i.split(':').next().unwrap()))));
}

#[test]
fn a_fetched_tensor_of_no_static_shape_keeps_the_evaluation_joined_on_worker_0() {
    // The digits MLP on 2 stages: its loss and accuracy are scalars, so the evaluation
    // runs on both stages; with the logits (`[?, 10]`, on the last stage) as a metric,
    // which cannot be sent to the chief at a static size, it stays on worker 0.
    let text = include_str!("../../../../../examples/digits/digits.json");
    let def = dflow_graph::format::parse_json(text, None).unwrap().def;
    let graph = Graph::from_def(&def).unwrap();
    let cluster = ClusterSpec::local(&[("worker", 2)]).unwrap();
    let pipeline = Pipeline {
        stages: Some(2),
        micro_batches: 2,
        schedule: ScheduleKind::OneFOneB,
        chunks: 1,
        batch_size: Some(32),
    };
    let mut spec = def.train.clone().unwrap();
    let tasks = |spec: &dflow_graph::train::TrainSpec| -> Vec<String> {
        let input = JobInput::new(&graph, spec, &cluster, "pixels", "labels");
        let plan = pipeline.plan(&input).unwrap();
        let eval = plan.eval_signature().unwrap();
        eval.tasks().unwrap().into_iter().collect()
    };
    let w = |i: u32| task_name("worker", i);
    assert_eq!(tasks(&spec), [w(0), w(1)]);
    spec.metrics.push("logits".into());
    assert_eq!(
        tasks(&spec),
        [w(0), w(1)],
        "worker 1 still sends its weights"
    );
    let input = JobInput::new(&graph, &spec, &cluster, "pixels", "labels");
    let plan = pipeline.plan(&input).unwrap();
    let eval = plan.eval_signature().unwrap();
    assert_eq!(
        eval.fetches,
        ["eval/loss:0", "eval/accuracy:0", "eval/logits:0"]
    );
    // Joined: every evaluation op on worker 0, the weights of stage 1 sent to it.
    let (_, part) = eval
        .partitions
        .partitions
        .iter()
        .find(|(d, _)| d.task == Some(1))
        .unwrap();
    assert!(part
        .graph
        .to_def()
        .nodes
        .iter()
        .all(|n| !n.name.starts_with("eval/")));
    assert!(crossing(&plan).iter().any(|(t, _)| t == "w2:0"));
}
