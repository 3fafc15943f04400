//! The SitebootConfig reconciler: reads what [`plan`] needs (in the management cluster, and the
//! config's token in the workload cluster through its `<cluster>-kubeconfig` Secret), performs
//! the write the step it returns describes ([`plan::Step::write`], given a token secret half
//! minted here) through one `apply`, and writes the status. Killed between any two lines, the
//! next pass reads what was stored and plans the same step or the one after it.
//!
//! The token's secret half exists only in the workload cluster's token Secret and in the data
//! Secret: it is never logged, put in an Event, or written to the config's status.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use rand::Rng;
use serde_json::json;
use siteboot_boot::dhcp::leases::unix_now;

use super::plan::{self, BootstrapToken, DataSecret, Kubeconfig, Plan, Requeue, TokenRead};
use super::write::{Level, Note, Request, TOKEN_GROUP, TOKEN_NAMESPACE, Write, token_name};
use crate::context::{
    Ctx, Error, Reconciled, key, patch_status_unchanged, patch_unchanged, report_refused_in_ready,
    write_status,
};
use crate::crd::SitebootConfig;
use crate::owners::{self, OwnedBy, Owners};
use crate::workload::Workload;

/// After losing a compare-and-swap: long enough for the watch to bring the winner's write.
const LOST_RACE_RETRY: Duration = Duration::from_secs(1);

/// The ClusterRoleBindings a kubeadm cluster has for node bootstrap, by name: the token's group
/// may create CSRs and get them approved; nodes may renew their own client certificates.
pub const NODE_BOOTSTRAP_BINDINGS: [(&str, &str, &str); 3] = [
    ("kubeadm:kubelet-bootstrap", "system:node-bootstrapper", TOKEN_GROUP),
    (
        "kubeadm:node-autoapprove-bootstrap",
        "system:certificates.k8s.io:certificatesigningrequests:nodeclient",
        TOKEN_GROUP,
    ),
    (
        "kubeadm:node-autoapprove-certificate-rotation",
        "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient",
        "system:nodes",
    ),
];

pub async fn run(ctx: Arc<Ctx>, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let client = ctx.client.clone();
    let controller =
        Controller::new(Api::<SitebootConfig>::all(client.clone()), watcher::Config::default());
    let (controller, owners) = Owners::watch(&client, controller, |machine| {
        let namespace = machine.namespace().unwrap_or_default();
        machine
            .spec
            .bootstrap
            .config_ref
            .as_ref()
            .filter(|r| r.kind == "SitebootConfig" && r.api_group == SitebootConfig::group(&()))
            .map(|r| ObjectRef::new(&r.name).within(&namespace))
    });
    let owners = Arc::new(owners);
    ctx.drive(controller, shutdown, move |config, ctx| {
        let owners = owners.clone();
        async move { pass(&config, &ctx, &owners).await }
    })
    .await;
}

impl Reconciled for SitebootConfig {
    /// In the Ready condition, which Cluster API shows on the Machine (best effort: this write
    /// may be refused too).
    async fn report_refused(&self, ctx: &Ctx, error: &Error) {
        let conditions = self.status.clone().unwrap_or_default().conditions;
        report_refused_in_ready(ctx, self, &conditions, error).await
    }
}

/// Where bootstrap tokens live in the workload cluster.
fn tokens(w: &Workload) -> Api<Secret> {
    Api::namespaced(w.client.clone(), TOKEN_NAMESPACE)
}

