//! The interface between ops and the executor: kernels and variable storage.
//!
//! An op declares its CPU kernel next to its shape rule (see [`crate::ops`]); the executor
//! instantiates one [`Kernel`] per node when it compiles a partition, then calls
//! [`Kernel::compute`] every step.

use crate::ops::TensorType;
use crate::{AttrValue, DType, OpError, Tensor};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;

/// Storage of one variable on its device, shared by the `Variable` node that reads it and the
/// ops that update it through reference inputs.
#[derive(Debug, Default)]
pub struct VariableCell {
    value: Mutex<Option<Tensor>>,
}

impl VariableCell {
    /// The current value, or `None` before initialization. Cheap: shares the buffer.
    pub fn read(&self) -> Option<Tensor> {
        self.value.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the value. A value viewing external memory (a transport's receive slot) is
    /// copied first: a variable outlives steps, and must not keep a slot from its sender.
    pub fn write(&self, t: Tensor) {
        let t = if t.buffer().is_external() {
            Tensor::from_bytes(t.dtype(), t.dims(), t.as_bytes()).unwrap_or(t)
        } else {
            t
        };
        *self.value.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
    }

    /// Updates the value in place under the lock (no torn reads: readers see old or new).
    pub fn update<R>(&self, f: impl FnOnce(&mut Option<Tensor>) -> R) -> R {
        f(&mut self.value.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// What a kernel sees when it is instantiated (once per node per compiled plan).
#[derive(Debug)]
pub struct KernelInit<'a> {
    /// Node name.
    pub node: &'a str,
    /// Attributes with defaults filled in.
    pub attrs: &'a BTreeMap<String, AttrValue>,
    /// Static types of the data inputs.
    pub input_types: &'a [TensorType],
    /// Static types of the outputs.
    pub output_types: &'a [TensorType],
}

impl KernelInit<'_> {
    /// An attribute (defaults are already filled in).
    pub fn attr(&self, name: &str) -> Result<&AttrValue, OpError> {
        self.attrs.get(name).ok_or_else(|| OpError::MissingAttr {
            name: name.to_string(),
        })
    }
}

/// What a kernel sees each step.
#[derive(Debug)]
pub struct KernelContext<'a> {
    /// Node name (for messages).
    pub node: &'a str,
    /// Data input values, in slot order. For a reference input the value is the variable's
    /// current value (or empty before initialization); use [`KernelContext::variable`] to write.
    /// Borrowed: the executor lends its value slots, no tensor is cloned to run a kernel.
    pub inputs: &'a [&'a Tensor],
    /// The variable this node owns (`Variable`), or the variables behind its reference inputs,
    /// in input order.
    pub variables: &'a [std::sync::Arc<VariableCell>],
    /// The step id.
    pub step: u64,
    /// Output values; the kernel sets each one.
    pub outputs: &'a mut [Option<Tensor>],
    /// The collective operations of this process's groups (set by a distributed runtime that
    /// joined collective groups; `None` elsewhere, and collective kernels then fail clearly).
    pub collectives: Option<&'a dyn Collectives>,
    /// Memory the runtime provides for some outputs (e.g. the shared-memory slot an output is
    /// sent from); see [`KernelContext::allocate_output`]. `None`: every output is allocated
    /// normally.
    pub output_memory: Option<&'a dyn OutputMemory>,
}

/// Memory for a kernel's outputs that the runtime provides, so an output that leaves the device
/// is written where the transport reads it (zero copy).
pub trait OutputMemory: Send + Sync + fmt::Debug {
    /// A `dtype` tensor of shape `dims` for output `output`, or `None` to allocate normally. Its
    /// contents are unspecified; the caller writes every element.
    fn allocate(&self, output: usize, dtype: DType, dims: &[usize]) -> Option<Tensor>;
}

/// Where a kernel allocates one output: in memory the runtime provides for it (see
/// [`OutputMemory`]), or fresh. Made by [`KernelContext::output_alloc`]; [`OutputAlloc::FRESH`]
/// always allocates fresh memory.
#[derive(Clone, Copy, Debug)]
pub struct OutputAlloc<'a> {
    memory: Option<&'a dyn OutputMemory>,
    output: usize,
}

