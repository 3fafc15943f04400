//! `siteboot-agent`: the deploy ramdisk's agent. Reads its kernel command line, then asks the
//! appliance's agent API for a task until told to reboot (docs/agent-api.md): inspect the
//! machine, provision it (choose the root disk, write the image, grow the last partition, add
//! the NoCloud seed) or deprovision it (wipe its disks). Every failure is reported with its
//! reason through `POST v1/complete`; the console says what it is doing, for an operator
//! watching the machine's screen or serial console.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use http::{Method, StatusCode};
use serde::Serialize;
use siteboot_agent::hints::NoDisk;
use siteboot_agent::inspect::{Disk, SystemRoot};
use siteboot_agent::partition::{self, PartitionError, SEED_RESERVE};
use siteboot_agent::progress::Progress;
use siteboot_agent::seed::{self, MetaData, SeedError};
use siteboot_agent::task::{Complete, ProgressReport, Provision, Task};
use siteboot_agent::wipe::{self, Policy, WipeError};
use siteboot_agent::write::{self, WriteError};
use siteboot_agent::{AgentClient, ClientError, Cmdline, Response, Token};
use siteboot_image::{Digest, ImageUrl};
use tokio::sync::watch;

const USAGE: &str = "\
usage: siteboot-agent [--cmdline FILE] [--root DIR]

The siteboot deploy ramdisk's agent: asks the appliance named on the kernel command line
(siteboot.agent=, siteboot.fingerprint=, siteboot.token=) for tasks and does them: inspect,
provision (write an image and a NoCloud seed), deprovision (wipe), reboot.

  --cmdline FILE  the kernel command line to read (default /proc/cmdline)
  --root DIR      where sys/ and proc/ are read from (default /)
  --help          this text
";

/// Waits between failed requests: doubling from a second up to half a minute.
struct Backoff(Duration);

impl Backoff {
    const FIRST: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(30);

    fn new() -> Self {
        Self(Self::FIRST)
    }

    /// How long to wait after this failure.
    fn next(&mut self) -> Duration {
        let wait = self.0;
        self.0 = (self.0 * 2).min(Self::MAX);
        wait
    }
}

