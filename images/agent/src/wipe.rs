//! Wiping disks before a host changes hands. `quick` clears what makes a disk look like
//! something: partition tables at both ends, and filesystem, RAID, LVM and ZFS signatures,
//! which live in the first or last MiB of the disk or of a partition (ext4, XFS, LVM, md 1.1/1.2
//! near the start; md 0.90/1.0, ZFS's last labels and GPT's backup at the end). The partitions
//! are those the tables list before wiping. `full` writes every byte. Either way, what was
//! written is read back and must be zeros.
//!
//! On a block device the page cache is dropped (BLKFLSBUF) after the sync, so the read-back
//! comes from the disk, not from memory.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::partition::partitions;
use crate::progress::{Progress, Throttle};

const MIB: u64 = 1 << 20;

/// How a deprovisioned disk is wiped (`wipe` of a deprovision task; `none` is no wipe).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    Quick,
    Full,
    None,
}

#[derive(Debug, thiserror::Error)]
pub enum WipeError {
    #[error("{action} {}: {error}", device.display())]
    Io { action: &'static str, device: PathBuf, error: io::Error },
    #[error("{} still holds non-zero bytes at offset {offset} after wiping", device.display())]
    NotZero { device: PathBuf, offset: u64 },
}

/// The byte ranges a policy clears on a disk of `size` bytes holding `partitions` (offset,
/// length): sorted, merged, within the disk.
pub fn regions(policy: Policy, size: u64, partitions: &[(u64, u64)]) -> Vec<Range<u64>> {
    let ends = |offset: u64, len: u64| {
        let head = offset..offset + len.min(MIB);
        let tail = offset + len.saturating_sub(MIB)..offset + len;
        [head, tail]
    };
    let mut ranges: Vec<Range<u64>> = match policy {
        Policy::None => Vec::new(),
        Policy::Full => std::iter::once(0..size).collect(),
        Policy::Quick => std::iter::once((0, size))
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
    policy: Policy,
    mut progress: impl FnMut(Progress),
) -> Result<u64, WipeError> {
    let io = |action| move |error| WipeError::Io { action, device: device.to_owned(), error };
    let file = File::options().read(true).write(true).open(device).map_err(io("opening"))?;
    let found = match policy {
        // Unreadable tables must not stop the wipe: the disk's own ends are still cleared.
        Policy::Quick => partitions(&file, size, sector).unwrap_or_else(|e| {
            eprintln!("siteboot-agent: reading the tables of {}: {e}", device.display());
            Vec::new()
        }),
        Policy::Full | Policy::None => Vec::new(),
    };
    let ranges = regions(policy, size, &found);
    let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let zeros = vec![0u8; MIB as usize];
    let mut throttle = Throttle::new(Duration::from_secs(1));
    let mut done = 0;
    for range in &ranges {
        let mut at = range.start;
        while at < range.end {
            let n = (range.end - at).min(MIB) as usize;
            file.write_all_at(&zeros[..n], at).map_err(io("writing"))?;
            at += n as u64;
            done += n as u64;
            if throttle.due(Instant::now()) {
                progress(Progress { done, total: 2 * total });
            }
        }
    }
    file.sync_all().map_err(io("syncing"))?;
    drop_cache(&file).map_err(io("dropping the cached pages of"))?;
    let mut buffer = vec![0u8; MIB as usize];
    for range in &ranges {
        let mut at = range.start;
        while at < range.end {
            let n = (range.end - at).min(MIB) as usize;
            file.read_exact_at(&mut buffer[..n], at).map_err(io("reading back"))?;
            if let Some(i) = buffer[..n].iter().position(|b| *b != 0) {
                return Err(WipeError::NotZero {
                    device: device.to_owned(),
                    offset: at + i as u64,
                });
            }
            at += n as u64;
            done += n as u64;
            if throttle.due(Instant::now()) {
                progress(Progress { done, total: 2 * total });
            }
        }
    }
    progress(Progress { done, total: 2 * total });
    Ok(total)
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
            regions(Policy::Quick, size, &parts),
            vec![0..2 * MIB, 8 * MIB..10 * MIB, 99 * MIB - 34 * 512..size]
        );
        // A partition smaller than a MiB is cleared whole, once.
        assert_eq!(
            regions(Policy::Quick, 4 * MIB, &[(MIB, 4096)]),
            vec![0..MIB + 4096, 3 * MIB..4 * MIB]
        );
        assert_eq!(
            regions(Policy::Full, size, &parts),
            std::iter::once(0..size).collect::<Vec<_>>()
        );
        assert_eq!(regions(Policy::None, size, &parts), vec![]);
        assert_eq!(regions(Policy::Quick, MIB / 2, &[]), vec![0..MIB / 2]);
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
        let wiped = wipe(disk.path(), 64 * MIB, 512, Policy::Quick, |p| reports.push(p)).unwrap();
        assert_eq!(
            wiped,
            regions(Policy::Quick, 64 * MIB, &parts).iter().map(|r| r.end - r.start).sum::<u64>()
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
        let wiped = wipe(disk.path(), 64 * MIB, 512, Policy::Full, |_| {}).unwrap();
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
        let wiped = wipe(disk.path(), 64 * MIB, 512, Policy::Quick, |_| {}).unwrap();
        assert_eq!(wiped, 2 * MIB);
        let bytes = std::fs::read(disk.path()).unwrap();
        assert!(bytes[..MIB as usize].iter().all(|b| *b == 0));
        assert!(bytes[63 * MIB as usize..].iter().all(|b| *b == 0));
        assert_eq!(probe(disk.path(), 0, 64 * MIB), "");
    }
}
