//! Where clients reach this appliance: the address advertised over DHCP and the URLs built on it.

use std::net::Ipv4Addr;

use crate::MacAddr;
use crate::tls::Fingerprint;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    /// The server address clients are told about (DHCP server id, next-server, HTTP host).
    pub address: Ipv4Addr,
    pub http_port: u16,
}

impl Endpoints {
    /// `http://<address>:<port>`, with no trailing slash.
    pub fn http_base(&self) -> String {
        format!("http://{}:{}", self.address, self.http_port)
    }

    /// The per-host iPXE script.
    pub fn script_url(&self, mac: MacAddr) -> String {
        format!("{}/boot/{}.ipxe", self.http_base(), mac.hyphenated())
    }

    /// A file under the HTTP root; `path` is relative and already checked by the caller.
    pub fn file_url(&self, path: &str) -> String {
        format!("{}/files/{}", self.http_base(), path.trim_start_matches('/'))
    }

    /// An image of the image cache, by its SHA-256 (hex).
    pub fn image_url(&self, sha256_hex: &str) -> String {
        format!("{}/images/sha256/{}", self.http_base(), sha256_hex)
    }

    /// An iPXE binary, for UEFI HTTP boot clients.
    pub fn ipxe_binary_url(&self, name: &str) -> String {
        format!("{}/ipxe/{}", self.http_base(), name)
    }
}

/// Where the deploy ramdisk reaches the agent API over HTTPS, and the certificate it pins there
/// (both go on its kernel command line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentEndpoint {
    pub address: Ipv4Addr,
    pub port: u16,
    pub fingerprint: Fingerprint,
}

impl AgentEndpoint {
    /// `https://<address>:<port>`, with no trailing slash; the API is under `/agent/`.
    pub fn base_url(&self) -> String {
        format!("https://{}:{}", self.address, self.port)
    }
}
