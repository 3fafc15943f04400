//! siteboot installed and used the clusterctl way: `clusterctl init --infrastructure siteboot`
//! from the release folder `siteboot manifests --output-dir` writes (a local provider
//! repository), then `clusterctl generate cluster` with its template, applied to the real
//! management cluster (apiserver + etcd + the Cluster API core, kubeadm bootstrap and kubeadm
//! control plane managers of v1.14.2). See `tests/src/kube/clusterctl.rs` for what stands in for
//! GitHub and cert-manager, and why.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use kube::api::{DynamicObject, ListParams};
use serde_json::{Value, json};
use siteboot_controller::manifests::{BOOT_PLANE_ACCOUNT, CLUSTERCTL_PROVIDER, crds};
use siteboot_tests::kube::KubeEnv;
use siteboot_tests::kube::capi::{CAPI, create_namespace, wait_object};
use siteboot_tests::kube::clusterctl::{Clusterctl, apply};

const TIMEOUT: Duration = Duration::from_secs(60);
const INFRA: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";
const CHECKSUM: &str = "sha256:5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusterctl_init_and_generate_cluster_with_siteboot() {
    let mut env = KubeEnv::start().await.expect("starting the environment");
    env.start_kubeadm_providers().await.expect("starting the kubeadm providers");
    // Panicking while `env` is alive prints the components' logs.
    if let Err(err) = steps(&env).await {
        panic!("{err:#}");
    }
}

fn label<'a>(object: &'a DynamicObject, key: &str) -> Option<&'a str> {
    object.metadata.labels.as_ref()?.get(key).map(String::as_str)
}

fn provider_labelled(object: &DynamicObject) -> bool {
    label(object, "cluster.x-k8s.io/provider") == Some(CLUSTERCTL_PROVIDER)
        && label(object, "clusterctl.cluster.x-k8s.io") == Some("")
}

async fn steps(env: &KubeEnv) -> Result<()> {
    let dir = tempfile::tempdir()?;

    // The release folder, as the binary under test writes it, is the committed one.
    let siteboot = siteboot_tests::appliance::binary()?;
    let status = Command::new(&siteboot)
        .args(["manifests", "--output-dir"])
        .arg(dir.path().join("deploy"))
        .status()?;
    ensure!(status.success(), "siteboot manifests --output-dir failed");
    let release = Path::new("clusterctl")
        .join(CLUSTERCTL_PROVIDER)
        .join(format!("v{}", env!("CARGO_PKG_VERSION")));
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy").join(&release);
    for file in [
        "metadata.yaml",
        "infrastructure-components.yaml",
        "cluster-template.yaml",
        "cluster-template-clusterclass.yaml",
        "clusterclass-siteboot-kubeadm.yaml",
    ] {
        let generated =
            std::fs::read_to_string(dir.path().join("deploy").join(&release).join(file))?;
        let in_git = std::fs::read_to_string(committed.join(file)).unwrap_or_default();
        ensure!(
            generated == in_git,
            "deploy/{}/{file} differs from what siteboot generates",
            release.display()
        );
    }

    let clusterctl = Clusterctl::new(
        env,
        dir.path(),
        &dir.path().join("deploy").join(&release).join("infrastructure-components.yaml"),
    )?;
    clusterctl.record_core_provider(env).await?;
    clusterctl.install_cert_manager_crds(env).await?;

    // Two variables set, the others take their defaults.
    let init = clusterctl.run(
        clusterctl
            .command(&["init", "--infrastructure", "siteboot"])
            .env("SITEBOOT_SITE", "rack-7")
            .env("SITEBOOT_IMAGE", "registry.example/siteboot:test"),
    )?;
    let said =
        String::from_utf8_lossy(&init.stderr).into_owned() + &String::from_utf8_lossy(&init.stdout);
    ensure!(init.status.success(), "clusterctl init failed");
    ensure!(said.contains("Installing provider=\"infrastructure-siteboot\" version=\"v0.1.0\" targetNamespace=\"siteboot-system\""), "{said}");
    ensure!(
        !said.contains("Installing provider=\"cluster-api\""),
        "the core provider was reinstalled"
    );
    check_installed_components(env).await?;

    // The template's variables: clusterctl's own and siteboot's.
    let listed = clusterctl.run(&mut clusterctl.command(&[
        "generate",
        "cluster",
        "edge-1",
        "--infrastructure",
        "siteboot",
        "--list-variables",
    ]))?;
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    for variable in [
        "SITEBOOT_CONTROL_PLANE_ENDPOINT_HOST",
        "SITEBOOT_IMAGE_URL",
        "SITEBOOT_IMAGE_CHECKSUM",
        "KUBERNETES_VERSION",
    ] {
        ensure!(listed.contains(variable), "{variable} is not listed:\n{listed}");
    }

    let generated = generate_cluster(&clusterctl, "edge-1", None, "10.99.0.50")?;
    create_namespace(env, "metal").await?;
    let applied = apply(env, "metal", &generated).await?;
    ensure!(
        applied
            == [
                "Cluster/edge-1",
                "SitebootCluster/edge-1",
                "KubeadmControlPlane/edge-1-control-plane",
                "SitebootMachineTemplate/edge-1-control-plane",
                "MachineDeployment/edge-1-workers",
                "SitebootMachineTemplate/edge-1-workers",
                "SitebootConfigTemplate/edge-1-workers",
            ],
        "applied {applied:?}"
    );
    check_workload_cluster(env).await?;

    // The ClusterClass flavor: clusterctl adds the class to the Cluster, and the topology
    // controller makes the control plane and the workers from the class's templates.
    let generated = generate_cluster(&clusterctl, "edge-2", Some("clusterclass"), "10.99.0.51")?;
    let applied = apply(env, "metal", &generated).await?;
    ensure!(
        applied.contains(&"ClusterClass/siteboot-kubeadm".to_owned())
            && applied.contains(&"Cluster/edge-2".to_owned()),
        "applied {applied:?}"
    );
    check_cluster_class_cluster(env).await
}

