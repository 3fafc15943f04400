//! The standalone configuration file: its format (the serde types, documented field by field in
//! `examples/standalone.yaml`) and the checks that turn it into a [`Config`] the servers can run
//! with. Every error names the file, the field and what is wrong.
//!
//! Each default is written once, in the serde default of its field (or its section's `Default`);
//! doc comments do not repeat the values. The examples show every field with its default, and a
//! test checks both that every field is shown and that each shown default is the real one.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use siteboot_agent_server::{Image, RootDeviceHints, WipePolicy};
use siteboot_bmc::{AddressError, BootMode};
use siteboot_boot::MacAddr;
use siteboot_boot::admission::CapsError;
use siteboot_boot::dhcp::relay_agent::RelayPin;
use siteboot_boot::dhcp::settings::{
    FieldError, NetworkPlan, Reservation, Settings as DhcpSettings,
};
use siteboot_boot::files::check_relative;
use siteboot_boot::http::HttpSettings;
use siteboot_boot::inventory::{BootAction, LinuxBoot, LocalBoot, Source};
use siteboot_boot::media::BootMedia;
use siteboot_boot::tftp::TftpSettings;
use siteboot_ipxe::{IpxeBinaries, Word};
use siteboot_ssh::{HostKeyError, Target};

use crate::bmc::HostBmc;
use crate::fd_limit;
use crate::ssh::HostSsh;
use crate::standalone::{ListedHost, Provisioning, StaticInventory};

#[cfg(feature = "kubernetes")]
mod kubernetes;
#[cfg(feature = "kubernetes")]
use kubernetes::KubernetesFile;
#[cfg(feature = "kubernetes")]
pub use kubernetes::{KubernetesConfig, check_site_name};
/// A build without Kubernetes mode reads a `kubernetes:` section only to refuse it.
#[cfg(not(feature = "kubernetes"))]
type KubernetesFile = serde::de::IgnoredAny;

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// The interface DHCP answers on.
    pub interface: String,
    /// This appliance's IPv4 address on `interface`, advertised to clients. Unset: the
    /// interface's own address in `dhcp.subnets`, so replicas of a site that share one config
    /// each advertise the address of the node they run on.
    pub address: Option<Ipv4Addr>,
    /// Where leases and other state are kept.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// On SIGTERM, how long the TFTP and HTTP transfers under way get to finish. DHCP stops at
    /// once and the leader Lease is given back before that. Default 10s.
    #[serde(default = "default_drain_timeout", with = "humantime_serde")]
    pub drain_timeout: std::time::Duration,
    #[serde(default)]
    pub dhcp: DhcpSettings,
    #[serde(default)]
    pub tftp: TftpSettings,
    #[serde(default)]
    pub http: HttpSettings,
    #[serde(default)]
    pub images: ImagesSettings,
    #[serde(default)]
    pub profiles: BTreeMap<String, ProfileFile>,
    #[serde(default)]
    pub hosts: Vec<HostFile>,
    pub unknown_hosts: Option<UnknownHostsFile>,
    /// The profile (kernel + initrds) of the deploy ramdisk that inspects, provisions and
    /// wipes the hosts under `hosts` (`siteboot host inspect|provision|deprovision`); siteboot
    /// adds the operation's token to its command line. Unset: no host operations.
    pub ramdisk_profile: Option<String>,
    /// Standalone host operations: how long a ramdisk that booted for an operation may go
    /// without reporting before the operation ends as failed ("ramdisk silent for ...") and
    /// its token stops working. Kubernetes mode takes `kubernetes.ramdisk_silence_timeout`.
    #[serde(default = "default_ramdisk_silence_timeout", with = "humantime_serde")]
    pub ramdisk_silence_timeout: std::time::Duration,
    /// Kubernetes mode: Hosts come from the management cluster instead of `hosts`.
    pub kubernetes: Option<KubernetesFile>,
}

fn default_ramdisk_silence_timeout() -> std::time::Duration {
    siteboot_agent_server::silence::RAMDISK_SILENCE_TIMEOUT
}

/// The `images:` section: the image cache in `<state_dir>/images`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImagesSettings {
    /// The most bytes cached images may take; the least recently used are evicted to stay
    /// under it.
    #[serde(default = "default_images_max_bytes")]
    pub max_bytes: u64,
}

impl Default for ImagesSettings {
    fn default() -> Self {
        Self { max_bytes: default_images_max_bytes() }
    }
}

fn default_images_max_bytes() -> u64 {
    50 << 30
}

/// This appliance's address, which clients are sent to: `address`, else
/// [`interface_address`].
fn server_address(
    file: &ConfigFile,
    on_interface: impl FnOnce(&str) -> std::io::Result<Vec<Ipv4Addr>>,
) -> Result<Ipv4Addr, FieldError> {
    let address = match file.address {
        Some(address) => address,
        None => interface_address(file, on_interface)?,
    };
    if address.is_unspecified() || address.is_broadcast() || address.is_multicast() {
        return Err(FieldError::new("address", format!("{address} cannot be a server address")));
    }
    Ok(address)
}

/// For an unset `address`: the one address of `interface` in `dhcp.subnets` (its one address
/// when there are none).
fn interface_address(
    file: &ConfigFile,
    on_interface: impl FnOnce(&str) -> std::io::Result<Vec<Ipv4Addr>>,
) -> Result<Ipv4Addr, FieldError> {
    let interface = &file.interface;
    let found = on_interface(interface).map_err(|e| {
        FieldError::new(
            "address",
            format!("unset, and the addresses of {interface} cannot be read: {e}"),
        )
    })?;
    let subnets = &file.dhcp.subnets;
    let served: Vec<Ipv4Addr> = found
        .into_iter()
        .filter(|a| subnets.is_empty() || subnets.iter().any(|s| s.subnet.contains(*a)))
        .collect();
    let listed = |addresses: &[Ipv4Addr]| {
        addresses.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    };
    match served.as_slice() {
        [address] => Ok(*address),
        [] => Err(FieldError::new(
            "address",
            format!(
                "unset, and {interface} has no IPv4 address in dhcp.subnets: give it one, or set address"
            ),
        )),
        several => Err(FieldError::new(
            "address",
            format!(
                "unset, and {interface} has several addresses in dhcp.subnets ({}): set address",
                listed(several)
            ),
        )),
    }
}

fn default_drain_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(10)
}

fn default_state_dir() -> PathBuf {
    PathBuf::from("/var/lib/siteboot")
}

/// A boot profile: exactly one of `kernel` (with `initrds` and `cmdline`), `script` or
/// `local_boot`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileFile {
    pub kernel: Option<String>,
    #[serde(default)]
    pub initrds: Vec<String>,
    pub cmdline: Option<String>,
    pub script: Option<String>,
    pub local_boot: Option<LocalBoot>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostFile {
    pub mac: MacAddr,
    /// What the host boots when no operation is under way.
    pub profile: String,
    /// The name `siteboot host` commands use. Default: its DHCP reservation's `hostname`,
    /// else its MAC.
    pub name: Option<String>,
    /// The image `siteboot host provision` writes.
    pub image: Option<ImageFile>,
    /// A file (absolute path) with the bootstrap data (cloud-init user-data) provisioning hands
    /// the host, read when the ramdisk asks for it. Unset: empty user-data.
    pub user_data: Option<PathBuf>,
    /// Which disk to write (every field optional; the same fields as a Host's
    /// `spec.rootDeviceHints`: `name`, `serial`, `wwn`, `model`, `minSizeBytes`,
    /// `maxSizeBytes`). Unset: the smallest disk that holds the image.
    pub root_device_hints: Option<RootDeviceHintsFile>,
    /// How `siteboot host deprovision` wipes the disks: `quick` (partition tables and
    /// signatures), `full` (every block) or `none` (nothing written: disposable test
    /// hosts only).
    #[serde(default = "default_wipe")]
    pub wipe: WipePolicy,
    /// The host's Redfish BMC: each `siteboot host inspect|provision|deprovision` boots it
    /// once from the network (powering it on or restarting it). Unset: power-cycle it by hand.
    pub bmc: Option<BmcFile>,
    /// A server that already runs an OS, reached over SSH: `siteboot host provision` adopts it
    /// as it runs (its `user_data` delivered through its own cloud-init, or run if it is a
    /// script), `deprovision` resets it (its Kubernetes state removed, its OS and data kept),
    /// `inspect` reads it. No ramdisk, so no image, `root_device_hints` or `bmc` beside it.
    pub ssh: Option<SshFile>,
    /// For a host behind a DHCP relay: the relay agent information (option 82) the relay puts
    /// in its messages, `circuit_id` (its port), `remote_id` (the relay or switch) or both.
    /// A relayed message for this MAC is answered only when it carries each one given, byte
    /// for byte, and a relayed lease is its identity (`dhcp.trust_relayed_leases`) only when
    /// granted so. Each is text (printable ASCII, `eth1/0/12`) or `hex:` and two hex digits
    /// per byte (`hex:000c29a1b2c3`). Unset: any port of a trusted relay.
    pub relay_agent: Option<RelayPin>,
}

