//! What the reconcilers and the boot-plane inventory share, and the one way Host status is
//! written: read the Host, compute, write with its resourceVersion, retry on conflict.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use siteboot_agent_server::silence::{RAMDISK_SILENCE_TIMEOUT, TOKEN_MAX_AGE};
use siteboot_boot::inventory::LinuxBoot;
use siteboot_ssh::reimage::{KexecRamdisk, RamdiskFilesError};

use crate::cache::HostIndex;
use crate::conditions::{READY, Reason};
use crate::crd::{Conditions, Host, HostStatus, WipePolicy, set_condition};
use crate::machine::plan::Policy as MachinePolicy;
use crate::throttle::Throttle;

/// The appliance's namespace unless configured (`kubernetes.lease_namespace`).
pub const DEFAULT_NAMESPACE: &str = "siteboot-system";

pub struct Ctx {
    pub client: Client,
    /// The site this appliance serves: Hosts labelled `siteboot.dev/site=<site>`.
    pub site: String,
    /// This appliance, for leases, events and the Site status.
    pub identity: String,
    /// The appliance's own namespace (`kubernetes.lease_namespace`): its leader Leases, the
    /// DHCP checkpoint and the bootstrap data handed to the boot plane ([`crate::handoff`]).
    pub namespace: String,
    pub hosts: Arc<HostIndex>,
    /// The deploy ramdisk's kernel, initrds and command line.
    pub ramdisk: LinuxBoot,
    /// How long a ramdisk token stays valid after it is issued.
    pub token_max_age: Duration,
    /// How long a booted ramdisk may stay silent before its host is quarantined.
    pub ramdisk_silence_timeout: Duration,
    /// The least wipe a used host gets before anyone else may have it
    /// (`kubernetes.min_wipe`); a tenant or a Host may ask for more, never less.
    pub min_wipe: WipePolicy,
    /// What the SitebootMachine reconciler may do (its site, identity, host namespaces).
    pub machine_policy: MachinePolicy,
    pub backoff: Backoff,
    pub recorder: Recorder,
    /// Bounds the Events that machines on the segment can cause ([`Ctx::segment_warning`]).
    pub segment_events: Mutex<Throttle>,
    /// The appliance's image cache, which the ramdisk downloads images from. `None`: the
    /// ramdisk fetches each image from its source itself.
    pub images: Option<Arc<siteboot_agent_server::images::ImageService>>,
    /// The workload clusters' clients, kept between passes.
    pub workloads: crate::workload::Workloads,
    /// Where a BMC fetches a host's virtual media (`https://<address>:<https_port>`, the agent
    /// API's listener, which serves `/media/<key>.iso`); `None`: this appliance serves no
    /// media (`kubernetes.ramdisk_media` unset).
    pub media_base: Option<String>,
    /// The certificate (PEM) served at `media_base`: a BMC that can check its image server's
    /// certificate is told to trust exactly this one.
    pub media_certificate: Option<String>,
    /// The deploy ramdisk a Reimage host reached over SSH is kexec'ed into, or why there is
    /// none (said on the Host when it is needed).
    pub kexec_ramdisk: Result<KexecRamdisk, RamdiskFilesError>,
}

