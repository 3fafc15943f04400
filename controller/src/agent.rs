//! The deploy ramdisk's API, under `/agent/v1/`, over Kubernetes mode's records: each Host's
//! status holds its operation (the token's hash, where it was issued, what was handed out), and
//! every write re-reads the Host and re-checks the token. The endpoints, their checks and
//! their order are `siteboot_agent_server::serve`'s, shared with standalone mode.
//!
//! What only this mode adds: a Host is found by the MAC behind the request's address or by the
//! token its virtual media carried; the provisioning's image and wipe come from the
//! SitebootMachine the Host is bound to and are frozen into status at the first task; the
//! bootstrap data is what the controller handed over for this operation; refusals that matter
//! to the operator become events on the Host.

use std::sync::Arc;

use kube::{Api, ResourceExt};
use siteboot_agent_api::{Hardware, MetaData};
use siteboot_agent_server::images::ImageService;
use siteboot_agent_server::serve::{self, BootstrapData, Opened, Records, Target};
use siteboot_agent_server::{Grant, Refusal, check_token, needs_new_token, token};
use siteboot_boot::inventory::{AgentRequest, AgentResponse};

use crate::conditions::paused_itself;
use crate::context::{Ctx, key, owner_machine_ref, update_host_status};
use crate::crd::capi::Machine;
use crate::crd::{
    ByteCount, Host, HostState, HostStatus, Image, MachineAddress, Operation, OperationKind,
    SitebootMachine, WipePolicy, now,
};
use crate::handoff::{self, Staged};
use crate::host::lifecycle::{self, Fresh, completed, older_than, wipe};
use crate::machine::plan::provider_id;

pub async fn handle(ctx: Arc<Ctx>, req: AgentRequest) -> AgentResponse {
    serve::answer(&HostRecords { ctx: &ctx }, &req).await
}

type Failure = serve::Failure<kube::Error>;

/// Seconds between two writes of one step's progress (see [`Records::progress`]).
const PROGRESS_WRITE_INTERVAL: i64 = 5;

/// Kubernetes mode's records: the Hosts' status, through the API server and the Host cache.
struct HostRecords<'a> {
    ctx: &'a Ctx,
}

