//! Framing over [`Pairs`]: every message is a [`Header`] (fingerprint, tag, length) and its
//! payload, received straight into the caller's buffer. [`Channel::exchange`] drives a set of
//! sends and receives together until all are done, so a rank can send to one peer while it
//! receives from another without threads and without deadlock. It also runs the safety net:
//! fingerprint checks on every frame, abort frames that fail a call on every rank, stall notices
//! and warnings, and the per-call deadline.

use super::error::{CollectiveError, Result};
use super::fingerprint::{CollectiveOp, Fingerprint, FrameKind, Header, HEADER_LEN, MAX_ABORT_LEN};
use super::pairs::{LinkError, Pairs};
use smallvec::SmallVec;
use std::fmt;
use std::io::IoSlice;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes staged per link for headers and small payloads; larger payloads bypass it.
const STAGING: usize = 64 * 1024;
/// After this long in one call, links without a posted receive are watched for control frames.
const WATCH_AFTER: Duration = Duration::from_millis(5);

/// A send posted to [`Channel::exchange`]; `peer` is a rank of the call's group.
#[derive(Debug)]
pub struct SendOp<'a> {
    /// Destination (group rank).
    pub peer: usize,
    /// Message tag within the call.
    pub tag: u64,
    /// Payload.
    pub data: &'a [u8],
}

/// A receive posted to [`Channel::exchange`]: the frame must carry exactly `buf.len()` bytes.
#[derive(Debug)]
pub struct RecvOp<'a> {
    /// Source (group rank).
    pub peer: usize,
    /// Message tag within the call.
    pub tag: u64,
    /// Where the payload goes.
    pub buf: &'a mut [u8],
}

/// One call in progress: its fingerprint, group, deadline and stall-inspection state. A
/// collective creates one and passes it to each of its exchanges.
#[derive(Debug)]
pub struct CallState {
    fp: Fingerprint,
    members: Arc<[usize]>,
    me: usize,
    started: Instant,
    timeout: Duration,
    stall_warning: Duration,
    announced: bool,
    warned: bool,
    /// How long to poll without sleeping after the last progress (small calls).
    spin: Duration,
}

impl CallState {
    /// A call with fingerprint `fp` among `members` (global ranks, indexed by group rank), where
    /// this rank is group rank `me`.
    pub fn new(
        fp: Fingerprint,
        members: Arc<[usize]>,
        me: usize,
        timeout: Duration,
        stall_warning: Duration,
    ) -> CallState {
        CallState {
            fp,
            members,
            me,
            started: Instant::now(),
            timeout,
            stall_warning,
            announced: false,
            warned: false,
            spin: Duration::ZERO,
        }
    }

    /// Polls the links for up to `spin` after the last progress before sleeping: trades CPU
    /// for latency on small calls (default zero: sleep at once).
    pub fn with_spin(mut self, spin: Duration) -> CallState {
        self.spin = spin;
        self
    }

    /// The call's fingerprint.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fp
    }

    /// This rank's group rank.
    pub fn rank(&self) -> usize {
        self.me
    }

    /// The group's size.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    fn deadline(&self) -> Instant {
        self.started + self.timeout
    }
}

#[derive(Debug)]
struct Link {
    rx: Box<[u8]>,
    rx_start: usize,
    rx_end: usize,
    /// The next frame's header, its payload not yet (wholly) read.
    pending: Option<Header>,
    /// Payload bytes of the pending frame not yet read.
    payload_left: usize,
    /// Control frames (abort, joined) waiting for a frame boundary.
    ctrl: Vec<u8>,
    /// A data frame is partly written: control frames must wait.
    tx_mid: bool,
    /// (group, seq) of the last frame seen from this peer.
    last_seen: Option<(u32, u64)>,
    /// The peer closed the link (seen while watching; a receive from it fails).
    closed: bool,
}

impl Link {
    fn new() -> Link {
        Link {
            rx: vec![0; STAGING].into_boxed_slice(),
            rx_start: 0,
            rx_end: 0,
            pending: None,
            payload_left: 0,
            ctrl: Vec::new(),
            tx_mid: false,
            last_seen: None,
            closed: false,
        }
    }

    fn staged(&self) -> usize {
        self.rx_end - self.rx_start
    }

