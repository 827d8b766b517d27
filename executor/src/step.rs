//! Running one step of an [`ExecutionPlan`]: the dataflow scheduler.
//!
//! Each node waits for a count of distinct predecessors. A [`Runner`] (one per pool task) keeps a
//! local stack of ready nodes and runs them one after the other; a node's newly ready successors
//! go on that stack, so a chain runs on one thread without a hand-off or a queue per node.
//!
//! - *Cheap* nodes (small tensors, see [`ExecutionPlan`]) are batched: when a runner's stack
//!   grows past [`SPLIT_AT`], a chunk of [`CHUNK`] nodes is handed to the pool as one task, so a
//!   wide fan-out costs one spawn per chunk, not per node.
//! - *Expensive* nodes run alone: each newly ready one is spawned on its own, except one, kept
//!   inline when the runner has nothing else to do; before a runner starts an expensive node it
//!   hands its other ready work to the pool, so a long (or blocking, like a collective) kernel
//!   never holds other nodes back.
//! - A node with one predecessor is ready when that one completes: no atomic. Decrements of one
//!   successor by consecutive nodes (a fan-in) are coalesced into one atomic subtraction, held
//!   back for at most [`MAX_COALESCED`] nodes.
//! - The count of nodes left in the step is decremented once per runner, not once per node.
//! - Values live in plain cells ([`ValueSlots`]) whose hand-over the pending counts order;
//!   the per-step arrays are recycled ([`crate::arena`]); constants are bound by the plan, not
//!   run.
//!
//! A `Recv` never blocks a thread: it registers a callback with the rendezvous and the step
//! continues elsewhere. An error anywhere aborts the step on the rendezvous, which wakes every
//! pending `Recv` on every device with the cause; the remaining nodes are skipped and the step
//! completes with the first error.

use crate::arena::StepArrays;
use crate::error::ExecError;
use crate::memory::MemoryMeter;
use crate::plan::{ExecutionPlan, NodeAction, Release};
use crate::run::StepEnv;
use crate::slots::ValueSlots;
use crate::trace::{TraceEvent, Tracer};
use dflow_graph::kernel::{Collectives, KernelContext, OutputMemory};
use dflow_graph::{DType, OpError, Tensor};
use dflow_transport::{Rendezvous, RendezvousError, RendezvousKey};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Called once when the step finishes on this device.
pub type StepDone = Box<dyn FnOnce(Result<(), ExecError>) + Send>;

/// A runner whose stack of ready cheap nodes reaches this size hands [`CHUNK`] of them to the
/// pool (when the pool has more than one thread).
const SPLIT_AT: usize = 2 * CHUNK;

/// Cheap ready nodes per pool task when a runner shares its work.
const CHUNK: usize = 128;

/// A decrement held back (to be coalesced with the next ones of the same successor) is applied
/// at the latest once the runner has finished this many more nodes.
const MAX_COALESCED: usize = 64;

/// Everything one running step of one device needs.
pub(crate) struct StepState {
    plan: Arc<ExecutionPlan>,
    step: u64,
    pending: Box<[AtomicU32]>,
    values: ValueSlots,
    outstanding: AtomicUsize,
    failed: AtomicBool,
    error: Mutex<Option<ExecError>>,
    done: Mutex<Option<StepDone>>,
    rendezvous: Arc<dyn Rendezvous>,
    pool: Arc<rayon::ThreadPool>,
    /// More than one compute thread: worth sharing batches of ready nodes.
    share: bool,
    tracer: Option<Arc<Tracer>>,
    collectives: Option<Arc<dyn Collectives>>,
    /// Per counted slot, the reads left (see [`Release`]).
    reads: Box<[AtomicU32]>,
    /// The task's accounting of step values, when on.
    meter: Option<Arc<MemoryMeter>>,
    /// With a meter: per slot, the bytes counted for its value (0: not counted).
    counted: Box<[AtomicUsize]>,
}

