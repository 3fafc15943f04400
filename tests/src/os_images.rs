//! The deploy ramdisk and the test OS image a provisioning VM test writes to disk, built by
//! `scripts/build-ramdisk` and `scripts/build-test-os-image` and cached by their inputs under
//! `$SITEBOOT_CACHE` (see docs/testing.md): only the first run pays for a build.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

const BUILD_RAMDISK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/build-ramdisk");
const BUILD_TEST_OS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/build-test-os-image");

/// The deploy ramdisk: boot `kernel` with `initramfs` and the agent's kernel command line
/// (docs/agent-api.md).
#[derive(Clone, Debug)]
pub struct Ramdisk {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// Both on a CD image for virtual media (its kernel parameters a region the appliance fills).
    pub iso: PathBuf,
}

/// The test OS: a raw GPT disk image that boots under SeaBIOS and OVMF and prints its NoCloud
/// seed on the console (lines listed in tests/fixtures/test-os/init).
#[derive(Clone, Debug)]
pub struct TestOsImage {
    pub disk: PathBuf,
    /// SHA-256 of `disk`, hex: what a provision task's `image.checksum` names.
    pub sha256: String,
}

/// Builds (or finds in the cache) the ramdisk with `agent` as /bin/siteboot-agent; `None`
/// builds the agent from images/agent.
pub fn ramdisk(agent: Option<&Path>) -> Result<Ramdisk> {
    let dir = PathBuf::from(run_builder(BUILD_RAMDISK, agent.map(Path::as_os_str))?);
    let ramdisk = Ramdisk {
        kernel: dir.join("vmlinuz"),
        initramfs: dir.join("initramfs"),
        iso: dir.join("ramdisk.iso"),
    };
    for file in [&ramdisk.kernel, &ramdisk.initramfs, &ramdisk.iso] {
        if !file.is_file() {
            bail!("{BUILD_RAMDISK} printed {} but there is no {}", dir.display(), file.display());
        }
    }
    Ok(ramdisk)
}

/// Builds (or finds in the cache) the test OS image.
pub fn test_os_image() -> Result<TestOsImage> {
    let disk = PathBuf::from(run_builder(BUILD_TEST_OS, None)?);
    let sha256_file = disk.with_file_name("sha256");
    let sha256 = std::fs::read_to_string(&sha256_file)
        .with_context(|| format!("reading {}", sha256_file.display()))?
        .trim()
        .to_owned();
    if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("{} holds no SHA-256: {sha256:?}", sha256_file.display());
    }
    if !disk.is_file() {
        bail!("{BUILD_TEST_OS} printed {} but it is no file", disk.display());
    }
    Ok(TestOsImage { disk, sha256 })
}

/// Runs a builder script and returns the last line it printed (its result's path). One at a
/// time in this process: tests running in parallel would otherwise build the same kernel at
/// once (the scripts lock their own caches, not apt's download or cargo's build).
fn run_builder(script: &str, arg: Option<&std::ffi::OsStr>) -> Result<String> {
    static BUILDING: Mutex<()> = Mutex::new(());
    let _building = BUILDING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    // The agent's static release build goes to the script's own target folder under
    // $SITEBOOT_CACHE, kept between runs, not to the one the tests were built in.
    let output = Command::new(script)
        .args(arg)
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .with_context(|| format!("running {script}"))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!("{script} failed ({}):\n{stderr}", output.status);
    }
    let stdout = String::from_utf8(output.stdout)?;
    let last =
        stdout.lines().last().with_context(|| format!("{script} printed nothing:\n{stderr}"))?;
    Ok(last.to_owned())
}
