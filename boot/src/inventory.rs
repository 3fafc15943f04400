//! What each host boots. The boot plane asks an [`Inventory`]; the standalone appliance answers
//! from its config file, the Kubernetes mode from its Host cache.

use std::future::Future;
use std::net::Ipv4Addr;
use std::pin::Pin;
use std::sync::Arc;

use siteboot_ipxe::Word;

use crate::MacAddr;
use crate::arp_probe::Unconfirmed;
use crate::dhcp::relay_agent::RelayPin;

/// What a host's iPXE is told to do when it fetches its script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootAction {
    /// Boot a Linux kernel and initrds fetched over HTTP.
    Linux(LinuxBoot),
    /// An operator-written iPXE script, served as it is.
    Script(String),
    /// Leave the network boot and boot the local disk.
    LocalDisk(LocalBoot),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinuxBoot {
    pub kernel: Source,
    pub initrds: Vec<Source>,
    /// Kernel command line, one argument per word. siteboot adds `initrd=`, `siteboot.url=` and
    /// `siteboot.mac=` itself.
    pub cmdline: Vec<Word>,
}

/// Where a kernel or initrd comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A path under the HTTP root, served at `/files/<path>`; already a safe URL path.
    File(Word),
    /// An absolute URL elsewhere.
    Url(Word),
}

/// How to boot the local disk from iPXE. No single method works on every machine, so it is a
/// per-profile choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LocalBoot {
    /// `exit`: hand control back to the firmware, which tries its next boot entry.
    Exit,
    /// `sanboot --drive 0x80`: boot the first disk through the firmware's disk interface.
    Sanboot,
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Asks the segment whether an address is a MAC's now
/// ([`Neighbors::confirm`](crate::neighbors::Neighbors::confirm)): an inventory asks right
/// before it mints a token and before secrets leave, not for every request (an ARP probe
/// takes [`PROBE_DEADLINE`](crate::arp_probe::PROBE_DEADLINE)).
pub trait Confirm: Send + Sync {
    fn confirm(&self, addr: Ipv4Addr, mac: MacAddr) -> BoxFuture<'_, Result<(), Unconfirmed>>;
}

/// The boot plane's [`Confirm`], handed to the inventory with each request.
#[derive(Clone)]
pub struct Segment(pub Arc<dyn Confirm>);

impl Segment {
    pub async fn confirm(&self, addr: Ipv4Addr, mac: MacAddr) -> Result<(), Unconfirmed> {
        self.0.confirm(addr, mac).await
    }
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Segment")
    }
}

/// Who asks for a boot script.
#[derive(Debug, Clone)]
pub struct BootRequest {
    /// The MAC named in the URL.
    pub mac: MacAddr,
    pub remote: Ipv4Addr,
    /// Whether `remote` is the address this appliance knows that MAC by (its DHCP lease, or
    /// the neighbour table). Secrets go only to requests where it is, and the `segment` confirms it.
    pub remote_holds_mac: bool,
    pub segment: Segment,
}

/// A request to `/agent/...`: the deploy ramdisk's API.
#[derive(Debug, Clone)]
pub struct AgentRequest {
    pub method: http::Method,
    /// The path after `/agent/`.
    pub path: String,
    /// The `Authorization: Bearer` token, if any.
    pub token: Option<String>,
    pub remote: Ipv4Addr,
    /// The MAC this appliance knows `remote` by, if any (the tables; secrets leave only once
    /// the `segment` confirms it).
    pub remote_mac: Option<MacAddr>,
    pub segment: Segment,
    pub body: bytes::Bytes,
}

/// A BMC's request for a host's boot media: `GET` or `HEAD` `/media/<key>.iso` on the HTTPS
/// port, the URL the controller inserted as the host's virtual media ([`crate::media`]).
#[derive(Clone)]
pub struct MediaRequest {
    /// The key in the URL: 64 lower-case hex digits, checked before the inventory is asked.
    /// Whoever has it gets the ISO and the token on its command line: it is a secret, and
    /// `Debug` leaves it out.
    pub key: String,
    /// Who asks: the BMC's address, not the host's.
    pub remote: Ipv4Addr,
}

impl std::fmt::Debug for MediaRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MediaRequest")
            .field("key", &"<redacted>")
            .field("remote", &self.remote)
            .finish()
    }
}

#[derive(Debug, Clone)]
pub struct AgentResponse {
    pub status: http::StatusCode,
    pub content_type: &'static str,
    pub body: bytes::Bytes,
}

impl AgentResponse {
    pub fn text(status: http::StatusCode, body: impl Into<String>) -> Self {
        Self { status, content_type: "text/plain", body: bytes::Bytes::from(body.into()) }
    }

    pub fn json(value: &impl serde::Serialize) -> Self {
        Self {
            status: http::StatusCode::OK,
            content_type: "application/json",
            body: bytes::Bytes::from(serde_json::to_vec(value).expect("answers serialize")),
        }
    }
}

