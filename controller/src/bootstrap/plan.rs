//! What a SitebootConfig needs next, as a pure function of what was read: the config, its
//! Machine and Cluster, the workload cluster's kubeconfig and the config's token there, and the
//! data Secret. [`plan`] returns the one step to take, the status to report, and when to look
//! again; [`Step::write`] says what the step writes (the objects, patches and guards); the
//! reconciler performs it.
//!
//! The token's life: its id is recorded in `status.tokenId` (a compare-and-swap on the
//! config's resourceVersion) before the token exists, so two passes, or a pass on a stale copy,
//! can never mint two tokens for one config; then the token Secret is created in the workload
//! cluster; then the data Secret is written with it. While the Machine has no Node the token is
//! extended; once it has one, or the config goes, the token is deleted.

use std::time::Duration;

use kube::ResourceExt;

use super::cloud_config::{self, BootstrapData, ClusterDns, JoinData};
use crate::conditions::{DATA_SECRET_AVAILABLE, READY, Reason, check_paused};
use crate::crd::capi::{ApiEndpoint, CONTROL_PLANE_LABEL, Cluster, Machine};
use crate::crd::{BootstrapInitialization, SitebootConfig, SitebootConfigStatus, set_condition};

pub const FINALIZER: &str = "sitebootconfig.bootstrap.cluster.x-k8s.io";
/// The token lifetime when the spec names none (as kubeadm's and CABPK's).
pub const DEFAULT_TOKEN_TTL: Duration = Duration::from_secs(15 * 60);
/// How long a deleted config waits for an unreachable workload cluster before it lets go of
/// its token (which then expires on its own, within its TTL).
pub const DELETE_GRACE: Duration = Duration::from_secs(120);
/// How often to try an unreachable workload cluster again.
pub const UNREACHABLE_RETRY: Duration = Duration::from_secs(15);
/// How often to look for a kubeconfig Secret that does not exist yet (Secrets are not watched).
const KUBECONFIG_RETRY: Duration = Duration::from_secs(30);
const INVALID_KUBECONFIG_RETRY: Duration = Duration::from_secs(300);

pub use crate::workload::JoinTarget;

/// A bootstrap token as read from the workload cluster. Debug never shows the secret half.
#[derive(Clone, PartialEq, Eq)]
pub struct BootstrapToken {
    pub id: String,
    pub secret: String,
    /// Unix seconds; None if the Secret has no (readable) expiration.
    pub expiration: Option<u64>,
}

impl std::fmt::Debug for BootstrapToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapToken")
            .field("id", &self.id)
            .field("expiration", &self.expiration)
            .finish_non_exhaustive()
    }
}

/// The `<cluster>-kubeconfig` Secret.
#[derive(Debug, Clone, PartialEq)]
pub enum Kubeconfig<'a> {
    /// No Cluster, or no Secret yet.
    Missing,
    /// It exists but cannot be used: why.
    Invalid(String),
    Valid {
        target: &'a JoinTarget,
        token: TokenRead<'a>,
    },
}

/// The config's token in the workload cluster. Read whenever an id is recorded, paused or not:
/// a read changes nothing.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenRead<'a> {
    /// No token id is recorded in the status: nothing to read.
    NoId,
    /// The workload cluster's API server did not answer: why.
    Unreachable(String),
    /// The recorded id has no token Secret.
    Absent(&'a str),
    Present(&'a BootstrapToken),
}

/// The Secret named like the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataSecret {
    Absent,
    /// Controlled by this config.
    Ours,
    /// Someone else's: never overwritten, never handed to the Machine.
    Foreign,
}

/// What one pass read.
pub struct Observed<'a> {
    pub config: &'a SitebootConfig,
    /// The Cluster API Machine that owns it.
    pub owner: Option<&'a Machine>,
    pub cluster: Option<&'a Cluster>,
    pub kubeconfig: Kubeconfig<'a>,
    pub data_secret: DataSecret,
    /// Seconds since the Unix epoch.
    pub now: u64,
    /// A fresh token id, minted by the reconciler for this pass: the one [`Step::RecordTokenId`]
    /// records if the config has none.
    pub new_token_id: &'a str,
}

/// The one write a pass makes (besides the status).
#[derive(Debug, Clone, PartialEq)]
pub enum Step<'a> {
    None,
    AddFinalizer,
    /// Record the plan's status, which names the pass's fresh token id in `status.tokenId`, only
    /// if the config is unchanged since read: a pass on a stale copy (which would not see an
    /// id already recorded) loses instead of minting a second token.
    RecordTokenId,
    /// Create the token Secret `kube-system/bootstrap-token-<id>` (a fresh secret half).
    CreateToken {
        id: &'a str,
        expiration: u64,
    },
    /// Ensure the node-bootstrap RBAC in the workload cluster, then write the data Secret,
    /// labelled with the Cluster's name.
    WriteDataSecret {
        data: BootstrapData,
        cluster: String,
    },
    ExtendToken {
        id: &'a str,
        expiration: u64,
    },
    DeleteToken {
        id: &'a str,
    },
    /// Drop the finalizer; `abandoned` says why the token could not be deleted (a Warning).
    RemoveFinalizer {
        abandoned: Option<String>,
    },
}

