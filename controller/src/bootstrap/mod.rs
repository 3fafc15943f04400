//! The Cluster API bootstrap provider: `SitebootConfig` (contract v1beta2) becomes first-boot
//! data that joins a host to its cluster as a plain kubelet and leaves nothing of siteboot
//! behind. It shares the binary and the client with the infrastructure provider, never its
//! state: it works with any infrastructure provider, and theirs with any bootstrap provider.
//!
//! [`plan`] decides the one next step from what was read, [`write`](mod@write) what that step
//! writes (the token and data Secrets, the patches, their guards); [`reconciler`] reads,
//! performs it and reports; [`cloud_config`] renders the data. In order, a pass:
//! 1. honours pause (Cluster or annotation): reports Paused and changes nothing
//! 2. on delete: deletes the config's token in the workload cluster, then drops the finalizer
//!    (after [`plan::DELETE_GRACE`] of an unreachable workload cluster it lets go, with a
//!    Warning Event: the token expires on its own)
//! 3. adds the finalizer
//! 4. waits for the Machine, the Cluster, its control plane to be initialized, and the
//!    `<cluster>-kubeconfig` Secret
//! 5. records a token id in status (compare-and-swap), creates the token
//!    `kube-system/bootstrap-token-<id>` in the workload cluster, ensures the node-bootstrap
//!    RBAC there, writes the data Secret
//! 6. reports `status.dataSecretName` and `status.initialization.dataSecretCreated`; extends the
//!    token while the Machine has no Node, deletes it once it has

pub mod cloud_config;
pub mod plan;
pub mod reconciler;
pub mod write;

pub use plan::FINALIZER;
pub use reconciler::run;
