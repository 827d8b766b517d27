//! TLS 1.3 with mutual authentication against the cluster CA (rustls, ring provider).
//!
//! Both sides present a certificate signed by the cluster CA. The connecting side names the
//! task it dials (its DNS name, [`super::names`]) and rustls checks the acceptor's certificate
//! against it; the accepting side requires a client certificate chaining to the CA
//! ([`WebPkiClientVerifier`], no anonymous clients) and then checks that it names the task the
//! peer's Hello claims ([`peer_names_task`]). A peer with no certificate or one from another CA
//! fails the handshake and never reaches the frame layer.

use super::identity::QuicIdentity;
use super::names::task_dns_name;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use rustls_pki_types::{CertificateDer, DnsName, ServerName};
use std::sync::Arc;

/// The ALPN protocol both sides require.
pub const ALPN: &[u8] = b"dflow/1";

/// rustls's ring provider (no aws-lc), TLS 1.3 suites only, AES-128-GCM first.
///
/// Every byte of a tensor is encrypted and decrypted, and the cipher is most of QUIC's cost
/// per byte. AES-128 runs 10 rounds where AES-256 runs 14: AES-128-GCM is TLS 1.3's mandatory
/// suite and 128-bit keys are ample for traffic keys that live one connection; the ring
/// provider's default order puts AES-256-GCM first. Both ends use this list, so they agree on
/// AES-128-GCM; a peer that offers only the others still gets one of them.
pub fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::ring::cipher_suite;
    Arc::new(CryptoProvider {
        cipher_suites: vec![
            cipher_suite::TLS13_AES_128_GCM_SHA256,
            cipher_suite::TLS13_AES_256_GCM_SHA384,
            cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        ],
        ..rustls::crypto::ring::default_provider()
    })
}

fn roots(ca: &CertificateDer<'static>) -> Result<Arc<RootCertStore>, String> {
    let mut roots = RootCertStore::empty();
    roots
        .add(ca.clone())
        .map_err(|e| format!("the cluster CA certificate is unusable: {e}"))?;
    Ok(Arc::new(roots))
}

/// The acceptor's rustls configuration: TLS 1.3 only, a client certificate signed by the CA
/// required.
pub fn server_config(id: &QuicIdentity) -> Result<rustls::ServerConfig, String> {
    let provider = provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(id.ca())?, provider.clone())
        .build()
        .map_err(|e| format!("building the client-certificate verifier: {e}"))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| format!("TLS 1.3 with the ring provider: {e}"))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(id.chain().to_vec(), id.key())
        .map_err(|e| {
            format!(
                "the certificate or key of {} ({}): {e}",
                id.task(),
                id.source()
            )
        })?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    // Every connection runs the full handshake with certificates: no resumption, no 0-RTT.
    cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    cfg.send_tls13_tickets = 0;
    Ok(cfg)
}

/// The connecting side's rustls configuration: TLS 1.3 only, the acceptor's certificate
/// checked against the CA, this task's certificate presented.
pub fn client_config(id: &QuicIdentity) -> Result<rustls::ClientConfig, String> {
    client_config_from_parts(id.ca(), id.chain().to_vec(), id.key()).map_err(|e| {
        format!(
            "the certificate or key of {} ({}): {e}",
            id.task(),
            id.source()
        )
    })
}

/// A connecting configuration that trusts `ca` and presents `chain` with `key`, whatever
/// signed them (tests: a certificate from another CA must be refused by the acceptor).
pub fn client_config_from_parts(
    ca: &CertificateDer<'static>,
    chain: Vec<CertificateDer<'static>>,
    key: rustls_pki_types::PrivateKeyDer<'static>,
) -> Result<rustls::ClientConfig, String> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| format!("TLS 1.3 with the ring provider: {e}"))?
        .with_root_certificates(roots(ca)?)
        .with_client_auth_cert(chain, key)
        .map_err(|e| e.to_string())?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    cfg.resumption = rustls::client::Resumption::disabled();
    Ok(cfg)
}

/// A connecting configuration that trusts `ca` but presents no certificate (tests: such a
/// peer must be refused).
pub fn anonymous_client_config(
    ca: &CertificateDer<'static>,
) -> Result<rustls::ClientConfig, String> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| format!("TLS 1.3 with the ring provider: {e}"))?
        .with_root_certificates(roots(ca)?)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    Ok(cfg)
}

/// Checks that the certificate `conn`'s peer presented names `task` (the name its Hello
/// claims). The chain itself was verified against the CA by the handshake.
pub fn peer_names_task(conn: &quinn::Connection, task: &str) -> Result<(), String> {
    let certs = conn
        .peer_identity()
        .and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok())
        .ok_or("it presented no certificate")?;
    let end = certs.first().ok_or("it presented no certificate")?;
    let dns = task_dns_name(task).map_err(|e| e.to_string())?;
    let name = DnsName::try_from(dns.clone()).map_err(|e| format!("`{dns}`: {e}"))?;
    let ee = webpki::EndEntityCert::try_from(end)
        .map_err(|e| format!("its certificate does not parse: {e}"))?;
    ee.verify_is_valid_for_subject_name(&ServerName::DnsName(name))
        .map_err(|_| format!("its certificate is not for task {task} (`{dns}`)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quic::pki::ephemeral_cluster;

    #[test]
    fn two_tasks_agree_on_aes_128_gcm() {
        let ids = ephemeral_cluster(&["ps:0", "worker:0"]).unwrap();
        let server_cfg = Arc::new(server_config(&ids[0]).unwrap());
        let client_cfg = Arc::new(client_config(&ids[1]).unwrap());
        let name = ServerName::try_from(task_dns_name("ps:0").unwrap()).unwrap();
        let mut client = rustls::ClientConnection::new(client_cfg, name).unwrap();
        let mut server = rustls::ServerConnection::new(server_cfg).unwrap();
        // In-memory handshake: each side's records go straight to the other (bounded).
        for _ in 0..16 {
            if !client.is_handshaking() && !server.is_handshaking() {
                break;
            }
            let mut buf = Vec::new();
            while client.wants_write() {
                client.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                server.read_tls(&mut rd).unwrap();
            }
            server.process_new_packets().unwrap();
            let mut buf = Vec::new();
            while server.wants_write() {
                server.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                client.read_tls(&mut rd).unwrap();
            }
            client.process_new_packets().unwrap();
        }
        assert!(!client.is_handshaking() && !server.is_handshaking());
        for suite in [
            client.negotiated_cipher_suite(),
            server.negotiated_cipher_suite(),
        ] {
            assert_eq!(
                suite.map(|s| s.suite()),
                Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
            );
        }
    }
}
