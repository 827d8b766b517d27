//! The UDP socket under a plane's endpoint: quinn's tokio socket, with large kernel buffers and
//! one 64 KiB receive buffer per datagram slot instead of room for 64 GRO segments of 64 KiB.
//!
//! quinn sizes its receive buffer as max UDP payload × GRO segments × batch (32): with the
//! 65 527-byte datagrams loopback uses, 134 MB per task. The kernel never coalesces more than
//! 64 KiB of UDP payload into one GRO packet, so one maximum datagram per slot holds any of them
//! (quinn still splits a coalesced packet by its segment size): 2 MB.

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, Runtime, UdpPoller};
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Kernel socket buffer sizes asked for (the kernel caps them at its `rmem_max`/`wmem_max`).
pub const SOCKET_BUFFER: usize = 8 << 20;

/// quinn's socket, reporting one receive segment per datagram slot.
#[derive(Debug)]
pub struct PlaneSocket(Arc<dyn AsyncUdpSocket>);

impl AsyncUdpSocket for PlaneSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.0.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.0.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.0.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.0.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.0.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        1
    }

    fn may_fragment(&self) -> bool {
        self.0.may_fragment()
    }
}

/// Binds `addr` with large kernel buffers and wraps it for quinn.
pub fn bind(addr: SocketAddr, runtime: &quinn::TokioRuntime) -> io::Result<Arc<PlaneSocket>> {
    let socket = std::net::UdpSocket::bind(addr)?;
    #[cfg(target_os = "linux")]
    {
        let s = socket2::SockRef::from(&socket);
        let _ = s.set_recv_buffer_size(SOCKET_BUFFER);
        let _ = s.set_send_buffer_size(SOCKET_BUFFER);
    }
    Ok(Arc::new(PlaneSocket(runtime.wrap_udp_socket(socket)?)))
}
