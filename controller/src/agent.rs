//! The deploy ramdisk's API, under `/agent/v1/`. Every request that acts for an operation must
//! carry that operation's token (`Authorization: Bearer`), come from the address the token was
//! issued to, and arrive before the token expires; bootstrap data is handed out once. Anything
//! else is refused and logged, and no refusal says more than the ramdisk needs.
//!
//! - `GET  task`: what to do: `inspect`, `provision` (with the image), `deprovision` (with the
//!   wipe policy), `reboot` (to fetch a token for a new operation) or `wait`
//! - `POST inspection`: the hardware found (JSON `Hardware`); ends inspection
//! - `GET  bootstrap`: the Machine's bootstrap data, once per operation
//! - `POST progress`: `{"step": "..."}`
//! - `POST complete`: `{"ok": bool, "message": "..."}`; ends provisioning or deprovisioning

use std::fmt;
use std::sync::Arc;

use http::{Method, StatusCode};
use kube::{Api, ResourceExt};
use siteboot_agent_api::{Ack, MetaData, ProgressReport, Provision, Task};
use siteboot_boot::arp_probe::Unconfirmed;
use siteboot_boot::inventory::{AgentRequest, AgentResponse};

use crate::conditions::paused_itself;
use crate::context::{Ctx, key, owner_machine_ref, update_host_status};
use crate::crd::capi::Machine;
use crate::crd::{
    ByteCount, Host, HostState, Image, MachineAddress, Operation, OperationKind, RootDeviceHints,
    SitebootMachine, WipePolicy, now,
};
use crate::handoff::{self, Staged};
use crate::host::lifecycle::{self, Fresh, completed, older_than, wipe};
use crate::images::Readiness;
use crate::machine::plan::provider_id;
use crate::token;

pub async fn handle(ctx: Arc<Ctx>, req: AgentRequest) -> AgentResponse {
    let Some(endpoint) = Endpoint::of(&req) else {
        return AgentResponse::text(StatusCode::NOT_FOUND, "no such agent endpoint\n");
    };
    let result = match endpoint {
        Endpoint::Task => task(&ctx, &req).await,
        Endpoint::Inspection => inspection(&ctx, &req).await,
        Endpoint::Bootstrap => bootstrap(&ctx, &req).await,
        Endpoint::Progress => progress(&ctx, &req).await,
        Endpoint::Complete => complete(&ctx, &req).await,
    };
    match result {
        Ok(response) => response,
        Err(Failure::Refused(refusal)) => refused(&req, &refusal),
        Err(Failure::Api(e)) => {
            tracing::error!(remote = %req.remote, path = %req.path, error = %e, "agent request failed");
            AgentResponse::text(StatusCode::SERVICE_UNAVAILABLE, "try again\n")
        }
    }
}

/// The endpoints of the agent API; both modes serve the same ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Task,
    Inspection,
    Bootstrap,
    Progress,
    Complete,
}

impl Endpoint {
    /// The endpoint `req` asks for; `None`: no such endpoint (404).
    pub fn of(req: &AgentRequest) -> Option<Self> {
        Some(match (&req.method, req.path.as_str()) {
            (&Method::GET, "v1/task") => Endpoint::Task,
            (&Method::POST, "v1/inspection") => Endpoint::Inspection,
            (&Method::GET, "v1/bootstrap") => Endpoint::Bootstrap,
            (&Method::POST, "v1/progress") => Endpoint::Progress,
            (&Method::POST, "v1/complete") => Endpoint::Complete,
            _ => return None,
        })
    }
}

/// Logs a refused request and answers it, saying no more than the reason.
pub fn refused(req: &AgentRequest, refusal: &Refusal) -> AgentResponse {
    tracing::warn!(remote = %req.remote, mac = ?req.remote_mac, path = %req.path, reason = %refusal, "agent request refused");
    AgentResponse::text(refusal.status(), format!("refused: {refusal}\n"))
}

