//! A Host's SSH access: its `spec.access.ssh` parsed ([`spec_of`]), bound to the Secret that
//! `credentialsName` names ([`access_for`], as [`crate::bmc::redfish_for`] binds a BMC's
//! credentials), and the host-key policy the connection uses ([`policy`]). No I/O here but
//! the connections of the steps that log in: [`check`] (the registration's), [`inspect`],
//! [`deliver`] and [`reset`] (an adopted host's), and [`kexec`] (a Reimage host's boot into its
//! ramdisk: the pass itself, kube-free, is siteboot-ssh's [`reimage::kexec`], and so is the
//! ramdisk it sends, [`KexecRamdisk`]); the outcome of their answers is
//! [`crate::host::write`]'s. [`identify`] takes an inspection's report only from this Host's
//! machine.

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use siteboot_agent_api::Hardware;
use siteboot_ssh::adopt::{
    self, AdoptError, Delivery, MetaData, OperationId, Progress, Remote, Stalled, StepFailed,
};
use siteboot_ssh::inspect::{self, InspectError, InspectFailed, Report};
use siteboot_ssh::reimage::{self, KexecFailed, KexecRamdisk, Kexecuted, RamdiskFilesError};
pub use siteboot_ssh::{
    AccessError, BindingError, BoundAccess, ClientKey, Endpoint, HostKey, HostKeyPolicy,
    HostKeyTrust, SECRET_TYPE, Session, SshError, Target,
};

use crate::crd::{Host, RecordedHostKey, SshMode};
use crate::handoff::BootstrapData;

/// How long the registration's connection (TCP, handshake, login) may take.
const CONNECT_DEADLINE: Duration = Duration::from_secs(20);

/// A Host's `spec.access.ssh`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshSpec {
    pub endpoint: Endpoint,
    pub target: Target,
    pub user: String,
    pub mode: SshMode,
    pub credentials_name: String,
}

/// Why siteboot cannot, or did not, reach a Host's server over SSH. None repeats what the
/// Secret holds: its content is not the Host editor's to read.
#[derive(Debug, thiserror::Error)]
pub enum SshAccessError {
    #[error("spec.access.ssh.address {0:?} is not an IP address")]
    InvalidAddress(String),
    #[error("spec.access.ssh: {0}")]
    InvalidTarget(String),
    #[error("the SSH access Secret {name} {why}")]
    Secret { name: String, why: String },
    #[error(
        "the SSH access Secret {name} has type {found:?}, not {SECRET_TYPE:?}: nothing was sent"
    )]
    SecretType { name: String, found: String },
    /// The address is offered only for the case that the Host's is the right one.
    #[error(
        "the SSH access Secret {namespace}/{name} does not name the server it is for, so its key \
         is used nowhere. If it is the key of the server at {address}, add its address to the \
         Secret: kubectl -n {namespace} patch secret {name} --type merge -p \
         '{{\"stringData\":{{\"address\":\"{address}\"}}}}'"
    )]
    Unbound { namespace: String, name: String, address: IpAddr },
    #[error(
        "the SSH access Secret {name} is for another server than spec.access.ssh \
         ({address} port {port}): nothing was sent"
    )]
    NotForThisServer { name: String, address: IpAddr, port: u16 },
    #[error("status.sshHostKey cannot be read: {0}; remove it to record the key again")]
    RecordUnreadable(String),
    /// The connection: the host key, the login, the network.
    #[error(transparent)]
    Connect(#[from] SshError),
    #[error("the inspection command failed: {0}")]
    InspectionFailed(String),
    #[error("the server's inspection report is unreadable: {0}")]
    Report(#[from] InspectError),
    /// The delivery cannot go on (a step failed, and the run was not started or its start is
    /// unknown: the next pass probes; or the server's marker says it must not run).
    #[error("delivering the bootstrap data: {0}")]
    Delivery(#[from] Stalled),
    #[error("delivering the bootstrap data: {0}")]
    Adopt(#[from] AdoptError),
    /// A step of the reset failed, or left something behind: the host is not released.
    #[error("resetting the server: {0}")]
    Reset(StepFailed),
    /// The login for a kexec into the ramdisk failed: nothing was sent.
    #[error("the server cannot be reached over SSH to kexec it into its ramdisk: {0}")]
    KexecUnreachable(Box<SshAccessError>),
    #[error(
        "no host key is pinned or recorded (status.sshHostKey) for the server: its ramdisk's token goes only to a server siteboot knows; nothing was sent"
    )]
    HostKeyNotRecorded,
    /// A step of the kexec failed: the kexec was not started.
    #[error("kexec into the ramdisk: {0}")]
    Kexec(StepFailed),
    #[error("kexec into the ramdisk: {0}")]
    RamdiskFiles(#[from] RamdiskFilesError),
}

impl SshAccessError {
    /// CamelCase, for a condition's reason and an Event.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::InvalidAddress(_) | Self::InvalidTarget(_) => "SSHSpecInvalid",
            Self::Secret { .. } | Self::SecretType { .. } => "SSHCredentialsMissing",
            Self::Unbound { .. } => "SSHCredentialsUnbound",
            Self::NotForThisServer { .. } => "SSHCredentialsNotForThisServer",
            Self::RecordUnreadable(_) => "SSHHostKeyRecordInvalid",
            Self::InspectionFailed(_) | Self::Report(_) => "SSHInspectionFailed",
            Self::Delivery(_) | Self::Adopt(_) => "SSHDeliveryFailed",
            Self::Reset(_) => "SSHResetFailed",
            Self::KexecUnreachable(e) => e.reason(),
            Self::HostKeyNotRecorded => "SSHHostKeyNotRecorded",
            Self::Kexec(_) => "SSHKexecFailed",
            Self::RamdiskFiles(_) => "RamdiskFilesUnavailable",
            Self::Connect(e) => match e {
                SshError::HostKeyMismatch { .. } => "HostKeyMismatch",
                SshError::UnacceptableHostKey { .. } | SshError::HostCertificate { .. } => {
                    "HostKeyUnacceptable"
                }
                SshError::AuthenticationRejected { .. } => "SSHAuthenticationRejected",
                SshError::Connect { .. } | SshError::Timeout { .. } => "SSHUnreachable",
                _ => "SSHFailed",
            },
        }
    }
}

