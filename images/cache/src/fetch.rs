//! Fetching an image into a [`Sink`]: from a local file, or over HTTP(S) with hyper and
//! rustls (the platform's root certificates, ring as the crypto provider like the rest of
//! siteboot). One connection per attempt; a body that breaks off is resumed with `Range` from
//! the last byte written, guarded by `If-Range` so a changed file restarts instead of splicing.
//! A server that goes away mid-download (the appliance restarting, say) is waited for: while
//! resuming, a refused connection or a 5xx is one more attempt, and only attempts in a row
//! that bring no byte count towards giving up.
//! The cache's store and the deploy ramdisk's disk writer are both [`FetchSink`]s.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use siteboot_image::ImageUrl;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::timeout;
use tokio_rustls::TlsConnector;

use crate::{CacheError, Interruption};

pub const MAX_REDIRECTS: u32 = 5;
/// Attempts in a row that brought no byte (a transfer that broke off at once, a connection
/// refused or a 5xx while resuming) before a download is given up; any byte resets the count.
const MAX_FRUITLESS_ATTEMPTS: u32 = 8;
/// Connecting, TLS included.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// From the request to the response headers.
const HEADERS_TIMEOUT: Duration = Duration::from_secs(30);
/// Between two pieces of the body: an image takes as long as it takes, a silent server not.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a fetch writes the bytes it receives, in order.
pub trait FetchSink: Send {
    /// The sink's own failures; a fetch's are [`CacheError`]s.
    type Error: From<CacheError> + Send;
    /// Bytes written so far: where a resumed transfer starts.
    fn written(&self) -> u64;
    /// The source announced the image's size.
    fn set_total(&mut self, total: u64) -> Result<(), Self::Error>;
    /// The next bytes.
    fn write(&mut self, data: &[u8]) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// Starts over from the first byte (a server that would not resume sent the whole image).
    fn restart(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// Fetches `url` into `sink`, resuming broken HTTP transfers.
pub async fn fetch<S: FetchSink>(url: &ImageUrl, sink: &mut S) -> Result<(), S::Error> {
    match url {
        ImageUrl::File(path) => {
            let io = |e| S::Error::from(CacheError::io("reading", path, e));
            let mut file = tokio::fs::File::open(path).await.map_err(io)?;
            sink.set_total(file.metadata().await.map_err(io)?.len())?;
            let mut buffer = vec![0; 1 << 20];
            loop {
                let n = file.read(&mut buffer).await.map_err(io)?;
                if n == 0 {
                    return Ok(());
                }
                sink.write(&buffer[..n]).await?;
            }
        }
        ImageUrl::Http(uri) => fetch_http(uri.clone(), sink).await,
    }
}

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

async fn fetch_http<S: FetchSink>(mut uri: Uri, sink: &mut S) -> Result<(), S::Error> {
    let mut redirects = 0;
    let mut resumes = 0;
    let mut fruitless = 0;
    // ETag or Last-Modified of the first answer: a resume asks for the same version.
    let mut validator: Option<HeaderValue> = None;
    loop {
        let url = uri.to_string();
        let offset = sink.written();
        let range = validator.as_ref().filter(|_| offset > 0);
        let resuming = range.is_some();
        let mut received = 0;
        let cause = match request(&uri, range.map(|v| (offset, v))).await {
            // The server went away mid-download: wait for it as for a broken transfer.
            Err(e) if resuming => Interruption::Resuming(Arc::new(e)),
            Err(e) => return Err(e.into()),
            Ok(response) if resuming && response.status().is_server_error() => {
                Interruption::Resuming(Arc::new(CacheError::Status {
                    url,
                    status: response.status(),
                }))
            }
            Ok(response) => {
                let status = response.status();
                if status.is_redirection() {
                    redirects += 1;
                    uri = redirect_target(&uri, &response)?;
                    if redirects > MAX_REDIRECTS {
                        return Err(CacheError::TooManyRedirects { url: uri.to_string() }.into());
                    }
                    continue;
                }
                let length = response
                    .headers()
                    .get(header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                match status {
                    StatusCode::OK => {
                        if offset > 0 {
                            sink.restart().await?;
                        }
                        let headers = response.headers();
                        validator = headers
                            .get(header::ETAG)
                            .or(headers.get(header::LAST_MODIFIED))
                            .cloned();
                        if let Some(length) = length {
                            sink.set_total(length)?;
                        }
                    }
                    StatusCode::PARTIAL_CONTENT if resuming => {
                        let content_range = response
                            .headers()
                            .get(header::CONTENT_RANGE)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default();
                        if !content_range.starts_with(&format!("bytes {offset}-")) {
                            return Err(CacheError::BadRange {
                                url,
                                offset,
                                content_range: content_range.to_owned(),
                            }
                            .into());
                        }
                    }
                    status => return Err(CacheError::Status { url, status }.into()),
                }
                let mut body = response.into_body();
                loop {
                    match timeout(IDLE_TIMEOUT, body.frame()).await {
                        Err(_) => break Interruption::Stalled(IDLE_TIMEOUT),
                        Ok(None) => return Ok(()),
                        Ok(Some(Err(e))) => break Interruption::Body(Arc::new(e)),
                        Ok(Some(Ok(frame))) => {
                            if let Some(data) = frame.data_ref() {
                                received += data.len();
                                sink.write(data).await?;
                            }
                        }
                    }
                }
            }
        };
        fruitless = if received > 0 { 0 } else { fruitless + 1 };
        // Resuming needs a validator: without one, bytes from a changed file could be spliced
        // onto the old ones (the digest would catch it, but only after the whole download).
        if fruitless == MAX_FRUITLESS_ATTEMPTS || validator.is_none() {
            let bytes = sink.written();
            let url = uri.to_string();
            return Err(CacheError::Dropped { url, bytes, resumes, cause }.into());
        }
        resumes += 1;
        tokio::time::sleep(backoff(fruitless)).await;
    }
}

/// The wait before the next attempt, after `fruitless` attempts in a row that brought no byte:
/// 250 ms after progress, then doubling up to 8 s (about 30 s in all before a download is given
/// up), long enough for a server to restart.
fn backoff(fruitless: u32) -> Duration {
    let doublings = fruitless.saturating_sub(1).min(5);
    Duration::from_millis(250 << doublings).min(Duration::from_secs(8))
}

/// Where a redirect points: an absolute http(s) URL, or a path on the same server. Never
/// another scheme (a `file://` would read the appliance's own disk).
fn redirect_target(
    from: &Uri,
    response: &http::Response<hyper::body::Incoming>,
) -> Result<Uri, CacheError> {
    let location = response.headers().get(header::LOCATION).and_then(|v| v.to_str().ok());
    let bad = || CacheError::BadRedirect {
        url: from.to_string(),
        location: location.unwrap_or_default().to_owned(),
    };
    let location = location.ok_or_else(bad)?;
    if location.starts_with('/') && !location.starts_with("//") {
        let parts = from.clone().into_parts();
        let mut target = http::uri::Parts::default();
        target.scheme = parts.scheme;
        target.authority = parts.authority;
        target.path_and_query = Some(location.parse().map_err(|_| bad())?);
        return Uri::from_parts(target).map_err(|_| bad());
    }
    match location.parse::<ImageUrl>() {
        Ok(ImageUrl::Http(uri)) => Ok(uri),
        _ => Err(bad()),
    }
}

/// One GET on a new connection, `Range` from `offset` if `resume` is given.
async fn request(
    uri: &Uri,
    resume: Option<(u64, &HeaderValue)>,
) -> Result<http::Response<hyper::body::Incoming>, CacheError> {
    let url = uri.to_string();
    let https = uri.scheme_str() == Some("https");
    let authority = uri.authority().expect("an ImageUrl has a host");
    let host = authority.host().trim_start_matches('[').trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });

    let connect = async {
        let tcp = TcpStream::connect((host, port))
            .await
            .map_err(|e| CacheError::Connect { url: url.clone(), error: Arc::new(e) })?;
        let _ = tcp.set_nodelay(true);
        if !https {
            return Ok::<_, CacheError>(Box::new(tcp) as Box<dyn Stream>);
        }
        let name = ServerName::try_from(host.to_owned()).map_err(|e| CacheError::Tls {
            url: url.clone(),
            error: Arc::new(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)),
        })?;
        let tls = tls_connector()?
            .connect(name, tcp)
            .await
            .map_err(|e| CacheError::Tls { url: url.clone(), error: Arc::new(e) })?;
        Ok(Box::new(tls) as Box<dyn Stream>)
    };
    let stream = timeout(CONNECT_TIMEOUT, connect).await.map_err(|_| CacheError::Timeout {
        url: url.clone(),
        phase: "connecting",
        timeout: CONNECT_TIMEOUT,
    })??;

    let http = |e| CacheError::Http { url: url.clone(), error: Arc::new(e) };
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(http)?;
    tokio::spawn(connection);
    let mut request = Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
        .header(header::HOST, authority.as_str())
        .header(header::USER_AGENT, concat!("siteboot/", env!("CARGO_PKG_VERSION")));
    if let Some((offset, validator)) = resume {
        request = request
            .header(header::RANGE, format!("bytes={offset}-"))
            .header(header::IF_RANGE, validator);
    }
    let request = request.body(Empty::<Bytes>::new()).expect("a parsed URI makes a valid request");
    timeout(HEADERS_TIMEOUT, sender.send_request(request))
        .await
        .map_err(|_| CacheError::Timeout {
            url: url.clone(),
            phase: "waiting for the response",
            timeout: HEADERS_TIMEOUT,
        })?
        .map_err(http)
}

/// TLS with the platform's root certificates (Debian's ca-certificates).
fn tls_connector() -> Result<TlsConnector, CacheError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found.errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ");
        return Err(CacheError::NoRoots(why));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports TLS 1.2 and 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}
