//! Training data: small tabular data sets held in memory, split, sharded and batched.
//!
//! A [`Dataset`] is a list of examples, each a row of `f32` features and one `i64` class label.
//! The rows live once in two contiguous, shared buffers ([`Arc`]); splitting and sharding only
//! build new lists of row indices, and shuffling permutes indices. The one copy of the data made
//! while training is the gather of a batch's rows into that batch's own tensors.
//!
//! Readers stream their file once, row by row, straight into the contiguous buffers:
//! [`read_csv`] (plain or gzip), [`read_npy`] (two `.npy` files) and [`read_safetensors`] (two
//! named tensors). Every error names the file and the line, row or column at fault.
//!
//! ```
//! use dflow_executor::data::Dataset;
//!
//! // Four examples with two features each; labels in 0..2.
//! let ds = Dataset::new(vec![0., 1., 2., 3., 4., 5., 6., 7.], vec![0, 1, 0, 1], 2, Some(2))?;
//! let (train, test) = ds.split(0.25, 7)?;
//! assert_eq!((train.len(), test.len()), (3, 1));
//! let batches: Vec<_> = train.batches(2, Some(1), 0, false)?.collect::<Result<_, _>>()?;
//! assert_eq!(batches.len(), 2); // 2 + 1 rows
//! assert_eq!(batches[0].0.dims(), &[2, 2]);
//! assert_eq!(batches[1].1.dims(), &[1]);
//! # Ok::<(), dflow_executor::data::DataError>(())
//! ```

mod csv;
mod npy;
mod safetensors;
pub mod text;

pub use self::csv::read_csv;
pub use self::npy::read_npy;
pub use self::safetensors::read_safetensors;

use dflow_graph::{DType, Tensor, TensorError};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Why reading, splitting or batching a data set failed. File errors name the file and the
/// position (line and column for CSV, row for arrays).
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be opened or read.
    #[error("{}: {source}", file.display())]
    Io {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file holds no examples.
    #[error("{}: no examples (the file is empty)", file.display())]
    Empty {
        /// The file.
        file: PathBuf,
    },
    /// A CSV field is not a number.
    #[error("{}: line {line}, column {column}: \"{value}\" is not a number", file.display())]
    NotANumber {
        /// The file.
        file: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The field as written.
        value: String,
    },
    /// A label is not a whole number.
    #[error("{}: {at}: label \"{value}\" is not a whole number", file.display())]
    NotAnInteger {
        /// The file.
        file: PathBuf,
        /// Where: `line L, column C` or `row R`.
        at: String,
        /// The label as written.
        value: String,
    },
    /// A CSV row has a different number of columns than the first row.
    #[error(
        "{}: line {line}: {found} columns, but the first row has {expected}",
        file.display()
    )]
    Ragged {
        /// The file.
        file: PathBuf,
        /// 1-based line.
        line: usize,
        /// Columns in the first row.
        expected: usize,
        /// Columns in this row.
        found: usize,
    },
    /// The label column index does not exist.
    #[error(
        "{}: label column {label_column} does not exist in rows of {columns} columns",
        file.display()
    )]
    NoLabelColumn {
        /// The file.
        file: PathBuf,
        /// The requested index (negative counts from the end).
        label_column: i64,
        /// Columns per row.
        columns: usize,
    },
    /// A label lies outside `0..num_classes`.
    #[error("{}: {at}: label {label} is out of range for {num_classes} classes (0..{num_classes})", file.display())]
    LabelOutOfRange {
        /// The file (empty for in-memory data).
        file: PathBuf,
        /// Where: `line L, column C` or `row R`.
        at: String,
        /// The label.
        label: i64,
        /// The number of classes.
        num_classes: usize,
    },
    /// An array file (`.npy`, safetensors) is malformed or has the wrong dtype or rank.
    #[error("{}: {message}", file.display())]
    Array {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A text file, once decompressed, is larger than [`ReadOptions::max_text_bytes`], or one of
    /// its lines is longer than [`MAX_LINE_BYTES`] (a gzip bomb, or not a CSV file).
    #[error("{}: {what} is larger than the limit of {limit} bytes; {hint}", file.display())]
    TooLarge {
        /// The file.
        file: PathBuf,
        /// What passed the limit (`the decompressed text`, `line 1`).
        what: String,
        /// The limit in bytes.
        limit: u64,
        /// What to do about it.
        hint: String,
    },
    /// CSV rows hold a label and nothing else.
    #[error(
        "{}: line {line} has a single column (the label) and no features; a data row is \
         `feature,feature,...,label` separated by commas",
        file.display()
    )]
    NoFeatures {
        /// The file.
        file: PathBuf,
        /// The first data line (1-based).
        line: usize,
    },
    /// Features and labels disagree on the number of examples.
    #[error("{features} has {feature_rows} examples but {labels} has {label_rows} labels")]
    RowCountMismatch {
        /// Where the features came from.
        features: String,
        /// Rows of features.
        feature_rows: usize,
        /// Where the labels came from.
        labels: String,
        /// Number of labels.
        label_rows: usize,
    },
    /// A caller-supplied argument is invalid (batch size 0, shard index out of range, ...).
    #[error("{0}")]
    InvalidArgument(String),
    /// A batch tensor could not be built.
    #[error("building a batch: {0}")]
    Tensor(#[from] TensorError),
}

