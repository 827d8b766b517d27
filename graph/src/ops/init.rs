//! Variable initializers: the `initializer` and `seed` attributes of `Variable`.
//!
//! | name             | values                                                            |
//! |------------------|-------------------------------------------------------------------|
//! | `zeros`          | 0 (any dtype)                                                     |
//! | `ones`           | 1 (any dtype; `true` for bool)                                    |
//! | `constant`       | the `init_value` attribute (any dtype: truncated for ints, ≠ 0 for bool) |
//! | `uniform`        | U[−0.05, 0.05) (Keras `RandomUniform` default)                    |
//! | `normal`         | N(0, σ²), σ the `stddev` attribute (default 0.05, Keras `RandomNormal`'s) |
//! | `glorot_uniform` | U[−l, l), l = √(6 / (fan_in + fan_out))                           |
//! | `glorot_normal`  | N(0, σ²) truncated at ±2σ, σ = √(2 / (fan_in + fan_out)) / 0.8796…|
//! | `he_uniform`     | U[−l, l), l = √(6 / fan_in)                                       |
//! | `he_normal`      | N(0, σ²) truncated at ±2σ, σ = √(2 / fan_in) / 0.8796…            |
//! | `tf_random_normal`    | TensorFlow's `RandomStandardNormal` × `init_scale` + `init_value` |
//! | `tf_random_uniform`   | TensorFlow's `RandomUniform` (U[0, 1)) × `init_scale` + `init_value` |
//! | `tf_truncated_normal` | TensorFlow's `TruncatedNormal` × `init_scale` + `init_value` |
//!
//! The `tf_*` initializers reproduce TensorFlow's values exactly (float32 only): the draw of
//! its CPU kernel for the op's `seed` and `seed2` (the Variable's `seed` and `seed2`
//! attributes, see [`crate::tf_random`]), then `× init_scale` and `+ init_value` in float32, as
//! the `Mul` and `Add` of TensorFlow's initializer graph compute them. The TensorFlow importer
//! sets them ([`crate::tf_import`]).
//!
//! The truncated normals divide σ by 0.87962566103423978 (the standard deviation of a unit
//! normal truncated at ±2) so the *truncated* distribution has the variance named above, as
//! TensorFlow's `VarianceScaling` does. Random initializers need a float dtype (`f32`, `f64`,
//! `bf16`, `f16`); values are drawn as `f64` and rounded once.
//!
//! # Fans (TensorFlow's `_compute_fans`)
//!
//! - rank 0: fan_in = fan_out = 1;
//! - rank 1 `[n]`: fan_in = fan_out = n;
//! - rank 2 `[fan_in, fan_out]` (a `MatMul` weight `x · W`);
//! - rank ≥ 3 `[..., in, out]` (convolution kernels): fan_in = in · r, fan_out = out · r with
//!   r the product of the leading (receptive-field) dims.
//!
//! # Determinism
//!
//! Values come from ChaCha8 seeded with `seed` on the stream given by the FNV-1a hash of the
//! variable's node name: the same (name, seed) gives the same values on every run and machine,
//! a different seed gives different values, and two variables sharing a seed still differ.

use super::elementwise::{new_tensor, ones};
use crate::{DType, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;
use std::str::FromStr;

/// A variable initializer (see the module docs for the distributions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Initializer {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Every element the `init_value` attribute.
    Constant,
    /// Uniform on [−0.05, 0.05).
    Uniform,
    /// Normal, mean 0, standard deviation 0.05.
    Normal,
    /// Glorot (Xavier) uniform.
    GlorotUniform,
    /// Glorot (Xavier) truncated normal.
    GlorotNormal,
    /// He (Kaiming) uniform.
    HeUniform,
    /// He (Kaiming) truncated normal.
    HeNormal,
    /// TensorFlow's `RandomStandardNormal` stream, scaled and offset (see the module docs).
    TfRandomNormal,
    /// TensorFlow's `RandomUniform` stream, scaled and offset.
    TfRandomUniform,
    /// TensorFlow's `TruncatedNormal` stream, scaled and offset.
    TfTruncatedNormal,
}

