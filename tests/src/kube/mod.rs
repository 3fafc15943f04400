//! A real Kubernetes management cluster for tests: etcd, kube-apiserver and the upstream Cluster
//! API core manager, built from their Go modules by `scripts/build-test-peers` (see
//! `docs/testing.md`, "Kubernetes + Cluster API environment"). No fake apiserver, no mocked CAPI.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! let env = siteboot_tests::kube::KubeEnv::start().await?;
//! let client = env.client(); // admin (system:masters)
//! env.create_workload_kubeconfig_secret("default", "my-cluster").await?;
//! # Ok(()) }
//! ```
//!
//! Each environment has its own temporary directory and free loopback ports, so tests can run in
//! parallel. Dropping it stops the processes (manager, apiserver, etcd) and removes the directory;
//! if the test is panicking, the processes' logs are printed first.
//!
//! What is installed, as in a real management cluster: the 13 CRDs of CAPI's
//! `core/config/crd/bases`, with conversion through the manager's `/convert`, and its mutating and
//! validating webhook configurations, so CAPI's defaulting and validation apply to every write.
//! Missing compared to a real cluster: kubelets (tests create Nodes, or boot a VM whose kubelet
//! joins), and kube-controller-manager and kube-scheduler unless a test starts them
//! ([`KubeEnv::start_control_plane`]: node bootstrap's and Deployments' controllers only, so no
//! garbage collection of owner references and no namespace finalization).

pub mod bootstrap;
pub mod capi;
pub mod clusterctl;
mod control_plane;
pub mod kubeadm;
mod manifests;
pub mod node;
pub mod peers;
mod pki;

use std::collections::BTreeSet;
use std::future::Future;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ::kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use ::kube::config::{KubeConfigOptions, Kubeconfig};
use ::kube::runtime::wait::{await_condition, conditions};
use ::kube::{Client, Config};
use anyhow::{Context, Result, anyhow, bail};
use base64::Engine;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub use peers::Peers;

use crate::process::Supervised;
use crate::wait;

/// Field manager for everything the harness applies.
const FIELD_MANAGER: &str = "siteboot-tests";
/// How many times a component is started on new ports when a port it was given was taken meanwhile.
const PORT_ATTEMPTS: usize = 4;
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
const CRD_TIMEOUT: Duration = Duration::from_secs(30);
/// One readiness probe (an HTTP GET on loopback).
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// The host as a QEMU guest with user-mode networking sees it: the apiserver's serving
/// certificate names it, so a VM's kubelet reaches the apiserver through QEMU at this address.
pub const VM_HOST_ADDRESS: &str = "10.0.2.2";

/// The running environment. Fields drop in order: processes stop before the directory goes.
pub struct KubeEnv {
    client: Client,
    apiserver_url: String,
    apiserver_port: u16,
    admin_kubeconfig: String,
    kubeconfig_path: PathBuf,
    webhook_port: u16,
    peers: Peers,
    procs: Procs,
    dir: tempfile::TempDir,
}

impl KubeEnv {
    /// Starts etcd, kube-apiserver and the Cluster API core manager, installs the CAPI CRDs and
    /// webhooks, and returns once the webhooks are being called by the apiserver.
    pub async fn start() -> Result<Self> {
        let started = Instant::now();
        let peers = Peers::locate()?;
        let dir = tempfile::Builder::new().prefix("siteboot-kube-").tempdir()?;
        let mut procs = Procs::default();
        match boot(&peers, dir.path(), &mut procs).await {
            Ok(booted) => {
                let startup = started.elapsed();
                eprintln!(
                    "kube env: up in {:.1} s at {} ({})",
                    startup.as_secs_f64(),
                    booted.apiserver_url,
                    dir.path().display()
                );
                Ok(Self {
                    client: booted.client,
                    apiserver_url: booted.apiserver_url,
                    apiserver_port: booted.apiserver_port,
                    admin_kubeconfig: booted.admin_kubeconfig,
                    kubeconfig_path: booted.kubeconfig_path,
                    webhook_port: booted.webhook_port,
                    peers,
                    procs,
                    dir,
                })
            }
            Err(err) => {
                procs.print_logs();
                Err(err.context("starting the Kubernetes + Cluster API test environment"))
            }
        }
    }

