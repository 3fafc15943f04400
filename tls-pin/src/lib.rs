//! Certificate pinning for rustls clients: a certificate's SHA-256 ([`Fingerprint`]) and a
//! [`PinnedCertificate`] verifier that trusts exactly the certificate with that fingerprint,
//! failing with a [`PinMismatch`] that says which certificate came instead.
//!
//! The ramdisk's agent pins the appliance's agent-API certificate with it (the fingerprint from
//! its kernel command line), and the Redfish BMC driver (`siteboot-bmc`) a BMC's certificate
//! (the credentials Secret's `certificateFingerprint`). It depends on no Kubernetes client and
//! on neither of them, so the BMC driver need not link the ramdisk's agent.

#![forbid(unsafe_code)]

mod fingerprint;
mod pin;

pub use fingerprint::Fingerprint;
pub use pin::{PinMismatch, PinnedCertificate};
