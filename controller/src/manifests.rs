//! The YAML this provider installs: its CRDs (generated from the Rust types, then given what
//! derive cannot express: list-map conditions for server-side apply and CEL immutability rules),
//! the admission policy that keeps templates immutable but for Cluster API's dry-runs,
//! least-privilege RBAC, a site's appliance (ConfigMap and Deployment of the container image
//! `scripts/build-image` builds), and the clusterctl release folder that packages them all.
//! `siteboot manifests` writes them; the committed copies under `deploy/` are checked against
//! this code by a test.

use std::path::{Path, PathBuf};

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
        // The templates' immutability is the admission policy's ([`admission_policy`]): a
        // CRD rule cannot tell Cluster API's dry-runs from users' updates.
        _ => vec![],
    }
}

/// The annotation Cluster API's topology controller puts on the objects of its server-side
/// apply dry-runs, to tell admission that a change is only being computed.
pub const TOPOLOGY_DRY_RUN_ANNOTATION: &str = "topology.cluster.x-k8s.io/dry-run";

/// The name of the templates' immutability policy and of its binding.
const TEMPLATE_POLICY: &str = "siteboot-templates-immutable";

/// Templates are immutable (a change is a new template, and a rollout), except in the
/// dry-runs of Cluster API's topology controller: it server-side applies a ClusterClass's
/// template with `dryRun` to find out whether it differs, and rotates to a new template when it
/// does. A ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes 1.30+) sees
/// what a CRD validation rule cannot, the request's `dryRun` and the object's annotations, and
/// runs in the API server: no webhook server, no certificate, and it holds while no appliance
/// runs. A request is a topology dry-run as Cluster API's own webhooks judge it
/// (`util/topology.IsDryRunRequest`): `dryRun` set and the annotation present on the object.
pub fn admission_policy() -> Vec<Value> {
    let templates = |group: &str, resources: &[&str]| {
        json!({
            "apiGroups": [group], "apiVersions": ["*"], "operations": ["UPDATE"],
            "resources": resources,
        })
    };
    vec![
        json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
            "metadata": { "name": TEMPLATE_POLICY },
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": { "resourceRules": [
                    templates(
                        "infrastructure.cluster.x-k8s.io",
                        &["sitebootmachinetemplates", "sitebootclustertemplates"],
                    ),
                    templates("bootstrap.cluster.x-k8s.io", &["sitebootconfigtemplates"]),
                ] },
                "matchConditions": [{
                    "name": "not-a-topology-dry-run",
                    "expression": format!(
                        "!(request.dryRun == true && has(object.metadata.annotations) \
                         && '{TOPOLOGY_DRY_RUN_ANNOTATION}' in object.metadata.annotations)"
                    ),
                }],
                "validations": [{
                    // Optional selection: a SitebootConfigTemplate's spec may be absent.
                    "expression": "object.spec.template.?spec == oldObject.spec.template.?spec",
                    "message": "spec.template.spec is immutable: create a new template",
                    "reason": "Invalid",
                }],
            },
        }),
        json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": { "name": TEMPLATE_POLICY },
            "spec": { "policyName": TEMPLATE_POLICY, "validationActions": ["Deny"] },
        }),
    ]
}

/// `crds.yaml`: the CRDs, then the policy that keeps their templates immutable.
pub fn crds_yaml() -> String {
    format!("{}---\n{}", to_yaml(&crds()), to_yaml(&admission_policy()))
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

/// The ServiceAccount of the boot plane when it runs apart (`serve --role boot-plane`).
pub const BOOT_PLANE_ACCOUNT: &str = "siteboot-boot-plane";

/// The RBAC of the appliance in `namespace`: the `siteboot` ServiceAccount (the controller, or
/// the whole appliance in one process), the `siteboot-boot-plane` ServiceAccount (the boot
/// plane apart: no Secret of any other namespace), and the ClusterRole aggregated to the Cluster
/// API core manager.
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
          "resources": ["sitebootmachines/status", "sitebootmachinetemplates/status",
                        "sitebootclusters/status"],
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
    let secret_roles = secret_namespaces.iter().flat_map(|ns| {
        let mut role = namespaced_role(
            ns,
            "siteboot-bootstrap-data",
            "siteboot",
            json!([secrets_rule.clone()]),
        );
        // The ServiceAccount lives in the appliance's namespace, whichever namespace grants.
        role[1]["subjects"][0]["namespace"] = json!(namespace);
        role
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
    // Leader election (one Lease per site, watched so a standby takes over the moment it is
    // released), the site's DHCP lease checkpoint (a ConfigMap) and the bootstrap data handed
    // to the boot plane, in the appliance's namespace only.
    objects.extend(namespaced_role(
        namespace,
        "siteboot-leader-election",
        "siteboot",
        json!([
            { "apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
              "verbs": ["get", "list", "watch", "create", "update"] },
            { "apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch"] },
            // Bootstrap data handed to the boot plane (`handoff`).
            { "apiGroups": [""], "resources": ["secrets"],
              "verbs": ["get", "create", "patch", "delete"] },
        ]),
    ));
    objects.extend(secret_roles);
    objects.extend(boot_plane_rbac(namespace));
    objects.push(host_operator_role());
    objects
}

/// Who may register hardware in a pool namespace (`kubernetes.host_namespaces`) decides what its
/// tenants' machines and join data go to: this ClusterRole is for operators, bound with a
/// RoleBinding in each pool namespace (never to a tenant). It aggregates to no built-in role, so
/// a namespace's `admin` or `edit` grants no Host rights.
pub const HOST_OPERATOR_ROLE: &str = "siteboot-host-operator";

fn host_operator_role() -> Value {
    json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": { "name": HOST_OPERATOR_ROLE },
        "rules": [
            { "apiGroups": ["siteboot.dev"], "resources": ["hosts"],
              "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"] },
            { "apiGroups": ["siteboot.dev"], "resources": ["hosts/status"],
              "verbs": ["get", "list", "watch"] },
            // BMC credentials live beside the Hosts that name them.
            { "apiGroups": [""], "resources": ["secrets"],
              "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"] },
        ],
    })
}

