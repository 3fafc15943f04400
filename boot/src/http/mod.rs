//! The HTTP server: per-host iPXE scripts, boot files, iPXE binaries for UEFI HTTP boot, boot
//! callbacks, timelines, health and metrics over plain HTTP (what firmware and iPXE can fetch),
//! and the deploy ramdisk's agent API over HTTPS only (it carries join secrets).
//!
//! Plain HTTP routes (`http.port`):
//! - `GET /boot/<mac>.ipxe`: the host's iPXE script
//! - `GET|HEAD /files/<path>`: a file under the HTTP root (Range, ETag)
//! - `GET|HEAD /ipxe/<name>`: an iPXE binary (UEFI HTTP boot)
//! - `GET|HEAD /images/sha256/<hex>`: an image of the appliance's image cache, by digest (what
//!   the deploy ramdisk writes to disk; the cache stores only verified images)
//! - `POST /report/<mac>/<stage>`: a boot callback, accepted from the host holding that MAC
//! - `GET /timeline` and `GET /timeline/<mac>`: boot timelines as JSON
//! - `GET /healthz` (alive), `GET /readyz` (the inventory can answer), `GET /metrics`
//! - `GET /` and `GET /status/...`: the status page and its event stream ([`status_page`]),
//!   unless `http.status_page` is off
//! - `/agent/...` and `/media/...`: refused (403), with the HTTPS URL to use instead
//!
//! HTTPS routes (`http.https_port`, the certificate of [`crate::tls`]):
//! - `/agent/...`: the deploy ramdisk's agent API ([`Inventory::agent`](crate::Inventory::agent))
//! - `GET|HEAD /media/<key>.iso`: the boot media (the ramdisk's ISO, for a BMC's virtual
//!   media) with the kernel command line of the operation `<key>` (64 lower-case hex digits)
//!   names written into it ([`crate::media`], [`Inventory::media`](crate::Inventory::media));
//!   a single byte range, no caching. Each request is logged at info level with the client's
//!   address and the outcome, never the key or the command line.
//!
//! Every client is untrusted: connections on both ports are admitted per address from one pool
//! with a reserve for boot scripts and iPXE binaries ([`crate::admission`]); a host the site
//! knows is never kept out by the others (its connection takes the slot of the oldest unknown
//! one), and the listeners are never paused, so it never waits behind a flood in the listen
//! backlog ([`listen`]). Every read and write has a deadline (the TLS handshake, request
//! headers, the agent body, and [`deadline::WriteDeadline`] for responses). On shutdown both listeners close at once and
//! the requests in flight get the configured `drain_timeout` to finish.

mod boot_media;
mod deadline;
mod sendfile;
#[cfg(test)]
mod server_tests;
mod static_files;
mod status_page;

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Deserialize;
use siteboot_image::Digest;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admission::{Caps, CapsError, Slot, Slots, Standing, Ticket};
use crate::backoff::Backoff;
use crate::decision::{ipxe_script, media_cmdline};
use crate::files::{FileError, FileRoot};
use crate::inventory::{AgentRequest, BootRequest, MediaRequest, Segment};
use crate::media::{BootMedia, MediaParams};
use crate::metrics::{HttpRefusal, HttpRoute, Metrics};
use crate::rate::{Rate, RateLimiter};
use crate::timeline::Stage;
use crate::tls::{ServerIdentity, TlsFiles};
use crate::{AgentEndpoint, BootPlane, MacAddr};

use deadline::WriteDeadline;
use sendfile::{FileChunks, SendfileStream};
pub use static_files::{RangeRequest, parse_range};
pub use status_page::StatusPage;

pub type Body = BoxBody<Bytes, std::io::Error>;

/// Largest request body the agent API accepts (inspection reports are a few KiB).
const MAX_AGENT_BODY: usize = 1024 * 1024;

/// Boot reports per address: a host reports a few stages per boot, so a burst of 10 and then
/// one every 6 s is plenty, and bounds what a flood costs (each report reads the ARP table).
const REPORT_RATE: Rate = Rate { burst: 10, every: Duration::from_secs(6) };
/// Addresses whose report rate is tracked at once (a /16 of senders, a few MiB at most).
const REPORT_ADDRESSES: usize = 65_536;

/// `GET /timeline` lists at most this many MACs, the most recently active first. Anyone on the
/// segment may ask, and the timeline keeps up to 4096 MACs (some made up by clients): this
/// keeps one answer to about 6 KiB. Each `/timeline/<mac>` is bounded by the timeline itself
/// (128 events of a few hundred bytes).
const MAX_LISTED_HOSTS: usize = 256;

