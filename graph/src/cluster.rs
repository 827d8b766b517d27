//! Cluster specs in TensorFlow's schema, and the `TF_CONFIG` environment variable.
//!
//! A cluster maps job names to tasks, and each task to a `host:port` address. The JSON file is
//! either dense (task `i` is the `i`-th list entry) or sparse (task indices as string keys):
//!
//! ```
//! use dflow_graph::{ClusterSpec, DeviceName};
//!
//! let cluster = ClusterSpec::from_json(r#"{
//!     "ps": ["ps0.example.com:2222"],
//!     "worker": {"1": "w1.example.com:2222", "3": "w3.example.com:2222"}
//! }"#)?;
//! assert_eq!(cluster.address("worker", 3), Some("w3.example.com:2222"));
//! assert_eq!(cluster.num_tasks("worker"), 2);
//! let workers = cluster.matching_devices(&"/job:worker".parse()?);
//! assert_eq!(workers[0].to_string(), "/job:worker/replica:0/task:1/device:CPU:0");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::device::{is_valid_job_name, DeviceName};
use crate::device_type::DeviceType;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

/// The environment variable [`TfConfig::from_env`] reads.
pub const TF_CONFIG_VAR: &str = "TF_CONFIG";

/// Errors from loading or checking a cluster spec or `TF_CONFIG`.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The cluster file could not be read.
    #[error("cannot read cluster spec {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An error in a cluster file (the path is added to the inner error).
    #[error("in cluster spec {}: {source}", path.display())]
    InFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with its contents.
        source: Box<ClusterError>,
    },
    /// Malformed JSON, or JSON not in the expected schema; the message carries line and column.
    #[error("{what} is not valid: {source}")]
    Json {
        /// What was being parsed: "cluster spec JSON" or "TF_CONFIG JSON".
        what: &'static str,
        /// serde_json's error, with line and column.
        source: serde_json::Error,
    },
    /// The cluster has no jobs.
    #[error(
        "cluster spec has no jobs; list at least one, e.g. {{\"worker\": [\"localhost:2222\"]}}"
    )]
    Empty,
    /// A job with an empty task list.
    #[error("job \"{job}\" has no tasks; give it at least one \"host:port\" address")]
    EmptyJob {
        /// The job.
        job: String,
    },
    /// A job name that is not `[A-Za-z][A-Za-z0-9_]*`.
    #[error("invalid job name \"{job}\": job names must start with a letter and contain only letters, digits and '_'")]
    InvalidJobName {
        /// The offending name.
        job: String,
    },
    /// A task address that is not `host:port`.
    #[error("/job:{job}/task:{task}: address \"{address}\" is not host:port: {reason}")]
    BadAddress {
        /// The job.
        job: String,
        /// The task index.
        task: u32,
        /// The address as given.
        address: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Two tasks share an address.
    #[error("address \"{address}\" is used by both /job:{first_job}/task:{first_task} and /job:{job}/task:{task}; every task needs its own host:port")]
    DuplicateAddress {
        /// The shared address.
        address: String,
        /// The job of the first task using it (in job, task order).
        first_job: String,
        /// The first task using it.
        first_task: u32,
        /// The job of the second task using it.
        job: String,
        /// The second task using it.
        task: u32,
    },
    /// `TF_CONFIG` is not set.
    #[error("environment variable {TF_CONFIG_VAR} is not set; set it to {{\"cluster\": {{...}}, \"task\": {{\"type\": \"worker\", \"index\": 0}}}}")]
    EnvNotSet,
    /// `TF_CONFIG` is not valid Unicode.
    #[error("environment variable {TF_CONFIG_VAR} is not valid UTF-8")]
    EnvNotUnicode,
    /// An error in the contents of `TF_CONFIG`.
    #[error("in environment variable {TF_CONFIG_VAR}: {source}")]
    InEnv {
        /// What is wrong with its contents.
        source: Box<ClusterError>,
    },
    /// `TF_CONFIG`'s task type is not a job of its cluster.
    #[error(
        "task type \"{job}\" is not a job in the cluster (jobs: {})",
        quoted(jobs)
    )]
    UnknownJob {
        /// The task type given.
        job: String,
        /// The jobs the cluster has.
        jobs: Vec<String>,
    },
    /// `TF_CONFIG`'s task index is not a task of its job.
    #[error("job \"{job}\" has no task {index} (tasks: {})", joined(tasks))]
    UnknownTask {
        /// The job.
        job: String,
        /// The task index given.
        index: u32,
        /// The task indices the job has.
        tasks: Vec<u32>,
    },
}

