//! What the planner knows about a cluster: devices per host, memory and FLOP/s per device, and
//! the bandwidth and latency of the two link classes (inside a host, between hosts). Presets
//! for this machine (as measured in BENCHMARKS.md) and for common GPU nodes (vendors' data
//! sheets, cited in docs/planner.md); a JSON profile file for calibrated numbers.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A class of link between two devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LinkClass {
    /// Both devices on one host (NVLink, shared memory).
    IntraHost,
    /// Devices on different hosts (InfiniBand, TCP).
    InterHost,
}

impl fmt::Display for LinkClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkClass::IntraHost => "intra-host",
            LinkClass::InterHost => "inter-host",
        })
    }
}

/// One link class: bandwidth per direction per device and the latency of one message.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Bytes per second a device sends over this class of link (per direction).
    pub bandwidth: f64,
    /// Seconds one message takes before its first byte arrives (α).
    pub latency: f64,
}

/// How parameters and activations are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// f32 everywhere (dflow today): 4-byte weights, gradients and optimizer moments.
    F32,
    /// Mixed precision as in the ZeRO and Megatron papers: 2-byte weights, gradients and
    /// activations, f32 master weights with the optimizer's moments.
    Mixed,
}

/// A cluster description for the planner (`--profile FILE` reads it as JSON).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterProfile {
    /// A name for reports.
    pub name: String,
    /// Devices per host: ranks `h·devices_per_host ..` share host `h`'s fast links.
    pub devices_per_host: usize,
    /// Bytes of memory per device.
    pub memory_per_device: u64,
    /// Sustained FLOP/s of one device on the model's matrix products.
    pub flops_per_second: f64,
    /// Links between devices of one host.
    pub intra_host: Link,
    /// Links between hosts.
    pub inter_host: Link,
    /// Storage precision of parameters and activations.
    pub precision: Precision,
    /// Seconds the runtime spends per op a device runs in a step, beyond its FLOPs (scheduling,
    /// allocation, dispatch): what makes a small model's step slower than its FLOPs say
    /// (`dflow bench calibrate` measures dflow's executor; 0 when not given).
    #[serde(default)]
    pub op_overhead: f64,
    /// Seconds per step independent of the model (the driver's feed, fetch and step dispatch;
    /// 0 when not given).
    #[serde(default)]
    pub step_overhead: f64,
    /// What a step of a real multi-task dflow job costs beyond its ops' arithmetic, measured by
    /// `dflow bench calibrate` on small 2-worker jobs (all 0 when not given: not modelled).
    #[serde(default)]
    pub job: JobCosts,
    /// Where the numbers come from.
    #[serde(default)]
    pub source: String,
}

