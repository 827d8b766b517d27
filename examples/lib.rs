//! Example graphs built with the dflow library API.
#![warn(missing_docs)]

pub mod word_features;

use dflow::graph::builder::GraphBuilder;
use dflow::graph::{DType, Graph, GraphErrors};

/// Builds the 64-32-10 digits MLP: variables on `/job:ps/task:0`, compute on
/// `/job:worker/task:0` — the same graph as `examples/mlp/mlp.json`.
pub fn mlp() -> Result<Graph, GraphErrors> {
    let mut b = GraphBuilder::new();
    let worker = "/job:worker/task:0";
    let (w1, b1, w2, b2) = b.with_device("/job:ps/task:0", |b| {
        let w1 = b
            .op("Variable", "w1")
            .attr("dtype", DType::F32)
            .attr("shape", dflow::graph::Shape::known(&[64, 32]))
            .attr("initializer", "glorot_uniform")
            .attr("seed", 1i64)
            .finish();
        let b1 = b.variable("b1", DType::F32, &[32], "zeros");
        let w2 = b
            .op("Variable", "w2")
            .attr("dtype", DType::F32)
            .attr("shape", dflow::graph::Shape::known(&[32, 10]))
            .attr("initializer", "glorot_uniform")
            .attr("seed", 2i64)
            .finish();
        let b2 = b.variable("b2", DType::F32, &[10], "zeros");
        (w1, b1, w2, b2)
    });
    b.with_device(worker, |b| {
        let x = b.placeholder("x", DType::F32, &[-1, 64]);
        let labels = b.placeholder("labels", DType::I64, &[-1]);
        let h = b.matmul("layer1/matmul", &x, &w1);
        let h = b.binary("BiasAdd", "layer1/bias", &h, &b1);
        let h = b.unary("Relu", "layer1/relu", &h);
        let l = b.matmul("layer2/matmul", &h, &w2);
        let logits = b.binary("BiasAdd", "logits", &l, &b2);
        b.unary("Softmax", "probs", &logits);
        let xent = b.binary(
            "SparseSoftmaxCrossEntropyWithLogits",
            "xent",
            &logits,
            &labels,
        );
        b.unary("Mean", "loss", &xent);
        let pred = b
            .op("ArgMax", "predictions")
            .input(&logits)
            .attr("axis", 1i64)
            .finish();
        let correct = b.binary("Equal", "correct", &pred, &labels);
        let c = b
            .op("Cast", "correct_f32")
            .input(&correct)
            .attr("DstT", DType::F32)
            .finish();
        b.unary("Mean", "accuracy", &c);
    });
    b.build()
}

/// The bundled character-level GPT (`examples/gpt/gpt.json` and `gpt.dflow`): nanoGPT's
/// `shakespeare_char` CPU configuration built with [`dflow::graph::layers::gpt`], as the JSON
/// and DSL texts of the graph with its training section.
pub fn gpt_files() -> Result<(String, String), String> {
    let model = dflow::graph::layers::gpt(&dflow::graph::layers::GptConfig::default())?;
    Ok((
        dflow::graph::format::to_json(&model.def),
        dflow::graph::format::to_dsl(&model.def),
    ))
}

/// The 100M-parameter GPT of the "too big for one process" demonstration
/// (`examples/gpt/gpt-100m.json`, `tests/big_model/`): 8 blocks of 1,024 channels in 16 heads
/// over a context of 32 characters of the bundled 76-character vocabulary, trained as the
/// bundled GPT is (AdamW, clipping at 1.0) but with no warm-up, so the few demonstration steps
/// move the loss, and a 10× smaller learning rate (1e-4; the bundled GPT's 1e-3 without warm-up
/// makes the loss of this wider model climb). Its [`num_params`](dflow::graph::layers::GptConfig::num_params) is 100,882,432:
/// 16 bytes each with Adam make 1.61 GB of training state, 12 of them (parameters and both
/// moments, 1.21 GB) held as variables by every worker under plain data parallelism.
pub fn gpt_100m_config() -> dflow::graph::layers::GptConfig {
    dflow::graph::layers::GptConfig {
        block_size: 32,
        n_layer: 8,
        n_head: 16,
        n_embd: 1024,
        warmup_steps: 0,
        learning_rate: 1e-4,
        min_lr: 1e-5,
        ..dflow::graph::layers::GptConfig::default()
    }
}

/// [`gpt_100m_config`]'s graph with its training section, as JSON text
/// (`examples/gpt/gpt-100m.json`).
pub fn gpt_100m_json() -> Result<String, String> {
    let model = dflow::graph::layers::gpt(&gpt_100m_config())?;
    Ok(dflow::graph::format::to_json(&model.def))
}

/// The GPT with mixture-of-experts MLPs (`examples/gpt/gpt-moe.json`): [`gpt_files`]'s model
/// with every block's MLP replaced by 4 experts, top-1 routing at capacity factor 1.25 (Switch
/// Transformer's setting) and the load-balancing loss (α = 0.01) added to the training loss, as
/// the JSON text of the graph with its training section.
pub fn gpt_moe_json() -> Result<String, String> {
    let cfg = dflow::graph::layers::GptConfig {
        moe: Some(dflow::graph::layers::MoeConfig::default()),
        ..dflow::graph::layers::GptConfig::default()
    };
    let model = dflow::graph::layers::gpt(&cfg)?;
    Ok(dflow::graph::format::to_json(&model.def))
}
