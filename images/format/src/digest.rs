use std::fmt;
use std::str::FromStr;

/// A SHA-256 digest. Written `sha256:<64 lowercase hex>`; that is also the only form
/// [`FromStr`] accepts, so a digest that parses is one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest([u8; 32]);

/// Why a text is not a digest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestError {
    #[error("a digest is written sha256:<64 hex digits>; {0:?} does not start with sha256:")]
    Algorithm(String),
    #[error("a SHA-256 digest has 64 hex digits, not {0}")]
    Length(usize),
    #[error("{0:?} is not a hex digit (0-9, a-f)")]
    NotHex(char),
}

impl Digest {
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The 64 hex digits alone, without `sha256:` (e.g. a file name). Upper case is refused,
    /// not folded: a digest has one spelling, so two spellings never name two cache entries.
    pub fn from_hex(hex: &str) -> Result<Self, DigestError> {
        if let Some(c) = hex.chars().find(|c| !matches!(c, '0'..='9' | 'a'..='f')) {
            return Err(DigestError::NotHex(c));
        }
        if hex.len() != 64 {
            return Err(DigestError::Length(hex.len()));
        }
        let mut bytes = [0; 32];
        hex::decode_to_slice(hex, &mut bytes).expect("64 checked hex digits");
        Ok(Self(bytes))
    }

    /// The 64 lowercase hex digits.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl FromStr for Digest {
    type Err = DigestError;
    fn from_str(s: &str) -> Result<Self, DigestError> {
        let hex = s.strip_prefix("sha256:").ok_or_else(|| DigestError::Algorithm(s.to_owned()))?;
        Self::from_hex(hex)
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn parses_and_prints_one_spelling() {
        let d: Digest = format!("sha256:{EMPTY}").parse().unwrap();
        assert_eq!(d.to_string(), format!("sha256:{EMPTY}"));
        assert_eq!(d.hex(), EMPTY);
        assert_eq!(Digest::from_hex(EMPTY), Ok(d));
    }

    #[test]
    fn says_what_is_wrong() {
        assert_eq!("md5:00".parse::<Digest>(), Err(DigestError::Algorithm("md5:00".into())));
        assert_eq!(EMPTY.parse::<Digest>(), Err(DigestError::Algorithm(EMPTY.into())));
        assert_eq!(Digest::from_hex(&EMPTY[1..]), Err(DigestError::Length(63)));
        assert_eq!(Digest::from_hex(&EMPTY.to_uppercase()), Err(DigestError::NotHex('E')));
        assert_eq!(Digest::from_hex("../../etc/passwd"), Err(DigestError::NotHex('.')));
        assert_eq!(Digest::from_hex(""), Err(DigestError::Length(0)));
        // A multi-byte character is a bad digit, not a slicing panic.
        assert_eq!(Digest::from_hex(&format!("é{}", &EMPTY[2..])), Err(DigestError::NotHex('é')));
    }
}
