//! `--transport auto|tcp|shm|quic|rdma`: which data plane a task runs, and what `auto` means.
//!
//! `auto` picks one kind for the whole job: `shm` when every task of the cluster is on this
//! host (its address is a loopback address, an address of a local interface, or a name that
//! resolves to one; Linux only), else `tcp`. Every task sees the same cluster, so every task
//! picks the same kind. `auto` never picks `quic`: that needs certificates.

use dflow_graph::ClusterSpec;
use dflow_transport::TransportKind;
use std::net::{IpAddr, ToSocketAddrs};
use std::str::FromStr;

/// What `--transport` asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// Decide from the cluster (see the module docs).
    Auto,
    /// This kind.
    Kind(TransportKind),
}

impl FromStr for TransportChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "auto" {
            return Ok(TransportChoice::Auto);
        }
        s.parse::<TransportKind>()
            .map(TransportChoice::Kind)
            .map_err(|e| format!("{e}; or `auto`"))
    }
}

/// True when `ip` belongs to this host: loopback, unspecified, or bindable here.
fn is_local_ip(ip: IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// True when the task address `host:port` names this host.
pub fn is_local_address(address: &str) -> bool {
    let host = match address.rsplit_once(':') {
        Some((h, _)) => h,
        None => address,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = host.parse::<IpAddr>() {
        return is_local_ip(ip);
    }
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match (host, 0u16).to_socket_addrs() {
        Ok(mut addrs) => addrs.any(|a| is_local_ip(a.ip())),
        Err(_) => false,
    }
}

impl TransportChoice {
    /// The kind this task runs, and why when `auto` decided.
    pub fn resolve(self, cluster: &ClusterSpec) -> (TransportKind, Option<String>) {
        match self {
            TransportChoice::Kind(k) => (k, None),
            TransportChoice::Auto => {
                let remote: Vec<String> = cluster
                    .jobs()
                    .flat_map(|job| cluster.tasks(job).map(move |(i, a)| (job, i, a)))
                    .filter(|(_, _, a)| !is_local_address(a))
                    .map(|(job, i, a)| format!("{job}:{i} at {a}"))
                    .collect();
                if cfg!(target_os = "linux") && remote.is_empty() {
                    (
                        TransportKind::Shm,
                        Some("shm: every task of the cluster is on this host".into()),
                    )
                } else if remote.is_empty() {
                    (
                        TransportKind::Tcp,
                        Some("tcp: shared memory needs Linux".into()),
                    )
                } else {
                    (
                        TransportKind::Tcp,
                        Some(format!("tcp: not on this host: {}", remote.join(", "))),
                    )
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_shm_for_a_local_cluster_and_tcp_otherwise() {
        let local = ClusterSpec::from_json(
            r#"{"ps": ["127.0.0.1:2222"], "worker": ["localhost:2223", "[::1]:2224"]}"#,
        )
        .unwrap();
        let (kind, why) = TransportChoice::Auto.resolve(&local);
        if cfg!(target_os = "linux") {
            assert_eq!(kind, TransportKind::Shm, "{why:?}");
        }
        // 192.0.2.0/24 is TEST-NET-1: never an address of this host.
        let remote =
            ClusterSpec::from_json(r#"{"ps": ["127.0.0.1:2222"], "worker": ["192.0.2.7:2223"]}"#)
                .unwrap();
        let (kind, why) = TransportChoice::Auto.resolve(&remote);
        assert_eq!(kind, TransportKind::Tcp);
        assert!(why
            .unwrap_or_default()
            .contains("worker:0 at 192.0.2.7:2223"));
        assert_eq!(
            "quic".parse::<TransportChoice>(),
            Ok(TransportChoice::Kind(TransportKind::Quic))
        );
        assert!("udp"
            .parse::<TransportChoice>()
            .unwrap_err()
            .contains("auto"));
    }
}
