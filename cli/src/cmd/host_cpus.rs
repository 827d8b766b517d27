//! The CPUs of a host shared among the tasks of a job that run there: which CPUs each task is
//! bound to and how many compute threads it runs.
//!
//! A task's kernels run on a pool of threads. When several tasks share a host, a pool of one
//! thread per CPU in every task, and every task free to run on every CPU, put more runnable
//! threads on a CPU than it has: an idle pool thread polls (`sched_yield`) on a CPU another
//! task's thread needs, a node handed to the pool wakes a thread that then waits for a CPU,
//! and the tasks' threads migrate between the CPUs. So, as `mpirun` binds ranks to cores and
//! torchrun sets `OMP_NUM_THREADS=1` for several processes per node, each of `L` tasks on a
//! host of `C` CPUs is bound to its own `C / L` of them (task `k` of the host to CPU `k mod C`
//! when `L > C`) and runs one compute thread per CPU it is bound to
//! (`--cpu-binding none`: unbound, `C / L` threads), at least [`MIN_COMPUTE_THREADS`] unless
//! `--compute-threads` asks for fewer. Measured on this 2-CPU machine (BENCHMARKS.md "CPU
//! binding", `tests/planner/cpu_binding.sh`): the 2×32 GPT's jobs of 2, 4 and 8 processes take
//! 1.20–1.44× longer a step (median) unbound, idle; the bundled GPT at dp=2 the same (0.99–1.05).

use anyhow::{bail, Context};
use dflow_graph::ClusterSpec;

/// Whether the tasks of a host are bound to CPUs (`dflow run --cpu-binding`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CpuBinding {
    /// Bind when several tasks share the host (each to its share of the CPUs); a task alone
    /// on its host is left free.
    #[default]
    Auto,
    /// Never bind.
    None,
}

/// The host part of a cluster address (`host:port`, `[v6]:port`).
fn host_of(address: &str) -> &str {
    address.rsplit_once(':').map_or(address, |(host, _)| host)
}

/// Where a task sits among the tasks of its host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostShare {
    /// Its position among them (in the cluster's order: by job, then index).
    pub local_index: usize,
    /// How many tasks the host runs (at least 1).
    pub local_tasks: usize,
}

impl HostShare {
    /// A task alone on its host.
    pub const ALONE: HostShare = HostShare {
        local_index: 0,
        local_tasks: 1,
    };

    /// Task `index` of `job` among the tasks of `cluster` (every job, ps included) whose
    /// address names the same host; alone when the task is not in the cluster.
    pub fn in_cluster(cluster: &ClusterSpec, job: &str, index: u32) -> HostShare {
        let Some(own) = cluster.address(job, index).map(host_of) else {
            return HostShare::ALONE;
        };
        let mut share = HostShare {
            local_index: 0,
            local_tasks: 0,
        };
        for j in cluster.jobs() {
            for (i, address) in cluster.tasks(j) {
                if host_of(address) != own {
                    continue;
                }
                if j == job && i == index {
                    share.local_index = share.local_tasks;
                }
                share.local_tasks += 1;
            }
        }
        share
    }

    /// As the launcher that started this process says: its local rank and torchrun's
    /// `LOCAL_WORLD_SIZE` or Open MPI's `OMPI_COMM_WORLD_LOCAL_SIZE` (a task that learns the
    /// cluster by registration only); alone when the launcher says neither.
    pub fn from_launcher(local_rank: Option<u32>) -> HostShare {
        let size = ["LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"]
            .iter()
            .find_map(|v| std::env::var(v).ok());
        HostShare::of_local_rank(local_rank, size.as_deref())
    }

    /// Local rank `local_rank` of the `size` (a launcher's variable, unparsed) tasks of a host;
    /// alone when either is missing, `size` is not a positive number or the rank is not below it.
    pub fn of_local_rank(local_rank: Option<u32>, size: Option<&str>) -> HostShare {
        let size = size
            .and_then(|s| s.trim().parse::<usize>().ok())
            .filter(|&n| n > 0);
        match (local_rank, size) {
            (Some(r), Some(n)) if (r as usize) < n => HostShare {
                local_index: r as usize,
                local_tasks: n,
            },
            _ => HostShare::ALONE,
        }
    }
}

