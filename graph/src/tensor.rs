//! Dense tensors over a shared, aligned buffer (64 bytes on the heap; tensors of at most 64
//! bytes live inside the buffer itself, 16-byte aligned).
//!
//! A [`Tensor`] is cheap to clone: clones share the same [`Buffer`]. Handing a tensor from one
//! partition to another in the same process therefore moves no bytes; [`Tensor::data_ptr`] lets
//! tests prove it. Writing goes through [`Tensor::as_mut_slice`], which copies only when the
//! buffer is shared (copy-on-write), and counts such copies in [`buffer_copies`].

use crate::{DType, Shape};
use aligned_vec::{AVec, ConstAlign};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Alignment in bytes of every heap or external tensor buffer (a cache line; enough for AVX-512
/// and RDMA). Tensors of at most 64 bytes live inside their [`Buffer`], aligned to
/// [`INLINE_ALIGN`].
pub const BUFFER_ALIGN: usize = 64;

/// Alignment in bytes of the tiny tensors (at most 64 bytes) stored inside their [`Buffer`]:
/// enough for every element type and 128-bit vector loads. Not a cache line, so the buffer is an
/// ordinary allocation (a 64-byte aligned allocation takes the allocator's slow path, which cost
/// the executor about a tenth of a scalar node).
pub const INLINE_ALIGN: usize = 16;

/// The largest tensor a single buffer may hold (bounds allocations driven by untrusted input).
pub const MAX_TENSOR_BYTES: usize = 1 << 40;

static BUFFER_COPIES: AtomicU64 = AtomicU64::new(0);

/// How many times a shared buffer has been copied by copy-on-write since the process started.
pub fn buffer_copies() -> u64 {
    BUFFER_COPIES.load(Ordering::Relaxed)
}

/// Errors from constructing or viewing tensors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// A typed view asked for the wrong element type.
    #[error("tensor has dtype {actual}, not {requested}")]
    DTypeMismatch {
        /// The tensor's dtype.
        actual: DType,
        /// The dtype the caller asked for.
        requested: DType,
    },
    /// The number of values does not match the shape.
    #[error("shape {shape} holds {expected} elements but {actual} values were given")]
    ElementCount {
        /// The shape.
        shape: Shape,
        /// Elements the shape needs.
        expected: usize,
        /// Values given.
        actual: usize,
    },
    /// The tensor would be larger than [`MAX_TENSOR_BYTES`] (or its size overflows).
    #[error("tensor of dtype {dtype} and shape {shape} is too large to allocate")]
    TooLarge {
        /// Element type.
        dtype: DType,
        /// Requested shape.
        shape: Shape,
    },
}

/// Bytes up to this size live inside the [`Buffer`] itself: a scalar or a tiny tensor then costs
/// one allocation (the `Arc`) instead of two.
const INLINE_BYTES: usize = 64;

#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct InlineBytes([u8; INLINE_BYTES]);

const _: () = assert!(std::mem::align_of::<InlineBytes>() == INLINE_ALIGN);

enum Storage {
    Inline { bytes: InlineBytes, len: usize },
    Heap(AVec<u8, ConstAlign<BUFFER_ALIGN>>),
    External(ExternalBytes),
}

