//! Optimizer update kernels against hand-computed values, and the training-spec expansion.

use dflow_graph::kernel::{KernelContext, KernelInit, VariableCell};
use dflow_graph::ops::{registry, InferCtx, TensorType};
use dflow_graph::train::{expand_training, ExpandError, OptimizerKind, OptimizerSpec, TrainSpec};
use dflow_graph::{AttrValue, DType, GraphDef, InputRef, Shape, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

mod common;
use common::Eval;

/// Runs op `op`'s CPU kernel once: `vars` are the cells behind its reference inputs (in order),
/// `inputs` every data input value (reference inputs get the cell's current value).
fn run(
    op: &str,
    attrs: &[(&str, AttrValue)],
    vars: &[Arc<VariableCell>],
    data: &[Tensor],
) -> Result<Vec<Option<Tensor>>, String> {
    let def = registry().get(op).unwrap();
    let mut map: BTreeMap<String, AttrValue> = def
        .attrs
        .iter()
        .filter_map(|a| Some((a.name.to_string(), a.default.value()?)))
        .collect();
    for (k, v) in attrs {
        map.insert(k.to_string(), v.clone());
    }
    let mut inputs: Vec<Tensor> = vars.iter().map(|c| c.read().unwrap()).collect();
    inputs.extend(data.iter().cloned());
    // ApplyAdam's data input `t` sits between the slots and grad; callers pass it first in `data`.
    let types: Vec<TensorType> = inputs
        .iter()
        .map(|t| TensorType::new(t.dtype(), t.shape()))
        .collect();
    let outs = (def.infer)(&InferCtx {
        node: "n",
        inputs: &types,
        attrs: &map,
    })?;
    let kernel = (def.kernel_for(&dflow_graph::DeviceType::CPU).unwrap())(&KernelInit {
        node: "n",
        attrs: &map,
        input_types: &types,
        output_types: &outs,
    })?;
    let mut outputs = vec![None; outs.len()];
    let inputs: Vec<&Tensor> = inputs.iter().collect();
    kernel.compute(&mut KernelContext {
        node: "n",
        inputs: &inputs,
        variables: vars,
        step: 0,
        outputs: &mut outputs,
        collectives: None,
        output_memory: None,
    })?;
    Ok(outputs)
}

fn cell(v: &[f64]) -> Arc<VariableCell> {
    let c = Arc::new(VariableCell::default());
    c.write(Tensor::from_slice(&[v.len()], v).unwrap());
    c
}

fn value(c: &VariableCell) -> Vec<f64> {
    c.read().unwrap().to_f64_vec()
}

fn vec1(v: &[f64]) -> Tensor {
    Tensor::from_slice(&[v.len()], v).unwrap()
}

fn close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-12 * y.abs().max(1.0), "{a:?} vs {b:?}");
    }
}

#[test]
fn gradient_descent_two_steps() {
    let w = cell(&[1.0, 2.0]);
    let lr = [("lr", AttrValue::Float(0.1))];
    run(
        "ApplyGradientDescent",
        &lr,
        std::slice::from_ref(&w),
        &[vec1(&[0.5, -1.0])],
    )
    .unwrap();
    close(&value(&w), &[0.95, 2.1]);
    run(
        "ApplyGradientDescent",
        &lr,
        std::slice::from_ref(&w),
        &[vec1(&[0.5, -1.0])],
    )
    .unwrap();
    close(&value(&w), &[0.9, 2.2]);
}

#[test]
fn momentum_two_steps_plain_and_nesterov() {
    for (nesterov, expect) in [(false, [0.9, 0.71]), (true, [0.81, 0.539])] {
        let (w, a) = (cell(&[1.0]), cell(&[0.0]));
        let attrs = [
            ("lr", AttrValue::Float(0.1)),
            ("momentum", AttrValue::Float(0.9)),
            ("use_nesterov", AttrValue::Bool(nesterov)),
        ];
        for (step, want) in expect.iter().enumerate() {
            run(
                "ApplyMomentum",
                &attrs,
                &[w.clone(), a.clone()],
                &[vec1(&[1.0])],
            )
            .unwrap();
            close(&value(&w), &[*want]);
            close(&value(&a), &[[1.0, 1.9][step]]);
        }
    }
}

