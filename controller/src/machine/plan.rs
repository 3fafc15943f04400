//! What a SitebootMachine needs next, as a pure function of what was read: the SitebootMachine,
//! its Machine and Cluster, the Host it is bound to, and the Hosts of the site. [`plan`] returns
//! the one write to make (a [`Step`]), the status to report, and when to look again; the
//! reconciler performs it. Every rule of the InfraMachine contract is a match arm here, and what
//! each step writes (object, patch, guard) is data too ([`super::write`]), so the unit tests
//! below cover them in milliseconds, without Kubernetes.
//!
//! Binding a machine to a host takes three writes, each a compare-and-swap: the machine's
//! binder mark naming the host to claim ([`Mark`]), the Host's `spec.consumerRef`, then the
//! machine's `spec.hostRef` (which also drops the mark). A host is adopted after a crash only if
//! the machine's own mark names it and it still fits the machine: a Host that merely says it
//! belongs to a machine (anyone who may edit Hosts can write that) is never adopted; its claim
//! is given back.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;

use crate::conditions::{NODE_HAS_PROVIDER_ID, READY, Reason, check_paused};
use crate::crd::capi::{Cluster, DELETE_FOR_MOVE_ANNOTATION, Machine};
use crate::crd::{
    Host, HostRef, HostState, Initialization, MachineAddress, OperationKind, Provisioning,
    SITE_LABEL, SitebootMachine, SitebootMachineStatus, condition, set_condition,
};
use crate::handoff::Staged;
use crate::pools::HostPools;
use crate::selection;

pub const FINALIZER: &str = "sitebootmachine.infrastructure.cluster.x-k8s.io";
/// The binder mark (see [`Mark`]).
pub const BINDER_ANNOTATION: &str = "siteboot.dev/binder";
/// A binder that has not finished within this many seconds has died; another may take over.
pub const BINDER_TIMEOUT: u64 = 60;

/// How often a machine waiting for a host looks again (Host changes also wake it at once).
pub const NO_HOST_RETRY: Duration = Duration::from_secs(60);
/// How often a machine whose host is working looks again.
const PROGRESS_RETRY: Duration = Duration::from_secs(30);
const DEPROVISION_RETRY: Duration = Duration::from_secs(10);
const PROVISIONED_RETRY: Duration = Duration::from_secs(600);
/// How often a provisioned machine looks for its Node while it has none.
const NODE_RETRY: Duration = Duration::from_secs(15);

/// What this appliance may do, from its configuration.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The site this appliance serves.
    pub site: String,
    /// This appliance, as written in binder marks.
    pub identity: String,
    /// Namespaces besides the machine's own that `hostSelector.namespace` may name, and which
    /// machines' namespaces may name each.
    pub host_pools: HostPools,
}

/// What one pass read.
pub struct Observed<'a> {
    pub machine: &'a SitebootMachine,
    /// The Cluster API Machine that owns it.
    pub owner: Option<&'a Machine>,
    pub cluster: Option<&'a Cluster>,
    /// The Host that `spec.hostRef` names, if it exists.
    pub bound: Option<&'a Host>,
    /// The site's Hosts (candidates, and claims made for this machine), as cached.
    pub hosts: &'a [Arc<Host>],
    /// The workload cluster's Nodes, read once the bound host is Provisioned and while the
    /// Machine has no nodeRef (see [`wants_nodes`]); `Err` says why they could not be read.
    pub nodes: Option<Result<&'a [Node], String>>,
    /// What is staged of the machine's bootstrap data for the boot plane ([`crate::handoff`]).
    pub staged: Option<&'a Staged>,
    /// Seconds since the Unix epoch.
    pub now: u64,
}

impl<'a> Observed<'a> {
    fn hosts(&self) -> impl Iterator<Item = &'a Host> + use<'a> {
        self.hosts.iter().map(|h| &**h)
    }
}

/// The one write a pass makes (besides the status).
#[derive(Debug, Clone, PartialEq)]
pub enum Step<'a> {
    /// Nothing to write but the status.
    None,
    AddFinalizer,
    /// Take the machine for binding, naming the host this appliance will claim.
    Mark(Mark),
    /// Claim the host: write its `consumerRef`, if it is unchanged since read.
    Claim(&'a Host),
    /// Record the host claimed for this machine in `spec.hostRef`, dropping the mark.
    RecordHostRef(&'a Host),
    /// Take over the claim of a Host and machine that `clusterctl move` (or a restore) recreated
    /// with new uids: write this machine's uid into its `consumerRef`, if it is unchanged since
    /// read.
    Adopt(&'a Host),
    /// Clear `spec.hostRef`: the host it names no longer names this machine.
    ForgetHostRef,
    /// Give back a claim for this machine that it does not use.
    Release {
        host: &'a Host,
        why: String,
    },
    /// Ask the host to install the machine's image.
    RequestProvisioning {
        host: &'a Host,
        provisioning: Provisioning,
    },
    SetProviderId(String),
    /// Set `spec.providerID` on the machine's Node in the workload cluster (it had none).
    SetNodeProviderId {
        node: &'a Node,
        provider_id: String,
    },
    /// Let go of `spec.provisioning`: the host wipes itself.
    CancelProvisioning(&'a Host),
    /// Copy the Machine's bootstrap Secret (`secret`, in the machine's namespace) to the boot
    /// plane for the host's operation ([`crate::handoff`]).
    StageBootstrapData {
        secret: String,
        staged: Staged,
    },
    /// Delete what is staged for the boot plane: delivered, or no longer wanted.
    UnstageBootstrapData,
    RemoveFinalizer,
}

pub use crate::context::Requeue;
use crate::context::key;

#[derive(Debug, Clone, PartialEq)]
pub struct Plan<'a> {
    pub step: Step<'a>,
    pub status: SitebootMachineStatus,
    pub requeue: Requeue,
}

/// The binder mark: `<appliance>@<unix seconds> claims <namespace>/<host>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    pub binder: String,
    pub at: u64,
    pub host: HostRef,
}

impl Mark {
    pub fn parse(value: &str) -> Option<Mark> {
        let (who_at, host) = value.split_once(" claims ")?;
        let (binder, at) = who_at.rsplit_once('@')?;
        let (namespace, name) = host.split_once('/')?;
        Some(Mark {
            binder: binder.to_owned(),
            at: at.parse().ok()?,
            host: HostRef { namespace: namespace.to_owned(), name: name.to_owned() },
        })
    }

    pub fn of(machine: &SitebootMachine) -> Option<Mark> {
        Mark::parse(machine.annotations().get(BINDER_ANNOTATION)?)
    }

    fn fresh(&self, now: u64) -> bool {
        now.saturating_sub(self.at) < BINDER_TIMEOUT
    }

    fn names(&self, host: &Host) -> bool {
        self.host.name == host.name_any()
            && Some(self.host.namespace.as_str()) == host.namespace().as_deref()
    }
}

impl std::fmt::Display for Mark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{} claims {}/{}", self.binder, self.at, self.host.namespace, self.host.name)
    }
}

pub fn plan<'a>(seen: &Observed<'a>, policy: &Policy) -> Plan<'a> {
    let mut report = Report {
        status: seen.machine.status.clone().unwrap_or_default(),
        generation: seen.machine.metadata.generation,
    };
    let (step, requeue) = decide(seen, policy, &mut report);
    Plan { step, status: report.status, requeue }
}

/// The status being built in one pass.
struct Report {
    status: SitebootMachineStatus,
    generation: Option<i64>,
}

impl Report {
    fn ready(&mut self, ready: bool, reason: Reason, message: &str) {
        let reason = reason.to_string();
        set_condition(&mut self.status.conditions, READY, ready, &reason, message, self.generation);
    }

