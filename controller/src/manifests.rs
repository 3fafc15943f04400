//! The YAML this provider installs: its CRDs (generated from the Rust types, then given what
//! derive cannot express: list-map conditions for server-side apply and CEL immutability rules)
//! and least-privilege RBAC. `siteboot manifests` writes them; the committed copies under
//! `deploy/` are checked against this code by a test.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::{Value, json};

use crate::crd::{
    Host, Site, SitebootCluster, SitebootClusterTemplate, SitebootConfig, SitebootConfigTemplate,
    SitebootMachine, SitebootMachineTemplate,
};

/// Every CRD of siteboot, ready to apply.
pub fn crds() -> Vec<CustomResourceDefinition> {
    let mut crds = vec![
        Host::crd(),
        Site::crd(),
        SitebootMachine::crd(),
        SitebootMachineTemplate::crd(),
        SitebootCluster::crd(),
        SitebootClusterTemplate::crd(),
        SitebootConfig::crd(),
        SitebootConfigTemplate::crd(),
    ];
    for crd in &mut crds {
        let kind = crd.spec.names.kind.clone();
        let version = &mut crd.spec.versions[0];
        let schema = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
            .expect("derived CRDs have a schema");
        let mut value = serde_json::to_value(&*schema).expect("schema serializes");
        conditions_as_list_maps(&mut value);
        for (path, rule, message) in validations(&kind) {
            add_rule(&mut value, path, rule, message);
        }
        *schema = serde_json::from_value(value).expect("schema round-trips");
    }
    crds
}

/// CEL rules per kind: (path of properties, rule, message).
fn validations(kind: &str) -> Vec<(&'static [&'static str], &'static str, &'static str)> {
    match kind {
        "Host" => vec![(
            &["spec"],
            "self.bootMACAddress == oldSelf.bootMACAddress",
            "spec.bootMACAddress is immutable: create a new Host for another NIC",
        )],
        "SitebootMachine" => vec![
            (
                &["spec"],
                "!has(oldSelf.hostRef) || (has(self.hostRef) && self.hostRef == oldSelf.hostRef)",
                "spec.hostRef cannot change once set",
            ),
            (
                &["spec"],
                "!has(oldSelf.providerID) || (has(self.providerID) && self.providerID == oldSelf.providerID)",
                "spec.providerID cannot change once set",
            ),
            (
                &["spec", "image"],
                "self == oldSelf",
                "spec.image is immutable: roll out a new template",
            ),
        ],
        "SitebootMachineTemplate" | "SitebootClusterTemplate" | "SitebootConfigTemplate" => vec![(
            &["spec", "template", "spec"],
            "self == oldSelf",
            "spec.template.spec is immutable: create a new template",
        )],
        _ => vec![],
    }
}

/// Every `conditions` array becomes `x-kubernetes-list-type: map` keyed by `type`, so
/// server-side apply merges conditions one by one instead of replacing the list.
fn conditions_as_list_maps(schema: &mut Value) {
    if let Some(props) = schema.get_mut("properties").and_then(Value::as_object_mut) {
        for (name, prop) in props.iter_mut() {
            if name == "conditions" && prop.get("type") == Some(&json!("array")) {
                prop["x-kubernetes-list-type"] = json!("map");
                prop["x-kubernetes-list-map-keys"] = json!(["type"]);
            }
            conditions_as_list_maps(prop);
        }
    }
    if let Some(items) = schema.get_mut("items") {
        conditions_as_list_maps(items);
    }
}

fn add_rule(schema: &mut Value, path: &[&str], rule: &str, message: &str) {
    let mut node = schema;
    for segment in path {
        node = node
            .get_mut("properties")
            .and_then(|p| p.get_mut(*segment))
            .unwrap_or_else(|| panic!("schema has no property {segment} on the way to {path:?}"));
    }
    let rules = node
        .as_object_mut()
        .expect("a property schema is an object")
        .entry("x-kubernetes-validations")
        .or_insert_with(|| json!([]));
    rules
        .as_array_mut()
        .expect("validations are a list")
        .push(json!({ "rule": rule, "message": message }));
}

/// Where the appliance may read bootstrap data Secrets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretAccess {
    /// `get` in these namespaces only (a Role and RoleBinding each): the namespaces whose
    /// Machines this appliance serves. The default, with the appliance's own namespace.
    Namespaces(Vec<String>),
    /// `get` in every namespace (a ClusterRole rule): the opt-in for appliances that serve
    /// Machines anywhere. Anyone who controls the appliance can then read any Secret by name.
    Cluster,
}

