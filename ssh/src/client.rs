//! The connection: TCP, the SSH handshake with the host key checked inside it, public-key
//! authentication, then commands on session channels.
//!
//! The host key is checked in russh's `check_server_key`, which runs when the key exchange has
//! proved the server holds the key and before anything else is sent: on a mismatch the
//! handshake ends there, so the server never learns the user name, the client's public key or
//! a command. When a key is pinned, only its algorithm is offered for the host key, so a server
//! with several host keys presents the pinned one (as OpenSSH's client does from known_hosts).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use russh::client::{self, AuthResult, Handle};
use russh::keys::{Algorithm, HashAlg, PrivateKey, PrivateKeyWithHashAlg, PublicKeyOrCertificate};
use russh::{ChannelMsg, Disconnect, Preferred, Sig};
use tokio::net::TcpStream;

use crate::output::{CAPTURE_LIMIT, Captured};
use crate::upload::{self, FileMode, RemotePath};
use crate::{HostKey, HostKeyPolicy, SshError};

/// Where to connect and as whom. The host is a name or an address; the user is what sshd will
/// look up, so it is one word of printable characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    host: String,
    port: u16,
    user: String,
}

impl Target {
    pub fn new(host: &str, port: u16, user: &str) -> Result<Self, SshError> {
        let word =
            |s: &str| !s.is_empty() && !s.chars().any(|c| c.is_whitespace() || c.is_control());
        if !word(host) {
            return Err(SshError::InvalidTarget(format!("host {host:?} is not a name or address")));
        }
        if !word(user) {
            return Err(SshError::InvalidTarget(format!("user {user:?} is not a user name")));
        }
        if port == 0 {
            return Err(SshError::InvalidTarget("port 0".into()));
        }
        Ok(Self { host: host.to_owned(), port, user: user.to_owned() })
    }

    /// `host:port`, with an IPv6 address in brackets: for messages.
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// The private key siteboot authenticates with: OpenSSH's format (`ssh-keygen`'s default) or
/// PEM, as a Secret holds it. Not encrypted: nobody would be there to type the passphrase.
#[derive(Clone)]
pub struct ClientKey(Arc<PrivateKey>);

impl ClientKey {
    pub fn from_text(text: &str) -> Result<Self, SshError> {
        if text.contains("-----BEGIN ENCRYPTED PRIVATE KEY-----")
            || text.contains("Proc-Type: 4,ENCRYPTED")
        {
            return Err(SshError::EncryptedKey);
        }
        match russh::keys::decode_secret_key(text, None) {
            Ok(key) => Ok(Self(Arc::new(key))),
            Err(russh::keys::Error::KeyIsEncrypted) => Err(SshError::EncryptedKey),
            // The error of a key parser may quote what it read: only its kind is kept.
            Err(err) => Err(SshError::InvalidClientKey(kind_of(&err))),
        }
    }

    /// The public half, as authorized_keys would hold it.
    pub fn public_key(&self) -> String {
        self.0.public_key().to_openssh().unwrap_or_default()
    }
}

fn kind_of(err: &russh::keys::Error) -> String {
    match err {
        russh::keys::Error::CouldNotReadKey => "no private key in it".into(),
        russh::keys::Error::UnsupportedKeyType { key_type_string, .. } => {
            format!("key type {key_type_string:?} is not supported")
        }
        _ => "not an OpenSSH or PEM private key".into(),
    }
}

impl std::fmt::Debug for ClientKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fingerprint = self.0.public_key().fingerprint(HashAlg::Sha256);
        write!(f, "ClientKey({} {fingerprint})", self.0.algorithm().as_str())
    }
}

/// How a command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitStatus {
    Code(u32),
    /// Killed by this signal (`TERM`, `KILL`, …).
    Signal(String),
}

/// What a command returned. Each stream keeps its first [`CAPTURE_LIMIT`] bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: Captured,
    pub stderr: Captured,
}

impl Output {
    pub fn success(&self) -> bool {
        self.status == ExitStatus::Code(0)
    }
}

