//! Making room for the NoCloud seed at the end of a freshly written disk: the image's partition
//! table describes the image, not the disk, so its GPT backup sits where the image ended and
//! its last partition stops there. This moves the GPT backup header and table to the disk's end,
//! optionally grows the last partition up to the seed, and adds the seed's partition entry (GPT,
//! or a primary MBR partition). The filesystem inside the grown partition is left to the OS
//! (cloud-init's growpart/resizefs grow it on first boot).
//!
//! The table logic works on sectors in memory ([`Gpt`], [`Mbr`]); only [`add_seed_partition`]
//! reads and writes the disk.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The seed partition's size: a few KiB of files in a filesystem big enough to format.
pub const SEED_BYTES: u64 = 8 << 20;
/// Partitions start on MiB boundaries (what partitioning tools do; good for every disk).
const ALIGN_BYTES: u64 = 1 << 20;
/// What a disk needs beyond the image: the seed, its alignment and the GPT backup.
pub const SEED_RESERVE: u64 = SEED_BYTES + ALIGN_BYTES + (1 << 20);

const GPT_SIGNATURE: &[u8] = b"EFI PART";
/// "Microsoft basic data" (EBD0A0A2-B9E5-4433-87C0-68B6B72699C7) in GPT's mixed-endian bytes.
const BASIC_DATA: [u8; 16] = [
    0xa2, 0xa0, 0xd0, 0xeb, 0xe5, 0xb9, 0x33, 0x44, 0x87, 0xc0, 0x68, 0xb6, 0xb7, 0x26, 0x99, 0xc7,
];
/// MBR partition type of the seed: FAT16 with LBA addressing.
const MBR_FAT16_LBA: u8 = 0x0e;
const MBR_GPT_PROTECTIVE: u8 = 0xee;

/// Why no seed partition could be added.
#[derive(Debug, thiserror::Error)]
pub enum PartitionError {
    #[error("{action} {}: {error}", device.display())]
    Io { action: &'static str, device: PathBuf, error: io::Error },
    #[error("the image has no partition table (neither GPT nor MBR) to add the seed partition to")]
    NoTable,
    /// A header damaged or out of bounds (a previous tenant's may be hostile): the field named.
    #[error("the GPT header is refused: its {0}")]
    BadGpt(&'static str),
    #[error(
        "no room for the seed: the last partition ends at sector {last_end}, the seed would start at {seed_start}"
    )]
    NoRoom { last_end: u64, seed_start: u64 },
    #[error("every entry of the partition table is in use")]
    TableFull,
    #[error("the image's last MBR partition is an extended one; only a primary one is grown")]
    Extended,
    #[error("the disk has {0} sectors, more than an MBR addresses")]
    TooLargeForMbr(u64),
}

/// Where the seed partition went, in bytes from the disk's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeedPlace {
    pub offset: u64,
    pub len: u64,
}

/// Sector arithmetic of one disk.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    sector: u64,
    sectors: u64,
}

impl Geometry {
    fn align(&self) -> u64 {
        (ALIGN_BYTES / self.sector).max(1)
    }

