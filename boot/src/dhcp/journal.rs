//! The lease journal: lease changes appended to a file and synced before a client is told.
//!
//! Each line is `<crc32 hex> <json record>\n`. A crash can leave at most a torn last line, which
//! start-up detects (no newline or a bad checksum) and cuts off; it held a change whose ACK was
//! never sent. When the file grows past a few times the live state, it is rewritten: the live
//! records go to a temporary file that is synced and renamed over the journal, so at every moment
//! one complete file exists. An exclusive lock keeps a second siteboot off the same file.
//!
//! A failed append is cut off again: whatever part of it reached the file would otherwise join
//! the next record's line, and replay would drop that good record as corrupt.
//!
//! The file grows in steps of [`GROWTH`] zero bytes that records then overwrite, and replay
//! ignores the zeros after the last record. An fdatasync that changes a file's size must write
//! its inode too, and under a DHCP storm that write was a third of each sync's cost (perf, ext4);
//! overwriting bytes already on disk leaves the inode alone. Database logs do the same.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

use super::leases::LeaseRecord;

/// How much the file grows by when records reach its end: zeros written ahead of them.
const GROWTH: u64 = 1 << 20;

#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    /// The file's length up to its last good record: where the next one goes, and where a failed
    /// append is cut back to.
    len: u64,
    /// The file's length: records, then zeros.
    allocated: u64,
    /// A failed append could not be cut off: cut it before writing again.
    torn: bool,
    /// Records in the file, to decide when to compact.
    records_in_file: usize,
}

/// What opening the journal found.
#[derive(Debug)]
pub struct Replay {
    pub records: Vec<LeaseRecord>,
    /// Lines that failed their checksum or did not parse (skipped, and logged).
    pub corrupt_lines: usize,
    /// Bytes of an unfinished last line cut off (a write interrupted by a crash).
    pub torn_bytes: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("lease file {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "lease file {0} is locked by another process (is another siteboot running with the same state_dir?)"
    )]
    Locked(PathBuf),
}

impl Journal {
    /// Opens (creating if needed) and replays the journal at `path`, taking its lock.
    pub fn open(path: &Path) -> Result<(Self, Replay), JournalError> {
        let io_err = |source| JournalError::Io { path: path.to_owned(), source };
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io_err)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_err)?;
        rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive)
            .map_err(|_| JournalError::Locked(path.to_owned()))?;

        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io_err)?;
        let records = without_padding(&bytes);
        let replay = parse(records);
        let len = (records.len() - replay.torn_bytes) as u64;
        let mut allocated = bytes.len() as u64;
        if replay.torn_bytes > 0 {
            file.set_len(len).map_err(io_err)?;
            file.sync_data().map_err(io_err)?;
            allocated = len;
        }
        let mut journal = Self {
            path: path.to_owned(),
            file,
            len,
            allocated,
            torn: false,
            records_in_file: replay.records.len(),
        };
        if replay.corrupt_lines > 0 {
            tracing::error!(path = %path.display(), lines = replay.corrupt_lines, "lease file had corrupt lines; they were skipped and the file is rewritten");
            journal.compact(&replay.records)?;
        }
        Ok((journal, replay))
    }

    /// Appends `records` and syncs them to disk: when this returns, they survive a crash. On an
    /// error none of them is in the file.
    pub fn append(&mut self, records: &[LeaseRecord]) -> Result<(), JournalError> {
        self.append_with(records, |file, at, buf| {
            file.write_all_at(buf, at)?;
            file.sync_data()
        })
    }

    /// [`append`](Self::append), with the write and sync passed in so tests can fail them.
    fn append_with(
        &mut self,
        records: &[LeaseRecord],
        write: impl FnOnce(&File, u64, &[u8]) -> io::Result<()>,
    ) -> Result<(), JournalError> {
        if records.is_empty() {
            return Ok(());
        }
        let io_err = |source| JournalError::Io { path: self.path.clone(), source };
        if self.torn {
            self.file.set_len(self.len).map_err(io_err)?;
            self.allocated = self.len;
            self.torn = false;
        }
        let mut buf = Vec::with_capacity(records.len() * 128);
        for r in records {
            encode_line(&mut buf, r);
        }
        let end = self.len + buf.len() as u64;
        // Zeros ahead of the records when they reach the end, synced by the records' fdatasync.
        let allocated = self.allocated.max(end.next_multiple_of(GROWTH));
        let written = if allocated > self.allocated {
            write_zeros(&self.file, self.allocated, allocated)
        } else {
            Ok(())
        };
        if let Err(e) = written.and_then(|()| write(&self.file, self.len, &buf)) {
            // The replies these records announce are not sent: drop whatever part was written.
            self.torn = self.file.set_len(self.len).is_err();
            self.allocated = self.len;
            return Err(io_err(e));
        }
        self.allocated = allocated;
        self.len = end;
        self.records_in_file += records.len();
        Ok(())
    }

    /// Whether the file holds so much history that it should be rewritten from `live` records.
    pub fn should_compact(&self, live: usize) -> bool {
        self.records_in_file > 1024 && self.records_in_file > 4 * live
    }

    /// Replaces the file's contents with `live`, atomically.
    pub fn compact(&mut self, live: &[LeaseRecord]) -> Result<(), JournalError> {
        let io_err = |source| JournalError::Io { path: self.path.clone(), source };
        let tmp = self.path.with_extension("compacting");
        let mut len = 0;
        {
            let mut w = BufWriter::new(File::create(&tmp).map_err(io_err)?);
            let mut buf = Vec::new();
            for r in live {
                buf.clear();
                encode_line(&mut buf, r);
                w.write_all(&buf).map_err(io_err)?;
                len += buf.len() as u64;
            }
            let f = w.into_inner().map_err(|e| io_err(e.into_error()))?;
            write_zeros(&f, len, len.next_multiple_of(GROWTH)).map_err(io_err)?;
            f.sync_all().map_err(io_err)?;
        }
        let new = OpenOptions::new().read(true).write(true).open(&tmp).map_err(io_err)?;
        // Lock the new file before it replaces the old one, so the lock is never absent.
        rustix::fs::flock(&new, FlockOperation::NonBlockingLockExclusive)
            .map_err(|_| JournalError::Locked(self.path.clone()))?;
        std::fs::rename(&tmp, &self.path).map_err(io_err)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir).and_then(|d| d.sync_all()).map_err(io_err)?;
        }
        self.file = new;
        self.len = len;
        self.allocated = len.next_multiple_of(GROWTH);
        self.torn = false;
        self.records_in_file = live.len();
        Ok(())
    }
}

