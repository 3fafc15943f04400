//! siteboot's SSH client (`siteboot-ssh`) against a real OpenSSH server: Debian's sshd, in a
//! network namespace of the test's own, with host keys and an authorized key the test made with
//! ssh-keygen, logging at DEBUG3 so its log shows everything it received.
//!
//! - pinned to the server's key: commands run (exit status, stdout, stderr, stdin, capped
//!   output), a file arrives with its mode and exact bytes at a path made to be shell syntax;
//! - pinned to the server's second key (not its preferred one): the pinned key is what is used;
//! - pinned to another key: refused, naming both fingerprints, and sshd's log has no
//!   authentication request at all (it never learnt the user or the client's key);
//! - trust on first use: the key returned is exactly the server's `.pub`, and pinning it works;
//! - a key the server does not authorize: an authentication error;
//! - a command outliving its deadline: cut off with a timeout error.
//!
//! Failures panic while sshd is alive, so its log gets printed.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use siteboot_ssh::{
    CAPTURE_LIMIT, ClientKey, ExitStatus, FileMode, HostKey, HostKeyPolicy, Session, SshError,
    Target,
};
use siteboot_tests::netns::{self, Netns};
use siteboot_tests::sshd::{self, PORT};

const CONNECT: Duration = Duration::from_secs(20);
const COMMAND: Duration = Duration::from_secs(20);

/// sshd in a namespace of its own, listening on the namespace's loopback. Dropped in field
/// order: sshd first (its log printed if the test is failing), then its files, then the
/// namespace.
struct Sshd {
    server: sshd::Sshd,
    ns: Netns,
    user: String,
}

impl Sshd {
    fn start(tag: &str) -> Self {
        let ns = Netns::new(tag).unwrap();
        let keys = [
            ("host_ed25519", "ed25519"),
            ("host_ecdsa", "ecdsa"),
            ("client", "ed25519"),
            ("other_client", "ed25519"),
            ("not_the_host", "ed25519"),
        ];
        let server = sshd::Sshd::start(&ns, &keys).unwrap();
        let user = netns::output(Command::new("id").arg("-un")).unwrap().trim().to_owned();
        Self { server, ns, user }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.server.path(name)
    }

    fn key(&self, name: &str) -> ClientKey {
        ClientKey::from_text(&std::fs::read_to_string(self.path(name)).unwrap()).unwrap()
    }

    fn host_key(&self, name: &str) -> HostKey {
        std::fs::read_to_string(self.path(&format!("{name}.pub"))).unwrap().parse().unwrap()
    }

    fn target(&self) -> Target {
        Target::new("127.0.0.1", PORT, &self.user).unwrap()
    }

    /// Connects from inside the namespace with `key` under `policy`.
    fn connect(&self, key: &str, policy: HostKeyPolicy) -> Result<Connected, SshError> {
        let (target, key) = (self.target(), self.key(key));
        let runtime = runtime();
        self.ns
            .enter(move || {
                // The socket is made in this thread, so in the namespace; the runtime goes along.
                let session = runtime.block_on(Session::connect(&target, &key, &policy, CONNECT));
                Ok(session.map(|session| Connected { session, runtime }))
            })
            .unwrap()
    }

    fn login_needles(&self) -> Vec<String> {
        self.server.login_needles(&self.user).unwrap()
    }

    fn log(&self) -> String {
        self.server.log()
    }

    fn wait_log(&self, what: &str, done: impl Fn(&str) -> bool) {
        self.server.wait_log(what, done).unwrap()
    }
}

/// A session and the runtime it lives on.
struct Connected {
    session: Session,
    runtime: tokio::runtime::Runtime,
}

impl Connected {
    fn run(&self, command: &str, stdin: &[u8]) -> Result<siteboot_ssh::Output, SshError> {
        self.runtime.block_on(self.session.run(command, stdin, COMMAND))
    }

    fn close(self) {
        self.runtime.block_on(self.session.close(COMMAND)).unwrap();
    }
}

fn runtime() -> tokio::runtime::Runtime {
    // Not current-thread: russh's session task runs between calls, as it does in siteboot.
    tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
}

