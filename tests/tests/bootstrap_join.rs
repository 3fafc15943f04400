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
//! One environment, one image, two boots and a Machine that never boots: the Machine deleted
//! before its host boots loses its token; the host booted after its token's first lifetime
//! joins; alongside it, a host of an nspawn-mode config, whose kubelet joins from a
//! systemd-nspawn container, boots with meta-data that has no provider-id (as under an
//! infrastructure provider that sets the Node's providerID itself): its Node registers without
//! one, the test sets it as such a provider would, and Cluster API matches the Node.
//!
//! Needs `scripts/build-test-peers`, root (the lab namespace, debootstrap) and, the first time,
//! the Debian mirror (the image is then cached under `$SITEBOOT_CACHE/images/`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use serde_json::json;
use siteboot_tests::kube::bootstrap::{self, BOOTSTRAP, condition, secret_text};
use siteboot_tests::kube::capi::{self, CAPI, wait_gone, wait_object};
use siteboot_tests::kube::node::{MetaData, NodeImage, NodeVm};
use siteboot_tests::kube::{KubeEnv, Peers, VM_HOST_ADDRESS};
use siteboot_tests::provider::{NS, ProviderLab};
use siteboot_tests::wait;

const CLUSTER: &str = "c";
/// The shortest TTL the CRD allows: the host below boots after its token's first lifetime.
const TTL: u64 = 60;
const TIMEOUT: Duration = Duration::from_secs(60);
/// Boot, cloud-init and the join of a TCG VM on a busy 2-core machine.
const JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// The uninitialized taint, which CAPI removes once the Node is its Machine's.
const UNINITIALIZED: &str = "node.cluster.x-k8s.io/uninitialized";
/// The MachineDeployment (and its templates) whose config asks for nspawn mode.
const NSPAWN: &str = "nspawn";
/// Cluster API's label naming a Machine's MachineDeployment.
const DEPLOYMENT_LABEL: &str = "cluster.x-k8s.io/deployment-name";

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

