use std::fmt;
use std::str::FromStr;

/// A certificate's SHA-256, written `sha256:<64 hex digits>`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The fingerprint of a certificate (its DER encoding).
    pub fn of(certificate_der: &[u8]) -> Self {
        use sha2::Digest;
        Self(sha2::Sha256::digest(certificate_der).into())
    }
}

impl FromStr for Fingerprint {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let hex = s.strip_prefix("sha256:").ok_or("must start with sha256:")?;
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(hex, &mut bytes).map_err(|_| "must be 64 hex digits after sha256:")?;
        Ok(Self(bytes))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
