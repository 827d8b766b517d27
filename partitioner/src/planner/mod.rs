//! `dflow plan`: choose how to spread a model over N devices before anything runs.
//!
//! The planner reads every op, shape and variable of the model ([`model`]), enumerates the
//! layouts `dp × tp × pp` over the devices (with ZeRO stages 0–3 over the data-parallel group
//! and the micro-batches that divide the batch; [`layout`]; for a model with MoE layers also
//! `dp × ep` and `dp × tp × ep`, the experts spread over expert-parallel groups of `ep` ranks), predicts each one's memory per
//! device, bytes per step per link class and step time ([`evaluate`], with the collectives'
//! costs from the algorithms dflow runs in [`collective`] and the pipeline cut the way the
//! pipeline strategy cuts it in [`staging`]), prunes those that do not fit in memory, and ranks
//! the rest by predicted step time. [`render`] prints the table and one layout in detail;
//! [`timeline`] writes a simulated step as a Chrome trace.
//!
//! ```
//! use dflow_graph::layers::gpt::{gpt, GptConfig};
//! use dflow_partitioner::planner::{plan, ClusterProfile, ModelProfile, PlanOptions};
//!
//! let cfg = GptConfig { vocab_size: 32, block_size: 8, n_layer: 2, n_head: 2, n_embd: 16, ..GptConfig::default() };
//! let model = ModelProfile::new(&gpt(&cfg).unwrap().def, "idx", "targets").unwrap();
//! let profile = ClusterProfile::preset("this-machine").unwrap();
//! let report = plan(&model, &profile, &PlanOptions { devices: 2, batch_size: 8 }).unwrap();
//! let best = report.best().unwrap();
//! assert!(best.fits);
//! assert_eq!(best.layout.mesh.size(), 2);
//! ```

pub mod accounting;
pub mod collective;
pub mod evaluate;
mod executor_order;
pub mod fit;
pub mod flops;
pub mod layout;
pub mod model;
pub mod profile;
pub mod render;
pub mod runtime;
pub mod staging;
pub mod timeline;

pub use evaluate::{Evaluation, LayoutRefused, Memory, StepTime, Traffic};
pub use layout::Layout;
pub use model::{ModelError, ModelProfile};
pub use profile::{ClusterProfile, JobCosts, Link, LinkClass, Precision, ProfileError};

use crate::mesh::Mesh;
use crate::strategy::pipeline::PipelineError;
use evaluate::Context;
use staging::StagedModel;
use std::collections::BTreeMap;

/// What to plan for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Devices.
    pub devices: usize,
    /// The global batch (rows per step).
    pub batch_size: usize,
}

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// Zero devices or batch.
    #[error("{what} must be at least 1")]
    Zero {
        /// `--devices` or `--batch-size`.
        what: &'static str,
    },
    /// More devices than the planner enumerates.
    #[error("--devices {devices}: the planner handles up to {MAX_DEVICES} devices")]
    TooManyDevices {
        /// The devices asked for.
        devices: usize,
    },
    /// The layout asked for cannot run the model.
    #[error(transparent)]
    Refused(#[from] LayoutRefused),
    /// The model cannot be cut into the stages asked for.
    #[error("layout {layout}: {source}")]
    Stages {
        /// The layout.
        layout: String,
        /// Why.
        source: PipelineError,
    },
}

/// The most devices [`plan`] takes (each layout costs time linear in the devices).
pub const MAX_DEVICES: usize = 1 << 16;

/// The most micro-batches a layout may have (the enumeration stops at `max(64, 8·pp)`).
pub const MAX_MICRO_BATCHES: usize = 1 << 16;

/// Every layout tried, ranked.
#[derive(Debug, Clone)]
pub struct PlanReport {
    /// Devices.
    pub devices: usize,
    /// The global batch.
    pub batch_size: usize,
    /// Parameter elements of the model.
    pub parameters: f64,
    /// Layouts that fit, fastest first (within 1%: the simpler layout, less memory, the name).
    pub ranked: Vec<Evaluation>,
    /// Layouts that do not fit in memory, least memory first.
    pub too_big: Vec<Evaluation>,
    /// Layouts that cannot run the model at all, with the reason.
    pub refused: Vec<LayoutRefused>,
}

