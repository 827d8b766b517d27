//! A layout: how many ways the model is replicated (dp), split inside its layers (tp) and cut
//! into stages (pp), how many data-parallel ranks share one copy of its experts (ep, a model
//! with MoE layers), the ZeRO stage over the data-parallel group, the micro-batches per step
//! and the pipeline schedule; `--layout dp=2,tp=2,pp=2,zero=1,m=8,schedule=1f1b` (or
//! `dp=4,ep=2`) parses into one.

use crate::mesh::{Mesh, MeshError};
use crate::strategy::pipeline::schedule::ScheduleKind;
use std::fmt;
use std::str::FromStr;

/// One way to run the model on the devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    /// The mesh (dp × tp × pp devices).
    pub mesh: Mesh,
    /// ZeRO stage over the data-parallel group: 0 none, 1 optimizer state, 2 + gradients,
    /// 3 + parameters.
    pub zero: u8,
    /// Micro-batches per step (1 without a pipeline).
    pub micro_batches: usize,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline device (interleaved only).
    pub chunks: usize,
}

impl Layout {
    /// A layout of `mesh` without ZeRO, one micro-batch, 1F1B.
    pub fn new(mesh: Mesh) -> Layout {
        Layout {
            mesh,
            zero: 0,
            micro_batches: 1,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
        }
    }

    /// The layout's short name for tables (`dp4 tp2 pp1 z1`, `dp4 tp1 pp1 ep2`).
    pub fn short(&self) -> String {
        let mut s = format!("dp{} tp{} pp{}", self.mesh.dp, self.mesh.tp, self.mesh.pp);
        if self.mesh.ep > 1 {
            s.push_str(&format!(" ep{}", self.mesh.ep));
        }
        if self.zero > 0 {
            s.push_str(&format!(" z{}", self.zero));
        }
        if self.mesh.pp > 1 {
            s.push_str(&format!(" m{}", self.micro_batches));
            if self.schedule != ScheduleKind::OneFOneB {
                s.push_str(&format!(" {}", self.schedule));
            }
            if self.chunks > 1 {
                s.push_str(&format!(" v{}", self.chunks));
            }
        }
        s
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{},zero={},m={},schedule={}",
            self.mesh, self.zero, self.micro_batches, self.schedule
        )?;
        if self.chunks > 1 {
            write!(f, ",chunks={}", self.chunks)?;
        }
        Ok(())
    }
}

/// Why `--layout` does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The mesh part is wrong.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// Another key is wrong.
    #[error("layout `{text}`: {message} (write it as dp=2,tp=2,pp=2[,ep=2][,zero=1][,m=8][,schedule=1f1b][,chunks=2])")]
    Syntax {
        /// The layout as written.
        text: String,
        /// What is wrong.
        message: String,
    },
}

impl FromStr for Layout {
    type Err = LayoutError;

    fn from_str(text: &str) -> Result<Layout, LayoutError> {
        let syntax = |message: String| LayoutError::Syntax {
            text: text.to_string(),
            message,
        };
        let mut mesh_parts = Vec::new();
        let mut layout = Layout::new(Mesh::new(1, 1, 1)?);
        for part in text.split(',').map(str::trim) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| syntax(format!("`{part}` has no `=`")))?;
            let (key, value) = (key.trim(), value.trim());
            let number = || -> Result<usize, LayoutError> {
                value
                    .parse()
                    .map_err(|_| syntax(format!("{key}: `{value}` is not a whole number")))
            };
            match key {
                "dp" | "tp" | "pp" | "ep" => mesh_parts.push(part.to_string()),
                "zero" => {
                    let z = number()?;
                    if z > 3 {
                        return Err(syntax(format!("zero={z}: the ZeRO stages are 0 to 3")));
                    }
                    layout.zero = z as u8;
                }
                "m" | "micro-batches" => {
                    layout.micro_batches = number()?;
                    if layout.micro_batches == 0 {
                        return Err(syntax("m=0: a step needs at least 1 micro-batch".into()));
                    }
                }
                "chunks" => {
                    layout.chunks = number()?;
                    if layout.chunks == 0 {
                        return Err(syntax("chunks=0: at least 1 chunk".into()));
                    }
                }
                "schedule" => layout.schedule = value.parse().map_err(syntax)?,
                other => {
                    return Err(syntax(format!(
                    "unknown key `{other}`; the keys are dp, tp, pp, ep, zero, m, schedule, chunks"
                )))
                }
            }
        }
        layout.mesh = if mesh_parts.is_empty() {
            Mesh::new(1, 1, 1)?
        } else {
            mesh_parts.join(",").parse()?
        };
        Ok(layout)
    }
}

/// The divisors of `n`, ascending.
pub fn divisors(n: usize) -> Vec<usize> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d * d <= n {
        if n % d == 0 {
            small.push(d);
            if d * d != n {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_parse_and_print() {
        let l: Layout = "dp=2,tp=2,pp=2,zero=1,m=8,schedule=gpipe".parse().unwrap();
        assert_eq!(l.mesh, Mesh::new(2, 2, 2).unwrap());
        assert_eq!(l.zero, 1);
        assert_eq!(l.micro_batches, 8);
        assert_eq!(l.schedule, ScheduleKind::GPipe);
        assert_eq!(l.to_string().parse::<Layout>().unwrap(), l);
        assert_eq!(l.short(), "dp2 tp2 pp2 z1 m8 gpipe");
        let e = "dp=2,zero=4".parse::<Layout>().unwrap_err().to_string();
        assert!(e.contains("the ZeRO stages are 0 to 3"), "{e}");
        let l: Layout = "dp=4,ep=2".parse().unwrap();
        assert_eq!(l.mesh, Mesh::new(4, 1, 1).unwrap().with_ep(2).unwrap());
        assert_eq!(l.short(), "dp4 tp1 pp1 ep2");
        assert_eq!(l.to_string().parse::<Layout>().unwrap(), l);
        let e = "dp=2,x=1".parse::<Layout>().unwrap_err().to_string();
        assert!(e.contains("unknown key `x`"), "{e}");
    }

    #[test]
    fn divisors_are_sorted() {
        assert_eq!(divisors(12), [1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(16), [1, 2, 4, 8, 16]);
        assert_eq!(divisors(1), [1]);
    }
}
