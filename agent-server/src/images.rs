//! Images for the deploy ramdisk. The appliance fetches each image once into its cache
//! (`<state_dir>/images`, [`siteboot_image_cache`]) and the ramdisk downloads it from the boot
//! plane (`/images/sha256/<hex>`): a rack imaging at once pulls the image over the site's
//! uplink once, and every copy is one the cache verified.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use siteboot_boot::Endpoints;
use siteboot_image::{Digest, ImageRef, ImageUrl};
use siteboot_image_cache::{Cache, CacheError, Lease};

use crate::Image;

/// How long a task request waits for the cache before answering "wait": a download already
/// under way keeps going on its own.
const GET_WAIT: Duration = Duration::from_secs(2);

/// Where an operation's image stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// In the cache: the ramdisk downloads it from `url`; `size` bytes (0: not known).
    Ready { url: String, size: u64 },
    /// Being fetched (or to be fetched again after `why`): ask again later.
    Fetching { why: String },
    /// It cannot be had: the operation fails with this reason.
    Failed { why: String },
}

pub struct ImageService {
    cache: Cache,
    endpoints: Endpoints,
    /// One per provisioning operation that was handed an image: while an operation holds its
    /// image, the cache never evicts it (the ramdisk may resume its download at any time).
    leases: Mutex<HashMap<String, Lease>>,
}

impl ImageService {
    pub fn new(cache: Cache, endpoints: Endpoints) -> Self {
        Self { cache, endpoints, leases: Mutex::new(HashMap::new()) }
    }

    /// Readies `image` for the provisioning operation `operation`.
    pub async fn prepare(&self, operation: &str, image: &Image) -> Readiness {
        let image = match reference(image) {
            Ok(image) => image,
            Err(why) => return Readiness::Failed { why },
        };
        match tokio::time::timeout(GET_WAIT, self.cache.get(&image, |_| {})).await {
            Ok(Ok(lease)) => {
                let url = self.endpoints.image_url(&lease.digest().hex());
                let size = lease.size();
                self.leases.lock().expect("lease lock").insert(operation.to_owned(), lease);
                Readiness::Ready { url, size }
            }
            Ok(Err(e)) => {
                let why = format!("fetching {}: {e}", image.url);
                if is_permanent(&e) {
                    Readiness::Failed { why }
                } else {
                    Readiness::Fetching { why }
                }
            }
            Err(_) => Readiness::Fetching { why: format!("fetching {}", image.url) },
        }
    }

    /// The operation ended: its image may be evicted again.
    pub fn release(&self, operation: &str) {
        self.leases.lock().expect("lease lock").remove(operation);
    }
}

/// The cache's name for `image`. Only http(s) sources: a `file://` URL would let whoever may
/// edit a Host or SitebootMachine have the appliance read its own files (the CRDs refuse it
/// too).
fn reference(image: &Image) -> Result<ImageRef, String> {
    let url: ImageUrl = image.url.parse().map_err(|e| format!("image URL {:?}: {e}", image.url))?;
    if !matches!(url, ImageUrl::Http(_)) {
        return Err(format!("image URL {:?}: only http and https are fetched", image.url));
    }
    let sha256: Digest =
        image.checksum.parse().map_err(|e| format!("image checksum {:?}: {e}", image.checksum))?;
    Ok(ImageRef { url, sha256 })
}

/// Whether trying again cannot help: the source has another image, refuses it, or it cannot
/// fit. A network failure, a busy cache or a broken transfer are worth another try.
fn is_permanent(error: &CacheError) -> bool {
    match error {
        CacheError::Mismatch(_)
        | CacheError::TooLarge { .. }
        | CacheError::BadRedirect { .. }
        | CacheError::TooManyRedirects { .. }
        | CacheError::NoRoots(_) => true,
        CacheError::Status { status, .. } => status.is_client_error(),
        CacheError::Io { .. }
        | CacheError::Connect { .. }
        | CacheError::Tls { .. }
        | CacheError::Http { .. }
        | CacheError::BadRange { .. }
        | CacheError::Timeout { .. }
        | CacheError::Dropped { .. }
        | CacheError::NoRoom { .. }
        | CacheError::NotFound(_)
        | CacheError::InUse(_)
        | CacheError::Aborted(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use sha2::Digest as _;

    use super::*;

    fn image(url: &str, checksum: &str) -> Image {
        Image {
            url: url.into(),
            checksum: checksum.into(),
            format: None,
            grow_last_partition: false,
        }
    }

    #[test]
    fn only_http_sources_with_a_sha256_are_fetched() {
        let sum = format!("sha256:{}", "ab".repeat(32));
        assert!(reference(&image("https://images.example/os.img", &sum)).is_ok());
        for (url, checksum) in [
            ("file:///etc/shadow", sum.as_str()),
            ("ftp://images.example/os.img", sum.as_str()),
            ("https://images.example/os.img", "md5:0123"),
            ("https://images.example/os.img", "sha256:AB"),
        ] {
            assert!(reference(&image(url, checksum)).is_err(), "{url} {checksum}");
        }
    }

    #[tokio::test]
    async fn a_file_source_fails_the_operation_and_is_never_read() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, b"not for hosts").unwrap();
        let digest = Digest::from_bytes(sha2::Sha256::digest(b"not for hosts").into());
        let cache = Cache::open(&dir.path().join("images"), 1 << 20).unwrap();
        let service = ImageService::new(
            cache.clone(),
            Endpoints { address: Ipv4Addr::new(10, 0, 0, 1), http_port: 8080 },
        );
        let url = format!("file://{}", secret.display());
        let readiness = service.prepare("op-1", &image(&url, &digest.to_string())).await;
        assert!(matches!(readiness, Readiness::Failed { .. }), "{readiness:?}");
        assert!(cache.list().is_empty());
    }

    #[test]
    fn a_wrong_image_fails_and_a_broken_network_is_retried() {
        let status = |code| CacheError::Status {
            url: "u".into(),
            status: http::StatusCode::from_u16(code).unwrap(),
        };
        assert!(is_permanent(&status(404)));
        assert!(!is_permanent(&status(503)));
        assert!(is_permanent(&CacheError::TooLarge { size: 2, max: 1 }));
        assert!(!is_permanent(&CacheError::NoRoom { needed: 2, max: 1, in_use: 1 }));
    }
}
