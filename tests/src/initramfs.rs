//! The test ramdisk: the installed Debian kernel plus a busybox-static initramfs whose init
//! (`tests/fixtures/initramfs/init`) gets an address over DHCP, POSTs a `running` callback to the
//! `siteboot.url` on its kernel command line and powers off.
//!
//! The pair is cached under `${SITEBOOT_CACHE:-/var/cache/siteboot}/lab/<hash of inputs>/`, so
//! only the first run pays for building it.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};
use siteboot_ssh::cpio::Newc;

/// virtio-net and what it needs, in load order (see /work/shared/notes/pxe-lab.md).
const MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "failover",
    "net_failover",
    "virtio_net",
];

const INIT: &[u8] = include_bytes!("../fixtures/initramfs/init");
const UDHCPC_SCRIPT: &[u8] = include_bytes!("../fixtures/initramfs/udhcpc.script");
const BUSYBOX: &str = "/bin/busybox";
/// Bump when the archive layout changes, so old cache entries are not reused.
const FORMAT: &str = "siteboot-lab-initramfs-1";

/// A kernel and an initramfs that boot to the callback.
#[derive(Clone, Debug)]
pub struct BootFiles {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub kernel_version: String,
}

/// Builds (or finds in the cache) the test kernel + initramfs. Built once per process.
pub fn boot_files() -> Result<BootFiles> {
    static BUILT: Mutex<Option<BootFiles>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(files) = built.as_ref() {
        return Ok(files.clone());
    }
    let files = build().context("building the test initramfs")?;
    *built = Some(files.clone());
    Ok(files)
}

fn build() -> Result<BootFiles> {
    let version = kernel_version()?;
    let kernel_path = PathBuf::from(format!("/boot/vmlinuz-{version}"));
    let kernel = read(&kernel_path)?;
    let busybox = read(Path::new(BUSYBOX))?;
    let modules = load_modules(&version)?;

    let mut hash = Sha256::new();
    for part in [FORMAT.as_bytes(), INIT, UDHCPC_SCRIPT, &busybox, &kernel] {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    for (name, bytes) in &modules {
        hash.update(name.as_bytes());
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    }
    let key: String = hash.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();

    let dir = cache_dir().join("lab").join(&key);
    let files = BootFiles {
        kernel: dir.join("vmlinuz"),
        initrd: dir.join("initrd.img"),
        kernel_version: version,
    };
    if files.kernel.exists() && files.initrd.exists() {
        return Ok(files);
    }

    // Build beside the final directory and rename, so a concurrent or interrupted build never
    // leaves a half-written entry behind.
    let parent = dir.parent().expect("cache dir has a parent");
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let tmp = tempfile::Builder::new().prefix(".build-").tempdir_in(parent)?;
    std::fs::write(tmp.path().join("vmlinuz"), &kernel)?;
    std::fs::write(tmp.path().join("initrd.img"), archive(&busybox, &modules)?)?;
    let tmp = tmp.keep();
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another process won the race; its entry has the same content.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    if !files.initrd.exists() {
        bail!("{} missing after build", files.initrd.display());
    }
    Ok(files)
}

/// `${SITEBOOT_CACHE:-/var/cache/siteboot}`: where the harness keeps what it builds or downloads.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("SITEBOOT_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/siteboot"))
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// The newest installed Debian kernel: one with both /boot/vmlinuz-<v> and /lib/modules/<v>.
/// Not `uname -r`: the machine running the tests may boot some other kernel.
fn kernel_version() -> Result<String> {
    let mut versions: Vec<String> = std::fs::read_dir("/lib/modules")
        .context("reading /lib/modules (is linux-image-amd64 installed? run scripts/setup)")?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|v| Path::new(&format!("/boot/vmlinuz-{v}")).exists())
        .collect();
    versions.sort_by_key(|v| version_key(v));
    versions.pop().context(
        "no /boot/vmlinuz-<v> with /lib/modules/<v>: install linux-image-amd64 (scripts/setup)",
    )
}

/// "6.1.0-57-amd64" -> [6, 1, 0, 57]: numeric order, so 6.1.0-57 sorts after 6.1.0-9.
fn version_key(version: &str) -> Vec<u64> {
    version.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect()
}

/// Reads [`MODULES`] from /lib/modules/<version>, decompressed. Built-in ones are skipped.
fn load_modules(version: &str) -> Result<Vec<(String, Vec<u8>)>> {
    let root = PathBuf::from(format!("/lib/modules/{version}"));
    let mut found = HashMap::new();
    index_modules(&root.join("kernel"), &mut found)?;
    let builtin = std::fs::read_to_string(root.join("modules.builtin")).unwrap_or_default();

    let mut modules = Vec::new();
    for &name in MODULES {
        match found.get(name) {
            Some(path) => modules.push((name.to_owned(), decompress(path)?)),
            None if builtin.lines().any(|l| l.ends_with(&format!("/{name}.ko"))) => {}
            None => bail!("module {name} not found under {}", root.display()),
        }
    }
    Ok(modules)
}

/// Maps module name -> file, for `.ko` and compressed `.ko.{xz,zst,gz}`.
fn index_modules(dir: &Path, found: &mut HashMap<String, PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            index_modules(&path, found)?;
        } else if let Some(file) = path.file_name().and_then(|f| f.to_str())
            && let Some((name, _)) = file.split_once(".ko")
        {
            found.insert(name.to_owned(), path.clone());
        }
    }
    Ok(())
}

fn decompress(path: &Path) -> Result<Vec<u8>> {
    let name = path.to_string_lossy();
    let tool: &[&str] = if name.ends_with(".ko") {
        return read(path);
    } else if name.ends_with(".xz") {
        &["xz", "-dc"]
    } else if name.ends_with(".zst") {
        &["zstd", "-dcq"]
    } else if name.ends_with(".gz") {
        &["gzip", "-dc"]
    } else {
        bail!("unknown module compression: {name}");
    };
    let out = Command::new(tool[0])
        .args(&tool[1..])
        .arg(path)
        .output()
        .with_context(|| format!("running {} on {name}", tool[0]))?;
    if !out.status.success() {
        bail!("{} {name} failed: {}", tool[0], String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

/// The gzip-compressed newc archive.
fn archive(busybox: &[u8], modules: &[(String, Vec<u8>)]) -> Result<Vec<u8>> {
    let mut cpio = Newc::default();
    for dir in ["bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "lib", "lib/modules"] {
        cpio.entry(dir, 0o040755, b"");
    }
    for dir in ["dev", "proc", "sys", "tmp", "run"] {
        cpio.entry(dir, 0o040755, b"");
    }
    // The kernel opens /dev/console for init before anything is mounted.
    cpio.device("dev/console", 0o020600, 5, 1);
    cpio.entry("bin/busybox", 0o100755, busybox);
    cpio.entry("bin/sh", 0o120777, b"busybox");
    cpio.entry("init", 0o100755, INIT);
    cpio.entry("etc/udhcpc.script", 0o100755, UDHCPC_SCRIPT);
    let order: String = modules.iter().map(|(name, _)| format!("{name}\n")).collect();
    cpio.entry("etc/modules", 0o100644, order.as_bytes());
    for (name, bytes) in modules {
        cpio.entry(&format!("lib/modules/{name}.ko"), 0o100644, bytes);
    }

    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&cpio.finish())?;
    Ok(gz.finish()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_sort_numerically() {
        assert!(version_key("6.1.0-57-amd64") > version_key("6.1.0-9-amd64"));
        assert!(version_key("6.10.1-1-amd64") > version_key("6.9.12-1-amd64"));
    }
}