impl HostRecords<'_> {
    /// The Host a request is for, as cached: the one whose boot MAC holds the request's
    /// address, else the one whose virtual media or kexec carried the request's token (such a
    /// ramdisk may get its address from anyone: a routed network, another DHCP server).
    fn cached(&self, req: &AgentRequest) -> Result<Arc<Host>, Refusal> {
        let hosts = &self.ctx.hosts;
        let by_mac = req.remote_mac.and_then(|mac| hosts.get(mac));
        let by_token =
            || req.token.as_deref().and_then(|t| hosts.with_out_of_band_token(&token::hash(t)));
        match (by_mac.or_else(by_token), req.remote_mac) {
            (Some(host), _) => Ok(host),
            (None, Some(_)) => Err(Refusal::UnknownHost),
            (None, None) => Err(Refusal::UnknownAddress),
        }
    }

    /// The operation `req`'s token opens on `host`, as its status keeps it.
    fn operation(&self, req: &AgentRequest, host: &Host) -> Result<Operation, Refusal> {
        let op = host.status.as_ref().and_then(|s| s.operation.clone());
        let max_age = self.ctx.token_max_age.as_secs() as i64;
        let grant = op.as_ref().map(|op| Grant {
            token_hash: op.token_hash.as_deref(),
            address: op.token_address.as_deref(),
            out_of_band: op.token_out_of_band(),
            fresh: op.token_issued.as_ref().is_some_and(|t| !older_than(t, max_age, &now())),
        });
        check_token(req.token.as_deref(), grant, req.remote)?;
        Ok(op.expect("checked: an operation"))
    }

    /// Writes `host`'s status as `change` computes it from the Host read fresh (see
    /// [`update_host_status`]); `None`: `change` wrote nothing.
    async fn write_status(
        &self,
        host: &Host,
        change: impl FnMut(&Host) -> Result<Option<HostStatus>, Refusal>,
    ) -> Result<Option<Host>, Failure> {
        let api = self.ctx.hosts_api(&host.namespace().unwrap_or_default());
        Ok(update_host_status(&api, &host.name_any(), change).await.map_err(Failure::Store)??)
    }

    /// Freezes the provisioning's image and its tenant's wipe into the Host's status from the
    /// trusted side, the SitebootMachine the Host is bound to (never from
    /// `spec.provisioning`, which whoever may edit a Host can change).
    async fn hand_out(
        &self,
        req: &AgentRequest,
        host: &Host,
        op: &Opened,
    ) -> Result<Image, Failure> {
        let bound = match self.binding(host).await? {
            Ok(bound) => bound,
            Err(refusal) => {
                let note = format!("provisioning refused: {refusal}");
                self.ctx.event(host, true, "ProvisioningRefused", note).await;
                return Err(refusal.into());
            }
        };
        let image = bound.spec.image;
        let written = self
            .write_status(host, |current| {
                let current_op = self.operation(req, current)?;
                if current_op.id != op.id {
                    return Err(Refusal::NoOperation);
                }
                // Handed out already (a second question racing this one): that image stays.
                if current_op.image.is_some() {
                    return Ok(None);
                }
                let mut status = current.status.clone().unwrap_or_default();
                lifecycle::hand_out(&mut status, &image, bound.spec.wipe);
                Ok(Some(status))
            })
            .await?;
        if written.is_some() {
            tracing::info!(host = %key(host), operation = %op.id, image = %image.url, "provisioning handed out");
            return Ok(image);
        }
        // Someone else's hand-out won: use what it froze.
        let fresh = self.host(req).await?;
        Ok(self.operation(req, &fresh)?.image.ok_or(Refusal::NoOperation)?)
    }

    /// What `host` is bound to, found from the binding alone: the Host's `consumerRef` names
    /// a SitebootMachine with the same uid whose `spec.hostRef` names this Host, owned by a
    /// Machine that still exists with the uid it names. Nothing a Host says can point
    /// elsewhere.
    async fn binding(&self, host: &Host) -> Result<Result<SitebootMachine, Refusal>, Failure> {
        let not_bound = |why: &str| Ok(Err(Refusal::NotBound(why.to_owned())));
        let Some(consumer) = &host.spec.consumer_ref else { return not_bound("no consumerRef") };
        if consumer.kind != "SitebootMachine" {
            return not_bound("the consumer is not a SitebootMachine");
        }
        let client = self.ctx.client.clone();
        let machines: Api<SitebootMachine> = Api::namespaced(client.clone(), &consumer.namespace);
        let Some(sbm) = machines.get_opt(&consumer.name).await.map_err(Failure::Store)? else {
            return not_bound("its SitebootMachine does not exist");
        };
        if sbm.metadata.uid.as_deref() != Some(consumer.uid.as_str()) {
            return not_bound("consumerRef.uid is not its SitebootMachine's");
        }
        let names_host = sbm.spec.host_ref.as_ref().is_some_and(|r| {
            Some(r.namespace.as_str()) == host.metadata.namespace.as_deref()
                && Some(r.name.as_str()) == host.metadata.name.as_deref()
        });
        if !names_host {
            return not_bound("its SitebootMachine's hostRef does not name this Host");
        }
        let Some(owner) = owner_machine_ref(&sbm) else {
            return not_bound("its SitebootMachine has no owner Machine");
        };
        let machines: Api<Machine> = Api::namespaced(client, &consumer.namespace);
        let Some(machine) = machines.get_opt(&owner.name).await.map_err(Failure::Store)? else {
            return not_bound("its Machine does not exist");
        };
        if machine.metadata.uid.as_deref() != Some(owner.uid.as_str()) {
            return not_bound("its owner Machine was replaced");
        }
        Ok(Ok(sbm))
    }
}