/// Shorthand for results of this module.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// How to read a data file. Defaults: label in the last column, features unscaled, the number of
/// classes inferred as `max label + 1`, no header line.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadOptions {
    /// CSV only: the column holding the label; negative counts from the end (`-1` = last).
    pub label_column: i64,
    /// Every feature is multiplied by this (e.g. `1.0 / 16.0` for the digits pixels 0..16).
    pub feature_scale: f32,
    /// When set, every label must lie in `0..num_classes`; otherwise labels must be `>= 0`.
    pub num_classes: Option<usize>,
    /// CSV only: skip the first non-blank line (column names).
    pub has_header: bool,
    /// CSV only: most bytes of text read (after decompression), so a small gzip bomb cannot
    /// take the machine's memory. Default [`DEFAULT_MAX_TEXT_BYTES`], or the value of the
    /// environment variable [`MAX_DATA_BYTES_ENV`] when it is set to a number.
    pub max_text_bytes: u64,
}

/// Default [`ReadOptions::max_text_bytes`]: 2 GiB of decompressed CSV text.
pub const DEFAULT_MAX_TEXT_BYTES: u64 = 2 << 30;

/// Longest CSV line accepted (bytes); a longer one is refused before it is held in memory.
/// Rows of even a million features fit.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// The environment variable that overrides [`DEFAULT_MAX_TEXT_BYTES`] (a number of bytes).
pub const MAX_DATA_BYTES_ENV: &str = "DFLOW_MAX_DATA_BYTES";

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            label_column: -1,
            feature_scale: 1.0,
            num_classes: None,
            has_header: false,
            max_text_bytes: std::env::var(MAX_DATA_BYTES_ENV)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(DEFAULT_MAX_TEXT_BYTES),
        }
    }
}

impl ReadOptions {
    /// Sets [`ReadOptions::label_column`].
    pub fn label_column(mut self, column: i64) -> Self {
        self.label_column = column;
        self
    }

    /// Sets [`ReadOptions::feature_scale`].
    pub fn feature_scale(mut self, scale: f32) -> Self {
        self.feature_scale = scale;
        self
    }

    /// Sets [`ReadOptions::num_classes`].
    pub fn num_classes(mut self, n: usize) -> Self {
        self.num_classes = Some(n);
        self
    }

    /// Sets [`ReadOptions::max_text_bytes`].
    pub fn max_text_bytes(mut self, bytes: u64) -> Self {
        self.max_text_bytes = bytes;
        self
    }

    /// Sets [`ReadOptions::has_header`].
    pub fn has_header(mut self, yes: bool) -> Self {
        self.has_header = yes;
        self
    }
}

/// Checks one label against the options; `at` renders the position only on error.
pub(crate) fn check_label(
    label: i64,
    num_classes: Option<usize>,
    file: &Path,
    at: impl FnOnce() -> String,
) -> Result<()> {
    let in_range = match num_classes {
        Some(n) => usize::try_from(label).is_ok_and(|l| l < n),
        None => label >= 0,
    };
    if in_range {
        Ok(())
    } else {
        Err(DataError::LabelOutOfRange {
            file: file.to_path_buf(),
            at: at(),
            label,
            num_classes: num_classes.unwrap_or(0),
        })
    }
}

