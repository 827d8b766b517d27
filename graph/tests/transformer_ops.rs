//! The transformer ops (Gather, BatchMatMul, Transpose, Split, Concat, Slice, LayerNorm, Gelu,
//! causal Softmax, Dropout and their gradient ops): shape rules (good and bad shapes, errors
//! naming the node), kernels against direct naive references on random inputs, and gradients
//! against central finite differences in f64 through autodiff.

use dflow_graph::autodiff::gradients;
use dflow_graph::builder::GraphBuilder;
use dflow_graph::ops::testing::{run_kernel, run_kernel_with};
use dflow_graph::{AttrValue, DType, Graph, InputRef, Shape, Tensor, TensorType};
use std::collections::HashMap;

mod common;
use common::{tensor, values, Case, Eval};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn ints(v: &[i64]) -> AttrValue {
    AttrValue::IntList(v.to_vec())
}

fn t64(seed: &mut u64, dims: &[usize]) -> Tensor {
    tensor(seed, dims, -1.0, 1.0)
}

fn t32(seed: &mut u64, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f32> = values(seed, n, -1.0, 1.0)
        .into_iter()
        .map(|x| x as f32)
        .collect();
    Tensor::from_slice(dims, &v).unwrap()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i}: got {g}, want {w}"
        );
    }
}

/// The multi-index of flat index `i` in `dims` (row-major).
fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        idx[d] = i % dims[d];
        i /= dims[d];
    }
    idx
}

fn ravel(idx: &[usize], dims: &[usize]) -> usize {
    idx.iter().zip(dims).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// Validates a one-op graph over placeholders of the given static types; returns the output
/// types or the validation error text.
fn validate(
    op: &str,
    inputs: &[(DType, &[i64])],
    attrs: &[(&str, AttrValue)],
) -> Result<Vec<TensorType>, String> {
    let mut b = GraphBuilder::new();
    let hs: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, (d, s))| b.placeholder(&format!("in{i}"), *d, s))
        .collect();
    let mut ob = b.op(op, "the_node");
    for h in &hs {
        ob = ob.input(h);
    }
    for (k, v) in attrs {
        ob = ob.attr(k, v.clone());
    }
    ob.finish();
    let g = b.build().map_err(|e| e.to_string())?;
    Ok(g.node(g.find("the_node").unwrap()).outputs.to_vec())
}

fn tt(dtype: DType, dims: &[i64]) -> TensorType {
    TensorType::new(dtype, Shape::from_signed(dims).unwrap())
}

/// A bad shape is rejected, the error names the node and contains every `needle`.
fn rejects(op: &str, inputs: &[(DType, &[i64])], attrs: &[(&str, AttrValue)], needles: &[&str]) {
    let e = validate(op, inputs, attrs).expect_err("should be rejected");
    assert!(e.contains("the_node"), "{e}");
    for n in needles {
        assert!(e.contains(n), "{e} (wanted {n:?})");
    }
}

// ---------------------------------------------------------------------------------------------
// Gather, GatherGrad, SparseRowsToDense
// ---------------------------------------------------------------------------------------------

#[test]
fn gather_shape_rule() {
    use DType::*;
    assert_eq!(
        validate("Gather", &[(F32, &[65, 8]), (I64, &[-1, 16])], &[]),
        Ok(vec![tt(F32, &[-1, 16, 8])])
    );
    assert_eq!(
        validate("Gather", &[(F32, &[10]), (I32, &[])], &[]),
        Ok(vec![tt(F32, &[])])
    );
    rejects(
        "Gather",
        &[(F32, &[10, 4]), (F32, &[3])],
        &[],
        &["i32 or i64"],
    );
    rejects("Gather", &[(F32, &[]), (I32, &[3])], &[], &["rank >= 1"]);
    rejects(
        "Gather",
        &[(F32, &[10, 4]), (I32, &[3])],
        &[("axis", AttrValue::Int(1))],
        &["axis 0", "axis 1"],
    );
    assert_eq!(
        validate("GatherGrad", &[(I32, &[2, 3]), (F64, &[2, 3, 5])], &[]),
        Ok(vec![tt(I64, &[6]), tt(F64, &[6, 5])])
    );
    rejects(
        "GatherGrad",
        &[(I32, &[2, 3]), (F64, &[3, 2, 5])],
        &[],
        &["[3, 2, 5]", "[2, 3]"],
    );
    assert_eq!(
        validate(
            "SparseRowsToDense",
            &[(I64, &[-1]), (F32, &[-1, 5]), (F32, &[9, 5])],
            &[]
        ),
        Ok(vec![tt(F32, &[9, 5])])
    );
    rejects(
        "SparseRowsToDense",
        &[(I64, &[4]), (F32, &[4, 6]), (F32, &[9, 5])],
        &[],
        &["[4, 6]", "[9, 5]"],
    );
}

#[test]
fn gather_kernel_matches_naive_lookup() {
    let mut seed = 1;
    let params = t32(&mut seed, &[7, 3, 2]);
    let p = params.as_slice::<f32>().unwrap().to_vec();
    let idx = [6i64, 0, 3, 3, 1, 6];
    for indices in [
        Tensor::from_slice(&[2, 3], &idx).unwrap(),
        Tensor::from_slice(&[2, 3], &idx.map(|i| i as i32)).unwrap(),
    ] {
        let out = run_kernel("Gather", &[], &[params.clone(), indices]).unwrap();
        assert_eq!(out[0].dims(), &[2, 3, 3, 2]);
        let want: Vec<f32> = idx
            .iter()
            .flat_map(|&i| p[i as usize * 6..(i as usize + 1) * 6].to_vec())
            .collect();
        assert_eq!(out[0].as_slice::<f32>().unwrap(), &want[..]);
    }
    // Integer params and a scalar index.
    let table = Tensor::from_slice(&[3, 2], &[1i64, 2, 3, 4, 5, 6]).unwrap();
    let out = run_kernel("Gather", &[], &[table, Tensor::scalar(2i32)]).unwrap();
    assert_eq!(out[0].as_slice::<i64>().unwrap(), &[5, 6]);
}

#[test]
fn gather_index_out_of_range_names_node_index_and_size() {
    let params = Tensor::zeros(DType::F32, &[65, 4]).unwrap();
    for bad in [65i64, -1] {
        let idx = Tensor::from_slice(&[3], &[0i64, bad, 2]).unwrap();
        let types = [
            TensorType::new(DType::F32, params.shape()),
            TensorType::new(DType::I64, idx.shape()),
        ];
        let e =
            run_kernel_with("Gather", "wte", &[], &types, &[params.clone(), idx], &[]).unwrap_err();
        assert!(
            e.contains("wte") && e.contains(&bad.to_string()) && e.contains("[0, 65)"),
            "{e}"
        );
    }
    // The dense gradient checks its indices too.
    let e = run_kernel(
        "SparseRowsToDense",
        &[],
        &[
            Tensor::from_slice(&[1], &[9i64]).unwrap(),
            Tensor::zeros(DType::F32, &[1, 2]).unwrap(),
            Tensor::zeros(DType::F32, &[4, 2]).unwrap(),
        ],
    )
    .unwrap_err();
    assert!(e.contains("index 9") && e.contains("[0, 4)"), "{e}");
}

