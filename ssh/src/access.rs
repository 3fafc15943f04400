//! The SSH access Secret of a host (Kubernetes type `siteboot.dev/ssh-access`), read into what
//! a connection needs: the private key siteboot logs in with, how the server's host key is
//! trusted, and the machine the Secret is for. As a BMC's credentials Secret names its BMC, this
//! one names its server (`address`, optionally `port`): the key is used only against the server
//! the Secret names, so whoever may edit a Host cannot point it at another machine. The caller
//! hands over the Secret's `data` as bytes: this crate has no Kubernetes types.
//!
//! | key | what |
//! |---|---|
//! | `privateKey` | the client key, OpenSSH or PEM, not encrypted |
//! | `hostKey` | the server's host key, one OpenSSH line (its `/etc/ssh/ssh_host_*_key.pub`) |
//! | `trustOnFirstUse` | `"true"` instead of `hostKey`: record the key presented the first time |
//! | `address` | the server's IP address, as the Host's `spec.access.ssh.address` |
//! | `port` | optional: the server's port, as the Host's `spec.access.ssh.port` |

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::{ClientKey, HostKey, HostKeyError, SshError};

/// The Kubernetes type an SSH access Secret has.
pub const SECRET_TYPE: &str = "siteboot.dev/ssh-access";

/// Why a Secret holds no usable SSH access. No variant repeats a value of the Secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    #[error("has no {0:?} key")]
    Missing(&'static str),
    #[error("its {0:?} is not UTF-8")]
    NotUtf8(&'static str),
    #[error("its privateKey is encrypted; siteboot needs it without a passphrase")]
    EncryptedKey,
    #[error("its privateKey cannot be read: {0}")]
    InvalidPrivateKey(String),
    #[error("its hostKey is not usable: {0}")]
    InvalidHostKey(HostKeyError),
    #[error("has neither hostKey nor trustOnFirstUse: \"true\"; the server's key must be pinned")]
    NoHostKey,
    #[error("has both hostKey and trustOnFirstUse; remove one")]
    HostKeyAndTrustOnFirstUse,
    #[error("its trustOnFirstUse is neither \"true\" nor \"false\"")]
    InvalidTrustOnFirstUse,
    #[error("its address is not an IP address")]
    InvalidAddress,
    #[error("its port is not a port number (1-65535)")]
    InvalidPort,
}

/// How the server's host key is trusted, as the Secret says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostKeyTrust {
    /// Exactly this key.
    Pinned(HostKey),
    /// The key the server presents the first time, recorded by the caller and pinned after.
    OnFirstUse,
}

/// Where a Host says its server is: the address and port siteboot would connect to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub address: IpAddr,
    pub port: u16,
}

/// An SSH access Secret, read, and bound to the server it names.
#[derive(Debug, Clone)]
pub struct BoundAccess {
    endpoint: Endpoint,
    key: ClientKey,
    trust: HostKeyTrust,
}

/// Why a Secret's key may not be used against the server a Host names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindingError {
    #[error(transparent)]
    Unusable(#[from] AccessError),
    /// The Secret has no `address`.
    #[error("names no server")]
    Unbound,
    #[error("names another server")]
    OtherAddress,
    #[error("names another port")]
    OtherPort,
}

impl BoundAccess {
    /// The access in a Secret's `data` for the server at `endpoint` that a Host names: only
    /// when the Secret's `address` (and `port`, if it has one) is that server.
    pub fn from_secret_data(
        data: &BTreeMap<String, Vec<u8>>,
        endpoint: Endpoint,
    ) -> Result<Self, BindingError> {
        let key =
            client_key(field(data, "privateKey")?.ok_or(AccessError::Missing("privateKey"))?)?;
        let trust = trust(field(data, "hostKey")?, field(data, "trustOnFirstUse")?)?;
        let address: IpAddr = field(data, "address")?
            .ok_or(BindingError::Unbound)?
            .trim()
            .parse()
            .map_err(|_| AccessError::InvalidAddress)?;
        let port = field(data, "port")?
            .map(|port| port.trim().parse::<u16>().ok().filter(|&p| p != 0))
            .map(|port| port.ok_or(AccessError::InvalidPort))
            .transpose()?;
        if address != endpoint.address {
            return Err(BindingError::OtherAddress);
        }
        if port.is_some_and(|port| port != endpoint.port) {
            return Err(BindingError::OtherPort);
        }
        Ok(Self { endpoint, key, trust })
    }