impl PlanReport {
    /// The fastest layout that fits.
    pub fn best(&self) -> Option<&Evaluation> {
        self.ranked.first()
    }
}

/// Cuts of the model by number of virtual stages and padded vocabulary (the tensor strategy
/// pads the vocabulary to a multiple of tp: [`ModelProfile::padded_vocabulary`]), made once
/// each.
#[derive(Debug, Default)]
struct Cuts(BTreeMap<(usize, Option<usize>), Result<StagedModel, PipelineError>>);

impl Cuts {
    fn get(
        &mut self,
        model: &ModelProfile,
        stages: usize,
        tp: usize,
    ) -> &Result<StagedModel, PipelineError> {
        self.0
            .entry((stages, model.padded_vocabulary(tp)))
            .or_insert_with(|| StagedModel::at_tp(model, stages, tp))
    }
}

/// Every layout over `devices` devices the enumeration tries: each `pp` dividing the devices,
/// each `tp` dividing the rest up to a host's devices, `dp` the rest; ZeRO 0–3 with `dp > 1`
/// (over a pipeline too: `--mesh dp=D,pp=P --zero-stage 1|2|3` runs); with a pipeline, every micro-batch count up to
/// `max(64, 8·pp)` that divides a replica's batch, under 1F1B. A model without experts.
pub fn layouts(devices: usize, batch: usize, per_host: usize) -> Vec<Layout> {
    layouts_with_experts(devices, batch, per_host, &[1])
}

/// [`layouts`], and for a model with experts (`ep_sizes`: the expert-parallel sizes its MoE
/// layers split over, [`ModelProfile::ep_sizes`]) every `dp × ep` layout: `ep > 1` dividing
/// `dp` and every layer's experts, with ZeRO 0–3 (the dense states over `dp`, the
/// experts' over their expert-data-parallel groups) when `pp = 1`, with one micro-batch and
/// ZeRO 0–3 inside pipeline stages, and beside `tp > 1` (`dp × tp × ep`, and inside pipeline
/// stages the 4-axis `dp × tp × pp × ep` with one micro-batch) with ZeRO 0–3.
pub fn layouts_with_experts(
    devices: usize,
    batch: usize,
    per_host: usize,
    ep_sizes: &[usize],
) -> Vec<Layout> {
    layouts_with_expert_micro_batches(devices, batch, per_host, ep_sizes, false)
}

/// [`layouts_with_experts`], and when `micro_batched_experts` (no MoE router couples a batch's
/// examples: [`ModelProfile::batch_coupled`] is `None`) the `ep × pp` layouts (beside tp too)
/// with every micro-batch count a dense pipeline gets, as `dflow run` runs them.
pub fn layouts_with_expert_micro_batches(
    devices: usize,
    batch: usize,
    per_host: usize,
    ep_sizes: &[usize],
    micro_batched_experts: bool,
) -> Vec<Layout> {
    let mut out = Vec::new();
    for pp in layout::divisors(devices) {
        for tp in layout::divisors(devices / pp) {
            if tp > per_host {
                continue;
            }
            let dp = devices / pp / tp;
            let Ok(mesh) = Mesh::new(dp, tp, pp) else {
                continue;
            };
            let zeros: &[u8] = if dp > 1 { &[0, 1, 2, 3] } else { &[0] };
            // More micro-batches than max(64, 8·pp) shrink the bubble by little.
            let micro: Vec<usize> = if pp == 1 || batch % dp != 0 {
                vec![1]
            } else {
                layout::divisors(batch / dp)
                    .into_iter()
                    .filter(|&m| m <= (8 * pp).max(64))
                    .collect()
            };
            for &zero in zeros {
                for &m in &micro {
                    out.push(Layout {
                        zero,
                        micro_batches: m,
                        ..Layout::new(mesh)
                    });
                }
            }
            for &ep in ep_sizes.iter().filter(|&&e| e > 1 && dp % e == 0) {
                let Ok(mesh) = mesh.with_ep(ep) else {
                    continue;
                };
                // Inside pipeline stages: one micro-batch where an MoE layer couples a batch's
                // tokens (else every count), ZeRO 0 to 3 (as a dense pipeline's); beside tp
                // ZeRO 0 to 3 too, inside pipeline stages as well (the 4-axis mesh
                // `dp × tp × pp × ep`).
                let counts: &[usize] = if micro_batched_experts { &micro } else { &[1] };
                for zero in 0..=3 {
                    for &m in counts {
                        out.push(Layout {
                            zero,
                            micro_batches: m,
                            ..Layout::new(mesh)
                        });
                    }
                }
            }
        }
    }
    out
}

