//! The control plane's messages: what the chief and the other tasks of a job say to each other.
//!
//! Messages travel as the payload of [`FrameKind::Message`](dflow_transport::wire::FrameKind)
//! frames on the data plane's authenticated connections, so the frame header's length is
//! bounded by the receiver's message limit before anything is allocated. The payload is a
//! little-endian `u16` [`PROTOCOL_VERSION`] followed by the [`postcard`] encoding of a
//! [`Message`] (compact varint-based binary; every length inside is checked against the bytes
//! actually present before it is used).
//!
//! The conversation (chief = worker 0):
//!
//! | chief → task                | task → chief                                 |
//! |-----------------------------|----------------------------------------------|
//! | `Request{RegisterGraph}`    | `Reply{Registered}` or the error             |
//! | `Request{SetVariables}`     | `Reply{VariablesSet}` (checkpoint restore)   |
//! | `Request{RunStep}`          | `Reply{StepDone}` with fetched values        |
//! | `Request{GetVariables}`     | `Reply{Variables}` (checkpoint save)         |
//! | `Request{Reset}`            | `Reply{ResetDone}` (elastic re-plan)         |
//! | `Request{Connect}`          | `Reply{Connected}` (a worker joins)          |
//! | `AbortStep` (no reply)      |                                              |
//! | `Shutdown` (no reply)       |                                              |
//! |                             | `Ready` (connected to every task; serving)   |
//!
//! Liveness is the data plane's: heartbeats on idle connections and the idle timeout.

use dflow_graph::{DType, RendezvousKey, Tensor};
use serde::{Deserialize, Serialize};

/// The version this build speaks; a message of another version is rejected with both numbers.
/// Version 2: receive slots carry the job plan's byte size. Version 3: a [`DataSpec`] is a CSV
/// table or a text of character windows ([`DataKind`]). Version 4: [`Request::Reset`] (an
/// elastic job's re-plan). Version 5: [`Message::Ready`] and [`Request::Connect`] (a worker
/// joining an elastic job).
pub const PROTOCOL_VERSION: u16 = 5;

/// One control-plane message.
#[derive(Debug, Serialize, Deserialize)]
pub enum Message {
    /// Asks the receiver to do something; answered by a [`Message::Reply`] with the same `id`.
    Request {
        /// Chosen by the sender, unique among its outstanding requests.
        id: u64,
        /// What to do.
        body: Request,
    },
    /// The answer to request `id`: the result, or the error message naming what failed.
    Reply {
        /// The request answered.
        id: u64,
        /// The outcome.
        body: Result<Reply, String>,
    },
    /// Abort `step` everywhere: pending Recvs fail with `reason`.
    AbortStep {
        /// The step.
        step: u64,
        /// Why (names the failed task or key).
        reason: String,
    },
    /// The job is over. `failure: None` ends the task cleanly (exit 0); `Some(reason)` makes it
    /// exit non-zero with the reason.
    Shutdown {
        /// Why the job failed, if it did.
        failure: Option<String>,
    },
    /// Task → chief: this task connected to every other task and serves requests. The chief
    /// of an elastic job takes a `Ready` from a worker that is not (or no longer) in the job
    /// as a request to join it at the next step boundary; other chiefs ignore it.
    Ready,
}

/// What a [`Message::Request`] asks for.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// Install the partitions of one run signature on this task.
    RegisterGraph(RegisterGraph),
    /// Run one step of a registered graph.
    RunStep(RunStep),
    /// Send back every variable this task holds (for a checkpoint).
    GetVariables,
    /// Overwrite these variables (restoring a checkpoint); each must belong to a registered
    /// graph of this task.
    SetVariables(Vec<NamedTensor>),
    /// Open a listener for collective group `group`; the reply is its address.
    PrepareGroup {
        /// The group key (`workers`).
        group: String,
    },
    /// Connect to every other rank of `group` (their addresses, in rank order) as `rank`.
    JoinGroup {
        /// The group key.
        group: String,
        /// This task's rank.
        rank: u32,
        /// Every rank's address from `PrepareGroup`, in rank order.
        addrs: Vec<String>,
    },
    /// Drop every registered graph, variable and collective group (the job is re-planned on a
    /// new membership and registered again; its graphs initialize the variables anew unless
    /// the chief restores them).
    Reset,
    /// Open this task's data-plane connection to `task` at `address` (a worker joining the
    /// job: the tasks already in it connect to the newcomer before the re-plan).
    Connect {
        /// The task, `/job:J/replica:0/task:I`.
        task: String,
        /// Its cluster address, `host:port`.
        address: String,
    },
}