/// The `http:` section of the configuration. A field left out takes its value from
/// [`HttpSettings::default`], the one place the defaults are written (`examples/standalone.yaml`
/// shows each, checked by a test).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSettings {
    /// TCP port for boot scripts, files, reports, health and metrics (plain HTTP, what
    /// firmware and iPXE fetch).
    pub port: u16,
    /// TCP port of the agent API, over HTTPS only: the deploy ramdisk gets
    /// `siteboot.agent=https://<address>:<https_port>` on its command line. The boot media
    /// (`/media/<key>.iso`, for BMCs' virtual media) is served here too.
    pub https_port: u16,
    /// The agent API's certificate and key (PEM files, e.g. a mounted Kubernetes TLS Secret).
    /// Default: none, and siteboot generates a self-signed certificate on first start and keeps
    /// it in `state_dir/agent-tls.pem` (mode 0600), reused on every restart. Either way the
    /// ramdisk pins the certificate's SHA-256 (`siteboot.fingerprint=` on its command line), so
    /// no CA is needed; replicas of one site should share one certificate.
    pub tls: Option<TlsFiles>,
    /// Kernels, initrds and images, served at `/files/<path>`.
    pub root: Option<PathBuf>,
    /// Connections served at once, on both ports together. Once they are all taken, a new
    /// connection from an address held by a host the site knows (in the config or a Host)
    /// takes the slot of the oldest connection of an address that is not, which is closed;
    /// any other is closed on arrival. Each takes up to two file descriptors (the socket and a
    /// file), which the process's limit must allow.
    pub max_connections: usize,
    /// Connections one client address may hold at once; more are closed as they arrive, so
    /// one machine cannot take every slot.
    pub max_connections_per_address: usize,
    /// How many of `max_connections` addresses the site does not know may use only for boot
    /// scripts (`/boot/`), iPXE binaries (`/ipxe/`), `/healthz` and `/readyz`, once the others
    /// are taken: unknown hosts can still start to boot while large downloads or idle clients
    /// hold the rest. Known hosts and the appliance's own address (its probes) never need it.
    /// Default: a sixteenth of `max_connections`.
    pub reserved_connections: Option<usize>,
    /// Time an HTTPS client has to finish the TLS handshake, from connecting.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// Time a client has to send a request's headers, from connecting (or from the end of the
    /// TLS handshake) or from the end of its previous response.
    #[serde(with = "humantime_serde")]
    pub header_timeout: Duration,
    /// Time a client has to send a whole agent API request body.
    #[serde(with = "humantime_serde")]
    pub body_timeout: Duration,
    /// A client that accepts no response data for this long loses its connection. The time
    /// restarts whenever data goes through: a slow but live download is never cut.
    #[serde(with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// Serve the status page at `GET /` on `port`: the site's hosts (state, MAC, address,
    /// claimed or free), their boot timelines and this appliance's health, read-only, to anyone who
    /// can reach the port (see docs/security.md for what it shows).
    pub status_page: bool,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            port: 8080,
            https_port: 8443,
            tls: None,
            root: None,
            max_connections: 1024,
            max_connections_per_address: 16,
            reserved_connections: None,
            handshake_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_secs(30),
            status_page: true,
        }
    }
}

impl HttpSettings {
    /// `reserved_connections`, or its default.
    pub fn reserved_connections(&self) -> usize {
        self.reserved_connections.unwrap_or(self.max_connections / 16)
    }

    /// The connection caps; an error names what is wrong with which of the three fields.
    pub fn caps(&self) -> Result<Caps, CapsError> {
        Caps::new(
            self.max_connections,
            self.max_connections_per_address,
            self.reserved_connections(),
        )
    }
}

/// Why the HTTP server cannot start.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("opening a file root: {0}")]
    Root(#[from] std::io::Error),
    #[error("http connection caps: {0}")]
    Caps(#[from] CapsError),
}

/// The two listening sockets: plain HTTP (`http.port`) and HTTPS for the agent API
/// (`http.https_port`).
pub struct Listeners {
    pub http: TcpListener,
    pub https: TcpListener,
}

/// Which of the two ports a connection came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Port {
    Http,
    Https,
}

pub struct HttpServer {
    plane: BootPlane,
    /// What the ramdisk is told about the agent API, and where plain `/agent/` requests are
    /// sent.
    agent: AgentEndpoint,
    tls: TlsAcceptor,
    files: Option<FileRoot>,
    ipxe_root: FileRoot,
    /// The image cache's `sha256/` directory, if this appliance serves images.
    images: Option<FileRoot>,
    slots: Arc<Slots>,
    reports: Mutex<RateLimiter>,
    handshake_timeout: Duration,
    header_timeout: Duration,
    body_timeout: Duration,
    stall_timeout: Duration,
    /// `None`: the page is turned off and its paths answer 404.
    status: Option<StatusPage>,
    /// The boot ISO served at `/media/`, if there is one.
    media: Option<Arc<BootMedia>>,
}

