//! Tensor parallelism's placement changes (`graph/src/ops/collective_tp.rs`) on `T` ranks in
//! threads over an in-memory collective runtime: every op's forward turns the logical tensor's
//! pieces into the pieces of the target placement, and its gradient (built by autodiff, its
//! collectives run across the ranks too) equals central finite differences of the logical
//! loss, read in the tensor-parallel convention (a `Shard` rank holds its slice's gradient, a
//! `Replicate` or `Partial` rank the whole gradient).

use dflow_graph::autodiff::gradients;
use dflow_graph::axis_split::AxisSplit;
use dflow_graph::builder::GraphBuilder;
use dflow_graph::kernel::{
    CollectiveCall, Collectives, KernelContext, KernelInit, ReduceKind, VariableCell,
};
use dflow_graph::{AttrValue, DType, Graph, GraphDef, InputRef, Shape, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The ranks' deposits per (instance, step): the inputs and how many ranks have read them.
type Slots = HashMap<(i64, u64), (Vec<Option<Tensor>>, usize)>;

/// An in-memory group of `n` ranks: each call waits (at most 10 s) for every rank's input.
#[derive(Debug)]
struct Hub {
    n: usize,
    slots: Mutex<Slots>,
    ready: Condvar,
}

#[derive(Debug)]
struct Rank {
    hub: Arc<Hub>,
    rank: usize,
}

impl Rank {
    /// Every rank's input to this call, in rank order.
    fn exchange(&self, call: &CollectiveCall<'_>, x: &Tensor) -> Result<Vec<Tensor>, String> {
        let key = (call.instance, call.step);
        let n = self.hub.n;
        let mut slots = self.hub.slots.lock().map_err(|e| e.to_string())?;
        slots.entry(key).or_insert_with(|| (vec![None; n], 0)).0[self.rank] = Some(x.clone());
        self.hub.ready.notify_all();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (inputs, _) = &slots[&key];
            if inputs.iter().all(Option::is_some) {
                break;
            }
            let left = deadline
                .checked_duration_since(Instant::now())
                .ok_or_else(|| format!("rank {} timed out waiting for {key:?}", self.rank))?;
            slots = self
                .hub
                .ready
                .wait_timeout(slots, left)
                .map_err(|e| e.to_string())?
                .0;
        }
        let entry = slots.get_mut(&key).ok_or("the slot vanished")?;
        let all: Vec<Tensor> = entry.0.iter().flatten().cloned().collect();
        entry.1 += 1;
        if entry.1 == n {
            slots.remove(&key);
        }
        Ok(all)
    }
}

/// Dimension 0 of `t` cut in `n`: part `r`.
fn part0(t: &Tensor, r: usize, n: usize) -> Tensor {
    let dims = t.dims();
    AxisSplit {
        axis: 0,
        blocks: 1,
        parts: n,
        padded: dims[0],
    }
    .shard(t, r)
    .unwrap()
}

fn concat0(ts: &[Tensor]) -> Tensor {
    let mut dims = ts[0].dims().to_vec();
    dims[0] *= ts.len();
    let v: Vec<f64> = ts.iter().flat_map(|t| t.to_f64_vec()).collect();
    Tensor::from_slice(&dims, &v).unwrap()
}

fn sum(ts: &[Tensor]) -> Tensor {
    let mut v = vec![0.0f64; ts[0].num_elements()];
    for t in ts {
        for (s, x) in v.iter_mut().zip(t.to_f64_vec()) {
            *s += x;
        }
    }
    Tensor::from_slice(ts[0].dims(), &v).unwrap()
}

impl Collectives for Rank {
    fn rank_and_size(&self, _group: &str) -> Result<(usize, usize), String> {
        Ok((self.rank, self.hub.n))
    }
    fn all_reduce(
        &self,
        call: &CollectiveCall<'_>,
        x: &Tensor,
        _op: ReduceKind,
    ) -> Result<Tensor, String> {
        Ok(sum(&self.exchange(call, x)?))
    }
    fn all_gather(&self, call: &CollectiveCall<'_>, x: &Tensor) -> Result<Tensor, String> {
        Ok(concat0(&self.exchange(call, x)?))
    }
    fn reduce_scatter(
        &self,
        call: &CollectiveCall<'_>,
        x: &Tensor,
        _op: ReduceKind,
    ) -> Result<Tensor, String> {
        Ok(part0(&sum(&self.exchange(call, x)?), self.rank, self.hub.n))
    }
    fn broadcast(
        &self,
        call: &CollectiveCall<'_>,
        x: &Tensor,
        root: usize,
    ) -> Result<Tensor, String> {
        Ok(self.exchange(call, x)?[root].clone())
    }
    fn all_to_all(&self, call: &CollectiveCall<'_>, x: &Tensor) -> Result<Tensor, String> {
        let all = self.exchange(call, x)?;
        let parts: Vec<Tensor> = all
            .iter()
            .map(|t| part0(t, self.rank, self.hub.n))
            .collect();
        Ok(concat0(&parts))
    }
}

