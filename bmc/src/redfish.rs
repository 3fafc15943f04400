//! The Redfish driver: a client for one BMC's system over hyper + rustls (ring), one
//! connection per request (a reconcile makes a handful). Authentication is a Redfish session
//! (`X-Auth-Token`, deleted when the client is finished or dropped) when the service root
//! links a session service, else basic authentication on every request. TLS trusts the
//! platform's CA certificates, or exactly one certificate when `spec.bmc` pins its SHA-256.
//!
//! What is sent and read is in [`protocol`]; when a failure is retried, in [`retry`].

pub mod protocol;
pub mod retry;

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::{CertificateError, ClientConfig, OtherError, RootCertStore};
use serde_json::Value;
use siteboot_tls_pin::Fingerprint;
use siteboot_tls_pin::{PinMismatch, PinnedCertificate};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use self::protocol::{BootOverride, BootTarget, MediaCollection, ResetType, VirtualMedia};
use self::retry::{Next, RetryPolicy};
use crate::{
    BmcDriver, BmcError, BootMode, BoundCredentials, BoxFuture, Identity, PowerState,
    RedfishAddress, Transport,
};

/// How long one request may take, connecting and TLS included.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);
/// The largest answer read; Redfish resources are a few KiB.
const MAX_RESPONSE: usize = 4 * 1024 * 1024;
const SERVICE_ROOT: &str = "/redfish/v1/";

/// How requests authenticate, decided on first use.
#[derive(Clone)]
enum Auth {
    Basic,
    Session { token: HeaderValue },
}

/// A client for the system its credentials are bound to.
pub struct RedfishClient {
    bound: BoundCredentials,
    /// `None` for `redfish+http://`.
    tls: Option<TlsConnector>,
    timeout: Duration,
    retry: RetryPolicy,
    auth: tokio::sync::Mutex<Option<Auth>>,
    /// The session to delete on drop, if [`RedfishClient::finish`] was not awaited.
    open_session: Arc<Mutex<Option<(HeaderValue, String)>>>,
}

impl RedfishClient {
    /// A client for the BMC `bound` names, the only one its credentials go to; with a pin,
    /// TLS trusts only that certificate, else the platform's CA certificates.
    pub fn new(bound: BoundCredentials) -> Result<Self, BmcError> {
        let tls = match bound.address().transport {
            Transport::Http => None,
            Transport::Https => Some(tls_connector(bound.address(), bound.pin())?),
        };
        Ok(Self {
            bound,
            tls,
            timeout: DEFAULT_TIMEOUT,
            retry: RetryPolicy::default(),
            auth: tokio::sync::Mutex::new(None),
            open_session: Arc::default(),
        })
    }

    /// The same client with another per-request deadline and retry policy.
    pub fn with_limits(mut self, timeout: Duration, retry: RetryPolicy) -> Self {
        self.timeout = timeout;
        self.retry = retry;
        self
    }

    pub fn address(&self) -> &RedfishAddress {
        self.bound.address()
    }

    /// The system resource.
    pub async fn system(&self) -> Result<Value, BmcError> {
        self.get(&self.address().system).await
    }

    pub async fn power(&self) -> Result<PowerState, BmcError> {
        protocol::power_state(&self.system().await?).map_err(protocol_error)
    }

    pub async fn boot_override(&self) -> Result<BootOverride, BmcError> {
        Ok(protocol::boot_override(&self.system().await?))
    }

    pub async fn reset(&self, reset: ResetType) -> Result<(), BmcError> {
        let path = protocol::reset_path(&self.address().system);
        self.call(Method::POST, &path, Some(protocol::reset_body(reset)), false).await.map(drop)
    }

    /// Makes the next boot, only that one, from `target`.
    pub async fn boot_once(
        &self,
        target: BootTarget,
        mode: Option<BootMode>,
    ) -> Result<(), BmcError> {
        let body = protocol::boot_once_body(target, mode);
        self.call(Method::PATCH, &self.address().system, Some(body), true).await.map(drop)
    }

