//! The Host reconciler's decision, as `machine::plan` is the SitebootMachine's: from the Host
//! as read and what else the pass observed (the clock and fresh ids, where the Host stands among
//! the Hosts sharing its boot MAC, the site's settings), the one step this pass takes. Pure: no
//! I/O, no clock, no randomness, so every branch is a millisecond test. What a step writes, once
//! the BMC answered if it asks the BMC something, is data too ([`super::write::outcome`]); the
//! reconciler performs it, and a step whose write lands looks again at once.

use std::sync::Arc;
use std::time::Duration;

use super::lifecycle::{self, Deletion, FINALIZER, Fresh, Reboot, Transition};
use super::record;
use super::write::Recheck;
use crate::conditions::{BOOT_MAC_UNIQUE, check_paused};
use crate::crd::{Host, HostState, WipePolicy, set_condition};
use crate::pools::MacStanding;

/// What the pass observed besides the Host.
pub struct Observed<'a> {
    /// The pass's clock and ids.
    pub fresh: &'a Fresh,
    /// Where the Host stands among the Hosts with its boot MAC.
    pub mac: &'a MacStanding,
    /// The other Hosts with its boot MAC, and where each stands: a change of this Host's
    /// standing changes theirs, and nothing else would wake them.
    pub others: &'a [(Arc<Host>, MacStanding)],
    /// How long a ramdisk may say nothing during an operation.
    pub max_silence: Duration,
    /// The site's least wipe.
    pub min_wipe: WipePolicy,
}

/// The one thing the pass does.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// The `Paused` condition no longer says what the annotation does: write it.
    ReportPaused,
    /// Paused: nothing until the Host changes.
    Paused,
    /// Every Host carries the finalizer, so a deleted one is wiped before it goes.
    AddFinalizer,
    /// A Host with no state but a lifecycle record (moved, restored): its status rebuilt.
    Restore { status: Box<crate::crd::HostStatus>, reason: &'static str, message: String },
    /// The lifecycle record annotation lags the status: rewrite it.
    RecordStale(String),
    /// The `BootMACUnique` condition no longer says where the Host stands: write it (and the
    /// others' with that MAC).
    ReportMac,
    /// Another Host owns the boot MAC: this one does nothing.
    Disowned,
    /// The retry annotation outlived the quarantine it ended: removed, so that it does not end
    /// the next one unasked.
    ClearRetry,
    /// The lifecycle's next state.
    Transit(Transition),
    /// Have the BMC boot the ramdisk of the operation under way.
    RequestBoot,
    /// Kexec the host over SSH into the ramdisk of the operation under way: a Reimage host's
    /// [`Step::RequestBoot`].
    KexecOverSsh,
    /// Have the BMC boot the disk just written.
    RequestDiskBoot,
    /// Eject the virtual media of an operation that ended.
    EjectMedia,
    /// Ask the BMC for the host's identity (registration).
    CheckBmc,
    /// Log in to the host over SSH with its pinned host key (registration, without a BMC).
    CheckSsh,
    /// Inspect the host over SSH: it runs, and boots no ramdisk.
    InspectOverSsh,
    /// Probe an adopted host's delivery over SSH, and start it if it never was: the
    /// provisioning of a host that keeps its OS.
    DeliverOverSsh,
    /// Reset a released adopted host over SSH: its wipe.
    ResetOverSsh,
    /// Reboot or power as the Host's annotation asks.
    Reboot(Reboot),
    /// Nothing to change: refresh the power reading, look again after `again`.
    Idle { again: Duration },
    /// Deleted, and its disks may hold a tenant's data: the wipe first ([`lifecycle::on_delete`]).
    WipeBeforeDelete(Transition),
    /// Deleted, and its consumer still holds it or its wipe runs: look again soon.
    AwaitDeletion,
    /// Deleted by `clusterctl move`: let go untouched (it lives on in the target cluster).
    LetGoMoved,
    /// Deleted, released and wiped (or forced): power it off and let go.
    PowerOffAndLetGo,
    /// Deleted, and the finalizer already gone.
    Gone,
}

