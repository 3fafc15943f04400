//! The boot plane's inventory in Kubernetes mode: what a MAC boots follows its Host's state.
//!
//! | Host state | boot |
//! |---|---|
//! | Inspecting, Provisioning, Deprovisioning | the ramdisk with a fresh token for the operation |
//! | the same, booting from virtual media | the local disk: its token comes only in the media |
//! | the same, paused (`cluster.x-k8s.io/paused`) | the ramdisk with no token: nothing is written |
//! | Registering, Available, Quarantined | the ramdisk with no token: it waits for work |
//! | Provisioned | the local disk |
//! | none yet, recreated by a move or restore | as its lifecycle record restores it ([`record::state`]) |
//! | `spec.online: false`, unknown MAC | nothing |
//!
//! A token is minted only for a request from the address that holds the MAC's lease, once the
//! segment confirms it (the appliance's own ARP probe, for an on-link address); its hash is
//! written to the Host before the script leaves, so the ramdisk can use it at once.
//!
//! A host with `spec.bootMethod: VirtualMedia` gets its token another way: the Host reconciler
//! mints a media key, stores the hash of the token it stands for and inserts
//! `/media/<key>.iso` through the BMC; [`Inventory::media`] answers the BMC's fetch with the
//! ramdisk's command line, that token included.
//!
//! The status page lists the Host cache: name, state, address, whether it is claimed and the
//! ramdisk's progress; nothing from a Secret or the BMC, nothing naming its tenant.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use siteboot_boot::MacAddr;
use siteboot_boot::dhcp::relay_agent::RelayPin;
use siteboot_boot::inventory::{
    AgentRequest, AgentResponse, BootAction, BootRequest, BoxFuture, ByteProgress, Claim,
    HostSummary, Inventory, LocalBoot, MediaRequest, OperationSummary,
};
use siteboot_ipxe::Word;

