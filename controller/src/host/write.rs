//! What a planned Host [`Step`] does, as data, as `dhcp::server` returns what to send and to
//! record: the writes (which Host, the change, what is said once it landed), what is said
//! whatever they do, and when the Host is looked at again. A step that asks the BMC something
//! takes its [`Answer`] as an input like the Host, so the unit tests assert every write of every
//! step and every answer; the reconciler asks the BMC and performs the outcome.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

use super::lifecycle::{
    self, Deletion, FINALIZER, Fresh, REBOOT_ANNOTATION, RETRY_ANNOTATION, Reboot, Transition,
};
use super::plan::{self, Observed, Step};
use super::record::RECORD_ANNOTATION;
use crate::bmc::{BmcError, Identity};
use crate::conditions::{BMC_READY, BOOT_MAC_UNIQUE, SSH_READY, check_paused};
use crate::context::{Note, finalizer_patch};
use crate::crd::{
    Hardware, Host, HostState, HostStatus, Installed, OperationKind, PowerState, RecordedHostKey,
    WipePolicy, set_condition,
};
use crate::pools::MacStanding;
use crate::ssh::{Endpoint, Reached, SshAccessError};
use siteboot_ssh::adopt::{Progress, Stalled};
use siteboot_ssh::inspect::Report;
use siteboot_ssh::reimage::Kexecuted;

/// How soon a boot or reboot the BMC failed is tried again.
pub const REBOOT_RETRY: Duration = Duration::from_secs(60);
/// How soon an ejection of virtual media (and the boot or power-off after it) the BMC failed is
/// tried again: the same 60 s as [`REBOOT_RETRY`], named apart so either can change alone.
pub const EJECT_RETRY: Duration = Duration::from_secs(60);
/// How soon a Host whose reboot annotation was carried out is looked at again.
const AFTER_REBOOT: Duration = Duration::from_secs(300);

/// What a pass does once its step is chosen and the BMC, if asked, answered.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome<'a> {
    /// Said first, whatever the writes do: what the BMC answered.
    pub note: Option<Note>,
    /// Performed in order. One that does not land (its change no longer applies to the Host as
    /// read again, or the Host changed under its guard) ends the pass: it was planned from a
    /// stale read, and the Host is looked at again at once.
    pub writes: Vec<Write<'a>>,
    pub again: Again,
}

/// When the Host is looked at again once the writes landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Again {
    After(Duration),
    /// Only when it changes.
    OnChange,
}

/// One write of one Host.
#[derive(Debug, Clone, PartialEq)]
pub struct Write<'a> {
    /// The Host as it was read.
    pub target: &'a Host,
    pub change: Change,
    /// Said once it landed.
    pub note: Option<Note>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// The status, computed again on the Host as read just before it is written (and again
    /// after a conflict), so the change always sees what it replaces.
    Status(StatusChange),
    /// A merge patch, written only if the Host is unchanged since it was read.
    Patch(Value),
    /// A merge patch written whatever changed since (an annotation's removal).
    PlainPatch(Value),
}

/// A change of a Host's status; [`StatusChange::apply`] computes it on the Host as it is.
#[derive(Debug, Clone, PartialEq)]
pub enum StatusChange {
    /// The `Paused` condition as the annotation says.
    Paused,
    /// The status rebuilt from the lifecycle record, if the Host still has no state.
    Restore(Box<HostStatus>),
    /// The `BootMACUnique` condition as the standing says.
    Mac(MacStanding),
    /// A lifecycle transition made at `fresh`, if `recheck` still computes it.
    Transit { transition: Transition, fresh: Fresh, recheck: Recheck },
    /// The BMC was asked at `at` to boot the ramdisk of `operation`.
    BootRequested { operation: String, at: Time },
    /// The BMC was asked to boot the disk of `installed` (or refused: the ramdisk reboots).
    DiskBootAsked { installed: Installed },
    /// The `BMCReady` condition from the BMC's answer.
    BmcChecked { ok: bool, reason: &'static str, message: String },
    /// The `SSHReady` condition from the login's result, and the host key to record on first
    /// use (never over one already recorded for that server).
    SshChecked { ok: bool, reason: &'static str, message: String, record: Option<RecordedHostKey> },
    /// The server of an SSH Host inspected for `operation` at `fresh`: its hardware written and
    /// the Host Available, in one write, or (not this Host's machine) `Err`, the quarantine.
    SshInspected { operation: String, fresh: Fresh, result: Box<Result<Hardware, Transition>> },
    /// The delivery of `operation` over SSH seen started on the server (its data left: the
    /// staged copy goes), and, once its run ended, the transition [`lifecycle::delivery_ended`]
    /// made of it at `fresh`.
    SshDelivery { operation: String, fresh: Fresh, ended: Option<Transition> },
    /// The reset of `operation` over SSH done and verified at `fresh`: the host Available.
    SshReset { operation: String, fresh: Fresh },
    /// `carrier` takes `operation`'s ramdisk a token whose hash is `hash`, issued at `at`; the
    /// hash is stored before the media goes in (the kexec starts), so the ramdisk's token works
    /// as soon as it boots. Not once the bootstrap data left: as for a network boot, no new
    /// token then.
    OutOfBandToken { operation: String, hash: String, at: Time, carrier: TokenCarrier },
    /// The kexec of `operation`'s ramdisk was started over SSH at `at` (by this pass, or by one
    /// that died before its record: the server's marker said so).
    KexecStarted { operation: String, at: Time },
    /// The virtual media of an ended operation was ejected.
    MediaEjected,
    /// The BMC's power reading.
    Power(PowerState),
}

/// What takes a token the reconciler minted to the ramdisk, never across the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenCarrier {
    /// Virtual media, through the host's BMC.
    VirtualMedia,
    /// The initrd of a kexec over SSH.
    Kexec,
}

/// Which rule a [`StatusChange::Transit`] is checked against again before it is written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Recheck {
    /// The lifecycle's next transition, or quarantine for a ramdisk gone silent.
    Lifecycle { max_silence: Duration, min_wipe: WipePolicy },
    /// The wipe a deleted Host needs.
    DeletionWipe { min_wipe: WipePolicy },
}

/// What the BMC answered the step that asked it something.
#[derive(Debug)]
pub enum Answer {
    /// Nothing was asked: the step asks the BMC nothing, or the Host has no BMC.
    NotAsked,
    /// A boot, reboot, ejection or power-off: done, or why not.
    Done(Result<(), String>),
    /// The system the BMC manages.
    Identity(Result<Option<Identity>, BmcError>),
    /// The power reading, if the BMC gave one.
    Power(Option<PowerState>),
    /// The SSH login: the server reached, or why not. Nothing was sent to a server whose host
    /// key was not the pinned one.
    Ssh(Result<Reached, SshAccessError>),
    /// The inspection over SSH: what the server said it is, or why it said nothing.
    Inspected(Result<Report, SshAccessError>),
    /// The delivery over SSH, probed first: where it stands ([`Progress::Running`] once this
    /// pass started it; [`Progress::NotStarted`]: the data is not staged yet, nothing was sent),
    /// or why the server was not reached or a step failed.
    Delivery(Result<Progress, SshAccessError>),
    /// The reset over SSH: done and verified, or why not.
    Reset(Result<(), SshAccessError>),
    /// The kexec into the ramdisk over SSH: started (or found started), or why not.
    Kexec(Result<Kexecuted, SshAccessError>),
}

impl Recheck {
    pub fn lifecycle(seen: &Observed) -> Self {
        Recheck::Lifecycle { max_silence: seen.max_silence, min_wipe: seen.min_wipe }
    }

    /// The transition this rule computes for `host` at `fresh`.
    pub fn transition(&self, host: &Host, fresh: &Fresh) -> Option<Transition> {
        match *self {
            Recheck::Lifecycle { max_silence, min_wipe } => {
                lifecycle::silent(host, max_silence, fresh)
                    .or_else(|| lifecycle::next(host, min_wipe))
            }
            Recheck::DeletionWipe { min_wipe } => match lifecycle::on_delete(host, min_wipe) {
                Deletion::Wipe(t) => Some(t),
                _ => None,
            },
        }
    }
}

impl StatusChange {
    /// The status to write over `current`'s: `None` when the change no longer applies, or
    /// changes nothing.
    pub fn apply(&self, current: &Host) -> Option<HostStatus> {
        let mut status = current.status.clone().unwrap_or_default();
        let generation = current.metadata.generation;
        match self {
            StatusChange::Paused => {
                check_paused(None, current, &mut status.conditions);
            }
            StatusChange::Restore(restored) => {
                if status.state.is_some() {
                    return None;
                }
                status = (**restored).clone();
            }
            StatusChange::Mac(standing) => {
                let (unique, reason, message) = standing.condition(&current.spec.boot_mac_address);
                let reason = reason.to_string();
                let conditions = &mut status.conditions;
                set_condition(conditions, BOOT_MAC_UNIQUE, unique, &reason, &message, generation);
            }
            StatusChange::Transit { transition, fresh, recheck } => {
                if recheck.transition(current, fresh).as_ref() != Some(transition) {
                    return None;
                }
                status = lifecycle::apply(current, transition, fresh);
            }
            StatusChange::BootRequested { operation, at } => {
                let op = status.operation.as_mut().filter(|op| op.id == *operation)?;
                op.boot_requested = Some(at.clone());
            }
            StatusChange::DiskBootAsked { installed } => {
                let now = status.installed.as_mut().filter(|now| **now == *installed)?;
                now.disk_boot_pending = false;
            }
            StatusChange::BmcChecked { ok, reason, message } => {
                let conditions = &mut status.conditions;
                set_condition(conditions, BMC_READY, *ok, reason, message, generation);
            }
            StatusChange::SshChecked { ok, reason, message, record } => {
                let conditions = &mut status.conditions;
                set_condition(conditions, SSH_READY, *ok, reason, message, generation);
                if let Some(record) = record {
                    // A key recorded since the login was planned is the one pinned: kept.
                    let endpoint =
                        Endpoint { address: record.address.parse().ok()?, port: record.port };
                    if crate::ssh::recorded(current, endpoint).is_some() {
                        return None;
                    }
                    status.ssh_host_key = Some(record.clone());
                }
            }
            StatusChange::SshInspected { operation, fresh, result } => {
                if !running(current, HostState::Inspecting, operation) {
                    return None;
                }
                status = match &**result {
                    Ok(hardware) => lifecycle::completed(
                        current,
                        OperationKind::Inspect,
                        true,
                        "",
                        Some(hardware.clone()),
                        fresh,
                    ),
                    Err(quarantine) => lifecycle::apply(current, quarantine, fresh),
                };
                if result.is_ok() {
                    logged_in(&mut status, "logged in and inspected the server", generation);
                }
            }
            StatusChange::SshDelivery { operation, fresh, ended } => {
                if !running(current, HostState::Provisioning, operation) {
                    return None;
                }
                match ended {
                    None => {
                        let op = status.operation.as_mut()?;
                        op.bootstrap_delivered = true;
                    }
                    Some(ended) => status = lifecycle::delivered(current, ended, fresh),
                }
                logged_in(&mut status, "logged in and delivered the bootstrap data", generation);
            }
            StatusChange::SshReset { operation, fresh } => {
                if !running(current, HostState::Deprovisioning, operation) {
                    return None;
                }
                status = lifecycle::apply(current, &lifecycle::reset_done(), fresh);
                logged_in(&mut status, "logged in and reset the server", generation);
            }
            StatusChange::OutOfBandToken { operation, hash, at, carrier } => {
                let op = status.operation.as_mut();
                let op = op.filter(|op| op.id == *operation && !op.bootstrap_delivered)?;
                op.token_hash = Some(hash.clone());
                op.token_address = None;
                op.token_issued = Some(at.clone());
                op.token_via_ssh = *carrier == TokenCarrier::Kexec;
                if *carrier == TokenCarrier::VirtualMedia {
                    status.media_inserted = true;
                }
            }
            StatusChange::KexecStarted { operation, at } => {
                let op = status.operation.as_mut().filter(|op| op.id == *operation)?;
                op.boot_requested = Some(at.clone());
                logged_in(
                    &mut status,
                    "logged in and kexec'ed the server into the ramdisk",
                    generation,
                );
            }
            StatusChange::MediaEjected => {
                if status.operation.is_some() {
                    return None;
                }
                status.media_inserted = false;
            }
            StatusChange::Power(power) => status.power = Some(*power),
        }
        (current.status.as_ref() != Some(&status)).then_some(status)
    }
}

