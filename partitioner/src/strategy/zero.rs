//! ZeRO data parallelism (stages 1, 2 and 3) as a graph rewrite: every worker computes the
//! whole gradient of its part of the batch, as under [`super::allreduce`], but each worker keeps
//! the Adam/AdamW slots (`m`, `v`) of only its shard of every parameter and updates only that
//! shard; stage 3 also keeps only the shard of each parameter (see [`params`]).
//!
//! **Shard layout.** Parameter `p` with `L` elements, flattened in row-major order, is padded
//! with zeros to `N·S` elements, `S = ⌈L/N⌉` over `N` workers; rank `r` owns the elements
//! `[r·S, (r+1)·S)` (the last ranks' shards may be partly or wholly padding). Its slots are the
//! variables `{p}/adam_m/shard_{r}_of_{N}` and `{p}/adam_v/shard_{r}_of_{N}`, each of `S`
//! elements, initialised to zeros like the unsharded slots, so the logical slot `{p}/adam_m` is
//! the concatenation of the `N` shards cut back to `L` elements. At stages 1 and 2 the
//! parameters keep their names, shapes and initialisers (seeded by name), so every rank starts
//! from exactly the weights of a one-process run; at stage 3 the parameter is the variable
//! `{p}/shard_{r}_of_{N}`, initialised as its elements of that same seeded value. The step
//! counter `adam/t` is replicated. [`JobPlan::sharded`] lists every sharded logical tensor, so
//! a checkpoint holds whole tensors and resumes under any layout.
//!
//! **One step on rank `r`.**
//! 1. Forward and backward on the worker's part of the batch, loss weighted by `n_r/n` (as
//!    under all-reduce), giving every gradient whole. Stage 3 all-gathers each parameter just
//!    before its forward use and again before its backward use, and drops the gathered copy
//!    after its last reader.
//! 2. Gradients are fused into buckets (reverse variable order, at most `bucket_bytes` of padded
//!    gradients each). A bucket is packed rank-major — shard 0 of each of its parameters, then
//!    shard 1 of each, … — so that its `r`-th equal part holds exactly rank `r`'s shards.
//!    Stage 1 all-reduces the bucket (every rank holds the whole summed gradient, then slices its
//!    part); stages 2 and 3 reduce-scatter it (each rank only ever holds its part of the sum).
//! 3. Clipping by global norm, when asked: each rank's `SquaredNorm` of its gradient shards
//!    (padding is zero), summed over ranks by an all-reduce, is `Σ‖g‖²` of the whole summed
//!    gradient, so `GlobalNormScale(squared_norm=true)` gives exactly the one-process scale.
//! 4. `ApplyAdam`/`ApplyAdamW` with `shard_offset = r·S` update the rank's window of the
//!    parameter in place from the shard gradient and the shard slots (stage 3: the shard
//!    variable itself).
//! 5. Stages 1 and 2, per bucket: each rank reads (`ReadVariable`, after its update) its shard
//!    of every parameter, the shards are all-gathered, unpacked and written back (`Assign`):
//!    every rank ends the step with the same, fully updated parameters. Stage 3 keeps them
//!    sharded.
//! 6. The weighted loss is all-reduced into the global batch's mean loss (the fetched loss).
//!
//! All collectives are chained by control edges in one order on every rank (stage 3: one
//! topological order of the graph).
//!
//! **Memory per rank** (f32, Ψ parameters, padding aside): variables (parameters and slots)
//! 4Ψ + 8Ψ/N at stages 1 and 2 (12Ψ under all-reduce), 12Ψ/N at stage 3, measured by each
//! task's variable stores; gradients are step tensors: stage 1 materialises the whole summed
//! gradient, stage 2 receives only the rank's shard of the sum (the backward pass still
//! produces the whole local gradient of a bucket before packing it), stage 3 likewise plus the
//! gathered copies of the parameters in use. [`super::JobPlan::variables`] lists the variables
//! with their holders.

pub mod params;

use super::allreduce::{check_job, fresh, node, weighted_training, WeightedTraining};
use super::{JobInput, JobPlan, Registration, ReplicaGraph, Strategy, StrategyError};
use crate::job::{CollectiveGroup, Schedule};
use crate::shards::ShardedVariable;
use dflow_graph::train::{OptimizerKind, TrainSpec, TrainingGraph};
use dflow_graph::{AttrValue, DType, Graph, GraphDef, NodeDef, Shape, Tensor};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// The collective group of the workers under ZeRO.
pub const GROUP: &str = "zero";

/// ZeRO data parallelism over the workers (see the module docs); no ps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zero {
    /// 1: shard optimizer slots; 2: also reduce-scatter gradients; 3: also shard the
    /// parameters, gathered before each use.
    pub stage: u8,
    /// Fusion threshold: the most bytes of (padded) gradients in one bucket.
    pub bucket_bytes: usize,
}

/// `--strategy zero`.
pub(super) static REGISTRATION: Registration = Registration {
    name: "zero",
    about: "ZeRO: every worker computes whole gradients but keeps and updates only its 1/N shard \
            of the Adam state (--zero-stage 1), of the summed gradients (2), and of the \
            parameters, all-gathered just before each use (3); no ps",
    build: |opts| {
        if opts.asynchronous {
            return Err(StrategyError::Options {
                strategy: "zero",
                message:
                    "ZeRO is synchronous; --async is a parameter-server mode (use --strategy ps)"
                        .into(),
            });
        }
        match opts.zero_stage {
            1..=3 => Ok(Box::new(Zero {
                stage: opts.zero_stage,
                bucket_bytes: opts.bucket_bytes,
            })),
            s => Err(StrategyError::Options {
                strategy: "zero",
                message: format!("--zero-stage must be 1, 2 or 3, got {s}"),
            }),
        }
    },
};

