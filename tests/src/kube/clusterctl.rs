//! clusterctl against the test management cluster, with nothing downloaded from GitHub:
//!
//! - the kubeadm bootstrap and control plane providers of the same Cluster API module run as
//!   processes like the core manager ([`KubeEnv::start_kubeadm_providers`]), with their CRDs
//!   and webhooks, so a cluster template with a KubeadmControlPlane applies for real;
//! - [`Clusterctl`] writes a clusterctl config whose provider repositories are local folders:
//!   siteboot's release folder, and the core provider's `metadata.yaml` from the module;
//! - the core provider the environment runs is recorded in clusterctl's inventory (a `Provider`
//!   object, as `clusterctl init` writes after installing it): clusterctl then treats the cluster
//!   as initialized instead of trying to install the core and kubeadm providers from GitHub;
//! - cert-manager: `clusterctl init` refuses to go on until the cert-manager API answers (it
//!   creates an Issuer and a Certificate). Its CRDs (the version clusterctl pins) come from
//!   cert-manager's Go module; its controller and webhook cannot be had here (their `cmd/*`
//!   modules are not on the Go module proxy, the images are on quay.io), so they do not run.
//!   Nothing siteboot installs uses cert-manager (`docs/testing.md`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ::kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use siteboot_controller::manifests::CLUSTERCTL_PROVIDER;

use super::{
    FIELD_MANAGER, KubeEnv, free_port, http_status, install_crds, manifests, peer_command, peers,
    start_with_retry, until_ready,
};
use crate::process::Supervised;
use crate::wait;

/// A kubeadm provider of the Cluster API module.
struct KubeadmProvider {
    binary: &'static str,
    /// Its folder in the module (`<component>/config/{crd/bases,webhook}`).
    component: &'static str,
    /// What kustomize's `namePrefix` makes of its webhook configurations' names in a real
    /// installation (the module's files all say `mutating-webhook-configuration`).
    name_prefix: &'static str,
}

const KUBEADM_PROVIDERS: [KubeadmProvider; 2] = [
    KubeadmProvider {
        binary: peers::KUBEADM_BOOTSTRAP_MANAGER,
        component: "bootstrap/kubeadm",
        name_prefix: "capi-kubeadm-bootstrap-",
    },
    KubeadmProvider {
        binary: peers::KUBEADM_CONTROL_PLANE_MANAGER,
        component: "controlplane/kubeadm",
        name_prefix: "capi-kubeadm-control-plane-",
    },
];

impl KubeEnv {
    /// Starts the kubeadm bootstrap and control plane managers (CABPK and KCP) against this
    /// environment, as the core manager is started: CRDs converted by the manager's webhook,
    /// admission webhooks at `https://127.0.0.1:<port>`, the environment's webhook certificate.
    /// Returns once the apiserver calls KCP's validating webhook.
    pub async fn start_kubeadm_providers(&mut self) -> Result<()> {
        self.start_providers(&KUBEADM_PROVIDERS).await?;
        self.wait_for_control_plane_webhook().await
    }

    /// Starts the kubeadm bootstrap manager (CABPK) alone, as
    /// [`KubeEnv::start_kubeadm_providers`] does: for hosts that join with `kubeadm join` a
    /// control plane that is not KCP's (see [`super::kubeadm`]).
    pub async fn start_kubeadm_bootstrap_provider(&mut self) -> Result<()> {
        self.start_providers(&KUBEADM_PROVIDERS[..1]).await
    }