impl HttpServer {
    /// A server for `plane`, serving the agent API with `identity`'s certificate.
    pub fn new(
        plane: BootPlane,
        settings: &HttpSettings,
        identity: &ServerIdentity,
    ) -> Result<Self, SetupError> {
        Ok(Self {
            agent: AgentEndpoint {
                address: plane.endpoints.address,
                port: settings.https_port,
                fingerprint: identity.fingerprint,
            },
            tls: TlsAcceptor::from(identity.config.clone()),
            files: settings.root.as_deref().map(FileRoot::open).transpose()?,
            ipxe_root: FileRoot::open(plane.binaries.dir())?,
            images: None,
            plane,
            slots: Slots::new(settings.caps()?),
            reports: Mutex::new(RateLimiter::new(REPORT_RATE, REPORT_ADDRESSES)),
            handshake_timeout: settings.handshake_timeout,
            header_timeout: settings.header_timeout,
            body_timeout: settings.body_timeout,
            stall_timeout: settings.stall_timeout,
            status: None,
            media: None,
        })
    }

    /// Serves the images in `dir` (the image cache's `sha256/` directory, whose files are named
    /// by their digest) at `/images/sha256/<hex>`.
    pub fn with_images(self, dir: &std::path::Path) -> Result<Self, SetupError> {
        Ok(Self { images: Some(FileRoot::open(dir)?), ..self })
    }

    /// Serves `page` at `GET /` and `/status/...`.
    pub fn with_status_page(self, page: StatusPage) -> Self {
        Self { status: Some(page), ..self }
    }

    /// Serves `media`, patched for each operation, at `/media/<key>.iso` on the HTTPS port.
    pub fn with_boot_media(self, media: BootMedia) -> Self {
        Self { media: Some(Arc::new(media)), ..self }
    }

    /// Accepts and serves connections on both ports until `shutdown` is cancelled; then closes
    /// both listeners (new connections are refused), lets the requests in flight finish for
    /// up to `drain`, and returns.
    pub async fn run(self, listeners: Listeners, shutdown: CancellationToken, drain: Duration) {
        let server = Arc::new(self);
        let connections = TaskTracker::new();
        tokio::join!(
            server.clone().accept(listeners.http, Port::Http, &connections, &shutdown),
            server.clone().accept(listeners.https, Port::Https, &connections, &shutdown),
        );
        // Event streams never end by themselves: end them, or they would hold the drain.
        if let Some(page) = &server.status {
            page.close();
        }
        connections.close();
        let open = connections.len();
        if tokio::time::timeout(drain, connections.wait()).await.is_err() {
            tracing::warn!(
                left = connections.len(),
                deadline = ?drain,
                "HTTP connections still open after the drain deadline; leaving them"
            );
        } else {
            tracing::info!(drained = open, "HTTP server stopped");
        }
    }

