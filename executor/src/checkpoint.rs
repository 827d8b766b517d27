//! Checkpoints: named tensors plus string metadata in the safetensors format, written atomically.
//!
//! A checkpoint of step `s` is the file `ckpt-{s:08}.safetensors` in a checkpoint directory
//! (steps past 99,999,999 simply get more digits). Any safetensors reader can open it, e.g.
//! Python's `safetensors.numpy.load_file`. Layout:
//!
//! - one tensor per variable, named by the variable (names with `/` are fine: `layer1/w`);
//! - optimizer state is just more tensors, named `{variable}/{slot}` by convention
//!   (`w1/adam_m`, `w1/adam_v`, and scalars such as `adam/t`);
//! - metadata (the header's `__metadata__`) holds the caller's string pairs plus
//!   [`STEP_KEY`] (`dflow_step`, the step as decimal) and [`VERSION_KEY`]
//!   (`dflow_format_version`, currently [`FORMAT_VERSION`]); these two always win over caller
//!   entries with the same key.
//!
//! dtypes map one to one: f32→F32, f64→F64, i32→I32, i64→I64, bool→BOOL, bf16→BF16, f16→F16.
//! Data is stored little-endian (the tensors' native order on every supported target).
//!
//! [`save`] writes a temporary file (`.ckpt-{step}.safetensors.tmp-…`) in the same directory,
//! fsyncs it, renames it over the final name and fsyncs the directory, so a crash leaves either
//! the complete old state or the complete new file. [`latest`] and [`list`] only see complete
//! files; [`load`] rejects truncated or corrupted files with an error naming the file, never
//! returning part of one.
//!
//! ```
//! use dflow_executor::checkpoint;
//! use dflow_graph::Tensor;
//! use std::collections::BTreeMap;
//!
//! let dir = std::env::temp_dir().join(format!("dflow-ckpt-doc-{}", std::process::id()));
//! let w = Tensor::from_slice(&[2], &[1.0f32, 2.0])?;
//! let path = checkpoint::save(&dir, 7, &[("w".to_string(), w)], &BTreeMap::new())?;
//! assert_eq!(checkpoint::latest(&dir)?, Some(path.clone()));
//! let ckpt = checkpoint::load(&path)?;
//! assert_eq!(ckpt.step, 7);
//! assert_eq!(ckpt.tensors["w"].as_slice::<f32>()?, &[1.0, 2.0]);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use dflow_graph::{DType, Tensor};
use safetensors::tensor::{SafeTensorError, TensorView};
use safetensors::{Dtype, SafeTensors};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Metadata key holding the step (decimal).
pub const STEP_KEY: &str = "dflow_step";
/// Metadata key holding the format version.
pub const VERSION_KEY: &str = "dflow_format_version";
/// The format version this code writes and reads.
pub const FORMAT_VERSION: &str = "1";

const PREFIX: &str = "ckpt-";
const SUFFIX: &str = ".safetensors";

/// Why saving, finding or loading a checkpoint failed. Every variant names the file or directory.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file system operation failed.
    #[error("{}: {action}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done (`reading`, `renaming into place`, ...).
        action: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is shorter than its header says (e.g. a copy cut short).
    #[error("{}: truncated checkpoint: {detail}", path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Sizes found versus expected.
        detail: String,
    },
    /// The header is not valid safetensors (bad length, bad UTF-8, bad JSON, bad offsets).
    #[error("{}: corrupted checkpoint header: {detail}", path.display())]
    CorruptHeader {
        /// The file.
        path: PathBuf,
        /// The parser's complaint.
        detail: String,
    },
    /// A metadata entry dflow needs is missing or malformed.
    #[error("{}: metadata `{key}`: {problem}", path.display())]
    Metadata {
        /// The file.
        path: PathBuf,
        /// The key (`dflow_step`, `dflow_format_version`).
        key: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// A tensor has a dtype dflow does not support.
    #[error("{}: tensor `{tensor}` has dtype {dtype}, which dflow does not support", path.display())]
    UnknownDType {
        /// The file.
        path: PathBuf,
        /// Tensor name.
        tensor: String,
        /// The safetensors dtype.
        dtype: String,
    },
    /// A tensor's contents are invalid (e.g. a bool that is neither 0 nor 1).
    #[error("{}: tensor `{tensor}`: {problem}", path.display())]
    BadTensor {
        /// The file.
        path: PathBuf,
        /// Tensor name.
        tensor: String,
        /// What is wrong.
        problem: String,
    },
    /// The tensors to save are not valid (duplicate names, ...).
    #[error("checkpoint of step {step} in {}: {problem}", dir.display())]
    InvalidSave {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The step being saved.
        step: u64,
        /// What is wrong.
        problem: String,
    },
    /// The checkpoint does not match the variables expected by [`restore_into`].
    #[error("{}: checkpoint does not match the model ({} problems):{}", path.display(), mismatches.len(), list_mismatches(mismatches))]
    Mismatch {
        /// The checkpoint file.
        path: PathBuf,
        /// Every mismatch found, in expected order then extras by name.
        mismatches: Vec<Mismatch>,
    },
}