    /// An admin (system:masters) client.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// A client that acts as `user` (the admin impersonating it), with only the rights RBAC
    /// grants that user.
    pub async fn client_as_user(&self, user: &str) -> anyhow::Result<Client> {
        let kubeconfig: kube::config::Kubeconfig = serde_norway::from_str(&self.admin_kubeconfig)?;
        let mut config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
        config.auth_info.impersonate = Some(user.to_owned());
        Ok(Client::try_from(config)?)
    }

    /// The admin kubeconfig file, for programs under test (for example `siteboot --kubeconfig`).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig_path
    }

    /// The admin kubeconfig's text.
    pub fn admin_kubeconfig(&self) -> &str {
        &self.admin_kubeconfig
    }

    /// `https://127.0.0.1:<port>`.
    pub fn apiserver_url(&self) -> &str {
        &self.apiserver_url
    }

    /// The apiserver's port on 127.0.0.1 (for a `controlPlaneEndpoint`, for example).
    pub fn apiserver_port(&self) -> u16 {
        self.apiserver_port
    }

    /// The port of the Cluster API webhook server (admission and conversion).
    pub fn webhook_port(&self) -> u16 {
        self.webhook_port
    }

    pub fn peers(&self) -> &Peers {
        &self.peers
    }

    /// This environment's temporary directory (certificates, kubeconfig, etcd data, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `Api<DynamicObject>` for any kind, for example `api("cluster.x-k8s.io/v1beta2", "Machine",
    /// Some("default"))`. The plural is derived from the kind (`machines`); `namespace` None means
    /// all namespaces for namespaced kinds, or a cluster-scoped kind.
    pub fn api(
        &self,
        api_version: &str,
        kind: &str,
        namespace: Option<&str>,
    ) -> Api<DynamicObject> {
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
        match namespace {
            Some(namespace) => Api::namespaced_with(self.client(), namespace, &resource),
            None => Api::all_with(self.client(), &resource),
        }
    }

    /// Creates or updates a CRD (server-side apply) and waits until it is established.
    pub async fn install_crd(&self, crd: &Value) -> Result<()> {
        install_crds(&self.client, std::slice::from_ref(crd)).await
    }

    /// [`KubeEnv::install_crd`] for every CRD in a (multi-document) YAML text.
    pub async fn install_crd_yaml(&self, yaml: &str) -> Result<()> {
        install_crds(&self.client, &manifests::yaml_documents(yaml)?).await
    }

    /// Creates the Secret CAPI's ClusterCache reads to reach a workload cluster
    /// (`<cluster>-kubeconfig`, key `value`, type `cluster.x-k8s.io/secret`, labelled with the
    /// cluster name so the manager's cache sees it), pointing at this same apiserver: Nodes the
    /// test creates here are the workload cluster's Nodes.
    pub async fn create_workload_kubeconfig_secret(
        &self,
        namespace: &str,
        cluster: &str,
    ) -> Result<()> {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {
                "name": format!("{cluster}-kubeconfig"),
                "namespace": namespace,
                "labels": { "cluster.x-k8s.io/cluster-name": cluster },
            },
            "type": "cluster.x-k8s.io/secret",
            "stringData": { "value": self.admin_kubeconfig },
        }))?;
        Api::<Secret>::namespaced(self.client(), namespace)
            .create(&PostParams::default(), &secret)
            .await
            .with_context(|| format!("creating {namespace}/{cluster}-kubeconfig"))?;
        Ok(())
    }

    /// Starts kube-controller-manager, with node bootstrap's controllers (CSR approving and
    /// signing with this environment's CA, the CSR cleaner, the bootstrap token cleaner) and
    /// those of Deployments, and kube-scheduler; they stop first when the environment drops.
    pub async fn start_control_plane(&mut self) -> Result<()> {
        let files = control_plane::Files {
            kubeconfig: &self.kubeconfig_path,
            admin_kubeconfig: &self.admin_kubeconfig,
            pki_dir: &self.dir.path().join("pki"),
            logs: &self.dir.path().join("logs"),
        };
        let started = control_plane::start(&self.peers, &files, &mut self.procs).await;
        if started.is_err() {
            self.procs.print_logs();
        }
        started
    }

    /// Prints every component's log tail to stderr (also done automatically on panic).
    pub fn print_logs(&self) {
        self.procs.print_logs();
    }
}

