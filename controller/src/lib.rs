//! The Kubernetes side of siteboot: the Host inventory, the Cluster API infrastructure
//! provider and the Cluster API bootstrap provider, reconciled from inside the appliance.

#![forbid(unsafe_code)]

pub mod agent;
pub mod bmc;
pub mod bootstrap;
pub mod cache;
pub mod cluster;
pub mod conditions;
pub mod context;
pub mod crd;
pub mod dhcp_checkpoint;
pub mod handoff;
pub mod host;
pub mod inventory;
pub mod leader;
pub mod machine;
pub mod manifests;
pub mod owners;
pub mod pools;
pub mod run;
pub mod selection;
pub mod site;
pub mod ssh;
pub mod template;
pub mod throttle;
pub mod workload;
