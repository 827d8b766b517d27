//! Placement: every node of a graph gets one full device name that exists in the cluster.
//!
//! The steps, in order:
//! 1. each node's requested device is parsed (`""` means unconstrained);
//! 2. colocation groups are formed with union-find from `colocate_with` lists and from reference
//!    edges (a ref input forces the consumer into its variable's group); the requests of a
//!    group's members are merged with [`DeviceName::merge`], and a conflict names both nodes;
//! 3. the policy fills in what a group did not request. Under [`Policy::DeviceSetter`] a group
//!    holding a variable (`OpDef::is_variable`) goes to `/job:ps`, its task chosen round-robin or
//!    greedily by bytes; everything else gets the default device. A request wins over the policy
//!    where they disagree (TensorFlow's `replica_device_setter` does the same);
//! 4. the merged spec is resolved to the first matching cluster device in sorted order; with soft
//!    placement a device type/id that does not exist is dropped before giving up;
//! 5. generator nodes (a `Const` with no inputs and no request) follow their consumers when all
//!    of them ended on one device, so a constant does not cost a transfer.

use crate::error::PlacementError;
use dflow_graph::{ClusterSpec, DeviceName, DeviceType, Graph};
use petgraph::graph::NodeIndex;
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::collections::HashMap;

/// How variables are spread over the ps tasks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PsStrategy {
    /// Variable groups go to ps tasks 0, 1, 2, … in graph order, wrapping around.
    #[default]
    RoundRobin,
    /// Each variable group goes to the ps task holding the fewest bytes so far (ties: lowest
    /// task), in graph order — TensorFlow's `GreedyLoadBalancingStrategy` with a byte-size load.
    GreedyBytes,
}

/// Which placement policy fills in what nodes do not request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// `replica_device_setter`: variables on `/job:ps`, everything else on the default device.
    DeviceSetter {
        /// How variables are spread over the ps tasks.
        ps_strategy: PsStrategy,
    },
    /// Only explicit requests and the default device.
    Explicit,
}

impl Default for Policy {
    fn default() -> Self {
        Policy::DeviceSetter {
            ps_strategy: PsStrategy::RoundRobin,
        }
    }
}

/// Options of [`place`].
#[derive(Clone, Debug, PartialEq)]
pub struct PlacementOptions {
    /// The placement policy.
    pub policy: Policy,
    /// What an unconstrained node gets, e.g. `/job:worker/task:0`.
    pub default_device: DeviceName,
    /// Drop a requested device type/id that the cluster does not have instead of failing.
    pub allow_soft_placement: bool,
}

impl Default for PlacementOptions {
    fn default() -> Self {
        PlacementOptions {
            policy: Policy::default(),
            default_device: DeviceName {
                job: Some("worker".into()),
                task: Some(0),
                ..DeviceName::default()
            },
            allow_soft_placement: false,
        }
    }
}

/// A graph whose every node has a full device name.
#[derive(Clone, Debug)]
pub struct PlacedGraph {
    /// The graph (node `device` fields keep the requests as written).
    pub graph: Graph,
    /// The full device of each node, indexed by `NodeIndex::index()`.
    pub devices: Vec<DeviceName>,
}

impl PlacedGraph {
    /// The device of the node named `name`.
    pub fn device_of(&self, name: &str) -> Option<&DeviceName> {
        self.graph
            .find(name)
            .and_then(|i| self.devices.get(i.index()))
    }
}

/// Union-find over node indices; the root of a group is its smallest index.
struct Groups {
    parent: Vec<u32>,
}

impl Groups {
    fn new(n: usize) -> Self {
        Groups {
            parent: (0..n as u32).collect(),
        }
    }

    fn find(&mut self, mut x: u32) -> u32 {
        while self.parent[x as usize] != x {
            let p = self.parent[x as usize];
            self.parent[x as usize] = self.parent[p as usize];
            x = p;
        }
        x
    }

    fn union(&mut self, a: u32, b: u32) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra < rb {
            self.parent[rb as usize] = ra;
        } else if rb < ra {
            self.parent[ra as usize] = rb;
        }
    }
}

