//! ZeRO beside expert parallelism (`--mesh dp=D,ep=E --zero-stage 1|2|3`): on every worker, in
//! place of the all-reduces of the dense gradients (over all `D` workers) and of the expert
//! shards' gradients (over their expert-data-parallel group of `D/E` workers),
//! `--strategy zero`'s step ([`zero::shard_step_with`]) over each of those groups:
//!
//! - the dense parameters' Adam slots are sharded over the `D` workers
//!   (`{p}/adam_m/shard_{i}_of_{D}`), their gradients all-reduced (stage 1) or reduce-scattered
//!   (stage 2) in rank-major buckets over [`GROUP`], the updated shards all-gathered back;
//! - each expert shard's slots are sharded over its expert-data-parallel group
//!   (`{v}/shard_{k}/adam_m/shard_{j}_of_{D/E}`, `j` the worker's position in the group),
//!   summed and gathered over `experts_dp<k>`. With `E = D` no other worker holds a worker's
//!   experts: their slots stay whole and their update reads the gradient as it comes back
//!   through the all-to-all (as without ZeRO).
//!
//! **Stage 3** also shards the parameters themselves, by `--strategy zero`'s
//! [`params::shard_parameters_by`] over the same groups: each dense parameter becomes the
//! worker's flat shard `{p}/shard_{i}_of_{D}`, each expert shard the worker's flat shard of it
//! `{v}/shard_{k}/shard_{j}_of_{D/E}` (drawn as the flat elements of rows
//! `[k·E/ep, (k+1)·E/ep)` of the one-process variable: [`as_row_split`]), and every use reads a
//! copy all-gathered over [`GROUP`] or `experts_dp<k>` just before it (once for the forward
//! pass, once for the backward pass), dropped after its last reader. The gradients are
//! reduce-scattered over the same groups and each update writes the shard in place. With
//! `E = D` the expert shards stay whole (no other worker holds them).
//!
//! **Clipping** by the global norm: the dense `Σ‖g‖²` summed over the dense group (once), each
//! expert shard's over its expert-data-parallel group and then once per shard across the
//! expert-parallel group; their sum is the one-process `Σ‖g‖²`, one `GlobalNormScale` scales
//! every shard's update.
//!
//! **Order**: the two steps' collectives, the clipping's, the forward all-to-alls and the
//! load-balancing loss's gathers are chained in one topological order of the worker's graph
//! (the same on every worker: their graphs differ only in names, offsets and group keys).

use super::{ExpertLayout, GROUP};
use crate::strategy::allreduce::{fresh, node, WeightedTraining};
use crate::strategy::zero::{self, params, params::order_collectives, Clip, Param, ShardGroup};
use crate::strategy::{ReplicaGraph, StrategyError};
use dflow_graph::train::{TrainSpec, TrainingGraph};
use dflow_graph::{AttrValue, Graph, NodeDef};
use std::collections::{BTreeMap, HashMap, HashSet};

/// What [`zero_step`] shards.
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertZero<'a> {
    /// The layout of the experts over the workers.
    pub layout: ExpertLayout,
    /// The ZeRO stage (1, 2 or 3).
    pub stage: u8,
    /// Fusion threshold: the most bytes of (padded) gradients in one bucket.
    pub bucket_bytes: usize,
    /// The fed features and labels.
    pub feeds: (&'a str, &'a str),
    /// The nodes of the worker's forward graph (stage 3 gathers each parameter once for the
    /// forward pass and once for the backward pass).
    pub forward: &'a HashSet<String>,
}

