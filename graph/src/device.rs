//! Device names in TensorFlow's grammar: `/job:NAME/replica:N/task:N/device:TYPE:ID`.
//!
//! Every part is optional, so one type covers both a *partial* spec as a user writes it on a node
//! (`/job:ps`, `/device:GPU:*`) and the *full* name of a concrete device in a cluster
//! (`/job:worker/replica:0/task:1/device:CPU:0`).
//!
//! ```
//! use dflow_graph::{DeviceName, DeviceType};
//!
//! let spec: DeviceName = "/job:worker/gpu:1".parse()?;
//! assert_eq!(spec.to_string(), "/job:worker/device:GPU:1");
//!
//! let concrete = DeviceName::full("worker", 0, DeviceType::GPU, 1);
//! assert!(spec.matches(&concrete));
//! assert_eq!(concrete.task_name().as_deref(), Some("/job:worker/replica:0/task:0"));
//! # Ok::<(), dflow_graph::device::DeviceError>(())
//! ```

use crate::device_type::{is_identifier, DeviceType};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// A possibly partial TensorFlow device name.
///
/// `None` in a field means "unconstrained". The default value (every field `None`) is the empty
/// spec `""`, which matches every device.
///
/// Accepted text forms (parts may come in any order, each at most once, the leading `/` is
/// optional):
/// - `job:NAME` — `NAME` is `[A-Za-z][A-Za-z0-9_]*`; `job:*` leaves the job unset.
/// - `replica:N`, `task:N` — `N` a decimal `u32`; `*` leaves it unset.
/// - `device:TYPE:ID`, `device:TYPE:*`, `device:TYPE` — `TYPE` is `[A-Za-z][A-Za-z0-9_]*` (stored
///   upper-case) or `*`; `ID` a decimal `u32` or `*`.
/// - legacy `cpu:ID` / `gpu:ID` (any case), the same as `device:CPU:ID` / `device:GPU:ID`.
///
/// [`Display`](fmt::Display) prints the canonical form: the set parts in grammar order, with
/// `device:TYPE:*` for a type without an id and `device:*:ID` for an id without a type.
///
/// Ordering is by job, replica, task, device type, device id (unset before set, ids numerically),
/// so sorted device lists are deterministic.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceName {
    /// The job name, e.g. `worker` or `ps`.
    pub job: Option<String>,
    /// The replica index within the job (dflow always uses 0 for concrete devices).
    pub replica: Option<u32>,
    /// The task index within the job.
    pub task: Option<u32>,
    /// The device type, e.g. `CPU` or `GPU`.
    pub device_type: Option<DeviceType>,
    /// The device index within its type on the task.
    pub device_id: Option<u32>,
}

/// Longest device string accepted (bytes); TensorFlow's longest real names are under 100.
pub const MAX_DEVICE_LEN: usize = 1024;

