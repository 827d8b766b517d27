//! A model cut into pipeline stages the way `--strategy pipeline --stages N` cuts it
//! ([`crate::strategy::pipeline::stages::balanced`]), summed per stage: parameters, FLOPs,
//! activations and tensor-parallel all-reduces, and every tensor that crosses between stages
//! (once per reading stage, as the pipeline rewrite sends it).

use super::model::{ModelProfile, PerRows, TpRole};
use crate::strategy::pipeline::stages::balanced;
use crate::strategy::pipeline::PipelineError;
use std::collections::BTreeSet;

/// One stage's sums.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageCosts {
    /// Parameter elements split by tensor parallelism.
    pub params_split: f64,
    /// Parameter elements every tensor-parallel rank holds whole.
    pub params_whole: f64,
    /// Of [`Self::params_split`], the elements the backward pass reads (ZeRO-3 gathers them
    /// again for it).
    pub backward_split: f64,
    /// Of [`Self::params_whole`], the elements the backward pass reads.
    pub backward_whole: f64,
    /// Under tensor parallelism, of [`Self::backward_split`], the elements the backward pass
    /// reads on this stage: through an op of this stage other than the vocabulary-parallel
    /// lookup (a one-hot product, whose gradient does not read the table); not a tied
    /// embedding read only by the head on another stage (the tensor strategy's ZeRO-3 inside
    /// pipeline stages gathers nothing for it there).
    pub backward_split_tp: f64,
    /// Under tensor parallelism, of [`Self::backward_whole`], those read on this stage.
    pub backward_whole_tp: f64,
    /// Under tensor parallelism, the variables the backward pass reads on this stage.
    pub backward_variables_tp: f64,
    /// Variables of the stage.
    pub variables: f64,
    /// Of them, those the backward pass reads.
    pub backward_variables: f64,
    /// Forward FLOPs of ops divided over the tensor-parallel ranks.
    pub flops_split: PerRows,
    /// Forward FLOPs of replicated ops.
    pub flops_whole: PerRows,
    /// Output bytes of divided batch ops (the activations a micro-batch leaves for backward).
    pub act_split: PerRows,
    /// Output bytes of replicated batch ops.
    pub act_whole: PerRows,
    /// Tensor-parallel all-reduces of the forward pass, one entry each.
    pub tp_forward: Vec<PerRows>,
    /// Tensor-parallel all-reduces of the backward pass.
    pub tp_backward: Vec<PerRows>,
    /// Forward ops (variables and constants included).
    pub ops: f64,
    /// Parameter elements of MoE experts (part of `params_whole`).
    pub params_expert: f64,
    /// Expert variables.
    pub expert_variables: usize,
    /// Of [`Self::params_expert`], the elements the backward pass reads.
    pub backward_expert: f64,
    /// Of the expert variables, those the backward pass reads.
    pub backward_expert_variables: f64,
    /// The MoE layers on this stage (indices into the model's `moe`).
    pub moe: Vec<usize>,
    /// The load-balancing losses on this stage (indices into the model's `aux_losses`): beside
    /// `ep > 1` their inputs are all-gathered over the stage's data-parallel group.
    pub aux_losses: Vec<usize>,
    /// ZeRO-3 over a pipeline: the expert variables' gathers (see [`PassGathers`]).
    pub expert_gathers: PassGathers,
}

/// What ZeRO-3 over a pipeline gathers of a set of variables, as
/// `strategy/pipeline/zero.rs` places the gathers (`Passes::use_of`): a variable a
/// micro-batch's forward copy reads (a batch op) is gathered for every micro-batch's forward
/// pass, one read by an op the micro-batches share (an expert bias's reshape) once per step
/// for the forward passes; likewise for the backward pass by where the gradient ops that read
/// it belong. Each sum counts a variable once per pass that gathers it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassGathers {
    /// Elements gathered for each micro-batch (forward and backward passes summed).
    pub per_micro_batch: f64,
    /// Gather calls for each micro-batch (one per variable and pass).
    pub calls_per_micro_batch: f64,
    /// Elements gathered once per step for the ops the micro-batches share.
    pub per_step: f64,
    /// Gather calls once per step.
    pub calls_per_step: f64,
}

