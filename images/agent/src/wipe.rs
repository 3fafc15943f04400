//! Wiping disks before a host changes hands. `quick` clears what makes a disk look like
//! something: partition tables at both ends, and filesystem, RAID, LVM and ZFS signatures,
//! which live in the first or last MiB of the disk or of a partition (ext4, XFS, LVM, md 1.1/1.2
//! near the start; md 0.90/1.0, ZFS's last labels and GPT's backup at the end). The partitions
//! are those the tables list before wiping: a quick wipe leaves the rest, and a forensic reader
//! recovers files from it. `full` zeroes every block, with the device's own zeroing where it
//! has one ([`zero_out`]). Either way, what was wiped is read back and must be zeros.
//!
//! On a block device the page cache is dropped (BLKFLSBUF) after the sync and the read-back
//! uses O_DIRECT where it can, so it comes from the disk, not from memory.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use siteboot_agent_api::{Progress, Wipe};

use crate::partition::partitions;
use crate::progress::Throttle;
use crate::write::{ALIGN, CHUNK, Chunk, open_disk, stop_direct};

const MIB: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum WipeError {
    #[error("{action} {}: {error}", device.display())]
    Io { action: &'static str, device: PathBuf, error: io::Error },
    #[error("{} still holds non-zero bytes at offset {offset} after wiping", device.display())]
    NotZero { device: PathBuf, offset: u64 },
}

/// The byte ranges a policy clears on a disk of `size` bytes holding `partitions` (offset,
/// length): sorted, merged, within the disk.
pub fn regions(policy: Wipe, size: u64, partitions: &[(u64, u64)]) -> Vec<Range<u64>> {
    let ends = |offset: u64, len: u64| {
        let head = offset..offset + len.min(MIB);
        let tail = offset + len.saturating_sub(MIB)..offset + len;
        [head, tail]
    };
    let mut ranges: Vec<Range<u64>> = match policy {
        Wipe::None => Vec::new(),
        Wipe::Full => std::iter::once(0..size).collect(),
        Wipe::Quick => std::iter::once((0, size))
            .chain(partitions.iter().copied())
            .flat_map(|(offset, len)| ends(offset, len))
            .map(|r| r.start.min(size)..r.end.min(size))
            .collect(),
    };
    ranges.retain(|r| !r.is_empty());
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::new();
    for range in ranges {
        match merged.last_mut() {
            Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
            _ => merged.push(range),
        }
    }
    merged
}

/// Wipes `device` (`size` bytes, `sector`-byte sectors) by `policy`, then reads the wiped
/// bytes back. Returns the bytes wiped.
pub fn wipe(
    device: &Path,
    size: u64,
    sector: u64,
    policy: Wipe,
    mut progress: impl FnMut(Progress),
) -> Result<u64, WipeError> {
    let io = |action| move |error| WipeError::Io { action, device: device.to_owned(), error };
    let file = File::options().read(true).write(true).open(device).map_err(io("opening"))?;
    let found = match policy {
        // Unreadable tables must not stop the wipe: the disk's own ends are still cleared.
        Wipe::Quick => partitions(&file, size, sector).unwrap_or_else(|e| {
            eprintln!("siteboot-agent: reading the tables of {}: {e}", device.display());
            Vec::new()
        }),
        Wipe::Full | Wipe::None => Vec::new(),
    };
    let ranges = regions(policy, size, &found);
    let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let mut throttle = Throttle::new(Duration::from_secs(1));
    let mut done = 0;
    let mut step = |n: u64| {
        done += n;
        if throttle.due(Instant::now()) {
            progress(Progress { done, total: 2 * total });
        }
    };
    if policy == Wipe::Full {
        let how = zero_out(&file, device, size, &mut step)?;
        eprintln!("siteboot-agent: {}: {how}", device.display());
    } else {
        for range in &ranges {
            write_zeros(&file, range.clone(), &mut step).map_err(io("writing"))?;
        }
    }
    file.sync_all().map_err(io("syncing"))?;
    drop_cache(&file).map_err(io("dropping the cached pages of"))?;
    read_back(device, &ranges, &mut step)?;
    progress(Progress { done: 2 * total, total: 2 * total });
    Ok(total)
}

/// BLKDISCARD and BLKZEROOUT (linux/fs.h: `_IO(0x12, 119)`, `_IO(0x12, 127)`).
const BLKDISCARD: libc::c_ulong = 0x1277;
const BLKZEROOUT: libc::c_ulong = 0x127f;
/// Bytes per BLKZEROOUT call: progress is reported between calls.
const ZERO_OUT_STEP: u64 = 256 * MIB;

/// Zeroes all `size` bytes of `device`. First a discard, best effort: it tells an SSD or thin
/// volume the blocks are free, but reads after it may still return old data. Then BLKZEROOUT,
/// for which the kernel uses the device's own zeroing (WRITE ZEROES) where it has one and writes
/// zero pages itself otherwise. What has no BLKZEROOUT (a regular file, some devices) is
/// written zeros. Returns how, for the console.
fn zero_out(
    file: &File,
    device: &Path,
    size: u64,
    step: &mut impl FnMut(u64),
) -> Result<String, WipeError> {
    let io = |action| move |error| WipeError::Io { action, device: device.to_owned(), error };
    let discard = match range_ioctl(file, BLKDISCARD, 0..size) {
        Ok(()) => "discarded".to_owned(),
        Err(e) => format!("not discarded ({e})"),
    };
    let mut at = 0;
    while at < size {
        let n = (size - at).min(ZERO_OUT_STEP);
        match range_ioctl(file, BLKZEROOUT, at..at + n) {
            Ok(()) => {}
            Err(e) if at == 0 && unsupported(&e) => {
                write_zeros(file, 0..size, step).map_err(io("writing"))?;
                return Ok(format!("{discard}; no BLKZEROOUT ({e}): zeros written"));
            }
            Err(e) => return Err(io("zeroing out")(e)),
        }
        at += n;
        step(n);
    }
    Ok(format!("{discard}; zeroed with BLKZEROOUT"))
}

/// An ioctl failure that says the device (or file) has no such ioctl, not that it failed.
fn unsupported(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EOPNOTSUPP | libc::EINVAL))
}

