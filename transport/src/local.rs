//! The in-process rendezvous: a tensor handed from one partition to another in the same process
//! moves no bytes — the receiver gets the sender's buffer.

use crate::rendezvous::{RecvCallback, Rendezvous, RendezvousError, RendezvousKey};
use dflow_graph::Tensor;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};

enum Slot {
    Value(Tensor),
    Waiting(RecvCallback),
}

#[derive(Default)]
struct State {
    slots: HashMap<(u64, Arc<RendezvousKey>), Slot>,
    aborted: HashMap<u64, RendezvousError>,
    /// Keys already consumed by a Recv in a step (to detect duplicates).
    done: HashSet<(u64, Arc<RendezvousKey>)>,
}

/// The in-process rendezvous backend.
#[derive(Default)]
pub struct LocalRendezvous {
    state: Mutex<State>,
}

impl fmt::Debug for LocalRendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.lock().slots.len();
        write!(f, "LocalRendezvous({n} pending)")
    }
}

impl LocalRendezvous {
    /// An empty rendezvous.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A callback never runs under the lock, so poisoning means a bug elsewhere; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Rendezvous for LocalRendezvous {
    fn send(
        &self,
        key: &Arc<RendezvousKey>,
        step: u64,
        value: Tensor,
    ) -> Result<(), RendezvousError> {
        let waiter = {
            let mut st = self.lock();
            if let Some(cause) = st.aborted.get(&step) {
                return Err(cause.clone());
            }
            let k = (step, key.clone());
            if st.done.contains(&k) {
                return Err(RendezvousError::DuplicateSend {
                    key: (**key).clone(),
                    step,
                });
            }
            match st.slots.remove(&k) {
                Some(Slot::Waiting(cb)) => {
                    st.done.insert(k);
                    cb
                }
                Some(Slot::Value(v)) => {
                    st.slots.insert(k, Slot::Value(v));
                    return Err(RendezvousError::DuplicateSend {
                        key: (**key).clone(),
                        step,
                    });
                }
                None => {
                    st.slots.insert(k, Slot::Value(value));
                    return Ok(());
                }
            }
        };
        waiter(Ok(value));
        Ok(())
    }

    fn recv_async(&self, key: &Arc<RendezvousKey>, step: u64, done: RecvCallback) {
        let ready = {
            let mut st = self.lock();
            if let Some(cause) = st.aborted.get(&step) {
                Err(cause.clone())
            } else {
                let k = (step, key.clone());
                match st.slots.remove(&k) {
                    Some(Slot::Value(v)) => {
                        st.done.insert(k);
                        Ok(v)
                    }
                    Some(w @ Slot::Waiting(_)) => {
                        st.slots.insert(k, w);
                        Err(RendezvousError::DuplicateRecv {
                            key: (**key).clone(),
                            step,
                        })
                    }
                    None if st.done.contains(&k) => Err(RendezvousError::DuplicateRecv {
                        key: (**key).clone(),
                        step,
                    }),
                    None => {
                        st.slots.insert(k, Slot::Waiting(done));
                        return;
                    }
                }
            }
        };
        done(ready);
    }

    fn abort_step(&self, step: u64, cause: RendezvousError) {
        let waiters: Vec<RecvCallback> = {
            let mut st = self.lock();
            st.aborted.entry(step).or_insert_with(|| cause.clone());
            let keys: Vec<_> = st
                .slots
                .keys()
                .filter(|(s, _)| *s == step)
                .cloned()
                .collect();
            keys.into_iter()
                .filter_map(|k| match st.slots.remove(&k) {
                    Some(Slot::Waiting(cb)) => Some(cb),
                    _ => None,
                })
                .collect()
        };
        for cb in waiters {
            cb(Err(cause.clone()));
        }
    }

    fn finish_step(&self, step: u64) {
        let mut st = self.lock();
        st.slots.retain(|(s, _), _| *s != step);
        st.done.retain(|(s, _)| *s != step);
        st.aborted.remove(&step);
    }

