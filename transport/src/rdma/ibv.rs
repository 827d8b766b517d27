//! The real verbs (feature `rdma`), through `ibverbs-sys`, the rdma-core bindings of the
//! `ibverbs` project.
//!
//! The `ibverbs` crate's safe API only posts SEND work requests into memory it allocates itself;
//! the protocol needs RDMA WRITE WITH IMMEDIATE into the slots' own buffers, so this module calls
//! the C API directly. Every call is a thin wrapper; the pointers it holds live until `Drop`.
//!
//! Not exercised on this project's CI machines (no RDMA hardware): only built. See
//! docs/distributed.md ("RDMA") for running it on RoCE or InfiniBand, or on Soft-RoCE (`rdma_rxe`).

use super::verbs::{
    Completion, CompletionKind, LocalSegment, MemoryRegion, QpEndpoint, QpId, RemoteSegment, Verbs,
    VerbsError,
};
use ibverbs_sys as ffi;
use std::collections::HashMap;
use std::ffi::CStr;
use std::fmt;
use std::io;
use std::mem::MaybeUninit;
use std::ptr;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Which device and port to use.
#[derive(Clone, Debug, Default)]
pub struct IbvConfig {
    /// Device name as `ibv_devices` lists it (none: the first).
    pub device: Option<String>,
    /// Port number (none: 1).
    pub port: Option<u8>,
    /// GID index (RoCE v2 usually needs the index of the RoCE v2 GID, see `show_gids`; none: 0
    /// on Ethernet, no GID on InfiniBand).
    pub gid_index: Option<u8>,
}

impl IbvConfig {
    /// From `DFLOW_RDMA_DEVICE`, `DFLOW_RDMA_PORT` and `DFLOW_RDMA_GID_INDEX`.
    pub fn from_env() -> Result<Self, VerbsError> {
        let num = |var: &str| -> Result<Option<u8>, VerbsError> {
            match std::env::var(var) {
                Ok(v) => v.parse().map(Some).map_err(|_| VerbsError::NoDevice {
                    name: None,
                    detail: format!("{var}={v:?} is not a number 0..=255"),
                }),
                Err(_) => Ok(None),
            }
        };
        Ok(IbvConfig {
            device: std::env::var("DFLOW_RDMA_DEVICE").ok(),
            port: num("DFLOW_RDMA_PORT")?,
            gid_index: num("DFLOW_RDMA_GID_INDEX")?,
        })
    }
}

/// Queue and completion-queue depths (capped by the device's limits).
const MAX_WR: i32 = 4096;
const CQ_DEPTH: i32 = 16384;

struct Qp {
    qp: *mut ffi::ibv_qp,
    psn: u32,
}

/// An opened RDMA device: context, protection domain and one completion queue.
pub struct IbvVerbs {
    name: String,
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    cq: *mut ffi::ibv_cq,
    port: u8,
    lid: u16,
    active_mtu: ffi::ibv_mtu,
    gid: Option<(u8, [u8; 16])>,
    max_wr: u32,
    mrs: Mutex<HashMap<u32, usize>>,
    qps: Mutex<HashMap<QpId, Qp>>,
}

// SAFETY: libibverbs objects may be used from several threads at once (rdma-core documents the
// verbs as thread-safe); the maps of raw pointers are behind mutexes, and the pointers stay
// valid until `Drop`, which needs `&mut self`.
unsafe impl Send for IbvVerbs {}
// SAFETY: as above.
unsafe impl Sync for IbvVerbs {}

impl fmt::Debug for IbvVerbs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IbvVerbs({} port {})", self.name, self.port)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn os_err(what: &str) -> String {
    format!("{what}: {}", io::Error::last_os_error())
}