/// What is wrong with a device string; wrapped in [`DeviceError::Parse`] with the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseProblem {
    /// Longer than [`MAX_DEVICE_LEN`].
    #[error("{len} bytes long; a device name is at most {MAX_DEVICE_LEN} (`/job:NAME/task:N`)")]
    TooLong {
        /// The length in bytes.
        len: usize,
    },
    /// Two slashes in a row, or a trailing slash.
    #[error("empty part (doubled or trailing \"/\")")]
    EmptyPart,
    /// A part without a `key:value` colon.
    #[error("part \"{part}\" is not of the form key:value")]
    NotKeyValue {
        /// The offending part.
        part: String,
    },
    /// A key that is none of job, replica, task, device, cpu, gpu.
    #[error("unknown part \"{key}\"; expected job, replica, task, device (or legacy cpu/gpu)")]
    UnknownKey {
        /// The unknown key.
        key: String,
    },
    /// The same part appears twice (legacy `cpu:`/`gpu:` count as the device part).
    #[error("{part} is given more than once")]
    Duplicate {
        /// Which part: "job", "replica", "task" or "device".
        part: &'static str,
    },
    /// `job:` with nothing after it.
    #[error("job name is empty")]
    EmptyJob,
    /// A job name with characters outside `[A-Za-z][A-Za-z0-9_]*`.
    #[error(
        "job name \"{name}\" must start with a letter and contain only letters, digits and '_'"
    )]
    BadJobName {
        /// The offending name.
        name: String,
    },
    /// A device type outside `[A-Za-z][A-Za-z0-9_]*`.
    #[error(
        "device type \"{name}\" must start with a letter and contain only letters, digits and '_'"
    )]
    BadDeviceType {
        /// The offending type.
        name: String,
    },
    /// An index that is not a decimal number.
    #[error("{what} \"{text}\" is not a number")]
    NotANumber {
        /// "replica index", "task index" or "device id".
        what: &'static str,
        /// The offending text.
        text: String,
    },
    /// An index too large for `u32`.
    #[error("{what} \"{text}\" is too large (at most {max})", max = u32::MAX)]
    TooLarge {
        /// "replica index", "task index" or "device id".
        what: &'static str,
        /// The offending text.
        text: String,
    },
}

/// Errors from parsing or merging device names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The text is not a device name.
    #[error("invalid device \"{input}\": {problem}")]
    Parse {
        /// The text as given.
        input: String,
        /// What is wrong with it.
        problem: ParseProblem,
    },
    /// Two specs constrain the same part differently and cannot both hold.
    #[error("cannot merge device \"{left}\" with \"{right}\": {part} {left_value} conflicts with {right_value}")]
    Conflict {
        /// The first spec (canonical form).
        left: String,
        /// The second spec (canonical form).
        right: String,
        /// Which part conflicts: "job", "replica", "task", "device type" or "device id".
        part: &'static str,
        /// The first spec's value of that part.
        left_value: String,
        /// The second spec's value of that part.
        right_value: String,
    },
}

/// True if `name` is a valid job name: `[A-Za-z][A-Za-z0-9_]*` (TensorFlow allows lower case only;
/// dflow accepts upper case too).
pub fn is_valid_job_name(name: &str) -> bool {
    is_identifier(name)
}

/// A device type for messages: its name, or empty when unset.
fn type_text(ty: &Option<DeviceType>) -> String {
    ty.as_ref().map(|t| t.to_string()).unwrap_or_default()
}

fn parse_index(what: &'static str, text: &str) -> Result<Option<u32>, ParseProblem> {
    if text == "*" {
        return Ok(None);
    }
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ParseProblem::NotANumber {
            what,
            text: text.to_string(),
        });
    }
    text.parse::<u32>()
        .map(Some)
        .map_err(|_| ParseProblem::TooLarge {
            what,
            text: text.to_string(),
        })
}

fn parse_device_type(text: &str) -> Result<Option<DeviceType>, ParseProblem> {
    if text == "*" {
        return Ok(None);
    }
    DeviceType::parse(text)
        .map(Some)
        .ok_or_else(|| ParseProblem::BadDeviceType {
            name: text.to_string(),
        })
}

