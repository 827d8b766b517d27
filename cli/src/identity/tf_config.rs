//! `TF_CONFIG`, as the Kubeflow TFJob operator and TensorFlow's own tooling set it:
//! `{"cluster": {...}, "task": {"type": T, "index": I}, "environment": "cloud"}`.
//!
//! Task types (TensorFlow's `tf.distribute.cluster_resolver.TFConfigClusterResolver` and
//! `tf.estimator.RunConfig`): `chief` (the coordinator that also trains, as under
//! MultiWorkerMirroredStrategy), `master` (its older name; with `"environment": "cloud"` the
//! master is the chief), `worker`, `ps`, `evaluator` (a side task that is not part of the
//! training cluster).
//!
//! dflow's chief is `/job:worker/task:0`. A cluster with a `chief` (or `master`) job is
//! normalized so that TF's chief *is* dflow's chief: it becomes worker 0 and TF's worker `i`
//! (the `i`-th by index) becomes worker `i + 1`. Every task reads the same `TF_CONFIG`, so every
//! task renames the same way. An `evaluator` job is dropped from the cluster (the other tasks
//! do not wait for it); an evaluator task itself has nothing to do, since dflow's chief
//! evaluates on the held-out split.

use super::{Env, Identity, IdentityError, Place, Source};
use dflow_graph::cluster::TF_CONFIG_VAR;
use dflow_graph::{ClusterSpec, TfConfig};
use std::collections::BTreeMap;

/// The identity `TF_CONFIG` gives, if it is set.
pub fn detect(env: &dyn Env) -> Result<Option<Identity>, IdentityError> {
    let Some(text) = env.get(TF_CONFIG_VAR) else {
        return Ok(None);
    };
    parse(&text).map(Some)
}

fn invalid(problem: String) -> IdentityError {
    IdentityError::Invalid {
        launcher: Source::TfConfig,
        problem,
    }
}