/// Starts `step` of `plan`; returns immediately. `done` runs once when every node has finished
/// or been skipped.
pub(crate) fn start_step(plan: Arc<ExecutionPlan>, step: u64, env: &StepEnv, done: StepDone) {
    let n = plan.num_scheduled;
    if n == 0 {
        done(Ok(()));
        return;
    }
    let mut arrays = plan
        .arena
        .take(&plan.initial_pending, plan.num_slots, &plan.release_counts);
    let meter = env.meter.clone();
    let counted = match meter {
        Some(_) => (0..plan.num_slots).map(|_| AtomicUsize::new(0)).collect(),
        None => Box::default(),
    };
    for (slot, value) in &plan.constants {
        arrays.values.set(*slot as usize, value.clone());
    }
    let state = Arc::new(StepState {
        pending: arrays.pending,
        values: arrays.values,
        reads: arrays.reads,
        meter,
        counted,
        outstanding: AtomicUsize::new(n),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        done: Mutex::new(Some(done)),
        share: env.pool.current_num_threads() > 1,
        plan,
        step,
        rendezvous: env.rendezvous.clone(),
        pool: env.pool.clone(),
        tracer: env.tracer.clone(),
        collectives: env.collectives.clone(),
    });
    let plan = state.plan.clone();
    let (cheap, expensive): (Vec<u32>, Vec<u32>) =
        plan.roots.iter().partition(|&&r| plan.cheap[r as usize]);
    for chunk in cheap.chunks(CHUNK) {
        state.spawn(chunk);
    }
    for r in expensive {
        state.spawn(&[r]);
    }
}

impl Drop for StepState {
    /// Hands the step's arrays back to the plan (emptied) for a later step.
    fn drop(&mut self) {
        if let Some(m) = &self.meter {
            m.sub(self.counted.iter().map(|c| c.load(Ordering::Relaxed)).sum());
        }
        self.plan.arena.give_back(StepArrays {
            pending: std::mem::take(&mut self.pending),
            values: std::mem::replace(&mut self.values, ValueSlots::new(0)),
            reads: std::mem::take(&mut self.reads),
        });
    }
}

/// Decrements of one successor's pending count held back by a runner.
#[derive(Clone, Copy)]
struct Deferred {
    /// The successor.
    node: u32,
    /// How many of its predecessors finished here.
    count: u32,
    /// The runner's count of finished nodes when the first of them finished.
    since: usize,
}

/// Runs ready nodes on one thread: its stack, the successors those make ready, and so on.
struct Runner<'s> {
    state: &'s Arc<StepState>,
    /// Ready nodes to run here, the next on top.
    stack: Vec<u32>,
    /// The inputs of the kernel being run (reused: no allocation per node).
    inputs: Vec<&'s Tensor>,
    /// Expensive nodes made ready by the node just finished, to dispatch.
    expensive: SmallVec<[u32; 4]>,
    /// Decrements of one successor's pending count not applied yet.
    deferred: Option<Deferred>,
    /// Nodes finished here, not yet subtracted from the step's outstanding count.
    completed: usize,
}

impl<'s> Runner<'s> {
    fn new(state: &'s Arc<StepState>, ready: &[u32]) -> Self {
        let mut stack = Vec::with_capacity(SPLIT_AT);
        stack.extend_from_slice(ready);
        Runner {
            state,
            stack,
            inputs: Vec::with_capacity(4),
            expensive: SmallVec::new(),
            deferred: None,
            completed: 0,
        }
    }

    /// Runs until no node is ready here, then retires the nodes finished.
    fn run(mut self) {
        let plan = &*self.state.plan;
        loop {
            while let Some(n) = self.stack.pop() {
                if !plan.cheap[n as usize] {
                    // Nothing waits on a long or blocking kernel: apply the held decrements
                    // and hand whatever is ready to the pool first.
                    self.apply_deferred();
                    self.share_all();
                }
                if self.state.start_node(n, &mut self.inputs) {
                    self.finish(n);
                }
            }
            if !self.apply_deferred() {
                break;
            }
            if !self.expensive.is_empty() {
                self.dispatch_expensive();
            }
        }
        self.state.retire(self.completed);
    }

