//! The memory and step-time model of one layout.
//!
//! **Memory per device** (the fullest device is reported): weights, gradients and optimizer
//! state of the parameters it holds (tensor-parallel weights `1/tp`, its pipeline stage only),
//! each divided over the data-parallel group by the ZeRO stage (1: optimizer state, 2: +
//! gradients, 3: + weights); plus the activations it stashes: every forward output of a batch op
//! of its stage for one micro-batch (`1/tp` of the split ones), times the micro-batches in
//! flight (GPipe `m`, 1F1B `min(p−s, m)` on stage `s`, interleaved from
//! [`schedule::simulate`]). Not included: workspace of kernels, temporary buffers of the
//! backward pass, collective buffers, the allocator's fragmentation.
//!
//! **ZeRO over a pipeline** (`pp > 1`, as `strategy/pipeline/zero.rs` runs it): a stage's
//! gradients add up whole over the micro-batches and are summed over its data-parallel group
//! once after the last backward pass, so ZeRO-2 and 3 divide the optimizer state (and, 3, the
//! weights) by `dp` but not the gradients. ZeRO-3 holds the stage's weight shards and gathers
//! them over the stage's group just in time, for every micro-batch: all of them before its
//! forward pass, those the backward pass reads ([`super::model::VariableProfile::backward_read`])
//! before its backward pass; the gathers are in each micro-batch's slot (so in the bubble
//! too) and in the data-parallel time and bytes (`m` times each). The updated shards are not
//! gathered back. The gathered copies are transient and not counted, as for `pp = 1`.
//!
//! **Step time**: the batch fed from the client (each tensor-parallel rank gets its replica's
//! rows: `tp` copies of the batch over a link between hosts), then a pipeline slot is the slowest stage's forward (FLOPs / device FLOP/s, plus
//! its tensor-parallel all-reduces), backward (twice the forward FLOPs, plus its all-reduces)
//! and its sends to the neighbouring stages; a step is `(m + p − 1)` slots (`m + (p−1)/v`
//! interleaved: the bubble formula), then the gradients' data-parallel collectives (buckets of
//! 25 MiB, as the all-reduce strategy fuses them; not overlapped with the backward pass).
//!
//! **Experts** (`ep > 1`, a model with MoE layers; dp × ep, or dp × ep × pp with one
//! micro-batch where a router couples the batch, else several, ZeRO 0 to 3 both): each rank holds `1/ep` of every MoE layer's experts of its stage
//! (their weights, gradients and Adam state), the dense parameters whole; ZeRO shards the dense
//! state over the `dp` ranks and the expert shards' over their expert-data-parallel group
//! (`dp/ep` ranks), at stage 3 the weights too (gathered before the forward and the backward
//! pass: over a pipeline the stage's dense weights over its replicas, the experts' shards over
//! their group, for every micro-batch those its copies read and once per step those the
//! micro-batches' shared ops read: [`super::staging::PassGathers`]), and with clipping each
//! group sums its shards' squared norm. Per step and MoE layer, four all-to-alls of the
//! dispatch buffer `[E, C, d]` over each expert-parallel group (tokens to their experts and
//! back, forward and backward; `C` from the replica's tokens as `MoeDispatch` sizes it), the
//! expert gradients summed over the expert-data-parallel groups, the dense ones over `dp`.
//! Beside `tp > 1` (dp × tp × ep, ZeRO 0 to 3: the tensor strategy with ep) the MoE layers
//! are replicated over tp ([`super::model`] leaves their ops out of the tensor-parallel
//! analysis): each rank holds its tp shard of the dense parameters, the routers whole and
//! `1/ep` of the experts, every tp rank repeats its replica's all-to-alls, and the groups are
//! those of the rank's tp coordinate (`data_t<t>` for the dense states, `experts_dp<s>_t<t>`
//! for the expert shards'; ZeRO-3 shards the weights over the same groups and gathers them
//! before the forward and the backward pass, as `strategy/tensor/experts.rs` runs it). Inside
//! pipeline stages too (the 4-axis mesh dp × tp × pp × ep, one micro-batch, ZeRO 0 to 3, as
//! `strategy/tensor/experts_pipeline.rs` runs it): per stage the same, over that stage's groups
//! (`pipeline/stage<s>_t<t>` for the dense states, `experts_dp<k>_s<s>_t<t>` for the expert
//! shards'), ZeRO as for dp × tp × pp. Beside ep over a pipeline each MoE layer's dropped count
//! (an i64 per micro-batch) goes to the loss's stage, and under ZeRO with clipping each stage's
//! expert shards' squared norm: both in the bytes between stages.
//!
//! **Tensor parallelism** counts dflow's calls (`strategy/tensor.rs`), each an all-reduce over
//! the rank's tensor-parallel group: per dense block `g` after both row-parallel products
//! forward and `f`'s input gradient before both column-parallel ones backward; the
//! vocabulary-parallel embedding's `g`; the tied head's `f`; the split cross-entropy's three
//! all-reduces of its per-row values (max, `Σ exp`, target logit); and with clipping each
//! device's squared norm of its shards, once per step. Bytes and messages
//! ([`Evaluation::tensor_parallel_messages`]) are the job plan's over its `tensor*` groups.
//! **A vocabulary tp does not divide** is padded to a multiple of tp, as `--strategy tensor`
//! pads it: the stage sums come from [`StagedModel::at_tp`], every vocabulary-split tensor at
//! the padded vocabulary.
//!
//! **The MoE layers' other collectives** (beside `ep > 1`, in the data-parallel bytes and
//! time, their messages in [`Evaluation::moe_messages`]): each load-balancing loss's two inputs
//! (the router's probabilities, f32, and the chosen experts, i64) all-gathered over the data-parallel
//! group of its stage (`dp` ranks, per tp coordinate) for every micro-batch, the float one's
//! gradient reduce-scattered back, even at α = 0 (`strategy::expert::worker_forward`); the
//! dropped-token count (an i64) summed over the loss stage's data-parallel group once per step;
//! and with clipping, the squared norm of each rank's expert shards summed over its
//! expert-parallel group once per step (all-gathered, one f32 per rank, by the expert
//! strategy without ZeRO, tp or pp; all-reduced elsewhere). So the table's bytes are the job
//! plan's, every collective counted.

use super::collective::{p2p_seconds, rank_messages, AxisLinks, Call, Collective, CommCost};
use super::layout::Layout;
use super::model::ModelProfile;
use super::profile::{ClusterProfile, LinkClass, Precision};
use super::staging::{PassGathers, StagedModel};
use crate::mesh::Axis;
use crate::strategy::allreduce::DEFAULT_BUCKET_BYTES;
use crate::strategy::pipeline::schedule::{self, PipelineShape, ScheduleKind};

/// Bytes of the loss the all-reduce strategy sums after the gradients.
pub const LOSS_BYTES: f64 = 4.0;

/// Bytes of the squared norm of a rank's shards that ZeRO with clipping sums over the group.
pub const CLIP_NORM_BYTES: f64 = 4.0;

/// Bytes of an MoE layer's count of dropped assignments (`MoeRoute`'s i64 output 3), which a
/// pipeline sends to the loss's stage per micro-batch beside ep.
pub const DROPPED_COUNT_BYTES: f64 = 8.0;

/// Memory of one device, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Memory {
    /// Parameters.
    pub weights: f64,
    /// Gradients.
    pub gradients: f64,
    /// Optimizer state (and f32 master weights under mixed precision).
    pub optimizer: f64,
    /// Stashed activations.
    pub activations: f64,
}

impl Memory {
    /// The sum.
    pub fn total(&self) -> f64 {
        self.weights + self.gradients + self.optimizer + self.activations
    }

    /// Everything but the activations (the model states, in the ZeRO paper's words).
    pub fn states(&self) -> f64 {
        self.weights + self.gradients + self.optimizer
    }
}

/// Where a step's time goes, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTime {
    /// Feeding the batch from the client: every tensor-parallel rank gets its replica's rows.
    pub input: f64,
    /// The slowest stage's FLOPs over all micro-batches.
    pub compute: f64,
    /// Tensor-parallel all-reduces of the slowest stage over all micro-batches.
    pub tensor_parallel: f64,
    /// Sends between stages of the slowest stage over all micro-batches.
    pub pipeline: f64,
    /// Idle time of the pipeline fill and drain.
    pub bubble: f64,
    /// The gradients' data-parallel collectives (the dense ones over `dp`, the experts' over
    /// their expert-data-parallel groups).
    pub data_parallel: f64,
    /// The experts' all-to-alls (tokens to their experts and back, forward and backward).
    pub expert_parallel: f64,
    /// The runtime's cost per op (and per tensor-parallel call) of the slowest stage over all
    /// micro-batches, plus its cost per step: the profile's `job` costs of a real multi-task
    /// job where calibrated, else `op_overhead` and `step_overhead`.
    pub overhead: f64,
}

impl StepTime {
    /// The predicted step time.
    pub fn total(&self) -> f64 {
        self.input
            + self.compute
            + self.tensor_parallel
            + self.pipeline
            + self.bubble
            + self.data_parallel
            + self.expert_parallel
            + self.overhead
    }
}

/// Bytes per step over each link class, summed over the cluster, by what sends them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Traffic {
    /// Tensor-parallel all-reduces.
    pub tensor_parallel: CommCost,
    /// Activations and gradients between stages.
    pub pipeline: CommCost,
    /// Data-parallel collectives of gradients (and parameters, ZeRO-3), the expert shards'
    /// over their expert-data-parallel groups included; beside `ep > 1` also the
    /// load-balancing losses' all-gathers (and their gradients' reduce-scatters), the
    /// dropped-token count's sum and the expert shards' clipping norm over each
    /// expert-parallel group.
    pub data_parallel: CommCost,
    /// The experts' all-to-alls over the expert-parallel groups.
    pub expert_parallel: CommCost,
}

impl Traffic {
    /// Bytes over links inside hosts.
    pub fn intra(&self) -> f64 {
        self.tensor_parallel.intra_bytes
            + self.pipeline.intra_bytes
            + self.data_parallel.intra_bytes
            + self.expert_parallel.intra_bytes
    }

    /// Bytes over links between hosts.
    pub fn inter(&self) -> f64 {
        self.tensor_parallel.inter_bytes
            + self.pipeline.inter_bytes
            + self.data_parallel.inter_bytes
            + self.expert_parallel.inter_bytes
    }
}

/// One layout, evaluated.
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluation {
    /// The layout.
    pub layout: Layout,
    /// Rows per micro-batch on one replica.
    pub rows: f64,
    /// Memory of each pipeline device (stage), in stage order.
    pub memory: Vec<Memory>,
    /// Whether the fullest device fits.
    pub fits: bool,
    /// Bytes per step.
    pub traffic: Traffic,
    /// Messages per step of the tensor-parallel collectives, every rank summed (each a step
    /// with a peer: [`super::collective::rank_messages`]), as the job plan's collectives over
    /// its `tensor*` groups send them.
    pub tensor_parallel_messages: f64,
    /// Messages per step, every rank summed, of the MoE layers' collectives besides the
    /// all-to-alls and the gradients' sums (each a step with a peer:
    /// [`super::collective::rank_messages`]): the load-balancing losses' all-gathers and their
    /// gradients' reduce-scatters, the dropped-token count's sum, and with clipping the
    /// expert shards' squared norm over each expert-parallel group; 0 without `ep`.
    pub moe_messages: f64,
    /// Bytes between stages per step over all replicas (Send/Recv pairs in a job plan).
    pub pipeline_bytes: f64,
    /// Bytes each rank of stage 0 puts into data-parallel collectives per step.
    pub data_parallel_payload: f64,
    /// Step time.
    pub time: StepTime,
    /// The bubble fraction of the schedule.
    pub bubble: f64,
    /// Seconds of one micro-batch on the slowest stage (forward, backward, sends).
    pub slot: f64,
    /// Of [`Self::slot`], ZeRO-3's gathers of the stage's weights (0 otherwise); `m` times it
    /// is in [`StepTime::data_parallel`].
    pub slot_gathers: f64,
    /// The slowest stage.
    pub slowest_stage: usize,
}

impl Evaluation {
    /// The fullest device's memory.
    pub fn peak(&self) -> Memory {
        self.memory
            .iter()
            .copied()
            .max_by(|a, b| a.total().total_cmp(&b.total()))
            .unwrap_or_default()
    }
}

/// What every layout of one plan shares.
#[derive(Debug)]
pub struct Context<'a> {
    /// The model.
    pub model: &'a ModelProfile,
    /// The cluster.
    pub profile: &'a ClusterProfile,
    /// The global batch.
    pub batch: usize,
}

/// Why a layout cannot run the model.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("layout {layout}: {reason}")]
pub struct LayoutRefused {
    /// The layout.
    pub layout: String,
    /// Why, naming the axis and the number.
    pub reason: String,
}

