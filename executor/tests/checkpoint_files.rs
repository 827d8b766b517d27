//! Checkpoints: round trips of every dtype, atomic naming, pruning, and every way a file is bad.

use dflow_executor::checkpoint::{
    self, checkpoint_path, keep_last, latest, list, load, restore_into, save, step_of,
    CheckpointError, Mismatch, FORMAT_VERSION, STEP_KEY, VERSION_KEY,
};
use dflow_graph::{DType, Tensor};
use half::{bf16, f16};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

fn all_dtypes() -> Vec<(String, Tensor)> {
    vec![
        (
            "layer1/w".into(),
            Tensor::from_slice(
                &[2, 3],
                &[1.5f32, -2.0, 3.25, 0.0, f32::MAX, f32::MIN_POSITIVE],
            )
            .unwrap(),
        ),
        (
            "layer1/w/adam_m".into(),
            Tensor::from_slice(&[2, 3], &[0.1f32; 6]).unwrap(),
        ),
        (
            "f64".into(),
            Tensor::from_slice(&[3], &[1e300f64, -0.5, f64::EPSILON]).unwrap(),
        ),
        (
            "i32".into(),
            Tensor::from_slice(&[2, 2], &[i32::MIN, -1, 0, i32::MAX]).unwrap(),
        ),
        (
            "i64".into(),
            Tensor::from_slice(&[2], &[i64::MIN, i64::MAX]).unwrap(),
        ),
        (
            "bool".into(),
            Tensor::from_slice(&[4], &[1u8, 0, 0, 1]).unwrap(),
        ),
        (
            "bf16".into(),
            Tensor::from_slice(&[2], &[bf16::from_f32(1.5), bf16::from_f32(-3.0)]).unwrap(),
        ),
        (
            "f16".into(),
            Tensor::from_slice(&[1, 2], &[f16::from_f32(0.25), f16::from_f32(65504.0)]).unwrap(),
        ),
        ("adam/t".into(), Tensor::scalar(7i64)),
        ("empty".into(), Tensor::zeros(DType::F32, &[0, 5]).unwrap()),
    ]
}

fn meta() -> BTreeMap<String, String> {
    BTreeMap::from([("model".to_string(), "mlp".to_string())])
}

#[test]
fn round_trip_every_dtype_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = all_dtypes();
    let path = save(dir.path(), 1234, &tensors, &meta()).unwrap();
    assert_eq!(path, dir.path().join("ckpt-00001234.safetensors"));
    let ckpt = load(&path).unwrap();
    assert_eq!(ckpt.step, 1234);
    assert_eq!(ckpt.path, path);
    assert_eq!(ckpt.metadata["model"], "mlp");
    assert_eq!(ckpt.metadata[STEP_KEY], "1234");
    assert_eq!(ckpt.metadata[VERSION_KEY], FORMAT_VERSION);
    assert_eq!(ckpt.tensors.len(), tensors.len());
    for (name, t) in &tensors {
        let back = &ckpt.tensors[name];
        assert_eq!(back.dtype(), t.dtype(), "{name}");
        assert_eq!(back.dims(), t.dims(), "{name}");
        assert_eq!(back.as_bytes(), t.as_bytes(), "{name}");
    }
    let expected: Vec<_> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.dtype(), t.dims().to_vec()))
        .collect();
    let restored = restore_into(&expected, &ckpt).unwrap();
    let names: Vec<_> = restored.iter().map(|(n, _)| n.as_str()).collect();
    let want: Vec<_> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, want, "restore_into keeps the expected order");
}

#[test]
fn the_file_is_plain_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), 3, &all_dtypes(), &meta()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = st.tensor("layer1/w").unwrap();
    assert_eq!(w.dtype(), safetensors::Dtype::F32);
    assert_eq!(w.shape(), &[2, 3]);
    assert_eq!(st.tensor("bool").unwrap().dtype(), safetensors::Dtype::BOOL);
    assert_eq!(st.tensor("bf16").unwrap().dtype(), safetensors::Dtype::BF16);
}

#[test]
fn step_overrides_caller_metadata_and_big_steps_sort_numerically() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = meta();
    m.insert(STEP_KEY.into(), "999".into());
    let t = vec![("w".to_string(), Tensor::scalar(1.0f32))];
    let p = save(dir.path(), 5, &t, &m).unwrap();
    assert_eq!(load(&p).unwrap().step, 5);
    let big = save(dir.path(), 123_456_789_012, &t, &m).unwrap();
    assert_eq!(big.file_name().unwrap(), "ckpt-123456789012.safetensors");
    save(dir.path(), 99_999_999, &t, &m).unwrap();
    assert_eq!(latest(dir.path()).unwrap(), Some(big));
}

