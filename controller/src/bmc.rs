//! BMC drivers: what siteboot can do to a host's power and boot device. Hosts without
//! `spec.bmc` get [`SelfBooting`]: siteboot cannot power-cycle them, and waits for them to
//! network-boot by themselves (PXE first in the boot order). The Redfish driver, with the
//! deploy ramdisk, is the next milestone; it implements the same trait.

use std::sync::Arc;

use siteboot_boot::inventory::BoxFuture;

use crate::crd::{Host, PowerState};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BmcError {
    #[error(
        "spec.bmc names {0:?}, and this siteboot has no driver for it yet: remove spec.bmc and let the host boot from the network by itself"
    )]
    Unsupported(String),
}

pub trait BmcDriver: Send + Sync {
    fn power(&self) -> BoxFuture<'_, Result<PowerState, BmcError>>;
    /// Boots the host from the network now: an operation needs the ramdisk.
    fn boot_from_network(&self) -> BoxFuture<'_, Result<(), BmcError>>;
    /// Turns the host off (a deleted Host, after its wipe).
    fn power_off(&self) -> BoxFuture<'_, Result<(), BmcError>>;
}

/// No BMC: the host boots from the network on its own whenever it restarts.
pub struct SelfBooting;

impl BmcDriver for SelfBooting {
    fn power(&self) -> BoxFuture<'_, Result<PowerState, BmcError>> {
        Box::pin(async { Ok(PowerState::Unknown) })
    }

    fn boot_from_network(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        // Nothing to do: the next time the host restarts it boots the ramdisk.
        Box::pin(async { Ok(()) })
    }

    fn power_off(&self) -> BoxFuture<'_, Result<(), BmcError>> {
        // Nothing siteboot can do; the operator unplugs a deleted host.
        Box::pin(async { Ok(()) })
    }
}

/// The driver for `host`.
pub fn driver_for(host: &Host) -> Result<Arc<dyn BmcDriver>, BmcError> {
    match &host.spec.bmc {
        None => Ok(Arc::new(SelfBooting)),
        Some(bmc) => Err(BmcError::Unsupported(bmc.address.clone())),
    }
}
