//! The agent API's endpoints, answered once for both modes over a [`Records`] store (as
//! hickory serves one protocol over many `Authority` backends). What a request must prove and
//! the order of the checks live here; each store says how it reads and writes its own record:
//! Kubernetes mode a Host's status (`controller/src/agent.rs`), standalone mode a file per host
//! (`appliance/src/standalone.rs`).
//!
//! - `GET  v1/task`: what to do: `inspect`, `provision` (with the image), `deprovision` (with
//!   the wipe policy), `reboot` (to fetch a token for a new operation) or `wait`
//! - `POST v1/inspection`: the hardware found (JSON `Hardware`); ends inspection
//! - `GET  v1/bootstrap`: the machine's bootstrap data, once per operation
//! - `POST v1/progress`: `{"step": "..."}`
//! - `POST v1/complete`: `{"ok": bool, "message": "..."}`; ends provisioning or deprovisioning

use std::fmt::Display;
use std::future::Future;

use http::StatusCode;
use siteboot_agent_api::{Ack, Complete, Hardware, MetaData, ProgressReport, Task};
use siteboot_boot::inventory::{AgentRequest, AgentResponse};

use crate::images::{ImageService, Readiness};
use crate::task::{deprovision_task, provision_task};
use crate::{
    ByteCount, Endpoint, Image, OperationKind, Refusal, RootDeviceHints, WipePolicy, body,
    confirm_holder, needs_new_token, refused,
};

/// The operation a request's token opens, as every store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    pub id: String,
    pub kind: OperationKind,
    pub bootstrap_delivered: bool,
    /// Its token never crossed the provisioning segment (the host's BMC put it in virtual
    /// media, or siteboot's SSH login put it in a kexec'ed ramdisk): holding it is the
    /// evidence, and the segment can add nothing to it.
    pub out_of_band: bool,
}

/// Where a provisioning writes, and what the installed OS learns of itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub hints: RootDeviceHints,
    pub meta_data: MetaData,
}

/// Bootstrap data, ready to leave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootstrapData {
    pub content_type: &'static str,
    pub data: bytes::Bytes,
}

/// Why a request gets no answer of its own.
#[derive(Debug)]
pub enum Failure<E> {
    Refused(Refusal),
    /// The store could not be read or written: nothing was promised, the ramdisk asks again.
    Store(E),
}

impl<E> From<Refusal> for Failure<E> {
    fn from(refusal: Refusal) -> Self {
        Failure::Refused(refusal)
    }
}

/// Where one mode keeps its hosts' operations. Every write re-checks the request's token
/// against the record it writes (another request may have changed it since it was read).
pub trait Records: Sync {
    /// A host as read for one request.
    type Host: Send + Sync;
    type Error: Display + Send;

    /// The host `req` is for, read fresh; refused if none is known or it is paused.
    fn host(
        &self,
        req: &AgentRequest,
    ) -> impl Future<Output = Result<Self::Host, Failure<Self::Error>>> + Send;

    /// What logs call `host`.
    fn name(&self, host: &Self::Host) -> String;

    /// The operation `req`'s token opens on `host`.
    fn authenticate(&self, req: &AgentRequest, host: &Self::Host) -> Result<Opened, Refusal>;

    /// Whether a ramdisk without a good token should reboot ([`Task::without_token`]).
    fn boots_again(&self, host: &Self::Host) -> bool;

    /// Whether what is cached already shows that `req` gets "wait, no token" (a rack of idle
    /// ramdisks asks every few seconds): spares the fresh read. A cache a moment behind may
    /// only make a ramdisk wait one more round.
    fn idle(&self, _req: &AgentRequest) -> bool {
        false
    }

    /// How a deprovisioning wipes `host`.
    fn wipe(&self, host: &Self::Host) -> WipePolicy;

    /// The appliance's image cache; `None`: the ramdisk fetches from the image's source.
    fn images(&self) -> Option<&ImageService>;

    /// The image provisioning `op` writes, fixed from the trusted side the first time it is
    /// asked for.
    fn image(
        &self,
        req: &AgentRequest,
        host: &Self::Host,
        op: &Opened,
    ) -> impl Future<Output = Result<Image, Failure<Self::Error>>> + Send;

    /// Where provisioning `op` writes, and the meta-data beside its bootstrap data.
    fn target(
        &self,
        host: &Self::Host,
        op: &Opened,
    ) -> impl Future<Output = Result<Target, Failure<Self::Error>>> + Send;

    /// `op`'s bootstrap data; `None`: not ready yet (the ramdisk asks again).
    fn bootstrap_data(
        &self,
        host: &Self::Host,
        op: &Opened,
    ) -> impl Future<Output = Result<Option<BootstrapData>, Failure<Self::Error>>> + Send;

    /// Records `op`'s bootstrap data as delivered, before it leaves; refused as
    /// [`Refusal::Replayed`] if another request's record came first.
    fn deliver(
        &self,
        req: &AgentRequest,
        host: &Self::Host,
        op: &Opened,
    ) -> impl Future<Output = Result<(), Failure<Self::Error>>> + Send;

    /// Records a progress report (as often as the store can afford).
    fn progress(
        &self,
        req: &AgentRequest,
        step: String,
        bytes: Option<ByteCount>,
    ) -> impl Future<Output = Result<(), Failure<Self::Error>>> + Send;

    /// Ends the operation of kind `kind` that `req`'s token opens.
    fn finish(
        &self,
        req: &AgentRequest,
        kind: OperationKind,
        ok: bool,
        message: String,
        hardware: Option<Hardware>,
    ) -> impl Future<Output = Result<(), Failure<Self::Error>>> + Send;

