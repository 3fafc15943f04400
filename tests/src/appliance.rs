//! The `siteboot` binary under test, running inside a lab namespace: config written to a temp
//! directory, `siteboot serve --config FILE`, readiness on `GET /healthz`, and helpers for its
//! HTTP API. The test process is not in the namespace, so HTTP goes through
//! `ip netns exec NS curl`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::initramfs::BootFiles;
use crate::netns::{self, Netns};
use crate::process::Supervised;

/// The lab network: `br0` with this address in every test namespace (they are isolated).
pub const BRIDGE: &str = "br0";
pub const ADDRESS: &str = "10.99.0.1";
pub const PREFIX_LEN: u8 = 24;
pub const HTTP_PORT: u16 = 8080;
/// The profile [`lab_config`] defines: the test kernel + initramfs, which calls back.
pub const LAB_PROFILE: &str = "lab";
/// The lab profile's kernel command line. panic=-1: a kernel panic resets, -no-reboot makes
/// that a QEMU exit, and the test fails at once instead of at its deadline. no_timer_check: a
/// TCG guest on a busy machine can miss the timer interrupts the kernel's IO-APIC check counts
/// in its first milliseconds, and the kernel then panics ("IO-APIC + timer doesn't work!", seen
/// in a CI run).
pub const LAB_CMDLINE: &str = "console=ttyS0 quiet panic=-1 no_timer_check";

const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A namespace with the lab bridge `br0` at `10.99.0.1/24`.
pub fn lab_network(tag: &str) -> Result<Netns> {
    let ns = Netns::new(tag)?;
    ns.add_bridge(BRIDGE, &format!("{ADDRESS}/{PREFIX_LEN}"))?;
    Ok(ns)
}

/// A siteboot config for the lab network: DHCP `mode` (`full`, `proxy` or `off`), pool
/// 10.99.0.100-199, and every host booting the `lab` profile. Tests adjust the JSON value;
/// [`Appliance::start`] fills in `state_dir` and `http.root` unless set.
pub fn lab_config(mode: &str) -> Value {
    let mut dhcp = json!({ "mode": mode, "lease_time": "1h" });
    if mode == "full" {
        dhcp["subnets"] = json!([{
            "subnet": "10.99.0.0/24",
            "pools": ["10.99.0.100-10.99.0.199"],
            "router": ADDRESS,
            "dns": [ADDRESS],
            "domain": "lab.internal",
        }]);
    }
    json!({
        "interface": BRIDGE,
        "address": ADDRESS,
        "dhcp": dhcp,
        "http": { "port": HTTP_PORT },
        "profiles": {
            LAB_PROFILE: {
                "kernel": "lab/vmlinuz",
                "initrds": ["lab/initrd.img"],
                "cmdline": LAB_CMDLINE,
            }
        },
        "unknown_hosts": { "profile": LAB_PROFILE },
    })
}

/// `52:54:00:12:34:56` -> `52-54-00-12-34-56`, the form siteboot puts on kernel command lines.
pub fn mac_dashed(mac: &str) -> String {
    mac.to_ascii_lowercase().replace(':', "-")
}

/// A running `siteboot serve`; stopped on drop, its log printed if the test fails.
pub struct Appliance {
    ns: String,
    bin: PathBuf,
    base_url: String,
    config_path: PathBuf,
    state_dir: PathBuf,
    http_root: PathBuf,
    /// Behind a lock, so a test can crash and restart the appliance (`kill9`, `restart`)
    /// while its scenarios share it.
    process: Mutex<Option<Supervised>>,
    /// Extra `serve` arguments, kept for restarts.
    args: Vec<String>,
    dir: tempfile::TempDir,
}

impl Appliance {
    /// Writes `config` (YAML) and starts siteboot in `ns`, waiting until `/healthz` answers 200.
    pub fn start(ns: &Netns, config: Value) -> Result<Self> {
        Self::start_with_args(ns, config, &[])
    }

    /// [`start`](Self::start) with more `siteboot serve` arguments (e.g. `--kubeconfig`).
    pub fn start_with_args(ns: &Netns, mut config: Value, args: &[&str]) -> Result<Self> {
        let bin = binary()?;
        let dir = tempfile::Builder::new().prefix("siteboot-appliance-").tempdir()?;
        if config.get("state_dir").is_none() {
            config["state_dir"] = json!(dir.path().join("state"));
        }
        if config.pointer("/http/root").is_none() {
            config["http"]["root"] = json!(dir.path().join("files"));
        }
        let state_dir = PathBuf::from(config["state_dir"].as_str().context("state_dir")?);
        let http_root = PathBuf::from(config["http"]["root"].as_str().context("http.root")?);
        std::fs::create_dir_all(&http_root)?;
        let address = config["address"].as_str().context("config has no address")?;
        let port = config.pointer("/http/port").and_then(Value::as_u64).unwrap_or(8080);
        let base_url = format!("http://{address}:{port}");

        let config_path = dir.path().join("siteboot.yaml");
        std::fs::write(&config_path, serde_norway::to_string(&config)?)?;

        let appliance = Self {
            ns: ns.name().to_owned(),
            bin,
            base_url,
            config_path,
            state_dir,
            http_root,
            process: Mutex::new(None),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            dir,
        };
        appliance.spawn()?;
        Ok(appliance)
    }