/// Worker `worker`'s training graph from its weighted training `w` (forward graph already
/// expert-parallel; `local`: its expert shards) with ZeRO's steps in place of the gradient
/// all-reduces (see the module docs).
pub(super) fn zero_step(
    w: WeightedTraining,
    spec: &TrainSpec,
    worker: usize,
    local: &HashSet<String>,
    z: ExpertZero<'_>,
) -> Result<ReplicaGraph, StrategyError> {
    let WeightedTraining {
        mut training,
        typed,
        device,
        weight,
        weighted,
        base,
    } = w;
    let layout = z.layout;
    let (workers, ep) = (layout.workers(), layout.ep());
    // The forward pass: the worker's forward graph and its loss weighting.
    let mut forward = z.forward.clone();
    forward.extend([weight.clone(), format!("{weight}/cast"), weighted.clone()]);
    let all = std::mem::take(&mut training.gradients);
    let (experts, dense): (Vec<_>, Vec<_>) =
        all.iter().cloned().partition(|(v, _)| local.contains(v));
    let mut taken: HashSet<String> = training.def.nodes.iter().map(|n| n.name.clone()).collect();
    let clip = spec.clip_global_norm;
    let scale = fresh(&mut taken, "experts/zero/clip/global_norm_scale");
    let how = || match clip {
        Some(_) => Clip::Scale(&scale),
        None => Clip::None,
    };

    // The dense parameters over every worker, then the global batch's loss.
    let mut nodes = zero::Nodes::new(taken, &device, 1);
    training.gradients = dense;
    let ctx = ShardGroup {
        rank: worker,
        ranks: workers,
        stage: z.stage,
        key: GROUP.to_string(),
        bucket_bytes: z.bucket_bytes,
    };
    let (dense_params, dense_squared) =
        zero::shard_step_with(&mut training, &typed, &mut nodes, &ctx, how(), None)?;
    let dense_ctx = ctx;
    let global = nodes.collective(
        GROUP,
        &format!("{base}/global"),
        "CollectiveAllReduce",
        weighted,
        workers,
        true,
    );
    let mut added = std::mem::take(&mut nodes.added);
    taken = std::mem::take(&mut nodes.taken);

    // The expert shards over their expert-data-parallel group, if another worker holds them.
    let data = layout.expert_data_group(worker).map(|group| ShardGroup {
        rank: worker / ep,
        ranks: workers / ep,
        stage: z.stage,
        key: group,
        bucket_bytes: z.bucket_bytes,
    });
    let mut nodes = zero::Nodes::new(taken, &device, 1);
    let ep_group = layout.ep_group(worker);
    let (expert_params, expert_squared) = expert_shard_step(
        &mut training,
        &typed,
        &mut nodes,
        &device,
        experts,
        data.as_ref(),
        (&ep_group, ep),
        clip.map(|_| scale.as_str()),
    )?;
    let expert_shards = data.map(|ctx| (expert_params, ctx));
    added.append(&mut nodes.added);
    taken = std::mem::take(&mut nodes.taken);

    // One scale from the dense Σ‖g‖² and every expert shard's.
    if let Some(clip) = clip {
        let mut terms: Vec<String> = dense_squared.into_iter().collect();
        terms.extend(expert_squared);
        let total = fresh(&mut taken, "experts/zero/clip/squared_norm");
        added.push(node(&total, "AddN", terms, &device));
        let mut gns = node(&scale, "GlobalNormScale", vec![total], &device);
        gns.attrs = BTreeMap::from([
            ("clip_norm".to_string(), AttrValue::Float(clip)),
            ("squared_norm".to_string(), AttrValue::Bool(true)),
        ]);
        added.push(gns);
    }
    training.def.nodes.extend(added);
    training.gradients = all;
    if z.stage >= 3 {
        // The parameters themselves sharded, gathered just before each pass that reads them.
        let roots = [training.train_op.as_str(), global.as_str()];
        let pass = |n: &NodeDef| {
            if forward.contains(&n.name) {
                "forward".to_string()
            } else {
                "backward".to_string()
            }
        };
        let def = &mut training.def;
        params::shard_parameters_by(def, &dense_params, &dense_ctx, &forward, &roots, &pass)?;
        if let Some((expert_params, ctx)) = expert_shards {
            let shard = layout.shard(worker);
            for v in def.nodes.iter_mut().filter(|n| local.contains(&n.name)) {
                as_row_split(v, ep, shard);
            }
            params::shard_parameters_by(def, &expert_params, &ctx, &forward, &roots, &pass)?;
        }
    }
    training.loss = global;
    order_collectives(&mut training.def)?;
    ReplicaGraph::of_replica(training, worker, z.feeds, Some(weight), spec)
}

