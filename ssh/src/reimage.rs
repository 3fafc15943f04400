//! Booting a running server into the deploy ramdisk by kexec, as a plan in the style of
//! [`adopt`](crate::adopt): each step is data, the unit tests read every command, and
//! [`follow`](crate::adopt::follow) runs it deciding nothing, every command under `timeout(1)`.
//!
//! The operation's secret words (its token and id) never appear on a command line: a local
//! user of the old OS could read them in `/proc/*/cmdline` and race the ramdisk to the agent
//! API. They travel inside the initrd: an uncompressed newc archive appended to the ramdisk's
//! own (Linux unpacks concatenated archives in turn) holds one file,
//! [`INITRD_CMDLINE`](siteboot_agent_api::INITRD_CMDLINE), which the agent reads with
//! `/proc/cmdline`. The public words (the agent's URL, the certificate's fingerprint, the
//! console) go on kexec's `--command-line`. The files are uploaded whole into a root-only
//! directory, mode 0600, and removed once kexec has loaded them.
//!
//! The kexec is started as a transient systemd timer a few seconds later (`systemctl kexec`:
//! the old OS shuts down cleanly, then jumps to the loaded kernel), so the command returns
//! before the connection dies. Its start claims the host's kexec marker with an exclusive
//! create: a pass resumed after a crash [`probe`]s first, and a server whose marker names this
//! operation gets nothing more ([`progress`]).
//!
//! One pass, with no Kubernetes client (the Kubernetes mode's, and standalone mode's to come), is
//! [`kexec`]: the probe,
//! then (never started) the ramdisk's files read, the operation's token issued by the caller,
//! who stores its hash first, and the plan ([`steps`]) followed. [`KexecRamdisk`] is the
//! ramdisk it sends: a ramdisk profile's kernel and initrds, read as files under the
//! appliance's `http.root`. Where the operation and its token's hash are kept is the caller's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use siteboot_agent_server::token::operation_words;
use siteboot_boot::files::FileRoot;
use siteboot_boot::inventory::{LinuxBoot, Source};
use siteboot_ipxe::Word;

use crate::adopt::{self, Command, Expect, OperationId, Remote, SHORT, Step, StepFailed, path};
use crate::cpio::Newc;
use crate::upload::{FileMode, quote};

/// Where siteboot keeps the kernel, the initrd and the kexec marker on the host: root's only.
pub const STATE_DIR: &str = "/var/lib/siteboot/reimage";
const KERNEL: &str = "/var/lib/siteboot/reimage/vmlinuz";
const INITRD: &str = "/var/lib/siteboot/reimage/initrd";
/// Holds the id of the operation whose kexec was started.
const MARKER: &str = "/var/lib/siteboot/reimage/kexec";
/// The transient unit that runs `systemctl kexec`.
const KEXEC_UNIT: &str = "siteboot-kexec";
/// How long after the start command the old OS begins to shut down: time for the command to
/// return and siteboot to hang up.
const KEXEC_DELAY: Duration = Duration::from_secs(5);

/// The deploy ramdisk as a kexec boots it, for one operation.
#[derive(Clone, PartialEq, Eq)]
pub struct Kexec {
    pub id: OperationId,
    pub kernel: Vec<u8>,
    /// The ramdisk's initrds, concatenated.
    pub initrd: Vec<u8>,
    /// What kexec's `--command-line` carries: words anyone on the old OS may read.
    pub cmdline: Vec<String>,
    /// What the appended archive carries (the token, the operation's id): never on a command
    /// line.
    pub secret_cmdline: Vec<String>,
}

impl std::fmt::Debug for Kexec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kexec")
            .field("id", &self.id)
            .field("kernel", &self.kernel.len())
            .field("initrd", &self.initrd.len())
            .field("cmdline", &self.cmdline)
            .finish_non_exhaustive()
    }
}

