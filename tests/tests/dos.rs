//! Denial of service from the provisioning segment, where every machine is untrusted. While a
//! real BIOS VM boots from siteboot, one machine holds 1,100 idle HTTP connections, another
//! stalls request bodies to the agent API and stops reading a large download, another asks for
//! 64 TFTP transfers with a 255 s timeout and never acknowledges them, and another posts boot
//! reports for the VM's MAC. The VM must boot, a real TFTP client must still get iPXE, siteboot
//! must stay up, and the server must close every stalled connection within its deadline (seen
//! from the client: EOF or a reset). A second test squeezes siteboot's file-descriptor limit:
//! failing accepts must not stop it, and it serves again once descriptors are free. A third
//! floods siteboot from 72 addresses (every connection slot held by slow readers, a connect
//! burst over the listen backlog) while a host of the site fetches its boot script and a
//! range of its kernel.
//!
//! siteboot runs with its default limits (the config has only the lab's fields). Every check
//! is collected and all failures are reported together, while the VM and siteboot are alive,
//! so their console and log are printed.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use serde_json::json;
use siteboot_tests::appliance::{self, Appliance};
use siteboot_tests::attack::{self, Flood, FloodPlan, Stalled};
use siteboot_tests::clients::{ClientHost, Udhcpc};
use siteboot_tests::netns::{self, Netns};
use siteboot_tests::vm::{Firmware, Vm, VmConfig};
use siteboot_tests::{initramfs, wait};

const SERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const HTTP: SocketAddrV4 = SocketAddrV4::new(SERVER_IP, appliance::HTTP_PORT);
const VM_MAC: &str = "52:54:00:00:0d:11";
const CMDLINE: &str = appliance::LAB_CMDLINE;
/// From QEMU start to the callback: ~30 s under TCG; generous for CI.
const BOOT_TIMEOUT: Duration = Duration::from_secs(240);

const IDLE_CONNECTIONS: usize = 1_100;
const STALLED_BODIES: usize = 8;
const TFTP_REQUESTS: usize = 64;
const REPORTS: usize = 30;
/// Sparse: never read from disk, and far more than the socket buffers between the two ends.
const BIG_FILE_LEN: u64 = 256 * 1024 * 1024;

/// The deadlines, from the defaults (http.header_timeout 10s, http.body_timeout 10s,
/// http.stall_timeout 30s) plus room for a loaded machine.
const IDLE_DEADLINE: Duration = Duration::from_secs(25);
const BODY_DEADLINE: Duration = Duration::from_secs(25);
const UNREAD_DEADLINE: Duration = Duration::from_secs(45);
/// Abandoned transfers run with the default 1 s timeout and 5 retries once 255 s is refused.
const TFTP_FREED_WITHIN: Duration = Duration::from_secs(30);

/// A machine on the lab bridge with a fixed address (no DHCP).
fn machine(ns: &Netns, mac: &str, address: &str) -> ClientHost {
    let host = ClientHost::attach(ns, appliance::BRIDGE, mac).unwrap();
    host.ns.ip(&["addr", "add", &format!("{address}/24"), "dev", ClientHost::IFACE]).unwrap();
    host
}

/// What the first packet answering a TFTP request was.
#[derive(Debug, Default)]
struct TftpAnswers {
    /// OACKs acknowledging `timeout 255`.
    acked_255: usize,
    other_oacks: usize,
    data: usize,
    errors: usize,
    silent: usize,
}

