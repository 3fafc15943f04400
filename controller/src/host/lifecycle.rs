//! The Host lifecycle: from a Host (spec and status) to the one next step. The pass's time and
//! a new operation's id come in as [`Fresh`]; two places still read for themselves: [`Fresh::now`]
//! (the clock and the RNG, once per pass) and [`apply`], whose Ready condition takes its
//! transition time from the clock. The reconciler and the agent API apply the steps; both write
//! with the Host's resourceVersion, so a step computed from a stale Host is refused and
//! recomputed.
//!
//! ```text
//! Registering -> Inspecting -> Available -> Provisioning -> Provisioned -> Deprovisioning -> Available
//!                    (any failure) -> Quarantined -> (retry annotation) -> Registering
//! ```
//!
//! From the moment provisioning starts until a wipe succeeds, `status.wipeRequired` is set: a
//! host that may hold a tenant's data goes from Registering to Deprovisioning, never to
//! Available, whatever released it (a Machine deleted while the host was Quarantined, a retry).
//! Deleting a Host waits for its consumer to let go and for that wipe ([`on_delete`]).
//!
//! An [`adopted`] host (reached over SSH alone, mode Adopt) goes the same way, but no ramdisk
//! boots: Provisioning gets the Machine's bootstrap data over SSH ([`needs_ssh_delivery`]) and
//! Deprovisioning resets it over SSH ([`needs_ssh_reset`]) instead of wiping its disks, which are
//! its operator's.
//!
//! A host [`reimaged_over_ssh`] (reached over SSH alone, mode Reimage) is inspected over SSH,
//! and its ramdisk, where a BMC would boot it, is booted by kexec over SSH ([`kexec_due`]); from
//! there it goes as a network-booted host does.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use siteboot_agent_server::silence::{RamdiskContact, ramdisk_silence};

use crate::bmc::{BmcError, Identity};
use crate::conditions::{BMC_READY, SSH_READY};

use crate::crd::capi::DELETE_FOR_MOVE_ANNOTATION;
use crate::crd::{
    BootMethod, Hardware, Host, HostState, HostStatus, Image, Installed, MachineAddress, Operation,
    OperationKind, SshAccess, SshMode, WipePolicy, now, set_condition,
};

/// Annotation an operator sets on a Quarantined host to try again from Registering.
pub const RETRY_ANNOTATION: &str = "siteboot.dev/retry";
/// Keeps a deleted Host until it is released and wiped.
pub const FINALIZER: &str = "siteboot.dev/host";
/// Annotation that lets a deleted Host go at once: no wait for its consumer, no wipe.
pub const FORCE_DELETE_ANNOTATION: &str = "siteboot.dev/force-delete";

/// Annotation that power-cycles a host through its BMC, into the ramdisk when an operation is
/// running; removed once done.
pub const REBOOT_ANNOTATION: &str = "siteboot.dev/reboot";
/// How soon a failing BMC check or SSH login is tried again, at the least and at the most.
const ACCESS_RECHECK_MIN: Duration = Duration::from_secs(10);
const ACCESS_RECHECK_MAX: Duration = Duration::from_secs(300);

/// A change of state, with what the Event says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub to: HostState,
    /// The ramdisk operation the new state runs, if any.
    pub operation: Option<OperationKind>,
    /// CamelCase, for the Event and the condition.
    pub reason: &'static str,
    pub message: String,
}

/// What the reconciler should do for `host` now, on a site whose wipe between tenants is at
/// least `min_wipe`.
pub fn next(host: &Host, min_wipe: WipePolicy) -> Option<Transition> {
    let status = host.status.as_ref();
    let state = status.and_then(|s| s.state);
    let wanted = host.spec.consumer_ref.is_some() && host.spec.provisioning.is_some();
    let t = |to, operation, reason, message: &str| {
        Some(Transition { to, operation, reason, message: message.to_owned() })
    };
    match state {
        None => t(HostState::Registering, None, "Registered", "new host"),
        Some(HostState::Registering) => {
            if let Err(e) = crate::bmc::spec_of(host) {
                return t(HostState::Quarantined, None, "BMCFailed", &e.to_string());
            }
            if host.spec.boot_method == BootMethod::VirtualMedia && host.spec.bmc.is_none() {
                let why = "spec.bootMethod VirtualMedia needs spec.bmc: the media is inserted through the BMC";
                return t(HostState::Quarantined, None, "VirtualMediaNeedsBMC", why);
            }
            if let Err(e) = crate::ssh::spec_of(host) {
                return t(HostState::Quarantined, None, e.reason(), &e.to_string());
            }
            if needs_bmc_check(host) || needs_ssh_check(host) {
                // The reconciler checks the BMC ([`bmc_check`]) or logs in over SSH first.
                return None;
            }
            if status.is_some_and(|s| s.wipe_required) {
                deprovision(
                    host,
                    min_wipe,
                    "WipeBeforeReuse",
                    "the host may hold a previous tenant's data",
                )
            } else if status.and_then(|s| s.hardware.as_ref()).is_some() {
                t(HostState::Available, None, "Registered", "hardware already known")
            } else {
                t(
                    HostState::Inspecting,
                    Some(OperationKind::Inspect),
                    "InspectionStarted",
                    "waiting for the host to boot the ramdisk and report its hardware",
                )
            }
        }
        Some(HostState::Available) if wanted => t(
            HostState::Provisioning,
            Some(OperationKind::Provision),
            "ProvisioningStarted",
            &format!("claimed by {}", consumer(host)),
        ),
        Some(HostState::Provisioning) if !wanted => deprovision(
            host,
            min_wipe,
            "ProvisioningCancelled",
            "the consumer let go of the host while it was provisioning",
        ),
        Some(HostState::Provisioned) => {
            let installed = status.and_then(|s| s.installed.as_ref());
            let provisioning = host.spec.provisioning.as_ref();
            if !wanted {
                deprovision(host, min_wipe, "DeprovisioningStarted", "released by its consumer")
            } else if installed.map(|i| &i.image) != provisioning.map(|p| &p.image) {
                deprovision(
                    host,
                    min_wipe,
                    "ImageChanged",
                    "spec.provisioning.image differs from what is installed",
                )
            } else {
                None
            }
        }
        Some(HostState::Deprovisioning)
            if wipe(host, min_wipe) == WipePolicy::None && !adopted(host) =>
        {
            t(HostState::Available, None, "Deprovisioned", "wipe policy none: nothing to do")
        }
        Some(HostState::Quarantined) if retry_requested(host) => {
            t(HostState::Registering, None, "Retry", "retry requested by annotation")
        }
        // Inspecting, Provisioning, Deprovisioning: the ramdisk moves them on.
        _ => None,
    }
}

