//! The boot plane's inventory in Kubernetes mode: what a MAC boots follows its Host's state.
//!
//! | Host state | boot |
//! |---|---|
//! | Inspecting, Provisioning, Deprovisioning | the ramdisk with a fresh token for the operation |
//! | the same, paused (`cluster.x-k8s.io/paused`) | the ramdisk with no token: nothing is written |
//! | Registering, Available, Quarantined | the ramdisk with no token: it waits for work |
//! | Provisioned | the local disk |
//! | `spec.online: false`, unknown MAC | nothing |
//!
//! A token is minted only for a request from the address that holds the MAC's lease; its hash
//! is written to the Host before the script leaves, so the ramdisk can use it at once.

use std::sync::Arc;

use siteboot_boot::MacAddr;
use siteboot_boot::inventory::{
    AgentRequest, AgentResponse, BootAction, BootRequest, BoxFuture, Inventory, LinuxBoot,
    LocalBoot,
};
use siteboot_ipxe::Word;

use crate::conditions::paused_itself;
use crate::context::{Ctx, host_key, update_host_status};
use crate::crd::{Host, HostState, now};
use crate::token;

pub struct KubeInventory {
    ctx: Arc<Ctx>,
}

impl KubeInventory {
    pub fn new(ctx: Arc<Ctx>) -> Self {
        Self { ctx }
    }

    async fn action(&self, request: BootRequest) -> Option<BootAction> {
        let host = self.ctx.hosts.get(request.mac)?;
        if !host.spec.online {
            return None;
        }
        let state = host.status.as_ref().and_then(|s| s.state);
        match state {
            Some(HostState::Provisioned) => Some(BootAction::LocalDisk(LocalBoot::Exit)),
            Some(HostState::Inspecting | HostState::Provisioning | HostState::Deprovisioning)
                if paused_itself(&*host) =>
            {
                Some(self.ramdisk(&[]))
            }
            Some(HostState::Inspecting | HostState::Provisioning | HostState::Deprovisioning) => {
                if !request.remote_holds_mac {
                    tracing::warn!(mac = %request.mac, remote = %request.remote, host = %host_key(&host), "boot script asked for by an address that does not hold this MAC; no token issued");
                    let note = format!(
                        "{} asked for this host's boot script but does not hold its MAC; no token issued",
                        request.remote
                    );
                    self.ctx.event(&*host, true, "TokenRefused", note).await;
                    return Some(self.ramdisk(&[]));
                }
                match self.issue_token(&host, request).await {
                    Ok(Some((token, operation))) => Some(self.ramdisk(&[
                        format!("siteboot.token={token}"),
                        format!("siteboot.operation={operation}"),
                    ])),
                    Ok(None) => Some(self.ramdisk(&[])),
                    Err(e) => {
                        tracing::error!(host = %host_key(&host), error = %e, "cannot issue a ramdisk token");
                        None
                    }
                }
            }
            _ => Some(self.ramdisk(&[])),
        }
    }

    /// Mints a token for the Host's current operation and stores its hash. `None` if the Host
    /// has no operation any more, or if the operation's bootstrap data was already delivered:
    /// once per operation means no token can fetch it again.
    async fn issue_token(
        &self,
        host: &Host,
        request: BootRequest,
    ) -> Result<Option<(String, String)>, kube::Error> {
        let (token, hash) = token::mint();
        let api = self.ctx.hosts_api(&host.metadata.namespace.clone().unwrap_or_default());
        let name = host.metadata.name.clone().unwrap_or_default();
        let mut operation_id = None;
        let written = update_host_status(&api, &name, |current| {
            let mut status = current.status.clone().unwrap_or_default();
            let Some(op) = status.operation.as_mut() else { return Ok(None) };
            if op.bootstrap_delivered {
                return Err(op.id.clone());
            }
            op.token_hash = Some(hash.clone());
            op.token_address = Some(request.remote.to_string());
            op.token_issued = Some(now());
            operation_id = Some(op.id.clone());
            Ok(Some(status))
        })
        .await?;
        Ok(match (written, operation_id) {
            (Ok(Some(_)), Some(id)) => {
                tracing::info!(mac = %request.mac, host = %host_key(host), operation = %id, "issued a ramdisk token");
                Some((token, id))
            }
            (Err(delivered), _) => {
                tracing::warn!(mac = %request.mac, remote = %request.remote, host = %host_key(host), operation = %delivered, "boot script asked for after the operation's bootstrap data was delivered; no new token");
                let note = format!(
                    "{} asked for a new token after operation {delivered} delivered its bootstrap data; refused (retry the host to start a new operation)",
                    request.remote
                );
                self.ctx.event(host, true, "TokenRefused", note).await;
                None
            }
            _ => None,
        })
    }

    fn ramdisk(&self, extra: &[String]) -> BootAction {
        let mut linux: LinuxBoot = self.ctx.ramdisk.clone();
        linux.cmdline.extend(extra.iter().map(|a| Word::new(a).expect("token and id are hex")));
        BootAction::Linux(linux)
    }
}

impl Inventory for KubeInventory {
    fn ready(&self) -> Result<(), &'static str> {
        if self.ctx.hosts.is_ready() { Ok(()) } else { Err("the Host cache has not synced yet") }
    }

    fn boots(&self, mac: MacAddr) -> bool {
        self.ctx.hosts.get(mac).is_some_and(|h| h.spec.online)
    }

    fn knows(&self, mac: MacAddr) -> bool {
        self.ctx.hosts.get(mac).is_some()
    }

    fn boot_action(&self, request: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
        Box::pin(self.action(request))
    }

    fn agent(&self, request: AgentRequest) -> BoxFuture<'_, AgentResponse> {
        Box::pin(crate::agent::handle(self.ctx.clone(), request))
    }
}
