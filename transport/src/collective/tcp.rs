//! The TCP backend: one persistent connection per pair of ranks (rank i connects to every
//! rank below it and accepts the ranks above), TCP_NODELAY, large socket buffers, vectored
//! writes, non-blocking sockets under one `mio` poll. Optionally each connection is
//! authenticated with the cluster secret ([`crate::auth`]) before it carries any frame.

use super::error::{CollectiveError, Result};
use super::pairs::{connect_on_threads, LinkError, Pairs};
use crate::auth::{Acceptor, Connector, Secret};
use mio::net::TcpStream as MioStream;
use mio::{Events, Interest, Poll, Token};
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

const HELLO_MAGIC: [u8; 4] = *b"DFCH";
const HELLO_VERSION: u8 = 1;
const HELLO_LEN: usize = 14;
/// Longest handshake message accepted (auth messages are a few hundred bytes).
const MAX_AUTH_MSG: usize = 1024;

/// How ranks connect.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// Setting up the whole mesh fails after this long (default 30 s).
    pub connect_timeout: Duration,
    /// SO_SNDBUF and SO_RCVBUF of every connection; `None` leaves the kernel's autotuning
    /// (default 4 MiB).
    pub socket_buffer: Option<usize>,
    /// When set, every connection proves both ends know the secret before use.
    pub secret: Option<Secret>,
    /// TCP congestion control of every connection (`TCP_CONGESTION`, e.g. `cubic`). `None`
    /// (the default) picks [`crate::sockopt::HOST_CONGESTION`] for connections within this
    /// host and leaves the system's default elsewhere (see [`crate::sockopt::tune_congestion`]):
    /// over 127.0.0.1 BBR's pacing halved 4 MiB all-reduce throughput here.
    pub congestion: Option<String>,
}

impl Default for TcpOptions {
    fn default() -> TcpOptions {
        TcpOptions {
            connect_timeout: Duration::from_secs(30),
            socket_buffer: Some(4 << 20),
            secret: None,
            congestion: None,
        }
    }
}

/// A rank's listening socket, bound before the ranks exchange addresses.
#[derive(Debug)]
pub struct TcpGroupListener {
    listener: TcpListener,
}

impl TcpGroupListener {
    /// Binds the listening socket (port 0 picks a free port; see [`TcpGroupListener::local_addr`]).
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<TcpGroupListener> {
        Ok(TcpGroupListener {
            listener: TcpListener::bind(addr)?,
        })
    }

