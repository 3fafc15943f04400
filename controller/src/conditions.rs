//! Condition types and the reasons siteboot's objects report, written once.
//!
//! Host transitions carry their own reasons (they double as Event reasons; see
//! [`crate::host::lifecycle`]); everything else a condition can say is here.

use std::fmt;

use kube::{Resource, ResourceExt};

use crate::crd::capi::{Cluster, PAUSED_ANNOTATION};
use crate::crd::{Conditions, set_condition};

/// Cluster API reads it: the object is (or is not) done.
pub const READY: &str = "Ready";
/// Cluster API's pause contract: reconciliation of the object is stopped.
pub const PAUSED: &str = "Paused";
/// On a Host: no other Host of the site has its boot MAC.
pub const BOOT_MAC_UNIQUE: &str = "BootMACUnique";
/// On a Host with `spec.bmc`: siteboot reached its BMC with the Secret's credentials, and the
/// BMC's system has the host's boot MAC. Checked again each time the Host registers.
pub const BMC_READY: &str = "BMCReady";
/// On a Host with `spec.access.ssh` and no BMC: siteboot logged in to its server with the
/// Secret's key, the server's host key being the pinned (or recorded) one. Checked again each
/// time the Host registers.
pub const SSH_READY: &str = "SSHReady";
/// On a SitebootMachine: the workload cluster's Node of the machine carries its providerID (so
/// Cluster API can give the Machine its nodeRef).
pub const NODE_HAS_PROVIDER_ID: &str = "NodeHasProviderID";
/// On a SitebootConfig (bootstrap contract): the bootstrap data Secret exists.
pub const DATA_SECRET_AVAILABLE: &str = "DataSecretAvailable";

/// Why a condition is what it is. Written as the variant's name (CamelCase, as Kubernetes
/// wants reasons).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Paused,
    NotPaused,
    WaitingForMachine,
    WaitingForCluster,
    WaitingForClusterInfrastructure,
    WaitingForBootstrapData,
    /// `hostSelector.namespace` names a namespace the operator does not allow.
    HostNamespaceNotAllowed,
    NoHostAvailable,
    /// Another appliance is binding this machine.
    BindingElsewhere,
    HostMissing,
    HostQuarantined,
    /// No Node of the workload cluster is this machine yet (matched by system UUID).
    WaitingForNode,
    /// The machine's Node carries this machine's providerID.
    NodeFound,
    /// A Node with this machine's system UUID carries another providerID: left alone.
    NodeProviderIDConflict,
    Provisioning,
    Provisioned,
    Deprovisioning,
    /// The API server refused a request (RBAC, validation): retried slowly.
    ApiRefused,
    BootMACUnique,
    /// Other Hosts name this Host's boot MAC too; this one keeps it.
    BootMACOwned,
    DuplicateBootMAC,
    /// The Cluster's control plane cannot take joins yet.
    WaitingForControlPlaneInitialized,
    /// The Cluster does not say yet where hosts reach its control plane.
    WaitingForControlPlaneEndpoint,
    /// The workload cluster's `<cluster>-kubeconfig` Secret does not exist yet.
    WaitingForKubeconfig,
    /// The `<cluster>-kubeconfig` Secret cannot be used.
    InvalidKubeconfig,
    /// The workload cluster's API server did not answer.
    WorkloadUnreachable,
    /// The SitebootConfig asks for something the renderer refuses.
    InvalidSpec,
    /// This provider joins workers only: control-plane Machines need a control plane provider.
    ControlPlaneMachineNotSupported,
    /// The token id is recorded; the token is being created in the workload cluster.
    CreatingToken,
    /// A Secret named like the config exists and is not this config's.
    DataSecretConflict,
    DataSecretAvailable,
    /// The token went from the workload cluster (expired, or deleted) before the host joined.
    TokenMissing,
    /// Deleting the token in the workload cluster failed for too long; it is left to expire.
    TokenAbandoned,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Whether `object` has Cluster API's paused annotation (a Host has no Cluster: this is its
/// pause).
pub fn paused_itself(object: &impl Resource) -> bool {
    object.annotations().contains_key(PAUSED_ANNOTATION)
}

/// Cluster API's pause contract: `object` is paused while its Cluster is, or while it has the
/// paused annotation. Records it in `conditions` (the object's own) and returns it.
pub fn check_paused(
    cluster: Option<&Cluster>,
    object: &impl Resource,
    conditions: &mut Conditions,
) -> bool {
    let paused = cluster.is_some_and(|c| c.spec.paused == Some(true)) || paused_itself(object);
    let (reason, message) = if paused {
        (Reason::Paused, "the Cluster or this object is paused: no changes are made")
    } else {
        (Reason::NotPaused, "")
    };
    let generation = object.meta().generation;
    set_condition(conditions, PAUSED, paused, &reason.to_string(), message, generation);
    paused
}
