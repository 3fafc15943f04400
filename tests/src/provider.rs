//! The lab for the Cluster API provider: the real Kubernetes + CAPI environment, siteboot in
//! Kubernetes mode in a lab namespace (reaching the apiserver through a loopback forward, as its
//! own ServiceAccount with the RBAC siteboot ships), and simulated hosts on the lab bridge.
//!
//! A background "operator" plays what the simulated hosts cannot: it power-cycles a host whose
//! Host object needs the ramdisk while the host runs its OS (a simulated host has no BMC), and
//! runs the kubelet of every provisioned host (a Node with the host's providerID, Ready unless
//! the test says otherwise).
//!
//! The lab's environment is the management cluster and also the workload cluster (the Nodes).
//! After `clusterctl move`, [`ProviderLab::move_to`] points the appliance at the management
//! cluster the objects went to; the Nodes stay where they are, as a workload cluster's do.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Node, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use sha2::Digest;
use siteboot_controller::crd::{Host, HostSpec, HostState, SITE_LABEL};
use siteboot_controller::manifests;

use crate::appliance::{self, Appliance};
use crate::forward::LoopbackForward;
use crate::kube::KubeEnv;
use crate::kube::capi::{self, CAPI};
use crate::netns::Netns;
use crate::os_images::{Ramdisk, TestOsImage};
use crate::process::Supervised;
use crate::sim::{Phase, SimHost};
use crate::wait;

/// Namespace of the Hosts, the Cluster and its Machines.
pub const NS: &str = "metal";
pub const SITE: &str = "lab";
pub const SYSTEM_NS: &str = "siteboot-system";
pub const INFRA: &str = "infrastructure.cluster.x-k8s.io/v1alpha1";
pub const INFRA_GROUP: &str = "infrastructure.cluster.x-k8s.io";

/// Provider labs running at once: each is a whole Kubernetes control plane plus siteboot.
static LABS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// Simulated hosts between power-on and Available at once while a lab starts: a thousand
/// powered on together would all DHCP, boot and be inspected in the same seconds, a load no
/// site sees and a small machine cannot carry.
pub const POWER_ON_WAVE: usize = 50;

/// How the lab runs siteboot and its simulated hosts' ramdisks.
#[derive(Debug, Clone, Copy, Default)]
struct Shape {
    /// See [`ProviderLab::start_polling_as_told`].
    polling_as_told: bool,
    /// See [`ProviderLab::start_split`].
    split: bool,
}

/// How a lab's simulated hosts behave.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sims {
    pub count: usize,
    /// The first `manual` hosts stop in the ramdisk once it holds a token and leave the agent
    /// API to the test (see [`SimHost::start_manual`]).
    pub manual: usize,
}

pub struct ProviderLab {
    sims: Arc<Mutex<Vec<Arc<SimHost>>>>,
    pub siteboot: Appliance,
    not_ready: Arc<Mutex<HashSet<String>>>,
    /// Whether the simulated kubelets register with `--provider-id` (as a bootstrap template
    /// that passes it from the meta-data does); if not, siteboot must set it on the Node.
    kubelet_provider_id: Arc<AtomicBool>,
    /// The management cluster's client, where the operator reads the Hosts.
    management: Arc<Mutex<kube::Client>>,
    operator: tokio::task::JoinHandle<()>,
    /// The management cluster's apiserver inside the lab namespace, for siteboot.
    forward: LoopbackForward,
    /// siteboot's kubeconfig file.
    kubeconfig: PathBuf,
    /// The apiserver's own port inside the lab namespace, on all its addresses: the
    /// `<cluster>-kubeconfig` Secrets (`KubeEnv::create_workload_kubeconfig_secret`) then work
    /// for siteboot too, and the lab's VMs join at `https://<appliance address>:<port>`.
    _workload_forward: LoopbackForward,
    pub lab: Netns,
    // Last: the apiserver outlives everything that talks to it.
    /// The management cluster the lab's objects were moved to ([`ProviderLab::move_to`]).
    moved_to: Option<KubeEnv>,
    /// The environment the lab started on: the management cluster until a move, and the
    /// workload cluster (its Nodes) throughout.
    pub env: KubeEnv,
    /// The siteboot ServiceAccount's token, for more appliances.
    token: String,
    /// Split ([`ProviderLab::start_split`]): the boot plane's ServiceAccount token.
    boot_plane_token: Option<String>,
    /// Split: the controller process, beside the boot plane.
    pub controller: Option<Supervised>,
    _slot: tokio::sync::SemaphorePermit<'static>,
}

/// Another appliance of the same site, in a namespace of its own (its boot plane reaches no
/// host: it only reconciles).
pub struct OtherAppliance {
    pub siteboot: Appliance,
    _forward: LoopbackForward,
    pub ns: Netns,
}

impl Drop for ProviderLab {
    fn drop(&mut self) {
        self.operator.abort();
    }
}

/// A MAC for simulated host `i` (`52:54:00:00:0c:<i>` for the first 256).
pub fn sim_mac(i: usize) -> String {
    format!("52:54:00:00:{:02x}:{:02x}", 0x0c + i / 256, i % 256)
}

pub fn host_name(i: usize) -> String {
    format!("host-{i}")
}

impl ProviderLab {
    /// `hosts` simulated hosts with Host objects, siteboot in Kubernetes mode (`config` may
    /// adjust its configuration), and every Host inspected and Available.
    pub async fn start(hosts: usize, config: impl FnOnce(&mut Value)) -> Result<Self> {
        Self::start_with(Sims { count: hosts, manual: 0 }, config).await
    }

