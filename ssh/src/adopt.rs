//! Adopting a running server and releasing it, as plans: each step is data (a file to upload,
//! a command to run and what its result must be), so the unit tests read every command, and
//! [`follow`] runs a plan over a [`Session`] deciding nothing: it stops at the first step that
//! fails and says which, with what the host printed kept short and printable.
//!
//! What comes from a tenant or a Host (the bootstrap data, the instance-id, the hostname, the
//! provider-id) travels only as the content of an uploaded file; the one value of a delivery
//! that appears on a command line, its id, is siteboot's, a plain word, and single-quoted all
//! the same ([`quote`]). Every command runs under `timeout(1)`: sshd does not pass a kill signal
//! to a root login's command, so a deadline on the channel alone would leave it running.
//!
//! Delivery runs the data once. The run is started as a transient systemd unit (it outlives a
//! dropped connection and ends with the data's run: nothing of siteboot's stays running), and
//! its start claims the host's delivery marker with an exclusive create: a second start for the
//! same delivery finds the marker and runs nothing. A delivery resumed after a crash
//! [`probe`]s first and learns from the marker and the run's result file where it stands
//! ([`progress`]).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use std::future::Future;

use crate::upload::{FileMode, RemotePath, quote};
use crate::{ExitStatus, Output, Session, SshError};

/// Where siteboot keeps what it must find again on the host: the delivery marker and the run's
/// result.
pub const STATE_DIR: &str = "/var/lib/siteboot/adopt";
/// cloud-init's NoCloud seed directory: read as the data source at the next cloud-init run.
pub const SEED_DIR: &str = "/var/lib/cloud/seed/nocloud";
/// The seed's vendor-data (under the user-data, which may say otherwise): a new instance-id
/// makes cloud-init delete and regenerate the SSH host keys by default, and siteboot, which
/// pins the key, could then not log in to reset the host.
const KEEP_HOST_KEYS: &str = "#cloud-config\nssh_deletekeys: false\n";
/// A cloud-init configuration file the delivery adds and the reset removes: NoCloud looks for
/// its seed in [`SEED_DIR`] only. A seed device (a filesystem labelled `cidata`: the seed
/// partition an earlier imaging left, a cloud image's seed disk) would replace the seed's
/// user-data with its own, and the tenant's data would silently not run.
pub const SEED_DEVICES_OFF: &str = "/etc/cloud/cloud.cfg.d/99-siteboot-adopted.cfg";
const SEED_DEVICES_OFF_CONFIG: &str = "# siteboot's adoption: the NoCloud seed is \
    /var/lib/cloud/seed/nocloud only (no device has this label). siteboot's reset removes this.\n\
    datasource:\n  NoCloud:\n    fs_label: siteboot-adopted-no-device\n";
/// The file of [`STATE_DIR`] that says what kubelet's and containerd's units were before the
/// delivery (`<unit> <is-enabled>` lines), which the reset puts back.
const UNITS_BEFORE: &str = "units-before";
/// [`UNITS_BEFORE`]'s path, quoted for a script.
fn units_before() -> String {
    quote(&format!("{STATE_DIR}/{UNITS_BEFORE}"))
}

/// The units a delivery may enable and a reset stops, disables and puts back.
const UNITS: &str = "kubelet containerd";
/// The transient unit that runs the data.
const RUN_UNIT: &str = "siteboot-adopt";
/// How long the data's run may take (a kubeadm join pulls images).
pub const RUN_LIMIT: Duration = Duration::from_secs(30 * 60);
/// How long a short command (a check, a probe, a removal) may take.
pub(crate) const SHORT: Duration = Duration::from_secs(60);
/// How long `kubeadm reset` may take (it drains nothing, but waits on etcd and the runtime).
const RESET_LIMIT: Duration = Duration::from_secs(5 * 60);
/// The slowest link an upload is given time for: a ramdisk's kernel and initrd (some 15 MB)
/// take a minute at 2 Mbit/s on top of [`SHORT`].
const UPLOAD_RATE: usize = 256 * 1024;
/// What the channel waits beyond a command's own `timeout(1)`: for it to report.
const CHANNEL_GRACE: Duration = Duration::from_secs(15);

/// One step of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Write `bytes` to `path` with `mode`, whole or not at all.
    Upload {
        path: RemotePath,
        bytes: Vec<u8>,
        mode: FileMode,
        what: &'static str,
    },
    Run(Command),
}

/// A command, bounded by `timeout(1)` on the server, and what its result must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// The command line sent: the script under `timeout`.
    pub line: String,
    /// What it does or checks, for a condition saying which step failed.
    pub what: &'static str,
    pub expect: Expect,
    /// How long the channel waits for it.
    pub deadline: Duration,
}

/// What a command's result must be for its step to have worked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Exit status 0; stderr says what is wrong otherwise.
    Success,
    /// Exit status 0 and nothing on stdout: each line printed is something left behind.
    NothingLeft,
    /// Whatever it prints is read by the caller ([`progress`]).
    Output,
}

