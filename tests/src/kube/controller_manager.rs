//! kube-controller-manager, for the tests where a real kubelet joins: only the controllers node
//! bootstrap needs, as in a kubeadm cluster. The CSR approver approves a kubelet's client CSR
//! when its requester may (the `kubeadm:node-autoapprove-*` bindings), the signer signs it with
//! the environment's CA (which the apiserver trusts for client certificates), the CSR cleaner
//! removes old ones, and the token cleaner deletes expired bootstrap tokens, so an expired token
//! is gone as in a real cluster. The service account controller gives each namespace its
//! `default` ServiceAccount, without which admission refuses every pod.

use std::path::Path;

use ::kube::config::{KubeConfigOptions, Kubeconfig};
use ::kube::{Client, Config};
use anyhow::{Context, Result};

use super::{Procs, free_port, peer_command, peers, start_with_retry, until_ready};
use crate::process::Supervised;

/// Node bootstrap's controllers and the service account controller (kube-controller-manager's
/// names).
const CONTROLLERS: &str = "csrapproving,csrsigning,csrcleaner,tokencleaner,serviceaccount";

/// Files the environment wrote at boot that kube-controller-manager reads.
pub(super) struct Files<'a> {
    pub kubeconfig: &'a Path,
    pub admin_kubeconfig: &'a str,
    pub pki_dir: &'a Path,
    pub logs: &'a Path,
}

/// Starts it and waits for its `/healthz` (HTTPS, with the serving certificate from `pki_dir`).
pub(super) async fn start(
    peers: &super::Peers,
    files: &Files<'_>,
    procs: &mut Procs,
) -> Result<()> {
    start_with_retry(procs, "kube-controller-manager", || async move {
        let port = free_port()?;
        let pki_file = |name: &str| files.pki_dir.join(name).display().to_string();
        let mut command = peer_command(peers, peers::KUBE_CONTROLLER_MANAGER);
        command.args([
            format!("--kubeconfig={}", files.kubeconfig.display()),
            "--leader-elect=false".to_owned(),
            format!("--controllers={CONTROLLERS}"),
            format!("--cluster-signing-cert-file={}", pki_file("ca.crt")),
            format!("--cluster-signing-key-file={}", pki_file("ca.key")),
            "--bind-address=127.0.0.1".to_owned(),
            format!("--secure-port={port}"),
            format!("--tls-cert-file={}", pki_file("controller-manager.crt")),
            format!("--tls-private-key-file={}", pki_file("controller-manager.key")),
        ]);
        let mut proc = Supervised::spawn("kube-controller-manager", &mut command, files.logs)?;
        let probe = healthz_client(files.admin_kubeconfig, port).await?;
        let probe = &probe;
        let ready =
            until_ready(&mut proc, "kube-controller-manager to be healthy", || async move {
                let request = http::Request::get("/healthz").body(Vec::new()).expect("a request");
                probe.request_text(request).await.is_ok_and(|body| body == "ok")
            })
            .await;
        Ok((proc, ready))
    })
    .await
}

/// A client for `https://127.0.0.1:<port>` that trusts the environment's CA (the admin
/// kubeconfig's, with its server replaced).
async fn healthz_client(admin_kubeconfig: &str, port: u16) -> Result<Client> {
    let mut kubeconfig = Kubeconfig::from_yaml(admin_kubeconfig)?;
    let cluster = kubeconfig
        .clusters
        .first_mut()
        .and_then(|c| c.cluster.as_mut())
        .context("the admin kubeconfig has no cluster")?;
    cluster.server = Some(format!("https://127.0.0.1:{port}"));
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}