impl IbvVerbs {
    /// Opens the device `config` names (or the first one), its port, a protection domain and a
    /// completion queue.
    pub fn open(config: &IbvConfig) -> Result<IbvVerbs, VerbsError> {
        let no_device = |detail: String| VerbsError::NoDevice {
            name: config.device.clone(),
            detail,
        };
        let mut n = 0i32;
        // SAFETY: `n` is a valid out-pointer; the list is freed below on every path.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(no_device(os_err(
                "ibv_get_device_list failed (no kernel RDMA support?)",
            )));
        }
        let mut names = Vec::new();
        let mut chosen = None;
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: the list holds `n` valid device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: `dev` is a valid device; the name is a NUL-terminated string it owns.
            let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            if chosen.is_none() && config.device.as_deref().map_or(true, |d| d == name) {
                chosen = Some((dev, name.clone()));
            }
            names.push(name);
        }
        let opened = chosen.map(|(dev, name)| {
            // SAFETY: `dev` comes from the list, which is still alive.
            (unsafe { ffi::ibv_open_device(dev) }, name)
        });
        // SAFETY: the list came from ibv_get_device_list; an opened context stays valid.
        unsafe { ffi::ibv_free_device_list(list) };
        let (ctx, name) = match opened {
            None if names.is_empty() => return Err(no_device("no RDMA devices found".into())),
            None => return Err(no_device(format!("found {}", names.join(", ")))),
            Some((ctx, name)) if ctx.is_null() => {
                return Err(no_device(os_err(&format!("ibv_open_device({name})"))))
            }
            Some(c) => c,
        };
        // From here `Drop` releases what was created (null pointers are skipped).
        let mut v = IbvVerbs {
            name,
            ctx,
            pd: ptr::null_mut(),
            cq: ptr::null_mut(),
            port: config.port.unwrap_or(1),
            lid: 0,
            active_mtu: 0,
            gid: None,
            max_wr: MAX_WR as u32,
            mrs: Mutex::default(),
            qps: Mutex::default(),
        };
        let dev_err = |v: &IbvVerbs, what: &str| VerbsError::NoDevice {
            name: Some(v.name.clone()),
            detail: os_err(what),
        };
        // SAFETY: `ctx` is an open context; the attribute structs are plain C data.
        unsafe {
            let mut dattr = MaybeUninit::<ffi::ibv_device_attr>::zeroed();
            if ffi::ibv_query_device(v.ctx, dattr.as_mut_ptr()) != 0 {
                return Err(dev_err(&v, "ibv_query_device"));
            }
            let dattr = dattr.assume_init();
            v.max_wr = MAX_WR.min(dattr.max_qp_wr).max(1) as u32;
            let cqe = CQ_DEPTH.min(dattr.max_cqe).max(1);

            let mut pattr = MaybeUninit::<ffi::ibv_port_attr>::zeroed();
            if ffi::ibv_query_port(v.ctx, v.port, pattr.as_mut_ptr().cast()) != 0 {
                return Err(dev_err(&v, &format!("ibv_query_port(port {})", v.port)));
            }
            let pattr = pattr.assume_init();
            if pattr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
                return Err(VerbsError::NoDevice {
                    name: Some(v.name.clone()),
                    detail: format!(
                        "port {} is not active (state {}; check `ibv_devinfo` and the link)",
                        v.port, pattr.state
                    ),
                });
            }
            v.lid = pattr.lid;
            v.active_mtu = pattr.active_mtu;
            let ethernet = u32::from(pattr.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET;
            if ethernet || config.gid_index.is_some() {
                let index = config.gid_index.unwrap_or(0);
                let mut gid = MaybeUninit::<ffi::ibv_gid>::zeroed();
                if ffi::ibv_query_gid(v.ctx, v.port, i32::from(index), gid.as_mut_ptr()) != 0 {
                    return Err(dev_err(&v, &format!("ibv_query_gid(index {index})")));
                }
                v.gid = Some((index, gid.assume_init().raw));
            }

            v.pd = ffi::ibv_alloc_pd(v.ctx);
            if v.pd.is_null() {
                return Err(dev_err(&v, "ibv_alloc_pd"));
            }
            v.cq = ffi::ibv_create_cq(v.ctx, cqe, ptr::null_mut(), ptr::null_mut(), 0);
            if v.cq.is_null() {
                return Err(dev_err(&v, "ibv_create_cq"));
            }
        }
        Ok(v)
    }

    fn qp(&self, qp: QpId) -> Result<*mut ffi::ibv_qp, VerbsError> {
        lock(&self.qps)
            .get(&qp)
            .map(|q| q.qp)
            .ok_or_else(|| VerbsError::Post(format!("no queue pair {qp}")))
    }
}