#[test]
fn sparse_gradient_pair_sums_duplicates() {
    let indices = Tensor::from_slice(&[2, 2], &[1i32, 3, 1, 1]).unwrap();
    let dy = Tensor::from_slice(&[2, 2, 2], &[1.0f64, 2., 3., 4., 5., 6., 7., 8.]).unwrap();
    let sparse = run_kernel("GatherGrad", &[], &[indices, dy.clone()]).unwrap();
    assert_eq!(sparse[0].as_slice::<i64>().unwrap(), &[1, 3, 1, 1]);
    assert_eq!(sparse[1].dims(), &[4, 2]);
    assert_eq!(
        sparse[1].data_ptr(),
        dy.data_ptr(),
        "values share dy's buffer"
    );
    let like = Tensor::zeros(DType::F64, &[5, 2]).unwrap();
    let dense = run_kernel(
        "SparseRowsToDense",
        &[],
        &[sparse[0].clone(), sparse[1].clone(), like],
    )
    .unwrap();
    assert_eq!(
        dense[0].to_f64_vec(),
        vec![0., 0., 1. + 5. + 7., 2. + 6. + 8., 0., 0., 3., 4., 0., 0.]
    );
}

#[test]
fn gather_gradient_is_the_adjacent_sparse_pair() {
    let mut b = GraphBuilder::new();
    let p = b.placeholder("p", DType::F32, &[10, 4]);
    let i = b.placeholder("i", DType::I64, &[-1]);
    let g = b.op("Gather", "emb").input(&p).input(&i).finish();
    b.op("Sum", "loss").input(&g).finish();
    let (def, grads) = gradients(&b.to_def(), "loss", &["p"]).unwrap();
    let graph = Graph::from_def(&def).unwrap();
    let dense = graph.node(graph.find(&grads[0].node).unwrap());
    assert_eq!(dense.op, "SparseRowsToDense");
    let inputs = graph.inputs(graph.find(&grads[0].node).unwrap());
    let sparse = graph.node(inputs[0].0);
    assert_eq!(sparse.op, "GatherGrad");
    assert_eq!((inputs[0].0, inputs[0].1), (inputs[1].0, 0));
    assert_eq!((inputs[1].0, inputs[1].1), (inputs[0].0, 1));
    assert_eq!(graph.node(inputs[2].0).name, "p");
}

#[test]
fn gather_gradient_with_duplicate_indices() {
    for dtype in [DType::I64, DType::I32] {
        let mut c = Case::new();
        let p = c.input("p", &[6, 3], &[6, 3], -1.0, 1.0);
        let i = c.b.placeholder("i", dtype, &[2, 3]);
        let idx = [4i64, 1, 4, 0, 4, 1];
        let t = match dtype {
            DType::I64 => Tensor::from_slice(&[2, 3], &idx).unwrap(),
            _ => Tensor::from_slice(&[2, 3], &idx.map(|v| v as i32)).unwrap(),
        };
        c.eval.feeds.insert("i".into(), t);
        let g = c.b.op("Gather", "g").input(&p).input(&i).finish();
        c.check(&g, &[2, 3, 3], &["p"]);
    }
}

// ---------------------------------------------------------------------------------------------
// BatchMatMul
// ---------------------------------------------------------------------------------------------

#[test]
fn batch_mat_mul_shape_rule() {
    use DType::*;
    let adj = |x: bool, y: bool| vec![("adj_x", x.into()), ("adj_y", y.into())];
    assert_eq!(
        validate(
            "BatchMatMul",
            &[(F32, &[2, 4, 8, 16]), (F32, &[2, 4, 16, 8])],
            &[]
        ),
        Ok(vec![tt(F32, &[2, 4, 8, 8])])
    );
    assert_eq!(
        validate(
            "BatchMatMul",
            &[(F32, &[-1, 64, 128]), (F32, &[128, 384])],
            &[]
        ),
        Ok(vec![tt(F32, &[-1, 64, 384])])
    );
    assert_eq!(
        validate(
            "BatchMatMul",
            &[(F64, &[3, 1, 5, 2]), (F64, &[4, 6, 5])],
            &adj(true, true)
        ),
        Ok(vec![tt(F64, &[3, 4, 2, 6])])
    );
    rejects(
        "BatchMatMul",
        &[(F32, &[2, 8, 16]), (F32, &[2, 8, 16])],
        &[],
        &["inner dimensions", "[2, 8, 16]"],
    );
    rejects(
        "BatchMatMul",
        &[(F32, &[3, 8, 16]), (F32, &[2, 16, 4])],
        &[],
        &["batch", "[3, 8, 16]", "[2, 16, 4]"],
    );
    rejects(
        "BatchMatMul",
        &[(F32, &[16]), (F32, &[16, 4])],
        &[],
        &["rank >= 2"],
    );
    rejects(
        "BatchMatMul",
        &[(F32, &[2, 2]), (F64, &[2, 2])],
        &[],
        &["f32", "f64"],
    );
    rejects(
        "BatchMatMul",
        &[(I32, &[2, 2]), (I32, &[2, 2])],
        &[],
        &["float"],
    );
}

/// Naive batched product with NumPy broadcasting and adj flags.
fn naive_bmm(x: &Tensor, y: &Tensor, ax: bool, ay: bool) -> (Vec<usize>, Vec<f64>) {
    let (xd, yd) = (x.dims(), y.dims());
    let (xv, yv) = (x.to_f64_vec(), y.to_f64_vec());
    let (rx, ry) = (xd.len(), yd.len());
    let (m, k) = if ax {
        (xd[rx - 1], xd[rx - 2])
    } else {
        (xd[rx - 2], xd[rx - 1])
    };
    let n = if ay { yd[ry - 2] } else { yd[ry - 1] };
    let (bx, by) = (&xd[..rx - 2], &yd[..ry - 2]);
    let rank = bx.len().max(by.len());
    let pad = |d: &[usize]| -> Vec<usize> {
        let mut v = vec![1; rank - d.len()];
        v.extend_from_slice(d);
        v
    };
    let (px, py) = (pad(bx), pad(by));
    let batch: Vec<usize> = px.iter().zip(&py).map(|(&a, &b)| a.max(b)).collect();
    let nb: usize = batch.iter().product();
    let mut out = vec![];
    for bi in 0..nb {
        let idx = unravel(bi, &batch);
        let ix: Vec<usize> = idx.iter().zip(&px).map(|(&i, &d)| i % d).collect();
        let iy: Vec<usize> = idx.iter().zip(&py).map(|(&i, &d)| i % d).collect();
        let (ox, oy) = (
            ravel(&ix, &px) * xd[rx - 2] * xd[rx - 1],
            ravel(&iy, &py) * yd[ry - 2] * yd[ry - 1],
        );
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    let a = if ax {
                        xv[ox + p * m + i]
                    } else {
                        xv[ox + i * k + p]
                    };
                    let b = if ay {
                        yv[oy + j * k + p]
                    } else {
                        yv[oy + p * n + j]
                    };
                    s += a * b;
                }
                out.push(s);
            }
        }
    }
    let mut dims = batch;
    dims.extend([m, n]);
    (dims, out)
}