/// `text` cut to its first `max` chars plus `…` when longer (for messages).
fn elide(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

impl DeviceName {
    /// The full name `/job:JOB/replica:0/task:TASK/device:TYPE:ID`.
    ///
    /// The job name is not validated: build names from untrusted text with
    /// [`DeviceName::parse`] instead.
    pub fn full(job: &str, task: u32, device_type: DeviceType, device_id: u32) -> DeviceName {
        DeviceName {
            job: Some(job.to_string()),
            replica: Some(0),
            task: Some(task),
            device_type: Some(device_type),
            device_id: Some(device_id),
        }
    }

    /// Parses a device name in any of the forms listed on [`DeviceName`].
    pub fn parse(text: &str) -> Result<DeviceName, DeviceError> {
        let parsed = if text.len() > MAX_DEVICE_LEN {
            Err(ParseProblem::TooLong { len: text.len() })
        } else {
            Self::parse_parts(text)
        };
        parsed.map_err(|problem| DeviceError::Parse {
            input: elide(text, 80),
            problem,
        })
    }

    fn parse_parts(text: &str) -> Result<DeviceName, ParseProblem> {
        let mut name = DeviceName::default();
        if text.is_empty() {
            return Ok(name);
        }
        let body = text.strip_prefix('/').unwrap_or(text);
        // Seen flags: a `*` value leaves a field `None` but still counts as given.
        let (mut job, mut replica, mut task, mut device) = (false, false, false, false);
        fn once(seen: &mut bool, part: &'static str) -> Result<(), ParseProblem> {
            if std::mem::replace(seen, true) {
                Err(ParseProblem::Duplicate { part })
            } else {
                Ok(())
            }
        }
        for part in body.split('/') {
            if part.is_empty() {
                return Err(ParseProblem::EmptyPart);
            }
            let Some((key, value)) = part.split_once(':') else {
                return Err(ParseProblem::NotKeyValue {
                    part: part.to_string(),
                });
            };
            match key {
                "job" => {
                    once(&mut job, "job")?;
                    if value.is_empty() {
                        return Err(ParseProblem::EmptyJob);
                    }
                    if value != "*" {
                        if !is_valid_job_name(value) {
                            return Err(ParseProblem::BadJobName {
                                name: value.to_string(),
                            });
                        }
                        name.job = Some(value.to_string());
                    }
                }
                "replica" => {
                    once(&mut replica, "replica")?;
                    name.replica = parse_index("replica index", value)?;
                }
                "task" => {
                    once(&mut task, "task")?;
                    name.task = parse_index("task index", value)?;
                }
                "device" => {
                    once(&mut device, "device")?;
                    let (ty, id) = match value.split_once(':') {
                        Some((ty, id)) => (ty, Some(id)),
                        None => (value, None),
                    };
                    name.device_type = parse_device_type(ty)?;
                    name.device_id = match id {
                        Some(id) => parse_index("device id", id)?,
                        None => None,
                    };
                }
                legacy
                    if legacy.eq_ignore_ascii_case("cpu") || legacy.eq_ignore_ascii_case("gpu") =>
                {
                    once(&mut device, "device")?;
                    name.device_type = DeviceType::parse(legacy);
                    name.device_id = parse_index("device id", value)?;
                }
                other => {
                    return Err(ParseProblem::UnknownKey {
                        key: other.to_string(),
                    })
                }
            }
        }
        Ok(name)
    }

    /// True when no part is set (the empty spec, which matches every device).
    pub fn is_unconstrained(&self) -> bool {
        *self == DeviceName::default()
    }

    /// True when all five parts are set, i.e. this names one concrete device.
    pub fn is_fully_specified(&self) -> bool {
        self.job.is_some()
            && self.replica.is_some()
            && self.task.is_some()
            && self.device_type.is_some()
            && self.device_id.is_some()
    }

    /// `/job:J/replica:R/task:T`, the task this device lives on; `None` unless job, replica and
    /// task are all set.
    pub fn task_name(&self) -> Option<String> {
        match (&self.job, self.replica, self.task) {
            (Some(job), Some(replica), Some(task)) => {
                Some(format!("/job:{job}/replica:{replica}/task:{task}"))
            }
            _ => None,
        }
    }

    /// True when every part set in `self` is set to the same value in `concrete`.
    ///
    /// An unset part of `self` matches anything; a part set in `self` but unset in `concrete`
    /// does not match. The empty spec matches every device.
    pub fn matches(&self, concrete: &DeviceName) -> bool {
        fn part<T: PartialEq>(spec: &Option<T>, other: &Option<T>) -> bool {
            spec.is_none() || spec == other
        }
        part(&self.job, &concrete.job)
            && part(&self.replica, &concrete.replica)
            && part(&self.task, &concrete.task)
            && part(&self.device_type, &concrete.device_type)
            && part(&self.device_id, &concrete.device_id)
    }

    /// Combines two specs for the same node (TensorFlow's `MergeDevNames`): every part unset in
    /// `self` is taken from `other`.
    ///
    /// - Job, replica or task set in both to different values is always a
    ///   [`DeviceError::Conflict`].
    /// - Device type set in both to different values: an error without soft placement; with
    ///   `allow_soft_placement` the result takes `other`'s device type *and* device id (the id is
    ///   taken even when `other` leaves it unset, because `self`'s id referred to `self`'s type).
    /// - Same (or one-sided) device type but device ids set in both to different values: an error
    ///   without soft placement; with it the result takes `other`'s id.
    ///
    /// Note that TensorFlow's soft placement instead *clears* the conflicting type/id and lets the
    /// placer choose; dflow keeps `other`'s, which is deterministic and still satisfiable.
    pub fn merge(
        &self,
        other: &DeviceName,
        allow_soft_placement: bool,
    ) -> Result<DeviceName, DeviceError> {
        let conflict =
            |part: &'static str, left_value: String, right_value: String| DeviceError::Conflict {
                left: self.to_string(),
                right: other.to_string(),
                part,
                left_value,
                right_value,
            };
        fn fill<T: Clone + PartialEq>(a: &Option<T>, b: &Option<T>) -> Result<Option<T>, ()> {
            match (a, b) {
                (Some(x), Some(y)) if x != y => Err(()),
                (Some(x), _) => Ok(Some(x.clone())),
                (None, y) => Ok(y.clone()),
            }
        }
        let job = fill(&self.job, &other.job).map_err(|()| {
            conflict(
                "job",
                format!("{:?}", self.job.as_deref().unwrap_or_default()),
                format!("{:?}", other.job.as_deref().unwrap_or_default()),
            )
        })?;
        let index = |x: Option<u32>| x.map(|v| v.to_string()).unwrap_or_default();
        let replica = fill(&self.replica, &other.replica)
            .map_err(|()| conflict("replica", index(self.replica), index(other.replica)))?;
        let task = fill(&self.task, &other.task)
            .map_err(|()| conflict("task", index(self.task), index(other.task)))?;

        let (device_type, device_id) = match fill(&self.device_type, &other.device_type) {
            Err(()) if allow_soft_placement => (other.device_type.clone(), other.device_id),
            Err(()) => {
                return Err(conflict(
                    "device type",
                    type_text(&self.device_type),
                    type_text(&other.device_type),
                ))
            }
            Ok(ty) => match fill(&self.device_id, &other.device_id) {
                Ok(id) => (ty, id),
                Err(()) if allow_soft_placement => (ty, other.device_id),
                Err(()) => {
                    return Err(conflict(
                        "device id",
                        index(self.device_id),
                        index(other.device_id),
                    ))
                }
            },
        };
        Ok(DeviceName {
            job,
            replica,
            task,
            device_type,
            device_id,
        })
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(job) = &self.job {
            write!(f, "/job:{job}")?;
        }
        if let Some(replica) = self.replica {
            write!(f, "/replica:{replica}")?;
        }
        if let Some(task) = self.task {
            write!(f, "/task:{task}")?;
        }
        match (&self.device_type, self.device_id) {
            (None, None) => Ok(()),
            (ty, id) => {
                let ty = ty.as_ref().map_or("*", DeviceType::as_str);
                match id {
                    Some(id) => write!(f, "/device:{ty}:{id}"),
                    None => write!(f, "/device:{ty}:*"),
                }
            }
        }
    }
}

