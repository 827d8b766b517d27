//! The collective groups a task joined, offered to collective kernels
//! ([`dflow_graph::kernel::Collectives`]) over the transport's [`Communicator`]s.
//!
//! Joining is two requests from the chief: `PrepareGroup` binds a listener and returns its
//! address; once every rank answered, `JoinGroup` gives each rank its number and every rank's
//! address, and the ranks connect to each other. With [`CollectiveHub::shared_memory`] (tasks
//! of one host, `--transport shm`) the "address" is the name of a shared-memory segment the
//! rank creates when it joins, and the group runs over [`ShmPairs`](dflow_transport::collective::ShmPairs).

use dflow_graph::kernel::{CollectiveCall, Collectives, ReduceKind};
use dflow_graph::{DType, Tensor};
use dflow_transport::auth::Secret;
use dflow_transport::collective::{
    CommOptions, Communicator, Pairs, ReduceOp, Scalar, ShmOptions, ShmRendezvous,
    TcpGroupListener as CollectiveListener, TcpOptions,
};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// The groups of one task.
#[derive(Debug)]
pub struct CollectiveHub {
    /// The host this task's collective listeners bind to and advertise.
    host: String,
    secret: Option<Secret>,
    timeout: Duration,
    /// Groups run over shared memory instead of TCP.
    shm: bool,
    pending: Mutex<HashMap<String, Pending>>,
    groups: Mutex<HashMap<String, Communicator>>,
}

/// A prepared group: its TCP listener, or the shared-memory segment name it published.
#[derive(Debug)]
enum Pending {
    Tcp(CollectiveListener),
    Shm(String),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn reduce_op(k: ReduceKind) -> ReduceOp {
    match k {
        ReduceKind::Sum => ReduceOp::Sum,
        ReduceKind::Prod => ReduceOp::Prod,
        ReduceKind::Min => ReduceOp::Min,
        ReduceKind::Max => ReduceOp::Max,
        ReduceKind::Avg => ReduceOp::Avg,
    }
}

/// A fresh copy of `t` (the collectives write in place), as `T` elements.
fn owned<T: Scalar + dflow_graph::tensor::Element>(t: &Tensor) -> Result<Vec<T>, String> {
    Ok(t.as_slice::<T>().map_err(|e| e.to_string())?.to_vec())
}

fn tensor<T: Scalar + dflow_graph::tensor::Element>(
    dims: &[usize],
    v: &[T],
) -> Result<Tensor, String> {
    Tensor::from_slice(dims, v).map_err(|e| e.to_string())
}

/// Runs `$body` with `T` bound to the element type of `$dtype`.
macro_rules! with_scalar {
    ($dtype:expr, $op:literal, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            DType::I32 => {
                type $t = i32;
                $body
            }
            DType::I64 => {
                type $t = i64;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            d => Err(format!(
                "{}: dtype {d} is not supported by collectives (f32, f64, i32, i64, bf16)",
                $op
            )),
        }
    };
}

impl CollectiveHub {
    /// A hub whose listeners bind to `host` (this task's cluster host), connections proving
    /// `secret` when given, every call bounded by `timeout`.
    pub fn new(host: &str, secret: Option<Secret>, timeout: Duration) -> CollectiveHub {
        CollectiveHub {
            host: host.to_string(),
            secret,
            timeout,
            shm: false,
            pending: Mutex::default(),
            groups: Mutex::default(),
        }
    }

    /// The same hub with its groups over shared memory (`on`: every rank is a process of this
    /// host) instead of TCP.
    pub fn shared_memory(mut self, on: bool) -> CollectiveHub {
        self.shm = on;
        self
    }

    /// Binds a listener for `group` (or picks its shared-memory segment name); returns the
    /// address to publish.
    pub fn prepare(&self, group: &str) -> Result<String, String> {
        if self.shm {
            let name = ShmRendezvous::reserve_name(group);
            lock(&self.pending).insert(group.to_string(), Pending::Shm(name.clone()));
            return Ok(name);
        }
        let ip = self
            .host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let listener = CollectiveListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| format!("group `{group}`: cannot listen on {}: {e}", self.host))?;
        let port = listener
            .local_addr()
            .map_err(|e| format!("group `{group}`: {e}"))?
            .port();
        lock(&self.pending).insert(group.to_string(), Pending::Tcp(listener));
        Ok(format!("{}:{port}", self.host))
    }

    /// Leaves every group (prepared or joined): their connections close once no step uses
    /// them. An elastic job's survivors leave the old membership's group before joining the new.
    pub fn leave_all(&self) {
        lock(&self.pending).clear();
        lock(&self.groups).clear();
    }

    /// Connects to the other ranks of `group` as `rank` (blocking, bounded by the timeout).
    pub fn join(&self, group: &str, rank: usize, addrs: &[String]) -> Result<(), String> {
        let pending = lock(&self.pending)
            .remove(group)
            .ok_or_else(|| format!("group `{group}` was not prepared on this task"))?;
        let (pairs, over): (Box<dyn Pairs>, &str) = match pending {
            Pending::Shm(name) => (
                Box::new(self.join_shm(group, rank, &name, addrs)?),
                "shared memory",
            ),
            Pending::Tcp(listener) => (
                Box::new(self.join_tcp(group, rank, listener, addrs)?),
                "TCP",
            ),
        };
        tracing::info!(
            "joined collective group `{group}` as rank {rank} of {} over {over}",
            addrs.len()
        );
        let comm = Communicator::new(
            pairs,
            CommOptions {
                timeout: self.timeout,
                ..CommOptions::default()
            },
        );
        lock(&self.groups).insert(group.to_string(), comm);
        Ok(())
    }

