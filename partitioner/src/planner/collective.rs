//! The cost of the collectives dflow runs (`transport/src/collective/algo/`), from what they
//! send: all-reduce is recursive doubling up to 64 KiB (ranks beyond the largest power of two
//! fold into a partner first and get the result back) and a ring above (reduce-scatter then
//! all-gather, `2(n−1)` steps of `S/n` bytes per rank); all-gather and reduce-scatter are rings
//! of `n−1` steps. A step costs `α + bytes/β` of the slowest link it crosses; the bytes are
//! counted per link class over every group of the axis.

use super::profile::{ClusterProfile, Link, LinkClass};
use crate::mesh::{Axis, Mesh};

/// The all-reduce size up to which dflow uses recursive doubling (`CommOptions::small_bytes`).
pub const SMALL_BYTES: f64 = (64 << 10) as f64;

/// A collective operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// Sum across the group, everyone gets the result.
    AllReduce,
    /// Everyone gets every rank's block.
    AllGather,
    /// Everyone gets the sum of one block.
    ReduceScatter,
    /// Everyone sends block `j` of its buffer to rank `j` directly (the expert strategy's
    /// token exchange).
    AllToAll,
}

/// Time and traffic of one collective (or of several added up).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommCost {
    /// Seconds, on the slowest group.
    pub seconds: f64,
    /// Bytes sent over links inside hosts, summed over all groups.
    pub intra_bytes: f64,
    /// Bytes sent over links between hosts, summed over all groups.
    pub inter_bytes: f64,
}

impl CommCost {
    /// The sum of two costs run one after the other.
    pub fn then(self, other: CommCost) -> CommCost {
        CommCost {
            seconds: self.seconds + other.seconds,
            intra_bytes: self.intra_bytes + other.intra_bytes,
            inter_bytes: self.inter_bytes + other.inter_bytes,
        }
    }

    /// `k` copies in a row.
    pub fn times(self, k: f64) -> CommCost {
        CommCost {
            seconds: self.seconds * k,
            intra_bytes: self.intra_bytes * k,
            inter_bytes: self.inter_bytes * k,
        }
    }

    fn add_bytes(&mut self, class: LinkClass, bytes: f64) {
        match class {
            LinkClass::IntraHost => self.intra_bytes += bytes,
            LinkClass::InterHost => self.inter_bytes += bytes,
        }
    }
}

/// Messages of one round of an algorithm over every group of an axis.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Round {
    /// The slowest link any message of the round crosses.
    slowest: Link,
    /// Messages over links inside hosts and between hosts, over all groups.
    messages: [f64; 2],
}

/// The links the groups of one mesh axis use: computed once per layout, then any collective
/// size costs O(log n).
#[derive(Clone, Debug, PartialEq)]
pub struct AxisLinks {
    /// Ranks per group.
    pub n: usize,
    /// Ring edges (rank → next rank of its group) inside and between hosts, over all groups.
    ring_edges: [f64; 2],
    ring_slowest: Link,
    /// Ordered pairs of distinct ranks of a group (all-to-all's messages) inside and between
    /// hosts, over all groups.
    pair_edges: [f64; 2],
    pair_slowest: Link,
    /// Recursive doubling: fold-in, the log2 rounds, fold-out.
    tree: Vec<Round>,
}

fn slower(a: Link, b: Link) -> Link {
    if b.bandwidth < a.bandwidth || (b.bandwidth == a.bandwidth && b.latency > a.latency) {
        b
    } else {
        a
    }
}

fn index(class: LinkClass) -> usize {
    match class {
        LinkClass::IntraHost => 0,
        LinkClass::InterHost => 1,
    }
}

impl AxisLinks {
    /// The links of `axis`'s groups on `mesh` over `profile`'s hosts.
    pub fn new(mesh: &Mesh, axis: Axis, profile: &ClusterProfile) -> AxisLinks {
        AxisLinks::of_groups(&mesh.groups(axis), mesh.size_of(axis), profile)
    }

