//! TLS servers of a test's own: a fresh self-signed certificate that nothing trusts unless the
//! test tells it to (an impostor, or a server whose certificate a test installs somewhere).

use std::sync::Arc;

use anyhow::Result;

/// A self-signed certificate for one name and a rustls server configuration serving it.
pub struct SelfSigned {
    /// The certificate, PEM.
    pub certificate: String,
    pub config: Arc<rustls::ServerConfig>,
}

impl SelfSigned {
    /// For `name`: an IP address or a DNS name, the certificate's only subject alternative name.
    pub fn new(name: &str) -> Result<Self> {
        let key = rcgen::KeyPair::generate()?;
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])?.self_signed(&key)?;
        let key = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der())
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key)?;
        Ok(Self { certificate: cert.pem(), config: Arc::new(config) })
    }
}
