//! Non-negative least squares for the runtime costs `dflow bench calibrate` measures: given
//! `m` observations `tᵢ ≈ fixedᵢ + Σⱼ aᵢⱼ·xⱼ` (a job's counts `aᵢ` of `n` kinds of work, the part
//! of its step already priced `fixedᵢ` and its measured step `tᵢ`), the costs `x ≥ 0` that
//! minimise the **relative** squared error `Σᵢ ((fixedᵢ + aᵢ·x − tᵢ) / tᵢ)²` (a 200 µs job and a
//! 50 ms one weigh alike, as "within 25%" does).
//!
//! The design is checked first: fewer observations than unknowns, an unknown no observation
//! exercises (a zero column) and an unknown the others explain (a column that is a combination
//! of the columns before it) are errors naming the unknown, not a silently arbitrary answer.
//! The solve is Lawson and Hanson's active-set NNLS ("Solving Least Squares Problems", 1974,
//! ch. 23) on columns scaled to unit norm, each inner least-squares problem solved by its
//! normal equations (at most a handful of unknowns).

/// Why costs cannot be fitted to the observations.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    /// Fewer observations than unknowns.
    #[error(
        "{observations} calibration jobs for {unknowns} unknown costs: at least as many jobs as \
         costs are needed"
    )]
    TooFew {
        /// Observations given.
        observations: usize,
        /// Unknowns to fit.
        unknowns: usize,
    },
    /// No observation exercises an unknown (its column is 0).
    #[error("no calibration job does any `{unknown}` work: that cost cannot be measured")]
    Unmeasured {
        /// The unknown's name.
        unknown: String,
    },
    /// An unknown's column is (nearly) a combination of the others': its cost cannot be told
    /// apart from theirs.
    #[error(
        "the calibration jobs' `{unknown}` counts are a combination of the other costs' counts: \
         that cost cannot be told apart (add a job that varies it alone)"
    )]
    Collinear {
        /// The unknown's name.
        unknown: String,
    },
    /// An observation is not a finite positive time, or a count is not finite.
    #[error("calibration job {index} ({name}): {what}")]
    Invalid {
        /// Index of the observation.
        index: usize,
        /// Its name.
        name: String,
        /// What is wrong.
        what: String,
    },
    /// The rows' lengths differ from the number of unknowns.
    #[error("calibration job {index} has {got} counts for {unknowns} unknowns")]
    Shape {
        /// Index of the observation.
        index: usize,
        /// Counts it has.
        got: usize,
        /// Unknowns.
        unknowns: usize,
    },
}

/// One measured job: its counts of each kind of work, the seconds of it already priced, and
/// the seconds measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// A name for errors and reports.
    pub name: String,
    /// Count of each unknown's work (one per unknown).
    pub counts: Vec<f64>,
    /// Seconds of the step not depending on the unknowns (bytes over a link's β).
    pub fixed: f64,
    /// The measured step in seconds.
    pub seconds: f64,
}

/// The fitted costs and how well they explain each observation.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// One cost per unknown, each ≥ 0.
    pub costs: Vec<f64>,
    /// Per observation: (predicted − measured) / measured.
    pub relative_errors: Vec<f64>,
}

/// Below this (relative to a column's norm) what is left of a column once the columns before
/// it are projected out, the column is taken to be their combination.
const COLLINEAR: f64 = 1e-6;

/// Checks that `names.len()` unknowns can be fitted to `obs`.
pub fn check_design(obs: &[Observation], names: &[&str]) -> Result<(), FitError> {
    let n = names.len();
    if obs.len() < n {
        return Err(FitError::TooFew {
            observations: obs.len(),
            unknowns: n,
        });
    }
    for (index, o) in obs.iter().enumerate() {
        let invalid = |what: String| FitError::Invalid {
            index,
            name: o.name.clone(),
            what,
        };
        if o.counts.len() != n {
            return Err(FitError::Shape {
                index,
                got: o.counts.len(),
                unknowns: n,
            });
        }
        if !(o.seconds.is_finite() && o.seconds > 0.0) {
            return Err(invalid(format!(
                "measured step {} s is not a positive time",
                o.seconds
            )));
        }
        if !o.fixed.is_finite() || o.counts.iter().any(|c| !c.is_finite() || *c < 0.0) {
            return Err(invalid("a count is negative or not finite".into()));
        }
    }
    // Modified Gram–Schmidt over the weighted, unit-norm columns, in order.
    let columns = weighted_columns(obs, n);
    let mut basis: Vec<Vec<f64>> = Vec::new();
    for (j, col) in columns.iter().enumerate() {
        let norm = dot(col, col).sqrt();
        if norm == 0.0 {
            return Err(FitError::Unmeasured {
                unknown: names[j].to_string(),
            });
        }
        let mut v: Vec<f64> = col.iter().map(|x| x / norm).collect();
        for q in &basis {
            let p = dot(&v, q);
            v.iter_mut().zip(q).for_each(|(x, y)| *x -= p * y);
        }
        let left = dot(&v, &v).sqrt();
        if left < COLLINEAR {
            return Err(FitError::Collinear {
                unknown: names[j].to_string(),
            });
        }
        v.iter_mut().for_each(|x| *x /= left);
        basis.push(v);
    }
    Ok(())
}

