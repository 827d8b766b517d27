//! One task's side of a distributed job: the graphs the chief registered here, their variables,
//! and the steps it asks this task to run.

use super::collectives::CollectiveHub;
use super::protocol::{
    dims_usize, BatchRef, DataKind, DataSpec, FeedSource, NamedTensor, RegisterGraph, RunStep,
    StepDone, WireTensor,
};
use crate::data::text::{read_text, token_digest, CharCorpus, CharVocab, CharWindows};
use crate::data::{read_csv, Dataset, ReadOptions};
use crate::error::ExecError;
use crate::memory::MemoryMeter;
use crate::plan::ExecutionPlan;
use crate::run::{compute_pool, run_plans, StepEnv};
use crate::trace::Tracer;
use crate::variables::VariableStore;
use dflow_graph::format::parse_json;
use dflow_graph::{AttrValue, DType, DeviceName, Graph, Tensor};
use dflow_transport::DataPlane;
use dflow_transport::{RendezvousError, RendezvousKey};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The environment variable that makes a task a straggler: every step it runs sleeps this many
/// milliseconds first (for testing bounded staleness and timeouts; at most one minute).
pub const STEP_DELAY_ENV: &str = "DFLOW_STEP_DELAY_MS";

static STEP_DELAY: std::sync::LazyLock<Option<Duration>> = std::sync::LazyLock::new(|| {
    std::env::var(STEP_DELAY_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&ms| ms > 0)
        .map(|ms| Duration::from_millis(ms.min(60_000)))
});

/// How a task server runs steps.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Compute threads (0: one per core).
    pub num_threads: usize,
    /// Longest one step may take here before it is aborted.
    pub step_timeout: Duration,
    /// Record a Chrome trace of every step.
    pub trace: bool,
    /// This task's copy of the data set; `None` uses the path the chief sends.
    pub data_path: Option<PathBuf>,
    /// The host collective listeners bind to and advertise (this task's cluster host).
    pub host: String,
    /// The cluster secret collective connections must prove.
    pub secret: Option<dflow_transport::auth::Secret>,
    /// Collective groups run over shared memory (every task on this host, `--transport shm`)
    /// instead of TCP.
    pub shm_collectives: bool,
    /// The most bytes the step values of this task may take at once (`--memory-limit`; the
    /// variables are checked against it before the first step).
    pub memory_limit: Option<usize>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            num_threads: 0,
            step_timeout: Duration::from_secs(30),
            trace: false,
            data_path: None,
            host: "127.0.0.1".into(),
            secret: None,
            shm_collectives: false,
            memory_limit: None,
        }
    }
}

/// Where a variable lives on this task and what it holds: (device, dtype, dims).
pub type VariableSpec = (DeviceName, DType, Vec<usize>);

/// A graph registered on this task.
#[derive(Debug)]
struct Registered {
    plans: Vec<Arc<ExecutionPlan>>,
    feeds: Vec<(Arc<RendezvousKey>, FeedSource)>,
    fetches: Vec<Arc<RendezvousKey>>,
    updates_variables: bool,
}

/// The training data this task feeds from.
#[derive(Debug)]
enum TaskData {
    /// The training split of a CSV table and the shuffle's seed.
    Csv { train: Dataset, seed: u64 },
    /// The training split of a text as token ids, cut into windows of `block` tokens drawn
    /// with `seed`.
    Text {
        tokens: Arc<[u32]>,
        block: usize,
        seed: u64,
    },
}

/// Runs the partitions the chief registers on this task.
#[derive(Debug)]
pub struct TaskServer {
    task: String,
    rendezvous: Arc<dyn DataPlane>,
    env: StepEnv,
    stores: Mutex<BTreeMap<DeviceName, Arc<VariableStore>>>,
    /// Variable name → the device (of this task) that holds it.
    variables: Mutex<BTreeMap<String, VariableSpec>>,
    graphs: Mutex<HashMap<u32, Arc<Registered>>>,
    data: Mutex<Option<Arc<TaskData>>>,
    data_path: Option<PathBuf>,
    /// Steps of variable-updating graphs finished here (async staleness).
    updates: AtomicU64,
    /// Steps running now (to say what a failure interrupted).
    running: Mutex<BTreeSet<u64>>,
    /// The collective groups this task joined.
    collectives: Arc<CollectiveHub>,
    /// The receive slots registered on the data plane, by key.
    slots: Mutex<BTreeMap<RendezvousKey, RegisteredSlot>>,
    /// The send routes registered on the data plane: key → (receiving task, slot).
    routes: Mutex<BTreeMap<RendezvousKey, (String, u32)>>,
}