    pub async fn start_with(sims: Sims, config: impl FnOnce(&mut Value)) -> Result<Self> {
        Self::start_new(sims, Shape::default(), config).await
    }

    /// [`ProviderLab::start_with`] with siteboot split as deployed: the boot plane
    /// (`--role boot-plane`, as the `siteboot-boot-plane` ServiceAccount) is
    /// [`ProviderLab::siteboot`], and the controller (`--role controller`, as `siteboot`) runs
    /// beside it.
    pub async fn start_split(sims: Sims, config: impl FnOnce(&mut Value)) -> Result<Self> {
        Self::start_new(sims, Shape { split: true, ..Shape::default() }, config).await
    }

    /// [`ProviderLab::start_with`] whose automatic hosts' ramdisks wait as long as they are told
    /// from power-on ([`SimHost::wait_as_told`]), as the agent does: a thousand idle ramdisks
    /// asking every 500 ms would be most of the appliance's work while the lab starts (the
    /// controller benchmark).
    pub async fn start_polling_as_told(
        sims: Sims,
        config: impl FnOnce(&mut Value),
    ) -> Result<Self> {
        Self::start_new(sims, Shape { polling_as_told: true, ..Shape::default() }, config).await
    }

    async fn start_new(sims: Sims, shape: Shape, config: impl FnOnce(&mut Value)) -> Result<Self> {
        let slot = LABS.acquire().await.expect("never closed");
        let env = KubeEnv::start().await?;
        for crd in manifests::crds() {
            env.install_crd(&serde_json::to_value(crd)?).await?;
        }
        capi::create_namespace(&env, NS).await?;
        capi::create_namespace(&env, SYSTEM_NS).await?;
        install_rbac(&env).await?;
        Self::start_in(slot, env, sims, shape, config).await
    }

    /// [`ProviderLab::start_with`] on `env`, where siteboot's CRDs, its namespace and RBAC are
    /// already installed (by `clusterctl init`, for example); the lab's namespace is made here.
    pub async fn start_on(
        env: KubeEnv,
        sims: Sims,
        config: impl FnOnce(&mut Value),
    ) -> Result<Self> {
        let slot = LABS.acquire().await.expect("never closed");
        capi::create_namespace(&env, NS).await?;
        Self::start_in(slot, env, sims, Shape::default(), config).await
    }

    async fn start_in(
        slot: tokio::sync::SemaphorePermit<'static>,
        env: KubeEnv,
        sims: Sims,
        shape: Shape,
        config: impl FnOnce(&mut Value),
    ) -> Result<Self> {
        let token = service_account_token(&env, "siteboot").await?;

        let lab = appliance::lab_network("prov")?;
        let mut cfg = appliance_config();
        config(&mut cfg);
        route_subnets(&lab, &cfg)?;
        let (forward, siteboot, boot_plane_token, controller) = if shape.split {
            let boot_plane = service_account_token(&env, manifests::BOOT_PLANE_ACCOUNT).await?;
            let (forward, siteboot) =
                start_appliance_with(&env, &lab, &boot_plane, cfg, &["--role", "boot-plane"])?;
            let controller = start_controller(&env, &lab, forward.port(), &token, &siteboot)?;
            (forward, siteboot, Some(boot_plane), Some(controller))
        } else {
            let (forward, siteboot) = start_appliance(&env, &lab, &token, cfg)?;
            (forward, siteboot, None, None)
        };
        // On every address of the lab: the appliance reaches it on its loopback, the lab's VMs
        // (real kubelets) at the appliance's address.
        let everywhere = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, env.apiserver_port());
        let workload_forward = LoopbackForward::start_at(&lab, everywhere, env.apiserver_port())?;
        let ramdisk = siteboot.http_root().join("ramdisk");
        std::fs::create_dir_all(&ramdisk)?;
        std::fs::write(ramdisk.join("vmlinuz"), vec![0xaa; 64 * 1024])?;
        std::fs::write(ramdisk.join("initrd.img"), vec![0xbb; 32 * 1024])?;
        // The sources of the images `image_spec` names, which the appliance fetches into its
        // cache and serves to the ramdisks.
        let images = siteboot.http_root().join("images");
        std::fs::create_dir_all(&images)?;
        for image in LAB_IMAGES {
            std::fs::write(images.join(format!("{image}.raw")), image)?;
        }
        std::fs::write(images.join(format!("{TAMPERED_IMAGE}.raw")), "not what was published")?;

