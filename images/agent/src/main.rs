//! `siteboot-agent`: the deploy ramdisk's agent. Reads its kernel command line, then asks the
//! appliance's agent API for a task until told to reboot (docs/agent-api.md): inspect the
//! machine, provision it (choose the root disk, write the image, grow the last partition, add
//! the NoCloud seed) or deprovision it (wipe its disks). Every failure is reported with its
//! reason through `POST v1/complete`; the console says what it is doing, for an operator
//! watching the machine's screen or serial console.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use serde::Serialize;
use siteboot_agent::hints::{self, NoDisk};
use siteboot_agent::inspect::SystemRoot;
use siteboot_agent::partition::{self, PartitionError, SEED_RESERVE};
use siteboot_agent::seed::{self, MetaData, SeedError};
use siteboot_agent::wipe::{self, WipeError};
use siteboot_agent::write::{self, WriteError};
use siteboot_agent::{AgentClient, ClientError, Cmdline, Response, Token};
use siteboot_agent_api::{Complete, Disk, Progress, ProgressReport, Provision, Task, Wipe};
use siteboot_image::{Digest, ImageUrl};
use tokio::sync::watch;

const USAGE: &str = "\
usage: siteboot-agent [--cmdline FILE] [--initrd-cmdline FILE] [--root DIR]

