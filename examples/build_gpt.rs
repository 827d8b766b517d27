//! Builds the character-level GPT with the layer library and writes it as
//! `examples/gpt/gpt.json` and `examples/gpt/gpt.dflow` (what `dflow run` trains), and the same
//! GPT with mixture-of-experts MLPs as `examples/gpt/gpt-moe.json`, and the 100M-parameter GPT
//! of the memory-limit demonstration (`tests/big_model/`) as `examples/gpt/gpt-100m.json`.
//!
//! Run: `cargo run -p dflow-examples --example build_gpt [-- OUT_DIR]`. The committed files are
//! checked against this program's output by `tests/gpt_files.rs`, so they never drift.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/gpt").into());
    let (json, dsl) = dflow_examples::gpt_files()?;
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("gpt.json"), json)?;
    std::fs::write(dir.join("gpt.dflow"), dsl)?;
    std::fs::write(dir.join("gpt-moe.json"), dflow_examples::gpt_moe_json()?)?;
    std::fs::write(dir.join("gpt-100m.json"), dflow_examples::gpt_100m_json()?)?;
    let cfg = dflow::graph::layers::GptConfig::default();
    println!(
        "wrote {}/gpt.json and gpt.dflow: {} layers, {} heads, {} channels, context {}, vocabulary {}, {} parameters",
        dir.display(),
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        cfg.block_size,
        cfg.vocab_size,
        cfg.num_params()
    );
    let moe = dflow::graph::layers::MoeConfig::default();
    let moe_cfg = dflow::graph::layers::GptConfig {
        moe: Some(moe.clone()),
        ..cfg
    };
    println!(
        "wrote {}/gpt-moe.json: the same GPT with {} experts per MLP, top-{}, capacity factor {}, \
         load-balancing loss coefficient {}, {} parameters",
        dir.display(),
        moe.num_experts,
        moe.top_k,
        moe.capacity_factor,
        moe.aux_loss_coef,
        moe_cfg.num_params()
    );
    let big = dflow_examples::gpt_100m_config();
    println!(
        "wrote {}/gpt-100m.json: {} layers, {} heads, {} channels, context {}, {} parameters",
        dir.display(),
        big.n_layer,
        big.n_head,
        big.n_embd,
        big.block_size,
        big.num_params()
    );
    Ok(())
}
