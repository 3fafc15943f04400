//! The certificate the agent API is served with over HTTPS: the operator's (PEM files, e.g. a
//! Kubernetes TLS Secret mounted into the pod), or one siteboot generates on first start and
//! keeps in the state directory, so that its fingerprint, which ramdisks pin, survives
//! restarts. A file that exists but cannot be used stops start-up: replacing it would change
//! the fingerprint under the ramdisks already running and hide an operator's mistake.

use std::fmt;
use std::io::{self, Write};
use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::ServerConfig;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;

/// The file siteboot keeps its generated certificate and key in, under the state directory.
/// One file, written under a temporary name and renamed, so a crash never leaves half of it.
pub const GENERATED_FILE: &str = "agent-tls.pem";

/// The `http.tls` section: the operator's certificate for the agent API.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// PEM: the certificate first, then any intermediates (`tls.crt` of a Kubernetes TLS
    /// Secret). The ramdisk pins the first.
    pub certificate: PathBuf,
    /// PEM: its private key, PKCS#8, PKCS#1 or SEC1 (`tls.key` of a Kubernetes TLS Secret).
    pub key: PathBuf,
}

/// What ramdisks pin: the certificate's SHA-256, the type the BMC pins share.
pub use siteboot_tls_pin::Fingerprint;

/// Why the agent API's certificate cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path}: not PEM ({source:?})")]
    Pem { path: PathBuf, source: pem::Error },
    #[error("{path}: has no PEM certificate")]
    NoCertificate { path: PathBuf },
    #[error("{path}: has no PEM private key")]
    NoKey { path: PathBuf },
    #[error(
        "the certificate in {certificate} and the key in {key} cannot serve TLS (do they belong together?): {source}"
    )]
    Unusable { certificate: PathBuf, key: PathBuf, source: rustls::Error },
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

/// What the HTTPS listener serves with, and the fingerprint ramdisks pin.
#[derive(Clone)]
pub struct ServerIdentity {
    pub config: Arc<ServerConfig>,
    pub fingerprint: Fingerprint,
    /// The certificate chain as PEM (no key): what a BMC that checks the certificate of the
    /// server its virtual media comes from is given to trust.
    pub certificate_pem: String,
    /// Where the certificate came from, for the start-up log.
    pub source: PathBuf,
}

impl fmt::Debug for ServerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerIdentity")
            .field("fingerprint", &self.fingerprint)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl ServerIdentity {
    /// The operator's certificate if `files` names one; otherwise the one generated in
    /// `state_dir` (generated now, for `address`, if there is none yet).
    pub fn load(
        files: Option<&TlsFiles>,
        state_dir: &Path,
        address: Ipv4Addr,
    ) -> Result<Self, TlsError> {
        match files {
            Some(files) => {
                let certificate = read(&files.certificate)?;
                let key = read(&files.key)?;
                Self::from_pem(&certificate, &files.certificate, &key, &files.key)
            }
            None => {
                let path = state_dir.join(GENERATED_FILE);
                let pem = match std::fs::read(&path) {
                    Ok(pem) => pem,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        generate(state_dir, &path, address)?
                    }
                    Err(source) => return Err(TlsError::Read { path, source }),
                };
                Self::from_pem(&pem, &path, &pem, &path)
            }
        }
    }

    fn from_pem(
        certificate: &[u8],
        certificate_path: &Path,
        key: &[u8],
        key_path: &Path,
    ) -> Result<Self, TlsError> {
        let pem_error = |path: &Path| {
            let path = path.to_owned();
            move |source| TlsError::Pem { path, source }
        };
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(certificate)
            .collect::<Result<_, _>>()
            .map_err(pem_error(certificate_path))?;
        let Some(leaf) = chain.first() else {
            return Err(TlsError::NoCertificate { path: certificate_path.to_owned() });
        };
        let fingerprint = Fingerprint::of(leaf);
        let key = match PrivateKeyDer::from_pem_slice(key) {
            Ok(key) => key,
            Err(pem::Error::NoItemsFound) => {
                return Err(TlsError::NoKey { path: key_path.to_owned() });
            }
            Err(e) => return Err(pem_error(key_path)(e)),
        };
        let unusable = |source| TlsError::Unusable {
            certificate: certificate_path.to_owned(),
            key: key_path.to_owned(),
            source,
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        // TLS 1.3 only: the one client is siteboot's own ramdisk agent.
        let config = ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(unusable)?
            .with_no_client_auth()
            .with_single_cert(chain.clone(), key)
            .map_err(unusable)?;
        let certificate_pem = certificates_pem(&chain);
        Ok(Self {
            config: Arc::new(config),
            fingerprint,
            certificate_pem,
            source: certificate_path.to_owned(),
        })
    }
}

/// `chain` as PEM `CERTIFICATE` blocks.
fn certificates_pem(chain: &[CertificateDer<'_>]) -> String {
    use base64::Engine;
    let mut pem = String::new();
    for certificate in chain {
        let encoded = base64::engine::general_purpose::STANDARD.encode(certificate);
        pem.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in encoded.as_bytes().chunks(64) {
            pem.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
    }
    pem
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.to_owned(), source })
}

