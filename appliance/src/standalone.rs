//! The standalone inventory: what each MAC boots, from the config file, and the host operations
//! (inspect, provision, deprovision) that `siteboot host` starts without Kubernetes.
//!
//! | host | boot |
//! |---|---|
//! | reached over SSH (`ssh`), whatever is under way | its profile: its operations run over SSH ([`crate::ssh`], moved on by [`StaticInventory::drive_ssh`]); with an `image`, a kexec over SSH boots the ramdisk, whose token works from any address |
//! | an operation under way, asked from the address that holds its MAC | the ramdisk (`ramdisk_profile`) with a fresh token |
//! | an operation under way, asked from elsewhere, or after its bootstrap data went out | the ramdisk with no token: it waits |
//! | no operation | its profile |
//!
//! The agent API is answered by `siteboot_agent_server::serve`, as in Kubernetes mode, over
//! [`FileRecords`]: the records live in [`Operations`]. A host
//! with a BMC is booted into the ramdisk through it when an operation starts ([`crate::bmc`]);
//! an operation ends when its ramdisk reports, when the operator cancels it, or when its
//! ramdisk falls silent (Kubernetes mode's rule, checked by [`StaticInventory::watch_silence`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::StatusCode;
use siteboot_agent_api::{Hardware, MetaData};
use siteboot_agent_server::images::ImageService;
use siteboot_agent_server::serve::{self, BootstrapData, Opened, Records, Target};
use siteboot_agent_server::token::{self, ramdisk_boot};
use siteboot_agent_server::{
    ByteCount, Image, OperationKind, Refusal, RootDeviceHints, WipePolicy,
};
use siteboot_bmc::Redfish;
use siteboot_boot::dhcp::relay_agent::RelayPin;
use siteboot_boot::dhcp::settings::Reservation;
use siteboot_boot::inventory::{
    AgentRequest, AgentResponse, BootRequest, BoxFuture, ByteProgress, HostSummary, Inventory,
    LinuxBoot, OperationSummary,
};
use siteboot_boot::{BootAction, MacAddr};
use siteboot_ssh::reimage::KexecRamdisk;
use tokio_util::sync::CancellationToken;

use crate::bmc::{self, BmcFailure, HostBmc};
use crate::operations::{HostRecord, NoOperation, StartError, Store, StoreError, now};
use crate::ssh::{self, HostSsh, Pass};

/// A host listed under `hosts`.
#[derive(Debug)]
pub struct ListedHost {
    pub action: BootAction,
    /// The profile `action` comes from.
    pub profile: String,
    /// What `siteboot host` commands call it.
    pub name: String,
    /// Its DHCP reservation (`dhcp.reservations`), if it has one: the status page shows its
    /// host name and address.
    pub reservation: Option<Reservation>,
    /// What `siteboot host provision` writes; `None`: it cannot be provisioned.
    pub provisioning: Option<Provisioning>,
    pub wipe: WipePolicy,
    /// Its BMC, if siteboot may power-cycle it.
    pub bmc: Option<HostBmc>,
    /// Its SSH access, if it is a running server whose operations go over SSH ([`crate::ssh`])
    /// instead of through the ramdisk.
    pub ssh: Option<HostSsh>,
    /// The relay agent information its relayed DHCP messages must carry (`relay_agent`).
    pub relay_pin: Option<RelayPin>,
}

impl ListedHost {
    /// Reached over SSH with an image: its provisioning and deprovisioning kexec it into the
    /// ramdisk ([`crate::ssh::kexec_pass`]), which then runs them as on any host.
    pub fn reimaged_over_ssh(&self) -> bool {
        self.ssh.is_some() && self.provisioning.is_some()
    }
}

/// A host's image and bootstrap data.
#[derive(Debug, Clone)]
pub struct Provisioning {
    pub image: Image,
    /// Read when the ramdisk asks; `None`: empty user-data.
    pub user_data: Option<PathBuf>,
    pub root_device_hints: RootDeviceHints,
}

#[derive(Debug)]
pub struct StaticInventory {
    hosts: HashMap<MacAddr, ListedHost>,
    /// What MACs not listed boot (`unknown_hosts`); `None`: they get no boot information.
    default: Option<BootAction>,
    /// Host operations; `None` until [`enable_operations`](Self::enable_operations) (no
    /// `ramdisk_profile`, or `check-config`).
    operations: Option<Operations>,
}

/// The host operations' runtime: records, the ramdisk, the image cache.
pub struct Operations {
    store: Store,
    records: Mutex<HashMap<MacAddr, HostRecord>>,
    /// `None`: only the hosts reached over SSH have operations.
    ramdisk: Option<LinuxBoot>,
    /// The ramdisk as a kexec over SSH sends it, for hosts reached over SSH with an image.
    kexec: Option<KexecRamdisk>,
    images: Arc<ImageService>,
    token_max_age: Duration,
    /// How long a ramdisk that booted may stay silent before its operation ends.
    max_silence: Duration,
}

impl std::fmt::Debug for Operations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operations").field("store", &self.store).finish_non_exhaustive()
    }
}

/// Why `siteboot host ...` cannot do what it was asked.
#[derive(Debug)]
pub enum ControlError {
    UnknownHost(String),
    NoRamdisk,
    NoImage(String),
    /// The host's `user_data` file cannot be read.
    UserData(String),
    Start(StartError),
    /// Nothing to cancel.
    NoOperation(String),
    /// The host's BMC could not boot it into the ramdisk: `(host, why)`.
    Bmc(String, BmcFailure),
    Store(StoreError),
}