/// Places every node of `graph` on a device of `cluster`.
pub fn place(
    graph: &Graph,
    cluster: &ClusterSpec,
    opts: &PlacementOptions,
) -> Result<PlacedGraph, PlacementError> {
    let n = graph.num_nodes();
    let pg = graph.petgraph();
    let soft = opts.allow_soft_placement;

    // 1. Requests.
    let mut requested = Vec::with_capacity(n);
    for idx in graph.node_indices() {
        let node = graph.node(idx);
        let spec = DeviceName::parse(&node.device).map_err(|e| PlacementError::InvalidDevice {
            node: node.name.clone(),
            requested: node.device.to_string(),
            message: e.to_string(),
        })?;
        requested.push(spec);
    }

    // 2. Colocation groups.
    let mut groups = Groups::new(n);
    for idx in graph.node_indices() {
        let node = graph.node(idx);
        for target in &node.colocate_with {
            let other = graph
                .find(target)
                .ok_or_else(|| PlacementError::UnknownColocation {
                    node: node.name.clone(),
                    target: target.clone(),
                })?;
            groups.union(idx.index() as u32, other.index() as u32);
        }
        let op = node.op_def();
        if op.inputs.iter().any(|a| a.is_ref) {
            for e in pg.edges_directed(idx, Direction::Incoming) {
                if let dflow_graph::Edge::Data { dst_input, .. } = *e.weight() {
                    if op.inputs.get(dst_input).is_some_and(|a| a.is_ref) {
                        groups.union(idx.index() as u32, e.source().index() as u32);
                    }
                }
            }
        }
    }
    let root: Vec<u32> = (0..n as u32).map(|i| groups.find(i)).collect();

    // Merge the requests of each group; remember which member set what, for messages.
    let mut group_spec: HashMap<u32, (DeviceName, u32)> = HashMap::new();
    let mut group_size = vec![0u32; n];
    for i in 0..n {
        let r = root[i];
        group_size[r as usize] += 1;
        if requested[i].is_unconstrained() {
            continue;
        }
        match group_spec.get_mut(&r) {
            None => {
                group_spec.insert(r, (requested[i].clone(), i as u32));
            }
            Some((spec, _)) => match spec.merge(&requested[i], soft) {
                Ok(m) => *spec = m,
                Err(_) => {
                    return Err(colocation_error(graph, &requested, &root, i));
                }
            },
        }
    }

    // 3 + 4. Policy and resolution, group by group in graph order.
    let devices = cluster.devices();
    let ps_tasks: Vec<u32> = cluster.tasks("ps").map(|(t, _)| t).collect();
    let mut has_variable = vec![false; n];
    let mut var_bytes = vec![0usize; n];
    for idx in graph.node_indices() {
        let node = graph.node(idx);
        if node.op_def().is_variable {
            let r = root[idx.index()] as usize;
            has_variable[r] = true;
            let bytes = node
                .outputs
                .first()
                .and_then(|t| t.byte_size())
                .unwrap_or(0);
            var_bytes[r] = var_bytes[r].saturating_add(bytes);
        }
    }
    let mut next_ps = 0usize;
    let mut ps_load = vec![0usize; ps_tasks.len()];
    let mut resolved: HashMap<DeviceName, usize> = HashMap::new();
    let mut group_device = vec![u32::MAX; n];
    let unconstrained = DeviceName::default();
    for r in 0..n {
        if root[r] != r as u32 {
            continue;
        }
        let (spec, who) = group_spec
            .get(&(r as u32))
            .map(|(s, w)| (s, *w as usize))
            .unwrap_or((&unconstrained, r));
        let wants_ps = spec.job.is_none() || spec.job.as_deref() == Some("ps");
        let policy = match opts.policy {
            Policy::DeviceSetter { ps_strategy }
                if has_variable[r] && wants_ps && !ps_tasks.is_empty() =>
            {
                let slot = match spec
                    .task
                    .and_then(|t| ps_tasks.iter().position(|&p| p == t))
                {
                    Some(slot) => slot,
                    None => match ps_strategy {
                        PsStrategy::RoundRobin => {
                            let s = next_ps % ps_tasks.len();
                            next_ps += 1;
                            s
                        }
                        PsStrategy::GreedyBytes => (0..ps_tasks.len())
                            .min_by_key(|&s| (ps_load[s], s))
                            .unwrap_or(0),
                    },
                };
                ps_load[slot] = ps_load[slot].saturating_add(var_bytes[r]);
                DeviceName {
                    job: Some("ps".into()),
                    task: Some(ps_tasks[slot]),
                    ..DeviceName::default()
                }
            }
            _ => opts.default_device.clone(),
        };
        let full = fill(spec, &policy);
        let d = match resolved.get(&full) {
            Some(&d) => d,
            None => {
                let d =
                    resolve(&full, &devices, soft).ok_or_else(|| PlacementError::NoSuchDevice {
                        node: graph.node(NodeIndex::new(who)).name.clone(),
                        requested: full.to_string(),
                        reason: no_match_reason(&full, cluster),
                        available: devices.iter().map(|d| d.to_string()).collect(),
                    })?;
                resolved.insert(full, d);
                d
            }
        };
        group_device[r] = d as u32;
    }
    let mut assigned: Vec<u32> = (0..n).map(|i| group_device[root[i] as usize]).collect();

    // 5. Generators follow their consumers.
    for idx in graph.node_indices() {
        let i = idx.index();
        let node = graph.node(idx);
        if node.op != "Const"
            || !requested[i].is_unconstrained()
            || group_size[i] != 1
            || pg.edges_directed(idx, Direction::Incoming).next().is_some()
        {
            continue;
        }
        let mut consumers = pg
            .edges_directed(idx, Direction::Outgoing)
            .map(|e| assigned[e.target().index()]);
        if let Some(first) = consumers.next() {
            if consumers.all(|d| d == first) {
                assigned[i] = first;
            }
        }
    }

    Ok(PlacedGraph {
        graph: graph.clone(),
        devices: assigned
            .into_iter()
            .map(|d| devices[d as usize].clone())
            .collect(),
    })
}

