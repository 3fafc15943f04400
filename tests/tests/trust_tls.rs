//! The agent API carries join secrets, so it is served over HTTPS only, and the deploy ramdisk
//! pins the appliance's certificate by the fingerprint on its kernel command line (docs:
//! security.md, "Join secrets in clear text"). Three attacks from the provisioning segment:
//!
//! - a passive listener on the bridge records the whole agent exchange of a host being
//!   provisioned: neither the join secret nor the token (nor any `Authorization` header) may
//!   appear in what it captured;
//! - the host itself asks for its bootstrap data over plain HTTP, with its valid token: refused,
//!   with the HTTPS URL, and nothing in clear comes back;
//! - an impersonating appliance takes the agent URL with a certificate of its own: the agent
//!   client, pinning the real fingerprint, refuses it and sends it nothing.
//!
//! Failures panic (`unwrap`) while everything is alive, so the logs get printed.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use siteboot_agent::{ClientError, Token};
use siteboot_controller::crd::HostState;
use siteboot_tests::appliance::{self, Appliance, mac_dashed};
use siteboot_tests::clients::ClientHost;
use siteboot_tests::netns::{self, Netns};
use siteboot_tests::process::Supervised;
use siteboot_tests::provider::{ProviderLab, Sims};
use siteboot_tests::sim::{self, SimHost};
use siteboot_tests::tls::SelfSigned;