/// Memory a [`Buffer`] views but does not own (a transport's shared mapping), kept valid by
/// `owner`, which is dropped with the buffer (e.g. to hand a receive slot back to its sender).
struct ExternalBytes {
    ptr: NonNull<u8>,
    len: usize,
    /// False for a view others read too (a received slot): a write copies to the heap first.
    writable: bool,
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: `Buffer::from_external`'s contract makes the bytes valid for as long as `owner` lives
// and reachable only through this buffer, so they may move between and be read from threads
// like the heap bytes of the other variants (`&self` gives shared reads, `&mut self` the only
// writes).
unsafe impl Send for ExternalBytes {}
// SAFETY: see `Send` above: shared access only reads.
unsafe impl Sync for ExternalBytes {}

impl Clone for Storage {
    /// Clones own their bytes: a clone of external memory is a heap copy (copy-on-write).
    fn clone(&self) -> Self {
        match self {
            Storage::Inline { bytes, len } => Storage::Inline {
                bytes: *bytes,
                len: *len,
            },
            Storage::Heap(v) => Storage::Heap(v.clone()),
            Storage::External(e) => {
                // SAFETY: valid for `len` bytes while `e` (and its owner) lives.
                let bytes = unsafe { std::slice::from_raw_parts(e.ptr.as_ptr(), e.len) };
                Buffer::from_bytes(bytes).storage
            }
        }
    }
}

/// An aligned byte buffer (see [`BUFFER_ALIGN`], [`INLINE_ALIGN`]): owned (inline or on the
/// heap), or a view of external memory such as a shared-memory transport slot
/// ([`Buffer::from_external`]).
#[derive(Clone)]
pub struct Buffer {
    storage: Storage,
}

impl Buffer {
    /// A zero-filled buffer of `len` bytes.
    #[inline]
    pub fn zeroed(len: usize) -> Self {
        if len <= INLINE_BYTES {
            return Buffer {
                storage: Storage::Inline {
                    bytes: InlineBytes([0; INLINE_BYTES]),
                    len,
                },
            };
        }
        let mut bytes = AVec::with_capacity(BUFFER_ALIGN, len);
        bytes.resize(len, 0u8); // a plain fill loop that compiles to memset
        Buffer {
            storage: Storage::Heap(bytes),
        }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        if bytes.len() <= INLINE_BYTES {
            let mut inline = InlineBytes([0; INLINE_BYTES]);
            inline.0[..bytes.len()].copy_from_slice(bytes);
            return Buffer {
                storage: Storage::Inline {
                    bytes: inline,
                    len: bytes.len(),
                },
            };
        }
        Buffer {
            storage: Storage::Heap(AVec::from_slice(BUFFER_ALIGN, bytes)),
        }
    }

    /// A buffer over `len` bytes at `ptr` that it does not own: `owner` keeps them valid and is
    /// dropped when the buffer is (the last clone of the tensor sharing it). No byte is copied.
    /// Returns `None` when `ptr` is not [`BUFFER_ALIGN`]-aligned or `len` exceeds
    /// [`MAX_TENSOR_BYTES`]. A clone of the buffer (copy-on-write) copies to the heap, and so
    /// does the first write to a buffer that is not `writable`.
    ///
    /// # Safety
    ///
    /// For as long as `owner` lives, `ptr..ptr+len` must be valid for reads (and for writes
    /// when `writable`), and no one else may write those bytes or hold a mutable reference to
    /// them. A shared-memory transport guarantees this with its slot protocol: the peer does not
    /// write a slot before the buffer viewing it was dropped.
    pub unsafe fn from_external(
        ptr: NonNull<u8>,
        len: usize,
        writable: bool,
        owner: Box<dyn Send + Sync>,
    ) -> Option<Buffer> {
        if ptr.as_ptr() as usize % BUFFER_ALIGN != 0 || len > MAX_TENSOR_BYTES {
            return None;
        }
        Some(Buffer {
            storage: Storage::External(ExternalBytes {
                ptr,
                len,
                writable,
                _owner: owner,
            }),
        })
    }

    /// True when the bytes live in external memory ([`Buffer::from_external`]).
    #[inline]
    pub fn is_external(&self) -> bool {
        matches!(self.storage, Storage::External(_))
    }

    /// The bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Inline { bytes, len } => &bytes.0[..*len],
            Storage::Heap(v) => v,
            // SAFETY: `from_external`'s contract: valid for reads of `len` bytes while the
            // owner (dropped only with `self`) lives, and nobody writes them meanwhile.
            Storage::External(e) => unsafe { std::slice::from_raw_parts(e.ptr.as_ptr(), e.len) },
        }
    }

    /// The bytes, writable (a read-only external view is first copied to the heap, counted in
    /// [`buffer_copies`]).
    #[inline]
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        if matches!(&self.storage, Storage::External(e) if !e.writable) {
            BUFFER_COPIES.fetch_add(1, Ordering::Relaxed);
            self.storage = self.storage.clone();
        }
        match &mut self.storage {
            Storage::Inline { bytes, len } => &mut bytes.0[..*len],
            Storage::Heap(v) => v,
            // SAFETY: as in `as_bytes`, and `&mut self` makes this the only access.
            Storage::External(e) => unsafe {
                std::slice::from_raw_parts_mut(e.ptr.as_ptr(), e.len)
            },
        }
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Buffer({} bytes @ {:p})",
            self.len(),
            self.as_bytes().as_ptr()
        )
    }
}