/// The processes, in start order. Dropping stops them in reverse order (Supervised's drop), so
/// the manager goes before the apiserver and the apiserver before etcd.
#[derive(Default)]
struct Procs(Vec<Supervised>);

impl Procs {
    fn print_logs(&self) {
        for proc in &self.0 {
            proc.print_log();
        }
    }

    fn last(&mut self) -> &mut Supervised {
        self.0.last_mut().expect("a process was just pushed")
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        while let Some(proc) = self.0.pop() {
            drop(proc);
        }
    }
}

struct Booted {
    client: Client,
    apiserver_url: String,
    apiserver_port: u16,
    admin_kubeconfig: String,
    kubeconfig_path: PathBuf,
    webhook_port: u16,
}

async fn boot(peers: &Peers, dir: &Path, procs: &mut Procs) -> Result<Booted> {
    let logs = dir.join("logs");
    let pki = pki::Pki::new()?;
    let pki_dir = dir.join("pki");
    let webhook_dir = dir.join("webhook");
    let (sa_key, sa_pub) = pki::service_account_key()?;
    write(&pki_dir.join("ca.crt"), pki.ca_pem())?;
    write(&pki_dir.join("ca.key"), pki.ca_key_pem())?;
    write(&pki_dir.join("sa.key"), &sa_key)?;
    write(&pki_dir.join("sa.pub"), &sa_pub)?;
    // Where VMs reach it: QEMU's user-mode host, the lab appliance's address on its segment.
    let apiserver_cert =
        pki.server("kube-apiserver", &[VM_HOST_ADDRESS, crate::appliance::ADDRESS])?;
    write(&pki_dir.join("apiserver.crt"), &apiserver_cert.cert_pem)?;
    write(&pki_dir.join("apiserver.key"), &apiserver_cert.key_pem)?;
    // For kube-controller-manager and kube-scheduler, if a test starts them.
    for name in control_plane::SERVING_CERTIFICATES {
        let cert = pki.server(name, &[])?;
        write(&pki_dir.join(format!("{name}.crt")), &cert.cert_pem)?;
        write(&pki_dir.join(format!("{name}.key")), &cert.key_pem)?;
    }
    let webhook_cert = pki.server("capi-webhook", &[])?;
    write(&webhook_dir.join("tls.crt"), &webhook_cert.cert_pem)?;
    write(&webhook_dir.join("tls.key"), &webhook_cert.key_pem)?;
    let admin = pki.client("siteboot-test-admin", "system:masters")?;

    let (logs, pki_dir, webhook_dir, pki, admin) = (&logs, &pki_dir, &webhook_dir, &pki, &admin);

    // etcd: plain HTTP on loopback, no fsync (the data is thrown away).
    let etcd_port = start_with_retry(procs, "etcd", || async move {
        let (client, peer) = (free_port()?, free_port()?);
        let mut command = peer_command(peers, peers::ETCD);
        command.args([
            "--name=default".to_owned(),
            format!("--data-dir={}", dir.join("etcd").display()),
            format!("--listen-client-urls=http://127.0.0.1:{client}"),
            format!("--advertise-client-urls=http://127.0.0.1:{client}"),
            format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
            format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
            format!("--initial-cluster=default=http://127.0.0.1:{peer}"),
            "--unsafe-no-fsync=true".to_owned(),
        ]);
        let mut proc = Supervised::spawn("etcd", &mut command, logs)?;
        let ready = until_ready(&mut proc, "etcd to be healthy", || async move {
            http_status(client, "/health").await == Some(200)
        })
        .await;
        Ok((proc, ready.map(|()| client)))
    })
    .await?;

    let kubeconfig_path = &dir.join("admin.kubeconfig");
    let (client, apiserver_port, admin_kubeconfig) =
        start_with_retry(procs, "kube-apiserver", || async move {
            let port = free_port()?;
            let url = format!("https://127.0.0.1:{port}");
            let pki_file = |name: &str| pki_dir.join(name).display().to_string();
            let mut command = peer_command(peers, peers::KUBE_APISERVER);
            command.args([
                format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
                "--bind-address=127.0.0.1".to_owned(),
                "--advertise-address=127.0.0.1".to_owned(),
                format!("--secure-port={port}"),
                format!("--cert-dir={}", dir.join("apiserver").display()),
                format!("--tls-cert-file={}", pki_file("apiserver.crt")),
                format!("--tls-private-key-file={}", pki_file("apiserver.key")),
                format!("--client-ca-file={}", pki_file("ca.crt")),
                // Joining kubelets: bootstrap tokens authenticate, the Node authorizer lets
                // each kubelet write its own Node.
                "--enable-bootstrap-token-auth=true".to_owned(),
                "--authorization-mode=Node,RBAC".to_owned(),
                format!("--service-account-issuer={url}"),
                format!("--service-account-key-file={}", pki_file("sa.pub")),
                format!("--service-account-signing-key-file={}", pki_file("sa.key")),
                // Only allocates ClusterIPs for Service objects; nothing is routed there.
                "--service-cluster-ip-range=10.96.0.0/24".to_owned(),
                // The `kubernetes` Service cannot point at a loopback address.
                "--endpoint-reconciler-type=none".to_owned(),
            ]);
            let mut proc = Supervised::spawn("kube-apiserver", &mut command, logs)?;

            let kubeconfig = kubeconfig(&url, pki.ca_pem(), &admin.cert_pem, &admin.key_pem)?;
            write(kubeconfig_path, &kubeconfig)?;
            let config = Config::from_custom_kubeconfig(
                Kubeconfig::from_yaml(&kubeconfig)?,
                &KubeConfigOptions::default(),
            )
            .await?;
            let client = Client::try_from(config)?;
            let probe = &client;
            let ready =
                until_ready(&mut proc, "kube-apiserver to be ready (/readyz)", || async move {
                    let request =
                        http::Request::get("/readyz").body(Vec::new()).expect("a request");
                    probe.request_text(request).await.is_ok()
                })
                .await;
            Ok((proc, ready.map(|()| (client, port, kubeconfig))))
        })
        .await?;

    // The CRDs' conversion webhook URL names the manager's port, so CRDs are (re)applied for each
    // attempt; they must exist before the manager starts, or its informers fail.
    let capi_dir = peers.capi_module_dir();
    let client_ref = &client;
    let webhook_port = start_with_retry(procs, "capi-manager", || async move {
        let (webhook_port, health, diagnostics) = (free_port()?, free_port()?, free_port()?);
        let endpoint =
            manifests::WebhookEndpoint { port: webhook_port, ca_pem: pki.ca_pem().to_owned() };
        install_crds(client_ref, &manifests::capi_crds(capi_dir, &endpoint)?).await?;
        let mut command = peer_command(peers, peers::CAPI_MANAGER);
        command.args([
            format!("--kubeconfig={}", kubeconfig_path.display()),
            "--leader-elect=false".to_owned(),
            format!("--webhook-port={webhook_port}"),
            format!("--webhook-cert-dir={}", webhook_dir.display()),
            format!("--health-addr=127.0.0.1:{health}"),
            format!("--diagnostics-address=127.0.0.1:{diagnostics}"),
            "--insecure-diagnostics=true".to_owned(),
            // ClusterClass and managed topologies (alpha, off by default).
            "--feature-gates=ClusterTopology=true".to_owned(),
        ]);
        // Out of a Pod: ClusterCache then reaches the management cluster like any other.
        command.env_remove("POD_NAMESPACE").env_remove("POD_NAME").env_remove("POD_UID");
        let mut proc = Supervised::spawn("capi-manager", &mut command, logs)?;
        // /readyz includes the webhook server's "started" check.
        let ready = until_ready(&mut proc, "the Cluster API manager to be ready", || async move {
            http_status(health, "/readyz").await == Some(200)
        })
        .await;
        Ok((proc, ready.map(|()| webhook_port)))
    })
    .await?;

    let endpoint =
        manifests::WebhookEndpoint { port: webhook_port, ca_pem: pki.ca_pem().to_owned() };
    for configuration in manifests::capi_webhook_configurations(capi_dir, &endpoint)? {
        let name = configuration["metadata"]["name"].as_str().context("webhook name")?.to_owned();
        let params = PatchParams::apply(FIELD_MANAGER).force();
        match configuration["kind"].as_str() {
            Some("MutatingWebhookConfiguration") => {
                Api::<MutatingWebhookConfiguration>::all(client.clone())
                    .patch(&name, &params, &Patch::Apply(&configuration))
                    .await?;
            }
            Some("ValidatingWebhookConfiguration") => {
                Api::<ValidatingWebhookConfiguration>::all(client.clone())
                    .patch(&name, &params, &Patch::Apply(&configuration))
                    .await?;
            }
            other => bail!("unexpected kind {other:?} in the CAPI webhook manifests"),
        }
    }
    wait_for_webhooks(&client).await?;

    Ok(Booted {
        client,
        apiserver_url: format!("https://127.0.0.1:{apiserver_port}"),
        apiserver_port,
        admin_kubeconfig,
        kubeconfig_path: kubeconfig_path.clone(),
        webhook_port,
    })
}

