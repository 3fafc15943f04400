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
use serde_json::{Map, Value, json};

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
        let workload = Workload::connect(cluster, &secret).await.map_err(|e| e.to_string());
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
    pub async fn connect(cluster: &str, secret: &Secret) -> Result<Workload, BadKubeconfig> {
        let value =
            secret.data.as_ref().and_then(|d| d.get("value")).ok_or(BadKubeconfig::NoValue)?;
        let (kubeconfig, ca_pem) = inline_only(&value.0)?;
        let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .map_err(BadKubeconfig::Unusable)?;
        config.connect_timeout = Some(CONNECT_TIMEOUT);
        config.read_timeout = Some(READ_TIMEOUT);
        let client = kube::Client::try_from(config).map_err(BadKubeconfig::NoClient)?;
        Ok(Workload {
            cluster: cluster.to_owned(),
            target: JoinTarget { ca_pem },
            client,
            nodes: Default::default(),
        })
    }
}

/// Why a `<cluster>-kubeconfig` Secret cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BadKubeconfig {
    #[error("it has no key `value`")]
    NoValue,
    #[error("not a kubeconfig: {0}")]
    NotYaml(serde_norway::Error),
    #[error("it has no context")]
    NoContext,
    #[error("its context names cluster {0:?}, which it lacks")]
    NoCluster(String),
    #[error("its context names user {0:?}, which it lacks")]
    NoUser(String),
    #[error(
        "{0} is not accepted: a workload kubeconfig must carry inline credentials (token or client-certificate-data/client-key-data)"
    )]
    UserField(String),
    #[error(
        "{0} is not accepted: a workload kubeconfig's cluster must carry inline data only (server, certificate-authority-data, tls-server-name)"
    )]
    ClusterField(String),
    #[error("its user carries neither a token nor client-certificate-data with client-key-data")]
    NoCredentials,
    #[error("its cluster has no certificate-authority-data (the CA hosts must trust)")]
    NoCa,
    #[error("not a kubeconfig: {0}")]
    Malformed(serde_json::Error),
    #[error("unusable kubeconfig: {0}")]
    Unusable(kube::config::KubeconfigError),
    #[error("unusable kubeconfig: {0}")]
    NoClient(kube::Error),
}

/// What the selected cluster and user of a tenant's kubeconfig may set: data only, copied into a
/// kubeconfig of siteboot's own. kube honours more (exec and auth-provider run commands;
/// tokenFile, client-certificate, client-key and certificate-authority read siteboot's files;
/// proxy-url and insecure-skip-tls-verify redirect or unpin the connection), and a tenant is
/// trusted for its own namespace only. Anything else set is refused by name rather than dropped,
/// so the tenant learns why. That includes username/password and impersonation: harmless to
/// siteboot (they only say who the tenant's own cluster should take the request to be), but no
/// Cluster API kubeconfig carries them, and what is not needed is not accepted.
const CLUSTER_FIELDS: [&str; 3] = ["server", "certificate-authority-data", "tls-server-name"];
const USER_FIELDS: [&str; 3] = ["token", "client-certificate-data", "client-key-data"];

