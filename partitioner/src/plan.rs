//! The buffer plan: what every Send/Recv pair needs before the first step.
//!
//! A pair with a static shape gets a slot of known size, so the transport can allocate and
//! register it once; a pair whose shape is not static falls back to per-step buffers and is
//! listed in [`BufferPlan::dynamic`] with the reason.

use crate::partition::TransferPair;
use dflow_graph::{DType, DeviceName, RendezvousKey, Shape};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One preallocated receive slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotPlan {
    /// The pair's rendezvous key (shared with the pair's).
    pub key: RendezvousKey,
    /// Element type.
    pub dtype: DType,
    /// The static shape.
    pub shape: Shape,
    /// Bytes per step.
    pub bytes: usize,
    /// Index of this slot (slots are numbered in key order, from 0).
    pub slot: usize,
}

/// Buffers for every pair, known before the first step.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferPlan {
    /// One slot per pair with a static shape, in key order.
    pub slots: Vec<SlotPlan>,
    /// Pairs whose shape is not static: (key, reason).
    pub dynamic: Vec<(String, String)>,
    /// Per partition device, the bytes of static pairs it receives per step (0 if none).
    pub bytes_received_per_step: BTreeMap<DeviceName, usize>,
}

/// Builds the plan for `pairs` (sorted by key). `origin` names the placeholder a dynamic
/// shape comes from, when there is one.
pub(crate) fn build_buffer_plan<'a>(
    pairs: &[TransferPair],
    devices: impl Iterator<Item = &'a DeviceName>,
    mut origin: impl FnMut(&TransferPair) -> Option<String>,
) -> BufferPlan {
    use rayon::prelude::*;
    let client = dflow_graph::ops::transfer::CLIENT_DEVICE;
    // Slots are numbered in key order over the static pairs; copying keys and shapes is the
    // bulk of the work, done in parallel.
    let statics: Vec<(&TransferPair, usize)> =
        pairs.iter().filter_map(|p| Some((p, p.bytes?))).collect();
    let mut plan = BufferPlan {
        slots: statics
            .par_iter()
            .enumerate()
            .map(|(slot, &(p, bytes))| SlotPlan {
                key: p.key.clone(),
                dtype: p.dtype,
                shape: p.shape.clone(),
                bytes,
                slot,
            })
            .collect(),
        ..BufferPlan::default()
    };
    let mut per_device: BTreeMap<&str, usize> = BTreeMap::new();
    // Pairs come sorted by (send device, receive device): sum each run of one receiving device
    // before adding it to the map.
    let mut run: Option<(&str, usize)> = None;
    fn add<'p>(per_device: &mut BTreeMap<&'p str, usize>, (d, bytes): (&'p str, usize)) {
        let e = per_device.entry(d).or_insert(0);
        *e = e.saturating_add(bytes);
    }
    for p in pairs {
        match p.bytes {
            Some(bytes) => {
                if *p.recv_device != *client {
                    match &mut run {
                        Some((d, sum)) if **d == *p.recv_device => *sum = sum.saturating_add(bytes),
                        _ => {
                            if let Some(done) = run.replace((&*p.recv_device, bytes)) {
                                add(&mut per_device, done);
                            }
                        }
                    }
                }
            }
            None => {
                let mut reason = match p.shape.dims() {
                    None => "rank unknown".to_string(),
                    Some(dims) => {
                        let unknown: Vec<String> = dims
                            .iter()
                            .enumerate()
                            .filter(|(_, d)| d.is_none())
                            .map(|(i, _)| i.to_string())
                            .collect();
                        let s = if unknown.len() == 1 { "" } else { "s" };
                        format!("dimension{s} {} unknown", unknown.join(", "))
                    }
                };
                if let Some(ph) = origin(p) {
                    let batch = p.shape.dims().is_some_and(|d| d.first() == Some(&None));
                    if batch {
                        reason.push_str(&format!(": batch size of placeholder {ph}"));
                    } else {
                        reason.push_str(&format!(": from placeholder {ph}"));
                    }
                }
                plan.dynamic.push((p.key.to_string(), reason));
            }
        }
    }
    if let Some(done) = run {
        add(&mut per_device, done);
    }
    for d in devices {
        let bytes = per_device.get(d.to_string().as_str()).copied().unwrap_or(0);
        plan.bytes_received_per_step.insert(d.clone(), bytes);
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::DeviceType;

    fn pair(send: &str, recv: &str, tensor: &str, shape: Shape) -> TransferPair {
        let bytes = shape.num_elements().map(|n| n * 4);
        TransferPair {
            key: RendezvousKey::new(send, recv, tensor),
            tensor_name: tensor.into(),
            send_device: send.into(),
            recv_device: recv.into(),
            send_node: String::new(),
            recv_node: String::new(),
            dtype: DType::F32,
            shape,
            bytes,
            is_control: false,
            client_terminated: false,
        }
    }

    #[test]
    fn static_pairs_get_slots_in_order_and_dynamic_ones_a_reason() {
        let a = DeviceName::full("worker", 0, DeviceType::CPU, 0);
        let b = DeviceName::full("worker", 1, DeviceType::CPU, 0);
        let (sa, sb) = (a.to_string(), b.to_string());
        let pairs = [
            pair(&sa, &sb, "x:0", Shape::known(&[2, 3])),
            pair(&sa, &sb, "y:0", Shape::partial(vec![None, Some(3)])),
            pair(&sb, &sa, "z:0", Shape::known(&[5])),
        ];
        let plan = build_buffer_plan(&pairs, [&a, &b].into_iter(), |p| {
            (&*p.tensor_name == "y:0").then(|| "images".to_string())
        });
        let slots: Vec<(usize, &str, usize)> = plan
            .slots
            .iter()
            .map(|s| (s.slot, s.key.as_str(), s.bytes))
            .collect();
        assert_eq!(
            slots,
            [
                (0, pairs[0].key.as_str(), 24),
                (1, pairs[2].key.as_str(), 20)
            ]
        );
        assert_eq!(
            plan.dynamic,
            [(
                pairs[1].key.to_string(),
                "dimension 0 unknown: batch size of placeholder images".to_string()
            )]
        );
        assert_eq!(plan.bytes_received_per_step[&b], 24);
        assert_eq!(plan.bytes_received_per_step[&a], 20);
    }
}
