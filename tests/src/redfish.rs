//! A Redfish BMC lab: libvirt's daemons running QEMU (TCG) VMs on a test namespace's bridge,
//! and sushy-tools' Redfish emulator (from PyPI, pinned, in a cached venv) as their BMC on the
//! test process's loopback.
//!
//! libvirtd starts inside the test namespace, so the taps it makes for `<interface
//! type='bridge'>` land on that namespace's bridge. Its control socket is the machine's one
//! (`/var/run/libvirt`), so one lab runs at a time on a machine ([`Libvirt::start`] takes a file
//! lock). On drop: domains destroyed and undefined, daemons stopped; on a failing test the
//! domains' serial consoles and the daemons' logs are printed.

use std::fs::File;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result};
use tempfile::TempDir;

use crate::netns::{self, Netns};
use crate::process::{Supervised, tail};
use crate::vm::{Firmware, OVMF_CODE, OVMF_VARS};

/// The sushy-tools release the lab runs.
pub const SUSHY_TOOLS: &str = "2.2.0";
/// libvirt's Python binding, built against Debian 12's libvirt 9.0 (`libvirt-dev`).
pub const LIBVIRT_PYTHON: &str = "9.0.0";
/// libvirtd's URI; its socket is the machine's one.
const LIBVIRT_URI: &str = "qemu:///system";
/// The firmware sushy-tools gives a domain whose boot mode is set to Legacy (the one QEMU's
/// `pc` machine loads by default); UEFI gets the lab's OVMF.
const SEABIOS: &str = "/usr/share/seabios/bios-256k.bin";
/// Held while a lab's libvirtd runs: one per machine.
const LOCK: &str = "/run/siteboot-test-libvirtd.lock";
/// How long a test may queue for the lab.
const LOCK_TIMEOUT: Duration = Duration::from_secs(30 * 60);
const READY_TIMEOUT: Duration = Duration::from_secs(60);
const CONSOLE_TAIL_BYTES: u64 = 16 * 1024;

/// libvirtd (in a test namespace) and virtlogd.
pub struct Libvirt {
    dir: TempDir,
    domains: Mutex<Vec<Domain>>,
    libvirtd: Supervised,
    virtlogd: Supervised,
    /// The machine-wide lock, released last.
    _lock: File,
}

/// A libvirt domain the lab defined.
#[derive(Debug, Clone)]
pub struct Domain {
    pub name: String,
    /// Lower case, as libvirt and SMBIOS give it.
    pub uuid: String,
    pub mac: String,
    /// Its raw disk files: `vda`, `vdb`, ...
    pub disks: Vec<PathBuf>,
    console: PathBuf,
    /// The second serial port (`ttyS1`: the node image's journal).
    second: PathBuf,
}

impl Libvirt {
    /// Starts virtlogd and, inside `ns`, libvirtd; waits until libvirtd answers.
    pub fn start(ns: &Netns) -> Result<Self> {
        let lock = lock_machine()?;
        for dir in ["/var/log/libvirt", "/var/run/libvirt"] {
            std::fs::create_dir_all(dir)?;
        }
        let dir = tempfile::Builder::new().prefix("siteboot-libvirt-").tempdir()?;
        // QEMU may run as libvirt-qemu: it must reach the disks and consoles in here.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let logs = dir.path().join("logs");
        let virtlogd = Supervised::spawn("virtlogd", &mut Command::new("virtlogd"), &logs)
            .context("starting virtlogd (is libvirt-daemon-system installed? run scripts/setup)")?;
        let libvirtd = Supervised::spawn("libvirtd", &mut ns.command("libvirtd"), &logs)?;
        let lab = Self { dir, domains: Mutex::default(), libvirtd, virtlogd, _lock: lock };
        crate::wait::for_("libvirtd to answer", READY_TIMEOUT, || lab.virsh(&["version"]).ok())?;
        lab.clear_stale()?;
        // sushy-tools uploads an inserted virtual media image into the pool named `default`.
        // Transient: it goes with this libvirtd, leaving nothing in the machine's config.
        let pool = lab.dir.path().join("pool");
        std::fs::create_dir(&pool)?;
        lab.virsh(&["pool-create-as", "default", "dir", "--target", &pool.to_string_lossy()])?;
        Ok(lab)
    }

    /// Removes what a lab killed before its drop left in libvirt's runtime state, which
    /// libvirtd reloads when it starts: its domains and its pool. The machine lock is held, so
    /// nothing else's.
    fn clear_stale(&self) -> Result<()> {
        for name in self.virsh(&["list", "--all", "--name"])?.lines().filter(|l| !l.is_empty()) {
            eprintln!("redfish lab: removing the domain {name} a killed run left");
            let _ = self.virsh(&["destroy", name]);
            self.virsh(&["undefine", "--nvram", name])?;
        }
        if self.virsh(&["pool-info", "default"]).is_ok() {
            eprintln!("redfish lab: removing the pool a killed run left");
            self.virsh(&["pool-destroy", "default"])?;
        }
        Ok(())
    }