impl std::fmt::Display for ControlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ControlError::UnknownHost(name) => {
                write!(f, "no host named {name:?} (or with that MAC) under hosts")
            }
            ControlError::NoRamdisk => {
                f.write_str("the config has no ramdisk_profile: host operations are off")
            }
            ControlError::NoImage(name) => write!(f, "host {name:?} has no image to provision"),
            ControlError::UserData(why) => write!(f, "user_data {why}"),
            ControlError::Start(e) => e.fmt(f),
            ControlError::NoOperation(name) => {
                write!(f, "host {name:?} has no operation under way")
            }
            ControlError::Bmc(name, e) => write!(f, "host {name:?}: {e}"),
            ControlError::Store(e) => e.fmt(f),
        }
    }
}

impl StaticInventory {
    pub fn new(hosts: HashMap<MacAddr, ListedHost>, default: Option<BootAction>) -> Self {
        Self { hosts, default, operations: None }
    }

    pub fn known_hosts(&self) -> usize {
        self.hosts.len()
    }

    /// Whether a listed host is reached over SSH with an image: it is kexec'ed into the
    /// ramdisk.
    pub fn has_hosts_reimaged_over_ssh(&self) -> bool {
        self.hosts.values().any(ListedHost::reimaged_over_ssh)
    }

    /// Whether a listed host is reached over SSH: its operations need no ramdisk.
    pub fn has_ssh_hosts(&self) -> bool {
        self.hosts.values().any(|h| h.ssh.is_some())
    }

    /// Turns host operations on: reads every listed host's record from `store`.
    pub fn enable_operations(
        &mut self,
        store: Store,
        (ramdisk, kexec): (Option<LinuxBoot>, Option<KexecRamdisk>),
        images: Arc<ImageService>,
        token_max_age: Duration,
        max_silence: Duration,
    ) -> Result<(), StoreError> {
        let mut records = HashMap::new();
        for mac in self.hosts.keys() {
            records.insert(*mac, store.load(*mac)?);
        }
        self.operations = Some(Operations {
            store,
            records: Mutex::new(records),
            ramdisk,
            kexec,
            images,
            token_max_age,
            max_silence,
        });
        Ok(())
    }

    /// The host named `name`, or whose MAC `name` is.
    fn listed(&self, name: &str) -> Result<(MacAddr, &ListedHost), ControlError> {
        let by_mac = name.parse::<MacAddr>().ok().and_then(|mac| self.hosts.get_key_value(&mac));
        by_mac
            .or_else(|| self.hosts.iter().find(|(_, h)| h.name == name))
            .map(|(mac, h)| (*mac, h))
            .ok_or_else(|| ControlError::UnknownHost(name.to_owned()))
    }

    /// Starts (or follows, if one of that kind is under way) an operation on host `name`. A
    /// host with a BMC is then booted into the ramdisk through it: a BMC that cannot be used
    /// for this host fails the request before the operation starts, one that fails to boot it
    /// ends the operation with the reason. A host reached over SSH has its operation moved on
    /// by [`drive_ssh`](Self::drive_ssh).
    pub async fn start(&self, name: &str, kind: OperationKind) -> Result<HostView, ControlError> {
        let (mac, host) = self.listed(name)?;
        let ops = self.operations.as_ref().ok_or(ControlError::NoRamdisk)?;
        if host.ssh.is_none() && ops.ramdisk.is_none() {
            return Err(ControlError::NoRamdisk);
        }
        if kind == OperationKind::Provision {
            let user_data = match (&host.ssh, &host.provisioning) {
                (Some(ssh), _) => &ssh.user_data,
                (None, Some(provisioning)) => &provisioning.user_data,
                (None, None) => return Err(ControlError::NoImage(name.to_owned())),
            };
            // Read again when it is sent; checked here so a missing file fails now.
            if let Some(path) = user_data {
                std::fs::File::open(path)
                    .map_err(|e| ControlError::UserData(format!("{}: {e}", path.display())))?;
            }
        }
        let refused = |e: Result<StartError, StoreError>| match e {
            Ok(e) => ControlError::Start(e),
            Err(e) => ControlError::Store(e),
        };
        // Refused (busy, wipe required) before the BMC is bothered; followed without it.
        let mut current = self.record(mac);
        let following = current.operation.as_ref().is_some_and(|op| op.kind == kind);
        current.start(kind, now()).map_err(|e| refused(Ok(e)))?;
        let driver = match &host.bmc {
            Some(bmc) if !following => Some(
                bmc::connect(bmc, mac)
                    .await
                    .map_err(|e| ControlError::Bmc(host.name.clone(), e))?,
            ),
            _ => None,
        };
        let (record, started) = ops
            .update(mac, true, |r| {
                let before = r.operation.as_ref().map(|op| op.id.clone());
                let id = r.start(kind, now())?.id.clone();
                if let (None, Some(ssh)) = (&before, &host.ssh) {
                    r.progress(
                        format!("connecting over SSH to {}", ssh.target.address()),
                        None,
                        now(),
                    );
                }
                Ok((before.is_none()).then_some(id))
            })
            .map_err(refused)?;
        let Some(id) = started else { return Ok(self.view(mac, host, record)) };
        tracing::info!(host = %host.name, %mac, operation = %id, ?kind, "host operation started");
        let record = match driver {
            Some(driver) => self.boot_into_ramdisk(ops, mac, host, &id, &driver).await?,
            None => record,
        };
        Ok(self.view(mac, host, record))
    }

    /// Has the BMC boot the host from the network for operation `id`, and records what it
    /// did, or ends the operation with why it could not.
    async fn boot_into_ramdisk(
        &self,
        ops: &Operations,
        mac: MacAddr,
        host: &ListedHost,
        id: &str,
        driver: &Redfish,
    ) -> Result<HostRecord, ControlError> {
        let booted = bmc::boot_from_network(driver).await;
        let (record, ()) = ops
            .update(mac, true, |r| {
                let Some(op) = r.operation.as_mut().filter(|op| op.id == id) else {
                    return Ok(()); // Cancelled meanwhile.
                };
                match &booted {
                    Ok(done) => op.network_boot = Some(done.clone()),
                    Err(e) => drop(r.finish(false, e.to_string(), None, None, now())),
                }
                Ok::<_, std::convert::Infallible>(())
            })
            .map_err(|e| match e {
                Ok(never) => match never {},
                Err(e) => ControlError::Store(e),
            })?;
        match booted {
            Ok(done) => {
                tracing::info!(host = %host.name, operation = %id, "{done}");
                Ok(record)
            }
            Err(e) => {
                tracing::warn!(host = %host.name, operation = %id, error = %e, "the BMC did not boot the host into the ramdisk; operation failed");
                Err(ControlError::Bmc(host.name.clone(), e))
            }
        }
    }