/// The context a kubeconfig selects (its current one, else its first), as a kubeconfig of its
/// own that holds only [`CLUSTER_FIELDS`] and [`USER_FIELDS`], and its cluster's CA (PEM).
fn inline_only(yaml: &[u8]) -> Result<(kube::config::Kubeconfig, String), BadKubeconfig> {
    let doc: Value = serde_norway::from_slice(yaml).map_err(BadKubeconfig::NotYaml)?;
    let list = |key: &str| doc.get(key).and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    let contexts = list("contexts");
    let context = doc
        .get("current-context")
        .and_then(Value::as_str)
        .and_then(|name| contexts.iter().find(|c| c["name"] == name))
        .or_else(|| contexts.first())
        .and_then(|c| c.get("context"))
        .ok_or(BadKubeconfig::NoContext)?;
    // The first of a name, as kube would pick it.
    let named =
        |key: &str, name: &str| list(key).iter().enumerate().find(|(_, item)| item["name"] == name);
    let cluster_name = context["cluster"].as_str().unwrap_or_default();
    let (c, cluster) = named("clusters", cluster_name)
        .ok_or_else(|| BadKubeconfig::NoCluster(cluster_name.to_owned()))?;
    let user_name = context["user"].as_str().ok_or(BadKubeconfig::NoCredentials)?;
    let (u, user) =
        named("users", user_name).ok_or_else(|| BadKubeconfig::NoUser(user_name.to_owned()))?;
    let (cluster, user) = (&cluster["cluster"], &user["user"]);
    let refused = |fields: &Value, allowed: &[&str]| {
        let set = fields.as_object().into_iter().flatten().filter(|(_, v)| !v.is_null());
        set.map(|(k, _)| k).find(|k| !allowed.contains(&k.as_str())).cloned()
    };
    if let Some(field) = refused(user, &USER_FIELDS) {
        return Err(BadKubeconfig::UserField(format!("users[{u}].user.{field}")));
    }
    if let Some(field) = refused(cluster, &CLUSTER_FIELDS) {
        return Err(BadKubeconfig::ClusterField(format!("clusters[{c}].cluster.{field}")));
    }
    let has = |field| user.get(field).is_some_and(|v| !v.is_null());
    if !(has("token") || has("client-certificate-data") && has("client-key-data")) {
        return Err(BadKubeconfig::NoCredentials);
    }
    let ca_pem = cluster["certificate-authority-data"]
        .as_str()
        .and_then(|b64| BASE64.decode(b64).ok())
        .and_then(|pem| String::from_utf8(pem).ok())
        .filter(|pem| pem.contains("-----BEGIN CERTIFICATE-----"))
        .ok_or(BadKubeconfig::NoCa)?;
    let copy = |from: &Value, fields: &[&str]| -> Map<String, Value> {
        fields.iter().filter_map(|&f| Some((f.to_owned(), from.get(f)?.clone()))).collect()
    };
    let own = json!({
        "clusters": [{ "name": "workload", "cluster": copy(cluster, &CLUSTER_FIELDS) }],
        "users": [{ "name": "workload", "user": copy(user, &USER_FIELDS) }],
        "contexts": [{ "name": "workload", "context": { "cluster": "workload", "user": "workload" } }],
        "current-context": "workload",
    });
    Ok((serde_json::from_value(own).map_err(BadKubeconfig::Malformed)?, ca_pem))
}

#[cfg(test)]
mod tests {
    //! A tenant's kubeconfig against a loopback API server that records every request head it
    //! gets: what the tenant writes is data, never a command siteboot runs or a file it reads.

    use std::path::Path;
    use std::sync::LazyLock;

    use k8s_openapi::ByteString;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// What siteboot must never hand a tenant (stands for its ServiceAccount token).
    const SITEBOOT_SECRET: &str = "siteboot-own-service-account-token";

    /// A self-signed certificate and its key (PEM): the cluster CA, and a client identity.
    static PAIR: LazyLock<(String, String)> = LazyLock::new(|| {
        let key = rcgen::KeyPair::generate().unwrap();
        let certificate = rcgen::CertificateParams::new(vec!["workload".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (certificate.pem(), key.serialize_pem())
    });

    /// A plain-HTTP API server on loopback: records each connection's request head and answers
    /// with an empty NodeList.
    struct Listener {
        url: String,
        heads: Arc<Mutex<Vec<String>>>,
    }

    impl Listener {
        async fn start() -> Self {
            let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", socket.local_addr().unwrap());
            let heads = Arc::<Mutex<Vec<String>>>::default();
            let seen = heads.clone();
            tokio::spawn(async move {
                loop {
                    let (mut tcp, _) = socket.accept().await.unwrap();
                    let seen = seen.clone();
                    tokio::spawn(async move {
                        let (mut head, mut buf) = (Vec::new(), [0; 4096]);
                        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                            match tcp.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => head.extend_from_slice(&buf[..n]),
                            }
                        }
                        seen.lock().unwrap().push(String::from_utf8_lossy(&head).into_owned());
                        let body =
                            r#"{"kind":"NodeList","apiVersion":"v1","metadata":{},"items":[]}"#;
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        let _ = tcp.write_all(answer.as_bytes()).await;
                    });
                }
            });
            Self { url, heads }
        }

        fn heads(&self) -> Vec<String> {
            self.heads.lock().unwrap().clone()
        }

        /// Nothing reached it: no connection, so no credential either.
        fn untouched(&self) {
            assert_eq!(self.heads(), Vec::<String>::new(), "the tenant's listener was reached");
        }
    }

