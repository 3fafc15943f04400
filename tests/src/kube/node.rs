//! Kubernetes nodes as VMs: the Debian 12 node image `scripts/build-node-image` builds (cached
//! under `$SITEBOOT_CACHE/images/`) with the peers' kubelet, booted by QEMU straight into a
//! copy-on-write overlay of its disk with a NoCloud seed (a `cidata` volume holding user-data and
//! meta-data), as a cloud would boot it.
//!
//! The image prints one `NODE-CHECKLIST key=value ...` line on the console once cloud-init is
//! done (`tests/fixtures/node-image/rootfs/usr/local/sbin/node-checklist`) and writes its whole
//! journal to the second serial port, which is printed with the console if the test fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::{Peers, peers};
use crate::netns::Netns;
use crate::vm::{Drive, KernelBoot, KernelVm};

/// The image's own files, and the builder.
const BUILDER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/build-node-image");
const CHECKLIST: &str = "NODE-CHECKLIST";
const MEMORY_MB: u32 = 2048;
const CPUS: u32 = 2;

/// A built node image: `disk.raw` (ext4, the whole disk), `vmlinuz`, `initrd.img`.
#[derive(Debug, Clone)]
pub struct NodeImage {
    dir: PathBuf,
}

impl NodeImage {
    /// Runs `scripts/build-node-image` with the peers' kubelet: at once when the image for these
    /// inputs is in the cache, minutes (debootstrap from the Debian mirror) when it is not.
    pub fn build(peers: &Peers) -> Result<Self> {
        let output = Command::new(BUILDER)
            .arg(peers.bin(peers::KUBELET))
            .output()
            .with_context(|| format!("running {BUILDER}"))?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            bail!("{BUILDER} failed ({}):\n{stderr}", output.status);
        }
        let stdout = String::from_utf8(output.stdout)?;
        let dir = PathBuf::from(stdout.lines().last().context("the builder printed no path")?);
        for file in ["disk.raw", "vmlinuz", "initrd.img", ".complete"] {
            if !dir.join(file).is_file() {
                bail!("{} has no {file}; builder output:\n{stderr}", dir.display());
            }
        }
        Ok(Self { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// NoCloud meta-data.
#[derive(Debug, Clone)]
pub struct MetaData {
    pub instance_id: String,
    pub local_hostname: String,
    /// `provider-id`, which the bootstrap data gives the kubelet; None leaves the key out.
    pub provider_id: Option<String>,
}

impl MetaData {
    fn yaml(&self) -> Result<String> {
        let mut map = BTreeMap::from([
            ("instance-id", self.instance_id.clone()),
            ("local-hostname", self.local_hostname.clone()),
        ]);
        if let Some(provider_id) = &self.provider_id {
            map.insert("provider-id", provider_id.clone());
        }
        Ok(serde_yaml::to_string(&map)?)
    }
}

/// A node VM: the image's kernel, its disk under a throwaway overlay, the seed; QEMU runs in
/// `ns`, so the guest reaches that namespace's loopback at 10.0.2.2 (see [`KernelVm`]).
pub struct NodeVm {
    vm: KernelVm,
    _dir: tempfile::TempDir,
}

impl NodeVm {
    pub fn boot(
        image: &NodeImage,
        ns: &Netns,
        name: &str,
        user_data: &str,
        meta_data: &MetaData,
    ) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("siteboot-node-").tempdir()?;
        let overlay = dir.path().join("disk.qcow2");
        run(Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
            .arg(image.dir.join("disk.raw"))
            .arg(&overlay))?;
        let seed = dir.path().join("seed.img");
        nocloud_seed(&seed, dir.path(), user_data, &meta_data.yaml()?)?;
        let boot = KernelBoot {
            name: name.to_owned(),
            kernel: image.dir.join("vmlinuz"),
            initrd: image.dir.join("initrd.img"),
            // No partition table: the disk is the root filesystem. panic=-1 with -no-reboot:
            // a panic ends QEMU at once.
            append: "root=/dev/vda rw console=ttyS0 net.ifnames=0 noresume panic=-1".into(),
            drives: vec![
                Drive { path: overlay, format: "qcow2", read_only: false },
                Drive { path: seed, format: "raw", read_only: true },
            ],
            memory_mb: MEMORY_MB,
            cpus: CPUS,
        };
        Ok(Self { vm: KernelVm::start(ns, &boot)?, _dir: dir })
    }

    pub fn vm(&mut self) -> &mut KernelVm {
        &mut self.vm
    }

    /// Waits for the image's checklist line and returns its `key=value` pairs.
    pub fn checklist(&mut self, timeout: Duration) -> Result<BTreeMap<String, String>> {
        let line = self.vm.wait_for_console(CHECKLIST, timeout)?;
        Ok(line
            .split_whitespace()
            .skip(1)
            .filter_map(|pair| pair.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect())
    }
}

/// A NoCloud seed: a FAT volume labelled `cidata` with `user-data` and `meta-data`, made by
/// mkfs.vfat and mtools (no loop mount).
fn nocloud_seed(seed: &Path, scratch: &Path, user_data: &str, meta_data: &str) -> Result<()> {
    let (user, meta) = (scratch.join("user-data"), scratch.join("meta-data"));
    std::fs::write(&user, user_data)?;
    std::fs::write(&meta, meta_data)?;
    // 4 MiB, in 1 KiB blocks.
    run(Command::new("mkfs.vfat").args(["-n", "CIDATA", "-C"]).arg(seed).arg("4096"))?;
    run(Command::new("mcopy").arg("-i").arg(seed).arg(&user).arg(&meta).arg("::"))
}

fn run(command: &mut Command) -> Result<()> {
    let output = command.output().with_context(|| format!("running {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}