/// Quarantines a host whose ramdisk fell silent during the operation under way (see
/// [`ramdisk_silence`], the rule standalone mode applies too).
pub fn silent(host: &Host, max_silence: Duration, fresh: &Fresh) -> Option<Transition> {
    let status = host.status.as_ref()?;
    if !matches!(
        status.state,
        Some(HostState::Inspecting | HostState::Provisioning | HostState::Deprovisioning)
    ) {
        return None;
    }
    let op = status.operation.as_ref()?;
    let contact = RamdiskContact {
        kind: op.kind,
        id: &op.id,
        token_issued: op.token_issued.as_ref().map(|t| t.0.as_second()),
        last_heard: op.last_heard.as_ref().map(|t| t.0.as_second()),
        step: op.step.as_deref(),
    };
    let message = ramdisk_silence(&contact, fresh.seconds(), max_silence)?;
    Some(Transition {
        to: HostState::Quarantined,
        operation: None,
        reason: "RamdiskSilent",
        message,
    })
}

/// How `host` is wiped when it is deprovisioned: the strongest of the site's `min_wipe`, what
/// its last tenant asked for (frozen in status) and the Host's own `spec.wipe`. Each can only
/// add, so neither a Host editor nor a later tenant can weaken the wipe a tenant is owed.
pub fn wipe(host: &Host, min_wipe: WipePolicy) -> WipePolicy {
    let owed = host.status.as_ref().and_then(|s| s.wipe_owed);
    [owed, host.spec.wipe].into_iter().flatten().fold(min_wipe, WipePolicy::stronger)
}

fn deprovision(
    host: &Host,
    min_wipe: WipePolicy,
    reason: &'static str,
    message: &str,
) -> Option<Transition> {
    // An adopted host's disks are its operator's, never wiped: its reset (the node's
    // Kubernetes state removed) runs whatever the wipe policies say, as the next claim's
    // delivery needs it.
    if wipe(host, min_wipe) == WipePolicy::None && !adopted(host) {
        return Some(Transition {
            to: HostState::Available,
            operation: None,
            reason,
            message: format!("{message}; wipe policy none"),
        });
    }
    Some(Transition {
        to: HostState::Deprovisioning,
        operation: Some(OperationKind::Deprovision),
        reason,
        message: message.to_owned(),
    })
}

fn consumer(host: &Host) -> String {
    host.spec
        .consumer_ref
        .as_ref()
        .map(|c| format!("{} {}/{}", c.kind, c.namespace, c.name))
        .unwrap_or_default()
}

pub fn retry_requested(host: &Host) -> bool {
    host.metadata.annotations.as_ref().is_some_and(|a| a.contains_key(RETRY_ANNOTATION))
}

/// What a step does not read for itself: the time of the pass, and the id a new operation would
/// get. The reconciler makes one per pass ([`Fresh::now`]); tests pass their own. (The Ready
/// condition [`apply`] sets still stamps its transition time from the clock.)
#[derive(Debug, Clone, PartialEq)]
pub struct Fresh {
    pub now: Time,
    pub operation_id: String,
}

impl Fresh {
    /// The clock's time and a random operation id.
    pub fn now() -> Self {
        Self { now: now(), operation_id: siteboot_agent_server::token::operation_id() }
    }

    fn seconds(&self) -> i64 {
        self.now.0.as_second()
    }
}

/// `host`'s status after `transition`, made at `fresh.now` (a new operation gets `fresh`'s id).
pub fn apply(host: &Host, transition: &Transition, fresh: &Fresh) -> HostStatus {
    let mut status = host.status.clone().unwrap_or_default();
    status.state = Some(transition.to);
    status.last_transition_time = Some(fresh.now.clone());
    status.operation = transition.operation.map(|kind| Operation {
        virtual_media: host.spec.boot_method == BootMethod::VirtualMedia,
        ..Operation::new(kind, fresh.operation_id.clone(), fresh.now.clone())
    });
    match transition.to {
        HostState::Quarantined => {
            status.quarantine_reason =
                Some(format!("{}: {}", transition.reason, transition.message))
        }
        HostState::Registering => {
            status.quarantine_reason = None;
            // Each registration checks the BMC again (credentials or the BMC may have changed).
            status.conditions.retain(|c| c.type_ != BMC_READY && c.type_ != SSH_READY);
        }
        HostState::Provisioning => status.wipe_required = true,
        // Only a successful wipe (or a site's `min_wipe: none`) leads here from a used host.
        HostState::Available => {
            status.installed = None;
            status.wipe_required = false;
            status.wipe_owed = None;
        }
        _ => {}
    }
    if status.power.is_none() {
        status.power = Some(crate::crd::PowerState::Unknown);
    }
    let ready = matches!(transition.to, HostState::Available | HostState::Provisioned);
    set_condition(
        &mut status.conditions,
        crate::conditions::READY,
        ready,
        transition.reason,
        &transition.message,
        host.metadata.generation,
    );
    status
}

/// The ramdisk finished an operation.
pub fn completed(
    host: &Host,
    kind: OperationKind,
    ok: bool,
    message: &str,
    hardware: Option<Hardware>,
    fresh: &Fresh,
) -> HostStatus {
    let transition = match (kind, ok) {
        (OperationKind::Inspect, true) => Transition {
            to: HostState::Available,
            operation: None,
            reason: "Inspected",
            message: "hardware reported".into(),
        },
        (OperationKind::Provision, true) => Transition {
            to: HostState::Provisioned,
            operation: None,
            reason: "Provisioned",
            message: format!("image written for {}", consumer(host)),
        },
        (OperationKind::Deprovision, true) => Transition {
            to: HostState::Available,
            operation: None,
            reason: "Deprovisioned",
            message: "disks wiped".into(),
        },
        (OperationKind::Inspect, false) => Transition {
            to: HostState::Quarantined,
            operation: None,
            reason: "InspectionFailed",
            message: message.to_owned(),
        },
        (OperationKind::Provision, false) => Transition {
            to: HostState::Quarantined,
            operation: None,
            reason: "ProvisioningFailed",
            message: message.to_owned(),
        },
        (OperationKind::Deprovision, false) => Transition {
            to: HostState::Quarantined,
            operation: None,
            reason: "WipeFailed",
            message: message.to_owned(),
        },
    };
    let mut status = apply(host, &transition, fresh);
    if let Some(hw) = hardware {
        status.hardware = Some(hw);
    }
    // What was written is the image frozen into the operation, never what `spec.provisioning`
    // says now (a Host editor may have changed it since).
    let frozen = host.status.as_ref().and_then(|s| s.operation.as_ref()?.image.as_ref());
    if transition.to == HostState::Provisioned
        && let (Some(image), Some(c)) = (frozen, &host.spec.consumer_ref)
    {
        status.installed = Some(Installed {
            image: image.clone(),
            consumer: format!("{}/{}", c.namespace, c.name),
            disk_boot_pending: host.spec.bmc.is_some()
                && host.spec.boot_method == BootMethod::Network,
        });
    }
    status
}