/// Rust element types that map to a [`DType`]. Bool tensors are viewed as `u8` (0 or 1).
pub trait Element: bytemuck::Pod + Send + Sync + fmt::Debug + 'static {
    /// The dtype for this element type.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for u8 {
    const DTYPE: DType = DType::Bool;
}
impl Element for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for half::f16 {
    const DTYPE: DType = DType::F16;
}

/// A dense, row-major tensor with a fully known shape.
#[derive(Clone)]
pub struct Tensor {
    dtype: DType,
    /// Inline for rank ≤ 4: creating a tensor costs no allocation for its dims.
    shape: Dims,
    buf: Arc<Buffer>,
}

type Dims = smallvec::SmallVec<[usize; 4]>;

/// `shape` as [`Dims`]: a copy into the inline array for rank ≤ 4 (the common case, cheaper
/// than the generic `SmallVec::from_slice`).
#[inline]
fn dims_of(shape: &[usize]) -> Dims {
    match shape.len() {
        0 => Dims::new(),
        n if n <= 4 => {
            let mut a = [0usize; 4];
            a[..n].copy_from_slice(shape);
            Dims::from_buf_and_len(a, n)
        }
        _ => Dims::from_slice(shape),
    }
}

#[inline]
fn byte_len(dtype: DType, shape: &[usize]) -> Result<usize, TensorError> {
    shape
        .iter()
        .try_fold(dtype.size_of(), |acc, &d| acc.checked_mul(d))
        .filter(|&b| b <= MAX_TENSOR_BYTES)
        .ok_or_else(|| TensorError::TooLarge {
            dtype,
            shape: Shape::known(shape),
        })
}

impl Tensor {
    /// A zero-filled tensor.
    #[inline]
    pub fn zeros(dtype: DType, shape: &[usize]) -> Result<Tensor, TensorError> {
        let len = byte_len(dtype, shape)?;
        Ok(Tensor {
            dtype,
            shape: dims_of(shape),
            buf: Arc::new(Buffer::zeroed(len)),
        })
    }

    /// A tensor of dtype `T`'s and shape `shape` whose elements `fill` writes (it receives them
    /// zeroed). One allocation and no copy-on-write check: the cheapest way to make a new
    /// tensor (kernel outputs use it).
    #[inline]
    pub fn filled<T: Element>(
        shape: &[usize],
        fill: impl FnOnce(&mut [T]),
    ) -> Result<Tensor, TensorError> {
        let len = byte_len(T::DTYPE, shape)?;
        let mut buf = Buffer::zeroed(len);
        fill(bytemuck::cast_slice_mut(buf.as_bytes_mut()));
        Ok(Tensor {
            dtype: T::DTYPE,
            shape: dims_of(shape),
            buf: Arc::new(buf),
        })
    }

    /// A tensor holding a copy of `values`.
    pub fn from_slice<T: Element>(shape: &[usize], values: &[T]) -> Result<Tensor, TensorError> {
        let len = byte_len(T::DTYPE, shape)?;
        let expected = len / T::DTYPE.size_of();
        if expected != values.len() {
            return Err(TensorError::ElementCount {
                shape: Shape::known(shape),
                expected,
                actual: values.len(),
            });
        }
        Ok(Tensor {
            dtype: T::DTYPE,
            shape: dims_of(shape),
            buf: Arc::new(Buffer::from_bytes(bytemuck::cast_slice(values))),
        })
    }

    /// A rank-0 tensor.
    pub fn scalar<T: Element>(value: T) -> Tensor {
        Tensor {
            dtype: T::DTYPE,
            shape: Dims::new(),
            buf: Arc::new(Buffer::from_bytes(bytemuck::bytes_of(&value))),
        }
    }