    /// One port's accept loop, until `shutdown`. Accept errors (out of file descriptors, ...)
    /// are logged and retried after a backoff: they must not take the appliance down.
    async fn accept(
        self: Arc<Self>,
        listener: TcpListener,
        port: Port,
        connections: &TaskTracker,
        shutdown: &CancellationToken,
    ) {
        let mut backoff = Backoff::default();
        loop {
            // Never paused for want of a slot: a known host's connect must not wait in the
            // backlog behind a flood, so every connection is accepted and admitted or closed.
            let accepted = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let (stream, remote) = match accepted {
                Ok(accepted) => {
                    backoff.succeeded();
                    accepted
                }
                // The client gave up before we accepted: nothing to wait for.
                Err(e) if is_connection_error(&e) => continue,
                Err(e) => {
                    Metrics::add(&self.plane.metrics.http_accept_errors, 1);
                    let wait = backoff.failed();
                    tracing::warn!(error = %e, ?port, retry_in = ?wait, "cannot accept an HTTP connection");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            match self.slots.admit(remote.ip(), self.standing(remote)) {
                Ok(ticket) => {
                    let connection =
                        self.clone().connection(stream, remote, port, ticket, shutdown.clone());
                    connections.spawn(connection);
                }
                Err(refusal) => {
                    // Dropping the stream closes it. Debug level: a flood would fill the log.
                    Metrics::add(&self.plane.metrics.http_connections_refused, 1);
                    tracing::debug!(%remote, ?port, %refusal, "closing an HTTP connection on arrival");
                }
            }
        }
    }

    async fn connection(
        self: Arc<Self>,
        stream: TcpStream,
        remote: SocketAddr,
        port: Port,
        ticket: Ticket,
        shutdown: CancellationToken,
    ) {
        let _ = stream.set_nodelay(true);
        let metrics = self.plane.metrics.clone();
        Metrics::add(&metrics.http_connections_active, 1);
        let evicted = ticket.evicted().clone();
        let slot = ticket.slot();
        let serve = async move {
            match port {
                Port::Http => {
                    // Files leave by sendfile, so only plain HTTP connections get a chunk queue.
                    let chunks = Arc::new(FileChunks::default());
                    let io = WriteDeadline::new(
                        SendfileStream::new(stream, chunks.clone()),
                        self.stall_timeout,
                    );
                    self.serve_http(io, remote, port, Some(chunks), slot, &shutdown).await
                }
                Port::Https => {
                    // Under TLS, so the stall deadline sees the client's real progress.
                    let io = WriteDeadline::new(stream, self.stall_timeout);
                    match tokio::time::timeout(self.handshake_timeout, self.tls.accept(io)).await {
                        Ok(Ok(tls)) => {
                            self.serve_http(tls, remote, port, None, slot, &shutdown).await
                        }
                        Ok(Err(e)) => tracing::debug!(%remote, error = %e, "TLS handshake failed"),
                        Err(_elapsed) => {
                            Metrics::add(&self.plane.metrics.http_timeouts, 1);
                            tracing::debug!(%remote, "TLS handshake not finished in time");
                        }
                    }
                }
            }
        };
        tokio::select! {
            () = serve => {}
            // A known host needed the slot: dropping the connection closes it, mid-request or not.
            () = evicted.cancelled() => {
                Metrics::add(&metrics.http_connections_evicted, 1);
                tracing::debug!(%remote, ?port, "closed a connection to give its slot to a known host");
            }
        }
        metrics.http_connections_active.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        drop(ticket);
    }

    /// HTTP/1.1 on `io` until the client closes, a deadline passes, or `shutdown` (then the
    /// request in flight is finished and the connection closed).
    async fn serve_http<I>(
        self: Arc<Self>,
        io: I,
        remote: SocketAddr,
        port: Port,
        chunks: Option<Arc<FileChunks>>,
        slot: Slot,
        shutdown: &CancellationToken,
    ) where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let server = self.clone();
        let service = service_fn(move |req| {
            let (server, chunks) = (server.clone(), chunks.clone());
            async move { Ok::<_, Infallible>(server.route(req, remote, port, chunks, slot).await) }
        });
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_timeout)
            .serve_connection(TokioIo::new(io), service);
        let mut connection = std::pin::pin!(connection);
        let result = tokio::select! {
            result = connection.as_mut() => result,
            () = shutdown.cancelled() => {
                connection.as_mut().graceful_shutdown();
                connection.await
            }
        };
        if let Err(e) = result {
            if is_timeout(&e) {
                Metrics::add(&self.plane.metrics.http_timeouts, 1);
            }
            tracing::debug!(%remote, error = %e, "HTTP connection ended with an error");
        }
    }