    fn spawn(&self) -> Result<()> {
        let mut command = netns::exec(&self.ns, &self.bin);
        command.arg("serve").arg("--config").arg(&self.config_path).args(&self.args);
        // Enough detail to follow one boot in the log printed on failure; no colour codes.
        if std::env::var_os("SITEBOOT_LOG").is_none() {
            command.env("SITEBOOT_LOG", "info,siteboot_boot=debug");
        }
        command.env("NO_COLOR", "1");
        // Restarts append to the same log, so a failing test shows every run.
        let process = Supervised::spawn("siteboot", &mut command, self.dir.path())?;
        *self.process() = Some(process);
        self.wait_ready()
    }

    fn process(&self) -> std::sync::MutexGuard<'_, Option<Supervised>> {
        self.process.lock().expect("not poisoned")
    }

    fn wait_ready(&self) -> Result<()> {
        let result = crate::wait::until(
            "siteboot to answer GET /healthz with 200",
            READY_TIMEOUT,
            Duration::from_millis(200),
            || {
                let exited = self.process().as_mut().expect("spawned").try_wait();
                if let Some(status) = exited {
                    return Some(Err(anyhow::anyhow!("siteboot exited ({status})")));
                }
                match self.get("/healthz") {
                    Ok((200, _)) => Some(Ok(())),
                    _ => None,
                }
            },
        );
        result.and_then(|ready| ready).with_context(|| {
            format!(
                "config {}:\n{}\nlog:\n{}",
                self.config_path.display(),
                self.config(),
                self.log()
            )
        })
    }

    /// The running process's pid, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process().as_ref().map(Supervised::pid)
    }

    /// `http://10.99.0.1:8080`.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Files here are served at `/files/<path>`.
    pub fn http_root(&self) -> &Path {
        &self.http_root
    }

    /// Where the config is written: what `siteboot host --config` takes.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// The config as written.
    pub fn config(&self) -> String {
        std::fs::read_to_string(&self.config_path).unwrap_or_default()
    }

    /// Copies the test kernel + initramfs to where the `lab` profile points.
    pub fn install_boot_files(&self, files: &BootFiles) -> Result<()> {
        let dir = self.http_root.join("lab");
        std::fs::create_dir_all(&dir)?;
        std::fs::copy(&files.kernel, dir.join("vmlinuz")).context("copying the kernel")?;
        std::fs::copy(&files.initrd, dir.join("initrd.img")).context("copying the initrd")?;
        Ok(())
    }

    /// `GET path` -> (status, body).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        self.curl(&[], path)
    }

    /// `POST path` (empty body) -> (status, body).
    pub fn post(&self, path: &str) -> Result<(u16, String)> {
        self.curl(&["-X", "POST", "--data", ""], path)
    }

    fn curl(&self, args: &[&str], path: &str) -> Result<(u16, String)> {
        let url = format!("{}{path}", self.base_url);
        let out = netns::output(
            netns::exec(&self.ns, "curl")
                .args(["-sS", "--max-time", "10", "-o", "-", "-w", "\n%{http_code}"])
                .args(args)
                .arg(&url),
        )?;
        let (body, status) = out.rsplit_once('\n').context("curl printed no status")?;
        let status =
            status.trim().parse().with_context(|| format!("status of {url}: {status:?}"))?;
        Ok((status, body.to_owned()))
    }

    /// `GET /metrics`, parsed.
    pub fn metrics(&self) -> Result<Metrics> {
        match self.get("/metrics")? {
            (200, body) => Ok(Metrics::parse(&body)),
            (status, body) => bail!("GET /metrics: {status} {body}"),
        }
    }

    /// `GET /timeline/<mac>` as JSON.
    pub fn timeline(&self, mac: &str) -> Result<Value> {
        match self.get(&format!("/timeline/{}", mac_dashed(mac)))? {
            (200, body) => serde_json::from_str(&body).with_context(|| format!("timeline: {body}")),
            (status, body) => bail!("GET /timeline/{mac}: {status} {body}"),
        }
    }

    /// SIGKILL: no shutdown code runs, as in a crash or power loss.
    pub fn kill9(&self) {
        if let Some(process) = self.process().as_mut() {
            process.kill9();
        }
    }

    /// Sends `signal` (SIGSTOP, SIGCONT, SIGTERM...) to siteboot if it is running.
    pub fn signal(&self, signal: i32) {
        if let Some(process) = self.process().as_mut() {
            process.signal(signal);
        }
    }

    /// Stops siteboot (SIGTERM) if it is running, starts it again with the same config and
    /// state, and waits until it is ready.
    pub fn restart(&self) -> Result<()> {
        let running = self.process().take();
        if let Some(mut process) = running {
            process.stop();
        }
        self.spawn()
    }

    /// `Some(status)` if siteboot has exited.
    pub fn exited(&self) -> Option<std::process::ExitStatus> {
        self.process().as_mut().and_then(Supervised::try_wait)
    }

    pub fn log(&self) -> String {
        self.process().as_ref().map(Supervised::log).unwrap_or_default()
    }

    pub fn print_log(&self) {
        if let Some(process) = self.process().as_ref() {
            process.print_log();
        }
    }
}