#[test]
fn latest_ignores_temp_partial_and_unrelated_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert_eq!(latest(d).unwrap(), None);
    assert_eq!(latest(&d.join("does-not-exist")).unwrap(), None);
    let t = vec![("w".to_string(), Tensor::scalar(1.0f32))];
    for step in [10, 2, 30] {
        save(d, step, &t, &BTreeMap::new()).unwrap();
    }
    // What a save interrupted before its rename leaves behind, plus other junk.
    for junk in [
        ".ckpt-00000099.safetensors.tmp-1234-0",
        "ckpt-00000099.safetensors.tmp",
        "ckpt-.safetensors",
        "ckpt-12a.safetensors",
        "ckpt-00000077.json",
        "notes.txt",
    ] {
        std::fs::write(d.join(junk), b"partial").unwrap();
    }
    assert_eq!(latest(d).unwrap(), Some(checkpoint_path(d, 30)));
    let steps: Vec<u64> = list(d).unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, vec![2, 10, 30]);
    // A successful save leaves no temp file of its own.
    let temps = std::fs::read_dir(d)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name().into_string().unwrap();
            name.contains(".tmp-") && !name.contains("1234")
        })
        .count();
    assert_eq!(temps, 0);
    assert_eq!(step_of("ckpt-00000030.safetensors"), Some(30));
    assert_eq!(step_of(".ckpt-00000030.safetensors.tmp-1-0"), None);
}

#[test]
fn keep_last_prunes_oldest() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let t = vec![("w".to_string(), Tensor::scalar(1.0f32))];
    for step in 1..=5 {
        save(d, step * 100, &t, &BTreeMap::new()).unwrap();
    }
    std::fs::write(d.join(".ckpt-00000600.safetensors.tmp-1-0"), b"in progress").unwrap();
    let removed = keep_last(d, 2).unwrap();
    assert_eq!(
        removed,
        vec![
            checkpoint_path(d, 100),
            checkpoint_path(d, 200),
            checkpoint_path(d, 300)
        ]
    );
    let steps: Vec<u64> = list(d).unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, vec![400, 500]);
    assert!(
        d.join(".ckpt-00000600.safetensors.tmp-1-0").exists(),
        "temp files are left alone"
    );
    assert!(keep_last(d, 10).unwrap().is_empty());
}

#[test]
fn duplicate_names_are_rejected_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let t = vec![
        ("w".to_string(), Tensor::scalar(1.0f32)),
        ("w".to_string(), Tensor::scalar(2.0f32)),
    ];
    let e = save(dir.path(), 1, &t, &BTreeMap::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("tensor name `w` appears twice"), "{e}");
    assert_eq!(latest(dir.path()).unwrap(), None);
}

#[test]
fn truncated_files_are_rejected_at_every_cut() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), 8, &all_dtypes(), &meta()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let cut = dir.path().join("ckpt-00000009.safetensors");
    let cuts = [
        0,
        1,
        7,
        8,
        9,
        8 + header_len / 2,
        8 + header_len,
        8 + header_len + 1,
        bytes.len() - 1,
    ];
    for at in cuts {
        std::fs::write(&cut, &bytes[..at]).unwrap();
        let e = load(&cut).unwrap_err();
        assert!(
            matches!(e, CheckpointError::Truncated { .. }),
            "cut at {at}: {e}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("ckpt-00000009.safetensors: truncated checkpoint"),
            "cut at {at}: {msg}"
        );
    }
    // Trailing garbage is as wrong as missing bytes.
    let mut long = bytes.clone();
    long.extend_from_slice(b"xx");
    std::fs::write(&cut, &long).unwrap();
    assert!(load(&cut).is_err());
}