/// Why a task failed: what `complete {ok: false}` says.
#[derive(Debug, thiserror::Error)]
enum TaskError {
    #[error("the image URL {url:?}: {why}")]
    ImageUrl { url: String, why: String },
    #[error("choosing the root disk: {0}")]
    NoDisk(#[from] NoDisk),
    #[error("fetching the bootstrap data: {0}")]
    Bootstrap(String),
    #[error("the seed's metaData: {0}")]
    MetaData(SeedError),
    #[error("writing the image to {disk}: {error}; the disk's ends were {wiped}")]
    Write { disk: String, error: WriteError, wiped: &'static str },
    #[error("adding the seed partition to {disk}: {error}")]
    Partition { disk: String, error: PartitionError },
    #[error("writing the seed to {disk}: {error}")]
    Seed { disk: String, error: SeedError },
    #[error("wiping {disk}: {error}")]
    Wipe { disk: String, error: WipeError },
    #[error("a disk step stopped without a result: {0}")]
    Panicked(#[from] tokio::task::JoinError),
}

struct Agent {
    client: AgentClient,
    token: Option<Token>,
    root: SystemRoot,
}

/// Prints a line on the console.
macro_rules! say {
    ($($arg:tt)*) => { eprintln!("siteboot-agent: {}", format_args!($($arg)*)) };
}

impl Agent {
    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
    ) -> Result<Response, ClientError> {
        let json = body.map(|b| serde_json::to_vec(b).expect("bodies serialize").into());
        self.client.request(method, path, self.token.as_ref(), json).await
    }

    /// `method path` until the appliance answers something other than "try again" (503);
    /// transport failures are retried too, with backoff. A refusal is returned as is.
    async fn insist(&self, method: Method, path: &str, body: Option<&impl Serialize>) -> Response {
        let mut backoff = Backoff::new();
        loop {
            let failure = match self.request(method.clone(), path, body).await {
                Ok(r) if r.status != StatusCode::SERVICE_UNAVAILABLE => return r,
                Ok(_) => "the appliance said try again (503)".to_owned(),
                Err(e) => e.to_string(),
            };
            let wait = backoff.next();
            say!("{method} {path}: {failure}; again in {wait:?}");
            tokio::time::sleep(wait).await;
        }
    }

    /// Posts a body the appliance must get (inspection, completion); says so if refused.
    async fn post(&self, path: &str, body: &impl Serialize) {
        let response = self.insist(Method::POST, path, Some(body)).await;
        if !response.status.is_success() {
            say!(
                "POST {path} refused: {} {}",
                response.status,
                String::from_utf8_lossy(&response.body)
            );
        }
    }

    async fn run(&self) {
        let mut backoff = Backoff::new();
        loop {
            let response = self.insist(Method::GET, "v1/task", None::<&()>).await;
            if !response.status.is_success() {
                let wait = backoff.next();
                say!(
                    "no task: {} {}; asking again in {wait:?}",
                    response.status,
                    String::from_utf8_lossy(&response.body)
                );
                tokio::time::sleep(wait).await;
                continue;
            }
            let task = match serde_json::from_slice::<Task>(&response.body) {
                Ok(task) => task,
                Err(e) => {
                    let wait = backoff.next();
                    say!("a task this agent does not understand ({e}); asking again in {wait:?}");
                    tokio::time::sleep(wait).await;
                    continue;
                }
            };
            backoff = Backoff::new();
            match task {
                Task::Wait { seconds } => {
                    tokio::time::sleep(Duration::from_secs(seconds.clamp(1, 300))).await;
                }
                Task::Reboot => reboot(),
                Task::Inspect { operation } => {
                    say!("inspecting ({operation})");
                    let hardware = self.root.hardware();
                    say!(
                        "{} CPUs, {} MiB, {} disks, {} NICs",
                        hardware.cpus,
                        hardware.memory_mib,
                        hardware.disks.len(),
                        hardware.nics.len()
                    );
                    self.post("v1/inspection", &hardware).await;
                }
                Task::Provision(provision) => {
                    say!("provisioning ({}) with {}", provision.operation, provision.image.url);
                    let result = self.provision(provision).await;
                    self.complete(result).await;
                }
                Task::Deprovision { operation, wipe } => {
                    say!("deprovisioning ({operation}), wipe {wipe:?}");
                    let result = self.deprovision(wipe).await;
                    self.complete(result).await;
                }
            }
        }
    }

    async fn complete(&self, result: Result<String, TaskError>) {
        let body = match result {
            Ok(message) => Complete { ok: true, message },
            Err(e) => Complete { ok: false, message: e.to_string() },
        };
        say!("{}: {}", if body.ok { "done" } else { "failed" }, body.message);
        self.post("v1/complete", &body).await;
    }

    /// Reports progress of `step` to the appliance while `progress` changes.
    fn report(
        &self,
        step: &'static str,
    ) -> (watch::Sender<Option<Progress>>, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = watch::channel(None::<Progress>);
        let (client, token) = (self.client.clone(), self.token.clone());
        let task = tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let bytes = *rx.borrow_and_update();
                let json = serde_json::to_vec(&ProgressReport { step, bytes }).expect("serializes");
                if let Some(Progress { done, total }) = bytes {
                    say!("{step}: {done} of {total} bytes");
                }
                // Progress is informative: a lost report is not retried.
                let _ = client
                    .request(Method::POST, "v1/progress", token.as_ref(), Some(json.into()))
                    .await;
            }
        });
        (tx, task)
    }

    async fn provision(&self, task: Provision) -> Result<String, TaskError> {
        let bad_url = |why: String| TaskError::ImageUrl { url: task.image.url.clone(), why };
        let url: ImageUrl =
            task.image.url.parse().map_err(|e: siteboot_image::RefError| bad_url(e.to_string()))?;
        let digest: Digest = task
            .image
            .checksum
            .parse()
            .map_err(|e: siteboot_image::DigestError| bad_url(e.to_string()))?;
        let meta_data = MetaData::new(task.meta_data).map_err(TaskError::MetaData)?;
        let disks = self.root.disks();
        let disk =
            task.root_device_hints.choose(&disks, task.image.size_bytes + SEED_RESERVE)?.clone();
        say!("root disk {} ({} bytes)", disk.name, disk.size_bytes);
        let response = self.insist(Method::GET, "v1/bootstrap", None::<&()>).await;
        if !response.status.is_success() {
            let why = format!("{} {}", response.status, String::from_utf8_lossy(&response.body));
            return Err(TaskError::Bootstrap(why));
        }
        let user_data = response.body;

        let device = PathBuf::from(&disk.name);
        let sector = self.root.logical_block_size(&disk.name);
        let (progress, reporter) = self.report("writing image");
        let written = write::write_image(&url, &digest, &device, disk.size_bytes, |p| {
            progress.send_replace(Some(p));
        })
        .await;
        drop(progress);
        let _ = reporter.await;
        let written = match written {
            Ok(written) => written,
            Err(error) => {
                // Bytes may have been written: nothing half-written may boot.
                let wiped = match self.wipe_disk(&disk, Policy::Quick).await {
                    Ok(_) => "wiped",
                    Err(e) => {
                        say!("{e}");
                        "NOT wiped"
                    }
                };
                return Err(TaskError::Write { disk: disk.name, error, wiped });
            }
        };
        say!("wrote {written} bytes to {}", disk.name);
        let (size, grow) = (disk.size_bytes, task.grow_last_partition);
        let place =
            blocking(&device, move |d| partition::add_seed_partition(d, size, sector, grow))
                .await?
                .map_err(|error| TaskError::Partition { disk: disk.name.clone(), error })?;
        blocking(&device, move |d| seed::write_seed(d, place, sector, &user_data, &meta_data))
            .await?
            .map_err(|error| TaskError::Seed { disk: disk.name.clone(), error })?;
        Ok(format!("wrote {digest} ({written} bytes) and the NoCloud seed to {}", disk.name))
    }

    async fn deprovision(&self, policy: Policy) -> Result<String, TaskError> {
        let disks = self.root.disks();
        let mut wiped = 0;
        for disk in &disks {
            wiped += self.wipe_disk(disk, policy).await?;
        }
        Ok(format!("wiped {wiped} bytes ({policy:?}) on {} disks", disks.len()))
    }

    async fn wipe_disk(&self, disk: &Disk, policy: Policy) -> Result<u64, TaskError> {
        if policy == Policy::None {
            return Ok(0);
        }
        say!("wiping {} ({policy:?})", disk.name);
        let (progress, reporter) = self.report("wiping");
        let (size, sector) = (disk.size_bytes, self.root.logical_block_size(&disk.name));
        let device = PathBuf::from(&disk.name);
        let wiped = blocking(&device, move |d| {
            wipe::wipe(d, size, sector, policy, |p| {
                progress.send_replace(Some(p));
            })
        })
        .await?;
        let _ = reporter.await;
        wiped.map_err(|error| TaskError::Wipe { disk: disk.name.clone(), error })
    }
}