#[test]
fn adam_two_steps_match_tensorflow_formula() {
    let (w, m, v) = (cell(&[1.0]), cell(&[0.0]), cell(&[0.0]));
    let attrs = [("lr", AttrValue::Float(0.1))]; // beta1 0.9, beta2 0.999, epsilon 1e-7
                                                 // Values from TensorFlow's update rule, computed by hand (in Python floats).
    let steps = [
        (
            0i64,
            0.5,
            0.9000006324515321,
            0.04999999999999999,
            0.0002500000000000002,
        ),
        (
            1,
            -0.25,
            0.8733670792079219,
            0.019999999999999997,
            0.00031225000000000024,
        ),
    ];
    for (t, g, ew, em, ev) in steps {
        run(
            "ApplyAdam",
            &attrs,
            &[w.clone(), m.clone(), v.clone()],
            &[Tensor::scalar(t), vec1(&[g])],
        )
        .unwrap();
        close(&value(&w), &[ew]);
        close(&value(&m), &[em]);
        close(&value(&v), &[ev]);
    }
}

#[test]
fn adamw_two_steps_match_pytorch_formula() {
    let (w, m, v) = (cell(&[1.0]), cell(&[0.0]), cell(&[0.0]));
    let attrs = [
        ("lr", AttrValue::Float(0.1)),
        ("weight_decay", AttrValue::Float(0.1)),
    ]; // beta1 0.9, beta2 0.999, epsilon 1e-8
       // torch.optim.AdamW's single-tensor update, evaluated in Python floats.
    let steps = [
        (
            0i64,
            0.5,
            0.890000002,
            0.04999999999999999,
            0.0002500000000000002,
        ),
        (
            1,
            -0.25,
            0.8544662986878463,
            0.019999999999999997,
            0.0003122500000000003,
        ),
    ];
    for (t, g, ew, em, ev) in steps {
        run(
            "ApplyAdamW",
            &attrs,
            &[w.clone(), m.clone(), v.clone()],
            &[Tensor::scalar(t), vec1(&[g])],
        )
        .unwrap();
        close(&value(&w), &[ew]);
        close(&value(&m), &[em]);
        close(&value(&v), &[ev]);
    }
}

#[test]
fn lr_schedule_matches_nanogpt_get_lr() {
    use dflow_graph::train::LrSchedule;
    let s = LrSchedule {
        warmup_steps: 100,
        decay_steps: 2000,
        min_lr: 1e-4,
    };
    // nanoGPT's get_lr(it) with learning_rate 1e-3, evaluated in Python floats.
    let want = [
        (0, 9.900990099009901e-06),
        (99, 0.0009900990099009901),
        (100, 0.001),
        (1050, 0.00055),
        (2000, 0.0001),
        (2001, 0.0001),
        (5000, 0.0001),
    ];
    for (it, lr) in want {
        let got = s.lr_at(1e-3, it);
        assert!((got - lr).abs() <= 1e-15, "step {it}: {got} vs {lr}");
    }
    // The update kernel reads the same schedule at its step count: at t = 0 with warm-up 1 the
    // lr is halved, so SGD-like first Adam steps move half as far.
    let step = |schedule: &[(&str, AttrValue)]| {
        let (w, m, v) = (cell(&[1.0]), cell(&[0.0]), cell(&[0.0]));
        let mut attrs = vec![("lr", AttrValue::Float(0.1))];
        attrs.extend(schedule.iter().cloned());
        run(
            "ApplyAdamW",
            &attrs,
            &[w.clone(), m, v],
            &[Tensor::scalar(0i64), vec1(&[0.5])],
        )
        .unwrap();
        1.0 - value(&w)[0]
    };
    let full = step(&[]);
    let warm = step(&[("warmup_steps", AttrValue::Int(1))]);
    assert!((warm - full / 2.0).abs() < 1e-9, "{warm} vs {full}");
}

