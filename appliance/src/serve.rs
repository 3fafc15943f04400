//! `siteboot serve`: bind every socket first (so a port or interface problem fails start-up
//! with a clear error), then run the DHCP, TFTP and HTTP servers until one fails or a signal
//! arrives.
//!
//! SIGTERM (or SIGINT) stops in an order that hands the site over cleanly: DHCP first (it
//! finishes the batch in hand, so no lease is half-written), then the leader Lease is given
//! back (a standby, watching it, takes over at once), then the TFTP and HTTP transfers under
//! way get `drain_timeout` to finish.

use std::net::SocketAddrV4;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use siteboot_boot::arp_probe::PacketProbe;
use siteboot_boot::decision::DhcpMode;
use siteboot_boot::decision::media_cmdline;
use siteboot_boot::dhcp::checkpoint::LeaseCheckpoint;
use siteboot_boot::dhcp::journal::Journal;
use siteboot_boot::dhcp::leases::LeaseTable;
use siteboot_boot::dhcp::server::{self, DhcpServer, PXE_PORT, SERVER_PORT};
use siteboot_boot::dhcp::{DhcpService, bind_socket};
use siteboot_boot::http::{HttpServer, Listeners, StatusPage};
use siteboot_boot::inventory::LinuxBoot;
use siteboot_boot::leadership::Leadership;
use siteboot_boot::metrics::Metrics;
use siteboot_boot::neighbors::{KernelArp, Neighbors};
use siteboot_boot::tftp::TftpServer;
use siteboot_boot::timeline::Timeline;
use siteboot_boot::tls::ServerIdentity;
use siteboot_boot::{AgentEndpoint, BootPlane, Endpoints, Inventory};
use siteboot_ssh::reimage::{KexecRamdisk, RamdiskFilesError};
use tokio::net::UdpSocket;
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use siteboot_agent_server::images::ImageService;

use crate::config::Config;
use crate::kubernetes::KubeMode;
use crate::standalone::StaticInventory;

const TFTP_PORT: u16 = 69;

/// What the boot plane beside the controller serves its hosts. (The standalone build, with no
/// controller, makes one and reads none of it.)
#[cfg_attr(not(feature = "kubernetes"), allow(dead_code))]
pub struct Served<'a> {
    /// The agent API's certificate, when there is boot media for BMCs to fetch with it.
    pub media_certificate: Option<String>,
    /// Where files and the agent API are served: what a ramdisk kexec'ed over SSH is told.
    pub endpoints: &'a Endpoints,
    pub agent: &'a AgentEndpoint,
}

impl Served<'_> {
    /// `ramdisk` as a kexec over SSH sends it: its files under `http_root`, with the command
    /// line a boot from media gets (its own words and the appliance's).
    pub fn kexec_ramdisk(
        &self,
        http_root: Option<&std::path::Path>,
        ramdisk: &LinuxBoot,
    ) -> Result<KexecRamdisk, RamdiskFilesError> {
        let cmdline = media_cmdline(&ramdisk.cmdline, self.endpoints, self.agent);
        KexecRamdisk::new(ramdisk, http_root, &cmdline)
    }
}

/// The hosts the boot plane serves, and what runs beside it for them.
pub struct Hosts {
    pub inventory: Arc<dyn Inventory>,
    /// What the log calls them.
    pub known: String,
    /// What the status page calls this appliance's site.
    pub site: String,
    /// Kubernetes mode: where the DHCP leader shares its leases with the site's replicas.
    pub checkpoint: Option<Arc<dyn LeaseCheckpoint>>,
    /// Kubernetes mode: the controller, stopped after DHCP (see [`stop_in_order`]).
    pub controller: Option<tokio::task::JoinHandle<()>>,
}