/// Freezes into `status` what the trusted side (the SitebootMachine the Host is bound to)
/// decided for the provisioning under way: the image its task writes, and the wipe its tenant
/// asked for (kept from any earlier tenant too: the stronger one stays owed). Nothing a Host
/// editor writes afterwards changes either. `false`: no provisioning is under way.
pub fn hand_out(status: &mut HostStatus, image: &Image, tenant_wipe: Option<WipePolicy>) -> bool {
    let Some(op) = status.operation.as_mut().filter(|op| op.kind == OperationKind::Provision)
    else {
        return false;
    };
    op.image = Some(image.clone());
    status.wipe_owed = match (status.wipe_owed, tenant_wipe) {
        (Some(a), Some(b)) => Some(a.stronger(b)),
        (a, b) => a.or(b),
    };
    true
}

/// Whether `host` waits in Registering for its BMC to be checked: it has one, and this
/// registration has not reached it yet.
pub fn needs_bmc_check(host: &Host) -> bool {
    let status = host.status.as_ref();
    let verified = status
        .and_then(|s| crate::crd::condition(&s.conditions, BMC_READY))
        .is_some_and(|c| c.status == "True");
    host.spec.bmc.is_some()
        && status.and_then(|s| s.state) == Some(HostState::Registering)
        && !verified
}

/// How `host` is reached when SSH is its only way in (`spec.access.ssh`, no BMC: a BMC is the
/// stronger way in, and used instead).
fn reached_over_ssh(host: &Host) -> Option<SshMode> {
    if host.spec.bmc.is_some() {
        return None;
    }
    Some(ssh_of(host)?.mode)
}

/// Whether `host` boots its ramdisk by kexec over SSH: reached over SSH alone, in mode
/// Reimage. It is inspected over SSH like an adopted host; its other operations boot the ramdisk
/// by kexec ([`kexec_due`]) and go on as a network-booted host's do.
pub fn reimaged_over_ssh(host: &Host) -> bool {
    reached_over_ssh(host) == Some(SshMode::Reimage)
}

/// Whether `host` is adopted: reached over SSH alone, in mode Adopt. Claimed, it gets its
/// Machine's bootstrap data over SSH ([`needs_ssh_delivery`]); released, it is reset over SSH
/// ([`needs_ssh_reset`]); no ramdisk boots and no disk is written or wiped.
pub fn adopted(host: &Host) -> bool {
    reached_over_ssh(host) == Some(SshMode::Adopt)
}

/// Whether `host` is in `state` running an operation of `kind`.
fn runs(host: &Host, state: HostState, kind: OperationKind) -> bool {
    let status = host.status.as_ref();
    status.and_then(|s| s.state) == Some(state)
        && status.and_then(|s| s.operation.as_ref()).is_some_and(|op| op.kind == kind)
}

/// Whether `host` waits in Registering for a login over SSH: it is reached over SSH alone, and
/// this registration has not logged in yet.
pub fn needs_ssh_check(host: &Host) -> bool {
    let status = host.status.as_ref();
    let verified = status
        .and_then(|s| crate::crd::condition(&s.conditions, SSH_READY))
        .is_some_and(|c| c.status == "True");
    reached_over_ssh(host).is_some()
        && status.and_then(|s| s.state) == Some(HostState::Registering)
        && !verified
}

/// Whether `host` is inspected over SSH: it is reached over SSH alone (no ramdisk boots on a
/// server that already runs), and inspection is under way.
pub fn needs_ssh_inspection(host: &Host) -> bool {
    reached_over_ssh(host).is_some() && runs(host, HostState::Inspecting, OperationKind::Inspect)
}

/// Whether `host` gets its Machine's bootstrap data over SSH: adopted, and provisioning.
pub fn needs_ssh_delivery(host: &Host) -> bool {
    adopted(host) && runs(host, HostState::Provisioning, OperationKind::Provision)
}

/// Whether `host` is reset over SSH: adopted, and released (where a network-booted host is
/// wiped).
pub fn needs_ssh_reset(host: &Host) -> bool {
    adopted(host) && runs(host, HostState::Deprovisioning, OperationKind::Deprovision)
}

/// The end of an adopted host's delivery, whose data's run exited `code`: Provisioned, or
/// quarantined (the data is never run twice).
pub fn delivery_ended(host: &Host, code: i32) -> Transition {
    match code {
        0 => Transition {
            to: HostState::Provisioned,
            operation: None,
            reason: "Provisioned",
            message: format!("bootstrap data delivered over SSH and run for {}", consumer(host)),
        },
        code => Transition {
            to: HostState::Quarantined,
            operation: None,
            reason: "ProvisioningFailed",
            message: format!(
                "the bootstrap data's run on the server exited {code}; it is not run again"
            ),
        },
    }
}

/// An adopted host's status once its delivery ended with `transition` ([`delivery_ended`]):
/// Provisioned as a network-booted host is, its "installed image" the one its consumer asked
/// for (nothing was written: the Machine's image is what the machine reconciler compares), its
/// address the one siteboot reaches it at.
pub fn delivered(host: &Host, transition: &Transition, fresh: &Fresh) -> HostStatus {
    let mut status = apply(host, transition, fresh);
    let provisioning = host.spec.provisioning.as_ref();
    if transition.to == HostState::Provisioned
        && let (Some(p), Some(c), Some(ssh)) = (provisioning, &host.spec.consumer_ref, ssh_of(host))
    {
        status.installed = Some(Installed {
            image: p.image.clone(),
            consumer: format!("{}/{}", c.namespace, c.name),
            disk_boot_pending: false,
        });
        let address = ssh.address.clone();
        status.addresses = vec![MachineAddress { kind: "InternalIP".into(), address }];
    }
    status
}

fn ssh_of(host: &Host) -> Option<&SshAccess> {
    host.spec.access.as_ref()?.ssh.as_ref()
}

/// An adopted host reset: Available again, its disks untouched.
pub fn reset_done() -> Transition {
    Transition {
        to: HostState::Available,
        operation: None,
        reason: "Reset",
        message: "the node's Kubernetes state was removed over SSH and verified gone; the OS and data disks are kept".into(),
    }
}

/// The BMC condition from what asking the BMC for the host's identity gave: `(ok, reason,
/// message)` (see [`crate::bmc::identity_check`]).
pub fn bmc_check(
    host: &Host,
    identity: &Result<Option<Identity>, BmcError>,
) -> (bool, &'static str, String) {
    crate::bmc::identity_check(&host.spec.boot_mac_address, identity)
}

