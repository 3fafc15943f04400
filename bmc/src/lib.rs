//! BMC drivers: what siteboot can do to a host's power and boot device. Hosts without a BMC
//! get [`SelfBooting`]: siteboot cannot power-cycle them, and waits for them to network-boot by
//! themselves (PXE first in the boot order). Hosts with a Redfish BMC get [`Redfish`]: power, a
//! one-time network boot, and the identity the BMC reports.
//!
//! It depends on no Kubernetes client, so standalone mode can drive a BMC without one.
//! Kubernetes mode's side (a Host's `spec.bmc`, the credentials Secret) is
//! `siteboot_controller::bmc`. The `schema` feature derives `JsonSchema` on [`BootMode`] and
//! [`PowerState`], for the Host CRD; standalone mode leaves it off.

#![forbid(unsafe_code)]

pub mod address;
pub mod credentials;
pub mod redfish;

use std::pin::Pin;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use self::address::{AddressError, RedfishAddress, Transport};
pub use self::credentials::{BindingError, BoundCredentials, Credentials, CredentialsError};
pub use self::redfish::{Redfish, RedfishClient};

/// What a [`BmcDriver`] method returns. Defined as `siteboot_boot::inventory::BoxFuture` is, so
/// the two name one type; defined here so that the driver does not depend on the boot plane.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A server firmware's boot path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum BootMode {
    #[serde(rename = "UEFI")]
    Uefi,
    Legacy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum PowerState {
    On,
    Off,
    /// No BMC: siteboot cannot tell.
    Unknown,
}

/// What went wrong talking to a BMC, or before. Whatever answers at `spec.bmc.address` may be
/// a Host editor's server: what it says is carried as [`Echoed`] only.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BmcError {
    #[error(transparent)]
    InvalidAddress(#[from] AddressError),
    #[error("spec.bmc.certificateFingerprint {0:?} is not sha256: and 64 hex digits")]
    InvalidFingerprint(String),
    #[error("the BMC credentials Secret {name:?} {why}")]
    Credentials { name: String, why: String },
    /// The Secret names no BMC. Its address is what the operator vouches for, so the command
    /// is offered only for the case that the Host's address is the right one.
    #[error(
        "the BMC credentials Secret {namespace}/{name} does not name the BMC it is for, so they \
         are sent nowhere. If they are the credentials of the BMC at {address}, add its address \
         to the Secret: kubectl -n {namespace} patch secret {name} --type merge -p \
         '{{\"stringData\":{{\"address\":\"{address}\"}}}}'"
    )]
    CredentialsUnbound { namespace: String, name: String, address: String },
    /// The Secret names another BMC (which one is not said: the Secret's content is not the
    /// Host editor's to read).
    #[error(
        "the BMC credentials Secret {namespace}/{name} is for another BMC than spec.bmc.address \
         {address}: nothing was sent"
    )]
    CredentialsNotForThisAddress { namespace: String, name: String, address: String },
    #[error(
        "spec.bmc.certificateFingerprint pins a certificate that the BMC credentials Secret \
         {namespace}/{name} does not pin: nothing was sent (the Secret's certificateFingerprint \
         is the one trusted)"
    )]
    CredentialsNotForThisCertificate { namespace: String, name: String },
    #[error("the BMC at {address} is unreachable after {attempts} attempt(s): {reason}")]
    Unreachable { address: String, attempts: u32, reason: Echoed },
    #[error("the BMC at {address} did not answer within {after:?} ({attempts} attempt(s))")]
    Timeout { address: String, after: Duration, attempts: u32 },
    #[error("the BMC at {address} refused the credentials (wrong username or password?)")]
    Unauthorized { address: String },
    #[error("the BMC has no {path} (wrong system in spec.bmc.address?)")]
    NotFound { path: Echoed },
    #[error("the BMC at {address} is not trusted: {reason}")]
    Untrusted { address: String, reason: Echoed },
    #[error("the BMC refused {path}: {message}")]
    Rejected { path: Echoed, message: Echoed },
    #[error("the BMC failed {path} ({attempts} attempt(s)): {message}")]
    ServerError { path: Echoed, attempts: u32, message: Echoed },
    #[error("the BMC's answer makes no sense: {0}")]
    Protocol(Echoed),
    /// The host boots from virtual media, and the BMC (or the lack of one) cannot do it.
    #[error("no virtual CD: {0}")]
    NoVirtualMedia(&'static str),
}

/// Text from a BMC's answer (or made around it), fit for a condition, an Event or a log: no
/// control or bidirectional formatting characters, at most [`Echoed::MAX`] characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Echoed(String);

impl Echoed {
    pub const MAX: usize = 120;

    pub fn new(text: &str) -> Self {
        let bidi = |c: char| matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        let mut printable = text.chars().filter(|&c| !c.is_control() && !bidi(c));
        let mut kept: String = printable.by_ref().take(Self::MAX).collect();
        if printable.next().is_some() {
            kept.pop();
            kept.push('…');
        }
        Self(kept)
    }
}

