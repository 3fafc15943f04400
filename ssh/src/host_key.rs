//! A server's host key, as an operator pins it and as siteboot records it: one OpenSSH
//! public-key line (`ssh-ed25519 AAAA… comment`, what `/etc/ssh/ssh_host_*_key.pub` holds and
//! `ssh-keyscan` prints). Only the algorithm and the key take part in equality; the comment is
//! dropped, so a key recorded on first use and the same key pasted from the server compare equal.
//! The fingerprint is written as `ssh-keygen -l` and OpenSSH's own prompts write it
//! (`SHA256:<base64>`), so an operator can compare it with what they see on the server.

use std::fmt;
use std::str::FromStr;

use russh::keys::{Algorithm, HashAlg, PublicKey};

/// What is wrong with a host-key line. The line is public, but what was pasted may not be (a
/// private key by mistake), so no error repeats it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostKeyError {
    #[error("a host key is one line `<algorithm> <base64> [comment]`, and this is empty")]
    Empty,
    #[error("a host key is one line `<algorithm> <base64> [comment]`, and this has several")]
    MultipleLines,
    #[error(
        "this is a private key; a host key is the server's public key (its \
         /etc/ssh/ssh_host_*_key.pub, or what ssh-keyscan prints)"
    )]
    PrivateKey,
    #[error(
        "host key algorithm {0:?} is not accepted (ssh-ed25519, ecdsa-sha2-nistp256/384/521 \
         and ssh-rsa are)"
    )]
    UnsupportedAlgorithm(String),
    #[error("not an OpenSSH public key `<algorithm> <base64> [comment]`: {0}")]
    Malformed(String),
}

/// A server's public host key (algorithm and key; no comment).
#[derive(Clone, PartialEq, Eq)]
pub struct HostKey(PublicKey);

impl HostKey {
    /// The key the server presented in a handshake, if its algorithm is one a Host may pin.
    pub(crate) fn presented(key: &PublicKey) -> Result<Self, HostKeyError> {
        Self::accepted(key.clone())
    }

    fn accepted(mut key: PublicKey) -> Result<Self, HostKeyError> {
        match key.algorithm() {
            Algorithm::Ed25519 | Algorithm::Ecdsa { .. } | Algorithm::Rsa { .. } => {
                key.set_comment("");
                Ok(Self(key))
            }
            other => Err(HostKeyError::UnsupportedAlgorithm(other.as_str().to_owned())),
        }
    }

    /// `SHA256:<base64, unpadded>`, as `ssh-keygen -lf` prints it.
    pub fn fingerprint(&self) -> String {
        self.0.fingerprint(HashAlg::Sha256).to_string()
    }

    pub(crate) fn key_algorithm(&self) -> Algorithm {
        self.0.algorithm()
    }

    /// The algorithm's name, e.g. `ssh-ed25519`.
    pub fn algorithm(&self) -> String {
        self.0.algorithm().as_str().to_owned()
    }
}

impl FromStr for HostKey {
    type Err = HostKeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let line = s.trim();
        if line.is_empty() {
            return Err(HostKeyError::Empty);
        }
        if line.starts_with("-----BEGIN") || line.starts_with("PuTTY-User-Key-File") {
            return Err(HostKeyError::PrivateKey);
        }
        if line.contains(['\n', '\r']) {
            return Err(HostKeyError::MultipleLines);
        }
        let key = PublicKey::from_openssh(line).map_err(|err| match err {
            russh::keys::ssh_key::Error::AlgorithmUnknown
            | russh::keys::ssh_key::Error::AlgorithmUnsupported { .. } => {
                let name = line.split_whitespace().next().unwrap_or_default();
                HostKeyError::UnsupportedAlgorithm(name.chars().take(64).collect())
            }
            other => HostKeyError::Malformed(other.to_string()),
        })?;
        Self::accepted(key)
    }
}

/// `<algorithm> <base64>`: the line [`FromStr`] reads, without a comment.
impl fmt::Display for HostKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Encoding a key that was decoded cannot fail; fmt::Error if it ever did.
        f.write_str(&self.0.to_openssh().map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for HostKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostKey({} {})", self.algorithm(), self.fingerprint())
    }
}

