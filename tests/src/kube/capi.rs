//! Cluster API fixtures shared by the tests: a workload Cluster whose control plane is a
//! minimal "externally managed" test control plane (the shared apiserver plays it), bootstrap
//! Secrets, and waits on objects that show what they last looked like when they time out.

use std::fmt::Debug;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::KubeEnv;
use crate::wait;

pub const CAPI: &str = "cluster.x-k8s.io/v1beta2";
pub const CONTROL_PLANE: &str = "controlplane.cluster.x-k8s.io/v1alpha1";
pub const CLUSTER_NAME_LABEL: &str = "cluster.x-k8s.io/cluster-name";

/// TestControlPlane, labelled with the v1beta2 contract so CAPI reads
/// `status.initialization.*`. CAPI v1.14 refuses a Cluster with neither a control plane, an
/// infrastructure nor a topology, so every test Cluster has one.
pub const TEST_CONTROL_PLANE_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: testcontrolplanes.controlplane.cluster.x-k8s.io
  labels:
    cluster.x-k8s.io/v1beta2: v1alpha1
spec:
  group: controlplane.cluster.x-k8s.io
  scope: Namespaced
  names:
    kind: TestControlPlane
    listKind: TestControlPlaneList
    plural: testcontrolplanes
    singular: testcontrolplane
  versions:
    - name: v1alpha1
      served: true
      storage: true
      subresources: { status: {} }
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec: { type: object, x-kubernetes-preserve-unknown-fields: true }
            status: { type: object, x-kubernetes-preserve-unknown-fields: true }
"#;

/// Minimal infrastructure providers: TestMachine and TestMachineTemplate, labelled with the
/// v1beta2 contract so CAPI reads `status.initialization.*`.
pub const TEST_MACHINE_CRDS: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: testmachines.infrastructure.cluster.x-k8s.io
  labels:
    cluster.x-k8s.io/v1beta2: v1alpha1
spec:
  group: infrastructure.cluster.x-k8s.io
  scope: Namespaced
  names: { kind: TestMachine, listKind: TestMachineList, plural: testmachines, singular: testmachine }
  versions:
    - name: v1alpha1
      served: true
      storage: true
      subresources: { status: {} }
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec: { type: object, x-kubernetes-preserve-unknown-fields: true }
            status: { type: object, x-kubernetes-preserve-unknown-fields: true }
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: testmachinetemplates.infrastructure.cluster.x-k8s.io
  labels:
    cluster.x-k8s.io/v1beta2: v1alpha1
spec:
  group: infrastructure.cluster.x-k8s.io
  scope: Namespaced
  names:
    kind: TestMachineTemplate
    listKind: TestMachineTemplateList
    plural: testmachinetemplates
    singular: testmachinetemplate
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

pub async fn create_namespace(env: &KubeEnv, ns: &str) -> Result<()> {
    let namespace: Namespace = serde_json::from_value(json!({ "metadata": { "name": ns } }))?;
    Api::<Namespace>::all(env.client()).create(&PostParams::default(), &namespace).await?;
    Ok(())
}

/// An infrastructure reference for a Cluster: (apiGroup, kind, name).
pub type InfraRef<'a> = (&'a str, &'a str, &'a str);

/// A workload Cluster `name` in `ns` (which must exist), ready for Machines:
/// - a TestControlPlane marked initialized and externally managed (like a hosted control plane:
///   CAPI then deletes the Nodes of deleted Machines even with no control-plane Machine);
/// - the `<cluster>-kubeconfig` Secret, pointing at the same apiserver;
/// - `infrastructure` as its infrastructureRef, if given; waits until CAPI reports the
///   infrastructure provisioned and the control plane initialized.
pub async fn create_cluster(
    env: &KubeEnv,
    ns: &str,
    name: &str,
    infrastructure: Option<InfraRef<'_>>,
) -> Result<()> {
    create_cluster_at(env, ns, name, infrastructure, "127.0.0.1").await
}