    /// Ends host `name`'s operation as the operator asked: its token stops working at once,
    /// and a ramdisk that asks later is told to wait (or, if the host booted from its disk
    /// before, to reboot).
    pub fn cancel(&self, name: &str) -> Result<HostView, ControlError> {
        let (mac, host) = self.listed(name)?;
        let ops = self.operations.as_ref().ok_or(ControlError::NoRamdisk)?;
        let (record, id) = ops
            .update(mac, true, |r| r.cancel(now()).map(|outcome| outcome.operation.clone()))
            .map_err(|e| match e {
                Ok(NoOperation) => ControlError::NoOperation(host.name.clone()),
                Err(e) => ControlError::Store(e),
            })?;
        ops.images.release(&id);
        tracing::warn!(host = %host.name, %mac, operation = %id, state = %record.state(), "host operation cancelled by the operator");
        Ok(self.view(mac, host, record))
    }

    /// Ends, as failed, every operation whose ramdisk booted and then fell silent for longer
    /// than `ramdisk_silence_timeout`; checks every so often until `stop`.
    pub async fn watch_silence(self: Arc<Self>, stop: CancellationToken) {
        let Some(ops) = &self.operations else { return };
        let every = ops.max_silence.min(SILENCE_CHECK);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            self.end_silent_operations(ops);
        }
    }

    fn end_silent_operations(&self, ops: &Operations) {
        for (mac, host) in &self.hosts {
            let ended = ops.update(*mac, true, |r| {
                // An SSH host's operation has no ramdisk to fall silent (its passes say when it
                // is unreachable) until a kexec started one.
                let kexeced = r.operation.as_ref().is_some_and(|op| op.network_boot.is_some());
                if host.ssh.is_some() && !kexeced {
                    return Err(());
                }
                r.end_if_silent(now(), ops.max_silence).cloned().ok_or(())
            });
            match ended {
                Ok((record, outcome)) => {
                    ops.images.release(&outcome.operation);
                    tracing::warn!(host = %host.name, %mac, operation = %outcome.operation, kind = ?outcome.kind, state = %record.state(), "{}; operation failed, its token revoked", outcome.message);
                }
                Err(Ok(())) => {}
                // Checked again next time.
                Err(Err(e)) => {
                    tracing::error!(host = %host.name, error = %e, "cannot end a silent operation")
                }
            }
        }
    }

    /// Moves the operation of every host reached over SSH on, a pass at a time per host (a
    /// reset may take minutes, and the other hosts do not wait for it), until `stop`. An
    /// operation carried over a restart goes on from where its server says it stands.
    pub async fn drive_ssh(self: Arc<Self>, stop: CancellationToken) {
        if self.operations.is_none() {
            return;
        }
        let mut hosts = tokio::task::JoinSet::new();
        for (mac, host) in &self.hosts {
            if host.ssh.is_some() {
                hosts.spawn(self.clone().drive_ssh_host(*mac, stop.clone()));
            }
        }
        while hosts.join_next().await.is_some() {}
    }

    async fn drive_ssh_host(self: Arc<Self>, mac: MacAddr, stop: CancellationToken) {
        let (Some(ops), Some(host)) = (&self.operations, self.hosts.get(&mac)) else { return };
        let Some(access) = &host.ssh else { return };
        loop {
            let op = self.record(mac).operation;
            // Once a kexec started, the operation is the ramdisk's.
            if let Some(op) = op.filter(|op| op.network_boot.is_none()) {
                let kexec = match (&ops.kexec, host.reimaged_over_ssh()) {
                    (Some(ramdisk), true) if op.kind != OperationKind::Inspect => Some(ramdisk),
                    _ => None,
                };
                let issue = async || {
                    let issued =
                        ops.update(mac, true, |r| r.issue_kexec_token(&op.id, now()).ok_or(()));
                    match issued {
                        Ok((_, token)) => Ok(Some(token)),
                        Err(Ok(())) => Ok(None),
                        Err(Err(e)) => Err(e),
                    }
                };
                // Stopped mid-pass, it is as a crash: the next appliance's pass probes first.
                let pass = tokio::select! {
                    _ = stop.cancelled() => return,
                    pass = async {
                        match kexec {
                            Some(ramdisk) => ssh::kexec_pass(access, &op, ramdisk, issue).await,
                            None => ssh::pass(access, mac, &host.name, &op).await,
                        }
                    } => pass,
                };
                record_pass(ops, mac, host, &op.id, pass);
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(SSH_PASS_EVERY) => {}
            }
        }
    }

    /// Host `name` as `siteboot host` shows it.
    pub fn show(&self, name: &str) -> Result<HostView, ControlError> {
        let (mac, host) = self.listed(name)?;
        Ok(self.view(mac, host, self.record(mac)))
    }

    /// Every listed host, by name.
    pub fn list(&self) -> Vec<HostView> {
        let mut views: Vec<HostView> =
            self.hosts.iter().map(|(mac, h)| self.view(*mac, h, self.record(*mac))).collect();
        views.sort_by(|a, b| a.name.cmp(&b.name));
        views
    }

    fn record(&self, mac: MacAddr) -> HostRecord {
        self.operations
            .as_ref()
            .and_then(|ops| ops.records.lock().expect("records lock").get(&mac).cloned())
            .unwrap_or_default()
    }

    fn view(&self, mac: MacAddr, host: &ListedHost, mut record: HostRecord) -> HostView {
        if let Some(op) = record.operation.as_mut() {
            op.token_hash = None;
        }
        HostView {
            name: host.name.clone(),
            mac: mac.to_string(),
            profile: host.profile.clone(),
            state: record.state(),
            bmc: host.bmc.as_ref().map(|b| b.address.to_string()),
            ssh: host.ssh.as_ref().map(|s| s.target.address()),
            record,
        }
    }

    async fn action(&self, request: BootRequest) -> Option<BootAction> {
        let Some(host) = self.hosts.get(&request.mac) else { return self.default.clone() };
        let Some(ops) = &self.operations else { return Some(host.action.clone()) };
        let pending = ops
            .records
            .lock()
            .expect("records lock")
            .get(&request.mac)
            .is_some_and(|r| r.operation.is_some());
        // A host reached over SSH boots its profile whatever it runs: its operations need no
        // ramdisk, and none gets a token.
        let Some(ramdisk) = ops.ramdisk.as_ref().filter(|_| pending && host.ssh.is_none()) else {
            return Some(host.action.clone());
        };
        if !request.remote_holds_mac {
            tracing::warn!(mac = %request.mac, remote = %request.remote, host = %host.name, "boot script asked for by an address that does not hold this MAC; no token issued");
            return Some(ramdisk_boot(ramdisk, None));
        }
        if let Err(why) = request.segment.confirm(request.remote, request.mac).await {
            tracing::warn!(mac = %request.mac, remote = %request.remote, host = %host.name, %why, "boot script asked for by an address the segment does not confirm as this MAC's; no token issued");
            return Some(ramdisk_boot(ramdisk, None));
        }
        let issued =
            ops.update(request.mac, true, |r| r.issue_token(request.remote, now()).ok_or(()));
        match issued {
            Ok((_, (token, operation))) => {
                tracing::info!(mac = %request.mac, host = %host.name, %operation, "issued a ramdisk token");
                Some(ramdisk_boot(ramdisk, Some((&token, &operation))))
            }
            Err(Ok(())) => {
                tracing::warn!(mac = %request.mac, remote = %request.remote, host = %host.name, "boot script asked for after the operation's bootstrap data was delivered; no new token");
                Some(ramdisk_boot(ramdisk, None))
            }
            Err(Err(e)) => {
                tracing::error!(host = %host.name, error = %e, "cannot issue a ramdisk token");
                None
            }
        }
    }

    async fn agent_request(&self, req: AgentRequest) -> AgentResponse {
        let Some(ops) = &self.operations else {
            return AgentResponse::text(
                StatusCode::NOT_FOUND,
                "no host operations here (the config has no ramdisk_profile)\n",
            );
        };
        serve::answer(&FileRecords { hosts: &self.hosts, ops }, &req).await
    }
}