    async fn start_providers(&mut self, providers: &[KubeadmProvider]) -> Result<()> {
        let capi_dir = self.peers.capi_module_dir().to_owned();
        let ca_pem = std::fs::read_to_string(self.dir.path().join("pki/ca.crt"))?;
        let (webhook_dir, logs) = (self.dir.path().join("webhook"), self.dir.path().join("logs"));
        let (client, peers, kubeconfig) = (&self.client, &self.peers, &self.kubeconfig_path);
        for provider in providers {
            let (capi_dir, ca_pem, webhook_dir, logs) = (&capi_dir, &ca_pem, &webhook_dir, &logs);
            let webhook_port = start_with_retry(&mut self.procs, provider.binary, || async move {
                let (webhook_port, health, diagnostics) =
                    (free_port()?, free_port()?, free_port()?);
                let endpoint =
                    manifests::WebhookEndpoint { port: webhook_port, ca_pem: ca_pem.clone() };
                let crds = manifests::provider_crds(capi_dir, provider.component, &endpoint)?;
                install_crds(client, &crds).await?;
                let mut command = peer_command(peers, provider.binary);
                command.args([
                    format!("--kubeconfig={}", kubeconfig.display()),
                    "--leader-elect=false".to_owned(),
                    format!("--webhook-port={webhook_port}"),
                    format!("--webhook-cert-dir={}", webhook_dir.display()),
                    format!("--health-addr=127.0.0.1:{health}"),
                    format!("--diagnostics-address=127.0.0.1:{diagnostics}"),
                    "--insecure-diagnostics=true".to_owned(),
                    // As the core manager: clusterctl's CLUSTER_TOPOLOGY=true turns it on for
                    // every provider, and KCP accepts KubeadmControlPlaneTemplates only with it.
                    "--feature-gates=ClusterTopology=true".to_owned(),
                ]);
                command.env_remove("POD_NAMESPACE").env_remove("POD_NAME").env_remove("POD_UID");
                let mut proc = Supervised::spawn(provider.binary, &mut command, logs)?;
                let ready =
                    until_ready(&mut proc, "a kubeadm provider to be ready", || async move {
                        http_status(health, "/readyz").await == Some(200)
                    })
                    .await;
                Ok((proc, ready.map(|()| webhook_port)))
            })
            .await?;
            let endpoint =
                manifests::WebhookEndpoint { port: webhook_port, ca_pem: ca_pem.clone() };
            for mut configuration in
                manifests::provider_webhook_configurations(capi_dir, provider.component, &endpoint)?
            {
                let name = format!(
                    "{}{}",
                    provider.name_prefix,
                    configuration["metadata"]["name"].as_str().context("webhook name")?
                );
                configuration["metadata"]["name"] = json!(name);
                let kind = configuration["kind"].as_str().context("webhook kind")?.to_owned();
                self.api("admissionregistration.k8s.io/v1", &kind, None)
                    .patch(
                        &name,
                        &PatchParams::apply(FIELD_MANAGER).force(),
                        &Patch::Apply(&configuration),
                    )
                    .await
                    .with_context(|| format!("applying {kind} {name}"))?;
            }
        }
        Ok(())
    }

    /// Dry-run creates a KubeadmControlPlane with an even number of replicas (stacked etcd
    /// needs an odd one) until KCP's validating webhook refuses it: webhook configurations take
    /// effect asynchronously after they are written.
    async fn wait_for_control_plane_webhook(&self) -> Result<()> {
        let api = self.api(
            "controlplane.cluster.x-k8s.io/v1beta2",
            "KubeadmControlPlane",
            Some("default"),
        );
        let probe: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "controlplane.cluster.x-k8s.io/v1beta2",
            "kind": "KubeadmControlPlane",
            "metadata": { "name": "webhook-probe" },
            "spec": {
                "replicas": 2,
                "version": "v1.36.3",
                "machineTemplate": { "spec": { "infrastructureRef": {
                    "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "ProbeMachineTemplate", "name": "probe",
                } } },
            },
        }))?;
        let dry_run = PostParams { dry_run: true, ..PostParams::default() };
        let (api, probe, dry_run) = (&api, &probe, &dry_run);
        wait::for_async(
            "the apiserver to call KCP's webhook",
            super::STARTUP_TIMEOUT,
            || async move {
                match api.create(dry_run, probe).await {
                    Err(::kube::Error::Api(status))
                        if status.message.contains("denied the request") =>
                    {
                        Some(())
                    }
                    _ => None,
                }
            },
        )
        .await
    }
}

/// clusterctl (the peers' build) with a config in its own folder, against one environment.
pub struct Clusterctl {
    binary: PathBuf,
    kubeconfig: PathBuf,
    /// Holds the config, the core provider's repository, and clusterctl's home.
    dir: PathBuf,
    capi_module_dir: PathBuf,
}

/// What the core provider records in clusterctl's inventory (`clusterctl init` would install
/// it in this namespace).
const CORE_PROVIDER_NAMESPACE: &str = "capi-system";