/// `host`'s SSH access, if it has one; an error when it cannot be used at all (no I/O).
pub fn spec_of(host: &Host) -> Result<Option<SshSpec>, SshAccessError> {
    let Some(ssh) = host.spec.access.as_ref().and_then(|a| a.ssh.as_ref()) else {
        return Ok(None);
    };
    let address: IpAddr =
        ssh.address.parse().map_err(|_| SshAccessError::InvalidAddress(ssh.address.clone()))?;
    let target = Target::new(&address.to_string(), ssh.port, &ssh.user)
        .map_err(|e| SshAccessError::InvalidTarget(e.to_string()))?;
    Ok(Some(SshSpec {
        endpoint: Endpoint { address, port: ssh.port },
        target,
        user: ssh.user.clone(),
        mode: ssh.mode,
        credentials_name: ssh.credentials_name.clone(),
    }))
}

/// The access in the Secret `spec` names (`None`: there is none), read from `namespace`: only
/// if it is an SSH access Secret for the server `spec` names. No I/O.
pub fn access_for(
    spec: &SshSpec,
    namespace: &str,
    secret: Option<&Secret>,
) -> Result<BoundAccess, SshAccessError> {
    let name = spec.credentials_name.clone();
    let full = format!("{namespace}/{name}");
    let secret = secret.ok_or_else(|| SshAccessError::Secret {
        name: full.clone(),
        why: "does not exist".into(),
    })?;
    let found = secret.type_.clone().unwrap_or_default();
    if found != SECRET_TYPE {
        return Err(SshAccessError::SecretType { name: full, found });
    }
    let data = secret.data.clone().unwrap_or_default();
    let data = data.into_iter().map(|(key, ByteString(bytes))| (key, bytes)).collect();
    let Endpoint { address, port } = spec.endpoint;
    BoundAccess::from_secret_data(&data, spec.endpoint).map_err(|e| match e {
        BindingError::Unusable(e) => SshAccessError::Secret { name: full, why: e.to_string() },
        BindingError::Unbound => {
            SshAccessError::Unbound { namespace: namespace.to_owned(), name, address }
        }
        BindingError::OtherAddress | BindingError::OtherPort => {
            SshAccessError::NotForThisServer { name: full, address, port }
        }
    })
}