/// Whether `host` is in `state` running `operation`: what a step's answer is for.
fn running(host: &Host, state: HostState, operation: &str) -> bool {
    let status = host.status.as_ref();
    status.and_then(|s| s.state) == Some(state)
        && status.and_then(|s| s.operation.as_ref()).is_some_and(|op| op.id == operation)
}

/// `SSHReady` True again once siteboot logged in and did what it came for: a login that
/// failed since is over.
fn logged_in(status: &mut HostStatus, message: &str, generation: Option<i64>) {
    let ssh_ready = crate::crd::condition(&status.conditions, SSH_READY);
    if ssh_ready.is_some_and(|c| c.status != "True") {
        let conditions = &mut status.conditions;
        set_condition(conditions, SSH_READY, true, "LoggedIn", message, generation);
    }
}

impl<'a> Write<'a> {
    fn status(target: &'a Host, change: StatusChange) -> Self {
        Write { target, change: Change::Status(change), note: None }
    }

    fn noted(self, note: Note) -> Self {
        Write { note: Some(note), ..self }
    }
}

impl<'a> Outcome<'a> {
    fn after(again: Duration) -> Self {
        Outcome { note: None, writes: Vec::new(), again: Again::After(again) }
    }

    fn on_change() -> Self {
        Outcome { again: Again::OnChange, ..Outcome::after(Duration::ZERO) }
    }

    fn writing(write: Write<'a>) -> Self {
        Outcome { writes: vec![write], ..Outcome::after(Duration::ZERO) }
    }

    fn noted(self, note: Note) -> Self {
        Outcome { note: Some(note), ..self }
    }

    fn again(self, again: Duration) -> Self {
        Outcome { again: Again::After(again), ..self }
    }
}

/// The token write for the operation `host` runs, whose token's hash is `hash`, minted at `at`
/// for `carrier`: the reconciler inserts the media (starts the kexec) only once it landed.
pub fn out_of_band_token<'a>(
    host: &'a Host,
    hash: String,
    at: &Time,
    carrier: TokenCarrier,
) -> Option<Write<'a>> {
    let operation = host.status.as_ref()?.operation.as_ref()?.id.clone();
    let change = StatusChange::OutOfBandToken { operation, hash, at: at.clone(), carrier };
    Some(Write::status(host, change))
}

/// What `step`, planned for `host` from what the pass `seen`, does once the BMC gave `answer`.
pub fn outcome<'a>(step: &Step, host: &'a Host, seen: &'a Observed, answer: Answer) -> Outcome<'a> {
    match step {
        Step::ReportPaused => Outcome::writing(Write::status(host, StatusChange::Paused)),
        Step::Paused | Step::Gone => Outcome::on_change(),
        Step::AddFinalizer => Outcome::writing(Write {
            target: host,
            change: Change::Patch(finalizer_patch(host, FINALIZER, true)),
            note: None,
        }),
        Step::Restore { status, reason, message } => Outcome::writing(
            Write::status(host, StatusChange::Restore(status.clone()))
                .noted(Note::info(message.clone()).event(reason, message.clone())),
        ),
        Step::RecordStale(value) => Outcome::writing(Write {
            target: host,
            change: Change::Patch(
                json!({ "metadata": { "annotations": { RECORD_ANNOTATION: value } } }),
            ),
            note: None,
        }),
        Step::ReportMac => report_mac(host, seen),
        Step::Disowned => Outcome::after(IDLE_DISOWNED),
        Step::ClearRetry => Outcome::writing(Write {
            target: host,
            change: Change::Patch(without_annotation(RETRY_ANNOTATION)),
            note: Some(Note::info("removed the retry annotation: the quarantine it ended is over")),
        }),
        Step::Transit(transition) => transit(host, seen, transition, Recheck::lifecycle(seen)),
        Step::WipeBeforeDelete(transition) => {
            let recheck = Recheck::DeletionWipe { min_wipe: seen.min_wipe };
            transit(host, seen, transition, recheck)
        }
        Step::AwaitDeletion => Outcome::after(plan::DELETION_CHECK),
        Step::RequestBoot => boot_requested(host, seen, answer.done()),
        Step::KexecOverSsh => match answer {
            Answer::Kexec(Ok(Kexecuted::NotIssued)) => Outcome::after(Duration::ZERO),
            Answer::Kexec(Ok(_)) => kexec_started(host, seen),
            // Nothing was started: SSHReady says why (a wrong host key, a refused key, a step
            // that failed), and it is tried again later and later.
            Answer::Kexec(Err(e)) => ssh_checked(host, seen, Err(e)),
            _ => Outcome::after(Duration::ZERO),
        },
        Step::RequestDiskBoot => disk_boot_asked(host, answer.done()),
        Step::CheckBmc => match answer {
            Answer::Identity(identity) => bmc_checked(host, seen, &identity),
            // Never asked (the Host lost its BMC since it was read): the next pass sees.
            _ => Outcome::after(Duration::ZERO),
        },
        Step::CheckSsh => match answer {
            Answer::Ssh(login) => ssh_checked(host, seen, login),
            _ => Outcome::after(Duration::ZERO),
        },
        Step::InspectOverSsh => match answer {
            Answer::Inspected(Ok(report)) => inspected(host, seen, &report),
            // Unreachable, or an unreadable report: SSHReady says why, and it is tried again.
            Answer::Inspected(Err(e)) => ssh_checked(host, seen, Err(e)),
            _ => Outcome::after(Duration::ZERO),
        },
        Step::DeliverOverSsh => match answer {
            Answer::Delivery(Ok(progress)) => delivery(host, seen, progress),
            // Unreachable, a wrong host key, a failing step: SSHReady says which, and the
            // next try probes first.
            Answer::Delivery(Err(e)) => ssh_checked(host, seen, Err(e)),
            _ => Outcome::after(Duration::ZERO),
        },
        Step::ResetOverSsh => match answer {
            Answer::Reset(Ok(())) => reset(host, seen),
            // The host stays Deprovisioning, never Available with something left behind.
            Answer::Reset(Err(e)) => ssh_checked(host, seen, Err(e)),
            _ => Outcome::after(Duration::ZERO),
        },
        Step::Reboot(reboot) => rebooted(host, *reboot, answer.done()),
        Step::EjectMedia => match answer.done() {
            Err(e) => Outcome::after(EJECT_RETRY).noted(
                Note::warning(format!("cannot eject the virtual media: {e}"))
                    .event("MediaEjectFailed", e),
            ),
            Ok(()) => Outcome::writing(
                Write::status(host, StatusChange::MediaEjected)
                    .noted(Note::info("virtual media ejected")),
            ),
        },
        Step::LetGoMoved => {
            let_go(host, Note::info("Host moved to another management cluster: let go untouched"))
        }
        Step::PowerOffAndLetGo => {
            let outcome = let_go(host, Note::info("Host deleted"));
            match answer {
                Answer::Done(Err(e)) => {
                    outcome.noted(Note::warning(format!("cannot power off the deleted host: {e}")))
                }
                _ => outcome,
            }
        }
        Step::Idle { again } => {
            let power = match answer {
                Answer::Power(Some(power)) => Some(power),
                _ => None,
            };
            let change = power.map(StatusChange::Power).filter(|c| c.apply(host).is_some());
            let writes = change.map(|c| Write::status(host, c)).into_iter().collect();
            Outcome { writes, ..Outcome::after(*again) }
        }
    }
}

/// How often a Host that another Host's boot MAC claim disowns is looked at again.
const IDLE_DISOWNED: Duration = plan::IDLE;

impl Answer {
    /// A boot, reboot, ejection or power-off's result.
    fn done(self) -> Result<(), String> {
        match self {
            Answer::Done(result) => result,
            Answer::NotAsked => Err("the host has no spec.bmc".to_owned()),
            Answer::Identity(_)
            | Answer::Power(_)
            | Answer::Ssh(_)
            | Answer::Inspected(_)
            | Answer::Delivery(_)
            | Answer::Reset(_)
            | Answer::Kexec(_) => Err("the BMC was asked something else".into()),
        }
    }
}

/// The `BootMACUnique` condition written on the Host, and on the others with its MAC whose
/// condition changes with it. A Host that does not keep its MAC is said loudly.
fn report_mac<'a>(host: &'a Host, seen: &'a Observed) -> Outcome<'a> {
    let report = |target: &'a Host, standing: &MacStanding| {
        let change = StatusChange::Mac(standing.clone());
        change.apply(target)?;
        let write = Write::status(target, change);
        let (unique, reason, message) = standing.condition(&target.spec.boot_mac_address);
        Some(if unique {
            write
        } else {
            write.noted(Note::warning(&message).event(reason, message))
        })
    };
    let others = seen.others.iter().map(|(other, standing)| (&**other, standing));
    let writes = std::iter::once((host, seen.mac)).chain(others);
    let writes = writes.filter_map(|(target, standing)| report(target, standing)).collect();
    Outcome { writes, ..Outcome::after(Duration::ZERO) }
}