/// `initrd` with an uncompressed newc archive appended that holds `secret_cmdline` as
/// [`INITRD_CMDLINE`](siteboot_agent_api::INITRD_CMDLINE), mode 0600. The kernel looks for the
/// next archive at a 4-byte boundary: zeros pad `initrd` to one.
pub fn with_secret_cmdline(initrd: &[u8], secret_cmdline: &[String]) -> Vec<u8> {
    let file = siteboot_agent_api::INITRD_CMDLINE.trim_start_matches('/');
    let mut cpio = Newc::default();
    if let Some((dir, _)) = file.rsplit_once('/') {
        cpio.entry(dir, 0o040700, b"");
    }
    cpio.entry(file, 0o100600, format!("{}\n", secret_cmdline.join(" ")).as_bytes());
    let mut bytes = initrd.to_vec();
    bytes.resize(initrd.len().next_multiple_of(4), 0);
    bytes.extend_from_slice(&cpio.finish());
    bytes
}

/// The command that says whether a kexec was started on the host, and for which operation.
pub fn probe() -> Command {
    let script = format!("cat {} 2>/dev/null; exit 0", quote(MARKER));
    Command::new("reading the kexec marker", &script, SHORT, Expect::Output)
}

/// Whether `id`'s kexec was started, from what [`probe`] printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KexecProgress {
    /// Not for this operation: the [`steps`], from the first.
    NotStarted,
    /// Started for this operation (a pass that died before its record): never again.
    Started,
}

/// Why what [`probe`] printed cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the host's kexec marker is unreadable: {0:?}")]
pub struct UnreadableMarker(String);

/// Where `id`'s kexec stands, from [`probe`]'s output. Another operation's marker is one whose
/// kexec did not take (the old OS runs again): its operation is over, and it is replaced.
pub fn progress(probed: &str, id: &OperationId) -> Result<KexecProgress, UnreadableMarker> {
    match probed.trim() {
        "" => Ok(KexecProgress::NotStarted),
        marker if marker.parse::<OperationId>().is_err() => {
            Err(UnreadableMarker(marker.chars().take(80).collect()))
        }
        marker if marker == id.as_str() => Ok(KexecProgress::Started),
        _ => Ok(KexecProgress::NotStarted),
    }
}

/// The host can kexec: root, systemd as PID 1 (the kexec is `systemctl kexec`), the tools, and
/// a kernel that allows loading another.
fn check() -> Command {
    let script = "fail() { echo \"$*\" >&2; exit 1; }; \
         [ \"$(id -u)\" = 0 ] || fail \"logged in as $(id -un), not root: kexec needs root\"; \
         [ \"$(cat /proc/1/comm)\" = systemd ] || fail \"PID 1 is $(cat /proc/1/comm), not systemd\"; \
         for t in kexec systemctl systemd-run; do command -v $t >/dev/null || fail \"$t is not installed\"; done; \
         [ -e /sys/kernel/kexec_loaded ] || fail 'the running kernel has no kexec support'; \
         [ \"$(cat /proc/sys/kernel/kexec_load_disabled 2>/dev/null)\" = 1 ] && fail 'kexec is disabled (sysctl kernel.kexec_load_disabled=1)'; \
         exit 0";
    Command::new("checking the host can kexec", script, SHORT, Expect::Success)
}

/// Uploads, loads and starts `kexec`'s ramdisk, for a host where [`progress`] said
/// [`KexecProgress::NotStarted`]. The last step claims the marker and starts the kexec in one
/// command: if the marker exists it fails, and nothing starts.
pub fn steps(kexec: &Kexec) -> Vec<Step> {
    let private = FileMode::new(0o600).expect("permission bits");
    let dir = quote(STATE_DIR);
    let (kernel, initrd, marker) = (quote(KERNEL), quote(INITRD), quote(MARKER));
    let run = |what, script: &str| Step::Run(Command::new(what, script, SHORT, Expect::Success));
    let cmdline = quote(&format!("--command-line={}", kexec.cmdline.join(" ")));
    // kexec_file_load first: under Secure Boot's lockdown only it may load a (signed) kernel.
    let load = format!(
        "kexec -s -l {kernel} --initrd={initrd} {cmdline} 2>/dev/null || \
         kexec -l {kernel} --initrd={initrd} {cmdline}; loaded=$?; \
         rm -f {kernel} {initrd}; exit $loaded"
    );
    let start = format!(
        "(set -C && printf '%s\\n' {id} > {marker}) && \
         systemd-run --unit={KEXEC_UNIT} --collect --quiet --no-block --on-active={delay} \
         systemctl kexec",
        id = quote(kexec.id.as_str()),
        delay = KEXEC_DELAY.as_secs(),
    );
    vec![
        Step::Run(check()),
        // A marker left here names another operation (the probe said so): its kexec never took.
        run(
            "preparing the ramdisk's directory",
            &format!("umask 077 && mkdir -p {dir} && chmod 0700 {dir} && rm -f {marker}"),
        ),
        Step::Upload {
            path: path(KERNEL),
            bytes: kexec.kernel.clone(),
            mode: private,
            what: "uploading the ramdisk's kernel",
        },
        Step::Upload {
            path: path(INITRD),
            bytes: with_secret_cmdline(&kexec.initrd, &kexec.secret_cmdline),
            mode: private,
            what: "uploading the ramdisk's initrd",
        },
        run("loading the ramdisk with kexec", &load),
        run("starting the kexec", &start),
    ]
}

