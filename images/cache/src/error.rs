use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use siteboot_image::{Digest, Mismatch};

use crate::fetch::MAX_REDIRECTS;

/// What went wrong with an image. The underlying errors are in the message, not chained as
/// `source()`, so they are printed once. Clone (sources behind `Arc`) because every request waiting
/// on one shared download gets its result.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CacheError {
    #[error("{action} {}: {error}", path.display())]
    Io { action: &'static str, path: PathBuf, error: Arc<io::Error> },
    #[error("connecting to {url}: {error}")]
    Connect { url: String, error: Arc<io::Error> },
    #[error("https needs trusted root certificates and this system has none: {0}")]
    NoRoots(String),
    #[error("TLS handshake with {url}: {error}")]
    Tls { url: String, error: Arc<io::Error> },
    #[error("HTTP exchange with {url}: {error}")]
    Http { url: String, error: Arc<hyper::Error> },
    #[error("{url} answered {status}")]
    Status { url: String, status: StatusCode },
    #[error("{url} redirects to {location:?}, which is not an absolute http(s) URL or path")]
    BadRedirect { url: String, location: String },
    #[error("more than {MAX_REDIRECTS} redirects, the last to {url}")]
    TooManyRedirects { url: String },
    #[error(
        "{url} answered a request for the bytes from {offset} with Content-Range {content_range:?}"
    )]
    BadRange { url: String, offset: u64, content_range: String },
    #[error("no answer from {url} within {timeout:?} ({phase})")]
    Timeout { url: String, phase: &'static str, timeout: Duration },
    #[error("{url}: the transfer broke off after {bytes} bytes ({cause}), {resumes} resumes tried")]
    Dropped { url: String, bytes: u64, resumes: u32, cause: Interruption },
    /// The image was fetched whole, but it is not the one named: it was discarded.
    #[error("{0}; discarded")]
    Mismatch(Mismatch),
    #[error("the image is at least {size} bytes, more than the cache's max_bytes ({max})")]
    TooLarge { size: u64, max: u64 },
    #[error(
        "no room for {needed} more bytes: max_bytes is {max} and images in use (served or being written) hold {in_use}"
    )]
    NoRoom { needed: u64, max: u64, in_use: u64 },
    #[error("{0} is not in the cache")]
    NotFound(Digest),
    #[error("{0} is being downloaded or served; not removed")]
    InUse(Digest),
    #[error("the download of {0} stopped without a result")]
    Aborted(Digest),
}

/// Why a body stopped before its end.
#[derive(Debug, Clone)]
pub enum Interruption {
    Body(Arc<hyper::Error>),
    Stalled(Duration),
    /// Resuming failed: the server refused the connection, did not answer or answered 5xx.
    Resuming(Arc<CacheError>),
}

impl fmt::Display for Interruption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Body(e) => write!(f, "{e}"),
            Self::Stalled(t) => write!(f, "no data for {t:?}"),
            Self::Resuming(e) => write!(f, "resuming: {e}"),
        }
    }
}

impl CacheError {
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Io { action, path: path.into(), error: Arc::new(source) }
    }
}