/// Records what a pass over SSH found for operation `id` of host `host`, unless the operation
/// ended meanwhile (cancelled): the data's run seen started, the step it is at (written when
/// it changes), or how it ended.
fn record_pass(ops: &Operations, mac: MacAddr, host: &ListedHost, id: &str, pass: Pass) {
    let current = ops.records.lock().expect("records lock").get(&mac).cloned().unwrap_or_default();
    let persist = match (&pass, current.operation.as_ref()) {
        (Pass::Going { step, delivered }, Some(op)) => {
            op.step.as_deref() != Some(step.as_str()) || op.bootstrap_delivered != *delivered
        }
        _ => true,
    };
    let delivered = pass.delivered();
    let recorded = ops.update(mac, persist, |r| {
        let op = r.operation.as_mut().filter(|op| op.id == id).ok_or(())?;
        op.bootstrap_delivered |= delivered;
        match &pass {
            Pass::Going { step, .. } => r.progress(step.clone(), None, now()),
            Pass::Kexeced { step } => {
                op.network_boot = Some(step.clone());
                r.progress(step.clone(), None, now());
            }
            Pass::Done { ok, message, hardware, installed, .. } => {
                let installed = installed.as_ref().map(|(url, sum)| (url.as_str(), sum.as_str()));
                r.finish(*ok, message.clone(), hardware.as_deref().cloned(), installed, now());
            }
        }
        Ok(())
    });
    match (recorded, pass) {
        (Err(Ok(())), _) => {} // Ended meanwhile.
        (Err(Err(e)), _) => {
            tracing::error!(host = %host.name, error = %e, "cannot record an operation over SSH; tried again at the next pass")
        }
        (Ok(_), Pass::Going { step, .. } | Pass::Kexeced { step }) if persist => {
            tracing::info!(host = %host.name, %mac, operation = %id, "{step}")
        }
        (Ok(_), Pass::Going { .. } | Pass::Kexeced { .. }) => {}
        (Ok((record, ())), Pass::Done { ok, message, .. }) => {
            let state = record.state();
            if ok {
                tracing::info!(host = %host.name, %mac, operation = %id, %state, "{message}; operation over SSH succeeded")
            } else {
                tracing::warn!(host = %host.name, %mac, operation = %id, %state, "{message}; operation over SSH failed")
            }
        }
    }
}

/// How often a host reached over SSH is looked at while its operation goes on.
const SSH_PASS_EVERY: Duration = Duration::from_secs(5);
/// Seconds between two writes of one step's progress.
const PROGRESS_WRITE_SECS: u64 = 5;
/// How often operations are checked for a silent ramdisk, at the most.
const SILENCE_CHECK: Duration = Duration::from_secs(30);

type Failure = serve::Failure<StoreError>;

/// A refusal or a store error, from [`Operations::update`].
fn flatten(e: Result<Refusal, StoreError>) -> Failure {
    match e {
        Ok(refusal) => refusal.into(),
        Err(e) => Failure::Store(e),
    }
}

