//! The session API: run a graph over every device of a cluster inside this process.
//!
//! ```
//! use dflow_executor::{Session, SessionOptions};
//! use dflow_graph::{builder::GraphBuilder, ClusterSpec, DType, Tensor};
//!
//! let mut b = GraphBuilder::new();
//! let x = b.placeholder("x", DType::F32, &[2]);
//! let w = b.with_device("/job:ps/task:0", |b| b.variable("w", DType::F32, &[2], "ones"));
//! b.binary("Add", "y", &x, &w);
//! let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap();
//! let session = Session::new(b.build().unwrap(), cluster, SessionOptions::default()).unwrap();
//! let x = Tensor::from_slice(&[2], &[1.0f32, 2.0]).unwrap();
//! let out = session.run(&[("x", x)], &["y"], &[]).unwrap();
//! assert_eq!(out[0].as_slice::<f32>().unwrap(), &[2.0, 3.0]);
//! ```

use crate::error::ExecError;
use crate::plan::ExecutionPlan;
use crate::run::{compute_pool, run_plans, StepEnv};
use crate::trace::Tracer;
use crate::variables::VariableStore;
use dflow_graph::{ClusterSpec, DeviceName, Graph, Shape, Tensor};
use dflow_partitioner::{
    partition, place, PartitionOptions, Partitions, PlacedGraph, PlacementOptions,
};
use dflow_transport::{LocalRendezvous, Rendezvous, RendezvousKey};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How a session places and runs its graph.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Placement policy and defaults.
    pub placement: PlacementOptions,
    /// Longest a step may take before it is aborted with a message naming what it waited for.
    pub step_timeout: Duration,
    /// Record a Chrome trace of every step.
    pub trace: bool,
    /// Compute threads (0: one per core).
    pub num_threads: usize,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            placement: PlacementOptions::default(),
            step_timeout: Duration::from_secs(30),
            trace: false,
            num_threads: 0,
        }
    }
}

/// A fetch or feed signature: plans are compiled once per signature and reused.
type Signature = (Vec<String>, Vec<String>, Vec<String>);

/// A run signature compiled into per-device plans.
#[derive(Debug)]
struct CompiledCall {
    partitions: Partitions,
    plans: Vec<Arc<ExecutionPlan>>,
    feeds: Vec<(Arc<RendezvousKey>, dflow_graph::DType, Shape)>,
    fetches: Vec<Arc<RendezvousKey>>,
}

/// Runs a graph on every device of a cluster inside this process (the local backend).
#[derive(Debug)]
pub struct Session {
    placed: PlacedGraph,
    rendezvous: Arc<LocalRendezvous>,
    stores: Mutex<BTreeMap<DeviceName, Arc<VariableStore>>>,
    cache: Mutex<HashMap<Signature, Arc<CompiledCall>>>,
    /// The signature used last, as requested: a training loop repeats one call, and this finds
    /// its plans without building a signature (no allocation per step).
    last: Mutex<Option<(Signature, Arc<CompiledCall>)>>,
    next_step: AtomicU64,
    env: StepEnv,
}

/// True when `owned` holds exactly the names in `requested`, in order.
fn same(owned: &[String], requested: &[&str]) -> bool {
    owned.len() == requested.len() && owned.iter().zip(requested).all(|(a, b)| a == b)
}

fn tensor_name(name: &str) -> String {
    if name.contains(':') {
        name.to_string()
    } else {
        format!("{name}:0")
    }
}