/// A Role in `namespace` and its RoleBinding to `account` there.
fn namespaced_role(namespace: &str, name: &str, account: &str, rules: Value) -> [Value; 2] {
    [
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": { "name": name, "namespace": namespace },
            "rules": rules,
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": { "name": name, "namespace": namespace },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name },
            "subjects": [{ "kind": "ServiceAccount", "name": account, "namespace": namespace }],
        }),
    ]
}

/// The boot plane's ServiceAccount and rights: what the segment-facing process needs (Hosts and
/// their status, the bindings it checks, Events, its Lease and DHCP checkpoint, the Site's
/// heartbeat) and, of Secrets, only `get` in the appliance's own namespace, where the
/// controller hands it bootstrap data ([`crate::handoff`]).
fn boot_plane_rbac(namespace: &str) -> Vec<Value> {
    let mut objects = vec![
        json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": { "name": BOOT_PLANE_ACCOUNT, "namespace": namespace },
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": { "name": BOOT_PLANE_ACCOUNT },
            "rules": [
                { "apiGroups": ["siteboot.dev"], "resources": ["hosts"],
                  "verbs": ["get", "list", "watch"] },
                { "apiGroups": ["siteboot.dev"], "resources": ["hosts/status", "sites/status"],
                  "verbs": ["get", "update", "patch"] },
                { "apiGroups": ["siteboot.dev"], "resources": ["sites"],
                  "verbs": ["get", "list", "watch", "create"] },
                { "apiGroups": ["infrastructure.cluster.x-k8s.io"],
                  "resources": ["sitebootmachines"], "verbs": ["get"] },
                { "apiGroups": ["cluster.x-k8s.io"], "resources": ["machines"], "verbs": ["get"] },
                { "apiGroups": ["", "events.k8s.io"], "resources": ["events"],
                  "verbs": ["create", "patch"] },
            ],
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": { "name": BOOT_PLANE_ACCOUNT },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": BOOT_PLANE_ACCOUNT },
            "subjects": [{ "kind": "ServiceAccount", "name": BOOT_PLANE_ACCOUNT, "namespace": namespace }],
        }),
    ];
    objects.extend(namespaced_role(
        namespace,
        BOOT_PLANE_ACCOUNT,
        BOOT_PLANE_ACCOUNT,
        json!([
            { "apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
              "verbs": ["get", "list", "watch", "create", "update"] },
            { "apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "patch"] },
            { "apiGroups": [""], "resources": ["secrets"], "verbs": ["get"] },
        ]),
    ));
    objects
}

/// What `siteboot manifests` grants with no namespace named: bootstrap Secrets in `default`.
pub fn default_secret_access() -> SecretAccess {
    SecretAccess::Namespaces(vec!["default".to_owned()])
}

/// Multi-document YAML.
pub fn to_yaml<T: serde::Serialize>(docs: &[T]) -> String {
    docs.iter()
        .map(|d| serde_norway::to_string(d).expect("manifests serialize"))
        .collect::<Vec<_>>()
        .join("---\n")
}

/// What `scripts/build-image` tags its image as, without the tag.
pub const IMAGE_REPOSITORY: &str = "localhost/siteboot";

/// The image of this version, as `scripts/build-image` tags it: what the Deployments run unless
/// `siteboot manifests --image` names another (e.g. after pushing it to a registry).
pub fn default_image() -> String {
    format!("{IMAGE_REPOSITORY}:{}", env!("CARGO_PKG_VERSION"))
}

/// The user the image runs as (its /etc/passwd names it `siteboot`).
const IMAGE_USER: i64 = 65532;

/// Why the appliance's container needs what it asks for; an annotation on its Deployment, and
/// a label of the image (`scripts/build-image`).
const CAPABILITIES_WHY: &str = "NET_BIND_SERVICE and NET_RAW only: DHCP binds UDP 67 and TFTP UDP \
69, below 1024, and the ARP probe that confirms an on-link host before its ramdisk token is \
minted and before its bootstrap data leaves uses a packet socket; both as user 65532, through \
the binary's file capabilities (so allowPrivilegeEscalation must not be false: no_new_privs \
would ignore them). The DHCP sockets are plain UDP with SO_BROADCAST and SO_BINDTODEVICE; no \
NET_ADMIN. hostNetwork: DHCP and TFTP serve the site's L2 segment.";