/// A host's BMC, as Kubernetes mode's `spec.bmc`, with the credentials in a file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BmcFile {
    /// `redfish+https://<host>[:port]/redfish/v1/Systems/<id>` (`redfish+http://` only for a
    /// BMC without TLS).
    pub address: String,
    /// A file (absolute path, readable by its owner only) with `username:` and `password:`,
    /// read each time the BMC is used. Never the password itself in this config.
    pub credentials_file: PathBuf,
    /// `sha256:<64 hex digits>`: trust exactly this certificate instead of the platform's CAs.
    pub certificate_fingerprint: Option<String>,
    /// The firmware path of the network boot (`UEFI` or `Legacy`, Redfish
    /// `BootSourceOverrideMode`). Unset: whatever the system is set to.
    pub boot_mode: Option<BootMode>,
}

/// A host's SSH access, as Kubernetes mode's `spec.access.ssh` with its Secret, the private key
/// in a file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SshFile {
    /// The server's IP address.
    pub address: std::net::IpAddr,
    #[serde(default = "default_ssh_port")]
    pub port: u16,
    #[serde(default = "default_ssh_user")]
    pub user: String,
    /// A file (absolute path, readable by its owner only) with the private key siteboot logs in
    /// with (OpenSSH or PEM, no passphrase), read at each use.
    pub private_key_file: PathBuf,
    /// The server's host key, as its `/etc/ssh/ssh_host_*_key.pub` holds it (`ssh-ed25519
    /// AAAA...`): a server that presents another is sent nothing.
    pub host_key: String,
}

fn default_ssh_port() -> u16 {
    22
}

fn default_ssh_user() -> String {
    "root".to_owned()
}

fn default_wipe() -> WipePolicy {
    WipePolicy::Quick
}

/// Root device hints: the fields of a Host's `spec.rootDeviceHints`, every one optional. A
/// field siteboot does not know is an error (ignored, it could let the wrong disk be written).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RootDeviceHintsFile {
    /// `/dev/sdb` or `sdb`.
    pub name: Option<String>,
    pub serial: Option<String>,
    /// Compared without its notation (`0x…`, `naa.…`, `eui.…`).
    pub wwn: Option<String>,
    /// Compared without case or padding.
    pub model: Option<String>,
    /// 0: no hint.
    pub min_size_bytes: Option<u64>,
    /// 0: no hint.
    pub max_size_bytes: Option<u64>,
}

impl From<&RootDeviceHintsFile> for RootDeviceHints {
    fn from(h: &RootDeviceHintsFile) -> Self {
        Self {
            name: h.name.clone(),
            serial: h.serial.clone(),
            wwn: h.wwn.clone(),
            model: h.model.clone(),
            min_size_bytes: h.min_size_bytes,
            max_size_bytes: h.max_size_bytes,
        }
    }
}

/// An OS image: the shape of a Host's `spec.provisioning.image`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageFile {
    /// Where the appliance fetches it (http or https) into its image cache.
    pub url: String,
    /// `sha256:<64 hex digits>` of the image as served.
    pub checksum: String,
    /// Grow the image's last partition to fill the disk.
    #[serde(default)]
    pub grow_last_partition: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnknownHostsFile {
    pub profile: String,
}

/// A checked configuration.
#[derive(Debug)]
pub struct Config {
    pub interface: String,
    pub address: Ipv4Addr,
    pub state_dir: PathBuf,
    pub drain_timeout: std::time::Duration,
    pub dhcp: DhcpSettings,
    pub plan: NetworkPlan,
    /// `dhcp.known_hosts_only`, its default decided: true in Kubernetes mode (a machine gets
    /// its Host object before it first boots, so it is answered and inspected), false
    /// standalone (where `unknown_hosts` may boot machines nobody listed).
    pub known_hosts_only: bool,
    pub tftp: TftpSettings,
    pub http: HttpSettings,
    pub images: ImagesSettings,
    pub binaries: IpxeBinaries,
    pub inventory: StaticInventory,
    /// `ramdisk_profile`: the deploy ramdisk of standalone host operations.
    pub ramdisk: Option<LinuxBoot>,
    pub ramdisk_silence_timeout: std::time::Duration,
    /// `kubernetes.ramdisk_media`, an absolute path; opened by [`Config::open_ramdisk_media`].
    pub ramdisk_media: Option<PathBuf>,
    #[cfg(feature = "kubernetes")]
    pub kubernetes: Option<KubernetesConfig>,
}

/// A configuration error: the file, the field and what is wrong with it.
#[derive(Debug)]
pub struct ConfigError {
    pub file: PathBuf,
    /// Dotted path of the field, like `dhcp.subnets[0].pools[1]`; empty for the whole file.
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}: {}", self.file.display(), self.message)
        } else {
            write!(f, "{}: {}: {}", self.file.display(), self.field, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    /// `error`, found in `file`.
    pub fn in_file(file: &Path, error: FieldError) -> Self {
        Self { file: file.to_owned(), field: error.field, message: error.message }
    }
}

/// A directory the configuration names that is not on this machine.
#[derive(Debug, PartialEq)]
pub struct MissingDir {
    pub field: &'static str,
    pub path: PathBuf,
}

impl From<MissingDir> for FieldError {
    fn from(missing: MissingDir) -> Self {
        let MissingDir { field, path } = missing;
        FieldError::new(
            field,
            format!(
                "{}: no such directory (create it, or point {field} elsewhere)",
                path.display()
            ),
        )
    }
}

impl Config {
    /// Reads, parses and checks a configuration file, also against this process's
    /// file-descriptor limit (see [`fd_limit`]). The served content directories need not exist
    /// yet ([`Config::missing_content_dirs`]).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let error = |e| ConfigError::in_file(path, e);
        let text = std::fs::read_to_string(path)
            .map_err(|e| error(FieldError::new("", format!("cannot read: {e}"))))?;
        let config = Self::parse(&text).map_err(error)?;
        let limit = fd_limit::hard().map_err(|e| {
            error(FieldError::new("", format!("cannot read the file-descriptor limit: {e}")))
        })?;
        fd_limit::check(&config.http, &config.tftp, limit).map_err(error)?;
        Ok(config)
    }

    /// Parses and checks the text of a configuration file.
    pub fn parse(text: &str) -> Result<Self, FieldError> {
        let file: ConfigFile = serde_path_to_error::deserialize(
            serde_norway::Deserializer::from_str(text),
        )
        .map_err(|e| {
            let field = e.path().to_string();
            let field = if field == "." { String::new() } else { field };
            FieldError::new(field, e.into_inner().to_string())
        })?;
        Self::check(file, crate::interface::ipv4_addresses)
    }

    /// Checks `file`, section by section; `on_interface` lists an interface's addresses, for
    /// an unset `address`.
    fn check(
        file: ConfigFile,
        on_interface: impl FnOnce(&str) -> std::io::Result<Vec<Ipv4Addr>>,
    ) -> Result<Self, FieldError> {
        check_interface(&file.interface)?;
        let address = server_address(&file, on_interface)?;
        let plan = NetworkPlan::new(&file.dhcp, address, "dhcp")?;
        check_tftp(&file.tftp)?;
        check_http(&file.http)?;
        check_images(&file.images)?;
        check_timeouts(&file)?;
        let binaries = ipxe_binaries(&file.tftp.ipxe_dir)?;
        let profiles = profiles(&file.profiles)?;
        let ramdisk = standalone_ramdisk(&file, &profiles)?;
        let hosts = hosts(&file, &profiles, ramdisk.is_some())?;
        let default = file
            .unknown_hosts
            .as_ref()
            .map(|u| profile(&profiles, &u.profile, "unknown_hosts.profile".into()))
            .transpose()?;
        #[cfg(feature = "kubernetes")]
        let kubernetes =
            file.kubernetes.as_ref().map(|k| kubernetes::check(k, &file, &profiles)).transpose()?;
        #[cfg(feature = "kubernetes")]
        let ramdisk_media = file.kubernetes.as_ref().and_then(|k| k.ramdisk_media.clone());
        #[cfg(not(feature = "kubernetes"))]
        let ramdisk_media = None;
        #[cfg(not(feature = "kubernetes"))]
        if file.kubernetes.is_some() {
            return Err(FieldError::new(
                "kubernetes",
                "this siteboot is built without Kubernetes mode (cargo feature `kubernetes`, on by default)",
            ));
        }
        check_served_roots(&file)?;
        let known_hosts_only = file.dhcp.known_hosts_only.unwrap_or(file.kubernetes.is_some());
        Ok(Self {
            #[cfg(feature = "kubernetes")]
            kubernetes,
            ramdisk_media,
            known_hosts_only,
            interface: file.interface,
            address,
            state_dir: file.state_dir,
            drain_timeout: file.drain_timeout,
            plan,
            dhcp: file.dhcp,
            tftp: file.tftp,
            http: file.http,
            images: file.images,
            binaries,
            inventory: StaticInventory::new(hosts, default),
            ramdisk,
            ramdisk_silence_timeout: file.ramdisk_silence_timeout,
        })
    }
}