/// Runs `start` until it succeeds, restarting on new ports when the process died because a port
/// it was given had been taken in the meantime (ports are picked by binding port 0 and released
/// before the process binds them). `start` returns the process it spawned and whether it became
/// ready; the process is kept in `procs` either way, so its log is printed if starting fails.
async fn start_with_retry<T, F, Fut>(procs: &mut Procs, name: &str, mut start: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(Supervised, Result<T>)>>,
{
    for attempt in 1..=PORT_ATTEMPTS {
        let (proc, ready) = start().await.with_context(|| format!("starting {name}"))?;
        procs.0.push(proc);
        match ready {
            Ok(value) => return Ok(value),
            Err(err) if attempt < PORT_ATTEMPTS && port_clash(procs.last()) => {
                eprintln!("kube env: {name} lost a port race ({err:#}); retrying on new ports");
                procs.0.pop();
            }
            Err(err) => return Err(err.context(format!("starting {name}"))),
        }
    }
    unreachable!("the last attempt returns")
}

/// Whether the process has exited saying that a port was in use.
fn port_clash(proc: &mut Supervised) -> bool {
    proc.try_wait().is_some() && proc.log().contains("address already in use")
}

/// Waits until `ready` returns true, failing at once if the process exits.
async fn until_ready<F, Fut>(proc: &mut Supervised, what: &str, mut ready: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let name = proc.name().to_owned();
    wait::for_async(what, STARTUP_TIMEOUT, || {
        // Checked here, not in the future, so the future does not borrow the process.
        let exited = proc.try_wait();
        let probe = ready();
        let name = name.clone();
        async move {
            match exited {
                Some(status) => {
                    Some(Err(anyhow!("{name} exited ({status}) while waiting for {what}")))
                }
                // A probe that hangs (a port taken by some other server) must not hide an exit.
                None => tokio::time::timeout(PROBE_TIMEOUT, probe)
                    .await
                    .unwrap_or(false)
                    .then_some(Ok(())),
            }
        }
    })
    .await?
}

/// Dry-run creates Machines until the apiserver calls both CAPI webhooks: the mutating one
/// defaults `spec.deletion.nodeDeletionTimeoutSeconds`, the validating one rejects a Machine with
/// no bootstrap. Webhook configurations take effect asynchronously after they are written.
async fn wait_for_webhooks(client: &Client) -> Result<()> {
    let resource =
        ApiResource::from_gvk(&GroupVersionKind::gvk("cluster.x-k8s.io", "v1beta2", "Machine"));
    let machines: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &resource);
    let probe = |bootstrap: Value| -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2",
            "kind": "Machine",
            "metadata": { "name": "webhook-probe" },
            "spec": {
                "clusterName": "webhook-probe",
                "bootstrap": bootstrap,
                "infrastructureRef": {
                    "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "ProbeMachine", "name": "probe"
                },
            },
        }))
        .expect("a valid Machine")
    };
    let (valid, invalid) = (probe(json!({ "dataSecretName": "probe" })), probe(json!({})));
    let dry_run = PostParams { dry_run: true, ..PostParams::default() };
    let (machines, valid, invalid, dry_run) = (&machines, &valid, &invalid, &dry_run);
    wait::for_async(
        "the apiserver to call the Cluster API webhooks",
        STARTUP_TIMEOUT,
        || async move {
            let defaulted = machines.create(dry_run, valid).await.ok()?;
            defaulted.data["spec"]["deletion"]["nodeDeletionTimeoutSeconds"].as_i64()?;
            match machines.create(dry_run, invalid).await {
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

async fn install_crds(client: &Client, crds: &[Value]) -> Result<()> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let mut names = Vec::new();
    for crd in crds {
        let name = crd["metadata"]["name"].as_str().context("a CRD without a name")?;
        api.patch(name, &params, &Patch::Apply(crd))
            .await
            .with_context(|| format!("applying CRD {name}"))?;
        names.push(name);
    }
    for name in names {
        tokio::time::timeout(
            CRD_TIMEOUT,
            await_condition(api.clone(), name, conditions::is_crd_established()),
        )
        .await
        .with_context(|| format!("CRD {name} not established after {CRD_TIMEOUT:?}"))??;
    }
    Ok(())
}

/// A self-contained kubeconfig (certificates inline), usable from another host's view too.
fn kubeconfig(server: &str, ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<String> {
    let b64 = |pem: &str| base64::engine::general_purpose::STANDARD.encode(pem);
    Ok(serde_norway::to_string(&json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{
            "name": "siteboot-test",
            "cluster": { "server": server, "certificate-authority-data": b64(ca_pem) },
        }],
        "users": [{
            "name": "admin",
            "user": { "client-certificate-data": b64(cert_pem), "client-key-data": b64(key_pem) },
        }],
        "contexts": [{ "name": "siteboot-test", "context": { "cluster": "siteboot-test", "user": "admin" } }],
        "current-context": "siteboot-test",
    }))?)
}

/// A loopback port that was free a moment ago and that this process has not handed out before
/// (so parallel environments in one test binary never get the same port).
fn free_port() -> Result<u16> {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port();
        if HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return Ok(port);
        }
    }
}

/// The status code of a plain-HTTP GET on loopback, or None if the server is not answering.
async fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut stream = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await.ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.ok()?;
    // "HTTP/1.1 200 OK"
    std::str::from_utf8(&response).ok()?.split_whitespace().nth(1)?.parse().ok()
}

/// A command for one of the peer programs. Besides the drop of [`Supervised`], the kernel kills it
/// when the thread that started the environment ends (PR_SET_PDEATHSIG), so a test binary that is
/// itself killed leaves no apiserver behind.
fn peer_command(peers: &Peers, name: &str) -> Command {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(peers.bin(name));
    // SAFETY: prctl is async-signal-safe, and nothing else runs between fork and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    command
}

fn write(path: &Path, text: &str) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
