//! A standalone host reached over SSH (`hosts[].ssh`): a server that already runs an OS, with no
//! network boot path. Its operations run over SSH instead of in the ramdisk, through the plans
//! Kubernetes mode follows (`siteboot_ssh`): `inspect` reads the server, `provision` adopts it
//! (the host's `user_data` delivered through its own cloud-init, or run as a script, once), and
//! `deprovision` resets it (its Kubernetes state removed and verified gone, its OS and data
//! kept). A host listed with an `image` is reimaged instead: `provision` and `deprovision`
//! kexec it into the deploy ramdisk over SSH ([`kexec_pass`]), with the operation's token in
//! its initrd, and the ramdisk runs them as on a host that booted it from the network.
//!
//! Each [`pass`] logs in with the host key pinned (a server that presents another gets nothing)
//! and moves the operation one step: what it found is a [`Pass`], which the inventory records.
//! A pass killed at any point is harmless: the next one probes the server's delivery marker
//! first, so the data never runs twice, and a reset runs again from the start.

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

use siteboot_agent_api::Hardware;
use siteboot_agent_server::OperationKind;
use siteboot_boot::MacAddr;
use siteboot_ssh::adopt::{self, DataFormat, Delivery, MetaData, Progress, Stalled, StepFailed};
use siteboot_ssh::inspect::{self, InspectFailed};
use siteboot_ssh::reimage::{self, KexecFailed, KexecRamdisk, Kexecuted};
use siteboot_ssh::{ClientKey, HostKey, HostKeyPolicy, Session, SshError, Target};

use crate::operations::Operation;

/// How long a connection (TCP, handshake, login) may take.
const CONNECT_DEADLINE: Duration = Duration::from_secs(20);

/// `hosts[].ssh`, checked.
#[derive(Debug, Clone)]
pub struct HostSsh {
    pub target: Target,
    /// Read at each use; only its owner may read it.
    pub private_key_file: PathBuf,
    /// The only key the server may present.
    pub host_key: HostKey,
    /// The host's `user_data`: cloud-init user-data, or a script (`#!` first) run as it is.
    /// Unset: empty user-data.
    pub user_data: Option<PathBuf>,
}

/// What a pass found, for the host's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pass {
    /// The operation goes on; `step` says where it is.
    Going { step: String, delivered: bool },
    /// The server kexec'ed into the ramdisk (or was found doing so): the operation is the
    /// ramdisk's now.
    Kexeced { step: String },
    /// The operation ended.
    Done {
        ok: bool,
        message: String,
        /// Boxed: a pass is mostly [`Pass::Going`].
        hardware: Option<Box<Hardware>>,
        /// What a successful adoption leaves installed: `(url, checksum)` for the record.
        installed: Option<(String, String)>,
        delivered: bool,
    },
}

impl Pass {
    fn going(step: impl Into<String>, delivered: bool) -> Self {
        Self::Going { step: step.into(), delivered }
    }

    fn failed(message: impl Into<String>, delivered: bool) -> Self {
        let message = message.into();
        Self::Done { ok: false, message, hardware: None, installed: None, delivered }
    }

    /// Whether the data's run was seen started: the record marks it delivered, so a failure
    /// after it leaves the host to be reset before another provisioning.
    pub fn delivered(&self) -> bool {
        match self {
            Self::Going { delivered, .. } | Self::Done { delivered, .. } => *delivered,
            Self::Kexeced { .. } => false,
        }
    }
}

/// One pass of `op` on host `name` (boot MAC `mac`), reached as `ssh` says.
pub async fn pass(ssh: &HostSsh, mac: MacAddr, name: &str, op: &Operation) -> Pass {
    let delivered = op.bootstrap_delivered;
    let session = match connect(ssh).await {
        Ok(session) => session,
        Err(e) => return unreachable(ssh, &e, delivered),
    };
    let pass = match op.kind {
        OperationKind::Inspect => inspected(mac, inspect::run(&session).await),
        OperationKind::Provision => adopt_pass(&session, ssh, name, op).await,
        OperationKind::Deprovision => reset(adopt::follow(&session, &adopt::reset()).await),
    };
    if let Err(e) = session.close(CONNECT_DEADLINE).await {
        tracing::debug!(host = %name, "closing the SSH connection: {e}");
    }
    pass
}

