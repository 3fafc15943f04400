//! `siteboot serve`: bind every socket first (so a port or interface problem fails start-up
//! with a clear error), then run the DHCP, TFTP and HTTP servers until one fails or a signal
//! arrives.

use std::net::SocketAddrV4;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use siteboot_boot::decision::DhcpMode;
use siteboot_boot::dhcp::journal::Journal;
use siteboot_boot::dhcp::leases::LeaseTable;
use siteboot_boot::dhcp::server::{self, DhcpServer, PXE_PORT, SERVER_PORT};
use siteboot_boot::dhcp::{DhcpService, bind_socket};
use siteboot_boot::http::{HttpServer, Listeners};
use siteboot_boot::metrics::Metrics;
use siteboot_boot::neighbors::{KernelArp, Neighbors};
use siteboot_boot::tftp::TftpServer;
use siteboot_boot::timeline::Timeline;
use siteboot_boot::tls::ServerIdentity;
use siteboot_boot::{BootPlane, Endpoints, Inventory};
use tokio::net::{TcpListener, UdpSocket};
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::Config;

const TFTP_PORT: u16 = 69;

/// Kubernetes mode: where the management cluster is and which site this appliance serves.
pub struct KubeMode {
    pub client: kube::Client,
    pub site: String,
    pub identity: String,
}

pub async fn serve(config: Config, kube: Option<KubeMode>) -> Result<()> {
    let interface = &config.interface;
    if !std::path::Path::new("/sys/class/net").join(interface).exists() {
        bail!("interface {interface:?} does not exist on this machine (see `ip link`)");
    }
    // The config was checked against the hard limit; make it the one in force.
    let fd_limit = crate::fd_limit::raise().context("raising the file-descriptor limit")?;
    let endpoints = Endpoints { address: config.address, http_port: config.http.port };
    let binaries = Arc::new(config.binaries);
    for platform in binaries.platforms() {
        tracing::info!(%platform, file = binaries.file_for(platform), dir = %binaries.dir().display(), "iPXE binary");
    }
    let timeline = Arc::new(Timeline::new());
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
    // Who holds a client address: our leases when we hand them out, else the ARP table.
    let neighbors = Arc::new(match config.dhcp.mode {
        DhcpMode::Full => Neighbors::from_leases(leases.clone(), KernelArp),
        DhcpMode::Proxy | DhcpMode::Off => Neighbors::from_arp(KernelArp),
    });
    // Leadership (Kubernetes mode): full-mode DHCP answers only on the leader.
    let (leading_tx, leading_rx) = tokio::sync::watch::channel(kube.is_none());
    let mut tasks = JoinSet::new();
    let (inventory, known_hosts): (Arc<dyn Inventory>, String) = match kube {
        None => {
            let known = config.inventory.known_hosts().to_string();
            (Arc::new(config.inventory), known)
        }
        Some(kube) => {
            let k = config.kubernetes.as_ref().context("Kubernetes mode needs a kubernetes: section in the config (kubernetes.ramdisk_profile)")?;
            siteboot_controller::run::check_crds(&kube.client).await?;
            let mut ctx = siteboot_controller::context::Ctx::new(
                kube.client,
                kube.site.clone(),
                kube.identity,
                siteboot_controller::cache::HostIndex::new(),
                k.ramdisk.clone(),
            );
            ctx.token_max_age = k.token_max_age;
            ctx.machine_policy.host_namespaces = k.host_namespaces.clone();
            let ctx = Arc::new(ctx);
            let options = siteboot_controller::run::Options {
                lease_namespace: k.lease_namespace.clone(),
                leader_election: k.leader_election,
                addresses: vec![config.address.to_string()],
            };
            let inventory =
                Arc::new(siteboot_controller::inventory::KubeInventory::new(ctx.clone()));
            let timeline = timeline.clone();
            tasks.spawn(async move {
                siteboot_controller::run::run(ctx, timeline, options, leading_tx).await;
                Ok(())
            });
            (inventory, format!("Hosts of site {}", kube.site))
        }
    };

    let identity =
        ServerIdentity::load(config.http.tls.as_ref(), &config.state_dir, config.address)
            .context("the agent API's TLS certificate (http.tls)")?;
    tracing::info!(certificate = %identity.source.display(), fingerprint = %identity.fingerprint, "agent API certificate");
    let http_addr = SocketAddrV4::new(config.address, config.http.port);
    let https_addr = SocketAddrV4::new(config.address, config.http.https_port);
    let address = config.address;
    let bind = |addr: SocketAddrV4| async move {
        TcpListener::bind(addr).await.with_context(|| {
            format!("binding HTTP to {addr} (is {address} an address of this machine?)")
        })
    };
    let listeners = Listeners { http: bind(http_addr).await?, https: bind(https_addr).await? };
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
    let http =
        HttpServer::new(plane, &config.http, &identity).context("starting the HTTP server")?;
    let shutdown = CancellationToken::new();
    let mut http_task = tokio::spawn(http.run(listeners, shutdown.clone()));
    let tftp = TftpServer::new(
        config.address,
        &config.tftp,
        binaries.clone(),
        timeline.clone(),
        metrics.clone(),
        neighbors.clone(),
    )
    .context("starting the TFTP server")?;
    tasks.spawn(async move {
        tftp.run(tftp_socket).await;
        bail!("the TFTP server stopped")
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
            service = service.gated_by(leading_rx.clone());
        }
        tasks.spawn(
            async move { service.run(dhcp_socket, pxe_socket).await.context("DHCP server") },
        );
    }

    tracing::info!(
        interface = %interface,
        address = %config.address,
        dhcp = ?config.dhcp.mode,
        http = %http_addr,
        https = %https_addr,
        hosts = %known_hosts,
        fd_limit,
        "siteboot serving"
    );
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM: stopping"),
        _ = interrupt.recv() => tracing::info!("SIGINT: stopping"),
        _ = &mut http_task => bail!("the HTTP server stopped"),
        Some(ended) = tasks.join_next() => {
            return match ended {
                Ok(Ok(())) => bail!("a server stopped unexpectedly"),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(e).context("a server task panicked"),
            };
        }
    }
    // Both HTTP ports stop accepting; requests in flight get http.drain_timeout to finish.
    shutdown.cancel();
    let _ = http_task.await;
    Ok(())
}