impl Command {
    /// `script` run by `sh` under `timeout limit`: the one place a command line is made.
    pub(crate) fn new(what: &'static str, script: &str, limit: Duration, expect: Expect) -> Self {
        let line = format!("timeout {} sh -c {}", limit.as_secs(), quote(script));
        Self { line, what, expect, deadline: limit + CHANNEL_GRACE }
    }
}

/// siteboot's id of the operation a marker on the host is for (a delivery, a kexec): a plain
/// word (letters, digits, `.`, `_`, `-`; at most 64), so that the marker it is written into
/// never holds anything else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationId(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdoptError {
    #[error("an operation id is 1 to 64 letters, digits, '.', '_' or '-'")]
    OperationId,
    #[error(
        "bootstrap data format {0:?} cannot be delivered to a running host (cloud-config and script can)"
    )]
    Format(String),
    #[error("the host's delivery marker is unreadable: {0:?}")]
    Probe(String),
}

impl FromStr for OperationId {
    type Err = AdoptError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let word = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if s.is_empty() || s.len() > 64 || !s.chars().all(word) {
            return Err(AdoptError::OperationId);
        }
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl OperationId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// How the bootstrap data is run (its Secret's `format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataFormat {
    /// cloud-init user-data: seeded as NoCloud, and cloud-init run on it.
    CloudConfig,
    /// A program (`#!` first): run as it is.
    Script,
}

impl FromStr for DataFormat {
    type Err = AdoptError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cloud-config" => Ok(Self::CloudConfig),
            "script" => Ok(Self::Script),
            other => Err(AdoptError::Format(other.chars().take(32).collect())),
        }
    }
}

/// The NoCloud meta-data: what the host is to cloud-init and to Kubernetes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaData {
    pub instance_id: String,
    pub local_hostname: String,
    pub provider_id: String,
}

impl MetaData {
    /// As JSON, which is YAML: every value a JSON string, whatever it holds.
    fn to_bytes(&self) -> Vec<u8> {
        let meta = serde_json::json!({
            "instance-id": self.instance_id,
            "local-hostname": self.local_hostname,
            "provider-id": self.provider_id,
        });
        let mut bytes = serde_json::to_vec_pretty(&meta).expect("strings serialize");
        bytes.push(b'\n');
        bytes
    }
}

/// A Machine's bootstrap data for one host, in one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub id: OperationId,
    pub meta: MetaData,
    pub data: Vec<u8>,
    pub format: DataFormat,
}

/// The command that says where the host stands: its delivery marker and its run's result
/// (see [`progress`]).
pub fn probe() -> Command {
    let script = format!(
        "cd {dir} 2>/dev/null || exit 0; \
         for f in delivery result; do [ -f $f ] && printf '%s=%s\\n' $f \"$(head -c 80 $f)\"; done; \
         exit 0",
        dir = quote(STATE_DIR)
    );
    Command::new("reading the delivery marker", &script, SHORT, Expect::Output)
}

/// Where a delivery stands on the host, from what [`probe`] printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// No delivery was started: [`deliver`]'s steps, from the first.
    NotStarted,
    /// This delivery's run was started and has not finished (or was cut off before it could
    /// say: it is never started again).
    Running,
    /// This delivery's run ended with this exit status.
    Finished(i32),
    /// Another delivery was started on this host, and no reset ran since: nothing is sent.
    OtherDelivery,
}

/// Where `id` stands, from [`probe`]'s output.
pub fn progress(probed: &str, id: &OperationId) -> Result<Progress, AdoptError> {
    let mut marker = None;
    let mut result = None;
    for line in probed.lines() {
        match line.split_once('=') {
            Some(("delivery", value)) => marker = Some(value.trim()),
            Some(("result", value)) => result = Some(value.trim()),
            _ => return Err(AdoptError::Probe(line.chars().take(80).collect())),
        }
    }
    Ok(match (marker, result) {
        (None, None) => Progress::NotStarted,
        (None, Some(_)) => return Err(AdoptError::Probe("a result without a delivery".into())),
        (Some(marker), _) if marker != id.0 => Progress::OtherDelivery,
        (Some(_), None) => Progress::Running,
        (Some(_), Some(code)) => Progress::Finished(
            code.parse().map_err(|_| AdoptError::Probe(code.chars().take(16).collect()))?,
        ),
    })
}

/// The host can be adopted: a Linux with os-release, systemd as PID 1 (the run is a systemd
/// unit), the tools the format needs, and no kubelet state of a previous life.
fn check(format: DataFormat) -> Command {
    let tools = match format {
        DataFormat::CloudConfig => "systemd-run cloud-init",
        DataFormat::Script => "systemd-run",
    };
    let script = format!(
        "fail() {{ echo \"$*\" >&2; exit 1; }}; \
         [ -r /etc/os-release ] || fail 'no /etc/os-release'; \
         [ \"$(cat /proc/1/comm)\" = systemd ] || fail \"PID 1 is $(cat /proc/1/comm), not systemd\"; \
         for t in {tools}; do command -v $t >/dev/null || fail \"$t is not installed\"; done; \
         for p in /etc/kubernetes/kubelet.conf /etc/kubernetes/admin.conf /etc/kubernetes/pki \
                  /var/lib/kubelet/config.yaml /var/lib/kubelet/pki; do \
           [ -e $p ] && fail \"$p exists: a previous kubelet's state (reset the host first)\"; \
         done; \
         systemctl is-active --quiet kubelet && fail 'kubelet is running'; \
         exit 0"
    );
    Command::new("checking the host", &script, SHORT, Expect::Success)
}

