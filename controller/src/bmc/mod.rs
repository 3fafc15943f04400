//! BMC drivers: what siteboot can do to a host's power and boot device. Hosts without
//! `spec.bmc` get [`SelfBooting`]: siteboot cannot power-cycle them, and waits for them to
//! network-boot by themselves (PXE first in the boot order). Hosts with a Redfish BMC get
//! [`Redfish`]: power, a one-time network boot, and the identity the BMC reports.

pub mod address;
pub mod credentials;
pub mod redfish;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use siteboot_agent::Fingerprint;
use siteboot_boot::inventory::BoxFuture;

pub use self::address::{AddressError, RedfishAddress, Transport};
pub use self::credentials::{Credentials, CredentialsError};
pub use self::redfish::{Redfish, RedfishClient};
use crate::crd::{BootMode, Host, PowerState};

/// What went wrong talking to a BMC, or before.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BmcError {
    #[error(transparent)]
    InvalidAddress(#[from] AddressError),
    #[error("spec.bmc.certificateFingerprint {0:?} is not sha256: and 64 hex digits")]
    InvalidFingerprint(String),
    #[error("the BMC credentials Secret {name:?} {why}")]
    Credentials { name: String, why: String },
    #[error("the BMC at {address} is unreachable after {attempts} attempt(s): {reason}")]
    Unreachable { address: String, attempts: u32, reason: String },
    #[error("the BMC at {address} did not answer within {after:?} ({attempts} attempt(s))")]
    Timeout { address: String, after: Duration, attempts: u32 },
    #[error("the BMC at {address} refused the credentials (wrong username or password?)")]
    Unauthorized { address: String },
    #[error("the BMC has no {path} (wrong system in spec.bmc.address?)")]
    NotFound { path: String },
    #[error("the BMC at {address} is not trusted: {reason}")]
    Untrusted { address: String, reason: String },
    #[error("the BMC refused {path}: {message}")]
    Rejected { path: String, message: String },
    #[error("the BMC failed {path} ({attempts} attempt(s)): {message}")]
    ServerError { path: String, attempts: u32, message: String },
    #[error("the BMC's answer makes no sense: {0}")]
    Protocol(String),
}

impl BmcError {
    /// CamelCase, for a condition's reason and an Event.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::InvalidAddress(_) | Self::InvalidFingerprint(_) => "BMCSpecInvalid",
            Self::Credentials { .. } => "BMCCredentialsMissing",
            Self::Unreachable { .. } | Self::Timeout { .. } => "BMCUnreachable",
            Self::Unauthorized { .. } => "BMCUnauthorized",
            Self::NotFound { .. } => "BMCSystemNotFound",
            Self::Untrusted { .. } => "BMCUntrusted",
            Self::Rejected { .. } | Self::ServerError { .. } | Self::Protocol(_) => "BMCFailed",
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

/// A Host's `spec.bmc`, parsed: where the BMC is, and the certificate pinned, if one is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BmcSpec {
    pub address: RedfishAddress,
    pub pin: Option<Fingerprint>,
    pub credentials_name: String,
    pub boot_mode: Option<BootMode>,
}

/// `host`'s BMC, if it has one; an error when `spec.bmc` cannot be driven at all (no I/O).
pub fn spec_of(host: &Host) -> Result<Option<BmcSpec>, BmcError> {
    let Some(bmc) = &host.spec.bmc else { return Ok(None) };
    let pin = match &bmc.certificate_fingerprint {
        None => None,
        Some(pin) => Some(pin.parse().map_err(|_| BmcError::InvalidFingerprint(pin.clone()))?),
    };
    Ok(Some(BmcSpec {
        address: bmc.address.parse()?,
        pin,
        credentials_name: bmc.credentials_name.clone(),
        boot_mode: bmc.boot_mode,
    }))
}

/// The driver for `host`: its credentials are read from the Secret in its namespace.
pub async fn driver_for(
    host: &Host,
    client: &kube::Client,
) -> Result<Arc<dyn BmcDriver>, BmcError> {
    let Some(spec) = spec_of(host)? else { return Ok(Arc::new(SelfBooting)) };
    let namespace = kube::ResourceExt::namespace(host).unwrap_or_default();
    let secrets: kube::Api<Secret> = kube::Api::namespaced(client.clone(), &namespace);
    let name = &spec.credentials_name;
    let secret = secrets.get_opt(name).await.map_err(|e| BmcError::Credentials {
        name: format!("{namespace}/{name}"),
        why: format!("cannot be read: {e}"),
    })?;
    Ok(Arc::new(redfish_for(spec, &namespace, secret.as_ref())?))
}

/// The Redfish driver for `spec` with the credentials Secret it names (`None`: there is none),
/// read from `namespace`. No I/O.
pub fn redfish_for(
    spec: BmcSpec,
    namespace: &str,
    secret: Option<&Secret>,
) -> Result<Redfish, BmcError> {
    let name = &spec.credentials_name;
    let fail = |why: String| BmcError::Credentials { name: format!("{namespace}/{name}"), why };
    let secret = secret.ok_or_else(|| fail("does not exist".into()))?;
    let data = secret.data.clone().unwrap_or_default();
    let credentials = Credentials::from_secret_data(&data).map_err(|e| fail(e.to_string()))?;
    let client = RedfishClient::new(spec.address, credentials, spec.pin)?;
    Ok(Redfish::new(client).with_boot_mode(spec.boot_mode))
}