impl Session {
    /// Places `graph` on `cluster` and prepares to run it.
    pub fn new(
        graph: Graph,
        cluster: ClusterSpec,
        opts: SessionOptions,
    ) -> Result<Session, ExecError> {
        let placed = place(&graph, &cluster, &opts.placement)
            .map_err(|e| ExecError::Setup(e.to_string()))?;
        let pool = compute_pool(opts.num_threads)?;
        let rendezvous = Arc::new(LocalRendezvous::new());
        Ok(Session {
            placed,
            rendezvous: rendezvous.clone(),
            stores: Mutex::new(BTreeMap::new()),
            cache: Mutex::new(HashMap::new()),
            last: Mutex::new(None),
            next_step: AtomicU64::new(1),
            env: StepEnv {
                rendezvous,
                pool: Arc::new(pool),
                tracer: opts.trace.then(|| Arc::new(Tracer::new())),
                timeout: opts.step_timeout,
                collectives: None,
                meter: None,
            },
        })
    }

    /// Counts the tensors of every later step against `meter` (see [`crate::memory`]).
    pub fn set_memory_meter(&mut self, meter: Arc<crate::memory::MemoryMeter>) {
        self.env.meter = Some(meter);
    }

    /// The placed graph.
    pub fn placed(&self) -> &PlacedGraph {
        &self.placed
    }

    /// The trace recorder, when tracing is on.
    pub fn tracer(&self) -> Option<&Arc<Tracer>> {
        self.env.tracer.as_ref()
    }

    /// The partitions compiled for a run signature (compiling them if needed).
    pub fn partitions(
        &self,
        feeds: &[&str],
        fetches: &[&str],
        targets: &[&str],
    ) -> Result<Partitions, ExecError> {
        Ok(self.compiled(feeds, fetches, targets)?.partitions.clone())
    }

    fn store(&self, device: &DeviceName) -> Arc<VariableStore> {
        self.stores
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(device.clone())
            .or_default()
            .clone()
    }

    fn compiled(
        &self,
        feeds: &[&str],
        fetches: &[&str],
        targets: &[&str],
    ) -> Result<Arc<CompiledCall>, ExecError> {
        {
            let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(((f, x, t), call)) = last.as_ref() {
                if same(f, feeds) && same(x, fetches) && same(t, targets) {
                    return Ok(call.clone());
                }
            }
        }
        let call = self.compiled_by_signature(feeds, fetches, targets)?;
        let requested: Signature = (
            feeds.iter().map(|s| s.to_string()).collect(),
            fetches.iter().map(|s| s.to_string()).collect(),
            targets.iter().map(|s| s.to_string()).collect(),
        );
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((requested, call.clone()));
        Ok(call)
    }