/// The CPUs task `share` is bound to under `binding`, of `cpus` (the CPUs the process may
/// use); `None` when it runs unbound (a task alone on its host, `--cpu-binding none`).
pub fn bound_cpus(binding: CpuBinding, share: HostShare, cpus: &[usize]) -> Option<Vec<usize>> {
    let (k, l, c) = (share.local_index, share.local_tasks, cpus.len());
    if binding == CpuBinding::None || l < 2 || c == 0 {
        return None;
    }
    if l > c {
        return Some(vec![cpus[k % c]]);
    }
    Some(cpus[k * c / l..(k + 1) * c / l].to_vec())
}

/// The fewest compute threads a task is given unless it asks for fewer: a collective kernel
/// holds the thread that runs it until its peers join, and the peers may wait for a value this
/// task has yet to send (an evaluation step's `Send` beside a tensor-parallel all-reduce):
/// with one thread the task would never send it. Measured: the bundled GPT at tp=2 in 2
/// processes of one thread each hung at its evaluation step.
pub const MIN_COMPUTE_THREADS: usize = 2;

/// Compute threads for a task: `requested` when given (`--compute-threads N`, at least 1: one
/// thread runs the nodes in the order the planner's memory accounting assumes, and may hang a
/// job as [`MIN_COMPUTE_THREADS`] says), else one per CPU it is bound to, else (unbound) the
/// `cpus` shared among the host's tasks, never fewer than [`MIN_COMPUTE_THREADS`].
pub fn compute_threads(
    requested: Option<usize>,
    bound: Option<&[usize]>,
    cpus: usize,
    share: HostShare,
) -> usize {
    match (requested, bound) {
        (Some(n), _) => n.max(1),
        (None, Some(b)) => b.len().max(MIN_COMPUTE_THREADS),
        (None, None) => (cpus / share.local_tasks.max(1)).max(MIN_COMPUTE_THREADS),
    }
}

/// The CPUs this process may run on, in ascending order.
pub fn allowed_cpus() -> anyhow::Result<Vec<usize>> {
    let set = rustix::thread::sched_getaffinity(None).context("reading this process's CPU set")?;
    Ok((0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .collect())
}

/// Binds the calling thread, and every thread it creates afterwards, to `cpus`.
pub fn bind_to(cpus: &[usize]) -> anyhow::Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    for &cpu in cpus {
        if cpu >= rustix::thread::CpuSet::MAX_CPU {
            bail!(
                "CPU {cpu} is out of range (this system names at most {} CPUs)",
                rustix::thread::CpuSet::MAX_CPU
            );
        }
        set.set(cpu);
    }
    rustix::thread::sched_setaffinity(None, &set)
        .with_context(|| format!("binding to CPUs {cpus:?}"))
}