#[test]
fn adamw_decays_matrices_only_and_schedules_every_update() {
    use dflow_graph::train::LrSchedule;
    let mut spec = spec(OptimizerKind::adamw());
    spec.lr_schedule = Some(LrSchedule {
        warmup_steps: 10,
        decay_steps: 100,
        min_lr: 0.0,
    });
    let t = expand_training(&mlp(), &spec).unwrap();
    let updates: Vec<_> = t
        .def
        .nodes
        .iter()
        .filter(|n| n.op == "ApplyAdamW")
        .collect();
    assert!(!updates.is_empty());
    for u in updates {
        let var = t.def.nodes.iter().find(|n| n.name == u.inputs[0]).unwrap();
        let rank = match var.attrs.get("shape") {
            Some(AttrValue::Shape(s)) => s.rank().unwrap(),
            other => panic!("{other:?}"),
        };
        let decay = u.attrs.get("weight_decay");
        let want = if rank >= 2 { 0.01 } else { 0.0 };
        assert_eq!(decay, Some(&AttrValue::Float(want)), "{}", u.name);
        assert_eq!(u.attrs.get("warmup_steps"), Some(&AttrValue::Int(10)));
        assert_eq!(u.attrs.get("decay_steps"), Some(&AttrValue::Int(100)));
    }
    // A schedule needs a step counter.
    let mut sgd = spec_sgd();
    sgd.lr_schedule = spec.lr_schedule;
    let e = expand_training(&mlp(), &sgd).unwrap_err().to_string();
    assert!(
        e.contains("lr_schedule needs an optimizer that counts steps"),
        "{e}"
    );
}

fn spec_sgd() -> TrainSpec {
    spec(OptimizerKind::Sgd)
}

#[test]
fn updates_reject_bad_state() {
    let lr = [("lr", AttrValue::Float(0.1))];
    let err = run(
        "ApplyGradientDescent",
        &lr,
        &[cell(&[1.0])],
        &[vec1(&[1.0, 2.0])],
    )
    .unwrap_err();
    assert!(err.contains("shape [1]") && err.contains("[2]"), "{err}");
    // An uninitialized variable cell is an error, not a panic.
    let def = registry().get("ApplyGradientDescent").unwrap();
    let attrs: BTreeMap<String, AttrValue> = [("lr".to_string(), AttrValue::Float(0.1))].into();
    let types = vec![TensorType::new(DType::F64, Shape::known(&[1])); 2];
    let k = (def.kernel_for(&dflow_graph::DeviceType::CPU).unwrap())(&KernelInit {
        node: "n",
        attrs: &attrs,
        input_types: &types,
        output_types: &[],
    })
    .unwrap();
    let (a, b) = (vec1(&[0.0]), vec1(&[1.0]));
    let inputs = [&a, &b];
    let err = k
        .compute(&mut KernelContext {
            node: "n",
            inputs: &inputs,
            variables: &[Arc::new(VariableCell::default())],
            step: 0,
            outputs: &mut [],
            collectives: None,
            output_memory: None,
        })
        .unwrap_err();
    assert!(err.to_string().contains("not initialized"), "{err}");
}

#[test]
fn increment_step_and_global_norm_scale() {
    let t = Arc::new(VariableCell::default());
    t.write(Tensor::scalar(0i64));
    for want in [1, 2] {
        run("IncrementStep", &[], std::slice::from_ref(&t), &[]).unwrap();
        assert_eq!(t.read().unwrap().as_slice::<i64>().unwrap(), &[want]);
    }
    let grads = [vec1(&[3.0, 4.0]), vec1(&[12.0])]; // global norm 13
    for (clip, want) in [(5.0, 5.0 / 13.0), (20.0, 1.0)] {
        let out = run(
            "GlobalNormScale",
            &[("clip_norm", AttrValue::Float(clip))],
            &[],
            &grads,
        )
        .unwrap();
        close(&out[0].as_ref().unwrap().to_f64_vec(), &[want]);
    }
}

#[test]
fn sharded_adam_updates_equal_the_whole_update() {
    // A 5-element variable over 2 ranks: shards of 3 elements, the last one padded by 1.
    let (w0, g) = (
        [0.5, -1.0, 2.0, 0.25, -0.75],
        [0.3, -0.2, 0.1, 0.7, -0.4, 0.0],
    );
    for op in ["ApplyAdam", "ApplyAdamW"] {
        let attrs = [("lr", AttrValue::Float(0.1))];
        let (w, m, v) = (cell(&w0), cell(&[0.0; 5]), cell(&[0.0; 5]));
        let sharded = cell(&w0);
        let shards: Vec<[Arc<VariableCell>; 2]> =
            (0..2).map(|_| [cell(&[0.0; 3]), cell(&[0.0; 3])]).collect();
        for t in 0..3i64 {
            run(
                op,
                &attrs,
                &[w.clone(), m.clone(), v.clone()],
                &[Tensor::scalar(t), vec1(&g[..5])],
            )
            .unwrap();
            for (r, [m, v]) in shards.iter().enumerate() {
                let mut a = attrs.to_vec();
                a.push(("shard_offset", AttrValue::Int(3 * r as i64)));
                run(
                    op,
                    &a,
                    &[sharded.clone(), m.clone(), v.clone()],
                    &[Tensor::scalar(t), vec1(&g[3 * r..3 * r + 3])],
                )
                .unwrap();
            }
            close(&value(&sharded), &value(&w));
            let logical_m: Vec<f64> = shards.iter().flat_map(|[m, _]| value(m)).collect();
            close(&logical_m[..5], &value(&m));
            // The padding's slots stay zero (its gradient is zero).
            assert_eq!(logical_m[5], 0.0);
        }
    }
}