    /// The links of `groups` (each of `n` ranks) over `profile`'s hosts.
    pub fn of_groups(groups: &[Vec<usize>], n: usize, profile: &ClusterProfile) -> AxisLinks {
        let fastest = profile.intra_host;
        let mut ring_edges = [0.0; 2];
        let mut ring_slowest = fastest;
        let mut pair_edges = [0.0; 2];
        let mut pair_slowest = fastest;
        let p2 = if n == 0 {
            1
        } else {
            1usize << (usize::BITS - 1 - n.leading_zeros())
        };
        let extra = n - p2;
        let rounds = p2.trailing_zeros() as usize;
        let mut tree = vec![
            Round {
                slowest: fastest,
                messages: [0.0; 2],
            };
            rounds + 2
        ];
        for g in groups {
            // Ordered pairs inside a host: Σ c(c − 1) over the group's ranks per host.
            let mut hosts: Vec<usize> = g
                .iter()
                .map(|&r| r / profile.devices_per_host.max(1))
                .collect();
            hosts.sort_unstable();
            let mut inside = 0.0;
            for run in hosts.chunk_by(|a, b| a == b) {
                inside += (run.len() * (run.len() - 1)) as f64;
            }
            let all = (g.len() * g.len().saturating_sub(1)) as f64;
            pair_edges[0] += inside;
            pair_edges[1] += all - inside;
            if inside > 0.0 {
                pair_slowest = slower(pair_slowest, profile.intra_host);
            }
            if all > inside {
                pair_slowest = slower(pair_slowest, profile.inter_host);
            }
            if n > 1 {
                for i in 0..n {
                    let class = profile.class(g[i], g[(i + 1) % n]);
                    ring_edges[index(class)] += 1.0;
                    ring_slowest = slower(ring_slowest, profile.link(class));
                }
            }
            for r in 0..extra {
                let class = profile.class(g[r], g[r + p2]);
                for round in [0, rounds + 1] {
                    tree[round].messages[index(class)] += 1.0;
                    tree[round].slowest = slower(tree[round].slowest, profile.link(class));
                }
            }
            for k in 0..rounds {
                for r in 0..p2 {
                    let class = profile.class(g[r], g[r ^ (1 << k)]);
                    tree[k + 1].messages[index(class)] += 1.0;
                    tree[k + 1].slowest = slower(tree[k + 1].slowest, profile.link(class));
                }
            }
        }
        AxisLinks {
            n,
            ring_edges,
            ring_slowest,
            pair_edges,
            pair_slowest,
            tree,
        }
    }

    /// The cost of `kind` on a buffer of `bytes` (the whole buffer, not a rank's block) on
    /// every group of the axis at once.
    pub fn cost(&self, kind: Collective, bytes: f64) -> CommCost {
        let mut c = CommCost::default();
        if self.n <= 1 || bytes <= 0.0 {
            return c;
        }
        let n = self.n as f64;
        match kind {
            Collective::AllReduce if bytes <= SMALL_BYTES => {
                for round in &self.tree {
                    let msgs = round.messages[0] + round.messages[1];
                    if msgs == 0.0 {
                        continue;
                    }
                    c.seconds += round.slowest.latency + bytes / round.slowest.bandwidth;
                    c.add_bytes(LinkClass::IntraHost, round.messages[0] * bytes);
                    c.add_bytes(LinkClass::InterHost, round.messages[1] * bytes);
                }
            }
            Collective::AllToAll => {
                // Each rank sends its n − 1 other blocks, one message each.
                let block = bytes / n;
                c.seconds =
                    (n - 1.0) * (self.pair_slowest.latency + block / self.pair_slowest.bandwidth);
                c.add_bytes(LinkClass::IntraHost, self.pair_edges[0] * block);
                c.add_bytes(LinkClass::InterHost, self.pair_edges[1] * block);
            }
            _ => {
                let steps = match kind {
                    Collective::AllReduce => 2.0 * (n - 1.0),
                    Collective::AllGather | Collective::ReduceScatter => n - 1.0,
                    Collective::AllToAll => 0.0,
                };
                let block = bytes / n;
                c.seconds =
                    steps * (self.ring_slowest.latency + block / self.ring_slowest.bandwidth);
                c.add_bytes(LinkClass::IntraHost, self.ring_edges[0] * steps * block);
                c.add_bytes(LinkClass::InterHost, self.ring_edges[1] * steps * block);
            }
        }
        c
    }
}

