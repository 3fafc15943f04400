//! Imaging: N hosts at once (1 and 8 in the published run), each writing a raw GPT image (2
//! GiB) to its disk with the real deploy agent, against a standalone siteboot (release build),
//! and beside it, in the same run, the two limits imaging cannot beat: the line (one curl per
//! host fetching the same bytes from the same URL over the same veth, to /dev/null) and the
//! disk (one `dd bs=4M oflag=direct conv=fsync` per host of the same bytes onto a fresh disk of
//! the same kind).
//!
//! A host is a network namespace on the server's bridge with its own MAC. It gets a lease from
//! siteboot (udhcpc), `siteboot host provision` starts its operation, it fetches its iPXE script
//! (the ramdisk's kernel line with its token), and then `siteboot-agent` runs in it with that
//! line as its `--cmdline` and a made-up system root as `--root`: a sysfs listing one disk,
//! whose `/dev` node is a loop device. The agent takes its real path: the task, the bootstrap
//! data, the download (with Range resume), the digest check, the write, the seed partition,
//! the sync, `complete`, and the reboot it is then told to do. It is not run in a TCG VM: that
//! would measure QEMU's emulated CPU and disk, not siteboot or the agent.
//!
//! The agent reboots with reboot(2). Each agent is therefore the init of a PID namespace of its
//! own (`unshare --pid --fork`), where reboot(2) ends that namespace instead of the machine;
//! the driver checks that `unshare` gives such a namespace before any agent runs.
//!
//! The disks are loop devices in direct-I/O mode over sparse files on the machine's disk (not
//! tmpfs): a block device as the agent writes on a real host, with one page cache above it as a
//! disk has (a buffered loop device would cache every byte twice), on storage every host shares
//! as a rack's hosts share nothing but the line. The agent writes with O_DIRECT in 4 MiB
//! chunks and syncs at the end, and so does `dd` (a page-cache copy would make the limit slower
//! than the agent on a fast disk). Every disk is
//! created fresh (unallocated) for each measurement and deleted after it, also on failure; loop
//! devices and files left by a driver that was killed are removed by the next one.

use std::io::Write as _;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{SERVER_ADDRESS, Settings};
use crate::appliance::{self, Appliance, BRIDGE};
use crate::clients::{ClientHost, Udhcpc};
use crate::netns::{self, Netns};
use crate::process::Supervised;

const PORT: u16 = 8080;
/// The bench network ([`SERVER_ADDRESS`]/[`super::PREFIX_LEN`]) and the hosts' leases in it.
const SUBNET: &str = "10.98.0.0/16";
const POOL: &str = "10.98.1.1-10.98.254.254";
/// The disk each host's made-up sysfs lists (and the hosts' root device hint): a name no real
/// machine has, so an agent that read the real `/sys` would find no disk to write.
const DISK: &str = "sbbench0";
/// Room after the image for the agent's seed partition and the backup GPT.
const DISK_SLACK: u64 = 64 << 20;
/// How a host runs its agent: as the init of a new PID namespace, where reboot(2) ends the
/// namespace rather than the machine.
const PID_NAMESPACE: [&str; 4] = ["unshare", "--pid", "--fork", "--kill-child"];
/// Where the disks and the image go: on the machine's disk (`/tmp` may be tmpfs).
const SCRATCH_PARENT: &str = "/var/tmp";
const SCRATCH_PREFIX: &str = "siteboot-bench-imaging-";
/// The slowest rate a phase may take before it is given up (per host).
const SLOWEST_BYTES_PER_SECOND: u64 = 5 << 20;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub hosts: usize,
    pub run: usize,
    pub image_bytes: u64,
    /// From the agents' start until the last one finished: image written, its digest checked,
    /// the seed added, the disk synced, `complete` accepted.
    pub seconds: f64,
    /// One curl per host of the same URL over the same veths, to /dev/null, until the last
    /// finished.
    pub line_seconds: f64,
    /// One `dd bs=4M oflag=direct conv=fsync` per host of the same bytes onto a fresh disk of the same kind,
    /// until the last finished.
    pub disk_seconds: f64,
    /// siteboot's user + system CPU while the agents ran.
    pub server_cpu_seconds: f64,
    pub peak_rss_kib: u64,
    /// The agents' user + system CPU, all hosts together.
    pub agent_cpu_seconds: f64,
    /// What the hosts' disks were.
    pub target: String,
}

