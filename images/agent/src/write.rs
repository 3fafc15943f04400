//! Writing an image to a disk as it streams in: the image cache's fetch (`Range`/`If-Range`
//! resume, redirects, timeouts) into an [`ImageSink`] that hashes the bytes as served,
//! recognises gzip and zstd by their magic and decompresses them on the fly, and writes the
//! result from the disk's first byte. qcow2 is refused: its bytes are not a disk's.
//!
//! The digest can only be checked at the end, after the disk was written: a mismatch fails the
//! write, and the caller wipes the disk quickly ([`crate::wipe::wipe`]) so nothing
//! half-written boots.
//!
//! The disk is written with O_DIRECT (where its file system allows it) in 4 MiB chunks from
//! aligned buffers, by a thread of its own while the next chunk fills: no copy into the page
//! cache, and the download, hashing and decompression overlap the disk's work. There are three
//! chunks: when all are taken the runtime's thread waits for the disk, so a slow disk slows
//! the download instead of queueing it.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::progress::Throttle;

use siteboot_agent_api::Progress;
use siteboot_image::{Digest, ImageUrl, Mismatch, Verifier};
use siteboot_image_cache::{CacheError, FetchSink};

/// How an image's bytes are stored, told by their first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Raw,
    Gzip,
    Zstd,
}

const GZIP_MAGIC: &[u8] = &[0x1f, 0x8b];
const ZSTD_MAGIC: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];
const QCOW_MAGIC: &[u8] = b"QFI\xfb";
/// Bytes needed to tell the formats apart.
const MAGIC_LEN: usize = 4;

impl Format {
    /// The format of an image starting with `head` (at least [`MAGIC_LEN`] bytes, or all of a
    /// shorter image).
    pub fn detect(head: &[u8]) -> Result<Self, WriteError> {
        Ok(if head.starts_with(QCOW_MAGIC) {
            return Err(WriteError::Qcow2);
        } else if head.starts_with(GZIP_MAGIC) {
            Self::Gzip
        } else if head.starts_with(ZSTD_MAGIC) {
            Self::Zstd
        } else {
            Self::Raw
        })
    }
}

/// Why an image was not written (or not written whole).
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("fetching the image: {0}")]
    Fetch(#[from] CacheError),
    #[error(
        "the image is qcow2, which is not a disk's bytes; convert it with `qemu-img convert -O raw` (and compress it with gzip or zstd if you like)"
    )]
    Qcow2,
    #[error("{action} {}: {error}", device.display())]
    Io { action: &'static str, device: PathBuf, error: io::Error },
    #[error("decompressing the {format:?} image: {error}")]
    Decompress { format: Format, error: io::Error },
    #[error("the image is larger than {} ({capacity} bytes)", device.display())]
    DiskFull { device: PathBuf, capacity: u64 },
    /// The bytes were written (the disk must be wiped), but they are not the image named.
    #[error("{0}")]
    Mismatch(Mismatch),
}

/// O_DIRECT's alignment of buffers, disk offsets and lengths: 4096 covers disks with 512- and
/// 4096-byte logical blocks, and the file system blocks under a regular file.
pub(crate) const ALIGN: usize = 4096;
/// Bytes per disk write (a multiple of [`ALIGN`]): large enough that a write's fixed cost is
/// small against its bytes.
pub(crate) const CHUNK: usize = 4 << 20;
/// Chunk buffers per disk: one filling while the others are written. The download runs ahead
/// of the disk by at most this many chunks, then waits for it.
const CHUNKS: usize = 3;

/// [`CHUNK`] bytes at an [`ALIGN`]ed address, as O_DIRECT needs, to be written at `offset` (or
/// read into, [`Chunk::room`]): a `Vec` with room to start at its first aligned byte.
pub(crate) struct Chunk {
    memory: Vec<u8>,
    start: usize,
    len: usize,
    offset: u64,
}

