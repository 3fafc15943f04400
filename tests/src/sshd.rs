//! A real OpenSSH server for the SSH tests: Debian's sshd on a namespace's loopback, with keys
//! the test makes with ssh-keygen, logging at DEBUG3 so its log shows everything it received.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::netns::{self, Netns};
use crate::process::Supervised;

/// Where sshd listens, on the namespace's loopback.
pub const PORT: u16 = 2222;

/// Keys ssh-keygen made, in a folder of their own: `<name>` and `<name>.pub`.
pub struct Keys {
    dir: tempfile::TempDir,
}

impl Keys {
    /// Makes `keys` (name, key type), without a passphrase.
    pub fn make(keys: &[(&str, &str)]) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("siteboot-keys-").tempdir()?;
        for (name, kind) in keys {
            netns::run(
                Command::new("ssh-keygen")
                    .args(["-q", "-t", kind, "-N", "", "-C", &format!("{name}@test"), "-f"])
                    .arg(dir.path().join(name)),
            )?;
        }
        Ok(Self { dir })
    }

    /// A file of the folder (`client`, `host_ed25519.pub`, ...).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn read(&self, name: &str) -> Result<String> {
        std::fs::read_to_string(self.path(name)).with_context(|| format!("reading {name}"))
    }

    /// `ssh-keygen -lf`'s fingerprint (`SHA256:...`) of key `name`.
    pub fn fingerprint(&self, name: &str) -> Result<String> {
        fingerprint(&self.path(&format!("{name}.pub")))
    }
}

/// sshd and its folder of keys, config and log. Dropped in field order: sshd first (its log
/// printed if the test is failing), then its files.
pub struct Sshd {
    process: Supervised,
    keys: Keys,
}

impl Sshd {
    /// Starts sshd in `ns` at 127.0.0.1:[`PORT`] once ssh-keygen made `keys` (name, key type)
    /// in its folder: those named `host_*` are its host keys, in that order; `client` is the
    /// one authorized key (public-key logins only, root's too).
    pub fn start(ns: &Netns, keys: &[(&str, &str)]) -> Result<Self> {
        let made = Keys::make(keys)?;
        let dir = &made.dir;
        std::fs::copy(dir.path().join("client.pub"), dir.path().join("authorized_keys"))
            .context("no client key")?;
        let d = dir.path().display();
        let host_keys: String = keys
            .iter()
            .filter(|(name, _)| name.starts_with("host_"))
            .map(|(name, _)| format!("HostKey {d}/{name}\n"))
            .collect();
        let config = dir.path().join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "Port {PORT}\nListenAddress 127.0.0.1\n{host_keys}\
                 AuthorizedKeysFile {d}/authorized_keys\n\
                 PidFile none\nUsePAM no\nStrictModes no\n\
                 PermitRootLogin prohibit-password\nPubkeyAuthentication yes\n\
                 PasswordAuthentication no\nKbdInteractiveAuthentication no\n\
                 LogLevel DEBUG3\n"
            ),
        )?;
        // sshd's privilege separation directory, which the openssh-server service would make.
        std::fs::create_dir_all("/run/sshd")?;
        let mut sshd = ns.command("/usr/sbin/sshd");
        // -E, not -e: with -e, the debug lines of a session's child before it execs the
        // command land in the command's stderr. The file is the one Supervised prints.
        sshd.arg("-D").arg("-E").arg(dir.path().join("sshd.log")).arg("-f").arg(&config);
        let process = Supervised::spawn("sshd", &mut sshd, dir.path())?;
        let sshd = Self { process, keys: made };
        sshd.wait_log("sshd to listen", |log| {
            log.contains(&format!("Server listening on 127.0.0.1 port {PORT}"))
        })?;
        Ok(sshd)
    }

    /// A file of its folder (`client`, `host_ed25519.pub`, ...).
    pub fn path(&self, name: &str) -> PathBuf {
        self.keys.path(name)
    }

    pub fn read(&self, name: &str) -> Result<String> {
        self.keys.read(name)
    }

    /// `ssh-keygen -lf`'s fingerprint (`SHA256:...`) of key `name`.
    pub fn fingerprint(&self, name: &str) -> Result<String> {
        self.keys.fingerprint(name)
    }

    /// What sshd logs once a client goes past the key exchange: the service request (message 5)
    /// that starts authentication, `user`'s name, the client's key.
    pub fn login_needles(&self, user: &str) -> Result<Vec<String>> {
        Ok(vec![
            "receive packet: type 5 ".into(),
            format!("userauth-request for user {user}"),
            "publickey".into(),
            format!("Accepted publickey for {user}"),
            self.fingerprint("client")?,
            "Starting session".into(),
        ])
    }

    pub fn log(&self) -> String {
        self.process.log()
    }

    /// Waits (10 s at most) until its log satisfies `done`.
    pub fn wait_log(&self, what: &str, done: impl Fn(&str) -> bool) -> Result<()> {
        crate::wait::for_(what, Duration::from_secs(10), || done(&self.log()).then_some(()))
    }
}

/// `ssh-keygen -lf`'s fingerprint of a `.pub` file.
pub fn fingerprint(path: &Path) -> Result<String> {
    let out = netns::output(Command::new("ssh-keygen").arg("-lf").arg(path))?;
    out.split_whitespace().nth(1).map(str::to_owned).context("no fingerprint")
}
