//! Running one step of an [`ExecutionPlan`]: the dataflow scheduler.
//!
//! Each node waits for a count of incoming edges. When a node finishes, it decrements its
//! successors' counts; the first newly ready successor runs inline on the same thread (so a
//! chain runs without a thread hand-off per node) and the others go to the compute pool. A
//! `Recv` never blocks a thread: it registers a callback with the rendezvous and the step
//! continues elsewhere. An error anywhere aborts the step on the rendezvous, which wakes every
//! pending `Recv` on every device with the cause; the remaining nodes are skipped and the step
//! completes with the first error.

use crate::error::ExecError;
use crate::plan::{ExecutionPlan, NodeAction};
use crate::trace::{TraceEvent, Tracer};
use dflow_graph::kernel::{Collectives, KernelContext, OutputMemory};
use dflow_graph::{DType, Tensor};
use dflow_transport::{Rendezvous, RendezvousError, RendezvousKey};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Called once when the step finishes on this device.
pub type StepDone = Box<dyn FnOnce(Result<(), ExecError>) + Send>;

/// Everything one running step of one device needs.
pub(crate) struct StepState {
    plan: Arc<ExecutionPlan>,
    step: u64,
    pending: Vec<AtomicU32>,
    values: Vec<OnceLock<Tensor>>,
    outstanding: AtomicUsize,
    failed: AtomicBool,
    error: Mutex<Option<ExecError>>,
    done: Mutex<Option<StepDone>>,
    rendezvous: Arc<dyn Rendezvous>,
    pool: Arc<rayon::ThreadPool>,
    tracer: Option<Arc<Tracer>>,
    collectives: Option<Arc<dyn Collectives>>,
}

/// Starts `step` of `plan`; returns immediately. `done` runs once when every node has finished
/// or been skipped.
pub(crate) fn start_step(
    plan: Arc<ExecutionPlan>,
    step: u64,
    rendezvous: Arc<dyn Rendezvous>,
    pool: Arc<rayon::ThreadPool>,
    tracer: Option<Arc<Tracer>>,
    collectives: Option<Arc<dyn Collectives>>,
    done: StepDone,
) {
    let n = plan.nodes.len();
    if n == 0 {
        done(Ok(()));
        return;
    }
    let state = Arc::new(StepState {
        pending: plan
            .nodes
            .iter()
            .map(|p| AtomicU32::new(p.num_pending))
            .collect(),
        values: (0..plan.num_slots).map(|_| OnceLock::new()).collect(),
        outstanding: AtomicUsize::new(n),
        failed: AtomicBool::new(false),
        error: Mutex::new(None),
        done: Mutex::new(Some(done)),
        plan,
        step,
        rendezvous,
        pool,
        tracer,
        collectives,
    });
    let roots = state.plan.roots.clone();
    for r in roots {
        let s = state.clone();
        state.pool.spawn(move || s.run_from(r));
    }
}

impl StepState {
    /// Runs `first` and then, inline, one newly ready successor at a time.
    fn run_from(self: &Arc<Self>, first: u32) {
        let mut next = Some(first);
        while let Some(n) = next.take() {
            if !self.start_node(n) {
                continue; // a Recv: completion arrives through its callback
            }
            let mut ready: SmallVec<[u32; 8]> = SmallVec::new();
            self.complete(n, &mut ready);
            let mut it = ready.into_iter();
            next = it.next();
            for other in it {
                let s = self.clone();
                self.pool.spawn(move || s.run_from(other));
            }
        }
    }

    /// Executes node `n`. Returns false when completion is asynchronous (Recv).
    fn start_node(self: &Arc<Self>, n: u32) -> bool {
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
                                    ));
                                }
                                let _ = s.values[node.output_base as usize].set(t);
                            }
                            Err(e) => s.fail(node_transfer_error(&s.plan, n, e)),
                        }
                        // Continue on the pool: this callback may run on another device's thread.
                        let s2 = s.clone();
                        s.pool.spawn(move || {
                            let mut ready: SmallVec<[u32; 8]> = SmallVec::new();
                            s2.complete(n, &mut ready);
                            for r in ready {
                                let s3 = s2.clone();
                                s2.pool.spawn(move || s3.run_from(r));
                            }
                        });
                    }),
                );
                false
            }
            _ if failed => true,
            NodeAction::Send(key) => {
                if let Some(v) = self.values[node.inputs[0] as usize].get() {
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
                        ));
                    }
                }
                true
            }
            NodeAction::Kernel(kernel) => {
                let mut inputs: SmallVec<[Tensor; 4]> = SmallVec::with_capacity(node.inputs.len());
                for &slot in &node.inputs {
                    match self.values[slot as usize].get() {
                        Some(v) => inputs.push(v.clone()),
                        None => return true, // upstream skipped after a failure
                    }
                }
                let mut outputs: SmallVec<[Option<Tensor>; 2]> = SmallVec::new();
                outputs.resize(node.num_outputs as usize, None);
                let t0 = self.tracer.as_ref().map(|t| t.now_us());
                let send_memory = SendMemory {
                    rendezvous: &*self.rendezvous,
                    keys: &node.output_sends,
                    step: self.step,
                };
                let mut ctx = KernelContext {
                    node: &node.name,
                    inputs: &inputs,
                    variables: &node.variables,
                    step: self.step,
                    outputs: &mut outputs,
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
                    ));
                }
                match result {
                    Ok(()) => {
                        for (i, o) in outputs.into_iter().enumerate() {
                            match o {
                                Some(t) => {
                                    let _ = self.values[node.output_base as usize + i].set(t);
                                }
                                None => {
                                    self.fail(ExecError::Kernel {
                                        node: node.name.clone(),
                                        op: node.op.to_string(),
                                        device: self.plan.device_label.clone(),
                                        message: format!("kernel did not produce output {i}"),
                                    });
                                    break;
                                }
                            }
                        }
                    }
                    Err(message) => self.fail(ExecError::Kernel {
                        node: node.name.clone(),
                        op: node.op.to_string(),
                        device: self.plan.device_label.clone(),
                        message,
                    }),
                }
                true
            }
        }
    }

    /// Marks `n` finished: notifies successors (collecting the newly ready ones) and, if it was
    /// the last node, reports the step's result.
    fn complete(&self, n: u32, ready: &mut SmallVec<[u32; 8]>) {
        for &s in &self.plan.nodes[n as usize].successors {
            if self.pending[s as usize].fetch_sub(1, Ordering::AcqRel) == 1 {
                ready.push(s);
            }
        }
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
            let result = match self.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
                Some(e) => Err(e),
                None => Ok(()),
            };
            if let Some(done) = self.done.lock().unwrap_or_else(|p| p.into_inner()).take() {
                done(result);
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

    /// The value in `slot` (for fetching results of local nodes in tests).
    #[allow(dead_code)]
    pub(crate) fn value(&self, slot: usize) -> Option<&Tensor> {
        self.values.get(slot).and_then(|v| v.get())
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
    use crate::run::{run_plans, StepEnv};
    use crate::variables::VariableStore;
    use dflow_graph::builder::GraphBuilder;
    use dflow_graph::tensor::buffer_copies;
    use dflow_graph::DeviceName;
    use dflow_transport::shm::ShmPlane;
    use dflow_transport::tcp::TcpConfig;
    use dflow_transport::DataPlane;
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
