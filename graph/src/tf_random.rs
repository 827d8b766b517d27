//! TensorFlow's CPU random streams, reproduced: the values of `RandomStandardNormal`,
//! `RandomUniform` and `TruncatedNormal` (float32) for given `seed`/`seed2` attributes, so that a
//! variable initialized by a seeded TensorFlow initializer starts, after import, from exactly
//! the values TensorFlow drew ([`crate::tf_import`]).
//!
//! TensorFlow draws with Philox4x32-10 keyed by `seed` and started at counter `(0, 0, seed2)`
//! (`GuardedPhiloxRandom`, a fresh op's first run). Fixed-count distributions (normal, uniform)
//! make one group of 4 values per Philox block; the truncated normal, which rejects samples,
//! starts group `i` at block `256 * i` (`FillPhiloxRandomTask` with variable samples per
//! output). Normal values come from TensorFlow's `BoxMullerFloat`; uniform ones from
//! `Uint32ToFloat` (a float in [1, 2) from the 23 low bits, minus 1).

/// TensorFlow's `PhiloxRandom` (Philox4x32 with 10 rounds).
#[derive(Clone, Debug)]
struct Philox {
    counter: [u32; 4],
    key: [u32; 2],
}

const W32A: u32 = 0x9E37_79B9;
const W32B: u32 = 0xBB67_AE85;
const M4X32A: u32 = 0xD251_1F53;
const M4X32B: u32 = 0xCD9E_8D57;

impl Philox {
    /// `PhiloxRandom(seed_lo = seed, seed_hi = seed2)`.
    fn new(seed: u64, seed2: u64) -> Self {
        Philox {
            counter: [0, 0, seed2 as u32, (seed2 >> 32) as u32],
            key: [seed as u32, (seed >> 32) as u32],
        }
    }

    /// The next block of four 32-bit values.
    fn next_block(&mut self) -> [u32; 4] {
        let mut c = self.counter;
        let mut k = self.key;
        for _ in 0..10 {
            let p0 = u64::from(M4X32A) * u64::from(c[0]);
            let p1 = u64::from(M4X32B) * u64::from(c[2]);
            c = [
                (p1 >> 32) as u32 ^ c[1] ^ k[0],
                p1 as u32,
                (p0 >> 32) as u32 ^ c[3] ^ k[1],
                p0 as u32,
            ];
            k = [k[0].wrapping_add(W32A), k[1].wrapping_add(W32B)];
        }
        self.skip(1);
        c
    }

    /// Advances the 128-bit counter by `n` blocks.
    fn skip(&mut self, n: u64) {
        let lo = n as u32;
        let mut hi = (n >> 32) as u32;
        self.counter[0] = self.counter[0].wrapping_add(lo);
        if self.counter[0] < lo {
            hi = hi.wrapping_add(1);
        }
        self.counter[1] = self.counter[1].wrapping_add(hi);
        if self.counter[1] < hi {
            self.counter[2] = self.counter[2].wrapping_add(1);
            if self.counter[2] == 0 {
                self.counter[3] = self.counter[3].wrapping_add(1);
            }
        }
    }
}

/// TensorFlow's `Uint32ToFloat`: a float in [0, 1) from the low 23 bits.
fn uint32_to_float(x: u32) -> f32 {
    f32::from_bits((127 << 23) | (x & 0x7f_ffff)) - 1.0
}

/// TensorFlow's `BoxMullerFloat`: two standard normal values from two 32-bit values.
fn box_muller(x0: u32, x1: u32) -> [f32; 2] {
    let u1 = uint32_to_float(x0).max(1.0e-7);
    // `2.0f * M_PI * Uint32ToFloat(x1)` is computed in double (M_PI is a double).
    let v1 = (2.0 * std::f64::consts::PI * f64::from(uint32_to_float(x1))) as f32;
    let u2 = (-2.0f32 * u1.ln()).sqrt();
    [v1.sin() * u2, v1.cos() * u2]
}

/// Fills `out` with the values of a float32 `RandomStandardNormal` with attributes `seed`,
/// `seed2`.
pub fn fill_standard_normal_f32(seed: u64, seed2: u64, out: &mut [f32]) {
    let mut gen = Philox::new(seed, seed2);
    for group in out.chunks_mut(4) {
        let b = gen.next_block();
        let values = box_muller(b[0], b[1])
            .into_iter()
            .chain(box_muller(b[2], b[3]));
        for (o, v) in group.iter_mut().zip(values) {
            *o = v;
        }
    }
}

/// Fills `out` with the values of a float32 `RandomUniform` (in [0, 1)) with attributes
/// `seed`, `seed2`.
pub fn fill_uniform_f32(seed: u64, seed2: u64, out: &mut [f32]) {
    let mut gen = Philox::new(seed, seed2);
    for group in out.chunks_mut(4) {
        for (o, x) in group.iter_mut().zip(gen.next_block()) {
            *o = uint32_to_float(x);
        }
    }
}