impl Sample {
    /// (imaging, line, disk) in MiB/s, all hosts together.
    pub fn rates(&self) -> (f64, f64, f64) {
        let mib = (self.hosts as u64 * self.image_bytes) as f64 / f64::from(1 << 20);
        (mib / self.seconds, mib / self.line_seconds, mib / self.disk_seconds)
    }
}

/// Every run of every host count. Its files go under [`SCRATCH_PARENT`], not `_dir`, which may
/// be tmpfs.
pub fn run(settings: &Settings, _dir: &Path) -> Result<Vec<Sample>> {
    let agent = agent_binary()?;
    check_pid_namespace()?;
    remove_stale();
    let scratch = scratch_dir()?;
    let files = scratch.path().join("files");
    std::fs::create_dir_all(&files)?;
    let image = files.join("image.raw");
    write_image(&image, settings.imaging_bytes)?;
    let checksum = sha256_file(&image)?;
    let target = describe_target(scratch.path());
    let mut samples = Vec::new();
    for run in 0..settings.runs {
        let sets: Vec<Vec<Machine>> = settings
            .imaging_hosts
            .iter()
            .enumerate()
            .map(|(set, &hosts)| (0..hosts).map(|i| Machine::named(run, set, i)).collect())
            .collect();
        let lab = ImagingLab::start(scratch.path(), run, &image, &checksum, &sets)?;
        for machines in sets {
            let hosts = machines.len();
            let sample = lab.measure(&agent, machines, run, &target).with_context(|| {
                format!("{hosts} hosts, run {run}; siteboot's log:\n{}", lab.app.log())
            })?;
            let (imaging, line, disk) = sample.rates();
            eprintln!(
                "imaging hosts={hosts} run={run}: {:.1} s, {imaging:.0} MiB/s (line {line:.0}, disk {disk:.0}); siteboot {:.2} CPU s, {:.1} MiB; agents {:.2} CPU s",
                sample.seconds,
                sample.server_cpu_seconds,
                sample.peak_rss_kib as f64 / 1024.0,
                sample.agent_cpu_seconds
            );
            samples.push(sample);
        }
    }
    Ok(samples)
}

/// A host to image: its name in siteboot's config and its boot MAC.
#[derive(Clone, Debug)]
struct Machine {
    name: String,
    mac: String,
}

impl Machine {
    /// Host `i` of host set `set` (one set per host count) in run `run`: every host of a run
    /// is provisioned once, so each set has hosts of its own.
    fn named(run: usize, set: usize, i: usize) -> Self {
        Self {
            name: format!("r{run}-s{set}-h{i}"),
            mac: format!("02:be:00:{:02x}:{:02x}:{:02x}", run % 256, set % 256, i % 256),
        }
    }
}

/// The server namespace and a standalone siteboot listing every host of a run, its image
/// already in the image cache (a rack's first host would otherwise wait for the uplink).
struct ImagingLab {
    app: Appliance,
    /// The config `siteboot host` reads.
    config: PathBuf,
    /// siteboot's `state_dir` (with its image cache) and the logs of the processes the run
    /// starts; deleted after siteboot stops.
    state: tempfile::TempDir,
    /// Where the disks' files go.
    scratch: PathBuf,
    image: PathBuf,
    image_bytes: u64,
    /// The image's SHA-256, hex.
    checksum: String,
    server: Netns,
}

