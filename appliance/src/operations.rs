//! Standalone host operations (inspect, provision, deprovision): each listed host's record, the
//! rules that move it, and its file under `<state_dir>/hosts/`.
//!
//! A record is written (atomically: a temporary file, fsync, rename, fsync of the directory)
//! before anything that depends on it leaves the appliance: a token's hash before the boot
//! script that carries the token, "bootstrap data delivered" before the data. So killing the
//! appliance at any moment loses nothing a host or the operator was told.

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use siteboot_agent_api::Hardware;
use siteboot_agent_server::silence::{RamdiskContact, ramdisk_silence};
use siteboot_agent_server::{ByteCount, Grant, OperationKind, Refusal, check_token, token};
use siteboot_boot::MacAddr;

/// Seconds since the Unix epoch.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// What siteboot keeps about one listed host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostRecord {
    /// The operation under way, if any.
    #[serde(default)]
    pub operation: Option<Operation>,
    /// How the last operation ended.
    #[serde(default)]
    pub last: Option<Outcome>,
    /// The image the last successful provisioning wrote (until a wipe).
    #[serde(default)]
    pub installed: Option<Installed>,
    /// A provisioning started since the last successful wipe: the disks may hold an OS and its
    /// bootstrap data, so a new provisioning waits for a deprovision.
    #[serde(default)]
    pub wipe_required: bool,
    /// What the last inspection found.
    #[serde(default)]
    pub hardware: Option<Hardware>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Operation {
    pub id: String,
    pub kind: OperationKind,
    pub started: u64,
    /// SHA-256 of the current token; none until the host boots the ramdisk.
    pub token_hash: Option<String>,
    pub token_address: Option<String>,
    pub token_issued: Option<u64>,
    pub bootstrap_delivered: bool,
    /// The ramdisk's last progress report.
    pub step: Option<String>,
    pub bytes: Option<ByteCount>,
    pub last_heard: Option<u64>,
    /// What booted the host into the ramdisk: what its BMC was asked to do, or the kexec over
    /// SSH that started; none for a host that boots from the network by itself.
    #[serde(default)]
    pub network_boot: Option<String>,
    /// The token never crossed the segment: it went in the initrd of a kexec over SSH, to the
    /// server with the pinned host key, so it is bound to no address.
    #[serde(default)]
    pub out_of_band: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Outcome {
    pub operation: String,
    pub kind: OperationKind,
    pub ok: bool,
    pub message: String,
    pub finished: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Installed {
    pub operation: String,
    pub url: String,
    pub checksum: String,
}

/// The last result of an operation the operator cancelled.
pub const CANCELLED: &str = "cancelled by operator";

/// There is no operation under way to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoOperation;

/// Why an operation cannot start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartError {
    /// Another operation is under way.
    Busy { kind: OperationKind, id: String },
    /// The disks may hold an earlier provisioning: deprovision first.
    WipeRequired,
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Busy { kind, id } => write!(f, "operation {id} ({kind:?}) is under way"),
            StartError::WipeRequired => {
                f.write_str("the host was provisioned and not wiped since: deprovision it first")
            }
        }
    }
}

impl HostRecord {
    /// Starts an operation of `kind`, or, if one of that kind is under way, follows it (so
    /// running the same command again is harmless). A provisioning marks the host
    /// wipe-required at once: the disks may be written from its first byte on.
    pub fn start(&mut self, kind: OperationKind, now: u64) -> Result<&Operation, StartError> {
        if let Some(op) = &self.operation {
            if op.kind != kind {
                return Err(StartError::Busy { kind: op.kind, id: op.id.clone() });
            }
        } else {
            if kind == OperationKind::Provision && self.wipe_required {
                return Err(StartError::WipeRequired);
            }
            if kind == OperationKind::Provision {
                self.wipe_required = true;
            }
            self.operation = Some(Operation {
                id: token::operation_id(),
                kind,
                started: now,
                token_hash: None,
                token_address: None,
                token_issued: None,
                bootstrap_delivered: false,
                step: None,
                bytes: None,
                last_heard: None,
                network_boot: None,
                out_of_band: false,
            });
        }
        Ok(self.operation.as_ref().expect("set above"))
    }