fn list_mismatches(ms: &[Mismatch]) -> String {
    ms.iter().map(|m| format!("\n  - {m}")).collect()
}

/// Shorthand for results of this module.
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// One way a checkpoint differs from the expected variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// An expected variable is not in the checkpoint.
    Missing {
        /// Variable name.
        name: String,
    },
    /// The checkpoint holds a tensor no expected variable takes.
    Extra {
        /// Tensor name.
        name: String,
    },
    /// The dtypes differ.
    WrongDType {
        /// Variable name.
        name: String,
        /// Expected dtype.
        expected: DType,
        /// Dtype in the checkpoint.
        found: DType,
    },
    /// The shapes differ.
    WrongShape {
        /// Variable name.
        name: String,
        /// Expected dims.
        expected: Vec<usize>,
        /// Dims in the checkpoint.
        found: Vec<usize>,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Missing { name } => write!(f, "`{name}` is missing"),
            Mismatch::Extra { name } => write!(f, "`{name}` is not a variable of the model"),
            Mismatch::WrongDType {
                name,
                expected,
                found,
            } => write!(f, "`{name}` has dtype {found}, expected {expected}"),
            Mismatch::WrongShape {
                name,
                expected,
                found,
            } => write!(f, "`{name}` has shape {found:?}, expected {expected:?}"),
        }
    }
}

/// A loaded checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The file it was loaded from.
    pub path: PathBuf,
    /// The step (from metadata `dflow_step`).
    pub step: u64,
    /// Every tensor, by name (variables and optimizer slots alike).
    pub tensors: BTreeMap<String, Tensor>,
    /// All metadata, including `dflow_step` and `dflow_format_version`.
    pub metadata: BTreeMap<String, String>,
}

/// The file name of the checkpoint of `step` in `dir`.
pub fn checkpoint_path(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("{PREFIX}{step:08}{SUFFIX}"))
}

/// The step of a complete checkpoint's file name (`ckpt-<digits>.safetensors`), else `None`.
pub fn step_of(file_name: &str) -> Option<u64> {
    let digits = file_name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn to_st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::Bool => Dtype::BOOL,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

fn from_st_dtype(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::I32 => DType::I32,
        Dtype::I64 => DType::I64,
        Dtype::BOOL => DType::Bool,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        _ => return None,
    })
}

/// Lends a [`Tensor`]'s bytes to the safetensors serializer without copying.
struct View<'a>(&'a Tensor);

impl safetensors::View for View<'_> {
    fn dtype(&self) -> Dtype {
        to_st_dtype(self.0.dtype())
    }
    fn shape(&self) -> &[usize] {
        self.0.dims()
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.0.as_bytes())
    }
    fn data_len(&self) -> usize {
        self.0.byte_len()
    }
}

fn io_err(path: &Path, action: &'static str) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::Io {
        path,
        action,
        source,
    }
}

/// Writes the checkpoint of `step` into `dir` (created if missing) and returns its path.
///
/// Atomic: the bytes go to a temporary file in `dir` that is fsynced, renamed to
/// `ckpt-{step:08}.safetensors` (replacing an older file of the same step) and the directory is
/// fsynced. Metadata gets `dflow_step` and `dflow_format_version` added (overriding caller keys of
/// those names). Tensor names must be unique. The file is assembled in memory first (one copy of
/// the tensors), which suits dflow's model sizes.
pub fn save(
    dir: &Path,
    step: u64,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<PathBuf> {
    let mut seen = BTreeSet::new();
    for (name, _) in tensors {
        if !seen.insert(name.as_str()) {
            return Err(CheckpointError::InvalidSave {
                dir: dir.to_path_buf(),
                step,
                problem: format!("tensor name `{name}` appears twice"),
            });
        }
    }
    let mut meta: HashMap<String, String> = metadata.clone().into_iter().collect();
    meta.insert(STEP_KEY.into(), step.to_string());
    meta.insert(VERSION_KEY.into(), FORMAT_VERSION.into());
    let bytes = safetensors::serialize(
        tensors.iter().map(|(n, t)| (n.as_str(), View(t))),
        Some(meta),
    )
    .map_err(|e| CheckpointError::InvalidSave {
        dir: dir.to_path_buf(),
        step,
        problem: e.to_string(),
    })?;

    fs::create_dir_all(dir).map_err(io_err(dir, "creating the checkpoint directory"))?;
    let final_path = checkpoint_path(dir, step);
    let tmp_path = temp_path(dir, step);
    let written = write_synced(&tmp_path, &bytes).and_then(|()| {
        fs::rename(&tmp_path, &final_path).map_err(io_err(&final_path, "renaming into place"))
    });
    if let Err(e) = written {
        // Best effort: the temp file is invisible to `latest` anyway.
        let _ = fs::remove_file(&tmp_path);
        return Err(e);
    }
    sync_dir(dir)?;
    Ok(final_path)
}

/// A temp name unique within this process and across processes; never matches [`step_of`].
fn temp_path(dir: &Path, step: u64) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    dir.join(format!(
        ".{PREFIX}{step:08}{SUFFIX}.tmp-{}-{n}",
        std::process::id()
    ))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io_err(path, "creating the temporary file"))?;
    f.write_all(bytes).map_err(io_err(path, "writing"))?;
    f.sync_all().map_err(io_err(path, "syncing"))?;
    Ok(())
}