/// `interface`: a name Linux can give a network interface.
fn check_interface(interface: &str) -> Result<(), FieldError> {
    if interface.is_empty() || interface.len() > 15 || interface.contains(['/', ' ', '\0']) {
        return Err(FieldError::new(
            "interface",
            format!("{interface:?} is not a network interface name"),
        ));
    }
    Ok(())
}

fn check_images(images: &ImagesSettings) -> Result<(), FieldError> {
    if images.max_bytes == 0 {
        return Err(FieldError::new("images.max_bytes", "must be more than 0"));
    }
    Ok(())
}

/// The top-level timeouts: `drain_timeout` and `ramdisk_silence_timeout`.
fn check_timeouts(file: &ConfigFile) -> Result<(), FieldError> {
    if file.drain_timeout.is_zero() {
        return Err(FieldError::new("drain_timeout", "must be longer than 0s"));
    }
    if file.ramdisk_silence_timeout.is_zero() {
        return Err(FieldError::new("ramdisk_silence_timeout", "must be longer than 0s"));
    }
    Ok(())
}

/// The iPXE binaries in `tftp.ipxe_dir`: at least one.
fn ipxe_binaries(dir: &Path) -> Result<IpxeBinaries, FieldError> {
    let binaries = IpxeBinaries::discover(dir);
    if binaries.platforms().next().is_none() {
        return Err(FieldError::new(
            "tftp.ipxe_dir",
            format!(
                "{} holds no iPXE binary (undionly.kpxe, snponly.efi, ipxe.efi); install Debian's ipxe package or point this at a directory that does",
                dir.display()
            ),
        ));
    }
    Ok(binaries)
}

/// `profiles`, each checked, by name.
fn profiles(
    file: &BTreeMap<String, ProfileFile>,
) -> Result<BTreeMap<String, BootAction>, FieldError> {
    let mut profiles = BTreeMap::new();
    for (name, profile) in file {
        let at = format!("profiles.{name}");
        if name.is_empty()
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(FieldError::new(at, "profile names are letters, digits, '-', '_' and '.'"));
        }
        profiles.insert(name.clone(), boot_action(profile, &at)?);
    }
    Ok(profiles)
}

/// The profile `name`, as `field` names it.
fn profile(
    profiles: &BTreeMap<String, BootAction>,
    name: &str,
    field: String,
) -> Result<BootAction, FieldError> {
    profiles.get(name).cloned().ok_or_else(|| {
        let known: Vec<&str> = profiles.keys().map(String::as_str).collect();
        FieldError::new(
            field,
            format!("no profile named {name:?} (profiles: {})", known.join(", ")),
        )
    })
}

/// `ramdisk_profile`: the deploy ramdisk of standalone host operations, if there are any.
fn standalone_ramdisk(
    file: &ConfigFile,
    profiles: &BTreeMap<String, BootAction>,
) -> Result<Option<LinuxBoot>, FieldError> {
    match &file.ramdisk_profile {
        None => Ok(None),
        Some(_) if file.kubernetes.is_some() => Err(FieldError::new(
            "ramdisk_profile",
            "Kubernetes mode takes kubernetes.ramdisk_profile",
        )),
        Some(name) => ramdisk_boot(profiles, name, "ramdisk_profile").map(Some),
    }
}

/// `hosts`, by MAC: each with a name no other host has, its profile, and its provisioning and
/// BMC, which need a ramdisk (`ramdisk_profile`) to provision it with.
fn hosts(
    file: &ConfigFile,
    profiles: &BTreeMap<String, BootAction>,
    ramdisk: bool,
) -> Result<HashMap<MacAddr, ListedHost>, FieldError> {
    let reservations: HashMap<MacAddr, &Reservation> =
        file.dhcp.reservations.iter().map(|r| (r.mac, r)).collect();
    let mut hosts = HashMap::new();
    let mut names = HashMap::new();
    for (i, host) in file.hosts.iter().enumerate() {
        let at = format!("hosts[{i}]");
        let reservation = reservations.get(&host.mac).map(|r| (*r).clone());
        let name = host_name(host, reservation.as_ref(), &at)?;
        if let Some(other) = names.insert(name.clone(), i) {
            return Err(FieldError::new(
                format!("{at}.name"),
                format!("{name:?} is also the name of hosts[{other}]"),
            ));
        }
        check_host_operations(host, ramdisk, &at)?;
        let provisioning =
            host.image.as_ref().map(|image| provisioning(image, host, &at)).transpose()?;
        let listed = ListedHost {
            action: profile(profiles, &host.profile, format!("{at}.profile"))?,
            profile: host.profile.clone(),
            name,
            reservation,
            provisioning,
            wipe: host.wipe,
            bmc: host.bmc.as_ref().map(|b| bmc(b, &format!("{at}.bmc"))).transpose()?,
            ssh: host.ssh.as_ref().map(|ssh| host_ssh(ssh, host, &at)).transpose()?,
            relay_pin: host.relay_agent.clone(),
        };
        if hosts.insert(host.mac, listed).is_some() {
            return Err(FieldError::new(
                format!("{at}.mac"),
                format!("{} is listed twice", host.mac),
            ));
        }
    }
    Ok(hosts)
}

/// The host's name: its own, else its reservation's hostname, else its MAC.
fn host_name(
    host: &HostFile,
    reservation: Option<&Reservation>,
    at: &str,
) -> Result<String, FieldError> {
    match &host.name {
        Some(name) => {
            check_host_name(name, &format!("{at}.name"))?;
            Ok(name.clone())
        }
        None => {
            Ok(reservation.and_then(|r| r.hostname.clone()).unwrap_or_else(|| host.mac.to_string()))
        }
    }
}

/// A host's operation fields: an SSH host's run over SSH, and leave no place for a ramdisk's;
/// the others all need a ramdisk to run the operations, and user-data goes with an image.
fn check_host_operations(host: &HostFile, ramdisk: bool, at: &str) -> Result<(), FieldError> {
    if host.ssh.is_some() {
        // Reached over SSH: adopted as it runs, or, with an image, kexec'ed into the ramdisk.
        if host.bmc.is_some() {
            return Err(FieldError::new(
                format!("{at}.bmc"),
                "an SSH host is reached over SSH only (a BMC beside it is Kubernetes mode's)",
            ));
        }
        if host.root_device_hints.is_some() && host.image.is_none() {
            return Err(FieldError::new(
                format!("{at}.root_device_hints"),
                "root_device_hints go with an image (an SSH host without one is adopted as it runs)",
            ));
        }
        if host.image.is_some() && !ramdisk {
            return Err(FieldError::new(
                format!("{at}.image"),
                "an SSH host with an image is kexec'ed into the ramdisk to write it: it needs a ramdisk_profile (top level)",
            ));
        }
        return Ok(());
    }
    let operations = host.image.is_some()
        || host.user_data.is_some()
        || host.root_device_hints.is_some()
        || host.bmc.is_some();
    if operations && !ramdisk {
        return Err(FieldError::new(
            at,
            "image, user_data, root_device_hints and bmc need a ramdisk_profile (top level) to provision with",
        ));
    }
    if host.user_data.is_some() && host.image.is_none() {
        return Err(FieldError::new(
            format!("{at}.user_data"),
            "user_data goes with an image or ssh",
        ));
    }
    Ok(())
}

impl Config {
    /// The served content directories (`tftp.root`, `http.root`) this machine does not have.
    /// The configuration is valid without them: the operator creates them and puts the site's
    /// files there, so `check-config` only reports them, while `serve` refuses to start
    /// without them ([`Config::require_content_dirs`]). One that exists but is no directory,
    /// or cannot be looked at, is an error.
    pub fn missing_content_dirs(&self) -> Result<Vec<MissingDir>, FieldError> {
        let roots =
            [("tftp.root", self.tftp.root.as_deref()), ("http.root", self.http.root.as_deref())];
        let mut missing = Vec::new();
        for (field, root) in roots {
            if let Some(path) = root
                && !dir_exists(path, field)?
            {
                missing.push(MissingDir { field, path: path.to_owned() });
            }
        }
        Ok(missing)
    }

    /// What `serve` needs before it starts: every served content directory exists.
    pub fn require_content_dirs(&self) -> Result<(), FieldError> {
        match self.missing_content_dirs()?.into_iter().next() {
            Some(missing) => Err(missing.into()),
            None => Ok(()),
        }
    }

    /// Opens `kubernetes.ramdisk_media`, if it is set: reads the whole ISO (some 100 MB) once
    /// to find its parameters region. Not part of [`Config::load`], which `siteboot probe`
    /// runs every few seconds; `serve` and `check-config` call it.
    pub fn open_ramdisk_media(&self) -> Result<Option<BootMedia>, FieldError> {
        let Some(path) = &self.ramdisk_media else {
            return Ok(None);
        };
        BootMedia::open(path)
            .map(Some)
            .map_err(|e| FieldError::new("kubernetes.ramdisk_media", e.to_string()))
    }
}