impl Drop for IbvVerbs {
    fn drop(&mut self) {
        // SAFETY: every pointer was created by this value and is released once, children first.
        unsafe {
            for (_, q) in lock(&self.qps).drain() {
                ffi::ibv_destroy_qp(q.qp);
            }
            for (_, mr) in lock(&self.mrs).drain() {
                ffi::ibv_dereg_mr(mr as *mut ffi::ibv_mr);
            }
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            ffi::ibv_close_device(self.ctx);
        }
    }
}

impl Verbs for IbvVerbs {
    fn device_name(&self) -> &str {
        &self.name
    }

    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MemoryRegion, VerbsError> {
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        // SAFETY: the caller keeps `addr..addr+len` allocated until `deregister`; `pd` is valid.
        let mr = unsafe { ffi::ibv_reg_mr(self.pd, addr.cast(), len, access.0 as i32) };
        if mr.is_null() {
            return Err(VerbsError::Register {
                len,
                detail: os_err("ibv_reg_mr"),
            });
        }
        // SAFETY: a non-null MR from ibv_reg_mr is valid until ibv_dereg_mr.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        lock(&self.mrs).insert(lkey, mr as usize);
        Ok(MemoryRegion {
            addr: addr as u64,
            len,
            lkey,
            rkey,
        })
    }

    fn deregister(&self, mr: &MemoryRegion) {
        if let Some(p) = lock(&self.mrs).remove(&mr.lkey) {
            // SAFETY: `p` came from ibv_reg_mr and was removed from the map, so it is released
            // once.
            unsafe { ffi::ibv_dereg_mr(p as *mut ffi::ibv_mr) };
        }
    }

    fn create_qp(&self) -> Result<(QpId, QpEndpoint), VerbsError> {
        let mut attr = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: self.cq,
            recv_cq: self.cq,
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: self.max_wr,
                max_recv_wr: self.max_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: `pd` and `cq` are valid; `attr` is initialized.
        let qp = unsafe { ffi::ibv_create_qp(self.pd, &mut attr) };
        if qp.is_null() {
            return Err(VerbsError::QueuePair(os_err("ibv_create_qp")));
        }
        // SAFETY: a non-null QP is valid until ibv_destroy_qp.
        let qp_num = unsafe { (*qp).qp_num };
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        lock(&self.qps).insert(qp_num, Qp { qp, psn });
        Ok((
            qp_num,
            QpEndpoint {
                qp_num,
                lid: self.lid,
                gid: self.gid.map(|(_, g)| g).unwrap_or([0; 16]),
                psn,
            },
        ))
    }

