//! A task's TLS identity: the cluster CA it trusts, its certificate chain and its key.
//!
//! Loaded from PEM files ([`QuicIdentity::from_files`], [`QuicIdentity::from_dir`] for the
//! layout `dflow cert` writes, [`QuicIdentity::from_env`] for `DFLOW_CERT_DIR`) and checked at
//! once: the certificate must chain to the CA, be valid now, and name the task, so a wrong file
//! fails when the task starts, naming the file, rather than at the first connection.

use super::names::task_dns_name;
use super::pki::{task_files, PkiError, CA_CERT};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, DnsName, PrivateKeyDer, ServerName, UnixTime};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The environment variable naming a certificate directory, used when a QUIC plane is bound
/// without an explicit identity (e.g. through [`crate::plane::bind`]).
pub const CERT_DIR_ENV: &str = "DFLOW_CERT_DIR";

struct Inner {
    task: String,
    dns_name: String,
    ca: CertificateDer<'static>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    source: String,
}

/// A task's certificate, key and the CA it trusts (cheap to clone).
#[derive(Clone)]
pub struct QuicIdentity(Arc<Inner>);

impl fmt::Debug for QuicIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "QuicIdentity({} as {}, from {})",
            self.0.task, self.0.dns_name, self.0.source
        )
    }
}

/// Parses every certificate of a PEM file's contents.
pub(crate) fn parse_certs(
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let bad = |problem: String| PkiError::BadFile {
        path: path.to_path_buf(),
        problem,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(bad(
            "holds no certificate (expected `-----BEGIN CERTIFICATE-----`)".into(),
        ));
    }
    Ok(certs)
}

/// Parses the private key of a PEM file's contents.
pub(crate) fn parse_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, PkiError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| PkiError::BadFile {
        path: path.to_path_buf(),
        problem: format!("holds no usable PEM private key (PKCS#8, SEC1 or PKCS#1): {e}"),
    })
}

fn read(path: &Path) -> Result<Vec<u8>, PkiError> {
    std::fs::read(path).map_err(|source| PkiError::Io {
        path: path.to_path_buf(),
        what: "cannot read",
        source,
    })
}

/// Checks that `chain[0]` is valid now, chains to `ca` (for both TLS roles) and names `dns`.
pub(crate) fn check_cert(
    ca: &CertificateDer<'_>,
    chain: &[CertificateDer<'_>],
    dns: &str,
) -> Result<(), String> {
    let anchor = webpki::anchor_from_trusted_cert(ca)
        .map_err(|e| format!("the CA certificate is unusable: {e}"))?;
    let Some(end) = chain.first() else {
        return Err("no certificate".into());
    };
    let ee = webpki::EndEntityCert::try_from(end)
        .map_err(|e| format!("the certificate is unusable: {e}"))?;
    for usage in [
        webpki::KeyUsage::client_auth(),
        webpki::KeyUsage::server_auth(),
    ] {
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            std::slice::from_ref(&anchor),
            &chain[1..],
            UnixTime::now(),
            usage,
            None,
            None,
        )
        .map_err(|e| format!("the certificate does not verify against the CA: {e}"))?;
    }
    let name = DnsName::try_from(dns.to_string())
        .map_err(|e| format!("`{dns}` is not a DNS name: {e}"))?;
    ee.verify_is_valid_for_subject_name(&ServerName::DnsName(name))
        .map_err(|e| format!("the certificate does not name `{dns}`: {e}"))
}

impl QuicIdentity {
    /// An identity from parsed parts; checks that the certificate chains to `ca` and names
    /// `task`. `source` says where the parts came from, for messages.
    pub fn new(
        task: &str,
        ca: CertificateDer<'static>,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        source: String,
    ) -> Result<QuicIdentity, String> {
        let dns_name = task_dns_name(task).map_err(|e| e.to_string())?;
        check_cert(&ca, &chain, &dns_name)?;
        Ok(QuicIdentity(Arc::new(Inner {
            task: task.to_string(),
            dns_name,
            ca,
            chain,
            key,
            source,
        })))
    }