/// [`create_cluster`] whose control plane endpoint (where hosts join; CAPI copies it from the
/// TestControlPlane into the Cluster) is `endpoint_host` and the apiserver's port, e.g.
/// [`super::VM_HOST_ADDRESS`] for VMs on QEMU's user-mode network.
pub async fn create_cluster_at(
    env: &KubeEnv,
    ns: &str,
    name: &str,
    infrastructure: Option<InfraRef<'_>>,
    endpoint_host: &str,
) -> Result<()> {
    env.install_crd_yaml(TEST_CONTROL_PLANE_CRD).await?;
    let port = env.apiserver_port();
    let control_plane: DynamicObject = serde_json::from_value(json!({
        "apiVersion": CONTROL_PLANE, "kind": "TestControlPlane",
        "metadata": { "name": name },
        "spec": { "controlPlaneEndpoint": { "host": endpoint_host, "port": port } },
    }))?;
    let control_planes = env.api(CONTROL_PLANE, "TestControlPlane", Some(ns));
    control_planes.create(&PostParams::default(), &control_plane).await?;
    let status = json!({ "status": {
        "initialization": { "controlPlaneInitialized": true },
        "externalManagedControlPlane": true,
    }});
    control_planes.patch_status(name, &PatchParams::default(), &Patch::Merge(status)).await?;
    env.create_workload_kubeconfig_secret(ns, name).await?;

    let mut spec = json!({
        "controlPlaneRef": { "apiGroup": "controlplane.cluster.x-k8s.io", "kind": "TestControlPlane", "name": name },
    });
    if let Some((group, kind, infra)) = infrastructure {
        spec["infrastructureRef"] = json!({ "apiGroup": group, "kind": kind, "name": infra });
    }
    let cluster: DynamicObject = serde_json::from_value(
        json!({ "apiVersion": CAPI, "kind": "Cluster", "metadata": { "name": name }, "spec": spec }),
    )?;
    let clusters = env.api(CAPI, "Cluster", Some(ns));
    clusters.create(&PostParams::default(), &cluster).await?;
    wait_object(
        &clusters,
        name,
        "infrastructure provisioned and control plane initialized",
        Duration::from_secs(60),
        |c| {
            let init = &c.data["status"]["initialization"];
            init["infrastructureProvisioned"] == json!(true)
                && init["controlPlaneInitialized"] == json!(true)
        },
    )
    .await?;
    wait_object(&control_planes, name, "owned by its Cluster", Duration::from_secs(60), |cp| {
        cp.metadata.owner_references.iter().flatten().any(|o| o.kind == "Cluster" && o.name == name)
    })
    .await?;
    Ok(())
}

/// A bootstrap data Secret as a bootstrap provider writes it (type, label, `value`, `format`).
pub async fn create_bootstrap_secret(
    env: &KubeEnv,
    ns: &str,
    cluster: &str,
    name: &str,
    value: &str,
) -> Result<()> {
    let secret: Secret = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { CLUSTER_NAME_LABEL: cluster } },
        "type": "cluster.x-k8s.io/secret",
        "stringData": { "value": value, "format": "cloud-config" },
    }))?;
    Api::<Secret>::namespaced(env.client(), ns).create(&PostParams::default(), &secret).await?;
    Ok(())
}

/// Waits until `name` satisfies `done`; on timeout the error shows the object as last seen.
pub async fn wait_object<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
    timeout: Duration,
    done: impl Fn(&K) -> bool,
) -> Result<K>
where
    K: Clone + DeserializeOwned + serde::Serialize + Debug,
{
    let last_seen = Mutex::new(None::<Value>);
    let (last_seen_ref, done) = (&last_seen, &done);
    let found = wait::for_async(&format!("{name}: {what}"), timeout, || async move {
        let object = api.get_opt(name).await.ok().flatten()?;
        *last_seen_ref.lock().unwrap() = serde_json::to_value(&object).ok();
        done(&object).then_some(object)
    })
    .await;
    let last = last_seen.lock().unwrap().take();
    found
        .with_context(|| format!("last seen: {}", last.map_or("nothing".into(), |v| v.to_string())))
}

/// Waits until `name` no longer exists.
pub async fn wait_gone<K>(api: &Api<K>, name: &str, timeout: Duration) -> Result<()>
where
    K: Clone + DeserializeOwned + Debug,
{
    wait::for_async(&format!("{name} to be deleted"), timeout, || async {
        matches!(api.get_opt(name).await, Ok(None)).then_some(())
    })
    .await
}
