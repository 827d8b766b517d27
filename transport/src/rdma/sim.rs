//! An in-memory RDMA fabric implementing [`Verbs`], for tests on machines without RDMA.
//!
//! Every device opened on one [`SimFabric`] shares its state: memory regions are the callers'
//! real buffers (looked up by key, bounds-checked), an RDMA WRITE copies into the remote region
//! at once and raises completions like a reliable-connected queue pair would, in posting order.
//! Faults can be injected: a registration failure (as with a low `ulimit -l`), a locked-memory
//! limit, and a broken link (the queue pairs between two devices go to the error state and
//! flush their posted receives).

use super::verbs::{
    Completion, CompletionKind, LocalSegment, MemoryRegion, QpEndpoint, QpId, RemoteSegment, Verbs,
    VerbsError,
};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Device {
    cq: VecDeque<Completion>,
    registered: usize,
    memlock: Option<usize>,
}

struct Region {
    device: Arc<str>,
    addr: u64,
    len: usize,
}

struct Qp {
    device: Arc<str>,
    remote: Option<QpId>,
    recvs: VecDeque<u64>,
    broken: Option<String>,
}

#[derive(Default)]
struct Fabric {
    devices: HashMap<Arc<str>, Device>,
    regions: HashMap<u32, Region>,
    qps: HashMap<QpId, Qp>,
    next_key: u32,
    next_qp: QpId,
    fail_registrations: usize,
    writes: u64,
}

#[derive(Default)]
struct Shared {
    fabric: Mutex<Fabric>,
    cv: Condvar,
}

/// The simulated fabric: open devices on it with [`SimFabric::open`].
#[derive(Clone, Default)]
pub struct SimFabric {
    shared: Arc<Shared>,
}

impl fmt::Debug for SimFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fab = self.lock();
        write!(
            f,
            "SimFabric({} devices, {} regions, {} queue pairs)",
            fab.devices.len(),
            fab.regions.len(),
            fab.qps.len()
        )
    }
}

impl SimFabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Fabric> {
        self.shared.fabric.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Plugs in a device named `name`.
    pub fn add_device(&self, name: &str) {
        self.lock().devices.entry(name.into()).or_default();
    }

    /// Opens device `name` (plugged in with [`SimFabric::add_device`]).
    pub fn open(&self, name: &str) -> Result<SimVerbs, VerbsError> {
        let fab = self.lock();
        let Some((name, _)) = fab.devices.get_key_value(name) else {
            return Err(VerbsError::NoDevice {
                name: Some(name.to_string()),
                detail: if fab.devices.is_empty() {
                    "the fabric has no devices".into()
                } else {
                    let mut names: Vec<&str> = fab.devices.keys().map(|n| &**n).collect();
                    names.sort_unstable();
                    format!("found {}", names.join(", "))
                },
            });
        };
        Ok(SimVerbs {
            fabric: self.clone(),
            name: name.clone(),
            label: format!("sim:{name}"),
        })
    }

    /// Makes the next `n` registrations fail as the kernel does when the locked-memory limit is
    /// reached.
    pub fn fail_next_registrations(&self, n: usize) {
        self.lock().fail_registrations = n;
    }

    /// Limits the bytes device `name` may have registered at once (like `ulimit -l`).
    pub fn set_memlock_limit(&self, name: &str, bytes: usize) {
        if let Some(d) = self.lock().devices.get_mut(name) {
            d.memlock = Some(bytes);
        }
    }

    /// Breaks every connection between devices `a` and `b`: their queue pairs go to the error
    /// state, posted receives are flushed with an error, later writes fail.
    pub fn break_link(&self, a: &str, b: &str) {
        let mut fab = self.lock();
        let fab = &mut *fab;
        let pairs: Vec<(QpId, QpId)> = fab
            .qps
            .iter()
            .filter_map(|(id, q)| q.remote.map(|r| (*id, r)))
            .filter(|(id, r)| {
                let dev = |q: &QpId| fab.qps.get(q).map(|q| q.device.clone());
                matches!((dev(id), dev(r)), (Some(x), Some(y)) if (&*x == a && &*y == b) || (&*x == b && &*y == a))
            })
            .collect();
        for (id, _) in pairs {
            break_qp(fab, id, "link down (injected)");
        }
        self.shared.cv.notify_all();
    }

    /// RDMA writes carried so far.
    pub fn writes(&self) -> u64 {
        self.lock().writes
    }

    /// Bytes registered on device `name`.
    pub fn registered_bytes(&self, name: &str) -> usize {
        self.lock().devices.get(name).map_or(0, |d| d.registered)
    }
}

