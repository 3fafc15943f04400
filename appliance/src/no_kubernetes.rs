//! Stands in for `kubernetes.rs` in a build without the `kubernetes` feature: the standalone
//! appliance, which links no Kubernetes client. `siteboot serve` has no Kubernetes options,
//! and Kubernetes mode cannot be reached ([`KubeMode`] has no values).

use std::sync::Arc;

use anyhow::Result;
use siteboot_agent_server::images::ImageService;
use siteboot_boot::leadership::Leadership;
use siteboot_boot::timeline::Timeline;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::serve::{Hosts, Served};

/// `siteboot serve`'s options for Kubernetes mode: none in this build.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {}

/// Kubernetes mode, which this build does not have: there is no value of this type.
pub enum KubeMode {}

impl ServeArgs {
    /// `siteboot serve`: the boot plane alone (a config with a `kubernetes:` section was
    /// refused when it was read).
    pub async fn serve(self, config: Config) -> Result<()> {
        crate::serve::serve(config, None).await
    }
}

/// Never called: there is no [`KubeMode`] to call it with.
pub async fn hosts(
    _: &Config,
    kube: KubeMode,
    _: Served<'_>,
    _: ImageService,
    _: tokio::sync::watch::Sender<Leadership>,
    _: Arc<Timeline>,
    _: CancellationToken,
) -> Result<Hosts> {
    match kube {}
}