/// One host as the status page lists it, to every machine on the segment: what an operator
/// there watches, nothing secret (no tokens, bootstrap data, BMC addresses or credentials) and
/// nothing of its tenant (who claimed it, its image, its operation's id).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HostSummary {
    pub mac: MacAddr,
    /// The operator's name for it: the Host object (`namespace/name`), or its DHCP
    /// reservation's host name (standalone).
    pub name: Option<String>,
    /// Kubernetes mode: the Host's lifecycle state (`Provisioned`, ...); standalone: the boot
    /// profile it gets (`profile <name>`).
    pub state: String,
    /// The address the inventory knows it by, if any (Kubernetes mode: its Host's). The
    /// status page prefers the lease this appliance's DHCP gave it.
    pub address: Option<Ipv4Addr>,
    /// Whether a SitebootMachine holds it (Kubernetes mode); who does stays behind the
    /// Kubernetes API.
    pub claim: Option<Claim>,
    /// The ramdisk operation under way (Kubernetes mode).
    pub operation: Option<OperationSummary>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Claim {
    Claimed,
    Free,
}

/// A ramdisk operation as far as it has reported.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OperationSummary {
    /// `Inspect`, `Provision` or `Deprovision`.
    pub kind: String,
    /// The ramdisk's last progress report, as it wrote it.
    pub step: Option<String>,
    /// Bytes of the image written, as the ramdisk last reported them.
    pub bytes: Option<ByteProgress>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ByteProgress {
    pub done: u64,
    pub total: u64,
}

pub trait Inventory: Send + Sync + 'static {
    /// Whether DHCP gives `mac` boot information at all. Called on the DHCP path, so it must
    /// answer from memory.
    fn boots(&self, mac: MacAddr) -> bool;

    /// Whether `mac` is one of this site's hosts, whatever it boots now: listed in the config,
    /// or with a Host object. With `dhcp.known_hosts_only`, full-mode DHCP answers only these.
    /// Called on the DHCP path, so it must answer from memory. The default, [`boots`], also
    /// leaves out known hosts that boot nothing now.
    ///
    /// [`boots`]: Self::boots
    fn knows(&self, mac: MacAddr) -> bool {
        self.boots(mac)
    }

    /// The relay agent information (option 82) `mac`'s relayed messages must carry: its
    /// host's pin (standalone `hosts[].relay_agent`, a Host's `spec.relayAgent`). A relayed
    /// DHCP message for a pinned MAC is answered only when its relay says what the pin names,
    /// and a relayed lease is identity only when it was granted so. `None`, the default: not
    /// pinned. Called on the DHCP path and for each request from a relayed address, so it must
    /// answer from memory.
    fn relay_pin(&self, _mac: MacAddr) -> Option<RelayPin> {
        None
    }

    /// Whether this inventory can answer yet: `Err(why)` until it has read what it serves
    /// from (in Kubernetes mode, the first full list of Hosts). Until then `/readyz` answers 503
    /// and DHCP stays silent rather than tell a known host it is unknown.
    fn ready(&self) -> Result<(), &'static str> {
        Ok(())
    }

    /// What `request.mac` boots now; asked when its iPXE fetches `/boot/<mac>.ipxe`. `None`
    /// answers 404.
    fn boot_action(&self, request: BootRequest) -> BoxFuture<'_, Option<BootAction>>;

    /// Every host this inventory knows, for the status page. Called while the page is open
    /// (once a second or so per viewer), so it must answer from memory. The default lists
    /// none: the page then shows only the MACs the timeline saw.
    fn hosts(&self) -> Vec<HostSummary> {
        Vec::new()
    }

    /// The boot media `request.key` names: the deploy ramdisk's kernel command line, its own
    /// words with `siteboot.token=` and `siteboot.operation=`. siteboot adds `siteboot.url=`,
    /// `siteboot.agent=` and `siteboot.fingerprint=`, and writes the line into the ISO's
    /// parameters region, so every word must hold only `A-Z a-z 0-9 . _ : / = , + @ % -` and
    /// the whole line fit in 1024 bytes (else the request answers 500). `None` answers 404,
    /// the same whatever the reason.
    ///
    /// A BMC reads the ISO in many ranges, each one a request (`HEAD` first, often): answer
    /// from memory, and with the same words for a key every time, or the parts it read before
    /// would not match. The default has no media (404).
    fn media(&self, _request: MediaRequest) -> BoxFuture<'_, Option<Vec<Word>>> {
        Box::pin(async { None })
    }

    /// Serves the deploy ramdisk's API under `/agent/`. The default has none (404).
    fn agent(&self, _request: AgentRequest) -> BoxFuture<'_, AgentResponse> {
        Box::pin(async { AgentResponse::text(http::StatusCode::NOT_FOUND, "no agent API here\n") })
    }
}
