//! Finite-difference gradient checks (f64) for every differentiable op, run on the real CPU
//! kernels by a tiny single-device evaluator, plus autodiff's placement and error behaviour.

use dflow_graph::autodiff::{gradients, AutodiffError};
use dflow_graph::builder::GraphBuilder;
use dflow_graph::{AttrValue, DType, Graph, GraphDef, Tensor};
use std::collections::HashMap;

mod common;
use common::{Case, Eval};

#[test]
fn binary_ops_with_broadcasting() {
    for op in ["Add", "Sub", "Mul", "Div"] {
        // [3,1] with [1,4]
        let mut c = Case::new();
        let x = c.input("x", &[3, 1], &[3, 1], 0.5, 2.0);
        let y = c.input("y", &[1, 4], &[1, 4], 0.5, 2.0);
        let z = c.b.binary(op, "z", &x, &y);
        c.check(&z, &[3, 4], &["x", "y"]);
        // scalar with tensor, and a rank-1 operand against rank 2
        let mut c = Case::new();
        let s = c.input("s", &[], &[], 0.5, 2.0);
        let t = c.input("t", &[2, 3], &[2, 3], 0.5, 2.0);
        let v = c.input("v", &[3], &[3], 0.5, 2.0);
        let z = c.b.binary(op, "z", &s, &t);
        let w = c.b.binary(op, "w", &z, &v);
        c.check(&w, &[2, 3], &["s", "t", "v"]);
        // an unknown batch dimension broadcast against a known row
        let mut c = Case::new();
        let x = c.input("x", &[-1, 3], &[4, 3], 0.5, 2.0);
        let y = c.input("y", &[1, 3], &[1, 3], 0.5, 2.0);
        let z = c.b.binary(op, "z", &x, &y);
        c.check(&z, &[4, 3], &["x", "y"]);
    }
}

#[test]
fn unary_ops() {
    for (op, lo, hi) in [
        ("Neg", -1.0, 1.0),
        ("Identity", -1.0, 1.0),
        ("Square", -1.0, 1.0),
        ("Sqrt", 0.5, 2.0),
        ("Exp", -1.0, 1.0),
        ("Log", 0.5, 2.0),
        ("Relu", -1.0, 1.0),
        ("Sigmoid", -2.0, 2.0),
        ("Tanh", -2.0, 2.0),
        ("Softmax", -2.0, 2.0),
    ] {
        let mut c = Case::new();
        let x = c.input("x", &[3, 5], &[3, 5], lo, hi);
        let y = c.b.unary(op, "y", &x);
        c.check(&y, &[3, 5], &["x"]);
    }
}

#[test]
fn mat_mul_all_transpose_combinations() {
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let mut c = Case::new();
        let a_dims: [usize; 2] = if ta { [3, 2] } else { [2, 3] };
        let b_dims: [usize; 2] = if tb { [4, 3] } else { [3, 4] };
        let a = c.input(
            "a",
            &[a_dims[0] as i64, a_dims[1] as i64],
            &a_dims,
            -1.0,
            1.0,
        );
        let b = c.input(
            "b",
            &[b_dims[0] as i64, b_dims[1] as i64],
            &b_dims,
            -1.0,
            1.0,
        );
        let p =
            c.b.op("MatMul", "p")
                .input(&a)
                .input(&b)
                .attr("transpose_a", ta)
                .attr("transpose_b", tb)
                .finish();
        c.check(&p, &[2, 4], &["a", "b"]);
    }
}

#[test]
fn bias_add_and_sparse_softmax_cross_entropy() {
    let mut c = Case::new();
    let v = c.input("v", &[-1, 4], &[3, 4], -1.0, 1.0);
    let bias = c.input("bias", &[4], &[4], -1.0, 1.0);
    let y = c.b.binary("BiasAdd", "y", &v, &bias);
    c.check(&y, &[3, 4], &["v", "bias"]);

    let mut c = Case::new();
    let logits = c.input("logits", &[-1, 5], &[4, 5], -2.0, 2.0);
    let labels = c.b.placeholder("labels", DType::I64, &[-1]);
    c.eval.feeds.insert(
        "labels".into(),
        Tensor::from_slice(&[4], &[0i64, 4, 2, 2]).unwrap(),
    );
    let xent =
        c.b.op("SparseSoftmaxCrossEntropyWithLogits", "xent")
            .input(&logits)
            .input(&labels)
            .finish();
    c.check(&xent, &[4], &["logits"]);
}

