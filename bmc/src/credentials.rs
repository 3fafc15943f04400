//! A BMC's user name and password, from the Secret that `spec.bmc.credentialsName` names
//! (`username`, `password`), bound to the BMC that Secret names (`address`, optional
//! `certificateFingerprint`). `Debug` never shows the password. The controller reads the
//! Secret and hands its `data` over as bytes: this crate has no Kubernetes types.

use std::collections::BTreeMap;
use std::fmt;

use siteboot_tls_pin::Fingerprint;

use super::RedfishAddress;

#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    username: String,
    password: String,
}

/// Why a Secret holds no usable credentials.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialsError {
    #[error("has no {0:?} key")]
    Missing(&'static str),
    #[error("its {0:?} is not UTF-8")]
    NotUtf8(&'static str),
    #[error("its {0:?} is empty")]
    Empty(&'static str),
    #[error("its username contains ':', which basic authentication cannot carry")]
    ColonInUsername,
    #[error("its address is not a BMC address: {0}")]
    InvalidAddress(&'static str),
    #[error("its certificateFingerprint is not sha256: and 64 hex digits")]
    InvalidFingerprint,
}

/// Credentials and the one BMC they may be sent to, as whoever wrote the credentials named it.
/// A [`RedfishClient`](super::RedfishClient) takes nothing else, so credentials go only there.
#[derive(Debug, Clone)]
pub struct BoundCredentials {
    address: RedfishAddress,
    /// The certificate to trust instead of the platform's CAs.
    pin: Option<Fingerprint>,
    credentials: Credentials,
}

/// Why a Secret's credentials may not go to the BMC a Host names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindingError {
    #[error(transparent)]
    Unusable(#[from] CredentialsError),
    /// The Secret has no `address`.
    #[error("names no BMC")]
    Unbound,
    #[error("names another BMC")]
    OtherAddress,
    /// The Host pins a certificate the Secret does not pin.
    #[error("pins no certificate, or another one")]
    OtherCertificate,
}

impl BoundCredentials {
    /// The credentials in a Secret's `data` for the BMC at `address` that a Host names (with
    /// the certificate `pin` it pins, if any): only when the Secret's `address` is that BMC,
    /// and it pins the same certificate when the Host pins one. The Secret's pin is the one
    /// used: a Host editor may not choose which certificate to trust.
    pub fn from_secret_data(
        data: &BTreeMap<String, Vec<u8>>,
        address: &RedfishAddress,
        pin: Option<Fingerprint>,
    ) -> Result<Self, BindingError> {
        let credentials = Credentials::from_secret_data(data)?;
        let named: RedfishAddress = optional_field(data, "address")?
            .ok_or(BindingError::Unbound)?
            .parse()
            .map_err(|e: super::AddressError| CredentialsError::InvalidAddress(e.why))?;
        let secret_pin = optional_field(data, "certificateFingerprint")?
            .map(|pin| pin.parse().map_err(|_| CredentialsError::InvalidFingerprint))
            .transpose()?;
        if named != *address {
            return Err(BindingError::OtherAddress);
        }
        if pin.is_some() && pin != secret_pin {
            return Err(BindingError::OtherCertificate);
        }
        Ok(Self { address: named, pin: secret_pin, credentials })
    }

    /// Credentials for the BMC at `address` from the same trusted hand that named it (the
    /// operator's configuration in standalone mode): there is nothing to check them against.
    pub fn trusted(
        address: RedfishAddress,
        pin: Option<Fingerprint>,
        credentials: Credentials,
    ) -> Self {
        Self { address, pin, credentials }
    }

    pub fn address(&self) -> &RedfishAddress {
        &self.address
    }

    pub fn pin(&self) -> Option<Fingerprint> {
        self.pin
    }

    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }
}

/// `data[key]` as UTF-8, if it is there.
fn optional_field<'a>(
    data: &'a BTreeMap<String, Vec<u8>>,
    key: &'static str,
) -> Result<Option<&'a str>, CredentialsError> {
    data.get(key)
        .map(|bytes| std::str::from_utf8(bytes).map_err(|_| CredentialsError::NotUtf8(key)))
        .transpose()
}

impl Credentials {
    pub fn new(username: &str, password: &str) -> Result<Self, CredentialsError> {
        if username.is_empty() {
            return Err(CredentialsError::Empty("username"));
        }
        if password.is_empty() {
            return Err(CredentialsError::Empty("password"));
        }
        if username.contains(':') {
            return Err(CredentialsError::ColonInUsername);
        }
        Ok(Self { username: username.to_owned(), password: password.to_owned() })
    }

