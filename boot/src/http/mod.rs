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
//!
//! Three rooms: [`transport`] (accept, admission, TLS, deadlines, shutdown), [`routes`] (which
//! handler a request goes to) and [`handlers`] (what each answers). This file holds the settings,
//! the server's state and the response helpers they share.

mod boot_media;
mod deadline;
mod handlers;
mod routes;
mod sendfile;
#[cfg(test)]
mod server_tests;
mod static_files;
mod status_page;
mod transport;

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
use handlers::FileRequest;
use sendfile::{FileChunks, SendfileStream};
pub use static_files::{RangeRequest, parse_range};
pub use status_page::StatusPage;
pub use transport::listen;

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