/// The host key a connection to `access`'s server accepts: the Secret's pin; under trust on
/// first use, the key recorded in `host`'s status for that server, or (none yet) whatever the
/// server presents, to be recorded.
pub fn policy(host: &Host, access: &BoundAccess) -> Result<HostKeyPolicy, SshAccessError> {
    match access.trust() {
        HostKeyTrust::Pinned(key) => Ok(HostKeyPolicy::Pinned(key.clone())),
        HostKeyTrust::OnFirstUse => match recorded(host, access.endpoint()) {
            None => Ok(HostKeyPolicy::TrustOnFirstUse),
            Some(record) => record.key.parse().map(HostKeyPolicy::Pinned).map_err(
                |e: siteboot_ssh::HostKeyError| SshAccessError::RecordUnreadable(e.to_string()),
            ),
        },
    }
}

/// The host key `host`'s status recorded for the server at `endpoint`, if any.
pub fn recorded(host: &Host, endpoint: Endpoint) -> Option<&RecordedHostKey> {
    let record = host.status.as_ref()?.ssh_host_key.as_ref()?;
    let same = record.address.parse() == Ok(endpoint.address) && record.port == endpoint.port;
    same.then_some(record)
}

/// What the registration's connection found: the server's key, and whether it is to be
/// recorded (trust on first use, and none recorded yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reached {
    pub endpoint: Endpoint,
    pub user: String,
    pub host_key: HostKey,
    pub first_use: bool,
}

/// Connects to `host`'s server with the key its Secret holds, checking the host key inside the
/// handshake, and logs in: the session, and whether its key is to be recorded (trust on first
/// use, none recorded yet).
async fn connect(
    host: &Host,
    client: &kube::Client,
) -> Result<(Session, SshSpec, bool), SshAccessError> {
    let Some(spec) = spec_of(host)? else {
        return Err(SshAccessError::InvalidTarget("the Host has no spec.access.ssh".into()));
    };
    let namespace = kube::ResourceExt::namespace(host).unwrap_or_default();
    let secrets: kube::Api<Secret> = kube::Api::namespaced(client.clone(), &namespace);
    let name = &spec.credentials_name;
    let secret = secrets.get_opt(name).await.map_err(|e| SshAccessError::Secret {
        name: format!("{namespace}/{name}"),
        why: format!("cannot be read: {e}"),
    })?;
    let access = access_for(&spec, &namespace, secret.as_ref())?;
    let policy = policy(host, &access)?;
    let session = Session::connect(&spec.target, access.key(), &policy, CONNECT_DEADLINE).await?;
    Ok((session, spec, policy == HostKeyPolicy::TrustOnFirstUse))
}

/// Hangs up; a slow goodbye changes nothing.
async fn hang_up(host: &Host, session: Session) {
    if let Err(e) = session.close(CONNECT_DEADLINE).await {
        tracing::debug!(host = %crate::context::key(host), "closing the SSH connection: {e}");
    }
}

/// Logs in to `host`'s server and hangs up: the registration of a Host reached over SSH.
pub async fn check(host: &Host, client: &kube::Client) -> Result<Reached, SshAccessError> {
    let (session, spec, first_use) = connect(host, client).await?;
    let reached = Reached {
        endpoint: spec.endpoint,
        user: spec.user.clone(),
        host_key: session.host_key().clone(),
        first_use,
    };
    hang_up(host, session).await;
    Ok(reached)
}

/// Logs in to `host`'s server (its key pinned by now) and runs [`inspect::command`]: what
/// the server says it is. Whether it is this Host's machine is [`identify`]'s question.
pub async fn inspect(host: &Host, client: &kube::Client) -> Result<Report, SshAccessError> {
    let (session, _, _) = connect(host, client).await?;
    let report = inspect::run(&session).await;
    hang_up(host, session).await;
    report.map_err(|e| match e {
        InspectFailed::Ssh(e) => SshAccessError::Connect(e),
        InspectFailed::Command(why) => SshAccessError::InspectionFailed(why),
        InspectFailed::Report(e) => SshAccessError::Report(e),
    })
}

/// Logs in to `host`'s server (its key pinned by now) and moves its delivery on: where the
/// delivery of the operation under way stands, probed first on every pass, and, if it was never
/// started, the adopt plan with `data` (`None`: not staged yet, nothing is sent). The host's
/// marker, claimed by the run's start, is what keeps the data from running twice; the Host's
/// status records the delivery once the probe saw it started ([`crate::host::write`]).
pub async fn deliver(
    host: &Host,
    client: &kube::Client,
    data: Option<(BootstrapData, MetaData)>,
) -> Result<Progress, SshAccessError> {
    let (session, _, _) = connect(host, client).await?;
    let progress = deliver_on(&session, host, data).await;
    hang_up(host, session).await;
    progress
}

