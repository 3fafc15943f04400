//! The bootstrap provider's data joins a real kubelet. A Debian 12 VM (the node image
//! `scripts/build-node-image` builds: cloud-init, containerd, runc, the CNI plugins and the
//! peers' kubelet) boots in QEMU with a NoCloud seed whose user-data is a Machine's bootstrap
//! data Secret, as written, and whose meta-data carries the Machine's providerID. The workload
//! cluster is the test apiserver with kube-controller-manager (CSR approving and signing, the
//! token cleaner); the VM reaches it through QEMU's user-mode network at the Cluster's
//! `controlPlaneEndpoint`, 10.0.2.2. The Machines come from a MachineDeployment whose bootstrap
//! template is a SitebootConfigTemplate; the test plays the infrastructure provider
//! (TestMachine: providerID and provisioned).
//!
//! One environment, one image, one boot and a Machine that never boots: the Machine deleted
//! before its host boots loses its token; a host of an nspawn-mode config, whose kubelet joins
//! from a systemd-nspawn container, boots with meta-data that has no provider-id (as under an
//! infrastructure provider that sets the Node's providerID itself): its Node registers without
//! one, the test sets it as such a provider would, and Cluster API matches the Node. The host
//! mode on a host siteboot itself imaged (TLS bootstrapping after the token's first lifetime,
//! labels and taints, the token deleted, a pod running) is `provision_vm.rs`'s node scenario.
//!
//! Needs `scripts/build-test-peers`, root (the lab namespace, debootstrap) and, the first time,
//! the Debian mirror (the image is then cached under `$SITEBOOT_CACHE/images/`).

use std::time::{Duration, Instant};

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use serde_json::json;
use siteboot_tests::kube::bootstrap::{self, BOOTSTRAP, condition, secret_text};
use siteboot_tests::kube::capi::{self, CAPI, wait_gone, wait_object};
use siteboot_tests::kube::node::{
    KubeletOn, MetaData, NodeImage, NodeVm, UNINITIALIZED, joined_checklist, ready_and_matched,
};
use siteboot_tests::kube::{KubeEnv, Peers, VM_HOST_ADDRESS};
use siteboot_tests::provider::{NS, ProviderLab};