        let not_ready = Arc::new(Mutex::new(HashSet::new()));
        let all: Arc<Mutex<Vec<Arc<SimHost>>>> = Arc::default();
        let kubelet_provider_id = Arc::new(AtomicBool::new(true));
        let management = Arc::new(Mutex::new(env.client()));
        let operator = tokio::spawn(operate(
            management.clone(),
            env.client(),
            all.clone(),
            not_ready.clone(),
            kubelet_provider_id.clone(),
        ));
        let lab = Self {
            sims: all,
            siteboot,
            not_ready,
            kubelet_provider_id,
            management,
            operator,
            forward,
            kubeconfig: appliance_kubeconfig(&env, &lab),
            _workload_forward: workload_forward,
            lab,
            moved_to: None,
            env,
            token,
            boot_plane_token,
            controller,
            _slot: slot,
        };
        for i in 0..sims.manual {
            lab.add_host(i, true).await?;
        }
        // The automatic hosts power on in waves of at most POWER_ON_WAVE not yet Available.
        let mut available = 0;
        for (started, i) in (sims.manual..sims.count).enumerate() {
            if started.saturating_sub(available) >= POWER_ON_WAVE {
                available = lab.wait_available(started + 1 - POWER_ON_WAVE).await?;
            }
            let sim = lab.add_host(i, false).await?;
            if shape.polling_as_told {
                sim.wait_as_told();
            }
        }
        let automatic = sims.count - sims.manual;
        // Inspection takes a few seconds per host, many at once: more time for more hosts.
        let inspection = Duration::from_secs(120) + Duration::from_secs(1) * sims.count as u32;
        lab.wait_hosts(HostState::Available, automatic, inspection).await?;
        Ok(lab)
    }

    /// Waits until at least `count` Hosts are Available (a power-on wave has room) and returns
    /// how many are. Two minutes without that is a failure: a wave's hosts are inspected in
    /// seconds.
    async fn wait_available(&self, count: usize) -> Result<usize> {
        let result = wait::until_async(
            &format!("{count} Hosts Available before powering on more"),
            Duration::from_secs(120),
            Duration::from_millis(500),
            || async {
                let states = self.host_states().await.ok()?;
                let n = states.values().filter(|s| **s == HostState::Available).count();
                (n >= count).then_some(n)
            },
        )
        .await;
        let state = if result.is_err() { self.describe().await } else { String::new() };
        result.with_context(|| format!("state:\n{state}"))
    }

    /// Host `i`: its Host object and a simulated machine (manual: see [`Sims::manual`]).
    pub async fn add_host(&self, i: usize, manual: bool) -> Result<Arc<SimHost>> {
        self.create_host(i).await?;
        let start = if manual { SimHost::start_manual } else { SimHost::start };
        let sim =
            Arc::new(start(&self.lab, appliance::BRIDGE, &sim_mac(i), self.siteboot.base_url())?);
        self.sims.lock().unwrap().push(sim.clone());
        Ok(sim)
    }

    /// Host `i`'s Host object, in the lab's site, without a machine behind it.
    pub async fn create_host(&self, i: usize) -> Result<()> {
        let mut host = Host::new(&host_name(i), HostSpec::new(sim_mac(i)));
        host.metadata.labels = Some(BTreeMap::from([(SITE_LABEL.to_owned(), SITE.to_owned())]));
        self.hosts().create(&PostParams::default(), &host).await?;
        Ok(())
    }

    /// Puts the real deploy ramdisk where the lab's `ramdisk` profile boots it from (in place
    /// of the stand-ins the simulated hosts never download).
    pub fn install_ramdisk(&self, ramdisk: &Ramdisk) -> Result<()> {
        let dir = self.siteboot.http_root().join("ramdisk");
        std::fs::copy(&ramdisk.kernel, dir.join("vmlinuz"))?;
        std::fs::copy(&ramdisk.initramfs, dir.join("initrd.img"))?;
        Ok(())
    }

    /// Serves `image` from the lab appliance's HTTP root as `images/<name>.raw`; returns the
    /// `image` of a SitebootMachine that writes it (the appliance fetches it into its cache).
    pub fn serve_image(&self, name: &str, image: &TestOsImage) -> Result<Value> {
        self.serve_image_file(&format!("{name}.raw"), &image.disk, &image.sha256)
    }

    /// Serves the image file `path`, whose SHA-256 is `sha256`, as `file_name` from the
    /// appliance's HTTP root; returns a SitebootMachine `image` for it.
    pub fn serve_image_file(&self, file_name: &str, path: &Path, sha256: &str) -> Result<Value> {
        std::fs::copy(path, self.siteboot.http_root().join("images").join(file_name))?;
        Ok(json!({
            "url": format!("http://{}:{}/files/images/{file_name}", appliance::ADDRESS, appliance::HTTP_PORT),
            "checksum": format!("sha256:{sha256}"),
        }))
    }

    /// Starts another appliance for the site; `config` adjusts its configuration.
    pub fn other_appliance(&self, config: impl FnOnce(&mut Value)) -> Result<OtherAppliance> {
        let ns = appliance::lab_network("prov2")?;
        let mut cfg = appliance_config();
        config(&mut cfg);
        let (forward, siteboot) = start_appliance(&self.env, &ns, &self.token, cfg)?;
        Ok(OtherAppliance { siteboot, _forward: forward, ns })
    }

    /// Another replica of the site's appliance on the lab segment itself: a namespace of its
    /// own whose `eth0`, at `address` (in 10.99.0.0/24), is joined to the lab bridge. Its
    /// `--identity` is `identity`; `config` adjusts its configuration.
    pub fn replica(
        &self,
        address: &str,
        identity: &str,
        config: impl FnOnce(&mut Value),
    ) -> Result<OtherAppliance> {
        let ns = Netns::new("replica")?;
        self.lab.connect(appliance::BRIDGE, &ns, "eth0", None)?;
        ns.ip(&["addr", "add", &format!("{address}/{}", appliance::PREFIX_LEN), "dev", "eth0"])?;
        let mut cfg = appliance_config();
        cfg["interface"] = json!("eth0");
        cfg["address"] = json!(address);
        cfg["dhcp"]["subnets"][0]["router"] = json!(address);
        config(&mut cfg);
        let (forward, siteboot) =
            start_appliance_with(&self.env, &ns, &self.token, cfg, &["--identity", identity])?;
        Ok(OtherAppliance { siteboot, _forward: forward, ns })
    }

    /// Points the appliance at `target`, the management cluster the lab's objects were moved to
    /// (`clusterctl move`), where siteboot is installed: siteboot restarts with the same
    /// configuration, state directory and simulated hosts, as its ServiceAccount there. From
    /// then on the lab's Hosts and Cluster API objects are `target`'s; the Nodes stay in
    /// [`ProviderLab::env`].
    pub async fn move_to(&mut self, target: KubeEnv) -> Result<()> {
        let token = service_account_token(&target, "siteboot").await?;
        let forward = LoopbackForward::start(&self.lab, target.apiserver_port())?;
        std::fs::write(
            &self.kubeconfig,
            service_account_kubeconfig(&target, forward.port(), &token)?,
        )?;
        self.siteboot.restart()?;
        self.forward = forward;
        *self.management.lock().unwrap() = target.client();
        self.moved_to = Some(target);
        Ok(())
    }

    /// The management cluster: where the Hosts and the Cluster API objects are.
    pub fn management(&self) -> &KubeEnv {
        self.moved_to.as_ref().unwrap_or(&self.env)
    }

    /// A client that acts as siteboot's ServiceAccount, with exactly the RBAC siteboot ships.
    pub async fn siteboot_client(&self) -> Result<kube::Client> {
        self.client_as(&self.token).await
    }

    /// A client with the credentials of the process that serves the segment: the boot plane's
    /// ServiceAccount when split, else siteboot's.
    pub async fn segment_client(&self) -> Result<kube::Client> {
        self.client_as(self.boot_plane_token.as_deref().unwrap_or(&self.token)).await
    }

    async fn client_as(&self, token: &str) -> Result<kube::Client> {
        let yaml = service_account_kubeconfig(&self.env, self.env.apiserver_port(), token)?;
        let kubeconfig: kube::config::Kubeconfig = serde_norway::from_str(&yaml)?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
        Ok(kube::Client::try_from(config)?)
    }

    pub fn sims(&self) -> Vec<Arc<SimHost>> {
        self.sims.lock().unwrap().clone()
    }

    pub fn hosts(&self) -> Api<Host> {
        Api::namespaced(self.management().client(), NS)
    }

    /// Writes the BMC credentials Secret `<host>-bmc`: `user` (name, password) for the BMC at
    /// `address`, which siteboot sends them to and nowhere else. Returns its name.
    pub async fn bmc_credentials(
        &self,
        host: &str,
        address: &str,
        user: (&str, &str),
    ) -> Result<String> {
        let name = format!("{host}-bmc");
        let data = [("username", user.0), ("password", user.1), ("address", address)]
            .map(|(k, v)| (k.to_owned(), k8s_openapi::ByteString(v.as_bytes().to_vec())));
        let secret = Secret {
            metadata: kube::api::ObjectMeta { name: Some(name.clone()), ..Default::default() },
            data: Some(BTreeMap::from(data)),
            ..Default::default()
        };
        let secrets = Api::<Secret>::namespaced(self.management().client(), NS);
        let apply = PatchParams::apply("siteboot-tests").force();
        secrets.patch(&name, &apply, &Patch::Apply(&secret)).await?;
        Ok(name)
    }

    pub fn api(&self, kind: &str) -> Api<DynamicObject> {
        self.api_in(NS, kind)
    }

    /// [`ProviderLab::api`] in namespace `ns` (a tenant's, say).
    pub fn api_in(&self, ns: &str, kind: &str) -> Api<DynamicObject> {
        let version = if kind.starts_with("Siteboot") { INFRA } else { CAPI };
        self.management().api(version, kind, Some(ns))
    }

    /// Hosts by state.
    pub async fn host_states(&self) -> Result<BTreeMap<String, HostState>> {
        let hosts = self.hosts().list(&ListParams::default()).await?;
        Ok(hosts
            .items
            .iter()
            .filter_map(|h| Some((h.name_any(), h.status.as_ref()?.state?)))
            .collect())
    }

    /// Waits until exactly `count` Hosts are in `state`.
    pub async fn wait_hosts(
        &self,
        state: HostState,
        count: usize,
        timeout: Duration,
    ) -> Result<()> {
        let last = Mutex::new(BTreeMap::new());
        let result = wait::for_async(&format!("{count} Hosts {state:?}"), timeout, || async {
            let states = self.host_states().await.ok()?;
            let n = states.values().filter(|s| **s == state).count();
            *last.lock().unwrap() = states;
            (n == count).then_some(())
        })
        .await;
        let _ = last;
        let state = self.describe().await;
        result.with_context(|| format!("state:\n{state}"))
    }

    /// What a deleted Machine must not leave behind, one line each: Machines, SitebootMachines
    /// and SitebootConfigs in [`NS`], bootstrap tokens in the workload cluster, and bootstrap
    /// data staged for the boot plane in [`SYSTEM_NS`].
    pub async fn leftovers(&self) -> Result<Vec<String>> {
        let mut left = Vec::new();
        let all = ListParams::default();
        for kind in ["Machine", "SitebootMachine"] {
            for object in self.api(kind).list(&all).await?.items {
                left.push(format!("{kind} {}", object.name_any()));
            }
        }
        let configs = self.env.api(crate::kube::bootstrap::BOOTSTRAP, "SitebootConfig", Some(NS));
        for config in configs.list(&all).await?.items {
            left.push(format!("SitebootConfig {}", config.name_any()));
        }
        let tokens = Api::<Secret>::namespaced(self.env.client(), "kube-system");
        let of_type = ListParams::default().fields("type=bootstrap.kubernetes.io/token");
        for token in tokens.list(&of_type).await?.items {
            left.push(format!("bootstrap token Secret {}", token.name_any()));
        }
        for staged in
            Api::<Secret>::namespaced(self.env.client(), SYSTEM_NS).list(&all).await?.items
        {
            let name = staged.name_any();
            if name.starts_with("siteboot-bootstrap-") {
                left.push(format!("staged bootstrap data Secret {SYSTEM_NS}/{name}"));
            }
        }
        Ok(left)
    }

    /// What an operator would look at: Machines, SitebootMachines and Hosts, one line each.
    pub async fn describe(&self) -> String {
        let mut out = Vec::new();
        let ready = |o: &DynamicObject| {
            o.data["status"]["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "Ready").cloned())
                .unwrap_or_default()
        };
        if let Ok(list) = self.api("Machine").list(&ListParams::default()).await {
            for m in list.items {
                out.push(format!(
                    "Machine {} phase={} infra={} deleting={}",
                    m.name_any(),
                    m.data["status"]["phase"],
                    m.data["spec"]["infrastructureRef"]["name"],
                    m.metadata.deletion_timestamp.is_some()
                ));
            }
        }
        if let Ok(list) = self.api("SitebootMachine").list(&ListParams::default()).await {
            for m in list.items {
                let r = ready(&m);
                out.push(format!(
                    "SitebootMachine {} host={} ready={} {} {} deleting={}",
                    m.name_any(),
                    m.data["spec"]["hostRef"]["name"],
                    r["status"],
                    r["reason"],
                    r["message"],
                    m.metadata.deletion_timestamp.is_some()
                ));
            }
        }
        if let Ok(list) = self.hosts().list(&ListParams::default()).await {
            for h in list.items {
                let status = h.status.clone().unwrap_or_default();
                out.push(format!(
                    "Host {} state={:?} consumer={:?} provisioning={} op={:?}",
                    h.name_any(),
                    status.state,
                    h.spec.consumer_ref.as_ref().map(|c| c.name.clone()),
                    h.spec.provisioning.is_some(),
                    status.operation.map(|o| (o.kind, o.step)),
                ));
            }
        }
        for sim in self.sims() {
            out.push(format!("sim {} phase={:?} boots={}", sim.mac(), sim.phase(), sim.boots()));
        }
        out.join("\n")
    }

    /// `kubectl get` as the apiserver renders it (a meta.k8s.io Table: the CRD's printer
    /// columns) for `path`, e.g. `/apis/siteboot.dev/v1alpha1/namespaces/metal/hosts`.
    pub async fn table(&self, path: &str) -> Result<Value> {
        let request = http::Request::get(path)
            .header("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
            .body(Vec::new())?;
        Ok(serde_json::from_str(&self.management().client().request_text(request).await?)?)
    }

    /// The Node of a provisioned host reports NotReady (or Ready again).
    /// From now on, simulated kubelets register without `--provider-id`, under a Node name of
    /// their own (`kubelet-<host>`), with the host's system UUID.
    pub fn kubelets_without_provider_id(&self) {
        self.kubelet_provider_id.store(false, Ordering::Relaxed);
    }

    pub fn set_node_ready(&self, host: &str, ready: bool) {
        let mut set = self.not_ready.lock().unwrap();
        if ready {
            set.remove(host);
        } else {
            set.insert(host.to_owned());
        }
    }

    /// A SitebootCluster and a Cluster using it, and the bootstrap Secret its Machines use
    /// (before a move: the Cluster's workload is [`ProviderLab::env`], whose control plane
    /// endpoint is the appliance's address: the lab's VMs join there).
    pub async fn create_cluster(&self, name: &str, bootstrap: &str) -> Result<()> {
        self.create_cluster_in(NS, name, bootstrap).await
    }

    /// [`ProviderLab::create_cluster`] in namespace `ns`, which must exist.
    pub async fn create_cluster_in(&self, ns: &str, name: &str, bootstrap: &str) -> Result<()> {
        let sbc: DynamicObject = serde_json::from_value(json!({
            "apiVersion": INFRA, "kind": "SitebootCluster", "metadata": { "name": name }, "spec": {},
        }))?;
        self.api_in(ns, "SitebootCluster").create(&PostParams::default(), &sbc).await?;
        let infrastructure = Some((INFRA_GROUP, "SitebootCluster", name));
        capi::create_cluster_at(&self.env, ns, name, infrastructure, appliance::ADDRESS).await?;
        capi::create_bootstrap_secret(&self.env, ns, name, &format!("{name}-bootstrap"), bootstrap)
            .await
    }

    /// A SitebootMachineTemplate writing image `image` (a name: the URL and checksum derive
    /// from it).
    pub async fn create_template(&self, name: &str, image: &str) -> Result<()> {
        self.create_template_spec(name, json!({ "image": image_spec(image) })).await
    }

    /// A SitebootMachineTemplate whose machines get `spec` (a SitebootMachine's spec).
    pub async fn create_template_spec(&self, name: &str, spec: Value) -> Result<()> {
        self.create_template_spec_in(NS, name, spec).await
    }

    /// [`ProviderLab::create_template_spec`] in namespace `ns`.
    pub async fn create_template_spec_in(&self, ns: &str, name: &str, spec: Value) -> Result<()> {
        let template: DynamicObject = serde_json::from_value(json!({
            "apiVersion": INFRA, "kind": "SitebootMachineTemplate", "metadata": { "name": name },
            "spec": { "template": { "spec": spec } },
        }))?;
        self.api_in(ns, "SitebootMachineTemplate")
            .create(&PostParams::default(), &template)
            .await?;
        Ok(())
    }

    /// A MachineDeployment of `replicas` Machines from `template`, bootstrapped with the
    /// cluster's bootstrap Secret.
    pub async fn create_machine_deployment(
        &self,
        name: &str,
        cluster: &str,
        template: &str,
        replicas: u32,
    ) -> Result<()> {
        self.create_machine_deployment_in(NS, name, cluster, template, replicas).await
    }

    /// [`ProviderLab::create_machine_deployment`] in namespace `ns`.
    pub async fn create_machine_deployment_in(
        &self,
        ns: &str,
        name: &str,
        cluster: &str,
        template: &str,
        replicas: u32,
    ) -> Result<()> {
        let bootstrap = json!({ "dataSecretName": format!("{cluster}-bootstrap") });
        self.create_machine_deployment_with(ns, name, cluster, template, replicas, bootstrap).await
    }

    /// [`ProviderLab::create_machine_deployment_in`] whose Machines' `spec.bootstrap` is
    /// `bootstrap` (a `configRef` to a bootstrap provider's template, say).
    pub async fn create_machine_deployment_with(
        &self,
        ns: &str,
        name: &str,
        cluster: &str,
        template: &str,
        replicas: u32,
        bootstrap: Value,
    ) -> Result<()> {
        let md: DynamicObject = serde_json::from_value(json!({
            "apiVersion": CAPI, "kind": "MachineDeployment", "metadata": { "name": name },
            "spec": {
                "clusterName": cluster,
                "replicas": replicas,
                "selector": { "matchLabels": { "pool": name } },
                "template": {
                    "metadata": { "labels": { "pool": name } },
                    "spec": {
                        "clusterName": cluster,
                        "bootstrap": bootstrap,
                        "infrastructureRef": { "apiGroup": INFRA_GROUP, "kind": "SitebootMachineTemplate", "name": template },
                    },
                },
            },
        }))?;
        self.api_in(ns, "MachineDeployment").create(&PostParams::default(), &md).await?;
        Ok(())
    }

    /// Sets a MachineDeployment's replicas.
    pub async fn scale(&self, deployment: &str, replicas: u32) -> Result<()> {
        let patch = Patch::Merge(json!({ "spec": { "replicas": replicas } }));
        self.api("MachineDeployment").patch(deployment, &PatchParams::default(), &patch).await?;
        Ok(())
    }

    /// Machines of a MachineDeployment that are Running with a nodeRef.
    pub async fn running_machines(&self, deployment: &str) -> Result<Vec<DynamicObject>> {
        let lp =
            ListParams::default().labels(&format!("cluster.x-k8s.io/deployment-name={deployment}"));
        let machines = self.api("Machine").list(&lp).await?.items;
        Ok(machines
            .into_iter()
            .filter(|m| {
                m.data["status"]["phase"] == json!("Running")
                    && m.data["status"]["nodeRef"]["name"].is_string()
            })
            .collect())
    }

    /// Waits until the MachineDeployment has exactly `count` Machines, all Running.
    pub async fn wait_running(
        &self,
        deployment: &str,
        count: usize,
        timeout: Duration,
    ) -> Result<Vec<DynamicObject>> {
        let lp =
            ListParams::default().labels(&format!("cluster.x-k8s.io/deployment-name={deployment}"));
        let result = wait::for_async(
            &format!("{count} Machines of {deployment} Running"),
            timeout,
            || async {
                let all = self.api("Machine").list(&lp).await.ok()?.items;
                let running = self.running_machines(deployment).await.ok()?;
                (all.len() == count && running.len() == count).then_some(running)
            },
        )
        .await;
        let state = self.describe().await;
        result.with_context(|| format!("state:\n{state}"))
    }
}

/// The images a lab serves: `image_spec` of any of them can be provisioned.
pub const LAB_IMAGES: [&str; 2] = ["v1", "v2"];

/// An image whose source no longer has the bytes its checksum names.
pub const TAMPERED_IMAGE: &str = "tampered";

/// An image whose bytes are its name, from the lab appliance's HTTP root.
pub fn image_spec(image: &str) -> Value {
    let digest = sha2::Sha256::digest(image.as_bytes());
    json!({ "url": format!("http://10.99.0.1:8080/files/images/{image}.raw"), "checksum": format!("sha256:{}", hex(&digest)) })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The lab config in Kubernetes mode for site `lab`, with the ramdisk profile.
fn appliance_config() -> Value {
    let mut cfg = appliance::lab_config("full");
    cfg.as_object_mut().unwrap().remove("unknown_hosts");
    cfg["profiles"]["ramdisk"] = json!({ "kernel": "ramdisk/vmlinuz", "initrds": ["ramdisk/initrd.img"], "cmdline": "console=ttyS0" });
    cfg["kubernetes"] =
        json!({ "site": SITE, "ramdisk_profile": "ramdisk", "lease_namespace": SYSTEM_NS });
    cfg
}

/// Routes each DHCP subnet of `config` wider than the lab bridge's own /24 (a pool for more
/// than a hundred hosts) onto the bridge, so the appliance reaches every address it leases.
fn route_subnets(lab: &Netns, config: &Value) -> Result<()> {
    let own = format!("10.99.0.0/{}", appliance::PREFIX_LEN);
    let subnets = config["dhcp"]["subnets"].as_array().into_iter().flatten();
    for subnet in subnets.filter_map(|s| s["subnet"].as_str()).filter(|s| *s != own) {
        lab.ip(&["route", "add", subnet, "dev", appliance::BRIDGE, "src", appliance::ADDRESS])?;
    }
    Ok(())
}

/// siteboot in `ns`, reaching the apiserver as its ServiceAccount through a loopback forward.
fn start_appliance(
    env: &KubeEnv,
    ns: &Netns,
    token: &str,
    config: Value,
) -> Result<(LoopbackForward, Appliance)> {
    start_appliance_with(env, ns, token, config, &[])
}

/// [`start_appliance`] with more `siteboot serve` arguments.
fn start_appliance_with(
    env: &KubeEnv,
    ns: &Netns,
    token: &str,
    config: Value,
    args: &[&str],
) -> Result<(LoopbackForward, Appliance)> {
    let forward = LoopbackForward::start(ns, env.apiserver_port())?;
    let kubeconfig = appliance_kubeconfig(env, ns);
    std::fs::write(&kubeconfig, service_account_kubeconfig(env, forward.port(), token)?)?;
    let mut all = vec!["--kubeconfig", kubeconfig.to_str().unwrap()];
    all.extend_from_slice(args);
    let siteboot = Appliance::start_with_args(ns, config, &all)?;
    Ok((forward, siteboot))
}

/// `siteboot serve --role controller` in `ns` beside the boot plane `boot_plane`, with its
/// config, as siteboot's ServiceAccount (`token`) through the apiserver forward at `port`.
fn start_controller(
    env: &KubeEnv,
    ns: &Netns,
    port: u16,
    token: &str,
    boot_plane: &Appliance,
) -> Result<Supervised> {
    let kubeconfig = env.dir().join("siteboot-controller.kubeconfig");
    std::fs::write(&kubeconfig, service_account_kubeconfig(env, port, token)?)?;
    let config = env.dir().join("siteboot-controller.yaml");
    std::fs::write(&config, boot_plane.config())?;
    let mut command = crate::netns::exec(ns.name(), appliance::binary()?);
    command.arg("serve").arg("--config").arg(&config).arg("--kubeconfig").arg(&kubeconfig);
    command.args(["--role", "controller"]).env("NO_COLOR", "1");
    Supervised::spawn("siteboot-controller", &mut command, env.dir())
}

/// Where the kubeconfig of the appliance in `ns` is written.
fn appliance_kubeconfig(env: &KubeEnv, ns: &Netns) -> PathBuf {
    env.dir().join(format!("siteboot-{}.kubeconfig", ns.name()))
}

fn object_namespace(object: &Value) -> &str {
    object["metadata"]["namespace"].as_str().unwrap_or(SYSTEM_NS)
}

/// The ServiceAccount siteboot ships with and its RBAC.
async fn install_rbac(env: &KubeEnv) -> Result<()> {
    let client = env.client();
    for object in
        manifests::rbac(SYSTEM_NS, &manifests::SecretAccess::Namespaces(vec![NS.to_owned()]))
    {
        let pp = PostParams::default();
        match object["kind"].as_str() {
            Some("ServiceAccount") => drop(
                Api::<ServiceAccount>::namespaced(client.clone(), SYSTEM_NS)
                    .create(&pp, &serde_json::from_value(object)?)
                    .await?,
            ),
            Some("ClusterRole") => drop(
                Api::<ClusterRole>::all(client.clone())
                    .create(&pp, &serde_json::from_value(object)?)
                    .await?,
            ),
            Some("ClusterRoleBinding") => drop(
                Api::<ClusterRoleBinding>::all(client.clone())
                    .create(&pp, &serde_json::from_value(object)?)
                    .await?,
            ),
            Some("Role") => drop(
                Api::<Role>::namespaced(client.clone(), object_namespace(&object))
                    .create(&pp, &serde_json::from_value(object)?)
                    .await?,
            ),
            Some("RoleBinding") => drop(
                Api::<RoleBinding>::namespaced(client.clone(), object_namespace(&object))
                    .create(&pp, &serde_json::from_value(object)?)
                    .await?,
            ),
            other => bail!("unexpected RBAC kind {other:?}"),
        }
    }
    Ok(())
}

/// A token for the ServiceAccount `account` of siteboot's namespace.
async fn service_account_token(env: &KubeEnv, account: &str) -> Result<String> {
    let request: TokenRequest =
        serde_json::from_value(json!({ "spec": { "audiences": [], "expirationSeconds": 86400 } }))?;
    let api = Api::<ServiceAccount>::namespaced(env.client(), SYSTEM_NS);
    let response: TokenRequest =
        api.create_subresource("token", account, &PostParams::default(), &request).await?;
    response.status.and_then(|s| s.token).context("TokenRequest returned no token")
}

/// A kubeconfig for the siteboot ServiceAccount, with the apiserver at `port` on loopback.
fn service_account_kubeconfig(env: &KubeEnv, port: u16, token: &str) -> Result<String> {
    let admin: Value = serde_norway::from_str(env.admin_kubeconfig())?;
    let ca = admin["clusters"][0]["cluster"]["certificate-authority-data"]
        .as_str()
        .context("admin kubeconfig has no CA data")?;
    Ok(serde_norway::to_string(&json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{ "name": "lab", "cluster": { "server": format!("https://127.0.0.1:{port}"), "certificate-authority-data": ca } }],
        "users": [{ "name": "siteboot", "user": { "token": token } }],
        "contexts": [{ "name": "lab", "context": { "cluster": "lab", "user": "siteboot" } }],
        "current-context": "lab",
    }))?)
}