impl Chunk {
    pub(crate) fn new() -> Self {
        let memory = vec![0; CHUNK + ALIGN];
        let start = memory.as_ptr().align_offset(ALIGN);
        Self { memory, start, len: 0, offset: 0 }
    }

    /// Copies as much of `data` as fits; returns how much that was.
    fn fill(&mut self, data: &[u8]) -> usize {
        let n = data.len().min(CHUNK - self.len);
        let at = self.start + self.len;
        self.memory[at..at + n].copy_from_slice(&data[..n]);
        self.len += n;
        n
    }

    fn bytes(&self) -> &[u8] {
        &self.memory[self.start..self.start + self.len]
    }

    /// All [`CHUNK`] bytes, to read into.
    pub(crate) fn room(&mut self) -> &mut [u8] {
        &mut self.memory[self.start..self.start + CHUNK]
    }
}

/// Opens the disk as `options` say with O_DIRECT, so its bytes are not copied into the page
/// cache (most of the agent's CPU when they were), or without where its file system refuses
/// O_DIRECT (EINVAL). Returns whether it is direct.
pub(crate) fn open_disk(path: &Path, options: &std::fs::OpenOptions) -> io::Result<(File, bool)> {
    match options.clone().custom_flags(libc::O_DIRECT).open(path) {
        Ok(file) => Ok((file, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            eprintln!(
                "siteboot-agent: {} refuses O_DIRECT ({e}): using the page cache",
                path.display()
            );
            Ok((options.open(path)?, false))
        }
        Err(e) => Err(e),
    }
}

/// Turns O_DIRECT off for `file`'s later reads and writes: for those off [`ALIGN`].
pub(crate) fn stop_direct(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL and F_SETFL take no pointers; the descriptor is open for the calls.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Writes `chunk` to its place on the disk. Only an image's last chunk can end off
/// [`ALIGN`]: on a `direct` disk its tail then goes through the page cache (O_DIRECT off for
/// the descriptor's last write), and the sync at the end writes it out with the rest.
fn write_chunk(file: &File, direct: bool, chunk: &Chunk) -> io::Result<()> {
    let data = chunk.bytes();
    let aligned = if direct { data.len() - data.len() % ALIGN } else { data.len() };
    file.write_all_at(&data[..aligned], chunk.offset)?;
    if aligned < data.len() {
        stop_direct(file)?;
        file.write_all_at(&data[aligned..], chunk.offset + aligned as u64)?;
    }
    Ok(())
}

/// The thread writing full chunks to the disk while the next one fills; it hands each chunk
/// back empty when written. It stops at its first failure, which it returns when joined.
struct Writer {
    full: Option<SyncSender<Chunk>>,
    empty: Receiver<Chunk>,
    thread: Option<JoinHandle<io::Result<File>>>,
}

impl Writer {
    /// Starts the thread; returns it and the first chunk to fill.
    fn start(file: File, direct: bool) -> io::Result<(Self, Chunk)> {
        let (full, to_write) = mpsc::sync_channel::<Chunk>(CHUNKS);
        let (written, empty) = mpsc::sync_channel(CHUNKS);
        for _ in 1..CHUNKS {
            written.send(Chunk::new()).expect("the receiver is here");
        }
        let thread = std::thread::Builder::new().name("disk-writer".into()).spawn(move || {
            for chunk in to_write {
                write_chunk(&file, direct, &chunk)?;
                // The sink may be gone (it failed): then the chunk is not needed.
                let _ = written.send(chunk);
            }
            Ok(file)
        })?;
        Ok((Self { full: Some(full), empty, thread: Some(thread) }, Chunk::new()))
    }

    /// Queues `chunk` for writing; returns an empty one, once the disk has written one.
    fn swap(&mut self, chunk: Chunk) -> io::Result<Chunk> {
        let full = self.full.as_ref().expect("the sender lives until finish or drop");
        if full.send(chunk).is_err() {
            return Err(self.stopped());
        }
        self.empty.recv().map_err(|_| self.stopped())
    }

    /// Writes `last` (if it holds bytes) and returns the disk once every chunk is written.
    fn finish(mut self, last: Chunk) -> io::Result<File> {
        let full = self.full.take().expect("the sender lives until finish or drop");
        if last.len > 0 && full.send(last).is_err() {
            return Err(self.stopped());
        }
        drop(full);
        self.join()
    }

    /// Why the thread stopped before it was told to: its failure.
    fn stopped(&mut self) -> io::Error {
        match self.join() {
            Err(e) => e,
            Ok(_) => io::Error::other("the disk writer stopped"),
        }
    }

    fn join(&mut self) -> io::Result<File> {
        let thread =
            self.thread.take().ok_or_else(|| io::Error::other("an earlier write failed"))?;
        thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }
}

impl Drop for Writer {
    /// An abandoned write (a failure, a restart): the chunks already queued are written before
    /// the disk is given up, so nothing lands on it after, say, a wipe.
    fn drop(&mut self) {
        self.full = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The disk being written from its first byte: counts bytes and refuses any beyond its
/// capacity (a regular file would grow; a block device would fail with a vaguer ENOSPC).
struct Device {
    path: PathBuf,
    /// The chunk filling; `None` only after the writer failed.
    chunk: Option<Chunk>,
    writer: Writer,
    position: u64,
    capacity: u64,
    full: bool,
}

impl Device {
    fn open(path: &Path, capacity: u64) -> Result<Self, WriteError> {
        let (file, direct) = open_disk(path, File::options().write(true)).map_err(|error| {
            WriteError::Io { action: "opening", device: path.to_owned(), error }
        })?;
        Self::new(path, file, direct, capacity)
    }

    /// The disk at `path`, open as `file` (with O_DIRECT if `direct`).
    fn new(path: &Path, file: File, direct: bool, capacity: u64) -> Result<Self, WriteError> {
        let (writer, chunk) = Writer::start(file, direct).map_err(|error| WriteError::Io {
            action: "starting a writer for",
            device: path.to_owned(),
            error,
        })?;
        Ok(Self {
            path: path.to_owned(),
            chunk: Some(chunk),
            writer,
            position: 0,
            capacity,
            full: false,
        })
    }

    /// Writes the last chunk and syncs the disk; returns the bytes written.
    fn finish(mut self) -> Result<u64, WriteError> {
        let path = &self.path;
        let io = |action| move |error| WriteError::Io { action, device: path.clone(), error };
        let last = self.chunk.take().ok_or_else(|| io("writing")(self.writer.stopped()))?;
        let file = self.writer.finish(last).map_err(io("writing"))?;
        file.sync_all().map_err(io("syncing"))?;
        Ok(self.position)
    }
}

impl Write for Device {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.position + data.len() as u64 > self.capacity {
            self.full = true;
            return Err(io::Error::new(io::ErrorKind::StorageFull, "past the disk's end"));
        }
        let Some(chunk) = self.chunk.as_mut() else { return Err(self.writer.stopped()) };
        let n = chunk.fill(data);
        self.position += n as u64;
        if chunk.len == CHUNK {
            let full = self.chunk.take().expect("filled above");
            let mut empty = self.writer.swap(full)?;
            empty.len = 0;
            empty.offset = self.position;
            self.chunk = Some(empty);
        }
        Ok(n)
    }

    /// Chunks go to the disk as they fill; [`Device::finish`] writes the last one.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Where decompressed bytes go.
enum Output {
    Raw(Device),
    Gzip(flate2::write::MultiGzDecoder<Device>),
    Zstd(zstd::stream::write::Decoder<'static, Device>),
}

impl Output {
    fn new(format: Format, device: Device) -> Result<Self, WriteError> {
        Ok(match format {
            Format::Raw => Self::Raw(device),
            Format::Gzip => Self::Gzip(flate2::write::MultiGzDecoder::new(device)),
            Format::Zstd => Self::Zstd(
                zstd::stream::write::Decoder::new(device)
                    .map_err(|error| WriteError::Decompress { format, error })?,
            ),
        })
    }

    fn format(&self) -> Format {
        match self {
            Self::Raw(_) => Format::Raw,
            Self::Gzip(_) => Format::Gzip,
            Self::Zstd(_) => Format::Zstd,
        }
    }

    fn device(&mut self) -> &mut Device {
        match self {
            Self::Raw(d) => d,
            Self::Gzip(d) => d.get_mut(),
            Self::Zstd(d) => d.get_mut(),
        }
    }

    /// Writes the decompressor's last bytes and hands back the disk.
    fn finish(self) -> Result<Device, WriteError> {
        let format = self.format();
        match self {
            Self::Raw(d) => Ok(d),
            Self::Gzip(mut d) => {
                d.try_finish().map_err(|e| device_error(d.get_mut(), format, e))?;
                d.finish().map_err(|error| WriteError::Decompress { format, error })
            }
            Self::Zstd(mut d) => {
                d.flush().map_err(|e| device_error(d.get_mut(), format, e))?;
                Ok(d.into_inner())
            }
        }
    }
}

/// Receives an image and writes it to a disk; see the module documentation.
pub struct ImageSink<F> {
    path: PathBuf,
    capacity: u64,
    /// The disk, until the first [`MAGIC_LEN`] bytes tell how to write to it.
    pending: Option<Device>,
    head: Vec<u8>,
    output: Option<Output>,
    verifier: Verifier,
    total: u64,
    throttle: Throttle,
    progress: F,
}

impl<F: FnMut(Progress) + Send> ImageSink<F> {
    /// A sink writing to `device` (a block device, or a regular file in tests) of `capacity`
    /// bytes, reporting to `progress` at most about once a second.
    pub fn open(device: &Path, capacity: u64, progress: F) -> Result<Self, WriteError> {
        Ok(Self {
            path: device.to_owned(),
            capacity,
            pending: Some(Device::open(device, capacity)?),
            head: Vec::with_capacity(MAGIC_LEN),
            output: None,
            verifier: Verifier::new(),
            total: 0,
            throttle: Throttle::new(Duration::from_secs(1)),
            progress,
        })
    }

    /// Writes `data` (served bytes) on: into the head until the format is known, then through
    /// the decompressor.
    fn put(&mut self, mut data: &[u8]) -> Result<(), WriteError> {
        if self.output.is_none() {
            let take = (MAGIC_LEN - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.head.len() < MAGIC_LEN {
                return Ok(());
            }
            self.start()?;
        }
        let output = self.output.as_mut().expect("started above");
        let format = output.format();
        let written = match output {
            Output::Raw(d) => d.write_all(data),
            Output::Gzip(d) => d.write_all(data),
            Output::Zstd(d) => d.write_all(data),
        };
        written.map_err(|error| self.failure(format, error))
    }

    /// The format is known (from the head, or the image ended before it filled): write the
    /// head through the right decompressor.
    fn start(&mut self) -> Result<(), WriteError> {
        let format = Format::detect(&self.head)?;
        let device = self.pending.take().expect("a sink starts once per attempt");
        self.output = Some(Output::new(format, device)?);
        let head = std::mem::take(&mut self.head);
        self.put(&head)
    }

    /// What a failed write to `output` means: the disk filled, it failed, or the data was bad.
    fn failure(&mut self, format: Format, error: io::Error) -> WriteError {
        let device = self.output.as_mut().expect("writing").device();
        device_error(device, format, error)
    }

    /// Ends the write: the image must have the digest `expected`; then the decompressor's last
    /// bytes are written and the disk synced. Returns the bytes written to the disk.
    pub fn finish(mut self, expected: &Digest) -> Result<u64, WriteError> {
        if self.output.is_none() {
            self.start()?;
        }
        let verifier = std::mem::take(&mut self.verifier);
        let served = Progress { done: verifier.bytes(), total: self.total };
        verifier.check(expected).map_err(WriteError::Mismatch)?;
        (self.progress)(served);
        self.output.take().expect("started above").finish()?.finish()
    }
}

impl<F: FnMut(Progress) + Send> FetchSink for ImageSink<F> {
    type Error = WriteError;

    fn written(&self) -> u64 {
        self.verifier.bytes()
    }

    fn set_total(&mut self, total: u64) -> Result<(), WriteError> {
        self.total = total;
        Ok(())
    }

    async fn write(&mut self, data: &[u8]) -> Result<(), WriteError> {
        self.put(data)?;
        self.verifier.update(data);
        if self.throttle.due(Instant::now()) {
            (self.progress)(Progress { done: self.verifier.bytes(), total: self.total });
        }
        Ok(())
    }

    async fn restart(&mut self) -> Result<(), WriteError> {
        // Whatever the decompressor holds belongs to the abandoned attempt: the disk is
        // written again from its first byte, through a new one.
        self.output = None;
        self.pending = None;
        self.pending = Some(Device::open(&self.path, self.capacity)?);
        self.head.clear();
        self.verifier = Verifier::new();
        Ok(())
    }
}

fn device_error(device: &mut Device, format: Format, error: io::Error) -> WriteError {
    if device.full {
        WriteError::DiskFull { device: device.path.clone(), capacity: device.capacity }
    } else if format == Format::Raw || error.kind() != io::ErrorKind::InvalidData {
        WriteError::Io { action: "writing", device: device.path.clone(), error }
    } else {
        WriteError::Decompress { format, error }
    }
}

/// Fetches the image `url` with the digest `expected` onto `device`; see [`ImageSink`].
pub async fn write_image<F: FnMut(Progress) + Send>(
    url: &ImageUrl,
    expected: &Digest,
    device: &Path,
    capacity: u64,
    progress: F,
) -> Result<u64, WriteError> {
    let mut sink = ImageSink::open(device, capacity, progress)?;
    siteboot_image_cache::fetch(url, &mut sink).await?;
    sink.finish(expected)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use sha2::Digest as _;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// Bytes that compress somewhat (a disk image's mix of text and noise).
    fn image(len: usize) -> Vec<u8> {
        let mut x = 0x2545_f491_u32;
        (0..len)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                if i % 3 == 0 { b'a' + (i % 26) as u8 } else { x as u8 }
            })
            .collect()
    }

    fn digest(data: &[u8]) -> Digest {
        Digest::from_bytes(sha2::Sha256::digest(data).into())
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    /// A loopback HTTP server for `body` that breaks the first full answer off after
    /// `drop_after` bytes, answers `Range` requests with 206, and records every request.
    async fn server(body: Vec<u8>, drop_after: usize) -> (ImageUrl, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/image", listener.local_addr().unwrap()).parse().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let seen = requests.clone();
        tokio::spawn(async move {
            let mut dropped = false;
            loop {
                let (mut tcp, _) = listener.accept().await.unwrap();
                let mut request = Vec::new();
                while !request.ends_with(b"\r\n\r\n") {
                    let mut byte = [0];
                    if tcp.read(&mut byte).await.unwrap() == 0 {
                        break;
                    }
                    request.push(byte[0]);
                }
                let request = String::from_utf8(request).unwrap().to_lowercase();
                seen.lock().unwrap().push(request.clone());
                let from = request
                    .lines()
                    .find_map(|l| l.strip_prefix("range: bytes="))
                    .map(|r| r.trim_end_matches('-').parse::<usize>().unwrap());
                let (head, part) = match from {
                    Some(from) => (
                        format!(
                            "HTTP/1.1 206 Partial Content\r\ncontent-length: {}\r\ncontent-range: bytes {from}-{}/{}\r\netag: \"v1\"\r\n\r\n",
                            body.len() - from,
                            body.len() - 1,
                            body.len()
                        ),
                        &body[from..],
                    ),
                    None => (
                        format!(
                            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\netag: \"v1\"\r\n\r\n",
                            body.len()
                        ),
                        &body[..],
                    ),
                };
                tcp.write_all(head.as_bytes()).await.unwrap();
                let part = if dropped { part } else { &part[..drop_after.min(part.len())] };
                dropped = true;
                let _ = tcp.write_all(part).await;
                // Dropping the connection mid-body is the interruption.
                drop(tcp);
            }
        });
        (url, requests)
    }

    fn disk(len: u64) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(len).unwrap();
        file
    }

    #[tokio::test]
    async fn a_dropped_transfer_is_resumed_and_every_format_written() {
        let raw = image(3 << 20);
        let zstd = zstd::encode_all(&raw[..], 3).unwrap();
        for (format, served) in [("raw", raw.clone()), ("gzip", gzip(&raw)), ("zstd", zstd)] {
            let (url, requests) = server(served.clone(), served.len() / 3).await;
            let disk = disk(4 << 20);
            let mut reports = Vec::new();
            let written =
                write_image(&url, &digest(&served), disk.path(), 4 << 20, |p| reports.push(p))
                    .await
                    .unwrap();
            assert_eq!(written, raw.len() as u64, "{format}");
            let on_disk = std::fs::read(disk.path()).unwrap();
            assert_eq!(&on_disk[..raw.len()], &raw[..], "{format}");
            assert!(on_disk[raw.len()..].iter().all(|b| *b == 0), "{format}");
            let requests = requests.lock().unwrap();
            assert_eq!(requests.len(), 2, "{format}: {requests:?}");
            let resumed_at = format!("range: bytes={}-", served.len() / 3);
            assert!(requests[1].contains(&resumed_at), "{format}: {requests:?}");
            let total = served.len() as u64;
            assert_eq!(reports.last(), Some(&Progress { done: total, total }), "{format}");
        }
    }

    #[tokio::test]
    async fn a_wrong_digest_fails_after_writing() {
        let raw = image(100_000);
        let (url, _) = server(raw.clone(), usize::MAX).await;
        let disk = disk(1 << 20);
        let wrong = digest(b"another image");
        let e = write_image(&url, &wrong, disk.path(), 1 << 20, |_| {}).await.unwrap_err();
        match e {
            WriteError::Mismatch(m) => assert_eq!((m.expected, m.actual), (wrong, digest(&raw))),
            other => panic!("{other}"),
        }
    }

    #[tokio::test]
    async fn qcow2_and_images_larger_than_the_disk_are_refused() {
        let mut qcow = b"QFI\xfb\0\0\0\x03".to_vec();
        qcow.extend(image(4096));
        let (url, _) = server(qcow.clone(), usize::MAX).await;
        let disk = disk(1 << 20);
        let e = write_image(&url, &digest(&qcow), disk.path(), 1 << 20, |_| {}).await.unwrap_err();
        assert!(matches!(e, WriteError::Qcow2), "{e}");
        assert!(e.to_string().contains("qemu-img convert -O raw"), "{e}");
        assert!(std::fs::read(disk.path()).unwrap().iter().all(|b| *b == 0));

        let big = gzip(&image(2 << 20));
        let (url, _) = server(big.clone(), usize::MAX).await;
        let e = write_image(&url, &digest(&big), disk.path(), 1 << 20, |_| {}).await.unwrap_err();
        assert!(matches!(e, WriteError::DiskFull { capacity: 1048576, .. }), "{e}");
    }

    /// A disk file on the machine's disk (`/var/tmp`: `/tmp` may be a file system without
    /// O_DIRECT) of `len` bytes of 0x5a, to show what was not written.
    fn marked_disk(len: usize) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        std::fs::write(file.path(), vec![0x5a; len]).unwrap();
        file
    }

    /// The image lengths that matter for aligned writes: under one block, one byte either side
    /// of a block and of a chunk, whole chunks, and chunks with an odd tail.
    const LENGTHS: [usize; 8] = [
        1,
        ALIGN - 1,
        ALIGN + 1,
        CHUNK - 1,
        CHUNK,
        CHUNK + 1,
        2 * CHUNK,
        2 * CHUNK + 3 * ALIGN + 1234,
    ];

    /// The disk holds `image` from its first byte and its own bytes after it.
    fn assert_written(disk: &Path, image: &[u8], what: &str) {
        let on_disk = std::fs::read(disk).unwrap();
        assert!(on_disk[..image.len()] == image[..], "{what}: the image's bytes differ");
        assert!(on_disk[image.len()..].iter().all(|b| *b == 0x5a), "{what}: written past the end");
    }

    #[tokio::test]
    async fn images_of_any_length_are_written_exactly_with_o_direct() {
        for len in LENGTHS {
            let raw = image(len);
            let disk = marked_disk(len + 3 * ALIGN);
            let (_, direct) = open_disk(disk.path(), File::options().write(true)).unwrap();
            assert!(direct, "/var/tmp refuses O_DIRECT: these tests need a file system with it");
            let source = tempfile::NamedTempFile::new().unwrap();
            std::fs::write(source.path(), &raw).unwrap();
            let url = format!("file://{}", source.path().display()).parse().unwrap();
            let capacity = (len + 3 * ALIGN) as u64;
            let written = write_image(&url, &digest(&raw), disk.path(), capacity, |_| {}).await;
            assert_eq!(written.unwrap(), len as u64, "{len} bytes");
            assert_written(disk.path(), &raw, &format!("{len} bytes"));
        }
    }

    #[test]
    fn a_disk_that_refuses_o_direct_is_written_through_the_page_cache() {
        // Character devices refuse O_DIRECT with EINVAL, as some file systems do.
        let (_, direct) = open_disk(Path::new("/dev/null"), File::options().write(true)).unwrap();
        assert!(!direct);
        // What is written then: the same bytes, in pieces as a decompressor hands them.
        for len in LENGTHS {
            let raw = image(len);
            let disk = marked_disk(len + 3 * ALIGN);
            let file = File::options().write(true).open(disk.path()).unwrap();
            let mut device = Device::new(disk.path(), file, false, raw.len() as u64).unwrap();
            for piece in raw.chunks(32 * 1024 + 7) {
                device.write_all(piece).unwrap();
            }
            assert_eq!(device.finish().unwrap(), len as u64);
            assert_written(disk.path(), &raw, &format!("{len} bytes, buffered"));
        }
    }

    #[test]
    fn a_disk_that_fails_its_writes_fails_the_image_with_its_error() {
        let len = (CHUNKS + 1) * CHUNK;
        let disk = marked_disk(len);
        let read_only = File::open(disk.path()).unwrap();
        let mut device = Device::new(disk.path(), read_only, true, len as u64).unwrap();
        let raw = image(len);
        // CHUNKS chunks are taken before the writer's failure can show; the next meets it.
        let error = device.write_all(&raw).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EBADF), "{error}");
    }

    #[test]
    fn formats_by_magic() {
        assert_eq!(Format::detect(&[0x1f, 0x8b, 8, 0]).unwrap(), Format::Gzip);
        assert_eq!(Format::detect(&[0x28, 0xb5, 0x2f, 0xfd]).unwrap(), Format::Zstd);
        assert_eq!(Format::detect(b"\xebc\x90\x10").unwrap(), Format::Raw);
        assert_eq!(Format::detect(b"").unwrap(), Format::Raw);
        assert!(matches!(Format::detect(b"QFI\xfb"), Err(WriteError::Qcow2)));
    }
}
