//! The benchmark driver behind `scripts/bench` (`src/bin/bench.rs`): siteboot against the
//! servers a user would otherwise run (nginx, tftpd-hpa, dnsmasq, Kea), each in its own pair of
//! network namespaces joined by a veth, driven by real clients, with results as JSON and a
//! markdown table. Speeds are measured, never asserted: the smoke test only checks that every
//! benchmark ran and every peer is in the table.

pub mod controller;
pub mod dhcp;
pub mod http;
pub mod http_requests;
pub mod imaging;
pub mod report;
pub mod tftp;
pub mod tftp_concurrent;

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::appliance::BRIDGE;
use crate::netns::Netns;

/// The bench network: a /16, so the DHCP pool can be one too.
pub const SERVER_ADDRESS: &str = "10.98.0.1";
pub const CLIENT_ADDRESS: &str = "10.98.0.2";
pub const PREFIX_LEN: u8 = 16;

/// What to run, and how big.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Settings {
    pub runs: usize,
    pub http_bytes: u64,
    pub http_clients: Vec<usize>,
    pub tftp_bytes: u64,
    pub tftp_windows: Vec<u16>,
    /// Clients fetching an iPXE binary at once in `tftp-concurrent`.
    pub tftp_clients: usize,
    /// Length of one perfdhcp probe of the rate search.
    pub dhcp_seconds: u32,
    /// The rate search's ceiling, in exchanges/s.
    pub dhcp_max_rate: u32,
    pub only: Vec<String>,
    /// iPXE-script requests per run of the requests benchmark, and the keep-alive connections
    /// they share.
    pub script_requests: u64,
    pub script_connections: usize,
    /// Hosts, and the replicas a MachineDeployment is scaled to, in `controller`.
    #[serde(default = "controller_hosts")]
    pub controller_hosts: usize,
    /// Hosts imaging at once, one measurement each, and the image's size.
    #[serde(default)]
    pub imaging_hosts: Vec<usize>,
    #[serde(default)]
    pub imaging_bytes: u64,
}

/// What the issue asks for; the most the lab bridge takes (one port per simulated host).
fn controller_hosts() -> usize {
    1_000
}

impl Settings {
    /// The published run: 1 GiB over HTTP, 64 MiB over TFTP, 2 GiB images, 3 runs.
    pub fn full() -> Self {
        Self {
            runs: 3,
            http_bytes: 1 << 30,
            http_clients: vec![1, 16, 64],
            tftp_bytes: 64 << 20,
            tftp_windows: vec![1, 16, 64],
            tftp_clients: 200,
            dhcp_seconds: 3,
            dhcp_max_rate: 64_000,
            only: vec![],
            script_requests: 10_000,
            script_connections: 256,
            controller_hosts: controller_hosts(),
            imaging_hosts: vec![1, 8],
            imaging_bytes: 2 << 30,
        }
    }

    /// Seconds-long: every benchmark and every peer, tiny sizes, one run.
    pub fn smoke() -> Self {
        Self {
            runs: 1,
            http_bytes: 4 << 20,
            http_clients: vec![1, 4],
            tftp_bytes: 1 << 20,
            tftp_windows: vec![1, 16],
            tftp_clients: 10,
            dhcp_seconds: 1,
            dhcp_max_rate: 500,
            only: vec![],
            script_requests: 200,
            script_connections: 16,
            controller_hosts: 3,
            imaging_hosts: vec![1, 2],
            imaging_bytes: 16 << 20,
        }
    }

    pub fn wants(&self, benchmark: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == benchmark)
    }
}

/// A server namespace (bridge `br0` at [`SERVER_ADDRESS`]) and a client namespace joined to it
/// by a veth (`eth0` at [`CLIENT_ADDRESS`]). Both are deleted on drop.
pub struct Lab {
    pub client: Netns,
    pub server: Netns,
}

impl Lab {
    pub fn new(tag: &str) -> Result<Self> {
        let server = Netns::new(&format!("{tag}s"))?;
        server.add_bridge(BRIDGE, &format!("{SERVER_ADDRESS}/{PREFIX_LEN}"))?;
        let client = Netns::new(&format!("{tag}c"))?;
        server.connect(BRIDGE, &client, "eth0", None)?;
        Ok(Self { client, server })
    }

    /// Gives the client its address (perfdhcp wants none but its own on the link).
    pub fn address_client(&self) -> Result<()> {
        self.client.ip(&["addr", "add", &format!("{CLIENT_ADDRESS}/{PREFIX_LEN}"), "dev", "eth0"])
    }
}

