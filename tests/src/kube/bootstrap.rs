//! Fixtures for the bootstrap provider's tests (`SitebootConfig`): workers made by a
//! MachineDeployment whose bootstrap template is a SitebootConfigTemplate and whose
//! infrastructure is the minimal TestMachine kind ([`super::capi::TEST_MACHINE_CRDS`]), for
//! which the test plays the provider; and readers for what the provider writes.

use std::time::Duration;

use anyhow::{Context, Result};
use base64::Engine;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::KubeEnv;
use super::capi::{CAPI, wait_object};
use crate::wait;

pub const BOOTSTRAP: &str = "bootstrap.cluster.x-k8s.io/v1alpha1";
pub const BOOTSTRAP_GROUP: &str = "bootstrap.cluster.x-k8s.io";
pub const TEST_INFRA: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";
/// Where the bootstrap data writes the kubeconfig that holds the token.
pub const BOOTSTRAP_KUBECONFIG: &str = "/etc/kubernetes/bootstrap-kubelet.conf";

/// The text under `key` in a Secret's data (empty if absent).
pub fn secret_text(secret: &Secret, key: &str) -> String {
    let bytes = secret.data.as_ref().and_then(|d| d.get(key)).map(|b| b.0.clone());
    String::from_utf8(bytes.unwrap_or_default()).unwrap_or_default()
}