/// The stash of a micro-batch's activations on each device, in units of one device's stage.
fn stash(layout: &Layout) -> Vec<f64> {
    let (p, m, v) = (layout.mesh.pp, layout.micro_batches, layout.chunks);
    match layout.schedule {
        ScheduleKind::GPipe => vec![m as f64; p],
        ScheduleKind::OneFOneB => (0..p).map(|s| (p - s).min(m) as f64).collect(),
        ScheduleKind::Interleaved => {
            let shape = PipelineShape {
                stages: p,
                micro_batches: m,
                chunks: v,
            };
            schedule::orders(layout.schedule, shape)
                .ok()
                .and_then(|o| schedule::simulate(shape, &o, 1, 2).ok())
                .map(|sim| {
                    sim.peak_stash
                        .iter()
                        .map(|&c| c as f64 / v as f64)
                        .collect()
                })
                .unwrap_or_else(|| vec![m as f64; p])
        }
    }
}

/// Checks that `layout` can run the model: the axes divide what they split.
pub fn check(ctx: &Context<'_>, layout: &Layout, devices: usize) -> Result<(), LayoutRefused> {
    let refuse = |reason: String| LayoutRefused {
        layout: layout.short(),
        reason,
    };
    let mesh = layout.mesh;
    mesh.check_tasks(devices)
        .map_err(|e| refuse(e.to_string()))?;
    let replicas_rows = mesh.dp.saturating_mul(layout.micro_batches);
    mesh.check_divides(Axis::Dp, ctx.batch, "the global batch")
        .map_err(|e| refuse(e.to_string()))?;
    if ctx.batch % replicas_rows != 0 {
        return Err(refuse(format!(
            "the global batch {} does not split into dp={} × {} micro-batches",
            ctx.batch, mesh.dp, layout.micro_batches
        )));
    }
    if let Some(why) = ctx.model.tensor_refusal.as_ref().filter(|_| mesh.tp > 1) {
        return Err(refuse(format!(
            "tp={}: --strategy tensor cannot split this graph ({why}); write `_sharding` placements (docs/tensor-parallel.md) to run tensor parallelism",
            mesh.tp
        )));
    }
    if mesh.tp > 1 && mesh.ep == 1 {
        if let Some(l) = ctx.model.moe.first() {
            return Err(refuse(format!(
                "tp={} splits dense MLPs only, and MoE layer `{}` is not one: use ep for the experts (beside dp, inside pp, or beside tp: dp=D,tp=T,ep=E replicates the MoE MLPs over tp)",
                mesh.tp, l.dispatch
            )));
        }
    }
    if let Some(d) = ctx.model.tp_refusal(mesh.tp) {
        mesh.check_divides(Axis::Tp, d.size, &d.what)
            .map_err(|e| refuse(e.to_string()))?;
    }
    if mesh.ep > 1 {
        let Some(first) = ctx.model.moe.first() else {
            return Err(refuse(format!(
                "ep={} spreads the experts of MoE layers, and the model has none",
                mesh.ep
            )));
        };
        // The table models ep × pp with several micro-batches where no router couples the
        // batch (as dflow run runs them; refused below otherwise), at ZeRO 0 to 3 (at 3 beside
        // expert-data-parallel groups each micro-batch gathers its expert shards).
        if let Some(l) = ctx.model.moe.iter().find(|l| l.experts % mesh.ep != 0) {
            return Err(refuse(format!(
                "MoE layer `{}` has {} experts, which do not split over ep={} (first layer: {} experts)",
                l.dispatch, l.experts, mesh.ep, first.experts
            )));
        }
    }
    if let Some(op) = ctx
        .model
        .batch_coupled
        .as_ref()
        .filter(|_| layout.micro_batches > 1)
    {
        return Err(refuse(format!(
            "op `{op}` couples the examples of a batch (an expert's capacity, the load-balancing loss), so {} micro-batches would not train like the whole batch: dflow runs it with one",
            layout.micro_batches
        )));
    }
    if mesh.pp == 1 && layout.micro_batches > 1 {
        return Err(refuse(
            "micro-batches need a pipeline (pp > 1); without one a step is one batch".into(),
        ));
    }
    let shape = PipelineShape {
        stages: mesh.pp,
        micro_batches: layout.micro_batches,
        chunks: layout.chunks,
    };
    schedule::check(layout.schedule, shape).map_err(|e| refuse(e.to_string()))?;
    Ok(())
}

