//! One process of a distributed job: it listens at its cluster address, connects to every other
//! task (waiting for late starters up to a deadline), and then either serves the chief's
//! requests ([`Node::serve`]) or, on the chief, calls them ([`Rpc`]).

use super::protocol::{self, Message, Reply, Request};
use super::server::{ServerOptions, TaskServer};
use crate::error::ExecError;
use dflow_graph::ClusterSpec;
use dflow_transport::auth::{is_auth_failure, Secret, SECRET_ENV};
use dflow_transport::TcpConfig;
use dflow_transport::{plane, DataPlane, PeerEvent, TransportKind};
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// How a task joins its job.
#[derive(Clone)]
pub struct NodeOptions {
    /// Every task of the job and its address.
    pub cluster: ClusterSpec,
    /// This task's job (`ps`, `worker`).
    pub job: String,
    /// This task's index in its job.
    pub index: u32,
    /// The cluster secret every connection must prove it knows.
    pub secret: Option<Secret>,
    /// Longest a step or a request may take; also how long a silent peer is trusted.
    pub timeout: Duration,
    /// Longest this task waits for the other tasks to come up.
    pub startup_timeout: Duration,
    /// How the task server runs steps.
    pub server: ServerOptions,
    /// The transport between tasks.
    pub transport: TransportKind,
    /// This task's certificate, key and cluster CA, for [`TransportKind::Quic`] (without it,
    /// the plane loads them from `DFLOW_CERT_DIR`).
    pub quic_identity: Option<dflow_transport::quic::QuicIdentity>,
}

impl fmt::Debug for NodeOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeOptions")
            .field("job", &self.job)
            .field("index", &self.index)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("timeout", &self.timeout)
            .field("startup_timeout", &self.startup_timeout)
            .field("transport", &self.transport)
            .field("quic_identity", &self.quic_identity)
            .finish()
    }
}

/// Why a task of a distributed job stopped. Every message names the task, and the key or
/// request that was being waited on when there was one.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The task is not in the cluster, or its address is unusable.
    #[error("{0}")]
    Setup(String),
    /// Some tasks never came up.
    #[error("gave up after {secs} s waiting for {tasks} to start (last error: {last_error})")]
    Startup {
        /// Seconds waited.
        secs: u64,
        /// The tasks still missing.
        tasks: String,
        /// What the last connection attempt said.
        last_error: String,
    },
    /// Every other task this task reached refused its cluster secret (or this task refused
    /// theirs): its secret is the odd one out, and waiting will not mend that.
    #[error(
        "this task's cluster secret differs from that of every other task it reached ({tasks}): \
         each handshake failed authentication. Start this task with the same --secret-file (or \
         {SECRET_ENV}) as the rest of the job (first error: {first})"
    )]
    Authentication {
        /// The tasks reached.
        tasks: String,
        /// What the first one's handshake said.
        first: String,
    },
    /// A bounded wait before the job formed (registration) ended without what it waited for.
    #[error("gave up after {secs} s waiting for {what} (last error: {last_error})")]
    Waiting {
        /// Seconds waited.
        secs: u64,
        /// Whom or what it waited for.
        what: String,
        /// What the last attempt said.
        last_error: String,
    },
    /// A task died or became unreachable.
    #[error("task {task} is gone ({cause}){waiting}")]
    PeerGone {
        /// The task.
        task: String,
        /// What the data plane saw.
        cause: String,
        /// What this task was waiting for at that moment (`; waiting for ...`), if anything.
        waiting: String,
    },
    /// A request got no answer in time.
    #[error("{what} on task {task}: no reply within {secs} s")]
    Timeout {
        /// The request.
        what: String,
        /// The task asked.
        task: String,
        /// Seconds waited.
        secs: u64,
    },
    /// A request failed on the task that ran it.
    #[error("{what} failed on task {task}: {message}")]
    Remote {
        /// The request.
        what: String,
        /// The task.
        task: String,
        /// Its error.
        message: String,
    },
    /// The chief ended the job because of a failure elsewhere.
    #[error("the chief ended the job: {0}")]
    Aborted(String),
    /// A local step failed.
    #[error(transparent)]
    Exec(#[from] ExecError),
}

