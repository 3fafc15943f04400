//! The Hosts of this site, indexed by boot MAC, kept current by a watch. The boot plane asks
//! it on every DHCP packet, so lookups are a hash-map read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use futures_util::StreamExt;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use siteboot_boot::MacAddr;

use crate::crd::Host;

#[derive(Default)]
pub struct HostIndex {
    by_mac: RwLock<HashMap<MacAddr, Arc<Host>>>,
    ready: AtomicBool,
}

impl HostIndex {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn get(&self, mac: MacAddr) -> Option<Arc<Host>> {
        self.by_mac.read().expect("host index lock").get(&mac).cloned()
    }

    pub fn all(&self) -> Vec<Arc<Host>> {
        self.by_mac.read().expect("host index lock").values().cloned().collect()
    }

    /// Whether the first full list has arrived.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Keeps the index current until the watch ends (it retries with backoff on errors).
    pub async fn run(self: Arc<Self>, api: Api<Host>, config: watcher::Config) {
        let mut buffer: HashMap<MacAddr, Arc<Host>> = HashMap::new();
        let mut events = watcher(api, config).default_backoff().boxed();
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Init) => buffer.clear(),
                Ok(watcher::Event::InitApply(host)) => insert(&mut buffer, host),
                Ok(watcher::Event::InitDone) => {
                    *self.by_mac.write().expect("host index lock") = std::mem::take(&mut buffer);
                    self.ready.store(true, Ordering::Release);
                }
                Ok(watcher::Event::Apply(host)) => {
                    insert(&mut self.by_mac.write().expect("host index lock"), host)
                }
                Ok(watcher::Event::Delete(host)) => {
                    if let Ok(mac) = host.spec.boot_mac_address.parse::<MacAddr>() {
                        let mut map = self.by_mac.write().expect("host index lock");
                        if map.get(&mac).is_some_and(|h| h.uid() == host.uid()) {
                            map.remove(&mac);
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "watching Hosts failed; retrying"),
            }
        }
    }
}

fn insert(map: &mut HashMap<MacAddr, Arc<Host>>, host: Host) {
    let Ok(mac) = host.spec.boot_mac_address.parse::<MacAddr>() else {
        tracing::warn!(host = %host.name_any(), mac = %host.spec.boot_mac_address, "Host has an invalid boot MAC; ignored");
        return;
    };
    if let Some(other) = map.get(&mac)
        && other.uid() != host.uid()
    {
        tracing::error!(%mac, host = %host.name_any(), other = %other.name_any(), "two Hosts share a boot MAC; keeping the first");
        return;
    }
    map.insert(mac, Arc::new(host));
}