async fn pass(config: &SitebootConfig, ctx: &Ctx, owners: &Owners) -> Result<Action, Error> {
    let namespace = config.namespace().unwrap_or_default();
    let Some(OwnedBy { machine: owner, cluster }) = owners.of(config) else {
        return Ok(Action::requeue(owners::NOT_LISTED_RETRY));
    };
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    let data_secret = match secrets.get_opt(&config.name_any()).await? {
        None => DataSecret::Absent,
        Some(s) if controlled_by(&s, config) => DataSecret::Ours,
        Some(_) => DataSecret::Foreign,
    };
    let workload = match &cluster {
        Some(cluster) => {
            ctx.workloads.of_cluster(&ctx.client, &namespace, &cluster.name_any()).await?
        }
        None => None,
    };
    let token_id = config.status.as_ref().and_then(|s| s.token_id.as_deref());
    let token = match (&workload, token_id) {
        (Some(Ok(w)), Some(id)) => Some(read_token(w, id).await?),
        _ => None,
    };
    let kubeconfig = match &workload {
        None => Kubeconfig::Missing,
        Some(Err(why)) => Kubeconfig::Invalid(why.clone()),
        Some(Ok(w)) => Kubeconfig::Valid {
            target: &w.target,
            token: match (&token, token_id) {
                (Some(TokenFound::Present(t)), _) => TokenRead::Present(t),
                (Some(TokenFound::Absent), Some(id)) => TokenRead::Absent(id),
                (Some(TokenFound::Unreachable(why)), _) => TokenRead::Unreachable(why.clone()),
                (Some(TokenFound::Absent), None) | (None, _) => TokenRead::NoId,
            },
        },
    };
    let seen = plan::Observed {
        config,
        owner: owner.as_deref(),
        cluster: cluster.as_deref(),
        kubeconfig,
        data_secret,
        now: unix_now(),
        new_token_id: &token_part(6),
    };
    let Plan { step, status, requeue } = plan::plan(&seen);
    let api = configs_api(ctx, config);
    let workload = workload.as_ref().and_then(|w| w.as_ref().ok());
    let done = match step.write(config, &status, &token_part(16)) {
        Some(write) => apply(config, ctx, &api, workload, write).await?,
        None => Done::Yes,
    };
    let requeue = match done {
        Done::Yes => requeue,
        Done::StatusWritten => return Ok(requeue.into()),
        // The read was stale: a status planned from it would undo what was written since (a
        // token id recorded by the pass before, whose token would then never be extended).
        Done::LostRace => return Ok(Requeue::After(LOST_RACE_RETRY).into()),
    };
    write_status(&api, config, config.status.as_ref(), &status).await?;
    Ok(requeue.into())
}

fn configs_api(ctx: &Ctx, config: &SitebootConfig) -> Api<SitebootConfig> {
    Api::namespaced(ctx.client.clone(), &config.namespace().unwrap_or_default())
}

fn controlled_by(secret: &Secret, config: &SitebootConfig) -> bool {
    let uid = config.uid();
    secret
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && Some(&o.uid) == uid.as_ref())
}

/// What became of the token Secret `bootstrap-token-<id>`.
enum TokenFound {
    Present(BootstrapToken),
    Absent,
    Unreachable(String),
}

/// An API server that does not answer is a finding here, not an error (deletion must go on
/// without it); a refusal is an error.
async fn read_token(w: &Workload, id: &str) -> Result<TokenFound, Error> {
    match tokens(w).get_opt(&token_name(id)).await {
        Ok(Some(secret)) => Ok(TokenFound::Present(parse_token(id, &secret))),
        Ok(None) => Ok(TokenFound::Absent),
        Err(e) if unreachable(&e) => Ok(TokenFound::Unreachable(e.to_string())),
        Err(e) => Err(w.error(e)),
    }
}

/// Connection failures, timeouts and 5xx: the workload cluster is not answering.
fn unreachable(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(status) => status.code >= 500,
        _ => true,
    }
}

fn parse_token(id: &str, secret: &Secret) -> BootstrapToken {
    let field = |name: &str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get(name))
            .and_then(|v| String::from_utf8(v.0.clone()).ok())
    };
    BootstrapToken {
        id: id.to_owned(),
        secret: field("token-secret").unwrap_or_default(),
        expiration: field("expiration")
            .and_then(|e| e.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .and_then(|t| u64::try_from(t.as_second()).ok()),
    }
}

/// `len` characters of `[a-z0-9]`, as bootstrap token ids (6) and secrets (16) are.
fn token_part(len: usize) -> String {
    const ALPHABET: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut rng = rand::rng();
    (0..len).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
}

enum Done {
    Yes,
    /// The step wrote the status itself.
    StatusWritten,
    /// A compare-and-swap found the object changed since it was read.
    LostRace,
}