impl Ctx {
    pub fn new(
        client: Client,
        site: String,
        identity: String,
        hosts: Arc<HostIndex>,
        ramdisk: LinuxBoot,
    ) -> Self {
        let reporter = Reporter { controller: "siteboot".into(), instance: Some(identity.clone()) };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            machine_policy: MachinePolicy {
                site: site.clone(),
                identity: identity.clone(),
                host_pools: hosts.pools().clone(),
            },
            site,
            identity,
            namespace: DEFAULT_NAMESPACE.to_owned(),
            hosts,
            ramdisk,
            token_max_age: TOKEN_MAX_AGE,
            ramdisk_silence_timeout: RAMDISK_SILENCE_TIMEOUT,
            min_wipe: WipePolicy::Quick,
            backoff: Backoff::default(),
            segment_events: Mutex::default(),
            images: None,
            workloads: Default::default(),
            media_base: None,
            media_certificate: None,
            kexec_ramdisk: Err(RamdiskFilesError::NotConfigured),
        }
    }

    pub fn hosts_api(&self, namespace: &str) -> Api<Host> {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// Publishes an Event about `object`; a failure to record is logged, not fatal.
    pub async fn event<K: Resource<DynamicType = ()>>(
        &self,
        object: &K,
        warning: bool,
        reason: &str,
        note: String,
    ) {
        let event = Event {
            type_: if warning { EventType::Warning } else { EventType::Normal },
            reason: reason.to_owned(),
            note: Some(note),
            action: reason.to_owned(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &object.object_ref(&())).await {
            tracing::warn!(object = %object.meta().name.as_deref().unwrap_or(""), error = %e, "cannot record an Event");
        }
    }

    /// Logs and publishes a Warning Event about `host` for something any machine on the
    /// provisioning segment can cause (one per request it sends), through [`Throttle`]: at most
    /// one per Host and reason a minute, the next one counting those left out.
    pub async fn segment_warning(&self, host: &Host, reason: &'static str, note: String) {
        let key = key(host);
        let admitted = self.segment_events.lock().expect("event throttle lock").admit(
            &key,
            reason,
            Instant::now(),
        );
        let Some(left_out) = admitted else { return };
        let note = match left_out {
            0 => note,
            n => format!("{note} ({n} more since the last such Event, not recorded one by one)"),
        };
        tracing::warn!(host = %key, reason, "{note}");
        self.event(host, true, reason, note).await;
    }

    /// Runs `controller` until `shutdown`, each object through `pass`. A success forgets the
    /// object's backoff; an error is retried after [`Backoff::retry_after`], and a refusal is
    /// also reported on the object ([`Reconciled::report_refused`]).
    pub async fn drive<K, F>(
        self: Arc<Self>,
        controller: Controller<K>,
        shutdown: impl Future<Output = ()> + Send + Sync + 'static,
        pass: impl Fn(Arc<K>, Arc<Ctx>) -> F,
    ) where
        K: Reconciled,
        F: Future<Output = Result<Action, Error>> + Send + 'static,
    {
        let reconcile = move |object: Arc<K>, ctx: Arc<Ctx>| {
            let result = pass(object.clone(), ctx.clone());
            async move {
                let result = result.await;
                match &result {
                    Ok(_) => ctx.backoff.succeeded(&object.key()),
                    Err(e) if e.kind() == ErrorKind::Refused => {
                        object.report_refused(&ctx, e).await
                    }
                    Err(_) => {}
                }
                result
            }
        };
        let error_policy = |object: Arc<K>, error: &Error, ctx: Arc<Ctx>| {
            let key = object.key();
            let retry = ctx.backoff.retry_after(&key, error);
            tracing::warn!(object = %key, error = %error, kind = ?error.kind(), ?retry, "reconcile failed");
            Action::requeue(retry)
        };
        controller
            .graceful_shutdown_on(shutdown)
            .run(reconcile, error_policy, self)
            .for_each(|result| async move {
                if let Err(e) = result {
                    tracing::debug!(kind = %K::kind(&()), error = %e, "reconcile error");
                }
            })
            .await;
    }
}

/// An object a reconciler of this crate watches.
pub trait Reconciled:
    Resource<DynamicType = ()>
    + Clone
    + serde::de::DeserializeOwned
    + std::fmt::Debug
    + Send
    + Sync
    + 'static
{
    /// `Kind namespace/name`: the reconcilers share one [`Backoff`], so keys name the kind.
    fn key(&self) -> String {
        format!("{} {}", Self::kind(&()), key(self))
    }

    /// Says on the object that the API server refused what its reconciler needed, so the
    /// operator sees it without reading logs: a Warning Event unless the kind says otherwise.
    fn report_refused(&self, ctx: &Ctx, error: &Error) -> impl Future<Output = ()> + Send {
        async move { ctx.event(self, true, &Reason::ApiRefused.to_string(), error.refusal()).await }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// A request to a workload cluster's API server (through its `<cluster>-kubeconfig`).
    #[error("workload cluster {cluster} API: {source}")]
    Workload { cluster: String, source: kube::Error },
}

/// [`Reconciled::report_refused`] for a kind whose Ready condition Cluster API shows on the
/// Machine: the refusal goes there, into `conditions` as `object` has them (best effort: this
/// write may be refused too).
pub async fn report_refused_in_ready<K>(
    ctx: &Ctx,
    object: &K,
    conditions: &Conditions,
    error: &Error,
) where
    K: Reconciled + Resource<Scope = NamespaceResourceScope>,
{
    let mut conditions = conditions.clone();
    let reason = Reason::ApiRefused.to_string();
    let generation = object.meta().generation;
    if set_condition(&mut conditions, READY, false, &reason, &error.refusal(), generation) {
        let api: Api<K> =
            Api::namespaced(ctx.client.clone(), &object.namespace().unwrap_or_default());
        let patch = serde_json::json!({ "status": { "conditions": conditions } });
        let params = PatchParams::default();
        if let Err(e) = api.patch_status(&object.name_any(), &params, &Patch::Merge(&patch)).await {
            tracing::debug!(object = %key(object), error = %e, "cannot report the refusal either");
        }
    }
}

/// How a reconciler treats an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Conflict, throttling, timeout, a 5xx or a broken connection, or an object that went
    /// between the read and the write (404, 410: the watch brings the change): retry soon,
    /// backing off.
    Transient,
    /// The API server refused the request (403, 422, 400 ...): retrying at once would loop on
    /// the same answer; say so on the object and look again slowly.
    Refused,
}

impl Error {
    /// What a refusal says on the object.
    pub fn refusal(&self) -> String {
        format!("the API server refused a request: {self}")
    }

    pub fn kind(&self) -> ErrorKind {
        let (Error::Kube(e) | Error::Workload { source: e, .. }) = self;
        match e {
            kube::Error::Api(e) if matches!(e.code, 404 | 409 | 410 | 429) || e.code >= 500 => {
                ErrorKind::Transient
            }
            kube::Error::Api(_) => ErrorKind::Refused,
            _ => ErrorKind::Transient,
        }
    }
}

/// How long a refused request waits before it is tried again.
pub const REFUSED_RETRY: Duration = Duration::from_secs(300);

/// Per-object retry delays: transient errors back off exponentially (1 s doubling to 5 min),
/// refused ones wait [`REFUSED_RETRY`]; a success forgets the object.
#[derive(Default)]
pub struct Backoff {
    failures: std::sync::Mutex<std::collections::HashMap<String, u32>>,
}

impl Backoff {
    pub fn retry_after(&self, key: &str, error: &Error) -> Duration {
        if error.kind() == ErrorKind::Refused {
            return REFUSED_RETRY;
        }
        let mut failures = self.failures.lock().expect("backoff lock");
        let n = failures.entry(key.to_owned()).or_default();
        *n = n.saturating_add(1);
        Duration::from_secs(1u64 << (*n - 1).min(8)).min(REFUSED_RETRY)
    }

    pub fn succeeded(&self, key: &str) {
        self.failures.lock().expect("backoff lock").remove(key);
    }
}

/// When a reconciler looks at an object again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeue {
    Now,
    After(Duration),
    /// Only when something watched changes.
    OnChange,
}