impl FromStr for DeviceName {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DeviceName::parse(s)
    }
}

impl Serialize for DeviceName {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        DeviceName::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(s: &str) -> DeviceName {
        DeviceName::parse(s).unwrap()
    }

    fn err(s: &str) -> String {
        DeviceName::parse(s).unwrap_err().to_string()
    }

    #[test]
    fn parses_every_subset() {
        assert_eq!(
            p("/job:ps"),
            DeviceName {
                job: Some("ps".into()),
                ..Default::default()
            }
        );
        let wt = p("/job:worker/task:1");
        assert_eq!(wt.job.as_deref(), Some("worker"));
        assert_eq!((wt.replica, wt.task), (None, Some(1)));
        let d = p("/device:CPU:0");
        assert_eq!(d.device_type, Some(DeviceType::CPU));
        assert_eq!(d.device_id, Some(0));
        assert!(d.job.is_none());
        let full = p("/job:w/replica:0/task:0/device:GPU:1");
        assert_eq!(full, DeviceName::full("w", 0, DeviceType::GPU, 1));
        assert!(full.is_fully_specified());
        assert!(!wt.is_fully_specified());
        assert_eq!(p("/replica:3").replica, Some(3));
    }

    #[test]
    fn empty_is_unconstrained() {
        let d = p("");
        assert!(d.is_unconstrained());
        assert_eq!(d.to_string(), "");
        assert!(d.matches(&DeviceName::full("a", 1, DeviceType::CPU, 0)));
    }

