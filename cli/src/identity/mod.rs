//! Where a `dflow run` process learns its place in a job when no `--job/--index/--cluster`
//! flags are given: from the environment variables the launcher that started it sets.
//!
//! Precedence (the first that is present wins; the source is printed at start-up):
//! 1. flags (handled by `dflow run` itself),
//! 2. [`tf_config`]: `TF_CONFIG` (Kubeflow TFJob, TensorFlow's own tooling): the whole cluster;
//! 3. [`torchrun`]: `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT` (torchrun, Kubeflow
//!    PyTorchJob, Ray Train) and the PyTorchJob `PET_*` forms;
//! 4. [`slurm`]: `SLURM_PROCID`/`SLURM_NTASKS`/`SLURM_STEP_NODELIST` (srun);
//! 5. [`mpi`]: `OMPI_COMM_WORLD_*` (Open MPI) and `PMI_RANK`/`PMI_SIZE` (MPICH, Intel MPI).
//!
//! Only `TF_CONFIG` names every task's address ([`Place::Task`]); the others give a rank, the
//! world size and where rank 0 is ([`Place::Ranked`]), and the tasks then register with rank 0
//! (`dflow_executor::cluster::registration`). Every parser is pure: it reads an [`Env`].
//!
//! ```
//! use dflow::identity::{from_env, Place, Source};
//! let vars = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")];
//! let env = |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string());
//! let id = from_env(&env)?.expect("torchrun variables are set");
//! assert_eq!(id.source, Source::Torchrun);
//! let Place::Ranked(r) = id.place else { unreachable!() };
//! assert_eq!((r.rank, r.world_size), (1, 2));
//! # Ok::<(), dflow::identity::IdentityError>(())
//! ```

pub mod mpi;
pub mod slurm;
pub mod tf_config;
pub mod torchrun;

use dflow_graph::ClusterSpec;
use std::fmt;

/// The port rank 0 listens on for registrations when the launcher names its host but no port
/// (PyTorch's default, so Slurm scripts written for PyTorch work unchanged).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Reads an environment variable: `None` when unset (or not valid Unicode).
pub trait Env {
    /// The value of `name`.
    fn get(&self, name: &str) -> Option<String>;
}

impl<F: Fn(&str) -> Option<String>> Env for F {
    fn get(&self, name: &str) -> Option<String> {
        self(name)
    }
}

/// This process's environment.
#[derive(Debug, Clone, Copy)]
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn get(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

/// Which launcher's variables gave the identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `--job/--index/--cluster`.
    Flags,
    /// `TF_CONFIG`.
    TfConfig,
    /// `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (torchrun, PyTorchJob, Ray).
    Torchrun,
    /// PyTorchJob's `PET_NODE_RANK`, `PET_NNODES`, `PET_MASTER_ADDR`, `PET_MASTER_PORT`.
    PyTorchJobPet,
    /// `SLURM_PROCID`, `SLURM_NTASKS`, ... (srun).
    Slurm,
    /// `OMPI_COMM_WORLD_*` (Open MPI's mpirun).
    OpenMpi,
    /// `PMI_RANK`, `PMI_SIZE` (MPICH's and Intel MPI's mpiexec).
    Pmi,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Flags => "flags (--job/--index/--cluster)",
            Source::TfConfig => "TF_CONFIG",
            Source::Torchrun => "torchrun/PyTorchJob/Ray variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)",
            Source::PyTorchJobPet => "PyTorchJob PET_* variables (PET_NODE_RANK, PET_NNODES, PET_MASTER_ADDR, PET_MASTER_PORT)",
            Source::Slurm => "Slurm variables (SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST)",
            Source::OpenMpi => "Open MPI variables (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE)",
            Source::Pmi => "PMI variables (PMI_RANK, PMI_SIZE)",
        })
    }
}

/// Where rank 0 accepts registrations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Master {
    /// Host name or IP literal (IPv6 without brackets).
    pub host: String,
    /// Port.
    pub port: u16,
}

impl Master {
    /// `host:port` (IPv6 in brackets).
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// A rank-based identity: the tasks register with rank 0 to learn the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ranked {
    /// This process's rank, `0..world_size`; rank 0 is the chief.
    pub rank: u32,
    /// How many processes the job has.
    pub world_size: u32,
    /// This process's rank on its node, when the launcher says.
    pub local_rank: Option<u32>,
    /// Where rank 0 listens; `None` only for a job of one process.
    pub master: Option<Master>,
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// The whole cluster is known: run task `index` of `job`.
    Task {
        /// The cluster, normalized for dflow (a TF `chief` is `worker` 0).
        cluster: ClusterSpec,
        /// This task's job.
        job: String,
        /// This task's index.
        index: u32,
    },
    /// A TensorFlow evaluator task: dflow's chief evaluates on the held-out split itself, so
    /// this process has nothing to do.
    Evaluator,
    /// Only the rank is known; the cluster comes from registration with rank 0.
    Ranked(Ranked),
}

/// An identity and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The launcher's variables that gave it.
    pub source: Source,
    /// What was read, for the start-up line (`RANK=1, WORLD_SIZE=2, ...`).
    pub detail: String,
    /// The place in the job.
    pub place: Place,
}

