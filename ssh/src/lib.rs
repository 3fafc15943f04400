//! SSH access to servers that already run an OS, for hosts siteboot cannot network-boot: run
//! commands and send files over a connection whose server is known.
//!
//! The server is known by its host key ([`HostKey`]), which a Host pins; trust on first use
//! happens only when an operator asks for it, and then the key the server presented comes back
//! to be recorded ([`HostKeyPolicy`]). A server with another key learns nothing from siteboot:
//! the check runs inside the handshake, before the user name, the client key or any command is
//! sent ([`client`]). What travels after is deliberately small, what adopting and releasing a
//! host needs: [`Session::run`] (a command, its input, its bounded output, a deadline) and
//! [`Session::upload`] (a file, whole or not at all, with no shell-quoting hazard: [`upload`]).
//!
//! The SSH access Secret is read here ([`access`]): the key, how the host key is trusted, and
//! the server it is for. Adopting a host and releasing it are plans of steps as data
//! ([`adopt`]), and so is booting it into the deploy ramdisk by kexec ([`reimage`], whose
//! token travels in a newc archive appended to the initrd: [`cpio`]). A running server is
//! inspected in one read-only command ([`inspect`]).
//!
//! It depends on no Kubernetes client, so standalone mode can use it; Kubernetes mode's side
//! (a Host's `spec.access.ssh`, reading its Secret) is the controller's. The SSH protocol is
//! russh's.

#![forbid(unsafe_code)]

pub mod access;
pub mod adopt;
pub mod client;
pub mod cpio;
mod host_key;
pub mod inspect;
mod output;
pub mod reimage;
pub mod upload;

use std::time::Duration;

pub use self::access::{
    AccessError, BindingError, BoundAccess, Endpoint, HostKeyTrust, SECRET_TYPE,
};
pub use self::client::{ClientKey, ExitStatus, Output, Session, Target};
pub use self::host_key::{HostKey, HostKeyError, HostKeyMismatch, HostKeyPolicy};
pub use self::output::{CAPTURE_LIMIT, Captured};
pub use self::upload::{FileMode, RemotePath, UploadError};

/// What went wrong reaching a server or using it.
#[derive(Debug, thiserror::Error)]
pub enum SshError {
    #[error("invalid SSH target: {0}")]
    InvalidTarget(String),
    #[error("the SSH private key is encrypted; siteboot needs it without a passphrase")]
    EncryptedKey,
    #[error("the SSH private key cannot be read: {0}")]
    InvalidClientKey(String),
    #[error("connecting to {address}: {source}")]
    Connect { address: String, source: std::io::Error },
    /// Nothing was sent: the handshake stopped at the host key.
    #[error("{address}: {mismatch}; nothing was sent to it")]
    HostKeyMismatch { address: String, mismatch: HostKeyMismatch },
    #[error("{address} presented a host key siteboot does not accept: {source}")]
    UnacceptableHostKey { address: String, source: HostKeyError },
    #[error("{address} presented a host certificate; siteboot pins host keys, not certificates")]
    HostCertificate { address: String },
    #[error("{address} refused the key for user {user:?}")]
    AuthenticationRejected { address: String, user: String },
    #[error("{what}: no answer within {after:?}")]
    Timeout { what: String, after: Duration },
    #[error("the server refused to run the command")]
    ExecRefused,
    #[error("the command ended without an exit status")]
    NoExitStatus,
    #[error("writing {path} failed ({status:?}): {stderr}")]
    UploadFailed { path: String, status: ExitStatus, stderr: String },
    #[error("SSH: {0}")]
    Protocol(#[from] russh::Error),
}
