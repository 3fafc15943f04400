//! Smoke tests of the Kubernetes + Cluster API test environment: the real CAPI core manager drives
//! Machines whose infrastructure is a minimal test CRD that the test itself plays the provider
//! for (it sets providerID and `status.initialization.provisioned`, and creates the Nodes).
//!
//! Needs `scripts/build-test-peers` (see docs/testing.md); fails with that hint otherwise.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use siteboot_tests::kube::KubeEnv;
use siteboot_tests::kube::capi::{self, CAPI, CLUSTER_NAME_LABEL, wait_gone, wait_object};
use siteboot_tests::wait;

const INFRA_GROUP: &str = "infrastructure.cluster.x-k8s.io";
const INFRA: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";
const TIMEOUT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_lifecycle() {
    let env = KubeEnv::start().await.expect("starting the environment");
    // Panicking while `env` is alive prints the components' logs.
    if let Err(err) = machine_lifecycle_steps(&env).await {
        panic!("{err:#}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_deployment_scale() {
    let env = KubeEnv::start().await.expect("starting the environment");
    if let Err(err) = machine_deployment_steps(&env).await {
        panic!("{err:#}");
    }
}

async fn machine_lifecycle_steps(env: &KubeEnv) -> Result<()> {
    let ns = "smoke";
    let cluster = workload_cluster(env, ns, "smoke").await?;
    let machines = env.api(CAPI, "Machine", Some(ns));
    let test_machines = env.api(INFRA, "TestMachine", Some(ns));
    let nodes = Api::<Node>::all(env.client());

    // The validating webhook is called: a Machine needs bootstrap data or a config.
    let mut invalid = machine(&cluster, "invalid", "invalid");
    invalid.data["spec"]["bootstrap"] = json!({});
    match machines.create(&PostParams::default(), &invalid).await {
        Err(kube::Error::Api(status))
            if status
                .message
                .contains("spec.bootstrap.dataSecretName or spec.bootstrap.configRef") => {}
        other => {
            bail!("expected the Machine webhook to reject a Machine without bootstrap: {other:?}")
        }
    }

    test_machines.create(&PostParams::default(), &test_machine("worker-0")).await?;
    machines.create(&PostParams::default(), &machine(&cluster, "worker-0", "worker-0")).await?;
    let node = provision(env, ns, &cluster, "worker-0").await?;

    // The mutating webhook defaulted the Machine.
    let worker = machines.get("worker-0").await?;
    ensure!(
        worker.data["spec"]["deletion"]["nodeDeletionTimeoutSeconds"] == json!(10),
        "nodeDeletionTimeoutSeconds not defaulted: {}",
        worker.data["spec"]
    );
    // Conversion goes through the manager's /convert: the v1beta1 view has an apiVersion in
    // infrastructureRef, which v1beta2 does not store.
    let v1beta1 = env.api("cluster.x-k8s.io/v1beta1", "Machine", Some(ns)).get("worker-0").await?;
    ensure!(
        v1beta1.data["spec"]["infrastructureRef"]["apiVersion"] == json!(INFRA),
        "v1beta1 view not converted: {}",
        v1beta1.data["spec"]["infrastructureRef"]
    );

    machines.delete("worker-0", &DeleteParams::default()).await?;
    wait_gone(&test_machines, "worker-0", TIMEOUT).await?;
    wait_gone(&nodes, &node, TIMEOUT).await?;
    wait_gone(&machines, "worker-0", TIMEOUT).await?;
    Ok(())
}

async fn machine_deployment_steps(env: &KubeEnv) -> Result<()> {
    let ns = "smoke-md";
    let cluster = workload_cluster(env, ns, "smoke-md").await?;
    let machines = env.api(CAPI, "Machine", Some(ns));
    let test_machines = env.api(INFRA, "TestMachine", Some(ns));
    let nodes = Api::<Node>::all(env.client());
    let deployments = env.api(CAPI, "MachineDeployment", Some(ns));

    let template: DynamicObject = serde_json::from_value(json!({
        "apiVersion": INFRA, "kind": "TestMachineTemplate",
        "metadata": { "name": "workers" },
        "spec": { "template": { "spec": { "note": "cloned by the MachineSet" } } },
    }))?;
    env.api(INFRA, "TestMachineTemplate", Some(ns))
        .create(&PostParams::default(), &template)
        .await?;
    // No selector, template labels or rollout strategy: the defaulting webhook fills them in.
    let deployment: DynamicObject = serde_json::from_value(json!({
        "apiVersion": CAPI, "kind": "MachineDeployment",
        "metadata": { "name": "workers" },
        "spec": {
            "clusterName": cluster,
            "replicas": 2,
            "template": { "spec": {
                "clusterName": cluster,
                "bootstrap": { "dataSecretName": bootstrap_secret(&cluster) },
                "infrastructureRef": { "apiGroup": INFRA_GROUP, "kind": "TestMachineTemplate", "name": "workers" },
            }},
        },
    }))?;
    deployments.create(&PostParams::default(), &deployment).await?;

    let selector = "cluster.x-k8s.io/deployment-name=workers";
    let names = wait::for_async("the MachineDeployment's 2 Machines", TIMEOUT, || async {
        let list = machines.list(&ListParams::default().labels(selector)).await.ok()?;
        let names: Vec<String> =
            list.items.iter().filter_map(|m| m.metadata.name.clone()).collect();
        (names.len() == 2).then_some(names)
    })
    .await?;
    let mut node_names = Vec::new();
    for name in &names {
        node_names.push(provision(env, ns, &cluster, name).await?);
    }
    wait_object(&deployments, "workers", "2 replicas", TIMEOUT, |md| {
        md.data["status"]["replicas"] == json!(2)
    })
    .await?;

    deployments
        .patch(
            "workers",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "replicas": 0 } })),
        )
        .await?;
    wait::for_async("the MachineDeployment's Machines to be deleted", TIMEOUT, || async {
        let list = machines.list(&ListParams::default().labels(selector)).await.ok()?;
        list.items.is_empty().then_some(())
    })
    .await?;
    for name in &node_names {
        wait_gone(&nodes, name, TIMEOUT).await?;
    }
    let left: Vec<_> = test_machines.list(&ListParams::default()).await?.items;
    let left: Vec<_> = left.iter().filter_map(|m| m.metadata.name.as_deref()).collect();
    ensure!(left.is_empty(), "TestMachines left after scaling to 0: {left:?}");
    Ok(())
}

