//! Attacks on the provider's side of the trust boundary, against the real CAPI controllers, in
//! one lab: someone who may edit Hosts (but not read Secrets) plants a Host for a waiting
//! machine and points a Host at another namespace's kubeconfig; a host asks for its bootstrap
//! data again after delivery; a host whose wipe failed is released and retried; a claimed Host
//! is deleted. Round two (issue 22): the Host editor swaps the image mid-provisioning and sets
//! `wipe: none` on a used host; a tenant copies a pool host's boot MAC into a Host of its own
//! and asks for a host from a pool that does not list it.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use siteboot_controller::crd::{ConsumerRef, Host, HostSpec, HostState, SITE_LABEL};
use siteboot_controller::manifests;
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

/// Registers a Host (of no site siteboot serves) in the pool as `user`.
async fn register(lab: &ProviderLab, user: &str, name: &str) -> Result<Host, kube::Error> {
    let client = lab.env.client_as_user(user).await.unwrap();
    let mut host = Host::new(name, HostSpec::new("52:54:00:00:0e:01"));
    host.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), "elsewhere".to_owned())]));
    Api::<Host>::namespaced(client, NS).create(&PostParams::default(), &host).await
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

/// Issue 22 item 9: the lab's namespace is an operator's pool that lists one tenant, `team-a`.
/// Another tenant, `team-b`, who may write Hosts in its own namespace, copies the pool host's
/// boot MAC into a Host of its own, and asks for a host from the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_takes_hosts_only_from_its_pools_and_a_copied_mac_disables_only_the_copy() {
    let lab = ProviderLab::start(1, |cfg| {
        cfg["kubernetes"]["host_namespaces"] = json!([{ "namespace": NS, "tenants": ["team-a"] }]);
    })
    .await
    .unwrap();
    let sim = lab.sims().remove(0);
    let hosts = lab.hosts();
    for tenant in ["team-a", "team-b"] {
        siteboot_tests::kube::capi::create_namespace(&lab.env, tenant).await.unwrap();
    }

    // Who may register hardware in the pool: the shipped operator role, bound there to alice;
    // bob, admin of team-b (the built-in role, bound in his namespace), may not.
    let binding = |ns: &str, role: (&str, &str), user: &str| {
        serde_json::from_value::<kube::api::DynamicObject>(json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": { "name": format!("{user}-{}", role.1), "namespace": ns },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": role.0, "name": role.1 },
            "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user }],
        }))
        .unwrap()
    };
    let bindings = |ns: &str| {
        Api::<kube::api::DynamicObject>::namespaced_with(
            lab.env.client(),
            ns,
            &kube::discovery::ApiResource::erase::<k8s_openapi::api::rbac::v1::RoleBinding>(&()),
        )
    };
    let operator = ("ClusterRole", manifests::HOST_OPERATOR_ROLE);
    bindings(NS).create(&PostParams::default(), &binding(NS, operator, "alice")).await.unwrap();
    let admin = ("ClusterRole", "admin");
    bindings("team-b")
        .create(&PostParams::default(), &binding("team-b", admin, "bob"))
        .await
        .unwrap();
    match register(&lab, "bob", "bobs").await {
        Err(kube::Error::Api(e)) if e.code == 403 => {}
        other => panic!("a tenant's admin registered hardware in the pool: {other:?}"),
    }
    register(&lab, "alice", "alices")
        .await
        .expect("the operator role registers hardware in the pool");
    hosts.delete("alices", &DeleteParams::default()).await.unwrap();

    // team-b's Host with the pool host's boot MAC: only the copy is flagged, and its condition
    // names nothing of the pool's namespace.
    let copies: Api<Host> = Api::namespaced(lab.env.client(), "team-b");
    let mut copy = Host::new("copy", HostSpec::new(sim.mac()));
    copy.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), SITE.to_owned())]));
    copies.create(&PostParams::default(), &copy).await.unwrap();
    let flagged = wait::for_async("the copy's BootMACUnique=False", STEP, || async {
        let status = copies.get("copy").await.ok()?.status?;
        status.conditions.into_iter().find(|c| c.type_ == "BootMACUnique" && c.status == "False")
    })
    .await
    .unwrap();
    assert_eq!(flagged.reason, "DuplicateBootMAC", "{flagged:?}");
    assert!(
        !flagged.message.contains("host-0") && !flagged.message.contains(NS),
        "another namespace's Host is named to team-b: {}",
        flagged.message
    );
    let pool_host = hosts.get("host-0").await.unwrap();
    let unique =
        pool_host.status.unwrap().conditions.into_iter().find(|c| c.type_ == "BootMACUnique");
    assert_eq!(unique.map(|c| c.status), Some("True".to_owned()), "the pool host lost its MAC");
    let script = format!("/boot/{}.ipxe", sim.mac().replace(':', "-"));
    let (status, body) = sim.http("GET", &script, None, None).unwrap();
    assert_eq!(status, 200, "the pool host gets no boot script: {body}");

    // team-b is not one of the pool's tenants: its machine waits, the host stays free.
    lab.create_cluster_in("team-b", "b", SECRET_VALUE).await.unwrap();
    let from_pool = json!({ "image": image_spec("v1"), "hostSelector": { "namespace": NS } });
    lab.create_template_spec_in("team-b", "t", from_pool.clone()).await.unwrap();
    lab.create_machine_deployment_in("team-b", "workers", "b", "t", 1).await.unwrap();
    let refused = wait::for_async("team-b's machine refused, or a claim", STEP, || async {
        if let Some(claim) = hosts.get("host-0").await.ok()?.spec.consumer_ref {
            return Some(Err(claim));
        }
        let list = lab.api_in("team-b", "SitebootMachine").list(&ListParams::default()).await;
        let ready = list.ok()?.items.pop()?.data["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Ready" && c["reason"] == "HostNamespaceNotAllowed")?
            .clone();
        Some(Ok(ready))
    })
    .await;
    let refused = match refused {
        Ok(outcome) => outcome,
        Err(e) => panic!("{e}\n{}", lab.describe().await),
    };
    let refused = refused.unwrap_or_else(|claim| panic!("team-b claimed the pool host: {claim:?}"));
    assert!(refused["message"].as_str().unwrap().contains(NS), "{refused}");

    // team-a is: its machine claims the pool host, which boots into its provisioning.
    lab.create_cluster_in("team-a", "a", SECRET_VALUE).await.unwrap();
    lab.create_template_spec_in("team-a", "t", from_pool).await.unwrap();
    lab.create_machine_deployment_in("team-a", "workers", "a", "t", 1).await.unwrap();
    let claimed = wait::for_async("team-a's claim, provisioning", STEP, || async {
        let h = hosts.get("host-0").await.ok()?;
        let state = h.status.as_ref()?.state;
        (state == Some(HostState::Provisioning)).then_some(h.spec.consumer_ref?)
    })
    .await;
    let claimed = match claimed {
        Ok(claim) => claim,
        Err(e) => panic!("{e}\n{}", lab.describe().await),
    };
    assert_eq!(claimed.namespace, "team-a");
    wait_new_token(&sim, None).await;
}
