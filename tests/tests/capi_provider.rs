//! The Cluster API infrastructure provider against the real CAPI core controllers: siteboot in
//! Kubernetes mode, simulated hosts that DHCP, fetch their scripts and ramdisk and report as
//! the ramdisk would, and Machines driven by CAPI through MachineDeployments.
//!
//! Failures panic (`unwrap`) while everything is alive, so the logs of siteboot, the simulated
//! hosts and the Kubernetes components get printed.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;
use siteboot_controller::crd::HostState;
use siteboot_tests::kube::capi::wait_object;
use siteboot_tests::provider::{NS, ProviderLab, SYSTEM_NS, Sims, TAMPERED_IMAGE, image_spec};

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
    for sim in lab.sims() {
        let data = sim.bootstrap_data();
        assert!(data.len() <= 1, "{}: bootstrap data handed out {} times", sim.mac(), data.len());
        if let Some(d) = data.first() {
            assert_eq!(d, bootstrap);
        }
    }
    assert_eq!(lab.sims().iter().filter(|s| !s.bootstrap_data().is_empty()).count(), 3);

    // The site is the Cluster's failure domain.
    let sbc = lab.api("SitebootCluster").get("c1").await.unwrap();
    assert_eq!(
        sbc.data["status"]["failureDomains"],
        json!([{ "name": "lab", "controlPlane": true }])
    );
    let cluster = lab.api("Cluster").get("c1").await.unwrap();
    assert_eq!(
        cluster.data["status"]["failureDomains"][0]["name"], "lab",
        "{}",
        cluster.data["status"]
    );

    // `kubectl get hosts,sitebootmachines` shows what each host is doing.
    let hosts_table =
        lab.table("/apis/siteboot.dev/v1alpha1/namespaces/metal/hosts").await.unwrap();
    assert_eq!(
        columns(&hosts_table),
        ["Name", "State", "Power", "Consumer", "Site", "Maintenance", "MAC", "Age"]
    );
    let rows = cells(&hosts_table);
    assert_eq!(
        rows.iter()
            .filter(|r| r[1] == "Provisioned" && r[3].starts_with("workers-") && r[4] == "lab")
            .count(),
        3,
        "{rows:?}"
    );
    assert_eq!(
        rows.iter().filter(|r| r[1] == "Available" && r[3].is_empty()).count(),
        1,
        "{rows:?}"
    );
    let sbm_table = lab
        .table("/apis/infrastructure.cluster.x-k8s.io/v1alpha1/namespaces/metal/sitebootmachines")
        .await
        .unwrap();
    assert_eq!(
        columns(&sbm_table),
        ["Name", "Cluster", "Host", "Ready", "Reason", "ProviderID", "Machine", "Age"]
    );
    assert!(
        cells(&sbm_table).iter().all(|r| r[1] == "c1"
            && r[2].starts_with("host-")
            && r[3] == "True"
            && r[4] == "Provisioned"),
        "{:?}",
        cells(&sbm_table)
    );

    // Scale to 1: CAPI deletes 2 Machines; their hosts are wiped and Available again, and
    // every Host still exists.
    let deployments = lab.api("MachineDeployment");
    lab.scale("workers", 1).await.unwrap();
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
    let rolled = rolled_out(&lab, "v2").await;
    let host = rolled.data["spec"]["hostRef"]["name"].as_str().unwrap().to_owned();
    let h = lab.hosts().get(&host).await.unwrap();
    assert_eq!(
        h.status.clone().unwrap().installed.unwrap().image.url,
        image_spec("v2")["url"].as_str().unwrap()
    );
    lab.wait_hosts(HostState::Available, 3, ROLLOUT).await.unwrap();

    // No spare host: a rollout with maxSurge 0 onto exactly the hosts it has (a selector only
    // the current host matches) deletes the old Machine first; its host is wiped, and the
    // replacement claims it (the reuse policy, docs/cluster-api.md: nothing holds a released
    // host for a successor, so with no spare the successor gets the host its predecessor
    // released).
    let pinned = json!({ "metadata": { "labels": { "e2e.siteboot.dev/pinned": "yes" } } });
    lab.hosts().patch(&host, &PatchParams::default(), &Patch::Merge(pinned)).await.unwrap();
    let sim = lab.sims().into_iter().find(|s| s.mac() == h.spec.boot_mac_address).unwrap();
    let wipes = |log: String| log.lines().filter(|l| l.ends_with(" wiped")).count();
    let wiped_before = wipes(sim.log());
    let only_it = json!({ "matchLabels": { "e2e.siteboot.dev/pinned": "yes" } });
    let spec = json!({ "image": image_spec("v1"), "hostSelector": only_it });
    lab.create_template_spec("workers-v3", spec).await.unwrap();
    let patch = json!({ "spec": {
        "rollout": { "strategy": { "type": "RollingUpdate", "rollingUpdate": { "maxSurge": 0, "maxUnavailable": 1 } } },
        "template": { "spec": { "infrastructureRef": { "name": "workers-v3" } } },
    } });
    deployments.patch("workers", &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
    let replaced = rolled_out(&lab, "v1").await;
    assert_eq!(replaced.data["spec"]["hostRef"]["name"], json!(host), "the released host reused");
    assert_eq!(wipes(sim.log()), wiped_before + 1, "wiped once between the two Machines");
    let installed = lab.hosts().get(&host).await.unwrap().status.unwrap().installed.unwrap();
    assert_eq!(installed.image.url, image_spec("v1")["url"].as_str().unwrap());
}