/// The refusals after which `GET task` answers [`Task::without_token`] rather than refuse.
pub fn needs_new_token(refusal: &Refusal) -> bool {
    matches!(
        refusal,
        Refusal::NoToken | Refusal::WrongToken | Refusal::Expired | Refusal::NoOperation
    )
}

/// What an operation's token was issued as.
#[derive(Debug, Clone, Copy)]
pub struct Grant<'a> {
    /// The SHA-256 of the token (none issued yet: every token is wrong).
    pub token_hash: Option<&'a str>,
    /// The address it was issued to.
    pub address: Option<&'a str>,
    /// It came through the host's BMC, in virtual media, never over the segment: holding it is
    /// the evidence, whatever address the request comes from.
    pub via_bmc: bool,
    /// Whether it was issued less than the token lifetime ago.
    pub fresh: bool,
}

/// Checks a request's token against its host's operation (`None`: no operation).
pub fn check_token(
    token: Option<&str>,
    grant: Option<Grant<'_>>,
    remote: std::net::Ipv4Addr,
) -> Result<(), Refusal> {
    let token = token.ok_or(Refusal::NoToken)?;
    let grant = grant.ok_or(Refusal::NoOperation)?;
    let hash = grant.token_hash.ok_or(Refusal::WrongToken)?;
    if !token::matches(token, hash) {
        return Err(Refusal::WrongToken);
    }
    if !grant.via_bmc && grant.address != Some(remote.to_string().as_str()) {
        return Err(Refusal::WrongAddress);
    }
    if !grant.fresh {
        return Err(Refusal::Expired);
    }
    Ok(())
}

/// Why an agent request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The request comes from an address with no known MAC.
    UnknownAddress,
    /// No Host has the MAC behind the address.
    UnknownHost,
    NoToken,
    /// The token is not the current one of the Host's operation (wrong, or from an earlier boot
    /// or operation).
    WrongToken,
    /// The token was issued to another address.
    WrongAddress,
    Expired,
    NoOperation,
    /// The request does not fit the operation (bootstrap data during a wipe, say).
    WrongOperation(OperationKind),
    /// Bootstrap data was already handed out for this operation.
    Replayed,
    /// The Host is not bound to a machine whose bootstrap data it may have (why, in words).
    NotBound(String),
    /// The Host is paused: nothing about it changes until the annotation goes (the ramdisk
    /// retries).
    Paused,
    /// The segment does not confirm, as secrets would leave, that the address is the MAC's.
    Unconfirmed(Unconfirmed),
    BadRequest(String),
}

impl Refusal {
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::NoToken => StatusCode::UNAUTHORIZED,
            Refusal::Replayed => StatusCode::CONFLICT,
            Refusal::Paused => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::BadRequest(_) => StatusCode::BAD_REQUEST,
            _ => StatusCode::FORBIDDEN,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::UnknownAddress => f.write_str("no MAC is known for this address"),
            Refusal::UnknownHost => f.write_str("no Host has this MAC"),
            Refusal::NoToken => f.write_str("no token"),
            Refusal::WrongToken => f.write_str("wrong token"),
            Refusal::WrongAddress => f.write_str("token issued to another address"),
            Refusal::Expired => f.write_str("token expired"),
            Refusal::NoOperation => f.write_str("no operation in progress"),
            Refusal::WrongOperation(k) => write!(f, "not allowed during {k:?}"),
            Refusal::Replayed => f.write_str("bootstrap data already delivered for this operation"),
            Refusal::NotBound(why) => write!(f, "not bound to a machine: {why}"),
            Refusal::BadRequest(m) => write!(f, "bad request: {m}"),
            Refusal::Paused => f.write_str("the Host is paused; try again later"),
            Refusal::Unconfirmed(why) => {
                write!(f, "the address is not confirmed as this host's: {why}")
            }
        }
    }
}

enum Failure {
    Refused(Refusal),
    Api(kube::Error),
}

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Self {
        Failure::Refused(r)
    }
}

impl From<kube::Error> for Failure {
    fn from(e: kube::Error) -> Self {
        Failure::Api(e)
    }
}