    /// The domain `name` the lab defined, if it did.
    pub fn domain(&self, name: &str) -> Option<Domain> {
        self.domains.lock().expect("not poisoned").iter().find(|d| d.name == name).cloned()
    }

    /// Runs `virsh -c qemu:///system <args>`; returns its stdout.
    pub fn virsh(&self, args: &[&str]) -> Result<String> {
        netns::output(Command::new("virsh").args(["-q", "-c", LIBVIRT_URI]).args(args))
    }

    /// Defines (does not start) a TCG BIOS domain `name`: 512 MiB, one CPU, a NIC with `mac` on
    /// `bridge`, an empty 1 GiB disk it boots from unless told otherwise (so a network boot
    /// proves the override), its serial console to a file.
    pub fn define(&self, name: &str, mac: &str, bridge: &str) -> Result<Domain> {
        self.define_with(
            name,
            mac,
            bridge,
            &Machine { firmware: Firmware::Bios, disks_mib: &[1024], memory_mib: 512, cpus: 1 },
        )
    }

    /// [`Libvirt::define`] with `machine`'s firmware and empty raw disks (`vda`, `vdb`, ...),
    /// whose files a test may read ([`Domain::disks`]). ACPI is on (OVMF needs it, and a
    /// guest's power-off turns the domain off).
    pub fn define_with(
        &self,
        name: &str,
        mac: &str,
        bridge: &str,
        machine: &Machine<'_>,
    ) -> Result<Domain> {
        let mut disks = Vec::new();
        let mut disk_xml = String::new();
        for (i, mib) in machine.disks_mib.iter().enumerate() {
            let letter = char::from(b'a' + u8::try_from(i).context("too many disks")?);
            let disk = self.dir.path().join(format!("{name}-vd{letter}.raw"));
            File::create(&disk)?.set_len(mib << 20)?;
            // cache='unsafe': the guest's flushes stop at the host's page cache. A guest's
            // etcd syncs its log on every write, and through to the host's disk that took
            // seconds while a build wrote beside it: a control plane's health checks failed.
            // The test reads the file through the same page cache; nothing here survives a
            // host crash anyway.
            disk_xml += &format!(
                "    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='unsafe'/><source file='{}'/><target dev='vd{letter}' bus='virtio'/>
    </disk>\n",
                disk.display()
            );
            disks.push(disk);
        }
        let console = self.dir.path().join(format!("{name}.console"));
        let second = self.dir.path().join(format!("{name}.ttyS1"));
        // EDK2's own PXE client, as `vm::Firmware::Uefi` says: the NIC's iPXE ROM is off.
        let (loader, rom) = match machine.firmware {
            Firmware::Bios => (String::new(), ""),
            Firmware::Uefi => (
                format!(
                    "<loader readonly='yes' type='pflash'>{OVMF_CODE}</loader>\
                     <nvram template='{OVMF_VARS}'>{}</nvram>",
                    self.dir.path().join(format!("{name}-VARS.fd")).display()
                ),
                "<rom enabled='no'/>",
            ),
        };
        let xml = format!(
            "<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>{memory}</memory>
  <vcpu>{cpus}</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type>{loader}<boot dev='hd'/></os>
  <features><acpi/></features>
  <devices>
{disk_xml}    <interface type='bridge'>
      <source bridge='{bridge}'/><mac address='{mac}'/><model type='virtio'/>{rom}
    </interface>
    <serial type='file'><source path='{console}' append='on'/><target port='0'/></serial>
    <serial type='file'><source path='{second}' append='on'/><target port='1'/></serial>
  </devices>
</domain>
",
            console = console.display(),
            second = second.display(),
            memory = machine.memory_mib,
            cpus = machine.cpus,
        );
        let file = self.dir.path().join(format!("{name}.xml"));
        std::fs::write(&file, xml)?;
        self.virsh(&["define", &file.to_string_lossy()])?;
        let uuid = self.virsh(&["domuuid", name])?.trim().to_ascii_lowercase();
        let domain =
            Domain { name: name.to_owned(), uuid, mac: mac.to_owned(), console, second, disks };
        self.domains.lock().expect("not poisoned").push(domain.clone());
        Ok(domain)
    }

