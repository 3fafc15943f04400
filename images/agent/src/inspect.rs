//! Inspection: what the machine is, read from sysfs and procfs (under a root given as a path,
//! so tests read a fake tree) into the `Hardware` body of `POST v1/inspection`
//! (docs/agent-api.md). Whatever a file does not say is left out rather than guessed.

use std::fs;
use std::path::{Path, PathBuf};

use siteboot_agent_api::{Disk, Hardware, Nic, System};

/// The kernel's views of the machine: `<root>/sys`, `<root>/proc` and the disks' device nodes
/// under `<root>/dev` (`/` on the ramdisk).
#[derive(Debug, Clone)]
pub struct SystemRoot(pub PathBuf);

impl SystemRoot {
    fn sys(&self, rest: &str) -> PathBuf {
        self.0.join("sys").join(rest)
    }

    /// Reads everything inspection reports.
    pub fn hardware(&self) -> Hardware {
        let meminfo = fs::read_to_string(self.0.join("proc/meminfo")).unwrap_or_default();
        let online = fs::read_to_string(self.sys("devices/system/cpu/online")).unwrap_or_default();
        Hardware {
            cpus: count_cpus(&online),
            memory_mib: memory_mib(&meminfo),
            arch: Some(std::env::consts::ARCH.to_owned()),
            system: self.system(),
            disks: self.disks(),
            nics: self.nics(),
        }
    }

    fn system(&self) -> Option<System> {
        let dmi = self.sys("class/dmi/id");
        Some(System {
            uuid: read(&dmi.join("product_uuid"))?.to_ascii_lowercase(),
            vendor: read(&dmi.join("sys_vendor")),
            model: read(&dmi.join("product_name")),
            serial: read(&dmi.join("product_serial")),
        })
    }

    /// The machine's disks, by name: block devices backed by a device (not loop, ram, dm or
    /// md, which have none), except optical drives, and not empty (a card reader without a card).
    pub fn disks(&self) -> Vec<Disk> {
        let mut disks: Vec<Disk> = entries(&self.sys("block"))
            .into_iter()
            .filter(|(name, dir)| !name.starts_with("sr") && dir.join("device").exists())
            .filter_map(|(name, dir)| {
                // Always in 512-byte units, whatever the device's sector size.
                let sectors: u64 = read(&dir.join("size"))?.parse().ok()?;
                let device = dir.join("device");
                Some(Disk {
                    name: format!("/dev/{name}"),
                    size_bytes: sectors * 512,
                    model: read(&device.join("model")),
                    serial: read(&dir.join("serial"))
                        .or_else(|| read(&device.join("serial")))
                        .or_else(|| vpd_serial(&fs::read(device.join("vpd_pg80")).ok()?)),
                    wwn: read(&device.join("wwid")).or_else(|| read(&dir.join("wwid"))),
                    rotational: read(&dir.join("queue/rotational")).as_deref() == Some("1"),
                })
            })
            .filter(|disk| disk.size_bytes > 0)
            .collect();
        disks.sort_by(|a, b| a.name.cmp(&b.name));
        disks
    }

    /// The device node of the disk `/dev/<name>` under this root (itself on the ramdisk).
    pub fn device(&self, name: &str) -> PathBuf {
        self.0.join(name.trim_start_matches('/'))
    }

    /// The logical sector size of the disk `/dev/<name>` (what partition tables count in).
    pub fn logical_block_size(&self, name: &str) -> u64 {
        let name = name.strip_prefix("/dev/").unwrap_or(name);
        let path = self.sys("block").join(name).join("queue/logical_block_size");
        read(&path).and_then(|s| s.parse().ok()).unwrap_or(512)
    }