    fn join_shm(
        &self,
        group: &str,
        rank: usize,
        name: &str,
        names: &[String],
    ) -> Result<dflow_transport::collective::ShmPairs, String> {
        let opts = ShmOptions {
            connect_timeout: self.timeout,
            ..ShmOptions::default()
        };
        ShmRendezvous::create_named(name, rank, names.len(), &opts)
            .and_then(|rv| rv.connect(names, &opts))
            .map_err(|e| format!("joining group `{group}` as rank {rank} over shared memory: {e}"))
    }

    fn join_tcp(
        &self,
        group: &str,
        rank: usize,
        listener: CollectiveListener,
        addrs: &[String],
    ) -> Result<dflow_transport::collective::TcpPairs, String> {
        let resolved = addrs
            .iter()
            .map(|a| {
                a.to_socket_addrs()
                    .ok()
                    .and_then(|mut it| it.next())
                    .ok_or_else(|| format!("group `{group}`: cannot resolve rank address `{a}`"))
            })
            .collect::<Result<Vec<SocketAddr>, String>>()?;
        let opts = TcpOptions {
            connect_timeout: self.timeout,
            secret: self.secret.clone(),
            ..TcpOptions::default()
        };
        listener
            .connect(rank, &resolved, &opts)
            .map_err(|e| format!("joining group `{group}` as rank {rank}: {e}"))
    }

    /// What this task sent in all its groups (each group has its own channel).
    pub fn sent(&self) -> dflow_transport::Traffic {
        lock(&self.groups)
            .values()
            .map(Communicator::sent)
            .fold(dflow_transport::Traffic::default(), |a, b| a + b)
    }

    fn group(&self, group: &str) -> Result<Communicator, String> {
        lock(&self.groups).get(group).cloned().ok_or_else(|| {
            format!("this task has not joined collective group `{group}` (strategy allreduce joins `workers`)")
        })
    }
}

fn in_call(call: &CollectiveCall<'_>, e: impl std::fmt::Display) -> String {
    format!(
        "collective instance {} of group `{}` in step {}: {e}",
        call.instance, call.group, call.step
    )
}

impl Collectives for CollectiveHub {
    fn rank_and_size(&self, group: &str) -> Result<(usize, usize), String> {
        let c = self.group(group)?;
        Ok((c.rank(), c.size()))
    }

    fn all_reduce(
        &self,
        call: &CollectiveCall<'_>,
        input: &Tensor,
        op: ReduceKind,
    ) -> Result<Tensor, String> {
        let c = self.group(call.group)?;
        with_scalar!(input.dtype(), "CollectiveAllReduce", |T| {
            let mut v = owned::<T>(input)?;
            c.all_reduce(&mut v, reduce_op(op))
                .map_err(|e| in_call(call, e))?;
            tensor(input.dims(), &v)
        })
    }

    fn all_gather(&self, call: &CollectiveCall<'_>, input: &Tensor) -> Result<Tensor, String> {
        let c = self.group(call.group)?;
        let mut dims = input.dims().to_vec();
        let Some(d0) = dims.first_mut() else {
            return Err("CollectiveAllGather: the input must have rank ≥ 1".into());
        };
        *d0 *= c.size();
        with_scalar!(input.dtype(), "CollectiveAllGather", |T| {
            let send = owned::<T>(input)?;
            let mut recv = vec![<T as bytemuck::Zeroable>::zeroed(); send.len() * c.size()];
            c.all_gather(&send, &mut recv)
                .map_err(|e| in_call(call, e))?;
            tensor(&dims, &recv)
        })
    }

    fn reduce_scatter(
        &self,
        call: &CollectiveCall<'_>,
        input: &Tensor,
        op: ReduceKind,
    ) -> Result<Tensor, String> {
        let c = self.group(call.group)?;
        let mut dims = input.dims().to_vec();
        let n = c.size();
        match dims.first_mut() {
            Some(d0) if *d0 % n == 0 => *d0 /= n,
            _ => {
                return Err(format!(
                    "CollectiveReduceScatter: dimension 0 of {:?} does not split into {n} parts",
                    input.dims()
                ))
            }
        }
        with_scalar!(input.dtype(), "CollectiveReduceScatter", |T| {
            let send = owned::<T>(input)?;
            let mut recv = vec![<T as bytemuck::Zeroable>::zeroed(); send.len() / n];
            c.reduce_scatter(&send, &mut recv, reduce_op(op))
                .map_err(|e| in_call(call, e))?;
            tensor(&dims, &recv)
        })
    }

    fn broadcast(
        &self,
        call: &CollectiveCall<'_>,
        input: &Tensor,
        root: usize,
    ) -> Result<Tensor, String> {
        let c = self.group(call.group)?;
        with_scalar!(input.dtype(), "CollectiveBroadcast", |T| {
            let mut v = owned::<T>(input)?;
            c.broadcast(&mut v, root).map_err(|e| in_call(call, e))?;
            tensor(input.dims(), &v)
        })
    }

    fn all_to_all(&self, call: &CollectiveCall<'_>, input: &Tensor) -> Result<Tensor, String> {
        let c = self.group(call.group)?;
        with_scalar!(input.dtype(), "CollectiveAllToAll", |T| {
            let send = owned::<T>(input)?;
            let mut recv = vec![<T as bytemuck::Zeroable>::zeroed(); send.len()];
            c.all_to_all(&send, &mut recv)
                .map_err(|e| in_call(call, e))?;
            tensor(input.dims(), &recv)
        })
    }
}