/// Evaluates `layout` with the model cut into `staged` (its `pp · chunks` virtual stages).
pub fn evaluate(ctx: &Context<'_>, layout: &Layout, staged: &StagedModel) -> Evaluation {
    let profile = ctx.profile;
    let mesh = layout.mesh;
    let (d, t, p, m, v) = (
        mesh.dp,
        mesh.tp,
        mesh.pp,
        layout.micro_batches,
        layout.chunks,
    );
    let (df, tf, mf) = (d as f64, t as f64, m as f64);
    let rows = ctx.batch as f64 / (df * mf);
    let (w_bytes, g_bytes, opt_bytes, act_scale) = match profile.precision {
        Precision::F32 => (4.0, 4.0, 4.0 * ctx.model.optimizer_slots, 1.0),
        Precision::Mixed => (2.0, 2.0, 4.0 + 4.0 * ctx.model.optimizer_slots, 0.5),
    };
    let zero = layout.zero;
    let shard = |from: u8| if zero >= from { df } else { 1.0 };
    // Over a pipeline every micro-batch's gradients add up on the stage's device until the
    // last backward pass, and only then are they reduce-scattered: ZeRO-2 and 3 do not shard
    // the gradients a pipeline holds (`strategy/pipeline/zero.rs`).
    let grad_shard = |from: u8| if p > 1 { 1.0 } else { shard(from) };
    // ZeRO-3 gathers each stage's weights over its data-parallel group before every
    // micro-batch's forward pass, and again before its backward pass where that reads them;
    // the shards are updated in place and never gathered back (`strategy/zero`,
    // `strategy/pipeline/zero.rs`).
    let gathers_per_micro_batch = zero >= 3;
    // The experts' shards are data-parallel over their expert-data-parallel group.
    let ep = mesh.ep as f64;
    let expert_shard = |from: u8| if zero >= from { df / ep } else { 1.0 };
    let stash = stash(layout);
    let mut memory = Vec::with_capacity(p);
    let mut traffic = Traffic::default();
    // The slowest stage per micro-batch: compute, tensor-parallel, sends, ops, ZeRO-3's
    // gathers over a pipeline; and its index.
    let mut slowest = (0.0f64, 0.0f64, 0.0f64, 0.0f64, 0.0f64, 0usize);
    let mut dp_time: f64 = 0.0;
    let mut ep_time: f64 = 0.0;
    // Tensor-parallel collectives once per step (clipping's norm) on the slowest device.
    let mut tp_step_time: f64 = 0.0;
    let mut tensor_parallel_messages = 0.0;
    let mut moe_messages = 0.0;
    let mut stage0_payload = 0.0;
    // Bytes of the MoE layers' dropped counts (and under ZeRO with clipping the expert shards'
    // squared norms) sent to the loss's stage, every replica summed.
    let mut dropped_bytes = 0.0;
    // Per device and micro-batch: its activations sent forward, its gradients sent back.
    let mut sends = vec![0.0; p];
    let mut by_sender: Vec<Vec<usize>> = vec![Vec::new(); p];
    for (i, c) in staged.crossings.iter().enumerate() {
        by_sender[c.from % p].push(i);
    }
    for c in staged.crossings.iter().filter(|c| !c.per_step) {
        let (from, to) = (c.from % p, c.to % p);
        let link = profile.link(profile.class(mesh.rank(0, 0, from), mesh.rank(0, 0, to)));
        let per_rank = c.bytes.at(rows) * act_scale / if c.split { tf } else { 1.0 };
        // A calibrated job's cost per value sent and per value received (as
        // `runtime::job_step` prices a job plan's Send/Recv pairs).
        let call = profile.job.value_cost();
        sends[from] += p2p_seconds(link, per_rank) + call;
        sends[to] += call;
        if c.gradient {
            sends[to] += p2p_seconds(link, per_rank) + call;
            sends[from] += call;
        }
    }
    for (s, &in_flight) in stash.iter().enumerate() {
        // This device's chunks: virtual stages s, s + p, ...
        let chunks: Vec<_> = (0..v).map(|c| &staged.stages[c * p + s]).collect();
        let params: f64 = chunks
            .iter()
            .map(|c| c.params_split / tf + c.params_whole)
            .sum();
        let act: f64 = chunks
            .iter()
            .map(|c| c.act_split.at(rows) / tf + c.act_whole.at(rows))
            .sum::<f64>()
            * act_scale;
        // The dense parameters, and this rank's part of this stage's experts.
        let experts: f64 = if mesh.ep > 1 {
            chunks.iter().map(|c| c.params_expert).sum()
        } else {
            0.0
        };
        let (params, local_experts) = (params - experts, experts / ep);
        memory.push(Memory {
            weights: params * w_bytes / shard(3) + local_experts * w_bytes / expert_shard(3),
            gradients: params * g_bytes / grad_shard(2) + local_experts * g_bytes / expert_shard(2),
            optimizer: params * opt_bytes / shard(1) + local_experts * opt_bytes / expert_shard(1),
            activations: act * in_flight,
        });
        // Groups of this stage.
        // The groups of this stage only: O(devices / pp) per stage.
        let stage_groups = |axis: Axis| -> AxisLinks {
            let leads: Vec<usize> = match axis {
                Axis::Tp => (0..d).map(|di| mesh.rank(0, di, s)).collect(),
                Axis::Dp => (0..t).map(|ti| mesh.rank(ti, 0, s)).collect(),
                Axis::Pp => vec![mesh.rank(0, 0, 0)],
                // The expert-parallel groups: runs of `ep` data-parallel ranks.
                Axis::Ep => (0..t)
                    .flat_map(|ti| (0..d).map(move |di| (ti, di)))
                    .filter(|&(_, di)| di % mesh.ep == 0)
                    .map(|(ti, di)| mesh.rank(ti, di, s))
                    .collect(),
            };
            let groups: Vec<Vec<usize>> =
                leads.into_iter().map(|r| mesh.group_of(axis, r)).collect();
            AxisLinks::of_groups(&groups, mesh.size_of(axis), profile)
        };
        let tp_links = stage_groups(Axis::Tp);
        let dp_links = stage_groups(Axis::Dp);
        let flops: f64 = chunks
            .iter()
            .map(|c| c.flops_split.at(rows) / tf + c.flops_whole.at(rows))
            .sum();
        // A calibrated job's FLOP/s where the profile has one.
        let rate = if profile.job.flops_per_second > 0.0 {
            profile.job.flops_per_second
        } else {
            profile.flops_per_second
        };
        let compute_f = flops / rate;
        let mut tp_f = CommCost::default();
        let mut tp_b = CommCost::default();
        // Messages of one tensor-parallel group per micro-batch (every rank) and of its
        // rank 0 (the busiest: recursive doubling folds the ranks past a power of two into
        // the first ones).
        let (mut tp_msgs, mut tp_rank0_msgs) = (0.0, 0.0);
        let mut count_messages = |bytes: f64, size: usize| {
            let (group, first) = tp_messages(t, bytes, size);
            tp_msgs += group;
            tp_rank0_msgs += first;
        };
        let act_size = act_element_bytes(profile.precision);
        for c in &chunks {
            for b in &c.tp_forward {
                let bytes = b.at(rows) * act_scale;
                tp_f = tp_f.then(tp_links.cost(Collective::AllReduce, bytes));
                count_messages(bytes, act_size);
            }
            for b in &c.tp_backward {
                let bytes = b.at(rows) * act_scale;
                tp_b = tp_b.then(tp_links.cost(Collective::AllReduce, bytes));
                count_messages(bytes, act_size);
            }
        }
        traffic.tensor_parallel = traffic.tensor_parallel.then(tp_f.then(tp_b).times(mf));
        tensor_parallel_messages += tp_msgs * mf * df;
        // Clipping by global norm: once per step, the squared norm of this device's shards
        // summed over its tensor-parallel group (`tp/clip/shards_squared_norm_sum`; over a
        // pipeline each stage's, under ZeRO `zero/clip/sharded_squared_norm_outer`), where it
        // holds a shard.
        let mut tp_step = CommCost::default();
        let mut tp_step_rank0_msgs = 0.0;
        if t > 1 && ctx.model.clips && chunks.iter().any(|c| c.params_split > 0.0) {
            tp_step = tp_links.cost(Collective::AllReduce, CLIP_NORM_BYTES);
            let (group, first) = tp_messages(t, CLIP_NORM_BYTES, CLIP_NORM_BYTES as usize);
            tensor_parallel_messages += group * df;
            tp_step_rank0_msgs += first;
        }
        traffic.tensor_parallel = traffic.tensor_parallel.then(tp_step);
        tp_step_time =
            tp_step_time.max(tp_step.seconds + tp_step_rank0_msgs * profile.job.collective);
        // Sends of this device per micro-batch: activations forward, gradients back.
        let send_seconds = sends[s];
        for c in by_sender[s].iter().map(|&i| &staged.crossings[i]) {
            let per_rank = c.bytes.at(rows) * act_scale / if c.split { tf } else { 1.0 };
            let to = c.to % p;
            let times = if c.per_step { 1.0 } else { mf };
            let sent = per_rank * if c.gradient { 2.0 } else { 1.0 };
            let mut cost = CommCost::default();
            for ti in 0..t {
                for di in 0..d {
                    let class = profile.class(mesh.rank(ti, di, s), mesh.rank(ti, di, to));
                    match class {
                        LinkClass::IntraHost => cost.intra_bytes += sent * times,
                        LinkClass::InterHost => cost.inter_bytes += sent * times,
                    }
                }
            }
            traffic.pipeline = traffic.pipeline.then(cost);
        }
        // Under tensor parallelism each tp rank sends its vocabulary ids to the loss's stage
        // once per step.
        if let Some(c) = staged
            .vocab_ids
            .as_ref()
            .filter(|c| t > 1 && c.from % p == s)
        {
            let per_rank = c.bytes.at(rows) / tf;
            let mut cost = CommCost::default();
            for ti in 0..t {
                for di in 0..d {
                    match profile.class(mesh.rank(ti, di, s), mesh.rank(ti, di, c.to % p)) {
                        LinkClass::IntraHost => cost.intra_bytes += per_rank,
                        LinkClass::InterHost => cost.inter_bytes += per_rank,
                    }
                }
            }
            traffic.pipeline = traffic.pipeline.then(cost);
        }
        // Beside ep over a pipeline each MoE layer's count of dropped assignments (an i64,
        // per micro-batch) goes to the loss's stage, where they are summed
        // (`strategy/expert/pipeline.rs`, `add_dropped_count`).
        if mesh.ep > 1 && s != p - 1 {
            let layers = chunks.iter().map(|c| c.moe.len()).sum::<usize>() as f64;
            // Under ZeRO with clipping the squared norm of the stage's expert shards goes
            // there too, apart from the dense one (`strategy/pipeline/zero.rs`), once per step.
            let expert_norm = if zero >= 1 && ctx.model.clips && local_experts > 0.0 {
                CLIP_NORM_BYTES
            } else {
                0.0
            };
            let sent = DROPPED_COUNT_BYTES * layers * mf + expert_norm;
            let mut cost = CommCost::default();
            for ti in 0..t {
                for di in 0..d {
                    match profile.class(mesh.rank(ti, di, s), mesh.rank(ti, di, p - 1)) {
                        LinkClass::IntraHost => cost.intra_bytes += sent,
                        LinkClass::InterHost => cost.inter_bytes += sent,
                    }
                }
            }
            dropped_bytes += sent * df;
            traffic.pipeline = traffic.pipeline.then(cost);
        }
        if s > 0 {
            let class = profile.class(mesh.rank(0, 0, 0), mesh.rank(0, 0, s));
            let bytes = staged.scalars_per_later_stage * df * tf;
            let mut cost = CommCost::default();
            match class {
                LinkClass::IntraHost => cost.intra_bytes = bytes,
                LinkClass::InterHost => cost.inter_bytes = bytes,
            }
            traffic.pipeline = traffic.pipeline.then(cost);
        }
        let compute = 3.0 * compute_f;
        let tp_seconds = tp_f.seconds + tp_b.seconds;
        // The runtime's cost of the training ops this device runs per micro-batch.
        let ops: f64 = chunks.iter().map(|c| c.ops).sum::<f64>() * ctx.model.training_ops_per_op;
        // A calibrated job's costs (per op, per collective call) replace the in-process
        // executor's per-op cost.
        let per_op = if profile.job.op > 0.0 {
            profile.job.op
        } else {
            profile.op_overhead
        };
        // A calibrated job's cost per collective message (each a step with a peer, as
        // `runtime::job_step` prices the job plan's).
        let op_seconds = ops * per_op + tp_rank0_msgs * profile.job.collective;
        // Data parallelism: the stage's gradients in buckets (and parameters under ZeRO).
        let grad_bytes = params * g_bytes;
        let weight_bytes = params * w_bytes;
        // This stage's expert-data-parallel groups (the ranks holding the same expert shard),
        // where there are some.
        let expert_links = (local_experts > 0.0 && mesh.dp > mesh.ep).then(|| {
            let groups: Vec<Vec<usize>> = mesh
                .expert_data_groups()
                .into_iter()
                .filter(|g| g.first().is_some_and(|&r| mesh.coords(r).2 == s))
                .collect();
            AxisLinks::of_groups(&groups, mesh.dp / mesh.ep, profile)
        });
        // ZeRO-3 over a pipeline: the expert shards' gathers over those groups, per
        // micro-batch and once per step (elements of this rank's shards, calls).
        let expert_gathers = chunks
            .iter()
            .fold(PassGathers::default(), |a, c| a.plus(c.expert_gathers));
        let pipeline_expert_gathers = p > 1 && zero >= 3 && expert_links.is_some();
        // ZeRO-3: each micro-batch's gathers of the stage's weights (every weight for the
        // forward pass, those the backward pass reads for it), one call per weight, on the
        // stage's critical path.
        let mut gather_mb = CommCost::default();
        if gathers_per_micro_batch && d > 1 {
            // The dense weights (the experts' shards are gathered over their own groups).
            let (backward_experts, expert_calls) = if mesh.ep > 1 {
                chunks.iter().fold((0.0, 0.0), |(b, n), c| {
                    (
                        b + c.backward_expert,
                        n + c.expert_variables as f64 + c.backward_expert_variables,
                    )
                })
            } else {
                (0.0, 0.0)
            };
            // Under tensor parallelism the weights the backward pass reads on this stage
            // (not the vocabulary-parallel lookup's table, nor a tied embedding read by the
            // head on another stage).
            let backward: f64 = chunks
                .iter()
                .map(|c| {
                    if t > 1 {
                        c.backward_split_tp / tf + c.backward_whole_tp
                    } else {
                        c.backward_split / tf + c.backward_whole
                    }
                })
                .sum::<f64>()
                - backward_experts;
            let calls: f64 = chunks
                .iter()
                .map(|c| {
                    c.variables
                        + if t > 1 {
                            c.backward_variables_tp
                        } else {
                            c.backward_variables
                        }
                })
                .sum::<f64>()
                - expert_calls;
            gather_mb = buckets(&dp_links, Collective::AllGather, weight_bytes).then(buckets(
                &dp_links,
                Collective::AllGather,
                backward * w_bytes,
            ));
            gather_mb.seconds += calls * profile.job.collective;
            // The expert shards a micro-batch's forward and backward copies read, gathered
            // over their expert-data-parallel group for every micro-batch.
            if let Some(links) = expert_links.as_ref().filter(|_| pipeline_expert_gathers) {
                let mut experts = buckets(
                    links,
                    Collective::AllGather,
                    expert_gathers.per_micro_batch / ep * w_bytes,
                );
                experts.seconds += expert_gathers.calls_per_micro_batch * profile.job.collective;
                gather_mb = gather_mb.then(experts);
            }
        }
        if compute + tp_seconds + send_seconds + op_seconds + gather_mb.seconds
            > slowest.0 + slowest.1 + slowest.2 + slowest.3 + slowest.4
        {
            slowest = (
                compute,
                tp_seconds,
                send_seconds,
                op_seconds,
                gather_mb.seconds,
                s,
            );
        }
        // dflow's ZeRO-1 all-reduces the gradients (then each rank updates its shard and the
        // shards are all-gathered); ZeRO-2 and 3 reduce-scatter them.
        let kind = if zero <= 1 {
            Collective::AllReduce
        } else {
            Collective::ReduceScatter
        };
        let mut dp = buckets(&dp_links, kind, grad_bytes);
        if zero == 1 || zero == 2 {
            // Updated parameters gathered after the sharded step.
            dp = dp.then(buckets(&dp_links, Collective::AllGather, weight_bytes));
        }
        // ZeRO-3 over a pipeline: a weight another stage reads (a tied embedding) is gathered
        // once more per step, for its send.
        let mut shared_gathers = 0.0;
        if gathers_per_micro_batch && d > 1 {
            for c in by_sender[s].iter().map(|&i| &staged.crossings[i]) {
                if c.per_step {
                    let bytes = c.bytes.at(rows) * act_scale / if c.split { tf } else { 1.0 };
                    dp = dp.then(dp_links.cost(Collective::AllGather, bytes));
                    shared_gathers += 1.0;
                }
            }
        }
        // The loss summed over the loss stage's group (the last stage's), and under ZeRO with
        // clipping each stage's squared norm of its shards (4 bytes each).
        let loss_stage = s == p - 1;
        let clip_norm = zero >= 1 && ctx.model.clips;
        if loss_stage {
            dp = dp.then(dp_links.cost(Collective::AllReduce, LOSS_BYTES));
        }
        // Beside tensor parallelism the sharded and the replicated parameters' squared norms
        // are summed over the group apart.
        let clip_norms = if clip_norm {
            1.0 + f64::from(u8::from(t > 1))
        } else {
            0.0
        };
        if clip_norm {
            dp = dp.then(
                dp_links
                    .cost(Collective::AllReduce, CLIP_NORM_BYTES)
                    .times(clip_norms),
            );
        }
        // The expert shards' gradients over their expert-data-parallel groups (and, under
        // ZeRO, their updated shards gathered back; ZeRO-3: their weights gathered before the
        // forward and the backward pass).
        let expert_grad_bytes = local_experts * g_bytes;
        let mut expert_calls = 0.0;
        if let Some(links) = &expert_links {
            dp = dp.then(buckets(links, kind, expert_grad_bytes));
            let gathers = match zero {
                0 => 0.0,
                1 | 2 => 1.0,
                _ => 2.0,
            };
            if pipeline_expert_gathers {
                // Over a pipeline, the shards the micro-batches' shared ops read (an expert
                // bias's reshape) once per step; the rest per micro-batch, above.
                dp = dp.then(buckets(
                    links,
                    Collective::AllGather,
                    expert_gathers.per_step / ep * w_bytes,
                ));
            } else if zero >= 1 {
                dp = dp.then(
                    buckets(links, Collective::AllGather, local_experts * w_bytes).times(gathers),
                );
            }
            // Under ZeRO with clipping, the squared norm of the expert shards is summed over
            // their expert-data-parallel group too.
            if clip_norm {
                dp = dp.then(links.cost(Collective::AllReduce, CLIP_NORM_BYTES));
                expert_calls += 1.0;
            }
            let count = (expert_grad_bytes / DEFAULT_BUCKET_BYTES as f64)
                .ceil()
                .max(1.0);
            // Without ZeRO, one all-reduce per expert variable.
            expert_calls += if zero == 0 {
                chunks.iter().map(|c| c.expert_variables).sum::<usize>() as f64
            } else if pipeline_expert_gathers {
                count + expert_gathers.calls_per_step
            } else {
                (1.0 + gathers) * count
            };
        }
        // The MoE layers' other collectives (`moe_collectives`): their cost and the busiest
        // rank's messages, in the data-parallel time and bytes.
        let ep_links = (mesh.ep > 1).then(|| stage_groups(Axis::Ep));
        if let Some(ep_links) = &ep_links {
            let moe = moe_collectives(
                ctx,
                layout,
                MoeStage {
                    aux_losses: chunks.iter().flat_map(|c| c.aux_losses.iter().copied()),
                    loss_stage: s == p - 1,
                    experts: local_experts > 0.0,
                    rows,
                },
                &dp_links,
                ep_links,
            );
            moe_messages += moe.messages;
            dp = dp.then(moe.cost);
            dp.seconds += moe.rank_messages * profile.job.collective;
        }
        // The experts' tokens: four all-to-alls of the dispatch buffer of each MoE layer of
        // this stage per micro-batch.
        if let Some(ep_links) = ep_links {
            let mut a2a = CommCost::default();
            let layers: Vec<usize> = chunks.iter().flat_map(|c| c.moe.iter().copied()).collect();
            for l in layers.iter().filter_map(|&k| ctx.model.moe.get(k)) {
                let buffer = l.buffer_bytes(rows.round() as usize) * act_scale;
                a2a = a2a.then(ep_links.cost(Collective::AllToAll, buffer).times(4.0 * mf));
            }
            a2a.seconds += 4.0 * mf * layers.len() as f64 * profile.job.collective;
            ep_time = ep_time.max(a2a.seconds);
            traffic.expert_parallel = traffic.expert_parallel.then(a2a);
        }
        if s == 0 {
            stage0_payload = grad_bytes
                + if mesh.dp > mesh.ep {
                    expert_grad_bytes
                } else {
                    0.0
                }
                + if p == 1 { LOSS_BYTES } else { 0.0 };
        }
        // The calls' own cost in a calibrated job: one per bucket of each collective, the
        // loss's and the clipping norm's.
        if d > 1 {
            let count = |bytes: f64| (bytes / DEFAULT_BUCKET_BYTES as f64).ceil().max(1.0);
            // ZeRO-3's gathers are in each micro-batch's slot (above).
            let gathers = if zero == 1 || zero == 2 { 1.0 } else { 0.0 };
            let scalars = f64::from(u8::from(loss_stage)) + clip_norms;
            let calls =
                count(grad_bytes) + gathers * count(weight_bytes) + scalars + shared_gathers;
            dp.seconds += (calls + expert_calls) * profile.job.collective;
        }
        dp_time = dp_time.max(dp.seconds);
        traffic.data_parallel = traffic.data_parallel.then(dp).then(gather_mb.times(mf));
    }
    let (compute, tp_seconds, sends, op_seconds, gather_seconds, slowest_stage) = slowest;
    let slot = compute + tp_seconds + sends + op_seconds + gather_seconds;
    let vf = v as f64;
    let bubble = if p > 1 {
        (p as f64 - 1.0) / (vf * mf + p as f64 - 1.0)
    } else {
        0.0
    };
    // The client sends each replica's rows to each of its tensor-parallel ranks: `tp` copies
    // of the batch through the client's link (between hosts).
    let input = p2p_seconds(
        profile.inter_host,
        tf * ctx.model.feed_bytes.at(ctx.batch as f64),
    );
    let time = StepTime {
        input,
        compute: compute * mf,
        tensor_parallel: tp_seconds * mf + tp_step_time,
        pipeline: sends * mf,
        bubble: slot * (p as f64 - 1.0) / vf,
        data_parallel: dp_time + gather_seconds * mf,
        expert_parallel: ep_time,
        // A calibrated job's cost per step, and per task per step (the chief's feed of
        // each task, its share of the dispatch and fetch), as `runtime::job_step` has them.
        overhead: op_seconds * mf
            + if profile.job.step > 0.0 || profile.job.task > 0.0 {
                profile.job.step + mesh.size() as f64 * profile.job.task
            } else {
                profile.step_overhead
            },
    };
    let pipeline_bytes = staged.bytes_per_step(m, rows) * df + dropped_bytes;
    let fits = memory
        .iter()
        .all(|mem| mem.total() <= profile.memory_per_device as f64);
    Evaluation {
        layout: *layout,
        rows,
        memory,
        fits,
        traffic,
        tensor_parallel_messages,
        moe_messages,
        pipeline_bytes,
        data_parallel_payload: stage0_payload,
        time,
        bubble,
        slot,
        slot_gathers: gather_seconds,
        slowest_stage,
    }
}