    fn node(&mut self, linked: bool, reason: Reason, message: &str) {
        let reason = reason.to_string();
        set_condition(
            &mut self.status.conditions,
            NODE_HAS_PROVIDER_ID,
            linked,
            &reason,
            message,
            self.generation,
        );
    }

    fn wait(
        &mut self,
        reason: Reason,
        message: &str,
        requeue: Requeue,
    ) -> (Step<'static>, Requeue) {
        self.ready(false, reason, message);
        (Step::None, requeue)
    }
}

fn decide<'a>(seen: &Observed<'a>, policy: &Policy, report: &mut Report) -> (Step<'a>, Requeue) {
    let sbm = seen.machine;
    if check_paused(seen.cluster, sbm, &mut report.status.conditions) {
        return (Step::None, Requeue::OnChange);
    }
    // Staged data nobody waits for goes first, whatever else happens to the machine.
    if seen.staged.is_some() && awaited_data(seen).is_none() {
        return (Step::UnstageBootstrapData, Requeue::Now);
    }
    if sbm.metadata.deletion_timestamp.is_some() {
        return delete(seen, report);
    }
    if !sbm.finalizers().iter().any(|f| f == FINALIZER) {
        return (Step::AddFinalizer, Requeue::Now);
    }
    let Some(machine) = seen.owner else {
        return report.wait(
            Reason::WaitingForMachine,
            "no owner Machine yet (Cluster API sets it)",
            Requeue::OnChange,
        );
    };
    let Some(cluster) = seen.cluster else {
        return report.wait(
            Reason::WaitingForCluster,
            "the Machine's Cluster does not exist",
            Requeue::OnChange,
        );
    };
    if !cluster.infrastructure_provisioned() {
        return report.wait(
            Reason::WaitingForClusterInfrastructure,
            "the Cluster's infrastructure is not provisioned yet",
            Requeue::OnChange,
        );
    }
    if machine.spec.bootstrap.data_secret_name.is_none() {
        return report.wait(
            Reason::WaitingForBootstrapData,
            "Machine.spec.bootstrap.dataSecretName is not set yet",
            Requeue::OnChange,
        );
    }
    match &sbm.spec.host_ref {
        Some(host_ref) => match seen.bound.filter(|h| consumed_by(h, sbm)) {
            Some(host) => {
                if let Some(orphan) = orphans(seen, Some(host)).next() {
                    return release_orphan(sbm, orphan);
                }
                bound(seen, host, report)
            }
            None if let Some(host) = seen.bound.filter(|h| moved_with(h, sbm)) => {
                report.ready(false, Reason::Provisioning, "taking over the claim after a move");
                (Step::Adopt(host), Requeue::Now)
            }
            // The host went, or its claim was given back. Before anything ran on it (no
            // providerID), the machine binds again; after, it stays failed for Cluster API to
            // replace (a MachineHealthCheck).
            None if sbm.spec.provider_id.is_none() => (Step::ForgetHostRef, Requeue::Now),
            None => report.wait(
                Reason::HostMissing,
                &format!(
                    "Host {}/{} no longer exists or no longer names this machine",
                    host_ref.namespace, host_ref.name
                ),
                Requeue::After(NO_HOST_RETRY),
            ),
        },
        None => bind(seen, machine, policy, report),
    }
}

/// The bootstrap data the boot plane waits for: the bound host's provisioning operation, until
/// its data was delivered.
fn awaited_data(seen: &Observed<'_>) -> Option<Staged> {
    let host = seen.bound.filter(|h| consumed_by(h, seen.machine))?;
    let op = host.status.as_ref()?.operation.as_ref()?;
    (op.kind == OperationKind::Provision && !op.bootstrap_delivered)
        .then(|| Staged { host: key(host), operation: op.id.clone() })
}

/// The machine has its host: have it provisioned, hand its data to the boot plane when its
/// provisioning waits for it, and report it.
fn bound<'a>(seen: &Observed<'a>, host: &'a Host, report: &mut Report) -> (Step<'a>, Requeue) {
    let (step, requeue) = bound_host(seen, host, report);
    let secret = seen.owner.and_then(|m| m.spec.bootstrap.data_secret_name.clone());
    match (step, awaited_data(seen), secret) {
        (Step::None, Some(awaited), Some(secret)) if seen.staged != Some(&awaited) => {
            (Step::StageBootstrapData { secret, staged: awaited }, Requeue::Now)
        }
        (step, _, _) => (step, requeue),
    }
}

fn bound_host<'a>(seen: &Observed<'a>, host: &'a Host, report: &mut Report) -> (Step<'a>, Requeue) {
    let desired = Provisioning { image: seen.machine.spec.image.clone() };
    if host.spec.provisioning.as_ref() != Some(&desired) {
        report.ready(false, Reason::Provisioning, "asked the Host to install the image");
        return (
            Step::RequestProvisioning { host, provisioning: desired },
            Requeue::After(PROGRESS_RETRY),
        );
    }
    let status = host.status.clone().unwrap_or_default();
    report.status.failure_domain = host.labels().get(SITE_LABEL).cloned();
    match status.state {
        Some(HostState::Provisioned)
            if status.installed.as_ref().is_some_and(|i| i.image == desired.image) =>
        {
            let mut addresses = status.addresses.clone();
            addresses.push(MachineAddress { kind: "Hostname".into(), address: host.name_any() });
            report.status.addresses = addresses;
            report.status.initialization = Some(Initialization { provisioned: Some(true) });
            report.ready(
                true,
                Reason::Provisioned,
                &format!("running on Host {}", host.name_any()),
            );
            let provider_id = provider_id(host);
            if seen.machine.spec.provider_id.as_deref() != Some(provider_id.as_str()) {
                return (Step::SetProviderId(provider_id), Requeue::After(PROVISIONED_RETRY));
            }
            link_node(seen, host, provider_id, report)
        }
        Some(HostState::Quarantined) => {
            let why = status.quarantine_reason.unwrap_or_default();
            report.wait(
                Reason::HostQuarantined,
                &format!("Host {} is quarantined: {why}", host.name_any()),
                Requeue::After(NO_HOST_RETRY),
            )
        }
        state => {
            let step = status.operation.and_then(|o| o.step).map(|s| format!(" ({s})"));
            report.wait(
                Reason::Provisioning,
                &format!("Host {} is {state:?}{}", host.name_any(), step.unwrap_or_default()),
                Requeue::After(PROGRESS_RETRY),
            )
        }
    }
}

/// Whether a pass must read the workload cluster's Nodes: the host is Provisioned and the
/// Machine has no nodeRef yet (then Cluster API has found the Node by providerID, and there is
/// nothing left to do).
pub fn wants_nodes(owner: Option<&Machine>, bound: Option<&Host>) -> bool {
    let provisioned =
        bound.and_then(|h| h.status.as_ref()).and_then(|s| s.state) == Some(HostState::Provisioned);
    let node_ref = owner.and_then(|m| m.status.as_ref()).and_then(|s| s.node_ref.as_ref());
    provisioned && node_ref.is_none()
}

