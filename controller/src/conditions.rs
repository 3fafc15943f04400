//! Condition types and the reasons siteboot's objects report, written once.
//!
//! Host transitions carry their own reasons (they double as Event reasons; see
//! [`crate::host::lifecycle`]); everything else a condition can say is here.

use std::fmt;

/// Cluster API reads it: the object is (or is not) done.
pub const READY: &str = "Ready";
/// Cluster API's pause contract: reconciliation of the object is stopped.
pub const PAUSED: &str = "Paused";
/// On a Host: no other Host of the site has its boot MAC.
pub const BOOT_MAC_UNIQUE: &str = "BootMACUnique";

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
    Provisioning,
    Provisioned,
    Deprovisioning,
    /// The API server refused a request (RBAC, validation): retried slowly.
    ApiRefused,
    BootMACUnique,
    DuplicateBootMAC,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
