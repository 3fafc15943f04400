//! Relay agent information (DHCP option 82, RFC 3046) and the per-host pins checked against it.
//!
//! A relay that inserts option 82 says where a client's broadcast came in: the circuit-id
//! (sub-option 1, usually its port, `eth1/0/12`) and the remote-id (sub-option 2, usually the
//! relay or switch itself). Both are opaque bytes. A host pinned to them ([`RelayPin`]) is
//! answered through a relay only when the relay says exactly that: a machine on another port of
//! the same relay that forges the host's MAC gets nothing.
//!
//! Values are written one way everywhere (config, Host objects, logs, the lease file): as text
//! when every byte is printable ASCII (`eth1/0/12`), else `hex:` and two hex digits a byte
//! (`hex:000c29a1b2c3`). Either form is read; a value that is text but starts with `hex:` must
//! be written in hex.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The circuit-id sub-option of option 82.
const CIRCUIT_ID: u8 = 1;
/// The remote-id sub-option of option 82.
const REMOTE_ID: u8 = 2;
/// The prefix of the hex form.
const HEX: &str = "hex:";
/// A sub-option's length is one byte.
pub const MAX_LEN: usize = 255;

/// One relay agent sub-option's value: 1 to [`MAX_LEN`] bytes, compared exactly. Read from and
/// shown as text (printable ASCII) or `hex:...` (see the module documentation).
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AgentId(Vec<u8>);

/// Why a written [`AgentId`] is not one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentIdError {
    Empty,
    TooLong,
    /// `hex:` not followed by pairs of hex digits.
    NotHex,
    /// Text with a byte that is not printable ASCII.
    NotPrintable,
}

impl fmt::Display for AgentIdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Empty => "empty: a relay agent sub-option to match has at least one byte",
            Self::TooLong => "longer than a relay agent sub-option (255 bytes)",
            Self::NotHex => "hex: must be followed by two hex digits per byte (hex:0a0b...)",
            Self::NotPrintable => {
                "text is printable ASCII only: write other bytes as hex: and two hex digits per byte"
            }
        })
    }
}

impl std::error::Error for AgentIdError {}

impl AgentId {
    /// A value as a relay sent it; `None` if empty or longer than a sub-option holds.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        (!bytes.is_empty() && bytes.len() <= MAX_LEN).then(|| Self(bytes.to_vec()))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Whether it is shown as text: printable ASCII that cannot be read as the hex form.
    fn is_text(&self) -> bool {
        self.0.iter().all(|b| (b' '..=b'~').contains(b)) && !self.0.starts_with(HEX.as_bytes())
    }
}

impl FromStr for AgentId {
    type Err = AgentIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bytes = match s.strip_prefix(HEX) {
            Some(digits) => {
                if digits.len() % 2 != 0 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(AgentIdError::NotHex);
                }
                let pairs = digits.as_bytes().chunks(2);
                let byte = |pair: &[u8]| {
                    let text = std::str::from_utf8(pair).expect("ASCII hex digits");
                    u8::from_str_radix(text, 16).expect("two hex digits")
                };
                pairs.map(byte).collect()
            }
            None if !s.bytes().all(|b| (b' '..=b'~').contains(&b)) => {
                return Err(AgentIdError::NotPrintable);
            }
            None => s.as_bytes().to_vec(),
        };
        match bytes.len() {
            0 => Err(AgentIdError::Empty),
            n if n > MAX_LEN => Err(AgentIdError::TooLong),
            _ => Ok(Self(bytes)),
        }
    }
}

impl TryFrom<String> for AgentId {
    type Error = AgentIdError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<AgentId> for String {
    fn from(id: AgentId) -> Self {
        id.to_string()
    }
}

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_text() {
            // Printable ASCII: one byte, one char.
            return f.write_str(std::str::from_utf8(&self.0).expect("ASCII"));
        }
        f.write_str(HEX)?;
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

/// What a relay said about a message it relayed: option 82's circuit-id and remote-id. Other
/// sub-options are left out (pins do not name them); so is a sub-option that is ambiguous
/// (sent twice) or empty, and everything when the option is malformed (a sub-option runs past
/// its end): what the relay vouches for must be read one way only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayAgentInfo {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub circuit_id: Option<AgentId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_id: Option<AgentId>,
}

