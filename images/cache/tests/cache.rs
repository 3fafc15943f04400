//! The image cache against a loopback HTTP server that counts requests and misbehaves on demand,
//! and against file:// sources.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest as _, Sha256};
use siteboot_image::{Digest, ImageRef};
use siteboot_image_cache::{Cache, CacheError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[derive(Clone, Copy, PartialEq)]
enum Behaviour {
    /// Answers after a pause (so concurrent clients overlap), honours `Range`, sends an ETag.
    Good,
    /// The first answer breaks off halfway through the body; later ones are good.
    DropFirst,
    /// Every answer breaks off halfway, and none has a validator to resume with.
    DropAlways,
    /// Redirects to a file:// URL.
    RedirectToFile,
    /// As `DropFirst`, and the server is then gone (its port refuses connections) for
    /// [`GONE_FOR`] before it is back, as an appliance restarting.
    GoneAfterFirst,
}

/// How long a `GoneAfterFirst` server refuses connections.
const GONE_FOR: Duration = Duration::from_millis(1500);

struct Server {
    addr: SocketAddr,
    /// The `Range` header of every request (empty if none).
    requests: Arc<Mutex<Vec<String>>>,
}

impl Server {
    async fn start(body: Vec<u8>, behaviour: Behaviour) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        tokio::spawn(async move {
            let mut listener = Some(listener);
            loop {
                let (mut stream, _) = listener.as_ref().unwrap().accept().await.unwrap();
                if behaviour == Behaviour::GoneAfterFirst && seen.lock().unwrap().is_empty() {
                    // Closed after this first answer: connections are refused until it is back.
                    let answering = listener.take();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        drop(answering);
                    });
                }
                let (body, seen) = (body.clone(), seen.clone());
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    while !head.ends_with(b"\r\n\r\n") {
                        let mut byte = [0];
                        if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    let head = String::from_utf8(head).unwrap().to_ascii_lowercase();
                    let range = head
                        .lines()
                        .find_map(|l| l.strip_prefix("range: bytes="))
                        .map(|r| r.trim_end_matches('-').parse::<usize>().unwrap());
                    let first = {
                        let mut seen = seen.lock().unwrap();
                        seen.push(range.map(|r| r.to_string()).unwrap_or_default());
                        seen.len() == 1
                    };
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let answer = match (behaviour, range) {
                        (Behaviour::RedirectToFile, _) => {
                            "HTTP/1.1 302 Found\r\nLocation: file:///etc/passwd\r\nContent-Length: 0\r\n\r\n"
                                .as_bytes()
                                .to_vec()
                        }
                        (Behaviour::DropAlways, _) => {
                            let mut a = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len())
                                .into_bytes();
                            a.extend_from_slice(&body[..body.len() / 2]);
                            a
                        }
                        (_, Some(from)) => {
                            let mut a = format!(
                                "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {from}-{}/{}\r\nETag: \"v1\"\r\n\r\n",
                                body.len() - from,
                                body.len() - 1,
                                body.len()
                            )
                            .into_bytes();
                            a.extend_from_slice(&body[from..]);
                            a
                        }
                        (_, None) => {
                            let mut a = format!(
                                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nETag: \"v1\"\r\n\r\n",
                                body.len()
                            )
                            .into_bytes();
                            let drops = matches!(behaviour, Behaviour::DropFirst | Behaviour::GoneAfterFirst);
                            if drops && first {
                                a.extend_from_slice(&body[..body.len() / 2]);
                            } else {
                                a.extend_from_slice(&body);
                            }
                            a
                        }
                    };
                    let _ = stream.write_all(&answer).await;
                    // Closing here is the "dropped connection" when the body is short.
                });
                if listener.is_none() {
                    tokio::time::sleep(GONE_FOR).await;
                    listener = Some(TcpListener::bind(addr).await.unwrap());
                }
            }
        });
        Self { addr, requests }
    }

    fn url(&self) -> String {
        format!("http://{}/images/test.raw", self.addr)
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

fn digest_of(data: &[u8]) -> Digest {
    Digest::from_bytes(Sha256::digest(data).into())
}

fn image(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn reference(url: &str, digest: Digest) -> ImageRef {
    ImageRef { url: url.parse().unwrap(), sha256: digest }
}

/// The files in a cache subdirectory.
fn files(dir: &Path, sub: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir.join(sub))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn fetched_once_verified_then_hit() {
    let body = image(3 << 20, 1);
    let server = Server::start(body.clone(), Behaviour::Good).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 1 << 30).unwrap();
    let image = reference(&server.url(), digest_of(&body));

    let mut last = None;
    let lease = cache.get(&image, |p| last = Some(*p)).await.unwrap();
    assert_eq!(std::fs::read(lease.path()).unwrap(), body);
    assert_eq!(lease.path(), dir.path().join("sha256").join(image.sha256.hex()));
    let last = last.unwrap();
    assert_eq!((last.bytes, last.total), (body.len() as u64, Some(body.len() as u64)));
    drop(lease);

    let again = cache.get(&image, |_| {}).await.unwrap();
    assert_eq!(again.size(), body.len() as u64);
    assert_eq!(server.requests().len(), 1, "the second get is a hit");
    let listed = cache.list();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].digest, image.sha256);
    assert_eq!(listed[0].source.as_deref(), Some(server.url().as_str()));
    assert!(files(dir.path(), "tmp").is_empty());
}