/// The RBAC of the appliance (`siteboot` ServiceAccount in `namespace`), and the ClusterRole
/// aggregated to the Cluster API core manager.
pub fn rbac(namespace: &str, secrets: &SecretAccess) -> Vec<Value> {
    let manager_rules = json!([
        { "apiGroups": ["siteboot.dev"], "resources": ["hosts", "sites"],
          "verbs": ["get", "list", "watch", "create", "update", "patch"] },
        { "apiGroups": ["siteboot.dev"], "resources": ["hosts/status", "sites/status"],
          "verbs": ["get", "update", "patch"] },
        { "apiGroups": ["infrastructure.cluster.x-k8s.io"],
          "resources": ["sitebootmachines", "sitebootclusters"],
          "verbs": ["get", "list", "watch", "update", "patch"] },
        { "apiGroups": ["infrastructure.cluster.x-k8s.io"],
          "resources": ["sitebootmachines/status", "sitebootclusters/status"],
          "verbs": ["get", "update", "patch"] },
        { "apiGroups": ["infrastructure.cluster.x-k8s.io"],
          "resources": ["sitebootmachinetemplates", "sitebootclustertemplates"],
          "verbs": ["get", "list", "watch"] },
        // The bootstrap provider; finalizers: its data Secrets block their config's deletion.
        { "apiGroups": ["bootstrap.cluster.x-k8s.io"], "resources": ["sitebootconfigs"],
          "verbs": ["get", "list", "watch", "update", "patch"] },
        { "apiGroups": ["bootstrap.cluster.x-k8s.io"], "resources": ["sitebootconfigs/status"],
          "verbs": ["get", "update", "patch"] },
        { "apiGroups": ["bootstrap.cluster.x-k8s.io"], "resources": ["sitebootconfigs/finalizers"],
          "verbs": ["update"] },
        { "apiGroups": ["cluster.x-k8s.io"], "resources": ["machines", "clusters"],
          "verbs": ["get", "list", "watch"] },
        { "apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"] },
    ]);
    // Never list: get reads the one bootstrap Secret a Machine names and a cluster's
    // `<cluster>-kubeconfig`; create writes a SitebootConfig's data Secret, once (no update).
    let secrets_rule =
        json!({ "apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"] });
    let mut manager_rules = manager_rules;
    let secret_namespaces = match secrets {
        SecretAccess::Cluster => {
            manager_rules.as_array_mut().expect("rules are a list").push(secrets_rule.clone());
            Vec::new()
        }
        SecretAccess::Namespaces(namespaces) => namespaces.clone(),
    };
    let subject = json!([{ "kind": "ServiceAccount", "name": "siteboot", "namespace": namespace }]);
    let secret_roles = secret_namespaces.iter().flat_map(|ns| {
        [
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": { "name": "siteboot-bootstrap-data", "namespace": ns },
                "rules": [secrets_rule.clone()],
            }),
            json!({
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": { "name": "siteboot-bootstrap-data", "namespace": ns },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "siteboot-bootstrap-data" },
                "subjects": subject.clone(),
            }),
        ]
    });
    let mut objects = vec![
        json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": { "name": "siteboot", "namespace": namespace },
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": { "name": "siteboot-manager" },
            "rules": manager_rules,
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": { "name": "siteboot-manager" },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "siteboot-manager" },
            "subjects": [{ "kind": "ServiceAccount", "name": "siteboot", "namespace": namespace }],
        }),
        // Leader election (one Lease per site, watched so a standby takes over the moment it
        // is released) and the site's DHCP lease checkpoint (a ConfigMap), in the appliance's
        // namespace only.
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": { "name": "siteboot-leader-election", "namespace": namespace },
            "rules": [
                { "apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                  "verbs": ["get", "list", "watch", "create", "update"] },
                { "apiGroups": [""], "resources": ["configmaps"],
                  "verbs": ["get", "create", "patch"] },
            ],
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": { "name": "siteboot-leader-election", "namespace": namespace },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "siteboot-leader-election" },
            "subjects": [{ "kind": "ServiceAccount", "name": "siteboot", "namespace": namespace }],
        }),
        // The Cluster API core manager sets owner references and reads/writes our
        // infrastructure and bootstrap objects; blockOwnerDeletion needs finalizer updates on
        // them (v1.14).
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {
                "name": "siteboot-capi-manager",
                "labels": { "cluster.x-k8s.io/aggregate-to-manager": "true" },
            },
            "rules": [{
                "apiGroups": ["infrastructure.cluster.x-k8s.io"],
                "resources": [
                    "sitebootmachines", "sitebootmachines/status", "sitebootmachines/finalizers",
                    "sitebootmachinetemplates", "sitebootmachinetemplates/finalizers",
                    "sitebootclusters", "sitebootclusters/status", "sitebootclusters/finalizers",
                    "sitebootclustertemplates", "sitebootclustertemplates/finalizers",
                ],
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
            }, {
                "apiGroups": ["bootstrap.cluster.x-k8s.io"],
                "resources": [
                    "sitebootconfigs", "sitebootconfigs/status", "sitebootconfigs/finalizers",
                    "sitebootconfigtemplates", "sitebootconfigtemplates/finalizers",
                ],
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
            }],
        }),
    ];
    objects.extend(secret_roles);
    objects
}