impl RelayAgentInfo {
    /// Reads option 82's value, as received (its parts joined, RFC 3396): sub-options of a
    /// code byte, a length byte and the value.
    pub fn parse(option: &[u8]) -> Self {
        let mut found: [Vec<&[u8]>; 2] = [Vec::new(), Vec::new()];
        let mut rest = option;
        while let [code, len, tail @ ..] = rest {
            let Some(value) = tail.get(..usize::from(*len)) else {
                return Self::default();
            };
            if let CIRCUIT_ID | REMOTE_ID = *code {
                found[usize::from(*code - 1)].push(value);
            }
            rest = &tail[value.len()..];
        }
        if !rest.is_empty() {
            // A code byte with no length: malformed.
            return Self::default();
        }
        let one = |values: &[&[u8]]| match values {
            [value] => AgentId::from_bytes(value),
            _ => None,
        };
        Self { circuit_id: one(&found[0]), remote_id: one(&found[1]) }
    }

    pub fn is_empty(&self) -> bool {
        self.circuit_id.is_none() && self.remote_id.is_none()
    }
}

impl fmt::Display for RelayAgentInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("no circuit-id or remote-id");
        }
        describe(f, &self.circuit_id, &self.remote_id)
    }
}

fn describe(
    f: &mut fmt::Formatter<'_>,
    circuit_id: &Option<AgentId>,
    remote_id: &Option<AgentId>,
) -> fmt::Result {
    let parts = [("circuit-id", circuit_id), ("remote-id", remote_id)];
    let named: Vec<String> =
        parts.iter().filter_map(|(name, id)| Some(format!("{name} {}", id.as_ref()?))).collect();
    f.write_str(&named.join(", "))
}

/// A host's pin: the relay agent information a relayed message for its MAC must carry to be
/// answered, every pinned sub-option with exactly these bytes (other sub-options may come
/// too). At least one sub-option, except in [`unmatchable`](Self::unmatchable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RelayPinFields")]
pub struct RelayPin {
    circuit_id: Option<AgentId>,
    remote_id: Option<AgentId>,
}

/// A pin as written: `{circuit_id: ..., remote_id: ...}`, either or both.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RelayPinFields {
    circuit_id: Option<AgentId>,
    remote_id: Option<AgentId>,
}

impl TryFrom<RelayPinFields> for RelayPin {
    type Error = &'static str;

    fn try_from(fields: RelayPinFields) -> Result<Self, Self::Error> {
        Self::new(fields.circuit_id, fields.remote_id)
    }
}

impl RelayPin {
    pub fn new(
        circuit_id: Option<AgentId>,
        remote_id: Option<AgentId>,
    ) -> Result<Self, &'static str> {
        if circuit_id.is_none() && remote_id.is_none() {
            return Err("a relay agent pin names circuit_id, remote_id or both");
        }
        Ok(Self { circuit_id, remote_id })
    }

    /// A pin no relay matches: for a host whose pin cannot be read (it fails closed).
    pub fn unmatchable() -> Self {
        Self { circuit_id: None, remote_id: None }
    }

    pub fn circuit_id(&self) -> Option<&AgentId> {
        self.circuit_id.as_ref()
    }

    pub fn remote_id(&self) -> Option<&AgentId> {
        self.remote_id.as_ref()
    }

    /// The relay agent information this pin names: of what a relay it admits said, the
    /// sub-options it pins. What a lease granted through such a relay keeps: the operator's
    /// values, never more of what a relay sent.
    pub fn as_info(&self) -> RelayAgentInfo {
        RelayAgentInfo { circuit_id: self.circuit_id.clone(), remote_id: self.remote_id.clone() }
    }

    /// Whether a relay that said `info` vouches for this host: every pinned sub-option is
    /// there with exactly the pinned bytes. The one rule, for answering a relayed message and
    /// for a relayed lease to count as identity.
    pub fn admits(&self, info: &RelayAgentInfo) -> bool {
        let pairs = [(&self.circuit_id, &info.circuit_id), (&self.remote_id, &info.remote_id)];
        let pinned = pairs.iter().filter(|(pin, _)| pin.is_some());
        let mut pinned = pinned.peekable();
        pinned.peek().is_some() && pinned.all(|(pin, said)| pin == said)
    }
}