/// The successful answers.
#[derive(Debug, Serialize, Deserialize)]
pub enum Reply {
    /// The graph is registered.
    Registered,
    /// The step finished on this task.
    StepDone(StepDone),
    /// The variables of this task.
    Variables(Vec<NamedTensor>),
    /// The variables were set.
    VariablesSet,
    /// Where this task listens for its collective group.
    GroupAddress(String),
    /// This task joined the group.
    GroupJoined,
    /// The graphs and groups were dropped.
    ResetDone,
    /// The connection is open.
    Connected,
}

/// The partitions of one run signature that live on the receiving task, and how its
/// cross-task edges map onto data-plane slots.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RegisterGraph {
    /// The chief's id for this graph; `RunStep` names it.
    pub handle: u32,
    /// One dflow JSON graph per device of this task.
    pub partitions: Vec<PartitionDef>,
    /// Slots this task receives into (their buffers are allocated here, once).
    pub recv_slots: Vec<RecvSlot>,
    /// Where this task's outgoing keys go.
    pub send_routes: Vec<SendRoute>,
    /// Client feeds this task makes itself, from its own data.
    pub feeds: Vec<FeedBinding>,
    /// Client fetch keys this task receives and returns in [`StepDone::fetched`].
    pub fetches: Vec<RendezvousKey>,
    /// How this task reads its data, when it feeds any.
    pub data: Option<DataSpec>,
    /// True when the graph updates variables (counted for async staleness).
    pub updates_variables: bool,
}

/// One device's partition.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartitionDef {
    /// Full device name.
    pub device: String,
    /// The partition as a dflow JSON graph.
    pub graph_json: String,
}

/// A receive slot: `peer` sends `key` as slot `slot`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecvSlot {
    /// The job plan's global slot id of the pair.
    pub slot: u32,
    /// The sending task.
    pub peer: String,
    /// Rendezvous key `send;recv;tensor` (checked when the message is decoded).
    pub key: RendezvousKey,
    /// Element type name.
    pub dtype: String,
    /// Static shape.
    pub dims: Vec<u64>,
    /// Bytes per step, as the job plan sized the slot (checked against dtype and dims, and
    /// against the partition's Recv).
    pub bytes: u64,
}

/// An outgoing route: `key` goes to slot `slot` of `peer`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendRoute {
    /// Rendezvous key.
    pub key: RendezvousKey,
    /// The receiving task.
    pub peer: String,
    /// The slot there.
    pub slot: u32,
}

/// A client feed this task makes from its data.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FeedBinding {
    /// The feed's rendezvous key.
    pub key: RendezvousKey,
    /// What is fed.
    pub source: FeedSource,
}

/// What a feed carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FeedSource {
    /// The features of this task's part of the batch.
    Features,
    /// The labels of this task's part of the batch.
    Labels,
    /// This part's share of the batch, `n_part / n_batch`, as an f32 scalar.
    BatchWeight,
}

/// How a task reads and cuts the data it feeds, so every task sees the chief's examples.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DataSpec {
    /// The chief's path, used when the task was started without `--data`.
    pub path: String,
    /// Seed of the split and of the per-epoch shuffle (CSV), or of the windows (text).
    pub seed: u64,
    /// What the file holds and how it is cut into batches.
    pub kind: DataKind,
}

/// What a data file holds, and what a [`BatchRef`] names in it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum DataKind {
    /// A CSV table split into training and held-out rows; a [`BatchRef`] names batch `index`
    /// of epoch `epoch`'s shuffle of the training rows.
    Csv {
        /// Held-out fraction of the train/test split.
        test_fraction: f64,
        /// Rows the chief read: a task whose file differs fails instead of training on other
        /// data.
        rows: u64,
    },
    /// A text cut into random character windows (`train.data` `char_windows`); a [`BatchRef`]
    /// names training step `index` (epoch 0): its `batch_size` windows, drawn from the seed on
    /// the step's stream exactly as `dflow run --local` draws them.
    CharWindows {
        /// The vocabulary, its characters in id order (the chief's, or its checkpoint's).
        vocab: String,
        /// Tokens per window (inputs; the targets are shifted by one).
        block_size: u64,
        /// The held-out fraction at the end of the text.
        val_fraction: f64,
        /// Tokens in the chief's training split.
        train_tokens: u64,
        /// [`token_digest`](crate::data::text::token_digest) of the chief's training split: a
        /// task whose text differs fails instead of training on other data.
        digest: u64,
    },
}

