//! The RDMA protocol (slots, credits, immediates, ordering, errors) against the in-memory
//! fabric: two `Protocol`s, `a` sending to `b`.

use dflow_graph::{DType, Tensor};
use dflow_transport::rdma::imm::{Imm, ImmKind};
use dflow_transport::rdma::message::SlotAd;
use dflow_transport::rdma::protocol::{Event, Protocol};
use dflow_transport::rdma::sim::{SimFabric, SimVerbs};
use dflow_transport::rdma::verbs::{LocalSegment, Verbs, VerbsError};
use dflow_transport::rdma::RdmaError;
use dflow_transport::RendezvousKey;
use std::sync::Arc;
use std::time::Duration;

const SLOT: u32 = 5;
const TICK: Duration = Duration::from_millis(1);

struct Pair {
    fabric: SimFabric,
    a: Protocol,
    b: Protocol,
    key: Arc<RendezvousKey>,
    ad: SlotAd,
}

fn key() -> Arc<RendezvousKey> {
    Arc::new(RendezvousKey::new("/job:a/cpu:0", "/job:b/cpu:0", "x:0"))
}

/// `a` and `b` connected both ways; `b` has slot 5 (f32 [4]) that `a` writes.
fn pair() -> Pair {
    let fabric = SimFabric::new();
    fabric.add_device("a");
    fabric.add_device("b");
    let a = Protocol::new(Arc::new(fabric.open("a").unwrap()));
    let b = Protocol::new(Arc::new(fabric.open("b").unwrap()));
    let ea = a.local_endpoint("b").unwrap();
    let eb = b.local_endpoint("a").unwrap();
    a.connect("b", &eb).unwrap();
    b.connect("a", &ea).unwrap();
    a.on_ready("b");
    b.on_ready("a");
    let key = key();
    let ad = b
        .register_recv(SLOT, "a", key.clone(), DType::F32, &[4])
        .unwrap();
    a.register_send(key.clone(), "b", SLOT).unwrap();
    assert!(a.on_slot_ad("b", ad.clone()).unwrap().is_empty());
    Pair {
        fabric,
        a,
        b,
        key,
        ad,
    }
}

fn t(v: f32) -> Tensor {
    Tensor::from_slice(&[4], &[v, v + 1.0, v + 2.0, v + 3.0]).unwrap()
}

fn deliveries(events: Vec<Event>) -> Vec<(u64, Tensor)> {
    events
        .into_iter()
        .map(|e| match e {
            Event::Delivered(d) => (d.step, d.tensor),
            other => panic!("unexpected event {other:?}"),
        })
        .collect()
}

/// Runs both sides until nothing happens; returns what `b` delivered.
fn settle(p: &Pair) -> Vec<(u64, Tensor)> {
    let mut got = Vec::new();
    for _ in 0..20 {
        let ea = p.a.progress(TICK);
        assert!(ea.is_empty(), "sender events: {ea:?}");
        got.extend(deliveries(p.b.progress(TICK)));
    }
    got
}

fn failure(events: Vec<Event>) -> (String, String) {
    match events.into_iter().next() {
        Some(Event::PeerFailed { peer, cause, .. }) => (peer.to_string(), cause),
        other => panic!("expected a peer failure, got {other:?}"),
    }
}

