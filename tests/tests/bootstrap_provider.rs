//! The Cluster API bootstrap provider (`SitebootConfig`) against the real CAPI core manager:
//! siteboot in Kubernetes mode as its own ServiceAccount with the RBAC it ships, a Cluster whose
//! control plane (and workload cluster) is the test apiserver itself, and a MachineDeployment
//! whose bootstrap template is a SitebootConfigTemplate and whose infrastructure is a minimal
//! test kind the test plays the provider for. No host boots here: the data is checked as
//! written; a real kubelet joining from it is `bootstrap_join.rs`.
//!
//! Needs `scripts/build-test-peers` and root (the lab namespace), like the provider tests.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use siteboot_tests::kube::bootstrap::{
    self, BOOTSTRAP, bootstrap_kubeconfig, condition, secret_text as data_of,
};
use siteboot_tests::kube::capi::{self, CAPI, CLUSTER_NAME_LABEL, wait_gone, wait_object};
use siteboot_tests::provider::{NS, ProviderLab};

const CLUSTER: &str = "c";
const TTL: u64 = 600;
const TIMEOUT: Duration = Duration::from_secs(60);

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sitebootconfig_data_token_lifecycle_and_pause() {
    let lab = ProviderLab::start(0, |_| {}).await.unwrap();
    let env = &lab.env;
    env.install_crd_yaml(capi::TEST_MACHINE_CRDS).await.unwrap();
    capi::create_cluster(env, NS, CLUSTER, None).await.unwrap();

    let configs = env.api(BOOTSTRAP, "SitebootConfig", Some(NS));
    let machines = env.api(CAPI, "Machine", Some(NS));
    let secrets: Api<Secret> = Api::namespaced(env.client(), NS);
    let tokens: Api<Secret> = Api::namespaced(env.client(), "kube-system");

    let config_spec = json!({
        "nodeLabels": { "example.com/pool": "workers" },
        "nodeTaints": [{ "key": "dedicated", "value": "ml", "effect": "NoSchedule" }],
        "preCommands": ["echo 'it''s' \"$HOME\""],
        "tokenTTLSeconds": TTL,
    });
    bootstrap::create_workers(env, NS, CLUSTER, "workers", 2, config_spec).await.unwrap();

    // Both Machines get their SitebootConfig's data Secret through the contract.
    let found = bootstrap::machines_with_data(env, NS, 2, TIMEOUT).await;
    let machine_list = match found {
        Ok(list) => list,
        Err(e) => panic!("{e:#}\n{}", describe(&lab).await),
    };
    let mut by_config = BTreeMap::new();
    for machine in &machine_list {
        let config_name = machine.data["spec"]["bootstrap"]["configRef"]["name"].as_str().unwrap();
        assert_eq!(
            machine.data["spec"]["bootstrap"]["dataSecretName"],
            json!(config_name),
            "CAPI copied status.dataSecretName (the config's own name)"
        );
        by_config.insert(config_name.to_owned(), machine.name_any());
    }
    let mut token_secrets = BTreeMap::new();
    for (config_name, machine_name) in &by_config {
        let config = configs.get(config_name).await.unwrap();
        assert_eq!(config.data["status"]["initialization"]["dataSecretCreated"], json!(true));
        assert_eq!(config.data["status"]["dataSecretName"], json!(config_name));
        assert_eq!(condition(&config, "Ready"), (json!("True"), json!("DataSecretAvailable")));
        assert_eq!(condition(&config, "DataSecretAvailable").0, json!("True"));
        assert_eq!(condition(&config, "Paused"), (json!("False"), json!("NotPaused")));
        assert!(
            config
                .owner_references()
                .iter()
                .any(|o| o.kind == "Machine" && &o.name == machine_name)
        );

        let data = secrets.get(config_name).await.unwrap();
        assert_eq!(data.type_.as_deref(), Some("cluster.x-k8s.io/secret"));
        assert_eq!(data.labels().get(CLUSTER_NAME_LABEL).map(String::as_str), Some(CLUSTER));
        assert_eq!(data_of(&data, "format"), "cloud-config");
        let owner = data.owner_references().iter().find(|o| o.controller == Some(true)).unwrap();
        assert_eq!(
            (owner.kind.as_str(), Some(&owner.uid)),
            ("SitebootConfig", config.uid().as_ref())
        );
        let value = data_of(&data, "value");
        assert!(value.starts_with("## template: jinja\n#cloud-config\n"), "{value}");
        assert!(value.contains("{{ ds.meta_data.provider_id }}"));

        let id = config.data["status"]["tokenId"].as_str().expect("status.tokenId").to_owned();
        let token = tokens.get(&format!("bootstrap-token-{id}")).await.unwrap();
        assert_eq!(token.type_.as_deref(), Some("bootstrap.kubernetes.io/token"));
        assert_eq!(data_of(&token, "token-id"), id);
        assert_eq!(
            data_of(&token, "auth-extra-groups"),
            "system:bootstrappers:kubeadm:default-node-token"
        );
        assert_eq!(data_of(&token, "usage-bootstrap-authentication"), "true");
        assert_eq!(data_of(&token, "usage-bootstrap-signing"), "true");
        let expiration: k8s_openapi::jiff::Timestamp =
            data_of(&token, "expiration").parse().unwrap();
        let left = expiration.as_second() as u64 - unix_now().min(expiration.as_second() as u64);
        assert!(left > TTL / 2 && left <= TTL + 5, "the token expires in {left} s, TTL {TTL} s");
        let secret_half = data_of(&token, "token-secret");
        assert_eq!(secret_half.len(), 16);
        // The data carries the token; the config's status does not.
        let kubeconfig: Value =
            serde_norway::from_str(&bootstrap_kubeconfig(&value).unwrap()).unwrap();
        assert_eq!(kubeconfig["users"][0]["user"]["token"], json!(format!("{id}.{secret_half}")));
        assert!(!config.data["status"].to_string().contains(&secret_half));
        token_secrets.insert(config_name.clone(), (id, secret_half));
    }
    // The node-bootstrap RBAC a kubeadm cluster has, in the workload cluster.
    let bindings: Api<ClusterRoleBinding> = Api::all(env.client());
    for (name, role, group) in [
        (
            "kubeadm:kubelet-bootstrap",
            "system:node-bootstrapper",
            "system:bootstrappers:kubeadm:default-node-token",
        ),
        (
            "kubeadm:node-autoapprove-bootstrap",
            "system:certificates.k8s.io:certificatesigningrequests:nodeclient",
            "system:bootstrappers:kubeadm:default-node-token",
        ),
        (
            "kubeadm:node-autoapprove-certificate-rotation",
            "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient",
            "system:nodes",
        ),
    ] {
        let binding = bindings.get(name).await.unwrap();
        assert_eq!(binding.role_ref.name, role);
        let subjects = binding.subjects.unwrap_or_default();
        assert!(subjects.iter().any(|s| s.kind == "Group" && s.name == group), "{name}");
    }

    // Machine A joins (its Node appears, CAPI sets the nodeRef): its token goes.
    let mut names = by_config.iter();
    let (config_a, machine_a) = names.next().unwrap();
    let (config_b, _) = names.next().unwrap();
    join(env, &machines, machine_a).await;
    let (id_a, _) = &token_secrets[config_a];
    wait_gone(&tokens, &format!("bootstrap-token-{id_a}"), TIMEOUT).await.unwrap();
    assert_eq!(condition(&configs.get(config_a).await.unwrap(), "Ready").0, json!("True"));

    // Paused: deleting config B changes nothing, not even its token.
    let clusters = env.api(CAPI, "Cluster", Some(NS));
    let pause = |paused: bool| Patch::Merge(json!({ "spec": { "paused": paused } }));
    clusters.patch(CLUSTER, &PatchParams::default(), &pause(true)).await.unwrap();
    wait_object(&configs, config_b, "Paused", TIMEOUT, |c| {
        condition(c, "Paused").0 == json!("True")
    })
    .await
    .unwrap();
    configs.delete(config_b, &DeleteParams::default()).await.unwrap();
    let (id_b, secret_b) = &token_secrets[config_b];
    tokio::time::sleep(Duration::from_secs(5)).await;
    let held = configs.get(config_b).await.unwrap();
    assert!(
        held.metadata.deletion_timestamp.is_some()
            && held.finalizers().iter().any(|f| f.starts_with("sitebootconfig."))
    );
    tokens.get(&format!("bootstrap-token-{id_b}")).await.expect("the token stays while paused");

    // Unpaused: the deletion finishes, and takes the token with it.
    clusters.patch(CLUSTER, &PatchParams::default(), &pause(false)).await.unwrap();
    wait_gone(&tokens, &format!("bootstrap-token-{id_b}"), TIMEOUT).await.unwrap();
    wait_gone(&configs, config_b, TIMEOUT).await.unwrap();

    // The token's secret half never left the workload cluster and the data Secrets.
    let events =
        Api::<Event>::namespaced(env.client(), NS).list(&ListParams::default()).await.unwrap();
    let events = serde_json::to_string(&events.items).unwrap();
    assert!(events.contains("DataSecretAvailable"), "the data Secret was announced");
    for (_, secret_half) in token_secrets.values() {
        assert!(!events.contains(secret_half.as_str()), "a token secret in an Event");
        assert!(!lab.siteboot.log().contains(secret_half.as_str()), "a token secret in the log");
    }
    assert!(!lab.siteboot.log().contains(secret_b.as_str()));
}

