//! A workload cluster, reached through its `<cluster>-kubeconfig` Secret (the Cluster API
//! convention): the bootstrap provider keeps its join tokens there, the infrastructure provider
//! sets providerID on its Nodes. Every request is bounded, so an unreachable cluster is reported
//! in seconds.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;

use crate::context::Error;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const READ_TIMEOUT: Duration = Duration::from_secs(15);

/// What hosts joining the workload cluster take from its `<cluster>-kubeconfig` Secret (the
/// address they join at is the Cluster's `controlPlaneEndpoint`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinTarget {
    /// The cluster CA (PEM).
    pub ca_pem: String,
}

pub struct Workload {
    pub cluster: String,
    pub target: JoinTarget,
    pub client: kube::Client,
}

impl Workload {
    /// The workload cluster of Cluster `cluster` in `namespace`: `None` while its kubeconfig
    /// Secret does not exist, `Err(why)` if that Secret cannot be used.
    pub async fn of_cluster(
        client: &kube::Client,
        namespace: &str,
        cluster: &str,
    ) -> Result<Option<Result<Workload, String>>, kube::Error> {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
        Ok(match secrets.get_opt(&format!("{cluster}-kubeconfig")).await? {
            Some(secret) => Some(Self::connect(cluster, &secret).await),
            None => None,
        })
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
        Ok(Workload { cluster: cluster.to_owned(), target: JoinTarget { ca_pem }, client })
    }
}
