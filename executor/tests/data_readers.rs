//! Data set readers: the bundled digits file, CSV/gzip, `.npy` and safetensors, and every error.

use dflow_executor::data::{read_csv, read_npy, read_safetensors, DataError, ReadOptions};
use flate2::write::GzEncoder;
use flate2::Compression;
use npyz::WriterBuilder;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

fn digits_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/digits.csv.gz")
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn err_text(r: Result<impl std::fmt::Debug, DataError>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn digits_loads_with_right_shapes_and_labels() {
    let opts = ReadOptions::default()
        .feature_scale(1.0 / 16.0)
        .num_classes(10);
    let ds = read_csv(digits_path(), &opts).unwrap();
    assert_eq!(ds.len(), 1797);
    assert_eq!(ds.num_features(), 64);
    assert_eq!(ds.num_classes(), 10);
    let mut counts = [0usize; 10];
    for i in 0..ds.len() {
        let l = ds.label(i).unwrap();
        counts[usize::try_from(l).unwrap()] += 1;
        let f = ds.features(i).unwrap();
        assert!(
            f.iter().all(|&v| (0.0..=1.0).contains(&v)),
            "row {i}: {f:?}"
        );
    }
    assert!(
        counts.iter().all(|&c| c > 150),
        "every digit present: {counts:?}"
    );
    // First row of the file: pixels 0,0,5,13,... label 0.
    assert_eq!(ds.label(0), Some(0));
    assert_eq!(
        &ds.features(0).unwrap()[..4],
        &[0.0, 0.0, 5.0 / 16.0, 13.0 / 16.0]
    );
    let (x, y) = ds.to_tensors().unwrap();
    assert_eq!(x.dims(), &[1797, 64]);
    assert_eq!(y.dims(), &[1797]);
}

#[test]
fn digits_unscaled_and_inferred_classes() {
    let ds = read_csv(digits_path(), &ReadOptions::default()).unwrap();
    assert_eq!(ds.num_classes(), 10);
    assert_eq!(ds.features(0).unwrap()[3], 13.0);
}

#[test]
fn gzip_is_detected_by_magic_not_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(b"1,2,0\n3,4,1\n").unwrap();
    let gz_path = dir.path().join("data.csv"); // no .gz suffix
    std::fs::write(&gz_path, gz.finish().unwrap()).unwrap();
    let plain_path = write(dir.path(), "data.csv.gz", "1,2,0\n3,4,1\n"); // misleading suffix
    for p in [gz_path, plain_path] {
        let ds = read_csv(&p, &ReadOptions::default()).unwrap();
        assert_eq!(ds.len(), 2);
        assert_eq!(ds.features(1), Some(&[3.0f32, 4.0][..]));
    }
}

#[test]
fn label_column_from_start_or_end() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "a.csv", "2,1.5,2.5\n0,3.5,4.5\n");
    let ds = read_csv(&p, &ReadOptions::default().label_column(0)).unwrap();
    assert_eq!(ds.label(0), Some(2));
    assert_eq!(ds.features(1), Some(&[3.5f32, 4.5][..]));
    let ds = read_csv(&p, &ReadOptions::default().label_column(-3)).unwrap();
    assert_eq!(ds.label(1), Some(0));
    assert_eq!(ds.num_classes(), 3);
    let e = err_text(read_csv(&p, &ReadOptions::default().label_column(3)));
    assert!(
        e.contains("label column 3 does not exist in rows of 3 columns"),
        "{e}"
    );
    let e = err_text(read_csv(&p, &ReadOptions::default().label_column(-4)));
    assert!(e.contains("label column -4"), "{e}");
}

#[test]
fn csv_errors_name_file_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cases: Vec<(&str, &str, ReadOptions, &str)> = vec![
        (
            "nan.csv",
            "1,2,0\n1,x,1\n",
            ReadOptions::default(),
            "nan.csv: line 2, column 2: \"x\" is not a number",
        ),
        (
            "ragged.csv",
            "1,2,0\n1,2,3,1\n",
            ReadOptions::default(),
            "ragged.csv: line 2: 4 columns, but the first row has 3",
        ),
        (
            "empty.csv",
            "",
            ReadOptions::default(),
            "empty.csv: no examples",
        ),
        (
            "blank.csv",
            "\n \n",
            ReadOptions::default(),
            "blank.csv: no examples",
        ),
        (
            "header_only.csv",
            "a,b,label\n",
            ReadOptions::default().has_header(true),
            "header_only.csv: no examples",
        ),
        (
            "range.csv",
            "1,2,0\n\n1,2,10\n",
            ReadOptions::default().num_classes(10),
            "range.csv: line 3, column 3: label 10 is out of range for 10 classes",
        ),
        (
            "negative.csv",
            "1,2,-1\n",
            ReadOptions::default(),
            "negative.csv: line 1, column 3: label -1 is out of range",
        ),
        (
            "frac.csv",
            "1,2,1.5\n",
            ReadOptions::default(),
            "frac.csv: line 1, column 3: label \"1.5\" is not a whole number",
        ),
        (
            "badlabel.csv",
            "1,2,cat\n",
            ReadOptions::default(),
            "badlabel.csv: line 1, column 3: \"cat\" is not a number",
        ),
        (
            "trailing_comma.csv",
            "1,2,\n",
            ReadOptions::default().label_column(0),
            "trailing_comma.csv: line 1, column 3: \"\" is not a number",
        ),
        (
            "inf.csv",
            "inf,2,1\n",
            ReadOptions::default(),
            "inf.csv: line 1, column 1: \"inf\" is not a number",
        ),
    ];
    for (name, text, opts, want) in cases {
        let p = write(d, name, text);
        let e = err_text(read_csv(&p, &opts));
        assert!(e.contains(want), "{name}: got {e:?}, want {want:?}");
    }
    let e = err_text(read_csv(d.join("missing.csv"), &ReadOptions::default()));
    assert!(e.contains("missing.csv"), "{e}");
}