/// ZeRO's step for one worker's expert shards, whose gradients are `experts`, on `device`:
/// with `data` (the group of the workers holding the same shards) `--strategy zero`'s step over
/// it; without (no other worker holds them) their slots stay whole and, with `scale`, each
/// whole gradient is scaled before its update. With `scale` (clipping by the global norm
/// named so, made by the caller) the shards' `Σ‖g‖²` summed over the expert-parallel group
/// `ep_group` (key, size: each shard once) is returned. Used beside expert parallelism
/// ([`zero_step`]) and inside pipeline stages (`pipeline::zero::shard_stages`). Leaves
/// `training.gradients` as `experts`. Returns the parameters in the shard layout (none
/// without `data`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn expert_shard_step(
    training: &mut TrainingGraph,
    typed: &Graph,
    nodes: &mut zero::Nodes,
    device: &str,
    experts: Vec<(String, String)>,
    data: Option<&ShardGroup>,
    ep_group: (&str, usize),
    scale: Option<&str>,
) -> Result<(Vec<Param>, Option<String>), StrategyError> {
    training.gradients = experts;
    let mut params = Vec::new();
    let squared = if let Some(ctx) = data {
        let how = scale.map_or(Clip::None, Clip::Scale);
        let (p, sq) = zero::shard_step_with(training, typed, nodes, ctx, how, None)?;
        params = p;
        sq
    } else if let Some(scale) = scale {
        // Held by this worker alone: the whole gradient is here, scaled before its update.
        let part = fresh(&mut nodes.taken, "experts/zero/clip/squared_norm_part");
        let grads = training.gradients.iter().map(|(_, g)| g.clone()).collect();
        nodes.added.push(node(&part, "SquaredNorm", grads, device));
        let mut scaled: HashMap<String, String> = HashMap::new();
        for (var, g) in &training.gradients {
            let name = fresh(&mut nodes.taken, &format!("experts/zero/clip/{var}"));
            nodes.added.push(node(
                &name,
                "Mul",
                vec![g.clone(), scale.to_string()],
                device,
            ));
            scaled.insert(g.clone(), name);
        }
        for u in training
            .def
            .nodes
            .iter_mut()
            .filter(|u| u.op.starts_with("Apply"))
        {
            for input in &mut u.inputs {
                if let Some(s) = scaled.get(input.as_str()) {
                    *input = s.clone();
                }
            }
        }
        Some(part)
    } else {
        None
    };
    let Some(sq) = squared.filter(|_| scale.is_some()) else {
        return Ok((params, None));
    };
    // Not chained after the step's gathers, which wait for the updates, which wait for it.
    let mut apart = zero::Nodes::new(std::mem::take(&mut nodes.taken), device, nodes.instance);
    let squared = apart.collective(
        ep_group.0,
        "experts/zero/clip/expert_squared_norm",
        "CollectiveAllReduce",
        sq,
        ep_group.1,
        true,
    );
    nodes.taken = std::mem::take(&mut apart.taken);
    nodes.added.append(&mut apart.added);
    nodes.instance = apart.instance;
    Ok((params, Some(squared)))
}

/// Marks `v`, the expert row shard `shard` of `ep` (`[E/ep, ...]` rows of its `shard_of`), as
/// axis-0 part `shard` of `ep` of the whole variable: the same rows, in the form a flat shard of
/// it keeps ([`params::flat_shard`]: its elements of those rows, zero-padded past their end).
pub(crate) fn as_row_split(v: &mut NodeDef, ep: usize, shard: usize) {
    v.attrs
        .insert("shard_parts".into(), AttrValue::Int(ep as i64));
    v.attrs.insert("shard_axis".into(), AttrValue::Int(0));
    v.attrs
        .insert("shard_index".into(), AttrValue::Int(shard as i64));
    v.attrs.remove("shard_offset");
}

#[cfg(test)]
mod tests {
    use super::super::{expert_training_with, ExpertLayout};
    use crate::strategy::test_support::{moe_of, tiny_moe_gpt};
    use dflow_graph::{AttrValue, NodeDef};

    /// A two-block MoE GPT (4 experts, AdamW), clipped at global norm 0.5.
    fn graphs(stage: u8, workers: usize, ep: usize) -> Vec<crate::strategy::ReplicaGraph> {
        let (graph, spec) = tiny_moe_gpt(|c| {
            c.grad_clip = Some(0.5);
            moe_of(c).top_k = 1;
        });
        let layout = ExpertLayout::new(workers, ep).unwrap();
        expert_training_with(
            &graph,
            &spec,
            layout,
            "idx",
            "targets",
            1 << 20,
            Some(stage),
        )
        .unwrap()
    }

    fn group(n: &NodeDef) -> String {
        match n.attrs.get("group_key") {
            Some(AttrValue::String(k)) => k.to_string(),
            other => panic!("{}: group_key {other:?}", n.name),
        }
    }

