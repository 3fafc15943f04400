//! The Hosts of this site, indexed by boot MAC, kept current by a watch. The boot plane asks
//! it on every DHCP packet, so lookups are a hash-map read. Hosts that share a boot MAC are all
//! kept; a lookup by MAC answers with the one that owns it ([`HostPools::mac_owner`]), so a
//! Host made later, or outside the operator's pools, cannot take a host off the network.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use futures_util::StreamExt;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use siteboot_boot::MacAddr;

use crate::context::key;
use crate::crd::Host;
use crate::pools::HostPools;

#[derive(Default)]
pub struct HostIndex {
    by_mac: RwLock<ByMac>,
    ready: AtomicBool,
    /// Which Host owns a shared boot MAC depends on the pools.
    pools: HostPools,
}

impl HostIndex {
    pub fn new(pools: HostPools) -> Arc<Self> {
        Arc::new(Self { pools, ..Self::default() })
    }

    /// The pools the index was made with (the machine reconciler's [`HostPools`] too).
    pub fn pools(&self) -> &HostPools {
        &self.pools
    }

    /// The Host that owns this boot MAC, if any has it.
    pub fn get(&self, mac: MacAddr) -> Option<Arc<Host>> {
        self.owner_in(self.by_mac.read().expect("host index lock").get(&mac)?)
    }

    /// The Hosts that own their boot MAC: one per MAC.
    pub fn owners(&self) -> Vec<Arc<Host>> {
        let index = self.by_mac.read().expect("host index lock");
        index.values().filter_map(|hosts| self.owner_in(hosts)).collect()
    }

    fn owner_in(&self, hosts: &[Arc<Host>]) -> Option<Arc<Host>> {
        // The common case, on every DHCP packet: one Host, nothing to compare.
        if let [only] = hosts {
            return Some(only.clone());
        }
        let owner = self.pools.mac_owner(hosts.iter().map(|h| &**h))?;
        hosts.iter().find(|h| std::ptr::eq(&***h, owner)).cloned()
    }

    /// The Host whose operation's token hashes to `token_hash` and came out of band (virtual
    /// media, or a kexec over SSH): such a host is known by what its BMC or its SSH server was
    /// given, wherever its address comes from (a routed network, another DHCP server).
    pub fn with_out_of_band_token(&self, token_hash: &str) -> Option<Arc<Host>> {
        let holds = |host: &Host| {
            let op = host.status.as_ref().and_then(|s| s.operation.as_ref());
            op.is_some_and(|op| {
                op.token_out_of_band() && op.token_hash.as_deref() == Some(token_hash)
            })
        };
        self.all().into_iter().find(|h| holds(h))
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

/// Hosts by boot MAC; more than one under a MAC is an error an operator or tenant must fix.
type ByMac = HashMap<MacAddr, Vec<Arc<Host>>>;

fn insert(map: &mut ByMac, host: Host) {
    let Ok(mac) = host.spec.boot_mac_address.parse::<MacAddr>() else {
        tracing::warn!(host = %host.name_any(), mac = %host.spec.boot_mac_address, "Host has an invalid boot MAC; ignored");
        return;
    };
    let hosts = map.entry(mac).or_default();
    hosts.retain(|h| h.uid() != host.uid());
    if let Some(other) = hosts.first() {
        tracing::error!(%mac, host = %key(&host), other = %key(&**other), "two Hosts share a boot MAC; only the one that owns it boots or is claimed");
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
    use crate::pools::Tenants;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn host(namespace: &str, name: &str, created: i64) -> Host {
        let mut h = Host::new(name, HostSpec::new("52:54:00:00:00:01"));
        h.metadata.namespace = Some(namespace.into());
        h.metadata.uid = Some(format!("{namespace}/{name}"));
        h.metadata.creation_timestamp =
            Some(Time(k8s_openapi::jiff::Timestamp::from_second(created).unwrap()));
        h
    }

    /// The boot plane's lookup and the status page follow the MAC's owner: a tenant's copy
    /// made before or after a pool's Host never answers for the MAC.
    #[test]
    fn a_shared_boot_mac_answers_with_its_owner() {
        let pools = HostPools::new([("pool".to_owned(), Tenants::Any)]);
        let index = HostIndex { pools, ..HostIndex::default() };
        let mac: MacAddr = "52:54:00:00:00:01".parse().unwrap();
        let add = |h: &Host| insert(&mut index.by_mac.write().unwrap(), h.clone());
        let planted = host("tenant", "planted", 10);
        add(&planted);
        assert_eq!(key(&*index.get(mac).unwrap()), "tenant/planted");
        let pooled = host("pool", "node-1", 20);
        add(&pooled);
        add(&pooled);
        assert_eq!(index.all().len(), 2, "an update of the same Host is no duplicate");
        assert_eq!(key(&*index.get(mac).unwrap()), "pool/node-1", "the pool's Host");
        add(&host("tenant", "copy", 30));
        assert_eq!(key(&*index.get(mac).unwrap()), "pool/node-1");
        let owners: Vec<String> = index.owners().iter().map(|h| key(&**h)).collect();
        assert_eq!(owners, ["pool/node-1"]);
        assert_eq!(index.sharing_mac(&pooled).len(), 2);
        remove(&mut index.by_mac.write().unwrap(), &pooled);
        assert_eq!(key(&*index.get(mac).unwrap()), "tenant/planted", "the oldest left");
    }

    /// A media-booted or kexec'ed ramdisk is found by its token, whatever address it asks
    /// from; a token that came over the network finds nothing this way.
    #[test]
    fn an_out_of_band_token_names_its_host() {
        use crate::crd::{HostStatus, Operation, OperationKind};
        let index = HostIndex::default();
        let (token, hash) = siteboot_agent_server::token::mint();
        let mut booted = host("metal", "media", 10);
        let operation = Operation {
            token_hash: Some(hash.clone()),
            virtual_media: true,
            ..Operation::new(OperationKind::Provision, "op".into(), crate::crd::now())
        };
        booted.status = Some(HostStatus { operation: Some(operation), ..Default::default() });
        insert(&mut index.by_mac.write().unwrap(), host("metal", "other", 5));
        insert(&mut index.by_mac.write().unwrap(), booted.clone());
        let found = index
            .with_out_of_band_token(&siteboot_agent_server::token::hash(&token))
            .expect("found by its token");
        assert_eq!(key(&*found), "metal/media");
        assert!(
            index.with_out_of_band_token(&siteboot_agent_server::token::hash("another")).is_none()
        );
        booted.status.as_mut().unwrap().operation.as_mut().unwrap().virtual_media = false;
        insert(&mut index.by_mac.write().unwrap(), booted.clone());
        assert!(index.with_out_of_band_token(&hash).is_none(), "a network boot's token");
        booted.status.as_mut().unwrap().operation.as_mut().unwrap().token_via_ssh = true;
        insert(&mut index.by_mac.write().unwrap(), booted);
        assert!(index.with_out_of_band_token(&hash).is_some(), "a kexec's token");
    }
}
