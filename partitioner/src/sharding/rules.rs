//! Per-op sharding rules: the placement of an op's output from its inputs' placements, or an
//! error saying which input must be redistributed first (see [`super::transition`]). Each rule
//! is property-tested against the unsharded op: the op run on every rank's pieces, the outputs
//! combined by the rule's placement, equals the op on the whole tensors.

use super::Placement::{self, Partial, Replicate, Shard};

fn refuse(op: &str, what: String) -> Result<Placement, String> {
    Err(format!("{op}: {what}; redistribute an input first"))
}

/// `MatMul` of 2-D `a · b` (after the transposes): rows of `a` sharded give row shards, columns
/// of `b` give column shards, the contracted dimension sharded on both gives a partial sum.
pub fn matmul(
    a: Placement,
    b: Placement,
    transpose_a: bool,
    transpose_b: bool,
) -> Result<Placement, String> {
    // Placements on the logical [m, k] · [k, n].
    let logical = |p: Placement, t: bool| match p {
        Shard(d) if t => Shard(1 - d.min(1)),
        p => p,
    };
    match (logical(a, transpose_a), logical(b, transpose_b)) {
        (Replicate, Replicate) => Ok(Replicate),
        (Shard(0), Replicate) => Ok(Shard(0)),
        (Replicate, Shard(1)) => Ok(Shard(1)),
        (Shard(1), Shard(0)) => Ok(Partial),
        (Partial, Replicate) | (Replicate, Partial) => Ok(Partial),
        (a, b) => refuse("MatMul", format!("no rule for a {a} · b {b}")),
    }
}

/// `BatchMatMul` over leading batch dimensions: both inputs sharded along the same batch
/// dimension (attention's heads) stay sharded along it.
pub fn batch_matmul(a: Placement, b: Placement, rank: usize) -> Result<Placement, String> {
    match (a, b) {
        (Replicate, Replicate) => Ok(Replicate),
        (Shard(d), Shard(e)) if d == e && d + 2 < rank => Ok(Shard(d)),
        (a, b) => refuse(
            "BatchMatMul",
            format!("no rule for {a} × {b} (shard both along one batch dimension)"),
        ),
    }
}

/// Element-wise ops with NumPy broadcasting (`Add`, `Sub`, `Mul`, `BiasAdd`, unary ops):
/// `inputs` are (placement, rank) and the output has rank `out_rank`. Shards must agree on one
/// output dimension; a replicated input may join them only if it does not span that dimension
/// (a bias); partial sums stay partial under `Add`/`Sub` of partials and `Mul` by a replicated
/// factor.
pub fn elementwise(
    op: &str,
    inputs: &[(Placement, usize)],
    out_rank: usize,
) -> Result<Placement, String> {
    let aligned = |p: Placement, rank: usize| match p {
        Shard(d) => Shard(d + out_rank - rank),
        p => p,
    };
    let places: Vec<Placement> = inputs.iter().map(|&(p, r)| aligned(p, r)).collect();
    let shard = places.iter().find_map(|p| match p {
        Shard(d) => Some(*d),
        _ => None,
    });
    let partials = places.iter().filter(|p| **p == Partial).count();
    if let Some(d) = shard {
        for (&(p, rank), q) in inputs.iter().zip(&places) {
            match q {
                Shard(e) if *e == d => {}
                Replicate if d + rank < out_rank => {}
                _ => {
                    return refuse(
                        op,
                        format!(
                            "an input {p} of rank {rank} does not fit Shard({d}) of the output"
                        ),
                    )
                }
            }
        }
        return Ok(Shard(d));
    }
    match (partials, op) {
        (0, _) => Ok(Replicate),
        (n, "Add" | "Sub" | "AddN" | "BiasAdd") if n == places.len() => Ok(Partial),
        (1, "Mul" | "Neg") => Ok(Partial),
        _ => refuse(op, "a partial sum mixed with other inputs".into()),
    }
}