fn encode_line(buf: &mut Vec<u8>, record: &LeaseRecord) {
    let json = serde_json::to_vec(record).expect("lease records serialize");
    let crc = crc32fast::hash(&json);
    buf.extend_from_slice(format!("{crc:08x} ").as_bytes());
    buf.extend_from_slice(&json);
    buf.push(b'\n');
}

/// Writes zeros over `from..to` of `file`: real blocks, where a hole (`set_len`) would leave the
/// allocation to the first record's sync.
fn write_zeros(file: &File, from: u64, to: u64) -> io::Result<()> {
    static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];
    let mut at = from;
    while at < to {
        let n = (to - at).min(ZEROS.len() as u64);
        file.write_all_at(&ZEROS[..n as usize], at)?;
        at += n;
    }
    Ok(())
}

/// The file's bytes without the zeros it grew into. A record never holds a zero byte (JSON
/// escapes control characters), so they cannot be a record's end.
fn without_padding(bytes: &[u8]) -> &[u8] {
    &bytes[..bytes.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1)]
}

fn parse(bytes: &[u8]) -> Replay {
    let mut replay = Replay { records: Vec::new(), corrupt_lines: 0, torn_bytes: 0 };
    let mut rest = bytes;
    while !rest.is_empty() {
        let Some(end) = rest.iter().position(|b| *b == b'\n') else {
            replay.torn_bytes = rest.len();
            break;
        };
        let line = &rest[..end];
        rest = &rest[end + 1..];
        match decode_line(line) {
            Some(record) => replay.records.push(record),
            // A bad final line is a torn write; anything earlier is corruption.
            None if rest.is_empty() => replay.torn_bytes = line.len() + 1,
            None => replay.corrupt_lines += 1,
        }
    }
    replay
}

