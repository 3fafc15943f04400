//! What a planned [`Step`] writes, as data: which object, the merge patch, how the write is
//! guarded against a writer that came first, and what is said once it succeeded. The plan's
//! unit tests assert these; the reconciler's one `apply` performs them.

use k8s_openapi::api::core::v1::Node;
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};

use super::plan::{BINDER_ANNOTATION, FINALIZER, Step, consumed_by};
pub use crate::context::{Level, Note};
use crate::context::{finalizer_patch, key};
use crate::crd::{ConsumerRef, Host, HostRef, SitebootMachine};

/// One merge patch of one object.
#[derive(Debug, Clone, PartialEq)]
pub struct Write<'a> {
    pub target: Target<'a>,
    pub patch: Value,
    pub guard: Guard,
    pub note: Option<Note>,
}

/// The object a [`Write`] patches, as it was read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target<'a> {
    /// The SitebootMachine being reconciled.
    Machine,
    Host(&'a Host),
    /// A Node of the workload cluster.
    Node(&'a Node),
}

/// What a [`Write`] does if someone else wrote first. Whatever it is, the pass then writes
/// nothing more (its status was planned from a stale read) and looks again soon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    /// Written only if the target is unchanged since it was read (its resourceVersion goes with
    /// the patch: `patch_unchanged`).
    Unchanged,
    /// [`Guard::Unchanged`], and only if the machine is unchanged too (read again first): the
    /// machine and the Hosts come from different watches, so a claim made moments ago for this
    /// machine looks unused to a copy of it that predates its mark or its hostRef.
    BothUnchanged,
    /// A field the API server keeps once set (a CEL rule): a refusal (422) means another pass
    /// set it first.
    SetOnce,
    /// Written whatever changed since the read.
    Plain,
}

impl<'a> Step<'a> {
    /// The write this step is, for `sbm` (the machine it was planned for); `None` for a step
    /// that is not one merge patch (nothing, or the bootstrap data handed to the boot plane).
    pub fn write(&self, sbm: &SitebootMachine) -> Option<Write<'a>> {
        let (target, patch, guard, note) = match self {
            Step::None | Step::StageBootstrapData { .. } | Step::UnstageBootstrapData => {
                return None;
            }
            Step::AddFinalizer => {
                (Target::Machine, finalizer_patch(sbm, FINALIZER, true), Guard::Unchanged, None)
            }
            Step::RemoveFinalizer => {
                (Target::Machine, finalizer_patch(sbm, FINALIZER, false), Guard::Unchanged, None)
            }
            Step::Mark(mark) => {
                let patch = json!({ "metadata": { "annotations": { BINDER_ANNOTATION: mark.to_string() } } });
                (Target::Machine, patch, Guard::Unchanged, None)
            }
            Step::Claim(host) => {
                let note = Note::info("claimed a Host")
                    .event("Claimed", format!("claimed by SitebootMachine {}", key(sbm)));
                (Target::Host(host), consume(sbm), Guard::Unchanged, Some(note))
            }
            Step::Adopt(host) => {
                let message = format!(
                    "claim taken over by SitebootMachine {} after a move or restore",
                    key(sbm)
                );
                let note =
                    Note::info("took over the claim of a moved Host").event("Adopted", message);
                (Target::Host(host), consume(sbm), Guard::Unchanged, Some(note))
            }
            Step::RecordHostRef(host) => {
                let host_ref = HostRef {
                    namespace: host.namespace().unwrap_or_default(),
                    name: host.name_any(),
                };
                let patch = json!({
                    "metadata": { "annotations": { BINDER_ANNOTATION: null } },
                    "spec": { "hostRef": host_ref },
                });
                // The CEL rule keeps hostRef once set: refused, this machine was bound elsewhere
                // (a binder that timed out). The next pass gives this claim back as an orphan.
                (Target::Machine, patch, Guard::SetOnce, None)
            }
            Step::ForgetHostRef => {
                let host =
                    sbm.spec.host_ref.as_ref().map(|r| format!("{}/{}", r.namespace, r.name));
                let log = format!(
                    "the Host {} no longer names this machine; binding it again",
                    host.unwrap_or_default()
                );
                let note = Note::warning(log);
                (
                    Target::Machine,
                    json!({ "spec": { "hostRef": null } }),
                    Guard::Unchanged,
                    Some(note),
                )
            }
            Step::Release { host, why } => {
                // Only a claim for this machine is released; provisioning goes with it, and the
                // Host lifecycle wipes whatever may have been written.
                debug_assert!(consumed_by(host, sbm));
                let patch = json!({ "spec": { "consumerRef": null, "provisioning": null } });
                let note =
                    Note::info(format!("released the Host: {why}")).event("Released", why.clone());
                (Target::Host(host), patch, Guard::BothUnchanged, Some(note))
            }
            Step::RequestProvisioning { host, provisioning } => {
                let patch = json!({ "spec": { "provisioning": provisioning } });
                (Target::Host(host), patch, Guard::Unchanged, None)
            }
            Step::CancelProvisioning(host) => {
                let patch = json!({ "spec": { "provisioning": null } });
                (Target::Host(host), patch, Guard::Unchanged, None)
            }
            Step::SetProviderId(provider_id) => {
                let patch = json!({ "spec": { "providerID": provider_id } });
                (Target::Machine, patch, Guard::Plain, None)
            }
            Step::SetNodeProviderId { node, provider_id } => {
                let patch = json!({ "spec": { "providerID": provider_id } });
                let note = Note::info(format!(
                    "set the providerID of the machine's Node (found by its system UUID): {provider_id}"
                ));
                (Target::Node(node), patch, Guard::Unchanged, Some(note))
            }
        };
        Some(Write { target, patch, guard, note })
    }
}

/// The patch that makes `sbm` a Host's consumer.
fn consume(sbm: &SitebootMachine) -> Value {
    let consumer = ConsumerRef {
        api_version: SitebootMachine::api_version(&()).into_owned(),
        kind: "SitebootMachine".into(),
        namespace: sbm.namespace().unwrap_or_default(),
        name: sbm.name_any(),
        uid: sbm.uid().unwrap_or_default(),
    };
    json!({ "spec": { "consumerRef": consumer } })
}