/// Sends a read request asking for a 255 s timeout from each socket, and classifies the first
/// answer each gets within 3 s. The sockets never acknowledge anything.
fn request_timeout_255(sockets: &[UdpSocket]) -> TftpAnswers {
    let rrq = b"\x00\x01undionly.kpxe\x00octet\x00timeout\x00255\x00";
    for socket in sockets {
        socket.send_to(rrq, SocketAddrV4::new(SERVER_IP, 69)).unwrap();
        socket.set_nonblocking(true).unwrap();
    }
    let mut answers = TftpAnswers::default();
    let mut waiting: Vec<&UdpSocket> = sockets.iter().collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut buf = [0u8; 2048];
    while !waiting.is_empty() && Instant::now() < deadline {
        waiting.retain(|socket| {
            let Ok(n) = socket.recv(&mut buf) else { return true };
            match buf.get(..2) {
                Some([0, 6]) if n > 2 => {
                    let fields: Vec<&[u8]> = buf[2..n].split(|b| *b == 0).collect();
                    let acked = fields.windows(2).any(|w| w[0] == b"timeout" && w[1] == b"255");
                    if acked { answers.acked_255 += 1 } else { answers.other_oacks += 1 }
                }
                Some([0, 3]) => answers.data += 1,
                Some([0, 5]) => answers.errors += 1,
                _ => return true,
            }
            false
        });
        std::thread::sleep(Duration::from_millis(20));
    }
    answers.silent = waiting.len();
    answers
}