#[test]
fn reductions_including_an_unknown_batch_dimension() {
    let cases: [(&str, Vec<i64>, bool, Vec<usize>); 6] = [
        ("Sum", vec![1], false, vec![4]),
        ("Sum", vec![0], true, vec![1, 3]),
        ("Sum", vec![], false, vec![]),
        ("Mean", vec![0], false, vec![3]),
        ("Mean", vec![-1], true, vec![4, 1]),
        ("Mean", vec![], false, vec![]),
    ];
    for (op, axes, keep, out_dims) in cases {
        let mut c = Case::new();
        let x = c.input("x", &[-1, 3], &[4, 3], -1.0, 1.0);
        let y =
            c.b.op(op, "y")
                .input(&x)
                .attr("axes", AttrValue::IntList(axes))
                .attr("keep_dims", keep)
                .finish();
        c.check(&y, &out_dims, &["x"]);
    }
}

/// TensorFlow's ops with run-time operands and Maximum (imported from TensorFlow graphs):
/// Maximum (broadcasting, away from ties), DynamicSum over a tensor of axes, DynamicReshape and
/// BroadcastTo to a tensor of dims, with an unknown batch dimension.
#[test]
fn tensorflow_run_time_ops() {
    let ints = |v: &[i32]| Tensor::from_slice(&[v.len()], v).unwrap();
    let mut c = Case::new();
    let x = c.input("x", &[-1, 3], &[4, 3], -1.0, 1.0);
    let y = c.input("y", &[3], &[3], 1.5, 2.0);
    let z = c.b.binary("Maximum", "z", &x, &y);
    let w = c.b.binary("Maximum", "w", &y, &x);
    let s = c.b.binary("Add", "s", &z, &w);
    c.check(&s, &[4, 3], &["x", "y"]);
    let mut c = Case::new();
    let x = c.input("x", &[-1, 3], &[4, 3], -0.4, 0.4);
    let y = c.input("y", &[1, 3], &[1, 3], -1.0, 1.0);
    let z = c.b.binary("Maximum", "z", &x, &y);
    c.check(&z, &[4, 3], &["x", "y"]);
    for (axes, keep, out) in [
        (vec![0], false, vec![3]),
        (vec![-1], true, vec![4, 1]),
        (vec![], false, vec![4, 3]),
    ] {
        let mut c = Case::new();
        let x = c.input("x", &[-1, 3], &[4, 3], -1.0, 1.0);
        let a = c.b.constant("axes", ints(&axes));
        let y =
            c.b.op("DynamicSum", "y")
                .input(&x)
                .input(&a)
                .attr("keep_dims", keep)
                .finish();
        c.check(&y, &out, &["x"]);
    }
    let mut c = Case::new();
    let x = c.input("x", &[-1, 6], &[2, 6], -1.0, 1.0);
    let shape = c.b.constant("shape", ints(&[3, -1]));
    let y =
        c.b.op("DynamicReshape", "y")
            .input(&x)
            .input(&shape)
            .finish();
    c.check(&y, &[3, 4], &["x"]);
    let mut c = Case::new();
    let x = c.input("x", &[-1, 1], &[2, 1], -1.0, 1.0);
    let shape = c.b.constant("shape", ints(&[3, 2, 4]));
    let y = c.b.op("BroadcastTo", "y").input(&x).input(&shape).finish();
    c.check(&y, &[3, 2, 4], &["x"]);
}