/// The shared, immutable storage behind every view of one data set.
#[derive(Debug)]
struct Storage {
    /// Row-major `[rows, num_features]`.
    features: Vec<f32>,
    labels: Vec<i64>,
    num_features: usize,
    num_classes: usize,
}

/// An in-memory data set of `(features, label)` examples, or a view (split, shard) of one.
///
/// Cloning is cheap: clones share the rows. All views of one data set share one storage.
#[derive(Debug, Clone)]
pub struct Dataset {
    storage: Arc<Storage>,
    /// The storage rows this view holds, in order.
    rows: Arc<[usize]>,
}

impl Dataset {
    /// A data set from row-major features (`labels.len() * num_features` values) and labels.
    ///
    /// With `num_classes` set every label must lie in `0..num_classes`; without, labels must be
    /// non-negative and the number of classes is `max label + 1`.
    pub fn new(
        features: Vec<f32>,
        labels: Vec<i64>,
        num_features: usize,
        num_classes: Option<usize>,
    ) -> Result<Dataset> {
        let expected = labels.len().checked_mul(num_features);
        if expected != Some(features.len()) {
            return Err(DataError::RowCountMismatch {
                features: format!(
                    "features ({} values, {num_features} per row)",
                    features.len()
                ),
                feature_rows: features.len().checked_div(num_features).unwrap_or(0),
                labels: "labels".into(),
                label_rows: labels.len(),
            });
        }
        for (row, &label) in labels.iter().enumerate() {
            check_label(label, num_classes, Path::new("<memory>"), || {
                format!("row {row}")
            })?;
        }
        Ok(Self::from_checked(
            features,
            labels,
            num_features,
            num_classes,
        ))
    }

    /// Builds a data set from parts whose lengths and labels the caller has checked.
    fn from_checked(
        features: Vec<f32>,
        labels: Vec<i64>,
        num_features: usize,
        num_classes: Option<usize>,
    ) -> Dataset {
        let inferred = labels
            .iter()
            .max()
            .and_then(|&m| usize::try_from(m).ok())
            .map_or(0, |m| m + 1);
        let rows: Arc<[usize]> = (0..labels.len()).collect();
        Dataset {
            storage: Arc::new(Storage {
                features,
                labels,
                num_features,
                num_classes: num_classes.unwrap_or(inferred),
            }),
            rows,
        }
    }

    /// Number of examples in this view.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when the view holds no examples.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Features per example.
    pub fn num_features(&self) -> usize {
        self.storage.num_features
    }

    /// Number of classes: as given to the reader, or `max label + 1` of the whole data set.
    pub fn num_classes(&self) -> usize {
        self.storage.num_classes
    }

    /// The features of example `i` of this view (`None` past the end).
    pub fn features(&self, i: usize) -> Option<&[f32]> {
        let row = *self.rows.get(i)?;
        let f = self.storage.num_features;
        self.storage.features.get(row * f..(row + 1) * f)
    }

    /// The label of example `i` of this view (`None` past the end).
    pub fn label(&self, i: usize) -> Option<i64> {
        self.storage.labels.get(*self.rows.get(i)?).copied()
    }

    /// Identifies the examples of this view: their row numbers in the file they were read from.
    /// Views of one data set are disjoint exactly when these are.
    pub fn row_ids(&self) -> &[usize] {
        &self.rows
    }

    fn view(&self, rows: Vec<usize>) -> Dataset {
        Dataset {
            storage: self.storage.clone(),
            rows: rows.into(),
        }
    }