/// Plays the infrastructure provider and the kubelet for `machine`: providerID, provisioned,
/// a Node with that providerID; waits for CAPI's nodeRef.
async fn join(env: &siteboot_tests::kube::KubeEnv, machines: &Api<DynamicObject>, machine: &str) {
    let m = machines.get(machine).await.unwrap();
    let provider_id = bootstrap::provision(env, NS, &m).await.unwrap();
    let infra = m.data["spec"]["infrastructureRef"]["name"].as_str().unwrap().to_owned();
    let node: Node = serde_json::from_value(json!({
        "metadata": { "name": infra }, "spec": { "providerID": provider_id },
    }))
    .unwrap();
    Api::<Node>::all(env.client()).create(&PostParams::default(), &node).await.unwrap();
    wait_object(machines, machine, "a nodeRef", TIMEOUT, |m| {
        m.data["status"]["nodeRef"]["name"] == json!(infra)
    })
    .await
    .unwrap();
}

/// The SitebootConfigs, one line each, for a failure message.
async fn describe(lab: &ProviderLab) -> String {
    let configs = lab.env.api(BOOTSTRAP, "SitebootConfig", Some(NS));
    let list = configs.list(&ListParams::default()).await.map(|l| l.items).unwrap_or_default();
    let lines: Vec<String> = list
        .iter()
        .map(|c| {
            format!(
                "SitebootConfig {} ready={:?} status={}",
                c.name_any(),
                condition(c, "Ready"),
                c.data["status"]
            )
        })
        .collect();
    format!("{}\nsiteboot log:\n{}", lines.join("\n"), lab.siteboot.log())
}