/// The deploy ramdisk's boot: profile `name`, which must boot a kernel.
fn ramdisk_boot(
    profiles: &BTreeMap<String, BootAction>,
    name: &str,
    field: &str,
) -> Result<LinuxBoot, FieldError> {
    match profiles.get(name) {
        Some(BootAction::Linux(linux)) => Ok(linux.clone()),
        Some(_) => Err(FieldError::new(field, format!("profile {name:?} must boot a kernel"))),
        None => Err(FieldError::new(field, format!("no profile named {name:?}"))),
    }
}

/// Host names are what `siteboot host` commands take and what a provisioned host calls itself
/// (`local-hostname`): DNS labels.
fn check_host_name(name: &str, field: &str) -> Result<(), FieldError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(FieldError::new(
            field,
            format!("{name:?} is not a host name (letters, digits and '-', at most 63)"),
        ))
    }
}

/// A host's provisioning, checked: an http(s) image with a SHA-256, and an absolute user-data
/// path (the file is read when an operation starts and when the ramdisk asks for it, so it may
/// be written after the config).
fn provisioning(image: &ImageFile, host: &HostFile, at: &str) -> Result<Provisioning, FieldError> {
    let url: siteboot_image::ImageUrl = image
        .url
        .parse()
        .map_err(|e| FieldError::new(format!("{at}.image.url"), format!("{:?}: {e}", image.url)))?;
    if !matches!(url, siteboot_image::ImageUrl::Http(_)) {
        return Err(FieldError::new(
            format!("{at}.image.url"),
            format!("{:?}: the image cache fetches http:// and https:// only", image.url),
        ));
    }
    image.checksum.parse::<siteboot_image::Digest>().map_err(|e| {
        FieldError::new(
            format!("{at}.image.checksum"),
            format!("{:?}: {e} (sha256:<64 hex digits>)", image.checksum),
        )
    })?;
    if let Some(path) = &host.user_data {
        absolute(path, &format!("{at}.user_data"))?;
    }
    Ok(Provisioning {
        image: Image {
            url: image.url.clone(),
            checksum: image.checksum.clone(),
            format: None,
            grow_last_partition: image.grow_last_partition,
        },
        user_data: host.user_data.clone(),
        root_device_hints: host.root_device_hints.as_ref().map(Into::into).unwrap_or_default(),
    })
}

/// A host's BMC, checked without I/O: a Redfish address, a pin if one is given, an absolute
/// path to the credentials (read when the BMC is used).
fn bmc(bmc: &BmcFile, at: &str) -> Result<HostBmc, FieldError> {
    let address = bmc.address.parse().map_err(|e: AddressError| {
        FieldError::new(format!("{at}.address"), format!("{:?}: {}", bmc.address, e.why))
    })?;
    let pin = bmc
        .certificate_fingerprint
        .as_ref()
        .map(|pin| {
            pin.parse().map_err(|why| {
                FieldError::new(format!("{at}.certificate_fingerprint"), format!("{pin:?}: {why}"))
            })
        })
        .transpose()?;
    absolute(&bmc.credentials_file, &format!("{at}.credentials_file"))?;
    Ok(HostBmc {
        address,
        pin,
        credentials_file: bmc.credentials_file.clone(),
        boot_mode: bmc.boot_mode,
    })
}

/// A host's SSH access, checked without I/O: a target SSH can use, a host key, absolute paths
/// to the private key and the user-data (read at each use).
fn host_ssh(ssh: &SshFile, host: &HostFile, at: &str) -> Result<HostSsh, FieldError> {
    let target = Target::new(&ssh.address.to_string(), ssh.port, &ssh.user)
        .map_err(|e| FieldError::new(format!("{at}.ssh"), e.to_string()))?;
    let host_key = ssh.host_key.parse().map_err(|e: HostKeyError| {
        FieldError::new(format!("{at}.ssh.host_key"), format!("{:?}: {e}", ssh.host_key))
    })?;
    absolute(&ssh.private_key_file, &format!("{at}.ssh.private_key_file"))?;
    if let Some(path) = &host.user_data {
        absolute(path, &format!("{at}.user_data"))?;
    }
    Ok(HostSsh {
        target,
        private_key_file: ssh.private_key_file.clone(),
        host_key,
        user_data: host.user_data.clone(),
    })
}

/// A file the config names, read when it is used: an absolute path, so it does not depend on
/// where `siteboot` was started.
fn absolute(path: &Path, field: &str) -> Result<(), FieldError> {
    if path.is_absolute() {
        return Ok(());
    }
    Err(FieldError::new(field, format!("{}: give an absolute path", path.display())))
}

fn check_http(h: &HttpSettings) -> Result<(), FieldError> {
    if h.port == 0 {
        return Err(FieldError::new("http.port", "must be 1-65535"));
    }
    if h.https_port == 0 || h.https_port == h.port {
        return Err(FieldError::new("http.https_port", "must be 1-65535 and not http.port"));
    }
    h.caps().map_err(|e| {
        let field = match e {
            CapsError::ZeroTotal => "http.max_connections",
            CapsError::ZeroPerAddress => "http.max_connections_per_address",
            CapsError::ReserveNotBelowTotal { .. } => "http.reserved_connections",
        };
        FieldError::new(field, e.to_string())
    })?;
    for (field, timeout) in [
        ("http.handshake_timeout", h.handshake_timeout),
        ("http.header_timeout", h.header_timeout),
        ("http.body_timeout", h.body_timeout),
        ("http.stall_timeout", h.stall_timeout),
    ] {
        if timeout.is_zero() {
            return Err(FieldError::new(field, "must be longer than 0s"));
        }
    }
    Ok(())
}

fn check_tftp(t: &TftpSettings) -> Result<(), FieldError> {
    // Unlike the content roots, the binaries are read when the file is checked
    // ([`ipxe_binaries`]), and are installed software (Debian's ipxe package), not the site's
    // files: their directory must exist to be valid.
    check_dir(&t.ipxe_dir, "tftp.ipxe_dir")?;
    t.caps().map_err(|e| {
        let field = match e {
            CapsError::ZeroPerAddress => "tftp.max_transfers_per_address",
            _ => "tftp.max_transfers",
        };
        FieldError::new(field, e.to_string())
    })?;
    if !(512..=65464).contains(&t.max_block_size) {
        return Err(FieldError::new("tftp.max_block_size", "must be 512-65464 (RFC 2348)"));
    }
    if t.max_window_size == 0 {
        return Err(FieldError::new("tftp.max_window_size", "must be at least 1"));
    }
    let rfc_2349 =
        |d: std::time::Duration| (1..=255).contains(&d.as_secs()) && d.subsec_nanos() == 0;
    if !rfc_2349(t.max_timeout) {
        return Err(FieldError::new(
            "tftp.max_timeout",
            "must be whole seconds from 1s to 255s (RFC 2349)",
        ));
    }
    if t.timeout.is_zero() || t.timeout > t.max_timeout {
        return Err(FieldError::new(
            "tftp.timeout",
            format!("must be longer than 0s and at most tftp.max_timeout ({:?})", t.max_timeout),
        ));
    }
    Ok(())
}

/// Refuses a served directory (`http.root`, `tftp.root`, `tftp.ipxe_dir`: anyone on the
/// provisioning segment reads what they hold) that holds what no one there may read: the state
/// directory (leases, host records, the generated TLS key), the TLS key, BMC credentials files
/// and user-data files.
fn check_served_roots(file: &ConfigFile) -> Result<(), FieldError> {
    let mut secrets: Vec<(String, &Path)> = vec![("state_dir".into(), &file.state_dir)];
    if let Some(tls) = &file.http.tls {
        secrets.push(("http.tls.key".into(), &tls.key));
    }
    for (i, host) in file.hosts.iter().enumerate() {
        if let Some(bmc) = &host.bmc {
            secrets.push((format!("hosts[{i}].bmc.credentials_file"), &bmc.credentials_file));
        }
        if let Some(user_data) = &host.user_data {
            secrets.push((format!("hosts[{i}].user_data"), user_data));
        }
    }
    let served = [
        ("http.root", file.http.root.as_deref()),
        ("tftp.root", file.tftp.root.as_deref()),
        ("tftp.ipxe_dir", Some(file.tftp.ipxe_dir.as_path())),
    ];
    for (field, root) in served {
        let Some(root) = root else { continue };
        let real_root = resolved(root);
        if let Some((what, path)) =
            secrets.iter().find(|(_, p)| resolved(p).starts_with(&real_root))
        {
            return Err(FieldError::new(
                field,
                format!(
                    "{} holds {what} ({}), which everyone on the provisioning segment could then read: serve a directory without it",
                    root.display(),
                    path.display()
                ),
            ));
        }
    }
    Ok(())
}

/// `path` with its symbolic links resolved as far as it exists (the rest as written), so a
/// directory and a path inside it compare however either is spelt.
fn resolved(path: &Path) -> PathBuf {
    let mut missing = Vec::new();
    let mut at = path;
    loop {
        if let Ok(found) = at.canonicalize() {
            return missing.iter().rev().fold(found, |p: PathBuf, name| p.join(name));
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                missing.push(name.to_owned());
                at = parent;
            }
            _ => return path.to_path_buf(),
        }
    }
}