impl Strategy for Zero {
    fn name(&self) -> &'static str {
        REGISTRATION.name
    }

    fn describe(&self) -> String {
        format!(
            "ZeRO stage {} data-parallel training, buckets of {:.1} MiB",
            self.stage,
            self.bucket_bytes as f64 / (1u64 << 20) as f64
        )
    }

    fn plan(&self, input: &JobInput<'_>) -> Result<JobPlan, StrategyError> {
        let forward = input.graph.to_def();
        let graphs = zero_graphs(
            input.graph,
            &forward,
            input.train,
            input.workers(),
            input.features,
            input.labels,
            self,
        )?;
        let placement = input.explicit_placement();
        let group = CollectiveGroup {
            key: GROUP.to_string(),
            members: input.worker_task_names(),
        };
        let workers = input.workers();
        let mut plan = JobPlan::build(
            self.describe(),
            input,
            graphs,
            &placement,
            Schedule::Lockstep,
            vec![group],
        )?;
        // Each slot `{p}/adam_m` (and, at stage 3, each parameter `p`) is the concatenation of
        // its shards, cut back to p's size.
        let params: BTreeMap<String, (DType, Vec<usize>)> = forward
            .nodes
            .iter()
            .filter(|n| n.op == "Variable")
            .filter_map(|n| {
                let i = input.graph.find(&n.name)?;
                let ty = input.graph.output_type(i, 0)?;
                Some((n.name.clone(), (ty.dtype, ty.shape.as_static()?)))
            })
            .collect();
        plan.sharded = slot_shards(&plan.variables, &params, workers);
        Ok(plan)
    }
}

/// The logical tensors ZeRO shards over `ranks` ranks among the plan's `variables`: each
/// `{p}/{slot}` with shards `{p}/{slot}/shard_{r}_of_{N}` (and, at stage 3, each parameter
/// `p` with shards `{p}/shard_{r}_of_{N}`), where `params` gives every parameter `p`'s dtype
/// and dimensions (the slots' too).
pub(crate) fn slot_shards(
    variables: &[crate::job::VariablePlan],
    params: &BTreeMap<String, (DType, Vec<usize>)>,
    ranks: usize,
) -> Vec<ShardedVariable> {
    let suffix = format!("/shard_0_of_{ranks}");
    let mut sharded = Vec::new();
    for v in variables {
        let Some(logical) = v.name.strip_suffix(&suffix) else {
            continue;
        };
        let param = match params.get(logical) {
            Some(p) => Some(p),
            None => logical.rsplit_once('/').and_then(|(p, _)| params.get(p)),
        };
        let Some((dtype, dims)) = param else {
            continue;
        };
        sharded.push(ShardedVariable {
            logical: logical.to_string(),
            dtype: *dtype,
            dims: dims.clone(),
            shards: (0..ranks)
                .map(|r| format!("{logical}/shard_{r}_of_{ranks}"))
                .collect(),
            shard_dims: None,
        });
    }
    sharded
}

/// The ZeRO training graphs of `forward`, one per worker (see the module docs).
pub fn zero_training(
    forward: &GraphDef,
    spec: &TrainSpec,
    workers: usize,
    features: &str,
    labels: &str,
    zero: &Zero,
) -> Result<Vec<ReplicaGraph>, StrategyError> {
    let graph = Graph::from_def(forward).map_err(StrategyError::InvalidGraph)?;
    zero_graphs(&graph, forward, spec, workers, features, labels, zero)
}

fn zero_graphs(
    graph: &Graph,
    forward: &GraphDef,
    spec: &TrainSpec,
    workers: usize,
    features: &str,
    labels: &str,
    zero: &Zero,
) -> Result<Vec<ReplicaGraph>, StrategyError> {
    let loss_dtype = check_job(graph, spec, workers, features, labels)?;
    check_optimizer(spec, "zero")?;
    (0..workers)
        .map(|r| {
            let ctx = ShardGroup {
                rank: r,
                ranks: workers,
                stage: zero.stage,
                key: GROUP.to_string(),
                bucket_bytes: zero.bucket_bytes,
            };
            worker_graph(forward, spec, &ctx, features, labels, loss_dtype)
        })
        .collect()
}

/// ZeRO shards the Adam/AdamW slots: another optimizer is an error naming it (`strategy`: the
/// strategy refusing it).
pub(crate) fn check_optimizer(
    spec: &TrainSpec,
    strategy: &'static str,
) -> Result<(), StrategyError> {
    if matches!(
        spec.optimizer.kind,
        OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. }
    ) {
        return Ok(());
    }
    Err(StrategyError::Options {
        strategy,
        message: format!(
            "ZeRO shards the Adam/AdamW slots; the train spec's optimizer is {}: use adam or \
             adamw, or no ZeRO (--strategy allreduce, or no --zero-stage)",
            spec.optimizer.kind.name()
        ),
    })
}

/// A rank's place in the group of ranks a ZeRO step is sharded over: the workers under
/// `--strategy zero`, a data-parallel group of a mesh beside tensor parallelism.
pub(crate) struct ShardGroup {
    /// The rank's index in the group (its shard).
    pub rank: usize,
    /// The group's size `N`.
    pub ranks: usize,
    /// The ZeRO stage: 1 all-reduces the gradients, 2 and 3 reduce-scatter them; 1 and 2
    /// all-gather the updated shards back into the whole parameters.
    pub stage: u8,
    /// The group's collective key.
    pub key: String,
    /// Fusion threshold: the most bytes of (padded) gradients in one bucket.
    pub bucket_bytes: usize,
}

/// Parameters that are themselves shards over an outer group (tensor parallelism's weights):
/// clipping's `Σ‖g‖²` of their ZeRO shards is summed over [`ShardGroup::key`] and then over
/// `key`; every other parameter is replicated over the outer group, its `Σ‖g‖²` counted once.
pub(crate) struct OuterShards<'a> {
    /// The outer group's collective key.
    pub key: &'a str,
    /// The parameters sharded over it.
    pub sharded: &'a HashSet<String>,
}

/// A trained parameter in the shard layout.
pub(crate) struct Param {
    var: String,
    grad: String,
    update: String,
    dtype: DType,
    dims: Vec<usize>,
    /// Elements.
    len: usize,
    /// Shard elements `S = ⌈len / N⌉`.
    shard: usize,
    /// The shard's offset in the rank's part of its bucket.
    offset: usize,
}