/// Parses `TF_CONFIG` text into dflow's identity (see the module docs for the renaming).
pub fn parse(text: &str) -> Result<Identity, IdentityError> {
    let tf = TfConfig::from_json(text).map_err(|e| invalid(e.to_string()))?;
    let (job, index) = (tf.task_type.as_str(), tf.task_index);
    let given = format!("task {job}:{index}");
    if job == "evaluator" {
        return Ok(Identity {
            source: Source::TfConfig,
            detail: format!("{given}: dflow's chief evaluates on the held-out split itself; an evaluator has nothing to do"),
            place: Place::Evaluator,
        });
    }
    let mut jobs: BTreeMap<String, BTreeMap<u32, String>> = BTreeMap::new();
    for j in tf.cluster.jobs() {
        if j == "evaluator" {
            continue;
        }
        jobs.insert(
            j.to_string(),
            tf.cluster
                .tasks(j)
                .map(|(i, a)| (i, a.to_string()))
                .collect(),
        );
    }
    let chief_job = match (jobs.contains_key("chief"), jobs.contains_key("master")) {
        (true, true) => {
            return Err(invalid(
                "the cluster has both a `chief` and a `master` job; a job has one chief".into(),
            ))
        }
        (true, false) => Some("chief"),
        (false, true) => Some("master"),
        (false, false) => None,
    };
    let Some(chief_job) = chief_job else {
        let cluster = ClusterSpec::new(jobs).map_err(|e| invalid(e.to_string()))?;
        return Ok(Identity {
            source: Source::TfConfig,
            detail: given,
            place: Place::Task {
                cluster,
                job: job.to_string(),
                index,
            },
        });
    };
    let chief_tasks = jobs.remove(chief_job).unwrap_or_default();
    let Some((&chief_index, chief_address)) = chief_tasks.iter().next() else {
        return Err(invalid(format!("job `{chief_job}` has no task")));
    };
    if chief_tasks.len() != 1 {
        return Err(invalid(format!(
            "job `{chief_job}` has {} tasks; a job has exactly one chief",
            chief_tasks.len()
        )));
    }
    // TF's chief becomes worker 0, TF's workers follow in index order.
    let tf_workers = jobs.remove("worker").unwrap_or_default();
    let mut workers = BTreeMap::from([(0u32, chief_address.clone())]);
    let mut renamed = None;
    for (n, (&i, address)) in tf_workers.iter().enumerate() {
        let new = n as u32 + 1;
        workers.insert(new, address.clone());
        if job == "worker" && i == index {
            renamed = Some(new);
        }
    }
    jobs.insert("worker".to_string(), workers);
    let (job, index, role) = match job {
        j if j == chief_job && index == chief_index => ("worker", 0, "the chief"),
        "worker" => match renamed {
            Some(n) => ("worker", n, "a worker"),
            None => return Err(invalid(format!("the cluster has no worker {index}"))),
        },
        other => (other, index, "unchanged"),
    };
    let cluster = ClusterSpec::new(jobs).map_err(|e| invalid(e.to_string()))?;
    Ok(Identity {
        source: Source::TfConfig,
        detail: format!(
            "{given} runs as /job:{job}/task:{index} ({role}; TF's `{chief_job}` is dflow's worker 0, TF's worker i is dflow's worker i+1)"
        ),
        place: Place::Task {
            cluster,
            job: job.to_string(),
            index,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape the Kubeflow TFJob operator writes (its `TFConfig` with `"environment":
    /// "cloud"`, service addresses `NAME-TYPE-INDEX.NAMESPACE.svc:2222`), for a job with a
    /// Chief, two Workers, a PS and an Evaluator replica.
    fn tfjob(task_type: &str, index: u32) -> String {
        format!(
            r#"{{"cluster":{{"chief":["digits-chief-0.default.svc:2222"],"evaluator":["digits-evaluator-0.default.svc:2222"],"ps":["digits-ps-0.default.svc:2222"],"worker":["digits-worker-0.default.svc:2222","digits-worker-1.default.svc:2222"]}},"task":{{"type":"{task_type}","index":{index}}},"environment":"cloud"}}"#
        )
    }

    fn place(text: &str) -> (ClusterSpec, String, u32) {
        match parse(text).unwrap().place {
            Place::Task {
                cluster,
                job,
                index,
            } => (cluster, job, index),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_tfjob_chief_is_the_chief_and_workers_follow_it() {
        let (cluster, job, index) = place(&tfjob("chief", 0));
        assert_eq!((job.as_str(), index), ("worker", 0));
        assert_eq!(
            cluster.tasks("worker").collect::<Vec<_>>(),
            [
                (0, "digits-chief-0.default.svc:2222"),
                (1, "digits-worker-0.default.svc:2222"),
                (2, "digits-worker-1.default.svc:2222")
            ]
        );
        assert_eq!(
            cluster.jobs().collect::<Vec<_>>(),
            ["ps", "worker"],
            "evaluator dropped, chief folded into worker"
        );
        let (c1, job, index) = place(&tfjob("worker", 1));
        assert_eq!((job.as_str(), index), ("worker", 2));
        assert_eq!(c1, cluster, "every task derives the same cluster");
        let (_, job, index) = place(&tfjob("ps", 0));
        assert_eq!((job.as_str(), index), ("ps", 0));
        let id = parse(&tfjob("chief", 0)).unwrap();
        assert!(
            id.describe()
                .contains("task chief:0 runs as /job:worker/task:0 (the chief"),
            "{}",
            id.describe()
        );
    }

    #[test]
    fn an_evaluator_has_nothing_to_do() {
        assert_eq!(
            parse(&tfjob("evaluator", 0)).unwrap().place,
            Place::Evaluator
        );
    }

    #[test]
    fn master_in_the_cloud_environment_is_the_chief() {
        // tf.estimator's Cloud ML Engine form: a `master` job, `"environment": "cloud"`.
        let text = r#"{"cluster": {"master": ["m:2222"], "ps": ["p:2222"], "worker": ["w0:2222"]}, "task": {"type": "master", "index": 0}, "environment": "cloud"}"#;
        let (cluster, job, index) = place(text);
        assert_eq!((job.as_str(), index), ("worker", 0));
        assert_eq!(cluster.address("worker", 1), Some("w0:2222"));
    }

    #[test]
    fn without_a_chief_job_the_cluster_is_unchanged() {
        let text = r#"{"cluster": {"ps": ["p:1"], "worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}"#;
        let (cluster, job, index) = place(text);
        assert_eq!(
            (job.as_str(), index, cluster.num_tasks("worker")),
            ("worker", 1, 2)
        );
    }

    #[test]
    fn bad_chief_jobs_are_refused() {
        let two = r#"{"cluster": {"chief": ["a:1", "b:1"], "worker": ["c:1"]}, "task": {"type": "worker", "index": 0}}"#;
        assert!(parse(two)
            .unwrap_err()
            .to_string()
            .contains("exactly one chief"));
        let both = r#"{"cluster": {"chief": ["a:1"], "master": ["b:1"]}, "task": {"type": "chief", "index": 0}}"#;
        assert!(parse(both)
            .unwrap_err()
            .to_string()
            .contains("both a `chief` and a `master`"));
        let e = parse("{").unwrap_err().to_string();
        assert!(e.starts_with("TF_CONFIG: "), "{e}");
    }
}
