//! Per-operation boot media: the deploy ramdisk's ISO, patched for each request so that its
//! kernel command line carries one operation's token, for a BMC to boot as virtual media
//! (Redfish `InsertMedia`). The token then travels inside the ISO, over HTTPS, and never in
//! clear on the provisioning segment.
//!
//! The contract with the ISO (`ramdisk.iso` of `scripts/build-ramdisk`): the file holds,
//! exactly once, a [`REGION_LEN`]-byte parameters region, the ASCII bytes [`MARKER`] followed
//! by spaces up to [`REGION_LEN`] bytes: the tail of GRUB's `linux /vmlinuz <region>` line.
//! Any other occurrence of [`MARKER`] is refused too: a second `linux` line left unpatched
//! would boot without the token. Serving replaces the region's bytes with the kernel command
//! line's words joined by single spaces and padded with spaces ([`MediaParams`]); every other
//! byte is the file's own ([`overlay`]).
//!
//! What can be is pure: finding the region in a stream of chunks ([`RegionScanner`]), rendering
//! the parameters, and overlaying them on a chunk at an offset. [`BootMedia`] does the I/O: it
//! reads the file once at start-up, keeps it open, and reads byte ranges of it for the server.

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use siteboot_ipxe::Word;

/// The length of the parameters region, in bytes.
pub const REGION_LEN: usize = 1024;

/// How the parameters region starts in the file as built; spaces fill the rest of it.
pub const MARKER: &[u8] = b"siteboot.media=unset";

/// Why the file holds no single, well-formed parameters region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    #[error(
        "no parameters region (`siteboot.media=unset` padded with spaces to {REGION_LEN} bytes): not a siteboot boot ISO"
    )]
    Missing,
    #[error(
        "the parameters region is there more than once (at bytes {first} and {second}); the ISO must hold it exactly once"
    )]
    Repeated { first: u64, second: u64 },
    #[error(
        "`siteboot.media=unset` at byte {offset} is not followed by spaces up to {REGION_LEN} bytes"
    )]
    NotPadded { offset: u64 },
}

/// Finds the parameters region in a file fed to it in chunks of any size, a marker split
/// across chunks included. Pure: [`BootMedia::open`] does the reading.
#[derive(Debug, Default)]
pub struct RegionScanner {
    /// The bytes not yet searched to the end of a region: the last `REGION_LEN - 1` bytes fed
    /// (a marker starting there may have its region's end still to come), then the new chunk.
    window: Vec<u8>,
    /// The file offset of `window[0]`.
    base: u64,
    found: Option<u64>,
}

impl RegionScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// The next bytes of the file. An error ends the scan: the file is not one to serve.
    pub fn feed(&mut self, chunk: &[u8]) -> Result<(), RegionError> {
        self.window.extend_from_slice(chunk);
        // Every marker starting before `complete` has its whole region in the window; one
        // starting later stays in the window and is found again with the next chunk.
        let complete = self.window.len().saturating_sub(REGION_LEN - 1);
        if complete == 0 {
            return Ok(());
        }
        let searched = complete + MARKER.len() - 1;
        let mut from = 0;
        while let Some(at) = find(&self.window[from..searched], MARKER) {
            self.region_at(from + at)?;
            from += at + MARKER.len();
        }
        self.window.drain(..complete);
        self.base += complete as u64;
        Ok(())
    }

    /// The end of the file: the region's offset.
    pub fn finish(self) -> Result<u64, RegionError> {
        // A marker in what is left has fewer than REGION_LEN bytes before the end of the file.
        if let Some(at) = find(&self.window, MARKER) {
            return Err(RegionError::NotPadded { offset: self.base + at as u64 });
        }
        self.found.ok_or(RegionError::Missing)
    }

    /// A marker at `window[at..]`, with its whole region in the window.
    fn region_at(&mut self, at: usize) -> Result<(), RegionError> {
        let offset = self.base + at as u64;
        let padding = &self.window[at + MARKER.len()..at + REGION_LEN];
        if padding.iter().any(|b| *b != b' ') {
            return Err(RegionError::NotPadded { offset });
        }
        if let Some(first) = self.found {
            return Err(RegionError::Repeated { first, second: offset });
        }
        self.found = Some(offset);
        Ok(())
    }
}