/// Where [`elementwise`] refuses `inputs` (placement, rank) but one of them is sharded, the
/// placement each input is redistributed to so that it accepts them: sharded along the first
/// shard's output dimension (`Shard(i) → Shard(j)` an all-to-all, `Partial → Shard` a
/// reduce-scatter, `Replicate → Shard` a local slice), or `Replicate` for an input that does
/// not span that dimension (a bias). `None` when no input is sharded.
pub fn elementwise_targets(
    inputs: &[(Placement, usize)],
    out_rank: usize,
) -> Option<Vec<Placement>> {
    let d = inputs.iter().find_map(|&(p, rank)| match p {
        Shard(d) => Some(d + out_rank.checked_sub(rank)?),
        _ => None,
    })?;
    Some(
        inputs
            .iter()
            .map(|&(_, rank)| match (d + rank).checked_sub(out_rank) {
                Some(own) => Shard(own),
                None => Replicate,
            })
            .collect(),
    )
}

/// A reduction (`Sum`, `Mean`, `Max`) over `axes` of a tensor of `rank` dimensions.
pub fn reduce(
    op: &str,
    input: Placement,
    rank: usize,
    axes: &[usize],
    keep_dims: bool,
) -> Result<Placement, String> {
    let all: Vec<usize> = if axes.is_empty() {
        (0..rank).collect()
    } else {
        axes.to_vec()
    };
    match input {
        Replicate => Ok(Replicate),
        Partial if matches!(op, "Sum" | "Mean") => Ok(Partial),
        Shard(d) if all.contains(&d) && op == "Sum" => Ok(Partial),
        Shard(d) if !all.contains(&d) => Ok(Shard(if keep_dims {
            d
        } else {
            d - all.iter().filter(|&&a| a < d).count()
        })),
        p => refuse(op, format!("{p} reduced over {all:?}")),
    }
}

/// Ops normalising the last axis (`Softmax`, `LayerNorm`'s input): any other axis may be
/// sharded.
pub fn last_axis(op: &str, input: Placement, rank: usize) -> Result<Placement, String> {
    match input {
        Replicate => Ok(Replicate),
        Shard(d) if d + 1 < rank => Ok(Shard(d)),
        p => refuse(op, format!("{p} across the normalised last axis")),
    }
}

/// An embedding lookup `Gather(table [V, C], ids)`: a vocabulary-sharded table gives a partial
/// sum (each rank looks up the ids in its range, zeros elsewhere); a channel-sharded table
/// shards the output's last dimension.
pub fn gather(table: Placement, ids: Placement, ids_rank: usize) -> Result<Placement, String> {
    match (table, ids) {
        (Replicate, Replicate) => Ok(Replicate),
        (Shard(0), Replicate) => Ok(Partial),
        (Shard(1), Replicate) => Ok(Shard(ids_rank)),
        (Replicate, Shard(d)) => Ok(Shard(d)),
        (t, i) => refuse("Gather", format!("table {t} with ids {i}")),
    }
}

