//! Compiling one partition into an [`ExecutionPlan`], once, and reusing it every step.
//!
//! The plan flattens the partition's graph: nodes in an array, each with its bound kernel (or
//! its rendezvous key for Send/Recv), the output slots its inputs come from, its successors,
//! and its initial count of pending inputs. A step only resets counters and runs.

use crate::error::ExecError;
use crate::variables::VariableStore;
use dflow_graph::kernel::{Kernel, KernelInit, VariableCell};
use dflow_graph::{AttrValue, DeviceName, Graph};
use dflow_transport::RendezvousKey;
use std::sync::Arc;

/// What a plan node does when it runs.
#[derive(Debug)]
pub(crate) enum NodeAction {
    /// Run a kernel.
    Kernel(Box<dyn Kernel>),
    /// Hand input 0 to the rendezvous under `key`.
    Send(Arc<RendezvousKey>),
    /// Wait for the rendezvous to deliver `key` into output 0.
    Recv(Arc<RendezvousKey>),
}

/// One node of a compiled plan.
#[derive(Debug)]
pub(crate) struct PlanNode {
    pub(crate) name: String,
    pub(crate) op: &'static str,
    pub(crate) action: NodeAction,
    /// For each data input, the value slot it reads.
    pub(crate) inputs: Vec<u32>,
    /// First value slot of this node's outputs.
    pub(crate) output_base: u32,
    /// Number of outputs.
    pub(crate) num_outputs: u32,
    /// Nodes to notify on completion, once per edge.
    pub(crate) successors: Vec<u32>,
    /// Incoming edges (data and control): the node runs when all have fired.
    pub(crate) num_pending: u32,
    /// The variable this node owns, or the variables behind its reference inputs.
    pub(crate) variables: Vec<Arc<VariableCell>>,
    /// For a kernel whose outputs feed Sends: per output, the key of the (first) Send it feeds,
    /// so the kernel can write it where the transport sends it from. Empty otherwise.
    pub(crate) output_sends: Vec<Option<Arc<RendezvousKey>>>,
}

/// A partition compiled for execution on one device.
#[derive(Debug)]
pub struct ExecutionPlan {
    pub(crate) device: DeviceName,
    pub(crate) device_label: String,
    pub(crate) nodes: Vec<PlanNode>,
    pub(crate) roots: Vec<u32>,
    pub(crate) num_slots: usize,
}

/// Marks, on each kernel whose output feeds a Send, which key that output is sent under.
fn link_sends_to_producers(nodes: &mut [PlanNode], num_slots: usize) {
    let mut owner = vec![(u32::MAX, 0u32); num_slots];
    for (i, n) in nodes.iter().enumerate() {
        for k in 0..n.num_outputs {
            owner[(n.output_base + k) as usize] = (i as u32, k);
        }
    }
    let sends: Vec<(u32, Arc<RendezvousKey>)> = nodes
        .iter()
        .filter_map(|n| match (&n.action, n.inputs.first()) {
            (NodeAction::Send(key), Some(&slot)) => Some((slot, key.clone())),
            _ => None,
        })
        .collect();
    for (slot, key) in sends {
        let Some(&(node, out)) = owner.get(slot as usize) else {
            continue;
        };
        let Some(p) = nodes.get_mut(node as usize) else {
            continue;
        };
        if !matches!(p.action, NodeAction::Kernel(_)) {
            continue;
        }
        if p.output_sends.is_empty() {
            p.output_sends = vec![None; p.num_outputs as usize];
        }
        let entry = &mut p.output_sends[out as usize];
        if entry.is_none() {
            *entry = Some(key);
        }
    }
}