    async fn route(
        &self,
        req: Request<Incoming>,
        remote: SocketAddr,
        port: Port,
        chunks: Option<Arc<FileChunks>>,
        slot: Slot,
    ) -> Response<Body> {
        let path = req.uri().path().to_owned();
        let method = req.method().clone();
        let head = method == Method::HEAD;
        let segments: Vec<&str> = path.trim_start_matches('/').splitn(2, '/').collect();
        // A reserved slot is for what starts a boot: short answers, so the reserve frees fast.
        if slot == Slot::Reserved && !matches!(segments[0], "boot" | "ipxe" | "healthz" | "readyz")
        {
            self.plane.metrics.http_refused(HttpRefusal::ReservedSlot);
            let mut busy = text(StatusCode::SERVICE_UNAVAILABLE, "server busy, try again\n");
            busy.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("5"));
            return closing(busy);
        }
        let (route, response) = match (port, &method, segments.as_slice()) {
            (Port::Https, _, ["agent", rest]) => {
                let rest = (*rest).to_owned();
                (HttpRoute::Agent, self.agent(req, rest, remote).await)
            }
            (Port::Https, &Method::GET | &Method::HEAD, ["media", file]) => {
                (HttpRoute::Media, self.media(file, &req, head, remote).await)
            }
            (Port::Https, _, _) => (
                HttpRoute::NotFound,
                text(
                    StatusCode::NOT_FOUND,
                    "this port serves the agent API (/agent/) and boot media (/media/) only\n",
                ),
            ),
            // Before any of the request is read: the client has already sent its token in
            // clear, but it gets nothing in clear back, and learns where to go.
            (Port::Http, _, ["agent", ..]) => {
                self.plane.metrics.http_refused(HttpRefusal::AgentOverHttp);
                tracing::info!(%remote, path, "refused the agent API over plain HTTP");
                let message = format!(
                    "the agent API is served over HTTPS only: {}/agent/\n",
                    self.agent.base_url()
                );
                (HttpRoute::Agent, closing(text(StatusCode::FORBIDDEN, &message)))
            }
            // The key has crossed the segment in clear, but nothing else will.
            (Port::Http, _, ["media", ..]) => {
                self.plane.metrics.http_refused(HttpRefusal::MediaOverHttp);
                tracing::info!(%remote, "refused the boot media over plain HTTP");
                let message = format!(
                    "boot media is served over HTTPS only: {}/media/\n",
                    self.agent.base_url()
                );
                (HttpRoute::Media, text(StatusCode::FORBIDDEN, &message))
            }
            (Port::Http, &Method::GET, ["healthz"]) => {
                (HttpRoute::Health, text(StatusCode::OK, "ok\n"))
            }
            (Port::Http, &Method::GET, ["readyz"]) => (HttpRoute::Ready, self.readiness()),
            (Port::Http, &Method::GET, ["metrics"]) => (HttpRoute::Metrics, self.metrics_page()),
            (Port::Http, &Method::GET, ["boot", file]) => {
                (HttpRoute::Script, self.script(file, remote).await)
            }
            (Port::Http, &Method::GET | &Method::HEAD, ["files", rest]) => {
                (HttpRoute::File, self.file(rest, &req, head, remote, chunks).await)
            }
            (Port::Http, &Method::GET | &Method::HEAD, ["images", rest]) => {
                (HttpRoute::Image, self.image(rest, &req, head, remote, chunks).await)
            }
            (Port::Http, &Method::GET | &Method::HEAD, ["ipxe", name]) => {
                (HttpRoute::IpxeBinary, self.ipxe_binary(name, &req, head, remote, chunks).await)
            }
            (Port::Http, &Method::POST, ["report", rest]) => {
                (HttpRoute::Report, self.report(rest, remote))
            }
            (Port::Http, &Method::GET, ["timeline"]) => (HttpRoute::Timeline, self.timelines()),
            (Port::Http, &Method::GET, ["timeline", mac]) => {
                (HttpRoute::Timeline, self.timeline(mac))
            }
            (Port::Http, &Method::GET, [""] | ["status", _]) => match &self.status {
                Some(page) => page.respond(&self.plane, &path, remote.ip()),
                None => (
                    HttpRoute::NotFound,
                    text(StatusCode::NOT_FOUND, "the status page is off (http.status_page)\n"),
                ),
            },
            (Port::Http, _, _) => (HttpRoute::NotFound, text(StatusCode::NOT_FOUND, "not found\n")),
        };
        self.plane.metrics.http_request(route);
        // A media key is a secret: whoever has it gets a token.
        let path = if segments[0] == "media" { "/media/<key>" } else { path.as_str() };
        tracing::debug!(%remote, ?port, %method, path, status = response.status().as_u16(), "HTTP request");
        response
    }

    /// 200 once the inventory can answer (in Kubernetes mode: the Host cache has synced),
    /// else 503 with why. Liveness is `/healthz`.
    fn readiness(&self) -> Response<Body> {
        match self.plane.inventory.ready() {
            Ok(()) => text(StatusCode::OK, "ready\n"),
            Err(why) => text(StatusCode::SERVICE_UNAVAILABLE, &format!("not ready: {why}\n")),
        }
    }

    fn metrics_page(&self) -> Response<Body> {
        Response::builder()
            .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
            .body(full(self.plane.metrics.render(&self.plane.timeline)))
            .expect("valid response")
    }

    async fn script(&self, file: &str, remote: SocketAddr) -> Response<Body> {
        let Some(mac) = file.strip_suffix(".ipxe").and_then(|m| m.parse::<MacAddr>().ok()) else {
            return text(StatusCode::NOT_FOUND, "expected /boot/<mac>.ipxe\n");
        };
        let Some(remote_ip) = ipv4(remote) else {
            return text(StatusCode::NOT_FOUND, "boot scripts are served over IPv4\n");
        };
        let request = BootRequest {
            mac,
            remote: remote_ip,
            remote_holds_mac: self.plane.neighbors.mac_of(remote_ip) == Some(mac),
            segment: Segment(self.plane.neighbors.clone()),
        };
        match self.plane.inventory.boot_action(request).await {
            Some(action) => {
                let script = ipxe_script(&action, mac, &self.plane.endpoints, &self.agent);
                self.plane.timeline.record(mac, Stage::IpxeScript, describe_script(&script));
                Response::builder()
                    .header(header::CONTENT_TYPE, "text/plain")
                    .header(header::CACHE_CONTROL, "no-store")
                    .body(full(script))
                    .expect("valid response")
            }
            None => {
                tracing::info!(%mac, "no boot action for this host; answering 404");
                text(StatusCode::NOT_FOUND, "no boot action for this host\n")
            }
        }
    }

    async fn file(
        &self,
        path: &str,
        req: &Request<Incoming>,
        head: bool,
        remote: SocketAddr,
        chunks: Option<Arc<FileChunks>>,
    ) -> Response<Body> {
        let Some(root) = &self.files else {
            return text(StatusCode::NOT_FOUND, "no http.root configured\n");
        };
        let decoded = percent_decode(path);
        let Some(decoded) = decoded else {
            return text(StatusCode::BAD_REQUEST, "bad percent-encoding\n");
        };
        self.serve(root.open_file(&decoded), &decoded, req, head, remote, chunks).await
    }

    async fn image(
        &self,
        path: &str,
        req: &Request<Incoming>,
        head: bool,
        remote: SocketAddr,
        chunks: Option<Arc<FileChunks>>,
    ) -> Response<Body> {
        let Some(images) = &self.images else {
            return text(StatusCode::NOT_FOUND, "this appliance serves no images\n");
        };
        // Only names the cache gives its files: nothing else in its directory is served.
        let digest = path.strip_prefix("sha256/").and_then(|hex| Digest::from_hex(hex).ok());
        let Some(digest) = digest else {
            return text(StatusCode::NOT_FOUND, "expected /images/sha256/<64 lower-case hex>\n");
        };
        // The digest is the only key to a tenant's image: timelines and logs name the route only.
        self.serve(images.open_file(&digest.hex()), IMAGE_STEP, req, head, remote, chunks).await
    }

    async fn ipxe_binary(
        &self,
        name: &str,
        req: &Request<Incoming>,
        head: bool,
        remote: SocketAddr,
        chunks: Option<Arc<FileChunks>>,
    ) -> Response<Body> {
        if !self.plane.binaries.is_binary(name) {
            return text(StatusCode::NOT_FOUND, "not an iPXE binary served here\n");
        }
        self.serve(self.ipxe_root.open_file(name), name, req, head, remote, chunks).await
    }

    async fn serve(
        &self,
        opened: Result<(std::fs::File, u64), FileError>,
        name: &str,
        req: &Request<Incoming>,
        head: bool,
        remote: SocketAddr,
        chunks: Option<Arc<FileChunks>>,
    ) -> Response<Body> {
        // Files are routes of the plain HTTP port, whose connections all have a chunk queue.
        let Some(chunks) = chunks else {
            return text(StatusCode::NOT_FOUND, "files are served over plain HTTP only\n");
        };
        let (file, len) = match opened {
            Ok(found) => found,
            Err(e @ (FileError::NotFound | FileError::NotAFile)) => {
                return text(StatusCode::NOT_FOUND, &format!("{e}\n"));
            }
            Err(e @ (FileError::OutsideRoot | FileError::InvalidPath(_))) => {
                tracing::warn!(%remote, path = name, error = %e, "refused an HTTP path");
                return text(StatusCode::FORBIDDEN, &format!("{e}\n"));
            }
            Err(FileError::Io(e)) => {
                tracing::error!(%remote, path = name, error = %e, "cannot open file");
                return text(StatusCode::INTERNAL_SERVER_ERROR, "cannot open file\n");
            }
        };
        match static_files::respond(
            file,
            len,
            req.headers(),
            head,
            chunks,
            self.plane.metrics.clone(),
        ) {
            Ok(response) => {
                if let (false, Some(mac)) = (head, self.mac_of(remote)) {
                    self.plane.timeline.record(
                        mac,
                        Stage::HttpFile,
                        format!("{name} {} ({len} bytes)", response.status().as_u16()),
                    );
                }
                response
            }
            Err(e) => {
                tracing::error!(%remote, path = name, error = %e, "cannot read file");
                text(StatusCode::INTERNAL_SERVER_ERROR, "cannot read file\n")
            }
        }
    }

    /// `GET|HEAD /media/<file>` (HTTPS): the boot media for the key in `file`.
    async fn media(
        &self,
        file: &str,
        req: &Request<Incoming>,
        head: bool,
        remote: SocketAddr,
    ) -> Response<Body> {
        let method = if head { "HEAD" } else { "GET" };
        let log = |status: StatusCode, outcome: &dyn std::fmt::Display| {
            tracing::info!(%remote, method, status = status.as_u16(), %outcome, "boot media request");
        };
        let Some(media) = &self.media else {
            log(StatusCode::NOT_FOUND, &"no boot media configured");
            return text(StatusCode::NOT_FOUND, "no boot media here\n");
        };
        let Some(key) = file.strip_suffix(".iso").filter(|key| is_media_key(key)) else {
            log(StatusCode::NOT_FOUND, &"not a media key");
            return text(StatusCode::NOT_FOUND, "expected /media/<64 lower-case hex>.iso\n");
        };
        let Some(remote_ip) = ipv4(remote) else {
            log(StatusCode::NOT_FOUND, &"not IPv4");
            return text(StatusCode::NOT_FOUND, "boot media is served over IPv4\n");
        };
        let request = MediaRequest { key: key.to_owned(), remote: remote_ip };
        let Some(cmdline) = self.plane.inventory.media(request).await else {
            log(StatusCode::NOT_FOUND, &"no such media");
            return text(StatusCode::NOT_FOUND, "no such media\n");
        };
        let cmdline = media_cmdline(&cmdline, &self.plane.endpoints, &self.agent);
        let params = match MediaParams::new(&cmdline) {
            Ok(params) => params,
            Err(e) => {
                // The error names a word by its place and the character only, never a word.
                tracing::error!(%remote, error = %e, "cannot write a kernel command line into the boot media");
                log(StatusCode::INTERNAL_SERVER_ERROR, &"command line does not fit the media");
                return text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "cannot write this media's kernel command line\n",
                );
            }
        };
        if let Err(e) = media.check_unchanged() {
            tracing::error!(%remote, error = %e, "cannot serve the boot media");
            log(StatusCode::INTERNAL_SERVER_ERROR, &"the media file changed");
            return text(StatusCode::INTERNAL_SERVER_ERROR, "cannot read the boot media\n");
        }
        let (response, range) = boot_media::respond(
            media.clone(),
            params,
            req.headers(),
            head,
            self.plane.metrics.clone(),
        );
        let status = response.status();
        match range {
            RangeRequest::Full => log(status, &format_args!("whole ({} bytes)", media.file_len())),
            RangeRequest::Partial { start, end } => {
                log(status, &format_args!("bytes {start}-{end}"))
            }
            RangeRequest::Unsatisfiable => log(status, &"range not satisfiable"),
        }
        response
    }

    async fn agent(
        &self,
        req: Request<Incoming>,
        path: String,
        remote: SocketAddr,
    ) -> Response<Body> {
        let Some(remote_ip) = ipv4(remote) else {
            return text(StatusCode::FORBIDDEN, "the agent API is served over IPv4\n");
        };
        let token = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| t.trim().to_owned());
        let method = req.method().clone();
        let collect = Limited::new(req.into_body(), MAX_AGENT_BODY).collect();
        let body = match tokio::time::timeout(self.body_timeout, collect).await {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(_)) => return text(StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n"),
            Err(_elapsed) => {
                Metrics::add(&self.plane.metrics.http_timeouts, 1);
                tracing::info!(%remote, "agent request body not received in time");
                return closing(text(StatusCode::REQUEST_TIMEOUT, "request body too slow\n"));
            }
        };
        let request = AgentRequest {
            method,
            path,
            token,
            remote: remote_ip,
            remote_mac: self.plane.neighbors.mac_of(remote_ip),
            segment: Segment(self.plane.neighbors.clone()),
            body,
        };
        let response = self.plane.inventory.agent(request).await;
        Response::builder()
            .status(response.status)
            .header(header::CONTENT_TYPE, response.content_type)
            .header(header::CACHE_CONTROL, "no-store")
            .body(full(response.body))
            .expect("valid response")
    }

    fn report(&self, rest: &str, remote: SocketAddr) -> Response<Body> {
        let Some((mac, stage)) = rest.split_once('/') else {
            return text(StatusCode::NOT_FOUND, "expected /report/<mac>/<stage>\n");
        };
        let Ok(mac) = mac.parse::<MacAddr>() else {
            return text(StatusCode::BAD_REQUEST, "not a MAC address\n");
        };
        let valid = !stage.is_empty()
            && stage.len() <= 32
            && stage.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !valid {
            return text(StatusCode::BAD_REQUEST, "stage must be 1-32 of [a-z0-9-]\n");
        }
        // The rate first: it is cheap, and the holder check may read the ARP table.
        if !self.reports.lock().expect("report limiter lock").allow(remote.ip(), Instant::now()) {
            self.plane.metrics.http_refused(HttpRefusal::ReportRate);
            return text(StatusCode::TOO_MANY_REQUESTS, "too many reports from this address\n");
        }
        if self.mac_of(remote) != Some(mac) {
            self.plane.metrics.http_refused(HttpRefusal::ReportNotHolder);
            tracing::info!(%remote, %mac, stage, "refused a boot report from an address not holding the MAC");
            return text(
                StatusCode::FORBIDDEN,
                "reports are accepted only from the host holding the MAC\n",
            );
        }
        self.plane.timeline.record(mac, Stage::Report, format!("{stage} from {}", remote.ip()));
        text(StatusCode::OK, "recorded\n")
    }

    fn timelines(&self) -> Response<Body> {
        let hosts = self.plane.timeline.hosts();
        let listed: Vec<String> =
            hosts.iter().take(MAX_LISTED_HOSTS).map(|m| m.to_string()).collect();
        json(&serde_json::json!({ "hosts": listed, "total": hosts.len() }))
    }

    fn timeline(&self, mac: &str) -> Response<Body> {
        let Ok(mac) = mac.parse::<MacAddr>() else {
            return text(StatusCode::BAD_REQUEST, "not a MAC address\n");
        };
        json(&serde_json::json!({ "mac": mac, "events": self.plane.timeline.events(mac) }))
    }

    /// Whether `remote` is one of the site's hosts (its proven holder is a MAC the inventory
    /// knows) or this appliance itself: asked once per connection, at accept.
    fn standing(&self, remote: SocketAddr) -> Standing {
        let own = ipv4(remote) == Some(self.plane.endpoints.address);
        Standing::of(own, if own { None } else { self.mac_of(remote) }, |mac| {
            self.plane.inventory.knows(mac)
        })
    }

    fn mac_of(&self, remote: SocketAddr) -> Option<MacAddr> {
        match remote.ip() {
            std::net::IpAddr::V4(ip) => self.plane.neighbors.mac_of(ip),
            std::net::IpAddr::V6(ip) => {
                ip.to_ipv4_mapped().and_then(|ip: Ipv4Addr| self.plane.neighbors.mac_of(ip))
            }
        }
    }
}

