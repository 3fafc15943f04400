//! Inspection of a server that already runs an OS: one read-only command ([`command`]) prints
//! what the deploy ramdisk's inspection would report, one fact a line, and [`parse`] reads that
//! into a [`Report`] whose [`Report::hardware`] is the ramdisk's type, so nothing downstream
//! can tell how a Host was inspected.
//!
//! The output is the server's word, read as untrusted input: bounded in size and count, every
//! value checked for its shape, nothing kept that has a character a shell, a log line or a
//! status page could misread. Whether the server is the Host's machine is the caller's question
//! ([`Report::has_mac`]).

use std::time::Duration;

use siteboot_agent_api::{Disk, Hardware, Nic, System};

use crate::adopt::{Command, Expect};
use crate::{Session, SshError};

/// How long the command may take: it reads sysfs and two small files.
const LIMIT: Duration = Duration::from_secs(30);
/// More output than any server's report: past it the report is refused whole.
const MAX_OUTPUT: usize = 64 * 1024;
/// More NICs or disks than a server has.
const MAX_ITEMS: usize = 256;

/// The command whose output [`parse`] reads. It changes nothing on the server. As the
/// ramdisk does, disks are block devices backed by a device (not loop, ram, zram, dm or md,
/// which have none) and not optical drives; unlike it, every interface but `lo` is listed,
/// since a bridge may carry the boot MAC of a server that has been running for a while.
pub fn command() -> Command {
    let script = "\
        u=/sys/class/dmi/id/product_uuid; [ -r $u ] && printf 'uuid %s\\n' \"$(head -c 64 $u)\"; \
        for d in /sys/class/net/*; do n=${d##*/}; [ \"$n\" = lo ] && continue; \
          printf 'nic %s %s\\n' \"$n\" \"$(head -c 100 \"$d/address\" 2>/dev/null)\"; done; \
        for d in /sys/block/*; do n=${d##*/}; [ -e \"$d/device\" ] || continue; \
          case $n in sr*) continue;; esac; \
          printf 'disk %s %s\\n' \"$n\" \"$(head -c 24 \"$d/size\")\"; done; \
        printf 'cpus %s\\n' \"$(getconf _NPROCESSORS_ONLN)\"; \
        printf 'arch %s\\n' \"$(uname -m)\"; \
        sed -n 's/^MemTotal: *\\([0-9]*\\) kB$/memkb \\1/p' /proc/meminfo; \
        sed -n 's/^ID=/os-id /p; s/^VERSION_ID=/os-version /p' /etc/os-release 2>/dev/null; \
        exit 0";
    Command::new("inspecting the server", script, LIMIT, Expect::Output)
}

/// What the server said about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// `product_uuid`, in lower case, when the server has one (SMBIOS) and it is readable.
    pub uuid: Option<String>,
    /// Interfaces with an Ethernet address, by name; those without one (tunnels, WireGuard)
    /// cannot be a boot MAC and are left out.
    pub nics: Vec<(String, Mac)>,
    /// Disks that are not empty, by name, in bytes.
    pub disks: Vec<(String, u64)>,
    pub cpus: u32,
    pub memory_mib: u64,
    /// `uname -m`, when it is a plain word.
    pub arch: Option<String>,
    /// `/etc/os-release`'s `ID` and `VERSION_ID`, when present.
    pub os: Option<Os>,
}

/// The OS the server runs, as `/etc/os-release` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Os {
    pub id: String,
    pub version: Option<String>,
}

/// An Ethernet address, in lower case with colons.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mac(String);