pub(crate) fn path(text: &str) -> RemotePath {
    text.parse().expect("a constant absolute path")
}

/// Seeds, claims and starts `delivery`, for a host where [`progress`] said
/// [`Progress::NotStarted`]. The last step claims the marker and starts the run in one
/// command: if the marker exists it fails, and nothing runs.
pub fn deliver(delivery: &Delivery) -> Vec<Step> {
    let private = FileMode::new(0o600).expect("permission bits");
    // A server that never ran cloud-init has no seed directory, nor siteboot's own: root's only.
    let directories = format!("umask 077 && mkdir -p {} {}", quote(SEED_DIR), quote(STATE_DIR));
    // Rewritten by a delivery resumed before its start: nothing has run since.
    let record = format!(
        "for u in {UNITS}; do printf '%s %s\\n' $u \"$(systemctl is-enabled $u.service 2>/dev/null)\"; \
         done > {units}",
        units = units_before(),
    );
    let mut steps = vec![
        Step::Run(check(delivery.format)),
        Step::Run(Command::new(
            "making the seed's and siteboot's directories",
            &directories,
            SHORT,
            Expect::Success,
        )),
    ];
    let run = match delivery.format {
        DataFormat::CloudConfig => {
            steps.push(Step::Upload {
                path: path(&format!("{SEED_DIR}/meta-data")),
                bytes: delivery.meta.to_bytes(),
                mode: private,
                what: "writing the NoCloud meta-data",
            });
            steps.push(Step::Upload {
                path: path(&format!("{SEED_DIR}/user-data")),
                bytes: delivery.data.clone(),
                mode: private,
                what: "writing the NoCloud user-data",
            });
            steps.push(Step::Upload {
                path: path(&format!("{SEED_DIR}/vendor-data")),
                bytes: KEEP_HOST_KEYS.as_bytes().to_vec(),
                mode: private,
                what: "writing the NoCloud vendor-data",
            });
            steps.push(Step::Upload {
                path: path(SEED_DEVICES_OFF),
                bytes: SEED_DEVICES_OFF_CONFIG.as_bytes().to_vec(),
                mode: FileMode::new(0o644).expect("permission bits"),
                what: "turning cloud-init's seed devices off",
            });
            // A clean slate, so this instance's modules run; then cloud-init's own stages, as
            // at boot.
            "cloud-init clean --logs && cloud-init init --local && cloud-init init && \
             cloud-init modules --mode=config && cloud-init modules --mode=final"
                .to_owned()
        }
        DataFormat::Script => {
            let script = format!("{STATE_DIR}/bootstrap");
            steps.push(Step::Upload {
                path: path(&script),
                bytes: delivery.data.clone(),
                mode: FileMode::new(0o700).expect("permission bits"),
                what: "writing the bootstrap script",
            });
            quote(&script)
        }
    };
    let dir = quote(STATE_DIR);
    // The unit writes its result atomically; timeout(1) inside bounds the run, so the result is
    // written even when it is cut off.
    let unit_script = format!(
        "timeout {limit} sh -c {run}; echo $? > {dir}/result.partial && mv -f {dir}/result.partial {dir}/result",
        limit = RUN_LIMIT.as_secs(),
        run = quote(&run),
    );
    let start = format!(
        "mkdir -p {dir} && (set -C && printf '%s\\n' {id} > {dir}/delivery) && \
         systemd-run --unit={RUN_UNIT} --collect --quiet --property=RuntimeMaxSec={max} \
         sh -c {unit}",
        id = quote(&delivery.id.0),
        max = RUN_LIMIT.as_secs() + 60,
        unit = quote(&unit_script),
    );
    steps.push(Step::Run(Command::new(
        "recording kubelet's and containerd's units",
        &record,
        SHORT,
        Expect::Success,
    )));
    steps.push(Step::Run(Command::new("starting the run", &start, SHORT, Expect::Success)));
    steps
}

/// What a node's Kubernetes state is made of, removed by a reset and checked gone after it.
const KUBERNETES_STATE: &[&str] = &[
    "/etc/kubernetes",
    "/var/lib/kubelet",
    "/var/lib/etcd",
    "/etc/cni/net.d",
    "/var/lib/cni",
    "/var/lib/containerd",
    "/run/containerd",
];

