//! The Cluster API infrastructure provider against the real CAPI core controllers: siteboot in
//! Kubernetes mode, simulated hosts that DHCP, fetch their scripts and ramdisk and report as
//! the ramdisk would, and Machines driven by CAPI through MachineDeployments.
//!
//! Failures panic (`unwrap`) while everything is alive, so the logs of siteboot, the simulated
//! hosts and the Kubernetes components get printed.

use std::time::Duration;

use kube::ResourceExt;
use kube::api::{ListParams, Patch, PatchParams};
use serde_json::json;
use siteboot_controller::crd::HostState;
use siteboot_tests::provider::{ProviderLab, image_spec};

const ROLLOUT: Duration = Duration::from_secs(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn machine_deployment_claims_provisions_scales_and_releases_hosts() {
    let lab = ProviderLab::start(4, |_| {}).await.unwrap();
    let bootstrap = "#cloud-config\nhostname: from-bootstrap\n";
    lab.create_cluster("c1", bootstrap).await.unwrap();
    lab.create_template("workers-v1", "v1").await.unwrap();
    lab.create_machine_deployment("workers", "c1", "workers-v1", 3).await.unwrap();

    // 3 hosts claimed and provisioned, the Machines Running with Nodes of the same providerID.
    let running = lab.wait_running("workers", 3, ROLLOUT).await.unwrap();
    lab.wait_hosts(HostState::Provisioned, 3, Duration::from_secs(30)).await.unwrap();
    lab.wait_hosts(HostState::Available, 1, Duration::from_secs(30)).await.unwrap();
    let sbms = lab.api("SitebootMachine");
    let nodes = kube::Api::<k8s_openapi::api::core::v1::Node>::all(lab.env.client());
    let mut claimed = Vec::new();
    for machine in &running {
        let infra = machine.data["spec"]["infrastructureRef"]["name"].as_str().unwrap();
        let sbm = sbms.get(infra).await.unwrap();
        let host = sbm.data["spec"]["hostRef"]["name"].as_str().unwrap().to_owned();
        let provider_id = format!("siteboot://metal/{host}");
        assert_eq!(sbm.data["spec"]["providerID"], json!(provider_id));
        assert_eq!(machine.data["spec"]["providerID"], json!(provider_id));
        assert_eq!(sbm.data["status"]["initialization"]["provisioned"], json!(true));
        assert_eq!(sbm.data["status"]["failureDomain"], json!("lab"));
        let node = machine.data["status"]["nodeRef"]["name"].as_str().unwrap();
        assert_eq!(
            nodes.get(node).await.unwrap().spec.unwrap().provider_id.as_deref(),
            Some(provider_id.as_str())
        );
        let ready = sbm.data["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap()
            .clone();
        assert_eq!(ready["status"], "True", "{ready}");
        let h = lab.hosts().get(&host).await.unwrap();
        assert_eq!(h.spec.consumer_ref.as_ref().unwrap().name, infra);
        claimed.push(host);
    }
    claimed.sort();
    claimed.dedup();
    assert_eq!(claimed.len(), 3, "three distinct hosts");
    // Every provisioned host's ramdisk got the Machine's bootstrap data, once.
    for sim in lab.sims.iter() {
        let data = sim.bootstrap_data();
        assert!(data.len() <= 1, "{}: bootstrap data handed out {} times", sim.mac(), data.len());
        if let Some(d) = data.first() {
            assert_eq!(d, bootstrap);
        }
    }
    assert_eq!(lab.sims.iter().filter(|s| !s.bootstrap_data().is_empty()).count(), 3);

    // Scale to 1: CAPI deletes 2 Machines; their hosts are wiped and Available again, and
    // every Host still exists.
    let deployments = lab.api("MachineDeployment");
    deployments
        .patch(
            "workers",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "replicas": 1 } })),
        )
        .await
        .unwrap();
    lab.wait_running("workers", 1, ROLLOUT).await.unwrap();
    lab.wait_hosts(HostState::Available, 3, ROLLOUT).await.unwrap();
    let hosts = lab.hosts().list(&ListParams::default()).await.unwrap().items;
    assert_eq!(hosts.len(), 4, "deleting Machines never deletes Hosts");
    for h in hosts.iter().filter(|h| h.status.as_ref().unwrap().state == Some(HostState::Available))
    {
        assert!(h.spec.consumer_ref.is_none(), "{} released", h.name_any());
        assert!(h.spec.provisioning.is_none());
        assert!(h.status.as_ref().unwrap().installed.is_none(), "{} wiped", h.name_any());
    }
    wait_sbm_count(&lab, 1).await;

    // A template change rolls out a replacement Machine with the new image.
    lab.create_template("workers-v2", "v2").await.unwrap();
    let patch = json!({ "spec": { "template": { "spec": { "infrastructureRef": { "name": "workers-v2" } } } } });
    deployments.patch("workers", &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
    let rolled =
        siteboot_tests::wait::for_async("the rollout to the v2 template", ROLLOUT, || async {
            let running = lab.running_machines("workers").await.ok()?;
            let all = lab.api("Machine").list(&ListParams::default()).await.ok()?.items;
            let [machine] = running.as_slice() else { return None };
            let sbm =
                sbms.get(machine.data["spec"]["infrastructureRef"]["name"].as_str()?).await.ok()?;
            (all.len() == 1 && sbm.data["spec"]["image"] == image_spec("v2")).then(|| sbm)
        })
        .await;
    let rolled = match rolled {
        Ok(sbm) => sbm,
        Err(e) => panic!("{e:#}\n{}", lab.describe().await),
    };
    let host = rolled.data["spec"]["hostRef"]["name"].as_str().unwrap();
    let h = lab.hosts().get(host).await.unwrap();
    assert_eq!(
        h.status.unwrap().installed.unwrap().image.url,
        image_spec("v2")["url"].as_str().unwrap()
    );
    lab.wait_hosts(HostState::Available, 3, ROLLOUT).await.unwrap();
}

async fn wait_sbm_count(lab: &ProviderLab, count: usize) {
    let sbms = lab.api("SitebootMachine");
    siteboot_tests::wait::for_async(&format!("{count} SitebootMachines left"), ROLLOUT, || async {
        (sbms.list(&ListParams::default()).await.ok()?.items.len() == count).then_some(())
    })
    .await
    .unwrap();
}
