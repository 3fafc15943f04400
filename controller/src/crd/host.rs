//! `Host`: the persistent inventory record of one physical machine. It outlives every Cluster
//! API Machine it is allocated to: deleting a Machine deprovisions and releases its Host, never
//! deletes it.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
// `status.hardware` is the agent's inspection report as it sent it: one set of types, so the
// two cannot drift apart.
pub use siteboot_agent_api::{Disk, Hardware, Nic, System};
// The values standalone mode keeps too, shared with it from the kube-free agent server.
pub use siteboot_agent_server::{
    ByteCount, Image, ImageFormat, OperationKind, RootDeviceHints, WipePolicy,
};
// `spec.bmc.bootMode` and `status.power` are the BMC driver's own values.
pub use siteboot_bmc::{BootMode, PowerState};
use siteboot_boot::dhcp::relay_agent::{AgentId, AgentIdError, RelayPin};

use super::common::{Conditions, MachineAddress};

#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "siteboot.dev",
    version = "v1alpha1",
    kind = "Host",
    namespaced,
    status = "HostStatus",
    shortname = "sbhost",
    derive = "PartialEq",
    // `clusterctl move` moves Hosts (not part of any Cluster) with what they own, e.g. a BMC
    // credentials Secret whose ownerReference names its Host.
    label("clusterctl.cluster.x-k8s.io/move-hierarchy", ""),
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"Power","type":"string","jsonPath":".status.power"}"#,
    printcolumn = r#"{"name":"Consumer","type":"string","jsonPath":".spec.consumerRef.name"}"#,
    printcolumn = r#"{"name":"Site","type":"string","jsonPath":".metadata.labels.siteboot\\.dev/site"}"#,
    printcolumn = r#"{"name":"Maintenance","type":"boolean","jsonPath":".spec.maintenance","priority":1}"#,
    printcolumn = r#"{"name":"MAC","type":"string","jsonPath":".spec.bootMACAddress","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct HostSpec {
    /// The MAC address of the NIC the host network-boots from (lower case, colon-separated).
    #[serde(rename = "bootMACAddress")]
    #[schemars(regex(pattern = r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$"))]
    pub boot_mac_address: String,
    /// Whether the host should be powered on. Default true.
    #[serde(default = "default_true")]
    pub online: bool,
    /// Cordon: a host in maintenance is never claimed for a Machine.
    #[serde(default)]
    pub maintenance: bool,
    /// How siteboot controls the host's power and boot device. Absent: the host is expected to
    /// network-boot by itself (PXE first in its boot order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bmc: Option<Bmc>,
    /// The object this host is allocated to (a SitebootMachine). Set by a compare-and-swap on the
    /// Host's resourceVersion, so a host is never claimed twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer_ref: Option<ConsumerRef>,
    /// What to install. Set by the consumer; removing it deprovisions the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioning: Option<Provisioning>,
    /// A stronger wipe than the site's `min_wipe` for this host when it is deprovisioned
    /// (`full`, say, for a host whose disks must never keep a tenant's data). It can only add:
    /// a host is wiped with the strongest of this, the site's `min_wipe` and what its last
    /// SitebootMachine asked for, so whoever may edit a Host cannot skip or weaken a wipe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wipe: Option<WipePolicy>,
    /// Which disk the image goes to. Absent: the smallest disk that holds the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_device_hints: Option<RootDeviceHints>,
    /// How the host boots into the deploy ramdisk for an operation. `Network` (the default):
    /// PXE or HTTP boot from this appliance, the token in the boot script. `VirtualMedia`:
    /// through `spec.bmc`, an ISO the BMC fetches from the appliance over HTTPS and inserts
    /// (Redfish `InsertMedia`), the token inside it: it never crosses the provisioning segment
    /// in clear, and no network boot is needed (docs/security.md).
    #[serde(default, skip_serializing_if = "BootMethod::is_network")]
    pub boot_method: BootMethod,
    /// For a host behind a DHCP relay: the relay agent information (DHCP option 82) its relay
    /// adds for it, `circuitID` (its port), `remoteID` (the relay or switch) or both. A relayed
    /// DHCP message for `bootMACAddress` is answered only when it carries each one given, byte
    /// for byte: a machine on another port of the relay that forges this MAC gets nothing (it is
    /// counted in `siteboot_dhcp_relayed_dropped_total{reason="relay-agent-mismatch"}`, and
    /// logged once per MAC with what its relay said, written as here). With the appliance's
    /// `dhcp.trust_relayed_leases`, a relayed lease is the host's identity (its ramdisk token,
    /// bootstrap data) only when it was granted through a relay that said so. Only as good as
    /// the relay: it must replace or drop the option 82 clients send. Absent: any port of a
    /// trusted relay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relay_agent: Option<RelayAgent>,
    /// How siteboot reaches a host that already runs an OS, instead of (or besides) its BMC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access: Option<Access>,
}

