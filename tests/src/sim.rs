//! A simulated bare-metal host: a namespace with one NIC on the lab bridge that does on the wire
//! what a machine does when it network-boots from siteboot. It gets a lease from siteboot's
//! DHCP server (a real DISCOVER/REQUEST exchange, [`ThreadDhcp`]), fetches its iPXE script,
//! then either "boots the local disk" (the OS phase) or fetches the ramdisk's kernel and initrd
//! and plays the deploy ramdisk against the agent API (`/agent/v1/...`) with the token from its
//! kernel command line. It speaks to the agent API as the real ramdisk does: with
//! `siteboot_agent`'s client, over HTTPS, pinning the certificate fingerprint from that command
//! line.
//!
//! Each host is one thread that entered the host's network namespace once and keeps one
//! current-thread runtime for its agent API calls: no process and no thread per request, so a
//! thousand hosts fit on a small machine (a `curl` and `udhcpc` through `ip netns exec` each did
//! not: docs/benchmarks.md).
//!
//! What it cannot do by itself (power-cycle when told, run a kubelet) the test does through
//! [`SimHost::reboot`] and the Kubernetes API.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use siteboot_agent::{AgentClient, Cmdline, Token};

use crate::clients::{self, ClientHost, ThreadDhcp};
use crate::netns::Netns;

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
        crate::failure::record_panics();
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
        let (started, outcome) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new().name(format!("sim {mac}")).spawn(move || {
            // The host's thread lives in its namespace, with one runtime for its agent calls.
            let setup = h.ns.enter_current_thread().and_then(|()| current_thread_runtime());
            match setup {
                Ok(runtime) => {
                    let _ = started.send(Ok(()));
                    run(&s, &runtime);
                }
                Err(e) => drop(started.send(Err(e))),
            }
        })?;
        let sim = Self { shared, host, thread: Some(thread) };
        outcome.recv().context("the simulated host's thread ended before starting")??;
        Ok(sim)
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

    /// Takes the host off the segment (its link down), or puts it back: a machine between
    /// two boots answers nothing, not even ARP. Its address stays configured.
    pub fn set_link(&self, up: bool) -> Result<()> {
        self.host.ns.ip(&["link", "set", ClientHost::IFACE, if up { "up" } else { "down" }])
    }

    /// The IPv4 address its NIC has now (its lease), if any.
    pub fn address(&self) -> Option<std::net::Ipv4Addr> {
        let mut ip = self.host.ns.command("ip");
        let shown =
            crate::netns::output(ip.args(["-4", "-o", "addr", "show", "dev", ClientHost::IFACE]));
        let shown = shown.ok()?;
        let inet = shown.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
        inet.split('/').next()?.parse().ok()
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
        self.http_from_host(method, path, token, body)
    }

    /// The task its ramdisk gets with `token`, asked again while the answer is `wait` (the
    /// appliance still fetches the image), for at most a minute.
    pub fn task(&self, token: &str) -> Result<Value> {
        crate::wait::for_("a task other than wait", Duration::from_secs(60), || {
            let (status, body) = self.http("GET", "/agent/v1/task", Some(token), None).ok()?;
            let task: Value = serde_json::from_str(&body).ok().filter(|_| status == 200)?;
            (task["action"] != "wait").then_some(task)
        })
    }

    /// A request over plain HTTP from this host's address, whatever the path (what an old
    /// or misconfigured ramdisk would send): (status, body).
    pub fn http_plain(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
    ) -> Result<(u16, String)> {
        self.http_from_host(method, path, token, None)
    }

    /// A plain HTTP request to the boot plane from a thread in the host's namespace.
    fn http_from_host(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> Result<(u16, String)> {
        let url = format!("{}{path}", self.shared.base_url);
        let (method, token, body) = (method.to_owned(), token.map(str::to_owned), body.cloned());
        self.host.ns.enter(move || http(&url, &method, token.as_deref(), body.as_ref()))
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
            let what = format!("simulated host {}", self.shared.mac);
            crate::failure::print_log(&what, &self.log());
        }
    }
}