/// The costs of dflow's distributed step path ([`super::runtime`]), in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobCosts {
    /// Per step: the chief's batching, the feeds to every task, the step's dispatch to each
    /// task and the loss fetch (the round trips of a step).
    pub step: f64,
    /// Per task per step, beyond `step`: the chief's feed to it, its share of the step's
    /// dispatch and fetch, its threads' wake-ups (a 4-task job pays it twice as often as a
    /// 2-task one; 0 when not given: older profiles).
    pub task: f64,
    /// Per op a task runs in its partition (its executor's dispatch of a node). In a job
    /// nearly every node is dispatched alone: its batch dimension is unknown to the executor's
    /// plan, so it is not one of the cheap nodes batched on one runner.
    pub op: f64,
    /// Per message a task sends in its collective calls (each a step with a peer: one for a
    /// 2-rank all-gather or small all-reduce, `n − 1` for a ring all-gather over `n` ranks),
    /// beyond its `bytes/β`: the link's latency, the handshake and the waits of a thread woken
    /// by the other side (0: the link's latency α alone). Profiles before the per-message
    /// count fitted it per call, which is one message for most 2-rank calls.
    pub collective: f64,
    /// Per value a task sends to another task's `Recv`, and per value it receives, beyond its
    /// `bytes/β`: the sender's call, the receiver's wake-up and the stage's wait on it (a
    /// pipeline's stages wait on each other's values; 0: priced as a collective call, as
    /// older profiles were).
    pub value: f64,
    /// Per matrix product (`MatMul`, `BatchMatMul`) beyond its FLOPs and its dispatch: a small
    /// product's floor (the GEMM's setup and packing: ~1 µs on this machine where a `Relu` on as
    /// few elements costs ~0.1 µs; 0: not modelled, older profiles).
    pub product: f64,
    /// CPU seconds each wait on the step's path (a value sent or received, a collective
    /// message between two computations) costs the host, beyond `collective` and `value`, when
    /// its tasks outnumber its cores: the peer may be without a core, and the waiting thread's
    /// bounded spin yields its core once per switch (0: not modelled, older profiles).
    pub beyond_cores: f64,
    /// Per node a task's executor hands to its compute pool alone (one of several expensive
    /// nodes readied at once; `runtime::spawns`), beyond `op`: the hand-off and another pool
    /// thread's wake-up (0: not modelled, older profiles).
    pub spawn: f64,
    /// Seconds per matrix-product FLOP, beyond `1 / flops_per_second`, when a host's tasks
    /// outnumber its cores: a product split over a task's pool threads waits for whichever has
    /// no core (0: not modelled, older profiles).
    pub beyond_cores_per_flop: f64,
    /// Seconds per byte a task sends (in collectives and to other tasks' `Recv`s), beyond the
    /// link's `1/β`: a job's messages of tens to hundreds of KiB move well below the bandwidth
    /// a 16 MiB call reaches (each chunk through a shared-memory slot waits for the peer's
    /// wake-up; the 2×32 GPT's 110 KiB gradient all-reduce at dp=2 took ~100 µs in a trace
    /// where `bytes/β` said 26 µs; 0: not modelled, older profiles).
    pub transfer_per_byte: f64,
    /// The FLOP/s a task of a job gets on the model's ops (0: the profile's
    /// `flops_per_second`): below a lone `MatMul`'s rate when the machine is loaded or the ops
    /// are memory-bound.
    pub flops_per_second: f64,
    /// Bytes per second the ops that are not products read and write in a job (elementwise
    /// ops, normalizations, reductions, copies, the optimizer's updates: memory-bound on a
    /// CPU; 0: not modelled, their FLOPs are priced at `flops_per_second` instead).
    pub bytes_per_second: f64,
    /// Elements per second of the ops that evaluate a transcendental function per element
    /// (`Gelu`, `GeluGrad`, `Tanh`, `Sigmoid`, `Exp`, `Log`: a `tanh` or `exp` each, an order of
    /// magnitude slower than a memory-bound op on a CPU; 0: priced by their bytes).
    pub transcendentals_per_second: f64,
}

impl JobCosts {
    /// The seconds a value sent to another task or received from one costs: `value`, else (an
    /// older profile) a collective message's.
    pub fn value_cost(&self) -> f64 {
        if self.value > 0.0 {
            self.value
        } else {
            self.collective
        }
    }
}

/// Why a profile is refused.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// No preset of that name.
    #[error("unknown preset `{name}`; the presets are: {}", PRESETS.join(", "))]
    UnknownPreset {
        /// The name given.
        name: String,
    },
    /// The JSON does not parse as a profile.
    #[error("profile {path}: {source} (see docs/planner.md for the format)")]
    Json {
        /// The file.
        path: String,
        /// Why.
        source: serde_json::Error,
    },
    /// A number that must be positive is not.
    #[error("profile {name}: {field} must be a positive number, got {value}")]
    NotPositive {
        /// The profile's name.
        name: String,
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
}

/// The preset names, in `--help` order.
pub const PRESETS: [&str; 3] = ["this-machine", "a100-80g-8x", "h100-80g-8x"];

const GB: f64 = 1e9;

/// `this-machine`'s executor cost per op dispatched alone, one thread (`dflow bench calibrate`,
/// 2026-11-24 18:14 UTC, load average 5: 0.24 µs; docs/planner.md).
const THIS_MACHINE_OP_OVERHEAD: f64 = 0.24e-6;
/// `this-machine`'s executor cost per in-process step (the same run: 23.4 µs).
const THIS_MACHINE_STEP_OVERHEAD: f64 = 23.4e-6;