/// Ways in to a running host (`spec.access`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Access {
    /// Over SSH, with a key and the server's host key from a Secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh: Option<SshAccess>,
}

/// A host reached over SSH (`spec.access.ssh`). Its Secret (`credentialsName`, type
/// `siteboot.dev/ssh-access`, in the Host's namespace) holds `privateKey`, the server's
/// `hostKey` (one OpenSSH line; or `trustOnFirstUse: "true"`, and the key presented first is
/// recorded in `status.sshHostKey`), and `address` (and optionally `port`): the server the key
/// is for. A Host whose address or port differs from the Secret's is refused before anything
/// is sent, so whoever may edit a Host cannot point the key at another machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SshAccess {
    /// The server's IP address.
    pub address: String,
    /// Default 22.
    #[serde(default = "default_ssh_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// The user siteboot logs in as. Default `root`.
    #[serde(default = "default_ssh_user")]
    pub user: String,
    /// `Adopt` (the default): the host keeps its OS and gets the Machine's bootstrap data
    /// through its own first-boot path; released, its Kubernetes state is removed over SSH.
    /// `Reimage`: inspected over SSH; claimed, it is kexec'ed over SSH into the deploy ramdisk
    /// (the operation's token inside the initrd, never on a command line) and imaged as a
    /// network-booted host is. Later operations (the wipe on release, a new image) boot the
    /// ramdisk through `spec.bmc` if the Host has one, else by kexec over SSH again: that
    /// works only if the installed image accepts the key and presents the pinned host key.
    #[serde(default)]
    pub mode: SshMode,
    /// The SSH access Secret's name, in the Host's namespace.
    pub credentials_name: String,
}

/// What siteboot does with a host reached over SSH when it is claimed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SshMode {
    #[default]
    Adopt,
    Reimage,
}

fn default_ssh_port() -> u16 {
    22
}

fn default_ssh_user() -> String {
    "root".to_owned()
}

/// A server's host key recorded on first use (`status.sshHostKey`), for the address and port
/// it was presented at; pinned from then on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecordedHostKey {
    /// One OpenSSH line, `<algorithm> <base64>`.
    pub key: String,
    /// `SHA256:<base64>`, as `ssh-keygen -l` prints it.
    pub fingerprint: String,
    pub address: String,
    pub port: u16,
    pub recorded: Time,
}

/// What a host's relay must say about it (`spec.relayAgent`): at least one of the two.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(extend("minProperties" = 1))]
pub struct RelayAgent {
    /// Option 82's circuit-id (sub-option 1): the port of the relay the host is on, as the
    /// relay names it. Text when it is printable ASCII (`eth1/0/12`); otherwise `hex:` and two
    /// hex digits per byte (`hex:0001000c`), as is text that starts with `hex:`. 1 to 255 bytes.
    #[serde(rename = "circuitID", default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = RELAY_AGENT_ID_PATTERN))]
    pub circuit_id: Option<RelayAgentId>,
    /// Option 82's remote-id (sub-option 2): the relay or switch itself, often its MAC address
    /// as 6 bytes (`hex:000c29a1b2c3`). Written as `circuitID` is.
    #[serde(rename = "remoteID", default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = RELAY_AGENT_ID_PATTERN))]
    pub remote_id: Option<RelayAgentId>,
}

/// What [`AgentId`] reads: `hex:` and 1 to 255 pairs of hex digits, or 1 to 255 printable ASCII
/// characters that do not start with `hex:` (RE2 has no look-ahead, so spelt out: text whose
/// first four characters are not `hex:`).
pub const RELAY_AGENT_ID_PATTERN: &str = concat!(
    "^(hex:([0-9a-fA-F]{2}){1,255}",
    "|[ -gi-~][ -~]{0,254}",
    "|h([ -df-~][ -~]{0,253})?",
    "|he([ -wy-~][ -~]{0,252})?",
    "|hex([ -9;-~][ -~]{0,251})?)$",
);