/// Where `needle` first occurs in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if haystack.len() < needle.len() {
        return None;
    }
    let (first, rest) = needle.split_first()?;
    let last_start = haystack.len() - needle.len();
    let mut from = 0;
    while from <= last_start {
        let at = from + haystack[from..=last_start].iter().position(|b| b == first)?;
        if &haystack[at + 1..at + needle.len()] == rest {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// Why a kernel command line cannot be written into the parameters region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    /// GRUB parses the `linux` line like a shell: quotes, `$`, `;`, `\`, `#`, braces and the
    /// like would change what the kernel gets. The word itself is left out of the error: it
    /// may be the token.
    #[error(
        "word {index} holds {character:?}, which GRUB could treat specially (allowed: A-Z a-z 0-9 . _ : / = , + @ % -)"
    )]
    Character { index: usize, character: char },
    #[error("the kernel command line is {len} bytes, more than the {REGION_LEN} the media holds")]
    TooLong { len: usize },
}

/// What a word of the parameters region may hold: characters GRUB's `linux` line passes to
/// the kernel as they are. Stricter than a [`Word`], which iPXE takes.
fn grub_safe(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"._:/=,+@%-".contains(&b)
}

/// The parameters region as served: a kernel command line, its words joined by single spaces
/// and padded with spaces to [`REGION_LEN`] bytes. Made only from words GRUB passes on
/// unchanged, so every `MediaParams` is one that can be served. It carries the operation's
/// token: `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct MediaParams(Box<[u8; REGION_LEN]>);

impl MediaParams {
    pub fn new(words: &[Word]) -> Result<Self, ParamsError> {
        for (index, word) in words.iter().enumerate() {
            if let Some(b) = word.as_str().bytes().find(|b| !grub_safe(*b)) {
                return Err(ParamsError::Character { index, character: b as char });
            }
        }
        let len =
            words.iter().map(|w| w.as_str().len()).sum::<usize>() + words.len().saturating_sub(1);
        if len > REGION_LEN {
            return Err(ParamsError::TooLong { len });
        }
        let mut region = Box::new([b' '; REGION_LEN]);
        let mut at = 0;
        for word in words {
            let word = word.as_str().as_bytes();
            region[at..at + word.len()].copy_from_slice(word);
            at += word.len() + 1;
        }
        Ok(Self(region))
    }

    pub fn as_bytes(&self) -> &[u8; REGION_LEN] {
        &self.0
    }
}

impl fmt::Debug for MediaParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MediaParams(<redacted>)")
    }
}

/// Writes over `chunk`, the file's bytes from `chunk_offset`, the part of `params` that falls in
/// it, for a parameters region at `region`.
pub fn overlay(chunk: &mut [u8], chunk_offset: u64, region: u64, params: &MediaParams) {
    let chunk_end = chunk_offset.saturating_add(chunk.len() as u64);
    let start = chunk_offset.max(region);
    let end = chunk_end.min(region.saturating_add(REGION_LEN as u64));
    if start >= end {
        return;
    }
    let (in_chunk, in_region) = ((start - chunk_offset) as usize, (start - region) as usize);
    let len = (end - start) as usize;
    chunk[in_chunk..in_chunk + len].copy_from_slice(&params.as_bytes()[in_region..in_region + len]);
}

/// Why the boot media cannot be opened or served.
#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("{}: not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error("{}: {source}", path.display())]
    Region { path: PathBuf, source: RegionError },
    /// Written over in place since it was opened: the region found then may have moved.
    /// Replacing the file (a new one renamed over it) does not count: the file opened at
    /// start-up is served until siteboot restarts.
    #[error("{}: changed since siteboot opened it; restart siteboot to serve the new one", path.display())]
    Changed { path: PathBuf },
}