    /// A tensor over raw bytes (copied). The length must match dtype and shape.
    pub fn from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor, TensorError> {
        let len = byte_len(dtype, shape)?;
        if len != bytes.len() {
            return Err(TensorError::ElementCount {
                shape: Shape::known(shape),
                expected: len / dtype.size_of(),
                actual: bytes.len() / dtype.size_of(),
            });
        }
        Ok(Tensor {
            dtype,
            shape: dims_of(shape),
            buf: Arc::new(Buffer::from_bytes(bytes)),
        })
    }

    /// Wraps an existing shared buffer without copying. The length must match.
    pub fn from_shared(
        dtype: DType,
        shape: &[usize],
        buf: Arc<Buffer>,
    ) -> Result<Tensor, TensorError> {
        let len = byte_len(dtype, shape)?;
        if len != buf.len() {
            return Err(TensorError::ElementCount {
                shape: Shape::known(shape),
                expected: len / dtype.size_of(),
                actual: buf.len() / dtype.size_of(),
            });
        }
        Ok(Tensor {
            dtype,
            shape: dims_of(shape),
            buf,
        })
    }

    /// The element type.
    #[inline]
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dimensions.
    #[inline]
    pub fn dims(&self) -> &[usize] {
        &self.shape
    }

    /// The shape as a [`Shape`].
    pub fn shape(&self) -> Shape {
        Shape::known(&self.shape)
    }

    /// Rank (number of dimensions).
    #[inline]
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    #[inline]
    pub fn num_elements(&self) -> usize {
        self.buf.len() / self.dtype.size_of()
    }

    /// Size in bytes.
    #[inline]
    pub fn byte_len(&self) -> usize {
        self.buf.len()
    }

    /// The raw bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        self.buf.as_bytes()
    }

    /// The shared buffer (for zero-copy hand-over).
    #[inline]
    pub fn buffer(&self) -> &Arc<Buffer> {
        &self.buf
    }

    /// Address of the first byte: equal addresses mean the same memory (zero-copy proofs).
    #[inline]
    pub fn data_ptr(&self) -> *const u8 {
        self.buf.as_bytes().as_ptr()
    }

    /// A typed read-only view.
    #[inline]
    pub fn as_slice<T: Element>(&self) -> Result<&[T], TensorError> {
        self.check::<T>()?;
        Ok(bytemuck::cast_slice(self.buf.as_bytes()))
    }

    /// A typed writable view; copies the buffer first if it is shared (counted).
    #[inline]
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T], TensorError> {
        self.check::<T>()?;
        let before = Arc::as_ptr(&self.buf);
        let buf = Arc::make_mut(&mut self.buf);
        if !std::ptr::eq(before, buf) {
            BUFFER_COPIES.fetch_add(1, Ordering::Relaxed);
        }
        Ok(bytemuck::cast_slice_mut(buf.as_bytes_mut()))
    }

    /// The same bytes under a new shape with the same element count (no copy).
    pub fn reshaped(&self, shape: &[usize]) -> Result<Tensor, TensorError> {
        Tensor::from_shared(self.dtype, shape, self.buf.clone())
    }

    /// Copies of the values as `f64` (any dtype; bools as 0/1). For tests and printing.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        let b = self.buf.as_bytes();
        match self.dtype {
            DType::F32 => bytemuck::cast_slice::<u8, f32>(b)
                .iter()
                .map(|&x| x as f64)
                .collect(),
            DType::F64 => bytemuck::cast_slice::<u8, f64>(b).to_vec(),
            DType::I32 => bytemuck::cast_slice::<u8, i32>(b)
                .iter()
                .map(|&x| x as f64)
                .collect(),
            DType::I64 => bytemuck::cast_slice::<u8, i64>(b)
                .iter()
                .map(|&x| x as f64)
                .collect(),
            DType::Bool => b.iter().map(|&x| x as f64).collect(),
            DType::BF16 => bytemuck::cast_slice::<u8, half::bf16>(b)
                .iter()
                .map(|x| x.to_f64())
                .collect(),
            DType::F16 => bytemuck::cast_slice::<u8, half::f16>(b)
                .iter()
                .map(|x| x.to_f64())
                .collect(),
        }
    }

    #[inline]
    fn check<T: Element>(&self) -> Result<(), TensorError> {
        if self.dtype == T::DTYPE {
            Ok(())
        } else {
            Err(TensorError::DTypeMismatch {
                actual: self.dtype,
                requested: T::DTYPE,
            })
        }
    }
}