impl Param {
    fn padding(&self, ranks: usize) -> usize {
        self.shard * ranks - self.len
    }
}

/// Adds nodes to one worker's graph under fresh names; its collectives are numbered from
/// `instance` and each waits for the one before.
pub(crate) struct Nodes {
    /// The graph's names (and every added one).
    pub taken: HashSet<String>,
    /// The nodes added, for the caller to append to the graph.
    pub added: Vec<NodeDef>,
    device: String,
    /// The next collective's instance key.
    pub instance: i64,
    previous: Option<String>,
}

impl Nodes {
    /// Adds to a graph whose node names are `taken`, on `device`, the first collective keyed
    /// `instance`.
    pub(crate) fn new(taken: HashSet<String>, device: &str, instance: i64) -> Nodes {
        Nodes {
            taken,
            added: Vec::new(),
            device: device.to_string(),
            instance,
            previous: None,
        }
    }

    fn add(
        &mut self,
        base: &str,
        op: &str,
        inputs: Vec<String>,
        attrs: Vec<(&str, AttrValue)>,
    ) -> String {
        let name = fresh(&mut self.taken, base);
        let mut n = node(&name, op, inputs, &self.device);
        n.attrs = attrs.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        self.added.push(n);
        name
    }

    fn flat_slice(&mut self, base: &str, input: &str, offset: usize, dims: &[usize]) -> String {
        self.add(
            base,
            "FlatSlice",
            vec![input.to_string()],
            vec![
                ("offset", AttrValue::Int(offset as i64)),
                ("shape", AttrValue::Shape(Shape::known(dims))),
            ],
        )
    }

    /// A collective of group `key` (of `ranks` ranks), after the previous one.
    pub(crate) fn collective(
        &mut self,
        key: &str,
        base: &str,
        op: &str,
        input: String,
        ranks: usize,
        reduce: bool,
    ) -> String {
        let mut inputs = vec![input];
        if let Some(p) = &self.previous {
            inputs.push(format!("^{p}"));
        }
        let mut attrs = vec![
            ("group_key", AttrValue::String(key.into())),
            ("instance_key", AttrValue::Int(self.instance)),
        ];
        if op != "CollectiveAllReduce" {
            attrs.push(("group_size", AttrValue::Int(ranks as i64)));
        }
        if reduce {
            attrs.push(("reduce", AttrValue::String("sum".into())));
        }
        self.instance += 1;
        let name = self.add(base, op, inputs, attrs);
        self.previous = Some(name.clone());
        name
    }

    /// `input` flattened and padded with `padding` zeros of `dtype`.
    fn padded(
        &mut self,
        base: &str,
        input: &str,
        dtype: DType,
        padding: usize,
    ) -> Result<String, StrategyError> {
        let mut inputs = vec![input.to_string()];
        if padding > 0 {
            let zeros = Tensor::zeros(dtype, &[padding]).map_err(|e| StrategyError::Options {
                strategy: "zero",
                message: format!("padding `{input}` with {padding} zeros of {dtype}: {e}"),
            })?;
            inputs.push(self.add(
                &format!("{base}/padding"),
                "Const",
                vec![],
                vec![("value", AttrValue::Tensor(Arc::new(zeros)))],
            ));
        }
        Ok(self.add(base, "PackFlat", inputs, vec![]))
    }
}

fn worker_graph(
    forward: &GraphDef,
    spec: &TrainSpec,
    ctx: &ShardGroup,
    features: &str,
    labels: &str,
    loss_dtype: DType,
) -> Result<ReplicaGraph, StrategyError> {
    let n = ctx.ranks;
    // The update ops are rewritten below; clipping is done on the shards.
    let unclipped = TrainSpec {
        clip_global_norm: None,
        ..spec.clone()
    };
    let WeightedTraining {
        mut training,
        typed,
        device,
        weight,
        weighted,
        base,
    } = weighted_training(forward, &unclipped, ctx.rank, loss_dtype)?;

    let taken = training.def.nodes.iter().map(|x| x.name.clone()).collect();
    let mut nodes = Nodes::new(taken, &device, 1);
    let params = shard_step(
        &mut training,
        &typed,
        &mut nodes,
        ctx,
        spec.clip_global_norm,
        None,
    )?;

    // The forward pass's nodes (stage 3 gathers parameters separately for the backward pass).
    let mut passes: HashSet<String> = forward.nodes.iter().map(|x| x.name.clone()).collect();
    passes.extend([weight.clone(), format!("{weight}/cast"), weighted.clone()]);

    // The global batch's mean loss, last of the collectives.
    let global = nodes.collective(
        GROUP,
        &format!("{base}/global"),
        "CollectiveAllReduce",
        weighted,
        n,
        true,
    );
    training.def.nodes.extend(nodes.added);
    if ctx.stage >= 3 {
        let roots = [training.train_op.as_str(), global.as_str()];
        params::shard_parameters(&mut training.def, &params, ctx, &passes, &roots)?;
        params::order_collectives(&mut training.def)?;
    }
    training.loss = global;
    let mut replica =
        ReplicaGraph::of_replica(training, ctx.rank, (features, labels), Some(weight), spec)?;
    if ctx.stage >= 3 && ctx.rank == 0 {
        params::add_eval_copy(&mut replica, forward, &params, ctx)?;
    }
    Ok(replica)
}

/// Steps 2–5 of the module docs on one rank's training graph: its gradients summed over
/// `ctx`'s group in rank-major buckets (all-reduced at stage 1, reduce-scattered from stage 2),
/// clipped by the global norm `clip` across the shards (and across `outer`'s, see
/// [`OuterShards`]), its Adam/AdamW slots replaced by the rank's shards (`{slot}/shard_{r}_of_{N}`),
/// each update applied to the rank's window, and (stages 1 and 2) the updated shards all-gathered
/// and assigned back, the train op waiting for them. `typed` is the validated `training.def`.
/// The nodes added are left in `nodes.added` for the caller; returns the parameters in the
/// shard layout.
pub(crate) fn shard_step(
    training: &mut TrainingGraph,
    typed: &Graph,
    nodes: &mut Nodes,
    ctx: &ShardGroup,
    clip: Option<f64>,
    outer: Option<&OuterShards<'_>>,
) -> Result<Vec<Param>, StrategyError> {
    let clip = clip.map_or(Clip::None, Clip::Norm);
    shard_step_with(training, typed, nodes, ctx, clip, outer).map(|(params, _)| params)
}