pub use crate::context::Requeue;

#[derive(Debug, Clone, PartialEq)]
pub struct Plan<'a> {
    pub step: Step<'a>,
    pub status: SitebootConfigStatus,
    pub requeue: Requeue,
}

pub fn plan<'a>(seen: &Observed<'a>) -> Plan<'a> {
    let mut report = Report {
        status: seen.config.status.clone().unwrap_or_default(),
        generation: seen.config.metadata.generation,
    };
    let (step, requeue) = decide(seen, &mut report);
    Plan { step, status: report.status, requeue }
}

/// The token lifetime this config asks for.
pub fn token_ttl(config: &SitebootConfig) -> Duration {
    config.spec.token_ttl_seconds.map_or(DEFAULT_TOKEN_TTL, |s| Duration::from_secs(s.into()))
}

struct Report {
    status: SitebootConfigStatus,
    generation: Option<i64>,
}

impl Report {
    fn ready(&mut self, ready: bool, reason: Reason, message: &str) {
        let reason = reason.to_string();
        set_condition(&mut self.status.conditions, READY, ready, &reason, message, self.generation);
    }

    /// DataSecretAvailable, and Ready with it.
    fn data(&mut self, available: bool, reason: Reason, message: &str) {
        let r = reason.to_string();
        let conditions = &mut self.status.conditions;
        set_condition(conditions, DATA_SECRET_AVAILABLE, available, &r, message, self.generation);
        self.ready(available, reason, message);
    }

    fn wait(
        &mut self,
        reason: Reason,
        message: &str,
        requeue: Requeue,
    ) -> (Step<'static>, Requeue) {
        self.data(false, reason, message);
        (Step::None, requeue)
    }
}

fn decide<'a>(seen: &Observed<'a>, report: &mut Report) -> (Step<'a>, Requeue) {
    let config = seen.config;
    if check_paused(seen.cluster, config, &mut report.status.conditions) {
        return (Step::None, Requeue::OnChange);
    }
    if config.metadata.deletion_timestamp.is_some() {
        return delete(seen);
    }
    if !config.finalizers().iter().any(|f| f == FINALIZER) {
        return (Step::AddFinalizer, Requeue::Now);
    }
    if seen.data_secret == DataSecret::Ours {
        return available(seen, report);
    }
    if seen.data_secret == DataSecret::Foreign {
        return report.wait(
            Reason::DataSecretConflict,
            &format!(
                "Secret {} exists and is not this config's: delete or rename it",
                config.name_any()
            ),
            Requeue::After(INVALID_KUBECONFIG_RETRY),
        );
    }
    let Some(machine) = seen.owner else {
        return report.wait(
            Reason::WaitingForMachine,
            "no owner Machine yet (Cluster API sets it)",
            Requeue::OnChange,
        );
    };
    if machine.labels().contains_key(CONTROL_PLANE_LABEL) {
        return report.wait(
            Reason::ControlPlaneMachineNotSupported,
            "this provider joins workers only; control-plane Machines need a control plane provider",
            Requeue::OnChange,
        );
    }
    if let Err(e) = cloud_config::validate(&config.spec) {
        return report.wait(Reason::InvalidSpec, &e.to_string(), Requeue::OnChange);
    }
    let Some(cluster) = seen.cluster else {
        return report.wait(
            Reason::WaitingForCluster,
            "the Machine's Cluster does not exist",
            Requeue::OnChange,
        );
    };
    let dns = match ClusterDns::resolve(&config.spec, cluster.spec.cluster_network.as_ref()) {
        Ok(dns) => dns,
        Err(e) => return report.wait(Reason::InvalidSpec, &e.to_string(), Requeue::OnChange),
    };
    // Joins need a control plane that answers and has its CA and RBAC: CAPI sets this field
    // once the control plane provider reports it (it never goes back), exactly what CABPK
    // waits for before any worker join.
    if !cluster.control_plane_initialized() {
        return report.wait(
            Reason::WaitingForControlPlaneInitialized,
            "the Cluster's status.initialization.controlPlaneInitialized is not true yet",
            Requeue::OnChange,
        );
    }
    // Hosts join where the Cluster says its control plane is (as CABPK's joins do), not where
    // the management cluster reaches it through the kubeconfig Secret: a hosted control plane's
    // kubeconfig may well name an address only the management cluster can reach.
    let Some(server) =
        cluster.spec.control_plane_endpoint.as_ref().and_then(ApiEndpoint::https_url)
    else {
        return report.wait(
            Reason::WaitingForControlPlaneEndpoint,
            "the Cluster's spec.controlPlaneEndpoint is not set yet",
            Requeue::OnChange,
        );
    };
    let (target, token) = match &seen.kubeconfig {
        Kubeconfig::Missing => {
            return report.wait(
                Reason::WaitingForKubeconfig,
                &format!("Secret {}-kubeconfig does not exist yet", cluster.name_any()),
                Requeue::After(KUBECONFIG_RETRY),
            );
        }
        Kubeconfig::Invalid(why) => {
            return report.wait(
                Reason::InvalidKubeconfig,
                &format!("Secret {}-kubeconfig: {why}", cluster.name_any()),
                Requeue::After(INVALID_KUBECONFIG_RETRY),
            );
        }
        Kubeconfig::Valid { target, token } => (*target, token),
    };
    match token {
        TokenRead::NoId => {
            report.data(false, Reason::CreatingToken, "recording the bootstrap token's id");
            report.status.token_id = Some(seen.new_token_id.to_owned());
            (Step::RecordTokenId, Requeue::Now)
        }
        TokenRead::Unreachable(why) => report.wait(
            Reason::WorkloadUnreachable,
            &format!("the workload cluster's API server: {why}"),
            Requeue::After(UNREACHABLE_RETRY),
        ),
        TokenRead::Absent(id) => {
            report.data(false, Reason::CreatingToken, &format!("creating bootstrap token {id}"));
            let expiration = seen.now + token_ttl(config).as_secs();
            (Step::CreateToken { id, expiration }, Requeue::Now)
        }
        // A token Secret of our name without its secret half (written by hand, or damaged)
        // cannot join anyone: replace it (the next passes create it again under the same id).
        TokenRead::Present(token) if token.secret.is_empty() => {
            report.data(
                false,
                Reason::CreatingToken,
                &format!("replacing malformed bootstrap token {}", token.id),
            );
            (Step::DeleteToken { id: &token.id }, Requeue::Now)
        }
        TokenRead::Present(token) => {
            let join = JoinData {
                server: &server,
                ca_pem: &target.ca_pem,
                token_id: &token.id,
                token_secret: &token.secret,
                dns: &dns,
            };
            match cloud_config::render(&config.spec, &join) {
                Ok(data) => {
                    (Step::WriteDataSecret { data, cluster: cluster.name_any() }, Requeue::Now)
                }
                Err(e) => report.wait(Reason::InvalidSpec, &e.to_string(), Requeue::OnChange),
            }
        }
    }
}