    /// Gives `domain`'s running QEMU the CPU weight of `nice` (-20 to 19) against the rest of
    /// the machine. libvirt starts each QEMU in a session of its own, and with autogroups
    /// (`kernel.sched_autogroup_enabled`, on in Debian) the kernel shares the CPUs between
    /// sessions first: a thread's own nice counts only within its session, so the session's is
    /// set. A power cycle through the BMC starts a new QEMU, at 0 again.
    pub fn favour(&self, domain: &Domain, nice: i32) -> Result<()> {
        let pid_file = format!("/var/run/libvirt/qemu/{}.pid", domain.name);
        let pid =
            std::fs::read_to_string(&pid_file).with_context(|| format!("reading {pid_file}"))?;
        let autogroup = format!("/proc/{}/autogroup", pid.trim());
        std::fs::write(&autogroup, nice.to_string()).with_context(|| format!("writing {autogroup}"))
    }

    /// What libvirt says of `domain`'s state: `running`, `shut off`, ...
    pub fn state(&self, domain: &Domain) -> Result<String> {
        Ok(self.virsh(&["domstate", &domain.name])?.trim().to_owned())
    }
}

/// The hardware of a domain [`Libvirt::define_with`] makes.
#[derive(Debug, Clone, Copy)]
pub struct Machine<'a> {
    pub firmware: Firmware,
    /// The sizes of its disks, in MiB.
    pub disks_mib: &'a [u64],
    pub memory_mib: u32,
    pub cpus: u32,
}

impl Drop for Libvirt {
    fn drop(&mut self) {
        // The daemons print their own logs on a failing test (Supervised).
        for domain in self.domains.lock().expect("not poisoned").iter() {
            if std::thread::panicking() {
                domain.print_console();
            }
            // destroy fails for a domain that is off; undefine is what must happen.
            let _ = self.virsh(&["destroy", &domain.name]);
            if let Err(e) = self.virsh(&["undefine", "--nvram", &domain.name]) {
                eprintln!("redfish lab: {e:#}");
            }
        }
        self.libvirtd.stop();
        self.virtlogd.stop();
    }
}

impl Domain {
    /// The serial console so far (lossy UTF-8).
    pub fn console(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.console).unwrap_or_default()).into_owned()
    }

    /// Waits until a console line contains `pattern`; returns that line from the pattern on.
    pub fn wait_for_console(&self, pattern: &str, timeout: Duration) -> Result<String> {
        crate::wait::until(
            &format!("{pattern:?} on {}'s console", self.name),
            timeout,
            Duration::from_millis(500),
            || {
                let console = self.console();
                console
                    .lines()
                    .find_map(|line| line.find(pattern).map(|i| line[i..].trim().to_owned()))
            },
        )
    }

    /// The lines of its second serial port (the node image's journal, every boot's) that
    /// contain `pattern`: what one unit printed, which the printed tail may have lost among the
    /// others' lines.
    pub fn journal_lines(&self, pattern: &str) -> Vec<String> {
        let journal = std::fs::read(&self.second).unwrap_or_default();
        let journal = String::from_utf8_lossy(&journal);
        journal.lines().filter(|line| line.contains(pattern)).map(str::to_owned).collect()
    }

    /// The last `lines` lines of its serial console.
    pub fn console_tail(&self, lines: usize) -> String {
        let console = tail(&self.console, CONSOLE_TAIL_BYTES);
        let all: Vec<&str> = console.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Prints the tail of its console, and of its second serial port if the guest wrote there.
    pub fn print_console(&self) {
        let what = format!("console of domain {}", self.name);
        crate::failure::print_log(&what, &tail(&self.console, CONSOLE_TAIL_BYTES));
        if std::fs::metadata(&self.second).is_ok_and(|m| m.len() > 0) {
            let what = format!("ttyS1 of domain {}", self.name);
            crate::failure::print_log(&what, &tail(&self.second, CONSOLE_TAIL_BYTES));
        }
    }
}

/// How the emulator serves.
pub struct SushyOptions<'a> {
    /// `(username, password)`: the only credentials it accepts (basic authentication).
    pub user: (&'a str, &'a str),
    /// `(certificate PEM, key PEM)`: serve HTTPS with this certificate, else plain HTTP.
    pub tls: Option<(String, String)>,
    /// Listen on this namespace's loopback (for an appliance in it), else the test process's.
    pub netns: Option<&'a Netns>,
}

/// sushy-tools' Redfish emulator for the lab's libvirt, on 127.0.0.1.
pub struct Sushy {
    process: Supervised,
    port: u16,
    https: bool,
    _dir: TempDir,
}