    /// Loads `ca` (the cluster CA certificate), `cert` (this task's certificate, optionally
    /// followed by intermediates) and `key` (its private key) for `task`.
    pub fn from_files(task: &str, ca: &Path, cert: &Path, key: &Path) -> Result<Self, PkiError> {
        let ca_der = parse_certs(ca, &read(ca)?)?
            .into_iter()
            .next()
            .ok_or_else(|| PkiError::BadFile {
                path: ca.to_path_buf(),
                problem: "no certificate".into(),
            })?;
        let chain = parse_certs(cert, &read(cert)?)?;
        let key_der = parse_key(key, &read(key)?)?;
        let source = format!(
            "CA {}, certificate {}, key {}",
            ca.display(),
            cert.display(),
            key.display()
        );
        QuicIdentity::new(task, ca_der, chain, key_der, source).map_err(|problem| {
            PkiError::BadFile {
                path: cert.to_path_buf(),
                problem: format!("{problem} (task {task}, CA {})", ca.display()),
            }
        })
    }

    /// Loads `task`'s identity from a directory laid out by `dflow cert`: `DIR/ca.crt`,
    /// `DIR/<job>-<index>.crt`, `DIR/<job>-<index>.key`.
    pub fn from_dir(task: &str, dir: &Path) -> Result<Self, PkiError> {
        let (cert, key) = task_files(dir, task)?;
        Self::from_files(task, &dir.join(CA_CERT), &cert, &key)
    }

    /// Loads `task`'s identity from the directory named by [`CERT_DIR_ENV`].
    pub fn from_env(task: &str) -> Result<Self, String> {
        let dir = std::env::var_os(CERT_DIR_ENV).ok_or_else(|| {
            format!(
                "the quic transport needs a certificate for task {task}: pass --cert-dir DIR (or set {CERT_DIR_ENV}); make one with `dflow cert init --dir DIR` and `dflow cert issue --dir DIR --task JOB:INDEX`"
            )
        })?;
        Self::from_dir(task, &PathBuf::from(dir)).map_err(|e| e.to_string())
    }

    /// The task this identity is for.
    pub fn task(&self) -> &str {
        &self.0.task
    }

    /// The task's DNS name in its certificate.
    pub fn dns_name(&self) -> &str {
        &self.0.dns_name
    }

    /// Where it was loaded from.
    pub fn source(&self) -> &str {
        &self.0.source
    }

    /// The cluster CA certificate.
    pub fn ca(&self) -> &CertificateDer<'static> {
        &self.0.ca
    }

    /// The task's certificate chain (its own first).
    pub fn chain(&self) -> &[CertificateDer<'static>] {
        &self.0.chain
    }

    /// The task's private key.
    pub fn key(&self) -> PrivateKeyDer<'static> {
        self.0.key.clone_key()
    }
}

/// The same identity under another task name must not pass: this is what the accepting side
/// relies on when it compares a peer's Hello with its certificate.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::quic::pki::Authority;

    #[test]
    fn job_names_with_underscores_and_dashes_work() {
        let ca = Authority::generate(1).unwrap();
        for task in ["my_job:1", "/job:eval-set/replica:0/task:2"] {
            let issued = ca.issue(task, 1).unwrap();
            let (ca_der, chain, key) = ca.identity_parts(&issued).unwrap();
            QuicIdentity::new(task, ca_der, chain, key, "t".into()).unwrap();
        }
    }

    #[test]
    fn an_issued_certificate_names_its_task_only() {
        let ca = Authority::generate(1).unwrap();
        let issued = ca.issue("/job:worker/replica:0/task:1", 1).unwrap();
        let (ca_der, chain, key) = ca.identity_parts(&issued).unwrap();
        assert!(QuicIdentity::new(
            "/job:worker/replica:0/task:1",
            ca_der.clone(),
            chain.clone(),
            key.clone_key(),
            "t".into()
        )
        .is_ok());
        let e = QuicIdentity::new(
            "worker:0",
            ca_der,
            chain.clone(),
            key.clone_key(),
            "t".into(),
        )
        .unwrap_err();
        assert!(e.contains("worker-0.dflow"), "{e}");
        let other = Authority::generate(1).unwrap();
        let e = QuicIdentity::new("worker:1", other.cert_der().clone(), chain, key, "t".into())
            .unwrap_err();
        assert!(e.contains("does not verify against the CA"), "{e}");
    }
}