/// This process's place in the job, connected to every other task.
#[derive(Debug)]
pub struct Node {
    /// This task, `/job:J/replica:0/task:I`.
    pub task: String,
    /// The chief, `/job:worker/replica:0/task:0`.
    pub chief: String,
    /// Every other task.
    pub peers: Vec<String>,
    /// The data plane (and the control plane's transport).
    pub rendezvous: Arc<dyn DataPlane>,
    /// This task's server.
    pub server: Arc<TaskServer>,
    events: mpsc::UnboundedReceiver<PeerEvent>,
    timeout: Duration,
}

/// A task bound to its address that has not connected to the others yet (see [`Node::listen`]).
pub struct Listening {
    task: String,
    rendezvous: Arc<dyn DataPlane>,
    server: Arc<TaskServer>,
    events: mpsc::UnboundedReceiver<PeerEvent>,
    timeout: Duration,
    startup_timeout: Duration,
}

impl fmt::Debug for Listening {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listening")
            .field("task", &self.task)
            .field("local_addr", &self.rendezvous.local_addr())
            .finish()
    }
}

impl Listening {
    /// The address the data plane listens on (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.rendezvous.local_addr()
    }

    /// Connects to every other task of `cluster`, retrying until the startup timeout.
    pub async fn join(self, cluster: &ClusterSpec) -> Result<Node, JobError> {
        if cluster.num_tasks("worker") == 0 {
            return Err(JobError::Setup(
                "the cluster has no `worker` job: worker 0 is the chief".into(),
            ));
        }
        let task = self.task;
        let peers: Vec<(String, String)> = cluster
            .jobs()
            .flat_map(|job| {
                cluster
                    .tasks(job)
                    .map(move |(i, addr)| (task_name(job, i), addr.to_string()))
            })
            .filter(|(name, _)| *name != task)
            .collect();
        if peers.len() + 1 != cluster.task_names().len() {
            return Err(JobError::Setup(format!(
                "task {task} is not in the cluster (tasks: {})",
                cluster.task_names().join(", ")
            )));
        }
        connect_all(&self.rendezvous, &peers, self.startup_timeout).await?;
        Ok(Node {
            chief: task_name("worker", 0),
            peers: peers.into_iter().map(|(n, _)| n).collect(),
            task,
            rendezvous: self.rendezvous,
            server: self.server,
            events: self.events,
            timeout: self.timeout,
        })
    }
}

/// `/job:J/replica:0/task:I`.
pub fn task_name(job: &str, index: u32) -> String {
    format!("/job:{job}/replica:0/task:{index}")
}

/// The socket address to bind for a cluster address: an IP literal as given, a host name on
/// every interface.
pub fn bind_addr(address: &str) -> Result<SocketAddr, JobError> {
    let (host, port) = address
        .rsplit_once(':')
        .ok_or_else(|| JobError::Setup(format!("address `{address}` has no port")))?;
    let port: u16 = port
        .parse()
        .map_err(|_| JobError::Setup(format!("address `{address}`: bad port `{port}`")))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    // An IP literal is bound as given; a host name listens on every interface (its address
    // may be a service name that resolves elsewhere, as in Kubernetes).
    let ip = host
        .parse::<IpAddr>()
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    Ok(SocketAddr::new(ip, port))
}

impl Node {
    /// Binds this task's address and connects to every other task, retrying until
    /// `startup_timeout`; logs which tasks it still waits for.
    pub async fn start(opts: &NodeOptions) -> Result<Node, JobError> {
        let task = task_name(&opts.job, opts.index);
        let address = opts
            .cluster
            .address(&opts.job, opts.index)
            .ok_or_else(|| {
                JobError::Setup(format!(
                    "task {task} is not in the cluster (tasks: {})",
                    opts.cluster.task_names().join(", ")
                ))
            })?
            .to_string();
        let host = address
            .rsplit_once(':')
            .map(|(h, _)| h.to_string())
            .unwrap_or_else(|| "127.0.0.1".into());
        Node::listen(opts, bind_addr(&address)?, &host)
            .await?
            .join(&opts.cluster)
            .await
    }

