//! QEMU VMs that network-boot with real firmware: SeaBIOS + QEMU's iPXE option ROM (BIOS) or
//! OVMF with EDK2's own PXE client (UEFI) ([`Vm`]), and VMs that boot their disk image through
//! SeaBIOS on QEMU's user-mode network ([`DiskVm`]). Always TCG (`/dev/kvm` does not work
//! here). The serial console goes to a file that tests wait on; it is printed if the test fails.

use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::netns::Netns;
use crate::process::{Supervised, tail};

pub(crate) const OVMF_CODE: &str = "/usr/share/OVMF/OVMF_CODE_4M.fd";
pub(crate) const OVMF_VARS: &str = "/usr/share/OVMF/OVMF_VARS_4M.fd";
/// How long a test may queue for a VM slot before giving up.
const SLOT_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// Console lines after which no network boot follows (SeaBIOS, iPXE, Linux, EDK2): waiting
/// for a later marker stops there instead of at the deadline.
const DEAD_ENDS: &[&str] =
    &["No bootable device", "Nothing to boot", "Kernel panic", "No bootable option or device"];
/// How much of the console to print when a test fails.
const CONSOLE_TAIL_BYTES: u64 = 16 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Firmware {
    /// SeaBIOS; QEMU's iPXE ROM on the NIC does the network boot (DHCP with user class iPXE).
    Bios,
    /// OVMF with the NIC ROM disabled, so EDK2's PXE client boots (DHCP with arch 7, TFTP).
    Uefi,
}

/// What to boot.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub name: String,
    pub firmware: Firmware,
    /// e.g. `52:54:00:12:34:56`.
    pub mac: String,
    /// A tap from [`Netns::add_tap`].
    pub tap: String,
    pub memory_mb: u32,
}

impl VmConfig {
    pub fn new(name: &str, firmware: Firmware, mac: &str, tap: &str) -> Self {
        Self {
            name: name.to_owned(),
            firmware,
            mac: mac.to_owned(),
            tap: tap.to_owned(),
            memory_mb: 512,
        }
    }
}

/// A running network-booting VM; killed on drop.
pub struct Vm {
    config: VmConfig,
    qemu: Qemu,
}

impl Vm {
    /// Starts the VM inside `ns`, after waiting for a free slot (see [`max_vms`]).
    pub fn start(ns: &Netns, config: VmConfig) -> Result<Self> {
        let slot = Slot::acquire()?;
        let dir = tempfile::Builder::new().prefix("siteboot-vm-").tempdir()?;
        let console = dir.path().join("console.log");

        let mut qemu = ns.command("qemu-system-x86_64");
        qemu.args(["-accel", "tcg", "-smp", "1", "-nographic", "-no-reboot", "-monitor", "none"])
            .arg("-m")
            .arg(config.memory_mb.to_string())
            .arg("-serial")
            .arg(format!("file:{}", console.display()))
            .arg("-netdev")
            .arg(format!("tap,id=net0,ifname={},script=no,downscript=no", config.tap));
        let mut nic = format!("virtio-net-pci,netdev=net0,mac={},bootindex=1", config.mac);
        match config.firmware {
            Firmware::Bios => {
                // SeaBIOS's serial console mirrors the VGA text (iPXE's messages) to ttyS0. The
                // port is read as a little-endian integer, hence a 2-byte file.
                let sercon = dir.path().join("sercon-port");
                std::fs::write(&sercon, 0x3f8u16.to_le_bytes())?;
                qemu.args(["-boot", "n", "-fw_cfg"])
                    .arg(format!("name=etc/sercon-port,file={}", sercon.display()));
            }
            Firmware::Uefi => {
                let vars = dir.path().join("OVMF_VARS.fd");
                std::fs::copy(OVMF_VARS, &vars)
                    .with_context(|| format!("copying {OVMF_VARS} (is ovmf installed?)"))?;
                qemu.arg("-drive")
                    .arg(format!("if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}"))
                    .arg("-drive")
                    .arg(format!("if=pflash,format=raw,unit=1,file={}", vars.display()));
                // No iPXE ROM: EDK2's own PXE client does the first DHCP + TFTP.
                nic.push_str(",romfile=");
            }
        }
        qemu.arg("-device").arg(nic);

        let qemu = Qemu::spawn(&config.name, &mut qemu, console, None, dir, slot)?;
        Ok(Self { config, qemu })
    }

    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The console so far (lossy UTF-8, terminal escapes removed).
    pub fn console(&self) -> String {
        self.qemu.console()
    }

    pub fn console_tail(&self) -> String {
        self.qemu.console_tail()
    }

    /// Waits until a console line contains `pattern` and returns that line from the pattern on
    /// (firmware output may share the line). Fails at the deadline, at once if QEMU exits, and
    /// as soon as the console shows a boot dead end (see [`DEAD_ENDS`]).
    pub fn wait_for_console(&mut self, pattern: &str, timeout: Duration) -> Result<String> {
        self.qemu.wait_for_console(pattern, timeout)
    }