    /// A fresh token for the operation under way, bound to `remote`: `(token, operation id)`.
    /// `None` with no operation, or once its bootstrap data was delivered (once per operation
    /// means no new token can fetch it again).
    pub fn issue_token(&mut self, remote: Ipv4Addr, now: u64) -> Option<(String, String)> {
        self.mint(Some(remote), now)
    }

    /// A fresh token for operation `id`, bound to no address: it goes to the server in the
    /// initrd of a kexec over SSH ([`Operation::out_of_band`]). `None` if `id` is not under way
    /// (cancelled meanwhile), or once its bootstrap data was delivered.
    pub fn issue_kexec_token(&mut self, id: &str, now: u64) -> Option<String> {
        self.operation.as_ref().filter(|op| op.id == id)?;
        self.mint(None, now).map(|(token, _)| token)
    }

    fn mint(&mut self, bound_to: Option<Ipv4Addr>, now: u64) -> Option<(String, String)> {
        let op = self.operation.as_mut().filter(|op| !op.bootstrap_delivered)?;
        let (token, hash) = token::mint();
        op.token_hash = Some(hash);
        op.token_address = bound_to.map(|a| a.to_string());
        op.out_of_band = bound_to.is_none();
        op.token_issued = Some(now);
        Some((token, op.id.clone()))
    }

    /// The operation `token`, sent from `remote`, acts for.
    pub fn authenticate(
        &self,
        token: Option<&str>,
        remote: Ipv4Addr,
        now: u64,
        max_age_secs: u64,
    ) -> Result<&Operation, Refusal> {
        let grant = self.operation.as_ref().map(|op| Grant {
            token_hash: op.token_hash.as_deref(),
            address: op.token_address.as_deref(),
            out_of_band: op.out_of_band,
            fresh: op.token_issued.is_some_and(|t| now.saturating_sub(t) <= max_age_secs),
        });
        check_token(token, grant, remote)?;
        Ok(self.operation.as_ref().expect("checked: an operation"))
    }

    /// Marks the operation's bootstrap data delivered; refused if it is not a provisioning or
    /// the data already went out.
    pub fn deliver_bootstrap(&mut self) -> Result<(), Refusal> {
        let op = self.operation.as_mut().ok_or(Refusal::NoOperation)?;
        if op.kind != OperationKind::Provision {
            return Err(Refusal::WrongOperation(op.kind));
        }
        if op.bootstrap_delivered {
            return Err(Refusal::Replayed);
        }
        op.bootstrap_delivered = true;
        Ok(())
    }

    /// Records a progress report.
    pub fn progress(&mut self, step: String, bytes: Option<ByteCount>, now: u64) {
        if let Some(op) = self.operation.as_mut() {
            op.step = Some(step);
            op.bytes = bytes;
            op.last_heard = Some(now);
        }
    }

    /// Ends the operation under way: a successful provisioning installed `image`
    /// (`(url, checksum)`), a successful deprovisioning wiped the disks, an inspection
    /// recorded `hardware`. An operation that did not succeed (failed, cancelled, silent)
    /// changes what is known of the disks only by whether its ramdisk booted (took a token):
    /// a provisioning whose ramdisk never booted wrote nothing, so the host needs no wipe for
    /// it; one that booted may have written part of a disk, so the host stays wipe-required;
    /// a deprovisioning whose ramdisk booted may have wiped part of the installed OS, so the
    /// host is no longer provisioned.
    pub fn finish(
        &mut self,
        ok: bool,
        message: String,
        hardware: Option<Hardware>,
        image: Option<(&str, &str)>,
        now: u64,
    ) -> Option<&Outcome> {
        let op = self.operation.take()?;
        // A host adopted over SSH boots no ramdisk: its data's run started stands for it.
        let booted = op.token_issued.is_some() || op.bootstrap_delivered;
        match (op.kind, ok) {
            (OperationKind::Inspect, true) => self.hardware = hardware.or(self.hardware.take()),
            (OperationKind::Provision, true) => {
                self.installed = image.map(|(url, checksum)| Installed {
                    operation: op.id.clone(),
                    url: url.to_owned(),
                    checksum: checksum.to_owned(),
                });
            }
            (OperationKind::Deprovision, true) => {
                self.installed = None;
                self.wipe_required = false;
            }
            // A provisioning starts only on a host that needs no wipe (see `start`).
            (OperationKind::Provision, false) if !booted => self.wipe_required = false,
            (OperationKind::Deprovision, false) if booted => self.installed = None,
            (_, false) => {}
        }
        self.last = Some(Outcome { operation: op.id, kind: op.kind, ok, message, finished: now });
        self.last.as_ref()
    }