impl PartialEq for Tensor {
    /// Bitwise equality of dtype, shape and bytes.
    fn eq(&self, other: &Self) -> bool {
        self.dtype == other.dtype
            && self.shape == other.shape
            && self.as_bytes() == other.as_bytes()
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let vals = self.to_f64_vec();
        let shown: Vec<_> = vals.iter().take(8).collect();
        write!(
            f,
            "Tensor({} {}, {:?}{})",
            self.dtype,
            Shape::known(&self.shape),
            shown,
            if vals.len() > 8 { " ..." } else { "" }
        )
    }
}

/// One serialized element: a JSON number, or for non-finite floats the strings "nan", "inf", "-inf".
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum Scalar {
    Int(i64),
    Num(f64),
    Text(String),
}

impl Scalar {
    fn float(x: f64) -> Scalar {
        if x.is_nan() {
            Scalar::Text("nan".into())
        } else if x.is_infinite() {
            Scalar::Text(if x > 0.0 { "inf" } else { "-inf" }.into())
        } else {
            Scalar::Num(x)
        }
    }

    fn to_f64(&self) -> Result<f64, String> {
        match self {
            Scalar::Int(i) => Ok(*i as f64),
            Scalar::Num(x) => Ok(*x),
            Scalar::Text(t) => match t.as_str() {
                "nan" => Ok(f64::NAN),
                "inf" => Ok(f64::INFINITY),
                "-inf" => Ok(f64::NEG_INFINITY),
                _ => Err(format!("expected a number, got string {t:?}")),
            },
        }
    }