/// Where `id`'s kexec stands on the host behind `remote` ([`probe`], [`progress`]).
pub async fn where_it_stands(
    remote: &impl Remote,
    id: &OperationId,
) -> Result<KexecProgress, StepFailed> {
    let probe = probe();
    let probed = adopt::run(remote, &probe).await?;
    progress(&probed, id).map_err(|source| StepFailed::Marker { what: probe.what, source })
}

/// The deploy ramdisk as a kexec over SSH sends it: its kernel and initrds, files under the
/// appliance's HTTP root (as `/files/` serves them), and the public words of its command line.
/// The files are read for each kexec, not kept: a kexec is rare, and they are some 15 MB.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KexecRamdisk {
    root: PathBuf,
    kernel: String,
    initrds: Vec<String>,
    /// The ramdisk's own words and the appliance's (`siteboot.url=`, `siteboot.agent=`,
    /// `siteboot.fingerprint=`): none secret.
    cmdline: Vec<String>,
}

/// Why the ramdisk's files cannot be sent by kexec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RamdiskFilesError {
    #[error(
        "this process has no deploy ramdisk to kexec: a controller reads it from the boot plane's http.root, and runs beside it (--role all)"
    )]
    NotConfigured,
    #[error("the ramdisk's files are read from http.root, and this appliance has none")]
    NoHttpRoot,
    #[error("the ramdisk's {what} is a URL ({url}); kexec over SSH sends files under http.root")]
    NotAFile { what: &'static str, url: String },
    #[error("the ramdisk's {what} {path} cannot be read: {why}")]
    Unreadable { what: &'static str, path: String, why: String },
}

impl KexecRamdisk {
    /// `ramdisk`'s files under `root` (`http.root`), to boot with `cmdline`.
    pub fn new(
        ramdisk: &LinuxBoot,
        root: Option<&Path>,
        cmdline: &[Word],
    ) -> Result<Self, RamdiskFilesError> {
        let root = root.ok_or(RamdiskFilesError::NoHttpRoot)?;
        let file = |what, source: &Source| match source {
            Source::File(path) => Ok(path.as_str().to_owned()),
            Source::Url(url) => Err(RamdiskFilesError::NotAFile { what, url: url.to_string() }),
        };
        Ok(Self {
            root: root.to_owned(),
            kernel: file("kernel", &ramdisk.kernel)?,
            initrds: ramdisk.initrds.iter().map(|i| file("initrd", i)).collect::<Result<_, _>>()?,
            cmdline: cmdline.iter().map(|w| w.as_str().to_owned()).collect(),
        })
    }

    /// The kernel and the initrds (concatenated, each from a 4-byte boundary as the kernel
    /// looks for the next archive), as served.
    fn read(&self) -> Result<(Vec<u8>, Vec<u8>), RamdiskFilesError> {
        let unreadable = |what, path: &str, why: &dyn std::fmt::Display| {
            let path = self.root.join(path.trim_start_matches('/')).display().to_string();
            RamdiskFilesError::Unreadable { what, path, why: why.to_string() }
        };
        let root = FileRoot::open(&self.root).map_err(|e| unreadable("directory", "", &e))?;
        let read = |what, path: &str| {
            let (mut file, len) = root.open_file(path).map_err(|e| unreadable(what, path, &e))?;
            let mut bytes = Vec::with_capacity(len as usize);
            std::io::Read::read_to_end(&mut file, &mut bytes)
                .map_err(|e| unreadable(what, path, &e))?;
            Ok(bytes)
        };
        let kernel = read("kernel", &self.kernel)?;
        let mut initrd = Vec::new();
        for path in &self.initrds {
            initrd.resize(initrd.len().next_multiple_of(4), 0);
            initrd.extend(read("initrd", path)?);
        }
        Ok((kernel, initrd))
    }
}

/// What a kexec pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kexecuted {
    /// Started the kexec into the operation's ramdisk.
    Started,
    /// Found it started by a pass that died before its record (the server's marker): nothing
    /// was sent.
    AlreadyStarted,
    /// The token's write did not land (the record changed since it was read): nothing was sent.
    NotIssued,
}

