//! A workload cluster, reached through its `<cluster>-kubeconfig` Secret (the Cluster API
//! convention): the bootstrap provider keeps its join tokens there, the infrastructure provider
//! sets providerID on its Nodes. Every request is bounded, so an unreachable cluster is reported
//! in seconds. A client is made once per kubeconfig and kept (its connections with it), and the
//! Nodes are listed at most once per [`NODES_MAX_AGE`] per cluster, however many machines wait
//! for theirs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use k8s_openapi::api::core::v1::{Node, Secret};
use kube::Api;
use kube::ResourceExt;
use kube::api::ListParams;

use crate::context::Error;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const READ_TIMEOUT: Duration = Duration::from_secs(15);
/// How old a list of a workload cluster's Nodes may be when a machine looks for its Node there.
pub const NODES_MAX_AGE: Duration = Duration::from_secs(1);

/// What hosts joining the workload cluster take from its `<cluster>-kubeconfig` Secret (the
/// address they join at is the Cluster's `controlPlaneEndpoint`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinTarget {
    /// The cluster CA (PEM).
    pub ca_pem: String,
}

#[derive(Clone)]
pub struct Workload {
    pub cluster: String,
    pub target: JoinTarget,
    pub client: kube::Client,
    /// The last list of its Nodes, shared by every pass that uses this client.
    nodes: Arc<tokio::sync::Mutex<Option<NodeList>>>,
}

struct NodeList {
    listed: Instant,
    nodes: Arc<Vec<Node>>,
}

/// The workload clusters connected so far, by namespace and Cluster name, with the
/// resourceVersion of the kubeconfig Secret each client was made from.
#[derive(Default)]
pub struct Workloads {
    connected: Mutex<HashMap<(String, String), (String, Workload)>>,
}

impl Workloads {
    /// The workload cluster of Cluster `cluster` in `namespace`: `None` while its kubeconfig
    /// Secret does not exist, `Err(why)` if that Secret cannot be used. The Secret is read each
    /// time (it may be rotated); a client is made again only when it changed.
    pub async fn of_cluster(
        &self,
        client: &kube::Client,
        namespace: &str,
        cluster: &str,
    ) -> Result<Option<Result<Workload, String>>, kube::Error> {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
        let key = (namespace.to_owned(), cluster.to_owned());
        let Some(secret) = secrets.get_opt(&format!("{cluster}-kubeconfig")).await? else {
            self.connected.lock().expect("workloads lock").remove(&key);
            return Ok(None);
        };
        let version = secret.resource_version().unwrap_or_default();
        if let Some((v, w)) = self.connected.lock().expect("workloads lock").get(&key)
            && *v == version
        {
            return Ok(Some(Ok(w.clone())));
        }
        let workload = Workload::connect(cluster, &secret).await;
        let mut connected = self.connected.lock().expect("workloads lock");
        match &workload {
            Ok(w) => connected.insert(key, (version, w.clone())),
            Err(_) => connected.remove(&key),
        };
        Ok(Some(workload))
    }
}

impl Workload {
    /// Its Nodes, listed at most [`NODES_MAX_AGE`] ago; `Err` says why they cannot be read.
    pub async fn nodes(&self) -> Result<Arc<Vec<Node>>, String> {
        let mut last = self.nodes.lock().await;
        if let Some(last) = last.as_ref()
            && last.listed.elapsed() < NODES_MAX_AGE
        {
            return Ok(last.nodes.clone());
        }
        let listed = Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|e| format!("listing Nodes: {e}"))?;
        let nodes = Arc::new(listed.items);
        *last = Some(NodeList { listed: Instant::now(), nodes: nodes.clone() });
        Ok(nodes)
    }

    pub fn error(&self, source: kube::Error) -> Error {
        Error::Workload { cluster: self.cluster.clone(), source }
    }

    /// The workload cluster from its kubeconfig Secret, or why it cannot be used.
    pub async fn connect(cluster: &str, secret: &Secret) -> Result<Workload, String> {
        let value =
            secret.data.as_ref().and_then(|d| d.get("value")).ok_or("it has no key `value`")?;
        let kubeconfig: kube::config::Kubeconfig =
            serde_yaml::from_slice(&value.0).map_err(|e| format!("not a kubeconfig: {e}"))?;
        let context = kubeconfig
            .current_context
            .as_ref()
            .and_then(|name| kubeconfig.contexts.iter().find(|c| &c.name == name))
            .or_else(|| kubeconfig.contexts.first())
            .and_then(|c| c.context.as_ref())
            .ok_or("it has no context")?;
        let named = kubeconfig
            .clusters
            .iter()
            .find(|c| c.name == context.cluster)
            .and_then(|c| c.cluster.as_ref())
            .ok_or_else(|| {
                format!("its context names cluster {:?}, which it lacks", context.cluster)
            })?;
        let ca_pem = named
            .certificate_authority_data
            .as_ref()
            .and_then(|b64| BASE64.decode(b64).ok())
            .and_then(|pem| String::from_utf8(pem).ok())
            .filter(|pem| pem.contains("-----BEGIN CERTIFICATE-----"))
            .ok_or("its cluster has no certificate-authority-data (the CA hosts must trust)")?;
        let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .map_err(|e| format!("unusable kubeconfig: {e}"))?;
        config.connect_timeout = Some(CONNECT_TIMEOUT);
        config.read_timeout = Some(READ_TIMEOUT);
        let client =
            kube::Client::try_from(config).map_err(|e| format!("unusable kubeconfig: {e}"))?;
        Ok(Workload {
            cluster: cluster.to_owned(),
            target: JoinTarget { ca_pem },
            client,
            nodes: Default::default(),
        })
    }
}
