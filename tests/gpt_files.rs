//! The committed GPT graph files are what the layer library builds today
//! (`cargo run -p dflow-examples --example build_gpt` rewrites them), and the 100M-parameter
//! GPT has exactly the parameters its documentation counts.

use std::path::Path;

#[test]
fn committed_gpt_files_equal_the_layer_librarys_output() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/gpt");
    let (json, dsl) = dflow_examples::gpt_files().unwrap();
    let moe = dflow_examples::gpt_moe_json().unwrap();
    let big = dflow_examples::gpt_100m_json().unwrap();
    for (file, want) in [
        ("gpt.json", json),
        ("gpt.dflow", dsl),
        ("gpt-moe.json", moe),
        ("gpt-100m.json", big),
    ] {
        let have = std::fs::read_to_string(dir.join(file)).unwrap();
        assert!(
            have == want,
            "examples/gpt/{file} differs from the layer library's GPT; run \
             `cargo run -p dflow-examples --example build_gpt` and commit the result"
        );
    }
}

/// The demonstration GPT's variables (its parameters, before the training section adds the
/// optimizer's slots) hold 100,882,432 elements, as `GptConfig::num_params` and
/// tests/big_model/README.md count them: at least 100M, and 16 bytes each with Adam do not fit
/// the demonstration's 1 GB limit while a quarter of them does.
#[test]
fn the_100m_gpt_has_100_882_432_parameters() {
    let cfg = dflow_examples::gpt_100m_config();
    let model = dflow::graph::layers::gpt(&cfg).unwrap();
    let counted: usize = model
        .def
        .nodes
        .iter()
        .filter(|n| n.op == "Variable")
        .map(|n| match n.attrs.get("shape") {
            Some(dflow::graph::AttrValue::Shape(s)) => s.num_elements().unwrap(),
            other => panic!("variable {} has shape {other:?}", n.name),
        })
        .sum();
    assert_eq!(counted, 100_882_432);
    assert_eq!(cfg.num_params(), counted);
}