    /// Tells the operator of a refusal on `host` that is more than a stale ramdisk (a replay,
    /// a holder the segment does not confirm).
    fn report(
        &self,
        host: &Self::Host,
        reason: &'static str,
        note: String,
    ) -> impl Future<Output = ()> + Send;
}

/// Answers one agent request from `records`.
pub async fn answer<R: Records>(records: &R, req: &AgentRequest) -> AgentResponse {
    let Some(endpoint) = Endpoint::of(req) else {
        return AgentResponse::text(StatusCode::NOT_FOUND, "no such agent endpoint\n");
    };
    let result = match endpoint {
        Endpoint::Task => task(records, req).await,
        Endpoint::Inspection => inspection(records, req).await,
        Endpoint::Bootstrap => bootstrap(records, req).await,
        Endpoint::Progress => progress(records, req).await,
        Endpoint::Complete => complete(records, req).await,
    };
    match result {
        Ok(response) => response,
        Err(Failure::Refused(refusal)) => refused(req, &refusal),
        Err(Failure::Store(e)) => {
            tracing::error!(remote = %req.remote, path = %req.path, error = %e, "agent request failed");
            AgentResponse::text(StatusCode::SERVICE_UNAVAILABLE, "try again\n")
        }
    }
}

type Answer<R> = Result<AgentResponse, Failure<<R as Records>::Error>>;

fn taken() -> AgentResponse {
    AgentResponse::json(&Ack::TAKEN)
}

async fn task<R: Records>(records: &R, req: &AgentRequest) -> Answer<R> {
    if records.idle(req) {
        return Ok(AgentResponse::json(&Task::without_token(false)));
    }
    let host = records.host(req).await?;
    let op = match records.authenticate(req, &host) {
        Ok(op) => op,
        // No token, or one from before.
        Err(refusal) if needs_new_token(&refusal) => {
            return Ok(AgentResponse::json(&Task::without_token(records.boots_again(&host))));
        }
        Err(other) => return Err(other.into()),
    };
    let answer = match op.kind {
        OperationKind::Inspect => Task::Inspect { operation: op.id },
        OperationKind::Deprovision => deprovision_task(&op.id, records.wipe(&host)),
        OperationKind::Provision => {
            let image = records.image(req, &host, &op).await?;
            let readiness = match records.images() {
                Some(images) => images.prepare(&op.id, &image).await,
                None => Readiness::Ready { url: image.url.clone(), size: 0 },
            };
            let (url, size) = match readiness {
                Readiness::Ready { url, size } => (url, size),
                Readiness::Fetching { why } => {
                    tracing::info!(host = %records.name(&host), operation = %op.id, %why, "the ramdisk waits for its image");
                    return Ok(AgentResponse::json(&Task::Wait { seconds: 5 }));
                }
                Readiness::Failed { why } => {
                    records.finish(req, OperationKind::Provision, false, why, None).await?;
                    return Ok(AgentResponse::json(&Task::Wait { seconds: 10 }));
                }
            };
            let Target { hints, meta_data } = records.target(&host, &op).await?;
            provision_task(&op.id, &image, (&url, size), &hints, meta_data)
        }
    };
    Ok(AgentResponse::json(&answer))
}

async fn inspection<R: Records>(records: &R, req: &AgentRequest) -> Answer<R> {
    let hardware: Hardware = body(req)?;
    records.finish(req, OperationKind::Inspect, true, String::new(), Some(hardware)).await?;
    Ok(taken())
}

async fn complete<R: Records>(records: &R, req: &AgentRequest) -> Answer<R> {
    let report: Complete = body(req)?;
    let host = records.host(req).await?;
    let op = records.authenticate(req, &host)?;
    // An inspection ends with its report, not with `complete`.
    if op.kind == OperationKind::Inspect {
        return Err(Refusal::WrongOperation(op.kind).into());
    }
    records.finish(req, op.kind, report.ok, report.message(), None).await?;
    Ok(taken())
}

async fn progress<R: Records>(records: &R, req: &AgentRequest) -> Answer<R> {
    let report: ProgressReport = body(req)?;
    records.progress(req, report.step(), report.bytes.map(ByteCount::from)).await?;
    Ok(taken())
}

async fn bootstrap<R: Records>(records: &R, req: &AgentRequest) -> Answer<R> {
    let host = records.host(req).await?;
    let op = records.authenticate(req, &host)?;
    if op.kind != OperationKind::Provision {
        return Err(Refusal::WrongOperation(op.kind).into());
    }
    if op.bootstrap_delivered {
        let note = format!(
            "bootstrap data for operation {} was asked for again (from {}) after it was delivered; refused",
            op.id, req.remote
        );
        records.report(&host, "BootstrapDataReplayed", note).await;
        return Err(Refusal::Replayed.into());
    }
    let Some(data) = records.bootstrap_data(&host, &op).await? else {
        tracing::info!(host = %records.name(&host), operation = %op.id, "bootstrap data not ready yet");
        return Ok(AgentResponse::text(
            StatusCode::SERVICE_UNAVAILABLE,
            "bootstrap data not ready\n",
        ));
    };
    // Asked as the data is about to leave: a table entry naming the MAC can be planted or
    // stale. A token that came out of band is the evidence itself.
    if !op.out_of_band
        && let Err(refusal) = confirm_holder(req).await
    {
        let note = format!("bootstrap data refused to {}: {refusal}", req.remote);
        records.report(&host, "BootstrapDataRefused", note).await;
        return Err(refusal.into());
    }
    // Recorded first: if two requests race, only the one whose record wins gets the data.
    records.deliver(req, &host, &op).await?;
    tracing::info!(host = %records.name(&host), operation = %op.id, content_type = data.content_type, "bootstrap data delivered");
    Ok(AgentResponse { status: StatusCode::OK, content_type: data.content_type, body: data.data })
}
