//! The Hosts of this site, indexed by boot MAC, kept current by a watch. The boot plane asks
//! it on every DHCP packet, so lookups are a hash-map read. Two Hosts with one boot MAC are both
//! kept, and neither answers a lookup by MAC: which machine is which cannot be told until an
//! operator fixes one of them.

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
    by_mac: RwLock<ByMac>,
    ready: AtomicBool,
}

impl HostIndex {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The one Host with this boot MAC; `None` if there is none or more than one.
    pub fn get(&self, mac: MacAddr) -> Option<Arc<Host>> {
        match self.by_mac.read().expect("host index lock").get(&mac).map(Vec::as_slice) {
            Some([host]) => Some(host.clone()),
            _ => None,
        }
    }

    /// Every Host, duplicates included.
    pub fn all(&self) -> Vec<Arc<Host>> {
        self.by_mac.read().expect("host index lock").values().flatten().cloned().collect()
    }

    /// The other Hosts that share `host`'s boot MAC.
    pub fn sharing_mac(&self, host: &Host) -> Vec<Arc<Host>> {
        let Ok(mac) = host.spec.boot_mac_address.parse::<MacAddr>() else { return Vec::new() };
        let index = self.by_mac.read().expect("host index lock");
        index.get(&mac).into_iter().flatten().filter(|h| h.uid() != host.uid()).cloned().collect()
    }

    /// Whether the first full list has arrived.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Keeps the index current until the watch ends (it retries with backoff on errors).
    pub async fn run(self: Arc<Self>, api: Api<Host>, config: watcher::Config) {
        let mut buffer = ByMac::new();
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
                    remove(&mut self.by_mac.write().expect("host index lock"), &host)
                }
                Err(e) => tracing::warn!(error = %e, "watching Hosts failed; retrying"),
            }
        }
    }
}

/// Hosts by boot MAC; more than one under a MAC is an error an operator must fix.
type ByMac = HashMap<MacAddr, Vec<Arc<Host>>>;

fn insert(map: &mut ByMac, host: Host) {
    let Ok(mac) = host.spec.boot_mac_address.parse::<MacAddr>() else {
        tracing::warn!(host = %host.name_any(), mac = %host.spec.boot_mac_address, "Host has an invalid boot MAC; ignored");
        return;
    };
    let hosts = map.entry(mac).or_default();
    hosts.retain(|h| h.uid() != host.uid());
    if let Some(other) = hosts.first() {
        tracing::error!(%mac, host = %host.name_any(), other = %other.name_any(), "two Hosts share a boot MAC; neither boots nor is claimed until one is fixed");
    }
    hosts.push(Arc::new(host));
}

fn remove(map: &mut ByMac, host: &Host) {
    let Ok(mac) = host.spec.boot_mac_address.parse::<MacAddr>() else { return };
    if let Some(hosts) = map.get_mut(&mac) {
        hosts.retain(|h| h.uid() != host.uid());
        if hosts.is_empty() {
            map.remove(&mac);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::HostSpec;

    fn host(name: &str, uid: &str, mac: &str) -> Host {
        let mut h = Host::new(name, HostSpec::new(mac));
        h.metadata.uid = Some(uid.into());
        h
    }

    #[test]
    fn a_shared_boot_mac_answers_no_lookup_until_fixed() {
        let index = HostIndex::default();
        let mac: MacAddr = "52:54:00:00:00:01".parse().unwrap();
        let a = host("a", "1", "52:54:00:00:00:01");
        insert(&mut index.by_mac.write().unwrap(), a.clone());
        assert_eq!(index.get(mac).unwrap().name_any(), "a");
        insert(&mut index.by_mac.write().unwrap(), a.clone());
        assert!(index.get(mac).is_some(), "an update of the same Host is no duplicate");
        let b = host("b", "2", "52:54:00:00:00:01");
        insert(&mut index.by_mac.write().unwrap(), b.clone());
        assert!(index.get(mac).is_none(), "two Hosts, one MAC: neither");
        assert_eq!(index.all().len(), 2);
        assert_eq!(index.sharing_mac(&a)[0].name_any(), "b");
        remove(&mut index.by_mac.write().unwrap(), &b);
        assert_eq!(index.get(mac).unwrap().name_any(), "a");
        assert!(index.sharing_mac(&a).is_empty());
    }
}
