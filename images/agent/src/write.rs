//! Writing an image to a disk as it streams in: the image cache's fetch (`Range`/`If-Range`
//! resume, redirects, timeouts) into an [`ImageSink`] that hashes the bytes as served,
//! recognises gzip and zstd by their magic and decompresses them on the fly, and writes the
//! result from the disk's first byte. qcow2 is refused: its bytes are not a disk's.
//!
//! The digest can only be checked at the end, after the disk was written: a mismatch fails the
//! write, and the caller wipes the disk's ends ([`crate::wipe::wipe_ends`]) so nothing
//! half-written boots. Disk writes are blocking calls on the runtime's thread: the agent does
//! nothing else meanwhile, and a slow disk then slows the download instead of queueing it.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use crate::progress::Progress;
use crate::progress::Throttle;

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

/// The disk being written: counts bytes and refuses any beyond its capacity (a regular file
/// would grow; a block device would fail with a vaguer ENOSPC).
struct Device {
    path: PathBuf,
    file: BufWriter<File>,
    position: u64,
    capacity: u64,
    full: bool,
}

impl Device {
    fn open(path: &Path, capacity: u64) -> Result<Self, WriteError> {
        let file = File::options().write(true).open(path).map_err(|error| WriteError::Io {
            action: "opening",
            device: path.to_owned(),
            error,
        })?;
        Ok(Self {
            path: path.to_owned(),
            file: BufWriter::with_capacity(1 << 20, file),
            position: 0,
            capacity,
            full: false,
        })
    }
}

impl Write for Device {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.position + data.len() as u64 > self.capacity {
            self.full = true;
            return Err(io::Error::new(io::ErrorKind::StorageFull, "past the disk's end"));
        }
        let n = self.file.write(data)?;
        self.position += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
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
        let mut device = self.output.take().expect("started above").finish()?;
        let path = &self.path;
        let io = |action| move |error| WriteError::Io { action, device: path.clone(), error };
        device.file.flush().map_err(io("writing"))?;
        device.file.get_ref().sync_all().map_err(io("syncing"))?;
        Ok(device.position)
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

    #[test]
    fn formats_by_magic() {
        assert_eq!(Format::detect(&[0x1f, 0x8b, 8, 0]).unwrap(), Format::Gzip);
        assert_eq!(Format::detect(&[0x28, 0xb5, 0x2f, 0xfd]).unwrap(), Format::Zstd);
        assert_eq!(Format::detect(b"\xebc\x90\x10").unwrap(), Format::Raw);
        assert_eq!(Format::detect(b"").unwrap(), Format::Raw);
        assert!(matches!(Format::detect(b"QFI\xfb"), Err(WriteError::Qcow2)));
    }
}
