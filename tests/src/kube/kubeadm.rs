//! A workload control plane that hosts can join with `kubeadm join`, as Cluster API's kubeadm
//! bootstrap provider (CABPK) has them do.
//!
//! The test's apiserver is a hosted control plane (the topology of Kamaji and k0smotron): no
//! host ran `kubeadm init` for it. So the `kubeadm init` phases a joining node relies on run
//! against it, with the real kubeadm:
//! - `bootstrap-token`: the `cluster-info` ConfigMap in `kube-public` (which the bootstrap
//!   signer of kube-controller-manager signs for each token, and which a joining node reads
//!   anonymously, checked against the CA hash CABPK pins) and the RBAC that lets bootstrap
//!   tokens read Nodes, post CSRs and have them approved;
//! - `upload-config`: the `kubeadm-config` and `kubelet-config` ConfigMaps and the RBAC to read
//!   them, from which `kubeadm join` writes the kubelet's configuration.
//!
//! kubeadm runs inside the lab's network namespace with a kubeconfig naming the endpoint hosts
//! reach, so cluster-info names it too (a joining node talks to the server cluster-info names).
//! CABPK reads the cluster's CA from the `<cluster>-ca` Secret, as a control plane provider
//! writes it.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use serde_json::{Value, json};

use super::{KubeEnv, peers};
use crate::netns::Netns;

/// Cluster API's kubeadm bootstrap provider's API.
const KUBEADM_BOOTSTRAP: &str = "bootstrap.cluster.x-k8s.io/v1beta2";
/// The node image's CNI configuration (a bridge), as its build installs it.
const NODE_CNI: &str =
    include_str!("../../fixtures/node-image/rootfs/etc/cni/net.d/10-node.conflist");
/// The containerd configuration kubeadm's hosts get: the systemd cgroup driver, as kubeadm
/// configures the kubelet.
const CONTAINERD_CONFIG: &str = r#"version = 2
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = true
"#;
/// The bootstrap token `kubeadm init phase bootstrap-token` insists on creating; deleted at
/// once (CABPK mints one per Machine).
const INIT_TOKEN_ID: &str = "sbinit";
const INIT_TOKEN: &str = "sbinit.0123456789abcdef";
/// Where kubeadm's configuration says the cluster's CA is: the phases read nothing there
/// (they write no certificate), but kubeadm checks the folder name is absolute.
const CERTIFICATES_DIR: &str = "/etc/kubernetes/pki";

impl KubeEnv {
    /// Prepares this apiserver for `kubeadm join` (see the module's documentation) at
    /// `https://<endpoint_host>:<apiserver port>` as seen from namespace `lab`, and writes the
    /// `<cluster>-ca` Secret in `ns`.
    pub async fn prepare_kubeadm_join(
        &self,
        lab: &Netns,
        endpoint_host: &str,
        ns: &str,
        cluster: &str,
    ) -> Result<()> {
        let pki = self.dir.path().join("pki");
        let ca_secret: Secret = serde_json::from_value(json!({
            "metadata": {
                "name": format!("{cluster}-ca"),
                "labels": { "cluster.x-k8s.io/cluster-name": cluster },
            },
            "type": "cluster.x-k8s.io/secret",
            "stringData": {
                "tls.crt": std::fs::read_to_string(pki.join("ca.crt"))?,
                "tls.key": std::fs::read_to_string(pki.join("ca.key"))?,
            },
        }))?;
        Api::<Secret>::namespaced(self.client(), ns)
            .create(&PostParams::default(), &ca_secret)
            .await
            .with_context(|| format!("creating {ns}/{cluster}-ca"))?;

        let endpoint = format!("{endpoint_host}:{}", self.apiserver_port());
        let mut kubeconfig: serde_json::Value = serde_norway::from_str(&self.admin_kubeconfig)?;
        kubeconfig["clusters"][0]["cluster"]["server"] = json!(format!("https://{endpoint}"));
        let dir = self.dir.path().join("kubeadm");
        std::fs::create_dir_all(&dir)?;
        let kubeconfig_path = dir.join("admin.conf");
        std::fs::write(&kubeconfig_path, serde_norway::to_string(&kubeconfig)?)?;
        let config_path = dir.join("kubeadm.yaml");
        let version = self.kubernetes_version()?;
        let config = init_configuration(endpoint_host, &endpoint, self.apiserver_port(), &version);
        std::fs::write(&config_path, config)?;

        let kubeadm = self.peers.bin(peers::KUBEADM);
        for phase in [&["bootstrap-token", "--skip-token-print"][..], &["upload-config", "all"]] {
            let mut command = lab.command(&kubeadm);
            command.args(["init", "phase"]).args(phase);
            command.arg(format!("--config={}", config_path.display()));
            command.arg(format!("--kubeconfig={}", kubeconfig_path.display()));
            run_kubeadm(&mut command, &dir.join("kubeadm.log"))?;
        }
        let tokens: Api<Secret> = Api::namespaced(self.client(), "kube-system");
        tokens
            .delete(&format!("bootstrap-token-{INIT_TOKEN_ID}"), &DeleteParams::default())
            .await
            .context("deleting kubeadm init's own bootstrap token")?;
        let cluster_info =
            Api::<ConfigMap>::namespaced(self.client(), "kube-public").get("cluster-info").await?;
        let info = cluster_info.data.unwrap_or_default();
        let named =
            info.get("kubeconfig").is_some_and(|k| k.contains(&format!("https://{endpoint}")));
        ensure!(named, "cluster-info does not name https://{endpoint}: {info:?}");
        Ok(())
    }