/// Standalone mode's records: a file per listed host (`<state_dir>/hosts/`), kept in memory.
/// A host is the listed one whose MAC holds the request's address.
struct FileRecords<'a> {
    hosts: &'a HashMap<MacAddr, ListedHost>,
    ops: &'a Operations,
}

impl<'a> FileRecords<'a> {
    fn provisioning(host: &ListedHost) -> Result<&Provisioning, Refusal> {
        host.provisioning.as_ref().ok_or(Refusal::NoOperation)
    }
}

impl<'a> Records for FileRecords<'a> {
    type Host = (MacAddr, &'a ListedHost);
    type Error = StoreError;

    /// The listed host whose MAC holds the request's address, else the one whose kexec token
    /// the request carries: a ramdisk kexec'ed over SSH may ask from an address this appliance
    /// knows no MAC of (a routed segment, a NAT).
    async fn host(&self, req: &AgentRequest) -> Result<Self::Host, Failure> {
        let listed = req.remote_mac.and_then(|mac| self.hosts.get_key_value(&mac));
        let kexeced = || {
            let mac = self.ops.out_of_band_holder(req.token.as_deref()?)?;
            self.hosts.get_key_value(&mac)
        };
        match listed.or_else(kexeced) {
            Some((mac, host)) => Ok((*mac, host)),
            None if req.remote_mac.is_none() => Err(Refusal::UnknownAddress.into()),
            None => Err(Refusal::UnknownHost.into()),
        }
    }

    fn name(&self, (_, host): &Self::Host) -> String {
        host.name.clone()
    }

    fn authenticate(&self, req: &AgentRequest, (mac, _): &Self::Host) -> Result<Opened, Refusal> {
        let op = self.ops.authenticated(*mac, req)?;
        Ok(Opened {
            id: op.id,
            kind: op.kind,
            bootstrap_delivered: op.bootstrap_delivered,
            out_of_band: op.out_of_band,
        })
    }

    /// Boot again for an operation's token (none comes once its bootstrap data went out:
    /// booting again would only loop), or, just provisioned, into the disk.
    fn boots_again(&self, (mac, _): &Self::Host) -> bool {
        self.ops.records.lock().expect("records lock").get(mac).is_some_and(|r| {
            let pending = r.operation.as_ref().is_some_and(|op| !op.bootstrap_delivered);
            pending || r.installed.is_some()
        })
    }

    fn wipe(&self, (_, host): &Self::Host) -> WipePolicy {
        host.wipe
    }

    fn images(&self) -> Option<&ImageService> {
        Some(&self.ops.images)
    }

    /// The config's: only the operator edits it.
    async fn image(
        &self,
        _: &AgentRequest,
        (_, host): &Self::Host,
        _: &Opened,
    ) -> Result<Image, Failure> {
        Ok(Self::provisioning(host)?.image.clone())
    }

    async fn target(&self, (_, host): &Self::Host, op: &Opened) -> Result<Target, Failure> {
        Ok(Target {
            hints: Self::provisioning(host)?.root_device_hints.clone(),
            meta_data: MetaData {
                instance_id: op.id.clone(),
                local_hostname: Some(host.name.clone()),
                provider_id: Some(provider_id(&host.name)),
            },
        })
    }

    /// The host's `user_data` file, read as it is asked for (empty without one).
    async fn bootstrap_data(
        &self,
        (_, host): &Self::Host,
        _: &Opened,
    ) -> Result<Option<BootstrapData>, Failure> {
        let data = match &Self::provisioning(host)?.user_data {
            None => Vec::new(),
            Some(path) => match std::fs::read(path) {
                Ok(data) => data,
                Err(e) => {
                    tracing::error!(host = %host.name, file = %path.display(), error = %e, "cannot read the host's user_data");
                    return Ok(None);
                }
            },
        };
        Ok(Some(BootstrapData {
            content_type: "text/cloud-config",
            data: bytes::Bytes::from(data),
        }))
    }

    async fn deliver(
        &self,
        req: &AgentRequest,
        (mac, _): &Self::Host,
        _: &Opened,
    ) -> Result<(), Failure> {
        let ops = self.ops;
        ops.update(*mac, true, |r| {
            r.authenticate(req.token.as_deref(), req.remote, now(), ops.max_age())?;
            r.deliver_bootstrap()
        })
        .map_err(flatten)?;
        Ok(())
    }

    /// A ramdisk reports every second or so: the record is written when the step changes or
    /// every few seconds, the rest kept in memory.
    async fn progress(
        &self,
        req: &AgentRequest,
        step: String,
        bytes: Option<ByteCount>,
    ) -> Result<(), Failure> {
        let (mac, _) = self.host(req).await?;
        let ops = self.ops;
        let op = ops.authenticated(mac, req)?;
        let persist = op.step.as_deref() != Some(step.as_str())
            || op.last_heard.is_none_or(|t| now().saturating_sub(t) >= PROGRESS_WRITE_SECS);
        ops.update(mac, persist, |r| {
            r.authenticate(req.token.as_deref(), req.remote, now(), ops.max_age())?;
            r.progress(step, bytes, now());
            Ok::<_, Refusal>(())
        })
        .map_err(flatten)?;
        Ok(())
    }

    async fn finish(
        &self,
        req: &AgentRequest,
        kind: OperationKind,
        ok: bool,
        message: String,
        hardware: Option<Hardware>,
    ) -> Result<(), Failure> {
        let (mac, host) = self.host(req).await?;
        let image =
            host.provisioning.as_ref().map(|p| (p.image.url.as_str(), p.image.checksum.as_str()));
        self.ops.finish(mac, req, kind, ok, message, hardware, image)
    }

    async fn report(&self, (_, host): &Self::Host, reason: &'static str, note: String) {
        tracing::warn!(host = %host.name, reason, "{note}");
    }
}

impl Operations {
    fn max_age(&self) -> u64 {
        self.token_max_age.as_secs()
    }

