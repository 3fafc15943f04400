//! A ClusterClass-based Cluster on siteboot, against the real CAPI core manager with the
//! ClusterTopology feature gate: the class's SitebootClusterTemplate, SitebootMachineTemplate and
//! SitebootConfigTemplate (siteboot's bootstrap provider) are cloned by the topology controller,
//! its Machines get and provision hosts, and a class change rotates the machine template through
//! the topology controller's dry-runs, which the templates' admission policy lets through while
//! it refuses users' changes. The control plane is the provider tests' TestControlPlane (the
//! shared apiserver plays it), made from a TestControlPlaneTemplate.
//!
//! Needs `scripts/build-test-peers` and root (the lab namespace), like the provider tests.

use std::time::Duration;

use kube::ResourceExt;
use kube::api::{DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use siteboot_controller::crd::HostState;
use siteboot_tests::kube::capi::{self, CAPI, CONTROL_PLANE};
use siteboot_tests::provider::{INFRA, NS, ProviderLab, image_spec};

const BOOTSTRAP: &str = "bootstrap.cluster.x-k8s.io/v1alpha1";
const CLUSTER: &str = "cc1";
const VERSION: &str = "v1.36.3";
const ROLLOUT: Duration = Duration::from_secs(300);

/// The TestControlPlane's template, for a ClusterClass's `controlPlane.templateRef`.
const TEST_CONTROL_PLANE_TEMPLATE_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: testcontrolplanetemplates.controlplane.cluster.x-k8s.io
  labels:
    cluster.x-k8s.io/v1beta2: v1alpha1
spec:
  group: controlplane.cluster.x-k8s.io
  scope: Namespaced
  names:
    kind: TestControlPlaneTemplate
    listKind: TestControlPlaneTemplateList
    plural: testcontrolplanetemplates
    singular: testcontrolplanetemplate
  versions:
    - name: v1alpha1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec: { type: object, x-kubernetes-preserve-unknown-fields: true }
"#;

fn template_ref(api_version: &str, kind: &str, name: &str) -> Value {
    json!({ "templateRef": { "apiVersion": api_version, "kind": kind, "name": name } })
}

async fn create(lab: &ProviderLab, object: Value) {
    let api_version = object["apiVersion"].as_str().unwrap().to_owned();
    let kind = object["kind"].as_str().unwrap().to_owned();
    let object: DynamicObject = serde_json::from_value(object).unwrap();
    lab.env
        .api(&api_version, &kind, Some(NS))
        .create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("creating {kind}: {e}"));
}

/// The Machines of the cluster's `md-0`, once there are `count`, all Running with a Node,
/// with the image URL their SitebootMachine writes.
async fn wait_running(lab: &ProviderLab, count: usize, image: &str) -> Vec<DynamicObject> {
    let lp = ListParams::default().labels("topology.cluster.x-k8s.io/deployment-name=md-0");
    let url = image_spec(image)["url"].clone();
    let found = siteboot_tests::wait::for_async(
        &format!("{count} Machines of md-0 Running with image {image}"),
        ROLLOUT,
        || async {
            let machines = lab.api("Machine").list(&lp).await.ok()?.items;
            for m in &machines {
                let infra = m.data["spec"]["infrastructureRef"]["name"].as_str()?;
                let sbm = lab.api("SitebootMachine").get(infra).await.ok()?;
                let running = m.data["status"]["phase"] == "Running"
                    && m.data["status"]["nodeRef"]["name"].is_string();
                if !running || sbm.data["spec"]["image"]["url"] != url {
                    return None;
                }
            }
            (machines.len() == count).then_some(machines)
        },
    )
    .await;
    match found {
        Ok(machines) => machines,
        Err(e) => panic!("{e:#}\n{}", lab.describe().await),
    }
}