/// Fits `names.len()` non-negative costs to `obs` (relative errors; see the module).
pub fn fit(obs: &[Observation], names: &[&str]) -> Result<Fit, FitError> {
    check_design(obs, names)?;
    let n = names.len();
    let mut columns = weighted_columns(obs, n);
    let scale: Vec<f64> = columns.iter().map(|c| dot(c, c).sqrt()).collect();
    for (c, s) in columns.iter_mut().zip(&scale) {
        c.iter_mut().for_each(|x| *x /= s);
    }
    let target: Vec<f64> = obs
        .iter()
        .map(|o| (o.seconds - o.fixed) / o.seconds)
        .collect();
    let scaled = nnls(&columns, &target);
    let costs: Vec<f64> = scaled.iter().zip(&scale).map(|(x, s)| x / s).collect();
    let relative_errors = obs
        .iter()
        .map(|o| {
            let predicted = o.fixed + o.counts.iter().zip(&costs).map(|(a, x)| a * x).sum::<f64>();
            (predicted - o.seconds) / o.seconds
        })
        .collect();
    Ok(Fit {
        costs,
        relative_errors,
    })
}

/// Column `j` of the design, each row divided by its measured seconds.
fn weighted_columns(obs: &[Observation], n: usize) -> Vec<Vec<f64>> {
    (0..n)
        .map(|j| obs.iter().map(|o| o.counts[j] / o.seconds).collect())
        .collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `x ≥ 0` minimising `‖A·x − b‖` for `A` given by its columns (Lawson–Hanson), the columns
/// linearly independent (checked by [`check_design`]).
fn nnls(columns: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let n = columns.len();
    let mut x = vec![0.0; n];
    let mut passive = vec![false; n];
    let gradient = |x: &[f64]| -> Vec<f64> {
        let r: Vec<f64> = (0..b.len())
            .map(|i| b[i] - (0..n).map(|j| columns[j][i] * x[j]).sum::<f64>())
            .collect();
        columns.iter().map(|c| dot(c, &r)).collect()
    };
    let tol = 1e-12;
    // Each outer round frees one unknown; 3n rounds bound the loop (the usual limit).
    for _ in 0..3 * n.max(1) {
        let w = gradient(&x);
        let Some(j) = (0..n)
            .filter(|&j| !passive[j] && w[j] > tol)
            .max_by(|&a, &c| w[a].total_cmp(&w[c]))
        else {
            break;
        };
        passive[j] = true;
        for _ in 0..3 * n.max(1) {
            let s = least_squares_on(columns, b, &passive);
            if (0..n).all(|k| !passive[k] || s[k] > 0.0) {
                x = s;
                break;
            }
            // Step from x towards s as far as x stays non-negative; drop what reaches 0.
            let alpha = (0..n)
                .filter(|&k| passive[k] && s[k] <= 0.0)
                .map(|k| x[k] / (x[k] - s[k]))
                .fold(f64::INFINITY, f64::min);
            for k in 0..n {
                x[k] += alpha * (s[k] - x[k]);
                if passive[k] && x[k] <= tol {
                    passive[k] = false;
                    x[k] = 0.0;
                }
            }
        }
    }
    x
}

/// The unconstrained least-squares solution over the `passive` columns (0 elsewhere), by the
/// normal equations and Gaussian elimination with partial pivoting.
fn least_squares_on(columns: &[Vec<f64>], b: &[f64], passive: &[bool]) -> Vec<f64> {
    let idx: Vec<usize> = (0..columns.len()).filter(|&j| passive[j]).collect();
    let k = idx.len();
    let mut m: Vec<Vec<f64>> = idx
        .iter()
        .map(|&r| {
            let mut row: Vec<f64> = idx.iter().map(|&c| dot(&columns[r], &columns[c])).collect();
            row.push(dot(&columns[r], b));
            row
        })
        .collect();
    for c in 0..k {
        let p = (c..k)
            .max_by(|&a, &d| m[a][c].abs().total_cmp(&m[d][c].abs()))
            .unwrap_or(c);
        m.swap(c, p);
        let pivot = m[c][c];
        if pivot.abs() < 1e-300 {
            continue;
        }
        let pivot_row = m[c].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != c {
                let f = row[c] / pivot;
                row.iter_mut()
                    .zip(&pivot_row)
                    .skip(c)
                    .for_each(|(x, y)| *x -= f * y);
            }
        }
    }
    let mut s = vec![0.0; columns.len()];
    for (c, &j) in idx.iter().enumerate() {
        s[j] = if m[c][c] != 0.0 {
            m[c][k] / m[c][c]
        } else {
            0.0
        };
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: [&str; 3] = ["step", "op", "call"];

    fn observation(counts: [f64; 3], truth: [f64; 3], fixed: f64) -> Observation {
        Observation {
            name: format!("{counts:?}"),
            counts: counts.to_vec(),
            fixed,
            seconds: fixed + counts.iter().zip(truth).map(|(a, x)| a * x).sum::<f64>(),
        }
    }

    #[test]
    fn recovers_the_costs_that_made_the_steps() {
        let truth = [150e-6, 0.2e-6, 15e-6];
        let jobs = [
            [1.0, 40.0, 2.0],
            [1.0, 1640.0, 2.0],
            [1.0, 200.0, 26.0],
            [1.0, 90.0, 5.0],
            [1.0, 400.0, 12.0],
        ];
        let obs: Vec<Observation> = jobs
            .iter()
            .enumerate()
            .map(|(i, c)| observation(*c, truth, i as f64 * 1e-6))
            .collect();
        let f = fit(&obs, &NAMES).unwrap();
        for (got, want) in f.costs.iter().zip(truth) {
            assert!((got / want - 1.0).abs() < 1e-9, "{f:?}");
        }
        assert!(f.relative_errors.iter().all(|e| e.abs() < 1e-9), "{f:?}");
    }

    #[test]
    fn noisy_steps_give_nearby_costs_and_a_negative_cost_is_zero() {
        let truth = [150e-6, 0.2e-6, 15e-6];
        let jobs = [
            [1.0, 40.0, 2.0],
            [1.0, 1640.0, 2.0],
            [1.0, 200.0, 26.0],
            [1.0, 90.0, 5.0],
            [1.0, 400.0, 12.0],
            [1.0, 800.0, 8.0],
        ];
        // ±3% on each step, alternating.
        let obs: Vec<Observation> = jobs
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut o = observation(*c, truth, 0.0);
                o.seconds *= if i % 2 == 0 { 1.03 } else { 0.97 };
                o
            })
            .collect();
        let f = fit(&obs, &NAMES).unwrap();
        for (got, want) in f.costs.iter().zip(truth) {
            assert!((got / want - 1.0).abs() < 0.25, "{f:?}");
        }
        assert!(f.relative_errors.iter().all(|e| e.abs() < 0.05), "{f:?}");
        // Steps that fall as the calls rise: the unconstrained fit gives the call a negative
        // cost; the non-negative one gives 0 and refits the rest.
        let falling = [
            [1.0, 40.0, 2.0],
            [1.0, 1640.0, 2.0],
            [1.0, 40.0, 26.0],
            [1.0, 1640.0, 26.0],
        ];
        let truth_no_call = [150e-6, 0.2e-6, 0.0];
        let obs: Vec<Observation> = falling
            .iter()
            .map(|c| {
                let mut o = observation(*c, truth_no_call, 0.0);
                o.seconds *= if c[2] > 10.0 { 0.9 } else { 1.0 };
                o
            })
            .collect();
        let f = fit(&obs, &NAMES).unwrap();
        assert_eq!(f.costs[2], 0.0, "{f:?}");
        assert!(f.costs.iter().all(|c| *c >= 0.0), "{f:?}");
        assert!(f.costs[0] > 0.0 && f.costs[1] > 0.0, "{f:?}");
    }

    #[test]
    fn a_degenerate_design_is_refused_naming_the_cost() {
        let truth = [150e-6, 0.2e-6, 15e-6];
        let two = vec![
            observation([1.0, 40.0, 2.0], truth, 0.0),
            observation([1.0, 80.0, 3.0], truth, 0.0),
        ];
        assert_eq!(
            fit(&two, &NAMES).unwrap_err(),
            FitError::TooFew {
                observations: 2,
                unknowns: 3
            }
        );
        // No job makes a call.
        let no_calls: Vec<Observation> = [[1.0, 40.0, 0.0], [1.0, 80.0, 0.0], [1.0, 90.0, 0.0]]
            .iter()
            .map(|c| observation(*c, truth, 0.0))
            .collect();
        let e = fit(&no_calls, &NAMES).unwrap_err();
        assert_eq!(
            e,
            FitError::Unmeasured {
                unknown: "call".into()
            }
        );
        assert!(e.to_string().contains("`call`"), "{e}");
        // Calls always 1/20 of the ops: the two costs cannot be told apart.
        let tied: Vec<Observation> = [[1.0, 40.0, 2.0], [1.0, 80.0, 4.0], [1.0, 400.0, 20.0]]
            .iter()
            .map(|c| observation(*c, truth, 0.0))
            .collect();
        assert_eq!(
            fit(&tied, &NAMES).unwrap_err(),
            FitError::Collinear {
                unknown: "call".into()
            }
        );
        // A failed measurement.
        let mut bad = vec![
            observation([1.0, 40.0, 2.0], truth, 0.0),
            observation([1.0, 80.0, 3.0], truth, 0.0),
            observation([1.0, 90.0, 9.0], truth, 0.0),
        ];
        bad[1].seconds = f64::NAN;
        let e = fit(&bad, &NAMES).unwrap_err().to_string();
        assert!(e.contains("calibration job 1"), "{e}");
        bad[1].seconds = 1e-3;
        bad[2].counts.pop();
        assert!(matches!(
            fit(&bad, &NAMES).unwrap_err(),
            FitError::Shape { index: 2, .. }
        ));
    }
}
