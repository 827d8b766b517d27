//! `.npy` files for feeds and fetches (through the `npyz` crate).

use dflow_graph::{DType, Tensor};
use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::Path;

/// Errors reading or writing `.npy` files; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file's dtype has no dflow equivalent.
    #[error("{path}: unsupported .npy dtype {descr} (supported: f2, f4, f8, i4, i8, b1)")]
    UnsupportedDType {
        /// The file.
        path: String,
        /// The dtype descriptor in the file.
        descr: String,
    },
    /// The data does not form a valid tensor.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// Reads a `.npy` file (C order) into a tensor.
pub fn read_tensor(path: &Path) -> Result<Tensor, NpyError> {
    let p = path.display().to_string();
    let io = |source| NpyError::Io {
        path: p.clone(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let npy = npyz::NpyFile::new(BufReader::new(file)).map_err(io)?;
    if npy.order() != npyz::Order::C {
        return Err(NpyError::Invalid {
            path: p,
            message: "Fortran-order arrays are not supported".into(),
        });
    }
    let shape: Vec<usize> = npy
        .shape()
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| NpyError::Invalid {
            path: p.clone(),
            message: "dimension too large".into(),
        })?;
    let descr = match npy.dtype() {
        npyz::DType::Plain(ts) => ts.to_string(),
        other => other.descr(),
    };
    let kind = descr.trim_start_matches(['<', '>', '|', '=']);
    let invalid = |e: dflow_graph::TensorError| NpyError::Invalid {
        path: p.clone(),
        message: e.to_string(),
    };
    let t = match kind {
        "f4" => Tensor::from_slice(&shape, &npy.into_vec::<f32>().map_err(io)?),
        "f8" => Tensor::from_slice(&shape, &npy.into_vec::<f64>().map_err(io)?),
        "i4" => Tensor::from_slice(&shape, &npy.into_vec::<i32>().map_err(io)?),
        "i8" => Tensor::from_slice(&shape, &npy.into_vec::<i64>().map_err(io)?),
        "f2" => Tensor::from_slice(&shape, &npy.into_vec::<half::f16>().map_err(io)?),
        "b1" => {
            let v: Vec<u8> = npy
                .into_vec::<bool>()
                .map_err(io)?
                .into_iter()
                .map(u8::from)
                .collect();
            Tensor::from_slice(&shape, &v)
        }
        _ => return Err(NpyError::UnsupportedDType { path: p, descr }),
    };
    t.map_err(invalid)
}

/// Writes a tensor as a `.npy` file (bf16 is written as f32: numpy has no bf16).
pub fn write_tensor(path: &Path, t: &Tensor) -> Result<(), NpyError> {
    use npyz::WriterBuilder;
    let p = path.display().to_string();
    let io = |source| NpyError::Io {
        path: p.clone(),
        source,
    };
    let shape: Vec<u64> = t.dims().iter().map(|&d| d as u64).collect();
    let file = BufWriter::new(File::create(path).map_err(io)?);
    macro_rules! write_as {
        ($ty:ty, $values:expr) => {{
            let mut w = npyz::WriteOptions::<$ty>::new()
                .default_dtype()
                .shape(&shape)
                .writer(file)
                .begin_nd()
                .map_err(io)?;
            w.extend($values).map_err(io)?;
            w.finish().map_err(io)
        }};
    }
    let wrong = |e: dflow_graph::TensorError| NpyError::Invalid {
        path: p.clone(),
        message: e.to_string(),
    };
    match t.dtype() {
        DType::F32 => write_as!(f32, t.as_slice::<f32>().map_err(wrong)?.iter().copied()),
        DType::F64 => write_as!(f64, t.as_slice::<f64>().map_err(wrong)?.iter().copied()),
        DType::I32 => write_as!(i32, t.as_slice::<i32>().map_err(wrong)?.iter().copied()),
        DType::I64 => write_as!(i64, t.as_slice::<i64>().map_err(wrong)?.iter().copied()),
        DType::F16 => write_as!(
            half::f16,
            t.as_slice::<half::f16>().map_err(wrong)?.iter().copied()
        ),
        DType::BF16 => write_as!(
            f32,
            t.as_slice::<half::bf16>()
                .map_err(wrong)?
                .iter()
                .map(|x| x.to_f32())
        ),
        DType::Bool => write_as!(
            bool,
            t.as_slice::<u8>().map_err(wrong)?.iter().map(|&x| x != 0)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_dtype() {
        let dir = std::env::temp_dir().join(format!("dflow-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cases = [
            Tensor::from_slice(&[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.5]).unwrap(),
            Tensor::from_slice(&[2], &[1.0f64, -2.0]).unwrap(),
            Tensor::from_slice(&[1, 2], &[7i32, -8]).unwrap(),
            Tensor::from_slice(&[3], &[1i64, 2, 3]).unwrap(),
            Tensor::from_slice(&[2], &[0u8, 1]).unwrap(),
            Tensor::from_slice(&[1], &[half::f16::from_f32(1.5)]).unwrap(),
            Tensor::scalar(3.0f32),
            Tensor::zeros(DType::F32, &[0, 4]).unwrap(),
        ];
        for (i, t) in cases.iter().enumerate() {
            let p = dir.join(format!("t{i}.npy"));
            write_tensor(&p, t).unwrap();
            assert_eq!(&read_tensor(&p).unwrap(), t);
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn garbage_and_missing_files_are_errors_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("dflow-npy-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.npy");
        std::fs::write(&p, b"\x93NUMPY\x01\x00garbage").unwrap();
        let e = read_tensor(&p).unwrap_err().to_string();
        assert!(e.contains("bad.npy"), "{e}");
        let e = read_tensor(&dir.join("missing.npy"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.npy"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
