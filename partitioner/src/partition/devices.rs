//! Phase 1, devices: every node's full device, interned to a small id.
//!
//! Ids follow [`DeviceName`] order (task 2 before task 10), with the client's pseudo-device
//! among them, so sorting pairs by id pair sorts them by device name.

use crate::error::PartitionError;
use dflow_graph::ops::transfer::CLIENT_DEVICE;
use dflow_graph::{DeviceName, Graph};
use petgraph::graph::NodeIndex;

use super::naming::short_device;
use super::FastMap;

/// The devices of a placed graph, interned.
#[derive(Debug)]
pub(super) struct Devices {
    /// Every device with a node, and the client, sorted.
    pub(super) all: Vec<DeviceName>,
    /// Each node's device id (index into `all`), by node index.
    pub(super) of_node: Vec<u32>,
    /// The client's id.
    pub(super) client: u32,
    /// Each device's full name as text.
    pub(super) names: Vec<String>,
    /// Each device's short name for generated node names (`worker_0`, `client`).
    pub(super) short: Vec<String>,
}

/// Interns `devices` (one per node of `g`); every device must be fully specified.
pub(super) fn intern_devices(g: &Graph, devices: &[DeviceName]) -> Result<Devices, PartitionError> {
    let n = g.num_nodes();
    if devices.len() != n {
        return Err(PartitionError::DeviceCount {
            nodes: n,
            devices: devices.len(),
        });
    }
    let client = DeviceName::parse(CLIENT_DEVICE).unwrap_or_default();
    let mut raw = Vec::with_capacity(n);
    let mut index: FastMap<&DeviceName, u32> = FastMap::default();
    let mut uniq: Vec<&DeviceName> = Vec::new();
    let mut first_node: Vec<usize> = Vec::new();
    // Runs of one device are common (node order follows the file): skip the map along them.
    let mut last: Option<(&DeviceName, u32)> = None;
    for (i, d) in devices.iter().enumerate() {
        let id = match last {
            Some((ld, lid)) if ld == d => lid,
            _ => *index.entry(d).or_insert_with(|| {
                uniq.push(d);
                first_node.push(i);
                (uniq.len() - 1) as u32
            }),
        };
        last = Some((d, id));
        raw.push(id);
    }
    if let Some(k) = uniq.iter().position(|d| !d.is_fully_specified()) {
        return Err(PartitionError::NotFullDevice {
            node: g.node(NodeIndex::new(first_node[k])).name.clone(),
            device: uniq[k].to_string(),
        });
    }
    let mut all: Vec<DeviceName> = uniq.iter().map(|d| (*d).clone()).collect();
    if !all.contains(&client) {
        all.push(client.clone());
    }
    all.sort();
    let remap: Vec<u32> = uniq
        .iter()
        .map(|d| all.binary_search(d).unwrap_or(0) as u32)
        .collect();
    let of_node = raw.iter().map(|&i| remap[i as usize]).collect();
    let client_id = all.binary_search(&client).unwrap_or(0) as u32;
    let names = all.iter().map(|d| d.to_string()).collect();
    let short = all
        .iter()
        .map(|d| {
            if *d == client {
                "client".to_string()
            } else {
                short_device(d)
            }
        })
        .collect();
    Ok(Devices {
        all,
        of_node,
        client: client_id,
        names,
        short,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::{builder::GraphBuilder, DType, DeviceType};

    fn three_nodes() -> Graph {
        let mut b = GraphBuilder::new();
        for name in ["a", "b", "c"] {
            b.placeholder(name, DType::F32, &[1]);
        }
        b.build().unwrap()
    }

    #[test]
    fn ids_follow_device_order_with_the_client_among_them() {
        let g = three_nodes();
        let w10 = DeviceName::full("worker", 10, DeviceType::CPU, 0);
        let w2 = DeviceName::full("worker", 2, DeviceType::CPU, 0);
        let ps = DeviceName::full("ps", 0, DeviceType::CPU, 0);
        let d = intern_devices(&g, &[w10.clone(), w2.clone(), ps.clone()]).unwrap();
        let client = DeviceName::parse(CLIENT_DEVICE).unwrap();
        let mut want = vec![w10, w2, ps, client];
        want.sort();
        assert_eq!(d.all, want);
        // Task 2 sorts before task 10.
        assert!(d.of_node[1] < d.of_node[0]);
        assert_eq!(d.all[d.client as usize].to_string(), CLIENT_DEVICE);
        assert_eq!(d.short[d.client as usize], "client");
        assert_eq!(d.short[d.of_node[2] as usize], "ps_0");
        assert_eq!(
            d.names[d.of_node[1] as usize],
            d.all[d.of_node[1] as usize].to_string()
        );
    }

    #[test]
    fn partial_devices_and_wrong_counts_are_refused() {
        let g = three_nodes();
        let w = DeviceName::full("worker", 0, DeviceType::CPU, 0);
        let partial = DeviceName::parse("/job:worker").unwrap();
        let e = intern_devices(&g, &[w.clone(), partial, w.clone()]).unwrap_err();
        assert!(
            matches!(&e, PartitionError::NotFullDevice { node, .. } if node == "b"),
            "{e}"
        );
        let e = intern_devices(&g, &[w]).unwrap_err();
        assert_eq!(
            e,
            PartitionError::DeviceCount {
                nodes: 3,
                devices: 1
            }
        );
    }
}
