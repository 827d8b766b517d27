//! torchrun, Kubeflow's PyTorchJob and Ray Train: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`.
//!
//! - torchrun ("torchrun (Elastic Launch)", section "Environment Variables") sets for every
//!   worker `LOCAL_RANK`, `RANK`, `GROUP_RANK`, `ROLE_RANK`, `LOCAL_WORLD_SIZE`, `WORLD_SIZE`,
//!   `ROLE_WORLD_SIZE`, `MASTER_ADDR` ("the FQDN of the host that is running worker with rank
//!   0"), `MASTER_PORT`, `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_MAX_RESTARTS`,
//!   `TORCHELASTIC_RUN_ID`.
//! - PyTorchJob (Kubeflow training operator) sets in every pod `MASTER_ADDR` (the Master
//!   replica's service, e.g. `digits-master-0`), `MASTER_PORT`, `WORLD_SIZE`, `RANK` (the
//!   Master is rank 0, Worker `i` is rank `i + 1`) and `PYTHONUNBUFFERED`; with `nprocPerNode`
//!   or an elastic policy it sets the torchrun arguments as `PET_NNODES`, `PET_NPROC_PER_NODE`,
//!   `PET_NODE_RANK`, `PET_MASTER_ADDR`, `PET_MASTER_PORT` (`PET_` + the flag's name).
//! - Ray Train's Torch backend sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//!   `MASTER_PORT` in each training worker.
//!
//! dflow runs one process per rank, so under the `PET_*` form a pod is one rank:
//! `rank = PET_NODE_RANK × PET_NPROC_PER_NODE + LOCAL_RANK`.

use super::{master_named, parse_u32, Env, Identity, IdentityError, Place, Ranked, Source};

/// The identity torchrun-style variables give, if `RANK`, `WORLD_SIZE` or `PET_NODE_RANK` is set.
pub fn detect(env: &dyn Env) -> Result<Option<Identity>, IdentityError> {
    if env.get("RANK").is_some() || env.get("WORLD_SIZE").is_some() {
        return plain(env).map(Some);
    }
    if env.get("PET_NODE_RANK").is_some() || env.get("PET_NNODES").is_some() {
        return pet(env).map(Some);
    }
    Ok(None)
}

fn local_rank(
    env: &dyn Env,
    err: &dyn Fn(String) -> IdentityError,
) -> Result<Option<u32>, IdentityError> {
    env.get("LOCAL_RANK")
        .map(|v| parse_u32("LOCAL_RANK", &v).map_err(err))
        .transpose()
}

fn plain(env: &dyn Env) -> Result<Identity, IdentityError> {
    let err = |problem: String| IdentityError::Invalid {
        launcher: Source::Torchrun,
        problem,
    };
    let (Some(rank), Some(world)) = (env.get("RANK"), env.get("WORLD_SIZE")) else {
        return Err(err(
            "set both RANK and WORLD_SIZE (only one of them is set)".into(),
        ));
    };
    let rank = parse_u32("RANK", &rank).map_err(err)?;
    let world_size = parse_u32("WORLD_SIZE", &world).map_err(err)?;
    let local_rank = local_rank(env, &err)?;
    let master = master_named(env, "MASTER_ADDR", "MASTER_PORT", None).map_err(err)?;
    let detail = format!(
        "RANK={rank}, WORLD_SIZE={world_size}{}{}",
        local_rank
            .map(|l| format!(", LOCAL_RANK={l}"))
            .unwrap_or_default(),
        master
            .as_ref()
            .map(|m| format!(", rank 0 at {}", m.address()))
            .unwrap_or_default()
    );
    Identity {
        source: Source::Torchrun,
        detail,
        place: Place::Ranked(Ranked {
            rank,
            world_size,
            local_rank,
            master,
        }),
    }
    .checked()
}