#[tokio::test]
async fn concurrent_first_requests_share_one_download() {
    let body = image(1 << 20, 2);
    let server = Server::start(body.clone(), Behaviour::Good).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 1 << 30).unwrap();
    let image = reference(&server.url(), digest_of(&body));
    let (a, b, c) = tokio::join!(
        cache.get(&image, |_| {}),
        cache.get(&image, |_| {}),
        cache.get(&image, |_| {})
    );
    let (a, b, c) = (a.unwrap(), b.unwrap(), c.unwrap());
    assert_eq!(server.requests().len(), 1, "one upstream GET for three requests");
    assert_eq!(a.path(), b.path());
    assert_eq!(std::fs::read(c.path()).unwrap(), body);
}

#[tokio::test]
async fn wrong_digest_is_discarded() {
    let body = image(100_000, 3);
    let server = Server::start(body.clone(), Behaviour::Good).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 1 << 30).unwrap();
    let image = reference(&server.url(), digest_of(b"another image"));
    let e = cache.get(&image, |_| {}).await.err().unwrap();
    let CacheError::Mismatch(m) = e else { panic!("{e}") };
    assert_eq!((m.expected, m.actual, m.bytes), (image.sha256, digest_of(&body), 100_000));
    assert!(cache.list().is_empty());
    assert_eq!(cache.used_bytes(), 0);
    for sub in ["sha256", "tmp", "sources"] {
        assert!(files(dir.path(), sub).is_empty(), "{sub}: {:?}", files(dir.path(), sub));
    }
    // Not cached as a failure either: a later request tries again.
    assert!(cache.get(&image, |_| {}).await.is_err());
    assert_eq!(server.requests().len(), 2);
}

#[tokio::test]
async fn dropped_connection_is_resumed_with_range() {
    fetched_whole_after_one_resume(Behaviour::DropFirst, 4).await;
}

/// The server breaks off the transfer and is gone for a while (an appliance restarting): the
/// attempts to resume are refused, and the download waits for it instead of failing. The
/// refused attempts never reach it: it sees the first request, then the resume.
#[tokio::test]
async fn a_server_gone_mid_download_is_waited_for_and_resumed() {
    fetched_whole_after_one_resume(Behaviour::GoneAfterFirst, 6).await;
}

/// Fetches an image from a server that `behaves` so: the cache holds it whole, and the server
/// saw two requests, the second resuming with `Range` from where the first broke off.
async fn fetched_whole_after_one_resume(behaves: Behaviour, seed: u8) {
    let body = image(2 << 20, seed);
    let server = Server::start(body.clone(), behaves).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 1 << 30).unwrap();
    let image = reference(&server.url(), digest_of(&body));
    let lease = cache.get(&image, |_| {}).await.unwrap();
    assert_eq!(std::fs::read(lease.path()).unwrap(), body);
    let requests = server.requests();
    assert_eq!(requests.len(), 2, "{requests:?}");
    assert_eq!(requests[0], "");
    let from: usize = requests[1].parse().unwrap();
    assert!(from > 0 && from <= body.len() / 2, "resumed from {from}");
}

#[tokio::test]
async fn dropped_connection_without_validator_fails_and_stores_nothing() {
    let body = image(1 << 20, 5);
    let server = Server::start(body.clone(), Behaviour::DropAlways).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 1 << 30).unwrap();
    let image = reference(&server.url(), digest_of(&body));
    let e = cache.get(&image, |_| {}).await.err().unwrap();
    assert!(matches!(e, CacheError::Dropped { resumes: 0, .. }), "{e}");
    assert!(files(dir.path(), "sha256").is_empty());
    assert!(files(dir.path(), "tmp").is_empty());
}

#[tokio::test]
async fn redirect_to_another_scheme_is_refused() {
    let server = Server::start(Vec::new(), Behaviour::RedirectToFile).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 1 << 30).unwrap();
    let image = reference(&server.url(), digest_of(b""));
    let e = cache.get(&image, |_| {}).await.err().unwrap();
    assert!(
        matches!(&e, CacheError::BadRedirect { location, .. } if location == "file:///etc/passwd"),
        "{e}"
    );
}