    /// Worker `i`'s collectives in their chained order: (op, group with its index dropped).
    fn chain(g: &crate::strategy::ReplicaGraph) -> Vec<(String, String)> {
        let typed = &g.graph;
        let mut all: Vec<(i64, &NodeDef)> = g
            .training
            .def
            .nodes
            .iter()
            .filter(|n| n.op.starts_with("Collective"))
            .map(|n| match n.attrs.get("instance_key") {
                Some(AttrValue::Int(k)) => (*k, n),
                other => panic!("{}: instance_key {other:?}", n.name),
            })
            .collect();
        all.sort_by_key(|(k, _)| *k);
        // Each waits for the one before (except the dropped count, keyed apart, after the loss).
        for w in all.windows(2).filter(|w| w[1].0 < (1 << 19)) {
            assert!(
                w[1].1.inputs.contains(&format!("^{}", w[0].1.name)),
                "`{}` does not wait for `{}`",
                w[1].1.name,
                w[0].1.name
            );
        }
        assert!(typed.num_nodes() > 0);
        all.iter()
            .map(|(_, n)| {
                let g = group(n)
                    .trim_end_matches(|c: char| c.is_ascii_digit())
                    .to_string();
                (n.op.clone(), g)
            })
            .collect()
    }

    fn variables(g: &crate::strategy::ReplicaGraph) -> Vec<String> {
        g.training
            .def
            .nodes
            .iter()
            .filter(|n| n.op == "Variable")
            .map(|n| n.name.clone())
            .collect()
    }

    #[test]
    fn dp4_ep2_zero2_shards_dense_slots_over_all_and_expert_slots_over_their_holders() {
        let graphs = graphs(2, 4, 2);
        assert_eq!(graphs.len(), 4);
        let expert = "transformer.h.0.mlp.experts.c_fc.weight";
        for (i, g) in graphs.iter().enumerate() {
            let vars = variables(g);
            let has = |name: &str| vars.iter().any(|v| v == name);
            assert!(
                has(&format!("transformer.wte.weight/adam_m/shard_{i}_of_4")),
                "{vars:?}"
            );
            assert!(!has("transformer.wte.weight/adam_m"), "{vars:?}");
            let (k, j) = (i % 2, i / 2);
            assert!(
                has(&format!("{expert}/shard_{k}/adam_v/shard_{j}_of_2")),
                "{vars:?}"
            );
            assert!(!has(&format!("{expert}/shard_{k}/adam_v")), "{vars:?}");
            let ops: Vec<(&str, String)> = g
                .training
                .def
                .nodes
                .iter()
                .filter(|n| n.op.starts_with("Collective"))
                .map(|n| (n.op.as_str(), group(n)))
                .collect();
            // Stage 2: the gradients reduce-scattered over each group; no bucket all-reduce.
            for key in ["workers".to_string(), format!("experts_dp{k}")] {
                assert!(
                    ops.contains(&("CollectiveReduceScatter", key.clone())),
                    "{key}: {ops:?}"
                );
                assert!(
                    ops.contains(&("CollectiveAllGather", key.clone())),
                    "{ops:?}"
                );
            }
            // The expert shards' Σ‖g‖² once per shard across the expert-parallel group.
            let sq = g
                .training
                .def
                .nodes
                .iter()
                .find(|n| n.name == "experts/zero/clip/expert_squared_norm")
                .expect("the experts' squared norm over the ep group");
            assert_eq!(group(sq), format!("experts_ep{}", i / 2));
        }
        // One order of collectives (by kind and group) on every worker.
        let first = chain(&graphs[0]);
        for g in &graphs[1..] {
            assert_eq!(chain(g), first);
        }
    }