/// One site's appliance: the values that differ between sites and installs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplianceSite {
    /// The site (a `Site`, a failure domain); also the label of the nodes the appliance runs on.
    pub site: String,
    /// The namespace of the appliance, its ServiceAccount and its leader Lease.
    pub namespace: String,
    pub image: String,
    /// The nodes' interface on the site's segment. Each replica serves at its own node's
    /// address there (the config sets no `address`).
    pub interface: String,
    /// The DHCP subnet, its pool (`first-last`) and router.
    pub subnet: String,
    pub pool: String,
    pub router: String,
}

impl ApplianceSite {
    /// The example site of `deploy/kubernetes/appliance.yaml`.
    pub fn example(image: &str) -> Self {
        Self {
            site: "rack-1".to_owned(),
            namespace: "siteboot-system".to_owned(),
            image: image.to_owned(),
            interface: "eth1".to_owned(),
            subnet: "10.99.0.0/24".to_owned(),
            pool: "10.99.0.100-10.99.0.199".to_owned(),
            router: "10.99.0.1".to_owned(),
        }
    }

    /// Every value that differs per install as a clusterctl variable with this value as its
    /// default (`${SITEBOOT_SITE:=rack-1}`), for `clusterctl init` to fill in. The namespace
    /// stays: clusterctl sets it on every object itself.
    fn as_clusterctl_variables(&self) -> Self {
        let var = |name: &str, default: &str| format!("${{SITEBOOT_{name}:={default}}}");
        Self {
            site: var("SITE", &self.site),
            namespace: self.namespace.clone(),
            image: var("IMAGE", &self.image),
            interface: var("INTERFACE", &self.interface),
            subnet: var("DHCP_SUBNET", &self.subnet),
            pool: var("DHCP_POOL", &self.pool),
            router: var("DHCP_ROUTER", &self.router),
        }
    }
}

