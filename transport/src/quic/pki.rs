//! A small certificate authority for clusters without a PKI (`dflow cert init|issue`).
//!
//! `init` makes the cluster CA: an ECDSA P-256 key and a self-signed CA certificate
//! (`ca.key`, `ca.crt`). `issue` makes a task's key and a certificate signed by the CA whose
//! subject alternative name is the task's DNS name ([`super::names`]) and whose extended key
//! usages allow it both to accept and to open connections (`worker-0.key`, `worker-0.crt`).
//! Keys are written with mode 0600, every file atomically (a temporary file renamed into place).
//!
//! The CA's subject is `CN=dflow cluster CA <id>`, `<id>` derived from its public key, so a
//! certificate can be issued from `ca.key` alone and two CAs never share a name.

use super::names::{task_dns_name, task_label};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SerialNumber,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};
use time::{Duration as TimeDuration, OffsetDateTime};

/// File name of the CA certificate in a certificate directory.
pub const CA_CERT: &str = "ca.crt";
/// File name of the CA key in a certificate directory.
pub const CA_KEY: &str = "ca.key";

/// Why a certificate could not be made, loaded or written; names the file or task.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// A file could not be read or written.
    #[error("{path}: {what}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The cause.
        source: std::io::Error,
    },
    /// A file holds no usable PEM of the expected kind.
    #[error("{path}: {problem}")]
    BadFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A file that `init` would overwrite exists.
    #[error("{0} already exists (pass --force to replace the CA; every certificate it issued stops working)")]
    Exists(PathBuf),
    /// The task name cannot be a certificate name.
    #[error(transparent)]
    Name(#[from] super::names::NameError),
    /// rcgen refused the parameters.
    #[error("generating {what}: {source}")]
    Generate {
        /// What was being made.
        what: String,
        /// The cause.
        source: rcgen::Error,
    },
}

/// A CA in memory: its certificate and its signing key.
pub struct Authority {
    key: KeyPair,
    cert_pem: String,
    cert_der: CertificateDer<'static>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Authority({})", ca_common_name(&self.key))
    }
}

/// A task's certificate and key, PEM-encoded.
#[derive(Clone)]
pub struct Issued {
    /// The task.
    pub task: String,
    /// Its DNS name in the certificate.
    pub dns_name: String,
    /// The certificate (PEM).
    pub cert_pem: String,
    /// The private key (PKCS#8 PEM).
    pub key_pem: String,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Issued({} as {})", self.task, self.dns_name)
    }
}

fn generate(what: &str) -> impl FnOnce(rcgen::Error) -> PkiError + '_ {
    move |source| PkiError::Generate {
        what: what.to_string(),
        source,
    }
}

/// `dflow cluster CA <id>`, `<id>` the first 8 bytes of SHA-256 of the key's public key.
fn ca_common_name(key: &KeyPair) -> String {
    let digest = Sha256::digest(key.subject_public_key_info());
    let id: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("dflow cluster CA {id}")
}

fn ca_params(key: &KeyPair, days: u32) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, ca_common_name(key));
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = OffsetDateTime::now_utc();
    params.not_before = now - TimeDuration::hours(1);
    params.not_after = now + TimeDuration::days(i64::from(days.max(1)));
    params.serial_number = Some(random_serial());
    params
}

fn random_serial() -> SerialNumber {
    let mut b = [0u8; 16];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut b);
    b[0] &= 0x7f;
    b[0] |= 0x01;
    SerialNumber::from_slice(&b)
}

impl Authority {
    /// A new CA valid for `days` days.
    pub fn generate(days: u32) -> Result<Authority, PkiError> {
        let key = KeyPair::generate().map_err(generate("the CA key"))?;
        let cert = ca_params(&key, days)
            .self_signed(&key)
            .map_err(generate("the CA certificate"))?;
        Ok(Authority {
            cert_pem: cert.pem(),
            cert_der: cert.der().clone(),
            key,
        })
    }

