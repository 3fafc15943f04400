//! The rest of a control plane, for the tests where real kubelets join: kube-controller-manager
//! with the controllers node bootstrap and workloads need, and kube-scheduler.
//!
//! Node bootstrap, as in a kubeadm cluster: the CSR approver approves a kubelet's client CSR
//! when its requester may (the `kubeadm:node-autoapprove-*` bindings), the signer signs it with
//! the environment's CA (which the apiserver trusts for client certificates), the CSR cleaner
//! removes old ones, and the token cleaner deletes expired bootstrap tokens, so an expired token
//! is gone as in a real cluster; the bootstrap signer signs the `cluster-info` ConfigMap for each
//! token, which `kubeadm join` checks before it trusts the cluster ([`super::kubeadm`]). The service account controller gives each namespace its
//! `default` ServiceAccount, without which admission refuses every pod; the Deployment and
//! ReplicaSet controllers make a Deployment's pods, and kube-scheduler places them, so a drained
//! node's pod comes back on another node. The node lifecycle controller marks a Node whose
//! kubelet went silent Ready Unknown (what a MachineHealthCheck sees of a dead host), and the
//! pod garbage collector removes the pods of a Node that was deleted.

use std::path::Path;

use ::kube::config::{KubeConfigOptions, Kubeconfig};
use ::kube::{Client, Config};
use anyhow::{Context, Result};

use super::{Procs, free_port, peer_command, peers, start_with_retry, until_ready};
use crate::process::Supervised;

/// kube-controller-manager's names of the controllers it runs.
const CONTROLLERS: &str = "csrapproving,csrsigning,csrcleaner,tokencleaner,bootstrapsigner,\
                           serviceaccount,deployment,replicaset,nodelifecycle,podgc";

/// Files the environment wrote at boot that the components read.
pub(super) struct Files<'a> {
    pub kubeconfig: &'a Path,
    pub admin_kubeconfig: &'a str,
    pub pki_dir: &'a Path,
    pub logs: &'a Path,
}

/// The components with a serving certificate under `pki_dir` (`<name>.crt`, `<name>.key`).
pub(super) const SERVING_CERTIFICATES: [&str; 2] =
    [peers::KUBE_CONTROLLER_MANAGER, peers::KUBE_SCHEDULER];

/// Starts kube-controller-manager, then kube-scheduler; each is ready once its `/healthz` says
/// so.
pub(super) async fn start(
    peers: &super::Peers,
    files: &Files<'_>,
    procs: &mut Procs,
) -> Result<()> {
    let signing = [
        format!("--controllers={CONTROLLERS}"),
        format!("--cluster-signing-cert-file={}", files.pki_dir.join("ca.crt").display()),
        format!("--cluster-signing-key-file={}", files.pki_dir.join("ca.key").display()),
    ];
    start_component(peers, peers::KUBE_CONTROLLER_MANAGER, &signing, files, procs).await?;
    start_component(peers, peers::KUBE_SCHEDULER, &[], files, procs).await
}

/// Starts the peer `name` with the flags every component shares (its kubeconfig, no leader
/// election, HTTPS on a free loopback port) and `args`, and waits for its `/healthz`.
async fn start_component(
    peers: &super::Peers,
    name: &'static str,
    args: &[String],
    files: &Files<'_>,
    procs: &mut Procs,
) -> Result<()> {
    start_with_retry(procs, name, || async move {
        let port = free_port()?;
        let pki_file =
            |ext: &str| files.pki_dir.join(format!("{name}.{ext}")).display().to_string();
        let mut command = peer_command(peers, name);
        command.args([
            format!("--kubeconfig={}", files.kubeconfig.display()),
            "--leader-elect=false".to_owned(),
            "--bind-address=127.0.0.1".to_owned(),
            format!("--secure-port={port}"),
            format!("--tls-cert-file={}", pki_file("crt")),
            format!("--tls-private-key-file={}", pki_file("key")),
        ]);
        command.args(args);
        let mut proc = Supervised::spawn(name, &mut command, files.logs)?;
        let probe = healthz_client(files.admin_kubeconfig, port).await?;
        let probe = &probe;
        let what = format!("{name} to be healthy");
        let ready = until_ready(&mut proc, &what, || async move {
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
