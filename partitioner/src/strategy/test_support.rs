//! What the strategies' unit tests share: a tiny MoE GPT, and the weights an evaluation moves
//! between tasks.

use crate::strategy::ReplicaGraph;
use dflow_graph::layers::{gpt, GptConfig, MoeConfig};
use dflow_graph::train::TrainSpec;
use dflow_graph::{Graph, InputRef, NodeDef};
use std::collections::{HashMap, HashSet};

/// A tiny MoE GPT: 2 blocks of 8 channels and 2 heads over 4 characters, a vocabulary of 11,
/// MoE MLPs of 4 experts, top-2, capacity factor 4 (no token dropped); `tweak` changes the
/// rest (the MoE settings through `cfg.moe`).
pub(crate) fn tiny_moe_gpt(tweak: impl FnOnce(&mut GptConfig)) -> (Graph, TrainSpec) {
    let mut cfg = GptConfig {
        vocab_size: 11,
        block_size: 4,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        moe: Some(MoeConfig {
            num_experts: 4,
            top_k: 2,
            capacity_factor: 4.0,
            ..MoeConfig::default()
        }),
        ..GptConfig::default()
    };
    tweak(&mut cfg);
    let model = gpt(&cfg).unwrap();
    let spec = model.def.train.clone().unwrap();
    (Graph::from_def(&model.def).unwrap(), spec)
}

/// The MoE settings of `cfg` (set by [`tiny_moe_gpt`]).
pub(crate) fn moe_of(cfg: &mut GptConfig) -> &mut MoeConfig {
    cfg.moe.as_mut().unwrap()
}

/// The tensors computed from weights alone (a variable, or an op all of whose data inputs
/// are) that an evaluation node (`eval/...`) of `g` reads from another task, with the
/// reader: a weight (or a piece of one) moving between devices.
pub(crate) fn weights_crossing_tasks(g: &ReplicaGraph) -> Vec<(String, String)> {
    let typed = &g.graph;
    let mut weighty: HashSet<String> = HashSet::new();
    for i in typed.topo_order() {
        let n = typed.node(i);
        let inputs = typed.inputs(i);
        if n.op_def().is_variable
            || (!inputs.is_empty()
                && inputs
                    .iter()
                    .all(|(p, _)| weighty.contains(&typed.node(*p).name)))
        {
            weighty.insert(n.name.clone());
        }
    }
    let by_name: HashMap<&str, &NodeDef> = g
        .training
        .def
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), n))
        .collect();
    let mut out = Vec::new();
    for n in g
        .training
        .def
        .nodes
        .iter()
        .filter(|n| n.name.starts_with("eval/"))
    {
        for i in &n.inputs {
            let Ok(InputRef::Data { node: p, .. }) = InputRef::parse(i) else {
                continue;
            };
            if weighty.contains(&p) && task_of(&by_name[p.as_str()].device) != task_of(&n.device) {
                out.push((p, n.name.clone()));
            }
        }
    }
    out
}

/// [`weights_crossing_tasks`] as `(tensor, its task, the reader's task)`.
pub(crate) fn weights_crossing_between_tasks(g: &ReplicaGraph) -> Vec<(String, usize, usize)> {
    let device: HashMap<&str, &str> = g
        .training
        .def
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), n.device.as_str()))
        .collect();
    weights_crossing_tasks(g)
        .into_iter()
        .map(|(p, reader)| {
            let (from, to) = (
                task_of(device[p.as_str()]),
                task_of(device[reader.as_str()]),
            );
            (p, from, to)
        })
        .collect()
}

/// The task index of a device name (`usize::MAX` when it names none).
pub(crate) fn task_of(device: &str) -> usize {
    dflow_graph::DeviceName::parse(device)
        .ok()
        .and_then(|d| d.task)
        .map_or(usize::MAX, |t| t as usize)
}
