//! Device meshes of several axes (`dp=2,tp=2,pp=2`) in Megatron-core's rank order: the
//! tensor-parallel axis varies fastest, then data parallelism, then the pipeline, so a
//! tensor-parallel group is a run of consecutive ranks (one host's fast links) and a pipeline
//! group strides over the hosts.
//!
//! ```
//! use dflow_partitioner::mesh::{Axis, Mesh};
//!
//! let mesh: Mesh = "dp=2,tp=2,pp=2".parse().unwrap();
//! assert_eq!(mesh.size(), 8);
//! assert_eq!(mesh.groups(Axis::Tp), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
//! assert_eq!(mesh.groups(Axis::Dp), vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]);
//! assert_eq!(mesh.groups(Axis::Pp), vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
//! ```
//!
//! Expert parallelism (`ep`) is carved out of the data-parallel axis, as in Megatron-core: it
//! adds no ranks. The dense parameters stay data-parallel over every `dp` group; each `dp` group
//! splits into runs of `ep` consecutive data-parallel ranks that share the experts (an
//! expert-parallel group, whose all-to-alls move the tokens), and the ranks holding the same
//! expert shard, one in each expert-parallel group, sum their expert gradients (an
//! expert-data-parallel group).
//!
//! ```
//! use dflow_partitioner::mesh::{Axis, Mesh};
//!
//! let mesh: Mesh = "dp=4,ep=2".parse().unwrap();
//! assert_eq!(mesh.size(), 4);
//! assert_eq!(mesh.groups(Axis::Dp), vec![vec![0, 1, 2, 3]]);
//! assert_eq!(mesh.groups(Axis::Ep), vec![vec![0, 1], vec![2, 3]]);
//! assert_eq!(mesh.expert_data_groups(), vec![vec![0, 2], vec![1, 3]]);
//! ```

use std::fmt;
use std::str::FromStr;

/// An axis of a mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    /// Tensor parallelism (fastest-varying).
    Tp,
    /// Data parallelism.
    Dp,
    /// Pipeline parallelism (slowest-varying).
    Pp,
    /// Expert parallelism: a split of the data-parallel axis, not an axis of its own in the
    /// rank order (see the module docs).
    Ep,
}

impl Axis {
    /// Every axis, fastest-varying first (Megatron-core's order).
    pub const ORDER: [Axis; 3] = [Axis::Tp, Axis::Dp, Axis::Pp];

    /// Every axis the mesh syntax accepts: [`Axis::ORDER`] and the expert axis.
    pub const ALL: [Axis; 4] = [Axis::Tp, Axis::Dp, Axis::Pp, Axis::Ep];

    /// The name the mesh syntax uses (`tp`, `dp`, `pp`, `ep`).
    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
            Axis::Ep => "ep",
        }
    }

    /// What the axis does, in words.
    pub fn about(self) -> &'static str {
        match self {
            Axis::Tp => "tensor parallelism",
            Axis::Dp => "data parallelism",
            Axis::Pp => "pipeline parallelism",
            Axis::Ep => "expert parallelism",
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a mesh is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// The text is not `axis=size[,axis=size...]`.
    #[error("mesh `{text}`: {message} (write it as dp=2,tp=2,pp=2)")]
    Syntax {
        /// The mesh as written.
        text: String,
        /// What is wrong.
        message: String,
    },
    /// An axis of size 0.
    #[error("mesh axis {axis} has size 0; every axis needs at least 1 device")]
    ZeroAxis {
        /// The axis.
        axis: Axis,
    },
    /// The axes' product is not the number of tasks.
    #[error("mesh {mesh} has {size} ranks but the job has {tasks} tasks: the product of the axes must equal the number of tasks (change the {axis} axis to {suggestion} or the number of tasks)")]
    Size {
        /// The mesh.
        mesh: String,
        /// Its number of ranks.
        size: usize,
        /// The tasks.
        tasks: usize,
        /// The axis to change (the data-parallel axis, the usual free one).
        axis: Axis,
        /// What that axis would need to be, or `a divisor` when no whole size fits.
        suggestion: String,
    },
    /// An axis does not divide a dimension it splits.
    #[error("mesh axis {axis}={size} does not divide {what} ({dim}): use a {axis} size that divides {dim}")]
    Indivisible {
        /// The axis.
        axis: Axis,
        /// Its size.
        size: usize,
        /// The dimension, in words (`the global batch`, `weight transformer.h.0.attn.c_attn.weight dim 0`).
        what: String,
        /// The dimension's size.
        dim: usize,
    },
}