impl OutputAlloc<'_> {
    /// Always allocates fresh, zero-filled memory.
    pub const FRESH: OutputAlloc<'static> = OutputAlloc {
        memory: None,
        output: 0,
    };

    /// The memory the runtime provides for this output, when it has some of this dtype and
    /// shape (its contents are unspecified).
    #[inline]
    pub fn provided(&self, dtype: DType, dims: &[usize]) -> Option<Tensor> {
        let t = self.memory?.allocate(self.output, dtype, dims)?;
        (t.dtype() == dtype && t.dims() == dims).then_some(t)
    }

    /// A `dtype` tensor of shape `dims`: the provided memory (contents unspecified) or fresh
    /// zero-filled memory. The kernel must write every element.
    #[inline]
    pub fn tensor(&self, dtype: DType, dims: &[usize]) -> Result<Tensor, String> {
        match self.provided(dtype, dims) {
            Some(t) => Ok(t),
            None => Tensor::zeros(dtype, dims).map_err(|e| e.to_string()),
        }
    }

    /// A tensor of `T`s of shape `dims` whose elements `fill` writes (every one of them: they
    /// may hold old values), in the provided memory or fresh.
    #[inline]
    pub fn filled<T: crate::Element>(
        &self,
        dims: &[usize],
        fill: impl FnOnce(&mut [T]),
    ) -> Result<Tensor, String> {
        match self.provided(T::DTYPE, dims) {
            Some(mut t) => {
                fill(t.as_mut_slice::<T>().map_err(|e| e.to_string())?);
                Ok(t)
            }
            None => Tensor::filled(dims, fill).map_err(|e| e.to_string()),
        }
    }
}

impl<'a> KernelContext<'a> {
    /// Where output `i` is allocated (see [`KernelContext::allocate_output`]).
    #[inline]
    pub fn output_alloc(&self, i: usize) -> OutputAlloc<'a> {
        OutputAlloc {
            memory: self.output_memory,
            output: i,
        }
    }

    /// Input `i`.
    #[inline]
    pub fn input(&self, i: usize) -> Result<&'a Tensor, OpError> {
        self.inputs
            .get(i)
            .copied()
            .ok_or(OpError::MissingInput { index: i })
    }

    /// A `dtype` tensor of shape `dims` meant to become output `i`: in the memory the runtime
    /// provides for that output when it has some (its contents are then unspecified), else
    /// zero-filled. The kernel must write every element before setting it as the output.
    #[inline]
    pub fn allocate_output(
        &self,
        i: usize,
        dtype: DType,
        dims: &[usize],
    ) -> Result<Tensor, String> {
        self.output_alloc(i).tensor(dtype, dims)
    }

    /// Sets output `i`.
    #[inline]
    pub fn set_output(&mut self, i: usize, t: Tensor) -> Result<(), OpError> {
        let slot = self
            .outputs
            .get_mut(i)
            .ok_or(OpError::MissingOutput { index: i })?;
        *slot = Some(t);
        Ok(())
    }

    /// The variable cell (for `Variable`, or an op's first reference input).
    pub fn variable(&self) -> Result<&VariableCell, String> {
        self.variable_at(0)
    }

    /// The cell behind the `k`-th reference input.
    pub fn variable_at(&self, k: usize) -> Result<&VariableCell, String> {
        self.variables
            .get(k)
            .map(|c| &**c)
            .ok_or_else(|| format!("no variable is bound to reference input {k} of this node"))
    }
}

/// How a collective combines the values of the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    /// Element-wise sum.
    Sum,
    /// Element-wise product.
    Prod,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
    /// Element-wise mean over the ranks.
    Avg,
}

impl ReduceKind {
    /// Parses `sum`, `prod`, `min`, `max`, `avg`.
    pub fn parse(s: &str) -> Result<ReduceKind, String> {
        Ok(match s {
            "sum" => ReduceKind::Sum,
            "prod" => ReduceKind::Prod,
            "min" => ReduceKind::Min,
            "max" => ReduceKind::Max,
            "avg" | "mean" => ReduceKind::Avg,
            _ => {
                return Err(format!(
                    "unknown reduction `{s}` (sum, prod, min, max, avg)"
                ))
            }
        })
    }

    /// The name `parse` accepts.
    pub fn name(self) -> &'static str {
        match self {
            ReduceKind::Sum => "sum",
            ReduceKind::Prod => "prod",
            ReduceKind::Min => "min",
            ReduceKind::Max => "max",
            ReduceKind::Avg => "avg",
        }
    }
}

/// Which collective call a kernel makes: the group (`group_key`), and the instance within it
/// (`instance_key`, the same on every rank for the same op), in step `step`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveCall<'a> {
    /// The group of ranks.
    pub group: &'a str,
    /// The op instance (ranks match their calls by it).
    pub instance: i64,
    /// The step id.
    pub step: u64,
    /// The calling node (for messages).
    pub node: &'a str,
}

/// The collective operations a runtime offers kernels. Every rank of a group calls the same
/// instances in the same order; implementations check that (fingerprints) and time out naming
/// the ranks that did not join.
pub trait Collectives: Send + Sync + fmt::Debug {
    /// This process's rank in `group` and the group's size.
    fn rank_and_size(&self, group: &str) -> Result<(usize, usize), String>;

