//! Ethernet MAC addresses: how hosts are identified on the boot path.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A 48-bit Ethernet MAC address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MacAddr([u8; 6]);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a MAC address (expected six hex pairs separated by ':' or '-')")]
pub struct InvalidMac(pub String);

impl MacAddr {
    pub const fn new(bytes: [u8; 6]) -> Self {
        Self(bytes)
    }

    /// The MAC of an Ethernet DHCP client hardware address (`chaddr` with `hlen` = 6).
    pub fn from_chaddr(chaddr: &[u8]) -> Option<Self> {
        chaddr.get(..6)?.try_into().ok().map(Self)
    }

    pub fn octets(&self) -> [u8; 6] {
        self.0
    }

    /// `aa-bb-cc-dd-ee-ff`: the form used in URLs and file names (no ':' to escape).
    pub fn hyphenated(&self) -> String {
        self.to_string().replace(':', "-")
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl fmt::Debug for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for MacAddr {
    type Err = InvalidMac;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidMac(s.to_owned());
        let separator = if s.contains('-') { '-' } else { ':' };
        let mut bytes = [0u8; 6];
        let mut parts = s.split(separator);
        for byte in &mut bytes {
            let part = parts.next().ok_or_else(invalid)?;
            if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(invalid());
            }
            *byte = u8::from_str_radix(part, 16).map_err(|_| invalid())?;
        }
        if parts.next().is_some() {
            return Err(invalid());
        }
        Ok(Self(bytes))
    }
}

impl Serialize for MacAddr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MacAddr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_separators_and_prints_canonically() {
        let mac: MacAddr = "52:54:00:AB:cd:0f".parse().unwrap();
        assert_eq!(mac.to_string(), "52:54:00:ab:cd:0f");
        assert_eq!(mac.hyphenated(), "52-54-00-ab-cd-0f");
        assert_eq!("52-54-00-ab-cd-0f".parse::<MacAddr>().unwrap(), mac);
    }

    #[test]
    fn rejects_malformed() {
        for s in [
            "",
            "52:54:00:ab:cd",
            "52:54:00:ab:cd:0f:11",
            "5:54:00:ab:cd:0f",
            "zz:54:00:ab:cd:0f",
            "52:54-00:ab:cd:0f",
            "+5:54:00:ab:cd:0f",
        ] {
            assert!(s.parse::<MacAddr>().is_err(), "{s:?}");
        }
    }
}