/// An authenticated SSH connection to one server.
pub struct Session {
    handle: Handle<Verifier>,
    host_key: HostKey,
    address: String,
}

impl Session {
    /// Connects, checks the host key against `policy`, and authenticates as the target's user
    /// with `key`, all within `deadline`.
    pub async fn connect(
        target: &Target,
        key: &ClientKey,
        policy: &HostKeyPolicy,
        deadline: Duration,
    ) -> Result<Self, SshError> {
        let address = target.address();
        tokio::time::timeout(deadline, Self::connect_inner(target, key, policy)).await.map_err(
            |_| SshError::Timeout { what: format!("connecting to {address}"), after: deadline },
        )?
    }

    async fn connect_inner(
        target: &Target,
        key: &ClientKey,
        policy: &HostKeyPolicy,
    ) -> Result<Self, SshError> {
        let address = target.address();
        let stream = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .map_err(|source| SshError::Connect { address: address.clone(), source })?;
        stream
            .set_nodelay(true)
            .map_err(|source| SshError::Connect { address: address.clone(), source })?;

        let mut preferred = Preferred::default();
        if let HostKeyPolicy::Pinned(pinned) = policy {
            preferred.key = host_key_algorithms(pinned.key_algorithm()).into();
        }
        let config = Arc::new(client::Config { preferred, ..Default::default() });
        let presented = Arc::new(OnceLock::new());
        let verifier = Verifier {
            address: address.clone(),
            policy: policy.clone(),
            presented: presented.clone(),
        };
        let mut handle = client::connect_stream(config, stream, verifier).await?;
        // connect_stream returns once the key exchange is done, and that ran check_server_key.
        let host_key =
            presented.get().cloned().ok_or(SshError::Protocol(russh::Error::UnknownKey))?;

        let hash = match key.0.algorithm() {
            Algorithm::Rsa { .. } => handle.best_supported_rsa_hash().await?.flatten(),
            _ => None,
        };
        let auth = handle
            .authenticate_publickey(&target.user, PrivateKeyWithHashAlg::new(key.0.clone(), hash))
            .await?;
        match auth {
            AuthResult::Success => Ok(Self { handle, host_key, address }),
            AuthResult::Failure { .. } => {
                Err(SshError::AuthenticationRejected { address, user: target.user.clone() })
            }
        }
    }

    /// The key the server presented: the pinned one, or under trust on first use the one to
    /// record.
    pub fn host_key(&self) -> &HostKey {
        &self.host_key
    }

    /// Runs `command` (a shell command line, as `ssh host command` sends it) with `stdin` as its
    /// input (closed after it; empty for none), and returns how it ended and what it printed.
    /// Past `deadline` the command is sent SIGKILL, the channel closed, and [`SshError::Timeout`]
    /// returned. OpenSSH ignores the signal on a root login: a command that must not outlive
    /// its deadline there is wrapped in `timeout(1)` by the caller.
    pub async fn run(
        &self,
        command: &str,
        stdin: &[u8],
        deadline: Duration,
    ) -> Result<Output, SshError> {
        let channel = self.handle.channel_open_session().await?;
        let (mut read, write) = channel.split();
        let exchange = async {
            write.exec(true, command).await?;
            let send = async {
                write.data(stdin).await?;
                write.eof().await
            };
            let (sent, output) = tokio::join!(send, collect(&mut read));
            let output = output?;
            // A command may exit without reading its input; then the write fails, and that is fine.
            if let Err(err) = sent {
                tracing::debug!(%err, "the command's stdin was not all sent");
            }
            Ok(output)
        };
        match tokio::time::timeout(deadline, exchange).await {
            Ok(output) => output,
            Err(_) => {
                // Ask sshd to kill the command, then hang up. OpenSSH does it for other users
                // only: for a root login it logs "session signalling requires privilege
                // separation" and the command runs on.
                let _ = write.signal(Sig::KILL).await;
                let _ = write.close().await;
                Err(SshError::Timeout {
                    what: format!("{command:?} on {}", self.address),
                    after: deadline,
                })
            }
        }
    }

