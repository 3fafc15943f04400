//! The Cluster API bootstrap provider: `SitebootConfig` (contract v1beta2) becomes first-boot
//! data that joins a host to its cluster as a plain kubelet and leaves nothing of siteboot
//! behind. [`cloud_config`] renders the data.

pub mod cloud_config;
