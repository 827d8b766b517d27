//! `dflow check` and `dflow convert`, driven through the real binary.

use dflow::graph::format::{parse_dsl, parse_json};

mod support;
use support::{dflow, repo, scratch, stdout};

/// Every example graph, as (JSON, DSL) paths relative to the repository.
const EXAMPLES: &[(&str, &str)] = &[
    ("examples/mlp/mlp.json", "examples/mlp/mlp.dflow"),
    (
        "examples/three_devices/towers.json",
        "examples/three_devices/towers.dflow",
    ),
    (
        "examples/digits/digits.json",
        "examples/digits/digits.dflow",
    ),
];

#[test]
fn check_summarizes_the_mlp() {
    let out = stdout(&dflow(&["check", "examples/mlp/mlp.json"]));
    let expected = "\
file:         examples/mlp/mlp.json
format:       json
nodes:        18
edges:        18 (18 data, 0 control)
ops:          11
  ArgMax                               1
  BiasAdd                              2
  Cast                                 1
  Equal                                1
  MatMul                               2
  Mean                                 2
  Placeholder                          2
  Relu                                 1
  Softmax                              1
  SparseSoftmaxCrossEntropyWithLogits  1
  Variable                             4
devices:      2
  /job:ps/task:0      4
  /job:worker/task:0  14
variables:    4
size:         2,410 parameters (9.4 KiB)
placeholders: 2
  labels  i64[?]
  x       f32[?, 64]
";
    assert_eq!(out, expected);
}

#[test]
fn check_shows_unconstrained_devices_and_control_edges() {
    let dir = scratch("check_none");
    let f = dir.join("g.dflow");
    std::fs::write(
        &f,
        "dflow 1\nx = Placeholder(dtype: f32, shape: [2])\ny = Relu(x) @ \"/job:worker\"\nz = NoOp(^y)\n",
    )
    .unwrap();
    let out = stdout(&dflow(&["check", f.to_str().unwrap()]));
    assert!(
        out.contains("edges:        2 (1 data, 1 control)\n"),
        "{out}"
    );
    assert!(
        out.contains("  (none)       2\n  /job:worker  1\n"),
        "{out}"
    );
    assert!(out.contains("size:         0 parameters (0 B)\n"), "{out}");
}

#[test]
fn check_summary_is_the_same_for_json_and_dsl() {
    for (json, dsl) in EXAMPLES {
        let a = stdout(&dflow(&["check", json]));
        let b = stdout(&dflow(&["check", dsl]));
        let body = |s: &str| -> Vec<String> {
            s.lines()
                .filter(|l| !l.starts_with("file:") && !l.starts_with("format:"))
                .map(str::to_string)
                .collect()
        };
        assert_eq!(body(&a), body(&b), "{json} vs {dsl}");
        assert!(a.contains("format:       json\n") && b.contains("format:       dsl\n"));
    }
}

#[test]
fn check_detects_the_format_without_an_extension() {
    let dir = scratch("check_noext");
    for (json, dsl) in EXAMPLES {
        for (src, fmt) in [(json, "json"), (dsl, "dsl")] {
            let f = dir.join("graph");
            std::fs::copy(repo().join(src), &f).unwrap();
            let out = stdout(&dflow(&["check", f.to_str().unwrap()]));
            assert!(out.contains(&format!("format:       {fmt}\n")), "{out}");
        }
    }
}

#[test]
fn check_lists_ops() {
    let out = stdout(&dflow(&["check", "--ops"]));
    assert!(out.lines().any(|l| l.starts_with("MatMul ")), "{out}");
    assert!(out.lines().any(|l| l.starts_with("Placeholder ")), "{out}");
}