/// BLKDISCARD or BLKZEROOUT of `range` (bytes) of a block device.
fn range_ioctl(file: &File, request: libc::c_ulong, range: Range<u64>) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let arg: [u64; 2] = [range.start, range.end - range.start];
    // SAFETY: both requests read two u64s (start, length) through the pointer, which stays valid
    // for the call; the descriptor is open for its duration.
    if unsafe { libc::ioctl(file.as_raw_fd(), request as _, arg.as_ptr()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Writes zeros over `range` of `file`, a MiB at a time.
fn write_zeros(file: &File, range: Range<u64>, step: &mut impl FnMut(u64)) -> io::Result<()> {
    let zeros = vec![0u8; MIB as usize];
    let mut at = range.start;
    while at < range.end {
        let n = (range.end - at).min(MIB);
        file.write_all_at(&zeros[..n as usize], at)?;
        at += n;
        step(n);
    }
    Ok(())
}

/// Reads `ranges` of `device` back and fails at the first byte that is not zero. Through
/// O_DIRECT where the device allows it, in aligned chunks: a whole disk's read then neither
/// fills the page cache nor is answered by it.
fn read_back(
    device: &Path,
    ranges: &[Range<u64>],
    step: &mut impl FnMut(u64),
) -> Result<(), WipeError> {
    let io = |action| move |error| WipeError::Io { action, device: device.to_owned(), error };
    let (file, mut direct) =
        open_disk(device, File::options().read(true)).map_err(io("opening"))?;
    let mut chunk = Chunk::new();
    let buffer = chunk.room();
    for range in ranges {
        let mut at = range.start;
        while at < range.end {
            let n = (range.end - at).min(CHUNK as u64);
            // O_DIRECT takes aligned offsets and lengths only: a quick wipe's partition ends and
            // a disk's odd tail are read through the page cache (dropped after the sync).
            if direct && (at | n) % ALIGN as u64 != 0 {
                stop_direct(&file).map_err(io("reading back"))?;
                direct = false;
            }
            let read = &mut buffer[..n as usize];
            file.read_exact_at(read, at).map_err(io("reading back"))?;
            if let Some(i) = read.iter().position(|b| *b != 0) {
                return Err(WipeError::NotZero {
                    device: device.to_owned(),
                    offset: at + i as u64,
                });
            }
            at += n;
            step(n);
        }
    }
    Ok(())
}

/// Drops a block device's cached pages (they were just synced), so reads come from the disk.
fn drop_cache(file: &File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    if !file.metadata()?.file_type().is_block_device() {
        return Ok(());
    }
    const BLKFLSBUF: libc::c_ulong = 0x1261;
    // SAFETY: BLKFLSBUF takes no argument and the descriptor is open for the call's duration.
    if unsafe { libc::ioctl(file.as_raw_fd(), BLKFLSBUF as _, 0) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;
    use crate::partition::tests::{forge_gpt, run, written_disk};

    #[test]
    fn quick_regions_cover_both_ends_of_disk_and_partitions() {
        let size = 100 * MIB;
        let parts = [(MIB, 8 * MIB), (9 * MIB, 91 * MIB - 34 * 512), (99 * MIB, 2 * MIB)];
        assert_eq!(
            regions(Wipe::Quick, size, &parts),
            vec![0..2 * MIB, 8 * MIB..10 * MIB, 99 * MIB - 34 * 512..size]
        );
        // A partition smaller than a MiB is cleared whole, once.
        assert_eq!(
            regions(Wipe::Quick, 4 * MIB, &[(MIB, 4096)]),
            vec![0..MIB + 4096, 3 * MIB..4 * MIB]
        );
        assert_eq!(regions(Wipe::Full, size, &parts), std::iter::once(0..size).collect::<Vec<_>>());
        assert_eq!(regions(Wipe::None, size, &parts), vec![]);
        assert_eq!(regions(Wipe::Quick, MIB / 2, &[]), vec![0..MIB / 2]);
    }

    /// What `blkid` finds at `offset` of `disk` (nothing: empty).
    fn probe(disk: &Path, offset: u64, size: u64) -> String {
        let out = Command::new("blkid")
            .args(["-p", "-o", "export", "-O", &offset.to_string(), "-S", &size.to_string()])
            .arg(disk)
            .output()
            .expect("blkid (scripts/setup installs util-linux)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A disk with a GPT, ext4 in its first partition and FAT in its second, and a marker
    /// in the middle of the second.
    fn used_disk() -> (tempfile::NamedTempFile, Vec<(u64, u64)>) {
        let disk = written_disk(64, 64, "label: gpt\n,16M,L\n,,L\n");
        let parts = partitions(disk.as_file(), 64 * MIB, 512).unwrap();
        assert_eq!(parts.len(), 2, "{parts:?}");
        for ((offset, len), mkfs) in parts.iter().zip([["mkfs.ext4", "-q"], ["mkfs.vfat", "-n"]]) {
            let fs = tempfile::NamedTempFile::new().unwrap();
            fs.as_file().set_len(*len).unwrap();
            let fs_path = fs.path().to_str().unwrap();
            let args: Vec<&str> = if mkfs[0] == "mkfs.vfat" {
                vec!["-n", "DATA", fs_path]
            } else {
                vec!["-q", "-F", fs_path]
            };
            run(mkfs[0], &args, None);
            disk.as_file().write_all_at(&std::fs::read(fs.path()).unwrap(), *offset).unwrap();
        }
        disk.as_file().write_all_at(b"tenant data", 40 * MIB).unwrap();
        (disk, parts)
    }

    #[test]
    fn quick_wipe_leaves_nothing_blkid_or_wipefs_finds() {
        let (disk, parts) = used_disk();
        let name = disk.path().to_str().unwrap();
        assert!(probe(disk.path(), parts[0].0, parts[0].1).contains("TYPE=ext4"));
        assert!(probe(disk.path(), parts[1].0, parts[1].1).contains("TYPE=vfat"));
        assert!(run("wipefs", &["-n", name], None).contains("gpt"));

        let mut reports = Vec::new();
        let wiped = wipe(disk.path(), 64 * MIB, 512, Wipe::Quick, |p| reports.push(p)).unwrap();
        assert_eq!(
            wiped,
            regions(Wipe::Quick, 64 * MIB, &parts).iter().map(|r| r.end - r.start).sum::<u64>()
        );
        assert_eq!(reports.last(), Some(&Progress { done: 2 * wiped, total: 2 * wiped }));
        for (offset, len) in &parts {
            assert_eq!(probe(disk.path(), *offset, *len), "", "partition at {offset}");
        }
        assert_eq!(probe(disk.path(), 0, 64 * MIB), "");
        assert_eq!(run("wipefs", &["-n", name], None), "");
        // Quick is quick: the middle of a partition is left as it was.
        let mut middle = [0u8; 11];
        disk.as_file().read_exact_at(&mut middle, 40 * MIB).unwrap();
        assert_eq!(&middle, b"tenant data");
    }

    #[test]
    fn full_wipe_zeroes_every_byte() {
        let (disk, _) = used_disk();
        let wiped = wipe(disk.path(), 64 * MIB, 512, Wipe::Full, |_| {}).unwrap();
        assert_eq!(wiped, 64 * MIB);
        assert!(std::fs::read(disk.path()).unwrap().iter().all(|b| *b == 0));
    }

    #[test]
    fn quick_wipe_of_a_disk_with_a_hostile_gpt_still_clears_both_ends() {
        let (disk, _) = used_disk();
        // Both headers claim 1024 entries of 4 GiB each, with valid CRCs.
        for lba in [1, 64 * MIB / 512 - 1] {
            forge_gpt(disk.as_file(), lba, 84, &0xffff_fff8_u32.to_le_bytes());
        }
        let wiped = wipe(disk.path(), 64 * MIB, 512, Wipe::Quick, |_| {}).unwrap();
        assert_eq!(wiped, 2 * MIB);
        let bytes = std::fs::read(disk.path()).unwrap();
        assert!(bytes[..MIB as usize].iter().all(|b| *b == 0));
        assert!(bytes[63 * MIB as usize..].iter().all(|b| *b == 0));
        assert_eq!(probe(disk.path(), 0, 64 * MIB), "");
    }

    /// A loop device over a file, detached on drop (also when the test fails).
    struct LoopDevice(PathBuf);

    impl LoopDevice {
        fn attach(file: &Path) -> Self {
            // SAFETY: geteuid has no preconditions.
            assert_eq!(unsafe { libc::geteuid() }, 0, "needs root (losetup)");
            let shown = run("losetup", &["--find", "--show", file.to_str().unwrap()], None);
            Self(shown.lines().next().expect("losetup --show names the device").into())
        }
    }

    impl Drop for LoopDevice {
        fn drop(&mut self) {
            let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
        }
    }

    #[test]
    #[ignore = "needs root (losetup): scripts/test runs it with --include-ignored"]
    fn full_wipe_of_a_loop_device_zeroes_it_with_blkzeroout_and_reads_it_back() {
        // A previous tenant's disk: a pattern without zeros, then ext4 over it.
        let size = 64 * MIB;
        let file = tempfile::NamedTempFile::new_in("/var/tmp").unwrap();
        let pattern: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8 | 1).collect();
        for i in 0..64 {
            file.as_file().write_all_at(&pattern, i * MIB).unwrap();
        }
        run("mkfs.ext4", &["-q", "-F", file.path().to_str().unwrap()], None);
        let device = LoopDevice::attach(file.path());
        let disk = device.0.as_path();
        assert!(probe(disk, 0, size).contains("TYPE=ext4"));

        let opened = File::options().read(true).write(true).open(disk).unwrap();
        let how = zero_out(&opened, disk, size, &mut |_| {}).unwrap();
        assert!(how.ends_with("zeroed with BLKZEROOUT"), "{how}");
        // Read back here, not by the agent's read_back: the device (its cache dropped) and
        // the file under it.
        drop_cache(&opened).unwrap();
        let bytes = std::fs::read(disk).unwrap();
        assert_eq!(bytes.len() as u64, size);
        assert_eq!(bytes.iter().position(|b| *b != 0), None, "the device");
        let under = std::fs::read(file.path()).unwrap();
        assert_eq!(under.iter().position(|b| *b != 0), None, "the file under it");
        assert_eq!(probe(disk, 0, size), "");

        // The whole wipe, through the same path, on the tenant's disk again.
        file.as_file().write_all_at(&pattern, 5 * MIB).unwrap();
        let mut reports = Vec::new();
        assert_eq!(wipe(disk, size, 512, Wipe::Full, |p| reports.push(p)).unwrap(), size);
        assert_eq!(reports.last(), Some(&Progress { done: 2 * size, total: 2 * size }));
        assert!(std::fs::read(file.path()).unwrap().iter().all(|b| *b == 0));

        // A byte the zeroing missed fails the read-back, which names the device and offset.
        let missed = 40 * MIB + 123;
        opened.write_all_at(&[0x5a], missed).unwrap();
        opened.sync_all().unwrap();
        let e = read_back(disk, &regions(Wipe::Full, size, &[]), &mut |_| {}).unwrap_err();
        assert!(matches!(e, WipeError::NotZero { offset, .. } if offset == missed), "{e}");
        let message = e.to_string();
        assert!(message.contains(&device.0.display().to_string()), "{message}");
        assert!(message.contains(&missed.to_string()), "{message}");
    }
}