The siteboot deploy ramdisk's agent: asks the appliance named on the kernel command line
(siteboot.agent=, siteboot.fingerprint=, siteboot.token=) for tasks and does them: inspect,
provision (write an image and a NoCloud seed), deprovision (wipe), reboot.

  --cmdline FILE  the kernel command line to read (default /proc/cmdline)
  --initrd-cmdline FILE
                  more words of it, if the file exists (default /siteboot/cmdline: a
                  kexec over SSH puts the token there, off the old OS's command lines)
  --root DIR      where sys/, proc/ and the disks' dev/ nodes are (default /)
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
    #[error("imaging {disk}: {error}; the disk was {wiped}")]
    Imaging { disk: String, error: ImagingError, wiped: &'static str },
    #[error("wiping {disk}: {error}")]
    Wipe { disk: String, error: WipeError },
    #[error("a disk step stopped without a result: {0}")]
    Panicked(#[from] tokio::task::JoinError),
}

/// Why imaging a disk stopped once its first bytes may have been written.
#[derive(Debug, thiserror::Error)]
enum ImagingError {
    #[error("writing the image: {0}")]
    Write(#[from] WriteError),
    #[error("adding the seed partition: {0}")]
    Partition(#[from] PartitionError),
    #[error("writing the seed: {0}")]
    Seed(#[from] SeedError),
    #[error("a disk step stopped without a result: {0}")]
    Panicked(#[from] tokio::task::JoinError),
}

/// What a provision writes to its disk.
struct Imaging {
    url: ImageUrl,
    digest: Digest,
    grow: bool,
    user_data: Bytes,
    meta_data: MetaData,
}

struct Agent {
    client: AgentClient,
    token: Option<Token>,
    root: SystemRoot,
    /// Its token came in the initrd's archive: kexec'ed over SSH, known to the appliance only
    /// by that token, which ends with the operation.
    kexeced: bool,
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
    /// Whether the appliance took it.
    async fn post(&self, path: &str, body: &impl Serialize) -> bool {
        let response = self.insist(Method::POST, path, Some(body)).await;
        if !response.status.is_success() {
            say!(
                "POST {path} refused: {} {}",
                response.status,
                String::from_utf8_lossy(&response.body)
            );
        }
        response.status.is_success()
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
                    let result = self.provision(*provision).await;
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
        // A network-booted ramdisk is told to reboot by its MAC, a virtual-media one is
        // power-cycled by its BMC; a kexec'ed one has nobody left to ask once its operation
        // ended. Into the new OS, or, after a failure, the old one, where siteboot's retry can
        // kexec it again.
        if self.post("v1/complete", &body).await && self.kexeced {
            reboot();
        }
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
                let report = ProgressReport { step: step.to_owned(), bytes };
                let json = serde_json::to_vec(&report).expect("serializes");
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
        let needed = task.image.size_bytes + SEED_RESERVE;
        let disk = hints::choose(&task.root_device_hints, &disks, needed)?.clone();
        say!("root disk {} ({} bytes)", disk.name, disk.size_bytes);
        let response = self.insist(Method::GET, "v1/bootstrap", None::<&()>).await;
        if !response.status.is_success() {
            let why = format!("{} {}", response.status, String::from_utf8_lossy(&response.body));
            return Err(TaskError::Bootstrap(why));
        }
        let imaging = Imaging {
            url,
            digest,
            grow: task.grow_last_partition,
            user_data: response.body,
            meta_data,
        };
        match self.image(&disk, imaging).await {
            Ok(written) => Ok(format!(
                "wrote {digest} ({written} bytes) and the NoCloud seed to {}",
                disk.name
            )),
            Err(error) => {
                // Bytes may have been written: nothing half-written (or seedless) may boot.
                let wiped = match self.wipe_disk(&disk, Wipe::Quick).await {
                    Ok(_) => "wiped",
                    Err(e) => {
                        say!("{e}");
                        "NOT wiped"
                    }
                };
                Err(TaskError::Imaging { disk: disk.name, error, wiped })
            }
        }
    }

    /// Writes the image to `disk`, then adds the seed; returns the image's bytes on the disk.
    async fn image(&self, disk: &Disk, imaging: Imaging) -> Result<u64, ImagingError> {
        let device = self.root.device(&disk.name);
        let sector = self.root.logical_block_size(&disk.name);
        let (progress, reporter) = self.report("writing image");
        let written =
            write::write_image(&imaging.url, &imaging.digest, &device, disk.size_bytes, |p| {
                progress.send_replace(Some(p));
            })
            .await;
        drop(progress);
        let _ = reporter.await;
        let written = written?;
        say!("wrote {written} bytes to {}", disk.name);
        let (size, grow) = (disk.size_bytes, imaging.grow);
        let place =
            blocking(&device, move |d| partition::add_seed_partition(d, size, sector, grow))
                .await??;
        let Imaging { user_data, meta_data, .. } = imaging;
        blocking(&device, move |d| seed::write_seed(d, place, sector, &user_data, &meta_data))
            .await??;
        say!("seed written to {}", disk.name);
        Ok(written)
    }

    async fn deprovision(&self, policy: Wipe) -> Result<String, TaskError> {
        let disks = self.root.disks();
        let mut wiped = 0;
        for disk in &disks {
            wiped += self.wipe_disk(disk, policy).await?;
        }
        Ok(format!("wiped {wiped} bytes ({policy:?}) on {} disks", disks.len()))
    }

    async fn wipe_disk(&self, disk: &Disk, policy: Wipe) -> Result<u64, TaskError> {
        if policy == Wipe::None {
            return Ok(0);
        }
        say!("wiping {} ({policy:?})", disk.name);
        let (progress, reporter) = self.report("wiping");
        let (size, sector) = (disk.size_bytes, self.root.logical_block_size(&disk.name));
        let device = self.root.device(&disk.name);
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

/// The command line at `kernel`, with the words of the file at `initrd` if there is one
/// ([`Cmdline::parse_with_initrd`]); what is wrong, naming the file.
fn read_cmdline(kernel: &Path, initrd: &Path) -> Result<Cmdline, String> {
    let read = |path: &Path| std::fs::read_to_string(path);
    let named = |path: &Path, e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let kernel_text = read(kernel).map_err(|e| named(kernel, &e))?;
    let initrd_text = match read(initrd) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(named(initrd, &e)),
    };
    Cmdline::parse_with_initrd(&kernel_text, initrd_text.as_deref()).map_err(
        |e| match initrd_text {
            Some(_) => format!("{} with {}: {e}", kernel.display(), initrd.display()),
            None => named(kernel, &e),
        },
    )
}

fn main() -> ExitCode {
    let mut cmdline_path = PathBuf::from("/proc/cmdline");
    let mut initrd_cmdline_path = PathBuf::from(siteboot_agent_api::INITRD_CMDLINE);
    let mut root = PathBuf::from("/");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--help" | "-h", _) => {
                print!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            ("--cmdline", Some(path)) => cmdline_path = path.into(),
            ("--initrd-cmdline", Some(path)) => initrd_cmdline_path = path.into(),
            ("--root", Some(path)) => root = path.into(),
            _ => {
                eprint!("siteboot-agent: unexpected argument {arg:?}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let cmdline = match read_cmdline(&cmdline_path, &initrd_cmdline_path) {
        Ok(cmdline) => cmdline,
        Err(e) => {
            say!("{e}; nothing to do");
            return ExitCode::FAILURE;
        }
    };
    say!("appliance {} (certificate {})", cmdline.agent, cmdline.fingerprint);
    let agent = Agent {
        client: AgentClient::new(cmdline.agent, cmdline.fingerprint),
        token: cmdline.token,
        root: SystemRoot(root),
        kexeced: initrd_cmdline_path.exists(),
    };
    let runtime = tokio::runtime::Runtime::new().expect("a runtime starts");
    runtime.block_on(agent.run());
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::convert::Infallible;
    use std::io::Write;
    use std::net::{Ipv4Addr, SocketAddr};
    use std::process::Command;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    use serde_json::{Value, json};
    use sha2::Digest as _;
    use siteboot_agent::{AgentUrl, Fingerprint};
    use tokio::net::TcpListener;

    use super::*;

    /// The initramfs's file is read when it is there, and only then.
    #[test]
    fn the_command_line_is_read_with_the_initrd_s_words_when_they_are_there() {
        let dir = tempfile::tempdir().unwrap();
        let (kernel, initrd) = (dir.path().join("cmdline"), dir.path().join("siteboot-cmdline"));
        let pin = format!("sha256:{}", "ab".repeat(32));
        std::fs::write(
            &kernel,
            format!(
                "console=ttyS0 siteboot.agent=https://10.0.0.1:8443 siteboot.fingerprint={pin}\n"
            ),
        )
        .unwrap();
        let without = read_cmdline(&kernel, &initrd).unwrap();
        assert_eq!((without.token, without.operation), (None, None));
        std::fs::write(&initrd, "siteboot.token=00ff siteboot.operation=op-1\n").unwrap();
        let with = read_cmdline(&kernel, &initrd).unwrap();
        assert_eq!(with.token.as_ref().map(Token::as_str), Some("00ff"));
        assert_eq!(with.operation.as_deref(), Some("op-1"));
        std::fs::write(&initrd, "siteboot.agent=https://10.0.0.9:8443\n").unwrap();
        let refused = read_cmdline(&kernel, &initrd).unwrap_err();
        assert!(
            refused.contains("siteboot-cmdline") && refused.contains("more than once"),
            "{refused}"
        );
    }

    #[test]
    fn backoff_doubles_up_to_half_a_minute() {
        let mut b = Backoff::new();
        let waits: Vec<u64> = (0..7).map(|_| b.next().as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
    }

    /// What the fake appliance was sent: (method and path, body).
    type Log = Arc<Mutex<Vec<(String, Bytes)>>>;

    /// The agent API on loopback over TLS with a fresh certificate: hands out `tasks` in
    /// order (then `wait`), serves bootstrap data and accepts every post.
    async fn appliance(tasks: Vec<Value>) -> (AgentClient, Log) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let der: CertificateDer<'static> = cert.der().clone();
        let pin = Fingerprint::of(&der);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![der],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let SocketAddr::V4(addr) = listener.local_addr().unwrap() else { unreachable!() };
        let log: Log = Arc::default();
        let tasks = Arc::new(Mutex::new(VecDeque::from(tasks)));
        let seen = log.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                let Ok(tls) = acceptor.accept(tcp).await else { continue };
                let (seen, tasks) = (seen.clone(), tasks.clone());
                let service = hyper::service::service_fn(
                    move |request: http::Request<hyper::body::Incoming>| {
                        let (seen, tasks) = (seen.clone(), tasks.clone());
                        async move {
                            let what = format!("{} {}", request.method(), request.uri().path());
                            let body = request.into_body().collect().await.unwrap().to_bytes();
                            seen.lock().unwrap().push((what.clone(), body));
                            let answer = match what.as_str() {
                                "GET /agent/v1/task" => {
                                    let next = tasks.lock().unwrap().pop_front();
                                    next.unwrap_or(json!({"action": "wait", "seconds": 1}))
                                        .to_string()
                                }
                                "GET /agent/v1/bootstrap" => {
                                    "#cloud-config\nruncmd: [[true]]\n".into()
                                }
                                _ => r#"{"ok": true}"#.into(),
                            };
                            Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from(answer))))
                        }
                    },
                );
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service),
                );
            }
        });
        let url = AgentUrl { address: *addr.ip(), port: addr.port() };
        (AgentClient::new(url, pin), log)
    }

    fn put(root: &Path, path: &str, text: &str) {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    /// A machine of one 100 MiB disk, `<root>/dev/vda`, a regular file.
    fn machine() -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        put(root.path(), "proc/meminfo", "MemTotal: 1048576 kB\n");
        put(root.path(), "sys/devices/system/cpu/online", "0\n");
        put(root.path(), "sys/block/vda/size", &(100 * 2048).to_string());
        std::fs::create_dir_all(root.path().join("sys/block/vda/device")).unwrap();
        put(root.path(), "dev/vda", "");
        std::fs::File::options()
            .write(true)
            .open(root.path().join("dev/vda"))
            .unwrap()
            .set_len(100 << 20)
            .unwrap();
        root
    }

    /// A gzipped 32 MiB GPT image (sfdisk) in `dir`: its file:// URL and digest.
    fn image(dir: &Path) -> (String, String) {
        let raw = dir.join("image.raw");
        std::fs::File::create(&raw).unwrap().set_len(32 << 20).unwrap();
        let mut sfdisk = Command::new("sfdisk")
            .args(["--no-reread", "--no-tell-kernel"])
            .arg(&raw)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("sfdisk (scripts/setup installs fdisk)");
        sfdisk.stdin.take().unwrap().write_all(b"label: gpt\n,8M,U\n,,L\n").unwrap();
        assert!(sfdisk.wait().unwrap().success());
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&std::fs::read(&raw).unwrap()).unwrap();
        let gz = gz.finish().unwrap();
        let path = dir.join("image.raw.gz");
        std::fs::write(&path, &gz).unwrap();
        let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&gz)));
        (format!("file://{}", path.display()), digest)
    }

    /// Runs the agent until the appliance has `completes` completions (or a minute passed).
    async fn run_until(agent: Agent, log: &Log, completes: usize) -> Vec<Value> {
        let running = tokio::spawn(async move { agent.run().await });
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let got: Vec<Value> = log
                .lock()
                .unwrap()
                .iter()
                .filter(|(what, _)| what == "POST /agent/v1/complete")
                .map(|(_, body)| serde_json::from_slice(body).unwrap())
                .collect();
            if got.len() >= completes {
                running.abort();
                return got;
            }
            assert!(
                Instant::now() < deadline,
                "no {completes} completions: {:?}",
                log.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn posted(log: &Log, what: &str) -> Vec<Value> {
        let log = log.lock().unwrap();
        log.iter()
            .filter(|(w, _)| w == what)
            .map(|(_, b)| serde_json::from_slice(b).unwrap())
            .collect()
    }

    fn blkid(disk: &Path, offset: u64, size: u64) -> String {
        let out = Command::new("blkid")
            .args(["-p", "-o", "export", "-O", &offset.to_string(), "-S", &size.to_string()])
            .arg(disk)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn provision(url: &str, checksum: &str) -> Value {
        json!({"action": "provision", "operation": "op-2",
               "image": {"url": url, "checksum": checksum},
               "rootDeviceHints": {"name": "vda"}, "growLastPartition": true,
               "metaData": {"instance-id": "i-1", "local-hostname": "worker-1",
                            "provider-id": "siteboot://default/worker-1"}})
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inspects_provisions_and_deprovisions_a_machine() {
        let root = machine();
        let (url, checksum) = image(root.path());
        let tasks =
            vec![json!({"action": "inspect", "operation": "op-1"}), provision(&url, &checksum)];
        let (client, log) = appliance(tasks).await;
        let agent = Agent {
            client: client.clone(),
            token: Token::new("t0k3n").ok(),
            root: SystemRoot(root.path().to_owned()),
            kexeced: false,
        };
        let completes = run_until(agent, &log, 1).await;
        assert_eq!(completes[0]["ok"], true, "{completes:?}");

        let inspection = posted(&log, "POST /agent/v1/inspection");
        assert_eq!(inspection[0]["disks"][0]["name"], "/dev/vda");
        assert_eq!(inspection[0]["memoryMiB"], 1024);
        assert!(log.lock().unwrap().iter().any(|(w, _)| w == "GET /agent/v1/bootstrap"));
        let disk = root.path().join("dev/vda");
        let dump = Command::new("sfdisk").arg("-d").arg(&disk).output().unwrap();
        let dump = String::from_utf8_lossy(&dump.stdout).into_owned();
        let seed_line = dump.lines().find(|l| l.contains("name=\"CIDATA\"")).expect(&dump);
        let field = |name: &str| -> u64 {
            let v = seed_line.split(&format!("{name}=")).nth(1).unwrap().split(',').next().unwrap();
            v.trim().parse().unwrap()
        };
        let (start, size) = (field("start") * 512, field("size") * 512);
        let found = blkid(&disk, start, size);
        assert!(found.contains("LABEL=CIDATA"), "{found}\n{dump}");

        // Deprovisioning wipes it: nothing is left for blkid to find.
        let tasks = vec![json!({"action": "deprovision", "operation": "op-3", "wipe": "quick"})];
        let (client, log) = appliance(tasks).await;
        let agent =
            Agent { client, token: None, root: SystemRoot(root.path().to_owned()), kexeced: false };
        let completes = run_until(agent, &log, 1).await;
        assert_eq!(completes[0]["ok"], true, "{completes:?}");
        assert_eq!(blkid(&disk, 0, 100 << 20), "");
        assert_eq!(blkid(&disk, start, size), "");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_provision_is_reported_and_leaves_nothing_bootable() {
        let root = machine();
        let (url, _) = image(root.path());
        let wrong = format!("sha256:{}", "0".repeat(64));
        // An image without a partition table: written whole, but no seed partition fits in.
        let tableless = root.path().join("tableless.raw");
        std::fs::write(&tableless, b"not a partition table ".repeat(50_000)).unwrap();
        let tableless_digest = format!(
            "sha256:{}",
            hex::encode(sha2::Sha256::digest(std::fs::read(&tableless).unwrap()))
        );
        let tasks = vec![
            provision(&url, &wrong),
            provision(&format!("file://{}", tableless.display()), &tableless_digest),
            json!({"action": "provision", "operation": "op-4",
                   "image": {"url": url, "checksum": wrong},
                   "rootDeviceHints": {"serial": "no-such-disk"},
                   "metaData": {"instance-id": "i-1"}}),
        ];
        let (client, log) = appliance(tasks).await;
        let agent =
            Agent { client, token: None, root: SystemRoot(root.path().to_owned()), kexeced: false };
        let completes = run_until(agent, &log, 3).await;
        let disk = root.path().join("dev/vda");
        let message = completes[0]["message"].as_str().unwrap();
        assert_eq!(completes[0]["ok"], false);
        assert!(message.contains("not the expected"), "{message}");
        assert!(message.ends_with("the disk was wiped"), "{message}");
        assert_eq!(blkid(&disk, 0, 100 << 20), "");
        let message = completes[1]["message"].as_str().unwrap();
        assert_eq!(completes[1]["ok"], false);
        assert!(message.contains("the image has no partition table"), "{message}");
        assert!(message.ends_with("the disk was wiped"), "{message}");
        let first_mib = &std::fs::read(&disk).unwrap()[..1 << 20];
        assert!(first_mib.iter().all(|b| *b == 0), "the tableless image is still on the disk");
        assert_eq!(completes[2]["ok"], false);
        let message = completes[2]["message"].as_str().unwrap();
        assert!(message.contains("/dev/vda is not the hinted serial"), "{message}");
    }
}