/// Serves the boot plane: the hosts of the config (standalone), or of the site's Host objects
/// with, unless this process is `--role boot-plane`, the controller (Kubernetes mode).
pub async fn serve(config: Config, kube: Option<KubeMode>) -> Result<()> {
    let interface = &config.interface;
    if !std::path::Path::new("/sys/class/net").join(interface).exists() {
        bail!("interface {interface:?} does not exist on this machine (see `ip link`)");
    }
    // The config was checked against the hard limit; make it the one in force.
    let fd_limit = crate::fd_limit::raise().context("raising the file-descriptor limit")?;
    let endpoints = Endpoints { address: config.address, http_port: config.http.port };
    // Images the ramdisk writes: fetched once into <state_dir>/images, served by digest.
    let images = crate::image::open(&config)?;
    let images_dir = images.images_dir();
    // The boot ISO for virtual media, read once now: a bad file stops start-up.
    let media = config.open_ramdisk_media().map_err(|e| anyhow::anyhow!("{e}"))?;
    if let Some(media) = &media {
        tracing::info!(path = %media.path().display(), bytes = media.file_len(), region = media.region_offset(), "boot media");
    }
    let identity =
        ServerIdentity::load(config.http.tls.as_ref(), &config.state_dir, config.address)
            .context("the agent API's TLS certificate (http.tls)")?;
    tracing::info!(certificate = %identity.source.display(), fingerprint = %identity.fingerprint, "agent API certificate");
    let timeline = Arc::new(Timeline::new());
    // Leadership (Kubernetes mode): full-mode DHCP answers only on the leader, and shares its
    // leases with the site's other replicas through a checkpoint.
    let initial = if kube.is_some() { Leadership::Follower } else { Leadership::Always };
    let (leadership_tx, leadership) = tokio::sync::watch::channel(initial);
    // Stops the servers; `release` then ends this replica's term and gives the Lease back.
    let shutdown = CancellationToken::new();
    let release = CancellationToken::new();
    let image_service = ImageService::new(images.clone(), endpoints.clone());
    let agent = AgentEndpoint {
        address: config.address,
        port: config.http.https_port,
        fingerprint: identity.fingerprint,
    };
    let served = Served {
        media_certificate: media.is_some().then(|| identity.certificate_pem.clone()),
        endpoints: &endpoints,
        agent: &agent,
    };
    let Hosts { inventory, known, site, checkpoint, controller } = match kube {
        None => {
            let site = format!("standalone ({interface}, {})", config.address);
            // Hosts reimaged over SSH are kexec'ed into the ramdisk: its files must be here.
            let kexec = match &config.ramdisk {
                Some(ramdisk) if config.inventory.has_hosts_reimaged_over_ssh() => {
                    Some(served.kexec_ramdisk(config.http.root.as_deref(), ramdisk).context(
                        "hosts with ssh and an image are kexec'ed into the ramdisk_profile",
                    )?)
                }
                _ => None,
            };
            standalone_hosts(
                config.inventory,
                site,
                (config.ramdisk.clone(), kexec, config.ramdisk_silence_timeout),
                &config.state_dir,
                image_service,
                &shutdown,
            )?
        }
        Some(kube) => {
            let (timeline, release) = (timeline.clone(), release.clone());
            crate::kubernetes::hosts(
                &config,
                kube,
                served,
                image_service,
                leadership_tx,
                timeline,
                release,
            )
            .await?
        }
    };
    let binaries = Arc::new(config.binaries);
    for platform in binaries.platforms() {
        tracing::info!(%platform, file = binaries.file_for(platform), dir = %binaries.dir().display(), "iPXE binary");
    }
    let metrics = Arc::new(Metrics::new());
    let leases = Arc::new(Mutex::new(LeaseTable::new(Arc::new(config.plan))));
    let journal = if config.dhcp.mode == DhcpMode::Full {
        let path = config.state_dir.join("leases.log");
        let (journal, replay) = Journal::open(&path)?;
        let mut table = leases.lock().expect("lease table lock");
        for record in &replay.records {
            table.apply(record);
        }
        tracing::info!(path = %path.display(), records = replay.records.len(), torn_bytes = replay.torn_bytes, corrupt_lines = replay.corrupt_lines, "lease file replayed");
        Some(journal)
    } else {
        None
    };
    let mut servers = JoinSet::new();
    // Who holds a client address: our leases when we hand them out (a relayed one only as the
    // inventory's relay agent pins allow), else the ARP table.
    let arp = KernelArp::new(interface).context("opening a socket for ARP look-ups")?;
    let neighbors = match config.dhcp.mode {
        DhcpMode::Full => Neighbors::from_leases(leases.clone(), inventory.clone(), arp),
        DhcpMode::Proxy | DhcpMode::Off => Neighbors::from_arp(arp),
    };
    // Confirms an on-link holder where a token is minted or secrets leave. Without it siteboot
    // still boots hosts, but mints no token for them: it fails closed, and says why.
    let neighbors = Arc::new(match PacketProbe::new(interface, config.address) {
        Ok(probe) => neighbors.probing(probe),
        Err(error) => {
            tracing::error!(%interface, %error, "cannot open a packet socket for ARP probes (it needs CAP_NET_RAW): no on-link host gets a ramdisk token or bootstrap data");
            neighbors
        }
    });

    let http_addr = SocketAddrV4::new(config.address, config.http.port);
    let https_addr = SocketAddrV4::new(config.address, config.http.https_port);
    let address = config.address;
    let bind = |addr: SocketAddrV4| {
        siteboot_boot::http::listen(addr.into()).with_context(|| {
            format!("binding HTTP to {addr} (is {address} an address of this machine?)")
        })
    };
    let listeners = Listeners { http: bind(http_addr)?, https: bind(https_addr)? };
    let tftp_addr = SocketAddrV4::new(config.address, TFTP_PORT);
    let tftp_socket =
        UdpSocket::bind(tftp_addr).await.with_context(|| format!("binding TFTP to {tftp_addr}"))?;

    let plane = BootPlane {
        endpoints: endpoints.clone(),
        inventory: inventory.clone(),
        binaries: binaries.clone(),
        timeline: timeline.clone(),
        metrics: metrics.clone(),
        neighbors: neighbors.clone(),
    };
    let mut http = HttpServer::new(plane, &config.http, &identity)
        .and_then(|http| http.with_images(&images_dir))
        .context("starting the HTTP server")?;
    if config.http.status_page {
        http = http.with_status_page(StatusPage::new(site, leadership.clone()));
    }
    if let Some(media) = media {
        http = http.with_boot_media(media);
    }
    let (stop, drain) = (shutdown.clone(), config.drain_timeout);
    servers.spawn(async move {
        http.run(listeners, stop, drain).await;
        (Server::Http, Ok(()))
    });
    let tftp = TftpServer::new(
        config.address,
        &config.tftp,
        binaries.clone(),
        timeline.clone(),
        metrics.clone(),
        neighbors.clone(),
        inventory.clone(),
    )
    .context("starting the TFTP server")?;
    let (stop, drain) = (shutdown.clone(), config.drain_timeout);
    servers.spawn(async move {
        tftp.run(tftp_socket, stop, drain).await;
        (Server::Tftp, Ok(()))
    });

    if config.dhcp.mode != DhcpMode::Off {
        let dhcp_socket = bind_socket(interface, SERVER_PORT)?;
        let pxe_socket = bind_socket(interface, PXE_PORT)?;
        let ctx = server::Context {
            mode: config.dhcp.mode,
            endpoints: endpoints.clone(),
            binaries: binaries.clone(),
            inventory: inventory.clone(),
            timeline: timeline.clone(),
            metrics: metrics.clone(),
            known_hosts_only: config.known_hosts_only,
        };
        let mut service = DhcpService::new(DhcpServer::new(ctx, leases), journal);
        if config.dhcp.mode == DhcpMode::Full {
            service = service.led_by(leadership.clone(), checkpoint);
        }
        let stop = shutdown.clone();
        servers.spawn(async move {
            (Server::Dhcp, service.run(dhcp_socket, pxe_socket, stop).await.context("DHCP server"))
        });
    }

    tracing::info!(
        interface = %interface,
        address = %config.address,
        dhcp = ?config.dhcp.mode,
        http = %http_addr,
        https = %https_addr,
        hosts = %known,
        fd_limit,
        "siteboot serving"
    );
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM: stopping"),
        _ = interrupt.recv() => tracing::info!("SIGINT: stopping"),
        Some(ended) = servers.join_next() => {
            return match ended {
                Ok((server, Ok(()))) => bail!("the {server} server stopped unexpectedly"),
                Ok((_, Err(e))) => Err(e),
                Err(e) => Err(e).context("a server task panicked"),
            };
        }
    }
    stop_in_order(servers, controller, shutdown, release, config.drain_timeout).await;
    Ok(())
}