/// Releases an adopted host: its Kubernetes state goes (kubelet, containerd's state, CNI,
/// certificates), its OS and data disks stay; a step prints what is left, and must print
/// nothing. Then kubelet and containerd are enabled again if they were before the delivery
/// (containerd started: the next tenant's data, kubeadm's say, expects it running, as it was
/// before the host was adopted). The delivery marker goes last, so a reset cut short is a host
/// still adopted, and is run again. Every step can run again.
pub fn reset() -> Vec<Step> {
    let state: Vec<String> = KUBERNETES_STATE.iter().map(|p| quote(p)).collect();
    let state = state.join(" ");
    let devices_off = quote(SEED_DEVICES_OFF);
    let run =
        |what, script: &str, limit| Step::Run(Command::new(what, script, limit, Expect::Success));
    vec![
        // kubeadm's own reset when it is there (it knows the node's etcd member, its
        // certificates); what it leaves or fails at, the steps after remove.
        run(
            "kubeadm reset",
            "if command -v kubeadm >/dev/null; then kubeadm reset -f || echo 'kubeadm reset failed; removing by hand' >&2; fi; exit 0",
            RESET_LIMIT,
        ),
        run(
            "stopping kubelet and containerd",
            &format!(
                "for u in {UNITS}; do systemctl disable --now $u.service 2>/dev/null; done; \
             if systemctl is-active --quiet kubelet || systemctl is-active --quiet containerd; then \
               echo 'kubelet or containerd still runs' >&2; exit 1; fi; exit 0"
            ),
            SHORT,
        ),
        run(
            "removing the node's Kubernetes state",
            &format!(
                "findmnt -rn -o TARGET | grep -E '^/var/lib/(kubelet|containerd)/|^/run/containerd/' \
                 | sort -r | while read -r m; do umount -l \"$(printf '%b' \"$m\")\"; done; \
                 rm -rf {state} {seed} {devices_off}",
                seed = quote(SEED_DIR),
            ),
            SHORT,
        ),
        Step::Run(Command::new(
            "verifying the reset",
            &format!(
                "for p in {state} {devices_off}; do [ -e \"$p\" ] && echo \"$p\"; done; \
                 for u in kubelet containerd; do systemctl is-active --quiet $u && echo \"$u running\"; done; \
                 exit 0"
            ),
            SHORT,
            Expect::NothingLeft,
        )),
        run(
            "enabling kubelet and containerd again as they were before",
            &format!(
                "f={units}; [ -f $f ] || exit 0; \
                 for u in {UNITS}; do \
                   if grep -qx \"$u enabled\" $f; then systemctl enable --quiet $u.service || exit 1; fi; \
                 done; \
                 if grep -qx 'containerd enabled' $f; then systemctl start containerd.service || exit 1; fi; \
                 exit 0",
                units = units_before(),
            ),
            SHORT,
        ),
        run("removing the delivery marker", &format!("rm -rf {}", quote(STATE_DIR)), SHORT),
    ]
}

/// What a plan is followed on: a [`Session`], or in tests a stand-in.
pub trait Remote {
    fn run(
        &self,
        line: &str,
        deadline: Duration,
    ) -> impl Future<Output = Result<Output, SshError>> + Send;
    fn upload(
        &self,
        path: &RemotePath,
        mode: FileMode,
        bytes: &[u8],
        deadline: Duration,
    ) -> impl Future<Output = Result<(), SshError>> + Send;
}

impl Remote for Session {
    async fn run(&self, line: &str, deadline: Duration) -> Result<Output, SshError> {
        Session::run(self, line, b"", deadline).await
    }

    async fn upload(
        &self,
        path: &RemotePath,
        mode: FileMode,
        bytes: &[u8],
        deadline: Duration,
    ) -> Result<(), SshError> {
        Session::upload(self, path, mode, bytes, deadline).await
    }
}

