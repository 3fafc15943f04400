//! The boot decision: from "this client, this firmware, this host" to what it is sent. Pure
//! functions, so every combination is unit-tested without a network.

use serde::{Deserialize, Serialize};
use siteboot_ipxe::{IpxeBinaries, Platform, Script, Word};

use crate::client::{BootClient, ClientArch};
use crate::inventory::{BootAction, LocalBoot, Source};
use crate::{AgentEndpoint, Endpoints, MacAddr};

/// How siteboot takes part in DHCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DhcpMode {
    /// siteboot is the DHCP server: addresses and boot information.
    #[default]
    Full,
    /// Another server hands out addresses; siteboot adds boot information only (proxyDHCP).
    Proxy,
    /// No DHCP.
    Off,
}

/// What DHCP tells a client to load first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootOffer {
    /// Firmware PXE: fetch this iPXE binary from us over TFTP.
    Tftp { file: String },
    /// UEFI HTTP boot: fetch this URL (an iPXE binary); the reply must carry vendor class
    /// `HTTPClient`.
    HttpBoot { url: String },
    /// iPXE is running: fetch the per-host script over HTTP.
    Script { url: String },
}

impl BootOffer {
    /// The DHCP `file` field / option 67 value.
    pub fn boot_file(&self) -> &str {
        match self {
            BootOffer::Tftp { file } => file,
            BootOffer::HttpBoot { url } | BootOffer::Script { url } => url,
        }
    }
}

/// Why a client gets no boot information.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoBoot {
    /// Not a firmware or iPXE boot request (an operating system's DHCP client).
    NotNetworkBoot,
    /// The inventory does not boot this MAC (unknown host with no default profile).
    NotInInventory,
    /// A firmware architecture siteboot has no iPXE build for.
    UnsupportedArch(ClientArch),
    /// The iPXE binary for this platform is not in the iPXE directory.
    NoBinary(Platform),
}

impl std::fmt::Display for NoBoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoBoot::NotNetworkBoot => f.write_str("not a network-boot request"),
            NoBoot::NotInInventory => f.write_str("host not in inventory and no default profile"),
            NoBoot::UnsupportedArch(a) => write!(f, "unsupported client architecture {a:?}"),
            NoBoot::NoBinary(p) => {
                write!(f, "no iPXE binary for platform {p} in the iPXE directory")
            }
        }
    }
}

/// What to send for one client's boot request.
pub fn boot_offer(
    client: &BootClient,
    in_inventory: bool,
    binaries: &IpxeBinaries,
    endpoints: &Endpoints,
) -> Result<BootOffer, NoBoot> {
    if !in_inventory {
        return Err(NoBoot::NotInInventory);
    }
    // iPXE first: it may also send PXEClient and option 93, and sending it the iPXE binary
    // again would loop forever.
    if client.ipxe {
        return Ok(BootOffer::Script { url: endpoints.script_url(client.mac) });
    }
    if !client.firmware_boot {
        return Err(NoBoot::NotNetworkBoot);
    }
    // PXE 2.1 clients that predate RFC 4578 send no option 93: they are x86 BIOS.
    let arch = client.arch.unwrap_or(ClientArch::Bios);
    let platform = arch.platform().ok_or(NoBoot::UnsupportedArch(arch))?;
    let file = binaries.file_for(platform).ok_or(NoBoot::NoBinary(platform))?;
    if arch.is_http_boot() || client.http_client {
        Ok(BootOffer::HttpBoot { url: endpoints.ipxe_binary_url(file) })
    } else {
        Ok(BootOffer::Tftp { file: file.to_owned() })
    }
}

/// The DHCP-level answer: the boot decision combined with the DHCP mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Say nothing (proxy mode with nothing to add, or DHCP off).
    Ignore,
    /// Full mode: an address, and no boot information for this reason.
    AddressOnly(NoBoot),
    /// An address (full mode) or just boot information (proxy mode).
    Boot(BootOffer),
}