    /// Network interfaces backed by a device (not lo, bridges or other virtual ones).
    fn nics(&self) -> Vec<Nic> {
        let mut nics: Vec<Nic> = entries(&self.sys("class/net"))
            .into_iter()
            .filter(|(_, dir)| dir.join("device").exists())
            .map(|(name, dir)| Nic {
                mac: read(&dir.join("address")).unwrap_or_default(),
                // Reading carrier of a link that is down fails (EINVAL): no link.
                link: Some(read(&dir.join("carrier")).as_deref() == Some("1")),
                // -1 (or unreadable) when there is no link.
                speed_mbps: read(&dir.join("speed")).and_then(|s| s.parse().ok()),
                name,
            })
            .collect();
        nics.sort_by(|a, b| a.name.cmp(&b.name));
        nics
    }
}

/// A sysfs attribute, trimmed; None if unreadable or empty.
fn read(path: &Path) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

/// The unit serial number of a SCSI VPD page 0x80 (`device/vpd_pg80` of SATA and SAS disks):
/// a 4-byte header whose last two bytes are the length, then ASCII, often padded with blanks.
fn vpd_serial(page: &[u8]) -> Option<String> {
    let (header, rest) = page.split_at_checked(4)?;
    if header[1] != 0x80 {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([header[2], header[3]]));
    let serial = std::str::from_utf8(rest.get(..len)?).ok()?.trim();
    (!serial.is_empty()).then(|| serial.to_owned())
}

fn entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(listing) = fs::read_dir(dir) else { return Vec::new() };
    listing.flatten().filter_map(|e| Some((e.file_name().into_string().ok()?, e.path()))).collect()
}

/// CPUs in a kernel CPU list (`/sys/devices/system/cpu/online`: `0-3,6,8-9`).
fn count_cpus(list: &str) -> u32 {
    list.trim()
        .split(',')
        .filter_map(|range| match range.split_once('-') {
            Some((a, b)) => Some(b.parse::<u32>().ok()?.checked_sub(a.parse().ok()?)? + 1),
            None => range.parse::<u32>().ok().map(|_| 1),
        })
        .sum()
}

