//! The Cluster API manifests, read from the Go module cache (`core/config/...` of
//! sigs.k8s.io/cluster-api, and the kubeadm providers' `bootstrap/kubeadm/config/...` and
//! `controlplane/kubeadm/config/...`) and rewritten the way CAPI's own envtest does for a manager that runs
//! outside the cluster: every webhook (admission and CRD conversion) is called at
//! `https://127.0.0.1:<port><path>` and trusted through a caBundle, instead of through the
//! in-cluster `webhook-service` Service.

use std::path::Path;

use anyhow::{Context, Result, bail};
use base64::Engine;
use serde_json::{Value, json};

/// Where the apiserver reaches the webhook server.
pub struct WebhookEndpoint {
    pub port: u16,
    pub ca_pem: String,
}

impl WebhookEndpoint {
    fn client_config(&self, path: &str) -> Value {
        json!({
            "url": format!("https://127.0.0.1:{}{path}", self.port),
            "caBundle": base64::engine::general_purpose::STANDARD.encode(&self.ca_pem),
        })
    }
}

/// Every document of a (multi-document) YAML file, as JSON.
pub fn yaml_documents(text: &str) -> Result<Vec<Value>> {
    let mut documents = Vec::new();
    for document in serde_norway::Deserializer::from_str(text) {
        let value: Value = serde::Deserialize::deserialize(document)?;
        if !value.is_null() {
            documents.push(value);
        }
    }
    Ok(documents)
}

fn read_yaml(path: &Path) -> Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    yaml_documents(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The CRDs of `core/config/crd/bases`, each with conversion through the webhook server's
/// `/convert` (what `core/config/crd/patches/webhook_in_*.yaml` does in a real installation).
pub fn capi_crds(capi_module_dir: &Path, webhook: &WebhookEndpoint) -> Result<Vec<Value>> {
    provider_crds(capi_module_dir, "core", webhook)
}

/// [`capi_crds`] of the provider in `component` (`core`, `bootstrap/kubeadm`,
/// `controlplane/kubeadm`) of the module, with the labels its `config/crd/kustomization.yaml`
/// adds (the kubeadm providers' contract labels, which the core manager looks up).
pub fn provider_crds(
    capi_module_dir: &Path,
    component: &str,
    webhook: &WebhookEndpoint,
) -> Result<Vec<Value>> {
    let dir = capi_module_dir.join(component).join("config/crd/bases");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.retain(|path| path.extension().is_some_and(|ext| ext == "yaml"));
    files.sort();
    let kustomization = read_yaml(&dir.with_file_name("kustomization.yaml"))?;
    let labels: Vec<(&String, &Value)> = kustomization
        .iter()
        .flat_map(|k| k["labels"].as_array().into_iter().flatten())
        .flat_map(|entry| entry["pairs"].as_object().into_iter().flatten())
        .collect();
    let mut crds = Vec::new();
    for file in files {
        for mut crd in read_yaml(&file)? {
            for (key, value) in &labels {
                crd["metadata"]["labels"][key.as_str()] = (*value).clone();
            }
            crd["spec"]["conversion"] = json!({
                "strategy": "Webhook",
                "webhook": {
                    "conversionReviewVersions": ["v1"],
                    "clientConfig": webhook.client_config("/convert"),
                },
            });
            crds.push(crd);
        }
    }
    if crds.is_empty() {
        bail!("no CRDs in {}", dir.display());
    }
    Ok(crds)
}

/// The Mutating- and ValidatingWebhookConfiguration of `core/config/webhook/manifests.yaml`, with
/// each webhook's `clientConfig.service` replaced by a URL with the same path.
pub fn capi_webhook_configurations(
    capi_module_dir: &Path,
    webhook: &WebhookEndpoint,
) -> Result<Vec<Value>> {
    provider_webhook_configurations(capi_module_dir, "core", webhook)
}

/// [`capi_webhook_configurations`] of the provider in `component` of the module.
pub fn provider_webhook_configurations(
    capi_module_dir: &Path,
    component: &str,
    webhook: &WebhookEndpoint,
) -> Result<Vec<Value>> {
    let path = capi_module_dir.join(component).join("config/webhook/manifests.yaml");
    let mut configurations = read_yaml(&path)?;
    for configuration in &mut configurations {
        let Some(webhooks) = configuration["webhooks"].as_array_mut() else {
            bail!("{}: a document without webhooks", path.display());
        };
        for hook in webhooks {
            let service_path = hook["clientConfig"]["service"]["path"]
                .as_str()
                .with_context(|| {
                    format!("{}: webhook {} has no path", path.display(), hook["name"])
                })?
                .to_owned();
            hook["clientConfig"] = webhook.client_config(&service_path);
        }
    }
    Ok(configurations)
}