const CLUSTER: &str = "c";
const TIMEOUT: Duration = Duration::from_secs(60);
/// Boot, cloud-init and the join of a TCG VM on a busy 2-core machine.
const JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// The MachineDeployment (and its templates) whose config asks for nspawn mode.
const NSPAWN: &str = "nspawn";
/// Cluster API's label naming a Machine's MachineDeployment.
const DEPLOYMENT_LABEL: &str = "cluster.x-k8s.io/deployment-name";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_kubelet_joins_from_the_data_and_nothing_of_siteboot_stays() {
    let started = Instant::now();
    let progress =
        |what: &str| eprintln!("bootstrap join: {what} ({} s)", started.elapsed().as_secs());
    // Before the lab: a cold build takes minutes and needs no apiserver.
    let image = NodeImage::build(&Peers::locate().unwrap()).unwrap();
    progress("node image ready");
    let mut lab = ProviderLab::start(0, |_| {}).await.unwrap();
    lab.env.start_control_plane().await.unwrap();
    let env = &lab.env;
    env.install_crd_yaml(capi::TEST_MACHINE_CRDS).await.unwrap();
    capi::create_cluster_at(env, NS, CLUSTER, None, VM_HOST_ADDRESS).await.unwrap();
    bootstrap::create_workers(env, NS, CLUSTER, "workers", 1, json!({})).await.unwrap();
    let nspawn_spec = json!({ "nspawn": true });
    bootstrap::create_workers(env, NS, CLUSTER, NSPAWN, 1, nspawn_spec).await.unwrap();

    let machines = env.api(CAPI, "Machine", Some(NS));
    let secrets: Api<Secret> = Api::namespaced(env.client(), NS);
    let tokens: Api<Secret> = Api::namespaced(env.client(), "kube-system");
    let nodes: Api<Node> = Api::all(env.client());
    let in_nspawn_mode =
        |m: &DynamicObject| m.labels().get(DEPLOYMENT_LABEL).map(String::as_str) == Some(NSPAWN);
    let found = bootstrap::machines_with_data(env, NS, 2, TIMEOUT).await;
    let (in_nspawn, list): (Vec<_>, Vec<_>) =
        must(found, env).await.into_iter().partition(in_nspawn_mode);
    let (nspawn_machine, deleted) = (&in_nspawn[0], &list[0]);
    let data = |machine: &DynamicObject| {
        let secrets = secrets.clone();
        let name = machine.data["spec"]["bootstrap"]["dataSecretName"].as_str().unwrap().to_owned();
        async move { secret_text(&secrets.get(&name).await.unwrap(), "value") }
    };
    let nspawn_data = data(nspawn_machine).await;
    let server = format!("https://{VM_HOST_ADDRESS}:{}", env.apiserver_port());
    assert!(
        bootstrap::bootstrap_kubeconfig(&nspawn_data).unwrap().contains(&server),
        "hosts join at the Cluster's controlPlaneEndpoint ({server})"
    );

    progress("2 Machines have their data; booting the nspawn-mode host without a provider-id");

    // The nspawn-mode host boots now and is checked at the end. Its meta-data has no
    // provider-id: the Node registers without one, and the test sets the Machine's once the
    // Node is there, as an infrastructure provider would.
    let nspawn_provider_id = bootstrap::provision(env, NS, nspawn_machine).await.unwrap();
    let nspawn_hostname = nspawn_machine.name_any();
    let meta = MetaData {
        instance_id: nspawn_hostname.clone(),
        local_hostname: nspawn_hostname.clone(),
        provider_id: None,
    };
    let mut nspawn_vm = NodeVm::boot(&image, &lab.lab, NSPAWN, &nspawn_data, &meta).unwrap();

    // 1. A Machine deleted before its host boots: its token goes, and no longer authenticates.
    let deleted_token = must(bootstrap::machine_token(env, NS, deleted).await, env).await;
    assert_eq!(bootstrap::token_status(env, &deleted_token.token).await.unwrap(), 200);
    machines.delete(&deleted.name_any(), &DeleteParams::default()).await.unwrap();
    wait_gone(&tokens, &format!("bootstrap-token-{}", deleted_token.id), TIMEOUT).await.unwrap();
    wait_gone(&machines, &deleted.name_any(), TIMEOUT).await.unwrap();
    bootstrap::wait_token_refused(env, &deleted_token.token, TIMEOUT).await.unwrap();

    progress("a deleted Machine's token is gone");

    // 2. The nspawn-mode host: the same checks on the host (the host's own kubelet never runs),
    // and its kubelet runs inside the container (systemd-detect-virt in the kubelet's mount
    // namespace says systemd-nspawn; on the host it says none). Its Node registered without a
    // providerID; once the test sets the Machine's, Cluster API matches it.
    let checklist = must(nspawn_vm.checklist(JOIN_TIMEOUT), env).await;
    progress("the nspawn-mode host has joined (cloud-init done)");
    assert_eq!(checklist, joined_checklist(KubeletOn::Container));
    let registered = wait_object(&nodes, &nspawn_hostname, "registered", TIMEOUT, |_| true).await;
    let registered = must(registered, env).await;
    let spec = registered.spec.clone().unwrap_or_default();
    assert_eq!(spec.provider_id, None, "no provider-id in the meta-data, none registered");
    assert!(
        spec.taints.unwrap_or_default().iter().any(|t| t.key == UNINITIALIZED),
        "unmatched: the uninitialized taint stays"
    );
    let patch = json!({ "spec": { "providerID": nspawn_provider_id } });
    nodes
        .patch(
            &nspawn_hostname,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .unwrap();
    let node = must(ready_and_matched(&nodes, &nspawn_hostname, JOIN_TIMEOUT).await, env).await;
    let spec = node.spec.clone().unwrap_or_default();
    assert_eq!(spec.provider_id.as_deref(), Some(nspawn_provider_id.as_str()));
    wait_object(&machines, &nspawn_hostname, "its nodeRef", TIMEOUT, |m| {
        m.data["status"]["nodeRef"]["name"] == json!(nspawn_hostname)
    })
    .await
    .unwrap();
    progress("the nspawn-mode host's Node is Ready and its Machine's");
}

/// The value, or a panic that shows what the objects looked like (the processes' logs and the
/// VM's serial ports are printed as they drop).
async fn must<T>(result: anyhow::Result<T>, env: &KubeEnv) -> T {
    match result {
        Ok(value) => value,
        Err(e) => panic!("{e:#}\n{}", describe(env).await),
    }
}

/// Machines, SitebootConfigs, Nodes and CSRs, one line each.
async fn describe(env: &KubeEnv) -> String {
    let mut out = Vec::new();
    let all = ListParams::default();
    for m in
        env.api(CAPI, "Machine", Some(NS)).list(&all).await.map(|l| l.items).unwrap_or_default()
    {
        out.push(format!(
            "Machine {} phase={} providerID={} nodeRef={}",
            m.name_any(),
            m.data["status"]["phase"],
            m.data["spec"]["providerID"],
            m.data["status"]["nodeRef"]
        ));
    }
    let configs = env.api(BOOTSTRAP, "SitebootConfig", Some(NS));
    for c in configs.list(&all).await.map(|l| l.items).unwrap_or_default() {
        out.push(format!(
            "SitebootConfig {} ready={:?} tokenId={}",
            c.name_any(),
            condition(&c, "Ready"),
            c.data["status"]["tokenId"]
        ));
    }
    for n in Api::<Node>::all(env.client()).list(&all).await.map(|l| l.items).unwrap_or_default() {
        let spec = n.spec.clone().unwrap_or_default();
        let conditions = n.status.and_then(|s| s.conditions).unwrap_or_default();
        let ready = conditions.iter().find(|c| c.type_ == "Ready");
        out.push(format!(
            "Node {} providerID={:?} taints={:?} ready={:?}",
            n.metadata.name.unwrap_or_default(),
            spec.provider_id,
            spec.taints.unwrap_or_default().iter().map(|t| t.key.clone()).collect::<Vec<_>>(),
            ready.map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        ));
    }
    for pod in Api::<Pod>::all(env.client()).list(&all).await.map(|l| l.items).unwrap_or_default() {
        let status = pod.status.unwrap_or_default();
        out.push(format!(
            "Pod {} node={:?} phase={:?} containers={:?}",
            pod.metadata.name.unwrap_or_default(),
            pod.spec.and_then(|s| s.node_name),
            status.phase,
            status
                .container_statuses
                .unwrap_or_default()
                .iter()
                .map(|c| &c.state)
                .collect::<Vec<_>>()
        ));
    }
    let csrs: Api<CertificateSigningRequest> = Api::all(env.client());
    for csr in csrs.list(&all).await.map(|l| l.items).unwrap_or_default() {
        let status = csr.status.unwrap_or_default();
        out.push(format!(
            "CSR {} by {:?} conditions={:?} signed={}",
            csr.metadata.name.unwrap_or_default(),
            csr.spec.username,
            status
                .conditions
                .unwrap_or_default()
                .iter()
                .map(|c| c.type_.clone())
                .collect::<Vec<_>>(),
            status.certificate.is_some()
        ));
    }
    out.join("\n")
}