    /// Ends the operation under way as the operator asked: its token stops working at once.
    pub fn cancel(&mut self, now: u64) -> Result<&Outcome, NoOperation> {
        if self.operation.is_none() {
            return Err(NoOperation);
        }
        Ok(self.finish(false, CANCELLED.to_owned(), None, None, now).expect("an operation"))
    }

    /// Ends the operation under way as failed if its ramdisk has been silent for more than
    /// `max_silence` (the rule Kubernetes mode quarantines by).
    pub fn end_if_silent(&mut self, now: u64, max_silence: Duration) -> Option<&Outcome> {
        let op = self.operation.as_ref()?;
        let seconds = |t: Option<u64>| t.and_then(|t| i64::try_from(t).ok());
        let contact = RamdiskContact {
            kind: op.kind,
            id: &op.id,
            token_issued: seconds(op.token_issued),
            last_heard: seconds(op.last_heard),
            step: op.step.as_deref(),
        };
        let message = ramdisk_silence(&contact, i64::try_from(now).ok()?, max_silence)?;
        self.finish(false, message, None, None, now)
    }

    /// The state an operator reads: the operation under way, else what is on the disks.
    pub fn state(&self) -> String {
        match (&self.operation, &self.installed) {
            (Some(op), _) => match op.kind {
                OperationKind::Inspect => "Inspecting".to_owned(),
                OperationKind::Provision => "Provisioning".to_owned(),
                OperationKind::Deprovision => "Deprovisioning".to_owned(),
            },
            (None, Some(_)) => "Provisioned".to_owned(),
            (None, None) if self.wipe_required => "WipeRequired".to_owned(),
            (None, None) => "Available".to_owned(),
        }
    }
}

/// The host records under `<state_dir>/hosts/`, one JSON file per MAC.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
}

impl Store {
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = state_dir.join("hosts");
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
        Ok(Self { dir })
    }

    fn path(&self, mac: MacAddr) -> PathBuf {
        self.dir.join(format!("{}.json", mac.hyphenated()))
    }

    /// `mac`'s record; a host never seen has an empty one.
    pub fn load(&self, mac: MacAddr) -> Result<HostRecord, StoreError> {
        let path = self.path(mac);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| StoreError { path, message: e.to_string() }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(HostRecord::default()),
            Err(e) => Err(StoreError { path, message: e.to_string() }),
        }
    }

    /// Writes `mac`'s record atomically and durably.
    pub fn save(&self, mac: MacAddr, record: &HostRecord) -> Result<(), StoreError> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.path(mac);
        let tmp = path.with_extension("json.tmp");
        let error = |e: std::io::Error| StoreError { path: path.clone(), message: e.to_string() };
        let text = serde_json::to_vec_pretty(record).expect("a record serializes");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(error)?;
        file.write_all(&text).and_then(|()| file.sync_all()).map_err(error)?;
        std::fs::rename(&tmp, &path).map_err(error)?;
        std::fs::File::open(&self.dir).and_then(|d| d.sync_all()).map_err(error)
    }
}

#[derive(Debug)]
pub struct StoreError {
    pub path: PathBuf,
    pub message: String,
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "host record {}: {}", self.path.display(), self.message)
    }
}

