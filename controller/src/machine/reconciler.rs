//! The SitebootMachine reconciler: reads what [`plan`] needs, performs the step it returns with a
//! compare-and-swap, and writes the status. Killed between any two lines, the next pass reads
//! what was stored and plans the same step or the one after it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Secret};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde_json::json;
use siteboot_boot::dhcp::leases::unix_now;

use super::plan::{self, BINDER_ANNOTATION, FINALIZER, Observed, Plan, Requeue, Step, consumed_by};
use crate::conditions::{READY, Reason};
use crate::context::{
    Ctx, Error, Reconciled, key, patch_unchanged, report_refused_in_ready, set_finalizer,
    write_status,
};
use crate::crd::{ConsumerRef, Host, HostRef, SITE_LABEL, SitebootMachine};
use crate::handoff::{self, BootstrapData};
use crate::owners::{self, OwnedBy, Owners};
use crate::workload::Workload;

/// After losing a compare-and-swap: long enough for the watch to bring the winner's write.
const LOST_RACE_RETRY: Duration = Duration::from_secs(1);
/// When what a step needs is not there yet (a bootstrap Secret the Machine names).
const NOT_YET_RETRY: Duration = Duration::from_secs(5);

pub async fn run(ctx: Arc<Ctx>, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let client = ctx.client.clone();
    let controller =
        Controller::new(Api::<SitebootMachine>::all(client.clone()), watcher::Config::default());
    let by_host = controller.store();
    let controller = controller.watches(
        Api::<Host>::all(client.clone()),
        watcher::Config::default().labels(&format!("{SITE_LABEL}={}", ctx.site)),
        move |host| machines_for_host(&host, &by_host),
    );
    let (controller, owners) = Owners::watch(&client, controller, |machine| {
        let namespace = machine.namespace().unwrap_or_default();
        machine
            .spec
            .infrastructure_ref
            .as_ref()
            .filter(|r| r.kind == "SitebootMachine")
            .map(|r| ObjectRef::new(&r.name).within(&namespace))
    });
    let owners = Arc::new(owners);
    ctx.drive(controller, shutdown, move |sbm, ctx| {
        let owners = owners.clone();
        async move { pass(&sbm, &ctx, &owners).await }
    })
    .await;
}

/// A Host change concerns its consumer, and, if it may have become claimable, every machine
/// still waiting for a host.
fn machines_for_host(
    host: &Host,
    store: &Store<SitebootMachine>,
) -> Vec<ObjectRef<SitebootMachine>> {
    let mut refs = Vec::new();
    if let Some(c) = &host.spec.consumer_ref
        && c.kind == "SitebootMachine"
    {
        refs.push(ObjectRef::new(&c.name).within(&c.namespace));
    }
    if host.spec.consumer_ref.is_none() {
        refs.extend(
            store
                .state()
                .into_iter()
                .filter(|m| m.spec.host_ref.is_none())
                .map(|m| ObjectRef::from_obj(&*m)),
        );
    }
    refs
}

impl Reconciled for SitebootMachine {
    /// In the Ready condition, which Cluster API shows on the Machine (best effort: this write
    /// may be refused too).
    async fn report_refused(&self, ctx: &Ctx, error: &Error) {
        let conditions = self.status.clone().unwrap_or_default().conditions;
        report_refused_in_ready(ctx, self, &conditions, error).await
    }
}

