//! Sparse optimizer updates: SparseApplyGradientDescent equals the dense update with the
//! SparseRowsToDense gradient, SparseApplyAdagrad and SparseApplyLazyAdam follow their formulas
//! on the touched rows (duplicates summed) and leave every other row and slot untouched, lazy
//! Adam touching every row once equals dense ApplyAdam, and bad inputs are errors that name the
//! node (never a hang).

use dflow_graph::builder::GraphBuilder;
use dflow_graph::{AttrValue, DType, GraphDef, Tensor};
use std::collections::HashMap;

mod common;
use common::{tensor, Eval};

const V: usize = 6;
const D: usize = 3;

/// Indices with a duplicate (row 4 twice) and rows 0, 2, 5 untouched.
const IDS: [i64; 3] = [4, 1, 4];

struct Setup {
    eval: Eval,
    init: HashMap<String, Vec<f64>>,
    values: Vec<f64>,
}

fn setup(vars: &[&str], ids: &[i64], t: f64) -> Setup {
    let mut seed = 11;
    let values = tensor(&mut seed, &[ids.len(), D], -1.0, 1.0);
    let mut eval = Eval {
        feeds: HashMap::from([
            (
                "ids".to_string(),
                Tensor::from_slice(&[ids.len()], ids).unwrap(),
            ),
            ("values".to_string(), values.clone()),
            ("t".to_string(), Tensor::scalar(t)),
        ]),
        vars: HashMap::new(),
    };
    let mut init = HashMap::new();
    for name in vars {
        // Slots start positive (v and accum must be >= 0).
        let (lo, hi) = if *name == "var" || *name == "m" {
            (-1.0, 1.0)
        } else {
            (0.1, 0.5)
        };
        let t = tensor(&mut seed, &[V, D], lo, hi);
        init.insert(name.to_string(), t.to_f64_vec());
        eval.cell(name).write(t);
    }
    Setup {
        eval,
        init,
        values: values.to_f64_vec(),
    }
}

fn graph(op: &str, vars: &[&str], with_t: bool, attrs: &[(&str, AttrValue)]) -> GraphDef {
    let mut b = GraphBuilder::new();
    let handles: Vec<_> = vars
        .iter()
        .map(|v| b.variable(v, DType::F64, &[V, D], "zeros"))
        .collect();
    let t = b.placeholder("t", DType::F64, &[]);
    let ids = b.placeholder("ids", DType::I64, &[-1]);
    let values = b.placeholder("values", DType::F64, &[-1, D as i64]);
    let mut node = b.op(op, "update");
    for h in &handles {
        node = node.input(h);
    }
    if with_t {
        node = node.input(&t);
    }
    node = node.input(&ids).input(&values);
    for (k, v) in attrs {
        node = node.attr(k, v.clone());
    }
    node.finish();
    b.to_def()
}

/// The summed gradient per touched row.
fn summed(ids: &[i64], values: &[f64]) -> HashMap<usize, Vec<f64>> {
    let mut g: HashMap<usize, Vec<f64>> = HashMap::new();
    for (k, &i) in ids.iter().enumerate() {
        let row = g.entry(i as usize).or_insert_with(|| vec![0.0; D]);
        for j in 0..D {
            row[j] += values[k * D + j];
        }
    }
    g
}

#[test]
fn sparse_sgd_equals_the_dense_update() {
    let mut s = setup(&["var"], &IDS, 0.0);
    let lr = 0.3;
    s.eval.run(
        &graph(
            "SparseApplyGradientDescent",
            &["var"],
            false,
            &[("lr", lr.into())],
        ),
        &["^update".into()],
    );
    // Dense: ApplyGradientDescent with SparseRowsToDense(ids, values, var).
    let mut b = GraphBuilder::new();
    let var = b.variable("var", DType::F64, &[V, D], "zeros");
    let ids = b.placeholder("ids", DType::I64, &[-1]);
    let values = b.placeholder("values", DType::F64, &[-1, D as i64]);
    let dense = b
        .op("SparseRowsToDense", "dense")
        .input(&ids)
        .input(&values)
        .input(&var)
        .finish();
    b.op("ApplyGradientDescent", "update")
        .input(&var)
        .input(&dense)
        .attr("lr", lr)
        .finish();
    let mut dense_eval = Eval {
        feeds: s.eval.feeds.clone(),
        vars: HashMap::new(),
    };
    dense_eval
        .cell("var")
        .write(Tensor::from_slice(&[V, D], &s.init["var"]).unwrap());
    dense_eval.run(&b.to_def(), &["^update".into()]);
    assert_eq!(
        s.eval.get("var").to_f64_vec(),
        dense_eval.get("var").to_f64_vec()
    );
    assert_ne!(s.eval.get("var").to_f64_vec(), s.init["var"]);
}