/// Runs `fetch` of `def` with `feeds` on one rank (step `step`).
fn run(
    def: &GraphDef,
    feeds: &HashMap<String, Tensor>,
    fetch: &str,
    c: &Rank,
    step: u64,
) -> Tensor {
    let g = Graph::from_def(def).unwrap_or_else(|e| panic!("{e}"));
    let mut values: HashMap<(String, usize), Tensor> = HashMap::new();
    for idx in g.topo_order() {
        let node = g.node(idx);
        if let Some(t) = feeds.get(&node.name) {
            values.insert((node.name.clone(), 0), t.clone());
            continue;
        }
        let inputs: Vec<(String, usize)> = g
            .inputs(idx)
            .into_iter()
            .map(|(s, o)| (g.node(s).name.clone(), o))
            .collect();
        let Some(input_values) = inputs
            .iter()
            .map(|k| values.get(k))
            .collect::<Option<Vec<&Tensor>>>()
        else {
            continue; // downstream of an unfed placeholder: not needed
        };
        let types: Vec<_> = g
            .inputs(idx)
            .into_iter()
            .map(|(s, o)| g.output_type(s, o).unwrap().clone())
            .collect();
        let attrs = node.resolved_attrs();
        let kernel = (node
            .op_def()
            .kernel_for(&dflow_graph::DeviceType::CPU)
            .unwrap())(&KernelInit {
            node: &node.name,
            attrs: &attrs,
            input_types: &types,
            output_types: &node.outputs,
        })
        .unwrap_or_else(|e| panic!("{}: {e}", node.name));
        let mut outputs = vec![None; node.outputs.len()];
        let cells: Vec<Arc<VariableCell>> = Vec::new();
        kernel
            .compute(&mut KernelContext {
                node: &node.name,
                inputs: &input_values,
                variables: &cells,
                step,
                outputs: &mut outputs,
                collectives: Some(c),
                output_memory: None,
            })
            .unwrap_or_else(|e| panic!("{}: {e}", node.name));
        for (k, t) in outputs.into_iter().enumerate() {
            values.insert((node.name.clone(), k), t.unwrap());
        }
    }
    let InputRef::Data { node, index } = InputRef::parse(fetch).unwrap() else {
        panic!("{fetch}")
    };
    values[&(node, index)].clone()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Place {
    Shard(usize),
    Replicate,
    Partial,
}

/// Deterministic values in [-1, 1).
fn tensor(dims: &[usize], seed: u64) -> Tensor {
    let n: usize = dims.iter().product();
    let mut s = seed;
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect();
    Tensor::from_slice(dims, &v).unwrap()
}

/// Rank `r`'s piece of the logical `t` placed `p` over `n` ranks (a partial sum's terms: noise
/// on every rank but 0, which holds the rest).
fn piece(t: &Tensor, p: Place, r: usize, n: usize) -> Tensor {
    match p {
        Place::Replicate => t.clone(),
        Place::Shard(axis) => AxisSplit {
            axis,
            blocks: 1,
            parts: n,
            padded: t.dims()[axis],
        }
        .shard(t, r)
        .unwrap(),
        Place::Partial => {
            if r > 0 {
                return tensor(t.dims(), 1000 + r as u64);
            }
            let mut v = t.to_f64_vec();
            for q in 1..n {
                for (x, y) in v
                    .iter_mut()
                    .zip(tensor(t.dims(), 1000 + q as u64).to_f64_vec())
                {
                    *x -= y;
                }
            }
            Tensor::from_slice(t.dims(), &v).unwrap()
        }
    }
}

/// One placement change on `n` ranks: `x` (logical dims `dims`, placed `from`) → `op` → `y`
/// (placed `to`), loss `Σ y ⊙ w` on each rank; the logical loss is the sum of the ranks' for a
/// sharded `y` and any rank's for a replicated one.
struct Case {
    op: &'static str,
    attrs: Vec<(&'static str, AttrValue)>,
    dims: Vec<usize>,
    from: Place,
    to: Place,
    n: usize,
}

impl Case {
    fn graph(&self) -> GraphDef {
        let piece_dims = |p: Place| -> Vec<i64> {
            let mut d: Vec<i64> = self.dims.iter().map(|&x| x as i64).collect();
            if let Place::Shard(a) = p {
                d[a] /= self.n as i64;
            }
            d
        };
        let mut b = GraphBuilder::new();
        let x = b
            .op("Placeholder", "x")
            .attr("dtype", DType::F64)
            .attr("shape", Shape::from_signed(&piece_dims(self.from)).unwrap())
            .finish();
        let w = b
            .op("Placeholder", "w")
            .attr("dtype", DType::F64)
            .attr("shape", Shape::from_signed(&piece_dims(self.to)).unwrap())
            .finish();
        let mut y = b
            .op(self.op, "y")
            .input(&x)
            .attr("group_key", "tp")
            .attr("instance_key", 5i64)
            .attr("group_size", self.n as i64);
        for (k, v) in &self.attrs {
            y = y.attr(k, v.clone());
        }
        let y = y.finish();
        let p = b.binary("Mul", "p", &y, &w);
        b.op("Sum", "loss").input(&p).finish();
        b.to_def()
    }

    /// Runs `fetch` of `def` on every rank (in threads) with the pieces of `x` and `w`.
    fn on_ranks(
        &self,
        def: &GraphDef,
        x: &Tensor,
        w: &Tensor,
        fetch: &str,
        step: u64,
    ) -> Vec<Tensor> {
        let hub = Arc::new(Hub {
            n: self.n,
            slots: Mutex::new(HashMap::new()),
            ready: Condvar::new(),
        });
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.n)
                .map(|r| {
                    let feeds: HashMap<String, Tensor> = [
                        ("x".to_string(), piece(x, self.from, r, self.n)),
                        ("w".to_string(), piece(w, self.to, r, self.n)),
                    ]
                    .into();
                    let rank = Rank {
                        hub: hub.clone(),
                        rank: r,
                    };
                    s.spawn(move || run(def, &feeds, fetch, &rank, step))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn logical_loss(&self, def: &GraphDef, x: &Tensor, w: &Tensor) -> f64 {
        let losses: Vec<f64> = self
            .on_ranks(def, x, w, "loss", 0)
            .iter()
            .map(|t| t.to_f64_vec()[0])
            .collect();
        match self.to {
            Place::Replicate => {
                for l in &losses {
                    assert!((l - losses[0]).abs() < 1e-12, "{losses:?}");
                }
                losses[0]
            }
            _ => losses.iter().sum(),
        }
    }

    fn check(&self) {
        let def = self.graph();
        let x = tensor(&self.dims, 1);
        let w = tensor(&self.dims, 2);
        // Forward: every rank holds its piece of x in the target placement.
        let ys = self.on_ranks(&def, &x, &w, "y", 0);
        for (r, y) in ys.iter().enumerate() {
            let want = piece(&x, self.to, r, self.n);
            assert_eq!(y.dims(), want.dims(), "{} forward, rank {r}", self.op);
            for (a, b) in y.to_f64_vec().iter().zip(want.to_f64_vec()) {
                // Exact but for a partial sum's rounding.
                assert!(
                    (a - b).abs() <= 1e-12,
                    "{} forward, rank {r}: {a} vs {b}",
                    self.op
                );
            }
        }
        // Backward by autodiff, its collectives run across the ranks.
        let (gdef, grads) = gradients(&def, "loss", &["x"]).unwrap();
        let fetch = InputRef::Data {
            node: grads[0].node.clone(),
            index: grads[0].index,
        }
        .to_string();
        let dxs = self.on_ranks(&gdef, &x, &w, &fetch, 0);
        // Central differences of the logical loss in each element of the logical x.
        let h = 1e-6;
        let base = x.to_f64_vec();
        let numeric: Vec<f64> = (0..base.len())
            .map(|i| {
                let mut v = base.clone();
                v[i] += h;
                let plus =
                    self.logical_loss(&def, &Tensor::from_slice(&self.dims, &v).unwrap(), &w);
                v[i] -= 2.0 * h;
                let minus =
                    self.logical_loss(&def, &Tensor::from_slice(&self.dims, &v).unwrap(), &w);
                (plus - minus) / (2.0 * h)
            })
            .collect();
        let numeric = Tensor::from_slice(&self.dims, &numeric).unwrap();
        for (r, dx) in dxs.iter().enumerate() {
            // A Shard rank holds its slice's gradient; Replicate and Partial ranks the whole.
            let want = match self.from {
                Place::Shard(_) => piece(&numeric, self.from, r, self.n),
                _ => numeric.clone(),
            };
            assert_eq!(dx.dims(), want.dims(), "{} gradient, rank {r}", self.op);
            for (i, (a, b)) in dx.to_f64_vec().iter().zip(want.to_f64_vec()).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6,
                    "{} d loss / d x on rank {r} [{i}]: autodiff {a} vs finite difference {b}",
                    self.op
                );
            }
        }
    }
}

#[test]
fn tp_collective_all_gather_gathers_along_any_axis_and_its_gradient_is_the_slice() {
    for (axis, n) in [(0, 2), (1, 2), (1, 3), (2, 2)] {
        Case {
            op: "CollectiveTpAllGather",
            attrs: vec![("axis", AttrValue::Int(axis as i64))],
            dims: vec![6, 6, 4],
            from: Place::Shard(axis),
            to: Place::Replicate,
            n,
        }
        .check();
    }
}

#[test]
fn tp_collective_slice_keeps_the_ranks_slice_and_its_gradient_is_the_all_gather() {
    for (axis, n) in [(0, 2), (1, 3), (2, 2)] {
        Case {
            op: "CollectiveTpSlice",
            attrs: vec![("axis", AttrValue::Int(axis as i64))],
            dims: vec![6, 6, 4],
            from: Place::Replicate,
            to: Place::Shard(axis),
            n,
        }
        .check();
    }
}

#[test]
fn tp_collective_reduce_scatter_sums_into_slices_and_its_gradient_is_the_all_gather() {
    for (axis, n) in [(0, 2), (1, 2), (1, 3)] {
        Case {
            op: "CollectiveTpReduceScatter",
            attrs: vec![("axis", AttrValue::Int(axis as i64))],
            dims: vec![6, 6],
            from: Place::Partial,
            to: Place::Shard(axis),
            n,
        }
        .check();
    }
}

#[test]
fn tp_collective_all_to_all_reshards_and_its_gradient_is_the_reverse_exchange() {
    for (from, to, n) in [(0, 1, 2), (1, 0, 2), (0, 1, 3), (2, 0, 2)] {
        Case {
            op: "CollectiveTpAllToAll",
            attrs: vec![
                ("split_axis", AttrValue::Int(to as i64)),
                ("concat_axis", AttrValue::Int(from as i64)),
            ],
            dims: vec![6, 6, 4],
            from: Place::Shard(from),
            to: Place::Shard(to),
            n,
        }
        .check();
    }
}

#[test]
fn tp_collective_shape_rules_refuse_what_does_not_split() {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[4, 3]);
    b.op("CollectiveTpSlice", "s")
        .input(&x)
        .attr("group_key", "tp")
        .attr("instance_key", 1i64)
        .attr("group_size", 2i64)
        .attr("axis", 1i64)
        .finish();
    let e = Graph::from_def(&b.to_def()).unwrap_err().to_string();
    assert!(
        e.contains("dimension 1") && e.contains("group_size 2"),
        "{e}"
    );
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[4, 3]);
    b.op("CollectiveTpAllGather", "g")
        .input(&x)
        .attr("group_key", "tp")
        .attr("instance_key", 1i64)
        .attr("group_size", 2i64)
        .attr("axis", 2i64)
        .finish();
    let e = Graph::from_def(&b.to_def()).unwrap_err().to_string();
    assert!(e.contains("axis 2"), "{e}");
    // Types: [4, 3] all-to-all from 1 to 0 over 2 ranks is [2, 6].
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", DType::F32, &[4, 3]);
    b.op("CollectiveTpAllToAll", "a")
        .input(&x)
        .attr("group_key", "tp")
        .attr("instance_key", 1i64)
        .attr("group_size", 2i64)
        .attr("split_axis", 0i64)
        .attr("concat_axis", 1i64)
        .finish();
    let g = Graph::from_def(&b.to_def()).unwrap();
    assert_eq!(
        g.output_type(g.find("a").unwrap(), 0).unwrap().shape,
        Shape::known(&[2, 6])
    );
}