    /// The seed's first sector, if it ends at `last`: aligned down.
    fn seed_start(&self, last: u64) -> u64 {
        let start = (last + 1).saturating_sub(SEED_BYTES / self.sector);
        start - start % self.align()
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// A GPT: the primary header's sector and the entry array.
#[derive(Debug, Clone)]
struct Gpt {
    header: Vec<u8>,
    entries: Vec<u8>,
}

const ENTRY_SIZE: usize = 128;
/// The largest entry accepted: the UEFI spec allows 128 × 2^n bytes, tables in use have 128.
const MAX_ENTRY_SIZE: u32 = 4096;
/// The most entries accepted (tables in use have 128): with [`MAX_ENTRY_SIZE`], an entry array
/// of at most 4 MiB is read, whatever a previous tenant's header claims.
const MAX_ENTRIES: u32 = 1024;

impl Gpt {
    fn entries_lba(&self) -> u64 {
        u64_at(&self.header, 72)
    }
    fn entry_count(&self) -> usize {
        u32_at(&self.header, 80) as usize
    }
    fn entry_size(&self) -> usize {
        u32_at(&self.header, 84) as usize
    }
    fn entry(&self, i: usize) -> &[u8] {
        &self.entries[i * self.entry_size()..][..self.entry_size()]
    }

    /// Checks a header as read from a disk of `sectors` `sector`-byte sectors: its size and CRC,
    /// then the entry array it describes (bounded, and within the disk).
    fn check(header: &[u8], sectors: u64, sector: u64) -> Result<(), PartitionError> {
        let size = u32_at(header, 12) as usize;
        if !(92..=header.len()).contains(&size) {
            return Err(PartitionError::BadGpt("header size"));
        }
        let mut copy = header[..size].to_vec();
        put_u32(&mut copy, 16, 0);
        if crc32fast::hash(&copy) != u32_at(header, 16) {
            return Err(PartitionError::BadGpt("header CRC"));
        }
        let (count, entry) = (u32_at(header, 80), u32_at(header, 84));
        if !(1..=MAX_ENTRIES).contains(&count) {
            return Err(PartitionError::BadGpt("entry count"));
        }
        if !entry.is_power_of_two() || !(ENTRY_SIZE as u32..=MAX_ENTRY_SIZE).contains(&entry) {
            return Err(PartitionError::BadGpt("entry size"));
        }
        let array_sectors = (u64::from(count) * u64::from(entry)).div_ceil(sector);
        if u64_at(header, 72).checked_add(array_sectors).is_none_or(|end| end > sectors) {
            return Err(PartitionError::BadGpt("entries LBA"));
        }
        Ok(())
    }

    fn entries_sectors(&self, geometry: &Geometry) -> u64 {
        (self.entries.len() as u64).div_ceil(geometry.sector)
    }

    /// Moves the backup to the disk's end, grows the last partition up to the seed if `grow`,
    /// and adds the seed's entry. Returns the seed's sectors (first, last).
    fn add_seed(&mut self, geometry: &Geometry, grow: bool) -> Result<(u64, u64), PartitionError> {
        let backup_lba = geometry.sectors - 1;
        let last_usable = backup_lba - self.entries_sectors(geometry) - 1;
        let seed_start = geometry.seed_start(last_usable);
        let used: Vec<usize> =
            (0..self.entry_count()).filter(|&i| self.entry(i)[..16] != [0; 16]).collect();
        let last = used.iter().copied().max_by_key(|&i| u64_at(self.entry(i), 40));
        let last_end = last.map_or(u64_at(&self.header, 40), |i| u64_at(self.entry(i), 40));
        if last_end >= seed_start {
            return Err(PartitionError::NoRoom { last_end, seed_start });
        }
        let free =
            (0..self.entry_count()).find(|i| !used.contains(i)).ok_or(PartitionError::TableFull)?;
        let entry_size = self.entry_size();
        if let (true, Some(last)) = (grow, last) {
            put_u64(&mut self.entries[last * entry_size..], 40, seed_start - 1);
        }
        let disk_guid: [u8; 16] = self.header[56..72].try_into().expect("16 bytes");
        let entry = &mut self.entries[free * entry_size..][..entry_size];
        entry.fill(0);
        entry[..16].copy_from_slice(&BASIC_DATA);
        entry[16..32].copy_from_slice(&seed_guid(&disk_guid));
        put_u64(entry, 32, seed_start);
        put_u64(entry, 40, last_usable);
        for (i, unit) in "CIDATA".encode_utf16().enumerate() {
            entry[56 + 2 * i..][..2].copy_from_slice(&unit.to_le_bytes());
        }
        put_u64(&mut self.header, 32, backup_lba);
        put_u64(&mut self.header, 48, last_usable);
        put_u32(&mut self.header, 88, crc32fast::hash(&self.entries));
        seal(&mut self.header);
        Ok((seed_start, last_usable))
    }

    /// The backup header for a table whose backup entries start at `entries_lba`.
    fn backup(&self, entries_lba: u64) -> Vec<u8> {
        let mut backup = self.header.clone();
        let (current, other) = (u64_at(&backup, 24), u64_at(&backup, 32));
        put_u64(&mut backup, 24, other);
        put_u64(&mut backup, 32, current);
        put_u64(&mut backup, 72, entries_lba);
        seal(&mut backup);
        backup
    }
}

/// Recomputes a GPT header's CRC.
fn seal(header: &mut [u8]) {
    let size = u32_at(header, 12) as usize;
    put_u32(header, 16, 0);
    let crc = crc32fast::hash(&header[..size]);
    put_u32(header, 16, crc);
}

/// The seed partition's unique GUID: derived from the disk's, so the same image and disk give
/// the same table (a random-version UUID, as tools expect).
fn seed_guid(disk_guid: &[u8; 16]) -> [u8; 16] {
    use sha2::Digest as _;
    let hash = sha2::Sha256::digest([&disk_guid[..], b"siteboot CIDATA"].concat());
    let mut guid: [u8; 16] = hash[..16].try_into().expect("16 bytes");
    guid[7] = (guid[7] & 0x0f) | 0x40; // version 4 (byte 7: the high byte of the mixed-endian field)
    guid[8] = (guid[8] & 0x3f) | 0x80; // RFC 4122 variant
    guid
}

/// The MBR's sector.
#[derive(Debug, Clone)]
struct Mbr(Vec<u8>);

const MBR_ENTRIES: usize = 446;

impl Mbr {
    fn entry(&self, i: usize) -> &[u8] {
        &self.0[MBR_ENTRIES + 16 * i..][..16]
    }
    fn kind(&self, i: usize) -> u8 {
        self.entry(i)[4]
    }

    /// Grows the last primary partition up to the seed if `grow` and adds the seed's entry.
    fn add_seed(&mut self, geometry: &Geometry, grow: bool) -> Result<(u64, u64), PartitionError> {
        if geometry.sectors > u64::from(u32::MAX) {
            return Err(PartitionError::TooLargeForMbr(geometry.sectors));
        }
        let last_sector = geometry.sectors - 1;
        let seed_start = geometry.seed_start(last_sector);
        let used: Vec<usize> = (0..4).filter(|&i| self.kind(i) != 0).collect();
        let end = |i: usize| {
            let e = self.entry(i);
            u64::from(u32_at(e, 8)) + u64::from(u32_at(e, 12)) - 1
        };
        let last = used.iter().copied().max_by_key(|&i| end(i));
        let last_end = last.map_or(0, end);
        if last_end >= seed_start {
            return Err(PartitionError::NoRoom { last_end, seed_start });
        }
        let free = (0..4).find(|i| !used.contains(i)).ok_or(PartitionError::TableFull)?;
        if let (true, Some(last)) = (grow, last) {
            if [0x05, 0x0f, 0x85].contains(&self.kind(last)) {
                return Err(PartitionError::Extended);
            }
            let start = u64::from(u32_at(self.entry(last), 8));
            let len = u32::try_from(seed_start - start).expect("checked against u32::MAX above");
            put_u32(&mut self.0, MBR_ENTRIES + 16 * last + 12, len);
            self.lba_only_chs(last);
        }
        let at = MBR_ENTRIES + 16 * free;
        self.0[at..at + 16].fill(0);
        self.0[at + 4] = MBR_FAT16_LBA;
        let to_u32 = |v: u64| u32::try_from(v).expect("checked against u32::MAX above");
        put_u32(&mut self.0, at + 8, to_u32(seed_start));
        put_u32(&mut self.0, at + 12, to_u32(last_sector - seed_start + 1));
        self.lba_only_chs(free);
        Ok((seed_start, last_sector))
    }

    /// CHS addresses past what CHS reaches, as partitioning tools write them: use the LBA.
    fn lba_only_chs(&mut self, i: usize) {
        let at = MBR_ENTRIES + 16 * i;
        self.0[at + 1..at + 4].copy_from_slice(&[0xfe, 0xff, 0xff]);
        self.0[at + 5..at + 8].copy_from_slice(&[0xfe, 0xff, 0xff]);
    }

    /// A protective MBR covers the whole disk (or as much as 32 bits say).
    fn protect(&mut self, geometry: &Geometry) {
        if let Some(i) = (0..4).find(|&i| self.kind(i) == MBR_GPT_PROTECTIVE) {
            let len = u32::try_from(geometry.sectors - 1).unwrap_or(u32::MAX);
            put_u32(&mut self.0, MBR_ENTRIES + 16 * i + 12, len);
        }
    }
}

/// Adds the seed's partition at the end of `device` (`size` bytes, `sector`-byte logical
/// sectors), growing the last partition up to it if `grow`; see the module documentation.
pub fn add_seed_partition(
    device: &Path,
    size: u64,
    sector: u64,
    grow: bool,
) -> Result<SeedPlace, PartitionError> {
    let io = |action| move |error| PartitionError::Io { action, device: device.to_owned(), error };
    let file = File::options().read(true).write(true).open(device).map_err(io("opening"))?;
    let geometry = Geometry { sector, sectors: size / sector };
    let read = |lba: u64, len: usize| -> Result<Vec<u8>, PartitionError> {
        let mut buffer = vec![0; len];
        file.read_exact_at(&mut buffer, lba * sector).map_err(io("reading"))?;
        Ok(buffer)
    };
    let write =
        |lba: u64, data: &[u8]| file.write_all_at(data, lba * sector).map_err(io("writing"));
    let mut mbr = Mbr(read(0, sector as usize)?);
    let header = read(1, sector as usize)?;
    let (first, last) = if header.starts_with(GPT_SIGNATURE) {
        Gpt::check(&header, geometry.sectors, sector)?;
        let (count, entry_size) = (u32_at(&header, 80) as usize, u32_at(&header, 84) as usize);
        let old_backup = u64_at(&header, 32);
        let entries = read(u64_at(&header, 72), count * entry_size)?;
        let mut gpt = Gpt { header, entries };
        let seed = gpt.add_seed(&geometry, grow)?;
        let backup_entries_lba = geometry.sectors - 1 - gpt.entries_sectors(&geometry);
        let backup = gpt.backup(backup_entries_lba);
        // The image's backup header, now inside the disk: a stale one would confuse tools.
        if old_backup != geometry.sectors - 1 && old_backup < geometry.sectors {
            write(old_backup, &vec![0; sector as usize])?;
        }
        write(gpt.entries_lba(), &gpt.entries)?;
        write(backup_entries_lba, &gpt.entries)?;
        write(geometry.sectors - 1, &backup)?;
        write(1, &gpt.header)?;
        mbr.protect(&geometry);
        write(0, &mbr.0)?;
        seed
    } else if mbr.0[510..512] == [0x55, 0xaa] && (0..4).any(|i| mbr.kind(i) != 0) {
        let seed = mbr.add_seed(&geometry, grow)?;
        write(0, &mbr.0)?;
        seed
    } else {
        return Err(PartitionError::NoTable);
    };
    file.sync_all().map_err(io("syncing"))?;
    Ok(SeedPlace { offset: first * sector, len: (last - first + 1) * sector })
}

/// The partitions `file` (`size` bytes, `sector`-byte sectors) holds by its tables, in bytes
/// (offset, length): the GPT's (primary, and backup at the disk's end, whichever are intact) and
/// the MBR's primaries. What a quick wipe must clear the ends of; empty if there is no table.
pub fn partitions(file: &File, size: u64, sector: u64) -> io::Result<Vec<(u64, u64)>> {
    let sectors = size / sector;
    let read = |lba: u64, len: usize| -> io::Result<Vec<u8>> {
        let mut buffer = vec![0; len];
        file.read_exact_at(&mut buffer, lba * sector)?;
        Ok(buffer)
    };
    let mut found = Vec::new();
    if sectors < 3 {
        return Ok(found);
    }
    for lba in [1, sectors - 1] {
        let header = read(lba, sector as usize)?;
        if !header.starts_with(GPT_SIGNATURE) {
            continue;
        }
        if let Err(e) = Gpt::check(&header, sectors, sector) {
            eprintln!("siteboot-agent: ignoring the GPT at sector {lba}: {e}");
            continue;
        }
        let (count, entry_size) = (u32_at(&header, 80) as usize, u32_at(&header, 84) as usize);
        let Ok(entries) = read(u64_at(&header, 72), count * entry_size) else { continue };
        let gpt = Gpt { header, entries };
        for i in 0..count {
            let entry = gpt.entry(i);
            let (first, last) = (u64_at(entry, 32), u64_at(entry, 40));
            if entry[..16] != [0; 16] && first <= last && last < sectors {
                found.push((first * sector, (last - first + 1) * sector));
            }
        }
    }
    let mbr = Mbr(read(0, sector as usize)?);
    if mbr.0[510..512] == [0x55, 0xaa] {
        for i in (0..4).filter(|&i| ![0, MBR_GPT_PROTECTIVE].contains(&mbr.kind(i))) {
            let (start, len) =
                (u64::from(u32_at(mbr.entry(i), 8)), u64::from(u32_at(mbr.entry(i), 12)));
            if len > 0 && start + len <= sectors {
                found.push((start * sector, len * sector));
            }
        }
    }
    found.sort_unstable();
    found.dedup();
    Ok(found)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::process::Command;

    use super::*;

    const MIB: u64 = 1 << 20;

    /// Runs a tool the tests need (scripts/setup installs it) and returns its stdout.
    pub(crate) fn run(program: &str, args: &[&str], stdin: Option<&str>) -> String {
        use std::io::Write;
        let mut child = Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{program} (scripts/setup installs it): {e}"));
        child.stdin.take().unwrap().write_all(stdin.unwrap_or_default().as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{program} {args:?}: {}\n{text}\n{err}", out.status);
        text + &err
    }

    /// An image of `image_mib` partitioned by `sfdisk` with `script`, written to the start of a
    /// disk of `disk_mib` (as [`crate::write`] leaves it).
    pub(crate) fn written_disk(
        image_mib: u64,
        disk_mib: u64,
        script: &str,
    ) -> tempfile::NamedTempFile {
        let disk = tempfile::NamedTempFile::new().unwrap();
        disk.as_file().set_len(image_mib * MIB).unwrap();
        let path = disk.path().to_str().unwrap();
        run("sfdisk", &["--no-reread", "--no-tell-kernel", path], Some(script));
        disk.as_file().set_len(disk_mib * MIB).unwrap();
        disk
    }

    /// Rewrites the GPT header at `lba` of `disk` (512-byte sectors) with `value` at byte `at`
    /// and a valid CRC: a hostile table, not a damaged one.
    pub(crate) fn forge_gpt(disk: &File, lba: u64, at: usize, value: &[u8]) {
        let mut header = vec![0; 512];
        disk.read_exact_at(&mut header, lba * 512).unwrap();
        header[at..at + value.len()].copy_from_slice(value);
        seal(&mut header);
        disk.write_all_at(&header, lba * 512).unwrap();
    }

    fn sfdisk_dump(disk: &Path) -> String {
        run("sfdisk", &["-d", disk.to_str().unwrap()], None)
    }

    #[test]
    fn gpt_grown_with_the_backup_at_the_disk_end() {
        let disk = written_disk(32, 100, "label: gpt\n,8M,U\n,,L\n");
        let path = disk.path();
        let seed = add_seed_partition(path, 100 * MIB, 512, true).unwrap();
        let (seed_start, seed_end) = (seed.offset / 512, (seed.offset + seed.len) / 512 - 1);
        // The seed: MiB-aligned, at least SEED_BYTES, ending at the last usable sector.
        assert_eq!(seed_start % 2048, 0);
        assert!(seed.len >= SEED_BYTES && seed.len < SEED_BYTES + MIB, "{seed:?}");
        assert_eq!(seed_end, 100 * 2048 - 34);
        let verified = run("sgdisk", &["-v", path.to_str().unwrap()], None);
        assert!(verified.contains("No problems found"), "{verified}");
        let dump = sfdisk_dump(path);
        assert!(dump.contains(&format!("last-lba: {seed_end}")), "{dump}");
        let root_size = seed_start - 18432;
        assert!(dump.contains(&format!("start=       18432, size={root_size:>12}")), "{dump}");
        let seed_line = format!("start={seed_start:>12}, size={:>12}", seed_end - seed_start + 1);
        assert!(dump.contains(&seed_line) && dump.contains("name=\"CIDATA\""), "{dump}");
    }

    #[test]
    fn gpt_not_grown_keeps_the_last_partition() {
        let disk = written_disk(32, 100, "label: gpt\n,8M,U\n,,L\n");
        add_seed_partition(disk.path(), 100 * MIB, 512, false).unwrap();
        let verified = run("sgdisk", &["-v", disk.path().to_str().unwrap()], None);
        assert!(verified.contains("No problems found"), "{verified}");
        let dump = sfdisk_dump(disk.path());
        // The image's root partition ends where sfdisk put it (aligned, within 32 MiB).
        assert!(dump.contains("start=       18432, size=       45056"), "{dump}");
    }

    #[test]
    fn mbr_grown_and_seeded() {
        let disk = written_disk(32, 100, "label: dos\n,8M,c\n,,83\n");
        let seed = add_seed_partition(disk.path(), 100 * MIB, 512, true).unwrap();
        let seed_start = seed.offset / 512;
        assert_eq!((seed.offset + seed.len) / 512, 100 * 2048);
        let dump = sfdisk_dump(disk.path());
        let root = format!("start=       18432, size={:>12}, type=83", seed_start - 18432);
        assert!(dump.contains(&root), "{dump}");
        let seed_line = format!("start={seed_start:>12}, size={:>12}, type=e", seed.len / 512);
        assert!(dump.contains(&seed_line), "{dump}");
        run("sfdisk", &["--verify", disk.path().to_str().unwrap()], None);
    }

    #[test]
    fn what_cannot_take_a_seed() {
        let blank = tempfile::NamedTempFile::new().unwrap();
        blank.as_file().set_len(100 * MIB).unwrap();
        let e = add_seed_partition(blank.path(), 100 * MIB, 512, true).unwrap_err();
        assert!(matches!(e, PartitionError::NoTable), "{e}");
        // An image that fills the disk leaves no room.
        let full = written_disk(100, 100, "label: gpt\n,,L\n");
        let e = add_seed_partition(full.path(), 100 * MIB, 512, true).unwrap_err();
        assert!(matches!(e, PartitionError::NoRoom { .. }), "{e}");
        let four = written_disk(32, 100, "label: dos\n,4M\n,4M\n,4M\n,4M\n");
        let e = add_seed_partition(four.path(), 100 * MIB, 512, true).unwrap_err();
        assert!(matches!(e, PartitionError::TableFull), "{e}");
        // A damaged GPT header is refused, not trusted. A byte of the disk GUID is flipped:
        // written over with a constant, it was left unchanged when the random GUID had that
        // byte already (1 run in 256).
        let damaged = written_disk(32, 100, "label: gpt\n,,L\n");
        let mut byte = [0u8];
        damaged.as_file().read_exact_at(&mut byte, 512 + 60).unwrap();
        damaged.as_file().write_all_at(&[!byte[0]], 512 + 60).unwrap();
        let e = add_seed_partition(damaged.path(), 100 * MIB, 512, true).unwrap_err();
        assert!(matches!(e, PartitionError::BadGpt("header CRC")), "{e}");
    }

    #[test]
    fn hostile_gpt_headers_are_refused_by_field() {
        let cases: [(usize, &[u8], &str); 5] = [
            // Entries "past" the disk: the byte offset overflows.
            (72, &(u64::MAX / 4).to_le_bytes(), "entries LBA"),
            // Passes a multiple-of-8 check: 1024 entries of 4 GiB, 4 TiB to allocate.
            (84, &0xffff_fff8_u32.to_le_bytes(), "entry size"),
            (84, &0xffff_ffff_u32.to_le_bytes(), "entry size"),
            (84, &192_u32.to_le_bytes(), "entry size"),
            (80, &0xffff_ffff_u32.to_le_bytes(), "entry count"),
        ];
        for (at, value, field) in cases {
            let disk = written_disk(32, 32, "label: gpt\n,8M,U\n,,L\n");
            let intact = partitions(disk.as_file(), 32 * MIB, 512).unwrap();
            assert_eq!(intact.len(), 2, "{intact:?}");
            forge_gpt(disk.as_file(), 1, at, value);
            // The hostile primary is ignored; the intact backup still lists the partitions.
            let found = partitions(disk.as_file(), 32 * MIB, 512).unwrap();
            assert_eq!(found, intact, "{field}");
            disk.as_file().set_len(100 * MIB).unwrap();
            let e = add_seed_partition(disk.path(), 100 * MIB, 512, true).unwrap_err();
            assert!(matches!(e, PartitionError::BadGpt(f) if f == field), "{field}: {e}");
            assert!(e.to_string().contains(field), "{e}");
        }
    }
}