pub fn answer(
    mode: DhcpMode,
    client: &BootClient,
    in_inventory: bool,
    binaries: &IpxeBinaries,
    endpoints: &Endpoints,
) -> Answer {
    match (mode, boot_offer(client, in_inventory, binaries, endpoints)) {
        (DhcpMode::Off, _) => Answer::Ignore,
        (DhcpMode::Full, Ok(offer)) | (DhcpMode::Proxy, Ok(offer)) => Answer::Boot(offer),
        (DhcpMode::Full, Err(reason)) => Answer::AddressOnly(reason),
        (DhcpMode::Proxy, Err(_)) => Answer::Ignore,
    }
}

/// The iPXE script for a host's [`BootAction`]. A Linux boot's command line gets
/// `siteboot.url=` (plain HTTP: files, reports), `siteboot.agent=` (the agent API's HTTPS base
/// URL), `siteboot.fingerprint=` (`sha256:<hex>` of the certificate served there, which the
/// ramdisk pins) and `siteboot.mac=`.
pub fn ipxe_script(
    action: &BootAction,
    mac: MacAddr,
    endpoints: &Endpoints,
    agent: &AgentEndpoint,
) -> String {
    let linux = match action {
        BootAction::Script(text) => return text.clone(),
        BootAction::LocalDisk(method) => {
            let mut script = Script::new();
            script.echo(&[word("siteboot:"), word("booting"), word("local"), word("disk")]);
            match method {
                LocalBoot::Exit => script.exit(),
                LocalBoot::Sanboot => script.sanboot_local_disk(),
            };
            return script.render().to_owned();
        }
        BootAction::Linux(linux) => linux,
    };
    let url = |source: &Source| match source {
        Source::File(path) => Word::url(&endpoints.file_url(path.as_str()))
            .expect("a file URL built from a Word is a Word"),
        Source::Url(url) => url.clone(),
    };
    let initrds: Vec<(Word, Word)> = linux
        .initrds
        .iter()
        .enumerate()
        .map(|(i, source)| (url(source), initrd_name(i, source)))
        .collect();

    let mut args: Vec<Word> =
        initrds.iter().map(|(_, name)| word(&format!("initrd={name}"))).collect();
    args.extend(linux.cmdline.iter().cloned());
    args.extend(appliance_args(endpoints, agent));
    args.push(word(&format!("siteboot.mac={}", mac.hyphenated())));

    let mut script = Script::new();
    script.echo(&[word("siteboot:"), word("booting"), word(&mac.hyphenated())]);
    script.boot_linux(&url(&linux.kernel), &args, &initrds);
    script.render().to_owned()
}

/// The kernel command line of a deploy ramdisk booted from the boot media (virtual media,
/// [`crate::media`]) or by kexec over SSH: its own words (`cmdline`, with the operation's token
/// for media) and the appliance's, as [`ipxe_script`] gives them. No `initrd=` (GRUB or kexec
/// loads the initrd) and no `siteboot.mac=` (the request came from a BMC, not from the host's
/// MAC).
pub fn media_cmdline(cmdline: &[Word], endpoints: &Endpoints, agent: &AgentEndpoint) -> Vec<Word> {
    let mut args = cmdline.to_vec();
    args.extend(appliance_args(endpoints, agent));
    args
}

/// What every deploy ramdisk is told about the appliance, however it booted: `siteboot.url=`
/// (plain HTTP: files, reports), `siteboot.agent=` (the agent API's HTTPS base URL) and
/// `siteboot.fingerprint=` (`sha256:<hex>` of the certificate served there, which it pins).
fn appliance_args(endpoints: &Endpoints, agent: &AgentEndpoint) -> [Word; 3] {
    [
        Word::url(&format!("siteboot.url={}", endpoints.http_base())).expect("safe"),
        Word::url(&format!("siteboot.agent={}", agent.base_url())).expect("safe"),
        word(&format!("siteboot.fingerprint={}", agent.fingerprint)),
    ]
}