/// The host name a provisioned host gets (written by its ramdisk, or delivered over SSH): its
/// Machine's name (what CAPI expects the Node to be called), else its consumer's, else the
/// Host's.
pub async fn machine_name(client: &kube::Client, host: &Host) -> Result<String, kube::Error> {
    let Some(consumer) = &host.spec.consumer_ref else { return Ok(host.name_any()) };
    let machines: Api<SitebootMachine> = Api::namespaced(client.clone(), &consumer.namespace);
    let sbm = machines.get_opt(&consumer.name).await?;
    let owner = sbm.as_ref().and_then(owner_machine_ref);
    Ok(owner.map(|o| o.name.clone()).unwrap_or_else(|| consumer.name.clone()))
}

fn opened(op: Operation) -> Opened {
    Opened {
        out_of_band: op.token_out_of_band(),
        id: op.id,
        kind: op.kind,
        bootstrap_delivered: op.bootstrap_delivered,
    }
}

impl Records for HostRecords<'_> {
    type Host = Host;
    type Error = kube::Error;

    /// Read fresh from the API (a token minted a moment ago may not be in the cache yet).
    async fn host(&self, req: &AgentRequest) -> Result<Host, Failure> {
        let cached = self.cached(req)?;
        let api = self.ctx.hosts_api(cached.metadata.namespace.as_deref().unwrap_or_default());
        let host = api.get(&cached.name_any()).await.map_err(Failure::Store)?;
        if paused_itself(&host) {
            return Err(Refusal::Paused.into());
        }
        Ok(host)
    }

    fn name(&self, host: &Host) -> String {
        key(host)
    }

    fn authenticate(&self, req: &AgentRequest, host: &Host) -> Result<Opened, Refusal> {
        self.operation(req, host).map(opened)
    }

    fn boots_again(&self, host: &Host) -> bool {
        boots_again(host)
    }

    /// Read from the Host cache: its token was minted when its boot script was served, a
    /// kernel boot before its first question, so a cache a moment behind is no loss.
    fn idle(&self, req: &AgentRequest) -> bool {
        let Ok(host) = self.cached(req) else { return false };
        !paused_itself(&*host)
            && !boots_again(&host)
            && matches!(self.operation(req, &host), Err(refusal) if needs_new_token(&refusal))
    }

    fn wipe(&self, host: &Host) -> WipePolicy {
        wipe(host, self.ctx.min_wipe)
    }

    fn images(&self) -> Option<&ImageService> {
        self.ctx.images.as_deref()
    }

    /// Frozen into status the first time the ramdisk asks for its task.
    async fn image(&self, req: &AgentRequest, host: &Host, op: &Opened) -> Result<Image, Failure> {
        let frozen = host.status.as_ref().and_then(|s| s.operation.as_ref()?.image.clone());
        match frozen {
            Some(image) => Ok(image),
            None => self.hand_out(req, host, op).await,
        }
    }

    async fn target(&self, host: &Host, op: &Opened) -> Result<Target, Failure> {
        Ok(Target {
            hints: host.spec.root_device_hints.clone().unwrap_or_default(),
            meta_data: MetaData {
                instance_id: op.id.clone(),
                local_hostname: Some(
                    machine_name(&self.ctx.client, host).await.map_err(Failure::Store)?,
                ),
                provider_id: Some(provider_id(host)),
            },
        })
    }

    /// What the controller handed over in the appliance's namespace for this operation: the
    /// boot plane reads no Secret of the tenant's (see `handoff`).
    async fn bootstrap_data(
        &self,
        host: &Host,
        op: &Opened,
    ) -> Result<Option<BootstrapData>, Failure> {
        let bound = match self.binding(host).await? {
            Ok(bound) => bound,
            Err(refusal) => {
                let note = format!("bootstrap data refused: {refusal}");
                self.ctx.event(host, true, "BootstrapDataRefused", note).await;
                return Err(refusal.into());
            }
        };
        let expected = Staged { host: key(host), operation: op.id.clone() };
        let machine_uid = bound.metadata.uid.unwrap_or_default();
        let ctx = self.ctx;
        let staged = handoff::read(&ctx.client, &ctx.namespace, &machine_uid, &expected).await;
        Ok(staged.map_err(Failure::Store)?.map(|data| BootstrapData {
            content_type: if data.format == "ignition" {
                "application/vnd.coreos.ignition+json"
            } else {
                "text/cloud-config"
            },
            data: bytes::Bytes::from(data.value),
        }))
    }

    async fn deliver(&self, req: &AgentRequest, host: &Host, op: &Opened) -> Result<(), Failure> {
        self.write_status(host, |current| {
            let current_op = self.operation(req, current)?;
            if current_op.id != op.id || current_op.bootstrap_delivered {
                return Err(Refusal::Replayed);
            }
            let mut status = current.status.clone().unwrap_or_default();
            if let Some(o) = status.operation.as_mut() {
                o.bootstrap_delivered = true;
            }
            Ok(Some(status))
        })
        .await?;
        Ok(())
    }

    /// A ramdisk writing an image reports every second or so; a rack of them must not turn
    /// into a read and a write per host per second. The same step within a few seconds of the
    /// last one the Host cache shows is taken as heard (a stale cache only means more writes).
    async fn progress(
        &self,
        req: &AgentRequest,
        step: String,
        bytes: Option<ByteCount>,
    ) -> Result<(), Failure> {
        let cached = self.cached(req).ok();
        let heard = cached.filter(|h| !paused_itself(&**h)).is_some_and(|h| {
            self.operation(req, &h).is_ok_and(|op| {
                op.step.as_deref() == Some(step.as_str())
                    && op
                        .last_heard
                        .as_ref()
                        .is_some_and(|t| !older_than(t, PROGRESS_WRITE_INTERVAL, &now()))
            })
        });
        if heard {
            return Ok(());
        }
        let host = self.host(req).await?;
        self.operation(req, &host)?;
        self.write_status(&host, |current| {
            self.operation(req, current)?;
            let mut status = current.status.clone().unwrap_or_default();
            if let Some(op) = status.operation.as_mut() {
                op.step = Some(step.clone());
                op.bytes = bytes;
                op.last_heard = Some(now());
            }
            Ok(Some(status))
        })
        .await?;
        Ok(())
    }

    async fn finish(
        &self,
        req: &AgentRequest,
        kind: OperationKind,
        ok: bool,
        message: String,
        hardware: Option<Hardware>,
    ) -> Result<(), Failure> {
        let host = self.host(req).await?;
        let written = self
            .write_status(&host, |current| {
                let op = self.operation(req, current)?;
                if op.kind != kind {
                    return Err(Refusal::WrongOperation(op.kind));
                }
                // A provisioning succeeds only with the image it was handed (what the host
                // reports as written must be what the trusted side chose).
                if kind == OperationKind::Provision && ok && op.image.is_none() {
                    let why = "no image was handed out: ask for the task";
                    return Err(Refusal::BadRequest(why.into()));
                }
                let mut status =
                    completed(current, kind, ok, &message, hardware.clone(), &Fresh::now());
                if let Some(images) = &self.ctx.images {
                    images.release(&op.id);
                }
                if kind == OperationKind::Provision && ok {
                    let address = req.remote.to_string();
                    status.addresses = vec![MachineAddress { kind: "InternalIP".into(), address }];
                }
                Ok(Some(status))
            })
            .await?;
        let Some(host) = written else { return Ok(()) };
        let state = host.status.as_ref().and_then(|s| s.state);
        let reason = host
            .status
            .as_ref()
            .and_then(|s| crate::crd::condition(&s.conditions, crate::conditions::READY))
            .map(|c| c.reason.clone())
            .unwrap_or_default();
        tracing::info!(host = %key(&host), ?kind, ok, state = ?state, "ramdisk finished an operation");
        let outcome = if ok { "succeeded" } else { "failed" };
        let message = if message.is_empty() { String::new() } else { format!(" ({message})") };
        let note = format!("{kind:?} {outcome}: now {state:?}{message}");
        self.ctx.event(&host, !ok, &reason, note).await;
        Ok(())
    }

    async fn report(&self, host: &Host, reason: &'static str, note: String) {
        self.ctx.event(host, true, reason, note).await;
    }
}