impl ImagingLab {
    fn start(
        scratch: &Path,
        run: usize,
        image: &Path,
        checksum: &str,
        sets: &[Vec<Machine>],
    ) -> Result<Self> {
        let server = Netns::new("bis")?;
        server.add_bridge(BRIDGE, &format!("{SERVER_ADDRESS}/{}", super::PREFIX_LEN))?;
        let state =
            tempfile::Builder::new().prefix(&format!("state-{run}-")).tempdir_in(scratch)?;
        let state_dir = state.path();
        let files = image.parent().context("the image is in a folder")?;
        let user_data = scratch.join("user-data");
        std::fs::write(&user_data, "#cloud-config\nruncmd: [[true]]\n")?;
        // The ramdisk's files are never fetched: the agent runs as a process.
        std::fs::create_dir_all(files.join("ramdisk"))?;
        for file in ["vmlinuz", "initrd.img"] {
            std::fs::write(files.join("ramdisk").join(file), b"not a kernel")?;
        }
        let url = format!(
            "http://{SERVER_ADDRESS}:{PORT}/files/{}",
            image.file_name().context("an image file")?.to_string_lossy()
        );
        let hosts: Vec<Value> = sets
            .iter()
            .flatten()
            .map(|m| {
                json!({
                    "mac": m.mac, "name": m.name, "profile": "disk",
                    "image": { "url": url, "checksum": format!("sha256:{checksum}") },
                    "user_data": user_data,
                    "root_device_hints": { "name": format!("/dev/{DISK}") },
                    "wipe": "quick",
                })
            })
            .collect();
        let config = json!({
            "interface": BRIDGE,
            "address": SERVER_ADDRESS,
            "state_dir": state_dir,
            "dhcp": { "mode": "full", "lease_time": "1h", "subnets": [{
                "subnet": SUBNET,
                "pools": [POOL],
            }]},
            "http": { "port": PORT, "root": files },
            "profiles": {
                "disk": { "local_boot": "exit" },
                "ramdisk": { "kernel": "ramdisk/vmlinuz", "initrds": ["ramdisk/initrd.img"],
                             "cmdline": "console=ttyS0" },
            },
            "ramdisk_profile": "ramdisk",
            "hosts": hosts,
        });
        let config_path = scratch.join(format!("siteboot-{run}.yaml"));
        std::fs::write(&config_path, serde_norway::to_string(&config)?)?;
        // Into the cache before siteboot starts, so no host waits for the fetch.
        let pulled = netns::output(
            server
                .command(appliance::binary()?)
                .args(["image", "pull"])
                .arg(format!("file://{}", image.display()))
                .args(["--sha256", checksum, "--config"])
                .arg(&config_path),
        )
        .context("putting the image into siteboot's cache")?;
        if !pulled.contains(checksum) {
            bail!("siteboot image pull printed no {checksum}: {pulled}");
        }
        let app = Appliance::start(&server, config)?;
        Ok(Self {
            app,
            config: config_path,
            state,
            scratch: scratch.to_owned(),
            image: image.to_owned(),
            image_bytes: std::fs::metadata(image)?.len(),
            checksum: checksum.to_owned(),
            server,
        })
    }

    /// The limits, then the imaging, with `machines` at once.
    fn measure(
        &self,
        agent: &Path,
        machines: Vec<Machine>,
        run: usize,
        target: &str,
    ) -> Result<Sample> {
        let hosts = machines.len();
        let deadline =
            Duration::from_secs(60 + hosts as u64 * self.image_bytes / SLOWEST_BYTES_PER_SECOND);
        let mut booted: Vec<Booted> =
            machines.into_iter().map(|m| Booted::attach(&self.server, m)).collect::<Result<_>>()?;
        for host in &mut booted {
            let machine = format!("{} ({})", host.machine.name, host.machine.mac);
            host.dhcp.wait_bound(Duration::from_secs(30)).context(machine)?;
        }
        let line_seconds = self.line(&booted, deadline)?;
        let disk_seconds = self.disk(hosts, deadline)?;
        let imaging = self.image_all(agent, &booted, deadline)?;
        Ok(Sample {
            hosts,
            run,
            image_bytes: self.image_bytes,
            seconds: imaging.seconds,
            line_seconds,
            disk_seconds,
            server_cpu_seconds: imaging.server_cpu_seconds,
            peak_rss_kib: imaging.peak_rss_kib,
            agent_cpu_seconds: imaging.agent_cpu_seconds,
            target: target.to_owned(),
        })
    }

    /// The image's URL in siteboot's cache, as a provision task names it.
    fn cache_url(&self) -> String {
        format!("http://{SERVER_ADDRESS}:{PORT}/images/sha256/{}", self.checksum)
    }

