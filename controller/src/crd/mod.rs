//! The custom resources: `Host` and `Site` (group `siteboot.dev`), and the Cluster API
//! infrastructure kinds `SitebootMachine`, `SitebootMachineTemplate`, `SitebootCluster` and
//! `SitebootClusterTemplate` (group `infrastructure.cluster.x-k8s.io`), plus the small typed
//! subset of the CAPI core kinds the provider reads.

pub mod capi;
mod cluster;
mod common;
mod host;
mod machine;
mod site;

pub use cluster::*;
pub use common::*;
pub use host::*;
pub use machine::*;
pub use site::*;

/// The API group of the inventory kinds.
pub const GROUP: &str = "siteboot.dev";
/// The API group of the Cluster API infrastructure kinds.
pub const INFRASTRUCTURE_GROUP: &str = "infrastructure.cluster.x-k8s.io";
pub const VERSION: &str = "v1alpha1";
/// The label on a Host naming its site.
pub const SITE_LABEL: &str = "siteboot.dev/site";