/// The data Secret exists: report it; keep the token alive until the Machine has its Node,
/// then delete it.
fn available<'a>(seen: &Observed<'a>, report: &mut Report) -> (Step<'a>, Requeue) {
    let config = seen.config;
    report.status.data_secret_name = Some(config.name_any());
    report.status.initialization =
        Some(BootstrapInitialization { data_secret_created: Some(true) });
    report.data(true, Reason::DataSecretAvailable, "");
    let joined =
        seen.owner.is_some_and(|m| m.status.as_ref().is_some_and(|s| s.node_ref.is_some()));
    let token = match &seen.kubeconfig {
        Kubeconfig::Valid { token, .. } => token,
        // The data is out; the token's upkeep waits for a usable kubeconfig.
        Kubeconfig::Missing | Kubeconfig::Invalid(_) => {
            return (Step::None, Requeue::After(KUBECONFIG_RETRY));
        }
    };
    let ttl = token_ttl(config);
    match token {
        // No recorded id (status lost in a move or restore): the token, if any, expires on its
        // own; nothing here may mint another.
        TokenRead::NoId => (Step::None, Requeue::OnChange),
        TokenRead::Unreachable(why) => {
            if !joined {
                report.ready(
                    false,
                    Reason::WorkloadUnreachable,
                    &format!("cannot keep the bootstrap token alive: {why}"),
                );
            }
            (Step::None, Requeue::After(UNREACHABLE_RETRY))
        }
        TokenRead::Present(token) if joined => (Step::DeleteToken { id: &token.id }, Requeue::Now),
        TokenRead::Absent(_) if joined => (Step::None, Requeue::OnChange),
        TokenRead::Absent(id) => {
            report.ready(
                false,
                Reason::TokenMissing,
                &format!(
                    "bootstrap token {id} is gone from the workload cluster and the Machine has no Node yet: the host cannot join with this data; delete the Machine to get new data"
                ),
            );
            (Step::None, Requeue::OnChange)
        }
        TokenRead::Present(token) => {
            // As CABPK: extend once a sixth of the lifetime has passed, look every third, so a
            // token never comes within half its lifetime of expiring while the host may boot.
            let refresh_after = seen.now + ttl.as_secs() * 5 / 6;
            if token.expiration.is_none_or(|e| e < refresh_after) {
                let expiration = seen.now + ttl.as_secs();
                return (Step::ExtendToken { id: &token.id, expiration }, Requeue::After(ttl / 3));
            }
            (Step::None, Requeue::After(ttl / 3))
        }
    }
}