    /// Splits into `(train, test)`: `round(len * test_fraction)` examples, chosen by a ChaCha8
    /// shuffle seeded with `seed`, go to `test`, the rest to `train`. Both keep the original row
    /// order. The same seed always gives the same split; no rows are copied.
    pub fn split(&self, test_fraction: f64, seed: u64) -> Result<(Dataset, Dataset)> {
        if !(0.0..=1.0).contains(&test_fraction) {
            return Err(DataError::InvalidArgument(format!(
                "test fraction {test_fraction} is not in 0..=1"
            )));
        }
        let mut order: Vec<usize> = self.rows.to_vec();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        // The product is at most len, so the cast back cannot overflow.
        let n_test = ((self.len() as f64) * test_fraction).round() as usize;
        let mut test = order[..n_test.min(order.len())].to_vec();
        let mut train = order[n_test.min(order.len())..].to_vec();
        test.sort_unstable();
        train.sort_unstable();
        Ok((self.view(train), self.view(test)))
    }

    /// The shard of worker `index` out of `count`: examples `index, index + count, ...` of this
    /// view. The `count` shards are disjoint, cover every example once, and differ in size by at
    /// most one. Striding (rather than cutting blocks) keeps the class mix of sorted files even.
    pub fn shard(&self, index: usize, count: usize) -> Result<Dataset> {
        if count == 0 || index >= count {
            return Err(DataError::InvalidArgument(format!(
                "shard index {index} is not in 0..{count}"
            )));
        }
        let rows = self
            .rows
            .iter()
            .copied()
            .skip(index)
            .step_by(count)
            .collect();
        Ok(self.view(rows))
    }

    /// Number of batches [`Dataset::batches`] yields per epoch.
    pub fn num_batches(&self, batch_size: usize, drop_remainder: bool) -> usize {
        match (batch_size, drop_remainder) {
            (0, _) => 0,
            (b, true) => self.len() / b,
            (b, false) => self.len().div_ceil(b),
        }
    }

    /// Iterates over one epoch in batches of `batch_size` examples, each yielded as
    /// `(features: f32 [b, F], labels: i64 [b])`.
    ///
    /// With `shuffle_seed = Some(seed)` the order is a Fisher–Yates shuffle
    /// ([`SliceRandom::shuffle`]) driven by a [`ChaCha8Rng`] seeded (via `seed_from_u64`) with
    /// [`epoch_seed`]`(seed, epoch)`: deterministic, and different for every epoch. With `None`
    /// the view's order is kept. The last batch holds the remainder unless `drop_remainder`.
    /// Each batch gathers its rows into fresh tensors; nothing else is copied.
    pub fn batches(
        &self,
        batch_size: usize,
        shuffle_seed: Option<u64>,
        epoch: u64,
        drop_remainder: bool,
    ) -> Result<Batches> {
        if batch_size == 0 {
            return Err(DataError::InvalidArgument("batch size must be > 0".into()));
        }
        let mut order = self.epoch_order(shuffle_seed, epoch);
        if drop_remainder {
            order.truncate(order.len() - order.len() % batch_size);
        }
        Ok(Batches {
            storage: self.storage.clone(),
            order,
            next: 0,
            batch_size,
        })
    }

    /// Part `part` of `parts` of batch `batch_index` of an epoch shuffled with `seed`, as
    /// `(features [m, F], labels [m])`: the batch is the one [`Dataset::batches`]`(batch_size,
    /// Some(seed), epoch, false)` yields at that index, cut into `parts` contiguous slices by
    /// [`part_range`]. Concatenating the parts in order gives the batch back, so `parts` workers
    /// of a synchronous step together see exactly the global batch.
    ///
    /// Each call shuffles the whole view again (`O(len)`): cheap next to a training step on
    /// in-memory data, but a loop over many batches should call [`Dataset::batches`] instead.
    ///
    /// Errors: batch size 0, `part` not in `0..parts`, `batch_index` past the epoch's last batch,
    /// or an empty part (a batch with fewer rows than `parts`).
    pub fn batch_part(
        &self,
        batch_size: usize,
        seed: u64,
        epoch: u64,
        batch_index: usize,
        part: usize,
        parts: usize,
    ) -> Result<(Tensor, Tensor)> {
        if batch_size == 0 {
            return Err(DataError::InvalidArgument("batch size must be > 0".into()));
        }
        let num_batches = self.num_batches(batch_size, false);
        if batch_index >= num_batches {
            return Err(DataError::InvalidArgument(format!(
                "batch {batch_index} is not in 0..{num_batches} ({} examples in batches of {batch_size})",
                self.len()
            )));
        }
        let start = batch_index * batch_size;
        let rows = (self.len() - start).min(batch_size);
        let range = part_range(rows, part, parts).ok_or_else(|| {
            DataError::InvalidArgument(format!("batch part {part} is not in 0..{parts}"))
        })?;
        if range.is_empty() {
            return Err(DataError::InvalidArgument(format!(
                "part {part} of {parts} of batch {batch_index} would be empty: the batch has only {rows} examples"
            )));
        }
        let order = self.epoch_order(Some(seed), epoch);
        gather(
            &self.storage,
            &order[start + range.start..start + range.end],
        )
    }