#[test]
fn reshape_cast_and_add_n() {
    let mut c = Case::new();
    let x = c.input("x", &[-1, 6], &[2, 6], -1.0, 1.0);
    let y =
        c.b.op("Reshape", "y")
            .input(&x)
            .attr("shape", AttrValue::IntList(vec![-1, 3]))
            .finish();
    c.check(&y, &[4, 3], &["x"]);

    // x is used three times: gradients from several consumers are summed.
    let mut c = Case::new();
    let x = c.input("x", &[2, 3], &[2, 3], -1.0, 1.0);
    let y = c.input("y", &[2, 3], &[2, 3], -1.0, 1.0);
    let sq = c.b.unary("Square", "sq", &x);
    let s = c.b.op("AddN", "s").input(&x).input(&y).input(&sq).finish();
    c.check(&s, &[2, 3], &["x", "y"]);

    // Cast f64 -> f64 round trip through f32 is checked for structure (the cast back exists).
    let mut c = Case::new();
    let x = c.input("x", &[3], &[3], -1.0, 1.0);
    let y =
        c.b.op("Cast", "y")
            .input(&x)
            .attr("DstT", DType::F64)
            .finish();
    c.check(&y, &[3], &["x"]);
}

#[test]
fn cast_through_f32_differentiates_back_to_f64() {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F64, &[3]);
    let y = b
        .op("Cast", "y")
        .input(&x)
        .attr("DstT", DType::F32)
        .finish();
    b.op("Sum", "s").input(&y).finish();
    let (def, grads) = gradients(&b.to_def(), "s", &["x"]).unwrap();
    let g = Graph::from_def(&def).unwrap();
    let grad = g.find(&grads[0].node).unwrap();
    assert_eq!(g.node(grad).op, "Cast");
    assert_eq!(g.node(grad).outputs[0].dtype, DType::F64);
    let mut eval = Eval {
        feeds: [(
            "x".to_string(),
            Tensor::from_slice(&[3], &[1.0f64, 2.0, 3.0]).unwrap(),
        )]
        .into(),
        vars: HashMap::new(),
    };
    let out = eval.run(&def, &[grads[0].node.clone()]);
    assert_eq!(out[0].to_f64_vec(), vec![1.0; 3]);
}

#[test]
fn small_mlp_on_variables() {
    let mut c = Case::new();
    let x = c.input("x", &[-1, 4], &[5, 4], -1.0, 1.0);
    let labels = c.b.placeholder("labels", DType::I64, &[-1]);
    c.eval.feeds.insert(
        "labels".into(),
        Tensor::from_slice(&[5], &[0i64, 1, 2, 1, 0]).unwrap(),
    );
    let w1 = c.variable("w1", &[4, 3]);
    let b1 = c.variable("b1", &[3]);
    let w2 = c.variable("w2", &[3, 3]);
    let b2 = c.variable("b2", &[3]);
    let h = c.b.matmul("h", &x, &w1);
    let h = c.b.binary("BiasAdd", "hb", &h, &b1);
    let h = c.b.unary("Tanh", "ht", &h);
    let l = c.b.matmul("l", &h, &w2);
    let l = c.b.binary("BiasAdd", "logits", &l, &b2);
    let xent =
        c.b.op("SparseSoftmaxCrossEntropyWithLogits", "xent")
            .input(&l)
            .input(&labels)
            .finish();
    let loss = c.b.op("Mean", "loss").input(&xent).finish();
    c.check(&loss, &[], &["w1", "b1", "w2", "b2"]);
}

fn simple() -> GraphDef {
    let mut b = GraphBuilder::new();
    let x = b.with_device("/job:worker/task:0", |b| {
        b.placeholder("x", DType::F32, &[-1, 3])
    });
    let w = b.with_device("/job:ps/task:0", |b| {
        b.variable("w", DType::F32, &[3, 2], "zeros")
    });
    b.with_device("/job:worker/task:0", |b| {
        let m = b.matmul("m", &x, &w);
        b.op("Max", "max").input(&m).finish();
        b.op("Sum", "loss").input(&m).finish();
    });
    b.to_def()
}

#[test]
fn backward_nodes_follow_their_forward_nodes() {
    let def = simple();
    let (out, grads) = gradients(&def, "loss", &["w", "x"]).unwrap();
    assert_eq!(out.nodes[..def.nodes.len()], def.nodes[..]);
    let added = &out.nodes[def.nodes.len()..];
    assert!(!added.is_empty());
    for n in added {
        assert!(n.name.starts_with("gradients/"), "{}", n.name);
        let fwd = &n.colocate_with[0];
        let fwd_dev = &def.nodes.iter().find(|f| &f.name == fwd).unwrap().device;
        assert_eq!(&n.device, fwd_dev, "{}", n.name);
    }
    assert!(grads.iter().all(|g| g.node.starts_with("gradients/m/")));
    // A second call picks a fresh scope instead of clashing.
    let (again, grads2) = gradients(&out, "loss", &["w"]).unwrap();
    assert!(
        grads2[0].node.starts_with("gradients_1/"),
        "{:?}",
        grads2[0]
    );
    assert!(Graph::from_def(&again).is_ok());
}