/// A collective call as dflow's transport runs it (`transport/src/collective/communicator.rs`),
/// for the exact bytes one rank sends: [`rank_bytes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// `CollectiveAllReduce` and `CollectiveTpReduce`: recursive doubling up to
    /// [`SMALL_BYTES`], a ring above.
    AllReduce,
    /// `CollectiveAllGather`: a ring over the concatenated output.
    AllGather,
    /// `CollectiveReduceScatter`: the reduce-scatter half of a ring.
    ReduceScatter,
    /// `CollectiveBroadcast` from `root`: a binomial tree up to [`SMALL_BYTES`], a chain above.
    Broadcast {
        /// The root rank.
        root: usize,
    },
    /// `CollectiveAllToAll`: every rank sends each other rank its block directly.
    AllToAll,
}

/// Elements of block `i` of `len` elements cut into `parts` (the first `len % parts` blocks
/// one element longer: the transport's `block_range`).
fn block_len(len: usize, parts: usize, i: usize) -> usize {
    let parts = parts.max(1);
    len / parts + usize::from(i < len % parts)
}

/// The children of virtual rank `vr` (its rank counted from the root) in the transport's
/// binomial broadcast tree over `n` ranks: `vr + mask` for every mask below `vr`'s lowest set
/// bit (below `n` for the root).
fn tree_children(n: usize, vr: usize) -> usize {
    let top = if vr == 0 {
        n.next_power_of_two()
    } else {
        1 << vr.trailing_zeros()
    };
    (0..usize::BITS)
        .map(|b| 1usize << b)
        .take_while(|&m| m < top)
        .filter(|&m| vr + m < n)
        .count()
}

/// The payload bytes rank `rank` of a group of `n` sends in one `call` on an input of
/// `elements` elements of `size` bytes each, exactly as the transport's algorithms send them
/// (`transport/src/collective/algo/`: `tree.rs`, `ring.rs`, `chain.rs`, `direct.rs`; what
/// its channel counts, frame headers excluded). Chunking changes the messages, not the bytes.
pub fn rank_bytes(call: Call, n: usize, rank: usize, elements: usize, size: usize) -> u64 {
    if n <= 1 || rank >= n {
        return 0;
    }
    let bytes = elements * size;
    let small = bytes as f64 <= SMALL_BYTES;
    // Ring steps: reduce-scatter sends block (r + 2n − step − 1) mod n at step `step`, the
    // all-gather block (r + n − s) mod n at step `s`.
    let rs = |len: usize| -> usize {
        (0..n - 1)
            .map(|step| block_len(len, n, (rank + 2 * n - step - 1) % n))
            .sum()
    };
    let ag = |len: usize| -> usize {
        (0..n - 1)
            .map(|s| block_len(len, n, (rank + n - s) % n))
            .sum()
    };
    let sent = match call {
        Call::AllReduce if small => {
            let p2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
            let extra = n - p2;
            if rank >= p2 {
                bytes
            } else {
                let rounds = p2.trailing_zeros() as usize;
                bytes * (rounds + usize::from(rank < extra))
            }
        }
        Call::AllReduce => (rs(elements) + ag(elements)) * size,
        Call::ReduceScatter => rs(elements) * size,
        Call::AllGather => ag(elements * n) * size,
        Call::Broadcast { root } => {
            let vr = (rank + n - root % n) % n;
            if small {
                bytes * tree_children(n, vr)
            } else if vr + 1 < n {
                bytes
            } else {
                0
            }
        }
        Call::AllToAll => (n - 1) * (elements / n) * size,
    };
    sent as u64
}

/// The transport's default chunk (`CommOptions::chunk_bytes`): the rings and chains cut every
/// block into messages of at most this many bytes.
pub const CHUNK_BYTES: usize = 1 << 20;