    pub fn endpoint(&self) -> Endpoint {
        self.endpoint
    }

    pub fn key(&self) -> &ClientKey {
        &self.key
    }

    pub fn trust(&self) -> &HostKeyTrust {
        &self.trust
    }
}

fn client_key(text: &str) -> Result<ClientKey, AccessError> {
    ClientKey::from_text(text).map_err(|err| match err {
        SshError::EncryptedKey => AccessError::EncryptedKey,
        SshError::InvalidClientKey(why) => AccessError::InvalidPrivateKey(why),
        other => AccessError::InvalidPrivateKey(other.to_string()),
    })
}

/// The trust from `hostKey` and `trustOnFirstUse`: exactly one of a key and `"true"`.
fn trust(host_key: Option<&str>, on_first_use: Option<&str>) -> Result<HostKeyTrust, AccessError> {
    let on_first_use = match on_first_use.map(str::trim) {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => return Err(AccessError::InvalidTrustOnFirstUse),
    };
    match (host_key, on_first_use) {
        (Some(_), true) => Err(AccessError::HostKeyAndTrustOnFirstUse),
        (Some(line), false) => {
            Ok(HostKeyTrust::Pinned(line.parse().map_err(AccessError::InvalidHostKey)?))
        }
        (None, true) => Ok(HostKeyTrust::OnFirstUse),
        (None, false) => Err(AccessError::NoHostKey),
    }
}

