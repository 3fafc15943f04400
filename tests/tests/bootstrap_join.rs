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
//! Beside them, issue 26's existing server ([`adopted`]): a VM that runs the node image from
//! its own disk (root's authorized keys installed, no seed, no network boot path; its host key,
//! made at its first boot, read from its console) becomes a Host reached over SSH in mode
//! `Adopt`. Pinned to another host key, it
//! is refused and its sshd logs no authentication; pinned to its own, it is inspected over SSH
//! and Available. A MachineDeployment of siteboot's bootstrap provider claims it: the data
//! delivered over SSH (the appliance killed once the run started, and restarted: it runs once)
//! joins its kubelet (the image's checklist, run over SSH, as after a
//! boot), the Node Ready with the Host's providerID. Scaled to 0, the host is reset, checked on
//! the VM (the node's state gone, containerd running again as before, the operator's data
//! kept), Available again. While it waits so, a standalone appliance ([`standalone`], no
//! Kubernetes) lists the server with its SSH access: `siteboot host inspect`, `provision` (a
//! script delivered over SSH; the appliance killed once it runs, and restarted: it runs once)
//! and `deprovision` (the reset, checked the same way). Then it is claimed again by a Machine
//! of kubeadm's bootstrap provider, whose
//! data joins with `kubeadm join`; siteboot sets that Node's providerID, found by the server's
//! system UUID. Released once more and switched to mode `Reimage`,
//! it is claimed by a MachineDeployment of the test OS ([`reimaged`]): kexec'ed over SSH into
//! the deploy ramdisk, which reaches the appliance from QEMU's user-mode network by its token
//! alone, writes the test OS and reboots into it; the test OS runs the data.
//!
//! Needs `scripts/build-test-peers`, root (the lab namespace, debootstrap) and, the first time,
//! the Debian mirror (the images and the ramdisk are then cached under `$SITEBOOT_CACHE`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use siteboot_controller::conditions::SSH_READY;
use siteboot_controller::crd::{
    Access, Host, HostSpec, HostState, SITE_LABEL, SshAccess, SshMode, condition as host_condition,
};
use siteboot_controller::ssh::SECRET_TYPE;
use siteboot_tests::appliance::{self, Appliance, BRIDGE, LAB_PROFILE};
use siteboot_tests::kube::bootstrap::{self, BOOTSTRAP, condition, secret_text};
use siteboot_tests::kube::capi::{self, CAPI, wait_gone, wait_object};
use siteboot_tests::kube::node::{
    InstalledFile, KubeletOn, MetaData, NodeImage, NodeVm, ServerVm, UNINITIALIZED, checklist,
    joined_checklist, ready_and_matched,
};
use siteboot_tests::kube::{KubeEnv, Peers, VM_HOST_ADDRESS};
use siteboot_tests::netns::Netns;
use siteboot_tests::os_images::{self, Ramdisk, TestOsImage};
use siteboot_tests::provider::{NS, ProviderLab, SITE, host_state, image_spec, wait_host};
use siteboot_tests::sshd::Keys;
use siteboot_tests::wait;

const CLUSTER: &str = "c";
const TIMEOUT: Duration = Duration::from_secs(60);
/// Boot, cloud-init and the join of a TCG VM on a busy 2-core machine.
const JOIN_TIMEOUT: Duration = Duration::from_secs(600);
/// The MachineDeployment (and its templates) whose config asks for nspawn mode.
const NSPAWN: &str = "nspawn";
/// Cluster API's label naming a Machine's MachineDeployment.
const DEPLOYMENT_LABEL: &str = "cluster.x-k8s.io/deployment-name";
/// Issue 26's existing server: its VM, Host, SSH access Secret, templates and MachineDeployment.
const ADOPTED: &str = "adopted";
const ADOPTED_MAC: &str = "52:54:00:00:26:01";
/// The existing server's sshd, forwarded from the lab namespace's loopback.
const ADOPTED_SSH_PORT: u16 = 2201;
/// Labels the existing server's Host, which its MachineDeployment's template selects.
const ADOPT_LABEL: &str = "e2e.siteboot.dev/adopt";
/// A file of the server's operator: a reset keeps it.
const OPERATOR_DATA: &str = "/srv/data/keep";
/// What [`RESET_CHECK`] prints on a reset host: containerd running again, as before the
/// adoption, with none of the node's images.
const RESET: &str = "kubelet: inactive\ncontainerd: active\ncontainerd images: 0\n\
                     kubelet processes: 0\nsiteboot units: 0\noperator data: kept\n";