impl Clusterctl {
    /// A clusterctl config in `dir` with two local provider repositories: siteboot's
    /// (`siteboot_components`, the `infrastructure-components.yaml` of a release folder
    /// `.../infrastructure-siteboot/v<version>/`) and the core provider's, which holds only the
    /// `metadata.yaml` of the module the environment runs (clusterctl reads it to learn the
    /// management cluster's contract).
    pub fn new(env: &KubeEnv, dir: &Path, siteboot_components: &Path) -> Result<Self> {
        let capi_module_dir = env.peers().capi_module_dir().to_owned();
        let version = core_version(&capi_module_dir)?;
        let core_repository = dir.join("repository/cluster-api").join(&version);
        std::fs::create_dir_all(&core_repository)?;
        std::fs::copy(capi_module_dir.join("metadata.yaml"), core_repository.join("metadata.yaml"))
            .context("copying the Cluster API module's metadata.yaml")?;
        let config = json!({
            "providers": [
                {
                    "name": "siteboot",
                    "type": "InfrastructureProvider",
                    "url": format!("file://{}", siteboot_components.display()),
                },
                {
                    "name": "cluster-api",
                    "type": "CoreProvider",
                    "url": format!("file://{}", core_repository.join("core-components.yaml").display()),
                },
            ],
        });
        std::fs::write(dir.join("clusterctl.yaml"), serde_norway::to_string(&config)?)?;
        Ok(Self {
            binary: env.peers().bin(peers::CLUSTERCTL),
            kubeconfig: env.kubeconfig_path().to_owned(),
            dir: dir.to_owned(),
            capi_module_dir,
        })
    }

    /// `clusterctl <args> --config <ours> --kubeconfig <the environment's>`, with its home in
    /// our folder and no check for a newer clusterctl on GitHub.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.binary);
        command
            .args(args)
            .arg(format!("--config={}", self.dir.join("clusterctl.yaml").display()))
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .env("HOME", &self.dir)
            .env("XDG_CONFIG_HOME", self.dir.join(".config"))
            .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true");
        command
    }

    /// Runs the command and prints what it said.
    pub fn run(&self, command: &mut Command) -> Result<Output> {
        let output = command.output().with_context(|| format!("running {command:?}"))?;
        eprintln!(
            "$ {command:?}: {}\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(output)
    }

    /// `clusterctl generate cluster <name> <args>` with the template variables `variables`:
    /// the documents it printed, parsed.
    pub fn generate_cluster(
        &self,
        name: &str,
        args: &[&str],
        variables: &[(&str, &str)],
    ) -> Result<Vec<Value>> {
        let mut command = self.command(&["generate", "cluster", name]);
        command.args(args).envs(variables.iter().copied());
        let generated = self.run(&mut command)?;
        if !generated.status.success() {
            bail!(
                "clusterctl generate cluster {name} {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&generated.stderr)
            );
        }
        let text = std::str::from_utf8(&generated.stdout)?;
        super::manifests::yaml_documents(text).context("clusterctl's output is not YAML")
    }

    /// siteboot installed on `env` as a site operator installs it: the release folder the binary
    /// under test writes (`siteboot manifests --output-dir`) as a local provider repository, the
    /// core provider recorded, cert-manager's CRDs, then `clusterctl init --infrastructure
    /// siteboot`. `dir` holds the release folder and clusterctl's config.
    pub async fn install_siteboot(env: &KubeEnv, dir: &Path) -> Result<Self> {
        let deploy = dir.join("deploy");
        let status = Command::new(crate::appliance::binary()?)
            .args(["manifests", "--output-dir"])
            .arg(&deploy)
            .status()?;
        if !status.success() {
            bail!("siteboot manifests --output-dir failed ({status})");
        }
        let components = deploy
            .join("clusterctl")
            .join(CLUSTERCTL_PROVIDER)
            .join(format!("v{}", env!("CARGO_PKG_VERSION")))
            .join("infrastructure-components.yaml");
        let clusterctl = Self::new(env, dir, &components)?;
        clusterctl.record_core_provider(env).await?;
        clusterctl.install_cert_manager_crds(env).await?;
        let init =
            clusterctl.run(&mut clusterctl.command(&["init", "--infrastructure", "siteboot"]))?;
        if !init.status.success() {
            bail!("clusterctl init --infrastructure siteboot failed ({})", init.status);
        }
        Ok(clusterctl)
    }

    /// Records the core provider the environment runs in clusterctl's inventory: clusterctl's
    /// `Provider` CRD (from the module, as `clusterctl init` installs it), the object
    /// `clusterctl init` would have written after installing the core provider itself, and the
    /// labels it puts on every object it installs on the core's CRDs (`clusterctl move` moves
    /// only the kinds of CRDs with clusterctl's label).
    pub async fn record_core_provider(&self, env: &KubeEnv) -> Result<()> {
        let crd = self.capi_module_dir.join("cmd/clusterctl/config/manifest/clusterctl-api.yaml");
        env.install_crd_yaml(&std::fs::read_to_string(&crd)?).await?;
        let labels = json!({ "metadata": { "labels": {
            "clusterctl.cluster.x-k8s.io": "",
            "cluster.x-k8s.io/provider": "cluster-api",
        } } });
        let crds = env.api("apiextensions.k8s.io/v1", "CustomResourceDefinition", None);
        for name in core_crd_names(&self.capi_module_dir)? {
            crds.patch(&name, &PatchParams::default(), &Patch::Merge(&labels))
                .await
                .with_context(|| format!("labelling CRD {name}"))?;
        }
        super::capi::create_namespace(env, CORE_PROVIDER_NAMESPACE).await?;
        let provider: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "clusterctl.cluster.x-k8s.io/v1alpha3",
            "kind": "Provider",
            "metadata": {
                "name": "cluster-api",
                "namespace": CORE_PROVIDER_NAMESPACE,
                "labels": {
                    "clusterctl.cluster.x-k8s.io": "",
                    "clusterctl.cluster.x-k8s.io/core": "inventory",
                    "cluster.x-k8s.io/provider": "cluster-api",
                },
            },
            "providerName": "cluster-api",
            "type": "CoreProvider",
            "version": core_version(&self.capi_module_dir)?,
        }))?;
        env.api("clusterctl.cluster.x-k8s.io/v1alpha3", "Provider", Some(CORE_PROVIDER_NAMESPACE))
            .create(&PostParams::default(), &provider)
            .await?;
        Ok(())
    }

    /// Installs the CRDs of the cert-manager version clusterctl pins, from cert-manager's Go
    /// module (downloaded once into the Go module cache).
    pub async fn install_cert_manager_crds(&self, env: &KubeEnv) -> Result<()> {
        let pinned =
            self.capi_module_dir.join("cmd/clusterctl/client/config/cert_manager_client.go");
        let source = std::fs::read_to_string(&pinned)?;
        let version = source
            .lines()
            .find_map(|line| line.trim().strip_prefix("CertManagerDefaultVersion = \""))
            .and_then(|rest| rest.strip_suffix('"'))
            .with_context(|| format!("no CertManagerDefaultVersion in {}", pinned.display()))?;
        let module = format!("github.com/cert-manager/cert-manager@{version}");
        let output = Command::new("go")
            .args(["mod", "download", "-json", &module])
            .current_dir(&self.dir)
            .env("GOTOOLCHAIN", "local")
            .output()
            .context("running go mod download (Go is needed for the test peers too)")?;
        let download: Value = serde_json::from_slice(&output.stdout).with_context(|| {
            format!("go mod download {module}: {}", String::from_utf8_lossy(&output.stderr))
        })?;
        if let Some(error) = download["Error"].as_str() {
            bail!("go mod download {module}: {error}");
        }
        let crds_dir = Path::new(download["Dir"].as_str().context("no Dir")?).join("deploy/crds");
        install_crds(&env.client, &yaml_documents_in(&crds_dir)?).await
    }
}

