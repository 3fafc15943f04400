//! DHCP: perfdhcp 4-way exchanges (DISCOVER-OFFER-REQUEST-ACK) per second at ≤0.1% drops,
//! siteboot (full mode) against Kea (memfile, persist) and dnsmasq, each with the same /16 pool
//! and lease time and without per-packet logging. The highest rate is searched for: doubling
//! from [`FIRST_RATE`] until a probe drops too much, then bisecting. The latency of each leg
//! (DISCOVER to OFFER, REQUEST to ACK: where a lease is written before the answer) comes from
//! perfdhcp's per-packet timestamps at the highest passing rate.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{CLIENT_ADDRESS, Lab, PREFIX_LEN, SERVER_ADDRESS, Settings};
use crate::appliance::{Appliance, BRIDGE};
use crate::clients::PerfdhcpReport;
use crate::process::Supervised;

const POOL_START: &str = "10.98.1.0";
const POOL_END: &str = "10.98.255.254";
const LEASE_SECONDS: u32 = 3600;
/// Simulated clients: about the pool's size, so most exchanges make a new lease.
const CLIENTS: u32 = 60_000;
const FIRST_RATE: u32 = 250;
const BISECTIONS: u32 = 3;
pub const MAX_DROP_RATIO: f64 = 0.001;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub server: String,
    pub run: usize,
    /// The highest offered rate with ≤0.1% drops (0 if none passed).
    pub rate: u32,
    /// 4-way exchanges completed per second at that rate.
    pub exchanges_per_second: f64,
    /// Server CPU seconds per 1,000 completed exchanges at that rate.
    pub cpu_per_1000: f64,
    /// DISCOVER to OFFER and REQUEST to ACK delays at that rate.
    pub offer: Latency,
    pub ack: Latency,
    pub probes: Vec<Probe>,
}

/// One leg's delay, from perfdhcp's per-packet timestamps (`-x t`): sent to answered, in ms.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Latency {
    pub p50_ms: f64,
    pub p99_ms: f64,
}

