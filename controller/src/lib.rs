//! The Kubernetes side of siteboot: the Host inventory and the Cluster API infrastructure
//! provider, reconciled from inside the appliance.

pub mod crd;
pub mod manifests;