    /// The bound address, to be published as this rank's entry of the address list.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Connects this rank (`addrs[rank]` is its own address, rank 0 first) to every other
    /// rank. Blocks until the mesh is complete or `opts.connect_timeout` passes.
    pub fn connect(self, rank: usize, addrs: &[SocketAddr], opts: &TcpOptions) -> Result<TcpPairs> {
        let size = addrs.len();
        let setup = |problem: String| CollectiveError::Setup { rank, problem };
        if rank >= size {
            return Err(setup(format!(
                "rank {rank} is not in a list of {size} addresses"
            )));
        }
        let deadline = Instant::now() + opts.connect_timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        for (peer, addr) in addrs.iter().enumerate().take(rank) {
            let s = connect_to(*addr, deadline, opts)
                .map_err(|e| setup(format!("connecting to rank {peer} at {addr}: {e}")))?;
            handshake(&s, rank, size, Some(peer), opts, deadline)
                .map_err(|e| setup(format!("handshake with rank {peer} at {addr}: {e}")))?;
            streams[peer] = Some(s);
        }
        self.listener
            .set_nonblocking(true)
            .map_err(|e| setup(e.to_string()))?;
        let mut missing = size - rank - 1;
        while missing > 0 {
            match self.listener.accept() {
                Ok((s, from)) => {
                    let _ = s.set_nonblocking(false);
                    tune(&s, opts);
                    match handshake(&s, rank, size, None, opts, deadline) {
                        Ok(peer) if peer > rank && streams[peer].is_none() => {
                            streams[peer] = Some(s);
                            missing -= 1;
                        }
                        Ok(peer) => {
                            tracing::warn!(%from, peer, "dropping a second or unexpected connection from rank {peer}")
                        }
                        Err(e) => {
                            tracing::warn!(%from, error = %e, "dropping a connection that failed the collective handshake")
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let waiting: Vec<usize> =
                            (rank + 1..size).filter(|&p| streams[p].is_none()).collect();
                        return Err(setup(format!(
                            "timed out after {:?} waiting for ranks {waiting:?} to connect",
                            opts.connect_timeout
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(setup(format!("accepting: {e}"))),
            }
        }
        let poll = Poll::new().map_err(|e| setup(e.to_string()))?;
        let mut mio_streams = Vec::with_capacity(size);
        for (peer, s) in streams.into_iter().enumerate() {
            match s {
                None => mio_streams.push(None),
                Some(s) => {
                    s.set_nonblocking(true).map_err(|e| setup(e.to_string()))?;
                    let mut m = MioStream::from_std(s);
                    poll.registry()
                        .register(&mut m, Token(peer), Interest::READABLE | Interest::WRITABLE)
                        .map_err(|e| setup(e.to_string()))?;
                    mio_streams.push(Some(m));
                }
            }
        }
        Ok(TcpPairs {
            rank,
            streams: mio_streams,
            addrs: addrs.to_vec(),
            poll,
            events: Events::with_capacity(64),
        })
    }
}

fn tune(s: &TcpStream, opts: &TcpOptions) {
    let _ = s.set_nodelay(true);
    crate::sockopt::tune_congestion(s, opts.congestion.as_deref());
    if let Some(b) = opts.socket_buffer {
        let sock = socket2::SockRef::from(s);
        let _ = sock.set_send_buffer_size(b);
        let _ = sock.set_recv_buffer_size(b);
    }
}

fn connect_to(addr: SocketAddr, deadline: Instant, opts: &TcpOptions) -> io::Result<TcpStream> {
    loop {
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            None,
        )?;
        if let Some(b) = opts.socket_buffer {
            let _ = sock.set_send_buffer_size(b);
            let _ = sock.set_recv_buffer_size(b);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match sock.connect_timeout(&addr.into(), left.max(Duration::from_millis(1))) {
            Ok(()) => {
                let s: TcpStream = sock.into();
                tune(&s, opts);
                return Ok(s);
            }
            Err(e)
                if Instant::now() < deadline
                    && matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionReset
                    ) =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
}

fn hello(rank: usize, size: usize, auth: bool) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&HELLO_MAGIC);
    b[4] = HELLO_VERSION;
    b[5..9].copy_from_slice(&(rank as u32).to_le_bytes());
    b[9..13].copy_from_slice(&(size as u32).to_le_bytes());
    b[13] = u8::from(auth);
    b
}

/// Exchanges hellos (and the secret handshake); returns the peer's rank. `expect` is the rank
/// this side connected to (None when accepting).
fn handshake(
    s: &TcpStream,
    rank: usize,
    size: usize,
    expect: Option<usize>,
    opts: &TcpOptions,
    deadline: Instant,
) -> io::Result<usize> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))?;
    let mut s = s;
    let auth = opts.secret.is_some();
    s.write_all(&hello(rank, size, auth))?;
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b)?;
    let bad = |m: String| io::Error::new(io::ErrorKind::InvalidData, m);
    if b[0..4] != HELLO_MAGIC || b[4] != HELLO_VERSION {
        return Err(bad("not a dflow collective peer (bad hello)".into()));
    }
    let peer = u32::from_le_bytes([b[5], b[6], b[7], b[8]]) as usize;
    let peer_size = u32::from_le_bytes([b[9], b[10], b[11], b[12]]) as usize;
    if peer_size != size || peer >= size || peer == rank {
        return Err(bad(format!(
            "peer says it is rank {peer} of {peer_size}; this is rank {rank} of {size}"
        )));
    }
    if let Some(e) = expect {
        if peer != e {
            return Err(bad(format!(
                "expected rank {e}, the peer says it is rank {peer}"
            )));
        }
    }
    if (b[13] != 0) != auth {
        return Err(bad(format!(
            "rank {peer} {} a cluster secret and this rank {}",
            if b[13] != 0 { "uses" } else { "does not use" },
            if auth { "does" } else { "does not" }
        )));
    }
    if let Some(secret) = &opts.secret {
        authenticate(&mut s, secret, rank, peer, expect.is_some())?;
    }
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    Ok(peer)
}

fn authenticate(
    s: &mut &TcpStream,
    secret: &Secret,
    rank: usize,
    peer: usize,
    connecting: bool,
) -> io::Result<()> {
    let me = format!("rank {rank}");
    let who = format!("rank {peer}");
    let denied =
        |e: crate::auth::AuthError| io::Error::new(io::ErrorKind::PermissionDenied, e.to_string());
    if connecting {
        let (c, msg) = Connector::hello(secret, &me);
        write_msg(s, &msg)?;
        let challenge = read_msg(s)?;
        let (_, proof) = c.answer(&challenge, &who).map_err(denied)?;
        write_msg(s, &proof)?;
        let mut ok = [0u8; 1];
        s.read_exact(&mut ok)?;
    } else {
        let h = read_msg(s)?;
        let (a, challenge) = Acceptor::challenge(secret, &me, &h, &who).map_err(denied)?;
        write_msg(s, &challenge)?;
        let proof = read_msg(s)?;
        a.verify(&proof, &who).map_err(denied)?;
        s.write_all(&[1])?;
    }
    Ok(())
}

fn write_msg(s: &mut &TcpStream, m: &[u8]) -> io::Result<()> {
    s.write_all(&(m.len() as u16).to_le_bytes())?;
    s.write_all(m)
}

fn read_msg(s: &mut &TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len)?;
    let len = usize::from(u16::from_le_bytes(len));
    if len > MAX_AUTH_MSG {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("handshake message of {len} bytes (at most {MAX_AUTH_MSG})"),
        ));
    }
    let mut m = vec![0u8; len];
    s.read_exact(&mut m)?;
    Ok(m)
}