    /// From a Secret's `data`.
    pub fn from_secret_data(data: &BTreeMap<String, Vec<u8>>) -> Result<Self, CredentialsError> {
        let field = |key| optional_field(data, key)?.ok_or(CredentialsError::Missing(key));
        Self::new(field("username")?, field("password")?)
    }

    pub fn username(&self) -> &str {
        &self.username
    }

    pub fn password(&self) -> &str {
        &self.password
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials").field("username", &self.username).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &[u8])]) -> BTreeMap<String, Vec<u8>> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_vec())).collect()
    }

    #[test]
    fn reads_username_and_password_and_hides_the_password() {
        let c = Credentials::from_secret_data(&data(&[
            ("username", b"admin"),
            ("password", b"s3cret"),
        ]))
        .unwrap();
        assert_eq!((c.username(), c.password()), ("admin", "s3cret"));
        assert!(!format!("{c:?}").contains("s3cret"));
    }

    #[test]
    fn says_what_is_wrong_with_the_secret() {
        let err =
            |pairs: &[(&str, &[u8])]| Credentials::from_secret_data(&data(pairs)).unwrap_err();
        assert_eq!(err(&[("password", b"x")]), CredentialsError::Missing("username"));
        assert_eq!(
            err(&[("username", b"a"), ("password", b"\xff")]),
            CredentialsError::NotUtf8("password")
        );
        assert_eq!(
            err(&[("username", b"a"), ("password", b"")]),
            CredentialsError::Empty("password")
        );
        assert_eq!(
            err(&[("username", b"a:b"), ("password", b"x")]),
            CredentialsError::ColonInUsername
        );
    }

    const BMC: &str = "redfish+https://10.0.0.5/redfish/v1/Systems/1";
    const PIN: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000001";

    fn bind(
        pairs: &[(&str, &[u8])],
        address: &str,
        pin: Option<&str>,
    ) -> Result<BoundCredentials, BindingError> {
        let pairs = [&[("username", &b"admin"[..]), ("password", b"s3cret")][..], pairs].concat();
        let pin = pin.map(|p| p.parse().unwrap());
        BoundCredentials::from_secret_data(&data(&pairs), &address.parse().unwrap(), pin)
    }

    #[test]
    fn credentials_bind_only_to_the_bmc_their_secret_names() {
        let bound = bind(&[("address", BMC.as_bytes())], BMC, None).unwrap();
        assert_eq!((bound.address(), bound.pin()), (&BMC.parse().unwrap(), None));
        assert_eq!(bound.credentials().password(), "s3cret");
        // Spelt another way, the same BMC.
        let spelt = b"redfish://10.0.0.5:443/redfish/v1/Systems/1/";
        assert!(bind(&[("address", spelt)], BMC, None).is_ok());

        assert_eq!(bind(&[], BMC, None).unwrap_err(), BindingError::Unbound);
        let other = b"redfish+https://10.0.0.6/redfish/v1/Systems/1";
        assert_eq!(bind(&[("address", other)], BMC, None).unwrap_err(), BindingError::OtherAddress);
        let other_system = b"redfish+https://10.0.0.5/redfish/v1/Systems/2";
        let error = bind(&[("address", other_system)], BMC, None).unwrap_err();
        assert_eq!(error, BindingError::OtherAddress);
        let plain = b"redfish+http://10.0.0.5:443/redfish/v1/Systems/1";
        assert_eq!(bind(&[("address", plain)], BMC, None).unwrap_err(), BindingError::OtherAddress);
        assert_eq!(
            bind(&[("address", b"10.0.0.5")], BMC, None).unwrap_err(),
            BindingError::Unusable(CredentialsError::InvalidAddress(
                "no scheme (redfish+https://...)"
            ))
        );
    }

    #[test]
    fn the_pin_is_the_secrets_and_a_host_cannot_choose_another() {
        let address = ("address", BMC.as_bytes());
        let pinned = ("certificateFingerprint", PIN.as_bytes());
        // The Secret's pin holds whether or not the Host repeats it.
        let bound = bind(&[address, pinned], BMC, None).unwrap();
        assert_eq!(bound.pin(), Some(PIN.parse().unwrap()));
        assert!(bind(&[address, pinned], BMC, Some(PIN)).is_ok());
        // A Host's pin of its own is refused, not used.
        let other = "sha256:0000000000000000000000000000000000000000000000000000000000000002";
        let error = bind(&[address, pinned], BMC, Some(other)).unwrap_err();
        assert_eq!(error, BindingError::OtherCertificate);
        assert_eq!(bind(&[address], BMC, Some(PIN)).unwrap_err(), BindingError::OtherCertificate);
        assert_eq!(
            bind(&[address, ("certificateFingerprint", b"md5:00")], BMC, None).unwrap_err(),
            BindingError::Unusable(CredentialsError::InvalidFingerprint)
        );
    }
}