/// What [`moe_collectives`] counts on one pipeline device.
struct MoeStage<I> {
    /// The load-balancing losses on it (indices into the model's `aux_losses`).
    aux_losses: I,
    /// Whether it computes the loss (and sums the dropped-token count).
    loss_stage: bool,
    /// Whether it holds expert shards (and, with clipping, sums their squared norm).
    experts: bool,
    /// Rows per micro-batch on one replica.
    rows: f64,
}

/// The cost and messages of the MoE layers' other collectives on one pipeline device
/// ([`moe_collectives`]).
struct MoeCollectives {
    /// Their cost (every group of the stage).
    cost: CommCost,
    /// Their messages, every rank of the stage summed.
    messages: f64,
    /// The messages of the stage's busiest rank (rank 0 of its groups: recursive doubling
    /// folds the ranks past a power of two into the first ones).
    rank_messages: f64,
}

/// The MoE layers' collectives on one pipeline device besides the all-to-alls and the
/// gradients' sums, over the stage's data-parallel groups `dp_links` and expert-parallel
/// groups `ep_links` (every group of the stage at once), as the expert strategies build them
/// (`strategy/expert.rs`, `strategy/expert/pipeline.rs`, `strategy/expert/zero.rs`,
/// `strategy/tensor/experts*.rs`): per micro-batch each load-balancing loss's inputs
/// all-gathered (a float one's gradient reduce-scattered back); once per step the dropped-token
/// count (an i64) all-reduced on the loss's stage, and with clipping each rank's expert shards'
/// squared norm summed over its expert-parallel group (an all-gather of one f32 per rank by the
/// expert strategy without ZeRO, tp or pp, an all-reduce of it elsewhere).
fn moe_collectives<I: Iterator<Item = usize>>(
    ctx: &Context<'_>,
    layout: &Layout,
    stage: MoeStage<I>,
    dp_links: &AxisLinks,
    ep_links: &AxisLinks,
) -> MoeCollectives {
    let mesh = layout.mesh;
    let (d, t, ep) = (mesh.dp, mesh.tp, mesh.ep);
    let mf = layout.micro_batches as f64;
    let mut out = MoeCollectives {
        cost: CommCost::default(),
        messages: 0.0,
        rank_messages: 0.0,
    };
    // `times` calls of `call` on `elements` of `size` bytes over groups of `n` ranks, every
    // rank of the stage (`d · t`) making one each; `whole` is the buffer the group's cost is
    // priced on (the gathered output of an all-gather).
    let mut add = |links: &AxisLinks, call: Call, elements: usize, size: usize, times: f64| {
        let n = links.n;
        let (kind, whole) = match call {
            Call::AllGather => (Collective::AllGather, n * elements * size),
            Call::ReduceScatter => (Collective::ReduceScatter, elements * size),
            _ => (Collective::AllReduce, elements * size),
        };
        out.cost = out.cost.then(links.cost(kind, whole as f64).times(times));
        let ranks: f64 = (0..n)
            .map(|r| rank_messages(call, n, r, elements, size) as f64)
            .sum();
        let groups = (d * t / n.max(1)) as f64;
        out.messages += ranks * groups * times;
        out.rank_messages += rank_messages(call, n, 0, elements, size) as f64 * times;
    };
    for k in stage.aux_losses {
        let Some(aux) = ctx.model.aux_losses.get(k) else {
            continue;
        };
        for input in &aux.gathered {
            let size = input.element_bytes.max(1);
            let elements = (input.bytes.at(stage.rows) / size as f64).round() as usize;
            add(dp_links, Call::AllGather, elements, size, mf);
            if input.gradient {
                // The gathered gradient, `dp` ranks' blocks, reduce-scattered.
                add(dp_links, Call::ReduceScatter, elements * d, size, mf);
            }
        }
    }
    if stage.loss_stage {
        add(
            dp_links,
            Call::AllReduce,
            1,
            DROPPED_COUNT_BYTES as usize,
            1.0,
        );
    }
    if ctx.model.clips && stage.experts {
        let size = CLIP_NORM_BYTES as usize;
        let call = if layout.zero == 0 && mesh.pp == 1 && t == 1 {
            Call::AllGather
        } else {
            Call::AllReduce
        };
        debug_assert_eq!(ep_links.n, ep);
        add(ep_links, call, 1, size, 1.0);
    }
    out
}

/// Bytes of one element of the activations (and their gradients) the tensor-parallel
/// all-reduces sum.
fn act_element_bytes(precision: Precision) -> usize {
    match precision {
        Precision::F32 => 4,
        Precision::Mixed => 2,
    }
}

/// The messages of one all-reduce of `bytes` (elements of `size` bytes) over a group of `n`:
/// every rank's, and rank 0's (the most any rank sends).
fn tp_messages(n: usize, bytes: f64, size: usize) -> (f64, f64) {
    let elements = (bytes / size.max(1) as f64).round() as usize;
    let rank = |r: usize| rank_messages(Call::AllReduce, n, r, elements, size) as f64;
    ((0..n).map(rank).sum(), rank(0))
}

/// The cost of `kind` on `bytes` cut into the all-reduce strategy's buckets of at most 25 MiB.
fn buckets(links: &AxisLinks, kind: Collective, bytes: f64) -> CommCost {
    let size = DEFAULT_BUCKET_BYTES as f64;
    let full = (bytes / size).floor();
    let rest = bytes - full * size;
    links
        .cost(kind, size)
        .times(full)
        .then(links.cost(kind, rest))
}

#[cfg(test)]
mod tests {
    use super::super::{evaluate_layout, ClusterProfile, ModelProfile, PlanOptions};
    use dflow_graph::layers::gpt::{gpt, GptConfig};

    #[test]
    fn the_runtime_overhead_is_per_training_op_and_per_step() {
        let cfg = GptConfig {
            vocab_size: 32,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            ..GptConfig::default()
        };
        let model = ModelProfile::new(&gpt(&cfg).unwrap().def, "idx", "targets").unwrap();
        // Backward and optimizer ops make the training graph bigger than the forward one.
        assert!(
            model.training_ops_per_op > 1.5,
            "{}",
            model.training_ops_per_op
        );
        let options = PlanOptions {
            devices: 2,
            batch_size: 8,
        };
        let mut profile = ClusterProfile::preset("a100-80g-8x").unwrap();
        for layout in ["dp=2", "pp=2,m=4"] {
            let layout = layout.parse().unwrap();
            let free = evaluate_layout(&model, &profile, &options, &layout).unwrap();
            assert_eq!(free.time.overhead, 0.0);
            profile.op_overhead = 1e-6;
            profile.step_overhead = 1e-4;
            let e = evaluate_layout(&model, &profile, &options, &layout).unwrap();
            profile.op_overhead = 0.0;
            profile.step_overhead = 0.0;
            // Every forward op of the slowest stage, times the training ops per forward op,
            // once per micro-batch; plus the step's own.
            let m = e.layout.micro_batches as f64;
            let per_micro = (e.time.overhead - 1e-4) / m / 1e-6 / model.training_ops_per_op;
            let stage_ops = model.ops.len() as f64 / e.layout.mesh.pp as f64;
            assert!(
                per_micro > 0.0 && per_micro <= model.ops.len() as f64 + 1e-6,
                "{per_micro} ops per micro-batch of {stage_ops}"
            );
            assert!(e.time.total() > free.time.total() + 1e-4);
        }
    }

    fn moe_model() -> ModelProfile {
        use dflow_graph::layers::MoeConfig;
        let cfg = GptConfig {
            vocab_size: 32,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            moe: Some(MoeConfig {
                num_experts: 4,
                top_k: 1,
                capacity_factor: 1.25,
                ..MoeConfig::default()
            }),
            ..GptConfig::default()
        };
        ModelProfile::new(&gpt(&cfg).unwrap().def, "idx", "targets").unwrap()
    }