/// Run one step of graph `handle`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunStep {
    /// The registered graph.
    pub handle: u32,
    /// The step id (unique in the job; part of every transfer of the step).
    pub step: u64,
    /// Which part of which batch this task feeds, when the graph has feeds here.
    pub batch: Option<BatchRef>,
}

/// Part `part` of `parts` of batch `index` of `epoch` of the training split (for a text:
/// of training step `index`, see [`DataKind::CharWindows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchRef {
    /// Epoch (selects the shuffle).
    pub epoch: u64,
    /// Batch within the epoch.
    pub index: u64,
    /// Global batch size.
    pub batch_size: u64,
    /// This task's part.
    pub part: u32,
    /// Number of parts the batch is split into.
    pub parts: u32,
}

/// A finished step on one task.
#[derive(Debug, Serialize, Deserialize)]
pub struct StepDone {
    /// Values of the graph's fetch keys on this task, in registration order.
    pub fetched: Vec<WireTensor>,
    /// Variable updates other steps applied on this task while this one ran (async staleness).
    pub concurrent_updates: u64,
}

/// A named tensor (a variable).
#[derive(Debug, Serialize, Deserialize)]
pub struct NamedTensor {
    /// Variable name.
    pub name: String,
    /// Its value.
    pub value: WireTensor,
}

/// A tensor on the wire: dtype name, dimensions, raw little-endian bytes.
#[derive(Debug, Serialize, Deserialize)]
pub struct WireTensor {
    /// Element type name (`f32`, ...).
    pub dtype: String,
    /// Dimensions.
    pub dims: Vec<u64>,
    /// The elements' bytes.
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}

impl WireTensor {
    /// Copies `t` for the wire.
    pub fn from_tensor(t: &Tensor) -> WireTensor {
        WireTensor {
            dtype: t.dtype().name().to_string(),
            dims: t.dims().iter().map(|&d| d as u64).collect(),
            bytes: t.as_bytes().to_vec(),
        }
    }

    /// The tensor; an error names what does not fit (unknown dtype, bytes vs. shape).
    pub fn to_tensor(&self) -> Result<Tensor, String> {
        let dtype: DType = self
            .dtype
            .parse()
            .map_err(|_| format!("unknown dtype `{}`", self.dtype))?;
        let dims = dims_usize(&self.dims)?;
        Tensor::from_bytes(dtype, &dims, &self.bytes).map_err(|e| e.to_string())
    }
}

/// Converts wire dimensions, refusing any that do not fit this machine's `usize`.
pub fn dims_usize(dims: &[u64]) -> Result<Vec<usize>, String> {
    dims.iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("dimension {d} is too large")))
        .collect()
}

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// Fewer than two bytes: no version.
    #[error("control message of {0} bytes is too short to hold a version")]
    Truncated(usize),
    /// Another protocol version.
    #[error("control message has protocol version {found}; this build speaks {PROTOCOL_VERSION}")]
    Version {
        /// What the message said.
        found: u16,
    },
    /// The body does not decode.
    #[error("malformed control message: {0}")]
    Malformed(String),
}

/// Encodes `m` with the version prefix.
pub fn encode(m: &Message) -> Vec<u8> {
    let out = PROTOCOL_VERSION.to_le_bytes().to_vec();
    // Writing into a Vec cannot fail for these types (no maps with non-string keys, no
    // unsupported serde features); fall back to an empty body that the receiver rejects.
    match postcard::to_extend(m, out) {
        Ok(v) => v,
        Err(_) => PROTOCOL_VERSION.to_le_bytes().to_vec(),
    }
}

