//! `spec.bmc.address`, parsed once into what the driver needs: how to reach the BMC and which
//! system it manages. `redfish+https://host[:port]/redfish/v1/Systems/<id>` (`redfish://` is the
//! same), or `redfish+http://...` for a BMC without TLS: plain HTTP only when the address says
//! so, since the credentials travel in every request.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// How the BMC is spoken to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Https,
    /// Only when the address says `redfish+http://`.
    Http,
}

/// A Redfish BMC and the system on it that is the host. Two spellings of one address (the
/// scheme's aliases, a default port, a trailing slash, a DNS name's case, an IPv6 address's
/// zeros) parse equal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedfishAddress {
    pub transport: Transport,
    /// A DNS name, an IPv4 address, or an IPv6 address (without brackets).
    pub host: String,
    pub port: u16,
    /// `/redfish/v1/Systems/<id>`, without a trailing slash.
    pub system: String,
}

/// Why an address is not one siteboot can drive.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("spec.bmc.address {address:?}: {why}")]
pub struct AddressError {
    pub address: String,
    pub why: &'static str,
}

const SYSTEMS: &str = "/redfish/v1/Systems/";

impl FromStr for RedfishAddress {
    type Err = AddressError;

    fn from_str(address: &str) -> Result<Self, Self::Err> {
        let fail = |why| AddressError { address: address.to_owned(), why };
        let (scheme, rest) =
            address.split_once("://").ok_or(fail("no scheme (redfish+https://...)"))?;
        let transport = match scheme {
            "redfish" | "redfish+https" => Transport::Https,
            "redfish+http" => Transport::Http,
            _ => return Err(fail("the scheme is not redfish, redfish+https or redfish+http")),
        };
        let (authority, path) = rest.split_at(rest.find('/').ok_or(fail("no system path"))?);
        if authority.contains('@') {
            return Err(fail("credentials do not belong in the address"));
        }
        let (host, port) = split_host_port(authority).ok_or(fail("not host[:port]"))?;
        let port = match (port, transport) {
            (Some(port), _) => {
                port.parse().map_err(|_| fail("the port is not a number up to 65535"))?
            }
            (None, Transport::Https) => 443,
            (None, Transport::Http) => 80,
        };
        let valid_host = !host.is_empty()
            && (host.parse::<IpAddr>().is_ok()
                || host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'));
        if !valid_host {
            return Err(fail("the host is not a DNS name or an IP address"));
        }
        let path = path.strip_suffix('/').unwrap_or(path);
        let id =
            path.strip_prefix(SYSTEMS).ok_or(fail("the path is not /redfish/v1/Systems/<id>"))?;
        let valid_id =
            !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !valid_id {
            return Err(fail("the system id is not letters, digits, '-', '_' and '.'"));
        }
        // One spelling per BMC, so that addresses compare equal when they name the same one.
        let host = match host.parse::<IpAddr>() {
            Ok(ip) => ip.to_string(),
            Err(_) => host.to_ascii_lowercase(),
        };
        Ok(Self { transport, host, port, system: path.to_owned() })
    }
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn split_host_port(authority: &str) -> Option<(&str, Option<&str>)> {
    if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        return match after {
            "" => Some((host, None)),
            _ => Some((host, Some(after.strip_prefix(':')?))),
        };
    }
    match authority.split_once(':') {
        Some((host, port)) => Some((host, Some(port))),
        None => Some((authority, None)),
    }
}

impl RedfishAddress {
    /// `host:port` for the Host header and messages (IPv6 in brackets).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for RedfishAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.transport {
            Transport::Https => "redfish+https",
            Transport::Http => "redfish+http",
        };
        write!(f, "{scheme}://{}{}", self.authority(), self.system)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<RedfishAddress, &'static str> {
        s.parse::<RedfishAddress>().map_err(|e| e.why)
    }

    #[test]
    fn https_is_the_default_and_the_port_defaults_by_transport() {
        let a = parse("redfish://bmc-1.example/redfish/v1/Systems/1").unwrap();
        assert_eq!(a.transport, Transport::Https);
        assert_eq!(
            (a.host.as_str(), a.port, a.system.as_str()),
            ("bmc-1.example", 443, "/redfish/v1/Systems/1")
        );
        let a = parse("redfish+http://10.0.0.5/redfish/v1/Systems/abc/").unwrap();
        assert_eq!(
            (a.transport, a.port, a.system.as_str()),
            (Transport::Http, 80, "/redfish/v1/Systems/abc")
        );
    }

    #[test]
    fn ports_and_ipv6_are_parsed() {
        let a = parse("redfish+https://127.0.0.1:8000/redfish/v1/Systems/0b5a-11").unwrap();
        assert_eq!((a.host.as_str(), a.port), ("127.0.0.1", 8000));
        assert_eq!(a.to_string(), "redfish+https://127.0.0.1:8000/redfish/v1/Systems/0b5a-11");
        let a = parse("redfish+https://[fd00::1]:8443/redfish/v1/Systems/1").unwrap();
        assert_eq!(
            (a.host.as_str(), a.port, a.authority()),
            ("fd00::1", 8443, "[fd00::1]:8443".into())
        );
    }

    #[test]
    fn spellings_of_one_address_parse_equal() {
        let one = parse("redfish+https://bmc-1.example/redfish/v1/Systems/1").unwrap();
        assert_eq!(parse("redfish://BMC-1.Example:443/redfish/v1/Systems/1/"), Ok(one));
        let v6 = parse("redfish+https://[fd00::1]/redfish/v1/Systems/1").unwrap();
        assert_eq!(parse("redfish://[FD00:0:0::0001]:443/redfish/v1/Systems/1"), Ok(v6));
        let other_system = parse("redfish+https://bmc-1.example/redfish/v1/Systems/A").unwrap();
        assert_ne!(parse("redfish+https://bmc-1.example/redfish/v1/Systems/a"), Ok(other_system));
    }

    #[test]
    fn what_is_not_an_address_says_why() {
        assert_eq!(parse("10.0.0.5/redfish/v1/Systems/1"), Err("no scheme (redfish+https://...)"));
        assert_eq!(
            parse("ipmi://10.0.0.5/redfish/v1/Systems/1"),
            Err("the scheme is not redfish, redfish+https or redfish+http")
        );
        assert_eq!(parse("redfish://10.0.0.5"), Err("no system path"));
        assert_eq!(
            parse("redfish://admin:pw@10.0.0.5/redfish/v1/Systems/1"),
            Err("credentials do not belong in the address")
        );
        assert_eq!(
            parse("redfish://h:99999/redfish/v1/Systems/1"),
            Err("the port is not a number up to 65535")
        );
        assert_eq!(
            parse("redfish://h/redfish/v1/Managers/1"),
            Err("the path is not /redfish/v1/Systems/<id>")
        );
        assert_eq!(
            parse("redfish://h/redfish/v1/Systems/"),
            Err("the path is not /redfish/v1/Systems/<id>")
        );
        assert_eq!(
            parse("redfish://h/redfish/v1/Systems/1/Actions"),
            Err("the system id is not letters, digits, '-', '_' and '.'")
        );
        assert_eq!(
            parse("redfish://h_x/redfish/v1/Systems/1"),
            Err("the host is not a DNS name or an IP address")
        );
    }
}