/// The SitebootMachine of the one Machine of MachineDeployment `workers` once the rollout to a
/// template writing `image` is done: one Machine, Running, its SitebootMachine writing it.
async fn rolled_out(lab: &ProviderLab, image: &str) -> kube::api::DynamicObject {
    let sbms = lab.api("SitebootMachine");
    let what = format!("the rollout to a template writing {image}");
    let rolled = siteboot_tests::wait::for_async(&what, ROLLOUT, || async {
        let running = lab.running_machines("workers").await.ok()?;
        let all = lab.api("Machine").list(&ListParams::default()).await.ok()?.items;
        let [machine] = running.as_slice() else { return None };
        let sbm =
            sbms.get(machine.data["spec"]["infrastructureRef"]["name"].as_str()?).await.ok()?;
        (all.len() == 1 && sbm.data["spec"]["image"] == image_spec(image)).then_some(sbm)
    })
    .await;
    match rolled {
        Ok(sbm) => sbm,
        Err(e) => panic!("{e:#}\n{}", lab.describe().await),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_image_that_does_not_match_its_checksum_quarantines_the_host_and_is_never_served() {
    let lab = ProviderLab::start(1, |_| {}).await.unwrap();
    lab.create_cluster("c-bad", "#cloud-config\n").await.unwrap();
    lab.create_template("t", TAMPERED_IMAGE).await.unwrap();
    lab.create_machine_deployment("workers", "c-bad", "t", 1).await.unwrap();

    if let Err(e) = lab.wait_hosts(HostState::Quarantined, 1, ROLLOUT).await {
        panic!("{e:#}\n{}", lab.describe().await);
    }
    let host = lab.hosts().get("host-0").await.unwrap();
    let reason = host.status.unwrap().quarantine_reason.unwrap_or_default();
    assert!(reason.contains("tampered.raw") && reason.contains("discarded"), "{reason}");
    // The appliance refused before any task named the image: no ramdisk got the bootstrap
    // data, and nothing could write the image.
    for sim in lab.sims() {
        assert!(sim.bootstrap_data().is_empty(), "{}: bootstrap data handed out", sim.mac());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ramdisk_that_falls_silent_quarantines_its_host_with_the_reason() {
    let lab = ProviderLab::start(1, |config| {
        config["kubernetes"]["ramdisk_silence_timeout"] = json!("15s");
    })
    .await
    .unwrap();
    // The ramdisk reports "writing image", then hangs far longer than the appliance allows.
    for sim in lab.sims() {
        sim.set_work_time(Duration::from_secs(600));
    }
    lab.create_cluster("c-silent", "#cloud-config\n").await.unwrap();
    lab.create_template("t", "v1").await.unwrap();
    lab.create_machine_deployment("workers", "c-silent", "t", 1).await.unwrap();

    if let Err(e) = lab.wait_hosts(HostState::Quarantined, 1, ROLLOUT).await {
        panic!("{e:#}\n{}", lab.describe().await);
    }
    let status = lab.hosts().get("host-0").await.unwrap().status.unwrap();
    let reason = status.quarantine_reason.unwrap_or_default();
    assert!(reason.starts_with("RamdiskSilent: ") && reason.contains("writing image"), "{reason}");
    assert!(status.wipe_required, "a host quarantined mid-provisioning still owes a wipe");
}

async fn wait_sbm_count(lab: &ProviderLab, count: usize) {
    let sbms = lab.api("SitebootMachine");
    siteboot_tests::wait::for_async(&format!("{count} SitebootMachines left"), ROLLOUT, || async {
        (sbms.list(&ListParams::default()).await.ok()?.items.len() == count).then_some(())
    })
    .await
    .unwrap();
}

fn columns(table: &serde_json::Value) -> Vec<String> {
    table["columnDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_owned())
        .collect()
}

/// Table cells as strings (empty for a missing value).
fn cells(table: &serde_json::Value) -> Vec<Vec<String>> {
    table["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r["cells"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| {
                    c.as_str()
                        .map(str::to_owned)
                        .unwrap_or_else(|| if c.is_null() { String::new() } else { c.to_string() })
                })
                .collect()
        })
        .collect()
}

fn ready_condition(sbm: &kube::api::DynamicObject) -> serde_json::Value {
    sbm.data["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready").cloned())
        .unwrap_or_default()
}

fn condition(sbm: &kube::api::DynamicObject, type_: &str) -> serde_json::Value {
    sbm.data["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_).cloned())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn machines_wait_for_hosts_and_pause_stops_changes() {
    let lab = ProviderLab::start(2, |_| {}).await.unwrap();
    lab.create_cluster("c2", "#cloud-config\n").await.unwrap();
    lab.create_template("t", "v1").await.unwrap();
    lab.create_machine_deployment("workers", "c2", "t", 3).await.unwrap();

    // Two hosts, three Machines: the third waits and says why.
    let sbms = lab.api("SitebootMachine");
    let waiting = siteboot_tests::wait::for_async(
        "a SitebootMachine waiting for a host",
        ROLLOUT,
        || async {
            let list = sbms.list(&ListParams::default()).await.ok()?.items;
            let provisioned =
                list.iter().filter(|m| ready_condition(m)["status"] == "True").count();
            let waiting =
                list.into_iter().find(|m| ready_condition(m)["reason"] == "NoHostAvailable")?;
            (provisioned == 2).then_some(waiting)
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let message = ready_condition(&waiting)["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("no Available Host in site lab matches (2 hosts: 2 claimed)"),
        "{message}"
    );
    // No busy loop: while nothing changes, the waiting object is not rewritten.
    let name = waiting.name_any();
    let before = waiting.metadata.resource_version.clone();
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(
        sbms.get(&name).await.unwrap().metadata.resource_version,
        before,
        "the waiting SitebootMachine was rewritten while nothing changed"
    );
    lab.wait_running("workers", 2, Duration::from_secs(5)).await.ok();

    // Paused: a new host appears and is inspected, but nothing is claimed for the Cluster.
    let clusters = lab.api("Cluster");
    clusters
        .patch("c2", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "paused": true } })))
        .await
        .unwrap();
    siteboot_tests::wait::for_async(
        "the waiting SitebootMachine to report Paused",
        Duration::from_secs(60),
        || async {
            (condition(&sbms.get(&name).await.ok()?, "Paused")["status"] == "True").then_some(())
        },
    )
    .await
    .unwrap();
    lab.add_host(2, false).await.unwrap();
    lab.wait_hosts(HostState::Available, 1, Duration::from_secs(120)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let host = lab.hosts().get("host-2").await.unwrap();
    assert!(host.spec.consumer_ref.is_none(), "a host was claimed while the Cluster was paused");

    // Unpaused: the third Machine gets the new host.
    clusters
        .patch("c2", &PatchParams::default(), &Patch::Merge(json!({ "spec": { "paused": false } })))
        .await
        .unwrap();
    lab.wait_running("workers", 3, ROLLOUT).await.unwrap();
    let sbm = sbms.get(&name).await.unwrap();
    assert_eq!(sbm.data["spec"]["hostRef"]["name"], "host-2");
    assert_eq!(condition(&sbm, "Paused")["status"], "False");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn machine_health_check_replaces_a_machine_whose_node_goes_not_ready() {
    let lab = ProviderLab::start(2, |_| {}).await.unwrap();
    lab.create_cluster("c3", "#cloud-config\n").await.unwrap();
    lab.create_template("t", "v1").await.unwrap();
    lab.create_machine_deployment("workers", "c3", "t", 1).await.unwrap();
    let mhc: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineHealthCheck",
        "metadata": { "name": "workers" },
        "spec": {
            "clusterName": "c3",
            "selector": { "matchLabels": { "pool": "workers" } },
            "checks": {
                "nodeStartupTimeoutSeconds": 600,
                "unhealthyNodeConditions": [{ "type": "Ready", "status": "False", "timeoutSeconds": 5 }],
            },
        },
    }))
    .unwrap();
    lab.api("MachineHealthCheck").create(&kube::api::PostParams::default(), &mhc).await.unwrap();
    let first = lab.wait_running("workers", 1, ROLLOUT).await.unwrap().remove(0);
    let node = first.data["status"]["nodeRef"]["name"].as_str().unwrap().to_owned();

    lab.set_node_ready(&node, false);
    let replaced = siteboot_tests::wait::for_async(
        "the unhealthy Machine to be replaced",
        ROLLOUT,
        || async {
            let running = lab.running_machines("workers").await.ok()?;
            let all = lab.api("Machine").list(&ListParams::default()).await.ok()?.items;
            let [machine] = running.as_slice() else { return None };
            (all.len() == 1 && machine.name_any() != first.name_any()).then(|| machine.clone())
        },
    )
    .await;
    if let Err(e) = replaced {
        panic!("{e:#}\n{}", lab.describe().await);
    }
    // The unhealthy machine's host was wiped and went back to the pool.
    lab.wait_hosts(HostState::Available, 1, ROLLOUT).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_during_provisioning_or_deprovisioning_is_finished_after_restart() {
    let lab = ProviderLab::start(2, |_| {}).await.unwrap();
    for sim in lab.sims() {
        sim.set_work_time(Duration::from_secs(4));
    }
    lab.create_cluster("c4", "#cloud-config\n").await.unwrap();
    lab.create_template("t", "v1").await.unwrap();
    lab.create_machine_deployment("workers", "c4", "t", 1).await.unwrap();

    // kill -9 while the ramdisk writes the image.
    lab.wait_hosts(HostState::Provisioning, 1, ROLLOUT).await.unwrap();
    siteboot_tests::wait::for_async("the ramdisk to report writing", ROLLOUT, || async {
        let hosts = lab.hosts().list(&ListParams::default()).await.ok()?.items;
        hosts.iter().any(|h| step_of(h) == Some("writing image")).then_some(())
    })
    .await
    .unwrap();
    lab.siteboot.kill9();
    tokio::time::sleep(Duration::from_secs(2)).await;
    lab.siteboot.restart().unwrap();
    lab.wait_running("workers", 1, ROLLOUT).await.unwrap();

    // kill -9 while the ramdisk wipes.
    lab.scale("workers", 0).await.unwrap();
    siteboot_tests::wait::for_async("the ramdisk to report wiping", ROLLOUT, || async {
        let hosts = lab.hosts().list(&ListParams::default()).await.ok()?.items;
        hosts.iter().any(|h| step_of(h) == Some("wiping")).then_some(())
    })
    .await
    .unwrap();
    lab.siteboot.kill9();
    tokio::time::sleep(Duration::from_secs(2)).await;
    lab.siteboot.restart().unwrap();
    lab.wait_hosts(HostState::Available, 2, ROLLOUT).await.unwrap();
    wait_sbm_count(&lab, 0).await;
    let hosts = lab.hosts().list(&ListParams::default()).await.unwrap().items;
    assert!(hosts.iter().all(|h| h.spec.consumer_ref.is_none()), "{}", lab.describe().await);
}

