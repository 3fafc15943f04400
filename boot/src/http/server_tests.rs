//! The server on loopback, end to end: which port serves what, readiness, the TLS handshake
//! deadline, graceful shutdown, file bodies sent by sendfile, the status page's stream, and the
//! boot media patched per request.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use http::Method;
use siteboot_agent::{AgentClient, AgentUrl};

use super::*;
use crate::inventory::{AgentResponse, BootAction, BoxFuture, Inventory, MediaRequest};
use crate::leadership::Leadership;
use crate::neighbors::Neighbors;
use crate::timeline::Timeline;
use crate::tls::ServerIdentity;
use crate::{Endpoints, MacAddr};

const DOWNLOAD_LEN: u64 = 64 * 1024 * 1024;
/// The name of the one image in the test's image cache.
const IMAGE_HEX: &str = "4bd7a4a7f9e0a5e23e48c3e0b5d3c0a1f2e3d4c5b6a798877665544332211000";
/// Far longer than any wait below, so a test fails on its own deadline, not a hang.
const DEADLINE: Duration = Duration::from_secs(20);

/// The MAC loopback holds: files it fetches are steps of this host's timeline.
const HOLDER: &str = "52:54:00:00:00:42";
/// The operation id on the ramdisk command line [`TestInventory`] boots.
const OPERATION: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f0";

/// The one key [`TestInventory`] has boot media for.
const MEDIA_KEY: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
/// The token on that media's command line.
const MEDIA_TOKEN: &str = "5ec7e7a5ec7e7a5ec7e7a5ec7e7a5ec7";
/// The boot media's length, and where its parameters region is: across a boundary of the
/// chunks it is read in.
const MEDIA_LEN: usize = 1_200_000;
const MEDIA_REGION: usize = 3 * 256 * 1024 - 500;

/// Boots the ramdisk with a token and [`OPERATION`]; its agent API answers every request with
/// "agent ok"; has boot media for [`MEDIA_KEY`] only, and counts how often it is asked for
/// media; ready when told.
struct TestInventory {
    ready: AtomicBool,
    media_asked: AtomicUsize,
}

impl Inventory for TestInventory {
    fn boots(&self, _: MacAddr) -> bool {
        false
    }

    fn ready(&self) -> Result<(), &'static str> {
        if self.ready.load(Ordering::Relaxed) { Ok(()) } else { Err("the cache is cold") }
    }

    fn boot_action(&self, _: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
        let word = |w: &str| siteboot_ipxe::Word::new(w).unwrap();
        let ramdisk = crate::inventory::LinuxBoot {
            kernel: crate::inventory::Source::File(word("vmlinuz")),
            initrds: vec![],
            cmdline: vec![
                word("siteboot.token=0123abcd"),
                word(&format!("siteboot.operation={OPERATION}")),
            ],
        };
        Box::pin(async move { Some(BootAction::Linux(ramdisk)) })
    }

    fn agent(&self, request: AgentRequest) -> BoxFuture<'_, AgentResponse> {
        Box::pin(async move {
            AgentResponse::text(StatusCode::OK, format!("agent ok: {}", request.path))
        })
    }

    fn media(&self, request: MediaRequest) -> BoxFuture<'_, Option<Vec<siteboot_ipxe::Word>>> {
        self.media_asked.fetch_add(1, Ordering::Relaxed);
        let words = (request.key == MEDIA_KEY).then(|| {
            [
                "console=ttyS0,115200",
                format!("siteboot.token={MEDIA_TOKEN}").as_str(),
                format!("siteboot.operation={OPERATION}").as_str(),
            ]
            .map(|w| siteboot_ipxe::Word::new(w).unwrap())
            .to_vec()
        });
        Box::pin(async move { words })
    }
}

/// The boot ISO as built: bytes that are neither spaces nor the marker, and the blank region
/// at [`MEDIA_REGION`].
fn media_iso() -> Vec<u8> {
    let mut iso: Vec<u8> = (0..MEDIA_LEN as u32).map(|i| (i.wrapping_mul(7) % 31) as u8).collect();
    let region = &mut iso[MEDIA_REGION..MEDIA_REGION + crate::media::REGION_LEN];
    region.fill(b' ');
    region[..crate::media::MARKER.len()].copy_from_slice(crate::media::MARKER);
    iso
}

