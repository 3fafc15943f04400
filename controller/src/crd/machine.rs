//! `SitebootMachine` and `SitebootMachineTemplate`: the Cluster API InfraMachine contract
//! (v1beta2). A SitebootMachine is the allocation of one Host to one CAPI Machine.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Image;
use super::common::{Conditions, MachineAddress};
use super::host::WipePolicy;

#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "SitebootMachine",
    namespaced,
    status = "SitebootMachineStatus",
    shortname = "sbm",
    category = "cluster-api",
    derive = "PartialEq",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn = r#"{"name":"Cluster","type":"string","jsonPath":".metadata.labels.cluster\\.x-k8s\\.io/cluster-name"}"#,
    printcolumn = r#"{"name":"Host","type":"string","jsonPath":".spec.hostRef.name"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"ProviderID","type":"string","jsonPath":".spec.providerID","priority":1}"#,
    printcolumn = r#"{"name":"Machine","type":"string","jsonPath":".metadata.ownerReferences[?(@.kind==\"Machine\")].name"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SitebootMachineSpec {
    /// `siteboot://<namespace>/<host>`, set once the host is provisioned; the Node of this
    /// Machine must carry the same providerID.
    #[serde(rename = "providerID", default, skip_serializing_if = "Option::is_none")]
    pub provider_id: Option<String>,
    /// Which hosts may be chosen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_selector: Option<HostSelector>,
    /// The OS image written to the host's disk.
    pub image: Image,
    /// How the host is wiped when this machine lets go of it: `quick` or `full`. The site's
    /// `min_wipe` applies whatever this says; this can only ask for more. Frozen into the Host
    /// when its provisioning starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wipe: Option<WipePolicy>,
    /// The host allocated to this machine. Kept in spec (not status) so `clusterctl move`, which
    /// does not restore status, keeps the binding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_ref: Option<HostRef>,
}

impl SitebootMachineSpec {
    /// Where this machine's hosts are looked for: `hostSelector.namespace`, else the namespace of
    /// the object holding this spec (`own`).
    pub fn host_namespace(&self, own: Option<String>) -> String {
        self.host_selector
            .as_ref()
            .and_then(|s| s.namespace.clone())
            .unwrap_or_else(|| own.unwrap_or_default())
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostSelector {
    /// Labels the Host must have.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    /// Hardware the Host must have (from inspection).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<HardwareSelector>,
    /// Where Hosts are looked for. Default: the SitebootMachine's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HardwareSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_cpus: Option<u32>,
    #[serde(default, rename = "minMemoryMiB", skip_serializing_if = "Option::is_none")]
    pub min_memory_mib: Option<u64>,
    /// The largest disk must be at least this big.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_disk_bytes: Option<u64>,
    /// `x86_64`, `aarch64`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostRef {
    pub namespace: String,
    pub name: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Initialization {
    /// True once the host runs its OS with this machine's bootstrap data (contract v1beta2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned: Option<bool>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SitebootMachineStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<MachineAddress>,
    /// The site of the host: the Machine's failure domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Conditions,
}

#[derive(CustomResource, Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "SitebootMachineTemplate",
    namespaced,
    status = "SitebootMachineTemplateStatus",
    shortname = "sbmt",
    category = "cluster-api",
    derive = "PartialEq",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn = r#"{"name":"CPU","type":"string","jsonPath":".status.capacity.cpu"}"#,
    printcolumn = r#"{"name":"Memory","type":"string","jsonPath":".status.capacity.memory"}"#,
    printcolumn = r#"{"name":"Arch","type":"string","jsonPath":".status.nodeInfo.architecture","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct SitebootMachineTemplateSpec {
    /// Immutable: a change is a new template (and a rollout).
    pub template: SitebootMachineTemplateResource,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SitebootMachineTemplateResource {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateMetadata>,
    pub spec: SitebootMachineSpec,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateMetadata {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// What a machine made from the template will have, for the cluster autoscaler to scale a
/// MachineDeployment up from zero (Cluster API's "opt-in autoscaling from zero"): worked out
/// from the inspected Hosts the template's `hostSelector` matches. Empty while none matches.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SitebootMachineTemplateStatus {
    /// `cpu` and `memory`: the least any matching Host has, so no promise is too big.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub capacity: BTreeMap<String, Quantity>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_info: Option<NodeInfo>,
}

/// The architecture and operating system of the template's machines.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeInfo {
    /// Set when every matching Host has the same architecture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<Architecture>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operating_system: Option<String>,
}

/// The CPU architectures of the Cluster API contract, named as Go and the kubelet name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Amd64,
    Arm64,
    S390x,
    Ppc64le,
}

impl Architecture {
    /// From what inspection reports (the kernel's name, `uname -m`); `None` for the others.
    pub fn from_kernel_name(name: &str) -> Option<Self> {
        match name {
            "x86_64" => Some(Self::Amd64),
            "aarch64" => Some(Self::Arm64),
            "s390x" => Some(Self::S390x),
            "ppc64le" => Some(Self::Ppc64le),
            _ => None,
        }
    }
}