fn decode_line(line: &[u8]) -> Option<LeaseRecord> {
    let (crc, json) = (line.get(..8)?, line.get(9..)?);
    if line.get(8) != Some(&b' ') {
        return None;
    }
    let crc = u32::from_str_radix(std::str::from_utf8(crc).ok()?, 16).ok()?;
    if crc32fast::hash(json) != crc {
        return None;
    }
    serde_json::from_slice(json).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dhcp::leases::Lease;

    fn record(n: u8) -> LeaseRecord {
        LeaseRecord::Lease(Lease {
            addr: std::net::Ipv4Addr::new(10, 0, 0, n),
            mac: crate::MacAddr::new([2, 0, 0, 0, 0, n]),
            expires: 1000 + u64::from(n),
            hostname: None,
            relay_agent: Default::default(),
        })
    }

    /// The file's records, without the zeros it grew into.
    fn records_on_disk(path: &Path) -> Vec<u8> {
        without_padding(&std::fs::read(path).unwrap()).to_vec()
    }

    #[test]
    fn appends_and_replays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases.log");
        {
            let (mut j, replay) = Journal::open(&path).unwrap();
            assert!(replay.records.is_empty());
            j.append(&[record(1), record(2)]).unwrap();
            j.append(&[record(3)]).unwrap();
        }
        let (_j, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records, vec![record(1), record(2), record(3)]);
    }

    #[test]
    fn the_file_grows_in_zeroed_steps_that_records_fill() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases.log");
        let (mut j, _) = Journal::open(&path).unwrap();
        j.append(&[record(1)]).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), GROWTH, "one step ahead");
        let batch: Vec<_> = (0..=255).map(record).collect();
        let mut appended = 1;
        while records_on_disk(&path).len() as u64 <= GROWTH {
            j.append(&batch).unwrap();
            appended += batch.len();
        }
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, 2 * GROWTH, "the next step, when records reached the end");
        assert!(bytes[records_on_disk(&path).len()..].iter().all(|b| *b == 0));
        drop(j);
        let (mut j, replay) = Journal::open(&path).unwrap();
        assert_eq!(
            (replay.records.len(), replay.corrupt_lines, replay.torn_bytes),
            (appended, 0, 0)
        );
        // Reopened, the next record goes right after the last one, not after the zeros.
        j.append(&[record(7)]).unwrap();
        drop(j);
        let (_j, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records.len(), appended + 1);
        assert_eq!(replay.records.last(), Some(&record(7)));
    }

    #[test]
    fn a_second_opener_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases.log");
        let (_j, _) = Journal::open(&path).unwrap();
        assert!(matches!(Journal::open(&path), Err(JournalError::Locked(_))));
    }

    #[test]
    fn torn_tail_is_cut_at_every_byte_and_corruption_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases.log");
        let mut full = Vec::new();
        for n in 1..=3 {
            encode_line(&mut full, &record(n));
        }
        let two = full.iter().enumerate().filter(|(_, b)| **b == b'\n').nth(1).unwrap().0 + 1;
        // A crash can stop the last write at any byte, at the end of the file or inside the
        // zeros it grew into: only the finished lines survive.
        for (cut, padding) in (two..full.len()).flat_map(|cut| [(cut, 0), (cut, 100)]) {
            let mut bytes = full[..cut].to_vec();
            bytes.resize(cut + padding, 0);
            std::fs::write(&path, &bytes).unwrap();
            let (_j, replay) = Journal::open(&path).unwrap();
            assert_eq!(replay.records, vec![record(1), record(2)], "cut at {cut}");
            assert_eq!(replay.torn_bytes, cut - two, "cut at {cut}");
            assert_eq!(records_on_disk(&path), full[..two], "cut at {cut}");
        }
        // A flipped byte in the middle loses only that line.
        let mut corrupt = full.clone();
        corrupt[two + 12] ^= 0x55;
        let mut tail = Vec::new();
        encode_line(&mut tail, &record(4));
        corrupt.extend_from_slice(&tail);
        std::fs::write(&path, &corrupt).unwrap();
        let (_j, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.corrupt_lines, 1);
        assert_eq!(replay.records, vec![record(1), record(2), record(4)]);
        drop(_j);
        let (_j, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.corrupt_lines, 0, "the file was rewritten clean");
    }

    #[test]
    fn a_failed_append_leaves_no_partial_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases.log");
        let (mut j, _) = Journal::open(&path).unwrap();
        j.append(&[record(1)]).unwrap();
        let good = records_on_disk(&path);
        // The disk fills part-way through a batch, and then the sync of a whole one fails.
        let half_then_full = |file: &File, at: u64, buf: &[u8]| {
            file.write_all_at(&buf[..buf.len() / 2], at)?;
            Err(io::Error::from(io::ErrorKind::StorageFull))
        };
        let err = j.append_with(&[record(2), record(3)], half_then_full).unwrap_err();
        assert!(matches!(err, JournalError::Io { .. }), "{err}");
        assert_eq!(records_on_disk(&path), good, "partial batch cut off");
        let written_unsynced = |file: &File, at: u64, buf: &[u8]| {
            file.write_all_at(buf, at)?;
            Err(io::Error::other("sync failed"))
        };
        assert!(j.append_with(&[record(4)], written_unsynced).is_err());
        assert_eq!(records_on_disk(&path), good);
        // The next record starts a line of its own and every good record replays.
        j.append(&[record(5)]).unwrap();
        drop(j);
        let (_j, replay) = Journal::open(&path).unwrap();
        assert_eq!((replay.corrupt_lines, replay.torn_bytes), (0, 0));
        assert_eq!(replay.records, vec![record(1), record(5)]);
    }

    #[test]
    fn compaction_keeps_only_live_records_and_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases.log");
        let (mut j, _) = Journal::open(&path).unwrap();
        for _ in 0..300 {
            j.append(&[record(1), record(2), record(3), record(4)]).unwrap();
        }
        assert!(j.should_compact(2));
        j.compact(&[record(1), record(2)]).unwrap();
        assert!(!j.should_compact(2));
        j.append(&[record(5)]).unwrap();
        assert!(matches!(Journal::open(&path), Err(JournalError::Locked(_))));
        drop(j);
        let (_j, replay) = Journal::open(&path).unwrap();
        assert_eq!(replay.records, vec![record(1), record(2), record(5)]);
    }
}