/// The names of the core provider's CRDs (`core/config/crd/bases` of the module).
fn core_crd_names(capi_module_dir: &Path) -> Result<Vec<String>> {
    yaml_documents_in(&capi_module_dir.join("core/config/crd/bases"))?
        .iter()
        .map(|crd| Ok(crd["metadata"]["name"].as_str().context("a CRD without a name")?.to_owned()))
        .collect()
}

/// Every document of every `*.yaml` file in `dir`.
fn yaml_documents_in(dir: &Path) -> Result<Vec<Value>> {
    let mut documents = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            documents.extend(manifests::yaml_documents(&std::fs::read_to_string(&path)?)?);
        }
    }
    Ok(documents)
}

/// The version of the Cluster API module (`v1.14.2`), from its directory name in the module
/// cache (`.../cluster-api@v1.14.2`).
fn core_version(capi_module_dir: &Path) -> Result<String> {
    let name = capi_module_dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    match name.split_once('@') {
        Some((_, version)) => Ok(version.to_owned()),
        None => bail!("{} is not a module cache directory", capi_module_dir.display()),
    }
}

/// Applies every object of a `clusterctl generate cluster` output in namespace `ns` (server-side,
/// as `kubectl apply --server-side` would); returns `Kind/name` of each, in order.
pub async fn apply(env: &KubeEnv, ns: &str, generated: &[Value]) -> Result<Vec<String>> {
    let params = PatchParams::apply("clusterctl-test").force();
    let mut applied = Vec::new();
    for object in generated {
        let (api_version, kind) = (
            object["apiVersion"].as_str().context("apiVersion")?,
            object["kind"].as_str().context("kind")?,
        );
        let name = object["metadata"]["name"].as_str().context("name")?;
        env.api(api_version, kind, Some(ns))
            .patch(name, &params, &Patch::Apply(object))
            .await
            .with_context(|| format!("applying {kind} {name}"))?;
        applied.push(format!("{kind}/{name}"));
    }
    Ok(applied)
}
