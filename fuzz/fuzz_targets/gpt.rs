//! A previous tenant's disk as arbitrary bytes: the partition tables the agent reads before a
//! quick wipe (`partitions`) and rewrites after imaging (`add_seed_partition`), on a sparse
//! 64 MiB disk with 512- or 4096-byte sectors. The first byte chooses the sector size, whether
//! the last partition grows, and the disk's shape: raw (the input's first half at the disk's
//! start, its second half at the end) or a GPT whose header the target signs (the input's next
//! 92 bytes as the header at LBA 1 with the signature, size and CRC made right, so the fuzzer
//! reaches the fields a CRC would otherwise hide; the rest as the entries at LBA 2, and the MBR
//! left empty). Every partition found must lie inside the disk, a seed placed must too and be
//! read back, and nothing may panic or allocate without bound (the run's `-rss_limit_mb`).

#![no_main]

use std::os::unix::fs::FileExt;

use libfuzzer_sys::fuzz_target;
use siteboot_agent::partition::{self, SEED_BYTES};

const DISK: u64 = 64 << 20;
const HEADER: usize = 92;

fuzz_target!(|data: &[u8]| {
    let Some((&shape, tables)) = data.split_first() else { return };
    let sector: u64 = if shape & 1 == 0 { 512 } else { 4096 };
    let grow = shape & 2 != 0;
    let disk = tempfile::NamedTempFile::new().expect("a temporary disk");
    let file = disk.as_file();
    file.set_len(DISK).expect("a sparse disk");
    if shape & 4 == 0 {
        let (start, end) = tables.split_at(tables.len() / 2);
        file.write_all_at(start, 0).expect("the disk's start");
        file.write_all_at(end, DISK - end.len() as u64).expect("the disk's end");
    } else {
        let (fields, entries) = tables.split_at(tables.len().min(HEADER));
        let mut header = [0u8; HEADER];
        header[..fields.len()].copy_from_slice(fields);
        header[..8].copy_from_slice(b"EFI PART");
        header[12..16].copy_from_slice(&(HEADER as u32).to_le_bytes());
        header[16..20].fill(0);
        let crc = crc32fast::hash(&header);
        header[16..20].copy_from_slice(&crc.to_le_bytes());
        file.write_all_at(&header, sector).expect("the GPT header");
        file.write_all_at(entries, 2 * sector).expect("the GPT entries");
    }

    for (offset, len) in partition::partitions(file, DISK, sector).expect("reads inside the disk") {
        assert!(len > 0 && offset.checked_add(len).is_some_and(|e| e <= DISK), "{offset}+{len}");
    }
    if let Ok(seed) = partition::add_seed_partition(disk.path(), DISK, sector, grow) {
        assert!(seed.len >= SEED_BYTES && seed.offset + seed.len <= DISK, "{seed:?}");
        let found = partition::partitions(file, DISK, sector).expect("reads inside the disk");
        assert!(found.contains(&(seed.offset, seed.len)), "{seed:?} not in {found:?}");
    }
});