/// The fallback that needs nothing from the bootstrap template: the machine's Node, found by
/// the system UUID inspection recorded (never by name), gets the providerID if it has none.
fn link_node<'a>(
    seen: &Observed<'a>,
    host: &Host,
    provider_id: String,
    report: &mut Report,
) -> (Step<'a>, Requeue) {
    let node_ref = seen.owner.and_then(|m| m.status.as_ref()).and_then(|s| s.node_ref.as_ref());
    if let Some(node) = node_ref {
        report.node(true, Reason::NodeFound, &format!("Node {}", node.name));
        return (Step::None, Requeue::After(PROVISIONED_RETRY));
    }
    let waiting = |report: &mut Report, message: &str| {
        report.node(false, Reason::WaitingForNode, message);
        (Step::None, Requeue::After(NODE_RETRY))
    };
    let nodes = match &seen.nodes {
        None => return (Step::None, Requeue::After(NODE_RETRY)),
        Some(Err(why)) => {
            return waiting(report, &format!("cannot read the workload cluster's Nodes: {why}"));
        }
        Some(Ok(nodes)) => *nodes,
    };
    let uuid = host
        .status
        .as_ref()
        .and_then(|s| s.hardware.as_ref())
        .and_then(|h| h.system.as_ref())
        .map(|s| s.uuid.as_str());
    let Some(uuid) = uuid.filter(|u| !u.is_empty()) else {
        return waiting(
            report,
            &format!(
                "inspection recorded no system UUID for Host {}: the kubelet must be given --provider-id {provider_id}",
                host.name_any()
            ),
        );
    };
    let mine: Vec<&Node> = nodes
        .iter()
        .filter(|n| {
            let reported = n
                .status
                .as_ref()
                .and_then(|s| s.node_info.as_ref())
                .map(|i| i.system_uuid.as_str());
            reported.is_some_and(|r| r.eq_ignore_ascii_case(uuid))
        })
        .collect();
    match mine.as_slice() {
        [] => {
            waiting(report, &format!("no Node of the workload cluster has system UUID {uuid} yet"))
        }
        [node] => match node
            .spec
            .as_ref()
            .and_then(|s| s.provider_id.as_deref())
            .filter(|p| !p.is_empty())
        {
            None => {
                report.node(
                    false,
                    Reason::WaitingForNode,
                    &format!("setting the providerID of Node {}", node.name_any()),
                );
                (Step::SetNodeProviderId { node, provider_id }, Requeue::After(NODE_RETRY))
            }
            Some(p) if p == provider_id => {
                report.node(true, Reason::NodeFound, &format!("Node {}", node.name_any()));
                (Step::None, Requeue::After(NODE_RETRY))
            }
            Some(other) => {
                report.node(
                    false,
                    Reason::NodeProviderIDConflict,
                    &format!(
                        "Node {} has system UUID {uuid} but providerID {other}; left alone",
                        node.name_any()
                    ),
                );
                (Step::None, Requeue::After(PROVISIONED_RETRY))
            }
        },
        several => {
            let names: Vec<String> = several.iter().map(|n| n.name_any()).collect();
            waiting(
                report,
                &format!(
                    "Nodes {} all report system UUID {uuid}; none is changed",
                    names.join(", ")
                ),
            )
        }
    }
}

/// `siteboot://<namespace>/<host>`.
pub fn provider_id(host: &Host) -> String {
    format!("siteboot://{}/{}", host.namespace().unwrap_or_default(), host.name_any())
}

/// No host yet: mark, claim, record (see the module doc).
fn bind<'a>(
    seen: &Observed<'a>,
    machine: &Machine,
    policy: &Policy,
    report: &mut Report,
) -> (Step<'a>, Requeue) {
    let sbm = seen.machine;
    // A machine pinned to another site is that site's appliance's business.
    if machine.spec.failure_domain.as_deref().is_some_and(|fd| !fd.is_empty() && fd != policy.site)
    {
        return (Step::None, Requeue::OnChange);
    }
    let namespace = host_namespace(sbm);
    if let Err(e) = policy.host_pools.may_take(&sbm.namespace().unwrap_or_default(), &namespace) {
        return report.wait(Reason::HostNamespaceNotAllowed, &e.to_string(), Requeue::OnChange);
    }
    let mark = Mark::of(sbm);
    if let Some(m) = &mark
        && m.fresh(seen.now)
        && m.binder != policy.identity
    {
        return report.wait(
            Reason::BindingElsewhere,
            &format!("appliance {} is binding this machine", m.binder),
            Requeue::After(Duration::from_secs(5)),
        );
    }
    let selector = sbm.spec.host_selector.as_ref();
    let site = Some(policy.site.as_str());
    let pool = selection::Pool::new(seen.hosts(), &namespace, &policy.host_pools);
    // The host the mark names, claimed for this machine: adopt it if it still fits.
    if let Some(m) = &mark
        && let Some(host) = pool.hosts().find(|h| m.names(h) && consumed_by(h, sbm))
    {
        return match pool.fits(host, selector, site) {
            Ok(()) => (Step::RecordHostRef(host), Requeue::Now),
            Err(e) => (
                Step::Release {
                    host,
                    why: format!(
                        "claimed for SitebootMachine {} but no longer fits it: {e}",
                        key(sbm)
                    ),
                },
                Requeue::Now,
            ),
        };
    }
    if let Some(orphan) = orphans(seen, None).next() {
        return release_orphan(sbm, orphan);
    }
    let candidates = pool.candidates(selector, site, seed(sbm));
    let Some(first) = candidates.first().copied() else {
        let why = pool.explain(selector, site);
        return report.wait(
            Reason::NoHostAvailable,
            &format!("no Available Host in site {} matches ({why})", policy.site),
            Requeue::After(NO_HOST_RETRY),
        );
    };
    // Ours and fresh, naming a host that is still a candidate: claim it. Otherwise (no mark, a
    // stale one, or the named host went to someone else) mark the first candidate.
    if let Some(m) = &mark
        && m.fresh(seen.now)
        && m.binder == policy.identity
        && let Some(host) = candidates.iter().copied().find(|h| m.names(h))
    {
        report.ready(false, Reason::Provisioning, &format!("claiming Host {}", host.name_any()));
        return (Step::Claim(host), Requeue::Now);
    }
    let host = HostRef { namespace: namespace.clone(), name: first.name_any() };
    (Step::Mark(Mark { binder: policy.identity.clone(), at: seen.now, host }), Requeue::Now)
}

/// The machine is being deleted: wipe and release its host, then let it go.
fn delete<'a>(seen: &Observed<'a>, report: &mut Report) -> (Step<'a>, Requeue) {
    let sbm = seen.machine;
    if !sbm.finalizers().iter().any(|f| f == FINALIZER) {
        return (Step::None, Requeue::OnChange);
    }
    // `clusterctl move` deletes the source's copy: the host stays claimed, for the target's.
    if sbm.annotations().contains_key(DELETE_FOR_MOVE_ANNOTATION) {
        return (Step::RemoveFinalizer, Requeue::OnChange);
    }
    let mark = Mark::of(sbm);
    let host = seen.bound.filter(|h| consumed_by(h, sbm)).or_else(|| {
        // Claimed but not yet recorded: the host the mark names.
        let m = mark.as_ref()?;
        seen.hosts().find(|h| m.names(h) && consumed_by(h, sbm))
    });
    if let Some(host) = host {
        if host.spec.provisioning.is_some() {
            report.ready(
                false,
                Reason::Deprovisioning,
                &format!("Host {} is being wiped", host.name_any()),
            );
            return (Step::CancelProvisioning(host), Requeue::After(DEPROVISION_RETRY));
        }
        let state = host.status.as_ref().and_then(|s| s.state);
        // A host that may hold this machine's OS is released after its wipe. A Quarantined one
        // may be released as it is: the Host lifecycle wipes it before it is Available again.
        if matches!(
            state,
            Some(HostState::Provisioning | HostState::Provisioned | HostState::Deprovisioning)
        ) {
            return report.wait(
                Reason::Deprovisioning,
                &format!("waiting for Host {} to be wiped (now {state:?})", host.name_any()),
                Requeue::After(DEPROVISION_RETRY),
            );
        }
        let why = format!("released by SitebootMachine {}", key(sbm));
        return (Step::Release { host, why }, Requeue::Now);
    }
    if let Some(orphan) = orphans(seen, None).next() {
        return release_orphan(sbm, orphan);
    }
    (Step::RemoveFinalizer, Requeue::OnChange)
}