#[test]
fn check_reports_every_error_with_positions() {
    let dir = scratch("check_errors");
    let f = dir.join("bad.dflow");
    std::fs::write(
        &f,
        "dflow 1\nx = Placeholder(dtype: f32, shape: [2, 3])\na = Relu(q)\nm = MatMul(x, x)\n",
    )
    .unwrap();
    let o = dflow(&["check", f.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(o.stdout.is_empty());
    let err = String::from_utf8(o.stderr).unwrap();
    let shown = f.display();
    assert!(
        err.starts_with(&format!("error: {shown}: 2 errors\n")),
        "{err}"
    );
    assert!(
        err.contains(&format!("{shown}:3:1: node `a`: input `q`")),
        "{err}"
    );
    assert!(
        err.contains(&format!("{shown}:4:1: node `m` (MatMul)")),
        "{err}"
    );
    assert!(err.contains("\nm = MatMul(x, x)\n^"), "{err}");
}

#[test]
fn committed_dsl_examples_are_what_convert_writes() {
    for (json, dsl) in EXAMPLES {
        let out = stdout(&dflow(&["convert", json, "--to", "dsl"]));
        let committed = std::fs::read_to_string(repo().join(dsl)).unwrap();
        assert_eq!(
            out, committed,
            "{dsl} is stale; regenerate it with dflow convert"
        );
    }
}

#[test]
fn json_to_dsl_to_json_gives_back_the_same_graph() {
    let dir = scratch("roundtrip");
    for (json, _) in EXAMPLES {
        let original = parse_json(&std::fs::read_to_string(repo().join(json)).unwrap(), None)
            .unwrap()
            .def;
        let dsl_path = dir.join("g.dflow");
        let json_path = dir.join("g.json");
        let o = dflow(&[
            "convert",
            json,
            "--to",
            "dsl",
            "-o",
            dsl_path.to_str().unwrap(),
        ]);
        assert!(stdout(&o).is_empty());
        let dsl_text = std::fs::read_to_string(&dsl_path).unwrap();
        assert_eq!(
            parse_dsl(&dsl_text, None).unwrap().def,
            original,
            "{json} via DSL"
        );
        let o = dflow(&[
            "convert",
            dsl_path.to_str().unwrap(),
            "--to",
            "json",
            "--output",
            json_path.to_str().unwrap(),
        ]);
        stdout(&o);
        let back = std::fs::read_to_string(&json_path).unwrap();
        assert_eq!(
            parse_json(&back, None).unwrap().def,
            original,
            "{json} round trip"
        );
        // The writer is canonical: converting the canonical JSON again changes nothing.
        let again = stdout(&dflow(&[
            "convert",
            json_path.to_str().unwrap(),
            "--to",
            "json",
        ]));
        assert_eq!(again, back);
        // No temporary files are left next to the outputs.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");
    }
}

#[test]
fn convert_refuses_an_invalid_graph_and_leaves_the_output_alone() {
    let dir = scratch("convert_invalid");
    let bad = dir.join("bad.dflow");
    std::fs::write(
        &bad,
        "dflow 1\na = Placeholder(dtype: f32, shape: [2, 3])\nb = Placeholder(dtype: f32, shape: [4, 5])\nm = MatMul(a, b)\n",
    )
    .unwrap();
    let out = dir.join("out.json");
    std::fs::write(&out, "previous contents").unwrap();
    let o = dflow(&[
        "convert",
        bad.to_str().unwrap(),
        "--to",
        "json",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(err.contains(":4:1: node `m` (MatMul)"), "{err}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "previous contents");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
}

#[test]
fn convert_reports_an_unwritable_output() {
    let dir = scratch("convert_unwritable");
    let out = dir.join("no/such/dir/out.json");
    let o = dflow(&[
        "convert",
        "examples/mlp/mlp.dflow",
        "--to",
        "json",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(
        err.contains("cannot write") && err.contains("out.json"),
        "{err}"
    );
}

#[test]
fn convert_needs_a_known_target_format() {
    let o = dflow(&["convert", "examples/mlp/mlp.json", "--to", "yaml"]);
    assert!(!o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(err.contains("json") && err.contains("dsl"), "{err}");
}

#[test]
fn check_prints_the_training_spec() {
    for file in [
        "examples/digits/digits.json",
        "examples/digits/digits.dflow",
    ] {
        let out = stdout(&dflow(&["check", file]));
        assert!(
            out.contains("train:        loss loss, sgd, lr 0.1\n  metrics accuracy"),
            "{out}"
        );
    }
    let out = stdout(&dflow(&["check", "examples/mlp/mlp.json"]));
    assert!(!out.contains("train:"), "{out}");
}