#[test]
fn a_vm_boots_while_the_segment_attacks_siteboot() {
    attack::raise_fd_limit(4096).unwrap();
    let boot = initramfs::boot_files().unwrap();
    let ns = appliance::lab_network("dos").unwrap();
    let mut config = appliance::lab_config("full");
    config["profiles"][appliance::LAB_PROFILE]["cmdline"] = json!(CMDLINE);
    let siteboot = Appliance::start(&ns, config).unwrap();
    siteboot.install_boot_files(&boot).unwrap();
    std::fs::File::create(siteboot.http_root().join("big.img"))
        .and_then(|f| f.set_len(BIG_FILE_LEN))
        .unwrap();

    let flood = machine(&ns, "52:54:00:00:0d:01", "10.99.0.250");
    let slow = machine(&ns, "52:54:00:00:0d:02", "10.99.0.251");
    let tftp = machine(&ns, "52:54:00:00:0d:03", "10.99.0.252");
    let spoof = machine(&ns, "52:54:00:00:0d:04", "10.99.0.253");
    let booting = machine(&ns, "52:54:00:00:0d:05", "10.99.0.240");
    let mut failures: Vec<String> = Vec::new();

    // Boot reports for the VM's MAC from a machine that does not hold it.
    let report = format!("/report/{}/running", appliance::mac_dashed(VM_MAC));
    let statuses: Vec<u16> = (0..REPORTS)
        .map(|_| attack::http_status(&spoof.ns, HTTP, "POST", &report).unwrap())
        .collect();
    if statuses.iter().any(|s| *s < 400) {
        failures.push(format!("reports for {VM_MAC} from 10.99.0.253 were accepted: {statuses:?}"));
    }

    // Idle connections, stalled agent bodies, a download nobody reads. The agent API is on
    // HTTPS now: over plain HTTP these are refused (403) and closed before their bodies are
    // read; the body deadline over HTTPS is boot/src/http/server_tests.rs's.
    let mut idle = Stalled::open("idle", &flood.ns, HTTP, IDLE_CONNECTIONS, b"").unwrap();
    let body = "POST /agent/v1/inspection HTTP/1.1\r\nHost: 10.99.0.1\r\n\
                Content-Type: application/json\r\nContent-Length: 65536\r\n\r\n{\"disks\":";
    let mut bodies =
        Stalled::open("stalled bodies", &slow.ns, HTTP, STALLED_BODIES, body.as_bytes()).unwrap();
    let get = "GET /files/big.img HTTP/1.1\r\nHost: 10.99.0.1\r\n\r\n";
    let mut unread = Stalled::open("unread download", &slow.ns, HTTP, 1, get.as_bytes()).unwrap();
    for stalled in [&idle, &bodies, &unread] {
        if !stalled.failed.is_empty() {
            failures.push(format!(
                "{} connects failed: {:?}",
                stalled.failed.len(),
                stalled.failed
            ));
        }
    }

    // TFTP requests for a 255 s timeout, never acknowledged (the sockets live until the end:
    // closing them would end the transfers early).
    let tftp_sockets: Vec<UdpSocket> = tftp
        .ns
        .enter(|| {
            (0..TFTP_REQUESTS)
                .map(|_| Ok(UdpSocket::bind("10.99.0.252:0")?))
                .collect::<anyhow::Result<_>>()
        })
        .unwrap();
    let answers = request_timeout_255(&tftp_sockets);
    eprintln!("TFTP answers to {TFTP_REQUESTS} requests for timeout 255: {answers:?}");
    if answers.acked_255 > 0 {
        failures.push(format!("{} OACKs acknowledged timeout 255: {answers:?}", answers.acked_255));
    }
    if answers.errors == 0 {
        failures.push(format!("one address got all {TFTP_REQUESTS} TFTP transfers: {answers:?}"));
    }

    // The VM boots under all of this.
    let tap = ns.add_tap(appliance::BRIDGE).unwrap();
    let mut vm = Vm::start(&ns, VmConfig::new("dos", Firmware::Bios, VM_MAC, &tap)).unwrap();

    // A real TFTP client (a UEFI host's first stage) still gets iPXE.
    if let Err(e) = fetch_ipxe(&booting) {
        failures.push(format!("a real TFTP client: {e:#}"));
    }

    // The server closes what stalls, within its deadlines.
    match idle.wait_closed(IDLE_DEADLINE) {
        Ok(took) => eprintln!("{} idle connections closed within {took:?}", idle.len()),
        Err(e) => failures.push(format!("{e:#}")),
    }
    match bodies.wait_closed(BODY_DEADLINE) {
        Ok(took) => eprintln!(
            "{} stalled bodies closed within {took:?}, answered {:?}",
            bodies.len(),
            bodies.first_answer()
        ),
        Err(e) => failures.push(format!("{e:#}")),
    }
    std::thread::sleep((unread.opened + UNREAD_DEADLINE).saturating_duration_since(Instant::now()));
    let (received, closed) = unread.drain()[0];
    eprintln!("unread download: {received} bytes received, closed by the server: {closed}");
    if !closed || received >= BIG_FILE_LEN {
        failures.push(format!(
            "a client that stopped reading was not dropped within {UNREAD_DEADLINE:?}: \
             {received} of {BIG_FILE_LEN} bytes, closed: {closed}"
        ));
    }

    match vm.wait_for_console("SITEBOOT-TEST: callback", BOOT_TIMEOUT) {
        Ok(line) if line == "SITEBOOT-TEST: callback ok" => {}
        Ok(line) => failures.push(format!("the VM's callback failed: {line}")),
        Err(e) => failures.push(format!("the VM did not boot: {e:#}")),
    }
    match siteboot.timeline(VM_MAC) {
        Ok(timeline) => {
            let reports: Vec<String> = appliance::events(&timeline)
                .iter()
                .filter(|e| e["stage"] == "report")
                .map(|e| e["detail"].as_str().unwrap_or_default().to_owned())
                .collect();
            if reports.iter().any(|r| r.contains("10.99.0.253")) {
                failures.push(format!("the spoofed reports are in the timeline: {reports:?}"));
            }
            if !reports.iter().any(|r| r.starts_with("running from 10.99.0.1")) {
                failures.push(format!("the VM's own report is missing: {reports:?}"));
            }
        }
        Err(e) => failures.push(format!("no timeline: {e:#}")),
    }

    let freed = wait::for_("the abandoned TFTP transfers to end", TFTP_FREED_WITHIN, || {
        let m = siteboot.metrics().ok()?;
        (m.get("siteboot_tftp_transfers_active") == 0.0).then_some(())
    });
    if let Err(e) = freed {
        failures.push(format!("{e:#}"));
    }
    drop(tftp_sockets);

    if let Some(status) = siteboot.exited() {
        failures.push(format!("siteboot exited ({status})"));
    } else {
        match siteboot.metrics() {
            Ok(m) => {
                eprintln!(
                    "refused connections {}, timeouts {}, accept errors {}, refused reports {}",
                    m.get("siteboot_http_connections_refused_total"),
                    m.get("siteboot_http_timeouts_total"),
                    m.get("siteboot_http_accept_errors_total"),
                    m.get(r#"siteboot_http_requests_refused_total{reason="report-not-holder"}"#),
                );
                if m.get("siteboot_http_connections_refused_total") == 0.0 {
                    failures.push("no connection over the per-address cap was refused".into());
                }
            }
            Err(e) => failures.push(format!("siteboot does not answer /metrics: {e:#}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} defences failed:\n- {}",
        failures.len(),
        failures.join("\n- ")
    );
    vm.wait_exit(Duration::from_secs(30)).expect("the VM powers off after the callback");
}

#[test]
fn running_out_of_file_descriptors_does_not_stop_siteboot() {
    let ns = appliance::lab_network("fds").unwrap();
    let siteboot = Appliance::start(&ns, appliance::lab_config("off")).unwrap();
    let client = machine(&ns, "52:54:00:00:0e:01", "10.99.0.250");
    let pid = siteboot.pid().unwrap();
    // Room for a few more descriptors only: most of the connections below meet EMFILE.
    let limit = attack::open_fds(pid).unwrap() as u64 + 8;
    attack::set_fd_limit(pid, limit).unwrap();
    let conns = Stalled::open("connections", &client.ns, HTTP, 64, b"").unwrap();

    let accept_failed =
        wait::for_("siteboot to log a failed accept", Duration::from_secs(15), || {
            if let Some(status) = siteboot.exited() {
                return Some(Err(format!("siteboot exited ({status})")));
            }
            siteboot.log().contains("cannot accept an HTTP connection").then_some(Ok(()))
        });
    match accept_failed {
        Ok(Ok(())) => {}
        Ok(Err(exited)) => panic!("{exited}: a failed accept must not stop siteboot"),
        Err(e) => panic!("{e:#}"),
    }
    std::thread::sleep(Duration::from_secs(2));
    assert!(siteboot.exited().is_none(), "siteboot stopped while out of descriptors");

    // The descriptors come back: it serves again.
    drop(conns);
    wait::for_("GET /healthz to answer 200 again", Duration::from_secs(30), || {
        matches!(siteboot.get("/healthz"), Ok((200, _))).then_some(())
    })
    .unwrap();
    let metrics = siteboot.metrics().unwrap();
    assert!(metrics.get("siteboot_http_accept_errors_total") >= 1.0, "failed accepts are counted");
    assert!(siteboot.exited().is_none());
}

/// The attacker's block of source addresses: more than `max_connections /
/// max_connections_per_address` (1,024 / 16 = 64), so together they can hold every slot.
const FLOOD_SOURCES: u8 = 72;
/// Slow `/ipxe/` readers, from the sources in turn (14 or 15 each): every general slot and the
/// whole boot reserve (which admits `/ipxe/`).
const FLOOD_READERS: usize = 1_024;
/// Idle connections per source, opened all at once after the readers: a 288-connect burst,
/// more than a 128-entry listen backlog holds (and over the per-address cap for most).
const FLOOD_IDLE: usize = 4;
const KNOWN_MAC: &str = "52:54:00:00:0f:10";
/// The TFTP caps of the lab config (the defaults): 256 transfers, 8 per address.
const TFTP_SLOTS: usize = 256;
const TFTP_PER_ADDRESS: usize = 8;
/// For the known host's whole exchange, connect included; it takes well under a second
/// unflooded. The idle connections' header deadline (10 s) passes within it, so a server that
/// only waits for them to go still fails here: the flood opens them again at once.
const KNOWN_DEADLINE: Duration = Duration::from_secs(30);

/// `curl` from inside `ns` with `args`, within [`KNOWN_DEADLINE`]: the status and the body.
fn curl(ns: &Netns, args: &[&str], path: &str) -> anyhow::Result<(u16, Vec<u8>)> {
    let url = format!("http://{HTTP}{path}");
    let deadline = KNOWN_DEADLINE.as_secs().to_string();
    let out = ns
        .command("curl")
        .args(["-sS", "--max-time", &deadline, "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .arg(&url)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "curl {url}: {} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let split = out.stdout.iter().rposition(|b| *b == b'\n').unwrap_or(0);
    let status = String::from_utf8_lossy(&out.stdout[split + 1..]).trim().parse()?;
    Ok((status, out.stdout[..split].to_vec()))
}

/// Issue 22, item 11: 72 addresses hold every HTTP connection slot with slow `/ipxe/` readers
/// and a burst of idle connections, and open again whatever the server closes. A host the
/// site knows (listed in the config, holding its lease) must still get its boot script and a
/// range of its kernel while the flood's connections are still open.
#[test]
fn a_known_host_boots_while_many_addresses_hold_every_connection() {
    attack::raise_fd_limit(8192).unwrap();
    let ns = appliance::lab_network("flood").unwrap();
    let mut config = appliance::lab_config("full");
    config["hosts"] = json!([{ "mac": KNOWN_MAC, "profile": appliance::LAB_PROFILE }]);
    let siteboot = Appliance::start(&ns, config).unwrap();
    let kernel: Vec<u8> = (0..64 * 1024u32).map(|i| (i % 251) as u8).collect();
    std::fs::create_dir_all(siteboot.http_root().join("lab")).unwrap();
    std::fs::write(siteboot.http_root().join("lab/vmlinuz"), &kernel).unwrap();

    let known = ClientHost::attach(&ns, appliance::BRIDGE, KNOWN_MAC).unwrap();
    let mut dhcp = Udhcpc::start(&known, &[]).unwrap();
    let lease = dhcp.wait_bound(Duration::from_secs(60)).unwrap();
    eprintln!("the known host holds {:?}", lease.address);

    let attacker = ClientHost::attach(&ns, appliance::BRIDGE, "52:54:00:00:0f:01").unwrap();
    let sources: Vec<Ipv4Addr> =
        (0..FLOOD_SOURCES).map(|i| Ipv4Addr::new(10, 99, 0, 10 + i)).collect();
    for source in &sources {
        let address = format!("{source}/24");
        attacker.ns.ip(&["addr", "add", &address, "dev", ClientHost::IFACE]).unwrap();
    }
    let flood = Flood::start(
        &attacker.ns,
        FloodPlan {
            sources: sources.clone(),
            server: HTTP,
            readers: FLOOD_READERS,
            request: b"GET /ipxe/snponly.efi HTTP/1.1\r\nHost: 10.99.0.1\r\n\r\n".to_vec(),
            idle: FLOOD_IDLE,
        },
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    eprintln!("the flood holds {} connections", flood.open());

    let mut failures = Vec::new();
    let started = Instant::now();
    let script = curl(&known.ns, &[], &format!("/boot/{KNOWN_MAC}.ipxe"));
    match &script {
        Ok((200, body)) if body.starts_with(b"#!ipxe") => {}
        other => failures.push(format!("the known host's boot script: {}", outcome(other))),
    }
    let range = curl(&known.ns, &["-r", "4096-8191"], "/files/lab/vmlinuz");
    match &range {
        Ok((206, body)) if body[..] == kernel[4096..8192] => {}
        other => failures.push(format!("the known host's kernel range: {}", outcome(other))),
    }
    eprintln!(
        "the known host's script and range took {:?}; the flood's client side has {} \
         connections open (it opened {} again)",
        started.elapsed(),
        flood.open(),
        flood.reopened()
    );
    // The attack was in force: the server still serves (nearly) every slot to the flood, and
    // made room for the host (and this request, from the appliance's own address) by closing
    // a few of its oldest connections.
    match siteboot.metrics() {
        Ok(m) => {
            let active = m.get("siteboot_http_connections_active");
            let evicted = m.get("siteboot_http_connections_evicted_total");
            eprintln!("siteboot serves {active} connections, evicted {evicted}");
            if active < (FLOOD_READERS - 24) as f64 {
                failures.push(format!("the flood held only {active} connections"));
            }
            if evicted < 1.0 {
                failures.push("no flood connection was closed to make room".into());
            }
        }
        Err(e) => failures.push(format!("siteboot does not answer /metrics: {e:#}")),
    }
    // TFTP too: the same addresses take every transfer slot (the per-address cap times 72 is
    // more than the total) and acknowledge nothing, each with a 10 s retransmission timeout;
    // the known host's firmware still gets iPXE, a flood transfer giving up its slot.
    let holders: Vec<UdpSocket> = attacker
        .ns
        .enter(move || {
            let mut holders = Vec::new();
            for source in &sources {
                for _ in 0..TFTP_PER_ADDRESS {
                    holders.push(UdpSocket::bind((*source, 0))?);
                }
            }
            Ok(holders)
        })
        .unwrap();
    let rrq = b"\x00\x01undionly.kpxe\x00octet\x00timeout\x0010\x00";
    for holder in &holders {
        holder.send_to(rrq, SocketAddrV4::new(SERVER_IP, 69)).unwrap();
    }
    std::thread::sleep(Duration::from_secs(1));
    let held = siteboot.metrics().map(|m| m.get("siteboot_tftp_transfers_active")).unwrap_or(0.0);
    eprintln!("the flood holds {held} TFTP transfers");
    if held < TFTP_SLOTS as f64 {
        failures.push(format!("the flood held only {held} of {TFTP_SLOTS} TFTP transfers"));
    }
    if let Err(e) = fetch_ipxe(&known) {
        failures.push(format!("the known host's firmware: {e:#}"));
    }
    match siteboot.metrics() {
        Ok(m) if m.get("siteboot_tftp_transfers_evicted_total") < 1.0 => {
            failures.push("no flood transfer gave up its slot".into())
        }
        Ok(_) => {}
        Err(e) => failures.push(format!("siteboot does not answer /metrics: {e:#}")),
    }
    drop(holders);
    if let Some(status) = siteboot.exited() {
        failures.push(format!("siteboot exited ({status})"));
    }
    drop(flood);
    assert!(failures.is_empty(), "{} checks failed:\n- {}", failures.len(), failures.join("\n- "));
}

/// `undionly.kpxe` over TFTP with a real client (atftp), as `client`'s firmware fetches it;
/// checked against the file served.
fn fetch_ipxe(client: &ClientHost) -> anyhow::Result<()> {
    let out = client.dir().join("undionly.kpxe");
    netns::run(client.ns.command("timeout").args([
        "30",
        "atftp",
        "--get",
        "-r",
        "undionly.kpxe",
        "-l",
        out.to_str().unwrap(),
        &SERVER_IP.to_string(),
    ]))
    .map_err(|e| e.context("no iPXE over TFTP"))?;
    anyhow::ensure!(
        std::fs::read(&out)? == std::fs::read("/usr/lib/ipxe/undionly.kpxe")?,
        "got a different undionly.kpxe"
    );
    Ok(())
}

fn outcome(result: &anyhow::Result<(u16, Vec<u8>)>) -> String {
    match result {
        Ok((status, body)) => {
            format!("{status} {:?}", String::from_utf8_lossy(&body[..body.len().min(80)]))
        }
        Err(e) => format!("{e:#}"),
    }
}