/// A self-signed certificate for `address` and its key, written to `path` (mode 0600) and
/// returned as PEM.
fn generate(state_dir: &Path, path: &Path, address: Ipv4Addr) -> Result<Vec<u8>, TlsError> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(vec![address.to_string()])?;
    params.distinguished_name.push(rcgen::DnType::CommonName, "siteboot agent API");
    let certificate = params.self_signed(&key)?;
    let pem = format!("{}{}", certificate.pem(), key.serialize_pem()).into_bytes();

    let write_error = |path: &Path| {
        let path = path.to_owned();
        move |source| TlsError::Write { path, source }
    };
    std::fs::create_dir_all(state_dir).map_err(write_error(state_dir))?;
    let partial = path.with_extension("pem.partial");
    // A leftover from a start that died while writing: ours, never used, safe to replace.
    match std::fs::remove_file(&partial) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(write_error(&partial)(e)),
        _ => {}
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&partial)
        .map_err(write_error(&partial))?;
    file.write_all(&pem).and_then(|()| file.sync_all()).map_err(write_error(&partial))?;
    std::fs::rename(&partial, path).map_err(write_error(path))?;
    std::fs::File::open(state_dir).and_then(|d| d.sync_all()).map_err(write_error(state_dir))?;
    tracing::info!(path = %path.display(), "generated the agent API's certificate");
    Ok(pem)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    const ADDRESS: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);

    #[test]
    fn generated_once_kept_private_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let first = ServerIdentity::load(None, &state, ADDRESS).unwrap();
        let path = state.join(GENERATED_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the key is readable by others");
        let again = ServerIdentity::load(None, &state, ADDRESS).unwrap();
        assert_eq!(first.fingerprint, again.fingerprint, "a restart changed the certificate");
        let pem = std::fs::read(&path).unwrap();
        let leaf = CertificateDer::pem_slice_iter(&pem).next().unwrap().unwrap();
        assert_eq!(first.fingerprint, Fingerprint::of(&leaf));
        assert!(first.fingerprint.to_string().starts_with("sha256:"));
        // What a BMC is given: the certificate, never the key beside it in the file.
        let given = first.certificate_pem.as_bytes();
        let certificates: Vec<_> = CertificateDer::pem_slice_iter(given).collect();
        assert_eq!(certificates.len(), 1);
        assert_eq!(Fingerprint::of(certificates[0].as_ref().unwrap()), first.fingerprint);
        assert!(!first.certificate_pem.contains("PRIVATE KEY"));
        assert_eq!(first.fingerprint.to_string().len(), 7 + 64);
    }

    #[test]
    fn a_corrupt_generated_file_stops_start_up_and_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(GENERATED_FILE);
        for (content, expect) in [
            (&b""[..], "has no PEM certificate"),
            (b"-----BEGIN CERTIFICATE-----\nnot base64!\n", "not PEM"),
        ] {
            std::fs::write(&path, content).unwrap();
            let e = ServerIdentity::load(None, dir.path(), ADDRESS).unwrap_err();
            assert!(e.to_string().contains(expect), "{e}");
            assert_eq!(std::fs::read(&path).unwrap(), content, "the file was replaced");
        }
        // A certificate without its key.
        ServerIdentity::load(None, &dir.path().join("other"), ADDRESS).unwrap();
        let pem = std::fs::read_to_string(dir.path().join("other").join(GENERATED_FILE)).unwrap();
        let cert_only = &pem[..pem.find("-----BEGIN PRIVATE KEY").unwrap()];
        std::fs::write(&path, cert_only).unwrap();
        let e = ServerIdentity::load(None, dir.path(), ADDRESS).unwrap_err();
        assert!(matches!(e, TlsError::NoKey { .. }), "{e}");
    }

    #[test]
    fn an_unreadable_generated_file_stops_start_up() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the file should be: reading fails with something other than
        // "not found", and nothing is generated over it.
        std::fs::create_dir(dir.path().join(GENERATED_FILE)).unwrap();
        let e = ServerIdentity::load(None, dir.path(), ADDRESS).unwrap_err();
        assert!(matches!(e, TlsError::Read { .. }), "{e}");
    }

    #[test]
    fn operator_files_are_used_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: String| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let make = || {
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(vec!["siteboot.example".to_owned()])
                .unwrap()
                .self_signed(&key)
                .unwrap();
            (cert, key)
        };
        let (cert, key) = make();
        let files = TlsFiles {
            certificate: write("tls.crt", cert.pem()),
            key: write("tls.key", key.serialize_pem()),
        };
        let identity = ServerIdentity::load(Some(&files), dir.path(), ADDRESS).unwrap();
        assert_eq!(identity.fingerprint, Fingerprint::of(cert.der()));
        assert_eq!(
            identity.certificate_pem.replace("\r\n", "\n"),
            cert.pem().replace("\r\n", "\n")
        );
        assert!(!dir.path().join(GENERATED_FILE).exists(), "generated one anyway");

        // Another certificate's key.
        let (_, other_key) = make();
        let mismatched =
            TlsFiles { key: write("other.key", other_key.serialize_pem()), ..files.clone() };
        let e = ServerIdentity::load(Some(&mismatched), dir.path(), ADDRESS).unwrap_err();
        assert!(matches!(e, TlsError::Unusable { .. }), "{e}");

        let missing = TlsFiles { key: dir.path().join("nope.key"), ..files };
        let e = ServerIdentity::load(Some(&missing), dir.path(), ADDRESS).unwrap_err();
        assert!(matches!(&e, TlsError::Read { path, .. } if path.ends_with("nope.key")), "{e}");
    }
}