#[test]
fn sparse_adagrad_updates_only_the_touched_rows() {
    let vars = ["var", "accum"];
    let mut s = setup(&vars, &IDS, 0.0);
    let (lr, eps) = (0.2, 1e-7);
    s.eval.run(
        &graph("SparseApplyAdagrad", &vars, false, &[("lr", lr.into())]),
        &["^update".into()],
    );
    let g = summed(&IDS, &s.values);
    let (var, accum) = (
        s.eval.get("var").to_f64_vec(),
        s.eval.get("accum").to_f64_vec(),
    );
    for r in 0..V {
        for j in 0..D {
            let i = r * D + j;
            let (w0, a0) = (s.init["var"][i], s.init["accum"][i]);
            match g.get(&r) {
                None => {
                    assert_eq!(var[i], w0, "untouched var row {r}");
                    assert_eq!(accum[i], a0, "untouched accum row {r}");
                }
                Some(gr) => {
                    let a = a0 + gr[j] * gr[j];
                    let w = w0 - lr * gr[j] / (a.sqrt() + eps);
                    assert!((accum[i] - a).abs() < 1e-15, "accum [{r}, {j}]");
                    assert!((var[i] - w).abs() < 1e-15, "var [{r}, {j}]");
                }
            }
        }
    }
}

#[test]
fn lazy_adam_moves_touched_rows_and_equals_adam_when_every_row_is_touched() {
    let vars = ["var", "m", "v"];
    let (lr, b1, b2, eps, t): (f64, f64, f64, f64, f64) = (0.01, 0.9, 0.999, 1e-7, 4.0);
    let attrs = [("lr", AttrValue::Float(lr))];
    let mut s = setup(&vars, &IDS, t);
    s.eval.run(
        &graph("SparseApplyLazyAdam", &vars, true, &attrs),
        &["^update".into()],
    );
    let g = summed(&IDS, &s.values);
    let n: f64 = t + 1.0;
    let lr_n = lr * (1.0 - b2.powf(n)).sqrt() / (1.0 - b1.powf(n));
    let got: Vec<Vec<f64>> = vars.iter().map(|v| s.eval.get(v).to_f64_vec()).collect();
    for r in 0..V {
        for j in 0..D {
            let i = r * D + j;
            let (w0, m0, v0) = (s.init["var"][i], s.init["m"][i], s.init["v"][i]);
            match g.get(&r) {
                None => {
                    assert_eq!((got[0][i], got[1][i], got[2][i]), (w0, m0, v0), "row {r}");
                }
                Some(gr) => {
                    let m = m0 + (gr[j] - m0) * (1.0 - b1);
                    let v = v0 + (gr[j] * gr[j] - v0) * (1.0 - b2);
                    let w = w0 - lr_n * m / (v.sqrt() + eps);
                    assert!((got[1][i] - m).abs() < 1e-15, "m [{r}, {j}]");
                    assert!((got[2][i] - v).abs() < 1e-15, "v [{r}, {j}]");
                    assert!((got[0][i] - w).abs() < 1e-15, "var [{r}, {j}]");
                }
            }
        }
    }

    // Every row once (shuffled): the dense ApplyAdam with the same gradient.
    let ids: Vec<i64> = vec![3, 0, 5, 1, 4, 2];
    let mut sparse = setup(&vars, &ids, t);
    sparse.eval.run(
        &graph("SparseApplyLazyAdam", &vars, true, &attrs),
        &["^update".into()],
    );
    let mut b = GraphBuilder::new();
    let hs: Vec<_> = vars
        .iter()
        .map(|v| b.variable(v, DType::F64, &[V, D], "zeros"))
        .collect();
    let tt = b.placeholder("t", DType::F64, &[]);
    let idh = b.placeholder("ids", DType::I64, &[-1]);
    let vh = b.placeholder("values", DType::F64, &[-1, D as i64]);
    let dense = b
        .op("SparseRowsToDense", "dense")
        .input(&idh)
        .input(&vh)
        .input(&hs[0])
        .finish();
    b.op("ApplyAdam", "update")
        .input(&hs[0])
        .input(&hs[1])
        .input(&hs[2])
        .input(&tt)
        .input(&dense)
        .attr("lr", lr)
        .finish();
    let mut dense_eval = Eval {
        feeds: sparse.eval.feeds.clone(),
        vars: HashMap::new(),
    };
    for v in vars {
        dense_eval
            .cell(v)
            .write(Tensor::from_slice(&[V, D], &sparse.init[v]).unwrap());
    }
    dense_eval.run(&b.to_def(), &["^update".into()]);
    for v in vars {
        assert_eq!(
            sparse.eval.get(v).to_f64_vec(),
            dense_eval.get(v).to_f64_vec(),
            "{v}"
        );
    }
}