struct Running {
    http: SocketAddrV4,
    https: SocketAddrV4,
    identity: ServerIdentity,
    inventory: Arc<TestInventory>,
    timeline: Arc<Timeline>,
    shutdown: CancellationToken,
    server: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

/// The drain deadline of every test but the one about it: longer than any test waits.
const DRAIN: Duration = Duration::from_secs(30);

async fn start(settings: HttpSettings) -> Running {
    start_draining(settings, DRAIN).await
}

async fn start_draining(settings: HttpSettings, drain: Duration) -> Running {
    start_with(settings, drain, true).await
}

async fn start_without_media() -> Running {
    start_with(HttpSettings::default(), DRAIN, false).await
}

async fn start_with(settings: HttpSettings, drain: Duration, media: bool) -> Running {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("undionly.kpxe"), b"bios").unwrap();
    std::fs::File::create(dir.path().join("big.img")).unwrap().set_len(DOWNLOAD_LEN).unwrap();
    std::fs::write(dir.path().join("pattern.bin"), pattern()).unwrap();
    let images = dir.path().join("images/sha256");
    std::fs::create_dir_all(&images).unwrap();
    std::fs::write(images.join(IMAGE_HEX), b"image bytes").unwrap();
    std::fs::write(images.join("notes.txt"), b"not an image").unwrap();
    std::fs::write(dir.path().join("ramdisk.iso"), media_iso()).unwrap();
    let inventory =
        Arc::new(TestInventory { ready: AtomicBool::new(false), media_asked: AtomicUsize::new(0) });
    let timeline = Arc::new(Timeline::new());
    let plane = BootPlane {
        endpoints: Endpoints { address: Ipv4Addr::LOCALHOST, http_port: 0 },
        inventory: inventory.clone(),
        binaries: Arc::new(siteboot_ipxe::IpxeBinaries::discover(dir.path())),
        timeline: timeline.clone(),
        metrics: Arc::new(Metrics::new()),
        neighbors: Arc::new(Neighbors::from_arp(vec![(
            Ipv4Addr::LOCALHOST,
            HOLDER.parse().unwrap(),
        )])),
    };
    let identity = ServerIdentity::load(None, &dir.path().join("state"), Ipv4Addr::LOCALHOST)
        .expect("a generated certificate");
    let bind = || async { TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap() };
    let listeners = Listeners { http: bind().await, https: bind().await };
    let address = |l: &TcpListener| match l.local_addr().unwrap() {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => unreachable!("bound to IPv4"),
    };
    let (http, https) = (address(&listeners.http), address(&listeners.https));
    let settings =
        HttpSettings { root: Some(dir.path().to_owned()), https_port: https.port(), ..settings };
    let mut server =
        HttpServer::new(plane, &settings, &identity).unwrap().with_images(&images).unwrap();
    if settings.status_page {
        let (_, leadership) = tokio::sync::watch::channel(Leadership::Always);
        server = server.with_status_page(StatusPage::new("test-site", leadership));
    }
    if media {
        let iso = crate::media::BootMedia::open(&dir.path().join("ramdisk.iso")).unwrap();
        server = server.with_boot_media(iso);
    }
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(server.run(listeners, shutdown.clone(), drain));
    Running { http, https, identity, inventory, timeline, shutdown, server, _dir: dir }
}

impl Running {
    /// A TLS connection to the HTTPS port, pinned to its certificate as the ramdisk pins it.
    async fn tls_connect(&self) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let pin = self.identity.fingerprint;
        let verifier = siteboot_tls_pin::PinnedCertificate::new(pin, &provider);
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(self.https).await.unwrap();
        let name = rustls::pki_types::ServerName::IpAddress(Ipv4Addr::LOCALHOST.into());
        tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.unwrap()
    }

    /// `method path` over HTTPS with `headers` (each ending in CRLF), on a new connection:
    /// the status, the response head (lower-cased) and the body.
    async fn https(&self, method: &str, path: &str, headers: &str) -> (u16, String, Vec<u8>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tls = self.tls_connect().await;
        let request =
            format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n");
        tls.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        // The body's length is checked against Content-Length: a missing close_notify is no error.
        let _ = tokio::time::timeout(DEADLINE, tls.read_to_end(&mut answer)).await.unwrap();
        let end = answer.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head");
        let head = String::from_utf8(answer[..end].to_vec()).unwrap().to_ascii_lowercase();
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, head, answer[end + 4..].to_vec())
    }

    fn agent_client(&self) -> AgentClient {
        let url = AgentUrl { address: *self.https.ip(), port: self.https.port() };
        let pin = self.identity.fingerprint;
        AgentClient::new(url, pin).with_timeout(DEADLINE)
    }
}

