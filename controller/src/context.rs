//! What the reconcilers and the boot-plane inventory share, and the one way Host status is
//! written: read the Host, compute, write with its resourceVersion, retry on conflict.

use std::sync::Arc;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use siteboot_boot::inventory::LinuxBoot;

use crate::cache::HostIndex;
use crate::crd::{Host, HostStatus};
use crate::machine::plan::Policy as MachinePolicy;

/// How long a ramdisk token stays valid after it is issued, unless configured
/// (`kubernetes.token_max_age`).
pub const TOKEN_MAX_AGE: Duration = Duration::from_secs(2 * 3600);

pub struct Ctx {
    pub client: Client,
    /// The site this appliance serves: Hosts labelled `siteboot.dev/site=<site>`.
    pub site: String,
    /// This appliance, for leases, events and the Site status.
    pub identity: String,
    pub hosts: Arc<HostIndex>,
    /// The deploy ramdisk's kernel, initrds and command line.
    pub ramdisk: LinuxBoot,
    /// How long a ramdisk token stays valid after it is issued.
    pub token_max_age: Duration,
    /// What the SitebootMachine reconciler may do (its site, identity, host namespaces).
    pub machine_policy: MachinePolicy,
    pub backoff: Backoff,
    pub recorder: Recorder,
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
                host_namespaces: Vec::new(),
            },
            site,
            identity,
            hosts,
            ramdisk,
            token_max_age: TOKEN_MAX_AGE,
            backoff: Backoff::default(),
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
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// How a reconciler treats an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Conflict, throttling, timeout, a 5xx or a broken connection: retry soon, backing off.
    Transient,
    /// The API server refused the request (403, 422, 400 ...): retrying at once would loop on
    /// the same answer; say so on the object and look again slowly.
    Refused,
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Kube(kube::Error::Api(e)) if e.code == 409 || e.code == 429 || e.code >= 500 => {
                ErrorKind::Transient
            }
            Error::Kube(kube::Error::Api(_)) => ErrorKind::Refused,
            Error::Kube(_) => ErrorKind::Transient,
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

/// A merge patch that the API server accepts only if `object` is unchanged since it was read
/// (its resourceVersion is part of the patch). `Ok(None)`: it changed; look again.
pub async fn patch_unchanged<K>(
    api: &Api<K>,
    object: &K,
    mut patch: serde_json::Value,
) -> Result<Option<K>, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    patch["metadata"]["resourceVersion"] = object.meta().resource_version.clone().into();
    let name = object.meta().name.clone().unwrap_or_default();
    match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(written) => Ok(Some(written)),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
        Err(e) => Err(e),
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
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

pub fn host_key(host: &Host) -> String {
    format!("{}/{}", host.namespace().unwrap_or_default(), host.name_any())
}