/// Hosts that say they are claimed for this machine, other than `keep` (callers handle the host
/// the mark names first): a claim whose hostRef write lost to another appliance's, or a Host made or edited to
/// name this machine.
fn orphans<'a, 's>(
    seen: &'s Observed<'a>,
    keep: Option<&'s Host>,
) -> impl Iterator<Item = &'a Host> + 's {
    seen.hosts()
        .filter(move |h| consumed_by(h, seen.machine) && keep.is_none_or(|k| k.uid() != h.uid()))
}

fn release_orphan<'a>(sbm: &SitebootMachine, host: &'a Host) -> (Step<'a>, Requeue) {
    let why =
        format!("a claim for SitebootMachine {} that it did not make or does not use", key(sbm));
    (Step::Release { host, why }, Requeue::Now)
}

pub fn consumed_by(host: &Host, sbm: &SitebootMachine) -> bool {
    host.spec
        .consumer_ref
        .as_ref()
        .is_some_and(|c| c.kind == "SitebootMachine" && Some(&c.uid) == sbm.uid().as_ref())
}

/// Whether `host` and `sbm` name each other (its `consumerRef` by kind, namespace and name; the
/// machine's `spec.hostRef` is how `host` was found) but the uids differ: `clusterctl move` and
/// restores recreate both objects with new uids. A machine deleted and made again under the same
/// name has no `hostRef` (the deletion released the host first), so it never gets here.
fn moved_with(host: &Host, sbm: &SitebootMachine) -> bool {
    host.spec.consumer_ref.as_ref().is_some_and(|c| {
        c.kind == "SitebootMachine"
            && Some(&c.namespace) == sbm.namespace().as_ref()
            && c.name == sbm.name_any()
            && Some(&c.uid) != sbm.uid().as_ref()
    })
}

/// Where the machine's hosts are looked for.
pub fn host_namespace(sbm: &SitebootMachine) -> String {
    sbm.spec.host_namespace(sbm.namespace())
}

/// Spreads two appliances' first choices over different hosts.
fn seed(sbm: &SitebootMachine) -> u64 {
    sbm.uid()
        .map(|u| u.bytes().fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(b))))
        .unwrap_or(0)
}

