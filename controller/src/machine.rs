//! The SitebootMachine reconciler: the Cluster API InfraMachine contract (v1beta2).
//!
//! One pass reads the SitebootMachine, its Machine, its Cluster and its Host, and takes the
//! first step that is not done yet:
//!
//! 1. finalizer; paused (Cluster or annotation): report Paused and stop
//! 2. wait for the Cluster's infrastructure and for `Machine.spec.bootstrap.dataSecretName`
//! 3. bind a Host: adopt one already claimed for this SitebootMachine (a crash between the claim
//!    and the next write), or claim an Available one by compare-and-swap on its
//!    `spec.consumerRef`, then record it in `spec.hostRef`
//! 4. ask the Host for the image and the bootstrap data (`Host.spec.provisioning`)
//! 5. once the Host is Provisioned: `spec.providerID`, `status.addresses`,
//!    `status.initialization.provisioned`, Ready
//!
//! On delete: let go of `Host.spec.provisioning` (the Host wipes itself), wait until it is
//! Available again, clear its `consumerRef` (release), then drop the finalizer.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use serde_json::json;

use crate::context::{Ctx, Error};
use crate::crd::capi::{CLUSTER_NAME_LABEL, Cluster, Machine, PAUSED_ANNOTATION};
use crate::crd::{
    ConsumerRef, Host, HostRef, HostState, Initialization, MachineAddress, Provisioning,
    SITE_LABEL, SecretRef, SitebootMachine, SitebootMachineStatus, condition, set_condition,
};
use crate::selection;

pub const FINALIZER: &str = "sitebootmachine.infrastructure.cluster.x-k8s.io";
const API_VERSION: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";

/// How often a machine waiting for a host looks again (Host changes also wake it at once).
const NO_HOST_RETRY: Duration = Duration::from_secs(60);

pub async fn run(ctx: Arc<Ctx>, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let client = ctx.client.clone();
    let controller =
        Controller::new(Api::<SitebootMachine>::all(client.clone()), watcher::Config::default());
    let store = controller.store();
    let by_host = store.clone();
    let by_cluster = store.clone();
    controller
        .watches(
            Api::<Host>::all(client.clone()),
            watcher::Config::default().labels(&format!("{SITE_LABEL}={}", ctx.site)),
            move |host| machines_for_host(&host, &by_host),
        )
        .watches(Api::<Machine>::all(client.clone()), watcher::Config::default(), |machine| {
            let namespace = machine.namespace().unwrap_or_default();
            machine
                .spec
                .infrastructure_ref
                .filter(|r| r.kind == "SitebootMachine")
                .map(|r| ObjectRef::new(&r.name).within(&namespace))
        })
        .watches(Api::<Cluster>::all(client), watcher::Config::default(), move |cluster| {
            let (name, namespace) = (cluster.name_any(), cluster.namespace().unwrap_or_default());
            by_cluster
                .state()
                .into_iter()
                .filter(|m| {
                    m.namespace().as_deref() == Some(namespace.as_str())
                        && m.labels().get(CLUSTER_NAME_LABEL) == Some(&name)
                })
                .map(|m| ObjectRef::from_obj(&*m))
                .collect::<Vec<_>>()
        })
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "SitebootMachine reconcile error");
            }
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

fn error_policy(sbm: Arc<SitebootMachine>, error: &Error, _: Arc<Ctx>) -> Action {
    tracing::warn!(machine = %key(&sbm), error = %error, "SitebootMachine reconcile failed; retrying");
    Action::requeue(Duration::from_secs(5))
}

fn key(sbm: &SitebootMachine) -> String {
    format!("{}/{}", sbm.namespace().unwrap_or_default(), sbm.name_any())
}

/// The Machine that owns this SitebootMachine.
fn owner_machine(sbm: &SitebootMachine) -> Option<String> {
    sbm.owner_references()
        .iter()
        .find(|o| o.kind == "Machine" && o.api_version.starts_with("cluster.x-k8s.io/"))
        .map(|o| o.name.clone())
}

/// The status being built in one pass, written once at the end if it changed.
struct Report {
    status: SitebootMachineStatus,
    generation: Option<i64>,
}