impl From<Requeue> for Action {
    fn from(requeue: Requeue) -> Self {
        match requeue {
            Requeue::Now => Action::requeue(Duration::ZERO),
            Requeue::After(d) => Action::requeue(d),
            Requeue::OnChange => Action::await_change(),
        }
    }
}

/// `object`'s owner reference to a Cluster API Machine.
pub fn owner_machine_ref<K: Resource>(object: &K) -> Option<&OwnerReference> {
    object
        .meta()
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.kind == "Machine" && o.api_version.starts_with("cluster.x-k8s.io/"))
}

/// Whether `object` was deleted during this pass (its last finalizer removed): then there is no
/// status left to write.
pub async fn gone<K>(api: &Api<K>, object: &K) -> Result<bool, Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(object.meta().deletion_timestamp.is_some()
        && api.get_opt(&object.name_any()).await?.is_none())
}

/// Writes `status` as `object`'s status unless it is `current` already, or the object went
/// during this pass (its last finalizer removed: nothing left to write to).
pub async fn write_status<K, S>(
    api: &Api<K>,
    object: &K,
    current: Option<&S>,
    status: &S,
) -> Result<(), Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    S: serde::Serialize + PartialEq,
{
    if current == Some(status) || gone(api, object).await? {
        return Ok(());
    }
    let patch = Patch::Merge(serde_json::json!({ "status": status }));
    api.patch_status(&name_of(object), &PatchParams::default(), &patch).await?;
    Ok(())
}

/// A merge patch that the API server accepts only if `object` is unchanged since it was read
/// (its resourceVersion is part of the patch). `Ok(None)`: it changed; look again.
pub async fn patch_unchanged<K>(
    api: &Api<K>,
    object: &K,
    patch: serde_json::Value,
) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    unchanged(api.patch(&name_of(object), &PatchParams::default(), &guarded(object, patch)).await)
}

/// [`patch_unchanged`] for the status subresource: writes `status` as the object's status.
pub async fn patch_status_unchanged<K, S>(
    api: &Api<K>,
    object: &K,
    status: &S,
) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    S: serde::Serialize,
{
    let patch = guarded(object, serde_json::json!({ "status": status }));
    unchanged(api.patch_status(&name_of(object), &PatchParams::default(), &patch).await)
}

fn name_of<K: Resource>(object: &K) -> String {
    object.meta().name.clone().unwrap_or_default()
}

/// `patch` as a merge patch carrying `object`'s resourceVersion.
fn guarded<K: Resource>(object: &K, mut patch: serde_json::Value) -> Patch<serde_json::Value> {
    patch["metadata"]["resourceVersion"] = object.meta().resource_version.clone().into();
    Patch::Merge(patch)
}

