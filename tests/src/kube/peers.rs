//! Finding the peer programs that `scripts/build-test-peers` built from `tests/go`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

/// The programs the script builds, by file name under `bin/`.
pub const ETCD: &str = "etcd";
pub const KUBE_APISERVER: &str = "kube-apiserver";
pub const KUBE_CONTROLLER_MANAGER: &str = "kube-controller-manager";
pub const KUBE_SCHEDULER: &str = "kube-scheduler";
pub const KUBELET: &str = "kubelet";
pub const KUBEADM: &str = "kubeadm";
pub const CAPI_MANAGER: &str = "capi-manager";
pub const KUBEADM_BOOTSTRAP_MANAGER: &str = "kubeadm-bootstrap-manager";
pub const KUBEADM_CONTROL_PLANE_MANAGER: &str = "kubeadm-control-plane-manager";
pub const CLUSTERCTL: &str = "clusterctl";

const ALL: [&str; 10] = [
    ETCD,
    KUBE_APISERVER,
    KUBE_CONTROLLER_MANAGER,
    KUBE_SCHEDULER,
    KUBELET,
    KUBEADM,
    CAPI_MANAGER,
    KUBEADM_BOOTSTRAP_MANAGER,
    KUBEADM_CONTROL_PLANE_MANAGER,
    CLUSTERCTL,
];

/// A complete build folder: the binaries and the Cluster API module directory (CRDs, webhooks).
#[derive(Debug, Clone)]
pub struct Peers {
    dir: PathBuf,
    capi_module_dir: PathBuf,
}

impl Peers {
    /// `$SITEBOOT_PEERS_DIR` if set, otherwise the folder the script uses for the current
    /// `tests/go/go.{sum,mod}`. A missing or stale build is an error that says what to run: the
    /// Kubernetes tests never skip silently.
    pub fn locate() -> Result<Self> {
        let dir = match std::env::var_os("SITEBOOT_PEERS_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => default_dir()?,
        };
        let run = "run scripts/build-test-peers (it builds kube-apiserver, etcd, the Cluster API \
                   managers and the other peers from tests/go; the first build takes minutes)";
        if !dir.join(".complete").is_file() {
            bail!("no complete test-peer build in {}: {run}", dir.display());
        }
        for name in ALL {
            if !dir.join("bin").join(name).is_file() {
                bail!("{} is missing {name}: {run}", dir.display());
            }
        }
        let recorded = dir.join("capi-module-dir");
        let capi_module_dir = PathBuf::from(
            std::fs::read_to_string(&recorded)
                .with_context(|| format!("reading {}: {run}", recorded.display()))?
                .trim(),
        );
        if !capi_module_dir.join("core/config/crd/bases").is_dir() {
            bail!(
                "the Cluster API module directory {} is gone from the Go module cache: {run}",
                capi_module_dir.display()
            );
        }
        Ok(Self { dir, capi_module_dir })
    }

    /// The build folder (`.../peers/<key>`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of one of the programs above.
    pub fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bin").join(name)
    }

    /// `sigs.k8s.io/cluster-api@<version>` in the Go module cache.
    pub fn capi_module_dir(&self) -> &Path {
        &self.capi_module_dir
    }
}

/// `${SITEBOOT_CACHE:-/var/cache/siteboot}/peers/<first 16 hex digits of sha256(go.sum + go.mod)>`,
/// the same key scripts/build-test-peers computes.
fn default_dir() -> Result<PathBuf> {
    let go = Path::new(env!("CARGO_MANIFEST_DIR")).join("go");
    let mut hash = Sha256::new();
    for file in ["go.sum", "go.mod"] {
        let path = go.join(file);
        hash.update(std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?);
    }
    let key: String = hash.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect();
    let cache = std::env::var_os("SITEBOOT_CACHE").unwrap_or_else(|| "/var/cache/siteboot".into());
    Ok(PathBuf::from(cache).join("peers").join(key))
}