impl Report {
    fn ready(&mut self, ready: bool, reason: &str, message: &str) {
        set_condition(
            &mut self.status.conditions,
            "Ready",
            ready,
            reason,
            message,
            self.generation,
        );
    }

    fn paused(&mut self, paused: bool, message: &str) {
        let reason = if paused { "Paused" } else { "NotPaused" };
        set_condition(
            &mut self.status.conditions,
            "Paused",
            paused,
            reason,
            message,
            self.generation,
        );
    }
}

async fn reconcile(sbm: Arc<SitebootMachine>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let namespace = sbm.namespace().unwrap_or_default();
    let api: Api<SitebootMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let mut report = Report {
        status: sbm.status.clone().unwrap_or_default(),
        generation: sbm.metadata.generation,
    };
    let action = step(&sbm, &ctx, &api, &mut report).await?;
    if sbm.status.as_ref() != Some(&report.status) && !gone(&api, &sbm).await? {
        let patch = json!({ "status": report.status });
        api.patch_status(&sbm.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    }
    Ok(action)
}

/// Whether the object was deleted during this pass (the last finalizer removed).
async fn gone(api: &Api<SitebootMachine>, sbm: &SitebootMachine) -> Result<bool, Error> {
    Ok(sbm.metadata.deletion_timestamp.is_some() && api.get_opt(&sbm.name_any()).await?.is_none())
}

async fn step(
    sbm: &SitebootMachine,
    ctx: &Ctx,
    api: &Api<SitebootMachine>,
    report: &mut Report,
) -> Result<Action, Error> {
    let namespace = sbm.namespace().unwrap_or_default();
    let machine_name = owner_machine(sbm);
    let machine = match &machine_name {
        Some(name) => {
            Api::<Machine>::namespaced(ctx.client.clone(), &namespace).get_opt(name).await?
        }
        None => None,
    };
    let cluster_name = sbm.labels().get(CLUSTER_NAME_LABEL).cloned().or_else(|| {
        machine.as_ref().map(|m| m.spec.cluster_name.clone()).filter(|n| !n.is_empty())
    });
    let cluster = match &cluster_name {
        Some(name) => {
            Api::<Cluster>::namespaced(ctx.client.clone(), &namespace).get_opt(name).await?
        }
        None => None,
    };
    let paused = cluster.as_ref().is_some_and(Cluster::is_paused)
        || sbm.annotations().contains_key(PAUSED_ANNOTATION);
    if paused {
        report.paused(true, "the Cluster or this object is paused: no changes are made");
        return Ok(Action::await_change());
    }
    report.paused(false, "");

    if sbm.metadata.deletion_timestamp.is_some() {
        return delete(sbm, ctx, api, report).await;
    }
    if !sbm.finalizers().iter().any(|f| f == FINALIZER) {
        let mut finalizers = sbm.finalizers().to_vec();
        finalizers.push(FINALIZER.to_owned());
        let patch = json!({ "metadata": { "finalizers": finalizers, "resourceVersion": sbm.resource_version() } });
        api.patch(&sbm.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
        return Ok(Action::requeue(Duration::ZERO));
    }
    let Some(machine) = machine else {
        report.ready(false, "WaitingForMachine", "no owner Machine yet (Cluster API sets it)");
        return Ok(Action::await_change());
    };
    let Some(cluster) = cluster else {
        report.ready(false, "WaitingForCluster", "the Machine's Cluster does not exist");
        return Ok(Action::await_change());
    };
    if !cluster.infrastructure_provisioned() {
        report.ready(
            false,
            "WaitingForClusterInfrastructure",
            "the Cluster's infrastructure is not provisioned yet",
        );
        return Ok(Action::await_change());
    }
    let Some(secret_name) = machine.spec.bootstrap.data_secret_name.clone() else {
        report.ready(
            false,
            "WaitingForBootstrapData",
            "Machine.spec.bootstrap.dataSecretName is not set yet",
        );
        return Ok(Action::await_change());
    };

    let host = match bound_host(sbm, ctx).await? {
        Bound::Host(host) => {
            release_orphans(sbm, ctx, Some(&host.name_any())).await?;
            *host
        }
        Bound::Missing(r) => {
            report.ready(
                false,
                "HostMissing",
                &format!("Host {}/{} no longer exists", r.namespace, r.name),
            );
            return Ok(Action::requeue(NO_HOST_RETRY));
        }
        Bound::Unbound => return bind(sbm, &machine, ctx, api, report).await,
    };

    let desired = Provisioning {
        image: sbm.spec.image.clone(),
        bootstrap_data_secret: SecretRef { namespace: namespace.clone(), name: secret_name },
    };
    if host.spec.provisioning.as_ref() != Some(&desired) {
        let patch = json!({ "metadata": { "resourceVersion": host.resource_version() }, "spec": { "provisioning": desired } });
        ctx.hosts_api(&host.namespace().unwrap_or_default())
            .patch(&host.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        report.ready(false, "Provisioning", "asked the Host to install the image");
        return Ok(Action::requeue(Duration::from_secs(30)));
    }

    let host_status = host.status.clone().unwrap_or_default();
    report.status.failure_domain = host.labels().get(SITE_LABEL).cloned();
    match host_status.state {
        Some(HostState::Provisioned)
            if host_status.installed.as_ref().is_some_and(|i| i.image == desired.image) =>
        {
            let provider_id =
                format!("siteboot://{}/{}", host.namespace().unwrap_or_default(), host.name_any());
            if sbm.spec.provider_id.as_deref() != Some(provider_id.as_str()) {
                let patch = json!({ "spec": { "providerID": provider_id } });
                api.patch(&sbm.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
            }
            let mut addresses = host_status.addresses.clone();
            addresses.push(MachineAddress { kind: "Hostname".into(), address: host.name_any() });
            report.status.addresses = addresses;
            report.status.initialization = Some(Initialization { provisioned: Some(true) });
            report.ready(true, "Provisioned", &format!("running on Host {}", host.name_any()));
            Ok(Action::requeue(Duration::from_secs(600)))
        }
        Some(HostState::Quarantined) => {
            let why = host_status.quarantine_reason.unwrap_or_default();
            report.ready(
                false,
                "HostQuarantined",
                &format!("Host {} is quarantined: {why}", host.name_any()),
            );
            Ok(Action::requeue(Duration::from_secs(60)))
        }
        state => {
            let step = host_status
                .operation
                .and_then(|o| o.step)
                .map(|s| format!(" ({s})"))
                .unwrap_or_default();
            report.ready(
                false,
                "Provisioning",
                &format!("Host {} is {state:?}{step}", host.name_any()),
            );
            Ok(Action::requeue(Duration::from_secs(30)))
        }
    }
}

enum Bound {
    Host(Box<Host>),
    Missing(HostRef),
    Unbound,
}

/// The Host in `spec.hostRef`, if it still names this machine as its consumer.
async fn bound_host(sbm: &SitebootMachine, ctx: &Ctx) -> Result<Bound, Error> {
    let Some(r) = &sbm.spec.host_ref else { return Ok(Bound::Unbound) };
    match ctx.hosts_api(&r.namespace).get_opt(&r.name).await? {
        Some(host) if consumed_by(&host, sbm) => Ok(Bound::Host(Box::new(host))),
        _ => Ok(Bound::Missing(r.clone())),
    }
}

fn consumed_by(host: &Host, sbm: &SitebootMachine) -> bool {
    host.spec
        .consumer_ref
        .as_ref()
        .is_some_and(|c| c.kind == "SitebootMachine" && Some(&c.uid) == sbm.uid().as_ref())
}

fn host_namespace(sbm: &SitebootMachine) -> String {
    sbm.spec
        .host_selector
        .as_ref()
        .and_then(|s| s.namespace.clone())
        .unwrap_or_else(|| sbm.namespace().unwrap_or_default())
}

/// A Host already claimed for this machine (the claim happened, the hostRef write did not).
fn already_claimed(sbm: &SitebootMachine, hosts: &[Host]) -> Option<Host> {
    hosts.iter().find(|h| consumed_by(h, sbm)).cloned()
}

/// Binding a machine to a host takes two writes (the Host's consumerRef, then the machine's
/// hostRef), so two appliances binding one machine at once could each claim a host for it.
/// First, one appliance takes the machine with a compare-and-swap on its resourceVersion: it
/// writes `<identity>@<unix seconds>` here, and only it binds the machine. A binder that dies
/// loses the machine after [`BINDER_TIMEOUT`]; whoever takes over adopts a claim it left.
pub const BINDER_ANNOTATION: &str = "siteboot.dev/binder";
const BINDER_TIMEOUT: u64 = 60;

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Who is binding `sbm`, if the mark is fresh.
fn binder(sbm: &SitebootMachine) -> Option<String> {
    let value = sbm.annotations().get(BINDER_ANNOTATION)?;
    let (who, at) = value.rsplit_once('@')?;
    let at: u64 = at.parse().ok()?;
    (unix_now().saturating_sub(at) < BINDER_TIMEOUT).then(|| who.to_owned())
}

async fn bind(
    sbm: &SitebootMachine,
    machine: &Machine,
    ctx: &Ctx,
    api: &Api<SitebootMachine>,
    report: &mut Report,
) -> Result<Action, Error> {
    // A machine pinned to another site is that site's appliance's business.
    let failure_domain = machine.spec.failure_domain.clone().filter(|f| !f.is_empty());
    if failure_domain.as_deref().is_some_and(|fd| fd != ctx.site) {
        return Ok(Action::await_change());
    }
    let binder = binder(sbm);
    if binder.as_deref().is_some_and(|b| b != ctx.identity) {
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    let namespace = host_namespace(sbm);
    let hosts_api = ctx.hosts_api(&namespace);
    let site = format!("{SITE_LABEL}={}", ctx.site);
    let hosts = hosts_api.list(&ListParams::default().labels(&site)).await?.items;
    let adopt = already_claimed(sbm, &hosts);
    let seed = sbm
        .uid()
        .map(|u| u.bytes().fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(b))))
        .unwrap_or(0);
    let candidates =
        selection::candidates(&hosts, sbm.spec.host_selector.as_ref(), Some(&ctx.site), seed);
    if adopt.is_none() && candidates.is_empty() {
        let why = selection::explain(&hosts, sbm.spec.host_selector.as_ref(), Some(&ctx.site));
        let message = format!("no Available Host in site {} matches ({why})", ctx.site);
        if condition(&report.status.conditions, "Ready")
            .is_none_or(|c| c.reason != "NoHostAvailable")
        {
            tracing::info!(machine = %key(sbm), "{message}");
        }
        report.ready(false, "NoHostAvailable", &message);
        return Ok(Action::requeue(NO_HOST_RETRY));
    }
    if binder.is_none() {
        let mark = format!("{}@{}", ctx.identity, unix_now());
        let patch = json!({ "metadata": { "resourceVersion": sbm.resource_version(), "annotations": { BINDER_ANNOTATION: mark } } });
        match api.patch(&sbm.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await {
            Ok(_) | Err(kube::Error::Api(_)) => return Ok(Action::requeue(Duration::ZERO)),
            Err(e) => return Err(e.into()),
        }
    }
    // This appliance binds the machine.
    if let Some(host) = adopt {
        tracing::info!(machine = %key(sbm), host = %host.name_any(), "adopting a claim made before a restart");
        record_host_ref(sbm, api, ctx, &host).await?;
        return Ok(Action::requeue(Duration::ZERO));
    }
    for host in candidates {
        let consumer = ConsumerRef {
            api_version: API_VERSION.into(),
            kind: "SitebootMachine".into(),
            namespace: sbm.namespace().unwrap_or_default(),
            name: sbm.name_any(),
            uid: sbm.uid().unwrap_or_default(),
        };
        // The claim: accepted only if the Host is unchanged since it was listed.
        let patch = json!({ "metadata": { "resourceVersion": host.resource_version() }, "spec": { "consumerRef": consumer } });
        match hosts_api
            .patch(&host.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(claimed) => {
                tracing::info!(machine = %key(sbm), host = %claimed.name_any(), "claimed a Host");
                ctx.event(
                    &claimed,
                    false,
                    "Claimed",
                    format!("claimed by SitebootMachine {}", key(sbm)),
                )
                .await;
                record_host_ref(sbm, api, ctx, &claimed).await?;
                report.ready(
                    false,
                    "Provisioning",
                    &format!("claimed Host {}", claimed.name_any()),
                );
                return Ok(Action::requeue(Duration::ZERO));
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                tracing::debug!(machine = %key(sbm), host = %host.name_any(), "lost the race for a Host; trying the next");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Action::requeue(Duration::from_secs(1)))
}

/// Records `host` in `spec.hostRef` and drops the binder mark. Should the machine already have
/// another host (a binder that lost the machine by timing out), the CEL rule refuses the change
/// and this claim is given back.
async fn record_host_ref(
    sbm: &SitebootMachine,
    api: &Api<SitebootMachine>,
    ctx: &Ctx,
    host: &Host,
) -> Result<(), Error> {
    let host_ref =
        HostRef { namespace: host.namespace().unwrap_or_default(), name: host.name_any() };
    let patch = json!({ "metadata": { "annotations": { BINDER_ANNOTATION: null } }, "spec": { "hostRef": host_ref } });
    match api.patch(&sbm.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 422 => {
            let why = format!("SitebootMachine {} was bound to another host", key(sbm));
            release(ctx, host, &why).await.map(drop)
        }
        Err(e) => Err(e.into()),
    }
}

/// Clears `host`'s claim if it is unchanged since read. `Ok(false)`: it changed; the next pass
/// looks again.
async fn release(ctx: &Ctx, host: &Host, why: &str) -> Result<bool, Error> {
    let patch = json!({ "metadata": { "resourceVersion": host.resource_version() }, "spec": { "consumerRef": null } });
    match ctx
        .hosts_api(&host.namespace().unwrap_or_default())
        .patch(&host.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(released) => {
            tracing::info!(host = %released.name_any(), "released the Host: {why}");
            ctx.event(&released, false, "Released", why.to_owned()).await;
            Ok(true)
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Hosts claimed for this machine other than `bound` (a claim whose hostRef write lost to
/// another appliance's, or a crash in between): released while they hold nothing of it.
async fn release_orphans(
    sbm: &SitebootMachine,
    ctx: &Ctx,
    bound: Option<&str>,
) -> Result<(), Error> {
    for host in ctx.hosts.all() {
        if consumed_by(&host, sbm)
            && Some(host.name_any().as_str()) != bound
            && host.spec.provisioning.is_none()
        {
            release(
                ctx,
                &host,
                &format!("a claim by SitebootMachine {} it does not use", key(sbm)),
            )
            .await?;
        }
    }
    Ok(())
}

async fn delete(
    sbm: &SitebootMachine,
    ctx: &Ctx,
    api: &Api<SitebootMachine>,
    report: &mut Report,
) -> Result<Action, Error> {
    if !sbm.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    let namespace = host_namespace(sbm);
    let hosts_api = ctx.hosts_api(&namespace);
    let host = match bound_host(sbm, ctx).await? {
        Bound::Host(h) => Some(*h),
        // Claimed but not yet recorded: find it by its consumerRef.
        Bound::Unbound => {
            let site = format!("{SITE_LABEL}={}", ctx.site);
            already_claimed(sbm, &hosts_api.list(&ListParams::default().labels(&site)).await?.items)
        }
        Bound::Missing(_) => None,
    };
    if let Some(host) = host {
        let state = host.status.as_ref().and_then(|s| s.state);
        if host.spec.provisioning.is_some() {
            let patch = json!({ "metadata": { "resourceVersion": host.resource_version() }, "spec": { "provisioning": null } });
            hosts_api
                .patch(&host.name_any(), &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            report.ready(
                false,
                "Deprovisioning",
                &format!("Host {} is being wiped", host.name_any()),
            );
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
        if !matches!(
            state,
            Some(
                HostState::Available
                    | HostState::Quarantined
                    | HostState::Registering
                    | HostState::Inspecting
            )
        ) {
            report.ready(
                false,
                "Deprovisioning",
                &format!("waiting for Host {} to be wiped (now {state:?})", host.name_any()),
            );
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
        if !release(ctx, &host, &format!("released by SitebootMachine {}", key(sbm))).await? {
            return Ok(Action::requeue(Duration::from_secs(1)));
        }
    }
    release_orphans(sbm, ctx, None).await?;
    let finalizers: Vec<String> =
        sbm.finalizers().iter().filter(|f| *f != FINALIZER).cloned().collect();
    let patch = json!({ "metadata": { "finalizers": finalizers, "resourceVersion": sbm.resource_version() } });
    api.patch(&sbm.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(Action::await_change())
}
