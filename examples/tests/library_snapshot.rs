//! Snapshot tests of how dflow partitions my model: any change to placement, Send/Recv pairs or
//! buffer sizes shows up as a diff to review (`cargo insta review`).

use dflow::prelude::*;

/// My model: a two-layer MLP, its variables on the parameter server.
fn my_model() -> Graph {
    let mut b = GraphBuilder::new();
    let (w1, w2) = b.with_device("/job:ps/task:0", |b| {
        let w1 = b.variable("w1", DType::F32, &[8, 16], "glorot_uniform");
        let w2 = b.variable("w2", DType::F32, &[16, 1], "glorot_uniform");
        (w1, w2)
    });
    b.with_device("/job:worker/task:0", |b| {
        let x = b.placeholder("x", DType::F32, &[32, 8]);
        let y = b.placeholder("y", DType::F32, &[32, 1]);
        let h = b.matmul("hidden", &x, &w1);
        let h = b.unary("Relu", "relu", &h);
        let p = b.matmul("prediction", &h, &w2);
        let d = b.binary("Sub", "error", &p, &y);
        let sq = b.binary("Mul", "squared", &d, &d);
        b.op("Mean", "loss").input(&sq).finish();
    });
    b.build().expect("my model is valid")
}

#[test]
fn my_model_partitions_as_reviewed() {
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap();
    let placed = place(&my_model(), &cluster, &PlacementOptions::default()).unwrap();
    let parts = partition(&placed, &PartitionOptions::default()).unwrap();
    insta::assert_snapshot!(render_text(&parts));
}

#[test]
fn my_training_job_plans_as_reviewed() {
    let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
    let train = TrainSpec::new(
        "loss",
        OptimizerSpec {
            kind: OptimizerKind::Sgd,
            lr: 0.05,
        },
    );
    let strategy = "ps"
        .parse::<StrategyKind>()
        .unwrap()
        .build(&StrategyOptions::default())
        .unwrap();
    let model = my_model();
    let plan = strategy
        .plan(&JobInput::new(&model, &train, &cluster, "x", "y"))
        .unwrap();
    insta::assert_snapshot!(render_job_text(&plan));
}