/// The operator's loop: power buttons (for the Hosts of the `management` cluster) and kubelets
/// (in the `workload` cluster); see the module comment.
async fn operate(
    management: Arc<Mutex<kube::Client>>,
    workload: kube::Client,
    sims: Arc<Mutex<Vec<Arc<SimHost>>>>,
    not_ready: Arc<Mutex<HashSet<String>>>,
    kubelet_provider_id: Arc<AtomicBool>,
) {
    let nodes: Api<Node> = Api::all(workload);
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let hosts: Api<Host> = Api::namespaced(management.lock().unwrap().clone(), NS);
        let Ok(list) = hosts.list(&ListParams::default()).await else { continue };
        let Ok(registered) = nodes.list(&ListParams::default()).await else { continue };
        // Node name -> its Ready status, if it reported one.
        let registered: HashMap<String, Option<bool>> =
            registered.items.iter().map(|n| (n.name_any(), node_ready(n))).collect();
        let sims = sims.lock().unwrap().clone();
        for host in &list.items {
            let Some(sim) = sims.iter().find(|s| s.mac() == host.spec.boot_mac_address) else {
                continue;
            };
            let state = host.status.as_ref().and_then(|s| s.state);
            let needs_ramdisk = matches!(
                state,
                Some(HostState::Inspecting | HostState::Provisioning | HostState::Deprovisioning)
            );
            if sim.phase() == Phase::Os && needs_ramdisk {
                sim.reboot();
            }
            if sim.phase() == Phase::Os && state == Some(HostState::Provisioned) {
                let ready = !not_ready.lock().unwrap().contains(&host.name_any());
                let with_provider_id = kubelet_provider_id.load(Ordering::Relaxed);
                // Only a change is reported: heartbeats every 500 ms from a thousand simulated
                // kubelets would be most of the apiserver's load, and nothing here reads them.
                let node = node_name(host, with_provider_id);
                if registered.get(&node) != Some(&Some(ready)) {
                    let _ = kubelet(&nodes, host, ready, with_provider_id).await;
                }
            }
        }
    }
}

