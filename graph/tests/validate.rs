//! Validation of GraphDefs: each error names the node(s) involved.

use dflow_graph::{AttrValue, DType, Graph, GraphDef, GraphError, NodeDef, Shape};

fn node(name: &str, op: &str, inputs: &[&str]) -> NodeDef {
    NodeDef {
        name: name.into(),
        op: op.into(),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn placeholder(name: &str, dims: &[usize]) -> NodeDef {
    let mut n = node(name, "Placeholder", &[]);
    n.attrs.insert("dtype".into(), AttrValue::DType(DType::F32));
    n.attrs
        .insert("shape".into(), AttrValue::Shape(Shape::known(dims)));
    n
}

fn graph(nodes: Vec<NodeDef>) -> GraphDef {
    GraphDef {
        version: 1,
        nodes,
        train: None,
    }
}

fn errors(nodes: Vec<NodeDef>) -> Vec<GraphError> {
    Graph::from_def(&graph(nodes)).unwrap_err().0
}

#[test]
fn valid_graph_round_trips_and_infers_types() {
    let def = graph(vec![
        placeholder("x", &[2, 3]),
        node("a", "Identity", &["x"]),
        node("b", "Identity", &["a", "^x"]),
        node("done", "NoOp", &["^a", "^b"]),
    ]);
    let g = Graph::from_def(&def).unwrap();
    assert_eq!(g.to_def(), def);
    assert_eq!(g.num_nodes(), 4);
    assert_eq!(g.num_edges(), 5);
    let b = g.find("b").unwrap();
    assert_eq!(g.output_type(b, 0).unwrap().shape, Shape::known(&[2, 3]));
    let order: Vec<_> = g
        .topo_order()
        .iter()
        .map(|&i| g.node(i).name.clone())
        .collect();
    let pos = |n: &str| order.iter().position(|x| x == n).unwrap();
    assert!(pos("x") < pos("a") && pos("a") < pos("b") && pos("b") < pos("done"));
}

#[test]
fn duplicate_names_are_reported_with_both_positions() {
    let e = errors(vec![placeholder("x", &[1]), placeholder("x", &[1])]);
    assert_eq!(
        e,
        vec![GraphError::DuplicateName {
            name: "x".into(),
            first: 0,
            second: 1
        }]
    );
}

#[test]
fn dangling_input_suggests_nearest_name() {
    let e = errors(vec![
        placeholder("input", &[1]),
        node("y", "Identity", &["inptu"]),
    ]);
    assert_eq!(
        e[0].to_string(),
        "node `y`: input `inptu` refers to `inptu`, which does not exist (did you mean `input`?)"
    );
}

#[test]
fn cycle_is_printed_as_a_path() {
    let e = errors(vec![
        placeholder("x", &[1]),
        node("a", "Identity", &["c"]),
        node("b", "Identity", &["a"]),
        node("c", "Identity", &["b"]),
    ]);
    let msg = e[0].to_string();
    assert!(msg.starts_with("cycle: "), "{msg}");
    for n in ["a", "b", "c"] {
        assert!(msg.contains(&format!("`{n}`")) || msg.contains(n), "{msg}");
    }
    let GraphError::Cycle { path } = &e[0] else {
        panic!("{e:?}")
    };
    assert_eq!(path.first(), path.last());
    assert_eq!(path.len(), 4);
}

#[test]
fn self_loop_is_a_cycle() {
    let e = errors(vec![node("a", "Identity", &["a"])]);
    assert!(matches!(&e[0], GraphError::Cycle { path } if path == &["a", "a"]));
}

#[test]
fn unknown_op_suggests() {
    let e = errors(vec![node("y", "Identiy", &[])]);
    assert_eq!(
        e[0].to_string(),
        "node `y`: unknown op `Identiy` (did you mean `Identity`?)"
    );
}

#[test]
fn attr_errors() {
    let mut p = node("x", "Placeholder", &[]);
    p.attrs.insert("dtype".into(), AttrValue::Int(3));
    p.attrs.insert("colour".into(), AttrValue::Int(3));
    let v = node("v", "Variable", &[]);
    let e = errors(vec![p, v]);
    let msgs: Vec<String> = e.iter().map(|e| e.to_string()).collect();
    assert!(
        msgs.contains(
            &"node `x` (Placeholder): unknown attribute `colour` (valid: dtype, shape)".to_string()
        ),
        "{msgs:?}"
    );
    assert!(
        msgs.contains(&"node `x`: attribute `dtype` must be dtype, found int".to_string()),
        "{msgs:?}"
    );
    assert!(
        msgs.contains(
            &"node `v` (Variable): missing required attribute `dtype` of type dtype".to_string()
        ),
        "{msgs:?}"
    );
}

#[test]
fn arity_and_output_index() {
    let e = errors(vec![
        placeholder("x", &[1]),
        node("a", "Identity", &["x", "x"]),
        node("b", "Identity", &["x:3"]),
    ]);
    let msgs: Vec<String> = e.iter().map(|e| e.to_string()).collect();
    assert!(
        msgs.contains(&"node `a` (Identity): expects 1 data input(s), got 2".to_string()),
        "{msgs:?}"
    );
    assert!(
        msgs.contains(
            &"node `b`: input `x:3` asks for output 3 of `x`, which has 1 output(s)".to_string()
        ),
        "{msgs:?}"
    );
}

#[test]
fn control_inputs_must_come_last() {
    let e = errors(vec![
        placeholder("x", &[1]),
        node("a", "Identity", &["^x", "x"]),
    ]);
    assert!(
        e[0].to_string().contains("comes after a control input"),
        "{e:?}"
    );
}

#[test]
fn several_errors_are_reported_together() {
    let e = errors(vec![
        node("a", "Nope", &[]),
        node("b", "Identity", &["missing"]),
        node("c", "Identity", &["gone"]),
    ]);
    assert_eq!(e.len(), 3, "{e:?}");
}

#[test]
fn version_is_checked() {
    let mut def = graph(vec![placeholder("x", &[1])]);
    def.version = 7;
    let e = Graph::from_def(&def).unwrap_err().0;
    assert_eq!(
        e[0].to_string(),
        "unsupported graph format version 7 (this dflow reads version 1)"
    );
}

#[test]
fn variable_shape_must_be_static_and_parameters_are_counted() {
    let mut v = node("w", "Variable", &[]);
    v.attrs.insert("dtype".into(), AttrValue::DType(DType::F32));
    v.attrs
        .insert("shape".into(), AttrValue::Shape(Shape::known(&[64, 32])));
    let g = Graph::from_def(&graph(vec![v.clone()])).unwrap();
    assert_eq!(g.parameter_stats(), (1, 2048, 8192));
    v.attrs.insert(
        "shape".into(),
        AttrValue::Shape(Shape::partial(vec![None, Some(2)])),
    );
    let e = errors(vec![v]);
    assert!(e[0].to_string().contains("must be fully known"), "{e:?}");
}

#[test]
fn bad_device_names_the_node() {
    let mut p = placeholder("x", &[1]);
    p.device = "/job:ps/task:x".into();
    let e = errors(vec![p]);
    assert_eq!(
        e[0].to_string(),
        "node `x`: invalid device \"/job:ps/task:x\": task index \"x\" is not a number"
    );
}