    /// Waits for QEMU to exit (the guest powered off; `-no-reboot` turns resets into exits).
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<()> {
        self.qemu.wait_exit(timeout)
    }

    pub fn print_console(&self) {
        self.qemu.print_console();
    }
}

/// A disk for a [`DiskVm`]: virtio, in order (`/dev/vda`, `/dev/vdb`, ...).
#[derive(Clone, Debug)]
pub struct Drive {
    pub path: PathBuf,
    /// QEMU's format name: `raw`, `qcow2`.
    pub format: &'static str,
    pub read_only: bool,
}

/// What a [`DiskVm`] is: its first drive is the one it boots.
#[derive(Clone, Debug)]
pub struct DiskBoot {
    pub name: String,
    pub drives: Vec<Drive>,
    pub memory_mb: u32,
    pub cpus: u32,
    /// The NIC's MAC; QEMU's default (52:54:00:12:34:56) if None.
    pub mac: Option<String>,
    /// The SMBIOS system UUID (`product_uuid`); QEMU's default, all zeros, if None.
    pub uuid: Option<String>,
    /// A port of the namespace's loopback forwarded to the guest's sshd (port 22).
    pub ssh_forward: Option<u16>,
    /// Whether a reboot of the guest boots it again (a server rebooting into what was written
    /// to its disk); otherwise QEMU exits.
    pub reboots: bool,
}

/// A VM that boots its first drive through SeaBIOS (no network boot; its console is `ttyS0`),
/// with one NIC on QEMU's user-mode network: the guest gets 10.0.2.15 by DHCP and
/// reaches the loopback of the namespace QEMU runs in at 10.0.2.2, and nothing else there is.
/// Its second serial port (`ttyS1`) goes to a file of its own; both are printed if the test
/// fails. Killed on drop.
pub struct DiskVm {
    qemu: Qemu,
}

impl DiskVm {
    /// Starts the VM inside `ns`, after waiting for a free slot (see [`max_vms`]).
    pub fn start(ns: &Netns, boot: &DiskBoot) -> Result<Self> {
        let slot = Slot::acquire()?;
        let dir = tempfile::Builder::new().prefix("siteboot-vm-").tempdir()?;
        let console = dir.path().join("console.log");
        let second = dir.path().join("ttyS1.log");
        let mut qemu = ns.command("qemu-system-x86_64");
        qemu.args(["-accel", "tcg", "-nographic", "-monitor", "none"])
            .args(["-smp", &boot.cpus.to_string(), "-m", &boot.memory_mb.to_string()])
            .args((!boot.reboots).then_some("-no-reboot"))
            .args(boot.uuid.iter().flat_map(|uuid| ["-uuid", uuid]))
            .arg("-serial")
            .arg(format!("file:{}", console.display()))
            .arg("-serial")
            .arg(format!("file:{}", second.display()))
            .args(["-boot", "order=c"])
            .arg("-netdev")
            .arg(match boot.ssh_forward {
                Some(port) => format!("user,id=net0,hostfwd=tcp:127.0.0.1:{port}-:22"),
                None => "user,id=net0".to_owned(),
            })
            .arg("-device")
            // romfile=: no iPXE option ROM, so SeaBIOS offers no network boot.
            .arg(match &boot.mac {
                Some(mac) => format!("virtio-net-pci,netdev=net0,romfile=,mac={mac}"),
                None => "virtio-net-pci,netdev=net0,romfile=".to_owned(),
            });
        for drive in &boot.drives {
            let mut spec =
                format!("file={},format={},if=virtio", drive.path.display(), drive.format);
            if drive.read_only {
                spec.push_str(",readonly=on");
            }
            qemu.arg("-drive").arg(spec);
        }
        let qemu = Qemu::spawn(&boot.name, &mut qemu, console, Some(second), dir, slot)?;
        Ok(Self { qemu })
    }

    /// The console so far (lossy UTF-8, terminal escapes removed).
    pub fn console(&self) -> String {
        self.qemu.console()
    }

    /// As [`Vm::wait_for_console`].
    pub fn wait_for_console(&mut self, pattern: &str, timeout: Duration) -> Result<String> {
        self.qemu.wait_for_console(pattern, timeout)
    }

    pub fn print_console(&self) {
        self.qemu.print_console();
    }

    /// What the guest wrote to its second serial port so far (lossy UTF-8).
    pub fn second_serial(&self) -> Result<String> {
        let path = self.qemu.second.as_ref().context("the VM has no second serial port")?;
        Ok(String::from_utf8_lossy(&std::fs::read(path)?).into_owned())
    }
}

/// A QEMU process with its serial console in a file; what [`Vm`] and [`DiskVm`] share.
struct Qemu {
    name: String,
    console: PathBuf,
    /// The second serial port's file, if the VM has one.
    second: Option<PathBuf>,
    started: Instant,
    // Drop order: the process (kill) before the directory it uses, the slot last.
    process: Supervised,
    _dir: tempfile::TempDir,
    _slot: Slot,
}