    #[test]
    fn wildcards_and_short_device() {
        let d = p("/device:GPU:*");
        assert_eq!(d.device_type, Some(DeviceType::GPU));
        assert_eq!(d.device_id, None);
        assert_eq!(d.to_string(), "/device:GPU:*");
        assert_eq!(p("/device:GPU"), d);
        assert_eq!(p("/job:*/task:*"), DeviceName::default());
        let any_type = p("/device:*:2");
        assert_eq!((any_type.device_type, any_type.device_id), (None, Some(2)));
    }

    #[test]
    fn legacy_forms_normalise_type() {
        assert_eq!(p("/cpu:0"), p("/device:CPU:0"));
        assert_eq!(p("/gpu:1"), p("/device:GPU:1"));
        assert_eq!(p("/CPU:0"), p("/device:CPU:0"));
        assert_eq!(p("/device:gpu:3").device_type, Some(DeviceType::GPU));
        assert_eq!(p("/job:ps/gpu:*").to_string(), "/job:ps/device:GPU:*");
    }

    #[test]
    fn any_order_and_optional_slash() {
        let canonical = p("/job:worker/replica:0/task:2/device:CPU:0");
        assert_eq!(p("/device:CPU:0/task:2/replica:0/job:worker"), canonical);
        assert_eq!(p("job:worker/replica:0/task:2/cpu:0"), canonical);
        assert_eq!(
            p("/task:2/job:worker").to_string(),
            "/job:worker/task:2",
            "display is in grammar order"
        );
    }

    #[test]
    fn display_is_canonical() {
        assert_eq!(
            DeviceName::full("worker", 0, DeviceType::CPU, 0).to_string(),
            "/job:worker/replica:0/task:0/device:CPU:0"
        );
        assert_eq!(p("/job:ps/task:007").to_string(), "/job:ps/task:7");
    }

    #[test]
    fn error_messages_quote_input_and_part() {
        assert_eq!(
            err("/job:ps/task:x"),
            "invalid device \"/job:ps/task:x\": task index \"x\" is not a number"
        );
        assert_eq!(
            err("/job:ps/job:worker"),
            "invalid device \"/job:ps/job:worker\": job is given more than once"
        );
        assert!(err("/cpu:0/device:GPU:0").contains("device is given more than once"));
        assert!(err("/host:a").contains("unknown part \"host\""));
        assert!(err("/job:").contains("job name is empty"));
        assert!(err("/job:9ps").contains("job name \"9ps\" must start with a letter"));
        assert!(err("/job:p-s").contains("job name \"p-s\""));
        assert!(err("/task:4294967296").contains("task index \"4294967296\" is too large"));
        assert!(err("/replica:-1").contains("replica index \"-1\" is not a number"));
        assert!(err("/device:CPU:x").contains("device id \"x\" is not a number"));
        assert!(err("/device:CPU:0:1").contains("device id \"0:1\""));
        assert!(err("/device:C-PU:0").contains("device type \"C-PU\""));
        assert!(err("/device::0").contains("device type \"\""));
        assert!(err("/job:ps/").contains("empty part"));
        assert!(err("//job:ps").contains("empty part"));
        assert!(err("/").contains("empty part"));
        assert!(err("/worker").contains("part \"worker\" is not of the form key:value"));
        let long = format!("/job:{}", "w".repeat(70_000));
        let e = err(&long);
        assert!(e.contains("70005 bytes long") && e.len() < 300, "{e}");
        assert!(err(" /job:ps").contains("part \" \" is not of the form key:value"));
        assert_eq!(p("/task:4294967295").task, Some(u32::MAX));
        assert!(
            p("/job:Worker_2").job.is_some(),
            "upper case and digits are fine"
        );
    }