/// When the bootstrap token `id` expires, as the workload cluster holds it (None: no token).
async fn token_expiration(tokens: &Api<Secret>, id: &str) -> Option<u64> {
    let token = tokens.get_opt(&format!("bootstrap-token-{id}")).await.ok()??;
    let expiration: k8s_openapi::jiff::Timestamp =
        secret_text(&token, "expiration").parse().ok()?;
    u64::try_from(expiration.as_second()).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_kubelet_joins_from_the_data_and_nothing_of_siteboot_stays() {
    let started = Instant::now();
    let progress =
        |what: &str| eprintln!("bootstrap join: {what} ({} s)", started.elapsed().as_secs());
    // Before the lab: a cold build takes minutes and needs no apiserver.
    let image = NodeImage::build(&Peers::locate().unwrap()).unwrap();
    progress("node image ready");
    let mut lab = ProviderLab::start(0, |_| {}).await.unwrap();
    lab.env.start_controller_manager().await.unwrap();
    let env = &lab.env;
    env.install_crd_yaml(capi::TEST_MACHINE_CRDS).await.unwrap();
    capi::create_cluster_at(env, NS, CLUSTER, None, VM_HOST_ADDRESS).await.unwrap();
    let config_spec = json!({
        "nodeLabels": { "example.com/pool": "workers" },
        "nodeTaints": [{ "key": "dedicated", "value": "ml", "effect": "NoSchedule" }],
        "tokenTTLSeconds": TTL,
    });
    bootstrap::create_workers(env, NS, CLUSTER, "workers", 2, config_spec).await.unwrap();
    let nspawn_spec = json!({ "nspawn": true });
    bootstrap::create_workers(env, NS, CLUSTER, NSPAWN, 1, nspawn_spec).await.unwrap();

    let machines = env.api(CAPI, "Machine", Some(NS));
    let configs = env.api(BOOTSTRAP, "SitebootConfig", Some(NS));
    let secrets: Api<Secret> = Api::namespaced(env.client(), NS);
    let tokens: Api<Secret> = Api::namespaced(env.client(), "kube-system");
    let nodes: Api<Node> = Api::all(env.client());
    let in_nspawn_mode =
        |m: &DynamicObject| m.labels().get(DEPLOYMENT_LABEL).map(String::as_str) == Some(NSPAWN);
    let found = bootstrap::machines_with_data(env, NS, 3, TIMEOUT).await;
    let (in_nspawn, list): (Vec<_>, Vec<_>) =
        must(found, env).await.into_iter().partition(in_nspawn_mode);
    let (joining, deleted) = (list[0].clone(), list[1].clone());
    let data = |machine: &DynamicObject| {
        let secrets = secrets.clone();
        let name = machine.data["spec"]["bootstrap"]["dataSecretName"].as_str().unwrap().to_owned();
        async move { secret_text(&secrets.get(&name).await.unwrap(), "value") }
    };
    let token_id = |machine: &DynamicObject| {
        let configs = configs.clone();
        let name =
            machine.data["spec"]["bootstrap"]["configRef"]["name"].as_str().unwrap().to_owned();
        async move {
            let config = configs.get(&name).await.unwrap();
            config.data["status"]["tokenId"].as_str().unwrap().to_owned()
        }
    };
    let joining_data = data(&joining).await;
    let joining_id = token_id(&joining).await;
    let first_expiration = token_expiration(&tokens, &joining_id).await.expect("a token");
    let server = format!("https://{VM_HOST_ADDRESS}:{}", env.apiserver_port());
    assert!(
        bootstrap::bootstrap_kubeconfig(&joining_data).unwrap().contains(&server),
        "hosts join at the Cluster's controlPlaneEndpoint ({server})"
    );

    progress("3 Machines have their data; booting the nspawn-mode host without a provider-id");

    // The nspawn-mode host boots now and is checked at the end: it joins while the others run.
    // Its meta-data has no provider-id: the Node registers without one, and the test sets the
    // Machine's once the Node is there, as an infrastructure provider would.
    let nspawn_machine = &in_nspawn[0];
    let nspawn_provider_id = bootstrap::provision(env, NS, nspawn_machine).await.unwrap();
    let nspawn_hostname = nspawn_machine.name_any();
    let meta = MetaData {
        instance_id: nspawn_hostname.clone(),
        local_hostname: nspawn_hostname.clone(),
        provider_id: None,
    };
    let mut nspawn_vm =
        NodeVm::boot(&image, &lab.lab, NSPAWN, &data(nspawn_machine).await, &meta).unwrap();

    // 1. A Machine deleted before its host boots: its token goes, and no longer authenticates.
    let deleted_token = bootstrap::bootstrap_token(&data(&deleted).await).unwrap();
    let deleted_id = token_id(&deleted).await;
    assert_eq!(bootstrap::token_status(env, &deleted_token).await.unwrap(), 200);
    machines.delete(&deleted.name_any(), &DeleteParams::default()).await.unwrap();
    wait_gone(&tokens, &format!("bootstrap-token-{deleted_id}"), TIMEOUT).await.unwrap();
    wait_gone(&machines, &deleted.name_any(), TIMEOUT).await.unwrap();
    bootstrap::wait_token_refused(env, &deleted_token, TIMEOUT).await.unwrap();

    progress("a deleted Machine's token is gone");

    // 2. The host of the first Machine boots after its token's first lifetime (60 s): siteboot
    // kept extending the token (an expired one would fail authentication, and the token
    // cleaner would delete it), so it still joins.
    let after = first_expiration + 5;
    let left = Duration::from_secs(after.saturating_sub(unix_now()));
    wait::for_async("the token's first expiration to pass", left + TIMEOUT, || async {
        (unix_now() > after).then_some(())
    })
    .await
    .unwrap();
    let expiration = token_expiration(&tokens, &joining_id).await.expect("the token still exists");
    assert!(expiration > unix_now(), "extended past now");
    let joining_token = bootstrap::bootstrap_token(&joining_data).unwrap();
    assert_eq!(bootstrap::token_status(env, &joining_token).await.unwrap(), 200);

    let provider_id = bootstrap::provision(env, NS, &joining).await.unwrap();
    let hostname = joining.name_any();
    let meta = MetaData {
        instance_id: hostname.clone(),
        local_hostname: hostname.clone(),
        provider_id: Some(provider_id.clone()),
    };
    progress("the token outlived its first lifetime; booting the host that joins");
    let mut vm = NodeVm::boot(&image, &lab.lab, "joins", &joining_data, &meta).unwrap();
    let checklist = must(vm.checklist(JOIN_TIMEOUT), env).await;
    progress("the host has joined (cloud-init done)");
    assert_eq!(checklist, joined_checklist(KubeletOn::Host));

    // The kubelet's client CSR, from the bootstrap token's user, approved and signed.
    let csrs: Api<CertificateSigningRequest> = Api::all(env.client());
    let requester = format!("system:bootstrap:{joining_id}");
    let csr = wait::for_async("the kubelet's CSR approved and signed", TIMEOUT, || async {
        let list = csrs.list(&ListParams::default()).await.ok()?.items;
        list.into_iter().find(|csr| {
            let status = csr.status.clone().unwrap_or_default();
            let approved =
                status.conditions.unwrap_or_default().iter().any(|c| c.type_ == "Approved");
            csr.spec.username.as_deref() == Some(requester.as_str())
                && approved
                && status.certificate.is_some()
        })
    })
    .await;
    let csr = must(csr, env).await;
    assert_eq!(csr.spec.signer_name, "kubernetes.io/kube-apiserver-client-kubelet");

    // The Node: Ready, the Machine's providerID, the data's labels and taints; CAPI matches it
    // (nodeRef) and removes the uninitialized taint.
    let node = must(ready_and_matched(&nodes, &hostname).await, env).await;
    let spec = node.spec.clone().unwrap_or_default();
    assert_eq!(spec.provider_id.as_deref(), Some(provider_id.as_str()));
    assert_eq!(node.labels().get("example.com/pool").map(String::as_str), Some("workers"));
    let taints = spec.taints.unwrap_or_default();
    assert!(taints.iter().any(|t| t.key == "dedicated" && t.value.as_deref() == Some("ml")));
    wait_object(&machines, &hostname, "its nodeRef", TIMEOUT, |m| {
        m.data["status"]["nodeRef"]["name"] == json!(hostname)
    })
    .await
    .unwrap();

    // Joined: the token is deleted and no longer authenticates.
    wait_gone(&tokens, &format!("bootstrap-token-{joining_id}"), TIMEOUT).await.unwrap();
    bootstrap::wait_token_refused(env, &joining_token, TIMEOUT).await.unwrap();
    let config_name = joining.data["spec"]["bootstrap"]["configRef"]["name"].as_str().unwrap();
    assert_eq!(condition(&configs.get(config_name).await.unwrap(), "Ready").0, json!("True"));
    progress("the Node is Ready and its Machine's; the token is gone");

    // 3. The nspawn-mode host: the same checks on the host (the host's own kubelet never runs),
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
    let node = must(ready_and_matched(&nodes, &nspawn_hostname).await, env).await;
    let spec = node.spec.clone().unwrap_or_default();
    assert_eq!(spec.provider_id.as_deref(), Some(nspawn_provider_id.as_str()));
    wait_object(&machines, &nspawn_hostname, "its nodeRef", TIMEOUT, |m| {
        m.data["status"]["nodeRef"]["name"] == json!(nspawn_hostname)
    })
    .await
    .unwrap();
    progress("the nspawn-mode host's Node is Ready and its Machine's");
}

/// Where a joined host's kubelet runs.
enum KubeletOn {
    /// `kubelet.service` on the host.
    Host,
    /// In the nspawn mode's container, run by the host's `kubelet-container.service`.
    Container,
}

/// The checklist of a host that joined: the sentinel written, the bootstrap kubeconfig gone,
/// the kubelet's own there, `/opt/cni/bin` linked to Debian's plugins, no siteboot process.
fn joined_checklist(kubelet_on: KubeletOn) -> BTreeMap<String, String> {
    // The host's kubelet unit, the container's unit, systemd-detect-virt in the kubelet's mounts.
    let (kubelet, container, runs_in) = match kubelet_on {
        KubeletOn::Host => ("active", "inactive", "none"),
        KubeletOn::Container => ("inactive", "active", "systemd-nspawn"),
    };
    [
        ("cloud-init", "done"),
        ("sentinel", "yes"),
        ("bootstrap-kubeconfig", "no"),
        ("kubelet-kubeconfig", "yes"),
        ("kubelet", kubelet),
        ("kubelet-container", container),
        ("kubelet-runs-in", runs_in),
        ("cni-bin-bridge", "yes"),
        ("siteboot-processes", "0"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The Node `name` once it is Ready and Cluster API removed its uninitialized taint.
async fn ready_and_matched(nodes: &Api<Node>, name: &str) -> anyhow::Result<Node> {
    wait_object(nodes, name, "Ready, the uninitialized taint gone", JOIN_TIMEOUT, |n| {
        let status = n.status.clone().unwrap_or_default();
        let conditions = status.conditions.unwrap_or_default();
        let ready = conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True");
        let taints = n.spec.clone().unwrap_or_default().taints.unwrap_or_default();
        ready && !taints.iter().any(|t| t.key == UNINITIALIZED)
    })
    .await
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
