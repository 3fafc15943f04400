//! The cache directory and its index. Layout under `<state_dir>/images/`:
//!
//! - `sha256/<hex>`: verified images, nothing else. Only a complete, verified, fsynced file is
//!   ever renamed here, so this is the directory the boot plane serves.
//! - `tmp/<hex>.<pid>.<n>`: downloads under way, verified while written; removed on any failure.
//! - `sources/<hex>`: the URL each image came from, for `siteboot image list`. Kept out of
//!   `sha256/` because a URL may carry a query-string token that must not be served.
//!
//! Last use is kept in memory and persisted as the image file's mtime (one `futimens` per use),
//! so least-recently-used order survives a restart without a database.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use siteboot_image::{Digest, ImageRef, Verifier};
use tokio::io::{AsyncSeekExt, AsyncWriteExt, BufWriter};
use tokio::sync::watch;

use crate::CacheError;
use crate::fetch::{self, FetchSink};

/// How a download is going.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Progress {
    /// Bytes received and verified so far.
    pub bytes: u64,
    /// The image's size, when the source said.
    pub total: Option<u64>,
    /// Average bytes per second since the download started.
    pub rate: f64,
}

#[derive(Debug, Clone)]
enum Status {
    Running(Progress),
    Done(Result<(), CacheError>),
}

/// An image in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    pub digest: Digest,
    pub size: u64,
    pub last_used: SystemTime,
    /// Where it was fetched from (none if that record is missing).
    pub source: Option<String>,
}

/// The image cache: cheap to clone, one per directory and process.
#[derive(Clone)]
pub struct Cache {
    shared: Arc<Shared>,
}

struct Shared {
    dir: PathBuf,
    max_bytes: u64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    entries: HashMap<Digest, Entry>,
    /// One receiver per download under way: a request for a digest found here waits on it
    /// instead of starting another.
    in_flight: HashMap<Digest, watch::Receiver<Status>>,
    /// Bytes promised to downloads under way (their size if announced, else what they wrote).
    reserved: u64,
    next_tmp: u64,
}

struct Entry {
    size: u64,
    last_used: SystemTime,
    /// [`Lease`]s alive: an entry with any is never evicted or removed.
    leases: usize,
}

/// An image held in the cache: while it lives, the file at [`Lease::path`] is neither evicted
/// nor removed. Hold it for as long as the image is being served.
pub struct Lease {
    shared: Arc<Shared>,
    digest: Digest,
    size: u64,
}

impl Lease {
    pub fn digest(&self) -> Digest {
        self.digest
    }
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn path(&self) -> PathBuf {
        self.shared.image_path(&self.digest)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(entry) = self.shared.lock().entries.get_mut(&self.digest) {
            entry.leases -= 1;
        }
    }
}

impl Cache {
    /// Opens (creating it if needed) the cache in `dir`, normally `<state_dir>/images`, holding
    /// at most `max_bytes` of images. Temporary files left by dead processes are removed.
    pub fn open(dir: &Path, max_bytes: u64) -> Result<Self, CacheError> {
        for sub in ["sha256", "tmp", "sources"] {
            let path = dir.join(sub);
            fs::create_dir_all(&path).map_err(|e| CacheError::io("creating", &path, e))?;
        }
        remove_orphaned_temporaries(&dir.join("tmp"))?;
        let mut entries = HashMap::new();
        let images = dir.join("sha256");
        let listing = fs::read_dir(&images).map_err(|e| CacheError::io("reading", &images, e))?;
        for item in listing {
            let item = item.map_err(|e| CacheError::io("reading", &images, e))?;
            // Anything that is not named by a digest was not put there by the cache: ignored.
            let Some(digest) = item.file_name().to_str().and_then(|n| Digest::from_hex(n).ok())
            else {
                continue;
            };
            let meta = item.metadata().map_err(|e| CacheError::io("reading", item.path(), e))?;
            let last_used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            entries.insert(digest, Entry { size: meta.len(), last_used, leases: 0 });
        }
        let state = Mutex::new(State { entries, ..State::default() });
        Ok(Self { shared: Arc::new(Shared { dir: dir.to_owned(), max_bytes, state }) })
    }