#[test]
fn corrupt_gzip_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(&b"1,2,0\n".repeat(1000)).unwrap();
    let bytes = gz.finish().unwrap();
    let p = dir.path().join("cut.csv.gz");
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = err_text(read_csv(&p, &ReadOptions::default()));
    assert!(e.contains("cut.csv.gz"), "{e}");
}

fn write_npy<T: npyz::AutoSerialize + Copy>(path: &Path, shape: &[u64], data: &[T]) {
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(&mut buf)
        .begin_nd()
        .unwrap();
    w.extend(data.iter().copied()).unwrap();
    w.finish().unwrap();
    std::fs::write(path, buf).unwrap();
}

#[test]
fn npy_reads_features_and_labels() {
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
    write_npy(&x, &[3, 2], &[0.0f64, 2.0, 4.0, 6.0, 8.0, 10.0]);
    write_npy(&y, &[3], &[1i32, 0, 2]);
    let ds = read_npy(&x, &y, &ReadOptions::default().feature_scale(0.5)).unwrap();
    assert_eq!((ds.len(), ds.num_features(), ds.num_classes()), (3, 2, 3));
    assert_eq!(ds.features(2), Some(&[4.0f32, 5.0][..]));
    assert_eq!(ds.label(0), Some(1));

    // u8 pixels and [n, 1] u8 labels also work.
    write_npy(&x, &[2, 2], &[1u8, 2, 3, 4]);
    write_npy(&y, &[2, 1], &[0u8, 1]);
    let ds = read_npy(&x, &y, &ReadOptions::default()).unwrap();
    assert_eq!(ds.features(1), Some(&[3.0f32, 4.0][..]));
}

#[test]
fn npy_fortran_order_is_transposed() {
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&[2, 3])
        .order(npyz::Order::Fortran)
        .writer(&mut buf)
        .begin_nd()
        .unwrap();
    // Column-major storage of [[1, 2, 3], [4, 5, 6]].
    w.extend([1.0f32, 4.0, 2.0, 5.0, 3.0, 6.0]).unwrap();
    w.finish().unwrap();
    std::fs::write(&x, buf).unwrap();
    write_npy(&y, &[2], &[0i64, 1]);
    let ds = read_npy(&x, &y, &ReadOptions::default()).unwrap();
    assert_eq!(ds.features(0), Some(&[1.0f32, 2.0, 3.0][..]));
    assert_eq!(ds.features(1), Some(&[4.0f32, 5.0, 6.0][..]));
}

#[test]
fn npy_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (x, y) = (d.join("x.npy"), d.join("y.npy"));
    write_npy(&x, &[3, 2], &[0.0f32; 6]);

    write_npy(&y, &[2], &[0i64, 1]);
    let e = err_text(read_npy(&x, &y, &ReadOptions::default()));
    assert!(
        e.contains("x.npy has 3 examples but") && e.contains("y.npy has 2 labels"),
        "{e}"
    );

    write_npy(&y, &[3], &[0i64, 1, 7]);
    let e = err_text(read_npy(&x, &y, &ReadOptions::default().num_classes(5)));
    assert!(
        e.contains("y.npy: row 2: label 7 is out of range for 5 classes"),
        "{e}"
    );

    write_npy(&y, &[3], &[0.0f32, 1.0, 2.0]);
    let e = err_text(read_npy(&x, &y, &ReadOptions::default()));
    assert!(
        e.contains("y.npy: labels (integers) cannot have dtype <f4"),
        "{e}"
    );

    write_npy(&y, &[3, 2], &[0i64; 6]);
    let e = err_text(read_npy(&x, &y, &ReadOptions::default()));
    assert!(
        e.contains("y.npy: labels must have shape [n] or [n, 1]"),
        "{e}"
    );

    write_npy(&y, &[3], &[0i64; 3]);
    let bad = write(d, "bad.npy", "this is not numpy");
    let e = err_text(read_npy(&bad, &y, &ReadOptions::default()));
    assert!(e.contains("bad.npy: not a valid .npy file"), "{e}");

    // Truncated data: the header promises 6 values, only part of them follow.
    let mut bytes = std::fs::read(&x).unwrap();
    bytes.truncate(bytes.len() - 5);
    let cut = d.join("cut.npy");
    std::fs::write(&cut, bytes).unwrap();
    let e = err_text(read_npy(&cut, &y, &ReadOptions::default()));
    assert!(e.contains("cut.npy: reading element"), "{e}");

    let x3 = d.join("x3.npy");
    write_npy(&x3, &[1, 1, 3], &[0.0f32; 3]);
    let e = err_text(read_npy(&x3, &y, &ReadOptions::default()));
    assert!(e.contains("x3.npy: features must have rank 1 or 2"), "{e}");

    write_npy(&x, &[0, 2], &[0.0f32; 0]);
    write_npy(&y, &[0], &[0i64; 0]);
    let e = err_text(read_npy(&x, &y, &ReadOptions::default()));
    assert!(e.contains("x.npy: no examples"), "{e}");
}