#[test]
fn batch_mat_mul_kernel_matches_naive_product() {
    let mut seed = 3;
    // (x dims, y dims) before the adj flags are applied to the last two dims of each.
    let cases: &[(&[usize], &[usize])] = &[
        (&[2, 3, 4], &[2, 4, 5]),
        (&[2, 2, 3, 4], &[2, 2, 4, 3]),
        (&[3, 1, 4, 5], &[2, 5, 3]),
        (&[2, 3, 4], &[4, 6]),
        (&[4, 6], &[2, 6, 3]),
        (&[5, 4], &[4, 3]),
        (&[2, 0, 4], &[4, 3]),
        // Large enough for the parallel paths: inside one product, and across batch elements.
        (&[2, 80, 70], &[2, 70, 90]),
        (&[16, 32, 32], &[16, 32, 32]),
        (&[6, 40, 64], &[64, 72]),
    ];
    for &(xd, yd) in cases {
        for ax in [false, true] {
            for ay in [false, true] {
                let swap = |d: &[usize], t: bool| {
                    let mut d = d.to_vec();
                    let r = d.len();
                    if t {
                        d.swap(r - 1, r - 2);
                    }
                    d
                };
                let (xd, yd) = (swap(xd, ax), swap(yd, ay));
                let attrs = [("adj_x", ax.into()), ("adj_y", ay.into())];
                let (x64, y64) = (t64(&mut seed, &xd), t64(&mut seed, &yd));
                let (dims, want) = naive_bmm(&x64, &y64, ax, ay);
                let out = run_kernel("BatchMatMul", &attrs, &[x64, y64]).unwrap();
                assert_eq!(out[0].dims(), &dims[..], "{xd:?} {yd:?} {ax} {ay}");
                assert_close(&out[0].to_f64_vec(), &want, 1e-12, "f64");
                let (x32, y32) = (t32(&mut seed, &xd), t32(&mut seed, &yd));
                let (_, want) = naive_bmm(&x32, &y32, ax, ay);
                let out = run_kernel("BatchMatMul", &attrs, &[x32, y32]).unwrap();
                assert_close(&out[0].to_f64_vec(), &want, 1e-5, "f32");
            }
        }
    }
    // Runtime checks never panic.
    let e = run_kernel(
        "BatchMatMul",
        &[],
        &[
            Tensor::zeros(DType::F32, &[2, 3]).unwrap(),
            Tensor::zeros(DType::F32, &[4, 5]).unwrap(),
        ],
    );
    assert!(e.is_err());
}

#[test]
fn mat_mul_on_gemm_matches_naive_product_with_transposes() {
    let mut seed = 11;
    for &(m, k, n) in &[(1, 1, 1), (3, 7, 5), (65, 129, 33), (128, 64, 96)] {
        for ta in [false, true] {
            for tb in [false, true] {
                let a_dims = if ta { [k, m] } else { [m, k] };
                let b_dims = if tb { [n, k] } else { [k, n] };
                let (a, b) = (t32(&mut seed, &a_dims), t32(&mut seed, &b_dims));
                let out = run_kernel(
                    "MatMul",
                    &[("transpose_a", ta.into()), ("transpose_b", tb.into())],
                    &[a.clone(), b.clone()],
                )
                .unwrap();
                let a3 = a.reshaped(&[1, a_dims[0], a_dims[1]]).unwrap();
                let b3 = b.reshaped(&[1, b_dims[0], b_dims[1]]).unwrap();
                let (_, want) = naive_bmm(&a3, &b3, ta, tb);
                assert_close(&out[0].to_f64_vec(), &want, 1e-5, "MatMul f32");
            }
        }
    }
}

#[test]
fn batch_mat_mul_gradients() {
    // (x static, y static, adj_x, adj_y): plain batches, broadcasting on either side, a linear
    // layer ([B, T, C] · [C, N], the flattened gradient path) and every flag combination.
    let cases: &[(&[usize], &[usize])] = &[
        (&[2, 3, 4], &[2, 4, 2]),
        (&[2, 1, 3, 4], &[3, 4, 2]),
        (&[3, 4], &[2, 4, 2]),
        (&[2, 3, 4], &[4, 2]),
    ];
    for &(xd, yd) in cases {
        for ax in [false, true] {
            for ay in [false, true] {
                let swap = |d: &[usize], t: bool| {
                    let mut d = d.to_vec();
                    let r = d.len();
                    if t {
                        d.swap(r - 1, r - 2);
                    }
                    d
                };
                let (xd, yd) = (swap(xd, ax), swap(yd, ay));
                let sig = |d: &[usize]| d.iter().map(|&v| v as i64).collect::<Vec<_>>();
                let mut c = Case::new();
                let x = c.input("x", &sig(&xd), &xd, -1.0, 1.0);
                let y = c.input("y", &sig(&yd), &yd, -1.0, 1.0);
                let z =
                    c.b.op("BatchMatMul", "z")
                        .input(&x)
                        .input(&y)
                        .attr("adj_x", ax)
                        .attr("adj_y", ay)
                        .finish();
                let (xt, yt) = (
                    Tensor::zeros(DType::F64, &xd).unwrap(),
                    Tensor::zeros(DType::F64, &yd).unwrap(),
                );
                let (out_dims, _) = naive_bmm(&xt, &yt, ax, ay);
                c.check(&z, &out_dims, &["x", "y"]);
            }
        }
    }
    // An unknown batch dimension on the linear-layer path.
    let mut c = Case::new();
    let x = c.input("x", &[-1, 3, 4], &[2, 3, 4], -1.0, 1.0);
    let y = c.input("y", &[5, 4], &[5, 4], -1.0, 1.0);
    let z =
        c.b.op("BatchMatMul", "z")
            .input(&x)
            .input(&y)
            .attr("adj_y", true)
            .finish();
    c.check(&z, &[2, 3, 5], &["x", "y"]);
}

// ---------------------------------------------------------------------------------------------
// Transpose, Split, Concat, Slice
// ---------------------------------------------------------------------------------------------