#[test]
fn sharded_adam_refuses_a_matrix_shard_and_an_offset_past_the_end() {
    let (w, m, v) = (cell(&[1.0, 2.0]), cell(&[0.0]), cell(&[0.0]));
    let e = run(
        "ApplyAdam",
        &[
            ("lr", AttrValue::Float(0.1)),
            ("shard_offset", AttrValue::Int(2)),
        ],
        &[w.clone(), m.clone(), v.clone()],
        &[Tensor::scalar(0i64), vec1(&[1.0])],
    )
    .unwrap_err();
    assert!(e.contains("shard_offset 2 is past var's 2 elements"), "{e}");
    let mm = Arc::new(VariableCell::default());
    mm.write(Tensor::from_slice(&[1, 1], &[0.0f64]).unwrap());
    let e = run(
        "ApplyAdam",
        &[
            ("lr", AttrValue::Float(0.1)),
            ("shard_offset", AttrValue::Int(0)),
        ],
        &[w, mm.clone(), mm],
        &[
            Tensor::scalar(0i64),
            Tensor::from_slice(&[1, 1], &[1.0f64]).unwrap(),
        ],
    )
    .unwrap_err();
    assert!(e.contains("must be a vector"), "{e}");
}

#[test]
fn squared_norm_parts_give_the_global_norm_scale() {
    let parts = [vec1(&[3.0, 4.0]), vec1(&[12.0])]; // global norm 13
    let sum = run("SquaredNorm", &[], &[], &parts).unwrap()[0]
        .clone()
        .unwrap();
    close(&sum.to_f64_vec(), &[169.0]);
    for (clip, want) in [(5.0, 5.0 / 13.0), (20.0, 1.0)] {
        let out = run(
            "GlobalNormScale",
            &[
                ("clip_norm", AttrValue::Float(clip)),
                ("squared_norm", AttrValue::Bool(true)),
            ],
            &[],
            std::slice::from_ref(&sum),
        )
        .unwrap();
        close(&out[0].as_ref().unwrap().to_f64_vec(), &[want]);
    }
    let e = run(
        "GlobalNormScale",
        &[
            ("clip_norm", AttrValue::Float(1.0)),
            ("squared_norm", AttrValue::Bool(true)),
        ],
        &[],
        &parts,
    )
    .unwrap_err();
    assert!(e.contains("the one input is the scalar"), "{e}");
}

#[test]
fn read_variable_sees_updates_and_assign_overwrites() {
    let w = cell(&[1.0, 2.0]);
    run(
        "ApplyGradientDescent",
        &[("lr", AttrValue::Float(1.0))],
        std::slice::from_ref(&w),
        &[vec1(&[0.5, 0.5])],
    )
    .unwrap();
    let read = run("ReadVariable", &[], std::slice::from_ref(&w), &[]).unwrap();
    close(&read[0].as_ref().unwrap().to_f64_vec(), &[0.5, 1.5]);
    run(
        "Assign",
        &[],
        std::slice::from_ref(&w),
        &[vec1(&[7.0, 8.0])],
    )
    .unwrap();
    close(&value(&w), &[7.0, 8.0]);
    let e = run("Assign", &[], std::slice::from_ref(&w), &[vec1(&[7.0])]).unwrap_err();
    assert!(e.contains("same dtype and shape"), "{e}");
}

fn mlp() -> GraphDef {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/mlp/mlp.json");
    dflow_graph::load_file(std::path::Path::new(path))
        .unwrap()
        .def
}