/// What `siteboot manifests` grants with no namespace named: bootstrap Secrets in `default`.
pub fn default_secret_access() -> SecretAccess {
    SecretAccess::Namespaces(vec!["default".to_owned()])
}

/// Multi-document YAML.
pub fn to_yaml<T: serde::Serialize>(docs: &[T]) -> String {
    docs.iter()
        .map(|d| serde_yaml::to_string(d).expect("manifests serialize"))
        .collect::<Vec<_>>()
        .join("---\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crds_carry_the_contract_label_and_list_map_conditions() {
        let crds = crds();
        let names: Vec<&str> = crds.iter().map(|c| c.metadata.name.as_deref().unwrap()).collect();
        assert_eq!(
            names,
            [
                "hosts.siteboot.dev",
                "sites.siteboot.dev",
                "sitebootmachines.infrastructure.cluster.x-k8s.io",
                "sitebootmachinetemplates.infrastructure.cluster.x-k8s.io",
                "sitebootclusters.infrastructure.cluster.x-k8s.io",
                "sitebootclustertemplates.infrastructure.cluster.x-k8s.io",
                "sitebootconfigs.bootstrap.cluster.x-k8s.io",
                "sitebootconfigtemplates.bootstrap.cluster.x-k8s.io",
            ]
        );
        for crd in &crds[2..] {
            let labels = crd.metadata.labels.as_ref().unwrap();
            assert_eq!(
                labels.get("cluster.x-k8s.io/v1beta2").map(String::as_str),
                Some("v1alpha1")
            );
            assert_eq!(crd.spec.names.categories.as_deref(), Some(&["cluster-api".to_owned()][..]));
        }
        let host = serde_json::to_value(&crds[0]).unwrap();
        let conditions = &host["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
            ["properties"]["conditions"];
        assert_eq!(conditions["x-kubernetes-list-type"], "map");
        let template = serde_json::to_value(&crds[3]).unwrap();
        let spec = &template["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["template"]["properties"]["spec"];
        assert_eq!(spec["x-kubernetes-validations"][0]["rule"], "self == oldSelf");
    }

    /// The committed manifests are what this code generates: regenerate them with
    /// `siteboot manifests --output-dir deploy` after changing a CRD type or the RBAC.
    #[test]
    fn secrets_are_readable_only_where_machines_are_served() {
        let grants = |access| {
            rbac("sys", &access)
                .into_iter()
                .filter(|o| o.to_string().contains("\"secrets\""))
                .map(|o| format!("{} {}", o["kind"], o["metadata"]["namespace"]))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            grants(SecretAccess::Namespaces(vec!["a".into(), "b".into()])),
            [r#""Role" "a""#, r#""Role" "b""#]
        );
        assert_eq!(grants(SecretAccess::Cluster), [r#""ClusterRole" null"#]);
    }

    #[test]
    fn committed_manifests_do_not_drift() {
        let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        for (file, generated) in [
            ("crds.yaml", to_yaml(&crds())),
            ("rbac.yaml", to_yaml(&rbac("siteboot-system", &default_secret_access()))),
        ] {
            let committed = std::fs::read_to_string(deploy.join(file)).unwrap_or_default();
            assert!(
                committed == generated,
                "deploy/{file} is out of date: run `siteboot manifests --output-dir deploy`"
            );
        }
    }
}