/// The appliance of one site: its config (a ConfigMap) and a Deployment of two replicas on the
/// nodes labelled `siteboot.dev/site=<site>`, on the host network, as the image's non-root user.
/// The config names no `address`: each replica takes its node's on `interface`, so clients are
/// told the address of the replica that answered them, and a takeover needs no address moved.
/// The agent API's certificate is the TLS Secret `siteboot-<site>-agent-tls`, which the
/// operator creates (see `deploy/kubernetes/appliance.yaml`).
pub fn appliance(s: &ApplianceSite) -> Vec<Value> {
    let name = format!("siteboot-{}", s.site);
    let component = |component: &str| {
        json!({
            "app.kubernetes.io/name": "siteboot",
            "app.kubernetes.io/component": component,
            "siteboot.dev/site": s.site,
        })
    };
    let labels = component("boot-plane");
    let config_labels =
        json!({ "app.kubernetes.io/name": "siteboot", "siteboot.dev/site": s.site });
    let config = format!(
        "\
interface: {interface}
# No address: each replica serves at its own node's address on {interface} in the subnet below.
state_dir: /var/lib/siteboot
# SIGTERM: DHCP stops, the leader Lease is given back, transfers get this long to finish
# (keep terminationGracePeriodSeconds above it plus ~10s).
drain_timeout: 10s
dhcp:
  mode: full
  subnets:
    - subnet: {subnet}
      pools: [{pool}]
      router: {router}
tftp:
  max_transfers: 256
  max_transfers_per_address: 8
  max_timeout: 10s
http:
  port: 8080
  https_port: 8443
  tls:
    certificate: /etc/siteboot/tls/tls.crt
    key: /etc/siteboot/tls/tls.key
  root: /srv/siteboot
  max_connections: 1024
  max_connections_per_address: 16
  header_timeout: 10s
  body_timeout: 10s
  stall_timeout: 30s
profiles:
  ramdisk:
    kernel: ramdisk/vmlinuz
    initrds: [ramdisk/initrd.img]
    cmdline: console=ttyS0
kubernetes:
  site: {site}
  ramdisk_profile: ramdisk
  lease_namespace: {namespace}
",
        interface = s.interface,
        subnet = s.subnet,
        pool = s.pool,
        router = s.router,
        site = s.site,
        namespace = s.namespace,
    );
    // An HTTP probe's `host` is one address for every replica: `siteboot probe` asks the
    // address this replica serves at.
    let probe = |check: &str| {
        json!({
            "exec": { "command": [
                "/usr/bin/siteboot", "probe", "--config", "/etc/siteboot/siteboot.yaml", check,
            ] },
            // The probe's own deadline; the default (1 s) would count a busy node as dead.
            "timeoutSeconds": 5,
        })
    };
    // No Secret of any other namespace: the controller hands it bootstrap data in this one.
    // The grace period: drain_timeout (10s) plus DHCP's last batch and the Lease's release.
    let mut boot_plane = site_deployment(
        s,
        &name,
        &labels,
        (BOOT_PLANE_ACCOUNT, 25),
        json!({
            "containers": [{
                "name": "siteboot",
                "image": s.image,
                "args": ["serve", "--config", "/etc/siteboot/siteboot.yaml", "--role", "boot-plane"],
                "env": [{ "name": "POD_NAME",
                          "valueFrom": { "fieldRef": { "fieldPath": "metadata.name" } } }],
                "securityContext": {
                    "readOnlyRootFilesystem": true,
                    "capabilities": { "drop": ["ALL"], "add": ["NET_BIND_SERVICE", "NET_RAW"] },
                },
                "ports": [
                    { "name": "dhcp", "containerPort": 67, "protocol": "UDP" },
                    { "name": "pxe", "containerPort": 4011, "protocol": "UDP" },
                    { "name": "tftp", "containerPort": 69, "protocol": "UDP" },
                    { "name": "http", "containerPort": 8080, "protocol": "TCP" },
                    { "name": "agent", "containerPort": 8443, "protocol": "TCP" },
                ],
                // Ready once the Host cache has synced; alive while it answers at all.
                "readinessProbe": probe("readyz"),
                "livenessProbe": probe("healthz"),
                "volumeMounts": [
                    { "name": "config", "mountPath": "/etc/siteboot" },
                    { "name": "agent-tls", "mountPath": "/etc/siteboot/tls", "readOnly": true },
                    { "name": "state", "mountPath": "/var/lib/siteboot" },
                ],
            }],
            "volumes": [
                { "name": "config", "configMap": { "name": name } },
                { "name": "agent-tls",
                  "secret": { "secretName": format!("{name}-agent-tls"), "defaultMode": 0o440 } },
                // Per Pod: the leases come back from the site's checkpoint, images are fetched
                // again after a restart.
                { "name": "state", "emptyDir": {} },
            ],
        }),
    );
    boot_plane["metadata"]["annotations"] =
        json!({ "siteboot.dev/capabilities": CAPABILITIES_WHY });
    // The controller (`--role controller`): the reconcilers, as `siteboot`, apart from the boot
    // plane so that the process on the segment holds no right to tenants' Secrets. It binds no
    // socket and needs no capability; on the host network of a site node it takes its node's
    // address from the config as the boot plane does (virtual media URLs name it), and mounts
    // the boot plane's certificate (never its key), which BMCs are told to trust.
    let controller = format!("{name}-controller");
    let mut controller = site_deployment(
        s,
        &controller,
        &component("controller"),
        ("siteboot", 30),
        json!({
            "containers": [{
                "name": "controller",
                "image": s.image,
                "args": ["serve", "--config", "/etc/siteboot/siteboot.yaml", "--role", "controller"],
                "env": [{ "name": "POD_NAME",
                          "valueFrom": { "fieldRef": { "fieldPath": "metadata.name" } } }],
                "securityContext": {
                    "readOnlyRootFilesystem": true,
                    "capabilities": { "drop": ["ALL"] },
                },
                "volumeMounts": [
                    { "name": "config", "mountPath": "/etc/siteboot" },
                    { "name": "agent-tls", "mountPath": "/etc/siteboot/tls", "readOnly": true },
                ],
            }],
            "volumes": [
                { "name": "config", "configMap": { "name": name } },
                { "name": "agent-tls", "secret": {
                    "secretName": format!("{name}-agent-tls"), "defaultMode": 0o440,
                    "items": [{ "key": "tls.crt", "path": "tls.crt" }],
                } },
            ],
        }),
    );
    // Beside a boot plane replica: the media URLs it gives BMCs name its node's address.
    controller["spec"]["template"]["spec"]["affinity"]["podAffinity"] = json!({
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": { "matchLabels": labels },
            "topologyKey": "kubernetes.io/hostname",
        }],
    });
    vec![
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": name, "namespace": s.namespace, "labels": config_labels },
            "data": { "siteboot.yaml": config },
        }),
        boot_plane,
        controller,
    ]
}

/// A Deployment of two replicas of the site's appliance (a Lease elects the one that leads),
/// on two nodes labelled `siteboot.dev/site=<site>`, on the host network, as the image's
/// non-root user and `account` (ServiceAccount, seconds of termination grace); `pod` holds its
/// containers and volumes.
fn site_deployment(
    s: &ApplianceSite,
    name: &str,
    labels: &Value,
    (account, grace): (&str, u32),
    pod: Value,
) -> Value {
    let mut spec = json!({
        "serviceAccountName": account,
        "terminationGracePeriodSeconds": grace,
        "hostNetwork": true,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "nodeSelector": { "siteboot.dev/site": s.site },
        "affinity": { "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": { "matchLabels": labels },
                "topologyKey": "kubernetes.io/hostname",
            }],
        } },
        // fsGroup: the state and the Secret's files are the image user's group.
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": IMAGE_USER,
            "runAsGroup": IMAGE_USER,
            "fsGroup": IMAGE_USER,
        },
    });
    for (key, value) in pod.as_object().expect("a pod's fields") {
        spec[key] = value.clone();
    }
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": { "name": name, "namespace": s.namespace, "labels": labels },
        "spec": {
            "replicas": 2,
            "selector": { "matchLabels": labels },
            "template": { "metadata": { "labels": labels }, "spec": spec },
        },
    })
}

