use super::*;
use crate::def::FORMAT_VERSION;
use crate::ops::AttrDefault;
use crate::train::{DataSpec, LrSchedule, OptimizerKind, OptimizerSpec, TrainSpec};
use crate::{DType, Shape, Tensor};
use proptest::prelude::*;

fn node(name: &str, op: &str, inputs: &[&str]) -> NodeDef {
    NodeDef {
        name: name.into(),
        op: op.into(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        ..NodeDef::default()
    }
}

fn sample() -> GraphDef {
    let mut w = node("w1", "Variable", &[]);
    w.device = "/job:ps/task:0".into();
    w.attrs.insert("dtype".into(), DType::F32.into());
    w.attrs
        .insert("shape".into(), Shape::known(&[64, 32]).into());
    w.attrs
        .insert("initializer".into(), "glorot_uniform".into());
    w.attrs.insert("seed".into(), 1i64.into());
    let mut x = node("x", "Placeholder", &[]);
    x.attrs.insert("dtype".into(), DType::F32.into());
    x.attrs
        .insert("shape".into(), Shape::partial(vec![None, Some(64)]).into());
    let mut h = node("scope/h.1-a", "Identity", &["x", "^w1"]);
    h.device = "/job:worker/task:0".into();
    let mut sink = node("sink", "NoOp", &["^scope/h.1-a"]);
    sink.colocate_with = vec!["w1".into()];
    let mut c = node("c", "Const", &[]);
    c.attrs.insert(
        "value".into(),
        Tensor::from_slice(&[2], &[1.0f32, f32::INFINITY])
            .unwrap()
            .into(),
    );
    GraphDef {
        version: FORMAT_VERSION,
        nodes: vec![w, x, h, sink, c],
        train: None,
    }
}

fn errs_json(text: &str) -> Vec<FormatError> {
    parse_json(text, Some("g.json")).unwrap_err().0
}

fn errs_dsl(text: &str) -> Vec<FormatError> {
    parse_dsl(text, Some("g.dflow")).unwrap_err().0
}

#[test]
fn sample_round_trips_both_formats() {
    let g = sample();
    let j = to_json(&g);
    assert_eq!(parse_json(&j, None).unwrap().def, g, "{j}");
    let d = to_dsl(&g);
    assert_eq!(parse_dsl(&d, None).unwrap().def, g, "{d}");
    assert_eq!(to_json(&parse_dsl(&d, None).unwrap().def), j);
}

#[test]
fn writers_are_stable_and_readable() {
    let d = to_dsl(&sample());
    assert_eq!(
        d,
        "dflow 1\n\
         w1 = Variable(dtype: f32, initializer: glorot_uniform, seed: 1, shape: [64, 32]) @ \"/job:ps/task:0\"\n\
         x = Placeholder(dtype: f32, shape: [-1, 64])\n\
         scope/h.1-a = Identity(x, ^w1) @ \"/job:worker/task:0\"\n\
         sink = NoOp(^scope/h.1-a) colocate(w1)\n\
         c = Const(value: tensor(f32, [2], [1.0, inf]))\n"
    );
    let j = to_json(&sample());
    assert!(j.starts_with("{\n  \"format\": \"dflow-graph\",\n  \"version\": 1,\n  \"nodes\": [\n    {\n      \"name\": \"w1\",\n"), "{j}");
    assert!(j.contains("\"shape\": [-1, 64]"), "{j}");
    assert_eq!(
        to_json(&GraphDef::default()),
        "{\n  \"format\": \"dflow-graph\",\n  \"version\": 1,\n  \"nodes\": []\n}\n"
    );
}

#[test]
fn dsl_example_from_the_docs_parses() {
    let src = r#"# 64-32-10 MLP
dflow 1
device "/job:ps/task:0" {
  w1 = Variable(dtype: f32, shape: [64, 32], initializer: "glorot_uniform", seed: 1)
}
x = Placeholder(dtype: f32, shape: [-1, 64])   # trailing comment
h = Identity(x) @ "/job:worker/task:0"
sink = NoOp(^h,) colocate(w1)
c = Const(value: tensor(f32, [2], [1.0, 2.0]))
"#;
    let p = parse_dsl(src, None).unwrap();
    assert_eq!(p.def.nodes.len(), 5);
    assert_eq!(p.def.nodes[0].device, "/job:ps/task:0");
    assert_eq!(p.def.nodes[2].device, "/job:worker/task:0");
    assert_eq!(p.def.nodes[3].colocate_with, vec!["w1".to_string()]);
    assert_eq!(
        p.node_positions,
        vec![(4, 3), (6, 1), (7, 1), (8, 1), (9, 1)]
    );
    // Defaults are not filled in.
    assert!(!p.def.nodes[1].attrs.contains_key("initializer"));
}

#[test]
fn json_positions_and_bom() {
    let src = "\u{feff}{\"format\": \"dflow-graph\", \"version\": 1, \"nodes\": [\n  {\"name\": \"a\", \"op\": \"NoOp\"},\n    {\"name\": \"b\", \"op\": \"NoOp\", \"inputs\": [\"^a\"]}\n]}";
    let p = parse_json(src, None).unwrap();
    assert_eq!(p.node_positions, vec![(2, 3), (3, 5)]);
}

#[test]
fn unknown_op_suggests_and_points_at_op() {
    let e = errs_json(
        "{\"format\": \"dflow-graph\", \"version\": 1, \"nodes\": [\n  {\"name\": \"a\", \"op\": \"Identiy\", \"inputs\": [\"b\"]}\n]}",
    );
    assert_eq!(e.len(), 1);
    assert_eq!(
        e[0].message,
        "unknown op \"Identiy\" (did you mean \"Identity\"?)"
    );
    assert_eq!((e[0].line, e[0].column), (2, 23));
    assert_eq!(
        e[0].to_string(),
        "g.json:2:23: unknown op \"Identiy\" (did you mean \"Identity\"?)\n  {\"name\": \"a\", \"op\": \"Identiy\", \"inputs\": [\"b\"]}\n                      ^"
    );
    let e = errs_dsl("dflow 1\na = Identiy(b)\n");
    assert_eq!(
        e[0].message,
        "unknown op \"Identiy\" (did you mean \"Identity\"?)"
    );
    assert_eq!((e[0].line, e[0].column), (2, 5));
    let e = errs_dsl("dflow 1\na = Zzzzzzzzz()\n");
    assert_eq!(e[0].message, "unknown op \"Zzzzzzzzz\"");
}

#[test]
fn attr_errors_list_valid_attrs_and_required_ones() {
    let e = errs_dsl("dflow 1\nx = Placeholder(dtyp: f32)\n");
    assert_eq!(e.len(), 2, "{e:?}");
    assert_eq!(
        e[1].message,
        "unknown attr \"dtyp\" for op Placeholder (valid attrs of Placeholder: dtype, shape)"
    );
    assert_eq!((e[1].line, e[1].column), (2, 17));
    assert_eq!(
        e[0].message,
        "Placeholder is missing required attr \"dtype\" (dtype)"
    );
    assert_eq!((e[0].line, e[0].column), (2, 5));
    let e = errs_dsl("dflow 1\nx = Identity(y, foo: 1)\n");
    assert!(e[0].message.contains("Identity takes no attrs"), "{e:?}");
    let e = errs_json(
        r#"{"format": "dflow-graph", "version": 1, "nodes": [{"name": "x", "op": "Variable", "attrs": {"dtype": "f32", "shape": [2], "seed": 1.5}}]}"#,
    );
    assert_eq!(
        e[0].message,
        "attr \"seed\" of Variable: expected int, found number 1.5"
    );
    assert_eq!(e[0].column, 131);
    let e = errs_dsl("dflow 1\nx = Placeholder(dtype: q8)\n");
    assert!(e[0].message.contains("unknown dtype `q8`"), "{e:?}");
    let e = errs_dsl("dflow 1\nx = Placeholder(dtype: f32, dtype: f64)\n");
    assert_eq!(e[0].message, "attr \"dtype\" given twice");
}

#[test]
fn json_reports_every_bad_node_with_paths() {
    let src = r#"{"format": "dflow-graph", "version": 1, "nodes": [
  {"name": "a", "op": "NoOp", "attr": {}},
  {"name": "b", "op": "Nope"},
  {"name": "c c", "op": "NoOp"},
  {"name": "d", "op": "Identity", "inputs": ["^a", "b"]},
  {"name": "a", "op": "NoOp"},
  {"op": "NoOp"},
  {"name": "e", "op": "Identity", "inputs": ["x:y"], "colocate_with": [3]}
]}"#;
    let e = errs_json(src);
    let got: Vec<_> = e.iter().map(|e| (e.line, e.message.as_str())).collect();
    assert_eq!(got.len(), 8, "{got:#?}");
    assert_eq!(got[0].0, 2);
    assert!(
        got[0]
            .1
            .starts_with("unknown field nodes[0].attr (a node has name, op"),
        "{got:?}"
    );
    assert_eq!(got[1], (3, "unknown op \"Nope\" (did you mean \"NoOp\"?)"));
    assert_eq!(got[2], (4, "node name \"c c\" contains ' '"));
    assert_eq!(got[3].0, 5);
    assert!(got[3].1.contains("control inputs (^name) must come last"));
    assert_eq!(
        got[4],
        (6, "duplicate node name \"a\" (first defined at 2:12)")
    );
    assert_eq!(got[5], (7, "nodes[5] is missing \"name\""));
    assert_eq!(
        got[6],
        (
            8,
            "invalid input \"x:y\": output index \"y\" is not a number"
        )
    );
    assert_eq!(
        got[7],
        (
            8,
            "nodes[6].colocate_with[0] must be a string, found a number"
        )
    );
}

