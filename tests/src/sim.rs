//! A simulated bare-metal host: a namespace with one NIC on the lab bridge that does on the wire
//! what a machine does when it network-boots from siteboot. It gets a lease with a real DHCP
//! client (udhcpc), fetches its iPXE script, then either "boots the local disk" (the OS phase)
//! or fetches the ramdisk's kernel and initrd and plays the deploy ramdisk against the agent
//! API (`/agent/v1/...`) with the token from its kernel command line. It speaks to the agent
//! API as the real ramdisk does: with `siteboot_agent`'s client, over HTTPS, pinning the
//! certificate fingerprint from that command line.
//!
//! What it cannot do by itself (power-cycle when told, run a kubelet) the test does through
//! [`SimHost::reboot`] and the Kubernetes API.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use siteboot_agent::{AgentClient, Cmdline, Token};

use crate::clients::{ClientHost, Udhcpc};
use crate::netns::{self, Netns};

/// Where a simulated host is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Firmware: DHCP, then the boot script.
    Booting,
    /// In the deploy ramdisk, talking to the agent API.
    Ramdisk,
    /// Running the installed OS (the script said `exit`).
    Os,
}

/// What the simulated ramdisk reports from inspection.
/// The SMBIOS UUID of the simulated machine with boot MAC `mac`: what its ramdisk reports and
/// its kubelet registers (`Node.status.nodeInfo.systemUUID`).
pub fn system_uuid(mac: &str) -> String {
    format!("5e7b0000-0000-4000-8000-{}", mac.to_ascii_lowercase().replace(':', ""))
}

pub fn hardware() -> Value {
    json!({
        "cpus": 4, "memoryMiB": 8192, "arch": "x86_64",
        "disks": [{ "name": "sda", "sizeBytes": 128_000_000_000u64, "model": "QEMU HARDDISK", "rotational": false }],
        "nics": [{ "name": "eth0", "mac": "" }],
    })
}

struct Shared {
    mac: String,
    base_url: String,
    phase: Mutex<Phase>,
    reboot: AtomicBool,
    stop: AtomicBool,
    boots: AtomicU32,
    token: Mutex<Option<String>>,
    /// The agent API client of the current ramdisk boot (URL and pin from its command line).
    agent: Mutex<Option<AgentClient>>,
    bootstrap: Mutex<Vec<String>>,
    log: Mutex<Vec<String>>,
    /// Manual hosts boot and fetch their ramdisk, then leave the agent API to the test.
    manual: bool,
    /// How long writing an image or wiping takes, in milliseconds.
    work_ms: std::sync::atomic::AtomicU64,
    /// Told to wait, the ramdisk waits the answer's seconds as the agent does; else 500 ms, so
    /// tests see a new task at once.
    waits_as_told: AtomicBool,
}

impl Shared {
    fn note(&self, line: String) {
        let mut log = self.log.lock().unwrap();
        log.push(format!("{:?} {line}", Instant::now()));
        if log.len() > 500 {
            log.remove(0);
        }
    }

    fn set_phase(&self, phase: Phase) {
        *self.phase.lock().unwrap() = phase;
    }

    /// Whether to stop what the host is doing and boot again (or stop altogether).
    fn interrupted(&self) -> bool {
        self.stop.load(Ordering::Acquire) || self.reboot.load(Ordering::Acquire)
    }
}

pub struct SimHost {
    shared: Arc<Shared>,
    host: Arc<ClientHost>,
    thread: Option<JoinHandle<()>>,
}

impl SimHost {
    /// A host that boots and follows its ramdisk tasks on its own.
    pub fn start(lab: &Netns, bridge: &str, mac: &str, base_url: &str) -> Result<Self> {
        Self::spawn(lab, bridge, mac, base_url, false)
    }

    /// A host that boots into the ramdisk and, once it holds a token, stops there: the test
    /// drives the agent API. A ramdisk without a token waits for work as the agent does.
    pub fn start_manual(lab: &Netns, bridge: &str, mac: &str, base_url: &str) -> Result<Self> {
        Self::spawn(lab, bridge, mac, base_url, true)
    }

