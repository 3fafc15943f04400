//! What a planned [`Step`] writes, as data: the API request (which object, what is written, how
//! the write is guarded against a writer that came first) and what is said once it is done.
//! Time and randomness come in from outside (the expiration the plan computed from `now`, the
//! token's secret half minted by the reconciler), so the plan's unit tests assert the exact
//! objects and patches; the reconciler's one `apply` performs them.

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};

use super::cloud_config::BootstrapData;
use super::plan::{FINALIZER, Step};
use crate::conditions::Reason;
pub use crate::context::{Level, Note};
use crate::context::{finalizer_patch, key};
use crate::crd::capi::CLUSTER_NAME_LABEL;
use crate::crd::{SitebootConfig, SitebootConfigStatus};

/// Where bootstrap tokens live in the workload cluster.
pub const TOKEN_NAMESPACE: &str = "kube-system";
/// The group kubeadm gives node bootstrap tokens; the node-bootstrap RBAC is bound to it.
pub const TOKEN_GROUP: &str = "system:bootstrappers:kubeadm:default-node-token";
/// The type CAPI gives its Secrets (and that the infrastructure provider reads).
const CAPI_SECRET_TYPE: &str = "cluster.x-k8s.io/secret";

/// One write, and what is said once it is done.
#[derive(Debug, Clone, PartialEq)]
pub struct Write {
    pub request: Request,
    pub note: Option<Note>,
}

/// The API request a [`Write`] makes. A guarded request that finds someone else wrote first
/// makes the pass write nothing more (its status was planned from a stale read).
#[derive(Clone, PartialEq)]
pub enum Request {
    /// A merge patch of the config, written only if the config is unchanged since it was read
    /// (its resourceVersion goes with the patch: `patch_unchanged`).
    PatchConfigIfUnchanged(Value),
    /// The config's status, written only if the config is unchanged since it was read
    /// (`patch_status_unchanged`): the pass's status write, done early.
    WriteStatusIfUnchanged(SitebootConfigStatus),
    /// Create this token Secret in the workload cluster. One of its name there already was made
    /// by an earlier pass whose answer was lost: the next pass reads it.
    CreateToken(Secret),
    /// Ensure the node-bootstrap RBAC in the workload cluster (the joining kubelet needs it),
    /// then create this data Secret in the config's namespace. One of its name there already
    /// means another pass wrote first.
    CreateDataSecret(Secret),
    /// A merge patch of the token Secret of this name in the workload cluster, whatever changed
    /// since it was read.
    PatchToken { name: String, patch: Value },
    /// Delete the token Secret of this name from the workload cluster; one gone already is as
    /// good.
    DeleteToken { name: String },
}

/// The Secrets hold the token's secret half: Debug names them only.
impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Request::PatchConfigIfUnchanged(patch) => {
                f.debug_tuple("PatchConfigIfUnchanged").field(patch).finish()
            }
            Request::WriteStatusIfUnchanged(status) => {
                f.debug_tuple("WriteStatusIfUnchanged").field(status).finish()
            }
            Request::CreateToken(secret) => write!(f, "CreateToken({})", key(secret)),
            Request::CreateDataSecret(secret) => write!(f, "CreateDataSecret({})", key(secret)),
            Request::PatchToken { name, patch } => {
                f.debug_struct("PatchToken").field("name", name).field("patch", patch).finish()
            }
            Request::DeleteToken { name } => {
                f.debug_struct("DeleteToken").field("name", name).finish()
            }
        }
    }
}