/// The messages rank `rank` of a group of `n` sends in one `call` on an input of `elements`
/// elements of `size` bytes each, as the transport's algorithms send them (what its channel
/// counts as messages): each is a step the rank takes with a peer (a handshake and a wait on
/// the other side), so a call's latency grows with them: one for a 2-rank all-gather, `n − 1`
/// for a ring's, `2(n − 1)` for a ring all-reduce, each ring step cut into chunks of
/// [`CHUNK_BYTES`].
pub fn rank_messages(call: Call, n: usize, rank: usize, elements: usize, size: usize) -> usize {
    if n <= 1 || rank >= n {
        return 0;
    }
    let bytes = elements * size;
    let small = bytes as f64 <= SMALL_BYTES;
    let chunk = (CHUNK_BYTES / size.max(1)).max(1);
    // A ring step sends as many chunks as block 0 (the longest) needs, at least one.
    let ring_step = |len: usize| block_len(len, n, 0).div_ceil(chunk).max(1);
    match call {
        Call::AllReduce if small => {
            let p2 = 1usize << (usize::BITS - 1 - n.leading_zeros());
            if rank >= p2 {
                1
            } else {
                p2.trailing_zeros() as usize + usize::from(rank < n - p2)
            }
        }
        Call::AllReduce => 2 * (n - 1) * ring_step(elements),
        Call::ReduceScatter => (n - 1) * ring_step(elements),
        Call::AllGather => (n - 1) * ring_step(elements * n),
        Call::Broadcast { root } => {
            let vr = (rank + n - root % n) % n;
            if small {
                tree_children(n, vr)
            } else if vr + 1 < n {
                elements.div_ceil(chunk).max(1)
            } else {
                0
            }
        }
        Call::AllToAll => n - 1,
    }
}