/// Puts queue pair `id` in the error state and flushes its posted receives.
fn break_qp(fab: &mut Fabric, id: QpId, why: &str) {
    let Some(q) = fab.qps.get_mut(&id) else {
        return;
    };
    if q.broken.is_some() {
        return;
    }
    q.broken = Some(why.to_string());
    let flushed: Vec<u64> = q.recvs.drain(..).collect();
    let device = q.device.clone();
    if let Some(d) = fab.devices.get_mut(&device) {
        for wr_id in flushed {
            d.cq.push_back(Completion {
                qp: id,
                wr_id,
                result: Err(format!("work request flushed: {why}")),
            });
        }
    }
}

/// One device opened on a [`SimFabric`].
pub struct SimVerbs {
    fabric: SimFabric,
    name: Arc<str>,
    label: String,
}

impl fmt::Debug for SimVerbs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimVerbs({})", self.label)
    }
}

impl SimVerbs {
    fn error(&self, fab: &mut Fabric, qp: QpId, wr_id: u64, status: String) {
        if let Some(d) = fab.devices.get_mut(&self.name) {
            d.cq.push_back(Completion {
                qp,
                wr_id,
                result: Err(status.clone()),
            });
        }
        // An error completion moves both ends of a reliable connection to the error state.
        let remote = fab.qps.get(&qp).and_then(|q| q.remote);
        break_qp(fab, qp, &status);
        if let Some(r) = remote {
            break_qp(fab, r, &format!("peer queue pair failed: {status}"));
        }
    }
}

impl Verbs for SimVerbs {
    fn device_name(&self) -> &str {
        &self.label
    }

    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MemoryRegion, VerbsError> {
        let mut fab = self.fabric.lock();
        let fab = &mut *fab;
        let err = |detail: &str| VerbsError::Register {
            len,
            detail: detail.to_string(),
        };
        if fab.fail_registrations > 0 {
            fab.fail_registrations -= 1;
            return Err(err("ibv_reg_mr: Cannot allocate memory (os error 12)"));
        }
        let dev = fab
            .devices
            .get_mut(&self.name)
            .ok_or_else(|| err("device removed"))?;
        if let Some(limit) = dev.memlock {
            if dev.registered + len > limit {
                return Err(err(&format!(
                    "ibv_reg_mr: Cannot allocate memory (os error 12): {} bytes already locked, limit {limit}",
                    dev.registered
                )));
            }
        }
        dev.registered += len;
        fab.next_key += 1;
        let key = fab.next_key;
        fab.regions.insert(
            key,
            Region {
                device: self.name.clone(),
                addr: addr as u64,
                len,
            },
        );
        Ok(MemoryRegion {
            addr: addr as u64,
            len,
            lkey: key,
            rkey: key,
        })
    }

    fn deregister(&self, mr: &MemoryRegion) {
        let mut fab = self.fabric.lock();
        if let Some(r) = fab.regions.remove(&mr.lkey) {
            if let Some(d) = fab.devices.get_mut(&r.device) {
                d.registered = d.registered.saturating_sub(r.len);
            }
        }
    }

    fn create_qp(&self) -> Result<(QpId, QpEndpoint), VerbsError> {
        let mut fab = self.fabric.lock();
        fab.next_qp += 1;
        let id = fab.next_qp;
        fab.qps.insert(
            id,
            Qp {
                device: self.name.clone(),
                remote: None,
                recvs: VecDeque::new(),
                broken: None,
            },
        );
        Ok((
            id,
            QpEndpoint {
                qp_num: id,
                lid: 1,
                gid: [0; 16],
                psn: 0,
            },
        ))
    }

    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<(), VerbsError> {
        let mut fab = self.fabric.lock();
        if !fab.qps.contains_key(&remote.qp_num) {
            return Err(VerbsError::QueuePair(format!(
                "remote queue pair {} does not exist",
                remote.qp_num
            )));
        }
        let q = fab
            .qps
            .get_mut(&qp)
            .ok_or_else(|| VerbsError::QueuePair(format!("no queue pair {qp}")))?;
        q.remote = Some(remote.qp_num);
        Ok(())
    }

    fn destroy_qp(&self, qp: QpId) {
        let mut fab = self.fabric.lock();
        let remote = fab.qps.get(&qp).and_then(|q| q.remote);
        fab.qps.remove(&qp);
        if let Some(r) = remote {
            break_qp(&mut fab, r, "peer destroyed its queue pair");
        }
        self.fabric.shared.cv.notify_all();
    }