/// A pass of `op` on a host reached over SSH with an image: the server kexec'ed into the
/// deploy ramdisk ([`reimage::kexec`]) with a token `issue` records (bound to no address) and
/// returns, which the ramdisk then runs the operation with as on any host. A pass after a
/// crash finds the server's kexec marker and sends nothing more; one after a failed step
/// (the kexec not started) mints another token, and the first stops working.
pub async fn kexec_pass<E: std::fmt::Display>(
    ssh: &HostSsh,
    op: &Operation,
    ramdisk: &KexecRamdisk,
    issue: impl AsyncFnOnce() -> Result<Option<String>, E>,
) -> Pass {
    let id = match op.id.parse() {
        Ok(id) => id,
        Err(e) => return Pass::failed(format!("operation id {:?}: {e}", op.id), false),
    };
    let session = match connect(ssh).await {
        Ok(session) => session,
        Err(e) => return unreachable(ssh, &e, false),
    };
    let kexecuted = reimage::kexec(&session, &id, ramdisk, issue).await;
    if let Err(e) = session.close(CONNECT_DEADLINE).await {
        tracing::debug!(operation = %op.id, "closing the SSH connection: {e}");
    }
    match kexecuted {
        Ok(Ok(Kexecuted::Started)) => {
            Pass::Kexeced { step: "kexec over SSH into the ramdisk started".into() }
        }
        Ok(Ok(Kexecuted::AlreadyStarted)) => Pass::Kexeced {
            step: "kexec over SSH into the ramdisk found started (before a restart)".into(),
        },
        Ok(Ok(Kexecuted::NotIssued)) => Pass::going("the operation changed; nothing sent", false),
        Ok(Err(KexecFailed::Step(e))) => step_failed(&e, false),
        Ok(Err(e @ KexecFailed::Files(_))) => Pass::failed(e.to_string(), false),
        // The record could not be written: nothing was sent, the next pass tries again.
        Err(e) => {
            Pass::going(format!("cannot record the ramdisk's token ({e}); trying again"), false)
        }
    }
}

/// Logs in to the server with the key file's key, its host key pinned.
async fn connect(ssh: &HostSsh) -> Result<Session, ConnectError> {
    let mut text = String::new();
    crate::owner_only::open(&ssh.private_key_file)
        .and_then(|mut file| file.read_to_string(&mut text).map_err(|e| e.to_string()))
        .map_err(|why| ConnectError::KeyFile(ssh.private_key_file.clone(), why))?;
    let key = ClientKey::from_text(&text)?;
    let policy = HostKeyPolicy::Pinned(ssh.host_key.clone());
    Ok(Session::connect(&ssh.target, &key, &policy, CONNECT_DEADLINE).await?)
}

#[derive(Debug)]
enum ConnectError {
    KeyFile(PathBuf, String),
    Ssh(SshError),
}

impl From<SshError> for ConnectError {
    fn from(e: SshError) -> Self {
        Self::Ssh(e)
    }
}

/// Whether `e` may pass by itself (the network, the server's load): the operation waits and
/// tries again. The rest (the host key, the login, the key) needs the operator.
fn transient(e: &SshError) -> bool {
    matches!(
        e,
        SshError::Connect { .. }
            | SshError::Timeout { .. }
            | SshError::Protocol(_)
            | SshError::NoExitStatus
    )
}

/// The connection failed: the operation waits for a server that may come back, and ends on one
/// siteboot must not or cannot log in to.
fn unreachable(ssh: &HostSsh, e: &ConnectError, delivered: bool) -> Pass {
    match e {
        ConnectError::Ssh(e) if transient(e) => {
            Pass::going(format!("unreachable over SSH ({e}); trying again"), delivered)
        }
        ConnectError::Ssh(e) => Pass::failed(e.to_string(), delivered),
        ConnectError::KeyFile(path, why) => {
            let at = ssh.target.address();
            Pass::failed(format!("the SSH key file {} for {at} {why}", path.display()), delivered)
        }
    }
}

/// A step failed: on the connection, the next pass tries again (a delivery probes first);
/// a command that ran and failed ends the operation.
fn step_failed(e: &StepFailed, delivered: bool) -> Pass {
    match e {
        StepFailed::Ssh { source, .. } if transient(source) => {
            Pass::going(format!("{e}; trying again"), delivered)
        }
        _ => Pass::failed(e.to_string(), delivered),
    }
}