impl fmt::Display for RelayPin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.circuit_id.is_none() && self.remote_id.is_none() {
            return f.write_str("a pin that cannot be read (nothing matches it)");
        }
        describe(f, &self.circuit_id, &self.remote_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> AgentId {
        s.parse().unwrap()
    }

    #[test]
    fn agent_ids_are_text_or_hex_and_shown_one_way() {
        assert_eq!(id("eth1/0/12").as_bytes(), b"eth1/0/12");
        assert_eq!(id("hex:000C29a1").as_bytes(), [0, 0x0c, 0x29, 0xa1]);
        assert_eq!(id("sw 1").as_bytes(), b"sw 1", "spaces are text");
        // Shown as text when printable, else in hex; either way read back the same.
        for (written, shown) in [
            ("eth1/0/12", "eth1/0/12"),
            ("hex:6574683121", "eth1!"),
            ("hex:000c29a1", "hex:000c29a1"),
            ("hex:6865783a3031", "hex:6865783a3031"), // the text "hex:01"
            ("hex:0a", "hex:0a"),
        ] {
            assert_eq!(id(written).to_string(), shown, "{written}");
            assert_eq!(id(shown), id(written), "{shown}");
        }
        assert_eq!(id(&"x".repeat(255)).as_bytes().len(), 255);
        assert_eq!(id(&format!("hex:{}", "ab".repeat(255))).as_bytes().len(), 255);
        for (bad, why) in [
            ("", AgentIdError::Empty),
            ("hex:", AgentIdError::Empty),
            ("hex:0", AgentIdError::NotHex),
            ("hex:0g", AgentIdError::NotHex),
            ("hex:0a 0b", AgentIdError::NotHex),
            ("hex:+a", AgentIdError::NotHex),
            ("eth1/0/12\n", AgentIdError::NotPrintable),
            ("port\u{e9}", AgentIdError::NotPrintable),
            ("\u{1b}[31m", AgentIdError::NotPrintable),
        ] {
            assert_eq!(bad.parse::<AgentId>(), Err(why), "{bad:?}");
        }
        assert_eq!("x".repeat(256).parse::<AgentId>(), Err(AgentIdError::TooLong));
        let long_hex = format!("hex:{}", "ab".repeat(256));
        assert_eq!(long_hex.parse::<AgentId>(), Err(AgentIdError::TooLong));
        assert_eq!(AgentId::from_bytes(b""), None);
        assert_eq!(AgentId::from_bytes(&[0; 256]), None);
    }

    #[test]
    fn pins_are_read_from_config_with_at_least_one_sub_option() {
        let read = |json: &str| serde_json::from_str::<RelayPin>(json).map_err(|e| e.to_string());
        let pin = read(r#"{"circuit_id": "eth1/0/12"}"#).unwrap();
        assert_eq!((pin.circuit_id(), pin.remote_id()), (Some(&id("eth1/0/12")), None));
        let pin = read(r#"{"circuit_id": "eth1/0/12", "remote_id": "hex:000c29a1b2c3"}"#).unwrap();
        assert_eq!(pin.remote_id(), Some(&id("hex:000c29a1b2c3")));
        assert_eq!(pin.to_string(), "circuit-id eth1/0/12, remote-id hex:000c29a1b2c3");
        for (bad, says) in [
            ("{}", "names circuit_id, remote_id or both"),
            (r#"{"circuit_id": ""}"#, "empty"),
            (r#"{"remote_id": "hex:xyz"}"#, "hex: must be followed"),
            (r#"{"circuit": "eth1"}"#, "unknown field"),
        ] {
            let error = read(bad).unwrap_err();
            assert!(error.contains(says), "{bad}: {error}");
        }
    }

    /// Option 82 as a relay sends it: sub-options of a code, a length and the value.
    fn option(sub_options: &[(u8, &[u8])]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for (code, value) in sub_options {
            bytes.extend_from_slice(&[*code, value.len() as u8]);
            bytes.extend_from_slice(value);
        }
        bytes
    }

    #[test]
    fn option_82_is_read_one_way_only() {
        let info = |subs: &[(u8, &[u8])]| RelayAgentInfo::parse(&option(subs));
        let both = info(&[(1, b"eth1/0/12"), (9, &[0, 0, 0, 9, 1, 0]), (2, &[0, 0x0c, 0x29])]);
        assert_eq!(both.circuit_id, Some(id("eth1/0/12")));
        assert_eq!(both.remote_id, Some(id("hex:000c29")));
        assert_eq!(both.to_string(), "circuit-id eth1/0/12, remote-id hex:000c29");
        assert_eq!(info(&[(2, b"sw-7")]).circuit_id, None);
        // Sent twice: which one would the relay stand behind? Neither.
        let twice = info(&[(1, b"eth1/0/12"), (1, b"eth1/0/13"), (2, b"sw-7")]);
        assert_eq!((twice.circuit_id, twice.remote_id), (None, Some(id("sw-7"))));
        assert_eq!(info(&[(1, b"")]), RelayAgentInfo::default(), "empty");
        // Malformed: a sub-option running past the end, or a code with no length.
        let mut past_end = option(&[(1, b"eth1/0/12")]);
        past_end.extend_from_slice(&[2, 10, b'x']);
        assert_eq!(RelayAgentInfo::parse(&past_end), RelayAgentInfo::default());
        let mut dangling = option(&[(1, b"eth1/0/12")]);
        dangling.push(2);
        assert_eq!(RelayAgentInfo::parse(&dangling), RelayAgentInfo::default());
        assert_eq!(RelayAgentInfo::parse(&[]), RelayAgentInfo::default());
        assert_eq!(RelayAgentInfo::default().to_string(), "no circuit-id or remote-id");
    }

    #[test]
    fn a_pin_admits_exactly_its_sub_options() {
        let info = |subs: &[(u8, &[u8])]| RelayAgentInfo::parse(&option(subs));
        let circuit = RelayPin::new(Some(id("eth1/0/12")), None).unwrap();
        let both = RelayPin::new(Some(id("eth1/0/12")), Some(id("hex:000c29"))).unwrap();
        let right_port = info(&[(1, b"eth1/0/12")]);
        let right_both = info(&[(1, b"eth1/0/12"), (2, &[0, 0x0c, 0x29])]);
        let cases = [
            (&circuit, right_port.clone(), true),
            (&circuit, right_both.clone(), true),
            (&circuit, info(&[(9, b"vendor"), (1, b"eth1/0/12"), (2, b"x")]), true),
            (&circuit, info(&[(1, b"eth1/0/13")]), false),
            (&circuit, info(&[(1, b"eth1/0/1")]), false),
            (&circuit, info(&[(1, b"eth1/0/120")]), false),
            (&circuit, info(&[(1, b"ETH1/0/12")]), false),
            (&circuit, info(&[(2, b"eth1/0/12")]), false),
            (&circuit, info(&[(1, b"eth1/0/12"), (1, b"eth1/0/12")]), false),
            (&circuit, RelayAgentInfo::default(), false),
            (&both, right_both, true),
            (&both, right_port, false),
            (&both, info(&[(1, b"eth1/0/12"), (2, &[0, 0x0c, 0x2a])]), false),
            (&both, info(&[(2, &[0, 0x0c, 0x29])]), false),
        ];
        for (pin, said, admitted) in cases {
            assert_eq!(pin.admits(&said), admitted, "{pin} vs {said}");
        }
        // What a lease keeps of what an admitted relay said: the pinned sub-options.
        assert_eq!(circuit.as_info(), info(&[(1, b"eth1/0/12")]));
        assert!(circuit.admits(&circuit.as_info()) && both.admits(&both.as_info()));
        let unmatchable = RelayPin::unmatchable();
        assert!(!unmatchable.admits(&info(&[(1, b"eth1/0/12"), (2, b"sw")])));
        assert!(!unmatchable.admits(&RelayAgentInfo::default()));
    }

    /// The lease file keeps what the relay said, in the same form.
    #[test]
    fn relay_agent_information_is_stored_as_written() {
        let info =
            RelayAgentInfo { circuit_id: Some(id("eth1/0/12")), remote_id: Some(id("hex:00ff")) };
        let json = serde_json::to_string(&info).unwrap();
        assert_eq!(json, r#"{"circuit_id":"eth1/0/12","remote_id":"hex:00ff"}"#);
        assert_eq!(serde_json::from_str::<RelayAgentInfo>(&json).unwrap(), info);
        assert_eq!(serde_json::to_string(&RelayAgentInfo::default()).unwrap(), "{}");
    }
}