/// The Host a request is for, as cached: the one whose boot MAC holds the request's address,
/// else the one whose virtual media carried the request's token (a media-booted ramdisk may get
/// its address from anyone: a routed network, another DHCP server).
fn cached_host(ctx: &Ctx, req: &AgentRequest) -> Result<Arc<Host>, Refusal> {
    let by_mac = req.remote_mac.and_then(|mac| ctx.hosts.get(mac));
    let by_media =
        || req.token.as_deref().and_then(|t| ctx.hosts.with_media_token(&token::hash(t)));
    match (by_mac.or_else(by_media), req.remote_mac) {
        (Some(host), _) => Ok(host),
        (None, Some(_)) => Err(Refusal::UnknownHost),
        (None, None) => Err(Refusal::UnknownAddress),
    }
}

/// The Host the request is for ([`cached_host`]), read fresh from the API (a token minted a
/// moment ago may not be in the cache yet).
async fn host_of(ctx: &Ctx, req: &AgentRequest) -> Result<(Api<Host>, Host), Failure> {
    let cached = cached_host(ctx, req)?;
    let api = ctx.hosts_api(cached.metadata.namespace.as_deref().unwrap_or_default());
    let host = api.get(cached.metadata.name.as_deref().unwrap_or_default()).await?;
    if paused_itself(&host) {
        return Err(Refusal::Paused.into());
    }
    Ok((api, host))
}

/// Checks the token against `host`'s operation.
fn authenticate(ctx: &Ctx, req: &AgentRequest, host: &Host) -> Result<Operation, Refusal> {
    let op = host.status.as_ref().and_then(|s| s.operation.clone());
    let grant = op.as_ref().map(|op| Grant {
        token_hash: op.token_hash.as_deref(),
        address: op.token_address.as_deref(),
        via_bmc: op.virtual_media,
        fresh: op
            .token_issued
            .as_ref()
            .is_some_and(|t| !older_than(t, ctx.token_max_age.as_secs() as i64, &now())),
    });
    check_token(req.token.as_deref(), grant, req.remote)?;
    Ok(op.expect("checked: an operation"))
}

async fn task(ctx: &Ctx, req: &AgentRequest) -> Result<AgentResponse, Failure> {
    if let Some(idle) = idle_from_cache(ctx, req) {
        return Ok(idle);
    }
    let (_, host) = host_of(ctx, req).await?;
    let op = match authenticate(ctx, req, &host) {
        Ok(op) => op,
        // No token, or one from before.
        Err(refusal) if needs_new_token(&refusal) => {
            return Ok(AgentResponse::json(&Task::without_token(boots_again(&host))));
        }
        Err(other) => return Err(other.into()),
    };
    let answer = match op.kind {
        OperationKind::Inspect => Task::Inspect { operation: op.id },
        OperationKind::Provision => {
            let image = match &op.image {
                Some(image) => image.clone(),
                None => hand_out(ctx, req, &host, &op).await?,
            };
            let readiness = match &ctx.images {
                Some(images) => images.prepare(&op.id, &image).await,
                None => Readiness::Ready { url: image.url.clone(), size: 0 },
            };
            let (url, size) = match readiness {
                Readiness::Ready { url, size } => (url, size),
                Readiness::Fetching { why } => {
                    tracing::info!(host = %key(&host), operation = %op.id, %why, "the ramdisk waits for its image");
                    return Ok(AgentResponse::json(&Task::Wait { seconds: 5 }));
                }
                Readiness::Failed { why } => {
                    finish(ctx, req, OperationKind::Provision, false, &why, None).await?;
                    return Ok(AgentResponse::json(&Task::Wait { seconds: 10 }));
                }
            };
            let hostname = machine_name(ctx, &host).await?;
            let hints = host.spec.root_device_hints.clone().unwrap_or_default();
            let meta = MetaData {
                instance_id: op.id.clone(),
                local_hostname: Some(hostname),
                provider_id: Some(provider_id(&host)),
            };
            provision_task(&op.id, &image, (&url, size), &hints, meta)
        }
        OperationKind::Deprovision => deprovision_task(&op.id, wipe(&host, ctx.min_wipe)),
    };
    Ok(AgentResponse::json(&answer))
}