#[test]
fn layout_shape_rules() {
    use DType::*;
    assert_eq!(
        validate(
            "Transpose",
            &[(F32, &[-1, 64, 4, 32])],
            &[("perm", ints(&[0, 2, 1, 3]))]
        ),
        Ok(vec![tt(F32, &[-1, 4, 64, 32])])
    );
    rejects(
        "Transpose",
        &[(F32, &[2, 3])],
        &[("perm", ints(&[0, 0]))],
        &["permutation"],
    );
    rejects(
        "Transpose",
        &[(F32, &[2, 3])],
        &[("perm", ints(&[1, 0, 2]))],
        &["permutation"],
    );
    rejects("Transpose", &[(F32, &[2, 3])], &[], &["perm"]);

    let split = |axis: i64, n: i64| {
        vec![
            ("axis", AttrValue::Int(axis)),
            ("num_split", AttrValue::Int(n)),
        ]
    };
    assert_eq!(
        validate("Split", &[(F32, &[-1, 8, 384])], &split(-1, 3)),
        Ok(vec![tt(F32, &[-1, 8, 128]); 3])
    );
    rejects(
        "Split",
        &[(F32, &[4, 10])],
        &split(1, 3),
        &["10", "num_split 3"],
    );
    rejects("Split", &[(F32, &[4, 10])], &split(2, 2), &["axis 2"]);
    rejects("Split", &[(F32, &[4, 10])], &split(0, 0), &[">= 1"]);

    let axis = |a: i64| vec![("axis", AttrValue::Int(a))];
    assert_eq!(
        validate(
            "Concat",
            &[(F32, &[2, 3, 4]), (F32, &[2, 5, 4]), (F32, &[-1, -1, 4])],
            &axis(1)
        ),
        Ok(vec![tt(F32, &[2, -1, 4])])
    );
    assert_eq!(
        validate("Concat", &[(F32, &[2, 3]), (F32, &[2, 5])], &axis(-1)),
        Ok(vec![tt(F32, &[2, 8])])
    );
    rejects(
        "Concat",
        &[(F32, &[2, 3]), (F32, &[3, 3])],
        &axis(1),
        &["values[1]", "[3, 3]"],
    );
    rejects(
        "Concat",
        &[(F32, &[2, 3]), (F32, &[2, 3, 1])],
        &axis(0),
        &["rank"],
    );
    rejects(
        "Concat",
        &[(F32, &[2, 3]), (F64, &[2, 3])],
        &axis(0),
        &["f64"],
    );

    let sl = |b: &[i64], s: &[i64]| vec![("begin", ints(b)), ("size", ints(s))];
    assert_eq!(
        validate("Slice", &[(F32, &[4, 6])], &sl(&[1, 2], &[2, -1])),
        Ok(vec![tt(F32, &[2, 4])])
    );
    rejects(
        "Slice",
        &[(F32, &[4, 6])],
        &sl(&[3, 0], &[2, -1]),
        &["dimension 0"],
    );
    rejects(
        "Slice",
        &[(F32, &[4, 6])],
        &sl(&[0], &[1]),
        &["one entry per dimension"],
    );
}

#[test]
fn transpose_kernel_matches_index_mapping() {
    let mut seed = 5;
    let dims = [2usize, 3, 4, 5];
    let x = t64(&mut seed, &dims);
    let xv = x.to_f64_vec();
    for perm in [
        [0usize, 2, 1, 3],
        [3, 2, 1, 0],
        [1, 0, 3, 2],
        [0, 1, 2, 3],
        [2, 3, 0, 1],
    ] {
        let attrs = [("perm", ints(&perm.map(|p| p as i64)))];
        let out = run_kernel("Transpose", &attrs, std::slice::from_ref(&x)).unwrap();
        let od: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
        assert_eq!(out[0].dims(), &od[..]);
        let want: Vec<f64> = (0..xv.len())
            .map(|i| {
                let oi = unravel(i, &od);
                let mut ii = [0usize; 4];
                for (k, &p) in perm.iter().enumerate() {
                    ii[p] = oi[k];
                }
                xv[ravel(&ii, &dims)]
            })
            .collect();
        assert_eq!(out[0].to_f64_vec(), want, "{perm:?}");
    }
    // Any dtype; the identity permutation shares the buffer.
    let i = Tensor::from_slice(&[2, 3], &[1i32, 2, 3, 4, 5, 6]).unwrap();
    let out = run_kernel(
        "Transpose",
        &[("perm", ints(&[1, 0]))],
        std::slice::from_ref(&i),
    )
    .unwrap();
    assert_eq!(out[0].as_slice::<i32>().unwrap(), &[1, 4, 2, 5, 3, 6]);
    let out = run_kernel(
        "Transpose",
        &[("perm", ints(&[0, 1]))],
        std::slice::from_ref(&i),
    )
    .unwrap();
    assert_eq!(out[0].data_ptr(), i.data_ptr());
    // A perm that does not fit the run-time rank is an error, not a panic.
    let types = [TensorType::new(DType::I32, Shape::unknown())];
    let e = run_kernel_with(
        "Transpose",
        "t",
        &[("perm", ints(&[1, 0, 2]))],
        &types,
        &[i],
        &[],
    )
    .unwrap_err();
    assert!(e.contains("permutation"), "{e}");
}

#[test]
fn split_concat_and_slice_kernels_match_naive_indexing() {
    let mut seed = 9;
    let dims = [2usize, 6, 3];
    let x = t64(&mut seed, &dims);
    let xv = x.to_f64_vec();
    for (axis, n) in [(0i64, 2usize), (1, 3), (-1, 3), (1, 1)] {
        let a = if axis < 0 {
            (3 + axis) as usize
        } else {
            axis as usize
        };
        let attrs = [
            ("axis", AttrValue::Int(axis)),
            ("num_split", AttrValue::Int(n as i64)),
        ];
        let parts = run_kernel("Split", &attrs, std::slice::from_ref(&x)).unwrap();
        assert_eq!(parts.len(), n);
        let mut pd = dims.to_vec();
        pd[a] /= n;
        for (k, p) in parts.iter().enumerate() {
            assert_eq!(p.dims(), &pd[..]);
            let want: Vec<f64> = (0..p.num_elements())
                .map(|i| {
                    let mut idx = unravel(i, &pd);
                    idx[a] += k * pd[a];
                    xv[ravel(&idx, &dims)]
                })
                .collect();
            assert_eq!(p.to_f64_vec(), want, "axis {axis} part {k}");
        }
        // Concat undoes Split.
        let back = run_kernel("Concat", &[("axis", AttrValue::Int(axis))], &parts).unwrap();
        assert_eq!(back[0].dims(), &dims);
        assert_eq!(back[0].to_f64_vec(), xv);
    }
    // Concat of unequal parts against naive indexing.
    let (a, b) = (t64(&mut seed, &[2, 1, 3]), t64(&mut seed, &[2, 4, 3]));
    let out = run_kernel(
        "Concat",
        &[("axis", AttrValue::Int(1))],
        &[a.clone(), b.clone()],
    )
    .unwrap();
    let (av, bv) = (a.to_f64_vec(), b.to_f64_vec());
    let want: Vec<f64> = (0..30)
        .map(|i| {
            let idx = unravel(i, &[2, 5, 3]);
            if idx[1] < 1 {
                av[ravel(&idx, &[2, 1, 3])]
            } else {
                bv[ravel(&[idx[0], idx[1] - 1, idx[2]], &[2, 4, 3])]
            }
        })
        .collect();
    assert_eq!(out[0].to_f64_vec(), want);
    let e = run_kernel(
        "Concat",
        &[("axis", AttrValue::Int(1))],
        &[a, t64(&mut seed, &[3, 1, 3])],
    )
    .unwrap_err();
    assert!(e.contains("values[1]"), "{e}");
    // Split of a run-time size that does not divide.
    let types = [TensorType::new(
        DType::F64,
        Shape::partial(vec![None, Some(3)]),
    )];
    let e = run_kernel_with(
        "Split",
        "s",
        &[
            ("axis", AttrValue::Int(0)),
            ("num_split", AttrValue::Int(4)),
        ],
        &types,
        std::slice::from_ref(&x),
        &[],
    )
    .unwrap_err();
    assert!(e.contains("size 2") && e.contains("num_split 4"), "{e}");
    // Slice.
    let out = run_kernel(
        "Slice",
        &[("begin", ints(&[1, 2, 0])), ("size", ints(&[-1, 3, 2]))],
        std::slice::from_ref(&x),
    )
    .unwrap();
    assert_eq!(out[0].dims(), &[1, 3, 2]);
    let want: Vec<f64> = (0..6)
        .map(|i| {
            let idx = unravel(i, &[1, 3, 2]);
            xv[ravel(&[idx[0] + 1, idx[1] + 2, idx[2]], &dims)]
        })
        .collect();
    assert_eq!(out[0].to_f64_vec(), want);
}