    fn joined(&self, fp: &Fingerprint) -> bool {
        matches!(self.last_seen, Some((g, s)) if g == fp.group && s >= fp.seq)
    }
}

/// Framed, fingerprinted messaging between all ranks over one [`Pairs`] backend.
pub struct Channel {
    pairs: Box<dyn Pairs>,
    links: Vec<Link>,
    poisoned: Option<CollectiveError>,
    timeout: Duration,
    /// Payload bytes and data frames written completely (headers not counted).
    sent: crate::Traffic,
}

impl fmt::Debug for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Channel")
            .field("rank", &self.pairs.rank())
            .field("size", &self.pairs.size())
            .field("poisoned", &self.poisoned.is_some())
            .finish()
    }
}

fn lost(call: &CallState, peer: usize, e: LinkError) -> CollectiveError {
    CollectiveError::PeerLost {
        call: call.fp.call(),
        peer,
        reason: e.to_string(),
    }
}

impl Channel {
    /// Frames over `pairs`; point-to-point calls time out after `timeout`.
    pub fn new(pairs: Box<dyn Pairs>, timeout: Duration) -> Channel {
        let links = (0..pairs.size()).map(|_| Link::new()).collect();
        Channel {
            pairs,
            links,
            poisoned: None,
            timeout,
            sent: crate::Traffic::default(),
        }
    }

    /// What this rank has sent over the channel: payload bytes and messages of every completed
    /// exchange (frame headers and fingerprints not counted).
    pub fn sent(&self) -> crate::Traffic {
        self.sent
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.pairs.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.pairs.size()
    }

    /// The failure that made this channel unusable, if any.
    pub fn poisoned(&self) -> Option<&CollectiveError> {
        self.poisoned.as_ref()
    }

    fn p2p_call(&self, peer: usize, tag: u64, len: usize) -> CallState {
        let members: Arc<[usize]> = (0..self.size()).collect();
        CallState::new(
            Fingerprint {
                group: 0,
                seq: tag,
                op: CollectiveOp::PointToPoint,
                dtype: None,
                reduce: None,
                root: peer.min(self.rank()) as u32,
                count: len as u64,
            },
            members,
            self.rank(),
            self.timeout,
            self.timeout,
        )
    }

    /// Sends `data` to `peer` with `tag`; the peer receives it with [`Channel::recv_into`] and
    /// the same tag and length.
    pub fn send(&mut self, peer: usize, tag: u64, data: &[u8]) -> Result<()> {
        let mut call = self.p2p_call(peer, tag, data.len());
        self.exchange(&mut call, &[SendOp { peer, tag, data }], &mut [])
    }

    /// Receives the message `peer` sent with `tag` into `buf`, which must be exactly its length.
    pub fn recv_into(&mut self, peer: usize, tag: u64, buf: &mut [u8]) -> Result<()> {
        let mut call = self.p2p_call(peer, tag, buf.len());
        self.exchange(&mut call, &[], &mut [RecvOp { peer, tag, buf }])
    }

    /// Runs `sends` and `recvs` concurrently until all are done, the call's deadline passes, or
    /// a peer fails. At most one send and one receive per peer. On failure the channel is
    /// poisoned and every peer of the call is told (an abort frame), so they fail too.
    pub fn exchange(
        &mut self,
        call: &mut CallState,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
    ) -> Result<()> {
        if let Some(e) = &self.poisoned {
            return Err(CollectiveError::Poisoned(Box::new(e.clone())));
        }
        let r = self.drive(call, sends, recvs);
        if let Err(e) = &r {
            self.fail(call, e);
        }
        r
    }