/// How [`shard_step_with`] clips the gradient shards.
pub(crate) enum Clip<'a> {
    /// Not at all.
    None,
    /// By this global norm of the whole summed gradient (the group's and `outer`'s).
    Norm(f64),
    /// By the scalar `scale` the caller computes (under that name, after the step) from the
    /// `Σ‖g‖²` the step returns and other groups' (a pipeline's stages).
    Scale(&'a str),
}

/// [`shard_step`] with the clipping `clip`; also returns, under [`Clip::Scale`], the tensor
/// holding `Σ‖g‖²` of the group's summed gradients (the caller's scale is computed from it).
pub(crate) fn shard_step_with(
    training: &mut TrainingGraph,
    typed: &Graph,
    nodes: &mut Nodes,
    ctx: &ShardGroup,
    clip: Clip<'_>,
    outer: Option<&OuterShards<'_>>,
) -> Result<(Vec<Param>, Option<String>), StrategyError> {
    let n = ctx.ranks;
    let mut params: Vec<Param> = Vec::new();
    for (var, grad) in &training.gradients {
        let update = training
            .def
            .nodes
            .iter()
            .find(|u| {
                matches!(u.op.as_str(), "ApplyAdam" | "ApplyAdamW") && u.inputs.first() == Some(var)
            })
            .map(|u| u.name.clone())
            .ok_or_else(|| StrategyError::UnknownTensor {
                role: "variable",
                name: var.clone(),
                message: "no Adam update op reads it".into(),
            })?;
        let ty = typed
            .find(var)
            .and_then(|i| typed.output_type(i, 0))
            .ok_or_else(|| StrategyError::UnknownTensor {
                role: "variable",
                name: var.clone(),
                message: "not in the training graph".into(),
            })?;
        let dims = ty
            .shape
            .as_static()
            .ok_or_else(|| StrategyError::NotScalar {
                role: "variable",
                name: var.clone(),
                shape: ty.shape.clone(),
            })?;
        let len = dims.iter().product::<usize>();
        params.push(Param {
            var: var.clone(),
            grad: grad.clone(),
            update,
            dtype: ty.dtype,
            dims,
            len,
            shard: len.div_ceil(n).max(1),
            offset: 0,
        });
    }

    // Buckets, last variables first, split by dtype and by the threshold.
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut bucket_size = 0usize;
    for (i, p) in params.iter().enumerate().rev() {
        let bytes = p.shard * n * p.dtype.size_of();
        let fits = buckets.last().is_some_and(|b| {
            params[b[0]].dtype == p.dtype && bucket_size + bytes <= ctx.bucket_bytes.max(1)
        });
        if !fits {
            buckets.push(Vec::new());
            bucket_size = 0;
        }
        bucket_size += bytes;
        if let Some(b) = buckets.last_mut() {
            b.push(i);
        }
    }
    for b in &buckets {
        let mut offset = 0;
        for &i in b {
            params[i].offset = offset;
            offset += params[i].shard;
        }
    }

    // Gradients: packed rank-major, summed, the rank's part kept.
    let mut shard_grads: Vec<String> = vec![String::new(); params.len()];
    for (k, b) in buckets.iter().enumerate() {
        let part: usize = b.iter().map(|&i| params[i].shard).sum();
        let mut padded = Vec::with_capacity(b.len());
        for &i in b {
            let p = &params[i];
            padded.push(nodes.padded(
                &format!("zero/{}/grad_flat", p.var),
                &p.grad,
                p.dtype,
                p.padding(n),
            )?);
        }
        let mut pieces = Vec::with_capacity(b.len() * n);
        for r in 0..n {
            for (j, &i) in b.iter().enumerate() {
                let p = &params[i];
                pieces.push(nodes.flat_slice(
                    &format!("zero/{}/grad_part_{r}", p.var),
                    &padded[j],
                    r * p.shard,
                    &[p.shard],
                ));
            }
        }
        let pack = nodes.add(
            &format!("zero/bucket_{k}/grads"),
            "PackFlat",
            pieces,
            vec![],
        );
        let mine = if ctx.stage >= 2 {
            nodes.collective(
                &ctx.key,
                &format!("zero/bucket_{k}/reduce_scatter"),
                "CollectiveReduceScatter",
                pack,
                n,
                true,
            )
        } else {
            let all = nodes.collective(
                &ctx.key,
                &format!("zero/bucket_{k}/all_reduce"),
                "CollectiveAllReduce",
                pack,
                n,
                true,
            );
            nodes.flat_slice(
                &format!("zero/bucket_{k}/grads_mine"),
                &all,
                ctx.rank * part,
                &[part],
            )
        };
        for &i in b {
            let p = &params[i];
            shard_grads[i] = nodes.flat_slice(
                &format!("zero/{}/grad_shard", p.var),
                &mine,
                p.offset,
                &[p.shard],
            );
        }
    }

    // Clipping by the norm of the whole summed gradient.
    let mut squared = None;
    let scale = match clip {
        Clip::None => None,
        Clip::Norm(clip) => {
            let total = squared_norm(nodes, ctx, &params, &shard_grads, outer);
            Some(nodes.add(
                "zero/clip/global_norm_scale",
                "GlobalNormScale",
                vec![total],
                vec![
                    ("clip_norm", AttrValue::Float(clip)),
                    ("squared_norm", AttrValue::Bool(true)),
                ],
            ))
        }
        Clip::Scale(scale) => {
            squared = Some(squared_norm(nodes, ctx, &params, &shard_grads, outer));
            Some(scale.to_string())
        }
    };
    if let Some(scale) = scale {
        for (p, g) in params.iter().zip(shard_grads.iter_mut()) {
            *g = nodes.add(
                &format!("zero/clip/{}", p.var),
                "Mul",
                vec![g.clone(), scale.clone()],
                vec![],
            );
        }
    }

    // Sharded slots and updates.
    let mut removed: HashSet<String> = HashSet::new();
    let mut slots: Vec<NodeDef> = Vec::new();
    for (p, g) in params.iter().zip(&shard_grads) {
        let Some(u) = training.def.nodes.iter_mut().find(|u| u.name == p.update) else {
            continue;
        };
        for k in [1, 2] {
            let Some(slot) = u.inputs.get(k).cloned() else {
                continue;
            };
            let name = format!("{slot}/shard_{}_of_{n}", ctx.rank);
            if nodes.taken.contains(&name) {
                return Err(StrategyError::NameTaken {
                    node: slot.clone(),
                    name,
                });
            }
            nodes.taken.insert(name.clone());
            let mut s = node(&name, "Variable", vec![], &nodes.device);
            s.attrs = BTreeMap::from([
                ("dtype".to_string(), AttrValue::DType(p.dtype)),
                (
                    "shape".to_string(),
                    AttrValue::Shape(Shape::known(&[p.shard])),
                ),
                ("initializer".to_string(), AttrValue::String("zeros".into())),
            ]);
            slots.push(s);
            removed.insert(slot);
            u.inputs[k] = name;
        }
        if let Some(grad) = u.inputs.get_mut(4) {
            *grad = g.clone();
        }
        // Stage 3: the variable is the shard itself (its whole, `shard_offset` unset).
        if ctx.stage < 3 {
            u.attrs.insert(
                "shard_offset".to_string(),
                AttrValue::Int((ctx.rank * p.shard) as i64),
            );
        }
    }
    training.def.nodes.retain(|x| !removed.contains(&x.name));
    training.def.nodes.extend(slots);

    // The updated shards, all-gathered and written back (stage 3 keeps them sharded).
    let mut assigns = Vec::with_capacity(params.len());
    for (k, b) in buckets.iter().enumerate().filter(|_| ctx.stage < 3) {
        let part: usize = b.iter().map(|&i| params[i].shard).sum();
        let mut mine = Vec::with_capacity(b.len());
        for &i in b {
            let p = &params[i];
            let read = nodes.add(
                &format!("zero/{}/read", p.var),
                "ReadVariable",
                vec![p.var.clone(), format!("^{}", p.update)],
                vec![],
            );
            let flat = nodes.padded(
                &format!("zero/{}/flat", p.var),
                &read,
                p.dtype,
                p.padding(n),
            )?;
            mine.push(nodes.flat_slice(
                &format!("zero/{}/shard", p.var),
                &flat,
                ctx.rank * p.shard,
                &[p.shard],
            ));
        }
        let pack = nodes.add(&format!("zero/bucket_{k}/params"), "PackFlat", mine, vec![]);
        let gathered = nodes.collective(
            &ctx.key,
            &format!("zero/bucket_{k}/all_gather"),
            "CollectiveAllGather",
            pack,
            n,
            false,
        );
        for &i in b {
            let p = &params[i];
            let shards: Vec<String> = (0..n)
                .map(|r| {
                    nodes.flat_slice(
                        &format!("zero/{}/gathered_{r}", p.var),
                        &gathered,
                        r * part + p.offset,
                        &[p.shard],
                    )
                })
                .collect();
            let whole = nodes.add(
                &format!("zero/{}/gathered", p.var),
                "PackFlat",
                shards,
                vec![],
            );
            let value = nodes.flat_slice(&format!("zero/{}/value", p.var), &whole, 0, &p.dims);
            assigns.push(nodes.add(
                &format!("zero/{}/assign", p.var),
                "Assign",
                vec![p.var.clone(), value],
                vec![],
            ));
        }
    }

    if let Some(t) = training
        .def
        .nodes
        .iter_mut()
        .find(|x| x.name == training.train_op)
    {
        t.inputs.extend(assigns.iter().map(|a| format!("^{a}")));
    }
    Ok((params, squared))
}