fn quoted(items: &[String]) -> String {
    items
        .iter()
        .map(|s| format!("\"{s}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

fn joined(items: &[u32]) -> String {
    items
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The jobs, tasks and addresses of a cluster.
///
/// Every task has one device, `/device:CPU:0` (GPUs are not modelled yet). Always valid: at least
/// one job, every job has a task, job names are `[A-Za-z][A-Za-z0-9_]*`, addresses are
/// `host:port` and no two tasks share one (port 0, "any free port", is exempt).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterSpec {
    jobs: BTreeMap<String, BTreeMap<u32, String>>,
}

impl ClusterSpec {
    /// Checks and wraps a job → task → address map.
    pub fn new(jobs: BTreeMap<String, BTreeMap<u32, String>>) -> Result<ClusterSpec, ClusterError> {
        if jobs.is_empty() {
            return Err(ClusterError::Empty);
        }
        let mut seen: HashMap<String, (&str, u32)> = HashMap::new();
        for (job, tasks) in &jobs {
            if !is_valid_job_name(job) {
                return Err(ClusterError::InvalidJobName { job: job.clone() });
            }
            if tasks.is_empty() {
                return Err(ClusterError::EmptyJob { job: job.clone() });
            }
            for (&task, address) in tasks {
                let bad = |reason| ClusterError::BadAddress {
                    job: job.clone(),
                    task,
                    address: address.clone(),
                    reason,
                };
                let port = check_address(address).map_err(bad)?;
                if port == 0 {
                    continue;
                }
                let key = address.to_ascii_lowercase();
                if let Some(&(first_job, first_task)) = seen.get(&key) {
                    return Err(ClusterError::DuplicateAddress {
                        address: address.clone(),
                        first_job: first_job.to_string(),
                        first_task,
                        job: job.clone(),
                        task,
                    });
                }
                seen.insert(key, (job, task));
            }
        }
        Ok(ClusterSpec { jobs })
    }

    /// A cluster on this machine with `count` tasks per job, for tests and `--local` runs.
    ///
    /// Every address is the placeholder `127.0.0.1:0` ("any free port"): the in-process local
    /// backend never dials it, and a TCP run binds port 0 and learns the real port at start-up.
    pub fn local(jobs: &[(&str, u32)]) -> Result<ClusterSpec, ClusterError> {
        let mut map = BTreeMap::new();
        for &(job, count) in jobs {
            let tasks = (0..count).map(|t| (t, "127.0.0.1:0".to_string())).collect();
            map.insert(job.to_string(), tasks);
        }
        ClusterSpec::new(map)
    }

    /// Parses a cluster spec from JSON text in the dense or sparse form.
    pub fn from_json(text: &str) -> Result<ClusterSpec, ClusterError> {
        let raw: RawCluster = serde_json::from_str(text).map_err(|source| ClusterError::Json {
            what: "cluster spec JSON",
            source,
        })?;
        ClusterSpec::new(raw.0)
    }

    /// Reads a cluster spec JSON file; errors name the file.
    pub fn from_file(path: &Path) -> Result<ClusterSpec, ClusterError> {
        let text = std::fs::read_to_string(path).map_err(|source| ClusterError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        ClusterSpec::from_json(&text).map_err(|e| ClusterError::InFile {
            path: path.to_path_buf(),
            source: Box::new(e),
        })
    }

    /// The spec as a JSON value: a list per job when its tasks are `0..n`, a map otherwise.
    pub fn to_json_value(&self) -> serde_json::Value {
        let jobs = self.jobs.iter().map(|(job, tasks)| {
            let dense = tasks.keys().copied().eq(0..tasks.len() as u32);
            let value = if dense {
                tasks
                    .values()
                    .cloned()
                    .map(serde_json::Value::from)
                    .collect()
            } else {
                tasks
                    .iter()
                    .map(|(t, a)| (t.to_string(), serde_json::Value::from(a.clone())))
                    .collect::<serde_json::Map<_, _>>()
                    .into()
            };
            (job.clone(), value)
        });
        serde_json::Value::Object(jobs.collect())
    }

    /// The spec as pretty-printed JSON, readable by [`ClusterSpec::from_json`].
    pub fn to_json(&self) -> String {
        format!("{:#}", self.to_json_value())
    }

    /// The job names, sorted.
    pub fn jobs(&self) -> impl Iterator<Item = &str> + '_ {
        self.jobs.keys().map(String::as_str)
    }

    /// The tasks of `job` as `(index, address)`, by index; empty for an unknown job.
    pub fn tasks<'a>(&'a self, job: &str) -> impl Iterator<Item = (u32, &'a str)> + 'a {
        self.jobs
            .get(job)
            .into_iter()
            .flat_map(|tasks| tasks.iter().map(|(&t, a)| (t, a.as_str())))
    }

    /// The address of one task.
    pub fn address(&self, job: &str, task: u32) -> Option<&str> {
        self.jobs.get(job)?.get(&task).map(String::as_str)
    }

    /// How many tasks `job` has (0 for an unknown job). With the sparse form this is not the
    /// largest index plus one.
    pub fn num_tasks(&self, job: &str) -> usize {
        self.jobs.get(job).map_or(0, BTreeMap::len)
    }

    /// True if `job` has task `task`.
    pub fn has_task(&self, job: &str, task: u32) -> bool {
        self.address(job, task).is_some()
    }

    /// Every task as `/job:J/replica:0/task:T`, sorted by job then index.
    pub fn task_names(&self) -> Vec<String> {
        self.jobs
            .iter()
            .flat_map(|(job, tasks)| {
                tasks
                    .keys()
                    .map(move |t| format!("/job:{job}/replica:0/task:{t}"))
            })
            .collect()
    }

    /// Every device in the cluster as a full name, sorted: one `CPU:0` per task.
    pub fn devices(&self) -> Vec<DeviceName> {
        self.jobs
            .iter()
            .flat_map(|(job, tasks)| {
                tasks
                    .keys()
                    .map(|&t| DeviceName::full(job, t, DeviceType::CPU, 0))
            })
            .collect()
    }

    /// True if `device` is a full name of a device in this cluster (a partial spec is not
    /// contained; use [`ClusterSpec::matching_devices`] for those).
    pub fn contains_device(&self, device: &DeviceName) -> bool {
        device.is_fully_specified()
            && device.replica == Some(0)
            && device.device_type == Some(DeviceType::CPU)
            && device.device_id == Some(0)
            && matches!((&device.job, device.task), (Some(j), Some(t)) if self.has_task(j, t))
    }

    /// The cluster's devices that `spec` matches, sorted; empty if none do.
    pub fn matching_devices(&self, spec: &DeviceName) -> Vec<DeviceName> {
        self.devices()
            .into_iter()
            .filter(|d| spec.matches(d))
            .collect()
    }
}

/// Checks `host:port` and returns the port.
fn check_address(address: &str) -> Result<u16, &'static str> {
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err("missing \":port\"");
    };
    if host.is_empty() {
        return Err("host is empty");
    }
    if host.contains(|c: char| c.is_whitespace() || c.is_control() || c == '/') {
        return Err("host contains whitespace or '/'");
    }
    let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
    if host.contains(':') && !bracketed {
        return Err("an IPv6 host must be in brackets, e.g. [::1]:2222");
    }
    if bracketed && host[1..host.len() - 1].contains(['[', ']']) {
        return Err("stray brackets in host");
    }
    if !bracketed && host.contains(['[', ']']) {
        return Err("stray brackets in host");
    }
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return Err("port is not a number");
    }
    port.parse::<u16>().map_err(|_| "port is larger than 65535")
}