/// [`deliver`] on the server behind `remote`.
async fn deliver_on(
    remote: &impl Remote,
    host: &Host,
    data: Option<(BootstrapData, MetaData)>,
) -> Result<Progress, SshAccessError> {
    let op = host.status.as_ref().and_then(|s| s.operation.as_ref());
    let Some(op) = op else { return Ok(Progress::NotStarted) };
    let id: OperationId = op.id.parse()?;
    let delivery = match data {
        Some((data, meta)) => {
            Some(Delivery { id: id.clone(), meta, data: data.value, format: data.format.parse()? })
        }
        None => None,
    };
    Ok(adopt::advance(remote, &id, op.bootstrap_delivered, delivery.as_ref()).await?)
}

/// Logs in to `host`'s server and resets it ([`adopt::reset`]): its Kubernetes state removed
/// and verified gone, its delivery marker last.
pub async fn reset(host: &Host, client: &kube::Client) -> Result<(), SshAccessError> {
    let (session, _, _) = connect(host, client).await?;
    let reset = adopt::follow(&session, &adopt::reset()).await.map_err(SshAccessError::Reset);
    hang_up(host, session).await;
    reset
}

/// Logs in to `host`'s server with its pinned (or recorded) host key and kexecs it into the
/// ramdisk of the operation under way ([`kexec_on`]). The outer error is `issue`'s, which
/// stores the token's hash before it leaves and gives the token.
pub async fn kexec<E>(
    host: &Host,
    client: &kube::Client,
    ramdisk: Result<&KexecRamdisk, &RamdiskFilesError>,
    issue: impl AsyncFnOnce() -> Result<Option<String>, E>,
) -> Result<Result<Kexecuted, SshAccessError>, E> {
    let ramdisk = match ramdisk {
        Ok(ramdisk) => ramdisk,
        Err(e) => return Ok(Err(e.clone().into())),
    };
    let (session, _, first_use) = match connect(host, client).await {
        Ok(connected) => connected,
        Err(e) => return Ok(Err(SshAccessError::KexecUnreachable(Box::new(e)))),
    };
    let kexecuted = match first_use {
        true => Ok(Err(SshAccessError::HostKeyNotRecorded)),
        false => kexec_on(&session, host, ramdisk, issue).await,
    };
    hang_up(host, session).await;
    kexecuted
}

/// [`kexec`] on the server behind `remote`: the pass of the operation under way
/// ([`reimage::kexec`]), its failures said as the Host's.
async fn kexec_on<E>(
    remote: &impl Remote,
    host: &Host,
    ramdisk: &KexecRamdisk,
    issue: impl AsyncFnOnce() -> Result<Option<String>, E>,
) -> Result<Result<Kexecuted, SshAccessError>, E> {
    let op = host.status.as_ref().and_then(|s| s.operation.as_ref());
    let Some(op) = op else { return Ok(Ok(Kexecuted::NotIssued)) };
    let id: OperationId = match op.id.parse() {
        Ok(id) => id,
        Err(source) => {
            let failed = StepFailed::Progress { what: "the operation's id", source };
            return Ok(Err(SshAccessError::Kexec(failed)));
        }
    };
    Ok(reimage::kexec(remote, &id, ramdisk, issue).await?.map_err(|e| match e {
        KexecFailed::Step(e) => SshAccessError::Kexec(e),
        KexecFailed::Files(e) => SshAccessError::RamdiskFiles(e),
    }))
}

/// Why an inspected server is not `host`'s machine. Says what was seen, bounded: the server's
/// MACs and UUID passed [`inspect::parse`], so they are plain hex.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotThisHost {
    #[error(
        "the server at spec.access.ssh has no interface with spec.bootMACAddress {boot_mac}; it has {seen}: nothing is recorded of it"
    )]
    NoBootMac { boot_mac: String, seen: String },
    #[error(
        "the server at spec.access.ssh has system UUID {seen}, not {recorded} as inspected before: nothing is recorded of it"
    )]
    OtherUuid { recorded: String, seen: String },
}

/// At most this many MACs are named in a refusal.
const MACS_NAMED: usize = 8;