    /// The system's virtual CD: the first virtual media device that takes a CD or DVD image,
    /// with its path.
    pub async fn virtual_cd(&self) -> Result<(String, VirtualMedia), BmcError> {
        let system = self.system().await?;
        let collection = match protocol::virtual_media_path(&system) {
            Some(MediaCollection::Here(path)) => path,
            Some(MediaCollection::Manager(manager)) => {
                protocol::manager_virtual_media_path(&self.get(&manager).await?)
                    .ok_or(BmcError::NoVirtualMedia("the BMC's manager has no VirtualMedia"))?
            }
            None => return Err(BmcError::NoVirtualMedia("the BMC offers none for the system")),
        };
        let members = protocol::members(&self.get(&collection).await?).map_err(protocol_error)?;
        for path in members {
            let media = protocol::virtual_media(&path, &self.get(&path).await?);
            if media.takes_cd {
                return Ok((path, media));
            }
        }
        Err(BmcError::NoVirtualMedia("none of the BMC's virtual media takes a CD image"))
    }

    /// Inserts the image at `url` into the virtual CD (ejecting what it holds first: many BMCs
    /// refuse to insert into a full drive). With `certificate` (PEM), a BMC that can check
    /// its image server's certificate is made to trust exactly that one first; returns
    /// whether it checks.
    pub async fn insert_cd(&self, url: &str, certificate: Option<&str>) -> Result<bool, BmcError> {
        let (path, cd) = self.virtual_cd().await?;
        let checks = match (certificate, &cd.certificates) {
            (Some(pem), Some(certificates)) => {
                self.trust_only(certificates, pem).await?;
                if !cd.verifies {
                    let body = protocol::verify_certificate_body();
                    self.call(Method::PATCH, &path, Some(body), true).await?;
                }
                true
            }
            _ => cd.verifies,
        };
        if cd.inserted {
            self.call(Method::POST, &cd.eject, Some(serde_json::json!({})), false).await?;
        }
        let body = protocol::insert_media_body(url);
        self.call(Method::POST, &cd.insert, Some(body), false).await?;
        Ok(checks)
    }

    /// Makes `pem` the one certificate in the collection at `certificates`.
    async fn trust_only(&self, certificates: &str, pem: &str) -> Result<(), BmcError> {
        let members = protocol::members(&self.get(certificates).await?).map_err(protocol_error)?;
        let mut held = false;
        for member in members {
            if protocol::holds_certificate(&self.get(&member).await?, pem) {
                held = true;
            } else {
                self.call(Method::DELETE, &member, None, true).await?;
            }
        }
        if !held {
            let body = protocol::certificate_body(pem);
            self.call(Method::POST, certificates, Some(body), false).await?;
        }
        Ok(())
    }

    /// Ejects the virtual CD, if it holds anything.
    pub async fn eject_cd(&self) -> Result<(), BmcError> {
        let (_, cd) = self.virtual_cd().await?;
        if !cd.inserted {
            return Ok(());
        }
        self.call(Method::POST, &cd.eject, Some(serde_json::json!({})), false).await.map(drop)
    }

    /// The system's UUID and the MACs of its EthernetInterfaces.
    pub async fn identity(&self) -> Result<Identity, BmcError> {
        let system = self.system().await?;
        let uuid = protocol::system_uuid(&system).map_err(protocol_error)?;
        let mut macs = Vec::new();
        if let Some(path) = protocol::ethernet_interfaces_path(&system) {
            let collection = self.get(&path).await?;
            for member in protocol::members(&collection).map_err(protocol_error)? {
                let nic = self.get(&member).await?;
                macs.push(protocol::mac_address(&nic).map_err(protocol_error)?);
            }
        }
        Ok(Identity { uuid, macs })
    }

    /// Deletes the session, if one was opened.
    pub async fn finish(&self) {
        let session = self.open_session.lock().expect("not poisoned").take();
        if let Some((token, location)) = session {
            let _ =
                self.send(Method::DELETE, &location, None, Some(&Auth::Session { token })).await;
        }
        *self.auth.lock().await = None;
    }

    async fn get(&self, path: &str) -> Result<Value, BmcError> {
        self.call(Method::GET, path, None, true).await
    }

