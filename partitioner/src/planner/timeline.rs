//! A simulated step of a layout as a Chrome trace (`chrome://tracing`, Perfetto): each pipeline
//! stage's forward and backward passes in the schedule's order, timed by the cost model
//! (forward a third of a slot, backward two thirds, as the FLOPs split), then the data-parallel
//! collectives. Nothing runs: [`schedule::simulate`] places the units.

use super::evaluate::Evaluation;
use crate::strategy::pipeline::schedule::{self, Phase, PipelineShape};
use serde_json::{json, Value};

/// The trace of one simulated step of `e` (a JSON object with `traceEvents`).
pub fn chrome_trace(e: &Evaluation) -> Result<Value, String> {
    let l = &e.layout;
    let shape = PipelineShape {
        stages: l.mesh.pp,
        micro_batches: l.micro_batches,
        chunks: l.chunks,
    };
    let orders = schedule::orders(l.schedule, shape).map_err(|e| e.to_string())?;
    // Ticks of one nanosecond; a chunk's share of the slot.
    let per_chunk = (e.slot / l.chunks as f64 * 1e9).max(3.0);
    let fwd = (per_chunk / 3.0).round().max(1.0) as u64;
    let bwd = (2.0 * per_chunk / 3.0).round().max(1.0) as u64;
    let sim = schedule::simulate(shape, &orders, fwd, bwd).map_err(|e| e.to_string())?;
    let mut events = Vec::new();
    for (stage, units) in sim.timeline.iter().enumerate() {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": stage,
            "args": {"name": format!("stage {stage}")}
        }));
        for (start, unit) in units {
            let dur = match unit.phase {
                Phase::Forward => fwd,
                Phase::Backward => bwd,
            };
            events.push(json!({
                "name": unit.to_string(),
                "cat": match unit.phase { Phase::Forward => "forward", Phase::Backward => "backward" },
                "ph": "X", "pid": 0, "tid": stage,
                "ts": *start as f64 / 1e3, "dur": dur as f64 / 1e3,
                "args": {"micro_batch": unit.micro, "chunk": unit.chunk}
            }));
        }
        // ZeRO-3's gathers are inside each unit already (part of the slot).
        let after = e.time.data_parallel - e.slot_gathers * l.micro_batches as f64;
        if after > 0.0 {
            events.push(json!({
                "name": "data-parallel gradients", "cat": "collective",
                "ph": "X", "pid": 0, "tid": stage,
                "ts": sim.makespan as f64 / 1e3, "dur": after * 1e6,
            }));
        }
    }
    Ok(json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"layout": l.to_string(), "predicted_step_seconds": e.time.total()}
    }))
}