/// With siteboot split as deployed: the boot plane, which serves the segment, reads no Secret
/// of the tenant's; the controller hands it the data, and takes the copy back once delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bootstrap_data_reaches_only_the_claimed_host_with_its_token() {
    let lab = ProviderLab::start_split(Sims { count: 1, manual: 1 }, |config| {
        config["kubernetes"]["token_max_age"] = json!("20s");
        // The intruder below is a machine with no Host: it gets a lease only with this off.
        config["dhcp"]["known_hosts_only"] = json!(false);
    })
    .await
    .unwrap();
    let sim = lab.sims().remove(0);
    // Inspection through the agent API, by hand.
    let token = wait_token(&sim).await;
    let (status, body) = sim
        .http("POST", "/agent/v1/inspection", Some(&token), Some(&siteboot_tests::sim::hardware()))
        .unwrap();
    assert_eq!(status, 200, "{body}");
    lab.wait_hosts(HostState::Available, 1, Duration::from_secs(60)).await.unwrap();

    let secret_value = "#cloud-config\nkubeadm-join-token: abcdef.0123456789abcdef\n";
    lab.create_cluster("c5", secret_value).await.unwrap();
    lab.create_template("t", "v1").await.unwrap();
    lab.create_machine_deployment("workers", "c5", "t", 1).await.unwrap();
    lab.wait_hosts(HostState::Provisioning, 1, ROLLOUT).await.unwrap();
    sim.reboot();
    let old = token;
    let token = siteboot_tests::wait::for_async(
        "a provisioning token",
        Duration::from_secs(60),
        || async { sim.token().filter(|t| *t != old) },
    )
    .await
    .unwrap();

    // Another machine on the network, with the right token: refused.
    let intruder = siteboot_tests::clients::ClientHost::attach(
        &lab.lab,
        siteboot_tests::appliance::BRIDGE,
        "52:54:00:00:0d:01",
    )
    .unwrap();
    let mut dhcp = siteboot_tests::clients::Udhcpc::start(&intruder, &[]).unwrap();
    dhcp.wait_bound(Duration::from_secs(30)).unwrap();
    let intruder_get = |path: &str| {
        let mut command = intruder.ns.command("curl");
        command.args(["-sS", "-o", "-", "-w", "\n%{http_code}"]);
        let out = siteboot_tests::netns::output(
            command.arg(format!("{}{path}", lab.siteboot.base_url())),
        )
        .unwrap();
        let (body, status) = out.rsplit_once('\n').unwrap();
        (status.trim().parse::<u16>().unwrap(), body.to_owned())
    };
    // Nor does it get a token by asking for the host's script.
    let (status, script) = intruder_get(&format!("/boot/{}.ipxe", sim.mac().replace(':', "-")));
    assert_eq!(status, 200);
    // Over HTTPS, as a ramdisk would, with the agent URL and pin from that script.
    let agent =
        siteboot_tests::sim::agent_client(&siteboot_tests::sim::ramdisk_cmdline(&script).unwrap());
    let (status, _) = siteboot_tests::sim::agent_http(
        &intruder.ns,
        &agent,
        "GET",
        "/agent/v1/bootstrap",
        Some(&token),
        None,
    )
    .unwrap();
    assert_eq!(status, 403);
    assert!(
        !script.contains("siteboot.token="),
        "a token was issued to another address:\n{script}"
    );

    // The host itself: a wrong token is refused; an expired one too.
    assert_eq!(sim.http("GET", "/agent/v1/bootstrap", Some("0000"), None).unwrap().0, 403);
    tokio::time::sleep(Duration::from_secs(21)).await;
    assert_eq!(
        sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap().0,
        403,
        "expired"
    );
    // A new boot gets a new token, which gets the data once.
    sim.reboot();
    let fresh =
        siteboot_tests::wait::for_async("a fresh token", Duration::from_secs(60), || async {
            sim.token().filter(|t| *t != token)
        })
        .await
        .unwrap();
    let (status, data) = sim.http("GET", "/agent/v1/bootstrap", Some(&fresh), None).unwrap();
    assert_eq!((status, data.as_str()), (200, secret_value));
    a_taken_over_boot_plane_reads_no_tenant_secret(&lab).await;
    assert_eq!(
        sim.http("GET", "/agent/v1/bootstrap", Some(&fresh), None).unwrap().0,
        409,
        "replayed"
    );
    // The previous operation's token is no good any more.
    assert_eq!(
        sim.http("POST", "/agent/v1/progress", Some(&old), Some(&json!({ "step": "x" })))
            .unwrap()
            .0,
        403
    );
    assert_eq!(sim.task(&fresh).unwrap()["action"], "provision");
    let (status, body) =
        sim.http("POST", "/agent/v1/complete", Some(&fresh), Some(&json!({ "ok": true }))).unwrap();
    assert_eq!(status, 200, "{body}");
    sim.reboot();
    lab.wait_running("workers", 1, ROLLOUT).await.unwrap();

    // Every refusal was logged with its reason; no token and no join secret was, by either
    // process.
    let log = lab.siteboot.log() + &lab.controller.as_ref().unwrap().log();
    for reason in
        ["no Host has this MAC", "wrong token", "bootstrap data already delivered", "token expired"]
    {
        assert!(log.contains(reason), "refusal {reason:?} not logged");
    }
    for secret in [token.as_str(), fresh.as_str(), "abcdef.0123456789abcdef"] {
        assert!(!log.contains(secret), "a secret appeared in siteboot's log");
    }
    let host = serde_json::to_string(&lab.hosts().get("host-0").await.unwrap()).unwrap();
    assert!(
        !host.contains("abcdef.0123456789abcdef") && !host.contains(&fresh),
        "a secret appeared in the Host"
    );
    let events = kube::Api::<k8s_openapi::api::events::v1::Event>::all(lab.env.client())
        .list(&ListParams::default())
        .await
        .unwrap();
    let events = serde_json::to_string(&events.items).unwrap();
    assert!(
        !events.contains("abcdef.0123456789abcdef") && !events.contains(&fresh),
        "a secret appeared in an Event"
    );
}