#[tokio::test]
async fn image_larger_than_the_cache_is_refused_before_download() {
    let body = image(1000, 6);
    let server = Server::start(body.clone(), Behaviour::Good).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 999).unwrap();
    let e = cache.get(&reference(&server.url(), digest_of(&body)), |_| {}).await.err().unwrap();
    assert!(matches!(e, CacheError::TooLarge { size: 1000, max: 999 }), "{e}");
    assert!(files(dir.path(), "tmp").is_empty());
}

/// Three 100-byte images as files, and their references.
fn file_images(dir: &Path) -> Vec<ImageRef> {
    (0..3)
        .map(|i| {
            let body = image(100, 10 + i);
            let path = dir.join(format!("image-{i}.raw"));
            std::fs::write(&path, &body).unwrap();
            reference(&format!("file://{}", path.display()), digest_of(&body))
        })
        .collect()
}

#[tokio::test]
async fn least_recently_used_is_evicted_never_one_in_use() {
    let sources = tempfile::tempdir().unwrap();
    let [a, b, c]: [ImageRef; 3] = file_images(sources.path()).try_into().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 250).unwrap();
    drop(cache.get(&a, |_| {}).await.unwrap());
    drop(cache.get(&b, |_| {}).await.unwrap());
    drop(cache.get(&a, |_| {}).await.unwrap()); // a is now more recent than b
    let c_lease = cache.get(&c, |_| {}).await.unwrap();
    let held: Vec<Digest> = cache.list().iter().map(|i| i.digest).collect();
    assert_eq!(held, [c.sha256, a.sha256], "b, the least recently used, was evicted");
    assert!(!dir.path().join("sha256").join(b.sha256.hex()).exists());

    // a and c both held: there is no room for b, and nothing held is evicted for it.
    let a_lease = cache.get(&a, |_| {}).await.unwrap();
    let e = cache.get(&b, |_| {}).await.err().unwrap();
    assert!(matches!(e, CacheError::NoRoom { needed: 100, max: 250, in_use: 200 }), "{e}");
    assert_eq!(std::fs::read(a_lease.path()).unwrap().len(), 100);
    assert_eq!(std::fs::read(c_lease.path()).unwrap().len(), 100);
    assert!(files(dir.path(), "tmp").is_empty());

    // Released, the least recently used of them (c, leased before a) makes room.
    drop((a_lease, c_lease));
    cache.get(&b, |_| {}).await.unwrap();
    let held: Vec<Digest> = cache.list().iter().map(|i| i.digest).collect();
    assert_eq!(held, [b.sha256, a.sha256]);
}

#[tokio::test]
async fn the_index_and_use_order_survive_a_restart() {
    let sources = tempfile::tempdir().unwrap();
    let [a, b, _]: [ImageRef; 3] = file_images(sources.path()).try_into().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 1000).unwrap();
    drop(cache.get(&b, |_| {}).await.unwrap());
    drop(cache.get(&a, |_| {}).await.unwrap());
    drop(cache);
    // A temporary file of a dead process is cleaned up on open; it was never served.
    std::fs::write(dir.path().join("tmp").join(format!("{}.999999999.1", a.sha256.hex())), "x")
        .unwrap();

    let cache = Cache::open(dir.path(), 1000).unwrap();
    let listed = cache.list();
    let order: Vec<Digest> = listed.iter().map(|i| i.digest).collect();
    assert_eq!(order, [a.sha256, b.sha256]);
    assert_eq!(listed[0].size, 100);
    assert_eq!(listed[0].source.as_deref(), Some(a.url.to_string().as_str()));
    assert!(files(dir.path(), "tmp").is_empty());
}

#[tokio::test]
async fn remove_refuses_what_is_in_use() {
    let sources = tempfile::tempdir().unwrap();
    let [a, b, _]: [ImageRef; 3] = file_images(sources.path()).try_into().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 1000).unwrap();
    let lease = cache.get(&a, |_| {}).await.unwrap();
    assert!(matches!(cache.remove(a.sha256), Err(CacheError::InUse(d)) if d == a.sha256));
    assert!(matches!(cache.remove(b.sha256), Err(CacheError::NotFound(d)) if d == b.sha256));
    drop(lease);
    cache.remove(a.sha256).unwrap();
    assert!(cache.list().is_empty());
    assert!(files(dir.path(), "sha256").is_empty());
    assert!(files(dir.path(), "sources").is_empty());
}

#[tokio::test]
async fn missing_file_source_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::open(dir.path(), 1000).unwrap();
    let e = cache.get(&reference("file:///nonexistent/image.raw", digest_of(b"")), |_| {}).await;
    let e = e.err().unwrap();
    assert!(
        matches!(&e, CacheError::Io { path, .. } if path == Path::new("/nonexistent/image.raw")),
        "{e}"
    );
    assert!(files(dir.path(), "tmp").is_empty());
}