use crate::conditions::paused_itself;
use crate::context::{Ctx, key, update_host_status};
use crate::crd::{Host, HostState, now};
use crate::host::lifecycle::older_than;
use crate::host::record;
use siteboot_agent_server::token::{self, ramdisk_boot};

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
        match record::state(&host) {
            Some(HostState::Provisioned) => Some(BootAction::LocalDisk(LocalBoot::Exit)),
            Some(HostState::Inspecting | HostState::Provisioning | HostState::Deprovisioning)
                if paused_itself(&*host) =>
            {
                Some(ramdisk_boot(&self.ctx.ramdisk, None))
            }
            Some(HostState::Inspecting | HostState::Provisioning | HostState::Deprovisioning)
                if boots_from_media(&host) =>
            {
                tracing::info!(mac = %request.mac, host = %key(&*host), remote = %request.remote, "the host boots its operation from virtual media: no token over the network");
                Some(BootAction::LocalDisk(LocalBoot::Exit))
            }
            Some(HostState::Inspecting | HostState::Provisioning | HostState::Deprovisioning) => {
                if !request.remote_holds_mac {
                    let note = format!(
                        "{} asked for this host's boot script but does not hold its MAC; no token issued",
                        request.remote
                    );
                    self.ctx.segment_warning(&host, "TokenRefused", note).await;
                    return Some(ramdisk_boot(&self.ctx.ramdisk, None));
                }
                if let Err(why) = request.segment.confirm(request.remote, request.mac).await {
                    let note = format!(
                        "{} holds this host's MAC by the lease and ARP tables, but {why}; no token issued",
                        request.remote
                    );
                    self.ctx.segment_warning(&host, "TokenRefused", note).await;
                    return Some(ramdisk_boot(&self.ctx.ramdisk, None));
                }
                match self.issue_token(&host, request).await {
                    Ok(Some((token, operation))) => {
                        Some(ramdisk_boot(&self.ctx.ramdisk, Some((&token, &operation))))
                    }
                    Ok(None) => Some(ramdisk_boot(&self.ctx.ramdisk, None)),
                    Err(e) => {
                        tracing::error!(host = %key(&*host), error = %e, "cannot issue a ramdisk token");
                        None
                    }
                }
            }
            _ => Some(ramdisk_boot(&self.ctx.ramdisk, None)),
        }
    }

    /// The ramdisk's command line for the virtual media whose key is `request.key`: the token
    /// it stands for and the operation's id, if a Host's operation booting from virtual media
    /// holds that token, fresh and with its bootstrap data not yet delivered. The Host
    /// reconciler inserts the media right after it stores the token's hash, so a BMC may ask
    /// before the cache shows it: a miss is looked up again for a moment.
    async fn media_cmdline(&self, request: MediaRequest) -> Option<Vec<Word>> {
        let token = token::media_token(&request.key);
        let hash = token::hash(&token);
        let deadline = tokio::time::Instant::now() + MEDIA_CACHE_WAIT;
        let host = loop {
            if let Some(host) = self.ctx.hosts.with_out_of_band_token(&hash) {
                break host;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::info!(remote = %request.remote, "virtual media asked for with a key no operation holds");
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let op = host.status.as_ref()?.operation.as_ref()?;
        let fresh = op
            .token_issued
            .as_ref()
            .is_some_and(|t| !older_than(t, self.ctx.token_max_age.as_secs() as i64, &now()));
        let refused = if !op.virtual_media {
            Some("the operation does not boot from virtual media")
        } else if paused_itself(&*host) {
            Some("the Host is paused")
        } else if op.bootstrap_delivered {
            Some("the operation's bootstrap data was delivered")
        } else if !fresh {
            Some("the media's token expired")
        } else if !op.token_hash.as_deref().is_some_and(|h| token::matches(&token, h)) {
            Some("the media's token is not the operation's")
        } else {
            None
        };
        if let Some(why) = refused {
            tracing::info!(host = %key(&*host), remote = %request.remote, "virtual media refused: {why}");
            return None;
        }
        tracing::info!(host = %key(&*host), operation = %op.id, remote = %request.remote, "virtual media served");
        match ramdisk_boot(&self.ctx.ramdisk, Some((&token, &op.id))) {
            BootAction::Linux(linux) => Some(linux.cmdline),
            _ => None,
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
            op.token_via_ssh = false;
            op.token_issued = Some(now());
            operation_id = Some(op.id.clone());
            Ok(Some(status))
        })
        .await?;
        Ok(match (written, operation_id) {
            (Ok(Some(_)), Some(id)) => {
                tracing::info!(mac = %request.mac, host = %key(host), operation = %id, "issued a ramdisk token");
                Some((token, id))
            }
            (Err(delivered), _) => {
                let note = format!(
                    "{} asked for a new token after operation {delivered} delivered its bootstrap data; refused (retry the host to start a new operation)",
                    request.remote
                );
                self.ctx.segment_warning(host, "TokenRefused", note).await;
                None
            }
            _ => None,
        })
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

    /// The owning Host's `spec.relayAgent`, read when the Host was.
    fn relay_pin(&self, mac: MacAddr) -> Option<RelayPin> {
        Some(self.ctx.hosts.get(mac)?.spec.relay_agent.as_ref()?.pin())
    }

    fn boot_action(&self, request: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
        Box::pin(self.action(request))
    }

    /// What each MAC boots as: its owner (a Host that names another's MAC is not shown).
    fn hosts(&self) -> Vec<HostSummary> {
        let owners = self.ctx.hosts.owners();
        owners
            .iter()
            .filter_map(|h| Some(summary(h.spec.boot_mac_address.parse().ok()?, h)))
            .collect()
    }

    fn agent(&self, request: AgentRequest) -> BoxFuture<'_, AgentResponse> {
        Box::pin(crate::agent::handle(self.ctx.clone(), request))
    }

    fn media(&self, request: MediaRequest) -> BoxFuture<'_, Option<Vec<Word>>> {
        Box::pin(self.media_cmdline(request))
    }
}

/// How long a virtual-media fetch waits for the Host cache to show the token just stored.
const MEDIA_CACHE_WAIT: Duration = Duration::from_secs(3);

/// Whether `host`'s operation boots its ramdisk from virtual media.
fn boots_from_media(host: &Host) -> bool {
    host.status.as_ref().and_then(|s| s.operation.as_ref()).is_some_and(|op| op.virtual_media)
}