    /// A KubeadmConfigTemplate `name` in `ns` for the node image, as a user writes one for a
    /// plain Debian image with containerd: the systemd cgroup driver, forwarding, Debian's CNI
    /// plugins where containerd looks for them, the kubelet enabled, its Node labelled
    /// `example.com/pool=<pool>`. `after_reset`: for a host whose node state a reset removed (an
    /// adopted server claimed again), the image's CNI configuration and container images put
    /// back, as a cluster's CNI and an image preload would. Returns the fields of a Machine's
    /// spec that use it: `bootstrap`, and `version` (the peers' Kubernetes version), which
    /// kubeadm's provider needs.
    pub async fn create_kubeadm_config_template(
        &self,
        ns: &str,
        name: &str,
        pool: &str,
        after_reset: bool,
    ) -> Result<Value> {
        let mut files =
            vec![json!({ "path": "/etc/containerd/config.toml", "content": CONTAINERD_CONFIG })];
        let mut commands = vec![
            "modprobe br_netfilter",
            "sysctl -w net.ipv4.ip_forward=1",
            "mkdir -p /opt/cni && ln -sfn /usr/lib/cni /opt/cni/bin",
            "systemctl restart containerd",
            "systemctl enable kubelet",
        ];
        if after_reset {
            files.push(json!({ "path": "/etc/cni/net.d/10-node.conflist", "content": NODE_CNI }));
            commands.push("node-images");
        }
        let template: DynamicObject = serde_json::from_value(json!({
            "apiVersion": KUBEADM_BOOTSTRAP, "kind": "KubeadmConfigTemplate",
            "metadata": { "name": name },
            "spec": { "template": { "spec": {
                "format": "cloud-config",
                "files": files,
                "preKubeadmCommands": commands,
                "joinConfiguration": { "nodeRegistration": {
                    "kubeletExtraArgs": [{ "name": "node-labels", "value": format!("example.com/pool={pool}") }],
                } },
            } } },
        }))?;
        let templates = self.api(KUBEADM_BOOTSTRAP, "KubeadmConfigTemplate", Some(ns));
        templates.create(&PostParams::default(), &template).await?;
        let config_ref = json!({
            "apiGroup": "bootstrap.cluster.x-k8s.io", "kind": "KubeadmConfigTemplate", "name": name,
        });
        Ok(
            json!({ "bootstrap": { "configRef": config_ref }, "version": self.kubernetes_version()? }),
        )
    }

    /// The Kubernetes version of the peers (kubeadm's, the control plane's and the kubelet's):
    /// what a Machine joined with kubeadm says in `spec.version`.
    pub fn kubernetes_version(&self) -> Result<String> {
        let output = Command::new(self.peers.bin(peers::KUBEADM))
            .args(["version", "-o", "short"])
            .output()
            .context("running kubeadm version")?;
        ensure!(output.status.success(), "kubeadm version: {}", output.status);
        Ok(String::from_utf8(output.stdout)?.trim().to_owned())
    }
}

/// kubeadm's configuration for the phases: the control plane's endpoint and version, the
/// Service network CABPK's hosts assume (kubeadm's defaults), and the kubelet's configuration
/// every joining node gets: the systemd cgroup driver (as the node image's containerd is told
/// in the join data), the cluster DNS kubeadm derives from the Service range.
fn init_configuration(advertise: &str, endpoint: &str, port: u16, version: &str) -> String {
    format!(
        "apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
bootstrapTokens:
- token: {INIT_TOKEN}
  ttl: 10m0s
localAPIEndpoint:
  advertiseAddress: {advertise}
  bindPort: {port}
nodeRegistration:
  name: hosted-control-plane
  criSocket: unix:///run/containerd/containerd.sock
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: {version}
controlPlaneEndpoint: {endpoint}
certificatesDir: {CERTIFICATES_DIR}
networking:
  serviceSubnet: 10.96.0.0/12
  dnsDomain: cluster.local
---
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: systemd
clusterDNS: [10.96.0.10]
clusterDomain: cluster.local
"
    )
}

/// Runs one kubeadm phase, appending its output to `log`; fails with that output.
fn run_kubeadm(command: &mut Command, log: &Path) -> Result<()> {
    let output = command.output().context("running kubeadm")?;
    let text = format!(
        "$ {command:?}\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    use std::io::Write;
    std::fs::OpenOptions::new().create(true).append(true).open(log)?.write_all(text.as_bytes())?;
    if !output.status.success() {
        bail!("kubeadm failed ({}):\n{text}", output.status);
    }
    Ok(())
}