/// What one task sent: [`TaskServer::traffic`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TaskTraffic {
    /// Values sent to other tasks' Recvs.
    pub data_plane: dflow_transport::Traffic,
    /// Messages sent in collective groups.
    pub collectives: dflow_transport::Traffic,
}

impl std::fmt::Display for TaskTraffic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} B in {} values over the data plane, {} B in {} collective messages",
            self.data_plane.bytes,
            self.data_plane.messages,
            self.collectives.bytes,
            self.collectives.messages
        )
    }
}

/// What one task holds at the end of a job: [`TaskServer::held`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TaskHeld {
    /// Initialized variables in its stores (parameters and optimizer state).
    pub variables: usize,
    /// Their bytes.
    pub variable_bytes: usize,
    /// The most bytes of step values it held at once (the executor's meter).
    pub peak_step_bytes: usize,
}

impl std::fmt::Display for TaskHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} variables, {} bytes; step tensors peaked at {} bytes",
            self.variables, self.variable_bytes, self.peak_step_bytes
        )
    }
}

/// A receive slot a task registered on its data plane, as the job plan gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisteredSlot {
    /// The plan's global slot id.
    pub slot: u32,
    /// The pair's rendezvous key.
    pub key: RendezvousKey,
    /// The sending task.
    pub peer: String,
    /// Bytes per step.
    pub bytes: usize,
}

/// The Send and Recv nodes of a partition whose pair crosses to another task:
/// `(key, node, bytes per step)`.
#[derive(Debug, Default)]
struct CrossTaskEnds {
    recvs: Vec<(RendezvousKey, String, Option<usize>)>,
    sends: Vec<(RendezvousKey, String)>,
}

