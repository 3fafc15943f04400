//! Certificate pinning: the agent trusts exactly one certificate, the one whose SHA-256 the
//! appliance put on its kernel command line. No CA, no name check, no expiry: the pin is the
//! whole of the trust, and it came over the same boot that started the ramdisk. The handshake's
//! signatures are still verified against that certificate's key, so presenting the certificate
//! without its private key gets nowhere.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, Error, OtherError, SignatureScheme};

use crate::Fingerprint;

/// The server presented another certificate than the pinned one. Carried inside the rustls
/// error so the client (the agent's `ClientError`, the controller's Redfish client) can say which.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the server's certificate is {presented}, not the pinned {pinned}")]
pub struct PinMismatch {
    pub pinned: Fingerprint,
    pub presented: Fingerprint,
}

/// A [`ServerCertVerifier`] that accepts exactly the pinned end-entity certificate.
#[derive(Debug)]
pub struct PinnedCertificate {
    pin: Fingerprint,
    algorithms: WebPkiSupportedAlgorithms,
}

impl PinnedCertificate {
    /// Pins `pin`; handshake signatures are checked with `provider`'s algorithms.
    pub fn new(pin: Fingerprint, provider: &CryptoProvider) -> Arc<Self> {
        Arc::new(Self { pin, algorithms: provider.signature_verification_algorithms })
    }
}

impl ServerCertVerifier for PinnedCertificate {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let presented = Fingerprint::of(end_entity);
        if presented == self.pin {
            Ok(ServerCertVerified::assertion())
        } else {
            let mismatch = PinMismatch { pinned: self.pin, presented };
            Err(Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(mismatch)))))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
