//! Slurm: `srun` gives every task `SLURM_PROCID` (its rank), `SLURM_NTASKS` (the world size),
//! `SLURM_LOCALID` (its rank on the node), `SLURM_STEP_NODELIST` (the step's nodes, as a
//! compressed host list) and `SLURM_STEP_TASKS_PER_NODE` (tasks on each node, compressed).
//!
//! Slurm hands out no address: rank 0 is on the first node of the step's node list, so that
//! node (or `MASTER_ADDR` when set, as sbatch scripts written for PyTorch do) is where the
//! others register, at `MASTER_PORT` (default [`super::DEFAULT_MASTER_PORT`]).
//!
//! The formats, from the srun(1)/sbatch(1) manual pages (section "OUTPUT ENVIRONMENT
//! VARIABLES") and the hostlist syntax of scontrol(1) ("scontrol show hostnames"):
//! - a host list is comma-separated items; an item may carry bracketed ranges and single
//!   numbers, e.g. `n[1-2],m5,o[3-4,6,7-9]` is n1 n2 m5 o3 o4 o6 o7 o8 o9, and zero padding is
//!   kept (`tux[008-010]` is tux008 tux009 tux010);
//! - `SLURM_TASKS_PER_NODE`/`SLURM_STEP_TASKS_PER_NODE`: "If two or more consecutive nodes are
//!   to have the same task count, that count is followed by "(x#)" where "#" is the repetition
//!   count", e.g. `2(x3),1` (three nodes with two tasks, then one with one).

use super::{master_from, parse_u32, Env, Identity, IdentityError, Place, Ranked, Source};

/// Longest host list expanded (a typo such as `n[1-99999999]` must not take the memory).
pub const MAX_HOSTS: usize = 100_000;

/// Expands a Slurm compressed host list: `n[1-2],m5,o[3-4,6,7-9]` →
/// `[n1, n2, m5, o3, o4, o6, o7, o8, o9]`.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            return Err(format!("host list {list:?} has an empty entry"));
        }
        expand_item(item, &mut hosts, list)?;
        if hosts.len() > MAX_HOSTS {
            return Err(format!(
                "host list {list:?} has more than {MAX_HOSTS} hosts"
            ));
        }
    }
    Ok(hosts)
}

/// Splits at commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0u32, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("host list {list:?}: nested '['")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("host list {list:?}: ']' without '['")),
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("host list {list:?}: '[' without ']'"));
    }
    items.push(&list[start..]);
    Ok(items)
}

/// Expands one item (`o[3-4,6]`, `rack[1-2]-n[01-02]`, `m5`), appending to `out`.
fn expand_item(item: &str, out: &mut Vec<String>, list: &str) -> Result<(), String> {
    let Some(open) = item.find('[') else {
        out.push(item.to_string());
        return Ok(());
    };
    let close = item[open..]
        .find(']')
        .map(|c| open + c)
        .ok_or_else(|| format!("host list {list:?}: '[' without ']' in {item:?}"))?;
    let (prefix, body, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    for part in body.split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let bad = || format!("host list {list:?}: {part:?} in {item:?} is not N or N-M");
        if lo.is_empty() || !lo.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        if hi.is_empty() || !hi.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let width = lo.len();
        let (a, b): (u64, u64) = (
            lo.parse().map_err(|_| bad())?,
            hi.parse().map_err(|_| bad())?,
        );
        if b < a {
            return Err(format!("host list {list:?}: range {part:?} runs backwards"));
        }
        if b - a > MAX_HOSTS as u64 {
            return Err(format!(
                "host list {list:?} has more than {MAX_HOSTS} hosts"
            ));
        }
        for n in a..=b {
            let head = format!("{prefix}{n:0width$}");
            // The rest may hold another bracket group (`rack[1-2]-n[01-02]`).
            let mut tails = Vec::new();
            expand_item(rest, &mut tails, list)?;
            for t in tails {
                out.push(format!("{head}{t}"));
            }
            if out.len() > MAX_HOSTS {
                return Err(format!(
                    "host list {list:?} has more than {MAX_HOSTS} hosts"
                ));
            }
        }
    }
    Ok(())
}

/// Expands `SLURM_TASKS_PER_NODE`'s form: `3(x2),2,1` → `[3, 3, 2, 1]`.
pub fn expand_tasks_per_node(text: &str) -> Result<Vec<u32>, String> {
    let mut counts = Vec::new();
    for part in text.split(',') {
        let bad = || format!("tasks per node {text:?}: {part:?} is not N or N(xR)");
        let (count, repeat) = match part.split_once('(') {
            None => (part, "1"),
            Some((count, rep)) => {
                let rep = rep
                    .strip_prefix('x')
                    .and_then(|r| r.strip_suffix(')'))
                    .ok_or_else(bad)?;
                (count, rep)
            }
        };
        let count: u32 = count.parse().map_err(|_| bad())?;
        let repeat: usize = repeat.parse().map_err(|_| bad())?;
        if repeat == 0 || counts.len() + repeat > MAX_HOSTS {
            return Err(bad());
        }
        counts.extend(std::iter::repeat(count).take(repeat));
    }
    Ok(counts)
}