/// The config is being deleted: delete its token, then let go; an unreachable workload
/// cluster holds the config back for [`DELETE_GRACE`] at most.
fn delete<'a>(seen: &Observed<'a>) -> (Step<'a>, Requeue) {
    let config = seen.config;
    if !config.finalizers().iter().any(|f| f == FINALIZER) {
        return (Step::None, Requeue::OnChange);
    }
    let id = config.status.as_ref().and_then(|s| s.token_id.as_deref()).unwrap_or_default();
    let abandon = |why: String| {
        let abandoned = Some(format!(
            "bootstrap token {id} was not deleted from the workload cluster ({why}); it expires on its own"
        ));
        (Step::RemoveFinalizer { abandoned }, Requeue::OnChange)
    };
    let token = match &seen.kubeconfig {
        Kubeconfig::Valid { token, .. } => token,
        _ if id.is_empty() => {
            return (Step::RemoveFinalizer { abandoned: None }, Requeue::OnChange);
        }
        Kubeconfig::Missing => return abandon("no kubeconfig Secret".into()),
        Kubeconfig::Invalid(why) => return abandon(format!("invalid kubeconfig Secret: {why}")),
    };
    match token {
        TokenRead::Present(token) => (Step::DeleteToken { id: &token.id }, Requeue::Now),
        TokenRead::NoId | TokenRead::Absent(_) => {
            (Step::RemoveFinalizer { abandoned: None }, Requeue::OnChange)
        }
        TokenRead::Unreachable(why) => {
            let since = config
                .metadata
                .deletion_timestamp
                .as_ref()
                .map_or(seen.now, |t| u64::try_from(t.0.as_second()).unwrap_or(0));
            if seen.now.saturating_sub(since) < DELETE_GRACE.as_secs() {
                (Step::None, Requeue::After(UNREACHABLE_RETRY))
            } else {
                abandon(format!("unreachable for {} s: {why}", DELETE_GRACE.as_secs()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
    use serde_json::json;

    use super::*;
    use crate::bootstrap::write::{Level, Note, Request, Write};
    use crate::conditions::PAUSED;
    use crate::crd::capi::{
        ClusterInitialization, ClusterSpec, ClusterStatus, MachineStatus, NodeRef,
        PAUSED_ANNOTATION,
    };
    use crate::crd::{SitebootConfigSpec, condition};

    const NOW: u64 = 1_000_000;
    const TTL: u64 = 900;

    fn config() -> SitebootConfig {
        let mut c = SitebootConfig::new("worker-0", SitebootConfigSpec::default());
        c.metadata.namespace = Some("ns".into());
        c.metadata.uid = Some("config-uid".into());
        c.metadata.finalizers = Some(vec![FINALIZER.into()]);
        c.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "cluster.x-k8s.io/v1beta2".into(),
            kind: "Machine".into(),
            name: "machine".into(),
            uid: "machine-uid".into(),
            controller: Some(true),
            ..Default::default()
        }]);
        c
    }

    fn with_token_id(mut c: SitebootConfig) -> SitebootConfig {
        c.status.get_or_insert_with(Default::default).token_id = Some("abcdef".into());
        c
    }

    const SERVER: &str = "https://10.0.0.1:6443";

    fn cluster() -> Cluster {
        let endpoint = ApiEndpoint { host: "10.0.0.1".into(), port: 6443 };
        let spec = ClusterSpec { control_plane_endpoint: Some(endpoint), ..Default::default() };
        let mut c = Cluster::new("c", spec);
        c.status = Some(ClusterStatus {
            initialization: Some(ClusterInitialization {
                infrastructure_provisioned: Some(true),
                control_plane_initialized: Some(true),
            }),
        });
        c
    }

    fn target() -> JoinTarget {
        JoinTarget {
            ca_pem: "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".into(),
        }
    }

    fn token(expiration: u64) -> BootstrapToken {
        BootstrapToken {
            id: "abcdef".into(),
            secret: "0123456789abcdef".into(),
            expiration: Some(expiration),
        }
    }

    /// What a pass would read; each test changes what it is about.
    struct World {
        config: SitebootConfig,
        machine: Option<Machine>,
        cluster: Option<Cluster>,
        kubeconfig: KubeconfigState,
        token: TokenState,
        data_secret: DataSecret,
        target: JoinTarget,
    }

    enum KubeconfigState {
        Missing,
        Invalid,
        Valid,
    }

    enum TokenState {
        Unreachable,
        Absent,
        Present(BootstrapToken),
    }

    impl World {
        fn new(config: SitebootConfig) -> Self {
            World {
                config,
                machine: Some(Machine::new("machine", Default::default())),
                cluster: Some(cluster()),
                kubeconfig: KubeconfigState::Valid,
                token: TokenState::Absent,
                data_secret: DataSecret::Absent,
                target: target(),
            }
        }

        fn joined(mut self) -> Self {
            let machine = self.machine.as_mut().unwrap();
            machine.status = Some(MachineStatus {
                node_ref: Some(NodeRef { name: "node-0".into() }),
                ..Default::default()
            });
            self
        }

        fn plan(&self) -> Plan<'_> {
            let id = self.config.status.as_ref().and_then(|s| s.token_id.as_deref());
            let token = match (id, &self.token) {
                (None, _) => TokenRead::NoId,
                (Some(_), TokenState::Unreachable) => TokenRead::Unreachable("timed out".into()),
                (Some(id), TokenState::Absent) => TokenRead::Absent(id),
                (Some(_), TokenState::Present(t)) => TokenRead::Present(t),
            };
            let kubeconfig = match self.kubeconfig {
                KubeconfigState::Missing => Kubeconfig::Missing,
                KubeconfigState::Invalid => Kubeconfig::Invalid("it has no key `value`".into()),
                KubeconfigState::Valid => Kubeconfig::Valid { target: &self.target, token },
            };
            plan(&Observed {
                config: &self.config,
                owner: self.machine.as_ref(),
                cluster: self.cluster.as_ref(),
                kubeconfig,
                data_secret: self.data_secret,
                now: NOW,
                new_token_id: "ghijkl",
            })
        }
    }

    /// The API server the data's bootstrap kubeconfig names.
    fn join_server(data: &BootstrapData) -> String {
        use base64::Engine;
        let doc: serde_json::Value = serde_norway::from_str(&data.0).unwrap();
        let files = doc["write_files"].as_array().unwrap();
        let file = files.iter().find(|f| f["path"] == cloud_config::BOOTSTRAP_KUBECONFIG).unwrap();
        let text = base64::engine::general_purpose::STANDARD
            .decode(file["content"].as_str().unwrap())
            .unwrap();
        let kubeconfig: serde_json::Value = serde_norway::from_slice(&text).unwrap();
        kubeconfig["clusters"][0]["cluster"]["server"].as_str().unwrap().to_owned()
    }

    #[test]
    fn the_endpoint_is_a_url_only_with_a_host_and_a_port() {
        let url = |host: &str, port| ApiEndpoint { host: host.into(), port }.https_url();
        assert_eq!(url("cp.example", 6443).as_deref(), Some("https://cp.example:6443"));
        assert_eq!(url("fd00::1", 443).as_deref(), Some("https://[fd00::1]:443"));
        assert_eq!(url("", 6443), None);
        assert_eq!(url("cp.example", 0), None);
        assert_eq!(url("cp.example", 70000), None);
    }

    fn reason(plan: &Plan, type_: &str) -> (String, String) {
        let c = condition(&plan.status.conditions, type_).unwrap_or_else(|| panic!("no {type_}"));
        (c.status.clone(), c.reason.clone())
    }

    fn waits(plan: &Plan, why: Reason) {
        assert_eq!(plan.step, Step::None, "{plan:?}");
        let expected = ("False".to_owned(), why.to_string());
        assert_eq!(reason(plan, DATA_SECRET_AVAILABLE), expected);
        assert_eq!(reason(plan, READY), expected);
    }

    fn deleting(mut c: SitebootConfig, seconds_ago: u64) -> SitebootConfig {
        let at = k8s_openapi::jiff::Timestamp::from_second((NOW - seconds_ago) as i64).unwrap();
        c.metadata.deletion_timestamp = Some(Time(at));
        c
    }

    #[test]
    fn waits_for_finalizer_machine_cluster_control_plane_and_kubeconfig_in_order() {
        let mut w = World::new(config());
        w.config.metadata.finalizers = None;
        assert_eq!((w.plan().step, w.plan().requeue), (Step::AddFinalizer, Requeue::Now));
        w.config = config();
        w.machine = None;
        waits(&w.plan(), Reason::WaitingForMachine);
        w.machine = Some(Machine::new("machine", Default::default()));
        w.cluster = None;
        waits(&w.plan(), Reason::WaitingForCluster);
        let mut initializing = cluster();
        initializing
            .status
            .as_mut()
            .unwrap()
            .initialization
            .as_mut()
            .unwrap()
            .control_plane_initialized = None;
        w.cluster = Some(initializing);
        let p = w.plan();
        waits(&p, Reason::WaitingForControlPlaneInitialized);
        assert_eq!(p.requeue, Requeue::OnChange, "the Cluster watch wakes it");
        let mut no_endpoint = cluster();
        no_endpoint.spec.control_plane_endpoint = Some(ApiEndpoint { host: "".into(), port: 6443 });
        w.cluster = Some(no_endpoint);
        let p = w.plan();
        waits(&p, Reason::WaitingForControlPlaneEndpoint);
        assert_eq!(p.requeue, Requeue::OnChange, "the Cluster watch wakes it");
        w.cluster = Some(cluster());
        w.kubeconfig = KubeconfigState::Missing;
        let p = w.plan();
        waits(&p, Reason::WaitingForKubeconfig);
        assert_eq!(p.requeue, Requeue::After(KUBECONFIG_RETRY), "Secrets are not watched");
        w.kubeconfig = KubeconfigState::Invalid;
        waits(&w.plan(), Reason::InvalidKubeconfig);
    }

    #[test]
    fn what_this_provider_cannot_do_is_said_before_any_token_exists() {
        let mut w = World::new(config());
        let mut control_plane = Machine::new("machine", Default::default());
        control_plane.metadata.labels =
            Some(BTreeMap::from([(CONTROL_PLANE_LABEL.to_owned(), String::new())]));
        w.machine = Some(control_plane);
        waits(&w.plan(), Reason::ControlPlaneMachineNotSupported);
        w.machine = Some(Machine::new("machine", Default::default()));
        w.config.spec.node_labels = BTreeMap::from([("a".into(), "x,evil=1".into())]);
        let p = w.plan();
        waits(&p, Reason::InvalidSpec);
        assert!(p.status.token_id.is_none());
        // A Cluster whose Service range leaves no address for the cluster DNS.
        w.config.spec.node_labels.clear();
        let network = crate::crd::capi::ClusterNetwork {
            services: Some(crate::crd::capi::NetworkRanges {
                cidr_blocks: vec!["10.0.0.0/30".into()],
            }),
            service_domain: None,
        };
        w.cluster.as_mut().unwrap().spec.cluster_network = Some(network);
        let p = w.plan();
        waits(&p, Reason::InvalidSpec);
        assert!(p.status.token_id.is_none());
        w.config.spec.cluster_dns = vec!["10.0.0.2".into()];
        assert_eq!(w.plan().step, Step::RecordTokenId, "the config's own clusterDNS is enough");
    }

    #[test]
    fn the_token_id_is_recorded_before_the_token_and_the_token_before_the_data() {
        let mut w = World::new(config());
        let p = w.plan();
        assert_eq!((p.step.clone(), p.requeue), (Step::RecordTokenId, Requeue::Now));
        assert_eq!(p.status.token_id.as_deref(), Some("ghijkl"), "the pass's fresh id");
        assert_eq!(reason(&p, READY), ("False".into(), Reason::CreatingToken.to_string()));
        w.config = with_token_id(config());
        let p = w.plan();
        assert_eq!(p.step, Step::CreateToken { id: "abcdef", expiration: NOW + TTL });
        w.config.spec.token_ttl_seconds = Some(3600);
        assert_eq!(w.plan().step, Step::CreateToken { id: "abcdef", expiration: NOW + 3600 });
        w.token = TokenState::Present(BootstrapToken { secret: String::new(), ..token(NOW) });
        assert_eq!(
            w.plan().step,
            Step::DeleteToken { id: "abcdef" },
            "a malformed token is replaced"
        );
        w.token = TokenState::Present(token(NOW + 3600));
        let Step::WriteDataSecret { data, cluster } = w.plan().step else {
            panic!("{:?}", w.plan())
        };
        assert_eq!(cluster, "c");
        assert!(data.0.contains("#cloud-config"));
        assert_eq!(join_server(&data), SERVER, "the Cluster's endpoint, not the kubeconfig's");
        assert!(!format!("{:?}", w.plan()).contains("0123456789abcdef"), "Debug hides the token");
        // The token Secret as read carries the secret half; the status never does.
        assert!(!serde_json::to_string(&w.plan().status).unwrap().contains("0123456789abcdef"));
    }

    #[test]
    fn an_unreachable_workload_cluster_is_waited_for() {
        let mut w = World::new(with_token_id(config()));
        w.token = TokenState::Unreachable;
        let p = w.plan();
        waits(&p, Reason::WorkloadUnreachable);
        assert_eq!(p.requeue, Requeue::After(UNREACHABLE_RETRY));
    }

    #[test]
    fn a_written_data_secret_is_reported_per_contract() {
        let mut w = World::new(with_token_id(config()));
        w.data_secret = DataSecret::Ours;
        w.token = TokenState::Present(token(NOW + TTL));
        let p = w.plan();
        assert_eq!(p.status.data_secret_name.as_deref(), Some("worker-0"));
        assert_eq!(p.status.initialization.unwrap().data_secret_created, Some(true));
        assert_eq!(
            reason(&w.plan(), READY),
            ("True".into(), Reason::DataSecretAvailable.to_string())
        );
        assert_eq!(reason(&w.plan(), DATA_SECRET_AVAILABLE).0, "True");
        assert_eq!(reason(&w.plan(), PAUSED), ("False".into(), Reason::NotPaused.to_string()));
        // Someone else's Secret of that name is never reported as the data.
        w.data_secret = DataSecret::Foreign;
        let p = w.plan();
        waits(&p, Reason::DataSecretConflict);
        assert!(p.status.data_secret_name.is_none());
    }

    #[test]
    fn the_token_is_extended_until_the_machine_has_its_node_then_deleted() {
        let mut w = World::new(with_token_id(config()));
        w.data_secret = DataSecret::Ours;
        // Fresh: within the first sixth of its life nothing is written.
        w.token = TokenState::Present(token(NOW + TTL - TTL / 6 + 1));
        assert_eq!(w.plan().step, Step::None);
        assert_eq!(w.plan().requeue, Requeue::After(Duration::from_secs(TTL / 3)));
        w.token = TokenState::Present(token(NOW + TTL - TTL / 6 - 1));
        assert_eq!(w.plan().step, Step::ExtendToken { id: "abcdef", expiration: NOW + TTL });
        w.token = TokenState::Present(BootstrapToken { expiration: None, ..token(0) });
        assert_eq!(w.plan().step, Step::ExtendToken { id: "abcdef", expiration: NOW + TTL });
        let mut w = w.joined();
        w.token = TokenState::Present(token(NOW + 10));
        assert_eq!(w.plan().step, Step::DeleteToken { id: "abcdef" });
        w.token = TokenState::Absent;
        assert_eq!((w.plan().step, w.plan().requeue), (Step::None, Requeue::OnChange));
        assert_eq!(reason(&w.plan(), READY).0, "True");
    }

    #[test]
    fn a_token_gone_before_the_join_is_reported_and_never_replaced() {
        let mut w = World::new(with_token_id(config()));
        w.data_secret = DataSecret::Ours;
        w.token = TokenState::Absent;
        let p = w.plan();
        assert_eq!(p.step, Step::None);
        assert_eq!(reason(&p, READY), ("False".into(), Reason::TokenMissing.to_string()));
        assert_eq!(reason(&p, DATA_SECRET_AVAILABLE).0, "True");
        // A status lost in a move: the data stands, no second token is minted.
        let mut w = World::new(config());
        w.data_secret = DataSecret::Ours;
        let p = w.plan();
        assert_eq!(p.step, Step::None);
        assert!(p.status.token_id.is_none());
        assert_eq!(p.status.data_secret_name.as_deref(), Some("worker-0"));
    }

    #[test]
    fn deletion_deletes_the_token_then_lets_go() {
        let mut w = World::new(deleting(with_token_id(config()), 1));
        w.data_secret = DataSecret::Ours;
        w.token = TokenState::Present(token(NOW + TTL));
        assert_eq!(w.plan().step, Step::DeleteToken { id: "abcdef" });
        w.token = TokenState::Absent;
        assert_eq!(w.plan().step, Step::RemoveFinalizer { abandoned: None });
        // No token was ever made.
        let w = World::new(deleting(config(), 1));
        assert_eq!(w.plan().step, Step::RemoveFinalizer { abandoned: None });
        // Not ours to hold any more.
        let mut released = deleting(config(), 1);
        released.metadata.finalizers = None;
        assert_eq!(World::new(released).plan().step, Step::None);
    }

    #[test]
    fn an_unreachable_workload_cluster_holds_deletion_for_a_bounded_time() {
        let mut w = World::new(deleting(with_token_id(config()), 10));
        w.token = TokenState::Unreachable;
        let p = w.plan();
        assert_eq!((p.step, p.requeue), (Step::None, Requeue::After(UNREACHABLE_RETRY)));
        w.config = deleting(with_token_id(config()), DELETE_GRACE.as_secs());
        let Step::RemoveFinalizer { abandoned: Some(why) } = w.plan().step else {
            panic!("{:?}", w.plan())
        };
        assert!(why.contains("abcdef") && why.contains("timed out"), "{why}");
        // No way to reach it at all: let go at once, saying so.
        w.config = deleting(with_token_id(config()), 1);
        w.kubeconfig = KubeconfigState::Missing;
        assert!(matches!(w.plan().step, Step::RemoveFinalizer { abandoned: Some(_) }));
        w.kubeconfig = KubeconfigState::Invalid;
        assert!(matches!(w.plan().step, Step::RemoveFinalizer { abandoned: Some(_) }));
    }

    #[test]
    fn pause_stops_everything_even_deletion() {
        let mut w = World::new(with_token_id(config()));
        w.cluster.as_mut().unwrap().spec.paused = Some(true);
        w.data_secret = DataSecret::Ours;
        w.token = TokenState::Present(token(NOW));
        let p = w.plan();
        assert_eq!((p.step.clone(), p.requeue), (Step::None, Requeue::OnChange));
        assert_eq!(reason(&p, PAUSED), ("True".into(), Reason::Paused.to_string()));
        let mut w = w.joined();
        assert_eq!(w.plan().step, Step::None, "no deletion of the token while paused");
        w.config = deleting(with_token_id(config()), DELETE_GRACE.as_secs() * 10);
        assert_eq!(w.plan().step, Step::None, "no finalizer removal while paused");
        w.cluster.as_mut().unwrap().spec.paused = None;
        w.config.metadata.annotations =
            Some(BTreeMap::from([(PAUSED_ANNOTATION.to_owned(), String::new())]));
        assert_eq!(w.plan().step, Step::None, "the annotation pauses too");
        let mut fresh = World::new(config());
        fresh.config.metadata.annotations = w.config.metadata.annotations.clone();
        assert_eq!(fresh.plan().step, Step::None, "no token id recorded while paused");
    }

    /// The secret half the reconciler minted for the pass.
    const MINTED: &str = "mintedsecret0001";

    /// The write of the step planned for `w`.
    fn write(w: &World) -> Write {
        let p = w.plan();
        p.step.write(&w.config, &p.status, MINTED).unwrap_or_else(|| panic!("no write: {p:?}"))
    }

    /// The Secret a write creates, as JSON.
    fn created(request: &Request) -> serde_json::Value {
        match request {
            Request::CreateToken(s) | Request::CreateDataSecret(s) => serde_json::to_value(s),
            other => panic!("creates no Secret: {other:?}"),
        }
        .unwrap()
    }

    #[test]
    fn the_finalizer_is_added_and_removed_keeping_the_others_if_the_config_is_unchanged() {
        let mut c = config();
        c.metadata.finalizers = Some(vec!["other.example/f".into()]);
        let w = World::new(c);
        assert_eq!(
            write(&w),
            Write {
                request: Request::PatchConfigIfUnchanged(json!({ "metadata": { "finalizers": [
                    "other.example/f", FINALIZER
                ] } })),
                note: None,
            }
        );
        let mut c = deleting(config(), 1);
        c.metadata.finalizers = Some(vec!["other.example/f".into(), FINALIZER.into()]);
        let w = World::new(c);
        assert_eq!(
            write(&w),
            Write {
                request: Request::PatchConfigIfUnchanged(json!({ "metadata": { "finalizers": [
                    "other.example/f"
                ] } })),
                note: None,
            }
        );
    }

    #[test]
    fn a_token_let_go_is_said_with_a_warning_once_the_finalizer_is_dropped() {
        let mut w = World::new(deleting(with_token_id(config()), 1));
        w.kubeconfig = KubeconfigState::Missing;
        let why = "bootstrap token abcdef was not deleted from the workload cluster (no kubeconfig Secret); it expires on its own";
        assert_eq!(
            write(&w),
            Write {
                request: Request::PatchConfigIfUnchanged(
                    json!({ "metadata": { "finalizers": [] } })
                ),
                note: Some(Note {
                    level: Level::Warning,
                    log: why.into(),
                    event: Some((Reason::TokenAbandoned.to_string(), why.into())),
                }),
            }
        );
    }

    #[test]
    fn the_token_id_is_recorded_as_the_plan_s_status_if_the_config_is_unchanged() {
        let w = World::new(config());
        // One plan: a condition's transition time is the clock's.
        let p = w.plan();
        assert_eq!(p.status.token_id.as_deref(), Some("ghijkl"));
        assert_eq!(
            p.step.write(&w.config, &p.status, MINTED),
            Some(Write {
                request: Request::WriteStatusIfUnchanged(p.status.clone()),
                note: Some(Note {
                    level: Level::Info,
                    log: "recorded the bootstrap token id ghijkl".into(),
                    event: None
                }),
            })
        );
    }

    #[test]
    fn the_token_is_created_in_kube_system_with_the_minted_secret_and_its_expiration() {
        let mut w = World::new(with_token_id(config()));
        w.config.spec.token_ttl_seconds = Some(3600);
        let write = write(&w);
        assert_eq!(
            created(&write.request),
            json!({
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": { "name": "bootstrap-token-abcdef", "namespace": "kube-system" },
                "type": "bootstrap.kubernetes.io/token",
                "stringData": {
                    "description": "siteboot bootstrap token for SitebootConfig ns/worker-0",
                    "token-id": "abcdef",
                    "token-secret": MINTED,
                    // NOW + 3600.
                    "expiration": "1970-01-12T14:46:40Z",
                    "usage-bootstrap-authentication": "true",
                    "usage-bootstrap-signing": "true",
                    "auth-extra-groups": "system:bootstrappers:kubeadm:default-node-token",
                },
            })
        );
        assert_eq!(
            write.note,
            Some(Note {
                level: Level::Info,
                log: "created the bootstrap token".into(),
                event: None
            })
        );
        assert!(!format!("{write:?}").contains(MINTED), "Debug hides the secret half");
    }

    #[test]
    fn the_data_secret_is_the_config_s_labelled_with_its_cluster_and_announced() {
        let mut w = World::new(with_token_id(config()));
        w.token = TokenState::Present(token(NOW + TTL));
        let Step::WriteDataSecret { data, .. } = w.plan().step else { panic!("{:?}", w.plan()) };
        let write = write(&w);
        assert_eq!(
            created(&write.request),
            json!({
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": "worker-0",
                    "namespace": "ns",
                    "labels": { "cluster.x-k8s.io/cluster-name": "c" },
                    "ownerReferences": [{
                        "apiVersion": "bootstrap.cluster.x-k8s.io/v1alpha1",
                        "kind": "SitebootConfig",
                        "name": "worker-0",
                        "uid": "config-uid",
                        "controller": true,
                        "blockOwnerDeletion": true,
                    }],
                },
                "type": "cluster.x-k8s.io/secret",
                "stringData": { "value": data.0, "format": "cloud-config" },
            })
        );
        assert_eq!(
            write.note,
            Some(Note {
                level: Level::Info,
                log: "wrote the bootstrap data Secret".into(),
                event: Some((
                    Reason::DataSecretAvailable.to_string(),
                    "Secret worker-0 holds the bootstrap data".into()
                )),
            })
        );
        assert!(!format!("{write:?}").contains("0123456789abcdef"), "Debug hides the token");
    }

    #[test]
    fn extending_the_token_patches_its_expiration_quietly() {
        let mut w = World::new(with_token_id(config()));
        w.data_secret = DataSecret::Ours;
        w.token = TokenState::Present(token(NOW));
        assert_eq!(
            write(&w),
            Write {
                request: Request::PatchToken {
                    name: "bootstrap-token-abcdef".into(),
                    // base64 of "1970-01-12T14:01:40Z", NOW + TTL.
                    patch: json!({ "data": { "expiration": "MTk3MC0wMS0xMlQxNDowMTo0MFo=" } }),
                },
                note: Some(Note {
                    level: Level::Debug,
                    log: "extended the bootstrap token".into(),
                    event: None
                }),
            }
        );
    }

    #[test]
    fn deleting_the_token_deletes_its_secret() {
        let mut w = World::new(with_token_id(config())).joined();
        w.data_secret = DataSecret::Ours;
        w.token = TokenState::Present(token(NOW + TTL));
        assert_eq!(
            write(&w),
            Write {
                request: Request::DeleteToken { name: "bootstrap-token-abcdef".into() },
                note: Some(Note {
                    level: Level::Info,
                    log: "deleted the bootstrap token".into(),
                    event: None
                }),
            }
        );
    }

    #[test]
    fn doing_nothing_writes_nothing() {
        let c = config();
        assert_eq!(Step::None.write(&c, &Default::default(), MINTED), None);
    }
}