    /// The image `image` names, fetched and verified first if the cache does not hold it.
    /// Concurrent calls for one digest share one download; `progress` sees how it goes. The
    /// download runs on its own task, so a caller that gives up does not cancel it for others.
    pub async fn get(
        &self,
        image: &ImageRef,
        mut progress: impl FnMut(&Progress),
    ) -> Result<Lease, CacheError> {
        let digest = image.sha256;
        loop {
            let mut status = {
                let mut state = self.shared.lock();
                if let Some(lease) = self.shared.lease(&mut state, digest) {
                    return Ok(lease);
                }
                match state.in_flight.get(&digest) {
                    Some(status) => status.clone(),
                    None => {
                        let (tx, rx) = watch::channel(Status::Running(Progress::default()));
                        state.in_flight.insert(digest, rx.clone());
                        tokio::spawn(Shared::download(self.shared.clone(), image.clone(), tx));
                        rx
                    }
                }
            };
            loop {
                match status.borrow_and_update().clone() {
                    Status::Running(p) => progress(&p),
                    // Leased at the top of the outer loop. Should it have been evicted in
                    // between (a cache far too small for its load), it is fetched again.
                    Status::Done(Ok(())) => break,
                    Status::Done(Err(e)) => return Err(e),
                }
                if status.changed().await.is_err() {
                    return Err(CacheError::Aborted(digest));
                }
            }
        }
    }

    /// The images held, most recently used first.
    pub fn list(&self) -> Vec<ImageInfo> {
        let state = self.shared.lock();
        let mut images: Vec<ImageInfo> = state
            .entries
            .iter()
            .map(|(digest, entry)| ImageInfo {
                digest: *digest,
                size: entry.size,
                last_used: entry.last_used,
                source: fs::read_to_string(self.shared.source_path(digest))
                    .ok()
                    .map(|s| s.trim_end().to_owned()),
            })
            .collect();
        images.sort_by(|a, b| b.last_used.cmp(&a.last_used).then(a.digest.cmp(&b.digest)));
        images
    }

    /// Removes an image, unless it is being downloaded or served.
    pub fn remove(&self, digest: Digest) -> Result<(), CacheError> {
        let mut state = self.shared.lock();
        if state.in_flight.contains_key(&digest) {
            return Err(CacheError::InUse(digest));
        }
        match state.entries.get(&digest) {
            None => return Err(CacheError::NotFound(digest)),
            Some(entry) if entry.leases > 0 => return Err(CacheError::InUse(digest)),
            Some(_) => {}
        }
        self.shared.delete(&mut state, digest)
    }

    /// Bytes the cache's images take.
    pub fn used_bytes(&self) -> u64 {
        self.shared.lock().entries.values().map(|e| e.size).sum()
    }