    /// Writes `bytes` to `path` with `mode`: whole or not at all (see [`crate::upload`]).
    pub async fn upload(
        &self,
        path: &RemotePath,
        mode: FileMode,
        bytes: &[u8],
        deadline: Duration,
    ) -> Result<(), SshError> {
        let output = self.run(&upload::command(path, mode), bytes, deadline).await?;
        if output.success() {
            Ok(())
        } else {
            Err(SshError::UploadFailed {
                path: path.to_string(),
                status: output.status,
                stderr: output.stderr.text(),
            })
        }
    }

    /// Says goodbye to the server, and waits up to `deadline` for the connection to end.
    pub async fn close(self, deadline: Duration) -> Result<(), SshError> {
        self.handle.disconnect(Disconnect::ByApplication, "", "en").await?;
        let ended =
            tokio::time::timeout(deadline, self.handle).await.map_err(|_| SshError::Timeout {
                what: format!("closing the connection to {}", self.address),
                after: deadline,
            })?;
        match ended {
            // The session ends on the disconnect it was asked to send.
            Ok(()) | Err(SshError::Protocol(russh::Error::Disconnect)) => Ok(()),
            Err(err) => Err(err),
        }
    }
}

/// The host-key algorithms to offer for a pinned key: its own. For RSA, the SHA-2 signatures
/// (OpenSSH refuses SHA-1 `ssh-rsa` signatures by default, and so does this).
fn host_key_algorithms(pinned: Algorithm) -> Vec<Algorithm> {
    match pinned {
        Algorithm::Rsa { .. } => vec![
            Algorithm::Rsa { hash: Some(HashAlg::Sha512) },
            Algorithm::Rsa { hash: Some(HashAlg::Sha256) },
        ],
        other => vec![other],
    }
}

/// Reads a channel until the server closes it: both streams (capped) and the exit status.
async fn collect(read: &mut russh::ChannelReadHalf) -> Result<Output, SshError> {
    let mut stdout = Captured::new(CAPTURE_LIMIT);
    let mut stderr = Captured::new(CAPTURE_LIMIT);
    let mut status = None;
    while let Some(message) = read.wait().await {
        match message {
            ChannelMsg::Data { data } => stdout.push(&data),
            // Extended data type 1 is stderr (RFC 4254 5.2); there is no other.
            ChannelMsg::ExtendedData { data, ext: 1 } => stderr.push(&data),
            ChannelMsg::ExitStatus { exit_status } => status = Some(ExitStatus::Code(exit_status)),
            ChannelMsg::ExitSignal { signal_name, .. } => {
                status = Some(ExitStatus::Signal(format!("{signal_name:?}")))
            }
            ChannelMsg::Failure => return Err(SshError::ExecRefused),
            ChannelMsg::Close => break,
            _ => {}
        }
    }
    let status = status.ok_or(SshError::NoExitStatus)?;
    Ok(Output { status, stdout, stderr })
}

/// russh's side of the handshake: checks the host key, and keeps the one presented.
struct Verifier {
    address: String,
    policy: HostKeyPolicy,
    presented: Arc<OnceLock<HostKey>>,
}

impl client::Handler for Verifier {
    type Error = SshError;