/// When to check a failing BMC again: after as long as it has been failing (so the checks
/// thin out), between 10 s and 5 min. `now` in seconds since the epoch.
pub fn bmc_recheck_after(host: &Host, now: i64) -> Duration {
    recheck_after(host, BMC_READY, now)
}

/// When to try a failing SSH login again: as [`bmc_recheck_after`], from `SSHReady`.
pub fn ssh_recheck_after(host: &Host, now: i64) -> Duration {
    recheck_after(host, SSH_READY, now)
}

/// After as long as `condition` has been False, between 10 s and 5 min.
fn recheck_after(host: &Host, condition: &str, now: i64) -> Duration {
    let since = host
        .status
        .as_ref()
        .and_then(|s| crate::crd::condition(&s.conditions, condition))
        .filter(|c| c.status == "False")
        .map(|c| c.last_transition_time.0.as_second());
    let failing_for = since.map_or(0, |since| now.saturating_sub(since).max(0) as u64);
    Duration::from_secs(failing_for).clamp(ACCESS_RECHECK_MIN, ACCESS_RECHECK_MAX)
}

/// Whether to have the host's BMC boot the disk just written (a one-time disk boot and a
/// restart, as Ironic does): a Provisioned host with a BMC that boots its ramdisk from the
/// network, whose installation left the request pending. Its ramdisk waits meanwhile, so the host goes
/// straight to its disk instead of through a network boot whose script exits to the firmware,
/// which on UEFI tries PXE and HTTP over IPv6 first (minutes).
pub fn disk_boot_due(host: &Host) -> bool {
    let status = host.status.as_ref();
    host.spec.bmc.is_some()
        && host.spec.boot_method == BootMethod::Network
        && status.and_then(|s| s.state) == Some(HostState::Provisioned)
        && status.and_then(|s| s.installed.as_ref()).is_some_and(|i| i.disk_boot_pending)
}

/// Whether virtual media siteboot inserted for an operation that has ended is still in.
pub fn media_to_eject(host: &Host) -> bool {
    host.status.as_ref().is_some_and(|s| s.media_inserted && s.operation.is_none())
}

/// How long after asking a host's BMC to boot the ramdisk siteboot asks again while the ramdisk
/// has not taken its token: a server takes minutes to POST and network-boot, and firmware that
/// found no DHCP answer (the appliance was restarting) gives up and waits for good.
pub const BOOT_RETRY: Duration = Duration::from_secs(600);

/// Whether to ask the host's BMC (again) to boot the ramdisk of the operation under way: the
/// host has a BMC, the ramdisk has not taken a token for the operation (network boot) and no
/// virtual media was inserted with one, and siteboot has not asked yet (a new operation, or a
/// request lost when the appliance died before it was recorded) or asked more than
/// [`BOOT_RETRY`] ago. Without a BMC siteboot waits for the host to network-boot; a ramdisk
/// that booted is timed out by [`silent`] instead.
pub fn boot_due(host: &Host, now: i64) -> bool {
    let Some(op) = host.status.as_ref().and_then(|s| s.operation.as_ref()) else { return false };
    host.spec.bmc.is_some()
        && op.token_issued.is_none()
        && op.boot_requested.as_ref().is_none_or(|at| asked_long_ago(at, now))
}

/// Whether to kexec the host (again) over SSH into the ramdisk of the operation under way: it
/// boots its ramdisk that way ([`reimaged_over_ssh`]), no ramdisk has said a word for the
/// operation nor taken a token from a network boot, and siteboot has not started the kexec
/// yet (a new operation, or a start lost when the appliance died before it was recorded) or
/// started it more than [`BOOT_RETRY`] ago. The server's kexec marker keeps a second pass from
/// starting the same operation's kexec twice; a ramdisk that booted and fell silent is timed
/// out by [`silent`], from the token stored before the kexec.
pub fn kexec_due(host: &Host, now: i64) -> bool {
    let Some(op) = host.status.as_ref().and_then(|s| s.operation.as_ref()) else { return false };
    reimaged_over_ssh(host)
        && op.kind != OperationKind::Inspect
        && op.last_heard.is_none()
        && op.token_address.is_none()
        && op.boot_requested.as_ref().is_none_or(|at| asked_long_ago(at, now))
}

/// Whether a boot asked for at `at` was more than [`BOOT_RETRY`] before `now` (seconds since
/// the epoch).
fn asked_long_ago(at: &Time, now: i64) -> bool {
    now.saturating_sub(at.0.as_second()) > BOOT_RETRY.as_secs() as i64
}

/// What the reboot annotation asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reboot {
    /// An operation is running: boot once into the ramdisk (from the network, or from new
    /// virtual media).
    IntoRamdisk,
    PowerCycle,
    /// No `spec.bmc`: siteboot cannot; the operator is told.
    NoBmc,
}

pub fn reboot(host: &Host) -> Option<Reboot> {
    let annotations = host.metadata.annotations.as_ref();
    if !annotations.is_some_and(|a| a.contains_key(REBOOT_ANNOTATION)) {
        return None;
    }
    Some(if host.spec.bmc.is_none() {
        Reboot::NoBmc
    } else if host.status.as_ref().is_some_and(|s| s.operation.is_some()) {
        Reboot::IntoRamdisk
    } else {
        Reboot::PowerCycle
    })
}

/// What a deleted Host needs before it may go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deletion {
    /// `clusterctl move` deletes the source's copy: drop the finalizer, touch nothing (the host
    /// lives on, with its record, in the target management cluster).
    Moved,
    /// Its consumer still holds it: deleting the Machine releases it.
    WaitForRelease,
    /// Wipe first.
    Wipe(Transition),
    /// A wipe (or another operation) is running.
    WaitForWipe,
    /// Power it off and drop the finalizer.
    Finish,
}

/// The step for a Host being deleted (`metadata.deletionTimestamp` set).
pub fn on_delete(host: &Host, min_wipe: WipePolicy) -> Deletion {
    let annotations = host.metadata.annotations.as_ref();
    if annotations.is_some_and(|a| a.contains_key(DELETE_FOR_MOVE_ANNOTATION)) {
        return Deletion::Moved;
    }
    if annotations.is_some_and(|a| a.contains_key(FORCE_DELETE_ANNOTATION)) {
        return Deletion::Finish;
    }
    if host.spec.consumer_ref.is_some() {
        return Deletion::WaitForRelease;
    }
    let status = host.status.as_ref();
    if status.is_some_and(|s| s.operation.is_some()) {
        return Deletion::WaitForWipe;
    }
    if status.is_some_and(|s| s.wipe_required) {
        return match deprovision(host, min_wipe, "WipeBeforeDelete", "the Host is deleted") {
            Some(t) if t.operation.is_some() => Deletion::Wipe(t),
            _ => Deletion::Finish,
        };
    }
    Deletion::Finish
}