/// Whether a ramdisk without a good token should reboot: an operation waits (boot again for
/// its token), or the host is Provisioned (the ramdisk that just wrote its disk: the boot
/// script now says the local disk) and no BMC disk boot is pending (if one was asked, the
/// BMC's restart comes first; the reboot only matters if the BMC refused). Not for an
/// operation whose bootstrap data was delivered: it gets no new token, so booting again would
/// only loop until the silence timeout.
fn boots_again(host: &Host) -> bool {
    let status = host.status.as_ref();
    let pending =
        status.and_then(|s| s.operation.as_ref()).is_some_and(|op| !op.bootstrap_delivered);
    let provisioned = status.and_then(|s| s.state) == Some(HostState::Provisioned);
    pending || (provisioned && !lifecycle::disk_boot_due(host))
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use siteboot_agent_api::Task;

    use super::*;
    use crate::crd::HostSpec;

    #[test]
    fn an_idle_ramdisk_reboots_into_a_pending_operation_or_a_provisioned_disk() {
        use crate::host::lifecycle::{Transition, apply};
        let with = |to, operation: bool| {
            let mut host = Host::new("node-1", HostSpec::new("52:54:00:00:00:01"));
            let operation = operation.then_some(OperationKind::Deprovision);
            let transition = Transition { to, operation, reason: "Test", message: String::new() };
            host.status = Some(apply(&host, &transition, &Fresh::now()));
            Task::without_token(boots_again(&host))
        };
        let wait = Task::Wait { seconds: 10 };
        assert_eq!(with(HostState::Deprovisioning, true), Task::Reboot);
        assert_eq!(with(HostState::Provisioned, false), Task::Reboot);
        let mut delivered = Host::new("node-1", HostSpec::new("52:54:00:00:00:01"));
        let transition = Transition {
            to: HostState::Provisioning,
            operation: Some(OperationKind::Provision),
            reason: "Test",
            message: String::new(),
        };
        delivered.status = Some(apply(&delivered, &transition, &Fresh::now()));
        assert_eq!(Task::without_token(boots_again(&delivered)), Task::Reboot);
        delivered.status.as_mut().unwrap().operation.as_mut().unwrap().bootstrap_delivered = true;
        assert_eq!(Task::without_token(boots_again(&delivered)), wait);
        assert_eq!(with(HostState::Available, false), wait);
        assert_eq!(with(HostState::Quarantined, false), wait);

        // With a BMC, the ramdisk that wrote the disk waits while the BMC is asked to boot it.
        let mut host = Host::new("node-1", HostSpec::new("52:54:00:00:00:01"));
        host.spec.bmc = Some(crate::crd::Bmc {
            address: "redfish+https://10.0.0.5/redfish/v1/Systems/1".into(),
            credentials_name: "c".into(),
            certificate_fingerprint: None,
            boot_mode: None,
        });
        let transition = Transition {
            to: HostState::Provisioned,
            operation: None,
            reason: "Test",
            message: String::new(),
        };
        let mut status = apply(&host, &transition, &Fresh::now());
        status.installed = Some(crate::crd::Installed {
            image: serde_json::from_value(
                json!({ "url": "http://x/i.raw", "checksum": "sha256:00" }),
            )
            .unwrap(),
            consumer: "ns/m".into(),
            disk_boot_pending: true,
        });
        host.status = Some(status);
        assert_eq!(Task::without_token(boots_again(&host)), wait);
        host.status.as_mut().unwrap().installed.as_mut().unwrap().disk_boot_pending = false;
        assert_eq!(Task::without_token(boots_again(&host)), Task::Reboot);
    }
}