#[test]
fn commands_run_and_files_arrive_on_the_pinned_server() {
    let sshd = Sshd::start("ssh-ok");
    let connected =
        sshd.connect("client", HostKeyPolicy::Pinned(sshd.host_key("host_ed25519"))).unwrap();
    assert_eq!(connected.session.host_key(), &sshd.host_key("host_ed25519"));

    let output = connected.run("echo hello; echo oops >&2; exit 3", b"").unwrap();
    assert_eq!(output.status, ExitStatus::Code(3));
    assert_eq!((output.stdout.text(), output.stderr.text()), ("hello\n".into(), "oops\n".into()));
    assert!(!output.success());

    let input: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let output = connected.run("sha256sum; printf done", &input).unwrap();
    assert!(output.success(), "{output:?}");
    assert_eq!(output.stdout.text(), format!("{}  -\ndone", sha256_hex(&input)));

    // More than the cap: the first CAPTURE_LIMIT bytes, and the count of all.
    let output = connected.run("head -c 3000000 /dev/zero", b"").unwrap();
    assert!(output.success());
    assert_eq!(output.stdout.bytes().len(), CAPTURE_LIMIT);
    assert!(output.stdout.truncated());
    assert_eq!(output.stdout.total(), 3_000_000);

    // A file at a path that is shell syntax if unquoted, with every byte value in it.
    let name = "it's $(touch pwned) `touch pwned`; touch pwned";
    let path = sshd.path(name);
    let remote = path.to_str().unwrap().parse().unwrap();
    let bytes: Vec<u8> = (0..=255u8).rev().cycle().take(70_000).collect();
    connected
        .runtime
        .block_on(connected.session.upload(&remote, FileMode::new(0o640).unwrap(), &bytes, COMMAND))
        .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777, 0o640);
    // Again over it, smaller, another mode: replaced whole, and nothing else made.
    connected
        .runtime
        .block_on(connected.session.upload(
            &remote,
            FileMode::new(0o600).unwrap(),
            b"second",
            COMMAND,
        ))
        .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"second");
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777, 0o600);
    let home = netns::output(Command::new("sh").args(["-c", "echo ~"])).unwrap();
    for pwned in [sshd.path("pwned"), Path::new(home.trim()).join("pwned")] {
        assert!(!pwned.exists(), "a path ran a command: {} exists", pwned.display());
    }
    assert!(!sshd.path(&format!("{name}.siteboot-partial")).exists());

    // A directory that is not there: the error says which path, and what the server said.
    let missing = sshd.path("no/such/dir/file");
    let err = connected
        .runtime
        .block_on(connected.session.upload(
            &missing.to_str().unwrap().parse().unwrap(),
            FileMode::new(0o644).unwrap(),
            b"x",
            COMMAND,
        ))
        .unwrap_err();
    assert!(
        matches!(&err, SshError::UploadFailed { stderr, .. } if stderr.contains("No such file")),
        "{err}"
    );
    connected.close();

    // What the other test says sshd never logs is in the log of a real login.
    let log = sshd.log();
    assert!(
        log.contains(&format!("userauth-request for user {}", sshd.user)),
        "the needle is wrong"
    );
    assert!(log.contains(&format!("Accepted publickey for {}", sshd.user)));
}