    /// Binds this task's data plane at `bind` (port 0: any free port) without knowing the
    /// cluster yet; `host` is the name the other tasks reach it by. [`Listening::join`]
    /// connects once the cluster is known (registration learns it after binding).
    pub async fn listen(
        opts: &NodeOptions,
        bind: SocketAddr,
        host: &str,
    ) -> Result<Listening, JobError> {
        let task = task_name(&opts.job, opts.index);
        let config = TcpConfig {
            idle_timeout: opts.timeout,
            frame_timeout: opts.timeout,
            connect_timeout: Duration::from_secs(5).min(opts.startup_timeout),
            heartbeat_interval: Some(opts.timeout / 4),
            ..TcpConfig::default()
        };
        let rendezvous = plane::bind_with_identity(
            opts.transport,
            &task,
            bind,
            config,
            opts.secret.clone(),
            opts.quic_identity.clone(),
        )
        .await
        .map_err(|e| JobError::Setup(format!("task {task} cannot listen on {bind}: {e}")))?;
        let events = rendezvous.subscribe();
        tracing::info!("{task} listening on {}", rendezvous.local_addr());
        let mut server_opts = opts.server.clone();
        server_opts.host = host.to_string();
        server_opts.secret = opts.secret.clone();
        // Shared memory for the data plane means every task is on this host: collective groups
        // use it too.
        server_opts.shm_collectives = opts.transport == TransportKind::Shm;
        let server = Arc::new(TaskServer::new(&task, rendezvous.clone(), &server_opts)?);
        Ok(Listening {
            task,
            rendezvous,
            server,
            events,
            timeout: opts.timeout,
            startup_timeout: opts.startup_timeout,
        })
    }

    /// True on the chief.
    pub fn is_chief(&self) -> bool {
        self.task == self.chief
    }