impl std::error::Error for StoreError {}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: u64 = 3600;

    fn remote() -> Ipv4Addr {
        "10.0.0.5".parse().unwrap()
    }

    #[test]
    fn a_provisioning_runs_once_with_one_token_per_boot_and_data_once() {
        let mut record = HostRecord::default();
        let id = record.start(OperationKind::Provision, 100).unwrap().id.clone();
        assert!(record.wipe_required, "wipe-required from the start");
        assert_eq!(record.start(OperationKind::Provision, 101).unwrap().id, id, "follows");
        assert!(matches!(
            record.start(OperationKind::Deprovision, 101),
            Err(StartError::Busy { kind: OperationKind::Provision, .. })
        ));
        let (old, _) = record.issue_token(remote(), 100).unwrap();
        let (token, op) = record.issue_token(remote(), 110).unwrap();
        assert_eq!(op, id);
        assert_eq!(
            record.authenticate(Some(&old), remote(), 110, HOUR).unwrap_err(),
            Refusal::WrongToken,
            "a new boot's token replaces the old one"
        );
        assert_eq!(record.authenticate(Some(&token), remote(), 110, HOUR).unwrap().id, id);
        let elsewhere = "10.0.0.9".parse().unwrap();
        assert_eq!(
            record.authenticate(Some(&token), elsewhere, 110, HOUR).unwrap_err(),
            Refusal::WrongAddress
        );
        assert_eq!(
            record.authenticate(Some(&token), remote(), 110 + HOUR + 1, HOUR).unwrap_err(),
            Refusal::Expired
        );
        assert_eq!(record.deliver_bootstrap(), Ok(()));
        assert_eq!(record.deliver_bootstrap(), Err(Refusal::Replayed));
        assert_eq!(record.issue_token(remote(), 120), None, "no token after the data went out");
        record.progress("writing image".into(), Some(ByteCount { done: 5, total: 10 }), 121);
        assert_eq!(record.state(), "Provisioning");
        let outcome = record.finish(true, String::new(), None, Some(("u", "sha256:ab")), 130);
        assert!(outcome.is_some_and(|o| o.ok && o.operation == id));
        assert_eq!(record.state(), "Provisioned");
        assert!(record.operation.is_none());
        assert_eq!(
            record.authenticate(Some(&token), remote(), 131, HOUR).unwrap_err(),
            Refusal::NoOperation
        );
        assert_eq!(record.start(OperationKind::Provision, 140), Err(StartError::WipeRequired));
    }

    /// A kexec's token was never on the segment: it works from whatever address the ramdisk
    /// gets, and only for its own operation; a token later issued to a network boot is bound
    /// to its address again.
    #[test]
    fn a_kexec_token_is_bound_to_no_address_and_only_to_its_operation() {
        let mut record = HostRecord::default();
        let id = record.start(OperationKind::Provision, 1).unwrap().id.clone();
        assert_eq!(record.issue_kexec_token("another", 2), None);
        let token = record.issue_kexec_token(&id, 2).unwrap();
        let elsewhere = Ipv4Addr::new(10, 0, 2, 15);
        let op = record.authenticate(Some(&token), elsewhere, 3, HOUR).unwrap();
        assert!(op.out_of_band && op.token_address.is_none());
        assert_eq!(
            record.authenticate(Some("wrong"), elsewhere, 3, HOUR).unwrap_err(),
            Refusal::WrongToken
        );
        let (booted, _) = record.issue_token(remote(), 4).unwrap();
        assert_eq!(
            record.authenticate(Some(&booted), elsewhere, 5, HOUR).unwrap_err(),
            Refusal::WrongAddress
        );
        record.deliver_bootstrap().unwrap();
        assert_eq!(record.issue_kexec_token(&id, 6), None, "no token after the data went out");
    }

    #[test]
    fn only_a_successful_wipe_clears_wipe_required() {
        let mut record = HostRecord::default();
        record.start(OperationKind::Provision, 1).unwrap();
        record.issue_token(remote(), 1).unwrap();
        record.finish(false, "digest mismatch".into(), None, Some(("u", "c")), 2);
        assert!(record.wipe_required && record.installed.is_none());
        assert_eq!(record.state(), "WipeRequired");
        record.start(OperationKind::Deprovision, 3).unwrap();
        assert_eq!(
            record.deliver_bootstrap(),
            Err(Refusal::WrongOperation(OperationKind::Deprovision))
        );
        record.finish(false, "disk gone".into(), None, None, 4);
        assert!(record.wipe_required, "a failed wipe wiped nothing for sure");
        record.start(OperationKind::Deprovision, 5).unwrap();
        record.finish(true, String::new(), None, None, 6);
        assert!(!record.wipe_required);
        assert_eq!(record.state(), "Available");
        assert!(record.start(OperationKind::Provision, 7).is_ok());
    }

    #[test]
    fn a_cancelled_provisioning_revokes_its_token_and_is_not_provisioned() {
        let mut record = HostRecord::default();
        record.start(OperationKind::Provision, 1).unwrap();
        let (token, _) = record.issue_token(remote(), 2).unwrap();
        record.deliver_bootstrap().unwrap();
        let outcome = record.cancel(3).unwrap().clone();
        assert!(!outcome.ok && outcome.message == CANCELLED, "{outcome:?}");
        assert_eq!(
            record.authenticate(Some(&token), remote(), 4, HOUR).unwrap_err(),
            Refusal::NoOperation
        );
        assert!(record.installed.is_none());
        assert_eq!(record.state(), "WipeRequired", "its ramdisk may have written the disk");
        assert_eq!(record.cancel(5), Err(NoOperation));
    }

    #[test]
    fn what_an_unfinished_operation_leaves_depends_on_whether_its_ramdisk_booted() {
        // Never booted: nothing was written, nothing wiped.
        let mut record = HostRecord::default();
        record.start(OperationKind::Provision, 1).unwrap();
        record.cancel(2).unwrap();
        assert_eq!(record.state(), "Available");
        record.start(OperationKind::Provision, 3).unwrap();
        record.issue_token(remote(), 4).unwrap();
        record.finish(true, String::new(), None, Some(("u", "c")), 5);
        record.start(OperationKind::Deprovision, 6).unwrap();
        record.finish(false, "the BMC refused".into(), None, None, 7);
        assert_eq!(record.state(), "Provisioned", "the wipe never began");
        // Booted: the wipe may have begun, the OS may be gone.
        record.start(OperationKind::Deprovision, 8).unwrap();
        record.issue_token(remote(), 9).unwrap();
        record.cancel(10).unwrap();
        assert!(record.installed.is_none() && record.wipe_required);
        assert_eq!(record.state(), "WipeRequired");
    }

    #[test]
    fn a_ramdisk_that_booted_and_fell_silent_ends_its_operation() {
        let minute = Duration::from_secs(60);
        let mut record = HostRecord::default();
        let id = record.start(OperationKind::Provision, 1000).unwrap().id.clone();
        assert_eq!(record.end_if_silent(100_000, minute), None, "never booted: it waits");
        let (token, _) = record.issue_token(remote(), 2000).unwrap();
        assert_eq!(record.end_if_silent(2060, minute), None);
        record.progress("writing image".into(), None, 2050);
        assert_eq!(record.end_if_silent(2110, minute), None, "a report restarts the count");
        let outcome = record.end_if_silent(2111, minute).unwrap().clone();
        assert!(!outcome.ok);
        assert_eq!(
            outcome.message,
            format!(
                "ramdisk silent for more than 1m during Provision operation {id} (its last step: writing image)"
            )
        );
        assert_eq!(
            record.authenticate(Some(&token), remote(), 2112, HOUR).unwrap_err(),
            Refusal::NoOperation,
            "a late ramdisk's token is refused"
        );
        assert_eq!(record.state(), "WipeRequired");
        assert_eq!(record.end_if_silent(3000, minute), None, "nothing left to end");
    }

    #[test]
    fn an_inspection_keeps_the_hardware_found() {
        let mut record = HostRecord::default();
        record.start(OperationKind::Inspect, 1).unwrap();
        let hardware = Hardware { cpus: 4, ..Default::default() };
        record.finish(true, String::new(), Some(hardware.clone()), None, 2);
        assert_eq!(record.hardware, Some(hardware));
        assert!(!record.wipe_required);
    }

    #[test]
    fn records_survive_a_round_trip_and_a_torn_write_leaves_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let mac: MacAddr = "52:54:00:00:00:01".parse().unwrap();
        assert_eq!(store.load(mac).unwrap(), HostRecord::default());
        let mut record = HostRecord::default();
        record.start(OperationKind::Provision, 1).unwrap();
        record.issue_token(remote(), 2).unwrap();
        record.deliver_bootstrap().unwrap();
        store.save(mac, &record).unwrap();
        assert_eq!(store.load(mac).unwrap(), record);
        // A crash while writing leaves a temporary file, never a half-written record.
        std::fs::write(dir.path().join("hosts/52-54-00-00-00-01.json.tmp"), b"{\"oper").unwrap();
        assert_eq!(Store::open(dir.path()).unwrap().load(mac).unwrap(), record);
        std::fs::write(dir.path().join("hosts/52-54-00-00-00-01.json"), b"{").unwrap();
        assert!(store.load(mac).is_err(), "a corrupt record is an error, not a blank host");
    }
}
