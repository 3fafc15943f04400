//! Network namespaces for the boot-plane lab: every test builds its own little network (a bridge,
//! taps for VMs, veth pairs into other namespaces) so tests can run in parallel and never touch
//! the host's network. A namespace is deleted when its [`Netns`] is dropped, also on panic.

use std::ffi::OsStr;
use std::process::Command;
use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result, bail};

/// Prefix of every namespace the harness creates: `sbt-<tag>-<pid>-<n>`.
const PREFIX: &str = "sbt-";

static NEXT_NS: AtomicU32 = AtomicU32::new(0);

/// A network namespace owned by this test process.
pub struct Netns {
    name: String,
    next_link: AtomicU32,
}

impl Netns {
    /// Creates a fresh namespace with `lo` up. `tag` only makes the name readable.
    pub fn new(tag: &str) -> Result<Self> {
        static CLEANUP: Once = Once::new();
        CLEANUP.call_once(remove_stale);

        let n = NEXT_NS.fetch_add(1, Ordering::Relaxed);
        let name = format!("{PREFIX}{tag}-{}-{n}", std::process::id());
        run(Command::new("ip").args(["netns", "add", &name]))?;
        let ns = Self { name, next_link: AtomicU32::new(0) };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A command that runs `program` inside this namespace.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        exec(&self.name, program)
    }

    /// Runs `ip -n <ns> <args>` and fails with its stderr if it fails.
    pub fn ip(&self, args: &[&str]) -> Result<()> {
        run(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Adds a bridge with address `cidr` (e.g. `10.99.0.1/24`) and brings it up.
    pub fn add_bridge(&self, bridge: &str, cidr: &str) -> Result<()> {
        // No STP and no forwarding delay: a port must pass DHCP the moment firmware sends it.
        self.ip(&[
            "link",
            "add",
            bridge,
            "type",
            "bridge",
            "stp_state",
            "0",
            "forward_delay",
            "0",
        ])?;
        self.ip(&["addr", "add", cidr, "dev", bridge])?;
        self.ip(&["link", "set", bridge, "up"])
    }

    /// Adds a tap on `bridge` for a VM and returns its name.
    pub fn add_tap(&self, bridge: &str) -> Result<String> {
        let tap = format!("tap{}", self.next_link.fetch_add(1, Ordering::Relaxed));
        self.ip(&["tuntap", "add", &tap, "mode", "tap"])?;
        self.ip(&["link", "set", &tap, "master", bridge, "up"])?;
        Ok(tap)
    }

    /// Joins `peer` to `bridge` with a veth pair: the peer's end is `peer_if` (with `mac` if
    /// given), both ends up. Returns the name of this namespace's end.
    pub fn connect(
        &self,
        bridge: &str,
        peer: &Netns,
        peer_if: &str,
        mac: Option<&str>,
    ) -> Result<String> {
        let local = format!("veth{}", self.next_link.fetch_add(1, Ordering::Relaxed));
        let mut args = vec!["link", "add", &local, "type", "veth", "peer", "name", peer_if];
        if let Some(mac) = mac {
            args.extend(["address", mac]);
        }
        args.extend(["netns", &peer.name]);
        self.ip(&args)?;
        self.ip(&["link", "set", &local, "master", bridge, "up"])?;
        peer.ip(&["link", "set", peer_if, "up"])?;
        Ok(local)
    }

    /// Lets the machine's own processes reach `address`, an address on one of this
    /// namespace's bridges (a VM's): a veth pair from the machine into the namespace, a /32
    /// route to `address` through it, and the namespace masquerading what it forwards, so the
    /// VM answers an address on its own segment and needs no route back. All of it goes with
    /// the namespace (deleting one end of a veth pair deletes the other, and its routes).
    pub fn route_from_machine(&self, address: &str) -> Result<()> {
        let n = self.next_link.fetch_add(1, Ordering::Relaxed);
        // Unique on the machine: the pid, as the namespace's own name has it.
        let (outside, inside) = (format!("sbm{}x{n}", std::process::id()), format!("fm{n}"));
        let subnet = format!("10.253.{n}");
        run(Command::new("ip").args([
            "link", "add", &outside, "type", "veth", "peer", "name", &inside, "netns", &self.name,
        ]))?;
        run(Command::new("ip").args(["addr", "add", &format!("{subnet}.1/30"), "dev", &outside]))?;
        run(Command::new("ip").args(["link", "set", &outside, "up"]))?;
        self.ip(&["addr", "add", &format!("{subnet}.2/30"), "dev", &inside])?;
        self.ip(&["link", "set", &inside, "up"])?;
        run(self.command("sysctl").args(["-qw", "net.ipv4.ip_forward=1"]))?;
        let from = format!("{subnet}.1");
        run(self.command("iptables").args([
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-s",
            &from,
            "-j",
            "MASQUERADE",
        ]))?;
        let to = format!("{address}/32");
        // Replace: a killed run's route may outlive it while its processes hold its namespace.
        run(Command::new("ip").args(["route", "replace", &to, "via", &format!("{subnet}.2")]))
    }
}

impl Netns {
    /// Runs `f` on a thread that has entered this namespace, and returns its result. Sockets
    /// `f` creates stay in the namespace, so the test process can use them from anywhere.
    pub fn enter<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let name = self.name.clone();
        std::thread::spawn(move || -> Result<T> {
            // The thread ends when `f` returns.
            setns_current_thread(&name)?;
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("a thread in namespace {} panicked", self.name))?
    }

    /// Moves the calling thread into this namespace for the rest of its life: for a thread
    /// that lives there (a simulated host's), where [`Netns::enter`] spawns a thread per call.
    /// Only network state follows; the thread keeps the process's mounts (`/sys` is the
    /// host's), unlike [`Netns::command`]'s `ip netns exec`.
    pub fn enter_current_thread(&self) -> Result<()> {
        setns_current_thread(&self.name)
    }
}

/// setns(2) into network namespace `ns` for the calling thread only.
pub(crate) fn setns_current_thread(ns: &str) -> Result<()> {
    let path = format!("/run/netns/{ns}");
    let target = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    // SAFETY: setns on an open namespace file; it changes only the calling thread.
    if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&target), libc::CLONE_NEWNET) } != 0 {
        bail!("setns into {path}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Processes still inside keep the namespace alive until they exit; the name goes now.
        if let Err(err) = run(Command::new("ip").args(["netns", "del", &self.name])) {
            eprintln!("netns: {err:#}");
        }
    }
}

/// A command that runs `program` inside the namespace called `ns`.
pub fn exec(ns: &str, program: impl AsRef<OsStr>) -> Command {
    let mut command = Command::new("ip");
    command.args(["netns", "exec", ns]).arg(program);
    command
}

/// Runs a command to completion; an error carries its stderr.
pub fn run(command: &mut Command) -> Result<()> {
    output(command).map(drop)
}

/// Runs a command to completion and returns its stdout; an error carries its stderr.
pub fn output(command: &mut Command) -> Result<String> {
    let out = command.output().with_context(|| format!("running {command:?}"))?;
    if !out.status.success() {
        bail!(
            "{command:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Deletes namespaces left behind by test processes that were killed (their pid is gone).
fn remove_stale() {
    let Ok(list) = output(Command::new("ip").args(["netns", "list"])) else {
        return;
    };
    for name in list.lines().filter_map(|line| line.split_whitespace().next()) {
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid = rest.rsplit('-').nth(1).and_then(|pid| pid.parse::<u32>().ok());
        if let Some(pid) = pid
            && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = run(Command::new("ip").args(["netns", "del", name]));
        }
    }
}