/// `data[key]` as UTF-8, if it is there.
fn field<'a>(
    data: &'a BTreeMap<String, Vec<u8>>,
    key: &'static str,
) -> Result<Option<&'a str>, AccessError> {
    data.get(key)
        .map(|bytes| std::str::from_utf8(bytes).map_err(|_| AccessError::NotUtf8(key)))
        .transpose()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    // Throwaway keys made with `ssh-keygen -t ed25519` for these tests; they open nothing.
    pub(crate) const PRIVATE_KEY: &str = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\nQyNTUxOQAAACBHtIV64SKCJuQ9TdaCoIcgM01Lg0AuiNylCH8JtJ3F+AAAAJBx4HtwceB7\ncAAAAAtzc2gtZWQyNTUxOQAAACBHtIV64SKCJuQ9TdaCoIcgM01Lg0AuiNylCH8JtJ3F+A\nAAAEBAP0sERiFkFrIz0omAHUUluhVum32a57sKOPbsMZQ2sEe0hXrhIoIm5D1N1oKghyAz\nTUuDQC6I3KUIfwm0ncX4AAAADHJvb3RAZml4dHVyZQE=\n-----END OPENSSH PRIVATE KEY-----\n";
    const HOST_KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEe0hXrhIoIm5D1N1oKghyAzTUuDQC6I3KUIfwm0ncX4 root@fixture";

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect()
    }

    const SERVER: Endpoint =
        Endpoint { address: IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 5)), port: 22 };

    fn bind(pairs: &[(&str, &str)], endpoint: Endpoint) -> Result<BoundAccess, BindingError> {
        let pairs = [&[("privateKey", PRIVATE_KEY)][..], pairs].concat();
        BoundAccess::from_secret_data(&data(&pairs), endpoint)
    }

    #[test]
    fn a_secret_is_read_into_its_key_its_trust_and_its_server() {
        let bound = bind(&[("hostKey", HOST_KEY), ("address", "10.0.0.5")], SERVER).unwrap();
        assert_eq!(bound.endpoint(), SERVER);
        assert_eq!(bound.trust(), &HostKeyTrust::Pinned(HOST_KEY.parse().unwrap()));
        assert_eq!(bound.key().public_key(), HOST_KEY, "the fixture's key pair");
        let tofu = [("trustOnFirstUse", "true"), ("address", "10.0.0.5"), ("port", "22")];
        assert_eq!(bind(&tofu, SERVER).unwrap().trust(), &HostKeyTrust::OnFirstUse);
        let v6 = Endpoint { address: "fd00::5".parse().unwrap(), port: 2222 };
        let spelt = [("hostKey", HOST_KEY), ("address", "fd00:0::5\n"), ("port", "2222")];
        assert!(bind(&spelt, v6).is_ok(), "the same address spelt another way");
    }

    /// A Host editor's attack: the Host names another machine than the Secret.
    #[test]
    fn a_key_binds_only_to_the_server_its_secret_names() {
        let pinned = ("hostKey", HOST_KEY);
        assert_eq!(bind(&[pinned], SERVER).unwrap_err(), BindingError::Unbound);
        let other = bind(&[pinned, ("address", "10.0.0.6")], SERVER).unwrap_err();
        assert_eq!(other, BindingError::OtherAddress);
        let port = bind(&[pinned, ("address", "10.0.0.5"), ("port", "2222")], SERVER);
        assert_eq!(port.unwrap_err(), BindingError::OtherPort);
        // A name is not an address: what it resolves to is not the Secret's to say.
        let named = bind(&[pinned, ("address", "server.example")], SERVER).unwrap_err();
        assert_eq!(named, BindingError::Unusable(AccessError::InvalidAddress));
    }

    #[test]
    fn says_what_is_wrong_with_the_secret_without_repeating_it() {
        let at = ("address", "10.0.0.5");
        let err = |pairs: &[(&str, &str)]| match bind(pairs, SERVER).unwrap_err() {
            BindingError::Unusable(e) => e,
            other => panic!("{other:?}"),
        };
        assert_eq!(err(&[at]), AccessError::NoHostKey);
        let both = [at, ("hostKey", HOST_KEY), ("trustOnFirstUse", "true")];
        assert_eq!(err(&both), AccessError::HostKeyAndTrustOnFirstUse);
        assert_eq!(err(&[at, ("trustOnFirstUse", "yes")]), AccessError::InvalidTrustOnFirstUse);
        assert_eq!(err(&[at, ("trustOnFirstUse", "false")]), AccessError::NoHostKey);
        let private = err(&[at, ("hostKey", PRIVATE_KEY)]);
        assert_eq!(private, AccessError::InvalidHostKey(HostKeyError::PrivateKey));
        assert!(!private.to_string().contains("b3Blbn"), "{private}");
        assert_eq!(err(&[at, ("hostKey", HOST_KEY), ("port", "0")]), AccessError::InvalidPort);
        assert_eq!(err(&[at, ("hostKey", HOST_KEY), ("port", "65536")]), AccessError::InvalidPort);
        let missing = BoundAccess::from_secret_data(&data(&[at, ("hostKey", HOST_KEY)]), SERVER);
        assert_eq!(
            missing.unwrap_err(),
            BindingError::Unusable(AccessError::Missing("privateKey"))
        );
        let public = data(&[("privateKey", HOST_KEY), at, ("hostKey", HOST_KEY)]);
        let error = BoundAccess::from_secret_data(&public, SERVER).unwrap_err();
        assert!(
            matches!(error, BindingError::Unusable(AccessError::InvalidPrivateKey(_))),
            "{error:?}"
        );
        let mut bytes = data(&[at, ("hostKey", HOST_KEY), ("privateKey", PRIVATE_KEY)]);
        bytes.insert("hostKey".into(), b"\xff".to_vec());
        let error = BoundAccess::from_secret_data(&bytes, SERVER).unwrap_err();
        assert_eq!(error, BindingError::Unusable(AccessError::NotUtf8("hostKey")));
    }
}
