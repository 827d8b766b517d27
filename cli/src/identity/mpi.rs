//! MPI launchers: Open MPI's `mpirun` sets `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//! `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` and `OMPI_COMM_WORLD_NODE_RANK`
//! (mpirun(1), "Exported Environment Variables"); MPICH's Hydra `mpiexec` and Intel MPI set
//! `PMI_RANK` and `PMI_SIZE` (and `MPI_LOCALRANKID`).
//!
//! MPI hands out no address: pass rank 0's host and a port with `mpirun -x MASTER_ADDR=HOST
//! -x MASTER_PORT=PORT` (Open MPI) or `mpiexec -genv MASTER_ADDR HOST ...` (MPICH).

use super::{master_from, parse_u32, Env, Identity, IdentityError, Place, Ranked, Source};

/// The identity MPI's variables give, if `OMPI_COMM_WORLD_RANK` or `PMI_RANK` is set.
pub fn detect(env: &dyn Env) -> Result<Option<Identity>, IdentityError> {
    let (source, rank_var, size_var, local_var) = if env.get("OMPI_COMM_WORLD_RANK").is_some() {
        (
            Source::OpenMpi,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
        )
    } else if env.get("PMI_RANK").is_some() {
        (Source::Pmi, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
    } else {
        return Ok(None);
    };
    let err = |problem: String| IdentityError::Invalid {
        launcher: source,
        problem,
    };
    let rank = parse_u32(rank_var, &env.get(rank_var).unwrap_or_default()).map_err(err)?;
    let size = env
        .get(size_var)
        .ok_or_else(|| err(format!("{rank_var} is set but {size_var} is not")))?;
    let world_size = parse_u32(size_var, &size).map_err(err)?;
    let local_rank = env
        .get(local_var)
        .map(|v| parse_u32(local_var, &v).map_err(err))
        .transpose()?;
    let master = master_from(env, None).map_err(err)?;
    if master.is_none() && world_size > 1 {
        return Err(err(
            "MPI gives no address for rank 0: pass MASTER_ADDR (rank 0's host) and MASTER_PORT, e.g. `mpirun -x MASTER_ADDR=HOST -x MASTER_PORT=29500 ...`".into(),
        ));
    }
    Identity {
        source,
        detail: format!("{rank_var}={rank}, {size_var}={world_size}"),
        place: Place::Ranked(Ranked {
            rank,
            world_size,
            local_rank,
            master,
        }),
    }
    .checked()
    .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::test_env;

    #[test]
    fn open_mpi_variables() {
        let env = test_env(&[
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_COMM_WORLD_NODE_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]);
        let id = detect(&env).unwrap().unwrap();
        assert_eq!(id.source, Source::OpenMpi);
        let Place::Ranked(r) = id.place else { panic!() };
        assert_eq!((r.rank, r.world_size, r.local_rank), (2, 4, Some(0)));
    }

    #[test]
    fn pmi_variables_and_the_missing_master() {
        let env = test_env(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MASTER_ADDR", "h"),
        ]);
        let id = detect(&env).unwrap().unwrap();
        assert_eq!(id.source, Source::Pmi);
        let Place::Ranked(r) = id.place else { panic!() };
        assert_eq!((r.rank, r.world_size, r.local_rank), (1, 2, Some(1)));
        let e = detect(&test_env(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("mpirun -x MASTER_ADDR"), "{e}");
        let e = detect(&test_env(&[("PMI_RANK", "1")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("PMI_SIZE is not"), "{e}");
    }
}