#[test]
fn a_tensor_lands_in_the_registered_slot() {
    let p = pair();
    assert!(p.a.send(&p.key, 1, t(1.0)).unwrap());
    let got = settle(&p);
    assert_eq!(got.len(), 1);
    let (step, first) = &got[0];
    assert_eq!(*step, 1);
    assert_eq!(first.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
    let addr = first.data_ptr();
    drop(got);
    p.a.send(&p.key, 2, t(10.0)).unwrap();
    let got = settle(&p);
    // Zero copy on the receive side: every step's tensor is the same registered slot memory.
    assert_eq!(got[0].1.data_ptr(), addr);
    assert_eq!(
        got[0].1.as_slice::<f32>().unwrap(),
        &[10.0, 11.0, 12.0, 13.0]
    );
}

#[test]
fn without_a_credit_the_sender_queues_and_never_overwrites_a_held_slot() {
    let p = pair();
    p.a.send(&p.key, 1, t(1.0)).unwrap();
    let held = settle(&p).pop().unwrap().1;
    assert!(p.b.is_held(SLOT));
    assert!(!p.a.has_credit(&p.key));
    let writes = p.fabric.writes();

    // The reader still holds step 1: step 2 waits on the sender, the slot is untouched.
    p.a.send(&p.key, 2, t(2.0)).unwrap();
    assert!(settle(&p).is_empty());
    assert_eq!(p.a.queued(&p.key), 1);
    assert_eq!(p.fabric.writes(), writes);
    assert_eq!(held.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0, 4.0]);

    // Released: the credit goes back and step 2 is written.
    drop(held);
    let got = settle(&p);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, 2);
    assert_eq!(got[0].1.as_slice::<f32>().unwrap(), &[2.0, 3.0, 4.0, 5.0]);
    assert_eq!(p.a.queued(&p.key), 0);
}

#[test]
fn steps_arrive_in_order() {
    let p = pair();
    for step in 1..=20u64 {
        p.a.send(&p.key, step * 3, t(step as f32)).unwrap();
    }
    assert_eq!(p.a.queued(&p.key), 19);
    let mut seen = Vec::new();
    for _ in 0..200 {
        p.a.progress(TICK);
        for (step, tensor) in deliveries(p.b.progress(TICK)) {
            let v = (step / 3) as f32;
            assert_eq!(
                tensor.as_slice::<f32>().unwrap(),
                &[v, v + 1.0, v + 2.0, v + 3.0]
            );
            seen.push(step);
        } // each tensor dropped here: the slot is released
        if seen.len() == 20 {
            break;
        }
    }
    assert_eq!(seen, (1..=20).map(|s| s * 3).collect::<Vec<_>>());
}

#[test]
fn an_advertisement_before_the_route_is_kept() {
    let fabric = SimFabric::new();
    fabric.add_device("a");
    fabric.add_device("b");
    let a = Protocol::new(Arc::new(fabric.open("a").unwrap()));
    let b = Protocol::new(Arc::new(fabric.open("b").unwrap()));
    let ea = a.local_endpoint("b").unwrap();
    let eb = b.local_endpoint("a").unwrap();
    a.connect("b", &eb).unwrap();
    b.connect("a", &ea).unwrap();
    a.on_ready("b");
    let k = key();
    let ad = b
        .register_recv(SLOT, "a", k.clone(), DType::F32, &[0])
        .unwrap();
    a.on_slot_ad("b", ad).unwrap();
    a.register_send(k.clone(), "b", SLOT).unwrap();
    // An empty tensor: only the step word travels.
    a.send(&k, 7, Tensor::zeros(DType::F32, &[0]).unwrap())
        .unwrap();
    let mut got = Vec::new();
    for _ in 0..5 {
        a.progress(TICK);
        got.extend(deliveries(b.progress(TICK)));
    }
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, 7);
    assert_eq!(got[0].1.dims(), &[0]);
}

#[test]
fn writes_wait_until_the_peer_is_ready() {
    let fabric = SimFabric::new();
    fabric.add_device("a");
    fabric.add_device("b");
    let a = Protocol::new(Arc::new(fabric.open("a").unwrap()));
    let b = Protocol::new(Arc::new(fabric.open("b").unwrap()));
    let ea = a.local_endpoint("b").unwrap();
    let eb = b.local_endpoint("a").unwrap();
    a.connect("b", &eb).unwrap();
    let k = key();
    let ad = b
        .register_recv(SLOT, "a", k.clone(), DType::F32, &[4])
        .unwrap();
    a.register_send(k.clone(), "b", SLOT).unwrap();
    a.on_slot_ad("b", ad).unwrap();
    a.send(&k, 1, t(1.0)).unwrap();
    assert_eq!(fabric.writes(), 0, "b has not posted receives yet");
    b.connect("a", &ea).unwrap();
    a.on_ready("b");
    let mut got = Vec::new();
    for _ in 0..5 {
        a.progress(TICK);
        got.extend(deliveries(b.progress(TICK)));
    }
    assert_eq!(got.len(), 1);
}