/// How often a Host with nothing to do is looked at again.
pub const IDLE: Duration = Duration::from_secs(300);
/// How often a Host whose ramdisk works is checked for silence.
pub const SILENCE_CHECK: Duration = Duration::from_secs(30);
/// How often a deleted Host that waits for its release or wipe is looked at again.
pub const DELETION_CHECK: Duration = Duration::from_secs(30);

/// The step for `host`, given what the pass `seen`.
pub fn next(host: &Host, seen: &Observed) -> Step {
    let conditions = host.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    let mut paused_conditions = conditions.to_vec();
    let paused = check_paused(None, host, &mut paused_conditions);
    if paused_conditions != conditions {
        return Step::ReportPaused;
    }
    if paused {
        return Step::Paused;
    }
    if host.metadata.deletion_timestamp.is_some() {
        return deletion(host, seen);
    }
    if !has_finalizer(host) {
        return Step::AddFinalizer;
    }
    if let Some((status, reason, message)) = record::restore(host, &seen.fresh.now) {
        return Step::Restore { status: Box::new(status), reason, message };
    }
    if let Some(value) = record::stale(host) {
        return Step::RecordStale(value);
    }
    if mac_condition_stale(host, seen.mac) {
        return Step::ReportMac;
    }
    if matches!(seen.mac, MacStanding::Duplicate { .. }) {
        return Step::Disowned;
    }
    let state = host.status.as_ref().and_then(|s| s.state);
    if lifecycle::retry_requested(host) && state != Some(HostState::Quarantined) {
        return Step::ClearRetry;
    }
    if let Some(transition) = transition(host, seen) {
        return Step::Transit(transition);
    }
    if lifecycle::boot_due(host, seen.fresh.now.0.as_second()) {
        return Step::RequestBoot;
    }
    if lifecycle::kexec_due(host, seen.fresh.now.0.as_second()) {
        return Step::KexecOverSsh;
    }
    if lifecycle::disk_boot_due(host) {
        return Step::RequestDiskBoot;
    }
    if lifecycle::media_to_eject(host) {
        return Step::EjectMedia;
    }
    if lifecycle::needs_bmc_check(host) {
        return Step::CheckBmc;
    }
    if lifecycle::needs_ssh_check(host) {
        return Step::CheckSsh;
    }
    if lifecycle::needs_ssh_inspection(host) {
        return Step::InspectOverSsh;
    }
    if lifecycle::needs_ssh_delivery(host) {
        return Step::DeliverOverSsh;
    }
    if lifecycle::needs_ssh_reset(host) {
        return Step::ResetOverSsh;
    }
    if let Some(reboot) = lifecycle::reboot(host) {
        return Step::Reboot(reboot);
    }
    // While a ramdisk works, look again soon enough to notice it falling silent.
    let operation = host.status.as_ref().is_some_and(|s| s.operation.is_some());
    Step::Idle { again: if operation { seen.max_silence.min(SILENCE_CHECK) } else { IDLE } }
}

/// A deleted Host goes once its consumer let go and its disks are wiped
/// ([`lifecycle::on_delete`]); meanwhile its lifecycle goes on: a consumer that lets go waits
/// for the wipe it starts. An adopted host's delivery and reset go on as a ramdisk's boot does,
/// and so does a Reimage host's kexec.
fn deletion(host: &Host, seen: &Observed) -> Step {
    if !has_finalizer(host) {
        return Step::Gone;
    }
    match lifecycle::on_delete(host, seen.min_wipe) {
        Deletion::WaitForRelease | Deletion::WaitForWipe => match transition(host, seen) {
            Some(t) => Step::Transit(t),
            None if lifecycle::boot_due(host, seen.fresh.now.0.as_second()) => Step::RequestBoot,
            None if lifecycle::kexec_due(host, seen.fresh.now.0.as_second()) => Step::KexecOverSsh,
            None if lifecycle::needs_ssh_delivery(host) => Step::DeliverOverSsh,
            None if lifecycle::needs_ssh_reset(host) => Step::ResetOverSsh,
            None => Step::AwaitDeletion,
        },
        Deletion::Wipe(t) => Step::WipeBeforeDelete(t),
        Deletion::Moved => Step::LetGoMoved,
        Deletion::Finish => Step::PowerOffAndLetGo,
    }
}