/// The identity `srun` gives, if `SLURM_PROCID` is set.
pub fn detect(env: &dyn Env) -> Result<Option<Identity>, IdentityError> {
    let Some(procid) = env.get("SLURM_PROCID") else {
        return Ok(None);
    };
    let err = |problem: String| IdentityError::Invalid {
        launcher: Source::Slurm,
        problem,
    };
    let rank = parse_u32("SLURM_PROCID", &procid).map_err(err)?;
    let ntasks = env
        .get("SLURM_NTASKS")
        .or_else(|| env.get("SLURM_NPROCS"))
        .ok_or_else(|| {
            err("SLURM_PROCID is set but SLURM_NTASKS is not; start the tasks with srun".into())
        })?;
    let world_size = parse_u32("SLURM_NTASKS", &ntasks).map_err(err)?;
    let local_rank = match env.get("SLURM_LOCALID") {
        Some(v) => Some(parse_u32("SLURM_LOCALID", &v).map_err(err)?),
        None => None,
    };
    let nodelist = env
        .get("SLURM_STEP_NODELIST")
        .or_else(|| env.get("SLURM_JOB_NODELIST"))
        .or_else(|| env.get("SLURM_NODELIST"));
    let nodes = match &nodelist {
        Some(l) => expand_hostlist(l).map_err(err)?,
        None => Vec::new(),
    };
    let mut detail = format!("SLURM_PROCID={rank}, SLURM_NTASKS={world_size}");
    if let Some(tpn) = env
        .get("SLURM_STEP_TASKS_PER_NODE")
        .or_else(|| env.get("SLURM_TASKS_PER_NODE"))
    {
        let counts = expand_tasks_per_node(&tpn).map_err(err)?;
        let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
        if total != u64::from(world_size) {
            return Err(err(format!(
                "tasks per node {tpn:?} add up to {total}, but SLURM_NTASKS is {world_size}"
            )));
        }
        if !nodes.is_empty() && nodes.len() != counts.len() {
            return Err(err(format!(
                "tasks per node {tpn:?} lists {} nodes, the node list {} nodes",
                counts.len(),
                nodes.len()
            )));
        }
        detail.push_str(&format!(", {} node(s)", counts.len()));
    }
    // Rank 0 runs on the first node of the step (block and cyclic distributions both start there).
    let master = master_from(env, nodes.first().map(String::as_str)).map_err(err)?;
    Ok(Some(
        Identity {
            source: Source::Slurm,
            detail,
            place: Place::Ranked(Ranked {
                rank,
                world_size,
                local_rank,
                master,
            }),
        }
        .checked()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::test_env;

    #[test]
    fn expands_the_manual_examples() {
        // The example of the issue and of the Slurm hostlist documentation.
        assert_eq!(
            expand_hostlist("n[1-2],m5,o[3-4,6,7-9]").unwrap(),
            ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]
        );
        // srun(1): "SLURM_JOB_NODELIST ... tux[0-2]"-style lists keep zero padding.
        assert_eq!(
            expand_hostlist("tux[008-010]").unwrap(),
            ["tux008", "tux009", "tux010"]
        );
        assert_eq!(expand_hostlist("node1").unwrap(), ["node1"]);
        assert_eq!(
            expand_hostlist("rack[1-2]-n[01-02]").unwrap(),
            ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
        );
        assert_eq!(expand_tasks_per_node("3(x2),2,1").unwrap(), [3, 3, 2, 1]);
        // sbatch(1): "SLURM_TASKS_PER_NODE=2(x3),1 indicates that the first three nodes will
        // each execute two tasks and the fourth node will execute one task".
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
    }

    #[test]
    fn refuses_malformed_lists_with_the_offending_part() {
        for bad in [
            "n[1-2",
            "n1-2]",
            "n[a-b]",
            "n[3-1]",
            "n[1-2],,m",
            "n[[1]]",
            "n[1-99999999]",
        ] {
            let e = expand_hostlist(bad).unwrap_err();
            assert!(e.contains(bad) || e.contains("more than"), "{bad}: {e}");
        }
        for bad in ["3(x2", "3(2)", "x", "3(x0)", "", "2(x99999999)"] {
            assert!(expand_tasks_per_node(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn srun_variables_give_a_ranked_identity_with_the_first_node_as_master() {
        let env = test_env(&[
            ("SLURM_PROCID", "4"),
            ("SLURM_NTASKS", "9"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODELIST", "n[1-2],m5"),
            ("SLURM_STEP_TASKS_PER_NODE", "3(x2),3"),
        ]);
        let id = detect(&env).unwrap().unwrap();
        assert_eq!(id.source, Source::Slurm);
        let Place::Ranked(r) = id.place else {
            panic!("{:?}", id.place)
        };
        assert_eq!((r.rank, r.world_size, r.local_rank), (4, 9, Some(1)));
        let m = r.master.unwrap();
        assert_eq!(
            (m.host.as_str(), m.port),
            ("n1", super::super::DEFAULT_MASTER_PORT)
        );
    }

    #[test]
    fn master_addr_overrides_the_node_list_and_inconsistent_counts_are_refused() {
        let env = test_env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_NODELIST", "n[1-2]"),
            ("MASTER_ADDR", "10.0.0.7"),
            ("MASTER_PORT", "4000"),
        ]);
        let Place::Ranked(r) = detect(&env).unwrap().unwrap().place else {
            panic!()
        };
        let m = r.master.unwrap();
        assert_eq!((m.host.as_str(), m.port), ("10.0.0.7", 4000));
        let env = test_env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "5"),
            ("SLURM_STEP_TASKS_PER_NODE", "3(x2),2,1"),
        ]);
        let e = detect(&env).unwrap_err().to_string();
        assert!(e.contains("add up to 9, but SLURM_NTASKS is 5"), "{e}");
        let env = test_env(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "5")]);
        let e = detect(&env).unwrap_err().to_string();
        assert!(e.contains("rank 5") && e.contains("world size 5"), "{e}");
    }
}