/// `MemTotal` of `/proc/meminfo` (in kB) in MiB.
fn memory_mib(meminfo: &str) -> u64 {
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map_or(0, |kb| kb / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(root: &Path, path: &str, text: &str) {
        let path = root.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    #[test]
    fn cpu_lists_and_meminfo() {
        assert_eq!(count_cpus("0-3,6,8-9\n"), 7);
        assert_eq!(count_cpus("0\n"), 1);
        assert_eq!(count_cpus(""), 0);
        assert_eq!(memory_mib("MemTotal:        2048000 kB\nMemFree: 1 kB\n"), 2000);
        assert_eq!(memory_mib("MemFree: 1 kB\n"), 0);
    }

    #[test]
    fn scsi_serial_pages() {
        assert_eq!(vpd_serial(b"\0\x80\0\x0a  WD-12345").as_deref(), Some("WD-12345"));
        assert_eq!(vpd_serial(b"\0\x80\0\x0a  WD-1"), None, "shorter than its length");
        assert_eq!(vpd_serial(b"\0\x83\0\x02ab"), None, "another page");
        assert_eq!(vpd_serial(b"\0\x80\0\x02  "), None, "blank");
        assert_eq!(vpd_serial(b"\0\x80"), None);
    }

    #[test]
    fn a_fake_machine() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        put(root, "proc/meminfo", "MemTotal:        2097152 kB\n");
        put(root, "sys/devices/system/cpu/online", "0-1\n");
        put(root, "sys/class/dmi/id/product_uuid", "5E7B0000-0000-4000-8000-525400000001\n");
        put(root, "sys/class/dmi/id/sys_vendor", "QEMU\n");
        put(root, "sys/class/dmi/id/product_name", "Standard PC (Q35 + ICH9, 2009)\n");
        put(root, "sys/class/dmi/id/product_serial", "\n");
        // A virtio disk (serial beside it), a SCSI disk (serial and wwid under device/), an
        // NVMe namespace (wwid beside it), and what is not a disk.
        put(root, "sys/block/vda/size", "2097152\n");
        put(root, "sys/block/vda/serial", "disk-a\n");
        put(root, "sys/block/vda/queue/rotational", "0\n");
        fs::create_dir_all(root.join("sys/block/vda/device")).unwrap();
        put(root, "sys/block/sdb/size", "4194304\n");
        put(root, "sys/block/sdb/device/model", "QEMU HARDDISK   \n");
        put(root, "sys/block/sdb/device/serial", "disk-b\n");
        put(root, "sys/block/sdb/device/wwid", "naa.5000c500a1b2c3d4\n");
        put(root, "sys/block/sdb/queue/rotational", "1\n");
        put(root, "sys/block/sdb/queue/logical_block_size", "4096\n");
        put(root, "sys/block/nvme0n1/size", "8\n");
        put(root, "sys/block/nvme0n1/wwid", "eui.0025388b91b2c3d4\n");
        put(root, "sys/block/nvme0n1/device/model", "NVMe disk\n");
        put(root, "sys/block/sdd/size", "16\n");
        put(root, "sys/block/sdd/device/vpd_pg80", "");
        fs::write(root.join("sys/block/sdd/device/vpd_pg80"), b"\0\x80\0\x08SER-D   ").unwrap();
        put(root, "sys/block/loop0/size", "2048\n");
        put(root, "sys/block/dm-0/size", "2048\n");
        put(root, "sys/block/sr0/size", "2048\n");
        fs::create_dir_all(root.join("sys/block/sr0/device")).unwrap();
        put(root, "sys/block/sdc/size", "0\n");
        fs::create_dir_all(root.join("sys/block/sdc/device")).unwrap();
        put(root, "sys/class/net/eth0/address", "52:54:00:12:34:56\n");
        put(root, "sys/class/net/eth0/carrier", "1\n");
        put(root, "sys/class/net/eth0/speed", "1000\n");
        fs::create_dir_all(root.join("sys/class/net/eth0/device")).unwrap();
        put(root, "sys/class/net/eth1/address", "52:54:00:12:34:57\n");
        put(root, "sys/class/net/eth1/speed", "-1\n");
        fs::create_dir_all(root.join("sys/class/net/eth1/device")).unwrap();
        put(root, "sys/class/net/lo/address", "00:00:00:00:00:00\n");

        let system = SystemRoot(root.to_owned());
        assert_eq!(system.logical_block_size("/dev/sdb"), 4096);
        assert_eq!(system.logical_block_size("/dev/vda"), 512);
        let hardware = system.hardware();
        let json = serde_json::to_value(&hardware).unwrap();
        let expected = serde_json::json!({
            "cpus": 2, "memoryMiB": 2048, "arch": std::env::consts::ARCH,
            "system": {"uuid": "5e7b0000-0000-4000-8000-525400000001", "vendor": "QEMU",
                       "model": "Standard PC (Q35 + ICH9, 2009)"},
            "disks": [
                {"name": "/dev/nvme0n1", "sizeBytes": 4096, "model": "NVMe disk",
                 "wwn": "eui.0025388b91b2c3d4", "rotational": false},
                {"name": "/dev/sdb", "sizeBytes": 2147483648u64, "model": "QEMU HARDDISK",
                 "serial": "disk-b", "wwn": "naa.5000c500a1b2c3d4", "rotational": true},
                {"name": "/dev/sdd", "sizeBytes": 8192, "serial": "SER-D", "rotational": false},
                {"name": "/dev/vda", "sizeBytes": 1073741824u64, "serial": "disk-a",
                 "rotational": false},
            ],
            "nics": [
                {"name": "eth0", "mac": "52:54:00:12:34:56", "link": true, "speedMbps": 1000},
                {"name": "eth1", "mac": "52:54:00:12:34:57", "link": false},
            ],
        });
        assert_eq!(json, expected);
    }

    #[test]
    fn an_empty_tree_reports_nothing_made_up() {
        let dir = tempfile::tempdir().unwrap();
        let hardware = SystemRoot(dir.path().to_owned()).hardware();
        assert_eq!((hardware.cpus, hardware.memory_mib), (0, 0));
        assert_eq!(hardware.system, None);
        assert!(hardware.disks.is_empty() && hardware.nics.is_empty());
    }
}