/// The listen backlog asked for. The kernel caps it at `net.core.somaxconn` (per network
/// namespace; 4096 by default since Linux 5.4), and tokio's own `bind` asks for 128. The
/// accept loops never pause, so the queue fills only in a burst of connects faster than they
/// run; a SYN that finds it full is dropped (the client sends it again after 1 s, 3 s, ...),
/// SYN cookies (`net.ipv4.tcp_syncookies`, on by default) or not: cookies stand in only for
/// the queue of half-open connections (`tcp_max_syn_backlog`), against a SYN flood.
const LISTEN_BACKLOG: u32 = 4096;

/// A listener on `addr` with [`LISTEN_BACKLOG`].
pub fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    // As tokio's `bind` does: a restarted appliance binds again at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Errors of one connection that came and went before `accept()`: no reason to back off.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset)
}

/// Whether a connection ended on a deadline: hyper's header timeout or a [`WriteDeadline`].
fn is_timeout(e: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        source = s.source();
    }
    e.is_timeout()
}

/// A boot media key: exactly 64 lower-case hex digits.
fn is_media_key(key: &str) -> bool {
    key.len() == 64 && key.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn ipv4(remote: SocketAddr) -> Option<Ipv4Addr> {
    match remote.ip() {
        std::net::IpAddr::V4(ip) => Some(ip),
        std::net::IpAddr::V6(ip) => ip.to_ipv4_mapped(),
    }
}

/// What the timeline calls a download of a cached image.
const IMAGE_STEP: &str = "/images/sha256/<digest>";

/// What a script's kernel command line carries that the timeline leaves out: the token (a
/// secret) and the operation's id, which stays behind the Kubernetes API.
const REDACTED_ARGS: [&str; 2] = ["siteboot.token=", "siteboot.operation="];

/// What the timeline says about a script: its first command after the banner, with its token
/// and operation redacted (the timeline is published to the whole segment).
fn describe_script(script: &str) -> String {
    let line = script
        .lines()
        .find(|l| !l.starts_with("#!") && !l.starts_with("echo") && !l.trim().is_empty())
        .unwrap_or("(empty)");
    let redacted: Vec<String> = line
        .split(' ')
        .map(|w| match REDACTED_ARGS.iter().find(|arg| w.starts_with(*arg)) {
            Some(arg) => format!("{arg}<redacted>"),
            None => w.to_owned(),
        })
        .collect();
    redacted.join(" ").chars().take(300).collect()
}

/// Decodes `%XX` escapes; `None` for a malformed escape or a result that is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

pub(crate) fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into()).map_err(|never| match never {}).boxed()
}

pub(crate) fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed()
}

fn text(status: StatusCode, body: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain")
        .body(full(body.to_owned()))
        .expect("valid response")
}

/// `response`, and the connection closes after it.
fn closing(mut response: Response<Body>) -> Response<Body> {
    response.headers_mut().insert(header::CONNECTION, header::HeaderValue::from_static("close"));
    response
}

fn json(value: &serde_json::Value) -> Response<Body> {
    Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(value.to_string()))
        .expect("valid response")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_descriptions_redact_tokens_and_operations() {
        let script = "#!ipxe\necho hi\n\
            kernel http://h/k siteboot.token=s3cret siteboot.operation=0a1b quiet\nboot\n";
        assert_eq!(
            describe_script(script),
            "kernel http://h/k siteboot.token=<redacted> siteboot.operation=<redacted> quiet"
        );
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%20b/c").as_deref(), Some("a b/c"));
        assert_eq!(percent_decode("%2e%2e/x").as_deref(), Some("../x"));
        assert_eq!(percent_decode("bad%2"), None);
        assert_eq!(percent_decode("bad%zz"), None);
        assert_eq!(percent_decode("%ff"), None);
    }
}