/// Whoever takes over the process on the segment holds its credentials: with them, the tenant's
/// bootstrap Secret and every other Secret beyond the appliance's namespace are refused (403),
/// and what the controller staged there is gone once delivered. The controller's credentials
/// read the same Secret: the refusal is the split's doing, not the Secret's absence.
async fn a_taken_over_boot_plane_reads_no_tenant_secret(lab: &ProviderLab) {
    use k8s_openapi::api::core::v1::Secret;
    let segment = lab.segment_client().await.unwrap();
    let status = |result: Result<Secret, kube::Error>| match result {
        Ok(_) => 200,
        Err(kube::Error::Api(e)) => e.code,
        Err(e) => panic!("{e}"),
    };
    let tenant = kube::Api::<Secret>::namespaced(segment.clone(), NS);
    assert_eq!(status(tenant.get("c5-bootstrap").await), 403, "the tenant's bootstrap Secret");
    assert!(tenant.list(&ListParams::default()).await.is_err(), "listed the tenant's Secrets");
    let anywhere = kube::Api::<Secret>::all(segment);
    assert!(anywhere.list(&ListParams::default()).await.is_err(), "listed every Secret");
    let controller = kube::Api::<Secret>::namespaced(lab.siteboot_client().await.unwrap(), NS);
    assert_eq!(status(controller.get("c5-bootstrap").await), 200, "the controller reads it");
    let staged = kube::Api::<Secret>::namespaced(lab.env.client(), SYSTEM_NS);
    siteboot_tests::wait::for_async("the staged copy to go", Duration::from_secs(30), || async {
        let names: Vec<String> = staged
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .filter_map(|s| s.metadata.name)
            .filter(|n| n.starts_with("siteboot-bootstrap-"))
            .collect();
        names.is_empty().then_some(())
    })
    .await
    .unwrap();
}