    /// Applies `change` to a copy of `mac`'s record; if it succeeds, writes the copy (when
    /// `persist`) and only then makes it the record. Returns the record as it now is, with
    /// what `change` returned.
    fn update<T, E>(
        &self,
        mac: MacAddr,
        persist: bool,
        change: impl FnOnce(&mut HostRecord) -> Result<T, E>,
    ) -> Result<(HostRecord, T), Result<E, StoreError>> {
        let mut records = self.records.lock().expect("records lock");
        let current = records.get(&mac).cloned().unwrap_or_default();
        let mut next = current.clone();
        let value = change(&mut next).map_err(Ok)?;
        if persist && next != current {
            self.store.save(mac, &next).map_err(Err)?;
        }
        records.insert(mac, next.clone());
        Ok((next, value))
    }

    /// The host whose operation's token went out of band (a kexec's) and is `token`.
    fn out_of_band_holder(&self, token: &str) -> Option<MacAddr> {
        let records = self.records.lock().expect("records lock");
        records.iter().find_map(|(mac, r)| {
            let op = r.operation.as_ref().filter(|op| op.out_of_band)?;
            token::matches(token, op.token_hash.as_deref()?).then_some(*mac)
        })
    }

    /// The operation `req`'s token acts for (with whether one is under way at all).
    fn authenticated(
        &self,
        mac: MacAddr,
        req: &AgentRequest,
    ) -> Result<crate::operations::Operation, Refusal> {
        let records = self.records.lock().expect("records lock");
        let record = records.get(&mac).ok_or(Refusal::NoOperation)?;
        let op = record.authenticate(req.token.as_deref(), req.remote, now(), self.max_age())?;
        Ok(op.clone())
    }

    /// Ends `mac`'s operation of kind `kind` (checked again on the record it writes); a
    /// successful provisioning installed `image` (`(url, checksum)`).
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        mac: MacAddr,
        req: &AgentRequest,
        kind: OperationKind,
        ok: bool,
        message: String,
        hardware: Option<Hardware>,
        image: Option<(&str, &str)>,
    ) -> Result<(), Failure> {
        let (record, id) = self
            .update(mac, true, |r| {
                let op = r.authenticate(req.token.as_deref(), req.remote, now(), self.max_age())?;
                if op.kind != kind {
                    return Err(Refusal::WrongOperation(op.kind));
                }
                let id = op.id.clone();
                r.finish(ok, message, hardware, image, now());
                Ok(id)
            })
            .map_err(flatten)?;
        self.images.release(&id);
        if let Some(last) = &record.last {
            tracing::info!(%mac, operation = %last.operation, kind = ?last.kind, ok, message = %last.message, state = %record.state(), "ramdisk finished an operation");
        }
        Ok(())
    }
}

/// The providerID a provisioned host's meta-data gives it.
pub fn provider_id(name: &str) -> String {
    format!("siteboot://standalone/{name}")
}

/// One host as `siteboot host` shows it (no token hash, no BMC credentials).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct HostView {
    pub name: String,
    pub mac: String,
    pub profile: String,
    pub state: String,
    /// Its BMC's address, if it has one.
    pub bmc: Option<String>,
    /// Its SSH server's address, if its operations go over SSH.
    #[serde(default)]
    pub ssh: Option<String>,
    pub record: HostRecord,
}

impl Inventory for StaticInventory {
    fn boots(&self, mac: MacAddr) -> bool {
        self.hosts.contains_key(&mac) || self.default.is_some()
    }

    /// Listed under `hosts`: `unknown_hosts` does not make a MAC known.
    fn knows(&self, mac: MacAddr) -> bool {
        self.hosts.contains_key(&mac)
    }

    fn relay_pin(&self, mac: MacAddr) -> Option<RelayPin> {
        self.hosts.get(&mac)?.relay_pin.clone()
    }

    fn boot_action(&self, request: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
        Box::pin(self.action(request))
    }

    /// The hosts under `hosts`: the profile each boots, or its operation.
    fn hosts(&self) -> Vec<HostSummary> {
        self.hosts
            .iter()
            .map(|(mac, host)| {
                let record = self.record(*mac);
                let state = match (&record.operation, &record.installed, record.wipe_required) {
                    (None, None, false) => format!("profile {}", host.profile),
                    _ => format!("{} (profile {})", record.state(), host.profile),
                };
                HostSummary {
                    mac: *mac,
                    name: Some(host.name.clone()),
                    state,
                    address: host.reservation.as_ref().map(|r| r.address),
                    claim: None,
                    operation: record.operation.map(|op| OperationSummary {
                        kind: format!("{:?}", op.kind),
                        step: op.step,
                        bytes: op.bytes.map(|b| ByteProgress { done: b.done, total: b.total }),
                    }),
                }
            })
            .collect()
    }

    fn agent(&self, request: AgentRequest) -> BoxFuture<'_, AgentResponse> {
        Box::pin(self.agent_request(request))
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use siteboot_boot::Endpoints;
    use siteboot_boot::arp_probe::Unconfirmed;
    use siteboot_boot::inventory::{Confirm, LocalBoot, Segment, Source};
    use siteboot_ipxe::Word;

    use super::*;