/// An inspection over SSH: the server must have the host's boot MAC, positive evidence that
/// the pinned key's server is the machine listed.
fn inspected(mac: MacAddr, report: Result<inspect::Report, InspectFailed>) -> Pass {
    match report {
        Ok(report) if report.has_mac(&mac.to_string()) => Pass::Done {
            ok: true,
            message: "inspected over SSH".into(),
            hardware: Some(Box::new(report.hardware())),
            installed: None,
            delivered: false,
        },
        Ok(report) => Pass::failed(
            format!(
                "the server has no interface with MAC {mac} (it has {}): not this host",
                report.macs().join(", ")
            ),
            false,
        ),
        Err(InspectFailed::Ssh(e)) if transient(&e) => {
            Pass::going(format!("inspecting over SSH: {e}; trying again"), false)
        }
        Err(e) => Pass::failed(e.to_string(), false),
    }
}

/// A provisioning's pass: the delivery moved on ([`adopt::advance`]); the data, read only
/// while its run is not seen started.
async fn adopt_pass(session: &Session, ssh: &HostSsh, name: &str, op: &Operation) -> Pass {
    let delivered = op.bootstrap_delivered;
    let id = match op.id.parse() {
        Ok(id) => id,
        Err(e) => return Pass::failed(format!("operation id {:?}: {e}", op.id), delivered),
    };
    let delivery = match delivered {
        true => None,
        false => match staged(ssh, name, &id) {
            Ok(delivery) => Some(delivery),
            Err(why) => return Pass::failed(why, delivered),
        },
    };
    let progress = adopt::advance(session, &id, delivered, delivery.as_ref()).await;
    adopted(ssh, progress, delivered)
}

/// The delivery of the host's `user_data` for operation `id`: a script if it starts with `#!`,
/// cloud-init user-data otherwise; the meta-data as a provisioning by the ramdisk has it.
fn staged(ssh: &HostSsh, name: &str, id: &adopt::OperationId) -> Result<Delivery, String> {
    let data = match &ssh.user_data {
        None => Vec::new(),
        Some(path) => std::fs::read(path)
            .map_err(|e| format!("user_data {} cannot be read: {e}", path.display()))?,
    };
    let format = if data.starts_with(b"#!") { DataFormat::Script } else { DataFormat::CloudConfig };
    let meta = MetaData {
        instance_id: id.to_string(),
        local_hostname: name.to_owned(),
        provider_id: crate::standalone::provider_id(name),
    };
    Ok(Delivery { id: id.clone(), meta, data, format })
}

/// What a delivery pass found.
fn adopted(ssh: &HostSsh, progress: Result<Progress, Stalled>, delivered: bool) -> Pass {
    match progress {
        Ok(Progress::NotStarted) => Pass::going("delivering the bootstrap data over SSH", false),
        Ok(Progress::Running) => Pass::going("the bootstrap data runs on the server", true),
        Ok(Progress::Finished(0)) => Pass::Done {
            ok: true,
            message: "the bootstrap data ran on the server (exit status 0)".into(),
            hardware: None,
            installed: Some((format!("ssh://{}", ssh.target.address()), String::new())),
            delivered: true,
        },
        Ok(Progress::Finished(code)) => {
            Pass::failed(format!("the bootstrap data exited with status {code}"), true)
        }
        // Not returned by `advance`, which says it as an error.
        Ok(Progress::OtherDelivery) => Pass::failed(Stalled::OtherDelivery.to_string(), delivered),
        Err(Stalled::Step(e)) => step_failed(&e, delivered),
        Err(e) => Pass::failed(e.to_string(), delivered),
    }
}