    /// The directory of the images, each a complete, verified file named by its digest's hex:
    /// what the boot plane serves at `/images/sha256/<hex>`.
    pub fn images_dir(&self) -> PathBuf {
        self.shared.dir.join("sha256")
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the index consistent (every change is a
        // single insert or remove), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn image_path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("sha256").join(digest.hex())
    }

    fn source_path(&self, digest: &Digest) -> PathBuf {
        self.dir.join("sources").join(digest.hex())
    }

    /// A lease on `digest` if the cache holds it, marking it used.
    fn lease(self: &Arc<Self>, state: &mut State, digest: Digest) -> Option<Lease> {
        let entry = state.entries.get_mut(&digest)?;
        entry.leases += 1;
        entry.last_used = SystemTime::now();
        // Best effort: a failed touch only makes the order after a restart less exact.
        if let Ok(file) = fs::File::open(self.image_path(&digest)) {
            let _ = file.set_modified(entry.last_used);
        }
        Some(Lease { shared: self.clone(), digest, size: entry.size })
    }

    /// Unlinks an image and forgets it. Called with the lock held, so nobody leases it in
    /// between. A server that already has it open keeps reading the unlinked file.
    fn delete(&self, state: &mut State, digest: Digest) -> Result<(), CacheError> {
        let path = self.image_path(&digest);
        fs::remove_file(&path).map_err(|e| CacheError::io("removing", &path, e))?;
        state.entries.remove(&digest);
        let _ = fs::remove_file(self.source_path(&digest));
        Ok(())
    }

    /// Reserves `needed` more bytes for a download, evicting least recently used images that
    /// nobody holds. Evicts nothing unless that makes enough room.
    fn reserve(&self, needed: u64) -> Result<(), CacheError> {
        let mut state = self.lock();
        let used = state.entries.values().map(|e| e.size).sum::<u64>() + state.reserved;
        if used + needed <= self.max_bytes {
            state.reserved += needed;
            return Ok(());
        }
        let mut victims: Vec<(SystemTime, Digest, u64)> = state
            .entries
            .iter()
            .filter(|(_, e)| e.leases == 0)
            .map(|(d, e)| (e.last_used, *d, e.size))
            .collect();
        let evictable: u64 = victims.iter().map(|v| v.2).sum();
        let excess = used + needed - self.max_bytes;
        if evictable < excess {
            return Err(CacheError::NoRoom {
                needed,
                max: self.max_bytes,
                in_use: used - evictable,
            });
        }
        victims.sort();
        let mut freed = 0;
        for (_, digest, size) in victims {
            if freed >= excess {
                break;
            }
            self.delete(&mut state, digest)?;
            freed += size;
        }
        state.reserved += needed;
        Ok(())
    }

    fn release(&self, bytes: u64) {
        self.lock().reserved -= bytes;
    }

    /// The download task: fetches into a temporary file and commits it, then wakes everyone
    /// waiting. The result is published after the entry is in the index and out of
    /// `in_flight`, so no waiter can miss both.
    async fn download(self: Arc<Self>, image: ImageRef, status: watch::Sender<Status>) {
        let result = self.fetch_and_commit(&image, &status).await;
        self.lock().in_flight.remove(&image.sha256);
        status.send_replace(Status::Done(result));
    }

    async fn fetch_and_commit(
        self: &Arc<Self>,
        image: &ImageRef,
        status: &watch::Sender<Status>,
    ) -> Result<(), CacheError> {
        let digest = image.sha256;
        let tmp = {
            let mut state = self.lock();
            state.next_tmp += 1;
            let name = format!("{}.{}.{}", digest.hex(), std::process::id(), state.next_tmp);
            self.dir.join("tmp").join(name)
        };
        let file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .await
            .map_err(|e| CacheError::io("creating", &tmp, e))?;
        let temporary = Temporary(tmp.clone());
        let mut sink = Sink {
            shared: self.clone(),
            path: tmp.clone(),
            file: BufWriter::with_capacity(1 << 20, file),
            verifier: Verifier::new(),
            reserved: 0,
            total: None,
            started: Instant::now(),
            status,
        };
        let fetched = fetch::fetch(&image.url, &mut sink).await;
        let reserved = sink.reserved;
        let committed = match fetched {
            Ok(()) => self.commit(image, sink, &tmp).await,
            Err(e) => Err(e),
        };
        // The reservation becomes the entry's size on success; either way it ends here.
        self.release(reserved);
        drop(temporary);
        committed
    }

    /// Verifies, fsyncs and renames a complete download into place.
    async fn commit(
        &self,
        image: &ImageRef,
        mut sink: Sink<'_>,
        tmp: &Path,
    ) -> Result<(), CacheError> {
        let digest = image.sha256;
        sink.file.flush().await.map_err(|e| CacheError::io("writing", tmp, e))?;
        let size = sink.verifier.bytes();
        sink.verifier.check(&digest).map_err(CacheError::Mismatch)?;
        let file = sink.file.into_inner();
        file.sync_all().await.map_err(|e| CacheError::io("syncing", tmp, e))?;
        drop(file);
        let source = self.source_path(&digest);
        fs::write(&source, format!("{}\n", image.url))
            .map_err(|e| CacheError::io("writing", &source, e))?;
        let path = self.image_path(&digest);
        let mut state = self.lock();
        fs::rename(tmp, &path).map_err(|e| CacheError::io("renaming into", &path, e))?;
        // The rename is durable only once the directory is synced.
        let images = self.dir.join("sha256");
        fs::File::open(&images)
            .and_then(|d| d.sync_all())
            .map_err(|e| CacheError::io("syncing", &images, e))?;
        state.entries.insert(digest, Entry { size, last_used: SystemTime::now(), leases: 0 });
        Ok(())
    }
}

/// Removes a temporary file when dropped: a download that failed, was refused or panicked
/// leaves nothing behind (after a successful rename there is nothing left to remove).
struct Temporary(PathBuf);

impl Drop for Temporary {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Where a fetch writes: verifies and reserves room as it writes, and reports progress.
pub(crate) struct Sink<'a> {
    shared: Arc<Shared>,
    path: PathBuf,
    file: BufWriter<tokio::fs::File>,
    verifier: Verifier,
    reserved: u64,
    total: Option<u64>,
    started: Instant,
    status: &'a watch::Sender<Status>,
}

impl Sink<'_> {
    fn grow(&mut self, to: u64) -> Result<(), CacheError> {
        if to > self.shared.max_bytes {
            return Err(CacheError::TooLarge { size: to, max: self.shared.max_bytes });
        }
        if to > self.reserved {
            self.shared.reserve(to - self.reserved)?;
            self.reserved = to;
        }
        Ok(())
    }
}

