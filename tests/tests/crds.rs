//! siteboot's CRDs in the real apiserver: the validation they declare (patterns, CEL
//! immutability) and the templates' admission policy refuse bad objects and changes, Cluster
//! API's topology dry-runs get through, and conditions merge per type under server-side apply.

use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::json;
use siteboot_controller::manifests::{self, TOPOLOGY_DRY_RUN_ANNOTATION};
use siteboot_tests::admission::{self, IMMUTABLE};
use siteboot_tests::kube::KubeEnv;

const INFRA: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";
const BOOTSTRAP: &str = "bootstrap.cluster.x-k8s.io/v1alpha1";

async fn create(
    api: &Api<DynamicObject>,
    object: serde_json::Value,
) -> Result<DynamicObject, kube::Error> {
    api.create(&PostParams::default(), &serde_json::from_value(object).unwrap()).await
}

fn refused(result: Result<DynamicObject, kube::Error>, why: &str) {
    match result {
        Err(kube::Error::Api(status)) if status.code == 422 => {
            assert!(
                status.message.contains(why),
                "refused, but not for {why:?}: {}",
                status.message
            )
        }
        other => panic!("expected a 422 mentioning {why:?}, got {other:?}"),
    }
}

fn image(url: &str, checksum: &str) -> serde_json::Value {
    json!({ "url": url, "checksum": checksum })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crd_validation_refuses_bad_objects_and_conditions_merge() {
    let env = KubeEnv::start().await.unwrap();
    for crd in manifests::crds() {
        env.install_crd(&serde_json::to_value(crd).unwrap()).await.unwrap();
    }
    let hosts = env.api("siteboot.dev/v1alpha1", "Host", Some("default"));
    let host = |name: &str, mac: &str| json!({ "apiVersion": "siteboot.dev/v1alpha1", "kind": "Host", "metadata": { "name": name }, "spec": { "bootMACAddress": mac } });
    refused(create(&hosts, host("bad-mac", "52:54:00:ZZ:00:01")).await, "bootMACAddress");
    refused(create(&hosts, host("upper", "52:54:00:AB:00:01")).await, "bootMACAddress");
    create(&hosts, host("h1", "52:54:00:00:00:01")).await.unwrap();
    // spec.relayAgent: each value text (printable ASCII) or hex: and byte pairs; one at least.
    let pinned = |name: &str, mac: &str, relay_agent: serde_json::Value| {
        let mut host = host(name, mac);
        host["spec"]["relayAgent"] = relay_agent;
        host
    };
    for (name, relay_agent, why) in [
        ("pin-hex", json!({ "circuitID": "hex:zz" }), "circuitID"),
        ("pin-ctl", json!({ "remoteID": "eth1\n" }), "remoteID"),
        ("pin-long", json!({ "circuitID": "x".repeat(256) }), "circuitID"),
        ("pin-none", json!({}), "relayAgent"),
    ] {
        refused(create(&hosts, pinned(name, "52:54:00:00:00:11", relay_agent)).await, why);
    }
    let relay_agent = json!({ "circuitID": "eth1/0/12", "remoteID": "hex:000c29a1b2c3" });
    create(&hosts, pinned("pinned", "52:54:00:00:00:12", relay_agent)).await.unwrap();
    let change_mac = json!({ "spec": { "bootMACAddress": "52:54:00:00:00:02" } });
    match hosts.patch("h1", &PatchParams::default(), &Patch::Merge(change_mac)).await {
        Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains("immutable") => {}
        other => panic!("changing the boot MAC should be refused: {other:?}"),
    }

    let good = "sha256:".to_owned() + &"a".repeat(64);
    let sbms = env.api(INFRA, "SitebootMachine", Some("default"));
    let sbm = |name: &str, image: serde_json::Value| json!({ "apiVersion": INFRA, "kind": "SitebootMachine", "metadata": { "name": name }, "spec": { "image": image } });
    refused(create(&sbms, sbm("m1", image("ftp://x/img", &good))).await, "url");
    refused(create(&sbms, sbm("m2", image("http://x/img", "md5:abc"))).await, "checksum");
    create(&sbms, sbm("m3", image("http://x/img", &good))).await.unwrap();
    let set =
        |field: &str, value: serde_json::Value| Patch::Merge(json!({ "spec": { field: value } }));
    sbms.patch(
        "m3",
        &PatchParams::default(),
        &set("hostRef", json!({ "namespace": "default", "name": "h1" })),
    )
    .await
    .unwrap();
    match sbms
        .patch(
            "m3",
            &PatchParams::default(),
            &set("hostRef", json!({ "namespace": "default", "name": "h2" })),
        )
        .await
    {
        Err(kube::Error::Api(s))
            if s.code == 422 && s.message.contains("hostRef cannot change") => {}
        other => panic!("re-pointing hostRef should be refused: {other:?}"),
    }

    templates_are_immutable_but_for_topology_dry_runs(&env, &good).await;

    // Two field managers applying different condition types: both stay (a list-map by type).
    let condition = |type_: &str| json!({ "type": type_, "status": "True", "reason": "Test", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z" });
    for (manager, type_) in [("one", "Ready"), ("two", "Claimed")] {
        let status = json!({ "apiVersion": "siteboot.dev/v1alpha1", "kind": "Host", "metadata": { "name": "h1" }, "status": { "conditions": [condition(type_)] } });
        hosts
            .patch_status("h1", &PatchParams::apply(manager).force(), &Patch::Apply(status))
            .await
            .unwrap();
    }
    let h1 = hosts.get("h1").await.unwrap();
    let types: Vec<&str> = h1.data["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["Ready", "Claimed"]);
}

/// What the policy of `manifests::admission_policy` lets through: nothing that changes a
/// template's spec, but Cluster API's topology dry-runs (server-side apply or update with
/// `dryRun` and the annotation), which compute a ClusterClass's diff.
async fn templates_are_immutable_but_for_topology_dry_runs(env: &KubeEnv, checksum: &str) {
    let templates = env.api(INFRA, "SitebootMachineTemplate", Some("default"));
    let annotations = |annotated: bool| {
        if annotated { json!({ TOPOLOGY_DRY_RUN_ANNOTATION: "" }) } else { json!({}) }
    };
    let template = |url: &str, annotated: bool| {
        json!({ "apiVersion": INFRA, "kind": "SitebootMachineTemplate",
            "metadata": { "name": "t1", "annotations": annotations(annotated) },
            "spec": { "template": { "spec": { "image": image(url, checksum) } } } })
    };
    admission::install(env, "default").await.unwrap();
    create(&templates, template("http://x/img", false)).await.unwrap();
    let new_image = |annotated: bool| {
        Patch::Merge(json!({ "metadata": { "annotations": annotations(annotated) },
            "spec": { "template": { "spec": { "image": image("http://x/other", checksum) } } } }))
    };
    let patch = |params, annotated| {
        let templates = templates.clone();
        async move { templates.patch("t1", &params, &new_image(annotated)).await }
    };
    // A user's change, dry-run or not, and one with the annotation but no dryRun.
    refused(patch(PatchParams { dry_run: true, ..Default::default() }, false).await, IMMUTABLE);
    refused(patch(PatchParams::default(), false).await, IMMUTABLE);
    refused(patch(PatchParams::default(), true).await, IMMUTABLE);

    // The topology controller's two dry-runs: server-side apply, forced, and an update.
    let apply = PatchParams { dry_run: true, ..PatchParams::apply("capi-topology").force() };
    let applied = templates
        .patch("t1", &apply, &Patch::Apply(template("http://x/other", true)))
        .await
        .expect("a topology dry-run apply is accepted");
    assert_eq!(applied.data["spec"]["template"]["spec"]["image"]["url"], "http://x/other");
    let mut replaced: DynamicObject =
        serde_json::from_value(template("http://x/third", true)).unwrap();
    replaced.metadata.resource_version = applied.metadata.resource_version.clone();
    let replace = PostParams { dry_run: true, ..Default::default() };
    let replaced = templates
        .replace("t1", &replace, &replaced)
        .await
        .expect("a topology dry-run update is accepted");
    assert_eq!(replaced.data["spec"]["template"]["spec"]["image"]["url"], "http://x/third");
    let stored = templates.get("t1").await.unwrap();
    assert_eq!(stored.data["spec"]["template"]["spec"]["image"]["url"], "http://x/img");
    // Metadata stays writable (Cluster API sets owner references and labels on templates).
    let label = Patch::Merge(
        json!({ "metadata": { "labels": { "cluster.x-k8s.io/cluster-name": "c1" } } }),
    );
    templates.patch("t1", &PatchParams::default(), &label).await.unwrap();

    // The other two templates, the bootstrap one with no spec at all at first.
    let cluster_templates = env.api(INFRA, "SitebootClusterTemplate", Some("default"));
    create(
        &cluster_templates,
        json!({ "apiVersion": INFRA, "kind": "SitebootClusterTemplate",
        "metadata": { "name": "ct1" }, "spec": { "template": { "spec": { "sites": ["a"] } } } }),
    )
    .await
    .unwrap();
    let sites = Patch::Merge(json!({ "spec": { "template": { "spec": { "sites": ["b"] } } } }));
    refused(cluster_templates.patch("ct1", &PatchParams::default(), &sites).await, IMMUTABLE);
    let config_templates = env.api(BOOTSTRAP, "SitebootConfigTemplate", Some("default"));
    create(
        &config_templates,
        json!({ "apiVersion": BOOTSTRAP, "kind": "SitebootConfigTemplate",
        "metadata": { "name": "cfg1" }, "spec": { "template": {} } }),
    )
    .await
    .unwrap();
    config_templates.patch("cfg1", &PatchParams::default(), &label).await.unwrap();
    let commands =
        Patch::Merge(json!({ "spec": { "template": { "spec": { "preCommands": ["true"] } } } }));
    refused(config_templates.patch("cfg1", &PatchParams::default(), &commands).await, IMMUTABLE);
}