fn write_st(path: &Path, tensors: Vec<(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)>) {
    let views: HashMap<String, safetensors::tensor::TensorView<'_>> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.to_string(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn le<T: Copy, const N: usize>(v: &[T], f: fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

#[test]
fn safetensors_reads_two_named_tensors() {
    use safetensors::Dtype;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.safetensors");
    write_st(
        &p,
        vec![
            (
                "x",
                Dtype::F32,
                vec![2, 3],
                le(&[1.0f32, 2., 3., 4., 5., 6.], f32::to_le_bytes),
            ),
            ("y", Dtype::I64, vec![2], le(&[1i64, 0], i64::to_le_bytes)),
            (
                "y_f",
                Dtype::F32,
                vec![2],
                le(&[1.0f32, 0.], f32::to_le_bytes),
            ),
            (
                "x_bf16",
                Dtype::BF16,
                vec![2, 1],
                le(
                    &[half::bf16::from_f32(0.5), half::bf16::from_f32(2.0)],
                    half::bf16::to_le_bytes,
                ),
            ),
            ("y_big", Dtype::U8, vec![2], vec![0, 200]),
        ],
    );
    let ds = read_safetensors(&p, "x", "y", &ReadOptions::default()).unwrap();
    assert_eq!((ds.len(), ds.num_features(), ds.num_classes()), (2, 3, 2));
    assert_eq!(ds.features(1), Some(&[4.0f32, 5.0, 6.0][..]));
    assert_eq!(ds.label(0), Some(1));

    let ds = read_safetensors(
        &p,
        "x_bf16",
        "y",
        &ReadOptions::default().feature_scale(2.0),
    )
    .unwrap();
    assert_eq!(ds.features(1), Some(&[4.0f32][..]));

    let e = err_text(read_safetensors(&p, "x", "nope", &ReadOptions::default()));
    assert!(
        e.contains("d.safetensors: no tensor `nope`") && e.contains("\"x\""),
        "{e}"
    );
    let e = err_text(read_safetensors(&p, "x", "y_f", &ReadOptions::default()));
    assert!(
        e.contains("labels `y_f` must be integers, found dtype F32"),
        "{e}"
    );
    let e = err_text(read_safetensors(&p, "x", "x", &ReadOptions::default()));
    assert!(
        e.contains("labels `x` must have shape [n] or [n, 1]"),
        "{e}"
    );
    let e = err_text(read_safetensors(
        &p,
        "x",
        "y_big",
        &ReadOptions::default().num_classes(10),
    ));
    assert!(
        e.contains("tensor `y_big`, row 1: label 200 is out of range for 10 classes"),
        "{e}"
    );
    let e = err_text(read_safetensors(&p, "x_bf16", "x", &ReadOptions::default()));
    assert!(e.contains("labels `x` must"), "{e}");

    let cut = dir.path().join("cut.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() - 3]).unwrap();
    let e = err_text(read_safetensors(&cut, "x", "y", &ReadOptions::default()));
    assert!(
        e.contains("cut.safetensors: not a valid safetensors file"),
        "{e}"
    );
}

#[test]
fn safetensors_row_count_mismatch() {
    use safetensors::Dtype;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.safetensors");
    write_st(
        &p,
        vec![
            (
                "x",
                Dtype::F32,
                vec![3, 1],
                le(&[1.0f32, 2., 3.], f32::to_le_bytes),
            ),
            ("y", Dtype::I32, vec![2], le(&[1i32, 0], i32::to_le_bytes)),
        ],
    );
    let e = err_text(read_safetensors(&p, "x", "y", &ReadOptions::default()));
    assert!(
        e.contains("tensor `x` has 3 examples but") && e.contains("tensor `y` has 2 labels"),
        "{e}"
    );
}