/// Blocks TensorFlow reserves for each group of 4 truncated-normal values.
const TRUNCATED_BLOCKS_PER_GROUP: u64 = 256;

/// Fills `out` with the values of a float32 `TruncatedNormal` (standard normal values with
/// |v| < 2; others redrawn) with attributes `seed`, `seed2`. `None` if a group would need more
/// than the blocks TensorFlow reserves for it (TensorFlow then reads into the next group's; the
/// chance is below 10^-300).
pub fn fill_truncated_normal_f32(seed: u64, seed2: u64, out: &mut [f32]) -> Option<()> {
    let base = Philox::new(seed, seed2);
    for (group, values) in out.chunks_mut(4).enumerate() {
        let mut gen = base.clone();
        gen.skip(group as u64 * TRUNCATED_BLOCKS_PER_GROUP);
        let mut got = 0;
        // One sample pair takes half a block; the group may use its reserved blocks.
        let mut pending: Vec<u32> = Vec::with_capacity(4);
        let mut blocks = 0;
        while got < 4 {
            if pending.len() < 2 {
                if blocks == TRUNCATED_BLOCKS_PER_GROUP {
                    return None;
                }
                blocks += 1;
                let b = gen.next_block();
                pending.extend(b.iter().rev());
            }
            let (x0, x1) = (pending.pop()?, pending.pop()?);
            for v in box_muller(x0, x1) {
                if v.abs() < 2.0 && got < 4 {
                    if let Some(o) = values.get_mut(got) {
                        *o = v;
                    }
                    got += 1;
                }
            }
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn standard_normal_f32(seed: u64, seed2: u64, n: usize) -> Vec<f32> {
        let mut v = vec![0.0; n];
        fill_standard_normal_f32(seed, seed2, &mut v);
        v
    }

    fn uniform_f32(seed: u64, seed2: u64, n: usize) -> Vec<f32> {
        let mut v = vec![0.0; n];
        fill_uniform_f32(seed, seed2, &mut v);
        v
    }

    fn truncated_normal_f32(seed: u64, seed2: u64, n: usize) -> Option<Vec<f32>> {
        let mut v = vec![0.0; n];
        fill_truncated_normal_f32(seed, seed2, &mut v)?;
        Some(v)
    }

    fn close(got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!(
                (f64::from(*g) - w).abs() < 1e-6,
                "{got:?}\nTensorFlow: {want:?}"
            );
        }
    }

    // References: TensorFlow 2.21, `tf.raw_ops.<Op>(shape=[10], dtype=tf.float32,
    // seed=87654321, seed2=7)` (10 values: two full groups and a partial one).

    #[test]
    fn standard_normal_matches_tensorflow() {
        close(
            &standard_normal_f32(87654321, 7, 10),
            &[
                -0.046945683658123016,
                -1.2039023637771606,
                1.1668351888656616,
                1.1706204414367676,
                -0.3200702369213104,
                -0.19035114347934723,
                -1.4242879152297974,
                0.9578679203987122,
                -0.22877390682697296,
                -0.6875477433204651,
            ],
        );
    }

    #[test]
    fn uniform_matches_tensorflow() {
        close(
            &uniform_f32(87654321, 7, 10),
            &[
                0.4839409589767456,
                0.5062030553817749,
                0.25514376163482666,
                0.12474226951599121,
                0.9330101013183594,
                0.6646093130111694,
                0.22922444343566895,
                0.8442271947860718,
                0.7691035270690918,
                0.5511230230331421,
            ],
        );
    }

    #[test]
    fn truncated_normal_matches_tensorflow() {
        close(
            &truncated_normal_f32(87654321, 7, 10).unwrap(),
            &[
                -0.046945683658123016,
                -1.2039023637771606,
                1.1668351888656616,
                1.1706204414367676,
                0.7166261076927185,
                0.5711334943771362,
                -0.9265397787094116,
                -0.10458973050117493,
                -1.1940083503723145,
                -1.1085455417633057,
            ],
        );
        // TensorFlow 2.21: TruncatedNormal(shape=[3000], seed=5, seed2=9) at 0, 1, 4, 5, 2999.
        let v = truncated_normal_f32(5, 9, 3000).unwrap();
        close(
            &[v[0], v[1], v[4], v[5], v[2999]],
            &[
                0.5352789759635925,
                0.13203659653663635,
                0.2581433355808258,
                0.34821030497550964,
                0.3381316065788269,
            ],
        );
        assert!(v.iter().all(|x| x.abs() < 2.0));
    }

    #[test]
    fn counter_skips_carry() {
        let mut g = Philox::new(1, 2);
        g.counter = [u32::MAX, u32::MAX, u32::MAX, 0];
        g.skip(1);
        assert_eq!(g.counter, [0, 0, 0, 1]);
        g.skip(1 << 32);
        assert_eq!(g.counter, [0, 1, 0, 1]);
    }
}