/// The existing server's labels once it is to be reimaged, its template, MachineDeployment and
/// bootstrap data Secret (a script the test OS runs).
const REIMAGED: &str = "reimaged";
const REIMAGED_DATA: &str = "#!/bin/sh\necho \"user-data on $(hostname)\"\nexit 7\n";
/// The test OS's lines once it ran the data (`scripts/build-test-os-image`).
const TEST_OS_DONE: &str = "siteboot-test-os: done";
const TEST_OS_FAILED: &str = "siteboot-test-os: failed";
const TEST_OS_DATA_EXIT: &str = "siteboot-test-os: user-data exit=7";
/// The standalone appliance's address on the lab bridge, beside the Kubernetes-mode one's.
const STANDALONE_ADDRESS: &str = "10.99.0.2";
/// The standalone adoption's user-data: a script (no cloud-init), which counts its runs and
/// then waits (up to 5 minutes) for the test to let it end, so it runs while the appliance is
/// killed.
const STANDALONE_DATA: &str = "#!/bin/sh\necho run >> /root/standalone-runs\n\
    for i in $(seq 300); do [ -e /root/standalone-go ] && exit 0; sleep 1; done; exit 1\n";
/// How often the existing server is looked at while it boots.
const EVERY: Duration = Duration::from_secs(3);
/// Run on the server after its reset: whatever of the node's state is left (containerd,
/// started again, makes its empty CNI configuration folder), the units,
/// containerd's images, the kubelet's processes, siteboot's units, the operator's file.
const RESET_CHECK: &str = "for p in /etc/kubernetes /var/lib/kubelet \
     /var/lib/cloud/seed/nocloud /etc/cloud/cloud.cfg.d/99-siteboot-adopted.cfg \
     /var/lib/siteboot/adopt; do \
     [ -e $p ] && echo \"left: $p\"; done; \
     for f in $(ls -A /etc/cni/net.d 2>/dev/null); do echo \"left: /etc/cni/net.d/$f\"; done; \
     for u in kubelet containerd; do echo \"$u: $(systemctl is-active $u)\"; done; \
     echo \"containerd images: $(ctr -n k8s.io images ls -q | wc -l)\"; \
     echo \"kubelet processes: $(pgrep -xc kubelet)\"; \
     echo \"siteboot units: $(systemctl list-units --all --no-legend 'siteboot*' | wc -l)\"; \
     echo \"operator data: $(cat /srv/data/keep)\"";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_kubelet_joins_from_the_data_and_nothing_of_siteboot_stays() {
    let started = Instant::now();
    let progress =
        |what: &str| eprintln!("bootstrap join: {what} ({} s)", started.elapsed().as_secs());
    // Before the lab: a cold build takes minutes and needs no apiserver.
    let image = NodeImage::build(&Peers::locate().unwrap()).unwrap();
    let (ramdisk, test_os) =
        (os_images::ramdisk(None).unwrap(), os_images::test_os_image().unwrap());
    progress("node image, ramdisk and test OS ready");
    let mut lab = ProviderLab::start(0, |_| {}).await.unwrap();
    lab.install_ramdisk(&ramdisk).unwrap();
    // Issue 26's existing server boots while the lab gets ready.
    let keys =
        Keys::make(&[("siteboot", "ed25519"), ("operator", "ed25519"), ("impostor", "ed25519")])
            .unwrap();
    let server = existing_server(&image, &lab.lab, &keys).unwrap();
    lab.env.start_control_plane().await.unwrap();
    lab.env.start_kubeadm_bootstrap_provider().await.unwrap();
    let env = &lab.env;
    env.install_crd_yaml(capi::TEST_MACHINE_CRDS).await.unwrap();
    capi::create_cluster_at(env, NS, CLUSTER, None, VM_HOST_ADDRESS).await.unwrap();
    // kubeadm's init phases, run in the lab namespace, reach the apiserver at the address the
    // VMs use (QEMU's user-mode network's name for the namespace's loopback), which the
    // namespace's loopback gets too: the apiserver's port is forwarded on every address there.
    lab.lab.ip(&["address", "add", &format!("{VM_HOST_ADDRESS}/32"), "dev", "lo"]).unwrap();
    env.prepare_kubeadm_join(&lab.lab, VM_HOST_ADDRESS, NS, CLUSTER).await.unwrap();
    bootstrap::create_workers(env, NS, CLUSTER, "workers", 1, json!({})).await.unwrap();
    let nspawn_spec = json!({ "nspawn": true });
    bootstrap::create_workers(env, NS, CLUSTER, NSPAWN, 1, nspawn_spec).await.unwrap();

    // The existing server registers meanwhile; its MachineDeployment waits until the nspawn
    // host has joined: one kubelet joins at a time (two at once, beside the libvirt lab's
    // guests in the other stream of `scripts/test`, slowed that lab past its deadlines).
    let joined = tokio::sync::Notify::new();
    let (adoption, ()) = tokio::join!(
        adopted(&lab, &server, &keys, &joined, (&image, &ramdisk, &test_os)),
        join_from_the_data(env, &image, &lab.lab, &joined, progress)
    );
    must(adoption, env).await;
    progress("the existing server was adopted, reset, adopted again and reimaged");
}