/// Which step of a plan failed, and why. What the host printed is kept short and printable:
/// it goes into a condition.
#[derive(Debug, thiserror::Error)]
pub enum StepFailed {
    #[error("{what}: {source}")]
    Ssh { what: &'static str, source: SshError },
    #[error("{what} failed ({status:?}): {stderr}")]
    Failed { what: &'static str, status: ExitStatus, stderr: String },
    #[error("{what}: still there: {left}")]
    LeftBehind { what: &'static str, left: String },
    #[error("{what}: {source}")]
    Progress { what: &'static str, source: AdoptError },
    #[error("{what}: {source}")]
    Marker { what: &'static str, source: crate::reimage::UnreadableMarker },
}

/// How much of what a host printed an error keeps.
const ECHO: usize = 200;

/// `text` without control characters, at most [`ECHO`] characters.
fn echoed(text: &str) -> String {
    let printable = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut kept: String = printable.chars().filter(|c| !c.is_control()).take(ECHO).collect();
    if printable.chars().count() > ECHO {
        kept.push('…');
    }
    kept
}

/// Follows `steps` in order on `remote`, stopping at the first that fails.
pub async fn follow(remote: &impl Remote, steps: &[Step]) -> Result<(), StepFailed> {
    for step in steps {
        match step {
            Step::Upload { path, bytes, mode, what } => remote
                .upload(path, *mode, bytes, upload_deadline(bytes.len()))
                .await
                .map_err(|source| StepFailed::Ssh { what, source })?,
            Step::Run(command) => {
                run(remote, command).await?;
            }
        }
    }
    Ok(())
}

/// How long an upload of `len` bytes may take: [`SHORT`], and the time it takes at
/// [`UPLOAD_RATE`].
fn upload_deadline(len: usize) -> Duration {
    SHORT + Duration::from_secs((len / UPLOAD_RATE) as u64)
}

/// Runs `command` and checks its result as it [`Expect`]s; its stdout.
pub(crate) async fn run(remote: &impl Remote, command: &Command) -> Result<String, StepFailed> {
    let what = command.what;
    let output = remote
        .run(&command.line, command.deadline)
        .await
        .map_err(|source| StepFailed::Ssh { what, source })?;
    if !output.success() {
        let stderr = echoed(&output.stderr.text());
        return Err(StepFailed::Failed { what, status: output.status, stderr });
    }
    let stdout = output.stdout.text();
    if command.expect == Expect::NothingLeft && !stdout.trim().is_empty() {
        return Err(StepFailed::LeftBehind { what, left: echoed(&stdout) });
    }
    Ok(stdout)
}

/// Why a delivery cannot go on (nothing of it was started by the pass that says so).
#[derive(Debug, thiserror::Error)]
pub enum Stalled {
    /// A step failed: the run was not started, or whether it was is unknown (the next pass
    /// probes).
    #[error(transparent)]
    Step(#[from] StepFailed),
    #[error(
        "the server holds another delivery's marker in {STATE_DIR}, and no reset ran since: nothing was sent"
    )]
    OtherDelivery,
    #[error(
        "the server no longer has delivery {0}'s marker in {STATE_DIR}, though its run was seen started: it is not run again; reset the host (release it) first"
    )]
    MarkerLost(OperationId),
}

/// One pass of delivery `id` on the server behind `remote`, as the Kubernetes and the
/// standalone modes both run it: where it stands, probed first on every pass, and, only if it
/// was never started, `delivery` (of `id`; `None`: not staged yet, nothing is sent) followed,
/// which claims the marker and starts the run. `seen_started`: an earlier pass saw this run
/// started, so a server without the marker lost it, and nothing is run again.
pub async fn advance(
    remote: &impl Remote,
    id: &OperationId,
    seen_started: bool,
    delivery: Option<&Delivery>,
) -> Result<Progress, Stalled> {
    match where_it_stands(remote, id).await? {
        Progress::NotStarted if seen_started => return Err(Stalled::MarkerLost(id.clone())),
        Progress::NotStarted => {}
        Progress::OtherDelivery => return Err(Stalled::OtherDelivery),
        progress => return Ok(progress),
    }
    let Some(delivery) = delivery else { return Ok(Progress::NotStarted) };
    follow(remote, &deliver(delivery)).await?;
    Ok(Progress::Running)
}

/// Where delivery `id` stands on the host behind `remote` ([`probe`], [`progress`]).
pub async fn where_it_stands(
    remote: &impl Remote,
    id: &OperationId,
) -> Result<Progress, StepFailed> {
    let probe = probe();
    let probed = run(remote, &probe).await?;
    progress(&probed, id).map_err(|source| StepFailed::Progress { what: probe.what, source })
}

/// A stand-in for a host, for the tests of this crate's plans (adopt's and reimage's).
#[cfg(test)]
pub(crate) mod fake {
    use std::future::Future;
    use std::sync::Mutex;
    use std::time::Duration;

    use super::Remote;
    use crate::output::Captured;
    use crate::upload::{FileMode, RemotePath};
    use crate::{ExitStatus, Output, SshError};

    /// A command line's exit code, stdout and stderr.
    type Answer = (u32, &'static str, String);

    /// A host that answers each command line as `answer` says, recording what it was sent and
    /// what was uploaded.
    pub(crate) struct Fake {
        pub(crate) sent: Mutex<Vec<String>>,
        pub(crate) uploaded: Mutex<Vec<(String, Vec<u8>)>>,
        answer: Box<dyn Fn(&str) -> Answer + Send + Sync>,
    }

    impl Fake {
        pub(crate) fn new(answer: impl Fn(&str) -> Answer + Send + Sync + 'static) -> Self {
            Self { sent: Mutex::default(), uploaded: Mutex::default(), answer: Box::new(answer) }
        }
    }

    impl Remote for Fake {
        async fn run(&self, line: &str, _: Duration) -> Result<Output, SshError> {
            self.sent.lock().unwrap().push(line.to_owned());
            let (code, stdout, stderr) = (self.answer)(line);
            Ok(Output {
                status: ExitStatus::Code(code),
                stdout: Captured::of(stdout.as_bytes()),
                stderr: Captured::of(stderr.as_bytes()),
            })
        }

        async fn upload(
            &self,
            path: &RemotePath,
            _: FileMode,
            bytes: &[u8],
            _: Duration,
        ) -> Result<(), SshError> {
            self.sent.lock().unwrap().push(format!("upload {path}"));
            self.uploaded.lock().unwrap().push((path.to_string(), bytes.to_vec()));
            Ok(())
        }
    }

    pub(crate) fn block_on<T>(future: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(future)
    }
}

#[cfg(test)]
mod tests {
    use super::fake::{Fake, block_on};
    use super::*;

    /// Values a Host or a tenant might write to get a command run or a key injected.
    const HOSTILE: &[&str] = &[
        "it's",
        "'; touch /tmp/pwned; '",
        "$(touch /tmp/pwned)",
        "`touch /tmp/pwned`",
        "a\nprovider-id: siteboot://other/host",
        "x\" , \"provider-id\": \"evil",
        "\\'\\",
        "é ✓ \u{0}",
    ];

    fn delivery(format: DataFormat, meta: MetaData) -> Delivery {
        Delivery {
            id: "op-1".parse().unwrap(),
            meta,
            data: b"#cloud-config\n{}\n".to_vec(),
            format,
        }
    }

    fn meta(value: &str) -> MetaData {
        MetaData {
            instance_id: value.into(),
            local_hostname: value.into(),
            provider_id: format!("siteboot://metal/{value}"),
        }
    }

    fn lines(steps: &[Step]) -> Vec<&str> {
        steps
            .iter()
            .filter_map(|s| match s {
                Step::Run(c) => Some(c.line.as_str()),
                Step::Upload { .. } => None,
            })
            .collect()
    }

    /// On a server that never ran cloud-init, the files land: the directories are made (a real
    /// shell, on a scratch root standing in for the server's) before the first upload.
    #[test]
    fn the_directories_are_made_before_the_first_upload() {
        for format in [DataFormat::CloudConfig, DataFormat::Script] {
            let steps = deliver(&delivery(format, meta("h")));
            let first_upload = steps.iter().position(|s| matches!(s, Step::Upload { .. })).unwrap();
            let Step::Run(make) = &steps[first_upload - 1] else { panic!("{steps:?}") };
            let root = std::env::temp_dir().join(format!("siteboot-dirs-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            let line = make.line.replace("/var/lib", &format!("{}/var/lib", root.display()));
            let made = std::process::Command::new("sh").args(["-c", &line]).status().unwrap();
            assert!(made.success(), "{line}");
            for dir in [SEED_DIR, STATE_DIR] {
                assert!(root.join(&dir[1..]).is_dir(), "{dir} not made by {line}");
            }
            std::fs::remove_dir_all(&root).unwrap();
        }
    }

    /// cloud-init's new instance would delete the host keys siteboot pins: the seed's
    /// vendor-data keeps them, and only a cloud-config delivery runs cloud-init.
    #[test]
    fn a_cloud_config_delivery_keeps_the_host_keys() {
        let vendor_data = |format| {
            deliver(&delivery(format, meta("h"))).into_iter().find_map(|s| match s {
                Step::Upload { path, bytes, .. } if path.to_string().ends_with("/vendor-data") => {
                    Some(String::from_utf8(bytes).unwrap())
                }
                _ => None,
            })
        };
        let seeded = vendor_data(DataFormat::CloudConfig).expect("no vendor-data seeded");
        assert_eq!(seeded.lines().collect::<Vec<_>>(), ["#cloud-config", "ssh_deletekeys: false"]);
        assert_eq!(vendor_data(DataFormat::Script), None);
    }

    /// A seed device (the partition an imaging left, a cloud image's seed disk) would replace
    /// the seed's user-data (cloud-init 22.4's NoCloud reads both, the device last): the
    /// delivery points NoCloud at a label no device has, in a file the reset removes and
    /// verifies gone.
    #[test]
    fn a_cloud_config_delivery_turns_seed_devices_off_until_the_reset() {
        let steps = deliver(&delivery(DataFormat::CloudConfig, meta("h")));
        let config = steps.iter().find_map(|s| match s {
            Step::Upload { path, bytes, mode, .. } if path.to_string() == SEED_DEVICES_OFF => {
                Some((String::from_utf8(bytes.clone()).unwrap(), mode.bits()))
            }
            _ => None,
        });
        let (config, mode) = config.expect("seed devices left on");
        assert_eq!(mode, 0o644);
        let settings: Vec<&str> = config.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            settings,
            ["datasource:", "  NoCloud:", "    fs_label: siteboot-adopted-no-device"]
        );
        // Before the run starts.
        let upload = steps.iter().position(
            |s| matches!(s, Step::Upload { path, .. } if path.to_string() == SEED_DEVICES_OFF),
        );
        assert!(
            upload
                < steps
                    .iter()
                    .position(|s| matches!(s, Step::Run(c) if c.what == "starting the run"))
        );
        let reset = reset();
        let Step::Run(verify) = &reset[3] else { panic!() };
        assert!(
            lines(&reset)[2].contains(SEED_DEVICES_OFF) && verify.line.contains(SEED_DEVICES_OFF)
        );
    }

    /// The meta-data reads back as exactly the three values, whatever they hold.
    #[test]
    fn hostile_meta_data_is_data_in_an_uploaded_file_and_never_on_a_command_line() {
        let plain = deliver(&delivery(DataFormat::CloudConfig, meta("h")));
        for value in HOSTILE {
            let steps = deliver(&delivery(DataFormat::CloudConfig, meta(value)));
            // The command lines do not depend on the values at all.
            assert_eq!(lines(&steps), lines(&plain), "{value:?} reached a command line");
            let Step::Upload { path, bytes, mode, .. } = &steps[2] else { panic!("{steps:?}") };
            assert_eq!(path.to_string(), "/var/lib/cloud/seed/nocloud/meta-data");
            assert_eq!(mode.bits(), 0o600);
            let read: serde_json::Value = serde_json::from_slice(bytes).unwrap();
            assert_eq!(
                read,
                serde_json::json!({
                    "instance-id": value,
                    "local-hostname": value,
                    "provider-id": format!("siteboot://metal/{value}"),
                }),
                "{value:?}"
            );
        }
    }

    /// Every command line is `timeout N sh -c '<script>'`, one word after `-c`, and a real
    /// shell parses it (dry: `sh -n`).
    #[test]
    fn every_command_is_bounded_by_timeout_and_parses() {
        let mut steps = deliver(&delivery(DataFormat::CloudConfig, meta("h")));
        steps.extend(deliver(&delivery(DataFormat::Script, meta("h"))));
        steps.extend(reset());
        let mut commands: Vec<Command> = steps
            .into_iter()
            .filter_map(|s| match s {
                Step::Run(c) => Some(c),
                Step::Upload { .. } => None,
            })
            .collect();
        commands.push(probe());
        for command in &commands {
            let rest = command.line.strip_prefix("timeout ").expect(&command.line);
            let (secs, script) = rest.split_once(" sh -c ").expect(&command.line);
            let secs: u64 = secs.parse().unwrap();
            assert_eq!(command.deadline, Duration::from_secs(secs) + CHANNEL_GRACE);
            // The script's quoting is the one function's, and the shell reads it back whole.
            let out = std::process::Command::new("sh")
                .args(["-c", &format!("printf %s {script}")])
                .output()
                .unwrap();
            let inner = String::from_utf8(out.stdout).unwrap();
            assert_eq!(quote(&inner), script);
            let parsed = std::process::Command::new("sh").args(["-n", "-c", &inner]).output();
            assert!(parsed.unwrap().status.success(), "{inner}");
        }
    }

    /// The probe, run by a real shell on a scratch directory standing in for the host's state,
    /// reads back as where the delivery stands; the claim creates the marker once only.
    #[test]
    fn a_resumed_delivery_learns_where_it_stands_and_never_starts_twice() {
        let id: OperationId = "op-1".parse().unwrap();
        let dir = std::env::temp_dir().join(format!("siteboot-adopt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let on_host = |line: &str| {
            let line = line.replace(STATE_DIR, dir.to_str().unwrap());
            std::process::Command::new("sh").args(["-c", &line]).output().unwrap()
        };
        let probed = |_: ()| String::from_utf8(on_host(&probe().line).stdout).unwrap();
        assert_eq!(progress(&probed(()), &id), Ok(Progress::NotStarted));
        // The claim of the start command, without systemd-run.
        let steps = deliver(&delivery(DataFormat::Script, meta("h")));
        let start = lines(&steps).last().copied().unwrap();
        let claim = start.split(" && systemd-run").next().unwrap().to_owned() + "'";
        assert!(on_host(&claim).status.success(), "{claim}");
        assert!(!on_host(&claim).status.success(), "the marker was claimed twice");
        assert_eq!(progress(&probed(()), &id), Ok(Progress::Running));
        std::fs::write(dir.join("result"), "0\n").unwrap();
        assert_eq!(progress(&probed(()), &id), Ok(Progress::Finished(0)));
        let other: OperationId = "op-2".parse().unwrap();
        assert_eq!(progress(&probed(()), &other), Ok(Progress::OtherDelivery));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(progress("garbage", &id).is_err());
        assert!(progress("result=0\n", &id).is_err());
        assert!(progress("delivery=op-1\nresult=x\n", &id).is_err());
    }

    #[test]
    fn delivery_ids_are_plain_words_and_formats_are_known() {
        for bad in ["", "a b", "a'b", "a\nb", &"x".repeat(65)] {
            assert_eq!(bad.parse::<OperationId>(), Err(AdoptError::OperationId), "{bad:?}");
        }
        assert_eq!("cloud-config".parse(), Ok(DataFormat::CloudConfig));
        assert_eq!("script".parse(), Ok(DataFormat::Script));
        assert!(matches!("ignition".parse::<DataFormat>(), Err(AdoptError::Format(_))));
    }

    /// A plan stops at the first step that fails, which the error names with what the host
    /// said, short and printable; a verification that prints something fails.
    #[test]
    fn a_plan_stops_at_its_first_failing_step_and_says_which() {
        let not_systemd = Fake::new(|line| match line.contains("os-release") {
            true => (1, "", format!("PID 1 is init, not systemd\n\u{1b}[2J{}", "x".repeat(500))),
            false => (0, "", String::new()),
        });
        let steps = deliver(&delivery(DataFormat::CloudConfig, meta("h")));
        let err = block_on(follow(&not_systemd, &steps)).unwrap_err();
        let message = err.to_string();
        assert!(
            message.starts_with("checking the host failed (Code(1)): PID 1 is init"),
            "{message}"
        );
        assert!(
            !message.chars().any(char::is_control) && message.chars().count() < 260,
            "{message}"
        );
        assert_eq!(not_systemd.sent.lock().unwrap().len(), 1, "steps ran after the check failed");

        let leftovers = Fake::new(|line| match line.contains("[ -e") {
            true => (0, "/var/lib/kubelet\n", String::new()),
            false => (0, "", String::new()),
        });
        let err = block_on(follow(&leftovers, &reset())).unwrap_err();
        assert!(
            matches!(&err, StepFailed::LeftBehind { left, .. } if left == "/var/lib/kubelet"),
            "{err}"
        );
        assert_eq!(leftovers.sent.lock().unwrap().len(), 4, "the marker went despite leftovers");

        let fine = Fake::new(|_| (0, "", String::new()));
        block_on(follow(&fine, &reset())).unwrap();
        assert_eq!(fine.sent.lock().unwrap().len(), 6);
        let id: OperationId = "op-1".parse().unwrap();
        assert_eq!(block_on(where_it_stands(&fine, &id)).unwrap(), Progress::NotStarted);
    }

    /// The reset removes the state it then verifies gone, the marker last.
    #[test]
    fn the_reset_removes_the_node_state_verifies_it_and_then_the_marker() {
        let steps = reset();
        let Step::Run(verify) = &steps[3] else { panic!() };
        assert_eq!(verify.expect, Expect::NothingLeft);
        for state in KUBERNETES_STATE {
            assert!(lines(&steps)[2].contains(state), "{state} is not removed");
            assert!(verify.line.contains(state), "{state} is not verified");
        }
        let last = lines(&steps)[5];
        assert!(last.contains("rm -rf") && last.contains(STATE_DIR), "{last}");
    }

    /// What the delivery recorded of kubelet's and containerd's units, the reset puts back, once
    /// the state is verified gone: run by a real shell on a scratch root, with a stand-in
    /// `systemctl` that answers `is-enabled` as the node image would and logs the rest.
    #[test]
    fn the_reset_enables_again_what_was_enabled_before_the_delivery() {
        let root = std::env::temp_dir().join(format!("siteboot-units-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (bin, log) = (root.join("bin"), root.join("systemctl.log"));
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(root.join(&STATE_DIR[1..])).unwrap();
        let systemctl = format!(
            "#!/bin/sh\ncase \"$1 $2\" in\n\
             'is-enabled containerd.service') echo enabled ;;\n\
             'is-enabled kubelet.service') echo disabled ;;\n\
             *) echo \"$*\" >> {} ;;\nesac\n",
            log.display()
        );
        std::fs::write(bin.join("systemctl"), systemctl).unwrap();
        std::fs::set_permissions(
            bin.join("systemctl"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let run = |command: &Command| {
            let line = command.line.replace("/var/lib", &format!("{}/var/lib", root.display()));
            let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
            let status =
                std::process::Command::new("sh").args(["-c", &line]).env("PATH", path).status();
            assert!(status.unwrap().success(), "{line}");
        };
        let step = |steps: Vec<Step>, what: &str| {
            steps
                .into_iter()
                .find_map(|s| match s {
                    Step::Run(c) if c.what == what => Some(c),
                    _ => None,
                })
                .unwrap()
        };
        let delivery = deliver(&delivery(DataFormat::CloudConfig, meta("h")));
        run(&step(delivery, "recording kubelet's and containerd's units"));
        let recorded = root.join(&STATE_DIR[1..]).join(UNITS_BEFORE);
        assert_eq!(
            std::fs::read_to_string(&recorded).unwrap(),
            "kubelet disabled\ncontainerd enabled\n"
        );

        let restore = step(reset(), "enabling kubelet and containerd again as they were before");
        run(&restore);
        let logged = std::fs::read_to_string(&log).unwrap();
        assert_eq!(logged, "enable --quiet containerd.service\nstart containerd.service\n");
        // A host adopted before anything was recorded: nothing is enabled.
        std::fs::remove_file(&recorded).unwrap();
        std::fs::remove_file(&log).unwrap();
        run(&restore);
        assert!(!log.exists());
        let steps = reset();
        let position = |what: &str| {
            steps.iter().position(|s| matches!(s, Step::Run(c) if c.what == what)).unwrap()
        };
        assert!(position("verifying the reset") < position(restore.what));
        assert!(position(restore.what) < position("removing the delivery marker"));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