    /// Every rank gets the element-wise reduction of all ranks' `input` (same dtype and shape
    /// everywhere).
    fn all_reduce(
        &self,
        call: &CollectiveCall<'_>,
        input: &Tensor,
        op: ReduceKind,
    ) -> Result<Tensor, String>;

    /// Every rank gets the ranks' inputs concatenated along dimension 0, in rank order.
    fn all_gather(&self, call: &CollectiveCall<'_>, input: &Tensor) -> Result<Tensor, String>;

    /// Rank r gets part r (dimension 0 split in `size` equal parts) of the reduction.
    fn reduce_scatter(
        &self,
        call: &CollectiveCall<'_>,
        input: &Tensor,
        op: ReduceKind,
    ) -> Result<Tensor, String>;

    /// Every rank gets `root`'s input.
    fn broadcast(
        &self,
        call: &CollectiveCall<'_>,
        input: &Tensor,
        root: usize,
    ) -> Result<Tensor, String>;

    /// Part j (dimension 0 split in `size` equal parts) of rank i's input becomes part i of
    /// rank j's output.
    fn all_to_all(&self, call: &CollectiveCall<'_>, input: &Tensor) -> Result<Tensor, String>;
}

/// A compiled kernel for one node.
pub trait Kernel: Send + Sync + fmt::Debug {
    /// Computes the outputs from the inputs. The error message is wrapped by the executor with
    /// the node name and device, so it should describe only the problem (e.g. both shapes).
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError>;
}

/// Builds the kernel for one node from its static description.
pub type KernelFactory = fn(&KernelInit<'_>) -> Result<Box<dyn Kernel>, OpError>;

/// A kernel made from a plain function (for stateless ops with no per-node setup).
pub struct FnKernel(pub fn(&mut KernelContext<'_>) -> Result<(), OpError>);

impl fmt::Debug for FnKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnKernel")
    }
}

impl Kernel for FnKernel {
    #[inline]
    fn compute(&self, ctx: &mut KernelContext<'_>) -> Result<(), OpError> {
        (self.0)(ctx)
    }
}

/// Ops whose kernels take constant time whatever the size of their tensors (they hand buffers
/// over or register a callback): always cheap ([`is_cheap`]).
pub const CONSTANT_TIME_OPS: &[&str] = &["NoOp", "Const", "Identity", "Recv", "Variable"];

/// A node whose inputs and outputs hold at most this many elements in all is cheap
/// ([`is_cheap`]).
pub const CHEAP_ELEMENTS: usize = 1024;

/// Whether a node of `op` with these static types is cheap: the executor may run it in a batch
/// with other cheap nodes on one thread instead of handing it to its pool alone (and the
/// planner counts the nodes handed over alone by this rule). A constant-time op is cheap; a
/// collective never is (it blocks until its peers join and must not hold back the nodes
/// queued behind it on its thread); any other op is cheap when its tensors' shapes are all
/// static and hold at most [`CHEAP_ELEMENTS`] elements in all (an op on a batch whose size the
/// plan does not know is not).
pub fn is_cheap(op: &str, inputs: &[&TensorType], outputs: &[TensorType]) -> bool {
    if op.starts_with("Collective") {
        return false;
    }
    if CONSTANT_TIME_OPS.contains(&op) {
        return true;
    }
    let mut total = 0usize;
    for t in inputs.iter().copied().chain(outputs) {
        match t.shape.num_elements() {
            Some(n) => total = total.saturating_add(n),
            None => return false,
        }
    }
    total <= CHEAP_ELEMENTS
}

#[cfg(test)]
mod cheap_tests {
    use super::*;
    use crate::Shape;

    #[test]
    fn small_static_and_constant_time_nodes_are_cheap_collectives_and_batches_are_not() {
        let t = |dims: &[usize]| TensorType::new(DType::F32, Shape::known(dims));
        let batch = TensorType::new(DType::F32, Shape::partial(vec![None, Some(8)]));
        let (small, big) = (t(&[16, 8]), t(&[64, 64]));
        assert!(is_cheap("Relu", &[&small], std::slice::from_ref(&small)));
        assert!(!is_cheap("Relu", &[&big], std::slice::from_ref(&big)));
        assert!(!is_cheap("Relu", &[&batch], std::slice::from_ref(&batch)));
        assert!(is_cheap("Variable", &[], std::slice::from_ref(&big)));
        assert!(!is_cheap(
            "CollectiveAllReduce",
            &[&small],
            std::slice::from_ref(&small)
        ));
    }
}
