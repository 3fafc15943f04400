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
use siteboot_boot::inventory::BoxFuture;
use siteboot_tls_pin::Fingerprint;

pub use self::address::{AddressError, RedfishAddress, Transport};
pub use self::credentials::{BindingError, BoundCredentials, Credentials, CredentialsError};
pub use self::redfish::{Redfish, RedfishClient};
use crate::crd::{BootMode, Host, PowerState};

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
/// read from `namespace`: only if the Secret names the BMC `spec` does. No I/O.
pub fn redfish_for(
    spec: BmcSpec,
    namespace: &str,
    secret: Option<&Secret>,
) -> Result<Redfish, BmcError> {
    let (namespace, name) = (namespace.to_owned(), spec.credentials_name);
    let missing = |why: String| BmcError::Credentials { name: format!("{namespace}/{name}"), why };
    let secret = secret.ok_or_else(|| missing("does not exist".into()))?;
    let data = secret.data.clone().unwrap_or_default();
    let bound = match BoundCredentials::from_secret_data(&data, &spec.address, spec.pin) {
        Ok(bound) => bound,
        Err(BindingError::Unusable(e)) => return Err(missing(e.to_string())),
        Err(BindingError::Unbound) => {
            let address = spec.address.to_string();
            return Err(BmcError::CredentialsUnbound { namespace, name, address });
        }
        Err(BindingError::OtherAddress) => {
            let address = spec.address.to_string();
            return Err(BmcError::CredentialsNotForThisAddress { namespace, name, address });
        }
        Err(BindingError::OtherCertificate) => {
            return Err(BmcError::CredentialsNotForThisCertificate { namespace, name });
        }
    };
    Ok(Redfish::new(RedfishClient::new(bound)?).with_boot_mode(spec.boot_mode))
}

#[cfg(test)]
mod tests {
    //! A Host editor's attack on the credentials: a loopback listener stands in for the server
    //! the editor names, and records every request that reaches it.

    use std::collections::BTreeMap;
    use std::net::{Ipv4Addr, SocketAddr};
    use std::sync::Mutex;

    use k8s_openapi::ByteString;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::crd::{Bmc, HostSpec};

    const SYSTEM: &str = "/redfish/v1/Systems/1";

    /// The request heads a listener received, each as text.
    type Seen = Arc<Mutex<Vec<String>>>;

