//! The custom resources: `Host` and `Site` (group `siteboot.dev`), and the Cluster API
//! infrastructure kinds `SitebootMachine`, `SitebootMachineTemplate`, `SitebootCluster` and
//! `SitebootClusterTemplate` (group `infrastructure.cluster.x-k8s.io`), the Cluster API
//! bootstrap kinds `SitebootConfig` and `SitebootConfigTemplate` (group
//! `bootstrap.cluster.x-k8s.io`), plus the small typed subset of the CAPI core kinds the
//! providers read.

mod bootstrap;
pub mod capi;
mod cluster;
mod common;
mod host;
mod machine;
mod site;

pub use bootstrap::*;
pub use cluster::*;
pub use common::*;
pub use host::*;
pub use machine::*;
pub use site::*;

/// The label on a Host naming its site.
pub const SITE_LABEL: &str = "siteboot.dev/site";