fn step_of(host: &siteboot_controller::crd::Host) -> Option<&str> {
    host.status.as_ref()?.operation.as_ref()?.step.as_deref()
}

/// The token of the manual host's ramdisk. A host that booted before its Host was Inspecting
/// sits in the ramdisk without one, waiting for work: it is power-cycled, as a BMC would.
async fn wait_token(sim: &siteboot_tests::sim::SimHost) -> String {
    siteboot_tests::wait::for_async(
        "the host to boot the ramdisk with a token",
        Duration::from_secs(120),
        || async {
            let token = sim.token();
            if token.is_none() && sim.phase() == siteboot_tests::sim::Phase::Ramdisk {
                sim.reboot();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            token
        },
    )
    .await
    .unwrap()
}

/// Two appliances of one site reconcile at once (no leader election, so both are active): every
/// claim is a compare-and-swap, so no Host ever has two Machines and no Machine two Hosts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_appliances_never_claim_one_host_twice() {
    let no_election =
        |config: &mut serde_json::Value| config["kubernetes"]["leader_election"] = json!(false);
    let lab = ProviderLab::start(6, no_election).await.unwrap();
    let other = lab
        .other_appliance(|config| {
            no_election(config);
            config["dhcp"] = json!({ "mode": "off" });
        })
        .unwrap();
    lab.create_cluster("c6", "#cloud-config\n").await.unwrap();
    lab.create_template("t", "v1").await.unwrap();
    lab.create_machine_deployment("workers", "c6", "t", 6).await.unwrap();
    for round in 0..2 {
        lab.wait_running("workers", 6, ROLLOUT)
            .await
            .unwrap_or_else(|e| panic!("round {round}: {e:#}"));
        assert_one_to_one(&lab).await;
        lab.scale("workers", 0).await.unwrap();
        lab.wait_hosts(HostState::Available, 6, ROLLOUT).await.unwrap();
        wait_sbm_count(&lab, 0).await;
        assert!(
            lab.hosts()
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .iter()
                .all(|h| h.spec.consumer_ref.is_none()),
            "a claim outlived its machine"
        );
        lab.scale("workers", 6).await.unwrap();
    }
    lab.wait_running("workers", 6, ROLLOUT).await.unwrap();
    assert_one_to_one(&lab).await;
    // Claims that lost the race to bind the machine are given back at once; every other claim
    // is one Machine's one host.
    let count = |pattern: &str| {
        lab.siteboot.log().matches(pattern).count() + other.siteboot.log().matches(pattern).count()
    };
    // A claim that lost the bind is released as an orphan (`machine::plan::release_orphan`).
    let given_back = count("that it did not make or does not use");
    let claims = count("claimed a Host");
    eprintln!("claims: {claims}, given back after losing the bind: {given_back}");
    assert_eq!(claims - given_back, 18, "every Machine claimed exactly one host, once");
}