/// `this-machine`'s job costs: `dflow bench calibrate` (release build, 2026-11-25 13:57 UTC,
/// the last of three idle rounds, nothing else running; the 19 jobs within 18% of the fit;
/// `tests/planner/this-machine-calibrated.json`, docs/planner.md). A loaded machine's steps are
/// slower: calibrate at the time and pass `--profile`.
const THIS_MACHINE_JOB: JobCosts = JobCosts {
    step: 0.0,
    task: 44.4e-6,
    op: 0.092e-6,
    collective: 6.6e-6,
    value: 26.6e-6,
    product: 0.0,
    beyond_cores: 3.4e-6,
    spawn: 0.49e-6,
    beyond_cores_per_flop: 0.59e-12,
    transfer_per_byte: 0.206e-9,
    flops_per_second: 107.0e9,
    bytes_per_second: 37.40e9,
    transcendentals_per_second: 331.8e6,
};

impl ClusterProfile {
    /// A preset by name (see [`PRESETS`] and docs/planner.md for the sources).
    pub fn preset(name: &str) -> Result<ClusterProfile, ProfileError> {
        let p = match name {
            // BENCHMARKS.md: MatMul 1024³ f32 one thread 78.1 GFLOP/s (issue 4); all-reduce
            // busbw at 64 MiB, 2 ranks: shm 9.7 GB/s, 4-byte 0.4 µs; TCP 3.12 GB/s, 4-byte
            // 6.3 µs (issue 8). One device = one worker process on one of the 2 cores; TCP on
            // 127.0.0.1 stands for the link between hosts. 25.3 GB of RAM over 2 devices.
            "this-machine" => ClusterProfile {
                name: name.into(),
                devices_per_host: 2,
                memory_per_device: 12_000_000_000,
                flops_per_second: 78.1e9,
                intra_host: Link {
                    bandwidth: 9.7 * GB,
                    latency: 0.4e-6,
                },
                inter_host: Link {
                    bandwidth: 3.12 * GB,
                    latency: 6.3e-6,
                },
                precision: Precision::F32,
                op_overhead: THIS_MACHINE_OP_OVERHEAD,
                step_overhead: THIS_MACHINE_STEP_OVERHEAD,
                job: THIS_MACHINE_JOB,
                source: "BENCHMARKS.md (MatMul issue 4; collectives over shm and TCP, issue 8; \
                         executor overheads and job costs: dflow bench calibrate, docs/planner.md)"
                    .into(),
            },
            // NVIDIA A100 80GB SXM data sheet: 312 TFLOPS BF16 dense, 600 GB/s NVLink (300 per
            // direction), 80 GB HBM2e; DGX A100: 8 GPUs, one 200 Gb/s HDR InfiniBand port per
            // GPU (25 GB/s). Sustained FLOP/s: 50% of peak (Megatron-LM 2021 reached 44–52%).
            "a100-80g-8x" => ClusterProfile {
                name: name.into(),
                devices_per_host: 8,
                memory_per_device: 80_000_000_000,
                flops_per_second: 0.5 * 312e12,
                intra_host: Link {
                    bandwidth: 300.0 * GB,
                    latency: 3e-6,
                },
                inter_host: Link {
                    bandwidth: 25.0 * GB,
                    latency: 5e-6,
                },
                precision: Precision::Mixed,
                op_overhead: 0.0,
                step_overhead: 0.0,
                job: JobCosts::default(),
                source: "NVIDIA A100 80GB and DGX A100 data sheets; 50% of peak sustained".into(),
            },
            // NVIDIA H100 SXM5 80GB data sheet: 989 TFLOPS BF16 dense, 900 GB/s NVLink (450 per
            // direction), 80 GB HBM3; DGX H100: 8 GPUs, one 400 Gb/s ConnectX-7 port per GPU
            // (50 GB/s). Sustained: 50% of peak.
            "h100-80g-8x" => ClusterProfile {
                name: name.into(),
                devices_per_host: 8,
                memory_per_device: 80_000_000_000,
                flops_per_second: 0.5 * 989e12,
                intra_host: Link {
                    bandwidth: 450.0 * GB,
                    latency: 3e-6,
                },
                inter_host: Link {
                    bandwidth: 50.0 * GB,
                    latency: 5e-6,
                },
                precision: Precision::Mixed,
                op_overhead: 0.0,
                step_overhead: 0.0,
                job: JobCosts::default(),
                source: "NVIDIA H100 SXM5 and DGX H100 data sheets; 50% of peak sustained".into(),
            },
            _ => {
                return Err(ProfileError::UnknownPreset {
                    name: name.to_string(),
                })
            }
        };
        Ok(p)
    }

