//! Kubernetes mode (the `kubernetes` feature, on by default): the Cluster API provider for a
//! site, its Host inventory behind the boot plane, and `siteboot manifests`. Everything here
//! links the Kubernetes client; a build without the feature is the standalone appliance
//! (`no_kubernetes.rs` stands in for this module).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use siteboot_agent_server::images::ImageService;
use siteboot_boot::inventory::LinuxBoot;
use siteboot_boot::leadership::Leadership;
use siteboot_boot::timeline::Timeline;
use siteboot_controller::context::Ctx;
use siteboot_controller::dhcp_checkpoint::ConfigMapCheckpoint;
use siteboot_controller::inventory::KubeInventory;
use siteboot_controller::manifests::SecretAccess;
use siteboot_controller::run;
use siteboot_ssh::reimage::{KexecRamdisk, RamdiskFilesError};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::config::{self, Config, KubernetesConfig};
use crate::serve::{Hosts, STEP_DEADLINE, Served};

/// `siteboot serve`'s options for Kubernetes mode.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Kubeconfig of the management cluster. Default in Kubernetes mode: $KUBECONFIG, then
    /// ~/.kube/config, then the in-cluster service account.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// The site this appliance serves (overrides kubernetes.site).
    #[arg(long)]
    site: Option<String>,
    /// This replica's name in the leader Lease and Events. Default: <hostname>-<pid>.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Kubernetes mode: what this process runs. `all`: everything in one process.
    /// `boot-plane` and `controller` split it in two processes with two ServiceAccounts, so
    /// that the process on the untrusted segment cannot read Secrets in tenants'
    /// namespaces (deploy/kubernetes/appliance.yaml runs them so).
    #[arg(long, value_enum, default_value_t = Role::All)]
    role: Role,
}

/// What a process of the appliance runs in Kubernetes mode. Split, the boot plane (which faces
/// the untrusted segment) runs with no right to read Secrets in tenants' namespaces, and the
/// controller, which has them, answers nothing on the segment (docs/security.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// The boot plane and the controller in one process.
    All,
    /// DHCP, TFTP, HTTP and the agent API: the Host cache, no reconcilers.
    BootPlane,
    /// The reconcilers (Hosts, BMCs, the Cluster API providers): no sockets.
    Controller,
}

impl std::fmt::Display for Role {
    /// As `--role` spells it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = clap::ValueEnum::to_possible_value(self).expect("no role is hidden");
        f.write_str(value.get_name())
    }
}

/// Kubernetes mode: where the management cluster is, which site this appliance serves, and
/// what this process runs of it.
pub struct KubeMode {
    client: kube::Client,
    site: String,
    identity: String,
    role: Role,
}

impl ServeArgs {
    /// `siteboot serve`: the boot plane alone (standalone), or Kubernetes mode if the config
    /// has a `kubernetes:` section or `--site` is given, in the processes `--role` asks for.
    pub async fn serve(self, config: Config) -> Result<()> {
        let role = self.role;
        match (role, self.kube_mode(&config).await?) {
            (Role::All | Role::BootPlane, kube) => crate::serve::serve(config, kube).await,
            (_, None) => anyhow::bail!(
                "--role {role} splits Kubernetes mode: give the config a kubernetes: section or --site"
            ),
            (Role::Controller, Some(kube)) => serve_controller(config, kube).await,
        }
    }

    async fn kube_mode(self, config: &Config) -> Result<Option<KubeMode>> {
        let configured = config.kubernetes.as_ref().and_then(|k| k.site.clone());
        if config.kubernetes.is_none() && self.site.is_none() {
            return Ok(None);
        }
        let site = self
            .site
            .or(configured)
            .context("Kubernetes mode needs a site: --site NAME or kubernetes.site")?;
        config::check_site_name(&site, "--site").map_err(|e| anyhow::anyhow!("{e}"))?;
        let client_config = match &self.kubeconfig {
            Some(path) => {
                let file = kube::config::Kubeconfig::read_from(path)
                    .with_context(|| format!("reading kubeconfig {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(file, &Default::default()).await?
            }
            None => kube::Config::infer()
                .await
                .context("no kubeconfig: pass --kubeconfig or run in a cluster")?,
        };
        let client = kube::Client::try_from(client_config)?;
        let identity = self.identity.unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}-{}", host.trim(), std::process::id())
        });
        Ok(Some(KubeMode { client, site, identity, role: self.role }))
    }
}