#[test]
fn json_structural_errors() {
    let cases: &[(&str, &str, (usize, usize))] = &[
        (
            r#"{"format": "dflow-graph", "version": 2, "nodes": []}"#,
            "unsupported format version 2 (this build reads version 1)",
            (1, 38),
        ),
        (
            r#"{"format": "tf", "version": 1, "nodes": []}"#,
            "\"format\" must be \"dflow-graph\"",
            (1, 12),
        ),
        (
            r#"{"version": 1, "nodes": []}"#,
            "missing field \"format\" (\"dflow-graph\")",
            (1, 1),
        ),
        (
            r#"{"format": "dflow-graph", "version": 1, "nodes": [], "nodes": []}"#,
            "duplicate key \"nodes\"",
            (1, 54),
        ),
        (
            "{\"format\": \"dflow-graph\",\n \"version\": 1, \"nodes\": [",
            "expected a value, found end of file",
            (2, 26),
        ),
        (
            r#"{"format": "dflow-graph", "version": 1, "nodes": [1e999]}"#,
            "number 1e999 is out of range for f64",
            (1, 51),
        ),
        (
            r#"{"format": "dflow-graph", "version": 1, "nodes": [NaN]}"#,
            "expected a JSON value, found 'N'",
            (1, 51),
        ),
        (
            r#"{"format": "dflow-graph", "version": 99999999999999999999, "nodes": []}"#,
            "integer 99999999999999999999 does not fit in 64 bits (signed)",
            (1, 38),
        ),
        (
            r#"{"format": "dflow-graph", "version": 1, "nodes": {}}"#,
            "\"nodes\" must be an array, found an object",
            (1, 50),
        ),
        (
            r#"{"format": "dflow-graph", "version": 1, "nodes": [], }"#,
            "expected a key in double quotes, found '}'",
            (1, 54),
        ),
        (r#"[1 2]"#, "expected \",\" or \"]\", found '2'", (1, 4)),
        (
            r#"{} x"#,
            "unexpected 'x' after the top-level value",
            (1, 4),
        ),
        ("", "expected a value, found end of file", (1, 1)),
        (
            "{\"a\": \"x\ny\"}",
            "control character in string (escape it, e.g. \\n)",
            (1, 9),
        ),
    ];
    for (src, msg, pos) in cases {
        let e = errs_json(src);
        assert_eq!(e[0].message, *msg, "{src}");
        assert_eq!((e[0].line, e[0].column), *pos, "{src}");
    }
    let e = errs_json(r#"{"version": 1, "nodes": [], "extra": 1}"#);
    assert!(e
        .iter()
        .any(|e| e.message.starts_with("unknown field \"extra\"")));
}

#[test]
fn deep_nesting_is_a_clean_error() {
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let e = errs_json(&deep);
    assert_eq!(e[0].message, "nesting deeper than 128 levels");
    assert_eq!(e[0].column, 129);
    let src = format!(
        "dflow 1\nx = Placeholder(dtype: f32, shape: {})\n",
        "[".repeat(10_000)
    );
    let e = errs_dsl(&src);
    assert_eq!(e[0].message, "lists nest deeper than 64 levels");
}

#[test]
fn dsl_syntax_errors_say_what_was_expected() {
    let cases: &[(&str, &str, (usize, usize))] = &[
        (
            "dflow 1\nx = Identity(a b)\n",
            "expected \")\" or \",\", found 'b'",
            (2, 16),
        ),
        (
            "dflow 1\nx = Identity(a\n",
            "expected \")\" or \",\", found end of file",
            (3, 1),
        ),
        (
            "dflow 1\nx Identity(a)\n",
            "expected \"=\", found 'I'",
            (2, 3),
        ),
        ("x = NoOp()\n", "expected dflow 1, found 'x'", (1, 1)),
        (
            "dflow 2\n",
            "unsupported format version 2 (this build reads version 1)",
            (1, 7),
        ),
        (
            "dflow 1\nx = Placeholder(dtype: )\n",
            "expected value, found ')'",
            (2, 24),
        ),
        (
            "dflow 1\nx = Placeholder(shape: [1 2])\n",
            "expected \"]\" or \",\", found '2'",
            (2, 27),
        ),
        (
            "dflow 1\nx = Placeholder(dtype: \"f32)\n",
            "unterminated string (strings end on the same line)",
            (2, 24),
        ),
        (
            "dflow 1\nx = Variable(seed: 99999999999999999999)\n",
            "integer 99999999999999999999 does not fit in 64 bits (signed)",
            (2, 20),
        ),
        (
            "dflow 1\nx = Variable(seed: \"\\q\")\n",
            "unknown escape \\q",
            (2, 21),
        ),
        (
            "dflow 1\ndevice \"/cpu:0\" {\n  device \"/cpu:1\" { }\n}\n",
            "device blocks cannot be nested",
            (3, 3),
        ),
        (
            "dflow 1\ndevice \"/cpu:0\" {\n  x = NoOp()\n",
            "device block is never closed (missing \"}\")",
            (2, 1),
        ),
        (
            "dflow 1\nx = NoOp() @ cpu\n",
            "expected device string, found 'c'",
            (2, 14),
        ),
        (
            "dflow 1\nx = NoOp() colocate(, a)\n",
            "expected node name, found ','",
            (2, 21),
        ),
    ];
    for (src, msg, pos) in cases {
        let e = errs_dsl(src);
        assert_eq!(e.last().map(|e| e.message.as_str()), Some(*msg), "{src}");
        let last = e.last().unwrap();
        assert_eq!((last.line, last.column), *pos, "{src}");
    }
}

#[test]
fn dsl_semantic_errors_are_collected() {
    let src = "dflow 1\n\
               device \"/cpu:0\" {\n\
               a = NoOp() @ \"/cpu:1\"\n\
               }\n\
               b = Variable(dtype: f32, shape: [1], seed:1)\n\
               c = Identity(^a, b)\n\
               d = Nop()\n";
    let e = errs_dsl(src);
    let got: Vec<_> = e.iter().map(|e| (e.line, e.message.as_str())).collect();
    assert_eq!(got.len(), 4, "{got:#?}");
    assert!(got[0]
        .1
        .starts_with("a node inside a device block cannot also have"));
    assert_eq!(got[0].0, 3);
    assert!(
        got[1].1.starts_with("input \"seed:1\" comes after attrs"),
        "{got:?}"
    );
    assert_eq!(got[2].0, 6);
    assert!(got[2].1.contains("must come last"));
    assert_eq!(got[3], (7, "unknown op \"Nop\" (did you mean \"NoOp\"?)"));
}

#[test]
fn error_count_is_capped() {
    let mut src = String::from("dflow 1\n");
    for i in 0..200 {
        src.push_str(&format!("n{i} = Bogus()\n"));
    }
    assert_eq!(errs_dsl(&src).len(), MAX_ERRORS);
    let nodes: Vec<_> = (0..200)
        .map(|i| format!("{{\"name\": \"n{i}\", \"op\": \"Bogus\"}}"))
        .collect();
    let src = format!(
        "{{\"format\": \"dflow-graph\", \"version\": 1, \"nodes\": [{}]}}",
        nodes.join(",\n")
    );
    assert_eq!(errs_json(&src).len(), MAX_ERRORS);
}

#[test]
fn non_finite_float_attrs_and_tensors_round_trip() {
    // No registry op has a float attr yet, so exercise the conversion directly.
    for x in [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.1,
        -1e300,
        5e-324,
    ] {
        let j = attr_to_json(&AttrValue::Float(x));
        let AttrValue::Float(back) = attr_from_json(&j, AttrType::Float).unwrap() else {
            panic!("not a float");
        };
        assert_eq!(back.to_bits(), x.to_bits());
    }
    let mut c = node("c", "Const", &[]);
    c.attrs.insert(
        "value".into(),
        Tensor::from_slice(&[3], &[f64::NAN, f64::NEG_INFINITY, 1e-300])
            .unwrap()
            .into(),
    );
    let g = GraphDef {
        version: FORMAT_VERSION,
        nodes: vec![c],
        train: None,
    };
    assert_eq!(
        parse_dsl(&to_dsl(&g), None).unwrap().def.nodes[0].attrs["value"].to_json(),
        g.nodes[0].attrs["value"].to_json()
    );
    assert!(to_dsl(&g).contains("[nan, -inf, 1e-300]"), "{}", to_dsl(&g));
}

#[test]
fn strings_with_escapes_round_trip() {
    let mut v = node("v", "Variable", &[]);
    v.attrs.insert("dtype".into(), DType::F32.into());
    v.attrs.insert("shape".into(), Shape::scalar().into());
    v.attrs
        .insert("initializer".into(), "a \"q\" \\ \n\t\u{1} é ✓ true".into());
    v.device = "/job:\"x\"".into();
    let g = GraphDef {
        version: FORMAT_VERSION,
        nodes: vec![v],
        train: None,
    };
    assert_eq!(
        parse_dsl(&to_dsl(&g), None).unwrap().def,
        g,
        "{}",
        to_dsl(&g)
    );
    assert_eq!(parse_json(&to_json(&g), None).unwrap().def, g);
    let p = parse_json(
        r#"{"format": "dflow-graph", "version": 1, "nodes": [{"name": "\u0061\ud83d\ude00", "op": "NoOp"}]}"#,
        None,
    );
    assert!(p.unwrap_err().0[0].message.contains("contains '😀'"));
}

#[test]
fn format_detection_and_load_file() {
    use std::path::Path;
    assert_eq!(
        Format::detect(Some(Path::new("a.JSON")), "dflow 1"),
        Format::Json
    );
    assert_eq!(Format::detect(Some(Path::new("a.dflow")), "{"), Format::Dsl);
    assert_eq!(Format::detect(None, "\u{feff}  \n{"), Format::Json);
    assert_eq!(
        Format::detect(Some(Path::new("a.txt")), "dflow 1"),
        Format::Dsl
    );

    let dir = std::env::temp_dir().join(format!("dflow-format-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("g.dflow");
    std::fs::write(&good, "dflow 1\nx = NoOp()\n").unwrap();
    assert_eq!(load_file(&good).unwrap().def.nodes.len(), 1);
    let bad = dir.join("g.json");
    std::fs::write(&bad, b"{\"format\": \"dflow-graph\",\n \"x\xff\": 1}").unwrap();
    let e = load_file(&bad).unwrap_err().0;
    assert_eq!(
        e[0].message,
        "file is not valid UTF-8 (invalid byte at offset 29)"
    );
    assert_eq!((e[0].line, e[0].column), (2, 4));
    assert!(e[0]
        .to_string()
        .starts_with(&format!("{}:2:4: ", bad.display())));
    let e = load_file(&dir.join("missing.json")).unwrap_err().0;
    assert!(e[0].message.starts_with("cannot read: "), "{e:?}");
    assert_eq!(e[0].line, 0);
    let e = load_file(&dir).unwrap_err().0;
    assert!(e[0].message.starts_with("cannot read: "), "{e:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncated_files_never_panic() {
    let j = to_json(&sample());
    let d = to_dsl(&sample());
    for text in [&j, &d] {
        for end in (0..text.len()).filter(|&i| text.is_char_boundary(i)) {
            let _ = parse_json(&text[..end], None);
            let _ = parse_dsl(&text[..end], None);
        }
    }
}

// ---- the train section ----

const TRAIN_JSON: &str = r#"{"format": "dflow-graph", "version": 1, "nodes": [
  {"name": "x", "op": "Placeholder", "attrs": {"dtype": "f32"}}
], "train": {"loss": "x", "optimizer": {"type": "adam", "lr": 0.01, "beta2": 0.99},
  "clip_global_norm": 5, "metrics": ["x", "x:0"]}}"#;

#[test]
fn train_section_reads_in_both_formats() {
    let want = TrainSpec {
        lr_schedule: None,
        data: None,
        loss: "x".into(),
        optimizer: OptimizerSpec {
            kind: OptimizerKind::Adam {
                beta1: 0.9,
                beta2: 0.99,
                epsilon: 1e-7,
            },
            lr: 0.01,
        },
        clip_global_norm: Some(5.0),
        metrics: vec!["x".into(), "x:0".into()],
    };
    let j = parse_json(TRAIN_JSON, None).unwrap().def;
    assert_eq!(j.train.as_ref(), Some(&want));
    let dsl = "dflow 1\nx = Placeholder(dtype: f32)\n\
               train { loss: x, optimizer: adam(lr: 0.01, beta2: 0.99,), \
               clip_global_norm: 5, metrics: [x, \"x:0\"], }\n";
    let d = parse_dsl(dsl, None).unwrap().def;
    assert_eq!(d, j);
    let text = to_dsl(&d);
    assert!(
        text.contains("train { loss: x, optimizer: adam(lr: 0.01, beta1: 0.9, beta2: 0.99, epsilon: 1e-7), clip_global_norm: 5.0, metrics: [x, x:0] }"),
        "{text}"
    );
    // Scoped names need no quotes; a node may be called `train`.
    let d = parse_dsl(
        "dflow 1\ntrain = NoOp()\ntrain { loss: a/b:1, optimizer: sgd(lr: 1) }\n",
        None,
    )
    .unwrap()
    .def;
    assert_eq!(d.nodes[0].name, "train");
    let t = d.train.unwrap();
    assert_eq!(
        (t.loss.as_str(), &t.optimizer.kind),
        ("a/b:1", &OptimizerKind::Sgd)
    );
}

#[test]
fn train_section_errors_point_at_the_value() {
    let bad = TRAIN_JSON.replace("\"adam\"", "\"adamax\"");
    let e = parse_json(&bad, None).unwrap_err();
    assert_eq!(e.0.len(), 1, "{e}");
    assert!(
        e.0[0].message.contains("unknown optimizer \"adamax\""),
        "{e}"
    );
    assert_eq!(e.0[0].line, 3, "{e}");
    let e = parse_json(&TRAIN_JSON.replace("\"lr\": 0.01", "\"lr\": -1"), None).unwrap_err();
    assert!(e.to_string().contains("lr must be positive"), "{e}");
    let e = parse_json(&TRAIN_JSON.replace("\"loss\": \"x\",", ""), None).unwrap_err();
    assert!(e.to_string().contains("train is missing \"loss\""), "{e}");
    let e = parse_json(&TRAIN_JSON.replace("\"beta2\"", "\"momentum\""), None).unwrap_err();
    assert!(
        e.to_string().contains("adam has no parameter \"momentum\""),
        "{e}"
    );
    let e = parse_dsl(
        "dflow 1\ntrain { loss: x, optimizer: sgd(lr: 1), speed: 3 }\n",
        None,
    )
    .unwrap_err();
    assert_eq!((e.0[0].line, e.0[0].column), (2, 48), "{e}");
    assert!(e.0[0].message.contains("unknown field train.speed"), "{e}");
    let e = parse_dsl(
        "dflow 1\ntrain { loss: x, optimizer: sgd(lr: 1) }\ntrain { loss: x, optimizer: sgd(lr: 1) }\n",
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("second train section"), "{e}");
    let e = parse_dsl("dflow 1\ntrain { loss: x, optimizer: sgd(lr 1) }\n", None).unwrap_err();
    assert!(e.to_string().contains("expected \":\""), "{e}");
}

// ---- property tests: random graphs from the registry round-trip through both formats ----

fn name_strategy() -> impl Strategy<Value = String> {
    "[a-zA-Z_.][a-zA-Z0-9_./-]{0,12}"
}

fn attr_value(ty: AttrType) -> BoxedStrategy<AttrValue> {
    let text = "[ -~é✓\n\t\"\\\\]{0,10}";
    match ty {
        AttrType::Int => any::<i64>().prop_map(AttrValue::Int).boxed(),
        AttrType::Float => any::<f64>()
            .prop_filter("finite (NaN != NaN)", |x| !x.is_nan())
            .prop_map(AttrValue::Float)
            .boxed(),
        AttrType::Bool => any::<bool>().prop_map(AttrValue::Bool).boxed(),
        AttrType::String => text.prop_map(|s| AttrValue::String(s.into())).boxed(),
        AttrType::DType => proptest::sample::select(DType::ALL.to_vec())
            .prop_map(AttrValue::DType)
            .boxed(),
        AttrType::Shape => prop_oneof![
            Just(Shape::unknown()),
            proptest::collection::vec(proptest::option::of(0usize..1000), 0..4)
                .prop_map(Shape::partial),
        ]
        .prop_map(AttrValue::Shape)
        .boxed(),
        AttrType::Tensor => prop_oneof![
            proptest::collection::vec(any::<f32>().prop_filter("not nan", |x| !x.is_nan()), 0..4)
                .prop_map(|v| Tensor::from_slice(&[v.len()], &v).unwrap()),
            proptest::collection::vec(any::<f64>().prop_filter("not nan", |x| !x.is_nan()), 0..4)
                .prop_map(|v| Tensor::from_slice(&[1, v.len()], &v).unwrap()),
            proptest::collection::vec(any::<i64>(), 0..4).prop_map(|v| Tensor::from_slice(
                &[v.len()],
                &v
            )
            .unwrap()),
            proptest::collection::vec(any::<i32>(), 0..4).prop_map(|v| Tensor::from_slice(
                &[v.len()],
                &v
            )
            .unwrap()),
            proptest::collection::vec(0u8..2, 0..4).prop_map(|v| Tensor::from_slice(
                &[v.len()],
                &v
            )
            .unwrap()),
            any::<f32>()
                .prop_filter("not nan", |x| !x.is_nan())
                .prop_map(|x| Tensor::from_slice(&[1], &[half::bf16::from_f32(x)]).unwrap()),
        ]
        .prop_map(|t| AttrValue::Tensor(t.into()))
        .boxed(),
        AttrType::IntList => proptest::collection::vec(any::<i64>(), 0..4)
            .prop_map(AttrValue::IntList)
            .boxed(),
        AttrType::StringList => proptest::collection::vec(text, 0..3)
            .prop_map(AttrValue::StringList)
            .boxed(),
    }
}

/// One node: an op from the registry, its required attrs plus some optional ones.
fn node_strategy() -> BoxedStrategy<(String, BTreeMap<String, AttrValue>)> {
    let ops: Vec<_> = registry().ops().collect();
    let per_op: Vec<BoxedStrategy<_>> = ops
        .into_iter()
        .map(|op| {
            let attrs: Vec<_> = op
                .attrs
                .iter()
                .map(|a| {
                    let required = a.default == AttrDefault::Required;
                    let name = a.name.to_string();
                    let v = if required {
                        attr_value(a.ty).prop_map(Some).boxed()
                    } else {
                        proptest::option::of(attr_value(a.ty)).boxed()
                    };
                    v.prop_map(move |v| (name.clone(), v))
                })
                .collect();
            let name = op.name.to_string();
            attrs
                .prop_map(move |kv| {
                    let attrs = kv
                        .into_iter()
                        .filter_map(|(k, v)| v.map(|v| (k, v)))
                        .collect();
                    (name.clone(), attrs)
                })
                .boxed()
        })
        .collect();
    proptest::strategy::Union::new(per_op).boxed()
}

fn tensor_name_strategy() -> impl Strategy<Value = String> {
    (name_strategy(), 0usize..3).prop_map(|(n, k)| if k == 0 { n } else { format!("{n}:{k}") })
}

fn positive() -> impl Strategy<Value = f64> {
    prop_oneof![1e-9f64..1e3, Just(0.01), Just(1.0), Just(5.0)]
}

fn train_strategy() -> impl Strategy<Value = Option<TrainSpec>> {
    let kind = prop_oneof![
        Just(OptimizerKind::Sgd),
        (0.0f64..2.0, any::<bool>())
            .prop_map(|(momentum, nesterov)| OptimizerKind::Momentum { momentum, nesterov }),
        (0.0f64..1.0, 0.0f64..1.0, positive()).prop_map(|(beta1, beta2, epsilon)| {
            OptimizerKind::Adam {
                beta1,
                beta2,
                epsilon,
            }
        }),
        (0.0f64..1.0, 0.0f64..1.0, positive(), 0.0f64..1.0).prop_map(
            |(beta1, beta2, epsilon, weight_decay)| OptimizerKind::AdamW {
                beta1,
                beta2,
                epsilon,
                weight_decay,
            }
        ),
    ];
    let schedule = (0u64..200, 0u64..5000, 0.0f64..1.0);
    let data = proptest::option::of((
        1usize..512,
        tensor_name_strategy(),
        tensor_name_strategy(),
        0.0f64..0.5,
    ));
    proptest::option::of(
        (
            tensor_name_strategy(),
            kind,
            positive(),
            proptest::option::of(positive()),
            proptest::collection::vec(tensor_name_strategy(), 0..3),
            schedule,
            data,
        )
            .prop_map(
                |(loss, kind, lr, clip_global_norm, metrics, (warmup, decay, min_frac), data)| {
                    // A schedule needs a step-counting optimizer and decay > warmup (or 0).
                    let lr_schedule = kind.counts_steps().then_some(LrSchedule {
                        warmup_steps: warmup,
                        decay_steps: if decay > warmup { decay } else { 0 },
                        min_lr: lr * min_frac,
                    });
                    TrainSpec {
                        loss,
                        optimizer: OptimizerSpec { kind, lr },
                        clip_global_norm,
                        metrics,
                        lr_schedule,
                        data: data.map(|(block_size, inputs, targets, val_fraction)| {
                            DataSpec::CharWindows {
                                block_size,
                                inputs,
                                targets,
                                val_fraction,
                            }
                        }),
                    }
                },
            ),
    )
}

prop_compose! {
    fn graph_strategy()(
        specs in proptest::collection::vec(
            (
                node_strategy(),
                name_strategy(),
                proptest::collection::vec((any::<proptest::sample::Index>(), 0usize..3), 0..3),
                proptest::collection::vec(any::<proptest::sample::Index>(), 0..2),
                prop_oneof![Just(String::new()), "/job:[a-z]{1,4}/task:[0-9]", "[ -~]{0,8}"],
                proptest::collection::vec(any::<proptest::sample::Index>(), 0..2),
            ),
            0..12,
        ),
        train in train_strategy(),
    ) -> GraphDef {
        let mut nodes: Vec<NodeDef> = vec![];
        for (i, ((op, attrs), base, data, control, device, coloc)) in specs.into_iter().enumerate() {
            // Unique names: a random stem plus the index.
            let name = format!("{base}{i}");
            let mut inputs = vec![];
            if !nodes.is_empty() {
                for (ix, out) in &data {
                    let p = &nodes[ix.index(nodes.len())].name;
                    inputs.push(if *out == 0 { p.clone() } else { format!("{p}:{out}") });
                }
                for ix in &control {
                    inputs.push(format!("^{}", nodes[ix.index(nodes.len())].name));
                }
            }
            let colocate_with = if nodes.is_empty() {
                vec![]
            } else {
                coloc.iter().map(|ix| nodes[ix.index(nodes.len())].name.clone()).collect()
            };
            nodes.push(NodeDef { name, op, inputs, device, colocate_with, attrs });
        }
        GraphDef { version: FORMAT_VERSION, nodes, train }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn json_round_trips(g in graph_strategy()) {
        let text = to_json(&g);
        let back = parse_json(&text, None).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(back.def, g);
    }

    #[test]
    fn dsl_round_trips(g in graph_strategy()) {
        let text = to_dsl(&g);
        let back = parse_dsl(&text, None).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(back.node_positions.len(), g.nodes.len());
        prop_assert_eq!(back.def, g);
    }

    #[test]
    fn json_dsl_json_is_identity(g in graph_strategy()) {
        let j = to_json(&g);
        let via = parse_dsl(&to_dsl(&parse_json(&j, None).unwrap().def), None).unwrap().def;
        prop_assert_eq!(to_json(&via), j);
    }

    #[test]
    fn arbitrary_text_never_panics(s in "\\PC{0,200}") {
        let _ = parse_json(&s, None);
        let _ = parse_dsl(&s, None);
        let _ = parse_dsl(&format!("dflow 1\n{s}"), None);
    }
}

#[test]
fn sharding_attrs_round_trip_through_json_and_the_dsl() {
    let text = "dflow 1\n\
                w1 = Variable(dtype: f32, shape: [4, 6], initializer: zeros, _sharding: \"Shard(1)\")\n\
                w2 = Variable(dtype: f32, shape: [6, 2], initializer: zeros, _sharding: Replicate)\n\
                x = Placeholder(dtype: f32, shape: [-1, 4])\n\
                h = MatMul(x, w1, _sharding: \"Shard(1)\")\n";
    let g = parse_dsl(text, None).unwrap().def;
    let w1 = g.nodes.iter().find(|n| n.name == "w1").unwrap();
    assert_eq!(
        crate::sharding::node_sharding(w1),
        Ok(Some(crate::sharding::AxisPlacements::tp(
            crate::sharding::Placement::Shard(1)
        )))
    );
    let w2 = g.nodes.iter().find(|n| n.name == "w2").unwrap();
    assert_eq!(
        crate::sharding::node_sharding(w2),
        Ok(Some(crate::sharding::AxisPlacements::tp(
            crate::sharding::Placement::Replicate
        )))
    );
    let d = to_dsl(&g);
    assert!(d.contains("_sharding: \"Shard(1)\""), "{d}");
    assert_eq!(parse_dsl(&d, None).unwrap().def, g, "{d}");
    let j = to_json(&g);
    assert!(j.contains("\"_sharding\": \"Shard(1)\""), "{j}");
    assert_eq!(parse_json(&j, None).unwrap().def, g, "{j}");
    // The validated graph keeps the attribute.
    let graph = crate::Graph::from_def(&g).unwrap();
    assert!(graph
        .to_def()
        .nodes
        .iter()
        .any(|n| n.attrs.contains_key("_sharding")));
}

#[test]
fn a_bad_sharding_attr_is_refused_naming_the_node_and_what_is_accepted() {
    let e = errs_dsl(
        "dflow 1\nw1 = Variable(dtype: f32, shape: [4], initializer: zeros, _sharding: \"Split(0)\")\n",
    );
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(
        e[0].message,
        "node \"w1\", attr \"_sharding\": unknown placement \"Split(0)\"; write Shard(d) or \
         Replicate (d: a dimension of the tensor, from 0)"
    );
    assert_eq!(e[0].line, 2);
    let e = errs_json(
        r#"{"format": "dflow-graph", "version": 1, "nodes": [
            {"name": "w", "op": "Variable", "attrs": {"dtype": "f32", "shape": [2],
             "initializer": "zeros", "_sharding": "Partial(sum)"}}]}"#,
    );
    assert!(
        e[0].message.contains("node \"w\"") && e[0].message.contains("not declared"),
        "{e:?}"
    );
    // A graph built in memory is checked by validation, naming the node.
    let mut w = node("w", "Variable", &[]);
    w.attrs.insert("dtype".into(), DType::F32.into());
    w.attrs.insert("shape".into(), Shape::known(&[2]).into());
    w.attrs.insert("initializer".into(), "zeros".into());
    w.attrs.insert("_sharding".into(), "Shard(one)".into());
    let def = GraphDef {
        nodes: vec![w],
        ..GraphDef::default()
    };
    let e = crate::Graph::from_def(&def).unwrap_err().to_string();
    assert!(e.contains("node `w`") && e.contains("Shard(d)"), "{e}");
}

#[test]
fn the_builder_declares_placements() {
    use crate::builder::GraphBuilder;
    use crate::sharding::Placement;
    let mut b = GraphBuilder::new();
    let w = b.variable("w", DType::F32, &[4, 6], "zeros");
    assert!(b.set_sharding(&w, Placement::Shard(1)));
    let x = b.placeholder("x", DType::F32, &[-1, 4]);
    b.op("MatMul", "h")
        .input(&x)
        .input(&w)
        .sharding(Placement::Replicate)
        .finish();
    let g = b.build().unwrap().to_def();
    let get = |n: &str| {
        crate::sharding::node_sharding(g.nodes.iter().find(|x| x.name == n).unwrap())
            .map(|p| p.and_then(|p| p.tp))
    };
    assert_eq!(get("w"), Ok(Some(Placement::Shard(1))));
    assert_eq!(get("h"), Ok(Some(Placement::Replicate)));
    assert_eq!(get("x"), Ok(None));
}

#[test]
fn the_builder_declares_placements_per_axis() {
    use crate::builder::GraphBuilder;
    use crate::sharding::{AxisPlacements, Placement};
    let both = AxisPlacements {
        dp: Some(Placement::Shard(0)),
        tp: Some(Placement::Shard(1)),
    };
    let mut b = GraphBuilder::new();
    let w = b.variable("w", DType::F32, &[4, 6], "zeros");
    assert!(b.set_placements(&w, both));
    let v = b
        .op("Variable", "v")
        .attr("dtype", DType::F32)
        .attr("shape", Shape::known(&[6]))
        .attr("initializer", "zeros")
        .placements(AxisPlacements::dp(Placement::Replicate))
        .finish();
    let x = b.placeholder("x", DType::F32, &[-1, 4]);
    let h = b.matmul("h", &x, &w);
    b.binary("Add", "y", &h, &v);
    let g = b.build().unwrap().to_def();
    let get =
        |n: &str| crate::sharding::node_sharding(g.nodes.iter().find(|x| x.name == n).unwrap());
    assert_eq!(get("w"), Ok(Some(both)));
    assert_eq!(get("v"), Ok(Some(AxisPlacements::dp(Placement::Replicate))));
    // Written axis-named, read back by both formats.
    let j = to_json(&g);
    assert!(
        j.contains("\"_sharding\": \"dp:Shard(0),tp:Shard(1)\""),
        "{j}"
    );
    assert_eq!(parse_json(&j, None).unwrap().def, g, "{j}");
    let d = to_dsl(&g);
    assert!(d.contains("_sharding: \"dp:Shard(0),tp:Shard(1)\""), "{d}");
    assert_eq!(parse_dsl(&d, None).unwrap().def, g, "{d}");
    // A dp placement on an op is refused by validation, naming the node.
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[-1, 4]);
    b.op("Relu", "r")
        .input(&x)
        .placements(AxisPlacements::dp(Placement::Shard(0)))
        .finish();
    let e = b.build().unwrap_err().to_string();
    assert!(
        e.contains("node `r`") && e.contains("only variables"),
        "{e}"
    );
}

#[test]
fn axis_named_sharding_round_trips_through_json_and_the_dsl_and_bad_ones_name_node_and_axis() {
    let text = "dflow 1\n\
                w1 = Variable(dtype: f32, shape: [4, 6], initializer: zeros, _sharding: \"dp:Shard(0),tp:Shard(1)\")\n\
                w2 = Variable(dtype: f32, shape: [6, 2], initializer: zeros, _sharding: \"tp:Replicate, dp:Replicate\")\n";
    let g = parse_dsl(text, None).unwrap().def;
    let j = to_json(&g);
    assert!(j.contains("\"dp:Shard(0),tp:Shard(1)\""), "{j}");
    let via_json = parse_json(&j, None).unwrap().def;
    assert_eq!(via_json, g);
    assert_eq!(parse_dsl(&to_dsl(&via_json), None).unwrap().def, g);
    let w2 = g.nodes.iter().find(|n| n.name == "w2").unwrap();
    let p = crate::sharding::node_sharding(w2).unwrap().unwrap();
    assert_eq!(p.to_string(), "dp:Replicate,tp:Replicate");
    for (value, want) in [
        ("ep:Shard(0)", "unknown mesh axis \"ep\""),
        ("tp:Shard(1),tp:Shard(0)", "axis \"tp\" is given twice"),
        ("dp:Partial(sum)", "axis \"dp\": placement"),
        ("dp:Shard(1)", "dp:Shard(1): a variable's training state"),
    ] {
        let e = errs_json(&format!(
            r#"{{"format": "dflow-graph", "version": 1, "nodes": [
                {{"name": "w", "op": "Variable", "attrs": {{"dtype": "f32", "shape": [2],
                 "initializer": "zeros", "_sharding": "{value}"}}}}]}}"#
        ));
        assert_eq!(e.len(), 1, "{value}: {e:?}");
        assert!(
            e[0].message.starts_with("node \"w\", attr \"_sharding\": ")
                && e[0].message.contains(want),
            "{value}: {e:?}"
        );
    }
    let e =
        errs_dsl("dflow 1\nx = Placeholder(dtype: f32, shape: [2], _sharding: \"dp:Shard(0)\")\n");
    assert!(
        e[0].message.contains("node \"x\"") && e[0].message.contains("on a Placeholder"),
        "{e:?}"
    );
    assert_eq!(e[0].line, 2);
}