    fn compiled_by_signature(
        &self,
        feeds: &[&str],
        fetches: &[&str],
        targets: &[&str],
    ) -> Result<Arc<CompiledCall>, ExecError> {
        let sig: Signature = (
            feeds.iter().map(|s| tensor_name(s)).collect(),
            fetches.iter().map(|s| tensor_name(s)).collect(),
            targets.iter().map(|s| s.to_string()).collect(),
        );
        if let Some(c) = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&sig)
        {
            return Ok(c.clone());
        }
        let opts = PartitionOptions {
            feeds: sig.0.clone(),
            fetches: sig.1.clone(),
            targets: sig.2.clone(),
        };
        let partitions =
            partition(&self.placed, &opts).map_err(|e| ExecError::Setup(e.to_string()))?;
        let mut plans = Vec::new();
        for (device, part) in &partitions.partitions {
            let store = self.store(device);
            plans.push(Arc::new(ExecutionPlan::compile(
                device,
                &part.graph,
                &store,
            )?));
        }
        let pair_types: HashMap<&RendezvousKey, (dflow_graph::DType, Shape)> = partitions
            .pairs
            .iter()
            .map(|p| (&p.key, (p.dtype, p.shape.clone())))
            .collect();
        let mut feed_keys = Vec::new();
        for (name, ep) in sig.0.iter().zip(&partitions.feeds) {
            let key = ep.key.clone();
            let (dtype, shape) =
                pair_types
                    .get(&ep.key)
                    .cloned()
                    .ok_or_else(|| ExecError::Feed {
                        name: name.clone(),
                        message: format!("no transfer pair for key {}", ep.key),
                    })?;
            feed_keys.push((Arc::new(key), dtype, shape));
        }
        let mut fetch_keys = Vec::new();
        for ep in &partitions.fetches {
            fetch_keys.push(Arc::new(ep.key.clone()));
        }
        let c = Arc::new(CompiledCall {
            partitions,
            plans,
            feeds: feed_keys,
            fetches: fetch_keys,
        });
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(sig, c.clone());
        Ok(c)
    }

    /// Runs one step: feeds by tensor name (`x` or `x:0`), returns fetches in order; `targets`
    /// are nodes run for their effect. Variables persist across calls. After an error the
    /// session stays usable.
    pub fn run(
        &self,
        feeds: &[(&str, Tensor)],
        fetches: &[&str],
        targets: &[&str],
    ) -> Result<Vec<Tensor>, ExecError> {
        let feed_names: Vec<&str> = feeds.iter().map(|(n, _)| *n).collect();
        let call = self.compiled(&feed_names, fetches, targets)?;
        // Check every feed before sending any, so a bad feed leaves nothing behind.
        for ((name, value), (_, dtype, shape)) in feeds.iter().zip(&call.feeds) {
            if value.dtype() != *dtype {
                return Err(ExecError::Feed {
                    name: name.to_string(),
                    message: format!("expected dtype {dtype}, got {}", value.dtype()),
                });
            }
            if !shape.is_compatible_with(&value.shape()) {
                return Err(ExecError::Feed {
                    name: name.to_string(),
                    message: format!("expected shape {shape}, got {}", value.shape()),
                });
            }
        }
        let values: Vec<Tensor> = feeds.iter().map(|(_, t)| t.clone()).collect();
        self.execute(&call, &values)
    }

    /// Runs one step of a compiled call with already-checked feed values (in `call.feeds` order).
    fn execute(&self, call: &CompiledCall, feeds: &[Tensor]) -> Result<Vec<Tensor>, ExecError> {
        let step = self.next_step.fetch_add(1, Ordering::Relaxed);
        let result = self.execute_step(call, feeds, step);
        self.rendezvous.finish_step(step);
        result
    }

    fn execute_step(
        &self,
        call: &CompiledCall,
        feeds: &[Tensor],
        step: u64,
    ) -> Result<Vec<Tensor>, ExecError> {
        let feeds: Vec<(Arc<RendezvousKey>, Tensor)> = call
            .feeds
            .iter()
            .zip(feeds)
            .map(|((key, _, _), value)| (key.clone(), value.clone()))
            .collect();
        run_plans(&self.env, step, &call.plans, &feeds, &call.fetches)
    }

    /// Current values of every initialized variable on every device: (device, name, value).
    pub fn variables(&self) -> Vec<(DeviceName, String, Tensor)> {
        let stores = self.stores.lock().unwrap_or_else(|p| p.into_inner());
        stores
            .iter()
            .flat_map(|(d, s)| {
                s.snapshot()
                    .into_iter()
                    .map(move |(n, t)| (d.clone(), n, t))
            })
            .collect()
    }

    /// Sets a variable's value (restoring checkpoints). The variable must exist in the graph.
    pub fn assign_variable(&self, name: &str, value: Tensor) -> Result<(), ExecError> {
        let idx = self
            .placed
            .graph
            .find(name)
            .filter(|&i| self.placed.graph.node(i).op_def().is_variable)
            .ok_or_else(|| ExecError::Setup(format!("no variable named `{name}` in the graph")))?;
        let expected = &self.placed.graph.node(idx).outputs[0];
        if expected.dtype != value.dtype() || expected.shape != value.shape() {
            return Err(ExecError::Setup(format!(
                "variable `{name}` is {expected}, the value is {}{}",
                value.dtype(),
                value.shape()
            )));
        }
        let device = self.placed.devices[idx.index()].clone();
        self.store(&device).cell(name).write(value);
        Ok(())
    }

    /// Every variable of the graph: (name, dtype, dims), sorted by name.
    pub fn variable_specs(&self) -> Vec<(String, dflow_graph::DType, Vec<usize>)> {
        let g = &self.placed.graph;
        let mut v: Vec<_> = g
            .node_indices()
            .map(|i| g.node(i))
            .filter(|n| n.op_def().is_variable)
            .filter_map(|n| {
                let t = n.outputs.first()?;
                Some((n.name.clone(), t.dtype, t.shape.as_static()?))
            })
            .collect();
        v.sort();
        v
    }

    /// Recv keys still pending in `step` (diagnostics).
    pub fn pending(&self, step: u64) -> Vec<RendezvousKey> {
        self.rendezvous.pending_recvs(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::builder::GraphBuilder;
    use dflow_graph::DType;
    use std::time::Instant;

    #[test]
    fn a_value_is_dropped_when_its_last_reader_finishes() {
        // w → a → b → c (each 64 Ki f32 = 256 KiB), c fetched: with each value dropped after
        // its reader, at most two are held at once; kept to the end of the step, three.
        let mut b = GraphBuilder::new();
        b.with_device("/job:worker/task:0", |b| {
            let w = b.variable("w", DType::F32, &[256, 256], "ones");
            let a = b.unary("Neg", "a", &w);
            let x = b.unary("Neg", "b", &a);
            b.unary("Neg", "c", &x);
        });
        let cluster = ClusterSpec::local(&[("worker", 1)]).unwrap();
        let mut s = Session::new(b.build().unwrap(), cluster, SessionOptions::default()).unwrap();
        let meter = Arc::new(crate::memory::MemoryMeter::new(None));
        s.set_memory_meter(meter.clone());
        for _ in 0..3 {
            let out = s.run(&[], &["c"], &[]).unwrap();
            assert_eq!(out[0].as_slice::<f32>().unwrap()[0], -1.0);
        }
        let one = 256 * 256 * 4;
        assert_eq!(meter.peak(), 2 * one, "the variable's value is not counted");
        assert_eq!(
            meter.live(),
            0,
            "every value released at the end of the step"
        );
    }

    #[test]
    fn a_recv_that_never_arrives_times_out_naming_the_key_and_the_producer() {
        let mut b = GraphBuilder::new();
        let w = b.with_device("/job:ps/task:0", |b| {
            b.variable("w", DType::F32, &[2], "ones")
        });
        b.with_device("/job:worker/task:0", |b| b.unary("Neg", "y", &w));
        let cluster = ClusterSpec::local(&[("ps", 1), ("worker", 1)]).unwrap();
        let opts = SessionOptions {
            step_timeout: Duration::from_millis(300),
            ..SessionOptions::default()
        };
        let s = Session::new(b.build().unwrap(), cluster, opts).unwrap();
        let call = s.compiled(&[], &["y"], &[]).unwrap();
        // Run the worker's partition alone: the ps, which would send `w`, never runs.
        let worker: Vec<_> = call
            .plans
            .iter()
            .filter(|p| p.device().job.as_deref() == Some("worker"))
            .cloned()
            .collect();
        assert_eq!(worker.len(), 1);
        let partial = CompiledCall {
            partitions: call.partitions.clone(),
            plans: worker,
            feeds: vec![],
            fetches: call.fetches.clone(),
        };
        let started = Instant::now();
        let err = s.execute(&partial, &[]).unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "bounded by the timeout and its grace period"
        );
        let ExecError::Timeout { waiting, .. } = &err else {
            panic!("expected a timeout, got {err}")
        };
        assert!(
            waiting.iter().any(|(t, from, to)| t == "w:0"
                && from.contains("/job:ps")
                && to.contains("/job:worker")),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("tensor `w:0` from /job:ps/replica:0/task:0/device:CPU:0"),
            "{msg}"
        );
        // The session is still usable afterwards.
        let out = s.run(&[], &["y"], &[]).unwrap();
        assert_eq!(out[0].as_slice::<f32>().unwrap(), &[-1.0, -1.0]);
    }
}