impl FetchSink for Sink<'_> {
    type Error = CacheError;

    fn written(&self) -> u64 {
        self.verifier.bytes()
    }

    /// Room for all of the announced size is reserved at once.
    fn set_total(&mut self, total: u64) -> Result<(), CacheError> {
        self.total = Some(total);
        self.grow(total)
    }

    async fn write(&mut self, data: &[u8]) -> Result<(), CacheError> {
        self.grow(self.written() + data.len() as u64)?;
        self.file.write_all(data).await.map_err(|e| CacheError::io("writing", &self.path, e))?;
        self.verifier.update(data);
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-3);
        let bytes = self.written();
        self.status.send_replace(Status::Running(Progress {
            bytes,
            total: self.total,
            rate: bytes as f64 / elapsed,
        }));
        Ok(())
    }

    async fn restart(&mut self) -> Result<(), CacheError> {
        let io = |e| CacheError::io("truncating", &self.path, e);
        self.file.flush().await.map_err(io)?;
        self.file.get_mut().set_len(0).await.map_err(io)?;
        self.file.get_mut().rewind().await.map_err(io)?;
        self.verifier = Verifier::new();
        Ok(())
    }
}

/// Removes `tmp/<hex>.<pid>.<n>` files whose process is gone (a crash mid-download); those of
/// a live process (a `siteboot image pull` next to the server) are its downloads under way.
fn remove_orphaned_temporaries(tmp: &Path) -> Result<(), CacheError> {
    let listing = fs::read_dir(tmp).map_err(|e| CacheError::io("reading", tmp, e))?;
    for item in listing.flatten() {
        let name = item.file_name();
        let pid = name.to_str().and_then(|n| n.split('.').nth(1)).and_then(|p| p.parse().ok());
        let alive = pid.is_some_and(|pid: u32| Path::new("/proc").join(pid.to_string()).exists());
        if !alive {
            match fs::remove_file(item.path()) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => {
                    return Err(CacheError::io("removing", item.path(), e));
                }
                _ => {}
            }
        }
    }
    Ok(())
}
