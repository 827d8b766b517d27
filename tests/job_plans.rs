//! Snapshot tests of the job plans `dflow partition --strategy S` prints (and `dflow run`
//! executes) for the digits training graph: every registered strategy on a cluster it fits.

use dflow::load::load_graph;
use dflow_graph::ClusterSpec;
use dflow_partitioner::{render_job_text, JobInput, StrategyKind, StrategyOptions};
use std::path::PathBuf;

fn digits_plan(strategy: &str, cluster: ClusterSpec, options: &StrategyOptions) -> String {
    plan_of("digits.json", strategy, cluster, options)
}

/// The plan of `examples/digits/{file}` under `strategy`.
fn plan_of(file: &str, strategy: &str, cluster: ClusterSpec, options: &StrategyOptions) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/digits")
        .join(file);
    let loaded = load_graph(&path).unwrap();
    let train = loaded.parsed.def.train.clone().unwrap();
    let strategy = strategy
        .parse::<StrategyKind>()
        .unwrap()
        .build(options)
        .unwrap();
    let input = JobInput::new(&loaded.graph, &train, &cluster, "pixels", "labels");
    render_job_text(&strategy.plan(&input).unwrap())
}

#[test]
fn digits_sync_ps_on_two_workers() {
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
    insta::assert_snapshot!(digits_plan("ps", cluster, &StrategyOptions::default()));
}

#[test]
fn digits_async_ps_on_two_workers() {
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
    let options = StrategyOptions {
        asynchronous: true,
        ..StrategyOptions::default()
    };
    insta::assert_snapshot!(digits_plan("ps", cluster, &options));
}

#[test]
fn digits_allreduce_on_two_workers() {
    let cluster = ClusterSpec::local(&[("worker", 2)]).unwrap();
    insta::assert_snapshot!(digits_plan(
        "allreduce",
        cluster,
        &StrategyOptions::default()
    ));
}

#[test]
fn digits_adamw_zero_stage_2_on_two_workers() {
    // The Adam slots are split in halves, one per worker; the parameters are on both.
    let cluster = ClusterSpec::local(&[("worker", 2)]).unwrap();
    let options = StrategyOptions {
        zero_stage: 2,
        ..StrategyOptions::default()
    };
    insta::assert_snapshot!(plan_of("digits-adamw.json", "zero", cluster, &options));
}

#[test]
fn tiny_moe_gpt_expert_parallel_on_two_workers() {
    // One block with 4 experts: 2 on each worker, tokens moved by all-to-all; worker 1 sends its
    // expert shards to worker 0 when it evaluates.
    use dflow_graph::layers::{gpt, GptConfig, MoeConfig};
    let cfg = GptConfig {
        vocab_size: 11,
        block_size: 4,
        n_layer: 1,
        n_head: 2,
        n_embd: 8,
        grad_clip: None,
        moe: Some(MoeConfig {
            num_experts: 4,
            ..MoeConfig::default()
        }),
        ..GptConfig::default()
    };
    let model = gpt(&cfg).unwrap();
    let train = model.def.train.clone().unwrap();
    let graph = dflow_graph::Graph::from_def(&model.def).unwrap();
    let cluster = ClusterSpec::local(&[("worker", 2)]).unwrap();
    let strategy = "expert"
        .parse::<StrategyKind>()
        .unwrap()
        .build(&StrategyOptions::default())
        .unwrap();
    let input = JobInput::new(&graph, &train, &cluster, "idx", "targets");
    insta::assert_snapshot!(render_job_text(&strategy.plan(&input).unwrap()));
}

#[test]
fn tiny_gpt_tensor_parallel_on_two_workers() {
    // One block split over 2 workers (Megatron); every worker feeds whole batches (part 0), and
    // worker 1 sends its shards to worker 0 when it evaluates.
    use dflow_graph::layers::{gpt, GptConfig};
    let cfg = GptConfig {
        vocab_size: 11,
        block_size: 4,
        n_layer: 1,
        n_head: 2,
        n_embd: 8,
        ..GptConfig::default()
    };
    let model = gpt(&cfg).unwrap();
    let train = model.def.train.clone().unwrap();
    let graph = dflow_graph::Graph::from_def(&model.def).unwrap();
    let cluster = ClusterSpec::local(&[("worker", 2)]).unwrap();
    let strategy = "tensor"
        .parse::<StrategyKind>()
        .unwrap()
        .build(&StrategyOptions {
            tp: Some(2),
            ..StrategyOptions::default()
        })
        .unwrap();
    let input = JobInput::new(&graph, &train, &cluster, "idx", "targets");
    insta::assert_snapshot!(render_job_text(&strategy.plan(&input).unwrap()));
}
