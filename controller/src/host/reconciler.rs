//! The Host reconciler: reads a Host, has [`plan`] pick its one next step, asks the BMC (or logs
//! in over SSH) if the step does, and performs what [`write::outcome`] makes of that: status written with the
//! Host's resourceVersion (re-read and recomputed on conflict), metadata patches guarded the
//! same way, log lines and Events. Killed between any two lines, it recomputes the same step
//! from what is stored. It also keeps a finalizer on every Host, so a deleted one is released
//! and wiped before it goes, keeps its lifecycle [`record`](super::record) (what a
//! `clusterctl move` or a restore must not lose) and restores from it, honours the paused
//! annotation, and reports boot MACs two Hosts share (only the owner goes on).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;

use super::lifecycle::{Fresh, Reboot};
use super::plan::{self, Observed, Step};
use super::write::{self, Again, Answer, Change, Outcome, TokenCarrier, Write};
use crate::agent;
use crate::bmc::{self, BmcError};
use crate::context::{
    Ctx, Error, Level, Note, Reconciled, key, patch_unchanged, update_host_status,
};
use crate::crd::{Host, HostState, SITE_LABEL};
use crate::handoff::{self, BootstrapData, Staged};
use crate::machine::plan::provider_id;
use crate::pools::MacStanding;
use crate::ssh;
use siteboot_agent_server::token;
use siteboot_ssh::adopt::MetaData;

/// How soon a Host is looked at again after a write that did not land (it was planned from a
/// stale read).
const LOST_RACE: Duration = Duration::from_secs(1);

pub async fn run(ctx: Arc<Ctx>, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let api: Api<Host> = Api::all(ctx.client.clone());
    let config = watcher::Config::default().labels(&format!("{SITE_LABEL}={}", ctx.site));
    let controller = Controller::new(api, config);
    ctx.drive(controller, shutdown, |host, ctx| async move { pass(&host, &ctx).await }).await;
}

impl Reconciled for Host {}

async fn pass(host: &Host, ctx: &Ctx) -> Result<Action, Error> {
    // The only clock and randomness of the pass: the plan is a function of what was read.
    let fresh = Fresh::now();
    let others = ctx.hosts.sharing_mac(host);
    let mac = mac_standing(ctx, host, &others);
    let others: Vec<(Arc<Host>, MacStanding)> = others
        .iter()
        .map(|other| (other.clone(), mac_standing(ctx, other, &ctx.hosts.sharing_mac(other))))
        .collect();
    let seen = Observed {
        fresh: &fresh,
        mac: &mac,
        others: &others,
        max_silence: ctx.ramdisk_silence_timeout,
        min_wipe: ctx.min_wipe,
    };
    let step = plan::next(host, &seen);
    let answer = ask(&step, host, ctx, &fresh).await?;
    perform(ctx, host, write::outcome(&step, host, &seen, answer)).await
}

fn mac_standing(ctx: &Ctx, host: &Host, others: &[Arc<Host>]) -> MacStanding {
    let others: Vec<&Host> = others.iter().map(|h| &**h).collect();
    ctx.hosts.pools().mac_standing(host, &others)
}

