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

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

use super::leases::LeaseRecord;

#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    /// The file's length up to its last good record: where a failed append is cut back to.
    len: u64,
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
        let mut file =
            OpenOptions::new().read(true).append(true).create(true).open(path).map_err(io_err)?;
        rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive)
            .map_err(|_| JournalError::Locked(path.to_owned()))?;

        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io_err)?;
        let replay = parse(&bytes);
        let len = (bytes.len() - replay.torn_bytes) as u64;
        if replay.torn_bytes > 0 {
            file.set_len(len).map_err(io_err)?;
            file.sync_data().map_err(io_err)?;
        }
        let mut journal = Self {
            path: path.to_owned(),
            file,
            len,
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
        self.append_with(records, |file, buf| {
            file.write_all(buf)?;
            file.sync_data()
        })
    }

    /// [`append`](Self::append), with the write and sync passed in so tests can fail them.
    fn append_with(
        &mut self,
        records: &[LeaseRecord],
        write: impl FnOnce(&mut File, &[u8]) -> io::Result<()>,
    ) -> Result<(), JournalError> {
        if records.is_empty() {
            return Ok(());
        }
        let io_err = |source| JournalError::Io { path: self.path.clone(), source };
        if self.torn {
            self.file.set_len(self.len).map_err(io_err)?;
            self.torn = false;
        }
        let mut buf = Vec::with_capacity(records.len() * 128);
        for r in records {
            encode_line(&mut buf, r);
        }
        if let Err(e) = write(&mut self.file, &buf) {
            // The replies these records announce are not sent: drop whatever part was written.
            self.torn = self.file.set_len(self.len).is_err();
            return Err(io_err(e));
        }
        self.len += buf.len() as u64;
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
            f.sync_all().map_err(io_err)?;
        }
        let new = OpenOptions::new().read(true).append(true).open(&tmp).map_err(io_err)?;
        // Lock the new file before it replaces the old one, so the lock is never absent.
        rustix::fs::flock(&new, FlockOperation::NonBlockingLockExclusive)
            .map_err(|_| JournalError::Locked(self.path.clone()))?;
        std::fs::rename(&tmp, &self.path).map_err(io_err)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir).and_then(|d| d.sync_all()).map_err(io_err)?;
        }
        self.file = new;
        self.len = len;
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
        })
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
        // A crash can stop the last write at any byte: only the finished lines survive.
        for cut in two..full.len() {
            std::fs::write(&path, &full[..cut]).unwrap();
            let (_j, replay) = Journal::open(&path).unwrap();
            assert_eq!(replay.records, vec![record(1), record(2)], "cut at {cut}");
            assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, two);
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
        let good = std::fs::metadata(&path).unwrap().len();
        // The disk fills part-way through a batch, and then the sync of a whole one fails.
        let half_then_full = |file: &mut File, buf: &[u8]| {
            file.write_all(&buf[..buf.len() / 2])?;
            Err(io::Error::from(io::ErrorKind::StorageFull))
        };
        let err = j.append_with(&[record(2), record(3)], half_then_full).unwrap_err();
        assert!(matches!(err, JournalError::Io { .. }), "{err}");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), good, "partial batch cut off");
        let written_unsynced = |file: &mut File, buf: &[u8]| {
            file.write_all(buf)?;
            Err(io::Error::other("sync failed"))
        };
        assert!(j.append_with(&[record(4)], written_unsynced).is_err());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), good);
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