    /// An authenticated request, retried per [`retry::after_failure`]; a session the BMC
    /// forgot (401) is opened again once. Returns the answer's JSON (`Null` when empty).
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        idempotent: bool,
    ) -> Result<Value, BmcError> {
        let mut renewed = false;
        loop {
            let auth = self.authenticate().await?;
            let answer = self
                .with_retries(idempotent, || {
                    self.send(method.clone(), path, body.as_ref(), Some(&auth))
                })
                .await?;
            let (status, bytes) = answer;
            if status == StatusCode::UNAUTHORIZED
                && matches!(auth, Auth::Session { .. })
                && !renewed
            {
                renewed = true;
                *self.auth.lock().await = None;
                continue;
            }
            return self.check(path, status, &bytes);
        }
    }

    /// The answer's JSON if `status` is a success, else what it means.
    fn check(&self, path: &str, status: StatusCode, bytes: &[u8]) -> Result<Value, BmcError> {
        match status {
            s if s.is_success() => {
                if bytes.iter().all(u8::is_ascii_whitespace) {
                    return Ok(Value::Null);
                }
                serde_json::from_slice(bytes).map_err(|e| {
                    BmcError::Protocol(format!("{path}: the answer is not JSON: {e}").into())
                })
            }
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                Err(BmcError::Unauthorized { address: self.address().authority() })
            }
            StatusCode::NOT_FOUND => Err(BmcError::NotFound { path: path.into() }),
            s => Err(BmcError::Rejected {
                path: path.into(),
                message: protocol::error_message(s, bytes).into(),
            }),
        }
    }

    /// How requests authenticate: decided once, from the service root (which needs none).
    async fn authenticate(&self) -> Result<Auth, BmcError> {
        let mut auth = self.auth.lock().await;
        if let Some(auth) = auth.as_ref() {
            return Ok(auth.clone());
        }
        let (status, root) =
            self.with_retries(true, || self.send(Method::GET, SERVICE_ROOT, None, None)).await?;
        let root = self.check(SERVICE_ROOT, status, &root)?;
        let decided = match protocol::sessions_path(&root) {
            None => Auth::Basic,
            Some(sessions) => self.open_session(&sessions).await?,
        };
        *auth = Some(decided.clone());
        Ok(decided)
    }

    async fn open_session(&self, sessions: &str) -> Result<Auth, BmcError> {
        let body = protocol::session_body(self.bound.credentials());
        let (status, bytes, headers) = self
            .with_retries(false, || async {
                let (status, bytes, headers) =
                    self.exchange(Method::POST, sessions, Some(&body), None).await?;
                server_error(sessions, status, &bytes)?;
                Ok((status, bytes, headers))
            })
            .await?;
        // A session service that does not take this POST: fall back to basic authentication.
        if matches!(status, StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED) {
            return Ok(Auth::Basic);
        }
        self.check(sessions, status, &bytes)?;
        let token = headers.get("x-auth-token").cloned().ok_or(BmcError::Protocol(
            format!("{sessions}: the new session has no X-Auth-Token").into(),
        ))?;
        let location = headers
            .get(header::LOCATION)
            .and_then(|l| l.to_str().ok())
            .map(protocol::location_path);
        if let Some(location) = &location {
            *self.open_session.lock().expect("not poisoned") =
                Some((token.clone(), location.clone()));
        }
        Ok(Auth::Session { token })
    }

    /// `attempt` until it succeeds or [`retry::after_failure`] gives up; the error carries how
    /// many attempts were made.
    async fn with_retries<T, F, Fut>(&self, idempotent: bool, mut attempt: F) -> Result<T, BmcError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, BmcError>>,
    {
        let mut made = 0;
        loop {
            made += 1;
            let error = match attempt().await {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            match retry::after_failure(&self.retry, made, idempotent, &error) {
                Next::RetryAfter(delay) => {
                    tracing::debug!(bmc = %self.address(), attempt = made, error = %error, "retrying in {delay:?}");
                    tokio::time::sleep(delay).await;
                }
                Next::GiveUp => return Err(error.with_attempts(made)),
            }
        }
    }

    /// One request; a 5xx answer counts as a failure (so it can be retried).
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        auth: Option<&Auth>,
    ) -> Result<(StatusCode, Bytes), BmcError> {
        let (status, bytes, _) = self.exchange(method, path, body, auth).await?;
        server_error(path, status, &bytes)?;
        Ok((status, bytes))
    }

    /// One request on a new connection, within the timeout.
    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        auth: Option<&Auth>,
    ) -> Result<(StatusCode, Bytes, http::HeaderMap), BmcError> {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, self.address().authority())
            .header(header::ACCEPT, "application/json")
            .header("OData-Version", "4.0");
        match auth {
            None => {}
            Some(Auth::Basic) => {
                let credentials = self.bound.credentials();
                let pair = format!("{}:{}", credentials.username(), credentials.password());
                let encoded = base64::engine::general_purpose::STANDARD.encode(pair);
                request = request.header(header::AUTHORIZATION, format!("Basic {encoded}"));
            }
            Some(Auth::Session { token, .. }) => {
                request = request.header("X-Auth-Token", token.clone())
            }
        }
        let bytes = match body {
            Some(body) => {
                request = request.header(header::CONTENT_TYPE, "application/json");
                Bytes::from(serde_json::to_vec(body).expect("a JSON value serialises"))
            }
            None => Bytes::new(),
        };
        let request = request
            .body(Full::new(bytes))
            .map_err(|e| BmcError::Protocol(format!("{path} makes no request: {e}").into()))?;
        let timeout = self.timeout;
        tokio::time::timeout(timeout, self.connect_and_send(request)).await.map_err(|_| {
            BmcError::Timeout { address: self.address().authority(), after: timeout, attempts: 1 }
        })?
    }

    async fn connect_and_send(
        &self,
        request: Request<Full<Bytes>>,
    ) -> Result<(StatusCode, Bytes, http::HeaderMap), BmcError> {
        let address = self.address().authority();
        let unreachable = |reason: String| BmcError::Unreachable {
            address: address.clone(),
            attempts: 1,
            reason: reason.into(),
        };
        let tcp = TcpStream::connect((self.address().host.as_str(), self.address().port))
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => exchange_on(tcp, request, &address).await,
            Some(tls) => {
                let name = server_name(&self.address().host)?;
                let stream = tls.connect(name, tcp).await.map_err(|e| match untrusted(&e) {
                    Some(reason) => {
                        BmcError::Untrusted { address: address.clone(), reason: reason.into() }
                    }
                    None => unreachable(format!("TLS handshake: {e}")),
                })?;
                exchange_on(stream, request, &address).await
            }
        }
    }
}