/// The name iPXE gives an initrd (referenced by `initrd=` under UEFI): its file name, prefixed
/// with its position so two initrds with one name stay apart.
fn initrd_name(index: usize, source: &Source) -> Word {
    let path = match source {
        Source::File(w) | Source::Url(w) => w.as_str(),
    };
    let base = path.rsplit('/').next().filter(|b| !b.is_empty()).unwrap_or("initrd");
    let base = base.split(['?', '#']).next().unwrap_or("initrd");
    Word::url(&format!("{index}-{base}")).expect("index prefix makes it non-empty")
}

/// A word from a string siteboot itself wrote.
fn word(s: &str) -> Word {
    Word::new(s).expect("siteboot's own script words are safe")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::LinuxBoot;

    fn endpoints() -> Endpoints {
        Endpoints { address: "10.0.0.1".parse().unwrap(), http_port: 8080 }
    }

    fn agent() -> AgentEndpoint {
        AgentEndpoint {
            address: "10.0.0.1".parse().unwrap(),
            port: 8443,
            fingerprint: crate::tls::Fingerprint::of(b"a certificate"),
        }
    }

    /// The x86 binaries of Debian's ipxe package, no arm64 build.
    fn binaries() -> (tempfile::TempDir, IpxeBinaries) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("undionly.kpxe"), b"bios").unwrap();
        std::fs::write(dir.path().join("snponly.efi"), b"efi").unwrap();
        let bins = IpxeBinaries::discover(dir.path());
        (dir, bins)
    }

    fn client(arch: Option<u16>, vendor: &str, ipxe: bool) -> BootClient {
        BootClient {
            mac: "52:54:00:00:00:01".parse().unwrap(),
            arch: arch.map(ClientArch::from_code),
            firmware_boot: vendor.starts_with("PXEClient") || vendor.starts_with("HTTPClient"),
            http_client: vendor.starts_with("HTTPClient"),
            ipxe,
        }
    }

    /// Every architecture x iPXE or not x known or unknown MAC x mode.
    #[test]
    fn decision_matrix() {
        let (_dir, bins) = binaries();
        let ep = endpoints();
        let script = "http://10.0.0.1:8080/boot/52-54-00-00-00-01.ipxe".to_owned();
        let tftp = |f: &str| Answer::Boot(BootOffer::Tftp { file: f.into() });
        let http = |f: &str| {
            Answer::Boot(BootOffer::HttpBoot { url: format!("http://10.0.0.1:8080/ipxe/{f}") })
        };
        // (arch, vendor class, expected firmware-stage offer in full mode)
        let archs: [(Option<u16>, &str, Answer); 8] = [
            (Some(0), "PXEClient:Arch:00000:UNDI:002001", tftp("undionly.kpxe")),
            (None, "PXEClient", tftp("undionly.kpxe")),
            (Some(7), "PXEClient:Arch:00007:UNDI:003000", tftp("snponly.efi")),
            (Some(9), "PXEClient:Arch:00009:UNDI:003000", tftp("snponly.efi")),
            (Some(16), "HTTPClient:Arch:00016:UNDI:003001", http("snponly.efi")),
            (
                Some(11),
                "PXEClient:Arch:00011:UNDI:003000",
                Answer::AddressOnly(NoBoot::NoBinary(Platform::UefiArm64)),
            ),
            (
                Some(6),
                "PXEClient:Arch:00006:UNDI:003000",
                Answer::AddressOnly(NoBoot::UnsupportedArch(ClientArch::Other(6))),
            ),
            (None, "", Answer::AddressOnly(NoBoot::NotNetworkBoot)),
        ];
        for (arch, vendor, firmware_full) in archs {
            for ipxe in [false, true] {
                for known in [false, true] {
                    for mode in [DhcpMode::Full, DhcpMode::Proxy, DhcpMode::Off] {
                        let c = client(arch, vendor, ipxe);
                        let got = answer(mode, &c, known, &bins, &ep);
                        let full = if !known {
                            Answer::AddressOnly(NoBoot::NotInInventory)
                        } else if ipxe {
                            Answer::Boot(BootOffer::Script { url: script.clone() })
                        } else {
                            firmware_full.clone()
                        };
                        let expected = match (mode, full) {
                            (DhcpMode::Off, _) => Answer::Ignore,
                            (DhcpMode::Full, a) => a,
                            (DhcpMode::Proxy, Answer::AddressOnly(_)) => Answer::Ignore,
                            (DhcpMode::Proxy, a) => a,
                        };
                        assert_eq!(
                            got, expected,
                            "arch {arch:?} vendor {vendor:?} ipxe {ipxe} known {known} mode {mode:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn linux_script_names_initrds_and_adds_siteboot_args() {
        let action = BootAction::Linux(LinuxBoot {
            kernel: Source::File(Word::new("k/vmlinuz").unwrap()),
            initrds: vec![
                Source::File(Word::new("a/initrd.img").unwrap()),
                Source::Url(Word::new("http://mirror/b/initrd.img").unwrap()),
            ],
            cmdline: vec![Word::new("console=ttyS0").unwrap()],
        });
        let mac = "52:54:00:00:00:01".parse().unwrap();
        let script = ipxe_script(&action, mac, &endpoints(), &agent());
        assert_eq!(
            script.split_inclusive('\n').take(7).collect::<String>(),
            "#!ipxe\n\
             echo siteboot: booting 52-54-00-00-00-01\n\
             kernel http://10.0.0.1:8080/files/k/vmlinuz initrd=0-initrd.img initrd=1-initrd.img console=ttyS0 siteboot.url=http://10.0.0.1:8080 siteboot.agent=https://10.0.0.1:8443 siteboot.fingerprint=sha256:81acd762140fa692a142822d2fbe4dc6f54bcaa501f68ab37e5aeed0bafe4d99 siteboot.mac=52-54-00-00-00-01 || goto siteboot-attempt-2\n\
             initrd --name 0-initrd.img http://10.0.0.1:8080/files/a/initrd.img || goto siteboot-attempt-2\n\
             initrd --name 1-initrd.img http://mirror/b/initrd.img || goto siteboot-attempt-2\n\
             boot || goto siteboot-attempt-2\n\
             :siteboot-attempt-2\n"
        );
        // What the ramdisk agent reads back from that command line.
        let kernel = script.lines().find(|l| l.starts_with("kernel ")).unwrap();
        let cmdline = siteboot_agent::cmdline::Cmdline::parse(kernel).unwrap();
        assert_eq!(cmdline.agent.to_string(), agent().base_url());
        assert_eq!(cmdline.fingerprint.to_string(), agent().fingerprint.to_string());
        assert_eq!(cmdline.token, None);
    }

    #[test]
    fn media_command_lines_add_the_appliance_as_scripts_do() {
        let ramdisk =
            [Word::new("console=ttyS0").unwrap(), Word::new("siteboot.token=0a").unwrap()];
        let line: Vec<String> = media_cmdline(&ramdisk, &endpoints(), &agent())
            .iter()
            .map(|w| w.as_str().to_owned())
            .collect();
        let line = line.join(" ");
        assert_eq!(
            line,
            "console=ttyS0 siteboot.token=0a siteboot.url=http://10.0.0.1:8080 siteboot.agent=https://10.0.0.1:8443 siteboot.fingerprint=sha256:81acd762140fa692a142822d2fbe4dc6f54bcaa501f68ab37e5aeed0bafe4d99"
        );
        let cmdline = siteboot_agent::cmdline::Cmdline::parse(&line).unwrap();
        assert_eq!(cmdline.agent.to_string(), agent().base_url());
        assert_eq!(cmdline.token.map(|t| t.as_str().to_owned()).as_deref(), Some("0a"));
    }

    #[test]
    fn local_disk_scripts() {
        let mac = "52:54:00:00:00:01".parse().unwrap();
        let exit =
            ipxe_script(&BootAction::LocalDisk(LocalBoot::Exit), mac, &endpoints(), &agent());
        assert!(exit.ends_with("\nexit 1\n"), "{exit}");
        let san =
            ipxe_script(&BootAction::LocalDisk(LocalBoot::Sanboot), mac, &endpoints(), &agent());
        assert!(san.ends_with("\nsanboot --no-describe --drive 0x80\n"), "{san}");
    }
}