impl Initializer {
    /// Every initializer, in documentation order.
    pub const ALL: [Initializer; 12] = [
        Initializer::Zeros,
        Initializer::Ones,
        Initializer::Constant,
        Initializer::Uniform,
        Initializer::Normal,
        Initializer::GlorotUniform,
        Initializer::GlorotNormal,
        Initializer::HeUniform,
        Initializer::HeNormal,
        Initializer::TfRandomNormal,
        Initializer::TfRandomUniform,
        Initializer::TfTruncatedNormal,
    ];

    /// True for the initializers that reproduce a TensorFlow random op ([`tf_random_value`]).
    pub fn is_tensorflow(self) -> bool {
        matches!(
            self,
            Initializer::TfRandomNormal
                | Initializer::TfRandomUniform
                | Initializer::TfTruncatedNormal
        )
    }

    /// The attribute spelling.
    pub fn name(self) -> &'static str {
        match self {
            Initializer::Zeros => "zeros",
            Initializer::Ones => "ones",
            Initializer::Constant => "constant",
            Initializer::Uniform => "uniform",
            Initializer::Normal => "normal",
            Initializer::GlorotUniform => "glorot_uniform",
            Initializer::GlorotNormal => "glorot_normal",
            Initializer::HeUniform => "he_uniform",
            Initializer::HeNormal => "he_normal",
            Initializer::TfRandomNormal => "tf_random_normal",
            Initializer::TfRandomUniform => "tf_random_uniform",
            Initializer::TfTruncatedNormal => "tf_truncated_normal",
        }
    }
}