/// `Σ‖g‖²` of the whole summed gradient from the rank's gradient shards `grads` (one per
/// parameter): summed over `ctx`'s group, and over `outer`'s group for its sharded parameters.
fn squared_norm(
    nodes: &mut Nodes,
    ctx: &ShardGroup,
    params: &[Param],
    grads: &[String],
    outer: Option<&OuterShards<'_>>,
) -> String {
    let n = ctx.ranks;
    let Some(outer) = outer else {
        let part = nodes.add(
            "zero/clip/squared_norm_part",
            "SquaredNorm",
            grads.to_vec(),
            vec![],
        );
        return nodes.collective(
            &ctx.key,
            "zero/clip/squared_norm",
            "CollectiveAllReduce",
            part,
            n,
            true,
        );
    };
    let (sharded, replicated): (Vec<_>, Vec<_>) = params
        .iter()
        .zip(grads)
        .partition(|(p, _)| outer.sharded.contains(&p.var));
    let mut terms = Vec::new();
    for (what, list, over_outer) in [
        ("sharded", sharded, true),
        ("replicated", replicated, false),
    ] {
        if list.is_empty() {
            continue;
        }
        let part = nodes.add(
            &format!("zero/clip/{what}_squared_norm_part"),
            "SquaredNorm",
            list.iter().map(|(_, g)| g.to_string()).collect(),
            vec![],
        );
        let mut sum = nodes.collective(
            &ctx.key,
            &format!("zero/clip/{what}_squared_norm"),
            "CollectiveAllReduce",
            part,
            n,
            true,
        );
        if over_outer {
            sum = nodes.collective(
                outer.key,
                &format!("zero/clip/{what}_squared_norm_outer"),
                "CollectiveAllReduce",
                sum,
                n,
                true,
            );
        }
        terms.push(sum);
    }
    match &terms[..] {
        [a, b] => nodes.add(
            "zero/clip/squared_norm",
            "Add",
            vec![a.clone(), b.clone()],
            vec![],
        ),
        [a] => a.clone(),
        _ => nodes.add(
            "zero/clip/squared_norm",
            "Const",
            vec![],
            vec![("value", AttrValue::Tensor(Arc::new(Tensor::scalar(0.0f32))))],
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::train::OptimizerSpec;

    fn digits_adamw() -> (GraphDef, TrainSpec) {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/digits/digits-adamw.json"
        ))
        .unwrap();
        let parsed = dflow_graph::format::parse_json(&text, None).unwrap();
        let spec = parsed.def.train.clone().unwrap();
        (parsed.def, spec)
    }

    fn zero(stage: u8, bucket_bytes: usize) -> Zero {
        Zero {
            stage,
            bucket_bytes,
        }
    }

    fn ops<'a>(g: &'a ReplicaGraph, op: &str) -> Vec<&'a NodeDef> {
        g.training.def.nodes.iter().filter(|n| n.op == op).collect()
    }

    fn int(n: &NodeDef, attr: &str) -> i64 {
        match n.attrs.get(attr) {
            Some(AttrValue::Int(v)) => *v,
            other => panic!("{} {attr}: {other:?}", n.name),
        }
    }

    #[test]
    fn each_rank_holds_and_updates_only_its_shard_of_the_adam_slots() {
        let (def, spec) = digits_adamw();
        for n in [2usize, 3] {
            let graphs =
                zero_training(&def, &spec, n, "pixels", "labels", &zero(1, 1 << 20)).unwrap();
            assert_eq!(graphs.len(), n);
            for (r, g) in graphs.iter().enumerate() {
                let want = format!("/job:worker/task:{r}");
                assert!(g.training.def.nodes.iter().all(|x| x.device == want));
                // Every update reads its rank's shard slots at offset r·S, S = ⌈len/N⌉.
                let updates = ops(g, "ApplyAdamW");
                assert_eq!(updates.len(), 4);
                for u in updates {
                    let var = &u.inputs[0];
                    let len: usize = match var.as_str() {
                        "w1" => 64 * 32,
                        "b1" => 32,
                        "w2" => 32 * 10,
                        "b2" => 10,
                        v => panic!("unexpected variable {v}"),
                    };
                    let s = len.div_ceil(n);
                    assert_eq!(int(u, "shard_offset"), (r * s) as i64, "{}", u.name);
                    for (k, slot) in [(1, "adam_m"), (2, "adam_v")] {
                        let name = format!("{var}/{slot}/shard_{r}_of_{n}");
                        assert_eq!(u.inputs[k], name);
                        let v = g
                            .training
                            .def
                            .nodes
                            .iter()
                            .find(|x| x.name == name)
                            .unwrap();
                        assert_eq!(
                            v.attrs.get("shape"),
                            Some(&AttrValue::Shape(Shape::known(&[s])))
                        );
                    }
                    assert!(u.inputs[4].starts_with("zero/clip/"), "{:?}", u.inputs);
                }
                // No whole-size slot is left.
                assert!(!g
                    .training
                    .def
                    .nodes
                    .iter()
                    .any(|x| x.name.ends_with("/adam_m")));
                // Stage 1: one all-reduce of the gradients, one of the squared norm, one of the loss.
                assert_eq!(ops(g, "CollectiveAllReduce").len(), 3);
                assert!(ops(g, "CollectiveReduceScatter").is_empty());
                assert_eq!(ops(g, "CollectiveAllGather").len(), 1);
                assert_eq!(ops(g, "Assign").len(), 4);
            }
        }
    }

    #[test]
    fn stage_two_reduce_scatters_and_every_collective_is_chained_in_one_order() {
        let (def, spec) = digits_adamw();
        // One bucket per parameter: four reduce-scatters, four all-gathers.
        let graphs = zero_training(&def, &spec, 2, "pixels", "labels", &zero(2, 1)).unwrap();
        let names: Vec<Vec<(String, i64)>> = graphs
            .iter()
            .map(|g| {
                g.training
                    .def
                    .nodes
                    .iter()
                    .filter(|n| n.op.starts_with("Collective"))
                    .map(|n| (n.op.clone(), int(n, "instance_key")))
                    .collect()
            })
            .collect();
        assert_eq!(names[0], names[1]);
        let g = &graphs[0];
        assert_eq!(ops(g, "CollectiveReduceScatter").len(), 4);
        assert_eq!(ops(g, "CollectiveAllGather").len(), 4);
        // Grad buckets, the clip norm, gather buckets, the loss: each after the one before.
        let chain: Vec<&NodeDef> = g
            .training
            .def
            .nodes
            .iter()
            .filter(|n| n.op.starts_with("Collective"))
            .collect();
        assert_eq!(chain.len(), 4 + 1 + 4 + 1);
        let mut sorted = chain.clone();
        sorted.sort_by_key(|n| int(n, "instance_key"));
        for w in sorted.windows(2) {
            assert!(
                w[1].inputs.contains(&format!("^{}", w[0].name)),
                "{} does not wait for {}",
                w[1].name,
                w[0].name
            );
        }
        for rs in ops(g, "CollectiveReduceScatter") {
            assert_eq!(int(rs, "group_size"), 2);
        }
        assert_eq!(g.training.loss, sorted.last().unwrap().name);
    }

    #[test]
    fn a_rank_major_bucket_puts_each_ranks_shards_together() {
        let (def, spec) = digits_adamw();
        let graphs = zero_training(&def, &spec, 3, "pixels", "labels", &zero(2, 1 << 20)).unwrap();
        let g = &graphs[1];
        let pack = g
            .training
            .def
            .nodes
            .iter()
            .find(|n| n.name == "zero/bucket_0/grads")
            .unwrap();
        // Reverse variable order, rank 0's shards first: b2, w2, b1, w1 of rank 0, then rank 1…
        let first: Vec<&str> = pack.inputs[..4].iter().map(String::as_str).collect();
        assert_eq!(
            first,
            [
                "zero/b2/grad_part_0",
                "zero/w2/grad_part_0",
                "zero/b1/grad_part_0",
                "zero/w1/grad_part_0"
            ]
        );
        assert_eq!(pack.inputs[4], "zero/b2/grad_part_1");
        // b2 (10 elements over 3 ranks) is padded with 2 zeros; w1 (2048) with 1.
        let pad = |name: &str| {
            g.training
                .def
                .nodes
                .iter()
                .find(|n| n.name == name)
                .map(|n| match n.attrs.get("value") {
                    Some(AttrValue::Tensor(t)) => t.num_elements(),
                    _ => 0,
                })
        };
        assert_eq!(pad("zero/b2/grad_flat/padding"), Some(2));
        assert_eq!(pad("zero/w1/grad_flat/padding"), Some(1));
        assert_eq!(pad("zero/w2/grad_flat/padding"), Some(1));
        assert_eq!(pad("zero/b1/grad_flat/padding"), Some(1));
    }

    #[test]
    fn one_worker_holds_whole_shards_and_zero_workers_are_refused() {
        let (def, spec) = digits_adamw();
        let graphs = zero_training(&def, &spec, 1, "pixels", "labels", &zero(2, 1 << 20)).unwrap();
        let g = &graphs[0];
        for u in ops(g, "ApplyAdamW") {
            assert_eq!(int(u, "shard_offset"), 0);
            assert!(
                u.inputs[1].ends_with("/adam_m/shard_0_of_1"),
                "{:?}",
                u.inputs
            );
        }
        assert!(!g
            .training
            .def
            .nodes
            .iter()
            .any(|n| n.name.ends_with("/padding")));
        assert!(matches!(
            zero_training(&def, &spec, 0, "pixels", "labels", &zero(1, 1)),
            Err(StrategyError::WorkerCount(0))
        ));
    }

    #[test]
    fn the_gpt_keeps_its_decay_rule_and_schedule_per_shard() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/gpt/gpt.json"
        ))
        .unwrap();
        let parsed = dflow_graph::format::parse_json(&text, None).unwrap();
        let spec = parsed.def.train.clone().unwrap();
        let graphs =
            zero_training(&parsed.def, &spec, 2, "idx", "targets", &zero(2, 1 << 20)).unwrap();
        let g = &graphs[1];
        let float = |n: &NodeDef, a: &str| match n.attrs.get(a) {
            Some(AttrValue::Float(x)) => *x,
            other => panic!("{} {a}: {other:?}", n.name),
        };
        // The unsharded expansion's attributes (decay rule, schedule), per variable.
        let single = dflow_graph::train::expand_training(&parsed.def, &spec).unwrap();
        let unsharded: BTreeMap<&str, &NodeDef> = single
            .def
            .nodes
            .iter()
            .filter(|n| n.op == "ApplyAdamW")
            .map(|n| (n.inputs[0].as_str(), n))
            .collect();
        let updates = ops(g, "ApplyAdamW");
        assert_eq!(updates.len(), unsharded.len());
        assert!(updates.iter().any(|u| float(u, "weight_decay") == 0.0));
        for u in updates {
            let want = unsharded[u.inputs[0].as_str()];
            for (k, v) in &want.attrs {
                assert_eq!(u.attrs.get(k), Some(v), "{} {k}", u.name);
            }
            assert_eq!(
                u.attrs.len(),
                want.attrs.len() + 1,
                "{}: shard_offset",
                u.name
            );
        }
        assert!(!ops(g, "CollectiveReduceScatter").is_empty());
    }

    #[test]
    fn stage_three_shards_the_parameters_and_gathers_them_before_each_pass() {
        let (def, spec) = digits_adamw();
        let graphs = zero_training(&def, &spec, 2, "pixels", "labels", &zero(3, 1)).unwrap();
        for (r, g) in graphs.iter().enumerate() {
            let nodes = &g.training.def.nodes;
            let find = |name: &str| nodes.iter().find(|n| n.name == name);
            for (var, len, dims) in [
                ("w1", 2048usize, vec![64usize, 32]),
                ("b1", 32, vec![32]),
                ("w2", 320, vec![32, 10]),
                ("b2", 10, vec![10]),
            ] {
                // The whole variable is gone; the rank holds a flat shard of it.
                let v = find(var);
                assert!(v.map_or(true, |v| v.op != "Variable"), "{var} still whole");
                let shard = find(&format!("{var}/shard_{r}_of_2")).unwrap();
                assert_eq!(
                    shard.attrs.get("shape"),
                    Some(&AttrValue::Shape(Shape::known(&[len / 2])))
                );
                assert_eq!(int(shard, "shard_offset"), (r * len / 2) as i64);
                assert_eq!(shard.attrs.get("shard_flat"), Some(&AttrValue::Bool(true)));
                assert_eq!(
                    shard.attrs.get("shard_of"),
                    Some(&AttrValue::Shape(Shape::known(&dims)))
                );
                // Gathered for the forward pass, and again for the backward pass where it is
                // read there (w2, for the gradient of the hidden layer; not w1: the pixels'
                // gradient is dead code, dropped; not a bias: an addition's gradient does not
                // read it).
                let passes: &[&str] = if var == "w2" {
                    &["forward", "backward"]
                } else {
                    assert!(find(&format!("zero/{var}/all_gather_backward")).is_none());
                    &["forward"]
                };
                for pass in passes {
                    let gather = find(&format!("zero/{var}/all_gather_{pass}")).unwrap();
                    assert_eq!(gather.op, "CollectiveAllGather");
                    assert_eq!(gather.inputs[0], format!("{var}/shard_{r}_of_2"));
                    let value = format!("zero/{var}/{pass}");
                    let readers: Vec<&NodeDef> =
                        nodes.iter().filter(|n| n.inputs.contains(&value)).collect();
                    assert!(!readers.is_empty(), "nobody reads {value}");
                }
                // The update reads the shard, no window offset.
                let u = ops(g, "ApplyAdamW")
                    .into_iter()
                    .find(|u| u.inputs[0] == format!("{var}/shard_{r}_of_2"))
                    .unwrap();
                assert!(!u.attrs.contains_key("shard_offset"));
            }
            // The second layer's forward gather waits for the first layer's activation (just in
            // time, not at the start of the step).
            let w2 = find("zero/w2/all_gather_forward").unwrap();
            assert!(
                w2.inputs.contains(&"^layer1/relu".to_string()),
                "{:?}",
                w2.inputs
            );
            // The backward gather waits for the gradient flowing into the layer.
            let w2 = find("zero/w2/all_gather_backward").unwrap();
            assert!(
                w2.inputs.contains(&"^gradients/xent/dfeatures".to_string()),
                "{:?}",
                w2.inputs
            );
            // Nothing is gathered back after the update, nothing is assigned.
            assert!(ops(g, "Assign").is_empty());
            // 4 forward + 1 backward gathers, 4 reduce-scatters, the clip norm, the loss: in one
            // chain numbered in order, the same order on both ranks.
            // (Worker 0's graph also holds the evaluation's gathers, `eval/...`.)
            let mut chain: Vec<&NodeDef> = nodes
                .iter()
                .filter(|n| n.op.starts_with("Collective") && !n.name.starts_with("eval/"))
                .collect();
            assert_eq!(chain.len(), 5 + 4 + 1 + 1);
            chain.sort_by_key(|n| int(n, "instance_key"));
            for (k, w) in chain.windows(2).enumerate() {
                assert_eq!(int(w[0], "instance_key"), k as i64 + 1);
                assert!(
                    w[1].inputs.contains(&format!("^{}", w[0].name)),
                    "{} does not wait for {}",
                    w[1].name,
                    w[0].name
                );
            }
        }
        let order = |g: &ReplicaGraph| -> Vec<String> {
            let mut c: Vec<&NodeDef> = g
                .training
                .def
                .nodes
                .iter()
                .filter(|n| n.op.starts_with("Collective") && !n.name.starts_with("eval/"))
                .collect();
            c.sort_by_key(|n| int(n, "instance_key"));
            c.iter().map(|n| n.name.clone()).collect()
        };
        assert_eq!(order(&graphs[0]), order(&graphs[1]));
        // Worker 0 evaluates on a copy that gathers each weight just before its use; worker 1
        // joins each gather with its shard, in the same order, at the same keys.
        let eval = &graphs[0].eval.loss;
        assert!(eval.starts_with("eval/"), "{eval}");
        let def = &graphs[0].training.def;
        let gathers = |device_task: &str| -> Vec<(i64, String)> {
            let mut g: Vec<(i64, String)> = def
                .nodes
                .iter()
                .filter(|n| n.name.starts_with("eval/") && n.op == "CollectiveAllGather")
                .filter(|n| n.device.contains(device_task))
                .map(|n| (int(n, "instance_key"), n.inputs[0].clone()))
                .collect();
            g.sort();
            g
        };
        let (on0, on1) = (gathers("task:0"), gathers("task:1"));
        assert_eq!(on0.len(), 4, "{on0:?}");
        assert_eq!(
            on0.iter().map(|g| g.0).collect::<Vec<_>>(),
            on1.iter().map(|g| g.0).collect::<Vec<_>>()
        );
        for ((_, a), (_, b)) in on0.iter().zip(&on1) {
            assert_eq!(a.replace("shard_0_of_2", "shard_1_of_2"), *b);
        }
        let training_max = order(&graphs[1])
            .iter()
            .filter_map(|name| {
                graphs[1]
                    .training
                    .def
                    .nodes
                    .iter()
                    .find(|n| n.name == *name)
            })
            .map(|n| int(n, "instance_key"))
            .max()
            .unwrap();
        assert!(on0.iter().all(|g| g.0 > training_max));
        // Worker 1 holds one gathered weight at a time: a `Size` reads (and so frees) each, and
        // the next gather waits for it.
        let mut ones: Vec<&NodeDef> = def
            .nodes
            .iter()
            .filter(|n| n.name.starts_with("eval/zero/") && n.name.contains("all_gather_r1"))
            .collect();
        ones.sort_by_key(|n| int(n, "instance_key"));
        for w in ones.windows(2) {
            let dropped = def
                .nodes
                .iter()
                .find(|n| n.op == "Size" && n.inputs == [w[0].name.clone()])
                .unwrap();
            assert!(
                w[1].inputs.contains(&format!("^{}", dropped.name)),
                "{:?}",
                w[1]
            );
        }
        // No node joins the shards: nothing reads another worker's whole shard set.
        assert!(!def
            .nodes
            .iter()
            .any(|n| n.op == "PackFlat" && n.name.starts_with("eval/")));
        assert_eq!(graphs[1].eval.loss, spec.loss);
    }

    #[test]
    fn sgd_an_unknown_stage_and_async_are_refused() {
        let (def, mut spec) = digits_adamw();
        spec.optimizer = OptimizerSpec {
            kind: OptimizerKind::Sgd,
            lr: 0.1,
        };
        let e = zero_training(&def, &spec, 2, "pixels", "labels", &zero(1, 1)).unwrap_err();
        assert!(e.to_string().contains("optimizer is sgd"), "{e}");
        let build = |stage: u8, asynchronous: bool| {
            (REGISTRATION.build)(&super::super::StrategyOptions {
                asynchronous,
                zero_stage: stage,
                ..Default::default()
            })
        };
        let e = build(4, false).unwrap_err();
        assert!(e.to_string().contains("must be 1, 2 or 3, got 4"), "{e}");
        let e = build(0, false).unwrap_err();
        assert!(e.to_string().contains("must be 1, 2 or 3"), "{e}");
        assert_eq!(build(3, false).unwrap().name(), "zero");
        let e = build(2, true).unwrap_err();
        assert!(e.to_string().contains("synchronous"), "{e}");
        assert_eq!(
            build(2, false).unwrap().describe(),
            "ZeRO stage 2 data-parallel training, buckets of 25.0 MiB"
        );
    }
}