/// How much of the file is read at once when it is opened.
const SCAN_CHUNK: usize = 1 << 20;

/// The boot ISO with its parameters region found: opened once, at start-up, and kept open.
#[derive(Debug)]
pub struct BootMedia {
    path: PathBuf,
    file: File,
    len: u64,
    region: u64,
    /// The file's modification time when it was scanned: a file written since is not served.
    modified: Option<SystemTime>,
}

impl BootMedia {
    /// Opens the ISO at `path` and reads it once, in chunks, to find its parameters region.
    pub fn open(path: &Path) -> Result<Self, MediaError> {
        let io = |source| MediaError::Io { path: path.to_owned(), source };
        let mut file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(MediaError::NotAFile { path: path.to_owned() });
        }
        let region_error = |source| MediaError::Region { path: path.to_owned(), source };
        let mut scanner = RegionScanner::new();
        let mut chunk = vec![0u8; SCAN_CHUNK];
        let mut len = 0u64;
        loop {
            let n = match file.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io(e)),
            };
            len += n as u64;
            scanner.feed(&chunk[..n]).map_err(region_error)?;
        }
        let region = scanner.finish().map_err(region_error)?;
        let media =
            Self { path: path.to_owned(), file, len, region, modified: meta.modified().ok() };
        // Written to while it was read: what was scanned may not be what is there.
        media.check_unchanged()?;
        Ok(media)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's length, which the patched file keeps.
    pub fn file_len(&self) -> u64 {
        self.len
    }

    /// Where the parameters region starts.
    pub fn region_offset(&self) -> u64 {
        self.region
    }

    /// Whether the open file is still the one scanned: same length, not written since. Asked
    /// before each response (one `fstat`).
    pub fn check_unchanged(&self) -> Result<(), MediaError> {
        let meta = self
            .file
            .metadata()
            .map_err(|source| MediaError::Io { path: self.path.clone(), source })?;
        if meta.len() != self.len || meta.modified().ok() != self.modified {
            return Err(MediaError::Changed { path: self.path.clone() });
        }
        Ok(())
    }

    /// `len` bytes of the patched file from `offset`: the file's own, `params` over the region.
    pub fn read_patched(
        &self,
        params: &MediaParams,
        offset: u64,
        len: usize,
    ) -> io::Result<Vec<u8>> {
        if offset.checked_add(len as u64).is_none_or(|end| end > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a range past the end of the boot media",
            ));
        }
        let mut chunk = vec![0u8; len];
        self.file.read_exact_at(&mut chunk, offset).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => {
                io::Error::new(e.kind(), "the boot media shrank while it was being sent")
            }
            _ => e,
        })?;
        overlay(&mut chunk, offset, self.region, params);
        Ok(chunk)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// A region as the ISO build writes it.
    fn blank_region() -> Vec<u8> {
        let mut region = MARKER.to_vec();
        region.resize(REGION_LEN, b' ');
        region
    }

    /// `before` bytes of filler, the blank region, `after` bytes of filler.
    fn iso(before: usize, after: usize) -> Vec<u8> {
        let mut file: Vec<u8> = (0..before).map(|i| (i % 251) as u8).collect();
        file.extend(blank_region());
        file.extend((0..after).map(|i| (i % 241) as u8));
        file
    }

    fn scan(file: &[u8], chunk: usize) -> Result<u64, RegionError> {
        let mut scanner = RegionScanner::new();
        for part in file.chunks(chunk) {
            scanner.feed(part)?;
        }
        scanner.finish()
    }

    #[test]
    fn one_region_is_found_whatever_the_chunks() {
        let file = iso(5000, 3000);
        for chunk in [1, 7, 19, 20, 21, 512, 1023, 1024, 1025, 4096, 5001, 5010, 100_000] {
            assert_eq!(scan(&file, chunk), Ok(5000), "chunks of {chunk}");
        }
        // The region alone, and at the very end of the file.
        assert_eq!(scan(&blank_region(), 1024), Ok(0));
        assert_eq!(scan(&iso(10, 0), 3), Ok(10));
    }

    #[test]
    fn a_marker_split_across_a_chunk_boundary_is_found() {
        let file = iso(1 << 20, 1 << 10);
        // Every split of the marker, and of the padding, between two reads.
        for split in 1..MARKER.len() + 3 {
            let mut scanner = RegionScanner::new();
            let cut = (1 << 20) + split;
            scanner.feed(&file[..cut]).unwrap();
            scanner.feed(&file[cut..]).unwrap();
            assert_eq!(scanner.finish(), Ok(1 << 20), "split {split} bytes into the marker");
        }
        // Split in the padding, just before the region's last byte.
        let mut scanner = RegionScanner::new();
        let cut = (1 << 20) + REGION_LEN - 1;
        scanner.feed(&file[..cut]).unwrap();
        scanner.feed(&file[cut..]).unwrap();
        assert_eq!(scanner.finish(), Ok(1 << 20));
    }

    #[test]
    fn no_region_is_missing() {
        assert_eq!(scan(&iso(0, 0)[REGION_LEN..], 64), Err(RegionError::Missing));
        assert_eq!(scan(&[0u8; 10_000], 1000), Err(RegionError::Missing));
        assert_eq!(scan(&[], 1), Err(RegionError::Missing));
        // The marker with almost the padding, then something else.
        let mut file = iso(100, 100);
        file[100 + REGION_LEN - 1] = b'x';
        assert_eq!(scan(&file, 300), Err(RegionError::NotPadded { offset: 100 }));
        // A region cut short by the end of the file.
        let file = &iso(100, 0)[..100 + REGION_LEN - 1];
        assert_eq!(scan(file, 300), Err(RegionError::NotPadded { offset: 100 }));
        assert_eq!(scan(&MARKER[..MARKER.len() - 1], 5), Err(RegionError::Missing));
    }

    #[test]
    fn two_regions_are_refused() {
        let mut file = iso(100, 50);
        file.extend(blank_region());
        file.extend([0u8; 10]);
        let second = (100 + REGION_LEN + 50) as u64;
        for chunk in [1, 1000, 1 << 16] {
            assert_eq!(
                scan(&file, chunk),
                Err(RegionError::Repeated { first: 100, second }),
                "chunks of {chunk}"
            );
        }
        // Back to back.
        let mut file = blank_region();
        file.extend(blank_region());
        assert_eq!(scan(&file, 700), Err(RegionError::Repeated { first: 0, second: 1024 }));
    }

    fn words(line: &str) -> Vec<Word> {
        line.split(' ').map(|w| Word::new(w).unwrap()).collect()
    }

    #[test]
    fn params_are_words_joined_by_spaces_and_padded() {
        let params = MediaParams::new(&words("console=ttyS0,115200 siteboot.token=0a1b")).unwrap();
        let line = b"console=ttyS0,115200 siteboot.token=0a1b";
        assert_eq!(&params.as_bytes()[..line.len()], line);
        assert!(params.as_bytes()[line.len()..].iter().all(|b| *b == b' '));
        assert_eq!(format!("{params:?}"), "MediaParams(<redacted>)");
        assert!(MediaParams::new(&[]).unwrap().as_bytes().iter().all(|b| *b == b' '));
        // Every character allowed, in one word.
        let all = "AZaz09._:/=,+@%-";
        assert!(MediaParams::new(&words(all)).is_ok());
    }

    #[test]
    fn params_that_do_not_fit_are_refused() {
        // Exactly 1024 bytes fit: words of 340, 340 and 342, and 2 spaces.
        let line = format!("{} {} {}", "a".repeat(340), "b".repeat(340), "c".repeat(342));
        let fits = MediaParams::new(&words(&line)).unwrap();
        assert_eq!(&fits.as_bytes()[..], line.as_bytes());
        let long = format!("{line} d");
        assert_eq!(MediaParams::new(&words(&long)), Err(ParamsError::TooLong { len: 1026 }));
        let one = "x".repeat(1025);
        assert_eq!(MediaParams::new(&words(&one)), Err(ParamsError::TooLong { len: 1025 }));
    }

    #[test]
    fn params_with_characters_grub_treats_specially_are_refused() {
        // Each is a valid iPXE word, but GRUB's shell-like parsing would change it.
        for bad in [';', '&', '|', '<', '>', '(', ')', '[', ']', '!', '*', '?', '~', '`', '^'] {
            let line = format!("quiet a{bad}b");
            let words = words(&line);
            assert_eq!(
                MediaParams::new(&words),
                Err(ParamsError::Character { index: 1, character: bad }),
                "{line}"
            );
        }
        let error = MediaParams::new(&words("siteboot.token=s3cr3t x;y")).unwrap_err();
        assert!(!error.to_string().contains("s3cr3t"), "{error}");
    }

    fn params() -> MediaParams {
        MediaParams::new(&words("siteboot.token=0123456789abcdef quiet")).unwrap()
    }

    #[test]
    fn overlay_writes_the_region_and_nothing_else() {
        let params = params();
        let file = iso(3000, 3000);
        let mut expected = file.clone();
        expected[3000..3000 + REGION_LEN].copy_from_slice(params.as_bytes());
        // Chunks of every size around the region's edges, at every alignment near them.
        for size in [1, 2, 100, REGION_LEN - 1, REGION_LEN, REGION_LEN + 1, 5000, file.len()] {
            for start in (2990..3010).chain(3000 + REGION_LEN - 10..3000 + REGION_LEN + 10) {
                let start = start.saturating_sub(size / 2).min(file.len() - size);
                let mut chunk = file[start..start + size].to_vec();
                overlay(&mut chunk, start as u64, 3000, &params);
                assert_eq!(chunk, &expected[start..start + size], "{size} bytes at {start}");
            }
        }
        // Chunks that end where the region starts and start where it ends are untouched.
        let mut before = file[..3000].to_vec();
        overlay(&mut before, 0, 3000, &params);
        assert_eq!(before, &file[..3000]);
        let mut after = file[3000 + REGION_LEN..].to_vec();
        overlay(&mut after, (3000 + REGION_LEN) as u64, 3000, &params);
        assert_eq!(after, &file[3000 + REGION_LEN..]);
        let mut empty = [];
        overlay(&mut empty, 3000, 3000, &params);
    }

    #[test]
    fn media_files_are_scanned_and_read_patched() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ramdisk.iso");
        // The region across the scan's 1 MiB chunk boundary.
        let at = SCAN_CHUNK - 7;
        let file = iso(at, SCAN_CHUNK);
        std::fs::write(&path, &file).unwrap();
        let media = BootMedia::open(&path).unwrap();
        assert_eq!((media.file_len(), media.region_offset()), (file.len() as u64, at as u64));
        let params = params();
        let read = media.read_patched(&params, at as u64 - 3, 10).unwrap();
        assert_eq!(&read[..3], &file[at - 3..at]);
        assert_eq!(&read[3..], &params.as_bytes()[..7]);
        let whole = media.read_patched(&params, 0, file.len()).unwrap();
        assert_eq!(&whole[at..at + REGION_LEN], params.as_bytes());
        assert!(media.read_patched(&params, 1, file.len()).is_err());
        media.check_unchanged().unwrap();

        // Written over in place: refused from then on.
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"x").unwrap();
        assert!(matches!(media.check_unchanged(), Err(MediaError::Changed { .. })));

        let errors = [
            (dir.path().join("nothing.iso"), "No such file"),
            (dir.path().to_owned(), "not a regular file"),
        ];
        for (path, why) in errors {
            let error = BootMedia::open(&path).unwrap_err().to_string();
            assert!(error.contains(why) && error.contains(&*path.to_string_lossy()), "{error}");
        }
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let error = BootMedia::open(&path).unwrap_err();
        assert!(
            matches!(&error, MediaError::Region { source: RegionError::Missing, .. }),
            "{error}"
        );
        assert!(error.to_string().starts_with(&*path.to_string_lossy()), "{error}");
    }
}