    /// The CA of a certificate directory (`DIR/ca.crt`, `DIR/ca.key`).
    pub fn load(dir: &Path) -> Result<Authority, PkiError> {
        let cert_path = dir.join(CA_CERT);
        let key_path = dir.join(CA_KEY);
        let cert_pem = read_text(&cert_path)?;
        let key_pem = read_text(&key_path)?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| PkiError::BadFile {
            path: key_path.clone(),
            problem: format!("not a PEM private key rcgen can use: {e}"),
        })?;
        let cert_der = super::identity::parse_certs(&cert_path, cert_pem.as_bytes())?
            .into_iter()
            .next()
            .ok_or_else(|| PkiError::BadFile {
                path: cert_path.clone(),
                problem: "no certificate".into(),
            })?;
        Ok(Authority {
            key,
            cert_pem,
            cert_der,
        })
    }

    /// The CA certificate (PEM).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA certificate (DER).
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The CA key (PKCS#8 PEM).
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// Issues a certificate for `task`, valid for `days` days, with a fresh key.
    pub fn issue(&self, task: &str, days: u32) -> Result<Issued, PkiError> {
        let dns_name = task_dns_name(task)?;
        let what = format!("the certificate of {task}");
        let key = KeyPair::generate().map_err(generate(&what))?;
        let mut params = CertificateParams::new(vec![dns_name.clone()]).map_err(generate(&what))?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, task);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let now = OffsetDateTime::now_utc();
        params.not_before = now - TimeDuration::hours(1);
        params.not_after = now + TimeDuration::days(i64::from(days.max(1)));
        params.serial_number = Some(random_serial());
        let issuer = Issuer::new(ca_params(&self.key, 1), &self.key);
        let cert = params.signed_by(&key, &issuer).map_err(generate(&what))?;
        Ok(Issued {
            task: task.to_string(),
            dns_name,
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// The parsed forms of `issued`, for building an identity in memory.
    pub fn identity_parts(
        &self,
        issued: &Issued,
    ) -> Result<
        (
            CertificateDer<'static>,
            Vec<CertificateDer<'static>>,
            PrivateKeyDer<'static>,
        ),
        PkiError,
    > {
        let name = PathBuf::from(format!("<{}>", issued.task));
        let certs = super::identity::parse_certs(&name, issued.cert_pem.as_bytes())?;
        let key = super::identity::parse_key(&name, issued.key_pem.as_bytes())?;
        Ok((self.cert_der.clone(), certs, key))
    }
}

fn read_text(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|source| PkiError::Io {
        path: path.to_path_buf(),
        what: "cannot read",
        source,
    })
}

/// Writes `contents` to `path` atomically: a temporary file in the same directory (mode 0600
/// when `secret`, else 0644), synced, then renamed over `path`.
pub fn write_atomic(path: &Path, contents: &[u8], secret: bool) -> Result<(), PkiError> {
    let io = |what: &'static str| {
        move |source| PkiError::Io {
            path: path.to_path_buf(),
            what,
            source,
        }
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    let mut nonce = [0u8; 6];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut nonce);
    let suffix: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    let tmp = dir.join(format!(".{file_name}.{suffix}.tmp"));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(if secret { 0o600 } else { 0o644 });
    }
    #[cfg(not(unix))]
    let _ = secret;
    let result = (|| {
        let mut f = opts
            .open(&tmp)
            .map_err(io("cannot create a temporary file"))?;
        f.write_all(contents).map_err(io("cannot write"))?;
        f.sync_all().map_err(io("cannot sync"))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io("cannot move the temporary file into place"))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn ensure_dir(dir: &Path) -> Result<(), PkiError> {
    std::fs::create_dir_all(dir).map_err(|source| PkiError::Io {
        path: dir.to_path_buf(),
        what: "cannot create the directory",
        source,
    })
}

/// `dflow cert init`: makes a CA in `dir` (`ca.crt`, `ca.key`); refuses to replace an existing
/// one unless `force`. Returns the paths written.
pub fn init_ca(dir: &Path, days: u32, force: bool) -> Result<Vec<PathBuf>, PkiError> {
    ensure_dir(dir)?;
    let cert_path = dir.join(CA_CERT);
    let key_path = dir.join(CA_KEY);
    if !force {
        for p in [&cert_path, &key_path] {
            if p.exists() {
                return Err(PkiError::Exists(p.clone()));
            }
        }
    }
    let ca = Authority::generate(days)?;
    // The key first: a CA certificate without its key would be useless.
    write_atomic(&key_path, ca.key_pem().as_bytes(), true)?;
    write_atomic(&cert_path, ca.cert_pem().as_bytes(), false)?;
    Ok(vec![cert_path, key_path])
}

/// The certificate and key paths of `task` in `dir` (`worker-0.crt`, `worker-0.key`).
pub fn task_files(dir: &Path, task: &str) -> Result<(PathBuf, PathBuf), PkiError> {
    let label = task_label(task)?;
    Ok((
        dir.join(format!("{label}.crt")),
        dir.join(format!("{label}.key")),
    ))
}

/// `dflow cert issue`: issues `task`'s certificate with the CA in `dir` and writes it there.
/// The new certificate is checked against `ca.crt` before anything is written, so a `ca.key`
/// that does not belong to `ca.crt` is an error. Returns the paths written.
pub fn issue_to_dir(dir: &Path, task: &str, days: u32) -> Result<Vec<PathBuf>, PkiError> {
    let ca = Authority::load(dir)?;
    let issued = ca.issue(task, days)?;
    let (ca_der, chain, key) = ca.identity_parts(&issued)?;
    super::identity::QuicIdentity::new(task, ca_der, chain, key, dir.display().to_string())
        .map_err(|e| PkiError::BadFile {
            path: dir.join(CA_KEY),
            problem: format!(
                "a certificate issued with this key does not verify against {}: {e}",
                dir.join(CA_CERT).display()
            ),
        })?;
    let (cert_path, key_path) = task_files(dir, task)?;
    write_atomic(&key_path, issued.key_pem.as_bytes(), true)?;
    write_atomic(&cert_path, issued.cert_pem.as_bytes(), false)?;
    Ok(vec![cert_path, key_path])
}

/// A CA and an identity for each of `tasks`, in memory (tests, benchmarks).
pub fn ephemeral_cluster(tasks: &[&str]) -> Result<Vec<super::identity::QuicIdentity>, PkiError> {
    let ca = Authority::generate(1)?;
    tasks
        .iter()
        .map(|task| {
            let issued = ca.issue(task, 1)?;
            let (ca_der, chain, key) = ca.identity_parts(&issued)?;
            super::identity::QuicIdentity::new(task, ca_der, chain, key, "<memory>".into()).map_err(
                |e| PkiError::BadFile {
                    path: PathBuf::from("<memory>"),
                    problem: e.to_string(),
                },
            )
        })
        .collect()
}
