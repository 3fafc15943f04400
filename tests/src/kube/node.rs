//! Kubernetes nodes as VMs: the Debian 12 node image `scripts/build-node-image` builds (cached
//! under `$SITEBOOT_CACHE/images/`) with the peers' binaries, booted by QEMU through SeaBIOS and
//! the image's GRUB from a copy-on-write overlay of its disk with a NoCloud seed (a `cidata`
//! volume holding user-data and meta-data), as a cloud would boot it.
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
use crate::vm::{DiskBoot, DiskVm, Drive};

/// The image's own files, and the builder.
const BUILDER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/build-node-image");
/// What starts the image's checklist line on the console.
pub const CHECKLIST: &str = "NODE-CHECKLIST";
const MEMORY_MB: u32 = 2048;
/// What a server's disk has beyond the node image.
const SERVER_DISK_ROOM: u64 = 1 << 30;
const CPUS: u32 = 2;

/// A built node image: `disk.raw` (a GPT disk that boots under BIOS and UEFI) and
/// `disk.raw.zst`, whose SHA-256 is `sha256`.
#[derive(Debug, Clone)]
pub struct NodeImage {
    dir: PathBuf,
    /// SHA-256 of `disk.raw.zst`, hex.
    pub sha256: String,
}

impl NodeImage {
    /// Runs `scripts/build-node-image` with the peers' binaries folder (their kubelet and
    /// kubeadm, and the control plane's images built from their kube-apiserver,
    /// kube-controller-manager, kube-scheduler and etcd): at once when the image for these
    /// inputs is in the cache, minutes (debootstrap from the Debian mirror) when it is not.
    pub fn build(peers: &Peers) -> Result<Self> {
        let bin = peers.bin(peers::KUBELET);
        let bin = bin.parent().context("the peers' kubelet has no folder")?;
        let output = Command::new(BUILDER)
            .arg(bin)
            .output()
            .with_context(|| format!("running {BUILDER}"))?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            bail!("{BUILDER} failed ({}):\n{stderr}", output.status);
        }
        let stdout = String::from_utf8(output.stdout)?;
        let dir = PathBuf::from(stdout.lines().last().context("the builder printed no path")?);
        for file in ["disk.raw", "disk.raw.zst", "sha256", ".complete"] {
            if !dir.join(file).is_file() {
                bail!("{} has no {file}; builder output:\n{stderr}", dir.display());
            }
        }
        let sha256 = std::fs::read_to_string(dir.join("sha256"))?.trim().to_owned();
        Ok(Self { dir, sha256 })
    }

    /// The image's raw disk (sparse).
    pub fn disk(&self) -> PathBuf {
        self.dir.join("disk.raw")
    }

    /// The image as siteboot serves it: zstd-compressed.
    pub fn compressed(&self) -> PathBuf {
        self.dir.join("disk.raw.zst")
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
        Ok(serde_norway::to_string(&map)?)
    }
}

/// A node VM: the image's disk under a throwaway overlay, the seed; QEMU runs in `ns`, so the
/// guest reaches that namespace's loopback at 10.0.2.2 (see [`DiskVm`]).
pub struct NodeVm {
    vm: DiskVm,
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
            .arg(image.disk())
            .arg(&overlay))?;
        let seed = dir.path().join("seed.img");
        nocloud_seed(&seed, dir.path(), user_data, &meta_data.yaml()?)?;
        let boot = DiskBoot {
            name: name.to_owned(),
            drives: vec![
                Drive { path: overlay, format: "qcow2", read_only: false },
                Drive { path: seed, format: "raw", read_only: true },
            ],
            memory_mb: MEMORY_MB,
            cpus: CPUS,
            mac: None,
            uuid: None,
            ssh_forward: None,
            reboots: false,
        };
        Ok(Self { vm: DiskVm::start(ns, &boot)?, _dir: dir })
    }

    pub fn vm(&mut self) -> &mut DiskVm {
        &mut self.vm
    }

    /// Waits for the image's checklist line and returns its `key=value` pairs.
    pub fn checklist(&mut self, timeout: Duration) -> Result<BTreeMap<String, String>> {
        Ok(checklist(&self.vm.wait_for_console(CHECKLIST, timeout)?))
    }
}

/// A file an installer would have put on a [`ServerVm`]'s disk.
pub struct InstalledFile<'a> {
    /// Absolute, in the guest.
    pub path: &'a str,
    pub contents: &'a [u8],
    pub mode: u32,
}

/// A server that already runs the node image, as an existing server runs its OS: booted from
/// its own copy of the image's disk with `files` written into it first, no seed, no network
/// boot path, and its sshd at `127.0.0.1:ssh_port` of the namespace QEMU runs in.
pub struct ServerVm {
    vm: DiskVm,
    uuid: String,
    _dir: tempfile::TempDir,
}

impl ServerVm {
    pub fn boot(
        image: &NodeImage,
        ns: &Netns,
        name: &str,
        mac: &str,
        ssh_port: u16,
        files: &[InstalledFile],
    ) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("siteboot-server-").tempdir()?;
        let disk = dir.path().join("disk.raw");
        run(Command::new("cp").arg("--sparse=always").arg(image.disk()).arg(&disk))?;
        install(&disk, dir.path(), files)?;
        // Larger than the image, as a server's disk is: reimaged, its NoCloud seed goes after
        // the image's partitions. (Sparse: the room costs nothing until written.)
        let file = std::fs::OpenOptions::new().write(true).open(&disk)?;
        file.set_len(file.metadata()?.len() + SERVER_DISK_ROOM)?;
        // A system UUID of its own, as a server has (siteboot finds its Node by it).
        let uuid = format!("00000000-0000-4000-8000-{}", mac.replace(':', "").to_lowercase());
        let boot = DiskBoot {
            name: name.to_owned(),
            drives: vec![Drive { path: disk, format: "raw", read_only: false }],
            memory_mb: MEMORY_MB,
            // One vCPU: it runs beside the libvirt lab's guests on a 2-core machine.
            cpus: 1,
            mac: Some(mac.to_owned()),
            uuid: Some(uuid.clone()),
            ssh_forward: Some(ssh_port),
            // Reimaged, it reboots into its new OS.
            reboots: true,
        };
        Ok(Self { vm: DiskVm::start(ns, &boot)?, uuid, _dir: dir })
    }

    pub fn vm(&self) -> &DiskVm {
        &self.vm
    }

    /// Its SMBIOS system UUID, in lower case.
    pub fn uuid(&self) -> &str {
        &self.uuid
    }
}