/// Performs the write a step describes, then says what it did (nothing if it was done already).
async fn apply(
    config: &SitebootConfig,
    ctx: &Ctx,
    api: &Api<SitebootConfig>,
    workload: Option<&Workload>,
    write: Write,
) -> Result<Done, Error> {
    let Write { request, note } = write;
    let workload = || workload.expect("workload writes are planned only with a usable kubeconfig");
    let (object, done) = match request {
        Request::PatchConfigIfUnchanged(patch) => {
            let written = patch_unchanged(api, config, patch).await?;
            let done = if written.is_some() { Done::Yes } else { Done::LostRace };
            (format!("SitebootConfig {}", key(config)), done)
        }
        Request::WriteStatusIfUnchanged(status) => {
            let written = patch_status_unchanged(api, config, &status).await?;
            let done = if written.is_some() { Done::StatusWritten } else { Done::LostRace };
            (format!("SitebootConfig {}", key(config)), done)
        }
        Request::CreateToken(token) => {
            let w = workload();
            match tokens(w).create(&PostParams::default(), &token).await {
                Ok(_) => (token_object(w, &token.name_any()), Done::Yes),
                // Made by an earlier pass whose answer was lost: the next pass reads it.
                Err(kube::Error::Api(e)) if e.code == 409 => return Ok(Done::Yes),
                Err(e) => return Err(w.error(e)),
            }
        }
        Request::CreateDataSecret(secret) => {
            ensure_node_bootstrap_rbac(workload()).await?;
            let secrets: Api<Secret> =
                Api::namespaced(ctx.client.clone(), &config.namespace().unwrap_or_default());
            let done = match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => Done::Yes,
                Err(kube::Error::Api(e)) if e.code == 409 => Done::LostRace,
                Err(e) => return Err(e.into()),
            };
            (format!("Secret {}", key(&secret)), done)
        }
        Request::PatchToken { name, patch } => {
            let w = workload();
            tokens(w)
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| w.error(e))?;
            (token_object(w, &name), Done::Yes)
        }
        Request::DeleteToken { name } => {
            let w = workload();
            match tokens(w).delete(&name, &DeleteParams::default()).await {
                Ok(_) => (token_object(w, &name), Done::Yes),
                Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Done::Yes),
                Err(e) => return Err(w.error(e)),
            }
        }
    };
    if matches!(done, Done::LostRace) {
        tracing::debug!(config = %key(config), object, "lost the race: it changed since it was read");
        return Ok(done);
    }
    if let Some(Note { level, log, event }) = note {
        match level {
            Level::Debug => tracing::debug!(config = %key(config), object, "{log}"),
            Level::Info => tracing::info!(config = %key(config), object, "{log}"),
            Level::Warning => tracing::warn!(config = %key(config), object, "{log}"),
        }
        if let Some((reason, message)) = event {
            ctx.event(config, level == Level::Warning, &reason, message).await;
        }
    }
    Ok(done)
}

/// How logs name the token Secret `name` of workload cluster `w`.
fn token_object(w: &Workload, name: &str) -> String {
    format!("Secret {TOKEN_NAMESPACE}/{name} of cluster {}", w.cluster)
}

/// The ClusterRoleBindings of [`NODE_BOOTSTRAP_BINDINGS`], created where missing (a kubeadm
/// cluster has them already; existing ones are left as they are).
async fn ensure_node_bootstrap_rbac(w: &Workload) -> Result<(), Error> {
    let api: Api<ClusterRoleBinding> = Api::all(w.client.clone());
    for (name, role, group) in NODE_BOOTSTRAP_BINDINGS {
        let binding: ClusterRoleBinding = serde_json::from_value(json!({
            "metadata": { "name": name },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role },
            "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": group }],
        }))
        .expect("a ClusterRoleBinding deserializes");
        match api.create(&PostParams::default(), &binding).await {
            Ok(_) => {
                tracing::info!(cluster = %w.cluster, binding = name, "created node-bootstrap RBAC")
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(w.error(e)),
        }
    }
    Ok(())
}
