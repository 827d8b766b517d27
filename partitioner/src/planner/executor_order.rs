//! The order dflow's executor runs a task's step in, modelled (for [`super::accounting`]: the
//! peak of a step's tensors depends on it). It follows `executor/src/step.rs` and
//! `executor/src/plan.rs` rule by rule: which nodes are cheap, a runner's stack, the held-back
//! decrements of successors with several inputs, expensive nodes dispatched alone, the pool's
//! jobs. Every node takes one tick; with one thread the order is the executor's own.

use dflow_graph::Graph;
use petgraph::graph::NodeIndex;
use std::collections::VecDeque;

/// Ops a runner treats as cheap whatever their size (executor `plan.rs`).
const CONSTANT_TIME_OPS: &[&str] = &["NoOp", "Const", "Identity", "Recv", "Variable"];

/// Inputs and outputs of at most this many elements make a node cheap (executor `plan.rs`).
const CHEAP_ELEMENTS: usize = 1024;

/// Ready nodes a runner hands to the pool at once (executor `step.rs`).
const CHUNK: usize = 128;

/// Whether the executor runs `idx` batched with other ready nodes on one runner (executor
/// `plan.rs`, `is_cheap`): never a collective, always a constant-time op, else when its
/// inputs and outputs hold at most [`CHEAP_ELEMENTS`] elements (an unknown size is not cheap).
fn is_cheap(g: &Graph, idx: NodeIndex) -> bool {
    let node = g.node(idx);
    if node.op.starts_with("Collective") {
        return false;
    }
    if CONSTANT_TIME_OPS.contains(&node.op) {
        return true;
    }
    let mut total = 0usize;
    let inputs = g.inputs(idx);
    let types = inputs
        .iter()
        .map(|&(s, k)| &g.node(s).outputs[k])
        .chain(node.outputs.iter());
    for t in types {
        match t.shape.num_elements() {
            Some(n) => total = total.saturating_add(n),
            None => return false,
        }
    }
    total <= CHEAP_ELEMENTS
}

/// Ready nodes a runner keeps before it hands some to the pool (executor `step.rs`).
const SPLIT_AT: usize = 2 * CHUNK;

/// Decrements a runner holds back before it applies them (executor `step.rs`).
const MAX_COALESCED: usize = 64;

/// A successor's pending count decremented by a runner but not yet applied.
#[derive(Debug, Clone, Copy)]
struct Deferred {
    node: NodeIndex,
    count: usize,
    since: usize,
}

/// The graph's dependencies, as the executor's plan holds them.
struct Deps {
    /// Distinct predecessors (data and control) of each node.
    initial: Vec<usize>,
    /// Distinct successors of each node.
    successors: Vec<Vec<NodeIndex>>,
    cheap: Vec<bool>,
}

/// What the threads share: pending counts, the pool's jobs and the order so far.
struct Shared {
    pending: Vec<usize>,
    /// Jobs: (the thread that spawned it, if one did; its nodes).
    jobs: VecDeque<(Option<usize>, Vec<NodeIndex>)>,
    order: Vec<NodeIndex>,
    /// More than one thread: runners share big stacks (executor `StepState::share`).
    share: bool,
}

/// One runner of the executor's scheduler (executor `step.rs`, `Runner`): its stack of ready
/// nodes (the next on top), the expensive nodes made ready by the node it just finished, and
/// the decrements of one successor's pending count it holds back.
#[derive(Debug)]
struct Runner {
    thread: usize,
    stack: Vec<NodeIndex>,
    expensive: Vec<NodeIndex>,
    deferred: Option<Deferred>,
    completed: usize,
}

impl Runner {
    fn new(thread: usize, stack: Vec<NodeIndex>) -> Runner {
        Runner {
            thread,
            stack,
            expensive: Vec::new(),
            deferred: None,
            completed: 0,
        }
    }

    fn spawn(&self, shared: &mut Shared, nodes: &[NodeIndex]) {
        shared.jobs.push_back((Some(self.thread), nodes.to_vec()));
    }

    fn ready(&mut self, deps: &Deps, shared: &mut Shared, s: NodeIndex) {
        if !deps.cheap[s.index()] {
            self.expensive.push(s);
            return;
        }
        self.stack.push(s);
        if shared.share && self.stack.len() >= SPLIT_AT {
            let at = self.stack.len() - CHUNK;
            let tail = self.stack.split_off(at);
            self.spawn(shared, &tail);
        }
    }

    fn apply_deferred(&mut self, deps: &Deps, shared: &mut Shared) -> bool {
        let Some(d) = self.deferred.take() else {
            return false;
        };
        let left = &mut shared.pending[d.node.index()];
        *left -= d.count;
        if *left == 0 {
            self.ready(deps, shared, d.node);
            return true;
        }
        false
    }