    /// A listener answering every request with `answer(request head)`: status and body.
    async fn listen(answer: fn(&str) -> (u16, String)) -> (SocketAddr, Seen) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let address = listener.local_addr().unwrap();
        let seen: Seen = Arc::default();
        let record = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut tcp, _)) = listener.accept().await {
                let mut head = Vec::new();
                let mut buf = [0; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tcp.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                record.lock().unwrap().push(head.clone());
                let (status, body) = answer(&head);
                let response = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = tcp.write_all(response.as_bytes()).await;
            }
        });
        (address, seen)
    }

    /// A BMC without a session service whose system is `52:54:00:00:00:01`'s.
    fn bmc(head: &str) -> (u16, String) {
        if head.starts_with(&format!("GET {SYSTEM} ")) {
            (200, r#"{"UUID": "0b5a1c2d-0000-4000-8000-0123456789ab", "PowerState": "On"}"#.into())
        } else {
            (200, "{}".into())
        }
    }

    fn host(address: &str) -> Host {
        let mut host = Host::new("victim", HostSpec::new("52:54:00:00:00:01".to_owned()));
        host.metadata.namespace = Some("metal".into());
        host.spec.bmc = Some(Bmc {
            address: address.to_owned(),
            credentials_name: "other-bmc".into(),
            certificate_fingerprint: None,
            boot_mode: None,
        });
        host
    }

    /// The credentials Secret of another host's BMC: `address`, if given, names that BMC.
    fn secret(address: Option<&str>) -> Secret {
        let mut data = BTreeMap::from([
            ("username".to_owned(), ByteString(b"root".to_vec())),
            ("password".to_owned(), ByteString(b"other-hosts-password".to_vec())),
        ]);
        if let Some(address) = address {
            data.insert("address".into(), ByteString(address.as_bytes().to_vec()));
        }
        Secret { data: Some(data), ..Secret::default() }
    }

    /// What siteboot does for `host` with `secret`: builds the driver, asks for the identity.
    async fn check(host: &Host, secret: &Secret) -> Result<Option<Identity>, BmcError> {
        let spec = spec_of(host)?.unwrap();
        redfish_for(spec, "metal", Some(secret))?.identity().await
    }

    #[tokio::test]
    async fn credentials_for_another_bmc_never_reach_the_address_a_host_editor_names() {
        let (listener, seen) = listen(bmc).await;
        let attacker = format!("redfish+http://{listener}{SYSTEM}");
        let secret = secret(Some("redfish+https://10.0.0.77/redfish/v1/Systems/1"));
        let result = check(&host(&attacker), &secret).await;
        let seen = seen.lock().unwrap().clone();
        assert!(seen.is_empty(), "the editor's server got {} request(s): {seen:?}", seen.len());
        let error = result.unwrap_err();
        assert_eq!(error.reason(), "BMCCredentialsNotForThisAddress", "{error}");
        assert!(!error.to_string().contains("10.0.0.77"), "the Secret's address leaked: {error}");

        // A Secret that names no BMC at all is no better.
        let result = check(&host(&attacker), &self::secret(None)).await;
        assert_eq!(seen.len(), 0);
        let error = result.unwrap_err();
        assert_eq!(error.reason(), "BMCCredentialsUnbound", "{error}");
        assert!(
            error.to_string().contains(r#"--type merge -p '{"stringData":{"address":""#),
            "{error}"
        );
    }

    #[tokio::test]
    async fn credentials_go_to_the_bmc_their_secret_names_however_the_address_is_spelt() {
        let (listener, seen) = listen(bmc).await;
        let port = listener.port();
        let secret = secret(Some(&format!("redfish+http://127.0.0.1:{port}{SYSTEM}/")));
        let host = host(&format!("redfish+http://127.0.0.1:{port}{SYSTEM}"));
        let identity = check(&host, &secret).await.unwrap().unwrap();
        assert_eq!(identity.uuid, "0b5a1c2d-0000-4000-8000-0123456789ab");
        let basic = base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            "root:other-hosts-password",
        );
        let seen = seen.lock().unwrap().clone();
        assert!(seen.iter().any(|h| h.contains(&format!("Basic {basic}"))), "{seen:?}");
    }

    /// 10 KiB of control characters, escape sequences and markup.
    fn garbage() -> String {
        "\u{1b}[2J<script>alert(1)</script>\r\n\0\u{7}BODY-ECHOED\t".repeat(10 * 1024 / 48)
    }

    /// An error siteboot writes into a condition, an Event and its log.
    fn assert_echo_is_bounded(error: &BmcError) {
        let message = error.to_string();
        assert!(message.chars().count() <= 200, "{} characters: {message:?}", message.len());
        assert!(!message.chars().any(char::is_control), "{message:?}");
    }

    #[tokio::test]
    async fn what_a_bmc_answers_is_echoed_bounded_and_printable() {
        let (listener, _) = listen(|head| match head.starts_with(&format!("GET {SYSTEM} ")) {
            true => (400, garbage()),
            false => (200, "{}".into()),
        })
        .await;
        let address = format!("redfish+http://{listener}{SYSTEM}");
        let error = check(&host(&address), &secret(Some(&address))).await.unwrap_err();
        assert_echo_is_bounded(&error);
        assert!(!error.to_string().contains("BODY-ECHOED"), "a raw body is echoed: {error}");

        // The Redfish error's own message is echoed, cut short.
        let (listener, _) = listen(|head| match head.starts_with(&format!("GET {SYSTEM} ")) {
            true => (400, serde_json::json!({"error": {"message": garbage()}}).to_string()),
            false => (200, "{}".into()),
        })
        .await;
        let address = format!("redfish+http://{listener}{SYSTEM}");
        let error = check(&host(&address), &secret(Some(&address))).await.unwrap_err();
        assert_echo_is_bounded(&error);
        assert!(error.to_string().contains("BODY-ECHOED"), "{error}");

        // So is what a successful answer says that makes no sense.
        let (listener, _) = listen(|head| match head.starts_with(&format!("GET {SYSTEM} ")) {
            true => (200, serde_json::json!({"UUID": garbage(), "PowerState": "On"}).to_string()),
            false => (200, "{}".into()),
        })
        .await;
        let address = format!("redfish+http://{listener}{SYSTEM}");
        let error = check(&host(&address), &secret(Some(&address))).await.unwrap_err();
        assert_echo_is_bounded(&error);
    }
}