/// Which host key a connection accepts. There is no "accept anything": a server is either
/// pinned, or its key is recorded the first time, on an operator's explicit request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostKeyPolicy {
    /// Exactly this key; any other aborts the handshake before anything is sent.
    Pinned(HostKey),
    /// Whatever the server presents, returned by the connection so the caller records it and
    /// pins it from then on.
    TrustOnFirstUse,
}

impl HostKeyPolicy {
    /// Whether `presented` may be talked to; the error names both fingerprints.
    pub(crate) fn check(&self, presented: &HostKey) -> Result<(), HostKeyMismatch> {
        match self {
            Self::Pinned(pinned) if pinned != presented => Err(HostKeyMismatch {
                pinned: pinned.fingerprint(),
                presented: presented.fingerprint(),
            }),
            Self::Pinned(_) | Self::TrustOnFirstUse => Ok(()),
        }
    }
}

/// The server presented another host key than the pinned one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the server's host key is {presented}, not the pinned {pinned}")]
pub struct HostKeyMismatch {
    pub pinned: String,
    pub presented: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    // Throwaway keys made with ssh-keygen; the fingerprints are what `ssh-keygen -lf` printed.
    const ED25519: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEe0hXrhIoIm5D1N1oKghyAzTUuDQC6I3KUIfwm0ncX4 root@fixture";
    const ED25519_SHA256: &str = "SHA256:t6d8j15eRbRn9Rf4ubBEjXKgM19vUQJ2ncv6llQPJdg";
    const ECDSA_P256: &str = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBBCR00Kiiiv9bKZqYLAJXcQDH/Q/7VryGvP9kaeLo48tc0o4IVSHkcQVxNZmBff7UZFtuaUlrLD+1ZwJssvOiGs= ecdsa fixture";
    const ECDSA_P256_SHA256: &str = "SHA256:ckKO9Sve7+4jwOkPfvXunO9/yy8hZKwmv/hDgORfqUs";
    const ECDSA_P384: &str = "ecdsa-sha2-nistp384 AAAAE2VjZHNhLXNoYTItbmlzdHAzODQAAAAIbmlzdHAzODQAAABhBChjaVdBCimII7PyK3Wk7Hf4TmHdHGwatIETsDuPURxPJzKSMdVegzGROUdifN1lmfzgZmJQu9nVTSl1voX7f6iHp4cRc7rq9XFSLDUncmP6tt7t7FTSMd5gc213nHqS1g==";
    const ECDSA_P384_SHA256: &str = "SHA256:Lu5+n1KSPk1+2y99/osD3w1kGu78DIXdpSSjKHU4njc";
    const RSA: &str = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQDLHatPtaygciV1lTRq/PHiz2qxn1xaPTL3AwLutxsfBWVEjNvsj4/bgGtbyvRxvfnbYjEYLj6maOG/X8AmmSkR3A2UhRIZ8SJXTT0dtd36m3vjRbA302zHhtS7bflYIZMPRLJ54uUwy8aJnR9C8qkGvgPvccgBOVWiHrz1CXsoVr5u61A8qCJ3TGk97vOOaRL41dppaJjSwfbmXjAkZe6NgyM6lAXE7E1VPckWdC44wo+6UAoBlInzjYz/jFRNp9Pmguuy/NH60SRQyYckb1UYeA1H993Mf4dSfLDLgf1JUsxMpvcbM3akfgFns/CHQxCsgTLO6lTjzDALSr4MmIDd rsa";
    const RSA_SHA256: &str = "SHA256:ZJWKYCGdwdAMsDCJQOoR7Z9VcuinMPLP9acRcDh3Zv0";