    /// Poisons the channel with `e` and sends an abort frame carrying its text to every peer of
    /// the call (best effort, without blocking).
    pub fn fail(&mut self, call: &CallState, e: &CollectiveError) {
        if self.poisoned.is_some() {
            return;
        }
        let mut reason = match e {
            CollectiveError::Aborted { reason, .. } => reason.clone(),
            e => e.to_string(),
        };
        if reason.len() > MAX_ABORT_LEN {
            let mut cut = MAX_ABORT_LEN;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        for (g, &glob) in call.members.iter().enumerate() {
            if g == call.me {
                continue;
            }
            self.queue_ctrl(glob, FrameKind::Abort, &call.fp, reason.as_bytes());
            let _ = self.flush_ctrl(glob);
        }
        self.poisoned = Some(e.clone());
    }

    fn queue_ctrl(&mut self, glob: usize, kind: FrameKind, fp: &Fingerprint, payload: &[u8]) {
        let h = Header {
            kind,
            fp: *fp,
            tag: 0,
            len: payload.len() as u64,
        };
        let l = &mut self.links[glob];
        l.ctrl.extend_from_slice(&h.encode());
        l.ctrl.extend_from_slice(payload);
    }

    /// Writes queued control frames to `glob` if no data frame is half written; true when none
    /// remain queued.
    fn flush_ctrl(&mut self, glob: usize) -> std::result::Result<bool, LinkError> {
        let l = &mut self.links[glob];
        if l.ctrl.is_empty() {
            return Ok(true);
        }
        if l.tx_mid {
            return Ok(false);
        }
        while !l.ctrl.is_empty() {
            let n = self.pairs.try_write(glob, &[IoSlice::new(&l.ctrl)])?;
            if n == 0 {
                return Ok(false);
            }
            l.ctrl.drain(..n);
        }
        Ok(true)
    }

    fn drive(
        &mut self,
        call: &mut CallState,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
    ) -> Result<()> {
        let size = call.members.len();
        for (peer, what) in sends
            .iter()
            .map(|s| (s.peer, "send to"))
            .chain(recvs.iter().map(|r| (r.peer, "receive from")))
        {
            if peer >= size || peer == call.me {
                return Err(CollectiveError::InvalidArgument {
                    call: call.fp.call(),
                    rank: call.me,
                    problem: format!("cannot {what} rank {peer} in a group of {size}"),
                });
            }
        }
        let mut sent: SmallVec<[usize; 8]> = SmallVec::from_elem(0, sends.len());
        let mut got: SmallVec<[Option<usize>; 8]> = SmallVec::from_elem(Some(0), recvs.len());
        // A send to a peer that closed its link: reported once the receives show whether the
        // peer left an abort (its reason) before it went.
        let mut lost_peer: Option<(usize, CollectiveError)> = None;
        let mut last_progress = Instant::now();
        loop {
            let mut done = true;
            let mut progressed = false;
            for (s, off) in sends.iter().zip(sent.iter_mut()) {
                if lost_peer.is_some() {
                    break;
                }
                let before = *off;
                match self.progress_send(call, s, off) {
                    Ok(d) => done &= d,
                    Err(e @ CollectiveError::PeerLost { .. }) => lost_peer = Some((s.peer, e)),
                    Err(e) => return Err(e),
                }
                progressed |= *off != before;
            }
            for (r, off) in recvs.iter_mut().zip(got.iter_mut()) {
                if let Some(o) = off {
                    let before = *o;
                    if self.progress_recv(call, r, o)? {
                        *off = None;
                        progressed = true;
                    } else {
                        done = false;
                        progressed |= *o != before;
                    }
                }
            }
            if let Some((g, e)) = lost_peer.take() {
                if done
                    || recvs
                        .iter()
                        .zip(&got)
                        .all(|(r, o)| r.peer != g || o.is_none())
                {
                    if self.links[call.members[g]].pending.is_none() {
                        self.next_header(call, g)?;
                    }
                    return Err(e);
                }
                lost_peer = Some((g, e));
            }
            if done {
                return self.finish(call);
            }
            if progressed {
                last_progress = Instant::now();
                // Every link was driven until it would block or its operation was done: go on
                // while bytes move, re-checking the deadline.
                self.check_deadline(call)?;
                continue;
            }
            self.idle(
                call,
                |g| {
                    recvs
                        .iter()
                        .zip(&got)
                        .any(|(r, o)| r.peer == g && o.is_some())
                },
                last_progress,
            )?;
        }
    }

    /// Ends a call on this rank: flushes control frames still queued for its peers.
    pub(crate) fn finish(&mut self, call: &CallState) -> Result<()> {
        for &glob in call.members.iter() {
            if glob != self.rank() {
                self.flush_ctrl(glob)
                    .map_err(|e| lost(call, group_rank(call, glob), e))?;
            }
        }
        Ok(())
    }

    fn timeout_error(&self, call: &CallState) -> CollectiveError {
        CollectiveError::Timeout {
            call: call.fp.call(),
            rank: call.me,
            after: call.timeout,
            missing: self.missing(call),
            gone: call
                .members
                .iter()
                .enumerate()
                .filter(|&(g, &glob)| g != call.me && self.links[glob].closed)
                .map(|(g, _)| g)
                .collect(),
        }
    }

    /// Fails with [`CollectiveError::Timeout`] once the call's deadline passed.
    pub(crate) fn check_deadline(&self, call: &CallState) -> Result<()> {
        if Instant::now() >= call.deadline() {
            return Err(self.timeout_error(call));
        }
        Ok(())
    }

    /// Called when a pass over a call's operations moved nothing (every link would block, or
    /// waits on another): watches idle links for control frames, announces and reports
    /// stalls, enforces the deadline, then polls again (within the call's spin after
    /// `last_progress`) or sleeps until a link may move. `busy(g)` is true for group ranks
    /// with a receive in progress (their frames are read by it, not by the watch).
    pub(crate) fn idle(
        &mut self,
        call: &mut CallState,
        busy: impl Fn(usize) -> bool,
        last_progress: Instant,
    ) -> Result<()> {
        let now = Instant::now();
        let elapsed = now - call.started;
        if elapsed >= WATCH_AFTER {
            self.watch(call, &busy)?;
        }
        if !call.announced && elapsed >= call.stall_warning / 2 {
            call.announced = true;
            let fp = call.fp;
            for (g, &glob) in call.members.clone().iter().enumerate() {
                if g != call.me {
                    self.queue_ctrl(glob, FrameKind::Joined, &fp, &[]);
                }
            }
        }
        if !call.warned && elapsed >= call.stall_warning {
            call.warned = true;
            tracing::warn!(
                collective = %call.fp,
                rank = call.me,
                waiting_s = elapsed.as_secs_f64(),
                missing = ?self.missing(call),
                "collective stalled: ranks listed as missing have not joined it"
            );
        }
        if now >= call.deadline() {
            return Err(self.timeout_error(call));
        }
        if now < last_progress + call.spin {
            // Poll again, yielding the core in between: a peer that shares this core runs at
            // once, as a sleep and a wake-up would let it, but without their latency. (A pure
            // pause loop measured far worse here: ranks woken on one core starve each other.)
            std::thread::yield_now();
            return Ok(());
        }
        let mut wake = call.deadline();
        for t in [
            call.started + WATCH_AFTER,
            call.started + call.stall_warning / 2,
            call.started + call.stall_warning,
        ] {
            if t > now {
                wake = wake.min(t);
            }
        }
        self.pairs.wait(wake).map_err(|e| lost(call, call.me, e))
    }

    /// Group ranks that sent nothing for this call.
    fn missing(&self, call: &CallState) -> Vec<usize> {
        call.members
            .iter()
            .enumerate()
            .filter(|&(g, &glob)| g != call.me && !self.links[glob].joined(&call.fp))
            .map(|(g, _)| g)
            .collect()
    }

    /// Reads headers from links without an active receive: control frames (abort, joined)
    /// take effect; a data header waits for its receive.
    fn watch(&mut self, call: &CallState, busy: &impl Fn(usize) -> bool) -> Result<()> {
        for g in 0..call.members.len() {
            if g == call.me || busy(g) {
                continue;
            }
            let glob = call.members[g];
            if self.links[glob].closed {
                continue;
            }
            // A peer that left after its part of the call is not an error here: a receive
            // from it reports it, and timeouts name it.
            let r = match self.flush_ctrl(glob) {
                Ok(_) => self.next_header(call, g).map(|_| ()),
                Err(e) => Err(lost(call, g, e)),
            };
            match r {
                Err(CollectiveError::PeerLost { .. }) => self.links[glob].closed = true,
                r => r?,
            }
        }
        Ok(())
    }

    fn progress_send(
        &mut self,
        call: &CallState,
        s: &SendOp<'_>,
        sent: &mut usize,
    ) -> Result<bool> {
        self.send_frame(call, s.peer, s.tag, s.data, sent)
    }

    /// Writes the data frame `tag` carrying `data` to group rank `g` as far as the link takes
    /// it now; `sent` counts the frame's bytes written so far (header included). True once the
    /// whole frame is written.
    pub(crate) fn send_frame(
        &mut self,
        call: &CallState,
        g: usize,
        tag: u64,
        data: &[u8],
        sent: &mut usize,
    ) -> Result<bool> {
        let total = HEADER_LEN + data.len();
        let n_before = *sent;
        let glob = call.members[g];
        if *sent == 0 && !self.flush_ctrl(glob).map_err(|e| lost(call, g, e))? {
            return Ok(false);
        }
        let hdr = Header {
            kind: FrameKind::Data,
            fp: call.fp,
            tag,
            len: data.len() as u64,
        }
        .encode();
        while *sent < total {
            let r = if *sent < HEADER_LEN {
                self.pairs
                    .try_write(glob, &[IoSlice::new(&hdr[*sent..]), IoSlice::new(data)])
            } else {
                self.pairs
                    .try_write(glob, &[IoSlice::new(&data[*sent - HEADER_LEN..])])
            };
            let n = match r {
                Ok(n) => n,
                Err(e) => return Err(self.write_failed(call, g, e)),
            };
            if n == 0 {
                break;
            }
            *sent += n;
        }
        self.links[glob].tx_mid = *sent > 0 && *sent < total;
        if *sent == total && n_before < total {
            self.sent.bytes += data.len() as u64;
            self.sent.messages += 1;
        }
        Ok(*sent == total)
    }

    /// The error for a failed write to group rank `g`: an abort the peer left before it
    /// closed explains more than the closed link, so it is read first.
    fn write_failed(&mut self, call: &CallState, g: usize, e: LinkError) -> CollectiveError {
        if self.links[call.members[g]].pending.is_none() {
            if let Err(a @ CollectiveError::Aborted { .. }) = self.next_header(call, g) {
                return a;
            }
        }
        lost(call, g, e)
    }

    /// The next frame header from group rank `g`, handling control frames on the way; `None`
    /// until a data header has arrived.
    fn next_header(&mut self, call: &CallState, g: usize) -> Result<Option<Header>> {
        let glob = call.members[g];
        loop {
            if let Some(h) = self.links[glob].pending {
                return Ok(Some(h));
            }
            if !self.stage(call, g, HEADER_LEN)? {
                return Ok(None);
            }
            let l = &self.links[glob];
            let mut raw = [0u8; HEADER_LEN];
            raw.copy_from_slice(&l.rx[l.rx_start..l.rx_start + HEADER_LEN]);
            let h = Header::decode(&raw).map_err(|problem| CollectiveError::Protocol {
                call: call.fp.call(),
                peer: g,
                problem,
            })?;
            match h.kind {
                FrameKind::Abort => {
                    // Bounded by decode (MAX_ABORT_LEN < STAGING): wait for the whole frame.
                    let len = h.len as usize;
                    if !self.stage(call, g, HEADER_LEN + len)? {
                        return Ok(None);
                    }
                    let l = &mut self.links[glob];
                    let start = l.rx_start + HEADER_LEN;
                    let reason = String::from_utf8_lossy(&l.rx[start..start + len]).into_owned();
                    l.rx_start = start + len;
                    return Err(CollectiveError::Aborted {
                        call: call.fp.call(),
                        from: g,
                        reason,
                    });
                }
                FrameKind::Joined => {
                    let l = &mut self.links[glob];
                    l.rx_start += HEADER_LEN;
                    l.last_seen = Some((h.fp.group, h.fp.seq));
                    if h.fp.group == call.fp.group && h.fp.seq == call.fp.seq && h.fp != call.fp {
                        return Err(self.mismatch(call, g, h.fp));
                    }
                }
                FrameKind::Data => {
                    let l = &mut self.links[glob];
                    l.rx_start += HEADER_LEN;
                    l.last_seen = Some((h.fp.group, h.fp.seq));
                    l.pending = Some(h);
                    // Only read once `recv_header` checked the length against a buffer.
                    l.payload_left = usize::try_from(h.len).unwrap_or(usize::MAX);
                }
            }
        }
    }

    fn mismatch(&self, call: &CallState, g: usize, theirs: Fingerprint) -> CollectiveError {
        CollectiveError::Mismatch {
            call: call.fp.call(),
            rank: call.me,
            peer: g,
            ours: call.fp,
            theirs,
        }
    }

    /// Makes at least `want` (at most [`STAGING`]) bytes staged from group rank `g`; false if
    /// they have not arrived yet.
    fn stage(&mut self, call: &CallState, g: usize, want: usize) -> Result<bool> {
        let glob = call.members[g];
        let l = &mut self.links[glob];
        if l.staged() >= want {
            return Ok(true);
        }
        if l.rx_start + want > STAGING {
            l.rx.copy_within(l.rx_start..l.rx_end, 0);
            l.rx_end -= l.rx_start;
            l.rx_start = 0;
        }
        while l.staged() < want {
            let n = self
                .pairs
                .try_read(glob, &mut l.rx[l.rx_end..])
                .map_err(|e| lost(call, g, e))?;
            if n == 0 {
                return Ok(false);
            }
            l.rx_end += n;
        }
        Ok(true)
    }

    fn progress_recv(
        &mut self,
        call: &CallState,
        r: &mut RecvOp<'_>,
        off: &mut usize,
    ) -> Result<bool> {
        if !self.recv_header(call, r.peer, r.tag, r.buf.len())? {
            return Ok(false);
        }
        self.recv_payload(call, r.peer, r.buf, off)
    }

    /// True once the header of the next data frame from group rank `g` is here and matches
    /// this call, `tag` and `len` payload bytes (a mismatch is an error); false while it has
    /// not arrived.
    pub(crate) fn recv_header(
        &mut self,
        call: &CallState,
        g: usize,
        tag: u64,
        len: usize,
    ) -> Result<bool> {
        let Some(h) = self.next_header(call, g)? else {
            return Ok(false);
        };
        if h.fp != call.fp {
            return Err(self.mismatch(call, g, h.fp));
        }
        if h.tag != tag || h.len != len as u64 {
            return Err(CollectiveError::Protocol {
                call: call.fp.call(),
                peer: g,
                problem: format!(
                    "frame with tag {} and {} bytes where tag {tag} and {len} bytes were expected",
                    h.tag, h.len,
                ),
            });
        }
        Ok(true)
    }

    /// Reads the payload of the frame whose header [`Channel::recv_header`] accepted into
    /// `buf` (its whole length) from byte `*off` on, as far as it has arrived. True once
    /// complete: the link then expects the next header.
    pub(crate) fn recv_payload(
        &mut self,
        call: &CallState,
        g: usize,
        buf: &mut [u8],
        off: &mut usize,
    ) -> Result<bool> {
        while *off < buf.len() {
            let n = self.recv_some(call, g, &mut buf[*off..])?;
            if n == 0 {
                break;
            }
            *off += n;
        }
        if *off < buf.len() {
            return Ok(false);
        }
        // An empty frame is complete at once.
        let l = &mut self.links[call.members[g]];
        if l.payload_left == 0 {
            l.pending = None;
        }
        Ok(true)
    }

    /// Reads the next bytes of the accepted frame's payload into `dst` (at most what is left
    /// of the frame); returns how many arrived (0: none yet). After the last byte the link
    /// expects the next header.
    pub(crate) fn recv_some(
        &mut self,
        call: &CallState,
        g: usize,
        dst: &mut [u8],
    ) -> Result<usize> {
        let glob = call.members[g];
        let l = &mut self.links[glob];
        let want = dst.len().min(l.payload_left);
        if want == 0 {
            if l.payload_left == 0 {
                l.pending = None;
            }
            return Ok(0);
        }
        let n = if l.staged() > 0 {
            let take = l.staged().min(want);
            dst[..take].copy_from_slice(&l.rx[l.rx_start..l.rx_start + take]);
            l.rx_start += take;
            take
        } else if l.payload_left >= STAGING / 2 {
            // Large remainder: straight into the destination.
            self.pairs
                .try_read(glob, &mut dst[..want])
                .map_err(|e| lost(call, g, e))?
        } else {
            // The frame's tail: through staging, so that the next header comes with it.
            l.rx_start = 0;
            l.rx_end = self
                .pairs
                .try_read(glob, &mut l.rx[..])
                .map_err(|e| lost(call, g, e))?;
            let take = l.rx_end.min(want);
            dst[..take].copy_from_slice(&l.rx[..take]);
            l.rx_start = take;
            take
        };
        l.payload_left -= n;
        if l.payload_left == 0 {
            l.pending = None;
        }
        Ok(n)
    }
}

fn group_rank(call: &CallState, glob: usize) -> usize {
    call.members.iter().position(|&m| m == glob).unwrap_or(glob)
}