/// The hardware `report` describes, if the server is `host`'s machine: positive evidence only,
/// one of its interfaces has the Host's boot MAC (what a network boot would have proved), and
/// a system UUID recorded by an earlier inspection is the one it has now.
pub fn identify(host: &Host, report: &Report) -> Result<Hardware, NotThisHost> {
    let boot_mac = &host.spec.boot_mac_address;
    if !report.has_mac(boot_mac) {
        let macs = report.macs();
        let mut seen = macs.iter().take(MACS_NAMED).copied().collect::<Vec<_>>().join(", ");
        if macs.len() > MACS_NAMED {
            seen.push_str(&format!(" and {} more", macs.len() - MACS_NAMED));
        }
        if macs.is_empty() {
            seen = "no Ethernet interface".into();
        }
        let boot_mac: String = boot_mac.chars().take(17).collect();
        return Err(NotThisHost::NoBootMac { boot_mac, seen });
    }
    let hardware = report.hardware();
    let recorded = host.status.as_ref().and_then(|s| s.hardware.as_ref()?.system.as_ref());
    if let Some(recorded) = recorded {
        let seen = hardware.system.as_ref().map(|s| s.uuid.as_str());
        if seen != Some(recorded.uuid.as_str()) {
            return Err(NotThisHost::OtherUuid {
                recorded: recorded.uuid.clone(),
                seen: seen.unwrap_or("none").to_owned(),
            });
        }
    }
    Ok(hardware)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::crd::{Access, HostSpec, HostStatus, SshAccess};
    use siteboot_boot::inventory::{LinuxBoot, Source};
    use siteboot_ipxe::Word;
    use siteboot_ssh::Captured;

    const PRIVATE_KEY: &str = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\nQyNTUxOQAAACBHtIV64SKCJuQ9TdaCoIcgM01Lg0AuiNylCH8JtJ3F+AAAAJBx4HtwceB7\ncAAAAAtzc2gtZWQyNTUxOQAAACBHtIV64SKCJuQ9TdaCoIcgM01Lg0AuiNylCH8JtJ3F+A\nAAAEBAP0sERiFkFrIz0omAHUUluhVum32a57sKOPbsMZQ2sEe0hXrhIoIm5D1N1oKghyAz\nTUuDQC6I3KUIfwm0ncX4AAAADHJvb3RAZml4dHVyZQE=\n-----END OPENSSH PRIVATE KEY-----\n";
    const HOST_KEY: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEe0hXrhIoIm5D1N1oKghyAzTUuDQC6I3KUIfwm0ncX4";

    pub fn host(address: &str) -> Host {
        let mut host = Host::new("adopted", HostSpec::new("52:54:00:00:00:01"));
        host.metadata.namespace = Some("metal".into());
        host.spec.access = Some(Access {
            ssh: Some(SshAccess {
                address: address.into(),
                port: 22,
                user: "root".into(),
                mode: SshMode::Adopt,
                credentials_name: "ssh".into(),
            }),
        });
        host
    }

    fn secret(pairs: &[(&str, &str)], type_: &str) -> Secret {
        let data: BTreeMap<String, ByteString> =
            pairs.iter().map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec()))).collect();
        Secret { data: Some(data), type_: Some(type_.into()), ..Secret::default() }
    }

    fn bind(host: &Host, secret: &Secret) -> Result<BoundAccess, SshAccessError> {
        access_for(&spec_of(host)?.unwrap(), "metal", Some(secret))
    }

    #[test]
    fn the_secret_binds_the_key_to_its_server_and_type() {
        let pinned = [("privateKey", PRIVATE_KEY), ("hostKey", HOST_KEY), ("address", "10.0.0.5")];
        assert!(bind(&host("10.0.0.5"), &secret(&pinned, SECRET_TYPE)).is_ok());
        // A Host editor points the Host at another machine: the key goes nowhere.
        let other = bind(&host("10.0.0.66"), &secret(&pinned, SECRET_TYPE)).unwrap_err();
        assert_eq!(other.reason(), "SSHCredentialsNotForThisServer", "{other}");
        assert!(!other.to_string().contains("10.0.0.5"), "the Secret's address leaked: {other}");
        // Another kind of Secret (a tenant's kubernetes.io/ssh-auth) is not an access Secret.
        let typed = bind(&host("10.0.0.5"), &secret(&pinned, "kubernetes.io/ssh-auth"));
        assert_eq!(typed.unwrap_err().reason(), "SSHCredentialsMissing");
        let unbound = bind(&host("10.0.0.5"), &secret(&pinned[..2], SECRET_TYPE)).unwrap_err();
        assert_eq!(unbound.reason(), "SSHCredentialsUnbound");
        assert!(unbound.to_string().contains(r#"-p '{"stringData":{"address":"10.0.0.5"}}'"#));
        let missing = access_for(&spec_of(&host("10.0.0.5")).unwrap().unwrap(), "metal", None);
        assert_eq!(missing.unwrap_err().reason(), "SSHCredentialsMissing");
        let named = spec_of(&host("server.example")).unwrap_err();
        assert_eq!(named.reason(), "SSHSpecInvalid");
        let mut odd = host("10.0.0.5");
        odd.spec.access.as_mut().unwrap().ssh.as_mut().unwrap().user = "root; reboot".into();
        assert_eq!(spec_of(&odd).unwrap_err().reason(), "SSHSpecInvalid");
    }

    /// Trust on first use pins the key recorded for this server once there is one.
    #[test]
    fn the_policy_is_the_secret_s_pin_or_the_key_recorded_on_first_use() {
        let pinned = [("privateKey", PRIVATE_KEY), ("hostKey", HOST_KEY), ("address", "10.0.0.5")];
        let tofu =
            [("privateKey", PRIVATE_KEY), ("trustOnFirstUse", "true"), ("address", "10.0.0.5")];
        let mut host = host("10.0.0.5");
        let key: HostKey = HOST_KEY.parse().unwrap();
        let access = bind(&host, &secret(&pinned, SECRET_TYPE)).unwrap();
        assert_eq!(policy(&host, &access).unwrap(), HostKeyPolicy::Pinned(key.clone()));
        let access = bind(&host, &secret(&tofu, SECRET_TYPE)).unwrap();
        assert_eq!(policy(&host, &access).unwrap(), HostKeyPolicy::TrustOnFirstUse);
        let record = |address: &str, key: &str| RecordedHostKey {
            key: key.into(),
            fingerprint: String::new(),
            address: address.into(),
            port: 22,
            recorded: crate::crd::now(),
        };
        host.status = Some(HostStatus {
            ssh_host_key: Some(record("10.0.0.5", HOST_KEY)),
            ..HostStatus::default()
        });
        assert_eq!(policy(&host, &access).unwrap(), HostKeyPolicy::Pinned(key));
        // Recorded for another server: not this one's.
        host.status.as_mut().unwrap().ssh_host_key = Some(record("10.0.0.9", HOST_KEY));
        assert_eq!(policy(&host, &access).unwrap(), HostKeyPolicy::TrustOnFirstUse);
        host.status.as_mut().unwrap().ssh_host_key = Some(record("10.0.0.5", "garbage"));
        assert_eq!(policy(&host, &access).unwrap_err().reason(), "SSHHostKeyRecordInvalid");
    }

    /// A server that answers a probe (a delivery's or a kexec's) with `probed` and every other
    /// command with success, recording what it was sent.
    #[derive(Default)]
    struct Server {
        probed: &'static str,
        sent: std::sync::Mutex<Vec<String>>,
    }

    impl Remote for Server {
        async fn run(&self, line: &str, _: Duration) -> Result<siteboot_ssh::Output, SshError> {
            self.sent.lock().unwrap().push(line.to_owned());
            let probe = line == adopt::probe().line || line == reimage::probe().line;
            let stdout = Captured::of(if probe { self.probed.as_bytes() } else { b"" });
            Ok(siteboot_ssh::Output {
                status: siteboot_ssh::ExitStatus::Code(0),
                stdout,
                stderr: Captured::of(b""),
            })
        }

        async fn upload(
            &self,
            path: &siteboot_ssh::RemotePath,
            _: siteboot_ssh::FileMode,
            _: &[u8],
            _: Duration,
        ) -> Result<(), SshError> {
            self.sent.lock().unwrap().push(format!("upload {path}"));
            Ok(())
        }
    }

    fn provisioning(delivered: bool) -> Host {
        let mut host = host("10.0.0.5");
        let kind = crate::crd::OperationKind::Provision;
        let op = crate::crd::Operation {
            bootstrap_delivered: delivered,
            ..crate::crd::Operation::new(kind, "op-1".into(), crate::crd::now())
        };
        host.status = Some(HostStatus {
            state: Some(crate::crd::HostState::Provisioning),
            operation: Some(op),
            ..HostStatus::default()
        });
        host
    }

    fn staged() -> Option<(BootstrapData, MetaData)> {
        let data =
            BootstrapData { value: b"#cloud-config\n".to_vec(), format: "cloud-config".into() };
        let meta = MetaData {
            instance_id: "op-1".into(),
            local_hostname: "m".into(),
            provider_id: "siteboot://metal/adopted".into(),
        };
        Some((data, meta))
    }

    fn block_on<T>(future: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(future)
    }

    /// Every delivery pass probes first. Only a server where nothing was started gets the
    /// plan; one where this delivery's run was started (a pass that died before its record)
    /// gets nothing more, nor does one whose marker went after the run was recorded started.
    #[test]
    fn a_delivery_probes_first_and_never_starts_the_run_twice() {
        let deliver = |probed: &'static str, delivered: bool, data| {
            let server = Server { probed, ..Server::default() };
            let progress = block_on(deliver_on(&server, &provisioning(delivered), data));
            (progress, server.sent.into_inner().unwrap())
        };
        let (progress, sent) = deliver("", false, staged());
        assert_eq!(progress.unwrap(), Progress::Running);
        assert_eq!(sent[0], adopt::probe().line);
        assert!(sent.iter().any(|l| l.contains("systemd-run")), "{sent:?}");
        assert!(!sent.iter().any(|l| l.contains("cloud-config")), "the data on a command line");
        let (progress, sent) = deliver("", false, None);
        assert_eq!((progress.unwrap(), sent.len()), (Progress::NotStarted, 1), "not staged yet");
        for (probed, expected) in [
            ("delivery=op-1\n", Progress::Running),
            ("delivery=op-1\nresult=0\n", Progress::Finished(0)),
        ] {
            let (progress, sent) = deliver(probed, false, staged());
            assert_eq!(progress.unwrap(), expected);
            assert_eq!(sent, [adopt::probe().line], "started again");
        }
        let (other, sent) = deliver("delivery=op-0\n", false, staged());
        assert_eq!((other.unwrap_err().reason(), sent.len()), ("SSHDeliveryFailed", 1));
        let (lost, sent) = deliver("", true, None);
        assert!(matches!(lost, Err(SshAccessError::Delivery(Stalled::MarkerLost(_)))), "{lost:?}");
        assert_eq!(sent.len(), 1);
    }

    /// A kexec's failures are said as the Host's, with the reasons [`crate::host::write`]
    /// records, and none asks for a token (the pass itself is siteboot-ssh's, tested there).
    #[test]
    fn a_kexec_says_its_failures_as_the_host_s() {
        let root = tempfile::tempdir().unwrap();
        let word = |w: &str| Word::new(w).unwrap();
        let profile = LinuxBoot {
            kernel: Source::File(word("k/vmlinuz")),
            initrds: Vec::new(),
            cmdline: Vec::new(),
        };
        let ramdisk = KexecRamdisk::new(&profile, Some(root.path()), &[]).unwrap();
        let kexec = |probed: &'static str, host: &Host| {
            let server = Server { probed, ..Server::default() };
            let issue = async || -> Result<Option<String>, std::convert::Infallible> {
                panic!("a token was asked for")
            };
            let Ok(kexecuted) = block_on(kexec_on(&server, host, &ramdisk, issue));
            (kexecuted.unwrap_err(), server.sent.into_inner().unwrap())
        };
        let (e, sent) = kexec("", &provisioning(false));
        assert_eq!(e.reason(), "RamdiskFilesUnavailable");
        assert!(e.to_string().starts_with("kexec into the ramdisk: the ramdisk's kernel "), "{e}");
        assert!(e.to_string().contains("k/vmlinuz"), "{e}");
        assert_eq!(sent, [reimage::probe().line]);
        let (e, _) = kexec("a b\n", &provisioning(false));
        assert_eq!(e.reason(), "SSHKexecFailed");
        assert!(
            e.to_string().starts_with("kexec into the ramdisk: reading the kexec marker: "),
            "{e}"
        );
        let mut unnamed = provisioning(false);
        unnamed.status.as_mut().unwrap().operation.as_mut().unwrap().id = "op 1".into();
        let (e, sent) = kexec("", &unnamed);
        assert_eq!(e.reason(), "SSHKexecFailed");
        assert!(e.to_string().starts_with("kexec into the ramdisk: the operation's id: "), "{e}");
        assert!(sent.is_empty(), "{sent:?}");
    }
}
