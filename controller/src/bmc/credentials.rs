//! A BMC's user name and password, from the Secret that `spec.bmc.credentialsName` names
//! (`username`, `password`). `Debug` never shows the password.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::ByteString;

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
    pub fn from_secret_data(data: &BTreeMap<String, ByteString>) -> Result<Self, CredentialsError> {
        let field = |key: &'static str| {
            let bytes = data.get(key).ok_or(CredentialsError::Missing(key))?;
            std::str::from_utf8(&bytes.0).map_err(|_| CredentialsError::NotUtf8(key))
        };
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

    fn data(pairs: &[(&str, &[u8])]) -> BTreeMap<String, ByteString> {
        pairs.iter().map(|(k, v)| (k.to_string(), ByteString(v.to_vec()))).collect()
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
}
