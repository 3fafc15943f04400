//! The agent API client: one HTTPS request per connection (a ramdisk makes a handful), TLS 1.3
//! to the address on the command line, trusting only the pinned certificate ([`siteboot_tls_pin`]).
//! Nothing of the request, the token included, is written before the handshake has accepted
//! the certificate: with a wrong one, the server sees a TLS alert and no request.
//!
//! Why hyper over tokio-rustls rather than a blocking client such as ureq: the appliance already
//! builds exactly these crates (one HTTP and TLS stack to audit, no second version), they take a
//! rustls [`ServerCertVerifier`](rustls::client::danger::ServerCertVerifier) as it is, ring is
//! their only crypto (a static musl build needs no C toolchain for aws-lc), and the agent will
//! need async I/O anyway to stream images to disk while it reports progress.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::{CertificateError, ClientConfig, OtherError};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use siteboot_tls_pin::{PinMismatch, PinnedCertificate};

use crate::cmdline::{AgentUrl, Fingerprint, Token};

/// How long one request may take, connecting included.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest answer read (bootstrap data is the largest, tens of KiB).
const MAX_RESPONSE: usize = 16 * 1024 * 1024;

/// An answer from the agent API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: StatusCode,
    pub body: Bytes,
}

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("{0:?} is not an agent API path (letters, digits, '/', '-' and '_')")]
    BadPath(String),
    #[error("connecting to {url}: {source}")]
    Connect { url: AgentUrl, source: io::Error },
    /// The server is not the appliance this ramdisk was booted by: nothing was sent to it.
    #[error("{url} is not the appliance: {mismatch}; nothing was sent")]
    FingerprintMismatch { url: AgentUrl, mismatch: PinMismatch },
    #[error("TLS handshake with {url}: {source}")]
    Handshake { url: AgentUrl, source: io::Error },
    #[error("HTTP exchange with {url}: {source}")]
    Http { url: AgentUrl, source: hyper::Error },
    #[error("the answer from {url} is larger than {MAX_RESPONSE} bytes")]
    TooLarge { url: AgentUrl },
    #[error("no answer from {url} within {timeout:?}")]
    Timeout { url: AgentUrl, timeout: Duration },
}

/// A client for one appliance's agent API. Cheap to clone.
#[derive(Clone)]
pub struct AgentClient {
    url: AgentUrl,
    connector: TlsConnector,
    timeout: Duration,
}

impl AgentClient {
    /// A client for the agent API at `url` that trusts only the certificate `pin`.
    pub fn new(url: AgentUrl, pin: Fingerprint) -> Self {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = PinnedCertificate::new(pin, &provider);
        let config = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("ring supports TLS 1.3")
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        Self { url, connector: TlsConnector::from(Arc::new(config)), timeout: DEFAULT_TIMEOUT }
    }

    /// The same client with another per-request deadline.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn url(&self) -> AgentUrl {
        self.url
    }

    /// `method /agent/<path>` with the token as `Authorization: Bearer` and `json` as the body.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        token: Option<&Token>,
        json: Option<Bytes>,
    ) -> Result<Response, ClientError> {
        let valid = !path.is_empty()
            && path.bytes().all(|b| b.is_ascii_alphanumeric() || b"/-_".contains(&b));
        if !valid {
            return Err(ClientError::BadPath(path.to_owned()));
        }
        let timeout = self.timeout;
        tokio::time::timeout(timeout, self.exchange(method, path, token, json))
            .await
            .map_err(|_| ClientError::Timeout { url: self.url, timeout })?
    }

    async fn exchange(
        &self,
        method: Method,
        path: &str,
        token: Option<&Token>,
        json: Option<Bytes>,
    ) -> Result<Response, ClientError> {
        let url = self.url;
        let tcp = TcpStream::connect((url.address, url.port))
            .await
            .map_err(|source| ClientError::Connect { url, source })?;
        let _ = tcp.set_nodelay(true);
        let tls =
            self.connector.connect(ServerName::IpAddress(url.address.into()), tcp).await.map_err(
                |source| match pin_mismatch(&source) {
                    Some(mismatch) => ClientError::FingerprintMismatch { url, mismatch },
                    None => ClientError::Handshake { url, source },
                },
            )?;
        let http = |source| ClientError::Http { url, source };
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.map_err(http)?;

        let mut request = Request::builder()
            .method(method)
            .uri(format!("/agent/{path}"))
            .header(header::HOST, format!("{}:{}", url.address, url.port));
        if let Some(token) = token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {}", token.as_str()));
        }
        if json.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(Full::new(json.unwrap_or_default()))
            .expect("a checked path and a token of letters and digits make a valid request");

        let exchange = async {
            let response = sender.send_request(request).await.map_err(http)?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_RESPONSE)
                .collect()
                .await
                .map_err(|e| match e.downcast::<hyper::Error>() {
                    Ok(e) => http(*e),
                    Err(_) => ClientError::TooLarge { url },
                })?
                .to_bytes();
            Ok(Response { status, body })
        };
        let mut connection = std::pin::pin!(connection);
        tokio::select! {
            result = exchange => result,
            // The connection failed before the answer was read (an Ok end leaves the
            // exchange to report what happened).
            Err(e) = &mut connection => Err(http(e)),
        }
    }
}