/// The stages of a timeline (`dhcp-ack`, `ipxe-script`, `report`, ...), in order.
pub fn stages(timeline: &Value) -> Vec<String> {
    events(timeline).iter().filter_map(|e| e["stage"].as_str()).map(str::to_owned).collect()
}

/// The events of a timeline.
pub fn events(timeline: &Value) -> Vec<Value> {
    timeline["events"].as_array().cloned().unwrap_or_default()
}

/// Parses an event's RFC 3339 `at`.
pub fn event_time(event: &Value) -> Option<SystemTime> {
    let at = event["at"].as_str()?;
    // humantime takes `Z` only; siteboot may write the equivalent `+00:00`.
    let at = at.strip_suffix("+00:00").map(|t| format!("{t}Z")).unwrap_or_else(|| at.to_owned());
    humantime::parse_rfc3339(&at).ok()
}

/// Prometheus text exposition: series (`name{labels}`) -> value.
#[derive(Clone, Debug, Default)]
pub struct Metrics(pub BTreeMap<String, f64>);

impl Metrics {
    pub fn parse(text: &str) -> Self {
        let series = text
            .lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| {
                // The value follows the series (labels may contain spaces); a timestamp may follow.
                let split =
                    line.rfind('}').map(|i| i + 1).unwrap_or_else(|| line.find(' ').unwrap_or(0));
                let (series, rest) = line.split_at(split);
                let value = rest.split_whitespace().next()?.parse().ok()?;
                Some((series.trim().to_owned(), value))
            })
            .collect();
        Self(series)
    }

    /// One series, e.g. `siteboot_boot_steps_total{stage="report"}`; 0 if absent.
    pub fn get(&self, series: &str) -> f64 {
        self.0.get(series).copied().unwrap_or(0.0)
    }

    /// The sum of every counter (`*_total`) whose name contains `word`, e.g. `dhcp`.
    pub fn counters(&self, word: &str) -> f64 {
        self.0
            .iter()
            .filter(|(series, _)| {
                let name = series.split('{').next().unwrap_or_default();
                name.ends_with("_total") && name.contains(word)
            })
            .map(|(_, value)| value)
            .sum()
    }
}

/// The siteboot binary: `SITEBOOT_BIN`, else `<workspace>/target/debug/siteboot`. Fails if it
/// is missing or older than the sources it is built from.
pub fn binary() -> Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is in the workspace");
    let bin = std::env::var_os("SITEBOOT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/debug/siteboot"));
    let built = std::fs::metadata(&bin).and_then(|m| m.modified()).map_err(|_| {
        anyhow::anyhow!(
            "siteboot binary {} not found: run `cargo build -p siteboot` (scripts/test does this), \
             or point SITEBOOT_BIN at it",
            bin.display()
        )
    })?;
    let mut newest = None;
    for dir in ["appliance/src", "boot/src", "ipxe/src"] {
        newest_file(&root.join(dir), &mut newest)?;
    }
    if let Some((modified, source)) = newest
        && modified > built
    {
        bail!(
            "siteboot binary {} is older than {}: run `cargo build -p siteboot` (scripts/test does this)",
            bin.display(),
            source.display()
        );
    }
    Ok(bin)
}

/// Keeps in `newest` the most recently modified file under `dir` (recursively) if newer.
pub fn newest_file(dir: &Path, newest: &mut Option<(SystemTime, PathBuf)>) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            newest_file(&path, newest)?;
        } else {
            let modified = entry.metadata()?.modified()?;
            if newest.as_ref().is_none_or(|(time, _)| modified > *time) {
                *newest = Some((modified, path));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prometheus_text() {
        let metrics = Metrics::parse(
            "# HELP siteboot_dhcp_packets_total DHCP packets\n\
             # TYPE siteboot_dhcp_packets_total counter\n\
             siteboot_dhcp_packets_total{type=\"discover\"} 3\n\
             siteboot_dhcp_packets_total{type=\"request\",note=\"a b\"} 2\n\
             siteboot_dhcp_leases 7\n\
             siteboot_http_requests_total 5 1700000000000\n",
        );
        assert_eq!(metrics.counters("dhcp"), 5.0);
        assert_eq!(metrics.counters("http"), 5.0);
        assert_eq!(metrics.get("siteboot_dhcp_leases"), 7.0);
        assert_eq!(metrics.get("siteboot_dhcp_packets_total{type=\"discover\"}"), 3.0);
        assert_eq!(metrics.get("absent"), 0.0);
    }

    #[test]
    fn reads_timeline_times() {
        let event = json!({"at": "2026-01-02T03:04:05.5+00:00", "stage": "report"});
        let zulu = json!({"at": "2026-01-02T03:04:05Z", "stage": "report"});
        let delta = event_time(&event).unwrap().duration_since(event_time(&zulu).unwrap());
        assert_eq!(delta.unwrap(), Duration::from_millis(500));
    }
}