impl ExecutionPlan {
    /// Compiles `graph` (one partition, placed on `device`) against `variables`.
    pub fn compile(
        device: &DeviceName,
        graph: &Graph,
        variables: &VariableStore,
    ) -> Result<ExecutionPlan, ExecError> {
        let device_label = device.to_string();
        let device_type = device
            .device_type
            .clone()
            .unwrap_or_else(|| "CPU".to_string());
        let order: Vec<_> = graph.node_indices().collect();
        let mut output_base = Vec::with_capacity(order.len());
        let mut num_slots = 0u32;
        for &idx in &order {
            output_base.push(num_slots);
            num_slots += graph.node(idx).outputs.len() as u32;
        }
        let mut nodes = Vec::with_capacity(order.len());
        for &idx in &order {
            let node = graph.node(idx);
            let op = node.op_def();
            let attrs = node.resolved_attrs();
            let key_of = || -> Result<Arc<RendezvousKey>, ExecError> {
                let get = |k: &str| match attrs.get(k) {
                    Some(AttrValue::String(s)) => Ok(s.clone()),
                    _ => Err(ExecError::KernelInit {
                        node: node.name.clone(),
                        op: node.op.into(),
                        device: device_label.clone(),
                        message: format!("missing string attribute `{k}`"),
                    }),
                };
                Ok(Arc::new(RendezvousKey::new(
                    &get("send_device")?,
                    &get("recv_device")?,
                    &get("tensor_name")?,
                )))
            };
            let inputs = graph.inputs(idx);
            let action = match op.name {
                "Send" => NodeAction::Send(key_of()?),
                "Recv" => NodeAction::Recv(key_of()?),
                _ => {
                    let factory =
                        op.kernel_for(&device_type)
                            .ok_or_else(|| ExecError::NoKernel {
                                node: node.name.clone(),
                                op: node.op.into(),
                                device: device_label.clone(),
                                device_type: device_type.clone(),
                            })?;
                    let input_types: Vec<_> = inputs
                        .iter()
                        .map(|(src, out)| graph.node(*src).outputs[*out].clone())
                        .collect();
                    let init = KernelInit {
                        node: &node.name,
                        attrs: &attrs,
                        input_types: &input_types,
                        output_types: &node.outputs,
                    };
                    NodeAction::Kernel(factory(&init).map_err(|message| ExecError::KernelInit {
                        node: node.name.clone(),
                        op: node.op.into(),
                        device: device_label.clone(),
                        message,
                    })?)
                }
            };
            let cells = if op.is_variable {
                vec![variables.cell(&node.name)]
            } else {
                op.inputs
                    .iter()
                    .zip(&inputs)
                    .filter(|(arg, _)| arg.is_ref)
                    .map(|(_, (src, _))| variables.cell(&graph.node(*src).name))
                    .collect()
            };
            let mut successors = Vec::new();
            for (dst, _) in graph.out_edges(idx) {
                successors.push(dst.index() as u32);
            }
            let num_pending = (inputs.len() + graph.control_inputs(idx).len()) as u32;
            nodes.push(PlanNode {
                name: node.name.clone(),
                op: op.name,
                action,
                inputs: inputs
                    .iter()
                    .map(|(src, out)| output_base[src.index()] + *out as u32)
                    .collect(),
                output_base: output_base[idx.index()],
                num_outputs: node.outputs.len() as u32,
                successors,
                num_pending,
                variables: cells,
                output_sends: Vec::new(),
            });
        }
        link_sends_to_producers(&mut nodes, num_slots as usize);
        let roots = nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.num_pending == 0)
            .map(|(i, _)| i as u32)
            .collect();
        Ok(ExecutionPlan {
            device: device.clone(),
            device_label,
            nodes,
            roots,
            num_slots: num_slots as usize,
        })
    }

    /// The device this plan runs on.
    pub fn device(&self) -> &DeviceName {
        &self.device
    }

    /// Number of nodes.
    pub fn num_nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Keys of the plan's Recv nodes (what it waits for from other devices).
    pub fn recv_keys(&self) -> Vec<Arc<RendezvousKey>> {
        self.nodes
            .iter()
            .filter_map(|n| match &n.action {
                NodeAction::Recv(k) => Some(k.clone()),
                _ => None,
            })
            .collect()
    }
}