    /// Serves the chief's requests until it says the job is over: `Ok` on a clean shutdown,
    /// an error naming the cause when the chief aborts the job or disappears.
    pub async fn serve(mut self) -> Result<(), JobError> {
        // Tell the chief this task is up: an elastic job's chief takes it in at its next step
        // boundary when it is not in the job (a replacement for a dead worker).
        if let Err(e) = self
            .rendezvous
            .send_message(&self.chief, protocol::encode(&Message::Ready))
        {
            tracing::warn!("{}: cannot tell the chief it is ready: {e}", self.task);
        }
        let result = loop {
            let Some(event) = self.events.recv().await else {
                break Err(JobError::Aborted("the data plane stopped".into()));
            };
            match event {
                PeerEvent::Message { peer, body } => {
                    if *peer != *self.chief {
                        tracing::warn!("{}: ignoring a control message from `{peer}`: only the chief {} controls this task", self.task, self.chief);
                        continue;
                    }
                    let message = match protocol::decode(&body) {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::error!(
                                "{}: dropping a message from the chief: {e}",
                                self.task
                            );
                            continue;
                        }
                    };
                    match message {
                        Message::Request { id, body } => {
                            let server = self.server.clone();
                            let rv = self.rendezvous.clone();
                            let chief = self.chief.clone();
                            tokio::spawn(async move {
                                let reply = answer(server, &rv, body).await;
                                let bytes = protocol::encode(&Message::Reply { id, body: reply });
                                if let Err(e) = rv.send_message(&chief, bytes) {
                                    tracing::error!("cannot answer the chief: {e}");
                                }
                            });
                        }
                        Message::AbortStep { step, reason } => {
                            self.server.abort_step(step, &reason)
                        }
                        Message::Shutdown { failure: None } => break Ok(()),
                        Message::Shutdown { failure: Some(f) } => break Err(JobError::Aborted(f)),
                        Message::Reply { .. } | Message::Ready => {
                            tracing::warn!("{}: unexpected message from the chief", self.task)
                        }
                    }
                }
                PeerEvent::Gone { peer, cause } => {
                    if *peer == *self.chief {
                        let waiting = describe_waiting(&self.server);
                        break Err(self
                            .after_chief_gone(peer.to_string(), cause, waiting)
                            .await);
                    }
                    // Another task: the chief sees it too and ends the job if it matters (a
                    // step waiting on it fails here); at the end of a job tasks leave in any
                    // order, so this is not an error by itself.
                    tracing::debug!("{}: `{peer}` is gone: {cause}", self.task);
                }
            }
        };
        self.rendezvous.close(Duration::from_secs(2)).await;
        result
    }

    /// Why the job ended, once the chief's connection is gone. A chief that ends a failed job
    /// sends every task its reason and then closes; this task may see the closed connection
    /// (a broken pipe on a reply it was writing) before it reads that reason. So it reads what
    /// is still arriving for up to [`CHIEF_LAST_WORDS`]: the chief's reason (naming the task that
    /// failed) wins over "the chief is gone", which is the answer only when the chief said
    /// nothing (it died).
    async fn after_chief_gone(
        &mut self,
        chief: String,
        cause: String,
        waiting: String,
    ) -> JobError {
        let deadline = tokio::time::Instant::now() + CHIEF_LAST_WORDS;
        while let Ok(Some(event)) = tokio::time::timeout_at(deadline, self.events.recv()).await {
            let PeerEvent::Message { peer, body } = event else {
                continue;
            };
            if *peer != *self.chief {
                continue;
            }
            match protocol::decode(&body) {
                Ok(Message::Shutdown { failure: Some(f) }) => return JobError::Aborted(f),
                Ok(Message::Shutdown { failure: None }) => break,
                _ => {}
            }
        }
        JobError::PeerGone {
            task: chief,
            cause,
            waiting,
        }
    }

    /// Splits off the chief's request client; its event pump runs until the data plane stops.
    pub fn into_rpc(self) -> Rpc {
        let inner = Arc::new(RpcInner {
            pending: Mutex::default(),
            failed: Mutex::default(),
            members: Mutex::new(self.peers.iter().cloned().collect()),
            ready: Mutex::default(),
            next_id: AtomicU64::new(1),
        });
        tokio::spawn(pump(inner.clone(), self.events, self.server.clone()));
        Rpc {
            task: self.task,
            peers: self.peers,
            rendezvous: self.rendezvous,
            server: self.server,
            inner,
            timeout: self.timeout,
        }
    }
}

/// How long a task keeps reading after its chief's connection closed, for the chief's last
/// message (the reason it ended the job): see `Node::after_chief_gone`.
const CHIEF_LAST_WORDS: Duration = Duration::from_millis(500);

fn describe_waiting(server: &TaskServer) -> String {
    let waiting = server.waiting_for();
    if waiting.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = waiting
        .iter()
        .map(|(step, keys)| {
            let keys: Vec<String> = keys
                .iter()
                .map(|k| format!("`{}` from {}", k.tensor_name(), k.send_device()))
                .collect();
            format!("step {step}: {}", keys.join(", "))
        })
        .collect();
    format!("; was waiting for {}", parts.join("; "))
}

/// Remembers `error` for task `name`: its distinct errors, latest last, at most 3.
fn note_error<'a>(errors: &mut HashMap<&'a str, Vec<String>>, name: &'a str, error: String) {
    let seen = errors.entry(name).or_default();
    seen.retain(|s| *s != error);
    seen.push(error);
    if seen.len() > 3 {
        seen.remove(0);
    }
}