impl Drop for RedfishClient {
    fn drop(&mut self) {
        // A session left open counts against the BMC's (small) session limit: delete it.
        let Some((token, location)) = self.open_session.lock().expect("not poisoned").take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let client = Self {
            bound: self.bound.clone(),
            tls: self.tls.clone(),
            timeout: self.timeout,
            retry: RetryPolicy { attempts: 1, ..self.retry },
            auth: tokio::sync::Mutex::new(None),
            open_session: Arc::default(),
        };
        runtime.spawn(async move {
            let auth = Auth::Session { token };
            let _ = client.send(Method::DELETE, &location, None, Some(&auth)).await;
        });
    }
}

/// A 5xx answer as an error (retried for idempotent requests).
fn server_error(path: &str, status: StatusCode, bytes: &[u8]) -> Result<(), BmcError> {
    if status.is_server_error() {
        return Err(BmcError::ServerError {
            path: path.into(),
            attempts: 1,
            message: protocol::error_message(status, bytes).into(),
        });
    }
    Ok(())
}

async fn exchange_on<S>(
    stream: S,
    request: Request<Full<Bytes>>,
    address: &str,
) -> Result<(StatusCode, Bytes, http::HeaderMap), BmcError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let broken =
        |e: hyper::Error| BmcError::Protocol(format!("HTTP exchange with {address}: {e}").into());
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(broken)?;
    let exchange = async {
        let response = sender.send_request(request).await.map_err(broken)?;
        let status = response.status();
        let (parts, body) = response.into_parts();
        let bytes = Limited::new(body, MAX_RESPONSE)
            .collect()
            .await
            .map_err(|e| {
                BmcError::Protocol(format!("reading the answer from {address}: {e}").into())
            })?
            .to_bytes();
        Ok((status, bytes, parts.headers))
    };
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        result = exchange => result,
        Err(e) = &mut connection => Err(broken(e)),
    }
}

fn tls_connector(
    address: &RedfishAddress,
    pin: Option<Fingerprint>,
) -> Result<TlsConnector, BmcError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports TLS 1.2 and 1.3");
    let config = match pin {
        Some(pin) => builder
            .dangerous()
            .with_custom_certificate_verifier(PinnedCertificate::new(pin, &provider))
            .with_no_client_auth(),
        None => {
            let mut roots = RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(BmcError::Untrusted {
                    address: address.authority(),
                    reason: "the platform has no CA certificates: pin the BMC's certificate in the credentials Secret's certificateFingerprint".into(),
                });
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
    };
    Ok(TlsConnector::from(Arc::new(config)))
}