    fn spawn(lab: &Netns, bridge: &str, mac: &str, base_url: &str, manual: bool) -> Result<Self> {
        let host = Arc::new(ClientHost::attach(lab, bridge, mac)?);
        let shared = Arc::new(Shared {
            mac: mac.to_owned(),
            base_url: base_url.to_owned(),
            phase: Mutex::new(Phase::Booting),
            reboot: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            boots: AtomicU32::new(0),
            token: Mutex::new(None),
            agent: Mutex::new(None),
            bootstrap: Mutex::new(Vec::new()),
            log: Mutex::new(Vec::new()),
            manual,
            work_ms: std::sync::atomic::AtomicU64::new(0),
            waits_as_told: AtomicBool::new(false),
        });
        let (s, h) = (shared.clone(), host.clone());
        let thread = std::thread::spawn(move || run(&s, &h));
        Ok(Self { shared, host, thread: Some(thread) })
    }

    pub fn mac(&self) -> &str {
        &self.shared.mac
    }

    pub fn phase(&self) -> Phase {
        self.shared.phase.lock().unwrap().clone()
    }

    /// Power-cycles the host: it drops what it does and network-boots again.
    pub fn reboot(&self) {
        self.shared.note("power cycle requested".into());
        self.shared.reboot.store(true, Ordering::Release);
    }

    /// Makes imaging and wiping take `time` (so a test can crash siteboot in the middle).
    pub fn set_work_time(&self, time: Duration) {
        self.shared.work_ms.store(time.as_millis() as u64, Ordering::Release);
    }

    /// Makes the ramdisk wait as long as the answer says (1 s to 5 min), as the real agent
    /// does: the load a rack's idle ramdisks put on the appliance (the controller benchmark).
    pub fn wait_as_told(&self) {
        self.shared.waits_as_told.store(true, Ordering::Release);
    }

    /// How many times it has fetched a boot script.
    pub fn boots(&self) -> u32 {
        self.shared.boots.load(Ordering::Acquire)
    }

    /// The token on its current ramdisk command line.
    pub fn token(&self) -> Option<String> {
        self.shared.token.lock().unwrap().clone()
    }

    /// Every bootstrap payload its ramdisk received.
    pub fn bootstrap_data(&self) -> Vec<String> {
        self.shared.bootstrap.lock().unwrap().clone()
    }

    /// An HTTP request from this host's address: (status, body). `/agent/...` goes over HTTPS
    /// to the agent API its ramdisk was told about, pinning that certificate.
    pub fn http(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> Result<(u16, String)> {
        if path.starts_with("/agent/") {
            let agent = self.shared.agent.lock().unwrap().clone();
            let agent = agent.context("the host has not booted a ramdisk: no agent API to ask")?;
            return agent_http(&self.host.ns, &agent, method, path, token, body);
        }
        http(&self.host.ns, &self.shared.base_url, method, path, token, body)
    }

    /// A request over plain HTTP from this host's address, whatever the path (what an old
    /// or misconfigured ramdisk would send): (status, body).
    pub fn http_plain(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
    ) -> Result<(u16, String)> {
        http(&self.host.ns, &self.shared.base_url, method, path, token, None)
    }

    pub fn log(&self) -> String {
        self.shared.log.lock().unwrap().join("\n")
    }
}

impl Drop for SimHost {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if std::thread::panicking() {
            eprintln!("----- simulated host {} -----\n{}\n-----", self.shared.mac, self.log());
        }
    }
}

