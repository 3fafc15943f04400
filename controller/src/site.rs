//! The Site object: created if missing, its status the leader's heartbeat with host counts and
//! boot counters, so `kubectl get sites` shows each appliance is alive.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams, PostParams};
use siteboot_boot::timeline::Timeline;

use crate::context::Ctx;
use crate::crd::{Site, SiteSpec, SiteStatus, now};

pub const HEARTBEAT: Duration = Duration::from_secs(15);

pub async fn heartbeat(ctx: Arc<Ctx>, timeline: Arc<Timeline>, addresses: Vec<String>) {
    let api: Api<Site> = Api::all(ctx.client.clone());
    loop {
        if let Err(e) = beat(&ctx, &api, &timeline, &addresses).await {
            tracing::warn!(site = %ctx.site, error = %e, "cannot update the Site heartbeat");
        }
        tokio::time::sleep(HEARTBEAT).await;
    }
}

async fn beat(
    ctx: &Ctx,
    api: &Api<Site>,
    timeline: &Timeline,
    addresses: &[String],
) -> Result<(), kube::Error> {
    if api.get_opt(&ctx.site).await?.is_none() {
        let site = Site::new(&ctx.site, SiteSpec::default());
        match api.create(&PostParams::default(), &site).await {
            Ok(_) => tracing::info!(site = %ctx.site, "created the Site"),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    let mut hosts: BTreeMap<String, u32> = BTreeMap::new();
    for host in ctx.hosts.all() {
        let state = host
            .status
            .as_ref()
            .and_then(|s| s.state)
            .map(|s| format!("{s:?}"))
            .unwrap_or_else(|| "New".into());
        *hosts.entry(state).or_default() += 1;
    }
    let status = SiteStatus {
        leader: Some(ctx.identity.clone()),
        heartbeat: Some(now()),
        version: Some(env!("CARGO_PKG_VERSION").to_owned()),
        addresses: addresses.to_vec(),
        hosts,
        boots: timeline
            .stage_counts()
            .filter(|(_, n)| *n > 0)
            .map(|(s, n)| (s.as_str().to_owned(), n))
            .collect(),
    };
    api.patch_status(
        &ctx.site,
        &PatchParams::default(),
        &Patch::Merge(&serde_json::json!({ "status": status })),
    )
    .await?;
    Ok(())
}