    /// Node `n` has finished: releases the inputs it read last and notifies its successors.
    #[inline]
    fn finish(&mut self, n: u32) {
        self.completed += 1;
        let plan = &*self.state.plan;
        for &slot in plan.input_slots(n) {
            self.state.read_done(slot);
        }
        for &s in plan.successors(n) {
            if plan.initial_pending[s as usize] == 1 {
                self.ready(s); // `n` was all it waited for
                continue;
            }
            match &mut self.deferred {
                Some(d) if d.node == s => d.count += 1,
                _ => {
                    self.apply_deferred();
                    self.deferred = Some(Deferred {
                        node: s,
                        count: 1,
                        since: self.completed,
                    });
                }
            }
        }
        // Bound how long a successor waits for the held decrements (e.g. behind a long chain of
        // single-predecessor nodes that never touch them).
        if matches!(self.deferred, Some(d) if self.completed - d.since >= MAX_COALESCED) {
            self.apply_deferred();
        }
        if !self.expensive.is_empty() {
            self.dispatch_expensive();
        }
    }

    /// Applies the held decrements; true when that made the successor ready.
    fn apply_deferred(&mut self) -> bool {
        let Some(Deferred {
            node: s, count: c, ..
        }) = self.deferred.take()
        else {
            return false;
        };
        // AcqRel: publishes this thread's outputs to, and acquires the other predecessors'
        // outputs for, whoever runs `s`.
        if self.state.pending[s as usize].fetch_sub(c, Ordering::AcqRel) == c {
            self.ready(s);
            return true;
        }
        false
    }

    /// `s` is ready to run.
    #[inline]
    fn ready(&mut self, s: u32) {
        if !self.state.plan.cheap[s as usize] {
            self.expensive.push(s);
            return;
        }
        self.stack.push(s);
        if self.state.share && self.stack.len() >= SPLIT_AT {
            let at = self.stack.len() - CHUNK;
            self.state.spawn(&self.stack[at..]);
            self.stack.truncate(at);
        }
    }

    /// Keeps one newly ready expensive node to run here if nothing else is, spawns the others.
    fn dispatch_expensive(&mut self) {
        if self.stack.is_empty() {
            if let Some(e) = self.expensive.pop() {
                self.stack.push(e);
            }
        }
        for e in self.expensive.drain(..) {
            self.state.spawn(&[e]);
        }
    }

    /// Hands every ready node held here to the pool.
    fn share_all(&mut self) {
        for e in self.expensive.drain(..) {
            self.state.spawn(&[e]);
        }
        for chunk in self.stack.chunks(CHUNK) {
            self.state.spawn(chunk);
        }
        self.stack.clear();
    }
}

impl StepState {
    /// A node that read `slot` finished: the value is dropped when that was its last read.
    #[inline]
    fn read_done(&self, slot: u32) {
        let last = match self.plan.release[slot as usize] {
            Release::AtEnd => false,
            Release::AfterOnlyRead => true,
            // AcqRel: every other reader's reads happen before the last reader's take.
            Release::Counted(i) => self.reads[i as usize].fetch_sub(1, Ordering::AcqRel) == 1,
        };
        if !last {
            return;
        }
        // SAFETY: the producer of `slot` and every node reading it in this step have finished
        // (this is the last read, ordered after the others by the count above, and a reader
        // runs after the producer); nothing touches the slot again in this step.
        drop(unsafe { self.values.take(slot as usize) });
        if let Some(m) = &self.meter {
            m.sub(self.counted[slot as usize].swap(0, Ordering::Relaxed));
        }
    }

    /// Counts the new values of node `n` (outputs `base..base + k`, read from `outputs`)
    /// against the meter, unless they share an input's buffer or are a variable's value.
    fn count_outputs(&self, n: u32, inputs: &[&Tensor], outputs: &[Option<Tensor>]) {
        let Some(m) = &self.meter else {
            return;
        };
        let node = &self.plan.nodes[n as usize];
        if !node.variables.is_empty() && matches!(node.op, "Variable" | "ReadVariable") {
            return;
        }
        let mut total = 0;
        for (k, t) in outputs.iter().enumerate() {
            let Some(t) = t else { continue };
            let ptr = t.data_ptr();
            if inputs.iter().any(|i| i.data_ptr() == ptr) {
                continue;
            }
            let bytes = t.byte_len();
            self.counted[node.output_base as usize + k].store(bytes, Ordering::Relaxed);
            total += bytes;
        }
        if let Err(over) = m.add(total) {
            self.fail(ExecError::MemoryLimit {
                node: node.name.clone(),
                op: node.op.to_string(),
                device: self.plan.device_label.clone(),
                live: over.live,
                limit: over.limit,
            });
        }
    }