fn spec(kind: OptimizerKind) -> TrainSpec {
    TrainSpec {
        lr_schedule: None,
        data: None,
        loss: "loss".into(),
        optimizer: OptimizerSpec { kind, lr: 0.01 },
        clip_global_norm: None,
        metrics: vec!["accuracy".into()],
    }
}

#[test]
fn mlp_expands_with_updates_on_ps_and_gradients_on_the_worker() {
    let def = mlp();
    let t = expand_training(&def, &spec(OptimizerKind::adam())).unwrap();
    let node = |name: &str| {
        t.def
            .nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    };
    let vars: Vec<&str> = t.gradients.iter().map(|(v, _)| v.as_str()).collect();
    assert_eq!(vars, ["w1", "b1", "w2", "b2"]);
    for (v, grad) in &t.gradients {
        let producer = InputRef::parse(grad).unwrap().node().to_string();
        assert!(producer.starts_with("gradients/"), "{grad}");
        assert_eq!(node(&producer).device, "/job:worker/task:0", "{grad}");
        let update = node(&format!("train/{v}/update"));
        assert_eq!(update.op, "ApplyAdam");
        assert_eq!(update.device, "/job:ps/task:0");
        assert_eq!(update.colocate_with, vec![v.clone()]);
        assert_eq!(
            update.inputs,
            vec![
                v.clone(),
                format!("{v}/adam_m"),
                format!("{v}/adam_v"),
                "adam/t".into(),
                grad.clone()
            ]
        );
        for slot in ["adam_m", "adam_v"] {
            let s = node(&format!("{v}/{slot}"));
            assert_eq!(
                (s.op.as_str(), s.device.as_str()),
                ("Variable", "/job:ps/task:0")
            );
            assert_eq!(s.colocate_with, vec![v.clone()]);
            assert_eq!(s.attrs["initializer"], AttrValue::String("zeros".into()));
        }
    }
    // Every backward node sits on its forward node's device, colocated with it.
    for n in t
        .def
        .nodes
        .iter()
        .filter(|n| n.name.starts_with("gradients/"))
    {
        assert_eq!(n.device, "/job:worker/task:0", "{}", n.name);
        assert_eq!(n.colocate_with.len(), 1, "{}", n.name);
        assert!(def.nodes.iter().any(|f| f.name == n.colocate_with[0]));
    }
    let inc = node("train/adam/t/increment");
    assert_eq!(inc.op, "IncrementStep");
    assert_eq!(inc.inputs.len(), 5, "counter + a control edge per update");
    let train = node(&t.train_op);
    assert_eq!(train.op, "NoOp");
    assert_eq!(
        train.inputs,
        [
            "^train/w1/update",
            "^train/b1/update",
            "^train/w2/update",
            "^train/b2/update",
            "^train/adam/t/increment"
        ]
    );
    assert_eq!(t.metrics, ["accuracy"]);
    assert!(t.def.train.is_none());
    // The forward graph is unchanged; only nodes were appended.
    assert_eq!(t.def.nodes[..def.nodes.len()], def.nodes[..]);
}

#[test]
fn sgd_momentum_and_clipping_expand() {
    let def = mlp();
    let t = expand_training(&def, &spec(OptimizerKind::Sgd)).unwrap();
    let ops: Vec<&str> = t
        .def
        .nodes
        .iter()
        .filter(|n| n.name.ends_with("/update"))
        .map(|n| n.op.as_str())
        .collect();
    assert_eq!(ops, ["ApplyGradientDescent"; 4]);

    let mut s = spec(OptimizerKind::momentum());
    s.clip_global_norm = Some(5.0);
    let t = expand_training(&def, &s).unwrap();
    let find = |name: &str| t.def.nodes.iter().find(|n| n.name == name).unwrap();
    let scale = find("train/clip/global_norm_scale");
    assert_eq!(
        (scale.op.as_str(), scale.inputs.len()),
        ("GlobalNormScale", 4)
    );
    for (v, g) in &t.gradients {
        assert_eq!(g, &format!("train/clip/{v}"));
        assert_eq!(find(g).device, "/job:worker/task:0");
        let u = find(&format!("train/{v}/update"));
        assert_eq!(
            u.inputs,
            vec![v.clone(), format!("{v}/momentum"), g.clone()]
        );
    }
}