fn check_dir(path: &Path, field: &'static str) -> Result<(), FieldError> {
    if dir_exists(path, field)? {
        Ok(())
    } else {
        Err(MissingDir { field, path: path.to_owned() }.into())
    }
}

/// Whether the directory `path` is on this machine: false if nothing is there; anything else
/// there, or a failure to look, is an error.
fn dir_exists(path: &Path, field: &str) -> Result<bool, FieldError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(true),
        Ok(_) => Err(FieldError::new(field, format!("{} is not a directory", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(FieldError::new(field, format!("{}: {e}", path.display()))),
    }
}

fn boot_action(p: &ProfileFile, at: &str) -> Result<BootAction, FieldError> {
    let kinds = [p.kernel.is_some(), p.script.is_some(), p.local_boot.is_some()];
    if kinds.iter().filter(|k| **k).count() != 1 {
        return Err(FieldError::new(at, "needs exactly one of kernel, script or local_boot"));
    }
    if p.kernel.is_none() && (!p.initrds.is_empty() || p.cmdline.is_some()) {
        return Err(FieldError::new(at, "initrds and cmdline go with kernel"));
    }
    if let Some(method) = p.local_boot {
        return Ok(BootAction::LocalDisk(method));
    }
    if let Some(script) = &p.script {
        if !script.starts_with("#!ipxe") {
            return Err(FieldError::new(
                format!("{at}.script"),
                "an iPXE script starts with #!ipxe",
            ));
        }
        return Ok(BootAction::Script(script.clone()));
    }
    let kernel = source(p.kernel.as_deref().expect("checked above"), &format!("{at}.kernel"))?;
    let initrds = p
        .initrds
        .iter()
        .enumerate()
        .map(|(i, s)| source(s, &format!("{at}.initrds[{i}]")))
        .collect::<Result<_, _>>()?;
    let cmdline = p
        .cmdline
        .as_deref()
        .unwrap_or("")
        .split_whitespace()
        .map(|arg| {
            Word::new(arg).map_err(|e| {
                FieldError::new(format!("{at}.cmdline"), format!("argument {arg:?} {e}"))
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(BootAction::Linux(LinuxBoot { kernel, initrds, cmdline }))
}

/// A kernel or initrd: an `http://`/`https://` URL, or a path under `http.root`.
fn source(s: &str, field: &str) -> Result<Source, FieldError> {
    let err = |m: String| FieldError::new(field, m);
    if s.starts_with("http://") || s.starts_with("https://") {
        return Word::url(s).map(Source::Url).map_err(|e| err(format!("URL {e}")));
    }
    if s.contains("://") {
        return Err(err(format!("{s:?}: only http:// and https:// URLs are fetched by iPXE here")));
    }
    let path = check_relative(s).map_err(|e| err(format!("{s:?}: {e}")))?;
    // A literal '%' in a file name must reach the server as %25, not start an escape.
    Word::url(&path.replace('%', "%25")).map(Source::File).map_err(|e| err(format!("path {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
interface: br0
address: 10.99.0.1
state_dir: /tmp/x
dhcp:
  subnets:
    - subnet: 10.99.0.0/24
      pools: [10.99.0.100-10.99.0.199]
tftp:
  ipxe_dir: IPXE
profiles:
  linux:
    kernel: vmlinuz
    initrds: [initrd.img]
    cmdline: console=ttyS0 quiet
  disk:
    local_boot: exit
hosts:
  - mac: 52:54:00:12:34:56
    profile: linux
unknown_hosts:
  profile: disk
"#;

    fn with_ipxe(text: &str) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("undionly.kpxe"), b"x").unwrap();
        let text = text.replace("IPXE", dir.path().to_str().unwrap());
        (dir, text)
    }

    fn error_of(text: &str) -> FieldError {
        let (_dir, text) = with_ipxe(text);
        Config::parse(&text).expect_err("config should be refused")
    }

    #[test]
    fn good_config_loads() {
        let (_dir, text) = with_ipxe(GOOD);
        let config = Config::parse(&text).unwrap();
        assert_eq!(config.interface, "br0");
        assert_eq!(config.plan.subnets.len(), 1);
        assert_eq!(config.http.port, 8080);
        assert_eq!(config.tftp.max_transfers, 256);
    }

    #[test]
    fn the_status_page_lists_hosts_with_their_profile_and_reservation() {
        use siteboot_boot::Inventory;

        let text = GOOD.replace(
            "dhcp:\n",
            "dhcp:\n  reservations:\n    - { mac: '52:54:00:12:34:56', address: 10.99.0.10, hostname: node-a }\n",
        );
        let (_dir, text) = with_ipxe(&text);
        let config = Config::parse(&text).unwrap();
        assert!(config.http.status_page, "on by default");
        let hosts = config.inventory.hosts();
        assert_eq!(hosts.len(), 1);
        assert_eq!(hosts[0].mac, "52:54:00:12:34:56".parse().unwrap());
        assert_eq!(hosts[0].name.as_deref(), Some("node-a"));
        assert_eq!(hosts[0].address, Some("10.99.0.10".parse().unwrap()));
        assert_eq!(hosts[0].state, "profile linux");
        let (_dir, off) = with_ipxe(&format!("{GOOD}\nhttp:\n  status_page: false\n"));
        assert!(!Config::parse(&off).unwrap().http.status_page);
    }

    #[test]
    fn errors_name_the_field() {
        let cases: &[(&str, &str, &str)] = &[
            ("address: 10.99.0.1", "address: 10.99.0.300", "address"),
            (
                "      pools: [10.99.0.100-10.99.0.199]",
                "      pools: [10.99.0.100-10.99.1.199]",
                "dhcp.subnets[0].pools[0]",
            ),
            (
                "      pools: [10.99.0.100-10.99.0.199]",
                "      pools: [nonsense]",
                "dhcp.subnets[0].pools[0]",
            ),
            (
                "    cmdline: console=ttyS0 quiet",
                "    cmdline: console=ttyS0 ${evil}",
                "profiles.linux.cmdline",
            ),
            ("    kernel: vmlinuz", "    kernel: ../../etc/shadow", "profiles.linux.kernel"),
            ("    kernel: vmlinuz", "    kernel: tftp://x/vmlinuz", "profiles.linux.kernel"),
            ("    profile: linux", "    profile: nosuch", "hosts[0].profile"),
            ("  - mac: 52:54:00:12:34:56", "  - mac: 52:54:00:12:34", "hosts[0].mac"),
            ("  profile: disk", "  profile: nope", "unknown_hosts.profile"),
            ("    local_boot: exit", "    local_boot: reboot", "profiles.disk.local_boot"),
            ("    local_boot: exit", "    local_boot: exit\n    script: '#!ipxe'", "profiles.disk"),
            ("state_dir: /tmp/x", "state_dir: /tmp/x\nbogus: 1", "bogus"),
            ("  ipxe_dir: IPXE", "  ipxe_dir: /nonexistent", "tftp.ipxe_dir"),
        ];
        for (from, to, field) in cases {
            assert!(GOOD.contains(from), "{from}");
            let e = error_of(&GOOD.replace(from, to));
            assert_eq!(&e.field, field, "{to}: got {e}");
        }
        let e = error_of(&GOOD.replace("state_dir: /tmp/x", "state_dir: /tmp/x\nbogus: 1"));
        assert!(e.message.contains("unknown field `bogus`"), "{e}");
        let e = error_of(
            &GOOD.replace("    cmdline: console=ttyS0 quiet", "    cmdline: console=ttyS0 ${evil}"),
        );
        assert!(e.message.contains("'$'"), "{e}");
    }

    /// `hosts[].relay_agent` is read into the pin the DHCP server checks, or refused naming
    /// the field.
    #[test]
    fn relay_agent_pins_are_read_per_host() {
        use siteboot_boot::inventory::Inventory;
        let with = |pin: &str| {
            GOOD.replace(
                "    profile: linux\n",
                &format!("    profile: linux\n    relay_agent: {pin}\n"),
            )
        };
        let (_dir, text) =
            with_ipxe(&with("{circuit_id: eth1/0/12, remote_id: 'hex:000c29a1b2c3'}"));
        let config = Config::parse(&text).unwrap();
        let pin = config.inventory.relay_pin("52:54:00:12:34:56".parse().unwrap()).unwrap();
        assert_eq!(pin.to_string(), "circuit-id eth1/0/12, remote-id hex:000c29a1b2c3");
        assert_eq!(config.inventory.relay_pin("52:54:00:12:34:57".parse().unwrap()), None);
        let (_dir, text) = with_ipxe(GOOD);
        let unpinned = Config::parse(&text).unwrap();
        assert_eq!(unpinned.inventory.relay_pin("52:54:00:12:34:56".parse().unwrap()), None);
        for (pin, field, says) in [
            ("{}", "hosts[0].relay_agent", "circuit_id, remote_id or both"),
            ("{circuit_id: ''}", "hosts[0].relay_agent.circuit_id", "empty"),
            ("{remote_id: 'hex:0c2'}", "hosts[0].relay_agent.remote_id", "two hex digits"),
            ("{circuit: eth1}", "hosts[0].relay_agent.circuit", "unknown field `circuit`"),
            ("eth1/0/12", "hosts[0].relay_agent", ""),
        ] {
            let e = error_of(&with(pin));
            assert_eq!((e.field.as_str(), e.message.contains(says)), (field, true), "{pin}: {e}");
        }
    }

    #[test]
    fn provisioned_hosts_are_checked_field_by_field() {
        let dir = tempfile::tempdir().unwrap();
        let user_data = dir.path().join("user-data");
        std::fs::write(&user_data, b"#cloud-config\n").unwrap();
        let sum = format!("sha256:{}", "ab".repeat(32));
        let host = |extra: &str| {
            GOOD.replace(
                "    profile: linux\n",
                &format!(
                    "    profile: linux\n    name: node-a\n    image: {{ url: 'http://10.99.0.1:8080/files/os.img', checksum: '{sum}' }}\n    user_data: {}\n{extra}",
                    user_data.display()
                ),
            ) + "ramdisk_profile: linux\n"
        };
        let (_ipxe, text) = with_ipxe(&host("    wipe: full\n"));
        let config = Config::parse(&text).unwrap();
        assert!(config.ramdisk.is_some());
        let cases: &[(String, &str)] = &[
            (host("").replace("'http://10.99", "'file:///10.99"), "hosts[0].image.url"),
            (host("").replace(&sum, "sha256:12"), "hosts[0].image.checksum"),
            (host("").replace(user_data.to_str().unwrap(), "relative/path"), "hosts[0].user_data"),
            (host("    wipe: sometimes\n"), "hosts[0].wipe"),
            (
                host("    root_device_hints: { serial: S1, bogus: 1 }\n"),
                "hosts[0].root_device_hints.bogus",
            ),
            (host("").replace("name: node-a", "name: node_a"), "hosts[0].name"),
            (
                host("").replace("ramdisk_profile: linux", "ramdisk_profile: disk"),
                "ramdisk_profile",
            ),
            (host("").replace("ramdisk_profile: linux\n", ""), "hosts[0]"),
            (host("") + "ramdisk_silence_timeout: 0s\n", "ramdisk_silence_timeout"),
        ];
        for (text, field) in cases {
            let e = error_of(text);
            assert_eq!(&e.field, field, "got {e}\n{text}");
        }
        assert_eq!(config.ramdisk_silence_timeout, std::time::Duration::from_secs(15 * 60));
    }

    #[test]
    fn a_host_bmc_is_checked_and_keeps_no_secret() {
        let bmc = |fields: &str| {
            GOOD.replace(
                "    profile: linux\n",
                &format!("    profile: linux\n    bmc: {{ {fields} }}\n"),
            ) + "ramdisk_profile: linux\n"
        };
        let address = "address: 'redfish+https://10.0.0.5:8443/redfish/v1/Systems/1'";
        let pin = format!("certificate_fingerprint: 'sha256:{}'", "ab".repeat(32));
        let good = bmc(&format!(
            "{address}, credentials_file: /etc/siteboot/bmc.yaml, {pin}, boot_mode: Legacy"
        ));
        let (_ipxe, text) = with_ipxe(&good);
        let config = Config::parse(&text).unwrap();
        let view = config.inventory.show("52:54:00:12:34:56").unwrap();
        let shown = view.bmc.as_deref();
        assert_eq!(shown, Some("redfish+https://10.0.0.5:8443/redfish/v1/Systems/1"));
        let cases: &[(String, &str, &str)] = &[
            (
                bmc("address: 'ipmi://10.0.0.5/redfish/v1/Systems/1', credentials_file: /c"),
                "hosts[0].bmc.address",
                "the scheme is not redfish",
            ),
            (
                bmc("address: 'redfish://admin:pw@h/redfish/v1/Systems/1', credentials_file: /c"),
                "hosts[0].bmc.address",
                "credentials do not belong in the address",
            ),
            (
                bmc(&format!("{address}, credentials_file: bmc.yaml")),
                "hosts[0].bmc.credentials_file",
                "absolute",
            ),
            (
                bmc(&format!("{address}, credentials_file: /c, certificate_fingerprint: 'md5:00'")),
                "hosts[0].bmc.certificate_fingerprint",
                "sha256:",
            ),
            (
                bmc(&format!("{address}, credentials_file: /c, password: x")),
                "hosts[0].bmc.password",
                "unknown field",
            ),
            (
                bmc(&format!("{address}, credentials_file: /c, boot_mode: BIOS")),
                "hosts[0].bmc.boot_mode",
                "unknown variant",
            ),
            (
                bmc(&format!("{address}, credentials_file: /c"))
                    .replace("ramdisk_profile: linux\n", ""),
                "hosts[0]",
                "bmc need a ramdisk_profile",
            ),
        ];
        for (text, field, message) in cases {
            let e = error_of(text);
            assert_eq!(&e.field, field, "got {e}\n{text}");
            assert!(e.message.contains(message), "{e}");
        }
    }

    /// An SSH host needs no ramdisk, takes its user_data without an image, and refuses what
    /// only a ramdisk could use; with an image (reimaged: kexec'ed into the ramdisk) it needs
    /// the ramdisk_profile.
    #[test]
    fn a_host_reached_over_ssh_is_checked_without_a_ramdisk() {
        let key =
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEwlXB8lkkHcwFYCSCopHZP7EL7EaFMGYyYTWBLhWrBu";
        let ssh = |fields: &str, more: &str| {
            GOOD.replace(
                "    profile: linux\n",
                &format!("    profile: linux\n    ssh: {{ {fields} }}\n{more}"),
            )
        };
        let fields = format!("address: 10.0.0.21, private_key_file: /k, host_key: '{key}'");
        let (_ipxe, text) = with_ipxe(&ssh(&fields, "    user_data: /etc/siteboot/u\n"));
        let config = Config::parse(&text).unwrap();
        let view = config.inventory.show("52:54:00:12:34:56").unwrap();
        assert_eq!(view.ssh.as_deref(), Some("10.0.0.21:22"), "port 22 by default");
        assert!(config.ramdisk.is_none() && config.inventory.has_ssh_hosts());
        let cases: &[(String, &str, &str)] = &[
            (
                ssh(
                    &fields,
                    &format!(
                        "    image: {{ url: 'http://h/i.raw', checksum: 'sha256:{}' }}\n",
                        "0".repeat(64)
                    ),
                ),
                "hosts[0].image",
                "needs a ramdisk_profile",
            ),
            (
                ssh(&fields, "    root_device_hints: { name: sdb }\n"),
                "hosts[0].root_device_hints",
                "go with an image",
            ),
            (
                ssh(&fields, "    wipe: full\n    bmc: { address: x, credentials_file: /c }\n"),
                "hosts[0].bmc",
                "reached over SSH only",
            ),
            (ssh(&fields.replace("/k", "k"), ""), "hosts[0].ssh.private_key_file", "absolute"),
            (ssh(&fields.replace(key, "ssh-ed25519 AAAA"), ""), "hosts[0].ssh.host_key", "AAAA"),
            (ssh(&fields.replace("10.0.0.21", "db-1.example"), ""), "hosts[0].ssh.address", ""),
            (ssh(&format!("{fields}, user: 'root; reboot'"), ""), "hosts[0].ssh", "user"),
            (ssh(&format!("{fields}, password: x"), ""), "hosts[0].ssh.password", "unknown field"),
        ];
        for (text, field, message) in cases {
            let e = error_of(text);
            assert_eq!(&e.field, field, "got {e}\n{text}");
            assert!(e.message.contains(message), "{e}");
        }
    }

    #[test]
    fn connection_caps_and_deadlines_are_checked() {
        let (_dir, text) = with_ipxe(GOOD);
        let config = Config::parse(&text).unwrap();
        assert_eq!(config.http.max_connections_per_address, 16);
        assert_eq!(config.http.reserved_connections(), 64, "a sixteenth by default");
        assert_eq!(config.http.header_timeout, std::time::Duration::from_secs(10));
        assert_eq!(config.http.https_port, 8443);
        assert_eq!(config.http.tls, None, "generated in state_dir unless configured");
        assert_eq!(config.http.handshake_timeout, std::time::Duration::from_secs(10));
        assert_eq!(config.drain_timeout, std::time::Duration::from_secs(10));
        assert_eq!(config.tftp.max_transfers_per_address, 8);
        assert_eq!(config.tftp.max_timeout, std::time::Duration::from_secs(10));
        let cases: &[(&str, &str)] = &[
            ("http:\n  max_connections: 0", "http.max_connections"),
            ("http:\n  max_connections_per_address: 0", "http.max_connections_per_address"),
            ("http:\n  max_connections: 8\n  reserved_connections: 8", "http.reserved_connections"),
            ("http:\n  header_timeout: 0s", "http.header_timeout"),
            ("http:\n  body_timeout: 0s", "http.body_timeout"),
            ("http:\n  stall_timeout: 0s", "http.stall_timeout"),
            ("http:\n  handshake_timeout: 0s", "http.handshake_timeout"),
            ("drain_timeout: 0s", "drain_timeout"),
            ("http:\n  https_port: 8080", "http.https_port"),
            ("http:\n  tls:\n    certificate: /x.crt", "http.tls"),
            ("  max_transfers: 0", "tftp.max_transfers"),
            ("  max_transfers_per_address: 0", "tftp.max_transfers_per_address"),
            ("  max_timeout: 256s", "tftp.max_timeout"),
            ("  max_timeout: 1500ms", "tftp.max_timeout"),
            ("  timeout: 11s", "tftp.timeout"),
        ];
        for (extra, field) in cases {
            // Unindented lines start a section or set a top-level field; indented ones go into
            // the tftp: section.
            let text = if !extra.starts_with(' ') {
                format!("{GOOD}\n{extra}\n")
            } else {
                GOOD.replace("  ipxe_dir: IPXE", &format!("  ipxe_dir: IPXE\n{extra}"))
            };
            let e = error_of(&text);
            assert_eq!(&e.field, field, "{extra}: got {e}");
        }
        // The reserve follows max_connections unless set.
        let small = format!("{GOOD}\nhttp:\n  max_connections: 8\n");
        let (_dir, text) = with_ipxe(&small);
        assert_eq!(Config::parse(&text).unwrap().http.reserved_connections(), 0);
    }

    #[cfg(feature = "kubernetes")]
    /// Replicas that share the deploy manifests' config (no `address`) each serve at their own
    /// node's address on the interface: the one in the DHCP subnet.
    #[test]
    fn replicas_sharing_the_deploy_config_each_serve_at_their_node_s_address() {
        use siteboot_controller::manifests::{ApplianceSite, appliance};
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("undionly.kpxe"), b"x").unwrap();
        let objects = appliance(&ApplianceSite::example("img"));
        let config = objects[0]["data"]["siteboot.yaml"].as_str().unwrap();
        let here = dir.path().to_str().unwrap();
        let config = config
            .replacen("tftp:\n", &format!("tftp:\n  ipxe_dir: {here}\n"), 1)
            .replace("/srv/siteboot", here);
        let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        let on_node = |addresses: Vec<Ipv4Addr>| {
            let file: ConfigFile = serde_norway::from_str(&config).unwrap();
            assert_eq!(file.interface, "eth1");
            Config::check(file, move |interface| {
                assert_eq!(interface, "eth1");
                Ok(addresses)
            })
        };
        let a = on_node(vec![ip("192.168.7.21"), ip("10.99.0.2")]).unwrap();
        let b = on_node(vec![ip("10.99.0.3"), ip("172.16.0.3")]).unwrap();
        assert_eq!((a.address, b.address), (ip("10.99.0.2"), ip("10.99.0.3")));
        for (addresses, why) in [
            (vec![ip("192.168.7.21")], "no IPv4 address in dhcp.subnets"),
            (vec![ip("10.99.0.2"), ip("10.99.0.3")], "several addresses in dhcp.subnets"),
        ] {
            let e = on_node(addresses).unwrap_err();
            assert_eq!(e.field, "address");
            assert!(e.message.contains(why), "{}", e.message);
        }
    }

    fn example(name: &str) -> String {
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        std::fs::read_to_string(examples.join(name)).unwrap()
    }

    /// The example configurations this build reads: kubernetes.yaml needs Kubernetes mode.
    const EXAMPLES: &[&str] = if cfg!(feature = "kubernetes") {
        &["standalone.yaml", "kubernetes.yaml"]
    } else {
        &["standalone.yaml"]
    };

    /// The example configurations are valid (their directories replaced by ones that exist).
    #[test]
    fn examples_load() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("undionly.kpxe"), b"x").unwrap();
        for name in EXAMPLES {
            let here = dir.path().to_str().unwrap();
            let text = example(name).replace("/srv/siteboot", here).replace("/usr/lib/ipxe", here);
            let config = Config::parse(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            #[cfg(feature = "kubernetes")]
            assert_eq!(config.kubernetes.is_some(), *name == "kubernetes.yaml");
            #[cfg(not(feature = "kubernetes"))]
            drop(config);
        }
    }

    #[cfg(feature = "kubernetes")]
    /// Fields whose example value is not their default: what every file must give, the
    /// examples' own data, and defaults that follow other fields.
    const EXAMPLE_VALUES: &[&str] = &[
        "interface",
        "address",
        "dhcp.subnets",
        "dhcp.reservations",
        // Unset, it follows the mode.
        "dhcp.known_hosts_only",
        "http.root",
        // Unset (generated): kubernetes.yaml shows a certificate shared by the replicas.
        "http.tls",
        // Unset, a sixteenth of max_connections.
        "http.reserved_connections",
        "profiles",
        "hosts",
        "unknown_hosts",
        "ramdisk_profile",
        "kubernetes.site",
        "kubernetes.ramdisk_profile",
    ];

    #[cfg(feature = "kubernetes")]
    /// The examples are the reference of the file format. standalone.yaml shows every field
    /// both modes have, kubernetes.yaml its `kubernetes:` section (and may show a part of the
    /// rest; the fields of an optional section standalone.yaml shows unset). Which fields exist
    /// comes from serde itself (see [`crate::serde_keys`]), so a new
    /// field fails here, by name, until an example shows it. Every value shown must be the
    /// default, but for [`EXAMPLE_VALUES`]: the file without that line must parse the same.
    #[test]
    fn examples_show_every_field_with_its_default() {
        let standalone = crate::serde_keys::keys::<ConfigFile>(&example("standalone.yaml"));
        let kubernetes = crate::serde_keys::keys::<ConfigFile>(&example("kubernetes.yaml"));
        let (standalone, kubernetes) = (standalone.unwrap(), kubernetes.unwrap());
        let mut missing = Vec::new();
        for key in standalone.accepted.union(&kubernetes.accepted) {
            let (shown_in, name) = if key == "kubernetes" || key.starts_with("kubernetes.") {
                (&kubernetes, "kubernetes.yaml")
            } else {
                (&standalone, "standalone.yaml")
            };
            // An optional section standalone.yaml leaves unset (`null`) may have its fields
            // shown in kubernetes.yaml instead.
            let parent_unset_here = key.rsplit_once('.').is_some_and(|(parent, _)| {
                standalone.present.contains(parent) && kubernetes.present.contains(key)
            });
            if !shown_in.present.contains(key) && !parent_unset_here {
                missing.push(format!("{key} (in examples/{name})"));
            }
        }
        assert!(missing.is_empty(), "fields no example shows: {}", missing.join(", "));

        for name in ["standalone.yaml", "kubernetes.yaml"] {
            let doc: serde_norway::Value = serde_norway::from_str(&example(name)).unwrap();
            let parsed = |doc: &serde_norway::Value| {
                format!("{:?}", serde_norway::from_value::<ConfigFile>(doc.clone()).unwrap())
            };
            let shown = parsed(&doc);
            let mut leaves = Vec::new();
            collect_leaves(&doc, &mut Vec::new(), &mut leaves);
            for path in leaves {
                let mut without = doc.clone();
                let (last, parents) = path.split_last().unwrap();
                let section =
                    parents.iter().fold(&mut without, |v, key| v.get_mut(key.as_str()).unwrap());
                let value = section.as_mapping_mut().unwrap().remove(last.as_str()).unwrap();
                assert_eq!(
                    parsed(&without),
                    shown,
                    "examples/{name}: {} shows {value:?}, which is not its default",
                    path.join(".")
                );
            }
        }
    }

    /// The paths of the values in `value`, but for [`EXAMPLE_VALUES`].
    #[cfg(feature = "kubernetes")]
    fn collect_leaves(
        value: &serde_norway::Value,
        at: &mut Vec<String>,
        out: &mut Vec<Vec<String>>,
    ) {
        let Some(mapping) = value.as_mapping() else { return out.push(at.clone()) };
        for (key, value) in mapping {
            at.push(key.as_str().unwrap().to_owned());
            if !EXAMPLE_VALUES.contains(&at.join(".").as_str()) {
                collect_leaves(value, at, out);
            }
            at.pop();
        }
    }

    #[cfg(feature = "kubernetes")]
    #[test]
    fn known_hosts_only_defaults_by_mode() {
        let kubernetes =
            GOOD.replace("hosts:\n  - mac: 52:54:00:12:34:56\n    profile: linux\n", "").replace(
                "unknown_hosts:\n  profile: disk\n",
                "kubernetes:\n  ramdisk_profile: linux\n",
            );
        let explicit = |text: &str, value: bool| {
            text.replace("dhcp:\n", &format!("dhcp:\n  known_hosts_only: {value}\n"))
        };
        for (text, expected) in [
            (GOOD.to_owned(), false),
            (explicit(GOOD, true), true),
            (kubernetes.clone(), true),
            (explicit(&kubernetes, false), false),
        ] {
            let (_dir, text) = with_ipxe(&text);
            let config = Config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            assert_eq!(config.known_hosts_only, expected, "{text}");
        }
    }

    #[cfg(feature = "kubernetes")]
    /// Both forms of `host_namespaces`: a plain name is open to every tenant, a pool only to
    /// the tenants it lists; a namespace listed twice is refused.
    #[test]
    fn host_pools_list_their_tenants() {
        let kubernetes = |pools: &str| {
            GOOD.replace("hosts:\n  - mac: 52:54:00:12:34:56\n    profile: linux\n", "").replace(
                "unknown_hosts:\n  profile: disk\n",
                &format!("kubernetes:\n  ramdisk_profile: linux\n  host_namespaces: {pools}\n"),
            )
        };
        let parse = |pools: &str| {
            let (_dir, text) = with_ipxe(&kubernetes(pools));
            Config::parse(&text).map(|c| c.kubernetes.unwrap().host_pools)
        };
        let pools = parse("[shared, { namespace: pool-a, tenants: [team-a] }]").unwrap();
        assert_eq!(pools.may_take("team-b", "shared"), Ok(()));
        assert_eq!(pools.may_take("team-a", "pool-a"), Ok(()));
        assert!(pools.may_take("team-b", "pool-a").is_err());
        assert!(pools.may_take("team-a", "elsewhere").is_err());
        let twice = parse("[pool-a, { namespace: pool-a, tenants: [team-a] }]").unwrap_err();
        assert_eq!(twice.field, "kubernetes.host_namespaces", "{twice}");
        assert!(parse("[{ namespace: pool-a, tenant: [team-a] }]").is_err(), "a misspelt field");
    }

    #[cfg(feature = "kubernetes")]
    /// `kubernetes.ramdisk_media`: an absolute path, checked by parsing; the file itself is
    /// read only when opened (serve, check-config), and a file that is no boot ISO is refused
    /// there, naming the field.
    #[test]
    fn ramdisk_media_is_an_absolute_path_opened_on_demand() {
        let dir = tempfile::tempdir().unwrap();
        let parse = |media: &str| {
            let text = GOOD
                .replace("hosts:\n  - mac: 52:54:00:12:34:56\n    profile: linux\n", "")
                .replace(
                    "unknown_hosts:\n  profile: disk\n",
                    &format!("kubernetes:\n  ramdisk_profile: linux\n{media}"),
                );
            let (_ipxe, text) = with_ipxe(&text);
            Config::parse(&text)
        };
        assert!(parse("").unwrap().open_ramdisk_media().unwrap().is_none());
        let relative = parse("  ramdisk_media: ramdisk.iso\n").unwrap_err();
        assert_eq!(relative.field, "kubernetes.ramdisk_media", "{relative}");

        let iso = dir.path().join("ramdisk.iso");
        let config = parse(&format!("  ramdisk_media: {}\n", iso.display())).unwrap();
        let missing = config.open_ramdisk_media().unwrap_err();
        assert_eq!(missing.field, "kubernetes.ramdisk_media");
        assert!(missing.message.contains(&*iso.to_string_lossy()), "{missing}");
        std::fs::write(&iso, b"no region here").unwrap();
        let not_media = config.open_ramdisk_media().unwrap_err();
        assert!(not_media.message.contains("not a siteboot boot ISO"), "{not_media}");

        let mut good = b"boot code ".to_vec();
        good.extend(siteboot_boot::media::MARKER);
        good.resize(10 + siteboot_boot::media::REGION_LEN + 100, b' ');
        std::fs::write(&iso, good).unwrap();
        let media = config.open_ramdisk_media().unwrap().expect("media");
        assert_eq!(media.region_offset(), 10);
    }

    /// What anyone on the segment reads: a served root holding the state directory, the TLS
    /// key, a BMC credentials file or a user-data file is refused, however the path is spelt.
    #[test]
    fn a_served_root_never_holds_what_the_segment_may_not_read() {
        let served = tempfile::tempdir().unwrap();
        let root = served.path().display().to_string();
        let inside = |name: &str| served.path().join(name).display().to_string();
        std::os::unix::fs::symlink(served.path(), served.path().join("alias")).unwrap();
        let state = |dir: &str| GOOD.replace("/tmp/x", dir);
        let http = |config: String, http: &str| format!("{config}http:\n{http}");
        let tftp_root = |config: String| {
            config.replace("  ipxe_dir: IPXE\n", &format!("  ipxe_dir: IPXE\n  root: {root}\n"))
        };
        let user_data = |config: String, path: &str| {
            config.replace(
                "    profile: linux\n",
                &format!(
                    "    profile: linux\n    image: {{ url: 'http://x/os.img', checksum: 'sha256:{}' }}\n    user_data: {path}\nramdisk_profile: linux\n",
                    "0".repeat(64)
                ),
            )
        };
        let http_root = format!("  root: {root}\n");
        for (config, field, holds) in [
            (http(state(&inside("state")), &http_root), "http.root", "state_dir"),
            (http(state(&inside("alias/state/deeper")), &http_root), "http.root", "state_dir"),
            (
                http(
                    tftp_root(GOOD.into()),
                    &format!("  tls:\n    certificate: /c.pem\n    key: {}\n", inside("tls.key")),
                ),
                "tftp.root",
                "http.tls.key",
            ),
            (
                http(user_data(GOOD.into(), &inside("alias/node.user-data")), &http_root),
                "http.root",
                "hosts[0].user_data",
            ),
        ] {
            let e = error_of(&config);
            assert_eq!(e.field, field, "{e}\n{config}");
            assert!(e.message.contains(holds), "{e}");
        }
        // Beside each other is fine.
        std::fs::create_dir(served.path().join("www")).unwrap();
        let beside = http(state(&inside("state")), &format!("  root: {}\n", inside("www")));
        let (_dir, text) = with_ipxe(&beside);
        Config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    }

    /// `http.root` and `tftp.root` hold the site's files, which a fresh machine does not have
    /// yet: the file is valid without them, and what `serve` needs is listed; anything else at
    /// their path is an error. The iPXE binaries' directory must exist to be valid.
    #[test]
    fn content_dirs_may_be_missing_until_served() {
        let dir = tempfile::tempdir().unwrap();
        let (http_root, tftp_root) = (dir.path().join("www"), dir.path().join("tftp"));
        let roots = |http_root: &Path| {
            GOOD.replace(
                "  ipxe_dir: IPXE\n",
                &format!("  ipxe_dir: IPXE\n  root: {}\n", tftp_root.display()),
            ) + &format!("http:\n  root: {}\n", http_root.display())
        };
        let (_ipxe, text) = with_ipxe(&roots(&http_root));
        let config = Config::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(
            config.missing_content_dirs().unwrap(),
            [
                MissingDir { field: "tftp.root", path: tftp_root.clone() },
                MissingDir { field: "http.root", path: http_root.clone() },
            ]
        );
        let refused = config.require_content_dirs().unwrap_err();
        assert_eq!(refused.field, "tftp.root");
        let expected = format!(
            "{}: no such directory (create it, or point tftp.root elsewhere)",
            tftp_root.display()
        );
        assert_eq!(refused.message, expected);

        std::fs::create_dir(&tftp_root).unwrap();
        std::fs::create_dir(&http_root).unwrap();
        assert_eq!(config.missing_content_dirs().unwrap(), []);
        config.require_content_dirs().unwrap();

        let file = dir.path().join("a-file");
        std::fs::write(&file, b"").unwrap();
        let (_ipxe, text) = with_ipxe(&roots(&file));
        let not_dir = Config::parse(&text).unwrap().missing_content_dirs().unwrap_err();
        assert_eq!(not_dir.field, "http.root");
        assert!(not_dir.message.ends_with("is not a directory"), "{not_dir}");

        let no_ipxe = error_of(&GOOD.replace("ipxe_dir: IPXE", "ipxe_dir: /nonexistent"));
        assert_eq!(no_ipxe.field, "tftp.ipxe_dir");
        assert!(no_ipxe.message.contains("no such directory"), "{no_ipxe}");
    }

    /// A build without Kubernetes mode refuses a `kubernetes:` section, saying why, rather than
    /// serve as a standalone appliance what was meant for a site's Hosts.
    #[cfg(not(feature = "kubernetes"))]
    #[test]
    fn a_kubernetes_section_needs_kubernetes_mode_built_in() {
        let kubernetes =
            GOOD.replace("hosts:\n  - mac: 52:54:00:12:34:56\n    profile: linux\n", "").replace(
                "unknown_hosts:\n  profile: disk\n",
                "kubernetes:\n  ramdisk_profile: linux\n",
            );
        let (_dir, text) = with_ipxe(&kubernetes);
        let refused = Config::parse(&text).unwrap_err();
        assert_eq!(refused.field, "kubernetes", "{refused}");
        assert!(refused.message.contains("built without Kubernetes mode"), "{refused}");
    }

    #[test]
    fn load_reports_the_file() {
        let e = Config::load(Path::new("/nonexistent/siteboot.yaml")).unwrap_err();
        assert!(e.to_string().starts_with("/nonexistent/siteboot.yaml: cannot read"), "{e}");
    }
}