/// The header of `deploy/kubernetes/appliance.yaml`: what to do before applying it.
const APPLIANCE_HEADER: &str = "\
# The appliance for one site as two Deployments on the nodes labelled siteboot.dev/site=rack-1,
# on the host network (DHCP and TFTP need the site's L2 network; TFTP's per-transfer ports do
# not survive a Service). Apply crds.yaml and rbac.yaml first; adapt the config to the site.
# Generated by `siteboot manifests --output-dir deploy` (--image names another image).
#
# The image is what scripts/build-image builds (localhost/siteboot:<version>; push it to your
# registry and pass --image): the static siteboot binary, Debian's iPXE binaries under
# /usr/lib/ipxe, CA certificates. Put the ramdisk files under /srv/siteboot (a volume of yours).
# It runs as user 65532 with NET_BIND_SERVICE and NET_RAW only (the siteboot.dev/capabilities annotation
# says why). The state directory is per Pod: in Kubernetes mode the leases live on in the
# site's checkpoint (a ConfigMap), and cached images are fetched again after a restart.
#
# Two Deployments share the config: the boot plane (siteboot-rack-1, --role boot-plane, as the
# ServiceAccount siteboot-boot-plane, which reads no Secret outside this namespace) and the
# controller (siteboot-rack-1-controller, --role controller, as siteboot: the reconcilers, no
# socket; it hands each Machine's bootstrap data to the boot plane in this namespace). Keep BMC
# credentials and other Secrets out of this namespace.
#
# Replicas: two of each, on two nodes of the site (one boot plane leads: it answers DHCP; both
# serve TFTP and HTTP, and the standby follows the leader's leases; one controller reconciles). Each serves at its own
# node's address on eth1, which the config leaves unset: give each node one static address in
# the DHCP subnet, outside the pool (e.g. 10.99.0.2 and 10.99.0.3). A client is told the
# address of the replica that answered it; after a takeover, the new leader answers with its
# own. The probes run `siteboot probe`, which asks this replica's own address.
#
# The agent API (join secrets) is served over HTTPS on 8443 with the certificate in the TLS
# Secret siteboot-rack-1-agent-tls, shared by both replicas (a ramdisk pins the certificate of
# the replica that served its boot script, by the fingerprint on its command line, so no CA or
# DNS name is needed). Create it before applying, e.g. with a self-signed certificate:
#   openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \\
#     -subj /CN=siteboot-rack-1 -keyout tls.key -out tls.crt
#   kubectl -n siteboot-system create secret tls siteboot-rack-1-agent-tls --cert tls.crt --key tls.key
# Replacing the certificate changes the fingerprint: ramdisks booted before must boot again.
#
# File descriptors: a Pod cannot set RLIMIT_NOFILE; it inherits the container runtime's
# (containerd 2 and Docker 25+: soft 1024, hard 524288; older: 1048576). siteboot raises its
# soft limit to the hard one at start and refuses to start, naming http.max_connections, if
# the hard limit cannot hold 2 x http.max_connections + 2 x tftp.max_transfers + 256 (2816 with
# the defaults below). If yours is lower, raise it in the runtime (containerd: LimitNOFILE in
# its systemd unit, or the default_ulimits of CRI-O) or lower http.max_connections.
";

fn namespace(name: &str) -> Value {
    json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name } })
}

/// `deploy/kubernetes/appliance.yaml`: the site's namespace and appliance.
pub fn appliance_with_namespace(site: &ApplianceSite) -> String {
    let mut objects = vec![namespace(&site.namespace)];
    objects.extend(appliance(site));
    format!("{APPLIANCE_HEADER}{}", to_yaml(&objects))
}

/// The provider's name in clusterctl (`clusterctl init --infrastructure siteboot`) with its type
/// prefix: the value of the provider label and the folder of its local repository.
pub const CLUSTERCTL_PROVIDER: &str = "infrastructure-siteboot";

/// The workload cluster template of the clusterctl release: a kubeadm control plane
/// (KubeadmControlPlane, the default control plane provider of `clusterctl init`) and a
/// MachineDeployment of workers joined by siteboot's bootstrap provider, all on siteboot hosts.
const CLUSTER_TEMPLATE: &str = include_str!("manifests/cluster-template.yaml");
/// The same on a ClusterClass (`--flavor clusterclass`), and the class, which clusterctl adds
/// to that flavor's output by the class's name.
const CLUSTER_TEMPLATE_CLUSTERCLASS: &str =
    include_str!("manifests/cluster-template-clusterclass.yaml");
const CLUSTERCLASS: &str = include_str!("manifests/clusterclass-siteboot-kubeadm.yaml");
/// The control plane's `kubeadmConfigSpec`, one text for both flavors: each template has
/// [`KUBEADM_CONFIG_LINE`] where it goes.
const CONTROL_PLANE_KUBEADM_CONFIG: &str =
    include_str!("manifests/control-plane-kubeadm-config.yaml");
const KUBEADM_CONFIG_LINE: &str = "kubeadmConfigSpec: {} # control-plane-kubeadm-config.yaml";