fn run(s: &Shared, host: &ClientHost) {
    while !s.stop.load(Ordering::Acquire) {
        s.reboot.store(false, Ordering::Release);
        s.set_phase(Phase::Booting);
        *s.token.lock().unwrap() = None;
        *s.agent.lock().unwrap() = None;
        if let Err(e) = boot(s, host) {
            s.note(format!("boot failed: {e:#}"));
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

/// One power-on: DHCP, script, then the OS or the ramdisk until interrupted or done.
fn boot(s: &Shared, host: &ClientHost) -> Result<()> {
    // Power-on: no address yet, as a real NIC.
    let _ = host.ns.ip(&["addr", "flush", "dev", ClientHost::IFACE]);
    let mut dhcp = Udhcpc::start(host, &[])?;
    let lease = dhcp.wait_bound(Duration::from_secs(30))?;
    s.note(format!("lease {:?}", lease.address));
    let script = loop {
        let (status, body) = http(
            &host.ns,
            &s.base_url,
            "GET",
            &format!("/boot/{}.ipxe", s.mac.replace(':', "-")),
            None,
            None,
        )?;
        if status == 200 {
            break body;
        }
        s.note(format!("boot script: {status}"));
        if s.interrupted() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    s.boots.fetch_add(1, Ordering::AcqRel);
    if script.lines().any(|l| l.split_whitespace().next() == Some("exit")) {
        s.note("booting the local disk".into());
        s.set_phase(Phase::Os);
        while !s.interrupted() {
            std::thread::sleep(Duration::from_millis(200));
        }
        dhcp.kill();
        return Ok(());
    }
    let (files, cmdline) = parse_script(&script)?;
    let token = cmdline.token.as_ref().map(|t| t.as_str().to_owned());
    let agent = agent_client(&cmdline);
    for url in files {
        let path = url.strip_prefix(&s.base_url).context("ramdisk served elsewhere")?;
        let (status, _) = http(&host.ns, &s.base_url, "GET", path, None, None)?;
        if status != 200 {
            bail!("GET {url}: {status}");
        }
    }
    *s.token.lock().unwrap() = token.clone();
    *s.agent.lock().unwrap() = Some(agent.clone());
    // trust_controller.rs counts these lines: keep "(token: ...)" as it is.
    s.note(format!("in the ramdisk (token: {}) agent API {}", token.is_some(), agent.url()));
    s.set_phase(Phase::Ramdisk);
    // A manual host leaves its token's calls to the test; without a token it waits for work
    // as the agent does (and boots again when told: its Host was still Registering, say).
    if s.manual && token.is_some() {
        while !s.interrupted() {
            std::thread::sleep(Duration::from_millis(200));
        }
    } else {
        ramdisk(s, host, &agent, token.as_deref())?;
    }
    dhcp.kill();
    Ok(())
}

/// The kernel and initrd URLs of an iPXE script siteboot wrote, and the kernel command line
/// as the ramdisk agent reads it.
fn parse_script(script: &str) -> Result<(Vec<String>, Cmdline)> {
    let mut files = Vec::new();
    for line in script.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["kernel", url, ..] => files.push((*url).to_owned()),
            ["initrd", "--name", _, url] => files.push((*url).to_owned()),
            _ => {}
        }
    }
    if files.is_empty() {
        bail!("not a kernel script:\n{script}");
    }
    Ok((files, ramdisk_cmdline(script)?))
}

/// The kernel command line of a ramdisk script siteboot served, parsed as the agent does.
pub fn ramdisk_cmdline(script: &str) -> Result<Cmdline> {
    let kernel = script
        .lines()
        .find(|l| l.starts_with("kernel "))
        .with_context(|| format!("no kernel line in:\n{script}"))?;
    Cmdline::parse(kernel).with_context(|| format!("the ramdisk's command line: {kernel}"))
}

/// The agent API client a ramdisk with `cmdline` uses.
pub fn agent_client(cmdline: &Cmdline) -> AgentClient {
    AgentClient::new(cmdline.agent, cmdline.fingerprint).with_timeout(Duration::from_secs(10))
}

/// A request to the agent API from inside `ns` (`path` starts with `/agent/`): (status, body).
pub fn agent_http(
    ns: &Netns,
    agent: &AgentClient,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Result<(u16, String)> {
    let path = path.strip_prefix("/agent/").context("not an agent API path")?.to_owned();
    let method: http::Method = method.parse()?;
    let token = token.map(Token::new).transpose().map_err(anyhow::Error::msg)?;
    let body = body.map(|b| bytes::Bytes::from(b.to_string()));
    let agent = agent.clone();
    let response = ns.enter(move || {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        Ok(runtime.block_on(agent.request(method, &path, token.as_ref(), body))?)
    })?;
    Ok((response.status.as_u16(), String::from_utf8_lossy(&response.body).into_owned()))
}

/// The deploy ramdisk's loop: ask for a task, do it, report.
fn ramdisk(s: &Shared, host: &ClientHost, agent: &AgentClient, token: Option<&str>) -> Result<()> {
    // A call the appliance never answered (it restarted, say) is sent again, as a real agent
    // does: the token stays good, and rebooting would end the operation for good once its
    // bootstrap data was delivered.
    let call = |method: &str, path: &str, body: Option<&Value>| {
        let path = format!("/agent/v1/{path}");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            match agent_http(&host.ns, agent, method, &path, token, body) {
                Err(e) if std::time::Instant::now() < deadline && !s.interrupted() => {
                    s.note(format!("{method} {path}: {e:#}; again in 1 s"));
                    std::thread::sleep(Duration::from_secs(1));
                }
                result => return result,
            }
        }
    };
    while !s.interrupted() {
        let (status, body) = call("GET", "task", None)?;
        if status != 200 {
            s.note(format!("task: {status} {body}"));
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        let task: Value = serde_json::from_str(&body)?;
        match task["action"].as_str() {
            Some("wait") => {
                let time = if s.waits_as_told.load(Ordering::Acquire) {
                    Duration::from_secs(task["seconds"].as_u64().unwrap_or(1).clamp(1, 300))
                } else {
                    Duration::from_millis(500)
                };
                if !pause(s, time) {
                    return Ok(());
                }
            }
            Some("reboot") => {
                s.note("told to reboot".into());
                return Ok(());
            }
            Some("inspect") => {
                let mut hw = hardware();
                hw["nics"][0]["mac"] = json!(s.mac);
                hw["system"] = json!({ "uuid": system_uuid(&s.mac), "vendor": "QEMU" });
                expect_ok(call("POST", "inspection", Some(&hw)), "inspection")?;
                s.note("inspected".into());
            }
            Some("provision") => {
                let (status, data) = call("GET", "bootstrap", None)?;
                if status != 200 {
                    bail!("bootstrap: {status} {data}");
                }
                s.bootstrap.lock().unwrap().push(data);
                expect_ok(
                    call("POST", "progress", Some(&json!({ "step": "writing image" }))),
                    "progress",
                )?;
                // The image as the agent would write it: from the URL the task names, checked
                // against its checksum.
                let url = task["image"]["url"].as_str().context("a provision task has an image")?;
                // Like the agent's resumed download, a connection the appliance dropped (it
                // restarted, say) is tried again rather than ending the operation.
                let deadline = Instant::now() + Duration::from_secs(60);
                let (status, image) = loop {
                    match http(&host.ns, url, "GET", "", None, None) {
                        Err(e) if Instant::now() < deadline && !s.interrupted() => {
                            s.note(format!("GET {url}: {e:#}; again in 1 s"));
                            std::thread::sleep(Duration::from_secs(1));
                        }
                        result => break result?,
                    }
                };
                let digest = format!("sha256:{:x}", Sha256::digest(image.as_bytes()));
                let result = if status != 200 {
                    json!({ "ok": false, "message": format!("{url} answered {status}") })
                } else if task["image"]["checksum"] != json!(digest) {
                    json!({ "ok": false, "message": format!("{url} has {digest}") })
                } else {
                    json!({ "ok": true })
                };
                if !work(s) {
                    return Ok(());
                }
                expect_ok(call("POST", "complete", Some(&result)), "complete")?;
                s.note(format!("provisioned {url}: {result}"));
                return Ok(()); // reboot into the installed OS
            }
            Some("deprovision") => {
                expect_ok(
                    call("POST", "progress", Some(&json!({ "step": "wiping" }))),
                    "progress",
                )?;
                if !work(s) {
                    return Ok(());
                }
                expect_ok(call("POST", "complete", Some(&json!({ "ok": true }))), "complete")?;
                s.note("wiped".into());
                return Ok(());
            }
            other => bail!("unknown task {other:?}: {body}"),
        }
    }
    Ok(())
}

/// The time a ramdisk's work takes. False: the host was stopped or rebooted meanwhile, and the
/// work never finished.
fn work(s: &Shared) -> bool {
    pause(s, Duration::from_millis(s.work_ms.load(Ordering::Acquire)))
}

/// Sleeps for `time` unless the host is stopped or rebooted first (then false).
fn pause(s: &Shared, time: Duration) -> bool {
    let until = Instant::now() + time;
    while Instant::now() < until {
        if s.interrupted() {
            return false;
        }
        std::thread::sleep(
            Duration::from_millis(100).min(until.saturating_duration_since(Instant::now())),
        );
    }
    true
}

fn expect_ok(result: Result<(u16, String)>, what: &str) -> Result<()> {
    match result? {
        (200, _) => Ok(()),
        (status, body) => bail!("{what}: {status} {body}"),
    }
}

/// curl inside `ns`.
fn http(
    ns: &Netns,
    base_url: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Result<(u16, String)> {
    let mut command = ns.command("curl");
    command.args(["-sS", "--max-time", "10", "-o", "-", "-w", "\n%{http_code}", "-X", method]);
    if let Some(token) = token {
        command.args(["-H", &format!("Authorization: Bearer {token}")]);
    }
    if let Some(body) = body {
        command.args(["-H", "Content-Type: application/json", "--data", &body.to_string()]);
    }
    command.arg(format!("{base_url}{path}"));
    let out = netns::output(&mut command)?;
    let (body, status) = out.rsplit_once('\n').context("curl printed no status")?;
    Ok((status.trim().parse()?, body.to_owned()))
}