/// What the status page shows of the Host that owns boot MAC `mac`.
fn summary(mac: MacAddr, host: &Host) -> HostSummary {
    let status = host.status.as_ref();
    let mut state = match status.and_then(|s| s.state) {
        Some(state) => format!("{state:?}"),
        None => "New".to_owned(),
    };
    if host.spec.maintenance {
        state.push_str(" (maintenance)");
    }
    if !host.spec.online {
        state.push_str(" (offline)");
    }
    HostSummary {
        mac,
        name: Some(key(host)),
        state,
        address: status.into_iter().flat_map(|s| &s.addresses).find_map(|a| {
            (a.kind == "InternalIP").then(|| a.address.parse::<Ipv4Addr>().ok()).flatten()
        }),
        claim: Some(if host.spec.consumer_ref.is_some() { Claim::Claimed } else { Claim::Free }),
        operation: status.and_then(|s| s.operation.as_ref()).map(|op| OperationSummary {
            kind: format!("{:?}", op.kind),
            step: op.step.clone(),
            bytes: op.bytes.map(|b| ByteProgress { done: b.done, total: b.total }),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{
        ByteCount, ConsumerRef, HostSpec, HostStatus, Image, MachineAddress, Operation,
        OperationKind,
    };

    fn host(name: &str) -> Host {
        let mut host = Host::new(name, HostSpec::new("52:54:00:00:00:01"));
        host.metadata.namespace = Some("site-a".into());
        host
    }

    /// Whatever a Host holds, its summary (published to every machine on the segment) names
    /// no tenant, operation, image or token.
    #[test]
    fn a_summary_shows_state_address_claim_and_progress_and_nothing_of_the_tenant() {
        const DIGEST: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
        let mut claimed = host("node-1");
        claimed.spec.consumer_ref = Some(ConsumerRef {
            api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
            kind: "SitebootMachine".into(),
            namespace: "tenant-ns".into(),
            name: "worker-0".into(),
            uid: "u".into(),
        });
        claimed.status = Some(HostStatus {
            state: Some(HostState::Provisioning),
            addresses: vec![
                MachineAddress { kind: "Hostname".into(), address: "node-1".into() },
                MachineAddress { kind: "InternalIP".into(), address: "10.99.0.100".into() },
            ],
            operation: Some(Operation {
                token_hash: Some("secret-hash".into()),
                token_address: Some("10.99.0.100".into()),
                image: Some(Image {
                    url: "http://images.tenant.example/node.raw".into(),
                    checksum: format!("sha256:{DIGEST}"),
                    format: None,
                    grow_last_partition: false,
                }),
                step: Some("writing image".into()),
                bytes: Some(ByteCount { done: 512, total: 2048 }),
                ..Operation::new(OperationKind::Provision, "op-1f2e3d".into(), now())
            }),
            ..HostStatus::default()
        });
        let mac = "52:54:00:00:00:01".parse().unwrap();
        let summary = summary(mac, &claimed);
        assert_eq!(summary.name.as_deref(), Some("site-a/node-1"));
        assert_eq!(summary.state, "Provisioning");
        assert_eq!(summary.address, Some("10.99.0.100".parse().unwrap()));
        let operation = summary.operation.clone().unwrap();
        assert_eq!(
            (operation.kind.as_str(), operation.step.as_deref()),
            ("Provision", Some("writing image"))
        );
        assert_eq!(operation.bytes, Some(ByteProgress { done: 512, total: 2048 }));
        let shown = serde_json::to_string(&summary).unwrap();
        assert!(shown.contains(r#""claim":"claimed""#), "{shown}");
        for secret in
            ["tenant-ns", "worker-0", "op-1f2e3d", DIGEST, "images.tenant.example", "secret-hash"]
        {
            assert!(!shown.contains(secret), "{secret} is published: {shown}");
        }
    }

    #[test]
    fn new_cordoned_and_offline_hosts() {
        let mac = "52:54:00:00:00:01".parse().unwrap();
        let mut cordoned = host("node-2");
        cordoned.spec.maintenance = true;
        cordoned.spec.online = false;
        let summary = summary(mac, &cordoned);
        assert_eq!(summary.state, "New (maintenance) (offline)");
        assert_eq!(summary.claim, Some(Claim::Free));
        assert_eq!((summary.address, summary.operation), (None, None));
    }
}