/// What the boot plane serves standalone: the hosts of the config, with their operations
/// (`operations`: the ramdisk, from `ramdisk_profile`, and its silence timeout; on when there
/// is a ramdisk or a host reached over SSH) and the control socket `siteboot host` talks to,
/// both under `state_dir`.
fn standalone_hosts(
    mut inventory: StaticInventory,
    site: String,
    (ramdisk, kexec, max_silence): (Option<LinuxBoot>, Option<KexecRamdisk>, Duration),
    state_dir: &std::path::Path,
    images: ImageService,
    shutdown: &CancellationToken,
) -> Result<Hosts> {
    let known = inventory.known_hosts().to_string();
    if ramdisk.is_some() || inventory.has_ssh_hosts() {
        let store = crate::operations::Store::open(state_dir)
            .context("opening the host records (<state_dir>/hosts)")?;
        let token_max_age = siteboot_agent_server::silence::TOKEN_MAX_AGE;
        inventory.enable_operations(
            store,
            (ramdisk, kexec),
            Arc::new(images),
            token_max_age,
            max_silence,
        )?;
    }
    let inventory = Arc::new(inventory);
    let listener = crate::control::bind(state_dir)?;
    tokio::spawn(crate::control::serve(listener, inventory.clone(), shutdown.clone()));
    tokio::spawn(inventory.clone().watch_silence(shutdown.clone()));
    tokio::spawn(inventory.clone().drive_ssh(shutdown.clone()));
    Ok(Hosts { inventory, known, site, checkpoint: None, controller: None })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    Dhcp,
    Tftp,
    Http,
}