/// The host's life, on its thread in its namespace: power-on after power-on until stopped.
fn run(s: &Shared, runtime: &tokio::runtime::Runtime) {
    while !s.stop.load(Ordering::Acquire) {
        s.reboot.store(false, Ordering::Release);
        s.set_phase(Phase::Booting);
        *s.token.lock().unwrap() = None;
        *s.agent.lock().unwrap() = None;
        if let Err(e) = boot(s, runtime) {
            s.note(format!("boot failed: {e:#}"));
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

/// One power-on: DHCP, script, then the OS or the ramdisk until interrupted or done.
fn boot(s: &Shared, runtime: &tokio::runtime::Runtime) -> Result<()> {
    // Power-on: no address yet, as a real NIC.
    clients::clear_address(ClientHost::IFACE)?;
    let dhcp = ThreadDhcp { iface: ClientHost::IFACE, mac: &s.mac };
    let lease = dhcp.obtain(Duration::from_secs(30), || s.interrupted())?;
    s.note(format!("lease {:?}", lease.address));
    let script_url = format!("{}/boot/{}.ipxe", s.base_url, s.mac.replace(':', "-"));
    let script = loop {
        let (status, body) = http(&script_url, "GET", None, None)?;
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
    if first_try(&script).any(|c| c.split_whitespace().next() == Some("exit")) {
        s.note("booting the local disk".into());
        s.set_phase(Phase::Os);
        while !s.interrupted() {
            std::thread::sleep(Duration::from_millis(200));
        }
        return Ok(());
    }
    let (files, cmdline) = parse_script(&script)?;
    let token = cmdline.token.as_ref().map(|t| t.as_str().to_owned());
    let agent = agent_client(&cmdline);
    for url in files {
        if !url.starts_with(&s.base_url) {
            bail!("ramdisk served elsewhere: {url}");
        }
        let (status, _) = http(&url, "GET", None, None)?;
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
        ramdisk(s, runtime, &agent, token.as_deref())?;
    }
    Ok(())
}

/// The commands iPXE runs of a script siteboot wrote when every fetch succeeds: those before
/// the first label (the retries), each without what it does if it fails (`|| goto ...`).
fn first_try(script: &str) -> impl Iterator<Item = &str> {
    script.lines().take_while(|l| !l.starts_with(':')).map(|l| l.split(" || ").next().unwrap_or(l))
}

/// The kernel and initrd URLs of an iPXE script siteboot wrote ([`first_try`]), and the kernel
/// command line as the ramdisk agent reads it.
fn parse_script(script: &str) -> Result<(Vec<String>, Cmdline)> {
    let mut files = Vec::new();
    for command in first_try(script) {
        let words: Vec<&str> = command.split_whitespace().collect();
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

/// A plain HTTP GET of `url` (`http://<address>:<port>/<path>`) from a machine in `ns`, as its
/// firmware fetches a boot script: (status, body).
pub fn http_get(ns: &Netns, url: &str) -> Result<(u16, String)> {
    let url = url.to_owned();
    ns.enter(move || http(&url, "GET", None, None))
}

/// The kernel command of a ramdisk script siteboot served, as iPXE runs it (what the script
/// does if it fails left out).
pub fn kernel_line(script: &str) -> Result<&str> {
    first_try(script)
        .find(|c| c.starts_with("kernel "))
        .with_context(|| format!("no kernel line in:\n{script}"))
}

/// The kernel command line of a ramdisk script siteboot served, parsed as the agent does.
pub fn ramdisk_cmdline(script: &str) -> Result<Cmdline> {
    let kernel = kernel_line(script)?;
    Cmdline::parse(kernel).with_context(|| format!("the ramdisk's command line: {kernel}"))
}

/// The agent API client a ramdisk with `cmdline` uses.
pub fn agent_client(cmdline: &Cmdline) -> AgentClient {
    AgentClient::new(cmdline.agent, cmdline.fingerprint).with_timeout(Duration::from_secs(10))
}

/// A request to the agent API from inside `ns` (`path` starts with `/agent/`): (status, body).
/// It runs on a thread of its own; the simulated host's loop uses [`AgentCall`] on its own.
pub fn agent_http(
    ns: &Netns,
    agent: &AgentClient,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Result<(u16, String)> {
    let call = AgentCall::new(method, path, token, body)?;
    let agent = agent.clone();
    ns.enter(move || call.send(&current_thread_runtime()?, &agent))
}

/// An agent API request, ready to send from a thread in the host's namespace.
struct AgentCall {
    method: http::Method,
    /// After `/agent/`.
    path: String,
    token: Option<Token>,
    body: Option<bytes::Bytes>,
}

impl AgentCall {
    /// `path` starts with `/agent/`.
    fn new(method: &str, path: &str, token: Option<&str>, body: Option<&Value>) -> Result<Self> {
        Ok(Self {
            method: method.parse()?,
            path: path.strip_prefix("/agent/").context("not an agent API path")?.to_owned(),
            token: token.map(Token::new).transpose().map_err(anyhow::Error::msg)?,
            body: body.map(|b| bytes::Bytes::from(b.to_string())),
        })
    }

    /// (status, body).
    fn send(self, runtime: &tokio::runtime::Runtime, agent: &AgentClient) -> Result<(u16, String)> {
        let response = runtime.block_on(agent.request(
            self.method,
            &self.path,
            self.token.as_ref(),
            self.body,
        ))?;
        Ok((response.status.as_u16(), String::from_utf8_lossy(&response.body).into_owned()))
    }
}

fn current_thread_runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// The deploy ramdisk's loop: ask for a task, do it, report.
fn ramdisk(
    s: &Shared,
    runtime: &tokio::runtime::Runtime,
    agent: &AgentClient,
    token: Option<&str>,
) -> Result<()> {
    // A call the appliance never answered (it restarted, say) is sent again, as a real agent
    // does: the token stays good, and rebooting would end the operation for good once its
    // bootstrap data was delivered.
    let call = |method: &str, path: &str, body: Option<&Value>| {
        let path = format!("/agent/v1/{path}");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            match AgentCall::new(method, &path, token, body)?.send(runtime, agent) {
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
                    match http(url, "GET", None, None) {
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

/// One HTTP/1.1 request to `url` (`http://<address>:<port>/<path>`) from the calling thread's
/// namespace, as the firmware and the ramdisk fetch from the boot plane: (status, body). Each
/// step has 10 s.
fn http(
    url: &str,
    method: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> Result<(u16, String)> {
    const TIMEOUT: Duration = Duration::from_secs(10);
    let rest = url.strip_prefix("http://").with_context(|| format!("not an http:// URL: {url}"))?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let address: SocketAddr =
        authority.parse().with_context(|| format!("no address:port in {url}"))?;
    let mut request = format!(
        "{method} {} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n",
        if path.is_empty() { "/" } else { path }
    );
    if let Some(token) = token {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    let body = body.map(Value::to_string).unwrap_or_default();
    if !body.is_empty() {
        request.push_str("Content-Type: application/json\r\n");
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));

    let answer = (|| -> std::io::Result<Vec<u8>> {
        let mut stream = TcpStream::connect_timeout(&address, TIMEOUT)?;
        stream.set_read_timeout(Some(TIMEOUT))?;
        stream.set_write_timeout(Some(TIMEOUT))?;
        stream.write_all(request.as_bytes())?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer)?;
        Ok(answer)
    })()
    .with_context(|| format!("{method} {url}"))?;
    parse_response(&answer).with_context(|| format!("{method} {url}"))
}

/// A whole HTTP/1.1 response with a `Content-Length` body (what siteboot sends): (status, body).
fn parse_response(answer: &[u8]) -> Result<(u16, String)> {
    let head_end = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("the connection closed before the end of the response head")?;
    let head = String::from_utf8_lossy(&answer[..head_end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("not an HTTP/1.1 status line: {status_line:?}"))?;
    let mut length = None;
    for (name, value) in lines.filter_map(|l| l.split_once(':')) {
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.trim().parse::<usize>().context("a bad Content-Length")?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            bail!("a {} body; this client reads Content-Length bodies only", value.trim());
        }
    }
    let body = &answer[head_end + 4..];
    let body = match length {
        Some(length) if body.len() < length => {
            bail!("the connection closed after {} of {length} body bytes", body.len())
        }
        Some(length) => &body[..length],
        None => body,
    };
    Ok((status, String::from_utf8_lossy(body).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_give_status_and_body() {
        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello";
        assert_eq!(parse_response(answer).unwrap(), (200, "hello".to_owned()));
        let answer = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(parse_response(answer).unwrap(), (404, String::new()));
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
        assert!(parse_response(b"SSH-2.0\r\n\r\n").is_err());
    }
}