/// One request on a new connection (blocking, so run it off the runtime): (status, body).
fn get(addr: SocketAddrV4, path: &str) -> (u16, String) {
    let (head, body) = get_with_head(addr, path);
    (head.split_whitespace().nth(1).unwrap().parse().unwrap(), body)
}

/// One request on a new connection: the response head (lower-cased) and body.
fn get_with_head(addr: SocketAddrV4, path: &str) -> (String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    (head.to_ascii_lowercase(), body.to_owned())
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

#[tokio::test]
async fn the_agent_api_is_served_over_https_only() {
    let running = start(HttpSettings::default()).await;
    let client = running.agent_client();
    let response = client.request(Method::GET, "v1/task", None, None).await.unwrap();
    assert_eq!((response.status, &response.body[..]), (StatusCode::OK, &b"agent ok: v1/task"[..]));

    let https = running.https;
    let (http, url) = (running.http, format!("https://127.0.0.1:{}/agent/", https.port()));
    let (status, body) = blocking(move || get(http, "/agent/v1/bootstrap")).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains(&url), "the refusal does not point to {url}: {body}");
    assert!(!body.contains("agent ok"), "the plain request reached the agent API");
}

#[tokio::test]
async fn readyz_follows_the_inventory_and_healthz_does_not() {
    let running = start(HttpSettings::default()).await;
    let http = running.http;
    let (status, body) = blocking(move || get(http, "/readyz")).await;
    assert_eq!((status, body.as_str()), (503, "not ready: the cache is cold\n"));
    assert_eq!(blocking(move || get(http, "/healthz")).await.0, 200);
    running.inventory.ready.store(true, Ordering::Relaxed);
    assert_eq!(blocking(move || get(http, "/readyz")).await, (200, "ready\n".to_owned()));
}

#[tokio::test]
async fn a_client_that_never_finishes_the_handshake_is_dropped() {
    let timeout = Duration::from_millis(300);
    let running = start(HttpSettings { handshake_timeout: timeout, ..Default::default() }).await;
    let https = running.https;
    let (closed_after, got) = blocking(move || {
        let mut stream = TcpStream::connect(https).unwrap();
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        let started = std::time::Instant::now();
        let mut got = Vec::new();
        // EOF or a reset: either way the server let go.
        let _ = stream.read_to_end(&mut got);
        (started.elapsed(), got.len())
    })
    .await;
    assert!(closed_after >= timeout && closed_after < DEADLINE, "closed after {closed_after:?}");
    assert_eq!(got, 0);
}