impl PassGathers {
    /// Adds a variable of `elements` whose readers in each pass are `batch` (a micro-batch's
    /// copy) or shared (the rest): `forward` and `backward` list the readers' kinds.
    fn add(&mut self, elements: f64, forward: &[bool], backward: &[bool]) {
        for pass in [forward, backward] {
            if pass.iter().any(|&batch| batch) {
                self.per_micro_batch += elements;
                self.calls_per_micro_batch += 1.0;
            }
            if pass.iter().any(|&batch| !batch) {
                self.per_step += elements;
                self.calls_per_step += 1.0;
            }
        }
    }

    /// `self + other`.
    pub fn plus(self, other: PassGathers) -> PassGathers {
        PassGathers {
            per_micro_batch: self.per_micro_batch + other.per_micro_batch,
            calls_per_micro_batch: self.calls_per_micro_batch + other.calls_per_micro_batch,
            per_step: self.per_step + other.per_step,
            calls_per_step: self.calls_per_step + other.calls_per_step,
        }
    }
}

/// The tensor whose gradient is output `out` of `node`'s, as dflow's autodiff builds it: while
/// its one reader is an `AddN`, or an `Add` of an input of the output's static shape, the
/// reader's gradient passes through unchanged (no `ReduceToShapeOf`), so the gradient of each
/// of the MoE layers' load-balancing losses added into the loss is the loss's, and a pipeline
/// sends it back once. (An `Add` of a tensor that does not depend on the batch to one that does
/// broadcasts at more rows than the model's one: not passed.)
fn gradient_of(
    model: &ModelProfile,
    mut node: petgraph::graph::NodeIndex,
    mut out: usize,
) -> (petgraph::graph::NodeIndex, usize) {
    let g = &model.graph;
    loop {
        let readers: Vec<_> = g
            .out_edges(node)
            .into_iter()
            .filter(|(_, e)| {
                matches!(e, dflow_graph::Edge::Data { src_output, .. } if *src_output == out)
            })
            .map(|(r, _)| r)
            .collect();
        let [reader] = readers[..] else {
            return (node, out);
        };
        let r = g.node(reader);
        let shape = &g.node(node).outputs[out].shape;
        let passes = match r.op {
            "AddN" => true,
            "Add" => {
                model.ops[node.index()].batch == model.ops[reader.index()].batch
                    && r.outputs
                        .first()
                        .is_some_and(|o| shape.is_static() && o.shape == *shape)
            }
            _ => false,
        };
        if !passes {
            return (node, out);
        }
        (node, out) = (reader, 0);
    }
}

/// A tensor sent from one stage to another.
#[derive(Clone, Debug, PartialEq)]
pub struct Crossing {
    /// The sending stage.
    pub from: usize,
    /// The reading stage.
    pub to: usize,
    /// Its bytes.
    pub bytes: PerRows,
    /// Whether it is split over the tensor-parallel ranks.
    pub split: bool,
    /// Whether its gradient is sent back.
    pub gradient: bool,
    /// A weight: sent once per step, not once per micro-batch.
    pub per_step: bool,
}

/// A model cut into stages.
#[derive(Clone, Debug, PartialEq)]
pub struct StagedModel {
    /// Per stage, in order.
    pub stages: Vec<StageCosts>,
    /// Every crossing tensor.
    pub crossings: Vec<Crossing>,
    /// Under tensor parallelism only: the vocabulary-parallel embedding's ids, sent once per
    /// step from the lookup's stage to the split cross-entropy's (see `vocab_ids_crossing`).
    pub vocab_ids: Option<Crossing>,
    /// Scalar bytes each later stage exchanges with the first per step (the clipping norm and
    /// scale, the optimizer's step count).
    pub scalars_per_later_stage: f64,
}

impl StagedModel {
    /// Cuts `model` into `stages` stages (1: the whole model, no cut).
    pub fn new(model: &ModelProfile, stages: usize) -> Result<StagedModel, PipelineError> {
        StagedModel::at_tp(model, stages, 1)
    }

