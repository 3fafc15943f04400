//! TFTP packets (RFC 1350) and option extension (RFC 2347), parsed without trusting any length.

use std::fmt;

pub const OP_RRQ: u16 = 1;
pub const OP_WRQ: u16 = 2;
pub const OP_DATA: u16 = 3;
pub const OP_ACK: u16 = 4;
pub const OP_ERROR: u16 = 5;
pub const OP_OACK: u16 = 6;

/// Options accepted in one request; more is a malformed (or hostile) request.
const MAX_OPTIONS: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferMode {
    Octet,
    /// Served byte for byte like octet: every boot file is binary, and clients asking for
    /// netascii of a binary would get it mangled anyway.
    Netascii,
}

/// A request: RRQ or WRQ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request<'a> {
    pub write: bool,
    pub filename: &'a str,
    pub mode: TransferMode,
    /// Option names lower-cased by the caller's comparisons; values as sent.
    pub options: Vec<(&'a str, &'a str)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet<'a> {
    Request(Request<'a>),
    Data { block: u16, data: &'a [u8] },
    Ack { block: u16 },
    Error { code: u16, message: &'a str },
    Oack,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    #[error("packet shorter than its opcode and fields")]
    Truncated,
    #[error("unknown opcode {0}")]
    UnknownOpcode(u16),
    #[error("a string field is not NUL-terminated")]
    Unterminated,
    #[error("a string field is not UTF-8")]
    NotUtf8,
    #[error("unsupported transfer mode {0:?}")]
    BadMode(String),
    #[error("more than {MAX_OPTIONS} options")]
    TooManyOptions,
    #[error("option {0:?} has no value")]
    OptionWithoutValue(String),
    #[error("option {0:?} given twice")]
    DuplicateOption(String),
}

pub fn parse(bytes: &[u8]) -> Result<Packet<'_>, PacketError> {
    let (op, body) = split_u16(bytes).ok_or(PacketError::Truncated)?;
    match op {
        OP_RRQ | OP_WRQ => parse_request(op == OP_WRQ, body).map(Packet::Request),
        OP_DATA => {
            let (block, data) = split_u16(body).ok_or(PacketError::Truncated)?;
            Ok(Packet::Data { block, data })
        }
        OP_ACK => {
            let (block, _) = split_u16(body).ok_or(PacketError::Truncated)?;
            Ok(Packet::Ack { block })
        }
        OP_ERROR => {
            let (code, rest) = split_u16(body).ok_or(PacketError::Truncated)?;
            // Be lenient with clients' error text: it is only logged.
            let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
            let message = std::str::from_utf8(&rest[..end]).unwrap_or("<not UTF-8>");
            Ok(Packet::Error { code, message })
        }
        OP_OACK => Ok(Packet::Oack),
        other => Err(PacketError::UnknownOpcode(other)),
    }
}

fn split_u16(bytes: &[u8]) -> Option<(u16, &[u8])> {
    let (head, rest) = bytes.split_at_checked(2)?;
    Some((u16::from_be_bytes([head[0], head[1]]), rest))
}

fn parse_request(write: bool, body: &[u8]) -> Result<Request<'_>, PacketError> {
    let mut fields = Strings(body);
    let filename = fields.next_str()?.ok_or(PacketError::Truncated)?;
    let mode = match fields.next_str()?.ok_or(PacketError::Truncated)? {
        m if m.eq_ignore_ascii_case("octet") => TransferMode::Octet,
        m if m.eq_ignore_ascii_case("netascii") => TransferMode::Netascii,
        other => return Err(PacketError::BadMode(other.to_owned())),
    };
    let mut options: Vec<(&str, &str)> = Vec::new();
    while let Some(name) = fields.next_str()? {
        let value =
            fields.next_str()?.ok_or_else(|| PacketError::OptionWithoutValue(name.to_owned()))?;
        if options.len() == MAX_OPTIONS {
            return Err(PacketError::TooManyOptions);
        }
        if options.iter().any(|(n, _)| n.eq_ignore_ascii_case(name)) {
            return Err(PacketError::DuplicateOption(name.to_owned()));
        }
        options.push((name, value));
    }
    Ok(Request { write, filename, mode, options })
}