/// The pin mismatch inside a handshake error, if that is what failed.
fn pin_mismatch(e: &io::Error) -> Option<PinMismatch> {
    match e.get_ref()?.downcast_ref::<rustls::Error>()? {
        rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(inner))) => {
            inner.downcast_ref::<PinMismatch>().copied()
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddr};

    use rustls::ServerConfig;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    use rustls::server::{ClientHello, ResolvesServerCert};
    use rustls::sign::CertifiedKey;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    struct Identity {
        cert: CertificateDer<'static>,
        key: rcgen::KeyPair,
    }

    fn identity() -> Identity {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        Identity { cert: cert.der().clone(), key }
    }

    /// Serves `cert` with the signing key `key` (which need not be the certificate's: rustls'
    /// own constructors would refuse that, a rogue server would not).
    #[derive(Debug)]
    struct Serve(Arc<CertifiedKey>);

    impl ResolvesServerCert for Serve {
        fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
            Some(self.0.clone())
        }
    }

    /// A TLS server on loopback that answers one request with `200 hello` and returns what it
    /// decrypted from the client (or why the handshake failed).
    async fn server(
        cert: CertificateDer<'static>,
        key: &rcgen::KeyPair,
    ) -> (AgentUrl, tokio::task::JoinHandle<Result<Vec<u8>, io::Error>>) {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = provider.key_provider.load_private_key(der).unwrap();
        let resolver = Serve(Arc::new(CertifiedKey::new(vec![cert], signing)));
        let config = ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(resolver));
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let SocketAddr::V4(addr) = listener.local_addr().unwrap() else { unreachable!() };
        let task = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await?;
            let mut tls = acceptor.accept(tcp).await?;
            let mut got = vec![0u8; 4096];
            let n = tls.read(&mut got).await?;
            got.truncate(n);
            tls.write_all(
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
            )
            .await?;
            tls.shutdown().await?;
            Ok(got)
        });
        (AgentUrl { address: *addr.ip(), port: addr.port() }, task)
    }

    fn token() -> Token {
        Token::new("s3cr3t").unwrap()
    }

    #[tokio::test]
    async fn the_pinned_certificate_is_accepted() {
        let me = identity();
        let (url, server) = server(me.cert.clone(), &me.key).await;
        let client = AgentClient::new(url, Fingerprint::of(&me.cert));
        let response = client.request(Method::GET, "v1/task", Some(&token()), None).await.unwrap();
        assert_eq!((response.status, &response.body[..]), (StatusCode::OK, &b"hello"[..]));
        let got = String::from_utf8(server.await.unwrap().unwrap()).unwrap();
        assert!(got.starts_with("GET /agent/v1/task HTTP/1.1\r\n"), "{got}");
        assert!(got.contains("authorization: Bearer s3cr3t\r\n"), "{got}");
    }

    #[tokio::test]
    async fn another_certificate_is_refused_before_anything_is_sent() {
        let (pinned, rogue) = (identity(), identity());
        let (url, server) = server(rogue.cert.clone(), &rogue.key).await;
        let client = AgentClient::new(url, Fingerprint::of(&pinned.cert));
        let e =
            client.request(Method::GET, "v1/bootstrap", Some(&token()), None).await.unwrap_err();
        match e {
            ClientError::FingerprintMismatch { mismatch, .. } => {
                assert_eq!(mismatch.pinned, Fingerprint::of(&pinned.cert));
                assert_eq!(mismatch.presented, Fingerprint::of(&rogue.cert));
            }
            other => panic!("expected a fingerprint mismatch, got {other}"),
        }
        let served = server.await.unwrap();
        assert!(served.is_err(), "the rogue server completed a handshake: {served:?}");
    }

    #[tokio::test]
    async fn the_pinned_certificate_without_its_key_is_refused() {
        let (pinned, thief) = (identity(), identity());
        // The certificate is public: a rogue server can present it, but cannot sign with its key.
        let (url, server) = server(pinned.cert.clone(), &thief.key).await;
        let client = AgentClient::new(url, Fingerprint::of(&pinned.cert));
        let e =
            client.request(Method::GET, "v1/bootstrap", Some(&token()), None).await.unwrap_err();
        assert!(matches!(e, ClientError::Handshake { .. }), "{e}");
        assert!(e.to_string().contains("Signature"), "{e}");
        let served = server.await.unwrap();
        assert!(served.is_err(), "the rogue server completed a handshake: {served:?}");
    }

    #[tokio::test]
    async fn paths_are_checked_before_connecting() {
        let url = AgentUrl { address: Ipv4Addr::LOCALHOST, port: 9 };
        let client = AgentClient::new(url, Fingerprint([0; 32]));
        for path in ["", "v1/../x", "v1/task?x", "v1/task x"] {
            let e = client.request(Method::GET, path, None, None).await.unwrap_err();
            assert!(matches!(e, ClientError::BadPath(_)), "{path}: {e}");
        }
    }
}