    fn connect_qp(&self, qp: QpId, remote: &QpEndpoint) -> Result<(), VerbsError> {
        let (raw, psn) = {
            let qps = lock(&self.qps);
            let q = qps
                .get(&qp)
                .ok_or_else(|| VerbsError::QueuePair(format!("no queue pair {qp}")))?;
            (q.qp, q.psn)
        };
        let modify = |attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask, what: &str| {
            // SAFETY: `raw` is a live QP; `attr` is initialized for the bits in `mask`.
            let rc = unsafe { ffi::ibv_modify_qp(raw, attr, mask.0 as i32) };
            if rc != 0 {
                return Err(VerbsError::QueuePair(format!(
                    "ibv_modify_qp to {what}: {}",
                    io::Error::from_raw_os_error(rc)
                )));
            }
            Ok(())
        };
        use ffi::ibv_qp_attr_mask as M;
        // SAFETY (for the zeroed structs): ibv_qp_attr is plain C data, all-zero is valid.
        let zero = || unsafe { MaybeUninit::<ffi::ibv_qp_attr>::zeroed().assume_init() };

        let mut a = zero();
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
        a.port_num = self.port;
        a.pkey_index = 0;
        a.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;

        let mut a = zero();
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = self.active_mtu;
        a.dest_qp_num = remote.qp_num;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = self.port;
        if let Some((index, _)) = self.gid {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = index;
            a.ah_attr.grh.hop_limit = 0xff;
        }
        modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;

        let mut a = zero();
        a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = psn;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.max_rd_atomic = 1;
        modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    fn destroy_qp(&self, qp: QpId) {
        if let Some(q) = lock(&self.qps).remove(&qp) {
            // SAFETY: removed from the map, so destroyed once.
            unsafe { ffi::ibv_destroy_qp(q.qp) };
        }
    }

    fn post_write(
        &self,
        qp: QpId,
        wr_id: u64,
        local: Option<LocalSegment>,
        remote: RemoteSegment,
        imm: Option<u32>,
    ) -> Result<(), VerbsError> {
        let raw = self.qp(qp)?;
        let mut sge = local.map(|l| ffi::ibv_sge {
            addr: l.addr,
            length: l.len,
            lkey: l.lkey,
        });
        // SAFETY: ibv_send_wr is plain C data; all-zero is a valid starting point.
        let mut wr: ffi::ibv_send_wr = unsafe { MaybeUninit::zeroed().assume_init() };
        wr.wr_id = wr_id;
        wr.next = ptr::null_mut();
        match &mut sge {
            Some(s) => {
                wr.sg_list = s;
                wr.num_sge = 1;
            }
            None => {
                wr.sg_list = ptr::null_mut();
                wr.num_sge = 0;
            }
        }
        match imm {
            Some(imm) => {
                wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
                wr.__bindgen_anon_1.imm_data = imm.to_be();
            }
            None => wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        }
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: remote.addr,
            rkey: remote.rkey,
        };
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: `raw` is a live QP whose context's ops table is filled by the provider;
        // `wr` and `sge` outlive the call (the provider copies them into the send queue); the
        // local segment lies in a registered region (the caller's `register` contract).
        let rc = unsafe {
            let ops = &(*(*raw).context).ops;
            match ops.post_send {
                Some(post) => post(raw, &mut wr, &mut bad),
                None => libc_enosys(),
            }
        };
        if rc != 0 {
            return Err(VerbsError::Post(format!(
                "ibv_post_send: {}",
                io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    fn post_recv(&self, qp: QpId, wr_id: u64) -> Result<(), VerbsError> {
        let raw = self.qp(qp)?;
        let mut wr = ffi::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: as in `post_write`; a zero-SGE receive only catches an immediate.
        let rc = unsafe {
            let ops = &(*(*raw).context).ops;
            match ops.post_recv {
                Some(post) => post(raw, &mut wr, &mut bad),
                None => libc_enosys(),
            }
        };
        if rc != 0 {
            return Err(VerbsError::Post(format!(
                "ibv_post_recv: {}",
                io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    fn poll(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: Duration,
    ) -> Result<usize, VerbsError> {
        const BATCH: usize = 32;
        let deadline = Instant::now() + timeout;
        let spin_until = Instant::now() + Duration::from_micros(50);
        loop {
            let mut wcs = [MaybeUninit::<ffi::ibv_wc>::uninit(); BATCH];
            let want = max.clamp(1, BATCH) as i32;
            // SAFETY: `cq` is live; the provider writes at most `want` entries into `wcs` and
            // returns how many.
            let n = unsafe {
                let ops = &(*self.ctx).ops;
                match ops.poll_cq {
                    Some(poll) => poll(self.cq, want, wcs.as_mut_ptr().cast()),
                    None => -libc_enosys(),
                }
            };
            if n < 0 {
                return Err(VerbsError::Poll(format!("ibv_poll_cq returned {n}")));
            }
            let n = n as usize;
            for wc in &wcs[..n] {
                // SAFETY: the first `n` entries were written by ibv_poll_cq.
                let wc = unsafe { wc.assume_init_ref() };
                out.push(convert(wc));
            }
            let now = Instant::now();
            if n > 0 || now >= deadline {
                return Ok(n);
            }
            if now < spin_until {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

/// ENOSYS, for a provider without the operation.
fn libc_enosys() -> i32 {
    38
}

fn convert(wc: &ffi::ibv_wc) -> Completion {
    let result = match wc.error() {
        Some((status, vendor)) => {
            // SAFETY: ibv_wc_status_str returns a static NUL-terminated string for any status.
            let text = unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(status)) };
            Err(format!(
                "{} (status {status}, vendor error {vendor:#x})",
                text.to_string_lossy()
            ))
        }
        None => match wc.opcode() {
            ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE => Ok(CompletionKind::Write),
            ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => Ok(CompletionKind::RecvImm {
                imm: u32::from_be(wc.imm_data),
                byte_len: wc.len() as u32,
            }),
            op => Err(format!("unexpected completion opcode {op}")),
        },
    };
    Completion {
        qp: wc.qp_num,
        wr_id: wc.wr_id(),
        result,
    }
}
