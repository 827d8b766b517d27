//! Logical tensors stored as flat shards over several variables (ZeRO's optimizer slots), and
//! the two conversions a checkpoint needs so that it does not depend on the layout it was
//! written under: [`gather`] (shards → whole logical tensors, on save) and [`split`] (whole
//! logical tensors → this job's shards, on restore).
//!
//! A [`ShardedVariable`] of `L` elements over `N` shards stores its flattened (row-major)
//! elements padded with zeros to `N·S`, `S = ⌈L/N⌉`; shard `r` holds `[r·S, (r+1)·S)`. A
//! checkpoint holds the logical tensor under its logical name (`w1/adam_m`) with its logical
//! shape, exactly what a one-process run saves, so it resumes under any number of shards.
//!
//! Shards are flat (`[S]`) unless [`ShardedVariable::shard_dims`] gives their shape: the expert
//! strategy's shards are whole rows (`[E/N, ...]` of an `[E, ...]` variable, E a multiple of N),
//! which are exactly the flat chunks above with no padding.

use dflow_graph::axis_split::AxisSplit;
use dflow_graph::{DType, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A logical tensor stored as equal flat shards (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardedVariable {
    /// The logical name (`w1/adam_m`), as a one-process run names it.
    pub logical: String,
    /// Element type.
    pub dtype: DType,
    /// The logical dimensions.
    pub dims: Vec<usize>,
    /// The shard variables in rank order, each of `⌈L/N⌉` elements.
    pub shards: Vec<String>,
    /// The shards' shape when it is not flat (`[⌈L/N⌉]`); its elements must number `⌈L/N⌉`.
    #[serde(default)]
    pub shard_dims: Option<Vec<usize>>,
}

impl ShardedVariable {
    fn len(&self) -> usize {
        self.dims.iter().product()
    }

    fn shard_len(&self) -> usize {
        self.len().div_ceil(self.shards.len().max(1)).max(1)
    }
}

/// Replaces the shards in `tensors` by their logical tensors (for a checkpoint). A sharded
/// variable none of whose shards is present is left alone; one with some shards missing, or a
/// shard of the wrong dtype or size, is an error naming it.
pub fn gather(
    sharded: &[ShardedVariable],
    tensors: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>, String> {
    let mut by_name: BTreeMap<String, Tensor> = tensors.into_iter().collect();
    for s in sharded {
        if !s.shards.iter().any(|n| by_name.contains_key(n)) {
            continue;
        }
        let mut bytes = Vec::with_capacity(s.shard_len() * s.shards.len() * s.dtype.size_of());
        for name in &s.shards {
            let t = by_name
                .remove(name)
                .ok_or_else(|| format!("`{}`: shard `{name}` is missing", s.logical))?;
            if t.dtype() != s.dtype || t.num_elements() != s.shard_len() {
                return Err(format!(
                    "`{}`: shard `{name}` is {} {:?}, expected {} [{}]",
                    s.logical,
                    t.dtype(),
                    t.dims(),
                    s.dtype,
                    s.shard_len()
                ));
            }
            bytes.extend_from_slice(t.as_bytes());
        }
        bytes.truncate(s.len() * s.dtype.size_of());
        let whole = Tensor::from_bytes(s.dtype, &s.dims, &bytes)
            .map_err(|e| format!("`{}`: {e}", s.logical))?;
        by_name.insert(s.logical.clone(), whole);
    }
    Ok(by_name.into_iter().collect())
}

/// Takes logical tensor `logical` out of a checkpoint's `tensors` for splitting: `None` when it
/// is absent (the caller's missing-variable check reports it), an error naming it when its dtype
/// or shape is not the one this job trains.
fn take_logical(
    tensors: &mut BTreeMap<String, Tensor>,
    logical: &str,
    dtype: DType,
    dims: &[usize],
) -> Result<Option<Tensor>, String> {
    let Some(t) = tensors.remove(logical) else {
        return Ok(None);
    };
    if t.dtype() != dtype || t.dims() != dims {
        return Err(format!(
            "`{logical}` is {} {:?} in the checkpoint, but this job trains it as {dtype} {dims:?}",
            t.dtype(),
            t.dims(),
        ));
    }
    Ok(Some(t))
}

/// Replaces each logical tensor in `tensors` by this layout's shards (for a restore). A logical
/// tensor of the wrong dtype or shape is an error naming it; one that is absent is left for the
/// caller's missing-variable check.
pub fn split(
    sharded: &[ShardedVariable],
    tensors: &mut BTreeMap<String, Tensor>,
) -> Result<(), String> {
    for s in sharded {
        let Some(t) = take_logical(tensors, &s.logical, s.dtype, &s.dims)? else {
            continue;
        };
        let shard_dims = match &s.shard_dims {
            Some(d) if d.iter().product::<usize>() != s.shard_len() => {
                return Err(format!(
                    "`{}`: shards of shape {d:?} cannot hold {} of its {} elements each",
                    s.logical,
                    s.shard_len(),
                    s.len()
                ))
            }
            Some(d) => d.clone(),
            None => vec![s.shard_len()],
        };
        let size = s.dtype.size_of();
        let mut padded = t.as_bytes().to_vec();
        padded.resize(s.shard_len() * s.shards.len() * size, 0);
        for (r, name) in s.shards.iter().enumerate() {
            let part = &padded[r * s.shard_len() * size..(r + 1) * s.shard_len() * size];
            let shard = Tensor::from_bytes(s.dtype, &shard_dims, part)
                .map_err(|e| format!("`{name}`: {e}"))?;
            tensors.insert(name.clone(), shard);
        }
    }
    Ok(())
}

/// A logical tensor stored as [`AxisSplit`] shards along one of its axes (tensor parallelism's
/// weights and their optimizer slots): shard `r` is variable `shards[r]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AxisShardedVariable {
    /// The logical name, as a one-process run names it.
    pub logical: String,
    /// Element type.
    pub dtype: DType,
    /// The logical dimensions.
    pub dims: Vec<usize>,
    /// The shard variables in rank order.
    pub shards: Vec<String>,
    /// The axis cut.
    pub axis: usize,
    /// Blocks along the axis, each cut separately.
    pub blocks: usize,
    /// The axis's length with its zero padding.
    pub padded: usize,
}

impl AxisShardedVariable {
    /// The split its shards follow.
    pub fn split(&self) -> AxisSplit {
        AxisSplit {
            axis: self.axis,
            blocks: self.blocks,
            parts: self.shards.len(),
            padded: self.padded,
        }
    }
}

/// [`gather`] for axis-sharded variables: the shards in `tensors` replaced by their logical
/// tensors (padding dropped). One with no shard present is left alone; one with some missing
/// is an error naming it.
pub fn gather_axis(
    sharded: &[AxisShardedVariable],
    tensors: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>, String> {
    let mut by_name: BTreeMap<String, Tensor> = tensors.into_iter().collect();
    for s in sharded {
        if !s.shards.iter().any(|n| by_name.contains_key(n)) {
            continue;
        }
        let parts = s
            .shards
            .iter()
            .map(|name| {
                by_name
                    .remove(name)
                    .ok_or_else(|| format!("`{}`: shard `{name}` is missing", s.logical))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let whole = s
            .split()
            .assemble(&parts, &s.dims)
            .map_err(|e| format!("`{}`: {e}", s.logical))?;
        by_name.insert(s.logical.clone(), whole);
    }
    Ok(by_name.into_iter().collect())
}

/// [`split`] for axis-sharded variables: each logical tensor replaced by this job's shards.
pub fn split_axis(
    sharded: &[AxisShardedVariable],
    tensors: &mut BTreeMap<String, Tensor>,
) -> Result<(), String> {
    for s in sharded {
        let Some(t) = take_logical(tensors, &s.logical, s.dtype, &s.dims)? else {
            continue;
        };
        let split = s.split();
        for (r, name) in s.shards.iter().enumerate() {
            let shard = split
                .shard(&t, r)
                .map_err(|e| format!("`{}`: {e}", s.logical))?;
            tensors.insert(name.clone(), shard);
        }
    }
    Ok(())
}

/// One shard of a [`RowShardedVariable`]: the variable and the logical rows it holds,
/// `start, start + step, ...` (`count` of them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowShard {
    /// The shard variable (`emb/part_1`, `emb/part_1/adam_m`).
    pub name: String,
    /// The logical row of its row 0.
    pub start: u64,
    /// The distance between the logical rows of consecutive rows (1: a block).
    pub step: u64,
    /// Its rows.
    pub count: u64,
}

/// A logical `[rows, d..]` tensor stored as row shards (an embedding table sharded over the ps
/// tasks, and its optimizer slots): a checkpoint holds it whole under its logical name, so it
/// resumes at any number of shards, or in one process.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowShardedVariable {
    /// The logical name (`emb`, `emb/adam_m`), as a one-process run names it.
    pub logical: String,
    /// Element type.
    pub dtype: DType,
    /// The logical dimensions, `[rows, d..]`.
    pub dims: Vec<usize>,
    /// The shards, shard 0 first.
    pub shards: Vec<RowShard>,
}

impl RowShardedVariable {
    fn row_bytes(&self) -> usize {
        self.dims.iter().skip(1).product::<usize>() * self.dtype.size_of()
    }

    /// The byte range of logical row `r` of shard `k`'s `i`-th row, checked against the dims.
    fn logical_row(&self, k: &RowShard, i: u64) -> Result<std::ops::Range<usize>, String> {
        let r = k
            .step
            .checked_mul(i)
            .and_then(|o| o.checked_add(k.start))
            .filter(|&r| r < self.dims.first().copied().unwrap_or(0) as u64)
            .ok_or_else(|| {
                format!(
                    "`{}`: shard `{}` row {i} lies outside {:?}",
                    self.logical, k.name, self.dims
                )
            })? as usize;
        let b = self.row_bytes();
        Ok(r * b..(r + 1) * b)
    }
}

/// Replaces the row shards in `tensors` by their logical tensors (for a checkpoint). A variable
/// none of whose shards is present is left alone; one with some shards missing or misshapen is
/// an error naming it.
pub fn gather_rows(
    sharded: &[RowShardedVariable],
    tensors: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>, String> {
    let mut by_name: BTreeMap<String, Tensor> = tensors.into_iter().collect();
    for s in sharded {
        if !s.shards.iter().any(|k| by_name.contains_key(&k.name)) {
            continue;
        }
        let mut bytes = vec![0u8; s.dims.iter().product::<usize>() * s.dtype.size_of()];
        for k in &s.shards {
            let t = by_name
                .remove(&k.name)
                .ok_or_else(|| format!("`{}`: shard `{}` is missing", s.logical, k.name))?;
            let want: Vec<usize> = std::iter::once(k.count as usize)
                .chain(s.dims.iter().skip(1).copied())
                .collect();
            if t.dtype() != s.dtype || t.dims() != want.as_slice() {
                return Err(format!(
                    "`{}`: shard `{}` is {} {:?}, expected {} {want:?}",
                    s.logical,
                    k.name,
                    t.dtype(),
                    t.dims(),
                    s.dtype
                ));
            }
            let b = s.row_bytes();
            for i in 0..k.count {
                let at = s.logical_row(k, i)?;
                let src = i as usize * b;
                bytes[at].copy_from_slice(&t.as_bytes()[src..src + b]);
            }
        }
        let whole = Tensor::from_bytes(s.dtype, &s.dims, &bytes)
            .map_err(|e| format!("`{}`: {e}", s.logical))?;
        by_name.insert(s.logical.clone(), whole);
    }
    Ok(by_name.into_iter().collect())
}

/// Replaces each logical tensor in `tensors` by this layout's row shards (for a restore). A
/// logical tensor of the wrong dtype or shape is an error naming it; one that is absent is left
/// for the caller's missing-variable check.
pub fn split_rows(
    sharded: &[RowShardedVariable],
    tensors: &mut BTreeMap<String, Tensor>,
) -> Result<(), String> {
    for s in sharded {
        let Some(t) = take_logical(tensors, &s.logical, s.dtype, &s.dims)? else {
            continue;
        };
        for k in &s.shards {
            let mut part = Vec::with_capacity(k.count as usize * s.row_bytes());
            for i in 0..k.count {
                part.extend_from_slice(&t.as_bytes()[s.logical_row(k, i)?]);
            }
            let dims: Vec<usize> = std::iter::once(k.count as usize)
                .chain(s.dims.iter().skip(1).copied())
                .collect();
            let shard = Tensor::from_bytes(s.dtype, &dims, &part)
                .map_err(|e| format!("`{}`: {e}", k.name))?;
            tensors.insert(k.name.clone(), shard);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(n: usize) -> ShardedVariable {
        ShardedVariable {
            logical: "w/adam_m".into(),
            dtype: DType::F32,
            dims: vec![5],
            shards: (0..n)
                .map(|r| format!("w/adam_m/shard_{r}_of_{n}"))
                .collect(),
            shard_dims: None,
        }
    }

    #[test]
    fn row_shards_keep_their_shape_and_gather_back_to_the_whole() {
        // Experts: a [4, 3] variable as two [2, 3] shards of whole rows.
        let whole =
            Tensor::from_slice(&[4, 3], &(0..12).map(|v| v as f32).collect::<Vec<_>>()).unwrap();
        let s = ShardedVariable {
            logical: "experts".into(),
            dtype: DType::F32,
            dims: vec![4, 3],
            shards: vec!["experts/shard_0".into(), "experts/shard_1".into()],
            shard_dims: Some(vec![2, 3]),
        };
        let mut tensors = BTreeMap::from([("experts".to_string(), whole.clone())]);
        split(std::slice::from_ref(&s), &mut tensors).unwrap();
        assert_eq!(tensors["experts/shard_1"].dims(), [2, 3]);
        assert_eq!(
            tensors["experts/shard_1"].as_slice::<f32>().unwrap(),
            [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
        );
        let back = gather(std::slice::from_ref(&s), tensors.into_iter().collect()).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].0, "experts");
        assert_eq!(back[0].1.dims(), [4, 3]);
        assert_eq!(
            back[0].1.as_slice::<f32>().unwrap(),
            whole.as_slice::<f32>().unwrap()
        );
        // A shard shape that does not hold a shard's elements is refused, naming the variable.
        let bad = ShardedVariable {
            shard_dims: Some(vec![3, 3]),
            ..s
        };
        let mut tensors = BTreeMap::from([("experts".to_string(), whole)]);
        let e = split(std::slice::from_ref(&bad), &mut tensors).unwrap_err();
        assert!(e.contains("`experts`: shards of shape [3, 3]"), "{e}");
    }

    #[test]
    fn split_then_gather_is_the_identity_at_any_shard_count() {
        let whole = Tensor::from_slice(&[5], &[1.0f32, 2.0, 3.0, 4.0, 5.0]).unwrap();
        for n in 1..=6 {
            let s = slot(n);
            let mut tensors = BTreeMap::from([("w/adam_m".to_string(), whole.clone())]);
            split(std::slice::from_ref(&s), &mut tensors).unwrap();
            assert_eq!(tensors.len(), n);
            let s_len = 5usize.div_ceil(n);
            assert!(tensors.values().all(|t| t.dims() == [s_len]));
            let back = gather(std::slice::from_ref(&s), tensors.into_iter().collect()).unwrap();
            assert_eq!(back.len(), 1);
            assert_eq!(back[0].0, "w/adam_m");
            assert_eq!(
                back[0].1.as_slice::<f32>().unwrap(),
                whole.as_slice::<f32>().unwrap()
            );
        }
    }

    #[test]
    fn a_missing_or_misshapen_shard_is_named() {
        let s = slot(2);
        let t = Tensor::from_slice(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
        let e = gather(
            std::slice::from_ref(&s),
            vec![("w/adam_m/shard_0_of_2".into(), t.clone())],
        )
        .unwrap_err();
        assert!(
            e.contains("shard `w/adam_m/shard_1_of_2` is missing"),
            "{e}"
        );
        let bad = Tensor::from_slice(&[2], &[1.0f32, 2.0]).unwrap();
        let e = gather(
            std::slice::from_ref(&s),
            vec![
                ("w/adam_m/shard_0_of_2".into(), t),
                ("w/adam_m/shard_1_of_2".into(), bad),
            ],
        )
        .unwrap_err();
        assert!(e.contains("expected f32 [3]"), "{e}");
        let mut tensors = BTreeMap::from([(
            "w/adam_m".to_string(),
            Tensor::from_slice(&[4], &[0.0f32; 4]).unwrap(),
        )]);
        let e = split(std::slice::from_ref(&s), &mut tensors).unwrap_err();
        assert!(e.contains("this job trains it as f32 [5]"), "{e}");
    }

    #[test]
    fn axis_shards_round_trip_and_a_missing_one_is_named() {
        let whole = Tensor::from_slice(&[3, 2], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let s = AxisShardedVariable {
            logical: "wte".into(),
            dtype: DType::F32,
            dims: vec![3, 2],
            shards: vec!["wte/tp_0_of_2".into(), "wte/tp_1_of_2".into()],
            axis: 0,
            blocks: 1,
            padded: 4,
        };
        let mut tensors = BTreeMap::from([("wte".to_string(), whole.clone())]);
        split_axis(std::slice::from_ref(&s), &mut tensors).unwrap();
        assert_eq!(tensors["wte/tp_1_of_2"].dims(), &[2, 2]);
        let back = gather_axis(
            std::slice::from_ref(&s),
            tensors.clone().into_iter().collect(),
        )
        .unwrap();
        assert_eq!(back, vec![("wte".to_string(), whole)]);
        tensors.remove("wte/tp_0_of_2");
        let e = gather_axis(std::slice::from_ref(&s), tensors.into_iter().collect()).unwrap_err();
        assert!(e.contains("shard `wte/tp_0_of_2` is missing"), "{e}");
    }
    #[test]
    fn row_shards_split_and_gather_back_mod_and_div() {
        let whole: Vec<f32> = (0..10).map(|v| v as f32).collect();
        let whole = Tensor::from_slice(&[5, 2], &whole).unwrap();
        // mod over 2: rows 0,2,4 and 1,3; div over 2: rows 0..3 and 3..5.
        for layout in [[(0, 2, 3), (1, 2, 2)], [(0, 1, 3), (3, 1, 2)]] {
            let s = RowShardedVariable {
                logical: "emb".into(),
                dtype: DType::F32,
                dims: vec![5, 2],
                shards: layout
                    .iter()
                    .enumerate()
                    .map(|(i, &(start, step, count))| RowShard {
                        name: format!("emb/part_{i}"),
                        start,
                        step,
                        count,
                    })
                    .collect(),
            };
            let mut tensors = BTreeMap::from([("emb".to_string(), whole.clone())]);
            split_rows(std::slice::from_ref(&s), &mut tensors).unwrap();
            let p1 = tensors["emb/part_1"].as_slice::<f32>().unwrap().to_vec();
            let (start, step, _) = layout[1];
            let want: Vec<f32> = (0..2)
                .flat_map(|i| {
                    let r = (start + step * i) as f32;
                    [2.0 * r, 2.0 * r + 1.0]
                })
                .collect();
            assert_eq!(p1, want);
            let back =
                gather_rows(std::slice::from_ref(&s), tensors.into_iter().collect()).unwrap();
            assert_eq!(back.len(), 1);
            assert_eq!(
                back[0].1.as_slice::<f32>().unwrap(),
                whole.as_slice::<f32>().unwrap()
            );
        }
    }

    #[test]
    fn a_checkpoint_tensor_of_another_shape_is_refused_naming_it() {
        let mut tensors = BTreeMap::from([(
            "emb".to_string(),
            Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap(),
        )]);
        let e = take_logical(&mut tensors, "emb", DType::F32, &[4, 2]).unwrap_err();
        assert!(
            e.contains("`emb` is") && e.contains("this job trains it as f32 [4, 2]"),
            "{e}"
        );
        // Absent: left for the caller's missing-variable check.
        assert!(take_logical(&mut tensors, "w", DType::F32, &[1])
            .unwrap()
            .is_none());
    }
}
