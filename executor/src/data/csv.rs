//! CSV reader: comma-separated numbers, plain or gzip-compressed (told apart by the magic bytes).

use super::{check_label, DataError, Dataset, ReadOptions, Result, MAX_LINE_BYTES};
use flate2::bufread::MultiGzDecoder;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Reads a CSV file of numbers: one example per line, the label in column
/// [`ReadOptions::label_column`], every other column an `f32` feature (times
/// [`ReadOptions::feature_scale`]).
///
/// The file may be gzip-compressed (recognised by its magic bytes, whatever its name). It is read
/// once, line by line, straight into the data set's storage. Blank lines are skipped; fields may
/// be surrounded by spaces; quoting is not supported (the files are numeric). Labels must be
/// whole numbers (`3` or `3.0`). Errors name the file, line and column. The text (decompressed)
/// is bounded by [`ReadOptions::max_text_bytes`] and each line by [`MAX_LINE_BYTES`], checked as
/// it streams in, so memory stays bounded whatever the file claims.
pub fn read_csv(path: impl AsRef<Path>, options: &ReadOptions) -> Result<Dataset> {
    let path = path.as_ref();
    let io_err = |source| DataError::Io {
        file: path.to_path_buf(),
        source,
    };
    let mut file = BufReader::new(File::open(path).map_err(io_err)?);
    let is_gzip = file.fill_buf().map_err(io_err)?.starts_with(&GZIP_MAGIC);
    let reader: Box<dyn BufRead> = if is_gzip {
        Box::new(BufReader::new(MultiGzDecoder::new(file)))
    } else {
        Box::new(file)
    };
    parse(reader, path, options)
}

fn parse(mut reader: impl BufRead, path: &Path, options: &ReadOptions) -> Result<Dataset> {
    let file = || path.to_path_buf();
    let mut features: Vec<f32> = Vec::new();
    let mut labels: Vec<i64> = Vec::new();
    // (columns per row, resolved label column), fixed by the first data row.
    let mut layout: Option<(usize, usize)> = None;
    let mut header_pending = options.has_header;
    let mut raw = Vec::new();
    let mut line_no = 0usize;
    let mut total = 0u64;
    loop {
        raw.clear();
        let n = (&mut reader)
            .take(MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut raw)
            .map_err(|source| DataError::Io {
                file: file(),
                source,
            })?;
        if n == 0 {
            break;
        }
        line_no += 1;
        total += n as u64;
        if raw.len() > MAX_LINE_BYTES {
            return Err(DataError::TooLarge {
                file: file(),
                what: format!("line {line_no}"),
                limit: MAX_LINE_BYTES as u64,
                hint: "is this a CSV file of numbers? Rows are lines of comma-separated values"
                    .into(),
            });
        }
        if total > options.max_text_bytes {
            return Err(DataError::TooLarge {
                file: file(),
                what: "the text (after decompression)".into(),
                limit: options.max_text_bytes,
                hint: format!(
                    "if the file is genuine, raise the limit with the environment variable \
                     {}=<bytes>",
                    super::MAX_DATA_BYTES_ENV
                ),
            });
        }
        let text = String::from_utf8_lossy(&raw);
        let line = text.trim();
        if line.is_empty() {
            continue;
        }
        if header_pending {
            header_pending = false;
            continue;
        }
        let columns = line.split(',').count();
        let (expected, label_col) = match layout {
            Some(l) => l,
            None => {
                let resolved = resolve_label_column(options.label_column, columns).ok_or(
                    DataError::NoLabelColumn {
                        file: file(),
                        label_column: options.label_column,
                        columns,
                    },
                )?;
                if columns < 2 {
                    return Err(DataError::NoFeatures {
                        file: file(),
                        line: line_no,
                    });
                }
                let l = (columns, resolved);
                layout = Some(l);
                l
            }
        };
        if columns != expected {
            return Err(DataError::Ragged {
                file: file(),
                line: line_no,
                expected,
                found: columns,
            });
        }
        for (col, field) in line.split(',').map(str::trim).enumerate() {
            if col == label_col {
                let label = parse_label(field, path, line_no, col + 1)?;
                check_label(label, options.num_classes, path, || {
                    format!("line {line_no}, column {}", col + 1)
                })?;
                labels.push(label);
            } else {
                let value = field
                    .parse::<f32>()
                    .ok()
                    .filter(|v| v.is_finite())
                    .ok_or_else(|| DataError::NotANumber {
                        file: file(),
                        line: line_no,
                        column: col + 1,
                        value: field.to_string(),
                    })?;
                features.push(value * options.feature_scale);
            }
        }
    }
    match layout {
        Some((columns, _)) => Ok(Dataset::from_checked(
            features,
            labels,
            columns - 1,
            options.num_classes,
        )),
        None => Err(DataError::Empty { file: file() }),
    }
}

/// The label column as a 0-based index, if it exists in rows of `columns` columns.
fn resolve_label_column(label_column: i64, columns: usize) -> Option<usize> {
    let columns = i64::try_from(columns).ok()?;
    let idx = if label_column < 0 {
        columns.checked_add(label_column)?
    } else {
        label_column
    };
    if (0..columns).contains(&idx) {
        usize::try_from(idx).ok()
    } else {
        None
    }
}

fn parse_label(field: &str, path: &Path, line: usize, column: usize) -> Result<i64> {
    if let Ok(v) = field.parse::<i64>() {
        return Ok(v);
    }
    match field.parse::<f64>() {
        // Whole floats within i64's range convert exactly enough for class ids.
        Ok(v) if v.is_finite() && v.fract() == 0.0 && v.abs() < 9.0e18 => Ok(v as i64),
        Ok(_) => Err(DataError::NotAnInteger {
            file: path.to_path_buf(),
            at: format!("line {line}, column {column}"),
            value: field.to_string(),
        }),
        Err(_) => Err(DataError::NotANumber {
            file: path.to_path_buf(),
            line,
            column,
            value: field.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_column_resolution() {
        assert_eq!(resolve_label_column(-1, 65), Some(64));
        assert_eq!(resolve_label_column(0, 65), Some(0));
        assert_eq!(resolve_label_column(-65, 65), Some(0));
        assert_eq!(resolve_label_column(-66, 65), None);
        assert_eq!(resolve_label_column(65, 65), None);
        assert_eq!(resolve_label_column(i64::MIN, 3), None);
    }

    #[test]
    fn header_and_blank_lines_are_skipped() {
        let text = "a,b,label\n\n1, 2 ,0\r\n3,4,1\n";
        let ds = parse(
            text.as_bytes(),
            Path::new("t.csv"),
            &ReadOptions::default().has_header(true),
        )
        .unwrap();
        assert_eq!(ds.len(), 2);
        assert_eq!(ds.features(1), Some(&[3.0, 4.0][..]));
        assert_eq!(ds.label(1), Some(1));
    }
}
