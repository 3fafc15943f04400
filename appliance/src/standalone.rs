//! The standalone inventory: what each MAC boots, straight from the config file.

use std::collections::HashMap;

use siteboot_boot::dhcp::settings::Reservation;
use siteboot_boot::inventory::{BootRequest, BoxFuture, HostSummary, Inventory};
use siteboot_boot::{BootAction, MacAddr};

/// A host listed under `hosts`.
#[derive(Debug)]
pub struct ListedHost {
    pub action: BootAction,
    /// The profile `action` comes from.
    pub profile: String,
    /// Its DHCP reservation (`dhcp.reservations`), if it has one: the status page shows its
    /// host name and address.
    pub reservation: Option<Reservation>,
}

#[derive(Debug)]
pub struct StaticInventory {
    hosts: HashMap<MacAddr, ListedHost>,
    /// What MACs not listed boot (`unknown_hosts`); `None`: they get no boot information.
    default: Option<BootAction>,
}

impl StaticInventory {
    pub fn new(hosts: HashMap<MacAddr, ListedHost>, default: Option<BootAction>) -> Self {
        Self { hosts, default }
    }

    fn lookup(&self, mac: MacAddr) -> Option<&BootAction> {
        self.hosts.get(&mac).map(|h| &h.action).or(self.default.as_ref())
    }

    pub fn known_hosts(&self) -> usize {
        self.hosts.len()
    }
}

impl Inventory for StaticInventory {
    fn boots(&self, mac: MacAddr) -> bool {
        self.lookup(mac).is_some()
    }

    /// Listed under `hosts`: `unknown_hosts` does not make a MAC known.
    fn knows(&self, mac: MacAddr) -> bool {
        self.hosts.contains_key(&mac)
    }

    fn boot_action(&self, request: BootRequest) -> BoxFuture<'_, Option<BootAction>> {
        let action = self.lookup(request.mac).cloned();
        Box::pin(async move { action })
    }

    /// The hosts under `hosts`, each with the profile it boots as its state.
    fn hosts(&self) -> Vec<HostSummary> {
        self.hosts
            .iter()
            .map(|(mac, host)| HostSummary {
                mac: *mac,
                name: host.reservation.as_ref().and_then(|r| r.hostname.clone()),
                state: format!("profile {}", host.profile),
                address: host.reservation.as_ref().map(|r| r.address),
                consumer: None,
                operation: None,
            })
            .collect()
    }
}