/// Asks the Host's BMC (or its SSH server) what `step` needs of it: the pass's only I/O besides
/// its writes.
async fn ask(step: &Step, host: &Host, ctx: &Ctx, fresh: &Fresh) -> Result<Answer, Error> {
    if *step == Step::CheckSsh {
        return Ok(Answer::Ssh(ssh::check(host, &ctx.client).await));
    }
    if *step == Step::InspectOverSsh {
        return Ok(Answer::Inspected(ssh::inspect(host, &ctx.client).await));
    }
    if *step == Step::DeliverOverSsh {
        let data = staged_delivery(host, ctx).await?;
        return Ok(Answer::Delivery(ssh::deliver(host, &ctx.client, data).await));
    }
    if *step == Step::ResetOverSsh {
        return Ok(Answer::Reset(ssh::reset(host, &ctx.client).await));
    }
    if *step == Step::KexecOverSsh {
        let issue = async || issue_kexec_token(host, ctx, fresh).await;
        let ramdisk = ctx.kexec_ramdisk.as_ref();
        return Ok(Answer::Kexec(ssh::kexec(host, &ctx.client, ramdisk, issue).await?));
    }
    let asks = matches!(
        step,
        Step::RequestBoot
            | Step::RequestDiskBoot
            | Step::CheckBmc
            | Step::Reboot(_)
            | Step::EjectMedia
            | Step::PowerOffAndLetGo
            | Step::Idle { .. }
    );
    if !asks || host.spec.bmc.is_none() {
        return Ok(Answer::NotAsked);
    }
    let driver = match bmc::driver_for(host, &ctx.client).await {
        Ok(driver) => driver,
        Err(e) if matches!(step, Step::CheckBmc) => return Ok(Answer::Identity(Err(e))),
        Err(_) if matches!(step, Step::Idle { .. }) => return Ok(Answer::Power(None)),
        Err(e) => return Ok(Answer::Done(Err(e.to_string()))),
    };
    let done = |result: Result<(), BmcError>| Answer::Done(result.map_err(|e| e.to_string()));
    Ok(match step {
        Step::RequestBoot | Step::Reboot(Reboot::IntoRamdisk) => {
            match boot_ramdisk(host, ctx, &*driver, fresh).await {
                Err(BootFailure::Api(e)) => return Err(e.into()),
                result => Answer::Done(result.map_err(|e| e.to_string())),
            }
        }
        Step::RequestDiskBoot => done(driver.boot_from_disk().await),
        Step::CheckBmc => Answer::Identity(driver.identity().await),
        Step::Reboot(_) => done(driver.restart().await),
        Step::EjectMedia => {
            // Media left in could boot the ramdisk again, with a token that no longer works:
            // out, then the disk (Provisioned) or power off.
            let ejected = async {
                driver.eject_media().await?;
                match host.status.as_ref().and_then(|s| s.state) {
                    Some(HostState::Provisioned) => driver.restart().await,
                    _ => driver.power_off().await,
                }
            };
            done(ejected.await)
        }
        Step::PowerOffAndLetGo => done(driver.power_off().await),
        Step::Idle { .. } => Answer::Power(driver.power().await.ok()),
        _ => Answer::NotAsked,
    })
}

/// What an adopted host's delivery sends, until it was seen started: the data staged for its
/// operation, read as the boot plane reads it ([`handoff::read`]: only a copy naming this Host
/// and operation), and the meta-data a ramdisk would write. `None`: not staged (yet).
async fn staged_delivery(
    host: &Host,
    ctx: &Ctx,
) -> Result<Option<(BootstrapData, MetaData)>, kube::Error> {
    let op = host.status.as_ref().and_then(|s| s.operation.as_ref());
    let (Some(consumer), Some(op)) = (&host.spec.consumer_ref, op) else { return Ok(None) };
    if op.bootstrap_delivered {
        return Ok(None);
    }
    let expected = Staged { host: key(host), operation: op.id.clone() };
    let staged = handoff::read(&ctx.client, &ctx.namespace, &consumer.uid, &expected).await?;
    let Some(data) = staged else { return Ok(None) };
    let meta = MetaData {
        instance_id: op.id.clone(),
        local_hostname: agent::machine_name(&ctx.client, host).await?,
        provider_id: provider_id(host),
    };
    Ok(Some((data, meta)))
}

/// Mints a token for the kexec of `host`'s operation and stores its hash before the token
/// leaves (as for virtual media); a new token voids the one before. `None`: the write did not
/// land (the Host changed since it was read), and nothing is sent.
async fn issue_kexec_token(
    host: &Host,
    ctx: &Ctx,
    fresh: &Fresh,
) -> Result<Option<String>, kube::Error> {
    let (token, hash) = token::mint();
    let Some(write) = write::out_of_band_token(host, hash, &fresh.now, TokenCarrier::Kexec) else {
        return Ok(None);
    };
    Ok(apply(ctx, write).await?.then_some(token))
}

