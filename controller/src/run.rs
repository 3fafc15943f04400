//! Starting the Kubernetes side: the Host cache (every replica, for the boot plane), leader
//! election, and, while this replica leads, the reconcilers and the Site heartbeat. In one
//! process (role `all`) one election decides both; split in two processes, the boot plane's
//! decides which replica answers DHCP and keeps the heartbeat, the controller's which runs the
//! reconcilers, each on a Lease of its own.

use std::sync::Arc;
use std::time::Duration;

use kube::CustomResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use siteboot_boot::leadership::Leadership;
use siteboot_boot::timeline::Timeline;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::context::Ctx;
use crate::crd::{
    Host, SITE_LABEL, Site, SitebootCluster, SitebootConfig, SitebootMachine,
    SitebootMachineTemplate,
};
use crate::leader::LeaderElection;
use crate::{bootstrap, cluster, host, machine, site, template};

pub struct Options {
    /// Namespace of the leader Lease.
    pub lease_namespace: String,
    /// The leader Lease's name.
    pub lease_name: String,
    /// Run the reconcilers while leading (not in the boot plane of a split appliance).
    pub reconcilers: bool,
    /// Keep the Site's heartbeat while leading (not in the controller of a split appliance:
    /// the heartbeat reports the boot plane).
    /// Off: this replica always leads (a single appliance per site, or tests of concurrent
    /// appliances).
    pub leader_election: bool,
    pub heartbeat: bool,
    /// The boot-plane addresses, for the Site status.
    pub addresses: Vec<String>,
}

/// The leader Lease of a site's boot plane (or of its whole appliance, in one process).
pub fn lease_name(site: &str) -> String {
    format!("siteboot-{site}")
}

/// The leader Lease of a site's controller, when it runs apart from the boot plane.
pub fn controller_lease_name(site: &str) -> String {
    format!("siteboot-{site}-controller")
}

/// Fails unless `K`'s CRD is installed, saying how to install it. Probes the kind with a
/// one-item list: the appliance has no rights on CRDs themselves, and needs none.
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

/// Fails unless the CRDs of the inventory are installed, and with `provider` (where the
/// reconcilers run) those of the infrastructure provider too.
pub async fn check_crds(client: &kube::Client, provider: bool) -> anyhow::Result<()> {
    probe::<Host>(client).await?;
    probe::<Site>(client).await?;
    if !provider {
        return Ok(());
    }
    probe::<SitebootMachine>(client).await?;
    probe::<SitebootMachineTemplate>(client).await?;
    probe::<SitebootCluster>(client).await?;
    Ok(())
}

/// How long the reconcilers get to finish what they are doing once this replica's term ends.
const STOP_DEADLINE: Duration = Duration::from_secs(20);

/// Runs until `release`: then this replica stops leading, its reconcilers stop, and it gives the
/// leader Lease back. `leadership` tells the boot plane (full-mode DHCP) whether and until when
/// this replica leads.
pub async fn run(
    ctx: Arc<Ctx>,
    timeline: Arc<Timeline>,
    options: Options,
    leadership: watch::Sender<Leadership>,
    release: CancellationToken,
) {
    let hosts = Api::<Host>::all(ctx.client.clone());
    let selector = watcher::Config::default().labels(&format!("{SITE_LABEL}={}", ctx.site));
    let cache = tokio::spawn(ctx.hosts.clone().run(hosts, selector));

    // The bootstrap provider is optional: without its CRD the appliance runs without it.
    let bootstrap_provider = match probe::<SitebootConfig>(&ctx.client).await {
        Ok(()) => true,
        Err(e) => {
            tracing::info!(error = %e, "the bootstrap provider stays off (restart once its CRD is installed)");
            false
        }
    };
    let mut leading_rx = leadership.subscribe();
    let election = if options.leader_election {
        let election = LeaderElection::new(
            ctx.client.clone(),
            &options.lease_namespace,
            &options.lease_name,
            &ctx.identity,
        );
        tokio::spawn(election.run(leadership, release.clone()))
    } else {
        leadership.send_replace(Leadership::Always);
        let release = release.clone();
        // Without election the sender lives until release, then ends the only term.
        tokio::spawn(async move {
            release.cancelled().await;
            leadership.send_replace(Leadership::Follower);
        })
    };
    let leading = |l: &Leadership| l.is_leading(tokio::time::Instant::now());
    loop {
        tokio::select! {
            r = leading_rx.wait_for(leading) => if r.is_err() { break },
            _ = release.cancelled() => break,
        }
        tracing::info!(site = %ctx.site, reconcilers = options.reconcilers, "leading");
        let stop = || {
            let mut rx = leading_rx.clone();
            async move {
                let _ = rx.wait_for(|l| !leading(l)).await;
            }
        };
        let mut tasks = JoinSet::new();
        if options.reconcilers {
            tasks.spawn(host::reconciler::run(ctx.clone(), stop()));
            tasks.spawn(machine::run(ctx.clone(), stop()));
            tasks.spawn(cluster::run(ctx.clone(), stop()));
            tasks.spawn(template::run(ctx.clone(), stop()));
            if bootstrap_provider {
                tasks.spawn(bootstrap::run(ctx.clone(), stop()));
            }
        } else {
            tasks.spawn(stop());
        }
        let heartbeat = options.heartbeat.then(|| {
            tokio::spawn(site::heartbeat(ctx.clone(), timeline.clone(), options.addresses.clone()))
        });
        // A reconcile stuck on a call that never returns must not keep this replica from ever
        // running its reconcilers again (seen under load: the term ended, came back, and no
        // reconciler ran). Past the deadline they are aborted: killing a reconciler between
        // any two lines is safe by design.
        let deadline = async {
            stop().await;
            tokio::time::sleep(STOP_DEADLINE).await;
        };
        tokio::pin!(deadline);
        let mut aborted = false;
        loop {
            tokio::select! {
                next = tasks.join_next() => if next.is_none() { break },
                _ = &mut deadline, if !aborted => {
                    tracing::warn!(site = %ctx.site, after = ?STOP_DEADLINE, "the reconcilers did not stop after the term ended: aborted");
                    tasks.abort_all();
                    aborted = true;
                }
            }
        }
        if let Some(heartbeat) = heartbeat {
            heartbeat.abort();
        }
        tracing::warn!(site = %ctx.site, "no longer leading: reconcilers stopped");
    }
    // The election gives the Lease back once its term has ended (the reconcilers stopped).
    let _ = election.await;
    cache.abort();
}
