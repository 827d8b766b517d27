//! `.npy` reader (NumPy's array format, parsed by the `npyz` crate): features and labels in two
//! files.

use super::{check_label, DataError, Dataset, ReadOptions, Result};
use npyz::{NpyFile, Order};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

/// Reads features from one `.npy` file and labels from another.
///
/// Features: shape `[n, F]` (or `[n]`, read as one feature), any float or integer dtype, converted
/// to `f32` and multiplied by [`ReadOptions::feature_scale`]; C or Fortran order. Labels: shape
/// `[n]` or `[n, 1]`, any integer dtype. Both files are streamed element by element into the data
/// set's storage. Errors name the file; label errors name the (0-based) row.
pub fn read_npy(
    features_path: impl AsRef<Path>,
    labels_path: impl AsRef<Path>,
    options: &ReadOptions,
) -> Result<Dataset> {
    let fpath = features_path.as_ref();
    let lpath = labels_path.as_ref();

    let fnpy = open(fpath)?;
    let (rows, num_features, order) = match *fnpy.shape() {
        [n] => (n, 1, Order::C),
        [n, f] => (n, f, fnpy.order()),
        ref other => {
            return Err(array_err(
                fpath,
                format!("features must have rank 1 or 2, found shape {other:?}"),
            ))
        }
    };
    let rows = to_usize(fpath, rows)?;
    let num_features = to_usize(fpath, num_features)?;
    let mut features = read_features(fpath, fnpy)?;
    if order == Order::Fortran && rows > 1 && num_features > 1 {
        features = transpose(&features, num_features, rows);
    }
    if options.feature_scale != 1.0 {
        features
            .iter_mut()
            .for_each(|v| *v *= options.feature_scale);
    }

    let lnpy = open(lpath)?;
    match *lnpy.shape() {
        [_] | [_, 1] => {}
        ref other => {
            return Err(array_err(
                lpath,
                format!("labels must have shape [n] or [n, 1], found {other:?}"),
            ))
        }
    }
    let labels = read_labels(lpath, lnpy)?;
    if labels.len() != rows {
        return Err(DataError::RowCountMismatch {
            features: fpath.display().to_string(),
            feature_rows: rows,
            labels: lpath.display().to_string(),
            label_rows: labels.len(),
        });
    }
    if rows == 0 {
        return Err(DataError::Empty {
            file: fpath.to_path_buf(),
        });
    }
    for (row, &label) in labels.iter().enumerate() {
        check_label(label, options.num_classes, lpath, || format!("row {row}"))?;
    }
    Ok(Dataset::from_checked(
        features,
        labels,
        num_features,
        options.num_classes,
    ))
}

fn array_err(file: &Path, message: String) -> DataError {
    DataError::Array {
        file: file.to_path_buf(),
        message,
    }
}

fn io_err(file: &Path, source: std::io::Error) -> DataError {
    DataError::Io {
        file: file.to_path_buf(),
        source,
    }
}

fn open(path: &Path) -> Result<NpyFile<BufReader<File>>> {
    let file = File::open(path).map_err(|e| io_err(path, e))?;
    NpyFile::new(BufReader::new(file))
        .map_err(|e| array_err(path, format!("not a valid .npy file: {e}")))
}

fn to_usize(path: &Path, n: u64) -> Result<usize> {
    usize::try_from(n).map_err(|_| array_err(path, format!("dimension {n} is too large")))
}

/// Tries each element type in turn; the first the file's dtype matches is streamed into `out`.
macro_rules! read_as {
    ($path:expr, $npy:expr, $out:expr, $what:literal, [$($t:ty => $conv:expr),+ $(,)?]) => {{
        let npy = $npy;
        let dtype = match npy.dtype() {
            npyz::DType::Plain(ts) => ts.to_string(),
            other => other.descr(),
        };
        $(
            let npy = match npy.try_data::<$t>() {
                Ok(reader) => {
                    for (i, v) in reader.enumerate() {
                        let v = v.map_err(|e| {
                            array_err($path, format!("reading element {i}: {e}"))
                        })?;
                        $out.push($conv(i, v)?);
                    }
                    return Ok($out);
                }
                Err(npy) => npy,
            };
        )+
        drop(npy);
        Err(array_err($path, format!(concat!($what, " cannot have dtype {}"), dtype)))
    }};
}

fn read_features<R: Read>(path: &Path, npy: NpyFile<R>) -> Result<Vec<f32>> {
    let mut out: Vec<f32> = Vec::with_capacity(capacity(npy.len()));
    let ok = |_: usize, v: f32| -> Result<f32> { Ok(v) };
    read_as!(path, npy, out, "features", [
        f32 => ok,
        f64 => |i, v: f64| ok(i, v as f32),
        i64 => |i, v: i64| ok(i, v as f32),
        i32 => |i, v: i32| ok(i, v as f32),
        i16 => |i, v: i16| ok(i, f32::from(v)),
        i8 => |i, v: i8| ok(i, f32::from(v)),
        u64 => |i, v: u64| ok(i, v as f32),
        u32 => |i, v: u32| ok(i, v as f32),
        u16 => |i, v: u16| ok(i, f32::from(v)),
        u8 => |i, v: u8| ok(i, f32::from(v)),
    ])
}

fn read_labels<R: Read>(path: &Path, npy: NpyFile<R>) -> Result<Vec<i64>> {
    let mut out: Vec<i64> = Vec::with_capacity(capacity(npy.len()));
    let ok = |_: usize, v: i64| -> Result<i64> { Ok(v) };
    read_as!(path, npy, out, "labels (integers)", [
        i64 => ok,
        i32 => |i, v: i32| ok(i, i64::from(v)),
        i16 => |i, v: i16| ok(i, i64::from(v)),
        i8 => |i, v: i8| ok(i, i64::from(v)),
        u64 => |i, v: u64| i64::try_from(v).map_err(|_| DataError::LabelOutOfRange {
            file: path.to_path_buf(),
            at: format!("row {i}"),
            label: i64::MAX,
            num_classes: 0,
        }),
        u32 => |i, v: u32| ok(i, i64::from(v)),
        u16 => |i, v: u16| ok(i, i64::from(v)),
        u8 => |i, v: u8| ok(i, i64::from(v)),
    ])
}

/// A capacity hint that a lying header cannot turn into a huge allocation.
fn capacity(n: u64) -> usize {
    usize::try_from(n).unwrap_or(0).min(1 << 24)
}

/// Column-major `[rows, cols]` (`cols` runs of `rows`) to row-major.
fn transpose(col_major: &[f32], cols: usize, rows: usize) -> Vec<f32> {
    let mut out = vec![0.0; col_major.len()];
    for (c, column) in col_major.chunks_exact(rows).enumerate() {
        for (r, &v) in column.iter().enumerate() {
            out[r * cols + c] = v;
        }
    }
    out
}
