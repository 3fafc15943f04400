//! `demo`: boots one BIOS VM from siteboot in a throwaway network namespace and prints what
//! happened: the boot timeline siteboot recorded for the VM's MAC (relative times) and the tail
//! of the VM's serial console. Exits non-zero if the VM did not boot and call back.
//!
//! `demo cluster` shows the headline path instead: a VM behind a Redfish BMC imaged and joined
//! as a Node through Cluster API, then drained and wiped ([`cluster`]).
//!
//! Run by `scripts/demo` (which builds siteboot first). Needs root: it creates a network
//! namespace, a bridge and a tap. Nothing leaves the namespace.

mod cluster;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::initramfs;
use siteboot_tests::vm::{self, Firmware, Vm, VmConfig};

const MAC: &str = "52:54:00:de:00:01";
const BOOT_TIMEOUT: Duration = Duration::from_secs(240);
const CONSOLE_LINES: usize = 25;

fn main() -> ExitCode {
    let result = match std::env::args().nth(1).as_deref() {
        None => run(),
        Some("cluster") => {
            root().and_then(|()| tokio::runtime::Runtime::new()?.block_on(cluster::run()))
        }
        Some(other) => Err(anyhow::anyhow!("unknown demo {other:?}: run `demo` or `demo cluster`")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("\ndemo failed: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn root() -> Result<()> {
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("run as root: the demo creates a network namespace, a bridge and a tap");
    }
    Ok(())
}

fn run() -> Result<()> {
    root()?;
    vm::check_installed()?;
    let started = Instant::now();

    println!("==> test kernel + busybox initramfs");
    let boot = initramfs::boot_files()?;
    println!("    {} (Linux {})", boot.initrd.display(), boot.kernel_version);

    println!("==> siteboot in a private network namespace");
    let ns = appliance::lab_network("demo")?;
    let config = appliance::lab_config("full");
    let siteboot = Appliance::start(&ns, config)?;
    siteboot.install_boot_files(&boot)?;
    println!(
        "    namespace {}, bridge {}, serving at {}",
        ns.name(),
        appliance::BRIDGE,
        siteboot.base_url()
    );

    println!(
        "==> BIOS VM {MAC}: SeaBIOS -> iPXE ROM -> DHCP -> HTTP script -> kernel + initrd -> callback"
    );
    let tap = ns.add_tap(appliance::BRIDGE)?;
    let vm_started = Instant::now();
    let mut vm = Vm::start(&ns, VmConfig::new("demo", Firmware::Bios, MAC, &tap))?;
    let outcome = vm.wait_for_console("SITEBOOT-TEST: callback", BOOT_TIMEOUT);
    let boot_time = vm_started.elapsed();

    let timeline = siteboot.timeline(MAC);
    match &timeline {
        Ok(timeline) => print_timeline(timeline),
        Err(err) => println!("\n(no timeline: {err:#})"),
    }
    println!("\nVM console (last {CONSOLE_LINES} lines):");
    let console = vm.console();
    let lines: Vec<&str> = console.lines().filter(|l| !l.trim().is_empty()).collect();
    for line in &lines[lines.len().saturating_sub(CONSOLE_LINES)..] {
        println!("  | {line}");
    }

    let marker = outcome.inspect_err(|_| siteboot.print_log())?;
    if marker != "SITEBOOT-TEST: callback ok" {
        siteboot.print_log();
        bail!("the VM booted but its callback failed: {marker}");
    }
    let stages = appliance::stages(&timeline?);
    if !stages.iter().any(|s| s == "report") {
        siteboot.print_log();
        bail!("siteboot's timeline has no report from the VM");
    }
    println!(
        "\nok: the VM booted from siteboot and called back {:.1}s after power-on ({:.1}s in all)",
        boot_time.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// One line per event: time since the first event, stage, detail.
fn print_timeline(timeline: &serde_json::Value) {
    let events = appliance::events(timeline);
    println!("\nBoot timeline of {MAC} (GET /timeline/{}):", appliance::mac_dashed(MAC));
    let start = events.first().and_then(appliance::event_time);
    for event in &events {
        let offset = match (start, appliance::event_time(event)) {
            (Some(start), Some(at)) => {
                format!("+{:7.3}s", at.duration_since(start).unwrap_or_default().as_secs_f64())
            }
            _ => event["at"].as_str().unwrap_or("?").to_owned(),
        };
        let stage = event["stage"].as_str().unwrap_or("?");
        let detail = event["detail"].as_str().unwrap_or("");
        println!("  {offset}  {stage:<14} {detail}");
    }
}