#[test]
fn bad_sparse_updates_are_errors_naming_the_node() {
    use dflow_graph::kernel::VariableCell;
    use dflow_graph::ops::testing::run_kernel_with;
    use dflow_graph::{Shape, TensorType};
    use std::sync::Arc;
    let tt = |d: DType, dims: &[i64]| TensorType::new(d, Shape::from_signed(dims).unwrap());
    let var = Tensor::zeros(DType::F32, &[4, 2]).unwrap();
    let cell = Arc::new(VariableCell::default());
    cell.write(var.clone());
    let run = |ids: &[i64], values: Tensor, cells: &[Arc<VariableCell>], op: &str| {
        let n = ids.len();
        let mut types = vec![tt(DType::F32, &[4, 2])];
        let mut inputs = vec![var.clone()];
        if op == "SparseApplyAdagrad" {
            types.push(tt(DType::F32, &[4, 2]));
            inputs.push(var.clone());
        }
        types.push(tt(DType::I64, &[-1]));
        types.push(tt(DType::F32, &[-1, 2]));
        inputs.push(Tensor::from_slice(&[n], ids).unwrap());
        inputs.push(values);
        run_kernel_with(
            op,
            "the_update",
            &[("lr", AttrValue::Float(0.1))],
            &types,
            &inputs,
            cells,
        )
    };
    let vals = |n: usize| Tensor::zeros(DType::F32, &[n, 2]).unwrap();
    let sgd = "SparseApplyGradientDescent";
    let e = run(&[1, 4], vals(2), std::slice::from_ref(&cell), sgd).unwrap_err();
    assert!(e.contains("the_update") && e.contains("index 4"), "{e}");
    let e = run(&[1, 2], vals(3), std::slice::from_ref(&cell), sgd).unwrap_err();
    assert!(e.contains("the_update") && e.contains("values"), "{e}");
    // The same variable as var and accum: an error, not a deadlock.
    let e = run(
        &[1],
        vals(1),
        &[cell.clone(), cell.clone()],
        "SparseApplyAdagrad",
    )
    .unwrap_err();
    assert!(e.contains("same variable"), "{e}");
    // Shape rule: values' trailing dims must be var's.
    let mut b = GraphBuilder::new();
    let v = b.variable("var", DType::F32, &[4, 2], "zeros");
    let ids = b.placeholder("ids", DType::I64, &[3]);
    let vals = b.placeholder("values", DType::F32, &[3, 5]);
    b.op(sgd, "the_update")
        .input(&v)
        .input(&ids)
        .input(&vals)
        .attr("lr", 0.1)
        .finish();
    let e = b.build().unwrap_err().to_string();
    assert!(
        e.contains("the_update") && e.contains("trailing dimensions"),
        "{e}"
    );
}

/// With `skip_padding`, index -1 rows are ignored: the same update as without them, for every
/// sparse optimizer.
#[test]
fn padding_rows_are_skipped_only_when_asked() {
    let padded: Vec<i64> = IDS.iter().copied().chain([-1, -1]).collect();
    for (op, vars, with_t) in [
        ("SparseApplyGradientDescent", &["var"][..], false),
        ("SparseApplyAdagrad", &["var", "accum"][..], false),
        ("SparseApplyLazyAdam", &["var", "m", "v"][..], true),
    ] {
        let mut plain = setup(vars, &IDS, 2.0);
        plain.eval.run(
            &graph(op, vars, with_t, &[("lr", 0.1.into())]),
            &["^update".into()],
        );
        let mut with_pad = setup(vars, &padded, 2.0);
        // The same initial values and the same values on the real rows; padding rows get junk.
        let mut values = plain.values.clone();
        values.extend([7.0; 2 * D]);
        with_pad.eval.feeds.insert(
            "values".into(),
            Tensor::from_slice(&[padded.len(), D], &values).unwrap(),
        );
        for v in vars {
            with_pad
                .eval
                .cell(v)
                .write(Tensor::from_slice(&[V, D], &plain.init[*v]).unwrap());
        }
        let attrs = [("lr", 0.1.into()), ("skip_padding", true.into())];
        with_pad
            .eval
            .run(&graph(op, vars, with_t, &attrs), &["^update".into()]);
        for v in vars {
            assert_eq!(
                with_pad.eval.get(v).to_f64_vec(),
                plain.eval.get(v).to_f64_vec(),
                "{op} {v}"
            );
        }
    }
}