async fn pass(sbm: &SitebootMachine, ctx: &Ctx, owners: &Owners) -> Result<Action, Error> {
    let namespace = sbm.namespace().unwrap_or_default();
    let Some(OwnedBy { machine: owner, cluster }) = owners.of(sbm) else {
        return Ok(Action::requeue(owners::NOT_LISTED_RETRY));
    };
    let bound = match &sbm.spec.host_ref {
        Some(r) => ctx.hosts_api(&r.namespace).get_opt(&r.name).await?,
        None => None,
    };
    let hosts = ctx.hosts.all();
    let workload = match (&cluster, plan::wants_nodes(owner.as_deref(), bound.as_ref())) {
        (Some(cluster), true) => Some(
            ctx.workloads
                .of_cluster(&ctx.client, &namespace, &cluster.name_any())
                .await?
                .unwrap_or_else(|| {
                    Err(format!("{}-kubeconfig does not exist", cluster.name_any()))
                }),
        ),
        _ => None,
    };
    let nodes = match &workload {
        Some(Ok(w)) => Some(w.nodes().await),
        Some(Err(why)) => Some(Err(why.clone())),
        None => None,
    };
    let staged = match sbm.uid() {
        Some(uid) => handoff::staged(&ctx.client, &ctx.namespace, &uid).await?,
        None => None,
    };
    let seen = Observed {
        machine: sbm,
        owner: owner.as_deref(),
        cluster: cluster.as_deref(),
        bound: bound.as_ref(),
        hosts: &hosts,
        nodes: nodes.as_ref().map(|n| n.as_ref().map(|n| n.as_slice()).map_err(Clone::clone)),
        staged: staged.as_ref(),
        now: unix_now(),
    };
    let Plan { step, status, requeue } = plan::plan(&seen, &ctx.machine_policy);
    if status_reason(&status) == Some(Reason::NoHostAvailable.to_string())
        && !plan::was_waiting_for_a_host(sbm)
    {
        tracing::info!(machine = %key(sbm), "{}", status_message(&status));
    }
    let api: Api<SitebootMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let workload = workload.as_ref().and_then(|w| w.as_ref().ok());
    let requeue = match perform(sbm, ctx, &api, workload, step).await? {
        Done::Yes => requeue,
        // The read was stale: a status planned from it would undo what was written since.
        Done::LostRace => return Ok(Requeue::After(LOST_RACE_RETRY).into()),
        Done::NotYet => Requeue::After(NOT_YET_RETRY),
    };
    write_status(&api, sbm, sbm.status.as_ref(), &status).await?;
    Ok(requeue.into())
}

fn status_reason(status: &crate::crd::SitebootMachineStatus) -> Option<String> {
    crate::crd::condition(&status.conditions, READY).map(|c| c.reason.clone())
}

fn status_message(status: &crate::crd::SitebootMachineStatus) -> String {
    crate::crd::condition(&status.conditions, READY).map(|c| c.message.clone()).unwrap_or_default()
}

/// Whether `sbm` is still the machine's latest version.
async fn unchanged(api: &Api<SitebootMachine>, sbm: &SitebootMachine) -> Result<bool, Error> {
    let latest = api.get_opt(&sbm.name_any()).await?;
    Ok(latest.is_some_and(|m| m.metadata.resource_version == sbm.metadata.resource_version))
}

enum Done {
    Yes,
    /// A compare-and-swap found the object changed since it was read.
    LostRace,
    /// What the step needs does not exist yet.
    NotYet,
}

fn done<K>(written: Option<K>) -> Done {
    if written.is_some() { Done::Yes } else { Done::LostRace }
}

