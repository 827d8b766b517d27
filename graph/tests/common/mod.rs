//! A tiny single-device evaluator over the real CPU kernels, for the autodiff and training tests.
#![allow(dead_code)]

use dflow_graph::autodiff::gradients;
use dflow_graph::builder::{GraphBuilder, NodeHandle, Output};
use dflow_graph::kernel::{KernelContext, KernelInit, VariableCell};
use dflow_graph::{DType, Graph, GraphDef, InputRef, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// Evaluates `fetches` of `def` on one CPU device: feeds replace nodes' outputs (placeholders),
/// variables live in `vars` (created on first use). A fetch `^name` runs `name` (a target) and
/// returns nothing for it.
pub struct Eval {
    pub feeds: HashMap<String, Tensor>,
    pub vars: HashMap<String, Arc<VariableCell>>,
}

impl Eval {
    pub fn run(&mut self, def: &GraphDef, fetches: &[String]) -> Vec<Tensor> {
        let g = Graph::from_def(def).unwrap_or_else(|e| panic!("{e}"));
        // Only the fetches' ancestors run (unfed placeholders elsewhere would fail).
        let mut needed = vec![false; g.num_nodes()];
        let mut stack: Vec<_> = fetches
            .iter()
            .map(|f| g.find(InputRef::parse(f).unwrap().node()).unwrap())
            .collect();
        while let Some(i) = stack.pop() {
            if !std::mem::replace(&mut needed[i.index()], true) {
                stack.extend(g.inputs(i).into_iter().map(|(s, _)| s));
                stack.extend(g.control_inputs(i));
            }
        }
        let mut values: HashMap<(String, usize), Tensor> = HashMap::new();
        for idx in g.topo_order() {
            if !needed[idx.index()] {
                continue;
            }
            let node = g.node(idx);
            if let Some(t) = self.feeds.get(&node.name) {
                values.insert((node.name.clone(), 0), t.clone());
                continue;
            }
            let op = node.op_def();
            let inputs: Vec<(String, usize)> = g
                .inputs(idx)
                .into_iter()
                .map(|(s, o)| (g.node(s).name.clone(), o))
                .collect();
            let input_types: Vec<_> = g
                .inputs(idx)
                .into_iter()
                .map(|(s, o)| g.output_type(s, o).unwrap().clone())
                .collect();
            let attrs = node.resolved_attrs();
            let kernel = (op.kernel_for(&dflow_graph::DeviceType::CPU).unwrap())(&KernelInit {
                node: &node.name,
                attrs: &attrs,
                input_types: &input_types,
                output_types: &node.outputs,
            })
            .unwrap_or_else(|e| panic!("{}: {e}", node.name));
            let mut cells = vec![];
            if op.is_variable {
                cells.push(self.cell(&node.name));
            }
            for (slot, (src, _)) in inputs.iter().enumerate() {
                if op.inputs.get(slot).is_some_and(|a| a.is_ref) {
                    cells.push(self.cell(src));
                }
            }
            let input_values: Vec<&Tensor> = inputs.iter().map(|k| &values[k]).collect();
            let mut outputs = vec![None; node.outputs.len()];
            kernel
                .compute(&mut KernelContext {
                    node: &node.name,
                    inputs: &input_values,
                    variables: &cells,
                    step: 0,
                    outputs: &mut outputs,
                    collectives: None,
                    output_memory: None,
                })
                .unwrap_or_else(|e| panic!("{}: {e}", node.name));
            for (k, t) in outputs.into_iter().enumerate() {
                values.insert((node.name.clone(), k), t.unwrap());
            }
        }
        fetches
            .iter()
            .filter_map(|f| match InputRef::parse(f).unwrap() {
                InputRef::Data { node, index } => Some(values[&(node, index)].clone()),
                InputRef::Control(_) => None,
            })
            .collect()
    }

    pub fn cell(&mut self, name: &str) -> Arc<VariableCell> {
        self.vars.entry(name.to_string()).or_default().clone()
    }

    /// The current value of a wrt tensor (a feed or a variable).
    pub fn get(&self, name: &str) -> Tensor {
        match self.feeds.get(name) {
            Some(t) => t.clone(),
            None => self.vars[name].read().unwrap(),
        }
    }

    pub fn set(&mut self, name: &str, t: Tensor) {
        if self.feeds.contains_key(name) {
            self.feeds.insert(name.to_string(), t);
        } else {
            self.vars[name].write(t);
        }
    }
}

/// Deterministic values in [lo, hi).
pub fn values(seed: &mut u64, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((*seed >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

pub fn tensor(seed: &mut u64, dims: &[usize], lo: f64, hi: f64) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_slice(dims, &values(seed, n, lo, hi)).unwrap()
}

/// Builds on top of the graph under test: `loss = Sum(out * r)` with a random weight `r` fed at
/// run time, so every element of `out` gets a different upstream gradient.
pub struct Case {
    pub b: GraphBuilder,
    pub eval: Eval,
    pub seed: u64,
}

impl Case {
    pub fn new() -> Self {
        Case {
            b: GraphBuilder::new(),
            eval: Eval {
                feeds: HashMap::new(),
                vars: HashMap::new(),
            },
            seed: 42,
        }
    }

    /// A placeholder of static shape `static_dims` (-1 = unknown) fed with a random value of
    /// shape `dims` in [lo, hi).
    pub fn input(
        &mut self,
        name: &str,
        static_dims: &[i64],
        dims: &[usize],
        lo: f64,
        hi: f64,
    ) -> NodeHandle {
        let h = self.b.placeholder(name, DType::F64, static_dims);
        let t = tensor(&mut self.seed, dims, lo, hi);
        self.eval.feeds.insert(name.to_string(), t);
        h
    }

    /// A variable with a random value.
    pub fn variable(&mut self, name: &str, dims: &[usize]) -> NodeHandle {
        let h = self.b.variable(name, DType::F64, dims, "zeros");
        let t = tensor(&mut self.seed, dims, -1.0, 1.0);
        self.eval.cell(name).write(t);
        h
    }

    /// Checks d loss / d wrt against central differences, `out` of run-time shape `out_dims`.
    pub fn check(mut self, out: impl Into<Output>, out_dims: &[usize], wrt: &[&str]) {
        let out = out.into();
        let rt = tensor(&mut self.seed, out_dims, 0.5, 1.5);
        let r_dims: Vec<i64> = out_dims.iter().map(|&d| d as i64).collect();
        let mut b = self.b;
        let rh = b
            .op("Placeholder", "check/weights")
            .attr("dtype", DType::F64)
            .attr("shape", dflow_graph::Shape::from_signed(&r_dims).unwrap())
            .finish();
        self.eval.feeds.insert("check/weights".into(), rt);
        let prod = b.binary("Mul", "check/prod", &out, &rh);
        let _loss = b.op("Sum", "check/loss").input(&prod).finish();
        let def = b.to_def();
        let (gdef, grads) = gradients(&def, "check/loss", wrt).unwrap_or_else(|e| panic!("{e}"));
        let fetch: Vec<String> = grads
            .iter()
            .map(|o| {
                InputRef::Data {
                    node: o.node.clone(),
                    index: o.index,
                }
                .to_string()
            })
            .collect();
        let mut eval = self.eval;
        let analytic = eval.run(&gdef, &fetch);
        let loss_of = |eval: &mut Eval| eval.run(&def, &["check/loss".into()])[0].to_f64_vec()[0];
        let h = 1e-6;
        for (w, a) in wrt.iter().zip(&analytic) {
            let x = eval.get(w);
            assert_eq!(a.dims(), x.dims(), "gradient of {w} has the wrong shape");
            let base = x.to_f64_vec();
            let a = a.to_f64_vec();
            for i in 0..base.len() {
                let mut plus = base.clone();
                plus[i] += h;
                eval.set(w, Tensor::from_slice(x.dims(), &plus).unwrap());
                let fp = loss_of(&mut eval);
                let mut minus = base.clone();
                minus[i] -= h;
                eval.set(w, Tensor::from_slice(x.dims(), &minus).unwrap());
                let fm = loss_of(&mut eval);
                eval.set(w, x.clone());
                let numeric = (fp - fm) / (2.0 * h);
                assert!(
                    (a[i] - numeric).abs() <= 1e-6 + 1e-5 * numeric.abs(),
                    "d loss / d {w}[{i}]: autodiff {} vs finite difference {numeric}",
                    a[i]
                );
            }
        }
    }
}