#[test]
fn errors_name_the_node_and_op() {
    let def = simple();
    let e = gradients(&def, "max", &["w"]).unwrap_err();
    assert_eq!(
        e,
        AutodiffError::NoGradient {
            node: "max".into(),
            op: "Max".into()
        }
    );
    assert!(e.to_string().contains("`Max` has no gradient"), "{e}");
    assert!(matches!(
        gradients(&def, "nope", &["w"]),
        Err(AutodiffError::UnknownTensor { role: "loss", .. })
    ));
    assert!(matches!(
        gradients(&def, "loss:3", &["w"]),
        Err(AutodiffError::UnknownTensor { .. })
    ));
    // The loss does not depend on an unrelated placeholder.
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[2]);
    let _y = b.placeholder("y", DType::F32, &[2]);
    let _l = b.op("Sum", "l").input(&x).finish();
    let e = gradients(&b.to_def(), "l", &["y"]).unwrap_err();
    assert!(matches!(e, AutodiffError::NotConnected { .. }), "{e}");
    // Integer tensors have no gradients.
    let mut b = GraphBuilder::new();
    let _i = b.placeholder("i", DType::I64, &[2]);
    let e = gradients(&b.to_def(), "i", &["i"]).unwrap_err();
    assert!(matches!(e, AutodiffError::NotFloat { .. }), "{e}");
}

#[test]
fn gradient_coverage() {
    let reg = dflow_graph::registry();
    let differentiable = [
        "Identity",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Neg",
        "MatMul",
        "BiasAdd",
        "Relu",
        "Sigmoid",
        "Tanh",
        "Softmax",
        "SparseSoftmaxCrossEntropyWithLogits",
        "Sum",
        "Mean",
        "Reshape",
        "Cast",
        "AddN",
        "Square",
        "Sqrt",
        "Exp",
        "Log",
    ];
    let not_differentiable = [
        "ArgMax",
        "Equal",
        "ZerosLike",
        "OnesLike",
        "Placeholder",
        "Const",
        "Variable",
    ];
    for op in differentiable.iter().chain(&not_differentiable) {
        assert!(
            reg.get(op).unwrap().gradient.is_some(),
            "{op} has no gradient"
        );
    }
}

#[test]
fn every_op_has_a_gradient_or_a_reason_and_mistakes_are_named() {
    use dflow_graph::ops::{same_as_input, OpRegistry, NO_GRADIENT};
    // The built-in registry is consistent (it asserts this when built, too).
    assert_eq!(
        dflow_graph::registry().check_gradients(NO_GRADIENT),
        Vec::<String>::new()
    );
    // A registry with every kind of mistake reports each one.
    let mut r = OpRegistry::default();
    r.add(dflow_graph::OpDef::new(
        "Plain",
        "no gradient, not listed",
        same_as_input,
    ));
    r.add(dflow_graph::OpDef::new(
        "Listed",
        "has a gradient but listed",
        same_as_input,
    ));
    r.set_gradient("Listed", dflow_graph::autodiff::no_gradient);
    r.set_gradient("Mispelt", dflow_graph::autodiff::no_gradient);
    let problems = r.check_gradients(&[("Listed", "why"), ("Gone", "why")]);
    assert_eq!(problems.len(), 4, "{problems:?}");
    assert!(problems[0].contains("`Mispelt`, which is no op"));
    assert!(problems
        .iter()
        .any(|p| p.contains("`Plain` has no gradient and is not in NO_GRADIENT")));
    assert!(problems
        .iter()
        .any(|p| p.contains("`Listed` has a gradient but is listed")));
    assert!(problems
        .iter()
        .any(|p| p.contains("lists `Gone`, which is no op")));
}