#[tokio::test]
async fn shutdown_finishes_a_download_in_flight_and_refuses_new_connections() {
    let running = start(HttpSettings::default()).await;
    let http = running.http;
    // The download starts, and stops being read well before it is done.
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (cancelled_tx, cancelled_rx) = std::sync::mpsc::channel::<()>();
    let download = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(http).unwrap();
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        write!(stream, "GET /files/big.img HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut chunk = vec![0u8; 64 * 1024];
        let mut total = stream.read(&mut chunk).unwrap() as u64;
        started_tx.send(()).unwrap();
        cancelled_rx.recv_timeout(DEADLINE).unwrap();
        loop {
            match stream.read(&mut chunk) {
                Ok(0) => return total,
                Ok(n) => total += n as u64,
                Err(e) => panic!("the download broke off after {total} bytes: {e}"),
            }
        }
    });
    tokio::task::spawn_blocking(move || started_rx.recv_timeout(DEADLINE).unwrap()).await.unwrap();
    running.shutdown.cancel();

    // New connections are refused once the listeners are closed (soon after the cancel).
    let https = running.https;
    let refused = blocking(move || {
        let deadline = std::time::Instant::now() + DEADLINE;
        loop {
            let http_refused =
                TcpStream::connect(http).is_err_and(|e| e.kind() == ErrorKind::ConnectionRefused);
            let https_refused =
                TcpStream::connect(https).is_err_and(|e| e.kind() == ErrorKind::ConnectionRefused);
            if http_refused && https_refused {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await;
    assert!(refused, "a new connection was still accepted after the cancel");
    assert!(!running.server.is_finished(), "the server returned with a download in flight");

    cancelled_tx.send(()).unwrap();
    let total = download.await.unwrap();
    // The response head is counted too: at least the whole file arrived, and then EOF.
    assert!(total > DOWNLOAD_LEN, "only {total} of {DOWNLOAD_LEN} bytes");
    tokio::time::timeout(DEADLINE, running.server)
        .await
        .expect("run returns once drained")
        .unwrap();
}

#[tokio::test]
async fn the_drain_deadline_bounds_shutdown() {
    let drain = Duration::from_millis(300);
    let running = start_draining(HttpSettings::default(), drain).await;
    let http = running.http;
    // A download nobody reads: it cannot finish.
    let _stalled = blocking(move || {
        let mut stream = TcpStream::connect(http).unwrap();
        write!(stream, "GET /files/big.img HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut head = [0u8; 16];
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        stream.read_exact(&mut head).unwrap();
        stream
    })
    .await;
    let started = tokio::time::Instant::now();
    running.shutdown.cancel();
    tokio::time::timeout(DEADLINE, running.server).await.expect("run returns").unwrap();
    let took = started.elapsed();
    assert!(took >= drain && took < DEADLINE, "returned after {took:?}");
}

#[tokio::test]
async fn a_stalled_agent_body_over_https_is_answered_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let body_timeout = Duration::from_millis(300);
    let running = start(HttpSettings { body_timeout, ..Default::default() }).await;
    let mut tls = running.tls_connect().await;
    let started = tokio::time::Instant::now();
    tls.write_all(
        b"POST /agent/v1/inspection HTTP/1.1\r\nHost: x\r\nContent-Length: 65536\r\n\r\n{",
    )
    .await
    .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, tls.read_to_end(&mut answer)).await.unwrap().unwrap_or(0);
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(started.elapsed() >= body_timeout);
}

/// 3.5 MiB that are not zeros (a sendfile placeholder is zeros) and differ at every 4-byte
/// position, spanning several sendfile chunks.
fn pattern() -> Vec<u8> {
    (0..(7u32 << 19) / 4).flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()).collect()
}

/// Reads one response with a Content-Length body from a keep-alive connection.
fn read_response(stream: &mut TcpStream) -> (u16, Vec<u8>) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        stream.read_exact(&mut byte).unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap();
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).unwrap();
    (status, body)
}

#[tokio::test]
async fn file_bodies_by_sendfile_are_exact_across_chunks_ranges_and_keep_alive() {
    let server = start(HttpSettings::default()).await;
    let addr = server.http;
    blocking(move || {
        let expected = pattern();
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        // A range across a chunk boundary, the whole file, a small iPXE binary, and the tail:
        // four responses on one connection, each exact, none shifted by the one before.
        let requests = [
            ("/files/pattern.bin", "bytes=1000-2500000", &expected[1000..=2_500_000]),
            ("/files/pattern.bin", "", &expected[..]),
            ("/ipxe/undionly.kpxe", "", &b"bios"[..]),
            ("/files/pattern.bin", "bytes=-7", &expected[expected.len() - 7..]),
        ];
        for (path, range, want) in requests {
            let range =
                if range.is_empty() { String::new() } else { format!("Range: {range}\r\n") };
            write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\n{range}\r\n").unwrap();
            let (status, body) = read_response(&mut stream);
            assert!(status == 200 || status == 206, "{path}: {status}");
            assert_eq!(body.len(), want.len(), "{path} {range}");
            assert!(body == want, "{path} {range}: the bytes differ");
        }
    })
    .await;
    server.shutdown.cancel();
}

#[tokio::test]
async fn images_are_served_by_digest_and_nothing_else_from_their_directory() {
    let server = start(HttpSettings::default()).await;
    let addr = server.http;
    blocking(move || {
        assert_eq!(get(addr, &format!("/images/sha256/{IMAGE_HEX}")), (200, "image bytes".into()));
        let refused = [
            "/images/sha256/notes.txt".to_owned(),
            format!("/images/sha256/{}", IMAGE_HEX.to_uppercase()),
            format!("/images/{IMAGE_HEX}"),
            "/images/sha256/../../pattern.bin".to_owned(),
            format!("/images/sha256/{}", &IMAGE_HEX[..63]),
        ];
        for path in refused {
            assert_eq!(get(addr, &path).0, 404, "{path}");
        }
    })
    .await;
    server.shutdown.cancel();
}