impl Step<'_> {
    /// The write this step is, for `config` (the config it was planned for), with `status` the
    /// plan's status and `token_secret` a fresh secret half for a token this step creates;
    /// `None` for [`Step::None`].
    pub fn write(
        &self,
        config: &SitebootConfig,
        status: &SitebootConfigStatus,
        token_secret: &str,
    ) -> Option<Write> {
        let (request, note) = match self {
            Step::None => return None,
            Step::AddFinalizer => {
                (Request::PatchConfigIfUnchanged(finalizer_patch(config, FINALIZER, true)), None)
            }
            Step::RemoveFinalizer { abandoned } => {
                let note = abandoned
                    .as_ref()
                    .map(|why| Note::warning(why).event(Reason::TokenAbandoned, why));
                (Request::PatchConfigIfUnchanged(finalizer_patch(config, FINALIZER, false)), note)
            }
            Step::RecordTokenId => {
                let id = status.token_id.as_deref().unwrap_or_default();
                let note = Note::info(format!("recorded the bootstrap token id {id}"));
                (Request::WriteStatusIfUnchanged(status.clone()), Some(note))
            }
            Step::CreateToken { id, expiration } => (
                Request::CreateToken(token(config, id, token_secret, *expiration)),
                Some(Note::info("created the bootstrap token")),
            ),
            Step::WriteDataSecret { data, cluster } => {
                let note = Note::info("wrote the bootstrap data Secret").event(
                    Reason::DataSecretAvailable,
                    format!("Secret {} holds the bootstrap data", config.name_any()),
                );
                (Request::CreateDataSecret(data_secret(config, cluster, data)), Some(note))
            }
            Step::ExtendToken { id, expiration } => {
                let patch =
                    json!({ "data": { "expiration": BASE64.encode(rfc3339(*expiration)) } });
                let note = Note::debug("extended the bootstrap token");
                (Request::PatchToken { name: token_name(id), patch }, Some(note))
            }
            Step::DeleteToken { id } => (
                Request::DeleteToken { name: token_name(id) },
                Some(Note::info("deleted the bootstrap token")),
            ),
        };
        Some(Write { request, note })
    }
}

/// The name of the token Secret of token id `id` (in [`TOKEN_NAMESPACE`]).
pub fn token_name(id: &str) -> String {
    format!("bootstrap-token-{id}")
}

/// The token Secret of `config`: id `id`, secret half `secret`, valid until `expiration` (Unix
/// seconds), for joining nodes as kubeadm's are.
fn token(config: &SitebootConfig, id: &str, secret: &str, expiration: u64) -> Secret {
    let description = format!("siteboot bootstrap token for SitebootConfig {}", key(config));
    serde_json::from_value(json!({
        "metadata": { "name": token_name(id), "namespace": TOKEN_NAMESPACE },
        "type": "bootstrap.kubernetes.io/token",
        "stringData": {
            "description": description,
            "token-id": id,
            "token-secret": secret,
            "expiration": rfc3339(expiration),
            "usage-bootstrap-authentication": "true",
            "usage-bootstrap-signing": "true",
            "auth-extra-groups": TOKEN_GROUP,
        },
    }))
    .expect("a token Secret deserializes")
}

/// The data Secret of `config` in Cluster `cluster`, as the contract wants it: named like the
/// config, controlled by it (so it goes with it), labelled with the cluster.
fn data_secret(config: &SitebootConfig, cluster: &str, data: &BootstrapData) -> Secret {
    let owner = OwnerReference {
        api_version: SitebootConfig::api_version(&()).into_owned(),
        kind: SitebootConfig::kind(&()).into_owned(),
        name: config.name_any(),
        uid: config.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };
    serde_json::from_value(json!({
        "metadata": {
            "name": config.name_any(),
            "namespace": config.namespace(),
            "labels": { CLUSTER_NAME_LABEL: cluster },
            "ownerReferences": [owner],
        },
        "type": CAPI_SECRET_TYPE,
        "stringData": { "value": data.0, "format": "cloud-config" },
    }))
    .expect("a data Secret deserializes")
}

/// Unix seconds as the token Secret's `expiration` wants them.
fn rfc3339(unix: u64) -> String {
    k8s_openapi::jiff::Timestamp::from_second(unix as i64)
        .map(|t| t.to_string())
        .unwrap_or_default()
}