#[test]
fn a_tensor_of_the_wrong_length_is_refused_naming_peer_and_key() {
    let p = pair();
    let err =
        p.a.send(&p.key, 1, Tensor::zeros(DType::F32, &[5]).unwrap())
            .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("peer `b`"), "{msg}");
    assert!(
        msg.contains("x:0") && msg.contains("20 bytes") && msg.contains("16"),
        "{msg}"
    );
}

#[test]
fn a_send_to_an_unknown_key_is_local() {
    let p = pair();
    let other = RendezvousKey::new("/job:a/cpu:0", "/job:a/cpu:1", "y:0");
    assert!(!p.a.send(&other, 1, t(0.0)).unwrap());
}

/// A second handle on `a`'s device that writes `b` whatever a test wants, on `a`'s queue pair.
struct Rogue {
    verbs: SimVerbs,
    qp: u32,
    word: Box<[u8; 8]>,
    local: LocalSegment,
}

impl Rogue {
    fn new(p: &Pair) -> Rogue {
        let verbs = p.fabric.open("a").unwrap();
        let qp = p.a.local_endpoint("b").unwrap().qp_num;
        let mut word = Box::new([0u8; 8]);
        // SAFETY: the box outlives every write in the test and is only read by the fabric.
        let mr = unsafe { verbs.register(word.as_mut_ptr(), 8) }.unwrap();
        Rogue {
            verbs,
            qp,
            word,
            local: LocalSegment {
                addr: mr.addr,
                len: 8,
                lkey: mr.lkey,
            },
        }
    }

    fn write(&mut self, step: u64, imm: u32, ad: &SlotAd) {
        *self.word = step.to_le_bytes();
        // wr_id 3 << 32: a credit's tag, which the sender's driver ignores on completion.
        self.verbs
            .post_write(self.qp, 3 << 32, Some(self.local), ad.step_word, Some(imm))
            .unwrap();
    }
}

fn data(slot: u32, step: u64) -> u32 {
    Imm::new(ImmKind::Data, slot, step).encode()
}

#[test]
fn a_write_to_an_unknown_slot_drops_the_peer() {
    let p = pair();
    let mut rogue = Rogue::new(&p);
    rogue.write(1, data(99, 1), &p.ad);
    let (peer, cause) = failure(p.b.progress(TICK));
    assert_eq!(peer, "a");
    assert!(cause.contains("unknown slot 99"), "{cause}");
}

#[test]
fn a_write_without_a_credit_drops_the_peer() {
    let p = pair();
    p.a.send(&p.key, 1, t(1.0)).unwrap();
    let _held = settle(&p);
    let mut rogue = Rogue::new(&p);
    rogue.write(2, data(SLOT, 2), &p.ad);
    let (peer, cause) = failure(p.b.progress(TICK));
    assert_eq!(peer, "a");
    assert!(
        cause.contains("without a credit") && cause.contains("x:0"),
        "{cause}"
    );
}

#[test]
fn a_wrong_parity_drops_the_peer() {
    let p = pair();
    let mut rogue = Rogue::new(&p);
    rogue.write(3, data(SLOT, 4), &p.ad);
    let (_, cause) = failure(p.b.progress(TICK));
    assert!(
        cause.contains("parity") && cause.contains("step 3"),
        "{cause}"
    );
}

#[test]
fn an_out_of_order_step_drops_the_peer() {
    let p = pair();
    p.a.send(&p.key, 8, t(1.0)).unwrap();
    drop(settle(&p)); // delivered and released
    assert!(p.b.pump().is_empty()); // the credit goes back to `a`
    let mut rogue = Rogue::new(&p);
    rogue.write(6, data(SLOT, 6), &p.ad);
    let (_, cause) = failure(p.b.progress(TICK));
    assert!(cause.contains("step 6 arrived after step 8"), "{cause}");
}