/// Decodes a message, checking the version first.
pub fn decode(bytes: &[u8]) -> Result<Message, ProtocolError> {
    let (version, body) = match bytes {
        [a, b, rest @ ..] => (u16::from_le_bytes([*a, *b]), rest),
        _ => return Err(ProtocolError::Truncated(bytes.len())),
    };
    if version != PROTOCOL_VERSION {
        return Err(ProtocolError::Version { found: version });
    }
    let (m, rest) = postcard::take_from_bytes::<Message>(body)
        .map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(ProtocolError::Malformed(format!(
            "{} trailing bytes after the message",
            rest.len()
        )));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Message {
        Message::Request {
            id: 7,
            body: Request::RegisterGraph(RegisterGraph {
                handle: 3,
                partitions: vec![PartitionDef {
                    device: "/job:ps/replica:0/task:0/device:CPU:0".into(),
                    graph_json: "{\"nodes\": []}".into(),
                }],
                recv_slots: vec![RecvSlot {
                    slot: 1,
                    peer: "/job:worker/replica:0/task:0".into(),
                    key: RendezvousKey::new("a", "b", "g:0"),
                    dtype: "f32".into(),
                    dims: vec![64, 32],
                    bytes: 64 * 32 * 4,
                }],
                send_routes: vec![],
                feeds: vec![FeedBinding {
                    key: RendezvousKey::new("client", "w", "x:0"),
                    source: FeedSource::Features,
                }],
                fetches: vec![RendezvousKey::new("w", "client", "loss:0")],
                data: Some(DataSpec {
                    path: "examples/data/shakespeare.txt.gz".into(),
                    seed: 3,
                    kind: DataKind::CharWindows {
                        vocab: "\n !abc".into(),
                        block_size: 16,
                        val_fraction: 0.1,
                        train_tokens: 1000,
                        digest: 0xdead_beef,
                    },
                }),
                updates_variables: true,
            }),
        }
    }

    #[test]
    fn messages_round_trip() {
        let bytes = encode(&sample());
        let back = decode(&bytes).unwrap();
        assert_eq!(format!("{back:?}"), format!("{:?}", sample()));
        let t = Tensor::from_slice(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]).unwrap();
        let m = Message::Reply {
            id: 1,
            body: Ok(Reply::StepDone(StepDone {
                fetched: vec![WireTensor::from_tensor(&t)],
                concurrent_updates: 2,
            })),
        };
        let Message::Reply {
            body: Ok(Reply::StepDone(done)),
            ..
        } = decode(&encode(&m)).unwrap()
        else {
            panic!("wrong message")
        };
        let back = done.fetched[0].to_tensor().unwrap();
        assert_eq!(
            back.as_slice::<f32>().unwrap(),
            t.as_slice::<f32>().unwrap()
        );
        assert_eq!(back.dims(), &[2, 2]);
    }

    #[test]
    fn the_joining_messages_round_trip() {
        // A worker joining an elastic job says Ready; the chief asks the members to Connect.
        for m in [
            Message::Ready,
            Message::Request {
                id: 7,
                body: Request::Connect {
                    task: "/job:worker/replica:0/task:2".into(),
                    address: "127.0.0.1:2222".into(),
                },
            },
            Message::Reply {
                id: 7,
                body: Ok(Reply::Connected),
            },
        ] {
            let back = decode(&encode(&m)).unwrap();
            assert_eq!(format!("{back:?}"), format!("{m:?}"));
        }
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error_not_a_panic() {
        let bytes = encode(&sample());
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "prefix of {n} bytes decoded");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(matches!(decode(&extra), Err(ProtocolError::Malformed(_))));
        let mut other = bytes.clone();
        other[0] = 9;
        assert_eq!(
            decode(&other).unwrap_err(),
            ProtocolError::Version { found: 9 }
        );
        // A huge announced length inside the body is refused without allocating it.
        let mut hostile = PROTOCOL_VERSION.to_le_bytes().to_vec();
        hostile.extend([0, 7, 0]); // Request, id 7, RegisterGraph
        hostile.extend([3]); // handle
        hostile.extend([0xff, 0xff, 0xff, 0xff, 0x0f]); // 4 billion partitions
        assert!(decode(&hostile).is_err());
        // Flipping any byte never panics.
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0xa5;
            let _ = decode(&b);
        }
    }

    #[test]
    fn wire_tensors_are_checked() {
        let bad = WireTensor {
            dtype: "f32".into(),
            dims: vec![3],
            bytes: vec![0; 8],
        };
        assert!(bad.to_tensor().is_err());
        let unknown = WireTensor {
            dtype: "f13".into(),
            dims: vec![],
            bytes: vec![],
        };
        assert!(unknown.to_tensor().unwrap_err().contains("f13"));
    }
}