    /// A graph `--strategy tensor` cannot split (the digits MLP: no GPT layer names, no
    /// `_sharding` placements) gets no tp layout, the refusal saying why and what to write.
    #[test]
    fn a_graph_the_tensor_strategy_cannot_split_has_no_tp_layout() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/digits/digits.json");
        let text = std::fs::read_to_string(path).unwrap();
        let def = dflow_graph::format::parse_json(&text, None).unwrap().def;
        let model = ModelProfile::new(&def, "pixels", "labels").unwrap();
        assert!(model.tensor_refusal.is_some());
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let options = PlanOptions {
            devices: 2,
            batch_size: 32,
        };
        let tp: crate::planner::Layout = "tp=2".parse().unwrap();
        let e = evaluate_layout(&model, &profile, &options, &tp)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot split this graph") && e.contains("_sharding"),
            "{e}"
        );
        let report = super::super::plan(&model, &profile, &options).unwrap();
        assert_eq!(
            report.best().map(|b| b.layout.short()),
            Some("dp2 tp1 pp1".into())
        );
        assert!(report.ranked.iter().all(|e| e.layout.mesh.tp == 1));
    }

    /// What `dflow run` refuses for an MoE model the planner refuses too, naming the op: tp
    /// (the tensor strategy splits dense MLPs only) and several micro-batches (the router
    /// drops tokens by a share of the batch).
    #[test]
    fn an_moe_model_has_no_tp_layout_and_no_micro_batches() {
        let model = moe_model();
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let options = PlanOptions {
            devices: 4,
            batch_size: 8,
        };
        for (layout, want) in [
            ("dp=2,tp=2", "splits dense MLPs only"),
            ("dp=2,pp=2,m=2", "couples the examples of a batch"),
        ] {
            let layout: crate::planner::Layout = layout.parse().unwrap();
            let e = evaluate_layout(&model, &profile, &options, &layout).unwrap_err();
            assert!(e.to_string().contains(want), "{layout:?}: {e}");
        }
        let one: crate::planner::Layout = "dp=2,pp=2,m=1".parse().unwrap();
        assert!(evaluate_layout(&model, &profile, &options, &one).is_ok());
    }

    /// `dp=2,ep=2,pp=2`: each stage's ranks hold the dense parameters of their stage and half
    /// of its experts, as the job plan's variables (weights and Adam slots) count them, and
    /// the all-to-alls move what the job plan's `CollectiveAllToAll` ops send; with ZeRO-1
    /// the dense slots are halved as the job plan's are; more micro-batches beside it are
    /// refused.
    #[test]
    fn an_ep_pp_layout_holds_half_its_stages_experts_as_the_job_plan_does() {
        use super::super::accounting;
        use crate::planner::collective::{rank_bytes, Call};
        let model = moe_model();
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let options = PlanOptions {
            devices: 4,
            batch_size: 8,
        };
        let def = small_moe_gpt(|_| {});
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        // ZeRO too: each stage's dense slots (ZeRO-3: and weights) halved over its replicas,
        // the experts' whole (dp = ep); the gradients whole over the micro-batch. The dense
        // gradients' collectives (ZeRO-3: and each pass's gathers) over the stage's replicas
        // are the job plan's.
        for text in [
            "dp=2,ep=2,pp=2",
            "dp=2,ep=2,pp=2,zero=1",
            "dp=2,ep=2,pp=2,zero=2",
            "dp=2,ep=2,pp=2,zero=3",
            "dp=4,ep=2,pp=2,zero=2",
            "dp=4,ep=2,pp=2,zero=3",
        ] {
            let layout: crate::planner::Layout = text.parse().unwrap();
            let devices = layout.mesh.size();
            let options = PlanOptions {
                devices,
                batch_size: 8,
            };
            let rows = 8 / layout.mesh.dp;
            let e = evaluate_layout(&model, &profile, &options, &layout).unwrap();
            assert_eq!(e.memory.len(), 2);
            let plan = accounting::job_plan(&g, &train, "idx", "targets", &layout, 8).unwrap();
            assert_expert_collectives(&e, &plan, rows, text);
            let tasks = accounting::account(&plan, rows, 1).unwrap();
            for (s, mem) in e.memory.iter().enumerate() {
                // Worker dp·s holds replica 0 of stage s; adam/t (8 bytes) lives on stage 0 only.
                let task = format!("/job:worker/replica:0/task:{}", layout.mesh.dp * s);
                let held = tasks
                    .iter()
                    .find(|t| t.task == task)
                    .unwrap()
                    .variable_bytes as f64;
                let predicted = mem.weights + mem.optimizer;
                assert!(
                    (held - predicted).abs() <= 8.0,
                    "{text}, stage {s}: held {held}, predicted {predicted}"
                );
            }
        }
        let layout: crate::planner::Layout = "dp=2,ep=2,pp=2".parse().unwrap();
        let e = evaluate_layout(&model, &profile, &options, &layout).unwrap();
        let plan = accounting::job_plan(&g, &train, "idx", "targets", &layout, 8).unwrap();
        let mut a2a = 0u64;
        for sig in plan.train_signatures() {
            for part in sig.partitions.partitions.values() {
                let fixed = accounting::with_rows(&part.graph, 4).unwrap();
                for i in fixed.node_indices() {
                    if fixed.node(i).op == "CollectiveAllToAll" {
                        let (src, k) = fixed.inputs(i)[0];
                        let elements = fixed.node(src).outputs[k].shape.num_elements().unwrap();
                        a2a += rank_bytes(Call::AllToAll, 2, 0, elements, 4);
                    }
                }
            }
        }
        let predicted =
            e.traffic.expert_parallel.intra_bytes + e.traffic.expert_parallel.inter_bytes;
        assert!(a2a > 0);
        assert_eq!(predicted, a2a as f64);
        for (bad, want) in [
            ("dp=2,ep=2,pp=2,m=2", "couples the examples of a batch"),
            (
                "dp=2,ep=2,pp=2,m=2,zero=3",
                "couples the examples of a batch",
            ),
        ] {
            let e = evaluate_layout(&model, &profile, &options, &bad.parse().unwrap())
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    /// `dp × tp × ep` (`--mesh dp=D,tp=T,ep=E`, the tensor strategy), ZeRO 0 to 3 (at 3 the
    /// weights sharded as the slots are, and gathered before each pass): every rank holds its
    /// tp shard of the dense parameters, the routers whole and `1/ep` of the experts
    /// (replicated over tp), as the job plan's variables count them; the all-to-alls are the
    /// job plan's (each tp rank repeats its replica's), and the data-parallel bytes (the dense
    /// gradients over `data_t<t>`, the experts' over `experts_dp<s>_t<t>`, the load-balancing
    /// loss's all-gathers and the dropped-token count over `data_t<t>`) are the job plan's
    /// collectives over those groups, every collective's bytes together the plan's, and the
    /// MoE layers' other collectives' messages the plan's. No tensor-parallel all-reduce is
    /// around an MoE MLP.
    #[test]
    fn a_dp_tp_ep_layout_holds_its_expert_shard_on_every_tp_rank_as_the_job_plan_does() {
        use super::super::accounting;
        let model = moe_model();
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let def = small_moe_gpt(|_| {});
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        // Tensor-parallel all-reduces: Megatron's around attention (one each way per block),
        // the vocabulary-parallel embedding, the head's input gradient and the split loss;
        // none around an MoE MLP (`transformer.h.<i>.mlp`).
        let tp_ops: Vec<&str> = model
            .ops
            .iter()
            .filter(|o| o.tp_forward.at(4.0) > 0.0 || o.tp_backward.at(4.0) > 0.0)
            .map(|o| model.graph.node(o.node).name.as_str())
            .collect();
        assert_eq!(tp_ops.len(), 2 * 2 + 3, "{tp_ops:?}");
        assert!(tp_ops.iter().all(|n| !n.contains("mlp")), "{tp_ops:?}");
        // No MoE weight is split by tp (the routers and experts stay whole on each tp rank).
        for v in &model.variables {
            let name = &model.graph.node(v.node).name;
            if v.expert || name.contains("router") {
                assert!(!v.split, "{name} split");
            }
        }
        for (text, devices) in [
            ("dp=2,tp=2,ep=2", 4),
            ("dp=4,tp=2,ep=2", 8),
            ("dp=4,tp=2,ep=2,zero=1", 8),
            ("dp=4,tp=2,ep=2,zero=2", 8),
            ("dp=2,tp=2,ep=2,zero=3", 4),
            ("dp=4,tp=2,ep=2,zero=3", 8),
        ] {
            let options = PlanOptions {
                devices,
                batch_size: 8,
            };
            let layout: crate::planner::Layout = text.parse().unwrap();
            let e = evaluate_layout(&model, &profile, &options, &layout).unwrap();
            let rows = 8 / layout.mesh.dp;
            let plan = accounting::job_plan(&g, &train, "idx", "targets", &layout, 8).unwrap();
            let tasks = accounting::account(&plan, rows, 1).unwrap();
            assert_eq!(tasks.len(), devices);
            let mem = e.memory[0];
            for t in &tasks {
                let held = t.variable_bytes as f64;
                let predicted = mem.weights + mem.optimizer;
                assert!(
                    (held - predicted).abs() <= 8.0,
                    "{text}, {}: held {held}, predicted {predicted}",
                    t.task
                );
            }
            let job = assert_expert_collectives(&e, &plan, rows, text);
            assert!(job.all_to_all > 0);
        }
    }

    /// The 4-axis mesh `dp × tp × pp × ep` (`--mesh dp=2,tp=2,pp=2,ep=2`, the tensor strategy
    /// inside pipeline stages, one micro-batch), ZeRO 0 to 3, the MoE GPT clipped: per stage,
    /// each rank holds its tp shard of the stage's dense parameters and `1/ep` of the stage's
    /// experts, as the job plan's variables count them on every task of that stage; the
    /// all-to-alls (each tp rank repeats its replica's per micro-batch), the tensor-parallel
    /// bytes and messages (`tensor_s<s>_d<d>`), the data-parallel bytes (the dense gradients
    /// over `pipeline/stage<s>_t<t>`, the experts' over `experts_dp<k>_s<s>_t<t>`) and the
    /// bytes between stages are the job plan's, every task summed.
    /// The tests' small MoE GPT: 2 blocks of 16 channels and 2 heads over 8 characters, a
    /// vocabulary of 32, 4 experts, top-1, capacity factor 1.25; `tweak` changes the rest.
    fn small_moe_gpt(tweak: impl FnOnce(&mut GptConfig)) -> dflow_graph::GraphDef {
        let mut c = GptConfig {
            vocab_size: 32,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            moe: Some(dflow_graph::layers::MoeConfig {
                num_experts: 4,
                top_k: 1,
                capacity_factor: 1.25,
                ..Default::default()
            }),
            ..GptConfig::default()
        };
        tweak(&mut c);
        gpt(&c).unwrap().def
    }

    #[test]
    fn a_dp_tp_pp_ep_layout_holds_its_stages_tp_shard_and_expert_shard_as_the_job_plan_does() {
        let def = small_moe_gpt(|c| {
            c.grad_clip = Some(1.0);
        });
        let model = ModelProfile::new(&def, "idx", "targets").unwrap();
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        for zero in 0..=3 {
            let text = format!("dp=2,tp=2,pp=2,ep=2,m=1,zero={zero}");
            let sums = assert_staged_experts_are_the_job_plans(&model, &g, &train, &text);
            assert_eq!(sums.stages, 2);
            assert!(sums.all_to_all > 0 && sums.tensor > 0 && sums.between_stages > 0);
        }
    }

    /// What [`assert_staged_experts_are_the_job_plans`] compared: the layout's stages and
    /// the job plan's bytes summed over its tasks.
    struct StagedSums {
        stages: usize,
        all_to_all: u64,
        tensor: u64,
        between_stages: u64,
    }

    /// The table row of `layout` (an MoE GPT `model` with experts over a pipeline) against
    /// the job plan of `g` dflow runs: each task's variables equal its stage's weights and
    /// optimizer state (within `adam/t`'s 8 bytes), and the all-to-all, data-parallel,
    /// tensor-parallel (bytes and messages) and between-stage bytes equal the plan's, every
    /// task summed.
    fn assert_staged_experts_are_the_job_plans(
        model: &ModelProfile,
        g: &dflow_graph::Graph,
        train: &dflow_graph::train::TrainSpec,
        layout: &str,
    ) -> StagedSums {
        use super::super::accounting;
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let bytes = |c: super::CommCost| c.intra_bytes + c.inter_bytes;
        let text = layout;
        let layout: crate::planner::Layout = layout.parse().unwrap();
        let options = PlanOptions {
            devices: layout.mesh.size(),
            batch_size: 8,
        };
        let e = evaluate_layout(model, &profile, &options, &layout).unwrap();
        let rows = 8 / layout.mesh.dp;
        let plan = accounting::job_plan(g, train, "idx", "targets", &layout, 8).unwrap();
        let tasks = accounting::account(&plan, rows, 1).unwrap();
        assert_eq!(tasks.len(), layout.mesh.size(), "{text}");
        for t in &tasks {
            let index: usize = t.task.rsplit(':').next().unwrap().parse().unwrap();
            let (_, _, s) = layout.mesh.coords(index);
            let held = t.variable_bytes as f64;
            let mem = e.memory[s];
            let predicted = mem.weights + mem.optimizer;
            assert!(
                (held - predicted).abs() <= 8.0,
                "{text}, {} (stage {s}): held {held}, predicted {predicted}",
                t.task
            );
        }
        let a2a = assert_expert_collectives(&e, &plan, rows, text).all_to_all;
        let (tp, messages) = tensor_job_traffic(&plan, rows);
        assert_eq!(bytes(e.traffic.tensor_parallel), tp as f64, "{text}");
        assert_eq!(e.tensor_parallel_messages, messages as f64, "{text}");
        let sent: u64 = accounting::traffic(&plan, rows)
            .unwrap()
            .iter()
            .map(|t| t.data_plane)
            .sum();
        assert_eq!(bytes(e.traffic.pipeline), sent as f64, "{text}");
        StagedSums {
            stages: e.memory.len(),
            all_to_all: a2a,
            tensor: tp,
            between_stages: sent,
        }
    }

    /// The MoE layers' other collectives over groups whose sizes are not powers of two (6
    /// experts, clipped, batch 12): the load-balancing losses' all-gathers and reduce-scatters
    /// as rings of 6 or 3 ranks, the dropped-token count's all-reduce folding ranks past 4 (or
    /// 2) in, the expert shards' clipping norm over expert-parallel groups of 3 (an all-gather
    /// without ZeRO, an all-reduce folding one rank in with it), beside tp and inside pipeline
    /// stages too: the table's bytes (every collective, and between stages) and those calls'
    /// messages are the job plan's.
    #[test]
    fn moe_collectives_over_groups_of_three_and_six_are_the_job_plans() {
        let def = small_moe_gpt(|c| {
            c.n_embd = 12;
            c.grad_clip = Some(1.0);
            if let Some(moe) = c.moe.as_mut() {
                moe.num_experts = 6;
                moe.top_k = 2;
            }
        });
        let model = ModelProfile::new(&def, "idx", "targets").unwrap();
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        let profile = ClusterProfile::preset("this-machine").unwrap();
        for text in [
            "dp=6,ep=3",
            "dp=6,ep=3,zero=1",
            "dp=6,ep=2,zero=3",
            "dp=6,ep=6",
            "dp=3,tp=2,ep=3",
            "dp=3,tp=2,ep=3,zero=2",
            "dp=3,ep=3,pp=2",
            "dp=3,ep=3,pp=2,zero=3",
        ] {
            let layout: crate::planner::Layout = text.parse().unwrap();
            let options = PlanOptions {
                devices: layout.mesh.size(),
                batch_size: 12,
            };
            let e = evaluate_layout(&model, &profile, &options, &layout).unwrap();
            let rows = 12 / layout.mesh.dp;
            let plan =
                super::super::accounting::job_plan(&g, &train, "idx", "targets", &layout, 12)
                    .unwrap();
            assert_expert_collectives(&e, &plan, rows, text);
            let sent: u64 = super::super::accounting::traffic(&plan, rows)
                .unwrap()
                .iter()
                .map(|t| t.data_plane)
                .sum();
            let between = e.traffic.pipeline.intra_bytes + e.traffic.pipeline.inter_bytes;
            assert_eq!(between, sent as f64, "{text}");
        }
    }

    /// Where no router couples the batch (capacity factor ≥ E, no load-balancing loss) the
    /// planner ranks several micro-batches beside `ep × pp` (beside tp too), and the table's
    /// variables and bytes are the job plan's: `dp=2,ep=2,pp=2` and `dp=2,tp=2,pp=2,ep=2` with
    /// 2 micro-batches, ZeRO 0 to 3, and `dp=4,ep=2,pp=2` (the expert shards' sums over their
    /// expert-data-parallel groups) at ZeRO 0 to 3 (at 3 the expert shards gathered over those
    /// groups for every micro-batch's forward and backward pass, the biases once per pass), and
    /// beside tp `dp=4,tp=2,pp=2,ep=2` at ZeRO-3.
    #[test]
    fn uncoupled_experts_over_a_pipeline_take_micro_batches_as_the_job_plan_does() {
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let def = small_moe_gpt(|c| {
            c.grad_clip = Some(1.0);
            if let Some(moe) = c.moe.as_mut() {
                moe.capacity_factor = 4.0;
                moe.aux_loss_coef = 0.0;
            }
        });
        let model = ModelProfile::new(&def, "idx", "targets").unwrap();
        assert_eq!(model.batch_coupled, None);
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        // (16 tasks beside tp: ZeRO-3 only, the stage the others do not cover.)
        for (mesh, zeros) in [
            ("dp=2,ep=2,pp=2", 0..=3),
            ("dp=2,tp=2,pp=2,ep=2", 0..=3),
            ("dp=4,ep=2,pp=2", 0..=3),
            ("dp=4,tp=2,pp=2,ep=2", 3..=3),
        ] {
            for zero in zeros {
                let text = format!("{mesh},m=2,zero={zero}");
                let sums = assert_staged_experts_are_the_job_plans(&model, &g, &train, &text);
                assert!(sums.all_to_all > 0 && sums.between_stages > 0, "{text}");
            }
        }
        let options = PlanOptions {
            devices: 8,
            batch_size: 8,
        };
        // ZeRO-3 beside expert-data-parallel groups: every micro-batch gathers the expert
        // matrices its forward and backward copies read, and the expert biases (read through a
        // reshape the micro-batches share) are gathered once per pass: 522,880 B per step;
        // with the load-balancing losses' all-gathers of every micro-batch (9,216 B) and their
        // gradients' reduce-scatters (6,144 B), the dropped-token count's sum (64 B) and the
        // expert shards' clipping norm over each expert-parallel group (32 B): 538,336 B.
        let z3: crate::planner::Layout = "dp=4,ep=2,pp=2,m=2,zero=3".parse().unwrap();
        let e = evaluate_layout(&model, &profile, &options, &z3).unwrap();
        let data = e.traffic.data_parallel;
        assert_eq!(data.intra_bytes + data.inter_bytes, 538_336.0);
        // Per micro-batch and rank: 3 ring steps each of the two gathers and the
        // reduce-scatter (8 ranks, 2 micro-batches: 144); the count's 2 rounds on the 4 ranks
        // of the loss's stage (8) and the norm's one on each of the 8 ranks.
        assert_eq!(e.moe_messages, 144.0 + 8.0 + 8.0);
        let report = super::super::plan(&model, &profile, &options).unwrap();
        let all = || report.ranked.iter().chain(&report.too_big);
        assert!(all()
            .any(|e| e.layout.mesh.ep > 1 && e.layout.mesh.tp > 1 && e.layout.micro_batches > 1));
        assert!(all().any(|e| e.layout == z3), "{z3} not ranked");
        assert!(report
            .refused
            .iter()
            .all(|r| !r.reason.contains("micro-batch")));
    }

    /// A job plan's collectives per step, every rank summed (see [`expert_job_bytes`]).
    struct ExpertJobBytes {
        /// Bytes of its all-to-alls.
        all_to_all: u64,
        /// Bytes of every other collective but those over the `tensor*` groups: the
        /// gradients' and weights' (over `workers`, `pipeline/stage<s>`, `data_t<t>` and the
        /// `experts_dp*` groups), the load-balancing losses' all-gathers and reduce-scatters,
        /// the dropped-token count's sum, the clipping norms' (over the `experts_ep*` groups
        /// too).
        data: u64,
        /// Messages of the MoE layers' collectives besides the all-to-alls and the gradients'
        /// sums: the load-balancing losses' all-gathers and their gradients' reduce-scatters,
        /// the dropped-token count's sum, the expert shards' clipping norm over each
        /// expert-parallel group.
        moe_messages: usize,
        /// Bytes of every collective.
        all: u64,
    }

    /// What `plan`'s collectives send per step with `rows` rows per replica, every rank summed.
    fn expert_job_bytes(plan: &crate::strategy::JobPlan, rows: usize) -> ExpertJobBytes {
        use super::super::accounting;
        use crate::planner::collective::{rank_bytes, rank_messages, Call};
        let mut sums = ExpertJobBytes {
            all_to_all: 0,
            data: 0,
            moe_messages: 0,
            all: 0,
        };
        for sig in plan.train_signatures() {
            for (device, part) in &sig.partitions.partitions {
                let task = device.task_name().unwrap();
                let f = accounting::with_rows(&part.graph, rows).unwrap();
                for i in f.node_indices() {
                    let node = f.node(i);
                    let call = match node.op {
                        "CollectiveAllReduce" | "CollectiveTpReduce" => Call::AllReduce,
                        "CollectiveReduceScatter" => Call::ReduceScatter,
                        "CollectiveAllGather" => Call::AllGather,
                        "CollectiveAllToAll" => Call::AllToAll,
                        _ => continue,
                    };
                    let Some(dflow_graph::AttrValue::String(key)) = node.attr("group_key") else {
                        continue;
                    };
                    let group = plan.groups.iter().find(|x| x.key == *key).unwrap();
                    let n = group.members.len();
                    let rank = group.members.iter().position(|m| *m == task).unwrap();
                    let (src, k) = f.inputs(i)[0];
                    let t = &f.node(src).outputs[k];
                    let elements = t.shape.num_elements().unwrap();
                    let size = t.dtype.size_of();
                    let bytes = rank_bytes(call, n, rank, elements, size);
                    sums.all += bytes;
                    if call == Call::AllToAll {
                        sums.all_to_all += bytes;
                        continue;
                    }
                    if !key.starts_with("tensor") {
                        sums.data += bytes;
                    }
                    // The expert strategy without ZeRO gathers the expert shards' norms
                    // (`allreduce/clip/local/all_gather`, over `workers` where ep = dp).
                    let moe = node.name.contains("aux_loss")
                        || node.name.starts_with("moe/dropped")
                        || node.name == "allreduce/clip/local/all_gather"
                        || key.starts_with("experts_ep");
                    if moe {
                        sums.moe_messages += rank_messages(call, n, rank, elements, size);
                    }
                }
            }
        }
        sums
    }

    /// The table row `e` of an MoE layout `text` against its job plan `plan` (`rows` rows per
    /// replica): the all-to-all bytes, the data-parallel bytes (every collective but the
    /// all-to-alls and the tensor-parallel ones) and the MoE layers' other collectives'
    /// messages equal the plan's, and so do all the collectives' bytes together.
    fn assert_expert_collectives(
        e: &super::Evaluation,
        plan: &crate::strategy::JobPlan,
        rows: usize,
        text: &str,
    ) -> ExpertJobBytes {
        let bytes = |c: super::CommCost| c.intra_bytes + c.inter_bytes;
        let job = expert_job_bytes(plan, rows);
        let t = e.traffic;
        assert_eq!(bytes(t.expert_parallel), job.all_to_all as f64, "{text}");
        assert_eq!(bytes(t.data_parallel), job.data as f64, "{text}");
        assert_eq!(e.moe_messages, job.moe_messages as f64, "{text}");
        assert!(job.moe_messages > 0, "{text}");
        let sent: u64 = super::super::accounting::traffic(plan, rows)
            .unwrap()
            .iter()
            .map(|t| t.collective)
            .sum();
        assert_eq!(sent, job.all, "{text}");
        assert_eq!(
            bytes(t.tensor_parallel) + bytes(t.data_parallel) + bytes(t.expert_parallel),
            sent as f64,
            "{text}: every collective"
        );
        job
    }

    #[test]
    fn an_ep_layout_holds_its_part_of_the_experts_and_moves_their_tokens() {
        use super::super::accounting;
        use crate::planner::collective::{rank_bytes, Call};
        let model = moe_model();
        assert_eq!(model.moe.len(), 2);
        assert_eq!(model.ep_sizes(), [1, 2, 4]);
        let experts = model.expert_parameters();
        assert!(experts > 0.0 && experts < model.parameters());
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let options = PlanOptions {
            devices: 4,
            batch_size: 8,
        };
        let dp = evaluate_layout(&model, &profile, &options, &"dp=4".parse().unwrap()).unwrap();
        let ep =
            evaluate_layout(&model, &profile, &options, &"dp=4,ep=2".parse().unwrap()).unwrap();
        // Half of the experts' weights (and gradients, Adam state) leave each rank.
        let saved = dp.peak().weights - ep.peak().weights;
        assert!(
            (saved - experts / 2.0 * 4.0).abs() < 1e-6,
            "{saved} {experts}"
        );
        assert_eq!(dp.traffic.expert_parallel, super::CommCost::default());
        // The all-to-alls: what the job plan's CollectiveAllToAll ops send, every rank summed.
        let def = small_moe_gpt(|_| {});
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        let plan = accounting::job_plan(&g, &train, "idx", "targets", &ep.layout, 8).unwrap();
        let (mut a2a, mut calls) = (0u64, 0usize);
        for sig in plan.train_signatures() {
            for part in sig.partitions.partitions.values() {
                let fixed = accounting::with_rows(&part.graph, 2).unwrap();
                for i in fixed.node_indices() {
                    if fixed.node(i).op == "CollectiveAllToAll" {
                        let (s, k) = fixed.inputs(i)[0];
                        let elements = fixed.node(s).outputs[k].shape.num_elements().unwrap();
                        a2a += rank_bytes(Call::AllToAll, 2, 0, elements, 4);
                        calls += 1;
                    }
                }
            }
        }
        // Two each way per layer, forward and backward, on each of the 4 workers.
        assert_eq!(calls, 4 * 2 * 4);
        let predicted =
            ep.traffic.expert_parallel.intra_bytes + ep.traffic.expert_parallel.inter_bytes;
        assert_eq!(predicted, a2a as f64);
        // ZeRO-3: the dense weights over 4, each rank's experts over their 2 holders.
        let z3 = evaluate_layout(
            &model,
            &profile,
            &options,
            &"dp=4,ep=2,zero=3".parse().unwrap(),
        )
        .unwrap();
        let dense = model.parameters() - experts;
        let want = (dense / 4.0 + experts / 2.0 / 2.0) * 4.0;
        assert!((z3.peak().weights - want).abs() < 1e-6, "{z3:?}");
        assert!((z3.peak().gradients - want).abs() < 1e-6, "{z3:?}");
        // ZeRO-2: the dense gradients and Adam state over 4, the experts' over 2.
        let z2 = evaluate_layout(
            &model,
            &profile,
            &options,
            &"dp=4,ep=2,zero=2".parse().unwrap(),
        )
        .unwrap();
        let dense = model.parameters() - experts;
        let want = (dense / 4.0 + experts / 2.0 / 2.0) * 4.0 * 2.0;
        assert!((z2.peak().optimizer - want).abs() < 1e-6, "{z2:?}");
        // At every ZeRO stage the data-parallel bytes (the dense states over 4, the experts'
        // over their 2 holders, the expert shards' clipping norm over those 2 too) are the
        // job plan's.
        for zero in 0..4 {
            let layout: crate::planner::Layout = format!("dp=4,ep=2,zero={zero}").parse().unwrap();
            let e = evaluate_layout(&model, &profile, &options, &layout).unwrap();
            let plan = accounting::job_plan(&g, &train, "idx", "targets", &layout, 8).unwrap();
            assert_expert_collectives(&e, &plan, 2, &layout.short());
        }
        // A model without experts has no ep layout, and refuses one by name.
        let cfg = GptConfig {
            vocab_size: 32,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            ..GptConfig::default()
        };
        let dense = ModelProfile::new(&gpt(&cfg).unwrap().def, "idx", "targets").unwrap();
        assert_eq!(dense.ep_sizes(), [1]);
        let e = evaluate_layout(&dense, &profile, &options, &"dp=4,ep=2".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ep=2 spreads the experts of MoE layers, and the model has none"),
            "{e}"
        );
        let report = super::super::plan(&dense, &profile, &options).unwrap();
        assert!(report
            .ranked
            .iter()
            .chain(&report.too_big)
            .all(|e| e.layout.mesh.ep == 1));
        let report = super::super::plan(&model, &profile, &options).unwrap();
        let eps: Vec<String> = report
            .ranked
            .iter()
            .chain(&report.too_big)
            .filter(|e| e.layout.mesh.ep > 1)
            .map(|e| e.layout.short())
            .collect();
        // ZeRO 0 to 3 of each dp × ep; dp2 × ep2 inside 2 pipeline stages, one micro-batch
        // at ZeRO 0 to 3; dp2 × tp2 × ep2 at ZeRO 0 to 3.
        assert_eq!(eps.len(), 16, "{eps:?}");
        for l in [
            "dp2 tp2 pp1 ep2 z1",
            "dp2 tp2 pp1 ep2 z2",
            "dp2 tp2 pp1 ep2 z3",
            "dp2 tp1 pp2 ep2 z2 m1",
            "dp2 tp1 pp2 ep2 z3 m1",
            "dp2 tp2 pp1 ep2",
            "dp4 tp1 pp1 ep2",
            "dp4 tp1 pp1 ep4",
            "dp4 tp1 pp1 ep2 z2",
            "dp4 tp1 pp1 ep2 z3",
            "dp2 tp1 pp2 ep2 m1",
            "dp2 tp1 pp2 ep2 z1 m1",
        ] {
            assert!(eps.iter().any(|e| e == l), "{l} not in {eps:?}");
        }
    }

    /// The digits MLP with AdamW (clipped), as `examples/digits/digits-adamw.json`.
    fn digits_adamw() -> (dflow_graph::GraphDef, ModelProfile) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../examples/digits/digits-adamw.json");
        let text = std::fs::read_to_string(path).unwrap();
        let def = dflow_graph::format::parse_json(&text, None).unwrap().def;
        let model = ModelProfile::new(&def, "pixels", "labels").unwrap();
        (def, model)
    }

    /// Every task's collective bytes per step of `layout`'s job plan, summed.
    fn job_collective_bytes(def: &dflow_graph::GraphDef, layout: &str, batch: usize) -> u64 {
        use super::super::accounting;
        let g = dflow_graph::Graph::from_def(def).unwrap();
        let train = def.train.clone().unwrap();
        let layout: super::Layout = layout.parse().unwrap();
        let plan = accounting::job_plan(&g, &train, "pixels", "labels", &layout, batch).unwrap();
        accounting::traffic(&plan, batch / layout.mesh.dp)
            .unwrap()
            .iter()
            .map(|t| t.collective)
            .sum()
    }

    #[test]
    fn zero_over_a_pipeline_is_what_the_job_does() {
        let (def, model) = digits_adamw();
        // w1 (first layer) is read by no backward op: its input, the pixels, needs no gradient.
        let backward: Vec<bool> = model.variables.iter().map(|v| v.backward_read).collect();
        let names: Vec<&str> = model
            .variables
            .iter()
            .map(|v| model.graph.node(v.node).name.as_str())
            .collect();
        assert!(
            names.iter().zip(&backward).all(|(n, &b)| b == (*n == "w2")),
            "{names:?} {backward:?}"
        );
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let options = PlanOptions {
            devices: 4,
            batch_size: 32,
        };
        let eval = |l: &str| evaluate_layout(&model, &profile, &options, &l.parse().unwrap());
        let z: Vec<_> = (0..4)
            .map(|zero| eval(&format!("dp=2,pp=2,m=2,zero={zero}")).unwrap())
            .collect();
        for s in 0..2 {
            let m: Vec<_> = z.iter().map(|e| e.memory[s]).collect();
            // The gradients add up over the micro-batches, whole, at every stage.
            assert!(m.iter().all(|x| x.gradients == m[0].gradients), "{m:?}");
            assert_eq!(m[1].optimizer, m[0].optimizer / 2.0);
            assert_eq!(m[2], m[1]);
            assert_eq!(m[3].weights, m[0].weights / 2.0);
            assert_eq!(m[3].optimizer, m[1].optimizer);
        }
        // The data-parallel bytes: the table's collectives (the gradients, ZeRO's gathers, the
        // loss and the clipping norm) are the job plan's, every task summed, exactly.
        let bytes = |e: &super::Evaluation| {
            e.traffic.data_parallel.intra_bytes + e.traffic.data_parallel.inter_bytes
        };
        for zero in 0..4 {
            for layout in [
                format!("dp=2,pp=2,m=2,zero={zero}"),
                format!("dp=2,zero={zero}"),
            ] {
                let devices = if layout.contains("pp") { 4 } else { 2 };
                let options = PlanOptions {
                    devices,
                    batch_size: 32,
                };
                let e = evaluate_layout(&model, &profile, &options, &layout.parse().unwrap());
                let table = bytes(&e.unwrap());
                let job = job_collective_bytes(&def, &layout, 32);
                assert_eq!(table, job as f64, "{layout}");
            }
        }
        // ZeRO-3's gathers sit in every micro-batch's slot: more micro-batches, more gathers.
        let m4 = eval("dp=2,pp=2,m=4,zero=3").unwrap();
        assert!(bytes(&m4) > bytes(&z[3]));
        assert!(z[3].time.data_parallel > z[2].time.data_parallel);
        assert!(z[3].slot_gathers > 0.0 && z[2].slot_gathers == 0.0);
        assert!(z[3].time.data_parallel >= 2.0 * z[3].slot_gathers);
        // No refusal left for ZeRO over a pipeline, and the enumeration has them.
        let report = super::super::plan(&model, &profile, &options).unwrap();
        assert!(report
            .ranked
            .iter()
            .chain(&report.too_big)
            .any(|e| e.layout.mesh.pp > 1 && e.layout.zero == 3));
        assert!(report.refused.iter().all(|r| !r.reason.contains("ZeRO")));
    }

    /// The small GPT of `cli/tests/plan_vs_measured.rs` (tied embedding, clipped): the
    /// table's data-parallel bytes over a pipeline, every ZeRO stage, are the job plan's
    /// collectives exactly (ZeRO-3: the gathers of every micro-batch and pass, and the tied
    /// embedding's gather for its send to the last stage).
    #[test]
    fn gpt_zero_over_a_pipeline_table_against_the_job_plan() {
        use super::super::accounting;
        let cfg = GptConfig {
            vocab_size: 76,
            block_size: 8,
            n_layer: 2,
            n_head: 4,
            n_embd: 32,
            grad_clip: Some(0.5),
            ..GptConfig::default()
        };
        let def = gpt(&cfg).unwrap().def;
        let model = ModelProfile::new(&def, "idx", "targets").unwrap();
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        for (layout, devices) in [
            ("dp=2,pp=2,m=2,zero=0", 4),
            ("dp=2,pp=2,m=2,zero=1", 4),
            ("dp=2,pp=2,m=2,zero=2", 4),
            ("dp=2,pp=2,m=2,zero=3", 4),
            ("dp=2,zero=3", 2),
        ] {
            let options = PlanOptions {
                devices,
                batch_size: 4,
            };
            let l: super::Layout = layout.parse().unwrap();
            let e = evaluate_layout(&model, &profile, &options, &l).unwrap();
            let plan = accounting::job_plan(&g, &train, "idx", "targets", &l, 4).unwrap();
            let job: u64 = accounting::traffic(&plan, 2)
                .unwrap()
                .iter()
                .map(|t| t.collective)
                .sum();
            let table = e.traffic.data_parallel.intra_bytes + e.traffic.data_parallel.inter_bytes;
            assert_eq!(table, job as f64, "{layout}");
        }
    }

    /// The small GPT beside tensor parallelism: the table's data-parallel bytes are the job
    /// plan's collectives over its data-parallel groups (every group but the tensor-parallel
    /// ones), every task summed, exactly: the 3D mesh at ZeRO 0–2 and dp2×tp2 at ZeRO 1–3 (the
    /// tensor-parallel bytes: `the_tensor_parallel_bytes_and_messages_are_the_job_plans`).
    #[test]
    fn gpt_3d_table_data_parallel_bytes_are_the_job_plans() {
        use super::super::accounting;
        use crate::planner::collective::{rank_bytes, Call};
        let cfg = GptConfig {
            vocab_size: 76,
            block_size: 8,
            n_layer: 2,
            n_head: 4,
            n_embd: 32,
            grad_clip: Some(0.5),
            ..GptConfig::default()
        };
        let def = gpt(&cfg).unwrap().def;
        let model = ModelProfile::new(&def, "idx", "targets").unwrap();
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        for (layout, devices) in [
            ("dp=2,tp=2,pp=2,m=2,zero=0", 8),
            ("dp=2,tp=2,pp=2,m=2,zero=1", 8),
            ("dp=2,tp=2,pp=2,m=2,zero=2", 8),
            ("dp=2,tp=2,zero=1", 4),
            ("dp=2,tp=2,zero=2", 4),
            ("dp=2,tp=2,zero=3", 4),
        ] {
            let options = PlanOptions {
                devices,
                batch_size: 4,
            };
            let l: super::Layout = layout.parse().unwrap();
            let e = evaluate_layout(&model, &profile, &options, &l).unwrap();
            let plan = accounting::job_plan(&g, &train, "idx", "targets", &l, 4).unwrap();
            let mut job = 0u64;
            for sig in plan.train_signatures() {
                for (device, part) in &sig.partitions.partitions {
                    let task = device.task_name().unwrap();
                    let f = accounting::with_rows(&part.graph, 2).unwrap();
                    for i in f.node_indices() {
                        let node = f.node(i);
                        let call = match node.op {
                            "CollectiveAllReduce" => Call::AllReduce,
                            "CollectiveReduceScatter" => Call::ReduceScatter,
                            "CollectiveAllGather" => Call::AllGather,
                            _ => continue,
                        };
                        let Some(dflow_graph::AttrValue::String(key)) = node.attr("group_key")
                        else {
                            continue;
                        };
                        if key.starts_with("tensor") {
                            continue;
                        }
                        let group = plan.groups.iter().find(|x| x.key == *key).unwrap();
                        let rank = group.members.iter().position(|m| *m == task).unwrap();
                        let (src, k) = f.inputs(i)[0];
                        let t = &f.node(src).outputs[k];
                        let elements = t.shape.num_elements().unwrap();
                        job += rank_bytes(
                            call,
                            group.members.len(),
                            rank,
                            elements,
                            t.dtype.size_of(),
                        );
                    }
                }
            }
            let table = e.traffic.data_parallel.intra_bytes + e.traffic.data_parallel.inter_bytes;
            assert_eq!(table, job as f64, "{layout}");
        }
    }

    /// Under a calibrated profile the table's step prices what the job plan's price
    /// (`runtime::predict`, "step as dflow runs it") prices: a value sent between stages and
    /// received costs a call each side, every task its per-step cost. Before, the table put a
    /// 2-stage pipeline of the digits MLP at a sixth of the job plan's step.
    #[test]
    fn a_calibrated_table_prices_sends_and_tasks_as_the_job_plan_does() {
        use super::super::{accounting, runtime, JobCosts};
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/digits/digits.json");
        let text = std::fs::read_to_string(path).unwrap();
        let def = dflow_graph::format::parse_json(&text, None).unwrap().def;
        let model = ModelProfile::new(&def, "pixels", "labels").unwrap();
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        let mut profile = ClusterProfile::preset("this-machine").unwrap();
        // A calibration of this machine (2026-11-25 06:44 UTC, the per-call model: no value or
        // product cost).
        profile.job = JobCosts {
            step: 0.0,
            task: 74.9e-6,
            op: 0.148e-6,
            collective: 16.7e-6,
            value: 0.0,
            product: 0.0,
            beyond_cores: 0.0,
            spawn: 0.0,
            beyond_cores_per_flop: 0.0,
            transfer_per_byte: 0.0,
            flops_per_second: 46.4e9,
            bytes_per_second: 15.32e9,
            transcendentals_per_second: 251.1e6,
        };
        let options = PlanOptions {
            devices: 2,
            batch_size: 32,
        };
        for layout in ["dp=2", "pp=2,m=4", "pp=2,m=8"] {
            let l: super::Layout = layout.parse().unwrap();
            let e = evaluate_layout(&model, &profile, &options, &l).unwrap();
            let plan = accounting::job_plan(&g, &train, "pixels", "labels", &l, 32).unwrap();
            let job = runtime::predict(&plan, 32 / l.mesh.dp, &e, &profile).unwrap();
            let gap = e.time.total() / job.total() - 1.0;
            assert!(
                gap.abs() < 0.15,
                "{layout}: table {} s, job plan {} s",
                e.time.total(),
                job.total()
            );
        }
    }

    /// A job plan's collectives over its tensor-parallel groups (`tensor*`), every task
    /// summed: bytes and messages, as [`super::super::accounting::traffic`] counts them.
    fn tensor_job_traffic(plan: &crate::strategy::JobPlan, rows: usize) -> (u64, u64) {
        use super::super::accounting;
        use crate::planner::collective::{rank_bytes, rank_messages, Call};
        let (mut bytes, mut messages) = (0u64, 0u64);
        for sig in plan.train_signatures() {
            for (device, part) in &sig.partitions.partitions {
                let task = device.task_name().unwrap();
                let f = accounting::with_rows(&part.graph, rows).unwrap();
                for i in f.node_indices() {
                    let node = f.node(i);
                    let call = match node.op {
                        "CollectiveAllReduce" | "CollectiveTpReduce" => Call::AllReduce,
                        "CollectiveReduceScatter" => Call::ReduceScatter,
                        "CollectiveAllGather" => Call::AllGather,
                        "CollectiveAllToAll" => Call::AllToAll,
                        _ => continue,
                    };
                    let Some(dflow_graph::AttrValue::String(key)) = node.attr("group_key") else {
                        continue;
                    };
                    if !key.starts_with("tensor") {
                        continue;
                    }
                    let group = plan.groups.iter().find(|x| x.key == *key).unwrap();
                    let n = group.members.len();
                    let rank = group.members.iter().position(|m| *m == task).unwrap();
                    let (src, k) = f.inputs(i)[0];
                    let t = &f.node(src).outputs[k];
                    let elements = t.shape.num_elements().unwrap();
                    let size = t.dtype.size_of();
                    bytes += rank_bytes(call, n, rank, elements, size);
                    messages += rank_messages(call, n, rank, elements, size) as u64;
                }
            }
        }
        (bytes, messages)
    }

    /// The table's tensor-parallel bytes and messages are the job plan's collectives over its
    /// `tensor*` groups, every task summed, exactly: dflow's `f`/`g` (two all-reduces per
    /// dense block forward, two backward), the vocabulary-parallel embedding's `g`, the tied
    /// head's `f`, the split cross-entropy's three all-reduces of its per-row values (the
    /// max, `Σ exp`, the target's logit; not its gradient output), the column-parallel
    /// products' input gradients at the size of that input alone (not a layer norm's other
    /// outputs), and under clipping each device's squared norm of its shards once per step.
    /// For the bundled GPT over tp, dp × tp and pipelines (1 and 2 micro-batches, ZeRO too),
    /// and the MoE GPT over dp × tp × ep (no all-reduce around an MoE MLP).
    #[test]
    fn the_tensor_parallel_bytes_and_messages_are_the_job_plans() {
        use super::super::accounting;
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/gpt/gpt.json");
        let text = std::fs::read_to_string(path).unwrap();
        let def = dflow_graph::format::parse_json(&text, None).unwrap().def;
        let moe = small_moe_gpt(|c| {
            c.grad_clip = Some(1.0);
        });
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let cases: Vec<(&dflow_graph::GraphDef, &str)> = vec![
            (&def, "tp=2"),
            (&def, "tp=4"),
            (&def, "dp=2,tp=2"),
            (&def, "dp=2,tp=2,zero=1"),
            (&def, "dp=2,tp=2,zero=3"),
            (&def, "tp=2,pp=2,m=1"),
            (&def, "tp=2,pp=2,m=2"),
            (&def, "dp=2,tp=2,pp=2,m=1"),
            (&def, "dp=2,tp=2,pp=2,m=2"),
            (&def, "dp=2,tp=2,pp=2,m=2,zero=2"),
            (&moe, "dp=2,tp=2,ep=2"),
            (&moe, "dp=2,tp=2,ep=2,zero=2"),
            (&moe, "dp=2,tp=2,ep=2,zero=3"),
            (&moe, "dp=4,tp=2,ep=2,zero=3"),
        ];
        for (def, layout) in cases {
            let model = ModelProfile::new(def, "idx", "targets").unwrap();
            let g = dflow_graph::Graph::from_def(def).unwrap();
            let train = def.train.clone().unwrap();
            let l: super::Layout = layout.parse().unwrap();
            let options = PlanOptions {
                devices: l.mesh.size(),
                batch_size: 8,
            };
            let e = evaluate_layout(&model, &profile, &options, &l).unwrap();
            let plan = accounting::job_plan(&g, &train, "idx", "targets", &l, 8).unwrap();
            let (bytes, messages) = tensor_job_traffic(&plan, 8 / l.mesh.dp);
            let tp = e.traffic.tensor_parallel;
            assert!(bytes > 0, "{layout}");
            assert_eq!(tp.intra_bytes + tp.inter_bytes, bytes as f64, "{layout}");
            assert_eq!(e.tensor_parallel_messages, messages as f64, "{layout}");
        }
    }

    /// Tensor parallelism inside pipeline stages: the table's bytes between stages are the
    /// job plan's Send/Recv pairs, every task summed, exactly: each tp rank sends its
    /// replica's activations whole, its shard of the tied embedding (and gets its shard's
    /// gradient back) and its vocabulary ids (`tp/vocab_ids`) to the loss's stage once per
    /// step; and the table's collectives (tensor- and data-parallel) are the job plan's, at
    /// ZeRO-3 too (the 3D job gathers the tied embedding on stage 0 for no backward pass: its
    /// one-hot lookup does not read it, the head on the last stage reads the copy it was sent).
    #[test]
    fn tp_pp_bytes_between_stages_are_the_job_plans() {
        use super::super::accounting;
        let cfg = GptConfig {
            vocab_size: 76,
            block_size: 8,
            n_layer: 2,
            n_head: 4,
            n_embd: 32,
            grad_clip: Some(0.5),
            ..GptConfig::default()
        };
        let def = gpt(&cfg).unwrap().def;
        let model = ModelProfile::new(&def, "idx", "targets").unwrap();
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        let bytes = |c: super::CommCost| c.intra_bytes + c.inter_bytes;
        for layout in [
            "dp=2,pp=2,m=2",
            "tp=2,pp=2,m=1",
            "tp=2,pp=2,m=2",
            "dp=2,tp=2,pp=2,m=2",
            "dp=2,tp=2,pp=2,m=2,zero=1",
            "dp=2,tp=2,pp=2,m=2,zero=2",
            "dp=2,tp=2,pp=2,m=2,zero=3",
        ] {
            let l: super::Layout = layout.parse().unwrap();
            let options = PlanOptions {
                devices: l.mesh.size(),
                batch_size: 4,
            };
            let e = evaluate_layout(&model, &profile, &options, &l).unwrap();
            let plan = accounting::job_plan(&g, &train, "idx", "targets", &l, 4).unwrap();
            let tasks = accounting::traffic(&plan, 4 / l.mesh.dp).unwrap();
            let sent: u64 = tasks.iter().map(|t| t.data_plane).sum();
            let collective: u64 = tasks.iter().map(|t| t.collective).sum();
            assert_eq!(bytes(e.traffic.pipeline), sent as f64, "{layout}");
            let table = bytes(e.traffic.tensor_parallel) + bytes(e.traffic.data_parallel);
            assert_eq!(table, collective as f64, "{layout}");
        }
    }

    /// A vocabulary no tp divides (33 at tp = 2 and 4): `--strategy tensor` pads it with zero
    /// rows to a multiple of tp (34, 36), and the planner ranks those layouts at the padded
    /// vocabulary: every task's variables are its stage's weights and optimizer state (within
    /// `adam/t`'s 8 bytes), and the tensor-parallel bytes and messages, the collectives
    /// (tensor- and data-parallel, ZeRO 0 to 3) and the bytes between stages (the tied
    /// embedding's padded shard, the padded vocabulary ids) are the job plan's, every task
    /// summed; for the MoE GPT of 33 tokens beside tp too (`dp=2,tp=2,ep=2` at ZeRO-3, the
    /// 4-axis `dp=2,tp=2,pp=2,ep=2` at ZeRO-2). A tp the heads do not divide is still refused.
    #[test]
    fn a_vocabulary_tp_does_not_divide_is_padded_as_the_job_plan_pads_it() {
        use super::super::accounting;
        let def = gpt(&GptConfig {
            vocab_size: 33,
            block_size: 8,
            n_layer: 2,
            n_head: 4,
            n_embd: 16,
            grad_clip: Some(1.0),
            ..GptConfig::default()
        })
        .unwrap()
        .def;
        let model = ModelProfile::new(&def, "idx", "targets").unwrap();
        assert_eq!(model.vocabulary, Some(33));
        assert_eq!(model.padded_vocabulary(2), Some(34));
        assert_eq!(model.padded_vocabulary(4), Some(36));
        let profile = ClusterProfile::preset("this-machine").unwrap();
        let g = dflow_graph::Graph::from_def(&def).unwrap();
        let train = def.train.clone().unwrap();
        let bytes = |c: super::CommCost| c.intra_bytes + c.inter_bytes;
        for layout in [
            "tp=2",
            "tp=4",
            "dp=2,tp=2",
            "dp=2,tp=2,zero=1",
            "dp=2,tp=2,zero=2",
            "dp=2,tp=2,zero=3",
            "tp=2,pp=2,m=2",
            "dp=2,tp=2,pp=2,m=2",
            "dp=2,tp=2,pp=2,m=2,zero=2",
            "dp=2,tp=2,pp=2,m=2,zero=3",
        ] {
            let l: super::Layout = layout.parse().unwrap();
            let options = PlanOptions {
                devices: l.mesh.size(),
                batch_size: 8,
            };
            let e = evaluate_layout(&model, &profile, &options, &l).unwrap();
            let rows = 8 / l.mesh.dp;
            let plan = accounting::job_plan(&g, &train, "idx", "targets", &l, 8).unwrap();
            let tasks = accounting::account(&plan, rows, 1).unwrap();
            assert_eq!(tasks.len(), l.mesh.size(), "{layout}");
            for t in &tasks {
                let index: usize = t.task.rsplit(':').next().unwrap().parse().unwrap();
                let (_, _, s) = l.mesh.coords(index);
                let held = t.variable_bytes as f64;
                let predicted = e.memory[s].weights + e.memory[s].optimizer;
                assert!(
                    (held - predicted).abs() <= 8.0,
                    "{layout}, {} (stage {s}): held {held}, predicted {predicted}",
                    t.task
                );
            }
            let (tp, messages) = tensor_job_traffic(&plan, rows);
            assert_eq!(bytes(e.traffic.tensor_parallel), tp as f64, "{layout}");
            assert_eq!(e.tensor_parallel_messages, messages as f64, "{layout}");
            let traffic = accounting::traffic(&plan, rows).unwrap();
            let sent: u64 = traffic.iter().map(|t| t.data_plane).sum();
            let collective: u64 = traffic.iter().map(|t| t.collective).sum();
            assert_eq!(bytes(e.traffic.pipeline), sent as f64, "{layout}");
            let table = bytes(e.traffic.tensor_parallel) + bytes(e.traffic.data_parallel);
            assert_eq!(table, collective as f64, "{layout}");
        }
        // The MoE GPT of 33 tokens beside tp (`dp=2,tp=2,ep=2`, the tensor strategy with ep;
        // `dp=2,tp=2,pp=2,ep=2`, the 4-axis mesh): padded the same way.
        let moe = small_moe_gpt(|c| {
            c.vocab_size = 33;
            c.grad_clip = Some(1.0);
        });
        let moe_model = ModelProfile::new(&moe, "idx", "targets").unwrap();
        assert_eq!(moe_model.vocabulary, Some(33));
        let g = dflow_graph::Graph::from_def(&moe).unwrap();
        let train = moe.train.clone().unwrap();
        for layout in ["dp=2,tp=2,ep=2,zero=3", "dp=2,tp=2,pp=2,ep=2,m=1,zero=2"] {
            let sums = assert_staged_experts_are_the_job_plans(&moe_model, &g, &train, layout);
            assert!(sums.all_to_all > 0 && sums.tensor > 0, "{layout}");
        }
        // The heads (4) are not padded: tp = 8 is refused naming them.
        let l: super::Layout = "tp=8".parse().unwrap();
        let options = PlanOptions {
            devices: 8,
            batch_size: 8,
        };
        let e = evaluate_layout(&model, &profile, &options, &l)
            .unwrap_err()
            .to_string();
        assert!(e.contains("heads"), "{e}");
    }
}