impl CrossTaskEnds {
    fn add(&mut self, graph: &Graph, task: &str) {
        let task_of = |d: &str| DeviceName::parse(d).ok().and_then(|d| d.task_name());
        for idx in graph.node_indices() {
            let node = graph.node(idx);
            if node.op != "Send" && node.op != "Recv" {
                continue;
            }
            let attrs = node.resolved_attrs();
            let text = |k: &str| match attrs.get(k) {
                Some(AttrValue::String(s)) => s.to_string(),
                _ => String::new(),
            };
            if matches!(attrs.get("client_terminated"), Some(AttrValue::Bool(true))) {
                continue;
            }
            let (send, recv) = (text("send_device"), text("recv_device"));
            let (send_task, recv_task) = (task_of(&send), task_of(&recv));
            if send_task == recv_task {
                continue;
            }
            let key = RendezvousKey::new(&send, &recv, &text("tensor_name"));
            if node.op == "Recv" && recv_task.as_deref() == Some(task) {
                let bytes = node.outputs.first().and_then(|t| {
                    t.shape
                        .num_elements()
                        .and_then(|n| n.checked_mul(t.dtype.size_of()))
                });
                self.recvs.push((key, node.name.clone(), bytes));
            } else if node.op == "Send" && send_task.as_deref() == Some(task) {
                self.sends.push((key, node.name.clone()));
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl TaskServer {
    /// A server for task `task` (`/job:J/replica:0/task:T`) moving tensors over `rendezvous`.
    pub fn new(
        task: &str,
        rendezvous: Arc<dyn DataPlane>,
        opts: &ServerOptions,
    ) -> Result<TaskServer, ExecError> {
        let pool = compute_pool(opts.num_threads)?;
        let collectives = Arc::new(
            CollectiveHub::new(&opts.host, opts.secret.clone(), opts.step_timeout)
                .shared_memory(opts.shm_collectives),
        );
        Ok(TaskServer {
            task: task.to_string(),
            env: StepEnv {
                rendezvous: rendezvous.clone().as_rendezvous(),
                pool: Arc::new(pool),
                tracer: opts.trace.then(|| Arc::new(Tracer::new())),
                timeout: opts.step_timeout,
                collectives: Some(collectives.clone()),
                meter: Some(Arc::new(MemoryMeter::new(opts.memory_limit))),
            },
            rendezvous,
            stores: Mutex::default(),
            variables: Mutex::default(),
            graphs: Mutex::default(),
            data: Mutex::default(),
            data_path: opts.data_path.clone(),
            updates: AtomicU64::new(0),
            running: Mutex::default(),
            collectives,
            slots: Mutex::default(),
            routes: Mutex::default(),
        })
    }

    /// This task's name.
    pub fn task(&self) -> &str {
        &self.task
    }

    /// The trace recorder, when tracing.
    pub fn tracer(&self) -> Option<&Arc<Tracer>> {
        self.env.tracer.as_ref()
    }

    /// What this task has sent so far: tensor values over the data plane (Send/Recv pairs to
    /// other tasks) and messages in its collective groups, payload bytes only.
    pub fn traffic(&self) -> TaskTraffic {
        TaskTraffic {
            data_plane: self.rendezvous.traffic(),
            collectives: self.collectives.sent(),
        }
    }

    /// What this task holds now: its variables (parameters and optimizer state, as its stores
    /// hold them) and the peak of its step values.
    pub fn held(&self) -> TaskHeld {
        let stores: Vec<Arc<VariableStore>> = lock(&self.stores).values().cloned().collect();
        let values: Vec<Tensor> = stores
            .iter()
            .flat_map(|s| s.snapshot())
            .map(|(_, t)| t)
            .collect();
        TaskHeld {
            variables: values.len(),
            variable_bytes: values.iter().map(Tensor::byte_len).sum(),
            peak_step_bytes: self.meter().map_or(0, |m| m.peak()),
        }
    }

    /// The accounting of this task's step values.
    pub fn meter(&self) -> Option<&Arc<MemoryMeter>> {
        self.env.meter.as_ref()
    }

    fn store(&self, device: &DeviceName) -> Arc<VariableStore> {
        lock(&self.stores)
            .entry(device.clone())
            .or_default()
            .clone()
    }

    /// Installs a graph: compiles each partition once, registers its receive slots (allocating
    /// their buffers) and send routes on the data plane, and loads the data set if it feeds.
    pub fn register(&self, g: &RegisterGraph) -> Result<(), String> {
        let mut plans = Vec::with_capacity(g.partitions.len());
        let mut variables = Vec::new();
        let mut ends = CrossTaskEnds::default();
        let mut largest: Option<(String, usize)> = None;
        for p in &g.partitions {
            let device = DeviceName::parse(&p.device)
                .map_err(|e| format!("partition device `{}`: {e}", p.device))?;
            let parsed = parse_json(&p.graph_json, Some(&p.device))
                .map_err(|e| format!("partition for {}: {e}", p.device))?;
            let graph = Graph::from_def(&parsed.def)
                .map_err(|e| format!("partition for {} is invalid: {e}", p.device))?;
            ends.add(&graph, &self.task);
            for idx in graph.node_indices() {
                let node = graph.node(idx);
                if !node.op_def().is_variable && node.op != "Const" {
                    for t in node.outputs.iter() {
                        let bytes = t.shape.num_elements().map(|n| n * t.dtype.size_of());
                        if let Some(b) =
                            bytes.filter(|&b| largest.as_ref().map_or(true, |l| b > l.1))
                        {
                            largest = Some((node.name.clone(), b));
                        }
                    }
                }
                if node.op_def().is_variable {
                    if let Some(dims) = node.outputs[0].shape.as_static() {
                        variables.push((
                            node.name.clone(),
                            (device.clone(), node.outputs[0].dtype, dims),
                        ));
                    }
                }
            }
            let store = self.store(&device);
            let plan = ExecutionPlan::compile(&device, &graph, &store)
                .map_err(|e| format!("compiling the partition for {}: {e}", p.device))?;
            plans.push(Arc::new(plan));
        }
        if let Some(meter) = &self.env.meter {
            let need = self.footprint(&variables, &largest);
            if let Some(limit) = meter.limit() {
                crate::memory::fits(&self.task, &need, limit)?;
            }
            meter.set_resident(need.variable_bytes());
        }
        let slots = self.check_slots(g, &ends)?;
        self.check_routes(g, &ends)?;
        for (s, dtype, dims) in slots {
            let key = Arc::new(s.key.clone());
            self.rendezvous
                .register_recv(s.slot, &s.peer, key, dtype, &dims)
                .map_err(|e| format!("pair {}: registering slot {}: {e}", s.key, s.slot))?;
            lock(&self.slots).insert(s.key.clone(), s);
        }
        for r in &g.send_routes {
            if lock(&self.routes).contains_key(&r.key) {
                continue; // routed by a graph registered earlier
            }
            let key = Arc::new(r.key.clone());
            self.rendezvous.register_send(key, &r.peer, r.slot);
            lock(&self.routes).insert(r.key.clone(), (r.peer.clone(), r.slot));
        }
        let feeds = g
            .feeds
            .iter()
            .map(|f| (Arc::new(f.key.clone()), f.source))
            .collect();
        let fetches = g.fetches.iter().cloned().map(Arc::new).collect();
        if let Some(spec) = &g.data {
            self.load_data(spec)?;
        }
        lock(&self.variables).extend(variables);
        lock(&self.graphs).insert(
            g.handle,
            Arc::new(Registered {
                plans,
                feeds,
                fetches,
                updates_variables: g.updates_variables,
            }),
        );
        Ok(())
    }

    /// What this task needs at least once `new` variables join those registered before:
    /// every variable's bytes, and `largest`, the largest step tensor of the graph registered.
    fn footprint(
        &self,
        new: &[(String, VariableSpec)],
        largest: &Option<(String, usize)>,
    ) -> crate::memory::Footprint {
        let mut all: BTreeMap<String, usize> = lock(&self.variables)
            .iter()
            .map(|(n, (_, dtype, dims))| {
                (n.clone(), dims.iter().product::<usize>() * dtype.size_of())
            })
            .collect();
        for (n, (_, dtype, dims)) in new {
            all.insert(n.clone(), dims.iter().product::<usize>() * dtype.size_of());
        }
        crate::memory::Footprint {
            variables: all.into_iter().collect(),
            largest_tensor: largest.clone(),
        }
    }

    /// Checks `g`'s receive slots against its partitions and the slots registered before: the
    /// sizes agree (plan, dtype × dims, the Recv's output), every listed slot has a Recv here,
    /// every cross-task Recv has a slot, and a key keeps its slot id. Returns the new slots to
    /// register. Every error names the pair.
    fn check_slots(
        &self,
        g: &RegisterGraph,
        ends: &CrossTaskEnds,
    ) -> Result<Vec<(RegisteredSlot, DType, Vec<usize>)>, String> {
        let registered = lock(&self.slots).clone();
        let mut new = Vec::new();
        let mut listed = BTreeSet::new();
        for s in &g.recv_slots {
            let pair = |msg: String| format!("task {}: pair {}: {msg}", self.task, s.key);
            let dtype: DType = s
                .dtype
                .parse()
                .map_err(|_| pair(format!("slot {}: unknown dtype `{}`", s.slot, s.dtype)))?;
            let dims = dims_usize(&s.dims).map_err(pair)?;
            let size = dims
                .iter()
                .try_fold(dtype.size_of(), |a, &d| a.checked_mul(d))
                .ok_or_else(|| pair(format!("slot {}: {dtype}{dims:?} overflows", s.slot)))?;
            let bytes = usize::try_from(s.bytes).map_err(|e| pair(e.to_string()))?;
            if size != bytes {
                return Err(pair(format!(
                    "the plan sizes slot {} at {bytes} bytes, but {dtype}{dims:?} is {size} bytes",
                    s.slot
                )));
            }
            let Some((_, node, recv_bytes)) = ends.recvs.iter().find(|(k, _, _)| *k == s.key)
            else {
                return Err(pair(format!(
                    "the plan gives this task slot {}, but none of its partitions receives the pair",
                    s.slot
                )));
            };
            if *recv_bytes != Some(bytes) {
                return Err(pair(format!(
                    "Recv `{node}` takes {recv_bytes:?} bytes, the plan's slot {} has {bytes}",
                    s.slot
                )));
            }
            listed.insert(&s.key);
            let slot = RegisteredSlot {
                slot: s.slot,
                key: s.key.clone(),
                peer: s.peer.clone(),
                bytes,
            };
            match registered.get(&s.key) {
                Some(old) if *old != slot => {
                    return Err(pair(format!(
                        "registered earlier as slot {} ({} bytes from {}), the plan now says slot {} ({bytes} bytes from {})",
                        old.slot, old.bytes, old.peer, s.slot, s.peer
                    )))
                }
                Some(_) => {}
                None => {
                    if let Some(other) = registered.values().find(|o| o.slot == s.slot) {
                        return Err(pair(format!(
                            "slot {} is already pair {}'s",
                            s.slot, other.key
                        )));
                    }
                    new.push((slot, dtype, dims));
                }
            }
        }
        for (key, node, _) in &ends.recvs {
            if !listed.contains(key) && !registered.contains_key(key) {
                return Err(format!(
                    "task {}: pair {key}: Recv `{node}` receives from another task, but the plan lists no slot for it",
                    self.task
                ));
            }
        }
        Ok(new)
    }

    /// Checks `g`'s send routes against its partitions' cross-task Sends (both ways).
    fn check_routes(&self, g: &RegisterGraph, ends: &CrossTaskEnds) -> Result<(), String> {
        let routed = lock(&self.routes).clone();
        for r in &g.send_routes {
            if !ends.sends.iter().any(|(k, _)| *k == r.key) {
                return Err(format!(
                    "task {}: pair {}: the plan routes it to slot {} of {}, but none of this task's partitions sends it",
                    self.task, r.key, r.slot, r.peer
                ));
            }
            if let Some((peer, slot)) = routed.get(&r.key) {
                if (peer, *slot) != (&r.peer, r.slot) {
                    return Err(format!(
                        "task {}: pair {}: routed earlier to slot {slot} of {peer}, the plan now says slot {} of {}",
                        self.task, r.key, r.slot, r.peer
                    ));
                }
            }
        }
        for (key, node) in &ends.sends {
            if !routed.contains_key(key) && !g.send_routes.iter().any(|r| r.key == *key) {
                return Err(format!(
                    "task {}: pair {key}: Send `{node}` sends to another task, but the plan lists no route for it",
                    self.task
                ));
            }
        }
        Ok(())
    }

    /// The receive slots this task registered on its data plane, in slot order.
    pub fn registered_slots(&self) -> Vec<RegisteredSlot> {
        let mut v: Vec<RegisteredSlot> = lock(&self.slots).values().cloned().collect();
        v.sort_by_key(|s| s.slot);
        v
    }

    /// The send routes this task registered: `(key, receiving task, slot)`, in key order.
    pub fn registered_routes(&self) -> Vec<(RendezvousKey, String, u32)> {
        lock(&self.routes)
            .iter()
            .map(|(k, (p, s))| (k.clone(), p.clone(), *s))
            .collect()
    }

    fn load_data(&self, spec: &DataSpec) -> Result<(), String> {
        if lock(&self.data).is_some() {
            return Ok(());
        }
        let path = self
            .data_path
            .clone()
            .unwrap_or_else(|| PathBuf::from(&spec.path));
        let data = match &spec.kind {
            DataKind::Csv {
                test_fraction,
                rows,
            } => {
                let all = read_csv(&path, &ReadOptions::default())
                    .map_err(|e| format!("task {} reading its data: {e}", self.task))?;
                if all.len() as u64 != *rows {
                    return Err(format!(
                        "task {}: {} has {} examples, the chief's data {} has {rows}: every task must read the same data set",
                        self.task,
                        path.display(),
                        all.len(),
                        spec.path,
                    ));
                }
                let (train, _test) = all
                    .split(*test_fraction, spec.seed)
                    .map_err(|e| e.to_string())?;
                TaskData::Csv {
                    train,
                    seed: spec.seed,
                }
            }
            DataKind::CharWindows {
                vocab,
                block_size,
                val_fraction,
                train_tokens,
                digest,
            } => {
                let at = |e: String| format!("task {}: {}: {e}", self.task, path.display());
                let vocab = CharVocab::from_saved(vocab)
                    .map_err(|e| at(format!("the chief's vocabulary: {e}")))?;
                let block = usize::try_from(*block_size).map_err(|e| at(e.to_string()))?;
                let text = read_text(&path)
                    .map_err(|e| format!("task {} reading its data: {e}", self.task))?;
                let corpus = CharCorpus::with_vocab(&text, vocab, *val_fraction).map_err(|e| {
                    at(format!(
                        "{e}; every task must read the chief's text ({})",
                        spec.path
                    ))
                })?;
                let tokens = corpus.train();
                if tokens.len() as u64 != *train_tokens || token_digest(&tokens) != *digest {
                    return Err(at(format!(
                        "its training split ({} characters) differs from that of the chief's text {} ({train_tokens} characters): every task must read the same text",
                        tokens.len(),
                        spec.path
                    )));
                }
                TaskData::Text {
                    tokens,
                    block,
                    seed: spec.seed,
                }
            }
        };
        *lock(&self.data) = Some(Arc::new(data));
        Ok(())
    }

    fn graph(&self, handle: u32) -> Result<Arc<Registered>, String> {
        lock(&self.graphs)
            .get(&handle)
            .cloned()
            .ok_or_else(|| format!("task {}: no graph {handle} is registered", self.task))
    }

    /// The tensors this task feeds for `batch` of graph `handle`, in its feed order.
    fn batch_feeds(&self, g: &Registered, batch: Option<&BatchRef>) -> Result<Vec<Tensor>, String> {
        if g.feeds.is_empty() {
            return Ok(Vec::new());
        }
        let b = batch.ok_or_else(|| {
            format!(
                "task {}: the step feeds this task but names no batch",
                self.task
            )
        })?;
        let data = lock(&self.data).clone().ok_or_else(|| {
            format!(
                "task {}: the graph feeds data but no data set was loaded",
                self.task
            )
        })?;
        let batch_size = usize::try_from(b.batch_size).map_err(|e| e.to_string())?;
        let ((x, y), whole) = match &*data {
            TaskData::Csv { train, seed } => {
                let part = train
                    .batch_part(
                        batch_size,
                        *seed,
                        b.epoch,
                        b.index as usize,
                        b.part as usize,
                        b.parts as usize,
                    )
                    .map_err(|e| format!("task {}: {e}", self.task))?;
                let start = (b.index as usize).saturating_mul(batch_size);
                (part, train.len().saturating_sub(start).min(batch_size))
            }
            TaskData::Text {
                tokens,
                block,
                seed,
            } => {
                // `CharWindows::new` refuses a step beyond `MAX_STEP_TOKENS` before allocating.
                let part = CharWindows::new(tokens.clone(), *block, batch_size, *seed)
                    .and_then(|w| w.batch_part(b.index, b.part as usize, b.parts as usize))
                    .map_err(|e| format!("task {}: step {}: {e}", self.task, b.index))?;
                (part, batch_size)
            }
        };
        let rows = x.dims().first().copied().unwrap_or(0);
        let weight = rows as f32 / whole.max(1) as f32;
        Ok(g.feeds
            .iter()
            .map(|(_, source)| match source {
                FeedSource::Features => x.clone(),
                FeedSource::Labels => y.clone(),
                FeedSource::BatchWeight => Tensor::scalar(weight),
            })
            .collect())
    }

    /// Runs one step of a registered graph, feeding this task's part of the named batch.
    /// Blocks until the step finished here (run it off the async runtime).
    pub fn run_step(&self, r: &RunStep) -> Result<StepDone, String> {
        if let Some(delay) = *STEP_DELAY {
            // A straggler on purpose (see STEP_DELAY_ENV).
            std::thread::sleep(delay);
        }
        let g = self.graph(r.handle)?;
        let feeds = self.batch_feeds(&g, r.batch.as_ref())?;
        let (fetched, concurrent_updates) = self
            .run_with_feeds(r.handle, r.step, feeds)
            .map_err(|e| e.to_string())?;
        Ok(StepDone {
            fetched: fetched.iter().map(WireTensor::from_tensor).collect(),
            concurrent_updates,
        })
    }

    /// Runs one step of graph `handle` with explicit feed values (in its feed order); returns
    /// the fetched values and how many variable updates other steps made here meanwhile.
    pub fn run_with_feeds(
        &self,
        handle: u32,
        step: u64,
        feeds: Vec<Tensor>,
    ) -> Result<(Vec<Tensor>, u64), ExecError> {
        let g = self.graph(handle).map_err(ExecError::Setup)?;
        if feeds.len() != g.feeds.len() {
            return Err(ExecError::Setup(format!(
                "graph {handle} takes {} feeds on task {}, got {}",
                g.feeds.len(),
                self.task,
                feeds.len()
            )));
        }
        let feeds: Vec<(Arc<RendezvousKey>, Tensor)> =
            g.feeds.iter().map(|(k, _)| k.clone()).zip(feeds).collect();
        let before = self.updates.load(Ordering::SeqCst);
        lock(&self.running).insert(step);
        let result = run_plans(&self.env, step, &g.plans, &feeds, &g.fetches);
        lock(&self.running).remove(&step);
        self.env.rendezvous.finish_step(step);
        let fetched = result?;
        let after = if g.updates_variables {
            self.updates.fetch_add(1, Ordering::SeqCst)
        } else {
            self.updates.load(Ordering::SeqCst)
        };
        Ok((fetched, after - before))
    }

    /// Runs one step of graph `handle`, feeding each of its feeds the tensor `value` gives for
    /// the feed's source (the chief's evaluation feeds whole held-out batches this way).
    pub fn run_with_sources(
        &self,
        handle: u32,
        step: u64,
        value: impl Fn(FeedSource) -> Tensor,
    ) -> Result<(Vec<Tensor>, u64), ExecError> {
        let g = self.graph(handle).map_err(ExecError::Setup)?;
        let feeds = g.feeds.iter().map(|(_, s)| value(*s)).collect();
        self.run_with_feeds(handle, step, feeds)
    }

    /// Drops every registered graph, every variable (the graphs of a new plan initialize them
    /// again, unless the chief restores them) and every collective group, so that the chief
    /// can register a new plan (an elastic job's new membership). Receive slots and send
    /// routes stay registered on the data plane, and a new plan may reuse a slot only with the
    /// same key, peer and size (an all-reduce plan has no cross-task pairs).
    pub fn reset(&self) {
        lock(&self.graphs).clear();
        lock(&self.variables).clear();
        lock(&self.stores).clear();
        self.collectives.leave_all();
        tracing::info!(
            "{}: dropped its graphs and collective groups for a new plan",
            self.task
        );
    }

    /// Opens this task's listener for collective group `group`; returns its address.
    pub fn prepare_group(&self, group: &str) -> Result<String, String> {
        self.collectives.prepare(group)
    }

    /// Joins collective group `group` as `rank`, connecting to every rank's address.
    pub fn join_group(&self, group: &str, rank: usize, addrs: &[String]) -> Result<(), String> {
        self.collectives.join(group, rank, addrs)
    }

    /// Aborts `step` on this task: its pending Recvs fail with `reason`.
    pub fn abort_step(&self, step: u64, reason: &str) {
        self.env.rendezvous.abort_step(
            step,
            RendezvousError::Aborted {
                step,
                cause: reason.to_string(),
            },
        );
    }

    /// What the steps running now wait for: `(step, keys)`, for failure messages.
    pub fn waiting_for(&self) -> Vec<(u64, Vec<RendezvousKey>)> {
        let steps: Vec<u64> = lock(&self.running).iter().copied().collect();
        steps
            .into_iter()
            .map(|s| (s, self.env.rendezvous.pending_recvs(s)))
            .filter(|(_, keys)| !keys.is_empty())
            .collect()
    }

    /// Every initialized variable of this task.
    pub fn variables(&self) -> Vec<NamedTensor> {
        let stores: Vec<Arc<VariableStore>> = lock(&self.stores).values().cloned().collect();
        stores
            .iter()
            .flat_map(|s| s.snapshot())
            .map(|(name, t)| NamedTensor {
                name,
                value: WireTensor::from_tensor(&t),
            })
            .collect()
    }

    /// The variables of this task's registered graphs: name → (device, dtype, dims).
    pub fn variable_specs(&self) -> BTreeMap<String, VariableSpec> {
        lock(&self.variables).clone()
    }

    /// Overwrites variables (restoring a checkpoint). Checks every value before writing any.
    pub fn set_variables(&self, values: &[NamedTensor]) -> Result<(), String> {
        let specs = self.variable_specs();
        let mut checked = Vec::with_capacity(values.len());
        for v in values {
            let (device, dtype, dims) = specs.get(&v.name).ok_or_else(|| {
                format!("task {} holds no variable named `{}`", self.task, v.name)
            })?;
            let t = v
                .value
                .to_tensor()
                .map_err(|e| format!("variable `{}`: {e}", v.name))?;
            if t.dtype() != *dtype || t.dims() != dims.as_slice() {
                return Err(format!(
                    "variable `{}` is {dtype}{dims:?}, the value is {}{:?}",
                    v.name,
                    t.dtype(),
                    t.dims()
                ));
            }
            checked.push((device.clone(), v.name.clone(), t));
        }
        for (device, name, t) in checked {
            self.store(&device).cell(&name).write(t);
        }
        Ok(())
    }
}