/// Freezes the provisioning's image and its tenant's wipe into the Host's status from the
/// trusted side, the SitebootMachine the Host is bound to (never from `spec.provisioning`,
/// which whoever may edit a Host can change), the first time the ramdisk asks for its task.
async fn hand_out(
    ctx: &Ctx,
    req: &AgentRequest,
    host: &Host,
    op: &Operation,
) -> Result<Image, Failure> {
    let bound = match binding(ctx, host).await? {
        Ok(bound) => bound,
        Err(refusal) => {
            let note = format!("provisioning refused: {refusal}");
            ctx.event(host, true, "ProvisioningRefused", note).await;
            return Err(refusal.into());
        }
    };
    let image = bound.spec.image;
    let name = host.metadata.name.as_deref().unwrap_or_default();
    let written = update_host_status(
        &ctx.hosts_api(&host.namespace().unwrap_or_default()),
        name,
        |current| {
            let current_op = authenticate(ctx, req, current)?;
            if current_op.id != op.id {
                return Err(Refusal::NoOperation);
            }
            let mut status = current.status.clone().unwrap_or_default();
            // Handed out already (a second question racing this one): that image stays.
            if current_op.image.is_some() {
                return Ok(None);
            }
            lifecycle::hand_out(&mut status, &image, bound.spec.wipe);
            Ok(Some(status))
        },
    )
    .await??;
    match written {
        Some(_) => {
            tracing::info!(host = %key(host), operation = %op.id, image = %image.url, "provisioning handed out");
            Ok(image)
        }
        // Someone else's hand-out won: use what it froze.
        None => {
            let (_, fresh) = host_of(ctx, req).await?;
            let op = authenticate(ctx, req, &fresh)?;
            op.image.ok_or_else(|| Refusal::NoOperation.into())
        }
    }
}

