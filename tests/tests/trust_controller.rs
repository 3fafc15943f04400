//! Attacks on the provider's side of the trust boundary, against the real CAPI controllers, in
//! one lab: someone who may edit Hosts (but not read Secrets) plants a Host for a waiting
//! machine, points a Host at another namespace's kubeconfig, and makes a second Host with a
//! claimed host's boot MAC; a host asks for its bootstrap data again after delivery; a host
//! whose wipe failed is released and retried; a claimed Host is deleted. Round two (issue 22):
//! the Host editor swaps the image mid-provisioning and sets `wipe: none` on a used host.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use siteboot_controller::crd::{ConsumerRef, Host, HostSpec, HostState, SITE_LABEL};
use siteboot_tests::provider::{NS, ProviderLab, SITE, Sims, image_spec};
use siteboot_tests::sim::SimHost;
use siteboot_tests::wait;

const STEP: Duration = Duration::from_secs(60);
const SECRET_VALUE: &str = "#cloud-config\nkubeadm-join-token: abcdef.0123456789abcdef\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn host_editors_and_replays_get_no_join_secrets_and_used_hosts_are_wiped() {
    let lab = ProviderLab::start_with(Sims { count: 1, manual: 1 }, |_| {}).await.unwrap();
    let sim = lab.sims().remove(0);
    let hosts = lab.hosts();

    // A machine waits: its only host is still being inspected.
    lab.create_cluster("c", SECRET_VALUE).await.unwrap();
    // The tenant asks for a full wipe of its hosts when it lets go of them.
    lab.create_template_spec("t", json!({ "image": image_spec("v1"), "wipe": "full" }))
        .await
        .unwrap();
    lab.create_machine_deployment("workers", "c", "t", 1).await.unwrap();
    let sbm = wait::for_async("a SitebootMachine", STEP, || async {
        lab.api("SitebootMachine").list(&ListParams::default()).await.ok()?.items.pop()
    })
    .await
    .unwrap();

    // Hole 4: a Host made by someone who may edit Hosts, naming the waiting machine.
    let mut planted = Host::new("planted", HostSpec::new("52:54:00:00:0e:01"));
    planted.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), SITE.to_owned())]));
    planted.spec.consumer_ref = Some(ConsumerRef {
        api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
        kind: "SitebootMachine".into(),
        namespace: NS.into(),
        name: sbm.name_any(),
        uid: sbm.uid().unwrap(),
    });
    hosts.create(&PostParams::default(), &planted).await.unwrap();
    let given_back = wait::for_async("the planted Host to be given back", STEP, || async {
        let h = hosts.get("planted").await.ok()?;
        h.spec.consumer_ref.is_none().then_some(())
    })
    .await;
    if let Err(e) = given_back {
        panic!("{e}\n{}", lab.describe().await);
    }
    let sbm = lab.api("SitebootMachine").get(&sbm.name_any()).await.unwrap();
    assert!(sbm.data["spec"]["hostRef"].is_null(), "the planted Host was adopted: {sbm:?}");
    hosts.delete("planted", &DeleteParams::default()).await.unwrap();

    // The real host is inspected and claimed.
    let token = wait_new_token(&sim, None).await;
    let (status, body) = sim
        .http("POST", "/agent/v1/inspection", Some(&token), Some(&siteboot_tests::sim::hardware()))
        .unwrap();
    assert_eq!(status, 200, "{body}");
    lab.wait_hosts(HostState::Provisioning, 1, STEP).await.unwrap();
    sim.reboot();
    let token = wait_new_token(&sim, Some(&token)).await;

    // Round two, item 5: someone who may edit Hosts swaps `spec.provisioning.image` for their
    // own OS just before the ramdisk asks for its task, and again each time it is told to wait.
    // The task names the machine's image, frozen into the operation.
    let swap = json!({ "spec": { "provisioning": { "image": image_spec("v2") } } });
    let task = wait::for_async("a provision task", STEP, || async {
        hosts.patch("host-0", &PatchParams::default(), &Patch::Merge(&swap)).await.ok()?;
        let (status, body) = sim.http("GET", "/agent/v1/task", Some(&token), None).ok()?;
        let task: serde_json::Value = serde_json::from_str(&body).ok().filter(|_| status == 200)?;
        (task["action"] != "wait").then_some(task)
    })
    .await
    .unwrap();
    assert_eq!(
        (&task["action"], &task["image"]["checksum"]),
        (&json!("provision"), &image_spec("v1")["checksum"]),
        "the Host editor's image was handed out: {task}"
    );
    hosts.patch("host-0", &PatchParams::default(), &Patch::Merge(&swap)).await.unwrap();
    let again = sim.task(&token).unwrap();
    assert_eq!(again["image"]["checksum"], image_spec("v1")["checksum"], "{again}");

    // Hole 3: the Host pointed at another namespace's kubeconfig. The field no longer exists
    // (it is pruned), and siteboot may not read Secrets there at all.
    siteboot_tests::kube::capi::create_namespace(&lab.env, "victim").await.unwrap();
    let kubeconfig = "apiVersion: v1\nkind: Config\n# cluster-admin of the victim\n";
    siteboot_tests::kube::capi::create_bootstrap_secret(
        &lab.env,
        "victim",
        "prod",
        "prod-kubeconfig",
        kubeconfig,
    )
    .await
    .unwrap();
    let retarget = json!({ "spec": { "provisioning": { "bootstrapDataSecret": { "namespace": "victim", "name": "prod-kubeconfig" } } } });
    hosts.patch("host-0", &PatchParams::default(), &Patch::Merge(&retarget)).await.unwrap();
    let as_siteboot: Api<Secret> = Api::namespaced(lab.siteboot_client().await.unwrap(), "victim");
    let read = as_siteboot.get("prod-kubeconfig").await;
    assert!(
        matches!(&read, Err(kube::Error::Api(e)) if e.code == 403),
        "siteboot's ServiceAccount may read another namespace's Secrets: {:?}",
        read.map(|s| s.name_any())
    );

    // Hole 2: the data once; no new token for the operation after that.
    let (status, data) = sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap();
    assert_eq!((status, data.as_str()), (200, SECRET_VALUE), "the Machine's data, nothing else");
    let tokenless = || sim.log().matches("in the ramdisk (token: false)").count();
    let before = tokenless();
    sim.reboot();
    wait::for_async("the host back in the ramdisk, with no token", STEP, || async {
        (tokenless() > before).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("a new token after delivery? {e}\n{}", sim.log()));
    assert_eq!(sim.http("GET", "/agent/v1/bootstrap", Some(&token), None).unwrap().0, 409);
    wait_event(&lab, "host-0", "TokenRefused").await;
    wait_event(&lab, "host-0", "BootstrapDataReplayed").await;
    let (status, body) =
        sim.http("POST", "/agent/v1/complete", Some(&token), Some(&json!({ "ok": true }))).unwrap();
    assert_eq!(status, 200, "{body}");
    sim.reboot();
    lab.wait_running("workers", 1, STEP).await.unwrap();

    // Hole 5: a second Host with host-0's boot MAC, in another namespace: neither boots.
    siteboot_tests::kube::capi::create_namespace(&lab.env, "other").await.unwrap();
    let others: Api<Host> = Api::namespaced(lab.env.client(), "other");
    let mut twin = Host::new("twin", HostSpec::new(sim.mac()));
    twin.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), SITE.to_owned())]));
    others.create(&PostParams::default(), &twin).await.unwrap();
    for api in [&hosts, &others] {
        let name = if std::ptr::eq(api, &hosts) { "host-0" } else { "twin" };
        wait::for_async("a DuplicateBootMAC condition", STEP, || async {
            let h = api.get(name).await.ok()?;
            let conditions = h.status?.conditions;
            conditions
                .iter()
                .any(|c| c.type_ == "BootMACUnique" && c.reason == "DuplicateBootMAC")
                .then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let (status, _) = sim
        .http("GET", &format!("/boot/{}.ipxe", sim.mac().replace(':', "-")), None, None)
        .unwrap();
    assert_eq!(status, 404, "a MAC two Hosts claim boots nothing");
    others.delete("twin", &DeleteParams::default()).await.unwrap();
    siteboot_tests::kube::capi::wait_gone(&others, "twin", STEP).await.unwrap();

    // Hole 6: a claimed Host is deleted: it stays until released and wiped.
    hosts.delete("host-0", &DeleteParams::default()).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let h = hosts.get("host-0").await.expect("a claimed Host is kept");
    assert_eq!(h.status.unwrap().state, Some(HostState::Provisioned));

    // The machine goes; the wipe fails; the host is Quarantined and released; it is wiped
    // before it goes (and would be before any reuse). Round two, item 8: a Host editor's
    // `wipe: none` skips nothing, and the tenant's `full` is what the ramdisk is told.
    let no_wipe = json!({ "spec": { "wipe": "none" } });
    hosts.patch("host-0", &PatchParams::default(), &Patch::Merge(&no_wipe)).await.unwrap();
    lab.scale("workers", 0).await.unwrap();
    let wipe = wait_new_token(&sim, None).await;
    assert_eq!(sim.task(&wipe).unwrap()["wipe"], "full", "the tenant's wipe, not the editor's");
    let (status, _) = sim
        .http(
            "POST",
            "/agent/v1/complete",
            Some(&wipe),
            Some(&json!({ "ok": false, "message": "sda did not wipe" })),
        )
        .unwrap();
    assert_eq!(status, 200);
    let wiped_again = wait::for_async("the failed host to be wiped again", STEP, || async {
        let h = hosts.get("host-0").await.ok()?;
        (h.spec.consumer_ref.is_none() && h.status?.state == Some(HostState::Deprovisioning))
            .then_some(())
    })
    .await;
    if let Err(e) = wiped_again {
        panic!("{e}\n{}", lab.describe().await);
    }
    sim.reboot();
    let wipe = wait_new_token(&sim, Some(&wipe)).await;
    assert_eq!(sim.task(&wipe).unwrap()["wipe"], "full", "still owed after a failed wipe");
    let (status, _) =
        sim.http("POST", "/agent/v1/complete", Some(&wipe), Some(&json!({ "ok": true }))).unwrap();
    assert_eq!(status, 200);
    siteboot_tests::kube::capi::wait_gone(&hosts, "host-0", STEP).await.unwrap();

    let log = lab.siteboot.log();
    assert!(!log.contains("abcdef.0123456789abcdef") && !log.contains("cluster-admin"));
}

async fn wait_new_token(sim: &SimHost, old: Option<&str>) -> String {
    wait::for_async("a new ramdisk token", STEP, || async {
        sim.token().filter(|t| Some(t.as_str()) != old)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", sim.log()))
}

async fn wait_event(lab: &ProviderLab, host: &str, reason: &str) {
    let events: Api<Event> = Api::namespaced(lab.env.client(), NS);
    wait::for_async(&format!("a {reason} Warning Event on {host}"), STEP, || async {
        let list = events.list(&ListParams::default()).await.ok()?;
        list.items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some(reason)
                    && e.type_.as_deref() == Some("Warning")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(host)
            })
            .then_some(())
    })
    .await
    .unwrap();
}
