//! The Host reconciler: reads a Host, computes its one next step (see [`lifecycle`]), writes it
//! with the Host's resourceVersion and records an Event. Killed between any two lines, it
//! recomputes the same step from what is stored. It also keeps a finalizer on every Host, so a
//! deleted one is released and wiped before it goes, keeps its lifecycle [`record`] (what a
//! `clusterctl move` or a restore must not lose) and restores from it, honours the paused
//! annotation, and reports boot MACs two Hosts share (only the owner goes on).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::json;

use super::lifecycle::{
    self, Deletion, FINALIZER, Fresh, REBOOT_ANNOTATION, RETRY_ANNOTATION, Reboot, Transition,
};
use super::plan::{self, Observed, Step};
use super::record::RECORD_ANNOTATION;
use crate::bmc::{self, BmcError};
use crate::conditions::{BMC_READY, BOOT_MAC_UNIQUE, check_paused};
use crate::context::{
    Ctx, Error, Reconciled, key, patch_unchanged, set_finalizer, update_host_status,
};
use crate::crd::{Host, HostState, SITE_LABEL, now, set_condition};
use crate::pools::MacStanding;
use siteboot_agent_server::token;

/// How soon a boot or reboot the BMC failed is tried again.
const REBOOT_RETRY: Duration = Duration::from_secs(60);
/// How soon an ejection of virtual media (and the boot or power-off after it) the BMC failed is
/// tried again: the same 60 s as [`REBOOT_RETRY`], named apart so either can change alone.
const EJECT_RETRY: Duration = Duration::from_secs(60);

pub async fn run(ctx: Arc<Ctx>, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let api: Api<Host> = Api::all(ctx.client.clone());
    let config = watcher::Config::default().labels(&format!("{SITE_LABEL}={}", ctx.site));
    let controller = Controller::new(api, config);
    ctx.drive(controller, shutdown, |host, ctx| async move { pass(&host, &ctx).await }).await;
}

impl Reconciled for Host {}

async fn pass(host: &Host, ctx: &Ctx) -> Result<Action, Error> {
    let api = ctx.hosts_api(&host.namespace().unwrap_or_default());
    // The only clock and randomness of the pass: the plan is a function of what was read.
    let fresh = Fresh::now();
    let others = ctx.hosts.sharing_mac(host);
    let mac = mac_standing(ctx, host, &others);
    let seen = observed(ctx, &fresh, &mac);
    match plan::next(host, &seen) {
        Step::ReportPaused => {
            update_host_status(&api, &host.name_any(), |current| {
                let mut status = current.status.clone().unwrap_or_default();
                check_paused(None, current, &mut status.conditions);
                Ok::<_, ()>(Some(status))
            })
            .await?
            .ok();
            Ok(Action::requeue(Duration::ZERO))
        }
        Step::Paused => Ok(Action::await_change()),
        Step::Delete => delete(host, ctx, &api, &seen).await,
        Step::AddFinalizer => {
            set_finalizer(&api, host, FINALIZER, true).await?;
            Ok(Action::requeue(Duration::ZERO))
        }
        Step::Restore { status, reason, message } => {
            restore(host, ctx, &api, *status, reason, message).await
        }
        Step::RecordStale(value) => {
            let patch = json!({ "metadata": { "annotations": { RECORD_ANNOTATION: value } } });
            patch_unchanged(&api, host, patch).await?;
            Ok(Action::requeue(Duration::ZERO))
        }
        Step::ReportMac => {
            report_mac(host, &mac, &others, ctx, &api).await?;
            Ok(Action::requeue(Duration::ZERO))
        }
        Step::Disowned => Ok(Action::requeue(Duration::from_secs(300))),
        Step::Transit(transition) => {
            let still = |h: &Host| plan::transition(h, &seen);
            transit(host, ctx, &api, (&transition, &fresh), still).await
        }
        Step::RequestBoot => request_boot(host, ctx, &api, &fresh).await,
        Step::RequestDiskBoot => request_disk_boot(host, ctx, &api).await,
        Step::EjectMedia => eject_media(host, ctx, &api).await,
        Step::CheckBmc => check_bmc(host, ctx, &api).await,
        Step::Reboot(reboot) => reboot_host(host, ctx, &api, reboot).await,
        Step::Idle { again } => {
            refresh_power(host, ctx).await?;
            Ok(Action::requeue(again))
        }
    }
}

