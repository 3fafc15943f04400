//! Starting the Kubernetes side: the Host cache (every replica, for the boot plane), leader
//! election, and, while this replica leads, the reconcilers and the Site heartbeat.

use std::sync::Arc;

use kube::CustomResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use siteboot_boot::timeline::Timeline;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::context::Ctx;
use crate::crd::{Host, SITE_LABEL, Site, SitebootCluster, SitebootMachine};
use crate::leader::LeaderElection;
use crate::{cluster, host, machine, site};

pub struct Options {
    /// Namespace of the leader Lease.
    pub lease_namespace: String,
    /// Off: this replica always leads (a single appliance per site, or tests of concurrent
    /// appliances).
    pub leader_election: bool,
    /// The boot-plane addresses, for the Site status.
    pub addresses: Vec<String>,
}

/// Fails unless siteboot's CRDs are installed, saying how to install them. Probes each kind
/// with a one-item list: the appliance has no rights on CRDs themselves, and needs none.
pub async fn check_crds(client: &kube::Client) -> anyhow::Result<()> {
    async fn probe<K>(client: &kube::Client) -> anyhow::Result<()>
    where
        K: kube::Resource<DynamicType = ()>
            + CustomResourceExt
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        match Api::<K>::all(client.clone()).list(&ListParams::default().limit(1)).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => anyhow::bail!(
                "the {} CRD is not installed: run `siteboot manifests | kubectl apply -f -`",
                K::crd_name()
            ),
            Err(e) => Err(anyhow::Error::new(e).context(format!("listing {}", K::plural(&())))),
        }
    }
    probe::<Host>(client).await?;
    probe::<Site>(client).await?;
    probe::<SitebootMachine>(client).await?;
    probe::<SitebootCluster>(client).await?;
    Ok(())
}

/// Runs until the process ends. `leading` tells the boot plane (full-mode DHCP) whether this
/// replica leads.
pub async fn run(
    ctx: Arc<Ctx>,
    timeline: Arc<Timeline>,
    options: Options,
    leading: watch::Sender<bool>,
) {
    let hosts = Api::<Host>::all(ctx.client.clone());
    let selector = watcher::Config::default().labels(&format!("{SITE_LABEL}={}", ctx.site));
    tokio::spawn(ctx.hosts.clone().run(hosts, selector));

    let mut leading_rx = leading.subscribe();
    // Without election the sender stays here, alive as long as this loop.
    let _always_leading = if options.leader_election {
        let election = LeaderElection::new(
            ctx.client.clone(),
            &options.lease_namespace,
            &ctx.site,
            &ctx.identity,
        );
        tokio::spawn(election.run(leading));
        None
    } else {
        leading.send_replace(true);
        Some(leading)
    };
    loop {
        if leading_rx.wait_for(|l| *l).await.is_err() {
            return;
        }
        tracing::info!(site = %ctx.site, "leading: starting the reconcilers");
        let stop = || {
            let mut rx = leading_rx.clone();
            async move {
                let _ = rx.wait_for(|l| !*l).await;
            }
        };
        let mut tasks = JoinSet::new();
        tasks.spawn(host::reconciler::run(ctx.clone(), stop()));
        tasks.spawn(machine::run(ctx.clone(), stop()));
        tasks.spawn(cluster::run(ctx.clone(), stop()));
        let heartbeat =
            tokio::spawn(site::heartbeat(ctx.clone(), timeline.clone(), options.addresses.clone()));
        while tasks.join_next().await.is_some() {}
        heartbeat.abort();
        tracing::warn!(site = %ctx.site, "no longer leading: reconcilers stopped");
    }
}