    const HOST: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 5);

    fn mac() -> MacAddr {
        "52:54:00:00:00:01".parse().unwrap()
    }

    /// One listed host (`node-a`, booting the local disk) with operations on, its records in
    /// `dir`.
    fn inventory(dir: &std::path::Path) -> StaticInventory {
        inventory_with(dir, None)
    }

    /// [`inventory`], its host reached over SSH if `ssh` says so.
    fn inventory_with(dir: &std::path::Path, ssh: Option<HostSsh>) -> StaticInventory {
        let host = ListedHost {
            action: BootAction::LocalDisk(LocalBoot::Exit),
            profile: "disk".into(),
            name: "node-a".into(),
            reservation: None,
            provisioning: None,
            wipe: WipePolicy::Quick,
            bmc: None,
            ssh,
            relay_pin: None,
        };
        let mut inventory = StaticInventory::new(HashMap::from([(mac(), host)]), None);
        let ramdisk = LinuxBoot {
            kernel: Source::File(Word::new("vmlinuz").unwrap()),
            initrds: vec![],
            cmdline: vec![],
        };
        let cache = siteboot_image_cache::Cache::open(&dir.join("images"), 1 << 20).unwrap();
        let endpoints = Endpoints { address: Ipv4Addr::new(10, 0, 0, 1), http_port: 8080 };
        let images = Arc::new(ImageService::new(cache, endpoints));
        let store = Store::open(dir).unwrap();
        let (hour, minute) = (Duration::from_secs(3600), Duration::from_secs(60));
        inventory.enable_operations(store, (Some(ramdisk), None), images, hour, minute).unwrap();
        inventory
    }

    /// SSH access to the server at 10.0.0.5.
    fn ssh_access() -> HostSsh {
        let key =
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEwlXB8lkkHcwFYCSCopHZP7EL7EaFMGYyYTWBLhWrBu";
        HostSsh {
            target: siteboot_ssh::Target::new("10.0.0.5", 22, "root").unwrap(),
            private_key_file: "/k".into(),
            host_key: key.parse().unwrap(),
            user_data: None,
        }
    }

    /// The segment's answer, whatever it is asked.
    struct Answers(Result<(), Unconfirmed>);

    impl Confirm for Answers {
        fn confirm(&self, _: Ipv4Addr, _: MacAddr) -> BoxFuture<'_, Result<(), Unconfirmed>> {
            let answer = self.0;
            Box::pin(async move { answer })
        }
    }

    fn confirmed() -> Segment {
        Segment(Arc::new(Answers(Ok(()))))
    }

    fn boot(inventory: &StaticInventory, remote_holds_mac: bool) -> Vec<String> {
        boot_confirmed(inventory, remote_holds_mac, confirmed())
    }

    fn boot_confirmed(
        inventory: &StaticInventory,
        remote_holds_mac: bool,
        segment: Segment,
    ) -> Vec<String> {
        let request = BootRequest { mac: mac(), remote: HOST, remote_holds_mac, segment };
        match block_on(inventory.action(request)) {
            Some(BootAction::Linux(linux)) => {
                linux.cmdline.iter().map(|w| w.as_str().to_owned()).collect()
            }
            other => vec![format!("{other:?}")],
        }
    }

    fn agent(
        inventory: &StaticInventory,
        method: http::Method,
        path: &str,
        token: Option<&str>,
        remote_mac: Option<MacAddr>,
    ) -> (u16, String) {
        let request = AgentRequest {
            method,
            path: path.into(),
            token: token.map(str::to_owned),
            remote: HOST,
            remote_mac,
            segment: confirmed(),
            body: bytes::Bytes::from_static(b"{\"cpus\": 2}"),
        };
        let response = block_on(inventory.agent_request(request));
        (response.status.as_u16(), String::from_utf8_lossy(&response.body).into_owned())
    }

    fn block_on<T>(work: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(work)
    }

    #[test]
    fn the_ramdisk_gets_a_token_only_while_an_operation_waits_and_only_from_its_address() {
        let dir = tempfile::tempdir().unwrap();
        let inventory = inventory(dir.path());
        assert_eq!(boot(&inventory, true), vec!["Some(LocalDisk(Exit))".to_owned()], "its profile");
        block_on(inventory.start("node-a", OperationKind::Inspect)).unwrap();
        let stranger = boot(&inventory, false);
        assert!(stranger.iter().all(|a| !a.starts_with("siteboot.token=")), "{stranger:?}");
        // The tables name the MAC, but the ARP probe finds a planted entry.
        let planted = Segment(Arc::new(Answers(Err(Unconfirmed::Conflict { other: mac() }))));
        let planted = boot_confirmed(&inventory, true, planted);
        assert!(planted.iter().all(|a| !a.starts_with("siteboot.token=")), "{planted:?}");
        let args = boot(&inventory, true);
        let token = args.iter().find_map(|a| a.strip_prefix("siteboot.token=")).unwrap();

        // The same refusals as Kubernetes mode.
        let get = http::Method::GET;
        let post = http::Method::POST;
        let other: MacAddr = "52:54:00:00:00:02".parse().unwrap();
        for (mac, token, path, expected) in [
            (None, Some(token), "v1/task", (403, "refused: no MAC is known for this address\n")),
            (Some(other), Some(token), "v1/task", (403, "refused: no Host has this MAC\n")),
            (Some(mac()), Some("00"), "v1/inspection", (403, "refused: wrong token\n")),
            (Some(mac()), None, "v1/inspection", (401, "refused: no token\n")),
            (Some(mac()), Some(token), "v1/complete", (400, "")),
        ] {
            let method = if path == "v1/task" { get.clone() } else { post.clone() };
            let (status, body) = agent(&inventory, method, path, token, mac);
            assert_eq!(status, expected.0, "{path}: {body}");
            if !expected.1.is_empty() {
                assert_eq!(body, expected.1);
            }
        }
        let (status, body) = agent(&inventory, get.clone(), "v1/task", Some("00"), Some(mac()));
        assert_eq!((status, body.as_str()), (200, r#"{"action":"reboot"}"#), "boot again");
        let (status, body) = agent(&inventory, get.clone(), "v1/task", Some(token), Some(mac()));
        assert_eq!(status, 200);
        assert!(body.contains(r#""action":"inspect""#), "{body}");
        let (status, body) = agent(&inventory, get, "v1/bootstrap", Some(token), Some(mac()));
        assert_eq!((status, body.as_str()), (403, "refused: not allowed during Inspect\n"));
        let (status, _) = agent(&inventory, post, "v1/inspection", Some(token), Some(mac()));
        assert_eq!(status, 200);
        assert_eq!(boot(&inventory, true), vec!["Some(LocalDisk(Exit))".to_owned()], "done");

        // What it found was written, and is read back by the next appliance.
        let again = self::inventory(dir.path());
        let view = again.show("node-a").unwrap();
        assert_eq!(view.record.hardware.map(|h| h.cpus), Some(2));
        assert!(view.record.last.is_some_and(|l| l.ok && l.kind == OperationKind::Inspect));
    }

    /// A host reached over SSH with an image: its ramdisk, kexec'ed with a token that never
    /// crossed the segment, is known by that token from an address with no MAC known here (a
    /// NAT, a routed segment), and only by it; once the kexec started, the silence rule watches
    /// the ramdisk as on any host.
    #[test]
    fn a_kexeced_ramdisk_is_known_by_its_token_from_any_address() {
        let dir = tempfile::tempdir().unwrap();
        let access = ssh_access();
        let mut inventory = inventory_with(dir.path(), Some(access));
        let image = Image {
            url: "http://h/i.raw".into(),
            checksum: format!("sha256:{}", "0".repeat(64)),
            format: None,
            grow_last_partition: false,
        };
        let host = inventory.hosts.get_mut(&mac()).unwrap();
        host.provisioning =
            Some(Provisioning { image, user_data: None, root_device_hints: Default::default() });
        assert!(inventory.has_hosts_reimaged_over_ssh());
        // A wipe: its task needs no image fetched.
        let view = block_on(inventory.start("node-a", OperationKind::Deprovision)).unwrap();
        let id = view.record.operation.unwrap().id;
        let ops = inventory.operations.as_ref().unwrap();
        let get = http::Method::GET;
        let (_, token) =
            ops.update(mac(), true, |r| r.issue_kexec_token(&id, now()).ok_or(())).unwrap();
        let (status, body) = agent(&inventory, get.clone(), "v1/task", Some(&token), None);
        assert_eq!(status, 200, "{body}");
        assert!(body.contains(r#""action":"deprovision""#), "{body}");
        let (status, body) = agent(&inventory, get.clone(), "v1/task", Some("00"), None);
        assert_eq!((status, body.as_str()), (403, "refused: no MAC is known for this address\n"));
        // A token a network boot got is no key without the MAC behind its address.
        let booted = ops.update(mac(), true, |r| r.issue_token(HOST, now()).ok_or(())).unwrap().1.0;
        let (status, _) = agent(&inventory, get, "v1/task", Some(&booted), None);
        assert_eq!(status, 403);

        let step = "kexec over SSH into the ramdisk started".to_owned();
        record_pass(ops, mac(), &inventory.hosts[&mac()], &id, Pass::Kexeced { step });
        let op = inventory.show("node-a").unwrap().record.operation.unwrap();
        assert!(op.network_boot.is_some_and(|b| b.contains("kexec")));
        let silent = ops.update(mac(), false, |r| {
            let op = r.operation.as_mut().unwrap();
            op.token_issued = Some(1);
            op.last_heard = Some(1);
            Ok::<_, ()>(())
        });
        assert!(silent.is_ok());
        inventory.end_silent_operations(ops);
        let last = inventory.show("node-a").unwrap().record.last.unwrap();
        assert!(!last.ok && last.message.contains("ramdisk silent"), "{last:?}");
    }

    /// A host reached over SSH boots its profile while its operation runs (no ramdisk, no
    /// token), and its record follows what the passes found: the data's run seen started
    /// (kept over a restart), a failure after it leaving the host to be reset first, a pass of
    /// an operation that ended meanwhile ignored.
    #[test]
    fn a_host_reached_over_ssh_gets_no_ramdisk_and_its_record_follows_the_passes() {
        let dir = tempfile::tempdir().unwrap();
        let access = ssh_access();
        let inventory = inventory_with(dir.path(), Some(access.clone()));
        let view = block_on(inventory.start("node-a", OperationKind::Provision)).unwrap();
        let op = view.record.operation.unwrap();
        assert_eq!(op.step.as_deref(), Some("connecting over SSH to 10.0.0.5:22"));
        assert_eq!(boot(&inventory, true), vec!["Some(LocalDisk(Exit))".to_owned()], "its profile");
        let pass = |inventory: &StaticInventory, id: &str, pass: Pass| {
            let ops = inventory.operations.as_ref().unwrap();
            record_pass(ops, mac(), &inventory.hosts[&mac()], id, pass);
            inventory.show("node-a").unwrap().record
        };
        let step = "the bootstrap data runs on the server".to_owned();
        let record = pass(&inventory, &op.id, Pass::Going { step, delivered: true });
        assert!(record.operation.is_some_and(|op| op.bootstrap_delivered));

        // Restarted: the delivery is known started.
        let inventory = inventory_with(dir.path(), Some(access));
        let record = inventory.show("node-a").unwrap().record;
        assert!(record.operation.as_ref().is_some_and(|op| op.bootstrap_delivered));
        let failed = Pass::Done {
            ok: false,
            message: "the bootstrap data exited with status 7".into(),
            hardware: None,
            installed: None,
            delivered: true,
        };
        let record = pass(&inventory, &op.id, failed);
        assert_eq!(record.state(), "WipeRequired");
        let again = block_on(inventory.start("node-a", OperationKind::Provision));
        assert!(matches!(again, Err(ControlError::Start(StartError::WipeRequired))), "{again:?}");

        let view = block_on(inventory.start("node-a", OperationKind::Deprovision)).unwrap();
        let reset = Pass::Done {
            ok: true,
            message: "reset over SSH".into(),
            hardware: None,
            installed: None,
            delivered: false,
        };
        let stale = pass(&inventory, &op.id, reset.clone());
        assert_eq!(stale.state(), "Deprovisioning", "a pass of an ended operation");
        let id = view.record.operation.unwrap().id;
        assert_eq!(pass(&inventory, &id, reset).state(), "Available");
    }
}