/// Runs a blocking disk step off the runtime's threads (progress keeps being posted).
async fn blocking<T: Send + 'static>(
    device: &Path,
    step: impl FnOnce(&Path) -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    let device = device.to_owned();
    tokio::task::spawn_blocking(move || step(&device)).await
}

/// Syncs and reboots; if that is refused (not root), says so and carries on asking.
fn reboot() {
    say!("rebooting");
    // SAFETY: sync and reboot take no pointers; reboot returns only on failure.
    let failed = unsafe {
        libc::sync();
        libc::reboot(libc::RB_AUTOBOOT)
    };
    if failed != 0 {
        say!("reboot failed: {}", std::io::Error::last_os_error());
    }
}

fn main() -> ExitCode {
    let mut cmdline_path = PathBuf::from("/proc/cmdline");
    let mut root = PathBuf::from("/");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--help" | "-h", _) => {
                print!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            ("--cmdline", Some(path)) => cmdline_path = path.into(),
            ("--root", Some(path)) => root = path.into(),
            _ => {
                eprint!("siteboot-agent: unexpected argument {arg:?}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let cmdline = match std::fs::read_to_string(&cmdline_path)
        .map_err(|e| e.to_string())
        .and_then(|text| Cmdline::parse(&text).map_err(|e| e.to_string()))
    {
        Ok(cmdline) => cmdline,
        Err(e) => {
            say!("{}: {e}; nothing to do", cmdline_path.display());
            return ExitCode::FAILURE;
        }
    };
    say!("appliance {} (certificate {})", cmdline.agent, cmdline.fingerprint);
    let agent = Agent {
        client: AgentClient::new(cmdline.agent, cmdline.fingerprint),
        token: cmdline.token,
        root: SystemRoot(root),
    };
    let runtime = tokio::runtime::Runtime::new().expect("a runtime starts");
    runtime.block_on(agent.run());
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_half_a_minute() {
        let mut b = Backoff::new();
        let waits: Vec<u64> = (0..7).map(|_| b.next().as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
    }
}