    /// Runs `ready` (and what they make ready) in a new pool task.
    fn spawn(self: &Arc<Self>, ready: &[u32]) {
        let work: SmallVec<[u32; 8]> = SmallVec::from_slice(ready);
        let s = self.clone();
        self.pool.spawn(move || Runner::new(&s, &work).run());
    }

    /// Subtracts `completed` finished nodes from the step's count; the runner that brings it to
    /// zero reports the step's result.
    fn retire(&self, completed: usize) {
        if completed == 0 || self.outstanding.fetch_sub(completed, Ordering::AcqRel) != completed {
            return;
        }
        // The step's values leave the meter now, not when the last runner lets go of the state:
        // the caller may start the next step first, and would see this one's values counted.
        if let Some(m) = &self.meter {
            m.sub(
                self.counted
                    .iter()
                    .map(|c| c.swap(0, Ordering::Relaxed))
                    .sum(),
            );
        }
        let result = match self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        };
        if let Some(done) = self.done.lock().unwrap_or_else(|p| p.into_inner()).take() {
            done(result);
        }
    }

    /// Executes node `n` (once per step, after its predecessors), with `inputs` as scratch space
    /// for a kernel's input list. Returns false when completion is asynchronous (Recv).
    #[inline]
    fn start_node<'s>(self: &'s Arc<Self>, n: u32, inputs: &mut Vec<&'s Tensor>) -> bool {
        let node = &self.plan.nodes[n as usize];
        let failed = self.failed.load(Ordering::Acquire);
        match &node.action {
            NodeAction::Recv(key) => {
                if failed {
                    return true;
                }
                let s = self.clone();
                let t0 = self.tracer.as_ref().map(|t| t.now_us());
                self.rendezvous.recv_async(
                    key,
                    self.step,
                    Box::new(move |r| {
                        let node = &s.plan.nodes[n as usize];
                        match r {
                            Ok(t) => {
                                if let (Some(tr), Some(t0)) = (&s.tracer, t0) {
                                    tr.record(TraceEvent::span(
                                        &s.plan.device_label,
                                        "Recv",
                                        &node.name,
                                        t0,
                                        Some(t.byte_len()),
                                        s.step,
                                    ));
                                }
                                if let Some(m) = &s.meter {
                                    let bytes = t.byte_len();
                                    s.counted[node.output_base as usize]
                                        .store(bytes, Ordering::Relaxed);
                                    if let Err(over) = m.add(bytes) {
                                        s.fail(ExecError::MemoryLimit {
                                            node: node.name.clone(),
                                            op: "Recv".into(),
                                            device: s.plan.device_label.clone(),
                                            live: over.live,
                                            limit: over.limit,
                                        });
                                    }
                                }
                                // SAFETY: this callback runs once (FnOnce) for the Recv, the
                                // producer of its slot; the completion that lets consumers
                                // read it is handed to the pool below, after this write.
                                unsafe {
                                    s.values.outputs_mut(node.output_base as usize, 1)[0] = Some(t);
                                }
                            }
                            Err(e) => s.fail(node_transfer_error(&s.plan, n, e)),
                        }
                        // Continue on the pool: this callback may run on another device's thread.
                        let s2 = s.clone();
                        s.pool.spawn(move || {
                            let mut runner = Runner::new(&s2, &[]);
                            runner.finish(n);
                            runner.run();
                        });
                    }),
                );
                false
            }
            _ if failed => true,
            NodeAction::Send(key) => {
                let slot = self.plan.input_slots(n).first();
                // SAFETY: a Send runs after its producer finished (slot protocol, rule 2).
                if let Some(v) = slot.and_then(|&i| unsafe { self.values.get(i as usize) }) {
                    let t0 = self.tracer.as_ref().map(|t| t.now_us());
                    if let Err(e) = self.rendezvous.send(key, self.step, v.clone()) {
                        self.fail(node_transfer_error(&self.plan, n, e));
                    }
                    if let (Some(tr), Some(t0)) = (&self.tracer, t0) {
                        tr.record(TraceEvent::span(
                            &self.plan.device_label,
                            "Send",
                            &node.name,
                            t0,
                            Some(v.byte_len()),
                            self.step,
                        ));
                    }
                }
                true
            }
            NodeAction::Kernel(kernel) => {
                inputs.clear();
                for &slot in self.plan.input_slots(n) {
                    // SAFETY: this node runs after every producer of its inputs finished
                    // (slot protocol, rule 2).
                    match unsafe { self.values.get(slot as usize) } {
                        Some(v) => inputs.push(v),
                        None => return true, // upstream skipped after a failure
                    }
                }
                let base = node.output_base as usize;
                // SAFETY: this node produces these slots and runs once per step; its consumers
                // read them only after it finished (slot protocol, rule 1).
                let outputs = unsafe { self.values.outputs_mut(base, node.num_outputs as usize) };
                let t0 = self.tracer.as_ref().map(|t| t.now_us());
                let send_memory = SendMemory {
                    rendezvous: &*self.rendezvous,
                    keys: &node.output_sends,
                    step: self.step,
                };
                let mut ctx = KernelContext {
                    node: &node.name,
                    inputs,
                    variables: &node.variables,
                    step: self.step,
                    outputs,
                    collectives: self.collectives.as_deref(),
                    output_memory: if node.output_sends.is_empty() {
                        None
                    } else {
                        Some(&send_memory)
                    },
                };
                let result = kernel.compute(&mut ctx);
                if let (Some(tr), Some(t0)) = (&self.tracer, t0) {
                    tr.record(TraceEvent::span(
                        &self.plan.device_label,
                        node.op,
                        &node.name,
                        t0,
                        None,
                        self.step,
                    ));
                }
                let kernel_error = |error| ExecError::Kernel {
                    node: node.name.clone(),
                    op: node.op.to_string(),
                    device: self.plan.device_label.clone(),
                    error: Box::new(error),
                };
                match result {
                    Ok(()) => {
                        if let Some(i) = outputs.iter().position(Option::is_none) {
                            self.fail(kernel_error(OpError::MissingOutput { index: i }));
                        }
                        self.count_outputs(n, inputs, outputs);
                    }
                    // Outputs set before the error stay: nothing runs after a failure.
                    Err(error) => self.fail(kernel_error(error)),
                }
                true
            }
        }
    }

    /// Records the first error and aborts the step everywhere.
    fn fail(&self, e: ExecError) {
        let first = {
            let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(e.clone());
                true
            } else {
                false
            }
        };
        self.failed.store(true, Ordering::Release);
        if first && !is_abort_echo(&e) {
            self.rendezvous.abort_step(
                self.step,
                RendezvousError::Aborted {
                    step: self.step,
                    cause: e.to_string(),
                },
            );
        }
    }
}