impl Serialize for ClusterSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_json_value().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for ClusterSpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = RawCluster::deserialize(deserializer)?;
        ClusterSpec::new(raw.0).map_err(de::Error::custom)
    }
}

/// The cluster map before semantic checks. Its visitor rejects duplicate JSON keys and
/// non-numeric task indices, so those errors carry serde_json's line and column.
struct RawCluster(BTreeMap<String, BTreeMap<u32, String>>);

impl<'de> Deserialize<'de> for RawCluster {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ClusterVisitor)
    }
}

struct ClusterVisitor;

impl<'de> Visitor<'de> for ClusterVisitor {
    type Value = RawCluster;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map from job name to its task addresses")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawCluster, A::Error> {
        let mut jobs = BTreeMap::new();
        while let Some(job) = map.next_key::<String>()? {
            if jobs.contains_key(&job) {
                return Err(de::Error::custom(format_args!(
                    "job \"{job}\" is listed twice"
                )));
            }
            let tasks = map.next_value_seed(TasksSeed { job: &job })?;
            jobs.insert(job, tasks);
        }
        Ok(RawCluster(jobs))
    }
}

struct TasksSeed<'a> {
    job: &'a str,
}

impl<'de> DeserializeSeed<'de> for TasksSeed<'_> {
    type Value = BTreeMap<u32, String>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TasksSeed<'_> {
    type Value = BTreeMap<u32, String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the tasks of job \"{}\": a list of \"host:port\" addresses or a map from task index \
             (a string such as \"0\") to address",
            self.job
        )
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut tasks = BTreeMap::new();
        let mut index = 0u32;
        while let Some(address) = seq.next_element::<String>()? {
            tasks.insert(index, address);
            index = index.checked_add(1).ok_or_else(|| {
                de::Error::custom(format_args!("job \"{}\" has too many tasks", self.job))
            })?;
        }
        Ok(tasks)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut tasks = BTreeMap::new();
        while let Some(key) = map.next_key::<String>()? {
            let index = if !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit()) {
                key.parse::<u32>().ok()
            } else {
                None
            };
            let Some(index) = index else {
                return Err(de::Error::custom(format_args!(
                    "job \"{}\": task index \"{key}\" is not a number from 0 to {}",
                    self.job,
                    u32::MAX
                )));
            };
            let address: String = map.next_value()?;
            if tasks.insert(index, address).is_some() {
                return Err(de::Error::custom(format_args!(
                    "job \"{}\": task {index} is listed twice",
                    self.job
                )));
            }
        }
        Ok(tasks)
    }
}