    /// DSA: OpenSSH has not offered it by default since 7.0.
    const DSA: &str = "ssh-dss AAAAB3NzaC1kc3MAAACBANnRq//GyiiGaVOlQxqmVp32t/xD73+xcQ4eCppz8fJsJ29jCCXoyaL4m/SnECqa2YtRzIXFMrM9KegkgmIUu8G5njjp6NRZqSIvpPivpuJ5ROWj2f0Wvx8rufAZe/fyLLC3FhCITjwwKhWCE+EttHFsFhX+NQF/y2mZ1dQGfw79AAAAFQCG5xo4YfoePCUIHvuMw8hrKd0ObQAAAIAl/u3FNZHnXhpzdKliZU4ipFtozxiYpGjSyq8Ath0NQ8e+wf+OlBV4nlw/kuM0H9cQvxpEDjdHdhbB9f0lwHk3PkDJ28Iu4NbjDSI8HHQk6goraOGZgQEFgYzBac9idhfz/hhedwCEe/gh2OLThYTz4V6VqARsTFGcbvJSxgf/hwAAAIAyK2bNidY3ogjBvL4Ehn1FK5EWX4KdNQd4r2c/IV1uq3AOqwhwxRqvoCQJXPG1KV0DKMWwIB/oiG3roZTW8daEdo8/2MegCtYKLtW3UZgxBX8uBwlDSxgEbXEe0kJUfLXFFCYpPnvjr2N8JWjk6U7cBnDidLHhoEqkkTwuH7xw0A== dsa";

    fn without_comment(line: &str) -> String {
        line.split(' ').take(2).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn fingerprints_are_what_ssh_keygen_prints() {
        for (line, fingerprint, algorithm) in [
            (ED25519, ED25519_SHA256, "ssh-ed25519"),
            (ECDSA_P256, ECDSA_P256_SHA256, "ecdsa-sha2-nistp256"),
            (ECDSA_P384, ECDSA_P384_SHA256, "ecdsa-sha2-nistp384"),
            (RSA, RSA_SHA256, "ssh-rsa"),
        ] {
            let key: HostKey = line.parse().unwrap();
            assert_eq!(key.fingerprint(), fingerprint, "{line}");
            assert_eq!(key.algorithm(), algorithm);
            // Display drops the comment, and reads back as the same key.
            assert_eq!(key.to_string(), without_comment(line));
            assert_eq!(key.to_string().parse::<HostKey>().unwrap(), key);
        }
    }

    #[test]
    fn the_comment_and_surrounding_space_are_not_part_of_the_key() {
        let pasted = format!("  {}  another comment\n", without_comment(ED25519));
        assert_eq!(pasted.parse::<HostKey>().unwrap(), ED25519.parse::<HostKey>().unwrap());
        assert_ne!(ED25519.parse::<HostKey>().unwrap(), RSA.parse::<HostKey>().unwrap());
    }

    #[test]
    fn garbage_is_refused_with_what_is_wrong() {
        let err = |s: &str| s.parse::<HostKey>().unwrap_err();
        assert_eq!(err(""), HostKeyError::Empty);
        assert_eq!(err(" \n "), HostKeyError::Empty);
        assert_eq!(err(&format!("{ED25519}\n{RSA}")), HostKeyError::MultipleLines);
        let private = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUA\n";
        assert_eq!(err(private), HostKeyError::PrivateKey);
        assert!(!err(private).to_string().contains("b3Blbn"), "the error repeats the key");
        assert_eq!(err(DSA), HostKeyError::UnsupportedAlgorithm("ssh-dss".into()));
        for garbage in [
            "hello",
            "ssh-ed25519",
            "ssh-ed25519 not-base64!!",
            // The algorithm says ed25519, the blob is an RSA key.
            &format!("ssh-ed25519 {}", RSA.split(' ').nth(1).unwrap()),
            // The blob cut short.
            &ED25519[..60],
            "SHA256:t6d8j15eRbRn9Rf4ubBEjXKgM19vUQJ2ncv6llQPJdg",
        ] {
            assert!(
                matches!(
                    err(garbage),
                    HostKeyError::Malformed(_) | HostKeyError::UnsupportedAlgorithm(_)
                ),
                "{garbage:?} was {:?}",
                garbage.parse::<HostKey>()
            );
        }
    }

    #[test]
    fn a_pin_accepts_its_key_only_and_names_both_fingerprints() {
        let ed: HostKey = ED25519.parse().unwrap();
        let rsa: HostKey = RSA.parse().unwrap();
        assert_eq!(HostKeyPolicy::Pinned(ed.clone()).check(&ed), Ok(()));
        assert_eq!(HostKeyPolicy::TrustOnFirstUse.check(&rsa), Ok(()));
        let mismatch = HostKeyPolicy::Pinned(ed).check(&rsa).unwrap_err();
        assert_eq!(
            mismatch.to_string(),
            format!("the server's host key is {RSA_SHA256}, not the pinned {ED25519_SHA256}")
        );
    }
}
