//! `Site`: one per appliance site. Sites are the Cluster API failure domains; their status is
//! the appliance's heartbeat.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "siteboot.dev",
    version = "v1alpha1",
    kind = "Site",
    status = "SiteStatus",
    shortname = "sbsite",
    derive = "PartialEq",
    derive = "Default",
    printcolumn = r#"{"name":"Leader","type":"string","jsonPath":".status.leader"}"#,
    printcolumn = r#"{"name":"Heartbeat","type":"date","jsonPath":".status.heartbeat"}"#,
    printcolumn = r#"{"name":"Available","type":"integer","jsonPath":".status.hosts.Available"}"#,
    printcolumn = r#"{"name":"Provisioned","type":"integer","jsonPath":".status.hosts.Provisioned"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SiteSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Offered to Cluster API as a failure domain suitable for control-plane Machines.
    /// Default true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane: Option<bool>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SiteStatus {
    /// The appliance holding the site's leader Lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<String>,
    /// When the leader last reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Where the site's appliance serves (its boot-plane address).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    /// Hosts of this site by state.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub hosts: BTreeMap<String, u32>,
    /// Boot steps served by the leader since it started, by stage.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub boots: BTreeMap<String, u64>,
}