/// The parsed `TF_CONFIG`: the cluster and this process's task in it.
///
/// TensorFlow's schema, `{"cluster": {...}, "task": {"type": "worker", "index": 0}}`. The
/// optional top-level `"environment"` and `"rpc_layer"` keys and `task.trial` are accepted and
/// ignored; any other key is an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TfConfig {
    /// The cluster.
    pub cluster: ClusterSpec,
    /// This process's job.
    pub task_type: String,
    /// This process's task index within its job.
    pub task_index: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTfConfig {
    cluster: RawCluster,
    task: RawTask,
    #[serde(rename = "environment", default)]
    _environment: Option<IgnoredAny>,
    #[serde(rename = "rpc_layer", default)]
    _rpc_layer: Option<IgnoredAny>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTask {
    #[serde(rename = "type")]
    task_type: String,
    index: u32,
    #[serde(rename = "trial", default)]
    _trial: Option<IgnoredAny>,
}

impl TfConfig {
    /// Parses `TF_CONFIG` JSON text and checks that the task is in the cluster.
    pub fn from_json(text: &str) -> Result<TfConfig, ClusterError> {
        let raw: RawTfConfig = serde_json::from_str(text).map_err(|source| ClusterError::Json {
            what: "TF_CONFIG JSON",
            source,
        })?;
        let cluster = ClusterSpec::new(raw.cluster.0)?;
        let (task_type, task_index) = (raw.task.task_type, raw.task.index);
        if cluster.num_tasks(&task_type) == 0 {
            return Err(ClusterError::UnknownJob {
                job: task_type,
                jobs: cluster.jobs().map(str::to_string).collect(),
            });
        }
        if !cluster.has_task(&task_type, task_index) {
            return Err(ClusterError::UnknownTask {
                tasks: cluster.tasks(&task_type).map(|(t, _)| t).collect(),
                job: task_type,
                index: task_index,
            });
        }
        Ok(TfConfig {
            cluster,
            task_type,
            task_index,
        })
    }

    /// Reads and parses the `TF_CONFIG` environment variable.
    pub fn from_env() -> Result<TfConfig, ClusterError> {
        let text = std::env::var(TF_CONFIG_VAR).map_err(|e| match e {
            std::env::VarError::NotPresent => ClusterError::EnvNotSet,
            std::env::VarError::NotUnicode(_) => ClusterError::EnvNotUnicode,
        })?;
        TfConfig::from_json(&text).map_err(|e| ClusterError::InEnv {
            source: Box::new(e),
        })
    }

    /// This task's device, `/job:TYPE/replica:0/task:INDEX/device:CPU:0`.
    pub fn device(&self) -> DeviceName {
        DeviceName::full(&self.task_type, self.task_index, DeviceType::CPU, 0)
    }

    /// This task's address in the cluster.
    pub fn address(&self) -> Option<&str> {
        self.cluster.address(&self.task_type, self.task_index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn err(json: &str) -> String {
        ClusterSpec::from_json(json).unwrap_err().to_string()
    }

    #[test]
    fn dense_form() {
        let c = ClusterSpec::from_json(
            r#"{"ps": ["ps0:2222", "ps1:2222"], "worker": ["w0:2222", "w1:2222", "w2:2222"]}"#,
        )
        .unwrap();
        assert_eq!(c.jobs().collect::<Vec<_>>(), ["ps", "worker"]);
        assert_eq!(c.num_tasks("worker"), 3);
        assert_eq!(c.num_tasks("chief"), 0);
        assert_eq!(c.address("ps", 1), Some("ps1:2222"));
        assert_eq!(c.address("ps", 2), None);
        assert!(c.has_task("worker", 2));
        assert!(!c.has_task("nope", 0));
        assert_eq!(
            c.tasks("ps").collect::<Vec<_>>(),
            [(0, "ps0:2222"), (1, "ps1:2222")]
        );
        assert_eq!(c.tasks("nope").count(), 0);
        assert_eq!(
            c.task_names(),
            [
                "/job:ps/replica:0/task:0",
                "/job:ps/replica:0/task:1",
                "/job:worker/replica:0/task:0",
                "/job:worker/replica:0/task:1",
                "/job:worker/replica:0/task:2",
            ]
        );
    }

    #[test]
    fn sparse_form() {
        let c = ClusterSpec::from_json(r#"{"worker": {"1": "w1:2222", "3": "w3:2222"}}"#).unwrap();
        assert_eq!(c.num_tasks("worker"), 2);
        assert!(!c.has_task("worker", 0));
        assert_eq!(c.address("worker", 3), Some("w3:2222"));
        assert_eq!(
            c.devices()
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            [
                "/job:worker/replica:0/task:1/device:CPU:0",
                "/job:worker/replica:0/task:3/device:CPU:0"
            ]
        );
    }

    #[test]
    fn serializes_dense_when_contiguous_and_sparse_otherwise() {
        let c = ClusterSpec::from_json(
            r#"{"ps": {"0": "a:1", "1": "b:1"}, "worker": {"1": "w1:2", "3": "w3:2"}}"#,
        )
        .unwrap();
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"ps": ["a:1", "b:1"], "worker": {"1": "w1:2", "3": "w3:2"}})
        );
        assert_eq!(ClusterSpec::from_json(&c.to_json()).unwrap(), c);
        let back: ClusterSpec = serde_json::from_value(v).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn devices_and_matching() {
        let c = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
        let all = c.devices();
        assert_eq!(all.len(), 3);
        assert!(all.windows(2).all(|w| w[0] < w[1]));
        let w1 = DeviceName::full("worker", 1, DeviceType::CPU, 0);
        assert!(c.contains_device(&w1));
        assert!(!c.contains_device(&DeviceName::full("worker", 2, DeviceType::CPU, 0)));
        assert!(!c.contains_device(&DeviceName::full("worker", 1, DeviceType::GPU, 0)));
        assert!(!c.contains_device(&"/job:worker/task:1/cpu:0".parse().unwrap()));
        let workers = c.matching_devices(&"/job:worker".parse().unwrap());
        assert_eq!(
            workers,
            [DeviceName::full("worker", 0, DeviceType::CPU, 0), w1]
        );
        assert_eq!(c.matching_devices(&DeviceName::default()), all);
        assert!(c.matching_devices(&"/gpu:0".parse().unwrap()).is_empty());
        assert_eq!(c.matching_devices(&"/task:0".parse().unwrap()).len(), 2);
    }

    #[test]
    fn local_builder() {
        let c = ClusterSpec::local(&[("ps", 1), ("worker", 2)]).unwrap();
        assert_eq!(c.address("worker", 1), Some("127.0.0.1:0"));
        assert!(matches!(
            ClusterSpec::local(&[("ps", 0)]),
            Err(ClusterError::EmptyJob { .. })
        ));
        assert!(matches!(ClusterSpec::local(&[]), Err(ClusterError::Empty)));
        assert!(matches!(
            ClusterSpec::local(&[("bad job", 1)]),
            Err(ClusterError::InvalidJobName { .. })
        ));
    }

    #[test]
    fn json_errors_carry_line_and_column() {
        let e = err("{\"ps\": [\"a:1\",\n  ]}");
        assert!(e.starts_with("cluster spec JSON is not valid: "), "{e}");
        assert!(e.contains("line 2 column"), "{e}");
        let e = err(r#"{"ps": 3}"#);
        assert!(e.contains("expected the tasks of job \"ps\""), "{e}");
        assert!(e.contains("line 1 column"), "{e}");
        let e = err(r#"{"ps": [1]}"#);
        assert!(
            e.contains("invalid type: integer `1`, expected a string"),
            "{e}"
        );
        let e = err(r#"["a:1"]"#);
        assert!(e.contains("expected a map from job name"), "{e}");
        let e = err(r#"{"ps": ["a:1"], "ps": ["b:1"]}"#);
        assert!(e.contains("job \"ps\" is listed twice at line 1"), "{e}");
        let e = err(r#"{"w": {"x": "a:1"}}"#);
        assert!(
            e.contains("job \"w\": task index \"x\" is not a number"),
            "{e}"
        );
        let e = err(r#"{"w": {"-1": "a:1"}}"#);
        assert!(e.contains("task index \"-1\""), "{e}");
        let e = err(r#"{"w": {"1": "a:1", "01": "b:1"}}"#);
        assert!(e.contains("job \"w\": task 1 is listed twice"), "{e}");
        assert!(err("").contains("EOF"));
    }

    #[test]
    fn semantic_errors() {
        assert_eq!(
            err("{}"),
            "cluster spec has no jobs; list at least one, e.g. {\"worker\": [\"localhost:2222\"]}"
        );
        assert_eq!(
            err(r#"{"ps": []}"#),
            "job \"ps\" has no tasks; give it at least one \"host:port\" address"
        );
        assert!(err(r#"{"p-s": ["a:1"]}"#).contains("invalid job name \"p-s\""));
        assert!(err(r#"{"": ["a:1"]}"#).contains("invalid job name \"\""));
        assert_eq!(
            err(r#"{"ps": ["a:1", "host"]}"#),
            "/job:ps/task:1: address \"host\" is not host:port: missing \":port\""
        );
        assert!(err(r#"{"ps": ["a:http"]}"#).contains("port is not a number"));
        assert!(err(r#"{"ps": ["a:70000"]}"#).contains("port is larger than 65535"));
        assert!(err(r#"{"ps": [":1"]}"#).contains("host is empty"));
        assert!(err(r#"{"ps": ["a b:1"]}"#).contains("whitespace"));
        assert!(err(r#"{"ps": ["::1:2222"]}"#).contains("IPv6"));
        assert!(err(r#"{"ps": ["[::1]]:2222"]}"#).contains("stray brackets"));
        assert!(ClusterSpec::from_json(r#"{"ps": ["[::1]:2222"]}"#).is_ok());
        assert_eq!(
            err(r#"{"ps": ["h:1"], "worker": {"0": "x:2", "4": "H:1"}}"#),
            "address \"H:1\" is used by both /job:ps/task:0 and /job:worker/task:4; every task needs its own host:port"
        );
        assert!(
            ClusterSpec::from_json(r#"{"ps": ["h:0"], "w": ["h:0"]}"#).is_ok(),
            "port 0 placeholders may repeat"
        );
    }

    #[test]
    fn from_file_names_the_file() {
        let dir = std::env::temp_dir().join(format!("dflow-cluster-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.json");
        std::fs::write(&good, r#"{"worker": ["localhost:2222"]}"#).unwrap();
        assert_eq!(
            ClusterSpec::from_file(&good).unwrap().num_tasks("worker"),
            1
        );
        let bad = dir.join("bad.json");
        std::fs::write(&bad, "{\"worker\": [\n  \"localhost\"]}").unwrap();
        let e = ClusterSpec::from_file(&bad).unwrap_err().to_string();
        assert!(e.starts_with("in cluster spec "), "{e}");
        assert!(e.contains("bad.json: /job:worker/task:0"), "{e}");
        let broken = dir.join("broken.json");
        std::fs::write(&broken, "{\"worker\": [\n  \"a:1\" }").unwrap();
        let e = ClusterSpec::from_file(&broken).unwrap_err().to_string();
        assert!(e.contains("broken.json: cluster spec JSON"), "{e}");
        assert!(e.contains("line 2 column"), "{e}");
        let missing = dir.join("missing.json");
        let e = ClusterSpec::from_file(&missing).unwrap_err();
        assert!(matches!(e, ClusterError::Io { .. }));
        assert!(e.to_string().contains("cannot read cluster spec"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    const TF: &str = r#"{
        "cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p:2222"]},
        "task": {"type": "worker", "index": 1},
        "environment": "cloud",
        "rpc_layer": "grpc"
    }"#;

    #[test]
    fn tf_config_parses() {
        let t = TfConfig::from_json(TF).unwrap();
        assert_eq!(t.task_type, "worker");
        assert_eq!(t.task_index, 1);
        assert_eq!(t.cluster.num_tasks("worker"), 2);
        assert_eq!(t.address(), Some("w1:2222"));
        assert_eq!(
            t.device().to_string(),
            "/job:worker/replica:0/task:1/device:CPU:0"
        );
        let minimal = TfConfig::from_json(
            r#"{"cluster": {"w": {"2": "a:1"}}, "task": {"type": "w", "index": 2, "trial": "7"}}"#,
        )
        .unwrap();
        assert_eq!(minimal.task_index, 2);
    }

    #[test]
    fn tf_config_errors() {
        let e = |s: &str| TfConfig::from_json(s).unwrap_err().to_string();
        let unknown =
            e(r#"{"cluster": {"w": ["a:1"]}, "task": {"type": "w", "index": 0}, "foo": 1}"#);
        assert!(
            unknown.starts_with("TF_CONFIG JSON is not valid: unknown field `foo`"),
            "{unknown}"
        );
        assert!(unknown.contains("line 1 column"), "{unknown}");
        let unknown_task =
            e(r#"{"cluster": {"w": ["a:1"]}, "task": {"type": "w", "index": 0, "x": 1}}"#);
        assert!(unknown_task.contains("unknown field `x`"), "{unknown_task}");
        assert!(e(r#"{"cluster": {"w": ["a:1"]}}"#).contains("missing field `task`"));
        assert!(e(r#"{"task": {"type": "w", "index": 0}}"#).contains("missing field `cluster`"));
        assert!(
            e(r#"{"cluster": {"w": ["a:1"]}, "task": {"type": "w", "index": -1}}"#)
                .contains("invalid value: integer `-1`")
        );
        assert_eq!(
            e(
                r#"{"cluster": {"ps": ["a:1"], "worker": ["b:1"]}, "task": {"type": "chief", "index": 0}}"#
            ),
            "task type \"chief\" is not a job in the cluster (jobs: \"ps\", \"worker\")"
        );
        assert_eq!(
            e(
                r#"{"cluster": {"worker": {"0": "a:1", "2": "b:1"}}, "task": {"type": "worker", "index": 1}}"#
            ),
            "job \"worker\" has no task 1 (tasks: 0, 2)"
        );
        assert!(e(r#"{"cluster": {}, "task": {"type": "w", "index": 0}}"#).contains("no jobs"));
    }

    #[test]
    fn tf_config_from_env() {
        // The only test touching TF_CONFIG, so no other test races on it.
        std::env::remove_var(TF_CONFIG_VAR);
        assert!(matches!(TfConfig::from_env(), Err(ClusterError::EnvNotSet)));
        std::env::set_var(TF_CONFIG_VAR, TF);
        assert_eq!(
            TfConfig::from_env().unwrap(),
            TfConfig::from_json(TF).unwrap()
        );
        std::env::set_var(TF_CONFIG_VAR, "{");
        let e = TfConfig::from_env().unwrap_err().to_string();
        assert!(
            e.starts_with("in environment variable TF_CONFIG: TF_CONFIG JSON"),
            "{e}"
        );
        std::env::remove_var(TF_CONFIG_VAR);
    }

    fn arb_cluster() -> impl Strategy<Value = ClusterSpec> {
        proptest::collection::btree_map(
            "[a-z][a-z0-9_]{0,5}",
            proptest::collection::btree_set(0u32..8, 1..4),
            1..4,
        )
        .prop_map(|jobs| {
            let mut port = 1000u16;
            let map = jobs
                .into_iter()
                .map(|(job, tasks)| {
                    let tasks = tasks
                        .into_iter()
                        .map(|t| {
                            port += 1;
                            (t, format!("host{port}.example:{port}"))
                        })
                        .collect();
                    (job, tasks)
                })
                .collect();
            ClusterSpec::new(map).unwrap()
        })
    }

    proptest! {
        #[test]
        fn json_round_trip(c in arb_cluster()) {
            prop_assert_eq!(ClusterSpec::from_json(&c.to_json()).unwrap(), c.clone());
            prop_assert_eq!(c.devices().len(), c.task_names().len());
        }

        #[test]
        fn garbage_never_panics(s in "\\PC*") {
            let _ = ClusterSpec::from_json(&s);
            let _ = TfConfig::from_json(&s);
        }

        #[test]
        fn jsonish_garbage_never_panics(s in r#"[{}\[\]":,0-9a-z ]{0,40}"#) {
            let _ = ClusterSpec::from_json(&s);
            let _ = TfConfig::from_json(&s);
        }
    }
}