/// The context the Kubernetes side runs with, from the config. Fails unless the config has a
/// `kubernetes:` section and the CRDs are installed.
async fn context(kubernetes: Option<&KubernetesConfig>, kube: KubeMode) -> Result<Ctx> {
    let KubeMode { client, site, identity, role } = kube;
    let k = kubernetes.context(
        "Kubernetes mode needs a kubernetes: section in the config (kubernetes.ramdisk_profile)",
    )?;
    run::check_crds(&client, role != Role::BootPlane).await?;
    let mut ctx = Ctx::new(
        client,
        site,
        identity,
        siteboot_controller::cache::HostIndex::new(k.host_pools.clone()),
        k.ramdisk.clone(),
    );
    ctx.namespace = k.lease_namespace.clone();
    ctx.token_max_age = k.token_max_age;
    ctx.ramdisk_silence_timeout = k.ramdisk_silence_timeout;
    ctx.min_wipe = k.min_wipe;
    Ok(ctx)
}

/// The ramdisk a Reimage host is kexec'ed into over SSH ([`Served::kexec_ramdisk`]). One that
/// cannot be is said now, and on each Host that needs it.
fn kexec_ramdisk(
    config: &Config,
    ramdisk: &LinuxBoot,
    served: &Served,
) -> Result<KexecRamdisk, RamdiskFilesError> {
    let kexec = served.kexec_ramdisk(config.http.root.as_deref(), ramdisk);
    if let Err(e) = &kexec {
        tracing::info!("no kexec over SSH for Reimage hosts without a BMC: {e}");
    }
    kexec
}

/// Where BMCs fetch virtual media: the agent API's listener.
fn media_base(config: &Config) -> String {
    format!("https://{}:{}", config.address, config.http.https_port)
}

/// What the boot plane serves in Kubernetes mode: the Hosts of the site, from the Host cache,
/// with the controller running beside it (its reconcilers only with [`Role::All`]).
pub async fn hosts(
    config: &Config,
    kube: KubeMode,
    served: Served<'_>,
    images: ImageService,
    leadership: tokio::sync::watch::Sender<Leadership>,
    timeline: Arc<Timeline>,
    release: CancellationToken,
) -> Result<Hosts> {
    let (site, role) = (kube.site.clone(), kube.role);
    let mut ctx = context(config.kubernetes.as_ref(), kube).await?;
    let k = config.kubernetes.as_ref().expect("checked by context");
    ctx.kexec_ramdisk = kexec_ramdisk(config, &k.ramdisk, &served);
    // BMCs fetch a host's virtual media from the agent API's listener.
    if let Some(certificate_pem) = served.media_certificate {
        ctx.media_base = Some(media_base(config));
        ctx.media_certificate = Some(certificate_pem);
    }
    ctx.images = Some(Arc::new(images));
    let ctx = Arc::new(ctx);
    let options = run::Options {
        lease_namespace: k.lease_namespace.clone(),
        lease_name: run::lease_name(&site),
        leader_election: k.leader_election,
        reconcilers: role == Role::All,
        heartbeat: true,
        addresses: vec![config.address.to_string()],
    };
    let checkpoint = ConfigMapCheckpoint::new(ctx.client.clone(), &k.lease_namespace, &site);
    Ok(Hosts {
        inventory: Arc::new(KubeInventory::new(ctx.clone())),
        known: format!("Hosts of site {site}"),
        checkpoint: Some(Arc::new(checkpoint)),
        controller: Some(tokio::spawn(run::run(ctx, timeline, options, leadership, release))),
        site,
    })
}