#[tokio::test]
async fn the_status_page_is_served_under_a_policy_that_runs_no_inline_script() {
    let running = start(HttpSettings::default()).await;
    let http = running.http;
    let (head, body) = blocking(move || get_with_head(http, "/")).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/html"), "{head}");
    assert!(head.contains("content-security-policy: default-src 'none'; script-src 'self';"));
    assert!(body.contains(r#"<script src="/status/app.js" defer></script>"#), "{body}");
    for (path, kind) in [("/status/app.js", "text/javascript"), ("/status/style.css", "text/css")] {
        let (head, body) = blocking(move || get_with_head(http, path)).await;
        assert!(head.starts_with("http/1.1 200") && head.contains(kind), "{path}: {head}");
        assert!(!body.is_empty());
    }
    assert_eq!(blocking(move || get(http, "/status/nothing")).await.0, 404);
    running.shutdown.cancel();

    let off = start(HttpSettings { status_page: false, ..Default::default() }).await;
    let http = off.http;
    for path in ["/", "/status/app.js", "/status/events"] {
        let (status, body) = blocking(move || get(http, path)).await;
        assert_eq!((status, body.as_str()), (404, "the status page is off (http.status_page)\n"));
    }
    off.shutdown.cancel();
}

/// Opens `/status/events` and reads until `want` has arrived; returns the connection and
/// what it read.
fn open_stream(addr: SocketAddrV4, want: &str) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(stream, "GET /status/events HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let text = read_until(&mut stream, String::new(), want);
    (stream, text)
}

fn read_until(stream: &mut TcpStream, mut text: String, want: &str) -> String {
    let mut chunk = [0u8; 64 * 1024];
    while !text.contains(want) {
        let n = stream.read(&mut chunk).unwrap();
        assert!(n > 0, "the stream ended before {want:?}:\n{text}");
        text.push_str(&String::from_utf8_lossy(&chunk[..n]));
    }
    text
}

#[tokio::test]
async fn the_event_stream_sends_a_snapshot_then_each_step_and_ends_at_shutdown() {
    let running = start(HttpSettings::default()).await;
    let http = running.http;
    let (mut stream, text) = blocking(move || open_stream(http, "event: snapshot\n")).await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.to_ascii_lowercase().contains("content-type: text/event-stream"), "{text}");
    let text = blocking(move || {
        let text = read_until(&mut stream, text, "\n\n");
        (stream, text)
    });
    let (mut stream, text) = text.await;
    assert!(text.contains(r#""site":"test-site""#), "{text}");
    assert!(text.contains(r#""role":"only-replica""#), "{text}");

    let mac: MacAddr = "52:54:00:00:00:07".parse().unwrap();
    let detail = "<img src=x onerror=alert(1)>\n\nevent: snapshot";
    running.timeline.record(mac, crate::timeline::Stage::HttpFile, detail);
    let text = blocking(move || read_until(&mut stream, text, r#""stage":"http-file""#)).await;
    let step = text.split("event: step\ndata: ").nth(1).unwrap().split("\n\n").next().unwrap();
    let step: serde_json::Value = serde_json::from_str(step).unwrap();
    assert_eq!(step["mac"], "52:54:00:00:00:07");
    assert_eq!(step["detail"], detail);
    assert_eq!(step["chart"][0]["phase"], "download");

    // An open stream does not hold the shutdown up to the drain deadline.
    let started = tokio::time::Instant::now();
    running.shutdown.cancel();
    tokio::time::timeout(DEADLINE, running.server).await.expect("run returns").unwrap();
    assert!(started.elapsed() < DRAIN / 2, "shutdown took {:?}", started.elapsed());
}

#[tokio::test]
async fn event_streams_are_capped_per_address() {
    let running = start(HttpSettings::default()).await;
    let http = running.http;
    let refused = blocking(move || {
        let open: Vec<_> = (0..4).map(|_| open_stream(http, "event: snapshot\n").0).collect();
        let refused = get(http, "/status/events");
        drop(open);
        refused
    })
    .await;
    assert_eq!(refused.0, 503, "{}", refused.1);
    assert!(refused.1.contains("this address already holds 4 slots"), "{}", refused.1);
    running.shutdown.cancel();
}

/// What any machine on the segment reads (`/timeline`, the status page's stream, `/metrics`)
/// after a host fetched its boot script and its image: neither the operation id on the
/// script's command line nor the image's digest, the only key to `/images/sha256/<hex>`.
#[tokio::test]
async fn published_steps_name_no_operation_and_no_image_digest() {
    let running = start(HttpSettings::default()).await;
    let http = running.http;
    let (mut stream, text) = blocking(move || open_stream(http, "event: snapshot\n")).await;
    let (script, image) = blocking(move || {
        (
            get(http, &format!("/boot/{HOLDER}.ipxe")),
            get(http, &format!("/images/sha256/{IMAGE_HEX}")),
        )
    })
    .await;
    assert!(script.0 == 200 && script.1.contains(OPERATION), "{script:?}");
    assert_eq!(image.0, 200);
    let live = blocking(move || read_until(&mut stream, text, r#""stage":"http-file""#)).await;
    let published = blocking(move || {
        let (_, snapshot) = open_stream(http, "unlisted_omitted");
        [
            live,
            snapshot,
            get(http, "/timeline").1,
            get(http, &format!("/timeline/{HOLDER}")).1,
            get(http, "/metrics").1,
        ]
    })
    .await;
    let timeline = &published[3];
    assert!(timeline.contains("ipxe-script") && timeline.contains("http-file"), "{timeline}");
    for text in published {
        assert!(!text.contains(OPERATION), "the operation id is published: {text}");
        assert!(!text.contains(IMAGE_HEX), "the image digest is published: {text}");
    }
    running.shutdown.cancel();
}

/// A response header's value (the head is lower-cased).
fn header_of<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':').map(str::trim))
}

/// What the test ISO is when served for [`MEDIA_KEY`]: its region holds the inventory's words
/// and the appliance's, padded with spaces.
fn patched_iso(running: &Running) -> Vec<u8> {
    let line = format!(
        "console=ttyS0,115200 siteboot.token={MEDIA_TOKEN} siteboot.operation={OPERATION} \
         siteboot.url=http://127.0.0.1:0 siteboot.agent=https://127.0.0.1:{} \
         siteboot.fingerprint={}",
        running.https.port(),
        running.identity.fingerprint
    );
    let mut iso = media_iso();
    let region = &mut iso[MEDIA_REGION..MEDIA_REGION + crate::media::REGION_LEN];
    region.fill(b' ');
    region[..line.len()].copy_from_slice(line.as_bytes());
    iso
}

#[tokio::test]
async fn boot_media_is_the_iso_with_the_operation_command_line_written_in() {
    let running = start(HttpSettings::default()).await;
    let path = format!("/media/{MEDIA_KEY}.iso");
    let (status, head, body) = running.https("GET", &path, "").await;
    assert_eq!(status, 200, "{head}");
    assert_eq!(header_of(&head, "content-length"), Some(MEDIA_LEN.to_string().as_str()));
    assert_eq!(header_of(&head, "content-type"), Some("application/octet-stream"));
    assert_eq!(header_of(&head, "cache-control"), Some("no-store"));
    assert_eq!(header_of(&head, "accept-ranges"), Some("bytes"));
    let expected = patched_iso(&running);
    assert_eq!(body.len(), expected.len());
    assert!(body == expected, "the served ISO differs from the ISO with its region written");

    // What the ramdisk reads from that command line: the token, the agent and the pin.
    let region = &body[MEDIA_REGION..MEDIA_REGION + crate::media::REGION_LEN];
    let line = std::str::from_utf8(region).unwrap();
    let cmdline = siteboot_agent::cmdline::Cmdline::parse(line).unwrap();
    assert_eq!(cmdline.token.unwrap().as_str(), MEDIA_TOKEN);
    assert_eq!(cmdline.operation.as_deref(), Some(OPERATION));
    assert_eq!(cmdline.agent.port, running.https.port());
    assert_eq!(cmdline.fingerprint.to_string(), running.identity.fingerprint.to_string());
    assert!(line.ends_with("  ") && !line.contains("unset"), "{line:?}");

    // HEAD: the same head, no body.
    let (status, head_only, body) = running.https("HEAD", &path, "").await;
    assert_eq!((status, body.len()), (200, 0));
    assert_eq!(header_of(&head_only, "content-length"), Some(MEDIA_LEN.to_string().as_str()));
    assert_eq!(running.inventory.media_asked.load(Ordering::Relaxed), 2);
    running.shutdown.cancel();
}

#[tokio::test]
async fn boot_media_ranges_are_patched_where_they_cross_the_region() {
    let running = start(HttpSettings::default()).await;
    let path = format!("/media/{MEDIA_KEY}.iso");
    let expected = patched_iso(&running);
    let (a, b) = (MEDIA_REGION - 100, MEDIA_REGION + crate::media::REGION_LEN + 100);
    let ranges = [
        (format!("bytes={a}-{b}"), a, b),
        // Starting inside the region, to the end of the file.
        (format!("bytes={}-", MEDIA_REGION + 10), MEDIA_REGION + 10, MEDIA_LEN - 1),
        // The last bytes: after the region, untouched.
        ("bytes=-1000".to_owned(), MEDIA_LEN - 1000, MEDIA_LEN - 1),
        // One byte, the region's last.
        (format!("bytes={0}-{0}", b - 101), b - 101, b - 101),
    ];
    for (range, start, end) in ranges {
        let (status, head, body) =
            running.https("GET", &path, &format!("Range: {range}\r\n")).await;
        assert_eq!(status, 206, "{range}: {head}");
        let content_range = format!("bytes {start}-{end}/{MEDIA_LEN}");
        assert_eq!(header_of(&head, "content-range"), Some(content_range.as_str()), "{range}");
        assert!(body == expected[start..=end], "{range}: the bytes differ");
    }
    let (status, head, _) =
        running.https("GET", &path, &format!("Range: bytes={MEDIA_LEN}-\r\n")).await;
    assert_eq!(status, 416, "{head}");
    assert_eq!(header_of(&head, "content-range"), Some(format!("bytes */{MEDIA_LEN}").as_str()));
    running.shutdown.cancel();
}

#[tokio::test]
async fn boot_media_keys_are_checked_before_the_inventory_is_asked() {
    let running = start(HttpSettings::default()).await;
    let malformed = [
        format!("/media/{}.iso", MEDIA_KEY.to_uppercase()),
        format!("/media/{}.iso", &MEDIA_KEY[..63]),
        format!("/media/{MEDIA_KEY}0.iso"),
        format!("/media/{MEDIA_KEY}"),
        format!("/media/{MEDIA_KEY}.img"),
        format!("/media/x/{MEDIA_KEY}.iso"),
        format!("/media/{}g.iso", &MEDIA_KEY[..63]),
        "/media/".to_owned(),
    ];
    for path in malformed {
        let (status, _, body) = running.https("GET", &path, "").await;
        assert_eq!(status, 404, "{path}");
        assert_eq!(String::from_utf8_lossy(&body), "expected /media/<64 lower-case hex>.iso\n");
    }
    assert_eq!(running.inventory.media_asked.load(Ordering::Relaxed), 0);

    // A key of the right shape that the inventory has no media for.
    let unknown = format!("/media/{}.iso", "0".repeat(64));
    for method in ["GET", "HEAD"] {
        let (status, _, body) = running.https(method, &unknown, "").await;
        assert_eq!(status, 404, "{method}");
        if method == "GET" {
            assert_eq!(body, b"no such media\n");
        }
    }
    assert_eq!(running.inventory.media_asked.load(Ordering::Relaxed), 2);
    // Not a media method.
    let (status, _, _) = running.https("POST", &format!("/media/{MEDIA_KEY}.iso"), "").await;
    assert_eq!(status, 404);
    assert_eq!(running.inventory.media_asked.load(Ordering::Relaxed), 2);
    running.shutdown.cancel();
}

#[tokio::test]
async fn boot_media_over_plain_http_is_refused() {
    let running = start(HttpSettings::default()).await;
    let (http, url) = (running.http, format!("https://127.0.0.1:{}/media/", running.https.port()));
    let path = format!("/media/{MEDIA_KEY}.iso");
    let (status, body) = blocking(move || get(http, &path)).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains(&url) && body.contains("HTTPS only"), "{body}");
    assert_eq!(running.inventory.media_asked.load(Ordering::Relaxed), 0);
    running.shutdown.cancel();
}

#[tokio::test]
async fn without_boot_media_the_route_answers_404() {
    let running = start_without_media().await;
    let (status, _, body) = running.https("GET", &format!("/media/{MEDIA_KEY}.iso"), "").await;
    assert_eq!((status, body.as_slice()), (404, &b"no boot media here\n"[..]));
    assert_eq!(running.inventory.media_asked.load(Ordering::Relaxed), 0);
    running.shutdown.cancel();
}
