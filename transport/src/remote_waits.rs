//! Recvs waiting on remote peers: what every data plane (TCP, QUIC, RDMA, shared memory) does
//! the same way when a Recv for a peer's key is registered, when that peer dies, and when a
//! step ends. The planes differ in how they know a key's sender and a peer's death; they pass
//! those in.

use crate::local::LocalRendezvous;
use crate::rendezvous::{RecvCallback, Rendezvous, RendezvousError, RendezvousKey};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

/// The steps that have (or had) a Recv waiting on a remote peer's key.
#[derive(Debug, Default)]
pub(crate) struct RemoteWaits {
    steps: Mutex<BTreeSet<u64>>,
}

impl RemoteWaits {
    fn steps(&self) -> std::sync::MutexGuard<'_, BTreeSet<u64>> {
        // Nothing runs under this lock but set operations: a poisoned lock is still consistent.
        self.steps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers with `local` a Recv of `key` for `step`, a key that `peer` sends, and records
    /// the step (so [`RemoteWaits::abort_waiting_on`] finds it). A plane marks a peer gone only
    /// after delivering every value that peer sent, so a value already here completes the
    /// Recv even when the peer has left since (a sender that sends and closes at once); when
    /// the peer is gone (`gone_cause` says why, `None` while it is alive) and the Recv still
    /// waits, nothing will come and the step fails. Checked after registering: a death
    /// between a check and the registration would otherwise miss this Recv.
    pub(crate) fn recv(
        &self,
        local: &LocalRendezvous,
        peer: &str,
        gone_cause: impl Fn() -> Option<String>,
        key: &Arc<RendezvousKey>,
        step: u64,
        done: RecvCallback,
    ) {
        let gone = |cause| RendezvousError::PeerGone {
            peer: peer.to_string(),
            cause,
        };
        self.steps().insert(step);
        local.recv_async(key, step, done);
        if let Some(cause) = gone_cause() {
            if local.pending_recvs(step).iter().any(|k| k == &**key) {
                local.abort_step(step, gone(cause));
            }
        }
    }

    /// Aborts, with `err`, every recorded step in which `local` has a Recv waiting on a key for
    /// which `from_dead_peer` is true (the peer is gone, so those Recvs would only time out).
    /// `from_dead_peer` runs with no lock of this type held and before any abort, so it may
    /// take the plane's own locks.
    pub(crate) fn abort_waiting_on(
        &self,
        local: &LocalRendezvous,
        err: &RendezvousError,
        from_dead_peer: impl Fn(&RendezvousKey) -> bool,
    ) {
        let steps: Vec<u64> = self.steps().iter().copied().collect();
        for step in steps {
            if local.pending_recvs(step).iter().any(&from_dead_peer) {
                local.abort_step(step, err.clone());
            }
        }
    }

    /// Forgets `step` (it finished).
    pub(crate) fn finish(&self, step: u64) {
        self.steps().remove(&step);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflow_graph::Tensor;
    use std::sync::mpsc;
    use std::time::Duration;

    fn key(name: &str) -> Arc<RendezvousKey> {
        Arc::new(RendezvousKey::new("/job:a/task:0", "/job:b/task:0", name))
    }

    fn waiter() -> (
        RecvCallback,
        mpsc::Receiver<Result<Tensor, RendezvousError>>,
    ) {
        let (tx, rx) = mpsc::channel();
        (
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
            rx,
        )
    }

    #[test]
    fn a_recv_from_a_dead_peer_fails_at_once_naming_it() {
        let (local, waits) = (LocalRendezvous::new(), RemoteWaits::default());
        let (done, rx) = waiter();
        waits.recv(&local, "ps0", || Some("reset".into()), &key("x:0"), 1, done);
        let err = rx
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(&err, RendezvousError::PeerGone { peer, cause } if peer == "ps0" && cause == "reset"),
            "{err}"
        );
    }

    #[test]
    fn a_value_that_arrived_before_its_sender_left_is_still_received() {
        let (local, waits) = (LocalRendezvous::new(), RemoteWaits::default());
        local.send(&key("x:0"), 3, Tensor::scalar(2.5f32)).unwrap();
        let (done, rx) = waiter();
        waits.recv(
            &local,
            "ps0",
            || Some("closed".into()),
            &key("x:0"),
            3,
            done,
        );
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap().unwrap();
        assert_eq!(got.as_slice::<f32>().unwrap(), &[2.5]);
    }

    #[test]
    fn a_peer_death_aborts_only_the_steps_waiting_on_its_keys() {
        let (local, waits) = (LocalRendezvous::new(), RemoteWaits::default());
        let (from_ps, rx_ps) = waiter();
        let (from_other, rx_other) = waiter();
        waits.recv(&local, "ps0", || None, &key("a:0"), 1, from_ps);
        waits.recv(&local, "ps1", || None, &key("b:0"), 2, from_other);
        let err = RendezvousError::PeerGone {
            peer: "ps0".into(),
            cause: "closed".into(),
        };
        waits.abort_waiting_on(&local, &err, |k| k.tensor_name() == "a:0");
        assert!(rx_ps.recv_timeout(Duration::from_secs(5)).unwrap().is_err());
        // Step 2 waits on ps1: untouched, and still delivered.
        assert!(rx_other.try_recv().is_err());
        local.send(&key("b:0"), 2, Tensor::scalar(7.0f32)).unwrap();
        let got = rx_other
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
            .unwrap();
        assert_eq!(got.as_slice::<f32>().unwrap(), &[7.0]);
        // A finished step is forgotten: a later death does not touch it.
        waits.finish(1);
        waits.finish(2);
        assert!(waits.steps().is_empty());
    }
}