/// The Machines of the two MachineDeployments: one deleted before its host boots, one on a host
/// in nspawn mode without a provider-id.
async fn join_from_the_data(
    env: &KubeEnv,
    image: &NodeImage,
    ns: &Netns,
    joined: &tokio::sync::Notify,
    progress: impl Fn(&str),
) {
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
    let mut nspawn_vm = NodeVm::boot(image, ns, NSPAWN, &nspawn_data, &meta).unwrap();

    // 1. A Machine deleted before its host boots: its token goes, and no longer authenticates.
    let deleted_token =
        must(bootstrap::machine_token(env, &env.client(), NS, deleted).await, env).await;
    let kubeconfig = env.admin_kubeconfig();
    assert_eq!(bootstrap::token_status(kubeconfig, &deleted_token.token).await.unwrap(), 200);
    machines.delete(&deleted.name_any(), &DeleteParams::default()).await.unwrap();
    wait_gone(&tokens, &format!("bootstrap-token-{}", deleted_token.id), TIMEOUT).await.unwrap();
    wait_gone(&machines, &deleted.name_any(), TIMEOUT).await.unwrap();
    bootstrap::wait_token_refused(kubeconfig, &deleted_token.token, TIMEOUT).await.unwrap();

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
    joined.notify_one();
}

/// Issue 26's existing server: the node image on its own disk, with root's authorized keys
/// (siteboot's and the operator's, who is the test) and a file of its operator's; booted, not
/// seeded. Its first boot makes its host key (cloud-init, with no datasource), which it prints
/// on its console.
fn existing_server(image: &NodeImage, ns: &Netns, keys: &Keys) -> anyhow::Result<ServerVm> {
    let authorized = keys.read("siteboot.pub")? + &keys.read("operator.pub")?;
    let file = |path, contents, mode| InstalledFile { path, contents, mode };
    let files = [
        file("/root/.ssh/authorized_keys", authorized.as_bytes(), 0o600),
        file(OPERATOR_DATA, b"kept\n", 0o644),
    ];
    ServerVm::boot(image, ns, ADOPTED, ADOPTED_MAC, ADOPTED_SSH_PORT, &files)
}

/// The host key the server printed on its console (as an operator learns it, out of band),
/// kept as `host.pub` with the keys and as the operator's `known_hosts`.
async fn learn_host_key(server: &ServerVm, keys: &Keys) -> anyhow::Result<()> {
    let (begin, end) = ("-----BEGIN SSH HOST KEY KEYS-----", "-----END SSH HOST KEY KEYS-----");
    let key = wait::until_async("the host key on the console", JOIN_TIMEOUT, EVERY, || async {
        let console = server.vm().console();
        let printed = console.split(begin).nth(1)?.split(end).next()?;
        let line = printed.lines().map(str::trim).find(|l| l.starts_with("ssh-ed25519 "))?;
        Some(line.to_owned())
    })
    .await?;
    std::fs::write(keys.path("host.pub"), format!("{key}\n"))?;
    let known = format!("[127.0.0.1]:{ADOPTED_SSH_PORT} {key}\n");
    Ok(std::fs::write(keys.path("known_hosts"), known)?)
}