/// Makes the rename durable. Directories cannot be opened for syncing on Windows.
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir, "syncing the directory"))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Every complete checkpoint in `dir` as `(step, path)`, by increasing step. A missing directory
/// has none. Temporary and unrelated files are ignored.
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(dir, "listing")(e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err(dir, "listing"))?;
        let name = entry.file_name();
        if let Some(step) = name.to_str().and_then(step_of) {
            found.push((step, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// The complete checkpoint with the highest step in `dir`, if any.
pub fn latest(dir: &Path) -> Result<Option<PathBuf>> {
    Ok(list(dir)?.pop().map(|(_, p)| p))
}

/// Deletes all but the `n` checkpoints with the highest steps; returns the deleted paths.
/// Temporary files are left alone (a save may be in progress).
pub fn keep_last(dir: &Path, n: usize) -> Result<Vec<PathBuf>> {
    let all = list(dir)?;
    let cut = all.len().saturating_sub(n);
    let mut removed = Vec::with_capacity(cut);
    for (_, path) in all.into_iter().take(cut) {
        fs::remove_file(&path).map_err(io_err(&path, "removing"))?;
        removed.push(path);
    }
    if !removed.is_empty() {
        sync_dir(dir)?;
    }
    Ok(removed)
}

/// Loads a checkpoint completely, or fails naming the file: truncated file, corrupted header,
/// missing or malformed `dflow_step`, unsupported `dflow_format_version`, unsupported dtype, or a
/// bool tensor holding something other than 0 or 1.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let (tensors, metadata) = load_tensors(path)?;
    let meta_err = |key, problem: String| CheckpointError::Metadata {
        path: path.to_path_buf(),
        key,
        problem,
    };
    match metadata.get(VERSION_KEY) {
        Some(v) if v == FORMAT_VERSION => {}
        Some(v) => {
            return Err(meta_err(
                VERSION_KEY,
                format!("version {v:?} is not supported (this build reads {FORMAT_VERSION:?})"),
            ))
        }
        None => {
            return Err(meta_err(
                VERSION_KEY,
                "missing (not a dflow checkpoint?)".into(),
            ))
        }
    }
    let step = match metadata.get(STEP_KEY) {
        Some(s) => s
            .parse::<u64>()
            .map_err(|_| meta_err(STEP_KEY, format!("{s:?} is not a step number")))?,
        None => return Err(meta_err(STEP_KEY, "missing".into())),
    };
    Ok(Checkpoint {
        path: path.to_path_buf(),
        step,
        tensors,
        metadata,
    })
}

/// Every tensor and the metadata of any safetensors file (one written by PyTorch's
/// `safetensors.torch.save_file`, say), with the same checks on the bytes as [`load`] but no
/// dflow metadata required.
pub fn load_tensors(path: &Path) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, String>)> {
    let bytes = fs::read(path).map_err(io_err(path, "reading"))?;
    check_length(path, &bytes)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| classify(path, &bytes, e))?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| classify(path, &bytes, e))?;
    let metadata: BTreeMap<String, String> = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let mut tensors = BTreeMap::new();
    for (name, view) in st.iter() {
        tensors.insert(name.to_string(), to_tensor(path, name, &view)?);
    }
    Ok((tensors, metadata))
}