    #[test]
    fn error_variant_is_inspectable() {
        match DeviceName::parse("/task:x") {
            Err(DeviceError::Parse { input, problem }) => {
                assert_eq!(input, "/task:x");
                assert_eq!(
                    problem,
                    ParseProblem::NotANumber {
                        what: "task index",
                        text: "x".into()
                    }
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn from_str_and_serde_use_canonical_string() {
        let d: DeviceName = "/job:ps/cpu:0".parse().unwrap();
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(json, "\"/job:ps/device:CPU:0\"");
        let back: DeviceName = serde_json::from_str(&json).unwrap();
        assert_eq!(back, d);
        let bad = serde_json::from_str::<DeviceName>("\"/job:ps/task:x\"").unwrap_err();
        assert!(bad.to_string().contains("task index \"x\""), "{bad}");
        assert!(serde_json::from_str::<DeviceName>("3").is_err());
    }

    #[test]
    fn matches_partial_specs() {
        let concrete = DeviceName::full("worker", 1, DeviceType::CPU, 0);
        assert!(p("/job:worker").matches(&concrete));
        assert!(p("/job:worker/task:1/cpu:0").matches(&concrete));
        assert!(p("/device:CPU:*").matches(&concrete));
        assert!(!p("/job:ps").matches(&concrete));
        assert!(!p("/task:0").matches(&concrete));
        assert!(!p("/gpu:0").matches(&concrete));
        assert!(
            !p("/job:worker").matches(&p("/task:1")),
            "unset in concrete"
        );
    }

    #[test]
    fn task_name_needs_job_replica_task() {
        assert_eq!(
            DeviceName::full("ps", 3, DeviceType::CPU, 0)
                .task_name()
                .as_deref(),
            Some("/job:ps/replica:0/task:3")
        );
        assert_eq!(p("/job:ps/task:3").task_name(), None);
    }

    #[test]
    fn ordering_is_job_replica_task_type_id() {
        let mut v = [
            DeviceName::full("worker", 0, DeviceType::CPU, 0),
            DeviceName::full("ps", 1, DeviceType::CPU, 0),
            DeviceName::full("ps", 0, DeviceType::GPU, 10),
            DeviceName::full("ps", 0, DeviceType::GPU, 2),
            DeviceName::full("ps", 0, DeviceType::CPU, 0),
        ];
        v.sort();
        let s: Vec<String> = v.iter().map(ToString::to_string).collect();
        assert_eq!(
            s,
            [
                "/job:ps/replica:0/task:0/device:CPU:0",
                "/job:ps/replica:0/task:0/device:GPU:2",
                "/job:ps/replica:0/task:0/device:GPU:10",
                "/job:ps/replica:0/task:1/device:CPU:0",
                "/job:worker/replica:0/task:0/device:CPU:0",
            ]
        );
    }

    #[test]
    fn merge_fills_unset_parts() {
        let m = p("/job:ps").merge(&p("/task:1/cpu:0"), false).unwrap();
        assert_eq!(m.to_string(), "/job:ps/task:1/device:CPU:0");
        let same = p("/job:ps/task:1").merge(&p("/job:ps"), false).unwrap();
        assert_eq!(same, p("/job:ps/task:1"));
        assert_eq!(p("").merge(&p(""), false).unwrap(), p(""));
    }

    #[test]
    fn merge_conflicts_name_both_specs() {
        let e = p("/job:ps/task:0")
            .merge(&p("/job:worker"), true)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "cannot merge device \"/job:ps/task:0\" with \"/job:worker\": job \"ps\" conflicts with \"worker\""
        );
        let e = p("/task:0").merge(&p("/task:1"), true).unwrap_err();
        assert_eq!(
            e.to_string(),
            "cannot merge device \"/task:0\" with \"/task:1\": task 0 conflicts with 1"
        );
        let e = p("/replica:0").merge(&p("/replica:1"), true).unwrap_err();
        assert!(e.to_string().contains("replica 0 conflicts with 1"));
        let e = p("/gpu:0").merge(&p("/cpu:0"), false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "cannot merge device \"/device:GPU:0\" with \"/device:CPU:0\": device type GPU conflicts with CPU"
        );
        let e = p("/gpu:0").merge(&p("/gpu:1"), false).unwrap_err();
        assert!(
            e.to_string().contains("device id 0 conflicts with 1"),
            "{e}"
        );
    }

    #[test]
    fn merge_soft_placement_takes_others_type_and_id() {
        let m = p("/job:w/gpu:1").merge(&p("/cpu:0"), true).unwrap();
        assert_eq!(m.to_string(), "/job:w/device:CPU:0");
        // The id goes with the type even when the other leaves it unset.
        let m = p("/gpu:1").merge(&p("/device:CPU:*"), true).unwrap();
        assert_eq!(m.to_string(), "/device:CPU:*");
        let m = p("/gpu:1").merge(&p("/gpu:0"), true).unwrap();
        assert_eq!(m.to_string(), "/device:GPU:0");
        let m = p("/gpu:1").merge(&p("/device:*:3"), true).unwrap();
        assert_eq!(m.to_string(), "/device:GPU:3");
    }

    fn arb_device() -> impl Strategy<Value = DeviceName> {
        (
            proptest::option::of("[a-zA-Z][a-zA-Z0-9_]{0,8}"),
            proptest::option::of(any::<u32>()),
            proptest::option::of(any::<u32>()),
            proptest::option::of("[A-Z][A-Z0-9_]{0,6}"),
            proptest::option::of(any::<u32>()),
        )
            .prop_map(|(job, replica, task, device_type, device_id)| DeviceName {
                job,
                replica,
                task,
                device_type: device_type.and_then(|t| DeviceType::parse(&t)),
                device_id,
            })
    }

    proptest! {
        #[test]
        fn display_parse_round_trip(d in arb_device()) {
            let text = d.to_string();
            prop_assert_eq!(DeviceName::parse(&text).unwrap(), d.clone());
            prop_assert!(d.matches(&d));
            prop_assert_eq!(d.merge(&d, false).unwrap(), d);
        }

        #[test]
        fn garbage_never_panics(s in "\\PC*") {
            if let Ok(d) = DeviceName::parse(&s) {
                prop_assert_eq!(DeviceName::parse(&d.to_string()).unwrap(), d);
            }
        }

        #[test]
        fn devicey_garbage_never_panics(s in "(/?(job|task|replica|device|cpu|GPU|x)?:?[a-z0-9*:]{0,4}){0,5}") {
            if let Ok(d) = DeviceName::parse(&s) {
                prop_assert_eq!(DeviceName::parse(&d.to_string()).unwrap(), d);
            }
        }

        #[test]
        fn merge_result_satisfies_both_when_ok(a in arb_device(), b in arb_device()) {
            if let Ok(m) = a.merge(&b, false) {
                prop_assert!(a.matches(&m));
                prop_assert!(b.matches(&m));
            }
        }
    }
}