/// A mesh: the size of each axis. Ranks are numbered tp fastest, then dp, then pp; `ep`
/// splits the data-parallel axis (it divides `dp` and adds no ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Data-parallel size.
    pub dp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Expert-parallel size: the data-parallel ranks that share one copy of the experts (1: no
    /// expert parallelism).
    pub ep: usize,
}

impl Mesh {
    /// A mesh of these sizes with no expert parallelism; every size must be at least 1.
    pub fn new(dp: usize, tp: usize, pp: usize) -> Result<Mesh, MeshError> {
        let mesh = Mesh { tp, dp, pp, ep: 1 };
        for axis in Axis::ORDER {
            if mesh.size_of(axis) == 0 {
                return Err(MeshError::ZeroAxis { axis });
            }
        }
        Ok(mesh)
    }

    /// This mesh with expert parallelism `ep`, which must be at least 1 and divide `dp`.
    pub fn with_ep(self, ep: usize) -> Result<Mesh, MeshError> {
        if ep == 0 {
            return Err(MeshError::ZeroAxis { axis: Axis::Ep });
        }
        let mesh = Mesh { ep, ..self };
        mesh.check_divides(Axis::Ep, mesh.dp, "the data-parallel axis dp")?;
        Ok(mesh)
    }

    /// The size of `axis`.
    pub fn size_of(&self, axis: Axis) -> usize {
        match axis {
            Axis::Tp => self.tp,
            Axis::Dp => self.dp,
            Axis::Pp => self.pp,
            Axis::Ep => self.ep,
        }
    }

    /// The number of ranks: the product of the axes.
    pub fn size(&self) -> usize {
        self.tp * self.dp * self.pp
    }

    /// Checks that the mesh has exactly `tasks` ranks.
    pub fn check_tasks(&self, tasks: usize) -> Result<(), MeshError> {
        if self.size() == tasks {
            return Ok(());
        }
        let others = self.tp * self.pp;
        let suggestion = if tasks % others == 0 && tasks > 0 {
            format!("dp={}", tasks / others)
        } else {
            format!("a size making the product {tasks}")
        };
        Err(MeshError::Size {
            mesh: self.to_string(),
            size: self.size(),
            tasks,
            axis: Axis::Dp,
            suggestion,
        })
    }

    /// Checks that `axis` divides a dimension it splits (`what` names it for the error).
    pub fn check_divides(&self, axis: Axis, dim: usize, what: &str) -> Result<(), MeshError> {
        let size = self.size_of(axis);
        if dim % size == 0 {
            Ok(())
        } else {
            Err(MeshError::Indivisible {
                axis,
                size,
                what: what.to_string(),
                dim,
            })
        }
    }

    /// The coordinate of `rank` along each axis: `(tp, dp, pp)`.
    pub fn coords(&self, rank: usize) -> (usize, usize, usize) {
        let tp = rank % self.tp;
        let dp = (rank / self.tp) % self.dp;
        let pp = rank / (self.tp * self.dp);
        (tp, dp, pp)
    }

    /// The rank at coordinates `(tp, dp, pp)`.
    pub fn rank(&self, tp: usize, dp: usize, pp: usize) -> usize {
        tp + self.tp * (dp + self.dp * pp)
    }