/// The Node a provisioned host's kubelet registers: named like the host when it passes
/// `--provider-id`, else under a name of its own.
fn node_name(host: &Host, with_provider_id: bool) -> String {
    if with_provider_id { host.name_any() } else { format!("kubelet-{}", host.name_any()) }
}

/// Whether the Node's Ready condition is True, if it has one.
fn node_ready(node: &Node) -> Option<bool> {
    let conditions = node.status.as_ref()?.conditions.as_ref()?;
    conditions.iter().find(|c| c.type_ == "Ready").map(|c| c.status == "True")
}

/// Registers the host's Node (providerID as its SitebootMachine reports it) and its readiness.
async fn kubelet(
    nodes: &Api<Node>,
    host: &Host,
    ready: bool,
    with_provider_id: bool,
) -> Result<()> {
    let name = node_name(host, with_provider_id);
    let spec = if with_provider_id {
        json!({ "providerID": format!("siteboot://{NS}/{}", host.name_any()) })
    } else {
        json!({})
    };
    let existing = match nodes.get_opt(&name).await? {
        Some(node) => node,
        None => {
            let node: Node =
                serde_json::from_value(json!({ "metadata": { "name": name }, "spec": spec }))?;
            nodes.create(&PostParams::default(), &node).await?
        }
    };
    let previous = existing.status.and_then(|s| s.conditions).unwrap_or_default();
    // What a kubelet reports: Ready, and the three pressure conditions (CAPI counts a Node
    // without them as not healthy, so a rollout would wait for it forever). A condition's
    // transition time moves only when its status changes: health checks time from it.
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let condition = |type_: &str, status: &str, reason: &str| {
        let since = previous
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .and_then(|c| c.last_transition_time.as_ref())
            .map(|t| t.0.to_string())
            .unwrap_or_else(|| now.clone());
        json!({
            "type": type_, "status": status, "reason": reason, "message": "simulated kubelet",
            "lastHeartbeatTime": now, "lastTransitionTime": since,
        })
    };
    let node_info = json!({
        "systemUUID": crate::sim::system_uuid(&host.spec.boot_mac_address),
        "machineID": "", "bootID": "", "kernelVersion": "", "osImage": "",
        "containerRuntimeVersion": "", "kubeletVersion": "", "kubeProxyVersion": "",
        "operatingSystem": "linux", "architecture": "amd64",
    });
    let patch = json!({ "status": { "nodeInfo": node_info, "conditions": [
        condition("Ready", if ready { "True" } else { "False" }, if ready { "KubeletReady" } else { "KubeletNotReady" }),
        condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
        condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
        condition("PIDPressure", "False", "KubeletHasSufficientPID"),
    ] } });
    nodes.patch_status(&name, &PatchParams::default(), &Patch::Strategic(patch)).await?;
    Ok(())
}