fn server_name(host: &str) -> Result<ServerName<'static>, BmcError> {
    ServerName::try_from(host.to_owned())
        .map_err(|_| BmcError::Protocol(format!("{host:?} is not a TLS server name").into()))
}

/// Why the handshake refused the BMC's certificate, if that is what failed. A pin mismatch
/// names only the certificate presented (the pinned one is the operator's), so that it fits
/// in what is echoed.
fn untrusted(e: &io::Error) -> Option<String> {
    let error = e.get_ref()?.downcast_ref::<rustls::Error>()?;
    let rustls::Error::InvalidCertificate(invalid) = error else { return None };
    if let CertificateError::Other(OtherError(other)) = invalid
        && let Some(mismatch) = other.downcast_ref::<PinMismatch>()
    {
        return Some(format!("its certificate is {}, not the pinned one", mismatch.presented));
    }
    Some(error.to_string())
}

fn protocol_error(e: protocol::ProtocolError) -> BmcError {
    BmcError::Protocol(e.0.into())
}

/// [`BmcDriver`] over a [`RedfishClient`].
pub struct Redfish {
    client: RedfishClient,
    /// The firmware path of each network boot (unset: the system's own).
    boot_mode: Option<BootMode>,
}

impl Redfish {
    pub fn new(client: RedfishClient) -> Self {
        Self { client, boot_mode: None }
    }

    /// Network boots take `mode`'s firmware path.
    pub fn with_boot_mode(self, boot_mode: Option<BootMode>) -> Self {
        Self { boot_mode, ..self }
    }

    pub fn client(&self) -> &RedfishClient {
        &self.client
    }
}

impl BmcDriver for Redfish {
    fn power(&self) -> BoxFuture<'_, Result<PowerState, BmcError>> {
        Box::pin(self.client.power())
    }

    fn boot_from_network(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        Box::pin(async {
            self.client.boot_once(BootTarget::Pxe, self.boot_mode).await?;
            self.restart().await
        })
    }

    fn boot_from_disk(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        Box::pin(async {
            self.client.boot_once(BootTarget::Hdd, self.boot_mode).await?;
            self.restart().await
        })
    }

    fn boot_from_media<'a>(
        &'a self,
        url: &'a str,
        certificate: Option<&'a str>,
    ) -> BoxFuture<'a, Result<bool, BmcError>> {
        Box::pin(async move {
            let checks = self.client.insert_cd(url, certificate).await?;
            self.client.boot_once(BootTarget::Cd, self.boot_mode).await?;
            self.restart().await?;
            Ok(checks)
        })
    }

    fn eject_media(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        Box::pin(self.client.eject_cd())
    }

    fn restart(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        Box::pin(async {
            let reset = match self.client.power().await? {
                PowerState::On => ResetType::ForceRestart,
                PowerState::Off | PowerState::Unknown => ResetType::On,
            };
            self.client.reset(reset).await
        })
    }

    fn power_off(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        Box::pin(async {
            if self.client.power().await? == PowerState::Off {
                return Ok(());
            }
            self.client.reset(ResetType::ForceOff).await
        })
    }

    fn identity(&self) -> BoxFuture<'_, Result<Option<Identity>, BmcError>> {
        Box::pin(async { self.client.identity().await.map(Some) })
    }
}

#[cfg(test)]
mod tests {
    //! The client's I/O against a loopback BMC that speaks the parts of Redfish under test
    //! (sushy-tools, in `tests/tests/redfish.rs`, has no session service).

    use std::convert::Infallible;
    use std::net::{Ipv4Addr, SocketAddr};

    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use hyper::service::service_fn;
    use serde_json::json;
    use tokio::net::TcpListener;

    use super::*;
    use crate::Credentials;

    const SESSIONS: &str = "/redfish/v1/SessionService/Sessions";
    const SYSTEM: &str = "/redfish/v1/Systems/1";

    /// How the fake BMC behaves.
    #[derive(Clone, Copy, Default)]
    struct Fake {
        /// POST to the sessions collection answers 405 (basic authentication only).
        no_sessions: bool,
        /// Every session token works for one request only.
        tokens_expire: bool,
        /// The first `n` requests to the system and its reset action answer 503.
        unavailable: usize,
    }

    /// A request the fake BMC saw: method, path, and its authentication header.
    type Seen = Arc<Mutex<Vec<(Method, String, String)>>>;

    struct State {
        fake: Fake,
        seen: Seen,
        /// The tokens that work now.
        tokens: Mutex<Vec<String>>,
        /// Sessions opened so far (names the next token).
        opened: Mutex<usize>,
        failures: Mutex<usize>,
    }