/// Sparse softmax cross-entropy of `logits [N, V]` against labels `[N]`: vocabulary-sharded
/// logits give the whole per-row loss (replicated) through three all-reduces of `[N]` (the
/// maximum, `Σ exp`, the target's logit) — the vocabulary-parallel loss; row-sharded logits
/// and labels give row-sharded losses.
pub fn cross_entropy(logits: Placement, labels: Placement) -> Result<Placement, String> {
    match (logits, labels) {
        (Replicate, Replicate) => Ok(Replicate),
        (Shard(1), Replicate) => Ok(Replicate),
        (Shard(0), Shard(0)) => Ok(Shard(0)),
        (l, t) => refuse(
            "SparseSoftmaxCrossEntropyWithLogits",
            format!("logits {l} with labels {t}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::axis_split::AxisSplit;
    use dflow_graph::ops::testing::run_kernel;
    use dflow_graph::{AttrValue, Tensor};
    use proptest::prelude::*;

    fn tensor(dims: &[usize], seed: u64) -> Tensor {
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let x = (i as u64 + 1)
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(seed);
                ((x >> 33) % 2000) as f32 / 1000.0 - 1.0
            })
            .collect();
        Tensor::from_slice(dims, &v).unwrap()
    }

    /// Rank `r`'s piece of `t` placed `p` over `n` ranks.
    fn piece(t: &Tensor, p: Placement, r: usize, n: usize) -> Tensor {
        match p {
            Replicate => t.clone(),
            Shard(axis) => AxisSplit {
                axis,
                blocks: 1,
                parts: n,
                padded: t.dims()[axis],
            }
            .shard(t, r)
            .unwrap(),
            Partial => {
                // Terms: rank r's noise, the last rank's the rest.
                let noise = tensor(t.dims(), r as u64 + 99);
                if r + 1 < n {
                    noise
                } else {
                    let mut rest = t.as_slice::<f32>().unwrap().to_vec();
                    for k in 0..n - 1 {
                        let nk = tensor(t.dims(), k as u64 + 99);
                        for (x, y) in rest.iter_mut().zip(nk.as_slice::<f32>().unwrap()) {
                            *x -= y;
                        }
                    }
                    Tensor::from_slice(t.dims(), &rest).unwrap()
                }
            }
        }
    }

    /// The ranks' outputs combined as `p` says.
    fn combine(outs: &[Tensor], p: Placement, whole: &[usize]) -> Vec<f32> {
        match p {
            Replicate => outs[0].as_slice::<f32>().unwrap().to_vec(),
            Shard(axis) => AxisSplit {
                axis,
                blocks: 1,
                parts: outs.len(),
                padded: whole[axis],
            }
            .assemble(outs, whole)
            .unwrap()
            .as_slice::<f32>()
            .unwrap()
            .to_vec(),
            Partial => {
                let mut sum = vec![0.0f32; outs[0].num_elements()];
                for o in outs {
                    for (s, x) in sum.iter_mut().zip(o.as_slice::<f32>().unwrap()) {
                        *s += x;
                    }
                }
                sum
            }
        }
    }

    /// Runs `op` whole and on every rank's pieces; asserts the rule's combination equals it.
    fn check(
        op: &str,
        attrs: &[(&str, AttrValue)],
        inputs: &[(Tensor, Placement)],
        out: Placement,
        n: usize,
    ) {
        let whole: Vec<Tensor> = inputs.iter().map(|(t, _)| t.clone()).collect();
        let want = run_kernel(op, attrs, &whole).unwrap().remove(0);
        let outs: Vec<Tensor> = (0..n)
            .map(|r| {
                let parts: Vec<Tensor> = inputs.iter().map(|(t, p)| piece(t, *p, r, n)).collect();
                run_kernel(op, attrs, &parts).unwrap().remove(0)
            })
            .collect();
        let got = combine(&outs, out, want.dims());
        for (i, (a, b)) in got.iter().zip(want.as_slice::<f32>().unwrap()).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                "{op} [{i}]: {a} vs {b}"
            );
        }
    }

    fn placements() -> impl Strategy<Value = Placement> {
        prop_oneof![
            Just(Replicate),
            Just(Partial),
            Just(Shard(0)),
            Just(Shard(1))
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn matmul_rule_equals_the_unsharded_product(
            n in 1usize..4, m in 1usize..4, k in 1usize..4, c in 1usize..4,
            a in placements(), b in placements(), ta: bool, tb: bool,
        ) {
            let (m, k, c) = (m * n, k * n, c * n);
            let Ok(out) = matmul(a, b, ta, tb) else { return Ok(()) };
            let x = tensor(&if ta { [k, m] } else { [m, k] }, 1);
            let w = tensor(&if tb { [c, k] } else { [k, c] }, 2);
            check("MatMul", &[("transpose_a", AttrValue::Bool(ta)), ("transpose_b", AttrValue::Bool(tb))],
                &[(x, a), (w, b)], out, n);
        }

        #[test]
        fn elementwise_rules_equal_the_unsharded_op(
            n in 1usize..4, r in 1usize..4, c in 1usize..4,
            a in placements(), b in placements(), op in prop_oneof![Just("Add"), Just("Mul"), Just("BiasAdd")],
        ) {
            let (rows, cols) = (r * n, c * n);
            // BiasAdd's bias is a vector along the last axis.
            let (bdims, brank) = if op == "BiasAdd" { (vec![cols], 1) } else { (vec![rows, cols], 2) };
            if brank == 1 && b == Shard(1) { return Ok(()) }
            let b = if brank == 1 { match b { Shard(_) => Shard(0), p => p } } else { b };
            let Ok(out) = elementwise(op, &[(a, 2), (b, brank)], 2) else { return Ok(()) };
            check(op, &[], &[(tensor(&[rows, cols], 3), a), (tensor(&bdims, 4), b)], out, n);
        }

        /// Where the element-wise rule refuses, its inputs redistributed to the targets are
        /// taken, and the result equals the unsharded op.
        #[test]
        fn elementwise_targets_are_taken_and_equal_the_unsharded_op(
            n in 2usize..4, r in 1usize..4, c in 1usize..4,
            a in placements(), b in placements(), bias: bool,
            op in prop_oneof![Just("Add"), Just("Mul")],
        ) {
            let (rows, cols) = (r * n, c * n);
            // b: a [rows, cols] tensor, or a bias [cols] (its Shard(1) is none).
            let (bdims, brank) = if bias { (vec![cols], 1) } else { (vec![rows, cols], 2) };
            let b = if brank == 1 { match b { Shard(_) => Shard(0), p => p } } else { b };
            let inputs = [(a, 2), (b, brank)];
            if elementwise(op, &inputs, 2).is_ok() { return Ok(()) }
            let Some(to) = elementwise_targets(&inputs, 2) else {
                // No shard among the inputs: the rewrite makes them whole instead.
                prop_assert!(!matches!(a, Shard(_)) && !matches!(b, Shard(_)));
                return Ok(())
            };
            let out = elementwise(op, &[(to[0], 2), (to[1], brank)], 2);
            prop_assert!(out.is_ok(), "{:?} refused for {:?} {:?}", to, a, b);
            let out = out.unwrap();
            prop_assert!(matches!(out, Shard(_)));
            check(op, &[], &[(tensor(&[rows, cols], 3), to[0]), (tensor(&bdims, 4), to[1])], out, n);
        }

        #[test]
        fn reduce_rule_equals_the_unsharded_sum(
            n in 1usize..4, r in 1usize..4, c in 1usize..4, a in placements(),
            axis in 0usize..2, keep: bool,
        ) {
            let Ok(out) = reduce("Sum", a, 2, &[axis], keep) else { return Ok(()) };
            check("Sum", &[("axes", AttrValue::IntList(vec![axis as i64])), ("keep_dims", AttrValue::Bool(keep))],
                &[(tensor(&[r * n, c * n], 5), a)], out, n);
        }

        #[test]
        fn softmax_and_layer_norm_rules_equal_the_unsharded_ops(
            n in 1usize..4, r in 1usize..4, c in 1usize..5, a in placements(),
        ) {
            let x = tensor(&[r * n, c], 6);
            if let Ok(out) = last_axis("Softmax", a, 2) {
                check("Softmax", &[], &[(x.clone(), a)], out, n);
            }
            if let Ok(out) = last_axis("LayerNorm", a, 2) {
                let gamma = tensor(&[c], 7);
                let beta = tensor(&[c], 8);
                check("LayerNorm", &[("epsilon", AttrValue::Float(1e-5))],
                    &[(x, a), (gamma, Replicate), (beta, Replicate)], out, n);
            }
        }

        /// The vocabulary-sharded lookup: each rank's masked lookup of its rows, summed.
        #[test]
        fn a_vocabulary_sharded_lookup_sums_to_the_whole_lookup(
            n in 1usize..4, v in 1usize..4, c in 1usize..4, ids in proptest::collection::vec(0usize..100, 1..6),
        ) {
            let v = v * n;
            let table = tensor(&[v, c], 9);
            let ids: Vec<i64> = ids.iter().map(|i| (i % v) as i64).collect();
            let id_t = Tensor::from_slice(&[ids.len()], &ids).unwrap();
            let want = run_kernel("Gather", &[], &[table.clone(), id_t]).unwrap().remove(0);
            prop_assert_eq!(gather(Shard(0), Replicate, 1), Ok(Partial));
            let rows = v / n;
            let outs: Vec<Tensor> = (0..n).map(|r| {
                let shard = piece(&table, Shard(0), r, n);
                let s = shard.as_slice::<f32>().unwrap();
                let mut out = vec![0.0f32; ids.len() * c];
                for (i, &id) in ids.iter().enumerate() {
                    let local = id as usize;
                    if (r * rows..(r + 1) * rows).contains(&local) {
                        out[i * c..(i + 1) * c].copy_from_slice(&s[(local - r * rows) * c..(local - r * rows + 1) * c]);
                    }
                }
                Tensor::from_slice(&[ids.len(), c], &out).unwrap()
            }).collect();
            prop_assert_eq!(combine(&outs, Partial, want.dims()), want.as_slice::<f32>().unwrap().to_vec());
        }

        /// The vocabulary-parallel loss from each rank's logits: global max, Σ exp and the
        /// target's logit summed over ranks.
        #[test]
        fn the_vocabulary_parallel_loss_equals_the_whole_cross_entropy(
            n in 1usize..4, rows in 1usize..5, v in 1usize..4, seed in 0u64..1000,
        ) {
            let v = v * n;
            let logits = tensor(&[rows, v], seed);
            let labels: Vec<i64> = (0..rows).map(|i| ((i as u64 * 7 + seed) % v as u64) as i64).collect();
            let want = run_kernel("SparseSoftmaxCrossEntropyWithLogits", &[],
                &[logits.clone(), Tensor::from_slice(&[rows], &labels).unwrap()]).unwrap().remove(0);
            prop_assert_eq!(cross_entropy(Shard(1), Replicate), Ok(Replicate));
            let pieces: Vec<Vec<f32>> = (0..n).map(|r| piece(&logits, Shard(1), r, n).as_slice::<f32>().unwrap().to_vec()).collect();
            let w = v / n;
            for (i, &t) in labels.iter().enumerate() {
                let max = pieces.iter().flat_map(|p| p[i * w..(i + 1) * w].iter().copied()).fold(f32::MIN, f32::max);
                let sum: f32 = pieces.iter().map(|p| p[i * w..(i + 1) * w].iter().map(|z| (z - max).exp()).sum::<f32>()).sum();
                let target: f32 = pieces.iter().enumerate().map(|(r, p)| {
                    let t = t as usize;
                    if (r * w..(r + 1) * w).contains(&t) { p[i * w + t - r * w] - max } else { 0.0 }
                }).sum();
                let loss = sum.ln() - target;
                let whole = want.as_slice::<f32>().unwrap()[i];
                prop_assert!((loss - whole).abs() <= 1e-5 * whole.abs().max(1.0), "{} vs {}", loss, whole);
            }
        }
    }

    #[test]
    fn rules_refuse_what_needs_a_collective_first() {
        assert!(matmul(Shard(1), Replicate, false, false)
            .unwrap_err()
            .contains("redistribute"));
        // Megatron: column-parallel (weight [out, in] sharded on out, transposed) then
        // row-parallel (sharded on in) gives a partial sum.
        assert_eq!(matmul(Replicate, Shard(0), false, true), Ok(Shard(1)));
        assert_eq!(matmul(Shard(1), Shard(1), false, true), Ok(Partial));
        assert!(last_axis("Softmax", Shard(1), 2).is_err());
        assert!(reduce("Max", Shard(0), 2, &[0], false).is_err());
        assert_eq!(batch_matmul(Shard(1), Shard(1), 4), Ok(Shard(1)));
        assert!(batch_matmul(Shard(3), Shard(3), 4).is_err());
        assert!(cross_entropy(Partial, Replicate).is_err());
    }
}