/// The Host's state, if it has one yet.
pub fn host_state(host: &Host) -> Option<HostState> {
    host.status.as_ref()?.state
}

/// Waits until Host `name` satisfies `done`; a Quarantined Host that does not is an error at
/// once, with its reason.
pub async fn wait_host(
    hosts: &Api<Host>,
    name: &str,
    what: &str,
    timeout: Duration,
    done: impl Fn(&Host) -> bool,
) -> Result<Host> {
    let quarantined = |h: &Host| host_state(h) == Some(HostState::Quarantined);
    let host = until_host(hosts, name, what, timeout, |h| done(h) || quarantined(h)).await?;
    if !done(&host) {
        let reason = host.status.as_ref().and_then(|s| s.quarantine_reason.clone());
        bail!("Host {name} Quarantined: {reason:?}");
    }
    Ok(host)
}

/// Waits until Host `name` satisfies `done`, whatever its state on the way; the error says
/// what its status was last.
pub async fn until_host(
    hosts: &Api<Host>,
    name: &str,
    what: &str,
    timeout: Duration,
    done: impl Fn(&Host) -> bool,
) -> Result<Host> {
    let last = Mutex::new(None);
    let result = wait::for_async(&format!("Host {name} {what}"), timeout, || async {
        let host = hosts.get(name).await.ok()?;
        *last.lock().expect("not poisoned") = Some(host.clone());
        done(&host).then_some(host)
    })
    .await;
    let last = last.into_inner().expect("not poisoned");
    result.with_context(|| format!("the Host last: {:?}", last.map(|h| h.status)))
}