/// A rank's connections to every other rank.
#[derive(Debug)]
pub struct TcpPairs {
    rank: usize,
    streams: Vec<Option<MioStream>>,
    addrs: Vec<SocketAddr>,
    poll: Poll,
    events: Events,
}

impl TcpPairs {
    fn stream(&mut self, peer: usize) -> io::Result<&mut MioStream> {
        self.streams
            .get_mut(peer)
            .and_then(|s| s.as_mut())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("no connection to rank {peer}"),
                )
            })
    }
}

impl Pairs for TcpPairs {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.streams.len()
    }

    fn try_write(&mut self, peer: usize, bufs: &[IoSlice<'_>]) -> Result<usize, LinkError> {
        let s = self.stream(peer)?;
        loop {
            return match s.write_vectored(bufs) {
                Ok(0) if bufs.iter().any(|b| !b.is_empty()) => Err(LinkError::Closed),
                Ok(n) => Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if is_closed(&e) => Err(LinkError::Closed),
                Err(e) => Err(e.into()),
            };
        }
    }

    fn try_read(&mut self, peer: usize, buf: &mut [u8]) -> Result<usize, LinkError> {
        let s = self.stream(peer)?;
        loop {
            return match s.read(buf) {
                Ok(0) if !buf.is_empty() => Err(LinkError::Closed),
                Ok(n) => Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if is_closed(&e) => Err(LinkError::Closed),
                Err(e) => Err(e.into()),
            };
        }
    }

    fn wait(&mut self, until: Instant) -> Result<(), LinkError> {
        let left = until.saturating_duration_since(Instant::now());
        match self.poll.poll(&mut self.events, Some(left)) {
            Err(e) if e.kind() != io::ErrorKind::Interrupted => Err(e.into()),
            _ => Ok(()),
        }
    }

    fn describe(&self, peer: usize) -> String {
        self.addrs
            .get(peer)
            .map_or_else(|| format!("rank {peer}"), |a| a.to_string())
    }
}

fn is_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
    )
}

/// Binds one listener per rank on 127.0.0.1 and connects them on threads of this process:
/// `size` connected endpoints (tests and single-process benchmarks).
pub fn loopback_group(size: usize, opts: &TcpOptions) -> Result<Vec<TcpPairs>> {
    let setup = |rank: usize| {
        move |e: io::Error| CollectiveError::Setup {
            rank,
            problem: e.to_string(),
        }
    };
    let mut listeners = Vec::with_capacity(size);
    let mut addrs = Vec::with_capacity(size);
    for r in 0..size {
        let l = TcpGroupListener::bind("127.0.0.1:0").map_err(setup(r))?;
        addrs.push(l.local_addr().map_err(setup(r))?);
        listeners.push(l);
    }
    connect_on_threads(listeners, |r, l| l.connect(r, &addrs, opts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn congestion(p: &TcpPairs, peer: usize) -> String {
        let s = p.streams[peer].as_ref().expect("a connection");
        crate::sockopt::congestion(s).expect("TCP_CONGESTION")
    }

    #[test]
    fn loopback_links_avoid_paced_congestion_control() {
        let group = loopback_group(2, &TcpOptions::default()).unwrap();
        assert_eq!(congestion(&group[0], 1), crate::sockopt::HOST_CONGESTION);
        assert_eq!(congestion(&group[1], 0), crate::sockopt::HOST_CONGESTION);
        // An explicit choice wins (every Linux allows reno; bbr may not be built).
        let opts = TcpOptions {
            congestion: Some("reno".into()),
            ..TcpOptions::default()
        };
        let group = loopback_group(2, &opts).unwrap();
        assert_eq!(congestion(&group[0], 1), "reno");
    }
}