fn has_finalizer(host: &Host) -> bool {
    host.metadata.finalizers.iter().flatten().any(|f| f == FINALIZER)
}

/// The lifecycle's next transition, or quarantine for a ramdisk gone silent: what
/// [`Step::Transit`] writes, and what the write checks again on the Host it reads back.
pub fn transition(host: &Host, seen: &Observed) -> Option<Transition> {
    Recheck::lifecycle(seen).transition(host, seen.fresh)
}

/// Whether the Host's `BootMACUnique` condition differs from what `standing` says.
pub fn mac_condition_stale(host: &Host, standing: &MacStanding) -> bool {
    let (unique, reason, message) = standing.condition(&host.spec.boot_mac_address);
    let mut conditions = host.status.as_ref().map(|s| s.conditions.clone()).unwrap_or_default();
    let generation = host.metadata.generation;
    set_condition(
        &mut conditions,
        BOOT_MAC_UNIQUE,
        unique,
        &reason.to_string(),
        &message,
        generation,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::HostSpec;
    use crate::host::write::{Answer, tests::take};

    const MIN_WIPE: WipePolicy = WipePolicy::Quick;

    fn seen<'a>(fresh: &'a Fresh, mac: &'a MacStanding) -> Observed<'a> {
        let others = &[];
        Observed { fresh, mac, others, max_silence: Duration::from_secs(600), min_wipe: MIN_WIPE }
    }

    /// What the step's writes leave on the Host (the BMC is asked nothing).
    fn perform(host: &mut Host, step: &Step, mac: &MacStanding) {
        let fresh = Fresh::now();
        assert!(take(host, step, &seen(&fresh, mac), Answer::NotAsked), "{step:?} did not land");
    }

    /// The steps a Host takes until `until` says stop (at most 10).
    fn steps(host: &mut Host, mac: &MacStanding, until: impl Fn(&Step) -> bool) -> Vec<Step> {
        let fresh = Fresh::now();
        let mut taken = Vec::new();
        for _ in 0..10 {
            let step = next(host, &seen(&fresh, mac));
            if until(&step) {
                taken.push(step);
                return taken;
            }
            perform(host, &step, mac);
            taken.push(step);
        }
        panic!("no end after {taken:?}")
    }

    fn names(steps: &[Step]) -> Vec<&'static str> {
        steps
            .iter()
            .map(|s| match s {
                Step::ReportPaused => "ReportPaused",
                Step::Paused => "Paused",
                Step::AddFinalizer => "AddFinalizer",
                Step::Restore { .. } => "Restore",
                Step::RecordStale(_) => "RecordStale",
                Step::ReportMac => "ReportMac",
                Step::Disowned => "Disowned",
                Step::Transit(_) => "Transit",
                Step::RequestBoot => "RequestBoot",
                Step::KexecOverSsh => "KexecOverSsh",
                Step::RequestDiskBoot => "RequestDiskBoot",
                Step::EjectMedia => "EjectMedia",
                Step::CheckBmc => "CheckBmc",
                Step::CheckSsh => "CheckSsh",
                Step::InspectOverSsh => "InspectOverSsh",
                Step::DeliverOverSsh => "DeliverOverSsh",
                Step::ResetOverSsh => "ResetOverSsh",
                Step::Reboot(_) => "Reboot",
                Step::Idle { .. } => "Idle",
                Step::ClearRetry => "ClearRetry",
                Step::WipeBeforeDelete(_) => "WipeBeforeDelete",
                Step::AwaitDeletion => "AwaitDeletion",
                Step::LetGoMoved => "LetGoMoved",
                Step::PowerOffAndLetGo => "PowerOffAndLetGo",
                Step::Gone => "Gone",
            })
            .collect()
    }

    /// A new Host: its bookkeeping first, one write per pass, then its lifecycle.
    #[test]
    fn a_new_host_gets_its_conditions_finalizer_and_record_then_registers() {
        let mut host = Host::new("h", HostSpec::new("52:54:00:00:00:01"));
        let taken = steps(&mut host, &MacStanding::Unique, |s| matches!(s, Step::Transit(_)));
        assert_eq!(names(&taken), ["ReportPaused", "AddFinalizer", "ReportMac", "Transit"]);
        let Step::Transit(t) = &taken[3] else { unreachable!() };
        assert_eq!(t.to, HostState::Registering);
        // Once registered, the record follows the status, then the lifecycle goes on.
        perform(&mut host, &taken[3], &MacStanding::Unique);
        let fresh = Fresh::now();
        assert!(matches!(next(&host, &seen(&fresh, &MacStanding::Unique)), Step::RecordStale(_)));
    }

    /// Another Host owns the boot MAC: the condition says so, then nothing happens.
    #[test]
    fn a_host_whose_mac_another_owns_reports_it_and_does_nothing() {
        let mut host = Host::new("h", HostSpec::new("52:54:00:00:00:01"));
        let duplicate = MacStanding::Duplicate { owner: Some("first".into()) };
        let taken = steps(&mut host, &duplicate, |s| matches!(s, Step::Disowned));
        assert_eq!(names(&taken), ["ReportPaused", "AddFinalizer", "ReportMac", "Disowned"]);
        // The owner gone, the condition is written again and the Host registers.
        let taken = steps(&mut host, &MacStanding::Unique, |s| matches!(s, Step::Transit(_)));
        assert_eq!(names(&taken), ["ReportMac", "Transit"]);
    }

    /// Paused (Cluster API's annotation): the condition, then nothing, not even a deletion.
    #[test]
    fn a_paused_host_reports_it_then_waits_even_when_deleted() {
        let mut host = Host::new("h", HostSpec::new("52:54:00:00:00:01"));
        host.metadata.annotations = Some(
            [(crate::crd::capi::PAUSED_ANNOTATION.to_owned(), String::new())].into_iter().collect(),
        );
        host.metadata.deletion_timestamp = Some(crate::crd::now());
        host.metadata.finalizers = Some(vec![FINALIZER.to_owned()]);
        let taken = steps(&mut host, &MacStanding::Unique, |s| matches!(s, Step::Paused));
        assert_eq!(names(&taken), ["ReportPaused", "Paused"]);
        host.metadata.annotations = None;
        let taken = steps(&mut host, &MacStanding::Unique, |s| matches!(s, Step::PowerOffAndLetGo));
        assert_eq!(names(&taken), ["ReportPaused", "PowerOffAndLetGo"]);
        perform(&mut host, &taken[1], &MacStanding::Unique);
        let fresh = Fresh::now();
        assert_eq!(next(&host, &seen(&fresh, &MacStanding::Unique)), Step::Gone);
    }

    /// With nothing to change, a Host is looked at again soon enough to notice its ramdisk
    /// falling silent while an operation runs, else after the idle period.
    #[test]
    fn an_idle_host_is_looked_at_again_sooner_during_an_operation() {
        let mut host = Host::new("h", HostSpec::new("52:54:00:00:00:01"));
        let taken = steps(&mut host, &MacStanding::Unique, |s| matches!(s, Step::Idle { .. }));
        assert_eq!(
            names(&taken),
            [
                "ReportPaused",
                "AddFinalizer",
                "ReportMac",
                "Transit",
                "RecordStale",
                "Transit",
                "RecordStale",
                "Idle"
            ]
        );
        assert_eq!(host.status.as_ref().unwrap().state, Some(HostState::Inspecting));
        assert_eq!(taken.last(), Some(&Step::Idle { again: SILENCE_CHECK }));
        host.status.as_mut().unwrap().operation = None;
        let fresh = Fresh::now();
        let step = next(&host, &seen(&fresh, &MacStanding::Unique));
        assert_eq!(step, Step::Idle { again: IDLE });
    }
}