/// `clusterctl generate cluster <name>` (in `--flavor`) with 3 control-plane machines and 2
/// workers in namespace metal: the documents it printed.
fn generate_cluster(
    clusterctl: &Clusterctl,
    name: &str,
    flavor: Option<&str>,
    endpoint: &str,
) -> Result<Vec<Value>> {
    let mut args = vec!["--infrastructure", "siteboot"];
    args.extend(flavor.map(|f| ["--flavor", f]).into_iter().flatten());
    args.extend([
        "--target-namespace",
        "metal",
        "--kubernetes-version",
        "v1.36.3",
        "--control-plane-machine-count",
        "3",
        "--worker-machine-count",
        "2",
    ]);
    clusterctl.generate_cluster(
        name,
        &args,
        &[
            ("SITEBOOT_CONTROL_PLANE_ENDPOINT_HOST", endpoint),
            ("SITEBOOT_IMAGE_URL", "http://10.99.0.1:8080/files/os.raw"),
            ("SITEBOOT_IMAGE_CHECKSUM", CHECKSUM),
        ],
    )
}

/// The topology of edge-2 (class siteboot-kubeadm): a KubeadmControlPlane of 3 whose kubelets
/// get their providerID from the meta-data, on a clone of the class's control-plane machine
/// template, and the MachineDeployment md-0 of 2 joined by SitebootConfigs, with the image.
async fn check_cluster_class_cluster(env: &KubeEnv) -> Result<()> {
    let ns = Some("metal");
    let of_edge_2 = ListParams::default().labels("cluster.x-k8s.io/cluster-name=edge-2");
    let kcps = env.api("controlplane.cluster.x-k8s.io/v1beta2", "KubeadmControlPlane", ns);
    let kcp = siteboot_tests::wait::for_async("edge-2's KubeadmControlPlane", TIMEOUT, || async {
        kcps.list(&of_edge_2).await.ok()?.items.into_iter().next()
    })
    .await?;
    ensure!(kcp.data["spec"]["replicas"] == 3 && kcp.data["spec"]["version"] == "v1.36.3");
    ensure!(
        kcp.data["spec"]["kubeadmConfigSpec"]["joinConfiguration"]["nodeRegistration"]["kubeletExtraArgs"]
            == json!([{ "name": "provider-id", "value": "{{ ds.meta_data.provider_id }}" }]),
        "{}",
        kcp.data["spec"]
    );
    air_gapped_with_keepalived(&kcp)?;
    let infra = &kcp.data["spec"]["machineTemplate"]["spec"]["infrastructureRef"];
    ensure!(infra["kind"] == "SitebootMachineTemplate", "{infra}");
    let templates = env.api(INFRA, "SitebootMachineTemplate", ns);
    let template = templates.get(infra["name"].as_str().context("its name")?).await?;
    let spec = &template.data["spec"]["template"]["spec"];
    ensure!(spec["hostSelector"]["matchLabels"]["siteboot.dev/role"] == "control-plane", "{spec}");
    ensure!(spec["image"]["checksum"] == CHECKSUM, "{spec}");

    let mds = env.api(CAPI, "MachineDeployment", ns);
    let md_0 = ListParams::default().labels(
        "cluster.x-k8s.io/cluster-name=edge-2,topology.cluster.x-k8s.io/deployment-name=md-0",
    );
    let md =
        siteboot_tests::wait::for_async("edge-2's MachineDeployment md-0", TIMEOUT, || async {
            mds.list(&md_0).await.ok()?.items.into_iter().next()
        })
        .await?;
    ensure!(md.data["spec"]["replicas"] == 2);
    let template = &md.data["spec"]["template"]["spec"];
    ensure!(template["bootstrap"]["configRef"]["kind"] == "SitebootConfigTemplate", "{template}");
    let workers = templates.get(template["infrastructureRef"]["name"].as_str().context("name")?);
    let workers = workers.await?;
    let spec = &workers.data["spec"]["template"]["spec"];
    ensure!(spec["hostSelector"]["matchLabels"]["siteboot.dev/role"] == "worker", "{spec}");
    ensure!(spec["image"]["url"] == "http://10.99.0.1:8080/files/os.raw", "{spec}");
    Ok(())
}

