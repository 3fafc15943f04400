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
use crate::crd::{FailureDomain, Initialization, Site, SitebootCluster, set_condition};

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
    let generation = sbc.metadata.generation;
    let cluster = match sbc.labels().get(CLUSTER_NAME_LABEL) {
        Some(name) => {
            Api::<Cluster>::namespaced(ctx.client.clone(), &namespace).get_opt(name).await?
        }
        None => None,
    };
    if !check_paused(cluster.as_ref(), sbc, &mut status.conditions) {
        let sites = Api::<Site>::all(ctx.client.clone()).list(&ListParams::default()).await?.items;
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
        set_condition(&mut status.conditions, READY, true, &reason, &message, generation);
    }
    write_status(&api, sbc, sbc.status.as_ref(), &status).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}