#[test]
fn expansion_errors_name_the_problem() {
    let def = mlp();
    let mut s = spec(OptimizerKind::Sgd);
    s.loss = "los".into();
    let e = expand_training(&def, &s).unwrap_err();
    assert!(
        matches!(e, ExpandError::UnknownTensor { role: "loss", .. }),
        "{e}"
    );
    let mut s = spec(OptimizerKind::Sgd);
    s.metrics = vec!["acc".into()];
    let e = expand_training(&def, &s).unwrap_err();
    assert!(e.to_string().contains("metric `acc`"), "{e}");
    let mut s = spec(OptimizerKind::Sgd);
    s.optimizer.lr = -1.0;
    assert!(matches!(
        expand_training(&def, &s),
        Err(ExpandError::InvalidSpec(_))
    ));
    // The accuracy reaches the variables only through ArgMax (integer): nothing to train.
    let mut s = spec(OptimizerKind::Sgd);
    s.loss = "accuracy".into();
    let e = expand_training(&def, &s).unwrap_err();
    assert!(
        e.to_string().contains("does not depend differentiably"),
        "{e}"
    );
    // A slot name already in use.
    let mut taken = def.clone();
    let mut n = taken.nodes[2].clone();
    n.name = "w1/momentum".into();
    taken.nodes.push(n);
    let e = expand_training(&taken, &spec(OptimizerKind::momentum())).unwrap_err();
    assert_eq!(e, ExpandError::NameTaken("w1/momentum".into()));
}

/// A fixed batch for the MLP example: 16 examples of 64 features, labels 0..10.
fn mlp_batch() -> Eval {
    let x: Vec<f32> = (0..16 * 64)
        .map(|i| ((i * 7919 % 113) as f32 / 113.0) - 0.5)
        .collect();
    let labels: Vec<i64> = (0..16).map(|i| (i * 3 % 10) as i64).collect();
    Eval {
        feeds: HashMap::from([
            ("x".to_string(), Tensor::from_slice(&[16, 64], &x).unwrap()),
            (
                "labels".to_string(),
                Tensor::from_slice(&[16], &labels).unwrap(),
            ),
        ]),
        vars: HashMap::new(),
    }
}

#[test]
fn one_sgd_step_applies_minus_lr_times_the_gradient() {
    let mut s = spec(OptimizerKind::Sgd);
    s.optimizer.lr = 0.5;
    let t = expand_training(&mlp(), &s).unwrap();
    let mut eval = mlp_batch();
    let mut fetch: Vec<String> = t.gradients.iter().map(|(_, g)| g.clone()).collect();
    fetch.extend(t.gradients.iter().map(|(v, _)| v.clone()));
    let before = eval.run(&t.def, &fetch);
    let n = t.gradients.len();
    eval.run(&t.def, &[format!("^{}", t.train_op)]);
    for (i, (v, _)) in t.gradients.iter().enumerate() {
        let after = eval.get(v).to_f64_vec();
        let (g, w) = (before[i].to_f64_vec(), before[n + i].to_f64_vec());
        assert!(g.iter().any(|&x| x != 0.0), "{v}: zero gradient");
        for ((a, w), g) in after.iter().zip(&w).zip(&g) {
            let want = (*w as f32 - 0.5f32 * *g as f32) as f64;
            assert!((a - want).abs() <= 1e-6, "{v}: {a} vs {want}");
        }
    }
}

#[test]
fn adam_and_momentum_reduce_the_mlp_loss() {
    for (kind, lr) in [
        (OptimizerKind::adam(), 0.01),
        (OptimizerKind::momentum(), 0.1),
    ] {
        let mut s = spec(kind.clone());
        s.optimizer.lr = lr;
        s.clip_global_norm = Some(10.0);
        let t = expand_training(&mlp(), &s).unwrap();
        let mut eval = mlp_batch();
        let first = eval.run(&t.def, &["loss".into()])[0].to_f64_vec()[0];
        for _ in 0..30 {
            eval.run(&t.def, &[format!("^{}", t.train_op)]);
        }
        let last = eval.run(&t.def, &["loss".into()])[0].to_f64_vec()[0];
        assert!(last < 0.5 * first, "{kind:?}: loss {first} -> {last}");
        if matches!(kind, OptimizerKind::Adam { .. }) {
            assert_eq!(eval.get("adam/t").as_slice::<i64>().unwrap(), &[30]);
        }
    }
}
