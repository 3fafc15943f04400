//! `SitebootConfig` and `SitebootConfigTemplate`: the Cluster API bootstrap provider contract
//! (v1beta2). A SitebootConfig becomes the first-boot data (a cloud-init jinja template) that
//! joins one Machine's host to its cluster as a plain kubelet, with no agent left behind.

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::Conditions;
use super::machine::TemplateMetadata;

#[derive(CustomResource, Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "bootstrap.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "SitebootConfig",
    namespaced,
    status = "SitebootConfigStatus",
    shortname = "sbcfg",
    category = "cluster-api",
    derive = "PartialEq",
    derive = "Default",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn = r#"{"name":"Cluster","type":"string","jsonPath":".metadata.labels.cluster\\.x-k8s\\.io/cluster-name"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"DataSecret","type":"string","jsonPath":".status.dataSecretName"}"#,
    printcolumn = r#"{"name":"Machine","type":"string","jsonPath":".metadata.ownerReferences[?(@.kind==\"Machine\")].name"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SitebootConfigSpec {
    /// Labels the kubelet registers its Node with (`--node-labels`). Keys and values follow the
    /// Kubernetes label syntax; the kubelet itself refuses most `kubernetes.io` prefixes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_labels: BTreeMap<String, String>,
    /// Taints the kubelet registers its Node with, besides
    /// `node.cluster.x-k8s.io/uninitialized:NoSchedule` (which Cluster API removes once the
    /// Machine has its Node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub node_taints: Vec<NodeTaint>,
    /// Files written on the host before anything else runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<BootstrapFile>,
    /// Shell commands run, in order, before the join (each in its own `sh -c`). A failing one
    /// stops the bootstrap: the host does not join.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pre_commands: Vec<String>,
    /// Shell commands run, in order, after the kubelet has its client certificate and before
    /// the bootstrap is reported complete. A failing one stops the bootstrap.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub post_commands: Vec<String>,
    /// How long the bootstrap token lives without a refresh, in seconds (default 900). The
    /// token is extended while the Machine has no Node, and deleted once it has.
    #[serde(default, rename = "tokenTTLSeconds", skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 60, max = 86400))]
    pub token_ttl_seconds: Option<u32>,
    /// Run the kubelet and containerd inside a systemd-nspawn container on the host instead of
    /// on the host itself: the container runs the host's `/usr` and `/etc` (read-only) on a
    /// throwaway root, on the host's network, started by the host unit
    /// `kubelet-container.service`. The host image needs systemd-nspawn (Debian:
    /// `systemd-container`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nspawn: Option<bool>,
    /// The cluster DNS servers the kubelet gives pods (`clusterDNS`). Default, as kubeadm's:
    /// the tenth address of the Cluster's first Service range
    /// (`spec.clusterNetwork.services.cidrBlocks`, default `10.96.0.0/12`, so `10.96.0.10`).
    #[serde(default, rename = "clusterDNS", skip_serializing_if = "Vec::is_empty")]
    pub cluster_dns: Vec<String>,
    /// The cluster's DNS domain the kubelet gives pods (`clusterDomain`). Default: the
    /// Cluster's `spec.clusterNetwork.serviceDomain`, else `cluster.local`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_domain: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeTaint {
    /// A label-syntax key, e.g. `dedicated` or `example.com/gpu`.
    pub key: String,
    /// A label-syntax value (may be empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    pub effect: TaintEffect,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum TaintEffect {
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BootstrapFile {
    /// Absolute path on the host.
    #[schemars(regex(pattern = r"^/[^{}\x00-\x1f]*$"))]
    pub path: String,
    /// The file's content, written as given.
    pub content: String,
    /// Octal mode, e.g. `0644` (the default) or `0600`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^0?[0-7]{3}$"))]
    pub permissions: Option<String>,
    /// `user:group` (default `root:root`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[a-z_][a-z0-9_-]*(:[a-z_][a-z0-9_-]*)?$"))]
    pub owner: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BootstrapInitialization {
    /// True once the data Secret exists (contract v1beta2): Cluster API then copies
    /// `status.dataSecretName` into `Machine.spec.bootstrap.dataSecretName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_secret_created: Option<bool>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SitebootConfigStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<BootstrapInitialization>,
    /// The Secret holding the bootstrap data (key `value`, `format: cloud-config`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_secret_name: Option<String>,
    /// The public id of this config's bootstrap token (Secret `kube-system/bootstrap-token-<id>`
    /// in the workload cluster). Recorded before the token is created, so one config never
    /// mints two tokens. The token's secret half is never stored here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_id: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
}

#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "bootstrap.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "SitebootConfigTemplate",
    namespaced,
    shortname = "sbcfgt",
    category = "cluster-api",
    derive = "PartialEq",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SitebootConfigTemplateSpec {
    /// Immutable: a change is a new template (and a rollout).
    pub template: SitebootConfigTemplateResource,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SitebootConfigTemplateResource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateMetadata>,
    #[serde(default)]
    pub spec: SitebootConfigSpec,
}
