//! `SitebootCluster` and `SitebootClusterTemplate`: the Cluster API InfraCluster contract
//! (v1beta2). Bare metal has no cluster infrastructure to create; the SitebootCluster reports
//! the sites as failure domains and carries the control-plane endpoint.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::Conditions;
use super::machine::{Initialization, TemplateMetadata};

#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "SitebootCluster",
    namespaced,
    status = "SitebootClusterStatus",
    shortname = "sbc",
    category = "cluster-api",
    derive = "PartialEq",
    derive = "Default",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn = r#"{"name":"Cluster","type":"string","jsonPath":".metadata.labels.cluster\\.x-k8s\\.io/cluster-name"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Endpoint","type":"string","jsonPath":".spec.controlPlaneEndpoint.host"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SitebootClusterSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_endpoint: Option<ApiEndpoint>,
    /// The sites offered as failure domains. Default: every Site.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sites: Option<Vec<String>>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiEndpoint {
    pub host: String,
    pub port: i32,
}

/// A failure domain, as Cluster API v1beta2's `FailureDomain`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureDomain {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane: Option<bool>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SitebootClusterStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failure_domains: Vec<FailureDomain>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
}

#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "SitebootClusterTemplate",
    namespaced,
    shortname = "sbct",
    category = "cluster-api",
    derive = "PartialEq",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SitebootClusterTemplateSpec {
    pub template: SitebootClusterTemplateResource,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SitebootClusterTemplateResource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateMetadata>,
    pub spec: SitebootClusterSpec,
}
