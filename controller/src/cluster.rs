//! The SitebootCluster reconciler: the InfraCluster contract (v1beta2). Bare metal has nothing
//! to create for a cluster; it is provisioned at once and reports the sites as failure domains.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

use crate::conditions::{READY, Reason, check_paused};
use crate::context::{Ctx, Error, Reconciled, write_status};
use crate::crd::capi::{CLUSTER_NAME_LABEL, Cluster};
use crate::crd::{
    FailureDomain, Initialization, Site, SitebootCluster, SitebootClusterStatus, set_condition,
};

pub async fn run(ctx: Arc<Ctx>, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let client = ctx.client.clone();
    let controller =
        Controller::new(Api::<SitebootCluster>::all(client.clone()), watcher::Config::default());
    let store = controller.store();
    let controller =
        controller.watches(Api::<Site>::all(client), watcher::Config::default(), move |_| {
            store.state().into_iter().map(|c| ObjectRef::from_obj(&*c)).collect::<Vec<_>>()
        });
    ctx.drive(controller, shutdown, |sbc, ctx| async move { pass(&sbc, &ctx).await }).await;
}

impl Reconciled for SitebootCluster {}

async fn pass(sbc: &SitebootCluster, ctx: &Ctx) -> Result<Action, Error> {
    let namespace = sbc.namespace().unwrap_or_default();
    let api: Api<SitebootCluster> = Api::namespaced(ctx.client.clone(), &namespace);
    let mut status = sbc.status.clone().unwrap_or_default();
    let cluster = match sbc.labels().get(CLUSTER_NAME_LABEL) {
        Some(name) => {
            Api::<Cluster>::namespaced(ctx.client.clone(), &namespace).get_opt(name).await?
        }
        None => None,
    };
    if !check_paused(cluster.as_ref(), sbc, &mut status.conditions) {
        let sites = Api::<Site>::all(ctx.client.clone()).list(&ListParams::default()).await?.items;
        provisioned(sbc, &sites, &mut status);
    }
    write_status(&api, sbc, sbc.status.as_ref(), &status).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// `status` of an unpaused SitebootCluster among `sites`: provisioned at once, offering the
/// sites it names (every Site by default) as failure domains, in name order.
fn provisioned(sbc: &SitebootCluster, sites: &[Site], status: &mut SitebootClusterStatus) {
    status.failure_domains = sites
        .iter()
        .filter(|s| sbc.spec.sites.as_ref().is_none_or(|wanted| wanted.contains(&s.name_any())))
        .map(|s| FailureDomain {
            name: s.name_any(),
            control_plane: Some(s.spec.control_plane.unwrap_or(true)),
            attributes: BTreeMap::new(),
        })
        .collect();
    status.failure_domains.sort_by(|a, b| a.name.cmp(&b.name));
    status.initialization = Some(Initialization { provisioned: Some(true) });
    let message = format!("{} sites as failure domains", status.failure_domains.len());
    let reason = Reason::Provisioned.to_string();
    let generation = sbc.metadata.generation;
    set_condition(&mut status.conditions, READY, true, &reason, &message, generation);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{SiteSpec, SitebootClusterSpec, condition};

    fn site(name: &str, control_plane: Option<bool>) -> Site {
        Site::new(name, SiteSpec { description: None, control_plane })
    }

    /// The sites named (all by default) become failure domains, sorted, control-plane unless
    /// a Site says otherwise; the cluster is provisioned and Ready at once.
    #[test]
    fn a_cluster_offers_its_sites_as_failure_domains() {
        let sites = [site("rack-b", None), site("rack-a", Some(false)), site("lab", None)];
        let mut sbc = SitebootCluster::new("c", SitebootClusterSpec::default());
        let mut status = SitebootClusterStatus::default();
        provisioned(&sbc, &sites, &mut status);
        let domains: Vec<_> =
            status.failure_domains.iter().map(|d| (d.name.as_str(), d.control_plane)).collect();
        assert_eq!(domains, [("lab", Some(true)), ("rack-a", Some(false)), ("rack-b", Some(true))]);
        assert_eq!(status.initialization, Some(Initialization { provisioned: Some(true) }));
        let ready = condition(&status.conditions, READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.message.as_str()),
            ("True", "3 sites as failure domains")
        );
        // Named sites only; a Site that no longer exists is not offered.
        sbc.spec.sites = Some(vec!["rack-b".into(), "gone".into()]);
        provisioned(&sbc, &sites, &mut status);
        let names: Vec<_> = status.failure_domains.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["rack-b"]);
    }
}
