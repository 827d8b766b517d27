//! safetensors reader (parsed by the `safetensors` crate): features and labels as two named
//! tensors of one file.

use super::{check_label, DataError, Dataset, ReadOptions, Result};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// Reads the tensors `features_name` (shape `[n, F]`, or `[n]` as one feature; F32, F64, F16,
/// BF16 or any integer dtype, converted to `f32` and multiplied by
/// [`ReadOptions::feature_scale`]) and `labels_name` (shape `[n]` or `[n, 1]`, any integer dtype)
/// from one safetensors file.
///
/// The file is read once; the tensors are converted straight into the data set's storage. Errors
/// name the file and tensor; label errors name the (0-based) row.
pub fn read_safetensors(
    path: impl AsRef<Path>,
    features_name: &str,
    labels_name: &str,
    options: &ReadOptions,
) -> Result<Dataset> {
    let path = path.as_ref();
    let err = |message: String| DataError::Array {
        file: path.to_path_buf(),
        message,
    };
    let bytes = std::fs::read(path).map_err(|source| DataError::Io {
        file: path.to_path_buf(),
        source,
    })?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| err(format!("not a valid safetensors file: {e}")))?;
    let tensor = |name: &str| {
        st.tensor(name).map_err(|_| {
            let mut names = st.names();
            names.sort_unstable();
            err(format!("no tensor `{name}` (the file has {names:?})"))
        })
    };
    let fview = tensor(features_name)?;
    let lview = tensor(labels_name)?;

    let (rows, num_features) = match *fview.shape() {
        [n] => (n, 1),
        [n, f] => (n, f),
        ref other => {
            return Err(err(format!(
                "features `{features_name}` must have rank 1 or 2, found shape {other:?}"
            )))
        }
    };
    match *lview.shape() {
        [_] | [_, 1] => {}
        ref other => {
            return Err(err(format!(
                "labels `{labels_name}` must have shape [n] or [n, 1], found {other:?}"
            )))
        }
    }
    let mut features = to_f32(&fview).ok_or_else(|| {
        err(format!(
            "features `{features_name}` cannot have dtype {}",
            fview.dtype()
        ))
    })?;
    if options.feature_scale != 1.0 {
        features
            .iter_mut()
            .for_each(|v| *v *= options.feature_scale);
    }
    let labels = to_i64(&lview).ok_or_else(|| {
        err(format!(
            "labels `{labels_name}` must be integers, found dtype {}",
            lview.dtype()
        ))
    })?;
    if labels.len() != rows {
        let at = |name: &str| format!("{}: tensor `{name}`", path.display());
        return Err(DataError::RowCountMismatch {
            features: at(features_name),
            feature_rows: rows,
            labels: at(labels_name),
            label_rows: labels.len(),
        });
    }
    if rows == 0 {
        return Err(DataError::Empty {
            file: path.to_path_buf(),
        });
    }
    for (row, &label) in labels.iter().enumerate() {
        check_label(label, options.num_classes, path, || {
            format!("tensor `{labels_name}`, row {row}")
        })?;
    }
    Ok(Dataset::from_checked(
        features,
        labels,
        num_features,
        options.num_classes,
    ))
}

/// Decodes little-endian elements of `N` bytes (safetensors stores little-endian).
fn decode<const N: usize, T>(data: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    data.chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            f(a)
        })
        .collect()
}

fn to_f32(view: &TensorView<'_>) -> Option<Vec<f32>> {
    let d = view.data();
    Some(match view.dtype() {
        Dtype::F32 => decode(d, f32::from_le_bytes),
        Dtype::F64 => decode(d, |b| f64::from_le_bytes(b) as f32),
        Dtype::F16 => decode(d, |b| half::f16::from_le_bytes(b).to_f32()),
        Dtype::BF16 => decode(d, |b| half::bf16::from_le_bytes(b).to_f32()),
        Dtype::I64 => decode(d, |b| i64::from_le_bytes(b) as f32),
        Dtype::I32 => decode(d, |b| i32::from_le_bytes(b) as f32),
        Dtype::I16 => decode(d, |b| f32::from(i16::from_le_bytes(b))),
        Dtype::I8 => decode(d, |b| f32::from(i8::from_le_bytes(b))),
        Dtype::U64 => decode(d, |b| u64::from_le_bytes(b) as f32),
        Dtype::U32 => decode(d, |b| u32::from_le_bytes(b) as f32),
        Dtype::U16 => decode(d, |b| f32::from(u16::from_le_bytes(b))),
        Dtype::U8 => decode(d, |b| f32::from(u8::from_le_bytes(b))),
        _ => return None,
    })
}

fn to_i64(view: &TensorView<'_>) -> Option<Vec<i64>> {
    let d = view.data();
    Some(match view.dtype() {
        Dtype::I64 => decode(d, i64::from_le_bytes),
        Dtype::I32 => decode(d, |b| i64::from(i32::from_le_bytes(b))),
        Dtype::I16 => decode(d, |b| i64::from(i16::from_le_bytes(b))),
        Dtype::I8 => decode(d, |b| i64::from(i8::from_le_bytes(b))),
        // Values past i64::MAX become -1 and fail the label range check.
        Dtype::U64 => decode(d, |b| i64::try_from(u64::from_le_bytes(b)).unwrap_or(-1)),
        Dtype::U32 => decode(d, |b| i64::from(u32::from_le_bytes(b))),
        Dtype::U16 => decode(d, |b| i64::from(u16::from_le_bytes(b))),
        Dtype::U8 => decode(d, |b| i64::from(u8::from_le_bytes(b))),
        _ => return None,
    })
}