/// A namespace with a CAPI Cluster and what CAPI needs to manage its worker Machines:
/// - no infrastructureRef, so CAPI marks the Cluster's infrastructure provisioned itself;
/// - a controlPlaneRef to a TestControlPlane that the test marks initialized and externally
///   managed (like a hosted control plane: here it is this same apiserver). CAPI 1.14's Cluster
///   webhook requires a controlPlaneRef, infrastructureRef or topology, and CAPI deletes a
///   Machine's Node only if the control plane is externally managed or a control-plane Machine
///   remains (`isDeleteNodeAllowed`);
/// - the `<cluster>-kubeconfig` Secret, pointing at the same apiserver, and a bootstrap Secret.
async fn workload_cluster(env: &KubeEnv, ns: &str, name: &str) -> Result<String> {
    env.install_crd_yaml(capi::TEST_MACHINE_CRDS).await?;
    capi::create_namespace(env, ns).await?;
    capi::create_cluster(env, ns, name, None).await?;
    capi::create_bootstrap_secret(env, ns, name, &bootstrap_secret(name), "#cloud-config\n")
        .await?;
    Ok(name.to_owned())
}

/// Plays the infrastructure provider for one Machine: waits until CAPI has adopted the
/// TestMachine, sets providerID and provisioned, checks the Machine gets `Provisioned`, creates
/// the Node with the same providerID, and checks the Machine gets `Running` with a nodeRef.
/// Returns the Node's name.
async fn provision(env: &KubeEnv, ns: &str, cluster: &str, machine_name: &str) -> Result<String> {
    let machines = env.api(CAPI, "Machine", Some(ns));
    let test_machines = env.api(INFRA, "TestMachine", Some(ns));
    let machine = machines.get(machine_name).await?;
    let infra = machine.data["spec"]["infrastructureRef"]["name"]
        .as_str()
        .context("Machine without infrastructureRef")?
        .to_owned();

    wait_object(&test_machines, &infra, "owner reference and cluster-name label", TIMEOUT, |m| {
        let owned = m
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "Machine" && o.name == machine_name && o.api_version == CAPI);
        let labelled = m.metadata.labels.as_ref().and_then(|l| l.get(CLUSTER_NAME_LABEL))
            == Some(&cluster.to_owned());
        owned && labelled
    })
    .await?;

    let provider_id = format!("test://{ns}/{infra}");
    test_machines
        .patch(
            &infra,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "providerID": provider_id } })),
        )
        .await?;
    test_machines
        .patch_status(
            &infra,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "initialization": { "provisioned": true } } })),
        )
        .await?;
    wait_object(&machines, machine_name, "phase Provisioned", TIMEOUT, |m| {
        m.data["spec"]["providerID"] == json!(provider_id)
            && matches!(m.data["status"]["phase"].as_str(), Some("Provisioned" | "Running"))
    })
    .await?;

    let node: Node = serde_json::from_value(json!({
        "metadata": { "name": infra },
        "spec": { "providerID": provider_id },
    }))?;
    Api::<Node>::all(env.client()).create(&PostParams::default(), &node).await?;
    wait_object(&machines, machine_name, "phase Running with a nodeRef", TIMEOUT, |m| {
        m.data["status"]["phase"] == json!("Running")
            && m.data["status"]["nodeRef"]["name"] == json!(infra)
    })
    .await?;
    Ok(infra)
}

fn bootstrap_secret(cluster: &str) -> String {
    format!("{cluster}-bootstrap")
}

fn test_machine(name: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": INFRA, "kind": "TestMachine",
        "metadata": { "name": name },
        "spec": {},
    }))
    .expect("a valid TestMachine")
}

/// A v1beta2 Machine: references carry apiGroup and kind, the version comes from the CRD's
/// contract label.
fn machine(cluster: &str, name: &str, infra: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": CAPI, "kind": "Machine",
        "metadata": { "name": name },
        "spec": {
            "clusterName": cluster,
            "bootstrap": { "dataSecretName": bootstrap_secret(cluster) },
            "infrastructureRef": { "apiGroup": INFRA_GROUP, "kind": "TestMachine", "name": infra },
        },
    }))
    .expect("a valid Machine")
}