/// A `circuitID` or `remoteID`: as written, and read once, when the Host is. Reading never
/// fails (a Host that could not be read would stop the watch of every Host); the schema's
/// pattern refuses what [`AgentId`] does not read, and a value that got past it anyway pins
/// nothing a relay can match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(from = "String", into = "String")]
pub struct RelayAgentId {
    written: String,
    parsed: Result<AgentId, AgentIdError>,
}

impl From<String> for RelayAgentId {
    fn from(written: String) -> Self {
        Self { parsed: written.parse(), written }
    }
}

impl From<RelayAgentId> for String {
    fn from(id: RelayAgentId) -> Self {
        id.written
    }
}

impl RelayAgentId {
    pub fn parsed(&self) -> Result<&AgentId, AgentIdError> {
        self.parsed.as_ref().map_err(|e| *e)
    }
}

impl RelayAgent {
    /// The pin the DHCP server checks. One that cannot be read (a value the schema should
    /// have refused, or neither field) is a pin nothing matches: the host's relayed messages
    /// go unanswered rather than through any port.
    pub fn pin(&self) -> RelayPin {
        let parsed =
            |id: &Option<RelayAgentId>| id.as_ref().map(|id| id.parsed().cloned()).transpose();
        match (parsed(&self.circuit_id), parsed(&self.remote_id)) {
            (Ok(circuit_id), Ok(remote_id)) => {
                RelayPin::new(circuit_id, remote_id).unwrap_or_else(|_| RelayPin::unmatchable())
            }
            _ => RelayPin::unmatchable(),
        }
    }
}

/// How a host boots into the deploy ramdisk (`spec.bootMethod`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum BootMethod {
    #[default]
    Network,
    VirtualMedia,
}

impl BootMethod {
    pub fn is_network(&self) -> bool {
        *self == BootMethod::Network
    }
}

fn default_true() -> bool {
    true
}