/// The error to stop with when this task's cluster secret is the odd one out: no task of the
/// `total` others accepted it, and every one still `missing` answered, each with an
/// authentication failure (a task not up yet answers otherwise, so this waits for it). Where
/// some tasks authenticated this one, the failing ones are the odd ones out: this task keeps
/// waiting for them (they stop, and may be restarted with the right secret) and names them.
fn odd_secret_out(
    total: usize,
    missing: &[&(String, String)],
    last_errors: &HashMap<&str, Vec<String>>,
) -> Option<JobError> {
    if missing.len() != total || missing.is_empty() {
        return None;
    }
    let mut first = None;
    for (name, _) in missing {
        let latest = last_errors.get(name.as_str())?.last()?;
        if !is_auth_failure(latest) {
            return None;
        }
        first.get_or_insert(latest);
    }
    let tasks: Vec<&str> = missing.iter().map(|(n, _)| n.as_str()).collect();
    Some(JobError::Authentication {
        tasks: tasks.join(", "),
        first: first?.clone(),
    })
}

async fn connect_all(
    rv: &Arc<dyn DataPlane>,
    peers: &[(String, String)],
    within: Duration,
) -> Result<(), JobError> {
    let start = Instant::now();
    let mut missing: Vec<&(String, String)> = peers.iter().collect();
    // The distinct errors seen for each task, latest last (a refused certificate must not
    // hide behind a later timeout, nor behind another task's error).
    let mut last_errors: HashMap<&str, Vec<String>> = HashMap::new();
    let mut last_log = Instant::now();
    let mut pause = Duration::from_millis(50);
    loop {
        let mut still = Vec::new();
        for p in missing {
            let (name, addr) = p;
            let resolved = match tokio::net::lookup_host(addr.as_str()).await {
                Ok(mut a) => a.next(),
                Err(e) => {
                    note_error(&mut last_errors, name, format!("{name} at {addr}: {e}"));
                    None
                }
            };
            let Some(sa) = resolved else {
                still.push(p);
                continue;
            };
            match rv.clone().connect(name.clone(), sa).await {
                Ok(()) => tracing::info!("connected to {name} at {addr}"),
                Err(e) => {
                    note_error(&mut last_errors, name, e.to_string());
                    still.push(p);
                }
            }
        }
        missing = still;
        if missing.is_empty() {
            return Ok(());
        }
        if let Some(e) = odd_secret_out(peers.len(), &missing, &last_errors) {
            return Err(e);
        }
        let names: Vec<&str> = missing.iter().map(|(n, _)| n.as_str()).collect();
        if start.elapsed() >= within {
            let errors: Vec<String> = names
                .iter()
                .filter_map(|n| last_errors.get(n).map(|e| e.join(" / ")))
                .collect();
            return Err(JobError::Startup {
                secs: within.as_secs(),
                tasks: names.join(", "),
                last_error: if errors.is_empty() {
                    "none yet".into()
                } else {
                    errors.join("; ")
                },
            });
        }
        if last_log.elapsed() >= Duration::from_secs(2) {
            // A refused handshake (a different or missing cluster secret) will not fix itself:
            // say so instead of only waiting.
            // Any such error seen counts, not only the latest: a task that failed
            // authentication and then exited answers "connection refused" afterwards.
            let refused: Vec<&str> = names
                .iter()
                .filter_map(|n| {
                    last_errors
                        .get(n)
                        .and_then(|e| e.iter().rev().find(|e| e.contains("secret")))
                })
                .map(String::as_str)
                .collect();
            let why = if refused.is_empty() {
                String::new()
            } else {
                format!(" (last error: {})", refused.join("; "))
            };
            tracing::info!("waiting for {} to start{why}", names.join(", "));
            eprintln!(
                "{}: waiting for {} to start{why}",
                rv.task(),
                names.join(", ")
            );
            last_log = Instant::now();
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// Answers the chief's request `req`: a [`Request::Connect`] on the data plane `rv`, the
/// others on this task's server (off the async runtime).
async fn answer(
    server: Arc<TaskServer>,
    rv: &Arc<dyn DataPlane>,
    req: Request,
) -> Result<Reply, String> {
    match req {
        Request::Connect { task, address } => connect_peer(rv, &task, &address)
            .await
            .map(|()| Reply::Connected),
        other => handle_blocking(server, other).await,
    }
}

/// Opens `rv`'s connection to `task` at `address` (resolved here; the plane bounds the
/// connect itself).
async fn connect_peer(rv: &Arc<dyn DataPlane>, task: &str, address: &str) -> Result<(), String> {
    let resolved = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::lookup_host(address.to_string()),
    )
    .await
    .map_err(|_| format!("resolving {task}'s address {address}: no answer within 10 s"))?
    .map_err(|e| format!("resolving {task}'s address {address}: {e}"))?
    .next()
    .ok_or_else(|| format!("{task}'s address {address} resolves to nothing"))?;
    rv.clone()
        .connect(task.to_string(), resolved)
        .await
        .map_err(|e| format!("connecting to {task} at {address}: {e}"))?;
    tracing::info!("{}: connected to {task} at {address}", rv.task());
    Ok(())
}

/// Runs a request on this task's server, off the async runtime.
async fn handle_blocking(server: Arc<TaskServer>, req: Request) -> Result<Reply, String> {
    tokio::task::spawn_blocking(move || handle(&server, req))
        .await
        .unwrap_or_else(|e| Err(format!("the request handler failed: {e}")))
}

fn handle(server: &TaskServer, req: Request) -> Result<Reply, String> {
    match req {
        Request::RegisterGraph(g) => server.register(&g).map(|()| Reply::Registered),
        Request::RunStep(r) => server.run_step(&r).map(Reply::StepDone),
        Request::GetVariables => Ok(Reply::Variables(server.variables())),
        Request::SetVariables(v) => server.set_variables(&v).map(|()| Reply::VariablesSet),
        Request::PrepareGroup { group } => server.prepare_group(&group).map(Reply::GroupAddress),
        Request::JoinGroup { group, rank, addrs } => server
            .join_group(&group, rank as usize, &addrs)
            .map(|()| Reply::GroupJoined),
        Request::Reset => {
            server.reset();
            Ok(Reply::ResetDone)
        }
        Request::Connect { task, .. } => Err(format!(
            "Connect to {task} needs the data plane (answered by `answer`)"
        )),
    }
}

/// An outstanding request: the task asked, what was asked, and where the reply goes.
type Pending = HashMap<u64, (String, String, oneshot::Sender<Result<Reply, JobError>>)>;

#[derive(Debug)]
struct RpcInner {
    pending: Mutex<Pending>,
    /// Set once a task died (task, cause, what was waited for): every later call fails with it.
    failed: Mutex<Option<(String, String, String)>>,
    /// The tasks of the job now (an elastic job drops the dead ones): the loss of another
    /// connection is not a failure of the job.
    members: Mutex<BTreeSet<String>>,
    /// Tasks that said [`Message::Ready`] and have not gone since (see [`Rpc::joining`]).
    ready: Mutex<BTreeSet<String>>,
    next_id: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Delivers replies to their callers; on a task's death fails every outstanding call with it.
async fn pump(
    inner: Arc<RpcInner>,
    mut events: mpsc::UnboundedReceiver<PeerEvent>,
    server: Arc<TaskServer>,
) {
    while let Some(event) = events.recv().await {
        match event {
            PeerEvent::Message { peer, body } => match protocol::decode(&body) {
                Ok(Message::Reply { id, body }) => {
                    let waiter = lock(&inner.pending).remove(&id);
                    match waiter {
                        Some((task, _, tx)) if task == *peer => {
                            let _ = tx.send(body.map_err(|message| JobError::Remote {
                                what: String::new(),
                                task: task.clone(),
                                message,
                            }));
                        }
                        Some((task, what, tx)) => {
                            // Not from the task asked: put it back, drop the impostor's reply.
                            lock(&inner.pending).insert(id, (task, what, tx));
                            tracing::warn!(
                                "ignoring a reply from `{peer}` to a request it was not sent"
                            );
                        }
                        // After a failure the outstanding calls were failed already.
                        None if lock(&inner.failed).is_some() => {}
                        None => {
                            tracing::warn!("ignoring a reply from `{peer}` to unknown request {id}")
                        }
                    }
                }
                Ok(Message::Ready) => {
                    lock(&inner.ready).insert(peer.to_string());
                }
                Ok(_) => tracing::warn!("the chief ignores requests (from `{peer}`)"),
                Err(e) => tracing::error!("dropping a message from `{peer}`: {e}"),
            },
            PeerEvent::Gone { peer, cause } => {
                lock(&inner.ready).remove(&*peer);
                // Held until the failure is recorded, so that a concurrent `drop_tasks` of this
                // peer either sees the failure (and forgets it) or makes this event moot.
                let members = lock(&inner.members);
                if !members.contains(&*peer) {
                    drop(members);
                    tracing::warn!("dropped connection from `{peer}`: {cause}");
                    continue;
                }
                let calls: Vec<_> = lock(&inner.pending).drain().collect();
                let mut asked: Vec<&str> = calls
                    .iter()
                    .filter(|(_, (task, _, _))| *task == *peer)
                    .map(|(_, (_, what, _))| what.as_str())
                    .collect();
                asked.sort();
                let mut waiting = describe_waiting(&server);
                if !asked.is_empty() {
                    waiting.push_str(&format!(
                        "; the chief was waiting for its reply to {}",
                        asked.join(", ")
                    ));
                }
                {
                    let mut failed = lock(&inner.failed);
                    if failed.is_none() {
                        *failed = Some((peer.to_string(), cause.clone(), waiting.clone()));
                    }
                }
                drop(members);
                for (_, (_, _, tx)) in calls {
                    let _ = tx.send(Err(JobError::PeerGone {
                        task: peer.to_string(),
                        cause: cause.clone(),
                        waiting: waiting.clone(),
                    }));
                }
            }
        }
    }
}

/// The chief's client for requests to every task (its own included, served in-process).
#[derive(Debug, Clone)]
pub struct Rpc {
    /// The chief's task name.
    pub task: String,
    /// Every other task.
    pub peers: Vec<String>,
    /// The data plane.
    pub rendezvous: Arc<dyn DataPlane>,
    /// The chief's own server.
    pub server: Arc<TaskServer>,
    inner: Arc<RpcInner>,
    timeout: Duration,
}

impl Rpc {
    /// The first task failure seen, if any, with what the chief was waiting for then.
    pub fn failure(&self) -> Option<JobError> {
        lock(&self.inner.failed)
            .clone()
            .map(|(task, cause, waiting)| JobError::PeerGone {
                task,
                cause,
                waiting,
            })
    }

    /// The tasks of the job now, other than the chief (see [`Rpc::drop_tasks`]).
    pub fn members(&self) -> Vec<String> {
        lock(&self.inner.members).iter().cloned().collect()
    }

    /// Drops `dead` from the job and forgets the failure they caused, so that the chief can
    /// go on with the survivors (an elastic job): later calls to the survivors succeed again,
    /// and a lost connection to a dropped task is no longer a failure.
    pub fn drop_tasks(&self, dead: &[String]) {
        // Lock order: members, then failed (as the event pump).
        let mut members = lock(&self.inner.members);
        for d in dead {
            members.remove(d);
        }
        *lock(&self.inner.failed) = None;
    }

    /// Tasks that are up and connected (they said [`Message::Ready`]) but not in the job: a
    /// replacement for a dead worker, which an elastic job takes in (see [`Rpc::admit`]).
    pub fn joining(&self) -> Vec<String> {
        let members = lock(&self.inner.members);
        lock(&self.inner.ready)
            .iter()
            .filter(|t| !members.contains(*t) && **t != self.task)
            .cloned()
            .collect()
    }

    /// Takes `task` into the job: the chief connects to it at `address`, and from then on its
    /// loss is a failure of the job again (an elastic job drops it then).
    pub async fn admit(&self, task: &str, address: &str) -> Result<(), JobError> {
        connect_peer(&self.rendezvous, task, address)
            .await
            .map_err(|cause| JobError::PeerGone {
                task: task.to_string(),
                cause,
                waiting: "; the chief was taking it into the job".into(),
            })?;
        lock(&self.inner.members).insert(task.to_string());
        Ok(())
    }

    /// Forgets that `task` said it is ready (it could not be taken in): it is not offered by
    /// [`Rpc::joining`] again until it says so anew.
    pub fn forget_ready(&self, task: &str) {
        lock(&self.inner.ready).remove(task);
    }

    /// Sends `req` to `task` and waits for its reply, at most the job timeout (`extra` added
    /// for requests that take longer, e.g. registering large graphs).
    pub async fn call(&self, task: &str, req: Request, what: &str) -> Result<Reply, JobError> {
        if task == self.task {
            return answer(self.server.clone(), &self.rendezvous, req)
                .await
                .map_err(|message| JobError::Remote {
                    what: what.to_string(),
                    task: task.to_string(),
                    message,
                });
        }
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.inner.pending).insert(id, (task.to_string(), what.to_string(), tx));
        let bytes = protocol::encode(&Message::Request { id, body: req });
        if let Err(e) = self.rendezvous.send_message(task, bytes) {
            lock(&self.inner.pending).remove(&id);
            return Err(JobError::PeerGone {
                task: task.to_string(),
                cause: e.to_string(),
                waiting: format!("; the chief was sending {what}"),
            });
        }
        match tokio::time::timeout(self.timeout + Duration::from_secs(5), rx).await {
            Ok(Ok(Ok(reply))) => Ok(reply),
            Ok(Ok(Err(JobError::Remote { task, message, .. }))) => Err(JobError::Remote {
                what: what.to_string(),
                task,
                message,
            }),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(JobError::Aborted("the chief's event pump stopped".into())),
            Err(_) => {
                lock(&self.inner.pending).remove(&id);
                Err(JobError::Timeout {
                    what: what.to_string(),
                    task: task.to_string(),
                    secs: (self.timeout + Duration::from_secs(5)).as_secs(),
                })
            }
        }
    }

    /// Tells every other task to abort `step`.
    pub fn abort_step(&self, step: u64, reason: &str) {
        self.server.abort_step(step, reason);
        for p in &self.members() {
            let bytes = protocol::encode(&Message::AbortStep {
                step,
                reason: reason.to_string(),
            });
            let _ = self.rendezvous.send_message(p, bytes);
        }
    }

    /// Tells every task the job is over (`failure` says why it failed) and closes the
    /// connections once the messages are out.
    pub async fn shutdown(&self, failure: Option<String>) {
        for p in &self.members() {
            let bytes = protocol::encode(&Message::Shutdown {
                failure: failure.clone(),
            });
            let _ = self.rendezvous.send_message(p, bytes);
        }
        self.rendezvous.close(Duration::from_secs(2)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(name: &str) -> (String, String) {
        (name.to_string(), "127.0.0.1:1".to_string())
    }

    const BAD: &str = "peer ps failed authentication: its cluster secret differs";

    #[test]
    fn only_a_task_refused_by_every_other_one_stops_at_once() {
        let (ps, w0) = (peer("/job:ps/task:0"), peer("/job:worker/task:0"));
        let mut errors: HashMap<&str, Vec<String>> = HashMap::new();
        note_error(&mut errors, &ps.0, BAD.into());
        // One task not up yet (no error, then connection refused): keep waiting for it.
        assert!(odd_secret_out(2, &[&ps, &w0], &errors).is_none());
        note_error(&mut errors, &w0.0, "connection refused".into());
        assert!(odd_secret_out(2, &[&ps, &w0], &errors).is_none());
        // Both refuse it: this task's secret is the odd one out.
        note_error(&mut errors, &w0.0, BAD.into());
        let e = odd_secret_out(2, &[&ps, &w0], &errors)
            .expect("refused by both")
            .to_string();
        assert!(
            e.contains("/job:ps/task:0, /job:worker/task:0") && e.contains("--secret-file"),
            "{e}"
        );
        // Another task accepted it: the refusing one is the odd one out, not this task.
        assert!(odd_secret_out(2, &[&ps], &errors).is_none());
    }
}