/// Boots `host` into the ramdisk for the operation it runs: once from the network, or from
/// virtual media carrying a token minted now. Its hash is stored before the media is inserted
/// ([`write::StatusChange::OutOfBandToken`]); each insertion mints a new key, which voids the one
/// before.
async fn boot_ramdisk(
    host: &Host,
    ctx: &Ctx,
    driver: &dyn bmc::BmcDriver,
    fresh: &Fresh,
) -> Result<(), BootFailure> {
    let Some(op) = host.status.as_ref().and_then(|s| s.operation.as_ref()) else { return Ok(()) };
    if !op.virtual_media {
        return Ok(driver.boot_from_network().await?);
    }
    let base = ctx.media_base.as_deref().ok_or(BootFailure::NoMedia)?;
    let (media_key, hash) = token::mint_media_key();
    let carrier = TokenCarrier::VirtualMedia;
    let Some(write) = write::out_of_band_token(host, hash, &fresh.now, carrier) else {
        return Ok(());
    };
    if !apply(ctx, write).await? {
        return Ok(());
    }
    tracing::info!(host = %key(host), operation = %op.id, "inserting the ramdisk's virtual media");
    let url = format!("{base}/media/{media_key}.iso");
    let checks = driver.boot_from_media(&url, ctx.media_certificate.as_deref()).await?;
    if !checks {
        let note = "the BMC does not check the appliance's certificate when it fetches the virtual media: whoever can answer for the appliance's address on the BMC's network can swap the ramdisk";
        say(ctx, host, &Note::warning(note).event("MediaServerUnchecked", note)).await;
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

/// Says what `outcome` says and performs its writes in order, stopping at one that does not
/// land.
async fn perform(ctx: &Ctx, host: &Host, outcome: Outcome<'_>) -> Result<Action, Error> {
    let Outcome { note, writes, again } = outcome;
    if let Some(note) = &note {
        say(ctx, host, note).await;
    }
    for write in writes {
        if !apply(ctx, write).await? {
            return Ok(Action::requeue(LOST_RACE));
        }
    }
    Ok(match again {
        Again::After(after) => Action::requeue(after),
        Again::OnChange => Action::await_change(),
    })
}

/// Performs one write, then says what it says. Whether it landed.
async fn apply(ctx: &Ctx, write: Write<'_>) -> Result<bool, kube::Error> {
    let Write { target, change, note } = write;
    let api = ctx.hosts_api(&target.namespace().unwrap_or_default());
    let name = target.name_any();
    let written = match change {
        Change::Status(change) => {
            update_host_status(&api, &name, |current| Ok::<_, ()>(change.apply(current)))
                .await?
                .ok()
                .flatten()
        }
        Change::Patch(patch) => patch_unchanged(&api, target, patch).await?,
        Change::PlainPatch(patch) => {
            Some(api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?)
        }
    };
    let Some(written) = written else {
        tracing::debug!(host = %key(target), "changed since it was read: not written");
        return Ok(false);
    };
    if let Some(note) = note {
        say(ctx, &written, &note).await;
    }
    Ok(true)
}

/// Logs `note` about `host`, and records its Event.
async fn say(ctx: &Ctx, host: &Host, note: &Note) {
    match note.level {
        Level::Debug => tracing::debug!(host = %key(host), "{}", note.log),
        Level::Info => tracing::info!(host = %key(host), "{}", note.log),
        Level::Warning => tracing::warn!(host = %key(host), "{}", note.log),
    }
    if let Some((reason, message)) = &note.event {
        ctx.event(host, note.is_warning(), reason, message.clone()).await;
    }
}