#[test]
fn a_wrong_host_key_is_refused_before_anything_is_sent() {
    let sshd = Sshd::start("ssh-wrong");
    let pinned = sshd.host_key("not_the_host");
    let result = sshd.connect("client", HostKeyPolicy::Pinned(pinned.clone())).map(|connected| {
        // A client that let the server through: end the login so its log is complete.
        connected.close();
    });
    // Until the connection's end is logged, or a login (whose end is logged otherwise).
    let needles = sshd.login_needles();
    sshd.wait_log("the connection to end in sshd's log", |log| {
        ["Connection closed by", "Connection reset by", "Disconnected from", "Received disconnect"]
            .iter()
            .any(|end| log.contains(end))
            || needles.iter().any(|needle| log.contains(needle))
    });

    // sshd never heard of the user, the client's key or a command.
    let log = sshd.log();
    for needle in needles {
        assert!(
            !log.contains(&needle),
            "sshd's log has {needle:?}: the client sent more than the key exchange"
        );
    }

    let presented = sshd.host_key("host_ed25519");
    match result {
        Err(SshError::HostKeyMismatch { mismatch, .. }) => {
            assert_eq!(mismatch.pinned, pinned.fingerprint());
            assert_eq!(mismatch.presented, presented.fingerprint());
            assert_eq!(
                mismatch.presented,
                sshd::fingerprint(&sshd.path("host_ed25519.pub")).unwrap()
            );
        }
        Err(other) => panic!("refused, but not for the host key: {other}"),
        Ok(_) => panic!("connected to a server whose host key is not the pinned one"),
    }
    let err = sshd.connect("client", HostKeyPolicy::Pinned(pinned.clone())).err().unwrap();
    let message = err.to_string();
    assert!(
        message.contains(&pinned.fingerprint()) && message.contains(&presented.fingerprint()),
        "{message}"
    );
}

#[test]
fn the_pinned_key_is_used_when_the_server_prefers_another() {
    let sshd = Sshd::start("ssh-ecdsa");
    let ecdsa = sshd.host_key("host_ecdsa");
    let connected = sshd.connect("client", HostKeyPolicy::Pinned(ecdsa.clone())).unwrap();
    assert_eq!(connected.session.host_key(), &ecdsa);
    connected.close();
}

#[test]
fn trust_on_first_use_returns_the_server_s_key_to_pin() {
    let sshd = Sshd::start("ssh-tofu");
    let connected = sshd.connect("client", HostKeyPolicy::TrustOnFirstUse).unwrap();
    let recorded = connected.session.host_key().clone();
    connected.close();
    // ed25519 is the first a client offers, so the server's ed25519 key is the one presented.
    let file = std::fs::read_to_string(sshd.path("host_ed25519.pub")).unwrap();
    let mut words = file.split_whitespace();
    assert_eq!(
        recorded.to_string(),
        format!("{} {}", words.next().unwrap(), words.next().unwrap())
    );
    assert_eq!(recorded.fingerprint(), sshd::fingerprint(&sshd.path("host_ed25519.pub")).unwrap());

    // What was recorded, pinned from then on, lets the same server in.
    let pinned = recorded.to_string().parse().unwrap();
    sshd.connect("client", HostKeyPolicy::Pinned(pinned)).unwrap().close();
}

#[test]
fn a_key_the_server_does_not_authorize_is_refused() {
    let sshd = Sshd::start("ssh-auth");
    let pin = HostKeyPolicy::Pinned(sshd.host_key("host_ed25519"));
    match sshd.connect("other_client", pin) {
        Err(SshError::AuthenticationRejected { user, .. }) => assert_eq!(user, sshd.user),
        Err(other) => panic!("refused, but not as unauthorized: {other}"),
        Ok(_) => panic!("logged in with a key that is not in authorized_keys"),
    }
}

#[test]
fn a_command_past_its_deadline_is_cut_off() {
    let sshd = Sshd::start("ssh-slow");
    let connected =
        sshd.connect("client", HostKeyPolicy::Pinned(sshd.host_key("host_ed25519"))).unwrap();
    let deadline = Duration::from_secs(1);
    let started = Instant::now();
    let result = connected.runtime.block_on(connected.session.run("sleep 30", b"", deadline));
    let took = started.elapsed();
    match result {
        Err(SshError::Timeout { after, .. }) => assert_eq!(after, deadline),
        other => panic!("not a timeout: {other:?}"),
    }
    assert!(took < Duration::from_secs(5), "the deadline took {took:?}");
    // The server was asked to kill it. (It does not for a root login: "session signalling
    // requires privilege separation"; the client's deadline is what this proves.)
    sshd.wait_log("sshd to receive the signal request", |log| log.contains("req signal"));
    // The connection is still good for the next command.
    assert!(connected.run("true", b"").unwrap().success());
    connected.close();
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}