impl Latency {
    fn of(delays_ms: &[f64]) -> Self {
        let mut sorted = delays_ms.to_vec();
        sorted.sort_by(f64::total_cmp);
        Self { p50_ms: super::percentile(&sorted, 0.50), p99_ms: super::percentile(&sorted, 0.99) }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Probe {
    pub rate: u32,
    pub sent: u64,
    pub acks: u64,
    pub drops: u64,
    pub cpu_seconds: f64,
    pub offer: Latency,
    pub ack: Latency,
}

impl Probe {
    fn passed(&self) -> bool {
        self.acks > 0 && (self.drops as f64) <= MAX_DROP_RATIO * self.sent as f64
    }
}

pub const SERVERS: [&str; 3] = ["siteboot", "kea", "dnsmasq"];

pub fn run(settings: &Settings, dir: &Path) -> Result<Vec<Sample>> {
    let mut samples = Vec::new();
    for run in 0..settings.runs {
        for server in SERVERS {
            let lab = Lab::new("bd")?;
            lab.address_client()?;
            let work = dir.join(format!("dhcp-{server}-{run}"));
            std::fs::create_dir_all(&work)?;
            let (pid, _running): (u32, Box<dyn std::any::Any>) = match server {
                "siteboot" => {
                    let a = start_siteboot(&lab)?;
                    (a.pid().context("siteboot runs")?, Box::new(a))
                }
                "kea" => {
                    let p = start_kea(&lab, &work)?;
                    (p.pid(), Box::new(p))
                }
                _ => {
                    let p = start_dnsmasq(&lab, &work)?;
                    (p.pid(), Box::new(p))
                }
            };
            // For attaching a profiler (`perf record -p`, `strace -c -p`) to the server.
            eprintln!("dhcp {server} run={run}: server pid {pid}");
            let sample = search(&lab, server, run, pid, settings, &work)?;
            eprintln!(
                "dhcp {server} run={run}: {:.0} exchanges/s at offered {}/s",
                sample.exchanges_per_second, sample.rate
            );
            samples.push(sample);
        }
    }
    Ok(samples)
}

fn search(
    lab: &Lab,
    server: &str,
    run: usize,
    pid: u32,
    settings: &Settings,
    work: &Path,
) -> Result<Sample> {
    let mut probes: Vec<Probe> = Vec::new();
    let mut probe_at = |rate: u32| -> Result<bool> {
        let probe = probe(lab, pid, rate, settings.dhcp_seconds, work)?;
        let passed = probe.passed();
        eprintln!(
            "  dhcp {server} {rate}/s: {} acks, {} drops of {} sent, {:.1} ms server CPU per 1,000 acks{}",
            probe.acks,
            probe.drops,
            probe.sent,
            probe.cpu_seconds * 1e6 / probe.acks.max(1) as f64,
            if passed { "" } else { " (too many drops)" }
        );
        probes.push(probe);
        Ok(passed)
    };
    let (mut good, mut bad) = (0, None);
    let mut rate = FIRST_RATE.min(settings.dhcp_max_rate);
    loop {
        if probe_at(rate)? {
            good = rate;
            if rate >= settings.dhcp_max_rate {
                break;
            }
            rate = (rate * 2).min(settings.dhcp_max_rate);
        } else {
            bad = Some(rate);
            break;
        }
    }
    if let Some(mut bad) = bad {
        for _ in 0..BISECTIONS {
            let mid = (good + bad) / 2;
            if mid <= good || mid >= bad {
                break;
            }
            if probe_at(mid)? { good = mid } else { bad = mid }
        }
    }
    let best = probes.iter().rfind(|p| p.rate == good && p.passed()).cloned();
    let seconds = f64::from(settings.dhcp_seconds);
    Ok(Sample {
        server: server.to_owned(),
        run,
        rate: good,
        exchanges_per_second: best.as_ref().map_or(0.0, |p| p.acks as f64 / seconds),
        cpu_per_1000: best.as_ref().map_or(0.0, |p| p.cpu_seconds * 1000.0 / p.acks as f64),
        offer: best.as_ref().map_or_else(Latency::default, |p| p.offer),
        ack: best.as_ref().map_or_else(Latency::default, |p| p.ack),
        probes,
    })
}

fn probe(lab: &Lab, pid: u32, rate: u32, seconds: u32, work: &Path) -> Result<Probe> {
    let cpu = super::cpu_seconds(pid);
    let mut command = lab.client.command("perfdhcp");
    command
        .args(["-4", "-l", "eth0", "-r", &rate.to_string(), "-R", &CLIENTS.to_string()])
        .args(["-p", &seconds.to_string()])
        // Wait for the answers to the last requests before counting them as drops.
        .args(["-W", "1000000"])
        // Every answered packet's timestamps, for the latency percentiles.
        .args(["-x", "t"]);
    let mut process = Supervised::spawn("perfdhcp", &mut command, work)?;
    let status = process.wait_timeout(Duration::from_secs(u64::from(seconds) + 30))?;
    let report = PerfdhcpReport::parse(&process.log());
    std::fs::remove_file(process.log_path())?;
    let cpu_seconds = super::cpu_seconds(pid) - cpu;
    let (Some(offer), Some(ack)) =
        (report.exchange("DISCOVER-OFFER"), report.exchange("REQUEST-ACK"))
    else {
        bail!("perfdhcp ({status}) printed no statistics:\n{}", report.output);
    };
    Ok(Probe {
        rate,
        sent: offer.sent + ack.sent,
        acks: ack.received,
        drops: offer.drops + ack.drops,
        cpu_seconds,
        offer: Latency::of(&offer.delays_ms),
        ack: Latency::of(&ack.delays_ms),
    })
}

fn start_siteboot(lab: &Lab) -> Result<Appliance> {
    let config = json!({
        "interface": BRIDGE,
        "address": SERVER_ADDRESS,
        "dhcp": {
            "mode": "full",
            "lease_time": format!("{LEASE_SECONDS}s"),
            // perfdhcp acts as a relay from its own address; Kea and dnsmasq answer relays
            // in a subnet they serve, siteboot only those it is told to trust.
            "trusted_relays": [CLIENT_ADDRESS],
            "subnets": [{
                "subnet": format!("10.98.0.0/{PREFIX_LEN}"),
                "pools": [format!("{POOL_START}-{POOL_END}")],
                "router": SERVER_ADDRESS,
            }],
        },
        "profiles": { "none": { "script": "#!ipxe\nexit\n" } },
    });
    Appliance::start(&lab.server, config)
}

/// Kea 2.2's kea-dhcp4 with the memfile backend persisting to CSV (its default), raw sockets,
/// logging warnings only.
fn start_kea(lab: &Lab, work: &Path) -> Result<Supervised> {
    let leases = work.join("kea-leases4.csv");
    let config = json!({ "Dhcp4": {
        "interfaces-config": { "interfaces": [BRIDGE], "dhcp-socket-type": "raw" },
        "lease-database": {
            "type": "memfile", "persist": true, "name": leases, "lfc-interval": 0,
        },
        "valid-lifetime": LEASE_SECONDS,
        "subnet4": [{
            "id": 1,
            "subnet": format!("10.98.0.0/{PREFIX_LEN}"),
            "pools": [{ "pool": format!("{POOL_START} - {POOL_END}") }],
            "option-data": [{ "name": "routers", "data": SERVER_ADDRESS }],
        }],
        "loggers": [{
            "name": "kea-dhcp4",
            "output_options": [{ "output": "stdout" }],
            "severity": "WARN",
        }],
    }});
    let path = work.join("kea-dhcp4.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config)?)?;
    let mut command = lab.server.command("kea-dhcp4");
    command.arg("-c").arg(&path).env("KEA_PIDFILE_DIR", work).env("KEA_LOCKFILE_DIR", work);
    let mut process = Supervised::spawn("kea-dhcp4", &mut command, work)?;
    // Kea writes the CSV's header once its lease database is open, before it serves.
    super::wait_for("Kea to open its lease file", Duration::from_secs(20), || {
        leases.exists() || process.try_wait().is_some()
    })?;
    if let Some(status) = process.try_wait() {
        bail!("kea-dhcp4 exited ({status}):\n{}", process.log_tail());
    }
    wait_answering(lab, work).with_context(|| process.log_tail())?;
    Ok(process)
}

/// dnsmasq as a DHCP server only (DNS off), no per-lease logging, no ping before offering,
/// and a lease limit as large as the pool (its default is 1,000).
fn start_dnsmasq(lab: &Lab, work: &Path) -> Result<Supervised> {
    let args = [
        "--quiet-dhcp".to_owned(),
        "--no-ping".to_owned(),
        format!("--dhcp-range={POOL_START},{POOL_END},255.255.0.0,{LEASE_SECONDS}"),
        "--dhcp-lease-max=70000".to_owned(),
        format!("--dhcp-leasefile={}", work.join("dnsmasq.leases").display()),
    ];
    let process = super::start_dnsmasq(lab, "dnsmasq", &args, work)?;
    wait_answering(lab, work).with_context(|| process.log_tail())?;
    Ok(process)
}

/// Until one exchange completes (Kea and dnsmasq say nothing when their sockets are ready).
fn wait_answering(lab: &Lab, work: &Path) -> Result<()> {
    super::wait_for("the DHCP server to answer perfdhcp", Duration::from_secs(20), || {
        let mut command = lab.client.command("perfdhcp");
        command.args(["-4", "-l", "eth0", "-r", "1", "-n", "1", "-W", "500000"]);
        Supervised::spawn("perfdhcp-ready", &mut command, work)
            .and_then(|mut p| {
                let _ = p.wait_timeout(Duration::from_secs(10))?;
                let report = PerfdhcpReport::parse(&p.log());
                std::fs::remove_file(p.log_path())?;
                // An OFFER shows the server answers. (With -n 1 perfdhcp may exit before a
                // REQUEST's ACK arrives: Kea's often came too late and the probe never passed.)
                Ok(report.exchange("DISCOVER-OFFER").is_some_and(|e| e.received > 0))
            })
            .unwrap_or(false)
    })
}