/// `siteboot serve --role controller`: the reconcilers of the site, with no socket on the
/// segment, until SIGTERM or SIGINT. Virtual media needs the boot plane's certificate
/// (`http.tls`), which the controller tells BMCs to trust.
async fn serve_controller(config: Config, kube: KubeMode) -> Result<()> {
    let site = kube.site.clone();
    let mut ctx = context(config.kubernetes.as_ref(), kube).await?;
    let k = config.kubernetes.as_ref().expect("checked by context");
    if config.ramdisk_media.is_some() {
        let tls = config.http.tls.as_ref().context("kubernetes.ramdisk_media with --role controller needs http.tls: the boot plane's certificate, which BMCs are told to trust")?;
        let pem = std::fs::read_to_string(&tls.certificate)
            .with_context(|| format!("reading {}", tls.certificate.display()))?;
        ctx.media_base = Some(media_base(&config));
        ctx.media_certificate = Some(pem);
    }
    let options = run::Options {
        lease_namespace: k.lease_namespace.clone(),
        lease_name: run::controller_lease_name(&site),
        leader_election: k.leader_election,
        reconcilers: true,
        heartbeat: false,
        addresses: Vec::new(),
    };
    let (leadership, _) = tokio::sync::watch::channel(Leadership::Follower);
    let release = CancellationToken::new();
    let run =
        run::run(Arc::new(ctx), Arc::new(Timeline::new()), options, leadership, release.clone());
    let controller = tokio::spawn(run);
    tracing::info!(%site, "siteboot controller running (no boot plane in this process)");
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM: stopping"),
        _ = interrupt.recv() => tracing::info!("SIGINT: stopping"),
    }
    release.cancel();
    if tokio::time::timeout(STEP_DEADLINE, controller).await.is_err() {
        tracing::warn!("the controller did not stop in time");
    }
    tracing::info!("stopped");
    Ok(())
}

/// `siteboot manifests`' options.
#[derive(Debug, clap::Args)]
pub struct ManifestsArgs {
    /// Write the files here instead of printing them.
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// The container image the appliance's Deployments run (the default is what
    /// scripts/build-image builds and tags for this version).
    #[arg(long, default_value_t = siteboot_controller::manifests::default_image())]
    image: String,
    /// The namespace the appliance's ServiceAccount and leader Lease live in.
    #[arg(long, default_value = "siteboot-system")]
    namespace: String,
    /// A namespace whose Machines this appliance serves: it may read bootstrap data Secrets
    /// there, and nowhere else. Repeat for more. Default: `default`.
    #[arg(long = "machine-namespace", value_name = "NAMESPACE")]
    machine_namespaces: Vec<String>,
    /// Grant reading Secrets in every namespace instead (opt-in: whoever controls the
    /// appliance could then read any Secret by name).
    #[arg(long, conflicts_with = "machine_namespaces")]
    all_namespaces: bool,
}

/// `siteboot manifests`: prints the CRDs and RBAC, or writes everything under deploy/.
pub fn manifests(args: ManifestsArgs) -> Result<()> {
    use siteboot_controller::manifests::{
        crds_yaml, default_secret_access, deploy_files, rbac, to_yaml,
    };
    let secrets = if args.all_namespaces {
        SecretAccess::Cluster
    } else if args.machine_namespaces.is_empty() {
        default_secret_access()
    } else {
        SecretAccess::Namespaces(args.machine_namespaces)
    };
    let namespace = &args.namespace;
    match args.output_dir {
        None => print!("{}---\n{}", crds_yaml(), to_yaml(&rbac(namespace, &secrets))),
        Some(dir) => {
            for (file, text) in deploy_files(namespace, &secrets, &args.image) {
                let path = dir.join(file);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent)
                        .with_context(|| format!("creating {}", parent.display()))?;
                }
                std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
    }
    Ok(())
}