/// Writes `files` into the root file system of raw disk `disk` (its partition 3, see
/// `scripts/lib/bootable-disk.sh`), loop-mounted on a folder of `scratch`; parent folders are
/// made as needed.
fn install(disk: &Path, scratch: &Path, files: &[InstalledFile]) -> Result<()> {
    let listed = Command::new("partx").args(["-g", "-o", "START", "-n", "3"]).arg(disk).output()?;
    let start: u64 = String::from_utf8(listed.stdout)?
        .trim()
        .parse()
        .with_context(|| format!("partx found no partition 3 on {}", disk.display()))?;
    let root = scratch.join("root");
    std::fs::create_dir(&root)?;
    run(Command::new("mount")
        .arg("-o")
        .arg(format!("loop,offset={}", start * 512))
        .arg(disk)
        .arg(&root))?;
    let written = files.iter().try_for_each(|file| -> Result<()> {
        let at = root.join(file.path.trim_start_matches('/'));
        std::fs::create_dir_all(at.parent().context("a file at the root")?)?;
        std::fs::write(&at, file.contents)?;
        std::fs::set_permissions(&at, std::os::unix::fs::PermissionsExt::from_mode(file.mode))
            .with_context(|| format!("installing {}", file.path))
    });
    let unmounted = run(Command::new("umount").arg(&root));
    written.and(unmounted)
}

/// The `key=value` pairs of a console line from [`CHECKLIST`] on.
pub fn checklist(line: &str) -> BTreeMap<String, String> {
    let from = line.find(CHECKLIST).map_or(line.len(), |i| i + CHECKLIST.len());
    line[from..]
        .split_whitespace()
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Where a joined host's kubelet runs.
pub enum KubeletOn {
    /// `kubelet.service` on the host.
    Host,
    /// In the nspawn mode's container, run by the host's `kubelet-container.service`.
    Container,
}

/// The checklist of a host that joined: the sentinel written, the bootstrap kubeconfig gone,
/// the kubelet's own there, `/opt/cni/bin` linked to Debian's plugins, the image's container
/// images loaded, no siteboot process.
pub fn joined_checklist(kubelet_on: KubeletOn) -> BTreeMap<String, String> {
    // The host's kubelet unit, the container's unit, systemd-detect-virt in the kubelet's mounts.
    let (kubelet, container, runs_in) = match kubelet_on {
        KubeletOn::Host => ("active", "inactive", "none"),
        KubeletOn::Container => ("inactive", "active", "systemd-nspawn"),
    };
    [
        ("cloud-init", "done"),
        ("sentinel", "yes"),
        ("bootstrap-kubeconfig", "no"),
        ("kubelet-kubeconfig", "yes"),
        ("kubelet", kubelet),
        ("kubelet-container", container),
        ("kubelet-runs-in", runs_in),
        ("cni-bin-bridge", "yes"),
        ("node-images", "active"),
        ("siteboot-processes", "0"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
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

/// The workload image the node image carries (`scripts/build-node-image`): busybox, serving
/// HTTP on port 8080 by default.
pub const WORKLOAD_IMAGE: &str = "siteboot.test/workload:1";

/// A Deployment of one Pod of [`WORKLOAD_IMAGE`] (label `app: <name>`), placed by the
/// scheduler, never pulled (no registry is reachable), with `tolerations` and no service
/// account token (nothing in it talks to the apiserver). Tolerating every taint would tolerate
/// a cordon's too, and the scheduler would place it back on the node being drained.
pub fn workload_deployment(
    name: &str,
    tolerations: serde_json::Value,
) -> k8s_openapi::api::apps::v1::Deployment {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": name },
        "spec": {
            "replicas": 1,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": {
                    "automountServiceAccountToken": false,
                    "tolerations": tolerations,
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "workload",
                        "image": WORKLOAD_IMAGE,
                        "imagePullPolicy": "Never",
                        "ports": [{ "containerPort": 8080 }],
                    }],
                },
            },
        },
    }))
    .expect("a Deployment")
}

/// The uninitialized taint, which Cluster API removes once the Node is its Machine's.
pub const UNINITIALIZED: &str = "node.cluster.x-k8s.io/uninitialized";

/// The Node `name` once it is Ready and Cluster API removed its uninitialized taint.
pub async fn ready_and_matched(
    nodes: &kube::Api<k8s_openapi::api::core::v1::Node>,
    name: &str,
    timeout: Duration,
) -> Result<k8s_openapi::api::core::v1::Node> {
    super::capi::wait_object(nodes, name, "Ready, the uninitialized taint gone", timeout, |n| {
        let status = n.status.clone().unwrap_or_default();
        let conditions = status.conditions.unwrap_or_default();
        let ready = conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True");
        let taints = n.spec.clone().unwrap_or_default().taints.unwrap_or_default();
        ready && !taints.iter().any(|t| t.key == UNINITIALIZED)
    })
    .await
}