/// The memory of a kernel's outputs that feed Sends: where the rendezvous sends them from.
#[derive(Debug)]
struct SendMemory<'a> {
    rendezvous: &'a dyn Rendezvous,
    keys: &'a [Option<Arc<RendezvousKey>>],
    step: u64,
}

impl OutputMemory for SendMemory<'_> {
    fn allocate(&self, output: usize, dtype: DType, dims: &[usize]) -> Option<Tensor> {
        let key = self.keys.get(output)?.as_ref()?;
        self.rendezvous.send_buffer(key, self.step, dtype, dims)
    }
}

fn node_transfer_error(plan: &ExecutionPlan, n: u32, source: RendezvousError) -> ExecError {
    ExecError::Transfer {
        node: plan.nodes[n as usize].name.clone(),
        device: plan.device_label.clone(),
        source: Box::new(source),
    }
}

/// True for an error that only reports that the step was aborted elsewhere.
pub(crate) fn is_abort_echo(e: &ExecError) -> bool {
    matches!(e, ExecError::Transfer { source, .. } if matches!(**source, RendezvousError::Aborted { .. }))
}

#[cfg(all(test, target_os = "linux"))]
mod shm_tests {
    use super::*;
    use crate::plan::ExecutionPlan;
    use crate::run::run_plans;
    use crate::variables::VariableStore;
    use dflow_graph::builder::GraphBuilder;
    use dflow_graph::tensor::buffer_copies;
    use dflow_graph::DeviceName;
    use dflow_transport::shm::ShmPlane;
    use dflow_transport::DataPlane;
    use dflow_transport::TcpConfig;
    use std::time::Duration;