/// Binds this process (called before it starts any thread) as task `share` of its host under
/// `binding`, and returns its compute threads (`requested` or as [`compute_threads`] says).
/// A system that forbids binding (a container's policy) leaves the task unbound and says so
/// on stderr, naming `task`.
pub fn bind_task(
    task: &str,
    binding: CpuBinding,
    share: HostShare,
    requested: Option<usize>,
) -> usize {
    let cpus = match allowed_cpus() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{task}: {e:#}; running unbound");
            return compute_threads(requested, None, 1, share);
        }
    };
    let bound = bound_cpus(binding, share, &cpus);
    if let Some(b) = &bound {
        if let Err(e) = bind_to(b) {
            eprintln!("{task}: {e:#}; running unbound (--cpu-binding none says so quietly)");
            return compute_threads(requested, None, cpus.len(), share);
        }
    }
    compute_threads(requested, bound.as_deref(), cpus.len(), share)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn cluster(jobs: &[(&str, &[&str])]) -> ClusterSpec {
        let mut map = BTreeMap::new();
        for (job, addresses) in jobs {
            let tasks: BTreeMap<u32, String> = addresses
                .iter()
                .enumerate()
                .map(|(i, a)| (i as u32, a.to_string()))
                .collect();
            map.insert(job.to_string(), tasks);
        }
        ClusterSpec::new(map).unwrap()
    }

    fn share(local_index: usize, local_tasks: usize) -> HostShare {
        HostShare {
            local_index,
            local_tasks,
        }
    }

    #[test]
    fn a_tasks_place_on_its_host_counts_every_job_in_the_clusters_order() {
        let c = cluster(&[
            (
                "worker",
                &["10.0.0.1:1000", "10.0.0.1:1001", "10.0.0.2:1000"],
            ),
            ("ps", &["10.0.0.1:2000"]),
        ]);
        // ps sorts before worker.
        assert_eq!(HostShare::in_cluster(&c, "ps", 0), share(0, 3));
        assert_eq!(HostShare::in_cluster(&c, "worker", 0), share(1, 3));
        assert_eq!(HostShare::in_cluster(&c, "worker", 1), share(2, 3));
        assert_eq!(HostShare::in_cluster(&c, "worker", 2), share(0, 1));
        assert_eq!(HostShare::in_cluster(&c, "worker", 7), HostShare::ALONE);
        let v6 = cluster(&[("worker", &["[::1]:1000", "[::1]:1001", "127.0.0.1:5"])]);
        assert_eq!(HostShare::in_cluster(&v6, "worker", 1), share(1, 2));
    }

    #[test]
    fn a_launchers_local_rank_and_size_place_the_task_and_bad_ones_leave_it_alone() {
        assert_eq!(HostShare::of_local_rank(Some(1), Some("4")), share(1, 4));
        assert_eq!(HostShare::of_local_rank(Some(0), Some(" 2\n")), share(0, 2));
        for (rank, size) in [
            (None, Some("4")),
            (Some(1), None),
            (Some(4), Some("4")),
            (Some(0), Some("0")),
            (Some(0), Some("many")),
            (Some(0), Some("-2")),
        ] {
            assert_eq!(
                HostShare::of_local_rank(rank, size),
                HostShare::ALONE,
                "{rank:?} {size:?}"
            );
        }
    }

    #[test]
    fn tasks_sharing_a_host_are_bound_to_their_share_of_its_cpus() {
        let two = [0, 1];
        assert_eq!(bound_cpus(CpuBinding::Auto, share(0, 1), &two), None);
        assert_eq!(
            bound_cpus(CpuBinding::Auto, share(1, 2), &two),
            Some(vec![1])
        );
        assert_eq!(bound_cpus(CpuBinding::None, share(1, 2), &two), None);
        // More tasks than CPUs: round robin.
        let placed: Vec<_> = (0..4)
            .map(|k| bound_cpus(CpuBinding::Auto, share(k, 4), &two))
            .collect();
        assert_eq!(
            placed,
            [Some(vec![0]), Some(vec![1]), Some(vec![0]), Some(vec![1])]
        );
        // Fewer tasks than CPUs: a contiguous share each, of the CPUs the process may use.
        let eight = [2, 3, 4, 5, 6, 7, 8, 9];
        assert_eq!(
            bound_cpus(CpuBinding::Auto, share(1, 2), &eight),
            Some(vec![6, 7, 8, 9])
        );
        assert_eq!(
            bound_cpus(CpuBinding::Auto, share(2, 3), &eight),
            Some(vec![7, 8, 9])
        );
        assert_eq!(bound_cpus(CpuBinding::Auto, share(0, 2), &[]), None);
    }

    #[test]
    fn threads_are_the_bound_cpus_or_the_hosts_share_unless_asked() {
        let alone = HostShare::ALONE;
        assert_eq!(compute_threads(None, None, 4, alone), 4);
        assert_eq!(compute_threads(None, None, 8, share(0, 2)), 4);
        assert_eq!(compute_threads(None, None, 2, share(0, 8)), 2, "at least 2");
        assert_eq!(compute_threads(None, Some(&[4, 5, 6]), 16, share(0, 4)), 3);
        assert_eq!(compute_threads(None, Some(&[1]), 2, share(0, 2)), 2);
        assert_eq!(compute_threads(Some(3), Some(&[1]), 2, share(0, 8)), 3);
        assert_eq!(compute_threads(Some(1), None, 2, alone), 1, "asked for");
        assert_eq!(compute_threads(Some(0), None, 2, alone), 1);
        assert_eq!(
            compute_threads(None, None, 1, alone),
            2,
            "at least 2 unless asked"
        );
    }

    #[test]
    fn binding_to_an_impossible_cpu_is_an_error_not_a_panic() {
        let e = bind_to(&[usize::MAX]).unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
        assert!(!allowed_cpus().unwrap().is_empty());
    }
}