    /// [`Self::new`] for a tensor-parallel size `tp`: every vocabulary-split tensor (the
    /// vocabulary-parallel table, an untied head's weight, the logits; `OpProfile::vocab_split`)
    /// at the vocabulary padded to a multiple of `tp`, as `--strategy tensor` runs it
    /// ([`ModelProfile::padded_vocabulary`]): its elements, bytes and FLOPs, and the
    /// vocabulary ids sent to the loss's stage.
    pub fn at_tp(
        model: &ModelProfile,
        stages: usize,
        tp: usize,
    ) -> Result<StagedModel, PipelineError> {
        let g = &model.graph;
        let padding = model.vocabulary_padding(tp);
        let pad = |node: petgraph::graph::NodeIndex| {
            if model.ops[node.index()].vocab_split {
                padding
            } else {
                1.0
            }
        };
        let stage_of: Vec<usize> = if stages <= 1 {
            vec![0; g.num_nodes()]
        } else {
            balanced(g, &model.feeds, stages)?.stage
        };
        let mut costs = vec![StageCosts::default(); stages.max(1)];
        for var in &model.variables {
            let s = &mut costs[stage_of[var.node.index()]];
            let elements = var.elements * pad(var.node);
            if var.split {
                s.params_split += elements;
            } else {
                s.params_whole += var.elements;
            }
            if var.expert {
                s.params_expert += var.elements;
                s.expert_variables += 1;
                let forward: Vec<bool> = g
                    .out_edges(var.node)
                    .into_iter()
                    .filter(|(_, e)| matches!(e, dflow_graph::Edge::Data { .. }))
                    .map(|(r, _)| model.ops[r.index()].batch)
                    .collect();
                let backward: Vec<bool> = var
                    .backward_readers
                    .iter()
                    .map(|r| model.ops[r.index()].batch)
                    .collect();
                s.expert_gathers.add(var.elements, &forward, &backward);
            }
            s.variables += 1.0;
            let home = stage_of[var.node.index()];
            let read_here_tp = var.backward_readers.iter().any(|r| {
                stage_of[r.index()] == home && model.ops[r.index()].role != TpRole::VocabParallel
            });
            if read_here_tp {
                s.backward_variables_tp += 1.0;
                if var.split {
                    s.backward_split_tp += elements;
                } else {
                    s.backward_whole_tp += var.elements;
                }
            }
            if var.backward_read {
                s.backward_variables += 1.0;
                if var.split {
                    s.backward_split += elements;
                } else {
                    s.backward_whole += var.elements;
                }
                if var.expert {
                    s.backward_expert += var.elements;
                    s.backward_expert_variables += 1.0;
                }
            }
        }
        for (k, l) in model.moe.iter().enumerate() {
            if let Some(i) = g.find(&l.dispatch) {
                costs[stage_of[i.index()]].moe.push(k);
            }
        }
        for (k, a) in model.aux_losses.iter().enumerate() {
            costs[stage_of[a.node.index()]].aux_losses.push(k);
        }
        for op in &model.ops {
            let s = &mut costs[stage_of[op.node.index()]];
            s.ops += 1.0;
            let grown = |x: PerRows| {
                let f = pad(op.node);
                PerRows {
                    fixed: x.fixed * f,
                    per_row: x.per_row * f,
                }
            };
            if op.role.divided() {
                s.flops_split = s.flops_split.plus(grown(op.flops));
            } else {
                s.flops_whole = s.flops_whole.plus(op.flops);
            }
            if op.batch {
                if op.split_output {
                    s.act_split = s.act_split.plus(grown(op.out_bytes));
                } else {
                    s.act_whole = s.act_whole.plus(op.out_bytes);
                }
            }
            for _ in 0..op.tp_forward_calls() {
                s.tp_forward.push(op.tp_forward);
            }
            if op.tp_backward != PerRows::default() {
                s.tp_backward.push(op.tp_backward);
            }
        }
        let mut crossings = Vec::new();
        // The gradients already sent back to a stage, by the tensor whose gradient they are
        // (`gradient_of`): one send each.
        let mut gradients_sent: BTreeSet<(usize, usize, usize)> = BTreeSet::new();
        if stages > 1 {
            for idx in g.node_indices() {
                let node = g.node(idx);
                let op = &model.ops[idx.index()];
                let variable = model.variable_of[idx.index()].is_some();
                if !(op.batch || variable) {
                    continue;
                }
                let from = stage_of[idx.index()];
                let mut readers: BTreeSet<(usize, usize)> = BTreeSet::new();
                for (dst, edge) in g.out_edges(idx) {
                    if let dflow_graph::Edge::Data { src_output, .. } = edge {
                        let to = stage_of[dst.index()];
                        if to != from {
                            readers.insert((src_output, to));
                        }
                    }
                }
                let total1: f64 = node
                    .outputs
                    .iter()
                    .map(|t| t.byte_size().unwrap_or(0) as f64)
                    .sum();
                for (out, to) in readers {
                    let t = &node.outputs[out];
                    let share = if total1 > 0.0 {
                        t.byte_size().unwrap_or(0) as f64 / total1
                    } else {
                        0.0
                    };
                    crossings.push(Crossing {
                        from,
                        to,
                        bytes: PerRows {
                            fixed: op.out_bytes.fixed * share * pad(idx),
                            per_row: op.out_bytes.per_row * share * pad(idx),
                        },
                        // A shared weight split by tensor parallelism (the tied embedding):
                        // each tp rank sends its shard (and gets its shard's gradient back).
                        split: op.split_output
                            || model.variable_of[idx.index()]
                                .is_some_and(|v| model.variables[v].split),
                        gradient: t.dtype.is_float() && op.needs_gradient && {
                            let (n, k) = gradient_of(model, idx, out);
                            gradients_sent.insert((from, n.index(), k))
                        },
                        per_step: variable,
                    });
                }
            }
        }
        let vocab_ids = if stages > 1 {
            vocab_ids_crossing(model, &stage_of, tp)
        } else {
            None
        };
        let scalars =
            if model.clips { 8.0 } else { 0.0 } + if model.step_count { 8.0 } else { 0.0 };
        Ok(StagedModel {
            stages: costs,
            crossings,
            vocab_ids,
            scalars_per_later_stage: scalars,
        })
    }