    fn to_i64(&self) -> Result<i64, String> {
        match self {
            Scalar::Int(i) => Ok(*i),
            Scalar::Num(x) => Err(format!("expected an integer, got {x}")),
            Scalar::Text(t) => Err(format!("expected an integer, got string {t:?}")),
        }
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TensorRepr {
    dtype: DType,
    shape: Vec<usize>,
    values: Vec<Scalar>,
}

/// Serialized as `{"dtype": "f32", "shape": [2], "values": [1.5, 2.0]}` (the form `Const` attrs use).
impl Serialize for Tensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let b = self.as_bytes();
        let values: Vec<Scalar> = match self.dtype {
            DType::I32 => bytemuck::cast_slice::<u8, i32>(b)
                .iter()
                .map(|&x| Scalar::Int(x.into()))
                .collect(),
            DType::I64 => bytemuck::cast_slice::<u8, i64>(b)
                .iter()
                .map(|&x| Scalar::Int(x))
                .collect(),
            DType::Bool => b.iter().map(|&x| Scalar::Int(x.into())).collect(),
            DType::F32 => bytemuck::cast_slice::<u8, f32>(b)
                .iter()
                .map(|&x| {
                    // Print the f32's shortest decimal so files stay readable and round-trip exactly.
                    let shortest: f64 = x.to_string().parse().unwrap_or(x as f64);
                    if x.is_finite() {
                        Scalar::Num(shortest)
                    } else {
                        Scalar::float(x as f64)
                    }
                })
                .collect(),
            _ => self.to_f64_vec().into_iter().map(Scalar::float).collect(),
        };
        TensorRepr {
            dtype: self.dtype,
            shape: self.shape.to_vec(),
            values,
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Tensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let r = TensorRepr::deserialize(d)?;
        tensor_from_values(r.dtype, &r.shape, &r.values).map_err(D::Error::custom)
    }
}

fn tensor_from_values(dtype: DType, shape: &[usize], values: &[Scalar]) -> Result<Tensor, String> {
    let expected = byte_len(dtype, shape).map_err(|e| e.to_string())? / dtype.size_of();
    if expected != values.len() {
        return Err(TensorError::ElementCount {
            shape: Shape::known(shape),
            expected,
            actual: values.len(),
        }
        .to_string());
    }
    fn floats(v: &[Scalar]) -> Result<Vec<f64>, String> {
        v.iter().map(Scalar::to_f64).collect()
    }
    fn ints(v: &[Scalar]) -> Result<Vec<i64>, String> {
        v.iter().map(Scalar::to_i64).collect()
    }
    let t = match dtype {
        DType::F32 => Tensor::from_slice(
            shape,
            &floats(values)?
                .iter()
                .map(|&x| x as f32)
                .collect::<Vec<_>>(),
        ),
        DType::F64 => Tensor::from_slice(shape, &floats(values)?),
        DType::BF16 => Tensor::from_slice(
            shape,
            &floats(values)?
                .iter()
                .map(|&x| half::bf16::from_f64(x))
                .collect::<Vec<_>>(),
        ),
        DType::F16 => Tensor::from_slice(
            shape,
            &floats(values)?
                .iter()
                .map(|&x| half::f16::from_f64(x))
                .collect::<Vec<_>>(),
        ),
        DType::I64 => Tensor::from_slice(shape, &ints(values)?),
        DType::I32 => {
            let v = ints(values)?
                .into_iter()
                .map(|x| i32::try_from(x).map_err(|_| format!("value {x} does not fit in i32")))
                .collect::<Result<Vec<_>, _>>()?;
            Tensor::from_slice(shape, &v)
        }
        DType::Bool => {
            let v = ints(values)?
                .into_iter()
                .map(|x| match x {
                    0 | 1 => Ok(x as u8),
                    _ => Err(format!("bool value must be 0 or 1, got {x}")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Tensor::from_slice(shape, &v)
        }
    };
    t.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_and_shared() {
        let big = Tensor::zeros(DType::F32, &[17]).unwrap();
        assert_eq!(big.data_ptr() as usize % BUFFER_ALIGN, 0);
        let t = Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(t.data_ptr() as usize % INLINE_ALIGN, 0);
        let u = t.clone();
        assert_eq!(t.data_ptr(), u.data_ptr());
        let r = t.reshaped(&[4]).unwrap();
        assert_eq!(r.data_ptr(), t.data_ptr());
        assert!(t.reshaped(&[3]).is_err());
    }

    #[test]
    fn copy_on_write_counts() {
        let mut t = Tensor::from_slice(&[2], &[1i64, 2]).unwrap();
        let before = buffer_copies();
        t.as_mut_slice::<i64>().unwrap()[0] = 5; // unique: no copy
        let shared = t.clone();
        t.as_mut_slice::<i64>().unwrap()[1] = 7; // shared: one copy
        assert!(buffer_copies() > before);
        assert_eq!(shared.as_slice::<i64>().unwrap(), &[5, 2]);
        assert_eq!(t.as_slice::<i64>().unwrap(), &[5, 7]);
    }

    /// Sets its flag when dropped (stands in for a transport's slot release).
    struct Release(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Release {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn external_buffers_alias_and_release_their_memory() {
        let mut mem: AVec<u8, ConstAlign<BUFFER_ALIGN>> = AVec::with_capacity(BUFFER_ALIGN, 16);
        mem.resize(16, 0);
        let base = NonNull::new(mem.as_mut_ptr()).unwrap();
        let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // SAFETY: `mem` outlives the buffer (dropped at the end of the test) and is only
        // accessed through it meanwhile.
        let buf =
            unsafe { Buffer::from_external(base, 16, true, Box::new(Release(released.clone()))) }
                .unwrap();
        assert!(buf.is_external());
        let mut t = Tensor::from_shared(DType::F32, &[4], Arc::new(buf)).unwrap();
        assert_eq!(t.data_ptr(), base.as_ptr() as *const u8);
        let copies = buffer_copies();
        t.as_mut_slice::<f32>().unwrap()[1] = 2.5; // unique: written in place
        assert_eq!(buffer_copies(), copies);
        // SAFETY: in bounds of `mem`, aligned for f32; nothing writes meanwhile.
        assert_eq!(unsafe { base.as_ptr().add(4).cast::<f32>().read() }, 2.5);
        // Copy-on-write of a shared external buffer copies to the heap; the view is untouched.
        let shared = t.clone();
        t.as_mut_slice::<f32>().unwrap()[0] = 7.0;
        assert_eq!(buffer_copies(), copies + 1);
        assert!(!t.buffer().is_external());
        assert_eq!(shared.as_slice::<f32>().unwrap(), &[0.0, 2.5, 0.0, 0.0]);
        assert!(!released.load(Ordering::SeqCst));
        drop(shared);
        assert!(
            released.load(Ordering::SeqCst),
            "dropping the last view releases the slot"
        );
        // SAFETY: misaligned pointers are refused before anything is viewed.
        let odd = unsafe { Buffer::from_external(base.add(1), 4, true, Box::new(())) };
        assert!(odd.is_none());
        // A read-only view is copied before its first write, even when unique.
        // SAFETY: as above; `t`'s view was released, so nothing else views `mem`.
        let ro = unsafe { Buffer::from_external(base, 16, false, Box::new(())) }.unwrap();
        let mut t = Tensor::from_shared(DType::F32, &[4], Arc::new(ro)).unwrap();
        let copies = buffer_copies();
        t.as_mut_slice::<f32>().unwrap()[1] = 9.0;
        assert_eq!(buffer_copies(), copies + 1);
        assert_ne!(t.data_ptr(), base.as_ptr() as *const u8);
        // SAFETY: in bounds, aligned; nothing writes meanwhile.
        assert_eq!(unsafe { base.as_ptr().add(4).cast::<f32>().read() }, 2.5);
        drop(mem);
    }

    #[test]
    fn typed_view_checks_dtype() {
        let t = Tensor::scalar(1.0f64);
        assert!(matches!(
            t.as_slice::<f32>(),
            Err(TensorError::DTypeMismatch { .. })
        ));
    }

    #[test]
    fn huge_shapes_error_instead_of_aborting() {
        assert!(matches!(
            Tensor::zeros(DType::F32, &[1 << 40, 1 << 40]),
            Err(TensorError::TooLarge { .. })
        ));
    }

    #[test]
    fn json_round_trip_every_dtype() {
        let cases = vec![
            Tensor::from_slice(&[3], &[0.1f32, f32::NAN, -f32::INFINITY]).unwrap(),
            Tensor::from_slice(&[2], &[0.1f64, 1e300]).unwrap(),
            Tensor::from_slice(&[2], &[i32::MIN, 7]).unwrap(),
            Tensor::from_slice(&[1, 2], &[i64::MAX, -1]).unwrap(),
            Tensor::from_slice(&[2], &[0u8, 1]).unwrap(),
            Tensor::from_slice(&[1], &[half::bf16::from_f32(1.5)]).unwrap(),
            Tensor::from_slice(&[1], &[half::f16::from_f32(-2.25)]).unwrap(),
            Tensor::zeros(DType::F32, &[0, 3]).unwrap(),
        ];
        for t in cases {
            let j = serde_json::to_string(&t).unwrap();
            let back: Tensor = serde_json::from_str(&j).unwrap();
            assert_eq!(back, t, "{j}");
        }
        let j = serde_json::to_string(&Tensor::scalar(0.1f32)).unwrap();
        assert_eq!(j, r#"{"dtype":"f32","shape":[],"values":[0.1]}"#);
    }

    #[test]
    fn json_rejects_bad_values() {
        for bad in [
            r#"{"dtype":"f32","shape":[2],"values":[1]}"#,
            r#"{"dtype":"i32","shape":[1],"values":[1.5]}"#,
            r#"{"dtype":"i32","shape":[1],"values":[99999999999]}"#,
            r#"{"dtype":"bool","shape":[1],"values":[2]}"#,
            r#"{"dtype":"f32","shape":[1099511627776,1099511627776],"values":[]}"#,
            r#"{"dtype":"f32","shape":[1],"values":["x"]}"#,
        ] {
            assert!(serde_json::from_str::<Tensor>(bad).is_err(), "{bad}");
        }
    }
}