    fn b64(text: &str) -> String {
        BASE64.encode(text)
    }

    /// The selected cluster: `server` and the CA hosts must trust, as CAPI writes them.
    fn cluster(server: &str) -> Value {
        json!({ "server": server, "certificate-authority-data": b64(&PAIR.0) })
    }

    /// A kubeconfig whose one context selects `cluster` and `user`.
    fn kubeconfig(cluster: Value, user: Value) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{ "name": "c", "cluster": cluster }],
            "users": [{ "name": "u", "user": user }],
            "contexts": [{ "name": "ctx", "context": { "cluster": "c", "user": "u" } }],
            "current-context": "ctx",
        })
    }

    /// What the reconcilers do with a `<cluster>-kubeconfig` Secret holding `kubeconfig`:
    /// connect, then list the Nodes.
    async fn attempt(kubeconfig: &Value) -> Result<(), String> {
        let value = ByteString(serde_norway::to_string(kubeconfig).unwrap().into_bytes());
        let secret = Secret { data: Some([("value".into(), value)].into()), ..Default::default() };
        let workload = Workload::connect("c", &secret).await.map_err(|e| e.to_string())?;
        workload.nodes().await.map(drop)
    }

    /// `result` is the refusal of `field`, in words the tenant can act on.
    fn refused(result: Result<(), String>, field: &str) {
        let why = result.expect_err("the kubeconfig was used");
        assert!(
            why.starts_with(&format!("{field} is not accepted: ")) && why.contains("inline"),
            "{why}"
        );
    }

    fn marker_absent(marker: &Path) {
        assert!(!marker.exists(), "siteboot ran the tenant's command: {} exists", marker.display());
    }

    #[tokio::test]
    async fn an_inline_token_reaches_the_workload_cluster() {
        let server = Listener::start().await;
        let user = json!({ "token": "the-tenant-token" });
        attempt(&kubeconfig(cluster(&server.url), user)).await.unwrap();
        let heads = server.heads();
        assert!(
            heads
                .iter()
                .any(|h| h.to_ascii_lowercase().contains("authorization: bearer the-tenant-token")),
            "{heads:?}"
        );
    }

    #[tokio::test]
    async fn an_inline_client_certificate_is_accepted() {
        let server = Listener::start().await;
        let user = json!({
            "client-certificate-data": b64(&PAIR.0),
            "client-key-data": b64(&PAIR.1),
        });
        attempt(&kubeconfig(cluster(&server.url), user)).await.unwrap();
        assert_eq!(server.heads().len(), 1);
    }

    #[tokio::test]
    async fn exec_is_refused_and_never_run() {
        let (server, dir) = (Listener::start().await, tempfile::tempdir().unwrap());
        let marker = dir.path().join("ran");
        let user = json!({ "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "/bin/sh",
            "args": ["-c", format!("touch {}", marker.display())],
            "interactiveMode": "Never",
        }});
        let result = attempt(&kubeconfig(cluster(&server.url), user)).await;
        marker_absent(&marker);
        refused(result, "users[0].user.exec");
        server.untouched();
    }

    #[tokio::test]
    async fn a_token_file_is_refused_and_never_read() {
        let (server, dir) = (Listener::start().await, tempfile::tempdir().unwrap());
        let token = dir.path().join("token");
        std::fs::write(&token, SITEBOOT_SECRET).unwrap();
        let user = json!({ "tokenFile": token });
        let result = attempt(&kubeconfig(cluster(&server.url), user)).await;
        let heads = server.heads();
        assert!(
            !heads.iter().any(|h| h.contains(SITEBOOT_SECRET)),
            "the tenant's listener received siteboot's token: {heads:?}"
        );
        refused(result, "users[0].user.tokenFile");
        server.untouched();
    }

    #[tokio::test]
    async fn an_auth_provider_is_refused_and_its_command_never_run() {
        let (server, dir) = (Listener::start().await, tempfile::tempdir().unwrap());
        let marker = dir.path().join("ran");
        // kube runs the gcp provider's `cmd-path` for a token.
        let user = json!({ "auth-provider": {
            "name": "gcp",
            "config": { "cmd-path": "/usr/bin/touch", "cmd-args": marker },
        }});
        let result = attempt(&kubeconfig(cluster(&server.url), user)).await;
        marker_absent(&marker);
        refused(result, "users[0].user.auth-provider");
        server.untouched();
    }

    #[tokio::test]
    async fn file_paths_are_refused() {
        let (server, dir) = (Listener::start().await, tempfile::tempdir().unwrap());
        let (certificate, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&certificate, &PAIR.0).unwrap();
        std::fs::write(&key, &PAIR.1).unwrap();
        let token = json!({ "token": "the-tenant-token" });
        let mut ca_file = cluster(&server.url);
        ca_file["certificate-authority"] = json!(certificate);
        let cases = [
            (
                cluster(&server.url),
                json!({ "client-certificate": certificate, "client-key-data": b64(&PAIR.1) }),
                "users[0].user.client-certificate",
            ),
            (
                cluster(&server.url),
                json!({ "client-certificate-data": b64(&PAIR.0), "client-key": key }),
                "users[0].user.client-key",
            ),
            (ca_file, token, "clusters[0].cluster.certificate-authority"),
        ];
        for (cluster, user, field) in cases {
            refused(attempt(&kubeconfig(cluster, user)).await, field);
        }
        server.untouched();
    }

    #[tokio::test]
    async fn settings_beyond_inline_data_are_refused() {
        let server = Listener::start().await;
        let token = || json!({ "token": "the-tenant-token" });
        let with = |mut fields: Value, key: &str, value: Value| {
            fields[key] = value;
            fields
        };
        let cases = [
            (
                cluster(&server.url),
                json!({ "username": "admin", "password": "secret" }),
                "users[0].user.password",
            ),
            (cluster(&server.url), with(token(), "as", json!("system:admin")), "users[0].user.as"),
            (
                with(cluster(&server.url), "insecure-skip-tls-verify", json!(true)),
                token(),
                "clusters[0].cluster.insecure-skip-tls-verify",
            ),
            (
                with(cluster(&server.url), "proxy-url", json!(server.url)),
                token(),
                "clusters[0].cluster.proxy-url",
            ),
            // A key kube does not know today may mean something tomorrow.
            (cluster(&server.url), with(token(), "future", json!("x")), "users[0].user.future"),
        ];
        for (cluster, user, field) in cases {
            refused(attempt(&kubeconfig(cluster, user)).await, field);
        }
        server.untouched();
    }

    #[tokio::test]
    async fn the_selected_user_is_the_one_checked_and_used() {
        let server = Listener::start().await;
        let mut kubeconfig = kubeconfig(cluster(&server.url), json!({}));
        // kube takes the first user of a name, and so must the check.
        kubeconfig["users"] = json!([
            { "name": "other", "user": { "exec": { "command": "/bin/false" } } },
            { "name": "u", "user": { "token": "the-tenant-token" } },
            { "name": "u", "user": { "tokenFile": "/nonexistent" } },
        ]);
        attempt(&kubeconfig).await.unwrap();
        kubeconfig["contexts"][0]["context"]["user"] = json!("other");
        refused(attempt(&kubeconfig).await, "users[0].user.exec");
        assert_eq!(server.heads().len(), 1, "only the accepted kubeconfig reached the server");
    }
}