    /// Bytes sent between the stages of one pipeline replica per step, with `micro_batches`
    /// of `rows` rows each, without tensor parallelism: what the job plan's Send/Recv pairs
    /// carry.
    pub fn bytes_per_step(&self, micro_batches: usize, rows: f64) -> f64 {
        let m = micro_batches as f64;
        let mut total = 0.0;
        for c in &self.crossings {
            let once = c.bytes.at(rows) * if c.gradient { 2.0 } else { 1.0 };
            total += if c.per_step { once } else { m * once };
        }
        total + (self.stages.len().saturating_sub(1)) as f64 * self.scalars_per_later_stage
    }
}

/// The vocabulary-parallel embedding's ids under tensor parallelism (`tp/vocab_ids` of
/// `strategy/tensor.rs`: the `V/T` int64 ids of the rank's rows, a constant the lookup and the
/// split cross-entropy both read): placed with the lookup, sent once per step to the
/// cross-entropy's stage when that is another (each tp rank its own `V/T`, of the vocabulary
/// padded to a multiple of `tp`; no gradient).
fn vocab_ids_crossing(model: &ModelProfile, stage_of: &[usize], tp: usize) -> Option<Crossing> {
    let g = &model.graph;
    let lookup = model.ops.iter().find(|o| o.role == TpRole::VocabParallel)?;
    let loss = model
        .ops
        .iter()
        .find(|o| o.role == TpRole::SplitReduction)?;
    let (from, to) = (stage_of[lookup.node.index()], stage_of[loss.node.index()]);
    if from == to {
        return None;
    }
    let (table, _) = g.inputs(lookup.node).first().copied()?;
    let rows = *g.node(table).outputs.first()?.shape.as_static()?.first()?;
    let vocab = model.padded_vocabulary(tp).unwrap_or(rows);
    Some(Crossing {
        from,
        to,
        bytes: PerRows {
            fixed: (vocab * 8) as f64,
            per_row: 0.0,
        },
        split: true,
        gradient: false,
        per_step: true,
    })
}