/// `spec` with its unset parts taken from `policy`; where the jobs differ, the policy's
/// replica and task are meaningless and left for resolution.
fn fill(spec: &DeviceName, policy: &DeviceName) -> DeviceName {
    let same_job = spec.job.is_none() || spec.job == policy.job;
    let same_type = spec.device_type.is_none() || spec.device_type == policy.device_type;
    DeviceName {
        job: spec.job.clone().or_else(|| policy.job.clone()),
        replica: spec
            .replica
            .or(if same_job { policy.replica } else { None }),
        task: spec.task.or(if same_job { policy.task } else { None }),
        device_type: spec
            .device_type
            .clone()
            .or_else(|| policy.device_type.clone()),
        device_id: spec
            .device_id
            .or(if same_type { policy.device_id } else { None }),
    }
}

/// Index of the first device (in sorted order) matching `spec`.
fn resolve(spec: &DeviceName, devices: &[DeviceName], soft: bool) -> Option<usize> {
    if let Some(i) = devices.iter().position(|d| spec.matches(d)) {
        return Some(i);
    }
    if soft && (spec.device_type.is_some() || spec.device_id.is_some()) {
        let relaxed = DeviceName {
            device_type: None,
            device_id: None,
            ..spec.clone()
        };
        return devices.iter().position(|d| relaxed.matches(d));
    }
    None
}

fn no_match_reason(spec: &DeviceName, cluster: &ClusterSpec) -> String {
    let jobs: Vec<&str> = cluster.jobs().collect();
    if let Some(job) = &spec.job {
        if !jobs.contains(&job.as_str()) {
            return format!("no job \"{job}\"; jobs: {}", jobs.join(", "));
        }
        if let Some(task) = spec.task {
            if !cluster.has_task(job, task) {
                let tasks: Vec<String> = cluster.tasks(job).map(|(t, _)| t.to_string()).collect();
                return format!(
                    "job \"{job}\" has no task {task}; its tasks: {}",
                    tasks.join(", ")
                );
            }
        }
    }
    if spec.replica.is_some_and(|r| r != 0) {
        return "only replica 0 exists".into();
    }
    let ty = spec.device_type.as_ref().map_or("*", DeviceType::as_str);
    let id = spec.device_id.map_or("*".to_string(), |i| i.to_string());
    format!("no device {ty}:{id} there; each task has only CPU:0, which soft placement would use")
}

/// The error for member `i` whose request does not merge with its group's: finds the earlier
/// member it conflicts with.
fn colocation_error(
    graph: &Graph,
    requested: &[DeviceName],
    root: &[u32],
    i: usize,
) -> PlacementError {
    let name = |k: usize| graph.node(NodeIndex::new(k)).name.clone();
    // The first earlier member whose own request conflicts with i's; if each conflicts only
    // with a combination, blame the first requesting member.
    let mut first_requesting = None;
    for k in 0..i {
        if root[k] != root[i] || requested[k].is_unconstrained() {
            continue;
        }
        first_requesting.get_or_insert(k);
        if requested[k].merge(&requested[i], false).is_err() {
            return conflict(name(i), &requested[i], name(k), &requested[k]);
        }
    }
    let k = first_requesting.unwrap_or(root[i] as usize);
    conflict(name(i), &requested[i], name(k), &requested[k])
}

fn conflict(node: String, a: &DeviceName, other: String, b: &DeviceName) -> PlacementError {
    match (&a.job, &b.job) {
        (Some(ja), Some(jb)) if ja != jb => PlacementError::ColocationSpansJobs {
            node,
            node_job: ja.clone(),
            other,
            other_job: jb.clone(),
        },
        _ => PlacementError::ColocationConflict {
            message: a
                .merge(b, false)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_else(|| "the group's combined request conflicts".into()),
            node,
            node_device: a.to_string(),
            other,
            other_device: b.to_string(),
        },
    }
}