impl Sushy {
    /// Starts the emulator and waits until it accepts connections.
    pub fn start(options: SushyOptions<'_>) -> Result<Self> {
        let python = emulator_python()?;
        let dir = tempfile::Builder::new().prefix("siteboot-sushy-").tempdir()?;
        let (user, password) = options.user;
        // sushy-tools reads an Apache-style file with bcrypt digests only.
        let digest = netns::output(Command::new(&python).args([
            "-c",
            "import bcrypt, sys; print(bcrypt.hashpw(sys.argv[1].encode(), bcrypt.gensalt(4)).decode())",
            password,
        ]))?;
        let users = dir.path().join("htpasswd");
        std::fs::write(&users, format!("{user}:{}\n", digest.trim()))?;
        let port = free_port()?;
        let mut config = format!(
            "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'\n\
             SUSHY_EMULATOR_LISTEN_PORT = {port}\n\
             SUSHY_EMULATOR_LIBVIRT_URI = '{LIBVIRT_URI}'\n\
             SUSHY_EMULATOR_AUTH_FILE = '{}'\n\
             SUSHY_EMULATOR_BOOT_LOADER_MAP = {{\
                 'UEFI': {{'x86_64': '{OVMF_CODE}'}}, 'Legacy': {{'x86_64': '{SEABIOS}'}}}}\n\
             SUSHY_EMULATOR_SECURE_BOOT_DISABLED_NVRAM = '{OVMF_VARS}'\n",
            users.display()
        );
        if let Some((cert, key)) = &options.tls {
            let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
            std::fs::write(&cert_path, cert)?;
            std::fs::write(&key_path, key)?;
            config += &format!(
                "SUSHY_EMULATOR_SSL_CERT = '{}'\nSUSHY_EMULATOR_SSL_KEY = '{}'\n",
                cert_path.display(),
                key_path.display()
            );
        }
        let config_path = dir.path().join("emulator.conf");
        std::fs::write(&config_path, config)?;
        // As a module: the venv's scripts name the directory it was made in before its rename.
        let mut command = match options.netns {
            Some(ns) => ns.command(&python),
            None => Command::new(&python),
        };
        command.args(["-m", "sushy_tools.emulator.main", "--config"]).arg(&config_path);
        let process = Supervised::spawn("sushy-emulator", &mut command, dir.path())?;
        let mut sushy = Self { process, port, https: options.tls.is_some(), _dir: dir };
        let listening = || -> bool {
            let connect = move || Ok(TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok());
            match options.netns {
                Some(ns) => ns.enter(connect).unwrap_or(false),
                None => connect().unwrap_or(false),
            }
        };
        crate::wait::for_("sushy-emulator to listen", READY_TIMEOUT, || {
            if let Some(status) = sushy.process.try_wait() {
                return Some(Err(anyhow::anyhow!("sushy-emulator exited ({status})")));
            }
            listening().then_some(Ok(()))
        })??;
        Ok(sushy)
    }

    /// `spec.bmc.address` for `domain` on this emulator.
    pub fn address(&self, domain: &Domain) -> String {
        let scheme = if self.https { "redfish+https" } else { "redfish+http" };
        format!("{scheme}://127.0.0.1:{}/redfish/v1/Systems/{}", self.port, domain.uuid)
    }

    pub fn log(&self) -> String {
        self.process.log()
    }
}

/// A port on 127.0.0.1 that nothing listens on just now (a test namespace's loopback is all
/// but empty: the port is as good as free there too).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port())
}

/// A port on 127.0.0.1 that refuses connections for as long as the returned socket lives: bound
/// and never listening, so no other process can take it. A [`free_port`] nothing listens on
/// "just now" was taken in CI by a test of the other stream, and the BMC client then met a
/// server instead of a refusal.
pub fn refusing_port() -> Result<(socket2::Socket, u16)> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&std::net::SocketAddr::from((Ipv4Addr::LOCALHOST, 0)).into())?;
    let port = socket.local_addr()?.as_socket().context("bound to an IPv4 address")?.port();
    Ok((socket, port))
}

/// The venv's python with sushy-tools and libvirt-python.
fn emulator_python() -> Result<PathBuf> {
    crate::venv::python_with(
        &format!("sushy-tools-{SUSHY_TOOLS}-libvirt-python-{LIBVIRT_PYTHON}"),
        &[format!("sushy-tools=={SUSHY_TOOLS}"), format!("libvirt-python=={LIBVIRT_PYTHON}")],
    )
    .context("libvirt-python builds against libvirt-dev with pkg-config: run scripts/setup")
}

/// Takes the machine-wide lab lock, waiting for another test's lab to finish.
fn lock_machine() -> Result<File> {
    let file = File::options().create(true).truncate(false).write(true).open(Path::new(LOCK))?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    crate::wait::until(
        "another test's libvirt lab to finish",
        LOCK_TIMEOUT,
        Duration::from_secs(1),
        || {
            // SAFETY: flock on a file descriptor we own; released when the File is closed.
            (unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0).then_some(())
        },
    )?;
    Ok(file)
}