    /// The groups along `axis`: the ranks that differ only in that coordinate, each group in
    /// increasing rank order, groups ordered by their first rank. Along [`Axis::Ep`], the
    /// expert-parallel groups: each data-parallel group cut into runs of `ep` consecutive
    /// data-parallel ranks (they hold one copy of the experts between them).
    pub fn groups(&self, axis: Axis) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for rank in 0..self.size() {
            let (t, d, p) = self.coords(rank);
            let leads = match axis {
                Axis::Tp => t == 0,
                Axis::Dp => d == 0,
                Axis::Pp => p == 0,
                Axis::Ep => d % self.ep == 0,
            };
            if leads {
                groups.push(self.group_of(axis, rank));
            }
        }
        groups
    }

    /// The group along `axis` that holds `rank`.
    pub fn group_of(&self, axis: Axis, rank: usize) -> Vec<usize> {
        let (t, d, p) = self.coords(rank);
        (0..self.size_of(axis))
            .map(|i| match axis {
                Axis::Tp => self.rank(i, d, p),
                Axis::Dp => self.rank(t, i, p),
                Axis::Pp => self.rank(t, d, i),
                Axis::Ep => self.rank(t, d - d % self.ep + i, p),
            })
            .collect()
    }

    /// The expert-data-parallel groups: the ranks of one data-parallel group that hold the same
    /// expert shard (the same position in their expert-parallel groups), `dp / ep` each, which
    /// sum their expert gradients. In increasing rank order, ordered by their first rank.
    pub fn expert_data_groups(&self) -> Vec<Vec<usize>> {
        (0..self.size())
            .filter(|&r| self.coords(r).1 < self.ep)
            .map(|r| self.expert_data_group_of(r))
            .collect()
    }

    /// The expert-data-parallel group that holds `rank`.
    pub fn expert_data_group_of(&self, rank: usize) -> Vec<usize> {
        let (t, d, p) = self.coords(rank);
        (0..self.dp / self.ep)
            .map(|k| self.rank(t, d % self.ep + k * self.ep, p))
            .collect()
    }

    /// Rank `rank`'s position in its expert-parallel group: the expert shard it holds.
    pub fn expert_rank(&self, rank: usize) -> usize {
        self.coords(rank).1 % self.ep
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp={},tp={},pp={}", self.dp, self.tp, self.pp)?;
        if self.ep > 1 {
            write!(f, ",ep={}", self.ep)?;
        }
        Ok(())
    }
}

impl FromStr for Mesh {
    type Err = MeshError;

    /// Parses `dp=2,tp=2,pp=2` (and `ep=E`, which must divide `dp`): any order, each axis at
    /// most once, missing axes 1.
    fn from_str(text: &str) -> Result<Mesh, MeshError> {
        let syntax = |message: String| MeshError::Syntax {
            text: text.to_string(),
            message,
        };
        let mut sizes: [Option<usize>; 4] = [None; 4];
        for part in text.split(',').map(str::trim) {
            if part.is_empty() {
                return Err(syntax("an empty axis".into()));
            }
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| syntax(format!("`{part}` has no `=`")))?;
            let axis = Axis::ALL
                .into_iter()
                .find(|a| a.name() == name.trim())
                .ok_or_else(|| {
                    syntax(format!(
                        "unknown axis `{}`; the axes are dp, tp, pp, ep",
                        name.trim()
                    ))
                })?;
            let size: usize = value.trim().parse().map_err(|_| {
                syntax(format!(
                    "axis {axis}: `{}` is not a whole number",
                    value.trim()
                ))
            })?;
            let slot = &mut sizes[axis as usize];
            if slot.is_some() {
                return Err(syntax(format!("axis {axis} is given twice")));
            }
            *slot = Some(size);
        }
        let get = |a: Axis| sizes[a as usize].unwrap_or(1);
        Mesh::new(get(Axis::Dp), get(Axis::Tp), get(Axis::Pp))?.with_ep(get(Axis::Ep))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_groups_for_eight_ranks() {
        let mesh: Mesh = "dp=2,tp=2,pp=2".parse().unwrap();
        assert_eq!(
            mesh.groups(Axis::Tp),
            [[0, 1], [2, 3], [4, 5], [6, 7]].map(Vec::from)
        );
        assert_eq!(
            mesh.groups(Axis::Dp),
            [[0, 2], [1, 3], [4, 6], [5, 7]].map(Vec::from)
        );
        assert_eq!(
            mesh.groups(Axis::Pp),
            [[0, 4], [1, 5], [2, 6], [3, 7]].map(Vec::from)
        );
        for r in 0..8 {
            let (t, d, p) = mesh.coords(r);
            assert_eq!(mesh.rank(t, d, p), r);
        }
    }