/// A transition, checked again with `recheck` on the Host as written over. A new operation's
/// ramdisk is booted by the next pass ([`lifecycle::boot_due`]).
fn transit<'a>(
    host: &'a Host,
    seen: &Observed,
    transition: &Transition,
    recheck: Recheck,
) -> Outcome<'a> {
    let from = host.status.as_ref().and_then(|s| s.state);
    let Transition { to, reason, message, .. } = transition;
    let event = format!("{from:?} -> {to:?}: {message}");
    let log = format!("{event} ({reason})");
    let note = if *to == HostState::Quarantined { Note::warning(log) } else { Note::info(log) };
    let change = StatusChange::Transit {
        transition: transition.clone(),
        fresh: seen.fresh.clone(),
        recheck,
    };
    let write = Write::status(host, change).noted(note.event(reason, event));
    let again = if transition.operation.is_some() { Duration::ZERO } else { plan::IDLE };
    Outcome::writing(write).again(again)
}

/// The BMC asked to boot the ramdisk of the operation under way: recorded for that operation,
/// or tried again later. A crash before the record asks again.
fn boot_requested<'a>(host: &'a Host, seen: &Observed, result: Result<(), String>) -> Outcome<'a> {
    let Some(operation) = host.status.as_ref().and_then(|s| s.operation.as_ref()) else {
        return Outcome::after(Duration::ZERO);
    };
    let id = &operation.id;
    match result {
        Err(e) => Outcome::after(REBOOT_RETRY).noted(
            Note::warning(format!(
                "cannot boot the host into the ramdisk of operation {id}: {e}; trying again in {}",
                humantime::format_duration(REBOOT_RETRY)
            ))
            .event("BootFailed", format!("booting the ramdisk of operation {id}: {e}")),
        ),
        Ok(()) => {
            let at = seen.fresh.now.clone();
            let change = StatusChange::BootRequested { operation: id.clone(), at };
            let note = Note::info(format!("asked the BMC to boot the ramdisk of operation {id}"));
            Outcome::writing(Write::status(host, change).noted(note)).again(plan::SILENCE_CHECK)
        }
    }
}

/// The kexec into the ramdisk of the operation under way started: recorded for that operation,
/// so that it is not asked again every pass; the ramdisk's silence is timed from the token
/// stored before it.
fn kexec_started<'a>(host: &'a Host, seen: &Observed) -> Outcome<'a> {
    let Some(operation) = host.status.as_ref().and_then(|s| s.operation.as_ref()) else {
        return Outcome::after(Duration::ZERO);
    };
    let id = &operation.id;
    let at = seen.fresh.now.clone();
    let change = StatusChange::KexecStarted { operation: id.clone(), at };
    let log = format!("kexec'ed the server over SSH into the ramdisk of operation {id}");
    let note = Note::info(&log).event("KexecStarted", log);
    Outcome::writing(Write::status(host, change).noted(note)).again(plan::SILENCE_CHECK)
}

/// The BMC asked to boot the disk just written, once: if it refused, the ramdisk is told to
/// reboot, into the boot script, which exits to the firmware's boot order. (An appliance that
/// dies between the BMC's answer and the record asks again: a second restart of a host seconds
/// into its boot.)
fn disk_boot_asked(host: &Host, result: Result<(), String>) -> Outcome<'_> {
    let note = match result {
        Ok(()) => Note::info("asked the BMC to boot the disk"),
        Err(e) => Note::warning(format!("cannot boot the disk through the BMC: {e}; the ramdisk reboots into the boot script, which exits to the firmware"))
            .event("DiskBootFailed", format!("booting the disk: {e}")),
    };
    let Some(installed) = host.status.as_ref().and_then(|s| s.installed.clone()) else {
        return Outcome::after(Duration::ZERO).noted(note);
    };
    Outcome::writing(Write::status(host, StatusChange::DiskBootAsked { installed })).noted(note)
}

/// The BMC's identity answer in the `BMCReady` condition; a Registering host goes on once it is
/// True. A failing BMC is asked again later and later ([`lifecycle::bmc_recheck_after`]), with
/// an Event when the reason changes.
fn bmc_checked<'a>(
    host: &'a Host,
    seen: &Observed,
    identity: &Result<Option<Identity>, BmcError>,
) -> Outcome<'a> {
    let (ok, reason, message) = lifecycle::bmc_check(host, identity);
    let change = StatusChange::BmcChecked { ok, reason, message: message.clone() };
    // Measured from the condition as this write leaves it.
    let mut after = host.clone();
    if let Some(status) = change.apply(host) {
        after.status = Some(status);
    }
    let now = seen.fresh.now.0.as_second();
    let again = if ok { Duration::ZERO } else { lifecycle::bmc_recheck_after(&after, now) };
    if change.apply(host).is_none() {
        return Outcome::after(again);
    }
    let log = format!("BMC check: {message}");
    let note = if ok { Note::info(&log) } else { Note::warning(&log) }.event(reason, log);
    Outcome::writing(Write::status(host, change).noted(note)).again(again)
}

/// The SSH login's result in the `SSHReady` condition, with the host key presented recorded on
/// first use; a Registering host goes on once it is True. A failing login is tried again later
/// and later ([`lifecycle::ssh_recheck_after`]), with an Event when the reason changes.
fn ssh_checked<'a>(
    host: &'a Host,
    seen: &Observed,
    login: Result<Reached, SshAccessError>,
) -> Outcome<'a> {
    let (ok, reason, message, record) = match login {
        Ok(Reached { endpoint, user, host_key, first_use }) => {
            let fingerprint = host_key.fingerprint();
            let server = format!("{user}@{} port {}", endpoint.address, endpoint.port);
            let record = first_use.then(|| RecordedHostKey {
                key: host_key.to_string(),
                fingerprint: fingerprint.clone(),
                address: endpoint.address.to_string(),
                port: endpoint.port,
                recorded: seen.fresh.now.clone(),
            });
            let message = match first_use {
                true => format!(
                    "logged in as {server}; its host key {fingerprint} was trusted on first use and is recorded in status.sshHostKey"
                ),
                false => format!("logged in as {server}, host key {fingerprint}"),
            };
            (true, "LoggedIn", message, record)
        }
        Err(e) => (false, e.reason(), e.to_string(), None),
    };
    let change = StatusChange::SshChecked { ok, reason, message: message.clone(), record };
    // Measured from the condition as this write leaves it.
    let mut after = host.clone();
    if let Some(status) = change.apply(host) {
        after.status = Some(status);
    }
    let now = seen.fresh.now.0.as_second();
    let again = if ok { Duration::ZERO } else { lifecycle::ssh_recheck_after(&after, now) };
    if change.apply(host).is_none() {
        return Outcome::after(again);
    }
    let log = format!("SSH check: {message}");
    let note = if ok { Note::info(&log) } else { Note::warning(&log) }.event(reason, log);
    Outcome::writing(Write::status(host, change).noted(note)).again(again)
}

/// An SSH Host's server inspected: Available with its hardware if it is this Host's machine
/// ([`crate::ssh::identify`]), else quarantined with nothing of it recorded.
fn inspected<'a>(host: &'a Host, seen: &Observed, report: &Report) -> Outcome<'a> {
    let Some(operation) = host.status.as_ref().and_then(|s| s.operation.as_ref()) else {
        return Outcome::after(Duration::ZERO);
    };
    let (result, note) = match crate::ssh::identify(host, report) {
        Ok(hardware) => {
            let os = report.os.as_ref().map_or(String::new(), |os| match &os.version {
                Some(version) => format!(", {} {version}", os.id),
                None => format!(", {}", os.id),
            });
            let log = format!(
                "inspected over SSH: {} CPUs, {} MiB, {} disks{os}",
                hardware.cpus,
                hardware.memory_mib,
                hardware.disks.len()
            );
            (Ok(hardware), Note::info(&log).event("Inspected", log))
        }
        Err(e) => {
            let message = e.to_string();
            let quarantine = Transition {
                to: HostState::Quarantined,
                operation: None,
                reason: SERVER_NOT_THIS_HOST,
                message: message.clone(),
            };
            (Err(quarantine), Note::warning(&message).event(SERVER_NOT_THIS_HOST, message))
        }
    };
    let change = StatusChange::SshInspected {
        operation: operation.id.clone(),
        fresh: seen.fresh.clone(),
        result: Box::new(result),
    };
    Outcome::writing(Write::status(host, change).noted(note)).again(plan::IDLE)
}

/// How often an adopted host's delivery is probed while its data is not staged yet or runs.
pub const DELIVERY_CHECK: Duration = Duration::from_secs(30);
/// How long after its operation started a delivery's run may still be running: its own limit,
/// and a grace for the data's staging and the start (a later start is only waited for longer).
const DELIVERY_DEADLINE: Duration =
    Duration::from_secs(siteboot_ssh::adopt::RUN_LIMIT.as_secs() + 10 * 60);

/// Where an adopted host's delivery stands, written: started (the data left), ended
/// (Provisioned, or quarantined for a run that failed or never said how it ended), or nothing
/// yet.
fn delivery<'a>(host: &'a Host, seen: &Observed, progress: Progress) -> Outcome<'a> {
    let Some(op) = host.status.as_ref().and_then(|s| s.operation.as_ref()) else {
        return Outcome::after(Duration::ZERO);
    };
    let ended = match progress {
        Progress::NotStarted => {
            let note = Note::debug("waiting for the bootstrap data to be staged");
            return Outcome::after(DELIVERY_CHECK).noted(note);
        }
        Progress::OtherDelivery => {
            return ssh_checked(host, seen, Err(Stalled::OtherDelivery.into()));
        }
        Progress::Running
            if lifecycle::older_than(
                &op.started,
                DELIVERY_DEADLINE.as_secs() as i64,
                &seen.fresh.now,
            ) =>
        {
            let message = format!(
                "the bootstrap data's run gave no result within {} of the claim; it is not run again",
                humantime::format_duration(DELIVERY_DEADLINE)
            );
            let quarantine = Transition {
                to: HostState::Quarantined,
                operation: None,
                reason: "ProvisioningFailed",
                message,
            };
            Some(quarantine)
        }
        Progress::Running => None,
        Progress::Finished(code) => Some(lifecycle::delivery_ended(host, code)),
    };
    let note = match &ended {
        None => Note::info(format!("the bootstrap data of operation {} runs on the server", op.id)),
        Some(t) if t.to == HostState::Quarantined => {
            Note::warning(&t.message).event(t.reason, t.message.clone())
        }
        Some(t) => Note::info(&t.message).event(t.reason, t.message.clone()),
    };
    let again = if ended.is_some() { plan::IDLE } else { DELIVERY_CHECK };
    let change =
        StatusChange::SshDelivery { operation: op.id.clone(), fresh: seen.fresh.clone(), ended };
    if change.apply(host).is_none() {
        return Outcome::after(again);
    }
    Outcome::writing(Write::status(host, change).noted(note)).again(again)
}

/// An adopted host reset: Available again.
fn reset<'a>(host: &'a Host, seen: &Observed) -> Outcome<'a> {
    let Some(op) = host.status.as_ref().and_then(|s| s.operation.as_ref()) else {
        return Outcome::after(Duration::ZERO);
    };
    let done = lifecycle::reset_done();
    let note = Note::info(&done.message).event(done.reason, done.message.clone());
    let change = StatusChange::SshReset { operation: op.id.clone(), fresh: seen.fresh.clone() };
    Outcome::writing(Write::status(host, change).noted(note)).again(plan::IDLE)
}