async fn perform(
    sbm: &SitebootMachine,
    ctx: &Ctx,
    api: &Api<SitebootMachine>,
    workload: Option<&Workload>,
    step: Step<'_>,
) -> Result<Done, Error> {
    let hosts_api = |host: &Host| ctx.hosts_api(&host.namespace().unwrap_or_default());
    Ok(match step {
        Step::None => Done::Yes,
        Step::AddFinalizer => done(set_finalizer(api, sbm, FINALIZER, true).await?),
        Step::RemoveFinalizer => done(set_finalizer(api, sbm, FINALIZER, false).await?),
        Step::Mark(mark) => {
            let patch =
                json!({ "metadata": { "annotations": { BINDER_ANNOTATION: mark.to_string() } } });
            done(patch_unchanged(api, sbm, patch).await?)
        }
        Step::Claim(host) | Step::Adopt(host) => {
            let adopting = matches!(step, Step::Adopt(_));
            let consumer = ConsumerRef {
                api_version: SitebootMachine::api_version(&()).into_owned(),
                kind: "SitebootMachine".into(),
                namespace: sbm.namespace().unwrap_or_default(),
                name: sbm.name_any(),
                uid: sbm.uid().unwrap_or_default(),
            };
            let patch = json!({ "spec": { "consumerRef": consumer } });
            match patch_unchanged(&hosts_api(host), host, patch).await? {
                Some(claimed) if adopting => {
                    tracing::info!(machine = %key(sbm), host = %claimed.name_any(), "took over the claim of a moved Host");
                    let note = format!(
                        "claim taken over by SitebootMachine {} after a move or restore",
                        key(sbm)
                    );
                    ctx.event(&claimed, false, "Adopted", note).await;
                    Done::Yes
                }
                Some(claimed) => {
                    tracing::info!(machine = %key(sbm), host = %claimed.name_any(), "claimed a Host");
                    let note = format!("claimed by SitebootMachine {}", key(sbm));
                    ctx.event(&claimed, false, "Claimed", note).await;
                    Done::Yes
                }
                None => {
                    tracing::debug!(machine = %key(sbm), host = %host.name_any(), "lost the race for a Host");
                    Done::LostRace
                }
            }
        }
        Step::RecordHostRef(host) => {
            let host_ref =
                HostRef { namespace: host.namespace().unwrap_or_default(), name: host.name_any() };
            let patch = json!({ "metadata": { "annotations": { BINDER_ANNOTATION: null } }, "spec": { "hostRef": host_ref } });
            match api.patch(&sbm.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await {
                Ok(_) => Done::Yes,
                // The CEL rule keeps hostRef once set: this machine was bound elsewhere (a binder
                // that timed out). The next pass gives this claim back as an orphan.
                Err(kube::Error::Api(e)) if e.code == 422 => Done::LostRace,
                Err(e) => return Err(e.into()),
            }
        }
        Step::SetNodeProviderId { node, provider_id } => {
            let Some(w) = workload else {
                return Ok(Done::LostRace); // the plan saw Nodes, so there is a workload
            };
            let patch = json!({ "spec": { "providerID": provider_id } });
            let nodes = Api::<Node>::all(w.client.clone());
            let written = patch_unchanged(&nodes, node, patch).await.map_err(|e| w.error(e))?;
            if written.is_some() {
                tracing::info!(machine = %key(sbm), node = %node.name_any(), provider_id, "set the providerID of the machine's Node (found by its system UUID)");
            }
            done(written)
        }
        Step::ForgetHostRef => {
            let host = sbm.spec.host_ref.as_ref().map(|r| format!("{}/{}", r.namespace, r.name));
            let patch = json!({ "spec": { "hostRef": null } });
            let forgotten = patch_unchanged(api, sbm, patch).await?;
            if forgotten.is_some() {
                tracing::warn!(machine = %key(sbm), host = host.unwrap_or_default(), "the Host no longer names this machine; binding it again");
            }
            done(forgotten)
        }
        Step::Release { host, why } => {
            // The machine comes from one watch and the Hosts from another: a claim made moments
            // ago for this machine looks unused to a copy of it that predates its mark or its
            // hostRef. Give back only what the machine as it is now does not use.
            if !unchanged(api, sbm).await? {
                return Ok(Done::LostRace);
            }
            // Only a claim for this machine is released; provisioning goes with it, and the Host
            // lifecycle wipes whatever may have been written.
            debug_assert!(consumed_by(host, sbm));
            let patch = json!({ "spec": { "consumerRef": null, "provisioning": null } });
            match patch_unchanged(&hosts_api(host), host, patch).await? {
                Some(released) => {
                    tracing::info!(host = %released.name_any(), "released the Host: {why}");
                    ctx.event(&released, false, "Released", why).await;
                    Done::Yes
                }
                None => Done::LostRace,
            }
        }
        Step::RequestProvisioning { host, provisioning } => {
            let patch = json!({ "spec": { "provisioning": provisioning } });
            done(patch_unchanged(&hosts_api(host), host, patch).await?)
        }
        Step::CancelProvisioning(host) => {
            let patch = json!({ "spec": { "provisioning": null } });
            done(patch_unchanged(&hosts_api(host), host, patch).await?)
        }
        Step::StageBootstrapData { secret, staged } => {
            let uid = sbm.uid().unwrap_or_default();
            let tenant =
                Api::<Secret>::namespaced(ctx.client.clone(), &sbm.namespace().unwrap_or_default());
            let data = tenant.get_opt(&secret).await?;
            let Some(data) = data.as_ref().and_then(BootstrapData::of) else {
                tracing::info!(machine = %key(sbm), secret, "the bootstrap Secret has no data yet");
                return Ok(Done::NotYet);
            };
            handoff::stage(&ctx.client, &ctx.namespace, &uid, &staged, &data).await?;
            tracing::info!(machine = %key(sbm), host = staged.host, operation = staged.operation, "bootstrap data handed to the boot plane");
            Done::Yes
        }
        Step::UnstageBootstrapData => {
            handoff::unstage(&ctx.client, &ctx.namespace, &sbm.uid().unwrap_or_default()).await?;
            tracing::debug!(machine = %key(sbm), "staged bootstrap data deleted");
            Done::Yes
        }
        Step::SetProviderId(provider_id) => {
            let patch = json!({ "spec": { "providerID": provider_id } });
            api.patch(&sbm.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
            Done::Yes
        }
    })
}
