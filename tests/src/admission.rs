//! siteboot's admission policy (`manifests::admission_policy`) in a test apiserver, in force
//! before a test goes on: the apiserver loads a new policy a moment after it is created.

use std::time::Duration;

use anyhow::{Context, Result};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use siteboot_controller::manifests;

use crate::kube::KubeEnv;
use crate::wait;

const BOOTSTRAP: &str = "bootstrap.cluster.x-k8s.io/v1alpha1";
/// How long the apiserver may take to start enforcing a new policy.
const IN_FORCE: Duration = Duration::from_secs(30);
/// What the policy says when it refuses a template change.
pub const IMMUTABLE: &str = "spec.template.spec is immutable: create a new template";

/// Applies the policy and its binding, then waits until a dry-run change of a probe template
/// in `namespace` (which must exist) is refused.
pub async fn install(env: &KubeEnv, namespace: &str) -> Result<()> {
    for object in manifests::admission_policy() {
        let kind = object["kind"].as_str().context("kind")?;
        let name = object["metadata"]["name"].as_str().context("name")?;
        env.api("admissionregistration.k8s.io/v1", kind, None)
            .patch(name, &PatchParams::apply("siteboot-tests"), &Patch::Apply(&object))
            .await
            .with_context(|| format!("applying {kind} {name}"))?;
    }
    let probes = env.api(BOOTSTRAP, "SitebootConfigTemplate", Some(namespace));
    let probe = json!({ "apiVersion": BOOTSTRAP, "kind": "SitebootConfigTemplate",
        "metadata": { "name": "admission-probe" }, "spec": { "template": {} } });
    probes.create(&PostParams::default(), &serde_json::from_value(probe)?).await?;
    let change =
        Patch::Merge(json!({ "spec": { "template": { "spec": { "preCommands": ["true"] } } } }));
    let dry_run = PatchParams { dry_run: true, ..Default::default() };
    wait::for_async("the admission policy to refuse a template change", IN_FORCE, || async {
        match probes.patch("admission-probe", &dry_run, &change).await {
            Err(kube::Error::Api(s)) if s.code == 422 && s.message.contains(IMMUTABLE) => Some(()),
            _ => None,
        }
    })
    .await?;
    probes.delete("admission-probe", &DeleteParams::default()).await?;
    Ok(())
}