/// The reason of a quarantine for a server reached over SSH that is not the Host's machine.
pub const SERVER_NOT_THIS_HOST: &str = "SSHServerIsNotThisHost";

/// The reboot annotation carried out, then removed; a BMC that fails keeps it for a later pass.
/// Without a BMC the operator is told, and the annotation removed.
fn rebooted(host: &Host, reboot: Reboot, result: Result<(), String>) -> Outcome<'_> {
    let result = match reboot {
        Reboot::NoBmc => Err("the host has no spec.bmc: power-cycle it by hand".to_owned()),
        _ => result,
    };
    let note = match &result {
        Ok(()) => Note::info(format!("{reboot:?} through the BMC"))
            .event("Rebooted", format!("{reboot:?} through the BMC")),
        Err(e) => Note::warning(format!("cannot reboot: {e}")).event("RebootFailed", e.clone()),
    };
    if reboot != Reboot::NoBmc && result.is_err() {
        return Outcome::after(REBOOT_RETRY).noted(note);
    }
    let change = Change::PlainPatch(without_annotation(REBOOT_ANNOTATION));
    let write = Write { target: host, change, note: None };
    Outcome::writing(write).noted(note).again(AFTER_REBOOT)
}

fn without_annotation(name: &str) -> Value {
    json!({ "metadata": { "annotations": { name: null } } })
}