/// Runs `command` on the existing server as root through the operator's own login (its key, the
/// server's host key pinned); what it printed.
async fn on_server(ns: &Netns, keys: &Keys, command: &str) -> anyhow::Result<String> {
    let mut ssh = tokio::process::Command::from(ns.command("ssh"));
    let output = ssh
        .args(["-F", "/dev/null", "-i"])
        .arg(keys.path("operator"))
        .arg("-o")
        .arg(format!("UserKnownHostsFile={}", keys.path("known_hosts").display()))
        .args(["-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20"])
        .args(["-p", &ADOPTED_SSH_PORT.to_string(), "root@127.0.0.1", command])
        .kill_on_drop(true)
        .output()
        .await?;
    anyhow::ensure!(
        output.status.success(),
        "ssh {command:?}: {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// The SSH access Secret of the existing server, pinning key `pinned`'s public half.
fn access_secret(keys: &Keys, pinned: &str) -> anyhow::Result<Secret> {
    Ok(Secret {
        metadata: kube::api::ObjectMeta { name: Some(ADOPTED.into()), ..Default::default() },
        type_: Some(SECRET_TYPE.into()),
        string_data: Some(BTreeMap::from([
            ("privateKey".to_owned(), keys.read("siteboot")?),
            ("hostKey".to_owned(), keys.read(&format!("{pinned}.pub"))?),
            ("address".to_owned(), "127.0.0.1".to_owned()),
            ("port".to_owned(), ADOPTED_SSH_PORT.to_string()),
        ])),
        ..Default::default()
    })
}

/// The Host's SSHReady condition, once `done` accepts it: (status, reason, message).
async fn ssh_ready(
    hosts: &Api<Host>,
    done: impl Fn(&str, &str) -> bool,
) -> anyhow::Result<(String, String, String)> {
    wait::for_async("the existing server's SSHReady condition", JOIN_TIMEOUT, || async {
        let status = hosts.get(ADOPTED).await.ok()?.status?;
        let c = host_condition(&status.conditions, SSH_READY)?;
        done(&c.status, &c.reason).then(|| (c.status.clone(), c.reason.clone(), c.message.clone()))
    })
    .await
}

/// Issue 26's standalone mode, while the server's Host is Available: a standalone appliance (no
/// `ramdisk_profile`) lists the server with its SSH access, and `siteboot host` runs its
/// operations over SSH: `inspect` (its MAC found), `provision` (the script delivered; the
/// appliance killed once its run started, and restarted: it runs once) and `deprovision` (the
/// reset, checked on the server as the Kubernetes-mode one is).
async fn standalone(lab: &ProviderLab, keys: &Keys) -> anyhow::Result<()> {
    let ssh = |command: &'static str| on_server(&lab.lab, keys, command);
    let dir = tempfile::tempdir()?;
    let user_data = dir.path().join("user-data");
    std::fs::write(&user_data, STANDALONE_DATA)?;
    lab.lab.ip(&["address", "add", &format!("{STANDALONE_ADDRESS}/32"), "dev", BRIDGE])?;
    let app = Appliance::start(&lab.lab, standalone_config(keys, &user_data)?)?;
    let host = |operation: &str| host_command(&app, operation);
    let phases = async {
        let inspected = cli_output(host("inspect")?.output().await?)?;
        anyhow::ensure!(inspected.contains("Inspect succeeded; now Available"), "{inspected}");
        eprintln!("bootstrap join: standalone: the server inspected over SSH");
        let provision = host("provision")?.stdout(std::process::Stdio::piped()).spawn()?;
        wait::until_async("the standalone run", JOIN_TIMEOUT, Duration::from_secs(1), || async {
            ssh("test -e /root/standalone-runs").await.ok()
        })
        .await?;
        app.kill9();
        app.restart()?;
        ssh("touch /root/standalone-go").await?;
        let provisioned = cli_output(provision.wait_with_output().await?)?;
        anyhow::ensure!(
            provisioned.contains("Provision succeeded; now Provisioned"),
            "{provisioned}"
        );
        let runs = ssh("cat /root/standalone-runs").await?;
        anyhow::ensure!(runs == "run\n", "the data ran {} times", runs.lines().count());
        eprintln!("bootstrap join: standalone: adopted (killed and restarted during the run)");
        let reset = cli_output(host("deprovision")?.output().await?)?;
        anyhow::ensure!(reset.contains("Deprovision succeeded; now Available"), "{reset}");
        let left = ssh(RESET_CHECK).await?;
        anyhow::ensure!(left == RESET, "after the standalone reset:\n{left}");
        eprintln!("bootstrap join: standalone: reset");
        Ok(())
    };
    let result = phases.await;
    if result.is_err() {
        app.print_log();
    }
    result
}

/// Issue 26's standalone reimage: a standalone appliance with a `ramdisk_profile` lists the
/// server with its SSH access and the node image; `siteboot host provision` kexecs it over SSH
/// into the deploy ramdisk (its token in the initrd; the ramdisk reaches the appliance from
/// QEMU's user-mode network, an address with no MAC known there, by that token alone), which
/// writes the image and reboots into it. The user-data, cloud-config run by the new OS's
/// cloud-init, keeps the server as its operator had it: its host key (the same pinned key
/// logs in again, which the Kubernetes flow after this relies on), root's authorized keys and
/// the operator's file; the adoption's file is gone with the old disk.
async fn standalone_reimage(
    lab: &ProviderLab,
    keys: &Keys,
    node: &NodeImage,
    ramdisk: &Ramdisk,
) -> anyhow::Result<()> {
    let ssh = |command: &'static str| on_server(&lab.lab, keys, command);
    let host_key = ssh("cat /etc/ssh/ssh_host_ed25519_key").await?;
    let indented = |text: &str, by: usize| {
        text.lines().map(|l| format!("{}{l}\n", " ".repeat(by))).collect::<String>()
    };
    let authorized = keys.read("siteboot.pub")? + &keys.read("operator.pub")?;
    let user_data = format!(
        "#cloud-config\ndisable_root: false\nssh_deletekeys: true\nssh_genkeytypes: []\n\
         ssh_keys:\n  ed25519_private: |\n{}  ed25519_public: {}\n\
         write_files:\n\
         \x20 - path: /root/.ssh/authorized_keys\n    permissions: '0600'\n    content: |\n{}\
         \x20 - path: {OPERATOR_DATA}\n    content: \"kept\\n\"\n\
         \x20 - path: /root/reimaged\n    content: \"by the standalone appliance\\n\"\n",
        indented(&host_key, 4),
        keys.read("host.pub")?.trim(),
        indented(&authorized, 6),
    );
    let dir = tempfile::tempdir()?;
    let user_data_file = dir.path().join("user-data");
    std::fs::write(&user_data_file, user_data)?;
    let mut config = standalone_config(keys, &user_data_file)?;
    config["profiles"]["ramdisk"] = json!({
        "kernel": "ramdisk/vmlinuz",
        "initrds": ["ramdisk/initrd.img"],
        "cmdline": "console=ttyS0 no_timer_check",
    });
    config["ramdisk_profile"] = json!("ramdisk");
    config["hosts"][0]["image"] = json!({
        "url": format!("http://{STANDALONE_ADDRESS}:{}/files/node.raw.zst", appliance::HTTP_PORT),
        "checksum": format!("sha256:{}", node.sha256),
    });
    let app = Appliance::start(&lab.lab, config)?;
    let root = app.http_root();
    std::fs::create_dir_all(root.join("ramdisk"))?;
    std::fs::copy(&ramdisk.kernel, root.join("ramdisk/vmlinuz"))?;
    std::fs::copy(&ramdisk.initramfs, root.join("ramdisk/initrd.img"))?;
    std::fs::copy(node.compressed(), root.join("node.raw.zst"))?;
    let phases = async {
        let provisioned = cli_output(host_command(&app, "provision")?.output().await?)?;
        anyhow::ensure!(
            provisioned.contains("Provision succeeded; now Provisioned"),
            "{provisioned}"
        );
        eprintln!("bootstrap join: standalone: the server reimaged (kexec over SSH)");
        // Its new OS up, with the pinned host key (the operator's known_hosts is strict).
        let on_new_os = "cat /root/reimaged; cat /srv/data/keep; \
                         test -e /root/standalone-runs && echo 'the old disk is still there'; \
                         grep -o '\"provider-id\": \"[^\"]*\"' /run/cloud-init/instance-data.json | head -1";
        let seen =
            wait::until_async("the reimaged server over SSH", JOIN_TIMEOUT, EVERY, || async {
                ssh(on_new_os).await.ok()
            })
            .await?;
        let expected = format!(
            "by the standalone appliance\nkept\n\"provider-id\": \"siteboot://standalone/{ADOPTED}\"\n"
        );
        anyhow::ensure!(seen == expected, "on the reimaged server:\n{seen}");
        Ok(())
    };
    let result = phases.await;
    if result.is_err() {
        app.print_log();
    }
    result
}

/// A standalone appliance's config (at [`STANDALONE_ADDRESS`], DHCP off) listing the existing
/// server with its SSH access and `user_data`.
fn standalone_config(
    keys: &Keys,
    user_data: &std::path::Path,
) -> anyhow::Result<serde_json::Value> {
    let mut config = appliance::lab_config("off");
    config["address"] = json!(STANDALONE_ADDRESS);
    config["hosts"] = json!([{
        "mac": ADOPTED_MAC,
        "profile": LAB_PROFILE,
        "name": ADOPTED,
        "user_data": user_data,
        "ssh": {
            "address": "127.0.0.1",
            "port": ADOPTED_SSH_PORT,
            "private_key_file": keys.path("siteboot"),
            "host_key": keys.read("host.pub")?.trim(),
        },
    }]);
    Ok(config)
}

/// `siteboot host <operation> adopted` against `app`, following it for up to 20 minutes.
fn host_command(app: &Appliance, operation: &str) -> anyhow::Result<tokio::process::Command> {
    let mut command = tokio::process::Command::new(appliance::binary()?);
    command.args(["host", operation, ADOPTED, "--timeout", "1200s", "--config"]);
    command.arg(app.config_path()).kill_on_drop(true);
    Ok(command)
}

/// What a `siteboot host` command printed, if it succeeded.
fn cli_output(output: std::process::Output) -> anyhow::Result<String> {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    anyhow::ensure!(
        output.status.success(),
        "siteboot host: {}\n{stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(stdout)
}

/// Issue 26: the existing server adopted over SSH, then reimaged (see the module's
/// documentation). Its MachineDeployment waits for `joined`: the other hosts have joined.
async fn adopted(
    lab: &ProviderLab,
    server: &ServerVm,
    keys: &Keys,
    joined: &tokio::sync::Notify,
    (node_image, ramdisk, test_os): (&NodeImage, &Ramdisk, &TestOsImage),
) -> anyhow::Result<()> {
    let ssh = |command: &'static str| on_server(&lab.lab, keys, command);
    learn_host_key(server, keys).await?;
    wait::until_async("the server's sshd", JOIN_TIMEOUT, EVERY, || async {
        ssh("true").await.ok()
    })
    .await?;

    // Pinned to a key the server does not have: siteboot connects, sees another key, and sends
    // nothing. The server's sshd logs the connection closed before any authentication.
    let (secrets, hosts): (Api<Secret>, _) = (Api::namespaced(lab.env.client(), NS), lab.hosts());
    let pp = PostParams::default();
    secrets.create(&pp, &access_secret(keys, "impostor")?).await?;
    let mut host = Host::new(ADOPTED, HostSpec::new(ADOPTED_MAC));
    host.metadata.labels = Some(BTreeMap::from([
        (SITE_LABEL.to_owned(), SITE.to_owned()),
        (ADOPT_LABEL.to_owned(), ADOPTED.to_owned()),
    ]));
    host.spec.access = Some(Access {
        ssh: Some(SshAccess {
            address: "127.0.0.1".into(),
            port: ADOPTED_SSH_PORT,
            user: "root".into(),
            mode: SshMode::Adopt,
            credentials_name: ADOPTED.into(),
        }),
    });
    hosts.create(&pp, &host).await?;
    let refused = ssh_ready(&hosts, |status, _| status == "False").await?;
    anyhow::ensure!(refused.1 == "HostKeyMismatch", "{refused:?}");
    let journal = wait::for_async("sshd to log siteboot's connection", TIMEOUT, || async {
        let journal = server.vm().second_serial().ok()?;
        journal.contains("[preauth]").then_some(journal)
    })
    .await?;
    let siteboot_key = keys.fingerprint("siteboot")?;
    for needle in [siteboot_key.as_str(), "authenticating user", "Failed publickey"] {
        anyhow::ensure!(!journal.contains(needle), "the server's sshd logged {needle:?}");
    }
    let state = hosts.get(ADOPTED).await?.status.and_then(|s| s.state);
    anyhow::ensure!(state == Some(HostState::Registering), "refused, yet {state:?}");

    // Its own key pinned: logged in, inspected over SSH, Available.
    let fixed = json!({ "stringData": { "hostKey": keys.read("host.pub")? } });
    secrets.patch(ADOPTED, &PatchParams::default(), &Patch::Merge(&fixed)).await?;
    let available = wait_host(&hosts, ADOPTED, "Available", JOIN_TIMEOUT, |h| {
        host_state(h) == Some(HostState::Available)
    })
    .await?;
    let hardware = available.status.and_then(|s| s.hardware).context("no hardware")?;
    let macs: Vec<&str> = hardware.nics.iter().map(|n| n.mac.as_str()).collect();
    anyhow::ensure!(macs.contains(&ADOPTED_MAC), "inspected NICs {macs:?}");

    // Claimed: the data delivered over SSH joins the kubelet.
    joined.notified().await;
    let config = bootstrap::create_config_template(&lab.env, NS, ADOPTED, json!({})).await?;
    let selector = json!({ "matchLabels": { ADOPT_LABEL: ADOPTED } });
    let spec = json!({ "image": image_spec(ADOPTED), "hostSelector": selector });
    lab.create_template_spec(ADOPTED, spec).await?;
    let machine = json!({ "bootstrap": config });
    lab.create_machine_deployment_with(NS, ADOPTED, CLUSTER, ADOPTED, 1, machine).await?;
    // The appliance killed (kill -9) once the run has started on the server, while cloud-init
    // joins: the restarted appliance learns from the server's marker where the delivery
    // stands, records it and waits for the result; the data runs once.
    wait::until_async("the delivery started", JOIN_TIMEOUT, Duration::from_secs(1), || async {
        ssh("test -e /var/lib/siteboot/adopt/delivery").await.ok()
    })
    .await?;
    lab.siteboot.kill9();
    lab.siteboot.restart()?;
    let first = lab.wait_running(ADOPTED, 1, JOIN_TIMEOUT).await?.remove(0);
    let node = first.data["status"]["nodeRef"]["name"].as_str().context("no nodeRef")?;
    let nodes: Api<Node> = Api::all(lab.env.client());
    let node = ready_and_matched(&nodes, node, JOIN_TIMEOUT).await?;
    let provider_id = node.spec.and_then(|s| s.provider_id);
    anyhow::ensure!(provider_id == Some(format!("siteboot://{NS}/{ADOPTED}")), "{provider_id:?}");
    let joined = checklist(&ssh("node-checklist").await?);
    anyhow::ensure!(joined == joined_checklist(KubeletOn::Host), "after the join: {joined:?}");
    let runs =
        ssh("journalctl -o cat -u siteboot-adopt | grep -c '^Started siteboot-adopt'").await?;
    anyhow::ensure!(runs.trim() == "1", "the data's unit started {} times", runs.trim());

    // Scaled to 0: the host reset over SSH, and Available again.
    lab.scale(ADOPTED, 0).await?;
    wait_host(&hosts, ADOPTED, "Available again, reset", JOIN_TIMEOUT, |h| {
        host_state(h) == Some(HostState::Available)
    })
    .await?;
    let left = ssh(RESET_CHECK).await?;
    anyhow::ensure!(left == RESET, "after the reset:\n{left}");

    // While its Host waits Available, no Kubernetes: a standalone appliance adopts the server
    // and resets it. (Here, not before the first claim: the reset removes the CNI configuration
    // the node image ships, which only kubeadm's template below writes again.)
    standalone(lab, keys).await?;
    standalone_reimage(lab, keys, node_image, ramdisk).await?;

    // Claimed again, by a Machine of kubeadm's bootstrap provider: its data joins with
    // `kubeadm join`, and names no provider-id: siteboot sets the Node's, found by the system
    // UUID the inspection over SSH read.
    let kubeadm = format!("{ADOPTED}-kubeadm");
    let machine = lab.env.create_kubeadm_config_template(NS, &kubeadm, &kubeadm, true).await?;
    lab.create_machine_deployment_with(NS, &kubeadm, CLUSTER, ADOPTED, 1, machine).await?;
    let again = lab.wait_running(&kubeadm, 1, JOIN_TIMEOUT).await?.remove(0);
    let config_ref = &again.data["spec"]["bootstrap"]["configRef"];
    anyhow::ensure!(config_ref["kind"] == "KubeadmConfig", "the Machine's bootstrap: {config_ref}");
    let node = again.data["status"]["nodeRef"]["name"].as_str().context("no nodeRef")?;
    let node = ready_and_matched(&nodes, node, JOIN_TIMEOUT).await?;
    let system_uuid = node
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .map(|i| i.system_uuid.to_lowercase());
    anyhow::ensure!(
        system_uuid.as_deref() == Some(server.uuid()),
        "the Node's system UUID: {system_uuid:?}"
    );
    let provider_id = node.spec.and_then(|s| s.provider_id);
    anyhow::ensure!(provider_id == Some(format!("siteboot://{NS}/{ADOPTED}")), "{provider_id:?}");
    let joined = checklist(&ssh("node-checklist").await?);
    anyhow::ensure!(joined == joined_checklist(KubeletOn::Host), "after kubeadm join: {joined:?}");
    lab.scale(&kubeadm, 0).await?;
    reimaged(lab, server, test_os).await
}

/// The existing server, released and Available, switched to mode `Reimage` and claimed by a
/// MachineDeployment of the test OS: kexec'ed over SSH into the ramdisk, imaged, rebooted into
/// the test OS, which runs the data; the Host Provisioned.
async fn reimaged(
    lab: &ProviderLab,
    server: &ServerVm,
    test_os: &TestOsImage,
) -> anyhow::Result<()> {
    let hosts = lab.hosts();
    wait_host(&hosts, ADOPTED, "Available again, reset", JOIN_TIMEOUT, |h| {
        host_state(h) == Some(HostState::Available)
    })
    .await?;
    let reimage = json!({
        "metadata": { "labels": { ADOPT_LABEL: REIMAGED } },
        "spec": { "access": { "ssh": { "mode": "Reimage" } } },
    });
    hosts.patch(ADOPTED, &PatchParams::default(), &Patch::Merge(&reimage)).await?;
    let image = lab.serve_image(REIMAGED, test_os)?;
    capi::create_bootstrap_secret(&lab.env, NS, CLUSTER, REIMAGED, REIMAGED_DATA).await?;
    let selector = json!({ "matchLabels": { ADOPT_LABEL: REIMAGED } });
    lab.create_template_spec(REIMAGED, json!({ "image": image, "hostSelector": selector })).await?;
    let data = json!({ "bootstrap": { "dataSecretName": REIMAGED } });
    lab.create_machine_deployment_with(NS, REIMAGED, CLUSTER, REIMAGED, 1, data).await?;
    // The ramdisk writes the test OS and reboots into it; the test OS powers off at its end.
    let console = wait::until_async("the test OS's last line", JOIN_TIMEOUT * 2, EVERY, || async {
        let console = server.vm().console();
        (console.contains(TEST_OS_DONE) || console.contains(TEST_OS_FAILED)).then_some(console)
    })
    .await?;
    let provider_id = format!("siteboot-test-os: provider-id=siteboot://{NS}/{ADOPTED}");
    for line in [TEST_OS_DONE, provider_id.as_str(), TEST_OS_DATA_EXIT] {
        anyhow::ensure!(
            console.lines().any(|l| l.trim_end() == line),
            "no {line:?} on the console"
        );
    }
    wait_host(&hosts, ADOPTED, "Provisioned, reimaged", TIMEOUT, |h| {
        host_state(h) == Some(HostState::Provisioned)
    })
    .await?;
    Ok(())
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