    fn pending_recvs(&self, step: u64) -> Vec<RendezvousKey> {
        let st = self.lock();
        let mut v: Vec<_> = st
            .slots
            .iter()
            .filter(|((s, _), slot)| *s == step && matches!(slot, Slot::Waiting(_)))
            .map(|((_, k), _)| (**k).clone())
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn key(name: &str) -> Arc<RendezvousKey> {
        Arc::new(RendezvousKey::new(
            "/job:a/replica:0/task:0/device:CPU:0",
            "/job:b/replica:0/task:0/device:CPU:0",
            name,
        ))
    }

    fn recv(
        r: &LocalRendezvous,
        k: &Arc<RendezvousKey>,
        step: u64,
    ) -> mpsc::Receiver<Result<Tensor, RendezvousError>> {
        let (tx, rx) = mpsc::channel();
        r.recv_async(
            k,
            step,
            Box::new(move |v| {
                let _ = tx.send(v);
            }),
        );
        rx
    }

    #[test]
    fn send_then_recv_hands_over_the_same_buffer() {
        let r = LocalRendezvous::new();
        let t = Tensor::from_slice(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
        let ptr = t.data_ptr();
        let copies = dflow_graph::tensor::buffer_copies();
        r.send(&key("x:0"), 1, t).unwrap();
        let got = recv(&r, &key("x:0"), 1).try_recv().unwrap().unwrap();
        assert_eq!(
            got.data_ptr(),
            ptr,
            "zero-copy: the receiver sees the sender's buffer"
        );
        assert_eq!(dflow_graph::tensor::buffer_copies(), copies);
    }

    #[test]
    fn recv_before_send_completes_on_send() {
        let r = LocalRendezvous::new();
        let rx = recv(&r, &key("x:0"), 7);
        assert!(rx.try_recv().is_err());
        assert_eq!(r.pending_recvs(7), vec![(*key("x:0")).clone()]);
        r.send(&key("x:0"), 7, Tensor::scalar(5i32)).unwrap();
        assert_eq!(rx.try_recv().unwrap().unwrap(), Tensor::scalar(5i32));
        assert!(r.pending_recvs(7).is_empty());
    }

    #[test]
    fn steps_are_independent() {
        let r = LocalRendezvous::new();
        r.send(&key("x:0"), 1, Tensor::scalar(1i32)).unwrap();
        r.send(&key("x:0"), 2, Tensor::scalar(2i32)).unwrap();
        assert_eq!(
            recv(&r, &key("x:0"), 2).try_recv().unwrap().unwrap(),
            Tensor::scalar(2i32)
        );
        assert_eq!(
            recv(&r, &key("x:0"), 1).try_recv().unwrap().unwrap(),
            Tensor::scalar(1i32)
        );
    }

    #[test]
    fn abort_wakes_pending_and_future_recvs_with_the_cause() {
        let r = LocalRendezvous::new();
        let rx = recv(&r, &key("a:0"), 3);
        let cause = RendezvousError::Aborted {
            step: 3,
            cause: "node `m` failed".into(),
        };
        r.abort_step(3, cause.clone());
        assert_eq!(rx.try_recv().unwrap().unwrap_err(), cause);
        assert_eq!(
            recv(&r, &key("b:0"), 3).try_recv().unwrap().unwrap_err(),
            cause
        );
        assert_eq!(
            r.send(&key("c:0"), 3, Tensor::scalar(1i32)).unwrap_err(),
            cause
        );
        r.finish_step(3);
        r.send(&key("c:0"), 4, Tensor::scalar(1i32)).unwrap();
    }

    #[test]
    fn duplicates_are_errors() {
        let r = LocalRendezvous::new();
        r.send(&key("x:0"), 1, Tensor::scalar(1i32)).unwrap();
        assert!(matches!(
            r.send(&key("x:0"), 1, Tensor::scalar(1i32)),
            Err(RendezvousError::DuplicateSend { .. })
        ));
        recv(&r, &key("x:0"), 1).try_recv().unwrap().unwrap();
        assert!(matches!(
            recv(&r, &key("x:0"), 1).try_recv().unwrap(),
            Err(RendezvousError::DuplicateRecv { .. })
        ));
    }

    #[test]
    fn keys_parse_and_print() {
        let k = key("x:0");
        assert_eq!(RendezvousKey::parse(&k.to_string()).unwrap(), *k);
        assert!(RendezvousKey::parse("a;b").is_err());
    }
}
