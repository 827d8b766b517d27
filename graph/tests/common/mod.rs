//! A tiny single-device evaluator over the real CPU kernels, for the autodiff and training tests.
#![allow(dead_code)]

use dflow_graph::kernel::{KernelContext, KernelInit, VariableCell};
use dflow_graph::{Graph, GraphDef, InputRef, Tensor};
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
            let kernel = (op.kernel_for("CPU").unwrap())(&KernelInit {
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