#[test]
fn tp_collective_kernels_refuse_a_run_time_length_that_does_not_split() {
    // A batch dimension unknown to the shape rule: the kernel checks it, on every rank alike,
    // before any traffic.
    use dflow_graph::ops::testing::{attrs_with_defaults, build_kernel};
    use dflow_graph::TensorType;
    let attrs = attrs_with_defaults(
        "CollectiveTpSlice",
        &[
            ("group_key", AttrValue::String("tp".into())),
            ("instance_key", AttrValue::Int(1)),
            ("group_size", AttrValue::Int(2)),
            ("axis", AttrValue::Int(0)),
        ],
    )
    .unwrap();
    let ty = TensorType::new(DType::F64, Shape::from_signed(&[-1, 2]).unwrap());
    let kernel = build_kernel("CollectiveTpSlice", "s", &attrs, &[ty]).unwrap();
    let x = tensor(&[3, 2], 1);
    let rank = Rank {
        hub: Arc::new(Hub {
            n: 2,
            slots: Mutex::new(HashMap::new()),
            ready: Condvar::new(),
        }),
        rank: 0,
    };
    let mut outputs = vec![None];
    let e = kernel
        .compute(&mut KernelContext {
            node: "s",
            inputs: &[&x],
            variables: &[],
            step: 0,
            outputs: &mut outputs,
            collectives: Some(&rank),
            output_memory: None,
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("dimension 0 of shape [3, 2] is 3") && e.contains("2 equal parts"),
        "{e}"
    );
}