/// Every SitebootMachine has one Host, and that Host names it as its only consumer.
async fn assert_one_to_one(lab: &ProviderLab) {
    let sbms = lab.api("SitebootMachine").list(&ListParams::default()).await.unwrap().items;
    let hosts = lab.hosts().list(&ListParams::default()).await.unwrap().items;
    let mut seen = std::collections::BTreeSet::new();
    for sbm in &sbms {
        let host = sbm.data["spec"]["hostRef"]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("{} has no host", sbm.name_any()));
        assert!(seen.insert(host.to_owned()), "host {host} is bound to two machines");
        let claimers: Vec<_> = hosts
            .iter()
            .filter(|h| h.spec.consumer_ref.as_ref().is_some_and(|c| c.name == sbm.name_any()))
            .map(|h| h.name_any())
            .collect();
        assert_eq!(claimers, [host.to_owned()], "{} is claimed by {claimers:?}", sbm.name_any());
    }
}

/// With leader election, one replica of a site reconciles; when it dies, another takes the
/// site's Lease and carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn another_replica_takes_over_when_the_leader_dies() {
    let lab = ProviderLab::start(1, |_| {}).await.unwrap();
    let other = lab.other_appliance(|config| config["dhcp"] = json!({ "mode": "off" })).unwrap();
    let leases = kube::Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
        lab.env.client(),
        "siteboot-system",
    );
    let sites = kube::Api::<siteboot_controller::crd::Site>::all(lab.env.client());
    let holder =
        || async { leases.get_opt("siteboot-lab").await.ok().flatten()?.spec?.holder_identity };
    // Waits until the appliance with `pid` holds the Lease and writes the Site heartbeat.
    let leads = |pid: u32, what: &'static str| {
        let (holder, sites) = (&holder, &sites);
        async move {
            let leader = siteboot_tests::wait::for_async(what, Duration::from_secs(90), || async {
                holder().await.filter(|h| h.ends_with(&format!("-{pid}")))
            })
            .await
            .unwrap();
            siteboot_tests::wait::for_async(
                "the Site heartbeat from the leader",
                Duration::from_secs(60),
                || async { (sites.get("lab").await.ok()?.status?.leader? == leader).then_some(()) },
            )
            .await
            .unwrap();
        }
    };
    leads(lab.siteboot.pid().unwrap(), "the first appliance to lead").await;
    lab.siteboot.kill9();
    leads(other.siteboot.pid().unwrap(), "the other appliance to take the Lease").await;
    // The new leader reconciles: a new Host is registered and sent to inspection.
    let host: siteboot_controller::crd::Host = serde_json::from_value(json!({
        "apiVersion": "siteboot.dev/v1alpha1", "kind": "Host",
        "metadata": { "name": "host-9", "labels": { "siteboot.dev/site": "lab" } },
        "spec": { "bootMACAddress": "52:54:00:00:0c:09" },
    }))
    .unwrap();
    lab.hosts().create(&kube::api::PostParams::default(), &host).await.unwrap();
    lab.wait_hosts(HostState::Inspecting, 1, Duration::from_secs(60)).await.unwrap();
}