impl HostSpec {
    /// A host that boots from `boot_mac_address`, online, not in maintenance, unclaimed.
    pub fn new(boot_mac_address: impl Into<String>) -> Self {
        Self {
            boot_mac_address: boot_mac_address.into(),
            online: true,
            maintenance: false,
            bmc: None,
            consumer_ref: None,
            provisioning: None,
            wipe: None,
            root_device_hints: None,
            boot_method: BootMethod::Network,
            relay_agent: None,
            access: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Bmc {
    /// `redfish+https://host[:port]/redfish/v1/Systems/<id>` (`redfish://` is the same);
    /// `redfish+http://...` only for a BMC without TLS.
    pub address: String,
    /// A Secret in the Host's namespace with `username`, `password` and `address`: the BMC
    /// these credentials are for (`address` as here; spelt another way is fine), optionally
    /// with `certificateFingerprint`. They are sent only to that BMC: a Host whose address
    /// differs, or that names a Secret without `address`, is refused before anything is sent.
    pub credentials_name: String,
    /// `sha256:<64 hex digits>`: trust exactly the BMC certificate with this SHA-256 (of its
    /// DER encoding) instead of the platform's CA certificates, for BMCs with self-signed ones.
    /// The pin trusted is the credentials Secret's `certificateFingerprint`; set here, it must
    /// be the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^sha256:[0-9a-f]{64}$"))]
    pub certificate_fingerprint: Option<String>,
    /// The firmware path of the one-time network boot into the ramdisk (Redfish
    /// `BootSourceOverrideMode`); unset: whatever the BMC's system is set to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_mode: Option<BootMode>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerRef {
    pub api_version: String,
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Provisioning {
    pub image: Image,
    // No bootstrap data reference: whoever may edit a Host could point it at any Secret. The
    // agent API finds the data from the binding (consumerRef -> SitebootMachine -> Machine).
}

/// Where a host is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum HostState {
    /// Checking the BMC (reachable, credentials valid).
    Registering,
    /// Booting the ramdisk to report hardware.
    Inspecting,
    /// Ready to be claimed.
    Available,
    /// Claimed: the ramdisk writes the image and the bootstrap seed.
    Provisioning,
    /// Running its installed OS.
    Provisioned,
    /// The ramdisk wipes the disks before the host returns to the pool.
    Deprovisioning,
    /// Something failed; the reason is in `status.quarantineReason`. Never silently Available.
    Quarantined,
}

/// A ramdisk operation in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Operation {
    pub kind: OperationKind,
    /// Unique per operation: reports naming another operation are refused.
    pub id: String,
    pub started: Time,
    /// sha256 (hex) of the operation's current token. The token itself exists only on the
    /// host's kernel command line; a new one is minted each time the host boots into it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_hash: Option<String>,
    /// The image this operation writes, frozen from the SitebootMachine the Host is bound to
    /// when the ramdisk first asks for its task: what a Host editor writes into
    /// `spec.provisioning` afterwards changes nothing here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<Image>,
    /// The address the token was issued to: requests from elsewhere are refused. Unset for a
    /// token that came in virtual media or by kexec over SSH: the BMC, or the server behind the
    /// pinned host key, delivered it, so it is the host's evidence wherever the ramdisk's
    /// requests come from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_address: Option<String>,
    /// The host boots this operation's ramdisk from virtual media (its `spec.bootMethod` when
    /// the operation started): its token is minted when the media is inserted, never for a
    /// network boot.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub virtual_media: bool,
    /// The current token went to the host over SSH, inside the initrd of the ramdisk it was
    /// kexec'ed into (`spec.access.ssh.mode: Reimage`, no BMC); a network boot's token replaces
    /// it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub token_via_ssh: bool,
    /// When siteboot last asked the host's BMC to boot this operation's ramdisk, or started
    /// its kexec over SSH (None: not yet). Written after the BMC took the request (the kexec
    /// was started), so a request lost to a crash is made again, and one the host did not
    /// follow is repeated (see `lifecycle::boot_due`, `lifecycle::kexec_due`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_requested: Option<Time>,
    /// When the current token was issued: tokens expire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_issued: Option<Time>,
    /// Bootstrap data is handed out once per operation.
    #[serde(default)]
    pub bootstrap_delivered: bool,
    /// The ramdisk's last progress report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    /// When the ramdisk last reported progress: with `tokenIssued`, its last sign of life. A
    /// ramdisk silent for longer than the appliance allows quarantines the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heard: Option<Time>,
    /// Bytes of the image written so far, as the ramdisk last reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<ByteCount>,
}

impl Operation {
    /// Whether its current token never crossed the provisioning segment (virtual media, or a
    /// kexec over SSH): the ramdisk is known by it, from any address.
    pub fn token_out_of_band(&self) -> bool {
        self.virtual_media || self.token_via_ssh
    }

    /// A new operation of `kind`, started at `started`: no token, nothing handed out or heard
    /// yet.
    pub fn new(kind: OperationKind, id: String, started: Time) -> Self {
        Self {
            kind,
            id,
            started,
            token_hash: None,
            image: None,
            token_address: None,
            virtual_media: false,
            token_via_ssh: false,
            boot_requested: None,
            token_issued: None,
            bootstrap_delivered: false,
            step: None,
            last_heard: None,
            bytes: None,
        }
    }
}

/// What is installed on a provisioned host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Installed {
    pub image: Image,
    /// The consumer it was installed for.
    pub consumer: String,
    /// Whether siteboot still has to ask the host's BMC to boot this disk: set when a
    /// network-booted host with a BMC is installed, cleared once asked (instead of the ramdisk
    /// rebooting into the boot script, which exits to the firmware's boot order). A pending
    /// flag, so that hosts installed before this step existed are never restarted for it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disk_boot_pending: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<HostState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<PowerState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<Operation>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<Hardware>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub installed: Option<Installed>,
    /// The host's addresses (its DHCP lease).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<MachineAddress>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine_reason: Option<String>,
    /// The host may hold a tenant's data (provisioning started and no wipe has finished since):
    /// it returns to Available only through a successful wipe. In status, where those who may
    /// edit a Host cannot clear it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wipe_required: bool,
    /// The wipe the host's last tenant asked for (its SitebootMachine's `spec.wipe`), frozen
    /// when its provisioning was handed out; cleared when the host is Available again. In
    /// status, where those who may edit a Host cannot lower it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wipe_owed: Option<WipePolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
    /// siteboot inserted virtual media into the host's BMC that it has not ejected yet: it is
    /// ejected (and the host booted from its disk, or powered off) once the operation ends.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub media_inserted: bool,
    /// The host key its SSH server presented the first time, when its Secret asks for trust
    /// on first use: in status, where those who may edit a Host cannot replace it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_host_key: Option<RecordedHostKey>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// What the apiserver lets through (the schema's pattern) is what the controller reads.
    #[test]
    fn the_relay_agent_pattern_is_what_agent_ids_read() {
        let pattern = regex::Regex::new(RELAY_AGENT_ID_PATTERN).unwrap();
        let x = |n: usize| "x".repeat(n);
        let samples = [
            "eth1/0/12".to_owned(),
            "Gi1/0/3:100".into(),
            " ".into(),
            "~".into(),
            "h".into(),
            "he".into(),
            "hex".into(),
            "hexa".into(),
            "hex;".into(),
            "Hex:zz".into(),
            "hex:".into(),
            "hex:0".into(),
            "hex:0a".into(),
            "hex:0A0b".into(),
            "hex:zz".into(),
            "hex:0a\n".into(),
            "hex::0a".into(),
            "".into(),
            "a\n".into(),
            "tab\t".into(),
            "caf\u{e9}".into(),
            x(255),
            x(256),
            format!("h{}", x(254)),
            format!("h{}", x(255)),
            format!("he{}", x(253)),
            format!("he{}", x(254)),
            format!("hex{}", x(252)),
            format!("hex{}", x(253)),
            format!("hex:{}", "ab".repeat(255)),
            format!("hex:{}", "ab".repeat(256)),
        ];
        for sample in samples {
            let read = sample.parse::<AgentId>().is_ok();
            assert_eq!(pattern.is_match(&sample), read, "{sample:?}");
        }
    }

    /// `status.hardware` as the controller wrote it before it kept the agent's report as is
    /// (its own types, `system` last): read the same, and written back with the same content.
    #[test]
    fn a_status_written_before_reads_and_writes_back_the_same() {
        let written = json!({ "hardware": {
            "cpus": 2,
            "memoryMiB": 2048,
            "arch": "x86_64",
            "disks": [{ "name": "/dev/vda", "sizeBytes": 1073741824_u64, "serial": "S1",
                        "wwn": "0x5000", "rotational": false }],
            "nics": [{ "name": "eth0", "mac": "52:54:00:12:34:56", "link": true,
                       "speedMbps": 1000 }],
            "system": { "uuid": "u-1", "vendor": "QEMU" },
        }});
        let status: HostStatus = serde_json::from_value(written.clone()).unwrap();
        let hardware = status.hardware.as_ref().unwrap();
        assert_eq!((hardware.cpus, hardware.memory_mib), (2, 2048));
        assert_eq!(hardware.system.as_ref().map(|s| s.uuid.as_str()), Some("u-1"));
        assert_eq!(hardware.disks[0].wwn.as_deref(), Some("0x5000"));
        assert_eq!(hardware.nics[0].speed_mbps, Some(1000));
        assert_eq!(serde_json::to_value(&status).unwrap(), written);
        // What an older agent left out is unknown, not an error.
        let sparse: HostStatus = serde_json::from_value(json!({ "hardware": {} })).unwrap();
        assert_eq!(sparse.hardware, Some(Hardware::default()));
    }

    fn spec(relay_agent: serde_json::Value) -> HostSpec {
        let spec = json!({ "bootMACAddress": "52:54:00:00:00:01", "relayAgent": relay_agent });
        serde_json::from_value(spec).unwrap()
    }

    #[test]
    fn a_host_s_relay_agent_is_read_once_into_its_pin() {
        let host = spec(json!({ "circuitID": "eth1/0/12", "remoteID": "hex:000C29" }));
        let pin = host.relay_agent.as_ref().unwrap().pin();
        assert_eq!(pin.to_string(), "circuit-id eth1/0/12, remote-id hex:000c29");
        // Written back as it was written.
        let written = serde_json::to_value(&host).unwrap();
        assert_eq!(
            written["relayAgent"],
            json!({ "circuitID": "eth1/0/12", "remoteID": "hex:000C29" })
        );
        let host = spec(json!({ "remoteID": "sw-7" }));
        assert_eq!(host.relay_agent.unwrap().pin().to_string(), "remote-id sw-7");
        assert_eq!(spec(serde_json::Value::Null).relay_agent, None);
    }

    /// A value the schema should have refused is still read (a Host that fails to deserialize
    /// would stop the watch of every Host), and pins nothing a relay can match.
    #[test]
    fn an_unreadable_relay_agent_pins_nothing() {
        for bad in [
            json!({ "circuitID": "hex:zz" }),
            json!({ "circuitID": "eth1", "remoteID": "" }),
            json!({}),
        ] {
            let host = spec(bad.clone());
            let pin = host.relay_agent.as_ref().unwrap().pin();
            assert_eq!(pin, RelayPin::unmatchable(), "{bad}");
            assert_eq!(serde_json::to_value(&host).unwrap()["relayAgent"], bad, "kept as written");
        }
    }
}
