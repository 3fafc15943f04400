//! `bench`: siteboot against nginx (HTTP), tftpd-hpa and dnsmasq (TFTP), Kea and dnsmasq (DHCP), each in
//! its own network namespaces; the controller with simulated hosts; imaging with the deploy agent
//! against the line and disk limits.
//! Writes raw results as JSON and the tables into a markdown file (between the bench markers,
//! keeping the rest). Run through `scripts/bench` (release build).
//!
//! ```text
//! bench [--smoke] [--runs N]
//!       [--only http,http-requests,tftp,tftp-concurrent,dhcp,controller,imaging]
//!       [--http-bytes N] [--http-clients 1,16,64] [--script-requests N] [--script-connections N]
//!       [--tftp-bytes N] [--tftp-windows 1,16,64] [--tftp-clients N] [--dhcp-seconds S]
//!       [--dhcp-max-rate R] [--controller-hosts N] [--imaging-hosts 1,8] [--imaging-bytes N]
//!       [--json FILE] [--markdown FILE] [--command TEXT]
//! ```

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use siteboot_tests::bench::report::{self, Failure, Results};
use siteboot_tests::bench::{self, Settings};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut settings =
        if args.iter().any(|a| a == "--smoke") { Settings::smoke() } else { Settings::full() };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut json = root.join("docs/benchmarks.json");
    let mut markdown = root.join("docs/benchmarks.md");
    let mut command = "scripts/bench".to_owned();
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        if arg == "--smoke" {
            continue;
        }
        let value = rest.next().with_context(|| format!("{arg} needs a value"))?;
        let list = || value.split(',').map(str::parse).collect::<Result<Vec<_>, _>>();
        match arg.as_str() {
            "--runs" => settings.runs = value.parse()?,
            "--only" => settings.only = value.split(',').map(str::to_owned).collect(),
            "--http-bytes" => settings.http_bytes = value.parse()?,
            "--http-clients" => settings.http_clients = list()?,
            "--tftp-bytes" => settings.tftp_bytes = value.parse()?,
            "--tftp-windows" => {
                settings.tftp_windows =
                    value.split(',').map(str::parse).collect::<Result<_, _>>()?
            }
            "--tftp-clients" => settings.tftp_clients = value.parse()?,
            "--dhcp-seconds" => settings.dhcp_seconds = value.parse()?,
            "--dhcp-max-rate" => settings.dhcp_max_rate = value.parse()?,
            "--script-requests" => settings.script_requests = value.parse()?,
            "--script-connections" => settings.script_connections = value.parse()?,
            "--controller-hosts" => settings.controller_hosts = value.parse()?,
            "--imaging-hosts" => settings.imaging_hosts = list()?,
            "--imaging-bytes" => settings.imaging_bytes = value.parse()?,
            "--json" => json = value.into(),
            "--markdown" => markdown = value.into(),
            "--command" => command = value.clone(),
            other => bail!("unknown argument {other}"),
        }
    }
    // Per-request logging would cost siteboot what the peers (logging warnings only) do not pay.
    if std::env::var_os("SITEBOOT_LOG").is_none() {
        // SAFETY: single-threaded here; nothing else reads the environment yet.
        unsafe { std::env::set_var("SITEBOOT_LOG", "warn") };
    }
    let dir = tempfile::Builder::new().prefix("siteboot-bench-").tempdir()?;
    // A benchmark that fails costs its own table only: the others' results are still written.
    let mut failed = Vec::new();
    let http = attempt(&settings, "http", &mut failed, || bench::http::run(&settings, dir.path()));
    let http_requests = attempt(&settings, "http-requests", &mut failed, || {
        bench::http_requests::run(&settings, dir.path())
    });
    let tftp = attempt(&settings, "tftp", &mut failed, || bench::tftp::run(&settings, dir.path()));
    let dhcp = attempt(&settings, "dhcp", &mut failed, || bench::dhcp::run(&settings, dir.path()));
    let tftp_concurrent = attempt(&settings, "tftp-concurrent", &mut failed, || {
        bench::tftp_concurrent::run(&settings, dir.path())
    });
    let controller = attempt(&settings, "controller", &mut failed, || {
        bench::controller::run(&settings, dir.path())
    });
    let imaging =
        attempt(&settings, "imaging", &mut failed, || bench::imaging::run(&settings, dir.path()));
    let results = Results {
        command,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")?.trim().to_owned(),
        finished: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs(),
        versions: bench::versions(),
        settings,
        http,
        http_requests,
        tftp,
        dhcp,
        tftp_concurrent,
        controller,
        imaging,
        failed,
    };
    report::write(&results, &json, &markdown)?;
    println!("{}", results.markdown());
    if !results.failed.is_empty() {
        let names: Vec<&str> = results.failed.iter().map(|f| f.benchmark.as_str()).collect();
        bail!("failed: {} (the other results are written)", names.join(", "));
    }
    Ok(())
}

/// The samples of benchmark `name` if it is wanted and succeeds; a failure is recorded instead.
fn attempt<T>(
    settings: &Settings,
    name: &str,
    failed: &mut Vec<Failure>,
    benchmark: impl FnOnce() -> Result<Vec<T>>,
) -> Vec<T> {
    if !settings.wants(name) {
        return Vec::new();
    }
    benchmark().unwrap_or_else(|e| {
        eprintln!("bench: {name} failed: {e:#}");
        failed.push(Failure { benchmark: name.to_owned(), error: format!("{e:#}") });
        Vec::new()
    })
}