/// A bootstrap template that does not pass `--provider-id` to the kubelet: the Node registers
/// under a name of its own with no providerID, and siteboot sets it, matching the Node by the
/// system UUID the ramdisk reported, never by name. A Node with another UUID is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_without_provider_id_gets_it_by_its_system_uuid() {
    let lab = ProviderLab::start(1, |_| {}).await.unwrap();
    lab.kubelets_without_provider_id();
    let nodes: Api<Node> = Api::all(lab.env.client());
    // A stranger: no providerID, a UUID of no host, and the name a careless match would pick.
    let decoy: Node = serde_json::from_value(json!({ "metadata": { "name": "host-0" } })).unwrap();
    nodes.create(&kube::api::PostParams::default(), &decoy).await.unwrap();
    let info = json!({ "status": { "nodeInfo": {
        "systemUUID": "00000000-0000-4000-8000-00000000dead", "machineID": "", "bootID": "",
        "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "", "kubeletVersion": "",
        "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
    } } });
    nodes.patch_status("host-0", &PatchParams::default(), &Patch::Merge(&info)).await.unwrap();

    lab.create_cluster("c6", "#cloud-config\n").await.unwrap();
    lab.create_template("t", "v1").await.unwrap();
    lab.create_machine_deployment("workers", "c6", "t", 1).await.unwrap();
    let machine = match lab.wait_running("workers", 1, ROLLOUT).await {
        Ok(mut running) => running.remove(0),
        Err(e) => panic!("{e:#}\n{}", lab.describe().await),
    };
    assert_eq!(machine.data["status"]["nodeRef"]["name"], "kubelet-host-0", "{machine:?}");
    let node = nodes.get("kubelet-host-0").await.unwrap();
    assert_eq!(
        node.spec.and_then(|s| s.provider_id).as_deref(),
        Some("siteboot://metal/host-0"),
        "the Node found by its system UUID got the providerID"
    );
    let decoy = nodes.get("host-0").await.unwrap();
    assert_eq!(decoy.spec.and_then(|s| s.provider_id), None, "the stranger is left alone");
    // The machine's next pass (woken by the nodeRef, or its requeue) reports the link.
    let sbms = lab.api("SitebootMachine");
    let linked = siteboot_tests::wait::for_async("NodeHasProviderID True", ROLLOUT, || async {
        let sbm = sbms.list(&ListParams::default()).await.ok()?.items.pop()?;
        (condition(&sbm, "NodeHasProviderID")["status"] == "True").then_some(())
    })
    .await;
    if let Err(e) = linked {
        panic!("{e:#}\n{}", lab.describe().await);
    }
}