impl fmt::Display for Initializer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Initializer {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Initializer::ALL
            .into_iter()
            .find(|i| i.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = Initializer::ALL.iter().map(|i| i.name()).collect();
                format!(
                    "unknown initializer `{s}` (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// `(fan_in, fan_out)` of a weight of shape `dims` (see the module docs).
pub fn fans(dims: &[usize]) -> (f64, f64) {
    match dims {
        [] => (1.0, 1.0),
        [n] => (*n as f64, *n as f64),
        [i, o] => (*i as f64, *o as f64),
        [lead @ .., i, o] => {
            let r: f64 = lead.iter().map(|&d| d as f64).product();
            (*i as f64 * r, *o as f64 * r)
        }
    }
}

/// FNV-1a of `s` (the per-variable random stream).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A standard normal draw (Box–Muller).
fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1 = 1.0 - rng.gen::<f64>(); // (0, 1]: ln is finite
    let u2 = rng.gen::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Standard deviation of a unit normal truncated at ±2.
const TRUNCATED_STD: f64 = 0.879_625_661_034_239_8;

/// The initial value of variable `node` with dtype `dtype` and shape `dims`; `constant` is the
/// value of the `constant` initializer.
pub fn initial_value(
    init: Initializer,
    dtype: DType,
    dims: &[usize],
    seed: i64,
    node: &str,
    constant: f64,
) -> Result<Tensor, String> {
    initial_value_with_stddev(init, dtype, dims, seed, node, constant, DEFAULT_STDDEV)
}

/// The default standard deviation of the `normal` initializer (Keras `RandomNormal`'s).
pub const DEFAULT_STDDEV: f64 = 0.05;

/// [`initial_value`] with the standard deviation of the `normal` initializer (GPT-2 and nanoGPT
/// draw their weights from N(0, 0.02²)).
pub fn initial_value_with_stddev(
    init: Initializer,
    dtype: DType,
    dims: &[usize],
    seed: i64,
    node: &str,
    constant: f64,
    stddev: f64,
) -> Result<Tensor, String> {
    enum Dist {
        Uniform(f64),
        Normal(f64),
        Truncated(f64),
    }
    let (fan_in, fan_out) = fans(dims);
    let dist = match init {
        Initializer::Zeros => return Tensor::zeros(dtype, dims).map_err(|e| e.to_string()),
        Initializer::Ones => return ones(dtype, dims),
        Initializer::Constant => return filled(dtype, dims, constant),
        Initializer::Uniform => Dist::Uniform(0.05),
        Initializer::Normal => Dist::Normal(stddev),
        Initializer::GlorotUniform => Dist::Uniform((6.0 / (fan_in + fan_out)).sqrt()),
        Initializer::GlorotNormal => {
            Dist::Truncated((2.0 / (fan_in + fan_out)).sqrt() / TRUNCATED_STD)
        }
        Initializer::HeUniform => Dist::Uniform((6.0 / fan_in).sqrt()),
        Initializer::HeNormal => Dist::Truncated((2.0 / fan_in).sqrt() / TRUNCATED_STD),
        Initializer::TfRandomNormal
        | Initializer::TfRandomUniform
        | Initializer::TfTruncatedNormal => {
            return Err(format!(
                "initializer `{init}` is drawn by tf_random_value (it needs seed2 and init_scale)"
            ))
        }
    };
    if !dtype.is_float() {
        return Err(format!(
            "initializer `{init}` needs a float dtype, but the variable is {dtype}"
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed as u64);
    rng.set_stream(fnv1a(node));
    let n: usize = dims.iter().product();
    let values: Vec<f64> = (0..n)
        .map(|_| match dist {
            // Zero-sized fans give NaN/∞ limits; a 0-sized variable draws nothing anyway.
            Dist::Uniform(l) => (rng.gen::<f64>() * 2.0 - 1.0) * l,
            Dist::Normal(s) => standard_normal(&mut rng) * s,
            Dist::Truncated(s) => loop {
                let z = standard_normal(&mut rng);
                if z.abs() <= 2.0 {
                    break z * s;
                }
            },
        })
        .collect();
    match dtype {
        DType::F64 => Tensor::from_slice(dims, &values).map_err(|e| e.to_string()),
        DType::F32 => new_tensor(dims, |o: &mut [f32]| {
            for (o, &v) in o.iter_mut().zip(&values) {
                *o = v as f32;
            }
        }),
        DType::BF16 => new_tensor(dims, |o: &mut [half::bf16]| {
            for (o, &v) in o.iter_mut().zip(&values) {
                *o = half::bf16::from_f64(v);
            }
        }),
        DType::F16 => new_tensor(dims, |o: &mut [half::f16]| {
            for (o, &v) in o.iter_mut().zip(&values) {
                *o = half::f16::from_f64(v);
            }
        }),
        d => Err(format!("initializer `{init}` needs a float dtype, got {d}")),
    }
}

/// The value of a `tf_*` initializer: TensorFlow's draw for (`seed`, `seed2`), then
/// `× scale + offset` in float32 (see the module docs). Only `f32` variables.
pub fn tf_random_value(
    init: Initializer,
    dtype: DType,
    dims: &[usize],
    (seed, seed2): (i64, i64),
    scale: f64,
    offset: f64,
) -> Result<Tensor, String> {
    if dtype != DType::F32 {
        return Err(format!(
            "initializer `{init}` reproduces TensorFlow's float32 draws, but the variable is {dtype}"
        ));
    }
    use crate::tf_random::{fill_standard_normal_f32, fill_truncated_normal_f32, fill_uniform_f32};
    let (seed, seed2) = (seed as u64, seed2 as u64);
    let mut drawn = Ok(());
    // The tensor first (its size checked), then TensorFlow's draw into it.
    let t = new_tensor(dims, |o: &mut [f32]| {
        match init {
            Initializer::TfRandomNormal => fill_standard_normal_f32(seed, seed2, o),
            Initializer::TfRandomUniform => fill_uniform_f32(seed, seed2, o),
            Initializer::TfTruncatedNormal => {
                if fill_truncated_normal_f32(seed, seed2, o).is_none() {
                    drawn = Err(
                        "TensorFlow's truncated normal ran out of its reserved samples".to_string(),
                    );
                }
            }
            other => drawn = Err(format!("initializer `{other}` is not a TensorFlow draw")),
        }
        let (scale, offset) = (scale as f32, offset as f32);
        for v in o.iter_mut() {
            *v = *v * scale + offset;
        }
    })?;
    drawn.map(|()| t)
}

/// A tensor with every element `value` (cast like `Cast`: truncated for ints, `value != 0` for bool).
fn filled(dtype: DType, dims: &[usize], value: f64) -> Result<Tensor, String> {
    match dtype {
        DType::F32 => new_tensor(dims, |o: &mut [f32]| o.fill(value as f32)),
        DType::F64 => new_tensor(dims, |o: &mut [f64]| o.fill(value)),
        DType::I32 => new_tensor(dims, |o: &mut [i32]| o.fill(value as i32)),
        DType::I64 => new_tensor(dims, |o: &mut [i64]| o.fill(value as i64)),
        DType::Bool => new_tensor(dims, |o: &mut [u8]| o.fill(u8::from(value != 0.0))),
        DType::BF16 => new_tensor(dims, |o: &mut [half::bf16]| {
            o.fill(half::bf16::from_f64(value))
        }),
        DType::F16 => new_tensor(dims, |o: &mut [half::f16]| {
            o.fill(half::f16::from_f64(value))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fans_follow_tensorflow() {
        assert_eq!(fans(&[]), (1.0, 1.0));
        assert_eq!(fans(&[7]), (7.0, 7.0));
        assert_eq!(fans(&[784, 128]), (784.0, 128.0));
        assert_eq!(fans(&[3, 3, 16, 32]), (144.0, 288.0));
    }

    #[test]
    fn names_parse_and_unknown_lists_choices() {
        for i in Initializer::ALL {
            assert_eq!(i.name().parse::<Initializer>(), Ok(i));
        }
        let e = "xavier".parse::<Initializer>().unwrap_err();
        assert!(e.contains("xavier") && e.contains("glorot_uniform"), "{e}");
    }

    #[test]
    fn truncated_normals_stay_within_two_sigma() {
        let t = initial_value(Initializer::HeNormal, DType::F64, &[100, 50], 3, "w", 0.0).unwrap();
        let s = (2.0f64 / 100.0).sqrt() / TRUNCATED_STD;
        let v = t.to_f64_vec();
        assert!(v.iter().all(|x| x.abs() <= 2.0 * s + 1e-12));
        let var = v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64;
        assert!((var / (2.0 / 100.0) - 1.0).abs() < 0.1, "{var}");
    }

    #[test]
    fn normal_draws_with_the_given_stddev() {
        let t = initial_value_with_stddev(
            Initializer::Normal,
            DType::F64,
            &[200, 100],
            1,
            "w",
            0.0,
            0.02,
        )
        .unwrap();
        let v = t.to_f64_vec();
        let var = v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64;
        assert!((var.sqrt() / 0.02 - 1.0).abs() < 0.02, "{}", var.sqrt());
        // The default is Keras's 0.05, and the draws are the same numbers scaled.
        let d = initial_value(Initializer::Normal, DType::F64, &[200, 100], 1, "w", 0.0).unwrap();
        let scaled = d.to_f64_vec()[0] * 0.02 / DEFAULT_STDDEV;
        assert!((scaled - v[0]).abs() < 1e-15);
    }

    #[test]
    fn random_init_of_ints_is_an_error() {
        let e = initial_value(Initializer::Uniform, DType::I32, &[2], 0, "w", 0.0).unwrap_err();
        assert!(e.contains("float") && e.contains("i32"), "{e}");
        let z = initial_value(Initializer::Ones, DType::I32, &[2], 0, "w", 0.0).unwrap();
        let c = initial_value(Initializer::Constant, DType::F32, &[3], 0, "w", 0.25).unwrap();
        assert_eq!(c.as_slice::<f32>().unwrap(), &[0.25; 3]);
        let c = initial_value(Initializer::Constant, DType::I64, &[2], 0, "w", -2.7).unwrap();
        assert_eq!(c.as_slice::<i64>().unwrap(), &[-2, -2]);
        assert_eq!(z.as_slice::<i32>().unwrap(), &[1, 1]);
    }
}