/// Evaluates one layout (refusing it with the reason when it cannot run the model).
pub fn evaluate_layout(
    model: &ModelProfile,
    profile: &ClusterProfile,
    options: &PlanOptions,
    layout: &Layout,
) -> Result<Evaluation, PlanError> {
    let mut cuts = Cuts::default();
    evaluate_with(model, profile, options, layout, &mut cuts)
}

fn evaluate_with(
    model: &ModelProfile,
    profile: &ClusterProfile,
    options: &PlanOptions,
    layout: &Layout,
    cuts: &mut Cuts,
) -> Result<Evaluation, PlanError> {
    let ctx = Context {
        model,
        profile,
        batch: options.batch_size,
    };
    evaluate::check(&ctx, layout, options.devices)?;
    let staged = match cuts.get(model, layout.mesh.pp * layout.chunks, layout.mesh.tp) {
        Ok(s) => s,
        Err(e) => {
            return Err(PlanError::Stages {
                layout: layout.short(),
                source: e.clone(),
            })
        }
    };
    Ok(evaluate::evaluate(&ctx, layout, staged))
}

/// Step times within about 1% of each other compare equal: below the model's accuracy.
fn percent_bucket(seconds: f64) -> i64 {
    if seconds > 0.0 {
        (seconds.ln() / 1.01f64.ln()).round() as i64
    } else {
        i64::MIN
    }
}

/// Among equally fast layouts, the simpler first: no ZeRO, then fewer tensor-parallel,
/// pipeline and expert-parallel ranks.
fn simplicity(l: &Layout) -> (u8, usize, usize, usize) {
    (l.zero, l.mesh.tp, l.mesh.pp, l.mesh.ep)
}

/// Plans `model` on `options.devices` devices of `profile`: every layout of [`layouts`],
/// evaluated, pruned by memory and ranked by step time. Deterministic.
pub fn plan(
    model: &ModelProfile,
    profile: &ClusterProfile,
    options: &PlanOptions,
) -> Result<PlanReport, PlanError> {
    if options.devices == 0 {
        return Err(PlanError::Zero { what: "--devices" });
    }
    if options.batch_size == 0 {
        return Err(PlanError::Zero {
            what: "--batch-size",
        });
    }
    if options.devices > MAX_DEVICES {
        return Err(PlanError::TooManyDevices {
            devices: options.devices,
        });
    }
    let mut cuts = Cuts::default();
    let mut ranked = Vec::new();
    let mut too_big = Vec::new();
    let mut refused = Vec::new();
    for layout in layouts_with_expert_micro_batches(
        options.devices,
        options.batch_size,
        profile.devices_per_host,
        &model.ep_sizes(),
        model.batch_coupled.is_none(),
    ) {
        match evaluate_with(model, profile, options, &layout, &mut cuts) {
            Ok(e) if e.fits => ranked.push(e),
            Ok(e) => too_big.push(e),
            Err(PlanError::Refused(r)) => refused.push(r),
            Err(PlanError::Stages { layout, source }) => refused.push(LayoutRefused {
                layout,
                reason: source.to_string(),
            }),
            Err(e) => return Err(e),
        }
    }
    ranked.sort_by(|a, b| {
        percent_bucket(a.time.total())
            .cmp(&percent_bucket(b.time.total()))
            .then(simplicity(&a.layout).cmp(&simplicity(&b.layout)))
            .then(a.peak().total().total_cmp(&b.peak().total()))
            .then_with(|| a.layout.to_string().cmp(&b.layout.to_string()))
    });
    too_big.sort_by(|a, b| {
        a.peak()
            .total()
            .total_cmp(&b.peak().total())
            .then_with(|| a.layout.to_string().cmp(&b.layout.to_string()))
    });
    Ok(PlanReport {
        devices: options.devices,
        batch_size: options.batch_size,
        parameters: model.parameters(),
        ranked,
        too_big,
        refused,
    })
}