/// The answer for a ramdisk with nothing to do, when the cached Host shows nothing for it: no
/// operation its token opens and no reason to boot again. A rack of idle ramdisks asks every
/// few seconds; this spares the API server a read per question. Anything else is decided from a
/// fresh read. A cache a moment behind can only make a ramdisk wait one more round: its token
/// was minted when its boot script was served, a kernel boot before its first question.
fn idle_from_cache(ctx: &Ctx, req: &AgentRequest) -> Option<AgentResponse> {
    let host = cached_host(ctx, req).ok()?;
    if paused_itself(&*host) {
        return None;
    }
    match authenticate(ctx, req, &host) {
        Err(refusal) if needs_new_token(&refusal) && !boots_again(&host) => {
            Some(AgentResponse::json(&Task::without_token(false)))
        }
        _ => None,
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
    pending || (provisioned && !crate::host::lifecycle::disk_boot_due(host))
}

/// The provision task (docs/agent-api.md): the image at `url` (the appliance's copy, or its
/// source) and its size (0: unknown), how to pick the disk, and the NoCloud meta-data that
/// goes beside the bootstrap data.
pub fn provision_task(
    operation: &str,
    image: &Image,
    (url, size): (&str, u64),
    hints: &RootDeviceHints,
    meta_data: MetaData,
) -> Task {
    Task::Provision(Box::new(Provision {
        grow_last_partition: image.grow_last_partition,
        image: siteboot_agent_api::Image {
            checksum: image.checksum.clone(),
            size_bytes: size,
            url: url.to_owned(),
        },
        meta_data,
        operation: operation.to_owned(),
        root_device_hints: hints.clone().into(),
    }))
}

/// The deprovision task: wipe the disks per `wipe`.
pub fn deprovision_task(operation: &str, wipe: WipePolicy) -> Task {
    Task::Deprovision { operation: operation.to_owned(), wipe: wipe.into() }
}

/// The host name a provisioned host gets: its Machine's name (what CAPI expects the Node to be
/// called), else its consumer's, else the Host's.
async fn machine_name(ctx: &Ctx, host: &Host) -> Result<String, Failure> {
    let Some(consumer) = &host.spec.consumer_ref else { return Ok(host.name_any()) };
    let machines: Api<SitebootMachine> = Api::namespaced(ctx.client.clone(), &consumer.namespace);
    let sbm = machines.get_opt(&consumer.name).await?;
    let owner = sbm.as_ref().and_then(owner_machine_ref);
    Ok(owner.map(|o| o.name.clone()).unwrap_or_else(|| consumer.name.clone()))
}

async fn inspection(ctx: &Ctx, req: &AgentRequest) -> Result<AgentResponse, Failure> {
    let hardware: siteboot_agent_api::Hardware = body(req)?;
    finish(ctx, req, OperationKind::Inspect, true, "", Some(hardware)).await
}

async fn complete(ctx: &Ctx, req: &AgentRequest) -> Result<AgentResponse, Failure> {
    let body: siteboot_agent_api::Complete = body(req)?;
    let (_, host) = host_of(ctx, req).await?;
    let op = authenticate(ctx, req, &host)?;
    if op.kind == OperationKind::Inspect {
        return Err(Refusal::WrongOperation(op.kind).into());
    }
    finish(ctx, req, op.kind, body.ok, &body.message(), None).await
}

/// Ends the operation of kind `kind` (checked again against the fresh Host while writing).
async fn finish(
    ctx: &Ctx,
    req: &AgentRequest,
    kind: OperationKind,
    ok: bool,
    message: &str,
    hardware: Option<crate::crd::Hardware>,
) -> Result<AgentResponse, Failure> {
    let (api, host) = host_of(ctx, req).await?;
    let name = host.metadata.name.clone().unwrap_or_default();
    let message: String = message.chars().take(512).collect();
    let written = update_host_status(&api, &name, |current| {
        let op = authenticate(ctx, req, current)?;
        if op.kind != kind {
            return Err(Refusal::WrongOperation(op.kind));
        }
        // A provisioning succeeds only with the image it was handed (what the host reports as
        // written must be what the trusted side chose).
        if kind == OperationKind::Provision && ok && op.image.is_none() {
            return Err(Refusal::BadRequest("no image was handed out: ask for the task".into()));
        }
        let mut status = completed(current, kind, ok, &message, hardware.clone(), &Fresh::now());
        if let Some(images) = &ctx.images {
            images.release(&op.id);
        }
        if kind == OperationKind::Provision && ok {
            status.addresses =
                vec![MachineAddress { kind: "InternalIP".into(), address: req.remote.to_string() }];
        }
        Ok(Some(status))
    })
    .await??;
    if let Some(host) = written {
        let state = host.status.as_ref().and_then(|s| s.state);
        let reason = host
            .status
            .as_ref()
            .and_then(|s| crate::crd::condition(&s.conditions, crate::conditions::READY))
            .map(|c| c.reason.clone())
            .unwrap_or_default();
        tracing::info!(host = %key(&host), ?kind, ok, state = ?state, "ramdisk finished an operation");
        ctx.event(
            &host,
            !ok,
            &reason,
            format!(
                "{kind:?} {}: now {state:?}{}",
                if ok { "succeeded" } else { "failed" },
                if message.is_empty() { String::new() } else { format!(" ({message})") }
            ),
        )
        .await;
    }
    Ok(AgentResponse::json(&Ack::TAKEN))
}

/// Seconds between two writes of one step's progress (see [`progress`]).
const PROGRESS_WRITE_INTERVAL: i64 = 5;

/// Reads a request body as `T`, or refuses it.
pub fn body<T: serde::de::DeserializeOwned>(req: &AgentRequest) -> Result<T, Refusal> {
    serde_json::from_slice(&req.body).map_err(|e| Refusal::BadRequest(e.to_string()))
}

async fn progress(ctx: &Ctx, req: &AgentRequest) -> Result<AgentResponse, Failure> {
    let body: ProgressReport = body(req)?;
    let step = body.step();
    // A ramdisk writing an image reports every second or so; a rack of them must not turn
    // into a read and a write per host per second. The same step within a few seconds of the
    // last one the Host cache shows is taken as heard (a stale cache only means more writes).
    let cached = cached_host(ctx, req).ok();
    let heard = cached.filter(|h| !paused_itself(&**h)).is_some_and(|h| {
        authenticate(ctx, req, &h).is_ok_and(|op| {
            op.step.as_deref() == Some(step.as_str())
                && op
                    .last_heard
                    .as_ref()
                    .is_some_and(|t| !older_than(t, PROGRESS_WRITE_INTERVAL, &now()))
        })
    });
    if heard {
        return Ok(AgentResponse::json(&Ack::TAKEN));
    }
    let (api, host) = host_of(ctx, req).await?;
    authenticate(ctx, req, &host)?;
    update_host_status(&api, host.metadata.name.as_deref().unwrap_or_default(), |current| {
        authenticate(ctx, req, current)?;
        let mut status = current.status.clone().unwrap_or_default();
        if let Some(op) = status.operation.as_mut() {
            op.step = Some(step.clone());
            op.bytes = body.bytes.map(ByteCount::from);
            op.last_heard = Some(now());
        }
        Ok::<_, Refusal>(Some(status))
    })
    .await??;
    Ok(AgentResponse::json(&Ack::TAKEN))
}

async fn bootstrap(ctx: &Ctx, req: &AgentRequest) -> Result<AgentResponse, Failure> {
    let (api, host) = host_of(ctx, req).await?;
    let op = authenticate(ctx, req, &host)?;
    if op.kind != OperationKind::Provision {
        return Err(Refusal::WrongOperation(op.kind).into());
    }
    if op.bootstrap_delivered {
        let note = format!(
            "bootstrap data for operation {} was asked for again (from {}) after it was delivered; refused",
            op.id, req.remote
        );
        ctx.event(&host, true, "BootstrapDataReplayed", note).await;
        return Err(Refusal::Replayed.into());
    }
    let bound = match binding(ctx, &host).await? {
        Ok(bound) => bound,
        Err(refusal) => {
            let note = format!("bootstrap data refused: {refusal}");
            ctx.event(&host, true, "BootstrapDataRefused", note).await;
            return Err(refusal.into());
        }
    };
    // The controller hands the data over in the appliance's namespace: the boot plane reads no
    // Secret of the tenant's (see `handoff`).
    let expected = Staged { host: key(&host), operation: op.id.clone() };
    let machine_uid = bound.metadata.uid.unwrap_or_default();
    let Some(data) = handoff::read(&ctx.client, &ctx.namespace, &machine_uid, &expected).await?
    else {
        tracing::info!(host = %key(&host), operation = %op.id, "bootstrap data not handed over yet");
        return Ok(AgentResponse::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "bootstrap data not ready\n",
        ));
    };
    // A token from virtual media is the evidence itself; the segment can add nothing to it.
    if !op.virtual_media
        && let Err(refusal) = confirm_holder(req).await
    {
        let note = format!("bootstrap data refused to {}: {refusal}", req.remote);
        ctx.event(&host, true, "BootstrapDataRefused", note).await;
        return Err(refusal.into());
    }
    // Mark it delivered first: if two requests race, only the one whose write wins gets data.
    update_host_status(&api, host.metadata.name.as_deref().unwrap_or_default(), |current| {
        let current_op = authenticate(ctx, req, current)?;
        if current_op.id != op.id || current_op.bootstrap_delivered {
            return Err(Refusal::Replayed);
        }
        let mut status = current.status.clone().unwrap_or_default();
        if let Some(o) = status.operation.as_mut() {
            o.bootstrap_delivered = true;
        }
        Ok(Some(status))
    })
    .await??;
    tracing::info!(host = %key(&host), operation = %op.id, format = %data.format, "bootstrap data delivered");
    let content_type = if data.format == "ignition" {
        "application/vnd.coreos.ignition+json"
    } else {
        "text/cloud-config"
    };
    Ok(AgentResponse { status: StatusCode::OK, content_type, body: bytes::Bytes::from(data.value) })
}

