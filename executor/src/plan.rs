//! Compiling one partition into an [`ExecutionPlan`], once, and reusing it every step.
//!
//! The plan flattens the partition's graph: nodes in an array, each with its bound kernel (or
//! its rendezvous key for Send/Recv) and the output slots its inputs come from. The edges the
//! scheduler walks every step live in flat arrays (compressed sparse rows): each node's
//! distinct successors, its initial count of distinct predecessors, and whether it is cheap
//! enough to run in a batch with other ready nodes on one thread. A step copies the counts and
//! runs.
//!
//! A `Const` without inputs or control inputs is evaluated here, once: its value is bound to
//! its slot at the start of every step, it is not scheduled, and its consumers do not wait for
//! it (a constant addend leaves a chain of adds with one predecessor per node).

use crate::arena::Arena;
use crate::error::ExecError;
use crate::variables::VariableStore;
use dflow_graph::kernel::{is_cheap, Kernel, KernelContext, KernelInit, VariableCell};
use dflow_graph::ops::TensorType;
use dflow_graph::{AttrValue, DeviceName, DeviceType, Graph, Tensor};
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
    /// First value slot of this node's outputs.
    pub(crate) output_base: u32,
    /// Number of outputs.
    pub(crate) num_outputs: u32,
    /// The variable this node owns, or the variables behind its reference inputs.
    pub(crate) variables: Vec<Arc<VariableCell>>,
    /// For a kernel whose outputs feed Sends: per output, the key of the (first) Send it feeds,
    /// so the kernel can write it where the transport sends it from. Empty otherwise.
    pub(crate) output_sends: Vec<Option<Arc<RendezvousKey>>>,
}

/// When a step drops the value in one slot, so that a big intermediate tensor (a gathered
/// parameter, an activation) does not stay resident until the step ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Release {
    /// Kept until the step ends (a bound constant, or a value nobody reads in the step).
    AtEnd,
    /// Read once: dropped when that read's node finishes.
    AfterOnlyRead,
    /// Read several times: counter `i` of the step counts the reads left.
    Counted(u32),
}

/// A partition compiled for execution on one device.
#[derive(Debug)]
pub struct ExecutionPlan {
    pub(crate) device: DeviceName,
    pub(crate) device_label: String,
    pub(crate) nodes: Vec<PlanNode>,
    pub(crate) roots: Vec<u32>,
    pub(crate) num_slots: usize,
    /// Values bound at compile time (constants): (slot, value), written at each step's start.
    pub(crate) constants: Vec<(u32, Tensor)>,
    /// Nodes that run each step (every node but the bound constants).
    pub(crate) num_scheduled: usize,
    /// Per node, the number of distinct nodes it waits for (data and control edges): the
    /// pending counts every step starts from.
    pub(crate) initial_pending: Vec<u32>,
    /// Per node, whether it may run batched with other ready nodes (see `dflow_graph::kernel::is_cheap`).
    pub(crate) cheap: Vec<bool>,
    /// `successors[succ_start[n]..succ_start[n + 1]]`: the distinct nodes `n` notifies.
    succ_start: Vec<u32>,
    successors: Vec<u32>,
    /// `input_slots[input_start[n]..input_start[n + 1]]`: the value slot of each data input.
    input_start: Vec<u32>,
    input_slots: Vec<u32>,
    /// Per value slot, how its value is released once its consumers are done (see
    /// [`Release`]).
    pub(crate) release: Vec<Release>,
    /// Per counted slot (`Release::Counted(i)`), how many reads it starts each step with.
    pub(crate) release_counts: Vec<u32>,
    /// The per-step arrays, recycled across steps.
    pub(crate) arena: Arena,
}

