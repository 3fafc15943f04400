//! A Host's BMC: its `spec.bmc` parsed ([`spec_of`]) and its driver ([`driver_for`]), with the
//! credentials from the Secret that `spec.bmc.credentialsName` names. The drivers themselves
//! ([`SelfBooting`] for a Host without `spec.bmc`, [`Redfish`]) are the crate `siteboot-bmc`'s,
//! which has no Kubernetes client so that standalone mode can use them without one; they are
//! re-exported here.

use std::sync::Arc;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
pub use siteboot_bmc::{
    AddressError, BindingError, BmcDriver, BmcError, BoundCredentials, Credentials,
    CredentialsError, Echoed, Identity, Redfish, RedfishAddress, RedfishClient, SelfBooting,
    Transport, identity_check,
};
use siteboot_tls_pin::Fingerprint;

use crate::crd::{BootMode, Host};

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
    let data = data.into_iter().map(|(key, ByteString(bytes))| (key, bytes)).collect();
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