    const WORKER: &str = "/job:worker/replica:0/task:0/device:CPU:0";
    const PS: &str = "/job:ps/replica:0/task:0/device:CPU:0";

    /// A MatMul whose product is sent to another task over shared memory writes the product
    /// straight into the slot: the Recv output lies in the receiver's mapping, nothing is copied.
    /// An Identity's output (a constant's buffer) is copied into its slot once, and counted.
    #[test]
    fn a_kernel_feeding_a_shm_send_writes_into_the_slot() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let local = "127.0.0.1:0".parse().unwrap();
        let (ps, worker) = rt.block_on(async {
            let c = TcpConfig::default();
            let ps = ShmPlane::bind("ps:0", local, c, None).await.unwrap();
            let worker = ShmPlane::bind("worker:0", local, c, None).await.unwrap();
            worker
                .clone()
                .connect("ps:0".into(), ps.local_addr())
                .await
                .unwrap();
            (ps, worker)
        });
        let mut b = GraphBuilder::new();
        b.with_device(WORKER, |b| {
            let a = b.constant(
                "a",
                Tensor::from_slice(&[2, 3], &[1f32, 2., 3., 4., 5., 6.]).unwrap(),
            );
            let w = b.constant(
                "w",
                Tensor::from_slice(&[3, 2], &[1f32, 0., 0., 1., 1., 1.]).unwrap(),
            );
            let m = b.matmul("m", &a, &w);
            let id = b.unary("Identity", "id", &w);
            for (node, name) in [(&m, "m:0"), (&id, "id:0")] {
                b.op("Send", &format!("send_{}", &name[..name.len() - 2]))
                    .input(node)
                    .attr("tensor_name", name)
                    .attr("send_device", WORKER)
                    .attr("recv_device", PS)
                    .finish();
            }
        });
        let graph = b.build().unwrap();
        let device = DeviceName::parse(WORKER).unwrap();
        let plan =
            Arc::new(ExecutionPlan::compile(&device, &graph, &VariableStore::default()).unwrap());
        let keys: Vec<Arc<RendezvousKey>> = ["m:0", "id:0"]
            .iter()
            .map(|n| Arc::new(RendezvousKey::new(WORKER, PS, n)))
            .collect();
        for (slot, (k, dims)) in keys.iter().zip([[2usize, 2], [3, 2]]).enumerate() {
            ps.register_recv(slot as u32, "worker:0", k.clone(), DType::F32, &dims)
                .unwrap();
            worker.register_send(k.clone(), "ps:0", slot as u32);
        }
        let env = StepEnv {
            rendezvous: worker.clone().as_rendezvous(),
            pool: Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(2)
                    .build()
                    .unwrap(),
            ),
            tracer: None,
            timeout: Duration::from_secs(20),
            collectives: None,
            meter: None,
        };
        let copies = buffer_copies();
        for step in 1..=3 {
            run_plans(&env, step, std::slice::from_ref(&plan), &[], &[]).unwrap();
            let got: Vec<Tensor> = keys
                .iter()
                .map(|k| {
                    let (tx, rx) = std::sync::mpsc::channel();
                    ps.recv_async(k, step, Box::new(move |r| tx.send(r).unwrap()));
                    rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap()
                })
                .collect();
            assert_eq!(got[0].as_slice::<f32>().unwrap(), &[4., 5., 10., 11.]);
            assert_eq!(got[1].as_slice::<f32>().unwrap(), &[1., 0., 0., 1., 1., 1.]);
            for (k, t) in keys.iter().zip(&got) {
                let p = t.data_ptr() as usize;
                assert!(
                    ps.recv_mapping(k).unwrap().contains(&p),
                    "{k} aliases its slot"
                );
            }
            worker.finish_step(step);
            ps.finish_step(step);
        }
        let stats = worker.stats();
        assert_eq!(
            stats.zero_copy_sends, 3,
            "MatMul wrote its product in the slot"
        );
        assert_eq!((stats.copied_sends, stats.copied_bytes), (3, 3 * 24));
        assert_eq!(buffer_copies(), copies);
        rt.block_on(async {
            worker.close(Duration::from_secs(1)).await;
            ps.close(Duration::from_secs(1)).await;
        });
    }
}