/// Why a kexec pass did not start the kexec.
#[derive(Debug, thiserror::Error)]
pub enum KexecFailed {
    /// A step failed on the server: the kexec was not started.
    #[error("kexec into the ramdisk: {0}")]
    Step(StepFailed),
    /// The ramdisk's files cannot be read here: nothing was sent but the probe.
    #[error("kexec into the ramdisk: {0}")]
    Files(RamdiskFilesError),
}

/// One kexec pass of operation `id` on the server behind `remote`: the marker probed first,
/// and, if `id`'s kexec was never started, `ramdisk`'s files read, the token issued, and the
/// [`steps`] followed with the token only inside the initrd. `issue` stores the token's hash
/// before the token leaves and gives it (`None`: its write did not land, and nothing is sent);
/// the outer error is `issue`'s.
pub async fn kexec<E>(
    remote: &impl Remote,
    id: &OperationId,
    ramdisk: &KexecRamdisk,
    issue: impl AsyncFnOnce() -> Result<Option<String>, E>,
) -> Result<Result<Kexecuted, KexecFailed>, E> {
    match where_it_stands(remote, id).await {
        Ok(KexecProgress::Started) => return Ok(Ok(Kexecuted::AlreadyStarted)),
        Ok(KexecProgress::NotStarted) => {}
        Err(e) => return Ok(Err(KexecFailed::Step(e))),
    }
    // Some 15 MB from disk: off the runtime's threads.
    let files = ramdisk.clone();
    let read = tokio::task::spawn_blocking(move || files.read()).await;
    let (kernel, initrd) = match read.expect("reading the ramdisk's files does not panic") {
        Ok(files) => files,
        Err(e) => return Ok(Err(KexecFailed::Files(e))),
    };
    // Issued last: no token is minted for a kexec that the marker or the files stop.
    let Some(token) = issue().await? else { return Ok(Ok(Kexecuted::NotIssued)) };
    let secret_cmdline =
        operation_words(&token, id.as_str()).map(|w| w.as_str().to_owned()).to_vec();
    let cmdline = ramdisk.cmdline.clone();
    let plan = Kexec { id: id.clone(), kernel, initrd, cmdline, secret_cmdline };
    let followed = adopt::follow(remote, &steps(&plan)).await;
    Ok(followed.map(|()| Kexecuted::Started).map_err(KexecFailed::Step))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adopt::fake::{Fake, block_on};

    const TOKEN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn plan() -> Kexec {
        Kexec {
            id: "op-1".parse().unwrap(),
            kernel: b"kernel".to_vec(),
            initrd: b"gzipped initrd".to_vec(),
            cmdline: vec!["console=ttyS0".into(), "siteboot.agent=https://10.0.0.1:8443".into()],
            secret_cmdline: vec![
                format!("siteboot.token={TOKEN}"),
                "siteboot.operation=op-1".into(),
            ],
        }
    }

    /// Every command line of the plan, as it is sent.
    fn lines(steps: &[Step]) -> Vec<String> {
        let mut lines = vec![probe().line];
        for step in steps {
            if let Step::Run(c) = step {
                lines.push(c.line.clone());
            }
        }
        lines
    }

    /// The token is only in the uploaded initrd, never on a command line; the public words are
    /// kexec's command line, one shell word.
    #[test]
    fn the_token_travels_in_the_initrd_and_never_on_a_command_line() {
        let steps = steps(&plan());
        for line in lines(&steps) {
            assert!(!line.contains(TOKEN), "the token on a command line: {line}");
            assert!(!line.contains("siteboot.operation"), "{line}");
        }
        let Step::Run(load) = &steps[4] else { panic!("{steps:?}") };
        assert!(
            load.line.contains("--command-line=console=ttyS0 siteboot.agent=https://10.0.0.1:8443"),
            "{}",
            load.line
        );
        let uploads: Vec<_> = steps
            .iter()
            .filter_map(|s| match s {
                Step::Upload { path, bytes, mode, .. } => {
                    Some((path.to_string(), bytes, mode.bits()))
                }
                Step::Run(_) => None,
            })
            .collect();
        assert_eq!(uploads.len(), 2);
        assert_eq!((uploads[0].0.as_str(), uploads[0].1.as_slice()), (KERNEL, &b"kernel"[..]));
        let (initrd_path, initrd, mode) = &uploads[1];
        assert_eq!((initrd_path.as_str(), *mode), (INITRD, 0o600));
        assert!(initrd.starts_with(b"gzipped initrd\0\0"), "padded to 4 bytes");
        assert_eq!(&initrd[16..22], b"070701", "the appended archive starts at a 4-byte boundary");
    }

    /// `cpio` reads the appended archive back: the directory, then the file with the secret
    /// words, mode 0600, owner root.
    #[test]
    fn the_appended_archive_holds_the_secret_words_for_root_only() {
        let appended = with_secret_cmdline(b"", &plan().secret_cmdline);
        let dir = std::env::temp_dir().join(format!("siteboot-reimage-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("archive"), &appended).unwrap();
        let listed = std::process::Command::new("sh")
            .current_dir(&dir)
            .args(["-c", "cpio -itv < archive 2>/dev/null && cpio -id --quiet < archive"])
            .output()
            .unwrap();
        let listed = String::from_utf8(listed.stdout).unwrap();
        let modes: Vec<&str> = listed.lines().filter_map(|l| l.split_whitespace().next()).collect();
        assert_eq!(modes, ["drwx------", "-rw-------"], "{listed}");
        assert!(listed.contains(" root ") || listed.contains(" 0 "), "{listed}");
        let read = std::fs::read_to_string(dir.join("siteboot/cmdline")).unwrap();
        assert_eq!(read, format!("siteboot.token={TOKEN} siteboot.operation=op-1\n"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every command line is `timeout N sh -c '<script>'` and a real shell parses it (dry).
    #[test]
    fn every_command_is_bounded_and_parses() {
        for line in lines(&steps(&plan())) {
            let rest = line.strip_prefix("timeout ").expect(&line);
            let (_, script) = rest.split_once(" sh -c ").expect(&line);
            let out = std::process::Command::new("sh")
                .args(["-c", &format!("printf %s {script}")])
                .output()
                .unwrap();
            let inner = String::from_utf8(out.stdout).unwrap();
            let parsed = std::process::Command::new("sh").args(["-n", "-c", &inner]).output();
            assert!(parsed.unwrap().status.success(), "{inner}");
        }
    }

    /// The probe and the claim, run by a real shell on a scratch directory standing in for the
    /// host's: the marker is claimed once, and read back as this operation's kexec started.
    #[test]
    fn a_resumed_kexec_learns_it_started_and_never_starts_twice() {
        let id: OperationId = "op-1".parse().unwrap();
        let dir = std::env::temp_dir().join(format!("siteboot-kexec-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let on_host = |line: &str| {
            let line = line.replace(STATE_DIR, dir.to_str().unwrap());
            std::process::Command::new("sh").args(["-c", &line]).output().unwrap()
        };
        let probed = || String::from_utf8(on_host(&probe().line).stdout).unwrap();
        assert_eq!(progress(&probed(), &id), Ok(KexecProgress::NotStarted));
        let steps = steps(&plan());
        let Step::Run(prepare) = &steps[1] else { panic!() };
        assert!(on_host(&prepare.line).status.success());
        let Step::Run(start) = &steps[5] else { panic!() };
        // The claim of the start command, without systemd-run.
        let claim = start.line.split(" && systemd-run").next().unwrap().to_owned() + "'";
        assert!(on_host(&claim).status.success(), "{claim}");
        assert!(!on_host(&claim).status.success(), "the marker was claimed twice");
        assert_eq!(progress(&probed(), &id), Ok(KexecProgress::Started));
        let other: OperationId = "op-2".parse().unwrap();
        assert_eq!(progress(&probed(), &other), Ok(KexecProgress::NotStarted));
        // Another operation's kexec prepares over the stale marker.
        assert!(on_host(&prepare.line).status.success());
        assert_eq!(progress(&probed(), &id), Ok(KexecProgress::NotStarted));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(progress("a b\n", &id).is_err());
    }

    /// The start runs `systemctl kexec` a few seconds later, from a unit that outlives the
    /// connection, and returns at once.
    #[test]
    fn the_kexec_is_a_clean_shutdown_started_after_the_command_returns() {
        let steps = steps(&plan());
        let Step::Run(start) = &steps[5] else { panic!() };
        for part in ["systemd-run", "--no-block", "--on-active=5", "systemctl kexec"] {
            assert!(start.line.contains(part), "{part}: {}", start.line);
        }
        assert!(!start.line.contains("kexec -e"));
        let Step::Run(load) = &steps[4] else { panic!() };
        assert!(load.line.contains("rm -f"), "the uploaded files stay: {}", load.line);
    }

    /// A host whose kexec marker reads `probed`, and where every other command succeeds.
    fn host(probed: &'static str) -> Fake {
        Fake::new(move |line| (0, if line == probe().line { probed } else { "" }, String::new()))
    }

    /// A ramdisk profile's files under a scratch `http.root` named for `test`.
    fn ramdisk_files(test: &str) -> (PathBuf, KexecRamdisk) {
        let root = std::env::temp_dir().join(format!("siteboot-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("k")).unwrap();
        std::fs::write(root.join("k/vmlinuz"), b"the kernel").unwrap();
        std::fs::write(root.join("k/initrd.img"), b"gzip").unwrap();
        std::fs::write(root.join("k/modules.img"), b"zstd!").unwrap();
        let word = |w: &str| Word::new(w).unwrap();
        let file = |w: &str| Source::File(word(w));
        let profile = LinuxBoot {
            kernel: file("k/vmlinuz"),
            initrds: vec![file("k/initrd.img"), file("k/modules.img")],
            cmdline: vec![word("console=ttyS0")],
        };
        let cmdline = [word("console=ttyS0"), word("siteboot.agent=https://10.0.0.1:8443")];
        let ramdisk = KexecRamdisk::new(&profile, Some(&root), &cmdline).unwrap();
        (root, ramdisk)
    }

    /// The kexec of op-1 on `host`, its token `issued`: what it did, and whether the token was
    /// asked for.
    fn kexec_with(
        host: &Fake,
        ramdisk: &KexecRamdisk,
        issued: Option<&str>,
    ) -> (Result<Kexecuted, KexecFailed>, bool) {
        let asked = std::cell::Cell::new(false);
        let issue = async || {
            asked.set(true);
            Ok::<_, std::convert::Infallible>(issued.map(str::to_owned))
        };
        let id: OperationId = "op-1".parse().unwrap();
        let Ok(kexecuted) = block_on(kexec(host, &id, ramdisk, issue));
        (kexecuted, asked.get())
    }

    /// The kexec probes first, then sends the plan: the public words on kexec's command line,
    /// the token only inside the initrd (its own files, then an archive holding the token), on
    /// no command line.
    #[test]
    fn a_kexec_sends_the_token_only_inside_the_initrd() {
        let (root, ramdisk) = ramdisk_files("kexec-sends");
        let server = host("");
        let (kexecuted, asked) = kexec_with(&server, &ramdisk, Some(TOKEN));
        assert!(matches!(kexecuted, Ok(Kexecuted::Started)), "{kexecuted:?}");
        assert!(asked);
        let sent = server.sent.into_inner().unwrap();
        let plan = Kexec {
            id: "op-1".parse().unwrap(),
            kernel: Vec::new(),
            initrd: Vec::new(),
            cmdline: vec!["console=ttyS0".into(), "siteboot.agent=https://10.0.0.1:8443".into()],
            secret_cmdline: Vec::new(),
        };
        let mut expected = vec![probe().line];
        for step in steps(&plan) {
            expected.push(match step {
                Step::Run(command) => command.line,
                Step::Upload { path, .. } => format!("upload {path}"),
            });
        }
        assert_eq!(sent, expected);
        assert!(sent.iter().all(|line| !line.contains(TOKEN)), "the token on a command line");
        assert!(sent.iter().any(|l| l.contains("--command-line=console=ttyS0 siteboot.agent=")));
        let uploaded = server.uploaded.into_inner().unwrap();
        assert_eq!(
            uploaded[0],
            ("/var/lib/siteboot/reimage/vmlinuz".into(), b"the kernel".to_vec())
        );
        let (path, initrd) = &uploaded[1];
        assert_eq!(path, "/var/lib/siteboot/reimage/initrd");
        // Each initrd from a 4-byte boundary, the archive too.
        assert!(
            initrd.starts_with(&[&b"gzipzstd!"[..], &[0; 3], b"070701"].concat()),
            "{initrd:?}"
        );
        let archive = String::from_utf8_lossy(&initrd[12..]);
        let secret =
            format!("siteboot/cmdline\0\0siteboot.token={TOKEN} siteboot.operation=op-1\n");
        assert!(archive.contains(&secret), "{archive}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A server whose marker says this operation's kexec started (a pass died before its
    /// record) gets nothing but the probe, and no token is minted; nor does one whose token
    /// write did not land, or whose files cannot be read here (said).
    #[test]
    fn a_kexec_never_starts_twice_and_sends_nothing_without_its_token_or_files() {
        let (root, ramdisk) = ramdisk_files("kexec-once");
        let probe_only = |server: Fake| server.sent.into_inner().unwrap() == [probe().line];
        let started = host("op-1\n");
        let (kexecuted, asked) = kexec_with(&started, &ramdisk, Some(TOKEN));
        assert!(matches!(kexecuted, Ok(Kexecuted::AlreadyStarted)), "{kexecuted:?}");
        assert!(!asked && probe_only(started));
        // Another operation's marker: its kexec never took; this one's goes on.
        let stale = host("op-0\n");
        let (kexecuted, _) = kexec_with(&stale, &ramdisk, Some(TOKEN));
        assert!(matches!(kexecuted, Ok(Kexecuted::Started)), "{kexecuted:?}");
        let lost = host("");
        let (kexecuted, asked) = kexec_with(&lost, &ramdisk, None);
        assert!(matches!(kexecuted, Ok(Kexecuted::NotIssued)), "{kexecuted:?}");
        assert!(asked && probe_only(lost));
        std::fs::remove_file(root.join("k/modules.img")).unwrap();
        let missing = host("");
        let (kexecuted, asked) = kexec_with(&missing, &ramdisk, Some(TOKEN));
        let e = kexecuted.unwrap_err();
        assert!(matches!(e, KexecFailed::Files(_)), "{e:?}");
        assert!(e.to_string().contains("k/modules.img"), "{e}");
        assert!(!asked && probe_only(missing));
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A ramdisk profile that cannot be kexec'ed is said once, plainly.
    #[test]
    fn a_ramdisk_without_files_under_http_root_cannot_be_kexeced() {
        let word = |w: &str| Word::new(w).unwrap();
        let mut profile = LinuxBoot {
            kernel: Source::File(word("k/vmlinuz")),
            initrds: vec![Source::Url(word("http://elsewhere/initrd.img"))],
            cmdline: Vec::new(),
        };
        let e = KexecRamdisk::new(&profile, Some(Path::new("/srv")), &[]).unwrap_err();
        assert!(e.to_string().contains("initrd is a URL (http://elsewhere/initrd.img)"), "{e}");
        profile.initrds.clear();
        assert_eq!(KexecRamdisk::new(&profile, None, &[]), Err(RamdiskFilesError::NoHttpRoot));
    }
}
