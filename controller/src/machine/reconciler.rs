//! The SitebootMachine reconciler: reads what [`plan`] needs, performs the step it returns (the
//! write the step describes, [`Step::write`], through one `apply`; or the bootstrap data handed
//! to the boot plane), and writes the status. Killed between any two lines, the next pass reads
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
use siteboot_boot::dhcp::leases::unix_now;

use super::plan::{self, Observed, Plan, Requeue, Step};
use super::write::{Guard, Level, Note, Target, Write};
use crate::conditions::{READY, Reason};
use crate::context::{
    Ctx, Error, Reconciled, key, patch_unchanged, report_refused_in_ready, write_status,
};
use crate::crd::{Host, SITE_LABEL, SitebootMachine};
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
    /// Someone else wrote first (a compare-and-swap found the object changed, see [`Guard`]).
    LostRace,
    /// What the step needs does not exist yet.
    NotYet,
}

async fn perform(
    sbm: &SitebootMachine,
    ctx: &Ctx,
    api: &Api<SitebootMachine>,
    workload: Option<&Workload>,
    step: Step<'_>,
) -> Result<Done, Error> {
    if let Some(write) = step.write(sbm) {
        return apply(sbm, ctx, api, workload, write).await;
    }
    Ok(match step {
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
        // Step::None: every other step is a write.
        _ => Done::Yes,
    })
}

/// Performs the write a step describes, as its guard says, then says what it did.
async fn apply(
    sbm: &SitebootMachine,
    ctx: &Ctx,
    api: &Api<SitebootMachine>,
    workload: Option<&Workload>,
    write: Write<'_>,
) -> Result<Done, Error> {
    let Write { target, patch, guard, note } = write;
    if guard == Guard::BothUnchanged && !unchanged(api, sbm).await? {
        return Ok(Done::LostRace);
    }
    let (object, written) = match target {
        Target::Machine => {
            let written = guarded(api, sbm, patch, guard).await?;
            (format!("SitebootMachine {}", key(sbm)), written.is_some())
        }
        Target::Host(host) => {
            let hosts = ctx.hosts_api(&host.namespace().unwrap_or_default());
            let written = guarded(&hosts, host, patch, guard).await?;
            if let (Some(written), Some(note @ Note { event: Some((reason, message)), .. })) =
                (&written, &note)
            {
                ctx.event(written, note.is_warning(), reason, message.clone()).await;
            }
            (format!("Host {}", key(host)), written.is_some())
        }
        Target::Node(node) => {
            let Some(w) = workload else {
                return Ok(Done::LostRace); // the plan saw Nodes, so there is a workload
            };
            let nodes = Api::<Node>::all(w.client.clone());
            let written = guarded(&nodes, node, patch, guard).await.map_err(|e| w.error(e))?;
            (format!("Node {}", node.name_any()), written.is_some())
        }
    };
    if !written {
        tracing::debug!(machine = %key(sbm), object, "lost the race: it changed since it was read");
        return Ok(Done::LostRace);
    }
    match note {
        Some(Note { level: Level::Warning, log, .. }) => {
            tracing::warn!(machine = %key(sbm), object, "{log}")
        }
        Some(Note { log, .. }) => tracing::info!(machine = %key(sbm), object, "{log}"),
        None => {}
    }
    Ok(Done::Yes)
}

/// `patch` written to `object` as `guard` says: `None` if someone else wrote first.
async fn guarded<K>(
    api: &Api<K>,
    object: &K,
    patch: serde_json::Value,
    guard: Guard,
) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let (name, params) = (object.name_any(), PatchParams::default());
    match guard {
        Guard::Unchanged | Guard::BothUnchanged => patch_unchanged(api, object, patch).await,
        Guard::Plain => api.patch(&name, &params, &Patch::Merge(&patch)).await.map(Some),
        Guard::SetOnce => match api.patch(&name, &params, &Patch::Merge(&patch)).await {
            Ok(written) => Ok(Some(written)),
            Err(kube::Error::Api(e)) if e.code == 422 => Ok(None),
            Err(e) => Err(e),
        },
    }
}