/// What a reset pass did.
fn reset(result: Result<(), StepFailed>) -> Pass {
    match result {
        Ok(()) => Pass::Done {
            ok: true,
            message: "reset over SSH: the node's Kubernetes state removed and verified gone".into(),
            hardware: None,
            installed: None,
            delivered: false,
        },
        Err(e) => step_failed(&e, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ssh() -> HostSsh {
        let key =
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl";
        HostSsh {
            target: Target::new("10.0.0.5", 22, "root").unwrap(),
            private_key_file: "/etc/siteboot/k".into(),
            host_key: key.parse().unwrap(),
            user_data: None,
        }
    }

    fn io_error() -> SshError {
        let source = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        SshError::Connect { address: "10.0.0.5:22".into(), source }
    }

    /// A server that cannot be reached is waited for; one with the wrong host key, or a login
    /// refused, ends the operation: nothing was sent, and only the operator can fix it.
    #[test]
    fn an_unreachable_server_is_waited_for_and_a_refused_one_ends_the_operation() {
        let waits = unreachable(&ssh(), &ConnectError::Ssh(io_error()), true);
        assert!(
            matches!(&waits, Pass::Going { step, delivered: true } if step.contains("trying again")),
            "{waits:?}"
        );
        let rejected =
            SshError::AuthenticationRejected { address: "a".into(), user: "root".into() };
        let ends = unreachable(&ssh(), &ConnectError::Ssh(rejected), false);
        assert!(matches!(&ends, Pass::Done { ok: false, .. }), "{ends:?}");
        let file = ConnectError::KeyFile("/etc/siteboot/k".into(), "is readable".into());
        let Pass::Done { ok: false, message, .. } = unreachable(&ssh(), &file, false) else {
            panic!("a key file others may read is not used")
        };
        assert_eq!(message, "the SSH key file /etc/siteboot/k for 10.0.0.5:22 is readable");
    }

    /// The delivery's progress, as the record takes it: the run seen started is delivered, its
    /// exit status ends the operation, a step that failed on the connection is tried again
    /// (the next pass probes first), one that ran and failed ends it.
    #[test]
    fn a_delivery_pass_records_what_the_server_said() {
        let going = adopted(&ssh(), Ok(Progress::Running), false);
        assert_eq!(going, Pass::going("the bootstrap data runs on the server", true));
        let Pass::Done { ok: true, installed, delivered: true, .. } =
            adopted(&ssh(), Ok(Progress::Finished(0)), true)
        else {
            panic!("exit 0 is a success")
        };
        assert_eq!(installed, Some(("ssh://10.0.0.5:22".into(), String::new())));
        let failed = adopted(&ssh(), Ok(Progress::Finished(7)), false);
        assert_eq!(failed, Pass::failed("the bootstrap data exited with status 7", true));
        let cut = StepFailed::Ssh { what: "starting the run", source: io_error() };
        let retried = adopted(&ssh(), Err(Stalled::Step(cut)), false);
        assert!(matches!(retried, Pass::Going { delivered: false, .. }), "{retried:?}");
        let ran = StepFailed::Failed {
            what: "checking the host",
            status: siteboot_ssh::ExitStatus::Code(1),
            stderr: "kubelet is running".into(),
        };
        let ended = adopted(&ssh(), Err(Stalled::Step(ran)), false);
        assert!(
            matches!(&ended, Pass::Done { ok: false, message, .. } if message.contains("kubelet is running")),
            "{ended:?}"
        );
        let lost = adopted(&ssh(), Err(Stalled::MarkerLost("op".parse().unwrap())), true);
        assert!(matches!(lost, Pass::Done { ok: false, delivered: true, .. }), "{lost:?}");
    }

    /// The host's user_data goes as a script when it is one, as cloud-init user-data otherwise,
    /// with the meta-data a provisioning by the ramdisk gives.
    #[test]
    fn the_user_data_is_staged_as_the_format_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let mut host = ssh();
        let id: adopt::OperationId = "0123abcd".parse().unwrap();
        let staged_as = |host: &HostSsh| staged(host, "node-a", &id);
        assert_eq!(staged_as(&host).unwrap().format, DataFormat::CloudConfig, "empty user-data");
        for (text, format) in [
            ("#!/bin/sh\nexit 0\n", DataFormat::Script),
            ("#cloud-config\n{}\n", DataFormat::CloudConfig),
        ] {
            let path = dir.path().join("user-data");
            std::fs::write(&path, text).unwrap();
            host.user_data = Some(path);
            let delivery = staged_as(&host).unwrap();
            assert_eq!((delivery.format, delivery.data.as_slice()), (format, text.as_bytes()));
            assert_eq!(delivery.meta.provider_id, "siteboot://standalone/node-a");
            assert_eq!(delivery.meta.instance_id, "0123abcd");
        }
        host.user_data = Some(dir.path().join("gone"));
        assert!(staged_as(&host).unwrap_err().contains("gone cannot be read"));
    }
}