/// A KubeadmControlPlane of either flavor, as the webhooks admitted it: no image pulled nor
/// add-on installed (kubeadm's nor the control plane's upgrade of them), the etcd image's tag
/// the node image's, keepalived configured before kubeadm runs.
fn air_gapped_with_keepalived(kcp: &DynamicObject) -> Result<()> {
    let annotations = kcp.metadata.annotations.clone().unwrap_or_default();
    for skip in ["skip-coredns", "skip-kube-proxy"] {
        let annotation = format!("controlplane.cluster.x-k8s.io/{skip}");
        ensure!(annotations.contains_key(&annotation), "{annotation}: {annotations:?}");
    }
    let spec = &kcp.data["spec"]["kubeadmConfigSpec"];
    ensure!(
        spec["initConfiguration"]["skipPhases"] == json!(["addon/kube-proxy", "addon/coredns"]),
        "{spec}"
    );
    for phase in ["initConfiguration", "joinConfiguration"] {
        ensure!(spec[phase]["nodeRegistration"]["imagePullPolicy"] == "Never", "{spec}");
    }
    ensure!(spec["clusterConfiguration"]["etcd"]["local"]["imageTag"] == "3.6.16-0", "{spec}");
    let commands = spec["preKubeadmCommands"].as_array().context("preKubeadmCommands")?;
    let at = |command: &str| commands.iter().position(|c| c == command);
    ensure!(
        at("/usr/local/sbin/node-images control-plane").is_some()
            && at("/etc/keepalived/configure-endpoint").is_some(),
        "{commands:?}"
    );
    let files: Vec<&str> =
        spec["files"].as_array().into_iter().flatten().filter_map(|f| f["path"].as_str()).collect();
    ensure!(
        files.contains(&"/etc/keepalived/configure-endpoint")
            && files.contains(&"/etc/keepalived/keepalived.conf.in"),
        "{files:?}"
    );
    Ok(())
}