/// A SitebootMachineTemplate tells the cluster autoscaler what its machines will have (to scale
/// from zero): the fewest CPUs and least memory among the inspected Hosts its selector matches,
/// kept current as Hosts are inspected and relabelled; nothing once none matches.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn machine_templates_report_the_capacity_of_the_hosts_they_select() {
    let lab = ProviderLab::start_with(Sims { count: 2, manual: 1 }, |_| {}).await.unwrap();
    let templates = lab.api("SitebootMachineTemplate");
    for (name, selector) in
        [("any", json!({})), ("small", json!({ "matchLabels": { "pool": "small" } }))]
    {
        let template = serde_json::from_value(json!({
            "apiVersion": siteboot_tests::provider::INFRA, "kind": "SitebootMachineTemplate",
            "metadata": { "name": name },
            "spec": { "template": { "spec": { "image": image_spec("v1"), "hostSelector": selector } } },
        }))
        .unwrap();
        templates.create(&Default::default(), &template).await.unwrap();
    }
    let wait_status = |name: &'static str, want: serde_json::Value| {
        let templates = templates.clone();
        async move {
            let what = format!("status {want}");
            let timeout = Duration::from_secs(60);
            wait_object(&templates, name, &what, timeout, |t| t.data["status"] == want)
                .await
                .unwrap();
        }
    };
    let capacity = |cpu: &str, memory: &str| {
        json!({ "capacity": { "cpu": cpu, "memory": memory },
                "nodeInfo": { "architecture": "amd64", "operatingSystem": "linux" } })
    };

    // The simulated host inspected by itself: 4 CPUs, 8 GiB, x86_64; the other is not yet.
    lab.wait_hosts(HostState::Available, 1, Duration::from_secs(60)).await.unwrap();
    wait_status("any", capacity("4", "8192Mi")).await;

    // The other reports less: the template promises what the smaller one has.
    let sim = lab.sims().remove(0);
    let token = wait_token(&sim).await;
    let small = json!({ "cpus": 2, "memoryMiB": 3072, "arch": "x86_64", "disks": [], "nics": [] });
    let (status, body) =
        sim.http("POST", "/agent/v1/inspection", Some(&token), Some(&small)).unwrap();
    assert_eq!(status, 200, "{body}");
    lab.wait_hosts(HostState::Available, 2, Duration::from_secs(60)).await.unwrap();
    wait_status("any", capacity("2", "3072Mi")).await;

    // A selector follows the labels: matched, then matched no more.
    let label =
        |value: Option<&str>| Patch::Merge(json!({ "metadata": { "labels": { "pool": value } } }));
    let host = siteboot_tests::provider::host_name(0);
    lab.hosts().patch(&host, &PatchParams::default(), &label(Some("small"))).await.unwrap();
    wait_status("small", capacity("2", "3072Mi")).await;
    lab.hosts().patch(&host, &PatchParams::default(), &label(None)).await.unwrap();
    wait_status("small", json!({})).await;

    // What `kubectl get sitebootmachinetemplates` shows.
    let table = lab
        .table("/apis/infrastructure.cluster.x-k8s.io/v1alpha1/namespaces/metal/sitebootmachinetemplates")
        .await
        .unwrap();
    assert_eq!(columns(&table)[..3], ["Name", "CPU", "Memory"]);
    let rows = cells(&table);
    assert_eq!(rows[0][..3], ["any", "2", "3072Mi"]);
    assert_eq!(rows[1][..3], ["small", "", ""]);
}