/// Marks, on each kernel whose output feeds a Send, which key that output is sent under.
fn link_sends_to_producers(nodes: &mut [PlanNode], inputs: &[Vec<u32>], num_slots: usize) {
    let mut owner = vec![(u32::MAX, 0u32); num_slots];
    for (i, n) in nodes.iter().enumerate() {
        for k in 0..n.num_outputs {
            owner[(n.output_base + k) as usize] = (i as u32, k);
        }
    }
    let sends: Vec<(u32, Arc<RendezvousKey>)> = nodes
        .iter()
        .zip(inputs)
        .filter_map(|(n, inputs)| match (&n.action, inputs.first()) {
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
        let device_type = device.device_type.clone().unwrap_or(DeviceType::CPU);
        let order: Vec<_> = graph.node_indices().collect();
        let mut output_base = Vec::with_capacity(order.len());
        let mut num_slots = 0u32;
        for &idx in &order {
            output_base.push(num_slots);
            num_slots += graph.node(idx).outputs.len() as u32;
        }
        let mut nodes = Vec::with_capacity(order.len());
        let mut node_inputs: Vec<Vec<u32>> = Vec::with_capacity(order.len());
        let mut node_successors: Vec<Vec<u32>> = Vec::with_capacity(order.len());
        let mut cheap = Vec::with_capacity(order.len());
        // The last node that listed each node as a successor (deduplicates parallel edges).
        let mut notified_by = vec![usize::MAX; order.len()];
        let mut constants = Vec::new();
        let mut is_constant = Vec::with_capacity(order.len());
        for &idx in &order {
            let node = graph.node(idx);
            let op = node.op_def();
            let attrs = node.resolved_attrs();
            let key_of = || -> Result<Arc<RendezvousKey>, ExecError> {
                let get = |k: &str| match attrs.get(k) {
                    Some(AttrValue::String(s)) => Ok(s.to_string()),
                    _ => Err(ExecError::KernelInit {
                        node: node.name.clone(),
                        op: node.op.into(),
                        device: device_label.clone(),
                        error: Box::new(dflow_graph::OpError::MissingAttr {
                            name: k.to_string(),
                        }),
                    }),
                };
                Ok(Arc::new(RendezvousKey::new(
                    &get("send_device")?,
                    &get("recv_device")?,
                    &get("tensor_name")?,
                )))
            };
            let inputs = graph.inputs(idx);
            let input_types: Vec<&TensorType> = inputs
                .iter()
                .map(|(src, out)| &graph.node(*src).outputs[*out])
                .collect();
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
                    let owned_types: Vec<TensorType> =
                        input_types.iter().map(|t| (*t).clone()).collect();
                    let init = KernelInit {
                        node: &node.name,
                        attrs: &attrs,
                        input_types: &owned_types,
                        output_types: &node.outputs,
                    };
                    NodeAction::Kernel(factory(&init).map_err(|error| ExecError::KernelInit {
                        node: node.name.clone(),
                        op: node.op.into(),
                        device: device_label.clone(),
                        error: Box::new(error),
                    })?)
                }
            };
            cheap.push(is_cheap(op.name, &input_types, &node.outputs));
            let bound = op.name == "Const"
                && inputs.is_empty()
                && graph.control_inputs(idx).is_empty()
                && node.outputs.len() == 1;
            is_constant.push(bound);
            if bound {
                let value = evaluate_constant(&action, &node.name).map_err(|error| {
                    ExecError::KernelInit {
                        node: node.name.clone(),
                        op: node.op.to_string(),
                        device: device_label.clone(),
                        error: Box::new(error.into()),
                    }
                })?;
                constants.push((output_base[idx.index()], value));
            }
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
            // One notification per distinct successor, however many edges lead there.
            let mut successors: Vec<u32> = Vec::new();
            // A bound constant notifies nobody: its consumers do not wait for it.
            for (dst, _) in graph.out_edges(idx).into_iter().filter(|_| !bound) {
                let seen = &mut notified_by[dst.index()];
                if *seen != idx.index() {
                    *seen = idx.index();
                    successors.push(dst.index() as u32);
                }
            }
            node_successors.push(successors);
            node_inputs.push(
                inputs
                    .iter()
                    .map(|(src, out)| output_base[src.index()] + *out as u32)
                    .collect(),
            );
            nodes.push(PlanNode {
                name: node.name.clone(),
                op: op.name,
                action,
                output_base: output_base[idx.index()],
                num_outputs: node.outputs.len() as u32,
                variables: cells,
                output_sends: Vec::new(),
            });
        }
        link_sends_to_producers(&mut nodes, &node_inputs, num_slots as usize);
        let mut initial_pending = vec![0u32; nodes.len()];
        for succ in &node_successors {
            for &s in succ {
                initial_pending[s as usize] += 1;
            }
        }
        let roots = (0..nodes.len() as u32)
            .filter(|&i| initial_pending[i as usize] == 0 && !is_constant[i as usize])
            .collect();
        let num_scheduled = nodes.len() - constants.len();
        let (release, release_counts) =
            release_rules(&node_inputs, &is_constant, &output_base, num_slots as usize);
        let (succ_start, successors) = flatten(&node_successors);
        let (input_start, input_slots) = flatten(&node_inputs);
        Ok(ExecutionPlan {
            device: device.clone(),
            device_label,
            nodes,
            roots,
            num_slots: num_slots as usize,
            constants,
            num_scheduled,
            initial_pending,
            cheap,
            succ_start,
            successors,
            input_start,
            input_slots,
            release,
            release_counts,
            arena: Arena::default(),
        })
    }

    /// The distinct nodes that node `n` notifies when it completes.
    #[inline]
    pub(crate) fn successors(&self, n: u32) -> &[u32] {
        let n = n as usize;
        &self.successors[self.succ_start[n] as usize..self.succ_start[n + 1] as usize]
    }

    /// The value slot of each data input of node `n`.
    #[inline]
    pub(crate) fn input_slots(&self, n: u32) -> &[u32] {
        let n = n as usize;
        &self.input_slots[self.input_start[n] as usize..self.input_start[n + 1] as usize]
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

/// Per slot, when its value is released (see [`Release`]), and the starting read counts of the
/// counted ones. A bound constant's slot is kept (it is rebound every step).
fn release_rules(
    node_inputs: &[Vec<u32>],
    is_constant: &[bool],
    output_base: &[u32],
    num_slots: usize,
) -> (Vec<Release>, Vec<u32>) {
    let mut reads = vec![0u32; num_slots];
    for inputs in node_inputs {
        for &slot in inputs {
            reads[slot as usize] += 1;
        }
    }
    let mut constant = vec![false; num_slots];
    for (node, &bound) in is_constant.iter().enumerate() {
        if bound {
            constant[output_base[node] as usize] = true;
        }
    }
    let mut counts = Vec::new();
    let release = reads
        .iter()
        .zip(&constant)
        .map(|(&n, &c)| match n {
            _ if c => Release::AtEnd,
            0 => Release::AtEnd,
            1 => Release::AfterOnlyRead,
            n => {
                counts.push(n);
                Release::Counted(counts.len() as u32 - 1)
            }
        })
        .collect();
    (release, counts)
}

/// Concatenates `lists` into one array and the offsets of each list (with a final end offset).
fn flatten(lists: &[Vec<u32>]) -> (Vec<u32>, Vec<u32>) {
    let mut start = Vec::with_capacity(lists.len() + 1);
    let mut flat = Vec::with_capacity(lists.iter().map(Vec::len).sum());
    start.push(0);
    for l in lists {
        flat.extend_from_slice(l);
        start.push(flat.len() as u32);
    }
    (start, flat)
}

/// Runs a constant's kernel once, for its value.
fn evaluate_constant(action: &NodeAction, name: &str) -> Result<Tensor, String> {
    let NodeAction::Kernel(kernel) = action else {
        return Err("a constant must be a kernel".into());
    };
    let mut outputs = [None];
    kernel.compute(&mut KernelContext {
        node: name,
        inputs: &[],
        variables: &[],
        step: 0,
        outputs: &mut outputs,
        collectives: None,
        output_memory: None,
    })?;
    let [value] = outputs;
    value.ok_or_else(|| "the constant's kernel produced no value".to_string())
}