/// Every `pattern` (regular expression) in a schema: each ends in `$`, which clusterctl's
/// variable substitution must leave alone.
fn patterns(schema: &Value) -> Vec<String> {
    match schema {
        Value::Object(fields) => fields
            .iter()
            .flat_map(|(key, value)| match (key.as_str(), value) {
                ("pattern", Value::String(pattern)) => vec![pattern.clone()],
                _ => patterns(value),
            })
            .collect(),
        Value::Array(items) => items.iter().flat_map(patterns).collect(),
        _ => Vec::new(),
    }
}

/// What `clusterctl init` installed: every object labelled as the provider's, the variables
/// filled in, the inventory entry, and the CRDs' regular expressions untouched by clusterctl's
/// variable substitution.
async fn check_installed_components(env: &KubeEnv) -> Result<()> {
    const ADMISSION: &str = "admissionregistration.k8s.io/v1";
    let ns = Some("siteboot-system");
    let mut checked_patterns = 0;
    for crd in crds() {
        let name = crd.metadata.name.clone().context("CRD name")?;
        let installed =
            env.api("apiextensions.k8s.io/v1", "CustomResourceDefinition", None).get(&name).await?;
        ensure!(provider_labelled(&installed), "CRD {name} lacks the provider labels");
        let generated = patterns(&serde_json::to_value(&crd)?["spec"]);
        ensure!(patterns(&installed.data["spec"]) == generated, "CRD {name}'s patterns changed");
        checked_patterns += generated.len();
    }
    ensure!(checked_patterns > 0, "the CRDs have no patterns to check");
    for (api_version, kind, namespace, name) in [
        ("v1", "Namespace", None, "siteboot-system"),
        ("v1", "ServiceAccount", ns, "siteboot"),
        ("rbac.authorization.k8s.io/v1", "ClusterRole", None, "siteboot-manager"),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", None, "siteboot-manager"),
        ("rbac.authorization.k8s.io/v1", "ClusterRole", None, "siteboot-capi-manager"),
        ("rbac.authorization.k8s.io/v1", "Role", ns, "siteboot-leader-election"),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", ns, "siteboot-leader-election"),
        ("v1", "ServiceAccount", ns, BOOT_PLANE_ACCOUNT),
        ("rbac.authorization.k8s.io/v1", "ClusterRole", None, BOOT_PLANE_ACCOUNT),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", None, BOOT_PLANE_ACCOUNT),
        ("rbac.authorization.k8s.io/v1", "Role", ns, BOOT_PLANE_ACCOUNT),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", ns, BOOT_PLANE_ACCOUNT),
        ("v1", "ConfigMap", ns, "siteboot-rack-7"),
        ("apps/v1", "Deployment", ns, "siteboot-rack-7"),
        ("apps/v1", "Deployment", ns, "siteboot-rack-7-controller"),
        // Cluster-scoped, though clusterctl takes any kind it does not know for namespaced.
        (ADMISSION, "ValidatingAdmissionPolicy", None, "siteboot-templates-immutable"),
        (ADMISSION, "ValidatingAdmissionPolicyBinding", None, "siteboot-templates-immutable"),
    ] {
        let object = env
            .api(api_version, kind, namespace)
            .get(name)
            .await
            .with_context(|| format!("{kind} {name}"))?;
        ensure!(provider_labelled(&object), "{kind} {name} lacks the provider labels");
    }
    let deployment = env.api("apps/v1", "Deployment", ns).get("siteboot-rack-7").await?;
    let pod = &deployment.data["spec"]["template"]["spec"];
    ensure!(pod["containers"][0]["image"] == "registry.example/siteboot:test", "{pod}");
    ensure!(pod["nodeSelector"] == json!({ "siteboot.dev/site": "rack-7" }), "{pod}");
    ensure!(
        pod["containers"][0]["securityContext"]["capabilities"]["add"]
            == json!(["NET_BIND_SERVICE", "NET_RAW"])
    );
    // The process on the segment runs as the account that reads no tenant's Secret.
    ensure!(pod["serviceAccountName"] == BOOT_PLANE_ACCOUNT, "{pod}");
    let boot_plane = env
        .api("rbac.authorization.k8s.io/v1", "ClusterRole", None)
        .get(BOOT_PLANE_ACCOUNT)
        .await?;
    ensure!(!boot_plane.data["rules"].to_string().contains("secrets"), "{:?}", boot_plane.data);
    let controller = env.api("apps/v1", "Deployment", ns).get("siteboot-rack-7-controller").await?;
    let pod = &controller.data["spec"]["template"]["spec"];
    ensure!(pod["serviceAccountName"] == "siteboot", "{pod}");
    ensure!(pod["containers"][0]["image"] == "registry.example/siteboot:test", "{pod}");
    let config = env.api("v1", "ConfigMap", ns).get("siteboot-rack-7").await?;
    let config = config.data["data"]["siteboot.yaml"].as_str().context("siteboot.yaml")?.to_owned();
    for line in ["interface: eth1", "  site: rack-7", "pools: [10.99.0.100-10.99.0.199]"] {
        ensure!(config.contains(line), "no {line:?} in\n{config}");
    }
    // Each replica serves at its own node's address.
    ensure!(!config.contains("\naddress:"), "one address for every replica in\n{config}");
    let binding = env
        .api("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", None)
        .get("siteboot-manager")
        .await?;
    ensure!(binding.data["subjects"][0]["namespace"] == "siteboot-system");
    let inventory = env
        .api("clusterctl.cluster.x-k8s.io/v1alpha3", "Provider", ns)
        .get(CLUSTERCTL_PROVIDER)
        .await?;
    ensure!(
        (inventory.data["type"].as_str(), inventory.data["version"].as_str())
            == (Some("InfrastructureProvider"), Some("v0.1.0")),
        "{:?}",
        inventory.data
    );
    Ok(())
}