/// The name of the SitebootMachineTemplate the topology controller made for `md-0`.
async fn md_template(lab: &ProviderLab) -> String {
    let lp = ListParams::default().labels("topology.cluster.x-k8s.io/deployment-name=md-0");
    let mds = lab.api("MachineDeployment").list(&lp).await.unwrap().items;
    assert_eq!(mds.len(), 1, "{mds:?}");
    let infra = &mds[0].data["spec"]["template"]["spec"]["infrastructureRef"];
    assert_eq!(infra["kind"], "SitebootMachineTemplate");
    infra["name"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_class_cluster_provisions_hosts_and_rotates_its_machine_template() {
    let lab = ProviderLab::start(2, |_| {}).await.unwrap();
    let env = &lab.env;
    siteboot_tests::admission::install(env, NS).await.unwrap();
    env.install_crd_yaml(capi::TEST_CONTROL_PLANE_CRD).await.unwrap();
    env.install_crd_yaml(TEST_CONTROL_PLANE_TEMPLATE_CRD).await.unwrap();

    // The class and its templates.
    let spec = |spec: Value| json!({ "template": { "spec": spec } });
    let machine_template = |name: &str, image: &str| {
        json!({ "apiVersion": INFRA, "kind": "SitebootMachineTemplate", "metadata": { "name": name },
                "spec": spec(json!({ "image": image_spec(image) })) })
    };
    for object in [
        json!({ "apiVersion": INFRA, "kind": "SitebootClusterTemplate",
                "metadata": { "name": "siteboot" }, "spec": spec(json!({})) }),
        json!({ "apiVersion": CONTROL_PLANE, "kind": "TestControlPlaneTemplate",
                "metadata": { "name": "external" }, "spec": spec(json!({})) }),
        json!({ "apiVersion": BOOTSTRAP, "kind": "SitebootConfigTemplate",
                "metadata": { "name": "workers" }, "spec": spec(json!({})) }),
        machine_template("workers-v1", "v1"),
        json!({ "apiVersion": CAPI, "kind": "ClusterClass", "metadata": { "name": "siteboot" },
            "spec": {
                "infrastructure": template_ref(INFRA, "SitebootClusterTemplate", "siteboot"),
                "controlPlane": template_ref(CONTROL_PLANE, "TestControlPlaneTemplate", "external"),
                "workers": { "machineDeployments": [{
                    "class": "workers",
                    "bootstrap": template_ref(BOOTSTRAP, "SitebootConfigTemplate", "workers"),
                    "infrastructure": template_ref(INFRA, "SitebootMachineTemplate", "workers-v1"),
                }] },
            } }),
    ] {
        create(&lab, object).await;
    }

    // A Cluster of the class. Its control plane stands in for a hosted one, as the provider
    // tests' Clusters do: initialized at the requested version, workload cluster = this
    // apiserver.
    env.create_workload_kubeconfig_secret(NS, CLUSTER).await.unwrap();
    create(
        &lab,
        // Where hosts join (siteboot's bootstrap data waits for it): the test apiserver.
        json!({ "apiVersion": CAPI, "kind": "Cluster", "metadata": { "name": CLUSTER },
            "spec": {
              "controlPlaneEndpoint": { "host": "127.0.0.1", "port": env.apiserver_port() },
              "topology": {
                "classRef": { "name": "siteboot" },
                "version": VERSION,
                "workers": { "machineDeployments": [{ "class": "workers", "name": "md-0", "replicas": 1 }] },
            } } }),
    )
    .await;
    let control_planes = env.api(CONTROL_PLANE, "TestControlPlane", Some(NS));
    let lp = ListParams::default().labels(&format!("{}={CLUSTER}", capi::CLUSTER_NAME_LABEL));
    let control_plane =
        siteboot_tests::wait::for_async("the topology's control plane", ROLLOUT, || async {
            control_planes.list(&lp).await.ok()?.items.into_iter().next()
        })
        .await
        .unwrap();
    let status = json!({ "status": {
        "version": VERSION,
        "initialization": { "controlPlaneInitialized": true },
        "externalManagedControlPlane": true,
    } });
    control_planes
        .patch_status(&control_plane.name_any(), &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap();

    // Its Machine gets a host, provisioned with the class's image.
    let machines = wait_running(&lab, 1, "v1").await;
    lab.wait_hosts(HostState::Provisioned, 1, Duration::from_secs(30)).await.unwrap();
    let infra = machines[0].data["spec"]["infrastructureRef"]["name"].as_str().unwrap();
    let sbm = lab.api("SitebootMachine").get(infra).await.unwrap();
    let host = sbm.data["spec"]["hostRef"]["name"].as_str().unwrap().to_owned();
    assert_eq!(sbm.data["spec"]["providerID"], json!(format!("siteboot://{NS}/{host}")));
    assert_eq!(machines[0].data["spec"]["providerID"], sbm.data["spec"]["providerID"]);
    let first_template = md_template(&lab).await;
    assert_ne!(first_template, "workers-v1", "the topology controller clones the class's");
    // The clone says what its machines have, for the autoscaler.
    let clone = capi::wait_object(
        &lab.api("SitebootMachineTemplate"),
        &first_template,
        "capacity",
        Duration::from_secs(60),
        |t| t.data["status"]["capacity"] == json!({ "cpu": "4", "memory": "8192Mi" }),
    )
    .await;
    clone.unwrap();

    // A user cannot change the clone; the class can: a new template, rolled out.
    let change = Patch::Merge(json!({ "spec": spec(json!({ "image": image_spec("v2") })) }));
    let templates = lab.api("SitebootMachineTemplate");
    match templates.patch(&first_template, &PatchParams::default(), &change).await {
        Err(kube::Error::Api(s)) if s.message.contains(siteboot_tests::admission::IMMUTABLE) => {}
        other => panic!("a user's change of the clone should be refused: {other:?}"),
    }
    create(&lab, machine_template("workers-v2", "v2")).await;
    let class_change = Patch::Merge(json!({ "spec": { "workers": { "machineDeployments": [{
        "class": "workers",
        "bootstrap": template_ref(BOOTSTRAP, "SitebootConfigTemplate", "workers"),
        "infrastructure": template_ref(INFRA, "SitebootMachineTemplate", "workers-v2"),
    }] } } }));
    lab.api("ClusterClass")
        .patch("siteboot", &PatchParams::default(), &class_change)
        .await
        .unwrap();
    let machines = wait_running(&lab, 1, "v2").await;
    let rotated = md_template(&lab).await;
    assert_ne!(rotated, first_template);
    let infra = machines[0].data["spec"]["infrastructureRef"]["name"].as_str().unwrap();
    let sbm = lab.api("SitebootMachine").get(infra).await.unwrap();
    assert_ne!(sbm.data["spec"]["hostRef"]["name"], json!(host), "rolled out to the other host");
    lab.wait_hosts(HostState::Available, 1, ROLLOUT).await.unwrap();
    let cluster = lab.api("Cluster").get(CLUSTER).await.unwrap();
    let reconciled = cluster.data["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "TopologyReconciled").cloned())
        .unwrap_or_default();
    assert_eq!(reconciled["status"], "True", "{reconciled}");
}