#[test]
fn slice_gradient_and_slice_grad_errors() {
    let mut c = Case::new();
    let x = c.input("x", &[-1, 5, 3], &[2, 5, 3], -1.0, 1.0);
    let y =
        c.b.op("Slice", "y")
            .input(&x)
            .attr("begin", ints(&[1, 2, 0]))
            .attr("size", ints(&[-1, 2, 3]))
            .finish();
    c.check(&y, &[1, 2, 3], &["x"]);
    let e = run_kernel(
        "SliceGrad",
        &[("begin", ints(&[0, 4]))],
        &[
            Tensor::zeros(DType::F32, &[2, 2]).unwrap(),
            Tensor::zeros(DType::F32, &[2, 5]).unwrap(),
        ],
    )
    .unwrap_err();
    assert!(e.contains("does not fit"), "{e}");
}

#[test]
fn layout_gradients() {
    let mut c = Case::new();
    let x = c.input("x", &[2, 3, 4], &[2, 3, 4], -1.0, 1.0);
    let y =
        c.b.op("Transpose", "y")
            .input(&x)
            .attr("perm", ints(&[2, 0, 1]))
            .finish();
    c.check(&y, &[4, 2, 3], &["x"]);

    // Both outputs used.
    let mut c = Case::new();
    let x = c.input("x", &[2, 6], &[2, 6], -1.0, 1.0);
    let s =
        c.b.op("Split", "s")
            .input(&x)
            .attr("axis", -1i64)
            .attr("num_split", 2i64)
            .finish();
    let z = c.b.binary("Mul", "z", s.out(0), s.out(1));
    c.check(&z, &[2, 3], &["x"]);
    // Only the middle output used: the others' gradients are zeros.
    let mut c = Case::new();
    let x = c.input("x", &[-1, 6], &[2, 6], -1.0, 1.0);
    let s =
        c.b.op("Split", "s")
            .input(&x)
            .attr("axis", 1i64)
            .attr("num_split", 3i64)
            .finish();
    let z = c.b.unary("Square", "z", s.out(1));
    c.check(&z, &[2, 2], &["x"]);

    for axis in [1i64, -1, 0] {
        let mut c = Case::new();
        let a = c.input("a", &[2, 1, 3], &[2, 1, 3], -1.0, 1.0);
        let b = c.input("b", &[2, 2, 3], &[2, 2, 3], -1.0, 1.0);
        let d = c.input("d", &[2, 3, 3], &[2, 3, 3], -1.0, 1.0);
        let (a, b, d) = if axis == 1 {
            (a, b, d)
        } else {
            // Same-shaped inputs for the other axes.
            let mut c2 = Case::new();
            let a = c2.input("a", &[2, 2, 3], &[2, 2, 3], -1.0, 1.0);
            let b = c2.input("b", &[2, 2, 3], &[2, 2, 3], -1.0, 1.0);
            let d = c2.input("d", &[2, 2, 3], &[2, 2, 3], -1.0, 1.0);
            let y =
                c2.b.op("Concat", "y")
                    .inputs([&a, &b, &d])
                    .attr("axis", axis)
                    .finish();
            let out = if axis == 0 { [6, 2, 3] } else { [2, 2, 9] };
            c2.check(&y, &out, &["a", "b", "d"]);
            continue;
        };
        let y =
            c.b.op("Concat", "y")
                .inputs([&a, &b, &d])
                .attr("axis", axis)
                .finish();
        c.check(&y, &[2, 6, 3], &["a", "b", "d"]);
    }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------------------------

#[test]
fn layer_norm_shape_rule() {
    use DType::*;
    assert_eq!(
        validate(
            "LayerNorm",
            &[(F32, &[-1, 64, 128]), (F32, &[128]), (F32, &[128])],
            &[]
        ),
        Ok(vec![
            tt(F32, &[-1, 64, 128]),
            tt(F32, &[-1, 64]),
            tt(F32, &[-1, 64])
        ])
    );
    rejects(
        "LayerNorm",
        &[(F32, &[4, 128]), (F32, &[64]), (F32, &[128])],
        &[],
        &["gamma", "[64]", "128"],
    );
    rejects(
        "LayerNorm",
        &[(F32, &[4, 8]), (F32, &[8]), (F64, &[8])],
        &[],
        &["beta", "f64"],
    );
    rejects(
        "LayerNorm",
        &[(F32, &[]), (F32, &[1]), (F32, &[1])],
        &[],
        &["rank >= 1"],
    );
    rejects(
        "LayerNorm",
        &[(I32, &[4, 8]), (I32, &[8]), (I32, &[8])],
        &[],
        &["float"],
    );
    rejects(
        "LayerNorm",
        &[(F32, &[4, 8]), (F32, &[8]), (F32, &[8])],
        &[("epsilon", AttrValue::Float(-1.0))],
        &["epsilon"],
    );
    assert_eq!(
        validate(
            "LayerNormGrad",
            &[
                (F32, &[4, 8]),
                (F32, &[4, 8]),
                (F32, &[8]),
                (F32, &[4]),
                (F32, &[4])
            ],
            &[]
        ),
        Ok(vec![tt(F32, &[4, 8]), tt(F32, &[8]), tt(F32, &[8])])
    );
    rejects(
        "LayerNormGrad",
        &[
            (F32, &[4, 8]),
            (F32, &[4, 8]),
            (F32, &[8]),
            (F32, &[5]),
            (F32, &[4]),
        ],
        &[],
        &["mean", "[5]"],
    );
}

#[test]
fn layer_norm_kernel_matches_naive_formula() {
    let mut seed = 21;
    for c in [1usize, 7, 128] {
        for eps in [1e-5, 0.1] {
            let dims = [3, 2, c];
            let (x, g, b) = (
                t64(&mut seed, &dims),
                t64(&mut seed, &[c]),
                t64(&mut seed, &[c]),
            );
            let out = run_kernel(
                "LayerNorm",
                &[("epsilon", AttrValue::Float(eps))],
                &[x.clone(), g.clone(), b.clone()],
            )
            .unwrap();
            let (xv, gv, bv) = (x.to_f64_vec(), g.to_f64_vec(), b.to_f64_vec());
            let (mut want, mut means, mut rstds) = (vec![], vec![], vec![]);
            for row in xv.chunks(c) {
                let mu = row.iter().sum::<f64>() / c as f64;
                let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / c as f64;
                let r = 1.0 / (var + eps).sqrt();
                want.extend(
                    row.iter()
                        .zip(&gv)
                        .zip(&bv)
                        .map(|((v, g), b)| (v - mu) * r * g + b),
                );
                means.push(mu);
                rstds.push(r);
            }
            assert_eq!(out[0].dims(), &dims);
            assert_eq!(out[1].dims(), &[3, 2]);
            assert_close(&out[0].to_f64_vec(), &want, 1e-12, "y");
            assert_close(&out[1].to_f64_vec(), &means, 1e-12, "mean");
            assert_close(&out[2].to_f64_vec(), &rstds, 1e-12, "rstd");
            // f32 agrees with the f64 reference to f32 precision.
            let f = |t: &Tensor| {
                let v: Vec<f32> = t.to_f64_vec().iter().map(|&v| v as f32).collect();
                Tensor::from_slice(t.dims(), &v).unwrap()
            };
            let out32 = run_kernel(
                "LayerNorm",
                &[("epsilon", AttrValue::Float(eps))],
                &[f(&x), f(&g), f(&b)],
            )
            .unwrap();
            assert_close(&out32[0].to_f64_vec(), &want, 1e-5, "y f32");
        }
    }
}

#[test]
fn layer_norm_gradients_c1_and_c7() {
    for c in [1usize, 7] {
        let mut case = Case::new();
        let x = case.input("x", &[-1, 3, c as i64], &[2, 3, c], -1.0, 1.0);
        let g = case.input("gamma", &[c as i64], &[c], 0.5, 1.5);
        let b = case.input("beta", &[c as i64], &[c], -1.0, 1.0);
        let y = case
            .b
            .op("LayerNorm", "ln")
            .input(&x)
            .input(&g)
            .input(&b)
            .finish();
        case.check(&y, &[2, 3, c], &["x", "gamma", "beta"]);
    }
}

// ---------------------------------------------------------------------------------------------
// Gelu
// ---------------------------------------------------------------------------------------------

fn gelu_ref(x: f64, tanh: bool) -> f64 {
    if tanh {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    } else {
        // erf by its Maclaurin series (|x/√2| < 3 here: 60 terms are plenty).
        let z = x / std::f64::consts::SQRT_2;
        let (mut term, mut sum) = (z, z);
        for n in 1..60 {
            term *= -z * z / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        0.5 * x * (1.0 + 2.0 / std::f64::consts::PI.sqrt() * sum)
    }
}

#[test]
fn gelu_kernel_and_shape_rule() {
    let mut seed = 31;
    let x = tensor(&mut seed, &[4, 5], -3.0, 3.0);
    for (approx, tanh) in [("tanh", true), ("none", false)] {
        let out = run_kernel(
            "Gelu",
            &[("approximate", approx.into())],
            std::slice::from_ref(&x),
        )
        .unwrap();
        let want: Vec<f64> = x.to_f64_vec().iter().map(|&v| gelu_ref(v, tanh)).collect();
        assert_close(&out[0].to_f64_vec(), &want, 1e-12, approx);
    }
    // The default is the tanh form.
    let out = run_kernel("Gelu", &[], std::slice::from_ref(&x)).unwrap();
    assert_close(
        &out[0].to_f64_vec(),
        &x.to_f64_vec()
            .iter()
            .map(|&v| gelu_ref(v, true))
            .collect::<Vec<_>>(),
        1e-12,
        "default",
    );
    rejects(
        "Gelu",
        &[(DType::F32, &[2])],
        &[("approximate", "fast".into())],
        &["\"fast\""],
    );
    rejects("Gelu", &[(DType::I32, &[2])], &[], &["float"]);
    rejects(
        "GeluGrad",
        &[(DType::F32, &[2]), (DType::F32, &[3])],
        &[],
        &["[2]", "[3]"],
    );
}

#[test]
fn gelu_gradients() {
    for approx in ["tanh", "none"] {
        let mut c = Case::new();
        let x = c.input("x", &[3, 4], &[3, 4], -3.0, 3.0);
        let y =
            c.b.op("Gelu", "y")
                .input(&x)
                .attr("approximate", approx)
                .finish();
        c.check(&y, &[3, 4], &["x"]);
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax (causal) and SoftmaxGrad
// ---------------------------------------------------------------------------------------------

fn naive_softmax(x: &[f64], t: usize, s: usize, causal: bool) -> Vec<f64> {
    let mut out = vec![];
    for (r, row) in x.chunks(s).enumerate() {
        let i = r % t;
        let allowed = |j: usize| !causal || (j as i64) <= i as i64 + s as i64 - t as i64;
        let m = row
            .iter()
            .enumerate()
            .filter(|(j, _)| allowed(*j))
            .map(|(_, &v)| v)
            .fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row
            .iter()
            .enumerate()
            .filter(|(j, _)| allowed(*j))
            .map(|(_, &v)| (v - m).exp())
            .sum();
        out.extend(
            row.iter()
                .enumerate()
                .map(|(j, &v)| if allowed(j) { (v - m).exp() / z } else { 0.0 }),
        );
    }
    out
}

#[test]
fn causal_softmax_kernel_masks_exactly() {
    let mut seed = 41;
    for (t, s) in [(4usize, 4usize), (3, 5), (1, 6), (5, 3)] {
        let x = tensor(&mut seed, &[2, t, s], -3.0, 3.0);
        for causal in [false, true] {
            let out = run_kernel(
                "Softmax",
                &[("causal", causal.into())],
                std::slice::from_ref(&x),
            )
            .unwrap();
            let want = naive_softmax(&x.to_f64_vec(), t, s, causal);
            assert_close(
                &out[0].to_f64_vec(),
                &want,
                1e-12,
                &format!("{t}x{s} {causal}"),
            );
            if causal {
                // Masked entries are exactly zero, never NaN.
                for (g, w) in out[0].to_f64_vec().iter().zip(&want) {
                    if *w == 0.0 {
                        assert_eq!(*g, 0.0);
                    }
                }
            }
        }
    }
    rejects(
        "Softmax",
        &[(DType::F32, &[5])],
        &[("causal", true.into())],
        &["rank >= 2"],
    );
    assert!(validate("Softmax", &[(DType::F32, &[5])], &[]).is_ok());
}

#[test]
fn softmax_gradients_plain_and_causal() {
    for (t, s, causal) in [(3i64, 5i64, false), (4, 4, true), (3, 5, true)] {
        let mut c = Case::new();
        let x = c.input("x", &[2, t, s], &[2, t as usize, s as usize], -2.0, 2.0);
        let y =
            c.b.op("Softmax", "y")
                .input(&x)
                .attr("causal", causal)
                .finish();
        c.check(&y, &[2, t as usize, s as usize], &["x"]);
    }
    // SoftmaxGrad against its formula.
    let mut seed = 43;
    let dy = t64(&mut seed, &[2, 3]);
    let y = run_kernel("Softmax", &[], &[t64(&mut seed, &[2, 3])])
        .unwrap()
        .remove(0);
    let out = run_kernel("SoftmaxGrad", &[], &[dy.clone(), y.clone()]).unwrap();
    let (d, yv) = (dy.to_f64_vec(), y.to_f64_vec());
    let mut want = vec![];
    for r in 0..2 {
        let s: f64 = (0..3).map(|j| d[r * 3 + j] * yv[r * 3 + j]).sum();
        want.extend((0..3).map(|j| yv[r * 3 + j] * (d[r * 3 + j] - s)));
    }
    assert_close(&out[0].to_f64_vec(), &want, 1e-12, "SoftmaxGrad");
}

// ---------------------------------------------------------------------------------------------
// Dropout
// ---------------------------------------------------------------------------------------------

fn run_dropout(x: &Tensor, rate: f64, seed: i64, step: u64) -> Tensor {
    use dflow_graph::kernel::KernelContext;
    use dflow_graph::ops::testing::{attrs_with_defaults, build_kernel};
    let attrs = attrs_with_defaults(
        "Dropout",
        &[
            ("rate", AttrValue::Float(rate)),
            ("seed", AttrValue::Int(seed)),
        ],
    )
    .unwrap();
    let types = [TensorType::new(x.dtype(), x.shape())];
    let k = build_kernel("Dropout", "drop", &attrs, &types).unwrap();
    let mut outputs = vec![None];
    k.compute(&mut KernelContext {
        node: "drop",
        inputs: &[x],
        variables: &[],
        step,
        outputs: &mut outputs,
        collectives: None,
        output_memory: None,
    })
    .unwrap();
    outputs.pop().flatten().unwrap()
}

#[test]
fn dropout_kernel() {
    let x = Tensor::from_slice(&[4000], &vec![1.5f32; 4000]).unwrap();
    // rate 0 is the identity, sharing the buffer.
    let y = run_dropout(&x, 0.0, 1, 0);
    assert_eq!(y.data_ptr(), x.data_ptr());
    let y = run_dropout(&x, 0.25, 7, 3);
    let v = y.to_f64_vec();
    let kept = v.iter().filter(|&&e| e != 0.0).count();
    assert!(
        v.iter().all(|&e| e == 0.0 || (e - 2.0).abs() < 1e-6),
        "kept scaled by 1/(1-rate)"
    );
    assert!((kept as f64 / 4000.0 - 0.75).abs() < 0.03, "kept {kept}");
    // Reproducible for (seed, step); another step or seed draws another mask.
    assert_eq!(run_dropout(&x, 0.25, 7, 3).to_f64_vec(), v);
    assert_ne!(run_dropout(&x, 0.25, 7, 4).to_f64_vec(), v);
    assert_ne!(run_dropout(&x, 0.25, 8, 3).to_f64_vec(), v);
    rejects(
        "Dropout",
        &[(DType::F32, &[2])],
        &[("rate", AttrValue::Float(1.0))],
        &["[0, 1)"],
    );
    rejects("Dropout", &[(DType::I64, &[2])], &[], &["float"]);
}

#[test]
fn dropout_gradient_uses_the_same_mask() {
    let mut c = Case::new();
    let x = c.input("x", &[4, 6], &[4, 6], -1.0, 1.0);
    let y =
        c.b.op("Dropout", "y")
            .input(&x)
            .attr("rate", 0.4)
            .attr("seed", 5i64)
            .finish();
    c.check(&y, &[4, 6], &["x"]);
}

// ---------------------------------------------------------------------------------------------
// Coverage
// ---------------------------------------------------------------------------------------------

#[test]
fn the_ops_a_gpt_needs_exist_with_gradients() {
    let reg = dflow_graph::registry();
    for op in [
        "Gather",
        "BatchMatMul",
        "Transpose",
        "Split",
        "Concat",
        "LayerNorm",
        "Gelu",
        "Softmax",
        "Dropout",
        "Reshape",
        "Mean",
        "Sum",
        "Mul",
        "Add",
        "SparseSoftmaxCrossEntropyWithLogits",
        "Sqrt",
        "Cast",
        "MatMul",
    ] {
        let def = reg.get(op).unwrap_or_else(|| panic!("{op} missing"));
        assert!(def.gradient.is_some(), "{op} has no gradient");
        assert!(
            def.kernel_for(&dflow_graph::DeviceType::CPU).is_some(),
            "{op} has no kernel"
        );
    }
    for op in [
        "GatherGrad",
        "SparseRowsToDense",
        "LayerNormGrad",
        "GeluGrad",
        "SoftmaxGrad",
        "Slice",
    ] {
        assert!(
            reg.get(op)
                .is_some_and(|d| d.kernel_for(&dflow_graph::DeviceType::CPU).is_some()),
            "{op}"
        );
    }
    assert!(reg.get("Split").unwrap().has_variadic_output());
}

#[test]
fn a_consumer_of_a_missing_split_output_is_rejected() {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[4, 6]);
    let s = b
        .op("Split", "s")
        .input(&x)
        .attr("axis", 1i64)
        .attr("num_split", 2i64)
        .finish();
    b.op("Identity", "ok").input(s.out(1)).finish();
    b.op("Identity", "bad").input(s.out(2)).finish();
    let e = b.build().unwrap_err().to_string();
    assert!(e.contains("bad") && e.contains("s:2"), "{e}");
    // The evaluator sees both outputs.
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F64, &[2, 4]);
    let s = b
        .op("Split", "s")
        .input(&x)
        .attr("axis", 1i64)
        .attr("num_split", 2i64)
        .finish();
    b.op("Identity", "second").input(s.out(1)).finish();
    let mut eval = Eval {
        feeds: HashMap::from([(
            "x".to_string(),
            Tensor::from_slice(&[2, 4], &[1.0f64, 2., 3., 4., 5., 6., 7., 8.]).unwrap(),
        )]),
        vars: HashMap::new(),
    };
    let out = eval.run(
        &b.to_def(),
        &[InputRef::Data {
            node: "second".into(),
            index: 0,
        }
        .to_string()],
    );
    assert_eq!(out[0].to_f64_vec(), vec![3., 4., 7., 8.]);
}

#[test]
fn row_kernels_split_over_tasks_match_naive_results() {
    // Big enough that the kernels split rows over several pool tasks (16384 elements each).
    let mut seed = 51;
    let (rows, c) = (4000usize, 7usize);
    let x = t64(&mut seed, &[rows, c]);
    let (g, b) = (t64(&mut seed, &[c]), t64(&mut seed, &[c]));
    let ln = run_kernel("LayerNorm", &[], &[x.clone(), g.clone(), b.clone()]).unwrap();
    let (xv, gv, bv) = (x.to_f64_vec(), g.to_f64_vec(), b.to_f64_vec());
    let (mut want, mut xhat, mut rstd) = (vec![], vec![], vec![]);
    for row in xv.chunks(c) {
        let mu = row.iter().sum::<f64>() / c as f64;
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / c as f64;
        let r = 1.0 / (var + 1e-5).sqrt();
        xhat.extend(row.iter().map(|v| (v - mu) * r));
        want.extend(
            row.iter()
                .zip(&gv)
                .zip(&bv)
                .map(|((v, g), b)| (v - mu) * r * g + b),
        );
        rstd.push(r);
    }
    assert_close(&ln[0].to_f64_vec(), &want, 1e-12, "LayerNorm y");
    // LayerNormGrad: dgamma/dbeta sum over every task's rows.
    let dy = t64(&mut seed, &[rows, c]);
    let grads = run_kernel(
        "LayerNormGrad",
        &[],
        &[dy.clone(), x, g, ln[1].clone(), ln[2].clone()],
    )
    .unwrap();
    let dyv = dy.to_f64_vec();
    let (mut dgamma, mut dbeta, mut dx) = (vec![0.0; c], vec![0.0; c], vec![]);
    for r in 0..rows {
        let (d, xh) = (&dyv[r * c..(r + 1) * c], &xhat[r * c..(r + 1) * c]);
        let gj: Vec<f64> = d.iter().zip(&gv).map(|(d, g)| d * g).collect();
        let a = gj.iter().sum::<f64>() / c as f64;
        let bb = gj.iter().zip(xh).map(|(g, x)| g * x).sum::<f64>() / c as f64;
        for j in 0..c {
            dgamma[j] += d[j] * xh[j];
            dbeta[j] += d[j];
            dx.push(rstd[r] * (gj[j] - a - xh[j] * bb));
        }
    }
    assert_close(&grads[0].to_f64_vec(), &dx, 1e-10, "dx");
    assert_close(&grads[1].to_f64_vec(), &dgamma, 1e-10, "dgamma");
    assert_close(&grads[2].to_f64_vec(), &dbeta, 1e-10, "dbeta");
    // Causal softmax whose tasks start in the middle of a [T, S] block.
    let (t, s) = (64usize, 100usize);
    let x = tensor(&mut seed, &[3, t, s], -3.0, 3.0);
    let y = run_kernel(
        "Softmax",
        &[("causal", true.into())],
        std::slice::from_ref(&x),
    )
    .unwrap();
    let want = naive_softmax(&x.to_f64_vec(), t, s, true);
    assert_close(&y[0].to_f64_vec(), &want, 1e-12, "causal softmax");
    let dy = t64(&mut seed, &[3, t, s]);
    let dx = run_kernel("SoftmaxGrad", &[], &[dy.clone(), y[0].clone()]).unwrap();
    let (d, yv) = (dy.to_f64_vec(), y[0].to_f64_vec());
    let mut want = vec![];
    for (dr, yr) in d.chunks(s).zip(yv.chunks(s)) {
        let sum: f64 = dr.iter().zip(yr).map(|(a, b)| a * b).sum();
        want.extend(dr.iter().zip(yr).map(|(a, b)| b * (a - sum)));
    }
    assert_close(&dx[0].to_f64_vec(), &want, 1e-12, "SoftmaxGrad");
    // Gelu over several tasks.
    let x = tensor(&mut seed, &[40_000], -4.0, 4.0);
    let y = run_kernel("Gelu", &[], std::slice::from_ref(&x)).unwrap();
    let want: Vec<f64> = x.to_f64_vec().iter().map(|&v| gelu_ref(v, true)).collect();
    assert_close(&y[0].to_f64_vec(), &want, 1e-12, "Gelu");
}

/// A one-block GPT in miniature, end to end through autodiff: token and position embeddings
/// (Gather, broadcast Add), LayerNorm, the fused QKV projection (BatchMatMul on [B, T, C]·[C, 3C])
/// and Split, heads (Reshape, Transpose), scaled causal attention (BatchMatMul with adj_y, Mul by
/// a scalar, causal Softmax), the output projection with nn.Linear's [out, in] layout (adj_y), a
/// residual, Gelu, and an LM head tied to the token embedding (wte used twice), with the mean
/// cross-entropy as the loss. Every parameter's gradient against finite differences.
#[test]
fn tiny_gpt_block_gradients() {
    let (b, t, c, h, v) = (2usize, 3usize, 4usize, 2usize, 5usize);
    let hd = c / h;
    let mut cs = Case::new();
    let idx = cs.b.placeholder("idx", DType::I64, &[b as i64, t as i64]);
    let pos = cs.b.placeholder("pos", DType::I64, &[t as i64]);
    let targets = cs.b.placeholder("targets", DType::I64, &[(b * t) as i64]);
    cs.eval.feeds.insert(
        "idx".into(),
        Tensor::from_slice(&[b, t], &[0i64, 4, 4, 2, 1, 0]).unwrap(),
    );
    cs.eval.feeds.insert(
        "pos".into(),
        Tensor::from_slice(&[t], &[0i64, 1, 2]).unwrap(),
    );
    cs.eval.feeds.insert(
        "targets".into(),
        Tensor::from_slice(&[b * t], &[4i64, 4, 2, 1, 0, 3]).unwrap(),
    );
    let wte = cs.variable("wte", &[v, c]);
    let wpe = cs.variable("wpe", &[t, c]);
    let gamma = cs.variable("gamma", &[c]);
    let beta = cs.variable("beta", &[c]);
    let w_attn = cs.variable("w_attn", &[c, 3 * c]);
    let w_proj = cs.variable("w_proj", &[c, c]);
    let g = &mut cs.b;
    let tok = g.op("Gather", "tok").input(&wte).input(&idx).finish();
    let pe = g.op("Gather", "pe").input(&wpe).input(&pos).finish();
    let x = g.binary("Add", "x", &tok, &pe);
    let ln = g
        .op("LayerNorm", "ln")
        .input(&x)
        .input(&gamma)
        .input(&beta)
        .finish();
    let qkv = g
        .op("BatchMatMul", "qkv")
        .input(&ln)
        .input(&w_attn)
        .finish();
    let split = g
        .op("Split", "split")
        .input(&qkv)
        .attr("axis", -1i64)
        .attr("num_split", 3i64)
        .finish();
    let heads = |g: &mut GraphBuilder, k: usize, name: &str| {
        let r = g
            .op("Reshape", &format!("{name}_r"))
            .input(split.out(k))
            .attr("shape", vec![b as i64, t as i64, h as i64, hd as i64])
            .finish();
        g.op("Transpose", name)
            .input(&r)
            .attr("perm", vec![0i64, 2, 1, 3])
            .finish()
    };
    let (q, k, vv) = (heads(g, 0, "q"), heads(g, 1, "k"), heads(g, 2, "v"));
    let att = g
        .op("BatchMatMul", "att")
        .input(&q)
        .input(&k)
        .attr("adj_y", true)
        .finish();
    let scale = g.constant("scale", Tensor::scalar(1.0 / (hd as f64).sqrt()));
    let scaled = g.binary("Mul", "scaled", &att, &scale);
    let p = g
        .op("Softmax", "p")
        .input(&scaled)
        .attr("causal", true)
        .finish();
    let o = g.op("BatchMatMul", "o").input(&p).input(&vv).finish();
    let o = g
        .op("Transpose", "o_t")
        .input(&o)
        .attr("perm", vec![0i64, 2, 1, 3])
        .finish();
    let o = g
        .op("Reshape", "o_r")
        .input(&o)
        .attr("shape", vec![b as i64, t as i64, c as i64])
        .finish();
    let proj = g
        .op("BatchMatMul", "proj")
        .input(&o)
        .input(&w_proj)
        .attr("adj_y", true)
        .finish();
    let res = g.binary("Add", "res", &x, &proj);
    let act = g.unary("Gelu", "act", &res);
    let logits = g
        .op("BatchMatMul", "logits")
        .input(&act)
        .input(&wte)
        .attr("adj_y", true)
        .finish();
    let flat = g
        .op("Reshape", "flat")
        .input(&logits)
        .attr("shape", vec![-1i64, v as i64])
        .finish();
    let xent = g
        .op("SparseSoftmaxCrossEntropyWithLogits", "xent")
        .input(&flat)
        .input(&targets)
        .finish();
    let loss = g.op("Mean", "loss").input(&xent).finish();
    cs.check(
        &loss,
        &[],
        &["wte", "wpe", "gamma", "beta", "w_attn", "w_proj"],
    );
}