/// Whether the machine last reported that no host was available (so a repeat is not logged).
pub fn was_waiting_for_a_host(sbm: &SitebootMachine) -> bool {
    sbm.status
        .as_ref()
        .and_then(|s| condition(&s.conditions, READY))
        .is_some_and(|c| c.reason == Reason::NoHostAvailable.to_string())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    use serde_json::json;

    use super::*;
    use crate::conditions::PAUSED;
    use crate::crd::capi::{ClusterInitialization, ClusterStatus, PAUSED_ANNOTATION};
    use crate::crd::{
        ConsumerRef, Hardware, HostSelector, HostSpec, HostStatus, Image, Installed, Operation,
        SitebootMachineSpec, System, now,
    };
    use crate::machine::write::{Guard, Level, Note, Target, Write};
    use crate::pools::Tenants;

    const NOW: u64 = 1_000_000;

    fn policy() -> Policy {
        let host_pools = HostPools::new([
            ("pool".to_owned(), Tenants::Only(["ns".to_owned()].into())),
            ("team-pool".to_owned(), Tenants::Only(["team-a".to_owned()].into())),
        ]);
        Policy { site: "lab".into(), identity: "me".into(), host_pools }
    }

    fn image() -> Image {
        Image {
            url: "http://x/os.img".into(),
            checksum: format!("sha256:{}", "0".repeat(64)),
            format: None,
            grow_last_partition: false,
        }
    }

    fn sbm() -> SitebootMachine {
        let mut m = SitebootMachine::new(
            "m",
            SitebootMachineSpec {
                provider_id: None,
                host_selector: None,
                image: image(),
                wipe: None,
                host_ref: None,
            },
        );
        m.metadata.namespace = Some("ns".into());
        m.metadata.uid = Some("sbm-uid".into());
        m.metadata.finalizers = Some(vec![FINALIZER.into()]);
        m.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "cluster.x-k8s.io/v1beta2".into(),
            kind: "Machine".into(),
            name: "machine".into(),
            uid: "machine-uid".into(),
            ..Default::default()
        }]);
        m
    }

    fn machine() -> Machine {
        let mut m = Machine::new("machine", Default::default());
        m.spec.bootstrap.data_secret_name = Some("machine-bootstrap".into());
        m
    }

    fn cluster() -> Cluster {
        let mut c = Cluster::new("c", Default::default());
        c.status = Some(ClusterStatus {
            initialization: Some(ClusterInitialization {
                infrastructure_provisioned: Some(true),
                ..Default::default()
            }),
        });
        c
    }

    fn host(name: &str, mac: &str, state: HostState) -> Host {
        let mut h = Host::new(name, HostSpec::new(mac));
        h.metadata.namespace = Some("ns".into());
        h.metadata.uid = Some(format!("{name}-uid"));
        h.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), "lab".to_owned())]));
        h.status = Some(HostStatus { state: Some(state), ..Default::default() });
        h
    }

    fn available(n: u8) -> Host {
        host(&format!("h{n}"), &format!("52:54:00:00:00:{n:02x}"), HostState::Available)
    }

    fn claimed_for(mut h: Host, sbm: &SitebootMachine) -> Host {
        h.spec.consumer_ref = Some(ConsumerRef {
            api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
            kind: "SitebootMachine".into(),
            namespace: "ns".into(),
            name: sbm.name_any(),
            uid: sbm.uid().unwrap(),
        });
        h
    }

    fn marked(mut m: SitebootMachine, binder: &str, at: u64, host: &str) -> SitebootMachine {
        let mark = Mark {
            binder: binder.into(),
            at,
            host: HostRef { namespace: "ns".into(), name: host.into() },
        };
        m.metadata.annotations =
            Some(BTreeMap::from([(BINDER_ANNOTATION.into(), mark.to_string())]));
        m
    }

    fn bound_to(mut m: SitebootMachine, host: &str) -> SitebootMachine {
        m.spec.host_ref = Some(HostRef { namespace: "ns".into(), name: host.into() });
        m
    }

    struct World {
        sbm: SitebootMachine,
        machine: Option<Machine>,
        cluster: Option<Cluster>,
        hosts: Vec<Arc<Host>>,
        nodes: Option<Result<Vec<Node>, String>>,
        staged: Option<Staged>,
    }

    impl World {
        fn new(sbm: SitebootMachine, hosts: Vec<Host>) -> Self {
            let hosts = hosts.into_iter().map(Arc::new).collect();
            let (machine, cluster) = (Some(machine()), Some(cluster()));
            World { sbm, machine, cluster, hosts, nodes: None, staged: None }
        }

        fn plan(&self) -> Plan<'_> {
            let bound = self
                .sbm
                .spec
                .host_ref
                .as_ref()
                .and_then(|r| self.hosts.iter().find(|h| h.name_any() == r.name))
                .map(|h| &**h);
            let seen = Observed {
                machine: &self.sbm,
                owner: self.machine.as_ref(),
                cluster: self.cluster.as_ref(),
                bound,
                hosts: &self.hosts,
                nodes: self.nodes.as_ref().map(|n| n.as_deref().map_err(Clone::clone)),
                staged: self.staged.as_ref(),
                now: NOW,
            };
            plan(&seen, &policy())
        }
    }

    fn ready(plan: &Plan) -> (String, String, String) {
        let c = condition(&plan.status.conditions, READY).expect("a Ready condition");
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    fn waits(plan: &Plan, reason: Reason) {
        assert_eq!(plan.step, Step::None, "{plan:?}");
        let (status, r, message) = ready(plan);
        assert_eq!(
            (status.as_str(), r.as_str()),
            ("False", reason.to_string().as_str()),
            "{message}"
        );
    }

    fn name(step: &Step) -> String {
        match step {
            Step::Claim(h) | Step::RecordHostRef(h) | Step::CancelProvisioning(h) => h.name_any(),
            Step::Release { host, .. } | Step::RequestProvisioning { host, .. } => host.name_any(),
            Step::Mark(m) => m.host.name.clone(),
            other => format!("{other:?}"),
        }
    }

    #[test]
    fn pause_stops_everything_even_deletion() {
        let mut w = World::new(sbm(), vec![available(1)]);
        w.cluster.as_mut().unwrap().spec.paused = Some(true);
        let p = w.plan();
        assert_eq!((p.step.clone(), p.requeue), (Step::None, Requeue::OnChange));
        assert_eq!(condition(&p.status.conditions, PAUSED).unwrap().status, "True");
        w.sbm.metadata.deletion_timestamp = Some(now());
        assert_eq!(w.plan().step, Step::None);
        w.cluster.as_mut().unwrap().spec.paused = None;
        let mut annotated = sbm();
        annotated.metadata.annotations =
            Some(BTreeMap::from([(PAUSED_ANNOTATION.into(), "".into())]));
        assert_eq!(World::new(annotated, vec![]).plan().step, Step::None);
    }

    #[test]
    fn waits_for_finalizer_machine_cluster_infrastructure_and_data_in_order() {
        let mut m = sbm();
        m.metadata.finalizers = None;
        assert_eq!(World::new(m, vec![]).plan().step, Step::AddFinalizer);

        let mut w = World::new(sbm(), vec![available(1)]);
        w.machine = None;
        waits(&w.plan(), Reason::WaitingForMachine);
        w.machine = Some(machine());
        w.cluster = None;
        waits(&w.plan(), Reason::WaitingForCluster);
        w.cluster = Some(Cluster::new("c", Default::default()));
        waits(&w.plan(), Reason::WaitingForClusterInfrastructure);
        w.cluster = Some(cluster());
        w.machine.as_mut().unwrap().spec.bootstrap.data_secret_name = None;
        waits(&w.plan(), Reason::WaitingForBootstrapData);
        assert_eq!(w.plan().requeue, Requeue::OnChange, "a change wakes it, no polling");
    }

    #[test]
    fn binding_marks_then_claims_then_records() {
        let w = World::new(sbm(), vec![available(1)]);
        let Step::Mark(mark) = w.plan().step else { panic!("{:?}", w.plan()) };
        assert_eq!((mark.binder.as_str(), mark.at, mark.host.name.as_str()), ("me", NOW, "h1"));
        assert_eq!(Mark::parse(&mark.to_string()), Some(mark));

        let w = World::new(marked(sbm(), "me", NOW - 1, "h1"), vec![available(1)]);
        assert_eq!(name(&w.plan().step), "h1");
        assert!(matches!(w.plan().step, Step::Claim(_)));

        let m = marked(sbm(), "me", NOW - 1, "h1");
        let w = World::new(m.clone(), vec![claimed_for(available(1), &m)]);
        assert!(matches!(w.plan().step, Step::RecordHostRef(h) if h.name_any() == "h1"));
    }

    #[test]
    fn claim_race_outcomes() {
        // Another appliance's fresh mark: wait for it.
        let w = World::new(marked(sbm(), "other", NOW - 10, "h1"), vec![available(1)]);
        waits(&w.plan(), Reason::BindingElsewhere);
        // The host named went to another machine: mark the next candidate.
        let other = {
            let mut o = sbm();
            o.metadata.uid = Some("other-uid".into());
            o
        };
        let w = World::new(
            marked(sbm(), "me", NOW - 1, "h1"),
            vec![claimed_for(available(1), &other), available(2)],
        );
        assert!(matches!(&w.plan().step, Step::Mark(m) if m.host.name == "h2"), "{:?}", w.plan());
        // A stale mark of a dead binder whose claim went through: adopted.
        let m = marked(sbm(), "dead", NOW - BINDER_TIMEOUT - 1, "h1");
        let w = World::new(m.clone(), vec![claimed_for(available(1), &m)]);
        assert!(matches!(w.plan().step, Step::RecordHostRef(_)));
        // A stale mark whose claim did not: marked anew by us.
        let w =
            World::new(marked(sbm(), "dead", NOW - BINDER_TIMEOUT - 1, "h1"), vec![available(1)]);
        assert!(matches!(&w.plan().step, Step::Mark(m) if m.binder == "me"));
    }

    fn node(name: &str, uuid: &str, provider_id: Option<&str>) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": name },
            "spec": { "providerID": provider_id },
            "status": { "nodeInfo": {
                "systemUUID": uuid, "machineID": "", "bootID": "", "kernelVersion": "",
                "osImage": "", "containerRuntimeVersion": "", "kubeletVersion": "",
                "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
            } },
        }))
        .unwrap()
    }

    /// A machine on Provisioned host h1, whose inspection found system UUID `uuid`.
    fn provisioned_world(uuid: Option<&str>, nodes: Option<Result<Vec<Node>, String>>) -> World {
        let mut m = bound_to(sbm(), "h1");
        m.spec.provider_id = Some("siteboot://ns/h1".into());
        let mut h = claimed_for(host("h1", "52:54:00:00:00:01", HostState::Provisioned), &m);
        h.spec.provisioning = Some(Provisioning { image: image() });
        let status = h.status.as_mut().unwrap();
        status.installed =
            Some(Installed { image: image(), consumer: "ns/m".into(), disk_boot_pending: false });
        status.hardware = uuid.map(|uuid| Hardware {
            system: Some(System { uuid: uuid.into(), vendor: None, model: None, serial: None }),
            ..Default::default()
        });
        let mut w = World::new(m, vec![h]);
        w.nodes = nodes;
        w
    }

    fn node_condition(plan: &Plan) -> (String, String, String) {
        let c = condition(&plan.status.conditions, NODE_HAS_PROVIDER_ID).expect("the condition");
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    #[test]
    fn the_node_with_the_machine_s_system_uuid_gets_its_provider_id() {
        const UUID: &str = "8C1E4E2A-0000-4000-8000-00000000AB01";
        let ours = "siteboot://ns/h1";
        // Found by UUID (case aside), whatever its name: its providerID is set.
        let w = provisioned_world(
            Some(UUID),
            Some(Ok(vec![
                node("other", "11111111-0000-4000-8000-000000000000", None),
                node("worker-7", &UUID.to_lowercase(), None),
            ])),
        );
        let p = w.plan();
        assert!(
            matches!(&p.step, Step::SetNodeProviderId { node, provider_id } if node.name_any() == "worker-7" && provider_id == ours),
            "{p:?}"
        );
        // Already set: reported, nothing written.
        let w = provisioned_world(Some(UUID), Some(Ok(vec![node("worker-7", UUID, Some(ours))])));
        let p = w.plan();
        assert_eq!(p.step, Step::None);
        assert_eq!(node_condition(&p).1, Reason::NodeFound.to_string());
        // Another providerID, or two Nodes claiming the UUID, or none: left alone.
        let w =
            provisioned_world(Some(UUID), Some(Ok(vec![node("worker-7", UUID, Some("aws:///x"))])));
        assert_eq!(w.plan().step, Step::None);
        assert_eq!(node_condition(&w.plan()).1, Reason::NodeProviderIDConflict.to_string());
        let w = provisioned_world(
            Some(UUID),
            Some(Ok(vec![node("a", UUID, None), node("b", UUID, None)])),
        );
        assert_eq!(w.plan().step, Step::None);
        assert_eq!(node_condition(&w.plan()).1, Reason::WaitingForNode.to_string());
        let w = provisioned_world(
            Some(UUID),
            Some(Ok(vec![node("x", "22222222-0000-4000-8000-000000000000", None)])),
        );
        assert_eq!(w.plan().step, Step::None);
        assert_eq!(node_condition(&w.plan()).1, Reason::WaitingForNode.to_string());
        // No UUID from inspection, or the workload cluster unreadable: waiting, with why.
        let w = provisioned_world(None, Some(Ok(vec![node("worker-7", UUID, None)])));
        assert!(node_condition(&w.plan()).2.contains("--provider-id"));
        let w = provisioned_world(Some(UUID), Some(Err("connection refused".into())));
        assert!(node_condition(&w.plan()).2.contains("connection refused"));
        // Ready stays True throughout: the infrastructure is provisioned.
        assert_eq!(ready(&w.plan()).0, "True");
    }

    #[test]
    fn nodes_are_read_only_for_a_provisioned_host_whose_machine_has_no_node_ref() {
        let provisioned = host("h1", "52:54:00:00:00:01", HostState::Provisioned);
        let mut m = machine();
        assert!(wants_nodes(Some(&m), Some(&provisioned)));
        assert!(!wants_nodes(Some(&m), Some(&available(1))));
        assert!(!wants_nodes(Some(&m), None));
        m.status = Some(crate::crd::capi::MachineStatus {
            node_ref: Some(crate::crd::capi::NodeRef { name: "worker-7".into() }),
            ..Default::default()
        });
        assert!(!wants_nodes(Some(&m), Some(&provisioned)));
    }

    #[test]
    fn a_machine_whose_host_let_go_binds_again_unless_it_ran_there() {
        let m = bound_to(sbm(), "h1");
        let other = {
            let mut o = sbm();
            o.metadata.name = Some("other".into());
            o.metadata.uid = Some("other-uid".into());
            o
        };
        // The host's claim went to another machine, or the host is gone: forget it, bind anew.
        let w = World::new(m.clone(), vec![claimed_for(available(1), &other), available(2)]);
        assert_eq!(w.plan().step, Step::ForgetHostRef);
        let w = World::new(m.clone(), vec![available(2)]);
        assert_eq!(w.plan().step, Step::ForgetHostRef);
        // Once it has a providerID it stays failed: Cluster API replaces the Machine.
        let mut ran = m;
        ran.spec.provider_id = Some("siteboot://ns/h1".into());
        let w = World::new(ran, vec![available(2)]);
        waits(&w.plan(), Reason::HostMissing);
    }

    #[test]
    fn a_host_that_names_the_machine_is_not_adopted() {
        // Made (or edited) by someone who may edit Hosts, naming a waiting machine: given back.
        let m = sbm();
        let planted = claimed_for(available(9), &m);
        let w = World::new(m.clone(), vec![planted.clone(), available(1)]);
        let p = w.plan();
        assert!(matches!(&p.step, Step::Release { host, .. } if host.name_any() == "h9"), "{p:?}");
        // Also with a mark that names another host.
        let m = marked(sbm(), "me", NOW - 1, "h1");
        let w = World::new(m.clone(), vec![claimed_for(available(9), &m), available(1)]);
        assert!(matches!(&w.plan().step, Step::Release { host, .. } if host.name_any() == "h9"));
        // The marked host, claimed, but now in maintenance or no longer matching: given back.
        let mut cordoned = claimed_for(available(1), &m);
        cordoned.spec.maintenance = true;
        let w = World::new(m.clone(), vec![cordoned]);
        assert!(matches!(&w.plan().step, Step::Release { why, .. } if why.contains("maintenance")));
        let mut picky = marked(sbm(), "me", NOW - 1, "h1");
        picky.spec.host_selector = Some(HostSelector {
            match_labels: BTreeMap::from([("rack".into(), "r9".into())]),
            ..Default::default()
        });
        let w = World::new(picky.clone(), vec![claimed_for(available(1), &picky)]);
        assert!(matches!(&w.plan().step, Step::Release { .. }));
    }

    #[test]
    fn no_host_reasons() {
        let w = World::new(sbm(), vec![host("p", "52:54:00:00:00:01", HostState::Provisioned)]);
        waits(&w.plan(), Reason::NoHostAvailable);
        assert!(ready(&w.plan()).2.contains("1 not Available"), "{:?}", ready(&w.plan()));
        assert_eq!(w.plan().requeue, Requeue::After(NO_HOST_RETRY));
        // A Host with the boot MAC of one in a pool, in the machine's own namespace: only the
        // pool's host owns it.
        let mut pooled = available(1);
        pooled.metadata.namespace = Some("pool".into());
        let w = World::new(sbm(), vec![available(1), pooled]);
        waits(&w.plan(), Reason::NoHostAvailable);
        let why = ready(&w.plan()).2;
        assert!(why.contains("1 hosts: 1 whose boot MAC another Host owns"), "{why}");
        assert!(!why.contains("pool"), "{why}");
    }

    #[test]
    fn host_namespaces_and_sites_are_the_operators_choice() {
        let mut m = sbm();
        m.spec.host_selector =
            Some(HostSelector { namespace: Some("kube-system".into()), ..Default::default() });
        waits(&World::new(m.clone(), vec![]).plan(), Reason::HostNamespaceNotAllowed);
        // A pool of other tenants: its hosts are none of this machine's business.
        m.spec.host_selector.as_mut().unwrap().namespace = Some("team-pool".into());
        let mut theirs = available(1);
        theirs.metadata.namespace = Some("team-pool".into());
        let w = World::new(m.clone(), vec![theirs]);
        waits(&w.plan(), Reason::HostNamespaceNotAllowed);
        assert!(ready(&w.plan()).2.contains(r#""ns" is not a tenant of host pool "team-pool""#));
        m.spec.host_selector.as_mut().unwrap().namespace = Some("pool".into());
        let mut h = available(1);
        h.metadata.namespace = Some("pool".into());
        let w = World::new(m, vec![h, available(2)]);
        assert!(
            matches!(&w.plan().step, Step::Mark(m) if m.host.namespace == "pool" && m.host.name == "h1")
        );
        // Hosts of another namespace are not candidates.
        let mut elsewhere = available(1);
        elsewhere.metadata.namespace = Some("other".into());
        waits(&World::new(sbm(), vec![elsewhere]).plan(), Reason::NoHostAvailable);
        // Pinned to another site: another appliance's.
        let mut w = World::new(sbm(), vec![available(1)]);
        w.machine.as_mut().unwrap().spec.failure_domain = Some("far".into());
        assert_eq!((w.plan().step, w.plan().requeue), (Step::None, Requeue::OnChange));
    }

    #[test]
    fn a_bound_machine_is_provisioned_and_reported() {
        let m = bound_to(sbm(), "h1");
        let w = World::new(m.clone(), vec![claimed_for(available(1), &m)]);
        let Step::RequestProvisioning { provisioning, .. } = w.plan().step else { panic!() };
        assert_eq!(provisioning.image, image());

        let mut h = claimed_for(available(1), &m);
        h.spec.provisioning = Some(Provisioning { image: image() });
        h.status.as_mut().unwrap().state = Some(HostState::Provisioning);
        let w = World::new(m.clone(), vec![h.clone()]);
        waits(&w.plan(), Reason::Provisioning);

        let status = h.status.as_mut().unwrap();
        status.state = Some(HostState::Provisioned);
        status.installed =
            Some(Installed { image: image(), consumer: "ns/m".into(), disk_boot_pending: false });
        status.addresses =
            vec![MachineAddress { kind: "InternalIP".into(), address: "10.0.0.5".into() }];
        let w = World::new(m.clone(), vec![h.clone()]);
        let p = w.plan();
        assert_eq!(p.step, Step::SetProviderId("siteboot://ns/h1".into()));
        assert_eq!(ready(&p).0, "True");
        assert_eq!(p.status.initialization, Some(Initialization { provisioned: Some(true) }));
        assert_eq!(p.status.addresses.len(), 2);
        assert_eq!(p.status.failure_domain.as_deref(), Some("lab"));
        let mut done = m.clone();
        done.spec.provider_id = Some("siteboot://ns/h1".into());
        assert_eq!(World::new(done, vec![h.clone()]).plan().step, Step::None);

        h.status.as_mut().unwrap().state = Some(HostState::Quarantined);
        waits(&World::new(m.clone(), vec![h.clone()]).plan(), Reason::HostQuarantined);
        // Bound, and another Host names the machine too: that one is given back first.
        let w = World::new(m.clone(), vec![h, claimed_for(available(2), &m)]);
        assert!(matches!(&w.plan().step, Step::Release { host, .. } if host.name_any() == "h2"));
    }

    #[test]
    fn bootstrap_data_is_staged_for_the_boot_plane_only_while_its_provisioning_waits_for_it() {
        let m = bound_to(sbm(), "h1");
        let mut h = claimed_for(available(1), &m);
        h.spec.provisioning = Some(Provisioning { image: image() });
        let status = h.status.as_mut().unwrap();
        status.state = Some(HostState::Provisioning);
        status.operation = Some(Operation::new(OperationKind::Provision, "op-2".into(), now()));
        let for_op = |id: &str| Staged { host: "ns/h1".into(), operation: id.into() };
        let mut w = World::new(m.clone(), vec![h.clone()]);
        let p = w.plan();
        assert_eq!(
            (p.step, p.requeue),
            (
                Step::StageBootstrapData {
                    secret: "machine-bootstrap".into(),
                    staged: for_op("op-2")
                },
                Requeue::Now
            )
        );
        assert_eq!(ready(&w.plan()).1, Reason::Provisioning.to_string());
        // Staged for this operation: nothing more. Staged for an earlier one: staged again.
        w.staged = Some(for_op("op-2"));
        assert_eq!(w.plan().step, Step::None);
        w.staged = Some(for_op("op-1"));
        assert!(matches!(w.plan().step, Step::StageBootstrapData { .. }));
        // Delivered: the copy goes.
        h.status.as_mut().unwrap().operation.as_mut().unwrap().bootstrap_delivered = true;
        let mut w = World::new(m.clone(), vec![h.clone()]);
        assert_eq!(w.plan().step, Step::None, "nothing staged, nothing to do");
        w.staged = Some(for_op("op-2"));
        assert_eq!(w.plan().step, Step::UnstageBootstrapData);
        // Not while a wipe runs, nor for a host that no longer names the machine.
        let mut wiping = h.clone();
        let op = wiping.status.as_mut().unwrap().operation.as_mut().unwrap();
        (op.kind, op.bootstrap_delivered) = (OperationKind::Deprovision, false);
        let mut w = World::new(m.clone(), vec![wiping]);
        w.staged = Some(for_op("op-2"));
        assert_eq!(w.plan().step, Step::UnstageBootstrapData);
        let mut taken = h.clone();
        taken.spec.consumer_ref = None;
        let mut w = World::new(m.clone(), vec![taken]);
        w.staged = Some(for_op("op-2"));
        assert_eq!(w.plan().step, Step::UnstageBootstrapData);
    }

    #[test]
    fn deletion_wipes_then_releases_then_lets_go() {
        let mut m = bound_to(sbm(), "h1");
        m.metadata.deletion_timestamp = Some(now());
        let mut h = claimed_for(host("h1", "52:54:00:00:00:01", HostState::Provisioned), &m);
        h.spec.provisioning = Some(Provisioning { image: image() });
        let w = World::new(m.clone(), vec![h.clone()]);
        assert!(matches!(w.plan().step, Step::CancelProvisioning(_)));
        h.spec.provisioning = None;
        for state in [HostState::Provisioned, HostState::Deprovisioning] {
            h.status.as_mut().unwrap().state = Some(state);
            waits(&World::new(m.clone(), vec![h.clone()]).plan(), Reason::Deprovisioning);
        }
        // Available after its wipe, or Quarantined (the Host wipes it before reuse): released.
        for state in [HostState::Available, HostState::Quarantined] {
            h.status.as_mut().unwrap().state = Some(state);
            let w = World::new(m.clone(), vec![h.clone()]);
            assert!(matches!(w.plan().step, Step::Release { .. }), "{state:?}");
        }
        assert_eq!(World::new(m.clone(), vec![]).plan().step, Step::RemoveFinalizer);
        // Claimed, not yet recorded: found through the mark.
        let mut unbound = marked(sbm(), "me", NOW, "h1");
        unbound.metadata.deletion_timestamp = Some(now());
        let w = World::new(unbound.clone(), vec![claimed_for(available(1), &unbound)]);
        assert!(matches!(w.plan().step, Step::Release { .. }));
    }

    #[test]
    fn after_a_move_the_machine_takes_over_its_host_s_claim_and_nothing_else() {
        // `clusterctl move` recreated the machine (new uid, no status) and the Host, whose
        // consumerRef still carries the old uid.
        let mut w = provisioned_world(None, None);
        w.sbm.metadata.uid = Some("new-uid".into());
        w.sbm.status = None;
        let p = w.plan();
        assert!(matches!(p.step, Step::Adopt(h) if h.name_any() == "h1"), "{p:?}");
        // Once the uid is written the machine is bound again, Provisioned and never reimaged.
        let adopted = claimed_for((*w.hosts[0]).clone(), &w.sbm);
        let w = World::new(w.sbm.clone(), vec![adopted]);
        let p = w.plan();
        assert!(!matches!(p.step, Step::RequestProvisioning { .. } | Step::Adopt(_)), "{p:?}");
        assert_eq!(ready(&p).0, "True", "{p:?}");

        // A Host naming another machine of the same name elsewhere, or a machine that does not
        // name the Host in hostRef: no takeover.
        let mut w = provisioned_world(None, None);
        w.sbm.metadata.uid = Some("new-uid".into());
        let mut other_ns = (*w.hosts[0]).clone();
        other_ns.spec.consumer_ref.as_mut().unwrap().namespace = "elsewhere".into();
        let w2 = World::new(w.sbm.clone(), vec![other_ns]);
        waits(&w2.plan(), Reason::HostMissing);
        let mut unbound = w.sbm.clone();
        unbound.spec.host_ref = None;
        unbound.spec.provider_id = None;
        let w3 = World::new(unbound, vec![(*w.hosts[0]).clone()]);
        assert!(!matches!(w3.plan().step, Step::Adopt(_)), "{:?}", w3.plan());
    }

    #[test]
    fn a_machine_deleted_by_clusterctl_move_keeps_its_host() {
        let mut w = provisioned_world(None, None);
        w.sbm.metadata.deletion_timestamp = Some(now());
        assert!(matches!(w.plan().step, Step::CancelProvisioning(_)), "a real delete wipes");
        w.sbm.metadata.annotations =
            Some(BTreeMap::from([(DELETE_FOR_MOVE_ANNOTATION.into(), String::new())]));
        assert_eq!(w.plan().step, Step::RemoveFinalizer);
    }

    /// The write of the step planned for `w`.
    fn write(w: &World) -> Write<'_> {
        let p = w.plan();
        p.step.write(&w.sbm).unwrap_or_else(|| panic!("no write: {p:?}"))
    }

    #[test]
    fn a_mark_is_written_to_the_machine_if_it_is_unchanged() {
        let w = World::new(sbm(), vec![available(1)]);
        assert_eq!(
            write(&w),
            Write {
                target: Target::Machine,
                patch: json!({ "metadata": { "annotations": {
                    "siteboot.dev/binder": "me@1000000 claims ns/h1"
                } } }),
                guard: Guard::Unchanged,
                note: None,
            }
        );
    }

    #[test]
    fn a_claim_writes_the_machine_as_the_host_s_consumer_if_the_host_is_unchanged() {
        let w = World::new(marked(sbm(), "me", NOW - 1, "h1"), vec![available(1)]);
        assert_eq!(
            write(&w),
            Write {
                target: Target::Host(&w.hosts[0]),
                patch: json!({ "spec": { "consumerRef": {
                    "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
                    "kind": "SitebootMachine",
                    "namespace": "ns",
                    "name": "m",
                    "uid": "sbm-uid",
                } } }),
                guard: Guard::Unchanged,
                note: Some(Note {
                    level: Level::Info,
                    log: "claimed a Host".into(),
                    event: Some(("Claimed".into(), "claimed by SitebootMachine ns/m".into())),
                }),
            }
        );
    }

    #[test]
    fn recording_the_host_drops_the_mark_and_sets_host_ref_which_is_set_once() {
        let m = marked(sbm(), "me", NOW - 1, "h1");
        let w = World::new(m.clone(), vec![claimed_for(available(1), &m)]);
        let write = write(&w);
        assert_eq!(
            (write.target, write.guard, write.note),
            (Target::Machine, Guard::SetOnce, None)
        );
        assert_eq!(
            write.patch,
            json!({
                "metadata": { "annotations": { "siteboot.dev/binder": null } },
                "spec": { "hostRef": { "namespace": "ns", "name": "h1" } },
            })
        );
    }

    #[test]
    fn adopting_writes_the_new_uid_into_the_host_s_consumer_ref() {
        let mut w = provisioned_world(None, None);
        w.sbm.metadata.uid = Some("new-uid".into());
        let write = write(&w);
        assert_eq!((write.target, write.guard), (Target::Host(&w.hosts[0]), Guard::Unchanged));
        assert_eq!(write.patch["spec"]["consumerRef"]["uid"], "new-uid");
        assert_eq!(write.patch, Step::Claim(&w.hosts[0]).write(&w.sbm).unwrap().patch);
        let note = write.note.unwrap();
        assert_eq!(note.log, "took over the claim of a moved Host");
        assert_eq!(
            note.event,
            Some((
                "Adopted".into(),
                "claim taken over by SitebootMachine ns/m after a move or restore".into()
            ))
        );
    }

    #[test]
    fn forgetting_a_host_that_let_go_clears_host_ref_with_a_warning() {
        let w = World::new(bound_to(sbm(), "h1"), vec![available(2)]);
        let write = write(&w);
        assert_eq!(
            (write.target, write.patch, write.guard),
            (Target::Machine, json!({ "spec": { "hostRef": null } }), Guard::Unchanged)
        );
        let note = write.note.unwrap();
        assert!(note.is_warning());
        assert_eq!(note.log, "the Host ns/h1 no longer names this machine; binding it again");
    }

    #[test]
    fn a_release_clears_consumer_ref_and_provisioning_if_host_and_machine_are_unchanged() {
        let mut m = bound_to(sbm(), "h1");
        m.metadata.deletion_timestamp = Some(now());
        let w = World::new(m.clone(), vec![claimed_for(available(1), &m)]);
        let why = "released by SitebootMachine ns/m";
        assert_eq!(
            write(&w),
            Write {
                target: Target::Host(&w.hosts[0]),
                patch: json!({ "spec": { "consumerRef": null, "provisioning": null } }),
                guard: Guard::BothUnchanged,
                note: Some(Note {
                    level: Level::Info,
                    log: format!("released the Host: {why}"),
                    event: Some(("Released".into(), why.into())),
                }),
            }
        );
    }

    #[test]
    fn provisioning_is_asked_for_and_let_go_on_the_host_if_it_is_unchanged() {
        let m = bound_to(sbm(), "h1");
        let w = World::new(m.clone(), vec![claimed_for(available(1), &m)]);
        let image =
            json!({ "url": "http://x/os.img", "checksum": format!("sha256:{}", "0".repeat(64)) });
        assert_eq!(
            write(&w),
            Write {
                target: Target::Host(&w.hosts[0]),
                patch: json!({ "spec": { "provisioning": { "image": image } } }),
                guard: Guard::Unchanged,
                note: None,
            }
        );
        let mut w = provisioned_world(None, None);
        w.sbm.metadata.deletion_timestamp = Some(now());
        assert_eq!(
            write(&w),
            Write {
                target: Target::Host(&w.hosts[0]),
                patch: json!({ "spec": { "provisioning": null } }),
                guard: Guard::Unchanged,
                note: None,
            }
        );
    }

    #[test]
    fn the_machine_s_provider_id_is_written_whatever_changed_since_the_read() {
        let mut w = provisioned_world(None, None);
        w.sbm.spec.provider_id = None;
        assert_eq!(
            write(&w),
            Write {
                target: Target::Machine,
                patch: json!({ "spec": { "providerID": "siteboot://ns/h1" } }),
                guard: Guard::Plain,
                note: None,
            }
        );
    }

    #[test]
    fn the_node_s_provider_id_is_written_if_the_node_is_unchanged() {
        const UUID: &str = "8C1E4E2A-0000-4000-8000-00000000AB01";
        let w = provisioned_world(Some(UUID), Some(Ok(vec![node("worker-7", UUID, None)])));
        let nodes = w.nodes.as_ref().unwrap().as_ref().unwrap();
        let write = write(&w);
        assert_eq!(
            (write.target, write.patch, write.guard),
            (
                Target::Node(&nodes[0]),
                json!({ "spec": { "providerID": "siteboot://ns/h1" } }),
                Guard::Unchanged
            )
        );
        assert!(write.note.unwrap().log.ends_with(": siteboot://ns/h1"));
    }

    #[test]
    fn the_finalizer_is_added_and_removed_keeping_the_others_if_the_machine_is_unchanged() {
        let mut m = sbm();
        m.metadata.finalizers = Some(vec!["other.example/f".into()]);
        let w = World::new(m.clone(), vec![]);
        assert_eq!(
            write(&w),
            Write {
                target: Target::Machine,
                patch: json!({ "metadata": { "finalizers": ["other.example/f", FINALIZER] } }),
                guard: Guard::Unchanged,
                note: None,
            }
        );
        m.metadata.finalizers = Some(vec!["other.example/f".into(), FINALIZER.into()]);
        m.metadata.deletion_timestamp = Some(now());
        let w = World::new(m, vec![]);
        let write = write(&w);
        assert_eq!((write.target, write.guard), (Target::Machine, Guard::Unchanged));
        assert_eq!(write.patch, json!({ "metadata": { "finalizers": ["other.example/f"] } }));
    }

    #[test]
    fn handing_data_to_the_boot_plane_and_doing_nothing_are_no_patch() {
        let staged = Staged { host: "ns/h1".into(), operation: "op-1".into() };
        let stage = Step::StageBootstrapData { secret: "s".into(), staged };
        for step in [Step::None, stage, Step::UnstageBootstrapData] {
            assert_eq!(step.write(&sbm()), None, "{step:?}");
        }
    }
}