impl Qemu {
    fn spawn(
        name: &str,
        command: &mut std::process::Command,
        console: PathBuf,
        second: Option<PathBuf>,
        dir: tempfile::TempDir,
        slot: Slot,
    ) -> Result<Self> {
        let process = Supervised::spawn(&format!("qemu-{name}"), command, dir.path())?;
        Ok(Self {
            name: name.to_owned(),
            console,
            second,
            started: Instant::now(),
            process,
            _dir: dir,
            _slot: slot,
        })
    }

    fn console(&self) -> String {
        clean(&std::fs::read(&self.console).unwrap_or_default())
    }

    fn console_tail(&self) -> String {
        clean(tail(&self.console, CONSOLE_TAIL_BYTES).as_bytes())
    }

    fn wait_for_console(&mut self, pattern: &str, timeout: Duration) -> Result<String> {
        let find = |console: &str, pattern: &str| {
            console.lines().find_map(|line| line.find(pattern).map(|i| line[i..].trim().to_owned()))
        };
        let deadline = Instant::now() + timeout;
        loop {
            let console = self.console();
            if let Some(line) = find(&console, pattern) {
                return Ok(line);
            }
            if let Some(dead_end) = DEAD_ENDS.iter().find_map(|end| find(&console, end)) {
                bail!(
                    "VM {} reached {dead_end:?} after {:?} without printing {pattern:?}; console tail:\n{}",
                    self.name,
                    self.started.elapsed(),
                    last_lines(&console, 30)
                );
            }
            if let Some(status) = self.process.try_wait() {
                // One last look: the line may have been written just before the exit.
                if let Some(line) = find(&self.console(), pattern) {
                    return Ok(line);
                }
                bail!(
                    "VM {} exited ({status}) after {:?} without printing {pattern:?}; console tail:\n{}",
                    self.name,
                    self.started.elapsed(),
                    last_lines(&console, 30)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "timed out after {timeout:?} waiting for {pattern:?} on the console of VM {}; console tail:\n{}",
                    self.name,
                    last_lines(&console, 30)
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn wait_exit(&mut self, timeout: Duration) -> Result<()> {
        self.process.wait_timeout(timeout).map(drop)
    }

    fn print_console(&self) {
        let what = format!("console of VM {} ({})", self.name, self.console.display());
        crate::failure::print_log(&what, &self.console_tail());
        if let Some(second) = &self.second {
            let what = format!("second serial port of VM {} ({})", self.name, second.display());
            crate::failure::print_log(&what, &clean(tail(second, CONSOLE_TAIL_BYTES).as_bytes()));
        }
    }
}

impl Drop for Qemu {
    fn drop(&mut self) {
        // SITEBOOT_TEST_CONSOLE=1 shows consoles of passing tests too (to see what firmware did).
        if std::thread::panicking() || std::env::var_os("SITEBOOT_TEST_CONSOLE").is_some() {
            self.print_console();
        }
    }
}

/// The process-wide limit on running VMs: `SITEBOOT_TEST_VMS`, default 2 (a TCG VM takes a core).
pub fn max_vms() -> usize {
    std::env::var("SITEBOOT_TEST_VMS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(2)
}

static RUNNING: Mutex<usize> = Mutex::new(0);
static FREED: Condvar = Condvar::new();

/// One of the [`max_vms`] slots, given back on drop.
struct Slot;

impl Slot {
    fn acquire() -> Result<Self> {
        let deadline = Instant::now() + SLOT_TIMEOUT;
        let mut running = RUNNING.lock().unwrap_or_else(|p| p.into_inner());
        while *running >= max_vms() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "waited {SLOT_TIMEOUT:?} for a free VM slot (SITEBOOT_TEST_VMS={})",
                    max_vms()
                );
            }
            running = FREED.wait_timeout(running, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        *running += 1;
        Ok(Slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        *RUNNING.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
        FREED.notify_one();
    }
}

/// Console bytes as text without ANSI escape sequences (OVMF draws its screen with them).
fn clean(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => {
                // CSI: ESC [ params final-byte; other escapes: ESC + one char.
                if chars.next_if_eq(&'[').is_some() {
                    for c in chars.by_ref() {
                        if ('@'..='~').contains(&c) {
                            break;
                        }
                    }
                } else {
                    chars.next();
                }
            }
            '\r' => {}
            // iPXE's countdown erases with backspaces.
            '\x08' => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Fails with a clear message if QEMU or the firmware is missing.
pub fn check_installed() -> Result<()> {
    for path in
        ["/usr/bin/qemu-system-x86_64", OVMF_CODE, OVMF_VARS, "/usr/lib/ipxe/qemu/pxe-virtio.rom"]
    {
        if !Path::new(path).exists() {
            bail!("{path} missing: run scripts/setup");
        }
    }
    Ok(())
}
