//! A tenant's `<cluster>-kubeconfig` is data, against the real CAPI core manager: a tenant who may
//! write Secrets in its own namespace writes one whose user runs a command (`exec`). siteboot, in
//! Kubernetes mode as its own ServiceAccount, must refuse it by name on the SitebootConfig and
//! never run the command.
//!
//! Needs `scripts/build-test-peers` and root (the lab namespace), like the provider tests.

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};
use siteboot_tests::kube::bootstrap::{self, BOOTSTRAP};
use siteboot_tests::kube::capi;
use siteboot_tests::provider::{NS, ProviderLab};
use siteboot_tests::wait;

const CLUSTER: &str = "c";
const TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exec_kubeconfig_is_refused_and_its_command_never_runs() {
    let lab = ProviderLab::start(0, |_| {}).await.unwrap();
    let env = &lab.env;
    env.install_crd_yaml(capi::TEST_MACHINE_CRDS).await.unwrap();
    capi::create_cluster(env, NS, CLUSTER, None).await.unwrap();

    // The tenant rewrites its kubeconfig: same apiserver and CA, the user an exec plugin.
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let mut kubeconfig: Value = serde_norway::from_str(env.admin_kubeconfig()).unwrap();
    kubeconfig["users"][0]["user"] = json!({ "exec": {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": "/bin/sh",
        "args": ["-c", format!("touch {}", marker.display())],
        "interactiveMode": "Never",
    }});
    let value = serde_norway::to_string(&kubeconfig).unwrap();
    let secrets: Api<Secret> = Api::namespaced(env.client(), NS);
    let patch = json!({ "stringData": { "value": value } });
    let name = format!("{CLUSTER}-kubeconfig");
    secrets.patch(&name, &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
    bootstrap::create_workers(env, NS, CLUSTER, "workers", 1, json!({})).await.unwrap();

    let configs = env.api(BOOTSTRAP, "SitebootConfig", Some(NS));
    let refused = wait::for_async("a SitebootConfig refusing the kubeconfig", TIMEOUT, || async {
        let list = configs.list(&ListParams::default()).await.ok()?.items;
        let conditions = list.iter().flat_map(|c| c.data["status"]["conditions"].as_array());
        conditions.flatten().find(|c| c["reason"] == "InvalidKubeconfig").cloned()
    })
    .await;
    let condition = match refused {
        Ok(condition) => condition,
        Err(e) => panic!("{e:#}\n{}", lab.describe().await),
    };
    assert!(!marker.exists(), "siteboot ran the tenant's command: {condition}");
    let message = condition["message"].as_str().unwrap_or_default();
    assert!(message.contains("users[0].user.exec is not accepted"), "{condition}");
}