    fn post_write(
        &self,
        qp: QpId,
        wr_id: u64,
        local: Option<LocalSegment>,
        remote: RemoteSegment,
        imm: Option<u32>,
    ) -> Result<(), VerbsError> {
        let mut fab = self.fabric.lock();
        let fab = &mut *fab;
        let q = fab
            .qps
            .get(&qp)
            .filter(|q| q.device == self.name)
            .ok_or_else(|| VerbsError::Post(format!("no queue pair {qp} on {}", self.label)))?;
        if let Some(why) = &q.broken {
            return Err(VerbsError::Post(format!(
                "queue pair {qp} is in the error state: {why}"
            )));
        }
        let rqp = q
            .remote
            .ok_or_else(|| VerbsError::Post(format!("queue pair {qp} is not connected")))?;
        let Some(rq) = fab.qps.get(&rqp).filter(|r| r.broken.is_none()) else {
            self.error(fab, qp, wr_id, "transport retry counter exceeded".into());
            self.fabric.shared.cv.notify_all();
            return Ok(());
        };
        let rdev = rq.device.clone();
        let len = local.map_or(0, |l| l.len as usize);
        // Check both ends before touching memory, like the NIC does.
        let src = match local {
            None => None,
            Some(l) => match fab.regions.get(&l.lkey) {
                Some(r)
                    if r.device == self.name
                        && l.addr >= r.addr
                        && l.addr + u64::from(l.len) <= r.addr + r.len as u64 =>
                {
                    Some(l.addr)
                }
                _ => {
                    self.error(fab, qp, wr_id, "local protection error".into());
                    self.fabric.shared.cv.notify_all();
                    return Ok(());
                }
            },
        };
        if len > 0 {
            let ok = fab.regions.get(&remote.rkey).is_some_and(|r| {
                r.device == rdev
                    && remote.addr >= r.addr
                    && remote.addr + len as u64 <= r.addr + r.len as u64
            });
            if !ok {
                self.error(fab, qp, wr_id, "remote access error".into());
                self.fabric.shared.cv.notify_all();
                return Ok(());
            }
        }
        let recv = match imm {
            Some(_) => match fab.qps.get_mut(&rqp).and_then(|r| r.recvs.pop_front()) {
                Some(r) => Some(r),
                None => {
                    self.error(
                        fab,
                        qp,
                        wr_id,
                        "receiver not ready (RNR retry exceeded)".into(),
                    );
                    self.fabric.shared.cv.notify_all();
                    return Ok(());
                }
            },
            None => None,
        };
        if let Some(src) = src {
            if len > 0 {
                // SAFETY: both ranges were checked above to lie inside regions registered with
                // `Verbs::register`, whose contract keeps them allocated and free of Rust
                // references while writes may land; the fabric lock serializes this copy with
                // every other one. Source and destination are distinct registrations (a local
                // staging buffer and a remote slot), so they do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(src as *const u8, remote.addr as *mut u8, len);
                }
            }
        }
        fab.writes += 1;
        if let (Some(imm), Some(recv_wr)) = (imm, recv) {
            if let Some(d) = fab.devices.get_mut(&rdev) {
                d.cq.push_back(Completion {
                    qp: rqp,
                    wr_id: recv_wr,
                    result: Ok(CompletionKind::RecvImm {
                        imm,
                        byte_len: len as u32,
                    }),
                });
            }
            if let Some(d) = fab.devices.get_mut(&self.name) {
                d.cq.push_back(Completion {
                    qp,
                    wr_id,
                    result: Ok(CompletionKind::Write),
                });
            }
        }
        self.fabric.shared.cv.notify_all();
        Ok(())
    }

    fn post_recv(&self, qp: QpId, wr_id: u64) -> Result<(), VerbsError> {
        let mut fab = self.fabric.lock();
        let q = fab
            .qps
            .get_mut(&qp)
            .filter(|q| q.device == self.name)
            .ok_or_else(|| VerbsError::Post(format!("no queue pair {qp} on {}", self.label)))?;
        if let Some(why) = &q.broken {
            return Err(VerbsError::Post(format!(
                "queue pair {qp} is in the error state: {why}"
            )));
        }
        q.recvs.push_back(wr_id);
        Ok(())
    }

    fn poll(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, VerbsError> {
        let deadline = Instant::now() + timeout;
        let mut fab = self.fabric.lock();
        loop {
            let dev = fab
                .devices
                .get_mut(&self.name)
                .ok_or_else(|| VerbsError::Poll("device removed".into()))?;
            if !dev.cq.is_empty() {
                let n = dev.cq.len().min(max);
                out.extend(dev.cq.drain(..n));
                return Ok(n);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(0);
            }
            fab = self
                .fabric
                .shared
                .cv
                .wait_timeout(fab, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