/// NUL-terminated strings, one after another.
struct Strings<'a>(&'a [u8]);

impl<'a> Strings<'a> {
    fn next_str(&mut self) -> Result<Option<&'a str>, PacketError> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let end = self.0.iter().position(|b| *b == 0).ok_or(PacketError::Unterminated)?;
        let s = std::str::from_utf8(&self.0[..end]).map_err(|_| PacketError::NotUtf8)?;
        self.0 = &self.0[end + 1..];
        Ok(Some(s))
    }
}

/// TFTP error codes (RFC 1350, 2347).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    NotDefined = 0,
    FileNotFound = 1,
    AccessViolation = 2,
    IllegalOperation = 4,
    UnknownTransferId = 5,
    OptionRefused = 8,
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

pub fn error(code: ErrorCode, message: &str) -> Vec<u8> {
    let mut p = Vec::with_capacity(5 + message.len());
    p.extend_from_slice(&OP_ERROR.to_be_bytes());
    p.extend_from_slice(&(code as u16).to_be_bytes());
    p.extend_from_slice(message.as_bytes());
    p.push(0);
    p
}

pub fn oack(options: &[(&str, String)]) -> Vec<u8> {
    let mut p = OP_OACK.to_be_bytes().to_vec();
    for (name, value) in options {
        p.extend_from_slice(name.as_bytes());
        p.push(0);
        p.extend_from_slice(value.as_bytes());
        p.push(0);
    }
    p
}

/// Writes a DATA header into the first 4 bytes of `buf`.
pub fn data_header(buf: &mut [u8], block: u16) {
    buf[..2].copy_from_slice(&OP_DATA.to_be_bytes());
    buf[2..4].copy_from_slice(&block.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_requests_with_options() {
        let p =
            parse(b"\x00\x01undionly.kpxe\x00octet\x00blksize\x001468\x00tsize\x000\x00").unwrap();
        assert_eq!(
            p,
            Packet::Request(Request {
                write: false,
                filename: "undionly.kpxe",
                mode: TransferMode::Octet,
                options: vec![("blksize", "1468"), ("tsize", "0")],
            })
        );
        assert!(matches!(
            parse(b"\x00\x02f\x00OCTET\x00").unwrap(),
            Packet::Request(Request { write: true, .. })
        ));
    }

    #[test]
    fn rejects_malformed() {
        let cases: [(&[u8], PacketError); 8] = [
            (b"", PacketError::Truncated),
            (b"\x00", PacketError::Truncated),
            (b"\x00\x09", PacketError::UnknownOpcode(9)),
            (b"\x00\x01file", PacketError::Unterminated),
            (b"\x00\x01file\x00", PacketError::Truncated),
            (b"\x00\x01file\x00mail\x00", PacketError::BadMode("mail".into())),
            (
                b"\x00\x01file\x00octet\x00blksize\x00",
                PacketError::OptionWithoutValue("blksize".into()),
            ),
            (
                b"\x00\x01file\x00octet\x00a\x001\x00A\x002\x00",
                PacketError::DuplicateOption("A".into()),
            ),
        ];
        for (bytes, expected) in cases {
            assert_eq!(parse(bytes), Err(expected), "{bytes:?}");
        }
        let mut many = b"\x00\x01f\x00octet\x00".to_vec();
        for i in 0..=MAX_OPTIONS {
            many.extend_from_slice(format!("o{i}\x001\x00").as_bytes());
        }
        assert_eq!(parse(&many), Err(PacketError::TooManyOptions));
        assert_eq!(parse(b"\x00\x01\xff\x00octet\x00"), Err(PacketError::NotUtf8));
        assert_eq!(parse(b"\x00\x04\x00"), Err(PacketError::Truncated));
        assert_eq!(parse(b"\x00\x04\x12\x34").unwrap(), Packet::Ack { block: 0x1234 });
        assert_eq!(
            parse(b"\x00\x05\x00\x01oops").unwrap(),
            Packet::Error { code: 1, message: "oops" }
        );
    }
}