impl Identity {
    /// Checks a rank-based identity: rank below the world size, rank 0's address known when
    /// there is more than one process.
    pub(crate) fn checked(self) -> Result<Identity, IdentityError> {
        if let Place::Ranked(r) = &self.place {
            let err = |problem: String| IdentityError::Invalid {
                launcher: self.source,
                problem,
            };
            if r.world_size == 0 {
                return Err(err("the world size is 0".into()));
            }
            if r.rank >= r.world_size {
                return Err(err(format!(
                    "rank {} is not below the world size {}",
                    r.rank, r.world_size
                )));
            }
            if r.master.is_none() && r.world_size > 1 {
                return Err(err(format!(
                    "{} processes but no address for rank 0: set MASTER_ADDR (and MASTER_PORT, default {DEFAULT_MASTER_PORT}) to rank 0's host",
                    r.world_size
                )));
            }
        }
        Ok(self)
    }

    /// The start-up line: `identity from SOURCE: DETAIL`.
    pub fn describe(&self) -> String {
        format!("identity from {}: {}", self.source, self.detail)
    }
}

/// A launcher's variables are present but unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The variables of `source` are inconsistent or malformed.
    #[error("{launcher}: {problem}")]
    Invalid {
        /// Whose variables.
        launcher: Source,
        /// What is wrong and what to do.
        problem: String,
    },
}

/// The identity the environment gives, in the precedence above; `None` when no launcher's
/// variables are set.
pub fn from_env(env: &dyn Env) -> Result<Option<Identity>, IdentityError> {
    if let Some(id) = tf_config::detect(env)? {
        return Ok(Some(id));
    }
    if let Some(id) = torchrun::detect(env)? {
        return Ok(Some(id));
    }
    if let Some(id) = slurm::detect(env)? {
        return Ok(Some(id));
    }
    mpi::detect(env)
}

/// Parses a non-negative integer variable; the error names it.
pub(crate) fn parse_u32(name: &str, value: &str) -> Result<u32, String> {
    value
        .trim()
        .parse()
        .map_err(|_| format!("{name}={value:?} is not a non-negative integer"))
}

/// Rank 0's address from `MASTER_ADDR`/`MASTER_PORT`, else `default_host` with
/// [`DEFAULT_MASTER_PORT`] (or `MASTER_PORT`).
pub(crate) fn master_from(
    env: &dyn Env,
    default_host: Option<&str>,
) -> Result<Option<Master>, String> {
    master_named(env, "MASTER_ADDR", "MASTER_PORT", default_host)
}

/// Like [`master_from`] with the variable names given (`PET_MASTER_ADDR`, ...).
pub(crate) fn master_named(
    env: &dyn Env,
    addr_var: &str,
    port_var: &str,
    default_host: Option<&str>,
) -> Result<Option<Master>, String> {
    let host = match env.get(addr_var) {
        Some(h) if !h.trim().is_empty() => h.trim().to_string(),
        _ => match default_host {
            Some(h) => h.to_string(),
            None => return Ok(None),
        },
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .map(str::to_string)
        .unwrap_or(host);
    if host.contains(|c: char| c.is_whitespace() || c == '/') {
        return Err(format!(
            "{addr_var}={host:?} is not a host name or IP address"
        ));
    }
    let port = match env.get(port_var) {
        Some(p) => {
            let n = parse_u32(port_var, &p)?;
            match u16::try_from(n) {
                Ok(p) if p > 0 => p,
                _ => return Err(format!("{port_var}={p:?} is not a port from 1 to 65535")),
            }
        }
        None => DEFAULT_MASTER_PORT,
    };
    Ok(Some(Master { host, port }))
}

/// An [`Env`] over fixed pairs, for tests.
#[cfg(test)]
pub(crate) fn test_env(vars: &[(&str, &str)]) -> impl Env {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precedence_is_tf_config_then_torchrun_then_slurm_then_mpi() {
        let tf =
            r#"{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}"#;
        let all = [
            ("TF_CONFIG", tf),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_NODELIST", "n[1-2]"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ];
        let sources = [
            Source::TfConfig,
            Source::Torchrun,
            Source::Slurm,
            Source::OpenMpi,
        ];
        for (skip, want) in [0usize, 1, 4, 7].into_iter().zip(sources) {
            let env = test_env(&all[skip..]);
            let id = from_env(&env).unwrap().unwrap();
            assert_eq!(id.source, want, "{:?}", &all[skip..]);
            assert!(id.describe().starts_with("identity from "));
        }
        assert_eq!(from_env(&test_env(&[("PATH", "/bin")])).unwrap(), None);
    }

    #[test]
    fn master_address_forms() {
        let env = test_env(&[("MASTER_ADDR", "[::1]"), ("MASTER_PORT", "7")]);
        let m = master_from(&env, None).unwrap().unwrap();
        assert_eq!(m.address(), "[::1]:7");
        let env = test_env(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "70000")]);
        assert!(master_from(&env, None).unwrap_err().contains("MASTER_PORT"));
        let env = test_env(&[("MASTER_PORT", "0")]);
        assert!(master_from(&env, Some("x")).is_err());
        assert_eq!(master_from(&test_env(&[]), None).unwrap(), None);
    }
}
