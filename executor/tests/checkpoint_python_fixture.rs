//! Writes a checkpoint of every dtype to `$DFLOW_CKPT_OUT` when that variable is set, for the
//! manual Python interop check in `tests/fixtures/read_ckpt.py`. Does nothing otherwise.

use dflow_executor::checkpoint::save;
use dflow_graph::Tensor;
use half::{bf16, f16};
use std::collections::BTreeMap;

#[test]
fn write_checkpoint_for_python() {
    let Some(dir) = std::env::var_os("DFLOW_CKPT_OUT") else {
        return;
    };
    let tensors = vec![
        (
            "layer1/w".to_string(),
            Tensor::from_slice(&[2, 3], &[1.5f32, -2.0, 3.25, 0.0, 1.0, 2.0]).unwrap(),
        ),
        (
            "layer1/w/adam_m".to_string(),
            Tensor::from_slice(&[2, 3], &[0.1f32; 6]).unwrap(),
        ),
        (
            "f64".to_string(),
            Tensor::from_slice(&[2], &[1e300f64, -0.5]).unwrap(),
        ),
        (
            "i32".to_string(),
            Tensor::from_slice(&[2], &[i32::MIN, 7]).unwrap(),
        ),
        (
            "i64".to_string(),
            Tensor::from_slice(&[2], &[i64::MIN, 9]).unwrap(),
        ),
        (
            "bool".to_string(),
            Tensor::from_slice(&[3], &[1u8, 0, 1]).unwrap(),
        ),
        (
            "bf16".to_string(),
            Tensor::from_slice(&[2], &[bf16::from_f32(1.5), bf16::from_f32(-3.0)]).unwrap(),
        ),
        (
            "f16".to_string(),
            Tensor::from_slice(&[2], &[f16::from_f32(0.25), f16::from_f32(-8.0)]).unwrap(),
        ),
        ("adam/t".to_string(), Tensor::scalar(7i64)),
    ];
    let meta = BTreeMap::from([("model".to_string(), "mlp".to_string())]);
    let path = save(std::path::Path::new(&dir), 42, &tensors, &meta).unwrap();
    println!("{}", path.display());
}
