//! How a task's name appears in certificates and file names.
//!
//! A task `/job:worker/replica:0/task:1` (or `worker:1`) is the DNS name `worker-1.dflow` in
//! its certificate's subject alternative name, and its files are `worker-1.crt` and
//! `worker-1.key`. TLS checks DNS names, so the client side of every connection verifies that
//! the peer it dialled presents the certificate of the task it meant to reach, and the
//! accepting side checks that a peer's certificate names the task its Hello claims.

/// The DNS zone under which task names live in certificates.
pub const DNS_SUFFIX: &str = "dflow";

/// A task name that cannot be written as a certificate name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("task name `{task}` cannot name a certificate: {problem}")]
pub struct NameError {
    /// The task name.
    pub task: String,
    /// What is wrong.
    pub problem: String,
}

/// `(job, index)` of `/job:J/replica:R/task:I` (replica 0 only, or absent) or `J:I`.
pub fn parse_task(task: &str) -> Option<(String, u32)> {
    if let Some(rest) = task.strip_prefix("/job:") {
        let mut job = None;
        let mut index = None;
        for (i, part) in rest.split('/').enumerate() {
            if i == 0 {
                job = Some(part);
            } else if let Some(r) = part.strip_prefix("replica:") {
                if r != "0" {
                    return None;
                }
            } else if let Some(t) = part.strip_prefix("task:") {
                index = t.parse::<u32>().ok();
            } else {
                return None;
            }
        }
        return Some((job?.to_string(), index?)).filter(|(j, _)| !j.is_empty());
    }
    let (job, index) = task.rsplit_once(':')?;
    let index = index.parse::<u32>().ok()?;
    (!job.is_empty() && !job.contains('/')).then(|| (job.to_string(), index))
}

/// The label of `task`: `job-index` for a cluster task, else the name itself when it is a
/// valid DNS label (letters, digits, `-` and `_`, at most 63 bytes, not starting or ending
/// with `-`). This is also the stem of the task's certificate files.
pub fn task_label(task: &str) -> Result<String, NameError> {
    let err = |problem: &str| NameError {
        task: task.to_string(),
        problem: problem.to_string(),
    };
    let label = match parse_task(task) {
        Some((job, index)) => format!("{job}-{index}"),
        None => task.to_string(),
    };
    if label.is_empty() {
        return Err(err("it is empty"));
    }
    if label.len() > 63 {
        return Err(err("its label is longer than 63 bytes"));
    }
    if !label
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(err(
            "use a `/job:J/replica:0/task:I` or `J:I` name whose job has only letters, digits, `-` and `_`",
        ));
    }
    if label.starts_with('-') || label.ends_with('-') {
        return Err(err("its label may not start or end with `-`"));
    }
    Ok(label.to_ascii_lowercase())
}

/// The DNS name of `task` in certificates: `label.dflow` (see [`task_label`]).
pub fn task_dns_name(task: &str) -> Result<String, NameError> {
    Ok(format!("{}.{DNS_SUFFIX}", task_label(task)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_tasks_map_to_job_index() {
        assert_eq!(
            task_dns_name("/job:worker/replica:0/task:1").unwrap(),
            "worker-1.dflow"
        );
        assert_eq!(task_dns_name("/job:ps/task:0").unwrap(), "ps-0.dflow");
        assert_eq!(task_dns_name("ps:3").unwrap(), "ps-3.dflow");
        assert_eq!(task_label("my_job:2").unwrap(), "my_job-2");
        assert_eq!(task_label("bench-a").unwrap(), "bench-a");
    }

    #[test]
    fn unusable_names_are_errors() {
        for bad in [
            "",
            "/job:a b/task:0",
            "a.b",
            "-x",
            "/job:w/replica:1/task:0",
            "x/y",
        ] {
            assert!(task_label(bad).is_err(), "{bad}");
        }
        let e = task_label("a.b").unwrap_err();
        assert!(e.to_string().contains("`a.b`"), "{e}");
    }
}
