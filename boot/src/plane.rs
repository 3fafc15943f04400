//! What the boot plane's servers share: where clients reach this appliance, what each host
//! boots, and the records every server writes to.

use std::sync::Arc;

use siteboot_ipxe::IpxeBinaries;

use crate::metrics::Metrics;
use crate::neighbors::Neighbors;
use crate::timeline::Timeline;
use crate::{Endpoints, Inventory};

/// The shared parts of the boot plane, cheap to clone (everything but `endpoints` is shared).
#[derive(Clone)]
pub struct BootPlane {
    pub endpoints: Endpoints,
    pub inventory: Arc<dyn Inventory>,
    pub binaries: Arc<IpxeBinaries>,
    pub timeline: Arc<Timeline>,
    pub metrics: Arc<Metrics>,
    /// Who holds a client address: the only identity secrets are handed out on.
    pub neighbors: Arc<Neighbors>,
}
