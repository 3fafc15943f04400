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

use std::time::Duration;

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
    /// Not for this operation: [`kexec`]'s steps, from the first.
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
pub fn kexec(kexec: &Kexec) -> Vec<Step> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let steps = kexec(&plan());
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
        for line in lines(&kexec(&plan())) {
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
        let steps = kexec(&plan());
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
        let steps = kexec(&plan());
        let Step::Run(start) = &steps[5] else { panic!() };
        for part in ["systemd-run", "--no-block", "--on-active=5", "systemctl kexec"] {
            assert!(start.line.contains(part), "{part}: {}", start.line);
        }
        assert!(!start.line.contains("kexec -e"));
        let Step::Run(load) = &steps[4] else { panic!() };
        assert!(load.line.contains("rm -f"), "the uploaded files stay: {}", load.line);
    }
}