    /// The view's rows in the order of `epoch`: shuffled as [`Dataset::batches`] documents, or
    /// as they are without a seed.
    fn epoch_order(&self, shuffle_seed: Option<u64>, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = self.rows.to_vec();
        if let Some(seed) = shuffle_seed {
            order.shuffle(&mut ChaCha8Rng::seed_from_u64(epoch_seed(seed, epoch)));
        }
        order
    }

    /// The whole view as two tensors `(features [n, F], labels [n])` (e.g. for evaluation).
    pub fn to_tensors(&self) -> Result<(Tensor, Tensor)> {
        gather(&self.storage, &self.rows)
    }
}

/// The shuffle seed of `epoch` under base `seed`: `seed ^ (epoch * 0x9E3779B97F4A7C15)` (wrapping;
/// the golden-ratio constant spreads consecutive epochs over all 64 bits). Epoch 0 uses `seed`.
pub fn epoch_seed(seed: u64, epoch: u64) -> u64 {
    seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The rows of part `part` when `rows` rows are cut into `parts` contiguous slices: the first
/// `rows % parts` slices hold `rows / parts + 1` rows, the others `rows / parts`. `None` when
/// `part` is not in `0..parts`; a range is empty when `rows < parts` and `part >= rows`.
///
/// ```
/// use dflow_executor::data::part_range;
///
/// assert_eq!(part_range(31, 0, 2), Some(0..16));
/// assert_eq!(part_range(31, 1, 2), Some(16..31));
/// assert_eq!(part_range(2, 2, 3), Some(2..2));
/// assert_eq!(part_range(8, 3, 3), None);
/// ```
pub fn part_range(rows: usize, part: usize, parts: usize) -> Option<Range<usize>> {
    if part >= parts {
        return None;
    }
    let (size, longer) = (rows / parts, rows % parts);
    let start = part * size + part.min(longer);
    let len = size + usize::from(part < longer);
    Some(start..start + len)
}

/// Copies the given storage rows into fresh `[n, F]` and `[n]` tensors.
fn gather(storage: &Storage, rows: &[usize]) -> Result<(Tensor, Tensor)> {
    let f = storage.num_features;
    let mut features = Tensor::zeros(DType::F32, &[rows.len(), f])?;
    let mut labels = Tensor::zeros(DType::I64, &[rows.len()])?;
    {
        let dst = features.as_mut_slice::<f32>()?;
        for (out, &row) in dst.chunks_exact_mut(f.max(1)).zip(rows) {
            out.copy_from_slice(&storage.features[row * f..(row + 1) * f]);
        }
    }
    {
        let dst = labels.as_mut_slice::<i64>()?;
        for (out, &row) in dst.iter_mut().zip(rows) {
            *out = storage.labels[row];
        }
    }
    Ok((features, labels))
}

/// One epoch of batches; see [`Dataset::batches`]. Owns what it needs (no borrow of the data set).
#[derive(Debug)]
pub struct Batches {
    storage: Arc<Storage>,
    order: Vec<usize>,
    next: usize,
    batch_size: usize,
}

impl Iterator for Batches {
    type Item = Result<(Tensor, Tensor)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.order.len() {
            return None;
        }
        let end = (self.next + self.batch_size).min(self.order.len());
        let rows = &self.order[self.next..end];
        self.next = end;
        Some(gather(&self.storage, rows))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = (self.order.len() - self.next).div_ceil(self.batch_size);
        (n, Some(n))
    }
}

impl ExactSizeIterator for Batches {}