impl std::fmt::Display for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Server::Dhcp => "DHCP",
            Server::Tftp => "TFTP",
            Server::Http => "HTTP",
        })
    }
}

/// Time for DHCP to finish its batch, and for the Lease to be given back.
pub const STEP_DEADLINE: Duration = Duration::from_secs(5);

/// Stops in order (see the module doc). Each step has a deadline; what is left after the last
/// one is dropped with the process.
async fn stop_in_order(
    mut servers: JoinSet<(Server, Result<()>)>,
    controller: Option<tokio::task::JoinHandle<()>>,
    shutdown: CancellationToken,
    release: CancellationToken,
    drain: Duration,
) {
    shutdown.cancel();
    let dhcp_stopped = async {
        while let Some(ended) = servers.join_next().await {
            match ended {
                Ok((Server::Dhcp, result)) => {
                    if let Err(e) = result {
                        tracing::warn!("{e:#}");
                    }
                    return;
                }
                Ok((server, _)) => tracing::info!(%server, "stopped"),
                Err(e) => tracing::warn!(error = %e, "a server task failed while stopping"),
            }
        }
    };
    if tokio::time::timeout(STEP_DEADLINE, dhcp_stopped).await.is_err() {
        tracing::warn!("DHCP did not stop in time");
    }
    release.cancel();
    if let Some(controller) = controller
        && tokio::time::timeout(STEP_DEADLINE, controller).await.is_err()
    {
        tracing::warn!("the controller did not stop in time");
    }
    let drained = async { while servers.join_next().await.is_some() {} };
    if tokio::time::timeout(drain, drained).await.is_err() {
        tracing::warn!(deadline = ?drain, "transfers still running at the drain deadline are cut off");
    }
    tracing::info!("stopped");
}