/// User + system CPU seconds of `pid` and its live descendants (nginx's workers), from
/// `/proc/<pid>/stat`; reaped children are in the parent's cutime/cstime.
pub fn cpu_seconds(pid: u32) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut total = 0.0;
    let mut pending = vec![pid];
    while let Some(pid) = pending.pop() {
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // Fields after the command name (which may contain spaces) start at ") ".
            let fields: Vec<&str> =
                stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("").split(' ').collect();
            // utime, stime, cutime, cstime are fields 14-17 (1-based); index 0 here is field 3.
            total += fields
                .get(11..15)
                .unwrap_or(&[])
                .iter()
                .filter_map(|f| f.parse::<f64>().ok())
                .sum::<f64>()
                / ticks;
        }
        pending.extend(children(pid));
    }
    total
}

/// The live child processes of `pid`.
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return vec![] };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| c.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>())
        .collect()
}

/// Resets the peak RSS of `pid` (`VmHWM`), so the next [`peak_rss_kib`] covers what follows.
pub fn reset_peak_rss(pid: u32) -> Result<()> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").context("resetting VmHWM")
}

/// `VmHWM` of `pid`, in KiB.
pub fn peak_rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmHWM in /proc/<pid>/status")
}

/// A file of `bytes` bytes with varied content (not sparse: a sparse file would be served
/// from the zero page, flattering whoever reads it).
pub fn write_file(path: &Path, bytes: u64) -> Result<()> {
    use std::io::Write;
    let mut file = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path)?);
    let mut block = vec![0u8; 1 << 20];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut left = bytes;
    while left > 0 {
        for word in block.chunks_exact_mut(8) {
            // xorshift: cheap, and no page repeats.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        let n = left.min(block.len() as u64) as usize;
        file.write_all(&block[..n])?;
        left -= n as u64;
    }
    file.flush()?;
    Ok(())
}

/// dnsmasq in `lab`'s server namespace as `name` (its log and pid file in `dir`): what every
/// bench run of it shares (no config file, no DNS, in the foreground, bound to the bridge,
/// logging to stderr) and `args`; waits until it says it started.
pub fn start_dnsmasq(
    lab: &Lab,
    name: &str,
    args: &[String],
    dir: &Path,
) -> Result<crate::process::Supervised> {
    let mut command = lab.server.command("dnsmasq");
    command
        .args(["--keep-in-foreground", "--conf-file=/dev/null", "--port=0", "--user=root"])
        .args(["--bind-interfaces", "--log-facility=-"])
        .arg(format!("--interface={BRIDGE}"))
        .arg(format!("--pid-file={}", dir.join(format!("{name}.pid")).display()))
        .args(args);
    let mut process = crate::process::Supervised::spawn(name, &mut command, dir)?;
    wait_for("dnsmasq to start", Duration::from_secs(20), || {
        process.log().contains("started, version") || process.try_wait().is_some()
    })?;
    if let Some(status) = process.try_wait() {
        bail!("dnsmasq exited ({status}):\n{}", process.log_tail());
    }
    Ok(process)
}

/// Polls `probe` until it is true or `timeout` passes.
pub fn wait_for(what: &str, timeout: Duration, mut probe: impl FnMut() -> bool) -> Result<()> {
    crate::wait::until(what, timeout, Duration::from_millis(50), || probe().then_some(()))
}

/// Median, min and max of `values` (not empty).
pub fn spread(values: &[f64]) -> Result<(f64, f64, f64)> {
    if values.is_empty() {
        bail!("no values");
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = if n % 2 == 1 { sorted[n / 2] } else { (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0 };
    Ok((median, sorted[0], sorted[n - 1]))
}

/// The `q` quantile of `sorted` (ascending), nearest rank; 0 when there are no values.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).max(1);
    sorted.get(rank - 1).copied().unwrap_or(0.0)
}

/// The version each peer and client reports (its first line), for the record.
pub fn versions() -> Vec<(String, String)> {
    let version = |program: &str, arg: &str| {
        std::process::Command::new(program)
            .arg(arg)
            .output()
            .map(|o| {
                // nginx prints its version on stderr, the others on stdout.
                let text = [o.stdout, o.stderr].concat();
                let line = String::from_utf8_lossy(&text).lines().next().unwrap_or("").to_owned();
                // Up to the first word with a digit: the version, without build options.
                let mut words = Vec::new();
                for word in line.split_whitespace() {
                    words.push(word.trim_end_matches(','));
                    if word.contains(|c: char| c.is_ascii_digit()) {
                        break;
                    }
                }
                words.join(" ")
            })
            .unwrap_or_else(|e| format!("not found ({e})"))
    };
    [
        ("nginx", "nginx", "-v"),
        ("tftpd-hpa", "in.tftpd", "-V"),
        ("Kea", "kea-dhcp4", "-v"),
        ("dnsmasq", "dnsmasq", "--version"),
        ("perfdhcp", "perfdhcp", "-v"),
        ("curl", "curl", "--version"),
    ]
    .into_iter()
    .map(|(name, program, arg)| (name.to_owned(), version(program, arg)))
    .collect()
}