/// The generated cluster, applied: the values the variables carried, and the Cluster API
/// controllers taking it over (owner references to the Cluster on its infrastructure and
/// control plane).
async fn check_workload_cluster(env: &KubeEnv) -> Result<()> {
    let ns = Some("metal");
    let cluster = env.api(CAPI, "Cluster", ns).get("edge-1").await?;
    ensure!(cluster.data["spec"]["infrastructureRef"]["kind"] == "SitebootCluster");
    ensure!(cluster.data["spec"]["controlPlaneRef"]["kind"] == "KubeadmControlPlane");
    let owned_by_cluster = |object: &DynamicObject| {
        object
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "Cluster" && o.name == "edge-1")
    };
    let infra = env.api(INFRA, "SitebootCluster", ns);
    let infra =
        wait_object(&infra, "edge-1", "owned by its Cluster", TIMEOUT, owned_by_cluster).await?;
    ensure!(
        infra.data["spec"]["controlPlaneEndpoint"] == json!({ "host": "10.99.0.50", "port": 6443 })
    );
    let kcp = env.api("controlplane.cluster.x-k8s.io/v1beta2", "KubeadmControlPlane", ns);
    let kcp = wait_object(
        &kcp,
        "edge-1-control-plane",
        "owned by its Cluster",
        TIMEOUT,
        owned_by_cluster,
    )
    .await?;
    ensure!(
        (kcp.data["spec"]["replicas"].as_i64(), kcp.data["spec"]["version"].as_str())
            == (Some(3), Some("v1.36.3"))
    );
    air_gapped_with_keepalived(&kcp)?;
    for (template, role) in
        [("edge-1-control-plane", "control-plane"), ("edge-1-workers", "worker")]
    {
        let template = env.api(INFRA, "SitebootMachineTemplate", ns).get(template).await?;
        let spec = &template.data["spec"]["template"]["spec"];
        ensure!(
            spec["image"]
                == json!({ "url": "http://10.99.0.1:8080/files/os.raw", "checksum": CHECKSUM }),
            "{spec}"
        );
        ensure!(spec["hostSelector"]["matchLabels"]["siteboot.dev/role"] == role, "{spec}");
    }
    let workers = env.api(CAPI, "MachineDeployment", ns).get("edge-1-workers").await?;
    ensure!(workers.data["spec"]["replicas"] == 2);
    ensure!(
        workers.data["spec"]["template"]["spec"]["bootstrap"]["configRef"]["kind"]
            == "SitebootConfigTemplate"
    );
    env.api("bootstrap.cluster.x-k8s.io/v1alpha1", "SitebootConfigTemplate", ns)
        .get("edge-1-workers")
        .await?;
    Ok(())
}