/// One point-to-point message of `bytes` over `link`.
pub fn p2p_seconds(link: Link, bytes: f64) -> f64 {
    if bytes <= 0.0 {
        0.0
    } else {
        link.latency + bytes / link.bandwidth
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(per_host: usize) -> ClusterProfile {
        let mut p = ClusterProfile::preset("a100-80g-8x").unwrap();
        p.devices_per_host = per_host;
        p.intra_host = Link {
            bandwidth: 100.0,
            latency: 1.0,
        };
        p.inter_host = Link {
            bandwidth: 10.0,
            latency: 2.0,
        };
        p
    }

    #[test]
    fn ring_all_reduce_moves_two_n_minus_one_blocks_per_rank() {
        let mesh = Mesh::new(4, 1, 1).unwrap();
        let links = AxisLinks::new(&mesh, Axis::Dp, &profile(4));
        let c = links.cost(Collective::AllReduce, 4e6);
        // 4 ranks each send 2·3 blocks of 1e6 bytes, all inside the host.
        assert_eq!(c.intra_bytes, 24e6);
        assert_eq!(c.inter_bytes, 0.0);
        assert_eq!(c.seconds, 6.0 * (1.0 + 1e6 / 100.0));
        // Two hosts of 2: the ring crosses between hosts twice; the slowest link sets the pace.
        let links = AxisLinks::new(&mesh, Axis::Dp, &profile(2));
        let c = links.cost(Collective::AllReduce, 4e6);
        assert_eq!(c.intra_bytes, 12e6);
        assert_eq!(c.inter_bytes, 12e6);
        assert_eq!(c.seconds, 6.0 * (2.0 + 1e6 / 10.0));
    }

    #[test]
    fn small_all_reduce_is_recursive_doubling_with_a_fold() {
        // 6 ranks: 2 fold into ranks 0 and 1, 4 ranks do 2 rounds, then the result goes back.
        let mesh = Mesh::new(6, 1, 1).unwrap();
        let links = AxisLinks::new(&mesh, Axis::Dp, &profile(8));
        let c = links.cost(Collective::AllReduce, 1000.0);
        assert_eq!(c.intra_bytes, (2.0 + 4.0 * 2.0 + 2.0) * 1000.0);
        assert_eq!(c.seconds, 4.0 * (1.0 + 10.0));
        let one = AxisLinks::new(&Mesh::new(1, 4, 1).unwrap(), Axis::Dp, &profile(8));
        assert_eq!(one.cost(Collective::AllReduce, 1e9), CommCost::default());
    }

    #[test]
    fn all_to_all_sends_every_other_block_once() {
        // dp=4,ep=2 on hosts of 2: the expert-parallel groups {0,1} {2,3} stay inside a host.
        let mesh = Mesh::new(4, 1, 1).unwrap().with_ep(2).unwrap();
        let links = AxisLinks::new(&mesh, Axis::Ep, &profile(2));
        let c = links.cost(Collective::AllToAll, 4e6);
        // 2 groups × 2 ranks each send 1 block of 2e6 bytes.
        assert_eq!(c.intra_bytes, 8e6);
        assert_eq!(c.inter_bytes, 0.0);
        assert_eq!(c.seconds, 1.0 + 2e6 / 100.0);
        // Hosts of 1: every message crosses between hosts.
        let c = AxisLinks::new(&mesh, Axis::Ep, &profile(1)).cost(Collective::AllToAll, 4e6);
        assert_eq!((c.intra_bytes, c.inter_bytes), (0.0, 8e6));
    }

    #[test]
    fn all_gather_is_half_an_all_reduce() {
        let mesh = Mesh::new(8, 1, 1).unwrap();
        let links = AxisLinks::new(&mesh, Axis::Dp, &profile(8));
        let ar = links.cost(Collective::AllReduce, 8e6);
        let ag = links.cost(Collective::AllGather, 8e6);
        let rs = links.cost(Collective::ReduceScatter, 8e6);
        assert_eq!(ag.intra_bytes * 2.0, ar.intra_bytes);
        assert_eq!(ag.then(rs).seconds, ar.seconds);
    }

    /// Every call on `n` in-process ranks of dflow's transport: each rank's counted bytes
    /// equal [`rank_bytes`] and its messages [`rank_messages`], for sizes on both sides of the
    /// small/large switch and of a chunk, lengths that
    /// do not split evenly, and group sizes that are not powers of two.
    #[test]
    fn rank_bytes_are_what_the_transport_sends() {
        use dflow_transport::collective::{CommOptions, Communicator, ReduceOp};
        let calls = [
            Call::AllReduce,
            Call::AllGather,
            Call::ReduceScatter,
            Call::Broadcast { root: 0 },
            Call::Broadcast { root: 2 },
            Call::AllToAll,
        ];
        for n in [2usize, 3, 4, 5] {
            for elements in [1usize, 7, 1000, 16_385, 40_003, 600_007] {
                for call in calls {
                    let elements = match call {
                        Call::AllToAll | Call::ReduceScatter => elements.div_ceil(n) * n,
                        _ => elements,
                    };
                    let comms = Communicator::in_process(n, CommOptions::default());
                    let sent: Vec<dflow_transport::Traffic> = std::thread::scope(|s| {
                        let handles: Vec<_> = comms
                            .into_iter()
                            .map(|c| {
                                s.spawn(move || {
                                    let mut buf = vec![1.0f32; elements];
                                    match call {
                                        Call::AllReduce => c.all_reduce(&mut buf, ReduceOp::Sum),
                                        Call::AllGather => {
                                            let mut out = vec![0.0f32; elements * n];
                                            c.all_gather(&buf, &mut out)
                                        }
                                        Call::ReduceScatter => {
                                            let mut out = vec![0.0f32; elements / n];
                                            c.reduce_scatter(&buf, &mut out, ReduceOp::Sum)
                                        }
                                        Call::Broadcast { root } => c.broadcast(&mut buf, root % n),
                                        Call::AllToAll => {
                                            let mut out = vec![0.0f32; elements];
                                            c.all_to_all(&buf, &mut out)
                                        }
                                    }
                                    .unwrap();
                                    c.sent()
                                })
                            })
                            .collect();
                        handles.into_iter().map(|h| h.join().unwrap()).collect()
                    });
                    for (rank, sent) in sent.iter().enumerate() {
                        let call = match call {
                            Call::Broadcast { root } => Call::Broadcast { root: root % n },
                            c => c,
                        };
                        assert_eq!(
                            sent.bytes,
                            rank_bytes(call, n, rank, elements, 4),
                            "{call:?} of {elements} f32 on rank {rank} of {n}"
                        );
                        assert_eq!(
                            sent.messages,
                            rank_messages(call, n, rank, elements, 4) as u64,
                            "messages of {call:?} of {elements} f32 on rank {rank} of {n}"
                        );
                    }
                }
            }
        }
    }
}