    #[test]
    fn dp4_ep2_zero3_shards_the_weights_over_the_same_groups_and_gathers_them_before_each_pass() {
        let graphs = graphs(3, 4, 2);
        let expert = "transformer.h.0.mlp.experts.c_fc.weight";
        let dense = "transformer.wte.weight";
        for (i, g) in graphs.iter().enumerate() {
            let (k, j) = (i % 2, i / 2);
            let vars = variables(g);
            let has = |name: &str| vars.iter().any(|v| v == name);
            // The weights are the worker's flat shards; no whole copy stays.
            let mine = format!("{expert}/shard_{k}/shard_{j}_of_2");
            assert!(has(&format!("{dense}/shard_{i}_of_4")), "{vars:?}");
            assert!(has(&mine), "{vars:?}");
            assert!(has(&format!("{expert}/shard_{k}/adam_m/shard_{j}_of_2")));
            // Worker 0's evaluation reads every shard (its own among them).
            if i > 0 {
                assert!(!has(dense), "{vars:?}");
                assert!(!has(&format!("{expert}/shard_{k}")), "{vars:?}");
            }
            // The expert shard's flat part is drawn from rows k·2.. of the whole variable.
            let v = g
                .training
                .def
                .nodes
                .iter()
                .find(|n| n.name == mine)
                .unwrap();
            assert_eq!(v.attrs.get("shard_parts"), Some(&AttrValue::Int(2)));
            assert_eq!(v.attrs.get("shard_index"), Some(&AttrValue::Int(k as i64)));
            assert_eq!(v.attrs.get("shard_flat"), Some(&AttrValue::Bool(true)));
            assert_eq!(
                v.attrs.get("shard_name"),
                Some(&AttrValue::String(expert.into()))
            );
            // Gathered before the forward and the backward pass, over the holders' group.
            let nodes = &g.training.def.nodes;
            for pass in ["forward", "backward"] {
                for (var, key) in [
                    (dense.to_string(), "workers".to_string()),
                    (format!("{expert}/shard_{k}"), format!("experts_dp{k}")),
                ] {
                    let name = format!("zero/{var}/all_gather_{pass}");
                    let n = nodes
                        .iter()
                        .find(|n| n.name == name)
                        .unwrap_or_else(|| panic!("no `{name}`"));
                    assert_eq!(n.op, "CollectiveAllGather");
                    assert_eq!(group(n), key, "{name}");
                }
            }
            // Stage 3 keeps the updated shards: no gather of the parameters after the update.
            assert!(!nodes
                .iter()
                .any(|n| n.name.starts_with("zero/bucket_") && n.name.contains("all_gather")));
        }
        // Worker 0 evaluates from shard 1's halves, sent by workers 1 and 3, packed; each is
        // sent just before the experts' inputs are ready (it waits for them).
        let nodes = &graphs[0].training.def.nodes;
        let find = |name: &str| {
            nodes
                .iter()
                .find(|n| n.name == name)
                .unwrap_or_else(|| panic!("no `{name}`"))
        };
        let eval = find(&format!("eval/{expert}/shard_1/joined"));
        assert_eq!(eval.inputs.len(), 2, "{:?}", eval.inputs);
        for (j, on) in [(0, 1), (1, 3)] {
            let piece = format!("{expert}/shard_1/shard_{j}_of_2");
            let sent = find(&eval.inputs[j]);
            assert_eq!(sent.inputs[0], piece);
            assert!(sent.device.ends_with(&format!("task:{on}")), "{sent:?}");
            assert!(find(&piece).device.ends_with(&format!("task:{on}")));
            assert!(sent.inputs.iter().any(|i| i.starts_with('^')), "{sent:?}");
        }
        let first = chain(&graphs[0]);
        for g in &graphs[1..] {
            assert_eq!(chain(g), first);
        }
    }

    #[test]
    fn with_ep_equal_to_dp_the_experts_slots_stay_whole() {
        let graphs = graphs(1, 2, 2);
        let expert = "transformer.h.1.mlp.experts.c_proj.weight";
        for (i, g) in graphs.iter().enumerate() {
            let vars = variables(g);
            let has = |name: &str| vars.iter().any(|v| v == name);
            assert!(has(&format!("{expert}/shard_{i}/adam_m")), "{vars:?}");
            assert!(
                has(&format!("transformer.wte.weight/adam_m/shard_{i}_of_2")),
                "{vars:?}"
            );
            // Clipping scales the local expert gradients before their update.
            assert!(g
                .training
                .def
                .nodes
                .iter()
                .any(|n| n.name == format!("experts/zero/clip/{expert}/shard_{i}")));
        }
        assert_eq!(chain(&graphs[0]), chain(&graphs[1]));
        // ZeRO-3 with ep = dp: the dense weights sharded over both, the experts whole.
        let graphs = super::tests::graphs(3, 2, 2);
        for (i, g) in graphs.iter().enumerate() {
            let vars = variables(g);
            let has = |name: &str| vars.iter().any(|v| v == name);
            assert!(has(&format!("{expert}/shard_{i}")), "{vars:?}");
            assert!(
                has(&format!("transformer.wte.weight/shard_{i}_of_2")),
                "{vars:?}"
            );
        }
        assert_eq!(chain(&graphs[0]), chain(&graphs[1]));
    }
}