/// Whether `time` is more than `max_age_secs` seconds before `now`.
pub fn older_than(time: &Time, max_age_secs: i64, now: &Time) -> bool {
    now.0.as_second() - time.0.as_second() > max_age_secs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pass's fresh inputs: now, and a new operation id.
    fn fresh() -> Fresh {
        Fresh::now()
    }
    use crate::crd::{Bmc, ConsumerRef, HostSpec, Provisioning, set_condition};

    /// The site's wipe in these tests.
    const MIN_WIPE: WipePolicy = WipePolicy::Quick;

    fn host() -> Host {
        Host::new("h", HostSpec::new("52:54:00:00:00:01"))
    }

    fn step(h: &mut Host) -> Option<HostState> {
        let t = next(h, MIN_WIPE)?;
        h.status = Some(apply(h, &t, &fresh()));
        Some(t.to)
    }

    fn image(n: u8) -> Image {
        Image {
            url: format!("http://x/{n}.img"),
            checksum: format!("sha256:{}", "0".repeat(64)),
            format: None,
            grow_last_partition: false,
        }
    }

    fn claim(h: &mut Host, n: u8) {
        h.spec.consumer_ref = Some(ConsumerRef {
            api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
            kind: "SitebootMachine".into(),
            namespace: "ns".into(),
            name: "m".into(),
            uid: "u".into(),
        });
        h.spec.provisioning = Some(Provisioning { image: image(n) });
    }

    #[test]
    fn a_host_goes_round_the_lifecycle() {
        let mut h = host();
        assert_eq!(step(&mut h), Some(HostState::Registering));
        assert_eq!(step(&mut h), Some(HostState::Inspecting));
        assert_eq!(
            h.status.as_ref().unwrap().operation.as_ref().unwrap().kind,
            OperationKind::Inspect
        );
        assert_eq!(step(&mut h), None, "the ramdisk must report");
        h.status = Some(completed(
            &h,
            OperationKind::Inspect,
            true,
            "",
            Some(Hardware { cpus: 2, ..Default::default() }),
            &fresh(),
        ));
        assert_eq!(h.status.as_ref().unwrap().state, Some(HostState::Available));
        assert!(h.status.as_ref().unwrap().operation.is_none());
        assert_eq!(step(&mut h), None);
        claim(&mut h, 1);
        assert_eq!(step(&mut h), Some(HostState::Provisioning));
        assert!(hand_out(h.status.as_mut().unwrap(), &image(1), None));
        h.status = Some(completed(&h, OperationKind::Provision, true, "", None, &fresh()));
        assert_eq!(h.status.as_ref().unwrap().installed.as_ref().unwrap().image, image(1));
        assert_eq!(step(&mut h), None, "provisioned and wanted");
        h.spec.provisioning.as_mut().unwrap().image = image(2);
        assert_eq!(step(&mut h), Some(HostState::Deprovisioning), "image changed");
        h.status = Some(completed(&h, OperationKind::Deprovision, true, "", None, &fresh()));
        assert_eq!(h.status.as_ref().unwrap().state, Some(HostState::Available));
        assert!(h.status.as_ref().unwrap().installed.is_none());
        assert_eq!(
            h.status.as_ref().unwrap().hardware.as_ref().unwrap().cpus,
            2,
            "hardware is kept"
        );
    }

    #[test]
    fn release_cancel_failure_and_retry() {
        let mut h = host();
        h.status = Some(HostStatus {
            state: Some(HostState::Available),
            hardware: Some(Hardware::default()),
            ..Default::default()
        });
        claim(&mut h, 1);
        assert_eq!(step(&mut h), Some(HostState::Provisioning));
        h.spec.provisioning = None;
        assert_eq!(step(&mut h), Some(HostState::Deprovisioning), "cancelled mid-way: wipe");
        h.status = Some(completed(
            &h,
            OperationKind::Deprovision,
            false,
            "disk sdb did not wipe",
            None,
            &fresh(),
        ));
        let s = h.status.as_ref().unwrap();
        assert_eq!(s.state, Some(HostState::Quarantined));
        assert_eq!(s.quarantine_reason.as_deref(), Some("WipeFailed: disk sdb did not wipe"));
        assert_eq!(step(&mut h), None, "never silently Available");
        h.metadata.annotations = Some([(RETRY_ANNOTATION.to_owned(), "".to_owned())].into());
        assert_eq!(step(&mut h), Some(HostState::Registering));
        assert!(h.status.as_ref().unwrap().quarantine_reason.is_none());
        assert_eq!(step(&mut h), Some(HostState::Deprovisioning), "provisioning began: wipe first");
    }

    #[test]
    fn a_transition_is_made_at_the_pass_s_time_with_the_pass_s_operation_id() {
        let mut h = host();
        h.status = Some(HostStatus {
            state: Some(HostState::Available),
            hardware: Some(Hardware::default()),
            ..Default::default()
        });
        claim(&mut h, 1);
        let t = next(&h, WipePolicy::Quick).expect("a claimed host provisions");
        let at = Time("2026-01-02T03:04:05Z".parse().unwrap());
        let fresh = Fresh { now: at.clone(), operation_id: "0123456789abcdef".into() };
        let status = apply(&h, &t, &fresh);
        let op = status.operation.expect("an operation");
        assert_eq!((op.id.as_str(), &op.started), ("0123456789abcdef", &at));
        assert_eq!(status.last_transition_time, Some(at.clone()));
        assert_eq!(
            apply(&h, &t, &fresh).operation.unwrap().id,
            op.id,
            "the same inputs, the same write"
        );
        // Silence is measured from the pass's time, not the clock's.
        let mut booted = h.clone();
        booted.status = Some(apply(&h, &t, &fresh));
        booted.status.as_mut().unwrap().operation.as_mut().unwrap().token_issued = Some(at.clone());
        let later = |secs: i64| Fresh {
            now: Time(at.0 + k8s_openapi::jiff::SignedDuration::from_secs(secs)),
            ..fresh.clone()
        };
        let minute = Duration::from_secs(60);
        assert_eq!(silent(&booted, minute, &later(59)), None);
        assert!(silent(&booted, minute, &later(61)).is_some());
    }

    #[test]
    fn a_ramdisk_that_booted_and_fell_silent_quarantines_its_host() {
        let ago = |secs: i64| {
            Time(
                k8s_openapi::jiff::Timestamp::now()
                    - k8s_openapi::jiff::SignedDuration::from_secs(secs),
            )
        };
        let mut h = host();
        h.status = Some(HostStatus {
            state: Some(HostState::Available),
            hardware: Some(Hardware::default()),
            ..Default::default()
        });
        claim(&mut h, 1);
        assert_eq!(step(&mut h), Some(HostState::Provisioning));
        let minute = Duration::from_secs(60);
        assert_eq!(silent(&h, minute, &fresh()), None, "never booted the ramdisk: waits for it");
        h.status.as_mut().unwrap().operation.as_mut().unwrap().token_issued = Some(ago(30));
        assert_eq!(silent(&h, minute, &fresh()), None, "booted 30 s ago");
        h.status.as_mut().unwrap().operation.as_mut().unwrap().token_issued = Some(ago(600));
        h.status.as_mut().unwrap().operation.as_mut().unwrap().last_heard = Some(ago(10));
        assert_eq!(silent(&h, minute, &fresh()), None, "booted long ago, heard from 10 s ago");
        h.status.as_mut().unwrap().operation.as_mut().unwrap().last_heard = Some(ago(120));
        h.status.as_mut().unwrap().operation.as_mut().unwrap().step = Some("writing image".into());
        let t = silent(&h, minute, &fresh()).expect("silent for 120 s");
        assert_eq!((t.to, t.reason), (HostState::Quarantined, "RamdiskSilent"));
        let id = h.status.as_ref().unwrap().operation.as_ref().unwrap().id.clone();
        assert!(t.message.contains(&id) && t.message.contains("writing image"), "{}", t.message);
        h.status = Some(apply(&h, &t, &fresh()));
        assert!(
            h.status.as_ref().unwrap().wipe_required,
            "a silent provisioning still owes a wipe"
        );
        assert_eq!(silent(&h, minute, &fresh()), None, "Quarantined: nothing more to time out");
    }

    #[test]
    fn an_unusable_bmc_address_is_quarantined_with_a_reason() {
        let mut h = host();
        h.spec.bmc = Some(Bmc {
            address: "ipmi://x".into(),
            credentials_name: "c".into(),
            certificate_fingerprint: None,
            boot_mode: None,
        });
        step(&mut h);
        assert_eq!(step(&mut h), Some(HostState::Quarantined));
        let reason = h.status.unwrap().quarantine_reason.unwrap();
        assert!(
            reason
                .starts_with("BMCFailed: spec.bmc.address \"ipmi://x\": the scheme is not redfish"),
            "{reason}"
        );
    }

    #[test]
    fn virtual_media_without_a_bmc_is_quarantined_and_with_one_is_frozen_into_each_operation() {
        let mut h = host();
        h.spec.boot_method = BootMethod::VirtualMedia;
        step(&mut h);
        assert_eq!(step(&mut h), Some(HostState::Quarantined));
        let reason = h.status.unwrap().quarantine_reason.unwrap();
        assert!(reason.starts_with("VirtualMediaNeedsBMC: "), "{reason}");

        let mut h = with_bmc();
        h.spec.boot_method = BootMethod::VirtualMedia;
        step(&mut h);
        record_bmc_check(&mut h, identity(&["52:54:00:00:00:01"]));
        assert_eq!(step(&mut h), Some(HostState::Inspecting));
        let op = h.status.as_ref().unwrap().operation.clone().unwrap();
        assert!(op.virtual_media, "the operation boots from media");
        // A Host editor who switches the method later changes no running operation.
        h.spec.boot_method = BootMethod::Network;
        assert!(h.status.as_ref().unwrap().operation.as_ref().unwrap().virtual_media);
    }

    #[test]
    fn media_is_ejected_once_the_operation_that_inserted_it_ended() {
        let mut h = with_bmc();
        assert!(!media_to_eject(&h));
        let status = h.status.get_or_insert_with(HostStatus::default);
        status.media_inserted = true;
        status.operation = Some(Operation {
            virtual_media: true,
            ..Operation::new(OperationKind::Provision, "op".into(), now())
        });
        assert!(!media_to_eject(&h), "the ramdisk still works from it");
        h.status.as_mut().unwrap().operation = None;
        assert!(media_to_eject(&h));
        h.status.as_mut().unwrap().media_inserted = false;
        assert!(!media_to_eject(&h));
    }

    #[test]
    fn the_disk_is_made_the_next_boot_once_per_installation_of_a_network_booted_host_with_a_bmc() {
        let installed = |bmc: bool, method: BootMethod| {
            let mut h = provisioned();
            h.spec.bmc = bmc.then(|| with_bmc().spec.bmc).flatten();
            h.spec.boot_method = method;
            assert!(!disk_boot_due(&h), "not while the image is written");
            h.status = Some(completed(&h, OperationKind::Provision, true, "", None, &fresh()));
            assert_eq!(h.status.as_ref().unwrap().state, Some(HostState::Provisioned));
            h
        };
        let mut h = installed(true, BootMethod::Network);
        assert!(disk_boot_due(&h));
        h.status.as_mut().unwrap().installed.as_mut().unwrap().disk_boot_pending = false;
        assert!(!disk_boot_due(&h), "asked once");
        // The next installation asks again.
        let mut again = installed(true, BootMethod::Network);
        again.status.as_mut().unwrap().installed.as_mut().unwrap().consumer = "ns/m2".into();
        assert!(disk_boot_due(&again));
        // Without a BMC the boot script exits to the firmware; virtual media is ejected and
        // the host restarted by its own step.
        assert!(!disk_boot_due(&installed(false, BootMethod::Network)));
        assert!(!disk_boot_due(&installed(true, BootMethod::VirtualMedia)));
        // A host installed before this step existed has no pending flag in its status: an
        // upgrade restarts none of the hosts that already run their OS.
        let mut before = installed(true, BootMethod::Network);
        let mut status = serde_json::to_value(before.status.as_ref().unwrap()).unwrap();
        assert!(status["installed"].as_object_mut().unwrap().remove("diskBootPending").is_some());
        before.status = Some(serde_json::from_value(status).unwrap());
        assert!(!disk_boot_due(&before));
    }

    fn with_bmc() -> Host {
        let mut h = host();
        h.spec.bmc = Some(Bmc {
            address: "redfish+https://10.0.0.5/redfish/v1/Systems/1".into(),
            credentials_name: "c".into(),
            certificate_fingerprint: None,
            boot_mode: None,
        });
        h
    }

    /// What the reconciler writes after a BMC check.
    fn record_bmc_check(h: &mut Host, identity: Result<Option<Identity>, BmcError>) {
        let (ok, reason, message) = bmc_check(h, &identity);
        let status = h.status.as_mut().unwrap();
        set_condition(&mut status.conditions, BMC_READY, ok, reason, &message, None);
    }

    fn identity(macs: &[&str]) -> Result<Option<Identity>, BmcError> {
        Ok(Some(Identity { uuid: "u".into(), macs: macs.iter().map(|m| m.to_string()).collect() }))
    }

    #[test]
    fn a_host_with_a_bmc_registers_only_once_its_bmc_answered_for_it() {
        let mut h = with_bmc();
        assert_eq!(step(&mut h), Some(HostState::Registering));
        assert!(needs_bmc_check(&h));
        assert_eq!(step(&mut h), None, "waits for the BMC check");

        record_bmc_check(&mut h, Err(BmcError::Unauthorized { address: "10.0.0.5:443".into() }));
        assert_eq!(step(&mut h), None, "wrong credentials: still waiting, not quarantined");
        let c = crate::crd::condition(&h.status.as_ref().unwrap().conditions, BMC_READY).unwrap();
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "BMCUnauthorized"));

        record_bmc_check(&mut h, identity(&["52:54:00:00:00:09"]));
        assert_eq!(step(&mut h), None, "the BMC manages another machine");
        let c = crate::crd::condition(&h.status.as_ref().unwrap().conditions, BMC_READY).unwrap();
        assert_eq!(c.reason, "BMCBootMACMismatch");

        record_bmc_check(&mut h, identity(&["52:54:00:00:00:09", "52:54:00:00:00:01"]));
        assert!(!needs_bmc_check(&h));
        assert_eq!(step(&mut h), Some(HostState::Inspecting));
    }

    #[test]
    fn every_registration_checks_the_bmc_again() {
        let mut h = with_bmc();
        step(&mut h);
        record_bmc_check(&mut h, identity(&["52:54:00:00:00:01"]));
        assert_eq!(step(&mut h), Some(HostState::Inspecting));
        h.status = Some(apply(
            &h,
            &Transition {
                to: HostState::Quarantined,
                operation: None,
                reason: "X",
                message: String::new(),
            },
            &fresh(),
        ));
        h.metadata.annotations = Some([(RETRY_ANNOTATION.to_owned(), "".to_owned())].into());
        assert_eq!(step(&mut h), Some(HostState::Registering));
        assert!(needs_bmc_check(&h), "the old BMCReady does not carry over");
    }

    #[test]
    fn a_failing_bmc_is_checked_again_less_and_less_often() {
        let mut h = with_bmc();
        step(&mut h);
        assert_eq!(bmc_recheck_after(&h, 0), Duration::from_secs(10), "no failure recorded yet");
        let unreachable =
            BmcError::Unreachable { address: "a".into(), attempts: 4, reason: "refused".into() };
        record_bmc_check(&mut h, Err(unreachable));
        let since = crate::crd::condition(&h.status.as_ref().unwrap().conditions, BMC_READY)
            .unwrap()
            .last_transition_time
            .0
            .as_second();
        assert_eq!(bmc_recheck_after(&h, since + 1), Duration::from_secs(10));
        assert_eq!(bmc_recheck_after(&h, since + 60), Duration::from_secs(60));
        assert_eq!(bmc_recheck_after(&h, since + 86_400), Duration::from_secs(300));
    }

    #[test]
    fn the_bmc_is_asked_to_boot_the_ramdisk_until_it_takes_its_token() {
        let at = |seconds: i64| Time(k8s_openapi::jiff::Timestamp::from_second(seconds).unwrap());
        let now = 1_000_000;
        let mut h = with_bmc();
        assert!(!boot_due(&h, now), "no operation");
        claim(&mut h, 1);
        h.status.get_or_insert_with(HostStatus::default).operation =
            Some(Operation::new(OperationKind::Provision, "op".into(), at(now)));
        let set = |h: &mut Host, f: &dyn Fn(&mut Operation)| {
            f(h.status.as_mut().unwrap().operation.as_mut().unwrap())
        };
        assert!(boot_due(&h, now), "a new operation, or a request lost to a crash");
        set(&mut h, &|o| o.boot_requested = Some(at(now - 30)));
        assert!(!boot_due(&h, now), "asked 30 s ago: the host is booting");
        let retry = now - BOOT_RETRY.as_secs() as i64 - 1;
        set(&mut h, &|o| o.boot_requested = Some(at(retry)));
        assert!(boot_due(&h, now), "asked long ago, and no ramdisk took the token: ask again");
        set(&mut h, &|o| o.token_issued = Some(at(now - 5)));
        assert!(!boot_due(&h, now), "the ramdisk booted (or the media went in with its token)");
        let mut without_bmc = h.clone();
        without_bmc.spec.bmc = None;
        set(&mut without_bmc, &|o| o.token_issued = None);
        assert!(!boot_due(&without_bmc, now), "no BMC: siteboot waits for a network boot");
    }

    #[test]
    fn the_reboot_annotation_boots_the_ramdisk_when_an_operation_runs() {
        let reboot_annotated = |mut h: Host| {
            h.metadata.annotations = Some([(REBOOT_ANNOTATION.to_owned(), "".to_owned())].into());
            reboot(&h)
        };
        assert_eq!(reboot(&with_bmc()), None);
        assert_eq!(reboot_annotated(host()), Some(Reboot::NoBmc));
        let mut h = with_bmc();
        step(&mut h);
        assert_eq!(reboot_annotated(h.clone()), Some(Reboot::PowerCycle));
        record_bmc_check(&mut h, identity(&[]));
        assert_eq!(step(&mut h), Some(HostState::Inspecting));
        assert_eq!(reboot_annotated(h), Some(Reboot::IntoRamdisk));
    }

    fn provisioned() -> Host {
        let mut h = host();
        h.status = Some(HostStatus {
            state: Some(HostState::Available),
            hardware: Some(Hardware::default()),
            ..Default::default()
        });
        claim(&mut h, 1);
        assert_eq!(step(&mut h), Some(HostState::Provisioning));
        assert!(h.status.as_ref().unwrap().wipe_required);
        assert!(hand_out(h.status.as_mut().unwrap(), &image(1), None));
        h
    }

    #[test]
    fn a_used_host_is_available_again_only_through_a_wipe() {
        // Provisioning failed; the Machine is deleted (consumer and provisioning gone) while the
        // host is Quarantined; the operator retries.
        let mut h = provisioned();
        h.status =
            Some(completed(&h, OperationKind::Provision, false, "disk full", None, &fresh()));
        h.spec.consumer_ref = None;
        h.spec.provisioning = None;
        assert_eq!(step(&mut h), None, "Quarantined stays");
        h.metadata.annotations = Some([(RETRY_ANNOTATION.to_owned(), "".to_owned())].into());
        assert_eq!(step(&mut h), Some(HostState::Registering));
        assert_eq!(step(&mut h), Some(HostState::Deprovisioning), "wiped, not Available");
        h.status = Some(completed(&h, OperationKind::Deprovision, false, "sda", None, &fresh()));
        assert_eq!(h.status.as_ref().unwrap().state, Some(HostState::Quarantined));
        assert!(h.status.as_ref().unwrap().wipe_required, "a failed wipe leaves it required");
        assert_eq!(step(&mut h), Some(HostState::Registering), "the annotation is still there");
        assert_eq!(step(&mut h), Some(HostState::Deprovisioning));
        h.status = Some(completed(&h, OperationKind::Deprovision, true, "", None, &fresh()));
        let s = h.status.as_ref().unwrap();
        assert_eq!(s.state, Some(HostState::Available));
        assert!(!s.wipe_required);
    }

    #[test]
    fn a_deleted_host_waits_for_release_and_wipe() {
        let mut h = provisioned();
        h.status = Some(completed(&h, OperationKind::Provision, true, "", None, &fresh()));
        assert_eq!(on_delete(&h, MIN_WIPE), Deletion::WaitForRelease);
        h.spec.consumer_ref = None;
        h.spec.provisioning = None;
        // The lifecycle starts the wipe (released); deletion waits for it.
        assert_eq!(step(&mut h), Some(HostState::Deprovisioning));
        assert_eq!(on_delete(&h, MIN_WIPE), Deletion::WaitForWipe);
        h.status = Some(completed(&h, OperationKind::Deprovision, true, "", None, &fresh()));
        assert_eq!(on_delete(&h, MIN_WIPE), Deletion::Finish);

        // Quarantined with data on it: wiped before it goes.
        let mut q = provisioned();
        q.status = Some(completed(&q, OperationKind::Provision, false, "x", None, &fresh()));
        q.spec.consumer_ref = None;
        q.spec.provisioning = None;
        let Deletion::Wipe(t) = on_delete(&q, MIN_WIPE) else {
            panic!("{:?}", on_delete(&q, MIN_WIPE))
        };
        assert_eq!(t.to, HostState::Deprovisioning);

        // Never used: nothing to wait for. Forced: nothing either.
        assert_eq!(on_delete(&host(), MIN_WIPE), Deletion::Finish);
        let mut forced = provisioned();
        forced.metadata.annotations =
            Some([(FORCE_DELETE_ANNOTATION.to_owned(), "".to_owned())].into());
        assert_eq!(on_delete(&forced, MIN_WIPE), Deletion::Finish);
    }

    #[test]
    fn a_host_deleted_by_clusterctl_move_is_let_go_untouched() {
        // Claimed and Provisioned: a real delete waits for release; a move's delete does not.
        let mut h = provisioned();
        h.status = Some(completed(&h, OperationKind::Provision, true, "", None, &fresh()));
        h.metadata.annotations =
            Some([(DELETE_FOR_MOVE_ANNOTATION.to_owned(), "".to_owned())].into());
        assert_eq!(on_delete(&h, MIN_WIPE), Deletion::Moved);
        // Released with data on it: no wipe either.
        h.spec.consumer_ref = None;
        h.spec.provisioning = None;
        assert_eq!(on_delete(&h, MIN_WIPE), Deletion::Moved);
    }

    /// The wipe a used host gets, for each thing that may ask: the site, the tenant (frozen at
    /// hand-out) and the Host. Each can only add: a Host editor's `none` or `quick` never
    /// weakens what the site or the tenant asked for.
    #[test]
    fn a_host_is_wiped_with_the_strongest_wipe_anyone_trusted_asked_for() {
        use WipePolicy::{Full, None as Nothing, Quick};
        let levels = [None, Some(Nothing), Some(Quick), Some(Full)];
        for site in [Nothing, Quick, Full] {
            for tenant in levels {
                for editor in levels {
                    let mut h = provisioned();
                    h.status.as_mut().unwrap().wipe_owed = None;
                    hand_out(h.status.as_mut().unwrap(), &image(1), tenant);
                    h.status =
                        Some(completed(&h, OperationKind::Provision, true, "", None, &fresh()));
                    h.spec.wipe = editor;
                    h.spec.consumer_ref = None;
                    h.spec.provisioning = None;
                    let rank = |w: WipePolicy| [Nothing, Quick, Full].iter().position(|l| *l == w);
                    let expected = [Some(site), tenant, editor]
                        .into_iter()
                        .flatten()
                        .max_by_key(|w| rank(*w))
                        .unwrap();
                    assert_eq!(
                        wipe(&h, site),
                        expected,
                        "site {site:?} tenant {tenant:?} editor {editor:?}"
                    );
                    let t = next(&h, site).unwrap();
                    if expected == Nothing {
                        assert_eq!(t.to, HostState::Available);
                    } else {
                        assert_eq!(
                            (t.to, t.operation),
                            (HostState::Deprovisioning, Some(OperationKind::Deprovision))
                        );
                    }
                    if expected != Nothing {
                        h.status = Some(apply(&h, &t, &fresh()));
                        h.status = Some(completed(
                            &h,
                            OperationKind::Deprovision,
                            true,
                            "",
                            None,
                            &fresh(),
                        ));
                        assert_eq!(h.status.as_ref().unwrap().wipe_owed, None, "owed until wiped");
                    }
                }
            }
        }
        // What the Host editor attacks with: `none` on a site whose minimum is quick.
        let mut h = provisioned();
        h.status = Some(completed(&h, OperationKind::Provision, true, "", None, &fresh()));
        h.spec.wipe = Some(Nothing);
        h.spec.consumer_ref = None;
        assert_eq!(step(&mut h), Some(HostState::Deprovisioning), "wiped, not Available");
    }

    /// What the operation writes is frozen when it is handed out: a Host editor who swaps
    /// `spec.provisioning.image` mid-way changes neither the task nor what is recorded as
    /// installed (which then differs from the swapped spec, so the host is wiped, never kept).
    #[test]
    fn the_image_written_is_the_one_handed_out_not_the_one_in_spec() {
        let mut h = provisioned();
        h.spec.provisioning.as_mut().unwrap().image = image(9);
        let op = h.status.as_ref().unwrap().operation.clone().unwrap();
        assert_eq!(op.image, Some(image(1)));
        h.status = Some(completed(&h, OperationKind::Provision, true, "", None, &fresh()));
        assert_eq!(h.status.as_ref().unwrap().installed.as_ref().unwrap().image, image(1));
        assert_eq!(step(&mut h), Some(HostState::Deprovisioning), "spec and disk differ: wipe");

        // Not a provisioning: nothing is handed out.
        let mut idle = HostStatus::default();
        assert!(!hand_out(&mut idle, &image(1), Some(WipePolicy::Full)));
        assert_eq!(idle.wipe_owed, None);
        // A later tenant never lowers what an earlier one is still owed.
        let mut h = provisioned();
        let status = h.status.as_mut().unwrap();
        status.wipe_owed = Some(WipePolicy::Full);
        hand_out(status, &image(2), Some(WipePolicy::Quick));
        assert_eq!(status.wipe_owed, Some(WipePolicy::Full));
    }
}