#[test]
fn corrupted_header_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), 8, &all_dtypes(), &meta()).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8] = b'['; // the header's opening brace
    std::fs::write(&path, &bytes).unwrap();
    let e = load(&path).unwrap_err();
    assert!(matches!(e, CheckpointError::CorruptHeader { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("ckpt-00000008.safetensors: corrupted checkpoint header"),
        "{e}"
    );

    // An absurd header length.
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let e = load(&path).unwrap_err().to_string();
    assert!(
        e.contains("ckpt-00000008.safetensors: corrupted checkpoint header"),
        "{e}"
    );
}

/// A safetensors file from a raw JSON header and data bytes.
fn raw_file(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

const OK_META: &str = r#""__metadata__":{"dflow_step":"4","dflow_format_version":"1"}"#;

#[test]
fn unknown_and_unsupported_dtypes_name_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ckpt-00000004.safetensors");
    raw_file(
        &p,
        &format!(r#"{{{OK_META},"q":{{"dtype":"Q4","shape":[2],"data_offsets":[0,2]}}}}"#),
        &[0, 0],
    );
    let e = load(&p).unwrap_err().to_string();
    assert!(
        e.contains(
            "ckpt-00000004.safetensors: tensor `q` has dtype Q4, which dflow does not support"
        ),
        "{e}"
    );

    raw_file(
        &p,
        &format!(r#"{{{OK_META},"u":{{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}}}"#),
        &[0, 0],
    );
    let e = load(&p).unwrap_err().to_string();
    assert!(
        e.contains("tensor `u` has dtype U8, which dflow does not support"),
        "{e}"
    );

    raw_file(
        &p,
        &format!(r#"{{{OK_META},"b":{{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}}}}"#),
        &[1, 2],
    );
    let e = load(&p).unwrap_err().to_string();
    assert!(
        e.contains("tensor `b`: bool element 1 is 2, not 0 or 1"),
        "{e}"
    );
}

#[test]
fn dflow_metadata_is_required() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ckpt-00000004.safetensors");
    let w = r#""w":{"dtype":"F32","shape":[],"data_offsets":[0,4]}"#;
    let cases = [
        (
            r#""__metadata__":{"dflow_format_version":"1"}"#,
            "metadata `dflow_step`: missing",
        ),
        (
            r#""__metadata__":{"dflow_step":"-3","dflow_format_version":"1"}"#,
            "metadata `dflow_step`: \"-3\" is not a step number",
        ),
        (
            r#""__metadata__":{"dflow_step":"3"}"#,
            "metadata `dflow_format_version`: missing",
        ),
        (
            r#""__metadata__":{"dflow_step":"3","dflow_format_version":"2"}"#,
            "version \"2\" is not supported",
        ),
    ];
    for (meta, want) in cases {
        raw_file(&p, &format!("{{{meta},{w}}}"), &[0; 4]);
        let e = load(&p).unwrap_err().to_string();
        assert!(
            e.contains("ckpt-00000004.safetensors: ") && e.contains(want),
            "{e}"
        );
    }
    // No metadata at all (a plain safetensors file from elsewhere).
    let plain = safetensors::serialize(
        HashMap::from([(
            "w",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![], &[0u8; 4])
                .unwrap(),
        )]),
        None,
    )
    .unwrap();
    std::fs::write(&p, plain).unwrap();
    assert!(load(&p).unwrap_err().to_string().contains("missing"));
    // A missing file names itself.
    let e = load(&dir.path().join("nope.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.safetensors: reading"), "{e}");
}

#[test]
fn restore_reports_every_mismatch_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = save(dir.path(), 1, &all_dtypes(), &meta()).unwrap();
    let ckpt = load(&path).unwrap();
    let mut expected: Vec<(String, DType, Vec<usize>)> = all_dtypes()
        .into_iter()
        .filter(|(n, _)| n != "empty" && n != "adam/t")
        .map(|(n, t)| (n, t.dtype(), t.dims().to_vec()))
        .collect();
    expected[0].2 = vec![3, 2]; // layer1/w: wrong shape
    expected[2].1 = DType::F32; // f64: wrong dtype
    expected[3] = ("i32".into(), DType::I64, vec![4]); // both wrong
    expected.push(("layer2/w".into(), DType::F32, vec![3]));
    let err = restore_into(&expected, &ckpt).unwrap_err();
    let CheckpointError::Mismatch { mismatches, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(
        mismatches,
        &vec![
            Mismatch::WrongShape {
                name: "layer1/w".into(),
                expected: vec![3, 2],
                found: vec![2, 3]
            },
            Mismatch::WrongDType {
                name: "f64".into(),
                expected: DType::F32,
                found: DType::F64
            },
            Mismatch::WrongDType {
                name: "i32".into(),
                expected: DType::I64,
                found: DType::I32
            },
            Mismatch::WrongShape {
                name: "i32".into(),
                expected: vec![4],
                found: vec![2, 2]
            },
            Mismatch::Missing {
                name: "layer2/w".into()
            },
            Mismatch::Extra {
                name: "adam/t".into()
            },
            Mismatch::Extra {
                name: "empty".into()
            },
        ]
    );
    let msg = err.to_string();
    assert!(
        msg.contains("ckpt-00000001.safetensors: checkpoint does not match the model (7 problems)"),
        "{msg}"
    );
    assert!(
        msg.contains("`layer1/w` has shape [2, 3], expected [3, 2]"),
        "{msg}"
    );
    assert!(msg.contains("`layer2/w` is missing"), "{msg}");
    assert!(
        msg.contains("`adam/t` is not a variable of the model"),
        "{msg}"
    );
}

#[test]
fn save_overwrites_same_step_atomically() {
    let dir = tempfile::tempdir().unwrap();
    let a = vec![("w".to_string(), Tensor::scalar(1.0f32))];
    let b = vec![("w".to_string(), Tensor::scalar(2.0f32))];
    checkpoint::save(dir.path(), 1, &a, &BTreeMap::new()).unwrap();
    let p = checkpoint::save(dir.path(), 1, &b, &BTreeMap::new()).unwrap();
    assert_eq!(
        load(&p).unwrap().tensors["w"].as_slice::<f32>().unwrap(),
        &[2.0]
    );
    assert_eq!(list(dir.path()).unwrap().len(), 1);
}