/// A compare-and-swap's answer: `None` when the object had changed (409).
fn unchanged<K>(written: Result<K, kube::Error>) -> Result<Option<K>, kube::Error> {
    match written {
        Ok(written) => Ok(Some(written)),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
        Err(e) => Err(e),
    }
}

/// Adds `finalizer` to `object` (`keep`) or removes it, with [`patch_unchanged`]: `Ok(None)`
/// if `object` changed since it was read.
pub async fn set_finalizer<K>(
    api: &Api<K>,
    object: &K,
    finalizer: &str,
    keep: bool,
) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    patch_unchanged(api, object, finalizer_patch(object, finalizer, keep)).await
}

/// The merge patch that adds `finalizer` to `object` (`keep`) or removes it: the whole list, as
/// it was read (the write must be guarded, as [`set_finalizer`] does).
pub fn finalizer_patch<K: Resource>(object: &K, finalizer: &str, keep: bool) -> serde_json::Value {
    let mut finalizers: Vec<&str> =
        object.finalizers().iter().map(String::as_str).filter(|f| *f != finalizer).collect();
    if keep {
        finalizers.push(finalizer);
    }
    serde_json::json!({ "metadata": { "finalizers": finalizers } })
}

/// Writes a new status for Host `namespace/name`: `change` sees the current Host and returns
/// the new status, or `Ok(None)` to write nothing, or an error to give up. Conflicts (someone
/// wrote in between) re-read and retry, so `change` always sees what it replaces.
pub async fn update_host_status<E>(
    api: &Api<Host>,
    name: &str,
    mut change: impl FnMut(&Host) -> Result<Option<HostStatus>, E>,
) -> Result<Result<Option<Host>, E>, kube::Error> {
    for _ in 0..5 {
        let mut host = api.get(name).await?;
        let status = match change(&host) {
            Ok(Some(status)) => status,
            Ok(None) => return Ok(Ok(None)),
            Err(e) => return Ok(Err(e)),
        };
        host.status = Some(status);
        match api.replace_status(name, &PostParams::default(), &host).await {
            Ok(written) => return Ok(Ok(Some(written))),
            Err(kube::Error::Api(e)) if e.code == 409 => {
                tracing::debug!(host = name, "Host changed while writing its status; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e),
        }
    }
    Err(kube::Error::Api(Box::new(
        kube::core::Status::failure(
            &format!("Host {name} kept changing while its status was written"),
            "Conflict",
        )
        .with_code(409),
    )))
}

/// What a reconciler says once a planned write landed (or a step that writes nothing ended): a
/// log line naming the object, and maybe an Event on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub level: Level,
    pub log: String,
    /// The Event's reason (CamelCase) and message: a Warning with [`Level::Warning`], else
    /// Normal.
    pub event: Option<(String, String)>,
}

/// How loud a [`Note`] is logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Routine upkeep, written every few minutes.
    Debug,
    Info,
    /// Something went wrong before this write.
    Warning,
}

impl Note {
    pub fn debug(log: impl Into<String>) -> Self {
        Note { level: Level::Debug, log: log.into(), event: None }
    }

    pub fn info(log: impl Into<String>) -> Self {
        Note { level: Level::Info, ..Note::debug(log) }
    }

    pub fn warning(log: impl Into<String>) -> Self {
        Note { level: Level::Warning, ..Note::debug(log) }
    }

    /// The same, with an Event.
    pub fn event(self, reason: impl std::fmt::Display, message: impl Into<String>) -> Self {
        Note { event: Some((reason.to_string(), message.into())), ..self }
    }

    pub fn is_warning(&self) -> bool {
        self.level == Level::Warning
    }
}

/// `namespace/name`: how logs, Events and conditions name an object.
pub fn key<K: ResourceExt>(object: &K) -> String {
    format!("{}/{}", object.namespace().unwrap_or_default(), object.name_any())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_retrying_cannot_change_is_a_refusal() {
        let api = |code: u16| {
            let status = kube::core::Status::failure("", "").with_code(code);
            Error::Kube(kube::Error::Api(Box::new(status)))
        };
        for code in [404, 409, 410, 429, 500, 503] {
            assert_eq!(api(code).kind(), ErrorKind::Transient, "{code}");
        }
        for code in [400, 401, 403, 422] {
            assert_eq!(api(code).kind(), ErrorKind::Refused, "{code}");
        }
        let backoff = Backoff::default();
        assert_eq!(backoff.retry_after("h", &api(404)), Duration::from_secs(1), "soon");
        assert_eq!(backoff.retry_after("h", &api(403)), REFUSED_RETRY);
    }
}