/// Whether the segment confirms, now, that the request's address is its MAC's: asked as secrets
/// are about to leave, since a table entry naming the MAC can be planted or stale.
pub async fn confirm_holder(req: &AgentRequest) -> Result<(), Refusal> {
    let mac = req.remote_mac.ok_or(Refusal::UnknownAddress)?;
    req.segment.confirm(req.remote, mac).await.map_err(Refusal::Unconfirmed)
}

/// What `host` is bound to, found from the binding alone: the Host's `consumerRef` names a
/// SitebootMachine with the same uid whose `spec.hostRef` names this Host, owned by a Machine
/// that still exists with the uid it names. Nothing a Host says can point elsewhere.
async fn binding(ctx: &Ctx, host: &Host) -> Result<Result<SitebootMachine, Refusal>, kube::Error> {
    let not_bound = |why: &str| Ok(Err(Refusal::NotBound(why.to_owned())));
    let Some(consumer) = &host.spec.consumer_ref else { return not_bound("no consumerRef") };
    if consumer.kind != "SitebootMachine" {
        return not_bound("the consumer is not a SitebootMachine");
    }
    let machines: Api<SitebootMachine> = Api::namespaced(ctx.client.clone(), &consumer.namespace);
    let Some(sbm) = machines.get_opt(&consumer.name).await? else {
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
    let machines: Api<Machine> = Api::namespaced(ctx.client.clone(), &consumer.namespace);
    let Some(machine) = machines.get_opt(&owner.name).await? else {
        return not_bound("its Machine does not exist");
    };
    if machine.metadata.uid.as_deref() != Some(owner.uid.as_str()) {
        return not_bound("its owner Machine was replaced");
    }
    Ok(Ok(sbm))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::crd::HostSpec;

    #[test]
    fn a_token_is_good_only_as_issued_to_its_address_and_in_time() {
        let (token, hash) = token::mint();
        let remote: std::net::Ipv4Addr = "10.0.0.5".parse().unwrap();
        let grant = Grant {
            token_hash: Some(&hash),
            address: Some("10.0.0.5"),
            via_bmc: false,
            fresh: true,
        };
        assert_eq!(check_token(Some(&token), Some(grant), remote), Ok(()));
        let refusal = |token: Option<&str>, grant: Option<Grant<'_>>, remote| {
            check_token(token, grant, remote).unwrap_err()
        };
        assert_eq!(refusal(None, Some(grant), remote), Refusal::NoToken);
        assert_eq!(refusal(Some(&token), None, remote), Refusal::NoOperation);
        assert_eq!(refusal(Some(&hash), Some(grant), remote), Refusal::WrongToken);
        let unissued = Grant { token_hash: None, ..grant };
        assert_eq!(refusal(Some(&token), Some(unissued), remote), Refusal::WrongToken);
        let elsewhere = "10.0.0.6".parse().unwrap();
        assert_eq!(refusal(Some(&token), Some(grant), elsewhere), Refusal::WrongAddress);
        let stale = Grant { fresh: false, ..grant };
        assert_eq!(refusal(Some(&token), Some(stale), remote), Refusal::Expired);
        assert!(needs_new_token(&Refusal::Expired) && !needs_new_token(&Refusal::WrongAddress));
        let from_media = Grant { address: None, via_bmc: true, ..grant };
        assert_eq!(check_token(Some(&token), Some(from_media), elsewhere), Ok(()));
        assert_eq!(refusal(Some(&hash), Some(from_media), elsewhere), Refusal::WrongToken);
        assert_eq!(
            refusal(Some(&token), Some(Grant { fresh: false, ..from_media }), elsewhere),
            Refusal::Expired
        );
    }

    #[test]
    fn the_provision_task_carries_the_served_url_hints_and_meta_data() {
        let mut host = Host::new("node-1", HostSpec::new("52:54:00:00:00:01"));
        host.metadata.namespace = Some("metal".into());
        host.spec.root_device_hints =
            Some(RootDeviceHints { serial: Some("S2".into()), ..Default::default() });
        let image = Image {
            url: "https://images.example/os.img".into(),
            checksum: format!("sha256:{}", "ab".repeat(32)),
            format: None,
            grow_last_partition: true,
        };
        let served = format!("http://10.0.0.1:8080/images/sha256/{}", "ab".repeat(32));
        let hints = host.spec.root_device_hints.clone().unwrap_or_default();
        let meta = MetaData {
            instance_id: "op-7".into(),
            local_hostname: Some("worker-a".into()),
            provider_id: Some(provider_id(&host)),
        };
        let task = provision_task("op-7", &image, (&served, 4096), &hints, meta);
        // Byte for byte what this side sent when it wrote the task as a `json!` value.
        assert_eq!(
            serde_json::to_string(&task).unwrap(),
            json!({
                "action": "provision",
                "operation": "op-7",
                "image": { "url": served, "checksum": image.checksum, "sizeBytes": 4096 },
                "rootDeviceHints": { "serial": "S2" },
                "growLastPartition": true,
                "metaData": {
                    "instance-id": "op-7",
                    "local-hostname": "worker-a",
                    "provider-id": "siteboot://metal/node-1",
                },
            })
            .to_string()
        );
    }

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

    /// The two sides of docs/agent-api.md agree: what this side sends, the agent reads back
    /// from its JSON, and what the agent sends, this side reads and keeps in status. (The JSON
    /// itself is pinned by siteboot_agent_api's tests; status keeps its `Hardware` as is.)
    #[test]
    fn the_agent_reads_the_tasks_and_this_side_reads_its_reports() {
        use siteboot_agent_api as api;
        let mut host = Host::new("node-1", HostSpec::new("52:54:00:00:00:01"));
        host.metadata.namespace = Some("metal".into());
        let image = Image {
            url: "https://images.example/os.img".into(),
            checksum: format!("sha256:{}", "ab".repeat(32)),
            format: None,
            grow_last_partition: false,
        };
        for hints in [
            None,
            Some(RootDeviceHints {
                min_size_bytes: Some(1 << 30),
                wwn: Some("0x5000".into()),
                ..Default::default()
            }),
        ] {
            host.spec.root_device_hints = hints.clone();
            let meta = MetaData {
                instance_id: "op-7".into(),
                local_hostname: Some("worker-a".into()),
                provider_id: Some(provider_id(&host)),
            };
            let task = provision_task(
                "op-7",
                &image,
                ("http://a/i", 4096),
                &hints.clone().unwrap_or_default(),
                meta,
            );
            let json = serde_json::to_string(&task).unwrap();
            let Ok(Task::Provision(read)) = serde_json::from_str::<Task>(&json) else {
                panic!("the agent cannot read {json}");
            };
            assert_eq!(read.image.size_bytes, 4096);
            assert_eq!(read.root_device_hints.wwn, hints.and_then(|h| h.wwn));
            assert_eq!(read.meta_data.provider_id.as_deref(), Some("siteboot://metal/node-1"));
        }
        let json = serde_json::to_string(&deprovision_task("op-8", WipePolicy::Full)).unwrap();
        assert_eq!(
            serde_json::from_str::<Task>(&json).unwrap(),
            Task::Deprovision { operation: "op-8".into(), wipe: api::Wipe::Full }
        );
        let report = ProgressReport {
            step: "writing image".into(),
            bytes: Some(api::Progress { done: 5, total: 9 }),
        };
        let read: ProgressReport =
            serde_json::from_slice(&serde_json::to_vec(&report).unwrap()).unwrap();
        assert_eq!(
            (read.step().as_str(), read.bytes.map(ByteCount::from)),
            ("writing image", Some(ByteCount { done: 5, total: 9 }))
        );
    }
}