/// `template` with its [`KUBEADM_CONFIG_LINE`] replaced by the control plane's
/// `kubeadmConfigSpec`, indented under it.
fn with_control_plane_config(template: &str) -> String {
    let mut out = String::with_capacity(template.len() + 2 * CONTROL_PLANE_KUBEADM_CONFIG.len());
    for line in template.lines() {
        match line.strip_suffix(KUBEADM_CONFIG_LINE) {
            Some(indent) if indent.trim().is_empty() => {
                out.push_str(indent);
                out.push_str("kubeadmConfigSpec:\n");
                for spec_line in CONTROL_PLANE_KUBEADM_CONFIG.lines() {
                    if !spec_line.is_empty() {
                        out.push_str(indent);
                        out.push_str("  ");
                        out.push_str(spec_line);
                    }
                    out.push('\n');
                }
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// A clusterctl release: the files clusterctl reads from a provider repository, in the folder
/// `<repository>/infrastructure-siteboot/<version>/` of a local one.
pub struct ClusterctlRelease {
    /// `v<crate version>`.
    pub version: String,
    /// (file name, contents).
    pub files: Vec<(&'static str, String)>,
}

/// The clusterctl release of this version: `metadata.yaml` (the release series and the Cluster
/// API contract it implements), `infrastructure-components.yaml` (the CRDs, the RBAC, and the
/// example site's appliance with clusterctl variables for what differs per install, every
/// object labelled `cluster.x-k8s.io/provider: infrastructure-siteboot`) and
/// `cluster-template.yaml` (for `clusterctl generate cluster`), `cluster-template-clusterclass.yaml`
/// with `clusterclass-siteboot-kubeadm.yaml` (for `--flavor clusterclass`).
///
/// clusterctl puts every namespaced object in one target namespace, so the per-namespace Roles
/// for bootstrap data Secrets cannot be expressed: the appliance gets `get`/`create` on Secrets
/// in every namespace here, as with `siteboot manifests --all-namespaces`.
pub fn clusterctl_release(image: &str) -> ClusterctlRelease {
    let site = ApplianceSite::example(image).as_clusterctl_variables();
    let mut objects = vec![namespace(&site.namespace)];
    objects.extend(crds().iter().map(|crd| serde_json::to_value(crd).expect("CRDs serialize")));
    objects.extend(admission_policy());
    objects.extend(rbac(&site.namespace, &SecretAccess::Cluster));
    objects.extend(appliance(&site));
    for object in &mut objects {
        object["metadata"]["labels"]["cluster.x-k8s.io/provider"] = json!(CLUSTERCTL_PROVIDER);
    }
    let metadata = format!(
        "\
# Which Cluster API contract each release series of siteboot implements.
apiVersion: clusterctl.cluster.x-k8s.io/v1alpha3
kind: Metadata
releaseSeries:
  - major: {}
    minor: {}
    contract: v1beta2
",
        env!("CARGO_PKG_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MINOR"),
    );
    ClusterctlRelease {
        version: format!("v{}", env!("CARGO_PKG_VERSION")),
        files: vec![
            ("metadata.yaml", metadata),
            ("infrastructure-components.yaml", to_yaml(&objects)),
            ("cluster-template.yaml", with_control_plane_config(CLUSTER_TEMPLATE)),
            ("cluster-template-clusterclass.yaml", CLUSTER_TEMPLATE_CLUSTERCLASS.to_owned()),
            ("clusterclass-siteboot-kubeadm.yaml", with_control_plane_config(CLUSTERCLASS)),
        ],
    }
}

/// Every file `siteboot manifests --output-dir DIR` writes, by its path under DIR: `crds.yaml`,
/// `rbac.yaml` (for the appliance in `namespace`, reading bootstrap data Secrets as `secrets`
/// says), `kubernetes/appliance.yaml` (the example site, in `namespace`, running `image`) and
/// the clusterctl release under `clusterctl/infrastructure-siteboot/<version>/`.
pub fn deploy_files(
    namespace: &str,
    secrets: &SecretAccess,
    image: &str,
) -> Vec<(PathBuf, String)> {
    let release = clusterctl_release(image);
    let release_dir = Path::new("clusterctl").join(CLUSTERCTL_PROVIDER).join(&release.version);
    let site = ApplianceSite { namespace: namespace.to_owned(), ..ApplianceSite::example(image) };
    let mut files = vec![
        ("crds.yaml".into(), crds_yaml()),
        ("rbac.yaml".into(), to_yaml(&rbac(namespace, secrets))),
        ("kubernetes/appliance.yaml".into(), appliance_with_namespace(&site)),
    ];
    files.extend(release.files.into_iter().map(|(name, text)| (release_dir.join(name), text)));
    files
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
        let host_labels = crds[0].metadata.labels.as_ref().unwrap();
        assert!(host_labels.contains_key("clusterctl.cluster.x-k8s.io/move-hierarchy"));
        let host = serde_json::to_value(&crds[0]).unwrap();
        let conditions = &host["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
            ["properties"]["conditions"];
        assert_eq!(conditions["x-kubernetes-list-type"], "map");
        let template = serde_json::to_value(&crds[3]).unwrap();
        let spec = &template["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["properties"]["template"]["properties"]["spec"];
        // Left to the admission policy, which lets ClusterClass dry-runs through.
        assert!(spec.get("x-kubernetes-validations").is_none(), "{spec}");
    }

    #[test]
    fn secrets_are_readable_only_where_machines_are_served() {
        // Beyond its own namespace (`sys`), where bootstrap data is handed to the boot plane;
        // the operators' role is bound by operators, in pool namespaces only.
        let grants = |access| {
            rbac("sys", &access)
                .into_iter()
                .filter(|o| o["metadata"]["name"] != HOST_OPERATOR_ROLE)
                .filter(|o| o.to_string().contains("\"secrets\""))
                .map(|o| format!("{} {}", o["kind"], o["metadata"]["namespace"]))
                .filter(|grant| grant != r#""Role" "sys""#)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            grants(SecretAccess::Namespaces(vec!["a".into(), "b".into()])),
            [r#""Role" "a""#, r#""Role" "b""#]
        );
        assert_eq!(grants(SecretAccess::Cluster), [r#""ClusterRole" null"#]);
    }

    /// The committed manifests are what this code generates: regenerate them with
    /// `siteboot manifests --output-dir deploy` after changing a CRD type, the RBAC, the
    /// appliance, the cluster template or the version.
    #[test]
    fn committed_manifests_do_not_drift() {
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        let files = deploy_files("siteboot-system", &default_secret_access(), &default_image());
        for (file, generated) in files {
            let committed = std::fs::read_to_string(deploy.join(&file)).unwrap_or_default();
            assert!(
                committed == generated,
                "deploy/{} is out of date: run `siteboot manifests --output-dir deploy`",
                file.display()
            );
        }
    }

    /// Every `${...}` of the clusterctl files, as clusterctl's variable syntax reads them.
    fn variables(text: &str) -> Vec<&str> {
        text.split("${").skip(1).map(|rest| &rest[..rest.find('}').unwrap()]).collect()
    }

    #[test]
    fn clusterctl_components_label_every_object_and_default_every_variable() {
        let release = clusterctl_release("registry.example/siteboot:1");
        assert_eq!(release.version, format!("v{}", env!("CARGO_PKG_VERSION")));
        let components = &release.files[1].1;
        let mut kinds = Vec::new();
        for document in serde_norway::Deserializer::from_str(components) {
            let object: Value = serde::Deserialize::deserialize(document).unwrap();
            assert_eq!(
                object["metadata"]["labels"]["cluster.x-k8s.io/provider"], CLUSTERCTL_PROVIDER,
                "{} {}",
                object["kind"], object["metadata"]["name"]
            );
            kinds.push(object["kind"].as_str().unwrap().to_owned());
        }
        assert_eq!(kinds.iter().filter(|k| *k == "Namespace").count(), 1, "clusterctl wants one");
        for kind in ["CustomResourceDefinition", "ClusterRole", "ConfigMap", "Deployment"] {
            assert!(kinds.iter().any(|k| k == kind), "no {kind}");
        }
        // No cert-manager objects or CA injection: clusterctl demands cert-manager, siteboot
        // needs none of it.
        assert!(!components.contains("cert-manager"));
        // Nothing per namespace but the provider's own (clusterctl moves namespaced objects).
        assert!(!components.contains("siteboot-bootstrap-data"));
        // `clusterctl init` needs nobody to set a variable: each has a default.
        let variables = variables(components);
        assert!(variables.contains(&"SITEBOOT_IMAGE:=registry.example/siteboot:1"));
        assert!(variables.contains(&"SITEBOOT_SITE:=rack-1"));
        for variable in variables {
            assert!(variable.starts_with("SITEBOOT_") && variable.contains(":="), "{variable}");
        }
        // No `$NAME`: clusterctl's envsubst would substitute it too (a regex's `$` is fine).
        for (at, _) in components.match_indices('$') {
            let next = components[at + 1..].chars().next().unwrap();
            assert!(next == '{' || !(next.is_ascii_alphanumeric() || next == '_'), "at {at}");
        }
        let metadata: Value = serde_norway::from_str(&release.files[0].1).unwrap();
        assert_eq!(metadata["releaseSeries"][0]["contract"], "v1beta2");
    }

    /// Both flavors' control planes get the one `kubeadmConfigSpec`, as YAML under their spec.
    #[test]
    fn both_flavors_carry_the_control_plane_s_kubeadm_config() {
        let release = clusterctl_release("img:1");
        let file = |name: &str| &release.files.iter().find(|(n, _)| *n == name).unwrap().1;
        let spec: Value = serde_norway::from_str(CONTROL_PLANE_KUBEADM_CONFIG).unwrap();
        let mut seen = Vec::new();
        for (name, kind) in [
            ("cluster-template.yaml", "KubeadmControlPlane"),
            ("clusterclass-siteboot-kubeadm.yaml", "KubeadmControlPlaneTemplate"),
        ] {
            assert!(!file(name).contains(KUBEADM_CONFIG_LINE), "{name}");
            for document in serde_norway::Deserializer::from_str(file(name)) {
                let object: Value = serde::Deserialize::deserialize(document).unwrap();
                if object["kind"] == kind {
                    let in_spec = match kind {
                        "KubeadmControlPlane" => &object["spec"]["kubeadmConfigSpec"],
                        _ => &object["spec"]["template"]["spec"]["kubeadmConfigSpec"],
                    };
                    assert_eq!(in_spec, &spec, "{name}");
                    seen.push(name);
                }
            }
        }
        assert_eq!(seen.len(), 2);
        // cloud-init reads kubeadm's bootstrap data as a Jinja template, clusterctl substitutes
        // every dollar sign: the files' contents must hold neither.
        let text = CONTROL_PLANE_KUBEADM_CONFIG.replace("{{ ds.meta_data.provider_id }}", "");
        for jinja in ["{{", "{%", "{#"] {
            assert!(!text.contains(jinja), "{jinja}");
        }
        assert_eq!(text.matches('$').collect::<Vec<_>>(), ["$"]);
        assert!(text.contains("${SITEBOOT_ETCD_IMAGE_TAG:=3.6.16-0}"));
    }

    #[test]
    fn each_replica_serves_at_its_own_node_s_address() {
        let objects = appliance(&ApplianceSite::example("img:1"));
        let config = objects[0]["data"]["siteboot.yaml"].as_str().unwrap();
        let config: Value = serde_norway::from_str(config).unwrap();
        assert_eq!(config["interface"], "eth1");
        assert!(config.get("address").is_none(), "one address for both replicas: {config}");
        let deployment = &objects[1]["spec"];
        assert_eq!(deployment["replicas"], 2);
        assert_eq!(objects[2]["spec"]["replicas"], 2, "a standby controller too");
        let container = &deployment["template"]["spec"]["containers"][0];
        for probe in ["readinessProbe", "livenessProbe"] {
            let command = &container[probe]["exec"]["command"];
            assert_eq!(command[1], "probe", "{probe} asks another replica's address: {command}");
        }
        assert!(!appliance_with_namespace(&ApplianceSite::example("img:1")).contains("host:"));
    }

    #[test]
    fn the_appliance_runs_unprivileged_but_for_binding_ports_below_1024() {
        let objects = appliance(&ApplianceSite::example("img:1"));
        let pod = &objects[1]["spec"]["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
        assert_eq!(pod["securityContext"]["runAsUser"], IMAGE_USER);
        let container = &pod["containers"][0];
        assert_eq!(container["image"], "img:1");
        assert_eq!(container["securityContext"]["capabilities"]["drop"], json!(["ALL"]));
        assert_eq!(
            container["securityContext"]["capabilities"]["add"],
            json!(["NET_BIND_SERVICE", "NET_RAW"])
        );
        // no_new_privs would drop the binary's file capability.
        assert!(container["securityContext"].get("allowPrivilegeEscalation").is_none());
        // The controller needs no capability at all.
        let controller = &objects[2]["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(controller["securityContext"]["capabilities"], json!({ "drop": ["ALL"] }));
    }

    #[test]
    fn the_boot_plane_runs_apart_and_may_read_no_secret_beyond_the_appliance_s_namespace() {
        let objects = appliance(&ApplianceSite::example("img:1"));
        let account =
            |i: usize| objects[i]["spec"]["template"]["spec"]["serviceAccountName"].clone();
        let args =
            |i: usize| objects[i]["spec"]["template"]["spec"]["containers"][0]["args"].clone();
        assert_eq!(
            (account(1), args(1)[4].clone()),
            (json!(BOOT_PLANE_ACCOUNT), json!("boot-plane"))
        );
        assert_eq!((account(2), args(2)[4].clone()), (json!("siteboot"), json!("controller")));
        let tls = &objects[2]["spec"]["template"]["spec"]["volumes"][1]["secret"]["items"];
        assert_eq!(tls, &json!([{ "key": "tls.crt", "path": "tls.crt" }]), "never the key");
        let beside = &objects[2]["spec"]["template"]["spec"]["affinity"]["podAffinity"];
        let with = &beside["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"];
        assert_eq!(with["matchLabels"], objects[1]["spec"]["selector"]["matchLabels"], "{beside}");
        for secrets in [SecretAccess::Cluster, default_secret_access()] {
            let grants: Vec<String> = rbac("siteboot-system", &secrets)
                .into_iter()
                .filter(|o| o.to_string().contains(&format!("\"{BOOT_PLANE_ACCOUNT}\"")))
                .filter(|o| o.to_string().contains("\"secrets\""))
                .map(|o| format!("{} {} {}", o["kind"], o["metadata"]["namespace"], o["rules"]))
                .collect();
            assert_eq!(
                grants,
                [
                    r#""Role" "siteboot-system" [{"apiGroups":["coordination.k8s.io"],"resources":["leases"],"verbs":["get","list","watch","create","update"]},{"apiGroups":[""],"resources":["configmaps"],"verbs":["get","create","patch"]},{"apiGroups":[""],"resources":["secrets"],"verbs":["get"]}]"#
                ]
            );
        }
    }
}