fn pet(env: &dyn Env) -> Result<Identity, IdentityError> {
    let err = |problem: String| IdentityError::Invalid {
        launcher: Source::PyTorchJobPet,
        problem,
    };
    let node_rank = env
        .get("PET_NODE_RANK")
        .ok_or_else(|| err("PET_NNODES is set but PET_NODE_RANK is not".into()))?;
    let node_rank = parse_u32("PET_NODE_RANK", &node_rank).map_err(err)?;
    let nnodes = env
        .get("PET_NNODES")
        .ok_or_else(|| err("PET_NODE_RANK is set but PET_NNODES is not".into()))?;
    if nnodes.contains(':') {
        return Err(err(format!(
            "PET_NNODES={nnodes:?} is an elastic range; dflow needs a fixed number of pods (set minReplicas = maxReplicas)"
        )));
    }
    let nnodes = parse_u32("PET_NNODES", &nnodes).map_err(err)?;
    let nproc = match env.get("PET_NPROC_PER_NODE") {
        None => 1,
        Some(v) => parse_u32("PET_NPROC_PER_NODE", &v).map_err(|_| {
            err(format!("PET_NPROC_PER_NODE={v:?}: dflow runs one process per rank; set nprocPerNode to a number (1: one dflow per pod)"))
        })?,
    };
    let local_rank = local_rank(env, &err)?;
    if nproc > 1 && local_rank.is_none() {
        return Err(err(format!(
            "PET_NPROC_PER_NODE={nproc} but no LOCAL_RANK: start dflow under torchrun, or set nprocPerNode: 1"
        )));
    }
    let rank = node_rank
        .checked_mul(nproc)
        .and_then(|r| r.checked_add(local_rank.unwrap_or(0)))
        .ok_or_else(|| err("the rank overflows".into()))?;
    let world_size = nnodes
        .checked_mul(nproc)
        .ok_or_else(|| err("the world size overflows".into()))?;
    let master = match master_named(env, "PET_MASTER_ADDR", "PET_MASTER_PORT", None).map_err(err)? {
        Some(m) => Some(m),
        None => master_named(env, "MASTER_ADDR", "MASTER_PORT", None).map_err(err)?,
    };
    Identity {
        source: Source::PyTorchJobPet,
        detail: format!("PET_NODE_RANK={node_rank}, PET_NNODES={nnodes}, PET_NPROC_PER_NODE={nproc}: rank {rank} of {world_size}"),
        place: Place::Ranked(Ranked {
            rank,
            world_size,
            local_rank,
            master,
        }),
    }
    .checked()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::test_env;

    fn ranked(vars: &[(&str, &str)]) -> Ranked {
        match detect(&test_env(vars)).unwrap().unwrap().place {
            Place::Ranked(r) => r,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn torchrun_worker_variables() {
        // What `torchrun --nnodes 2 --nproc-per-node 2 --master-addr node0 --master-port 29400`
        // gives the second process of the second node.
        let r = ranked(&[
            ("LOCAL_RANK", "1"),
            ("RANK", "3"),
            ("GROUP_RANK", "1"),
            ("ROLE_RANK", "3"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("WORLD_SIZE", "4"),
            ("ROLE_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "0"),
            ("TORCHELASTIC_RUN_ID", "none"),
        ]);
        assert_eq!((r.rank, r.world_size, r.local_rank), (3, 4, Some(1)));
        assert_eq!(r.master.unwrap().address(), "node0:29400");
    }

    #[test]
    fn pytorchjob_worker_variables() {
        // A PyTorchJob with one Master and two Workers: Worker 1's pod.
        let r = ranked(&[
            ("MASTER_PORT", "23456"),
            ("MASTER_ADDR", "digits-master-0"),
            ("WORLD_SIZE", "3"),
            ("RANK", "2"),
            ("PYTHONUNBUFFERED", "1"),
        ]);
        assert_eq!((r.rank, r.world_size, r.local_rank), (2, 3, None));
        assert_eq!(r.master.unwrap().address(), "digits-master-0:23456");
    }

    #[test]
    fn pytorchjob_pet_variables() {
        let r = ranked(&[
            ("PET_NNODES", "3"),
            ("PET_NPROC_PER_NODE", "1"),
            ("PET_NODE_RANK", "2"),
            ("PET_MASTER_ADDR", "digits-master-0"),
            ("PET_MASTER_PORT", "23456"),
        ]);
        assert_eq!((r.rank, r.world_size), (2, 3));
        assert_eq!(r.master.unwrap().address(), "digits-master-0:23456");
        let e = detect(&test_env(&[("PET_NNODES", "1:4"), ("PET_NODE_RANK", "0")])).unwrap_err();
        assert!(e.to_string().contains("elastic range"), "{e}");
        let e = detect(&test_env(&[
            ("PET_NNODES", "2"),
            ("PET_NODE_RANK", "0"),
            ("PET_NPROC_PER_NODE", "auto"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("nprocPerNode"), "{e}");
    }

    #[test]
    fn inconsistent_variables_are_refused() {
        let e = detect(&test_env(&[("RANK", "0")])).unwrap_err().to_string();
        assert!(e.contains("set both RANK and WORLD_SIZE"), "{e}");
        let e = detect(&test_env(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("rank 2 is not below the world size 2"), "{e}");
        let e = detect(&test_env(&[("RANK", "1"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("set MASTER_ADDR"), "{e}");
        let e = detect(&test_env(&[("RANK", "x"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK=\"x\""), "{e}");
        // One process needs no master.
        let r = ranked(&[("RANK", "0"), ("WORLD_SIZE", "1")]);
        assert_eq!(r.master, None);
    }
}