impl From<&str> for Echoed {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

impl From<String> for Echoed {
    fn from(text: String) -> Self {
        Self::new(&text)
    }
}

impl std::fmt::Display for Echoed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl BmcError {
    /// CamelCase, for a condition's reason and an Event.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::InvalidAddress(_) | Self::InvalidFingerprint(_) => "BMCSpecInvalid",
            Self::Credentials { .. } => "BMCCredentialsMissing",
            Self::CredentialsUnbound { .. } => "BMCCredentialsUnbound",
            Self::CredentialsNotForThisAddress { .. } => "BMCCredentialsNotForThisAddress",
            Self::CredentialsNotForThisCertificate { .. } => "BMCCredentialsNotForThisCertificate",
            Self::Unreachable { .. } | Self::Timeout { .. } => "BMCUnreachable",
            Self::Unauthorized { .. } => "BMCUnauthorized",
            Self::NotFound { .. } => "BMCSystemNotFound",
            Self::Untrusted { .. } => "BMCUntrusted",
            Self::Rejected { .. } | Self::ServerError { .. } | Self::Protocol(_) => "BMCFailed",
            Self::NoVirtualMedia(_) => "BMCNoVirtualMedia",
        }
    }

    /// The same error, saying that `made` attempts were made.
    fn with_attempts(mut self, made: u32) -> Self {
        match &mut self {
            Self::Unreachable { attempts, .. }
            | Self::Timeout { attempts, .. }
            | Self::ServerError { attempts, .. } => *attempts = made,
            _ => {}
        }
        self
    }
}

/// What the BMC says the host is: for matching it to the host that registers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The system UUID, lower case.
    pub uuid: String,
    /// Its NICs' MACs, lower case, colon-separated.
    pub macs: Vec<String>,
}

/// Whether asking the BMC for its system's identity showed a BMC siteboot can drive for the
/// host with `boot_mac`: `(ok, reason, message)`, the reason CamelCase. A BMC whose system
/// does not have the host's boot MAC manages another machine: driving it would power-cycle
/// that one.
pub fn identity_check(
    boot_mac: &str,
    identity: &Result<Option<Identity>, BmcError>,
) -> (bool, &'static str, String) {
    match identity {
        Err(e) => (false, e.reason(), e.to_string()),
        Ok(Some(identity))
            if !identity.macs.is_empty()
                && !identity.macs.iter().any(|m| m.eq_ignore_ascii_case(boot_mac)) =>
        {
            (
                false,
                "BMCBootMACMismatch",
                format!(
                    "the BMC's system {} has NICs {}, not the boot MAC {boot_mac}: the BMC address names another machine",
                    identity.uuid,
                    identity.macs.join(", ")
                ),
            )
        }
        Ok(Some(identity)) => (true, "BMCReachable", format!("system {}", identity.uuid)),
        Ok(None) => (true, "BMCReachable", String::new()),
    }
}

pub trait BmcDriver: Send + Sync {
    fn power(&self) -> BoxFuture<'_, Result<PowerState, BmcError>>;
    /// Boots the host from the network now (once): an operation needs the ramdisk.
    fn boot_from_network(&self) -> BoxFuture<'_, Result<(), BmcError>>;
    /// Boots the host from its local disk now (once): the ramdisk wrote it, and synced it
    /// before it reported.
    fn boot_from_disk(&self) -> BoxFuture<'_, Result<(), BmcError>>;
    /// Inserts the ISO at `url` as the host's virtual CD and boots it now (once): an operation
    /// whose ramdisk comes in virtual media. With `certificate` (PEM: the server of `url`), a
    /// BMC that can check its image server trusts exactly that certificate. Returns whether
    /// the BMC checks the certificate of the server it fetches the ISO from.
    fn boot_from_media<'a>(
        &'a self,
        url: &'a str,
        certificate: Option<&'a str>,
    ) -> BoxFuture<'a, Result<bool, BmcError>>;
    /// Ejects the virtual CD (nothing if it holds nothing).
    fn eject_media(&self) -> BoxFuture<'_, Result<(), BmcError>>;
    /// Power-cycles the host (powers it on if it is off).
    fn restart(&self) -> BoxFuture<'_, Result<(), BmcError>>;
    /// Turns the host off (a deleted Host, after its wipe).
    fn power_off(&self) -> BoxFuture<'_, Result<(), BmcError>>;
    /// What the BMC says the host is; `None` without a BMC.
    fn identity(&self) -> BoxFuture<'_, Result<Option<Identity>, BmcError>>;
}

/// No BMC: the host boots from the network on its own whenever it restarts.
pub struct SelfBooting;

impl BmcDriver for SelfBooting {
    fn power(&self) -> BoxFuture<'_, Result<PowerState, BmcError>> {
        Box::pin(async { Ok(PowerState::Unknown) })
    }

    fn boot_from_network(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        // Nothing to do: the next time the host restarts it boots the ramdisk.
        Box::pin(async { Ok(()) })
    }

    fn boot_from_disk(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        // Nothing to do: the ramdisk reboots, and the boot script of a Provisioned host exits
        // to the firmware, which goes on to the disk.
        Box::pin(async { Ok(()) })
    }

    fn boot_from_media<'a>(
        &'a self,
        _url: &'a str,
        _certificate: Option<&'a str>,
    ) -> BoxFuture<'a, Result<bool, BmcError>> {
        Box::pin(async { Err(BmcError::NoVirtualMedia("the host has no spec.bmc")) })
    }

    fn eject_media(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        Box::pin(async { Ok(()) })
    }

    fn restart(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        // Nothing siteboot can do; the reconciler tells the operator before it gets here.
        Box::pin(async { Ok(()) })
    }

    fn power_off(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        // Nothing siteboot can do; the operator unplugs a deleted host.
        Box::pin(async { Ok(()) })
    }

    fn identity(&self) -> BoxFuture<'_, Result<Option<Identity>, BmcError>> {
        Box::pin(async { Ok(None) })
    }
}