    #[test]
    fn megatron_groups_for_four_ranks_dp2_tp2() {
        let mesh: Mesh = "dp=2,tp=2".parse().unwrap();
        assert_eq!(mesh.size(), 4);
        assert_eq!(mesh.groups(Axis::Tp), [[0, 1], [2, 3]].map(Vec::from));
        assert_eq!(mesh.groups(Axis::Dp), [[0, 2], [1, 3]].map(Vec::from));
        assert_eq!(mesh.groups(Axis::Pp), [[0], [1], [2], [3]].map(Vec::from));
        assert_eq!(mesh.coords(2), (0, 1, 0));
        assert_eq!(mesh.group_of(Axis::Dp, 3), [1, 3]);
    }

    #[test]
    fn expert_groups_for_dp4_ep2_and_inside_a_tp_pp_mesh() {
        let mesh: Mesh = "dp=4,ep=2".parse().unwrap();
        assert_eq!(mesh.size(), 4);
        assert_eq!(mesh.to_string(), "dp=4,tp=1,pp=1,ep=2");
        assert_eq!(mesh.groups(Axis::Dp), [[0, 1, 2, 3]].map(Vec::from));
        assert_eq!(mesh.groups(Axis::Ep), [[0, 1], [2, 3]].map(Vec::from));
        assert_eq!(mesh.expert_data_groups(), [[0, 2], [1, 3]].map(Vec::from));
        assert_eq!(mesh.group_of(Axis::Ep, 3), [2, 3]);
        assert_eq!(mesh.expert_data_group_of(3), [1, 3]);
        assert_eq!(
            (0..4).map(|r| mesh.expert_rank(r)).collect::<Vec<_>>(),
            [0, 1, 0, 1]
        );
        // ep = dp: one expert group, every expert-data group a single rank.
        let whole: Mesh = "dp=2,ep=2".parse().unwrap();
        assert_eq!(whole.groups(Axis::Ep), [[0, 1]].map(Vec::from));
        assert_eq!(whole.expert_data_groups(), [[0], [1]].map(Vec::from));
        // Inside tp and pp, the expert groups split each data-parallel group.
        let mesh: Mesh = "tp=2,dp=4,ep=2,pp=2".parse().unwrap();
        assert_eq!(mesh.size(), 16);
        assert_eq!(mesh.group_of(Axis::Dp, 1), [1, 3, 5, 7]);
        assert_eq!(mesh.group_of(Axis::Ep, 5), [5, 7]);
        assert_eq!(mesh.expert_data_group_of(5), [1, 5]);
        assert_eq!(mesh.groups(Axis::Ep).len(), 8);
        assert_eq!(mesh.expert_data_groups().len(), 8);
        assert_eq!(mesh.expert_data_groups()[1], [1, 5]);
    }

    #[test]
    fn order_of_the_text_does_not_matter_and_missing_axes_are_one() {
        let a: Mesh = "pp=2, tp=4".parse().unwrap();
        assert_eq!(a, Mesh::new(1, 4, 2).unwrap());
        assert_eq!(a.to_string(), "dp=1,tp=4,pp=2");
        assert_eq!(a.groups(Axis::Dp).len(), 8);
    }

    #[test]
    fn errors_name_the_axis() {
        let mesh: Mesh = "dp=2,tp=2,pp=2".parse().unwrap();
        let e = mesh.check_tasks(6).unwrap_err().to_string();
        assert!(e.contains("has 8 ranks but the job has 6 tasks"), "{e}");
        assert!(e.contains("dp"), "{e}");
        let e = mesh.check_tasks(12).unwrap_err().to_string();
        assert!(e.contains("change the dp axis to dp=3"), "{e}");
        let e = Mesh::new(1, 3, 1)
            .unwrap()
            .check_divides(Axis::Tp, 128, "the heads' channels")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "mesh axis tp=3 does not divide the heads' channels (128): use a tp size that divides 128"
        );
        for (text, want) in [
            ("dp=0", "axis dp has size 0"),
            ("dp=2,dp=2", "axis dp is given twice"),
            ("xp=2", "unknown axis `xp`"),
            (
                "dp=4,ep=3",
                "mesh axis ep=3 does not divide the data-parallel axis dp (4)",
            ),
            (
                "ep=2",
                "mesh axis ep=2 does not divide the data-parallel axis dp (1)",
            ),
            ("dp=2,ep=0", "axis ep has size 0"),
            ("dp=x", "`x` is not a whole number"),
            ("dp2", "`dp2` has no `=`"),
            ("", "an empty axis"),
        ] {
            let e = text.parse::<Mesh>().unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
    }
}