    async fn serve(fake: Fake) -> (SocketAddr, Seen) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let address = listener.local_addr().unwrap();
        let seen: Seen = Arc::default();
        let state = Arc::new(State {
            fake,
            seen: seen.clone(),
            tokens: Mutex::default(),
            opened: Mutex::default(),
            failures: Mutex::new(fake.unavailable),
        });
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let state = state.clone();
                tokio::spawn(async move {
                    let service = service_fn(|request| answer(state.clone(), request));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                });
            }
        });
        (address, seen)
    }

    async fn answer(
        state: Arc<State>,
        request: Request<Incoming>,
    ) -> Result<hyper::Response<Full<Bytes>>, Infallible> {
        let (parts, body) = request.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        let path = parts.uri.path().to_owned();
        let header = |name| parts.headers.get(name).and_then(|v: &HeaderValue| v.to_str().ok());
        let auth = header("x-auth-token")
            .map(|t| format!("token {t}"))
            .or(header("authorization").map(str::to_owned))
            .unwrap_or_default();
        state.seen.lock().unwrap().push((parts.method.clone(), path.clone(), auth.clone()));
        let reply = |status: StatusCode, json: Value| {
            let mut response = hyper::Response::new(Full::new(Bytes::from(json.to_string())));
            *response.status_mut() = status;
            response
        };
        let basic =
            format!("Basic {}", base64::engine::general_purpose::STANDARD.encode("admin:secret"));
        let response = match (&parts.method, path.as_str()) {
            (&Method::GET, SERVICE_ROOT) => {
                reply(StatusCode::OK, json!({"Links": {"Sessions": {"@odata.id": SESSIONS}}}))
            }
            (&Method::POST, SESSIONS) if state.fake.no_sessions => {
                reply(StatusCode::METHOD_NOT_ALLOWED, Value::Null)
            }
            (&Method::POST, SESSIONS) => {
                let credentials: Value = serde_json::from_slice(&body).unwrap();
                if credentials != json!({"UserName": "admin", "Password": "secret"}) {
                    reply(StatusCode::UNAUTHORIZED, Value::Null)
                } else {
                    let mut opened = state.opened.lock().unwrap();
                    *opened += 1;
                    let token = format!("t{opened}");
                    state.tokens.lock().unwrap().push(token.clone());
                    let mut response = reply(StatusCode::CREATED, json!({}));
                    let location = format!("http://bmc.example{SESSIONS}/{token}");
                    response.headers_mut().insert("x-auth-token", token.parse().unwrap());
                    response.headers_mut().insert(header::LOCATION, location.parse().unwrap());
                    response
                }
            }
            (method, path) => {
                let token = header("x-auth-token").map(str::to_owned);
                let authorized = match &token {
                    Some(token) => state.tokens.lock().unwrap().contains(token),
                    None => auth == basic,
                };
                let unavailable = {
                    let mut failures = state.failures.lock().unwrap();
                    let fail = authorized && *failures > 0;
                    *failures -= usize::from(fail);
                    fail
                };
                if !authorized {
                    reply(StatusCode::UNAUTHORIZED, Value::Null)
                } else if unavailable {
                    reply(StatusCode::SERVICE_UNAVAILABLE, Value::Null)
                } else {
                    if state.fake.tokens_expire
                        && let Some(token) = token
                    {
                        state.tokens.lock().unwrap().retain(|t| *t != token);
                    }
                    match (method, path) {
                        (&Method::GET, SYSTEM) => {
                            reply(StatusCode::OK, json!({"PowerState": "On"}))
                        }
                        (&Method::DELETE, _) if path.starts_with(SESSIONS) => {
                            reply(StatusCode::NO_CONTENT, Value::Null)
                        }
                        (&Method::POST, _) if path == protocol::reset_path(SYSTEM) => {
                            reply(StatusCode::NO_CONTENT, Value::Null)
                        }
                        _ => reply(StatusCode::NOT_FOUND, Value::Null),
                    }
                }
            }
        };
        Ok(response)
    }

    fn client(address: SocketAddr, password: &str) -> RedfishClient {
        let address: RedfishAddress = format!("redfish+http://{address}{SYSTEM}").parse().unwrap();
        let retry = RetryPolicy {
            attempts: 3,
            first_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(2),
        };
        let credentials = Credentials::new("admin", password).unwrap();
        RedfishClient::new(BoundCredentials::trusted(address, None, credentials))
            .unwrap()
            .with_limits(Duration::from_secs(5), retry)
    }

    fn requests(seen: &Seen) -> Vec<(Method, String, String)> {
        seen.lock().unwrap().clone()
    }

    #[tokio::test]
    async fn a_session_is_opened_used_and_deleted() {
        let (address, seen) = serve(Fake::default()).await;
        let client = client(address, "secret");
        assert_eq!(client.power().await.unwrap(), PowerState::On);
        assert_eq!(client.power().await.unwrap(), PowerState::On);
        client.finish().await;
        let expected = [
            (Method::GET, SERVICE_ROOT.to_owned(), String::new()),
            (Method::POST, SESSIONS.to_owned(), String::new()),
            (Method::GET, SYSTEM.to_owned(), "token t1".to_owned()),
            (Method::GET, SYSTEM.to_owned(), "token t1".to_owned()),
            (Method::DELETE, format!("{SESSIONS}/t1"), "token t1".to_owned()),
        ];
        assert_eq!(requests(&seen), expected);
    }

    #[tokio::test]
    async fn a_session_the_bmc_forgot_is_opened_again_once() {
        let (address, seen) = serve(Fake { tokens_expire: true, ..Fake::default() }).await;
        let client = client(address, "secret");
        assert_eq!(client.power().await.unwrap(), PowerState::On);
        assert_eq!(client.power().await.unwrap(), PowerState::On);
        let system: Vec<String> =
            requests(&seen).into_iter().filter(|r| r.1 == SYSTEM).map(|r| r.2).collect();
        assert_eq!(system, ["token t1", "token t1", "token t2"]);
    }

    #[tokio::test]
    async fn wrong_credentials_are_unauthorized_at_the_session_service() {
        let (address, _) = serve(Fake::default()).await;
        let error = client(address, "wrong").power().await.unwrap_err();
        assert!(matches!(error, BmcError::Unauthorized { .. }), "{error}");
    }

    #[tokio::test]
    async fn without_a_session_service_every_request_carries_basic_authentication() {
        let (address, seen) = serve(Fake { no_sessions: true, ..Fake::default() }).await;
        let client = client(address, "secret");
        assert_eq!(client.power().await.unwrap(), PowerState::On);
        let last = requests(&seen).pop().unwrap();
        assert_eq!((&last.0, last.1.as_str()), (&Method::GET, SYSTEM));
        assert!(last.2.starts_with("Basic "), "{last:?}");
        let error = self::client(address, "wrong").power().await.unwrap_err();
        assert!(matches!(error, BmcError::Unauthorized { .. }), "{error}");
    }

    #[tokio::test]
    async fn a_bmc_that_never_answers_times_out_per_request_and_is_given_up() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let address = listener.local_addr().unwrap();
        // Accepts connections and holds them, reading nothing.
        let held = tokio::spawn(async move {
            let mut connections = Vec::new();
            while let Ok((tcp, _)) = listener.accept().await {
                connections.push(tcp);
            }
        });
        let retry = RetryPolicy {
            attempts: 2,
            first_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(1),
        };
        let client = client(address, "secret").with_limits(Duration::from_millis(200), retry);
        let error = client.power().await.unwrap_err();
        assert!(matches!(error, BmcError::Timeout { attempts: 2, .. }), "{error}");
        held.abort();
    }

    #[tokio::test]
    async fn a_bmc_error_is_retried_for_reads_but_a_reset_is_sent_once() {
        let (address, seen) = serve(Fake { unavailable: 1, ..Fake::default() }).await;
        let client = client(address, "secret");
        assert_eq!(client.power().await.unwrap(), PowerState::On);
        let reads = requests(&seen).iter().filter(|r| r.1 == SYSTEM).count();
        assert_eq!(reads, 2, "one 503, then the answer");

        let (address, seen) = serve(Fake { unavailable: 1, ..Fake::default() }).await;
        let client = self::client(address, "secret");
        let error = client.reset(ResetType::ForceRestart).await.unwrap_err();
        assert!(matches!(error, BmcError::ServerError { attempts: 1, .. }), "{error}");
        let resets =
            requests(&seen).iter().filter(|r| r.0 == Method::POST && r.1 != SESSIONS).count();
        assert_eq!(resets, 1, "a reset that may have happened is not repeated");
    }
}