    async fn check_server_key(&mut self, key: &PublicKeyOrCertificate) -> Result<bool, SshError> {
        let PublicKeyOrCertificate::PublicKey { key, .. } = key else {
            return Err(SshError::HostCertificate { address: self.address.clone() });
        };
        let presented = HostKey::presented(key).map_err(|source| {
            SshError::UnacceptableHostKey { address: self.address.clone(), source }
        })?;
        self.policy.check(&presented).map_err(|mismatch| SshError::HostKeyMismatch {
            address: self.address.clone(),
            mismatch,
        })?;
        let _ = self.presented.set(presented);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Throwaway keys made with `ssh-keygen -t ed25519` for this test; they open nothing.
    const KEY: &str = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\nQyNTUxOQAAACBHtIV64SKCJuQ9TdaCoIcgM01Lg0AuiNylCH8JtJ3F+AAAAJBx4HtwceB7\ncAAAAAtzc2gtZWQyNTUxOQAAACBHtIV64SKCJuQ9TdaCoIcgM01Lg0AuiNylCH8JtJ3F+A\nAAAEBAP0sERiFkFrIz0omAHUUluhVum32a57sKOPbsMZQ2sEe0hXrhIoIm5D1N1oKghyAz\nTUuDQC6I3KUIfwm0ncX4AAAADHJvb3RAZml4dHVyZQE=\n-----END OPENSSH PRIVATE KEY-----\n";
    const KEY_PUBLIC: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEe0hXrhIoIm5D1N1oKghyAzTUuDQC6I3KUIfwm0ncX4 root@fixture";
    /// The same kind of key, with the passphrase `secret`.
    const ENCRYPTED: &str = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAACmFlczI1Ni1jdHIAAAAGYmNyeXB0AAAAGAAAABAwrb62oh\nGeuNCY93ErIbX8AAAAEAAAAAEAAAAzAAAAC3NzaC1lZDI1NTE5AAAAIA9IjL3v+T4wGZl7\npvvK3dAtZF0VaMdfG4LhT96lCyDYAAAAkPE4JcFMxqFoMTUK2yK2TUbFdEKxYgOaipNsWg\n/ypI2U9hBsccFZNPzhJGGwT8qRawyf80IukXCngvwUs7xvjR79DI2qCHWsoTM1ErbuOljX\nuCtM3SAxjZBvbceSN+Nl/9z9yCvgklIXeIimKIn1g45WYC783RPzH2lpaaxqelS0Dh7jN9\nQEsQchWFt2N7rY8Q==\n-----END OPENSSH PRIVATE KEY-----\n";

    #[test]
    fn a_private_key_is_read_from_a_secrets_text() {
        let key = ClientKey::from_text(KEY).unwrap();
        assert_eq!(key.public_key(), KEY_PUBLIC);
        assert_eq!(
            format!("{key:?}"),
            "ClientKey(ssh-ed25519 SHA256:t6d8j15eRbRn9Rf4ubBEjXKgM19vUQJ2ncv6llQPJdg)"
        );
    }

    #[test]
    fn encrypted_or_garbled_keys_are_refused_without_repeating_them() {
        assert!(matches!(ClientKey::from_text(ENCRYPTED), Err(SshError::EncryptedKey)));
        let pkcs8 =
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIC\n-----END ENCRYPTED PRIVATE KEY-----\n";
        assert!(matches!(ClientKey::from_text(pkcs8), Err(SshError::EncryptedKey)));
        let cut = &KEY[..KEY.len() / 2];
        for garbage in ["", "hello", KEY_PUBLIC, cut] {
            let err = ClientKey::from_text(garbage).unwrap_err();
            assert!(matches!(err, SshError::InvalidClientKey(_)), "{garbage:?}: {err}");
            assert!(!err.to_string().contains("b3BlbnNzaC"), "{err}");
        }
    }

    #[test]
    fn targets_are_one_word_each() {
        let target = Target::new("10.0.0.5", 2222, "root").unwrap();
        assert_eq!(target.address(), "10.0.0.5:2222");
        assert_eq!(Target::new("fd00::5", 22, "root").unwrap().address(), "[fd00::5]:22");
        for (host, port, user) in [
            ("", 22, "root"),
            ("a b", 22, "root"),
            ("h", 22, ""),
            ("h", 22, "ro ot"),
            ("h", 0, "u"),
        ] {
            assert!(Target::new(host, port, user).is_err(), "{host:?} {port} {user:?}");
        }
    }

    #[test]
    fn a_pinned_rsa_key_is_offered_with_sha2_signatures_only() {
        assert_eq!(host_key_algorithms(Algorithm::Ed25519), [Algorithm::Ed25519]);
        assert_eq!(
            host_key_algorithms(Algorithm::Rsa { hash: None }),
            [
                Algorithm::Rsa { hash: Some(HashAlg::Sha512) },
                Algorithm::Rsa { hash: Some(HashAlg::Sha256) }
            ]
        );
    }
}