#[test]
fn a_reserved_immediate_drops_the_peer() {
    let p = pair();
    let mut rogue = Rogue::new(&p);
    rogue.write(1, 0xc000_0005, &p.ad);
    let (_, cause) = failure(p.b.progress(TICK));
    assert!(cause.contains("reserved"), "{cause}");
}

#[test]
fn an_unasked_credit_drops_the_peer() {
    let p = pair();
    // `b` sends `a` a credit for a slot `a` still holds the credit of.
    let verbs = p.fabric.open("b").unwrap();
    let qp = p.b.local_endpoint("a").unwrap().qp_num;
    let credit = Imm::new(ImmKind::Credit, SLOT, 0).encode();
    verbs
        .post_write(qp, 3 << 32, None, p.ad.step_word, Some(credit))
        .unwrap();
    let (peer, cause) = failure(p.a.progress(TICK));
    assert_eq!(peer, "b");
    assert!(cause.contains("second credit"), "{cause}");
}

#[test]
fn registration_failure_names_the_memlock_fix() {
    let p = pair();
    p.fabric.fail_next_registrations(1);
    let err =
        p.b.register_recv(
            6,
            "a",
            Arc::new(RendezvousKey::new("a", "b", "y:0")),
            DType::F32,
            &[4],
        )
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, RdmaError::Register { slot_id: 6, .. }));
    assert!(
        msg.contains("ulimit -l unlimited") && msg.contains("limits.conf"),
        "{msg}"
    );
    assert!(msg.contains("y:0"), "{msg}");

    // A locked-memory limit: the first 64 KiB fit, the next slot does not.
    p.fabric
        .set_memlock_limit("b", p.fabric.registered_bytes("b") + 65_536 + 8);
    p.b.register_recv(
        7,
        "a",
        Arc::new(RendezvousKey::new("a", "b", "z:0")),
        DType::F32,
        &[16_384],
    )
    .unwrap();
    let err =
        p.b.register_recv(
            8,
            "a",
            Arc::new(RendezvousKey::new("a", "b", "w:0")),
            DType::F32,
            &[4],
        )
        .unwrap_err();
    assert!(err.to_string().contains("memlock"), "{err}");
}

#[test]
fn a_missing_device_is_a_clear_error() {
    let fabric = SimFabric::new();
    let err = fabric.open("mlx5_0").unwrap_err();
    assert!(matches!(err, VerbsError::NoDevice { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("mlx5_0") && msg.contains("ibv_devices"),
        "{msg}"
    );
}

#[test]
fn a_dropped_connection_fails_the_peer_and_its_queued_sends() {
    let p = pair();
    p.a.send(&p.key, 1, t(1.0)).unwrap();
    let held = settle(&p);
    p.a.send(&p.key, 2, t(2.0)).unwrap(); // queued: no credit
    p.fabric.break_link("a", "b");
    let events = p.a.progress(TICK);
    match events.into_iter().next() {
        Some(Event::PeerFailed { peer, cause, steps }) => {
            assert_eq!(&*peer, "b");
            assert!(cause.contains("link down"), "{cause}");
            assert_eq!(steps, vec![2]);
        }
        other => panic!("{other:?}"),
    }
    let (peer, _) = failure(p.b.progress(TICK));
    assert_eq!(peer, "a");
    drop(held);
    let err = p.a.send(&p.key, 3, t(3.0)).unwrap_err();
    assert!(err.to_string().contains("peer `b`"), "{err}");
}

#[test]
fn slot_ids_beyond_the_immediate_are_refused() {
    let p = pair();
    let err =
        p.b.register_recv(
            1 << 29,
            "a",
            Arc::new(RendezvousKey::new("a", "b", "big:0")),
            DType::F32,
            &[1],
        )
        .unwrap_err();
    assert!(err.to_string().contains("exceeds"), "{err}");
    let err =
        p.b.register_recv(
            SLOT,
            "a",
            Arc::new(RendezvousKey::new("a", "b", "dup:0")),
            DType::F32,
            &[1],
        )
        .unwrap_err();
    assert!(err.to_string().contains("already used"), "{err}");
}
