//! The NoCloud seed: a FAT filesystem labelled `CIDATA` holding `user-data` (the bootstrap
//! data, as the appliance serves it) and `meta-data` (the task's `metaData`, written as JSON,
//! which YAML readers such as cloud-init's read as YAML). cloud-init finds it by its label and
//! needs both files, and an `instance-id` in meta-data.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::partition::SeedPlace;

/// The filesystem label cloud-init's NoCloud datasource looks for.
pub const LABEL: &[u8; 11] = b"CIDATA     ";

/// A task's `metaData`, with the non-empty `instance-id` cloud-init needs.
#[derive(Debug, Clone, PartialEq)]
pub struct MetaData(siteboot_agent_api::MetaData);

#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error("metaData has no instance-id string, which cloud-init requires")]
    NoInstanceId,
    #[error("writing the NoCloud seed to {}: {error}", device.display())]
    Io { device: PathBuf, error: io::Error },
}

impl MetaData {
    pub fn new(fields: siteboot_agent_api::MetaData) -> Result<Self, SeedError> {
        if fields.instance_id.is_empty() { Err(SeedError::NoInstanceId) } else { Ok(Self(fields)) }
    }

    /// The `meta-data` file.
    fn file(&self) -> Vec<u8> {
        let mut text = serde_json::to_vec_pretty(&self.0).expect("meta-data serializes");
        text.push(b'\n');
        text
    }
}

/// Formats the partition at `place` on `device` (`sector`-byte logical sectors, which FAT's
/// sectors match) as the seed with `user_data` and `meta_data`.
pub fn write_seed(
    device: &Path,
    place: SeedPlace,
    sector: u64,
    user_data: &[u8],
    meta_data: &MetaData,
) -> Result<(), SeedError> {
    let io = |error| SeedError::Io { device: device.to_owned(), error };
    let file = File::options().read(true).write(true).open(device).map_err(io)?;
    let sectors = u32::try_from(place.len / sector).expect("a seed partition is a few MiB");
    let sector = u16::try_from(sector).expect("logical sectors are 512 to 4096 bytes");
    let options = fatfs::FormatVolumeOptions::new()
        .volume_label(*LABEL)
        .bytes_per_sector(sector)
        .total_sectors(sectors);
    fatfs::format_volume(Slice::new(&file, place), options).map_err(io)?;
    {
        let fs = fatfs::FileSystem::new(Slice::new(&file, place), fatfs::FsOptions::new())
            .map_err(io)?;
        for (name, data) in [("user-data", user_data), ("meta-data", &meta_data.file()[..])] {
            let mut f = fs.root_dir().create_file(name).map_err(io)?;
            f.truncate().map_err(io)?;
            f.write_all(data).map_err(io)?;
            f.flush().map_err(io)?;
        }
        fs.unmount().map_err(io)?;
    }
    file.sync_all().map_err(io)
}

/// A partition of a disk as a stream of its own: what fatfs formats and writes.
struct Slice<'a> {
    file: &'a File,
    place: SeedPlace,
    position: u64,
}

impl<'a> Slice<'a> {
    fn new(file: &'a File, place: SeedPlace) -> Self {
        Self { file, place, position: 0 }
    }

    /// How much of `len` fits before the partition's end.
    fn room(&self, len: usize) -> usize {
        (self.place.len.saturating_sub(self.position)).min(len as u64) as usize
    }
}

impl Read for Slice<'_> {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        let n = self.room(buffer.len());
        let n = self.file.read_at(&mut buffer[..n], self.place.offset + self.position)?;
        self.position += n as u64;
        Ok(n)
    }
}

impl Write for Slice<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = self.room(data.len());
        if n == 0 && !data.is_empty() {
            return Err(io::Error::new(io::ErrorKind::StorageFull, "past the seed's end"));
        }
        let n = self.file.write_at(&data[..n], self.place.offset + self.position)?;
        self.position += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Seek for Slice<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let position = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::Current(d) => self.position.checked_add_signed(d),
            SeekFrom::End(d) => self.place.len.checked_add_signed(d),
        };
        self.position = position
            .filter(|p| *p <= self.place.len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "outside the seed"))?;
        Ok(self.position)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;
    use crate::partition::add_seed_partition;
    use crate::partition::tests::{run, written_disk};

    fn meta_data() -> MetaData {
        MetaData::new(siteboot_agent_api::MetaData {
            instance_id: "default-worker-abc12".into(),
            local_hostname: Some("worker-1".into()),
            provider_id: Some("siteboot://default/worker-1".into()),
        })
        .unwrap()
    }

    #[test]
    fn a_seed_tools_and_cloud_init_can_read() {
        let disk = written_disk(32, 100, "label: gpt\n,8M,U\n,,L\n");
        let path = disk.path();
        let place = add_seed_partition(path, 100 << 20, 512, true).unwrap();
        let user_data = b"#cloud-config\nruncmd: [[kubeadm, join]]\n";
        write_seed(path, place, 512, user_data, &meta_data()).unwrap();

        let name = path.to_str().unwrap();
        let (offset, size) = (place.offset.to_string(), place.len.to_string());
        let probe = ["-p", "-o", "export", "-O", &offset, "-S", &size, name];
        let blkid = run("blkid", &probe, None);
        assert!(blkid.contains("LABEL=CIDATA") && blkid.contains("TYPE=vfat"), "{blkid}");
        // The rest of the disk is untouched by the seed: the partitions are still in order.
        let verified = run("sgdisk", &["-v", name], None);
        assert!(verified.contains("No problems found"), "{verified}");

        // fsck.vfat reads a filesystem from a file of its own.
        let alone = tempfile::NamedTempFile::new().unwrap();
        let bytes = std::fs::read(path).unwrap();
        let seed = &bytes[place.offset as usize..][..place.len as usize];
        std::fs::write(alone.path(), seed).unwrap();
        let alone = alone.path().to_str().unwrap();
        run("fsck.vfat", &["-n", alone], None);
        let read = |file: &str| run("mcopy", &["-n", "-i", alone, &format!("::{file}"), "-"], None);
        assert_eq!(read("user-data").as_bytes(), user_data);
        let meta: Value = serde_json::from_str(&read("meta-data")).unwrap();
        assert_eq!(meta["instance-id"], "default-worker-abc12");
        assert_eq!(meta["provider-id"], "siteboot://default/worker-1");
    }

    /// The file is what it was when the task carried a JSON map: pretty, keys sorted.
    #[test]
    fn the_meta_data_file() {
        let expected = r#"{
  "instance-id": "default-worker-abc12",
  "local-hostname": "worker-1",
  "provider-id": "siteboot://default/worker-1"
}
"#;
        assert_eq!(String::from_utf8(meta_data().file()).unwrap(), expected);
    }

    #[test]
    fn meta_data_needs_an_instance_id() {
        let none = MetaData::new(siteboot_agent_api::MetaData::default());
        assert!(matches!(none, Err(SeedError::NoInstanceId)));
    }
}