impl Mac {
    /// `text` if it is six hex octets separated by `:` (either case).
    pub fn parse(text: &str) -> Option<Self> {
        let octets: Vec<&str> = text.split(':').collect();
        let hex = |o: &&str| o.len() == 2 && o.bytes().all(|b| b.is_ascii_hexdigit());
        (octets.len() == 6 && octets.iter().all(hex)).then(|| Self(text.to_ascii_lowercase()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Mac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What was wrong with the output. Each quotes at most a short excerpt, escaped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InspectError {
    #[error("the report is longer than {MAX_OUTPUT} bytes")]
    TooLong,
    #[error("the report is not UTF-8")]
    NotUtf8,
    #[error("the system UUID {0:?} is not a UUID")]
    Uuid(String),
    #[error("interface {nic:?} has a malformed link-layer address {address:?}")]
    Mac { nic: String, address: String },
    #[error("{what} name {name:?} is not a device name")]
    Name { what: &'static str, name: String },
    #[error("{what} {value:?} is not a number")]
    Number { what: &'static str, value: String },
    #[error("more than {MAX_ITEMS} {0}")]
    TooMany(&'static str),
    #[error("{0} is reported twice")]
    Twice(&'static str),
    #[error("{0} is missing")]
    Missing(&'static str),
    #[error("unexpected line {0:?}")]
    Line(String),
}

/// Why [`run`] has no report.
#[derive(Debug, thiserror::Error)]
pub enum InspectFailed {
    #[error(transparent)]
    Ssh(#[from] SshError),
    #[error("the inspection command failed: {0}")]
    Command(String),
    #[error("the server's inspection report is unreadable: {0}")]
    Report(#[from] InspectError),
}

/// Runs [`command`] on the server behind `session` and reads what it printed ([`parse`]).
pub async fn run(session: &Session) -> Result<Report, InspectFailed> {
    let command = command();
    let output = session.run(&command.line, &[], command.deadline).await?;
    if !output.success() || output.stdout.truncated() {
        let stderr: String = output.stderr.text().chars().take(200).collect();
        return Err(InspectFailed::Command(format!("{:?}: {stderr:?}", output.status)));
    }
    Ok(parse(output.stdout.bytes())?)
}

/// At most 40 characters of `s`, for an error: `{:?}` escapes what is left.
fn excerpt(s: &str) -> String {
    s.chars().take(40).collect()
}

/// A device name as the kernel allows one: 1 to 32 of letters, digits, `.`, `_`, `-`, `@`,
/// `:` (no `/`, no blank, no control).
fn device_name(what: &'static str, name: &str) -> Result<String, InspectError> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '@' | ':');
    if name.is_empty() || name.len() > 32 || !name.chars().all(allowed) {
        return Err(InspectError::Name { what, name: excerpt(name) });
    }
    Ok(name.to_owned())
}

fn number<T: std::str::FromStr>(what: &'static str, value: &str) -> Result<T, InspectError> {
    value.parse().map_err(|_| InspectError::Number { what, value: excerpt(value) })
}

/// A value of os-release: unquoted, a plain word of at most 64 characters, or left out.
fn os_word(value: &str) -> Option<String> {
    let value = value.trim().trim_matches(|c| c == '"' || c == '\'');
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '+' | '~');
    (!value.is_empty() && value.len() <= 64 && value.chars().all(plain)).then(|| value.to_owned())
}

/// Whether `s` is a UUID: 8-4-4-4-12 hex digits.
fn is_uuid(s: &str) -> bool {
    let groups: Vec<&str> = s.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, n)| g.len() == n && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Sets `slot` once.
fn once<T>(slot: &mut Option<T>, what: &'static str, value: T) -> Result<(), InspectError> {
    match slot.replace(value) {
        Some(_) => Err(InspectError::Twice(what)),
        None => Ok(()),
    }
}

/// The report in what [`command`] printed.
pub fn parse(output: &[u8]) -> Result<Report, InspectError> {
    if output.len() > MAX_OUTPUT {
        return Err(InspectError::TooLong);
    }
    let text = std::str::from_utf8(output).map_err(|_| InspectError::NotUtf8)?;
    let (mut uuid, mut cpus, mut memory, mut arch) = (None, None, None, None);
    let (mut os_id, mut os_version) = (None, None);
    let (mut nics, mut disks) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let (key, rest) = line.split_once(' ').unwrap_or((line, ""));
        match key {
            "uuid" => {
                let value = rest.trim();
                if !is_uuid(value) {
                    return Err(InspectError::Uuid(excerpt(value)));
                }
                once(&mut uuid, "the system UUID", value.to_ascii_lowercase())?;
            }
            "nic" => {
                let (name, address) = rest.split_once(' ').unwrap_or((rest, ""));
                let name = device_name("interface", name)?;
                let address = address.trim();
                if nics.len() + 1 > MAX_ITEMS {
                    return Err(InspectError::TooMany("interfaces"));
                }
                if let Some(mac) = Mac::parse(address) {
                    nics.push((name, mac));
                } else if !link_layer(address) {
                    return Err(InspectError::Mac { nic: name, address: excerpt(address) });
                }
            }
            "disk" => {
                let (name, size) = rest.split_once(' ').unwrap_or((rest, ""));
                let name = device_name("disk", name)?;
                // Always in 512-byte units, whatever the device's sector size.
                let sectors: u64 = number("disk size", size.trim())?;
                if disks.len() + 1 > MAX_ITEMS {
                    return Err(InspectError::TooMany("disks"));
                }
                let bytes = sectors
                    .checked_mul(512)
                    .ok_or(InspectError::Number { what: "disk size", value: excerpt(size) })?;
                // Empty: a card reader without a card, as the ramdisk leaves it out.
                if bytes > 0 {
                    disks.push((name, bytes));
                }
            }
            "cpus" => once(&mut cpus, "cpus", number("cpus", rest.trim())?)?,
            "memkb" => once(&mut memory, "memkb", number::<u64>("memory", rest.trim())? / 1024)?,
            "arch" => once(&mut arch, "arch", os_word(rest))?,
            "os-id" => once(&mut os_id, "os-release ID", os_word(rest))?,
            "os-version" => once(&mut os_version, "os-release VERSION_ID", os_word(rest))?,
            _ => return Err(InspectError::Line(excerpt(line))),
        }
    }
    nics.sort();
    disks.sort();
    if nics.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(InspectError::Twice("an interface"));
    }
    if disks.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(InspectError::Twice("a disk"));
    }
    Ok(Report {
        uuid,
        nics,
        disks,
        cpus: cpus.ok_or(InspectError::Missing("cpus"))?,
        memory_mib: memory.ok_or(InspectError::Missing("memkb"))?,
        arch: arch.flatten(),
        os: os_id.flatten().map(|id| Os { id, version: os_version.flatten() }),
    })
}

/// Whether `address` is a link-layer address that is not Ethernet's (none, a tunnel's four
/// octets, InfiniBand's twenty): hex octets separated by `:`, or nothing.
fn link_layer(address: &str) -> bool {
    address.is_empty()
        || (address.len() <= 3 * 32
            && address.split(':').all(|o| o.len() == 2 && o.bytes().all(|b| b.is_ascii_hexdigit())))
}

impl Report {
    /// Whether one of the server's interfaces has `mac` (any case): positive evidence that the
    /// server is the machine a Host with that boot MAC describes.
    pub fn has_mac(&self, mac: &str) -> bool {
        Mac::parse(mac).is_some_and(|mac| self.nics.iter().any(|(_, m)| *m == mac))
    }

    /// The MACs seen, for a message saying the server is not the one expected.
    pub fn macs(&self) -> Vec<&str> {
        self.nics.iter().map(|(_, mac)| mac.as_str()).collect()
    }

    /// As the ramdisk's inspection reports it. What SSH cannot see as the ramdisk does (links,
    /// speeds, disk models and serials) is left out rather than guessed.
    pub fn hardware(&self) -> Hardware {
        Hardware {
            cpus: self.cpus,
            memory_mib: self.memory_mib,
            arch: self.arch.clone(),
            system: self.uuid.clone().map(|uuid| System {
                uuid,
                vendor: None,
                model: None,
                serial: None,
            }),
            disks: self
                .disks
                .iter()
                .map(|(name, size)| Disk {
                    name: format!("/dev/{name}"),
                    size_bytes: *size,
                    model: None,
                    serial: None,
                    wwn: None,
                    rotational: false,
                })
                .collect(),
            nics: self
                .nics
                .iter()
                .map(|(name, mac)| Nic {
                    name: name.clone(),
                    mac: mac.0.clone(),
                    link: None,
                    speed_mbps: None,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVER: &str = "\
uuid 4C4C4544-0042-3510-8052-B4C04F4E3332
nic br0 52:54:00:AB:cd:01
nic eth0 52:54:00:ab:cd:02
nic tunl0 00:00:00:00
nic wg0 
disk nvme0n1 1953525168
disk sda 0
cpus 8
arch x86_64
memkb 16318412
os-id ubuntu
os-version \"22.04\"
";

    #[test]
    fn a_server_s_report_is_the_ramdisk_s_hardware() {
        let report = parse(SERVER.as_bytes()).unwrap();
        assert_eq!(report.uuid.as_deref(), Some("4c4c4544-0042-3510-8052-b4c04f4e3332"));
        assert_eq!(report.macs(), ["52:54:00:ab:cd:01", "52:54:00:ab:cd:02"]);
        assert!(report.has_mac("52:54:00:AB:CD:02"));
        assert!(!report.has_mac("52:54:00:ab:cd:03"));
        assert!(!report.has_mac("00:00:00:00"));
        assert_eq!(report.os, Some(Os { id: "ubuntu".into(), version: Some("22.04".into()) }));
        let hardware = report.hardware();
        assert_eq!((hardware.cpus, hardware.memory_mib), (8, 15935));
        assert_eq!(hardware.arch.as_deref(), Some("x86_64"));
        assert_eq!(hardware.system.unwrap().uuid, "4c4c4544-0042-3510-8052-b4c04f4e3332");
        // The empty disk is left out, as the ramdisk leaves it out.
        assert_eq!(hardware.disks.len(), 1);
        assert_eq!(
            (hardware.disks[0].name.as_str(), hardware.disks[0].size_bytes),
            ("/dev/nvme0n1", 1953525168 * 512)
        );
        assert_eq!(hardware.nics[0].name, "br0");
    }

    /// A machine without SMBIOS (some VMs and boards) has no UUID, as the ramdisk reports it.
    #[test]
    fn a_server_without_a_system_uuid_has_no_system() {
        let text = SERVER.replace("uuid 4C4C4544-0042-3510-8052-B4C04F4E3332\n", "");
        let report = parse(text.as_bytes()).unwrap();
        assert_eq!((report.uuid.as_ref(), report.hardware().system), (None, None));
    }

    #[test]
    fn an_os_release_without_version_or_with_odd_values_is_kept_as_far_as_plain() {
        let text = SERVER.replace("os-version \"22.04\"\n", "");
        let report = parse(text.as_bytes()).unwrap();
        assert_eq!(report.os, Some(Os { id: "ubuntu".into(), version: None }));
        let text = SERVER.replace("os-id ubuntu", "os-id $(reboot)");
        assert_eq!(parse(text.as_bytes()).unwrap().os, None);
    }

    #[test]
    fn what_is_wrong_is_named() {
        let cases: &[(&str, &str, InspectError)] = &[
            ("uuid 4C4C4544-0042-3510-8052-B4C04F4E3332", "uuid ", InspectError::Uuid("".into())),
            (
                "uuid 4C4C4544-0042-3510-8052-B4C04F4E3332",
                "uuid Not Settable",
                InspectError::Uuid("Not Settable".into()),
            ),
            (
                "nic eth0 52:54:00:ab:cd:02",
                "nic eth0 52:54:00:ab:cd:zz",
                InspectError::Mac { nic: "eth0".into(), address: "52:54:00:ab:cd:zz".into() },
            ),
            (
                "nic eth0",
                "nic eth0/../x",
                InspectError::Name { what: "interface", name: "eth0/../x".into() },
            ),
            (
                "disk sda 0",
                "disk sda big",
                InspectError::Number { what: "disk size", value: "big".into() },
            ),
            ("cpus 8", "cpus 8\ncpus 9", InspectError::Twice("cpus")),
            ("cpus 8\n", "", InspectError::Missing("cpus")),
            ("memkb 16318412\n", "", InspectError::Missing("memkb")),
            ("nic br0", "nic eth0", InspectError::Twice("an interface")),
            (
                "arch x86_64",
                "Welcome to the server!",
                InspectError::Line("Welcome to the server!".into()),
            ),
        ];
        for (from, to, expected) in cases {
            let text = SERVER.replacen(from, to, 1);
            assert_eq!(parse(text.as_bytes()).as_ref(), Err(expected), "{from:?} -> {to:?}");
        }
    }

    /// Output made to confuse: it is refused, or kept as escaped, bounded data.
    #[test]
    fn hostile_output_is_refused_without_panicking() {
        let long = format!("{SERVER}{}", "nic eth9 52:54:00:00:00:09\n".repeat(5000));
        assert_eq!(parse(long.as_bytes()), Err(InspectError::TooLong));
        let many: String = (0..300)
            .map(|i| format!("nic e{i} 52:54:00:00:{:02x}:{:02x}\n", i / 256, i % 256))
            .collect();
        assert_eq!(
            parse(format!("{SERVER}{many}").as_bytes()),
            Err(InspectError::TooMany("interfaces"))
        );
        assert_eq!(parse(b"uuid \xff\xfe"), Err(InspectError::NotUtf8));
        let overflow = SERVER.replace("disk sda 0", &format!("disk sda {}", u64::MAX));
        assert!(matches!(parse(overflow.as_bytes()), Err(InspectError::Number { .. })));
        let escape = SERVER.replace("nic wg0 ", "nic \x1b[2J\x1b[31mowned 52:54:00:00:00:01");
        let err = parse(escape.as_bytes()).unwrap_err();
        assert!(matches!(err, InspectError::Name { .. }), "{err}");
        assert!(!err.to_string().contains('\x1b'), "{err}");
        let huge = SERVER.replace("nic wg0 ", &format!("nic wg0 {}", "ab:".repeat(1000)));
        let err = parse(huge.as_bytes()).unwrap_err();
        assert!(err.to_string().len() < 200, "{err}");
        for cut in 0..SERVER.len() {
            let _ = parse(&SERVER.as_bytes()[..cut]);
        }
        assert_eq!(parse(b""), Err(InspectError::Missing("cpus")));
    }

    #[test]
    fn the_command_is_bounded_and_reads_only() {
        let command = command();
        assert!(command.line.starts_with("timeout 30 sh -c '"), "{}", command.line);
        assert_eq!(command.expect, Expect::Output);
        // Its only redirection sends errors away: nothing is written on the server.
        let rest = command.line.replace("2>/dev/null", "");
        assert!(!rest.contains('>'), "{}", command.line);
        for writes in ["rm ", "tee", "dd ", "mv ", "sed -i"] {
            assert!(!rest.contains(writes), "{writes} in {}", command.line);
        }
    }

    /// The command, run by the local shell on this machine, prints what the parser reads.
    #[test]
    fn the_command_s_output_parses_here() {
        let script = command().line;
        let output = std::process::Command::new("sh").arg("-c").arg(&script).output().unwrap();
        let report = parse(&output.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stdout)));
        assert!(report.cpus > 0 && report.memory_mib > 0, "{report:?}");
        let uuid = std::fs::read_to_string("/sys/class/dmi/id/product_uuid").ok();
        assert_eq!(report.uuid, uuid.map(|u| u.trim().to_ascii_lowercase()));
    }
}
