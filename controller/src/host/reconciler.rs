//! The Host reconciler: reads a Host, computes its one next step (see [`lifecycle`]), writes it
//! with the Host's resourceVersion and records an Event. Killed between any two lines, it
//! recomputes the same step from what is stored.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use serde_json::json;

use super::lifecycle::{self, RETRY_ANNOTATION};
use crate::bmc;
use crate::context::{Ctx, Error, host_key, update_host_status};
use crate::crd::{Host, HostState, SITE_LABEL};

pub async fn run(ctx: Arc<Ctx>, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let api: Api<Host> = Api::all(ctx.client.clone());
    let config = watcher::Config::default().labels(&format!("{SITE_LABEL}={}", ctx.site));
    Controller::new(api, config)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "Host reconcile error");
            }
        })
        .await;
}

async fn reconcile(host: Arc<Host>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let Some(transition) = lifecycle::next(&host) else {
        refresh_power(&host, &ctx).await?;
        return Ok(Action::requeue(Duration::from_secs(300)));
    };
    let namespace = host.namespace().unwrap_or_default();
    let api = ctx.hosts_api(&namespace);
    let written = update_host_status(&api, &host.name_any(), |current| {
        // Re-check on the fresh Host: the step must still be the one to take.
        Ok::<_, ()>(match lifecycle::next(current) {
            Some(t) if t == transition => Some(lifecycle::apply(current, &t)),
            _ => None,
        })
    })
    .await?;
    let Ok(Some(written)) = written else { return Ok(Action::requeue(Duration::from_secs(1))) };
    let from = host.status.as_ref().and_then(|s| s.state);
    tracing::info!(host = %host_key(&written), from = ?from, to = ?transition.to, reason = transition.reason, "{}", transition.message);
    let warning = transition.to == HostState::Quarantined;
    ctx.event(
        &written,
        warning,
        transition.reason,
        format!("{from:?} -> {:?}: {}", transition.to, transition.message),
    )
    .await;
    if transition.operation.is_some()
        && let Ok(driver) = bmc::driver_for(&written)
        && let Err(e) = driver.boot_from_network().await
    {
        tracing::warn!(host = %host_key(&written), error = %e, "cannot boot the host into the ramdisk; it will when it restarts");
    }
    if transition.to == HostState::Registering && lifecycle::retry_requested(&written) {
        let patch = json!({ "metadata": { "annotations": { RETRY_ANNOTATION: null } } });
        api.patch(&written.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    }
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// Records what the BMC says about power, when it changed.
async fn refresh_power(host: &Host, ctx: &Ctx) -> Result<(), Error> {
    let Ok(driver) = bmc::driver_for(host) else { return Ok(()) };
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

fn error_policy(host: Arc<Host>, error: &Error, _: Arc<Ctx>) -> Action {
    tracing::warn!(host = %host_key(&host), error = %error, "Host reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}