/// The finalizer dropped: the Host goes.
fn let_go(host: &Host, note: Note) -> Outcome<'_> {
    let change = Change::Patch(finalizer_patch(host, FINALIZER, false));
    let write = Write { target: host, change, note: Some(note) };
    Outcome { again: Again::OnChange, ..Outcome::writing(write) }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::crd::{Access, Bmc, HostSpec, Operation, OperationKind, SshAccess, SshMode};
    use crate::host::plan::{IDLE, SILENCE_CHECK, next};
    use kube::ResourceExt;
    use siteboot_ssh::adopt::StepFailed;

    /// What `outcome`'s writes of `host` leave on it, as the API server would: whether each
    /// landed (the Host is the only writer, so every guard holds).
    pub fn land(host: &mut Host, outcome: &Outcome) -> bool {
        let name = host.name_any();
        for write in outcome.writes.iter().filter(|w| w.target.name_any() == name) {
            match &write.change {
                Change::Status(change) => match change.apply(host) {
                    Some(status) => host.status = Some(status),
                    None => return false,
                },
                Change::Patch(patch) | Change::PlainPatch(patch) => {
                    let mut object = serde_json::to_value(&*host).unwrap();
                    merge(&mut object, patch);
                    *host = serde_json::from_value(object).unwrap();
                }
            }
        }
        true
    }

    /// `step`'s outcome for `host` as it is now, given `answer`, landed on it.
    pub fn take(host: &mut Host, step: &Step, seen: &Observed, answer: Answer) -> bool {
        let read = host.clone();
        let outcome = outcome(step, &read, seen, answer);
        land(host, &outcome)
    }

    /// RFC 7386's merge patch.
    fn merge(target: &mut Value, patch: &Value) {
        let Value::Object(fields) = patch else { return *target = patch.clone() };
        if !target.is_object() {
            *target = json!({});
        }
        let object = target.as_object_mut().unwrap();
        for (name, value) in fields {
            match value {
                Value::Null => drop(object.remove(name)),
                _ => merge(object.entry(name.clone()).or_insert(Value::Null), value),
            }
        }
    }

    const MAC: &str = "52:54:00:00:00:01";

    fn observed<'a>(fresh: &'a Fresh, mac: &'a MacStanding) -> Observed<'a> {
        let max_silence = Duration::from_secs(600);
        Observed { fresh, mac, others: &[], max_silence, min_wipe: WipePolicy::Quick }
    }

    /// A pass `secs` from the clock's now (conditions take their transition time from the
    /// clock).
    fn at(secs: i64) -> Fresh {
        let now = k8s_openapi::jiff::Timestamp::now()
            + k8s_openapi::jiff::SignedDuration::from_secs(secs);
        Fresh { now: Time(now), operation_id: format!("op{secs}") }
    }

    fn annotated(mut host: Host, name: &str) -> Host {
        host.annotations_mut().insert(name.to_owned(), String::new());
        host
    }

    /// A Host with a BMC, its finalizer and record, registered and waiting for its BMC check.
    fn registering() -> Host {
        let mut host = Host::new("h", HostSpec::new(MAC));
        host.spec.bmc = Some(Bmc {
            address: "redfish+https://10.0.0.5/redfish/v1/Systems/1".into(),
            credentials_name: "creds".into(),
            certificate_fingerprint: None,
            boot_mode: None,
        });
        let fresh = at(0);
        let unique = MacStanding::Unique;
        for _ in 0..10 {
            let step = next(&host, &observed(&fresh, &unique));
            if step == Step::CheckBmc {
                return host;
            }
            assert!(
                take(&mut host, &step, &observed(&fresh, &unique), Answer::NotAsked),
                "{step:?}"
            );
        }
        panic!("never asked for a BMC check: {:?}", host.status)
    }

    /// A Host reached over SSH (no BMC), registered and waiting for its login.
    fn registering_over_ssh() -> Host {
        let mut host = Host::new("h", HostSpec::new(MAC));
        host.spec.access = Some(Access {
            ssh: Some(SshAccess {
                address: "10.0.0.7".into(),
                port: 22,
                user: "root".into(),
                mode: SshMode::Adopt,
                credentials_name: "ssh".into(),
            }),
        });
        let fresh = at(0);
        let unique = MacStanding::Unique;
        for _ in 0..10 {
            let step = next(&host, &observed(&fresh, &unique));
            if step == Step::CheckSsh {
                return host;
            }
            assert!(
                take(&mut host, &step, &observed(&fresh, &unique), Answer::NotAsked),
                "{step:?}"
            );
        }
        panic!("never asked for an SSH login: {:?}", host.status)
    }

    const HOST_KEY: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEe0hXrhIoIm5D1N1oKghyAzTUuDQC6I3KUIfwm0ncX4";
    const HOST_KEY_SHA256: &str = "SHA256:t6d8j15eRbRn9Rf4ubBEjXKgM19vUQJ2ncv6llQPJdg";

    fn reached(first_use: bool) -> Answer {
        Answer::Ssh(Ok(Reached {
            endpoint: Endpoint { address: "10.0.0.7".parse().unwrap(), port: 22 },
            user: "root".into(),
            host_key: HOST_KEY.parse().unwrap(),
            first_use,
        }))
    }

    fn ssh_ready(host: &Host) -> Option<(String, String, String)> {
        let conditions = &host.status.as_ref()?.conditions;
        let c = crate::crd::condition(conditions, SSH_READY)?;
        Some((c.status.clone(), c.reason.clone(), c.message.clone()))
    }

    /// A server presenting another key: SSHReady False HostKeyMismatch with both fingerprints,
    /// nothing recorded, the Host waits in Registering and is tried again later.
    #[test]
    fn a_wrong_host_key_is_a_condition_with_both_fingerprints_and_the_host_waits() {
        let mut host = registering_over_ssh();
        let unique = MacStanding::Unique;
        let fresh = at(0);
        let seen = observed(&fresh, &unique);
        let mismatch = || {
            Answer::Ssh(Err(SshAccessError::Connect(crate::ssh::SshError::HostKeyMismatch {
                address: "10.0.0.7:22".into(),
                mismatch: siteboot_ssh::HostKeyMismatch {
                    pinned: HOST_KEY_SHA256.into(),
                    presented: "SHA256:someoneelse".into(),
                },
            })))
        };
        let read = host.clone();
        let refused = outcome(&Step::CheckSsh, &read, &seen, mismatch());
        assert_eq!(refused.again, Again::After(Duration::from_secs(10)));
        assert!(refused.writes[0].note.as_ref().unwrap().is_warning());
        assert!(land(&mut host, &refused));
        let (status, reason, message) = ssh_ready(&host).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("False", "HostKeyMismatch"));
        assert!(message.contains(HOST_KEY_SHA256) && message.contains("SHA256:someoneelse"));
        assert!(message.contains("nothing was sent"), "{message}");
        assert_eq!(host.status.as_ref().unwrap().ssh_host_key, None);
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Registering));
        assert_eq!(next(&host, &observed(&fresh, &unique)), Step::CheckSsh);
        // The same failure again writes nothing.
        let read = host.clone();
        assert!(outcome(&Step::CheckSsh, &read, &seen, mismatch()).writes.is_empty());
    }

    /// The pinned key: True, nothing recorded, and the Host goes on at once.
    #[test]
    fn a_login_with_the_pinned_key_registers_the_host() {
        let mut host = registering_over_ssh();
        let unique = MacStanding::Unique;
        let fresh = at(0);
        let read = host.clone();
        let seen = observed(&fresh, &unique);
        let ok = outcome(&Step::CheckSsh, &read, &seen, reached(false));
        assert_eq!(ok.again, Again::After(Duration::ZERO));
        assert!(land(&mut host, &ok));
        let (status, reason, message) = ssh_ready(&host).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("True", "LoggedIn"));
        assert!(message.contains(HOST_KEY_SHA256), "{message}");
        assert_eq!(host.status.as_ref().unwrap().ssh_host_key, None);
        let Step::Transit(t) = next(&host, &observed(&fresh, &unique)) else { panic!() };
        assert_eq!(t.to, HostState::Inspecting);
    }

    /// Trust on first use: the key presented is recorded with its server, once; a record made
    /// meanwhile is never written over.
    #[test]
    fn a_key_trusted_on_first_use_is_recorded_once() {
        let mut host = registering_over_ssh();
        let unique = MacStanding::Unique;
        let fresh = at(3);
        let read = host.clone();
        let seen = observed(&fresh, &unique);
        let first = outcome(&Step::CheckSsh, &read, &seen, reached(true));
        let mut raced = host.clone();
        assert!(land(&mut host, &first));
        let record = host.status.as_ref().unwrap().ssh_host_key.clone().unwrap();
        assert_eq!(
            (
                record.key.as_str(),
                record.fingerprint.as_str(),
                record.address.as_str(),
                record.port
            ),
            (HOST_KEY, HOST_KEY_SHA256, "10.0.0.7", 22)
        );
        assert_eq!(record.recorded, fresh.now);
        let (status, _, message) = ssh_ready(&host).unwrap();
        assert_eq!(status, "True");
        assert!(message.contains("trusted on first use"), "{message}");
        // Another pass recorded a key for this server since this one read the Host.
        let mut other = record.clone();
        other.key =
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA9IjL3v+T4wGZl7pvvK3dAtZF0VaMdfG4LhT96lCyDY"
                .into();
        raced.status.as_mut().unwrap().ssh_host_key = Some(other.clone());
        assert!(!land(&mut raced, &first), "a recorded key was written over");
        assert_eq!(raced.status.unwrap().ssh_host_key, Some(other));
    }

    /// A Host with a BMC and SSH access registers through its BMC, as before.
    #[test]
    fn a_host_with_a_bmc_is_checked_through_it_not_over_ssh() {
        let mut host = registering();
        host.spec.access = registering_over_ssh().spec.access;
        let fresh = at(0);
        assert_eq!(next(&host, &observed(&fresh, &MacStanding::Unique)), Step::CheckBmc);
        assert!(!lifecycle::needs_ssh_check(&host));
        // Nor inspected over SSH: its ramdisk boots.
        host.status.as_mut().unwrap().state = Some(HostState::Inspecting);
        host.status.as_mut().unwrap().operation = Some(operation("op", false));
        assert!(!lifecycle::needs_ssh_inspection(&host));
    }

    /// An SSH Host registered (its login done) and Inspecting.
    fn inspecting_over_ssh() -> Host {
        inspecting_over_ssh_in(SshMode::Adopt)
    }

    /// An SSH Host in `mode` registered (its login done) and Inspecting: over SSH, whatever
    /// the mode.
    fn inspecting_over_ssh_in(mode: SshMode) -> Host {
        let mut host = registering_over_ssh();
        host.spec.access.as_mut().unwrap().ssh.as_mut().unwrap().mode = mode;
        let fresh = at(0);
        let unique = MacStanding::Unique;
        assert!(take(&mut host, &Step::CheckSsh, &observed(&fresh, &unique), reached(false)));
        for _ in 0..10 {
            let step = next(&host, &observed(&fresh, &unique));
            if step == Step::InspectOverSsh {
                return host;
            }
            let seen = observed(&fresh, &unique);
            assert!(take(&mut host, &step, &seen, Answer::NotAsked), "{step:?}");
        }
        panic!("never inspected over SSH: {:?}", host.status)
    }

    fn report(macs: &[&str], uuid: &str) -> Report {
        let mut text = format!("uuid {uuid}\ncpus 4\nmemkb 8388608\ndisk vda 20971520\n");
        for (i, mac) in macs.iter().enumerate() {
            text.push_str(&format!("nic eth{i} {mac}\n"));
        }
        siteboot_ssh::inspect::parse(text.as_bytes()).unwrap()
    }

    const UUID: &str = "0b5a1c2d-0000-4000-8000-0123456789ab";

    /// The server has the boot MAC: its hardware, and Available, in one write.
    #[test]
    fn a_server_with_the_boot_mac_is_inspected_and_the_host_available() {
        let mut host = inspecting_over_ssh();
        let fresh = at(1);
        let unique = MacStanding::Unique;
        let read = host.clone();
        let seen = observed(&fresh, &unique);
        let answer = Answer::Inspected(Ok(report(&["52:54:00:00:00:09", MAC], UUID)));
        let done = outcome(&Step::InspectOverSsh, &read, &seen, answer);
        assert_eq!(done.writes.len(), 1);
        assert!(land(&mut host, &done));
        let status = host.status.as_ref().unwrap();
        assert_eq!(status.state, Some(HostState::Available));
        assert_eq!(status.operation, None);
        let hardware = status.hardware.as_ref().unwrap();
        assert_eq!(hardware.system.as_ref().unwrap().uuid, UUID);
        assert_eq!((hardware.cpus, hardware.memory_mib), (4, 8192));
        assert!(hardware.nics.iter().any(|n| n.mac == MAC));
        assert_eq!(hardware.disks[0].size_bytes, 20971520 * 512);
        assert!(!matches!(next(&host, &observed(&fresh, &unique)), Step::InspectOverSsh));
    }

    /// Another machine at that address (no interface has the boot MAC): quarantined with the
    /// MACs seen, and nothing of it recorded.
    #[test]
    fn a_server_without_the_boot_mac_is_not_this_host() {
        let mut host = inspecting_over_ssh();
        let fresh = at(1);
        let unique = MacStanding::Unique;
        let read = host.clone();
        let seen = observed(&fresh, &unique);
        let answer = Answer::Inspected(Ok(report(&["52:54:00:00:00:09"], UUID)));
        let refused = outcome(&Step::InspectOverSsh, &read, &seen, answer);
        assert!(refused.writes[0].note.as_ref().unwrap().is_warning());
        assert!(land(&mut host, &refused));
        let status = host.status.as_ref().unwrap();
        assert_eq!(status.state, Some(HostState::Quarantined));
        assert_eq!(status.hardware, None);
        let ready = crate::crd::condition(&status.conditions, crate::conditions::READY).unwrap();
        assert_eq!(ready.reason, SERVER_NOT_THIS_HOST);
        assert!(ready.message.contains("52:54:00:00:00:09"), "{}", ready.message);
        assert!(ready.message.contains(MAC), "{}", ready.message);
    }

    /// A system UUID recorded by an earlier inspection must be the server's still.
    #[test]
    fn a_server_with_another_system_uuid_than_recorded_is_not_this_host() {
        let mut host = inspecting_over_ssh();
        let recorded = report(&[MAC], UUID).hardware();
        host.status.as_mut().unwrap().hardware = Some(recorded);
        let other = report(&[MAC], "0b5a1c2d-0000-4000-8000-00000000ffff");
        let e = crate::ssh::identify(&host, &other).unwrap_err();
        assert!(matches!(e, crate::ssh::NotThisHost::OtherUuid { .. }), "{e}");
        assert!(crate::ssh::identify(&host, &report(&[MAC], UUID)).is_ok());
        let fresh = at(1);
        let unique = MacStanding::Unique;
        let read = host.clone();
        let seen = observed(&fresh, &unique);
        let refused = outcome(&Step::InspectOverSsh, &read, &seen, Answer::Inspected(Ok(other)));
        assert!(land(&mut host, &refused));
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Quarantined));
    }

    /// Unreachable: SSHReady False says why, the Host stays Inspecting and is tried again.
    #[test]
    fn an_unreachable_server_is_inspected_again_later() {
        let mut host = inspecting_over_ssh();
        let fresh = at(1);
        let unique = MacStanding::Unique;
        let read = host.clone();
        let seen = observed(&fresh, &unique);
        let e = SshAccessError::InspectionFailed("Code(1): \"\"".into());
        let failed = outcome(&Step::InspectOverSsh, &read, &seen, Answer::Inspected(Err(e)));
        assert!(land(&mut host, &failed));
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Inspecting));
        let (status, reason, _) = ssh_ready(&host).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("False", "SSHInspectionFailed"));
        assert_eq!(next(&host, &observed(&fresh, &unique)), Step::InspectOverSsh);
        // Then it answers: Available, and SSHReady True again.
        let read = host.clone();
        let answer = Answer::Inspected(Ok(report(&[MAC], UUID)));
        assert!(land(&mut host, &outcome(&Step::InspectOverSsh, &read, &seen, answer)));
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Available));
        assert_eq!(ssh_ready(&host).unwrap().0, "True");
    }

    /// An adopted host (inspected over SSH, Available) claimed by a SitebootMachine: what it
    /// does until its delivery is the step.
    fn delivering() -> Host {
        let mut host = inspecting_over_ssh();
        let fresh = at(0);
        let unique = MacStanding::Unique;
        let seen = observed(&fresh, &unique);
        let answer = Answer::Inspected(Ok(report(&[MAC], UUID)));
        assert!(take(&mut host, &Step::InspectOverSsh, &seen, answer));
        host.spec.consumer_ref = Some(crate::crd::ConsumerRef {
            api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
            kind: "SitebootMachine".into(),
            namespace: "ns".into(),
            name: "m".into(),
            uid: "u".into(),
        });
        host.spec.provisioning = Some(crate::crd::Provisioning {
            image: crate::crd::Image {
                url: "http://x/1.img".into(),
                checksum: format!("sha256:{}", "0".repeat(64)),
                format: None,
                grow_last_partition: false,
            },
        });
        for _ in 0..10 {
            let step = next(&host, &observed(&fresh, &unique));
            if step == Step::DeliverOverSsh {
                return host;
            }
            assert!(!matches!(step, Step::RequestBoot), "a ramdisk for an adopted host");
            assert!(
                take(&mut host, &step, &observed(&fresh, &unique), Answer::NotAsked),
                "{step:?}"
            );
        }
        panic!("never delivered over SSH: {:?}", host.status)
    }

    /// `step`'s outcome for `host` at `fresh` given `answer`, landed: when the Host is looked
    /// at again, and how many writes it made.
    fn answered(host: &mut Host, step: Step, fresh: &Fresh, answer: Answer) -> (Again, usize) {
        let read = host.clone();
        let unique = MacStanding::Unique;
        let seen = observed(fresh, &unique);
        let done = outcome(&step, &read, &seen, answer);
        assert!(land(host, &done), "{step:?} did not land");
        (done.again, done.writes.len())
    }

    /// The delivery's probe of `host` at `fresh` said `progress`.
    fn probed(host: &mut Host, fresh: &Fresh, progress: Progress) -> (Again, usize) {
        answered(host, Step::DeliverOverSsh, fresh, Answer::Delivery(Ok(progress)))
    }

    fn delivery_started(host: &Host) -> bool {
        let op = host.status.as_ref().unwrap().operation.as_ref();
        op.is_some_and(|op| op.bootstrap_delivered)
    }

    /// Claimed: no ramdisk, no image. The delivery waits for the staged data, is recorded once
    /// the server says its run started (the staged copy then goes), and its run's success
    /// makes the host Provisioned as the machine reconciler expects: the image asked for, the
    /// address siteboot reaches it at.
    #[test]
    fn an_adopted_host_claimed_gets_its_data_over_ssh_and_is_provisioned() {
        let mut host = delivering();
        let state = |h: &Host| h.status.as_ref().unwrap().state;
        assert_eq!(state(&host), Some(HostState::Provisioning));
        let fresh = at(1);
        let waiting = probed(&mut host, &fresh, Progress::NotStarted);
        assert_eq!(waiting, (Again::After(DELIVERY_CHECK), 0));
        assert!(!delivery_started(&host));
        let started = probed(&mut host, &fresh, Progress::Running);
        assert_eq!(started, (Again::After(DELIVERY_CHECK), 1));
        assert!(delivery_started(&host));
        assert_eq!(state(&host), Some(HostState::Provisioning));
        assert_eq!(next(&host, &observed(&fresh, &MacStanding::Unique)), Step::DeliverOverSsh);
        // Still running: nothing new to write.
        let running = probed(&mut host, &fresh, Progress::Running);
        assert_eq!(running.1, 0);
        probed(&mut host, &fresh, Progress::Finished(0));
        let status = host.status.as_ref().unwrap();
        assert_eq!(status.state, Some(HostState::Provisioned));
        assert_eq!(status.operation, None);
        let installed = status.installed.as_ref().unwrap();
        assert_eq!(Some(&installed.image), host.spec.provisioning.as_ref().map(|p| &p.image));
        assert!(!installed.disk_boot_pending);
        assert_eq!(status.addresses[0].address, "10.0.0.7");
        assert!(status.wipe_required, "a tenant's node now: released only through a reset");
        let ready = crate::crd::condition(&status.conditions, crate::conditions::READY).unwrap();
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("True", "Provisioned"));
        assert!(matches!(settled(&mut host, &fresh), Step::Idle { .. }));
    }

    /// The pass that started the run died before its record: the status still says nothing
    /// left, so the next pass's step is the delivery again, which probes first
    /// ([`crate::ssh::deliver`]) and learns the run started: recorded, never started again.
    /// A record whose marker the server lost is said, not delivered again.
    #[test]
    fn a_delivery_resumed_after_a_crash_probes_and_records_what_the_server_says() {
        let mut host = delivering();
        let fresh = at(1);
        assert!(!delivery_started(&host));
        assert_eq!(next(&host, &observed(&fresh, &MacStanding::Unique)), Step::DeliverOverSsh);
        let resumed = probed(&mut host, &fresh, Progress::Finished(0));
        assert_eq!(resumed.1, 1);
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Provisioned));

        let mut host = delivering();
        probed(&mut host, &fresh, Progress::Running);
        let id = host.status.as_ref().unwrap().operation.as_ref().unwrap().id.clone();
        let lost = Answer::Delivery(Err(Stalled::MarkerLost(id.parse().unwrap()).into()));
        answered(&mut host, Step::DeliverOverSsh, &fresh, lost);
        let (status, reason, message) = ssh_ready(&host).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("False", "SSHDeliveryFailed"));
        assert!(message.contains("not run again"), "{message}");
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Provisioning));
    }

    /// A step that fails (the server cannot be adopted, a wrong host key, another delivery's
    /// marker) is SSHReady False naming it, tried again later and later, never Provisioned; a
    /// run that failed or never ended quarantines the host: its data is not run twice.
    #[test]
    fn a_failed_delivery_is_not_provisioned_and_is_tried_again_or_quarantined() {
        let mut host = delivering();
        let fresh = at(1);
        let check = StepFailed::Failed {
            what: "checking the host",
            status: siteboot_ssh::ExitStatus::Code(1),
            stderr: "PID 1 is init, not systemd".into(),
        };
        let failed = answered(
            &mut host,
            Step::DeliverOverSsh,
            &fresh,
            Answer::Delivery(Err(SshAccessError::Delivery(check.into()))),
        );
        assert_eq!(failed, (Again::After(Duration::from_secs(10)), 1));
        let (status, reason, message) = ssh_ready(&host).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("False", "SSHDeliveryFailed"));
        assert!(message.contains("checking the host failed"), "{message}");
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Provisioning));
        assert_eq!(next(&host, &observed(&fresh, &MacStanding::Unique)), Step::DeliverOverSsh);
        for (answer, reason) in [
            (
                Err(SshAccessError::Connect(crate::ssh::SshError::HostKeyMismatch {
                    address: "10.0.0.7:22".into(),
                    mismatch: siteboot_ssh::HostKeyMismatch {
                        pinned: HOST_KEY_SHA256.into(),
                        presented: "SHA256:someoneelse".into(),
                    },
                })),
                "HostKeyMismatch",
            ),
            (Ok(Progress::OtherDelivery), "SSHDeliveryFailed"),
        ] {
            answered(&mut host, Step::DeliverOverSsh, &fresh, Answer::Delivery(answer));
            let (status, found, _) = ssh_ready(&host).unwrap();
            assert_eq!((status.as_str(), found.as_str()), ("False", reason));
            assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Provisioning));
        }

        let mut host = delivering();
        probed(&mut host, &fresh, Progress::Finished(2));
        let status = host.status.as_ref().unwrap();
        assert_eq!(status.state, Some(HostState::Quarantined));
        assert_eq!(status.installed, None);
        assert!(status.quarantine_reason.as_ref().unwrap().contains("exited 2"));

        let mut host = delivering();
        let late = at(DELIVERY_DEADLINE.as_secs() as i64 + 60);
        probed(&mut host, &late, Progress::Running);
        let status = host.status.as_ref().unwrap();
        assert_eq!(status.state, Some(HostState::Quarantined));
        assert!(status.quarantine_reason.as_ref().unwrap().contains("no result"));
    }

    /// `host`'s next step once its lifecycle record follows its status.
    fn settled(host: &mut Host, fresh: &Fresh) -> Step {
        let unique = MacStanding::Unique;
        loop {
            let step = next(host, &observed(fresh, &unique));
            if !matches!(step, Step::RecordStale(_)) {
                return step;
            }
            assert!(take(host, &step, &observed(fresh, &unique), Answer::NotAsked));
        }
    }

    /// An adopted host delivered and Provisioned.
    fn adopted_and_provisioned() -> Host {
        let mut host = delivering();
        probed(&mut host, &at(1), Progress::Finished(0));
        host
    }

    /// Released (the Machine deleted): reset over SSH where a network-booted host is wiped,
    /// whatever the wipe policies say (its disks are the operator's), then Available; a reset
    /// that leaves something behind keeps it from Available and is tried again.
    #[test]
    fn a_released_adopted_host_is_reset_and_only_then_available() {
        for min_wipe in [WipePolicy::Quick, WipePolicy::None] {
            let mut host = adopted_and_provisioned();
            host.spec.consumer_ref = None;
            host.spec.provisioning = None;
            let t = lifecycle::next(&host, min_wipe).unwrap();
            assert_eq!(
                (t.to, t.operation),
                (HostState::Deprovisioning, Some(OperationKind::Deprovision)),
                "{min_wipe:?}"
            );
            host.status = Some(lifecycle::apply(&host, &t, &at(2)));
            assert_eq!(lifecycle::next(&host, min_wipe), None, "{min_wipe:?}: Available unreset");
        }
        let mut host = adopted_and_provisioned();
        host.spec.consumer_ref = None;
        host.spec.provisioning = None;
        let fresh = at(2);
        let unique = MacStanding::Unique;
        let step = settled(&mut host, &fresh);
        assert!(matches!(&step, Step::Transit(t) if t.to == HostState::Deprovisioning), "{step:?}");
        assert!(take(&mut host, &step, &observed(&fresh, &unique), Answer::NotAsked));
        assert_eq!(settled(&mut host, &fresh), Step::ResetOverSsh);

        let left =
            StepFailed::LeftBehind { what: "verifying the reset", left: "/var/lib/kubelet".into() };
        let failed = answered(
            &mut host,
            Step::ResetOverSsh,
            &fresh,
            Answer::Reset(Err(SshAccessError::Reset(left))),
        );
        assert!(matches!(failed.0, Again::After(d) if d >= Duration::from_secs(10)));
        let (status, reason, message) = ssh_ready(&host).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("False", "SSHResetFailed"));
        assert!(message.contains("still there: /var/lib/kubelet"), "{message}");
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Deprovisioning));
        assert!(host.status.as_ref().unwrap().wipe_required);
        assert_eq!(next(&host, &observed(&fresh, &unique)), Step::ResetOverSsh);

        answered(&mut host, Step::ResetOverSsh, &fresh, Answer::Reset(Ok(())));
        let status = host.status.as_ref().unwrap();
        assert_eq!(status.state, Some(HostState::Available));
        assert_eq!((status.installed.as_ref(), status.wipe_required), (None, false));
        assert!(status.hardware.is_some(), "its hardware is kept");
        assert_eq!(ssh_ready(&host).unwrap().0, "True");
    }

    /// A deleted adopted host is reset before it goes, as a used host is wiped; one still
    /// claimed goes on with its delivery meanwhile, as a ramdisk is still booted.
    #[test]
    fn a_deleted_adopted_host_is_reset_before_it_goes() {
        let mut claimed = delivering();
        claimed.metadata.deletion_timestamp = Some(crate::crd::now());
        let unique = MacStanding::Unique;
        assert_eq!(next(&claimed, &observed(&at(1), &unique)), Step::DeliverOverSsh);
        let mut host = adopted_and_provisioned();
        host.spec.consumer_ref = None;
        host.spec.provisioning = None;
        host.metadata.deletion_timestamp = Some(crate::crd::now());
        let fresh = at(2);
        let unique = MacStanding::Unique;
        let mut taken = Vec::new();
        for _ in 0..10 {
            let step = next(&host, &observed(&fresh, &unique));
            if step == Step::ResetOverSsh {
                break;
            }
            assert!(take(&mut host, &step, &observed(&fresh, &unique), Answer::NotAsked));
            taken.push(step);
        }
        assert!(
            matches!(taken.last(), Some(Step::WipeBeforeDelete(t)) if t.to == HostState::Deprovisioning),
            "{taken:?}"
        );
        answered(&mut host, Step::ResetOverSsh, &fresh, Answer::Reset(Ok(())));
        assert_eq!(next(&host, &observed(&fresh, &unique)), Step::PowerOffAndLetGo);
    }

    /// An SSH Host in mode Reimage, registered, inspected over SSH and Available.
    fn reimage_available() -> Host {
        let mut host = inspecting_over_ssh_in(SshMode::Reimage);
        let fresh = at(0);
        let answer = Answer::Inspected(Ok(report(&[MAC], UUID)));
        assert!(take(
            &mut host,
            &Step::InspectOverSsh,
            &observed(&fresh, &MacStanding::Unique),
            answer
        ));
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Available));
        host
    }

    /// A Reimage host claimed, Provisioning, its kexec due.
    fn reimage_claimed() -> Host {
        let mut host = reimage_available();
        let claimed = delivering();
        host.spec.consumer_ref = claimed.spec.consumer_ref;
        host.spec.provisioning = claimed.spec.provisioning;
        let fresh = at(1);
        let step = settled(&mut host, &fresh);
        assert!(matches!(&step, Step::Transit(t) if t.to == HostState::Provisioning), "{step:?}");
        assert!(take(&mut host, &step, &observed(&fresh, &MacStanding::Unique), Answer::NotAsked));
        host
    }

    /// What the kexec step leaves when it starts the kexec: the token stored before it left
    /// (by the reconciler, mid-step), then the outcome of `answer`.
    fn kexec(host: &mut Host, fresh: &Fresh, answer: Answer) {
        let read = host.clone();
        let token = out_of_band_token(&read, "hash".into(), &fresh.now, TokenCarrier::Kexec);
        assert!(land(host, &Outcome::writing(token.unwrap())));
        let unique = MacStanding::Unique;
        let seen = observed(fresh, &unique);
        assert!(land(host, &outcome(&Step::KexecOverSsh, &read, &seen, answer)));
    }

    /// The ramdisk's report that the image is written, as the agent API records it.
    fn ramdisk_reports_written(host: &mut Host) {
        let status = host.status.as_mut().unwrap();
        let op = status.operation.as_mut().unwrap();
        op.last_heard = Some(at(30).now);
        assert!(lifecycle::hand_out(status, &host.spec.provisioning.clone().unwrap().image, None));
        host.status =
            Some(lifecycle::completed(host, OperationKind::Provision, true, "", None, &at(60)));
    }

    /// Claimed: kexec'ed over SSH into the ramdisk (its token stored first, for any address),
    /// recorded so it is not asked again every pass; the ramdisk's report makes it Provisioned,
    /// and no BMC is asked to boot the disk (the ramdisk reboots into it).
    #[test]
    fn a_claimed_reimage_host_is_kexeced_into_its_ramdisk_and_provisioned() {
        let mut host = reimage_claimed();
        let fresh = at(2);
        assert!(!lifecycle::adopted(&host));
        assert_eq!(settled(&mut host, &fresh), Step::KexecOverSsh);
        kexec(&mut host, &fresh, Answer::Kexec(Ok(Kexecuted::Started)));
        let op = host.status.as_ref().unwrap().operation.clone().unwrap();
        assert_eq!(op.boot_requested.as_ref(), Some(&fresh.now));
        assert_eq!(
            (op.token_hash.as_deref(), op.token_issued.as_ref()),
            (Some("hash"), Some(&fresh.now))
        );
        assert!(op.token_via_ssh && op.token_out_of_band() && op.token_address.is_none());
        assert_eq!(
            next(&host, &observed(&at(3), &MacStanding::Unique)),
            Step::Idle { again: SILENCE_CHECK }
        );
        // Its silence is timed from the token, as for a BMC's boot.
        let silent = at(601 + 2);
        assert!(lifecycle::silent(&host, Duration::from_secs(600), &silent).is_some());
        ramdisk_reports_written(&mut host);
        let status = host.status.as_ref().unwrap();
        assert_eq!(status.state, Some(HostState::Provisioned));
        assert!(!status.installed.as_ref().unwrap().disk_boot_pending);
        assert!(!lifecycle::disk_boot_due(&host));
        let step = settled(&mut host, &at(61));
        assert!(matches!(step, Step::Idle { .. }), "{step:?}");
    }

    /// A login refused at the host key: SSHReady False says the host cannot be reached to boot
    /// its ramdisk and why, nothing is recorded started, the kexec is tried again later and the
    /// host is never Provisioned meanwhile.
    #[test]
    fn a_kexec_refused_at_the_host_key_is_said_and_tried_again() {
        let mut host = reimage_claimed();
        let fresh = at(2);
        let mismatch = SshAccessError::KexecUnreachable(Box::new(SshAccessError::Connect(
            crate::ssh::SshError::HostKeyMismatch {
                address: "10.0.0.7:22".into(),
                mismatch: siteboot_ssh::HostKeyMismatch {
                    pinned: HOST_KEY_SHA256.into(),
                    presented: "SHA256:someoneelse".into(),
                },
            },
        )));
        let (again, writes) =
            answered(&mut host, Step::KexecOverSsh, &fresh, Answer::Kexec(Err(mismatch)));
        assert_eq!((again, writes), (Again::After(Duration::from_secs(10)), 1));
        let (status, reason, message) = ssh_ready(&host).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("False", "HostKeyMismatch"));
        assert!(
            message.contains("cannot be reached over SSH to kexec it into its ramdisk"),
            "{message}"
        );
        assert!(message.contains("nothing was sent"), "{message}");
        let op = host.status.as_ref().unwrap().operation.clone().unwrap();
        assert_eq!((op.boot_requested, op.token_hash), (None, None));
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Provisioning));
        assert_eq!(settled(&mut host, &fresh), Step::KexecOverSsh);
        // A step that failed on the server, or no ramdisk files here: said, tried again.
        for (e, reason) in [
            (
                SshAccessError::Kexec(StepFailed::Failed {
                    what: "checking the host can kexec",
                    status: siteboot_ssh::ExitStatus::Code(1),
                    stderr: "kexec is not installed".into(),
                }),
                "SSHKexecFailed",
            ),
            (
                siteboot_ssh::reimage::RamdiskFilesError::NoHttpRoot.into(),
                "RamdiskFilesUnavailable",
            ),
        ] {
            answered(&mut host, Step::KexecOverSsh, &fresh, Answer::Kexec(Err(e)));
            assert_eq!(ssh_ready(&host).unwrap().1, reason);
            assert_eq!(settled(&mut host, &fresh), Step::KexecOverSsh);
        }
        // Then it works: SSHReady True again.
        kexec(&mut host, &fresh, Answer::Kexec(Ok(Kexecuted::Started)));
        assert_eq!(ssh_ready(&host).unwrap().0, "True");
    }

    /// The pass that started the kexec died before its record: the next pass's kexec step
    /// finds the server's marker (crate::ssh::kexec_on sends nothing more) and records it; a
    /// token write that did not land starts nothing and records nothing. Long after, with the
    /// ramdisk never heard, the step is due again (and finds the marker again).
    #[test]
    fn a_kexec_found_started_after_a_crash_is_recorded_not_repeated() {
        let mut host = reimage_claimed();
        let fresh = at(2);
        let (again, writes) = answered(
            &mut host,
            Step::KexecOverSsh,
            &fresh,
            Answer::Kexec(Ok(Kexecuted::NotIssued)),
        );
        assert_eq!((again, writes), (Again::After(Duration::ZERO), 0));
        let found = Answer::Kexec(Ok(Kexecuted::AlreadyStarted));
        answered(&mut host, Step::KexecOverSsh, &fresh, found);
        let op = host.status.as_ref().unwrap().operation.clone().unwrap();
        assert_eq!(op.boot_requested.as_ref(), Some(&fresh.now));
        assert!(!lifecycle::kexec_due(&host, fresh.now.0.as_second() + 60));
        let later = fresh.now.0.as_second() + lifecycle::BOOT_RETRY.as_secs() as i64 + 1;
        assert!(lifecycle::kexec_due(&host, later));
        // Once the ramdisk spoke, never.
        host.status.as_mut().unwrap().operation.as_mut().unwrap().last_heard =
            Some(fresh.now.clone());
        assert!(!lifecycle::kexec_due(&host, later));
    }

    /// Released, a Reimage host is wiped by a ramdisk: booted through its BMC if it has one,
    /// else by kexec over SSH again.
    #[test]
    fn the_wipe_of_a_released_reimage_host_boots_through_the_bmc_or_by_kexec() {
        let mut host = reimage_claimed();
        kexec(&mut host, &at(2), Answer::Kexec(Ok(Kexecuted::Started)));
        ramdisk_reports_written(&mut host);
        host.spec.consumer_ref = None;
        host.spec.provisioning = None;
        let fresh = at(70);
        let step = settled(&mut host, &fresh);
        assert!(matches!(&step, Step::Transit(t) if t.to == HostState::Deprovisioning), "{step:?}");
        assert!(take(&mut host, &step, &observed(&fresh, &MacStanding::Unique), Answer::NotAsked));
        assert!(!lifecycle::needs_ssh_reset(&host), "wiped, not reset");
        assert_eq!(settled(&mut host, &fresh), Step::KexecOverSsh);
        // Deleted meanwhile: the wipe's kexec goes on.
        let mut deleted = host.clone();
        deleted.metadata.deletion_timestamp = Some(crate::crd::now());
        assert_eq!(next(&deleted, &observed(&fresh, &MacStanding::Unique)), Step::KexecOverSsh);
        let mut with_bmc = host.clone();
        with_bmc.spec.bmc = registering().spec.bmc;
        assert_eq!(next(&with_bmc, &observed(&fresh, &MacStanding::Unique)), Step::RequestBoot);
        assert!(!lifecycle::kexec_due(&with_bmc, fresh.now.0.as_second()));
    }

    fn operation(id: &str, virtual_media: bool) -> Operation {
        Operation { virtual_media, ..Operation::new(OperationKind::Inspect, id.into(), at(0).now) }
    }

    fn running(id: &str) -> Host {
        let mut host = registering();
        host.status.as_mut().unwrap().operation = Some(operation(id, false));
        host
    }

    /// The BMC's check: a failure is written once with a warning and asked again after 10 s,
    /// then later as it keeps failing; the system found lets the Host go on at once.
    #[test]
    fn a_bmc_check_is_written_and_asked_again_later_and_later() {
        let mut host = registering();
        let unique = MacStanding::Unique;
        let fresh = at(0);
        let seen = observed(&fresh, &unique);
        let refused = || {
            Answer::Identity(Err(BmcError::Credentials {
                name: "creds".into(),
                why: "is missing".into(),
            }))
        };
        let read = host.clone();
        let failed = outcome(&Step::CheckBmc, &read, &seen, refused());
        assert_eq!(failed.writes.len(), 1);
        let note = failed.writes[0].note.clone().unwrap();
        assert!(note.is_warning() && note.log.starts_with("BMC check: "), "{note:?}");
        assert_eq!(failed.again, Again::After(Duration::from_secs(10)));
        assert!(land(&mut host, &failed));
        let condition = crate::crd::condition(&host.status.as_ref().unwrap().conditions, BMC_READY);
        assert_eq!(condition.map(|c| c.status.as_str()), Some("False"));
        // The same failure again: nothing to write, asked again as late as it has been failing.
        let read = host.clone();
        let since = condition.unwrap().last_transition_time.0.as_second();
        let later = Fresh {
            now: Time(k8s_openapi::jiff::Timestamp::from_second(since + 120).unwrap()),
            ..at(0)
        };
        let seen_later = observed(&later, &unique);
        let again = outcome(&Step::CheckBmc, &read, &seen_later, refused());
        assert_eq!((again.writes.len(), again.again), (0, Again::After(Duration::from_secs(120))));
        // Found: True, and on at once.
        let found =
            Answer::Identity(Ok(Some(Identity { uuid: "u".into(), macs: vec![MAC.into()] })));
        let ok = outcome(&Step::CheckBmc, &read, &seen, found);
        assert_eq!(ok.again, Again::After(Duration::ZERO));
        assert!(land(&mut host, &ok));
        let condition = crate::crd::condition(&host.status.as_ref().unwrap().conditions, BMC_READY);
        assert_eq!(condition.map(|c| c.status.as_str()), Some("True"));
    }

    /// Booting the ramdisk: recorded at the pass's time, for the operation asked for only; a
    /// refusal writes nothing and is tried again in a minute.
    #[test]
    fn a_ramdisk_boot_is_recorded_for_its_operation_or_tried_again() {
        let mut host = running("op-a");
        let unique = MacStanding::Unique;
        let fresh = at(5);
        let seen = observed(&fresh, &unique);
        let read = host.clone();
        let refused = outcome(&Step::RequestBoot, &read, &seen, Answer::Done(Err("503".into())));
        assert!(refused.writes.is_empty());
        assert_eq!(refused.again, Again::After(REBOOT_RETRY));
        let note = refused.note.unwrap();
        assert_eq!(
            note.event,
            Some(("BootFailed".into(), "booting the ramdisk of operation op-a: 503".into()))
        );
        let booted = outcome(&Step::RequestBoot, &read, &seen, Answer::Done(Ok(())));
        assert_eq!(
            booted.writes[0].change,
            Change::Status(StatusChange::BootRequested {
                operation: "op-a".into(),
                at: fresh.now.clone()
            })
        );
        assert_eq!(booted.again, Again::After(SILENCE_CHECK));
        // Another operation started meanwhile: the record is not its.
        let mut moved_on = running("op-b");
        assert!(!land(&mut moved_on, &booted), "written over another operation");
        assert!(land(&mut host, &booted));
        let op = host.status.as_ref().unwrap().operation.as_ref().unwrap();
        assert_eq!(op.boot_requested.as_ref(), Some(&fresh.now));
    }

    /// Virtual media: the token's hash is stored before the media goes in, for that operation,
    /// never once the bootstrap data left.
    #[test]
    fn a_media_token_is_stored_for_its_operation_until_the_data_left() {
        let mut host = registering();
        host.status.as_mut().unwrap().operation = Some(operation("op-a", true));
        let fresh = at(7);
        let carrier = TokenCarrier::VirtualMedia;
        let write = out_of_band_token(&host, "hash".into(), &fresh.now, carrier).unwrap();
        let Change::Status(change) = &write.change else { panic!("{write:?}") };
        let status = change.apply(&host).expect("stored");
        let op = status.operation.as_ref().unwrap();
        assert_eq!(
            (op.token_hash.as_deref(), op.token_issued.as_ref()),
            (Some("hash"), Some(&fresh.now))
        );
        assert!(status.media_inserted);
        let mut delivered = host.clone();
        delivered.status.as_mut().unwrap().operation.as_mut().unwrap().bootstrap_delivered = true;
        assert_eq!(change.apply(&delivered), None, "no new token once the data left");
        let mut other = host.clone();
        other.status.as_mut().unwrap().operation = Some(operation("op-b", true));
        assert_eq!(change.apply(&other), None, "not another operation's");
    }

    /// The reboot annotation: carried out then removed; kept while the BMC fails; without a
    /// BMC, removed with the operator told.
    #[test]
    fn the_reboot_annotation_is_removed_once_done_or_impossible() {
        let host = annotated(registering(), REBOOT_ANNOTATION);
        let unique = MacStanding::Unique;
        let fresh = at(0);
        let seen = observed(&fresh, &unique);
        let removal = Change::PlainPatch(
            json!({ "metadata": { "annotations": { REBOOT_ANNOTATION: null } } }),
        );
        let done = outcome(&Step::Reboot(Reboot::PowerCycle), &host, &seen, Answer::Done(Ok(())));
        assert_eq!(done.writes.iter().map(|w| &w.change).collect::<Vec<_>>(), [&removal]);
        assert_eq!(done.note.as_ref().unwrap().event.as_ref().unwrap().0, "Rebooted");
        assert_eq!(done.again, Again::After(AFTER_REBOOT));
        let failed =
            outcome(&Step::Reboot(Reboot::PowerCycle), &host, &seen, Answer::Done(Err("x".into())));
        assert!(failed.writes.is_empty());
        assert_eq!(failed.again, Again::After(REBOOT_RETRY));
        let none = outcome(&Step::Reboot(Reboot::NoBmc), &host, &seen, Answer::NotAsked);
        assert_eq!(none.writes.iter().map(|w| &w.change).collect::<Vec<_>>(), [&removal]);
        let note = none.note.unwrap();
        assert!(note.is_warning() && note.log.contains("power-cycle it by hand"), "{note:?}");
        let mut landed = host.clone();
        assert!(land(&mut landed, &done));
        assert!(!landed.annotations().contains_key(REBOOT_ANNOTATION));
    }

    /// The retry annotation ends one quarantine: once the Host is Registering again it is
    /// removed, so a later quarantine is not ended unasked.
    #[test]
    fn the_retry_annotation_is_removed_after_the_quarantine_it_ended() {
        let mut host = annotated(registering(), RETRY_ANNOTATION);
        host.status.as_mut().unwrap().state = Some(HostState::Quarantined);
        let unique = MacStanding::Unique;
        let fresh = at(0);
        let mut taken = Vec::new();
        loop {
            let step = next(&host, &observed(&fresh, &unique));
            if matches!(step, Step::CheckBmc) || taken.len() == 6 {
                break;
            }
            assert!(take(&mut host, &step, &observed(&fresh, &unique), Answer::NotAsked));
            taken.push(step);
        }
        assert!(
            matches!(&taken[..], [Step::RecordStale(_), Step::Transit(t), Step::RecordStale(_), Step::ClearRetry] if t.to == HostState::Registering),
            "{taken:?}"
        );
        assert!(!host.annotations().contains_key(RETRY_ANNOTATION));
    }

    /// A transition is written only if the Host as read again still calls for it.
    #[test]
    fn a_transition_is_not_written_over_a_host_that_moved_on() {
        let host = Host::new("h", HostSpec::new(MAC));
        let unique = MacStanding::Unique;
        let fresh = at(0);
        let seen = observed(&fresh, &unique);
        let Some(t) = plan::transition(&host, &seen) else { panic!("a new Host registers") };
        let planned = outcome(&Step::Transit(t.clone()), &host, &seen, Answer::NotAsked);
        let note = planned.writes[0].note.clone().unwrap();
        assert_eq!(note.event.unwrap().0, t.reason);
        let mut registered = host.clone();
        assert!(land(&mut registered, &planned));
        assert_eq!(registered.status.as_ref().unwrap().state, Some(t.to));
        assert!(!land(&mut registered, &planned), "written twice");
        assert_eq!(planned.again, Again::After(IDLE));
    }

    /// A deleted Host: waits for its consumer, is wiped, then powered off and let go; a
    /// failed power-off is said and does not keep it.
    #[test]
    fn a_deleted_host_is_wiped_then_powered_off_and_let_go() {
        let unique = MacStanding::Unique;
        let fresh = at(0);
        let mut host = registering();
        let status = host.status.as_mut().unwrap();
        // Quarantined mid-provisioning: nothing moves it on by itself.
        status.state = Some(HostState::Quarantined);
        status.wipe_required = true;
        host.spec.consumer_ref = Some(crate::crd::ConsumerRef {
            api_version: "v".into(),
            kind: "SitebootMachine".into(),
            namespace: "ns".into(),
            name: "m".into(),
            uid: "u".into(),
        });
        host.metadata.deletion_timestamp = Some(fresh.now.clone());
        let step = |h: &Host| next(h, &observed(&fresh, &unique));
        assert_eq!(step(&host), Step::AwaitDeletion);
        host.spec.consumer_ref = None;
        let wipe = step(&host);
        let Step::WipeBeforeDelete(t) = &wipe else { panic!("{wipe:?}") };
        assert_eq!(t.operation, Some(OperationKind::Deprovision));
        assert!(take(&mut host, &wipe, &observed(&fresh, &unique), Answer::NotAsked));
        assert_eq!(step(&host), Step::RequestBoot, "the wipe's ramdisk is booted");
        let status = host.status.as_mut().unwrap();
        status.operation = None;
        status.wipe_required = false;
        assert_eq!(step(&host), Step::PowerOffAndLetGo);
        let read = host.clone();
        let seen = observed(&fresh, &unique);
        let off =
            outcome(&Step::PowerOffAndLetGo, &read, &seen, Answer::Done(Err("timeout".into())));
        assert!(
            off.note.as_ref().unwrap().log.contains("cannot power off the deleted host: timeout")
        );
        assert_eq!(off.again, Again::OnChange);
        assert!(land(&mut host, &off));
        assert_eq!(step(&host), Step::Gone);
        // Deleted by a move: let go untouched.
        let mut moved = annotated(registering(), crate::crd::capi::DELETE_FOR_MOVE_ANNOTATION);
        moved.metadata.deletion_timestamp = Some(fresh.now.clone());
        assert_eq!(step(&moved), Step::LetGoMoved);
    }

    /// The MAC report: this Host's condition, and the others' that change with it; one that
    /// does not keep the MAC is said loudly.
    #[test]
    fn a_shared_mac_is_reported_on_every_host_that_has_it() {
        let first = std::sync::Arc::new(Host::new("first", HostSpec::new(MAC)));
        let second = Host::new("second", HostSpec::new(MAC));
        let owner = MacStanding::Owner { here: vec!["second".into()], elsewhere: 0 };
        let others = [(first.clone(), owner.clone())];
        let duplicate = MacStanding::Duplicate { owner: Some("first".into()) };
        let fresh = at(0);
        let seen = Observed { others: &others, ..observed(&fresh, &duplicate) };
        let report = outcome(&Step::ReportMac, &second, &seen, Answer::NotAsked);
        let targets: Vec<String> = report.writes.iter().map(|w| w.target.name_any()).collect();
        assert_eq!(targets, ["second", "first"]);
        assert!(report.writes[0].note.as_ref().is_some_and(|n| n.is_warning()));
        assert_eq!(report.writes[1].note, None, "the owner keeps it: no warning");
        // The owner's condition already says so: only this Host's is written.
        let mut written = (*first).clone();
        assert!(land(&mut written, &report));
        let others = [(std::sync::Arc::new(written), owner)];
        let seen = Observed { others: &others, ..observed(&fresh, &duplicate) };
        let report = outcome(&Step::ReportMac, &second, &seen, Answer::NotAsked);
        assert_eq!(report.writes.len(), 1);
    }

    /// Media of an ended operation: ejected then recorded; a failure is tried again in a minute.
    /// Power: written only when the reading changed.
    #[test]
    fn ejected_media_and_power_readings_are_recorded_when_they_change() {
        let mut host = registering();
        host.status.as_mut().unwrap().media_inserted = true;
        let unique = MacStanding::Unique;
        let fresh = at(0);
        let seen = observed(&fresh, &unique);
        let read = host.clone();
        let failed = outcome(&Step::EjectMedia, &read, &seen, Answer::Done(Err("x".into())));
        assert_eq!((failed.writes.len(), failed.again), (0, Again::After(EJECT_RETRY)));
        let ejected = outcome(&Step::EjectMedia, &read, &seen, Answer::Done(Ok(())));
        assert!(land(&mut host, &ejected));
        assert!(!host.status.as_ref().unwrap().media_inserted);
        let idle = Step::Idle { again: IDLE };
        let read = host.clone();
        let on = outcome(&idle, &read, &seen, Answer::Power(Some(PowerState::On)));
        assert_eq!(on.writes.len(), 1);
        assert!(land(&mut host, &on));
        let read = host.clone();
        let same = outcome(&idle, &read, &seen, Answer::Power(Some(PowerState::On)));
        assert_eq!((same.writes.len(), same.again), (0, Again::After(IDLE)));
        let unknown = outcome(&idle, &read, &seen, Answer::NotAsked);
        assert!(unknown.writes.is_empty());
    }
}
