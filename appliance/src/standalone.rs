//! The standalone inventory: what each MAC boots, straight from the config file.

use std::collections::HashMap;

use siteboot_boot::inventory::{BootRequest, BoxFuture, Inventory};
use siteboot_boot::{BootAction, MacAddr};

#[derive(Debug)]
pub struct StaticInventory {
    hosts: HashMap<MacAddr, BootAction>,
    /// What MACs not listed boot (`unknown_hosts`); `None`: they get no boot information.
    default: Option<BootAction>,
}

impl StaticInventory {
    pub fn new(hosts: HashMap<MacAddr, BootAction>, default: Option<BootAction>) -> Self {
        Self { hosts, default }
    }

    fn lookup(&self, mac: MacAddr) -> Option<&BootAction> {
        self.hosts.get(&mac).or(self.default.as_ref())
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
}