/// What the plan needs of the pass besides the Host.
fn observed<'a>(ctx: &Ctx, fresh: &'a Fresh, mac: &'a MacStanding) -> Observed<'a> {
    Observed { fresh, mac, max_silence: ctx.ramdisk_silence_timeout, min_wipe: ctx.min_wipe }
}

/// Writes `transition` if `still` computes it again from the fresh Host, then records it.
async fn transit(
    host: &Host,
    ctx: &Ctx,
    api: &Api<Host>,
    (transition, fresh): (&Transition, &Fresh),
    still: impl Fn(&Host) -> Option<Transition>,
) -> Result<Action, Error> {
    let written = update_host_status(api, &host.name_any(), |current| {
        // Re-check on the fresh Host: the step must still be the one to take.
        Ok::<_, ()>(match still(current) {
            Some(t) if &t == transition => Some(lifecycle::apply(current, &t, fresh)),
            _ => None,
        })
    })
    .await?;
    let Ok(Some(written)) = written else { return Ok(Action::requeue(Duration::from_secs(1))) };
    let from = host.status.as_ref().and_then(|s| s.state);
    tracing::info!(host = %key(&written), from = ?from, to = ?transition.to, reason = transition.reason, "{}", transition.message);
    let warning = transition.to == HostState::Quarantined;
    ctx.event(
        &written,
        warning,
        transition.reason,
        format!("{from:?} -> {:?}: {}", transition.to, transition.message),
    )
    .await;
    if transition.to == HostState::Registering && lifecycle::retry_requested(&written) {
        let patch = json!({ "metadata": { "annotations": { RETRY_ANNOTATION: null } } });
        api.patch(&written.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    }
    // A new operation's ramdisk is booted by the next pass (`lifecycle::boot_due`).
    let again = if transition.operation.is_some() { Duration::ZERO } else { plan::IDLE };
    Ok(Action::requeue(again))
}

/// Asks the host's BMC to boot the ramdisk of the operation under way, then records when, for
/// that operation only: a crash before the record means the next pass asks again.
async fn request_boot(
    host: &Host,
    ctx: &Ctx,
    api: &Api<Host>,
    fresh: &Fresh,
) -> Result<Action, Error> {
    let Some(id) = host.status.as_ref().and_then(|s| s.operation.as_ref()).map(|o| o.id.clone())
    else {
        return Ok(Action::requeue(Duration::ZERO));
    };
    if let Err(e) = boot_ramdisk(host, ctx, api).await {
        tracing::warn!(host = %key(host), operation = %id, error = %e, "cannot boot the host into the ramdisk; trying again in {}", humantime::format_duration(REBOOT_RETRY));
        ctx.event(host, true, "BootFailed", format!("booting the ramdisk of operation {id}: {e}"))
            .await;
        return Ok(Action::requeue(REBOOT_RETRY));
    }
    tracing::info!(host = %key(host), operation = %id, "asked the BMC to boot the ramdisk");
    update_host_status(api, &host.name_any(), |current| {
        let mut status = current.status.clone().unwrap_or_default();
        let Some(op) = status.operation.as_mut().filter(|op| op.id == id) else {
            return Ok::<_, ()>(None);
        };
        op.boot_requested = Some(fresh.now.clone());
        Ok(Some(status))
    })
    .await?
    .ok();
    Ok(Action::requeue(plan::SILENCE_CHECK))
}

/// Has the BMC boot the disk just written (its ramdisk waits meanwhile), and records that it
/// asked. Asked once: if the BMC refuses, the ramdisk is told to reboot, into the boot script,
/// which exits to the firmware's boot order. (An appliance that dies between the BMC's answer
/// and the record asks again: a second restart of a host seconds into its boot.)
async fn request_disk_boot(host: &Host, ctx: &Ctx, api: &Api<Host>) -> Result<Action, Error> {
    let asked = async { bmc::driver_for(host, &ctx.client).await?.boot_from_disk().await };
    match asked.await {
        Ok(()) => tracing::info!(host = %key(host), "asked the BMC to boot the disk"),
        Err(e) => {
            tracing::warn!(host = %key(host), error = %e, "cannot boot the disk through the BMC; the ramdisk reboots into the boot script, which exits to the firmware");
            ctx.event(host, true, "DiskBootFailed", format!("booting the disk: {e}")).await;
        }
    }
    let installed = host.status.as_ref().and_then(|s| s.installed.clone());
    update_host_status(api, &host.name_any(), |current| {
        let mut status = current.status.clone().unwrap_or_default();
        let Some(now) = status.installed.as_mut().filter(|now| Some(&**now) == installed.as_ref())
        else {
            return Ok::<_, ()>(None);
        };
        now.disk_boot_pending = false;
        Ok(Some(status))
    })
    .await?
    .ok();
    Ok(Action::requeue(Duration::ZERO))
}

/// Writes the status rebuilt from the Host's lifecycle record, if it still has no state.
async fn restore(
    host: &Host,
    ctx: &Ctx,
    api: &Api<Host>,
    status: crate::crd::HostStatus,
    reason: &'static str,
    message: String,
) -> Result<Action, Error> {
    let written = update_host_status(api, &host.name_any(), |current| {
        let unset = current.status.as_ref().and_then(|s| s.state).is_none();
        Ok::<_, ()>(unset.then(|| status.clone()))
    })
    .await?;
    if let Ok(Some(written)) = written {
        tracing::info!(host = %key(&written), state = ?status.state, "{message}");
        ctx.event(&written, false, reason, message).await;
    }
    Ok(Action::requeue(Duration::ZERO))
}

/// A deleted Host goes once its consumer let go and its disks are wiped (see
/// [`lifecycle::on_delete`]).
async fn delete(
    host: &Host,
    ctx: &Ctx,
    api: &Api<Host>,
    seen: &Observed<'_>,
) -> Result<Action, Error> {
    let fresh = seen.fresh;
    if !host.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    match lifecycle::on_delete(host, ctx.min_wipe) {
        // Meanwhile the lifecycle goes on: a consumer that lets go waits for the wipe it starts.
        Deletion::WaitForRelease | Deletion::WaitForWipe => match plan::transition(host, seen) {
            Some(t) => transit(host, ctx, api, (&t, fresh), |h| plan::transition(h, seen)).await,
            None if lifecycle::boot_due(host, fresh.now.0.as_second()) => {
                request_boot(host, ctx, api, fresh).await
            }
            None => Ok(Action::requeue(Duration::from_secs(30))),
        },
        Deletion::Wipe(t) => {
            let still = |h: &Host| match lifecycle::on_delete(h, ctx.min_wipe) {
                Deletion::Wipe(t) => Some(t),
                _ => None,
            };
            transit(host, ctx, api, (&t, fresh), still).await
        }
        Deletion::Moved => {
            drop_finalizer(api, host).await?;
            tracing::info!(host = %key(host), "Host moved to another management cluster: let go untouched");
            Ok(Action::await_change())
        }
        Deletion::Finish => {
            if let Ok(driver) = bmc::driver_for(host, &ctx.client).await
                && let Err(e) = driver.power_off().await
            {
                tracing::warn!(host = %key(host), error = %e, "cannot power off the deleted host");
            }
            drop_finalizer(api, host).await?;
            tracing::info!(host = %key(host), "Host deleted");
            Ok(Action::await_change())
        }
    }
}

async fn drop_finalizer(api: &Api<Host>, host: &Host) -> Result<(), Error> {
    set_finalizer(api, host, FINALIZER, false).await?;
    Ok(())
}

/// Writes on the Host where it stands among the Hosts with its boot MAC, and on those others
/// too: nothing else would wake them.
async fn report_mac(
    host: &Host,
    standing: &MacStanding,
    others: &[Arc<Host>],
    ctx: &Ctx,
    api: &Api<Host>,
) -> Result<(), Error> {
    if set_mac_condition(host, standing, ctx, api).await? {
        for other in others {
            let standing = mac_standing(ctx, other, &ctx.hosts.sharing_mac(other));
            let api = ctx.hosts_api(&other.namespace().unwrap_or_default());
            set_mac_condition(other, &standing, ctx, &api).await?;
        }
    }
    Ok(())
}

fn mac_standing(ctx: &Ctx, host: &Host, others: &[Arc<Host>]) -> MacStanding {
    let others: Vec<&Host> = others.iter().map(|h| &**h).collect();
    ctx.hosts.pools().mac_standing(host, &others)
}

/// Sets `host`'s BootMACUnique condition from its `standing`. Returns whether it changed.
async fn set_mac_condition(
    host: &Host,
    standing: &MacStanding,
    ctx: &Ctx,
    api: &Api<Host>,
) -> Result<bool, Error> {
    let (unique, reason, message) = standing.condition(&host.spec.boot_mac_address);
    let mut conditions = host.status.clone().unwrap_or_default().conditions;
    let reason = reason.to_string();
    let generation = host.metadata.generation;
    if !set_condition(&mut conditions, BOOT_MAC_UNIQUE, unique, &reason, &message, generation) {
        return Ok(false);
    }
    if !unique {
        tracing::error!(host = %key(host), "{message}");
        ctx.event(host, true, &reason, message.clone()).await;
    }
    update_host_status(api, &host.name_any(), |current| {
        let mut status = current.status.clone().unwrap_or_default();
        let generation = current.metadata.generation;
        set_condition(
            &mut status.conditions,
            BOOT_MAC_UNIQUE,
            unique,
            &reason,
            &message,
            generation,
        );
        Ok::<_, ()>(Some(status))
    })
    .await?
    .ok();
    Ok(true)
}

/// Asks the BMC, with the Secret's credentials, what system it manages, and records the
/// answer in the BMCReady condition; a Registering host goes on once it is True. A failing BMC
/// is asked again later and later ([`lifecycle::bmc_recheck_after`]), with an Event when the
/// reason changes.
async fn check_bmc(host: &Host, ctx: &Ctx, api: &Api<Host>) -> Result<Action, Error> {
    let identity = match bmc::driver_for(host, &ctx.client).await {
        Ok(driver) => driver.identity().await,
        Err(e) => Err(e),
    };
    let (ok, reason, message) = lifecycle::bmc_check(host, &identity);
    let generation = host.metadata.generation;
    let written = update_host_status(api, &host.name_any(), |current| {
        let mut status = current.status.clone().unwrap_or_default();
        let changed =
            set_condition(&mut status.conditions, BMC_READY, ok, reason, &message, generation);
        Ok::<_, ()>(changed.then_some(status))
    })
    .await?;
    if let Ok(Some(written)) = &written {
        tracing::info!(host = %key(written), ok, reason, "BMC check: {message}");
        ctx.event(written, !ok, reason, format!("BMC check: {message}")).await;
    }
    if ok {
        return Ok(Action::requeue(Duration::ZERO));
    }
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let current = written.ok().flatten();
    Ok(Action::requeue(lifecycle::bmc_recheck_after(current.as_ref().unwrap_or(host), now)))
}

/// Carries out the reboot annotation, then removes it; a BMC that fails keeps it for a later
/// pass.
async fn reboot_host(
    host: &Host,
    ctx: &Ctx,
    api: &Api<Host>,
    reboot: Reboot,
) -> Result<Action, Error> {
    let result = match reboot {
        Reboot::NoBmc => Err("the host has no spec.bmc: power-cycle it by hand".to_owned()),
        Reboot::IntoRamdisk => boot_ramdisk(host, ctx, api).await.map_err(|e| e.to_string()),
        Reboot::PowerCycle => {
            let done = async { bmc::driver_for(host, &ctx.client).await?.restart().await };
            done.await.map_err(|e: BmcError| e.to_string())
        }
    };
    let retry_later = reboot != Reboot::NoBmc && result.is_err();
    match &result {
        Ok(()) => ctx.event(host, false, "Rebooted", format!("{reboot:?} through the BMC")).await,
        Err(e) => ctx.event(host, true, "RebootFailed", e.clone()).await,
    }
    if retry_later {
        return Ok(Action::requeue(REBOOT_RETRY));
    }
    let patch = json!({ "metadata": { "annotations": { REBOOT_ANNOTATION: null } } });
    api.patch(&host.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Boots `host` into the ramdisk for the operation it runs: once from the network, or from
/// virtual media carrying a token minted now. The token's hash is stored before the media is
/// inserted, so the media works as soon as the BMC fetches it; each insertion mints a new
/// key, which voids the one before.
async fn boot_ramdisk(host: &Host, ctx: &Ctx, api: &Api<Host>) -> Result<(), BootFailure> {
    let driver = bmc::driver_for(host, &ctx.client).await?;
    let Some(op) = host.status.as_ref().and_then(|s| s.operation.as_ref()) else { return Ok(()) };
    if !op.virtual_media {
        return Ok(driver.boot_from_network().await?);
    }
    let base = ctx.media_base.as_deref().ok_or(BootFailure::NoMedia)?;
    let (media_key, hash) = token::mint_media_key();
    let written = update_host_status(api, &host.name_any(), |current| {
        let mut status = current.status.clone().unwrap_or_default();
        let Some(current_op) = status.operation.as_mut() else { return Ok(None) };
        // Once the data left, no new token: as for a network boot.
        if current_op.id != op.id || current_op.bootstrap_delivered {
            return Ok(None);
        }
        current_op.token_hash = Some(hash.clone());
        current_op.token_address = None;
        current_op.token_issued = Some(now());
        status.media_inserted = true;
        Ok::<_, ()>(Some(status))
    })
    .await?;
    if !matches!(written, Ok(Some(_))) {
        return Ok(());
    }
    tracing::info!(host = %key(host), operation = %op.id, "inserting the ramdisk's virtual media");
    let url = format!("{base}/media/{media_key}.iso");
    let checks = driver.boot_from_media(&url, ctx.media_certificate.as_deref()).await?;
    if !checks {
        let note = "the BMC does not check the appliance's certificate when it fetches the virtual media: whoever can answer for the appliance's address on the BMC's network can swap the ramdisk";
        tracing::warn!(host = %key(host), "{note}");
        ctx.event(host, true, "MediaServerUnchecked", note.to_owned()).await;
    }
    Ok(())
}

/// Why a host could not be booted into its ramdisk.
#[derive(Debug, thiserror::Error)]
enum BootFailure {
    #[error(transparent)]
    Bmc(#[from] BmcError),
    #[error(
        "the host boots from virtual media, but this appliance serves none (kubernetes.ramdisk_media)"
    )]
    NoMedia,
    #[error("cannot store the media's token: {0}")]
    Api(#[from] kube::Error),
}

/// Ejects the virtual media of an operation that ended, then boots the host's disk
/// (Provisioned) or powers it off: media left in could boot the ramdisk again, with a token
/// that no longer works.
async fn eject_media(host: &Host, ctx: &Ctx, api: &Api<Host>) -> Result<Action, Error> {
    let done = async {
        let driver = bmc::driver_for(host, &ctx.client).await?;
        driver.eject_media().await?;
        match host.status.as_ref().and_then(|s| s.state) {
            Some(HostState::Provisioned) => driver.restart().await,
            _ => driver.power_off().await,
        }
    };
    if let Err(e) = done.await {
        tracing::warn!(host = %key(host), error = %e, "cannot eject the virtual media");
        ctx.event(host, true, "MediaEjectFailed", e.to_string()).await;
        return Ok(Action::requeue(EJECT_RETRY));
    }
    update_host_status(api, &host.name_any(), |current| {
        let mut status = current.status.clone().unwrap_or_default();
        let ended = status.operation.is_none() && status.media_inserted;
        status.media_inserted = false;
        Ok::<_, ()>(ended.then_some(status))
    })
    .await?
    .ok();
    tracing::info!(host = %key(host), "virtual media ejected");
    Ok(Action::requeue(Duration::ZERO))
}

/// Records what the BMC says about power, when it changed.
async fn refresh_power(host: &Host, ctx: &Ctx) -> Result<(), Error> {
    let Ok(driver) = bmc::driver_for(host, &ctx.client).await else { return Ok(()) };
    let Ok(power) = driver.power().await else { return Ok(()) };
    if host.status.as_ref().and_then(|s| s.power) == Some(power) {
        return Ok(());
    }
    let api = ctx.hosts_api(&host.namespace().unwrap_or_default());
    update_host_status(&api, &host.name_any(), |current| {
        let mut status = current.status.clone().unwrap_or_default();
        status.power = Some(power);
        Ok::<_, ()>(Some(status))
    })
    .await?
    .ok();
    Ok(())
}