    fn dispatch_expensive(&mut self, shared: &mut Shared) {
        if self.stack.is_empty() {
            if let Some(e) = self.expensive.pop() {
                self.stack.push(e);
            }
        }
        for e in std::mem::take(&mut self.expensive) {
            self.spawn(shared, &[e]);
        }
    }

    fn share_all(&mut self, shared: &mut Shared) {
        for e in std::mem::take(&mut self.expensive) {
            self.spawn(shared, &[e]);
        }
        for chunk in std::mem::take(&mut self.stack).chunks(CHUNK) {
            self.spawn(shared, chunk);
        }
    }

    fn finish(&mut self, deps: &Deps, shared: &mut Shared, n: NodeIndex) {
        self.completed += 1;
        for &s in &deps.successors[n.index()] {
            if deps.initial[s.index()] == 1 {
                shared.pending[s.index()] = 0;
                self.ready(deps, shared, s);
                continue;
            }
            match &mut self.deferred {
                Some(d) if d.node == s => d.count += 1,
                _ => {
                    self.apply_deferred(deps, shared);
                    self.deferred = Some(Deferred {
                        node: s,
                        count: 1,
                        since: self.completed,
                    });
                }
            }
        }
        if matches!(self.deferred, Some(d) if self.completed - d.since >= MAX_COALESCED) {
            self.apply_deferred(deps, shared);
        }
        if !self.expensive.is_empty() {
            self.dispatch_expensive(shared);
        }
    }

    /// Runs one node; false when the runner has nothing left to run.
    fn step(&mut self, deps: &Deps, shared: &mut Shared) -> bool {
        loop {
            if let Some(n) = self.stack.pop() {
                if !deps.cheap[n.index()] {
                    self.apply_deferred(deps, shared);
                    self.share_all(shared);
                }
                shared.order.push(n);
                self.finish(deps, shared, n);
                return true;
            }
            if !self.apply_deferred(deps, shared) {
                return false;
            }
            if !self.expensive.is_empty() {
                self.dispatch_expensive(shared);
            }
        }
    }
}

/// The order the executor's scheduler runs `g` in with `threads` compute threads, one node per
/// thread in turn (every node takes one tick), following executor `step.rs`: the step hands
/// the cheap roots to the pool in chunks and each expensive root alone; a runner runs its stack
/// of ready nodes last first; a finished node's successors that waited for it alone are ready
/// at once, the others' counts are decremented later (held back, one successor at a time);
/// of the expensive nodes made ready it runs one itself when nothing else is ready and hands
/// the others to the pool; it hands everything ready to the pool before it runs an expensive
/// node. An idle thread takes the job it spawned last, else the oldest job (work stealing).
pub(crate) fn run_order(g: &Graph, threads: usize) -> Vec<NodeIndex> {
    let n = g.num_nodes();
    let mut initial = vec![0usize; n];
    let mut successors: Vec<Vec<NodeIndex>> = vec![Vec::new(); n];
    for idx in g.node_indices() {
        let mut preds: Vec<NodeIndex> = g.inputs(idx).into_iter().map(|(s, _)| s).collect();
        preds.extend(g.control_inputs(idx));
        preds.sort();
        preds.dedup();
        initial[idx.index()] = preds.len();
        for p in preds {
            successors[p.index()].push(idx);
        }
    }
    let deps = Deps {
        cheap: g.node_indices().map(|i| is_cheap(g, i)).collect(),
        initial,
        successors,
    };
    let (roots_cheap, roots_expensive): (Vec<NodeIndex>, Vec<NodeIndex>) = g
        .node_indices()
        .filter(|i| deps.initial[i.index()] == 0)
        .partition(|i| deps.cheap[i.index()]);
    let threads = threads.max(1);
    let mut shared = Shared {
        pending: deps.initial.clone(),
        jobs: roots_cheap
            .chunks(CHUNK)
            .map(|c| (None, c.to_vec()))
            .collect(),
        order: Vec::with_capacity(n),
        share: threads > 1,
    };
    shared
        .jobs
        .extend(roots_expensive.into_iter().map(|r| (None, vec![r])));
    let mut runners: Vec<Option<Runner>> = (0..threads).map(|_| None).collect();
    loop {
        let mut ran = false;
        for (t, slot) in runners.iter_mut().enumerate() {
            if slot.is_none() {
                // Its own newest job, else the oldest job of anyone.
                let own = shared.jobs.iter().rposition(|(by, _)| *by == Some(t));
                let job = match own {
                    Some(i) => shared.jobs.remove(i),
                    None => shared.jobs.pop_front(),
                };
                *slot = job.map(|(_, stack)| Runner::new(t, stack));
            }
            if let Some(runner) = slot.as_mut() {
                if runner.step(&deps, &mut shared) {
                    ran = true;
                } else {
                    *slot = None;
                }
            }
        }
        if !ran && shared.jobs.is_empty() && runners.iter().all(Option::is_none) {
            break;
        }
    }
    shared.order
}