    /// Seconds until one curl per host, all at once, fetched the cached image to /dev/null.
    fn line(&self, booted: &[Booted], deadline: Duration) -> Result<f64> {
        let url = self.cache_url();
        let started = Instant::now();
        let curls: Vec<_> = booted
            .iter()
            .map(|b| {
                b.host
                    .ns
                    .command("curl")
                    .args(["-sS", "-o", "/dev/null", "-w", "%{size_download}", "--max-time"])
                    .arg(deadline.as_secs().to_string())
                    .arg(&url)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .context("starting curl")
            })
            .collect::<Result<_>>()?;
        for curl in curls {
            // curl's --max-time bounds each wait.
            let out = curl.wait_with_output()?;
            let got: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0);
            if !out.status.success() || got != self.image_bytes {
                bail!(
                    "curl got {got} of {} bytes ({}): {}",
                    self.image_bytes,
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
        Ok(started.elapsed().as_secs_f64())
    }

    /// Seconds until one `dd` per host, all at once, wrote the image to a fresh disk and synced.
    fn disk(&self, hosts: usize, deadline: Duration) -> Result<f64> {
        let disks = (0..hosts).map(|_| LoopDisk::create(&self.disk_file()?, self.disk_bytes()));
        let disks: Vec<LoopDisk> = disks.collect::<Result<_>>()?;
        let started = Instant::now();
        let dds: Vec<Supervised> = disks
            .iter()
            .enumerate()
            .map(|(i, disk)| {
                let mut dd = Command::new("dd");
                dd.arg(format!("if={}", self.image.display()))
                    .arg(format!("of={}", disk.device.display()))
                    .args(["bs=4M", "oflag=direct", "conv=fsync", "status=none"]);
                Supervised::spawn(&format!("dd-{i}"), &mut dd, self.state.path())
            })
            .collect::<Result<_>>()?;
        for mut dd in dds {
            let left = deadline.saturating_sub(started.elapsed());
            let status = dd.wait_timeout(left)?;
            if !status.success() {
                bail!("dd failed ({status}): {}", dd.log_tail());
            }
        }
        Ok(started.elapsed().as_secs_f64())
    }

    fn disk_file(&self) -> Result<PathBuf> {
        let file = tempfile::Builder::new().prefix("disk-").tempfile_in(&self.scratch)?;
        Ok(file.into_temp_path().keep()?)
    }

    fn disk_bytes(&self) -> u64 {
        self.image_bytes + DISK_SLACK
    }

    /// Provisions every host at once with the real agent on a fresh disk each.
    fn image_all(&self, agent: &Path, booted: &[Booted], deadline: Duration) -> Result<Imaging> {
        let mut disks = Vec::new();
        let mut followers = Vec::new();
        let mut roots = Vec::new();
        for host in booted {
            disks.push(LoopDisk::create(&self.disk_file()?, self.disk_bytes())?);
            let disk = disks.last().expect("pushed");
            let root = system_root(self.state.path(), &host.machine, disk, self.disk_bytes())?;
            // The operation first: only then does the boot script carry a token.
            followers.push(self.provision(&host.machine)?);
            let script = host.boot_script()?;
            if crate::sim::ramdisk_cmdline(&script)?.token.is_none() {
                bail!("{}: the ramdisk got no token:\n{script}", host.machine.name);
            }
            std::fs::write(root.join("cmdline"), crate::sim::kernel_line(&script)?)?;
            roots.push(root);
        }
        let pid = self.app.pid().context("siteboot runs")?;
        super::reset_peak_rss(pid)?;
        let cpu = super::cpu_seconds(pid);
        let children_cpu = children_cpu_seconds();
        let started = Instant::now();
        let mut agents: Vec<Supervised> = booted
            .iter()
            .zip(&roots)
            .map(|(host, root)| {
                let mut command = host.host.ns.command(PID_NAMESPACE[0]);
                command
                    .args(&PID_NAMESPACE[1..])
                    .arg(agent)
                    .arg("--cmdline")
                    .arg(root.join("cmdline"))
                    .arg("--root")
                    .arg(root);
                Supervised::spawn(&format!("agent-{}", host.machine.name), &mut command, root)
            })
            .collect::<Result<_>>()?;
        // An agent ends when it reboots, which it does when told to after its `complete`. An
        // operation that failed ends its follower without success (the followers are not
        // reaped until the clock stops: the agents' CPU is what the reaped children used).
        let ended = crate::wait::until(
            "every agent to finish and reboot",
            deadline,
            Duration::from_millis(20),
            || {
                let failed = followers
                    .iter()
                    .find(|f| exited_unreaped(f.pid()) && !f.log().contains("Provision succeeded"));
                if let Some(failed) = failed {
                    return Some(Err(anyhow::anyhow!("{}:\n{}", failed.name(), failed.log_tail())));
                }
                agents.iter_mut().all(|a| a.try_wait().is_some()).then_some(Ok(()))
            },
        )
        .and_then(|ended| ended);
        let seconds = started.elapsed().as_secs_f64();
        let server_cpu_seconds = super::cpu_seconds(pid) - cpu;
        let agent_cpu_seconds = children_cpu_seconds() - children_cpu;
        let peak_rss_kib = super::peak_rss_kib(pid)?;
        let logs = || agents.iter().map(|a| a.log_tail()).collect::<Vec<_>>().join("\n");
        ended.with_context(logs)?;
        for ((agent, follower), host) in agents.iter().zip(&mut followers).zip(booted) {
            let name = &host.machine.name;
            if !agent.log().contains("siteboot-agent: done: wrote") {
                bail!("{name}: the agent did not write the image:\n{}", agent.log_tail());
            }
            let status = follower.wait_timeout(Duration::from_secs(30))?;
            if !status.success() || !follower.log().contains("Provision succeeded") {
                bail!("{name}: siteboot host provision ({status}):\n{}", follower.log_tail());
            }
        }
        for (disk, host) in disks.iter().zip(booted) {
            self.check_written(disk).with_context(|| host.machine.name.clone())?;
        }
        Ok(Imaging { seconds, server_cpu_seconds, peak_rss_kib, agent_cpu_seconds })
    }

    /// Starts `siteboot host provision` for `machine` and returns it, following the operation.
    fn provision(&self, machine: &Machine) -> Result<Supervised> {
        let mut command = Command::new(appliance::binary()?);
        command
            .args(["host", "provision", &machine.name, "--timeout", "2h", "--config"])
            .arg(&self.config);
        let mut follower = Supervised::spawn(
            &format!("provision-{}", machine.name),
            &mut command,
            self.state.path(),
        )?;
        crate::wait::for_("the provision operation to start", Duration::from_secs(30), || {
            (follower.log().contains("Provision operation") || follower.try_wait().is_some())
                .then_some(())
        })?;
        if !follower.log().contains("Provision operation") {
            bail!("siteboot host provision {}:\n{}", machine.name, follower.log_tail());
        }
        Ok(follower)
    }

    /// The disk holds the image's bytes (two MiB away from the partition tables the agent
    /// rewrote): the agent wrote to the disk it was given.
    fn check_written(&self, disk: &LoopDisk) -> Result<()> {
        let device = std::fs::File::open(&disk.device)?;
        let image = std::fs::File::open(&self.image)?;
        let len = (1u64 << 20).min(self.image_bytes / 4);
        for offset in [len, self.image_bytes - 2 * len] {
            let (mut on_disk, mut expected) = (vec![0; len as usize], vec![0; len as usize]);
            device.read_exact_at(&mut on_disk, offset)?;
            image.read_exact_at(&mut expected, offset)?;
            if on_disk != expected {
                bail!("{} differs from the image at {offset}", disk.device.display());
            }
        }
        Ok(())
    }
}

struct Imaging {
    seconds: f64,
    server_cpu_seconds: f64,
    peak_rss_kib: u64,
    agent_cpu_seconds: f64,
}

/// A host on the bridge holding a lease from siteboot.
struct Booted {
    machine: Machine,
    dhcp: Udhcpc,
    // Last: dropped after the processes in it.
    host: ClientHost,
}

impl Booted {
    fn attach(server: &Netns, machine: Machine) -> Result<Self> {
        let host = ClientHost::attach(server, BRIDGE, &machine.mac)?;
        let dhcp = Udhcpc::start(&host, &[])?;
        Ok(Self { machine, dhcp, host })
    }

    /// What siteboot tells this host's firmware to boot.
    fn boot_script(&self) -> Result<String> {
        let url = format!(
            "http://{SERVER_ADDRESS}:{PORT}/boot/{}.ipxe",
            appliance::mac_dashed(&self.machine.mac)
        );
        netns::output(self.host.ns.command("curl").args(["-sSf", "--max-time", "10", &url]))
    }
}

/// A loop device in direct-I/O mode over a sparse file; detached and deleted on drop.
struct LoopDisk {
    file: PathBuf,
    device: PathBuf,
}

impl LoopDisk {
    fn create(file: &Path, bytes: u64) -> Result<Self> {
        std::fs::File::options().write(true).open(file)?.set_len(bytes)?;
        let attached = netns::output(
            Command::new("losetup").args(["--find", "--show", "--direct-io=on"]).arg(file),
        );
        match attached {
            Ok(device) => {
                let disk = Self { file: file.to_owned(), device: device.trim().into() };
                // losetup falls back to buffered I/O (with a warning) where the file's
                // filesystem refuses O_DIRECT: then the disk is not what the table says.
                let name = disk.device.file_name().context("a device name")?.to_string_lossy();
                let dio = std::fs::read_to_string(format!("/sys/block/{name}/loop/dio"))?;
                if dio.trim() != "1" {
                    bail!(
                        "{} over {} is not in direct-I/O mode",
                        disk.device.display(),
                        file.display()
                    );
                }
                Ok(disk)
            }
            Err(e) => {
                let _ = std::fs::remove_file(file);
                Err(e.context("attaching a loop device"))
            }
        }
    }
}

impl Drop for LoopDisk {
    fn drop(&mut self) {
        if let Err(e) = netns::run(Command::new("losetup").arg("-d").arg(&self.device)) {
            eprintln!("imaging: {e:#}");
        }
        let _ = std::fs::remove_file(&self.file);
    }
}

/// The system root the agent of `machine` reads (`--root`): a sysfs of one disk, [`DISK`],
/// whose device node is a link to `disk`'s loop device.
fn system_root(dir: &Path, machine: &Machine, disk: &LoopDisk, bytes: u64) -> Result<PathBuf> {
    let root = dir.join(format!("root-{}", machine.name));
    let block = root.join("sys/block").join(DISK);
    std::fs::create_dir_all(block.join("device"))?;
    std::fs::create_dir_all(block.join("queue"))?;
    std::fs::create_dir_all(root.join("dev"))?;
    std::fs::write(block.join("size"), (bytes / 512).to_string())?;
    std::fs::write(block.join("queue/logical_block_size"), "512")?;
    std::os::unix::fs::symlink(&disk.device, root.join("dev").join(DISK))?;
    Ok(root)
}

/// The agent binary: `SITEBOOT_AGENT_BIN`, else `siteboot-agent` beside the siteboot binary
/// (`scripts/bench` builds both). Fails if it is missing or older than its sources.
fn agent_binary() -> Result<PathBuf> {
    let siteboot = appliance::binary()?;
    let bin = std::env::var_os("SITEBOOT_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| siteboot.with_file_name("siteboot-agent"));
    let built = std::fs::metadata(&bin).and_then(|m| m.modified()).with_context(|| {
        format!(
            "agent binary {} not found: build it with siteboot (`cargo build -p siteboot -p siteboot-agent`), or point SITEBOOT_AGENT_BIN at it",
            bin.display()
        )
    })?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut newest = None;
    for dir in ["images/agent/src", "images/cache/src", "images/format/src"] {
        appliance::newest_file(&root.join(dir), &mut newest)?;
    }
    if let Some((modified, source)) = newest
        && modified > built
    {
        bail!(
            "agent binary {} is older than {}: run `cargo build -p siteboot-agent`",
            bin.display(),
            source.display()
        );
    }
    Ok(bin)
}

/// Fails unless [`PID_NAMESPACE`] runs its command as the init of a new PID namespace: an agent
/// outside one would reboot the machine.
fn check_pid_namespace() -> Result<()> {
    let pid = netns::output(
        Command::new(PID_NAMESPACE[0]).args(&PID_NAMESPACE[1..]).args(["sh", "-c", "echo $$"]),
    )?;
    if pid.trim() != "1" {
        bail!("{PID_NAMESPACE:?} ran its command as pid {pid:?}, not 1: no agent may run");
    }
    Ok(())
}

/// A folder of its own under [`SCRATCH_PARENT`], which must not be tmpfs; deleted on drop.
fn scratch_dir() -> Result<tempfile::TempDir> {
    let parent = Path::new(SCRATCH_PARENT);
    // SAFETY: statfs writes only into the struct it is given.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    let path = std::ffi::CString::new(SCRATCH_PARENT)?;
    if unsafe { libc::statfs(path.as_ptr(), &mut fs) } != 0 {
        bail!("statfs {SCRATCH_PARENT}: {}", std::io::Error::last_os_error());
    }
    if fs.f_type == libc::TMPFS_MAGIC {
        bail!("{SCRATCH_PARENT} is tmpfs: the disks must be on the machine's disk");
    }
    Ok(tempfile::Builder::new()
        .prefix(&format!("{SCRATCH_PREFIX}{}-", std::process::id()))
        .tempdir_in(parent)?)
}

/// Loop devices and scratch folders of drivers that were killed (their pid is gone).
fn remove_stale() {
    let stale = |path: &str| {
        let rest = path.strip_prefix(&format!("{SCRATCH_PARENT}/{SCRATCH_PREFIX}"))?;
        let pid: u32 = rest.split('-').next()?.parse().ok()?;
        let dir = rest.split('/').next()?;
        (!Path::new(&format!("/proc/{pid}")).exists())
            .then(|| format!("{SCRATCH_PARENT}/{SCRATCH_PREFIX}{dir}"))
    };
    let mut listing = Command::new("losetup");
    listing.args(["--list", "--noheadings", "--raw", "--output", "NAME,BACK-FILE"]);
    for line in netns::output(&mut listing).unwrap_or_default().lines() {
        if let Some((device, file)) = line.split_once(' ')
            && stale(file).is_some()
        {
            let _ = netns::run(Command::new("losetup").args(["-d", device]));
        }
    }
    let Ok(entries) = std::fs::read_dir(SCRATCH_PARENT) else { return };
    for entry in entries.flatten() {
        if let Some(dir) = stale(&entry.path().to_string_lossy()) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// "loop device (direct I/O) over a sparse file on ext4 (/dev/vda)": the disks' kind.
fn describe_target(dir: &Path) -> String {
    let source = netns::output(
        Command::new("findmnt").args(["-n", "-o", "FSTYPE,SOURCE", "--target"]).arg(dir),
    )
    .unwrap_or_default();
    let mut words = source.split_whitespace();
    let (fstype, device) = (words.next().unwrap_or("?"), words.next().unwrap_or("?"));
    format!("loop device (direct I/O) over a sparse file on {fstype} ({device})")
}

/// A raw GPT disk image of `bytes` (a multiple of 512) with one partition over varied bytes
/// that do not compress: what the agent writes as it is served.
fn write_image(path: &Path, bytes: u64) -> Result<()> {
    if !bytes.is_multiple_of(512) || bytes < 1 << 20 {
        bail!("the image must be whole 512-byte sectors and at least 1 MiB, not {bytes} bytes");
    }
    super::write_file(path, bytes)?;
    // No boot code: the agent must not take random first bytes for a compression magic.
    std::fs::File::options().write(true).open(path)?.write_all_at(&[0; 512], 0)?;
    let mut sfdisk = Command::new("sfdisk")
        .args(["--quiet", "--no-reread", "--no-tell-kernel"])
        .arg(path)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("sfdisk (scripts/setup installs fdisk)")?;
    sfdisk.stdin.take().context("sfdisk's stdin")?.write_all(b"label: gpt\n,,L\n")?;
    let out = sfdisk.wait_with_output()?;
    if !out.status.success() {
        bail!("sfdisk failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// The SHA-256 of a file, hex.
fn sha256_file(path: &Path) -> Result<String> {
    let mut hasher = Sha256::new();
    let mut file = std::fs::File::open(path)?;
    std::io::copy(&mut file, &mut hasher)?;
    Ok(format!("{:x}", hasher.finalize()))
}

/// Whether the child `pid` has exited, without reaping it (waitid with WNOWAIT).
fn exited_unreaped(pid: u32) -> bool {
    // SAFETY: waitid writes only into the struct it is given; WNOWAIT leaves the child as is.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let flags = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
    let found = unsafe { libc::waitid(libc::P_PID, pid, &mut info, flags) };
    // With WNOHANG and nothing to report, the pid in `info` stays 0.
    found == 0 && unsafe { info.si_pid() } != 0
}

/// User + system CPU seconds of this process's children that were waited for (and of their
/// waited-for descendants: `unshare` waits for its agent).
fn children_cpu_seconds() -> f64 {
    // SAFETY: getrusage writes only into the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}
