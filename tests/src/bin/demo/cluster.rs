//! `demo cluster`: the headline path on one VM. A management cluster (kube-apiserver, etcd, the
//! Cluster API core controllers, kube-controller-manager and kube-scheduler, built from their Go
//! modules), siteboot in Kubernetes mode, and a BIOS VM behind a Redfish BMC (sushy-tools and
//! libvirt) with an empty disk. The Host is inspected; a MachineDeployment of 1 with siteboot's
//! bootstrap provider claims it; siteboot writes the node image and the VM joins as a Node with
//! the Host's providerID; scaled to 0, the Node is drained and deleted and the host wiped. Prints
//! each step and the host's timeline (what the demo saw and the appliance's own record).

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use serde_json::json;
use siteboot_controller::crd::{Bmc, BootMode, Host, HostSpec, HostState, SITE_LABEL};
use siteboot_tests::kube::capi::wait_gone;
use siteboot_tests::kube::node::{NodeImage, ready_and_matched};
use siteboot_tests::kube::{Peers, bootstrap};
use siteboot_tests::os_images;
use siteboot_tests::provider::{NS, ProviderLab, SITE, host_state, wait_host};
use siteboot_tests::redfish::{Libvirt, Machine, Sushy, SushyOptions};
use siteboot_tests::timeline::Timeline;
use siteboot_tests::vm::Firmware;

const HOST: &str = "rack1-node1";
const MAC: &str = "52:54:00:de:00:02";
const CLUSTER: &str = "demo";
const WORKERS: &str = "workers";
const BMC_USER: (&str, &str) = ("admin", "demo password");
/// A network boot and an operation under TCG on a small machine: minutes.
const STEP_TIMEOUT: Duration = Duration::from_secs(15 * 60);

pub async fn run() -> Result<()> {
    println!("==> the peers, the deploy ramdisk and the node image (built once, then cached)");
    let peers = Peers::locate()?;
    let ramdisk = os_images::ramdisk(None)?;
    let node = NodeImage::build(&peers)?;

    println!("==> a management cluster, siteboot in Kubernetes mode, a Redfish BMC");
    let mut lab = ProviderLab::start(0, |_| {}).await?;
    lab.env.start_control_plane().await?;
    let result = demo(&lab, &ramdisk, &node).await;
    if result.is_err() {
        eprintln!("{}", lab.describe().await);
        lab.siteboot.print_log();
    }
    result
}

async fn demo(lab: &ProviderLab, ramdisk: &os_images::Ramdisk, node: &NodeImage) -> Result<()> {
    lab.install_ramdisk(ramdisk)?;
    let image = lab.serve_image_file("node.raw.zst", &node.compressed(), &node.sha256)?;
    let libvirt = Libvirt::start(&lab.lab)?;
    let options = SushyOptions { user: BMC_USER, tls: None, netns: Some(&lab.lab) };
    let sushy = Sushy::start(options)?;
    lab.create_cluster(CLUSTER, "").await?;
    let apiserver = format!("https://127.0.0.1:{}", lab.env.apiserver_port());
    println!("    siteboot serves {}, the apiserver is {apiserver}", lab.siteboot.base_url());

    let machine =
        Machine { firmware: Firmware::Bios, disks_mib: &[3072], memory_mib: 2048, cpus: 2 };
    let domain = libvirt.define_with(HOST, MAC, siteboot_tests::appliance::BRIDGE, &machine)?;
    let timeline = Timeline::start();
    let result = lifecycle(lab, &sushy, &domain, &image, &timeline).await;
    println!("\n{}", timeline.render(HOST, &lab.siteboot.timeline(MAC).unwrap_or_default()));
    if result.is_err() {
        domain.print_console();
    }
    result
}

async fn lifecycle(
    lab: &ProviderLab,
    sushy: &Sushy,
    domain: &siteboot_tests::redfish::Domain,
    image: &serde_json::Value,
    timeline: &Timeline,
) -> Result<()> {
    let step = |what: &str| {
        println!("==> {what}");
        timeline.mark(what);
    };
    let hosts = lab.hosts();
    let mut host = Host::new(HOST, HostSpec::new(MAC));
    host.metadata.labels = Some([(SITE_LABEL.to_owned(), SITE.to_owned())].into());
    let address = sushy.address(domain);
    host.spec.bmc = Some(Bmc {
        credentials_name: lab.bmc_credentials(HOST, &address, BMC_USER).await?,
        address: address.clone(),
        certificate_fingerprint: None,
        boot_mode: Some(BootMode::Legacy),
    });
    hosts.create(&PostParams::default(), &host).await?;
    step(&format!(
        "Host {HOST} created with its BMC at {address}: checked, powered on, network boot"
    ));
    let available = |h: &Host| host_state(h) == Some(HostState::Available);
    let host = wait_host(&hosts, HOST, "Available", STEP_TIMEOUT, available).await?;
    let hardware = host.status.and_then(|s| s.hardware).context("no hardware")?;
    step(&format!(
        "inspected by the ramdisk: Available ({} disk(s), {} NIC(s), system {})",
        hardware.disks.len(),
        hardware.nics.len(),
        hardware.system.map(|s| s.uuid).unwrap_or_default()
    ));

    let config = json!({ "nodeLabels": { "example.com/pool": WORKERS } });
    let bootstrap = bootstrap::create_config_template(&lab.env, NS, WORKERS, config).await?;
    lab.create_template_spec(WORKERS, json!({ "image": image })).await?;
    let machine = json!({ "bootstrap": bootstrap });
    lab.create_machine_deployment_with(NS, WORKERS, CLUSTER, WORKERS, 1, machine).await?;
    step("MachineDeployment of 1 created (SitebootMachineTemplate + SitebootConfigTemplate)");
    let machine = lab.wait_running(WORKERS, 1, STEP_TIMEOUT).await?.remove(0);
    let node_name = machine.data["status"]["nodeRef"]["name"].as_str().context("no nodeRef")?;
    let nodes: Api<Node> = Api::all(lab.env.client());
    let node = ready_and_matched(&nodes, node_name, STEP_TIMEOUT).await?;
    let provider_id = node.spec.and_then(|s| s.provider_id).unwrap_or_default();
    ensure!(
        provider_id == format!("siteboot://{NS}/{HOST}"),
        "the Node's providerID: {provider_id}"
    );
    step(&format!(
        "imaged and joined: Node {node_name} Ready, providerID {provider_id}, Machine Running"
    ));

    lab.scale(WORKERS, 0).await?;
    step("scaled to 0");
    wait_host(&hosts, HOST, "wiped and Available", STEP_TIMEOUT, |h| {
        h.spec.consumer_ref.is_none()
            && available(h)
            && h.status.as_ref().is_some_and(|s| !s.wipe_required && s.installed.is_none())
    })
    .await?;
    wait_gone(&nodes, node_name, STEP_TIMEOUT).await?;
    step("drained, wiped and released: the Host Available again, the Node deleted");
    Ok(())
}