/// Reports a short file as truncated before the parser calls it something vaguer.
fn check_length(path: &Path, bytes: &[u8]) -> Result<()> {
    let truncated = |detail| CheckpointError::Truncated {
        path: path.to_path_buf(),
        detail,
    };
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(truncated(format!(
            "{} bytes, shorter than the 8-byte header length",
            bytes.len()
        )));
    };
    let mut a = [0u8; 8];
    a.copy_from_slice(len_bytes);
    let header_len = u64::from_le_bytes(a);
    let have = bytes.len() as u64 - 8;
    // A sane header length larger than the file means the file was cut inside the header;
    // an absurd one means a corrupted length, which the parser reports.
    if header_len > have && header_len <= 100_000_000 {
        return Err(truncated(format!(
            "the header needs {header_len} bytes but only {have} follow the length"
        )));
    }
    Ok(())
}

fn classify(path: &Path, bytes: &[u8], e: SafeTensorError) -> CheckpointError {
    match e {
        SafeTensorError::MetadataIncompleteBuffer => CheckpointError::Truncated {
            path: path.to_path_buf(),
            detail: "the tensor data does not match the sizes in the header".into(),
        },
        SafeTensorError::InvalidHeaderDeserialization(_) => unknown_dtype(path, bytes)
            .unwrap_or_else(|| CheckpointError::CorruptHeader {
                path: path.to_path_buf(),
                detail: e.to_string(),
            }),
        other => CheckpointError::CorruptHeader {
            path: path.to_path_buf(),
            detail: other.to_string(),
        },
    }
}

/// When the header is valid JSON but names a dtype safetensors does not know, says which tensor.
fn unknown_dtype(path: &Path, bytes: &[u8]) -> Option<CheckpointError> {
    let len = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header = bytes.get(8..8usize.checked_add(len)?)?;
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    json.iter().find_map(|(name, info)| {
        let dtype = info.get("dtype")?.as_str()?;
        let known = serde_json::from_value::<Dtype>(serde_json::Value::from(dtype)).is_ok();
        (!known).then(|| CheckpointError::UnknownDType {
            path: path.to_path_buf(),
            tensor: name.clone(),
            dtype: dtype.to_string(),
        })
    })
}

fn to_tensor(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Tensor> {
    let dtype = from_st_dtype(view.dtype()).ok_or_else(|| CheckpointError::UnknownDType {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        dtype: view.dtype().to_string(),
    })?;
    let bad = |problem: String| CheckpointError::BadTensor {
        path: path.to_path_buf(),
        tensor: name.to_string(),
        problem,
    };
    if dtype == DType::Bool {
        if let Some(i) = view.data().iter().position(|&b| b > 1) {
            return Err(bad(format!(
                "bool element {i} is {}, not 0 or 1",
                view.data()[i]
            )));
        }
    }
    Tensor::from_bytes(dtype, view.shape(), view.data()).map_err(|e| bad(e.to_string()))
}

/// Picks the expected variables out of `ckpt`, checking each is present with the expected dtype
/// and shape, and that the checkpoint holds nothing else. Every problem is reported in one
/// [`CheckpointError::Mismatch`]. Optimizer slots (`w1/adam_m`, ...) must be listed in `expected`
/// like variables. Returns the tensors in `expected` order (cheap clones sharing the buffers).
pub fn restore_into(
    expected: &[(String, DType, Vec<usize>)],
    ckpt: &Checkpoint,
) -> Result<Vec<(String, Tensor)>> {
    let mut mismatches = Vec::new();
    let mut out = Vec::with_capacity(expected.len());
    for (name, dtype, dims) in expected {
        match ckpt.tensors.get(name) {
            None => mismatches.push(Mismatch::Missing { name: name.clone() }),
            Some(t) => {
                let mut ok = true;
                if t.dtype() != *dtype {
                    ok = false;
                    mismatches.push(Mismatch::WrongDType {
                        name: name.clone(),
                        expected: *dtype,
                        found: t.dtype(),
                    });
                }
                if t.dims() != dims.as_slice() {
                    ok = false;
                    mismatches.push(Mismatch::WrongShape {
                        name: name.clone(),
                        expected: dims.clone(),
                        found: t.dims().to_vec(),
                    });
                }
                if ok {
                    out.push((name.clone(), t.clone()));
                }
            }
        }
    }
    let wanted: BTreeSet<&str> = expected.iter().map(|(n, _, _)| n.as_str()).collect();
    for name in ckpt.tensors.keys() {
        if !wanted.contains(name.as_str()) {
            mismatches.push(Mismatch::Extra { name: name.clone() });
        }
    }
    if mismatches.is_empty() {
        Ok(out)
    } else {
        Err(CheckpointError::Mismatch {
            path: ckpt.path.clone(),
            mismatches,
        })
    }
}