/// (status, reason) of an object's condition `type_` (nulls if it has none).
pub fn condition(object: &DynamicObject, type_: &str) -> (Value, Value) {
    let c = object.data["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == type_).cloned())
        .unwrap_or_default();
    (c["status"].clone(), c["reason"].clone())
}

/// A SitebootConfigTemplate with `config_spec`, a TestMachineTemplate, and a MachineDeployment
/// of `replicas` Machines using both, all named `name`, in Cluster `cluster`.
pub async fn create_workers(
    env: &KubeEnv,
    ns: &str,
    cluster: &str,
    name: &str,
    replicas: u32,
    config_spec: Value,
) -> Result<()> {
    let pp = PostParams::default();
    let object = |value: Value| -> Result<DynamicObject> { Ok(serde_json::from_value(value)?) };
    let bootstrap = create_config_template(env, ns, name, config_spec).await?;
    let infra_template = object(json!({
        "apiVersion": TEST_INFRA, "kind": "TestMachineTemplate", "metadata": { "name": name },
        "spec": { "template": { "spec": {} } },
    }))?;
    env.api(TEST_INFRA, "TestMachineTemplate", Some(ns)).create(&pp, &infra_template).await?;
    let md = object(json!({
        "apiVersion": CAPI, "kind": "MachineDeployment", "metadata": { "name": name },
        "spec": {
            "clusterName": cluster,
            "replicas": replicas,
            "template": { "spec": {
                "clusterName": cluster,
                "bootstrap": bootstrap,
                "infrastructureRef": { "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "TestMachineTemplate", "name": name },
            } },
        },
    }))?;
    env.api(CAPI, "MachineDeployment", Some(ns)).create(&pp, &md).await?;
    Ok(())
}

/// A SitebootConfigTemplate `name` with `config_spec`; returns a Machine's `spec.bootstrap`
/// that uses it.
pub async fn create_config_template(
    env: &KubeEnv,
    ns: &str,
    name: &str,
    config_spec: Value,
) -> Result<Value> {
    let template: DynamicObject = serde_json::from_value(json!({
        "apiVersion": BOOTSTRAP, "kind": "SitebootConfigTemplate", "metadata": { "name": name },
        "spec": { "template": { "spec": config_spec } },
    }))?;
    let templates = env.api(BOOTSTRAP, "SitebootConfigTemplate", Some(ns));
    templates.create(&PostParams::default(), &template).await?;
    Ok(
        json!({ "configRef": { "apiGroup": BOOTSTRAP_GROUP, "kind": "SitebootConfigTemplate", "name": name } }),
    )
}

/// Waits until `ns` has exactly `count` Machines, none being deleted, each with its bootstrap
/// data Secret named (CAPI copies it from the config's status).
pub async fn machines_with_data(
    env: &KubeEnv,
    ns: &str,
    count: usize,
    timeout: Duration,
) -> Result<Vec<DynamicObject>> {
    let machines = env.api(CAPI, "Machine", Some(ns));
    let machines = &machines;
    wait::for_async(&format!("{count} Machines with bootstrap data"), timeout, || async move {
        let list = machines.list(&ListParams::default()).await.ok()?.items;
        let live: Vec<DynamicObject> =
            list.into_iter().filter(|m| m.metadata.deletion_timestamp.is_none()).collect();
        let named = live.iter().all(|m| m.data["spec"]["bootstrap"]["dataSecretName"].is_string());
        (live.len() == count && named).then_some(live)
    })
    .await
}

/// A Machine's bootstrap token: the id its SitebootConfig's status records, the token its data
/// carries, and when the workload cluster's token Secret says it expires.
#[derive(Debug, Clone)]
pub struct MachineToken {
    pub config: String,
    pub id: String,
    /// `<id>.<secret>`, from the data's bootstrap kubeconfig.
    pub token: String,
    /// Seconds since the epoch; None: no such token Secret.
    pub expiration: Option<u64>,
}

/// The bootstrap token of `machine`, which has its data: its config and data in the management
/// cluster `env`, its token Secret in the workload cluster `workload`. Fails unless the data
/// carries the token the config's status records: one token per config (a status written from
/// a stale read once recorded a second token in its place, so the data's was never extended).
pub async fn machine_token(
    env: &KubeEnv,
    workload: &kube::Client,
    ns: &str,
    machine: &DynamicObject,
) -> Result<MachineToken> {
    let bootstrap = &machine.data["spec"]["bootstrap"];
    let (config, secret) = (&bootstrap["configRef"]["name"], &bootstrap["dataSecretName"]);
    let (config, secret) =
        (config.as_str().context("no configRef")?, secret.as_str().context("no data yet")?);
    let read = env.api(BOOTSTRAP, "SitebootConfig", Some(ns)).get(config).await?;
    let id = read.data["status"]["tokenId"].as_str().context("no tokenId")?.to_owned();
    let data = kube::Api::<Secret>::namespaced(env.client(), ns).get(secret).await?;
    let token = bootstrap_token(&secret_text(&data, "value"))?;
    anyhow::ensure!(
        token.starts_with(&format!("{id}.")),
        "the data's token is {token}, the status's id {id}"
    );
    let tokens = kube::Api::<Secret>::namespaced(workload.clone(), "kube-system");
    let expiration = match tokens.get_opt(&format!("bootstrap-token-{id}")).await? {
        Some(secret) => {
            let at: k8s_openapi::jiff::Timestamp = secret_text(&secret, "expiration").parse()?;
            Some(u64::try_from(at.as_second())?)
        }
        None => None,
    };
    Ok(MachineToken { config: config.to_owned(), id, token, expiration })
}

/// The bootstrap kubeconfig the cloud-config writes, decoded.
pub fn bootstrap_kubeconfig(cloud_config: &str) -> Result<String> {
    // The first two lines are `## template: jinja` and `#cloud-config`: YAML comments.
    let doc: Value = serde_norway::from_str(cloud_config)?;
    let file = doc["write_files"]
        .as_array()
        .context("no write_files")?
        .iter()
        .find(|f| f["path"] == BOOTSTRAP_KUBECONFIG)
        .context("no bootstrap kubeconfig")?;
    anyhow::ensure!(file["permissions"] == "0600", "the bootstrap kubeconfig is not 0600");
    let content = file["content"].as_str().context("no content")?;
    Ok(String::from_utf8(base64::engine::general_purpose::STANDARD.decode(content)?)?)
}

/// The bootstrap token (`<id>.<secret>`) in a cloud-config's bootstrap kubeconfig.
pub fn bootstrap_token(cloud_config: &str) -> Result<String> {
    let kubeconfig: Value = serde_norway::from_str(&bootstrap_kubeconfig(cloud_config)?)?;
    Ok(kubeconfig["users"][0]["user"]["token"].as_str().context("no token")?.to_owned())
}

/// Plays the infrastructure provider for `machine`: once CAPI owns its TestMachine, gives it
/// the providerID `test://<ns>/<TestMachine>` and reports it provisioned. Returns the providerID.
pub async fn provision(env: &KubeEnv, ns: &str, machine: &DynamicObject) -> Result<String> {
    let test_machines = env.api(TEST_INFRA, "TestMachine", Some(ns));
    let infra = machine.data["spec"]["infrastructureRef"]["name"]
        .as_str()
        .with_context(|| format!("Machine {} has no infrastructureRef", machine.name_any()))?;
    let provider_id = format!("test://{ns}/{infra}");
    wait_object(&test_machines, infra, "owned by its Machine", Duration::from_secs(60), |t| {
        t.owner_references().iter().any(|o| o.kind == "Machine")
    })
    .await?;
    let pp = PatchParams::default();
    let spec = json!({ "spec": { "providerID": provider_id } });
    test_machines.patch(infra, &pp, &Patch::Merge(spec)).await?;
    let status = json!({ "status": { "initialization": { "provisioned": true } } });
    test_machines.patch_status(infra, &pp, &Patch::Merge(status)).await?;
    Ok(provider_id)
}

/// Waits until the apiserver of `kubeconfig` (an admin's, whose user is replaced) refuses
/// `token` (401). The apiserver caches a token it accepted for 10 s (its authenticators'
/// success cache), so a token deleted just after a use still works that long.
pub async fn wait_token_refused(kubeconfig: &str, token: &str, timeout: Duration) -> Result<()> {
    let last = std::sync::Mutex::new(None);
    let refused =
        wait::until_async("the token to get 401", timeout, Duration::from_secs(1), || async {
            let status = token_status(kubeconfig, token).await;
            let refused = matches!(status, Ok(401));
            *last.lock().unwrap() = Some(status.map_err(|e| format!("{e:#}")));
            refused.then_some(())
        })
        .await;
    refused.with_context(|| format!("last answer: {:?}", last.lock().unwrap()))
}

/// `GET /api` on the apiserver of `kubeconfig` with `token` as the bearer token (in place of
/// the kubeconfig's user): 200 while the apiserver accepts it, 401 once it does not (deleted or
/// expired).
pub async fn token_status(kubeconfig: &str, token: &str) -> Result<u16> {
    let mut kubeconfig: Value = serde_norway::from_str(kubeconfig)?;
    kubeconfig["users"][0]["user"] = json!({ "token": token });
    let kubeconfig: kube::config::Kubeconfig = serde_json::from_value(kubeconfig)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
    let client = kube::Client::try_from(config)?;
    let request = http::Request::get("/api").body(Vec::new())?;
    match client.request_text(request).await {
        Ok(_) => Ok(200),
        Err(kube::Error::Api(status)) => Ok(status.code),
        Err(e) => Err(e.into()),
    }
}