    /// Parses a profile from JSON text (`path` names it in errors) and checks its numbers.
    pub fn from_json(text: &str, path: &str) -> Result<ClusterProfile, ProfileError> {
        let p: ClusterProfile =
            serde_json::from_str(text).map_err(|source| ProfileError::Json {
                path: path.to_string(),
                source,
            })?;
        p.check()?;
        Ok(p)
    }

    /// Checks that every rate, size and count is positive (latencies may be 0).
    pub fn check(&self) -> Result<(), ProfileError> {
        let bad = |field: &'static str, value: f64| ProfileError::NotPositive {
            name: self.name.clone(),
            field,
            value,
        };
        let positive = [
            ("devices_per_host", self.devices_per_host as f64),
            ("memory_per_device", self.memory_per_device as f64),
            ("flops_per_second", self.flops_per_second),
            ("intra_host.bandwidth", self.intra_host.bandwidth),
            ("inter_host.bandwidth", self.inter_host.bandwidth),
        ];
        for (field, value) in positive {
            if !(value.is_finite() && value > 0.0) {
                return Err(bad(field, value));
            }
        }
        for (field, value) in [
            ("intra_host.latency", self.intra_host.latency),
            ("inter_host.latency", self.inter_host.latency),
            ("op_overhead", self.op_overhead),
            ("step_overhead", self.step_overhead),
            ("job.step", self.job.step),
            ("job.task", self.job.task),
            ("job.op", self.job.op),
            ("job.bytes_per_second", self.job.bytes_per_second),
            (
                "job.transcendentals_per_second",
                self.job.transcendentals_per_second,
            ),
            ("job.collective", self.job.collective),
            ("job.value", self.job.value),
            ("job.product", self.job.product),
            ("job.beyond_cores", self.job.beyond_cores),
            ("job.spawn", self.job.spawn),
            ("job.beyond_cores_per_flop", self.job.beyond_cores_per_flop),
            ("job.transfer_per_byte", self.job.transfer_per_byte),
            ("job.flops_per_second", self.job.flops_per_second),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(bad(field, value));
            }
        }
        Ok(())
    }

    /// The link of `class`.
    pub fn link(&self, class: LinkClass) -> Link {
        match class {
            LinkClass::IntraHost => self.intra_host,
            LinkClass::InterHost => self.inter_host,
        }
    }

    /// The class of the link between ranks `a` and `b`.
    pub fn class(&self, a: usize, b: usize) -> LinkClass {
        if a / self.devices_per_host == b / self.devices_per_host {
            LinkClass::IntraHost
        } else {
            LinkClass::InterHost
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_check_and_round_trip_through_json() {
        for name in PRESETS {
            let p = ClusterProfile::preset(name).unwrap();
            p.check().unwrap();
            let text = serde_json::to_string_pretty(&p).unwrap();
            assert_eq!(ClusterProfile::from_json(&text, "x.json").unwrap(), p);
        }
        let e = ClusterProfile::preset("tpu").unwrap_err().to_string();
        assert!(e.contains("this-machine, a100-80g-8x, h100-80g-8x"), "{e}");
    }

    #[test]
    fn bad_profiles_name_the_field() {
        let mut p = ClusterProfile::preset("this-machine").unwrap();
        p.flops_per_second = 0.0;
        let text = serde_json::to_string(&p).unwrap();
        let e = ClusterProfile::from_json(&text, "p.json").unwrap_err();
        assert!(
            e.to_string()
                .contains("flops_per_second must be a positive"),
            "{e}"
        );
        let e = ClusterProfile::from_json("{\"name\": 3}", "p.json").unwrap_err();
        assert!(e.to_string().starts_with("profile p.json:"), "{e}");
    }

    #[test]
    fn runtime_overheads_default_to_zero_and_must_not_be_negative() {
        let mut p = ClusterProfile::preset("a100-80g-8x").unwrap();
        let mut json = serde_json::to_value(&p).unwrap();
        let fields = json.as_object_mut().unwrap();
        fields.remove("op_overhead");
        fields.remove("step_overhead");
        let old = ClusterProfile::from_json(&json.to_string(), "old.json").unwrap();
        assert_eq!((old.op_overhead, old.step_overhead), (0.0, 0.0));
        p.op_overhead = -1e-6;
        let e = ClusterProfile::from_json(&serde_json::to_string(&p).unwrap(), "p.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("op_overhead"), "{e}");
    }

    /// The per-value, per-product and beyond-the-cores costs are optional (0 in older
    /// profiles, which still load; a value then costs a collective message) and never negative.
    #[test]
    fn value_product_and_beyond_cores_costs_default_to_zero_and_must_not_be_negative() {
        let p = ClusterProfile::preset("this-machine").unwrap();
        let mut json = serde_json::to_value(&p).unwrap();
        let job = json["job"].as_object_mut().unwrap();
        job.remove("value");
        job.remove("product");
        job.remove("beyond_cores");
        job.remove("spawn");
        job.remove("beyond_cores_per_flop");
        job.remove("transfer_per_byte");
        let old = ClusterProfile::from_json(&json.to_string(), "old.json").unwrap();
        assert_eq!(
            (
                old.job.value,
                old.job.product,
                old.job.beyond_cores,
                old.job.spawn,
                old.job.beyond_cores_per_flop,
                old.job.transfer_per_byte
            ),
            (0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        );
        assert_eq!(old.job.value_cost(), old.job.collective);
        assert_eq!(p.job.value_cost(), p.job.value);
        for field in [
            "value",
            "product",
            "beyond_cores",
            "spawn",
            "beyond_cores_per_flop",
            "transfer_per_byte",
        ] {
            let mut bad = serde_json::to_value(&p).unwrap();
            bad["job"][field] = serde_json::json!(-1e-6);
            let e = ClusterProfile::from_json(&bad.to_string(), "p.json")
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("job.{field}")), "{e}");
        }
    }

    #[test]
    fn a_profile_from_before_the_per_task_cost_loads_with_it_at_zero() {
        // The `job` section as `dflow bench calibrate` wrote it before `task` existed.
        let mut json =
            serde_json::to_value(ClusterProfile::preset("this-machine").unwrap()).unwrap();
        json["job"] = serde_json::json!({
            "step": 149.9e-6, "op": 0.189e-6, "collective": 16.0e-6,
            "flops_per_second": 54.9e9, "bytes_per_second": 12.84e9,
            "transcendentals_per_second": 136.4e6
        });
        let old = ClusterProfile::from_json(&json.to_string(), "old.json").unwrap();
        assert_eq!(old.job.task, 0.0);
        assert_eq!(old.job.step, 149.9e-6);
        json["job"]["task"] = serde_json::json!(-1e-6);
        let e = ClusterProfile::from_json(&json.to_string(), "p.json").unwrap_err();
        assert!(e.to_string().contains("job.task"), "{e}");
    }

    #[test]
    fn link_class_follows_hosts() {
        let p = ClusterProfile::preset("a100-80g-8x").unwrap();
        assert_eq!(p.class(0, 7), LinkClass::IntraHost);
        assert_eq!(p.class(7, 8), LinkClass::InterHost);
    }
}