const ROLLOUT: Duration = Duration::from_secs(300);
const JOIN_TOKEN: &str = "abcdef.0123456789abcdef";
const SECRET: &str = "#cloud-config\nkubeadm-join-token: abcdef.0123456789abcdef\n";
const AGENT_URL: &str = "https://10.99.0.1:8443/agent/";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_passive_listener_reads_no_join_secret_and_plain_http_gets_none() {
    let lab = ProviderLab::start_with(Sims { count: 1, manual: 1 }, |_| {}).await.unwrap();
    let sim = lab.sims().remove(0);
    let inspection = wait_token(&sim, None).await;
    let (status, body) = sim
        .http("POST", "/agent/v1/inspection", Some(&inspection), Some(&sim::hardware()))
        .unwrap();
    assert_eq!(status, 200, "{body}");
    lab.wait_hosts(HostState::Available, 1, Duration::from_secs(60)).await.unwrap();
    lab.create_cluster("c", SECRET).await.unwrap();
    lab.create_template("t", "v1").await.unwrap();
    lab.create_machine_deployment("workers", "c", "t", 1).await.unwrap();
    lab.wait_hosts(HostState::Provisioning, 1, ROLLOUT).await.unwrap();
    sim.reboot();
    let token = wait_token(&sim, Some(&inspection)).await;

    // The host's own valid token, from its own address, over plain HTTP: refused before the
    // request is read, with the URL to use instead.
    let (status, body) = sim.http_plain("GET", "/agent/v1/bootstrap", Some(&token)).unwrap();
    assert!(
        status == 403 && body.contains(AGENT_URL) && !body.contains(JOIN_TOKEN),
        "plain HTTP answered {status}: {body:?}"
    );

    assert_eq!(sim.task(&token).unwrap()["action"], "provision");
    // Everything on the bridge while the host fetches its data and finishes provisioning.
    let capture = Capture::start(&lab.lab, appliance::BRIDGE);
    let (status, data) = sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!((status, data.as_str()), (200, SECRET), "the host did not get its data");
    let progress = serde_json::json!({ "step": "writing image" });
    assert_eq!(
        sim.http("POST", "/agent/v1/progress", Some(&token), Some(&progress)).unwrap().0,
        200
    );
    let complete = serde_json::json!({ "ok": true });
    assert_eq!(
        sim.http("POST", "/agent/v1/complete", Some(&token), Some(&complete)).unwrap().0,
        200
    );
    let captured = capture.stop();

    let agent_packets = captured.packets("tcp port 8443");
    assert!(agent_packets >= 10, "the capture missed the agent exchange ({agent_packets} packets)");
    let bytes = captured.bytes();
    for (what, needle) in [("the join token", JOIN_TOKEN), ("the operation's token", &token)] {
        assert!(!contains(&bytes, needle.as_bytes()), "{what} crossed the segment in clear");
    }
    assert!(
        !contains(&bytes.to_ascii_lowercase(), b"authorization: bearer"),
        "an Authorization header crossed the segment in clear"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impersonating_appliance_gets_no_token() {
    let ns = appliance::lab_network("rogue").unwrap();
    let siteboot = Appliance::start(&ns, appliance::lab_config("off")).unwrap();
    let mac = "52:54:00:00:0f:01";
    let host = ClientHost::attach(&ns, appliance::BRIDGE, mac).unwrap();
    host.ns.ip(&["addr", "add", "10.99.0.50/24", "dev", ClientHost::IFACE]).unwrap();
    let token = "c0ffee".repeat(10);

    // The script names the agent API and pins its certificate; with that pin the real
    // appliance answers (standalone: it has no agent API, so 404).
    let script = netns::output(
        host.ns
            .command("curl")
            .args(["-sSf", &format!("{}/boot/{}.ipxe", siteboot.base_url(), mac_dashed(mac))]),
    )
    .unwrap();
    let agent = sim::agent_client(&sim::ramdisk_cmdline(&script).unwrap());
    let (status, _) =
        sim::agent_http(&host.ns, &agent, "GET", "/agent/v1/task", Some(&token), None).unwrap();
    assert_eq!(status, 404, "the real appliance did not answer through the pin");

    // The appliance goes; a rogue server takes its address and port, with its own certificate.
    siteboot.kill9();
    let rogue = Rogue::start(&ns, SocketAddrV4::new(Ipv4Addr::new(10, 99, 0, 1), 8443));
    let request_token = Token::new(&token).unwrap();
    let result = host
        .ns
        .enter(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            Ok(runtime.block_on(agent.request(
                http::Method::GET,
                "v1/bootstrap",
                Some(&request_token),
                None,
            )))
        })
        .unwrap();
    match result {
        Err(ClientError::FingerprintMismatch { .. }) => {}
        other => panic!("the agent client did not refuse the rogue's certificate: {other:?}"),
    }
    let seen = rogue.finish();
    assert!(seen.connections >= 1, "the client never reached the rogue server");
    assert!(seen.decrypted.is_empty(), "the rogue read a request: {:?}", seen.decrypted);
    assert!(!contains(&seen.raw, token.as_bytes()), "the token reached the rogue");
}

/// The token on the host's ramdisk command line (other than `not`). A host that booted while
/// its Host was still Registering got the ramdisk with no token: it is power-cycled.
async fn wait_token(sim: &SimHost, not: Option<&str>) -> String {
    for _ in 0..3 {
        let token =
            siteboot_tests::wait::for_async("a ramdisk token", Duration::from_secs(20), || async {
                sim.token().filter(|t| Some(t.as_str()) != not)
            })
            .await;
        if let Ok(token) = token {
            return token;
        }
        sim.reboot();
    }
    panic!("no ramdisk token after three boots:\n{}", sim.log());
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// tcpdump on an interface of a namespace, every byte of every frame.
struct Capture {
    tcpdump: Supervised,
    file: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

struct Captured {
    file: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Capture {
    fn start(ns: &Netns, interface: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("segment.pcap");
        let mut command = ns.command("tcpdump");
        // Immediate mode: packets reach the file as they come, not when a ring block fills.
        command.args(["-i", interface, "-n", "-s", "0", "-U", "--immediate-mode", "-w"]).arg(&file);
        let tcpdump = Supervised::spawn("tcpdump", &mut command, dir.path()).unwrap();
        siteboot_tests::wait::for_("tcpdump to listen", Duration::from_secs(10), || {
            tcpdump.log().contains("listening on").then_some(())
        })
        .unwrap();
        Self { tcpdump, file, _dir: dir }
    }

    fn stop(mut self) -> Captured {
        // The last segments (FIN, ACK) are still on their way.
        std::thread::sleep(Duration::from_secs(1));
        self.tcpdump.signal(libc::SIGINT);
        self.tcpdump.wait_timeout(Duration::from_secs(10)).unwrap();
        eprintln!("{}", self.tcpdump.log());
        Captured { file: self.file, _dir: self._dir }
    }
}

impl Captured {
    fn bytes(&self) -> Vec<u8> {
        std::fs::read(&self.file).unwrap()
    }

    /// How many captured packets match a tcpdump `filter`.
    fn packets(&self, filter: &str) -> usize {
        let mut command = std::process::Command::new("tcpdump");
        command.args(["-n", "-r"]).arg(&self.file).arg(filter);
        netns::output(&mut command).unwrap().lines().count()
    }
}

/// A TLS server with a certificate of its own, recording what reaches it.
struct Rogue {
    thread: std::thread::JoinHandle<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    connections: usize,
    /// Every byte received, as it came off the wire.
    raw: Vec<u8>,
    /// What TLS decrypted: a request, if a client trusted the rogue.
    decrypted: Vec<u8>,
}

impl Rogue {
    /// Listens on `addr` inside `ns` and serves the first connection (or gives up after 10 s).
    fn start(ns: &Netns, addr: SocketAddrV4) -> Self {
        let listener = ns.enter(move || Ok(TcpListener::bind(addr)?)).unwrap();
        let config = SelfSigned::new(&addr.ip().to_string()).unwrap().config;
        let thread = std::thread::spawn(move || serve(listener, config));
        Self { thread }
    }

    fn finish(self) -> Seen {
        self.thread.join().expect("the rogue server panicked")
    }
}

fn serve(listener: TcpListener, config: Arc<rustls::ServerConfig>) -> Seen {
    let mut seen = Seen::default();
    listener.set_nonblocking(true).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(_) => return seen,
        }
    };
    seen.connections += 1;
    stream.set_nonblocking(false).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut tls = rustls::ServerConnection::new(config).unwrap();
    let mut buf = [0u8; 16 * 1024];
    // Until the client closes (or is silent for 3 s): a refused handshake ends in an alert.
    loop {
        let n = match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        seen.raw.extend_from_slice(&buf[..n]);
        let mut input = &buf[..n];
        while !input.is_empty() {
            if tls.read_tls(&mut input).is_err() {
                break;
            }
        }
        if tls.process_new_packets().is_err() {
            let _ = write_pending(&mut tls, &mut stream);
            continue;
        }
        let _ = tls.reader().read_to_end(&mut seen.decrypted);
        if write_pending(&mut tls, &mut stream).is_err() {
            break;
        }
    }
    seen
}

fn write_pending(
    tls: &mut rustls::ServerConnection,
    stream: &mut TcpStream,
) -> std::io::Result<()> {
    while tls.wants_write() {
        tls.write_tls(stream)?;
    }
    stream.flush()
}
